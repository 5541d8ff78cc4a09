#!/usr/bin/env bash
# ./build.sh          build ./coli: one static x86-64 executable (musl, OpenMP)
# ./build.sh test     build, then run every test (also under ASan+UBSan); ends "N passed, N failed"
# ./build.sh fuzz N [SEED]  run the GGUF reader fuzz loop for N iterations (SEED: other mutations than the suite's)
# ./build.sh fuzz-serve [N]       N (default 10000) malformed requests against a coli serve it starts
# ./build.sh load [K] [M] [MODEL] K streaming clients x M requests against coli serve: tok/s, time to first token
# ./build.sh agents [TURNS] [MAX_TOKENS] [MODEL]  multi-turn agent chats against coli serve, as three runs at
#                 --parallel 1 (reuse, 2 turns without reuse, 2 interleaved) and one at --parallel 2: cached prompt
#                 share, prompt time as the history grows. Defaults 8 turns, 64 tokens (serve_agents' own
#                 are 20 and 500, too slow for the slice at ~9 tok/s decode on 2 cores)
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

# The glibc side of the foreign dlopen (coli.c §5, portable-notes.md): a tiny PIE that glibc's
# ld.so starts inside coli's process and that hands dlopen/dlsym/dlerror/dlclose to coli. Its own
# 6-instruction _start avoids __libc_start_main@GLIBC_2.34, and the dl* symbols are pinned to
# GLIBC_2.2.5, so the same binary works on glibc 2.2.5 through today. Embedded by coli.c.
build_helper() {
    mkdir -p build
    cat >build/coli_helper.c <<'HELPER'
__asm__(".symver dlopen,dlopen@GLIBC_2.2.5\n.symver dlsym,dlsym@GLIBC_2.2.5\n"
        ".symver dlerror,dlerror@GLIBC_2.2.5\n.symver dlclose,dlclose@GLIBC_2.2.5");
void *dlopen(const char *file, int mode);
void *dlsym(void *handle, const char *name);
char *dlerror(void);
int dlclose(void *handle);
/* argv[1] is the hex address of coli's callback; it never returns (it longjmps home). */
__attribute__((used, noreturn)) void helper_main(long argc, char **argv)
{
    unsigned long a = 0;
    for (const char *p = argc > 1 ? argv[1] : ""; *p; p++) a = a * 16 + (unsigned long)(*p <= '9' ? *p - '0' : *p - 'a' + 10);
    void *fns[4] = {(void *)dlopen, (void *)dlsym, (void *)dlerror, (void *)dlclose};
    if (a) ((void (*)(void *const *))a)(fns);
    for (;;) __asm__ volatile("hlt");
}
__asm__(".text\n.globl _start\n_start:\n xor %ebp,%ebp\n mov (%rsp),%rdi\n lea 8(%rsp),%rsi\n"
        " and $-16,%rsp\n call helper_main\n hlt\n");
HELPER
    gcc -Os -fPIE -pie -nostartfiles -fno-stack-protector -fno-asynchronous-unwind-tables \
        -Wl,--no-as-needed -Wl,-z,noexecstack -Wl,--build-id=none -s build/coli_helper.c -l:libdl.so.2 -o build/coli_helper
}

# kernels.ptx is committed, so builds need no CUDA toolkit. Where nvcc exists and kernels.cu
# changed, it is regenerated: nvcc 13 emits only .target sm_75+ / .version 9.0, but the
# instructions used are sm_30-era plus shfl.sync (PTX 6.0), so the header is lowered to what
# drivers of the last years JIT for every card from Maxwell on (portable-notes.md §4). No
# fused multiply-add (-fmad=false), as the CPU side's -ffp-contract=off.
build_ptx() {
    local nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    [ -x "$nvcc" ] && [ kernels.cu -nt kernels.ptx ] || return 0
    mkdir -p build
    "$nvcc" -ptx -arch=compute_75 -fmad=false -prec-div=true -prec-sqrt=true -ftz=false kernels.cu -o build/kernels.ptx
    if grep -qE 'dp4a|dp2a' build/kernels.ptx; then echo "build.sh: kernels.ptx would need sm_61 (dp4a)" >&2; exit 1; fi
    sed -e 's/^\.version .*/.version 6.0/' -e 's/^\.target .*/.target sm_52/' build/kernels.ptx >kernels.ptx
}

