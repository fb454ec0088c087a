"""vLLM and transformers compute the same Kimi-K2.5-shaped model: prompt log-probs of the toy K2.5 agree.

Stage 02 extracts hidden states with transformers while the draft is served next to vLLM's verifier; if the two
engines read a DeepSeek-V3 / K2.5 config field differently (rope interleave, YaRN mscale in the softmax scale,
router scaling and normalisation, shared expert, MLA latent), the draft learns states the server never computes.
The toy K2.5 (MLA 512 + 64, 1 dense + 7 MoE layers, YaRN x64 rope, sigmoid/noaux_tc router, all as the release's
text_config) is computed in fp32 by both engines from the same weights (the session's toy, served in fp32 by
conftest's vllm_server_k25, which test_generate_vllm.py shares), so the comparison has no bf16 noise: the engines
agree to 1e-4 nats here, while each wrong convention tried below moves the median by 0.5 nats or more.
(Until 2026-12-06 this file built an fp32 toy and started a server of its own for it: one K2.5 server start more.)
"""

from __future__ import annotations

import json

import pytest
import torch

from eagle3pipe.vllm_client import api_base
from eagle3pipe.toy import RELEASE_ROUTER

# Agreement bounds, in nats per prompt token. The llama toy meets them even in bf16 (median 0.009); fp32 MLA+MoE
# measured 0.0000 (median and max); every wrong convention below gives a median >= 0.5.
MEDIAN_TOL = 0.02
P95_TOL = 0.1
WRONG_CONVENTION_MIN_MEDIAN = 0.1  # a wrong convention must miss by at least this much (5x MEDIAN_TOL)


def _prompts(model_dir) -> list[list[int]]:
    """A chat rendered with the toy's K2.5 template (special tokens, <think>) and a seeded run of BPE ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=True)  # the release's tokenizer layout
    messages = [{"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": "What is 37 + 58? Then sort [9, 2, 5] and explain why."}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    gen = torch.Generator().manual_seed(7)
    bpe = torch.randint(0, 1000, (64,), generator=gen).tolist()
    return [list(chat), bpe]


def _vllm_prompt_logprobs(server, prompts: list[list[int]]) -> list[torch.Tensor]:
    """vLLM's log-prob of each prompt token given the ones before it (``prompt_logprobs``), positions 1..T-1."""
    from openai import OpenAI

    client = OpenAI(base_url=api_base(server.url), api_key="EMPTY", max_retries=0, timeout=120)
    out = []
    for ids in prompts:
        resp = client.completions.create(model=str(server.served_model_name), prompt=ids, max_tokens=1,
                                         temperature=0.0, extra_body={"prompt_logprobs": 0})
        entries = resp.choices[0].model_extra["prompt_logprobs"]
        assert len(entries) == len(ids) and entries[0] is None
        out.append(torch.tensor([entries[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]))
    return out


def _hf_prompt_logprobs(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]
            out.append(logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0])  # [T-1]
    return out


def _gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    diff = (torch.cat(a) - torch.cat(b)).abs()
    return float(diff.median()), float(diff.quantile(0.95))


def _text_model(model_dir, **overrides):
    """transformers' DeepseekV3 text model of the toy K2.5, with config fields optionally changed."""
    from transformers import AutoConfig, DeepseekV3ForCausalLM

    cfg = AutoConfig.from_pretrained(str(model_dir)).text_config
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return DeepseekV3ForCausalLM.from_pretrained(str(model_dir), config=cfg, dtype=torch.float32,
                                                 key_mapping={r"^language_model\.": ""}).eval()


@pytest.mark.integration
def test_k25_toy_prompt_logprobs_match_transformers(vllm_server_k25, toy_kimi):
    from transformers import AutoModelForImageTextToText

    prompts = _prompts(toy_kimi)
    served = _vllm_prompt_logprobs(vllm_server_k25, prompts)

    # The whole K2.5 model as transformers loads the checkpoint (nested config, language_model.* weights).
    reference = AutoModelForImageTextToText.from_pretrained(str(toy_kimi), dtype=torch.float32).eval()
    median, p95 = _gap(served, _hf_prompt_logprobs(reference, prompts))
    assert median <= MEDIAN_TOL and p95 <= P95_TOL, f"vLLM vs transformers: median {median:.4f}, p95 {p95:.4f} nats"

    # The bounds would catch an engine that reads a convention differently: transformers with one field changed.
    softmax_scale_without_yarn = _text_model(toy_kimi)
    for layer in softmax_scale_without_yarn.model.layers:
        layer.self_attn.scaling = layer.self_attn.qk_head_dim ** -0.5  # drop the mscale_all_dim factor (x2.0)
    wrong = {
        "rope not interleaved (neox)": _text_model(toy_kimi, rope_interleave=False),
        "routed_scaling_factor ignored": _text_model(toy_kimi, routed_scaling_factor=1.0),
        "top-k weights not renormalised": _text_model(toy_kimi, norm_topk_prob=False),
        "softmax scale without YaRN mscale": softmax_scale_without_yarn,
    }
    for name, model in wrong.items():
        median_wrong, _ = _gap(served, _hf_prompt_logprobs(model, prompts))
        assert median_wrong >= WRONG_CONVENTION_MIN_MEDIAN, f"{name}: only {median_wrong:.4f} nats from vLLM"


def test_deepseek_v3_flavour_config_has_the_release_fields_vllm_reads(toy_deepseek, toy_kimi):
    """The plain DeepseekV3 flavour writes the same text config as the K2.5 one (served above), router and rope
    included: without ``topk_method``/``scoring_func`` vLLM builds a softmax router and fails to start (KeyError on
    ``mlp.gate.e_score_correction_bias``)."""
    plain = json.loads((toy_deepseek / "config.json").read_text())
    text = json.loads((toy_kimi / "config.json").read_text())["text_config"]
    for key, value in RELEASE_ROUTER.items():
        assert plain[key] == text[key] == value, key
    assert plain["rope_scaling"] == text["rope_scaling"] and plain["rope_scaling"]["type"] == "yarn"
    assert plain["rope_theta"] == text["rope_theta"] and plain["max_position_embeddings"] == 262144
    assert "rope_parameters" not in plain  # written in the release's legacy keys, read back by both engines
    # the tokenizer layouts differ (fast toy vs release-shaped): vocabulary size and special ids
    ignored = {"architectures", "dtype", "model_type", "transformers_version", "vocab_size", "bos_token_id",
               "eos_token_id"}
    assert {k: v for k, v in plain.items() if k not in ignored} == {k: v for k, v in text.items() if k not in ignored}
