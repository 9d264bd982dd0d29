"""Prometheus text exposition (format 0.0.4), written without a client library.

The server owns a :class:`ServerMetrics` (request counters, latency
histograms) and renders it together with the engine's own counters and gauges
(``AsyncEngine.stats()``) on ``/metrics``. Every metric name starts with
``ec_frontend_``. Updates happen on the server's event loop, so no locking is
needed; rendering reads a consistent-enough snapshot.

Several API server processes in front of one engine (``--api-server-count``)
share their values: after :func:`share_values`, every counter increment,
histogram observation and in-flight change of this process is also written to
its own memory-mapped file in a directory the group shares
(:class:`SharedValues`), and :func:`render` sums the files of the whole group,
so a scrape of any member reports the same series. The engine's statistics are
not summed: the one engine reports them once.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import mmap
import os
import struct
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

PREFIX = "ec_frontend_"

#: Seconds; tuned for token latencies from sub-millisecond (mock) to seconds (CPU).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    inner = ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + inner + "}"


#: Summed values of a group of processes: metric name -> label values -> value.
Snapshot = dict[str, dict[tuple[str, ...], float]]

# Native byte order: the files are read on the host that writes them.
_HEADER = struct.Struct("=Q")  # bytes in use, header included
_KEY_LEN = struct.Struct("=I")
_VALUE = struct.Struct("=d")
_SUFFIX = ".metrics"


class SharedValues:
    """One process's metric values in a memory-mapped file that other processes read.

    Only the owning process writes its file. An entry is a key (JSON
    ``[name, *labels]``), padded to 8 bytes, and a float64 that is updated in
    place; a new entry is written before the header's length covers it, so a
    reader never sees a half-written key. The header and the values are 8-byte
    aligned words stored whole through typed views (``struct.pack_into`` zeroes its
    target before filling it, which a concurrent reader could see as a drop to 0).
    Readers sum the files of a directory (:func:`read_shared`).
    """

    def __init__(self, directory: str, name: str, capacity: int = 1 << 16) -> None:
        self.path = os.path.join(directory, name + _SUFFIX)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self._fd, capacity)
        self._mm = mmap.mmap(self._fd, capacity)
        self._map_views()
        self._used = _HEADER.size
        self._words[0] = self._used
        self._offsets: dict[tuple[str, tuple[str, ...]], int] = {}
        # Preprocessing threads count images while the event loop counts requests.
        self._lock = threading.Lock()

    def _offset(self, name: str, labels: tuple[str, ...]) -> int:
        key = (name, labels)
        offset = self._offsets.get(key)
        if offset is None:
            raw = orjson.dumps([name, *labels])
            start = self._used
            offset = start + _KEY_LEN.size + len(raw)
            offset += -offset % 8
            end = offset + _VALUE.size
            if end > len(self._mm):
                self._words.release()
                self._doubles.release()
                self._mm.resize(max(2 * len(self._mm), end))
                self._map_views()
            _KEY_LEN.pack_into(self._mm, start, len(raw))
            self._mm[start + _KEY_LEN.size : start + _KEY_LEN.size + len(raw)] = raw
            self._doubles[offset >> 3] = 0.0
            self._used = end
            self._words[0] = end
            self._offsets[key] = offset
        return offset

    def _map_views(self) -> None:
        self._words = memoryview(self._mm).cast("Q")
        self._doubles = memoryview(self._mm).cast("d")

    def add(self, name: str, labels: tuple[str, ...], amount: float) -> None:
        with self._lock:
            index = self._offset(name, labels) >> 3
            self._doubles[index] += amount

    def set(self, name: str, labels: tuple[str, ...], value: float) -> None:
        with self._lock:
            self._doubles[self._offset(name, labels) >> 3] = value

    def close(self) -> None:
        self._words.release()
        self._doubles.release()
        self._mm.close()
        os.close(self._fd)


def read_values(data: bytes, into: Snapshot) -> None:
    """Add the entries of one :class:`SharedValues` file's bytes to ``into``."""
    if len(data) < _HEADER.size:
        return
    end = min(_HEADER.unpack_from(data, 0)[0], len(data))
    pos = _HEADER.size
    while pos + _KEY_LEN.size <= end:
        (size,) = _KEY_LEN.unpack_from(data, pos)
        key_end = pos + _KEY_LEN.size + size
        offset = key_end + (-key_end % 8)
        if offset + _VALUE.size > end:
            break
        try:
            name, *labels = orjson.loads(data[pos + _KEY_LEN.size : key_end])
        except (ValueError, TypeError):  # not a file of ours: keep what was read
            break
        series = into.setdefault(name, {})
        label_key = tuple(labels)
        series[label_key] = series.get(label_key, 0.0) + _VALUE.unpack_from(data, offset)[0]
        pos = offset + _VALUE.size


