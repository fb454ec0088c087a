"""DFlash drafts (issue 31) on CPU: one extraction of the union of layers serves both drafts; a z-lab-format draft
converted by a warm start computes what z-lab's published forward computes; the export, read back by vLLM's own
speculators adapter (in .venv-vllm), names the layers 02 captured, the mask token 03 resolved, its k and a
non-causal block; YaRN's attention factor agrees between training and vLLM; a resumed run repeats the
uninterrupted one (each packed row's anchors seeded by its place in the packing)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3pipe.config import load_config
from eagle3pipe.extract import run_extract
from eagle3pipe.records import DataDir, load_hidden_states, load_hs_manifest, read_jsonl
from eagle3pipe.records_vocab import load_vocab_summary
from eagle3pipe.server import default_vllm_python
from eagle3pipe.train import build_data, run_train
from eagle3pipe.train_batches import EpochBatches, make_loader, packed_batches
from eagle3pipe.train_data import device_batches
from eagle3pipe.verifier import AuxStateCapture, load_text_model
from eagle3pipe.vocab import run_vocab
from tests.test_draft_fixtures import (
    DFLASH_TRAIN,
    TOY_HIDDEN,
    TOY_MASK_ID,
    dflash_config,
    make_rows,
    toy_config,
    write_hidden_states,
    write_rows,
)

CPU = torch.device("cpu")
UNION = [1, 2, 4, 5, 6]  # what 02 captures for both drafts below
EAGLE_IDS, DFLASH_IDS = [2, 4, 5], [1, 4, 6]


def _metrics(data_dir, kind):
    return [r for r in read_jsonl(DataDir(data_dir).train_metrics) if r["kind"] == kind]


# -- 02 captures the union once; each draft reads its own columns -------------------------------------------------


def _extract(data_dir: Path, verifier: Path, rows, aux: list[int], storage: str):
    write_rows(data_dir, rows)
    cfg = load_config(overrides={
        "shared": {"data_dir": str(data_dir), "verifier": str(verifier), "aux_layer_ids": aux,
                   "hidden_size": TOY_HIDDEN, "max_seq_len": 128, "progress_every_s": 1000.0},
        "extract": {"device": "cpu", "model_dtype": "float32", "writer_threads": 1, "storage_dtype": storage}})
    run_extract(cfg)


def _batches(data_dir: Path, verifier: Path, aux: list[int], storage: str, **train) -> list[dict]:
    cfg = toy_config(data_dir, verifier, total_seq_len=128, eval_fraction=0.0, **train)
    cfg.shared.aux_layer_ids = aux
    cfg.extract.storage_dtype, cfg.extract.model_dtype = storage, "float32"
    cfg.validate("train")
    train_ds, _, manifest = build_data(cfg, CPU)
    assert manifest.aux_layer_ids == aux  # the manifest names what 02 captured (check_states_match passed)
    sampler = EpochBatches()
    sampler.set(packed_batches(train_ds, 128, 0, 0))
    return [gpu for _, gpu in device_batches(make_loader(train_ds, sampler, cfg, CPU), CPU, torch.float32)]


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_one_extraction_of_the_union_serves_both_drafts(tmp_path, toy_llama, storage):
    """02 run once on the union of the EAGLE-3 and DFlash layers: each draft's batches equal, bit for bit, the
    batches of an extraction of its own layers only; EAGLE-3's are shifted by one token, DFlash's are not (the
    row's own ids, each position's states of that position)."""
    rows = make_rows(8, seed=41, min_len=10, max_len=30)
    for name, aux in (("union", UNION), ("eagle3", EAGLE_IDS), ("dflash", DFLASH_IDS)):
        _extract(tmp_path / name, toy_llama, rows, aux, storage)
    union = load_hs_manifest(DataDir(tmp_path / "union").hs_manifest)
    assert union.aux_layer_ids == UNION and len(union.states) == len(UNION) + 1
    for draft, own in (("eagle3", EAGLE_IDS), ("dflash", DFLASH_IDS)):
        extra = DFLASH_TRAIN if draft == "dflash" else {}
        from_union = _batches(tmp_path / "union", toy_llama, UNION, storage, **{**extra, "draft_layer_ids": own})
        alone = _batches(tmp_path / draft, toy_llama, own, storage, **extra)
        assert len(from_union) == len(alone) > 0
        for a, b in zip(from_union, alone):
            assert set(a) == set(b)
            for key in a:
                assert torch.equal(a[key], b[key]), (draft, key)
        assert from_union[0]["hidden_states"].shape[-1] == 3 * TOY_HIDDEN
    # DFlash's batch, independently: row 0 of the packing unshifted, its states those of the same positions
    batch = _batches(tmp_path / "union", toy_llama, UNION, storage, **DFLASH_TRAIN, draft_layer_ids=DFLASH_IDS)[0]
    train_ds = build_data(_cfg_for(tmp_path / "union", toy_llama, storage), CPU)[0]
    first = packed_batches(train_ds, 128, 0, 0)[0][0]  # the first sample of the first packed row (no held-out split)
    stored = load_hidden_states(DataDir(tmp_path / "union").hs_file(first), torch.float32)
    n = len(rows[first].input_ids)
    assert batch["input_ids"][0, :n].tolist() == rows[first].input_ids
    cols = [UNION.index(k) for k in DFLASH_IDS]
    want = stored["hidden_states"][:, cols].flatten(1)  # [T, 3H]
    torch.testing.assert_close(batch["hidden_states"][0, :n], want, rtol=0, atol=0)
    torch.testing.assert_close(batch["verifier_last_hidden_states"][0, :n], stored["hidden_states"][:, -1],
                               rtol=0, atol=0)


def _cfg_for(data_dir: Path, verifier: Path, storage: str):
    cfg = toy_config(data_dir, verifier, total_seq_len=128, eval_fraction=0.0, **DFLASH_TRAIN,
                     draft_layer_ids=DFLASH_IDS)
    cfg.shared.aux_layer_ids = UNION
    cfg.extract.storage_dtype, cfg.extract.model_dtype = storage, "float32"
    return cfg


# -- z-lab's published format, converted by a warm start, computes z-lab's forward --------------------------------

ZLAB_IDS = [1, 3, 4]  # z-lab's "output of layer L" ids = our TOY_AUX [2, 4, 5] - 1
ZLAB = {"layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 32, "inter": 192, "block": 4}


def make_zlab_checkpoint(folder: Path, seed: int = 0, **config_extra) -> Path:
    """A tiny draft in z-lab's layout (config.json of Qwen3 fields + dflash_config, body weights only), bf16, scaled
    so each part of a layer moves the output visibly."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h, d, z = TOY_HIDDEN, ZLAB["head_dim"], ZLAB

    def mat(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) / cols**0.5).to(torch.bfloat16)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.3 * torch.randn(n, generator=g)).to(torch.bfloat16)

    w = {"fc.weight": mat(h, 3 * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for i in range(z["layers"]):
        p = f"layers.{i}."
        q, kv = z["heads"] * d, z["kv_heads"] * d
        w |= {p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
              p + "self_attn.q_proj.weight": mat(q, h), p + "self_attn.k_proj.weight": mat(kv, h),
              p + "self_attn.v_proj.weight": mat(kv, h), p + "self_attn.o_proj.weight": mat(h, q),
              p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
              p + "mlp.gate_proj.weight": mat(z["inter"], h), p + "mlp.up_proj.weight": mat(z["inter"], h),
              p + "mlp.down_proj.weight": mat(h, z["inter"])}
    save_file(w, str(folder / "model.safetensors"))
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h,
              "intermediate_size": z["inter"], "num_hidden_layers": z["layers"], "num_attention_heads": z["heads"],
              "num_key_value_heads": z["kv_heads"], "head_dim": d, "vocab_size": 1088, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 4096, "rope_theta": 10000.0, "hidden_act": "silu", "attention_bias": False,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "num_target_layers": 8,
              "block_size": z["block"], "dflash_config": {"target_layer_ids": ZLAB_IDS, "mask_token_id": TOY_MASK_ID},
              **config_extra}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def zlab_reference_logits(zlab: Path, verifier: Path, input_ids: list[int], anchor: int) -> torch.Tensor:
    """z-lab's published draft forward (z-lab/dflash dflash/model.py), written out here from its formula: context
    = hidden_norm(fc(the verifier's hidden_states[L + 1] for L in target_layer_ids)) of every token before the
    anchor; block = embed([the anchor's token, mask, ...]) at positions anchor .. anchor + B - 1; each layer
    attends (unmasked, non-causal) from the block's queries to keys/values of [context; block] with per-head q/k
    RMSNorm and rope, then a SwiGLU MLP; logits = the verifier's lm_head of the final norm. Full vocabulary
    [B, V], fp32."""
    cfg = json.loads((zlab / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(zlab / "model.safetensors")).items()}
    ver = {k: v.float() for k, v in load_file(str(verifier / "model.safetensors")).items()}
    eps, d, theta = cfg["rms_norm_eps"], cfg["head_dim"], cfg["rope_theta"]
    nh, nkv, block = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["block_size"]

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(x, pos):  # x [n, heads, d]; the rotate-half convention
        freqs = pos[:, None].float() / theta ** (torch.arange(0, d, 2).float() / d)  # [n, d/2]
        cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
        half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
        return x * cos + half * sin

    model = load_text_model(verifier, torch.float32)
    with torch.no_grad():
        hs = model(input_ids=torch.tensor([input_ids]), output_hidden_states=True).hidden_states
    feats = torch.cat([hs[layer + 1][0, :anchor] for layer in cfg["dflash_config"]["target_layer_ids"]], -1)
    ctx = rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])  # [anchor, H]
    mask_id = cfg["dflash_config"]["mask_token_id"]
    x = ver["model.embed_tokens.weight"][[input_ids[anchor]] + [mask_id] * (block - 1)]  # [B, H]
    pos = torch.arange(anchor + block)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        kv_in = torch.cat([ctx, h])  # [anchor + B, H]
        q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(block, nh, d), w[p + "self_attn.q_norm.weight"])
        k = rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, d), w[p + "self_attn.k_norm.weight"])
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, d)
        q, k = rope(q, pos[anchor:]), rope(k, pos)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d), -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(block, nh * d)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["norm.weight"]) @ ver["lm_head.weight"].T


