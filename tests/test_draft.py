"""Draft checkpoint formats: AQ-MedAI/SpecForge flat layout -> speculators Eagle3DraftModel -> flat export.

The reference forward below is written from the published EAGLE-3 / SpecForge layer formula, independently of
speculators: fc over the 3 concatenated aux states; input_layernorm on the token embedding, hidden_norm on the fc
output; attention over concat(embedding, hidden) (2H wide, rotary on q/k); the residual is the fc output *before*
hidden_norm; post-attention norm + SwiGLU MLP with residual; the final norm only for the logits.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3pipe import draft
from eagle3pipe.toy import KIMI_VOCAB_SIZE
from tests.test_draft_fixtures import (
    DRAFT_HEAD_DIM,
    DRAFT_HEADS,
    DRAFT_KV_HEADS,
    DRAFT_VOCAB,
    TOY_AUX,
    TOY_HIDDEN,
    TOY_VOCAB,
    make_flat_checkpoint,
    map_from_targets,
)


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta=10000.0):  # x [heads, T, d]; HF/neox layout: halves rotated
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None]  # [T, d/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_logits(w: dict, embed: torch.Tensor, aux: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
                     theta: float = 10000.0):
    """One SpecForge-style EAGLE-3 step, from the formula. aux [T, 3H], ids [T] -> logits [T, draft_vocab]."""
    f = {k: v.float() for k, v in w.items()}
    t = ids.shape[0]
    hidden = aux @ f["fc.weight"].T  # [T, H]
    e = _rms(embed[ids].float(), f["midlayer.input_layernorm.weight"])
    h = _rms(hidden, f["midlayer.hidden_norm.weight"])
    x = torch.cat([e, h], -1)  # [T, 2H]
    q = (x @ f["midlayer.self_attn.q_proj.weight"].T).view(t, DRAFT_HEADS, DRAFT_HEAD_DIM).transpose(0, 1)
    k = (x @ f["midlayer.self_attn.k_proj.weight"].T).view(t, DRAFT_KV_HEADS, DRAFT_HEAD_DIM).transpose(0, 1)
    v = (x @ f["midlayer.self_attn.v_proj.weight"].T).view(t, DRAFT_KV_HEADS, DRAFT_HEAD_DIM).transpose(0, 1)
    q, k = _rope(q, pos, theta), _rope(k, pos, theta)
    rep = DRAFT_HEADS // DRAFT_KV_HEADS
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = q @ k.transpose(1, 2) / DRAFT_HEAD_DIM**0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, DRAFT_HEADS * DRAFT_HEAD_DIM)
    h1 = hidden + attn @ f["midlayer.self_attn.o_proj.weight"].T  # residual: fc output before hidden_norm
    m = _rms(h1, f["midlayer.post_attention_layernorm.weight"])
    mlp = torch.nn.functional.silu(m @ f["midlayer.mlp.gate_proj.weight"].T) * (m @ f["midlayer.mlp.up_proj.weight"].T)
    h2 = h1 + mlp @ f["midlayer.mlp.down_proj.weight"].T
    return _rms(h2, f["norm.weight"]) @ f["lm_head.weight"].T


def _load(ckpt_dir, verifier, **kw):
    ck = draft.read_flat_checkpoint(ckpt_dir)
    d2t, t2d = kw.pop("d2t", ck.d2t), kw.pop("t2d", ck.t2d)
    return draft.load_finetune_draft(ckpt_dir, verifier=verifier, d2t=d2t, t2d=t2d, aux_layer_ids=TOY_AUX,
                                     ttt_steps=1, attn_impl="sdpa", **kw)


def _model_logits(model, aux, ids, pos):
    captured = []
    handle = model.lm_head.register_forward_hook(lambda mod, inp, out: captured.append(out.detach()))
    with torch.no_grad():
        model(hidden_states=aux[None], input_ids=ids[None], document_ids=torch.zeros(1, ids.shape[0], dtype=torch.long),
              position_ids=pos[None], ttt_steps=1)
    handle.remove()
    return captured[0][0]


def test_round_trip_load_export_equals_input(tmp_path, toy_llama):
    src = make_flat_checkpoint(tmp_path / "aq", seed=3)
    model, ck, info = _load(src, toy_llama)
    assert not info["remapped"]
    assert model.config.transformer_layer_config.head_dim == DRAFT_HEAD_DIM  # the checkpoint's, not the verifier's 32
    out = draft.export_flat(model, tmp_path / "export", TOY_AUX, base_config=ck.config)
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_aux_hidden_state_layer_ids"] == TOY_AUX  # vLLM's key and meaning
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [k - 1 for k in TOY_AUX]  # SGLang's
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["vocab_size"] == TOY_VOCAB
    assert config["head_dim"] == DRAFT_HEAD_DIM and config["num_key_value_heads"] == DRAFT_KV_HEADS
    assert config["norm_before_residual"] is False and config["bos_token_id"] == 1008  # extra fields kept
    draft.read_flat_checkpoint(out)  # the export passes the same strict reader


def test_same_logits_as_reference_specforge_layer(tmp_path, toy_llama):
    src = make_flat_checkpoint(tmp_path / "aq", seed=4)
    model, ck, _ = _load(src, toy_llama)
    model.eval()
    g = torch.Generator().manual_seed(0)
    t = 24
    aux = torch.randn(t, 3 * TOY_HIDDEN, generator=g)
    ids = torch.randint(0, TOY_VOCAB, (t,), generator=g)
    pos = torch.arange(t)
    embed = load_file(str(toy_llama / "model.safetensors"))["model.embed_tokens.weight"]
    want = reference_logits(ck.tensors, embed, aux, ids, pos)
    got = _model_logits(model, aux, ids, pos)
    assert got.shape == (t, DRAFT_VOCAB)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # speculators' own defaults (the "Eagle 3.1" norm layout) compute a different function on the same weights
    eagle31 = draft.build_draft_model(draft.layer_config_from_flat(ck.config), verifier=toy_llama,
                                      aux_layer_ids=TOY_AUX,
                                      d2t=ck.d2t, t2d=ck.t2d, ttt_steps=1, attn_impl="sdpa",
                                      norm_flags={"norm_before_residual": True, "norm_before_fc": False,
                                                  "fc_norm": False, "norm_output": False})
    draft.load_flat_into_model(eagle31, ck)
    eagle31.eval()
    assert (_model_logits(eagle31, aux, ids, pos) - want).abs().max() > 1e-2


@pytest.mark.parametrize("fault", ["missing", "unexpected", "shape", "speculators"])
def test_strict_checks_name_the_key(tmp_path, fault):
    src = make_flat_checkpoint(tmp_path / "aq")
    tensors = load_file(str(src / "model.safetensors"))
    if fault == "missing":
        del tensors["midlayer.hidden_norm.weight"]
        expect = "midlayer.hidden_norm.weight"
    elif fault == "unexpected":
        tensors["midlayer.self_attn.q_norm.weight"] = torch.ones(DRAFT_HEAD_DIM)
        expect = "q_norm"
    elif fault == "shape":
        tensors["midlayer.self_attn.q_proj.weight"] = torch.zeros(TOY_HIDDEN, 2 * TOY_HIDDEN)  # head_dim 32 x 4
        expect = "q_proj"
    else:
        cfg = json.loads((src / "config.json").read_text())
        cfg["speculators_config"] = {}
        (src / "config.json").write_text(json.dumps(cfg))
        expect = "speculators-format"
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(draft.DraftFormatError, match=expect):
        draft.read_flat_checkpoint(src)


def test_rebuilt_map_remaps_lm_head_rows(tmp_path, toy_llama):
    old_targets = list(range(0, 2 * DRAFT_VOCAB, 2))  # even ids
    src = make_flat_checkpoint(tmp_path / "aq", targets=old_targets, seed=5)
    new_targets = list(range(0, DRAFT_VOCAB))  # ids 0..255: the even half shared, the odd half new
    d2t, t2d = map_from_targets(new_targets)
    model, ck, info = _load(src, toy_llama, d2t=d2t, t2d=t2d)
    assert info["remapped"] and info["shared"] == len(set(old_targets) & set(new_targets)) == 128
    old_rows = {tid: ck.tensors["lm_head.weight"][i] for i, tid in enumerate(old_targets)}
    verifier_lm_head = load_file(str(toy_llama / "model.safetensors"))["lm_head.weight"]
    got = model.lm_head.weight.detach()
    for i, tid in enumerate(new_targets):
        want = old_rows[tid] if tid in old_rows else verifier_lm_head[tid]
        assert torch.equal(got[i].to(want.dtype), want), (i, tid)
    # d2t / t2d of the model (and so of its export) are the new map
    assert torch.equal(model.d2t, d2t) and torch.equal(model.t2d, t2d)


def test_kimi_k25_verifier_weights_come_from_nested_layout(tmp_path, toy_kimi):
    src = make_flat_checkpoint(tmp_path / "aq", seed=6, vocab_size=KIMI_VOCAB_SIZE)
    model, ck, _ = _load(src, toy_kimi)
    file = load_file(str(toy_kimi / "model.safetensors"))
    assert torch.equal(model.embed_tokens.weight.to(torch.bfloat16), file["language_model.model.embed_tokens.weight"])
    assert torch.equal(model.verifier_norm.weight.to(torch.bfloat16), file["language_model.model.norm.weight"])
    rows = file["language_model.lm_head.weight"][ck.t2d]
    assert torch.equal(model.verifier_lm_head.weight.to(torch.bfloat16), rows)
    # the draft's own lm_head is the checkpoint's, not the verifier's
    assert torch.equal(model.lm_head.weight.to(torch.bfloat16), ck.tensors["lm_head.weight"])


def test_speculators_format_export_round_trips(tmp_path, toy_llama):
    from speculators.models.eagle3 import Eagle3DraftModel

    src = make_flat_checkpoint(tmp_path / "aq", seed=9)
    model, _, _ = _load(src, toy_llama)
    out = draft.export_speculators(model, tmp_path / "spec")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == TOY_AUX
    assert not any(config[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"))
    assert "layers.0.self_attn.q_proj.weight" in load_file(str(out / "model.safetensors"))
    loaded = Eagle3DraftModel.from_pretrained(str(out))
    assert loaded.config.transformer_layer_config.head_dim == DRAFT_HEAD_DIM
    theirs = loaded.state_dict()
    for key, value in model.state_dict().items():
        if key in draft.VERIFIER_OWNED_KEYS:
            continue
        assert torch.equal(value.to(theirs[key].dtype), theirs[key]), key


# SGLang cannot run here (no CPU build of it in this project): its rule is pinned from its source instead.
# python/sglang/srt/model_executor/model_runner.py reads the draft's aux ids from
# ``eagle_config["eagle_aux_hidden_state_layer_ids"]`` only (None when absent); models' forward appends
# ``hidden_states + residual`` before layer i for each i in ``layers_to_capture`` (the state entering layer i, vLLM's
# id i); ``set_eagle3_layers_to_capture`` sets, when ids are given, ``[val + 1 for val in layer_ids]`` (llama.py, up
# to sglang#25454) or, since #25454 (merged 2026-05-16), adds one only when the first id is 1; without ids it takes
# ``[2, n // 2, n - 3]``.
def sglang_captures(config: dict, num_layers: int, since_25454: bool) -> list[int]:
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return [2, num_layers // 2, num_layers - 3]
    if since_25454 and ids[0] != 1:
        return list(ids)
    return [k + 1 for k in ids]


# vLLM 0.32 (.venv-vllm, v1/worker/gpu_model_runner.py ``_get_eagle3_aux_layers_from_config``): the draft config's
# top-level ``eagle_aux_hidden_state_layer_ids`` first, else ``eagle_config``'s, else the model's default; ids are
# used as the layers whose input is captured (deepseek_v2.py: ``if idx in aux_hidden_state_layers: append(hidden +
# residual)`` before layer idx runs). vLLM before vllm#42764 read only the top-level key. The integration test
# test_train_vllm checks the running server's own log line for the ids it uses.
def vllm_captures(config: dict, num_layers: int, reads_eagle_config: bool = True) -> list[int]:
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids and reads_eagle_config:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else [2, num_layers // 2, num_layers - 3]


@pytest.mark.parametrize("aux, both_sglang_ok", [([2, 4, 5], True), ([2, 30, 58], True), ([3, 4, 6], False)])
def test_export_aux_ids_capture_the_trained_states_in_vllm_and_sglang(tmp_path, toy_llama, aux, both_sglang_ok):
    src = make_flat_checkpoint(tmp_path / "aq", seed=10)
    model, ck, _ = _load(src, toy_llama)
    config = json.loads((draft.export_flat(model, tmp_path / "out", aux, base_config=ck.config) / "config.json")
                        .read_text())
    num_layers = 61  # the ids are the verifier's; only the default branch would read this
    assert vllm_captures(config, num_layers) == aux
    assert vllm_captures(config, num_layers, reads_eagle_config=False) == aux  # vLLM before #42764 too
    assert sglang_captures(config, num_layers, since_25454=True) == aux
    assert (sglang_captures(config, num_layers, since_25454=False) == aux) is both_sglang_ok
    # what the export wrote before: vLLM's ids in eagle_config only; SGLang before #25454 read them one layer late
    old = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}}
    assert sglang_captures(old, num_layers, since_25454=False) == [k + 1 for k in aux]


def test_fresh_draft_export_carries_the_verifier_rope_for_older_readers(tmp_path, toy_kimi):
    from transformers import AutoConfig, LlamaConfig

    verifier_rope = AutoConfig.from_pretrained(str(toy_kimi)).get_text_config().rope_parameters
    assert verifier_rope["rope_type"] == "yarn" and verifier_rope["factor"] == 64.0  # K2.5's YaRN x64, theta 50000
    layer = draft.fresh_layer_config(toy_kimi, 4, 0, 64, 256)
    ck = draft.read_flat_checkpoint(make_flat_checkpoint(tmp_path / "aq", seed=11, vocab_size=KIMI_VOCAB_SIZE))
    model = draft.build_draft_model(layer, verifier=toy_kimi, aux_layer_ids=TOY_AUX, d2t=ck.d2t, t2d=ck.t2d,
                                    ttt_steps=1, attn_impl="sdpa")
    out = draft.export_flat(model, tmp_path / "out", TOY_AUX)
    config = json.loads((out / "config.json").read_text())
    # a reader that knows only the older fields (transformers 4.x; SGLang's llama: getattr(config, "rope_theta",
    # 10000), getattr(config, "rope_scaling", None)) gets the draft's real rope, not theta 10000 without scaling
    assert config["rope_theta"] == verifier_rope["rope_theta"] == 50000.0
    legacy = config["rope_scaling"]
    assert legacy["type"] == legacy["rope_type"] == "yarn"
    assert {k: v for k, v in legacy.items() if k != "type"} == {
        k: v for k, v in verifier_rope.items() if k not in ("rope_theta", "type")}
    # transformers 5 reads the file (both spellings present) back to the rope the draft trained with
    assert LlamaConfig.from_dict(config).rope_parameters == model.config.transformer_layer_config.rope_parameters
    # a warm start whose own config carries legacy fields keeps them equal to its rope_parameters
    warm, _, _ = _load(tmp_path / "aq", toy_kimi)  # rope_theta 10000, rope_scaling null in its config.json
    default = json.loads((draft.export_flat(warm, tmp_path / "o2", TOY_AUX, base_config=ck.config) / "config.json")
                         .read_text())
    assert default["rope_theta"] == 10000.0 and default["rope_scaling"] is None
    assert default["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}


def test_checkpoint_without_aux_ids_reads_and_says_none(tmp_path):
    src = make_flat_checkpoint(tmp_path / "aq")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (src / "config.json").write_text(json.dumps(cfg))
    assert draft.read_flat_checkpoint(src).aux_layer_ids == []
    assert draft.default_aux_layer_ids(61) == [2, 30, 58]  # vLLM's and SGLang's default for K2.5's 61 layers


def test_a_new_draft_takes_a_dense_verifiers_attention_geometry(toy_llama, toy_kimi):
    """Issue 46: train.draft_num_heads / draft_num_kv_heads / draft_head_dim 0 = the verifier's, so that vLLM 0.26-0.28
    serve a new draft of a dense verifier on their default path (05's geometry check finds nothing to work around);
    beside an MLA verifier: its query heads, as many KV heads, head dim 128; a value given wins; heads that cannot
    share the KV heads are refused, naming the key."""
    from eagle3pipe.draft import draft_attention_geometry, fresh_layer_config, verifier_text_config
    from eagle3pipe.evaluate import attention_geometry

    llama = json.loads((toy_llama / "config.json").read_text())
    want = (llama["num_attention_heads"], llama["num_key_value_heads"], llama["head_dim"])  # (4, 2, 32)
    layer = fresh_layer_config(toy_llama, 0, 0, 0, 0)
    assert (layer.num_attention_heads, layer.num_key_value_heads, layer.head_dim) == want
    assert attention_geometry(layer) == attention_geometry(llama)  # what 05 compares before choosing a backend
    assert draft_attention_geometry(llama, 0, 4, 128) == (4, 4, 128)  # the MHA geometry, asked for
    mla = verifier_text_config(toy_kimi, trust_remote_code=True)
    assert draft_attention_geometry(mla) == (mla.num_attention_heads, mla.num_attention_heads, 128)
    with pytest.raises(ValueError, match="train.draft_num_kv_heads"):
        draft_attention_geometry(llama, 4, 3, 0)
