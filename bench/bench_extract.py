"""Benchmark of stage 02 on one GPU: a Kimi-K2.5-shaped DeepseekV3 stack with random weights.

Measures, in one process (results appended to ``--out``/results.json as they come, so a cut run keeps them):
1. pure forward of the stack (capture hooks on, no lm_head), eager: tok/s and TFLOP/s for several batch shapes,
   and a torch.profiler table of one batch (where the forward waits: GPU busy share, host syncs);
2. the GIL probe: the forward's time alone and while 8 threads write sample files with safetensors' ``save_file``
   and with ours (``records.save_tensors_atomic``, os.write from the buffer);
3. pure write bandwidth of sample files on the output disk with 1/4/8/16 threads;
4. stage 02 end to end (``run_extract``: batching, capture, device-to-host ring, writer threads, journal, finalize)
   on synthetic rows, bf16 and fp8 storage, with the in-memory random model standing in for the checkpoint loader
   (a 100 GB random checkpoint cannot be written to the 64 GB disk), against forward-only time and write-only time
   for the same batches and files (same writer, same threads), side by side;
5. the same forward under ``torch.compile`` (last: its compile time is the least predictable).

Usage (device machine): ``python bench/bench_extract.py --out $OUT [--moe-layers N] [--e2e-tokens 320000]``
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3pipe import extract as extract_mod  # noqa: E402
from eagle3pipe import extract_worker  # noqa: E402
from eagle3pipe.config import load_config  # noqa: E402
from eagle3pipe.records import (  # noqa: E402
    DataDir,
    atomic_write_bytes,
    encode_hidden_states,
    hidden_states_tensors,
    save_hidden_states,
    tmp_path_for,
)
from eagle3pipe.verifier import AuxStateCapture  # noqa: E402

log = logging.getLogger("bench_extract")

H, HEADS, Q_LORA, KV_LORA, ROPE, NOPE, V_DIM = 7168, 64, 1536, 512, 64, 128, 128
DENSE_I, MOE_I, EXPERTS, TOP_K, SHARED = 18432, 2048, 384, 8, 1
FULL_LAYERS = 61  # K2.5: 1 dense + 60 MoE
VOCAB = 163840
DEVICE = "cuda"
PROBE_SHAPE = (4, 2048)  # batch x seq of the profile and the GIL probe
RESULTS: dict = {}


def shrink_for_cpu_dry_run() -> None:
    """--cpu-dry-run: tiny dims on the CPU, to check the script's logic before spending device time."""
    global H, HEADS, Q_LORA, KV_LORA, ROPE, NOPE, V_DIM, DENSE_I, MOE_I, EXPERTS, TOP_K, VOCAB, DEVICE, PROBE_SHAPE
    H, HEADS, Q_LORA, KV_LORA, ROPE, NOPE, V_DIM = 128, 4, 64, 512, 64, 32, 32
    DENSE_I, MOE_I, EXPERTS, TOP_K, VOCAB, DEVICE = 256, 64, 8, 2, 1088, "cpu"
    PROBE_SHAPE = (2, 32)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def k25_config(num_layers: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=DENSE_I, moe_intermediate_size=MOE_I,
        num_hidden_layers=num_layers, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        n_shared_experts=SHARED, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.827, norm_topk_prob=True, q_lora_rank=Q_LORA,
        kv_lora_rank=KV_LORA, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V_DIM,
        max_position_embeddings=32768, rope_theta=50000.0, tie_word_embeddings=False,
    )


def layer_flops_per_token(dense: bool, ctx: float) -> float:
    """Matmul FLOPs of one decoder layer per token; ``ctx`` = mean attended length (causal: (T+1)/2)."""
    attn_proj = 2 * (H * Q_LORA + Q_LORA * HEADS * (NOPE + ROPE) + H * (KV_LORA + ROPE)
                     + KV_LORA * HEADS * (NOPE + V_DIM) + HEADS * V_DIM * H)
    attn_core = 2 * ctx * HEADS * ((NOPE + ROPE) + V_DIM)
    mlp = 2 * 3 * H * DENSE_I if dense else 2 * 3 * H * MOE_I * (TOP_K + SHARED) + 2 * H * EXPERTS
    return attn_proj + attn_core + mlp


def stack_flops(num_layers: int, batch: int, seq: int) -> float:
    ctx = (seq + 1) / 2
    per_token = sum(layer_flops_per_token(i == 0, ctx) for i in range(num_layers))
    return per_token * batch * seq


