#!/usr/bin/env bash
# The GPU check in one go, on a machine with a CUDA device, Python 3.12, torch,
# transformers and Triton, and no package registry. Run it from the kit that
# benches/gpu_check_kit.py builds (it sits at the kit's top, beside wheels/ and repo/):
#
#   OUT=/some/dir bash gpu_check.sh
#
# It installs the kit's wheels offline into a virtual environment that sees the
# machine's own packages, then runs, each step logged under $OUT and the next
# one run even if one fails:
#   1. the tests that need CUDA (repo/benches/gpu_check_tests.py, JUnit XML);
#   2. greedy token identity against transformers on the same GPU (bfloat16) and
#      throughput against transformers' generate on a Qwen2-VL-2B-shaped model with
#      random weights at batch 1, 8 and 32 (benches/gpu_check.py);
#   3. the attention backends (sdpa, gather, triton) on the GPU (bench_attention);
#   4. multi-turn TTFT with and without prefix caching on the GPU (bench_prefix).
# $OUT/summary.json lists each step's exit status. Exit status: 0 when all passed.
set -uo pipefail

KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$KIT/out}"
PYTHON="${PYTHON:-python3.12}"
mkdir -p "$OUT"
VENV="$(mktemp -d)/venv"

log() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" | tee -a "$OUT/gpu_check.log"; }

"$PYTHON" -m venv --system-site-packages "$VENV" || exit 1
"$VENV/bin/python" -m pip install --no-index --find-links "$KIT/wheels" \
    ec-frontend openai uvloop httptools pytest pytest-timeout >"$OUT/install.log" 2>&1 || {
    log "offline install failed: see $OUT/install.log"
    exit 1
}
"$VENV/bin/python" -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())' \
    >"$OUT/versions.txt" 2>&1
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1

cd "$KIT/repo" || exit 1
declare -A status
step() {
    local name="$1"
    shift
    log "start $name"
    "$@" >"$OUT/$name.log" 2>&1
    status[$name]=$?
    log "end $name: exit ${status[$name]}"
}
step tests "$VENV/bin/python" -m pytest -q -p no:cacheprovider benches/gpu_check_tests.py \
    --junitxml "$OUT/gpu_tests.xml"
step checks "$VENV/bin/python" benches/gpu_check.py --out "$OUT" --device cuda
step attention "$VENV/bin/python" benches/bench_attention.py --device cuda --dtype bfloat16 \
    --rounds 3 --output "$OUT/bench_attention_cuda.json"
step prefix "$VENV/bin/python" benches/bench_prefix.py --device cuda --dtype bfloat16 \
    --rounds 3 --output "$OUT/bench_prefix_cuda.json"

failed=0
{
    printf '{'
    sep=''
    for name in tests checks attention prefix; do
        printf '%s"%s": %s' "$sep" "$name" "${status[$name]}"
        sep=', '
        [ "${status[$name]}" -eq 0 ] || failed=1
    done
    printf '}\n'
} >"$OUT/summary.json"
cat "$OUT/summary.json"
exit "$failed"
