#!/usr/bin/env bash
# Creates .venv, installs the pinned dependencies and builds the native core into it.
# Safe to run again: dependencies are reinstalled only when requirements.txt changes.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
    echo "$want" >"$stamp"
fi

# nasm assembles libjpeg-turbo's SIMD code (mozjpeg-sys feature nasm_simd): JPEG decode in
# the native preprocessor is several times slower without it, and the build needs it.
if ! command -v nasm >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ]; then
        echo "setup: nasm is missing (apt-get install nasm as root); the JPEG decoder's SIMD needs it" >&2
        exit 1
    fi
    echo "setup: apt-get install nasm" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends nasm >/dev/null \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends nasm >/dev/null; }
fi

export VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH" PYO3_PYTHON="$PWD/.venv/bin/python"
log=$(mktemp)
if ! maturin develop --release --locked -q >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "setup: maturin develop failed" >&2
    exit 1
fi
rm -f "$log"
# Test-only: transformers' torchvision image-processor backend, the second reference of
# tests/preprocess and benches/bench_preprocess.py. Kept out of the venv's site-packages
# (with torchvision importable, transformers would pick that backend everywhere): those
# two put this directory on PYTHONPATH of a child process. --no-deps: the venv's torch
# serves it. A failed install only leaves that comparison skipped.
TORCHVISION="torchvision==0.29.2"
extras=.venv/extras/torchvision
if [ "$(cat "$extras/.requirement" 2>/dev/null || true)" != "$TORCHVISION" ]; then
    rm -rf "$extras"
    if .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps \
        --target "$extras" "$TORCHVISION"; then
        echo "$TORCHVISION" >"$extras/.requirement"
    else
        echo "setup: $TORCHVISION could not be installed (tests/preprocess skip that comparison)" >&2
    fi
fi

.venv/bin/python -c "import ec_frontend._core" \
    || { echo "setup: the native extension did not build" >&2; exit 1; }
