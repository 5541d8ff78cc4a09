#!/usr/bin/env bash
# test_cli: the static binary as a user runs it: command line, errors, exit codes, --json.
# usage: tests/test_cli.sh ./coli [GOLDEN_DIR]
set -u
COLI=${1:-./coli}
GOLDEN=${2:-../shared/golden}
pass=0
fail=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export HEAT_FILE="$tmp/default.heat" # runs save expert heat; keep it out of ~/.cache

ok() { echo "ok - $1"; pass=$((pass + 1)); }
bad() { echo "FAIL - $1: $2"; fail=$((fail + 1)); }

# expect LABEL STATUS PATTERN -- COMMAND...: exit status STATUS, stderr one line matching PATTERN
# (for STATUS 0, PATTERN is matched against stdout).
expect() {
    local label=$1 want=$2 pattern=$3
    shift 4
    local rc=0
    "$@" >"$tmp/out" 2>"$tmp/err" </dev/null || rc=$?
    if [ "$rc" != "$want" ]; then bad "$label" "exit status $rc, wanted $want; stderr: $(head -c 300 "$tmp/err")"; return; fi
    if [ "$want" = 0 ]; then
        grep -qE -- "$pattern" "$tmp/out" && ok "$label" || bad "$label" "stdout lacks /$pattern/"
        return
    fi
    if [ -z "$pattern" ]; then ok "$label"; return; fi
    # informational lines may come first; the error is one line, the last
    local errors
    errors=$(grep -c '^coli: ' "$tmp/err")
    if [ "$errors" != 1 ] || ! tail -n 1 "$tmp/err" | grep -qE -- "^coli: .*$pattern"; then
        bad "$label" "stderr does not end in one 'coli: ' line matching /$pattern/: $(head -c 300 "$tmp/err")"
        return
    fi
    ok "$label"
}

expect "--version" 0 '^coli [0-9]' -- "$COLI" --version
expect "--help lists the commands" 0 'tokenize' -- "$COLI" --help
expect "help run" 0 '--json' -- "$COLI" help run
expect "no command is a usage error" 2 '' -- "$COLI"
expect "unknown command" 2 "unknown command 'frobnicate'" -- "$COLI" frobnicate
expect "unknown option" 2 "unknown option '--bogus'" -- "$COLI" run -m x.gguf -p hi --bogus
expect "bad number" 2 "'-3' is not a whole number" -- "$COLI" run -m x.gguf -p hi -n -3
expect "missing value" 2 "needs a value" -- "$COLI" run -m
expect "a thinking budget below -1" 2 "--reasoning-budget: '-2' is not a whole number" -- "$COLI" run -m x.gguf -p hi --chat --reasoning-budget -2
expect "help for an unknown command" 2 "no command 'nope'" -- "$COLI" help nope
expect "missing model file" 1 "/nonexistent.gguf: cannot open" -- "$COLI" run -m /nonexistent.gguf -p hi
expect "a device as the model file" 1 "/dev/null: cannot open: not a regular file" -- "$COLI" run -m /dev/null -p hi
expect "a directory as the model file" 1 ": cannot open: Is a directory" -- "$COLI" run -m "$tmp" -p hi
expect "info without a model" 0 '^kernels: ' -- "$COLI" info
expect "COLI_CPU=scalar" 0 '^kernels: scalar' -- env COLI_CPU=scalar "$COLI" info
expect "COLI_CPU=bogus (a usage error)" 2 'COLI_CPU' -- env COLI_CPU=bogus "$COLI" info
expect "COLI_PING_SECONDS=0 (a usage error)" 2 "COLI_PING_SECONDS='0': a number of seconds" -- env COLI_PING_SECONDS=0 "$COLI" serve -m x.gguf
expect "--kv: an unknown format is a usage error" 2 "--kv: 'q8' is not a KV cache format \(f32, f16 or q8_0\)" -- "$COLI" run -m x.gguf -p hi --kv q8
# the 35B-A3B's KV cache a token: 10 attention layers x K and V x 2 KV heads x 256 dims x 4 bytes = 40 KiB
expect "plan: the 35B-A3B's f32 KV cache, 40 KiB a token" 0 '^cpu: KV cache: 40.0 KiB per token' -- env COLI_CUDA=0 "$COLI" plan --synthetic 35b-a3b -c 4096
expect "plan --kv f16: half of it" 0 '^cpu: KV cache: 20.0 KiB per token' -- env COLI_CUDA=0 "$COLI" plan --synthetic 35b-a3b -c 4096 --kv f16
# Q8_0: 34 bytes a block of 32 values
expect "plan --kv q8_0: 17/64 of it" 0 '^cpu: KV cache: 10.6 KiB per token' -- env COLI_CUDA=0 "$COLI" plan --synthetic 35b-a3b -c 4096 --kv q8_0
# (its own heat file: the plans compared below must not find this run's heat)
for kv in f16:fp16 q8_0:q8_0; do
    if [ -f "$GOLDEN/q35moe-q8_0.gguf" ] && HEAT_FILE="$tmp/kv.heat" "$COLI" run -m "$GOLDEN/q35moe-q8_0.gguf" -p hi -n 2 --kv "${kv%%:*}" >/dev/null 2>"$tmp/kv_err" &&
        grep -q "^\[coli\] .*context [0-9]* of [0-9]* tokens (KV cache ${kv#*:});" "$tmp/kv_err"; then
        ok "run --kv ${kv%%:*} says so where it tells the context"
    elif [ -f "$GOLDEN/q35moe-q8_0.gguf" ]; then bad "run --kv ${kv%%:*} says so where it tells the context" "$(head -c 300 "$tmp/kv_err")"
    else ok "run --kv ${kv%%:*} # SKIP golden data absent"; fi
