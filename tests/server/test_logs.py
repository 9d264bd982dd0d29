"""What ``ec-frontend serve`` says: the first line, weight loading, the startup
summary, an access line per request (with the error's code and param), request
bodies with ``--enable-log-requests``, the stats line; every line with a time.

One real server (the built-in model on the CPU) started with vLLM-named flags
whose effects the tests check too: CORS (``--allowed-origins``),
``--max-logprobs``, ``--chat-template``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ..helpers.processes import Proc

pytestmark = pytest.mark.slow

ORIGIN = "http://app.example"
STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
TEMPLATE = "{% for m in messages %}TEMPLATE-MARK {{ m['role'] }}{% endfor %}"


@pytest.fixture(scope="module")
def server(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    proc = Proc(
        "serve",
        [str(builtin_model_dir), "--device", "cpu", "--max-model-len", "1024",
         "--served-model-name", "tiny", "--log-level", "INFO",
         "--allowed-origins", f'["{ORIGIN}"]', "--max-logprobs", "2",
         "--chat-template", str(template), "--enable-log-requests", "--max-log-len", "30"],
        "server",
        env={"EC_FRONTEND_LOG_STATS_INTERVAL": "0.5"},
    )  # fmt: skip
    proc.wait_ready()
    yield proc
    proc.stop()


def _wait_for(proc: Proc, pattern: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, proc.output(), re.MULTILINE)
        if found:
            return found.group(0)
        time.sleep(0.1)
    raise AssertionError(f"no line matching {pattern!r} in:\n{proc.log()}")


def test_startup_lines(server: Proc) -> None:
    lines = server.output().splitlines()
    assert re.search(r"INFO ec_frontend: ec-frontend \S+ serve \(pid \d+\)$", lines[0])
    _wait_for(server, r"loading weights: shard 1/1 model\.safetensors \(\d+\.\d\d GiB")
    _wait_for(
        server,
        r"engine: device cpu, dtype float32, weights \d+\.\d\d GiB, KV cache \d+ tokens "
        r"\(\d+\.\d\d GiB\), encoder cache \d+ tokens$",
    )
    _wait_for(server, r"transfer: EC off, KV off, side channel none$")
    _wait_for(
        server,
        rf"serving tiny on http://127\.0\.0\.1:{server.port}: API key off, transfer secret "
        r"off, access log on, stats log on$",
    )


def test_access_line_for_a_400_names_code_and_param(server: Proc) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": []},
        headers={"x-request-id": "bad-request-1"},
    )
    assert r.status_code == 400
    line = _wait_for(server, r'.*"POST /v1/chat/completions" 400 .*rid=bad-request-1 .*')
    assert line.endswith("code=invalid_value param=messages")
    body = _wait_for(server, r".*request rid=bad-request-1 body: .*")
    assert body.split("body: ", 1)[1] == r.request.content.decode()[:30]


def test_max_logprobs_is_enforced(server: Proc) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 3,
            "max_tokens": 1,
        },
        headers={"x-request-id": "logprobs-1"},
    )
    assert r.status_code == 400
    assert "--max-logprobs" in r.json()["error"]["message"]
    line = _wait_for(server, r'.*" 400 .*rid=logprobs-1 .*')
    assert line.endswith("code=invalid_value param=logprobs")


def test_stats_line_after_work(server: Proc) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200
    line = _wait_for(server, r".*Avg prompt throughput: [1-9][\d.]* tokens/s.*")
    for part in ("Avg generation throughput: ", "Running: ", "Waiting: ", "KV cache usage: ",
                 "Prefix cache hit rate: ", "Encoder cache usage: ", "EC loads: "):  # fmt: skip
        assert part in line


def test_cors_and_chat_template(server: Proc) -> None:
    r = httpx.get(server.url + "/v1/models", headers={"origin": ORIGIN})
    assert r.headers.get("access-control-allow-origin") == ORIGIN
    r = httpx.get(server.url + "/v1/models", headers={"origin": "http://other.example"})
    assert "access-control-allow-origin" not in r.headers
    tokens = httpx.post(
        server.url + "/tokenize",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    ).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"model": "tiny", "tokens": tokens})
    assert text.json()["prompt"].startswith("TEMPLATE-MARK user")


def test_every_line_has_a_time(server: Proc) -> None:
    _wait_for(server, r".*ec_frontend\.engine\.kv_cache: KV cache: .*")
    lines = [line for line in server.output().splitlines() if line.strip()]
    untimed = [line for line in lines if not STAMP.match(line)]
    assert not untimed, untimed[:5]
