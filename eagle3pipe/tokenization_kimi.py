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

It imports only tiktoken and transformers (a remote-code module is loaded outside this package).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

NUM_RESERVED_SPECIAL_TOKENS = 256

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

# tiktoken's regex engine recurses per character of a run: very long runs of one class overflow its stack
# (openai/tiktoken#195), so text is fed to it in pieces that end at whitespace/non-whitespace changes.
MAX_RUN_CHARS = 25_000


def _pieces(text: str):
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


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, bos_token="[BOS]", eos_token="[EOS]", unk_token=None, pad_token=None,
                 added_tokens_decoder: dict | None = None, **kwargs):
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        num_base = len(ranks)
        named = {int(i): getattr(t, "content", t) for i, t in (added_tokens_decoder or {}).items()}
        specials = {named.get(i, f"<|reserved_token_{i}|>"): i
                    for i in range(num_base, num_base + NUM_RESERVED_SPECIAL_TOKENS)}
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
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self._token_to_id)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        # Special tokens were split off by the base class (they are all added tokens); the rest is plain text.
        return [self._id_to_token[i] for piece in _pieces(text) for i in self.model.encode_ordinary(piece)]

    def _convert_token_to_id(self, token: str) -> int:
        return self._token_to_id.get(token, self.unk_token_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self._id_to_token[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(self._char_to_byte[c] for c in "".join(tokens)).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(out) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, out)
        return (out,)