done

# --synthetic: a model from a geometry (no file); its tensors are checked against gen_model and the golden files in test_gguf
expect "--synthetic: an unknown geometry is a usage error" 2 "unknown geometry 'big'" -- "$COLI" plan --synthetic big
expect "--synthetic: LAYERS must be a count" 2 'write NAME\[:QUANT\[:LAYERS\]\]' -- "$COLI" plan --synthetic tiny:q4_0:0
expect "--synthetic: an unknown QUANT" 2 "unknown QUANT 'q9'" -- "$COLI" info --synthetic tiny:q9
expect "--synthetic and -m together" 2 'name two models; give one' -- "$COLI" bench -m x.gguf --synthetic tiny
expect "--synthetic is not an option of run" 2 "unknown option '--synthetic'" -- "$COLI" run --synthetic tiny -p hi
expect "--synthetic tiny:q4_k_m: rows too short for Q4_K" 2 'rows of 64, not a multiple of the Q4_K block \(256\)' -- "$COLI" plan --synthetic tiny:q4_k_m
expect "info --synthetic 35b-a3b: the Q4_K_M mix, 20.2 GiB, without memory" 0 '^  routed experts +Q4_K 100 \(14400.0 MiB\), Q6_K 20 \(4200.0 MiB\)$' -- "$COLI" info --synthetic 35b-a3b
expect "plan --synthetic 80b-a3b-next:q4_0 (qwen3next, 512 experts)" 0 '^cpu: routed experts: [0-9.]+ MiB' -- env COLI_CUDA=0 "$COLI" plan --synthetic 80b-a3b-next:q4_0
expect "bench --synthetic: not even one block of layers fits --ram" 1 'not even 4 layers fit in the 0.0 MiB' -- "$COLI" bench --synthetic tiny:q8_0 --ram 1K
"$COLI" bench --synthetic tiny:q8_0:8 --ram 1200K -p 16 -n 16 --json 2>"$tmp/syn_err" | tail -n 1 >"$tmp/syn"
if python3 - "$tmp/syn" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); s = j["synthetic"]
assert j["model"] == "tiny:q8_0:8" and s["layers"] == 8 and s["layers_measured"] == 4 and s["fits_in_memory"], s
head, tm, t = s["head_s"], 1 / s["measured_decode_tok_s"], 1 / j["decode_tok_s"]
assert 0 < head < tm and abs(t - (head + (tm - head) * 8 / 4)) < 0.01 * t, (head, tm, t)
PY
then ok "bench --synthetic tiny:q8_0:8 --ram 1200K: 4 of 8 layers measured, the layers' time doubled, the head once"
else bad "bench --synthetic scaled" "$(cat "$tmp/syn") $(tail -n 3 "$tmp/syn_err")"; fi
if python3 - "$tmp/syn" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); ph = j["decode_ms_per_token"]
assert set(ph) == {"products", "experts", "deltanet", "attention", "routing", "other", "sampling"}, ph
assert min(ph.values()) >= 0 and ph["products"] > 0 and ph["experts"] > 0 and ph["deltanet"] > 0, ph
per = 1000 / j["synthetic"]["measured_decode_tok_s"]  # the decode steps' wall time, which the phases divide
assert 0.3 * per < sum(ph.values()) <= 1.001 * per, (ph, per)
assert 0 <= j["decode_idle_ms_per_token"] <= ph["products"] + ph["experts"] + ph["routing"], j  # the products' barriers
roof = j["read_gb_s"] * 1e9 / j["decode_bytes_per_token"]
assert j["decode_bytes_per_token"] > 0 and abs(j["roofline_tok_s"] - roof) <= 1e-3 * roof, j
# the state a decode step reads, from the tiny geometry (`info --synthetic tiny`): 4 measured layers,
# 3 of them DeltaNet (4 value heads of 16 x 16 floats, a conv state of 3 rows of 2*2*16 + 4*16
# channels), one attention layer's KV rows (2 heads of 32 floats, K and V) at the steps' mean context
rows = j["prompt_tokens"] + j["gen_tokens"] / 2
assert j["decode_state_bytes_per_token"] == 3 * (4 * 16 * 16 + 3 * 128) * 4 + 2 * 2 * 32 * 4 * rows, j
PY
then ok "bench --json: the decode profile's phases divide the decode steps' time, its idle at barriers within the products'; roofline = bandwidth / bytes a token (state included)"
else bad "bench --json decode profile" "$(cat "$tmp/syn")"; fi
if python3 - "$tmp/syn" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); ph = j["prompt_ms_per_token"]
assert set(ph) == set(j["decode_ms_per_token"]) and min(ph.values()) >= 0 and ph["experts"] > 0, ph
per = 1000 / j["synthetic"]["measured_prompt_tok_s"]  # the prompt's wall time per token
# the phases also hold the first token's sampling, which the prompt's time leaves out, and each
# is printed to 1e-4 ms (a tiny model's prompt takes ~0.1 ms a token)
assert 0.3 * per < sum(ph.values()) <= 1.02 * per + 7e-4, (ph, per)
PY
then ok "bench --json: the prompt profile's phases divide the prompt's time"
else bad "bench --json prompt profile" "$(cat "$tmp/syn")"; fi
if grep -qE '^\[experts\] [0-9.]+ GiB of experts mapped ahead in [0-9.]+ s \(before the measured run\)$' "$tmp/syn_err"
then ok "bench: the experts mapped ahead before it measures"
else bad "bench maps the experts ahead" "$(cat "$tmp/syn_err")"; fi

