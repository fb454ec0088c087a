"""EAGLE-3 drafts whose decoder layer is the verifier's MLA attention (``train.draft: eagle3_mla``): the model code,
its export in the layout vLLM's and SGLang's MLA EAGLE-3 loaders read, and the published drafts read back in.

The draft is speculators' ``Eagle3DraftModel`` (its TTT unroll, loss, metrics and vocabulary map, as for
``train.draft: eagle3``) with its one decoder layer swapped for ours, registered in speculators' table of layer
families under the layer config's model type (``deepseek_v3``). The layer is DeepSeek-V3's multi-head latent
attention over the concatenated [embedding, hidden] input (2H wide) and a dense SwiGLU MLP, parameters named as
vLLM's ``DeepseekV2Eagle3DecoderLayer`` (vllm/model_executor/models/deepseek_eagle3.py) and lightseekorg's
published drafts name them, so the trained state dict *is* the export (under ``layers.0.``).

Export (``export``; the layout of lightseekorg/kimi-k2.5-eagle3-mla and kimi-k2.6-eagle3-mla, field for field)::

    config.json        architectures [Eagle3DeepseekV2ForCausalLM], model_type kimi_k2 (vLLM and SGLang map it to
                       DeepseekV3Config), hidden_size, intermediate_size (the dense MLP), num_hidden_layers 1,
                       num_attention_heads, num_key_value_heads (= heads), q_lora_rank, kv_lora_rank,
                       qk_nope_head_dim, qk_rope_head_dim, v_head_dim, hidden_act, rms_norm_eps,
                       rope_theta + rope_scaling (the verifier's rope, the release's legacy spelling),
                       max_position_embeddings, vocab_size (the verifier's), draft_vocab_size,
                       eagle_aux_hidden_state_layer_ids (vLLM's meaning) and eagle_config.eagle_aux_hidden_state_
                       layer_ids (SGLang's: draft.sglang_aux_layer_ids), norm_before_residual / fc_norm /
                       norm_output (false: the original EAGLE-3 layout), tie_word_embeddings false, torch_dtype
    model.safetensors  fc.weight [H, 3H], norm.weight [H], lm_head.weight [N, H]
                       layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H]
                       layers.0.self_attn.q_a_proj.weight [q_lora, 2H], q_a_layernorm.weight [q_lora],
                       q_b_proj.weight [heads x (nope + rope), q_lora]   (q_lora_rank null: q_proj [.., 2H])
                       layers.0.self_attn.kv_a_proj_with_mqa.weight [kv_lora + rope, 2H],
                       kv_a_layernorm.weight [kv_lora], kv_b_proj.weight [heads x (nope + v), kv_lora],
                       o_proj.weight [H, heads x v]
                       layers.0.mlp.{gate,up}_proj.weight [I, H], down_proj.weight [H, I]
                       d2t int64 [N], t2d bool [V] (only when N < V; the published drafts have N = V and neither);
                       no embedding (vLLM and SGLang take the verifier's)

vLLM fuses q_a_proj and kv_a_proj_with_mqa into fused_qkv_a_proj and renames ``midlayer.`` to ``layers.0.``
itself; SGLang renames ``layers.0.`` to ``midlayer.``: both names load in both, and the reader below takes either.

What the layer computes, as vLLM serves it (tests/test_draft_mla.py holds an independent implementation):
``x = cat(input_layernorm(embedding), hidden_norm(h))``; queries ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` split
into nope and rope parts; the latent ``kv_a_layernorm`` of the first kv_lora columns of ``kv_a_proj_with_mqa(x)``,
its last qk_rope columns the one rotary key shared by every head; keys and values per head from
``kv_b_proj(latent)``; DeepSeek's interleaved rope (pairs 2i, 2i + 1) on the rope parts with the verifier's YaRN
frequencies; softmax scale (nope + rope)^-1/2 x mscale(factor, mscale_all_dim)^2; the residual is ``h`` before
its norm; a dense SwiGLU MLP; logits = lm_head(norm(out)), the next step's state ``out`` before that norm.

Why the latent norms take the config's rms_norm_eps: vLLM builds q_a_layernorm and kv_a_layernorm with it;
transformers' DeepseekV3Attention leaves them at 1e-6 (K2.5's eps is 1e-5).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .draft import (
    CONFIG_FILE,
    SPECFORGE_NORM_FLAGS,
    VERIFIER_OWNED_KEYS,
    DraftFormatError,
    default_aux_layer_ids,
    legacy_rope_fields,
    load_warm_start,
    replace_dir,
    sglang_aux_layer_ids,
    verifier_text_config,
)

log = logging.getLogger(__name__)

ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
ARCHITECTURES = (ARCHITECTURE, "Eagle3DeepseekV3ForCausalLM")  # vLLM registers both names for one class
MODEL_TYPE = "kimi_k2"  # the published drafts' model_type; vLLM and SGLang read it as a DeepseekV3Config
WEIGHTS_FILE = "model.safetensors"
LAYER_PREFIX = "layers.0."  # speculators' name for the layer, and the published drafts'
SGLANG_LAYER_PREFIX = "midlayer."  # the other name both engines load (TorchSpec's in training)
LAYER_FAMILY = "deepseek_v3"  # the layer config's model type: the key of our entry in speculators' table
# norm flags vLLM's deepseek_eagle3 and speculators both have; the original EAGLE-3 layout sets none of them
NORM_FLAGS = ("norm_before_residual", "fc_norm", "norm_output")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def is_mla_config(config: dict) -> bool:
    """A draft config.json of this family (vLLM's Eagle3DeepseekV2ForCausalLM)."""
    return any(a in ARCHITECTURES for a in config.get("architectures") or [])


# ---------------------------------------------------------------------------------------------------------------
# The layer


def softmax_scale(config) -> float:
    """(nope + rope)^-1/2, times mscale(factor, mscale_all_dim)^2 under a YaRN rope (as vLLM's DeepseekV2
    MLAAttention and transformers' DeepseekV3Attention both scale it)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_parameters or {}
    factor, all_dim = float(rope.get("factor") or 1.0), float(rope.get("mscale_all_dim") or 0.0)
    if rope.get("rope_type", "default") != "default" and all_dim and factor > 1:
        mscale = 0.1 * all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention taking EAGLE-3's 2H-wide input. The TTT unroll's earlier steps are
    kept in speculators' cache as the latent and the rotated shared key (576 numbers a token for K2.5), expanded to
    per-head keys and values at each step."""

    def __init__(self, config, layer_idx: int):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups, self.is_causal = 1, True  # read by transformers' attention functions
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        width, eps = 2 * config.hidden_size, config.rms_norm_eps
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(width, self.q_lora_rank, bias=False)
            self.q_a_layernorm = DeepseekV3RMSNorm(self.q_lora_rank, eps=eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * (self.nope + self.rope), bias=False)
        else:
            self.q_proj = nn.Linear(width, self.num_heads * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(width, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = DeepseekV3RMSNorm(self.kv_lora_rank, eps=eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, config.hidden_size, bias=False)
        self.scaling = softmax_scale(config)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask, past_key_values=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            apply_rotary_pos_emb_interleave,
            eager_attention_forward,
        )

        b, t, _ = hidden_states.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states))) if self.q_lora_rank else \
            self.q_proj(hidden_states)
        q = q.view(b, t, self.num_heads, self.nope + self.rope).transpose(1, 2)  # [B, heads, T, nope + rope]
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent).view(b, 1, t, self.kv_lora_rank)  # one "head": the cached latent
        k_rope = k_rope.view(b, 1, t, self.rope)
        cos, sin = position_embeddings
        # DeepSeek rotates interleaved pairs (vLLM: is_neox_style False); transformers' helper returns the pairs
        # de-interleaved, the same permutation for queries and keys, so every score is the same
        q_rope, k_rope = apply_rotary_pos_emb_interleave(q_rope, k_rope, cos, sin)
        if past_key_values is not None:  # TTT: the latents of the earlier steps come first
            latent, k_rope = past_key_values.update(latent, k_rope, self.layer_idx)
        kv = self.kv_b_proj(latent).view(b, -1, self.num_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, value = kv.split([self.nope, self.v_dim], dim=-1)  # [B, heads, Tk, nope], [B, heads, Tk, v]
        key = torch.cat([k_nope, k_rope.expand(-1, self.num_heads, -1, -1)], dim=-1)
        query = torch.cat([q_nope, q_rope], dim=-1)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
                                 **kwargs)
        return self.o_proj(out.reshape(b, t, -1)), weights


