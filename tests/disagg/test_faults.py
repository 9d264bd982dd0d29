"""Faults in a disaggregated deployment: everything is answered or fails cleanly, nothing hangs.

Processes (one set for the module; tests run in file order and later ones
rely on what earlier ones killed):

* ``e1``, ``e2``: side-channel encoders (items expire after ``TTL_S``);
* ``pd``: side-channel EC consumer (pull timeout ``PULL_TIMEOUT_S``) and KV
  producer (held KV expires after ``TTL_S``);
* ``d``: KV consumer; ``pd_ss``: shared-storage EC consumer;
* ``px``: proxy ``e1, e2 -> pd``; ``px_down``: a proxy whose encoders do not exist.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from ec_frontend.entrypoints.proxy.app import as_references, item_uuid, part_key

from ..helpers.processes import Proc, free_port, start_all
from .conftest import (
    MODEL_NAME,
    RelayEncoder,
    messages,
    png_data_url,
    proxy,
    resign,
    resign_ec,
    serve,
    shared_storage_ec,
    side_channel_ec,
    side_channel_kv,
)

pytestmark = pytest.mark.slow

TTL_S = 4.0
IDLE_GAUGES = (
    "kv_blocks_used",
    "kv_requests_held",
    "ec_items_held",
    "encoder_cache_refs",
    "num_requests_running",
    "num_requests_waiting",
)
PULL_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def dep(
    builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    shared = tmp_path_factory.mktemp("ec-shared-faults")
    m = builtin_model_dir
    procs = {
        "e1": serve(m, "e1", ec=side_channel_ec("ec_producer", ttl_s=TTL_S)),
        "e2": serve(m, "e2", ec=side_channel_ec("ec_producer", ttl_s=TTL_S)),
        "pd": serve(
            m,
            "pd",
            ec=side_channel_ec("ec_consumer", timeout_s=PULL_TIMEOUT_S),
            kv=side_channel_kv("kv_both", ttl_s=TTL_S),
        ),
        "d": serve(m, "d", kv=side_channel_kv("kv_consumer", timeout_s=PULL_TIMEOUT_S)),
        "pd_ss": serve(m, "pd_ss", ec=shared_storage_ec("ec_consumer", shared)),
    }
    start_all(list(procs.values()))
    nowhere = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    px = proxy("px", encode=[procs["e1"].url, procs["e2"].url], decode=[procs["pd"].url])
    px_down = proxy("px_down", encode=nowhere, decode=[procs["pd"].url])
    start_all([px, px_down])
    yield {**procs, "px": px, "px_down": px_down, "shared": shared}
    for p in (*procs.values(), px, px_down):
        p.stop()


_colors = iter(range(1, 10_000))


def fresh_image() -> str:
    k = next(_colors)
    return png_data_url(56, ((k * 37) % 256, (k * 91) % 256, (k * 53) % 256))


def chat(url: str, msgs: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": msgs, "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def metric(p: Proc, name: str) -> float:
    return p.metric(name)


def encoder_params(e: Proc, image: str) -> dict[str, Any]:
    """The real ``ec_transfer_params`` an encoder gives for ``image``."""
    r = chat(e.url, messages("x", image), max_tokens=1)
    assert r.status_code == 200, r.text
    params = r.json()["ec_transfer_params"]
    assert isinstance(params, dict) and len(params) == 1
    return params


def test_encoder_killed_mid_run_requests_still_answered(dep: dict[str, Any]) -> None:
    px, e1 = dep["px"], dep["e1"]
    images = [fresh_image() for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(chat, px.url, messages("what", img)) for img in images]
        time.sleep(0.05)
        e1.kill()
        results = [f.result() for f in futures]
    failed = [r.text for r in results if r.status_code != 200]
    assert [r.status_code for r in results] == [200] * 8, failed
    after = [chat(px.url, messages("and now", fresh_image())) for _ in range(4)]
    assert [r.status_code for r in after] == [200] * 4, [r.text[:300] for r in after]
    assert [r.headers.get("x-ec-fallback") for r in after] == [None] * 4, px.metrics()
    assert metric(px, "proxy_encoder_retries_total") >= 1, px.metrics()


def test_all_encoders_down_falls_back_to_local_encode(dep: dict[str, Any]) -> None:
    px, pd = dep["px_down"], dep["pd"]
    computed = metric(pd, "encoder_items_computed_total")
    r = chat(px.url, messages("fallback", fresh_image()))
    assert r.status_code == 200, r.text
    assert r.headers["x-ec-fallback"] == "local-encode"
    assert metric(px, "proxy_encoder_fallbacks_total") == 1
    assert metric(pd, "encoder_items_computed_total") == computed + 1


class SilentPeer:
    """A listening socket that accepts connections into its backlog and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("peer", ["refused", "silent"])