build_coli() {
    need_musl
    build_helper
    build_ptx
    build_coli_binary
}

# The compile itself: needs build_helper's and build_ptx's outputs.
build_coli_binary() {
    musl-gcc -static $CFLAGS coli.c -o coli -lm
}

# Runs each argument (a command line) in the background, at most as many at once as there are
# CPUs, and waits for all; fails if any failed. `./build.sh test` runs its 9 compiles so (the
# suite's two builds, coli, four small test builds, the fake driver, the clients), then its 21
# test runs: jobs of very different lengths, given the longest first so that the cores end
# close together.
# Each job leaves its outcome in build/pool/N, read once all have ended (a job's exit status
# could otherwise be collected by the wait that makes room for the next).
run_pool() {
    local slots cmd i=0 j rc=0 dir=build/pool cmds=("$@")
    slots=$(nproc 2>/dev/null || echo 2)
    rm -rf "$dir"
    mkdir -p "$dir"
    for cmd in "$@"; do
        while [ "$(jobs -rp | wc -l)" -ge "$slots" ]; do wait -n || true; done
        # not in an if: a condition's commands run with set -e off, down to a function's last one
        { set +e; (set -e; eval "$cmd"); echo "$?" >"$dir/$i"; } &
        i=$((i + 1))
    done
    wait
    for ((j = 0; j < i; j++)); do
        if [ "$(cat "$dir/$j" 2>/dev/null)" != 0 ]; then
            echo "build.sh: failed (status $(cat "$dir/$j" 2>/dev/null || echo unknown)): ${cmds[j]}" >&2
            rc=1
        fi
    done
    return "$rc"
}

# Builds tests/NAME.c plain (glibc gcc) or, given "san", with AddressSanitizer + UBSan (musl has
# no sanitizer runtime, so that build uses glibc; -g1: line tables for the reports' stacks, without
# the variable tracking that took a sixth of its compile).
# A test uses part of coli.c, so unused functions are expected there.
# The plain build of the suite (it holds test_quant and test_model, which check the kernels bit
# for bit) compiles them as shipped; every other build defines COLI_ROLLED (coli.c §3: the same
# results, ~30% less compile time).
unrolled_test() { case $1 in suite) return 0 ;; *) return 1 ;; esac; }

build_test_variant() {
    local name=$1 rolled=-DCOLI_ROLLED
    if unrolled_test "$name"; then rolled=; fi
    mkdir -p build
    if [ "${2:-}" = san ]; then
        gcc $CFLAGS -Wno-unused-function -O1 -g1 -fsanitize=address,undefined -fno-sanitize-recover=all -DCOLI_ROLLED -I. "tests/$name.c" -o "build/$name.san" -lm
    else
        gcc $CFLAGS $rolled -Wno-unused-function -g -I. "tests/$name.c" -o "build/$name" -lm
    fi
}

# Both builds of tests/NAME.c, side by side.
build_test() {
    run_pool "build_test_variant $1" "build_test_variant $1 san"
}

# The fake CUDA driver (tests/fake_cuda.c): a glibc libcuda.so.1 that runs each kernel's C twin
# on the host, the same built as a stub whose cuInit answers 34, and (where g++ is) the same
# running kernels.cu's own source on the host instead of the twins (tests/kernels_sim.cc).
build_kernels_sim() {
    rm -rf build/sim
    command -v g++ >/dev/null || { echo "build.sh: no g++: kernels.cu is not simulated on the host" >&2; return 0; }
    mkdir -p build/sim
    g++ -c -fPIC -O2 -Wall -Wextra -Wno-unknown-pragmas -ffp-contract=off -fno-exceptions -fno-rtti -fvisibility=hidden tests/kernels_sim.cc -o build/sim/kernels_sim.o
    gcc -shared -fPIC -O2 -Wall -Wextra -ffp-contract=off -DFAKE_SIM -Wl,-soname,libcuda.so.1 tests/fake_cuda.c build/sim/kernels_sim.o \
        -o build/sim/libcuda.so.1 -lm
}

