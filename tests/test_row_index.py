"""The row index beside a JSONL file (records.py, "Row index"): written in step with the file, every field equal to
an independent parse of the file, brought up to date after a crash, rebuilt when the file changed under it, and
read per rank without the other ranks' rows."""

import json
import os

import numpy as np
import pytest

from eagle3pipe.records import (
    RESPONSE_EMPTY_REASONING,
    RESPONSE_FLAGS,
    RESPONSE_NO_COMPLETION,
    RESPONSE_OTHER_FLAG,
    IndexedJsonlWriter,
    KeyCounts,
    KeySet,
    TrainingRow,
    id_key,
    open_row_index,
    read_jsonl,
    rewrite_without,
    row_index_path,
)


def _row(i: int) -> dict:
    n = 1 + i % 5
    return TrainingRow(id=f"row-{i}", input_ids=list(range(i, i + n)), loss_mask=[0] * (n - 1) + [1],
                       source="s").to_json()


def _independent_index(path) -> list[tuple[int, int, int, int]]:
    """(offset, bytes, tokens, key) of each line, from the file's bytes alone."""
    out, offset = [], 0
    for line in path.read_bytes().splitlines(keepends=True):
        d = json.loads(line)
        out.append((offset, len(line), len(d["input_ids"]), id_key(d["id"])))
        offset += len(line)
    return out


def _as_tuples(index) -> list[tuple[int, int, int, int]]:
    return list(zip(index.offsets.tolist(), index.num_bytes.tolist(), index.lengths.tolist(), index.keys.tolist()))


def test_written_in_step_and_each_row_read_back_exactly(tmp_path):
    path = tmp_path / "data.jsonl"
    with IndexedJsonlWriter(path, "rows") as out:
        for i in range(50):
            out.write(_row(i))
    assert path.read_bytes() == b"".join((json.dumps(_row(i), ensure_ascii=False) + "\n").encode() for i in range(50))
    index = open_row_index(path, "rows")
    assert _as_tuples(index) == _independent_index(path)
    assert os.path.getsize(row_index_path(path)) == 32 + 28 * 50  # 28 bytes a row
    assert [index.row(i).to_json() for i in (0, 17, 49)] == [_row(0), _row(17), _row(49)]
    assert [r.to_json() for r in index.rows([40, 3])] == [_row(3), _row(40)]  # file order
    assert index.find(np.array([id_key("row-7"), id_key("nope")], dtype=np.uint64)).tolist() == [7, -1]
    # per rank: contiguous blocks covering every row once, each holding only its own records
    shares = [index.rank_share(r, 4) for r in range(4)]
    assert sum(len(s) for s in shares) == 50
    assert [s.row(0).id for s in shares] == ["row-0", "row-12", "row-25", "row-37"]
    assert shares[3].keys.tolist() == index.keys[37:].tolist()


def test_a_crash_between_a_line_and_its_index_record_is_caught_up(tmp_path):
    path = tmp_path / "data.jsonl"
    with IndexedJsonlWriter(path, "rows") as out:
        for i in range(5):
            out.write(_row(i))
    with open(path, "ab") as f:  # two lines written, the process killed before their index records
        f.write((json.dumps(_row(5)) + "\n" + json.dumps(_row(6)) + "\n").encode())
        f.write(b'{"id": "row-7", "input_')  # and a torn line
    with IndexedJsonlWriter(path, "rows") as out:  # the next run: repairs the line, indexes 5 and 6, appends
        out.write(_row(8))
    assert [d["id"] for d in read_jsonl(path)] == ["row-0", "row-1", "row-2", "row-3", "row-4", "row-5", "row-6",
                                                   "row-8"]
    assert _as_tuples(open_row_index(path, "rows")) == _independent_index(path)
    # a partial index record (killed while appending it) and records past the file's end (a power cut) are dropped
    with open(row_index_path(path), "ab") as f:
        f.write(b"\x07" * 30)
    assert _as_tuples(open_row_index(path, "rows")) == _independent_index(path)
    with open(path, "rb+") as f:
        f.truncate(_independent_index(path)[-1][0])  # the last line lost with its page cache
    assert _as_tuples(open_row_index(path, "rows")) == _independent_index(path)
    assert os.path.getsize(row_index_path(path)) == 32 + 28 * 7


