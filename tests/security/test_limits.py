"""Resource bounds (issue 15, H3, M2, M3, M4 and the client-caused 500s) on real servers.

Each limit answers its status code naming the limit, the server stays healthy,
and for the expensive inputs (a decompression bomb, an upscaling processor
kwarg, a huge prompt, a huge fan-out) the server's resident memory is back
within 10% of a warmed-up baseline: the refusal happens before the cost.
Small configured limits keep the payloads small.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import struct
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from PIL import Image

from ..helpers.processes import Proc

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
#: The model server's bounds (small, so that payloads stay small).
REQUEST_PIXELS = 20_000_000
FANOUT = 64
#: The built-in checkpoint's ``max_pixels``.
CHECKPOINT_MAX_PIXELS = 50176


def rss_kib(pid: int) -> int:
    """Resident set size of process ``pid`` (``VmRSS`` in KiB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def assert_rss_back(proc: Proc, baseline: int, what: str) -> None:
    """RSS within 10% of ``baseline`` (allowing a moment for freed memory to return)."""
    deadline = time.monotonic() + 5.0
    now = rss_kib(proc.proc.pid)
    while now > baseline * 1.10 and time.monotonic() < deadline:
        time.sleep(0.2)
        now = rss_kib(proc.proc.pid)
    assert now <= baseline * 1.10, f"{what}: RSS {now} KiB vs baseline {baseline} KiB"


def png_bomb(width: int, height: int) -> bytes:
    """A valid grayscale PNG of ``width x height`` zero pixels: tiny on the wire,
    ``width * height`` bytes (and 3x that as RGB) once decoded."""
    row = b"\x00" * (width + 1)  # filter byte + pixels
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat_body(urls: list[str], **extra: Any) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "describe"}]
    content += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


SMALL_PNG = encoded(Image.new("RGB", (56, 56), (200, 30, 40)))


def post(proc: Proc, path: str, body: dict[str, Any], timeout: float = 60) -> httpx.Response:
    return httpx.post(proc.url + path, content=orjson.dumps(body), timeout=timeout)


