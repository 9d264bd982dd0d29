"""Structured outputs and tool calls over real HTTP with the official ``openai`` client.

The built-in model has random weights: every valid output here is the constraint's
doing, not the model's.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from ..helpers.processes import Proc
from .schemas import random_schema

pytestmark = pytest.mark.slow

MODEL = "tiny"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 999},
                    "b": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Describe the weather as JSON."}]


def _serve(args: list[str]) -> Proc:
    return Proc("serve", args, "server").wait_ready()


#: Put before the built-in chat template (which ignores tools): a system block
#: listing the tools, as the Qwen family's templates render them.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|im_end|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def tools_model_dir(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in checkpoint with a chat template that renders ``tools``."""
    out = tmp_path_factory.mktemp("tools-model")
    for f in builtin_model_dir.iterdir():
        shutil.copy(f, out / f.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE + config["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def server(tools_model_dir: Path) -> Iterator[Proc]:
    proc = _serve(
        [
            "--model",
            str(tools_model_dir),
            "--device",
            "cpu",
            "--max-model-len",
            "2048",
            "--served-model-name",
            MODEL,
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ]
    )
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server: Proc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300
    ) as c:
        yield c


def _stream_chat(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[dict[str, str]], str]:
    """Content, tool calls (accumulated by index as a client does) and finish reason."""
    content = ""
    calls: dict[int, dict[str, str]] = {}
    finish = ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += tc.id or ""
                if tc.function is not None:
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_200_random_schemas_validate(client: openai.OpenAI) -> None:
    """Objects, arrays, enums, nesting, string patterns and number ranges; every
    fourth request streamed; 16 in flight (the engine batches them)."""
    rng = random.Random(20261201)
    schemas = [random_schema(rng) for _ in range(200)]

    def one(i: int) -> tuple[str, str]:
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 600,
            "seed": i,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schemas[i], "strict": True},
            },
        }
        if i % 4 == 3:
            text, calls, finish = _stream_chat(client, **kwargs)
            assert calls == []
            return text, finish
        r = client.chat.completions.create(**kwargs)
        return r.choices[0].message.content or "", r.choices[0].finish_reason

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(200)))
    for schema, (text, finish) in zip(schemas, results, strict=True):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_n2_json_object_and_completions(client: openai.OpenAI) -> None:
    schema = {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}
    fmt = {"type": "json_schema", "json_schema": {"name": "b", "schema": schema}}
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=50,
        n=2,
        seed=1,
        response_format=fmt,  # type: ignore[arg-type]
    )
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content or ""), schema)
    r2 = client.completions.create(
        model=MODEL, prompt="two booleans:", max_tokens=50, extra_body={"response_format": fmt}
    )
    jsonschema.validate(json.loads(r2.choices[0].text), schema)
    # Any object: unbounded, so a random model usually runs out of tokens first
    # (finish_reason length, the text cut where the budget ended); what finishes is
    # an object.
    for seed in range(2):
        r = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=60,
            seed=seed,
            response_format={"type": "json_object"},
        )
        c = r.choices[0]
        assert (c.message.content or "").startswith("{")
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content or ""), dict)


REGEX = r"[A-Z][a-z]{2,6} [0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]


