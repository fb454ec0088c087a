"""A draft at its initial weights, exported where 04 exports (checkpoints/final), for step-cost measurements that
need no training (issue 46/48: what a speculation step costs on vLLM beside a verifier, by draft family and
attention geometry). Built by the family 04 trains (``train_drafts.draft_family(...).new_model``) on an identity
vocabulary map (draft token i = verifier token i), and written by the family's own export, so vLLM loads exactly
the layout a trained draft has. Its acceptance is ~0: only the step timings of 05 mean anything.

Usage: python bench/gpu_random_draft.py --config DATA.yaml     (bench/gpu_route.py --speed-random-weights runs it)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3pipe.config import load_config  # noqa: E402
from eagle3pipe.records import DataDir  # noqa: E402
from eagle3pipe.train_drafts import draft_family  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    cfg = load_config(p.parse_args().config)
    s = cfg.shared
    family = draft_family(cfg, torch.device("cpu"))
    d2t = torch.zeros(s.draft_vocab_size, dtype=torch.long)  # offsets: draft id i -> verifier id i + 0
    t2d = torch.zeros(s.vocab_size, dtype=torch.bool)
    t2d[: s.draft_vocab_size] = True
    torch.manual_seed(s.seed)
    model, _ = family.new_model(d2t, t2d, "sdpa")
    out = family.export(model, DataDir(cfg.data_dir).final_checkpoint, None)
    print(f"{family.name} draft at its initial weights: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
          f"parameters -> {out}")


if __name__ == "__main__":
    main()
