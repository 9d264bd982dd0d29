"""The media fetcher against real loopback origins (``tests/helpers/origin.py``).

Each refusal is shown with the origin's accepted-connection count: a URL the
policy refuses must cause no connection at all, whatever the name resolves to
and wherever a redirect points.
"""

from __future__ import annotations

import asyncio
import io
import os
import ssl
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from ec_frontend.media import MediaError, MediaFetchConfig, MediaFetcher
from ec_frontend.media.fetch import Fetched, RequestBudget
from PIL import Image

from ..helpers.origin import Origin, Route, origin

LOOPBACK = ("127.0.0.0/8",)


def png(color: tuple[int, int, int] = (10, 200, 30), size: int = 28) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


def config(**kw: Any) -> MediaFetchConfig:
    from ec_frontend.media import parse_networks

    networks = kw.pop("networks", ())
    return MediaFetchConfig(allowed_networks=parse_networks(list(networks)), **kw)


class CountingResolver:
    """Answers from a table (no DNS), counting calls; ``answers`` may change per call."""

    def __init__(self, *answers: Sequence[str]) -> None:
        self.answers = list(answers)
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.calls.append(host)
        index = min(len(self.calls), len(self.answers)) - 1
        return self.answers[index]


def fetch(fetcher: MediaFetcher, url: str, budget: RequestBudget | None = None) -> Fetched:
    return asyncio.run(_fetch_and_close(fetcher, url, budget))


async def _fetch_and_close(fetcher: MediaFetcher, url: str, budget: Any) -> Fetched:
    try:
        return await fetcher.fetch(url, budget)
    finally:
        await fetcher.aclose()


def refusal(fetcher: MediaFetcher, url: str) -> MediaError:
    with pytest.raises(MediaError) as info:
        fetch(fetcher, url)
    return info.value


@pytest.fixture(scope="module")
def local() -> Any:
    with origin("127.0.0.1") as o:
        yield o


@pytest.fixture(scope="module")
def public() -> Any:
    """An origin on 127.0.0.2, the only address the 'public' tests allow."""
    with origin("127.0.0.2") as o:
        yield o


# ------------------------------------------------------------------ success


def test_fetch_returns_the_origins_bytes_and_counts(local: Origin) -> None:
    body = png()
    url = local.set("/ok.png", Route(body))
    fetcher = MediaFetcher(config(networks=LOOPBACK))
    assert fetch(fetcher, url).data == body
    m = fetcher.metrics
    assert m.fetches.get(("http",)) == 1
    assert m.bytes.get() == len(body)
    assert m.latency.count == 1


def test_connects_to_the_checked_address_with_the_original_host(local: Origin) -> None:
    """The name is resolved once (by the fetcher); the connection goes to that address
    and the origin sees the name in ``Host`` (no second resolution: the system resolver
    does not know ``media.test``)."""
    url = local.set("/named.png", Route(png()))
    resolver = CountingResolver(["127.0.0.1"])
    fetcher = MediaFetcher(config(networks=LOOPBACK), resolver=resolver)
    named = url.replace("127.0.0.1", "media.test")
    assert fetch(fetcher, named).data == png()
    assert resolver.calls == ["media.test"]
    assert local.log[-1] == ("/named.png", f"media.test:{local.port}")


