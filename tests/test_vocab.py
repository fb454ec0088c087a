"""Stage 03: counts over supervised positions, top-N map (d2t offsets, t2d), coverage, warm-start map kept/rebuilt."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from memory_bound import in_a_fresh_process
from eagle3pipe.cli import run_stage
from eagle3pipe.config import ConfigError
from eagle3pipe.records import DataDir
from eagle3pipe.records_vocab import load_vocab_counts, load_vocab_mapping, load_vocab_summary
from eagle3pipe.vocab import run_vocab
from tests.test_draft_fixtures import (
    DRAFT_VOCAB,
    TOY_VOCAB,
    make_flat_checkpoint,
    make_rows,
    toy_config,
    toy_rows,  # noqa: F401 (fixture)
    write_rows,
)


def _independent_top(rows, n):
    counts = Counter(t for r in rows for t, m in zip(r.input_ids, r.loss_mask) if m == 1)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:n]
    return counts, sorted(ranked)


def test_counts_map_and_coverage_match_an_independent_count(tmp_path, toy_llama, toy_rows):
    write_rows(tmp_path, toy_rows)
    cfg = toy_config(tmp_path, toy_llama)
    cfg.shared.draft_vocab_size = 64
    summary = run_vocab(cfg)
    dd = DataDir(tmp_path)
    counts, top = _independent_top(toy_rows, 64)
    got_counts = load_vocab_counts(dd.vocab_counts)
    assert got_counts.shape == (TOY_VOCAB,)
    assert {i: int(c) for i, c in enumerate(got_counts.tolist()) if c} == dict(counts)  # prompt tokens not counted
    d2t, t2d = load_vocab_mapping(dd.vocab_mapping, TOY_VOCAB, 64)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert [i + int(d2t[i]) for i in range(64)] == top  # target = i + d2t[i]
    assert sorted(torch.nonzero(t2d).squeeze(1).tolist()) == top
    want_cov = sum(counts[t] for t in top) / sum(counts.values())
    assert summary.source == "data" and summary.coverage == pytest.approx(want_cov)
    assert load_vocab_summary(dd.vocab_summary).supervised_tokens == sum(counts.values())


def test_warm_start_keeps_the_checkpoint_map_and_rebuild_replaces_it(tmp_path, toy_llama):
    rows = make_rows(40, seed=2)
    write_rows(tmp_path, rows)
    ckpt_targets = list(range(TOY_VOCAB - 2 * DRAFT_VOCAB, TOY_VOCAB, 2))  # mostly rare ids: a poor map for our data
    ckpt = make_flat_checkpoint(tmp_path / "aq", targets=ckpt_targets)
    dd = DataDir(tmp_path)
    counts, top = _independent_top(rows, DRAFT_VOCAB)
    total = sum(counts.values())

    cfg = toy_config(tmp_path, toy_llama, finetune_from=str(ckpt))
    kept = run_vocab(cfg)
    d2t, t2d = load_vocab_mapping(dd.vocab_mapping)
    assert kept.source == "checkpoint"
    assert [i + int(d2t[i]) for i in range(DRAFT_VOCAB)] == ckpt_targets
    assert kept.coverage == pytest.approx(sum(counts[t] for t in ckpt_targets) / total)

    cfg.vocab.rebuild = True
    rebuilt = run_vocab(cfg)
    d2t, _ = load_vocab_mapping(dd.vocab_mapping)
    assert rebuilt.source == "rebuilt" and rebuilt.checkpoint == str(ckpt)
    assert [i + int(d2t[i]) for i in range(DRAFT_VOCAB)] == top
    assert rebuilt.shared_with_checkpoint == len(set(top) & set(ckpt_targets))
    assert rebuilt.coverage > rebuilt.checkpoint_coverage == pytest.approx(kept.coverage)


def test_checkpoint_with_another_draft_vocab_size_is_refused(tmp_path, toy_llama, toy_rows):
    write_rows(tmp_path, toy_rows)
    ckpt = make_flat_checkpoint(tmp_path / "aq")
    cfg = toy_config(tmp_path, toy_llama, finetune_from=str(ckpt))
    cfg.shared.draft_vocab_size = 128
    with pytest.raises(ConfigError, match="--draft-vocab-size 256"):
        run_vocab(cfg)


def test_door_writes_vocab_and_skips_an_unchanged_rerun(tmp_path, toy_llama, toy_rows, caplog):
    write_rows(tmp_path, toy_rows)
    argv = ["--data-dir", str(tmp_path), "--verifier", str(toy_llama), "--vocab-size", str(TOY_VOCAB),
            "--draft-vocab-size", "32", "--hidden-size", "128", "--aux-layer-ids", "2", "4", "5"]
    assert run_stage("vocab", "03_vocab", run_vocab, None, argv) == 0
    dd = DataDir(tmp_path)
    first = dd.vocab_mapping.stat().st_mtime_ns
    assert load_vocab_summary(dd.vocab_summary).draft_vocab_size == 32
    assert run_stage("vocab", "03_vocab", run_vocab, None, argv) == 0
    assert dd.vocab_mapping.stat().st_mtime_ns == first  # skipped, not rewritten
    assert "up to date" in dd.log_file("03_vocab").read_text()
    # a missing input is one clean error line, exit 2
    assert run_stage("vocab", "03_vocab", run_vocab, None, argv + ["--data-dir", str(tmp_path / "none")]) == 2


@in_a_fresh_process
def test_counting_keeps_tens_of_bytes_a_row(tmp_path, toy_llama):
    """Stage 03 streams the rows: what it allocates does not grow with their number (issue 27; it streamed before
    too, this keeps it so)."""
    from memory_bound import bytes_per_row

    def setup(n: int):
        folder = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        write_rows(folder, make_rows(n, seed=2, min_len=8, max_len=16), which="prepared")
        cfg = toy_config(folder, toy_llama)
        cfg.extract.input = "prepared"
        return lambda: run_vocab(cfg)

    per_row = bytes_per_row(setup, 5000, 20000)
    print(f"\nstage 03 allocates {per_row:.1f} bytes a row")
    assert per_row < 64


# -- issue 31: the DFlash mask token, by name, from the verifier's own tokenizer ----------------------------------


def test_dflash_mask_token_is_resolved_by_name_and_checked(tmp_path, toy_llama, toy_kimi, toy_kimi_meta, capsys):
    """03 --draft dflash writes the mask token's name and id: "[PAD]" on the fast-tokenizer toy (it has no
    [UNK]), "[UNK]" on the release-shaped toy through its remote-code tokenizer (the release's 163838, two below
    the vocabulary's end). Refused, naming the culprit: a name the tokenizer lacks (which its convert_tokens_to_ids
    would silently map to [UNK]), a plain text piece, and a token that occurs in the rows."""
    from transformers import AutoTokenizer

    from tests.test_draft_fixtures import TOY_MASK_ID, TOY_MASK_TOKEN, dflash_config

    rows = make_rows(12, seed=9)
    write_rows(tmp_path / "a", rows)
    summary = run_vocab(dflash_config(tmp_path / "a", toy_llama))
    assert (summary.mask_token, summary.mask_token_id) == (TOY_MASK_TOKEN, TOY_MASK_ID)
    assert load_vocab_summary(DataDir(tmp_path / "a").vocab_summary).mask_token_id == TOY_MASK_ID
    assert run_vocab(toy_config(tmp_path / "a", toy_llama)).mask_token_id == -1  # EAGLE-3: none resolved

    kimi_vocab = toy_kimi_meta["vocab_size"]
    write_rows(tmp_path / "k", rows)
    cfg = dflash_config(tmp_path / "k", toy_kimi)
    cfg.shared.vocab_size, cfg.vocab.mask_token = kimi_vocab, "[UNK]"
    summary = run_vocab(cfg)
    tok = AutoTokenizer.from_pretrained(toy_kimi, trust_remote_code=True)
    assert summary.mask_token_id == tok.get_vocab()["[UNK]"] == kimi_vocab - 2
    assert tok.convert_tokens_to_ids("[MASK]") == summary.mask_token_id  # the silent fallback a lookup by name avoids

    def refused(name: str, data_rows) -> str:
        folder = tmp_path / f"r{len(capsys.readouterr().err)}_{abs(hash(name)) % 1000}"
        write_rows(folder, data_rows)
        argv = ["--data-dir", str(folder), "--verifier", str(toy_kimi), "--vocab-size", str(kimi_vocab),
                "--draft-vocab-size", "256", "--aux-layer-ids", "2", "4", "5", "--draft", "dflash", "--mask-token",
                name, "--max-seq-len", "256"]
        assert run_stage("vocab", "03_vocab", run_vocab, None, argv) == 2
        return capsys.readouterr().err

    err = refused("[MASK]", rows)
    assert "vocab.mask_token '[MASK]': no token of that name" in err and "[UNK]" in err, err
    piece = next(t for t in tok.get_vocab() if t.isalpha() and len(t) > 2)
    err = refused(piece, rows)
    assert "is a regular piece of text" in err, err
    mixed = make_rows(12, seed=9)
    mixed[5].input_ids[3] = summary.mask_token_id  # a row whose text holds "[UNK]" (it encodes to the special)
    err = refused("[UNK]", mixed)
    assert "occurs 1 times in the rows (first in row 'r5')" in err and "--mask-token" in err, err
