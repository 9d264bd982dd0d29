#!/usr/bin/env bash
# The project's test command: lints, Rust tests, Python tests. Extra args go to one plain
# pytest run (no workers) in place of the default two-phase run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" PYO3_PYTHON="$PWD/.venv/bin/python"

echo "== lint"
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked --quiet -- -D warnings
ruff check .
ruff format --check .
# The package's floors import only downward (contract: [tool.importlinter] in pyproject.toml).
PYTHONPATH=python lint-imports --no-cache
# Types: mypy (config in pyproject.toml; strict on the engine, connectors and model) and
# the native module's stub checked against the built module.
mypy
PYTHONPATH=python python -m mypy.stubtest ec_frontend._core --allowlist scripts/stubtest_allowlist.txt

echo "== cargo test"
cargo test --workspace --locked --quiet
bash scripts/fuzz.sh 20

echo "== pytest"
# tests/interop drive the server with vLLM's own code from a separate venv (first run: 5-10 min).
bash scripts/setup_vllm.sh
# tests/mooncake start a real mooncake_master: the CPU build of Mooncake and its Debian libraries.
bash scripts/setup_mooncake.sh
if [ $# -gt 0 ]; then
    python -m pytest "$@"
else
    # Two workers (pytest-xdist), a test file kept on one worker so that its module's
    # shared servers start once; then the `serial` tests (scaling ratios, latency
    # bounds, real-shape checkpoints of 5-14 GiB), alone on the machine.
    # EC_TEST_WORKERS sets the worker count.
    # --durations: where the suite's time goes (its budget is 20 minutes, issue 27).
    python -m pytest -n "${EC_TEST_WORKERS:-2}" --dist loadfile -m "not serial" --durations=40
    python -m pytest -m serial --durations=15
fi
