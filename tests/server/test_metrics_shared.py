"""Metric values shared by a group of processes (``metrics.SharedValues``, ``read_shared``).

Writers are real processes (``python -c``) or threads writing real files under a
temporary directory; this test process only reads, so its own metrics stay local.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from ec_frontend import metrics
from ec_frontend.metrics import (
    ServerMetrics,
    SharedValues,
    parse_text,
    read_shared,
    read_values,
)

WRITER = textwrap.dedent(
    """
    import sys, threading
    from ec_frontend import metrics

    directory, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    metrics.share_values(directory, name)
    server = metrics.ServerMetrics()

    def work():
        for i in range(n):
            server.requests.inc(("/v1/chat/completions", "200"))
            server.ttft.observe(0.004 if i % 2 else 0.3)
            metrics.IMAGES_PREPROCESSED.inc(amount=2)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.requests.inc(("/v1/completions", name))
    server.in_flight = 5
    server.in_flight -= 2
    """
)


def run_writers(directory: Path, names: list[str], n: int) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(directory), name, str(n)])
        for name in names
    ]
    assert [p.wait(60) for p in procs] == [0] * len(names)


def test_processes_sum_into_one_set_of_series(tmp_path: Path) -> None:
    names, n = ["api-server-0", "api-server-1", "api-server-2"], 2000
    run_writers(tmp_path, names, n)
    snapshot = read_shared(str(tmp_path))
    text = "\n".join(ServerMetrics().render(snapshot))
    m = parse_text(text)
    each = 3 * n  # three threads per process
    assert m['ec_frontend_requests_total{endpoint="/v1/chat/completions",status="200"}'] == 3 * each
    for name in names:  # a label only one process used stays one series
        assert m[f'ec_frontend_requests_total{{endpoint="/v1/completions",status="{name}"}}'] == 1
    assert m["ec_frontend_images_preprocessed_total"] == 2 * 3 * each
    assert m["ec_frontend_http_requests_in_flight"] == 3 * 3
    assert m["ec_frontend_time_to_first_token_seconds_count"] == 3 * each
    assert m['ec_frontend_time_to_first_token_seconds_bucket{le="0.005"}'] == 3 * each // 2
    assert m['ec_frontend_time_to_first_token_seconds_bucket{le="+Inf"}'] == 3 * each
    assert m["ec_frontend_time_to_first_token_seconds_sum"] == pytest.approx(
        3 * (each // 2) * (0.004 + 0.3)
    )
    # Series that no process touched still render, at zero.
    assert m["ec_frontend_requests_aborted_total"] == 0
    assert m["ec_frontend_inter_token_latency_seconds_count"] == 0


@pytest.fixture
def sharing(tmp_path: Path) -> Iterator[Path]:
    """This process shares its metric values under ``tmp_path`` for one test."""
    shared = metrics.share_values(str(tmp_path), "self")
    try:
        yield tmp_path
    finally:
        metrics._SHARING.values = None
        metrics._SHARING.directory = None
        shared.close()


def test_snapshot_renders_like_the_local_values(sharing: Path) -> None:
    """A process alone in its group renders the same text from the shared file as
    from memory, and :func:`render` reads the file (the process-wide image counter
    holds whatever earlier tests here counted: the file starts from it)."""
    server = ServerMetrics()
    for v in [0.0, 0.01, 0.05, 0.5, 3.0, 1e-6, 0.1, 7.5, 100.0]:
        server.ttft.observe(v)
        server.requests.inc(("/v1/models", str(200 + int(v))))
    server.in_flight += 3
    server.aborted.inc()
    local = list(server.render())
    assert list(server.render(read_shared(str(sharing)))) == local
    assert metrics.render(server, None) == metrics.exposition(local)
    assert (sharing / "self.metrics").stat().st_size > 0


def test_values_counted_before_sharing_are_in_the_group_sums(tmp_path: Path) -> None:
    """The process-wide image counter starts the shared file with what it counted
    before sharing began, and later counts add to it once."""
    metrics.IMAGES_PREPROCESSED.inc(amount=3)
    before = metrics.IMAGES_PREPROCESSED.get()
    shared = metrics.share_values(str(tmp_path), "late")
    try:
        metrics.IMAGES_PREPROCESSED.inc()
        server = ServerMetrics()
        server.requests.inc(("/v1/models", "200"))
        local = list(server.render())
        assert list(server.render(read_shared(str(tmp_path)))) == local
        m = parse_text(metrics.exposition(server.render(read_shared(str(tmp_path)))))
        assert m["ec_frontend_images_preprocessed_total"] == before + 1
        assert m['ec_frontend_requests_total{endpoint="/v1/models",status="200"}'] == 1
    finally:
        metrics._SHARING.values = None
        metrics._SHARING.directory = None
        shared.close()


def test_file_grows_past_its_first_mapping(tmp_path: Path) -> None:
    shared = SharedValues(str(tmp_path), "big", capacity=4096)
    keys = 3000
    for i in range(keys):
        shared.add("c_total", (f"label-{i}", "x" * (i % 13)), float(i))
    shared.set("g", (), 2.5)
    shared.close()
    assert (tmp_path / "big.metrics").stat().st_size > 4096
    snapshot = read_shared(str(tmp_path))
    assert len(snapshot["c_total"]) == keys
    assert all(snapshot["c_total"][(f"label-{i}", "x" * (i % 13))] == float(i) for i in range(keys))
    assert snapshot["g"] == {(): 2.5}


def test_threads_lose_no_increment(tmp_path: Path) -> None:
    shared = SharedValues(str(tmp_path), "threads")
    per_thread, threads = 5000, 4

    def work(t: int) -> None:
        for i in range(per_thread):
            shared.add("c_total", (), 1.0)
            shared.add("c_total", (str(i % 7), str(t)), 1.0)  # new keys while others add

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    snapshot = read_shared(str(tmp_path))
    shared.close()
    assert snapshot["c_total"][()] == per_thread * threads
    assert sum(snapshot["c_total"].values()) == 2 * per_thread * threads


def test_reader_sees_whole_entries_while_a_writer_appends(tmp_path: Path) -> None:
    """A reader racing a writer that keeps adding keys parses every read and never
    sees a value go down."""
    code = textwrap.dedent(
        """
        import sys
        from ec_frontend.metrics import SharedValues
        shared = SharedValues(sys.argv[1], "w", capacity=256)
        for i in range(40000):
            shared.add("c_total", (str(i % 5000),), 1.0)
            shared.add("n_total", (), 1.0)
        """
    )
    writer = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)])
    last = 0.0
    reads = 0
    try:
        while writer.poll() is None:
            data = (
                (tmp_path / "w.metrics").read_bytes() if (tmp_path / "w.metrics").exists() else b""
            )
            snap: dict = {}
            read_values(data, snap)
            now = snap.get("n_total", {}).get((), 0.0)
            assert now >= last
            assert set(snap) <= {"c_total", "n_total"}
            last = now
            reads += 1
    finally:
        writer.wait(60)
    assert writer.returncode == 0
    assert read_shared(str(tmp_path))["n_total"] == {(): 40000.0}
    assert reads > 1


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x01",
        (1 << 40).to_bytes(8, "little"),
        (20).to_bytes(8, "little") + b"\xff" * 12,
        (24).to_bytes(8, "little") + (3).to_bytes(4, "little") + b"{{{" + bytes(9),
        (24).to_bytes(8, "little") + (3).to_bytes(4, "little") + b"123" + bytes(9),
    ],
)
def test_truncated_or_foreign_bytes_are_skipped(data: bytes) -> None:
    snap: dict = {}
    read_values(data, snap)
    assert snap == {}


def test_files_of_other_kinds_are_ignored(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not metrics")
    shared = SharedValues(str(tmp_path), "a")
    shared.add("c_total", (), 3.0)
    shared.close()
    assert read_shared(str(tmp_path)) == {"c_total": {(): 3.0}}
