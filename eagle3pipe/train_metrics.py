"""Stage 04's metrics: per-TTT-step loss and accuracy from speculators' metric sums, held-out evaluation, curves."""

from __future__ import annotations

from pathlib import Path

import torch

from .records import read_jsonl


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
    """Sum ``sums`` (None: this rank trained no row) and ``extra`` over every rank with one all-reduce."""
    zero = torch.zeros((), device=device)
    vector = torch.stack([sums[k] if sums is not None else zero for k in keys]
                         + [torch.tensor(float(x), device=device) for x in extra])
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
    """{"loss", "acc" (all drafted slots), "eal", "pos_acc_1".. "pos_acc_{block-1}", "blocks", "block_tokens"}:
    the loss is the mean over rows, the rest over every supervised block / slot of the rows summed."""
    def ratio(a: str, b: str) -> float:
        return sums[a] / sums[b] if sums[b] else 0.0

    out = {"loss": ratio("loss_sum", "loss_total"), "acc": ratio("full_acc_sum", "full_acc_total"),
           "eal": ratio("eal_sum", "eal_total"), "blocks": sums["eal_total"], "block_tokens": sums["full_acc_total"]}
    for i in range(1, block_size):
        out[f"pos_acc_{i}"] = ratio(f"position_{i}_acc_sum", f"position_{i}_acc_total")
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