def test_dns_rebinding_changes_nothing(public: Origin, local: Origin) -> None:
    """A name that answers an allowed address at the check and a loopback one after:
    resolved once, so the fetch goes to the checked address and 127.0.0.1 gets no
    connection."""
    url = public.set("/rebind.png", Route(png()))
    before = local.accepted
    resolver = CountingResolver(["127.0.0.2"], ["127.0.0.1"])
    fetcher = MediaFetcher(config(networks=("127.0.0.2/32",)), resolver=resolver)
    assert fetch(fetcher, url.replace("127.0.0.2", "rebind.test")).data == png()
    assert len(resolver.calls) == 1
    assert local.accepted == before


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("url_host", "answers"),
    [
        ("127.0.0.1", None),  # loopback literal
        ("localhost", None),  # the system resolver: /etc/hosts
        ("private.test", ["127.0.0.1"]),  # a name that resolves to loopback
        ("mixed.test", ["127.0.0.2", "127.0.0.1"]),  # one bad address is enough
        ("[::ffff:127.0.0.1]", None),  # IPv4-mapped loopback
    ],
)
def test_private_targets_are_refused_without_a_connection(
    local: Origin, url_host: str, answers: list[str] | None
) -> None:
    url = local.set("/secret.png", Route(png()))
    before = local.accepted
    resolver = CountingResolver(answers) if answers is not None else None
    fetcher = MediaFetcher(config(networks=("127.0.0.2/32",)), resolver=resolver)
    err = refusal(fetcher, url.replace("127.0.0.1", url_host))
    assert (err.code, err.reason) == ("media_url_refused", "address")
    assert local.accepted == before
    assert fetcher.metrics.refused.get(("address",)) == 1


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00:ec2::254]/latest/meta-data/",
        "http://100.100.100.200/latest/meta-data/",
        "http://10.0.0.1/a.png",
        "http://192.168.1.1/a.png",
        "http://0.0.0.0/a.png",
        "http://[::1]/a.png",
        "http://[fe80::1]/a.png",
        "http://224.0.0.1/a.png",
        "http://[64:ff9b::7f00:1]/a.png",
    ],
)
def test_metadata_and_private_addresses_are_refused(url: str) -> None:
    err = refusal(MediaFetcher(config()), url)
    assert err.reason == "address"


@pytest.mark.parametrize(
    ("url", "kw", "reason"),
    [
        ("ftp://example.com/a.png", {}, "scheme"),
        ("gopher://example.com/a", {}, "scheme"),
        ("http://user:pw@example.com/a.png", {}, "credentials"),
        ("http://evil.example.com/a.png", {"allowed_domains": ("example.com",)}, "domain"),
        ("http://example.org/a.png", {"allowed_domains": ("example.com",)}, "domain"),
        ("file:///etc/passwd", {}, "local_path"),
        ("http:///a.png", {}, "scheme"),
    ],
)
def test_urls_refused_before_any_resolution(url: str, kw: dict[str, Any], reason: str) -> None:
    resolver = CountingResolver(["127.0.0.1"])
    err = refusal(MediaFetcher(config(**kw), resolver=resolver), url)
    assert err.reason == reason
    assert resolver.calls == []


def test_allowed_domains_match_exact_names_case_insensitively(local: Origin) -> None:
    url = local.set("/dom.png", Route(png()))
    resolver = CountingResolver(["127.0.0.1"])
    fetcher = MediaFetcher(
        config(networks=LOOPBACK, allowed_domains=("media.test",)), resolver=resolver
    )
    assert fetch(fetcher, url.replace("127.0.0.1", "MEDIA.test")).data == png()


def test_a_redirect_to_a_private_address_is_refused_without_a_connection(
    public: Origin, local: Origin
) -> None:
    target = local.set("/internal.png", Route(png()))
    url = public.set("/hop", Route(status=302, location=target, content_type=None))
    before = local.accepted
    fetcher = MediaFetcher(config(networks=("127.0.0.2/32",)))
    err = refusal(fetcher, url)
    assert err.reason == "address"
    assert local.accepted == before
    assert public.paths()[-1] == "/hop"


@pytest.mark.parametrize(
    ("location", "reason"),
    [
        ("file:///etc/passwd", "scheme"),
        ("ftp://127.0.0.2/a.png", "scheme"),
        ("/loop", "redirects"),
    ],
)
def test_redirects_are_checked(public: Origin, location: str, reason: str) -> None:
    public.set("/loop", Route(status=307, location="/loop", content_type=None))
    url = public.set("/redir", Route(status=301, location=location, content_type=None))
    fetcher = MediaFetcher(config(networks=("127.0.0.2/32",), max_redirects=3))
    assert refusal(fetcher, url).reason == reason


