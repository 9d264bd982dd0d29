#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ and runs each for a bounded time, side by side
# (one per core); exits non-zero if any target finds a crash (see docs/fuzzing.md).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]    (default: 20 s, every target)
#
# Plain `cargo +nightly` with the sanitizer-coverage flags that cargo-fuzz passes, so
# nothing needs installing beyond the nightly toolchain and a C++ compiler (for
# libFuzzer). Environment:
#   FUZZ_TOOLCHAIN   rustup toolchain (default nightly)
#   FUZZ_SANITIZER   address | memory | thread ... (default: none; the core has no unsafe)
#   FUZZ_ARGS        extra libFuzzer flags (e.g. "-jobs=2 -workers=2")
# The corpus grows in fuzz/corpus/<target>/ (seeded from the tests' bodies by
# fuzz/seeds.py, which also writes the dictionary fuzz/corpus/json.dict); crashing
# inputs land in fuzz/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-20}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(parse_request data_url compare_to_serde)
fi
toolchain=${FUZZ_TOOLCHAIN:-nightly}
host=$(rustc +"$toolchain" -vV | sed -n 's/^host: //p')

flags=(
    -Cpasses=sancov-module
    -Cllvm-args=-sanitizer-coverage-level=4
    -Cllvm-args=-sanitizer-coverage-inline-8bit-counters
    -Cllvm-args=-sanitizer-coverage-pc-table
    -Cllvm-args=-sanitizer-coverage-trace-compares
    --cfg fuzzing
    -Cforce-frame-pointers
)
if [ -n "${FUZZ_SANITIZER:-}" ]; then
    flags+=("-Zsanitizer=$FUZZ_SANITIZER")
fi

echo "== fuzz: build (toolchain $toolchain, target $host)"
# An explicit --target keeps the flags off build scripts and proc macros.
RUSTFLAGS="${flags[*]}" cargo +"$toolchain" build --quiet --release --locked \
    --manifest-path fuzz/Cargo.toml --target "$host" --bins

python3 fuzz/seeds.py fuzz/corpus
bin=fuzz/target/$host/release
# The targets run side by side, one per core (FUZZ_JOBS; default: the core count), each
# for the whole SECONDS on a core of its own: the same fuzzing as one after the other.
jobs=${FUZZ_JOBS:-$(nproc)}
logs=$(mktemp -d)
run_target() {
    local t=$1
    mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
    # shellcheck disable=SC2086 # FUZZ_ARGS is a list of flags
    if "$bin/$t" -max_total_time="$seconds" -max_len=16384 -timeout=10 \
        -rss_limit_mb=2048 -print_final_stats=1 -dict=fuzz/corpus/json.dict \
        -artifact_prefix="fuzz/artifacts/$t/" ${FUZZ_ARGS:-} \
        "fuzz/corpus/$t" >"$logs/$t.log" 2>&1; then
        touch "$logs/$t.ok"
    fi
}
running=0
for t in "${targets[@]}"; do
    if [ "$running" -ge "$jobs" ]; then
        wait -n || true
        running=$((running - 1))
    fi
    echo "== fuzz: $t for ${seconds}s"
    run_target "$t" &
    running=$((running + 1))
done
wait
failed=()
for t in "${targets[@]}"; do
    if [ -e "$logs/$t.ok" ]; then
        echo "-- $t"
        grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb|Done )' "$logs/$t.log" || true
    else
        tail -n 60 "$logs/$t.log"
        failed+=("$t")
    fi
done
rm -rf "$logs"
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz: crash in ${failed[*]} (inputs under fuzz/artifacts/)" >&2
    exit 1
fi
echo "fuzz: no crash"
