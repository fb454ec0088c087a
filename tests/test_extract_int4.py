"""Kimi-K2.5's release format on a toy: routed experts int4 in compressed-tensors' pack-quantized layout (symmetric,
group 32, everything else bf16, quantization_config at the top of a kimi_k25 config, weights under
language_model.*). The compressed-tensors package quantises the toy offline; the stage's loader must load it through
transformers' compressed-tensors integration to exactly the model whose expert weights are the dequantised values."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3pipe.verifier import AuxStateCapture, load_text_model

from test_extract import AUX

EXPERT_WEIGHT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")

# Shaped like the K2.5 release's quantization_config: int4 routed experts, the rest left in bf16.
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                    "dynamic": False, "observer": "minmax"},
        "input_activations": None, "output_activations": None, "format": "pack-quantized"}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
               "re:vision_tower.*", "re:mm_projector.*"],
}


def quantize_toy(src: Path, int4_dir: Path, dequantized_dir: Path) -> int:
    """Write the int4 checkpoint and a bf16 twin holding the dequantised expert weights. Returns experts quantised."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    for d in (int4_dir, dequantized_dir):
        shutil.copytree(src, d)
    args = QuantizationArgs(**QUANTIZATION_CONFIG["config_groups"]["group_0"]["weights"])
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    packed, dequantized, n = {}, {}, 0
    for key, w in load_file(str(src / "model.safetensors")).items():
        if not EXPERT_WEIGHT.match(key):
            packed[key] = dequantized[key] = w
            continue
        groups = w.float().view(w.shape[0], -1, args.group_size)  # [out, in / 32, 32]
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)  # [out, in / 32]
        compressed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale.to(w.dtype)}, scheme)
        prefix = key.removesuffix("weight")
        packed.update({prefix + name: t for name, t in compressed.items()})  # weight_packed/_scale/_shape
        dequantized[key] = PackedQuantizationCompressor.decompress(dict(compressed), scheme)["weight"].to(w.dtype)
        n += 1
    save_file(packed, str(int4_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(dequantized_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((int4_dir / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (int4_dir / "config.json").write_text(json.dumps(config, indent=2))
    return n


def test_kimi_k25_int4_compressed_tensors_toy_loads_exactly(tmp_path, toy_kimi):
    n = quantize_toy(toy_kimi, tmp_path / "int4", tmp_path / "dequantized")
    assert n == 7 * 8 * 3  # 7 MoE layers x 8 experts x (gate, up, down)
    keys = load_file(str(tmp_path / "int4" / "model.safetensors"))
    packed = [k for k in keys if k.endswith("weight_packed")]
    assert packed and all(k.startswith("language_model.model.layers.") for k in packed)
    assert keys[packed[0]].dtype == torch.int32
    int4 = load_text_model(tmp_path / "int4", torch.bfloat16)
    reference = load_text_model(tmp_path / "dequantized", torch.bfloat16)
    original = load_text_model(toy_kimi, torch.bfloat16)
    got, want = int4.state_dict(), reference.state_dict()
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(3))
    states = AuxStateCapture(int4, AUX)(ids)
    torch.testing.assert_close(states, AuxStateCapture(reference, AUX)(ids), rtol=0, atol=0)
    # and int4 really changed the experts (the test would not notice a load that ignored the packed weights)
    assert not torch.equal(got["layers.1.mlp.experts.gate_up_proj"], original.state_dict()["layers.1.mlp.experts.gate_up_proj"])