def test_an_allowed_redirect_is_followed_and_re_resolved(public: Origin) -> None:
    public.set("/final.png", Route(png()))
    url = public.set("/moved", Route(status=308, location="/final.png", content_type=None))
    resolver = CountingResolver(["127.0.0.2"])
    fetcher = MediaFetcher(config(networks=("127.0.0.2/32",)), resolver=resolver)
    assert fetch(fetcher, url.replace("127.0.0.2", "cdn.test")).data == png()
    assert resolver.calls == ["cdn.test", "cdn.test"]


# ------------------------------------------------------------- origin errors


@pytest.mark.parametrize(
    ("route", "code", "reason"),
    [
        (Route(b"nope", status=404, content_type=None), "media_fetch_failed", "http_status"),
        (Route(b"oops", status=500, content_type=None), "media_fetch_failed", "http_status"),
        (Route(b"<html>", content_type="text/html"), "invalid_media_content_type", "content_type"),
        (
            Route(png(), headers={"Content-Encoding": "gzip"}),
            "invalid_media_content_type",
            "content_type",
        ),
        (Route(b"x" * 2000), "media_too_large", "too_large"),  # by Content-Length
        (Route(b"x" * 2000, content_length=-1), "media_too_large", "too_large"),  # streamed
    ],
)
def test_origin_answers_that_give_no_image(
    local: Origin, route: Route, code: str, reason: str
) -> None:
    url = local.set("/bad", route)
    fetcher = MediaFetcher(config(networks=LOOPBACK, max_item_bytes=1000))
    err = refusal(fetcher, url)
    assert (err.code, err.reason) == (code, reason)
    assert fetcher.metrics.refused.get((reason,)) == 1


def test_generic_content_types_are_accepted(local: Origin) -> None:
    for ctype in (None, "application/octet-stream"):
        url = local.set("/generic", Route(png(), content_type=ctype))
        assert fetch(MediaFetcher(config(networks=LOOPBACK)), url).data == png()


def test_the_request_budget_spans_items(local: Origin) -> None:
    url = local.set("/600", Route(b"y" * 600))
    budget = RequestBudget(1000)
    fetcher = MediaFetcher(config(networks=LOOPBACK, max_item_bytes=1000))
    fetch(fetcher, url, budget)
    with pytest.raises(MediaError) as info:
        fetch(fetcher, url, budget)
    assert info.value.reason == "request_too_large"


def test_an_unreachable_port() -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = refusal(MediaFetcher(config(networks=LOOPBACK)), f"http://127.0.0.1:{port}/a.png")
    assert err.reason == "unreachable"


def test_an_unresolvable_name() -> None:
    err = refusal(MediaFetcher(config()), "http://no-such-host.invalid/a.png")
    assert err.reason == "unreachable"


def test_a_slow_origin_ends_at_the_timeout(local: Origin) -> None:
    url = local.set("/slow", Route(png(), drip_s=1.0))
    fetcher = MediaFetcher(config(networks=LOOPBACK, timeout_s=1.5))
    started = time.monotonic()
    err = refusal(fetcher, url)
    elapsed = time.monotonic() - started
    assert (err.code, err.reason) == ("media_fetch_timeout", "timeout")
    assert 1.4 <= elapsed < 3.0


# -------------------------------------------------------------------- cache


@pytest.mark.parametrize(
    ("headers", "cached"),
    [
        ({"Cache-Control": "max-age=60"}, True),
        ({"Cache-Control": "public, s-maxage=60, max-age=0"}, True),
        ({"Expires": "Fri, 01 Jan 2100 00:00:00 GMT"}, True),
        ({}, False),  # no freshness information: never stored
        ({"Cache-Control": "max-age=60, no-store"}, False),
        ({"Cache-Control": "private, max-age=60"}, False),
        ({"Cache-Control": "no-cache"}, False),
        ({"Cache-Control": "max-age=60", "Age": "60"}, False),
        ({"Cache-Control": "max-age=60", "Vary": "*"}, False),
    ],
)
def test_cache_honours_the_origins_headers(
    local: Origin, headers: dict[str, str], cached: bool
) -> None:
    path = f"/cached-{abs(hash(tuple(sorted(headers.items()))))}.png"
    url = local.set(path, Route(png(), headers=headers))
    fetcher = MediaFetcher(config(networks=LOOPBACK, cache_bytes=1 << 20))

    async def twice() -> tuple[Fetched, Fetched]:
        try:
            return await fetcher.fetch(url), await fetcher.fetch(url)
        finally:
            await fetcher.aclose()

    first, second = asyncio.run(twice())
    assert first.data == second.data == png()
    assert second.cached is cached
    assert local.paths().count(path) == (1 if cached else 2)
    assert fetcher.metrics.cache_hits.get() == (1 if cached else 0)


