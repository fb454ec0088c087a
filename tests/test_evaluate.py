"""Stage 05 without a server: acceptance arithmetic (/metrics text, per-request counters), prompt sets (the known
benchmarks' schemas, seeded choice, the errors before any server starts), report round trip, plot, and the command
line of the servers it starts (recorded by a stand-in interpreter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3pipe.config import ConfigError, load_config
from eagle3pipe.cli import StageError
from eagle3pipe.eval_sets import KNOWN_SETS, choose, load_chat_prompts, load_eval_set, load_eval_sets
from eagle3pipe.acceptance import spec_decode_delta
from eagle3pipe.evaluate import plot_acceptance
from eagle3pipe.records import DataDir, FormatError
from eagle3pipe.records_eval import check_eval_report, load_eval_report, save_eval_report
from eagle3pipe.vllm_client import ServerMetrics, parse_prometheus_text

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


def test_load_chat_prompts_cuts_at_last_user_turn(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"id": "a", "messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "x"},
                                     {"role": "user", "content": "q2"}, {"role": "assistant", "content": "y"}]},
            {"conversations": [{"from": "human", "value": "hi"}]},
            {"id": "c", "messages": [{"role": "user", "content": "z"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = load_chat_prompts(path)
    assert [p["id"] for p in prompts] == ["a", "line-2", "c"]
    assert prompts[0]["messages"][-1] == {"role": "user", "content": "q2"} and len(prompts[0]["messages"]) == 3
    assert prompts[1]["messages"] == [{"role": "user", "content": "hi"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "narrator", "content": "x"}]}) + "\n")
    with pytest.raises(FormatError, match="bad.jsonl:1"):
        load_chat_prompts(bad)
    with pytest.raises(FileNotFoundError, match="--prompts"):
        load_chat_prompts(tmp_path / "missing.jsonl")


def test_choose_takes_the_same_number_by_seed_in_file_order():
    prompts = [{"id": str(i)} for i in range(50)]
    a, b, c = choose(prompts, 10, 0, "x"), choose(prompts, 10, 0, "x"), choose(prompts, 10, 1, "x")
    assert a == b and a != c and len(a) == len(c) == 10  # seeded: the same on every run, another seed another pick
    assert [int(p["id"]) for p in a] == sorted(int(p["id"]) for p in a)
    assert a != prompts[:10]  # chosen over the whole set, not its head
    assert choose(prompts, 0, 0, "x") == prompts  # 0 = all
    with pytest.raises(StageError, match="51 from every set"):
        choose(prompts, 51, 0, "x")
    with pytest.raises(StageError, match="empty"):
        choose([], 3, 0, "x")


# Rows in each real dataset's schema (the columns their dataset cards list; README 05_evaluate.py cites them), with
# toy questions of our own. Only the named field may be sent; the others must not leak into the prompt.
KNOWN_SCHEMA_ROWS = {
    "mtbench": [{"prompt": [f"Write a haiku about the number {i}.", "Now make it rhyme."], "prompt_id": 1000 + i,
                 "category": "writing", "reference": []} for i in range(5)],
    "gsm8k": [{"question": f"Tom has {i} apples and buys 3 more. How many now?", "answer": f"{i}+3={i + 3}\n#### "
               f"{i + 3}"} for i in range(5)],
    "humaneval": [{"task_id": f"HumanEval/{i}", "prompt": f"def add_{i}(x):\n    \"\"\"Add {i} to x.\"\"\"\n",
                   "canonical_solution": f"    return x + {i}\n", "test": "def check(c): pass",
                   "entry_point": f"add_{i}"} for i in range(5)],
    "math500": [{"problem": f"What is ${i}^2$?", "solution": f"${i * i}$", "answer": str(i * i),
                 "subject": "Algebra", "level": 1, "unique_id": f"test/algebra/{i}.json"} for i in range(5)],
}
FIELD_OF = {"mtbench": "prompt", "gsm8k": "question", "humaneval": "prompt", "math500": "problem"}


def test_known_sets_resolve_to_the_hub_ids_splits_and_fields_of_their_cards():
    assert {n: (s.dataset, s.config, s.split, s.field) for n, s in KNOWN_SETS.items()} == {
        "mtbench": ("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt"),
        "gsm8k": ("openai/gsm8k", "main", "test", "question"),
        "humaneval": ("openai/openai_humaneval", None, "test", "prompt"),
        "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem"),
    }


@pytest.mark.parametrize("name", sorted(KNOWN_SCHEMA_ROWS))
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_known_set_loader_reads_its_field_from_a_local_file_in_that_schema(tmp_path, name, suffix):
    """NAME=FILE goes through the same loader as the hub (datasets), only the source differs: the question sent is
    the card's field (MT-Bench: the first of its turns), as the only user turn."""
    import datasets

    rows = KNOWN_SCHEMA_ROWS[name]
    path = tmp_path / f"{name}_copy{suffix}"
    ds = datasets.Dataset.from_list(rows)
    ds.to_json(str(path)) if suffix == ".jsonl" else ds.to_parquet(str(path))
    s = load_eval_set(f"{name}={path}", num_prompts=0, seed=0)
    field = FIELD_OF[name]
    want = [r[field][0] if name == "mtbench" else r[field] for r in rows]
    assert s.name == name and s.size == len(rows) and s.source == str(path)
    assert [p["messages"] for p in s.prompts] == [[{"role": "user", "content": q}] for q in want]
    # the same file under another set's name lacks that set's field: named, with the columns found
    other = next(n for n in FIELD_OF if FIELD_OF[n] not in rows[0])
    with pytest.raises(StageError, match=f"no field '{FIELD_OF[other]}' \\(columns: "):
        load_eval_set(f"{other}={path}", num_prompts=0, seed=0)


