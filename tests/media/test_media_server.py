"""Images by URL against a real server (the built-in model on the CPU) and a real origin.

One server for the module, started with ``--allowed-media-networks 127.0.0.0/8``
(the origin listens on 127.0.0.1). Shown here: an image by URL gives exactly
what the same bytes inline give (chat, Responses, ``/tokenize``, and the same
prefix-cache key), new bytes behind one URL give a new answer (no stale
entry), every kind of failed fetch is a 400 naming the part with the server
healthy after it, ``file://`` below the allowed path, and the metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from ..helpers.origin import Origin, Route
from ..server.conftest import ServerProcess
from .conftest import data_url, image_messages, png_bytes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "tiny"
ITEM_CAP = 200_000
IMAGE_A = png_bytes(56, (200, 30, 30))
IMAGE_B = png_bytes(56, (20, 160, 90))
PARAM = "messages[0].content[1].image_url"


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media-root")
    (root / "a.png").write_bytes(IMAGE_A)
    return root


@pytest.fixture(scope="module")
def server(builtin_model_dir: Path, media_dir: Path) -> Iterator[ServerProcess]:
    args = ["--model", str(builtin_model_dir), "--device", "cpu", "--max-model-len", "1024",
            "--served-model-name", MODEL, "--allowed-media-networks", "127.0.0.0/8",
            "--media-fetch-timeout", "2", "--max-media-item-bytes", str(ITEM_CAP),
            "--allowed-local-media-path", str(media_dir)]  # fmt: skip
    proc = ServerProcess(args)
    yield proc
    assert proc.stop() == 0


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def answer(server: ServerProcess, url: str) -> tuple[str, int, list[float]]:
    """Greedy text, prompt tokens and the chosen tokens' logprobs for one image."""
    with client(server) as c:
        r = c.chat.completions.create(
            model=MODEL,
            messages=image_messages(url),  # type: ignore[arg-type]
            max_tokens=6,
            temperature=0.0,
            logprobs=True,
        )
    assert r.usage is not None and r.choices[0].logprobs is not None
    logprobs = [t.logprob for t in r.choices[0].logprobs.content or []]
    return r.choices[0].message.content or "", r.usage.prompt_tokens, logprobs


def same(a: tuple[str, int, list[float]], b: tuple[str, int, list[float]]) -> bool:
    return (
        a[:2] == b[:2]
        and len(a[2]) == len(b[2])
        and all(abs(x - y) < 1e-3 for x, y in zip(a[2], b[2], strict=True))
    )


def test_an_image_by_url_answers_as_the_same_bytes_inline(
    server: ServerProcess, local_origin: Origin
) -> None:
    url = local_origin.set("/a.png", Route(IMAGE_A))
    inline = answer(server, data_url(IMAGE_A))
    computed = server.metric("prompt_tokens_computed_total")
    by_url = answer(server, url)
    assert same(by_url, inline), (by_url, inline)
    # The same content key: the prompt's full blocks (image included) come from the
    # prefix cache that the inline request filled.
    assert server.metric("prompt_tokens_computed_total") - computed < by_url[1] / 2


def test_tokenize_counts_what_chat_feeds_for_a_url(
    server: ServerProcess, local_origin: Origin
) -> None:
    url = local_origin.set("/tok.png", Route(IMAGE_B))
    tok = httpx.post(server.url + "/tokenize", json={"messages": image_messages(url)}, timeout=60)
    inline = httpx.post(
        server.url + "/tokenize", json={"messages": image_messages(data_url(IMAGE_B))}, timeout=60
    )
    assert tok.status_code == 200, tok.text
    assert tok.json()["tokens"] == inline.json()["tokens"]
    assert tok.json()["count"] == answer(server, url)[1]


def test_responses_input_image_by_url(server: ServerProcess, local_origin: Origin) -> None:
    url = local_origin.set("/resp.png", Route(IMAGE_B))

    def ask(image: str) -> tuple[str, int]:
        with client(server) as c:
            r = c.responses.create(
                model=MODEL,
                input=[{"role": "user", "content": [  # type: ignore[list-item]
                    {"type": "input_text", "text": "what is it"},
                    {"type": "input_image", "image_url": image, "detail": "auto"}]}],
                max_output_tokens=6,
                temperature=0.0,
            )  # fmt: skip
        assert r.usage is not None
        return r.output_text, r.usage.input_tokens

    assert ask(url) == ask(data_url(IMAGE_B))


