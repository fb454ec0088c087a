"""Stage 05 without a server: acceptance arithmetic from /metrics text, prompt loading, report round trip, plot."""

from __future__ import annotations

import json

import pytest

from eagle3pipe.config import ConfigError, load_config
from eagle3pipe.evaluate import load_eval_prompts, plot_acceptance, spec_decode_delta
from eagle3pipe.records import DataDir, FormatError, check_eval_report, load_eval_report, save_eval_report
from eagle3pipe.server import ServerMetrics, parse_prometheus_text


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
