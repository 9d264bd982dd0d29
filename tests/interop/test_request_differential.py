"""Differential test: ec-frontend's request parsing against vLLM 0.33's own.

Several hundred bodies over chat, completions, Responses and generate (a few
handwritten, the rest drawn from per-field values, valid and invalid, with a
fixed seed) go through ec-frontend's parser and sampling-params builder here,
and through vLLM's request models and ``to_sampling_params`` in the vLLM
environment (``request_driver.py``). Both must accept or refuse each body alike
and, when both accept, produce the same sampling parameters. Every deliberate
difference is a rule below, named after its entry in docs/compatibility.md
("Differences found by the differential test"); a difference no rule explains
fails the test, and so does a rule that no body exercises.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ec_frontend as ecf
import pytest
from ec_frontend.entrypoints.http.errors import APIError
from ec_frontend.entrypoints.openai.sampling import build_sampling_params

from .conftest import run_vllm

HERE = Path(__file__).parent
MESSAGES = [{"role": "user", "content": "hi"}]
FIELDS = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logprobs", "prompt_logprobs", "ignore_eos", "skip_special_tokens",
    "include_stop_str_in_output", "logit_bias", "allowed_token_ids", "min_tokens",
    "bad_words", "extra_args",
)  # fmt: skip

#: field -> (valid values, invalid values); ``None`` is sent as JSON null.
Choices = dict[str, tuple[list[Any], list[Any]]]
SAMPLING: Choices = {
    "temperature": ([None, 0, 0.7, 2, "0.5", True], [2.5, "hot"]),
    "top_p": ([None, 0.5, 1], [0, 1.2]),
    "top_k": ([None, -1, 0, 5, "3"], [-2]),
    "min_p": ([None, 0.2], [1.5]),
    "seed": ([None, 0, -1, 7], [2**63]),
    "stop": ([None, "x", ["a", "b"]], [["a", "b", "c", "d", "e"], [1]]),
    "stop_token_ids": ([None, [1, 2], ["3"]], [[-1]]),
    "n": ([None, 1, 2, "2", True], [0]),
    "presence_penalty": ([None, 0.5, "-1"], [2.5]),
    "frequency_penalty": ([None, -0.5], [-3]),
    "repetition_penalty": ([None, 1.2], [0, -1]),
    "ignore_eos": ([None, True, "yes"], [2]),
    "skip_special_tokens": ([None, False], []),
    "include_stop_str_in_output": ([None, True], []),
    "logit_bias": ([None, {"5": 10}, {"7": 150, " 8 ": "-3.5"}], [{"x": 1}]),
    "allowed_token_ids": ([None, [1, 2]], [[]]),
    "min_tokens": ([None, 2, "3"], [-1, 500]),
    "bad_words": ([None, ["x"], ["a", "a"]], [[""], "w"]),
    "max_tokens": ([None, 1, 64, "16"], [0, -5, 1.5]),
}
CHAT: Choices = SAMPLING | {
    "logprobs": ([None, True, False], []),
    "top_logprobs": ([None, 2], [21]),
    "max_completion_tokens": ([None, 3], [0]),
    "kv_transfer_params": ([None, {}, {"do_remote_decode": True}], []),
    "ec_transfer_params": ([None, {}, {"ab12": {"peer_port": 1}}], []),
    "vllm_xargs": ([None, {"a": 1}], []),
    "stream": ([None, True, False, 1], []),
    "return_token_ids": ([None, True, "no"], []),
    "truncate_prompt_tokens": ([None, 5, -1], [-2]),
    "priority": ([None, 0], [1]),
    "echo": ([None, False], [True]),
    "prompt_logprobs": ([None, 0], [2]),
}
COMPLETIONS: Choices = SAMPLING | {
    "logprobs": ([None, 0, 3], [21]),
    "echo": ([None, True, False], []),
    "kv_transfer_params": ([None, {}, {"do_remote_decode": True}], []),
    "stream": ([None, True, False], []),
    "return_token_ids": ([None, True], []),
    "truncate_prompt_tokens": ([None, 5, -1], []),
    "stream_interval": ([None, 1, 3], [0]),
}
RESPONSES: Choices = {
    name: SAMPLING[name]
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                 "skip_special_tokens", "include_stop_str_in_output", "logit_bias")
} | {
    "max_output_tokens": ([None, 5], [0]),
    "top_logprobs": ([None, 0, 2], []),
    "include": ([None, ["message.output_text.logprobs"]], []),
    "kv_transfer_params": ([None, {}, {"do_remote_decode": True}], []),
}  # fmt: skip
GENERATE_SAMPLING: Choices = SAMPLING | {"logprobs": ([None, 0, 2], [])}
GENERATE_TOP: Choices = {
    "kv_transfer_params": ([None, {}, {"do_remote_prefill": True}], []),
    "ec_transfer_params": ([None, {}], []),
    "return_token_ids": ([None, True], []),
    "stream": ([None, True], []),
    "priority": ([None, 0], [2]),
}

HANDWRITTEN: list[tuple[str, dict[str, Any]]] = [
    ("chat", {"messages": MESSAGES}),
    ("chat", {"messages": MESSAGES, "prompt_logprobs": 1}),
    ("chat", {"messages": MESSAGES, "echo": True}),
    ("chat", {"messages": MESSAGES, "kv_transfer_params": {}, "ec_transfer_params": {}}),
    ("chat", {"messages": MESSAGES, "priority": 5}),
    ("chat", {"messages": MESSAGES, "min_tokens": None}),
    ("chat", {"messages": MESSAGES, "stream": "off", "stream_options": {"include_usage": True}}),
    ("chat", {"messages": MESSAGES, "logprobs": "false", "top_logprobs": 2}),
    ("completions", {"prompt": "x", "logprobs": 2, "echo": True}),
    ("completions", {"prompt": "x", "kv_transfer_params": {}}),
    ("responses", {"input": "x"}),
    ("responses", {"input": "x", "top_logprobs": 2}),
    ("responses", {"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 2}),
    ("generate", {"token_ids": [1, 2], "sampling_params": {"n": 2}}),
    ("generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}}),
    ("generate", {"token_ids": [1, 2], "kv_transfer_params": {}}),
]


def _draw(rng: random.Random, choices: Choices, p: float) -> dict[str, Any]:
    """Valid values for some fields and, every other body, one invalid value."""
    fields: dict[str, Any] = {}
    for name, (valid, _) in choices.items():
        if rng.random() < p:
            # null now and then: vLLM refuses it on its non-Optional fields
            fields[name] = None if rng.random() < 0.04 else rng.choice(valid[1:])
    if rng.random() < 0.5:
        name = rng.choice([n for n, (_, invalid) in choices.items() if invalid])
        fields[name] = rng.choice(choices[name][1])
    return fields


def corpus() -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(20261201)
    cases = list(HANDWRITTEN)
    for _ in range(180):
        cases.append(("chat", {"messages": MESSAGES, **_draw(rng, CHAT, 0.2)}))
    for _ in range(150):
        cases.append(("completions", {"prompt": "x", **_draw(rng, COMPLETIONS, 0.2)}))
    for _ in range(100):
        cases.append(("responses", {"input": "x", **_draw(rng, RESPONSES, 0.3)}))
    for _ in range(120):
        body = {"token_ids": [5, 6], **_draw(rng, GENERATE_TOP, 0.3)}
        body["sampling_params"] = _draw(rng, GENERATE_SAMPLING, 0.2)
        cases.append(("generate", body))
    for endpoint, body in cases:
        if endpoint != "generate":
            body["model"] = "m"
    return cases


def ours(endpoint: str, body: str) -> dict[str, Any] | None:
    """The sampling params ec-frontend's parser and builder make, or None (refused)."""
    try:
        sampling = ecf.parse_request(endpoint, body.encode()).sampling
        params = build_sampling_params(sampling)
    except (ecf.RequestError, APIError):
        return None
    out = {name: getattr(params, name) for name in FIELDS}
    out["n"] = sampling["n"]  # the builder makes one engine request per choice
    out["logit_bias"] = (
        None if params.logit_bias is None else {str(k): v for k, v in params.logit_bias.items()}
    )
    return out


