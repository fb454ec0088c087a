"""Stage 05: measure the exported draft where it matters, in vLLM: acceptance length, per position, and tokens/s.

Starts (or, with ``--eval-url``, uses) a vLLM server that serves the verifier with the draft
(``--speculative-config {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": k}``), sends the held-out
prompts through the chat API at ``--concurrency``, and reads the server's ``/metrics`` speculative-decoding
counters before and after. Between the two scrapes:

- acceptance length = 1 + accepted / drafts: the mean number of tokens one verify step emits (the bonus token the
  verifier always adds, plus the accepted draft tokens). This is vLLM's "mean acceptance length" and the figure
  EAGLE-3 papers and the AQ-MedAI / lightseek model cards quote;
- per-position acceptance = accepted at position i / drafts: the chance that draft token i (and all before it) is
  accepted;
- draft acceptance rate = accepted / draft tokens.

Where vLLM returns them (>= 0.32 started with ``--per-request-spec-decode-metrics``, which servers started here
get), the figures come from each response's own counters (``metrics.speculative_decoding``: verify steps, drafted
and accepted tokens, histogram of accepted counts), so other traffic on a shared server cannot leak in; otherwise
from the global ``/metrics`` delta, with a warning. ``k`` is read back from the server (the responses'
``num_spec_tokens``, or the number of per-position counters vLLM creates at start), not taken from the config.

Servers started here: CPU-only settings (``--enforce-eager``, ``VLLM_CPU_KVCACHE_SPACE``) only when the vLLM
interpreter is a CPU build (``evaluate.vllm_platform``, asked from vLLM by default), ``evaluate.server_args``
replacing those defaults, ``--tensor-parallel-size`` and ``--trust-remote-code`` from the config, and
``evaluate.server_start_timeout_s`` to load in.

Then, unless ``--no-baseline``, the same prompts go to a server without the draft (started here, or
``--baseline-url``) for tokens/s without speculation. Outputs: ``eval/report.json``, ``eval/report.md`` (the
table), ``eval/acceptance.png`` (per-position acceptance).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path

from .chat import ChatError, normalize_messages, question_messages
from .cli import StageError
from .config import PipelineConfig
from .records import DataDir, FormatError, read_jsonl, save_eval_report
from .server import ServerError, ServerMetrics, VllmServer, auth_headers, make_async_client, probe_vllm, read_metrics

log = logging.getLogger(__name__)

SPEC_METRICS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                "vllm:spec_decode_num_accepted_tokens_total")
PER_REQUEST_FLAG = "--per-request-spec-decode-metrics"
CPU_DEFAULT_ARGS = ["--enforce-eager"]  # CPU: start-up ~30 s instead of ~60 s; on a GPU it would disable CUDA graphs
CPU_KV_CACHE_GIB = 1


def load_eval_prompts(path: Path, limit: int) -> list[dict]:
    """The first ``limit`` prompts of a JSONL chat file (``messages``/``conversations``), cut at the last user turn."""
    if not path.is_file():
        raise FileNotFoundError(f"evaluation prompts not found: {path} (flag --prompts)")
    prompts = []
    for i, row in enumerate(read_jsonl(path), 1):
        try:
            messages = question_messages(normalize_messages(row))
        except ChatError as e:
            raise FormatError(f"{path}:{i}: {e}") from None
        prompts.append({"id": str(row.get("id", f"line-{i}")), "messages": messages})
        if limit and len(prompts) == limit:
            break
    if not prompts:
        raise FormatError(f"{path}: no prompts")
    return prompts


def speculative_config(draft_dir: Path, k: int) -> str:
    return json.dumps({"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k})


def _served_model(url: str) -> str:
    import httpx2

    resp = httpx2.get(url.rstrip("/") + "/v1/models", headers=auth_headers(), timeout=10.0)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def _send_all(url: str, prompts: list[dict], cfg: PipelineConfig) -> dict:
    """Send every prompt at ``evaluate.concurrency``; returns completion-token totals and wall time."""
    ev = cfg.evaluate
    model = _served_model(url)
    client = make_async_client(url, timeout_s=ev.request_timeout_s)
    gate = asyncio.Semaphore(ev.concurrency)
    completion_tokens: list[int] = []
    finish_reasons: dict[str, int] = {}
    spec_stats: list[dict | None] = []  # each response's own speculative-decoding counters (None: not returned)

    async def one(prompt: dict) -> None:
        async with gate:
            resp = await client.chat.completions.create(
                model=model, messages=prompt["messages"], max_completion_tokens=ev.max_completion_tokens,
                temperature=ev.temperature, seed=cfg.shared.seed,
                extra_body={"chat_template_kwargs": {"thinking": cfg.shared.thinking}},
            )
            completion_tokens.append(resp.usage.completion_tokens)
            reason = resp.choices[0].finish_reason
            finish_reasons[reason] = finish_reasons.get(reason, 0) + 1
            spec_stats.append(((resp.model_extra or {}).get("metrics") or {}).get("speculative_decoding"))

    t0 = time.monotonic()
    try:
        await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()
    wall = time.monotonic() - t0
    total = sum(completion_tokens)
    return {"requests": len(completion_tokens), "completion_tokens": total, "wall_s": round(wall, 3),
            "tokens_per_s": round(total / wall, 2) if wall > 0 else None, "finish_reasons": finish_reasons,
            "spec_stats": spec_stats}


def acceptance_figures(drafts: int, draft_tokens: int, accepted: int, per_position: list[int]) -> dict:
    """The report's acceptance figures from counts (see the module docstring for the definitions)."""
    return {
        "drafts": int(drafts),
        "draft_tokens": int(draft_tokens),
        "accepted_tokens": int(accepted),
        "accepted_per_position": [int(x) for x in per_position],
        "acceptance_length": round(1.0 + accepted / drafts, 4) if drafts > 0 else None,
        "acceptance_length_definition": "1 + accepted / drafts (mean tokens emitted per verify step)",
        "per_position_acceptance": [round(x / drafts, 4) for x in per_position] if drafts > 0 else [],
        "draft_acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens > 0 else None,
    }


