"""Stage 02 on a GPU (run on the device machine: ``pytest -m gpu``; deselected where no CUDA device is visible).

The device-to-host copy of each batch and the event the writer threads wait on must be on the same stream: the
copy stream of the GPU that holds the states. The first version recorded the event with
``torch.cuda.Event().record()``, i.e. on the *current* device's current stream (cuda:0, since no worker called
``torch.cuda.set_device``), so a worker on cuda:1..N or a layer split ending on another GPU could write a pinned
buffer before its copy had landed (zeros or a stale batch). One GPU cannot show that race itself, so the tests check
what decides it (where each event is recorded, and the worker's current device) and, with the copy stream
deliberately delayed, that every file still holds its own states.
"""

from __future__ import annotations

import pytest
import torch

from eagle3pipe import extract_worker
from eagle3pipe.extract import run_extract
from eagle3pipe.records import DataDir, load_hidden_states
from eagle3pipe.verifier import AuxStateCapture, load_text_model

from test_extract import AUX, make_cfg, write_rows

pytestmark = pytest.mark.gpu


def _last_gpu() -> str:
    return f"cuda:{torch.cuda.device_count() - 1}"


class _SpyEvent(torch.cuda.Event):
    """A real CUDA event that also notes which stream it was recorded on and what the current device was."""

    records: list[tuple[torch.device | None, int, int]] = []  # (stream's device, stream id, current device)

    def record(self, stream=None):
        type(self).records.append((stream.device if stream is not None else None,
                                   stream.stream_id if stream is not None else -1, torch.cuda.current_device()))
        return super().record(stream)


def test_event_recorded_on_the_states_device_copy_stream(tmp_path, toy_llama, monkeypatch):
    device = _last_gpu()
    write_rows(tmp_path, 12, max_len=40)
    _SpyEvent.records = []
    monkeypatch.setattr(torch.cuda, "Event", _SpyEvent)
    current = torch.cuda.current_device()
    try:
        run_extract(make_cfg(tmp_path, toy_llama, device=device, model_dtype="bfloat16", batch_tokens=96,
                             num_workers=1))
        worker_device = torch.cuda.current_device()  # the in-process worker set its device
    finally:
        torch.cuda.set_device(current)
    assert _SpyEvent.records, "no CUDA event recorded: the batch copies were not tracked"
    for stream_device, stream_id, current_device in _SpyEvent.records:
        assert stream_device == torch.device(device), \
            f"event recorded on {stream_device} (None = the current device's current stream), states on {device}"
        assert stream_id != torch.cuda.default_stream(device).stream_id  # the copy stream, not the compute stream
        assert current_device == torch.device(device).index
    assert worker_device == torch.device(device).index


def test_delayed_copy_stream_still_writes_each_batch_own_states(tmp_path, toy_llama, monkeypatch):
    """Each copy is held back ~20 ms on its stream (a GPU-side sleep queued before it): writers that did not wait
    for the copy would save zeros or the slot's previous batch. Files must match an independent forward."""
    device = _last_gpu()
    rows = write_rows(tmp_path, 24, min_len=8, max_len=64)
    real_stream = extract_worker.DeviceToHost.stream

    def delayed_stream(self, dev):
        s = real_stream(self, dev)
        with torch.cuda.stream(s):
            torch.cuda._sleep(40_000_000)  # ~20 ms of GPU clock cycles on the copy stream, before the copy
        return s

    monkeypatch.setattr(extract_worker.DeviceToHost, "stream", delayed_stream)
    current = torch.cuda.current_device()
    try:
        run_extract(make_cfg(tmp_path, toy_llama, device=device, model_dtype="bfloat16", batch_tokens=256,
                             max_pending_batches=2, writer_threads=4, num_workers=1))
    finally:
        torch.cuda.set_device(current)
    model = load_text_model(toy_llama, torch.float32, device=device)
    capture = AuxStateCapture(model, AUX)
    dd = DataDir(tmp_path)
    for i, row in enumerate(rows):
        stored = load_hidden_states(dd.hs_file(i))
        assert stored["token_ids"].tolist() == row["input_ids"]
        ref = capture(torch.tensor([row["input_ids"]], device=device))[0].float().cpu()  # [T, 4, H] fp32 reference
        err = (stored["hidden_states"].float() - ref).norm() / ref.norm()
        assert err < 0.03, f"sample {i}: relative error {err:.3f} (a copy race reads zeros or another batch: ~1)"
    capture.remove()
