"""Remote-code tokenizer of the release-shaped toy verifier, laid out like Kimi-K2.5's ``tokenization_kimi.py``.

``eagle3pipe.toy`` copies this file verbatim into a toy folder as ``tokenization_kimi.py`` and names its class in
``tokenizer_config.json``'s ``auto_map``, so transformers and vLLM load it exactly as they load the release's
tokenizer: with ``trust_remote_code=True``, as a slow (Python) tokenizer. Written for this project from the
release's published facts (no code copied):

- ``tiktoken.model`` holds the byte-level BPE: one ``base64(token bytes) rank`` line per token;
- text is split with Kimi's pre-tokenizer regex before BPE (CJK runs apart from other letters, camelCase pieces,
  digit runs of at most 3), which tiktoken's regex engine runs (it needs ``&&`` class intersection);
- 256 special tokens sit in a reserved block right after the BPE ranks; their names come from
  ``added_tokens_decoder`` in tokenizer_config.json, ``<|reserved_token_{id}|>`` for the unnamed ones.

Where the released class behaves differently from a plain ``PreTrainedTokenizer``, this one does the same:

- ``bos_token``, ``eos_token``, ``unk_token`` and ``pad_token`` must each name a token of the reserved block (the
  release looks them up there and fails with ``KeyError: 'None'`` on a missing one; here the error says which key),
  and ``additional_special_tokens`` defaults to the release's list (``<|start_header_id|>``, ``[EOT]``, ...); a
  name outside the block is refused here, where the release would append it as a new id past the model's rows;
- ``encode(text)`` with no other argument, and ``_tokenize``, run tiktoken with every special allowed: special-token
  text inside ordinary text becomes its special id; text is fed to tiktoken in 400 000-character cuts, each split
  further at same-class runs longer than 25 000 characters (the release's limits, so ids agree on long texts);
- ``apply_chat_template`` sorts ``tools`` recursively by key and passes their TypeScript-style rendering
  (``tool_declaration_ts.py``, copied beside this file) as ``tools_ts_str``, with the release's defaults
  (``tokenize=False``, ``add_generation_prompt=True``, ``thinking=True``, ``preserve_thinking=False``).

It imports only tiktoken, transformers and its sibling ``tool_declaration_ts`` (a remote-code module is loaded
outside this package; transformers copies relative imports along).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from .tool_declaration_ts import encode_tools_to_typescript_style

log = logging.getLogger(__name__)

NUM_RESERVED_SPECIAL_TOKENS = 256
# The release's default additional specials (all named in its reserved block).
DEFAULT_ADDITIONAL_SPECIAL_TOKENS = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                     "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>")

# Kimi's pre-tokenizer: Han runs; letter runs split at lower->upper case changes (with English contractions); digit
# runs of 1-3; punctuation runs (with trailing newlines); newline runs; other whitespace.
KIMI_PAT_STR = "|".join([
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

# tiktoken panics on one call over ~400k characters, and its regex engine recurses per character of a run, so very
# long runs of one class overflow its stack (openai/tiktoken#195): the release feeds text to it in fixed 400 000-
# character cuts, each split again where a whitespace or non-whitespace run passes 25 000 characters. The cuts
# change ids where they split a token, so they are the release's, at the release's positions.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000


def _split_runs(text: str):
    """``text`` in order, cut so no piece holds a same-class (space / non-space) run longer than MAX_RUN_CHARS."""
    start, run, prev_space = 0, 0, None
    for i, ch in enumerate(text):
        space = ch.isspace()
        run = run + 1 if space == prev_space else 1
        prev_space = space
        if run > MAX_RUN_CHARS:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]


def _pieces(text: str):
    """The pieces tiktoken encodes one at a time: fixed MAX_ENCODE_CHARS cuts, each split at over-long runs."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        yield from _split_runs(text[start:start + MAX_ENCODE_CHARS])


