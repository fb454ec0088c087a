"""Stage 03: the draft vocabulary: top ``draft_vocab_size`` target ids by supervised frequency, as d2t/t2d.

Counts token ids over the loss-masked (``loss_mask == 1``) positions of the training rows (the data.jsonl stage 02
extracts: ``extract.input``), keeps the most frequent ``draft_vocab_size`` (ties to the lower id; speculators'
``build_vocab_mappings_from_distribution``), and writes vocab/ (see records.py). With a warm-start checkpoint
(``vocab.finetune_from`` or ``train.finetune_from``) the default keeps the checkpoint's own map, because its lm_head
rows belong to it; ``--rebuild`` writes ours instead and stage 04 then remaps the lm_head rows.

For a DFlash draft (``--draft dflash``) it also resolves the mask token (``vocab.mask_token``, by name, from the
verifier's own tokenizer: a special token, inside the verifier vocabulary, never seen in the rows) into summary.json;
the map is always ours (a published DFlash draft predicts over the full vocabulary with the verifier's lm_head).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from .cli import StageError
from .config import ConfigError, PipelineConfig
from .progress import Progress
from .records import (
    DataDir,
    FormatError,
    TrainingRow,
    check_synthetic_finished,
    open_row_index,
    read_jsonl,
    read_provenance,
    write_provenance,
)
from .records_vocab import VocabSummary, save_vocab

log = logging.getLogger(__name__)


def rows_file(cfg: PipelineConfig) -> Path:
    """The training rows stage 02 extracts (and so the ones the draft is trained on)."""
    dd = DataDir(cfg.data_dir)
    return dd.synthetic_data if cfg.extract.input == "synthetic" else dd.prepared_data


COUNT_BATCH_TOKENS = 1 << 20  # supervised ids gathered before one bincount over the vocabulary


def count_supervised_tokens(path: Path, vocab_size: int, every_s: float = 30.0,
                            watch: dict | None = None) -> tuple[torch.Tensor, int]:
    """(counts int64 [vocab_size], rows read): occurrences of each id at loss_mask == 1 positions. ``watch``
    ({"id": token id}) also gets "count" (its occurrences at any position) and "first_row" (the first row's id).

    Streams the rows (one in memory at a time; the row count comes from the file's row index, not a pass over it)
    and counts their supervised ids in batches: one bincount over the vocabulary per COUNT_BATCH_TOKENS ids, not
    one per row (a [V] pass per row was most of the time on short rows)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    progress = Progress(len(open_row_index(path, "rows")), unit="rows", every_s=every_s, logger=log, desc="Counting")
    batch = np.empty(COUNT_BATCH_TOKENS, dtype=np.int64)  # supervised ids waiting for the next bincount
    filled = rows = 0
    if watch is not None:
        watch.update(count=0, first_row="")
    for i, d in enumerate(read_jsonl(path), 1):
        row = TrainingRow.from_json(d, where=f"{path}:{i}")
        ids = np.asarray(row.input_ids, dtype=np.int64)
        if watch is not None and (seen := int((ids == watch["id"]).sum())):
            watch["count"] += seen
            watch["first_row"] = watch["first_row"] or row.id
        supervised = ids[np.asarray(row.loss_mask, dtype=bool)]  # [n_sup]
        if supervised.size and (int(supervised.max()) >= vocab_size or int(supervised.min()) < 0):
            raise FormatError(f"{path}:{i}: token id {int(supervised.max())} outside the verifier vocabulary "
                              f"[0, {vocab_size}) (check --vocab-size)")
        if filled + supervised.size > batch.size:
            counts += np.bincount(batch[:filled], minlength=vocab_size)
            filled = 0
        if supervised.size > batch.size:
            counts += np.bincount(supervised, minlength=vocab_size)
        else:
            batch[filled: filled + supervised.size] = supervised
            filled += supervised.size
        rows += 1
        progress.update(1)
    counts += np.bincount(batch[:filled], minlength=vocab_size)
    progress.close()
    return torch.from_numpy(counts), rows


def map_from_counts(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the top ``draft_vocab_size`` ids, by speculators' own rule (unseen ids pad the map)."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    seen = torch.nonzero(counts).squeeze(1)
    freq = dict(zip(seen.tolist(), counts[seen].tolist()))
    return build_vocab_mappings_from_distribution(freq, draft_vocab_size, counts.shape[0])


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of supervised tokens whose id is in the draft vocabulary."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0


def shared_tokens(d2t_a: torch.Tensor, d2t_b: torch.Tensor) -> int:
    """How many target ids two draft vocabularies have in common."""
    a = set((torch.arange(d2t_a.shape[0]) + d2t_a).tolist())
    return len(a & set((torch.arange(d2t_b.shape[0]) + d2t_b).tolist()))


def resolve_mask_token(cfg: PipelineConfig) -> tuple[str, int]:
    """(name, id) of ``vocab.mask_token`` in the verifier's own tokenizer: it must be a token of that name (a
    tokenizer maps an unknown name to its unk id, so the name is looked up, not converted), a special token (plain
    text never encodes to it), and inside the verifier's vocabulary."""
    from .chat import load_tokenizer

    name, where = cfg.vocab.mask_token, cfg.tokenizer_path
    tokenizer = load_tokenizer(where, cfg.shared.trust_remote_code)
    token_id = tokenizer.get_vocab().get(name)
    if token_id is None:
        named = {k: getattr(tokenizer, k) for k in ("mask_token", "unk_token", "pad_token") if getattr(tokenizer, k)}
        specials = sorted(str(t) for t in tokenizer.added_tokens_decoder.values())
        raise StageError(f"vocab.mask_token {name!r}: no token of that name in {where}'s tokenizer (its "
                         f"{', '.join(f'{k} {v!r}' for k, v in named.items())}; {len(specials)} special tokens in "
                         "all): name one that never occurs in text (--mask-token)")
    if name not in tokenizer.all_special_tokens and token_id not in tokenizer.added_tokens_decoder:
        raise StageError(f"vocab.mask_token {name!r} (id {token_id}) is a regular piece of text in {where}'s "
                         "tokenizer, not a special token: rows would hold it where the draft reads a mask. Name a "
                         "reserved special token (--mask-token)")
    if not 0 <= token_id < cfg.shared.vocab_size:
        raise StageError(f"vocab.mask_token {name!r} has id {token_id}, outside the verifier's vocabulary "
                         f"[0, {cfg.shared.vocab_size}) (shared.vocab_size)")
    return name, token_id


def run_vocab(cfg: PipelineConfig) -> VocabSummary:
    """Count, choose the draft vocabulary (ours or the warm-start checkpoint's), write vocab/."""
    from .draft import DraftFormatError, read_flat_checkpoint
    from .draft_mla import read_checkpoint as read_mla_checkpoint

    started = time.time()
    dd = DataDir(cfg.data_dir)
    s = cfg.shared
    path = rows_file(cfg)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run the stage that writes it first (extract.input = "
                                f"{cfg.extract.input!r})")
    if cfg.extract.input == "synthetic":
        check_synthetic_finished(dd)  # a partial 01b output is refused, naming 01b
    dflash = cfg.train.draft == "dflash"
    checkpoint = "" if dflash else cfg.vocab.finetune_from or cfg.train.finetune_from
    if dflash and (cfg.vocab.finetune_from or cfg.train.finetune_from):
        log.info("--draft dflash: the map is built from our data (a DFlash warm start's lm_head is the verifier's "
                 "rows: stage 04 takes them, or remaps a speculators DFlash draft's own rows)")
    config_hash = cfg.section_hash("shared", "vocab", "extract") + f":{checkpoint}" + (":dflash" if dflash else "")
    inputs = [str(path), checkpoint] if checkpoint else [str(path)]
    prov = read_provenance(dd.provenance(dd.vocab))
    stat = path.stat()
    fingerprint = {"rows_file_bytes": stat.st_size, "rows_file_mtime": int(stat.st_mtime)}
    if prov and prov.get("config_hash") == config_hash and dd.vocab_summary.exists() and all(
            prov.get("counts", {}).get(k) == v for k, v in fingerprint.items()):
        log.info("vocab/ is up to date with %s and this config: skipping (delete %s to redo)", path, dd.vocab)
        from .records_vocab import load_vocab_summary

        return load_vocab_summary(dd.vocab_summary)

    mask = None
    if dflash:
        mask_name, mask_id = resolve_mask_token(cfg)
        mask = {"id": mask_id}
    counts, rows = count_supervised_tokens(path, s.vocab_size, s.progress_every_s, watch=mask)
    if mask is not None and mask["count"]:
        raise StageError(f"{path}: the DFlash mask token {mask_name!r} (id {mask_id}) occurs {mask['count']} times in "
                         f"the rows (first in row {mask['first_row']!r}): the draft could not tell a mask slot from "
                         "that text. Name another reserved special token (vocab.mask_token, --mask-token)")
    supervised = int(counts.sum())
    if supervised == 0:
        raise StageError(f"{path}: no supervised token (every loss_mask is 0)")
    if s.draft_vocab_size > s.vocab_size:
        raise ConfigError(f"--draft-vocab-size {s.draft_vocab_size} exceeds --vocab-size {s.vocab_size}")
    seen = int((counts > 0).sum())
    if seen < s.draft_vocab_size:
        log.warning("only %d distinct supervised ids for a draft vocabulary of %d: the rest is padded with unseen "
                    "ids (more data, or a smaller --draft-vocab-size)", seen, s.draft_vocab_size)
    ours_d2t, ours_t2d = map_from_counts(counts, s.draft_vocab_size)
    summary = VocabSummary(source="data", draft_vocab_size=s.draft_vocab_size, vocab_size=s.vocab_size,
                           supervised_tokens=supervised, coverage=coverage(counts, ours_t2d), rows_file=str(path))
    if mask is not None:
        summary.mask_token, summary.mask_token_id = mask_name, mask_id
        log.info("DFlash mask token %r = id %d (a special token, absent from the %d rows)", mask_name, mask_id, rows)
    d2t, t2d = ours_d2t, ours_t2d
    if checkpoint:
        try:  # the family's own reader (MHA flat layout, or MLA): either refuses the other's checkpoint
            ckpt = (read_mla_checkpoint if cfg.train.draft == "eagle3_mla" else read_flat_checkpoint)(checkpoint)
        except DraftFormatError as e:
            raise StageError(str(e)) from None
        if ckpt.t2d.shape[0] != s.vocab_size:
            raise StageError(f"{checkpoint}: its t2d covers {ckpt.t2d.shape[0]} target ids, --vocab-size is "
                             f"{s.vocab_size}: not a draft for this verifier")
        if ckpt.draft_vocab_size != s.draft_vocab_size and not cfg.vocab.rebuild:
            raise ConfigError(f"{checkpoint}: draft vocabulary of {ckpt.draft_vocab_size}, --draft-vocab-size is "
                              f"{s.draft_vocab_size}: set --draft-vocab-size {ckpt.draft_vocab_size} (keeps its map), "
                              "or --rebuild (our map at --draft-vocab-size; its lm_head rows are moved, new tokens "
                              "take the verifier's)")
        summary.checkpoint = str(checkpoint)
        summary.checkpoint_coverage = coverage(counts, ckpt.t2d)
        summary.shared_with_checkpoint = shared_tokens(ours_d2t, ckpt.d2t)
        if cfg.vocab.rebuild:
            summary.source = "rebuilt"
            log.info("rebuilt map: coverage %.4f (checkpoint's map: %.4f); %d of %d ids shared with the checkpoint, "
                     "whose lm_head rows stage 04 moves to their new places", summary.coverage,
                     summary.checkpoint_coverage, summary.shared_with_checkpoint, s.draft_vocab_size)
        else:
            d2t, t2d = ckpt.d2t, ckpt.t2d
            summary.source = "checkpoint"
            summary.coverage = summary.checkpoint_coverage
            log.info("kept the checkpoint's map (its lm_head rows belong to it): coverage on our data %.4f (a "
                     "rebuilt map would cover %.4f; --rebuild to use it)", summary.checkpoint_coverage,
                     coverage(counts, ours_t2d))
    save_vocab(dd, d2t, t2d, counts, summary)
    write_provenance(dd.provenance(dd.vocab), stage="vocab", config_hash=config_hash, config=cfg.to_dict(),
                     inputs=inputs, counts={"rows": rows, "supervised_tokens": supervised, "distinct_ids": seen,
                                            **fingerprint}, started=started)
    log.info("vocab: wrote %s (source %s, %d rows, %d supervised tokens, coverage %.4f) in %.1fs", dd.vocab,
             summary.source, rows, supervised, summary.coverage, time.time() - started)
    return summary
