#!/usr/bin/env bash
# Creates .venv-vllm, a separate virtual environment holding vLLM (pinned) and its own
# dependencies, for the interop tests (tests/interop/) that drive ec-frontend with vLLM's
# own code. The project's .venv is never touched.
#
# A full install from PyPI (vLLM, its torch and CUDA wheels: about 9.5 GB on disk) took
# 4.5 minutes on the 2-core development host; nothing of it is compiled. Installing vLLM
# without its dependencies against the project's torch/transformers was tried and dropped:
# vLLM 0.33.0 pins transformers<5.21 (the project has 5.24) and imports some twenty
# further modules before `vllm bench serve` even parses its arguments.
#
# Safe to run again, and from several shells at once (a lock serializes them): the venv is
# rebuilt only when the pinned requirement below changes (a stamp file records it) or a
# previous install did not finish.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${EC_FRONTEND_VLLM_VENV:-.venv-vllm}
REQUIREMENT="vllm==0.33.0"
PY=${PYTHON:-python3}

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9

stamp="$VENV/.ec-frontend-requirement"
if [ "$(cat "$stamp" 2>/dev/null || true)" = "$REQUIREMENT" ] && [ -x "$VENV/bin/vllm" ]; then
    exit 0
fi

echo "setup_vllm: installing $REQUIREMENT into $VENV (several minutes, about 9.5 GB)" >&2
start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$REQUIREMENT"
"$VENV/bin/vllm" bench serve --help >/dev/null 2>&1 \
    || { echo "setup_vllm: 'vllm bench serve' does not start in $VENV" >&2; exit 1; }
echo "$REQUIREMENT" >"$stamp"
echo "setup_vllm: done in $(($(date +%s) - start)) s" >&2
