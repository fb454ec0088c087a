"""Stage 02: the verifier's aux-layer hidden states for every training row, in the layout speculators trains from.

Reads ``synthetic/data.jsonl`` (or ``prepared/data.jsonl``), runs the verifier's text model over each row (batched
by length, right-padded, attention-masked), captures the states entering the aux layers plus the final pre-norm
state (``verifier.AuxStateCapture``), and writes ``hidden_states/`` (see the hidden-states section of records.py).

Work is split into shards, one per worker process (one per GPU, data-parallel), or one worker whose verifier is
split over all GPUs by layers (``--device-map auto``; consecutive batches are launched back to back without host
syncs, so GPU i runs batch b+1 while GPU i+1 runs batch b). Each worker writes its files from background threads
into ``work/shard_{w}/`` and journals each finished sample; a rerun skips journalled samples. When all samples are
done, ``finalize`` renames the files to ``hs_{i}`` in input order (so any number of workers gives the same output),
writes the rows dataset, errors.jsonl, and last the manifest.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .cli import StageError, errors_allowed
from .config import ConfigError, PipelineConfig
from .extract_worker import ShardJob, worker_main, clean_shard_dir, extract_shard
from .progress import format_duration
from .records import (
    HS_FORMAT_VERSION,
    HS_JOURNAL_DTYPE,
    HS_META_LAYER_IDS,
    DataDir,
    DroppedRow,
    FormatError,
    HiddenStatesManifest,
    RowIndex,
    RowSelection,
    atomic_write_json,
    check_hs_file_metadata,
    check_synthetic_finished,
    forget_hs_journal_entries,
    hs_bytes_estimate,
    hs_bytes_per_token,
    is_hs_attempt_file,
    load_hs_finalize_plan,
    load_hs_journal_arrays,
    load_hs_manifest,
    open_row_index,
    read_hidden_states_header,
    save_hs_finalize_plan,
    save_hs_manifest,
    save_hs_rows,
    write_jsonl_atomic,
    write_provenance,
)
from .extract_vllm import extract_with_vllm
from .verifier import load_text_config, state_names, verifier_load_bytes

log = logging.getLogger(__name__)

STAGE = "02_extract"  # its log and lock name: run_all's stage name (run_all.STAGES), as every stage's
DISK_HEADROOM = 1.05  # preflight wants 5 % more free space than the estimate


# ---------------------------------------------------------------------------------------------------------------
# Orchestration


def input_path(cfg: PipelineConfig) -> Path:
    dd = DataDir(cfg.data_dir)
    return dd.synthetic_data if cfg.extract.input == "synthetic" else dd.prepared_data


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def output_identity(cfg: PipelineConfig, input_file: Path) -> dict:
    """What decides the bytes of the output (not how it is computed: devices, batch size, worker count)."""
    return {
        "verifier": str(Path(cfg.shared.verifier).resolve()),
        "aux_layer_ids": list(cfg.shared.aux_layer_ids),
        "model_dtype": cfg.extract.model_dtype,
        "storage_dtype": cfg.extract.storage_dtype,
        "backend": cfg.extract.backend,  # another engine computes (slightly) other states
        "input": str(input_file.resolve()),
        "input_sha256": _file_sha256(input_file),
    }


def resolve_workers(cfg: PipelineConfig) -> list[str]:
    """One device name per worker."""
    ex = cfg.extract
    if ex.device_map == "auto":
        if not torch.cuda.is_available():
            raise ConfigError("extract.device_map 'auto' splits the verifier over GPUs, but no GPU is visible")
        return ["cuda"]
    device = ex.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        n = ex.num_workers or torch.cuda.device_count()
        if n > torch.cuda.device_count():
            raise ConfigError(f"extract.num_workers {n} exceeds the {torch.cuda.device_count()} visible GPUs")
        return [f"cuda:{i}" for i in range(n)]
    if device.startswith("cuda:") and ex.num_workers > 1:
        raise ConfigError(f"extract.device {device} names one GPU but num_workers is {ex.num_workers}; "
                          "pass --device cuda to use one worker per visible GPU")
    return [device] * (ex.num_workers or 1)


def remove_outputs(dd: DataDir) -> None:
    """Delete only the files this stage writes (for --overwrite)."""
    d = dd.hidden_states
    shutil.rmtree(dd.hs_work, ignore_errors=True)
    if dd.hs_files.exists():
        for p in dd.hs_files.glob("hs_*.safetensors"):
            p.unlink()
    for p in list(d.glob("data-*.arrow")) + [d / "state.json", d / "dataset_info.json", dd.hs_manifest,
                                               dd.hs_errors, dd.provenance(d)]:
        if p.exists():
            p.unlink()


def preflight_disk(dd: DataDir, tokens: int, samples: int, num_states: int, hidden_size: int, storage_dtype: str,
                   force: bool) -> None:
    need = hs_bytes_estimate(tokens, samples, num_states, hidden_size, storage_dtype)  # what the files will take
    dd.hidden_states.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dd.hidden_states).free
    log.info("disk preflight: %d tokens x %d B/token (%s) + %d file headers = %d bytes (%.2f GB) to write; %.2f GB "
             "free on %s", tokens, hs_bytes_per_token(num_states, hidden_size, storage_dtype), storage_dtype, samples,
             need, need / 1e9, free / 1e9, dd.hidden_states)
    if need * DISK_HEADROOM > free and not force:
        raise StageError(
            f"hidden states need {need / 1e9:.2f} GB (+5% headroom) but {dd.hidden_states} has {free / 1e9:.2f} GB "
            "free: free space, use --storage-dtype fp8 (half), or pass --force-disk"
        )


def run_workers(jobs: list[ShardJob], log_file: Path) -> None:
    if len(jobs) == 1:
        extract_shard(jobs[0])
        return
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(job, str(log_file)), name=f"extract-shard-{job.shard}")
             for job in jobs]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [(job.shard, p.exitcode) for job, p in zip(jobs, procs) if p.exitcode != 0]
    if failed:
        raise StageError(f"extract workers failed (shard, exit code): {failed}; see the log; a rerun resumes")


def _extract_with_transformers(cfg: PipelineConfig, dd: DataDir, first_shard: int, todo: RowSelection) -> None:
    """The transformers backend: worker processes (one per GPU, or one whose model spans all GPUs) run the model
    here, each on its own shard of the samples."""
    ex, sh = cfg.extract, cfg.shared
    devices = resolve_workers(cfg)
    if devices[0].startswith("cuda"):
        preflight_gpu_memory(verifier_load_bytes(sh.verifier, ex.model_dtype, sh.trust_remote_code),
                             gpu_memory_bytes(devices, ex.device_map), sh.verifier, ex.model_dtype)
    # interleave the length-sorted samples so every shard gets the same mix of lengths
    ordered = todo.longest_first()
    cpu_threads = max(1, (os.cpu_count() or 1) // len(devices)) if devices[0] == "cpu" else 0
    jobs = []
    for w, device in enumerate(devices):
        # a new shard number per worker of this run, so a rerun with another worker count never mixes journals
        jobs.append(ShardJob(
            shard=first_shard + w, data_dir=str(dd.root), verifier=sh.verifier, aux_layer_ids=list(sh.aux_layer_ids),
            model_dtype=ex.model_dtype, storage_dtype=ex.storage_dtype, device=device, device_map=ex.device_map,
            batch_tokens=ex.batch_tokens, writer_threads=ex.writer_threads,
            max_pending_batches=ex.max_pending_batches, progress_every_s=sh.progress_every_s,
            items=ordered.take(slice(w, None, len(devices))), cpu_threads=cpu_threads, trust_remote_code=sh.trust_remote_code,
            compile=ex.compile,
        ))
    run_workers([j for j in jobs if len(j.items)], dd.log_file(STAGE))


def gpu_memory_bytes(devices: list[str], device_map: str) -> int:
    """GPU memory one copy of the verifier may use: one GPU per worker, or all of them with ``--device-map auto``."""
    if device_map == "auto":
        return sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return torch.cuda.get_device_properties(torch.device(devices[0])).total_memory


def preflight_gpu_memory(need: int, have: int, verifier: str, model_dtype: str) -> None:
    """Refuse before loading a verifier the GPU memory cannot hold (transformers decompresses int4 on load)."""
    log.info("GPU memory preflight: the verifier's decoder takes %.1f GB in %s as transformers loads it; %.1f GB "
             "of GPU memory per copy", need / 1e9, model_dtype, have / 1e9)
    if need > have:
        raise StageError(
            f"{verifier}: the decoder takes {need / 1e9:.1f} GB in {model_dtype} as transformers loads it (int4 "
            f"experts are decompressed on load) but one copy may use {have / 1e9:.1f} GB of GPU memory: use "
            "extract.backend: vllm (--backend vllm: vLLM's int4 kernels, tensor parallel over the node's GPUs)")


class Journal:
    """Every journalled sample of hidden_states/work, as arrays (stage 02's resume and finalize at 10^6 samples,
    32 bytes a sample kept): ``positions`` (int64, sorted: every input position journalled), ``plan`` (the finalize
    plan of the written ones: int64 [N, 3], (position, shard, local index) of hs_0, hs_1, ... in input order), the
    written samples' ``num_tokens`` and ``bytes``, and ``dropped`` {position: (id, reason)} of the samples journalled
    as dropped. One entry per position: that of the lowest shard (the earliest run), the first it journalled."""

    def __init__(self, dd: DataDir):
        parts, dropped = [], {}
        for shard in sorted(int(p.name.split("_")[1]) for p in dd.hs_work.glob("shard_*")):
            entries, shard_dropped = load_hs_journal_arrays(dd.hs_shard_journal(shard), shard)
            parts.append(entries)
            for position, why in shard_dropped.items():
                dropped.setdefault(position, why)
        every = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.empty(0, HS_JOURNAL_DTYPE)
        del parts
        # in place, by position, then shard (the earlier run first), then local index (its journal order)
        every.sort(order=["position", "shard", "local_index"], kind="stable")
        first = np.ones(len(every), dtype=bool)
        first[1:] = every["position"][1:] != every["position"][:-1]
        if not first.all():
            every = every[first]  # the first entry of each position
        del first
        self.positions = every["position"].copy()  # [n]
        written = every["local_index"] >= 0  # [n]
        self.plan = np.empty((int(written.sum()), 3), dtype=np.int64)  # [N, 3]
        for column, name in enumerate(("position", "shard", "local_index")):
            self.plan[:, column] = every[name][written]
        self.num_tokens = int(every["num_tokens"][written].sum(dtype=np.int64))
        self.bytes = int(every["bytes"][written].sum(dtype=np.int64))
        dropped_positions = set(every["position"][~written].tolist())  # few
        self.dropped = {p: why for p, why in dropped.items() if p in dropped_positions}


PLAN_CHUNK = 1024  # plan rows turned into Python ints at a time (a loop over 10^6 files keeps its memory)


def plan_files(dd: DataDir, plan: np.ndarray) -> Iterator[tuple[int, int, Path, Path]]:
    """(g, position, its shard file, its final hs_{g}) of each row of a finalize plan, in order."""
    for start in range(0, len(plan), PLAN_CHUNK):
        for g, (position, shard, local_index) in enumerate(plan[start:start + PLAN_CHUNK].tolist(), start):
            yield g, position, dd.hs_shard_file(shard, local_index), dd.hs_file(g)


def load_plan(dd: DataDir) -> np.ndarray | None:
    """The saved finalize plan (or one an eagle3pipe before issue 27 saved as JSON), None when there is none."""
    plan = load_hs_finalize_plan(dd.hs_finalize_plan)
    return plan if plan is not None else load_hs_finalize_plan(dd.hs_finalize_plan_v1)


def delete_plan(dd: DataDir) -> None:
    dd.hs_finalize_plan.unlink(missing_ok=True)
    dd.hs_finalize_plan_v1.unlink(missing_ok=True)


def save_plan(dd: DataDir, plan: np.ndarray) -> None:
    save_hs_finalize_plan(dd.hs_finalize_plan, plan)
    dd.hs_finalize_plan_v1.unlink(missing_ok=True)


def undo_plan(dd: DataDir, plan: np.ndarray) -> None:
    """Put every file an earlier finalize renamed by ``plan`` back into its shard, then delete the plan. Needed
    before renaming by another plan (a sample left open is now written: every later hs_{i} moves by one), which
    would otherwise take a file that is already in place for the one it replaces. Idempotent: an interrupted undo is
    finished by the next run (the plan goes last)."""
    moved = 0
    for _, _, src, dst in plan_files(dd, plan):
        if dst.exists() and not src.exists():
            os.replace(dst, src)
            moved += 1
    log.info("%s: %d files put back into their shards by the finalize plan of %d samples, to be renumbered",
             dd.hs_files, moved, len(plan))
    delete_plan(dd)


def check_moved_files(dd: DataDir, rows, plan: np.ndarray) -> None:
    """Files already in hidden_states/ with no finalize plan saying how they got there (an output of an eagle3pipe
    before the plan existed, interrupted in finalize): each must hold its row's token ids, else the stage stops,
    naming the file (a finalize of that version renumbered around a sample left open: its files are mis-paired)."""
    for _, position, src, dst in plan_files(dd, plan):
        if src.exists() or not dst.exists():
            continue
        token_ids = read_hidden_states_header(dst)[0]
        row = rows[position]
        if token_ids != row.input_ids:
            raise StageError(
                f"{dst} holds other token ids than row {row.id} (line {position + 1}), the row it stands for: an "
                "earlier eagle3pipe's finalize was interrupted after it numbered the files without a sample left "
                f"open, so the files of {dd.hs_files} are not paired with their rows. Rerun with --overwrite to "
                "extract them again")


def reopen(dd: DataDir, manifest: HiddenStatesManifest) -> None:
    """Undo a finish that left samples open (within --max-error-share) so this run retries them: the manifest goes
    (and provenance); the files stay where the finalize plan says, and the next finalize puts them back into their
    shards by it before renumbering. An output finished before the plan existed gets one from its journals first
    (they are the ones its finalize renamed from: nothing was journalled since it finished)."""
    log.info("%s: finished with %d samples left open by transient failures: reopening it to retry them",
             dd.hidden_states, manifest.num_retryable)
    if load_plan(dd) is None:
        save_plan(dd, Journal(dd).plan)
    dd.provenance(dd.hidden_states).unlink(missing_ok=True)
    dd.hs_manifest.unlink()


def forget_lost_files(dd: DataDir, rows, plan: np.ndarray, lost: list[int]) -> None:
    """Journal entries whose file is gone (deleted, a lost disk) are removed, so the next run re-extracts exactly
    those rows (every other file stays); then the stage stops, saying so. ``lost``: rows of ``plan``."""
    by_shard: dict[int, set[int]] = {}
    for g in lost:
        by_shard.setdefault(int(plan[g, 1]), set()).add(int(plan[g, 0]))
    for shard, positions in by_shard.items():
        forget_hs_journal_entries(dd.hs_shard_journal(shard), positions)
    position, shard, local_index = (int(v) for v in plan[lost[0]])
    raise StageError(f"{len(lost)} samples journalled as written have no file (first: row {rows[position].id}, "
                     f"line {position + 1}: {dd.hs_shard_file(shard, local_index)}); their journal entries are "
                     "removed: rerun the stage to re-extract exactly them (every other sample is kept)")


def finalize(dd: DataDir, rows: RowIndex, identity: dict, cfg: PipelineConfig, num_layers: int, hidden_size: int,
             config_hash: str, open_samples: dict[int, str] | None = None) -> HiddenStatesManifest:
    """Rename shard files to hs_{i} in input order, write rows dataset, errors.jsonl and (last) the manifest.
    ``open_samples`` ({position: reason}): samples transient failures left open, within --max-error-share: listed
    in errors.jsonl as retryable, counted in ``num_retryable`` (a rerun reopens the output and retries them).

    The renames follow a plan saved before the first of them (``DataDir.hs_finalize_plan``): a rerun with the same
    journals goes on with it (a file already moved, source gone and target present, is left); one whose journals
    differ (a sample left open is now written) first puts every file back by the old plan. So an interrupted
    finalize is redone by a rerun, whatever it retried in between. At 10^6 samples it keeps arrays (the journals,
    the plan: ~50 bytes a sample), looks at each file's name (a stat or two, a rename), never into a file, and reads
    each row's ids once, streamed into the rows dataset."""
    open_samples = open_samples or {}
    journal = Journal(dd)
    positions = journal.positions
    accounted = np.zeros(len(rows), dtype=bool)
    accounted[positions[positions < len(rows)]] = True
    if open_samples:
        accounted[np.fromiter(open_samples, dtype=np.int64, count=len(open_samples))] = True
    missing = np.flatnonzero(~accounted)
    del accounted
    if missing.size:
        raise StageError(f"{missing.size} samples have no result (first lines: {(missing[:5] + 1).tolist()}); "
                         "rerun the stage to extract them")
    plan, before = journal.plan, load_plan(dd)
    if before is not None and not np.array_equal(before, plan):
        undo_plan(dd, before)
        before = None
    if before is None:
        check_moved_files(dd, rows, plan)
    lost = [g for g, _, src, dst in plan_files(dd, plan) if not src.exists() and not dst.exists()]
    if lost:  # checked before any rename: the mapping stays that of the journals
        forget_lost_files(dd, rows, plan, lost)
    if before is None:
        save_plan(dd, plan)  # durable before the first rename
    dd.hs_files.mkdir(parents=True, exist_ok=True)
    for _, _, src, dst in plan_files(dd, plan):
        if src.exists():
            os.replace(src, dst)
    with os.scandir(dd.hs_files) as listing:
        for stale in listing:
            if stale.name.startswith("hs_") and stale.name.endswith(".safetensors"):
                if int(stale.name[3:-len(".safetensors")]) >= len(plan):
                    os.unlink(stale.path)
    for shard_dir in dd.hs_work.glob("shard_*"):  # late writes of requests the vLLM client gave up on
        with os.scandir(shard_dir) as listing:
            for junk in listing:
                if is_hs_attempt_file(Path(junk.name)):
                    Path(junk.path).unlink(missing_ok=True)
    save_hs_rows(dd.hidden_states, ((row.input_ids, row.loss_mask) for row in rows.rows(plan[:, 0])))
    listed = [(position, reason, row_id) for position, (row_id, reason) in journal.dropped.items()]
    listed += [(i, f"retryable: {reason} (a rerun of stage 02 retries it)", rows[i].id)
               for i, reason in open_samples.items()]
    write_jsonl_atomic(dd.hs_errors, [DroppedRow(identity["input"], position, reason, row_id).to_json()
                                      for position, reason, row_id in sorted(listed)])
    manifest = HiddenStatesManifest(
        verifier=identity["verifier"], num_layers=num_layers, aux_layer_ids=identity["aux_layer_ids"],
        hidden_size=hidden_size, model_dtype=identity["model_dtype"], storage_dtype=identity["storage_dtype"],
        num_samples=len(plan), num_tokens=journal.num_tokens,
        num_dropped=len(journal.dropped) + len(open_samples), bytes=journal.bytes,
        input=identity["input"], config_hash=config_hash, states=state_names(identity["aux_layer_ids"], num_layers),
        num_retryable=len(open_samples),
    )
    save_hs_manifest(dd.hs_manifest, manifest)
    return manifest