def test_cache_is_bounded_in_bytes() -> None:
    from ec_frontend.media.cache import MediaCache

    cache = MediaCache(100)
    fresh = {"cache-control": "max-age=60"}
    assert cache.put("a", b"a" * 60, fresh)
    assert cache.put("b", b"b" * 30, fresh)
    assert cache.get("a") is not None  # a is now the most recently used
    assert cache.put("c", b"c" * 30, fresh)  # evicts b
    assert cache.get("b") is None and cache.size == 90
    assert not cache.put("d", b"d" * 101, fresh)  # larger than the cache
    now = [0.0]
    timed = MediaCache(100, clock=lambda: now[0])
    timed.put("x", b"x", {"cache-control": "max-age=10"})
    now[0] = 9.9
    assert timed.get("x") == b"x"
    now[0] = 10.0
    assert timed.get("x") is None and timed.size == 0


# --------------------------------------------------------------------- file


@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.png").write_bytes(png())
    (tmp_path / "outside.png").write_bytes(png((1, 2, 3)))
    os.symlink(tmp_path / "outside.png", root / "escape.png")
    os.symlink(root / "sub" / "a.png", root / "inner.png")
    os.symlink("/dev/zero", root / "zero")
    os.mkfifo(root / "fifo")
    (root / "big.png").write_bytes(b"z" * 5000)
    return root


@pytest.mark.parametrize(
    ("path", "outcome"),
    [
        ("sub/a.png", "ok"),
        ("inner.png", "ok"),  # a symlink that stays below the root
        ("sub/../sub/a.png", "local_path"),  # '..' never, even when it stays inside
        ("sub/%2e%2e/sub/a.png", "local_path"),  # percent-encoded '..'
        ("escape.png", "local_path"),  # symlink out of the root
        ("zero", "local_path"),  # a device file (through a symlink)
        ("fifo", "local_path"),  # not a regular file (and no hang)
        ("sub", "local_path"),  # a directory
        ("missing.png", "unreachable"),
        ("big.png", "too_large"),
    ],
)
def test_file_urls_stay_below_the_allowed_path(media_root: Path, path: str, outcome: str) -> None:
    fetcher = MediaFetcher(config(allowed_local_path=str(media_root), max_item_bytes=4000))
    url = f"file://{media_root}/{path}"
    if outcome == "ok":
        assert fetch(fetcher, url).data == png()
        assert fetcher.metrics.fetches.get(("file",)) == 1
        return
    assert refusal(fetcher, url).reason == outcome


def test_file_urls_outside_the_root(media_root: Path) -> None:
    fetcher = MediaFetcher(config(allowed_local_path=str(media_root)))
    assert refusal(fetcher, "file:///etc/passwd").reason == "local_path"
    assert refusal(fetcher, f"file://{media_root}").reason == "local_path"
    assert refusal(fetcher, "file://otherhost/etc/passwd").reason == "local_path"


def test_the_allowed_path_must_be_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        MediaFetcher(config(allowed_local_path=str(tmp_path / "nope")))


# -------------------------------------------------------------------- https


