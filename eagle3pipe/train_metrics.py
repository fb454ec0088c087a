"""Stage 04's metrics: per-TTT-step loss and accuracy from speculators' metric sums (means over the steps since the
last log line), the simulated acceptance length, held-out evaluation, curves, the trackers of ``train.report_to``
(``MetricsLog``: metrics.jsonl and tensorboard / wandb, every record to each), and the samples the reader skipped
(``SkippedSamples``)."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch

from .records import JsonlAppender, read_jsonl
from .records_checkpoints import SkippedSample

log = logging.getLogger(__name__)


def metric_keys(ttt_steps: int) -> list[str]:
    """speculators' metric sums that our loss and acc@k are made of, in a fixed order (one all-reduce a log step)."""
    keys = ["loss_sum", "loss_total"]
    for i in range(ttt_steps):
        keys += [f"loss_{i}_sum", f"full_acc_{i}_sum", f"full_acc_{i}_total"]
    return keys


def add_metrics(sums: dict | None, metrics: dict, keys: list[str]) -> dict:
    """``sums`` plus one packed row's metrics (tensors, added where they are: no device sync)."""
    if sums is None:
        return {k: metrics[k].detach().float().reshape(()) for k in keys}
    return {k: sums[k] + metrics[k].detach().float().reshape(()) for k in keys}


