"""Stage 01 end to end: every dataset shape, dropped rows listed with reasons, reruns, one-line errors, no-TTY progress."""

import json
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from memory_bound import in_a_fresh_process
from eagle3pipe.chat import load_tokenizer, normalize_messages, normalize_tools, question_messages
from eagle3pipe.chat import tokenize_with_loss_mask
from eagle3pipe.cli import StageError
from eagle3pipe.config import load_config
from eagle3pipe.prepare import conversation_id, run_prepare
from eagle3pipe.records import DataDir, load_questions, load_training_rows, read_jsonl

from conftest import run_script_here
from test_chat import OPENAI_ROW, PERFECTBLEND_ROW, SHAREGPT_ROW, masked_runs

ROOT = Path(__file__).resolve().parents[1]


def make_cfg(toy, meta, data_dir, datasets_, **prepare):
    cfg = load_config(overrides={
        "shared": {"data_dir": str(data_dir), "verifier": str(toy), "think_token_id": meta["think_token_id"],
                   "response_token_id": meta["response_token_id"], "max_seq_len": 256, "progress_every_s": 0.0},
        "prepare": {"dataset": [str(d) for d in datasets_], **prepare},
    })
    cfg.validate("prepare")
    return cfg


@pytest.fixture
def shaped_files(tmp_path):
    """One file per supported shape, in the format real datasets ship in, with a malformed row among them."""
    openai = tmp_path / "openai_chats.jsonl"
    rows = [OPENAI_ROW, {"messages": [{"role": "user", "content": "only a question, no answer"}]},
            {"messages": [{"role": "robot", "content": "bad role"}]}, OPENAI_ROW]  # last one: duplicate
    openai.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sharegpt = tmp_path / "sharegpt.json"  # ShareGPT ships a JSON array
    sharegpt.write_text(json.dumps([SHAREGPT_ROW, {"conversations": [{"from": "human", "value": "x" * 3000},
                                                                     {"from": "gpt", "value": "long"}]}]))
    blend = tmp_path / "perfectblend.parquet"
    datasets.Dataset.from_list([PERFECTBLEND_ROW]).to_parquet(str(blend))
    return openai, sharegpt, blend


def test_every_shape_prepared_with_exact_masks_and_listed_drops(tmp_path, toy_llama, toy_meta, shaped_files):
    cfg = make_cfg(toy_llama, toy_meta, tmp_path / "d", shaped_files)
    counts = run_prepare(cfg)
    dd = DataDir(tmp_path / "d")
    rows = list(load_training_rows(dd.prepared_data))
    questions = {q.id: q for q in load_questions(dd.questions)}
    errors = list(read_jsonl(dd.prepared_errors))
    tok = load_tokenizer(toy_llama)

    expected = {"openai_chats": OPENAI_ROW, "sharegpt": SHAREGPT_ROW, "perfectblend": PERFECTBLEND_ROW}
    assert sorted(r.source for r in rows) == sorted(expected)
    for row in rows:
        messages = normalize_messages(expected[row.source])
        assert row.id == conversation_id(row.source, messages)
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [tok.decode(run) for run in masked_runs(row.input_ids, row.loss_mask)] == [
            "</think>" + a + "<|im_end|>" for a in answers]
        assert questions[row.id].messages == messages[: max(i for i, m in enumerate(messages) if m["role"] == "user")
                                                      + 1]
    # The question-only row becomes a question for 01b but not a training row.
    assert counts["question_only"] == 1 and len(questions) == 4
    reasons = {(e["source"], e["row"]): e["reason"] for e in errors}
    assert reasons[("openai_chats", 2)].startswith("malformed: turn 0 has unknown role 'robot'")
    assert reasons[("openai_chats", 3)] == "duplicate conversation"
    assert reasons[("sharegpt", 1)].startswith("too long:") and "max_seq_len 256" in reasons[("sharegpt", 1)]
    assert counts["dropped"] == len(errors) == 3
    assert counts["rows_read"] == counts["questions"] + counts["dropped"]


