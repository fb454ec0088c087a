"""DFlash drafts: speculators' ``DFlashDraftModel`` built for our verifier, z-lab's published format read into it,
and the export vLLM serves (``--speculative-config {"method": "dflash", ...}``). draft.py is the EAGLE-3 counterpart.

A DFlash draft proposes a whole block in one forward: the block is the last verified token followed by
``block_size - 1`` mask tokens, its layers attend bidirectionally within the block and to the verifier's states of
every earlier token (``fc`` over the states of ``train.draft_layer_ids``, injected as keys/values of every layer).
vLLM drafts k = block_size - 1 tokens per step with it.

speculators' format (what 04 trains and exports)::

    config.json        speculators_model_type "dflash", architectures [DFlashDraftModel], transformer_layer_config
                       (qwen3: hidden, heads, head_dim, kv heads, MLP, rope_parameters, layer_types all
                       full_attention), aux_hidden_state_layer_ids (vLLM's ids: the state entering layer k),
                       block_size, mask_token_id, draft_vocab_size, sliding_window_non_causal (true: see below),
                       sample_from_anchor (false), speculators_config {algorithm dflash, proposal_methods
                       [{greedy, speculative_tokens: block_size - 1}], verifier {name_or_path, architectures}}
    model.safetensors  fc.weight [H, n*H], hidden_norm.weight [H], norm.weight [H], layers.N.{input_layernorm,
                       post_attention_layernorm}.weight, layers.N.self_attn.{q,k,v,o}_proj.weight,
                       layers.N.self_attn.{q,k}_norm.weight [head_dim], layers.N.mlp.{gate,up,down}_proj.weight;
                       with a draft vocabulary smaller than the verifier's also lm_head.weight [N, H], d2t [N], t2d [V]

z-lab's format (published drafts such as z-lab/Kimi-K2.5-DFlash, read by ``read_zlab``)::

    config.json        a Qwen3 config + architectures [DFlashDraftModel], block_size (top level or in
                       dflash_config), num_target_layers, dflash_config {target_layer_ids: "output of layer L" ids =
                       ours - 1, mask_token_id}; no layer_types = every layer full attention, non-causal
    model.safetensors  the same body keys; no embedding and no lm_head (the verifier's own)

Two traps this module closes (tests/test_draft_dflash.py):
(a) vLLM's speculators adapter serves every layer causal unless the config says ``sliding_window_non_causal:
    true`` (``dflash_config.causal = not sliding_window_non_causal``), while speculators trains full-attention
    layers bidirectionally whatever the flag says: the export always writes true (speculators' default and its
    own z-lab converter write false).
(b) K2.5's YaRN rope (factor 64, mscale = mscale_all_dim = 1): transformers 5.19 and vLLM >= 0.32 scale the
    draft's attention by 1.0, vLLM 0.26 (and z-lab's K2.5 draft) by 1 + 0.1 ln 64 = 1.4159. The layer config
    writes that factor explicitly (``attention_factor``), which every one of them honours.
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

from .draft import DraftFormatError, VERIFIER_OWNED_KEYS, remap_lm_head, replace_dir

log = logging.getLogger(__name__)

SPECULATORS_TYPE = "dflash"
ARCHITECTURE = "DFlashDraftModel"
CONFIG_FILE = "config.json"
FULL_ATTENTION = "full_attention"
# z-lab config keys that are not the draft decoder's (speculators' DFlashConverter drops the same)
ZLAB_NON_LAYER_KEYS = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers", "torch_dtype",
                       "dtype", "transformers_version")
# z-lab features speculators' DFlashDraftModel does not have: refused rather than silently dropped
ZLAB_DEFAULTS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
# z-lab keys of DFlash2 / fused variants that speculators' model has no place for
ZLAB_FOREIGN_KEY_PARTS = ("qkv_proj", ".g_proj.", "aux_hidden_norms", "attention_conv", "mlp_conv",
                          "candidate_selector")


def is_dflash_config(config: dict) -> bool:
    """A draft config.json of either DFlash format (speculators' or z-lab's)."""
    return config.get("speculators_model_type") == SPECULATORS_TYPE or is_zlab_config(config)


def is_zlab_config(config: dict) -> bool:
    return "speculators_model_type" not in config and ARCHITECTURE in (config.get("architectures") or []) \
        and "dflash_config" in config


def yarn_rope(rope: dict | None) -> dict:
    """``rope`` with YaRN's attention factor written out (trap (b) in the module docstring): for a YaRN rope that
    names none, 1 + 0.1 ln(factor), the value vLLM 0.26 and z-lab's K2.5 draft use, so that training
    (transformers), vLLM 0.26 and vLLM >= 0.32 all scale the draft's attention alike."""
    rope = dict(rope or {"rope_type": "default", "rope_theta": 10000.0})
    kind = rope.get("rope_type") or rope.get("type")
    factor = float(rope.get("factor") or 1.0)
    if kind == "yarn" and rope.get("attention_factor") is None and factor > 1:
        rope["attention_factor"] = 0.1 * math.log(factor) + 1.0
    return rope


