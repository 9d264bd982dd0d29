"""Transfer benchmark: Mooncake (TCP) against the side channels, same run, loopback.

* KV: a 7B-shaped cache (28 layers, 4 KV heads, head_dim 128, bfloat16, blocks of
  16 tokens), prompts of 4k and 16k tokens. The prefill half holds a request's
  blocks; the decode half moves them into its own cache: ``MooncakeConnector``
  (one batched one-sided Transfer Engine read into decode's registered blocks,
  plus the completion write) against ``KVSideChannelConnector`` (a pull over its
  TCP wire, then the copy into the cache). Both halves are the connectors' own
  code, in one process, over 127.0.0.1.
* Encoder output of a 1280x720 image on a 7B Qwen2-VL (1196 rows of 3584,
  bfloat16): ``MooncakeStoreECConnector``'s store client (put by the producer, get
  by a second client through a real ``mooncake_master``) against the EC side
  channel's item store (put, pull over TCP); in the same rounds, the Transfer
  Engine's raw read of a stored value into registered, touched memory (the floor
  of any Store round trip between two processes).

Prints ms per request and MB/s (median of the repeats, the two paths taking
turns so that a shared host's load hits both alike; 4x as many repeats for the
small EC item) with the ratio Mooncake / side channel, and writes
``benches/results/bench_transfer.json``. Needs Mooncake (``scripts/setup_mooncake.sh``)
and about 5 GB of memory.

    .venv/bin/python benches/bench_transfer.py [--repeats 5] [--out PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from ec_frontend.config import KVTransferConfig
from ec_frontend.connectors.kv_base import KVConnectorRole
from ec_frontend.connectors.kv_side_channel import KVSideChannelConnector
from ec_frontend.connectors.kv_side_channel import _Load as SideLoad
from ec_frontend.connectors.kv_transfer_params import parse_remote_prefill
from ec_frontend.connectors.mooncake_kv import MooncakeConnector, parse_layout
from ec_frontend.connectors.mooncake_kv import _Load as MooncakeLoad
from ec_frontend.connectors.mooncake_store import HEADER, EmbeddingStore, StoreSettings
from ec_frontend.connectors.side_channel_wire import dtype_name, request_tensor
from ec_frontend.connectors.transfer_settings import Settings
from ec_frontend.connectors.transfer_trust import TOKEN_KEY

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 28, 4, 128, 16
DTYPE = torch.bfloat16
EC_ROWS, EC_HIDDEN = 1196, 3584  # 1280x720 -> 1288x728 -> 46x26 merged patches; 7B hidden
RESULTS = Path(__file__).parent / "results" / "bench_transfer.json"

#: User-space copies of the payload on each path (kernel socket copies not counted).
COPIES = {
    "kv/mooncake": "0: the Transfer Engine reads prefill's registered blocks into decode's",
    "kv/side_channel": "4: index_select+stack, tobytes, recv into a bytearray, index_copy",
    "ec/mooncake": "1: put copies the tensor into the encoder's own segment (local memcpy, "
    "prefer_local_segment; 0 with it off: a TCP write from the tensor); get lands in a span "
    "of the registered read arena, used in place (one TCP read, no staging copy)",
    "ec/side_channel": "2: tobytes on the producer, recv into a bytearray",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_caches(num_blocks: int) -> list[torch.Tensor]:
    shape = (2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return [torch.empty(shape, dtype=DTYPE).uniform_(-1, 1) for _ in range(LAYERS)]


def fake_request(rid: str, num_tokens: int) -> SimpleNamespace:
    """What the connectors read of a finished prefill request (and decode's copy)."""
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params={"do_remote_decode": True},
        status=SimpleNamespace(finish_reason="length"),
        output_token_ids=[7],
        num_computed_tokens=num_tokens,
        num_prompt_tokens=num_tokens,
        prompt_token_ids=list(range(num_tokens)),
        mrope_position_delta=0,
    )


def kv_pair(cls: type, extra: dict[str, Any]) -> tuple[Any, Any]:
    prod = KVTransferConfig.from_json(
        {"kv_connector": cls.__name__, "kv_role": "kv_producer", "kv_connector_extra_config": extra}
    )
    cons = KVTransferConfig.from_json(
        {"kv_connector": cls.__name__, "kv_role": "kv_consumer", "kv_connector_extra_config": extra}
    )
    return cls(prod, KVConnectorRole.WORKER), cls(cons, KVConnectorRole.WORKER)


