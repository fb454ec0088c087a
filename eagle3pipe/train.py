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
"""

from __future__ import annotations

import hashlib
import logging
import math
import shutil
import time
from pathlib import Path

import torch

from .cli import StageError
from .config import PipelineConfig
from .progress import Progress
from .records import (
    DataDir,
    JsonlAppender,
    TrainingState,
    list_train_checkpoints,
    load_hs_manifest,
    load_train_checkpoint,
    load_vocab_mapping,
    load_vocab_summary,
    read_jsonl,
    save_train_checkpoint,
    write_jsonl_atomic,
    write_provenance,
)
from .train_metrics import evaluate, plot_curves, step_metrics

log = logging.getLogger(__name__)

LOSS_NAME = "kl_div"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise StageError(f"--device {name}: no CUDA device here (use --device cpu)")
    return device


def resolve_attn_impl(name: str, device: torch.device) -> str:
    if name == "auto":
        return "simple_flex_attention" if device.type == "cuda" else "sdpa"
    if name == "simple_flex_attention" and device.type == "cpu":
        raise StageError("--attn-impl simple_flex_attention: flex-attention backward does not run on CPU; use sdpa")
    return name


# ---------------------------------------------------------------------------------------------------------------
# Model


def _check_aux_ids(ckpt_ids: list[int], ours: list[int], folder: str) -> None:
    """A warm-start checkpoint must read the same verifier states as our data holds."""
    if list(ckpt_ids) == list(ours):
        return
    if [k + 1 for k in ckpt_ids] == list(ours):
        log.warning("%s names its aux layers %s: the 'output of layer k' convention for the states our data holds "
                    "(%s, vLLM's 'entering layer k'); the export writes %s", folder, ckpt_ids, ours, ours)
        return
    raise StageError(f"{folder}: trained on aux layers {ckpt_ids}, our hidden states hold {ours} "
                     "(--aux-layer-ids, stage 02): the draft would read different verifier states")


def build_model(cfg: PipelineConfig, device: torch.device):
    """(model, base_config for the export) from vocab/ and either --finetune-from or a fresh layer config."""
    from . import draft

    dd = DataDir(cfg.data_dir)
    s, t = cfg.shared, cfg.train
    summary = load_vocab_summary(dd.vocab_summary)
    d2t, t2d = load_vocab_mapping(dd.vocab_mapping, s.vocab_size, s.draft_vocab_size)
    attn_impl = resolve_attn_impl(t.attn_impl, device)
    torch.manual_seed(s.seed)  # a fresh draft's initial weights
    if not t.finetune_from:
        layer_config = draft.fresh_layer_config(s.verifier, t.draft_num_heads, t.draft_head_dim,
                                                t.draft_intermediate_size, s.trust_remote_code)
        model = draft.build_draft_model(layer_config, verifier=s.verifier, aux_layer_ids=s.aux_layer_ids, d2t=d2t,
                                        t2d=t2d, ttt_steps=t.ttt_steps, attn_impl=attn_impl)
        log.info("new draft: %d heads x %d, MLP %d, draft vocab %d (vocab/ source: %s)",
                 layer_config.num_attention_heads, layer_config.head_dim, layer_config.intermediate_size,
                 d2t.shape[0], summary.source)
        return model, None
    if summary.source == "data":
        raise StageError(f"{dd.vocab} was built from our data without the warm-start checkpoint: rerun "
                         f"03_build_vocab_mapping.py --finetune-from {t.finetune_from} (keeps its map, the default) "
                         "or add --rebuild (replaces it; its lm_head rows are then remapped)")
    if Path(summary.checkpoint).resolve() != Path(t.finetune_from).resolve():
        raise StageError(f"{dd.vocab} was built for checkpoint {summary.checkpoint}, --finetune-from is "
                         f"{t.finetune_from}: rerun 03_build_vocab_mapping.py")
    try:
        model, ckpt, info = draft.load_finetune_draft(t.finetune_from, verifier=s.verifier, d2t=d2t, t2d=t2d,
                                                      aux_layer_ids=s.aux_layer_ids, ttt_steps=t.ttt_steps,
                                                      attn_impl=attn_impl)
    except draft.DraftFormatError as e:
        raise StageError(str(e)) from None
    ckpt_ids = ckpt.aux_layer_ids
    if not ckpt_ids:
        num_layers = draft.verifier_text_config(s.verifier, s.trust_remote_code).num_hidden_layers
        ckpt_ids = draft.default_aux_layer_ids(num_layers)
        log.warning("%s names no aux layer ids: vLLM and SGLang then capture their default (2, L/2, L-3), for this "
                    "%d-layer verifier %s; taking those as the layers it was trained on", t.finetune_from, num_layers,
                    ckpt_ids)
    _check_aux_ids(ckpt_ids, s.aux_layer_ids, t.finetune_from)
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
# Data


class EpochBatches:
    """A batch sampler whose batch list is set per epoch (with a start offset for resume), so one DataLoader and
    its persistent workers serve every epoch."""

    def __init__(self):
        self.batches: list = []

    def set(self, batches: list, start: int = 0) -> None:
        self.batches = list(batches[start:])

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _datasets_without_video() -> None:
    """Shim: datasets 4.4's torch formatter imports ``torchvision.io.VideoReader`` for every row once torchvision
    is imported, and torchvision >= 0.26 (the H200 image here) no longer has it, so every read of hidden_states/
    fails. Our rows hold no video; tell datasets torchvision is absent."""
    import datasets.config

    datasets.config.TORCHVISION_AVAILABLE = False


def _worker_init(worker_id: int) -> None:  # noqa: ARG001
    _datasets_without_video()
    torch.set_num_threads(1)  # workers only read and copy; intra-op threads would oversubscribe the cores


def build_data(cfg: PipelineConfig, device: torch.device):
    """(train_dataset, val_dataset or None, make_loader) over <data_dir>/hidden_states with speculators' reader."""
    from speculators.train.data import ArrowDataset

    _datasets_without_video()
    dd = DataDir(cfg.data_dir)
    t = cfg.train
    manifest = load_hs_manifest(dd.hs_manifest)
    if manifest is None:
        raise StageError(f"{dd.hs_manifest} not found: stage 02 has not finished (run 02_extract_hidden_states.py)")
    check_states_match(manifest, cfg)
    dtype = train_dtype(device)
    if manifest.storage_dtype == "fp8":  # e4m3 + scales through the loader, dequantised on the device
        from .train_data import Fp8KeptTransfer, Fp8ScaledDataset

        transfer, dataset_class, stored = Fp8KeptTransfer(dd.hs_files, manifest), Fp8ScaledDataset, torch.float8_e4m3fn
    else:
        from .train_data import CheckedFileTransfer  # each file's layer ids checked against the manifest

        transfer, dataset_class, stored = CheckedFileTransfer(dd.hs_files, manifest), ArrowDataset, dtype
    n = manifest.num_samples
    train_ratio = 1.0 - t.eval_fraction
    has_val = t.eval_fraction > 0 and int(n * train_ratio) < n and int(n * train_ratio) > 0
    if t.eval_fraction > 0 and not has_val:
        log.warning("%d samples: too few to hold out %.1f%% for evaluation; training on all", n, 100 * t.eval_fraction)

    def dataset(split: str):
        return dataset_class(max_len=t.total_seq_len, datapath=str(dd.hidden_states), transfer=transfer,
                             on_missing="raise", train_ratio=train_ratio if has_val else 1.0, split=split,
                             hidden_states_dtype=stored)

    train_ds, val_ds = dataset("train"), (dataset("val") if has_val else None)
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