@pytest.mark.parametrize("stream", [False, True])
def test_regex_choice_and_grammar(client: openai.OpenAI, stream: bool) -> None:
    for seed in range(4):
        cases: list[tuple[dict[str, Any], Any]] = [
            ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
            ({"choice": CHOICES}, lambda t: t in CHOICES),
            (
                {"grammar": 'start: "yes" | "no" | NUM\nNUM: /[0-9]{1,3}/'},
                lambda t: re.fullmatch(r"yes|no|[0-9]{1,3}", t),
            ),
            ({"grammar": 'root ::= "a" [0-9] "b"'}, lambda t: re.fullmatch(r"a[0-9]b", t)),
        ]
        for spec, check in cases:
            body = {"structured_outputs": spec}
            if stream:
                text, _, finish = _stream_chat(
                    client,
                    model=MODEL,
                    messages=MESSAGES,
                    max_tokens=40,
                    seed=seed,
                    extra_body=body,
                )
            else:
                r = client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=40, seed=seed, extra_body=body
                )
                text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
            assert finish == "stop" and check(text), (spec, text)
        c = client.completions.create(
            model=MODEL,
            prompt="pick:",
            max_tokens=20,
            seed=seed,
            stream=False,
            extra_body={"structured_outputs": {"choice": CHOICES}},
        )
        assert c.choices[0].text in CHOICES


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_inside_constrained_output(client: openai.OpenAI, stream: bool) -> None:
    """A stop string ends a constrained output where it appears (the text before it,
    finish_reason stop); the next request on the same grammar is unaffected."""
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 40,
        "extra_body": {"structured_outputs": {"regex": r"key=[0-9]{3};value=[a-z]{4}"}},
    }
    for seed in range(3):
        if stream:
            text, _, finish = _stream_chat(client, seed=seed, stop=[";"], **kwargs)
        else:
            r = client.chat.completions.create(seed=seed, stop=[";"], **kwargs)
            text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
        assert finish == "stop" and re.fullmatch(r"key=[0-9]{3}", text), text
        r = client.chat.completions.create(seed=seed, **kwargs)
        whole = r.choices[0].message.content or ""
        assert re.fullmatch(r"key=[0-9]{3};value=[a-z]{4}", whole), whole
        assert whole.startswith(text + ";"), (text, whole)


def test_responses_text_format(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "r", "schema": schema, "strict": True}}
    r = client.responses.create(model=MODEL, input="json please", max_output_tokens=200, text=fmt)  # type: ignore[arg-type]
    jsonschema.validate(json.loads(r.output_text), schema)
    text = ""
    with client.responses.stream(
        model=MODEL, input="json please", max_output_tokens=200, text=fmt
    ) as s:  # type: ignore[arg-type]
        for event in s:
            if event.type == "response.output_text.delta":
                text += event.delta
    jsonschema.validate(json.loads(text), schema)


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), PARAMS[name])


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required(client: openai.OpenAI, parallel: bool) -> None:
    for seed in range(12):
        r = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=600,
            seed=seed,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            parallel_tool_calls=parallel,
        )
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert msg.content is None
        assert msg.tool_calls and (parallel or len(msg.tool_calls) == 1)
        for tc in msg.tool_calls:
            assert tc.type == "function" and tc.id.startswith("chatcmpl-tool-")
            _check_call(tc.function.name, tc.function.arguments)  # type: ignore[union-attr]


def test_tool_choice_required_streamed(client: openai.OpenAI) -> None:
    for seed in range(8):
        content, calls, finish = _stream_chat(
            client,
            model=MODEL,
            messages=MESSAGES,
            max_tokens=600,
            seed=seed,
            tools=TOOLS,
            tool_choice="required",
        )
        assert finish == "tool_calls" and content == "" and calls
        for call in calls:
            assert call["id"].startswith("chatcmpl-tool-")
            _check_call(call["name"], call["arguments"])


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool(client: openai.OpenAI, stream: bool) -> None:
    choice = {"type": "function", "function": {"name": "add"}}
    for seed in range(6):
        kwargs: dict[str, Any] = dict(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=300,
            seed=seed,
            tools=TOOLS,
            tool_choice=choice,
        )
        if stream:
            _, calls, finish = _stream_chat(client, **kwargs)
        else:
            r = client.chat.completions.create(**kwargs)
            finish = r.choices[0].finish_reason
            calls = [
                {"name": tc.function.name, "arguments": tc.function.arguments}  # type: ignore[union-attr]
                for tc in r.choices[0].message.tool_calls or []
            ]
        assert finish == "stop"
        assert [c["name"] for c in calls] == ["add"]
        _check_call("add", calls[0]["arguments"])


