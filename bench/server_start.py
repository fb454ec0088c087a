"""A vLLM CPU server's start, as the tests start it: seconds to ready and the CPU of its whole process tree (API
server, engine, any subprocess they reap), for each vLLM interpreter given, alternating, each start with an empty
vLLM cache (``VLLM_CACHE_ROOT``, as on a fresh machine such as CI's) unless ``--warm``.

    python bench/server_start.py --repeat 2 NEW_REPO/tests/vllm_python OLD_REPO/tests/vllm_python

Run it with .venv's python from the repository root, with test.sh's environment
(``VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle3pipe.server import VllmServer  # noqa: E402


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_start(python: str, warm_cache: str | None) -> tuple[float, float]:
    """(seconds to ready, CPU-s of the server's processes from start to stop)."""
    os.environ["VLLM_CACHE_ROOT"] = warm_cache or tempfile.mkdtemp(prefix="vllm-cache-")
    cpu, t = children_cpu_s(), time.monotonic()
    with tempfile.TemporaryDirectory() as log_dir:
        with VllmServer("data/ci/verifier", python=python, served_model_name="verifier", log_file=f"{log_dir}/log",
                        extra_args=["--reasoning-parser", "kimi_k2", "--max-model-len", "2048"]):
            ready = time.monotonic() - t
    return ready, children_cpu_s() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pythons", nargs="+", help="vLLM interpreters (e.g. tests/vllm_python of two checkouts)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--warm", action="store_true", help="one vLLM cache for every start, filled by a first start")
    args = ap.parse_args()
    warm = tempfile.mkdtemp(prefix="vllm-cache-") if args.warm else None
    if warm:
        one_start(args.pythons[0], warm)
    runs: dict[str, list[tuple[float, float]]] = {p: [] for p in args.pythons}
    for _ in range(args.repeat):
        for python in args.pythons:
            runs[python].append(one_start(python, warm))
            print(f"{python}: ready in {runs[python][-1][0]:.1f} s, {runs[python][-1][1]:.1f} CPU-s", flush=True)
    print(f"\n| vLLM interpreter ({'warm' if warm else 'empty'} cache) | ready s (median) | CPU-s (median) |")
    print("| --- | ---: | ---: |")
    for python, r in runs.items():
        print(f"| {python} | {statistics.median(x[0] for x in r):.1f} | {statistics.median(x[1] for x in r):.1f} |")


if __name__ == "__main__":
    main()
