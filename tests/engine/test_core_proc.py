"""The engine core in its own process: the wire schema, streamed detokenization, the
process handle and two clients on one engine (real process, real ZMQ sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ec_frontend.engine.async_engine import AsyncEngine
from ec_frontend.engine.core import EngineCore
from ec_frontend.engine.core_proc import EngineProcess, EngineSpec
from ec_frontend.engine.detokenizer import (
    IncrementalDetokenizer,
    StreamDetokenizer,
    make_detokenizer,
)
from ec_frontend.engine.mp_client import MPEngineClient
from ec_frontend.engine.outputs import RequestOutput
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.engine.wire import Codec, pack_dataclass, unpack_fields
from ec_frontend.errors import StartupError
from ec_frontend.model.processor import MultiModalFeature, ProcessedInputs

from .conftest import chat_inputs, engine_config, image_media

# ---- the wire schema ------------------------------------------------------------


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.int64).reshape(3, 4),
        torch.randn(5, 7, generator=torch.Generator().manual_seed(0)),
        torch.randn(4, 3, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
        torch.zeros(0, 1176),
        torch.arange(10, dtype=torch.float32)[::2],  # not contiguous
        torch.tensor(3.5),
    ],
    ids=["int64", "float32", "bfloat16", "empty", "strided", "scalar"],
)
def test_tensor_frames_round_trip(tensor: torch.Tensor) -> None:
    codec = Codec()
    frames = codec.encode(("add", {"t": tensor, "n": 3}))
    assert len(frames) == 2, "the tensor travels as one extra frame"
    kind, body = Codec().decode([bytes(f) for f in frames])
    assert kind == "add" and body["n"] == 3
    out = body["t"]
    assert out.dtype == tensor.dtype and tuple(out.shape) == tuple(tensor.shape)
    assert torch.equal(out, tensor)


def test_ndarray_and_nested_dataclasses_round_trip() -> None:
    pixels = torch.randn(16, 1176, generator=torch.Generator().manual_seed(2))
    inputs = ProcessedInputs(
        prompt_token_ids=[1, 2, 3, 4],
        mm_features=[MultiModalFeature("h0", 1, 2, (1, 2, 2), pixels)],
        mrope_positions=torch.arange(12, dtype=torch.int64).reshape(3, 4),
        mrope_position_delta=-2,
        prompt="p",
        cache_salt="salt",
    )
    codec = Codec()
    frames = codec.encode(("add", pack_dataclass(inputs), np.arange(6, dtype=np.int32)))
    assert len(frames) == 4
    _, packed, arr = Codec().decode(frames)
    kwargs = unpack_fields(packed)
    kwargs["mm_features"] = [MultiModalFeature(**unpack_fields(f)) for f in kwargs["mm_features"]]
    back = ProcessedInputs(**kwargs)
    assert back.mm_features[0].image_grid_thw == (1, 2, 2)
    assert torch.equal(back.mm_features[0].pixel_values, pixels)
    assert torch.equal(back.mrope_positions, inputs.mrope_positions)
    assert back.prompt_token_ids == [1, 2, 3, 4]
    assert (back.mrope_position_delta, back.cache_salt) == (-2, "salt")
    assert arr.dtype == np.int32 and arr.tolist() == list(range(6))


def test_unsupported_object_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="cannot send a object"):
        Codec().encode(("add", object()))


# ---- streamed detokenization ------------------------------------------------------


def _run_detok(detok: IncrementalDetokenizer, tokens: list[int], chunk: int) -> tuple[str, Any]:
    text, stop = "", None
    for i in range(0, len(tokens), chunk):
        part = tokens[i : i + chunk]
        finished = i + chunk >= len(tokens)
        stop = detok.update(part, finished)
        text += detok.take_delta(finished or stop is not None)
        if stop is not None:
            break
    return text, stop


@pytest.mark.parametrize("kind", ["stream", "piece"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stop", [[], ["e"], ["the", "\n\n"]])
def test_per_token_detokenizers_match_the_window_detokenizer(
    processor: Any, kind: str, seed: int, stop: list[str]
) -> None:
    """DecodeStream (a fast Hugging Face tokenizer) and the token -> text pieces (the
    mock's characters) give the text, the stop string and the stream deltas of the
    decode-window detokenizer, over random ids (multi-byte pieces, special tokens),
    with special tokens skipped and kept."""
    from ec_frontend.engine.detokenizer import PieceDetokenizer
    from ec_frontend.engine.mock import CharTokenizer

    rng = random.Random(seed)
    text = "Grüße, 東京! the café\n\nend"
    if kind == "stream":
        tok, cls = processor.tokenizer, StreamDetokenizer
        sample = tok.encode(text)
        tokens = [rng.choice([*sample, rng.randrange(len(tok))]) for _ in range(40)]
    else:
        tok, cls = CharTokenizer(), PieceDetokenizer
        sample = [*tok.encode(text), tok.eos_token_id]
        tokens = [rng.choice(sample) for _ in range(60)]
    prompt = tok.encode("user: hi")
    skip = seed % 2 == 0
    params = SamplingParams(stop=list(stop), max_tokens=64, skip_special_tokens=skip)
    chunk = 1 + seed % 3
    per_token = make_detokenizer(tok, prompt, params)
    assert isinstance(per_token, cls)
    got = _run_detok(per_token, tokens, chunk)
    want = _run_detok(IncrementalDetokenizer(tok, prompt, params), tokens, chunk)
    assert got == want
    assert got[0] or got[1] is not None


# ---- the output channel ---------------------------------------------------------------


def _channel(tmp_path: Path) -> tuple[Any, Any, str]:
    import zmq
    from ec_frontend.engine.core_proc import OutputChannel

    path = str(tmp_path / "out.sock")
    channel = OutputChannel(path)
    poller = zmq.Poller()
    channel.poller = poller
    channel.watch(channel.listener, zmq.POLLIN)
    return channel, poller, path


def _hello(path: str, identity: bytes, rcvbuf: int | None = None) -> Any:
    import socket

    from ec_frontend.engine.wire import HELLO, stream_frame

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(path)
    sock.sendall(stream_frame(Codec().encode_header((HELLO, identity))))
    return sock


def _serve(channel: Any, poller: Any, rounds: int = 5) -> list[bytes]:
    greeted = []
    for _ in range(rounds):
        greeted += channel.handle(dict(poller.poll(20)))
    return greeted


def test_output_channel_never_blocks_on_a_slow_client(tmp_path: Path) -> None:
    """A client that does not read keeps what the kernel would not take in the
    channel's outbox (``send`` returns at once, the other client gets its frames);
    once it reads, every frame arrives whole and in order; a client that hangs up is
    dropped and later sends to it are discarded; a bad hello closes the connection."""
    from ec_frontend.engine.wire import FrameReader

    channel, poller, path = _channel(tmp_path)
    slow, fast = _hello(path, b"slow", rcvbuf=4096), _hello(path, b"fast")
    assert sorted(_serve(channel, poller)) == [b"fast", b"slow"]
    payloads = [bytes([i % 251]) * (50_000 + i) for i in range(40)]
    start = time.monotonic()
    for payload in payloads:
        channel.send(b"slow", payload)
        channel.send(b"fast", payload[:10])
    assert time.monotonic() - start < 2.0
    assert len(channel._by_identity[b"slow"].outbox) > 0

    fast.settimeout(5)
    got_fast: list[bytes] = []
    reader = FrameReader()
    while len(got_fast) < len(payloads):
        got_fast += reader.feed(fast.recv(65536))
    assert got_fast == [p[:10] for p in payloads]

    slow.setblocking(False)
    reader, got_slow = FrameReader(), []
    deadline = time.monotonic() + 30
    while len(got_slow) < len(payloads) and time.monotonic() < deadline:
        channel.handle(dict(poller.poll(5)))
        with contextlib.suppress(BlockingIOError):
            got_slow += reader.feed(slow.recv(1 << 20))
    assert got_slow == payloads
    assert not channel._by_identity[b"slow"].outbox

    slow.close()
    _serve(channel, poller)
    assert b"slow" not in channel._by_identity
    channel.send(b"slow", b"gone")  # discarded, no error

    import socket

    bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bad.connect(path)
    bad.sendall(b"\x05\x00\x00\x00hello")
    bad.settimeout(5)
    _serve(channel, poller)
    assert bad.recv(10) == b""  # closed by the engine
    assert set(channel._by_identity) == {b"fast"}
    for sock in (fast, bad):
        sock.close()
    channel.close()


# ---- the process handle -------------------------------------------------------------


def test_startup_error_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = dataclasses.replace(engine_config(), model=str(tmp_path / "missing"))
    handle = EngineProcess.launch(EngineSpec(config))
    with pytest.raises(StartupError) as info:
        handle.wait_ready(timeout=120)
    assert "\n" not in str(info.value) and str(info.value)
    assert handle.proc.returncode == 2
    assert not Path(handle.directory).exists()


# ---- clients on one engine --------------------------------------------------------


async def _collect(stream: Any) -> RequestOutput:
    acc: RequestOutput | None = None
    async for out in stream:
        if acc is None:
            acc = out
        else:
            acc.add(out)
    assert acc is not None
    return acc


def _idle(stats: Any) -> bool:
    return stats.requests_finished_total == 4 and stats.num_requests_running == 0


def _greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.slow
def test_multiprocess_engine_matches_in_process_and_serves_two_clients(
    builtin_model_dir: Path, processor: Any
) -> None:
    """Two clients of one engine process get the in-process engine's tokens and text
    (text and image prompts: pixel values and M-RoPE positions as frames), each its
    own outputs for the same request id, stats from every step, abort and stop."""
    config = dataclasses.replace(engine_config(), model=str(builtin_model_dir))
    prompts = [
        chat_inputs(processor, "describe", [image_media(3)]),
        chat_inputs(processor, "hello there", []),
    ]
    model = EngineCore.load_model(config, builtin_model_dir)
    eos = processor.eos_token_id
    core = EngineCore(config, model, tokenizer=processor.tokenizer, eos_token_id=eos)
    local = AsyncEngine(core, processor)

    async def run_local() -> list[RequestOutput]:
        outs = [
            await _collect(local.add_request(f"l{i}", p, _greedy(12)))
            for i, p in enumerate(prompts)
        ]
        # Ended by one of stop_token_ids: the first k tokens' text, the stop token's left out.
        ids = outs[1].token_ids
        k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
        by_token = _greedy(12, stop_token_ids=[ids[k]])
        outs.append(await _collect(local.add_request("token", prompts[1], by_token)))
        outs.append(await _collect(local.add_request("first-k", prompts[1], _greedy(k))))
        return outs

    try:
        expected = asyncio.run(run_local())
    finally:
        local.shutdown()
    by_token, first_k = expected[2:]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == by_token.token_ids[-1]
    assert by_token.token_ids == [*first_k.token_ids, by_token.stop_reason]
    assert by_token.text == first_k.text
    token = by_token.stop_reason

    handle = EngineProcess.start(EngineSpec(config, cpu_threads=1), num_clients=2, timeout=300)
    clients = [
        MPEngineClient(handle.address, config=config, processor=processor, client_index=i)
        for i in range(2)
    ]

    async def run_remote() -> dict[str, Any]:
        same_id = [c.add_request("same", prompts[i], _greedy(12)) for i, c in enumerate(clients)]
        long = clients[1].add_request("long", prompts[1], _greedy(400))
        first = await long.__anext__()
        await clients[1].abort("long")
        aborted = await _collect(long)
        # A stop string found by the client ends the request in the core.
        text = expected[1].text
        stop_at = text[len(text) // 2 :][:3] or text[:1]
        stopped = await _collect(
            clients[0].add_request("stop", prompts[1], _greedy(12, stop=[stop_at]))
        )
        outs = await asyncio.gather(*(_collect(s) for s in same_id))
        by_token = await _collect(
            clients[1].add_request("token", prompts[1], _greedy(12, stop_token_ids=[token]))
        )
        return {"same": outs, "first": first, "aborted": aborted, "stopped": stopped,
                "stop": stop_at, "token": by_token}  # fmt: skip

    try:
        got = asyncio.run(run_remote())
        for i, out in enumerate(got["same"]):
            assert out.request_id == "same" and out.finish_reason == "length"
            assert out.token_ids == expected[i].token_ids
            assert out.text == expected[i].text
        assert got["first"].token_ids and got["aborted"].finish_reason == "abort"
        stopped = got["stopped"]
        assert stopped.finish_reason == "stop" and stopped.stop_reason == got["stop"]
        assert expected[1].text.startswith(stopped.text) and got["stop"] not in stopped.text
        remote = got["token"]
        assert (remote.token_ids, remote.text) == (by_token.token_ids, by_token.text)
        assert (remote.finish_reason, remote.stop_reason) == ("stop", token)
        # Every client gets every step's stats (each on its own I/O thread).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(_idle(c.stats()) for c in clients):
            time.sleep(0.05)
        for c in clients:
            stats = c.stats()
            assert stats.requests_finished_total == 5 and stats.num_requests_running == 0
            assert c.is_running and not c.holds_request("same")
    finally:
        for c in clients:
            c.shutdown()
        code = handle.terminate(timeout=10)
    assert code == 0
    assert not Path(handle.directory).exists()


# ---- the mock model behind the engine core -------------------------------------------

TRANSFER = {"kv_transfer_params": {"k": 1}, "ec_transfer_params": {"e": {}}}
FAIL_AFTER_3 = {"mock_fail_after": 3}
MOCK_CASES = [
    ("echo", "hello world", {"max_tokens": 8, "temperature": 0.0}),
    ("default length", "abc", {"max_tokens": None, "temperature": 0.0}),
    ("seeded", "the quick brown fox", {"max_tokens": 12, "temperature": 1.0, "seed": 7}),
    ("stop string", "abcdefabcdef", {"max_tokens": 12, "temperature": 0.0, "stop": ["def"]}),
    ("stop token", "hello", {"max_tokens": 8, "temperature": 0.0, "stop_token_ids": [ord("l")]}),
    ("logprobs", "xyz", {"max_tokens": 4, "temperature": 0.0, "logprobs": 2}),
    ("transfer params", "abc", {"max_tokens": 3, "temperature": 0.0, "extra_args": TRANSFER}),
    ("failure", "abcdef", {"max_tokens": 6, "temperature": 0.0, "extra_args": FAIL_AFTER_3}),
]


def _mock_view(out: RequestOutput) -> tuple[Any, ...]:
    lps = None
    if out.logprobs is not None:
        lps = [(lp.token_id, lp.logprob, lp.rank, list(map(tuple, lp.top))) for lp in out.logprobs]
    return (
        out.token_ids if out.finish_reason != "error" else None,
        out.text if out.finish_reason != "error" else None,
        out.finish_reason, out.stop_reason, lps,
        out.kv_transfer_params, out.ec_transfer_params, out.error,
    )  # fmt: skip


def test_client_serves_streams_of_several_event_loops() -> None:
    """The engine's messages are read on one running loop (the first request's);
    streams of a second loop, running at the same time in another thread, get their
    deltas posted there; once both loops are gone a third loop takes over the
    reading. Stats read between loops are current."""
    import threading

    from ec_frontend.engine.mock import MockEngineConfig

    client = MPEngineClient.start(MockEngineConfig(model="m"), kind="mock")
    started, second_done = threading.Event(), threading.Event()

    async def run(name: str, n: int, max_tokens: int) -> list[RequestOutput]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        prompt = client.processor.process_prompt("abcdefgh" * 4)
        streams = [client.add_request(f"{name}-{i}", prompt, params) for i in range(n)]
        started.set()
        outs = list(await asyncio.gather(*(_collect(s) for s in streams)))
        if name == "first":
            # The first loop runs on (and reads) until the second loop is done.
            await asyncio.to_thread(second_done.wait, 30)
        return outs

    results: dict[str, list[RequestOutput]] = {}

    def in_thread(name: str) -> None:
        started.wait(10)
        try:
            results[name] = asyncio.run(run(name, 3, 24))
        finally:
            second_done.set()

    try:
        other = threading.Thread(target=in_thread, args=("second",))
        other.start()
        results["first"] = asyncio.run(run("first", 3, 200))
        other.join(60)
        assert not other.is_alive()
        results["third"] = asyncio.run(run("third", 2, 8))
        finished = client.stats().requests_finished_total
    finally:
        client.shutdown()
    want = {"first": 200, "second": 24, "third": 8}
    for name, outs in results.items():
        assert [o.finish_reason for o in outs] == ["length"] * len(outs), name
        assert [len(o.token_ids) for o in outs] == [want[name]] * len(outs), name
        assert all(o.text == ("abcdefgh" * 4 * 30)[: want[name]] for o in outs), name
    assert finished == 8


@pytest.mark.slow
def test_mock_core_in_its_process_answers_as_the_in_process_mock() -> None:
    """``--mock-engine`` with the multiprocess engine (the mock model behind the real
    engine core, over ZMQ) gives the in-process mock engine's tokens, text, stops,
    logprobs, transfer params and failures, without loading torch."""
    from ec_frontend.engine.mock import MockEngine, MockEngineConfig

    cfg = MockEngineConfig(model="m")
    local = MockEngine(cfg)
    remote = MPEngineClient.start(cfg, kind="mock")

    async def run(engine: Any) -> list[RequestOutput]:
        outs = []
        for name, prompt, kw in MOCK_CASES:
            inputs = engine.processor.process_prompt(prompt)
            stream = engine.add_request(name, inputs, SamplingParams(**kw))
            outs.append(await _collect(stream))
        return outs

    async def backlog(engine: Any) -> tuple[bool, int, bool]:
        """A stream whose request already finished in the engine: every delta is
        there (``ready``) without waiting, and none is lost or merged."""
        inputs = engine.processor.process_prompt("a backlog of steps")
        stream = engine.add_request("backlog", inputs, SamplingParams(max_tokens=8))
        deadline = time.monotonic() + 30
        while engine.holds_request("backlog") and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        first = await stream.__anext__()
        ready = stream.ready()
        deltas = [first]
        async for out in stream:
            deltas.append(out)
        return ready, sum(len(d.token_ids) for d in deltas), stream.ready()

    try:
        want = asyncio.run(run(local))
        got = asyncio.run(run(remote))
        ready_after_first, backlog_tokens, ready_at_end = asyncio.run(backlog(remote))
        # Its startup is the server's: the mock engine process never loads torch.
        maps = Path(f"/proc/{remote.pid}/maps").read_text()
    finally:
        remote.shutdown()
    assert "libtorch" not in maps
    for (name, _, _), w, g in zip(MOCK_CASES, want, got, strict=True):
        assert _mock_view(g) == _mock_view(w), name
    assert remote.process is not None and remote.process.proc.returncode == 0
    assert (ready_after_first, backlog_tokens, ready_at_end) == (True, 8, False)