def test_zlab_draft_warm_started_and_exported_computes_zlab_forward(tmp_path, toy_llama):
    """A z-lab-format draft through 03 -> 04 (--finetune-from, learning rate 0) -> export: the export, loaded by
    speculators' own classes, gives per block slot the logits of z-lab's forward written out independently
    (draft vocabulary columns of the full-vocabulary reference; the states read by its ids + 1 through stage 02's
    capture), and says sliding_window_non_causal true."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    zlab = make_zlab_checkpoint(tmp_path / "zlab", seed=3)
    rows = make_rows(12, seed=42)
    data = tmp_path / "d"
    write_rows(data, rows)
    write_hidden_states(data, toy_llama, rows)  # manifest ids [2, 4, 5] = z-lab's [1, 3, 4] + 1
    cfg = dflash_config(data, toy_llama, finetune_from=str(zlab), learning_rate=0.0, epochs=1, eval_fraction=0.0,
                        dflash_num_layers=ZLAB["layers"])
    run_vocab(cfg)
    out = run_train(cfg)
    exported = json.loads((out / "config.json").read_text())
    assert exported["aux_hidden_state_layer_ids"] == [k + 1 for k in ZLAB_IDS]
    assert exported["sliding_window_non_causal"] is True and exported["block_size"] == ZLAB["block"]
    assert exported["transformer_layer_config"]["intermediate_size"] == ZLAB["inter"]  # the checkpoint's own dims

    config = DFlashSpeculatorConfig.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention has no CPU path
    model = DFlashDraftModel(config)
    missing, unexpected = model.load_state_dict(load_file(str(out / "model.safetensors")), strict=False)
    assert not unexpected and set(missing) == {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    model.load_verifier_weights()
    model.float().eval()

    ids = make_rows(1, seed=43, min_len=40, max_len=40)[0].input_ids
    anchor = 25
    verifier = load_text_model(toy_llama, torch.float32)
    states = AuxStateCapture(verifier, exported["aux_hidden_state_layer_ids"])(torch.tensor([ids]))  # stage 02's
    loss_mask = torch.zeros(1, len(ids))
    loss_mask[0, anchor] = 1  # the one position an anchor can be drawn at
    with torch.no_grad():
        _, logits, _, _, _ = model._backbone_forward(  # noqa: SLF001 (the forward up to the logits)
            states[:, :, :-1].flatten(2), torch.tensor([ids]), loss_mask, states[:, :, -1],
            torch.zeros(1, len(ids), dtype=torch.long), max_anchors=1)
    want = zlab_reference_logits(zlab, toy_llama, ids, anchor)  # [B, V]
    targets = torch.arange(model.d2t.shape[0]) + model.d2t  # the draft vocabulary's target ids
    torch.testing.assert_close(logits[0], want[:, targets], rtol=1e-4, atol=1e-4)
    assert (want[:, targets] - want[:, targets].mean()).abs().max() > 1.0  # logits that say something


@pytest.mark.parametrize("extra, fragment", [
    ({"output_multiplier": 2.0}, "output_multiplier 2.0"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}, "causal or sliding-window"),
    ({"dflash_config": {"target_layer_ids": [1, 3, 7], "mask_token_id": TOY_MASK_ID}}, "output of the verifier's last"),
])
def test_zlab_features_speculators_lacks_are_refused(tmp_path, toy_llama, extra, fragment):
    from eagle3pipe.draft import DraftFormatError
    from eagle3pipe.draft_dflash import read_checkpoint

    folder = make_zlab_checkpoint(tmp_path / "z", **extra)
    with pytest.raises(DraftFormatError, match=fragment):
        read_checkpoint(folder, num_verifier_layers=8)


# -- the export as vLLM reads it (vLLM's own speculators adapter, in the vLLM interpreter) -------------------------

VLLM_READS = """
import json, sys
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.qwen3_dflash import _dflash_layer_causal
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
out = {}
for folder in sys.argv[1:]:
    c = SpeculatorsConfig.from_pretrained(folder)
    spec = SpeculatorsConfig.extract_vllm_speculative_config(json.load(open(folder + "/config.json")))
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(c.head_dim, c.max_position_embeddings, True, c.rope_parameters, torch.float32)
    out[folder] = {"architectures": c.architectures, "aux_ids": c.eagle_aux_hidden_state_layer_ids,
                   "dflash_config": c.dflash_config, "speculative": spec, "rope_mscale": float(rope.mscale),
                   "causal": [_dflash_layer_causal(c, i) for i in range(c.num_hidden_layers)]}