def _certificate(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for ``name`` (the ``openssl`` command line)."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}",
         "-addext", f"subjectAltName=DNS:{name}"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def tls_origin(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An HTTPS origin on 127.0.0.1 with a certificate for ``media.test``, and a client
    context that trusts it (and nothing else)."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = _certificate(directory, "media.test")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(cert))
    with origin("127.0.0.1", tls=server) as o:
        yield o, client


def test_https_connects_to_the_checked_address_with_the_names_tls_identity(
    tls_origin: tuple[Origin, ssl.SSLContext],
) -> None:
    """The socket goes to 127.0.0.1 (the checked address); SNI, the certificate check and
    ``Host`` use the name."""
    server, client_tls = tls_origin
    url = server.set("/tls.png", Route(png()), host="media.test")
    resolver = CountingResolver(["127.0.0.1"])
    fetcher = MediaFetcher(config(networks=LOOPBACK), resolver=resolver, tls=client_tls)
    assert fetch(fetcher, url).data == png()
    assert server.server_names[-1] == "media.test"
    assert server.log[-1] == ("/tls.png", f"media.test:{server.port}")
    assert fetcher.metrics.fetches.get(("https",)) == 1


def test_https_refuses_a_certificate_for_another_name(
    tls_origin: tuple[Origin, ssl.SSLContext],
) -> None:
    server, client_tls = tls_origin
    url = server.set("/tls.png", Route(png()), host="other.test")
    resolver = CountingResolver(["127.0.0.1"])
    fetcher = MediaFetcher(config(networks=LOOPBACK), resolver=resolver, tls=client_tls)
    err = refusal(fetcher, url)
    assert err.reason == "unreachable"
    assert "certificate" in err.message.lower()


def test_https_never_redirects_down_to_http(
    tls_origin: tuple[Origin, ssl.SSLContext], local: Origin
) -> None:
    server, client_tls = tls_origin
    plain = local.set("/plain.png", Route(png()))
    url = server.set("/down", Route(status=302, location=plain, content_type=None), "media.test")
    before = local.accepted
    fetcher = MediaFetcher(
        config(networks=LOOPBACK), resolver=CountingResolver(["127.0.0.1"]), tls=client_tls
    )
    assert refusal(fetcher, url).reason == "scheme"
    assert local.accepted == before


@pytest.mark.parametrize(("slots", "outcomes"), [(2, ["ok", "ok"]), (1, ["ok", "timeout"])])
def test_concurrent_fetches_are_bounded(local: Origin, slots: int, outcomes: list[str]) -> None:
    """Two fetches of about 1 s each under a 1.6 s deadline: with one slot, the second
    waits for the first and runs out of time."""
    url = local.set("/three-bytes", Route(b"abc", drip_s=0.5, content_type="image/png"))
    fetcher = MediaFetcher(config(networks=LOOPBACK, timeout_s=1.6, max_concurrent=slots))

    async def both() -> list[str]:
        async def one(delay: float) -> str:
            await asyncio.sleep(delay)
            try:
                await fetcher.fetch(url)
            except MediaError as exc:
                return str(exc.reason)
            return "ok"

        return list(await asyncio.gather(one(0.0), one(0.05)))

    assert asyncio.run(both()) == outcomes


@pytest.mark.parametrize(
    "url",
    [
        "http://exa mple.com/a.png",
        "http://[::1/a.png",
        "http://example.com:99999/a.png",
        "http://xn--/a.png",
        "http://a..b/a.png",
        "http://\u2603\u2603.example/a.png",
        "http://example.com/\x00",
        "https://",
    ],
)
def test_malformed_urls_are_media_errors(url: str) -> None:
    """Whatever the URL, a :class:`MediaError` (a 400), never another exception. (A name
    that parses resolves to loopback here, which is refused: no connection is made.)"""
    resolver = CountingResolver(["127.0.0.1"])
    fetcher = MediaFetcher(config(timeout_s=1.0), resolver=resolver)
    assert refusal(fetcher, url).reason in ("scheme", "address")


def test_a_malformed_redirect_target(public: Origin) -> None:
    url = public.set("/bad-hop", Route(status=302, location="http://[::1/", content_type=None))
    fetcher = MediaFetcher(config(networks=("127.0.0.2/32",)))
    assert refusal(fetcher, url).reason == "scheme"
