#!/usr/bin/env bash
# test_cuda.sh: the static binary's GPU path as a user meets it, through the foreign dlopen:
# no driver, the toolkit's stub (or one built here) answering 34, the fake driver with 0, 1 and
# 2 devices, the fake failing module load (221, 222), allocations and a launch mid-run, and the
# Dockerfile's two images as roots (no glibc loader; the loader and the driver). Each case must
# print its one-line reason (none where there is no driver at all, unless -v) and keep the
# CPU's tokens and logits. Then placement: --place splits a component's layers over
# devices, and coli plan decides as coli run does (the same [place] lines) without loading weights;
# coli serve's requests on the device.
# usage: tests/test_cuda.sh ./coli GOLDEN_DIR BUILD_DIR   (BUILD_DIR holds fake/ and stub/)
set -u
COLI=$(realpath "${1:-./coli}")
GOLDEN=${2:-../shared/golden}
B=$(realpath "${3:-build}")
pass=0
fail=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ok() { echo "ok - $1"; pass=$((pass + 1)); }
bad() { echo "FAIL - $1: $2"; fail=$((fail + 1)); }

# has LABEL PATTERN FILE: FILE has a line matching PATTERN
has() { if grep -qE -- "$2" "$3"; then ok "$1"; else bad "$1" "no /$2/ in: $(head -c 400 "$3")"; fi; }

# The golden models' matrices are a few KiB, so a device's time for them is its fixed costs: at
# the fake's defaults (1 us a launch, 2 us a copy) near the CPU's time on these machines, where
# the probe's verdict would turn with the machine's load (CI stop 25). Every case here runs on a
# fake with 0.1 us costs, 2-12x faster than the CPU at these sizes, unless it sets its own
# (test_cuda's unit tests keep the defaults, whose figures they know).
export FAKE_CUDA_LAUNCH_US=0.1 FAKE_CUDA_COPY_US=0.1
FAKE="env -u COLI_LIBCUDA LD_LIBRARY_PATH=$B/fake"
$FAKE FAKE_CUDA_DEVICES=1 "$COLI" info >"$tmp/o" 2>&1; has "fake driver, 1 device: listed" '^cuda 0: Fake GPU A, compute 8.6, 20 SMs, 8.0 GiB VRAM, 7.5 GiB free, PCI 0000:10:00.0$' "$tmp/o"
has "the cost of one wrapped driver call is measured" 'one wrapped driver call [0-9.]+ us' "$tmp/o"
has "info: a token's launches as CUDA graphs" "one wrapped driver call [0-9.]+ us, a token's launches as CUDA graphs$" "$tmp/o"
$FAKE FAKE_CUDA_DEVICES=1 COLI_CUDA_GRAPHS=0 "$COLI" info >"$tmp/o" 2>&1
has "info with COLI_CUDA_GRAPHS=0: launches one by one" 'one wrapped driver call [0-9.]+ us, launches one by one \(no CUDA graphs\)$' "$tmp/o"
$FAKE FAKE_CUDA_DEVICES=2 "$COLI" info >"$tmp/o" 2>&1; has "fake driver, 2 devices: in PCI bus order" '^cuda 0: Fake GPU B.*PCI 0000:10' "$tmp/o"
has "fake driver, 2 devices: the second" '^cuda 1: Fake GPU A.*PCI 0000:20' "$tmp/o"
$FAKE FAKE_CUDA_DEVICES=0 "$COLI" info >"$tmp/o" 2>&1; has "fake driver, 0 devices: error 100" '^cuda: none: .*no CUDA device \(error 100\)' "$tmp/o"
has "fake driver, 0 devices: one [cuda] line" '^\[cuda\] .*error 100.*running on the CPU$' "$tmp/o"
$FAKE FAKE_CUDA_FAIL=module:221 "$COLI" info >"$tmp/o" 2>&1; has "no JIT compiler: error 221" '^\[cuda\] cuda 0: loading kernels.ptx: no PTX JIT compiler.*error 221' "$tmp/o"
$FAKE FAKE_CUDA_FAIL=module:222 "$COLI" info >"$tmp/o" 2>&1; has "PTX too new: error 222" 'too old for this PTX \(error 222\)' "$tmp/o"
$FAKE FAKE_CUDA_DEVICES=2 "$COLI" info --gpu 3 >"$tmp/o" 2>&1; has "--gpu 3 with 2 devices" '^\[cuda\] --gpu 3: there is no device 3 \(2 found\); running on the CPU' "$tmp/o"
$FAKE "$COLI" info --gpu off >"$tmp/o" 2>&1; has "--gpu off never touches the driver" '^cuda: none: off \(--gpu off\)' "$tmp/o"
$FAKE COLI_CUDA=0 "$COLI" info >"$tmp/o" 2>&1; has "COLI_CUDA=0 never touches the driver" '^cuda: none: off \(COLI_CUDA=0\)' "$tmp/o"
env -u LD_LIBRARY_PATH COLI_LIBCUDA=/nonexistent/libcuda.so.1 "$COLI" info >"$tmp/o" 2>&1
has "COLI_LIBCUDA names a missing file" '^cuda: none: cannot load /nonexistent/libcuda.so.1: ' "$tmp/o"
env -u LD_LIBRARY_PATH -u COLI_LIBCUDA "$COLI" info >"$tmp/o" 2>&1
if grep -q '^cuda 0:' "$tmp/o"; then ok "no libcuda.so.1 # SKIP this machine has a driver"
else has "no libcuda.so.1" '^cuda: none: (no libcuda.so.1 \(the NVIDIA driver\) found|.*error 34)' "$tmp/o"; fi
LD_LIBRARY_PATH=$B/stub "$COLI" info >"$tmp/o" 2>&1; has "a stub answering 34" "stub library, not a driver \(error 34\)" "$tmp/o"
for s in /usr/local/cuda/lib64/stubs/libcuda.so /usr/local/cuda-*/lib64/stubs/libcuda.so; do
    [ -f "$s" ] || continue
    mkdir -p "$tmp/tk" && cp "$s" "$tmp/tk/libcuda.so.1"
    LD_LIBRARY_PATH=$tmp/tk "$COLI" info >"$tmp/o" 2>&1; has "the CUDA toolkit's stub ($s)" "stub library, not a driver \(error 34\)" "$tmp/o"
    break
done
COLI_LDSO=/nonexistent "$COLI" info >"$tmp/o" 2>&1; has "COLI_LDSO names no loader" '^cuda: none: no glibc loader' "$tmp/o"

if [ ! -d "$GOLDEN" ]; then
    ok "golden runs # SKIP $GOLDEN absent"
    echo "$pass passed, $fail failed"
    exit $((fail != 0))
