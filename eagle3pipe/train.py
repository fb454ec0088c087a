"""Stage 04: train an EAGLE-3 draft on speculators 0.9 and export it for vLLM.

Model, loss, data loading and packing are speculators' own: ``Eagle3DraftModel`` (its TTT unroll and per-step
KL loss), ``ArrowDataset`` + ``FileTransfer`` (reads hidden_states/ exactly as ``speculators train --data-path``
does), ``shift_batch``, ``CollateFn`` and ``MultipackDistributedBatchSamplerV2``; fp8 files stay e4m3 through the
loader and are dequantised on the device, and each batch's host-to-device copy overlaps the step before it
(``train_data.py``). The loop around them
is ours (~100 lines) rather than speculators' ``Trainer`` because that one moves the model to ``cuda:local_rank``
(no CPU run), checkpoints per epoch fraction under epoch-numbered folders, and prints with tqdm.rich; we need
checkpoints every N steps with exact step resume, the CPU toy run, and our progress lines. Settings that differ
by device: flex attention on CUDA, sdpa on CPU (flex backward is not implemented on CPU); the eager loss always
(the fused Triton loss needs Triton and crashed under torch.compile on the H200).

Several GPUs (or CPU processes): torchrun starts one process per GPU, each runs ``run_train``; the draft is wrapped
in torch's ``DistributedDataParallel`` (gradients averaged over ranks once per step, ``no_sync`` while
``train.grad_accum`` rows accumulate), every rank trains its share of one packing (``rank_rows``), metrics are
all-reduced, and rank 0 alone touches files (``on_rank0``). A rank that dies is torchrun's to report: its elastic
agent stops the others and names it.

Every states file is checked as it is read (``train_data``): layer metadata that is not the manifest's stops the run;
a file whose states are not one row per token id, or whose token ids are not its row's, is trained without, listed
in checkpoints/skipped.jsonl with its file and reason (``train_metrics.SkippedSamples``: every rank's, written by
rank 0), counted in the epoch's records; past --max-error-share of an epoch's samples the run checkpoints and stops.

Monitoring (``train_metrics``): each log line holds the means since the line before; a held-out evaluation runs
every train.eval_every_steps steps (0: after each epoch) and after the last step, with the simulated acceptance
length, redrawing curves.png; every record also goes to train.report_to's trackers. train.export best exports the
best evaluation's checkpoint (saved when made, never pruned); --export-from step_N exports any checkpoint beside a
running training. The recipe (loss by name, AdamW decay and betas, clipping, hidden-state noise) is config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .cli import StageError, errors_allowed
from .config import PipelineConfig
from .progress import Progress
from .records import (
    DataDir,
    FormatError,
    load_hs_manifest,
    read_jsonl,
    read_provenance,
    write_jsonl_atomic,
    write_provenance,
)
from .records_checkpoints import (
    SkippedSample,
    TrainingState,
    check_train_checkpoint,
    list_train_checkpoints,
    load_skipped_samples,
    load_train_checkpoint,
    save_train_checkpoint,
)
from .records_vocab import load_vocab_mapping, load_vocab_summary
from .train_batches import (
    BatchSource,
    EpochBatches,
    EpochPlan,
    OfflineBatches,
    PackedRows,
    RankRows,
    Ranks,
    SourceStopped,
    agree_stop,
    check_lengths_fit,
    datasets_without_video,
    split_files,
    make_loader,
    packed_batches,
    states_reader,
    train_dtype,
)
from .train_anchor import InitAnchor
from .train_drafts import check_aux_ids, check_warm_start_vocab, draft_family, warm_start_aux_ids
from .train_metrics import (
    ACCEPTANCE_KEY,
    MetricsLog,
    SkippedSamples,
    add_metrics,
    best_evaluation,
    check_trackers,
    evaluate_sums,
    reduce_metrics,
)

log = logging.getLogger(__name__)


def resolve_device(name: str, ranks: Ranks | None = None) -> torch.device:
    """The training device; under torchrun every rank takes GPU ``LOCAL_RANK`` of its node."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise StageError(f"--device {name}: no CUDA device here (use --device cpu)")
    if device.type == "cuda" and ranks is not None and ranks.distributed:
        if device.index is not None and ranks.world > 1:
            raise StageError(f"--device {name} names one GPU, but torchrun runs {ranks.world} processes: pass "
                             "--device cuda (or auto), each rank then takes GPU LOCAL_RANK")
        device = torch.device("cuda", ranks.local_rank)
    return device


# ---------------------------------------------------------------------------------------------------------------
# Data parallel (torchrun)


def job_ranks() -> Ranks:
    if "WORLD_SIZE" not in os.environ:
        return Ranks()
    return Ranks(world=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]),
                 local_rank=int(os.environ.get("LOCAL_RANK", "0")), distributed=True)


def start_process_group(ranks: Ranks, device: torch.device) -> None:
    """NCCL between GPUs, gloo on CPU. A rank that dies is torchrun's to report: its elastic agent stops every
    other rank (SIGTERM, then SIGKILL after 30 s) and exits non-zero naming the failed rank first."""
    import datetime

    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    # rank 0 alone writes a checkpoint (~12.5 GB for K2.5) while the others wait in a collective: 30 minutes, not
    # the 10 of NCCL's default, before a wait counts as a hang
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=30),
                            device_id=device if device.type == "cuda" else None)


def on_rank0(ranks: Ranks, fn: Callable[[], object]):
    """Run ``fn`` on rank 0 alone (every file operation that is not per rank: deleting on --overwrite, run.json,
    truncating metrics.jsonl, checkpoints and their pruning, the export); the other ranks wait for its outcome and
    go on with its result, or stop with its StageError."""
    error, out = None, None
    if ranks.main:
        try:
            out = fn()
        except StageError as e:
            error = str(e)
    if ranks.distributed:
        import torch.distributed as dist

        box = [(error, out)]
        dist.broadcast_object_list(box, src=0)
        error, out = box[0]
    if error is not None:
        raise StageError(error if ranks.main else f"rank 0 stopped the job: {error}")
    return out


def rank_rows(num_rows: int, world: int, grad_accum: int, rank: int, start_step: int = 0) -> RankRows:
    """This rank's packed rows of an epoch from optimizer step ``start_step`` on, one per micro-step, as
    (row position, real) (``RankRows``: two arrays). Step s trains rows s*G .. s*G+G-1 (G = world x grad_accum),
    micro-step a of rank r row s*G + a*world + r, so every rank runs ceil(rows / G) steps of grad_accum micro-steps
    and no row is read twice. Where the epoch's last step holds fewer than G rows, a rank without one re-reads the
    step's first row with weight 0 (real False): it still joins the gradient all-reduce, and adds nothing to it."""
    group = world * grad_accum
    steps = np.arange(start_step, max(start_step, math.ceil(num_rows / group)), dtype=np.int64)  # [S]
    at = steps[:, None] * group + np.arange(grad_accum, dtype=np.int64)[None, :] * world + rank  # [S, accum]
    real = at < num_rows  # [S, accum]
    positions = np.where(real, at, steps[:, None] * group)  # [S, accum]
    return RankRows(positions.reshape(-1), real.reshape(-1))


def check_rows_trained(trained_per_rank: list[list[int]], rows, start_step: int, group: int, epoch: int) -> dict:
    """Every packed row of the epoch from ``start_step`` on was trained by exactly one rank (raises otherwise);
    returns the epoch's "rows" record for metrics.jsonl. Counted with arrays (one count a packed row)."""
    first = start_step * group
    seen = np.concatenate([np.asarray(r, dtype=np.int64).reshape(-1) for r in trained_per_rank] or
                          [np.zeros(0, dtype=np.int64)])  # [rows trained, all ranks]
    inside = (seen >= first) & (seen < len(rows))
    counts = np.bincount(seen[inside] - first, minlength=max(0, len(rows) - first))  # [rows from the first]
    outside, twice, missing = (np.unique(seen[~inside]), np.flatnonzero(counts > 1) + first,
                               np.flatnonzero(counts == 0) + first)
    if outside.size or twice.size or missing.size:
        raise StageError(f"epoch {epoch}: the ranks trained packed rows {np.unique(seen)[:20].tolist()}..., the "
                         f"packing has {max(0, len(rows) - first)} from row {first} (missing "
                         f"{missing[:20].tolist()}, twice {twice[:20].tolist()}, outside {outside[:20].tolist()}): a "
                         "bug in the row split, not in the data")
    sizes = (np.diff(rows.starts) if isinstance(rows, PackedRows) else
             np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows)))  # [rows]
    return {"kind": "rows", "epoch": epoch, "rows": int(len(seen)), "packed_rows": len(rows),
            "from_row": first if first < len(rows) else 0,
            "samples": int(sizes[first:].sum()), "rows_per_rank": [len(r) for r in trained_per_rank]}


