#!/usr/bin/env python3
"""Stage 03: the draft vocabulary: top-N target ids by frequency over supervised tokens, as d2t / t2d.

Usage:
    python 03_build_vocab_mapping.py --config configs/kimi_k25.yaml
    python 03_build_vocab_mapping.py --config configs/kimi_k25.yaml --finetune-from /models/Kimi-K2-Instruct-eagle3
    python 03_build_vocab_mapping.py --config configs/kimi_k25.yaml --finetune-from DIR --rebuild
    python 03_build_vocab_mapping.py --config configs/kimi_k25_dflash.yaml    # + the DFlash mask token ([UNK])

Reads:  <data_dir>/synthetic/data.jsonl or prepared/data.jsonl (extract.input says which; loss_mask == 1 counted);
        with --finetune-from (or train.finetune_from in the YAML) the checkpoint's d2t/t2d, kept unless --rebuild;
        with --draft dflash the verifier's tokenizer (the mask token --mask-token, by name).
Writes: <data_dir>/vocab/{mapping.safetensors (d2t, t2d), token_counts.safetensors, summary.json (source,
        coverage; DFlash: mask_token, mask_token_id), provenance.json}, logs/03_vocab.log.
All logic lives in eagle3pipe/vocab.py.
"""

import sys

from eagle3pipe.cli import run_stage
from eagle3pipe.vocab import run_vocab

if __name__ == "__main__":
    sys.exit(run_stage("vocab", "03_vocab", run_vocab, __doc__))
