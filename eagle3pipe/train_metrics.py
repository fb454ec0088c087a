"""Stage 04's metrics: per-TTT-step loss and accuracy from speculators' metric sums, held-out evaluation, curves,
and the samples the reader skipped (``SkippedSamples``)."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch

from .records import JsonlAppender, SkippedSample, read_jsonl

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


def summarize(sums: dict[str, float], ttt_steps: int) -> dict[str, float]:
    """{"loss", "loss_1".., "acc_1"..} over the rows summed: losses are the mean over rows (each packed row's loss
    counts once, as speculators weights it), acc@k the share of all supervised tokens right (all earlier steps
    included)."""
    rows = sums["loss_total"]
    out = {"loss": sums["loss_sum"] / rows if rows else 0.0}
    for i in range(ttt_steps):
        out[f"loss_{i + 1}"] = sums[f"loss_{i}_sum"] / rows if rows else 0.0
        total = sums[f"full_acc_{i}_total"]
        out[f"acc_{i + 1}"] = sums[f"full_acc_{i}_sum"] / total if total else 0.0
    return out


@torch.no_grad()
def evaluate_sums(model, batches_on_device, autocast: bool, call_kwargs: dict, keys: list[str],
                  device: torch.device) -> dict | None:
    """Metric sums over ``batches_on_device`` ((host batch, device batch) pairs: this rank's share of the held-out
    rows); None when it holds none. ``summarize(reduce_metrics(...))`` turns them into the mean over all ranks."""
    model.eval()
    sums = None
    for _, gpu in batches_on_device:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            _, _, metrics = model(**gpu, **call_kwargs)
        sums = add_metrics(sums, metrics, keys)
    model.train()
    return sums


def plot_curves(metrics_path: Path, out_png: Path, ttt_steps: int) -> None:
    """Per-TTT-step loss and accuracy against the step, train (lines) and eval (markers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(read_jsonl(metrics_path)) if metrics_path.exists() else []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for kind, style in (("train", "-"), ("eval", "o--")):
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            continue
        steps = [r["step"] for r in sel]
        for i in range(1, ttt_steps + 1):
            axes[0].plot(steps, [r[f"loss_{i}"] for r in sel], style, label=f"{kind} step {i}")
            axes[1].plot(steps, [r[f"acc_{i}"] for r in sel], style, label=f"{kind} acc@{i}")
    axes[0].set(xlabel="optimizer step", ylabel="KL loss", title="loss per TTT step")
    axes[1].set(xlabel="optimizer step", ylabel="accuracy", title="accuracy per TTT step", ylim=(0, 1))
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = out_png.with_name(f".{out_png.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out_png)


class SkippedSamples:
    """The samples the reader skipped (a states file that failed a read check: ``train_data.SkippedFile``), each
    listed in checkpoints/skipped.jsonl (``records.SkippedSample``) and counted per epoch over every rank. Each rank
    collects what it read (``add``); ``sync`` hands them to rank 0, which writes them, and gives every rank the
    global counts. Under torchrun ``sync`` is a collective: every rank calls it at the same steps."""

    def __init__(self, path: Path, ranks, device: torch.device, before: list[SkippedSample]):
        self.ranks, self.device = ranks, device
        self.pending: list[SkippedSample] = []  # this rank's, not yet synced
        self.trained = Counter(s.epoch for s in before if not s.held_out)  # epoch: global count, resumed ones too
        self.held_out = Counter(s.epoch for s in before if s.held_out)
        self.listed_this_run = Counter()  # epoch: trained-without samples synced in this run (its rows records)
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
