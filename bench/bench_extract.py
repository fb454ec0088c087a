"""Benchmark of stage 02 on one GPU: a Kimi-K2.5-shaped DeepseekV3 stack with random weights.

Measures, in one process (results appended to ``--out``/results.json as they come, so a cut run keeps them):
1. pure forward of the stack (capture hooks on, no lm_head), eager: tok/s and TFLOP/s for several batch shapes;
2. pure write bandwidth of sample files on the output disk (our encoder + atomic write with fsync) with 1/4/8 threads;
3. stage 02 end to end (``run_extract``: batching, capture, device-to-host, background writers, journal, finalize)
   on synthetic rows, bf16 and fp8 storage, with the in-memory random model standing in for the checkpoint loader
   (a 100 GB random checkpoint cannot be written to the 64 GB disk), against forward-only time for the same batches;
4. the same forward under ``torch.compile`` (last: its compile time is the least predictable).

Usage (device machine): ``python bench/bench_extract.py --out $OUT [--moe-layers N] [--e2e-tokens 160000]``
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3pipe import extract as extract_mod  # noqa: E402
from eagle3pipe import extract_worker  # noqa: E402
from eagle3pipe.config import load_config  # noqa: E402
from eagle3pipe.records import DataDir, atomic_write_bytes, encode_hidden_states, save_hidden_states  # noqa: E402
from eagle3pipe.verifier import AuxStateCapture  # noqa: E402

log = logging.getLogger("bench_extract")

H, HEADS, Q_LORA, KV_LORA, ROPE, NOPE, V_DIM = 7168, 64, 1536, 512, 64, 128, 128
DENSE_I, MOE_I, EXPERTS, TOP_K, SHARED = 18432, 2048, 384, 8, 1
FULL_LAYERS = 61  # K2.5: 1 dense + 60 MoE
VOCAB = 163840
DEVICE = "cuda"
RESULTS: dict = {}


def shrink_for_cpu_dry_run() -> None:
    """--cpu-dry-run: tiny dims on the CPU, to check the script's logic before spending device time."""
    global H, HEADS, Q_LORA, KV_LORA, ROPE, NOPE, V_DIM, DENSE_I, MOE_I, EXPERTS, TOP_K, VOCAB, DEVICE
    H, HEADS, Q_LORA, KV_LORA, ROPE, NOPE, V_DIM = 128, 4, 64, 512, 64, 32, 32
    DENSE_I, MOE_I, EXPERTS, TOP_K, VOCAB, DEVICE = 256, 64, 8, 2, 1088, "cpu"


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


def bench_writes(out: Path, disk_dir: Path, total_gb: float) -> None:
    t, n = 2048, 4
    hs = torch.randn(t, n, H, dtype=torch.bfloat16)
    ids = torch.arange(t)
    data = encode_hidden_states(hs, ids, "bf16")
    files = max(8, int(total_gb * 1e9 / len(data)))
    rows = []
    # "raw": prepared bytes, temp name + fsync + rename (the disk); "stage": save_hidden_states from the tensors
    # (safetensors save_file + fsync + rename, what the stage's writer threads run)
    writers = {"raw": lambda path: atomic_write_bytes(path, data),
               "stage": lambda path: save_hidden_states(path, hs, ids, "bf16")}
    for kind, write in writers.items():
        for threads in (1, 4, 8):
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
    # encode cost alone (the writer thread's CPU work besides the write)
    start = time.perf_counter()
    for _ in range(5):
        encode_hidden_states(hs, ids, "bf16")
    RESULTS["encode_gb_s_one_thread"] = round(5 * len(data) / 1e9 / (time.perf_counter() - start), 2)
    save(out)


def bench_end_to_end(model, num_layers: int, out: Path, disk_dir: Path, tokens: int, storage: str,
                     batch_tokens: int, writer_threads: int) -> None:
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
                    "writer_threads": writer_threads, "num_workers": 1},
    })
    # forward-only time for the same batches (same padding), the compute floor of this run
    items = [(i, r["id"], r["input_ids"]) for i, r in enumerate(rows)]
    capture = AuxStateCapture(model, aux)
    batches = extract_worker.make_batches(items, batch_tokens)
    padded = [extract_worker.pad_batch(b) for b in batches]
    for _ in range(2):  # first pass warms kernels/heuristics for these shapes; the second is timed
        sync()
        start = time.perf_counter()
        for ids, mask in padded:
            capture(ids.to(DEVICE), mask.to(DEVICE))
        sync()
        forward_s = time.perf_counter() - start
    capture.remove()
    original = extract_worker.load_text_model
    extract_worker.load_text_model = lambda *a, **k: model
    try:
        start = time.perf_counter()
        manifest = extract_mod.run_extract(cfg)
        stage_s = time.perf_counter() - start
    finally:
        extract_worker.load_text_model = original
    write_gb_s = max(r["gb_s"] for r in RESULTS.get("write_bandwidth", [{"gb_s": float("nan")}])
                     if r.get("threads", 0) <= writer_threads and r.get("writer", "stage") == "stage")
    write_s = manifest.bytes / 1e9 / write_gb_s
    row = {"storage": storage, "samples": manifest.num_samples, "tokens": manifest.num_tokens,
           "gb": round(manifest.bytes / 1e9, 2), "stage_s": round(stage_s, 2), "stage_tok_s": round(
               manifest.num_tokens / stage_s), "forward_only_s": round(forward_s, 2),
           "write_only_s_at_measured_bw": round(write_s, 2),
           "stage_over_max": round(stage_s / max(forward_s, write_s), 2), "batch_tokens": batch_tokens,
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
    p.add_argument("--e2e-tokens", type=int, default=160_000)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--writer-threads", type=int, default=8)
    p.add_argument("--skip-compile", action="store_true")
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
    bench_forward(model, capture, num_layers, shapes, "eager", out)
    capture.remove()

    # is the non_blocking device-to-host copy pinned (so the forward loop never waits for it)?
    if DEVICE == "cuda":
        probe = torch.randn(1024, 1024, device="cuda").to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        RESULTS["d2h_non_blocking_is_pinned"] = bool(probe.is_pinned())
        save(out)

    bench_writes(out, disk, args.write_gb)
    for storage in ("bf16", "fp8"):
        bench_end_to_end(model, num_layers, out, disk, args.e2e_tokens, storage, args.batch_tokens,
                         args.writer_threads)

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
    RESULTS["total_s"] = round(time.perf_counter() - t0, 1)
    save(out)
    print(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
