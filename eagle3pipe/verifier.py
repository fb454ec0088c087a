"""The verifier's text model for stage 02: loading (plain, Kimi-K2.5-wrapped, compressed-tensors) and exact capture
of the aux-layer states.

Layer-id contract (vLLM's): id ``k < L`` is the residual stream *entering* decoder layer ``k`` (= HF
``output_hidden_states[k]``), id ``L`` is the last decoder layer's output *before* the final norm. Both are taken
with hooks on the decoder layers, so nothing else (all L+1 states, the lm_head) is kept or computed.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import torch

from .cli import StageError

log = logging.getLogger(__name__)

# Kimi-K2.5's released checkpoint keeps the text model under language_model.*; mapping it away lets the plain
# DeepseekV3 classes load those weights (without it they stay randomly initialised with only a warning).
WRAPPED_KEY_MAPPING = {r"^language_model\.": ""}


class VerifierLoadError(StageError):
    """The verifier folder cannot be loaded exactly; the message names the folder and the keys (a one-line
    ``error:`` from the stage door, as every known failure)."""


def load_model_config(verifier: str | Path, trust_remote_code: bool = False):
    """The verifier's config.json as a transformers config. transformers' own class is used whenever it knows the
    model type (``kimi_k25`` natively from 5.13), even with ``trust_remote_code``: a remote config class is not
    registered with AutoModel, so the text model could not be built from it."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = Path(verifier) / "config.json"
    if not path.is_file():
        raise VerifierLoadError(f"{verifier}: no config.json (is --verifier the model folder?)")
    native = json.loads(path.read_text()).get("model_type") in CONFIG_MAPPING
    return AutoConfig.from_pretrained(str(verifier), trust_remote_code=trust_remote_code and not native)


def load_text_config(verifier: str | Path, trust_remote_code: bool = False):
    """(text config, wrapped): the decoder config, unwrapped from a nested ``text_config`` (Kimi-K2.5)."""
    config = load_model_config(verifier, trust_remote_code)
    text = config.get_text_config()
    wrapped = text is not config
    if text.model_type != type(text).model_type:
        # Shim for transformers 5.19's K2.5 config: it builds the released text_config (model_type "kimi_k2") as a
        # DeepseekV3Config but keeps "kimi_k2" on the instance; weight conversion is looked up by model type, so
        # the per-expert weights would never be fused and the load refused. The class's own type is the truth.
        log.info("%s: text_config model_type %r read as %r", verifier, text.model_type, type(text).model_type)
        text.model_type = type(text).model_type
    quant = getattr(config, "quantization_config", None)
    if wrapped and quant is not None and getattr(text, "quantization_config", None) is None:
        # K2.5 puts quantization_config at the top level; the text model must see it to load int4 weights.
        text.quantization_config = quant
    return text, wrapped