def resolve_attn_impl(name: str, device: torch.device) -> str:
    if name == "auto":
        return "simple_flex_attention" if device.type == "cuda" else "sdpa"
    if name == "simple_flex_attention" and device.type == "cpu":
        raise StageError("--attn-impl simple_flex_attention: flex-attention backward does not run on CPU; use sdpa")
    return name


# ---------------------------------------------------------------------------------------------------------------
# Model


def build_model(cfg: PipelineConfig, device: torch.device):
    """(model, base_config for the export) from vocab/ and either --finetune-from or a fresh layer config."""
    from . import draft

    dd = DataDir(cfg.data_dir)
    s, t = cfg.shared, cfg.train
    attn_impl = resolve_attn_impl(t.attn_impl, device)
    if t.draft != "eagle3":  # DFlash and MLA drafts build their own, fresh or warm (train_drafts.py)
        return draft_family(cfg, device).build_model(attn_impl)
    summary = load_vocab_summary(dd.vocab_summary)
    d2t, t2d = load_vocab_mapping(dd.vocab_mapping, s.vocab_size, s.draft_vocab_size)
    torch.manual_seed(s.seed)  # a fresh draft's initial weights
    if not t.finetune_from:
        try:
            model, layer_config = draft_family(cfg, device).new_model(d2t, t2d, attn_impl)
        except ValueError as e:  # the attention geometry asked for (draft_attention_geometry)
            raise StageError(str(e)) from None
        log.info("new draft: %d heads x %d (%d KV heads), MLP %d, draft vocab %d (vocab/ source: %s)",
                 layer_config.num_attention_heads, layer_config.head_dim, layer_config.num_key_value_heads,
                 layer_config.intermediate_size, d2t.shape[0], summary.source)
        return model, None
    check_warm_start_vocab(cfg, summary)
    try:
        model, ckpt, info = draft.load_finetune_draft(t.finetune_from, verifier=s.verifier, d2t=d2t, t2d=t2d,
                                                      aux_layer_ids=cfg.draft_layer_ids, ttt_steps=t.ttt_steps,
                                                      attn_impl=attn_impl)
    except draft.DraftFormatError as e:
        raise StageError(str(e)) from None
    check_aux_ids(warm_start_aux_ids(cfg, ckpt.aux_layer_ids), cfg.draft_layer_ids, t.finetune_from)
    if summary.source == "checkpoint" and info["remapped"]:
        raise StageError(f"{dd.vocab} says it kept the map of {t.finetune_from} but differs from it: rerun 03")
    log.info("warm start from %s (vocab %s%s)", t.finetune_from, summary.source,
             f", {info['shared']} lm_head rows kept, the rest the verifier's" if info["remapped"] else "")
    return model, ckpt.config


def set_lm_head_training(model, cfg: PipelineConfig) -> None:
    """speculators freezes the draft's lm_head; ``train.train_lm_head`` trains it. Either way, say which rows the
    export will hold, since a frozen head is whatever it started as."""
    t = cfg.train
    model.lm_head.weight.requires_grad_(t.train_lm_head)
    if t.train_lm_head:
        log.info("draft lm_head: trained (train.train_lm_head)")
    elif t.finetune_from:
        log.info("draft lm_head: frozen (speculators' default), so the export keeps the rows it starts from: %s's "
                 "(with a rebuilt vocab map, the verifier's rows for tokens new to it); train.train_lm_head trains it",
                 t.finetune_from)
    else:
        log.info("draft lm_head: frozen (speculators' default) at the verifier's lm_head rows of the draft "
                 "vocabulary; train.train_lm_head trains it")


def draft_state(model) -> dict[str, torch.Tensor]:
    """The draft's own tensors (what a checkpoint stores); the verifier's are reloaded from the verifier."""
    from .draft import VERIFIER_OWNED_KEYS

    return {k: v for k, v in model.state_dict().items() if k not in VERIFIER_OWNED_KEYS}


# ---------------------------------------------------------------------------------------------------------------
# Data: which source (the sources and what both build on: train_batches.py)


def build_data(cfg: PipelineConfig, device: torch.device):
    """(train_dataset, val_dataset or None, manifest) over <data_dir>/hidden_states with speculators' reader."""
    if cfg.train.data_source == "online":  # rows from 01/01b, states from vLLM as training goes (train_online.py)
        from .train_online import build_online_data

        return build_online_data(cfg, device)
    datasets_without_video()
    dd = DataDir(cfg.data_dir)
    t = cfg.train
    manifest = load_hs_manifest(dd.hs_manifest)
    if manifest is None:
        raise StageError(f"{dd.hs_manifest} not found: stage 02 has not finished (run 02_extract_hidden_states.py)")
    check_states_match(manifest, cfg)
    transfer, dataset_class, stored = states_reader(manifest, dd.hs_files, train_dtype(device))
    train_files, held_files = split_files(manifest.num_samples, t.eval_fraction, cfg.shared.seed, t.max_samples)

    def dataset(files):
        return dataset_class(max_len=t.total_seq_len, datapath=str(dd.hidden_states), transfer=transfer,
                             on_missing="raise", file_indices=files, hidden_states_dtype=stored)

    train_ds, val_ds = dataset(train_files), (dataset(held_files) if held_files is not None else None)
    check_lengths_fit(train_ds.approx_lengths + (val_ds.approx_lengths if val_ds is not None else []), cfg)
    return train_ds, val_ds, manifest


def _same_checkpoint(a: Path, b: Path) -> bool:
    """Two verifier folders hold the same checkpoint: equal config.json, and equal safetensors files by name, size,
    and their first and last MiB (header, first and last tensors; a copy matches, a fine-tune does not)."""
    def fingerprint(folder: Path) -> list | None:
        if not (folder / "config.json").is_file():
            return None
        out: list = [(folder / "config.json").read_bytes()]
        for f in sorted(folder.glob("*.safetensors")):
            size = f.stat().st_size
            with open(f, "rb") as fh:
                head = fh.read(1 << 20)
                fh.seek(max(0, size - (1 << 20)))
                out.append((f.name, size, hashlib.sha256(head + fh.read()).hexdigest()))
        return out

    fa = fingerprint(a)
    return fa is not None and fa == fingerprint(b)


def check_states_match(manifest, cfg: PipelineConfig) -> None:
    """Refuse hidden states made from another verifier, other layers or (when a config file is given) another
    extraction dtype than this run's: the draft would learn one model's states with another's embedding, final
    norm and lm_head, or be exported for layers it never read. Each message names both sides."""
    from . import draft

    dd, s = DataDir(cfg.data_dir), cfg.shared
    where = dd.hs_manifest
    theirs, ours = Path(manifest.verifier), Path(s.verifier)
    if theirs.resolve() != ours.resolve():
        if not _same_checkpoint(theirs, ours):
            raise StageError(
                f"{where}: the hidden states were extracted from verifier {manifest.verifier}, but --verifier is "
                f"{s.verifier}: training would pair one model's states with the other's embedding and lm_head. "
                f"Pass --verifier {manifest.verifier}, or rerun 02_extract_hidden_states.py --verifier {s.verifier} "
                "--overwrite (if the checkpoint only moved, a symlink at the old path to it is accepted)")
        log.info("%s: states from %s, an identical copy of --verifier %s", where, manifest.verifier, s.verifier)
    if list(manifest.aux_layer_ids) != list(s.aux_layer_ids) or manifest.hidden_size != s.hidden_size:
        raise StageError(f"{where}: aux layers {manifest.aux_layer_ids} / hidden {manifest.hidden_size}, "
                         f"config says {s.aux_layer_ids} / {s.hidden_size} (--aux-layer-ids, --hidden-size)")
    num_layers = draft.verifier_text_config(s.verifier, s.trust_remote_code).num_hidden_layers
    if manifest.num_layers != num_layers:
        raise StageError(f"{where}: states from a {manifest.num_layers}-layer verifier, --verifier {s.verifier} has "
                         f"{num_layers} layers: not the model the states came from")
    if cfg.source == "<defaults>":  # flags only: no extract section was given, the manifest says how it was stored
        log.info("%s: states stored as %s (verifier ran in %s)", where, manifest.storage_dtype, manifest.model_dtype)
        return
    ex = cfg.extract
    for key, got in (("storage_dtype", manifest.storage_dtype), ("model_dtype", manifest.model_dtype)):
        want = getattr(ex, key)
        if got != want:
            raise StageError(f"{where}: states {key} {got}, but {cfg.source} says extract.{key} {want}: hidden_states/ "
                             "was not made with this config (pass the config stage 02 ran with, or rerun 02 with "
                             "this one and --overwrite)")