def save(out: Path) -> None:
    (out / "results.json").write_text(json.dumps(RESULTS, indent=2) + "\n")


def timed(fn, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` runs, after one warm-up (synchronised host clock)."""
    fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def bench_forward(model, capture, num_layers: int, shapes, label: str, out: Path, iters: int = 5) -> None:
    rows = []
    for batch, seq in shapes:
        ids = torch.randint(0, VOCAB, (batch, seq), device=DEVICE)
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        s = timed(lambda: capture(ids), iters)
        flops = stack_flops(num_layers, batch, seq)
        row = {"batch": batch, "seq": seq, "s": round(s, 4), "tok_s": round(batch * seq / s),
               "tflop_s": round(flops / s / 1e12, 1), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if DEVICE == "cuda" else 0}
        log.info("%s forward %dx%d: %s", label, batch, seq, row)
        rows.append(row)
        RESULTS[f"forward_{label}"] = rows
        save(out)


def safetensors_save_file(path: Path, hs, ids, storage: str = "bf16") -> int:
    """The first writer: safetensors' own save_file + fsync + rename (for comparison)."""
    from safetensors.torch import save_file

    tmp = tmp_path_for(path)
    save_file(hidden_states_tensors(hs, ids, storage), str(tmp))
    fd = os.open(tmp, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    os.replace(tmp, path)
    return path.stat().st_size


def bench_writes(out: Path, disk_dir: Path, total_gb: float) -> None:
    t, n = 2048, 4
    hs = torch.randn(t, n, H, dtype=torch.bfloat16).pin_memory() if DEVICE == "cuda" else torch.randn(t, n, H).bfloat16()
    ids = torch.arange(t)
    data = encode_hidden_states(hs, ids, "bf16")
    files = max(8, int(total_gb * 1e9 / len(data)))
    rows = []
    # "raw": prepared bytes, temp name + fsync + rename (the disk); "stage": save_hidden_states from the pinned
    # tensor (os.write straight from its memory, what the stage's writer threads run); "save_file": safetensors'
    writers = {"raw": lambda path: atomic_write_bytes(path, data),
               "stage": lambda path: save_hidden_states(path, hs, ids, "bf16"),
               "save_file": lambda path: safetensors_save_file(path, hs, ids)}
    for kind, write in writers.items():
        for threads in (1, 4, 8, 16):
            if kind == "save_file" and threads not in (1, 8):
                continue
            folder = disk_dir / f"write_{kind}_{threads}"
            folder.mkdir(parents=True, exist_ok=True)
            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda i: write(folder / f"hs_{i}.safetensors"), range(files)))
            s = time.perf_counter() - start
            rows.append({"writer": kind, "threads": threads, "files": files,
                         "gb": round(files * len(data) / 1e9, 2), "gb_s": round(files * len(data) / 1e9 / s, 2)})
            log.info("write bandwidth: %s", rows[-1])
            shutil.rmtree(folder)
            RESULTS["write_bandwidth"] = rows
            save(out)


def gil_probe(capture, out: Path, disk_dir: Path, iters: int = 6) -> None:
    """Forward time alone vs while 8 threads write 117 MB sample files: safetensors' save_file vs ours."""
    ids = torch.randint(0, VOCAB, PROBE_SHAPE, device=DEVICE)
    t = 2048
    hs = torch.randn(t, 4, H, dtype=torch.bfloat16)
    hs = hs.pin_memory() if DEVICE == "cuda" else hs
    tok = torch.arange(t)
    writers = {"none": None, "save_file": lambda p: safetensors_save_file(p, hs, tok),
               "ours": lambda p: save_hidden_states(p, hs, tok, "bf16")}
    rows = []
    for kind, write in writers.items():
        stop = threading.Event()
        folder = disk_dir / f"gil_{kind}"
        folder.mkdir(parents=True, exist_ok=True)
        written = [0]

        def loop(k):
            i = 0
            while not stop.is_set():
                write(folder / f"w{k}_{i % 2}.safetensors")
                written[0] += 1
                i += 1

        threads = [threading.Thread(target=loop, args=(k,)) for k in range(8)] if write else []
        for th in threads:
            th.start()
        time.sleep(0.5 if write else 0)
        s = timed(lambda: capture(ids), iters)
        stop.set()
        for th in threads:
            th.join()
        shutil.rmtree(folder)
        rows.append({"writers": kind, "forward_s": round(s, 4), "files_written": written[0]})
        log.info("GIL probe: %s", rows[-1])
    base = rows[0]["forward_s"]
    for r in rows:
        r["slowdown"] = round(r["forward_s"] / base, 3)
    RESULTS["gil_probe_forward_4x2048_with_8_writer_threads"] = rows
    save(out)


def profile_forward(capture, out: Path) -> None:
    """torch.profiler over 3 forwards of 4 x 2048: GPU busy share, host syncs, the top ops (text table to $OUT)."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, VOCAB, PROBE_SHAPE, device=DEVICE)
    capture(ids)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(3):
            capture(ids)
        sync()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    syncs = {e.key: e.count for e in events if any(k in e.key for k in (
        "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize", "aten::item",
        "aten::_local_scalar_dense", "aten::nonzero"))}
    launches = sum(e.count for e in events if "LaunchKernel" in e.key or e.key.startswith("cuLaunch"))
    RESULTS["forward_profile_3x_4x2048"] = {
        "wall_s": round(wall, 4), "gpu_kernel_s": round(gpu_us / 1e6, 4),
        "gpu_busy_share": round(gpu_us / 1e6 / wall, 3), "host_sync_ops": syncs, "kernel_launches": launches}
    (out / "profile_forward.txt").write_text(
        events.table(sort_by="self_cuda_time_total", row_limit=30) + "\n\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=30))
    log.info("forward profile: %s", RESULTS["forward_profile_3x_4x2048"])
    save(out)


def _gpu_profile(fn) -> dict:
    """Run ``fn`` under torch.profiler: wall, summed kernel time, busy share, allocator calls, and the table."""
    from torch.profiler import ProfilerActivity, profile

    def alloc_retries() -> int:
        return torch.cuda.memory_stats().get("num_alloc_retries", 0) if DEVICE == "cuda" else 0

    retries = alloc_retries()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    calls = {e.key: e.count for e in events if e.key in ("cudaMalloc", "cudaFree", "cudaStreamSynchronize",
                                                          "cudaEventSynchronize", "cudaHostAlloc")}
    return {"wall_s": round(wall, 3), "gpu_kernel_s": round(gpu_us / 1e6, 3),
            "gpu_busy_share": round(gpu_us / 1e6 / wall, 3),
            "runtime_calls": calls, "alloc_retries": alloc_retries() - retries,
            "table": events.table(sort_by="self_cuda_time_total", row_limit=25)}


def bench_end_to_end(model, num_layers: int, out: Path, disk_dir: Path, tokens: int, storage: str,
                     batch_tokens: int, writer_threads: int, max_pending: int, compiled: bool = False,
                     profile: bool = False) -> None:
    """Stage 02 end to end vs forward-only and write-only for the same batches and files. ``compiled``: the model's
    decoder layers were compiled (extract_worker.compile_layers; the first forward-only pass compiles)."""
    rng = random.Random(0)
    root = disk_dir / f"e2e_{storage}"
    shutil.rmtree(root, ignore_errors=True)
    verifier = root / "verifier"
    verifier.mkdir(parents=True)
    model.config.save_pretrained(str(verifier))  # config only: the loader is replaced by the in-memory model
    rows, total = [], 0
    while total < tokens:
        t = rng.randint(512, 4096)
        rows.append({"id": f"s{len(rows)}", "input_ids": [rng.randrange(VOCAB) for _ in range(t)],
                     "loss_mask": [0] * (t // 4) + [1] * (t - t // 4), "source": "bench"})
        total += t
    dd = DataDir(root / "data")
    dd.prepared_data.parent.mkdir(parents=True)
    dd.prepared_data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    aux = [1, 2, num_layers - 1] if num_layers >= 4 else [0, 1, 2]
    cfg = load_config(overrides={
        "shared": {"data_dir": str(dd.root), "verifier": str(verifier), "aux_layer_ids": aux, "hidden_size": H,
                   "progress_every_s": 5.0},
        "extract": {"input": "prepared", "device": "cuda:0" if DEVICE == "cuda" else "cpu", "storage_dtype": storage, "batch_tokens": batch_tokens,
                    "writer_threads": writer_threads, "num_workers": 1, "max_pending_batches": max_pending},
    })
    # forward-only time for the same batches (same padding), the compute floor of this run
    items = [(i, r["id"], r["input_ids"]) for i, r in enumerate(rows)]
    capture = AuxStateCapture(model, aux)
    batches = extract_worker.make_batches(items, batch_tokens)
    padded = [extract_worker.pad_batch(b) for b in batches]
    first_pass_s = 0.0
    for i in range(2):  # first pass warms kernels/heuristics for these shapes (and compiles); the second is timed
        sync()
        start = time.perf_counter()
        for ids, mask in padded:
            capture(ids.to(DEVICE), mask.to(DEVICE))
        sync()
        forward_s = time.perf_counter() - start
        first_pass_s = forward_s if i == 0 else first_pass_s
    capture.remove()
    forward_flops = sum(stack_flops(num_layers, ids.shape[0], ids.shape[1]) for ids, _ in padded)  # padded tokens
    # write-only time for the same files: the same writer and threads, from one pinned buffer per thread
    write_dir = root / "write_only"
    write_dir.mkdir()
    biggest = max(len(r["input_ids"]) for r in rows)
    src = torch.randn(biggest, len(aux) + 1, H, dtype=torch.bfloat16)
    scales_src = None
    if storage == "fp8":
        from eagle3pipe.records import quantize_hidden_states

        src, scales_src = quantize_hidden_states(src)
    src = src.pin_memory() if DEVICE == "cuda" else src
    start = time.perf_counter()
    with ThreadPoolExecutor(writer_threads) as pool:
        list(pool.map(lambda i: save_hidden_states(
            write_dir / f"hs_{i}.safetensors", src[:len(rows[i]["input_ids"])], torch.tensor(rows[i]["input_ids"]),
            storage, scales_src[:len(rows[i]["input_ids"])] if scales_src is not None else None), range(len(rows))))
    write_s = time.perf_counter() - start
    shutil.rmtree(write_dir)
    original = extract_worker.load_text_model
    original_shard = extract_mod.extract_shard
    shard_stats = {}

    def timed_shard(job):
        shard_stats.update(original_shard(job))
        return shard_stats

    original_finalize = extract_mod.finalize
    phase = {}

    def timed_finalize(*a, **k):
        t0 = time.perf_counter()
        try:
            return original_finalize(*a, **k)
        finally:
            phase["finalize"] = time.perf_counter() - t0

    extract_worker.load_text_model = lambda *a, **k: model
    extract_mod.extract_shard = timed_shard
    extract_mod.finalize = timed_finalize
    try:
        if profile:  # kernels of the forward alone vs of the whole stage loop, same batches
            def forward_pass():
                for ids, mask in padded:
                    capture.model(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), use_cache=False)

            capture = AuxStateCapture(model, aux)
            with torch.inference_mode():
                prof_fwd = _gpu_profile(forward_pass)
            capture.remove()
            box = {}
            prof_stage = _gpu_profile(lambda: box.update(m=extract_mod.run_extract(cfg)))
            manifest = box["m"]
            name = f"profile_stage_{storage}{'_compiled' if compiled else ''}"
            (out / f"{name}.txt").write_text("== forward only\n" + prof_fwd.pop("table") + "\n\n== stage 02\n"
                                              + prof_stage.pop("table"))
            RESULTS[name] = {"forward_only": prof_fwd, "stage": prof_stage,
                             "extra_gpu_kernel_s": round(prof_stage["gpu_kernel_s"] - prof_fwd["gpu_kernel_s"], 3)}
            log.info("%s: %s", name, RESULTS[name])
            save(out)
            return
        start = time.perf_counter()
        manifest = extract_mod.run_extract(cfg)
        stage_s = time.perf_counter() - start
    finally:
        extract_worker.load_text_model = original
        extract_mod.extract_shard = original_shard
        extract_mod.finalize = original_finalize
    floor = max(forward_s, write_s)
    row = {"storage": storage, "compiled": compiled, "samples": manifest.num_samples, "tokens": manifest.num_tokens,
           "batches": len(batches), "gb": round(manifest.bytes / 1e9, 2), "stage_s": round(stage_s, 2),
           "stage_tok_s": round(manifest.num_tokens / stage_s), "forward_only_s": round(forward_s, 2),
           "forward_first_pass_s": round(first_pass_s, 1),
           "forward_tflop_s": round(forward_flops / forward_s / 1e12, 1),
           "forward_pct_of_790": round(100 * forward_flops / forward_s / 790e12, 1),
           "write_only_s": round(write_s, 2), "write_only_gb_s": round(manifest.bytes / 1e9 / write_s, 2),
           "extraction_s": round(shard_stats["total_s"], 2), "forward_loop_s": round(shard_stats["loop_s"], 2),
           "loop_waited_for_free_buffer_s": round(shard_stats["slot_wait_s"], 2),
           "writer_thread_write_s": round(shard_stats["write_s"], 1),
           "writer_thread_copy_wait_s": round(shard_stats["copy_wait_s"], 1),
           "stage_over_max": round(stage_s / floor, 3), "extraction_over_max": round(shard_stats["total_s"] / floor, 3),
           "fixed_s": round(stage_s - shard_stats["total_s"], 2), "finalize_s": round(phase["finalize"], 2),
           "batch_tokens": batch_tokens,
           "writer_threads": writer_threads, "stage_gb_s": round(manifest.bytes / 1e9 / stage_s, 2)}
    # the files hold what a fresh one-sample forward gives (catches a device-to-host copy read before it landed)
    from eagle3pipe.records import load_hidden_states

    capture = AuxStateCapture(model, aux)
    per_state_median, per_state_p99, tokens_over_5pct = [], [], []
    for i in (0, manifest.num_samples // 2, manifest.num_samples - 1):
        stored = load_hidden_states(dd.hs_file(i))
        ref = capture(stored["token_ids"].view(1, -1).to(DEVICE))[0].float().cpu()  # [T, 4, H]
        err = (stored["hidden_states"].float() - ref).norm(dim=-1) / ref.norm(dim=-1)  # [T, 4] per token, state
        per_state_median.append([round(v, 4) for v in err.median(dim=0).values.tolist()])
        per_state_p99.append([round(v, 4) for v in err.quantile(0.99, dim=0).tolist()])
        tokens_over_5pct.append(round((err > 0.05).float().mean().item(), 4))
    capture.remove()
    # batched+padded (stage) vs one sample alone: bf16 noise, MoE router flips; a copy race would be ~1
    row["stored_vs_fresh_median_per_state"] = per_state_median
    row["stored_vs_fresh_p99_per_state"] = per_state_p99
    row["stored_vs_fresh_share_over_5pct"] = tokens_over_5pct
    log.info("end to end %s: %s", storage, row)
    RESULTS.setdefault("end_to_end", []).append(row)
    save(out)
    shutil.rmtree(root)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--disk-dir", default="/tmp/bench_extract")
    p.add_argument("--moe-layers", type=int, default=0, help="0 = as many as fit (weights <= free memory - 30 GB)")
    p.add_argument("--write-gb", type=float, default=6.0)
    p.add_argument("--e2e-tokens", type=int, default=320_000)
    p.add_argument("--max-pending-batches", type=int, default=4)
    p.add_argument("--skip-probes", action="store_true", help="skip the profile and the GIL probe")
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--writer-threads", type=int, default=8)
    p.add_argument("--skip-compile", action="store_true", help="skip the whole-stack compile of one shape")
    p.add_argument("--e2e-compiled", action="store_true", help="also run end to end with compiled decoder layers")
    p.add_argument("--skip-writes", action="store_true", help="skip the write-bandwidth table")
    p.add_argument("--storages", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--repeats", type=int, default=1, help="end-to-end runs per variant (each with its own floors)")
    p.add_argument("--profile-stage-tokens", type=int, default=0,
                   help="also profile a short stage run (this many tokens) against its forward, per storage")
    p.add_argument("--skip-forward", action="store_true", help="skip the forward-shape table")
    p.add_argument("--cpu-dry-run", action="store_true", help="tiny dims on the CPU: check the script, not speed")
    args = p.parse_args()
    if args.cpu_dry_run:
        shrink_for_cpu_dry_run()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out, disk = Path(args.out), Path(args.disk_dir)
    out.mkdir(parents=True, exist_ok=True)
    disk.mkdir(parents=True, exist_ok=True)
    RESULTS["device"] = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (dry run)"
    RESULTS["versions"] = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}
    RESULTS["disk"] = {"path": str(disk), "free_gb": round(shutil.disk_usage(disk).free / 1e9, 1)}
    t0 = time.perf_counter()

    free = torch.cuda.mem_get_info()[0] if DEVICE == "cuda" else 40e9
    moe_bytes = EXPERTS * 3 * H * MOE_I * 2
    n_moe = args.moe_layers or max(1, int((free - 30e9 - 2e9) // moe_bytes))
    num_layers = 1 + n_moe
    from transformers import DeepseekV3Model

    torch.manual_seed(0)
    with torch.device(DEVICE):
        torch.set_default_dtype(torch.bfloat16)
        model = DeepseekV3Model(k25_config(num_layers)).eval()
        torch.set_default_dtype(torch.float32)
    params = sum(p.numel() for p in model.parameters())
    RESULTS["stack"] = {"layers": num_layers, "dense": 1, "moe": n_moe, "params_b": round(params / 1e9, 2),
                        "weights_gib": round(params * 2 / 2**30, 1), "build_s": round(time.perf_counter() - t0, 1),
                        "experts_impl": getattr(model.config, "_experts_implementation", "?"),
                        "attn_impl": getattr(model.config, "_attn_implementation", "?")}
    log.info("stack: %s", RESULTS["stack"])
    save(out)
    aux = [1, 2, num_layers - 1] if num_layers >= 4 else [0, 1, 2]
    capture = AuxStateCapture(model, aux)
    shapes = [(1, 8192), (4, 2048), (16, 512)] if DEVICE == "cuda" else [(1, 64), (4, 16)]
    if not args.skip_forward:
        bench_forward(model, capture, num_layers, shapes, "eager", out)
        try:  # larger batches: more tokens per expert in the grouped GEMMs
            bench_forward(model, capture, num_layers, [(8, 2048), (16, 2048)] if DEVICE == "cuda" else [(8, 16)],
                          "eager_large", out)
        except torch.OutOfMemoryError as e:
            RESULTS["forward_eager_large_error"] = str(e)[:200]
            torch.cuda.empty_cache()
    if not args.skip_probes:
        profile_forward(capture, out)
        gil_probe(capture, out, disk)
    capture.remove()

    # is the non_blocking device-to-host copy pinned (so the forward loop never waits for it)?
    if DEVICE == "cuda":
        probe = torch.randn(1024, 1024, device="cuda").to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        RESULTS["d2h_non_blocking_is_pinned"] = bool(probe.is_pinned())
        save(out)

    if not args.skip_writes:
        bench_writes(out, disk, args.write_gb)
    for storage in args.storages:
        for _ in range(args.repeats):
            bench_end_to_end(model, num_layers, out, disk, args.e2e_tokens, storage, args.batch_tokens,
                             args.writer_threads, args.max_pending_batches)
        if args.profile_stage_tokens:
            bench_end_to_end(model, num_layers, out, disk, args.profile_stage_tokens, storage, args.batch_tokens,
                             args.writer_threads, args.max_pending_batches, profile=True)

    if not args.skip_compile:
        try:
            start = time.perf_counter()
            compiled = torch.compile(model, dynamic=False)
            capture = AuxStateCapture(model, aux)
            ids = torch.randint(0, VOCAB, shapes[1], device=DEVICE)
            capture.model = compiled  # hooks stay on the original layers, which the compiled graph runs
            with torch.inference_mode():
                capture(ids)
            sync()
            RESULTS["compile_s"] = round(time.perf_counter() - start, 1)
            save(out)
            bench_forward(compiled, capture, num_layers, [shapes[1]], "compiled", out)  # one shape: no recompile
        except Exception as e:  # report, keep the eager figures
            RESULTS["compile_error"] = f"{type(e).__name__}: {str(e)[:500]}"
            log.exception("torch.compile failed")
            save(out)
    if args.e2e_compiled:  # last: the model's layers stay compiled
        try:
            extract_worker.compile_layers(model)
            for storage in sorted(args.storages, reverse=True):  # fp8 first: forward and writes are close there
                for _ in range(args.repeats):
                    bench_end_to_end(model, num_layers, out, disk, args.e2e_tokens, storage, args.batch_tokens,
                                     args.writer_threads, args.max_pending_batches, compiled=True)
        except Exception as e:  # report, keep the eager figures
            RESULTS["e2e_compiled_error"] = f"{type(e).__name__}: {str(e)[:500]}"
            log.exception("compiled end to end failed")
            save(out)
    RESULTS["total_s"] = round(time.perf_counter() - t0, 1)
    save(out)
    print(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
