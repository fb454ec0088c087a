#!/usr/bin/env python3
"""Stage 04: train the EAGLE-3 draft (or, with --draft dflash, a DFlash draft) with speculators (one GPU, several
under torchrun, or the CPU for the toy) and export it for vLLM.

Usage:
    python 04_train.py --config configs/kimi_k25.yaml
    torchrun --standalone --nproc-per-node 8 04_train.py --config configs/kimi_k25.yaml   # DDP, one GPU a rank
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 --rdzv-id draft \\
        04_train.py --config configs/kimi_k25.yaml                                         # on every node
    python 04_train.py --config configs/kimi_k25.yaml --finetune-from /models/Kimi-K2-Instruct-eagle3
    python 04_train.py --config configs/kimi_k25.yaml --resume          # after a crash or kill
    python 04_train.py --config configs/kimi_k25.yaml --export-from step_2000   # serve a checkpoint mid-run (05)
    python 04_train.py --config configs/demo.yaml                       # toy verifier, CPU
    python 04_train.py --config configs/kimi_k25_dflash.yaml [--finetune-from /models/Kimi-K2.5-DFlash]  # DFlash
    python 04_train.py --config configs/kimi_k25.yaml --data-source online --eval-fraction 0 --spool-gb 64 \\
        --extract-url http://node1:8000                                 # states from vLLM as training goes

Reads:  <data_dir>/hidden_states/ (stage 02, bf16 or fp8; online: the rows stage 02 reads, and the states of the
        next rows from stage 02's vLLM servers into hidden_states/work/train_spool/, train.spool_gb at most),
        <data_dir>/vocab/ (stage 03), the verifier's embedding,
        final norm and lm_head (Kimi-K2.5 nested layout included), and with --finetune-from a flat
        LlamaForCausalLMEagle3 draft (AQ-MedAI / SpecForge layout).
Writes: <data_dir>/checkpoints/{step_N/ (every --checkpoint-every steps and at the end), metrics.jsonl, curves.png
        (redrawn at every held-out evaluation), reports/ (--report-to tensorboard wandb), final/ (flat
        LlamaForCausalLMEagle3 for vLLM/SGLang, or speculators format; --export best: the best evaluation's step),
        provenance.json}, logs/04_train.log (rank N under torchrun: logs/04_train.rankN.log; rank 0 alone writes
        everything else); --export-from step_N: checkpoints/export_step_N/ (or --export-to) and logs/04_export.log.
All logic lives in eagle3pipe/train.py (model and checkpoint formats in eagle3pipe/draft.py; DFlash:
eagle3pipe/train_drafts.py, eagle3pipe/draft_dflash.py).
"""

import sys

from eagle3pipe.cli import run_stage
from eagle3pipe.train import run_train, train_log_name

if __name__ == "__main__":
    sys.exit(run_stage("train", train_log_name, run_train, __doc__))