def eval_due(step: int, epoch_end: bool, last_step: int, every: int) -> bool:
    """A held-out evaluation follows optimizer step ``step``: every ``train.eval_every_steps`` steps, or (0) after the
    last step of each epoch; and after the run's last step (--max-steps may end it inside an epoch), so the weights
    a run ends with always have a figure. The loop and ``run_plan`` (the online source plans the held-out rows
    from it) both ask this."""
    return (step % every == 0 if every else epoch_end) or step == last_step


def run_plan(epoch_batches: list, state: TrainingState, max_steps: int, world: int, accum: int, rank: int,
             eval_every: int = 0) -> list[EpochPlan]:
    """Every epoch the run trains from ``state`` on, as the loop will train it: the epoch where ``max_steps`` stops
    the run is cut there; the evaluations each epoch holds (``eval_due``)."""
    group = world * accum
    total = sum(math.ceil(len(b) / group) for b in epoch_batches)
    last = min(total, max_steps) if max_steps else total
    out, step = [], state.step
    for e in range(state.epoch, len(epoch_batches)):
        rows = epoch_batches[e]
        plan = rank_rows(len(rows), world, accum, rank, state.batches_done if e == state.epoch else 0)
        cut = bool(max_steps) and len(plan) // accum >= max_steps - step
        if cut:
            plan = plan[:max(0, max_steps - step) * accum]
        steps = len(plan) // accum
        epoch_steps = math.ceil(len(rows) / group)
        start = state.batches_done if e == state.epoch else 0
        evals = [step + i for i in range(1, steps + 1)
                 if eval_due(step + i, start + i == epoch_steps, last, eval_every)]
        picked = plan.positions
        out.append(EpochPlan(e, plan, rows.take(picked) if isinstance(rows, PackedRows) else
                             [rows[i] for i in picked.tolist()], evals, step))
        if cut:
            break
        step += steps
    return out


def make_batches(cfg: PipelineConfig, train_ds, val_ds, manifest, ranks: Ranks,
                 device: torch.device) -> BatchSource:
    """The epoch and evaluation batches of train.data_source: offline, DataLoaders over hidden_states/; online, the
    states extracted into the spool as training goes (train_online.py). Each rank evaluates its share of the
    held-out rows (one packing, the same every epoch); the sums are all-reduced."""
    eval_rows = (packed_batches(val_ds, cfg.train.total_seq_len, cfg.shared.seed, 0)[ranks.rank::ranks.world]
                 if val_ds is not None else [])
    if cfg.train.data_source == "online":
        from .train_online import OnlineBatches

        return OnlineBatches(cfg, train_ds, manifest, ranks, device, val_ds, eval_rows)
    sampler, val_loader = EpochBatches(), None
    if val_ds is not None:
        val_sampler = EpochBatches()
        val_sampler.set(eval_rows)
        val_loader = make_loader(val_ds, val_sampler, cfg, device)
    return OfflineBatches(make_loader(train_ds, sampler, cfg, device), sampler, val_loader)


# ---------------------------------------------------------------------------------------------------------------
# The stage