def per_request_delta(stats: list[dict]) -> dict:
    """Acceptance figures summed over responses' own ``metrics.speculative_decoding`` (vLLM >= 0.32): verify steps
    (``num_spec_steps``), drafted and accepted tokens, and per position i the steps that accepted more than i
    drafts (from ``acceptance_histogram``: entry j = steps that accepted exactly j)."""
    k = max(int(st["num_spec_tokens"]) for st in stats)
    per_position = [0] * k
    for st in stats:
        hist = st["acceptance_histogram"]
        for i in range(k):
            per_position[i] += sum(hist[i + 1:])
    return acceptance_figures(sum(int(st["num_spec_steps"]) for st in stats),
                              sum(int(st["num_draft_tokens"]) for st in stats),
                              sum(int(st["num_accepted_draft_tokens"]) for st in stats), per_position)


def spec_decode_delta(before: ServerMetrics, after: ServerMetrics) -> dict:
    """Acceptance figures from two /metrics scrapes (see the module docstring for the definitions)."""
    drafts = after.spec_decode_drafts - before.spec_decode_drafts
    draft_tokens = after.spec_decode_draft_tokens - before.spec_decode_draft_tokens
    accepted = after.spec_decode_accepted_tokens - before.spec_decode_accepted_tokens
    pos_after, pos_before = after.spec_decode_accepted_per_position(), before.spec_decode_accepted_per_position()
    pos_before = pos_before + [0.0] * (len(pos_after) - len(pos_before))
    per_position = [a - b for a, b in zip(pos_after, pos_before)]
    return acceptance_figures(drafts, draft_tokens, accepted, per_position)


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
                "enforce_eager": False, "kv_cache_gib": CPU_KV_CACHE_GIB if on_cpu else None,
                "tensor_parallel_size": tp, "trust_remote_code": cfg.shared.trust_remote_code,
                "startup_timeout_s": ev.server_start_timeout_s,
                "per_request_metrics": bool(env and env.per_request_spec_metrics)}
    log.info("vLLM platform %s (%s), tensor parallel %d, flags %s", platform,
             "from evaluate.vllm_platform" if ev.vllm_platform != "auto" else "as vLLM reports it", tp,
             settings["extra_args"] or "none beyond the required ones")
    return settings


@contextmanager
def _server(url: str, model_dir: str, extra_args: list[str], log_file: Path, served_name: str, settings: dict):
    """Use the server at ``url`` when given, else start one (stopped on exit) and yield its URL."""
    if url:
        yield url.rstrip("/")
        return
    kwargs = {k: v for k, v in settings.items() if k not in ("extra_args", "per_request_metrics")}
    server = VllmServer(model_dir, extra_args=extra_args + settings["extra_args"], log_file=log_file,
                        served_model_name=served_name, **kwargs)
    try:
        server.start()
    except ServerError as e:  # a known failure: one line naming the log, not a traceback
        raise StageError(f"{e}\n(evaluate.server_args, evaluate.server_start_timeout_s)") from None
    try:
        yield server.url
    finally:
        server.stop()


