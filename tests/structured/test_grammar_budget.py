"""A grammar's cost stays its own: the real server (built-in model, engine process)
on 127.0.0.1, driven by the official ``openai`` client.

* While a 100,000-choice grammar (2.2 MB) is built in the engine process, another
  client's stream keeps its tokens coming: its longest gap stays under 0.5 s (with
  the build inside the engine's step, that stream stood still for the whole build,
  14 s measured). The build outlasts the server's budget and the request ends with
  a clear error, non-streamed (400 ``grammar_error``) and streamed (an error event).
* A grammar over ``--structured-outputs-max-grammar-bytes`` is a 400 naming its
  field, before anything is generated.
* No output leaves its grammar (a property over choice lists, regexes and schemas,
  with ``min_tokens`` and ``max_tokens`` that collide with the grammar's length):
  every finished output matches its grammar, or ends with ``length``, or with an
  error.
* Log lines stay short (no grammar is written out).
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ..helpers.processes import Proc

pytestmark = pytest.mark.slow

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Pick one."}]
MAX_GRAMMAR_BYTES = 2_400_000
COMPILE_TIMEOUT_S = 3
HUGE = [f"choice-{i:06d}-abc" for i in range(100_000)]


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    proc = Proc(
        "serve",
        [
            "--device",
            "cpu",
            "--served-model-name",
            MODEL,
            "--structured-outputs-max-grammar-bytes",
            str(MAX_GRAMMAR_BYTES),
            "--structured-outputs-compile-timeout",
            str(COMPILE_TIMEOUT_S),
        ],
        "server",
    ).wait_ready()
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server: Proc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c


def _choose(client: openai.OpenAI, choices: list[str], *, stream: bool = False) -> Any:
    """A chat completion constrained to ``choices``."""
    return client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        stream=stream,
        extra_body={"structured_outputs": {"choice": choices}},
    )


def test_a_stream_keeps_flowing_while_a_huge_grammar_builds(client: openai.OpenAI) -> None:
    arrivals: list[float] = []
    started = threading.Event()

    def neighbour() -> None:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        # One chunk per token (its text may be empty: a random model writes special
        # tokens too).
        for chunk in stream:
            if chunk.choices:
                arrivals.append(time.monotonic())
                if len(arrivals) == 20:
                    started.set()

    thread = threading.Thread(target=neighbour)
    thread.start()
    assert started.wait(60)
    sent = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        _choose(client, HUGE)
    answered = time.monotonic()
    # The same grammar, streamed: it waits for the same build, then an error event.
    with pytest.raises(openai.APIError) as streamed:
        for _ in _choose(client, HUGE, stream=True):
            pass
    thread.join()

    # The neighbour streamed all along the build, and never stood still for long.
    assert arrivals[0] < sent and arrivals[-1] > answered, (sent, answered, arrivals[-1])
    during = [t for t in arrivals if sent <= t <= answered]
    edges = [
        max(t for t in arrivals if t < sent),
        *during,
        min(t for t in arrivals if t > answered),
    ]
    longest = max(b - a for a, b in itertools.pairwise(edges))
    assert longest < 0.5, f"a stream stood still for {longest:.2f} s while a grammar built"
    body = info.value.body
    assert isinstance(body, dict)
    assert body["code"] == "grammar_error"
    assert body["message"].startswith("structured output: ")
    assert "--structured-outputs-compile-timeout" in body["message"]
    assert answered - sent >= COMPILE_TIMEOUT_S
    assert "structured output: " in str(streamed.value)


def test_a_grammar_over_the_byte_budget_is_a_400_naming_its_field(
    client: openai.OpenAI,
) -> None:
    choices = [f"choice-{i:06d}-abc" for i in range(110_000)]
    with pytest.raises(openai.BadRequestError) as info:
        _choose(client, choices)
    body = info.value.body
    assert isinstance(body, dict)
    assert body["param"] == "structured_outputs.choice"
    assert "--structured-outputs-max-grammar-bytes" in body["message"]
    assert f"{MAX_GRAMMAR_BYTES:,}" in body["message"]
    schema = {"enum": choices}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "big", "schema": schema},
            },
        )
    body = info.value.body
    assert isinstance(body, dict)
    assert body["param"] == "response_format.json_schema.schema"
    # The server goes on serving constrained requests.
    r = _choose(client, ["yes", "no"])
    assert r.choices[0].message.content in ("yes", "no")


#: Regexes that stress the lexer: counted repetitions, a state blow-up, nesting.
REGEXES = st.one_of(
    st.integers(1, 24).map(lambda k: f"(a|b)*a(a|b){{{k}}}"),
    st.integers(1, 60).map(lambda k: f"[a-z]{{{k},{k + 40}}}"),
    st.integers(1, 30).map(lambda k: f"((ab|ba|c)*x){{1,{k}}}"),
    st.just(r"(\d{1,3}\.){3}\d{1,3}"),
    st.just("(x+x+)+y"),
)
CHOICES = st.lists(
    st.text("abcxyz -_01", min_size=1, max_size=10), min_size=1, max_size=30, unique=True
)
SCHEMAS = st.builds(
    lambda n, length: {
        "type": "object",
        "properties": {"k": {"type": "string", "maxLength": length}, "n": {"enum": list(range(n))}},
        "required": ["k", "n"],
        "additionalProperties": False,
    },
    st.integers(1, 40),
    st.integers(0, 12),
)
CONSTRAINTS = st.one_of(
    REGEXES.map(lambda r: ("regex", r)),
    CHOICES.map(lambda c: ("choice", c)),
    SCHEMAS.map(lambda s: ("json", s)),
)


def _matches(kind: str, spec: Any, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "choice":
        return text in spec
    try:
        jsonschema.validate(json.loads(text), spec)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@settings(
    max_examples=40,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    constraint=CONSTRAINTS,
    max_tokens=st.integers(1, 40),
    min_tokens=st.integers(0, 12),
    stream=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_no_output_leaves_its_grammar(
    client: openai.OpenAI,
    constraint: tuple[str, Any],
    max_tokens: int,
    min_tokens: int,
    stream: bool,
    seed: int,
) -> None:
    kind, spec = constraint
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": seed,
        "extra_body": {
            "structured_outputs": {kind: spec},
            "min_tokens": min(min_tokens, max_tokens),
        },
    }
    try:
        if stream:
            text, finish = "", None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
        else:
            r = client.chat.completions.create(**kwargs)
            text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
    except openai.APIError as exc:
        assert "structured output: " in str(exc), exc
        event("error")
        return
    assert finish in ("stop", "length"), (finish, text)
    event(str(finish))
    if finish == "stop":
        assert _matches(kind, spec, text), (kind, spec, text)


def test_log_lines_stay_short(server: Proc, client: openai.OpenAI) -> None:
    """After the failures above, nothing the server wrote quotes a grammar."""
    longest = max((len(line) for line in server.output().splitlines()), default=0)
    assert longest < 2000, longest
