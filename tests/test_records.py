"""JSONL append/repair and atomic writes: a crash loses at most the record in flight, never silently; the raw
safetensors writer writes safetensors' own bytes."""

import json
import os

import pytest
import torch

from eagle3pipe.records import (
    FormatError,
    JsonlAppender,
    atomic_write_json,
    read_jsonl,
    repair_jsonl,
    save_tensors_atomic,
)


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


@pytest.mark.parametrize("dtypes", [("bfloat16", None), ("float32", None), ("float16", None), ("float8_e4m3fn", "float32")])
def test_raw_safetensors_writer_writes_safetensors_own_bytes(tmp_path, dtypes):
    """save_tensors_atomic (os.write from the tensors' memory) == safetensors.torch.save, byte for byte, and
    safetensors reads it back (odd sizes: the header padding and every dtype's rank in the order are exercised)."""
    from safetensors.torch import load_file, save

    states_dtype, scales_dtype = (getattr(torch, d) if d else None for d in dtypes)
    g = torch.Generator().manual_seed(0)
    for t in (1, 7, 33):
        tensors = {"token_ids": torch.randint(0, 1000, (t,), generator=g),
                   "hidden_states": torch.randn(t, 4, 24, generator=g).to(states_dtype)}
        if scales_dtype is not None:
            tensors["hidden_states_scales"] = torch.rand(t, 1, 1, generator=g).to(scales_dtype)
        path = tmp_path / f"s{t}.safetensors"
        n = save_tensors_atomic(path, tensors)
        assert path.read_bytes() == save(tensors) and n == path.stat().st_size
        n = save_tensors_atomic(path, tensors, {"all_finite": "1"})  # the vLLM connector's metadata
        assert path.read_bytes() == save(tensors, metadata={"all_finite": "1"}) and n == path.stat().st_size
        back = load_file(str(path))
        assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in tensors.items())
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_sample_file_metadata_round_trip_and_check(tmp_path):
    """save_hidden_states -> read_hidden_states_metadata -> check_hs_file_metadata: the layer ids and depth a file
    names are compared with the config's (aux ids + the final state = num_layers), every key required."""
    from eagle3pipe.records import (
        check_hs_file_metadata,
        hs_file_metadata,
        hs_layer_ids,
        read_hidden_states_metadata,
        save_hidden_states,
    )

    path = tmp_path / "hs_0.safetensors"
    assert hs_layer_ids([58, 2, 30], 61) == [2, 30, 58, 61]
    save_hidden_states(path, torch.randn(5, 4, 8), torch.arange(5), "bf16", metadata=hs_file_metadata([2, 4, 5, 8], 8))
    meta = read_hidden_states_metadata(path)
    assert meta == {"layer_ids": "[2, 4, 5, 8]", "num_layers": "8", "all_finite": "1"}
    assert check_hs_file_metadata(path, meta, [2, 4, 5], 8) is True
    assert check_hs_file_metadata(path, hs_file_metadata([2, 4, 5, 8], 8, finite=False), [2, 4, 5], 8) is False
    with pytest.raises(FormatError, match=r"layer ids \[2, 4, 5, 8\] from a 8-layer verifier, but the config "
                                          r"stores \[1, 3, 4, 8\]"):
        check_hs_file_metadata(path, meta, [1, 3, 4], 8)
    with pytest.raises(FormatError, match=r"from a 8-layer verifier, but the config stores \[2, 4, 5, 9\] of a "
                                          "9-layer one"):
        check_hs_file_metadata(path, meta, [2, 4, 5], 9)
    for key in meta:
        with pytest.raises(FormatError, match=rf"its metadata lacks \['{key}'\]"):
            check_hs_file_metadata(path, {k: v for k, v in meta.items() if k != key}, [2, 4, 5], 8)