def check_lengths_fit(lengths: list[int], cfg: PipelineConfig) -> None:
    """Refuse samples longer than a packed row: speculators 0.9's sampler clips such a sample's length to
    ``total_seq_len`` and its collate copies only the first ``total_seq_len`` tokens, so the rest (extracted and
    stored) would never be trained, without an error."""
    limit = cfg.train.total_seq_len
    long = [n for n in lengths if n > limit]
    if long:
        raise StageError(f"{len(long)} of {len(lengths)} samples in {DataDir(cfg.data_dir).hidden_states} are longer "
                         f"than train.total_seq_len {limit} (longest {max(long)}): training would cut them and never "
                         f"see {sum(long) - limit * len(long)} of their tokens. Raise --total-seq-len to at least "
                         f"{max(long)}, or rebuild the rows with shared.max_seq_len <= {limit}")


def train_dtype(device: torch.device) -> torch.dtype:
    """dtype of the hidden states the draft reads: bf16 under CUDA autocast, fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def make_loader(dataset, sampler: EpochBatches, cfg: PipelineConfig, device: torch.device):
    from speculators.train.data import CollateFn
    from torch.utils.data import DataLoader

    from .train_data import shift_batch_with_scales

    workers = cfg.train.num_workers
    # hidden states are collated in the dtype stored (fp8 stays e4m3 until train_data.to_device on the device)
    collate = CollateFn(cfg.train.total_seq_len, cfg.shared.hidden_size, num_target_layers=3,
                        dtype=dataset.hidden_states_dtype, preprocess=shift_batch_with_scales)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=workers,
                      pin_memory=device.type == "cuda", prefetch_factor=4 if workers else None,
                      persistent_workers=workers > 0, multiprocessing_context="spawn" if workers else None,
                      worker_init_fn=_worker_init if workers else None)


def packed_batches(dataset, total_seq_len: int, seed: int, epoch: int) -> list:
    """speculators' packing of whole samples into rows of ``total_seq_len`` tokens, shuffled by seed + epoch."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=dataset.approx_lengths,
                                                 num_replicas=1, rank=0, seed=seed)
    return [b.tolist() for b in sampler._generate_batches(epoch)]  # noqa: SLF001 (its public iterator hides epoch)


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
    """The checkpoint to resume from, or None; refuses to silently overwrite an earlier run."""
    dd = DataDir(cfg.data_dir)
    existing = list_train_checkpoints(dd.checkpoints)
    if cfg.train.resume:
        if not existing:
            log.warning("--resume: no checkpoint in %s, starting from scratch", dd.checkpoints)
            return None
        return existing[-1]
    if existing or dd.final_checkpoint.exists():
        if not cfg.train.overwrite:
            raise StageError(f"{dd.checkpoints} holds an earlier run: --resume to continue it, --overwrite to start "
                             "over (deletes its checkpoints)")
        for _, path in existing:
            shutil.rmtree(path)
        shutil.rmtree(dd.final_checkpoint, ignore_errors=True)
        for p in (dd.train_metrics, dd.train_curves):
            p.unlink(missing_ok=True)
    return None


