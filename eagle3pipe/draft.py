"""EAGLE-3 draft checkpoints: the flat SpecForge/AQ-MedAI layout, speculators' Eagle3DraftModel, and export.

The flat layout (``LlamaForCausalLMEagle3``; what AQ-MedAI publishes and vLLM/SGLang load)::

    config.json        llama decoder fields (hidden_size, intermediate_size, num_attention_heads, head_dim, ...),
                       rope_parameters and the same rope as rope_theta / rope_scaling (older readers),
                       draft_vocab_size, vocab_size (verifier's), eagle_aux_hidden_state_layer_ids (vLLM's meaning)
                       and eagle_config.eagle_aux_hidden_state_layer_ids (SGLang's: see sglang_aux_layer_ids)
    model.safetensors  midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H]
                       midlayer.self_attn.{q,k,v}_proj.weight [heads*head_dim, 2H], o_proj [H, heads*head_dim]
                       midlayer.mlp.{gate,up}_proj.weight [I, H], down_proj [H, I]
                       fc.weight [H, 3H], norm.weight [H], lm_head.weight [N, H], d2t int64 [N], t2d bool [V]
                       (embed_tokens.weight [V, H] optional: vLLM shares the verifier's when absent; d2t and t2d
                       optional when N = V, as in lightseekorg/kimi-k2.5-eagle3: the identity map)

SpecForge-trained layers use the original EAGLE-3 layout, which in speculators' flags is all four off: no norm
before ``fc``, the decoder residual is the fc output *before* ``hidden_norm``, the final ``norm`` only feeds the
logits. speculators 0.9 defaults to the "Eagle 3.1" layout instead, so a warm start must set them explicitly.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FLAT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
FLAT_WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
FLAT_LAYER_PREFIX = "midlayer."
MODEL_LAYER_PREFIX = "layers.0."
# speculators' norm flags of the original (SpecForge / AQ-MedAI) EAGLE-3 layer
SPECFORGE_NORM_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
# keys of Eagle3DraftModel's state that come from the verifier, never from a draft checkpoint
VERIFIER_OWNED_KEYS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
# config fields of the decoder layer carried from a draft config into LlamaConfig
LAYER_CONFIG_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "attention_bias",
    "mlp_bias", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id",
)


class DraftFormatError(ValueError):
    """A draft checkpoint does not match its declared layout; the message names the folder and the key."""


@dataclass
class FlatCheckpoint:
    """A flat EAGLE-3 draft read from disk: its config.json as a dict and every tensor by its file key."""

    folder: Path
    config: dict
    tensors: dict[str, torch.Tensor]

    @property
    def aux_layer_ids(self) -> list[int]:
        """The aux ids the checkpoint declares ([] when none): the top-level key first (vLLM reads it first, in its
        own meaning), else ``eagle_config``'s (AQ-MedAI / SpecForge; either convention, see train._check_aux_ids)."""
        top = self.config.get("eagle_aux_hidden_state_layer_ids")
        return list(top or (self.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [])

    @property
    def draft_vocab_size(self) -> int:
        return int(self.config["draft_vocab_size"])

    @property
    def d2t(self) -> torch.Tensor:
        return self.tensors["d2t"]

    @property
    def t2d(self) -> torch.Tensor:
        return self.tensors["t2d"]


def flat_tensor_shapes(config: dict, num_aux: int = 3) -> dict[str, tuple[int, ...]]:
    """Every tensor a flat draft with ``config`` must hold, with its shape (embedding excluded: optional)."""
    h = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or h // heads)
    n, v = int(config["draft_vocab_size"]), int(config["vocab_size"])
    m = FLAT_LAYER_PREFIX
    maps = {"d2t": (n,), "t2d": (v,)} if n < v else {}  # a whole-vocabulary draft needs no map
    return {
        "fc.weight": (h, num_aux * h),
        f"{m}input_layernorm.weight": (h,),
        f"{m}hidden_norm.weight": (h,),
        f"{m}post_attention_layernorm.weight": (h,),
        f"{m}self_attn.q_proj.weight": (heads * head_dim, 2 * h),
        f"{m}self_attn.k_proj.weight": (kv_heads * head_dim, 2 * h),
        f"{m}self_attn.v_proj.weight": (kv_heads * head_dim, 2 * h),
        f"{m}self_attn.o_proj.weight": (h, heads * head_dim),
        f"{m}mlp.gate_proj.weight": (inter, h),
        f"{m}mlp.up_proj.weight": (inter, h),
        f"{m}mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (n, h),
        **maps,
    }


def read_safetensors_folder(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DraftFormatError(f"{folder}: no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for key, value in load_file(str(f)).items():
            if key in tensors:
                raise DraftFormatError(f"{folder}: tensor '{key}' appears in more than one file")
            tensors[key] = value
    return tensors


def read_flat_checkpoint(folder: str | Path) -> FlatCheckpoint:
    """Read and strictly check a flat ``LlamaForCausalLMEagle3`` draft: every key present, none unexpected, shapes
    and the vocabulary map consistent with config.json. Raises DraftFormatError naming the culprit."""
    from .records import FormatError
    from .records_vocab import check_vocab_mapping

    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise DraftFormatError(f"{folder}: no {CONFIG_FILE} (expected a flat LlamaForCausalLMEagle3 draft folder)")
    config = json.loads(config_path.read_text())
    if "speculators_config" in config:
        raise DraftFormatError(f"{config_path}: a speculators-format draft; --finetune-from expects the flat layout")
    arch = config.get("architectures") or []
    if not any(a in FLAT_ARCHITECTURES for a in arch):
        hint = " (an MLA draft: train.draft eagle3_mla)" if any("Deepseek" in a for a in arch) else ""
        raise DraftFormatError(f"{config_path}: architectures {arch} is not one of {FLAT_ARCHITECTURES}{hint}")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "draft_vocab_size", "vocab_size"):
        if key not in config:
            raise DraftFormatError(f"{config_path}: lacks '{key}'")
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise DraftFormatError(f"{config_path}: num_hidden_layers {config['num_hidden_layers']}, only 1 is supported")
    for where, aux in (("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids")),
                       ("eagle_config.eagle_aux_hidden_state_layer_ids",
                        (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))):
        if aux is not None and len(aux) != 3:  # absent is allowed: the engines then capture their default
            raise DraftFormatError(f"{config_path}: {where} must list 3 ids, got {aux}")

    tensors = read_safetensors_folder(folder)
    expected = flat_tensor_shapes(config, num_aux=3)
    vocab = int(config["vocab_size"])
    optional = {"embed_tokens.weight": (vocab, int(config["hidden_size"])),
                **({"d2t": (vocab,), "t2d": (vocab,)} if int(config["draft_vocab_size"]) == vocab else {})}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - set(optional))
    if missing:
        raise DraftFormatError(f"{folder}: missing tensors {missing}")
    if unexpected:
        raise DraftFormatError(f"{folder}: unexpected tensors {unexpected} (not part of the flat EAGLE-3 layout)")
    for key, value in tensors.items():
        want = {**expected, **optional}[key]
        if tuple(value.shape) != want:
            raise DraftFormatError(f"{folder}: tensor '{key}' has shape {tuple(value.shape)}, config says {want}")
    if "d2t" not in tensors:  # the whole vocabulary, in order
        tensors["d2t"], tensors["t2d"] = torch.zeros(vocab, dtype=torch.int64), torch.ones(vocab, dtype=torch.bool)
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    try:
        check_vocab_mapping(tensors["d2t"], tensors["t2d"], where=str(folder))
    except FormatError as e:
        raise DraftFormatError(str(e)) from None
    return FlatCheckpoint(folder=folder, config=config, tensors=tensors)


