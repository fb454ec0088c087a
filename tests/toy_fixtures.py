"""Session-scoped factory fixtures for the toy verifier kit (loaded by pytest as a plugin, see pyproject.toml)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from eagle3pipe.toy import build_toy_verifier


def _toy(tmp_path_factory, flavour: str, dtype: str = "bfloat16") -> Path:
    """The toy, built once per process tree: a test run again in a fresh interpreter (tests/memory_bound.py) reads
    the one its parent built (same flavour, seed and dtype; ~2.6 s a build) through the environment it inherits."""
    env = f"EAGLE3PIPE_TEST_TOY_{flavour}_{dtype}"
    built = os.environ.get(env)
    if built and (Path(built) / "toy_verifier.json").is_file():
        return Path(built)
    path = build_toy_verifier(tmp_path_factory.mktemp(f"toy_{flavour}_{dtype}"), flavour, seed=0, dtype=dtype)
    os.environ[env] = str(path)
    return path


@pytest.fixture(scope="session")
def toy_llama(tmp_path_factory) -> Path:
    """Toy Llama verifier (bf16) with the Kimi-style tokenizer; see eagle3pipe/toy.py."""
    return _toy(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def toy_deepseek(tmp_path_factory) -> Path:
    """Toy DeepseekV3 (MLA + MoE) verifier (bf16)."""
    return _toy(tmp_path_factory, "deepseek_v3")


@pytest.fixture(scope="session")
def toy_kimi(tmp_path_factory) -> Path:
    """Toy DeepseekV3 wrapped like Kimi-K2.5 (nested text_config, language_model.* weights) with the release's
    tokenizer layout (tiktoken.model + remote-code tokenizer: load with trust_remote_code)."""
    return _toy(tmp_path_factory, "kimi_k25")


@pytest.fixture(scope="session")
def toy_meta(toy_llama) -> dict:
    """toy_verifier.json of the fast-tokenizer toys (llama, deepseek_v3): token ids, aux layer ids, sizes."""
    return json.loads((toy_llama / "toy_verifier.json").read_text())


@pytest.fixture(scope="session")
def toy_kimi_meta(toy_kimi) -> dict:
    """toy_verifier.json of the release-shaped kimi_k25 toy (its own tokenizer layout: other special ids)."""
    return json.loads((toy_kimi / "toy_verifier.json").read_text())
