#!/usr/bin/env bash
# gpu_check.sh: the GPU path on a machine with a real NVIDIA card and driver (no toolkit needed).
# Builds, prints coli info, runs every kernel on device 0 against the CPU (GEMVs, batches of
# products, activation quantisation, routed-expert batches: bit-identical, through the native
# dlopen of a glibc test build; then the copy bandwidth and GB/s of the main formats' GEMVs),
# then the golden models on the CPU and with the trunk and the experts on the GPU through the
# static binary's foreign dlopen (same tokens and logits), prints bench --kernels' table for the
# card, runs the decode benchmark on the 35B-A3B geometry at 1k and 8k tokens of context (and at
# 1k without CUDA graphs), and prints a summary. Budget: under 10 minutes (each benchmark stops
# at 200 s).
# usage: tests/gpu_check.sh [--prebuilt] [GOLDEN_DIR]
# --prebuilt: a machine without musl-tools or a network (a lent card) runs the ./coli and
# build/test_cuda built elsewhere (`./build.sh` and `tests/gpu_check.sh --build-only`).
# GPU_CHECK_CONTEXTS: the decode benchmark's contexts (default "1024 8192"; "" skips it).
set -u
cd "$(dirname "$0")/.."
prebuilt=0
case "${1:-}" in
--prebuilt) prebuilt=1; shift ;;
--build-only)
    mkdir -p build
    # libgomp linked in, so that the machine with the card needs no gcc runtime beside glibc.
    exec gcc -std=c11 -O2 -Wall -Wextra -ffp-contract=off -fopenmp -I. tests/test_cuda.c -o build/test_cuda -lm -ldl \
        "$(gcc -print-file-name=libgomp.a)" -lpthread ;;
esac
GOLDEN=${1:-${COLI_GOLDEN:-../shared/golden}}
log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT
pass=0
fail=0
ok() { echo "ok - $1"; pass=$((pass + 1)); }
bad() { echo "FAIL - $1: $2"; fail=$((fail + 1)); }
t0=$(date +%s)

if [ "$prebuilt" = 1 ]; then
    [ -x ./coli ] && [ -x build/test_cuda ] && ok "prebuilt ./coli and build/test_cuda" ||
        { bad "prebuilt" "./coli or build/test_cuda missing: build them where musl-tools are (./build.sh; tests/gpu_check.sh --build-only) and copy them here"; echo "$pass passed, $fail failed"; exit 1; }
else
    timeout 240 ./build.sh >"$log/build" 2>&1 && ok "build" || { bad "build" "$(tail -n 5 "$log/build")"; echo "$pass passed, $fail failed"; exit 1; }
fi
timeout 60 ./coli info 2>&1 | tee "$log/info" | grep -E '^(cuda|\[cuda\])'
grep -q '^cuda 0: ' "$log/info" && ok "coli info lists a device" || bad "coli info" "no device: $(grep cuda "$log/info" | head -n 2)"
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=index,pci.bus_id,name,driver_version --format=csv,noheader; fi

mkdir -p build
[ "$prebuilt" = 1 ] || "$0" --build-only 2>"$log/cc" || bad "build test_cuda" "$(head -c 300 "$log/cc")"
COLI_TEST_REAL=1 timeout 120 build/test_cuda >"$log/kernels" 2>&1
grep -E '^(FAIL|#)' "$log/kernels"
k=$(grep -c '^ok - ' "$log/kernels")
kf=$(grep -c '^FAIL' "$log/kernels")
grep 'wrapped driver call' "$log/kernels"
[ "$kf" = 0 ] && [ "$k" -gt 0 ] && ok "$k kernel checks bit-identical to the CPU on device 0" || bad "kernels" "$kf failed, $k passed"

P="The capital of France is Paris, and the capital of Japan is"
for f in "$GOLDEN"/q35moe-*.gguf "$GOLDEN"/q3next-*.gguf; do
    [ -f "$f" ] || continue
    m=$(basename "$f")
    COLI_CUDA=0 timeout 60 ./coli run -m "$f" -p "$P" -n 16 --ignore-eog --json 2>/dev/null | tail -n 1 | sed 's/"timings".*//' >"$log/cpu"
    timeout 60 ./coli run -m "$f" -p "$P" -n 16 --ignore-eog --json 2>"$log/err" | tail -n 1 | sed 's/"timings".*//' >"$log/gpu"
    if [ -s "$log/cpu" ] && cmp -s "$log/cpu" "$log/gpu" && grep -q 'expert batches' "$log/err"; then
        ok "$m: CPU and GPU give the same tokens and logits ($(grep -o '[0-9]* products.*calls' "$log/err"))"
    else
        bad "$m: CPU vs GPU" "$(grep -E 'cuda|place' "$log/err" | tail -n 3)"
    fi
