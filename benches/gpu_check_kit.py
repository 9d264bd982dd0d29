"""Build, on a machine with a package registry, the kit that ``gpu_check.sh`` installs
offline on a GPU machine that has Python 3.12, torch, transformers and Triton but
no registry.

The kit (a directory, and ``<dir>.tar.gz`` beside it):

* ``wheels/``: ec-frontend built by maturin for CPython 3.12 (the extension and
  the Python package), and the wheels of every other dependency the GPU machine
  lacks (the server, the client and pytest; torch, transformers, tokenizers,
  safetensors and numpy are the machine's own), for manylinux x86-64 / cp312;
* ``repo/``: what the checks run from a checkout: ``benches/gpu_check*``,
  ``benches/bench_attention.py``, ``benches/bench_prefix.py``,
  ``tests/model/test_attention_paths.py`` and ``pyproject.toml`` (pytest's
  settings);
* ``gpu_check.sh`` and ``manifest.json`` (every file, its size and SHA-256).

It refuses to finish above 64 MiB.

Run: ``.venv/bin/python benches/gpu_check_kit.py [--python python3.12] [--out dist/gpu-kit]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 64 * 2**20
#: On the GPU machine already (torch's and transformers' own dependencies).
PROVIDED = {"torch", "transformers", "tokenizers", "safetensors", "numpy", "triton"}
#: Build, lint and plotting tools the checks do not use.
TOOLING = {"maturin", "ruff", "tqdm", "matplotlib", "jsonschema"}
REPO_FILES = (
    "benches/gpu_check.py",
    "benches/gpu_check_tests.py",
    "benches/bench_attention.py",
    "benches/bench_prefix.py",
    "tests/model/test_attention_paths.py",
    "pyproject.toml",
)
#: glibc levels a current GPU host satisfies (the extension built here is tagged by the
#: glibc of this host: 2.34 when this was written).
PLATFORMS = (
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
)


def kit_requirements() -> list[str]:
    """``requirements.txt`` pins minus what the GPU machine has and the tooling."""
    out = []
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name = line.split("==", 1)[0].split(">=", 1)[0].strip().lower()
        if name not in PROVIDED | TOOLING:
            out.append(line)
    return out


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default="python3.12", help="a CPython 3.12 for maturin")
    ap.add_argument("--out", type=Path, default=ROOT / "dist" / "gpu-kit")
    args = ap.parse_args()
    kit = args.out
    if kit.exists():
        shutil.rmtree(kit)
    wheels = kit / "wheels"
    wheels.mkdir(parents=True)
    run(
        [
            sys.executable,
            "-m",
            "maturin",
            "build",
            "--release",
            "-i",
            args.python,
            "--out",
            str(wheels),
        ]
    )
    cmd = [sys.executable, "-m", "pip", "download", "--dest", str(wheels)]
    cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    run(cmd + kit_requirements())
    for name in [w.name for w in wheels.iterdir()]:
        if name.split("-", 1)[0].lower().replace("_", "-") in PROVIDED:
            (wheels / name).unlink()
    for rel in REPO_FILES:
        dest = kit / "repo" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, dest)
    shutil.copy(ROOT / "benches" / "gpu_check.sh", kit / "gpu_check.sh")
    files = sorted(p for p in kit.rglob("*") if p.is_file())
    manifest = {
        str(p.relative_to(kit)): {
            "bytes": p.stat().st_size,
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
        }
        for p in files
    }
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    total = sum(entry["bytes"] for entry in manifest.values())
    if total > LIMIT:
        raise SystemExit(f"the kit holds {total} bytes, over the {LIMIT} byte limit")
    archive = kit.with_name(kit.name + ".tar.gz")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(kit, arcname=kit.name)
    print(f"kit: {kit} ({total / 2**20:.1f} MiB, {len(files)} files); {archive}")


if __name__ == "__main__":
    main()