def lr_factor(update: int, warmup_steps: int, total_steps: int) -> float:
    """Share of the peak learning rate that optimizer update ``update`` (0-based) runs at: linear warm-up that
    starts at 1 / warmup_steps (transformers' ``get_cosine_schedule_with_warmup`` starts at 0, so its first update
    changes nothing), then cosine decay that reaches 0 only after the last update."""
    if update < warmup_steps:
        return (update + 1) / warmup_steps
    progress = (update - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_schedule(optimizer, warmup_steps: int, total_steps: int):
    """LambdaLR over ``lr_factor``; its state (the update count) resumes like any scheduler's."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: lr_factor(update, warmup_steps, total_steps))


def _prepare_checkpoints(cfg: PipelineConfig) -> tuple[int, Path] | None:
    """The checkpoint to resume from, or None; refuses to silently overwrite an earlier run (rank 0 alone)."""
    dd = DataDir(cfg.data_dir)
    existing = list_train_checkpoints(dd.checkpoints)
    if cfg.train.resume:
        if not existing:
            log.warning("--resume: no checkpoint in %s, starting from scratch", dd.checkpoints)
            return None
        for step, folder in reversed(existing):  # the newest whole one (a power cut can leave the last one short)
            problem = check_train_checkpoint(folder)
            if problem is None:
                return step, folder
            torn = folder.with_name(f"{folder.name}.torn")  # no longer listed, kept to be looked at
            shutil.rmtree(torn, ignore_errors=True)
            folder.rename(torn)
            log.warning("--resume: %s is not whole (%s; a power cut before its data reached the disk?): moved to %s, "
                        "trying the checkpoint before it", folder, problem, torn.name)
        raise StageError(f"--resume: no whole checkpoint in {dd.checkpoints} (each is listed above with what it "
                         "lacks): --overwrite starts over")
    if existing or dd.final_checkpoint.exists():
        if not cfg.train.overwrite:
            raise StageError(f"{dd.checkpoints} holds an earlier run: --resume to continue it, --overwrite to start "
                             "over (deletes its checkpoints)")
        for _, path in existing:
            shutil.rmtree(path)
        shutil.rmtree(dd.final_checkpoint, ignore_errors=True)
        shutil.rmtree(dd.train_reports, ignore_errors=True)
        for p in dd.checkpoints.glob("export_step_*"):  # --export-from's exports of the run deleted
            shutil.rmtree(p, ignore_errors=True)
        for p in (dd.train_metrics, dd.train_curves, dd.train_online_errors, dd.train_skipped):
            p.unlink(missing_ok=True)
    return None


ROWS_PER_STEP = "rows per step (world size x train.grad_accum)"
HELD_OUT_KEY = "held-out rows"  # which rows train.eval_fraction holds out (train_batches.split_files)
# run.json keys that fix the draft's tensors: --export-from of a checkpoint needs them equal to the config it is given
DRAFT_SHAPE_KEYS = ("shared.verifier", "shared.aux_layer_ids", "shared.hidden_size", "shared.vocab_size",
                    "shared.draft_vocab_size", "train.finetune_from", "train.draft_num_heads",
                    "train.draft_num_kv_heads", "train.draft_head_dim", "train.draft_intermediate_size",
                    "vocab (stage 03)", "train.ttt_steps", "train.draft", "train.draft_layer_ids", "train.dflash")


def run_settings(cfg: PipelineConfig, manifest, world: int) -> dict:
    """What a checkpoint's position means (run.json's settings): the draft, its data, packing, schedule, split and
    recipe. ``manifest`` None: the data keys are left out (--export-from compares the draft's keys only)."""
    dd = DataDir(cfg.data_dir)
    s, t = cfg.shared, cfg.train
    return {
        "shared.verifier": str(Path(s.verifier).resolve()), "shared.aux_layer_ids": list(s.aux_layer_ids),
        "shared.hidden_size": s.hidden_size, "shared.vocab_size": s.vocab_size,
        "shared.draft_vocab_size": s.draft_vocab_size,
        "train.finetune_from": str(Path(t.finetune_from).resolve()) if t.finetune_from else "",
        "train.draft_num_heads": t.draft_num_heads, "train.draft_num_kv_heads": t.draft_num_kv_heads,
        "train.draft_head_dim": t.draft_head_dim,
        "train.draft_intermediate_size": t.draft_intermediate_size,
        **({"hidden_states (stage 02)": [manifest.config_hash, manifest.num_samples, manifest.num_tokens]}
           if manifest is not None else {}),
        "vocab (stage 03)": hashlib.sha256(dd.vocab_mapping.read_bytes()).hexdigest()[:16],
        # the packing (seed, row length), the schedule (epochs, warm-up, rows per step, peak rate), the held-out
        # split and the training samples (max_samples), the TTT unroll and which tensors the optimizer holds: another
        # value skips or repeats samples, or (lm_head) does not load the optimizer state at all. The peak rate lives
        # in the optimizer's and scheduler's state, which a resume loads: a new --learning-rate would be silently
        # ignored, so it is refused too
        "shared.seed": s.seed, "train.total_seq_len": t.total_seq_len, "train.epochs": t.epochs,
        "train.warmup_ratio": t.warmup_ratio, "train.learning_rate": t.learning_rate,
        "train.eval_fraction": t.eval_fraction, HELD_OUT_KEY: "drawn with shared.seed" if t.eval_fraction else "none",
        "train.max_samples": t.max_samples, "train.ttt_steps": t.ttt_steps,
        "train.train_lm_head": t.train_lm_head, ROWS_PER_STEP: world * t.grad_accum,
        # the recipe: the loss, AdamW's decay and betas (the betas also live in the optimizer state a resume loads),
        # the clipping and the noise; half a run on one recipe and half on another is no run of either
        "train.loss": t.loss, "train.weight_decay": t.weight_decay, "train.adam_betas": list(t.adam_betas),
        "train.max_grad_norm": t.max_grad_norm, "train.hidden_noise_std": t.hidden_noise_std,
        "train.anchor_to_init": t.anchor_to_init,
        **draft_family(cfg, torch.device("cpu")).identity(),  # the draft family (EAGLE-3, DFlash) and its settings
    }


def _check_resume_identity(cfg: PipelineConfig, resume_from: tuple[int, Path] | None, manifest,
                           ranks: Ranks) -> None:
    """--resume continues the same draft on the same data, packing, schedule, split and recipe only. A fresh start records
    them in checkpoints/run.json; a resume that changes any is refused naming the keys (rank 0 alone). The same
    rows per step under another world size x grad_accum resumes exactly (the packing does not depend on the
    world size); another number of rows per step is refused naming both."""
    import json

    from .records import atomic_write_json

    dd = DataDir(cfg.data_dir)
    t = cfg.train
    now = run_settings(cfg, manifest, ranks.world)
    layout = f"{ranks.world} x {t.grad_accum}"
    record = json.loads(dd.train_run.read_text()) if dd.train_run.exists() else None
    before = record["settings"] if record else None
    if resume_from is not None and before is None:
        log.warning("--resume: %s has no record of the run's settings (%s): cannot check them", dd.checkpoints,
                    dd.train_run.name)
    elif resume_from is not None:
        changed = []
        # a run.json written before issue 47 names no held-out rule: its held-out rows were the last ones; one
        # written before train.max_samples trained on the whole training split (0)
        before = {HELD_OUT_KEY: "the last rows" if before.get("train.eval_fraction") else "none",
                  "train.max_samples": 0, **before}
        for k, v in now.items():
            if before.get(k, v) != v:
                then_now = (f"{before[k]} ({record.get('layout', '?')}) then, {v} ({layout}) now"
                            if k == ROWS_PER_STEP else f"{before.get(k)!r} then, {v!r} now")
                changed.append(f"{k}: {then_now}")
        if changed:
            raise StageError(f"--resume: {resume_from[1]} belongs to a run with other settings or data ("
                             f"{'; '.join(changed)}): restore those settings / inputs to resume it, or pass "
                             "--overwrite instead of --resume to start over (deletes its checkpoints)")
        if record.get("layout", layout) != layout:
            log.info("--resume: %d rows per step as before, now as world size x grad_accum %s (was %s)",
                     now[ROWS_PER_STEP], layout, record["layout"])
        return
    atomic_write_json(dd.train_run, {"settings": now, "layout": layout})


EPOCH_END_RECORDS = ("rows", "online")  # metrics.jsonl kinds written at an epoch's end (the rest after a step)


def _truncate_records(dd: DataDir, state: TrainingState) -> list[SkippedSample]:
    """Drop the lines of metrics.jsonl and skipped.jsonl written after the checkpoint the run starts from (every
    line on a fresh start: a run killed before its first checkpoint), so each reads as one run and the steps
    trained again are listed once; returns the skipped samples kept (rank 0 alone). A step's records (train, and
    eval: an evaluation runs before the checkpoint of its step is saved) go by step, an epoch's end by epoch."""
    from .records import repair_jsonl

    def after_step(r: dict) -> bool:
        return r["epoch"] < state.epoch if r.get("kind") in EPOCH_END_RECORDS else r["step"] <= state.step

    for path in (dd.train_metrics, dd.train_skipped):
        if path.exists():
            repair_jsonl(path)
            write_jsonl_atomic(path, [r for r in read_jsonl(path) if after_step(r)])
    return load_skipped_samples(dd.train_skipped)


def _logged_tokens(dd: DataDir, step: int) -> int:
    """The cumulative tokens of the last train record at or before ``step`` (a checkpoint written before
    TrainingState kept them: the count then misses the steps between that record and the checkpoint)."""
    records = [r for r in read_jsonl(dd.train_metrics) if r.get("kind") == "train" and r["step"] <= step] \
        if dd.train_metrics.exists() else []
    return int(records[-1]["tokens"]) if records else 0


def _checkpoint_bytes(model_state: dict, optimizer_state: dict) -> int:
    """Bytes one checkpoint's tensors take (the draft's weights and the AdamW moments)."""
    tensors = list(model_state.values()) + [v for entry in optimizer_state["state"].values() for v in entry.values()]
    return sum(v.numel() * v.element_size() for v in tensors if isinstance(v, torch.Tensor))


def check_free_space(folder: Path, need: int, min_free_gb: float) -> None:
    """Refuse a save that would leave less than ``min_free_gb`` free on ``folder``'s disk, before writing a byte
    (a disk that fills mid-write leaves a torn temporary folder and no new checkpoint)."""
    free = shutil.disk_usage(folder).free
    if free - need < min_free_gb * 1e9:
        raise StageError(f"{folder}: {free / 1e9:.2f} GB free, a checkpoint needs {need / 1e9:.2f} GB and "
                         f"train.min_free_gb {min_free_gb:g} GB must stay free: free space, lower "
                         "train.keep_checkpoints, or move shared.data_dir; the checkpoints already written are "
                         "intact (--resume continues from the newest)")


def prune_checkpoints(checkpoints: Path, keep: int, protect: frozenset[int] = frozenset()) -> list[Path]:
    """Delete all but the newest ``keep`` step_N checkpoints (0 = keep all) and the steps in ``protect`` (the best
    evaluation's, train.export best), and temporary folders of saves that never finished; final/ is not a step_N
    folder and is never touched. Returns what was deleted."""
    gone = [p for p in checkpoints.glob(".step_*.tmp-*") if p.is_dir()]
    existing = list_train_checkpoints(checkpoints)
    if keep:
        gone += [p for step, p in existing[:-keep] if step not in protect]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def train_log_name(cfg: PipelineConfig) -> str:
    """The log and lock name of a 04 run: ``04_export`` for --export-from (it reads a checkpoint beside a running
    training, which holds ``04_train``'s lock), ``04_train`` otherwise."""
    return "04_export" if cfg.train.export_from else "04_train"


def run_train(cfg: PipelineConfig) -> Path:
    """Train (or resume), checkpoint, evaluate, export checkpoints/final/. Returns the export folder. Under
    torchrun every rank runs this; rank 0 alone writes files (see ``on_rank0``). With --export-from: export that
    checkpoint only (``export_checkpoint``)."""
    if cfg.train.export_from:
        return export_checkpoint(cfg)
    ranks = job_ranks()
    device = resolve_device(cfg.train.device, ranks)
    if ranks.distributed:
        start_process_group(ranks, device)
    before = torch.get_num_threads()
    if device.type == "cpu" and cfg.train.cpu_threads:
        # a toy draft's ops are small: with several threads each op waits for the slowest thread's time slice, and
        # on a shared 2-core machine a step took 4-6x longer than with one thread (docs/install.md, the demo)
        torch.set_num_threads(cfg.train.cpu_threads)
    try:
        return _run_train(cfg, ranks, device)
    finally:
        torch.set_num_threads(before)
        if ranks.distributed:
            import torch.distributed as dist

            dist.destroy_process_group()


def resolve_loss(cfg: PipelineConfig) -> dict:
    """speculators' loss config for train.loss (a name or a JSON dict of weights), eager implementation."""
    from speculators.losses import resolve_loss_config

    try:
        return resolve_loss_config(cfg.train.loss, "eager")
    except ValueError as e:
        raise StageError(f"train.loss {cfg.train.loss!r}: {e}") from None


def row_seed(seed: int, epoch: int, position: int) -> int:
    """A seed of one packed row of one epoch: the same whatever rank or micro-step trains it, and on a resume."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{epoch}/{position}".encode()).digest()[:8], "little")


def add_hidden_noise(batch: dict, std: float, seed: int) -> dict:
    """The device batch with uniform noise in [-std, std] added to the draft's input states (``hidden_states``, the
    3 aux states; not the verifier's last state, which makes the targets): what speculators' loader did before 0.9
    (``AddUniformNoise``, std 0.05 on training rows; 0.9.0 has no noise, so this is ours, one line of it). Drawn
    from ``seed`` (``row_seed``), so every world size x grad_accum and a resume add the same noise to a row."""
    states = batch["hidden_states"]
    generator = torch.Generator(device=states.device).manual_seed(seed)
    unit = torch.rand(states.shape, generator=generator, device=states.device, dtype=torch.float32)
    return {**batch, "hidden_states": states + ((2.0 * unit - 1.0) * std).to(states.dtype)}


def _run_train(cfg: PipelineConfig, ranks: Ranks, device: torch.device) -> Path:
    """One rank's training run, step by step: data and checkpoints checked, the draft built (and resumed), the rows
    packed and planned, then ``TrainingLoop`` trains them; the draft exported at the end."""
    started = time.time()
    t = cfg.train
    if ranks.distributed:
        log.info("rank %d of %d (local rank %d, pid %d) on %s", ranks.rank, ranks.world, ranks.local_rank,
                 os.getpid(), device)
    loss_config = resolve_loss(cfg)  # an unknown loss name costs no data check
    if ranks.main:
        check_trackers(t.report_to)
    train_ds, val_ds, manifest = build_data(cfg, device)  # its checks refuse before any checkpoint is touched
    # the samples the run trains on (train.max_samples cuts the training split) and judges on: provenance.json's
    split = {"train_samples": len(train_ds), "held_out_samples": len(val_ds) if val_ds is not None else 0}
    resume_from = on_rank0(ranks, lambda: _prepare_checkpoints(cfg))
    on_rank0(ranks, lambda: _check_resume_identity(cfg, resume_from, manifest, ranks))
    model, base_config = build_model(cfg, device)
    set_lm_head_training(model, cfg)
    model.to(device)
    epoch_batches, steps_per_epoch = pack_epochs(cfg, train_ds, ranks.world)
    params, optimizer, scheduler = make_optimizer(model, cfg, sum(steps_per_epoch))
    # train.anchor_to_init: theta_0 is the start training was built from, taken before a resume loads its step
    anchor = InitAnchor(params, t.anchor_to_init) if t.anchor_to_init else None
    state = load_resume_point(cfg, resume_from, model, optimizer, scheduler)
    dd = DataDir(cfg.data_dir)
    skipped_before = on_rank0(ranks, lambda: _truncate_records(dd, state))  # what steps after it wrote goes
    if state.epoch >= t.epochs or (t.max_steps and state.step >= t.max_steps):  # a --resume of a finished run
        log.info("--resume: %s is at step %d, %s: nothing left to train", resume_from[1], state.step,
                 f"--max-steps {t.max_steps}" if state.epoch < t.epochs else f"the end of epoch {t.epochs}")
        return on_rank0(ranks, lambda: _export(cfg, model, base_config, state, manifest, started, ranks.world,
                                               _skipped_counts(skipped_before), split, reuse=True))
    net = wrap_data_parallel(model, ranks, device)
    family = draft_family(cfg, device)  # EAGLE-3 or DFlash: forward kwargs, metrics, row RNG, export (train_drafts)
    call_kwargs = family.call_kwargs(loss_config)
    source = make_batches(cfg, train_ds, val_ds, manifest, ranks, device)  # online: servers up, capture checked
    plans = plan_epochs(cfg, epoch_batches, state, ranks, source, held_out=val_ds is not None)
    cap = min(sum(steps_per_epoch), t.max_steps) if t.max_steps else sum(steps_per_epoch)
    log_run_start(cfg, family, ranks.world, cap, epoch_batches, steps_per_epoch, manifest, device,
                  held_out=val_ds is not None, train_samples=len(train_ds))
    epoch_samples = len(train_ds) + (len(val_ds) if val_ds is not None else 0)
    loop = TrainingLoop(cfg, ranks, device, model, net, params, optimizer, scheduler, family, call_kwargs, source,
                        epoch_batches, steps_per_epoch, plans, cap, state, resume_from is not None, skipped_before,
                        epoch_samples, anchor)
    state, counts = loop.run()
    return on_rank0(ranks, lambda: _export(cfg, model, base_config, state, manifest, started, ranks.world, counts,
                                           split))


def pack_epochs(cfg: PipelineConfig, train_ds, world: int) -> tuple[list, list[int]]:
    """Every epoch's packed rows and its optimizer steps (world size x train.grad_accum rows a step)."""
    t = cfg.train
    group = world * t.grad_accum  # packed rows per optimizer step
    # one packing for every world size (speculators' sampler at num_replicas 1): ranks split its rows (rank_rows).
    # Its num_replicas > 1 would pack per world size (so 2 GPUs would not train what 1 GPU x grad_accum 2 does)
    # and drops an epoch's last samples when fewer than num_replicas are left.
    epoch_batches = [packed_batches(train_ds, t.total_seq_len, cfg.shared.seed, e) for e in range(t.epochs)]
    steps_per_epoch = [math.ceil(len(b) / group) for b in epoch_batches]
    if sum(steps_per_epoch) == 0:
        raise StageError(f"{DataDir(cfg.data_dir).hidden_states}: no training batch (no samples?)")
    return epoch_batches, steps_per_epoch


def make_optimizer(model, cfg: PipelineConfig, total_steps: int):
    """(trainable parameters, AdamW over them, its warm-up cosine schedule over ``total_steps``): the recipe's
    train.learning_rate, weight_decay, adam_betas and warmup_ratio."""
    t = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay,
                                  betas=tuple(t.adam_betas))  # the recipe (train.weight_decay, adam_betas)
    scheduler = warmup_cosine_schedule(optimizer, math.ceil(t.warmup_ratio * total_steps), total_steps)
    return params, optimizer, scheduler


