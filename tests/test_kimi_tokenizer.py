"""The release-shaped tokenizer: Kimi-K2.5's file layout, special-id block and pre-tokenizer, loaded the way the
release is (remote code, a slow tokenizer).

Independent references: ids come from ``tiktoken`` itself, built here from the folder's ``tiktoken.model`` with
Kimi's pre-tokenizer regex written out in this file (not imported from the package); the regex's split is
cross-checked with the ``regex`` module; and a generic split regex is shown to give other ids, so the check would
catch a tokenizer that is not the model's.
"""

from __future__ import annotations

import base64
import json
import shutil

import pytest
import regex
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from eagle3pipe.chat import ChatError, encode, load_tokenizer

# Kimi's pre-tokenizer, as the released tokenization_kimi.py states it.
KIMI_REGEX = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
# A generic GPT-style split (what transformers uses when it converts tiktoken.model by itself).
GENERIC_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CODE_CJK = "getHiddenStates 你好abc"
SAMPLES = [
    CODE_CJK,
    "def getUserName(requestId):\n    return self.userNames[requestId]  # 12345678 tokens\n\n\n",
    "数字四十二 is 42; こんにちは世界 and 데이터, naïve café — ok?",
    "   leading spaces\t\ttabs\r\nCRLF lines\n" + "x" * 300,
]
# Ids of the released Kimi-K2.5 tokenizer (REFERENCE.md); the toy keeps their offsets from its first special id.
RELEASE_IDS = {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
               "<|im_assistant|>": 163588, "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595,
               "<|tool_call_end|>": 163599, "<|im_middle|>": 163601, "<think>": 163606, "</think>": 163607,
               "[PAD]": 163839}
RELEASE_FIRST_SPECIAL = 163584


def _encoding(folder, pattern: str) -> tiktoken.Encoding:
    return tiktoken.Encoding("reference", pat_str=pattern, mergeable_ranks=load_tiktoken_bpe(str(folder / "tiktoken.model")),
                             special_tokens={})


def test_folder_is_laid_out_like_the_release(toy_kimi, toy_kimi_meta):
    names = {p.name for p in toy_kimi.iterdir()}
    assert {"tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py", "chat_template.jinja"} <= names
    # transformers looks for a fast tokenizer file by substring: no file name may contain "tokenizer.json"
    assert not [n for n in names if "tokenizer.json" in n]
    lines = (toy_kimi / "tiktoken.model").read_text().splitlines()
    tokens = [base64.b64decode(line.split()[0]) for line in lines]
    assert [int(line.split()[1]) for line in lines] == list(range(len(lines)))  # tiktoken's format: token, rank
    assert len(set(tokens)) == len(tokens) and set(bytes([b]) for b in range(256)) <= set(tokens)
    cfg = json.loads((toy_kimi / "tokenizer_config.json").read_text())
    assert cfg["auto_map"]["AutoTokenizer"][0] == "tokenization_kimi.TikTokenTokenizer"
    added = {a["content"]: int(i) for i, a in cfg["added_tokens_decoder"].items()}
    first = len(lines)  # the reserved block of 256 specials follows the BPE ranks, as in the release
    assert sorted(added.values()) == list(range(first, first + 256))
    for name, release_id in RELEASE_IDS.items():
        assert added[name] - first == release_id - RELEASE_FIRST_SPECIAL, name
    assert toy_kimi_meta["think_token_id"] == added["<think>"] and toy_kimi_meta["response_token_id"] == added["</think>"]
    model_cfg = json.loads((toy_kimi / "config.json").read_text())
    assert model_cfg["text_config"]["vocab_size"] == first + 256
    assert model_cfg["text_config"]["model_type"] == "kimi_k2"  # as released


def test_loads_only_as_remote_code(toy_kimi):
    with pytest.raises(ChatError, match="trust_remote_code: true"):
        load_tokenizer(toy_kimi)
    tok = load_tokenizer(toy_kimi, trust_remote_code=True)
    assert type(tok).__name__ == "TikTokenTokenizer" and not tok.is_fast
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [tok.vocab_size - 256 + 22, tok.vocab_size - 256 + 23]


def test_code_and_cjk_tokenize_as_tiktoken_with_kimis_regex(toy_kimi):
    assert regex.findall(KIMI_REGEX, CODE_CJK, flags=regex.V1) == ["get", "Hidden", "States", " ", "你好", "abc"]
    kimi, generic = _encoding(toy_kimi, KIMI_REGEX), _encoding(toy_kimi, GENERIC_REGEX)
    tok = load_tokenizer(toy_kimi, trust_remote_code=True)
    for text in SAMPLES:
        assert encode(tok, text) == kimi.encode_ordinary(text), text
        assert tok.decode(encode(tok, text)) == text
    # the reference discriminates: a generic split gives other ids on code/CJK text
    assert generic.encode_ordinary(CODE_CJK) != kimi.encode_ordinary(CODE_CJK)


def test_rendered_chat_special_tokens_become_their_ids(toy_kimi):
    tok = load_tokenizer(toy_kimi, trust_remote_code=True)
    text = tok.apply_chat_template([{"role": "user", "content": "你好 getX"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_user|>user<|im_middle|>你好 getX<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    kimi = _encoding(toy_kimi, KIMI_REGEX)
    sid = tok.convert_tokens_to_ids
    expected = ([sid("<|im_user|>")] + kimi.encode_ordinary("user") + [sid("<|im_middle|>")]
                + kimi.encode_ordinary("你好 getX") + [sid(t) for t in ("<|im_end|>", "<|im_assistant|>")]
                + kimi.encode_ordinary("assistant") + [sid("<|im_middle|>"), sid("<think>")])
    assert encode(tok, text) == expected


def test_tiktoken_folder_without_its_code_is_refused(toy_kimi, tmp_path):
    """Without auto_map transformers converts tiktoken.model itself with a generic regex: other ids, silently."""
    for name in ("tiktoken.model", "chat_template.jinja"):
        shutil.copy(toy_kimi / name, tmp_path / name)
    cfg = json.loads((toy_kimi / "tokenizer_config.json").read_text())
    del cfg["auto_map"], cfg["tokenizer_class"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    from transformers import AutoTokenizer

    converted = AutoTokenizer.from_pretrained(str(tmp_path))
    assert encode(converted, CODE_CJK) == _encoding(toy_kimi, GENERIC_REGEX).encode_ordinary(CODE_CJK)  # the trap
    with pytest.raises(ChatError, match="not the model's"):
        load_tokenizer(tmp_path, trust_remote_code=True)