def upgrade_manifest(dd: DataDir, manifest: HiddenStatesManifest) -> HiddenStatesManifest:
    """A finished hidden_states/ of an older format (``records.HS_FORMAT_VERSION``: format 1 was written before each
    sample file carried its layer ids): every file's metadata is read (headers only) and checked against the
    manifest; when all carry it, the manifest is rewritten in the current format and nothing is extracted again;
    one file without it stops the stage, naming it and --overwrite (nothing can tell which layers it holds, and
    stage 04 would stop at it mid-run)."""
    old = manifest.format_version
    log.info("%s: format %d: checking the layer ids of its %d files before upgrading it to format %d",
             dd.hidden_states, old, manifest.num_samples, HS_FORMAT_VERSION)
    for i in range(manifest.num_samples):
        path = dd.hs_file(i)
        try:
            metadata = read_hidden_states_header(path)[3]
            if HS_META_LAYER_IDS not in metadata:
                raise FormatError(f"{path}: no layer ids in its metadata (hidden_states/ of format {old}, written by "
                                  "an eagle3pipe before each file recorded which layers it holds)")
            finite = check_hs_file_metadata(path, metadata, manifest.aux_layer_ids, manifest.num_layers)
        except FormatError as e:
            raise StageError(f"{e}: nothing can check what it holds; rerun with --overwrite to extract "
                             f"{dd.hidden_states} again") from None
        if not finite:
            raise StageError(f"{path}: its metadata says its states hold NaN/Inf: rerun with --overwrite to extract "
                             f"{dd.hidden_states} again")
    manifest.format_version = HS_FORMAT_VERSION
    save_hs_manifest(dd.hs_manifest, manifest)
    log.info("%s: every file carries the layer ids the manifest names: upgraded to format %d", dd.hidden_states,
             HS_FORMAT_VERSION)
    return manifest


