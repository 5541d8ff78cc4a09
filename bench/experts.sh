#!/usr/bin/env bash
# bench/experts.sh — decode speed of a model larger than the memory it may use.
#
# usage: bench/experts.sh MODEL.gguf [LIMIT=12G] [PROMPT=32] [GEN=32] [extra coli flags...]
#
# Runs `coli bench` twice: in a fresh v1 memory cgroup limited to LIMIT (page cache dropped
# first, so every expert comes from the disk; coli picks its expert budget from the cgroup),
# then without a limit and with the model in the page cache (experts read in place from the
# mapping). Prints one line per run: decode tok/s, hit rates, bytes read and disk GB/s while
# reading, prefetch accuracy, peak RSS of coli and the cgroup's peak charge (RSS + page cache).
# Needs root (cgroup, drop_caches). The heat file is the default one, so a second run of this
# script starts warm: pass --heat FILE to choose one, --heat /dev/null for none.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: bench/experts.sh MODEL.gguf [LIMIT] [PROMPT] [GEN] [coli flags]}
LIMIT=${2:-12G}
PROMPT=${3:-32}
GEN=${4:-32}
shift $(($# < 4 ? $# : 4))
COLI=./coli
CG=/sys/fs/cgroup/memory/coli_bench_$$

[ -x "$COLI" ] || ./build.sh
[ -d /sys/fs/cgroup/memory ] || { echo "bench/experts.sh: no v1 memory controller at /sys/fs/cgroup/memory" >&2; exit 1; }

# field NAME JSON: a number from the one-line JSON object
field() { grep -o "\"$1\":[-0-9.e]*" <<<"$2" | head -n 1 | cut -d: -f2; }

report() {
    local label=$1 json=$2 cg_peak=$3
    local e=${json#*\"experts\":}
    printf '%-34s decode %6.2f tok/s  prompt %6.2f tok/s  hits prompt %5.1f%% decode %5.1f%%  read %6.2f GiB at %4.2f GB/s  prefetch %5.1f%%  decode waited %6.2f s  peak RSS %5.2f GiB  cgroup peak %s\n' \
        "$label" "$(field decode_tok_s "$json")" "$(field prompt_tok_s "$json")" \
        "$(awk "BEGIN{print 100*$(field hit_rate_prompt "$e")}")" "$(awk "BEGIN{print 100*$(field hit_rate_decode "$e")}")" \
        "$(awk "BEGIN{print $(field bytes_read "$e")/1073741824}")" "$(field disk_gb_s "$e")" \
        "$(awk "BEGIN{print 100*$(field prefetch_accuracy_decode "$e")}")" "$(field wait_decode_s "$e")" \
        "$(awk "BEGIN{print $(field peak_rss_bytes "$e")/1073741824}")" "$cg_peak"
}

mkdir "$CG"
trap 'rmdir "$CG" 2>/dev/null || true' EXIT INT TERM
echo "$LIMIT" | sed 's/G$/*1073741824/;s/M$/*1048576/' | bc >"$CG/memory.limit_in_bytes"
sync
echo 3 >/proc/sys/vm/drop_caches
json=$(sh -c "echo \$\$ >$CG/cgroup.procs && exec $COLI bench -m '$MODEL' -p $PROMPT -n $GEN --json $*" 2>/tmp/coli_bench_$$.err | tail -n 1)
grep '^\[experts\]' /tmp/coli_bench_$$.err | head -n 2 >&2 || true
report "cgroup $LIMIT, cold page cache" "$json" "$(awk '{printf "%.2f GiB", $1/1073741824}' "$CG/memory.max_usage_in_bytes")"

if [ "${BENCH_UNLIMITED:-1}" = 1 ]; then
    cat "$MODEL" >/dev/null # the whole file into the page cache
    json=$($COLI bench -m "$MODEL" -p "$PROMPT" -n "$GEN" --json --ram 1T "$@" 2>/dev/null | tail -n 1)
    report "no limit, model in page cache" "$json" "-"
fi
rm -f /tmp/coli_bench_$$.err
