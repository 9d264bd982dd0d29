"""``serve --api-server-count N``: API server processes behind one port, as a group.

Real processes on loopback, the real ``openai`` client; every request that must
reach "some server" opens its own connection (the kernel spreads connections,
not requests, over the servers' sockets).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from ec_frontend.metrics import parse_text

from ..helpers.processes import free_port
from .conftest import MOCK_MODEL, ServerProcess

pytestmark = pytest.mark.slow

HEADER = "x-ec-frontend-server"
CHAT = '{endpoint="/v1/chat/completions",status="200"}'


def _stat(pid: int) -> tuple[str, int] | None:
    """``(state, ppid)`` of a process, ``None`` when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw.rpartition(")")[2].split()
    return fields[0], int(fields[1])


def descendants(root: int) -> set[int]:
    """Every live process below ``root``, from a scan of /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(st[1], []).append(int(entry))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """The processes of ``pids`` still running (zombies count as gone)."""
    return {p for p in pids if (st := _stat(p)) is not None and st[0] != "Z"}


def wait_gone(pids: set[int], timeout_s: float = 15.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(pids)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def listening_servers(parent: int, port: int) -> set[int]:
    """Children of ``parent`` that hold a socket listening on ``port`` (the API servers)."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                listening.add(cols[9])
    return {
        pid
        for pid in descendants(parent)
        if _stat(pid) is not None and _stat(pid)[1] == parent and _socket_inodes(pid) & listening
    }


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def engines(parent: int) -> set[int]:
    """Engine processes (``engine/core_proc.py``) below ``parent``."""
    found = set()
    for pid in descendants(parent):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"ec_frontend.engine.core_proc" in cmdline:
            found.add(pid)
    return found


def group(count: int = 2, *extra: str) -> ServerProcess:
    return ServerProcess(
        [
            "--mock-engine",
            "--served-model-name",
            MOCK_MODEL,
            "--api-server-count",
            str(count),
            *extra,
        ]
    )


def client(url: str) -> openai.OpenAI:
    """A client with a connection of its own."""
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(url: str, text: str, max_tokens: int = 4) -> tuple[str, openai.types.chat.ChatCompletion]:
    with client(url) as c:
        raw = c.chat.completions.with_raw_response.create(
            model=MOCK_MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens
        )
        return raw.headers[HEADER], raw.parse()


def scrape(url: str) -> tuple[str, dict[str, float]]:
    r = httpx.get(url + "/metrics", headers={"connection": "close"}, timeout=10)
    assert r.status_code == 200
    return r.headers[HEADER], parse_text(r.text)


def check_spread_and_metrics(server: ServerProcess) -> None:
    """Requests on separate connections reach both servers, and a scrape of either
    server reports the group's counters and the one engine's, every time."""
    sent = 24
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: chat(server.url, f"hello {i}"), range(sent)))
    per_server = Counter(index for index, _ in results)
    assert set(per_server) == {"0", "1"}, per_server
    assert all(r.choices[0].finish_reason == "length" for _, r in results)
    tokens = sum(r.usage.completion_tokens for _, r in results)
    assert tokens == 4 * sent

    # The servers count a request once its response is sent: let the last one land.
    deadline = time.monotonic() + 10
    while scrape(server.url)[1].get("ec_frontend_requests_total" + CHAT) != sent:
        assert time.monotonic() < deadline, "counters never added up"
        time.sleep(0.05)
    scraped_by: set[str] = set()
    for _ in range(40):
        index, m = scrape(server.url)
        scraped_by.add(index)
        assert m["ec_frontend_requests_total" + CHAT] == sent
        assert m["ec_frontend_time_to_first_token_seconds_count"] == sent
        assert m["ec_frontend_e2e_request_latency_seconds_count"] == sent
        assert m['ec_frontend_e2e_request_latency_seconds_bucket{le="+Inf"}'] == sent
        assert m["ec_frontend_inter_token_latency_seconds_count"] == 3 * sent
        assert m["ec_frontend_http_requests_in_flight"] == 0
        # vLLM's names for the same requests, summed over the group too.
        vllm = f'{{model_name="{MOCK_MODEL}",engine="0"}}'
        assert m["vllm:e2e_request_latency_seconds_count" + vllm] == sent
        assert m["vllm:request_generation_tokens_sum" + vllm] == tokens
        reason = f'{{model_name="{MOCK_MODEL}",engine="0",finished_reason="length"}}'
        assert m["vllm:request_success_total" + reason] == sent
        assert m["vllm:generation_tokens_total" + vllm] == tokens
        # The one engine's statistics, reported once (not once per server).
        assert m["ec_frontend_generation_tokens_total"] == tokens
        assert m["ec_frontend_requests_finished_total"] == sent
        if len(scraped_by) == 2:
            break
    assert scraped_by == {"0", "1"}


