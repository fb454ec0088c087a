"""The toy verifier kit: deterministic, loadable, and shaped like Kimi-K2.5 where the pipeline cares."""

import hashlib
import json

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3ForCausalLM

from eagle3pipe.chat import load_tokenizer
from eagle3pipe.toy import K25_CHAT_TEMPLATE, SPECIAL_TOKENS, build_toy_verifier
from eagle3pipe.verifier import load_text_config


def _digest(folder):
    h = hashlib.sha256()
    for name in ("tokenizer.json", "model.safetensors"):
        h.update((folder / name).read_bytes())
    return h.hexdigest()


def test_same_seed_same_bytes(tmp_path, toy_llama):
    again = build_toy_verifier(tmp_path / "again", "llama", seed=0)
    assert _digest(again) == _digest(toy_llama)
    other = build_toy_verifier(tmp_path / "other", "llama", seed=1)
    assert _digest(other) != _digest(toy_llama)


def test_tokenizer_has_kimi_special_tokens(toy_llama, toy_meta):
    tok = load_tokenizer(toy_llama)
    for t in SPECIAL_TOKENS:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == t, t
    assert tok.convert_tokens_to_ids("<think>") == toy_meta["think_token_id"]
    assert toy_meta["aux_layer_ids"] == [2, 4, 5]


def test_flavours_load_and_run(toy_llama, toy_deepseek):
    for folder, arch in ((toy_llama, "LlamaForCausalLM"), (toy_deepseek, "DeepseekV3ForCausalLM")):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert type(model).__name__ == arch
        out = model(torch.tensor([[1, 2, 3, 4]]), output_hidden_states=True)
        hs = out.hidden_states
        # Scaled init: every layer moves the residual stream by a visible amount (off-by-one layers must show).
        for k in range(1, len(hs) - 1):
            rel = (hs[k + 1] - hs[k]).norm() / hs[k].norm()
            assert rel > 0.1, (arch, k, float(rel))
    cfg = AutoConfig.from_pretrained(toy_deepseek)
    assert cfg.kv_lora_rank == 512 and cfg.qk_rope_head_dim == 64 and cfg.n_routed_experts > 1


def test_kimi_k25_layout_nested_config_and_language_model_weights(toy_kimi, toy_deepseek, tmp_path):
    raw = json.loads((toy_kimi / "config.json").read_text())
    assert raw["architectures"] == ["KimiK25ForConditionalGeneration"] and raw["model_type"] == "kimi_k25"
    assert raw["text_config"]["model_type"] == "kimi_k2"  # as released; read as DeepseekV3 (verifier.py's shim)
    text_cfg, wrapped = load_text_config(toy_kimi)
    assert wrapped and type(text_cfg).__name__ == "DeepseekV3Config" and text_cfg.model_type == "deepseek_v3"
    tensors = load_file(toy_kimi / "model.safetensors")
    assert "language_model.model.embed_tokens.weight" in tensors and "language_model.lm_head.weight" in tensors
    # The released per-expert layout, wrapped: the same keys as the plain DeepseekV3 flavour writes.
    text = {k[len("language_model."):]: v for k, v in tensors.items() if k.startswith("language_model.")}
    assert set(load_file(toy_deepseek / "model.safetensors")) == set(text)
    # The text model loads exactly from the nested layout (not left randomly initialised with a warning): the
    # reference is the same tensors unwrapped into a plain DeepseekV3 folder, loaded the plain way.
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    save_file(text, str(plain_dir / "model.safetensors"), metadata={"format": "pt"})
    text_cfg.save_pretrained(plain_dir)
    model = DeepseekV3ForCausalLM.from_pretrained(toy_kimi, config=text_cfg,
                                                  key_mapping={"^language_model\\.": ""})
    ref_sd = DeepseekV3ForCausalLM.from_pretrained(plain_dir).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref_sd[k]), k


def test_kimi_k25_toy_names_the_release_specials_and_its_template_declares_tools_ts_str(toy_kimi):
    """The specials the release names sit at its offsets (so the release's own tokenizer class, whose default
    additional specials are the headers and [EOT], adds no id past the model's rows), unk_token is [UNK]; and the
    template declares tools with ``tools_ts_str`` when it is given, as K2.5's does, else as compact JSON."""
    from transformers.utils.chat_template_utils import render_jinja_template

    cfg = json.loads((toy_kimi / "tokenizer_config.json").read_text())
    first = min(int(i) for i in cfg["added_tokens_decoder"])
    named = {a["content"]: int(i) - first for i, a in cfg["added_tokens_decoder"].items()}
    release_offsets = {"<|start_header_id|>": 6, "<|end_header_id|>": 7, "[EOT]": 9, "[UNK]": 254}  # 163590, ...
    assert {k: named[k] for k in release_offsets} == release_offsets and cfg["unk_token"] == "[UNK]"
    assert (toy_kimi / "chat_template.jinja").read_text() == K25_CHAT_TEMPLATE
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"}]

    def rendered(**kw):
        (out,), _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=K25_CHAT_TEMPLATE,
                                          add_generation_prompt=False, **kw)
        return out

    turn = "<|im_user|>user<|im_middle|>hi<|im_end|>"
    assert rendered(tools_ts_str="# Tools TS") == "<|im_system|>tool_declare<|im_middle|># Tools TS<|im_end|>" + turn
    assert rendered() == ("<|im_system|>tool_declare<|im_middle|>" + json.dumps(tools, separators=(",", ":"))
                          + "<|im_end|>" + turn)


def test_kimi_k25_toy_at_the_release_mla_dims_vllm_gpu_serves(tmp_path, toy_kimi):
    """``--mla-dims release``: K2.5's own MLA head dims (nope 128, rope 64, v 128), which vLLM's GPU MLA prefill
    needs (0.26 refused the toy's 32/64/32 on the H200), with the toy's tokenizer and layout otherwise; and the vision
    tower's position table named as the release names it (vLLM 0.26 reads only init_pos_emb_*, default 64 x 64, and
    refused the toy's 8 x 8 table): every name of its size agrees with the tensor."""
    out = build_toy_verifier(tmp_path / "k25_release_dims", "kimi_k25", seed=0, mla_dims="release")
    text_cfg, _ = load_text_config(out)
    assert (text_cfg.qk_nope_head_dim, text_cfg.qk_rope_head_dim, text_cfg.v_head_dim) == (128, 64, 128)
    assert text_cfg.kv_lora_rank == 512
    tensors = load_file(out / "model.safetensors")
    q_b = tensors["language_model.model.layers.0.self_attn.q_b_proj.weight"]
    assert q_b.shape[0] == text_cfg.num_attention_heads * (128 + 64)  # the weights have those dims, not only config
    for folder in (out, toy_kimi):
        vision = json.loads((folder / "config.json").read_text())["vision_config"]
        h, w, _ = load_file(folder / "model.safetensors")["vision_tower.patch_embed.pos_emb.weight"].shape
        assert (vision["init_pos_emb_height"], vision["init_pos_emb_width"]) == (h, w)
        assert (vision["pos_emb_height"], vision["pos_emb_width"]) == (h, w)
    assert (json.loads((out / "tokenizer_config.json").read_text())
            == json.loads((toy_kimi / "tokenizer_config.json").read_text()))
