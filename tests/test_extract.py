"""Stage 02 contracts on the toy verifiers (CPU): layer ids, final pre-norm state, K2.5 wrapped load, batching,
fp8 storage, NaN handling, preflight, rerun/overwrite."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eagle3pipe import extract as extract_mod
from eagle3pipe import extract_worker
from eagle3pipe import verifier as verifier_mod
from eagle3pipe.cli import StageError, run_stage
from eagle3pipe.config import load_config
from eagle3pipe.extract import run_extract
from eagle3pipe.records import (
    DataDir,
    check_hidden_states_file,
    load_hidden_states,
    load_hs_manifest,
    load_hs_rows,
    read_jsonl,
    save_hidden_states,
)
from eagle3pipe.verifier import AuxStateCapture, load_text_model

AUX = [2, 4, 5]  # the toy's default aux ids (8 layers)


def write_rows(data_dir: Path, n: int, seed: int = 0, min_len: int = 4, max_len: int = 24,
               force_token: dict[int, int] | None = None) -> list[dict]:
    """prepared/data.jsonl with ``n`` random rows; ``force_token`` {row: token id} puts that id into a row."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        t = rng.randint(min_len, max_len)
        ids = [rng.randint(0, 1000) for _ in range(t)]
        if force_token and i in force_token:
            ids[t // 2] = force_token[i]
        rows.append({"id": f"row{i}", "input_ids": ids, "loss_mask": [0] * (t // 3) + [1] * (t - t // 3),
                     "source": "test"})
    path = DataDir(data_dir).prepared_data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def make_cfg(data_dir: Path, verifier: Path, **extract):
    ex = {"input": "prepared", "device": "cpu", "model_dtype": "float32", "writer_threads": 2}
    ex.update(extract)
    return load_config(overrides={
        "shared": {"data_dir": str(data_dir), "verifier": str(verifier), "aux_layer_ids": AUX, "hidden_size": 128,
                   "progress_every_s": 1.0},
        "extract": ex,
    })


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def reference_states(model, input_ids: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Independent reference: forward hooks on the embedding and every decoder layer's OUTPUT. The state entering
    layer k is the output of layer k-1 (the embedding for k = 0); the final is the last layer's output."""
    outs: dict[int, torch.Tensor] = {}
    handles = [model.embed_tokens.register_forward_hook(lambda m, a, o: outs.__setitem__(-1, o))]
    for i, layer in enumerate(model.layers):
        handles.append(layer.register_forward_hook(
            lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o)))
    with torch.no_grad():
        hf = model(input_ids=input_ids, output_hidden_states=True)
    for h in handles:
        h.remove()
    entering = {k: outs[k - 1] for k in range(len(model.layers))}
    return entering, outs[len(model.layers) - 1], hf


@pytest.mark.parametrize("flavour", ["toy_llama", "toy_deepseek"])
def test_capture_is_state_entering_layer_and_final_is_pre_norm(flavour, request):
    model = load_text_model(request.getfixturevalue(flavour), torch.float32)
    input_ids = torch.randint(0, 1000, (2, 19), generator=torch.Generator().manual_seed(1))
    ids = [0, 2, 4, 5, 7]
    states = AuxStateCapture(model, ids)(input_ids)  # [2, 19, 6, 128]
    entering, final, hf = reference_states(model, input_ids)
    assert states.shape == (2, 19, len(ids) + 1, 128)
    for slot, k in enumerate(ids):
        torch.testing.assert_close(states[:, :, slot], entering[k], rtol=0, atol=0)
        torch.testing.assert_close(states[:, :, slot], hf.hidden_states[k], rtol=0, atol=0)  # HF agrees for k < L
        # the toy init makes an off-by-one layer a large error, so the equality above pins the id
        assert rel_err(entering[k + 1] if k + 1 < 8 else final, entering[k]) > 0.2
    torch.testing.assert_close(states[:, :, -1], final, rtol=0, atol=0)
    # HF's last hidden_states entry is AFTER the final norm: ours is before it, and norm(ours) gives HF's
    assert rel_err(states[:, :, -1], hf.hidden_states[-1]) > 0.2
    torch.testing.assert_close(model.norm(states[:, :, -1]), hf.hidden_states[-1], rtol=1e-5, atol=1e-5)


def test_kimi_k25_wrapped_checkpoint_loads_text_model_exactly(toy_kimi, monkeypatch):
    model = load_text_model(toy_kimi, torch.bfloat16)
    assert type(model).__name__ == "DeepseekV3Model" and not hasattr(model, "lm_head")  # lm_head never built
    params = dict(model.state_dict())
    with safe_open(str(toy_kimi / "model.safetensors"), "pt") as f:
        expected = {k.removeprefix("language_model.model."): f.get_tensor(k) for k in f.keys()
                    if k.startswith("language_model.model.")}
    # the file keeps the released per-expert layout; the model holds experts fused: gate_up [E, 2I, H], down [E, H, I]
    for name in [n for n in params if n.endswith("mlp.experts.gate_up_proj")]:
        prefix = name.removesuffix("gate_up_proj")
        n_experts = params[name].shape[0]
        expected[name] = torch.stack([torch.cat([expected.pop(f"{prefix}{e}.gate_proj.weight"),
                                                 expected.pop(f"{prefix}{e}.up_proj.weight")]) for e in range(n_experts)])
        expected[prefix + "down_proj"] = torch.stack([expected.pop(f"{prefix}{e}.down_proj.weight")
                                                      for e in range(n_experts)])
    for name, tensor in expected.items():
        assert torch.equal(params.pop(name), tensor), name
    assert not [k for k in params if not k.endswith("e_score_correction_bias")], f"not from the file: {params}"
    # without the language_model.* key mapping the weights would stay random: the loader refuses
    monkeypatch.setattr(verifier_mod, "WRAPPED_KEY_MAPPING", {})
    with pytest.raises(verifier_mod.VerifierLoadError, match="not found in the checkpoint"):
        load_text_model(toy_kimi, torch.bfloat16)


def _read_all(data_dir: Path) -> list[dict]:
    dd = DataDir(data_dir)
    manifest = load_hs_manifest(dd.hs_manifest)
    return [load_hidden_states(dd.hs_file(i)) for i in range(manifest.num_samples)]


def test_batched_equals_one_at_a_time_bf16(tmp_path, toy_deepseek):
    rows = write_rows(tmp_path / "a", 8, min_len=3, max_len=30)
    write_rows(tmp_path / "b", 8, min_len=3, max_len=30)
    run_extract(make_cfg(tmp_path / "a", toy_deepseek, model_dtype="bfloat16", batch_tokens=4096))
    run_extract(make_cfg(tmp_path / "b", toy_deepseek, model_dtype="bfloat16", batch_tokens=1))
    batched, single = _read_all(tmp_path / "a"), _read_all(tmp_path / "b")
    assert len(batched) == len(single) == len(rows)
    errs = []
    for row, x, y in zip(rows, batched, single):
        assert x["token_ids"].tolist() == row["input_ids"] == y["token_ids"].tolist()
        assert x["hidden_states"].dtype == torch.bfloat16 and x["hidden_states"].shape == (len(row["input_ids"]), 4, 128)
        # per token and state: relative error of batched vs single
        e = (x["hidden_states"].float() - y["hidden_states"].float()).norm(dim=-1) / y["hidden_states"].float().norm(dim=-1)
        errs.append(e.flatten())
    errs = torch.cat(errs)
    # bf16 noise; MoE router flips may move a few tokens far (REFERENCE.md): median tight, small outlier budget
    assert errs.median() < 1e-2, errs.median()
    assert (errs > 0.05).float().mean() < 0.05, errs.sort().values[-10:]
    # a real batching bug (padding leaking, shifted positions) would be a wrong layer-sized error everywhere
    ds = load_hs_rows(DataDir(tmp_path / "a").hidden_states)
    assert [r.tolist() for r in ds["input_ids"]] == [r["input_ids"] for r in rows]
    assert [int(s) for s in ds["seq_len"]] == [len(r["input_ids"]) for r in rows]


def test_fp8_roundtrip_matches_hs_connectors_reader(tmp_path):
    from hs_connectors.transfer import FP8Transfer

    g = torch.Generator().manual_seed(0)
    hs = (torch.randn(37, 4, 128, generator=g) * torch.logspace(-2, 2, 37).view(37, 1, 1)).bfloat16()
    ids = torch.arange(37)
    fp8_bytes = save_hidden_states(tmp_path / "hs_0.safetensors", hs, ids, "fp8")
    bf16_bytes = save_hidden_states(tmp_path / "bf16.safetensors", hs, ids, "bf16")
    assert fp8_bytes < 0.55 * bf16_bytes
    with safe_open(str(tmp_path / "hs_0.safetensors"), "pt") as f:
        assert f.get_tensor("hidden_states").dtype == torch.float8_e4m3fn
        assert f.get_tensor("hidden_states_scales").shape == (37, 4, 1)  # one scale per token and state
    ours = load_hidden_states(tmp_path / "hs_0.safetensors")
    theirs = FP8Transfer(tmp_path).get_cached(0)  # what speculators' --hidden-states-backend fp8 reads
    torch.testing.assert_close(ours["hidden_states"], theirs["hidden_states"], rtol=0, atol=0)
    assert torch.equal(ours["token_ids"], ids)
    # e4m3 keeps 3 mantissa bits: per element error <= 1/16 relative + the per-(token, state) step near zero
    amax = hs.float().abs().amax(dim=2, keepdim=True)
    err = (ours["hidden_states"].float() - hs.float()).abs()
    assert (err <= hs.float().abs() / 16 + amax / 448 * 2 + 1e-6).all()
    assert rel_err(ours["hidden_states"], hs) < 0.05


def test_fp8_stage_output_close_to_bf16(tmp_path, toy_llama):
    write_rows(tmp_path / "a", 4)
    write_rows(tmp_path / "b", 4)
    m16 = run_extract(make_cfg(tmp_path / "a", toy_llama, storage_dtype="bf16", model_dtype="bfloat16"))
    m8 = run_extract(make_cfg(tmp_path / "b", toy_llama, storage_dtype="fp8", model_dtype="bfloat16"))
    assert m8.storage_dtype == "fp8" and m8.bytes < 0.55 * m16.bytes
    for x, y in zip(_read_all(tmp_path / "a"), _read_all(tmp_path / "b")):
        assert rel_err(y["hidden_states"], x["hidden_states"]) < 0.05


def _nan_verifier(src: Path, dst: Path, token: int) -> Path:
    """A copy of a toy verifier whose embedding row ``token`` is NaN: every sample holding it goes non-finite."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.embed_tokens.weight"][token] = float("nan")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_nan_samples_are_skipped_listed_and_rows_stay_aligned(tmp_path, toy_llama):
    verifier = _nan_verifier(toy_llama, tmp_path / "nan_verifier", token=1005)
    rows = write_rows(tmp_path / "d", 7, force_token={1: 1005, 4: 1005})
    manifest = run_extract(make_cfg(tmp_path / "d", verifier))
    dd = DataDir(tmp_path / "d")
    assert manifest.num_samples == 5 and manifest.num_dropped == 2
    errors = list(read_jsonl(dd.hs_errors))
    assert [(e["id"], e["row"]) for e in errors] == [("row1", 1), ("row4", 4)]
    assert all("non-finite" in e["reason"] for e in errors)
    kept = [r for i, r in enumerate(rows) if i not in (1, 4)]
    ds = load_hs_rows(dd.hidden_states)
    assert len(ds) == 5 and not dd.hs_file(5).exists()
    for i, r in enumerate(kept):  # row i of the dataset <-> hs_i, in input order
        assert ds[i]["input_ids"].tolist() == r["input_ids"] and ds[i]["loss_mask"].tolist() == r["loss_mask"]
        check_hidden_states_file(dd.hs_file(i), r["input_ids"], num_states=4, hidden_size=128)


def test_disk_preflight_refuses_with_numbers(tmp_path, toy_llama, monkeypatch):
    write_rows(tmp_path, 3)
    usage = type("U", (), {"free": 1000, "total": 10**6, "used": 0})()
    monkeypatch.setattr(extract_mod.shutil, "disk_usage", lambda p: usage)
    monkeypatch.setattr(extract_worker, "load_text_model", lambda *a, **k: pytest.fail("model loaded before preflight"))
    with pytest.raises(StageError, match=r"need .* GB .* --force-disk"):
        run_extract(make_cfg(tmp_path, toy_llama))


def test_rerun_skips_and_other_config_refuses_unless_overwrite(tmp_path, toy_llama, monkeypatch):
    write_rows(tmp_path, 3)
    first = run_extract(make_cfg(tmp_path, toy_llama))
    monkeypatch.setattr(extract_worker, "load_text_model", lambda *a, **k: pytest.fail("finished output recomputed"))
    assert run_extract(make_cfg(tmp_path, toy_llama)) == first
    with pytest.raises(StageError, match="--overwrite"):
        run_extract(make_cfg(tmp_path, toy_llama, storage_dtype="fp8"))
    monkeypatch.undo()
    again = run_extract(make_cfg(tmp_path, toy_llama, storage_dtype="fp8", overwrite=True))
    assert again.storage_dtype == "fp8" and again.num_samples == 3
    with safe_open(str(DataDir(tmp_path).hs_file(0)), "pt") as f:
        assert f.get_tensor("hidden_states").dtype == torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------------------------
# The release as released: kimi_k2 text config, int4 counted decompressed, one-line load errors, vLLM server flags


def test_gpu_memory_preflight_counts_int4_decompressed_and_names_the_vllm_backend(tmp_path, toy_kimi):
    from test_extract_int4 import quantize_toy

    quantize_toy(toy_kimi, tmp_path / "int4", tmp_path / "dequantized")
    need = verifier_mod.verifier_load_bytes(tmp_path / "int4", "bfloat16")
    # independent reference: what transformers really holds after loading (it decompresses the int4 experts)
    model = load_text_model(tmp_path / "int4", torch.bfloat16)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert abs(need - held) <= 0.01 * held
    assert need == verifier_mod.verifier_load_bytes(tmp_path / "dequantized", "bfloat16")  # int4 counted as bf16
    packed = sum(v.numel() * v.element_size() for k, v in
                 __import__("safetensors.torch", fromlist=["load_file"]).load_file(
                     str(tmp_path / "int4/model.safetensors")).items() if k.endswith("weight_packed"))
    assert packed > 0 and need > packed  # the file is smaller than the load
    with pytest.raises(StageError, match=r"takes \d+\.\d GB in bfloat16 .* extract.backend: vllm"):
        extract_mod.preflight_gpu_memory(need, need - 1, str(tmp_path / "int4"), "bfloat16")
    extract_mod.preflight_gpu_memory(need, need, str(tmp_path / "int4"), "bfloat16")


def test_a_checkpoint_that_does_not_load_is_a_one_line_error(tmp_path, toy_kimi):
    """A checkpoint missing one expert's weight (a broken download) is refused naming the folder: one `error:` line
    and status 2 from the door, not a traceback. (The intact release-shaped toy, text_config model_type kimi_k2 as
    released, loads: test_kimi_k25_wrapped_checkpoint_loads_text_model_exactly.)"""
    import shutil

    from safetensors.torch import load_file, save_file

    from conftest import run_script_here

    broken = tmp_path / "broken"
    shutil.copytree(toy_kimi, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["language_model.model.layers.3.mlp.experts.5.down_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    write_rows(tmp_path / "d", 2)
    code, stderr = run_script_here("02_extract_hidden_states.py", [
        "--data-dir", tmp_path / "d", "--verifier", broken, "--input", "prepared", "--aux-layer-ids", "2", "4", "5",
        "--hidden-size", "128", "--device", "cpu"])  # the door, in this process
    assert code == 2, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "could not load the decoder" in last and "Traceback" not in stderr


def test_vllm_server_flags_capture_aux_ids_then_the_final_state(tmp_path, toy_llama):
    from eagle3pipe import extract_vllm

    cfg = make_cfg(tmp_path, toy_llama, backend="vllm", server_args="--tensor-parallel-size 8 --max-model-len 99")
    args = extract_vllm.server_args(cfg, tmp_path / "work", num_layers=8, max_model_len=50, cpu=False)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5, 8]
    assert kv["kv_connector_module_path"] == "eagle3pipe.vllm_connector"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str((tmp_path / "work").resolve())
    assert "--no-enable-prefix-caching" in args and "--no-enable-chunked-prefill" not in args
    assert args.count("--max-model-len") == 1 and args[-4:] == ["--tensor-parallel-size", "8", "--max-model-len", "99"]
    assert "--gpu-memory-utilization" in args  # the connector's copies are not in vLLM's memory profile
    cpu = extract_vllm.server_args(make_cfg(tmp_path, toy_llama, backend="vllm"), tmp_path, 8, 50, cpu=True)
    assert "--no-enable-chunked-prefill" in cpu and cpu[cpu.index("--max-model-len") + 1] == "50"


@pytest.mark.parametrize("extract, fragment", [
    ({"backend": "sglang"}, "extract.backend must be"),
    ({"extract_url": ["http://a:1"]}, "for extract.backend: vllm"),
    ({"backend": "vllm", "extract_url": ["http://a:1/v1"]}, "without /v1"),
])
def test_extract_backend_settings_are_checked_at_start(tmp_path, toy_llama, extract, fragment):
    from eagle3pipe.config import ConfigError

    with pytest.raises(ConfigError, match=fragment):
        make_cfg(tmp_path, toy_llama, **extract).validate("extract")


def _door(data_dir: Path, verifier: Path, *flags: str, aux: list[int] = AUX) -> int:
    """Stage 02 through its door (cli.run_stage, flags as on the command line); returns the exit status."""
    argv = ["--data-dir", str(data_dir), "--verifier", str(verifier), "--input", "prepared", "--aux-layer-ids",
            *map(str, aux), "--hidden-size", "128", "--device", "cpu", "--writer-threads", "2", *flags]
    return run_stage("extract", extract_mod.STAGE, run_extract, None, argv)


def test_storage_dtype_is_what_is_written_and_the_preflight_counts_those_bytes(tmp_path, toy_llama):
    rows = write_rows(tmp_path, 5)
    dd = DataDir(tmp_path)
    assert _door(tmp_path, toy_llama, "--model-dtype", "float32", "--storage-dtype", "bf16") == 0
    manifest = load_hs_manifest(dd.hs_manifest)
    assert (manifest.model_dtype, manifest.storage_dtype) == ("float32", "bf16")
    written = 0
    for i, row in enumerate(rows):
        with safe_open(str(dd.hs_file(i)), "pt") as f:
            assert f.get_tensor("hidden_states").dtype == torch.bfloat16  # what the manifest says
        written += dd.hs_file(i).stat().st_size
    assert manifest.bytes == written
    # the preflight's figure is the bytes written (+ at most one header bound per file), not half or double
    from eagle3pipe.records import HS_FILE_HEADER_BYTES

    line = next(x for x in dd.log_file(extract_mod.STAGE).read_text().splitlines() if "disk preflight" in x)
    need = int(line.split(" bytes (")[0].rsplit(" ", 1)[1])
    assert written <= need <= written + len(rows) * HS_FILE_HEADER_BYTES
    tokens = sum(len(r["input_ids"]) for r in rows)
    assert tokens * 4 * 128 * 2 < written < tokens * 4 * 128 * 4  # 2 bytes per value on disk, not float32's 4


def test_changed_settings_on_resume_are_named(tmp_path, toy_llama, capsys):
    write_rows(tmp_path, 3)
    assert _door(tmp_path, toy_llama, "--model-dtype", "float32") == 0
    capsys.readouterr()
    assert _door(tmp_path, toy_llama, "--model-dtype", "bfloat16", aux=[1, 4, 5]) == 2
    err = capsys.readouterr().err
    assert "model_dtype: 'float32' then, 'bfloat16' now" in err and "aux_layer_ids: [2, 4, 5] then" in err
    assert "--overwrite" in err
    # an interrupted run (no manifest yet, only work/run.json) is checked the same way
    DataDir(tmp_path).hs_manifest.unlink()
    assert _door(tmp_path, toy_llama, "--model-dtype", "float32", "--storage-dtype", "fp8") == 2
    assert "storage_dtype: 'bf16' then, 'fp8' now" in capsys.readouterr().err


# -- issue 26 item 12: hidden_states/ of the format before each file carried its layer ids --------------------------


def _as_format_1(dd: DataDir, keep_metadata: bool) -> dict[str, bytes]:
    """Make a finished hidden_states/ look as an eagle3pipe before the layer metadata wrote it: manifest format 1,
    and (unless ``keep_metadata``: the outputs written between that change and the format bump) files without
    metadata. Returns the files' bytes."""
    from safetensors.torch import load_file

    from eagle3pipe.records import save_tensors_atomic

    if not keep_metadata:
        for path in dd.hs_files.glob("hs_*.safetensors"):
            data = load_file(str(path))
            save_tensors_atomic(path, {k: v.contiguous() for k, v in data.items()})
    manifest = json.loads(dd.hs_manifest.read_text())
    dd.hs_manifest.write_text(json.dumps({**manifest, "format_version": 1}))
    return {p.name: p.read_bytes() for p in dd.hs_files.glob("*.safetensors")}


def test_hidden_states_of_format_1_are_refused_at_start_or_upgraded(tmp_path, toy_llama, capsys):
    """An output whose files carry no layer ids (written before they did) used to pass 02 ("already finished") and
    04's start checks, then stop 04 at its first batch blaming the vLLM connector. Now 02 checks every file of a
    format-1 output: one without layer ids stops it, naming the file and --overwrite; 04 refuses it at start, naming
    02. An output whose files all carry them (written between that change and the format bump) is upgraded by 02
    in place, nothing extracted again, and 04 trains on it."""
    from eagle3pipe.train import run_train
    from eagle3pipe.vocab import run_vocab

    rows = write_rows(tmp_path, 6, max_len=40)
    dd = DataDir(tmp_path)
    assert _door(tmp_path, toy_llama, "--model-dtype", "float32") == 0
    config = tmp_path / "config.yaml"  # 03 and 04 read the rows and dtypes 02 used from the extract section
    config.write_text(json.dumps({"extract": {"input": "prepared", "model_dtype": "float32"}}))
    flags = ["--config", str(config), "--data-dir", str(tmp_path), "--verifier", str(toy_llama), "--vocab-size",
             "1088", "--draft-vocab-size", "256", "--aux-layer-ids", *map(str, AUX), "--hidden-size", "128",
             "--max-seq-len", "64"]
    assert run_stage("vocab", "03_build_vocab_mapping", run_vocab, None, flags) == 0
    train = flags + ["--device", "cpu", "--epochs", "1", "--total-seq-len", "64", "--eval-fraction", "0",
                     "--num-workers", "0", "--draft-num-heads", "4", "--draft-head-dim", "64",
                     "--draft-intermediate-size", "256", "--max-steps", "1"]
    capsys.readouterr()

    before = _as_format_1(dd, keep_metadata=False)
    assert run_stage("train", "04_train", run_train, None, train) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: {dd.hs_manifest}: hidden states of format 1, written before each sample file "
                          "recorded the layer ids it holds"), err
    assert "rerun 02_extract_hidden_states.py with the same settings" in err and "--overwrite" in err
    assert not dd.train_metrics.exists()  # refused before anything trained
    assert _door(tmp_path, toy_llama, "--model-dtype", "float32") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: {dd.hs_file(0)}: no layer ids in its metadata"), err
    assert "--overwrite" in err
    assert {p.name: p.read_bytes() for p in dd.hs_files.glob("*.safetensors")} == before
    assert json.loads(dd.hs_manifest.read_text())["format_version"] == 1  # left as it was

    assert _door(tmp_path, toy_llama, "--model-dtype", "float32", "--overwrite") == 0  # the fix it names
    capsys.readouterr()
    before = _as_format_1(dd, keep_metadata=True)
    assert _door(tmp_path, toy_llama, "--model-dtype", "float32") == 0
    assert load_hs_manifest(dd.hs_manifest).format_version == 2
    assert {p.name: p.read_bytes() for p in dd.hs_files.glob("*.safetensors")} == before  # nothing re-extracted
    assert run_stage("train", "04_train", run_train, None, train) == 0, capsys.readouterr().err
    assert len(rows) == load_hs_manifest(dd.hs_manifest).num_samples
