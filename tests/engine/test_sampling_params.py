"""SamplingParams: built from the parser's normalized dict, validated with parameter names."""

from __future__ import annotations

from typing import Any

import pytest
from ec_frontend.engine.sampling_params import SamplingParams, SamplingParamsError


def test_from_dict_takes_defaults_for_none() -> None:
    params = SamplingParams.from_dict(
        {"max_tokens": None, "temperature": None, "stop": ("a",), "seed": 3, "extra_args": None}
    )
    assert params.max_tokens is None and params.temperature == 1.0
    assert params.stop == ["a"] and params.seed == 3 and params.extra_args is None


@pytest.mark.parametrize(
    ("values", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [1, -5]}, "stop_token_ids[1]"),
        ({"max_tokens": True}, "max_tokens"),
        ({"extra_args": [1]}, "extra_args"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [2, -1]}, "allowed_token_ids[1]"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_invalid_values_name_the_parameter(values: dict[str, Any], param: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams.from_dict(values)
    assert info.value.param == param


def test_greedy_and_penalties_flags() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties


def test_seed_minus_one_is_no_seed() -> None:
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams.from_dict({"seed": -1}).seed is None
    assert SamplingParams(seed=-2).seed == -2
    assert SamplingParams(seed=0).seed == 0


def test_seed_minus_one_stays_unseeded_for_every_choice() -> None:
    from ec_frontend.entrypoints.openai.sampling import build_sampling_params

    assert [build_sampling_params({"seed": -1}, choice=i).seed for i in range(3)] == [None] * 3
    assert [build_sampling_params({"seed": 5}, choice=i).seed for i in range(3)] == [5, 6, 7]


def test_stop_token_ids_outside_the_vocabulary() -> None:
    params = SamplingParams(stop_token_ids=[3, 99, 100, 7])
    params.check_vocab(101)
    for vocab, bad in ((100, "[100]"), (99, "[99, 100]")):
        with pytest.raises(SamplingParamsError) as info:
            params.check_vocab(vocab)
        assert info.value.param == "stop_token_ids"
        assert bad in info.value.message


def test_refused_sampling_params_reserve_no_engine_request_id() -> None:
    import asyncio

    from ec_frontend._core import parse_request
    from ec_frontend.engine.mock import MockEngine
    from ec_frontend.entrypoints.http.errors import APIError
    from ec_frontend.entrypoints.openai.serving import Serving, ServingConfig
    from ec_frontend.metrics import ServerMetrics

    serving = Serving(
        MockEngine(),
        ServingConfig(("m",), 4096, offload_processing=False, vocab_size=100),
        ServerMetrics(),
    )
    body = b'{"prompt": "hi", "n": 2, "stop_token_ids": [100]}'
    with pytest.raises(APIError) as info:
        asyncio.run(serving.make_jobs(parse_request("completions", body), "rid"))
    assert (info.value.status, info.value.param) == (400, "stop_token_ids")
    assert serving.active_ids() == []


def test_logit_bias_and_allowed_ids_outside_the_vocabulary() -> None:
    SamplingParams(logit_bias={5: 1.0}, allowed_token_ids=[2, 9]).check_vocab(10)
    for params, param in (
        (SamplingParams(logit_bias={5: 1.0, 10: -1.0}), "logit_bias"),
        (SamplingParams(allowed_token_ids=[2, 10]), "allowed_token_ids"),
    ):
        with pytest.raises(SamplingParamsError) as info:
            params.check_vocab(10)
        assert info.value.param == param
        assert "[10]" in info.value.message
