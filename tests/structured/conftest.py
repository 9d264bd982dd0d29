"""The built-in model's tokenizer and a grammar compiler over it, shared by the
grammar tests of this directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from ec_frontend.engine.structured_output import GrammarCompiler
from transformers import AutoTokenizer

VOCAB = 576  # the built-in model's logits (its tokenizer has fewer tokens)


@pytest.fixture(scope="module")
def tokenizer(builtin_model_dir: Path):
    return AutoTokenizer.from_pretrained(builtin_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])