build_fake_driver() {
    mkdir -p build/fake build/stub
    gcc -shared -fPIC -O2 -Wall -Wextra -ffp-contract=off -Wl,-soname,libcuda.so.1 tests/fake_cuda.c -o build/fake/libcuda.so.1 -lm
    gcc -shared -fPIC -O2 -Wall -Wextra -DFAKE_STUB -Wl,-soname,libcuda.so.1 tests/fake_cuda.c -o build/stub/libcuda.so.1 -lm
    build_kernels_sim
}

# ptxas on kernels.ptx for every architecture the installed ptxas knows (CUDA 13: sm_75 on;
# an older toolkit also checks sm_52/61/70). Skipped without ptxas.
check_ptx() {
    local ptxas=${PTXAS:-$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)}
    if [ ! -x "$ptxas" ]; then echo "ok - kernels.ptx assembles # SKIP no ptxas"; echo "1 passed, 0 failed"; return; fi
    local sms sm p=0 f=0
    sms=$("$ptxas" --help | tr -d "\n '" | grep -oE "sm_[0-9]+[,]" | tr -d , | sort -u -V)
    # as many architectures at once as there are CPUs (~3 s each, a dozen of them)
    mkdir -p build/ptxas
    printf '%s\n' $sms | xargs -P "$(nproc 2>/dev/null || echo 2)" -I{} sh -c \
        '"$0" -arch={} kernels.ptx -o /dev/null 2>build/ptxas/{}.err; echo $? >build/ptxas/{}.rc' "$ptxas"
    for sm in $sms; do
        if [ "$(cat "build/ptxas/$sm.rc" 2>/dev/null)" = 0 ]; then echo "ok - kernels.ptx assembles for $sm"; p=$((p + 1))
        else echo "FAIL - kernels.ptx for $sm: $(head -c 300 "build/ptxas/$sm.err" 2>/dev/null)"; f=$((f + 1)); fi
    done
    if ! grep -qE '^\.target sm_52$' kernels.ptx; then echo "FAIL - kernels.ptx is not .target sm_52"; f=$((f + 1)); fi
    echo "$p passed, $f failed"
}

# The HTTP clients that fuzz, load and replay conversations against coli serve (loopback only;
# tests/serve_fuzz.c, serve_load.c, serve_agents.c). They report through check.h, whose
# golden-file helpers they do not use.
build_serve_clients() {
    mkdir -p build
    gcc -std=c11 -O2 -Wall -Wextra -Wno-unused-function -pthread tests/serve_fuzz.c -o build/serve_fuzz
    gcc -std=c11 -O2 -Wall -Wextra -Wno-unused-function -pthread tests/serve_load.c -o build/serve_load
    gcc -std=c11 -O2 -Wall -Wextra -Wno-unused-function -pthread tests/serve_agents.c -o build/serve_agents
}

# Stops the server start_server started, if any; it is also the EXIT trap, so that a run that
# fails leaves no server behind.
stop_server() {
    [ -n "${SERVE_PID:-}" ] || return 0
    kill "$SERVE_PID" 2>/dev/null || true
    wait "$SERVE_PID" 2>/dev/null || true
    SERVE_PID=
}

# Starts ./coli serve on a free loopback port with ARGS; sets SERVE_PID and SERVE_PORT. One at a
# time: stop_server ends it (at the latest when the script exits).
start_server() {
    local log=build/serve_bench.log i
    HEAT_FILE=build/serve_bench.heat ./coli serve --port 0 "$@" 2>"$log" &
    SERVE_PID=$!
    trap stop_server EXIT
    for i in $(seq 1 600); do
        SERVE_PORT=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$log" | grep -o '[0-9]*$' || true)
        [ -n "$SERVE_PORT" ] && curl -sf -m 2 "http://127.0.0.1:$SERVE_PORT/health" >/dev/null && return
        sleep 0.5
    done
    echo "build.sh: coli serve did not come up; $(tail -n 3 "$log")" >&2
    exit 1
}

