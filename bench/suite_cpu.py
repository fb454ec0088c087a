"""Where a command's CPU goes, by kind of process: runs the command (``./test.sh`` by default) and reads every
process's CPU time from /proc once a second until it ends, then sums them by kind (vLLM API servers, vLLM engines,
each numbered stage, torchrun agents, the test workers, ...). A process that lives under a second is missed, and
the whole machine is sampled, so run it on an otherwise quiet machine. Linux only.

    python bench/suite_cpu.py --json suite_cpu.json -- ./test.sh
    python bench/suite_cpu.py --report suite_cpu.json      # the table again, from the samples
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

STAGES = ("01_prepare_data.py", "01b_generate_synthetic.py", "02_extract_hidden_states.py",
          "03_build_vocab_mapping.py", "04_train.py", "05_evaluate.py")


def kind(cmd: str, comm: str) -> str:
    """The kind of a process, from its command line (first match wins)."""
    if "vllm_zygote.py serve" in cmd:
        return "vLLM zygote (imports the API server once; tests/vllm_zygote.py)"
    if "vllm.entrypoints.openai.api_server" in cmd:
        return "vLLM API server"
    if comm.startswith("VLLM::") or (".venv-vllm" in cmd and "spawn_main" in cmd):
        return "vLLM engine (started by the API server)"
    if ".venv-vllm" in cmd:
        return "vLLM interpreter, other (platform probes, guard checks, installs)"
    if "torch.distributed.run" in cmd:
        return "torchrun agent"
    for stage in STAGES:
        if stage in cmd:
            return stage
    if "eagle3pipe.toy_reasoning" in cmd:
        return "ci verifier rebuild"
    if "exec(eval(sys.stdin.readline()))" in cmd:
        return "pytest-xdist worker (tests run in-process)"
    if re.search(r"-m pytest .*-p no:cacheprovider", cmd):
        return "pytest child (memory bounds in a fresh interpreter)"
    if "spawn_main" in cmd:
        return "multiprocessing child (stage workers, 01's render pool)"
    if re.search(r"bin/pip3? ", cmd + " "):
        return "pip (installs)"
    if "python" in cmd:
        return "other Python"
    return "other"


def sample(procs: dict, before: bool = False) -> None:
    """Update {"pid:start time": [cmdline, comm, cpu seconds, cpu seconds before the command]} from /proc
    (``before``: the processes already running when the command starts, whose earlier CPU is not the command's)."""
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            key = f"{entry}:{fields[19]}"
            cpu = (int(fields[11]) + int(fields[12])) / tick
            if key not in procs:
                cmd = open(f"/proc/{entry}/cmdline").read().replace("\0", " ").strip()
                comm = open(f"/proc/{entry}/comm").read().strip()
                procs[key] = [cmd, comm, cpu, cpu if before else 0.0]
            else:
                procs[key][2] = cpu
                if "vllm_zygote.py serve" in procs[key][0]:  # a server it forked renames itself (setproctitle)
                    procs[key][0] = open(f"/proc/{entry}/cmdline").read().replace("\0", " ").strip()
                    procs[key][1] = open(f"/proc/{entry}/comm").read().strip()
        except (OSError, IndexError):  # gone between listdir and read
            pass


def save(procs: dict, path: str) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(procs, f)
    os.replace(path + ".tmp", path)


def report(procs: dict) -> str:
    cpu, count = collections.Counter(), collections.Counter()
    for cmd, comm, total_seconds, seconds_before in procs.values():
        seconds = total_seconds - seconds_before
        if seconds > 0:
            k = kind(cmd, comm)
            cpu[k] += seconds
            count[k] += 1
    total = sum(cpu.values())
    lines = ["| kind | processes | CPU-s | share |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {k} | {count[k]} | {v:.0f} | {100 * v / total:.0f} % |" for k, v in cpu.most_common()]
    return "\n".join(lines + [f"| all | {sum(count.values())} | {total:.0f} | |"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="suite_cpu.json", help="where the samples go (rewritten every 10 s)")
    p.add_argument("--report", metavar="JSON", help="print the table of an earlier run's samples and exit")
    p.add_argument("command", nargs="*", default=["./test.sh"], help="the command to run (after --)")
    args = p.parse_args()
    if args.report:
        print(report(json.load(open(args.report))))
        return 0
    procs: dict = {}
    sample(procs, before=True)
    started = time.time()
    proc = subprocess.Popen(args.command)
    last_write = 0.0
    while proc.poll() is None:
        sample(procs)
        if time.time() - last_write > 10:
            save(procs, args.json)
            last_write = time.time()
        time.sleep(1.0)
    save(procs, args.json)
    print(f"\n{' '.join(args.command)}: exit {proc.returncode} after {time.time() - started:.0f} s\n{report(procs)}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