def test_responses_tools(client: openai.OpenAI) -> None:
    """Responses' flat tools: a required call comes back as ``function_call`` items,
    streamed or not, with arguments valid for the tool."""
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    for seed in range(3):
        r = client.responses.create(
            model=MODEL,
            input="weather?",
            max_output_tokens=400,
            tools=flat,  # type: ignore[arg-type]
            tool_choice="required",
            extra_body={"seed": seed},
        )
        calls = [item for item in r.output if item.type == "function_call"]
        assert calls and r.tool_choice == "required" and len(r.tools) == 2
        for call in calls:
            assert call.call_id.startswith("call_")
            _check_call(call.name, call.arguments)
    named = {"type": "function", "name": "get_weather"}
    args = ""
    deltas = 0
    added = None
    arguments_done = None
    done = None
    with client.responses.stream(
        model=MODEL,
        input="weather?",
        max_output_tokens=400,
        tools=flat,
        tool_choice=named,  # type: ignore[arg-type]
    ) as stream:
        for event in stream:
            if event.type == "response.output_item.added":
                added = event
            if event.type == "response.function_call_arguments.delta":
                assert added is not None and event.item_id == added.item.id
                assert event.output_index == added.output_index
                args += event.delta
                deltas += 1
            if event.type == "response.function_call_arguments.done":
                arguments_done = event.arguments
            if event.type == "response.completed":
                done = event.response
    assert done is not None and added is not None
    (call,) = [item for item in done.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.arguments == args == arguments_done
    assert call.id == added.item.id and added.item.type == "function_call"
    # The arguments arrived as the model wrote them, not in one piece at the end.
    assert deltas > 3
    _check_call("get_weather", args)


def test_conversation_with_tool_results_and_auto(client: openai.OpenAI) -> None:
    """Assistant ``tool_calls`` and ``tool`` messages are accepted; ``auto`` lets the
    model write text, which the parser reads (the random model writes no call)."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        seed=0,
        tools=TOOLS,
        tool_choice="auto",  # type: ignore[arg-type]
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason in ("stop", "length")
    assert msg.tool_calls in (None, []) or all(tc.function.name for tc in msg.tool_calls)  # type: ignore[union-attr]
    assert r.usage is not None and r.usage.prompt_tokens > 20
    _, calls, _ = _stream_chat(
        client, model=MODEL, messages=messages, max_tokens=20, seed=0, tools=TOOLS
    )
    assert isinstance(calls, list)


BAD: list[tuple[str, dict[str, Any], str]] = [
    (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strin"}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "not": {"type": "object"}},
                },
            }
        },
        "response_format.json_schema.schema",
    ),
    ("chat", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ("chat", {"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
    ("chat", {"structured_outputs": {"json": "{oops"}}, "structured_outputs.json"),
    (
        "chat",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "unknown_fn"}}},
        "tool_choice.function.name",
    ),
    ("chat", {"tools": []}, "tools"),
    (
        "chat",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tools[0].function.parameters",
    ),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("completions", {"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs.regex"),
    (
        "responses",
        {
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "x",
                    "schema": {"type": "object", "if": {}, "then": {}},
                }
            }
        },
        "text.format.schema",
    ),
    (
        "chat",
        {
            "structured_outputs": {
                "structural_tag": json.dumps(
                    {
                        "structures": [{"begin": "@a", "schema": {"type": "strin"}, "end": ""}],
                        "triggers": ["@"],
                    }
                )
            }
        },
        "structured_outputs.structural_tag.structures[0].schema",
    ),
    (
        "chat",
        {"response_format": {"type": "structural_tag", "format": {"type": "triggered_tags"}}},
        "response_format.format",
    ),
]


def test_bad_input_is_400_naming_the_parameter(server: Proc) -> None:
    base = {
        "chat": ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 5}),
        "completions": ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5}),
        "responses": ("/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 5}),
    }
    for endpoint, extra, param in BAD:
        route, body = base[endpoint]
        r = httpx.post(server.url + route, json={**body, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param, (extra, error)
        assert error["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health").status_code == 200
    ok = httpx.post(
        server.url + "/v1/chat/completions",
        json={**base["chat"][1], "structured_outputs": {"choice": ["fine"]}},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"


def test_without_the_flags_auto_is_refused() -> None:
    """As vLLM: ``tool_choice: auto`` (the default with tools) needs
    ``--enable-auto-tool-choice --tool-call-parser``; a server with no tokenizer
    cannot constrain."""
    mock = _serve(["--mock-engine", "--served-model-name", MODEL])
    try:
        url = mock.url + "/v1/chat/completions"
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5}
        r = httpx.post(url, json={**body, "tools": TOOLS}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
        r = httpx.post(url, json={**body, "response_format": {"type": "json_object"}}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
        r = httpx.post(url, json={**body, "tools": TOOLS, "tool_choice": "none"}, timeout=30)
        assert r.status_code == 200
    finally:
        assert mock.stop() == 0


def test_tokenize_renders_tools_as_chat_does(server: Proc, client: openai.OpenAI) -> None:
    """``/tokenize`` with ``tools`` counts the prompt a chat request with those tools
    feeds the model (rendered by the chat template), as vLLM's does."""
    tok = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES, "tools": TOOLS})
    assert tok.status_code == 200, tok.text
    bare = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=1,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="auto",
    )
    assert r.usage is not None
    assert tok.json()["count"] == r.usage.prompt_tokens > bare["count"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": tok.json()["tokens"]}).json()
    assert '"get_weather"' in text["prompt"] and "Current weather in a city" in text["prompt"]
    bad = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES, "tools": [{"x": 1}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].type"


#: Two structures behind one trigger, ``@`` (one token of the built-in tokenizer).
STRUCTURAL_TAG = {
    "structures": [
        {"begin": "@weather:", "schema": PARAMS["get_weather"], "end": ";"},
        {"begin": "@add:", "schema": PARAMS["add"], "end": ";"},
    ],
    "triggers": ["@"],
}


@pytest.mark.parametrize("stream", [False, True])
def test_structural_tag(server: Proc, client: openai.OpenAI, stream: bool) -> None:
    """``response_format`` of type ``structural_tag`` and vLLM's
    ``structured_outputs.structural_tag`` (its JSON text): the free text is pushed to the
    trigger by ``logit_bias``, and every trigger is followed by a structure's begin,
    arguments valid for its schema and its end."""
    at = httpx.post(server.url + "/tokenize", json={"prompt": "@"}).json()["tokens"]
    assert len(at) == 1
    bodies = [
        {"response_format": {"type": "structural_tag", **STRUCTURAL_TAG}},
        {"structured_outputs": {"structural_tag": json.dumps(STRUCTURAL_TAG)}},
    ]
    ends = {s["begin"]: (s["schema"], s["end"]) for s in STRUCTURAL_TAG["structures"]}
    for seed, extra in enumerate(bodies):
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 120,
            "temperature": 1.0,
            "seed": seed,
            "logit_bias": {str(at[0]): 100},
            "extra_body": extra,
        }
        if stream:
            text, _, finish = _stream_chat(client, **kwargs)
        else:
            r = client.chat.completions.create(**kwargs)
            text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
        complete = 0
        pos = 0
        while pos < len(text):
            begin = next((b for b in ends if text.startswith(b, pos)), None)
            if begin is None:
                # Only a structure cut by max_tokens may stay unfinished.
                assert finish == "length" and any(b.startswith(text[pos:]) for b in ends), text
                break
            schema, end = ends[begin]
            try:
                value, pos = json.JSONDecoder().raw_decode(text, pos + len(begin))
            except ValueError:
                assert finish == "length", text
                break
            jsonschema.validate(value, schema)
            if not text.startswith(end, pos):
                assert finish == "length" and text[pos:] == "", text
                break
            pos += len(end)
            complete += 1
        assert complete >= 2, text