# The 10-layer slice of the 35B (tests/gen_model.c), made once into build/.
slice_model() {
    local out=build/35b-slice10.gguf
    if [ ! -s "$out" ]; then
        gcc -std=c11 -O2 -march=native -fopenmp -ffp-contract=off -I. tests/gen_model.c -o build/gen_model -lm
        build/gen_model "$out" --preset 35b-a3b --layers 10 >&2
    fi
    echo "$out"
}

# One serve_agents run against the server that is up, with ARGS; a run that lost a request sets
# agents_lost, and the next runs go on.
agents_client() {
    echo "-- serve_agents $*"
    build/serve_agents 127.0.0.1 "$SERVE_PORT" "$@" || agents_lost=1
}

# The agents benchmark on MODEL, TURNS turns of MAX_TOKENS: one server session per --parallel
# setting, each stopped before the next starts (one port, one heat file, the memory for one model).
# -c 16384: the history grows by a user message and a reply each turn. Returns 1 if a run lost.
run_agents() {
    local model=$1 turns=$2 max_tokens=$3
    agents_lost=0
    echo "== coli serve --parallel 1 -c 16384 ($model)"
    start_server -m "$model" -c 16384 --parallel 1
    agents_client --turns "$turns" --max-tokens "$max_tokens" --conversations 1
    agents_client --turns 2 --max-tokens "$max_tokens" --conversations 1 --no-reuse
    agents_client --turns "$turns" --max-tokens "$max_tokens" --conversations 2
    stop_server
    echo "== coli serve --parallel 2 -c 16384 ($model)"
    start_server -m "$model" -c 16384 --parallel 2
    agents_client --turns "$turns" --max-tokens "$max_tokens" --conversations 2
    stop_server
    return "$agents_lost"
}

passed=0
failed=0
# Runs one test program (job N of the test pool, labelled LABEL) with its output, exit status and
# seconds left in build/results/N.*, for test_report. A program still running after
# TEST_TIMEOUT seconds (default 600) is stopped, so that a hang fails the run instead of holding it.
test_job() {
    local n=$1 label=$2 start=$SECONDS rc=0; shift 2
    if [ "$(type -t "$1")" = function ]; then "$@" >"build/results/$n.out" 2>&1 || rc=$?
    else timeout -k 10 "${TEST_TIMEOUT:-600}" "$@" >"build/results/$n.out" 2>&1 || rc=$?; fi
    [ "$rc" != 124 ] || echo "FAIL - $label: still running after ${TEST_TIMEOUT:-600} s, stopped" >>"build/results/$n.out"
    echo "$label" >"build/results/$n.label"
    echo "$rc" >"build/results/$n.rc"
    echo "$((SECONDS - start))" >"build/results/$n.s"
}