def load_resume_point(cfg: PipelineConfig, resume_from: tuple[int, Path] | None, model, optimizer,
                      scheduler) -> TrainingState:
    """The state training starts from: step 0, or (--resume) the checkpoint's, with its weights, optimizer and
    schedule loaded into ``model``, ``optimizer`` and ``scheduler``."""
    state = TrainingState(step=0, epoch=0, batches_done=0, seed=cfg.shared.seed)
    if resume_from is not None:
        model_state, opt_state, sched_state, state = load_train_checkpoint(resume_from[1])
        own = draft_state(model)
        if set(model_state) != set(own):
            raise StageError(f"{resume_from[1]}: checkpoint keys differ from this draft's (config changed?)")
        model.load_state_dict(model_state, strict=False)
        optimizer.load_state_dict(opt_state)
        scheduler.load_state_dict(sched_state)
        log.info("resuming from %s: step %d, epoch %d, step %d of the epoch", resume_from[1], state.step, state.epoch,
                 state.batches_done)
    return state


def wrap_data_parallel(model, ranks: Ranks, device: torch.device):
    """The module the loop calls: the draft itself, or under torchrun the draft in DistributedDataParallel."""
    if not ranks.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    # buffers (the vocabulary maps) never change: no broadcast before every forward (torch 2.13 renamed the
    # flag forward_sync_buffers; the H200 image's 2.11 knows only broadcast_buffers)
    import inspect

    no_sync = ({"forward_sync_buffers": False}
               if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else {"broadcast_buffers": False})
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   gradient_as_bucket_view=True, **no_sync)


def plan_epochs(cfg: PipelineConfig, epoch_batches: list, state: TrainingState, ranks: Ranks, source: BatchSource,
                held_out: bool) -> dict[int, EpochPlan]:
    """This rank's plan of every epoch from ``state`` on (``run_plan``; no evaluations without held-out rows),
    handed to the source, with every rank's when the source plans the whole job (``plans_every_rank``: online with
    train.cache_gb, one cache for all ranks); otherwise no rank builds another's."""
    t = cfg.train
    eval_every = t.eval_every_steps if held_out else 0
    planned = range(ranks.world) if source.plans_every_rank else [ranks.rank]
    of_rank = {r: run_plan(epoch_batches, state, t.max_steps, ranks.world, t.grad_accum, r, eval_every)
               for r in planned}
    if not held_out:
        for p in (p for mine in of_rank.values() for p in mine):
            p.eval_steps = []
    plans = {p.epoch: p for p in of_rank[ranks.rank]}
    # online: the spool fills across epochs
    source.plan(of_rank[ranks.rank], [of_rank[r] for r in planned] if source.plans_every_rank else None)
    return plans


def log_run_start(cfg: PipelineConfig, family, world: int, cap: int, epoch_batches: list, steps_per_epoch: list[int],
                  manifest, device: torch.device, held_out: bool, train_samples: int) -> None:
    """The run's shape (steps, rows and tokens a step, epochs, samples) and its recipe, in two log lines."""
    t = cfg.train
    group = world * t.grad_accum
    log.info("training %d optimizer steps on %d process%s x grad_accum %d = %d packed rows of %d tokens a step "
             "(%d tokens); %d epochs of %s packed rows = %s steps (%d samples, %d trained%s; hidden states %s) on %s",
             cap, world, "es" if world > 1 else "", t.grad_accum, group, t.total_seq_len, group * t.total_seq_len,
             t.epochs, "/".join(str(len(b)) for b in epoch_batches), "/".join(map(str, steps_per_epoch)),
             manifest.num_samples, train_samples, f" (train.max_samples {t.max_samples})" if t.max_samples else "",
             manifest.storage_dtype, device)
    log.info("recipe: loss %s, AdamW weight decay %g, betas %s, gradient clipping %s, hidden-state noise %s; "
             "held-out evaluation %s; export %s", family.loss_name, t.weight_decay, tuple(t.adam_betas),
             f"{t.max_grad_norm:g}" if t.max_grad_norm else "off",
             f"uniform +-{t.hidden_noise_std:g}" if t.hidden_noise_std else "off",
             "none (train.eval_fraction 0)" if not held_out else
             f"every {t.eval_every_steps} steps" if t.eval_every_steps else "after each epoch", t.export)


