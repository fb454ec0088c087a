"""Stage 04 online vs offline on one GPU at Kimi-K2.5 draft dims, the extraction replayed from files: what the online
data path itself costs the training step when extraction keeps up.

vLLM cannot run on the device machine, so the extraction server here is a replay: a local HTTP server that speaks
the extraction API 04 online uses (``/v1/models``, ``/health``, ``/v1/completions`` naming ``hidden_states_path``)
and answers each request by copying the stage-02 file already written for that prompt to the requested spool path
(a real server writes the same bytes there). Everything on 04's side is the real online path: stage 02's Extractor
and ServerPool, ``check_file`` on every file, the spool budget, the prefetcher thread, the offline collate in the
training loop, deleting a step's files. Offline and online run ``04_train.py`` through its door on the same rows
(bench_train's stage-02-format fp8 files of 1200-3000 tokens, 32768-token rows), interleaved ``--repeat`` times;
the rates are bench_train's (tokens between two logged steps after warm-up). The capture check is off (the states are
random, so no server could agree with them: ``extract.verify_tokens 0``).

Usage (device): python bench/bench_online_gpu.py --work /tmp/bench --out $OUT
       (CPU smoke on toy dims):  python bench/bench_online_gpu.py --tiny
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

from bench_train import K25, TINY, e2e, samples_needed, write_data, write_verifier  # noqa: E402
from eagle3pipe.progress import setup_logging  # noqa: E402
from eagle3pipe.records import DataDir, hs_bytes_estimate, load_training_rows, read_jsonl  # noqa: E402

log = logging.getLogger("bench_online_gpu")


class ReplayExtractionServer:
    """The extraction API answered from files: the prompt's stage-02 file copied to the path the request names."""

    def __init__(self, data_dir: Path):
        dd = DataDir(data_dir)
        self.files = {tuple(r.input_ids): dd.hs_file(i) for i, r in enumerate(load_training_rows(dd.prepared_data))}
        self.copied = 0
        self.copy_s = 0.0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's server

            def log_message(self, *args):
                pass

            def _reply(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._reply({"object": "list", "data": [{"id": "replay", "object": "model",
                                                         "max_model_len": 1 << 20}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                path = body["kv_transfer_params"]["hidden_states_path"]
                t0 = time.perf_counter()
                shutil.copyfile(server.files[tuple(body["prompt"])], path)
                with server.lock:
                    server.copied += 1
                    server.copy_s += time.perf_counter() - t0
                self._reply({"id": "c", "object": "text_completion", "model": "replay",
                             "kv_transfer_params": {"hidden_states_path": path},
                             "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy dims on CPU (smoke test of this script)")
    p.add_argument("--work", default="/tmp/bench_online_gpu")
    p.add_argument("--out", default="")
    p.add_argument("--tokens", type=int, default=32768, help="packed-row length (train.total_seq_len)")
    p.add_argument("--measure-steps", type=int, default=8)
    p.add_argument("--skip-steps", type=int, default=4)
    p.add_argument("--log-every", type=int, default=2)
    p.add_argument("--workers", type=int, default=8, help="offline loader workers (online reads in the trainer)")
    p.add_argument("--spool-rows", type=float, default=8.0, help="train.spool_gb as this many full packed rows")
    p.add_argument("--concurrency", type=int, default=8, help="extract.concurrency of the online run")
    p.add_argument("--repeat", type=int, default=1, help="offline/online pairs, the order alternating")
    p.add_argument("--online-first", action="store_true", help="the first pair runs online first")
    args = p.parse_args()
    setup_logging(None)
    dims, device = (TINY, "cpu") if args.tiny else (K25, "cuda")
    tokens = 256 if args.tiny else args.tokens
    lengths = (40, 90) if args.tiny else (1200, 3000)
    aux = [2, 4, 5] if args.tiny else [2, 30, 58]
    storage = "fp8"
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    results: dict = {"dims": dims, "tokens_per_row": tokens, "storage": storage, "argv": sys.argv[1:],
                     "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__}
    verifier = write_verifier(work / "verifier", dims)
    data = work / "data"
    samples = samples_needed(tokens, args.skip_steps + args.measure_steps + 1, lengths)
    t0 = time.perf_counter()
    n_tok = write_data(data, verifier, dims, samples, lengths, storage, aux, device, prepared=True)
    log.info("data: %d samples, %d tokens written in %.1fs", samples, n_tok, time.perf_counter() - t0)
    if device == "cuda":
        torch.cuda.empty_cache()  # the runs are other processes: leave them the GPU
    row_bytes = hs_bytes_estimate(tokens, 1, 4, dims["hidden"], storage)  # a full row's upper bound, as 04 reckons it
    spool_gb = args.spool_rows * row_bytes / 1e9
    replay = ReplayExtractionServer(data)
    online = {"train": {"data_source": "online", "spool_gb": spool_gb},
              "extract": {"input": "prepared", "backend": "vllm", "extract_url": [replay.url], "verify_tokens": 0,
                          "concurrency": args.concurrency}}
    workers = 2 if args.tiny else args.workers

    def dump() -> None:
        if out:
            (out / "bench_online_gpu.json").write_text(json.dumps(results, indent=2) + "\n")

    try:
        for rep in range(args.repeat):
            for mode in (("offline", "online") if (rep + args.online_first) % 2 == 0 else ("online", "offline")):
                copied, copy_s = replay.copied, replay.copy_s
                r = e2e(data, verifier, dims, aux, tokens, workers, device, skip_steps=args.skip_steps,
                        drop_cache=False, log_every=args.log_every, storage=storage, tag=f"_{mode}{rep}",
                        overrides=online if mode == "online" else None)
                if mode == "online":
                    rec = [x for x in read_jsonl(DataDir(data).train_metrics) if x["kind"] == "online"]
                    r.update(spool_gb=spool_gb, files_replayed=replay.copied - copied,
                             replay_copy_s=replay.copy_s - copy_s, online=rec)
                results[f"{mode}_r{rep}"] = r
                log.info("%s r%d: %s", mode, rep, {k: v for k, v in r.items() if k != "online"})
                dump()
    finally:
        replay.close()

    def mean(mode: str, key: str) -> float:
        runs = [v for k, v in results.items() if k.startswith(mode + "_r")]
        return sum(x[key] for x in runs) / len(runs)

    results["ratio_online_to_offline_tokens_per_s"] = mean("online", "tokens_per_s") / mean("offline", "tokens_per_s")
    dump()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