# ---------------------------------------------------------------------------------------------------------------
# Building the draft


def layer_config(verifier: str | Path, *, num_layers: int, num_heads: int, head_dim: int, num_kv_heads: int,
                 intermediate_size: int, trust_remote_code: bool = False):
    """A new DFlash draft's decoder (Qwen3Config): hidden size, vocabulary, norm eps, rope (``yarn_rope``) and
    activation from the verifier; heads (0 = the verifier's), head_dim (0 = a dense verifier's, beside MLA 128), KV
    heads (0 = heads), MLP width (0 = the verifier's dense intermediate size) and layer count as given; every layer
    full attention (non-causal)."""
    from transformers import Qwen3Config

    from .draft import draft_attention_geometry, verifier_text_config

    text = verifier_text_config(verifier, trust_remote_code)
    heads = num_heads or text.num_attention_heads
    head_dim = head_dim or draft_attention_geometry(text)[2]  # 0: a dense verifier's; beside MLA 128
    return Qwen3Config(
        vocab_size=text.vocab_size, hidden_size=text.hidden_size,
        intermediate_size=intermediate_size or text.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=num_kv_heads or heads, head_dim=head_dim,
        hidden_act=getattr(text, "hidden_act", "silu"), rms_norm_eps=text.rms_norm_eps,
        max_position_embeddings=text.max_position_embeddings,
        rope_parameters=yarn_rope(getattr(text, "rope_parameters", None)), attention_bias=False,
        layer_types=[FULL_ATTENTION] * num_layers, use_sliding_window=False, tie_word_embeddings=False)


def build_model(layer, *, verifier: str | Path, layer_ids: list[int], d2t: torch.Tensor, t2d: torch.Tensor,
                block_size: int, mask_token_id: int, attn_impl: str):
    """speculators' DFlashDraftModel with the verifier's embedding, final norm and lm_head rows (t2d) loaded. Its
    layers are full attention, trained bidirectionally (speculators always does for full attention) and exported
    with ``sliding_window_non_causal`` true so vLLM serves them so (trap (a))."""
    from speculators.models.dflash import DFlashDraftModel

    return DFlashDraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=d2t, verifier_name_or_path=str(verifier),
        draft_vocab_size=int(d2t.shape[0]), block_size=block_size, target_layer_ids=list(layer_ids),
        mask_token_id=int(mask_token_id), draft_attn_impl=attn_impl, sliding_window_non_causal=True,
        sample_from_anchor=False)


