"""JSONL append/repair and atomic writes: a crash loses at most the record in flight, never silently."""

import json
import os

import pytest

from eagle3pipe.records import FormatError, JsonlAppender, atomic_write_json, read_jsonl, repair_jsonl


def test_torn_last_line_is_repaired_and_appending_continues(tmp_path):
    p = tmp_path / "r.jsonl"
    with JsonlAppender(p) as w:
        for i in range(3):
            w.write({"id": i})
    with open(p, "ab") as f:  # what a kill in the middle of a write leaves behind
        f.write(b'{"id": 3, "te')
    with pytest.raises(FormatError, match="torn last line"):
        list(read_jsonl(p))
    with JsonlAppender(p) as w:  # opening for append repairs first
        w.write({"id": 4})
    assert [d["id"] for d in read_jsonl(p)] == [0, 1, 2, 4]
    assert repair_jsonl(p) == 0


def test_corrupt_complete_line_is_an_error_naming_the_line(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"id": 1}\nnot json\n')
    with pytest.raises(FormatError, match=r"r.jsonl:2: not valid JSON"):
        list(read_jsonl(p))


def test_atomic_write_leaves_no_temp_file(tmp_path):
    p = tmp_path / "sub" / "x.json"
    atomic_write_json(p, {"a": 1})
    atomic_write_json(p, {"a": 2})
    assert json.loads(p.read_text()) == {"a": 2}
    assert os.listdir(p.parent) == ["x.json"]