def assert_error(r: httpx.Response, status: int, code: str, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err


def assert_healthy(proc: Proc) -> None:
    assert httpx.get(proc.url + "/health", timeout=10).status_code == 200
    r = post(proc, "/v1/chat/completions", chat_body([data_url(SMALL_PNG)]))
    assert r.status_code == 200, r.text


def warm_baseline(proc: Proc) -> int:
    """RSS after a few normal requests (allocator and caches warmed up)."""
    for _ in range(4):
        assert_healthy(proc)
    return rss_kib(proc.proc.pid)


@pytest.fixture(scope="module")
def model_server(builtin_model_dir: Path) -> Iterator[Proc]:
    """The built-in model on the CPU with one processing thread and no queue."""
    server = Proc(
        "serve",
        [
            "--model", str(builtin_model_dir), "--device", "cpu",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--max-request-pixels", str(REQUEST_PIXELS),
            "--max-fanout", str(FANOUT),
            "--processing-workers", "1", "--max-processing-queue", "0",
        ],
        "model server",
    ).wait_ready()  # fmt: skip
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def mock_server() -> Iterator[Proc]:
    """A mock engine taking 50 ms per token, 8 engine requests in flight at most,
    PNG as its only decoder and 4 media items per request."""
    server = Proc(
        "serve",
        [
            "--mock-engine", "--mock-token-latency-ms", "50",
            "--max-engine-requests", "8", "--image-formats", "PNG", "--max-media-items", "4",
        ],
        "mock server",
    ).wait_ready()  # fmt: skip
    yield server
    assert server.stop() == 0


# ---- images (M3) ------------------------------------------------------------------


def test_decompression_bomb_costs_no_memory(model_server: Proc) -> None:
    """The M3 image: an 8000x8000 PNG (about 64 KB, 192 MB as RGB) that the old 64 M
    pixel bound let through to the decoder, is refused from its header."""
    baseline = warm_baseline(model_server)
    bomb = data_url(png_bomb(8000, 8000))
    for _ in range(3):
        started = time.monotonic()
        r = post(model_server, "/v1/chat/completions", chat_body([bomb]))
        assert_error(r, 400, "image_too_large", "messages[0].content[1].image_url")
        assert "--max-image-pixels" in r.json()["error"]["message"]
        assert time.monotonic() - started < 5.0
    r = post(model_server, "/tokenize", chat_body([bomb]))
    assert_error(r, 400, "image_too_large")
    assert_healthy(model_server)
    assert_rss_back(model_server, baseline, "bomb")


def test_pixels_per_request(model_server: Proc) -> None:
    """Three 3000x3000 images pass one by one but not together (20 M pixels per request)."""
    image = data_url(png_bomb(3000, 3000))
    r = post(model_server, "/v1/chat/completions", chat_body([image] * 3))
    assert_error(r, 400, "too_many_pixels", "messages[0].content[3].image_url")
    assert post(model_server, "/v1/chat/completions", chat_body([image])).status_code == 200
    assert_healthy(model_server)


@pytest.mark.parametrize(
    ("data", "mime", "code"),
    [
        (SMALL_PNG, "image/jpeg", "mime_type_mismatch"),
        (encoded(Image.new("RGB", (32, 32)), "JPEG"), "image/png", "mime_type_mismatch"),
        (encoded(Image.new("RGB", (32, 32)), "TIFF"), "image/tiff", "invalid_image"),
        (b"GIF89a-not-really", "image/gif", "invalid_image"),
    ],
)
def test_decoders_and_mime_type(model_server: Proc, data: bytes, mime: str, code: str) -> None:
    """TIFF is outside the default decoder set; the declared type must match the content."""
    r = post(model_server, "/v1/chat/completions", chat_body([data_url(data, mime)]))
    assert_error(r, 400, code, "messages[0].content[1].image_url")


def test_other_default_formats_decode(model_server: Proc) -> None:
    for fmt, mime in (("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("BMP", "image/bmp"),
                      ("GIF", "image/gif")):  # fmt: skip
        data = encoded(Image.new("RGB", (56, 56), (10, 200, 30)), fmt)
        r = post(model_server, "/v1/chat/completions", chat_body([data_url(data, mime)]))
        assert r.status_code == 200, (fmt, r.text)
    # A JPEG with two pictures (as phone cameras write) is MPO to Pillow's JPEG decoder.
    buf = io.BytesIO()
    first, second = Image.new("RGB", (56, 56), (1, 2, 3)), Image.new("RGB", (56, 56))
    first.save(buf, format="MPO", save_all=True, append_images=[second])
    r = post(
        model_server, "/v1/chat/completions", chat_body([data_url(buf.getvalue(), "image/jpeg")])
    )
    assert r.status_code == 200, r.text


def test_configured_decoder_set_and_item_count(mock_server: Proc) -> None:
    """``--image-formats PNG``: a JPEG is refused even on the mock engine;
    ``--max-media-items 4``: a fifth image is refused."""
    jpeg = data_url(encoded(Image.new("RGB", (32, 32)), "JPEG"), "image/jpeg")
    assert_error(post(mock_server, "/v1/chat/completions", chat_body([jpeg])), 400, "invalid_image")
    png = data_url(SMALL_PNG)
    assert post(mock_server, "/v1/chat/completions", chat_body([png] * 4)).status_code == 200
    r = post(mock_server, "/v1/chat/completions", chat_body([png] * 5))
    assert r.status_code == 400, r.text
    assert "media" in r.json()["error"]["message"]


# ---- processor kwargs (H3) --------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_pixels": 40_000_000},
        {"max_pixels": 40_000_000},
        {"min_pixels": CHECKPOINT_MAX_PIXELS + 1},
        {"max_pixels": 10},
        {"min_pixels": 10_000, "max_pixels": 5_000},
        {"size": {"shortest_edge": 40_000_000}},
    ],
)
def test_processor_kwargs_within_checkpoint_range(
    model_server: Proc, kwargs: dict[str, Any]
) -> None:
    """The 334-byte upscaling request of H3 is refused before any allocation."""
    baseline = warm_baseline(model_server)
    small = data_url(encoded(Image.new("RGB", (28, 28))))
    started = time.monotonic()
    r = post(model_server, "/v1/chat/completions", chat_body([small], mm_processor_kwargs=kwargs))
    assert_error(r, 400, "invalid_processor_kwargs", "mm_processor_kwargs")
    assert time.monotonic() - started < 5.0
    assert_rss_back(model_server, baseline, f"mm_processor_kwargs {kwargs}")