# Prints job N's output but its ok lines, and adds its closing "N passed, N failed" line to the
# totals. A program that dies without that line counts as one failure.
test_report() {
    local d=build/results n=$1 label rc line p f
    label=$(cat "$d/$n.label" 2>/dev/null || echo "test job $n")
    rc=$(cat "$d/$n.rc" 2>/dev/null || echo "unknown")
    echo "== $label"
    echo "   ($(cat "$d/$n.s" 2>/dev/null || echo ?) s)"
    grep -v '^ok - ' "$d/$n.out" 2>/dev/null || true
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$d/$n.out" 2>/dev/null | tail -n 1 || true)
    if [ -z "$line" ]; then
        echo "FAIL - $label: exited $rc without a result line"
        failed=$((failed + 1))
        return
    fi
    p=${line%% passed*}
    f=${line#*, }; f=${f%% failed*}
    passed=$((passed + p))
    failed=$((failed + f))
    if [ "$rc" != 0 ] && [ "$f" = 0 ]; then
        echo "FAIL - $label: exit status $rc"
        failed=$((failed + 1))
    fi
}

TESTS="test_quant test_gguf test_tok test_sample test_model test_experts test_cuda test_serve"
# The tests that reach coli's kernels run from one binary per build kind (tests/suite.c): coli.c's
# reachable part, compiled once instead of six times, was most of the suite's time. The others
# are small and build alone.
SUITE_TESTS="test_quant test_model test_experts test_cuda test_serve test_sample"
in_suite() { case " $SUITE_TESTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# The command line of test T's build kind (empty or .san).
test_command() { if in_suite "$1"; then echo "build/suite${2:-} $1"; else echo "build/$1${2:-}"; fi; }

run_tests() {
    local t builds=()
    need_musl
    build_helper
    build_ptx
    # every compile in one pool, the longest first (the suite's two, then coli itself)
    builds=("build_test_variant suite san" "build_test_variant suite" build_coli_binary)
    for t in $TESTS; do
        if ! in_suite "$t"; then builds+=("build_test_variant $t" "build_test_variant $t san"); fi
    done
    run_pool "${builds[@]}" build_fake_driver build_serve_clients
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
    # As many tests at once as there are CPUs (run_pool), the longest first as measured on a 2-core
    # host, so that they end together: one at a time they kept 1.15 of its 2 cores busy. Waiting
    # threads sleep rather than spin, which another test's threads would pay for.
    export OMP_WAIT_POLICY=passive
    # LABEL|COMMAND; then every other test of $TESTS in both builds, and the simulation.
    local g=${GOLDEN@Q}
    local jobs=(
        "test_cuda.sh|bash tests/test_cuda.sh ./coli $g build"
        "test_model|$(test_command test_model) $g"
        "test_model (asan+ubsan)|$(test_command test_model .san) $g --quick"
        "test_quant (asan+ubsan)|$(test_command test_quant .san) $g --quick"
        "test_serve.sh|bash tests/test_serve.sh ./coli $g --fuzz-bin build/serve_fuzz"
        "test_experts|$(test_command test_experts) $g"
        "test_experts (asan+ubsan)|$(test_command test_experts .san) $g --quick"
        "test_gguf (asan+ubsan)|$(test_command test_gguf .san) $g --quick"
        "test_quant|$(test_command test_quant) $g"
        "kernels.ptx (ptxas)|check_ptx"
        "test_cli|bash tests/test_cli.sh ./coli $g"
    )
    for t in $TESTS; do
        case " ${jobs[*]} " in *"|$(test_command "$t") "*) ;; *) jobs+=("$t|$(test_command "$t") $g") ;; esac
        case " ${jobs[*]} " in *"|$(test_command "$t" .san) "*) ;; *) jobs+=("$t (asan+ubsan)|$(test_command "$t" .san) $g --quick") ;; esac
    done
    if [ -f build/sim/libcuda.so.1 ]; then jobs+=("test_cuda (kernels.cu on the host)|env COLI_TEST_SIM=1 $(test_command test_cuda) $g")
    else echo "== test_cuda (kernels.cu on the host): SKIP, no g++"; fi
    local pool=() i
    rm -rf build/results
    mkdir -p build/results
    for i in "${!jobs[@]}"; do pool+=("test_job $i '${jobs[i]%%|*}' ${jobs[i]#*|}"); done
    run_pool "${pool[@]}" || true
    for i in "${!jobs[@]}"; do test_report "$i"; done
    echo "$passed passed, $failed failed"
    [ "$failed" = 0 ]
}

case "${1:-build}" in
    build) build_coli ;;
    test) run_tests ;;
    fuzz) build_test test_gguf && "build/test_gguf" "$GOLDEN" --long "${2:-100000}" --seed "${3:-20240601}" ;;
    fuzz-serve)
        build_coli && build_serve_clients
        start_server -m "$GOLDEN/q35moe-q8_0.gguf" -c 256 --parallel 2
        build/serve_fuzz 127.0.0.1 "$SERVE_PORT" "${2:-10000}" ;;
    load)
        build_coli && build_serve_clients
        model=${4:-$(slice_model)}
        start_server -m "$model" -c 4096 --parallel "${2:-4}"
        build/serve_load 127.0.0.1 "$SERVE_PORT" "${2:-4}" "${3:-3}" ;;
    agents)
        build_coli && build_serve_clients
        model=${4:-$(slice_model)}
        run_agents "$model" "${2:-8}" "${3:-64}" ;;
    *) echo "usage: ./build.sh [build|test|fuzz N [SEED]|fuzz-serve [N]|load [K] [M] [MODEL]|agents [TURNS] [MAX_TOKENS] [MODEL]]" >&2; exit 2 ;;
esac