def reduce_metrics(sums: dict | None, keys: list[str], device: torch.device, extra: list[float] = (),
                   distributed: bool = False) -> tuple[dict[str, float], list[float]]:
    """Sum ``sums`` (None: this rank trained no row) and ``extra`` over every rank with one all-reduce, in float64:
    counts such as the tokens seen stay exact to 2**53 (float32 rounds 3e9 tokens to a multiple of 256)."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    vector = torch.stack([sums[k].double() if sums is not None else zero for k in keys]
                         + [torch.tensor(x, dtype=torch.float64, device=device) for x in extra])
    if distributed:
        import torch.distributed as dist

        dist.all_reduce(vector)
    values = vector.tolist()
    return dict(zip(keys, values[:len(keys)])), values[len(keys):]


ACCEPTANCE_KEY = "simulated_acceptance_length"  # the metric train.export best chooses by, in eval records


def simulated_acceptance_length(per_position: list[float], kind: str) -> float:
    """The acceptance length a draft with these per-position accuracies would reach in vLLM at k = len(per_position)
    draft tokens: 1 (the verifier's bonus token, as vLLM's and SGLang's acceptance length and the model cards count
    it) + the expected number of draft tokens accepted in a row. ``kind`` says what ``per_position[i]`` is:

    - "cumulative": P(draft tokens 1..i+1 all right), speculators' EAGLE-3 ``full_acc_i`` (our acc@k): the expected
      run is their sum;
    - "conditional": P(token i+1 right | tokens 1..i right), SpecForge's and TorchSpec's per-position accuracy: the
      expected run is sum_k prod_{i<=k} p_i, their ``simulated_acc_len`` (which leaves out the bonus token, so
      theirs is this minus 1).
    """
    if kind == "cumulative":
        return 1.0 + sum(per_position)
    if kind == "conditional":
        run, total = 1.0, 1.0
        for p in per_position:
            run *= p
            total += run
        return total
    raise ValueError(f"unknown per-position accuracy kind {kind!r} (cumulative, conditional)")


def summarize(sums: dict[str, float], ttt_steps: int) -> dict[str, float]:
    """{"loss", "loss_1".., "acc_1".., "acc_1_tokens".., simulated acceptance length} over the rows summed (one
    step's, or every step's since the last log line: the sums simply run on): losses are the mean over rows (each
    packed row's loss counts once, as speculators weights it), acc@k the share of all supervised tokens right (all
    earlier steps included) and acc_k_tokens how many tokens that share is of."""
    rows = sums["loss_total"]
    out = {"loss": sums["loss_sum"] / rows if rows else 0.0}
    for i in range(ttt_steps):
        out[f"loss_{i + 1}"] = sums[f"loss_{i}_sum"] / rows if rows else 0.0
        total = sums[f"full_acc_{i}_total"]
        out[f"acc_{i + 1}"] = sums[f"full_acc_{i}_sum"] / total if total else 0.0
        out[f"acc_{i + 1}_tokens"] = int(total)
    out[ACCEPTANCE_KEY] = simulated_acceptance_length([out[f"acc_{i + 1}"] for i in range(ttt_steps)], "cumulative")
    return out


def best_evaluation(records: list[dict], steps: set[int] | None = None) -> dict | None:
    """The eval record with the highest simulated acceptance length (the earliest of equals), among those at
    ``steps`` when given (the steps a checkpoint exists for); None when there is none."""
    evals = [r for r in records if r.get("kind") == "eval" and ACCEPTANCE_KEY in r
             and (steps is None or r["step"] in steps)]
    return max(evals, key=lambda r: (r[ACCEPTANCE_KEY], -r["step"]), default=None)


@torch.no_grad()
def evaluate_sums(model, batches_on_device, autocast: bool, call_kwargs: dict, keys: list[str],
                  device: torch.device, row_rng=None) -> dict | None:
    """Metric sums over ``batches_on_device`` ((host batch, device batch) pairs: this rank's share of the held-out
    rows); None when it holds none. ``summarize(reduce_metrics(...))`` turns them into the mean over all ranks.
    ``row_rng(i)``: the RNG context the i-th row's forward runs under (DFlash's anchors; None: as it is)."""
    from contextlib import nullcontext

    model.eval()
    sums = None
    for i, (_, gpu) in enumerate(batches_on_device):
        with row_rng(i) if row_rng is not None else nullcontext(), \
                torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            _, _, metrics = model(**gpu, **call_kwargs)
        sums = add_metrics(sums, metrics, keys)
    model.train()
    return sums


def plot_curves(metrics_path: Path, out_png: Path, ttt_steps: int, loss_name: str = "kl_div") -> None:
    """Per-TTT-step loss and accuracy against the step, and the simulated acceptance length: train (lines) and
    eval (markers). Redrawn at every evaluation (atomically: a viewer never sees half a file)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(read_jsonl(metrics_path)) if metrics_path.exists() else []
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for kind, style in (("train", "-"), ("eval", "o--")):
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            continue
        steps = [r["step"] for r in sel]
        for i in range(1, ttt_steps + 1):
            axes[0].plot(steps, [r[f"loss_{i}"] for r in sel], style, label=f"{kind} step {i}")
            axes[1].plot(steps, [r[f"acc_{i}"] for r in sel], style, label=f"{kind} acc@{i}")
        with_length = [r for r in sel if ACCEPTANCE_KEY in r]
        if with_length:
            axes[2].plot([r["step"] for r in with_length], [r[ACCEPTANCE_KEY] for r in with_length], style,
                         label=kind)
    axes[0].set(xlabel="optimizer step", ylabel=f"{loss_name} loss", title="loss per TTT step")
    axes[1].set(xlabel="optimizer step", ylabel="accuracy", title="accuracy per TTT step", ylim=(0, 1))
    axes[2].set(xlabel="optimizer step", ylabel="1 + expected accepted tokens",
                title=f"simulated acceptance length (k = {ttt_steps})", ylim=(1, ttt_steps + 1))
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = out_png.with_name(f".{out_png.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out_png)


def tracker_scalars(record: dict) -> dict[str, float]:
    """Every number of a metrics.jsonl record as a tracker tag: "<kind>/<key>" (a list: "<kind>/<key>/<i>");
    its step goes as the tracker's step, not as a value."""
    kind, out = record.get("kind", "train"), {}
    for key, value in record.items():
        if key in ("kind", "step"):
            continue
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, v in items:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"{kind}/{key}" + (f"/{i}" if i is not None else "")] = v
    return out


class TensorboardTracker:
    """torch's SummaryWriter into checkpoints/reports/tensorboard/. On a resume it purges the events after the
    checkpoint's step (tensorboard's purge_step), as metrics.jsonl drops its lines after it."""

    def __init__(self, folder: Path, resumed_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder), purge_step=None if resumed_step is None else resumed_step + 1)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()  # a log line every train.log_every steps: cheap, and tensorboard sees it at once

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """One wandb run per training run (its id kept in checkpoints/reports/wandb_run_id, so a --resume continues it),
    the optimizer step as its x-axis (``optimizer_step``). WANDB_MODE=offline keeps it on disk (wandb sync uploads
    it later); console capture is off: our log file already holds the output."""

    def __init__(self, folder: Path, project: str, name: str, config: dict, resumed_step: int | None):
        import wandb

        id_file = folder / "wandb_run_id"
        run_id = id_file.read_text().strip() if resumed_step is not None and id_file.is_file() else None
        if run_id is None:
            import uuid

            from .records import atomic_write_bytes

            run_id = uuid.uuid4().hex[:12]  # wandb ids: letters and digits

            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(id_file, run_id.encode())
        try:
            self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(folder),
                                  config=config, settings=wandb.Settings(console="off", silent=True))
        except Exception as e:  # wandb's own errors (no API key, no network) are many types; one line names it
            from .cli import StageError

            raise StageError(f"train.report_to wandb: wandb.init failed ({type(e).__name__}: {e}); log in with "
                             "`wandb login`, or set WANDB_MODE=offline to keep the run on disk") from None
        self.run.define_metric("optimizer_step")
        self.run.define_metric("*", step_metric="optimizer_step")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log({**scalars, "optimizer_step": step})

    def close(self) -> None:
        self.run.finish()