def _layer_classes():
    """speculators' first-layer mixin (split [embedding, hidden], their norms, the residual) over our MLA layer."""
    from speculators.models.eagle3.model_definitions import Eagle3FirstLayerMixin
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP, DeepseekV3RMSNorm

    class MLAEagle3Layer(Eagle3FirstLayerMixin, nn.Module):
        """EAGLE-3's first decoder layer with MLA attention and a dense MLP (vLLM's DeepseekV2Eagle3DecoderLayer)."""

        def __init__(self, config, layer_idx: int, norm_before_residual: bool = False):
            nn.Module.__init__(self)
            h, eps = config.hidden_size, config.rms_norm_eps
            self.norm_before_residual = norm_before_residual
            self.self_attn = MLAAttention(config, layer_idx)
            self.mlp = DeepseekV3MLP(config)
            self.input_layernorm = DeepseekV3RMSNorm(h, eps=eps)
            self.hidden_norm = DeepseekV3RMSNorm(h, eps=eps)
            self.post_attention_layernorm = DeepseekV3RMSNorm(h, eps=eps)

    return MLAEagle3Layer


def register_layer_family() -> None:
    """Our layer in speculators' table (``model_definitions.model_classes``, which Eagle3DraftModel looks its layer
    classes up in by the layer config's model type), once; refuses to replace an entry that is not ours."""
    from speculators.models.base_components import ModelComponents
    from speculators.models.eagle3.model_definitions import model_classes
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
        DeepseekV3RotaryEmbedding,
    )

    entry = model_classes.get(LAYER_FAMILY)
    if entry is not None:
        if getattr(entry.first_layer_class, "__qualname__", "").endswith("MLAEagle3Layer"):
            return
        raise RuntimeError(f"speculators already defines an EAGLE-3 layer for {LAYER_FAMILY!r} "
                           f"({entry.first_layer_class}): eagle3pipe's MLA layer would replace it")
    # only the first layer is built (num_hidden_layers 1); DeepseekV3DecoderLayer fills the table's other slot
    model_classes[LAYER_FAMILY] = ModelComponents(_layer_classes(), DeepseekV3DecoderLayer, DeepseekV3RMSNorm,
                                                  DeepseekV3RotaryEmbedding)