# bench --seed S draws another random prompt (default 42): the routing it saw, kept as heat, differs
M="$GOLDEN/q35moe-q8_0.gguf"
if [ -f "$M" ]; then
    for s in default 42 7; do
        seed=(); [ "$s" = default ] || seed=(--seed "$s")
        "$COLI" bench -m "$M" -p 16 -n 2 "${seed[@]}" --heat "$tmp/heat_$s" >/dev/null 2>&1
    done
    if [ -s "$tmp/heat_default" ] && cmp -s "$tmp/heat_default" "$tmp/heat_42" && ! cmp -s "$tmp/heat_42" "$tmp/heat_7"
    then ok "bench --seed: 42 is the default prompt, 7 another (the heat files of their routing)"
    else bad "bench --seed draws the prompt" "$(ls -l "$tmp"/heat_* 2>&1)"; fi
else ok "bench --seed # SKIP golden data absent"; fi

# a heat path that is not a regular file keeps no heat: saving renames over the path (as root,
# --heat /dev/null had replaced /dev/null); a FIFO stands in for it here, and would block a read
if [ -f "$M" ] && mkfifo "$tmp/heat_fifo"; then
    if timeout 60 "$COLI" run -m "$M" -p hi -n 2 --heat "$tmp/heat_fifo" >/dev/null 2>"$tmp/fifo_err" && [ -p "$tmp/heat_fifo" ] &&
        grep -q "heat $tmp/heat_fifo is not a regular file: no heat kept" "$tmp/fifo_err"
    then ok "--heat on a FIFO: said, not read, not replaced"
    else bad "--heat on a non-regular file" "$(ls -l "$tmp/heat_fifo" 2>&1) $(head -c 300 "$tmp/fifo_err")"; fi
