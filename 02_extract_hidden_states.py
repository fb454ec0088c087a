#!/usr/bin/env python3
"""Stage 02: extract the verifier's aux-layer hidden states for every training row (speculators' training layout).

Usage:
    python 02_extract_hidden_states.py --config configs/kimi_k25.yaml [--storage-dtype fp8] [--num-workers 8]
    python 02_extract_hidden_states.py --data-dir data --verifier /models/Kimi-K2.5 --input synthetic

Inputs:  <data_dir>/synthetic/data.jsonl (or prepared/data.jsonl with --input prepared); the verifier folder.
Outputs: <data_dir>/hidden_states/ = the `speculators train --data-path` folder: an HF dataset (input_ids,
         loss_mask, seq_len), hidden_states/hs_{i}.safetensors ([T, 4, H]: states entering the aux layers, then the
         final pre-norm state; token_ids [T]), manifest.json, errors.jsonl (samples not written, each with its reason),
         provenance.json. A rerun resumes; a finished output is skipped; other inputs need --overwrite.
"""

import sys

from eagle3pipe.cli import run_stage
from eagle3pipe.extract import STAGE, run_extract

if __name__ == "__main__":
    sys.exit(run_stage("extract", STAGE, run_extract, __doc__))
