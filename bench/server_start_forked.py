"""What a vLLM CPU server start costs when the interpreter has already imported the API server: starts forked from
this process (which imports it once) against fresh interpreters started as the tests start them
(``tests/vllm_python``), alternating, with the ci verifier and test.sh's flags. It prices one way the suite could
shed most of a server start's imports (a pre-imported "zygote" the tests' servers fork from); the suite does not
do that (docs/development.md, "Where the 15-minute target stands").

    .venv-vllm/bin/python bench/server_start_forked.py --repeat 2

Run it from the repository root with test.sh's environment (``VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVER = "vllm.entrypoints.openai.api_server"
ARGS = ["--model", str(REPO / "data/ci/verifier"), "--host", "127.0.0.1", "--served-model-name", "verifier",
        "--reasoning-parser", "kimi_k2", "--max-model-len", "2048", "--enforce-eager"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu_s(root: int) -> float:
    """CPU-s of ``root`` and its children (the API server and its engine), reaped ones included."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(entry) == root or int(fields[1]) == root:
                total += sum(int(x) for x in fields[11:15]) / tick
    return total


def wait_ready(port: int, alive) -> None:
    while True:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).status == 200:
                return
        except OSError:
            pass
        if not alive():
            raise SystemExit(f"the server on port {port} exited during start-up")
        time.sleep(0.2)


def forked_start(port: int, log) -> int:
    pid = os.fork()
    if pid == 0:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.argv = [SERVER, *ARGS, "--port", str(port)]
        try:
            runpy.run_module(SERVER, run_name="__main__", alter_sys=True)
        finally:
            os._exit(0)
    wait_ready(port, lambda: os.waitpid(pid, os.WNOHANG) == (0, 0))
    return pid


def fresh_start(port: int, log) -> int:
    proc = subprocess.Popen([str(REPO / "tests/vllm_python"), "-m", SERVER, *ARGS, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    wait_ready(port, lambda: proc.poll() is None)
    return proc.pid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--log-dir", default="/tmp")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # as VllmServer sets it on CPU
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    t, cpu = time.monotonic(), time.process_time()
    sys.path.insert(0, str(REPO / "tests"))
    import vllm_fork_server  # noqa: F401  the tests' patches (engine by fork, model inspection in process)
    __import__(SERVER)
    print(f"importing the API server once: {time.monotonic() - t:.1f} s, {time.process_time() - cpu:.1f} CPU-s")
    for i in range(args.repeat):
        for name, start in (("forked", forked_start), ("fresh", fresh_start)):
            port = free_port()
            with open(Path(args.log_dir) / f"server_start_{name}{i}.log", "w") as log:
                t = time.monotonic()
                pid = start(port, log)
                ready, cpu = time.monotonic() - t, tree_cpu_s(pid)
                os.kill(pid, signal.SIGTERM)
                os.waitpid(pid, 0)
            print(f"{name:6s}: ready in {ready:5.1f} s, {cpu:5.1f} CPU-s (server and engine, at ready)", flush=True)


if __name__ == "__main__":
    main()
