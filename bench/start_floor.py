"""The suite's start-up floor: the CPU its processes spend starting before they do a test's work.

For each kind of process that bench/suite_cpu.py recorded in a run (its JSON), the CPU of one start is measured here,
now, by a command that does what every process of that kind does first (a vLLM CPU server started and stopped; the
imports of 04 and 03, speculators included; the verifier's tokenizer that 01 and 01b load; 02's transformers model
imports; a pytest process collecting a file). Each recorded process counts min(that start, the CPU it used), so a
process that ended before its imports counts what it used. The sum is what the run would cost if every test did no
work beyond starting the real processes it starts. Run it on the machine, and the day, of the JSON's run.

    python bench/start_floor.py suite_cpu.json --repeat 2

Run it from the repository root with .venv's python and test.sh's environment (``OMP_NUM_THREADS=1
VLLM_ENABLE_V1_MULTIPROCESSING=0 EAGLE3PIPE_VLLM_PYTHON=$PWD/tests/vllm_python``, offline HF variables).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from server_start import one_start  # noqa: E402
from suite_cpu import kind  # noqa: E402

PY = [str(REPO / ".venv" / "bin" / "python")]
VLLM_PY = [str(REPO / ".venv-vllm" / "bin" / "python")]
TOKENIZER = PY + ["-c", "from eagle3pipe.chat import load_tokenizer; load_tokenizer('data/ci/verifier')"]
# kind (suite_cpu.kind) -> the command that does what a process of that kind does first; None: a vLLM server start
START = {
    "vLLM API server": None,  # to ready and stopped: its engine's start is in it
    "vLLM interpreter, other (platform probes, guard checks, installs)":
        VLLM_PY + ["-c", "import vllm; from vllm.platforms import current_platform; current_platform.device_type"],
    "04_train.py": PY + ["-c", "import speculators, eagle3pipe.train"],
    "03_build_vocab_mapping.py": PY + ["-c", "import speculators, eagle3pipe.vocab"],
    "01_prepare_data.py": TOKENIZER,
    "01b_generate_synthetic.py": TOKENIZER,
    "multiprocessing child (stage workers, 01's render pool)": TOKENIZER,
    "02_extract_hidden_states.py": PY + ["-c", "import eagle3pipe.extract, transformers; "
                                              "from transformers import AutoModelForCausalLM"],
    "05_evaluate.py": PY + ["-c", "import eagle3pipe.evaluate"],
    "torchrun agent": PY + ["-c", "import torch.distributed.run"],
    "pytest child (memory bounds in a fresh interpreter)": PY + ["-m", "pytest", "-q", "--co", "-p", "no:cacheprovider",
                                                                  "tests/test_vocab.py"],
    "pytest-xdist worker (tests run in-process)": PY + ["-m", "pytest", "-q", "--co", "-p", "no:cacheprovider",
                                                        "tests/test_vocab.py"],
}


def command_cpu_s(argv: list[str]) -> float:
    """CPU-s (user + system) of one run of ``argv`` and whatever it reaps."""
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}")
    return usage.ru_utime + usage.ru_stime


def start_cpu_s(k: str, repeat: int, warm_cache: str) -> float:
    """The least CPU of ``repeat`` starts of kind ``k`` (the least: the start itself, without a busy moment's noise)."""
    argv = START[k]
    if argv is None:
        python = os.environ.get("EAGLE3PIPE_VLLM_PYTHON", str(REPO / "tests" / "vllm_python"))
        return min(one_start(python, warm_cache)[1] for _ in range(repeat))
    return min(command_cpu_s(argv) for _ in range(repeat))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="a bench/suite_cpu.py run's samples")
    ap.add_argument("--repeat", type=int, default=2, help="starts measured per kind (the least counts)")
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    args = ap.parse_args()
    used: dict[str, list[float]] = collections.defaultdict(list)
    for cmd, comm, total, before in json.load(open(args.json)).values():
        if total - before > 0:
            used[kind(cmd, comm)].append(total - before)
    warm = tempfile.mkdtemp(prefix="vllm-cache-")
    one_start(os.environ.get("EAGLE3PIPE_VLLM_PYTHON", str(REPO / "tests" / "vllm_python")), warm)  # fills the cache
    rows, floor, everything = [], 0.0, sum(sum(v) for v in used.values())
    for k in START:
        if not used.get(k):
            continue
        start = start_cpu_s(k, args.repeat, warm)
        part = sum(min(start, cpu) for cpu in used[k])
        floor += part
        rows.append(f"| {k} | {len(used[k])} | {start:.1f} | {part:.0f} | {sum(used[k]):.0f} |")
        print(rows[-1], flush=True)
    print("\n| kind | processes | one start, CPU-s (here, now) | start-up floor, CPU-s | the run's CPU-s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    print(f"| all kinds of the run | | | {floor:.0f} | {everything:.0f} |")
    print(f"\nstart-up floor: {floor:.0f} CPU-s = {floor / args.cores / 60:.1f} min of {args.cores} fully used cores")


if __name__ == "__main__":
    main()