def _check_resume_identity(cfg: PipelineConfig, resume_from: tuple[int, Path] | None, manifest) -> None:
    """--resume continues the same draft on the same data only. A fresh start records both in checkpoints/run.json;
    a resume with another architecture (or warm start) or other hidden states / vocabulary is refused by name."""
    import hashlib
    import json

    from .records import atomic_write_json

    dd = DataDir(cfg.data_dir)
    s, t = cfg.shared, cfg.train
    now = {
        "shared.verifier": str(Path(s.verifier).resolve()), "shared.aux_layer_ids": list(s.aux_layer_ids),
        "shared.hidden_size": s.hidden_size, "shared.vocab_size": s.vocab_size,
        "shared.draft_vocab_size": s.draft_vocab_size,
        "train.finetune_from": str(Path(t.finetune_from).resolve()) if t.finetune_from else "",
        "train.draft_num_heads": t.draft_num_heads, "train.draft_head_dim": t.draft_head_dim,
        "train.draft_intermediate_size": t.draft_intermediate_size,
        "hidden_states (stage 02)": [manifest.config_hash, manifest.num_samples, manifest.num_tokens],
        "vocab (stage 03)": hashlib.sha256(dd.vocab_mapping.read_bytes()).hexdigest()[:16],
    }
    before = json.loads(dd.train_run.read_text())["settings"] if dd.train_run.exists() else None
    if resume_from is not None and before is None:
        log.warning("--resume: %s has no record of the run's settings (%s): cannot check them", dd.checkpoints,
                    dd.train_run.name)
    elif resume_from is not None:
        changed = [f"{k}: {before.get(k)!r} then, {v!r} now" for k, v in now.items() if before.get(k, v) != v]
        if changed:
            raise StageError(f"--resume: {resume_from[1]} belongs to a run with another draft or data ("
                             f"{'; '.join(changed)}): restore those settings / inputs to resume it, or pass "
                             "--overwrite instead of --resume to start over (deletes its checkpoints)")
        return
    atomic_write_json(dd.train_run, {"settings": now})