def check_open_share(cfg: PipelineConfig, rows, open_samples: dict[int, str]) -> None:
    """01b's rule (--max-error-share): more samples left open by transient failures than the share allows stop the
    stage (exit 2, no manifest: stages 03/04 refuse hidden_states/), naming them and how to resume; fewer finish it
    without them, listed, and a rerun still retries them."""
    if not open_samples:
        return
    share = cfg.extract.max_error_share
    allowed = errors_allowed(share, len(rows))
    kinds = collections.Counter(reason.split(":", 1)[0] for reason in open_samples.values())
    first = min(open_samples)
    summary = (f"{len(open_samples)} of {len(rows)} samples are not extracted after {1 + cfg.extract.max_retries} "
               f"attempts ({', '.join(f'{k} {v}' for k, v in kinds.most_common())}; first: row {rows[first].id}, "
               f"line {first + 1}: {open_samples[first]})")
    if len(open_samples) > allowed:
        raise StageError(f"{summary}; allowed: {allowed} (--max-error-share {share:g}). hidden_states/ is not "
                         "finished (no manifest.json; stages 03/04 refuse it). Everything else is kept: rerun the "
                         f"same command to retry exactly these {len(open_samples)} samples")
    log.warning("%s: within --max-error-share %g: hidden_states/ is finished without them (listed in errors.jsonl "
                "as retryable); a rerun retries them", summary, share)