def layer_config(verifier: str | Path, *, num_heads: int, intermediate_size: int, trust_remote_code: bool = False):
    """A new MLA draft's decoder (DeepseekV3Config, one dense layer): the verifier's MLA geometry (q_lora /
    kv_lora ranks, nope / rope / v head dims), hidden size, vocabulary, norm eps, rope and activation; heads (0 =
    the verifier's) and MLP width (0 = the verifier's dense intermediate_size) as given."""
    text = verifier_text_config(verifier, trust_remote_code)
    if not getattr(text, "kv_lora_rank", None):
        raise DraftFormatError(f"{verifier}: the verifier has no MLA attention (no kv_lora_rank in its config): "
                               "train.draft eagle3_mla drafts MLA verifiers (DeepSeek-V3, Kimi-K2.x); use eagle3")
    return _deepseek_config(
        vocab_size=text.vocab_size, hidden_size=text.hidden_size,
        intermediate_size=intermediate_size or text.intermediate_size,
        num_attention_heads=num_heads or text.num_attention_heads,
        **{k: getattr(text, k) for k in MLA_FIELDS}, hidden_act=getattr(text, "hidden_act", "silu"),
        rms_norm_eps=text.rms_norm_eps, max_position_embeddings=text.max_position_embeddings,
        rope_parameters=dict(text.rope_parameters))