def layer_config_from_flat(config: dict):
    """The draft decoder's LlamaConfig from a flat draft's own config.json (its head_dim, not the verifier's)."""
    from transformers import LlamaConfig

    fields = {k: config[k] for k in LAYER_CONFIG_FIELDS if k in config and config[k] is not None}
    fields.setdefault("head_dim", int(config["hidden_size"]) // int(config["num_attention_heads"]))
    return LlamaConfig(num_hidden_layers=1, tie_word_embeddings=False, **fields)


def verifier_text_config(verifier: str | Path, trust_remote_code: bool = False):
    """The verifier's text config (Kimi-K2.5's nested text_config unwrapped), loaded as stage 02 loads it."""
    from .verifier import load_text_config

    return load_text_config(verifier, trust_remote_code)[0]


MLA_VERIFIER_DRAFT_HEAD_DIM = 128  # a new MHA draft beside an MLA verifier: the published K2/K2.5 drafts' head size


def draft_attention_geometry(text_config, num_heads: int = 0, num_kv_heads: int = 0,
                             head_dim: int = 0) -> tuple[int, int, int]:
    """(heads, KV heads, head dim) of a new draft's attention: each value given, or (0) the verifier's, read from
    its text config (an object or config.json's dict). By default a draft of a dense verifier shares its attention
    geometry, which vLLM 0.26-0.28 need to serve it on their default path (FlashAttention-3 plans every layer with
    the verifier's geometry, vllm#53336; on the FlexAttention workaround a speculation step cost 7.6x a plain one on
    an H100). An MLA verifier (a ``kv_lora_rank``) has no per-head keys to share: its query heads, as many KV heads,
    and head dim 128. Raises ValueError when the heads cannot share the KV heads."""
    get = text_config.get if isinstance(text_config, dict) else (lambda k, d=None: getattr(text_config, k, d))
    verifier_heads = int(get("num_attention_heads"))
    heads = num_heads or verifier_heads
    if get("kv_lora_rank"):
        kv_heads, dim = num_kv_heads or heads, head_dim or MLA_VERIFIER_DRAFT_HEAD_DIM
    else:
        kv_heads = num_kv_heads or int(get("num_key_value_heads") or verifier_heads)
        dim = head_dim or int(get("head_dim") or int(get("hidden_size")) // verifier_heads)
    if heads % kv_heads:
        raise ValueError(f"a draft of {heads} attention heads cannot share keys/values among {kv_heads} KV heads: "
                         "set train.draft_num_kv_heads to a divisor of train.draft_num_heads")
    return heads, kv_heads, dim


def fresh_layer_config(verifier: str | Path, num_heads: int, num_kv_heads: int, head_dim: int,
                       intermediate_size: int, trust_remote_code: bool = False):
    """A new draft's LlamaConfig: hidden size, vocab, norm eps, rope and activation from the verifier; attention
    geometry by ``draft_attention_geometry`` (0 = the verifier's) and MLP width as given (0 = the verifier's dense
    intermediate size)."""
    from transformers import LlamaConfig

    text = verifier_text_config(verifier, trust_remote_code)
    heads, kv_heads, dim = draft_attention_geometry(text, num_heads, num_kv_heads, head_dim)
    return LlamaConfig(
        hidden_size=text.hidden_size,
        intermediate_size=intermediate_size or text.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=dim,
        hidden_act=getattr(text, "hidden_act", "silu"),
        rms_norm_eps=text.rms_norm_eps,
        max_position_embeddings=text.max_position_embeddings,
        rope_parameters=dict(getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}),
        vocab_size=text.vocab_size,
        num_hidden_layers=1,
        tie_word_embeddings=False,
    )


def build_draft_model(layer_config, *, verifier: str | Path, aux_layer_ids: list[int], d2t: torch.Tensor,
                      t2d: torch.Tensor, ttt_steps: int, attn_impl: str, norm_flags: dict | None = None):
    """speculators' Eagle3DraftModel with the verifier's embedding, final norm and lm_head rows (t2d) loaded."""
    from speculators.models.eagle3 import Eagle3DraftModel

    flags = dict(SPECFORGE_NORM_FLAGS if norm_flags is None else norm_flags)
    return Eagle3DraftModel.from_training_args(
        verifier_config=layer_config,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=str(verifier),
        draft_vocab_size=int(d2t.shape[0]),
        ttt_steps=ttt_steps,
        target_layer_ids=list(aux_layer_ids),
        draft_attn_impl=attn_impl,
        **flags,
    )


def remap_lm_head(old_lm_head: torch.Tensor, old_d2t: torch.Tensor, new_d2t: torch.Tensor,
                  new_default_rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """lm_head rows for a new draft vocabulary: a token both maps share keeps its trained row (moved to its new
    draft index); a new token gets its row from ``new_default_rows`` (the verifier's). Returns (rows, shared)."""
    old_targets = torch.arange(old_d2t.shape[0]) + old_d2t  # [N_old] target ids
    new_targets = torch.arange(new_d2t.shape[0]) + new_d2t  # [N_new]
    size = int(max(old_targets.max(), new_targets.max())) + 1
    old_index = torch.full((size,), -1, dtype=torch.long)
    old_index[old_targets] = torch.arange(old_d2t.shape[0])
    source = old_index[new_targets]  # [N_new]: old draft index of each new token, -1 if new
    rows = new_default_rows.detach().clone().to(old_lm_head.dtype)
    shared = source >= 0
    rows[shared] = old_lm_head[source[shared]]
    return rows, int(shared.sum())


def model_vocab_map(model) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a speculators draft on CPU; the identity when it drafts the whole vocabulary (no buffers)."""
    if model.d2t is None:
        return (torch.zeros(model.draft_vocab_size, dtype=torch.int64),
                torch.ones(model.verifier_vocab_size, dtype=torch.bool))
    return model.d2t.cpu(), model.t2d.cpu()


def load_flat_into_model(model, ckpt: FlatCheckpoint) -> dict:
    """Copy a flat checkpoint's weights into ``model`` (midlayer.* -> layers.0.*). The model's vocabulary map must
    be the checkpoint's, or its lm_head rows are remapped (shared tokens keep their rows, new ones take the
    verifier's). Every trainable key must be filled exactly once. Returns {"remapped": bool, "shared": int}."""
    state: dict[str, torch.Tensor] = {}
    for key, value in ckpt.tensors.items():
        if key in ("d2t", "t2d", "embed_tokens.weight"):
            continue
        name = MODEL_LAYER_PREFIX + key[len(FLAT_LAYER_PREFIX):] if key.startswith(FLAT_LAYER_PREFIX) else key
        state[name] = value
    return load_warm_start(model, state, ckpt)


def load_warm_start(model, state: dict[str, torch.Tensor], ckpt) -> dict:
    """Copy a warm start's tensors (``state``, in the model's names; ``ckpt``: its folder, tensors and vocab map)
    into ``model``. The model's vocabulary map must be the checkpoint's, or its lm_head rows are remapped (shared
    tokens keep their rows, new ones take the verifier's); an embedding the checkpoint carries must be the
    verifier's (vLLM and speculators use the verifier's: a checkpoint trained against another one would silently
    change its function); every draft-owned key is filled (the verifier's embedding, lm_head source and norm
    excepted, and d2t/t2d, which 03's map decides), no key left over, each of the model's shape; refused naming the
    key otherwise. Returns {"remapped": bool, "shared": int}."""
    info = {"remapped": False, "shared": ckpt.draft_vocab_size}
    ours_d2t, ours_t2d = model_vocab_map(model)
    if not (torch.equal(ours_d2t, ckpt.d2t) and torch.equal(ours_t2d, ckpt.t2d)):
        rows, shared = remap_lm_head(ckpt.tensors["lm_head.weight"], ckpt.d2t, ours_d2t,
                                     model.verifier_lm_head.weight.detach().cpu())
        state["lm_head.weight"] = rows
        info = {"remapped": True, "shared": shared}
        log.info("vocab map differs from %s: lm_head rows remapped (%d of %d draft tokens shared, the rest from the "
                 "verifier's lm_head)", ckpt.folder, shared, rows.shape[0])
    if "embed_tokens.weight" in ckpt.tensors:
        ours = model.embed_tokens.weight.detach().cpu().float()
        if not torch.allclose(ckpt.tensors["embed_tokens.weight"].float(), ours):
            raise DraftFormatError(f"{ckpt.folder}: embed_tokens.weight differs from the verifier's embedding (a "
                                   "draft of another model)")
    own_state = model.state_dict()
    own = {k for k in own_state if k not in VERIFIER_OWNED_KEYS and k not in ("d2t", "t2d")}
    missing, unexpected = sorted(own - set(state)), sorted(set(state) - own)
    if missing or unexpected:
        raise DraftFormatError(f"{ckpt.folder}: model keys not filled {missing}; checkpoint keys unused {unexpected}")
    for key, value in state.items():
        if tuple(own_state[key].shape) != tuple(value.shape):
            raise DraftFormatError(f"{ckpt.folder}: '{key}' has shape {tuple(value.shape)}, the draft expects "
                                   f"{tuple(own_state[key].shape)}")
    with torch.no_grad():
        for key, value in state.items():
            own_state[key].copy_(value)
    return info


def load_finetune_draft(folder: str | Path, *, verifier: str | Path, d2t: torch.Tensor, t2d: torch.Tensor,
                        aux_layer_ids: list[int], ttt_steps: int, attn_impl: str):
    """Build the draft a flat checkpoint describes (its own layer config, SpecForge norm flags) on the given
    vocabulary map, and load its weights. Returns (model, checkpoint, info)."""
    ckpt = read_flat_checkpoint(folder)  # a vocabulary size other than vocab/'s: 03 --rebuild's, rows remapped
    model = build_draft_model(layer_config_from_flat(ckpt.config), verifier=verifier, aux_layer_ids=aux_layer_ids,
                              d2t=d2t, t2d=t2d, ttt_steps=ttt_steps, attn_impl=attn_impl)
    info = load_flat_into_model(model, ckpt)
    return model, ckpt, info


def replace_dir(tmp: Path, out_dir: Path) -> None:
    """Move a fully written ``tmp`` folder to ``out_dir``; an old ``out_dir`` is removed only after."""
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The aux ids vLLM and SGLang capture when a draft names none: (2, L // 2, L - 3), states entering those
    layers (vLLM's ``get_eagle3_default_aux_hidden_state_layers``, SGLang's ``layer_ids is None`` branch)."""
    return [2, num_layers // 2, num_layers - 3]


def sglang_aux_layer_ids(vllm_ids: list[int]) -> tuple[list[int], str]:
    """What to write in ``eagle_config.eagle_aux_hidden_state_layer_ids`` (the only place SGLang reads) so that
    SGLang captures the states entering layers ``vllm_ids``, and a warning ('' when every SGLang reads it right).

    SGLang captures ``hidden_states + residual`` before layer i runs for each i in ``layers_to_capture`` (the same
    state as vLLM's id i). Up to sglang#25454 (merged 2026-05-16) ``set_eagle3_layers_to_capture`` set
    ``layers_to_capture = [id + 1 for id in ids]`` ("output of layer" convention); since then it adds one only when
    the first id is 1. So ids starting at 2 (the default (2, L/2, L-3); K2.5: 2, 30, 58) are written minus one,
    which every SGLang turns back into them; other ids cannot be read right by both SGLang generations."""
    ids = list(vllm_ids)
    if ids[0] == 2:
        return [k - 1 for k in ids], ""
    if ids[0] == 1:  # SGLang >= #25454 cannot name the state entering layer 1; older SGLang reads 0 + 1
        return [k - 1 for k in ids], (f"SGLang since sglang#25454 cannot capture aux ids {ids} (a first id 1 gets "
                                      "+1); the export serves SGLang before it")
    return ids, (f"SGLang before sglang#25454 adds one to aux ids {ids}; the export serves SGLang since #25454 "
                 "(ids not starting at 1 are used as written)")


def legacy_rope_fields(rope_parameters: dict | None) -> dict:
    """``rope_theta`` / ``rope_scaling`` equal to transformers 5's ``rope_parameters``, for readers that know only
    the older fields (transformers 4.x, SGLang's llama: ``getattr(config, "rope_theta", 10000)``); without them
    such a reader silently runs a fresh K2.5 draft (YaRN x64, theta 50000) with the plain theta-10000 rope.
    transformers 5.19 reads a config holding both back to the same ``rope_parameters``."""
    rope = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    theta = float(rope.pop("rope_theta", 10000.0))
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": None}
    rope.setdefault("rope_type", kind)
    rope.setdefault("type", kind)  # the key transformers < 4.45 and some engines read
    return {"rope_theta": theta, "rope_scaling": rope}


def flat_config(model, aux_layer_ids: list[int], base_config: dict | None = None, dtype: str = "bfloat16") -> dict:
    """config.json of the flat export. Starts from ``base_config`` (a warm start's own config keeps its extra
    fields) and sets every field vLLM and SGLang read.

    Aux ids are written twice, because the engines read different keys with different meanings: top-level
    ``eagle_aux_hidden_state_layer_ids`` = ``aux_layer_ids`` in vLLM's meaning (vLLM reads this key first, and it is
    the only one vLLM read before vllm#42764), ``eagle_config.eagle_aux_hidden_state_layer_ids`` = what SGLang needs
    to capture the same states (see ``sglang_aux_layer_ids``)."""
    layer = model.config.transformer_layer_config
    config = dict(base_config or {})
    layer_dict = layer.to_dict()
    for key in LAYER_CONFIG_FIELDS:
        if key in ("rope_theta", "rope_scaling"):
            continue
        if key in layer_dict and layer_dict[key] is not None:
            config[key] = layer_dict[key]
    config.update(legacy_rope_fields(layer_dict.get("rope_parameters")))
    sglang_ids, warning = sglang_aux_layer_ids(aux_layer_ids)
    if warning:
        log.warning("export: %s", warning)
    eagle_config = dict(config.get("eagle_config") or {})
    eagle_config["eagle_aux_hidden_state_layer_ids"] = sglang_ids
    eagle_config["use_aux_hidden_state"] = True
    config.update(
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
        draft_vocab_size=int(model.draft_vocab_size),
        vocab_size=int(model.verifier_vocab_size),
        eagle_config=eagle_config,
        torch_dtype=dtype,
        norm_before_residual=bool(model.config.norm_before_residual),
        norm_before_fc=bool(model.config.norm_before_fc),
        fc_norm=bool(model.config.fc_norm),
        norm_output=bool(model.config.norm_output),
    )
    return config


def export_flat(model, out_dir: str | Path, aux_layer_ids: list[int], base_config: dict | None = None,
                dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the flat LlamaForCausalLMEagle3 layout (midlayer.*, fc, norm, lm_head, d2t, t2d; no embedding) into
    ``out_dir`` atomically (temporary folder, then rename). ``aux_layer_ids`` in vLLM's convention."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tensors: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if key in VERIFIER_OWNED_KEYS:
            continue
        if key in ("d2t", "t2d"):
            tensors[key] = value.detach().cpu().contiguous()
            continue
        name = FLAT_LAYER_PREFIX + key[len(MODEL_LAYER_PREFIX):] if key.startswith(MODEL_LAYER_PREFIX) else key
        tensors[name] = value.detach().to("cpu", dtype).contiguous()
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / FLAT_WEIGHTS_FILE), metadata={"format": "pt"})
    dtype_name = str(dtype).removeprefix("torch.")
    config = flat_config(model, aux_layer_ids, base_config, dtype_name)
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    replace_dir(tmp, out_dir)
    return out_dir


def export_speculators(model, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write speculators' own format (``speculators_model_type: eagle3``, ``layers.0.*``) atomically."""
    import copy

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    copy.deepcopy(model).to("cpu", dtype).save_pretrained(str(tmp))
    replace_dir(tmp, out_dir)
    return out_dir