def test_eval_set_errors_name_the_entry(tmp_path):
    with pytest.raises(StageError, match="unknown set 'mmlu' \\(known: mtbench, gsm8k, humaneval, math500"):
        load_eval_set("mmlu", 4, 0)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(StageError, match="empty.jsonl.*the set is empty"):
        load_eval_set(str(empty), 4, 0)
    with pytest.raises(StageError, match="file not found"):
        load_eval_set(f"gsm8k={tmp_path / 'nope.jsonl'}", 4, 0)
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"question": "  ", "answer": "1"}) + "\n")
    with pytest.raises(StageError, match="row 0 has no question text in 'question'"):
        load_eval_set(f"gsm8k={blank}", 0, 0)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
                             for i in range(3)))
    with pytest.raises(StageError, match="two sets named chats"):
        load_eval_sets([str(chats)], str(chats), 3, 0)
    sets = load_eval_sets([f"other={chats}"], str(chats), 2, 0)
    assert [s.name for s in sets] == ["chats", "other"] and all(len(s.prompts) == 2 for s in sets)


def _runs_and_acceptance(drafts: dict[str, dict[str, list[dict]]], levels=("1", "4")):
    """A report's runs/acceptance for drafts -> set -> per-request counters (the same at every level)."""
    from eagle3pipe.acceptance import per_request_delta, pooled_figures

    runs, acceptance = {}, {}
    for draft, per_set in drafts.items():
        runs[draft], acceptance[draft] = {}, {}
        for name, stats in per_set.items():
            passes = {c: {"requests": len(stats), "completion_tokens": 10, "wall_s": 1.0, "tokens_per_s": 10.0,
                          "acceptance_source": "per-request counters",
                          "per_request": [{"id": str(i), "speculative_decoding": st} for i, st in enumerate(stats)],
                          **per_request_delta(stats)} for c in levels}
            runs[draft][name] = {"by_concurrency": passes}
            acceptance[draft][name] = pooled_figures(list(passes.values()))
    return runs, acceptance


def _stat(hist: list[int]) -> dict:
    k = len(hist) - 1
    return {"num_spec_tokens": k, "acceptance_histogram": hist, "num_spec_steps": sum(hist),
            "num_draft_tokens": k * sum(hist), "num_accepted_draft_tokens": sum(j * n for j, n in enumerate(hist))}


def _report(k: int = 3) -> dict:
    runs, acceptance = _runs_and_acceptance({
        "draft": {"gsm8k": [_stat([2, 3, 4, 1][: k + 1])], "humaneval": [_stat([0, 1, 1, 8][: k + 1])]},
        "aq": {"gsm8k": [_stat([6, 2, 1, 1][: k + 1])], "humaneval": [_stat([5, 5, 0, 0][: k + 1])]}})
    tps = {col: {s: {"1": v, "4": 2 * v} for s in ("gsm8k", "humaneval")}
           for col, v in (("verifier alone", 50.0), ("draft", 100.0), ("aq", 60.0))}
    return {"verifier": "v", "num_prompts": 1, "num_speculative_tokens": k, "concurrency": [1, 4], "temperature": 0.0,
            "thinking": True, "benchmarks": [{"name": "gsm8k"}, {"name": "humaneval"}],
            "drafts": [{"name": "draft", "folder": "/d"}, {"name": "aq", "folder": "/aq"}],
            "acceptance": acceptance, "runs": runs, "tokens_per_s": tps,
            "speedup": {d: {s: {c: tps[d][s][c] / tps["verifier alone"][s][c] for c in ("1", "4")}
                            for s in ("gsm8k", "humaneval")} for d in ("draft", "aq")},
            "with_draft": acceptance["draft"]["gsm8k"]}