def _truncate_metrics(path: Path, state: TrainingState) -> None:
    """Drop metric lines written after the checkpoint we resume from, so the log reads as one run."""
    if not path.exists():
        return
    from .records import repair_jsonl

    repair_jsonl(path)
    keep = [r for r in read_jsonl(path)
            if (r["kind"] == "train" and r["step"] <= state.step) or (r["kind"] == "eval" and r["epoch"] < state.epoch)]
    write_jsonl_atomic(path, keep)


def run_train(cfg: PipelineConfig) -> Path:
    """Train (or resume), checkpoint, evaluate per epoch, export checkpoints/final/. Returns the export folder."""
    if resolve_device(cfg.train.device).type == "cpu" and cfg.train.cpu_threads:
        # a toy draft's ops are small: with several threads each op waits for the slowest thread's time slice, and
        # on a shared 2-core machine a step took 4-6x longer than with one thread (README, demo)
        before = torch.get_num_threads()
        torch.set_num_threads(cfg.train.cpu_threads)
        try:
            return _run_train(cfg)
        finally:
            torch.set_num_threads(before)
    return _run_train(cfg)


def _run_train(cfg: PipelineConfig) -> Path:
    from speculators.losses import resolve_loss_config
    from speculators.train.recovery import RECOVERY_METADATA_KEY

    from . import draft
    from .train_data import device_batches

    started = time.time()
    dd = DataDir(cfg.data_dir)
    s, t = cfg.shared, cfg.train
    device = resolve_device(t.device)
    dtype = train_dtype(device)
    train_ds, val_ds, manifest = build_data(cfg, device)  # its checks refuse before any checkpoint is touched
    resume_from = _prepare_checkpoints(cfg)
    _check_resume_identity(cfg, resume_from, manifest)
    model, base_config = build_model(cfg, device)
    set_lm_head_training(model, cfg)
    model.to(device)
    autocast = device.type == "cuda"  # fp32 master weights, bf16 compute (speculators' Trainer does the same)

    epoch_batches = [packed_batches(train_ds, t.total_seq_len, s.seed, e) for e in range(t.epochs)]
    total_steps = sum(len(b) for b in epoch_batches)
    if total_steps == 0:
        raise StageError(f"{dd.hidden_states}: no training batch (no samples?)")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=0.01)
    scheduler = warmup_cosine_schedule(optimizer, math.ceil(t.warmup_ratio * total_steps), total_steps)
    state = TrainingState(step=0, epoch=0, batches_done=0, seed=s.seed)
    if resume_from is not None:
        model_state, opt_state, sched_state, state = load_train_checkpoint(resume_from[1])
        own = draft_state(model)
        if set(model_state) != set(own):
            raise StageError(f"{resume_from[1]}: checkpoint keys differ from this draft's (config changed?)")
        model.load_state_dict(model_state, strict=False)
        optimizer.load_state_dict(opt_state)
        scheduler.load_state_dict(sched_state)
        _truncate_metrics(dd.train_metrics, state)
        log.info("resuming from %s: step %d, epoch %d, batch %d", resume_from[1], state.step, state.epoch,
                 state.batches_done)

    loss_config = resolve_loss_config(LOSS_NAME, "eager")
    call_kwargs = {"ttt_steps": t.ttt_steps, "ttt_step_loss_decay": 1.0, "loss_config": loss_config}
    train_sampler, val_sampler = EpochBatches(), EpochBatches()
    train_loader = make_loader(train_ds, train_sampler, cfg, device)
    val_loader = None
    if val_ds is not None:
        val_sampler.set(packed_batches(val_ds, t.total_seq_len, s.seed, 0))
        val_loader = make_loader(val_ds, val_sampler, cfg, device)
    cap = min(total_steps, t.max_steps) if t.max_steps else total_steps
    log.info("training %d optimizer steps (%d epochs x ~%d packed rows of %d tokens, %d samples, hidden states %s) "
             "on %s", cap, t.epochs, total_steps // t.epochs, t.total_seq_len, manifest.num_samples,
             manifest.storage_dtype, device)

    def save(at: TrainingState) -> None:
        save_train_checkpoint(dd.checkpoint_step(at.step), draft_state(model), optimizer.state_dict(),
                              scheduler.state_dict(), at)
        log.info("checkpoint %s", dd.checkpoint_step(at.step))

    progress = Progress(cap, unit="steps", every_s=s.progress_every_s, logger=log, initial=state.step, desc="Training")
    metrics_log = JsonlAppender(dd.train_metrics, fsync_every=16)
    model.train()
    tokens_seen, t0 = 0, time.monotonic()
    waited: dict[str, float] = {}  # time the loop waited for the data loader (train_data.device_batches)
    stopped = False
    try:
        for epoch in range(state.epoch, t.epochs):
            start = state.batches_done if epoch == state.epoch else 0
            train_sampler.set(epoch_batches[epoch], start)
            done_in_epoch = start
            for batch, gpu in device_batches(train_loader, device, dtype, waited):
                tokens = int((batch["document_ids"] != -1).sum())
                if batch.get("error_records"):  # speculators' reader skipped samples (token ids differ from the row)
                    log.warning("epoch %d batch %d: %d samples skipped: %s", epoch, done_in_epoch + 1,
                                batch["error_records"], batch.get(RECOVERY_METADATA_KEY, ""))
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    _, loss, metrics = model(**gpu, **call_kwargs)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                lr_used = optimizer.param_groups[0]["lr"]  # the rate of this update (scheduler.step moves it on)
                optimizer.step()
                scheduler.step()
                done_in_epoch += 1
                state = TrainingState(step=state.step + 1, epoch=epoch, batches_done=done_in_epoch, seed=s.seed)
                tokens_seen += tokens
                if state.step % t.log_every == 0 or state.step == cap:
                    row = step_metrics(metrics, t.ttt_steps)
                    rate = tokens_seen / max(time.monotonic() - t0, 1e-9)
                    metrics_log.write({"kind": "train", "step": state.step, "epoch": epoch,
                                       "lr": lr_used, "tokens_per_s": rate,
                                       "tokens": tokens_seen, "elapsed_s": time.monotonic() - t0,
                                       "loader_wait_s": waited.get("loader_wait_s", 0.0),
                                       "skipped_samples": int(batch.get("error_records", 0)), **row})
                    progress.set_fields(loss=f"{row['loss']:.3f}", **{
                        f"acc@{i}": f"{row[f'acc_{i}']:.3f}" for i in range(1, t.ttt_steps + 1)},
                        **{"tok/s": f"{rate:.0f}"})
                progress.update(1)
                if state.step % t.checkpoint_every == 0:
                    save(state)
                if t.max_steps and state.step >= t.max_steps:
                    stopped = True
                    break
            if stopped:
                break
            if val_loader is not None:
                ev = evaluate(model, device_batches(val_loader, device, dtype), device, autocast, call_kwargs,
                              t.ttt_steps)
                metrics_log.write({"kind": "eval", "step": state.step, "epoch": epoch, **ev})
                log.info("eval after epoch %d: %s", epoch + 1, ", ".join(f"{k} {v:.4f}" for k, v in ev.items()))
            state = TrainingState(step=state.step, epoch=epoch + 1, batches_done=0, seed=s.seed)
    finally:
        metrics_log.close()
        progress.close()
    save(state)  # the end-of-run checkpoint (also records that the last epoch's eval is done)

    model.to("cpu")
    if t.export_format == "speculators":
        out = draft.export_speculators(model, dd.final_checkpoint)
    else:
        out = draft.export_flat(model, dd.final_checkpoint, s.aux_layer_ids, base_config)
    plot_curves(dd.train_metrics, dd.train_curves, t.ttt_steps)
    write_provenance(dd.provenance(dd.checkpoints), stage="train", config_hash=cfg.section_hash("shared", "train"),
                     config=cfg.to_dict(), inputs=[str(dd.hidden_states), str(dd.vocab), s.verifier, t.finetune_from],
                     counts={"steps": state.step, "epochs_done": state.epoch, "samples": manifest.num_samples},
                     started=started)
    log.info("train: exported %s (%s) after %d steps; curves %s; %.0fs", out, t.export_format, state.step,
             dd.train_curves, time.time() - started)
    return out