print("VLLM_READS " + json.dumps(out))
"""


def vllm_reads(*folders: Path) -> dict:
    """What vLLM's speculators adapter makes of each draft folder: capture ids, dflash_config, method and k, the
    causal flag of every draft layer, and the YaRN amplitude of the rope it builds."""
    r = subprocess.run([default_vllm_python(), "-c", VLLM_READS, *map(str, folders)], capture_output=True, text=True,
                       timeout=600, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "VLLM_HOST_IP": "127.0.0.1"})
    line = [x for x in r.stdout.splitlines() if x.startswith("VLLM_READS ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    return json.loads(line[0].removeprefix("VLLM_READS "))


def test_vllm_reads_the_export_as_trained_on_a_k25_shaped_verifier(tmp_path, toy_kimi, toy_kimi_meta):
    """The release-shaped toy (Kimi-K2.5 config, language_model.* weights, remote-code tokenizer, YaRN x64 rope):
    02's union of layers, a DFlash draft reading three of them, 03's mask token [UNK] by name, 04's export. vLLM's
    adapter names the draft's layers (all among those 02 captured), z-lab's ids one less, the mask token 03
    resolved, method dflash at k = block - 1, every layer non-causal as trained, and builds the rope with YaRN's
    amplitude 1 + 0.1 ln 64 as transformers trained it (trap (b)). The same export with speculators' default
    sliding_window_non_causal false is served causal (trap (a)), and 05's check names it."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from eagle3pipe import draft_dflash
    from eagle3pipe.draft_dflash import layer_config_from_checkpoint, read_checkpoint

    vocab = toy_kimi_meta["vocab_size"]
    rows = make_rows(12, seed=44)
    data = tmp_path / "d"
    write_rows(data, rows)
    write_hidden_states(data, toy_kimi, rows, aux_layer_ids=UNION)
    cfg = dflash_config(data, toy_kimi, epochs=1, eval_fraction=0.0, max_steps=2, draft_layer_ids=DFLASH_IDS)
    cfg.shared.aux_layer_ids, cfg.shared.vocab_size, cfg.vocab.mask_token = UNION, vocab, "[UNK]"
    cfg.validate("train")
    summary = run_vocab(cfg)
    assert summary.mask_token == "[UNK]" and summary.mask_token_id == vocab - 2  # the release: 163838 of 163840
    out = run_train(cfg)
    caught = tmp_path / "causal"
    config = json.loads((out / "config.json").read_text())
    caught.mkdir()
    for f in out.iterdir():
        (caught / f.name).write_bytes(f.read_bytes())
    (caught / "config.json").write_text(json.dumps({**config, "sliding_window_non_causal": False}))

    reads = vllm_reads(out, caught)
    served, causal = reads[str(out)], reads[str(caught)]
    captured = load_hs_manifest(DataDir(data).hs_manifest).aux_layer_ids
    assert served["aux_ids"] == DFLASH_IDS and set(served["aux_ids"]) <= set(captured) == set(UNION)
    assert served["dflash_config"]["target_layer_ids"] == [k - 1 for k in DFLASH_IDS]  # z-lab's convention
    assert served["dflash_config"]["mask_token_id"] == load_vocab_summary(DataDir(data).vocab_summary).mask_token_id
    k = DFLASH_TRAIN["dflash_block_size"] - 1
    assert served["speculative"] == {"method": "dflash", "num_speculative_tokens": k}
    assert served["causal"] == [False] * DFLASH_TRAIN["dflash_num_layers"]  # bidirectional, as speculators trains
    trained_rope = Qwen3RotaryEmbedding(layer_config_from_checkpoint(read_checkpoint(out, 8)))
    assert served["rope_mscale"] == pytest.approx(trained_rope.attention_scaling, rel=1e-6)
    assert served["rope_mscale"] == pytest.approx(1 + 0.1 * math.log(64), rel=1e-6)  # z-lab's K2.5 amplitude
    assert causal["causal"] == [True] * DFLASH_TRAIN["dflash_num_layers"]  # trap (a), in vLLM's own code
    assert draft_dflash.check_served(config, out) == []
    assert "sliding_window_non_causal: true" in " ".join(draft_dflash.check_served(
        json.loads((caught / "config.json").read_text()), caught))