def deep_sort(obj):
    """``obj`` with every dict's keys sorted, at any depth (lists keep their order), as the release sorts tools."""
    if isinstance(obj, dict):
        return {k: deep_sort(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [deep_sort(v) for v in obj]
    return obj


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, bos_token="[BOS]", eos_token="[EOS]", unk_token=None, pad_token=None,
                 additional_special_tokens: list | None = None, added_tokens_decoder: dict | None = None, **kwargs):
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        num_base = len(ranks)
        named = {int(i): getattr(t, "content", t) for i, t in (added_tokens_decoder or {}).items()}
        specials = {named.get(i, f"<|reserved_token_{i}|>"): i
                    for i in range(num_base, num_base + NUM_RESERVED_SPECIAL_TOKENS)}
        config = Path(vocab_file).with_name("tokenizer_config.json")
        for key, token in (("bos_token", bos_token), ("eos_token", eos_token), ("unk_token", unk_token),
                           ("pad_token", pad_token)):
            if token is None or str(token) not in specials:
                shown = None if token is None else str(token)
                raise ValueError(f"{config}: {key} is {shown!r}, which names no token of the reserved special block "
                                 f"(ids {num_base}-{num_base + NUM_RESERVED_SPECIAL_TOKENS - 1} in "
                                 "added_tokens_decoder); Kimi's tokenizer looks it up there (the release stops with "
                                 f"KeyError: {str(token)!r}): name it, as the release does"
                                 + (' ("[UNK]" at offset 254)' if key == "unk_token" else ""))
        if additional_special_tokens is None:
            # transformers 5 saves them as extra_special_tokens
            additional_special_tokens = (kwargs.pop("extra_special_tokens", None)
                                         or list(DEFAULT_ADDITIONAL_SPECIAL_TOKENS))
        unnamed = [str(t) for t in additional_special_tokens if str(t) not in specials]
        if unnamed:
            raise ValueError(f"{config}: additional special tokens {unnamed} are not named in the reserved special "
                             "block (added_tokens_decoder): they would get new ids past the model's embedding rows")
        self.model = tiktoken.Encoding(name=Path(vocab_file).name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                       special_tokens=specials)
        # Token strings are the bytes shown through GPT-2's byte-to-unicode table, as every byte-level BPE in
        # transformers spells them (special tokens are ASCII, so they read as themselves).
        byte_to_char = bytes_to_unicode()
        self._char_to_byte = {c: b for b, c in byte_to_char.items()}
        self._id_to_token = ["".join(byte_to_char[b] for b in self.model.decode_single_token_bytes(i))
                             for i in range(self.model.n_vocab)]
        self._token_to_id = {t: i for i, t in enumerate(self._id_to_token)}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         additional_special_tokens=additional_special_tokens,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self._token_to_id)

    def encode(self, text, *args, **kwargs):
        """As the release: ``encode(text)`` alone is tiktoken over the whole text, specials allowed, no BOS added;
        with any other argument, the base class's ``encode`` (which splits off added tokens, then ``_tokenize``)."""
        if args or kwargs or not isinstance(text, str):
            return super().encode(text, *args, **kwargs)
        return [i for piece in _pieces(text) for i in self.model.encode(piece, allowed_special="all")]

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        # The base class has split off added tokens already, unless split_special_tokens: special-token text left
        # here still becomes the special id, as in the release.
        return [self._id_to_token[i] for i in self.encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self._token_to_id.get(token, self.unk_token_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self._id_to_token[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(self._char_to_byte[c] for c in "".join(tokens)).decode("utf-8", errors="replace")

    def apply_chat_template(self, conversation, tools: list[dict] | None = None, tokenize: bool = False,
                            add_generation_prompt: bool = True, thinking: bool = True, preserve_thinking: bool = False,
                            **kwargs):
        """The template with the release's defaults; ``tools`` sorted by key at every depth, and declared to the
        template also as ``tools_ts_str`` (TypeScript style), which K2.5's template prefers to the JSON."""
        tools = deep_sort(tools)
        if tools:
            try:
                kwargs["tools_ts_str"] = encode_tools_to_typescript_style(tools)
            except Exception as e:  # the release falls back to the JSON declaration too
                log.warning("tools not rendered TypeScript-style (%s): declared as JSON", e)
        return super().apply_chat_template(conversation, tools=tools, tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt, thinking=thinking,
                                           preserve_thinking=preserve_thinking, **kwargs)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(out) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, out)
        return (out,)