def _without_empty_transfer_params(extra: dict[str, Any] | None) -> dict[str, Any] | None:
    kept = {k: v for k, v in (extra or {}).items() if v or k not in TRANSFER_KEYS}
    return kept or None


TRANSFER_KEYS = ("kv_transfer_params", "ec_transfer_params")


def _differing(a: dict[str, Any], b: dict[str, Any]) -> set[str]:
    return {k for k in FIELDS if _canonical(k, a.get(k)) != _canonical(k, b.get(k))}


def _canonical(field: str, value: Any) -> Any:
    """One spelling per meaning: top_k -1 and 0 both disable the filter (ec-frontend
    reports 0, vLLM keeps -1)."""
    if field == "top_k" and value == -1:
        return 0
    return value


Rule = Callable[[str, dict[str, Any], dict[str, Any] | None, dict[str, Any] | None], bool]


def _refused_by_us_for(*fields: str) -> Rule:
    def rule(endpoint: str, body: dict[str, Any], mine: Any, theirs: Any) -> bool:
        return mine is None and theirs is not None and any(f in body for f in fields)

    return rule


def _only(field_names: set[str], check: Callable[[dict[str, Any], Any, Any], bool]) -> Rule:
    def rule(endpoint: str, body: dict[str, Any], mine: Any, theirs: Any) -> bool:
        if mine is None or theirs is None:
            return False
        return _differing(mine, theirs) <= field_names and check(body, mine, theirs)

    return rule