def test_side_channel_peer_gone_falls_back_within_the_timeout(
    dep: dict[str, Any], peer: str
) -> None:
    pd = dep["pd"]
    image = fresh_image()
    params = encoder_params(dep["e2"], image)
    silent = SilentPeer() if peer == "silent" else None
    port = silent.port if silent is not None else free_port()
    params = resign_ec(params, peer_port=port)
    fallbacks = metric(pd, "ec_load_fallbacks_total")
    try:
        started = time.monotonic()
        r = chat(pd.url, messages("gone", image), ec_transfer_params=params)
        elapsed = time.monotonic() - started
    finally:
        if silent is not None:
            silent.close()
    assert r.status_code == 200, r.text
    assert metric(pd, "ec_load_fallbacks_total") == fallbacks + 1
    assert elapsed < PULL_TIMEOUT_S + 5
    if peer == "silent":
        assert elapsed >= PULL_TIMEOUT_S


def test_a_request_waiting_for_its_items_does_not_stall_the_batch(dep: dict[str, Any]) -> None:
    pd = dep["pd"]
    image = fresh_image()
    params = encoder_params(dep["e2"], image)
    silent = SilentPeer()
    params = resign_ec(params, peer_port=silent.port)
    try:
        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            waiting = pool.submit(chat, pd.url, messages("slow", image), ec_transfer_params=params)
            time.sleep(0.3)
            quick = chat(pd.url, messages("meanwhile"), max_tokens=8)
            quick_done = time.monotonic() - started
            slow = waiting.result()
            slow_done = time.monotonic() - started
    finally:
        silent.close()
    assert quick.status_code == 200 and slow.status_code == 200
    assert quick_done < PULL_TIMEOUT_S <= slow_done


@pytest.mark.parametrize("content", [b"", b"not a safetensors file at all", b"\xff" * 64])
def test_corrupt_shared_storage_file_falls_back(dep: dict[str, Any], content: bytes) -> None:
    pd_ss, shared = dep["pd_ss"], dep["shared"]
    image = fresh_image()
    (mm_hash,) = encoder_params(dep["e2"], image)
    (shared / f"{mm_hash}.safetensors").write_bytes(content)
    fallbacks = metric(pd_ss, "ec_load_fallbacks_total")
    computed = metric(pd_ss, "encoder_items_computed_total")
    r = chat(pd_ss.url, messages("corrupt", image))
    assert r.status_code == 200, r.text
    assert metric(pd_ss, "ec_load_fallbacks_total") == fallbacks + 1
    assert metric(pd_ss, "encoder_items_computed_total") == computed + 1


def prefill(pd: Proc, ids: list[int]) -> dict[str, Any]:
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 0},
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    r = httpx.post(pd.url + "/inference/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def referenced(e: Proc, image: str, port: int) -> dict[str, Any]:
    """A chat body as the proxy sends it on after ``e`` encoded ``image`` (a
    metadata-only reference and the encoder's params), with the params naming
    ``port`` as the encoder's side channel: an encoder that answered, then died."""
    body = {"model": MODEL_NAME, "messages": messages("ref", image), "max_tokens": 4}
    part = body["messages"][0]["content"][0]
    item = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": [{**part, "uuid": item_uuid(part)}]}],
        "max_tokens": 1,
    }
    r = httpx.post(e.url + "/v1/chat/completions", json=item, timeout=60)
    assert r.status_code == 200, r.text
    params = r.json()["ec_transfer_params"]
    (entry,) = params.values()
    out = as_references(body, {part_key(part): entry["metadata"]})
    out["ec_transfer_params"] = resign_ec(params, peer_port=port)
    out["temperature"] = 0
    return out


def sse_events(r: httpx.Response) -> list[dict[str, Any]]:
    """The JSON events of a streamed answer (``[DONE]`` left out)."""
    return [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]


