#!/usr/bin/env python3
"""Stage 01: chat datasets -> exact token ids and assistant-only loss masks.

Usage:
    python 01_prepare_data.py --config configs/kimi_k25.yaml --dataset mlabonne/open-perfectblend
    python 01_prepare_data.py --config configs/demo.yaml --dataset chats.jsonl --max-samples 500

Reads:  HF dataset ids or local .json/.jsonl/.parquet (OpenAI `messages` or ShareGPT `conversations`), and the
        verifier's tokenizer (its own chat template).
Writes: <data_dir>/prepared/{data.jsonl, questions.jsonl, errors.jsonl, provenance.json}, logs/01_prepare.log.
All logic lives in eagle3pipe/prepare.py.
"""

import sys

from eagle3pipe.cli import run_stage
from eagle3pipe.prepare import run_prepare

if __name__ == "__main__":
    sys.exit(run_stage("prepare", "01_prepare", run_prepare, __doc__))