else ok "--heat on a FIFO # SKIP golden data absent or no mkfifo"; fi

if file "$COLI" | grep -q 'statically linked'; then ok "binary is statically linked"; else bad "binary is statically linked" "$(file "$COLI")"; fi
if ldd "$COLI" 2>&1 | grep -q 'not a dynamic executable'; then ok "ldd: not a dynamic executable"; else bad "ldd" "$(ldd "$COLI" 2>&1)"; fi

if [ ! -d "$GOLDEN" ]; then
    ok "golden CLI checks # SKIP $GOLDEN absent"
else
    M=$GOLDEN/q35moe-q8_0.gguf
    expect "info -m" 0 'architecture: qwen35moe' -- "$COLI" info -m "$M"
    expect "tokenize" 0 '^9707$' -- "$COLI" tokenize -m "$GOLDEN/tokenizer-qwen3.gguf" -p "Hello world"
    head -c 4000 "$M" >"$tmp/trunc.gguf"
    expect "truncated model" 1 'trunc.gguf: ' -- "$COLI" info -m "$tmp/trunc.gguf"
    # a format coli does not read (IQ2_XXS): refused by name with what to download; info still describes it
    python3 tests/gguf_patch.py "$GOLDEN/q35moe-iq3_xxs.gguf" "$tmp/iq2.gguf" retype 18 16
    expect "a format coli does not read is refused by name" 1 "is IQ2_XXS, a format coli does not read yet; .*download" -- "$COLI" run -m "$tmp/iq2.gguf" -p hi
    expect "info describes a file of such a format" 0 '^runs: no: .*Q2_K' -- "$COLI" info -m "$tmp/iq2.gguf"
    expect "info: types per tensor group" 0 '^  routed experts +IQ2_XXS 12 ' -- "$COLI" info -m "$tmp/iq2.gguf"
    # a NaN or infinite block scale in each format coli reads: no crash, the NaN is reported
    for spec in q8_0:7e00 q4_0:7c00 q2_k:7e00 q3_k:7c00 q6_k:7e00 iq4_nl:7e00 iq4_xs:7c00 iq3_xxs:7e00 iq3_s:7c00 mxfp4:ff; do
        f=${spec%%:*}
        python3 tests/gguf_patch.py "$GOLDEN/q35moe-$f.gguf" "$tmp/nan.gguf" scale blk.1.ffn_down_exps.weight "${spec#*:}"
        expect "$f: a block scale of ${spec#*:} gives a reported non-finite result" 1 'the logits are not finite' -- "$COLI" run -m "$tmp/nan.gguf" -p hi -n 2
    done
    # plan --synthetic tiny:q8_0 is the golden q35moe-q8_0's geometry and types: the same plan
    COLI_CUDA=0 "$COLI" plan --synthetic tiny:q8_0 --json 2>/dev/null >"$tmp/plan_syn"
    COLI_CUDA=0 "$COLI" plan -m "$M" --json 2>/dev/null >"$tmp/plan_real"
    if python3 - "$tmp/plan_syn" "$tmp/plan_real" <<'PY'
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:3])
assert a["model"] == "tiny:q8_0" and a["components"] and a["components"] == b["components"], (a["components"], b["components"])
assert a["cpu"] == b["cpu"] and a["layers"] == b["layers"] == 4, (a["cpu"], b["cpu"])
assert a["expected"]["cpu_bytes_per_token"] == b["expected"]["cpu_bytes_per_token"]
PY
    then ok "plan --synthetic tiny:q8_0 --json: the golden q35moe-q8_0's components, CPU side and bytes per token"
    else bad "plan --synthetic vs the golden file" "$(head -c 300 "$tmp/plan_syn")"; fi
    expect "plan: experts copied where memory holds them twice" 0 "stays in memory, copied into coli's own memory" -- env COLI_CUDA=0 "$COLI" plan -m "$M"
    expect "plan --ram: experts read in place (never copied)" 0 "stays in memory, read in place from the mapping$" -- env COLI_CUDA=0 "$COLI" plan -m "$M" --ram 1G
    expect "plan --json: the copy said" 0 '"expert_cache":\{"mode":"mapped","copied":true\}' -- env COLI_CUDA=0 "$COLI" plan -m "$M" --json
    expect "vocabulary-only file cannot run" 1 "missing tensor 'token_embd.weight'" -- "$COLI" run -m "$GOLDEN/tokenizer-qwen3.gguf" -p hi
    expect "prompt longer than the context" 1 'context holds 8' -- "$COLI" run -m "$M" -c 8 -p "The capital of France is Paris, and"
    expect "context fills during generation" 0 '"stop":"context"' -- "$COLI" run -m "$M" -c 12 -n 100 --json --ignore-eog -p "The capital of France is"

    schema='{"type":"object","properties":{"c":{"enum":["red","blue"]},"n":{"type":"integer"}},"required":["c","n"]}'
    printf '%s' "$schema" >"$tmp/schema.json"
    sbad=
    for seed in 1 2 3; do
        "$COLI" run -m "$M" -p "The capital of France is" -n 400 --temp 1 --seed $seed --json-schema "@$tmp/schema.json" >"$tmp/js" 2>/dev/null &&
            python3 -c 'import json, sys; v = json.load(open(sys.argv[1])); sys.exit(not (list(v) == ["c", "n"] and v["c"] in ("red", "blue") and type(v["n"]) is int))' "$tmp/js" ||
            sbad="$sbad seed $seed: $(head -c 200 "$tmp/js" | tr '\n' ' ')"
    done
    if [ -z "$sbad" ]; then ok "run --json-schema @FILE: 3 sampled answers, each an object the schema admits (python)"; else bad "run --json-schema" "$sbad"; fi
    expect "run --json-schema: a schema not followed" 1 "--json-schema: the JSON schema keyword 'pattern'" -- "$COLI" run -m "$M" -p hi --json-schema '{"type":"object","pattern":"x"}'
    expect "run --json-schema: not JSON" 1 "--json-schema: not JSON" -- "$COLI" run -m "$M" -p hi --json-schema '{"type":'
    expect "run --json-schema: a missing file" 1 "--json-schema: cannot open" -- "$COLI" run -m "$M" -p hi --json-schema @"$tmp/absent.json"

    P="The capital of France is Paris, and the capital of Japan is"
    "$COLI" run -m "$M" -p "$P" -n 32 --ignore-eog --json -t 1 2>"$tmp/t1_err" | tail -n 1 >"$tmp/t1"
    "$COLI" run -m "$M" -p "$P" -n 32 --ignore-eog --json -t 2 2>/dev/null | tail -n 1 >"$tmp/t2"
    COLI_CPU=scalar "$COLI" run -m "$M" -p "$P" -n 32 --ignore-eog --json -t 2 2>/dev/null | tail -n 1 >"$tmp/t3"
    strip() { sed -e 's/"timings".*//' "$1"; }
    if [ -s "$tmp/t1" ] && [ "$(strip "$tmp/t1")" = "$(strip "$tmp/t2")" ] && [ "$(strip "$tmp/t1")" = "$(strip "$tmp/t3")" ]; then
        ok "run --json: same tokens and logits with -t 1, -t 2 and COLI_CPU=scalar"
    else
        bad "run --json thread/level identity" "outputs differ"
    fi
    want=$(tr -d ' \n' <"$GOLDEN/q35moe-q8_0.json" | grep -o '"name":"short".*' | grep -o '"tokens":\[[0-9,]*\]' | head -n 1)
    got=$(grep -o '"tokens":\[[0-9,]*\]' "$tmp/t1")
    if [ -n "$want" ] && [ "$want" = "$got" ]; then ok "run --json reproduces the golden greedy tokens"; else bad "golden tokens via CLI" "got $got want $want"; fi

    printf 'Hello there\n/reset\nAnd again\n/exit\n' >"$tmp/chat_in"
    rc=0
    "$COLI" chat -m "$M" -n 6 --seed 7 <"$tmp/chat_in" >"$tmp/chat_out" 2>"$tmp/chat_err" || rc=$?
    if [ "$rc" = 0 ] && grep -q 'conversation cleared' "$tmp/chat_err" && [ "$(grep -c '^\[stats\]' "$tmp/chat_err")" = 2 ]; then
        ok "chat: two turns around /reset, then /exit"
    else
        bad "chat session" "rc $rc; $(head -c 400 "$tmp/chat_err")"
    fi

    expect "a thinking budget without --chat" 2 "--reasoning-budget bounds a chat's think block: add --chat" -- "$COLI" run -m "$M" -p hi --reasoning-budget 3
    # --reasoning-budget 3: the unbounded answer's first 3 tokens of thought, then "\n</think>" forced (the newline
    # left out if the thoughts end in one), then the answer goes on
    "$COLI" run -m "$M" --chat -p "Why is the sky blue?" -n 3 --json 2>/dev/null | tail -n 1 >"$tmp/think_free"
    "$COLI" run -m "$M" --chat -p "Why is the sky blue?" -n 12 --json --reasoning-budget 3 2>/dev/null | tail -n 1 >"$tmp/think_cut"
    end=$("$COLI" tokenize -m "$M" -p "</think>" 2>/dev/null)
    newline=$("$COLI" tokenize -m "$M" -p "$(printf '\n.')" 2>/dev/null | head -n 1)
    if python3 - "$tmp/think_free" "$tmp/think_cut" "$end" "$newline" <<'PY'; then
