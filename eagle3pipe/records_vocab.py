"""Stage 03's on-disk format, vocab/: the draft vocabulary, its map onto the verifier's, the token counts and the
summary; their save/load/check. The folder's layout is ``records.DataDir``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .records import FORMAT_VERSION, DataDir, FormatError, atomic_write_bytes, atomic_write_json

# Vocab (stage 03): the draft vocabulary and its map onto the verifier's
#
#   vocab/
#     mapping.safetensors       d2t int64 [N]: offsets, target id = i + d2t[i], target ids strictly ascending
#                               t2d bool [V]: True at the N target ids in the draft vocabulary (vLLM ignores it)
#     token_counts.safetensors  counts int64 [V]: supervised (loss_mask == 1) occurrences of each target id
#     summary.json              VocabSummary: where the map came from, sizes, coverage of our supervised tokens
#     provenance.json

VOCAB_D2T_KEY = "d2t"
VOCAB_T2D_KEY = "t2d"
VOCAB_COUNTS_KEY = "counts"
VOCAB_SOURCES = ("data", "checkpoint", "rebuilt")


@dataclass
class VocabSummary:
    """summary.json of vocab/: what map stage 03 wrote and how much of our supervised data it covers."""

    source: str  # "data" (top-N of our counts), "checkpoint" (kept from finetune_from), "rebuilt" (ours, replacing it)
    draft_vocab_size: int
    vocab_size: int
    supervised_tokens: int  # loss_mask == 1 positions counted
    coverage: float  # share of supervised tokens whose id is in the draft vocabulary
    checkpoint: str = ""  # the warm-start checkpoint whose map was kept or replaced
    checkpoint_coverage: float = -1.0  # coverage of the checkpoint's own map on our data (-1: no checkpoint)
    shared_with_checkpoint: int = -1  # draft ids shared by our map and the checkpoint's (-1: no checkpoint)
    rows_file: str = ""  # the data.jsonl counted
    mask_token: str = ""  # DFlash (03 --draft dflash): the special token filling a block's draft slots, by name
    mask_token_id: int = -1  # its id in the verifier's vocabulary (-1: not resolved, an EAGLE-3 vocab/)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict:
        return asdict(self)


def check_vocab_mapping(d2t, t2d, vocab_size: int | None = None, draft_vocab_size: int | None = None,
                        where: str = "") -> None:
    """Raise FormatError unless d2t/t2d are a consistent map (dtypes, sizes, ascending ids, t2d == set of d2t)."""
    import torch

    if d2t.dtype != torch.int64 or d2t.ndim != 1:
        raise FormatError(f"{where}: d2t must be int64 [N], got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.ndim != 1:
        raise FormatError(f"{where}: t2d must be bool [V], got {t2d.dtype} {tuple(t2d.shape)}")
    if draft_vocab_size is not None and d2t.shape[0] != draft_vocab_size:
        raise FormatError(f"{where}: d2t has {d2t.shape[0]} entries, draft_vocab_size is {draft_vocab_size}")
    if vocab_size is not None and t2d.shape[0] != vocab_size:
        raise FormatError(f"{where}: t2d covers {t2d.shape[0]} target ids, vocab_size is {vocab_size}")
    target_ids = torch.arange(d2t.shape[0]) + d2t  # [N]
    if target_ids.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= t2d.shape[0]):
        raise FormatError(f"{where}: d2t maps outside the target vocabulary [0, {t2d.shape[0]})")
    if target_ids.numel() > 1 and not bool((target_ids[1:] > target_ids[:-1]).all()):
        raise FormatError(f"{where}: d2t target ids are not strictly ascending")
    if int(t2d.sum()) != d2t.shape[0] or not bool(t2d[target_ids].all()):
        raise FormatError(f"{where}: t2d does not mark exactly the {d2t.shape[0]} target ids of d2t")


def save_vocab(data_dir: "DataDir", d2t, t2d, counts, summary: VocabSummary) -> None:
    """Write vocab/ (mapping, counts, summary), each file atomically, summary last."""
    import torch
    from safetensors.torch import save as st_save

    check_vocab_mapping(d2t, t2d, summary.vocab_size, summary.draft_vocab_size, where="save_vocab")
    atomic_write_bytes(data_dir.vocab_mapping, st_save({VOCAB_D2T_KEY: d2t.contiguous(), VOCAB_T2D_KEY: t2d.contiguous()}))
    atomic_write_bytes(data_dir.vocab_counts, st_save({VOCAB_COUNTS_KEY: counts.to(torch.int64).contiguous()}))
    atomic_write_json(data_dir.vocab_summary, summary.to_json())


def load_vocab_mapping(path: Path, vocab_size: int | None = None, draft_vocab_size: int | None = None):
    """(d2t int64 [N], t2d bool [V]) from a mapping.safetensors, checked."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run 03_build_vocab_mapping.py first")
    data = load_file(str(path))
    for key in (VOCAB_D2T_KEY, VOCAB_T2D_KEY):
        if key not in data:
            raise FormatError(f"{path}: lacks tensor '{key}' (has {sorted(data)})")
    d2t, t2d = data[VOCAB_D2T_KEY], data[VOCAB_T2D_KEY]
    check_vocab_mapping(d2t, t2d, vocab_size, draft_vocab_size, where=str(path))
    return d2t, t2d


def load_vocab_counts(path: Path):
    from safetensors.torch import load_file

    return load_file(str(path))[VOCAB_COUNTS_KEY]


def load_vocab_summary(path: Path) -> VocabSummary:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run 03_build_vocab_mapping.py first")
    try:
        summary = VocabSummary(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise FormatError(f"{path}: not a vocab summary ({e})") from None
    if summary.source not in VOCAB_SOURCES:
        raise FormatError(f"{path}: source {summary.source!r} is not one of {VOCAB_SOURCES}")
    return summary