def _changed(run_before: dict | None, manifest: HiddenStatesManifest | None, identity: dict) -> str:
    """What differs between the extraction in hidden_states/ and this one, as 'key: then, now' (for the refusal)."""
    if run_before and "identity" in run_before:
        before = run_before["identity"]
    elif manifest is not None:
        before = {k: getattr(manifest, k) for k in ("verifier", "aux_layer_ids", "model_dtype", "storage_dtype",
                                                    "input")}
    else:
        return "no record of its settings"
    changed = []
    for key, now in identity.items():
        if key in before and before[key] != now:
            # the input's hash says only that the file changed; the other keys are worth printing
            changed.append(f"{identity['input']} changed since" if key == "input_sha256"
                           else f"{key}: {before[key]!r} then, {now!r} now")
    return "; ".join(changed) or "settings differ"


def read_rows(cfg: PipelineConfig) -> tuple[Path, RowIndex]:
    """(input file, its row index): the rows stage 02 extracts (and 04 online trains from), ``extract.input``'s file;
    a partial 01b output, an empty file or a repeated row id is refused. The rows stay on disk (``records.RowIndex``:
    28 bytes a row, memory-mapped); ``rows[i]`` reads row i when it is needed."""
    src = input_path(cfg)
    if not src.exists():
        raise FileNotFoundError(f"{src}: no input rows; run the stage that writes it, or pick another with --input")
    if cfg.extract.input == "synthetic":
        check_synthetic_finished(DataDir(cfg.data_dir))  # a partial 01b output is refused, naming 01b
    rows = open_row_index(src, "rows")
    if not len(rows):
        raise StageError(f"{src}: holds no rows")
    first_repeat = _first_repeated_id(rows)
    if first_repeat is not None:
        row_id, first, second = first_repeat
        raise FormatError(f"{src}: row id {row_id!r} appears on lines {first + 1} and {second + 1}")
    return src, rows


