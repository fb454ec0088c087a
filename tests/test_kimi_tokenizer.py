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
# Ids of the released Kimi-K2.5 tokenizer (REFERENCE.md, and the release's tokenizer_config.json for the headers,
# [EOT] and [UNK]); the toy keeps their offsets from its first special id.
RELEASE_IDS = {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
               "<|im_assistant|>": 163588, "<|start_header_id|>": 163590, "<|end_header_id|>": 163591,
               "[EOT]": 163593, "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595,
               "<|tool_call_end|>": 163599, "<|im_middle|>": 163601, "<think>": 163606, "</think>": 163607,
               "[UNK]": 163838, "[PAD]": 163839}
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
    # the release's class looks these up among the reserved names (a None unk_token was its KeyError: 'None')
    assert [cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")] == [
        "[BOS]", "[EOS]", "[UNK]", "[PAD]"]
    assert {"tokenization_kimi.py", "tool_declaration_ts.py"} <= names  # the tokenizer and the module it imports
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


def _with_config(toy_kimi, folder, **changes):
    """A copy of the toy's tokenizer files with tokenizer_config.json keys changed."""
    folder.mkdir()
    for name in ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py", "tool_declaration_ts.py",
                 "chat_template.jinja"):
        shutil.copy(toy_kimi / name, folder / name)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(changes)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def test_unk_token_and_extra_specials_must_be_named_in_the_reserved_block(toy_kimi, tmp_path):
    """The release's class fails with ``KeyError: 'None'`` on a missing unk_token and appends unnamed additional
    specials as ids past the model's rows; ours says which key is wrong, in one line."""
    tok = load_tokenizer(toy_kimi, trust_remote_code=True)
    assert tok.unk_token == "[UNK]" and tok.unk_token_id == tok.vocab_size - 256 + 254
    assert tok.convert_tokens_to_ids("not-a-token") == tok.unk_token_id
    with pytest.raises(ChatError, match=r"failed to load: ValueError: .*unk_token is None, which names no token of "
                                        r"the reserved special block .*\[UNK\]") as e:
        load_tokenizer(_with_config(toy_kimi, tmp_path / "no_unk", unk_token=None), trust_remote_code=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ChatError, match=r"additional special tokens \['<\|not_reserved\|>'\] are not named"):
        load_tokenizer(_with_config(toy_kimi, tmp_path / "extra", additional_special_tokens=["<|not_reserved|>"]),
                       trust_remote_code=True)
    # the release's default additional specials are all named in the toy: none appended
    assert len(tok) == tok.vocab_size == json.loads((toy_kimi / "config.json").read_text())["text_config"]["vocab_size"]
    assert {"<|start_header_id|>", "<|end_header_id|>", "[EOT]"} <= set(tok.extra_special_tokens)


def _reference_with_specials(folder) -> tiktoken.Encoding:
    """tiktoken over the folder's files with every reserved special, as the release builds it (written out here)."""
    ranks = load_tiktoken_bpe(str(folder / "tiktoken.model"))
    named = {int(i): a["content"] for i, a in
             json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"].items()}
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(len(ranks), len(ranks) + 256)}
    return tiktoken.Encoding("reference", pat_str=KIMI_REGEX, mergeable_ranks=ranks, special_tokens=specials)


def test_special_token_text_in_ordinary_text_becomes_special_ids(toy_kimi):
    tok = load_tokenizer(toy_kimi, trust_remote_code=True)
    ref = _reference_with_specials(toy_kimi)
    text = "say <|im_end|> and [EOT] or <|reserved_token_1050|>, getX"
    expected = ref.encode(text, allowed_special="all")
    assert expected.count(tok.convert_tokens_to_ids("<|im_end|>")) == 1 and 1050 in expected
    assert tok.encode(text) == expected  # the release's encode(text): specials allowed, no BOS
    assert tok.convert_tokens_to_ids(tok._tokenize(text)) == expected  # _tokenize too, as the release's
    # even when the base class is told not to split specials off first
    assert tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] == expected
    assert encode(tok, text) == expected


def test_long_text_is_cut_where_the_release_cuts_it(toy_kimi):
    """400 000-character cuts, then same-class runs over 25 000 characters: a cut inside a word splits it, so ids
    differ from one uncut encoding; the reference applies the two documented rules itself."""
    tok = load_tokenizer(toy_kimi, trust_remote_code=True)
    ref = _reference_with_specials(toy_kimi)
    words = "hello world getHiddenStates 你好 " * 16_000  # 512 000 characters; position 400 000 is inside a word
    assert not words[399_999].isspace() and not words[400_000].isspace()
    expected = ref.encode_ordinary(words[:400_000]) + ref.encode_ordinary(words[400_000:])
    assert expected != ref.encode_ordinary(words)  # the cut matters
    assert tok.encode(words) == expected
    assert encode(tok, words) == expected
    run = "ab" * 15_000  # one 30 000-character non-space run: cut after 25 000 characters
    expected = ref.encode_ordinary(run[:25_000]) + ref.encode_ordinary(run[25_000:])
    assert tok.encode(run) == encode(tok, run) == expected


# A tool with what a declaration holds: required and optional fields, descriptions (one on two lines), an enum,
# integer bounds and a default, a nested object closed by additionalProperties, an array whose items carry a
# comment, anyOf and a type list. Keys deliberately unsorted.
SEARCH_TOOL = {"function": {"parameters": {"required": ["query"], "type": "object", "properties": {
    "when": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "query": {"minLength": 1, "type": "string", "description": "What to look for"},
    "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
    "lang": {"enum": ["en", "de"]},
    "filters": {"type": "object", "description": "Narrow it", "properties": {"site": {"type": "string"}},
                "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string", "description": "one tag"}},
    "score": {"type": ["number", "null"]}}},
    "name": "search", "description": "Search the web.\nReturns links."}, "type": "function"}
# Written by hand from the documented format (required first, then optional, each by name; two spaces a level).
SEARCH_TS = """# Tools

## functions
namespace functions {
// Search the web.
// Returns links.
type search = (_: {
  // What to look for
  // minLength: 1
  query: string,
  // Narrow it
  filters?: {
    site?: string,
    [k: string]: never
  },
  lang?: "en" | "de",
  // maximum: 50, minimum: 1
  // Default: 10
  limit?: number,
  score?: number | null,
  tags?: Array<
    // one tag
    string
  >,
  when?: string | null
}) => any;
}
"""


def test_tools_are_sorted_by_key_and_declared_typescript_style(toy_kimi):
    tok = load_tokenizer(toy_kimi, trust_remote_code=True)
    probe = "{{ tools | tojson }}|{{ tools_ts_str }}"  # what the template is handed
    handed = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[SEARCH_TOOL], chat_template=probe)
    as_json, ts = handed.split("|", 1)
    assert as_json == json.dumps([SEARCH_TOOL], sort_keys=True, ensure_ascii=False)  # sorted at every depth
    assert as_json != json.dumps([SEARCH_TOOL], ensure_ascii=False)
    assert ts == SEARCH_TS
    # the release's defaults: text, with the generation prompt, thinking on
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[SEARCH_TOOL])
    assert text == ("<|im_system|>tool_declare<|im_middle|>" + SEARCH_TS + "<|im_end|><|im_user|>user<|im_middle|>x"
                    "<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