def test_eval_report_round_trip_markdown_and_plot(tmp_path):
    dd = DataDir(tmp_path)
    report = _report()
    save_eval_report(dd, report, "abc", {"evaluate": {}})
    loaded = load_eval_report(dd)
    assert loaded["acceptance"] == report["acceptance"] and loaded["config_hash"] == "abc"
    md = dd.eval_markdown.read_text()
    # rows = sets, columns = drafts; gsm8k/draft: 10 steps accepting 0*2 + 1*3 + 2*4 + 3*1 = 14 -> 1 + 14/10
    assert "| benchmark | draft | aq |" in md
    assert "| gsm8k | 2.400 | 1.700 |" in md and "| humaneval | 3.700 | 1.500 |" in md
    # per position: draft on gsm8k accepted position 0 in 8 of 10 steps, 1 in 5, 2 in 1
    assert "| gsm8k | 0.80 / 0.50 / 0.10 |" in md
    assert "### Tokens/s at concurrency 4" in md and "| benchmark | verifier alone | draft | aq |" in md
    assert "| gsm8k | 100.0 | 200.0 | 120.0 |" in md
    assert "### Speedup over the verifier alone at concurrency 1" in md and "| humaneval | 2.000 | 1.200 |" in md
    plot_acceptance(report, dd.eval_plot)
    assert dd.eval_plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decode_timings_and_step_costs_from_vllm_histograms(tmp_path):
    """Issue 46: 05's step timings are vLLM's own histograms between two scrapes (inter-token latency: one engine
    step; time per output token per finished request), and a speculation step's cost is its step over the verifier
    alone's at the same set and level; the acceptance length over that cost is the speedup it allows."""
    from eagle3pipe.evaluate import decode_timings, step_costs
    from eagle3pipe.vllm_client import ServerMetrics, parse_prometheus_text

    def scrape(itl_sum, itl_count, tpot_sum, tpot_count):
        text = "\n".join([
            "# TYPE vllm:inter_token_latency_seconds histogram",
            f'vllm:inter_token_latency_seconds_sum{{engine="0",model_name="m"}} {itl_sum}',
            f'vllm:inter_token_latency_seconds_count{{engine="0",model_name="m"}} {itl_count}',
            f'vllm:request_time_per_output_token_seconds_sum{{engine="0",model_name="m"}} {tpot_sum}',
            f'vllm:request_time_per_output_token_seconds_count{{engine="0",model_name="m"}} {tpot_count}', ""])
        return ServerMetrics(url="u", taken_at=0.0, samples=parse_prometheus_text(text))

    # 200 steps in 0.9 s, 4 requests finished with time per output token summing to 0.0096 s
    got = decode_timings(scrape(1.1, 50, 0.01, 2), scrape(2.0, 250, 0.0196, 6))
    assert got == {"step_ms": 4.5, "decode_steps": 200, "tpot_ms": 2.4}
    assert decode_timings(scrape(0, 0, 0, 0), scrape(0, 0, 0, 0)) == {"step_ms": None, "decode_steps": 0,
                                                                     "tpot_ms": None}
    runs = {"verifier alone": {"s": {"by_concurrency": {"1": {"step_ms": 2.0}, "8": {"step_ms": 2.5}}}},
            "draft": {"s": {"by_concurrency": {"1": {"step_ms": 3.0}, "8": {"step_ms": None}}}}}
    costs = step_costs(runs, {"draft": {"s": {"1": 3.3, "8": 3.1}}}, ["draft"], ["1", "8"])
    assert costs["draft"]["s"]["1"] == {"step_cost": 1.5, "acceptance_length": 3.3, "speedup_allowed": 2.2}
    assert costs["draft"]["s"]["8"]["step_cost"] is None and costs["draft"]["s"]["8"]["speedup_allowed"] is None
    # the report's markdown shows them, and the published wall-clock figures with their settings
    import dataclasses

    from eagle3pipe.anchors import WALL_CLOCK

    report = _report()
    report["decode_timings"] = {col: {s: {c: {"step_ms": 2.0 * (col != "verifier alone") + 2.0, "tpot_ms": 1.0}
                                          for c in ("1", "4")} for s in ("gsm8k", "humaneval")}
                                for col in ("verifier alone", "draft", "aq")}
    report["step_costs"] = {d: {s: {c: {"step_cost": 2.0, "acceptance_length": 3.0, "speedup_allowed": 1.5}
                                    for c in ("1", "4")} for s in ("gsm8k", "humaneval")} for d in ("draft", "aq")}
    report["wall_clock_anchors"] = [dataclasses.asdict(a) for a in WALL_CLOCK]
    save_eval_report(DataDir(tmp_path), report, "abc", {})
    md = DataDir(tmp_path).eval_markdown.read_text()
    assert "| gsm8k | 2.00 / 1.00 | 4.00 / 1.00 | 4.00 / 1.00 |" in md  # step / time per output token, ms
    assert "| gsm8k | 2.000 / 1.500 | 2.000 / 1.500 |" in md
    assert "| EAGLE-3 MLA, k = 3 | Kimi-K2.5 INT4 | 16 | 1.23 | vLLM 0.21.0, 8 x H200, concurrency 16, 1024 in " \
           "/ 512 out;" in md
    assert "Ours (concurrency 1 / 4): draft 2.00 / 2.00 on gsm8k" in md
    # drafts at their own k (a DFlash draft beside EAGLE-3): the columns are labelled with it, in these tables too
    for per_set in report["acceptance"]["aq"].values():
        per_set["per_position_acceptance"] = []
    report["num_speculative_tokens_by_draft"] = {"draft": 3, "aq": 7}
    save_eval_report(DataDir(tmp_path), report, "abc", {})
    md = DataDir(tmp_path).eval_markdown.read_text()
    assert "| benchmark | verifier alone | draft (k=3) | aq (k=7) |" in md
    assert "| gsm8k | 2.00 / 1.00 | 4.00 / 1.00 | 4.00 / 1.00 |" in md and "| gsm8k | 2.000 / 1.500 | 2.000 / 1.500 |" in md


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
    cfg = load_config(None, {"shared": {"verifier": str(tmp_path)}, "evaluate": {"benchmarks": ["gsm8k"]}})
    cfg.validate("evaluate")  # named sets alone are enough