def test_truncate_policy_keeps_prefix(tmp_path, toy_llama, toy_meta):
    src = tmp_path / "long.jsonl"
    long_answer = {"messages": [{"role": "user", "content": "count"},
                                {"role": "assistant", "content": " ".join(str(i) for i in range(200))}]}
    long_question = {"messages": [{"role": "user", "content": "y" * 2000}, {"role": "assistant", "content": "ok"}]}
    src.write_text(json.dumps(long_answer) + "\n" + json.dumps(long_question) + "\n")
    cfg = make_cfg(toy_llama, toy_meta, tmp_path / "d", [src], truncation="truncate")
    cfg.shared.max_seq_len = 40
    counts = run_prepare(cfg)
    dd = DataDir(tmp_path / "d")
    rows = list(load_training_rows(dd.prepared_data))
    full_ids, _ = tokenize_with_loss_mask(load_tokenizer(toy_llama), normalize_messages(long_answer), thinking=True)
    assert counts["truncated"] == 1 and [r.input_ids for r in rows] == [full_ids[:40]]
    (err,) = list(read_jsonl(dd.prepared_errors))
    assert err["row"] == 1 and err["reason"] == "too long: no supervised token within the first 40 tokens"


def test_rerun_skips_and_changed_config_refuses(tmp_path, toy_llama, toy_meta, shaped_files):
    cfg = make_cfg(toy_llama, toy_meta, tmp_path / "d", shaped_files)
    run_prepare(cfg)
    dd = DataDir(tmp_path / "d")
    before = dd.prepared_data.read_bytes()
    mtime = dd.prepared_data.stat().st_mtime_ns
    run_prepare(cfg)
    assert dd.prepared_data.stat().st_mtime_ns == mtime  # skipped, untouched
    cfg.shared.max_seq_len = 128
    with pytest.raises(StageError, match="different config.*--overwrite"):
        run_prepare(cfg)
    cfg.prepare.overwrite = True
    run_prepare(cfg)
    cfg2 = make_cfg(toy_llama, toy_meta, tmp_path / "d2", shaped_files)
    run_prepare(cfg2)
    # Deterministic: ids and tokens identical across runs into different folders.
    assert [json.loads(x)["id"] for x in before.splitlines()] == [
        json.loads(x)["id"] for x in DataDir(tmp_path / "d2").prepared_data.read_bytes().splitlines()]


def _run_script(*args) -> subprocess.CompletedProcess:
    """``python 01_prepare_data.py ARGS`` through its door in this process (conftest.run_script_here): its exit code
    and stderr."""
    code, stderr = run_script_here("01_prepare_data.py", list(args))
    return subprocess.CompletedProcess(args, code, "", stderr)


def test_thousands_of_rows_without_tty_print_plain_progress(tmp_path, toy_llama, toy_meta):
    """(10,000 rows until 2026-12-06: 2,000 at a 0.1 s interval print as many progress lines in a fifth of the time.)"""
    src = tmp_path / "big.jsonl"
    with open(src, "w") as f:
        for i in range(2_000):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"what is {i} + {i % 7}?"},
                                             {"role": "assistant", "content": str(i + i % 7)}]}) + "\n")
        f.write("{broken json\n")
    args = ["--verifier", toy_llama, "--think-token-id", toy_meta["think_token_id"], "--response-token-id",
            toy_meta["response_token_id"], "--data-dir", tmp_path / "d", "--dataset", src, "--max-samples", 0,
            "--progress-every-s", 0.1]  # a process of its own: its stderr is a pipe, as under nohup
    r = subprocess.run([sys.executable, "01_prepare_data.py", *map(str, args)], cwd=ROOT, capture_output=True,
                       text=True, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "Progress" in ln or "Prepare big:" in ln]
    assert len(lines) >= 3, r.stderr[-2000:]  # lines while it runs, not only the last one
    pattern = re.compile(r"Prepare big: \d+/\d+ \(\d+ errors\), [\d.]+ rows/s, kept: \d+, elapsed: \d+s, eta: \S+")
    assert lines and all(pattern.search(ln) for ln in lines), r.stderr[-2000:]
    assert "\r" not in r.stderr  # no tqdm bar redraws in a log read with tail -f
    log = (tmp_path / "d/logs/01_prepare.log").read_text()
    assert "prepared 2000 training rows" in log and "dropped 1" in log
    err = list(read_jsonl(tmp_path / "d/prepared/errors.jsonl"))
    assert err == [{"source": "big", "row": 2000, "reason": err[0]["reason"], "id": ""}]
    assert err[0]["reason"].startswith("malformed: not valid JSON")


