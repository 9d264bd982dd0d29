"""Sampling parameters from the Rust parser equal those of a pydantic mirror of vLLM's
``ChatCompletionRequest`` (``vllm_mirror.py``: the sampling fields, and the whole field
list with vLLM's "before" validators), and they refuse the same bodies."""

from __future__ import annotations

import json
import random
from typing import Any

import ec_frontend as ecf
import pydantic
import pytest

from .vllm_mirror import ChatCompletionRequest, FullChatCompletionRequest

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
ABSENT = object()

# Values per field, valid and invalid, that a typed client could send.
CHOICES: dict[str, list[Any]] = {
    "temperature": [None, 0, 0.0, 1e-6, 0.7, 1, 2, 2.5, -0.1, "0.5", " 1e-1", "hot", True],
    "top_p": [None, 0.1, 1, 0, 1.2],
    "top_k": [None, -1, 0, 5, -2],
    "min_p": [None, 0, 0.5, 1.5],
    "max_tokens": [None, 1, 100, 0, -5, 7.0, "16", "16.0", "16.5", 1.5, True],
    "max_completion_tokens": [None, 3, 0],
    "n": [None, 1, 4, 0, 200, True, "2"],
    "seed": [None, 0, -1, 2**63 - 1, 2**63, -(2**63)],
    "stop": [None, "x", ["a", "b"], [], ["a", "b", "c", "d"], ["a", "b", "c", "d", "e"]],
    "stop_token_ids": [None, [], [1, 2], [-1], ["3", 4.0]],
    "presence_penalty": [None, -2, 0.5, 2.5],
    "frequency_penalty": [None, 2, -0.5, -3],
    "repetition_penalty": [None, 1.1, 0, -1],
    "logprobs": [None, True, False, "true", 0, 2],
    "top_logprobs": [None, 0, 3, 20, 21, -1],
    "prompt_logprobs": [None, 0, 2, -1, -2],
    "echo": [True, False],
    "stream": [None, True, False, 1, "yes", "off", 2],
    "stream_options": [None, {"include_usage": True}, {"include_usage": "1"}],
    "ignore_eos": [True, False, "y", 1.0],
    "skip_special_tokens": [True, False],
    "include_stop_str_in_output": [True, False],
    "logit_bias": [
        None,
        {},
        {"5": 10},
        {"7": 150, " 8 ": "-3.5", "1_0": True},
        {"x": 1},
        {"-1": 1},
    ],
    "allowed_token_ids": [None, [1, 2], [], ["3", 4.0], [-1]],
    "min_tokens": [0, 2, "3", -1, 500],
    "bad_words": [[], ["x"], ["a b", "a b", "c"], [""], "word"],
    "vllm_xargs": [None, {}, {"a": 1}, {"kv_transfer_params": "old", "b": [1]}],
    "kv_transfer_params": [None, {}, {"do_remote_decode": True}],
    "ec_transfer_params": [None, {}, {"ab12": {"peer_port": 5501}}],
}

HANDWRITTEN: list[dict[str, Any]] = [
    {},
    {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "max_tokens": 64, "seed": 1},
    {"temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1},
    {"max_tokens": 10, "max_completion_tokens": 20},
    {"logprobs": True, "top_logprobs": 5, "echo": True},
    {"logprobs": True},
    {"echo": True},
    {"stop": "###", "stop_token_ids": [7, 8], "include_stop_str_in_output": True},
    {"stream": True, "stream_options": {"include_usage": False}},
    {"vllm_xargs": {"x": 1}, "kv_transfer_params": {}, "ec_transfer_params": {}},
    {"kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1, 2]}},
    {"n": 2, "presence_penalty": -1.5, "frequency_penalty": 1.5, "repetition_penalty": 1.2},
    {"ignore_eos": True, "skip_special_tokens": False, "user": "u"},
    {"prompt_logprobs": 3},
    {"top_logprobs": 2},
    {"stream": True, "prompt_logprobs": 1},
]


def _generated(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        fields = {}
        for name, values in CHOICES.items():
            if rng.random() < 0.3:
                fields[name] = rng.choice(values)
        out.append(fields)
    return out


CORPUS = HANDWRITTEN + _generated(1000, seed=20261129)


def _ours(body: bytes) -> dict[str, Any] | None:
    try:
        return ecf.parse_request("chat", body).sampling
    except ecf.RequestError:
        return None


def _mirror(model: type[ChatCompletionRequest], body: bytes) -> dict[str, Any] | None:
    try:
        return model.model_validate_json(body).to_sampling_params()
    except (pydantic.ValidationError, ValueError):
        return None


def _types(d: dict[str, Any]) -> dict[str, type]:
    return {k: type(v) for k, v in d.items()}


@pytest.mark.parametrize("fields", CORPUS, ids=[f"req{i}" for i in range(len(CORPUS))])
def test_sampling_params_match_the_vllm_mirror(fields: dict[str, Any]) -> None:
    body = json.dumps({"model": "m", "messages": MESSAGES, **fields}).encode()
    ours = _ours(body)
    for model in (ChatCompletionRequest, FullChatCompletionRequest):
        mirror = _mirror(model, body)
        assert (ours is None) == (mirror is None), (model.__name__, fields, ours, mirror)
        if ours is not None and mirror is not None:
            assert ours == mirror, model.__name__
            assert _types(ours) == _types(mirror), model.__name__


def test_corpus_exercises_both_outcomes() -> None:
    bodies = [json.dumps({"messages": MESSAGES, **f}).encode() for f in CORPUS]
    accepted = sum(_ours(b) is not None for b in bodies)
    assert accepted >= 100 and len(bodies) - accepted >= 100