def _empty_params_forwarded(body: dict[str, Any], mine: Any, theirs: Any) -> bool:
    return _without_empty_transfer_params(mine["extra_args"]) == _without_empty_transfer_params(
        theirs["extra_args"]
    )


#: Fields vLLM declares without ``None`` (it refuses ``null`` there).
NON_OPTIONAL = {
    "chat": ("min_tokens", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
             "bad_words", "priority", "echo", "add_generation_prompt", "continue_final_message"),
    "completions": ("min_tokens", "ignore_eos", "include_stop_str_in_output",
                    "skip_special_tokens", "bad_words", "priority", "echo", "n"),
    "responses": ("ignore_eos", "include_stop_str_in_output", "priority"),
    # generate: the top level, then its SamplingParams (a msgspec struct).
    "generate": ("priority",),
    "sampling_params": ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                        "frequency_penalty", "repetition_penalty", "n", "min_tokens",
                        "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                        "bad_words"),
}  # fmt: skip


def _null_on_non_optional(endpoint: str, body: dict[str, Any], mine: Any, theirs: Any) -> bool:
    def nulls(obj: dict[str, Any], names: tuple[str, ...]) -> bool:
        return any(k in obj and obj[k] is None for k in names)

    hit = nulls(body, NON_OPTIONAL[endpoint]) or (
        endpoint == "generate"
        and nulls(body.get("sampling_params", {}), NON_OPTIONAL["sampling_params"])
    )
    return mine is not None and theirs is None and hit


def _prompt_logprobs(endpoint: str, body: dict[str, Any], mine: Any, theirs: Any) -> bool:
    asked = body.get("prompt_logprobs") is not None or (
        endpoint == "completions" and body.get("echo") is True and body.get("logprobs") is not None
    )
    return mine is None and theirs is not None and asked


def _generate_n(endpoint: str, body: dict[str, Any], mine: Any, theirs: Any) -> bool:
    n = body.get("sampling_params", {}).get("n")
    return endpoint == "generate" and mine is None and theirs is not None and n not in (None, 1)


def _checked_early(endpoint: str, body: dict[str, Any], mine: Any, theirs: Any) -> bool:
    """Values vLLM's models accept and its engine refuses later (400 all the same)."""
    top = body.get("sampling_params", body) if endpoint == "generate" else body
    logprobs = top.get("logprobs")
    early = (
        body.get("priority") not in (None, 0),
        top.get("allowed_token_ids") == [],
        any(isinstance(t, int) and t < 0 for t in top.get("stop_token_ids") or ()),
        # vLLM's engine bounds logprobs by --max-logprobs (default 20).
        not isinstance(logprobs, bool) and isinstance(logprobs, int) and logprobs > 20,
    )
    return mine is None and theirs is not None and any(early)


def _bias_clamped(body: dict[str, Any], mine: Any, theirs: Any) -> bool:
    clamped = {k: max(-100.0, min(100.0, v)) for k, v in (theirs["logit_bias"] or {}).items()}
    return mine["logit_bias"] == clamped