def _deepseek_config(**fields):
    from transformers import DeepseekV3Config

    heads = fields["num_attention_heads"]
    config = DeepseekV3Config(num_hidden_layers=1, num_key_value_heads=heads, first_k_dense_replace=1,
                              rope_interleave=True, tie_word_embeddings=False, attention_bias=False, **fields)
    config.head_dim = config.qk_rope_head_dim  # what DeepseekV3RotaryEmbedding rotates
    return config


def build_model(layer, *, verifier: str | Path, aux_layer_ids: list[int], d2t: torch.Tensor, t2d: torch.Tensor,
                ttt_steps: int, attn_impl: str):
    """speculators' Eagle3DraftModel with our MLA layer, in the original EAGLE-3 layout (the one vLLM's
    deepseek_eagle3 and the published drafts use: no norm before fc, the residual before hidden_norm, the final
    norm for the logits only), the verifier's embedding, final norm and lm_head rows (t2d) loaded."""
    from speculators.models.eagle3 import Eagle3DraftModel

    register_layer_family()
    return Eagle3DraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=d2t, verifier_name_or_path=str(verifier),
        draft_vocab_size=int(d2t.shape[0]), ttt_steps=ttt_steps, target_layer_ids=list(aux_layer_ids),
        draft_attn_impl=attn_impl, **SPECFORGE_NORM_FLAGS)


# ---------------------------------------------------------------------------------------------------------------
# Sizes (run_all.sh --plan)


def tensor_shapes(config: dict, num_aux: int = 3) -> dict[str, tuple[int, ...]]:
    """Every tensor an MLA draft with ``config`` (config.json fields) holds, with its shape; d2t and t2d only with
    a draft vocabulary smaller than the verifier's; the embedding (optional) not included."""
    h, inter, heads = int(config["hidden_size"]), int(config["intermediate_size"]), int(config["num_attention_heads"])
    q_lora, kv_lora = config.get("q_lora_rank"), int(config["kv_lora_rank"])
    nope, rope, v = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"]), int(config["v_head_dim"])
    vocab = int(config["vocab_size"])
    n = int(config.get("draft_vocab_size") or vocab)
    a, p = f"{LAYER_PREFIX}self_attn.", LAYER_PREFIX
    query = ({f"{a}q_a_proj.weight": (int(q_lora), 2 * h), f"{a}q_a_layernorm.weight": (int(q_lora),),
              f"{a}q_b_proj.weight": (heads * (nope + rope), int(q_lora))} if q_lora else
             {f"{a}q_proj.weight": (heads * (nope + rope), 2 * h)})
    return {
        "fc.weight": (h, num_aux * h),
        f"{p}input_layernorm.weight": (h,), f"{p}hidden_norm.weight": (h,), f"{p}post_attention_layernorm.weight": (h,),
        **query,
        f"{a}kv_a_proj_with_mqa.weight": (kv_lora + rope, 2 * h), f"{a}kv_a_layernorm.weight": (kv_lora,),
        f"{a}kv_b_proj.weight": (heads * (nope + v), kv_lora), f"{a}o_proj.weight": (h, heads * v),
        f"{p}mlp.gate_proj.weight": (inter, h), f"{p}mlp.up_proj.weight": (inter, h),
        f"{p}mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,), "lm_head.weight": (n, h),
        **({"d2t": (n,), "t2d": (vocab,)} if n < vocab else {}),
    }