def test_processor_kwargs_inside_range_accepted(model_server: Proc) -> None:
    small = data_url(encoded(Image.new("RGB", (28, 28))))
    kwargs = {"min_pixels": CHECKPOINT_MAX_PIXELS, "max_pixels": CHECKPOINT_MAX_PIXELS}
    r = post(model_server, "/v1/chat/completions", chat_body([small], mm_processor_kwargs=kwargs))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 50  # upscaled to the checkpoint's maximum


# ---- prompt text (M4) and fan-out (M2) -------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "word " * 2_000_000, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "x" * 20_000], "max_tokens": 1}, "prompt[1]"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "word " * 2_000_000}]}, "messages"),
        ("/v1/responses", {"input": "word " * 2_000_000}, "input"),
        ("/tokenize", {"prompt": "word " * 2_000_000}, "prompt"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hi"}],
          "chat_template_kwargs": {"note": "word " * 2_000_000}}, "messages"),
    ],
)  # fmt: skip
def test_prompt_text_checked_before_tokenization(
    model_server: Proc, path: str, body: dict[str, Any], param: str
) -> None:
    """10 MB of text is refused in characters (16 x max_model_len), not tokenized."""
    baseline = warm_baseline(model_server)
    started = time.monotonic()
    r = post(model_server, path, body)
    assert_error(r, 400, "prompt_too_long", param)
    assert f"at most {16 * MAX_MODEL_LEN}" in r.json()["error"]["message"]
    assert time.monotonic() - started < 5.0
    assert_healthy(model_server)
    assert_rss_back(model_server, baseline, "huge prompt")


def test_fanout_per_request(model_server: Proc) -> None:
    """1000 prompts x n=128 (the M2 request) is refused before any engine request."""
    baseline = warm_baseline(model_server)
    body = {"prompt": [f"p{i}" for i in range(1000)], "n": 128, "max_tokens": 1}
    r = post(model_server, "/v1/completions", body)
    assert_error(r, 400, "too_many_completions", "prompt")
    assert "--max-fanout" in r.json()["error"]["message"]
    r = post(model_server, "/v1/completions", {"prompt": "hello", "n": FANOUT + 1, "max_tokens": 1})
    assert_error(r, 400, "too_many_completions", "n")
    r = post(model_server, "/v1/completions", {"prompt": "hello", "n": FANOUT, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == FANOUT
    assert_healthy(model_server)
    assert_rss_back(model_server, baseline, "fan-out")


def test_engine_requests_in_flight(mock_server: Proc) -> None:
    """8 engine requests in flight at most: 6 running leave no room for 4 more (429 with
    Retry-After); once they finish there is."""
    slow = {"prompt": "abcdef", "n": 6, "max_tokens": 30}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, mock_server, "/v1/completions", slow)
        deadline = time.monotonic() + 10
        while mock_server.metric("num_requests_running") < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        r = post(mock_server, "/v1/completions", {"prompt": "x", "n": 4, "max_tokens": 1})
        assert_error(r, 429, "too_many_engine_requests")
        assert r.headers["retry-after"] == "1"
        assert first.result(30).status_code == 200
    r = post(mock_server, "/v1/completions", {"prompt": "x", "n": 4, "max_tokens": 1})
    assert r.status_code == 200, r.text


# ---- bounded processing pool ------------------------------------------------------------


def test_processing_queue_full_is_429(model_server: Proc) -> None:
    """One processing thread and no queue: of concurrent image requests, those that find
    the thread busy get 429 with Retry-After; the rest succeed. The images differ (an
    image seen before is not decoded again, so it would hardly hold the thread), and
    the bodies are encoded first and sent together."""
    bodies = [
        orjson.dumps(chat_body([data_url(
            encoded(Image.effect_noise((1500, 1500), 64).convert("RGB"), "BMP"), "image/bmp"
        )]))
        for _ in range(8)
    ]  # fmt: skip
    together = threading.Barrier(len(bodies))

    def send(body: bytes) -> httpx.Response:
        with httpx.Client(timeout=60) as client:
            together.wait()
            return client.post(model_server.url + "/v1/chat/completions", content=body)

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(send, bodies))
    statuses = sorted(r.status_code for r in results)
    assert set(statuses) <= {200, 429}, [r.text for r in results]
    assert 200 in statuses and 429 in statuses, statuses
    busy = next(r for r in results if r.status_code == 429)
    assert_error(busy, 429, "processing_queue_full")
    assert busy.headers["retry-after"] == "1"
    assert_healthy(model_server)