def _greedy_n(endpoint: str, body: dict[str, Any], mine: Any, theirs: Any) -> bool:
    # vLLM: "n must be 1 when using greedy sampling".
    return mine is not None and theirs is None and mine["temperature"] < 1e-5 and mine["n"] > 1


def _bounds_on_generate(endpoint: str, body: dict[str, Any], mine: Any, theirs: Any) -> bool:
    sampling = body.get("sampling_params", {})
    stop, seed = sampling.get("stop"), sampling.get("seed")
    bounded = (isinstance(stop, list) and len(stop) > 4) or (
        isinstance(seed, int) and not -(2**63) <= seed < 2**63
    )
    return endpoint == "generate" and mine is None and theirs is not None and bounded


def _generate_defaults(endpoint: str, body: dict[str, Any], mine: Any, theirs: Any) -> bool:
    return endpoint == "generate" and "sampling_params" not in body and theirs is None


def _raw_flag_value(endpoint: str, body: dict[str, Any], mine: Any, theirs: Any) -> bool:
    # vLLM's "before" validators read the raw `stream` / `logprobs` ("off" and "false"
    # are true strings there); ec-frontend's rules see the coerced value.
    raw = isinstance(body.get("stream"), str) or isinstance(body.get("logprobs"), str)
    return (mine is None) != (theirs is None) and raw


#: name (as in docs/compatibility.md) -> rule
RULES: dict[str, Rule] = {
    "empty transfer params are forwarded": _only({"extra_args"}, _empty_params_forwarded),
    "prompt logprobs are refused": _prompt_logprobs,
    "chat echo is refused": lambda e, b, m, t: e == "chat" and b.get("echo") is True and m is None,
    "generate serves one sequence": _generate_n,
    "refused while parsing, not by the engine": _checked_early,
    "generate's sampling_params may be left out": _generate_defaults,
    "n > 1 with greedy sampling": _greedy_n,
    "logit_bias clamped on generate too": _only({"logit_bias"}, _bias_clamped),
    "the chat bounds apply to generate too": _bounds_on_generate,
    "null on vLLM's non-Optional fields": _null_on_non_optional,
    "flags read after coercion": _raw_flag_value,
}


@pytest.fixture(scope="module")
def results(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    work = tmp_path_factory.mktemp("differential")
    cases = [{"endpoint": e, "body": json.dumps(b)} for e, b in corpus()]
    (work / "cases.json").write_text(json.dumps(cases))
    done = run_vllm(
        vllm_python,
        [str(HERE / "request_driver.py"), str(work / "cases.json"), str(work / "out.json")],
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = json.loads((work / "out.json").read_text())
    assert len(theirs) == len(cases)
    return [(c, t) for c, t in zip(cases, theirs, strict=True)]


def test_every_difference_is_a_documented_rule(results: list[Any]) -> None:
    fired: Counter[str] = Counter()
    unexplained = []
    agree = Counter()
    for case, theirs in results:
        endpoint, body = case["endpoint"], json.loads(case["body"])
        mine = ours(endpoint, case["body"])
        vllm = theirs["sampling"] if theirs["ok"] else None
        if (mine is None and vllm is None) or (
            mine is not None and vllm is not None and not _differing(mine, vllm)
        ):
            agree["refused" if mine is None else "accepted"] += 1
            continue
        names = [name for name, rule in RULES.items() if rule(endpoint, body, mine, vllm)]
        if names:
            fired.update(names[:1])
            continue
        detail = (
            {k: (mine[k], vllm[k]) for k in _differing(mine, vllm)}
            if mine is not None and vllm is not None
            else ("ours" if mine is not None else theirs.get("error"))
        )
        unexplained.append((endpoint, case["body"], detail))
    assert not unexplained, "\n".join(map(str, unexplained[:30]))
    assert len(results) >= 500
    assert agree["accepted"] >= 150 and agree["refused"] >= 100, agree
    assert set(fired) == set(RULES), f"rules no body exercised: {set(RULES) - set(fired)}"


def test_the_rules_are_listed_in_the_compatibility_page() -> None:
    page = (HERE.parents[1] / "docs" / "compatibility.md").read_text()
    section = page.split("### Differences found by the differential test", 1)[-1]
    missing = [name for name in RULES if f"**{name}**" not in section]
    assert not missing, missing