def test_concurrency_is_a_list_of_levels(tmp_path):
    from eagle3pipe.config import parse_stage_args

    base = ["--verifier", str(tmp_path), "--benchmarks", "gsm8k", "math500"]
    assert parse_stage_args("evaluate", base + ["--concurrency", "1", "8", "16"]).evaluate.concurrency == [1, 8, 16]
    assert parse_stage_args("evaluate", base).evaluate.benchmarks == ["gsm8k", "math500"]
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text("evaluate:\n  concurrency: 4\n")  # one level, written as a number
    assert parse_stage_args("evaluate", base + ["--config", str(cfg_path)]).evaluate.concurrency == [4]
    for bad in (["0", "4"], ["4", "4"]):
        with pytest.raises(ConfigError, match="evaluate.concurrency"):
            parse_stage_args("evaluate", base + ["--concurrency", *bad])
    flags = base + ["--baseline-draft", "/a", "--baseline-draft", "old=/b"]
    assert parse_stage_args("evaluate", flags).evaluate.baseline_draft == ["/a", "old=/b"]


# -- issue 12 item 7: per-request counters, servers started for a GPU box -------------------------------------------


def test_per_request_counters_sum_to_the_report_figures():
    from eagle3pipe.acceptance import per_request_delta

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
    f.write(json.dumps({{"argv": sys.argv[1:], "kv_cache": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
                        "v2_runner": os.environ.get("VLLM_USE_V2_MODEL_RUNNER")}}) + "\\n")
if os.environ.get("FAKE_VLLM_HANG"):
    time.sleep(600)
if os.environ.get("FAKE_VLLM_LOG"):  # what a failing start printed (a real one's log)
    sys.stdout.write(open(os.environ["FAKE_VLLM_LOG"]).read())
    sys.stdout.flush()