TRACKER_LIBRARIES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # tracker: the library it needs


def check_trackers(report_to: list[str]) -> None:
    """Before any training: each tracker's library imports, else one error naming it and the pin to install."""
    import importlib

    from .cli import StageError

    for name in report_to:
        try:
            importlib.import_module(TRACKER_LIBRARIES[name])
        except ImportError as e:
            raise StageError(f"train.report_to {name}: the {TRACKER_LIBRARIES[name]} library is not installed ({e}): "
                             f"pip install the version pinned in requirements.txt, or drop {name} from "
                             "train.report_to") from None


class MetricsLog:
    """checkpoints/metrics.jsonl and every tracker of ``train.report_to``: each record goes to the file (appended,
    flushed) and, as ``tracker_scalars``, to each tracker at its optimizer step (a record without one, such as an
    epoch's rows record, at the step of the record before it). Rank 0 alone."""

    def __init__(self, path: Path, report_to: list[str], reports: Path, project: str, run_name: str, config: dict,
                 resumed_step: int | None, step: int = 0):
        self.out = JsonlAppender(path, fsync_every=16)
        self.step = step
        self.trackers = []
        try:
            for name in report_to:
                if name == "tensorboard":
                    self.trackers.append(TensorboardTracker(reports / "tensorboard", resumed_step))
                else:
                    self.trackers.append(WandbTracker(reports, project, run_name, config, resumed_step))
        except BaseException:
            self.close()
            raise

    def write(self, record: dict) -> None:
        self.out.write(record)
        self.step = record.get("step", self.step)
        scalars = tracker_scalars(record)
        for tracker in self.trackers:
            tracker.log(scalars, self.step)

    def close(self) -> None:
        self.out.close()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


class SkippedSamples:
    """The samples the reader skipped (a states file that failed a read check: ``train_data.SkippedFile``), each
    listed in checkpoints/skipped.jsonl (``records_checkpoints.SkippedSample``) and counted per epoch over every
    rank. Each rank collects what it read (``add``); ``sync`` hands them to rank 0, which writes them, and gives every
    rank the global counts. Under torchrun ``sync`` is a collective: every rank calls it at the same steps."""

    def __init__(self, path: Path, ranks, device: torch.device, before: list[SkippedSample]):
        self.ranks, self.device = ranks, device
        self.pending: list[SkippedSample] = []  # this rank's, not yet synced
        self.trained = Counter(s.epoch for s in before if not s.held_out)  # epoch: global count, resumed ones too
        self.held_out = Counter(s.epoch for s in before if s.held_out)
        self.listed_this_run = Counter()  # epoch: trained-without samples synced in this run (its rows records)
        # held-out samples skipped, as (epoch, index): several evaluations an epoch (train.eval_every_steps) read the
        # same held-out rows, and a file that fails its check fails it each time: listed and counted once an epoch
        self.held_out_seen = {(s.epoch, s.index) for s in before if s.held_out}
        self.out = JsonlAppender(path, fsync_every=1) if ranks.main else None

    def add(self, batch: dict, epoch: int, step: int, held_out: bool = False) -> None:
        """Takes a host batch's skipped samples (``train_data.SKIPPED_KEY``), read for ``step`` of ``epoch``."""
        from .train_data import SKIPPED_KEY

        for e in batch.get(SKIPPED_KEY) or ():
            log.warning("epoch %d step %d: skipped %s%s: %s", epoch + 1, step, e["file"],
                        " (held out)" if held_out else "", e["reason"])
            self.pending.append(SkippedSample(epoch=epoch, step=step, file=e["file"], index=e["index"],
                                              reason=e["reason"], held_out=held_out, rank=self.ranks.rank))

    def sync(self) -> int:
        """Every rank's pending samples listed (rank 0 writes) and counted; returns how many were new."""
        new, self.pending = self.pending, []
        if self.ranks.distributed:
            import torch.distributed as dist

            count = torch.tensor([len(new)], dtype=torch.int64, device=self.device)
            dist.all_reduce(count)
            if int(count.item()) == 0:
                return 0
            gathered = [None] * self.ranks.world
            dist.all_gather_object(gathered, new)
            new = [s for ranked in gathered for s in ranked]
        fresh = []
        for s in new:
            if s.held_out and (s.epoch, s.index) in self.held_out_seen:
                continue
            if s.held_out:
                self.held_out_seen.add((s.epoch, s.index))
            fresh.append(s)
        new = fresh
        for s in new:
            (self.held_out if s.held_out else self.trained)[s.epoch] += 1
            if not s.held_out:
                self.listed_this_run[s.epoch] += 1
            if self.out is not None:
                self.out.write(s.to_json())
        return len(new)

    def in_epoch(self, epoch: int) -> int:
        """Samples of ``epoch`` skipped so far, trained and held out, over every rank (as of the last ``sync``)."""
        return self.trained[epoch] + self.held_out[epoch]

    def close(self) -> None:
        if self.out is not None:
            self.out.close()


