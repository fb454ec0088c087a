"""Stage 04's metrics: per-TTT-step loss and accuracy from speculators' metric sums, held-out evaluation, curves."""

from __future__ import annotations

from pathlib import Path

import torch

from .records import read_jsonl


def step_metrics(metrics: dict, ttt_steps: int) -> dict[str, float]:
    """{"loss": total, "loss_1".., "acc_1"..}: per-TTT-step KL loss and accuracy (all earlier steps included)."""
    out = {"loss": float(metrics["loss_sum"])}
    for i in range(ttt_steps):
        out[f"loss_{i + 1}"] = float(metrics[f"loss_{i}_sum"])
        total = float(metrics[f"full_acc_{i}_total"])
        out[f"acc_{i + 1}"] = float(metrics[f"full_acc_{i}_sum"]) / total if total else 0.0
    return out


@torch.no_grad()
def evaluate(model, batches_on_device, device: torch.device, autocast: bool, call_kwargs: dict, ttt_steps: int) -> dict:
    """Mean loss and accuracy per TTT step over ``batches_on_device`` ((host batch, device batch) pairs)."""
    model.eval()
    sums: dict[str, float] = {}
    batches = 0
    for _, gpu in batches_on_device:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            _, _, metrics = model(**gpu, **call_kwargs)
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        batches += 1
    model.train()
    if not batches:
        return {}
    out = {"loss": sums["loss_sum"] / batches}
    for i in range(ttt_steps):
        out[f"loss_{i + 1}"] = sums[f"loss_{i}_sum"] / batches
        total = sums[f"full_acc_{i}_total"]
        out[f"acc_{i + 1}"] = sums[f"full_acc_{i}_sum"] / total if total else 0.0
    return out


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