class TrainingLoop:
    """This rank's planned steps from a state on: each step's micro-steps (forward, backward weighted by the rows
    present, DDP's all-reduce once after the last), clipping, the optimizer and schedule, then the step's log line,
    held-out evaluation, checkpoint (``save``) and --max-error-share check (``stop_past_share``); each epoch's end
    record. ``run`` returns the last state and the skipped counts; a ``SourceStopped`` saves the last finished step
    and stops with a StageError naming --resume."""

    def __init__(self, cfg: PipelineConfig, ranks: Ranks, device: torch.device, model, net, params, optimizer,
                 scheduler, family, call_kwargs: dict, source: BatchSource, epoch_batches: list,
                 steps_per_epoch: list[int], plans: dict[int, EpochPlan], cap: int, state: TrainingState,
                 resumed: bool, skipped_before: list[SkippedSample], epoch_samples: int,
                 anchor: InitAnchor | None = None):
        self.cfg, self.ranks, self.device = cfg, ranks, device
        self.dd, self.seed = DataDir(cfg.data_dir), cfg.shared.seed
        self.model, self.net, self.params, self.optimizer, self.scheduler = model, net, params, optimizer, scheduler
        self.family, self.call_kwargs, self.keys, self.source = family, call_kwargs, family.keys, source
        self.epoch_batches, self.steps_per_epoch, self.plans, self.cap = epoch_batches, steps_per_epoch, plans, cap
        self.state = state  # the last finished step's (what a save or a stop records)
        self.anchor = anchor  # train.anchor_to_init's L2-SP pull toward the start (train_anchor.py), or None
        self.world, self.accum = ranks.world, cfg.train.grad_accum
        self.group = self.world * self.accum  # packed rows per optimizer step
        self.dtype = train_dtype(device)
        self.autocast = device.type == "cuda"  # fp32 master weights, bf16 compute (speculators' Trainer does the same)
        self.last_saved: list[TrainingState] = []
        # train.export best: the best evaluation so far (every rank holds it: evaluations are all-reduced), its
        # checkpoint saved when it is made and never pruned
        self.best: list = on_rank0(ranks, lambda: _best_so_far(self.dd))  # [step, acceptance length] or []
        # samples a read check skipped (train_data.SkippedFile): listed in skipped.jsonl, and past --max-error-share
        # of an epoch's samples (trained and held out, the share 02 and the online source take) the run stops
        self.skips = SkippedSamples(self.dd.train_skipped, ranks, device, skipped_before)
        self.epoch_samples = epoch_samples
        self.allowed = errors_allowed(cfg.extract.max_error_share, epoch_samples)
        s, t = cfg.shared, cfg.train
        self.progress = (Progress(cap, unit="steps", every_s=s.progress_every_s, logger=log, initial=state.step,
                                  desc="Training", errors_label="skipped samples", show_zero_errors=False)
                         if ranks.main else None)
        self.metrics_log = (MetricsLog(self.dd.train_metrics, t.report_to, self.dd.train_reports, t.report_project,
                                       Path(cfg.data_dir).resolve().name, cfg.to_dict(),
                                       resumed_step=state.step if resumed else None, step=state.step)
                            if ranks.main else None)
        self.tokens_seen, self.t0 = 0, time.monotonic()  # this rank's tokens; the logged count is summed over ranks
        # every rank's tokens before this run (a resume's checkpoint): metrics.jsonl's "tokens" is cumulative over
        # the whole run, as if it had never stopped (the rate is this run's)
        self.tokens_before = (state.tokens or on_rank0(ranks, lambda: _logged_tokens(self.dd, state.step))
                              if resumed else 0)
        self.waited: dict[str, float] = {}  # time the loop waited for the data loader (train_data.device_batches)
        self.window, self.window_steps = None, 0  # this rank's metric sums since the last log line (the logged
        # figures are their means) and the steps they span (after a resume, the steps since the checkpoint)

    def run(self) -> tuple[TrainingState, dict[str, int]]:
        """Trains every planned epoch (to --max-steps), then saves the end-of-run checkpoint."""
        self.model.train()
        try:
            for epoch in range(self.state.epoch, self.cfg.train.epochs):
                if self.train_epoch(epoch):
                    break
        except SourceStopped as e:
            self.stop_for_source(e)
        finally:
            self.close()
        if self.last_saved != [self.state]:
            self.save(self.state)  # the end-of-run checkpoint (also records that the last epoch's eval is done)
        counts = {"trained": sum(self.skips.trained.values()), "held_out": sum(self.skips.held_out.values())}
        return self.state, counts

    def train_epoch(self, epoch: int) -> bool:
        """This rank's steps of ``epoch`` from the state's on, then the epoch's record; True when --max-steps ended
        the run inside it (no epoch record then)."""
        from .train_data import device_batches

        rows = self.epoch_batches[epoch]
        start = self.state.batches_done if epoch == self.state.epoch else 0
        trained: list[int] = []  # positions of the packed rows this rank trained in this epoch
        not_given = 0  # samples of those rows the reader did not give (skipped, or online: failed)
        batches = device_batches(self.source.epoch(epoch, self.plans[epoch].rows), self.device, self.dtype,
                                 self.waited)
        for step_in_epoch in range(start, self.steps_per_epoch[epoch]):
            present = min(self.group, len(rows) - step_in_epoch * self.group)  # rows in this step, over all ranks
            agree_stop(self.source, self.ranks)
            given, lr_used = self.train_step(batches, epoch, (step_in_epoch - start) * self.accum, present, trained)
            not_given += given
            if self.after_step(epoch, step_in_epoch, lr_used):
                return True
        self.end_epoch(epoch, rows, start, trained, not_given, batches)
        return False

    def train_step(self, batches, epoch: int, first: int, present: int, trained: list[int]) -> tuple[int, float]:
        """One optimizer step over this rank's micro-steps ``first`` .. ``first + grad_accum - 1`` of the epoch's
        plan; appends the positions trained to ``trained``. (samples the reader did not give, learning rate used)."""
        s, t, world = self.cfg.shared, self.cfg.train, self.world
        plan, net, model = self.plans[epoch].plan, self.net, self.model
        not_given = 0
        self.optimizer.zero_grad(set_to_none=True)
        for micro in range(self.accum):
            batch, gpu = next(batches)
            position, real = plan[first + micro]
            if real:
                self.skips.add(batch, epoch, self.state.step + 1)
                not_given += int(batch.get("error_records", 0))
            if t.hidden_noise_std:
                gpu = add_hidden_noise(gpu, t.hidden_noise_std, row_seed(s.seed, epoch, position))
            # the step's gradient is the mean over its rows of each row's gradient: DDP averages over
            # ranks, so each rank scales its rows by world / rows present (0 for a placeholder row)
            weight = world / present if real else 0.0
            last = micro == self.accum - 1  # gradients are all-reduced once a step, after the last micro-step
            with nullcontext() if last or net is model else net.no_sync():
                with self.family.row_rng(epoch, position), \
                        torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    _, loss, metrics = net(**gpu, **self.call_kwargs)
                (loss * weight).backward()
            if real:
                trained.append(position)
                self.tokens_seen += int((batch["document_ids"] != -1).sum())
                self.window = add_metrics(self.window, metrics, self.keys)
        if self.anchor is not None:  # after the all-reduce: every rank adds the same pull
            self.anchor.add_gradient()
        if t.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.params, t.max_grad_norm)
        lr_used = self.optimizer.param_groups[0]["lr"]  # the rate of this update (scheduler.step moves it on)
        self.optimizer.step()
        self.scheduler.step()
        self.source.step_done()
        return not_given, lr_used

    def after_step(self, epoch: int, step_in_epoch: int, lr_used: float) -> bool:
        """The step's bookkeeping: the state moves on; the log line, evaluation and checkpoint due at it; the
        --max-error-share check. True when --max-steps is reached."""
        t, ranks = self.cfg.train, self.ranks
        state = self.state = TrainingState(step=self.state.step + 1, epoch=epoch, batches_done=step_in_epoch + 1,
                                           seed=self.seed)
        self.window_steps += 1
        logged = state.step % t.log_every == 0 or state.step == self.cap
        saving = state.step % t.checkpoint_every == 0
        evaluating = state.step in self.plans[epoch].eval_steps
        if not ranks.distributed or logged or saving:  # under torchrun, a collective: at steps all share
            self.skips.sync()
        if logged:
            self.log_step(epoch, lr_used)
        if evaluating:
            ev = self.evaluate(epoch, state.step)
            if not self.best or ev[ACCEPTANCE_KEY] > self.best[1]:
                self.best[:] = [state.step, ev[ACCEPTANCE_KEY]]
                if t.export == "best":
                    saving = True  # the best evaluation's weights: train.export best exports them
        if self.progress is not None:
            self.progress.errors = sum(self.skips.trained.values()) + sum(self.skips.held_out.values())
            self.progress.update(1)
        if saving:
            self.save(state)
        self.stop_past_share(epoch, state)
        return bool(t.max_steps and state.step >= t.max_steps)

    def log_step(self, epoch: int, lr_used: float) -> None:
        """The means over every row since the last log line, pooled over ranks: metrics.jsonl, trackers, progress."""
        totals, (tokens_all,) = reduce_metrics(self.window, self.keys, self.device, [self.tokens_seen],
                                               self.ranks.distributed)
        row = self.family.summarize(totals)
        rate = tokens_all / max(time.monotonic() - self.t0, 1e-9)
        if self.ranks.main:
            self.metrics_log.write({"kind": "train", "step": self.state.step, "epoch": epoch,
                                    "lr": lr_used, "tokens_per_s": rate,
                                    "tokens": self.tokens_before + int(tokens_all),
                                    "elapsed_s": time.monotonic() - self.t0,
                                    "loader_wait_s": self.waited.get("loader_wait_s", 0.0),
                                    "skipped_samples": sum(self.skips.trained.values()),
                                    "rows": int(totals["loss_total"]), "window_steps": self.window_steps, **row,
                                    **({"anchor_penalty": self.anchor.penalty(), "anchor_distance":
                                        self.anchor.distance()} if self.anchor is not None else {})})
            self.progress.set_fields(**self.family.progress_fields(row), **{"tok/s": f"{rate:.0f}"})
        self.window, self.window_steps = None, 0

    def end_epoch(self, epoch: int, rows: list, start: int, trained: list[int], not_given: int, batches) -> None:
        """The epoch's record (every packed row trained once, over every rank), then the state at the next epoch."""
        ranks, world = self.ranks, self.world
        next(batches, None)  # lets the loader's epoch end (the plan held exactly its batches)
        self.skips.sync()
        per_rank = [(trained, not_given)]
        if ranks.distributed:
            import torch.distributed as dist

            per_rank = [None] * world
            dist.all_gather_object(per_rank, (trained, not_given))
        extra = self.source.epoch_record(epoch)  # every rank: online, it gathers every rank's counts
        if ranks.main:
            record = check_rows_trained([r for r, _ in per_rank], rows, start, self.group, epoch)
            # the samples trained: those packed less those the reader did not give (skipped.jsonl lists the
            # ones a read check skipped; online, online_errors.jsonl the ones never extracted)
            packed = record["samples"]
            record.update(samples=packed - sum(n for _, n in per_rank), packed_samples=packed,
                          skipped_samples=self.skips.listed_this_run[epoch])
            self.metrics_log.write(record)
            if extra is not None:
                self.metrics_log.write(extra)
            log.info("epoch %d: %d packed rows trained (%d samples%s), each once, over %d rank%s (%s rows each); "
                     "the packing's rows from row %d: %d", epoch + 1, record["rows"], record["samples"],
                     f", {packed - record['samples']} not given by the reader" if packed > record["samples"]
                     else "", world, "s" if world > 1 else "", "/".join(map(str, record["rows_per_rank"])),
                     record["from_row"], len(rows) - record["from_row"])
        self.stop_past_share(epoch, self.state)
        self.state = TrainingState(step=self.state.step, epoch=epoch + 1, batches_done=0, seed=self.seed)

    def evaluate(self, epoch: int, step: int) -> dict:
        """The held-out rows evaluated after optimizer step ``step`` (each rank its share, the sums all-reduced):
        its record in metrics.jsonl and the trackers, and curves.png redrawn."""
        from .train_data import device_batches

        ranks, world, family = self.ranks, self.world, self.family

        def held_out(batches):
            for host, on_device in batches:
                self.skips.add(host, epoch, step, held_out=True)
                yield host, on_device

        batches = held_out(device_batches(self.source.evaluation(epoch, step), self.device, self.dtype))
        ev_sums = evaluate_sums(self.model, batches, self.autocast, self.call_kwargs, self.keys, self.device,
                                # this rank's i-th held-out row is row rank + i x world
                                row_rng=lambda i: family.row_rng("eval", ranks.rank + i * world))
        ev = family.summarize(reduce_metrics(ev_sums, self.keys, self.device, (), ranks.distributed)[0])
        self.skips.sync()
        if ranks.main:
            self.metrics_log.write({"kind": "eval", "step": step, "epoch": epoch,
                                    "skipped_samples": self.skips.held_out[epoch], **ev})
            log.info("eval after step %d (epoch %d): %s", step, epoch + 1,
                     ", ".join(f"{k} {v:.4f}" for k, v in ev.items() if not k.endswith("_tokens")))
            family.plot(self.dd.train_metrics, self.dd.train_curves)
        return ev

    def save(self, at: TrainingState) -> None:
        """A checkpoint of ``at`` (rank 0 writes it, after checking the free space), the old ones pruned."""
        dd, t = self.dd, self.cfg.train
        # every rank calls save at the same steps (its conditions are global), so the tokens can be summed here
        _, (tokens_all,) = reduce_metrics(None, [], self.device, [self.tokens_seen], self.ranks.distributed)
        written = dataclasses.replace(at, tokens=self.tokens_before + int(tokens_all))

        def write() -> None:
            folder = dd.checkpoint_step(at.step)
            model_state, opt_state = draft_state(self.model), self.optimizer.state_dict()
            dd.checkpoints.mkdir(parents=True, exist_ok=True)
            check_free_space(dd.checkpoints, _checkpoint_bytes(model_state, opt_state), t.min_free_gb)
            save_train_checkpoint(folder, model_state, opt_state, self.scheduler.state_dict(), written)
            log.info("checkpoint %s", folder)
            protect = frozenset(self.best[:1]) if t.export == "best" else frozenset()
            for gone in prune_checkpoints(dd.checkpoints, t.keep_checkpoints, protect):
                log.info("deleted %s (train.keep_checkpoints %d)", gone, t.keep_checkpoints)

        on_rank0(self.ranks, write)
        self.last_saved[:] = [at]

    def stop_past_share(self, epoch: int, at: TrainingState) -> None:
        """Past the share (global counts, as of the last sync: every rank decides alike): checkpoint ``at``, stop."""
        dd, cfg, epoch_samples, allowed = self.dd, self.cfg, self.epoch_samples, self.allowed
        t = cfg.train
        skipped = self.skips.in_epoch(epoch)
        if skipped <= allowed:
            return
        if self.last_saved != [at]:
            self.save(at)
        again = "the same torchrun command with" if self.ranks.distributed else "04_train.py with the same flags and"
        fix = ("--resume reads them again from files extracted anew" if t.data_source == "online" else
               "or rebuild hidden_states/ (02_extract_hidden_states.py --overwrite) and start over (--overwrite)")
        need = math.ceil(skipped / epoch_samples * 1e4) / 1e4  # the smallest share (4 decimals) that allows them
        while errors_allowed(need, epoch_samples) < skipped:
            need = round(need + 1e-4, 4)
        raise StageError(f"epoch {epoch + 1}: {skipped} of its {epoch_samples} samples skipped as they were read "
                         f"(allowed {allowed}: --max-error-share {cfg.extract.max_error_share:g}); each is listed with "
                         f"its file and reason in {dd.train_skipped}. Checkpoint {dd.checkpoint_step(at.step)} (step "
                         f"{at.step}): to train on without them rerun {again} --resume --max-error-share {need:g}; "
                         f"{fix}")

    def stop_for_source(self, e: SourceStopped) -> None:
        """The source cannot go on: the last finished step (every rank's) is saved and the run stops naming --resume;
        under torchrun, a stop the ranks did not agree on cannot save (the others are mid-step)."""
        dd, ranks, state = self.dd, self.ranks, self.state
        if self.metrics_log is not None:
            self.metrics_log.close()
            self.metrics_log = None
        if ranks.distributed and not e.agreed:  # a save is a collective the other ranks, mid-step, would never
            # join: torchrun ends them
            raise StageError(f"{e}. The newest checkpoint in {dd.checkpoints} is the resume point: rerun the same "
                             "torchrun command with --resume once a server answers") from None
        self.skips.sync()  # every rank stops here (agreed): the samples of the steps kept are listed
        self.save(state)  # the last finished step (every rank's): nothing of the unfinished one was applied
        again = "the same torchrun command with" if ranks.distributed else "04_train.py with the same flags and"
        raise StageError(f"{e}. Checkpoint {dd.checkpoint_step(state.step)} (step {state.step}): rerun {again} "
                         "--resume once a server answers") from None

    def close(self) -> None:
        """The source's threads and servers, the skipped list, metrics.jsonl and the progress line."""
        self.source.close()
        self.skips.close()
        if self.metrics_log is not None:
            self.metrics_log.close()
        if self.progress is not None:
            self.progress.close()