# ---------------------------------------------------------------------------------------------------------------
# DFlash (train.draft dflash): speculators' DFlash metric sums. Its position accuracies are marginal (slot i right,
# whatever came before); "eal" is the mean over blocks of 1 + the leading run of right slots, the acceptance length
# vLLM would measure on these targets (compare it with 1 + the sum of EAGLE-3's cumulative acc@k).


def dflash_metric_keys(block_size: int) -> list[str]:
    keys = ["loss_sum", "loss_total", "full_acc_sum", "full_acc_total", "eal_sum", "eal_total"]
    for i in range(1, block_size):
        keys += [f"position_{i}_acc_sum", f"position_{i}_acc_total"]
    return keys


def summarize_dflash(sums: dict[str, float], block_size: int) -> dict[str, float]:
    """{"loss", "acc" (all drafted slots), "eal", "pos_acc_1".. "pos_acc_{block-1}", "blocks", "block_tokens", the
    simulated acceptance length (= eal: counted per block, so no model of the slots' dependence is needed)}: the
    loss is the mean over rows, the rest over every supervised block / slot of the rows summed."""
    def ratio(a: str, b: str) -> float:
        return sums[a] / sums[b] if sums[b] else 0.0

    out = {"loss": ratio("loss_sum", "loss_total"), "acc": ratio("full_acc_sum", "full_acc_total"),
           "eal": ratio("eal_sum", "eal_total"), "blocks": sums["eal_total"], "block_tokens": sums["full_acc_total"]}
    for i in range(1, block_size):
        out[f"pos_acc_{i}"] = ratio(f"position_{i}_acc_sum", f"position_{i}_acc_total")
    out[ACCEPTANCE_KEY] = out["eal"]  # what train.export best chooses by
    return out


def plot_dflash_curves(metrics_path: Path, out_png: Path, block_size: int) -> None:
    """Loss, and the expected acceptance length beside each block slot's accuracy, against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(read_jsonl(metrics_path)) if metrics_path.exists() else []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for kind, style in (("train", "-"), ("eval", "o--")):
        sel = [r for r in rows if r["kind"] == kind and "eal" in r]
        if not sel:
            continue
        steps = [r["step"] for r in sel]
        axes[0].plot(steps, [r["loss"] for r in sel], style, label=kind)
        axes[1].plot(steps, [r["eal"] for r in sel], style, label=kind)
        for i in range(1, block_size):
            axes[2].plot(steps, [r[f"pos_acc_{i}"] for r in sel], style, label=f"{kind} slot {i}")
    axes[0].set(xlabel="optimizer step", ylabel="loss", title="DFlash loss")
    axes[1].set(xlabel="optimizer step", ylabel="tokens per block", title="expected acceptance length",
                ylim=(1, block_size))
    axes[2].set(xlabel="optimizer step", ylabel="accuracy", title="accuracy per block slot", ylim=(0, 1))
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = out_png.with_name(f".{out_png.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out_png)