def stream_error(r: httpx.Response) -> dict[str, Any]:
    errors = [e["error"] for e in sse_events(r) if "error" in e]
    assert len(errors) == 1, r.text
    return errors[0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_reference_whose_encoder_is_gone_is_a_502(dep: dict[str, Any], stream: bool) -> None:
    """The reference carries no image, so there is nothing to encode locally: the request
    fails with ``ec_item_unavailable`` (a proxy then sends the image), the rest goes on."""
    pd = dep["pd"]
    body = referenced(dep["e2"], fresh_image(), free_port())
    fallbacks = metric(pd, "ec_load_fallbacks_total")
    r = httpx.post(pd.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=60)
    if stream:
        assert r.status_code == 200, r.text
        error = stream_error(r)
    else:
        assert r.status_code == 502, r.text
        error = r.json()["error"]
    assert error["code"] == "ec_item_unavailable", error
    assert "EC transfer of media item" in error["message"], error
    assert metric(pd, "ec_load_fallbacks_total") == fallbacks + 1
    assert chat(pd.url, messages("still here", fresh_image())).status_code == 200


def test_the_proxy_sends_the_image_when_the_encoded_item_is_gone(dep: dict[str, Any]) -> None:
    """E+PD through the proxy, the encoder gone between its answer and PD's pull: the
    proxy sends the request again with its image inline; PD encodes it; the answer
    equals the one for the image sent straight to PD."""
    pd = dep["pd"]
    # The encoder answers, then is gone before PD pulls: its params name a dead port.
    dead_port = free_port()
    encoder = RelayEncoder(dep["e2"].url, lambda p: resign_ec(p, peer_port=dead_port))
    px = proxy("px_dying", encode=[encoder.url], decode=[pd.url])
    try:
        start_all([px])
        for stream in (False, True):
            image = fresh_image()
            computed = metric(pd, "encoder_items_computed_total")
            body = {"model": MODEL_NAME, "messages": messages("what", image), "max_tokens": 4,
                    "temperature": 0, "stream": stream}  # fmt: skip
            r = httpx.post(px.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.headers.get("x-ec-fallback") == "local-encode"
            assert "error" not in r.text, r.text
            assert metric(pd, "encoder_items_computed_total") == computed + 1
            text = (
                "".join(e["choices"][0]["delta"].get("content", "") for e in sse_events(r))
                if stream
                else r.json()["choices"][0]["message"]["content"]
            )
            direct = chat(pd.url, messages("what", image))
            assert direct.status_code == 200, direct.text
            assert text == direct.json()["choices"][0]["message"]["content"]
        assert metric(px, "proxy_reference_retries_total") == 2
    finally:
        px.stop()
        encoder.close()


def test_unpulled_kv_is_freed_after_the_ttl(dep: dict[str, Any]) -> None:
    pd = dep["pd"]
    prefill(pd, [3, 1, 4, 1, 5, 9, 2, 6])
    assert metric(pd, "kv_requests_held") == 1
    assert metric(pd, "kv_blocks_used") > 0
    deadline = time.monotonic() + TTL_S + 5
    while metric(pd, "kv_requests_held") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(pd, "kv_requests_held") == 0
    assert metric(pd, "kv_blocks_used") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_prefill_killed_after_answering_decode_errors_cleanly(
    dep: dict[str, Any], stream: bool
) -> None:
    pd, d = dep["pd"], dep["d"]
    ids = [7, 8, 9, 10, 11, 12, 13]
    if pd.proc.poll() is None:
        kv = prefill(pd, ids)
        dep["dead_prefill_params"] = kv
        pd.kill()
    # Signed afresh for each use: the same signed params twice would be a replay.
    kv = resign("kv", dep["dead_prefill_params"]["remote_request_id"], dep["dead_prefill_params"])
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 8, "temperature": 0},
            "kv_transfer_params": kv, "stream": stream}  # fmt: skip
    started = time.monotonic()
    r = httpx.post(d.url + "/inference/v1/generate", json=body, timeout=60)
    assert time.monotonic() - started < PULL_TIMEOUT_S + 5
    if stream:
        assert r.status_code == 200
        assert "KV transfer from the prefill instance" in r.text
        assert '"code":"kv_transfer_failed"' in r.text
    else:
        # Signed params: a trusted prefill instance failed, so the decode instance is a gateway.
        assert r.status_code == 502
        error = r.json()["error"]
        assert "KV transfer from the prefill instance" in error["message"]
        assert error["code"] == "kv_transfer_failed"
    assert httpx.get(d.url + "/health").status_code == 200


def test_idle_after_faults_nothing_leaked(dep: dict[str, Any]) -> None:
    alive: list[Proc] = [dep["e2"], dep["d"], dep["pd_ss"]]
    deadline = time.monotonic() + TTL_S + 5

    def leaks() -> dict[str, float]:
        out = {}
        for p in alive:
            m = p.metrics()
            for name in IDLE_GAUGES:
                value = m.get("ec_frontend_" + name, 0.0)
                if value:
                    out[f"{p.name}.{name}"] = value
        return out

    while leaks() and time.monotonic() < deadline:
        time.sleep(0.25)
    assert leaks() == {}