def measure(url: str, prompts: list[dict], cfg: PipelineConfig, with_draft: bool) -> dict:
    """Warm up, scrape /metrics, send the prompts, scrape again; tokens/s and (with the draft) acceptance, from
    the responses' own counters where the server returns them, else from the /metrics delta (with a warning)."""
    warmup = prompts[: min(len(prompts), cfg.evaluate.concurrency, 4)]
    asyncio.run(_send_all(url, warmup, cfg))  # first requests pay one-off costs (graphs, caches): not timed
    before = read_metrics(url)
    if with_draft and not all(before.has(m) for m in SPEC_METRICS):
        raise StageError(f"server {url} exposes no speculative-decoding counters in /metrics "
                         f"({', '.join(SPEC_METRICS)}): is it serving with --speculative-config?")
    result = asyncio.run(_send_all(url, prompts, cfg))
    after = read_metrics(url)
    stats = result.pop("spec_stats")
    result["server_generation_tokens"] = int(after.generation_tokens - before.generation_tokens)
    if not with_draft:
        return result
    global_delta = spec_decode_delta(before, after)
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


def plot_acceptance(report: dict, path: Path) -> None:
    """Bar chart of per-position acceptance (accepted at position i / drafts), acceptance length in the title."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    wd = report["with_draft"]
    rates = wd["per_position_acceptance"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([str(i) for i in range(len(rates))], rates, color="#4477aa")
    for i, r in enumerate(rates):
        ax.text(i, r + 0.01, f"{r:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_title(f"k = {report['num_speculative_tokens']}, acceptance length {wd['acceptance_length']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def run_evaluate(cfg: PipelineConfig) -> dict:
    started = time.time()
    ev, dd = cfg.evaluate, DataDir(cfg.data_dir)
    draft_dir = Path(ev.draft) if ev.draft else dd.final_checkpoint
    if not ev.eval_url and not (draft_dir / "config.json").is_file():
        raise FileNotFoundError(f"no exported draft at {draft_dir} (config.json missing): run 04_train.py or pass "
                                "--draft DIR")
    if not ev.eval_url and not Path(cfg.shared.verifier).is_dir():
        raise FileNotFoundError(f"verifier folder not found: {cfg.shared.verifier} (flag --verifier)")
    prompts = load_eval_prompts(Path(ev.prompts), ev.num_prompts)
    log.info("evaluating draft %s at k=%d on %d prompts from %s, concurrency %d", draft_dir,
             ev.num_speculative_tokens, len(prompts), ev.prompts, ev.concurrency)
    served_name = "verifier"
    starts_a_server = not ev.eval_url or (ev.baseline and not ev.baseline_url)
    settings = server_settings(cfg) if starts_a_server else {}
    spec_args = ["--speculative-config", speculative_config(draft_dir.resolve(), ev.num_speculative_tokens)]
    if settings.get("per_request_metrics") and PER_REQUEST_FLAG not in ev.server_args:
        spec_args += [PER_REQUEST_FLAG, "summary"]
    with _server(ev.eval_url, cfg.shared.verifier, spec_args, dd.eval_server_log("draft"), served_name,
                 settings) as url:
        with_draft = measure(url, prompts, cfg, with_draft=True)
    k = with_draft.pop("num_speculative_tokens")
    if k != ev.num_speculative_tokens:
        log.warning("the server at %s drafts k = %d tokens per step, evaluate.num_speculative_tokens says %d: the "
                    "report gives the server's k", ev.eval_url or "(started here)", k, ev.num_speculative_tokens)
    log.info("with draft (k = %d): acceptance length %s, per position %s, %.1f tokens/s; from %s", k,
             with_draft["acceptance_length"], with_draft["per_position_acceptance"], with_draft["tokens_per_s"] or 0,
             with_draft["acceptance_source"])
    baseline = None
    if ev.baseline and (ev.baseline_url or not ev.eval_url):
        with _server(ev.baseline_url, cfg.shared.verifier, [], dd.eval_server_log("baseline"), served_name,
                     settings) as url:
            baseline = measure(url, prompts, cfg, with_draft=False)
        log.info("without draft: %.1f tokens/s", baseline["tokens_per_s"] or 0)
    report = {
        "draft": str(draft_dir),
        "verifier": cfg.shared.verifier,
        "prompts": ev.prompts,
        "num_prompts": len(prompts),
        "num_speculative_tokens": k,
        "concurrency": ev.concurrency,
        "max_completion_tokens": ev.max_completion_tokens,
        "temperature": ev.temperature,
        "with_draft": with_draft,
        "without_draft": baseline,
        "speedup": (round(with_draft["tokens_per_s"] / baseline["tokens_per_s"], 3)
                    if baseline and baseline["tokens_per_s"] and with_draft["tokens_per_s"] else None),
        "elapsed_s": round(time.time() - started, 1),
    }
    save_eval_report(dd, report, cfg.section_hash("shared", "evaluate"), cfg.to_dict())
    plot_acceptance(report, dd.eval_plot)
    log.info("eval report written to %s\n%s", dd.eval_report, dd.eval_markdown.read_text())
    return report