def max_anchors(total_seq_len: int, configured: int) -> int:
    """Blocks trained per packed row: ``train.dflash_max_anchors``, or speculators' 512 per 8192 tokens."""
    return configured or max(1, total_seq_len // 16)


def trainer_kwargs(*, loss: str, position_weight: str, gamma: float, anchors: int) -> dict:
    """The forward's keyword arguments, from speculators' own ``get_trainer_kwargs`` (eager loss: the fused one
    needs Triton and crashed under torch.compile on the H200)."""
    from speculators.models.dflash import DFlashDraftModel

    train_kwargs, _ = DFlashDraftModel.get_trainer_kwargs(
        loss_fn=loss, loss_implementation="eager", dflash_decay_gamma=gamma, max_anchors=anchors,
        per_position_loss_weight=position_weight, dpace_alpha=0.5)
    return train_kwargs


# ---------------------------------------------------------------------------------------------------------------
# Reading a published draft (warm start)


@dataclass
class DFlashCheckpoint:
    """A DFlash draft read from disk, in our terms whichever format it came in."""

    folder: Path
    source: str  # "zlab" or "speculators"
    layer: dict  # the decoder's Qwen3 config fields
    layer_ids: list[int]  # vLLM's ids (state entering layer k)
    block_size: int
    mask_token_id: int
    tensors: dict[str, torch.Tensor]  # body keys as DFlashDraftModel names them (+ lm_head, d2t, t2d if it has them)


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
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


def read_checkpoint(folder: str | Path, num_verifier_layers: int) -> DFlashCheckpoint:
    """A z-lab or speculators DFlash draft folder, checked: z-lab's "output of layer L" ids become ours (L + 1; the
    verifier's last layer's output, which 02 always stores as the final state, may not be among them), features
    speculators' model lacks are refused, naming the key."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise DraftFormatError(f"{folder}: no {CONFIG_FILE} (expected a DFlash draft folder)")
    config = json.loads(path.read_text())
    if not is_dflash_config(config):
        raise DraftFormatError(f"{path}: not a DFlash draft (neither speculators_model_type dflash nor z-lab's "
                               f"architectures [{ARCHITECTURE}] with dflash_config)")
    tensors = _read_tensors(folder)
    foreign = sorted(k for k in tensors if any(part in k for part in ZLAB_FOREIGN_KEY_PARTS))
    if foreign:
        raise DraftFormatError(f"{folder}: tensors {foreign[:4]} belong to a DFlash variant speculators' "
                               "DFlashDraftModel does not have (fused qkv, DFlash2 convolutions / selector)")
    if not is_zlab_config(config):
        layer = dict(config["transformer_layer_config"])
        for key in ("aux_hidden_state_layer_ids", "mask_token_id", "block_size"):
            if config.get(key) is None:
                raise DraftFormatError(f"{path}: lacks '{key}'")
        return DFlashCheckpoint(folder, "speculators", layer, list(config["aux_hidden_state_layer_ids"]),
                                int(config["block_size"]), int(config["mask_token_id"]), tensors)
    dflash = config["dflash_config"] or {}
    for key, default in ZLAB_DEFAULTS.items():
        value = dflash.get(key, config.get(key, default))
        if value != default and not (default is None and not value):
            raise DraftFormatError(f"{path}: {key} {value} (speculators' DFlashDraftModel has no such feature; "
                                   f"only {default} converts exactly)")
    if config.get("is_causal") or any(t != FULL_ATTENTION for t in config.get("layer_types") or []):
        raise DraftFormatError(f"{path}: causal or sliding-window layers (is_causal / layer_types): only all "
                               "full-attention, non-causal z-lab drafts convert")
    block = config.get("block_size") or dflash.get("block_size")
    zlab_ids, mask = dflash.get("target_layer_ids"), dflash.get("mask_token_id")
    if block is None or zlab_ids is None or mask is None:
        raise DraftFormatError(f"{path}: needs block_size, dflash_config.target_layer_ids and "
                               "dflash_config.mask_token_id")
    ids = [k + 1 for k in zlab_ids]  # z-lab reads hidden_states[L + 1] (model.py extract_context_feature)
    if any(k >= num_verifier_layers for k in ids):
        raise DraftFormatError(f"{path}: target_layer_ids {zlab_ids} name the output of the verifier's last layer "
                               f"(of {num_verifier_layers}): that is the final state, not an aux state we store")
    layer = {k: v for k, v in config.items() if k not in ZLAB_NON_LAYER_KEYS and k not in ZLAB_DEFAULTS
             and k != "is_causal"}
    return DFlashCheckpoint(folder, "zlab", layer, ids, int(block), int(mask), tensors)


def layer_config_from_checkpoint(ckpt: DFlashCheckpoint):
    """The checkpoint's own decoder config (its dims, not ours), all full attention, YaRN factor written out."""
    from transformers import Qwen3Config

    layer = Qwen3Config(**{k: v for k, v in ckpt.layer.items() if k != "model_type"})
    layer.layer_types = [FULL_ATTENTION] * layer.num_hidden_layers
    layer.rope_parameters = yarn_rope(layer.rope_parameters)
    return layer


def load_into_model(model, ckpt: DFlashCheckpoint) -> dict:
    """Copy a checkpoint's body into ``model`` (strict: every trainable key filled once, shapes equal). The lm_head
    of a draft vocabulary comes from the checkpoint when it has one (rows remapped to our map), else stays the
    verifier's rows (z-lab's head is the verifier's own: exact). Returns {"lm_head": where its rows came from}."""
    own_state = model.state_dict()
    skip = set(VERIFIER_OWNED_KEYS) | {"d2t", "t2d", "lm_head.weight"}
    body = {k: v for k, v in ckpt.tensors.items() if k not in skip}
    own = {k for k in own_state if k not in skip}
    missing, unexpected = sorted(own - set(body)), sorted(set(body) - own)
    if missing or unexpected:
        raise DraftFormatError(f"{ckpt.folder}: model keys not filled {missing[:6]}; checkpoint keys unused "
                               f"{unexpected[:6]}")
    for key, value in body.items():
        if tuple(own_state[key].shape) != tuple(value.shape):
            raise DraftFormatError(f"{ckpt.folder}: '{key}' has shape {tuple(value.shape)}, the draft expects "
                                   f"{tuple(own_state[key].shape)}")
    info = {"lm_head": "verifier rows"}
    if model.use_draft_vocab and "lm_head.weight" in ckpt.tensors:
        if "d2t" not in ckpt.tensors:
            raise DraftFormatError(f"{ckpt.folder}: an lm_head without d2t: its rows' tokens are unknown")
        rows, shared = remap_lm_head(ckpt.tensors["lm_head.weight"], ckpt.tensors["d2t"].to(torch.int64),
                                     model.d2t.cpu(), model.lm_head.weight.detach().cpu())
        body["lm_head.weight"] = rows
        info = {"lm_head": f"checkpoint rows for {shared} of {rows.shape[0]} tokens, verifier rows for the rest"}
    with torch.no_grad():
        for key, value in body.items():
            own_state[key].copy_(value)
    return info


# ---------------------------------------------------------------------------------------------------------------
# Export and what vLLM reads of it


def served_layers_causal(config: dict) -> list[bool]:
    """Per draft layer, whether vLLM (0.32-0.34, ``qwen3_dflash._dflash_layer_causal`` after the speculators
    adapter) runs it causal: speculators' format sets ``dflash_config.causal = not sliding_window_non_causal``
    (absent = false) for every layer; z-lab's, ``is_causal`` or else sliding layers only."""
    if is_zlab_config(config):
        layer = config
        override = config.get("is_causal", (config.get("dflash_config") or {}).get("causal"))
    else:
        layer = config.get("transformer_layer_config") or {}
        override = not config.get("sliding_window_non_causal", True)
    n = int(layer.get("num_hidden_layers", 1))
    if override is not None:
        return [bool(override)] * n
    types = layer.get("layer_types") or [FULL_ATTENTION] * n
    return [t == "sliding_attention" for t in types]


def trained_layers_causal(config: dict) -> list[bool]:
    """Per layer, whether speculators trained it causal: full attention never; sliding layers unless
    sliding_window_non_causal (SP models/dflash/attention.py)."""
    layer = config.get("transformer_layer_config") or config
    n = int(layer.get("num_hidden_layers", 1))
    types = layer.get("layer_types") or [FULL_ATTENTION] * n
    non_causal = bool(config.get("sliding_window_non_causal", False))
    return [t == "sliding_attention" and not non_causal for t in types]


def speculative_tokens(config: dict) -> int:
    """k vLLM drafts per step with this draft: speculators' proposal speculative_tokens, z-lab's block_size - 1."""
    if is_zlab_config(config):
        return int(config.get("block_size") or config["dflash_config"]["block_size"]) - 1
    return int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])