import json, sys
free, cut = (json.load(open(p)) for p in sys.argv[1:3])
end, newline = int(sys.argv[3]), int(sys.argv[4])
want = free['tokens'] + ([end] if free['text'].endswith('\n') else [newline, end])
sys.exit(0 if len(free['tokens']) == 3 and end not in free['tokens'] and cut['tokens'][:len(want)] == want and len(cut['tokens']) == 12 else 1)
PY
        ok "run --chat --reasoning-budget 3: the first 3 tokens of thought, then the close forced, the answer on"
    else
        bad "run --reasoning-budget" "$(head -c 200 "$tmp/think_free"); $(head -c 200 "$tmp/think_cut")"
    fi

    # the expert store: a budget of a few experts changes nothing but speed; heat files
    "$COLI" run -m "$M" -p "$P" -n 32 --ignore-eog --json -t 1 --ram 1 --heat "$tmp/h.heat" 2>"$tmp/ram_err" | tail -n 1 >"$tmp/t4"
    if [ -s "$tmp/t4" ] && [ "$(strip "$tmp/t1")" = "$(strip "$tmp/t4")" ] && grep -q '"experts":{"mode":"cached"' "$tmp/t4" && [ -s "$tmp/h.heat" ]; then
        ok "run --ram 1: same tokens and logits from a 4-expert cache; heat saved"
    else
        bad "run --ram 1" "outputs differ or no heat file; $(head -c 300 "$tmp/ram_err")"
    fi
    "$COLI" run -m "$M" -p "$P" -n 32 --ignore-eog --json -t 1 --ram 1G 2>"$tmp/inplace_err" | tail -n 1 >"$tmp/t5"
    if [ -s "$tmp/t5" ] && [ "$(strip "$tmp/t1")" = "$(strip "$tmp/t5")" ] && grep -q 'fit in memory: copied there' "$tmp/t1_err" &&
        grep -q 'fit in memory: read in place' "$tmp/inplace_err"; then
        ok "experts copied into memory (no --ram) and read in place (--ram 1G): the same tokens and logits"
    else
        bad "experts copied vs in place" "outputs differ or not both modes; $(grep experts "$tmp/t1_err" "$tmp/inplace_err" | head -c 300)"
    fi
    "$COLI" run -m "$M" -p "$P" -n 32 --ignore-eog --json -t 1 --copy-experts 2>"$tmp/copy_err" | tail -n 1 >"$tmp/t6"
    if [ -s "$tmp/t6" ] && [ "$(strip "$tmp/t1")" = "$(strip "$tmp/t6")" ] && grep -q 'fit in memory: copied there' "$tmp/copy_err"; then
        ok "run --copy-experts: copied, the same tokens and logits"
    else
        bad "run --copy-experts" "outputs differ or not copied; $(grep experts "$tmp/copy_err" | head -c 300)"
    fi
    printf 'COLIHEAT-but-not-really' >"$tmp/bad.heat"
    rc=0
    HEAT_FILE="$tmp/bad.heat" "$COLI" run -m "$M" -p "$P" -n 2 --ram 1 >/dev/null 2>"$tmp/heat_err" || rc=$?
    if [ "$rc" = 0 ] && [ "$(grep -c 'heat file .*bad.heat: .*; ignored' "$tmp/heat_err")" = 1 ]; then
        ok "HEAT_FILE: a corrupt heat file is ignored with one line"
    else
        bad "corrupt HEAT_FILE" "rc $rc; $(head -c 400 "$tmp/heat_err")"
    fi
fi

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