# ---- client-caused 500s -------------------------------------------------------------


def test_generate_with_unloadable_mm_hash_is_400(model_server: Proc) -> None:
    """Token ids whose image placeholder names an item no one has: 400, not 500."""
    image_token = 516  # the built-in checkpoint's <|image_pad|>
    body = {
        "token_ids": [1, 2, 3, image_token, image_token, image_token, image_token, 4],
        "features": {
            "mm_hashes": ["ab" * 32],
            "mm_placeholders": [{"offset": 3, "length": 4}],
            "mm_grid_thw": [[1, 4, 4]],
        },
        "sampling_params": {"max_tokens": 2},
    }
    r = post(model_server, "/inference/v1/generate", body)
    assert_error(r, 400, "ec_item_unavailable")
    assert "ab" * 32 in r.json()["error"]["message"]
    assert_healthy(model_server)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/inference/v1/generate", {"token_ids": [65, 0x110000]}, "token_ids[1]"),
        ("/inference/v1/generate", {"token_ids": [65, 0xD800]}, None),
        ("/v1/completions", {"prompt": [65, 0xDFFF], "max_tokens": 1}, None),
    ],
)
def test_out_of_vocabulary_ids_on_mock_engine(
    mock_server: Proc, path: str, body: dict[str, Any], param: str | None
) -> None:
    """The mock's vocabulary is the Unicode scalar values; other ids are a 400."""
    r = post(mock_server, path, body)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param


def test_memory_error_in_image_processing_is_413(builtin_model_dir: Path) -> None:
    """A real MemoryError: the server runs under an address-space limit and is allowed
    (``--max-processor-pixels``) to upscale an image to 10^10 pixels, which cannot be
    allocated. The request gets 413; the server serves the next one."""
    limit = 7 * 1024**3  # about 2 GiB above what the server maps once started
    server = Proc(
        "serve",
        ["--model", str(builtin_model_dir), "--device", "cpu", "--max-model-len", "1024",
         "--max-processor-pixels", str(10**10)],
        "capped server",
        env={"MALLOC_ARENA_MAX": "2"},
        program=["prlimit", f"--as={limit}", sys.executable, "-m", "ec_frontend.entrypoints.cli"],
    ).wait_ready()  # fmt: skip
    try:
        small = data_url(encoded(Image.new("RGB", (28, 28))))
        kwargs = {"min_pixels": 10**10, "max_pixels": 10**10}
        r = post(server, "/v1/chat/completions", chat_body([small], mm_processor_kwargs=kwargs))
        assert_error(r, 413, "input_too_large")
        assert_healthy(server)
        assert "unhandled error" not in server.output()
    finally:
        assert server.stop() == 0