def read_shared(directory: str) -> Snapshot:
    """The summed values of every process that writes under ``directory``."""
    out: Snapshot = {}
    for entry in sorted(os.listdir(directory)):
        if entry.endswith(_SUFFIX):
            try:
                with open(os.path.join(directory, entry), "rb") as f:
                    read_values(f.read(), out)
            except FileNotFoundError:
                continue
    return out


class _Sharing:
    """This process's :class:`SharedValues`, when it belongs to a group."""

    values: SharedValues | None = None
    directory: str | None = None


_SHARING = _Sharing()


def share_values(directory: str, name: str) -> SharedValues:
    """Write this process's metric values under ``directory`` from now on.

    Call it before the server's :class:`ServerMetrics` is made (an API server
    process does so first thing). The process-wide counters of this module start
    the file with what they counted so far, so the group's sums include it.
    """
    values = SharedValues(directory, name)
    for counter in _PROCESS_WIDE:
        counter.seed(values)
    _SHARING.values = values
    _SHARING.directory = directory
    return values


def shared_snapshot() -> Snapshot | None:
    """The group's summed values, or ``None`` when this process shares none."""
    if _SHARING.directory is None:
        return None
    return read_shared(_SHARING.directory)


class Counter:
    """A monotonically increasing counter, optionally labelled."""

    def __init__(self, name: str, help_text: str, labelnames: tuple[str, ...] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = labelnames
        self.values: dict[tuple[str, ...], float] = {}

    def seed(self, shared: SharedValues) -> None:
        """Write the values counted so far into ``shared``."""
        for labels, value in list(self.values.items()):
            shared.add(self.name, labels, value)

    def inc(self, labels: tuple[str, ...] = (), amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount
        shared = _SHARING.values
        if shared is not None:
            shared.add(self.name, labels, amount)

    def get(self, labels: tuple[str, ...] = ()) -> float:
        return self.values.get(labels, 0.0)

    def render(self, snapshot: Snapshot | None = None) -> Iterable[str]:
        """The exposition lines: this process's values, or the group's from ``snapshot``."""
        values = self.values if snapshot is None else snapshot.get(self.name, {})
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        if not self.labelnames and not values:
            yield f"{self.name} 0"
        for labels, value in sorted(values.items()):
            yield f"{self.name}{_labels(self.labelnames, labels)} {_fmt(value)}"


class Histogram:
    """A histogram with fixed upper bounds (seconds), rendered cumulatively."""

    def __init__(
        self,
        name: str,
        help_text: str,
        buckets: tuple[float, ...] = LATENCY_BUCKETS,
        const_labels: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.name = name
        self.help = help_text
        self.bounds = buckets
        #: Labels every line of this histogram carries (e.g. ``model_name``).
        self.const_labels = const_labels
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.bounds, value)
        self.counts[index] += 1
        self.sum += value
        self.count += 1
        shared = _SHARING.values
        if shared is not None:
            shared.add(self.name + "_bucket", (str(index),), 1.0)
            shared.add(self.name + "_sum", (), value)

    def render(self, snapshot: Snapshot | None = None) -> Iterable[str]:
        """The exposition lines: this process's values, or the group's from ``snapshot``."""
        counts, total = self.counts, self.sum
        if snapshot is not None:
            buckets = snapshot.get(self.name + "_bucket", {})
            counts = [int(buckets.get((str(i),), 0)) for i in range(len(self.counts))]
            total = snapshot.get(self.name + "_sum", {}).get((), 0.0)
        names = tuple(n for n, _ in self.const_labels)
        plain = _labels(names, tuple(v for _, v in self.const_labels))
        le = plain[1:-1] + "," if plain else ""
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        running = 0
        for bound, n in zip(self.bounds, counts, strict=False):
            running += n
            yield f'{self.name}_bucket{{{le}le="{_fmt(bound)}"}} {running}'
        yield f'{self.name}_bucket{{{le}le="+Inf"}} {sum(counts)}'
        yield f"{self.name}_sum{plain} {_fmt(total)}"
        yield f"{self.name}_count{plain} {sum(counts)}"


def refused_connections() -> Counter:
    """``http_connections_refused_total{reason}``: connections the HTTP limits closed."""
    return Counter(
        PREFIX + "http_connections_refused_total",
        "Connections closed by the HTTP limits (head size or timeout, URL size, "
        "connection cap), by reason.",
        ("reason",),
    )


#: Images this process decoded and preprocessed into pixel values (native or
#: transformers path); counted by ``model.native_preprocess.count_preprocessed``.
IMAGES_PREPROCESSED = Counter(
    PREFIX + "images_preprocessed_total",
    "Images decoded and preprocessed into pixel values by this instance.",
)


#: Videos this process decoded into sampled frames, the frames and the container bytes
#: (``model.video.decode_video``); an instance given ``video_embeds`` references
#: decodes none.
VIDEOS_DECODED = Counter(
    PREFIX + "videos_decoded_total",
    "Videos decoded into sampled frames by this instance.",
)
VIDEO_FRAMES_DECODED = Counter(
    PREFIX + "video_frames_decoded_total",
    "Sampled video frames decoded to RGB by this instance.",
)
VIDEO_BYTES_DECODED = Counter(
    PREFIX + "video_bytes_decoded_total",
    "Bytes of the video containers this instance decoded frames from.",
)

#: Videos a request sent again and the processor took from its cache of processed
#: videos (``model.video_cache``, ``--mm-processor-cache-gb``) instead of decoding.
VIDEO_CACHE_HITS = Counter(
    PREFIX + "video_cache_hits_total",
    "Videos taken from the processed-video cache (--mm-processor-cache-gb), not decoded again.",
)


#: Counters that live as long as the process (seeded into its shared file).
_PROCESS_WIDE = (
    IMAGES_PREPROCESSED, VIDEOS_DECODED, VIDEO_FRAMES_DECODED, VIDEO_BYTES_DECODED,
    VIDEO_CACHE_HITS,
)  # fmt: skip

_IN_FLIGHT = PREFIX + "http_requests_in_flight"


class ServerMetrics:
    """What the HTTP layer measures itself."""

    def __init__(self) -> None:
        self.requests = Counter(
            PREFIX + "requests_total",
            "HTTP requests by endpoint (the route's path; unmatched: no route) and status code.",
            ("endpoint", "status"),
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request.",
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last generated token.",
        )
        self.aborted = Counter(
            PREFIX + "requests_aborted_total",
            "Engine requests aborted because the client went away or the server drained.",
        )
        self.refused = refused_connections()
        #: Series of other parts of the server (the media fetcher's), each with a
        #: ``render(snapshot)`` like :meth:`render`'s.
        self.extra: list[Any] = []
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        """Generation requests this process is serving (the drain waits for 0)."""
        return self._in_flight

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        self._in_flight = value
        shared = _SHARING.values
        if shared is not None:
            shared.set(_IN_FLIGHT, (), value)

    def render(self, snapshot: Snapshot | None = None) -> Iterable[str]:
        """This process's series, or the group's summed from ``snapshot``."""
        in_flight = self._in_flight
        if snapshot is not None:
            in_flight = int(snapshot.get(_IN_FLIGHT, {}).get((), 0))
        yield from self.requests.render(snapshot)
        yield from self.aborted.render(snapshot)
        yield from self.refused.render(snapshot)
        for counter in _PROCESS_WIDE:
            yield from counter.render(snapshot)
        yield f"# HELP {_IN_FLIGHT} Generation requests being served."
        yield f"# TYPE {_IN_FLIGHT} gauge"
        yield f"{_IN_FLIGHT} {in_flight}"
        yield from self.ttft.render(snapshot)
        yield from self.itl.render(snapshot)
        yield from self.e2e.render(snapshot)
        for series in self.extra:
            yield from series.render(snapshot)


def stats_items(stats: Any) -> list[tuple[str, float]]:
    """Flatten an engine stats object (a dataclass or a mapping) to numeric pairs.

    Non-numeric fields are skipped; booleans count as 0 / 1.
    """
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        raw: Mapping[str, Any] = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    elif isinstance(stats, Mapping):
        raw = stats
    else:
        raw = {k: v for k, v in vars(stats).items() if not k.startswith("_")}
    return [(k, float(v)) for k, v in raw.items() if isinstance(v, int | float)]


def render_engine_stats(stats: Any, help_texts: Mapping[str, str] | None = None) -> Iterable[str]:
    """Engine counters (fields ending in ``_total``) and gauges (every other field).

    ``help_texts`` maps a field to its HELP text (what it counts).
    """
    for key, value in stats_items(stats):
        name = PREFIX + key
        kind = "counter" if key.endswith("_total") else "gauge"
        text = (help_texts or {}).get(key, f"Engine statistic {key}.")
        yield f"# HELP {name} {text}"
        yield f"# TYPE {name} {kind}"
        yield f"{name} {_fmt(value)}"


def exposition(lines: Iterable[str]) -> str:
    """Exposition text from rendered lines: each ends with a newline, the last one too."""
    return "\n".join(lines) + "\n"


def render(
    server: ServerMetrics, engine_stats: Any | None, help_texts: Mapping[str, str] | None = None
) -> str:
    """The full exposition text for ``/metrics`` (the group's, when values are shared)."""
    lines = list(server.render(shared_snapshot()))
    if engine_stats is not None:
        lines.extend(render_engine_stats(engine_stats, help_texts))
    return exposition(lines)


def parse_text(text: str) -> dict[str, float]:
    """Parse exposition text into ``{"name{labels}": value}`` (for tests and benches)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out