def _first_repeated_id(rows: RowIndex) -> tuple[str, int, int] | None:
    """(id, its first line, its second) of the id repeated earliest in file order (by its second line), or None.
    By the index's id keys (arrays), each candidate's lines read to compare the ids themselves."""
    keys = np.asarray(rows.keys)
    order = np.argsort(keys, kind="stable")  # [n]: equal keys in file order
    sorted_keys = keys[order]  # [n]
    same = np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1])  # order[j + 1] repeats order[j]'s key
    best = None
    for j in same[np.argsort(order[same + 1], kind="stable")]:  # by the repeat's line
        second = int(order[j + 1])
        first = int(order[np.searchsorted(sorted_keys, keys[second])])  # the key's first line
        if rows.record(first)["id"] == rows.record(second)["id"]:
            best = (rows.record(first)["id"], first, second)
            break
    return best


def run_extract(cfg: PipelineConfig) -> HiddenStatesManifest:
    """Stage 02 (see module docstring). Returns the manifest of the finished output."""
    started = time.time()
    dd, ex, sh = DataDir(cfg.data_dir), cfg.extract, cfg.shared
    src, rows = read_rows(cfg)
    text_config, _ = load_text_config(sh.verifier, sh.trust_remote_code)
    num_layers, hidden_size = text_config.num_hidden_layers, text_config.hidden_size
    if hidden_size != sh.hidden_size:
        raise ConfigError(f"{sh.verifier}: hidden size {hidden_size} but shared.hidden_size is {sh.hidden_size}; "
                          "fix --hidden-size")
    if any(k >= num_layers for k in sh.aux_layer_ids):
        raise ConfigError(f"shared.aux_layer_ids {sh.aux_layer_ids} must be < {num_layers} (the verifier's "
                          f"layers; the final state, id {num_layers}, is always stored last)")

    identity = output_identity(cfg, src)
    config_hash = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    manifest = load_hs_manifest(dd.hs_manifest, any_version=True)
    run_file = dd.hs_run
    run_before = json.loads(run_file.read_text()) if run_file.exists() else None
    previous = run_before["config_hash"] if run_before else None
    if manifest is not None:
        previous = manifest.config_hash
    if previous is not None and previous != config_hash:
        if not ex.overwrite:
            raise StageError(f"{dd.hidden_states} holds hidden states of other inputs/config ("
                             f"{_changed(run_before, manifest, identity)}); rerun with the original settings to "
                             "resume, or pass --overwrite to delete and redo them")
        log.warning("--overwrite: deleting hidden states of config %s in %s", previous, dd.hidden_states)
        remove_outputs(dd)
        manifest = None
    if manifest is not None and manifest.format_version < HS_FORMAT_VERSION:
        if ex.overwrite:
            log.warning("--overwrite: deleting hidden states of format %d in %s", manifest.format_version,
                        dd.hidden_states)
            remove_outputs(dd)
            manifest = None
        else:
            manifest = upgrade_manifest(dd, manifest)
    if manifest is not None and manifest.num_retryable:
        reopen(dd, manifest)
        manifest = None
    if manifest is not None:
        log.info("%s: already finished for this config (%d samples, %d tokens); nothing to do", dd.hidden_states,
                 manifest.num_samples, manifest.num_tokens)
        return manifest
    dd.hs_work.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_file, {"config_hash": config_hash, "identity": identity})

    done = np.zeros(len(rows), dtype=bool)
    for shard_dir in dd.hs_work.glob("shard_*"):
        positions = clean_shard_dir(dd, int(shard_dir.name.split("_")[1]))["position"]
        done[positions[positions < len(rows)]] = True
    todo = RowSelection(rows, np.flatnonzero(~done))  # positions and lengths: each row's ids read as it is sent
    num_states = len(sh.aux_layer_ids) + 1
    todo_tokens = todo.tokens
    log.info("%s: %d rows, %d already done, %d to extract (%d tokens); states %s", src, len(rows),
             int(done.sum()), len(todo), todo_tokens, state_names(sh.aux_layer_ids, num_layers))
    open_samples: dict[int, str] = {}
    if len(todo):
        preflight_disk(dd, todo_tokens, len(todo), num_states, hidden_size, ex.storage_dtype, ex.force_disk)
        shard = max({int(p.name.split("_")[1]) for p in dd.hs_work.glob("shard_*")} | {-1}) + 1
        t0 = time.monotonic()
        if ex.backend == "vllm":
            open_samples = extract_with_vllm(cfg, dd, shard, todo, num_layers, hidden_size,
                                             int(rows.lengths.max()))
        else:
            _extract_with_transformers(cfg, dd, shard, todo)
        elapsed = time.monotonic() - t0
        log.info("extracted %d samples / %d tokens in %s (%.0f tok/s), %s backend", len(todo), todo_tokens,
                 format_duration(elapsed), todo_tokens / max(elapsed, 1e-9), ex.backend)
        check_open_share(cfg, rows, open_samples)
    manifest = finalize(dd, rows, identity, cfg, num_layers, hidden_size, config_hash, open_samples)
    write_provenance(dd.provenance(dd.hidden_states), stage="extract", config_hash=config_hash,
                     config=cfg.to_dict(), inputs=[str(src), identity["verifier"]],
                     counts={"samples": manifest.num_samples, "tokens": manifest.num_tokens,
                             "dropped": manifest.num_dropped, "retryable": manifest.num_retryable,
                             "bytes": manifest.bytes}, started=started)
    log.info("hidden states: %s (%d samples, %d tokens, %.2f GB %s, %d dropped), %s", dd.hidden_states,
             manifest.num_samples, manifest.num_tokens, manifest.bytes / 1e9, manifest.storage_dtype,
             manifest.num_dropped, format_duration(time.time() - started))
    return manifest