def _best_so_far(dd: DataDir) -> list:
    """[step, simulated acceptance length] of the best evaluation metrics.jsonl holds (as truncated for this run),
    or [] (rank 0 alone)."""
    records = list(read_jsonl(dd.train_metrics)) if dd.train_metrics.exists() else []
    best = best_evaluation(records)
    return [best["step"], best[ACCEPTANCE_KEY]] if best is not None else []


def _skipped_counts(skipped: list[SkippedSample]) -> dict[str, int]:
    held_out = sum(s.held_out for s in skipped)
    return {"trained": len(skipped) - held_out, "held_out": held_out}


def _export_holds(dd: DataDir, step: int, export_format: str) -> bool:
    """checkpoints/final/ holds the export of training step ``step`` in ``export_format`` (its provenance says)."""
    prov = read_provenance(dd.provenance(dd.checkpoints))
    return (dd.final_checkpoint.is_dir() and prov is not None and prov.get("counts", {}).get("steps") == step
            and prov.get("config", {}).get("train", {}).get("export_format") == export_format)


def choose_export(cfg: PipelineConfig, state: TrainingState) -> tuple[int, dict | None]:
    """(step whose weights final/ gets, the eval record it was chosen by or None): train.export last = the end of
    training; best = the evaluation with the highest simulated acceptance length among the steps a checkpoint
    exists for (rank 0 alone)."""
    dd = DataDir(cfg.data_dir)
    if cfg.train.export == "last":
        return state.step, None
    records = list(read_jsonl(dd.train_metrics)) if dd.train_metrics.exists() else []
    saved = {step for step, _ in list_train_checkpoints(dd.checkpoints)}
    best = best_evaluation(records, saved)
    if best is None:
        raise StageError(f"train.export best: no held-out evaluation in {dd.train_metrics} has a checkpoint in "
                         f"{dd.checkpoints} to export (steps saved: {sorted(saved)}); export last, or train with "
                         "held-out rows (train.eval_fraction > 0)")
    overall = best_evaluation(records)
    if overall is not None and overall["step"] != best["step"]:
        log.warning("train.export best: the best evaluation, step %d (%s %.4f), has no checkpoint any more; "
                    "exporting step %d (%.4f), the best one saved", overall["step"], ACCEPTANCE_KEY,
                    overall[ACCEPTANCE_KEY], best["step"], best[ACCEPTANCE_KEY])
    return best["step"], best