done
# The probe's figures, and re-tiering on the device: experts swapped while decoding, same tokens.
f="$GOLDEN/q35moe-q8_0.gguf"
if [ -f "$f" ]; then
    timeout 60 ./coli plan -m "$f" | grep -E '^(\[probe\]|expected)'
    COLI_CUDA=0 timeout 60 ./coli run -m "$f" -p "$P" -n 32 --ignore-eog --json 2>/dev/null | tail -n 1 | sed 's/"timings".*//' >"$log/cpu"
    HEAT_FILE="$log/heat" COLI_PLACE=off timeout 60 ./coli run -m "$f" -p "$P" -n 32 --ignore-eog --json --vram 40K 2>"$log/err" |
        tail -n 1 | sed 's/"timings".*//' >"$log/gpu"
    if [ -s "$log/cpu" ] && cmp -s "$log/cpu" "$log/gpu" && grep -qE 're-tiering: [1-9][0-9]* swaps' "$log/err"; then
        ok "re-tiering on the device, same tokens ($(grep -o 're-tiering: [0-9]* swaps' "$log/err"))"
    else
        bad "re-tiering" "$(grep -E 'cuda|re-tier' "$log/err" | tail -n 3)"
    fi
fi
# Split layers: the trunk and the shared expert on the card, the routed experts on the CPU; the
# routing and the CPU's outputs cross in mapped memory (publish_words, the host polling its count).
if [ -f "$f" ]; then
    timeout 60 ./coli run -m "$f" -p "$P" -n 32 --ignore-eog --json --place lmhead=0,attnproj=0,dnproj=0,dnout=0,router=0,shexp=0 \
        2>"$log/err" | tail -n 1 | sed 's/"timings".*//' >"$log/gpu"
    if [ -s "$log/cpu" ] && cmp -s "$log/cpu" "$log/gpu" && ! grep -q 'running on the CPU from here' "$log/err"; then
        ok "split layers through mapped memory, same tokens ($(grep -o '[0-9]* driver calls, [0-9]* waits' "$log/err"))"
    else
        bad "split layers" "$(grep -E 'cuda' "$log/err" | tail -n 3)"
    fi
fi
# bench --kernels' table for the card: every format's GEMV in GB/s against its copy bandwidth.
timeout 150 ./coli bench --kernels >"$log/kt" 2>&1
sed -n '/^cuda [0-9]*: /,$p' "$log/kt"
grep -q '^cuda 0: ' "$log/kt" && ok "bench --kernels: the card's table" || bad "bench --kernels" "$(tail -n 2 "$log/kt")"
# The decode benchmark: the 35B-A3B geometry in the Q4_K_M mix (Q4_K experts; Q6_K head, down and
# attn_v; Q5_K attn_qkv), random weights in memory placed on device 0, decode after a 1k and an 8k
# prompt: tok/s, and the weight bytes a token reads per second against the card's copy bandwidth
# (test_cuda's figure above, bytes read and written).
bw=$(grep -m1 -o '^# device 0: copy bandwidth [0-9.]*' "$log/kernels" | grep -o '[0-9.]*$')
# The first context again without CUDA graphs (every launch on its own), for the launches' cost.
contexts=${GPU_CHECK_CONTEXTS-1024 8192}
for run in $contexts ${contexts:+${contexts%% *}:nographs}; do
    ctx=${run%:nographs} graphs=1
    [ "$run" != "$ctx" ] && graphs=0
    COLI_CUDA_GRAPHS=$graphs timeout 200 ./coli bench --synthetic 35b-a3b:q4_k_m --gpu 0 -p "$ctx" -n 64 --json >"$log/bench" 2>"$log/err"
    if python3 - "$log/bench" "$run" "${bw:-0}" <<'PY'; then ok "decode benchmark at $run tokens of context"
import json, sys
b = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
gbs = b["decode_bytes_per_token"] * b["decode_tok_s"] / 1e9
bw = float(sys.argv[3])
share = f", {100 * gbs / bw:.0f}% of the copy bandwidth" if bw > 0 else ""
print(f"# decode, 35b-a3b:q4_k_m on device 0 after {sys.argv[2]} tokens: {b['decode_tok_s']:.1f} tok/s ({gbs:.0f} GB/s of weights{share}); "
      f"prompt {b['prompt_tok_s']:.1f} tok/s; {b['synthetic']['layers_measured']} of {b['synthetic']['layers']} layers measured; "
      f"a decode step {b['decode_driver_calls_per_token']:.1f} driver calls, {b['decode_graph_launches_per_token']:.2f} graph launches")
PY
    else bad "decode benchmark at $run tokens of context" "$(grep -E 'cuda|place|coli' "$log/err" | tail -n 3)"; fi
    grep -E '^\[(place\] experts|cuda\])' "$log/err"
done
echo "summary: $(grep -m1 '^cuda 0: ' "$log/info"); $(grep -m1 'wrapped driver call' "$log/info" | grep -o 'one wrapped.*'); $(( $(date +%s) - t0 )) s"
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
