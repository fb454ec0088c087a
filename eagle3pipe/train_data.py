"""Stage 04's reader of per-sample states files (each read checked) and its batches on the device: fp8 hidden states
dequantised on the GPU, host-to-device copies overlapped.

Every file read (offline from hidden_states/, online from the spool) goes through ``CheckedFileTransfer`` (its
layer metadata against the manifest) and ``CheckedArrowDataset`` (its states hold one row per token id, and its
token ids are the row's: speculators checks the ids and skips, but not the length, and a file with fewer state rows
than token ids shifted every later sample of its packed row against its tokens). A sample that fails is skipped as
``SkippedFile`` (file and reason), and ``ListingCollateFn`` hands the packed row's list to the training loop, which
lists each in checkpoints/skipped.jsonl and stops past --max-error-share.

speculators' ``FP8Transfer`` dequantises each fp8 sample to bf16 inside the DataLoader workers, so every later copy
(collate, shared memory, pinning, host to device) moves twice the bytes and the workers spend CPU on the
arithmetic. Here the workers keep the e4m3 values and carry the per-token scales beside them; the training process
dequantises after the copy, on the device, with hs_connectors' own formula (``fp8.to(dtype) * scale.to(dtype)``,
elementwise, so the values are bit-identical to ``FP8Transfer``'s). ``device_batches`` copies batch i+1 to the GPU
on a side stream while step i computes.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from hs_connectors.transfer import FileTransfer
from speculators.models.eagle3.data import shift_batch
from speculators.train.data import ArrowDataset, CollateFn
from speculators.train.recovery import SampleUnavailable

from .records import HS_SCALES_KEY, FormatError, check_hs_file_metadata, read_hidden_states_metadata

FP8_SCALES = "fp8_scales"  # [T, k] float32 scales of a sample's fp8 states: k = 1 (one per token) or n (per state)
# after shift_batch: the scales of hidden_states (positions 0..T-2) and of verifier_last_hidden_states (1..T-1).
# Their names must not contain "hidden_states": CollateFn casts every such key to the states' dtype.
FP8_SCALES_IN = "fp8_scales_in"
FP8_SCALES_LAST = "fp8_scales_last"
SKIPPED_KEY = "skipped_files"  # a packed row's samples the read checks skipped: [{"file", "index", "reason"}]

# speculators warns about a token-id mismatch with both whole id tensors (32768 ids each at K2.5's rows); the sample
# is listed with its file and a short reason instead (CheckedArrowDataset)
warnings.filterwarnings("ignore", message="Loaded token ids", category=UserWarning)


@dataclass(frozen=True)
class SkippedFile(SampleUnavailable):
    """A sample whose states file failed a read check: speculators' collate drops it (and counts it in
    ``error_records``) like any unavailable sample; ``ListingCollateFn`` lists it with its file and reason."""

    file: str = ""
    index: int = -1  # the file index (hs_{index})


class CheckedFileTransfer(FileTransfer):
    """speculators' ``FileTransfer`` that first checks each file's metadata against the manifest (the layer ids it
    holds, the verifier's depth, finite: ``records.check_hs_file_metadata``): a file captured from other layers than
    hidden_states/ says (a server started with other ids, a file copied in) stops training, naming it."""

    def __init__(self, hidden_states_path, manifest):
        super().__init__(hidden_states_path)
        self.aux_layer_ids, self.num_layers = list(manifest.aux_layer_ids), manifest.num_layers

    last_read: Path | None = None  # the file the last get_cached read (None: it found none)

    def path(self, file_idx: int) -> Path:
        return self.hidden_states_path / f"hs_{file_idx}.safetensors"  # FileTransfer's own name for file file_idx

    def get_cached(self, file_idx: int):
        path = self.path(file_idx)
        if path.exists():
            if not check_hs_file_metadata(path, read_hidden_states_metadata(path), self.aux_layer_ids,
                                          self.num_layers):
                raise FormatError(f"{path}: its metadata says the states hold NaN/Inf (stage 02 never keeps such)")
        data = super().get_cached(file_idx)
        self.last_read = path if data is not None else None
        return data


class Fp8KeptTransfer(CheckedFileTransfer):
    """``CheckedFileTransfer`` for fp8 files that leaves the states quantised and keeps the last sample's scales,
    which ArrowDataset would otherwise drop (it keeps only ``hidden_states`` and ``token_ids``)."""

    last_scales: torch.Tensor | None = None

    def get_cached(self, file_idx: int):
        data = super().get_cached(file_idx)
        self.last_scales = data.pop(HS_SCALES_KEY, None) if data is not None else None
        return data


class CheckedArrowDataset(ArrowDataset):
    """speculators' ArrowDataset (over a ``CheckedFileTransfer``) whose samples are checked as they are read: a file
    whose states are not one row per token id, or whose token ids are not the row's, becomes a ``SkippedFile``
    naming the file and the reason. A file that is not there stays speculators' (``on_missing``).

    ``file_indices``: the rows of the rows dataset this split holds, in file order (``train_batches.split_files``:
    a seeded share held out), where speculators' own split takes a contiguous head and tail; sample i is file
    ``file_index(i)``."""

    def __init__(self, *args, file_indices=None, **kwargs):
        super().__init__(*args, **kwargs)
        if file_indices is None:
            self.file_indices = np.arange(self.start_file_idx, self.start_file_idx + len(self.data))
        else:
            self.file_indices = np.asarray(file_indices, dtype=np.int64)
            self.data = self.data.select(self.file_indices.tolist())
            self.approx_lengths = self._compute_approx_lengths()

    def _map_to_file_idx(self, index: int) -> int:
        return int(self.file_indices[index])

    def file_index(self, index: int) -> int:
        """The file (rows dataset row, hs_{i}) of this split's sample ``index``."""
        return int(self.file_indices[index])

    def _get_raw_data(self, index: int):
        path = self.transfer.path(self._map_to_file_idx(index))
        sample = super()._get_raw_data(index)
        if isinstance(sample, SampleUnavailable):
            if self.transfer.last_read != path:  # no file: on_missing's outcome (online lists its own failures)
                return sample
            return SkippedFile(reason=f"its token_ids are not the row's input_ids ({self.approx_lengths[index]} "
                                      "tokens): the states of another row", file=str(path),
                               index=self._map_to_file_idx(index))
        states, tokens = sample["hidden_states"].shape[0], sample["input_ids"].shape[0]
        if states != tokens:
            return SkippedFile(reason=f"hidden states for {states} tokens, token_ids hold {tokens}: a torn or "
                                      "altered file", file=str(path), index=self._map_to_file_idx(index))
        return sample


class ListingCollateFn(CollateFn):
    """speculators' CollateFn, which drops unavailable samples and keeps only their count (``error_records``); this
    one also hands on the ``SkippedFile`` entries as ``SKIPPED_KEY`` (file, index, reason) for the training loop."""

    def __call__(self, batch):
        skipped = [{"file": s.file, "index": s.index, "reason": s.reason} for s in batch if isinstance(s, SkippedFile)]
        out = super().__call__(batch)
        out[SKIPPED_KEY] = skipped
        return out


class Fp8ScaledDataset(CheckedArrowDataset):
    """``CheckedArrowDataset`` over fp8 files, each sample carrying its per-token scales (``FP8_SCALES``)."""

    def _get_raw_data(self, index: int):
        sample = super()._get_raw_data(index)
        if isinstance(sample, dict):
            scales = self.transfer.last_scales  # the file this call just read (one sample at a time per worker)
            if scales is None or scales.shape[0] != sample["input_ids"].shape[0]:
                raise ValueError(f"sample {index}: fp8 hidden states without matching per-token scales")
            sample[FP8_SCALES] = scales.reshape(scales.shape[0], -1).float()  # [T, k] from [T, 1, 1] or [T, n, 1]
        return sample


def shift_batch_with_scales(sample: dict) -> dict:
    """speculators' ``shift_batch`` (it keeps only its own keys), with the fp8 scales shifted alongside."""
    scales = sample.pop(FP8_SCALES, None)
    out = shift_batch(sample)
    if scales is not None:
        out[FP8_SCALES_IN] = scales[:-1]  # hidden_states keeps positions 0..T-2
        out[FP8_SCALES_LAST] = scales[1:]  # verifier_last_hidden_states keeps 1..T-1
    return out


class DraftStates:
    """The collate's per-sample preprocess: the columns of the states the draft reads (``train.draft_layer_ids``) out
    of those a file stores (``shared.aux_layer_ids``: one extraction of the union serves an EAGLE-3 and a DFlash
    draft), then EAGLE-3's one-token shift (``shift_batch``) or, for DFlash, none (its targets come from the state at
    the slot before, inside the model). fp8 scales follow their states. A class, not a closure: the DataLoader's
    spawned workers pickle it."""

    def __init__(self, stored_ids: list[int], read_ids: list[int], shift: bool):
        self.columns = [list(stored_ids).index(k) for k in read_ids]  # of the aux states; the final state stays last
        self.num_stored, self.shift = len(stored_ids), shift

    def __call__(self, sample: dict) -> dict:
        states = sample["hidden_states"]  # [T, n_stored * H]
        if self.num_stored != len(self.columns) and states.shape[0]:  # an empty sample is built at the read width
            t = states.shape[0]
            sample["hidden_states"] = states.view(t, self.num_stored, -1)[:, self.columns].flatten(1)
            scales = sample.get(FP8_SCALES)
            if scales is not None and scales.shape[-1] > 1:  # one scale per state: [T, n_stored + 1]
                sample[FP8_SCALES] = scales[:, self.columns + [self.num_stored]]
        if self.shift:
            return shift_batch_with_scales(sample)
        scales = sample.pop(FP8_SCALES, None)
        out = dict(sample)
        if scales is not None:  # unshifted: the draft's states and the verifier's last state share positions
            out[FP8_SCALES_IN], out[FP8_SCALES_LAST] = scales, scales
        return out


def to_device(batch: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """The batch's tensors on ``device``; fp8 states dequantised there to ``dtype`` (values * scales, per element as
    hs_connectors does it, for one scale per token or one per token and state)."""
    out = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    scales_in, scales_last = out.pop(FP8_SCALES_IN, None), out.pop(FP8_SCALES_LAST, None)
    states_in, last = out["hidden_states"], out["verifier_last_hidden_states"]  # [1, L, 3H], [1, L, H]
    if states_in.dtype == torch.float8_e4m3fn:
        if scales_in is None:  # an all-padding row (no sample in the batch): zeros
            out["hidden_states"], out["verifier_last_hidden_states"] = states_in.to(dtype), last.to(dtype)
            return out
        k = scales_in.shape[-1]  # 1, or the n states (the first n - 1 are the draft's input, the last the verifier's)
        if k == 1:
            out["hidden_states"] = states_in.to(dtype) * scales_in.to(dtype)
        else:
            split = states_in.view(*states_in.shape[:2], k - 1, -1)  # [1, L, n-1, H]
            out["hidden_states"] = (split.to(dtype) * scales_in[..., :k - 1, None].to(dtype)).flatten(2)
        out["verifier_last_hidden_states"] = last.to(dtype) * scales_last[..., k - 1:].to(dtype)
    return out


def _timed(loader, waited: dict | None):
    """Iterate ``loader``, adding the time spent waiting for each batch to ``waited["loader_wait_s"]``."""
    it = iter(loader)
    while True:
        t0 = time.monotonic()
        try:
            batch = next(it)
        except StopIteration:
            return
        if waited is not None:
            waited["loader_wait_s"] = waited.get("loader_wait_s", 0.0) + time.monotonic() - t0
        yield batch


def device_batches(loader, device: torch.device, dtype: torch.dtype, waited: dict | None = None):
    """Yields (host batch, device batch). On CUDA, batch i+1's copy (and dequantisation) is queued on a side stream
    before batch i is handed out, so it runs while step i computes; step i waits only for its own batch.
    ``waited["loader_wait_s"]`` accumulates the time the training loop waited for the loader (0 when it keeps up)."""
    if device.type != "cuda":
        for batch in _timed(loader, waited):
            yield batch, to_device(batch, device, dtype)
        return
    side = torch.cuda.Stream(device=device)

    def issue(batch):
        with torch.cuda.stream(side):
            moved = to_device(batch, device, dtype)
            ready = torch.cuda.Event()
            ready.record(side)
        return batch, moved, ready

    def hand_out(item):
        batch, moved, ready = item
        compute = torch.cuda.current_stream(device)
        compute.wait_event(ready)
        for t in moved.values():
            t.record_stream(compute)  # made on the side stream, used and freed on the compute stream
        return batch, moved

    pending = None
    for batch in _timed(loader, waited):
        queued = issue(batch)
        if pending is not None:
            yield hand_out(pending)
        pending = queued
    if pending is not None:
        yield hand_out(pending)