def check_sigterm_drains_both(server: ServerProcess) -> None:
    """Streams in flight on both servers finish after SIGTERM while new requests
    get 503 from each server; the parent then exits 0."""
    max_tokens = 50  # 5 s at 100 ms a token: still streaming when SIGTERM comes
    streams: list[tuple[str, Iterator[openai.types.chat.ChatCompletionChunk]]] = []
    # Open streams (one connection each) until both servers have one in flight.
    while {index for index, _ in streams} != {"0", "1"}:
        assert len(streams) < 40, "every connection went to one server"
        raw = client(server.url).chat.completions.with_raw_response.create(
            model=MOCK_MODEL,
            messages=[{"role": "user", "content": "drain me"}],
            max_tokens=max_tokens,
            stream=True,
        )
        chunks = iter(raw.parse())
        next(chunks)
        streams.append((raw.headers[HEADER], chunks))
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    refused: set[str] = set()
    for _ in range(40):
        with client(server.url) as c, pytest.raises(openai.APIStatusError) as err:
            c.models.list()
        assert err.value.status_code == 503
        assert err.value.body["code"] == "draining"
        refused.add(err.value.response.headers[HEADER])
        if len(refused) == 2:
            break
    assert refused == {"0", "1"}
    outcomes: list[tuple[str | None, int]] = []
    lock = threading.Lock()

    def drain(chunks: Iterator[openai.types.chat.ChatCompletionChunk]) -> None:
        last, pieces = None, 0
        for chunk in chunks:
            if chunk.choices:
                last = chunk.choices[0].finish_reason or last
                pieces += bool(chunk.choices[0].delta.content)
        with lock:
            outcomes.append((last, pieces))

    threads = [threading.Thread(target=drain, args=(chunks,)) for _, chunks in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # Every token arrived (the first chunk read above carries the role only) and no
    # stream was aborted: the drain let them finish.
    assert outcomes == [("length", max_tokens)] * len(streams)
    assert server.proc.wait(30) == 0


def test_two_servers_spread_add_up_and_drain() -> None:
    server = group(2, "--mock-token-latency-ms", "100")
    tree = descendants(server.proc.pid)
    try:
        assert len(listening_servers(server.proc.pid, server.port)) == 2
        assert len(engines(server.proc.pid)) == 1
        check_spread_and_metrics(server)
        check_sigterm_drains_both(server)
    finally:
        server.kill()
        server.stop()
    assert wait_gone(tree) == set()


def test_a_dead_server_stops_the_group() -> None:
    server = group()
    try:
        tree = descendants(server.proc.pid)
        victims = listening_servers(server.proc.pid, server.port)
        assert len(victims) == 2
        os.kill(min(victims), signal.SIGKILL)
        try:
            code = server.proc.wait(30)
        except subprocess.TimeoutExpired:
            left = {pid: _cmdline(pid) for pid in alive(tree)}
            pytest.fail(f"the group still runs 30 s on: {left}\n{server.log()}")
        assert code != 0
        assert "stopping the group" in server.output()
    finally:
        server.kill()
        server.stop()
    assert wait_gone(tree) == set()


def test_a_dead_engine_stops_the_group() -> None:
    server = group()
    try:
        tree = descendants(server.proc.pid)
        (engine,) = engines(server.proc.pid)
        os.kill(engine, signal.SIGKILL)
        assert server.proc.wait(30) == 1
        assert "engine process" in server.output()
    finally:
        server.kill()
        server.stop()
    assert wait_gone(tree) == set()


def test_servers_die_with_the_parent() -> None:
    server = group()
    tree = descendants(server.proc.pid)
    assert len(tree) >= 2
    server.kill()
    server.stop()
    assert wait_gone(tree) == set()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--api-server-count", "0"], "--api-server-count must be > 0"),
        (["--api-server-count", "-1"], "--api-server-count must be > 0"),
        (
            ["--api-server-count", "2", "--engine-mode", "inprocess"],
            "--api-server-count > 1 needs --engine-mode multiprocess",
        ),
    ],
)
def test_bad_count_is_a_startup_error(flags: list[str], message: str) -> None:
    cli = [sys.executable, "-m", "ec_frontend.entrypoints.cli", "serve", "--mock-engine"]
    args = [*cli, "--port", str(free_port()), *flags]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr


def test_a_port_in_use_is_a_startup_error() -> None:
    """Another listener on the port (without SO_REUSEPORT) keeps the group out."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cli = [sys.executable, "-m", "ec_frontend.entrypoints.cli", "serve", "--mock-engine"]
        args = [*cli, "--port", str(port), "--api-server-count", "2"]
        done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"cannot bind 127.0.0.1:{port}" in done.stderr


def test_one_server_is_the_default(mock_server: ServerProcess) -> None:
    r = httpx.get(mock_server.url + "/health")
    assert r.status_code == 200
    assert HEADER not in r.headers
    assert listening_servers(mock_server.proc.pid, mock_server.port) == set()


class _ScriptedServer:
    """Stands in for an API server process: ``exitcode`` answers from a script (then
    its last entry, or 0 once the group is stopping), ``sentinel`` never becomes
    readable, so only the polled exit codes can reveal a death."""

    def __init__(self, group: Any, script: list[int | None], sentinel: int) -> None:
        self.group, self.script, self.sentinel = group, script, sentinel
        self.name, self.pid = f"scripted-{len(script)}", None

    @property
    def exitcode(self) -> int | None:
        if self.group.stops:
            return self.script[-1] if self.script[-1] is not None else 0
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]


def test_a_death_between_two_polls_still_stops_the_group() -> None:
    """A server whose exit is first seen where the supervisor lists the live servers
    (it exited just after the previous pass checked it) stops the group: before the
    fix it was dropped from that list unreported and the group ran on."""
    from ec_frontend.entrypoints.api_servers import ServerGroup
    from ec_frontend.entrypoints.launcher import ServeOptions

    group = ServerGroup(ServeOptions(drain_timeout_s=1.0))
    pipes = [os.pipe(), os.pipe()]
    try:
        # Pass 1: listed live (None), checked (None); pass 2: listed, now exited.
        victim = _ScriptedServer(group, [None, None, -signal.SIGKILL], pipes[0][0])
        survivor = _ScriptedServer(group, [None], pipes[1][0])
        group.procs = [victim, survivor]  # type: ignore[list-item]
        outcome: list[int] = []
        waiter = threading.Thread(target=lambda: outcome.append(group.wait()), daemon=True)
        waiter.start()
        waiter.join(10)
        assert outcome == [1], "the group did not notice the dead server"
        assert group.stops == 1
    finally:
        for fd in (fd for pipe in pipes for fd in pipe):
            os.close(fd)
