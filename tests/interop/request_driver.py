"""Parses request bodies with vLLM's own request models (run by the vLLM venv's Python).

Usage: ``python request_driver.py CASES_JSON OUT_JSON``. ``CASES_JSON`` holds
``[{"endpoint": "chat" | "completions" | "responses" | "generate", "body": str}]``;
each body is validated by vLLM 0.33's ``ChatCompletionRequest``,
``CompletionRequest``, ``ResponsesRequest`` or ``GenerateRequest`` and turned into
``SamplingParams`` by the model's own ``to_sampling_params`` (generate: the
``sampling_params`` the model built). ``OUT_JSON`` gets one entry per case:
``{"ok": true, "sampling": {...}}`` with the fields ec-frontend's parser reports
(``max_tokens`` is what the request asked for, ``None`` when it asked nothing),
or ``{"ok": false, "error": str}`` when vLLM refuses the body.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

#: Stands in for the rest of the context where the server would compute it.
CONTEXT = 100_000
FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "n",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
    "prompt_logprobs", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
    "allowed_token_ids", "min_tokens", "bad_words", "extra_args",
)  # fmt: skip


def _sampling(endpoint: str, body: str) -> dict[str, Any]:
    if endpoint == "chat":
        chat = ChatCompletionRequest.model_validate_json(body)
        asked = chat.max_completion_tokens
        asked = chat.max_tokens if asked is None else asked
        params = chat.to_sampling_params(CONTEXT if asked is None else asked, {})
    elif endpoint == "completions":
        completion = CompletionRequest.model_validate_json(body)
        asked = completion.max_tokens
        params = completion.to_sampling_params(CONTEXT if asked is None else asked, {})
    elif endpoint == "responses":
        response = ResponsesRequest.model_validate_json(body)
        asked = response.max_output_tokens
        params = response.to_sampling_params(CONTEXT, {})
    else:
        generate = GenerateRequest.model_validate_json(body)
        params = generate.sampling_params
        asked = params.max_tokens if generate.is_sampling_param_provided("max_tokens") else None
        # As vLLM's generate server adds them (`is not None`: `{}` is kept).
        for key in ("kv_transfer_params", "ec_transfer_params"):
            if (value := getattr(generate, key)) is not None:
                params.extra_args = {**(params.extra_args or {}), key: value}
    out = {name: getattr(params, name) for name in FIELDS}
    out["max_tokens"] = asked
    bias = params.logit_bias
    out["logit_bias"] = None if bias is None else {str(k): v for k, v in bias.items()}
    return out


def main() -> None:
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    results = []
    for case in cases:
        try:
            results.append({"ok": True, "sampling": _sampling(case["endpoint"], case["body"])})
        except Exception as exc:  # vLLM refuses with ValidationError, ValueError, ...
            results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]})
    with open(sys.argv[2], "w") as f:
        json.dump(results, f, default=list)


if __name__ == "__main__":
    main()
