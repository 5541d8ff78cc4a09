#!/usr/bin/env bash
# ./build.sh          build ./coli: one static x86-64 executable (musl, OpenMP)
# ./build.sh test     build, then run every test (also under ASan+UBSan); ends "N passed, N failed"
# ./build.sh fuzz N   run the GGUF reader fuzz loop for N iterations
set -euo pipefail
cd "$(dirname "$0")"

# -ffp-contract=off: no fused multiply-add behind our back, so that the scalar reference,
# every SIMD level and the GPU compute the same bits. No -march: the binary runs on any
# x86-64; SIMD kernels carry their own target attributes and are picked from CPUID.
CFLAGS="-std=c11 -O2 -Wall -Wextra -ffp-contract=off -fopenmp"
GOLDEN="${COLI_GOLDEN:-../shared/golden}"

need_musl() {
    command -v musl-gcc >/dev/null && return
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        echo "build.sh: musl-gcc is missing; installing Debian's musl-tools" >&2
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq musl-tools) >/dev/null
        command -v musl-gcc >/dev/null && return
    fi
    echo "build.sh: musl-gcc not found: install the package musl-tools" >&2
    exit 1
}

build_coli() {
    need_musl
    musl-gcc -static $CFLAGS coli.c -o coli -lm
}

# Builds tests/NAME.c twice: plain glibc gcc, and with AddressSanitizer + UBSan (musl has no
# sanitizer runtime, so that build uses glibc).
build_test() {
    local name=$1
    mkdir -p build
    gcc $CFLAGS -g -I. "tests/$name.c" -o "build/$name" -lm
    gcc $CFLAGS -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -I. "tests/$name.c" -o "build/$name.san" -lm
}

passed=0
failed=0
# Runs one test program, echoing its output, and adds its closing "N passed, N failed" line
# to the totals. A program that dies without that line counts as one failure.
run_test() {
    local label=$1; shift
    local out rc=0
    echo "== $label"
    out=$("$@" 2>&1) || rc=$?
    printf '%s\n' "$out" | grep -v '^ok - ' || true
    local line
    line=$(printf '%s\n' "$out" | grep -E '^[0-9]+ passed, [0-9]+ failed' | tail -n 1 || true)
    if [ -z "$line" ]; then
        echo "FAIL - $label: exited $rc without a result line"
        failed=$((failed + 1))
        return
    fi
    local p f
    p=${line%% passed*}
    f=${line#*, }; f=${f%% failed*}
    passed=$((passed + p))
    failed=$((failed + f))
    if [ "$rc" != 0 ] && [ "$f" = 0 ]; then
        echo "FAIL - $label: exit status $rc"
        failed=$((failed + 1))
    fi
}

run_tests() {
    build_coli
    local t
    for t in test_quant test_gguf test_tok test_model test_experts; do build_test "$t"; done
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
    for t in test_quant test_gguf test_tok test_model test_experts; do
        run_test "$t" "build/$t" "$GOLDEN"
        run_test "$t (asan+ubsan)" "build/$t.san" "$GOLDEN" --quick
    done
    run_test "test_cli" bash tests/test_cli.sh ./coli "$GOLDEN"
    echo "$passed passed, $failed failed"
    [ "$failed" = 0 ]
}

case "${1:-build}" in
    build) build_coli ;;
    test) run_tests ;;
    fuzz) build_test test_gguf && "build/test_gguf" "$GOLDEN" --long "${2:-100000}" ;;
    *) echo "usage: ./build.sh [build|test|fuzz N]" >&2; exit 2 ;;
esac