sys.exit(1)
'''


def _evaluate_with_fake_vllm(tmp_path, monkeypatch, capsys, env_extra: dict, *flags: str, verifier: Path | None = None,
                             hidden_size_flag: bool = True):
    """05_evaluate.py's door (run_stage with argv) against the stand-in interpreter; (exit code, stderr, starts).
    The verifier: ``verifier``, else a folder holding a Llama config.json of hidden size 128 (the toy drafts')."""
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
    if verifier is None:
        verifier = tmp_path / "verifier"
        verifier.mkdir(exist_ok=True)
        (verifier / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128}))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    for key in ("FAKE_VLLM_PROBE", "FAKE_VLLM_HANG"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"EAGLE3PIPE_VLLM_PYTHON": str(fake), "FAKE_VLLM_RECORD": str(record), **env_extra}.items():
        monkeypatch.setenv(key, value)
    code = run_stage("evaluate", "05_evaluate", run_evaluate, None, [
        "--data-dir", str(tmp_path / "data"), "--verifier", str(verifier), "--draft", str(draft),
        "--prompts", str(prompts), "--num-prompts", "1", *(["--hidden-size", "128"] if hidden_size_flag else []),
        "--no-baseline", *flags])
    starts = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return code, capsys.readouterr().err, starts


# the shape of a failed start as vLLM 0.26 logged it on the H200 (2026-12-02: an EAGLE-3 server of stage 05): the
# engine's lines say why; the API server's traceback, which ends the log, says only "See root cause above"
ENGINE = "(EngineCore_DP0 pid=3390) ERROR 12-02 13:08:30 [core.py:1010] "
ENGINE_FAILED_LOG = ("(APIServer pid=3320) INFO 12-02 13:06:50 [api_server.py:1] vLLM API server version 0.26.0\n"
                     f"{ENGINE}EngineCore failed to start.\n{ENGINE}Traceback (most recent call last):\n"
                     + "".join(f'{ENGINE}  File "/tmp/site/vllm/x.py", line {i}\n' for i in range(30))
                     + f"{ENGINE}ValueError: the draft's KV cache does not fit\n"
                     + "".join(f'(APIServer pid=3320)   File "/tmp/site/vllm/v1/engine/core_client.py", line {i}\n'
                               for i in range(40))
                     + "(APIServer pid=3320) RuntimeError: Engine core initialization failed. See root cause above.\n")


def test_a_failed_start_names_the_engine_s_cause_not_only_the_log_s_last_lines(tmp_path, monkeypatch, capsys):
    """A vLLM that fails in its engine process ends its log with the API server's traceback ("See root cause
    above"): the error line must carry the engine's own lines (seen on the H200: 30 lines of the API server's
    traceback and no cause), and the exception the engine raised first, however deep its traceback (seen on this
    machine: 30 lines of the worker's traceback quoted, not its last, "RuntimeError: expect weight to be ...")."""
    log = tmp_path / "vllm_failed.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(ENGINE_FAILED_LOG)
    code, err, starts = _evaluate_with_fake_vllm(tmp_path / "run", monkeypatch, capsys,
                                                 {"FAKE_VLLM_PROBE": CPU_BUILD, "FAKE_VLLM_LOG": str(log)})
    assert code == 2 and len(starts) == 1, err
    assert "ValueError: the draft's KV cache does not fit" in err, err
    assert "EngineCore failed to start." in err and "See root cause above" in err  # the cause, then the end


GPU_BUILD = json.dumps({"cpu": False, "count": 8, "prm": True})
CPU_BUILD = json.dumps({"cpu": True, "count": 1, "prm": True})


def test_server_started_on_a_gpu_box_gets_no_cpu_settings_and_the_config_flags(tmp_path, monkeypatch, capsys):
    code, err, starts = _evaluate_with_fake_vllm(tmp_path, monkeypatch, capsys, {"FAKE_VLLM_PROBE": GPU_BUILD})
    assert code == 2 and "vLLM exited with status 1 during start-up" in err, err
    assert "error: draft 'draft' (" in err  # which draft's server failed
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


def test_before_vllm_0_29_a_gpu_serves_a_draft_of_other_attention_geometry_on_flex_and_the_v1_runner(
        tmp_path, monkeypatch, capsys):
    """vLLM < 0.29 plans FlashAttention-3 for the draft with the verifier's heads, KV heads and head size, and a
    draft of another geometry dies at start-up (seen on the H200 with 0.26: "scheduler_metadata must have shape");
    its V2 model runner ignores the draft's own attention_backend. 05 asks for FlexAttention for the draft and the
    V1 runner exactly there: a GPU build before 0.29 and a geometry that differs, MLA always (one latent "head")."""
    from tests.test_draft_fixtures import DRAFT_HEAD_DIM, DRAFT_HEADS, DRAFT_KV_HEADS, TOY_HIDDEN

    same = {"model_type": "llama", "hidden_size": TOY_HIDDEN, "num_attention_heads": DRAFT_HEADS,
            "num_key_value_heads": DRAFT_KV_HEADS, "head_dim": DRAFT_HEAD_DIM}
    mla = {"model_type": "deepseek_v3", "hidden_size": TOY_HIDDEN, "num_attention_heads": DRAFT_HEADS,
           "num_key_value_heads": DRAFT_HEADS, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
           "v_head_dim": 128}
    cases = [  # (verifier config, vLLM build, CPU build, flags, expected draft backend, VLLM_USE_V2_MODEL_RUNNER)
        (same | {"num_key_value_heads": DRAFT_HEADS}, "0.26.0", False, (), "FLEX_ATTENTION", "0"),
        (same | {"head_dim": 2 * DRAFT_HEAD_DIM}, "0.28.0", False, (), "FLEX_ATTENTION", "0"),
        (mla, "0.26.0", False, (), "FLEX_ATTENTION", "0"),
        (same, "0.26.0", False, (), None, None),  # the same geometry: FlashAttention-3 plans it right
        (mla, "0.29.0", False, (), None, None),  # fixed there (vllm#53336)
        (mla, "0.26.0", True, (), None, None),  # a CPU build
        (mla, "0.26.0", False, ("--draft-attention-backend", "none"), None, None),
        (same, "0.33.0", False, ("--draft-attention-backend", "TRITON_ATTN"), "TRITON_ATTN", None),
        (same, "0.27.1", False, ("--draft-attention-backend", "TRITON_ATTN"), "TRITON_ATTN", "0"),
        # vLLM 0.34: Model Runner V2 alone, and it refuses to start with VLLM_USE_V2_MODEL_RUNNER=0 (issue 49)
        (mla, "0.34.0", False, (), None, None),
        (same, "0.34.0", False, ("--draft-attention-backend", "TRITON_ATTN"), "TRITON_ATTN", None),
    ]
    for i, (config, version, cpu, flags, backend, v2_runner) in enumerate(cases):
        verifier = tmp_path / f"verifier{i}"
        verifier.mkdir(parents=True)
        (verifier / "config.json").write_text(json.dumps(config))
        probe = json.dumps({"cpu": cpu, "count": 1, "prm": True, "version": version})
        _, err, starts = _evaluate_with_fake_vllm(tmp_path / f"run{i}", monkeypatch, capsys,
                                                  {"FAKE_VLLM_PROBE": probe}, *flags, verifier=verifier)
        argv = starts[0]["argv"]
        spec = json.loads(argv[argv.index("--speculative-config") + 1])
        assert (spec.get("attention_backend"), starts[0]["v2_runner"]) == (backend, v2_runner), (i, err)
        assert ("vllm#53336" in err) == (backend == "FLEX_ATTENTION"), (i, err)  # the warning says why
    code, err, _ = _evaluate_with_fake_vllm(tmp_path / "bad", monkeypatch, capsys, {"FAKE_VLLM_PROBE": GPU_BUILD},
                                            "--draft-attention-backend", "flex")
    assert code == 2 and "evaluate.draft_attention_backend" in err, err
    # a DFlash draft (issue 47): vLLM < 0.29 plans its layers with the verifier's geometry as well, so it gets the
    # same workaround there (FlexAttention serves non-causal layers); from 0.29 vLLM chooses its backend itself
    from eagle3pipe import draft_dflash
    from eagle3pipe.config import load_config
    from eagle3pipe.evaluate import draft_serving, speculative_config

    mla = tmp_path / "mla_verifier"
    mla.mkdir()
    (mla / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "num_attention_heads": 64,
                                                 "kv_lora_rank": 512, "qk_rope_head_dim": 64, "hidden_size": 7168}))
    cfg = load_config(None, {"shared": {"verifier": str(mla)}})
    dflash = {"speculators_model_type": draft_dflash.SPECULATORS_TYPE, "transformer_layer_config": {
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 7168}}
    assert draft_serving(cfg, dflash, "gpu", "0.26.0") == ("FLEX_ATTENTION", {"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert draft_serving(cfg, dflash, "gpu", "0.29.0") == (None, {})
    assert draft_serving(cfg, dflash, "gpu", "0.34.0") == (None, {})
    from eagle3pipe.evaluate import v1_runner_env

    assert v1_runner_env("0.28.0") == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert v1_runner_env("0.34.0") == v1_runner_env("0.34.1") == {}  # the V1 runner is gone there
    # on vllm-cpu no FlashAttention-3; the verifier runs as MHA beside a draft without MLA (cpu_mla_setting)
    assert draft_serving(cfg, dflash, "cpu", "0.26.0") == (None, {"VLLM_MLA_DISABLE": "1"})
    folder = tmp_path / "dflash_draft"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**dflash, "speculators_config": {
        "proposal_methods": [{"speculative_tokens": 7}]}}))
    assert json.loads(speculative_config(folder, 3, "FLEX_ATTENTION")) == {
        "method": "dflash", "model": str(folder), "num_speculative_tokens": 7, "attention_backend": "FLEX_ATTENTION"}


def test_before_vllm_0_29_the_release_shaped_k25_verifier_gets_the_draft_on_flex(tmp_path, monkeypatch, capsys,
                                                                                 toy_kimi):
    """The same rule read through the release's layout (KimiK25 wrapper, nested kimi_k2 text config, remote-code
    tokenizer): 05 unwraps the verifier's MLA geometry and serves the draft on FlexAttention with the V1 runner."""
    probe = json.dumps({"cpu": False, "count": 1, "prm": True, "version": "0.26.0"})
    _, err, starts = _evaluate_with_fake_vllm(tmp_path, monkeypatch, capsys, {"FAKE_VLLM_PROBE": probe},
                                              verifier=toy_kimi)
    argv = starts[0]["argv"]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert (spec.get("attention_backend"), starts[0]["v2_runner"]) == ("FLEX_ATTENTION", "0"), err
    assert "--trust-remote-code" in argv and "576" in err  # its geometry named in the warning: one 512 + 64 latent


def test_server_start_timeout_is_a_config_key(tmp_path, monkeypatch, capsys):
    code, err, starts = _evaluate_with_fake_vllm(tmp_path, monkeypatch, capsys,
                                                 {"FAKE_VLLM_PROBE": GPU_BUILD, "FAKE_VLLM_HANG": "1"},
                                                 "--server-start-timeout-s", "3")
    assert len(starts) == 1
    assert code == 2 and "vLLM did not answer within 3 s" in err, err


# -- issue 20: every error knowable before a server starts is one line, and no server starts ------------------------


def _refused_drafts(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Draft folders vLLM would refuse (or serve wrongly), each with the words its error must hold."""
    from safetensors.torch import load_file, save_file

    from tests.test_draft_fixtures import make_flat_checkpoint

    out = {}
    d = make_flat_checkpoint(tmp_path / "plain_llama")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    out["plain_llama"] = (d, "is not an EAGLE-3 draft")
    d = make_flat_checkpoint(tmp_path / "wide")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "hidden_size": 256}))
    out["wide"] = (d, "hidden_size 256, the verifier's is 128")
    d = make_flat_checkpoint(tmp_path / "no_fc")
    weights = load_file(str(d / "model.safetensors"))
    del weights["fc.weight"]
    save_file(weights, str(d / "model.safetensors"))
    out["no_fc"] = (d, "tensor 'fc.weight' missing")
    d = make_flat_checkpoint(tmp_path / "no_weights")
    (d / "model.safetensors").unlink()
    out["no_weights"] = (d, "no *.safetensors weights")
    (tmp_path / "empty").mkdir()
    out["empty"] = (tmp_path / "empty", "config.json missing")
    return out


def test_errors_before_any_server_starts(tmp_path, monkeypatch, capsys):
    """An unknown set, a set lacking its field, too few prompts, and draft folders vLLM would refuse (as --draft
    or as --baseline-draft): each one `error:` line naming the culprit, and the stand-in vLLM never started."""
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    cases = [(["--benchmarks", "mmlu"], "unknown set 'mmlu'"),
             (["--benchmarks", f"gsm8k={gsm}"], "no field 'question' (columns: problem, answer)"),
             (["--num-prompts", "2"], "1 prompts, evaluate.num_prompts asks 2")]
    for name, (folder, words) in _refused_drafts(tmp_path / "drafts").items():
        cases.append((["--baseline-draft", str(folder)], words))
        if name == "wide":
            cases.append((["--draft", str(folder)], words))
    for i, (flags, words) in enumerate(cases):
        code, err, starts = _evaluate_with_fake_vllm(tmp_path / f"c{i}", monkeypatch, capsys,
                                                     {"FAKE_VLLM_PROBE": CPU_BUILD}, *flags)
        assert code == 2 and starts == [], (flags, err)
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and words in lines[0], (flags, err)


def test_a_draft_is_judged_against_the_served_verifiers_own_hidden_size(tmp_path, monkeypatch, capsys, toy_kimi):
    """Issue 26 item 12: `05 --verifier X --draft Y` without --hidden-size compared Y with shared.hidden_size's
    default (7168) and refused a draft that fits X ("the verifier's is 7168 ... a draft for another target"). The
    verifier's own config.json is the truth (K2.5's nested text_config included): a fitting draft goes on to the
    server start, a wider one is refused naming the verifier's config and its hidden size."""
    from tests.test_draft_fixtures import TOY_HIDDEN

    plain, wrapped = tmp_path / "plain", tmp_path / "wrapped"
    for root, verifier in ((plain, None), (wrapped, toy_kimi)):
        code, err, starts = _evaluate_with_fake_vllm(root, monkeypatch, capsys, {"FAKE_VLLM_PROBE": CPU_BUILD},
                                                     verifier=verifier, hidden_size_flag=False)
        (error,) = [line for line in err.splitlines() if line.startswith("error:")]
        assert "vLLM exited with status 1 during start-up" in error and len(starts) == 1, err  # checked, started
    wide = _refused_drafts(tmp_path / "drafts")["wide"][0]
    code, err, starts = _evaluate_with_fake_vllm(tmp_path / "k25_wide", monkeypatch, capsys,
                                                 {"FAKE_VLLM_PROBE": CPU_BUILD}, "--draft", str(wide),
                                                 verifier=toy_kimi, hidden_size_flag=False)
    assert code == 2 and starts == []
    assert f"hidden_size 256, the verifier's is {TOY_HIDDEN} ({toy_kimi / 'config.json'})" in err, err


def test_draft_provenance_and_the_anchors_figures(tmp_path):
    """Issue 29: 05's report says where each draft came from (04's provenance.json: beside final/, inside an
    --export-from folder; nothing for a folder 04 did not write) and, for the named benchmarks, the anchors'
    published acceptance lengths (REFERENCE.md's) with their settings."""
    import time

    from eagle3pipe.anchors import acceptance_anchors as anchor_figures
    from eagle3pipe.evaluate import draft_provenance
    from eagle3pipe.records import write_provenance

    checkpoints = tmp_path / "checkpoints"
    for folder in ("final", "export_step_4", "a_copy"):
        (checkpoints / folder).mkdir(parents=True)
    counts = {"steps": 10, "trained_steps": 12, "rows_per_step": 8, "samples": 100, "train_samples": 40,
              "export": "best"}  # train_samples: train.max_samples 40 of the split
    write_provenance(checkpoints / "provenance.json", stage="train", config_hash="abc123", config={}, inputs=[],
                     counts=counts, started=time.time())
    write_provenance(checkpoints / "export_step_4" / "provenance.json", stage="train", config_hash="abc123",
                     config={}, inputs=[], counts={"steps": 4, "rows_per_step": 8, "samples": 100,
                                                   "export": "export_from step_4"}, started=time.time())
    final = draft_provenance(checkpoints / "final")
    assert {k: final[k] for k in ("steps", "trained_steps", "rows_per_step", "samples", "train_samples", "export",
                                  "config_hash")} == {**counts, "config_hash": "abc123"}
    step4 = draft_provenance(checkpoints / "export_step_4")
    assert step4["steps"] == step4["trained_steps"] == 4 and step4["export"] == "export_from step_4"
    assert step4["train_samples"] is None  # a provenance written without the count (--export-from's) names none
    assert draft_provenance(checkpoints / "a_copy") is None  # checkpoints/provenance.json is final/'s alone
    assert draft_provenance(tmp_path) is None and draft_provenance(None) is None
    anchors = anchor_figures(["gsm8k", "held_out", "mtbench"], 3)
    # issue 47: the figures of eagle3pipe/anchors.py, the one table the page quotes too, each with its source (the
    # AQ-MedAI figures are its model card's, which has no MT-Bench; the report printed another source's before)
    assert [(a["draft"], a["acceptance_length"]) for a in anchors] == [
        ("lightseekorg/kimi-k2.5-eagle3", {"gsm8k": 3.201, "mtbench": 2.687}),
        ("lightseekorg/kimi-k2.5-eagle3-mla", {"gsm8k": 3.017, "mtbench": 2.940}),
        ("AQ-MedAI/Kimi-K2-Instruct-eagle3", {"gsm8k": 3.165})]
    assert all("k = 3" in a["settings"] and not a["note"] and "model card" in a["source"] for a in anchors)
    assert [a["draft"] for a in anchor_figures(["gsm8k"], 7)][-1] == "z-lab/Kimi-K2.5-DFlash"  # DFlash at its k
    assert "not comparable" in anchor_figures(["math500"], 5)[0]["note"]
    assert anchor_figures(["held_out"], 3) == []