fi
P="The capital of France is Paris, and the capital of Japan is"
# tokens LABEL WANT_STDERR_PATTERN MODEL ENV... [-- ARGS...]: the --json line without timings
# equals the CPU's
tokens() {
    local label=$1 pat=$2 m=$3 vars=()
    shift 3
    while [ $# -gt 0 ] && [ "$1" != -- ]; do vars+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    env "${vars[@]}" "$COLI" run -m "$GOLDEN/$m" -p "$P" -n 8 --ignore-eog --json "$@" 2>"$tmp/e" | tail -n 1 | sed 's/"timings".*//' >"$tmp/j"
    if [ ! -s "$tmp/j" ] || ! cmp -s "$tmp/j" "$tmp/cpu-$m"; then bad "$label" "tokens differ from the CPU's; $(tail -c 300 "$tmp/e")"
    elif ! grep -qE -- "$pat" "$tmp/e"; then bad "$label" "no /$pat/ in: $(head -c 400 "$tmp/e")"
    else ok "$label"; fi
}
# The other formats by one or two models per kind of unit (test_cuda checks every kernel alone):
# MXFP4 for the 32-blocks; the Q3_K_M mix (Q3_K beside Q4_K..Q6_K and Q8_0), IQ3_XXS and IQ3_S
# for the 256-super-blocks. ~2 s a model: everything runs in the fake's twins.
for m in q35moe-q8_0.gguf q35moe-k.gguf q35moe-q4_0.gguf q35moe-f16.gguf q3next-f32.gguf q35moe-mxfp4.gguf q35moe-q3_k_m.gguf \
    q35moe-iq3_xxs.gguf q35moe-iq3_s.gguf; do
    COLI_CUDA=0 "$COLI" run -m "$GOLDEN/$m" -p "$P" -n 8 --ignore-eog --json 2>/dev/null | tail -n 1 | sed 's/"timings".*//' >"$tmp/cpu-$m"
    tokens "$m: every trunk GEMV and routed expert on 1 fake device, same tokens and logits" '^\[cuda\] [0-9]+ products and [1-9][0-9]* expert batches' $m LD_LIBRARY_PATH="$B/fake"
done
# The same models through kernels.cu's own source run on the host (build/sim: the fake driver
# with tests/kernels_sim.cc in place of the twins), where g++ built it.
for m in q35moe-q8_0.gguf q35moe-k.gguf q35moe-q4_0.gguf q35moe-f16.gguf q3next-f32.gguf q35moe-mxfp4.gguf q35moe-q3_k_m.gguf \
    q35moe-iq3_xxs.gguf q35moe-iq3_s.gguf; do
    if [ ! -f "$B/sim/libcuda.so.1" ]; then ok "$m through kernels.cu on the host # SKIP no $B/sim (g++)"; continue; fi
    tokens "$m: kernels.cu's source run on the host, same tokens and logits" '^\[cuda\] [0-9]+ products and [1-9][0-9]* expert batches' $m LD_LIBRARY_PATH="$B/sim"
done
# A decode step brings down the output head's best 64 logits, not the row (the greedy runs above):
# top-k sampling too, through the twins and kernels.cu's source; a temperature alone draws there
# over the whole vocabulary; a nucleus without top-k is drawn from the best where its cut falls
# among them (a low temperature here), else its row comes down (these random models' rows are
# flat: at 0.8 it spans hundreds); with a repetition penalty and the top logits reported
# (--json), the row comes down (those are the model's, before the penalty).
m=q35moe-q8_0.gguf
for case in "fake|--temp 0.9 --top-k 40 --top-p 0.95 --seed 11|7" "sim|--temp 1.3 --top-k 64 --min-p 0.02 --seed 3|7" \
    "fake|--temp 0.8 --top-k 0 --seed 5|7" "sim|--temp 1.2 --top-k 0 --seed 9|7" "fake|--temp 0.05 --top-k 0 --top-p 0.5 --seed 2|7" \
    "sim|--temp 0.05 --top-k 0 --top-p 0.5 --seed 2|7" "fake|--temp 0.8 --top-k 0 --top-p 0.9 --seed 5|0" \
    "fake|--temp 0.7 --top-k 20 --repeat-penalty 1.1 --seed 5|0"; do
    lib=${case%%|*} rest=${case#*|} kept=${case##*|}
    args=${rest%|*}
    if [ ! -f "$B/$lib/libcuda.so.1" ]; then ok "sampled ($args) through $B/$lib # SKIP not built"; continue; fi
    COLI_CUDA=0 "$COLI" run -m "$GOLDEN/$m" -p "$P" -n 8 --ignore-eog --json $args 2>/dev/null | tail -n 1 | sed 's/"timings".*//' >"$tmp/cpu-sampled"
    LD_LIBRARY_PATH="$B/$lib" "$COLI" run -m "$GOLDEN/$m" -p "$P" -n 8 --ignore-eog --json $args 2>"$tmp/e" | tail -n 1 | sed 's/"timings".*//' >"$tmp/j"
    if [ -s "$tmp/j" ] && cmp -s "$tmp/j" "$tmp/cpu-sampled" && grep -q "; $kept tokens' logits stayed there$" "$tmp/e"; then
        ok "$lib, $args: the CPU's tokens, $kept steps' logits left on the device"
    else bad "$lib, $args" "tokens differ or not $kept steps' logits kept: $(grep '^\[cuda\]' "$tmp/e" | tail -c 300)"; fi
done
# A penalty without the top logits reported: the device penalises the recent tokens' logits, then
# finds the best or draws (a penalty below 1 here, which promotes them: the text changes).
COLI_CUDA=0 "$COLI" run -m "$GOLDEN/$m" -p "$P" -n 8 --ignore-eog --temp 0 >"$tmp/plain" 2>/dev/null
for case in "fake|--temp 0 --repeat-penalty 0.2" "sim|--temp 0 --repeat-penalty 0.2" "fake|--temp 0.9 --top-k 0 --repeat-penalty 0.5 --seed 3" \
    "sim|--temp 0.9 --top-k 20 --repeat-penalty 0.5 --seed 3"; do
    lib=${case%%|*} args=${case#*|}
    if [ ! -f "$B/$lib/libcuda.so.1" ]; then ok "penalised ($args) through $B/$lib # SKIP not built"; continue; fi
    COLI_CUDA=0 "$COLI" run -m "$GOLDEN/$m" -p "$P" -n 8 --ignore-eog $args >"$tmp/cpu-pen" 2>/dev/null
    LD_LIBRARY_PATH="$B/$lib" "$COLI" run -m "$GOLDEN/$m" -p "$P" -n 8 --ignore-eog $args >"$tmp/gpu-pen" 2>"$tmp/e"
    if [ -s "$tmp/cpu-pen" ] && cmp -s "$tmp/cpu-pen" "$tmp/gpu-pen" && ! cmp -s "$tmp/cpu-pen" "$tmp/plain" && grep -q "; 7 tokens' logits stayed there$" "$tmp/e"; then
        ok "$lib, $args: penalised on the device, the CPU's text (not the unpenalised one), 7 steps' logits left there"
    else bad "$lib, $args" "text differs, or is the unpenalised one, or logits came down: $(grep '^\[cuda\]' "$tmp/e" | tail -c 200)"; fi
done
# The chosen experts come down from the device for the heat (each layer's ids, after the chain's
# last layer): the heat a run saves is the CPU's, byte for byte, through the twins and the sim.
COLI_CUDA=0 HEAT_FILE="$tmp/heat-cpu" "$COLI" run -m "$GOLDEN/$m" -p "$P" -n 12 --ignore-eog >/dev/null 2>&1
for lib in fake sim; do
    if [ ! -f "$B/$lib/libcuda.so.1" ]; then ok "the heat through $B/$lib # SKIP not built"; continue; fi
    rm -f "$tmp/heat-gpu"
    LD_LIBRARY_PATH="$B/$lib" HEAT_FILE="$tmp/heat-gpu" "$COLI" run -m "$GOLDEN/$m" -p "$P" -n 12 --ignore-eog >/dev/null 2>"$tmp/e"
    if [ -s "$tmp/heat-cpu" ] && cmp -s "$tmp/heat-cpu" "$tmp/heat-gpu" && grep -qE '^\[cuda\] [0-9]+ products and [1-9]' "$tmp/e"; then
        ok "$lib: every layer's chosen experts come down right: the heat saved is the CPU's"
    else bad "$lib: the heat" "differs from the CPU's: $(grep '^\[cuda\]' "$tmp/e" | tail -c 200)"; fi
done
# A row whose logits reaching the bound outnumber the list (thousands of equal logits; here a
# list of 8 in the fake): its row comes down after all, the CPU's tokens.
tokens "a list too short for a row's best: its logits come down instead, the CPU's tokens" "; 0 tokens' logits stayed there$" $m \
    LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_TOP_LIST=8
COLI_CUDA=0 "$COLI" run -m "$GOLDEN/$m" -p "$P" -n 8 --ignore-eog --json --temp 0.8 --top-k 0 --seed 5 2>/dev/null | tail -n 1 | sed 's/"timings".*//' >"$tmp/cpu-sampled"
LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_TOP_LIST=8 "$COLI" run -m "$GOLDEN/$m" -p "$P" -n 8 --ignore-eog --json --temp 0.8 --top-k 0 --seed 5 2>"$tmp/e" |
    tail -n 1 | sed 's/"timings".*//' >"$tmp/j"
if [ -s "$tmp/j" ] && cmp -s "$tmp/j" "$tmp/cpu-sampled" && grep -q "; 0 tokens' logits stayed there$" "$tmp/e"; then
    ok "... and a whole-vocabulary draw's: the CPU draws from the row, the same tokens"
else bad "a list too short, drawn" "tokens differ or logits kept: $(grep '^\[cuda\]' "$tmp/e" | tail -c 300)"; fi
m=q35moe-q8_0.gguf
tokens "2 fake devices: same tokens" '^\[place\] lmhead: .* cuda 0: 1' $m LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=2
tokens "--place lmhead=1: obeyed" '^\[place\] lmhead: .* cuda 1: 1' $m LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=2 COLI_PLACE=lmhead=1
tokens "allocations fail: matrices stay on the CPU" 'cpu: [0-9]+, .*no room' $m LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_FAIL=alloc:3
tokens "2 fake devices, --no-probe: mixed by room, the experts spread over both" '^\[place\] experts: 32 of 32, .* cuda 0: [0-9]+ .* cuda 1: [0-9]+' $m LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=2 -- --no-probe
tokens "--place off: the trunk on the CPU, the experts on the device" '^\[place\] experts: 32 of 32' $m LD_LIBRARY_PATH="$B/fake" COLI_PLACE=off
tokens "--place lmhead=0: a list without experts= keeps them on the CPU" '^\[cuda\] 8 products and 0 expert batches' $m LD_LIBRARY_PATH="$B/fake" COLI_PLACE=lmhead=0
tokens "some experts in VRAM, the rest on the CPU" '^\[place\] experts: [1-9][0-9]? of 32, .*cpu: [1-9][0-9]? ' $m LD_LIBRARY_PATH="$B/fake" -- --vram 300K
has "... their copy in memory leaves out those in VRAM (filled from the file if the CPU needs them: re-tiering below)" \
    'fit in memory: copied there but for those in VRAM' "$tmp/e"
tokens "some experts in VRAM, the rest through a 4-slot RAM cache" '^\[experts\] cache .*: 4 of 32' $m LD_LIBRARY_PATH="$B/fake" -- --vram 300K --ram 100K
tokens "a launch fails in an expert batch: the CPU takes over" '^\[cuda\] experts on the device: unspecified launch failure \(error 719\); running on the CPU from here$' $m LD_LIBRARY_PATH="$B/fake" COLI_PLACE=experts=0 FAKE_CUDA_FAIL=launch:5
tokens "2 devices, a launch fails in device 0's expert batch: the CPU takes over" '^\[cuda\] experts on the device: unspecified launch failure' $m LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=2 COLI_PLACE=off FAKE_CUDA_FAIL=launch:2
n=$(grep -c 'running on the CPU from here' "$tmp/e")
if [ "$n" = 1 ]; then ok "... and says so once: no driver call after the failure"; else bad "one failure line" "$n lines: $(grep cuda "$tmp/e" | head -c 300)"; fi
# (only the output head there: every pass's last product a GEMV there, the 4th pass's failing)
tokens "a launch fails mid-run: the CPU takes over" '^\[cuda\] GEMV on the device: unspecified launch failure \(error 719\); running on the CPU from here$' $m LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_FAIL=launch:4 -- --place lmhead=0
tokens "a launch fails in the probe: everything on the CPU" '^\[cuda\] the probe: unspecified launch failure \(error 719\); running on the CPU from here$' \
    $m LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_FAIL=launch:1
tokens "module load fails: CPU" 'error 222' $m LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_FAIL=module:222
tokens "stub: CPU" 'error 34' $m LD_LIBRARY_PATH="$B/stub"
tokens "--vram 0: nothing placed" 'no room in the budget' $m LD_LIBRARY_PATH="$B/fake" CUDA_EXPERT_GB=0
tokens "--place dnproj=0:1+1:1: one DeltaNet layer on each device, the third on the CPU" \
    '^\[place\] dnproj: 12 matrices, .* cuda 0: 4 .* cuda 1: 4 .* cpu: 4, .*\(--place\)$' $m LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=2 COLI_PLACE=dnproj=0:1+1:1
tokens "--place experts=1:1+0:2: layer 0's experts on device 1, layers 1-2's on 0, layer 3's on the CPU" \
    '^\[place\] experts: 24 of 32, .* cuda 0: 16 .* cuda 1: 8 .* cpu: 8 \(--place\)$' $m LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=2 COLI_PLACE=experts=1:1+0:2

for spec in dnproj=0: dnproj=0:x dnproj=0:5+ dnproj=0:-1 dnproj=-1 dnproj=0+1:2 experts=0:1++1:1; do
    $FAKE "$COLI" run -m "$GOLDEN/$m" -p "$P" -n 1 --place "$spec" >"$tmp/o" 2>"$tmp/e"
    rc=$?
    if [ "$rc" = 2 ] && [ "$(wc -l <"$tmp/e")" = 1 ] && grep -qF "'$spec'" "$tmp/e" && [ ! -s "$tmp/o" ]; then ok "--place $spec: a usage error naming it"
    else bad "--place $spec" "exit $rc: $(head -c 300 "$tmp/e")"; fi
done

# A list naming a device that is not there, or not selected, is a usage error; cpu is a device.
for case in "lmhead=2||there is no CUDA device 2 (2 found)" "experts=0:1+5:1||there is no CUDA device 5" \
    "lmhead=1|--gpu 0|CUDA device 1 is not selected (--gpu)"; do
    spec=${case%%|*} rest=${case#*|} gpu=${rest%%|*} want=${rest#*|}
    $FAKE FAKE_CUDA_DEVICES=2 "$COLI" run -m "$GOLDEN/$m" -p "$P" -n 1 --place "$spec" ${gpu:+$gpu} >"$tmp/o" 2>"$tmp/e"
    rc=$?
    if [ "$rc" = 2 ] && [ "$(wc -l <"$tmp/e")" = 1 ] && grep -qF -- "$want" "$tmp/e" && [ ! -s "$tmp/o" ]; then ok "--place $spec${gpu:+ ($gpu)}: a usage error: $want"
    else bad "--place $spec $gpu" "exit $rc: $(head -c 300 "$tmp/e")"; fi
done
tokens "--place lmhead=cpu,experts=0:2+cpu:2: cpu is a device name" \
    '^\[place\] experts: 16 of 32, .* cuda 0: 16 .* cpu: 16 \(--place\)$' $m LD_LIBRARY_PATH="$B/fake" COLI_PLACE=lmhead=cpu,experts=0:2+cpu:2
has "... and lm_head stays on the CPU by the list" '^\[place\] lmhead: 1 matrix, .* cpu: 1, [0-9.]+ MiB \(--place\)$' "$tmp/e"
tokens "the probe: a device slower than the CPU gets no trunk" '^\[probe\] cuda 1: .*, on the CPU [0-9.]+ ms .*: slower than the CPU, no trunk there$' \
    $m LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=2 FAKE_CUDA_GBPS=1000,0.00001
if grep '^\[place\] [a-z]*: [0-9]* matri' "$tmp/e" | grep -q 'cuda 1'; then bad "... nothing of the trunk on it" "$(grep '^\[place\]' "$tmp/e" | head -c 400)"
else has "... nothing of the trunk on it, nor experts: slower than the CPU for them too" \
    '^\[probe\] cuda 1: a batch of [0-9]+ experts \([0-9.]+ MiB each, Q8_0\) [0-9.]+ ms .*: slower than the CPU, no experts there$' "$tmp/e"; fi
has "... every expert on the fast one" '^\[place\] experts: 32 of 32, .* -> cuda 0: 32 ' "$tmp/e"
has "... and the fast one says so" '^\[probe\] cuda 0: .*: the trunk may go there$' "$tmp/e"
tokens "--no-probe: nominal figures, the slow device takes trunk" '^\[place\] dnproj: .*cuda 1: [1-9]' $m LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=2 FAKE_CUDA_GBPS=1000,0.00001 -- --no-probe
has "... and says so" '^\[probe\] off \(--no-probe\)' "$tmp/e"
tokens "a --place list that does not fit says what" '^\[place\] --place lmhead=0,experts=1: 1 of 1 lmhead \([0-9.]+ MiB\) do not fit: cuda 0 has [0-9.]+ MiB left, cuda 1 has' \
    $m LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=2 COLI_PLACE=lmhead=0,experts=1 -- --vram 100K
tokens "re-tiering: experts swapped into VRAM while decoding (mapped), the same tokens" \
    '^\[experts\] re-tiering: [1-9][0-9]* swaps, [0-9.]+ MiB uploaded in the background; VRAM served [0-9.]+% of the routed experts so far$' \
    $m LD_LIBRARY_PATH="$B/fake" HEAT_FILE="$tmp/retier-heat" COLI_PLACE=off -- --vram 40K
rm -f "$tmp/retier-heat"
tokens "re-tiering with the RAM cache (evicted experts read from the file), the same tokens" '^\[experts\] re-tiering: [1-9][0-9]* swaps' \
    $m LD_LIBRARY_PATH="$B/fake" HEAT_FILE="$tmp/retier-heat" COLI_PLACE=off FAKE_CUDA_BUSY=0 -- --vram 40K --ram 20K
rm -f "$tmp/retier-heat"
tokens "the device fails while an expert is uploaded in the background: the CPU takes over, the same tokens" \
    '^\[cuda\] an upload in the background: an illegal memory access was encountered \(error 700\); running on the CPU from here$' \
    $m LD_LIBRARY_PATH="$B/fake" HEAT_FILE="$tmp/retier-heat" COLI_PLACE=off FAKE_CUDA_FAIL=query:2 -- --vram 40K
m=q35moe-f32.gguf
COLI_CUDA=0 "$COLI" run -m "$GOLDEN/$m" -p "$P" -n 8 --ignore-eog --json 2>/dev/null | tail -n 1 | sed 's/"timings".*//' >"$tmp/cpu-$m"
tokens "two unequal devices (0: fast, 1 MiB; 1: slow, 7 GiB): a split is priced, the same tokens" \
    '^\[probe\] expected per token: mixed by room [0-9.]+ ms, .* -> ' $m LD_LIBRARY_PATH="$B/fake" \
    FAKE_CUDA_DEVICES=2 FAKE_CUDA_VRAM_MB=1024,8192 FAKE_CUDA_FREE_MB=257,7680 FAKE_CUDA_GBPS=1000,50
# Which candidate wins depends on the CPU's measured speed (this model's matrices sit in its
# cache, at 50-120 GB/s on these machines, near the slow device's), so the run is checked against
# the rule on its own figures; test_cuda's unit test checks the choice on fixed figures.
if why=$(python3 - "$tmp/e" <<'PY'
import re, sys
log = open(sys.argv[1]).read()
line = re.search(r"^\[probe\] expected per token: (.*) -> (.*)$", log, re.M)
times = {name: float(ms) for name, ms in re.findall(r"(mixed by room|all on cuda \d|trunk on cuda \d and experts on cuda \d) ([0-9.]+) ms", line.group(1))}
best = min((t, n) for n, t in times.items() if n != "mixed by room")
want = best[1] if best[0] < times["mixed by room"] * 0.95 else "mixed by room"
want = re.sub(r"trunk on cuda (\d) and experts on cuda (\d)", r"trunk on cuda \1, experts on cuda \2", want)
if line.group(2) != want: sys.exit(f"chose '{line.group(2)}', the figures say '{want}'")
split = re.match(r"(?:all on cuda (\d))|(?:trunk on cuda (\d), experts on cuda (\d))", want)
if split:
    trunk = split.group(1) or split.group(2)
    experts = split.group(1) or split.group(3)
    if not re.search(rf"^\[place\] lmhead: .* -> cuda {trunk}: 1 ", log, re.M): sys.exit(f"lm_head not on cuda {trunk}")
    if not re.search(rf"^\[place\] experts: .* -> cuda {experts}: [1-9]", log, re.M): sys.exit(f"no expert on cuda {experts}")
PY
); then ok "... the choice is the fastest candidate's (by 5% over mixed), and lm_head and the experts are where it says"
else bad "... the choice follows its own figures" "$why"; fi
m=q35moe-q8_0.gguf
tokens "every run says the prices that decided" \
    '^\[place\] prices: every expert in memory; last expert placed: p [0-9.]+, value [0-9.]+; first kept on the CPU: none$' $m LD_LIBRARY_PATH="$B/fake"

# plan_vs_run LABEL ENV... [-- FLAGS...]: coli plan prints on stdout the [place] lines that coli
# run logs with the same settings (the same heat file: plan first, as run saves heat at its end)
plan_vs_run() {
    local label=$1 vars=()
    shift
    while [ $# -gt 0 ] && [ "$1" != -- ]; do vars+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    env "${vars[@]}" HEAT_FILE="$tmp/heat" "$COLI" plan -m "$GOLDEN/$m" "$@" >"$tmp/plan" 2>"$tmp/plan-e"
    env "${vars[@]}" HEAT_FILE="$tmp/heat" "$COLI" run -m "$GOLDEN/$m" -p "$P" -n 8 --ignore-eog "$@" 2>"$tmp/e" >/dev/null
    grep '^\[place\]' "$tmp/plan" >"$tmp/plan-place"
    grep '^\[place\]' "$tmp/e" >"$tmp/run-place"
    if [ ! -s "$tmp/run-place" ] || ! cmp -s "$tmp/plan-place" "$tmp/run-place"; then
        bad "$label" "plan and run differ: $(diff "$tmp/plan-place" "$tmp/run-place" | head -c 400)"
    else ok "$label"; fi
}
# bench --synthetic measures the CPU unless --gpu names devices (gpu_check.sh's decode benchmark)
$FAKE "$COLI" bench --synthetic tiny:q8_0 -p 4 -n 4 >"$tmp/o" 2>"$tmp/e"
if grep -qE '^\[(cuda|place)\]' "$tmp/e" || ! grep -q '^decode: 4 tokens' "$tmp/o"; then bad "bench --synthetic: on the CPU alone" "$(head -c 300 "$tmp/e")"
else ok "bench --synthetic: on the CPU alone"; fi
$FAKE "$COLI" bench --synthetic tiny:q8_0 --gpu 0 -p 4 -n 4 >"$tmp/o" 2>"$tmp/e"
has "bench --synthetic --gpu 0: the experts placed on the device" '^\[place\] experts: 32 of 32, .* -> cuda 0: 32 ' "$tmp/e"
has "... and run there" '^\[cuda\] [0-9]+ products and [1-9][0-9]* expert batches' "$tmp/e"
plan_vs_run "plan, 1 fake device (no heat yet): run's [place] lines" LD_LIBRARY_PATH="$B/fake"
has "plan, 1 fake device: its budget and what trunk and experts take" \
    '^cuda 0: Fake GPU A, budget [0-9.]+ GiB: trunk 0\.3 MiB, experts 0\.2 MiB, [0-9.]+ GiB left$' "$tmp/plan"
has "plan, 1 fake device: nothing of the trunk left on the CPU" '^cpu: trunk \(dense, read every token\): 0\.0 MiB$' "$tmp/plan"
plan_vs_run "plan, 2 fake devices (with heat): run's [place] lines" LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=2
has "plan, 2 fake devices: a line for the second" '^cuda 1: Fake GPU A, budget [0-9.]+ GiB: trunk [0-9.]+ MiB, experts [0-9.]+ MiB' "$tmp/plan"
plan_vs_run "plan, 2 fake devices, CUDA_EXPERT_GB=0.0001: the same partial placement as run" \
    LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=2 CUDA_EXPERT_GB=0.0001 -- --no-probe
has "plan, CUDA_EXPERT_GB=0.0001, --no-probe: part of the experts stays on the CPU" '^\[place\] experts: [1-9][0-9]? of 32, .*cpu: [1-9][0-9]? \(no room' "$tmp/plan"
plan_vs_run "plan, 2 fake devices, one slower than the CPU: run's [place] lines" LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=2 FAKE_CUDA_GBPS=0.00001,1000
has "plan: the probe's lines too" '^\[probe\] cuda 0: .*slower than the CPU, no trunk there$' "$tmp/plan"
has "plan: the bytes per token on each bus, against the bandwidth measured and probed" \
    '^expected per token: cpu [0-9.]+ MiB on the memory bus \([0-9.]+ GB/s measured: [0-9.]+ ms\)(, cuda [01] [0-9.]+ MiB \([0-9.]+ GB/s probed: [0-9.]+ ms\))+; [0-9.]+ MiB of it from the file$' "$tmp/plan"
has "plan: a decode rate from them" '^expected decode: at most [0-9.]+ tok/s \(memory traffic alone, the buses one after another\)$' "$tmp/plan"
plan_vs_run "plan, a split --place: run's [place] lines" LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=2 COLI_PLACE=lmhead=1,dnproj=0:1+1:1,experts=1:2
env LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=2 "$COLI" plan -m "$GOLDEN/$m" --json --ram 10K --vram 150K >"$tmp/plan.json" 2>"$tmp/plan-e"
if python3 - "$tmp/plan.json" <<'PY'
import json, sys
lines = open(sys.argv[1]).read().splitlines()
assert len(lines) == 1, "stdout is one JSON line"
d = json.loads(lines[0])
assert [x["index"] for x in d["devices"]] == [0, 1]
names = [c["name"] for c in d["components"]]
assert names[0] == "lmhead" and names[-1] == "experts", names
for c in d["components"]:
    assert sum(c["on_device"]) + c["cpu"] == c["count"], c
assert d["cpu"]["expert_cache"]["mode"] == "cached" and d["cpu"]["expert_cache"]["slots"] >= 4
e = d["expected"]
assert e["tok_s"] > 0 and abs(e["seconds_per_token"] * e["tok_s"] - 1) < 1e-3, e
PY
then ok "plan --json: one object: devices, components and where they went, the CPU's cache (--ram), the expectation"
else bad "plan --json" "$(head -c 400 "$tmp/plan.json")"; fi
has "plan --json: the [place] lines on stderr" '^\[place\] lmhead: ' "$tmp/plan-e"
COLI_CUDA=0 "$COLI" plan -m "$GOLDEN/$m" >"$tmp/plan" 2>&1
has "plan with COLI_CUDA=0: the reason instead of a device" '^cuda: none: off \(COLI_CUDA=0\)$' "$tmp/plan"
has "plan with COLI_CUDA=0: the whole trunk on the CPU" '^cpu: trunk \(dense, read every token\): 0\.3 MiB$' "$tmp/plan"

# The shared expert inside the routed experts' batch (q35moe-q8_0: its matrices have their types
# and shapes): the same tokens as with it on the CPU, and one FFN more on the device per layer and
# token forwarded (the prompt's tokens, then each generated one but the last).
all0=lmhead=0,attnproj=0,dnproj=0,dnout=0,router=0,experts=0
for where in 0 cpu; do
    $FAKE FAKE_CUDA_DEVICES=1 "$COLI" run -m "$GOLDEN/q35moe-q8_0.gguf" -p "$P" -n 8 --ignore-eog --json --place "$all0,shexp=$where" \
        2>"$tmp/shexp-$where.err" | tail -n 1 >"$tmp/shexp-$where.full"
    sed 's/"timings".*//' "$tmp/shexp-$where.full" >"$tmp/shexp-$where.json"
done
ffns() { grep -o "([0-9]* experts' FFNs)" "$1" | grep -o '[0-9]*'; }
forwarded=$(python3 -c 'import json, sys; j = json.load(open(sys.argv[1])); print(len(j["prompt_tokens"]) + len(j["tokens"]) - 1)' \
    "$tmp/shexp-0.full" 2>/dev/null)
if [ -s "$tmp/shexp-0.json" ] && cmp -s "$tmp/shexp-0.json" "$tmp/shexp-cpu.json" && [ -n "$forwarded" ] &&
    [ "$(( $(ffns "$tmp/shexp-0.err") - $(ffns "$tmp/shexp-cpu.err") ))" = "$((4 * forwarded))" ]; then
    ok "the shared expert in the experts' batch: the same tokens as on the CPU, 4 layers x $forwarded tokens more FFNs there"
else bad "the shared expert in the experts' batch" "FFNs $(ffns "$tmp/shexp-0.err") vs $(ffns "$tmp/shexp-cpu.err"), $forwarded tokens forwarded; $(grep cuda "$tmp/shexp-0.err" | tail -n 1)"; fi
# With the shared expert there too, device 0 holds all of each layer after its mixer: the
# output projection, the residual and norm, the router's products, the routing, the experts and
# their sum run there (cuda_moe_layer_start), and with them the next layer's input norm and
# mixer projections, and after the last layer of a decode step the final norm and the output
# head. Every layer's projections are made there (layer 0's from the embedded rows that go up
# with the pass's first upload, the others' by the layer before): the layers are chained, their
# mixers run there too over the states and KV caches kept there, and nothing comes back until
# the end. So a decode step of the 4 layers waits for the device once (the logits), the
# prompt's pass once more (its head: the logits of its last token alone), where step by step a
# pass waits 17 times (the projections, the output projection, the router's products and the
# experts' batch of each layer, the head); and only the prompt's head is a product. A pass: the
# prompt's, then one a generated token but the last.
cuda_count() { grep -o "[0-9]* $2" "$1" | tail -n 1 | grep -o '^[0-9]*'; }
passes=$(python3 -c 'import json, sys; print(len(json.load(open(sys.argv[1]))["tokens"]))' "$tmp/shexp-0.full" 2>/dev/null)
if [ -s "$tmp/shexp-0.json" ] && cmp -s "$tmp/shexp-0.json" "$tmp/shexp-cpu.json" && [ -n "$passes" ] &&
    [ "$(cuda_count "$tmp/shexp-0.err" waits)" = "$((passes + 1))" ] && [ "$(cuda_count "$tmp/shexp-cpu.err" waits)" = "$((17 * passes))" ] &&
    [ "$(cuda_count "$tmp/shexp-0.err" products)" = 1 ]; then
    ok "every layer chained on the device, mixers too: the same tokens, 1 wait a decode step instead of 17 ($passes passes)"
else bad "the rest of a layer on the device" "$passes passes; $(grep cuda "$tmp/shexp-0.err" | tail -n 1) against $(grep cuda "$tmp/shexp-cpu.err" | tail -n 1)"; fi
# Each decode step there is one window of launches (its upload before, its downloads after): the
# first step's made one by one, the second's too and then built into a CUDA graph, each later
# one that graph in one call. So passes - 3 graph launches; four more steps cost 12 driver
# calls (each: the upload, the graph, one copy down of the best logits and the ids) where
# without graphs (COLI_CUDA_GRAPHS=0) they cost a call a launch; the same tokens each way.
calls_of() { # calls_of STEPS ENV...: the driver calls of that run, its tokens in $tmp/calls-STEPS.json
    local n=$1; shift
    env "$@" FAKE_CUDA_DEVICES=1 "$COLI" run -m "$GOLDEN/q35moe-q8_0.gguf" -p "$P" -n "$n" --ignore-eog --json --place "$all0,shexp=0" \
        2>"$tmp/calls.err" | tail -n 1 | sed 's/"timings".*//' >"$tmp/calls-$n.json"
    cuda_count "$tmp/calls.err" 'driver calls'
}
with8=$(calls_of 8 LD_LIBRARY_PATH="$B/fake") with12=$(calls_of 12 LD_LIBRARY_PATH="$B/fake")
without8=$(calls_of 8 LD_LIBRARY_PATH="$B/fake" COLI_CUDA_GRAPHS=0) without12=$(calls_of 12 LD_LIBRARY_PATH="$B/fake" COLI_CUDA_GRAPHS=0)
if [ "$(cuda_count "$tmp/shexp-0.err" 'graph launches')" = "$((passes - 3))" ] && [ "$((with12 - with8))" = 12 ] &&
    [ "$((without12 - without8))" -gt 200 ] && cmp -s "$tmp/calls-8.json" "$tmp/shexp-cpu.json"; then
    ok "a decode step as one CUDA graph from the third on: $((passes - 3)) graph launches, 3 driver calls a step (without graphs $(((without12 - without8) / 4))), the same tokens"
else bad "a decode step as one CUDA graph" "graph launches: $(grep cuda "$tmp/shexp-0.err" | tail -n 1); calls $with8 -> $with12, without graphs $without8 -> $without12"; fi
# The trunk and the shared expert on the device, the routed experts on the CPU: each layer is
# split. The device hands back its routing, the CPU computes the routed experts while the device
# runs the shared one, their outputs go up for the sum. The layers are chained all the same (the
# sum, the next layer's start, its mixer and its routing there): 5 waits a decode step (a layer's
# routing, then the logits; the prompt's pass one more, its head), the device's FFNs the shared
# expert's alone, the same tokens. With the DeltaNet projections on the CPU their layers cannot
# chain: two waits each (the routing, then the layer's outputs), one for the attention layer
# after them: 7 a decode step. The routing and the CPU's outputs cross in mapped memory (a
# decode step's few tokens): from the third step on, the step's upload, a graph for each layer's
# launches from the sum before it to its own routing and experts, one for the last sum to the
# best logits, and the download, 4 + 3 driver calls a step (19 when they were copies).
split_run() { # split_run NAME PLACE [N]: the run's tokens and [cuda] lines in $tmp/NAME.json and .err
    $FAKE FAKE_CUDA_DEVICES=1 "$COLI" run -m "$GOLDEN/q35moe-q8_0.gguf" -p "$P" -n "${3:-8}" --ignore-eog --json --place "$2" 2>"$tmp/$1.err" |
        tail -n 1 | sed 's/"timings".*//' >"$tmp/$1.json"
}
split=lmhead=0,attnproj=0,dnproj=0,dnout=0,router=0,shexp=0
split_run split $split
split_run split-12 $split 12
split_run split-unchained lmhead=0,attnproj=0,dnout=0,router=0,shexp=0
split_calls=$(($(cuda_count "$tmp/split-12.err" 'driver calls') - $(cuda_count "$tmp/split.err" 'driver calls')))
if cmp -s "$tmp/split.json" "$tmp/shexp-cpu.json" && [ "$(cuda_count "$tmp/split.err" waits)" = "$((5 * passes + 1))" ] &&
    [ "$(ffns "$tmp/split.err")" = "$((4 * forwarded))" ] && cmp -s "$tmp/split-unchained.json" "$tmp/shexp-cpu.json" &&
    [ "$(cuda_count "$tmp/split-unchained.err" waits)" = "$((7 * passes + 1))" ] && [ "$split_calls" = 28 ]; then
    ok "split layers (the routed experts on the CPU) chained: the same tokens, 5 waits and 7 driver calls a decode step (7 waits unchained), the shared expert's FFNs alone on the device"
else bad "split layers" "$passes passes, $forwarded tokens, $split_calls calls in 4 steps; $(grep cuda "$tmp/split.err" | tail -n 1); unchained $(grep cuda "$tmp/split-unchained.err" | tail -n 1)"; fi
# ... and a launch failing there (after layer 0's start, 1-6, and its DeltaNet, 7-10, as in the
# chain below): 17 the routing, 18 its publishing into mapped memory, 19 the device's experts
# queued behind it, 22 the sum after the CPU's experts came up. The CPU's tokens each time. And
# a signal lost (the device's stream ends without publish_words's count: the CPU stops waiting).
for k in 17 18 19 22; do
    tokens "a split layer's launch $k fails: the CPU's tokens" '^\[cuda\] a layer on the device: unspecified launch failure' \
        q35moe-q8_0.gguf LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=1 FAKE_CUDA_FAIL=launch:$k -- --place $split
done
for k in 1 6; do
    tokens "a split layer's signal $k is lost: the CPU's tokens" '^\[cuda\] a layer on the device: the device finished without the signal awaited \(error -1\); running on the CPU from here$' \
        q35moe-q8_0.gguf LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=1 FAKE_CUDA_FAIL=publish:$k -- --place $split
done
# A launch that fails in a chain. Launches 1-6 of that placement are layer 0's start, made with
# the pass's upload (its norm, activations and projections): nothing is on the device yet but
# the uploaded copies, so the pass goes on on the CPU. 7-10 are layer 0's DeltaNet (conv, rule,
# gated norm, its rows' quantisation), 11-21 its rest (output projection, residual and norm,
# the two activations, router and gate logit, routing, gate/up, the hidden rows' quantisation,
# down and the sum), 22-27 layer 1's start, 28-31 its DeltaNet, 69-72 layer 3's attention
# (norms, RoPE and the cache's new rows; the splits' scores to values; their merge and the
# gate; its rows' quantisation), 73 on its rest; later ones fail in a decode step (500: in the
# fifth, run as a graph, which reports it when it is launched). There the states and the KV
# cache are only on the device: the pass is lost with them, the sequence is fed its tokens
# again on the CPU (engine_replay), then the pass runs again. The run keeps the CPU's tokens
# each time.
for k in 1 3 6; do
    tokens "launch $k (the first layer's start in a chain) fails: the CPU's tokens" '^\[cuda\] a chain of layers on the device: unspecified launch failure' \
        q35moe-q8_0.gguf LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=1 FAKE_CUDA_FAIL=launch:$k -- --place "$all0,shexp=0"
done
for k in 7 8 9 10 11 15 21 22 27 28 31 69 70 71 72 73 100 150 500; do
    tokens "launch $k (in a chain of layers on the device) fails: the pass again on the CPU, the CPU's tokens" \
        '^\[cuda\] the states of 1 conversations rebuilt on the CPU: [0-9]+ tokens of context fed again$' \
        q35moe-q8_0.gguf LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=1 FAKE_CUDA_FAIL=launch:$k -- --place "$all0,shexp=0"
done
# Attention past one split (OPS_ATTN_SPLIT, 256 rows): a prompt of 340 tokens (one batch of
# MODEL_BATCH, 512, at most) and the decode steps over 2 splits, every layer chained on device 0,
# through the fake's twins and through kernels.cu's source, with an f32 and a Q8_0 KV cache: the
# CPU's tokens and logits, and the waits of one prompt pass and 7 decode passes (attention stays
# on the device; a batch of 256 before made it two prompt passes and 17 waits).
LP=$(for i in $(seq 12); do printf '%s %s. ' "$P" "$i"; done)
long_run() { # long_run NAME KV ENV...: the run's --json line without timings in $tmp/long-NAME.json
    local name=$1 kv=$2; shift 2
    env "$@" "$COLI" run -m "$GOLDEN/q35moe-q8_0.gguf" -p "$LP" -n 8 -c 1024 --kv "$kv" --ignore-eog --json --place "$all0,shexp=0" \
        2>"$tmp/long.err" | tail -n 1 | sed 's/"timings".*//' >"$tmp/long-$name.json"
}
for kv in f32 q8_0; do
    long_run cpu $kv COLI_CUDA=0
    for lib in fake sim; do
        if [ ! -f "$B/$lib/libcuda.so.1" ]; then ok "attention in 2 splits on the device ($lib, --kv $kv) # SKIP no $B/$lib"; continue; fi
        long_run $lib $kv LD_LIBRARY_PATH="$B/$lib" FAKE_CUDA_DEVICES=1
        n=$(($(grep -o '"prompt_tokens":\[[0-9,]*\]' "$tmp/long-cpu.json" | tr -cd , | wc -c) + 1))
        if [ "$n" -gt 256 ] && cmp -s "$tmp/long-$lib.json" "$tmp/long-cpu.json" && grep -q ' 12 waits' "$tmp/long.err"; then
            ok "attention over 2 splits, every layer chained on the device ($lib, --kv $kv): a prompt of $n tokens and 8 more, the CPU's tokens and logits"
        else bad "attention over 2 splits on the device ($lib, --kv $kv)" "prompt of $n tokens; $(grep cuda "$tmp/long.err" | tail -n 1)"; fi
    done
done
# A Q8_0 KV cache whose rows go between the host and the device when a prompt's layers do not
# chain (a prompt of 225 tokens here): its keys are stored 16 positions to a group, the group's
# bytes mixing its rows, so a copy up to a row inside a group tore it (the device's tokens
# differed from the CPU's from a prompt of ~200 tokens on). The CPU's tokens and logits.
LP=$(for i in $(seq 8); do printf '%s %s. ' "$P" "$i"; done)
long_run cpu q8_0 COLI_CUDA=0
long_run fake q8_0 LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=1
if cmp -s "$tmp/long-fake.json" "$tmp/long-cpu.json"; then
    ok "Q8_0 KV rows between host and device mid-group (a prompt of 225 tokens): the CPU's tokens and logits"
else bad "Q8_0 KV rows between host and device mid-group" "$(grep cuda "$tmp/long.err" | tail -n 1)"; fi
# Split layers after that prompt: its pass copies the routing and the CPU's outputs (more than
# CUDA_MAPPED_TOKENS, 64), the decode steps cross in mapped memory. The CPU's tokens and logits.
env LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=1 "$COLI" run -m "$GOLDEN/q35moe-q8_0.gguf" -p "$LP" -n 8 -c 1024 --kv q8_0 --ignore-eog --json \
    --place "$split" 2>"$tmp/long.err" | tail -n 1 | sed 's/"timings".*//' >"$tmp/long-split.json"
if cmp -s "$tmp/long-split.json" "$tmp/long-cpu.json" && ! grep -q 'running on the CPU from here' "$tmp/long.err"; then
    ok "split layers after a prompt of 225 tokens (its routing by copies, the decode steps' through mapped memory): the CPU's tokens and logits"
else bad "split layers after a long prompt" "$(grep cuda "$tmp/long.err" | tail -n 1)"; fi
# bench says the same a decode step: of 11 steps of a small model all on the device, the first
# two made launch by launch and 9 as one graph each, one wait each.
$FAKE FAKE_CUDA_DEVICES=1 "$COLI" bench --synthetic tiny:q8_0 --gpu 0 -p 1 -n 12 --json >"$tmp/bench.json" 2>/dev/null
if python3 -c '
import json, sys
j = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
assert round(11 * j["decode_graph_launches_per_token"]) == 9 and j["decode_waits_per_token"] == 1, j
assert 4 < j["decode_driver_calls_per_token"] < 92, j' "$tmp/bench.json" 2>"$tmp/e"; then
    ok "bench --json: driver calls, waits and graph launches a decode step (9 graphs in 11 steps, 1 wait each)"
else bad "bench --json: driver calls a decode step" "$(tail -c 300 "$tmp/e")"; fi
# A graph the driver cannot build (its instantiation runs out of memory): one line, the launches
# one by one from then on, the CPU's tokens.
tokens "a CUDA graph that cannot be built: launches one by one, the CPU's tokens" \
    '^\[cuda\] a graph of [0-9]+ launches could not be built: out of device memory \(error 2\); launches made one by one from here$' \
    q35moe-q8_0.gguf LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=1 FAKE_CUDA_FAIL=graph:1 -- --place "$all0,shexp=0"

# coli serve on the fake device. The fake's current context is a thread's, as the driver's, so a
# driver call from a thread that did not make it current fails there (error 201) as on a card:
# the server's requests must run on the device, with no fallback line, and give the CPU's text.
serve_up() { # serve_up LOG SLOTS ENV...: coli serve with ENV on a free port; sets pid, and port once it is ready (else empty)
    local log=$1 slots=$2 i; shift 2
    env "$@" HEAT_FILE="$tmp/serve.heat" "$COLI" serve -m "$GOLDEN/q35moe-q8_0.gguf" --port 0 -c "${SERVE_CTX:-256}" --parallel "$slots" 2>"$log" &
    pid=$! port=""
    for i in $(seq 100); do
        grep -q '^\[serve\] ready' "$log" && port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$log" | grep -o '[0-9]*$') && break
        sleep 0.1
    done
}
serve_down() { kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; }
# The three sample differently, each with its row kept on the device: greedy with a frequency
# penalty (applied there), a temperature alone (as OpenAI clients send: drawn over the whole
# vocabulary) and top-k.
serve_text() { # serve_text LOG ENV...: three completions at once (slots decoding together) from a server started with ENV
    local log=$1 i pids=() sampling=('"temperature":0,"frequency_penalty":0.5' '"temperature":0.8,"seed":3' '"temperature":0.9,"top_k":30,"seed":7'); shift
    serve_up "$log" 3 "$@"
    if [ -n "$port" ]; then
        for i in 1 2 3; do
            curl -s -m 30 "http://127.0.0.1:$port/v1/completions" -o "$log.$i" \
                -d '{"prompt":"The capital of France is'"$(printf '%*s' "$i" '' | tr ' ' '!')"'","max_tokens":'$((4 + 4 * i))',"ignore_eos":true,'"${sampling[i - 1]}"'}' &
            pids+=($!)
        done
        wait "${pids[@]}"
        for i in 1 2 3; do grep -o '"text":"[^"]*"' "$log.$i"; done
    fi
    serve_down
}
serve_text "$tmp/serve-cpu" COLI_CUDA=0 >"$tmp/serve-cpu.txt"
serve_text "$tmp/serve-gpu" LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=1 >"$tmp/serve-gpu.txt"
if [ "$(wc -l <"$tmp/serve-cpu.txt")" = 3 ] && cmp -s "$tmp/serve-cpu.txt" "$tmp/serve-gpu.txt" && grep -qE '^\[cuda\] [1-9][0-9]* products' "$tmp/serve-gpu" &&
    ! grep -q 'running on the CPU from here' "$tmp/serve-gpu" && grep -qE "; [1-9][0-9]* tokens' logits stayed there$" "$tmp/serve-gpu"; then
    ok "serve on the fake device (a context per thread), three requests at once: they run there, the CPU's texts ($(tr '\n' ' ' <"$tmp/serve-gpu.txt")), $(grep -oE "[0-9]+ tokens' logits stayed there" "$tmp/serve-gpu")"
else bad "serve on the fake device" "cpu $(head -c 200 "$tmp/serve-cpu.txt"), gpu $(head -c 200 "$tmp/serve-gpu.txt"); $(grep -E 'cuda' "$tmp/serve-gpu" | tail -n 2)"; fi
# ... and with the routed experts on the CPU (split layers): the routing and the CPU's outputs
# cross in mapped memory, sized anew as the batch grows from one token to three.
serve_text "$tmp/serve-split" LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=1 COLI_PLACE=$split >"$tmp/serve-split.txt"
if [ "$(wc -l <"$tmp/serve-split.txt")" = 3 ] && cmp -s "$tmp/serve-cpu.txt" "$tmp/serve-split.txt" && grep -qE '^\[cuda\] [1-9][0-9]* products' "$tmp/serve-split" &&
    ! grep -q 'running on the CPU from here' "$tmp/serve-split"; then
    ok "serve on the fake device, split layers through mapped memory, three requests at once: the CPU's texts"
else bad "serve, split layers" "gpu $(head -c 200 "$tmp/serve-split.txt"); $(grep -E 'cuda' "$tmp/serve-split" | tail -n 2)"; fi
# ... and a launch failing while the three decode together, their DeltaNet states on the device:
# each conversation is fed its tokens again on the CPU, and every text is still the CPU's.
serve_text "$tmp/serve-fail" LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=1 FAKE_CUDA_FAIL=launch:400 >"$tmp/serve-fail.txt"
if [ "$(wc -l <"$tmp/serve-fail.txt")" = 3 ] && cmp -s "$tmp/serve-cpu.txt" "$tmp/serve-fail.txt" &&
    grep -qE '^\[cuda\] the states of [1-3] conversations rebuilt on the CPU: [1-9][0-9]* tokens of context fed again$' "$tmp/serve-fail"; then
    ok "serve: a device failing mid-decode with three conversations' states on it: each fed again on the CPU, the CPU's texts"
else bad "serve, a device failing mid-decode" "gpu $(head -c 200 "$tmp/serve-fail.txt"); $(grep -E 'cuda' "$tmp/serve-fail" | tail -n 2)"; fi
# A request with logprobs and a logit_bias, or in JSON mode (a schema's too), or a forced tool call (held to the
# template's form to its end), takes the whole logits row from the device (not its best): the CPU's tokens and
# log-probabilities, digit for digit. A JSON-mode chat still thinking (its constraint waits for </think>) takes the
# device's best: the CPU's thinking; so does a sampled chat whose thinking budget forces its close (no draw is made
# for the forced tokens, on either side). (A context of 1024: the tools block does not fit 256.)
ask() { # ask PATH BODY PATTERN: what of the answer the server on $port gives BODY at PATH matches PATTERN
    [ -n "$port" ] && curl -s -m 30 "http://127.0.0.1:$port$1" -d "$2" | grep -o "$3"
}
serve_logprobs() { # serve_logprobs LOG ENV...: a sampled completion's logprobs, and one's JSON text, from a server started with ENV
    local log=$1; shift
    serve_up "$log" 1 "$@"
    ask /v1/completions '{"prompt":"The capital of France is","max_tokens":8,"temperature":0.7,"seed":5,"logprobs":3,"logit_bias":{"1000":5}}' \
        '"logprobs":.*"finish_reason"'
    ask /v1/completions '{"prompt":"The capital of France is","max_tokens":12,"temperature":0.9,"seed":5,"response_format":{"type":"json_object"}}' \
        '"text":"[^"]*'
    ask /v1/completions '{"prompt":"The capital of France is","max_tokens":40,"temperature":0.9,"seed":5,"response_format":{"type":"json_schema","json_schema":{"name":"c","schema":{"type":"object","properties":{"c":{"enum":["red","blue"]}},"required":["c"]}}}}' \
        '"text":.*"finish_reason":"[a-z]*"'
    ask /v1/chat/completions '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":12,"temperature":0,"response_format":{"type":"json_object"},"chat_template_kwargs":{"enable_thinking":true}}' \
        '"reasoning_content":"[^"]*'
    ask /v1/chat/completions '{"messages":[{"role":"user","content":"Wake me"}],"max_tokens":300,"temperature":0.9,"seed":5,"tool_choice":"required","tools":[{"type":"function","function":{"name":"set_alarm","parameters":{"type":"object","properties":{"hour":{"type":"integer"},"loud":{"type":"boolean"},"day":{"enum":["mon","tue"]}},"required":["hour","day"]}}}],"chat_template_kwargs":{"enable_thinking":false}}' \
        '"tool_calls":.*"finish_reason":"[a-z_]*"'
    ask /v1/chat/completions '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":16,"temperature":0.9,"seed":5,"thinking_budget_tokens":4,"thinking_budget_message":" Done.","chat_template_kwargs":{"enable_thinking":true}}' \
        '"content":.*"reasoning_content":"[^"]*'
    serve_down
}
SERVE_CTX=1024 serve_logprobs "$tmp/lp-cpu" COLI_CUDA=0 >"$tmp/lp-cpu.txt"
SERVE_CTX=1024 serve_logprobs "$tmp/lp-gpu" LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=1 >"$tmp/lp-gpu.txt"
if grep -q '"token_logprobs":\[-' "$tmp/lp-cpu.txt" && grep -q '^"text":"[^"]*{[^"]*}$' "$tmp/lp-cpu.txt" && grep -q '^"text":"[^"]*{.*"finish_reason":"' "$tmp/lp-cpu.txt" && grep -q '^"reasoning_content":"..' "$tmp/lp-cpu.txt" && grep -q '^"tool_calls":\[{.*"name":"set_alarm".*"finish_reason":"tool_calls"$' "$tmp/lp-cpu.txt" && grep -q '^"content":"..*"reasoning_content":"[^"]* Done\.$' "$tmp/lp-cpu.txt" && cmp -s "$tmp/lp-cpu.txt" "$tmp/lp-gpu.txt" && grep -qE '^\[cuda\] [1-9][0-9]* products' "$tmp/lp-gpu" &&
    ! grep -q 'running on the CPU from here' "$tmp/lp-gpu"; then
    ok "serve on the fake device, logprobs and logit_bias, JSON mode, a JSON schema, a forced tool call, a thinking budget: the CPU's tokens and log-probabilities"
else bad "serve, logprobs on the device" "cpu $(head -c 200 "$tmp/lp-cpu.txt"), gpu $(head -c 200 "$tmp/lp-gpu.txt"); $(grep -E 'cuda' "$tmp/lp-gpu" | tail -n 2)"; fi
# One slot, three conversations one after another: the first is parked in RAM when the second
# takes the slot (its DeltaNet states and KV rows come down from the device first), and the third
# continues the first (its prompt and answer, and more), which is brought back and reused (its
# rows go up again). The CPU's texts, and the third's prompt tokens reused.
serve_turns() { # serve_turns LOG ENV...
    local log=$1 first; shift
    serve_up "$log" 1 "$@"
    turn() { curl -s -m 30 "http://127.0.0.1:$port/v1/completions" -d '{"prompt":"'"$1"'","max_tokens":6,"temperature":0,"ignore_eos":true}'; }
    if [ -n "$port" ]; then
        first=$(turn "The capital of France is" | grep -o '"text":"[^"]*"' | sed 's/^"text":"//; s/"$//')
        echo "$first"
        turn "Once upon a time, in a land" | grep -o '"text":"[^"]*"'
        turn "The capital of France is$first and" | grep -o '"text":"[^"]*"\|"cached_tokens":[0-9]*' | tr '\n' ' '
        echo
    fi
    serve_down
}
serve_turns "$tmp/turns-cpu" COLI_CUDA=0 >"$tmp/turns-cpu.txt"
serve_turns "$tmp/turns-gpu" LD_LIBRARY_PATH="$B/fake" FAKE_CUDA_DEVICES=1 >"$tmp/turns-gpu.txt"
if [ "$(wc -l <"$tmp/turns-cpu.txt")" = 3 ] && cmp -s "$tmp/turns-cpu.txt" "$tmp/turns-gpu.txt" && grep -qE '"cached_tokens":[1-9]' "$tmp/turns-gpu.txt" &&
    ! grep -q 'running on the CPU from here' "$tmp/turns-gpu"; then
    ok "serve on the fake device, one slot, a conversation parked and brought back: its prompt reused, the CPU's texts"
else bad "serve, a conversation parked and brought back" "cpu $(head -c 300 "$tmp/turns-cpu.txt"), gpu $(head -c 300 "$tmp/turns-gpu.txt")"; fi

# The two images of the Dockerfile, as root file systems built here and entered with chroot.
# cpu (FROM scratch): only the binary and the model: no glibc loader, nothing said about CUDA
# unless -v, and the CPU's tokens. gpu: the binary beside glibc's loader and libc (the files of
# debian:12-slim that matter here, taken from this Debian 12 host), and the fake driver where
# the NVIDIA container toolkit mounts the real one: the GPU path, the same tokens.
if [ "$(id -u)" = 0 ] && mkdir -p "$tmp/root" && cp "$COLI" "$tmp/root/coli" && cp "$GOLDEN/$m" "$tmp/root/" &&
    chroot "$tmp/root" /coli --version >/dev/null 2>&1; then
    chroot "$tmp/root" /coli info >"$tmp/o" 2>&1; has "cpu image: no loader" '^cuda: none: no glibc loader' "$tmp/o"
    has "cpu image: coli info says what to do" '^cuda: to use a card: the NVIDIA driver is a glibc library' "$tmp/o"
    chroot "$tmp/root" /coli run -m "/$m" -p "$P" -n 8 --ignore-eog --json 2>"$tmp/e" | tail -n 1 | sed 's/"timings".*//' >"$tmp/j"
    if cmp -s "$tmp/j" "$tmp/cpu-$m" && ! grep -q 'cuda' "$tmp/e"; then ok "cpu image: the CPU's tokens, and not a word about CUDA"
    else bad "cpu image run" "$(head -c 300 "$tmp/e")"; fi
    chroot "$tmp/root" /coli run -m "/$m" -p "$P" -n 1 -v 2>"$tmp/e" >/dev/null
    has "cpu image, -v: the reason in one line" '^\[cuda\] no glibc loader .*; running on the CPU$' "$tmp/e"
    lib=$(dirname "$(ldd "$B/fake/libcuda.so.1" | awk '/libc\.so\.6/ {print $3}')")
    ldso=$(ldd "$B/fake/libcuda.so.1" | awk '/ld-linux/ {print $1}')
    mkdir -p "$tmp/root$lib" "$tmp/root$(dirname "$ldso")" &&
        for so in libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1; do cp -L "$lib/$so" "$tmp/root$lib/"; done &&
        cp -L "$ldso" "$tmp/root$ldso" && cp "$B/fake/libcuda.so.1" "$tmp/root$lib/"
    chroot "$tmp/root" /coli info >"$tmp/o" 2>&1; has "gpu image: the (fake) device" '^cuda 0: Fake GPU A' "$tmp/o"
    chroot "$tmp/root" /coli run -m "/$m" -p "$P" -n 8 --ignore-eog --json 2>"$tmp/e" | tail -n 1 | sed 's/"timings".*//' >"$tmp/j"
    if cmp -s "$tmp/j" "$tmp/cpu-$m" && grep -qE '^\[cuda\] [1-9][0-9]* products' "$tmp/e"; then ok "gpu image: the GPU path, the CPU's tokens"
    else bad "gpu image run" "$(head -c 300 "$tmp/e")"; fi
else
    tokens "no loader (COLI_LDSO; chroot unavailable), -v" '^\[cuda\] no glibc loader' $m COLI_LDSO=/nonexistent -- -v
fi
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
