#!/usr/bin/env bash
# bench/prompt_cache.sh — what `serve --prompt-cache FILE` saves a conversation that returns after a restart.
#
# usage: bench/prompt_cache.sh MODEL.gguf [SENTENCES=60] [extra coli serve flags...]
#
# Starts `coli serve` with a new prompt cache file, sends one greedy chat request (a system
# prompt and SENTENCES sentences: a long agent prompt's stand-in; 8 tokens answered), stops the
# server (SIGTERM: the file is written), starts it again (the file is read) and sends the same
# request. Prints for each start the seconds to ready and to the answer, the prompt tokens and
# those reused, the server's own prompt and decode times, the file's size and the server's lines
# on writing and reading it. Needs curl and python3; loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: bench/prompt_cache.sh MODEL.gguf [SENTENCES] [coli serve flags]}
SENTENCES=${2:-60}
shift $(($# < 2 ? $# : 2))
COLI=./coli
[ -x "$COLI" ] || ./build.sh
dir=$(mktemp -d)
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$dir"' EXIT

python3 - "$SENTENCES" >"$dir/body.json" <<'PY'
import json, sys
text = ' '.join('The quick brown fox number %d jumps over the lazy dog near the river bank.' % i for i in range(int(sys.argv[1])))
print(json.dumps({'messages': [{'role': 'system', 'content': 'You are a careful assistant.'}, {'role': 'user', 'content': text}],
                  'max_tokens': 8, 'temperature': 0, 'chat_template_kwargs': {'enable_thinking': False}}))
PY

now() { date +%s.%N; }
# run LABEL: a server on the cache file, the request, SIGTERM; one line of figures
run() {
    local label=$1 t0 port="" ready answered
    shift
    t0=$(now)
    "$COLI" serve -m "$MODEL" --port 0 --prompt-cache "$dir/cache.bin" "$@" >"$dir/$label.out" 2>"$dir/$label.err" &
    pid=$!
    until [ -n "$port" ]; do
        kill -0 "$pid" 2>/dev/null || { echo "coli serve exited: $(tail -n 2 "$dir/$label.err")" >&2; exit 1; }
        port=$(sed -n 's|^\[serve\] listening on http://127\.0\.0\.1:\([0-9][0-9]*\).*|\1|p' "$dir/$label.err" | head -n 1)
        sleep 0.2
    done
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 0.2; done
    ready=$(awk "BEGIN{print $(now) - $t0}")
    t0=$(now)
    curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' --data-binary @"$dir/body.json" >"$dir/$label.json"
    answered=$(awk "BEGIN{print $(now) - $t0}")
    kill -TERM "$pid"
    wait "$pid" || true
    pid=""
    python3 - "$label" "$ready" "$answered" "$dir/$label.json" <<'PY'
import json, sys
label, ready, answered, path = sys.argv[1:5]
d = json.load(open(path))
u, t = d['usage'], d['timings']
print('%-6s ready %6.1f s  answered %7.2f s  prompt %d tokens, %d reused  server prompt %8.1f ms, decode %6.1f ms' %
      (label, float(ready), float(answered), u['prompt_tokens'], u['prompt_tokens_details']['cached_tokens'], t['prompt_ms'], t['decode_ms']))
PY
}
run cold "$@"
run warm "$@"
echo "file: $(du -m "$dir/cache.bin" | cut -f1) MiB"
grep -h '^\[serve\] prompt cache: [0-9]' "$dir/cold.err" "$dir/warm.err"
