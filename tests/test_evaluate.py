"""Stage 05 without a server: acceptance arithmetic (/metrics text, per-request counters), prompt loading, report
round trip, plot, and the command line of the servers it starts (recorded by a stand-in interpreter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3pipe.config import ConfigError, load_config
from eagle3pipe.evaluate import load_eval_prompts, plot_acceptance, spec_decode_delta
from eagle3pipe.records import DataDir, FormatError, check_eval_report, load_eval_report, save_eval_report
from eagle3pipe.server import ServerMetrics, parse_prometheus_text

ROOT = Path(__file__).resolve().parents[1]


def _metrics(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> ServerMetrics:
    """A /metrics scrape as vLLM 0.32 writes it (two engine label sets, summed by the parser)."""
    lines = ["# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
             "# TYPE vllm:spec_decode_num_drafts_total counter"]
    for engine, share in (("0", 0.75), ("1", 0.25)):
        def part(x):
            return x * share
        lines.append(f'vllm:spec_decode_num_drafts_total{{engine="{engine}",model_name="m"}} {part(drafts)}')
        lines.append(f'vllm:spec_decode_num_draft_tokens_total{{engine="{engine}",model_name="m"}} '
                     f'{part(draft_tokens)}')
        lines.append(f'vllm:spec_decode_num_accepted_tokens_total{{engine="{engine}",model_name="m"}} '
                     f'{part(accepted)}')
        for i, n in enumerate(per_pos):
            lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{engine}",model_name="m",'
                         f'position="{i}"}} {part(n)}')
    return ServerMetrics(url="x", taken_at=0.0, samples=parse_prometheus_text("\n".join(lines)))


def test_spec_decode_delta_matches_hand_computation():
    before = _metrics(100, 300, 120, [60, 40, 20])
    after = _metrics(500, 1500, 720, [340, 240, 140])  # deltas: 400 drafts, 1200 tokens, 600 accepted
    d = spec_decode_delta(before, after)
    assert (d["drafts"], d["draft_tokens"], d["accepted_tokens"]) == (400, 1200, 600)
    assert d["accepted_per_position"] == [280, 200, 120]
    assert d["acceptance_length"] == pytest.approx(1 + 600 / 400)
    assert d["per_position_acceptance"] == pytest.approx([0.7, 0.5, 0.3])
    assert d["draft_acceptance_rate"] == pytest.approx(0.5)
    # the per-position counts are the split of the accepted total: acceptance length = 1 + sum of position rates
    assert d["acceptance_length"] == pytest.approx(1 + sum(d["per_position_acceptance"]))


def test_spec_decode_delta_without_drafts_is_none_not_a_number():
    m = _metrics(10, 30, 5, [3, 2, 0])
    d = spec_decode_delta(m, m)
    assert d["acceptance_length"] is None and d["per_position_acceptance"] == []


def test_load_eval_prompts_cuts_at_last_user_turn_and_limits(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"id": "a", "messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "x"},
                                     {"role": "user", "content": "q2"}, {"role": "assistant", "content": "y"}]},
            {"conversations": [{"from": "human", "value": "hi"}]},
            {"id": "c", "messages": [{"role": "user", "content": "z"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = load_eval_prompts(path, 2)
    assert [p["id"] for p in prompts] == ["a", "line-2"]
    assert prompts[0]["messages"][-1] == {"role": "user", "content": "q2"} and len(prompts[0]["messages"]) == 3
    assert prompts[1]["messages"] == [{"role": "user", "content": "hi"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "narrator", "content": "x"}]}) + "\n")
    with pytest.raises(FormatError, match="bad.jsonl:1"):
        load_eval_prompts(bad, 5)
    with pytest.raises(FileNotFoundError, match="--prompts"):
        load_eval_prompts(tmp_path / "missing.jsonl", 5)


def _report(k: int = 3) -> dict:
    wd = spec_decode_delta(_metrics(0, 0, 0, [0] * k), _metrics(200, 200 * k, 250, [120, 80, 50][:k]))
    wd.update(tokens_per_s=90.0, completion_tokens=1000)
    return {"draft": "d", "verifier": "v", "num_prompts": 4, "num_speculative_tokens": k, "concurrency": 2,
            "temperature": 0.0, "with_draft": wd, "without_draft": {"tokens_per_s": 60.0}, "speedup": 1.5}


def test_eval_report_round_trip_markdown_and_plot(tmp_path):
    dd = DataDir(tmp_path)
    report = _report()
    save_eval_report(dd, report, "abc", {"evaluate": {}})
    loaded = load_eval_report(dd)
    assert loaded["with_draft"] == report["with_draft"] and loaded["config_hash"] == "abc"
    md = dd.eval_markdown.read_text()
    assert "| acceptance length (1 + accepted / drafts) | 2.250 |" in md  # 1 + 250 / 200
    assert "| 0 | 120 | 0.600 |" in md and "| 2 | 50 | 0.250 |" in md
    assert "| speedup | 1.500 |" in md
    plot_acceptance(report, dd.eval_plot)
    assert dd.eval_plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_check_eval_report_rejects_wrong_position_count():
    report = _report(k=3)
    report["num_speculative_tokens"] = 4
    with pytest.raises(FormatError, match="per-position"):
        check_eval_report(report)


def test_evaluate_config_requires_prompts(tmp_path):
    cfg = load_config(None, {"shared": {"verifier": str(tmp_path)}})
    with pytest.raises(ConfigError, match="--prompts"):
        cfg.validate("evaluate")
    cfg.evaluate.prompts = "p.jsonl"
    cfg.validate("evaluate")


# -- issue 12 item 7: per-request counters, servers started for a GPU box -------------------------------------------


def test_per_request_counters_sum_to_the_report_figures():
    from eagle3pipe.evaluate import per_request_delta

    # two responses' metrics.speculative_decoding as vLLM 0.32 returns them (k = 3): histogram entry j = verify steps
    # that accepted exactly j draft tokens
    a = {"num_spec_tokens": 3, "acceptance_histogram": [4, 3, 2, 1], "num_spec_steps": 10,
         "num_accepted_draft_tokens": 3 * 1 + 2 * 2 + 1 * 3, "num_draft_tokens": 30}
    b = {"num_spec_tokens": 3, "acceptance_histogram": [0, 0, 0, 5], "num_spec_steps": 5,
         "num_accepted_draft_tokens": 15, "num_draft_tokens": 15}
    d = per_request_delta([a, b])
    assert (d["drafts"], d["draft_tokens"], d["accepted_tokens"]) == (15, 45, 25)
    # position i accepted in every step that accepted more than i drafts
    assert d["accepted_per_position"] == [3 + 2 + 1 + 5, 2 + 1 + 5, 1 + 5]
    assert d["acceptance_length"] == pytest.approx(1 + 25 / 15, abs=1e-4)  # rounded to 4 places
    assert d["acceptance_length"] == pytest.approx(1 + sum(d["per_position_acceptance"]), abs=1e-3)


FAKE_VLLM = '''#!{python}
"""Stands in for the vLLM interpreter where a real one cannot run (a GPU build on this CPU machine): records the
command line and environment a server would get, answers the platform probe as told, never serves."""
import json, os, sys, time
if sys.argv[1] == "-c":
    answer = os.environ.get("FAKE_VLLM_PROBE")
    if answer:
        print("EAGLE3PIPE_PROBE " + answer)
    sys.exit(0 if answer else 1)
with open(os.environ["FAKE_VLLM_RECORD"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "kv_cache": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}}) + "\\n")
if os.environ.get("FAKE_VLLM_HANG"):
    time.sleep(600)
sys.exit(1)
'''


def _evaluate_with_fake_vllm(tmp_path, monkeypatch, capsys, env_extra: dict, *flags: str):
    """05_evaluate.py's door (run_stage with argv) against the stand-in interpreter; (exit code, stderr, starts)."""
    import sys

    from eagle3pipe.cli import run_stage
    from eagle3pipe.evaluate import run_evaluate
    from tests.test_draft_fixtures import make_flat_checkpoint

    tmp_path.mkdir(parents=True, exist_ok=True)
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_VLLM.format(python=sys.executable))
    fake.chmod(0o755)
    record = tmp_path / "record.jsonl"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    draft = make_flat_checkpoint(tmp_path / "draft")
    (tmp_path / "verifier").mkdir(exist_ok=True)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    for key in ("FAKE_VLLM_PROBE", "FAKE_VLLM_HANG"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"EAGLE3PIPE_VLLM_PYTHON": str(fake), "FAKE_VLLM_RECORD": str(record), **env_extra}.items():
        monkeypatch.setenv(key, value)
    code = run_stage("evaluate", "05_evaluate", run_evaluate, None, [
        "--data-dir", str(tmp_path / "data"), "--verifier", str(tmp_path / "verifier"), "--draft", str(draft),
        "--prompts", str(prompts), "--no-baseline", *flags])
    starts = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return code, capsys.readouterr().err, starts