def parameter_counts(cfg) -> tuple[int, int] | None:
    """(every float parameter of the export, those 04 trains) of the new MLA draft ``cfg`` describes: the
    verifier's MLA geometry (read from its config.json, K2.5's text_config unwrapped), train.draft_num_heads and
    draft_intermediate_size (0 = the verifier's), shared.draft_vocab_size; the lm_head is trained only with
    train.train_lm_head. None when the verifier's config.json cannot be read or has no MLA attention. For
    ``run_all.sh --plan`` (costs.py sizes the checkpoints and the export from it)."""
    s, t = cfg.shared, cfg.train
    try:
        config = json.loads((Path(s.verifier) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or config
    if not text.get("kv_lora_rank"):
        return None
    fields = {k: text.get(k) for k in MLA_FIELDS}
    layer = {"hidden_size": s.hidden_size, "num_attention_heads": t.draft_num_heads or text["num_attention_heads"],
             "intermediate_size": t.draft_intermediate_size or text["intermediate_size"],
             "vocab_size": s.vocab_size, "draft_vocab_size": s.draft_vocab_size, **fields}
    shapes = {k: v for k, v in tensor_shapes(layer, len(cfg.draft_layer_ids)).items() if k not in ("d2t", "t2d")}
    params = sum(math.prod(shape) for shape in shapes.values())
    return params, params - (0 if t.train_lm_head else math.prod(shapes["lm_head.weight"]))


# ---------------------------------------------------------------------------------------------------------------
# Export


def export_config(model, aux_layer_ids: list[int], base_config: dict | None = None, dtype: str = "bfloat16") -> dict:
    """config.json of the export: the published drafts' fields (a warm start's own config keeps its extra ones);
    aux ids written for vLLM (top level) and SGLang (eagle_config), as draft.flat_config does."""
    layer = model.config.transformer_layer_config
    config = dict(base_config or {})
    config.pop("rope_parameters", None)  # the rope is written in the release's legacy spelling below
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "hidden_act", "rms_norm_eps",
                "max_position_embeddings", *MLA_FIELDS):
        config[key] = getattr(layer, key)
    config.update(legacy_rope_fields(layer.rope_parameters))
    sglang_ids, warning = sglang_aux_layer_ids(aux_layer_ids)
    if warning:
        log.warning("export: %s", warning)
    eagle_config = {**(config.get("eagle_config") or {}), "eagle_aux_hidden_state_layer_ids": sglang_ids,
                    "use_aux_hidden_state": True}
    config.update(
        architectures=[ARCHITECTURE], model_type=MODEL_TYPE, num_hidden_layers=1,
        num_key_value_heads=int(layer.num_attention_heads), vocab_size=int(model.verifier_vocab_size),
        draft_vocab_size=int(model.draft_vocab_size), eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
        eagle_config=eagle_config, tie_word_embeddings=False, torch_dtype=dtype,
        **{flag: bool(getattr(model.config, flag)) for flag in NORM_FLAGS})
    return config


def export(model, out_dir: str | Path, aux_layer_ids: list[int], base_config: dict | None = None,
           dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the draft in the published MLA layout (module docstring) into ``out_dir`` atomically (a temporary
    folder, then a rename). ``aux_layer_ids`` in vLLM's convention."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tensors = {}
    for key, value in model.state_dict().items():
        if key in VERIFIER_OWNED_KEYS:
            continue
        keep = value.dtype in (torch.int64, torch.bool)  # d2t, t2d
        tensors[key] = value.detach().to("cpu", None if keep else dtype).contiguous()
    config = export_config(model, aux_layer_ids, base_config, str(dtype).removeprefix("torch."))
    want = tensor_shapes(config, len(aux_layer_ids))
    if {k: tuple(v.shape) for k, v in tensors.items()} != want:  # an internal invariant: the model is ours
        raise AssertionError(f"MLA export {out_dir}: tensors {sorted(set(tensors) ^ set(want))} or shapes differ "
                             "from the layout")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    replace_dir(tmp, out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------------------------------
# Reading a published (or our own) MLA draft: warm starts, and 05's check before serving


@dataclass
class MLACheckpoint:
    """An MLA draft read from disk: its config.json, every tensor under the names our model uses (``layers.0.``),
    and its vocabulary map (the identity when it drafts the whole vocabulary and carries no map)."""

    folder: Path
    config: dict
    tensors: dict[str, torch.Tensor]
    d2t: torch.Tensor
    t2d: torch.Tensor

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.shape[0])

    @property
    def aux_layer_ids(self) -> list[int]:
        """The aux ids it declares ([] when none): the top-level key (vLLM's) first, else eagle_config's."""
        top = self.config.get("eagle_aux_hidden_state_layer_ids")
        return list(top or (self.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [])


def config_problems(config: dict) -> list[str]:
    """What in an MLA draft's config.json neither our model nor vLLM's loader would read as written."""
    problems = []
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "vocab_size"):
        if config.get(key) is None:
            problems.append(f"lacks '{key}'")
    if int(config.get("num_hidden_layers", 1)) != 1:
        problems.append(f"num_hidden_layers {config['num_hidden_layers']}: only one layer is supported")
    heads = config.get("num_attention_heads")
    if config.get("num_key_value_heads") not in (None, heads):
        problems.append(f"num_key_value_heads {config['num_key_value_heads']} != num_attention_heads {heads} (MLA "
                        "has one latent for all heads)")
    for flag in (*NORM_FLAGS, "norm_before_fc"):
        if config.get(flag):
            problems.append(f"{flag} true (an Eagle 3.1 layout; only the original EAGLE-3 layout is supported)")
    aux = config.get("eagle_aux_hidden_state_layer_ids", (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"))
    if aux is not None and len(aux) != 3:
        problems.append(f"eagle_aux_hidden_state_layer_ids {aux}: an EAGLE-3 draft reads 3 states")
    return problems


def read_checkpoint(folder: str | Path) -> MLACheckpoint:
    """Read and strictly check an MLA draft folder (lightseekorg's published layout or our export): the config's
    fields, every tensor present with its shape (``layers.0.`` or ``midlayer.`` names), none unexpected, the
    vocabulary map consistent. Raises DraftFormatError naming the key."""
    from .draft import read_safetensors_folder
    from .records import FormatError
    from .records_vocab import check_vocab_mapping

    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise DraftFormatError(f"{folder}: no {CONFIG_FILE} (expected an {ARCHITECTURE} draft folder)")
    config = json.loads(path.read_text())
    if not is_mla_config(config):
        arch = config.get("architectures")
        hint = " (an MHA draft: train.draft eagle3)" if "LlamaForCausalLMEagle3" in (arch or []) else ""
        raise DraftFormatError(f"{path}: architectures {arch} is not one of {ARCHITECTURES}{hint}")
    problems = config_problems(config)
    if problems:
        raise DraftFormatError(f"{path}: {'; '.join(problems)}")
    tensors = {}
    for key, value in read_safetensors_folder(folder).items():
        name = LAYER_PREFIX + key[len(SGLANG_LAYER_PREFIX):] if key.startswith(SGLANG_LAYER_PREFIX) else key
        if name in tensors:
            raise DraftFormatError(f"{folder}: tensor '{key}' appears under both {LAYER_PREFIX} and "
                                   f"{SGLANG_LAYER_PREFIX}")
        tensors[name] = value
    vocab, h = int(config["vocab_size"]), int(config["hidden_size"])
    full = int(config.get("draft_vocab_size") or vocab) == vocab
    expected = tensor_shapes(config)
    optional = {"embed_tokens.weight": (vocab, h), **({"d2t": (vocab,), "t2d": (vocab,)} if full else {})}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - set(optional))
    if missing:
        raise DraftFormatError(f"{folder}: missing tensors {missing} ({ARCHITECTURE} layout, as its config.json "
                               "describes it)")
    if unexpected:
        raise DraftFormatError(f"{folder}: unexpected tensors {unexpected} (not part of the {ARCHITECTURE} layout)")
    for key, value in tensors.items():
        want = {**expected, **optional}[key]
        if tuple(value.shape) != want:
            raise DraftFormatError(f"{folder}: tensor '{key}' has shape {tuple(value.shape)}, its config.json says "
                                   f"{want}")
    if "d2t" in tensors:
        d2t, t2d = tensors.pop("d2t").to(torch.int64), tensors.pop("t2d").to(torch.bool)
    else:  # the whole vocabulary, in order: the identity map
        d2t, t2d = torch.zeros(vocab, dtype=torch.int64), torch.ones(vocab, dtype=torch.bool)
    try:
        check_vocab_mapping(d2t, t2d, where=str(folder))
    except FormatError as e:
        raise DraftFormatError(str(e)) from None
    return MLACheckpoint(folder, config, tensors, d2t, t2d)


def layer_config_from_checkpoint(config: dict):
    """The checkpoint's own decoder config (its dims and rope, not the verifier's)."""
    from transformers import DeepseekV3Config

    rope = DeepseekV3Config(rope_theta=config.get("rope_theta", 10000.0), rope_scaling=config.get("rope_scaling"),
                            **({"rope_parameters": config["rope_parameters"]} if config.get("rope_parameters")
                               else {})).rope_parameters  # transformers' reading of either spelling
    return _deepseek_config(
        vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]), num_attention_heads=int(config["num_attention_heads"]),
        **{k: config.get(k) for k in MLA_FIELDS}, hidden_act=config.get("hidden_act", "silu"),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)), rope_parameters=dict(rope))