def _write_draft(model, base_config, cfg: PipelineConfig, out: Path) -> Path:
    """The draft in its family's export format (EAGLE-3: train.export_format; DFlash: speculators')."""
    return draft_family(cfg, torch.device("cpu")).export(model, out, base_config)


def _export(cfg: PipelineConfig, model, base_config, state: TrainingState, manifest, started: float, world: int,
            skipped: dict[str, int], split: dict[str, int], reuse: bool = False) -> Path:
    """Export checkpoints/final/ (train.export: the last step's weights, or the best evaluation's checkpoint),
    curves and provenance (rank 0 alone; ``split``: its train_samples and held_out_samples counts). ``reuse``: a
    final/ that already holds this export is kept as it is."""
    dd, s, t = DataDir(cfg.data_dir), cfg.shared, cfg.train
    step, chosen = choose_export(cfg, state)
    if reuse and _export_holds(dd, step, t.export_format):
        log.info("train: %s already holds the export of step %d (%s)", dd.final_checkpoint, step, t.export_format)
        return dd.final_checkpoint
    model.to("cpu")
    if step != state.step:  # train.export best: that checkpoint's weights (the run's own draft, so its keys)
        model.load_state_dict(load_train_checkpoint(dd.checkpoint_step(step))[0], strict=False)
        log.info("train.export best: step %d (%s %.4f on the held-out rows), not the last step %d", step,
                 ACCEPTANCE_KEY, chosen[ACCEPTANCE_KEY], state.step)
    out = _write_draft(model, base_config, cfg, dd.final_checkpoint)
    draft_family(cfg, torch.device("cpu")).plot(dd.train_metrics, dd.train_curves)
    write_provenance(dd.provenance(dd.checkpoints), stage="train",
                     config_hash=cfg.section_hash("shared", "train"), config=cfg.to_dict(),
                     inputs=[str(dd.hidden_states), str(dd.vocab), s.verifier, t.finetune_from],
                     counts={"steps": step, "trained_steps": state.step, "epochs_done": state.epoch,
                             "samples": manifest.num_samples, **split, "max_samples": t.max_samples,
                             "world_size": world, "grad_accum": t.grad_accum,
                             "rows_per_step": world * t.grad_accum, "skipped_samples": skipped["trained"],
                             "skipped_held_out": skipped["held_out"], "export": t.export,
                             **({ACCEPTANCE_KEY: chosen[ACCEPTANCE_KEY]} if chosen else {})},
                     started=started)
    log.info("train: exported %s (%s) of step %d after %d steps; curves %s; %.0fs", out, t.export_format, step,
             state.step, dd.train_curves, time.time() - started)
    return out


def resolve_export_from(cfg: PipelineConfig) -> tuple[int, Path]:
    """(step, folder) of --export-from: step_N (in checkpoints/) or a checkpoint folder; refuses anything else
    naming the checkpoints there are."""
    dd, spec = DataDir(cfg.data_dir), cfg.train.export_from
    folder = dd.checkpoints / spec if "/" not in spec and spec.startswith("step_") else Path(spec)
    done = list_train_checkpoints(folder.parent)
    found = [step for step, p in done if p.resolve() == folder.resolve()]
    if not found:
        have = ", ".join(p.name for _, p in list_train_checkpoints(dd.checkpoints)) or "none"
        raise StageError(f"--export-from {spec}: {folder} is not a finished checkpoint (checkpoints in "
                         f"{dd.checkpoints}: {have})")
    return found[0], folder


def export_checkpoint(cfg: PipelineConfig) -> Path:
    """--export-from step_N: that checkpoint's draft exported (train.export_format) into checkpoints/export_step_N/
    (or --export-to), with its own provenance.json, atomically (written under a temporary name, then renamed), on
    CPU. It reads the checkpoint and writes only its own folder, so a training that is running goes on undisturbed
    (its lock is 04_train's; this one's is 04_export's). The draft's shape must be the run's (run.json)."""
    import json

    started = time.time()
    dd, t = DataDir(cfg.data_dir), cfg.train
    step, folder = resolve_export_from(cfg)
    if dd.train_run.exists():
        then = json.loads(dd.train_run.read_text())["settings"]
        now = run_settings(cfg, None, 1)
        changed = [f"{k}: {then[k]!r} then, {now[k]!r} now" for k in DRAFT_SHAPE_KEYS if k in then and then[k] != now[k]]
        if changed:
            raise StageError(f"--export-from {t.export_from}: the run in {dd.checkpoints} trained another draft "
                             f"({'; '.join(changed)}): pass the config it was trained with")
    try:
        model_state = load_train_checkpoint(folder)[0]  # read at once: a pruning by the running training after
        # this line no longer matters
    except (FileNotFoundError, FormatError) as e:
        raise StageError(f"--export-from {t.export_from}: {folder} could not be read ({e}); the running training "
                         "may have pruned it (train.keep_checkpoints): pick a newer step") from None
    model, base_config = build_model(cfg, torch.device("cpu"))
    if set(model_state) != set(draft_state(model)):
        raise StageError(f"--export-from {t.export_from}: {folder} holds other tensors than this config's draft")
    model.load_state_dict(model_state, strict=False)
    out = Path(t.export_to) if t.export_to else dd.train_export(step)
    tmp = out.with_name(f".{out.name}.export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _write_draft(model, base_config, cfg, tmp)
    write_provenance(dd.provenance(tmp), stage="train", config_hash=cfg.section_hash("shared", "train"),
                     config=cfg.to_dict(), inputs=[str(folder), str(dd.vocab), cfg.shared.verifier, t.finetune_from],
                     counts={"steps": step, "export": f"export_from {t.export_from}",
                             "rows_per_step": _rows_per_step(dd)}, started=started)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    log.info("train: exported %s of %s (%s, step %d); serve it: 05_evaluate.py --draft %s", out, folder,
             t.export_format, step, out)
    return out


def _rows_per_step(dd: DataDir) -> int | None:
    """Rows per optimizer step of the run in checkpoints/ (run.json), None when it has no record."""
    import json

    if not dd.train_run.exists():
        return None
    return json.loads(dd.train_run.read_text())["settings"].get(ROWS_PER_STEP)