def test_an_index_that_no_longer_describes_its_file_is_rebuilt(tmp_path, caplog):
    path = tmp_path / "data.jsonl"
    with IndexedJsonlWriter(path, "rows") as out:
        for i in range(40):
            out.write(_row(i))
    # the file replaced by a filtered copy (every other row), the index left as it was
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[::2]))
    index = open_row_index(path, "rows")
    assert "does not describe" in caplog.text
    assert _as_tuples(index) == _independent_index(path) and len(index) == 20
    assert _as_tuples(open_row_index(path, "rows")) == _independent_index(path)  # and saved
    # a reader's view with a torn last line (a writer still at it, or crashed) is refused, not guessed
    with open(path, "ab") as f:
        f.write(b'{"id": "x", "inp')
    row_index_path(path).unlink()
    with pytest.raises(Exception, match="torn last line"):
        open_row_index(path, "rows")


def test_rewrite_without_copies_the_kept_lines_and_their_index(tmp_path):
    path = tmp_path / "data.jsonl"
    with IndexedJsonlWriter(path, "rows") as out:
        for i in range(30):
            out.write(_row(i))
    before = path.read_bytes().splitlines(keepends=True)
    drop = np.arange(30) % 3 == 0
    index = rewrite_without(open_row_index(path, "rows"), drop)
    assert path.read_bytes() == b"".join(line for line, d in zip(before, drop) if not d)
    assert _as_tuples(index) == _independent_index(path) == _as_tuples(open_row_index(path, "rows"))


@pytest.mark.parametrize("kind", ["rows", "questions", "responses"])
def test_an_index_as_written_is_read_as_it_is(tmp_path, kind, caplog):
    """What the writer wrote is what a reader maps: no rebuild, no rewrite (its bytes and time stay)."""
    import logging

    path = tmp_path / "f.jsonl"
    record = {"rows": _row(1), "questions": {"id": "a", "messages": [], "source": "s"},
              "responses": {"id": "a", "prompt_token_ids": [1], "completion_token_ids": [2, 3], "flags": [],
                            "reasoning": "r"}}[kind]
    with IndexedJsonlWriter(path, kind) as out:
        out.write(record)
    before = row_index_path(path).stat().st_mtime_ns, row_index_path(path).read_bytes()
    with caplog.at_level(logging.INFO):
        index = open_row_index(path, kind)
    assert (len(index), int(index.lengths[0])) == (1, {"rows": 2, "questions": 0, "responses": 3}[kind])
    assert (row_index_path(path).stat().st_mtime_ns, row_index_path(path).read_bytes()) == before
    assert "indexed" not in caplog.text and "does not describe" not in caplog.text


def test_new_file_is_put_in_place_only_on_commit(tmp_path):
    path = tmp_path / "questions.jsonl"
    with IndexedJsonlWriter(path, "questions", new=True) as out:
        out.write({"id": "a", "messages": [{"role": "user", "content": "hi"}], "source": "s"})
    assert os.listdir(tmp_path) == []  # not committed: nothing left behind
    with IndexedJsonlWriter(path, "questions", new=True) as out:
        out.write({"id": "b", "messages": [{"role": "user", "content": "hi"}], "source": "s"})
        out.commit()
    assert sorted(os.listdir(tmp_path)) == ["questions.index", "questions.jsonl"]
    assert open_row_index(path, "questions").record(0)["id"] == "b"


def test_response_flags_and_keys():
    flags = {"id": "0123456789abcdef", "flags": ["length", "empty_reasoning", "from_the_future"],
             "completion_token_ids": [], "prompt_token_ids": [1], "reasoning": "  "}
    from eagle3pipe.records import describe_record

    key, tokens, bits = describe_record("responses", flags)
    assert key == 0x0123456789ABCDEF and tokens == 1  # stage 01's ids are their own key
    assert bits == (1 << RESPONSE_FLAGS.index("length")) | (1 << RESPONSE_FLAGS.index("empty_reasoning")) | \
        RESPONSE_OTHER_FLAG | RESPONSE_NO_COMPLETION | RESPONSE_EMPTY_REASONING
    assert id_key("q001") != id_key("q002") and id_key("q001") == id_key("q001")
    ids = KeySet(np.array([id_key(i) for i in ("b", "a", "b")], dtype=np.uint64))
    assert len(ids) == 2 and "a" in ids and "c" not in ids
    counts = KeyCounts(np.array([id_key("a"), id_key("b"), id_key("a")], dtype=np.uint64), np.array([2, 1, 3]))
    assert (counts.get("a"), counts.get("b"), counts.get("c", 0)) == (5, 1, 0)
