"""Factories for the vocab / draft / train tests: AQ-MedAI-format draft checkpoints, training rows, hidden states.

Everything is tiny and seeded. Hidden states are written with records.py's stage-02 functions, so the trainer
reads exactly the format stage 02 produces.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3pipe.config import load_config
from eagle3pipe.records import (
    DataDir,
    HiddenStatesManifest,
    TrainingRow,
    hs_file_metadata,
    hs_layer_ids,
    save_hidden_states,
    save_hs_manifest,
    save_hs_rows,
    write_jsonl_atomic,
    write_synthetic_provenance,
)

TOY_VOCAB = 1088
TOY_HIDDEN = 128
TOY_AUX = [2, 4, 5]
DRAFT_VOCAB = 256
# the crafted draft's attention differs from the toy verifier's (4 x 32) on purpose: head_dim must come from the
# checkpoint's own config; 64 >= 32 keeps vLLM's CPU attention happy
DRAFT_HEADS, DRAFT_KV_HEADS, DRAFT_HEAD_DIM, DRAFT_INTER = 4, 2, 64, 384


def map_from_targets(targets: list[int], vocab_size: int = TOY_VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a draft vocabulary given by its target ids."""
    ids = torch.tensor(sorted(targets), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.shape[0]), t2d


def make_flat_checkpoint(folder: Path, targets: list[int] | None = None, seed: int = 0,
                         aux_layer_ids: list[int] | None = None, dtype=torch.bfloat16,
                         vocab_size: int = TOY_VOCAB) -> Path:
    """An AQ-MedAI / SpecForge-format draft (LlamaForCausalLMEagle3, midlayer.*, no embedding) at tiny dims, for a
    verifier of ``vocab_size`` (the fast-tokenizer toys'; the release-shaped kimi_k25 toy has more rows)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h, n = TOY_HIDDEN, DRAFT_VOCAB
    targets = targets if targets is not None else list(range(0, 2 * n, 2))
    d2t, t2d = map_from_targets(targets, vocab_size)

    def mat(rows: int, cols: int) -> torch.Tensor:  # scaled so each part of the layer moves the output visibly
        return (torch.randn(rows, cols, generator=g) / cols**0.5).to(dtype)

    def norm() -> torch.Tensor:
        return (1.0 + 0.3 * torch.randn(h, generator=g)).to(dtype)

    q, kv = DRAFT_HEADS * DRAFT_HEAD_DIM, DRAFT_KV_HEADS * DRAFT_HEAD_DIM
    tensors = {
        "fc.weight": mat(h, 3 * h),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": mat(q, 2 * h),
        "midlayer.self_attn.k_proj.weight": mat(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": mat(kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": mat(h, q),
        "midlayer.mlp.gate_proj.weight": mat(DRAFT_INTER, h),
        "midlayer.mlp.up_proj.weight": mat(DRAFT_INTER, h),
        "midlayer.mlp.down_proj.weight": mat(h, DRAFT_INTER),
        "norm.weight": norm(),
        "lm_head.weight": mat(n, h),
        "d2t": d2t,
        "t2d": t2d,
    }
    config = {  # the fields AQ-MedAI's Kimi-K2 draft config carries, at toy sizes
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "bos_token_id": 1008,
        "eos_token_id": 1009,
        "hidden_act": "silu",
        "hidden_size": h,
        "intermediate_size": DRAFT_INTER,
        "num_attention_heads": DRAFT_HEADS,
        "num_key_value_heads": DRAFT_KV_HEADS,
        "head_dim": DRAFT_HEAD_DIM,
        "num_hidden_layers": 1,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": vocab_size,
        "draft_vocab_size": n,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids or TOY_AUX, "use_aux_hidden_state": True},
    }
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def make_rows(num_rows: int, seed: int = 0, min_len: int = 20, max_len: int = 60) -> list[TrainingRow]:
    """Rows with Zipf-like token ids (so a top-N vocabulary is meaningful) and a prompt/completion loss mask."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(TOY_VOCAB - 80)]  # ids past 1008 are the toy's specials/padding
    rows = []
    for r in range(num_rows):
        n = rng.randint(min_len, max_len)
        ids = rng.choices(range(TOY_VOCAB - 80), weights=weights, k=n)
        ids = [rng.randrange(TOY_VOCAB - 80) if rng.random() < 0.1 else t for t in ids]
        prompt = rng.randint(3, n // 2)
        rows.append(TrainingRow(id=f"r{r}", input_ids=ids, loss_mask=[0] * prompt + [1] * (n - prompt), source="t"))
    return rows


def write_rows(data_dir: Path, rows: list[TrainingRow], which: str = "synthetic") -> Path:
    """Rows as stage 01 or a finished stage 01b leaves them (01b's provenance included: 02/03 check it)."""
    dd = DataDir(data_dir)
    path = dd.synthetic_data if which == "synthetic" else dd.prepared_data
    write_jsonl_atomic(path, [r.to_json() for r in rows])
    if which == "synthetic":
        write_synthetic_provenance(dd, config_hash="test", config={}, counts={}, started=time.time())
    return path


def write_hidden_states(data_dir: Path, verifier: Path, rows: list[TrainingRow], storage_dtype: str = "bf16",
                        seed: int = 0, aux_layer_ids: list[int] = TOY_AUX) -> None:
    """Stage 02's output for ``rows`` (random states [T, len(aux_layer_ids) + 1, H]), through records.py's own
    writers."""
    dd = DataDir(data_dir)
    g = torch.Generator().manual_seed(seed)
    tokens = 0
    for i, row in enumerate(rows):
        t = len(row.input_ids)
        states = torch.randn(t, len(aux_layer_ids) + 1, TOY_HIDDEN, generator=g).to(torch.bfloat16)
        save_hidden_states(dd.hs_file(i), states, torch.tensor(row.input_ids), storage_dtype,
                           metadata=hs_file_metadata(hs_layer_ids(aux_layer_ids, 8), 8))
        tokens += t
    save_hs_rows(dd.hidden_states, [(r.input_ids, r.loss_mask) for r in rows])
    save_hs_manifest(dd.hs_manifest, HiddenStatesManifest(
        verifier=str(verifier), num_layers=8, aux_layer_ids=list(aux_layer_ids), hidden_size=TOY_HIDDEN,
        model_dtype="bfloat16",
        storage_dtype=storage_dtype, num_samples=len(rows), num_tokens=tokens, num_dropped=0, bytes=0,
        input=str(dd.synthetic_data), config_hash="test"))


def toy_config(data_dir: Path, verifier: Path, **train):
    """A PipelineConfig for the toy verifier, with train-section overrides."""
    base = {"total_seq_len": 256, "epochs": 2, "eval_fraction": 0.2, "num_workers": 0, "log_every": 1,
            "checkpoint_every": 1000, "device": "cpu", "learning_rate": 1e-3, "draft_num_heads": 4,
            "draft_num_kv_heads": 4, "draft_head_dim": 64, "draft_intermediate_size": 256}
    base.update(train)
    return load_config(None, {
        "shared": {"data_dir": str(data_dir), "verifier": str(verifier), "aux_layer_ids": TOY_AUX,
                   "max_seq_len": base["total_seq_len"],
                   "hidden_size": TOY_HIDDEN, "vocab_size": TOY_VOCAB, "draft_vocab_size": DRAFT_VOCAB,
                   "progress_every_s": 1000.0, "think_token_id": 1020, "response_token_id": 1021},
        "train": base,
    })


# a tiny DFlash draft for the llama toys (4 heads x 32, 2 KV heads, 2 layers, block 4); "[PAD]" (1023) is the
# fast-tokenizer toy's only special token never in the rows (it has no [UNK])
DFLASH_TRAIN = {"draft": "dflash", "dflash_num_layers": 2, "dflash_num_kv_heads": 2, "draft_head_dim": 32,
                "dflash_block_size": 4}
TOY_MASK_TOKEN, TOY_MASK_ID = "[PAD]", 1023


def dflash_config(data_dir: Path, verifier: Path, **train):
    """toy_config for a DFlash draft (DFLASH_TRAIN under ``train``), its mask token named."""
    cfg = toy_config(data_dir, verifier, **{**DFLASH_TRAIN, **train})
    cfg.vocab.mask_token = TOY_MASK_TOKEN
    return cfg


@pytest.fixture
def toy_rows() -> list[TrainingRow]:
    return make_rows(30, seed=1)