def load_into_model(model, ckpt: MLACheckpoint) -> dict:
    """Copy a checkpoint's weights into ``model`` key by key: every trainable key filled exactly once, shapes
    equal, the embedding (when it carries one) equal to the verifier's. The model's vocabulary map must be the
    checkpoint's, or its lm_head rows are remapped (shared tokens keep their rows, new ones take the verifier's).
    Returns {"remapped": bool, "shared": int, "keys": the keys filled}."""
    state = {k: v for k, v in ckpt.tensors.items() if k != "embed_tokens.weight"}
    info = load_warm_start(model, state, ckpt)
    return {**info, "keys": sorted(state)}


def checkpoint_aux_ids(ckpt: MLACheckpoint, num_verifier_layers: int) -> list[int]:
    """The aux ids a warm-start checkpoint was trained on: its own, or (none named) the engines' default."""
    return ckpt.aux_layer_ids or default_aux_layer_ids(num_verifier_layers)


def check_served(config: dict, folder: Path) -> list[str]:
    """Problems vLLM's Eagle3DeepseekV2ForCausalLM would have with this draft folder (empty: none); tensors
    compared by their headers only. vLLM's loader does not check that every weight was loaded: a missing one would
    be served uninitialised."""
    from safetensors import safe_open

    problems = config_problems(config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        problems.append("no *.safetensors weights")
    if problems:
        return problems
    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                name = LAYER_PREFIX + key[len(SGLANG_LAYER_PREFIX):] if key.startswith(SGLANG_LAYER_PREFIX) else key
                shapes[name] = tuple(st.get_slice(key).get_shape())
    for key, want in tensor_shapes(config).items():
        if key not in shapes:
            problems.append(f"tensor {key!r} missing")
        elif shapes[key] != want:
            problems.append(f"tensor {key!r} has shape {shapes[key]}, its config.json says {want}")
    return problems