def test_missing_dataset_and_wrong_think_id_are_one_line_errors(tmp_path, toy_llama, toy_meta):
    """A missing dataset file is named before the tokenizer loads (seconds earlier: the verifier here has none, whose
    error would come first otherwise)."""
    (tmp_path / "no_tokenizer").mkdir()
    r = _run_script("--verifier", tmp_path / "no_tokenizer", "--data-dir", tmp_path / "d",
                    "--dataset", tmp_path / "nope.jsonl",
                    "--think-token-id", toy_meta["think_token_id"], "--response-token-id",
                    toy_meta["response_token_id"])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == f"error: dataset file not found: {tmp_path / 'nope.jsonl'} (from --dataset)"
    src = tmp_path / "ok.jsonl"
    src.write_text(json.dumps(OPENAI_ROW) + "\n")
    r = _run_script("--verifier", toy_llama, "--data-dir", tmp_path / "d", "--dataset", src)  # K2.5 ids vs the toy
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: config shared.think_token_id = 163606 but the tokenizer maps '<think>' to")


@pytest.mark.parametrize("thinking", [True, False])
def test_release_shaped_toy_through_the_cli(tmp_path, toy_kimi, toy_kimi_meta, thinking):
    """Stage 01 on a folder laid out like the Kimi-K2.5 release (tiktoken.model + remote-code tokenizer, K2.5
    template): the masks decode to exactly what the assistant generates in each turn: multi-turn, tool calls, a
    conversation the assistant opens; tools and tool turns reach the questions 01b sends."""
    from test_chat import ASSISTANT_FIRST_ROW, TOOL_ROW, generated_text

    src = tmp_path / "chats.jsonl"
    rows = {"openai": OPENAI_ROW, "tools": TOOL_ROW, "first": ASSISTANT_FIRST_ROW, "sharegpt": SHAREGPT_ROW}
    src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows.values()))
    args = ["--config", ROOT / "configs/kimi_k25.yaml",  # the K2.5 config as shipped, pointed at the toy
            "--verifier", toy_kimi, "--think-token-id", toy_kimi_meta["think_token_id"], "--response-token-id",
            toy_kimi_meta["response_token_id"], "--data-dir", tmp_path / "d", "--dataset", src, "--max-seq-len", 1024,
            "--thinking" if thinking else "--no-thinking"]
    if thinking:  # the refusal does not depend on --thinking: checked once
        r = _run_script(*args, "--no-trust-remote-code")
        assert r.returncode == 2 and "trust_remote_code: true" in r.stderr.strip().splitlines()[-1]
    r = _run_script(*args)  # shared.trust_remote_code defaults to true, as the release needs
    assert r.returncode == 0, r.stderr[-2000:]
    dd = DataDir(tmp_path / "d")
    assert list(read_jsonl(dd.prepared_errors)) == []
    tok = load_tokenizer(toy_kimi, trust_remote_code=True)
    prepared = {row.id: row for row in load_training_rows(dd.prepared_data)}
    questions = {q.id: q for q in load_questions(dd.questions)}
    assert len(prepared) == len(questions) == len(rows)
    for row in rows.values():
        messages, tools = normalize_messages(row), normalize_tools(row)
        rid = conversation_id("chats", messages, tools)
        answers = [generated_text(m, thinking) for m in messages if m["role"] == "assistant"]
        assert [tok.decode(run) for run in masked_runs(prepared[rid].input_ids, prepared[rid].loss_mask)] == answers
        assert questions[rid].tools == tools
        assert questions[rid].messages == question_messages(messages)
    tool_q = questions[conversation_id("chats", normalize_messages(TOOL_ROW), normalize_tools(TOOL_ROW))]
    assert [m["role"] for m in tool_q.messages] == ["system", "user", "assistant", "tool", "tool"]