# -- resume: each packed row's anchors are its own, whatever ran before -------------------------------------------


def test_dflash_resume_repeats_the_uninterrupted_run(tmp_path, toy_llama):
    """A DFlash run stopped after 3 steps and resumed gives the uninterrupted run's loss, eal and held-out figures
    step for step and its draft: speculators draws each row's anchors from the global RNG, which a resumed process
    would otherwise draw from another state."""
    rows = make_rows(24, seed=45)
    runs = {}
    for name in ("whole", "resumed"):
        data = tmp_path / name
        write_rows(data, rows)
        write_hidden_states(data, toy_llama, rows)
        cfg = dflash_config(data, toy_llama, epochs=2, checkpoint_every=2, learning_rate=3e-3,
                            max_steps=3 if name == "resumed" else 0)
        run_vocab(cfg)
        run_train(cfg)
        if name == "resumed":
            cfg.train.max_steps, cfg.train.resume = 0, True
            run_train(cfg)
        runs[name] = data
    whole, resumed = (_metrics(runs[n], "train") for n in ("whole", "resumed"))
    assert [r["step"] for r in resumed] == [r["step"] for r in whole] and len(whole) >= 6
    for x, y in zip(whole, resumed):
        for key in ("loss", "eal", "acc", "pos_acc_1", "blocks"):
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-7), (x["step"], key)
    ev_whole = {r["step"]: r for r in _metrics(runs["whole"], "eval")}
    ev_resumed = {r["step"]: r for r in _metrics(runs["resumed"], "eval")}  # + the stopped run's last step's
    assert ev_whole and set(ev_whole) <= set(ev_resumed)
    for step, x in ev_whole.items():
        y = ev_resumed[step]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6) and x["eal"] == pytest.approx(y["eal"], rel=1e-6)
    wa = load_file(str(DataDir(runs["whole"]).final_checkpoint / "model.safetensors"))
    wb = load_file(str(DataDir(runs["resumed"]).final_checkpoint / "model.safetensors"))
    assert set(wa) == set(wb)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_05_refuses_a_dflash_draft_vllm_would_serve_otherwise_than_trained(tmp_path, toy_llama):
    """Before any server starts: a speculators DFlash config that says sliding_window_non_causal false (vLLM runs
    its full-attention layers causal; speculators trained them bidirectionally) or names no mask token (vLLM's
    adapter raises KeyError) is refused naming the fix; a right one passes, and is served with method dflash at
    its own k."""
    from eagle3pipe.cli import StageError
    from eagle3pipe.evaluate import check_served_draft, speculative_config

    zlab = make_zlab_checkpoint(tmp_path / "zlab")
    rows = make_rows(8, seed=46)
    write_rows(tmp_path / "d", rows)
    write_hidden_states(tmp_path / "d", toy_llama, rows)
    cfg = dflash_config(tmp_path / "d", toy_llama, finetune_from=str(zlab), learning_rate=0.0, epochs=1,
                        eval_fraction=0.0, max_steps=1, dflash_num_layers=ZLAB["layers"])
    run_vocab(cfg)
    good = run_train(cfg)
    check_served_draft(good, cfg, "--draft")
    check_served_draft(zlab, cfg, "--baseline-draft")  # z-lab's own layout, as vLLM reads it natively
    assert json.loads(speculative_config(good, 3)) == {"method": "dflash", "model": str(good),
                                                       "num_speculative_tokens": ZLAB["block"] - 1}
    config = json.loads((good / "config.json").read_text())
    for change, fragment in (({"sliding_window_non_causal": False}, "write sliding_window_non_causal: true"),
                             ({"mask_token_id": None}, "'mask_token_id' missing")):
        bad = tmp_path / f"bad_{len(fragment)}"
        bad.mkdir()
        (bad / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
        (bad / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(StageError, match=fragment):
            check_served_draft(bad, cfg, "--draft")