def load_text_model(verifier: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | None = None,
                    device_map: str | dict | None = None, trust_remote_code: bool = False):
    """The verifier's decoder stack (e.g. ``DeepseekV3Model``) without its lm_head, in eval mode.

    Refuses when any weight of the decoder is missing from the checkpoint (it would silently stay random)."""
    from transformers import AutoModel

    text_config, wrapped = load_text_config(verifier, trust_remote_code)
    kwargs: dict = {"config": text_config, "dtype": dtype, "output_loading_info": True}
    if wrapped:
        kwargs["key_mapping"] = WRAPPED_KEY_MAPPING
    if device_map is not None:
        kwargs["device_map"] = device_map
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report lists every lm_head / vision tensor we leave out on purpose
    try:
        model, info = AutoModel.from_pretrained(str(verifier), **kwargs)
    except (OSError, RuntimeError, ValueError) as e:  # a truncated download, a shard missing, shapes that differ
        raise VerifierLoadError(f"{verifier}: transformers could not load the decoder: "
                                f"{str(e).strip().splitlines()[-1][:500]}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    unexpected = list(info.get("unexpected_keys", []))
    if unexpected:
        log.info("%s: %d checkpoint tensors outside the decoder stack not loaded (e.g. %s)", verifier,
                 len(unexpected), sorted(unexpected)[:3])
    missing = list(info.get("missing_keys", []))
    if missing:
        raise VerifierLoadError(
            f"{verifier}: {len(missing)} decoder weights not found in the checkpoint (first: {sorted(missing)[:5]}); "
            "they would stay randomly initialised"
        )
    if device is not None and device_map is None:
        model = model.to(device)
    model.eval()
    log.info("verifier %s loaded: %s, %d layers, hidden %d, %s%s", verifier, type(model).__name__,
             text_config.num_hidden_layers, text_config.hidden_size, dtype,
             " (text model of a wrapped checkpoint)" if wrapped else "")
    return model


def decoder_layers(model) -> torch.nn.ModuleList:
    layers = getattr(model, "layers", None)
    if layers is None and hasattr(model, "model"):
        layers = getattr(model.model, "layers", None)
    if layers is None:
        raise VerifierLoadError(f"{type(model).__name__} has no decoder layer list (.layers)")
    return layers


def state_names(aux_layer_ids: list[int], num_layers: int) -> list[str]:
    """What each stored state is, for the manifest."""
    names = [f"entering decoder layer {k}" if k < num_layers else "final (pre-norm)" for k in aux_layer_ids]
    return names + [f"final: output of decoder layer {num_layers - 1}, before the final norm"]


class AuxStateCapture:
    """Runs the decoder stack and returns ``[B, T, len(aux_layer_ids) + 1, H]``: aux states, then the final state.

    A forward pre-hook on layer k takes its input (id k); a forward hook on the last layer takes its output
    (id L). The hooks hold references only; decoder layers return new tensors, so nothing is overwritten later.
    """

    def __init__(self, model, aux_layer_ids: list[int]):
        self.model = model
        layers = decoder_layers(model)
        self.num_layers = len(layers)
        bad = [k for k in aux_layer_ids if not 0 <= k <= self.num_layers]
        if bad:
            raise VerifierLoadError(f"aux layer ids {bad} out of range for a {self.num_layers}-layer verifier "
                                    f"(valid: 0..{self.num_layers}); fix shared.aux_layer_ids / --aux-layer-ids")
        self.aux_layer_ids = list(aux_layer_ids)
        self._slots: dict[int, torch.Tensor] = {}
        self._handles = []
        for k in sorted(set(aux_layer_ids)):
            if k < self.num_layers:
                self._handles.append(layers[k].register_forward_pre_hook(self._pre_hook(k), with_kwargs=True))
        self._handles.append(layers[-1].register_forward_hook(self._post_hook(self.num_layers), with_kwargs=True))

    def _pre_hook(self, layer_id: int):
        def hook(module, args, kwargs):
            self._slots[layer_id] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _post_hook(self, layer_id: int):
        def hook(module, args, kwargs, output):
            self._slots[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        self._slots.clear()
        self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        final_device = self._slots[self.num_layers].device
        # with a layer split, the states live on different GPUs: gather them where the final one is
        states = [self._slots[k].to(final_device) for k in self.aux_layer_ids] + [self._slots[self.num_layers]]
        self._slots.clear()
        return torch.stack(states, dim=2)  # [B, T, n_aux + 1, H]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def checkpoint_tensor_names(verifier: str | Path) -> list[str]:
    """Names of all tensors in the verifier's safetensors files (for load checks)."""
    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(Path(verifier).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            names.extend(h.keys())
    return names


def mapped_name(name: str, wrapped: bool) -> str:
    """Checkpoint tensor name -> the decoder model's parameter name (prefixes removed)."""
    if wrapped:
        name = re.sub(r"^language_model\.", "", name)
    return re.sub(r"^model\.", "", name)


def checkpoint_tensor_files(verifier: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (the index when there is one, else every file's header)."""
    from safetensors import safe_open

    folder = Path(verifier)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    out: dict[str, Path] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({name: f for name in h.keys()})
    return out


class OutputHead:
    """The verifier's final norm and lm_head, read by name from its safetensors (no model is built): they turn a
    stored final state (pre-norm) into next-token logits, so stage 02 can check its states against the server's
    own predictions."""

    def __init__(self, verifier: str | Path, trust_remote_code: bool = False):
        from safetensors import safe_open

        text, wrapped = load_text_config(verifier, trust_remote_code)
        prefix = "language_model." if wrapped else ""
        head = f"{prefix}{'model.embed_tokens' if text.tie_word_embeddings else 'lm_head'}.weight"
        files = checkpoint_tensor_files(verifier)
        for name in (f"{prefix}model.norm.weight", head):
            if name not in files:
                raise VerifierLoadError(f"{verifier}: tensor {name} not found (a quantized lm_head is not supported)")

        def read(name: str) -> torch.Tensor:
            with safe_open(str(files[name]), "pt") as h:
                return h.get_tensor(name)

        self.norm_weight = read(f"{prefix}model.norm.weight").float()
        self.lm_head = read(head)  # [V, H] as stored (bf16 for K2.5: 2.3 GB)
        self.eps = float(text.rms_norm_eps)

    @torch.no_grad()
    def top1(self, final_states: torch.Tensor, vocab_chunk: int = 16384) -> torch.Tensor:
        """Argmax next token after each position: lm_head(RMSNorm(state)) in fp32, vocabulary in chunks. [T]"""
        x = final_states.float()  # [T, H]
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        best = torch.full((x.shape[0],), -float("inf"))
        best_id = torch.zeros(x.shape[0], dtype=torch.long)
        for start in range(0, self.lm_head.shape[0], vocab_chunk):
            logits = x @ self.lm_head[start:start + vocab_chunk].float().T  # [T, chunk]
            value, idx = logits.max(dim=-1)
            better = value > best
            best = torch.where(better, value, best)
            best_id = torch.where(better, idx + start, best_id)
        return best_id


def verifier_load_bytes(verifier: str | Path, model_dtype: str, trust_remote_code: bool = False) -> int:
    """Bytes of the decoder stack as transformers loads it, from the safetensors headers (no weight is read):
    every decoder tensor in ``model_dtype``, compressed-tensors int4 ``weight_packed`` counted decompressed (8
    values per int32; transformers decompresses on load), their scales and shapes and everything outside the
    decoder (lm_head, vision tower) not counted."""
    from safetensors import safe_open

    _, wrapped = load_text_config(verifier, trust_remote_code)
    decoder = ("language_model." if wrapped else "") + "model."
    elem = getattr(torch, model_dtype).itemsize
    by_file: dict[Path, list[str]] = {}
    for name, file in checkpoint_tensor_files(verifier).items():
        if name.startswith(decoder) and not name.endswith(("weight_scale", "weight_shape", "weight_zero_point")):
            by_file.setdefault(file, []).append(name)
    total = 0
    for file, names in by_file.items():
        with safe_open(str(file), "pt") as h:
            for name in names:
                numel = math.prod(h.get_slice(name).get_shape())
                total += numel * (8 if name.endswith("weight_packed") else 1) * elem
    return total