def _kimi_copy(toy_kimi, folder, **config_changes):
    """The release-shaped toy with tokenizer_config.json keys changed (weights left out: 01 reads the tokenizer)."""
    import shutil

    shutil.copytree(toy_kimi, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    for key, value in config_changes.items():
        cfg[key] = value(cfg[key]) if callable(value) else value
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def _kimi_args(folder, meta, data_dir, src, *more):
    return ["--config", ROOT / "configs/kimi_k25.yaml", "--verifier", folder, "--think-token-id",
            meta["think_token_id"], "--response-token-id", meta["response_token_id"], "--data-dir", data_dir,
            "--dataset", src, "--max-seq-len", 1024, *more]


def test_a_tokenizer_that_fails_to_load_is_one_error_line(tmp_path, toy_kimi, toy_kimi_meta):
    """The release's class raised a bare KeyError: 'None' on the old toy (unk_token None); 01 says it in one line."""
    folder = _kimi_copy(toy_kimi, tmp_path / "no_unk", unk_token=None)
    src = tmp_path / "chats.jsonl"
    src.write_text(json.dumps(OPENAI_ROW) + "\n")
    r = _run_script(*_kimi_args(folder, toy_kimi_meta, tmp_path / "d", src))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the tokenizer at {folder} failed to load: ValueError: ")
    assert "unk_token is None" in last


def test_a_row_with_an_id_past_the_models_rows_stops_the_stage(tmp_path, toy_kimi, toy_kimi_meta):
    """A tokenizer that gives an id past the verifier's embedding rows (here a special added after the reserved
    block, as the release's class appended the old toy's unnamed specials): 01 stops naming the row and the id and
    writes nothing, instead of writing the row (which 02/04 would index out of range) or dropping every such row."""
    vocab = toy_kimi_meta["vocab_size"]
    extra = {"content": "<|extra|>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
             "special": True}
    folder = _kimi_copy(toy_kimi, tmp_path / "appended", added_tokens_decoder=lambda d: {**d, str(vocab): extra})
    src = tmp_path / "chats.jsonl"
    bad = {"messages": [{"role": "user", "content": "what is <|extra|>?"}, {"role": "assistant", "content": "ok"}]}
    src.write_text(json.dumps(OPENAI_ROW) + "\n" + json.dumps(bad) + "\n")
    args = _kimi_args(folder, toy_kimi_meta, tmp_path / "d", src, "--vocab-size", vocab, "--draft-vocab-size", 1000)
    r = _run_script(*args)
    assert r.returncode == 2, r.stderr[-2000:]
    rid = conversation_id("chats", normalize_messages(bad))
    ids, _ = tokenize_with_loss_mask(load_tokenizer(folder, trust_remote_code=True), normalize_messages(bad),
                                     thinking=True)
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: {src} row 1 (id {rid}): token id {vocab} ('<|extra|>') is >= shared.vocab_size {vocab}, the "
        f"verifier's embedding rows (1 of the row's {len(ids)} ids are): the tokenizer gives ids the model does not "
        "have; fix the tokenizer (name its specials in the reserved block) or shared.vocab_size (--vocab-size); "
        "nothing was written")
    assert not (tmp_path / "d/prepared/data.jsonl").exists()
    # the same rows fit a verifier with one more row
    r = _run_script(*_kimi_args(folder, toy_kimi_meta, tmp_path / "d2", src, "--vocab-size", vocab + 1,
                                "--draft-vocab-size", 1000))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = list(load_training_rows(tmp_path / "d2/prepared/data.jsonl"))
    assert len(rows) == 2 and max(max(row.input_ids) for row in rows) == vocab


# ---------------------------------------------------------------------------------------------------------------
# Scale (issue 27): worker processes, a seeded sample per dataset, memory flat in the row count


def _mixed_sources(folder: Path, n: int) -> list[Path]:
    """A JSON Lines file of n conversations with every kind of drop among them, a JSON array, a parquet file."""
    rows = [{"messages": [{"role": "user", "content": f"what is {i} + {i % 7}?"},
                          {"role": "assistant", "content": str(i + i % 7) * (1 + i % 9)}]} for i in range(n)]
    rows[5] = {"messages": [{"role": "robot", "content": "bad role"}]}
    rows[9] = {"messages": [{"role": "user", "content": "only a question, no answer"}]}
    rows[40] = rows[3]  # a duplicate, decided across batches and workers
    rows[77] = {"messages": [{"role": "user", "content": "x" * 3000}, {"role": "assistant", "content": "long"}]}
    lines = [json.dumps(r) for r in rows]
    lines[100] = "{broken json"
    folder.mkdir(parents=True, exist_ok=True)
    chats = folder / "chats.jsonl"
    chats.write_text("\n".join(lines[:50]) + "\n\n" + "\n".join(lines[50:]) + "\n")  # a blank line keeps its number
    sharegpt = folder / "sharegpt.json"
    sharegpt.write_text(json.dumps([SHAREGPT_ROW, 7, SHAREGPT_ROW]))
    blend = folder / "perfectblend.parquet"
    datasets.Dataset.from_list([PERFECTBLEND_ROW] * 2).to_parquet(str(blend))
    return [chats, sharegpt, blend]