GPU_BUILD = json.dumps({"cpu": False, "count": 8, "prm": True})
CPU_BUILD = json.dumps({"cpu": True, "count": 1, "prm": True})


def test_server_started_on_a_gpu_box_gets_no_cpu_settings_and_the_config_flags(tmp_path, monkeypatch, capsys):
    code, err, starts = _evaluate_with_fake_vllm(tmp_path, monkeypatch, capsys, {"FAKE_VLLM_PROBE": GPU_BUILD})
    assert code == 2 and "vLLM exited with status 1 during start-up" in err, err
    argv = starts[0]["argv"]
    assert "--enforce-eager" not in argv and starts[0]["kv_cache"] is None  # CUDA graphs on, no CPU KV setting
    assert argv[argv.index("--tensor-parallel-size") + 1] == "8"  # every GPU vLLM sees
    assert "--trust-remote-code" in argv  # shared.trust_remote_code (default true)
    assert argv[argv.index("--per-request-spec-decode-metrics") + 1] == "summary"
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 3
    # the same box, told otherwise: TP from the config, server_args replace the defaults, no remote code
    _, _, starts = _evaluate_with_fake_vllm(tmp_path / "b", monkeypatch, capsys, {"FAKE_VLLM_PROBE": GPU_BUILD},
                                            "--tensor-parallel-size", "4", "--server-args=--max-model-len=4096",
                                            "--no-trust-remote-code")
    argv = starts[0]["argv"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4" and "--max-model-len=4096" in argv
    assert "--trust-remote-code" not in argv


def test_cpu_settings_only_for_a_cpu_build_and_replaced_by_server_args(tmp_path, monkeypatch, capsys):
    _, _, starts = _evaluate_with_fake_vllm(tmp_path, monkeypatch, capsys, {"FAKE_VLLM_PROBE": CPU_BUILD})
    argv = starts[0]["argv"]
    assert "--enforce-eager" in argv and starts[0]["kv_cache"] == "1"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "1"
    _, _, starts = _evaluate_with_fake_vllm(tmp_path / "b", monkeypatch, capsys, {"FAKE_VLLM_PROBE": CPU_BUILD},
                                            "--server-args=--max-num-seqs=4")
    argv = starts[0]["argv"]
    assert "--enforce-eager" not in argv and "--max-num-seqs=4" in argv  # replaced, not added to
    # a platform named in the config wins over what the interpreter says (and works when it cannot say)
    _, err, starts = _evaluate_with_fake_vllm(tmp_path / "c", monkeypatch, capsys, {}, "--vllm-platform", "gpu",
                                              "--tensor-parallel-size", "2")
    assert "could not import vLLM" in err  # the probe failed: warned, then the config's platform
    argv = starts[0]["argv"]
    assert "--enforce-eager" not in argv and argv[argv.index("--tensor-parallel-size") + 1] == "2"
    code, err, _ = _evaluate_with_fake_vllm(tmp_path / "d", monkeypatch, capsys, {})
    assert code == 2 and "evaluate.vllm_platform" in err


def test_server_start_timeout_is_a_config_key(tmp_path, monkeypatch, capsys):
    code, err, starts = _evaluate_with_fake_vllm(tmp_path, monkeypatch, capsys,
                                                 {"FAKE_VLLM_PROBE": GPU_BUILD, "FAKE_VLLM_HANG": "1"},
                                                 "--server-start-timeout-s", "3")
    assert len(starts) == 1
    assert code == 2 and "vLLM did not answer within 3 s" in err, err
