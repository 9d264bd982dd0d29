#!/usr/bin/env bash
# Installs Mooncake (Transfer Engine + Store, with the mooncake_master binary) into the
# project's .venv, for the Mooncake connectors and their tests (tests/mooncake/).
#
# This host has no GPU: the CPU build `mooncake-transfer-engine-efa-non-cuda` (TCP
# transport, P2P handshake, Store client and master) is installed, with the Debian
# libraries its native modules link (libfabric1, libibverbs1, librdmacm1, libnuma1).
# GPU machines install `mooncake-transfer-engine` instead (the CUDA build: same `mooncake`
# Python module, plus RDMA and GPU memory): `pip install 'ec-frontend[mooncake]'`.
#
# Safe to run again, and from several shells at once (a lock serializes them): apt-get
# runs only when a library is missing, pip only when the pinned requirement below changes
# (a stamp file in .venv records it) or the module does not import.
set -euo pipefail
cd "$(dirname "$0")/.."

REQUIREMENT="mooncake-transfer-engine-efa-non-cuda==0.3.13.post1"
DEBS="libfabric1 libibverbs1 librdmacm1 libnuma1"
VENV=.venv
[ -x "$VENV/bin/python" ] || { echo "setup_mooncake: run scripts/setup.sh first" >&2; exit 1; }

exec 9>"$VENV/.mooncake.lock"
flock 9

missing=""
for deb in $DEBS; do
    dpkg-query -W -f='${Status}' "$deb" 2>/dev/null | grep -q "install ok installed" \
        || missing="$missing $deb"
done
if [ -n "$missing" ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "setup_mooncake: missing Debian packages:$missing (run as root or install them)" >&2
        exit 1
    fi
    echo "setup_mooncake: apt-get install$missing" >&2
    export DEBIAN_FRONTEND=noninteractive
    # shellcheck disable=SC2086
    apt-get install -y -q --no-install-recommends $missing >/dev/null \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $missing >/dev/null; }
fi

install_into() {
    local venv=$1 stamp="$1/.mooncake-requirement"
    if [ "$(cat "$stamp" 2>/dev/null || true)" != "$REQUIREMENT" ] \
        || ! "$venv/bin/python" -c "import mooncake.engine, mooncake.store" 2>/dev/null; then
        "$venv/bin/python" -m pip install -q --disable-pip-version-check "$REQUIREMENT"
        "$venv/bin/python" -c "import mooncake.engine, mooncake.store" \
            || { echo "setup_mooncake: mooncake does not import in $venv" >&2; exit 1; }
        echo "$REQUIREMENT" >"$stamp"
    fi
}
install_into "$VENV"
# The interop test runs vLLM's own Mooncake Store embedding client in vLLM's venv
# (scripts/setup_vllm.sh), so that venv gets the same build when it exists.
VLLM_VENV=${EC_FRONTEND_VLLM_VENV:-.venv-vllm}
if [ -x "$VLLM_VENV/bin/python" ]; then
    install_into "$VLLM_VENV"
fi
[ -x "$VENV/bin/mooncake_master" ] \
    || { echo "setup_mooncake: $VENV/bin/mooncake_master is missing" >&2; exit 1; }
