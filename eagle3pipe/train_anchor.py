"""The L2-SP anchor of stage 04 (``train.anchor_to_init``): a fine-tune pulled back toward the weights it started from.

L2-SP (Li et al. 2018, "Explicit inductive bias for transfer learning") adds ``weight / 2 x ||theta - theta_0||^2``
to the loss, theta_0 the trained tensors as training started (a warm start's checkpoint, or a fresh draft's seeded
initialisation): a draft fine-tuned on a narrow distribution keeps more of what its published weights did elsewhere.
k-l-lambda's K2.6 fine-tunes of lightseekorg's MLA draft use weight 1e-4.

Its gradient ``weight x (theta - theta_0)`` is added to each trained tensor's gradient once a step, after the rows'
backward (and, under torchrun, after DDP's all-reduce: every rank holds the same theta and theta_0, so the ranks
stay equal), before clipping. theta_0 is taken before a --resume loads its checkpoint: a resumed run rebuilds the
same start (the warm start's files, or the same seed) and so anchors to the same point.
"""

from __future__ import annotations

import torch


class InitAnchor:
    """theta_0 of the trained tensors (fp32 copies, on their device) and the anchor's gradient and penalty."""

    def __init__(self, params: list[torch.nn.Parameter], weight: float):
        self.params, self.weight = list(params), float(weight)
        self.start = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def add_gradient(self) -> None:
        """grad += weight x (theta - theta_0), for every trained tensor (one without a gradient gets one)."""
        for p, p0 in zip(self.params, self.start):
            pull = (p.detach().float() - p0).mul_(self.weight).to(p.dtype)
            if p.grad is None:
                p.grad = pull
            else:
                p.grad.add_(pull.to(p.grad.dtype))

    @torch.no_grad()
    def penalty(self) -> float:
        """weight / 2 x ||theta - theta_0||^2: the loss term the gradient above belongs to."""
        return 0.5 * self.weight * float(sum(((p.detach().float() - p0) ** 2).sum() for p, p0 in
                                             zip(self.params, self.start)))

    @torch.no_grad()
    def distance(self) -> float:
        """||theta - theta_0|| over every trained tensor (for the metrics: how far the fine-tune has moved)."""
        return float(sum(((p.detach().float() - p0) ** 2).sum() for p, p0 in zip(self.params, self.start))) ** 0.5
