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
def test_evaluate_starts_vllm_with_draft_and_measures(tmp_path, toy_llama, vllm_server):
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
                     "baseline_url": vllm_server.url,  # the session's plain server: no second start
                     "server_args": ["--max-model-len", "2048"]},
    })
    cfg.validate("evaluate")
    report = run_evaluate(cfg)
    wd = report["with_draft"]
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