def test_new_bytes_behind_one_url_change_the_answer(
    server: ServerProcess, local_origin: Origin
) -> None:
    """A camera's ``latest.png``: no encoder-cache or prefix-cache entry of the old
    bytes answers for the new ones."""
    want_a, want_b = answer(server, data_url(IMAGE_A)), answer(server, data_url(IMAGE_B))
    assert not same(want_a, want_b)  # the two images are told apart by the model
    url = local_origin.set("/latest.png", Route(IMAGE_A))
    assert same(answer(server, url), want_a)
    local_origin.set("/latest.png", Route(IMAGE_B))
    assert same(answer(server, url), want_b)
    local_origin.set("/latest.png", Route(IMAGE_A))
    assert same(answer(server, url), want_a)


def test_a_file_url_below_the_allowed_path(server: ServerProcess, media_dir: Path) -> None:
    assert same(answer(server, f"file://{media_dir}/a.png"), answer(server, data_url(IMAGE_A)))


def _unreachable_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/a.png"


#: path on the origin (or a whole URL) -> route, expected code.
FAILURES: list[tuple[str, str, Route | None, str]] = [
    ("unreachable", "", None, "media_fetch_failed"),
    ("origin-404", "/missing.png", None, "media_fetch_failed"),
    ("timeout", "/slow.png", Route(IMAGE_A, drip_s=1.0), "media_fetch_timeout"),
    ("over-cap", "/huge.png", Route(b"\x89PNG" + b"0" * ITEM_CAP), "media_too_large"),
    ("not-an-image-type", "/page", Route(b"<html></html>", content_type="text/html"),
     "invalid_media_content_type"),
    ("not-image-bytes", "/fake.png", Route(b"this is not a png"), "invalid_image"),
    ("redirect-loop", "/loop", Route(status=302, location="/loop", content_type=None),
     "media_url_refused"),
    ("file-outside", "file:///etc/passwd", None, "media_url_refused"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "path", "route", "code"), FAILURES, ids=[f[0] for f in FAILURES])
def test_a_failed_fetch_is_a_400_naming_the_part(
    server: ServerProcess,
    local_origin: Origin,
    case: str,
    path: str,
    route: Route | None,
    code: str,
) -> None:
    if case == "unreachable":
        url = _unreachable_url()
    elif path.startswith("file:"):
        url = path
    elif route is not None:
        url = local_origin.set(path, route)
    else:
        url = local_origin.url(path)
    with client(server) as c, pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(
            model=MODEL,
            messages=image_messages(url),  # type: ignore[arg-type]
            max_tokens=2,
        )
    err: Any = info.value.body
    assert (err["param"], err["code"]) == (PARAM, code), err
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert answer(server, data_url(IMAGE_A))[0] is not None
    assert server.metric("num_requests_running") == 0


def test_tokenize_reports_a_failed_fetch(server: ServerProcess, local_origin: Origin) -> None:
    url = local_origin.url("/nothing-here.png")
    r = httpx.post(server.url + "/tokenize", json={"messages": image_messages(url)}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == PARAM


def test_fetch_metrics(server: ServerProcess, local_origin: Origin) -> None:
    url = local_origin.set("/metrics.png", Route(IMAGE_B))
    before = server.metrics()
    answer(server, url)
    httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": image_messages(local_origin.url("/gone.png")), "max_tokens": 1},
        timeout=60,
    )
    after = server.metrics()

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta('ec_frontend_media_fetches_total{scheme="http"}') == 2
    assert delta("ec_frontend_media_fetched_bytes_total") == len(IMAGE_B)
    assert delta("ec_frontend_media_fetch_seconds_count") == 1
    assert delta('ec_frontend_media_fetch_refused_total{reason="http_status"}') == 1
    assert "ec_frontend_media_cache_hits_total" in after