def check_served(config: dict, folder: Path) -> list[str]:
    """Problems vLLM would have serving this DFlash draft (empty: none): no mask token (vLLM's adapter raises
    KeyError), no layer ids, or layers served causal that were trained bidirectionally (trap (a))."""
    problems = []
    if is_zlab_config(config):
        dflash = config.get("dflash_config") or {}
        for key in ("mask_token_id", "target_layer_ids"):
            if dflash.get(key) is None:
                problems.append(f"dflash_config.{key} missing")
        return problems
    for key in ("mask_token_id", "aux_hidden_state_layer_ids", "block_size"):
        if config.get(key) is None:
            problems.append(f"'{key}' missing (vLLM's speculators adapter needs it)")
    if served_layers_causal(config) != trained_layers_causal(config):
        problems.append(f"vLLM would run its layers causal={served_layers_causal(config)} but speculators trained "
                        f"them causal={trained_layers_causal(config)}: write sliding_window_non_causal: true in "
                        f"{folder / CONFIG_FILE}")
    return problems


def export(model, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """speculators' own format (``save_pretrained``), bf16, atomically (temporary folder, then rename), checked to
    serve as trained (trap (a)) and to name its layer ids and mask token."""
    import copy

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    copy.deepcopy(model).to("cpu", dtype).save_pretrained(str(tmp))
    config = json.loads((tmp / CONFIG_FILE).read_text())
    problems = check_served(config, tmp)
    if problems:  # an internal invariant: build_model always sets what vLLM needs
        raise AssertionError(f"DFlash export {out_dir}: {'; '.join(problems)}")
    replace_dir(tmp, out_dir)
    return out_dir
