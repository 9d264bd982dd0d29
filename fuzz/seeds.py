"""Writes the seed corpus of the fuzz targets from the tests' request bodies.

Usage: python3 fuzz/seeds.py OUT_DIR. Standard library only (no native extension).

Sources: the literal bodies of the Rust integration tests (``Endpoint::X, r#"..."#``
rows), the malformed bodies of ``tests/core/bad_inputs.py`` and the benchmark
fixtures. ``parse_request`` seeds are the endpoint's index byte plus the body;
``compare_to_serde`` seeds are the bodies; ``data_url`` seeds are every ``data:``
URL found in them or in the Rust tests' sources. Each seed is a file named by its
content's hash, so reruns add nothing twice. ``OUT_DIR/json.dict`` is a libFuzzer
dictionary: the quoted names in the parser's sources plus JSON and URL tokens.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENDPOINTS = ["chat", "completions", "responses", "generate"]
RUST_ROW = re.compile(rb'Endpoint::(Chat|Completions|Responses|Generate),\s*r#"(.*?)"#', re.S)
DATA_URL = re.compile(rb'data:[^"\\\s]*')
NAME = re.compile(rb'"([a-z][a-z_]*)"')
TOKENS = [
    b"{", b"}", b"[", b"]", b":", b",", b"null", b"true", b"false", b"-0", b"1e400",
    b"18446744073709551616", b"-9223372036854775809", b"0.5e-3", b"\\u", b"\\ud83d\\ude00",
    b"data:image/png;base64,", b"https://", b";base64", b"=",
]  # fmt: skip
# Seeds longer than this are left out (the targets run with a bounded input length).
MAX_SEED = 16 * 1024


def rust_bodies() -> list[tuple[str, bytes]]:
    out = []
    for path in sorted((ROOT / "rust" / "ec-core" / "tests").glob("*.rs")):
        for endpoint, body in RUST_ROW.findall(path.read_bytes()):
            if b"{{" not in body:
                out.append((endpoint.decode().lower(), body))
    return out


def bad_input_bodies() -> list[tuple[str, bytes]]:
    spec = importlib.util.spec_from_file_location(
        "bad_inputs", ROOT / "tests" / "core" / "bad_inputs.py"
    )
    if spec is None or spec.loader is None:
        raise RuntimeError("tests/core/bad_inputs.py not found")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bad_inputs"] = module
    spec.loader.exec_module(module)
    return [(case.endpoint, case.body) for case in module.BAD_INPUTS]


def fixture_bodies() -> list[tuple[str, bytes]]:
    fixtures = sorted((ROOT / "benches" / "fixtures").glob("*.json"))
    return [("chat", p.read_bytes()) for p in fixtures]


def dict_entry(token: bytes) -> bytes:
    """One line of a libFuzzer dictionary: the token quoted, ``\\`` and ``"`` escaped."""
    return b'"' + token.replace(b"\\", b"\\\\").replace(b'"', b'\\"') + b'"'


def dictionary() -> bytes:
    names = set()
    for path in sorted((ROOT / "rust" / "ec-core" / "src").glob("*.rs")):
        names.update(NAME.findall(path.read_bytes()))
    entries = [dict_entry(b'"' + n + b'"') for n in sorted(names)]
    entries += [dict_entry(t) for t in TOKENS]
    return b"\n".join(entries) + b"\n"


def write(directory: Path, data: bytes) -> bool:
    if len(data) > MAX_SEED:
        return False
    name = directory / ("seed-" + hashlib.sha1(data).hexdigest())
    if name.exists():
        return False
    name.write_bytes(data)
    return True


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: seeds.py OUT_DIR")
    out = Path(sys.argv[1])
    dirs = {t: out / t for t in ("parse_request", "compare_to_serde", "data_url")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    bodies = rust_bodies() + bad_input_bodies() + fixture_bodies()
    written = dict.fromkeys(dirs, 0)
    for endpoint, body in bodies:
        written["parse_request"] += write(
            dirs["parse_request"], bytes([ENDPOINTS.index(endpoint)]) + body
        )
        written["compare_to_serde"] += write(dirs["compare_to_serde"], body)
        for url in DATA_URL.findall(body):
            written["data_url"] += write(dirs["data_url"], url)
    for path in sorted((ROOT / "rust" / "ec-core" / "tests").glob("*.rs")):
        for url in DATA_URL.findall(path.read_bytes()):
            written["data_url"] += write(dirs["data_url"], url)
    (out / "json.dict").write_bytes(dictionary())
    print("seeds: " + ", ".join(f"{t} +{n}" for t, n in written.items()))


if __name__ == "__main__":
    main()