def test_worker_processes_write_exactly_what_one_process_writes(tmp_path, toy_llama, toy_meta, caplog):
    """prepare.num_proc: the rows are rendered in worker processes, batch by batch, and written in read order, so
    every output byte (rows, questions, drops, both row indexes) equals the single-process run's; the ids are the
    tokenizer's own rendering of each conversation."""
    import logging

    sources = _mixed_sources(tmp_path / "src", 400)
    outputs = {}
    for num_proc in (1, 2):
        cfg = make_cfg(toy_llama, toy_meta, tmp_path / f"p{num_proc}", sources, max_samples=0, num_proc=num_proc)
        with caplog.at_level(logging.INFO):
            counts = run_prepare(cfg)
        dd = DataDir(tmp_path / f"p{num_proc}")
        outputs[num_proc] = {p.name: p.read_bytes() for p in sorted(dd.prepared.iterdir())
                             if p.name != "provenance.json"}
    assert "rendering with 2 worker processes" in caplog.text
    assert sorted(outputs[2]) == ["data.index", "data.jsonl", "errors.jsonl", "questions.index", "questions.jsonl"]
    assert outputs[1] == outputs[2]
    assert counts["rows_read"] == 400 + 3 + 2 and counts["question_only"] == 1
    errors = [json.loads(x) for x in outputs[2]["errors.jsonl"].splitlines()]
    assert [(e["source"], e["row"], e["reason"].split(":")[0]) for e in errors] == [
        ("chats", 5, "malformed"), ("chats", 40, "duplicate conversation"), ("chats", 78, "too long"),
        ("chats", 101, "malformed"), ("sharegpt", 1, "malformed"), ("sharegpt", 2, "duplicate conversation"),
        ("perfectblend", 1, "duplicate conversation")]
    tok = load_tokenizer(toy_llama)
    rows = {r.id: r for r in load_training_rows(tmp_path / "p2/prepared/data.jsonl")}
    for i in (0, 63, 64, 200, 399):  # rows of several batches
        messages = normalize_messages({"messages": [{"role": "user", "content": f"what is {i} + {i % 7}?"},
                                                    {"role": "assistant", "content": str(i + i % 7) * (1 + i % 9)}]})
        ids, mask = tokenize_with_loss_mask(tok, messages, thinking=True)
        row = rows[conversation_id("chats", messages)]
        assert (row.input_ids, row.loss_mask) == (ids, mask)


def test_max_samples_is_a_seeded_sample_of_each_dataset(tmp_path, toy_llama, toy_meta):
    """--max-samples N: N questions from each dataset, drawn with shared.seed; rows of the draw that are dropped are
    replaced by the draw's next rows (written after the first N, each batch in file order); the same seed draws the
    same rows, another seed others."""
    from eagle3pipe.prepare import sample_order

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    bad = {3, 11, 12, 30, 31, 32, 47}
    for path, n in ((a, 60), (b, 25)):
        path.write_text("".join(
            ("{not json\n" if path == a and i in bad else json.dumps(
                {"messages": [{"role": "user", "content": f"{path.stem} {i}?"},
                              {"role": "assistant", "content": f"answer {i}"}]}) + "\n") for i in range(n)))

    def kept(seed: int, folder: str) -> dict[str, list[int]]:
        cfg = make_cfg(toy_llama, toy_meta, tmp_path / folder, [a, b], max_samples=20)
        cfg.shared.seed = seed
        counts = run_prepare(cfg)
        assert counts["questions"] == 40
        out: dict[str, list[int]] = {}
        for q in load_questions(tmp_path / folder / "prepared/questions.jsonl"):
            out.setdefault(q.source, []).append(int(q.messages[0]["content"].split()[1].rstrip("?")))
        return out

    got = kept(0, "s0")
    draw = sample_order(60, 0, "a").tolist()
    first = sorted(i for i in draw[:20] if i not in bad)  # the draw's first 20 rows, less the unreadable ones
    assert got["a"][: len(first)] == first and len(first) < 20
    assert sorted(got["a"]) == sorted([i for i in draw if i not in bad][:20])  # the draw's first 20 readable rows
    assert got["b"] == sorted(sample_order(25, 0, "b")[:20].tolist())
    assert kept(0, "s0b") == got
    assert kept(1, "s1")["a"] != got["a"]


@in_a_fresh_process
def test_prepare_keeps_tens_of_bytes_a_row(tmp_path, toy_llama, toy_meta):
    """Stage 01's row handling allocates a few tens of bytes per row at most (the id key of each kept
    conversation), not the rows: rows and questions go to disk as they are rendered."""
    from memory_bound import bytes_per_row

    def setup(n: int):
        folder = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        src = folder / "chats.jsonl"
        src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"what is {i} + {i % 7}?"},
                                                        {"role": "assistant", "content": str(i + i % 7)}]}) + "\n"
                               for i in range(n)))
        cfg = make_cfg(toy_llama, toy_meta, folder / "d", [src], max_samples=0, num_proc=1)
        return lambda: run_prepare(cfg)

    per_row = bytes_per_row(setup, 2000, 8000)
    print(f"\nstage 01 allocates {per_row:.1f} bytes a row")
    assert per_row < 64