def bench_kv(num_tokens: int, repeats: int) -> dict[str, float]:
    num_blocks = -(-num_tokens // BLOCK)
    src, dst = kv_caches(num_blocks + 8), kv_caches(num_blocks + 8)
    blocks = list(range(1, num_blocks + 1))
    local = list(range(4, num_blocks + 4))
    index = torch.tensor(local)
    nbytes = LAYERS * 2 * num_blocks * BLOCK * KV_HEADS * HEAD_DIM * 2
    out: dict[str, float] = {"bytes": nbytes}

    mc_prod, mc_cons = kv_pair(MooncakeConnector, {"ttl_s": 600.0, "timeout_s": 600.0})
    mc_prod.save_kv(src)
    mc_cons.start_load_kv(dst)

    def mooncake_once(i: int) -> None:
        req = fake_request(f"mc{num_tokens}-{i}", num_tokens)
        _, params = mc_prod.request_finished(req, blocks)
        remote, layout = parse_remote_prefill(params, req), parse_layout(params)
        mc_cons._read(MooncakeLoad(req.request_id, local, remote, layout), dst)
        mc_prod.state.release_done()

    sc_prod, sc_cons = kv_pair(
        KVSideChannelConnector,
        {"port": 0, "ttl_s": 600.0, "timeout_s": 600.0, "max_item_bytes": 8 << 30},
    )
    sc_prod.save_kv(src)

    def side_channel_once(i: int) -> None:
        req = fake_request(f"sc{num_tokens}-{i}", num_tokens)
        _, params = sc_prod.request_finished(req, blocks)
        remote = parse_remote_prefill(params, req)
        data = sc_cons._pull(SideLoad(req.request_id, local, remote), dst)
        for layer, kv in enumerate(dst):
            kv.index_copy_(1, index, data[layer])

    def checked(name: str, once: Callable[[int], None]) -> Callable[[int], None]:
        def run(i: int) -> None:
            dst[LAYERS - 1].zero_()
            once(i)
            if name == "mooncake":
                assert mc_prod.num_requests_held == 0, "the completion write did not free the hold"
            check = dst[LAYERS - 1].index_select(1, index)
            assert torch.equal(check, src[LAYERS - 1][:, 1 : num_blocks + 1]), name

        return run

    out.update(
        timed(
            {"mooncake": checked("mooncake", mooncake_once),
             "side_channel": checked("side_channel", side_channel_once)},
            repeats,
        )
    )  # fmt: skip
    return out


def timed(cases: dict[str, Callable[[int], None]], repeats: int) -> dict[str, float]:
    """``<name>_ms``: the median of ``repeats`` timed runs of each case, after one
    untimed run; the cases alternate, so a shared host's load changes hit them alike.
    ``ratio_p50`` is the median of the per-round ratios (first case over second)."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for once in cases.values():
        once(-1)
    for i in range(repeats):
        for name, once in cases.items():
            start = time.perf_counter()
            once(i)
            times[name].append((time.perf_counter() - start) * 1000)
    first, second = list(times.values())[:2]
    out = {f"{name}_ms": statistics.median(t) for name, t in times.items()}
    out["ratio_p50"] = statistics.median(a / b for a, b in zip(first, second, strict=True))
    return out


def start_master() -> tuple[subprocess.Popen[bytes], str, str]:
    rpc, http = free_port(), free_port()
    master = Path(sys.executable).parent / "mooncake_master"
    proc = subprocess.Popen(
        [str(master), "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
         "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={http}", "--metrics_host=127.0.0.1",
         f"--metrics_port={free_port()}", "--default_kv_lease_ttl=100"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", http), timeout=0.5).close()
            socket.create_connection(("127.0.0.1", rpc), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"


def bench_ec(repeats: int) -> dict[str, float]:
    from ec_frontend.connectors.ec_side_channel_store import ItemStore

    tensor = torch.empty(EC_ROWS, EC_HIDDEN, dtype=DTYPE).uniform_(-1, 1)
    nbytes = tensor.numel() * tensor.element_size()
    out: dict[str, float] = {"bytes": nbytes}
    master, address, metadata = start_master()
    try:
        extra = {
            "master_server_address": address,
            "metadata_server": metadata,
            "global_segment_size": "512MB",
            "local_buffer_size": "64MB",
            "store_read_buffer_bytes": "64MB",
            "embedding_dtype": "torch.bfloat16",
        }
        producer = EmbeddingStore(StoreSettings.from_extra(extra))
        consumer = EmbeddingStore(StoreSettings.from_extra(extra))

        # The floor of any Store round trip between two processes: the Transfer Engine
        # reading a stored value into registered, already touched memory (no put, no
        # lookup, no allocation), timed in the same rounds.
        raw_key = producer.key(f"{19_999:064x}")
        assert producer.put(raw_key, tensor)
        landing = torch.zeros_like(tensor)
        header = ctypes.create_string_buffer(HEADER.size)
        native = consumer.store
        assert native.register_buffer(landing.data_ptr(), nbytes) == 0
        assert native.register_buffer(ctypes.addressof(header), HEADER.size) == 0

        def raw_get_once(i: int) -> None:
            ptrs = [[ctypes.addressof(header), landing.data_ptr()]]
            [n] = native.batch_get_into_multi_buffers([raw_key], ptrs, [[HEADER.size, nbytes]])
            assert n == HEADER.size + nbytes
            assert i >= 0 or torch.equal(landing, tensor)

        # Each path's result is compared with the tensor on its untimed first run only,
        # so that neither round trip is timed with a 8.6 MB comparison in it.
        def mooncake_once(i: int) -> None:
            key = producer.key(f"{i + 20_000:064x}")
            assert producer.put(key, tensor)
            got = consumer.get({key: EC_ROWS})[key]
            assert i >= 0 or torch.equal(got, tensor)

        settings = Settings(host="127.0.0.1", port=0, advertise_host=None, max_items=64,
                            max_bytes=8 << 30, max_item_bytes=1 << 30, ttl_s=600.0,
                            timeout_s=600.0)  # fmt: skip
        items = ItemStore(settings)

        def side_channel_once(i: int) -> None:
            mm_hash = f"{i + 20_000:064x}"
            items.put(mm_hash, tensor)
            item = items.get(mm_hash)
            assert item is not None
            _, got = request_tensor(
                "127.0.0.1", items.server.port,
                {"op": "get_ec", "mm_hash": mm_hash, TOKEN_KEY: item.token},
                timeout_s=600.0, max_bytes=nbytes, secret=None,
                shape=list(tensor.shape), dtype=dtype_name(tensor.dtype),
            )  # fmt: skip
            assert got.shape == tensor.shape
            assert i >= 0 or torch.equal(got, tensor)

        paths = {"mooncake": mooncake_once, "side_channel": side_channel_once,
                 "mooncake_raw_get": raw_get_once}  # fmt: skip
        out.update(timed(paths, repeats))
    finally:
        master.kill()
        master.wait()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--cases", nargs="+", default=["kv_4k", "kv_16k", "ec_1280x720"], help="cases to run"
    )
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    results: dict[str, Any] = {
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "repeats": args.repeats,
        "copies": COPIES,
    }
    cases: list[tuple[str, Callable[[], dict[str, float]]]] = [
        ("kv_4k", lambda: bench_kv(4096, args.repeats)),
        ("kv_16k", lambda: bench_kv(16384, max(3, args.repeats // 2))),
        ("ec_1280x720", lambda: bench_ec(4 * args.repeats)),
    ]
    print(f"{'case':<14}{'MB':>9}{'mooncake ms':>13}{'MB/s':>9}{'side ch. ms':>13}{'MB/s':>9}"
          f"{'speed-up':>10}")  # fmt: skip
    for name, run in cases:
        if name not in args.cases:
            continue
        r = run()
        mb = r["bytes"] / 1e6
        r["mooncake_mb_s"] = mb / (r["mooncake_ms"] / 1000)
        r["side_channel_mb_s"] = mb / (r["side_channel_ms"] / 1000)
        r["speedup"] = r["side_channel_ms"] / r["mooncake_ms"]
        r["speedup_per_round_p50"] = 1 / r.pop("ratio_p50")
        results[name] = r
        print(f"{name:<14}{mb:>9.1f}{r['mooncake_ms']:>13.1f}{r['mooncake_mb_s']:>9.0f}"
              f"{r['side_channel_ms']:>13.1f}{r['side_channel_mb_s']:>9.0f}"
              f"{r['speedup']:>9.2f}x", flush=True)  # fmt: skip
        if "mooncake_raw_get_ms" in r:
            print(f"{'':<14}raw Transfer Engine get alone: {r['mooncake_raw_get_ms']:.1f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=args.out.parent, delete=False) as f:
        json.dump(results, f, indent=2)
    os.replace(f.name, args.out)
    print(f"wrote {args.out}")
    sys.stdout.flush()
    os._exit(0)  # Mooncake clients of a stopped master take seconds each to tear down


if __name__ == "__main__":
    main()
