#!/usr/bin/env bash
# test_serve: `coli serve` end to end, over loopback only: the OpenAI-compatible endpoints, greedy
# output identical to `coli run`, streaming, stop strings, parallel slots, errors and malformed
# HTTP, the API key, SIGTERM, the official `openai` npm client (tests/serve_openai.mjs), the Anthropic Messages API
# against the chat requests it means (tests/serve_anthropic.py) and through `@anthropic-ai/sdk` (tests/serve_anthropic.mjs),
# OpenAI's Responses API against the chat requests it means (tests/serve_responses.py), and Ollama's API against the
# requests it means (tests/serve_ollama.py) and through the `ollama` client (tests/serve_ollama.mjs).
# usage: tests/test_serve.sh ./coli GOLDEN_DIR [--fuzz-bin PATH]
# Needs curl and python3 (JSON); node + npm for the three clients (skipped without them, or when
# the install fails). COLI_TEST_OPENAI_PREFIX=DIR reuses an npm prefix that already holds them.
set -u
COLI=${1:-./coli}
GOLDEN=${2:-../shared/golden}
FUZZ=
if [ "${3:-}" = --fuzz-bin ]; then FUZZ=${4:-}; fi
HERE=$(cd "$(dirname "$0")" && pwd)
pass=0
fail=0
ok() { echo "ok - $1"; pass=$((pass + 1)); }
bad() { echo "FAIL - $1: $2"; fail=$((fail + 1)); }
finish() {
    echo "$pass passed, $fail failed"
    [ "$fail" = 0 ]
    exit
}

if [ ! -d "$GOLDEN" ]; then ok "serve # SKIP $GOLDEN absent"; finish; fi
M=$GOLDEN/q35moe-q8_0.gguf
MODEL_ID=q35moe-q8_0
for tool in curl python3; do
    if ! command -v "$tool" >/dev/null; then ok "serve # SKIP no $tool"; finish; fi
done

tmp=$(mktemp -d)
srv_pids=""
npm_pid=""
slow_pid=""
# shellcheck disable=SC2317 # called by the trap
cleanup() {
    local p
    for p in $srv_pids $npm_pid $slow_pid; do kill "$p" 2>/dev/null; done
    for p in $srv_pids $npm_pid $slow_pid; do wait "$p" 2>/dev/null; done
    rm -rf "$tmp"
}
trap cleanup EXIT
export HEAT_FILE="$tmp/run.heat" # coli run saves expert heat; keep it out of ~/.cache

# The official client, installed in the background while the rest runs.
npm_prefix=
npm_skip=
if [ -n "${COLI_TEST_OPENAI_PREFIX:-}" ] && [ -d "$COLI_TEST_OPENAI_PREFIX/node_modules/openai" ]; then
    npm_prefix=$COLI_TEST_OPENAI_PREFIX
elif ! command -v node >/dev/null; then
    npm_skip="no node"
elif ! command -v npm >/dev/null; then
    npm_skip="no npm"
else
    npm_prefix=$tmp/npm
    mkdir -p "$npm_prefix"
    timeout 120 npm install --prefix "$npm_prefix" --no-audit --no-fund --loglevel=error openai@4 @anthropic-ai/sdk@1 ollama@0.6 >"$tmp/npm.log" 2>&1 </dev/null &
    npm_pid=$!
fi

# JSON and server-sent events, read by python3. q MODE FILE EXPR prints EXPR's value as JSON
# (MODE json) or a string as is (MODE raw); d is FILE's JSON (MODE sse*: a summary of an event
# stream, below), E the environment. Exit status 1 (and nothing on stdout) when EXPR fails.
cat >"$tmp/q.py" <<'PY'
import json, os, re, sys
E = os.environ
def load(p):
    with open(p, 'rb') as f:
        return json.loads(f.read().decode('utf-8', 'replace'))
def sse(p):
    with open(p, 'rb') as f:
        raw = f.read().decode('utf-8', 'replace')
    s = {'problems': [], 'chunks': [], 'done_last': False, 'ends_with_done': raw.endswith('data: [DONE]\n\n')}
    events = raw.split('\n\n')
    if events and events[-1] == '':
        events.pop()
    else:
        s['problems'].append('the stream does not end in a blank line')
    datas = []
    for ev in events:
        if all(l.startswith(':') for l in ev.split('\n')):
            continue  # an SSE comment (keep-alive)
        if not ev.startswith('data: ') or '\n' in ev:
            s['problems'].append('not one data line: %r' % ev[:80])
            continue
        datas.append(ev[6:])
    s['done_last'] = bool(datas) and datas[-1] == '[DONE]' and datas.count('[DONE]') == 1
    for x in datas:
        if x == '[DONE]':
            continue
        try:
            s['chunks'].append(json.loads(x))
        except ValueError:
            s['problems'].append('not JSON: %r' % x[:80])
    ch = s['chunks']
    cc = [c for c in ch if c.get('choices')]
    s['objects'] = sorted(set(str(c.get('object')) for c in ch))
    s['ids'] = sorted(set(str(c.get('id')) for c in ch))
    s['n_choice_chunks'] = len(cc)
    s['first_role'] = cc[0]['choices'][0].get('delta', {}).get('role') if cc else None
    s['content'] = ''.join((c['choices'][0].get('delta') or {}).get('content') or '' for c in cc)
    s['reasoning'] = ''.join((c['choices'][0].get('delta') or {}).get('reasoning_content') or '' for c in cc)
    s['text'] = ''.join(c['choices'][0].get('text') or '' for c in cc)
    s['finish'] = [c['choices'][0].get('finish_reason') for c in cc]
    s['last_delta'] = cc[-1]['choices'][0].get('delta') if cc else None
    s['usage'] = [c.get('usage') for c in ch if c.get('choices') == [] and c.get('usage')]
    s['usage_last'] = bool(ch) and ch[-1].get('choices') == [] and bool(ch[-1].get('usage'))
    lps = [c['choices'][0]['logprobs'] for c in cc if c['choices'][0].get('logprobs')]
    s['logprobs'] = [t for lp in lps for t in lp.get('content', [])]  # a chat's token entries, in order
    s['legacy'] = {k: [x for lp in lps for x in lp.get(k, [])] for k in ('tokens', 'token_logprobs', 'top_logprobs', 'text_offset')}
    return s
def log_softmax(path):  # a raw little-endian float32 logits row's log-probabilities, in double
    import math, struct
    with open(path, 'rb') as f:
        raw = f.read()
    x = struct.unpack('<%df' % (len(raw) // 4), raw)
    m = max(x)
    lse = m + math.log(sum(math.exp(v - m) for v in x))
    return [v - lse for v in x]
def greedy(p):  # the text of `coli run --json`, without the end-of-generation token's text
    r = load(p)
    t = r['text']
    return re.sub(r'(<\|im_end\|>|<\|endoftext\|>)$', '', t) if r['stop'] == 'eog' else t
def content(p):  # a chat answer's content: the greedy text without the space around it
    return greedy(p).strip(' \t\r\n')
def thought(p):  # an answer begun inside a think block: (reasoning, content), split at </think>
    t = greedy(p)
    r, _, c = t.partition('</think>')
    return [r.strip(' \t\r\n'), c.strip(' \t\r\n')]
def pick_stop(c, frm, n, cls):  # a substring of c from frm*len(c) on, whose first occurrence is not at 0
    for i in range(int(len(c) * frm), len(c) - n):
        s = c[i:i + n]
        if re.fullmatch(cls, s) and c.find(s) >= 2:
            return s
    raise ValueError('no stop string')
def schema_valid(s, v):  # v under JSON schema s (the keywords of test_serve's), objects' keys in the schema's order
    if 'enum' in s: return any(type(v) is type(e) and v == e for e in s['enum'])
    t, props = s.get('type'), s.get('properties', {})
    if t == 'integer': return type(v) is int
    if t in ('string', 'boolean', 'array', 'object') and type(v) is not {'string': str, 'boolean': bool, 'array': list, 'object': dict}[t]: return False
    if t == 'array': return len(v) <= s.get('maxItems', len(v)) and all(schema_valid(s['items'], x) for x in v)
    if t == 'object': return set(s.get('required', [])) <= set(v) and list(v) == [k for k in props if k in v] and all(schema_valid(props[k], v[k]) for k in v)
    return True
mode, path, expr = sys.argv[1:4]
try:
    d = sse(path) if mode.startswith('sse') else (load(path) if path != '-' else None)
    v = eval(expr)
except Exception as e:
    sys.stderr.write('q: %s: %s\n' % (type(e).__name__, e))
    sys.exit(1)
if mode.endswith('raw') and isinstance(v, str):
    sys.stdout.write(v)
else:
    sys.stdout.write(json.dumps(v, sort_keys=True))
PY
q() { python3 "$tmp/q.py" "$@" 2>>"$tmp/q.err"; }
# qt FILE EXPR: true when EXPR is true on FILE's JSON
qt() { [ "$(q json "$1" "bool($2)")" = true ]; }
# errbody NAME: the start of a response body, for failure messages
errbody() { head -c 300 "$tmp/$1.body" 2>/dev/null | tr '\n' ' '; }

# start_server LOG ARGS...: starts coli serve (on $SERVE_MODEL, default $M) in the background; sets spid and sport
start_server() {
    local log=$1 i
    shift
    spid=""
    sport=""
    HEAT_FILE="$tmp/$log.heat" "$COLI" serve -m "${SERVE_MODEL:-$M}" "$@" >"$tmp/$log.out" 2>"$tmp/$log.err" </dev/null &
    spid=$!
    srv_pids="$srv_pids $spid"
    for i in $(seq 300); do
        sport=$(sed -n 's|^\[serve\] listening on http://127\.0\.0\.1:\([0-9][0-9]*\).*|\1|p' "$tmp/$log.err" | head -n 1)
        [ -n "$sport" ] && break
        kill -0 "$spid" 2>/dev/null || break
        sleep 0.1
    done
    [ -n "$sport" ] || return 1
    for i in $(seq 300); do
        [ "$(curl -s --max-time 2 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$sport/health")" = 200 ] && return 0
        kill -0 "$spid" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}
# stop_server PID: SIGTERM, wait at most 10 s (then SIGKILL); sets src (the exit status)
stop_server() {
    local p=$1 i
    kill -TERM "$p" 2>/dev/null
    for i in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$p" 2>/dev/null; then kill -KILL "$p" 2>/dev/null; fi
    src=0
    wait "$p" || src=$?
    srv_pids=$(echo "$srv_pids" | tr ' ' '\n' | grep -vx "$p" | tr '\n' ' ')
}

# http NAME METHOD PATH [CURL ARGS]: a request to $base; body in $tmp/NAME.body, headers in
# $tmp/NAME.hdr, status in $code (000 when curl failed)
http() {
    local name=$1 method=$2 path=$3
    shift 3
    code=$(curl -sS --max-time 30 -X "$method" -o "$tmp/$name.body" -D "$tmp/$name.hdr" -w '%{http_code}' \
        "$@" "$base$path" 2>"$tmp/$name.curl") || true
}
post() {
    local name=$1 path=$2 body=$3
    shift 3
    http "$name" POST "$path" -H 'Content-Type: application/json' --data-binary "$body" "$@"
}
chat_body() { # TEXT MAX_TOKENS [EXTRA JSON FIELDS]
    printf '{"model":"%s","messages":[{"role":"user","content":"%s"}],"max_tokens":%s,"temperature":0%s}' "$MODEL_ID" "$1" "$2" "${3:+,$3}"
}
comp_body() {
    printf '{"model":"%s","prompt":"%s","max_tokens":%s,"temperature":0%s}' "$MODEL_ID" "$1" "$2" "${3:+,$3}"
}
# header NAME FIELD: the value of a response header (the last response's block), lower-cased name
header() { tr -d '\r' <"$tmp/$1.hdr" | grep -i "^$2:" | tail -n 1 | sed 's/^[^:]*: *//'; }
# is_error NAME STATUS TYPE: the response is STATUS with the contract's error object of TYPE
is_error() {
    [ "$code" = "$2" ] && qt "$tmp/$1.body" "set(d['error']) >= {'message','type','param','code'} and d['error']['type'] == '$3' and isinstance(d['error']['message'], str)"
}
# client LABEL OUT CMD...: runs a client script; its `ok - ` and `FAIL - ` lines (kept in OUT) join the counts, and a
# script that prints no ok line, or fails without saying what, is a failure of LABEL
client() {
    local label=$1 out=$2 rc=0 np nf
    shift 2
    "$@" >"$out" 2>&1 || rc=$?
    np=$(grep -c '^ok - ' "$out")
    nf=$(grep -c '^FAIL - ' "$out")
    grep -E '^(ok|FAIL) - ' "$out"
    pass=$((pass + np))
    fail=$((fail + nf))
    if [ "$np" = 0 ] || { [ "$rc" != 0 ] && [ "$nf" = 0 ]; }; then bad "$label" "exit $rc: $(tail -n 5 "$out" | tr '\n' ' ' | head -c 400)"; fi
}
# raw NAME DATA: DATA sent as is over one connection; what came back until the server closed it
# (at most 5 s) in $tmp/NAME.raw, and whether it closed (rawclosed=yes: EOF, or a reset when
# unread request bytes were left) or was still open after 5 s (no)
raw() {
    local name=$1 data=$2 rc=0
    : >"$tmp/$name.raw"
    (
        exec 3<>"/dev/tcp/127.0.0.1/$port" || exit 2
        printf '%s' "$data" >&3
        timeout 5 cat <&3 >"$tmp/$name.raw"
    ) 2>/dev/null || rc=$?
    rawclosed=yes
    [ "$rc" = 124 ] && rawclosed=no
    [ "$rc" = 2 ] && rawclosed="no connection"
    rawstatus=$(head -n 1 "$tmp/$name.raw" | tr -d '\r')
}

# References from `coli run`: chat (one user message) and raw completions, greedy
A="Hello"
B="Tell me a story"
R="The capital of France is"
ref() { # OUT ARGS...
    local out=$1
    shift
    "$COLI" run -m "$M" "$@" --json -t 1 2>"$tmp/$out.err" </dev/null | tail -n 1 >"$tmp/$out.json"
}
# the server runs with --no-think, so that a chat answer is all content, as run --chat --no-think
ref refA16 --chat --no-think -p "$A" -n 16
ref refA5 --chat --no-think -p "$A" -n 5
ref refA64 --chat --no-think -p "$A" -n 64
ref refB64 --chat --no-think -p "$B" -n 64
ref refT16 --chat -p "$A" -n 16
ref refR16 -p "$R" -n 16
for r in refA16 refA5 refA64 refB64 refT16 refR16; do
    if ! q raw "$tmp/$r.json" 'greedy(path)' >"$tmp/$r.txt"; then
        bad "coli run reference $r" "$(head -c 300 "$tmp/$r.err")"
        finish
    fi
    if [ "$r" = refR16 ]; then q json "$tmp/$r.json" 'greedy(path)' >"$tmp/$r.jstr"; else q json "$tmp/$r.json" 'content(path)' >"$tmp/$r.jstr"; fi
done

start_server serve --port 0 --parallel 2 -c 256 -t 1 --no-think || {
    bad "serve starts: listening line and /health 200 within 30 s" "$(head -c 600 "$tmp/serve.err")"
    finish
}
pid=$spid
port=$sport
base=http://127.0.0.1:$port
ok "serve starts on --port 0 (port $port), /health 200"
if grep -q 'fit in memory: copied there (where memory holds them once, as a server or --copy-experts asks)' "$tmp/serve.err"; then
    ok "serve copies the experts into its memory by the server's rule (where memory holds them once)"
else bad "serve's experts" "$(grep '^\[experts\]' "$tmp/serve.err" | head -c 300)"; fi

# a client that sends half a header block and then nothing: closed by the 10 s header deadline
# (runs in the background while the rest goes on; checked near the end)
(
    exec 3<>"/dev/tcp/127.0.0.1/$port" || exit 2
    printf 'GET /health HTTP/1.1\r\nHost: x\r\n' >&3
    t0=$(date +%s%N)
    rc=0
    timeout 20 cat <&3 >"$tmp/slow.raw" 2>/dev/null || rc=$?
    echo "$rc $((($(date +%s%N) - t0) / 1000000))" >"$tmp/slow.res"
) 2>/dev/null &
slow_pid=$!

# --- the simple endpoints
http health GET /health
if [ "$code" = 200 ] && qt "$tmp/health.body" "d['status'] == 'ok'"; then ok "GET /health: 200 {\"status\":\"ok\"}"; else bad "GET /health" "$code $(errbody health)"; fi
http root GET /
if [ "$code" = 200 ] && [ "$(header root content-type)" = text/plain ] && grep -q '^coli is running' "$tmp/root.body"; then
    ok "GET /: 200, a line saying coli is running and where the APIs are"
else bad "GET /" "$code $(errbody root)"; fi
head_reply=$(python3 -c '
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
s.sendall(b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
got = b""
while True:
    b = s.recv(4096)
    if not b: break
    got += b
head, _, rest = got.partition(b"\r\n\r\n")
length = [l.split(b":")[1].strip().decode() for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")]
print(head.split(b"\r\n")[0].decode(), length[0] if length else "none", len(rest))' "$port" 2>&1)
if [ "$head_reply" = "HTTP/1.1 200 OK $(wc -c <"$tmp/health.body" | tr -d ' ') 0" ]; then
    ok "HEAD /health: 200, GET's Content-Length, no body bytes"
else bad "HEAD /health" "$head_reply"; fi
code=$(curl -sS --max-time 10 -I -o "$tmp/e_head.hdr" -w '%{http_code}' "$base/v1/chat/completions" 2>/dev/null) || true
if [ "$code" = 405 ] && [ "$(header e_head allow)" = "POST, OPTIONS" ]; then ok "HEAD /v1/chat/completions: 405, Allow: POST, OPTIONS"; else bad "HEAD on a POST endpoint" "$code $(header e_head allow)"; fi
http models GET /v1/models
if [ "$code" = 200 ] && qt "$tmp/models.body" "d['object'] == 'list' and any(m['id'] == '$MODEL_ID' and m['object'] == 'model' and m['owned_by'] == 'coli' and isinstance(m['created'], int) and m['type'] == 'model' and m['display_name'] == m['id'] and __import__('datetime').datetime.fromisoformat(m['created_at'].replace('Z', '+00:00')).timestamp() == m['created'] for m in d['data']) and d['has_more'] is False and d['first_id'] == d['last_id'] == '$MODEL_ID'"; then
    ok "GET /v1/models lists $MODEL_ID (OpenAI's members, and Anthropic's: type, display_name, created_at the same time)"
else bad "GET /v1/models" "$code $(errbody models)"; fi
http model1 GET "/v1/models/$(python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))' "$MODEL_ID")"
if [ "$code" = 200 ] && qt "$tmp/model1.body" "d == json.load(open('$tmp/models.body'))['data'][0]"; then
    ok "GET /v1/models/$MODEL_ID (percent-encoded): the list's model object"
else bad "GET /v1/models/ID" "$code $(errbody model1)"; fi
http model2 GET /v1/models/gpt-4o
if is_error model2 404 invalid_request_error && qt "$tmp/model2.body" "d['error']['code'] == 'model_not_found' and '$MODEL_ID' in d['error']['message']"; then
    ok "GET /v1/models/gpt-4o: 404 model_not_found naming the model served"
else bad "GET /v1/models/other" "$code $(errbody model2)"; fi
http metrics GET /metrics
if [ "$code" = 200 ] && header metrics content-type | grep -q '^text/plain' && grep -q '^coli_requests_total' "$tmp/metrics.body" &&
    grep -qE '^coli_slots_total 2(\.0*)?$' "$tmp/metrics.body"; then
    ok "GET /metrics: text/plain, coli_requests_total, coli_slots_total 2"
else bad "GET /metrics" "$code $(header metrics content-type) $(grep -E 'coli_(requests|slots)_total' "$tmp/metrics.body" | head -n 4 | tr '\n' ' ')"; fi
missing=""
for m in coli_prompt_tokens_total coli_generated_tokens_total coli_prompt_tokens_per_second coli_decode_tokens_per_second \
    coli_queue_length coli_slots_busy coli_expert_hit_rate coli_expert_vram_rate coli_resident_bytes coli_vram_used_bytes; do
    grep -q "^$m" "$tmp/metrics.body" || missing="$missing $m"
done
# one sample per GPU device: without one, the family is only declared
if [ "$missing" = " coli_vram_used_bytes" ] && grep -q '^# TYPE coli_vram_used_bytes gauge' "$tmp/metrics.body"; then missing=""; fi
if [ -z "$missing" ]; then ok "GET /metrics has every metric of the contract"; else bad "GET /metrics" "missing:$missing"; fi

# --- non-streaming chat, greedy = coli run --chat
post chatA /v1/chat/completions "$(chat_body "$A" 16)"
if [ "$code" = 200 ] && qt "$tmp/chatA.body" "d['object'] == 'chat.completion' and d['id'].startswith('chatcmpl-') and isinstance(d['created'], int) and d['model'] == '$MODEL_ID' and d['choices'][0]['index'] == 0 and d['choices'][0]['message']['role'] == 'assistant' and isinstance(d['choices'][0]['message']['content'], str) and d['choices'][0]['finish_reason'] in ('stop', 'length')"; then
    ok "chat completion: object, id, model, choices[0].message, finish_reason"
else bad "chat completion shape" "$code $(errbody chatA)"; fi
if qt "$tmp/chatA.body" "d['usage']['prompt_tokens'] > 0 and d['usage']['prompt_tokens'] + d['usage']['completion_tokens'] == d['usage']['total_tokens']"; then
    ok "chat completion: usage prompt + completion = total"
else bad "chat usage" "$(q json "$tmp/chatA.body" "d.get('usage')")"; fi
got=$(q json "$tmp/chatA.body" "d['choices'][0]['message']['content']")
if [ -n "$got" ] && [ "$got" = "$(cat "$tmp/refA16.jstr")" ]; then
    ok "chat greedy content = coli run --chat text (16 tokens)"
else bad "chat greedy content" "got $got, run gives $(cat "$tmp/refA16.jstr")"; fi
# the same prompt tokens and count as run; finish_reason as run's stop
want_fr=$(q raw "$tmp/refA16.json" "'length' if d['stop'] == 'length' else 'stop'")
if qt "$tmp/chatA.body" "d['usage']['prompt_tokens'] == len(load('$tmp/refA16.json')['prompt_tokens']) and d['usage']['completion_tokens'] == len(load('$tmp/refA16.json')['tokens']) - (1 if load('$tmp/refA16.json')['stop'] == 'eog' else 0) and d['choices'][0]['finish_reason'] == '$want_fr'"; then
    ok "chat usage and finish_reason match coli run's prompt tokens, tokens and stop"
else bad "chat usage vs run" "$(q json "$tmp/chatA.body" "[d.get('usage'), d['choices'][0].get('finish_reason')]") run: $(q json "$tmp/refA16.json" "[len(d['prompt_tokens']), len(d['tokens']), d['stop']]")"; fi

# --- raw completions, greedy = coli run -p
post compR /v1/completions "$(comp_body "$R" 16)"
if [ "$code" = 200 ] && qt "$tmp/compR.body" "d['object'] == 'text_completion' and d['id'].startswith('cmpl-') and d['model'] == '$MODEL_ID' and d['choices'][0]['index'] == 0 and d['choices'][0]['finish_reason'] in ('stop', 'length') and d['usage']['prompt_tokens'] + d['usage']['completion_tokens'] == d['usage']['total_tokens']"; then
    ok "completion: object text_completion, id, choices[0].text, usage"
else bad "completion shape" "$code $(errbody compR)"; fi
got=$(q json "$tmp/compR.body" "d['choices'][0]['text']")
if [ -n "$got" ] && [ "$got" = "$(cat "$tmp/refR16.jstr")" ] &&
    qt "$tmp/compR.body" "d['usage']['prompt_tokens'] == len(load('$tmp/refR16.json')['prompt_tokens'])"; then
    ok "completion greedy text = coli run -p text (16 tokens), same prompt tokens"
else bad "completion greedy text" "got $got $(q json "$tmp/compR.body" "d.get('usage')"), run gives $(cat "$tmp/refR16.jstr")"; fi

# --- streaming chat
post streamA /v1/chat/completions "$(chat_body "$A" 16 '"stream":true,"stream_options":{"include_usage":true}')" -N
q sse "$tmp/streamA.body" 'd' >"$tmp/streamA.sum" || echo '{}' >"$tmp/streamA.sum"
ctype=$(header streamA content-type)
if [ "$code" = 200 ] && echo "$ctype" | grep -q '^text/event-stream' && header streamA transfer-encoding | grep -qi chunked; then
    ok "stream: 200, Content-Type text/event-stream, Transfer-Encoding chunked"
else bad "stream headers" "$code content-type '$ctype' transfer-encoding '$(header streamA transfer-encoding)'"; fi
if qt "$tmp/streamA.sum" "not d['problems'] and d['objects'] == ['chat.completion.chunk'] and len(d['ids']) == 1 and d['ids'][0].startswith('chatcmpl-')"; then
    ok "stream: every event one 'data: {json}' line, chat.completion.chunk, one id"
else bad "stream events" "$(q json "$tmp/streamA.sum" "[d['problems'][:3], d['objects'], d['ids']]")"; fi
if qt "$tmp/streamA.sum" "d['first_role'] == 'assistant'"; then ok "stream: the first delta has role assistant"; else bad "stream first delta" "$(head -c 300 "$tmp/streamA.body")"; fi
got=$(q json "$tmp/streamA.sum" "d['content']")
if [ -n "$got" ] && [ "$got" = "$(cat "$tmp/refA16.jstr")" ]; then
    ok "stream: the content deltas add up to the non-stream content"
else bad "stream content" "got $got, want $(cat "$tmp/refA16.jstr")"; fi
if qt "$tmp/streamA.sum" "d['finish'][-1] == '$want_fr' and all(f is None for f in d['finish'][:-1]) and not (d['last_delta'] or {}).get('content')"; then
    ok "stream: finish_reason $want_fr on the last choice chunk only, its delta empty"
else bad "stream finish_reason" "$(q json "$tmp/streamA.sum" "[d['finish'], d['last_delta']]")"; fi
if qt "$tmp/streamA.sum" "d['usage_last'] and len(d['usage']) == 1 and all(d['usage'][0][k] == load('$tmp/chatA.body')['usage'][k] for k in ('prompt_tokens', 'completion_tokens', 'total_tokens'))"; then
    ok "stream: include_usage gives a last chunk with choices [] and the usage of the non-stream answer"
else bad "stream usage chunk" "$(q json "$tmp/streamA.sum" "d['usage']") vs $(q json "$tmp/chatA.body" "d.get('usage')")"; fi
if qt "$tmp/streamA.sum" "d['done_last'] and d['ends_with_done']"; then ok "stream: data: [DONE] last"; else bad "stream [DONE]" "$(tail -c 200 "$tmp/streamA.body")"; fi
post streamA2 /v1/chat/completions "$(chat_body "$A" 16 '"stream":true')" -N
q sse "$tmp/streamA2.body" 'd' >"$tmp/streamA2.sum" || echo '{}' >"$tmp/streamA2.sum"
if [ "$code" = 200 ] && qt "$tmp/streamA2.sum" "not d['usage'] and d['done_last'] and d['content'] == load('$tmp/chatA.body')['choices'][0]['message']['content']"; then
    ok "stream without include_usage: no usage chunk, same content"
else bad "stream without include_usage" "$code $(q json "$tmp/streamA2.sum" "[d['usage'], d['done_last']]")"; fi
# streaming completions
post streamR /v1/completions "$(comp_body "$R" 16 '"stream":true')" -N
q sse "$tmp/streamR.body" 'd' >"$tmp/streamR.sum" || echo '{}' >"$tmp/streamR.sum"
got=$(q json "$tmp/streamR.sum" "d['text']")
if [ "$code" = 200 ] && qt "$tmp/streamR.sum" "not d['problems'] and d['objects'] == ['text_completion'] and d['done_last'] and d['finish'][-1] in ('stop', 'length')" &&
    [ "$got" = "$(cat "$tmp/refR16.jstr")" ]; then
    ok "stream completions: text_completion chunks add up to coli run -p text"
else bad "stream completions" "$code got $got want $(cat "$tmp/refR16.jstr") $(q json "$tmp/streamR.sum" "[d['problems'][:2], d['objects'], d['finish'][-1:]]")"; fi

# --- max_tokens
for field in max_tokens max_completion_tokens; do
    post max5 /v1/chat/completions "$(printf '{"messages":[{"role":"user","content":"%s"}],"%s":5,"temperature":0}' "$A" "$field")"
    if [ "$code" = 200 ] && qt "$tmp/max5.body" "(d['choices'][0]['finish_reason'] == 'length' and d['usage']['completion_tokens'] == 5) or (d['choices'][0]['finish_reason'] == 'stop' and d['usage']['completion_tokens'] < 5)" &&
        [ "$(q json "$tmp/max5.body" "d['choices'][0]['message']['content']")" = "$(cat "$tmp/refA5.jstr")" ]; then
        ok "$field 5: finish_reason length, completion_tokens 5, the greedy text of run -n 5"
    else bad "$field 5" "$code $(q json "$tmp/max5.body" "[d['choices'][0]['finish_reason'], d['usage'], d['choices'][0]['message']['content']]") want $(cat "$tmp/refA5.jstr")"; fi
done

# --- stop strings: cut right before the first occurrence in the known greedy text
S1=$(q raw "$tmp/chatA.body" "pick_stop(d['choices'][0]['message']['content'], 0.3, 3, '[A-Za-z0-9]{3}')")
S2=$(q raw "$tmp/chatA.body" "pick_stop(d['choices'][0]['message']['content'], 0.5, 5, '[ -!#-\\\\[\\\\]-~]{5}')")
if [ -z "$S1" ] || [ -z "$S2" ]; then
    bad "stop strings" "no usable stop string in the greedy text $(cat "$tmp/refA16.jstr")"
else
    for case in "string:\"$S1\"" "array:[\"zzQQzzQQ\",\"$S1\"]" "array:[\"$S2\"]"; do
        stopv=${case#*:}
        s=$S1
        [ "$stopv" = "[\"$S2\"]" ] && s=$S2
        want=$(STOP="$s" q json "$tmp/chatA.body" "d['choices'][0]['message']['content'].split(E['STOP'])[0]")
        post stop /v1/chat/completions "$(chat_body "$A" 16 "\"stop\":$stopv")"
        got=$(q json "$tmp/stop.body" "d['choices'][0]['message']['content']")
        if [ "$code" = 200 ] && [ "$got" = "$want" ] && qt "$tmp/stop.body" "d['choices'][0]['finish_reason'] == 'stop'"; then
            ok "stop $stopv: text cut before it, finish_reason stop"
        else bad "stop $stopv" "$code got $got want $want finish $(q json "$tmp/stop.body" "d['choices'][0]['finish_reason']")"; fi
        post stopS /v1/chat/completions "$(chat_body "$A" 16 "\"stop\":$stopv,\"stream\":true")" -N
        q sse "$tmp/stopS.body" 'd' >"$tmp/stopS.sum" || echo '{}' >"$tmp/stopS.sum"
        got=$(q json "$tmp/stopS.sum" "d['content']")
        if [ "$code" = 200 ] && [ "$got" = "$want" ] && qt "$tmp/stopS.sum" "d['finish'][-1] == 'stop' and d['done_last']"; then
            ok "stop $stopv, streaming: the deltas add up to the cut text, finish_reason stop"
        else bad "stop $stopv streaming" "$code got $got want $want finish $(q json "$tmp/stopS.sum" "d['finish'][-1:]")"; fi
    done
    SR=$(q raw "$tmp/compR.body" "pick_stop(d['choices'][0]['text'], 0.4, 3, '[A-Za-z0-9]{3}')")
    post stopR /v1/completions "$(comp_body "$R" 16 "\"stop\":[\"$SR\"]")"
    want=$(STOP="$SR" q json "$tmp/compR.body" "d['choices'][0]['text'].split(E['STOP'])[0]")
    got=$(q json "$tmp/stopR.body" "d['choices'][0]['text']")
    if [ "$code" = 200 ] && [ "$got" = "$want" ] && qt "$tmp/stopR.body" "d['choices'][0]['finish_reason'] == 'stop'"; then
        ok "stop on /v1/completions"
    else bad "stop on /v1/completions" "$code got $got want $want"; fi
fi

# --- parallel: two slots, then four requests on two slots (two wait in the queue)
par() { # NAME TEXT N [stream]
    local extra=""
    [ "${4:-}" = stream ] && extra='"stream":true'
    curl -sS --max-time 30 -o "$tmp/$1.body" -H 'Content-Type: application/json' --data-binary "$(chat_body "$2" "$3" "$extra")" \
        "$base/v1/chat/completions" 2>"$tmp/$1.curl"
}
par par1 "$A" 64 & p1=$!
par par2 "$B" 64 & p2=$!
wait $p1; wait $p2
g1=$(q json "$tmp/par1.body" "d['choices'][0]['message']['content']")
g2=$(q json "$tmp/par2.body" "d['choices'][0]['message']['content']")
if [ -n "$g1" ] && [ "$g1" = "$(cat "$tmp/refA64.jstr")" ] && [ "$g2" = "$(cat "$tmp/refB64.jstr")" ]; then
    ok "two requests in parallel: each the greedy text of its own (64 tokens)"
else bad "two requests in parallel" "1: $(echo "$g1" | head -c 120) want $(head -c 120 "$tmp/refA64.jstr"); 2: $(echo "$g2" | head -c 120) want $(head -c 120 "$tmp/refB64.jstr")"; fi
par par3 "$A" 64 & p1=$!
par par4 "$B" 64 stream & p2=$!
par par5 "$B" 64 & p3=$!
par par6 "$A" 64 stream & p4=$!
wait $p1; wait $p2; wait $p3; wait $p4
q sse "$tmp/par4.body" 'd' >"$tmp/par4.sum" || echo '{}' >"$tmp/par4.sum"
q sse "$tmp/par6.body" 'd' >"$tmp/par6.sum" || echo '{}' >"$tmp/par6.sum"
if [ "$(q json "$tmp/par3.body" "d['choices'][0]['message']['content']")" = "$(cat "$tmp/refA64.jstr")" ] &&
    [ "$(q json "$tmp/par4.sum" "d['content']")" = "$(cat "$tmp/refB64.jstr")" ] &&
    [ "$(q json "$tmp/par5.body" "d['choices'][0]['message']['content']")" = "$(cat "$tmp/refB64.jstr")" ] &&
    [ "$(q json "$tmp/par6.sum" "d['content']")" = "$(cat "$tmp/refA64.jstr")" ]; then
    ok "four requests (two streaming) on two slots: each its own greedy text"
else bad "four requests on two slots" "$(head -c 200 "$tmp/par3.body") | $(head -c 200 "$tmp/par5.body") | $(q json "$tmp/par4.sum" "d['content'][:60]") | $(q json "$tmp/par6.sum" "d['content'][:60]")"; fi

# --- sampling fields accepted (and unknown fields ignored)
post sample /v1/chat/completions "$(printf '{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"%s"},{"role":"assistant","content":"Hi."},{"role":"user","content":"%s"}],"max_tokens":8,"temperature":0.8,"top_p":0.9,"top_k":20,"min_p":0.05,"seed":7,"repeat_penalty":1.1,"presence_penalty":0.5,"frequency_penalty":0.5,"frobnicate":{"x":[1,2]},"n_probs":3}' "$A" "$B")"
if [ "$code" = 200 ] && qt "$tmp/sample.body" "d['usage']['completion_tokens'] <= 8 and isinstance(d['choices'][0]['message']['content'], str)"; then
    ok "sampling fields, system/assistant turns and unknown fields accepted"
else bad "sampling fields" "$code $(errbody sample)"; fi
post sample2 /v1/chat/completions "$(printf '{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"%s"},{"role":"assistant","content":"Hi."},{"role":"user","content":"%s"}],"max_tokens":8,"temperature":0.8,"top_p":0.9,"top_k":20,"min_p":0.05,"seed":7,"repeat_penalty":1.1,"presence_penalty":0.5,"frequency_penalty":0.5}' "$A" "$B")"
if [ "$code" = 200 ] && [ "$(q json "$tmp/sample2.body" "d['choices'][0]['message']['content']")" = "$(q json "$tmp/sample.body" "d['choices'][0]['message']['content']")" ]; then
    ok "the same seed gives the same sampled text"
else bad "same seed" "$code $(q json "$tmp/sample2.body" "d['choices'][0]['message']['content']") vs $(q json "$tmp/sample.body" "d['choices'][0]['message']['content']")"; fi

# --- logprobs (the model's own distribution: raw logits at temperature 1) and logit_bias
# against the reference's logit row of the golden case's first generated position (log-softmax
# by python3): a log-probability is off by at most twice a logit's tolerance
export GOLDEN
gj=$GOLDEN/$MODEL_ID.json
ids=$(q json "$gj" "d['cases'][0]['prompt_tokens']")
tol=$(q json "$gj" "2 * d['tolerance']['logit_abs']")
post lpRef /v1/completions "{\"prompt\":$ids,\"max_tokens\":1,\"temperature\":0,\"logprobs\":5}"
lsm="sorted(log_softmax(E['GOLDEN'] + '/' + load(E['GOLDEN'] + '/$MODEL_ID.json')['cases'][0]['logits_file']), reverse=True)"
if [ "$code" = 200 ] && qt "$tmp/lpRef.body" "(lambda lp, ref: len(lp['top_logprobs'][0]) == 5 and all(abs(a - b) <= $tol for a, b in zip(sorted(lp['top_logprobs'][0].values(), reverse=True), ref)) and abs(lp['token_logprobs'][0] - ref[0]) <= $tol)(d['choices'][0]['logprobs'], $lsm)"; then
    ok "completion logprobs 5: the token's and the 5 best log-probabilities = the reference's log-softmax within $tol"
else bad "logprobs vs the reference" "$code $(q json "$tmp/lpRef.body" "d['choices'][0].get('logprobs')" | head -c 300)"; fi
post lpA /v1/chat/completions "$(chat_body "$A" 16 '"logprobs":true,"top_logprobs":3')"
if [ "$code" = 200 ] && [ "$(q json "$tmp/lpA.body" "d['choices'][0]['message']['content']")" = "$(cat "$tmp/refA16.jstr")" ] &&
    qt "$tmp/lpA.body" "(lambda c: len(c) == d['usage']['completion_tokens'] - (d['choices'][0]['finish_reason'] == 'stop') and re.sub('\ufffd+', '?', bytes(b for t in c for b in t['bytes']).decode('utf-8', 'replace').strip()) == re.sub('\ufffd+', '?', d['choices'][0]['message']['content']) and all(len(t['top_logprobs']) == 3 and t['top_logprobs'][0]['token'] == t['token'] and t['top_logprobs'][0]['logprob'] == t['logprob'] and t['logprob'] <= 0 and sorted([a['logprob'] for a in t['top_logprobs']], reverse=True) == [a['logprob'] for a in t['top_logprobs']] for t in c))(d['choices'][0]['logprobs']['content'])"; then
    ok "chat logprobs: the greedy text unchanged, a token each (their bytes make the content), each the best of its 3"
else bad "chat logprobs" "$code $(errbody lpA)"; fi
post lpAs /v1/chat/completions "$(chat_body "$A" 16 '"logprobs":true,"top_logprobs":3,"stream":true')" -N
q sse "$tmp/lpAs.body" 'd' >"$tmp/lpAs.sum" || echo '{}' >"$tmp/lpAs.sum"
if [ "$code" = 200 ] && qt "$tmp/lpAs.sum" "d['logprobs'] == load('$tmp/lpA.body')['choices'][0]['logprobs']['content'] and d['content'] == load('$tmp/lpA.body')['choices'][0]['message']['content']"; then
    ok "stream chat logprobs: the chunks' entries = the whole answer's"
else bad "stream chat logprobs" "$code $(q json "$tmp/lpAs.sum" "[len(d['logprobs']), d['problems'][:2]]")"; fi
post lpR /v1/completions "$(comp_body "$R" 16 '"logprobs":2')"
post lpRs /v1/completions "$(comp_body "$R" 16 '"logprobs":2,"stream":true')" -N
q sse "$tmp/lpRs.body" 'd' >"$tmp/lpRs.sum" || echo '{}' >"$tmp/lpRs.sum"
if qt "$tmp/lpR.body" "(lambda lp: len(lp['tokens']) == 16 and ''.join(lp['tokens']) == d['choices'][0]['text'] == load('$tmp/refR16.json')['text'] and lp['text_offset'] == [sum(len(t) for t in lp['tokens'][:i]) for i in range(16)] and all(len(t) == 2 and max(t.values()) == v for t, v in zip(lp['top_logprobs'], lp['token_logprobs'])))(d['choices'][0]['logprobs'])" &&
    qt "$tmp/lpRs.sum" "d['legacy'] == load('$tmp/lpR.body')['choices'][0]['logprobs']"; then
    ok "completion logprobs 2: tokens make the text, offsets, the best of 2 each; streamed the same"
else bad "completion logprobs" "$(q json "$tmp/lpR.body" "d['choices'][0].get('logprobs')" | head -c 300) stream: $(q json "$tmp/lpRs.sum" "d['legacy']" | head -c 200)"; fi
# a bias of -100 on the greedy first token: the runner-up comes, with its raw log-probability
t0=$(q json "$tmp/refR16.json" "d['tokens'][0]")
post lpBias /v1/completions "$(comp_body "$R" 1 "\"logprobs\":2,\"logit_bias\":{\"$t0\":-100}")"
if [ "$code" = 200 ] && qt "$tmp/lpBias.body" "(lambda lp, base: lp['tokens'][0] != base['tokens'][0] and {lp['tokens'][0]: lp['token_logprobs'][0]}.items() <= base['top_logprobs'][0].items())(d['choices'][0]['logprobs'], load('$tmp/lpR.body')['choices'][0]['logprobs'])"; then
    ok "logit_bias -100 on the greedy token: the runner-up, its log-probability unbiased"
else bad "logit_bias -100" "$code $(errbody lpBias)"; fi
post lpBias2 /v1/completions "$(comp_body "$R" 4 '"logprobs":0,"logit_bias":{"1000":100}')"
if [ "$code" = 200 ] && qt "$tmp/lpBias2.body" "(lambda lp: len(set(lp['tokens'])) == 1 and len(lp['tokens']) == 4 and all(v < -1 for v in lp['token_logprobs']))(d['choices'][0]['logprobs'])"; then
    ok "logit_bias +100 on one token: it every time, its log-probability the model's"
else bad "logit_bias +100" "$code $(errbody lpBias2)"; fi
# /tokenize: coli tokenize's ids; pieces that make the text (ASCII: a piece of part of a character shows U+FFFD);
# /detokenize of the ids the text; bad bodies 400
T="Hello <|im_start|> wörld"
"$COLI" tokenize -m "$M" -p "$T" 2>/dev/null | tr '\n' ' ' >"$tmp/tokids"
post tokA /tokenize "{\"content\":\"$T\"}"
post tokP /tokenize "{\"content\":\"${T/ö/o}\",\"with_pieces\":true,\"parse_special\":false}"
post detok /detokenize "{\"tokens\":$(q json "$tmp/tokA.body" "d['tokens']")}"
if [ "$code" = 200 ] && qt "$tmp/tokA.body" "d['tokens'] == [int(x) for x in open('$tmp/tokids').read().split()] and len(d['tokens']) > 3" &&
    qt "$tmp/tokP.body" "''.join(t['piece'] for t in d['tokens']) == '${T/ö/o}' and len(d['tokens']) > len(load('$tmp/tokA.body')['tokens'])" &&
    qt "$tmp/detok.body" "d['content'] == '$T'"; then
    ok "/tokenize: coli tokenize's ids (special-token text parsed, or not: more pieces); /detokenize: the text back"
else bad "/tokenize, /detokenize" "$(errbody tokA) / $(errbody tokP) / $(errbody detok)"; fi
for e in 'content:/tokenize:{"content":5}' 'with_pieces:/tokenize:{"content":"a","with_pieces":"y"}' 'tokens:/detokenize:{"tokens":[1,-1]}' \
         'tokens:/detokenize:{"tokens":[1e9]}' 'tokens:/detokenize:{"tokens":"12"}'; do
    p=${e#*:}
    post e_tok "${p%%:*}" "${p#*:}"
    if is_error e_tok 400 invalid_request_error && qt "$tmp/e_tok.body" "d['error']['param'] == '${e%%:*}'"; then ok "${p%%:*} ${p#*:}: 400, error.param ${e%%:*}"
    else bad "${p%%:*} ${p#*:}" "$code $(errbody e_tok)"; fi
done
# ignore_eos: a greedy chat that ends at its end-of-generation token before 120 goes on to max_tokens
post eogA /v1/chat/completions "$(chat_body Hi 120 '"chat_template_kwargs":{"enable_thinking":false}')"
post eogB /v1/chat/completions "$(chat_body Hi 120 '"chat_template_kwargs":{"enable_thinking":false},"ignore_eos":true')"
if qt "$tmp/eogA.body" "d['choices'][0]['finish_reason'] == 'stop' and d['usage']['completion_tokens'] < 120" &&
    qt "$tmp/eogB.body" "d['choices'][0]['finish_reason'] == 'length' and d['usage']['completion_tokens'] == 120"; then
    ok "ignore_eos: generation goes on through the end-of-generation token to max_tokens"
else bad "ignore_eos" "$(errbody eogA) / $(errbody eogB)"; fi
for e in 'ignore_eos:"ignore_eos":"y"' 'parallel_tool_calls:"parallel_tool_calls":"x"' 'top_logprobs:"top_logprobs":21' 'top_logprobs:"top_logprobs":2' 'logit_bias:"logit_bias":{"x":1}' 'logit_bias:"logit_bias":{"5":101}' 'logit_bias:"logit_bias":[1]'; do
    post e_lp /v1/chat/completions "$(chat_body "$A" 4 "${e#*:}")"
    if is_error e_lp 400 invalid_request_error && qt "$tmp/e_lp.body" "d['error']['param'] == '${e%%:*}'"; then ok "${e#*:}: 400, error.param ${e%%:*}"; else bad "${e#*:}" "$code $(errbody e_lp)"; fi
done
for e in 'echo:"echo":true' 'best_of:"best_of":2' 'suffix:"suffix":"x"' 'logprobs:"logprobs":21'; do
    post e_lp /v1/completions "$(comp_body "$R" 4 "${e#*:}")"
    if is_error e_lp 400 invalid_request_error && qt "$tmp/e_lp.body" "d['error']['param'] == '${e%%:*}'"; then ok "completion ${e#*:}: 400, error.param ${e%%:*}"; else bad "completion ${e#*:}" "$code $(errbody e_lp)"; fi
done
# response_format json_object: sampled answers (closers favoured, so that they close) are JSON objects
closers=$(printf '{"%s":4,"%s":4,"%s":3,"%s":3}' $(for t in '"' '}' ':' '1'; do "$COLI" tokenize -m "$M" -p "$t" 2>/dev/null; done))
jbad=
for seed in 1 2 3 4 5 6; do
    post jsonR /v1/completions "$(comp_body "$R" 120 "\"temperature\":1,\"seed\":$seed,\"response_format\":{\"type\":\"json_object\"},\"logit_bias\":$closers")"
    qt "$tmp/jsonR.body" "d['choices'][0]['finish_reason'] == 'stop' and isinstance(json.loads(d['choices'][0]['text']), dict)" || jbad="$jbad seed $seed: $(errbody jsonR)"
done
if [ -z "$jbad" ]; then ok "json_object completions, 6 seeds: each a JSON object (python's json.loads), ended where it closed"; else bad "json_object completions" "$jbad"; fi
post jsonC /v1/chat/completions "$(chat_body "$A" 120 "\"response_format\":{\"type\":\"json_object\"},\"logit_bias\":$closers")"
if [ "$code" = 200 ] && qt "$tmp/jsonC.body" "d['choices'][0]['finish_reason'] == 'stop' and isinstance(json.loads(d['choices'][0]['message']['content']), dict)"; then
    ok "json_object chat: the content a JSON object"
else bad "json_object chat" "$code $(errbody jsonC)"; fi
tools='"tools":[{"type":"function","function":{"name":"get_time","description":"The time","parameters":{"type":"object","properties":{}}}}]'
# response_format json_schema: sampled answers valid under the schema by python's own check (types, enum, required,
# no other keys, the schema's order, maxItems); what coli does not follow refused, naming it
schema='{"type":"object","properties":{"name":{"type":"string"},"n":{"type":"integer"},"c":{"enum":["red","blue"]},"t":{"type":"array","items":{"type":"boolean"},"maxItems":2}},"required":["n","c"],"additionalProperties":false}'
printf '%s' "$schema" >"$tmp/schema.json"
sclosers=$(printf '{"%s":3,"%s":3}' $(for t in '"' '}'; do "$COLI" tokenize -m "$M" -p "$t" 2>/dev/null; done))
sbad=
for seed in 1 2 3 4 5 6; do
    post jsonS /v1/completions "$(comp_body "$R" 400 "\"temperature\":1,\"seed\":$seed,\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"strict\":true,\"schema\":$schema}},\"logit_bias\":$sclosers")"
    qt "$tmp/jsonS.body" "d['choices'][0]['finish_reason'] == 'stop' and schema_valid(load('$tmp/schema.json'), json.loads(d['choices'][0]['text']))" ||
        sbad="$sbad seed $seed: $(errbody jsonS)"
done
if [ -z "$sbad" ]; then ok "json_schema completions, 6 seeds: each valid under the schema (python's check), ended where it closed"; else bad "json_schema completions" "$sbad"; fi
for e in 'minLength:{"type":"object","properties":{"a":{"type":"string","minLength":2}}}' 'root must be an object:{"type":"string"}' \
         'both admit:{"type":"object","properties":{"a":{"anyOf":[{"type":"integer"},{"type":"number"}]}}}' 'needs its schema:'; do
    post e_lp /v1/chat/completions "$(chat_body "$A" 4 "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\"${e#*:}}}" | sed 's/"x"{/"x","schema":{/')"
    if is_error e_lp 400 invalid_request_error && qt "$tmp/e_lp.body" "d['error']['param'] == 'response_format' and '${e%%:*}' in d['error']['message']"; then
        ok "json_schema refused: 400 saying '${e%%:*}'"
    else bad "json_schema refused (${e%%:*})" "$code $(errbody e_lp)"; fi
done
# tool_choice: "none" renders no tools (the model answers in text); a forced call with no tools, or an unknown value, refused
post tcTools /apply-template "$(chat_body "$A" 4 "$tools")"
post tcNone /apply-template "$(chat_body "$A" 4 "$tools,\"tool_choice\":\"none\"")"
post tcPlain /apply-template "$(chat_body "$A" 4)"
if [ "$code" = 200 ] && qt "$tmp/tcNone.body" "d['prompt'] == load('$tmp/tcPlain.body')['prompt'] != load('$tmp/tcTools.body')['prompt'] and 'get_time' in load('$tmp/tcTools.body')['prompt']"; then
    ok "tool_choice none: the prompt without the tools"
else bad "tool_choice none" "$code $(errbody tcNone)"; fi
post e_lp /v1/chat/completions "$(chat_body "$A" 4 '"tool_choice":"required"')"
if is_error e_lp 400 invalid_request_error && qt "$tmp/e_lp.body" "d['error']['param'] == 'tool_choice' and 'needs' in d['error']['message']"; then ok "tool_choice required without tools: 400, error.param tool_choice"; else bad "tool_choice required without tools" "$code $(errbody e_lp)"; fi
post e_lp /v1/chat/completions "$(chat_body "$A" 4 '"tool_choice":"sometimes"')"
if is_error e_lp 400 invalid_request_error && qt "$tmp/e_lp.body" "d['error']['param'] == 'tool_choice'"; then ok "tool_choice sometimes: 400, error.param tool_choice"; else bad "tool_choice sometimes" "$code $(errbody e_lp)"; fi
post e_lp /v1/completions '{"prompt":["a","b"],"max_tokens":4}'
if is_error e_lp 400 invalid_request_error && qt "$tmp/e_lp.body" "d['error']['param'] == 'prompt' and 'one prompt a request' in d['error']['message']"; then
    ok "completion of two prompts: 400, one prompt a request"
else bad "completion of two prompts" "$code $(errbody e_lp)"; fi

# --- errors
post e_json /v1/chat/completions '{"messages":[{"role":"user","content":"hi"}'
if is_error e_json 400 invalid_request_error; then ok "bad JSON: 400 invalid_request_error"; else bad "bad JSON" "$code $(errbody e_json)"; fi
post e_type /v1/chat/completions "$(chat_body "$A" '"x"')"
if is_error e_type 400 invalid_request_error && qt "$tmp/e_type.body" "d['error']['param'] == 'max_tokens'"; then ok "\"max_tokens\":\"x\": 400, error.param max_tokens"; else bad "max_tokens wrong type" "$code $(errbody e_type)"; fi
post e_type2 /v1/chat/completions "$(printf '{"messages":[{"role":"user","content":"%s"}],"max_tokens":4,"temperature":"hot"}' "$A")"
if is_error e_type2 400 invalid_request_error && qt "$tmp/e_type2.body" "d['error']['param'] == 'temperature'"; then ok "\"temperature\":\"hot\": 400, error.param temperature"; else bad "temperature wrong type" "$code $(errbody e_type2)"; fi
post e_type3 /v1/chat/completions "$(chat_body "$A" 4 '"stream":"yes"')"
if is_error e_type3 400 invalid_request_error && qt "$tmp/e_type3.body" "d['error']['param'] == 'stream'"; then ok "\"stream\":\"yes\": 400, error.param stream"; else bad "stream wrong type" "$code $(errbody e_type3)"; fi
post e_nomsg /v1/chat/completions '{"max_tokens":4}'
if is_error e_nomsg 400 invalid_request_error; then ok "chat without messages: 400"; else bad "chat without messages" "$code $(errbody e_nomsg)"; fi
post e_noprompt /v1/completions '{"max_tokens":4}'
if is_error e_noprompt 400 invalid_request_error; then ok "completion without prompt: 400"; else bad "completion without prompt" "$code $(errbody e_noprompt)"; fi
post e_stop5 /v1/chat/completions "$(chat_body "$A" 4 '"stop":["a","b","c","d","e"]')"
if is_error e_stop5 400 invalid_request_error; then ok "five stop strings: 400"; else bad "five stop strings" "$code $(errbody e_stop5)"; fi
long=$(printf 'hello %.0s' $(seq 300))
ntok=$("$COLI" tokenize -m "$M" -p "$long" 2>/dev/null | wc -l)
post e_long /v1/completions "$(comp_body "$long" 4)"
if is_error e_long 400 invalid_request_error && qt "$tmp/e_long.body" "re.search(r'\\b$ntok\\b', d['error']['message']) and re.search(r'\\b256\\b', d['error']['message'])"; then
    ok "prompt longer than the context: 400 naming $ntok and 256"
else bad "prompt longer than the context" "$code $(errbody e_long) (want $ntok and 256)"; fi
ref refLong --chat --no-think -p "$long" -n 1 -c 4096
nchat=$(q json "$tmp/refLong.json" "len(d['prompt_tokens'])")
post e_longc /v1/chat/completions "$(chat_body "$long" 4)"
if is_error e_longc 400 invalid_request_error && qt "$tmp/e_longc.body" "re.search(r'\\b$nchat\\b', d['error']['message']) and re.search(r'\\b256\\b', d['error']['message'])"; then
    ok "chat prompt longer than the context: 400 naming $nchat and 256"
else bad "chat prompt longer than the context" "$code $(errbody e_longc) (want $nchat and 256)"; fi
http e_404 GET /v1/nope
if is_error e_404 404 not_found_error; then ok "unknown path: 404 not_found_error"; else bad "unknown path" "$code $(errbody e_404)"; fi
http e_405 GET /v1/chat/completions
if [ "$code" = 405 ] && [ "$(header e_405 allow)" = "POST, OPTIONS" ]; then ok "GET /v1/chat/completions: 405 with Allow: POST, OPTIONS"; else bad "wrong method" "$code Allow '$(header e_405 allow)' $(errbody e_405)"; fi
head -c $((8 * 1024 * 1024 + 1024)) /dev/zero | tr '\0' ' ' >"$tmp/big.json"
post e_413 /v1/chat/completions "@$tmp/big.json"
if [ "$code" = 413 ]; then ok "a body over 8 MiB: 413"; else bad "body over 8 MiB" "$code $(errbody e_413) $(head -c 200 "$tmp/e_413.curl")"; fi
pad=$(head -c 17000 /dev/zero | tr '\0' a)
http e_431 GET /health -H "X-Pad: $pad"
if [ "$code" = 431 ]; then ok "a header block over 16 KiB: 431"; else bad "header block over 16 KiB" "$code $(head -c 200 "$tmp/e_431.curl")"; fi
hargs=()
for i in $(seq 101); do hargs+=(-H "X-H$i: $i"); done
http e_431b GET /health "${hargs[@]}"
if [ "$code" = 431 ]; then ok "over 100 header lines: 431"; else bad "over 100 header lines" "$code"; fi

raw r_line $'GARBAGE\r\n\r\n'
if [[ $rawstatus =~ ^HTTP/1\.[01]\ 400 ]] && [ "$rawclosed" = yes ]; then ok "malformed request line: 400, connection closed"; else bad "malformed request line" "'$rawstatus' closed: $rawclosed"; fi
raw r_cl $'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: abc\r\n\r\n{}'
if [[ $rawstatus =~ ^HTTP/1\.[01]\ 400 ]] && [ "$rawclosed" = yes ]; then ok "bad Content-Length: 400, connection closed"; else bad "bad Content-Length" "'$rawstatus' closed: $rawclosed"; fi
raw r_chunk $'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n'
if [[ $rawstatus =~ ^HTTP/1\.[01]\ 400 ]] && [ "$rawclosed" = yes ]; then ok "bad chunk size: 400, connection closed"; else bad "bad chunk size" "'$rawstatus' closed: $rawclosed"; fi
raw r_10 $'GET /health HTTP/1.0\r\n\r\n'
if [[ $rawstatus =~ ^HTTP/1\.[01]\ 200 ]] && [ "$rawclosed" = yes ] && grep -q '"ok"' "$tmp/r_10.raw"; then ok "HTTP/1.0: 200, then the connection closes"; else bad "HTTP/1.0" "'$rawstatus' closed: $rawclosed"; fi
body=$(comp_body "$R" 16)
raw r_close "$(printf 'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s' "${#body}" "$body")"
if [[ $rawstatus =~ ^HTTP/1\.1\ 200 ]] && [ "$rawclosed" = yes ]; then ok "Connection: close: 200, then the connection closes"; else bad "Connection: close" "'$rawstatus' closed: $rawclosed"; fi

# Expect: 100-continue: the interim answer comes before the body is sent
(
    exec 3<>"/dev/tcp/127.0.0.1/$port" || exit 2
    printf 'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n' "${#body}" >&3
    line=""
    read -r -t 5 line <&3
    echo "$line" | tr -d '\r' >"$tmp/expect.first"
    printf '%s' "$body" >&3
    timeout 5 cat <&3 >"$tmp/expect.rest"
) 2>/dev/null
if grep -q '^HTTP/1\.1 100' "$tmp/expect.first" && grep -q '^HTTP/1\.1 200' "$tmp/expect.rest"; then
    ok "Expect: 100-continue answered, then 200"
else bad "Expect: 100-continue" "first '$(cat "$tmp/expect.first")', then '$(head -n 1 "$tmp/expect.rest" | tr -d '\r')'"; fi

# chunked request body
chat_body "$A" 16 >"$tmp/chunked.json"
http chunked POST /v1/chat/completions -H 'Content-Type: application/json' -H 'Transfer-Encoding: chunked' --data-binary "@$tmp/chunked.json"
if [ "$code" = 200 ] && [ "$(q json "$tmp/chunked.body" "d['choices'][0]['message']['content']")" = "$(cat "$tmp/refA16.jstr")" ]; then
    ok "chunked request body: 200, the greedy text"
else bad "chunked request body" "$code $(errbody chunked)"; fi

# keep-alive: two requests over one connection
conns=$(curl -sS --max-time 10 -o /dev/null -o /dev/null -w '%{num_connects}\n' "$base/health" "$base/v1/models" 2>/dev/null | tr '\n' ' ')
if [ "$conns" = "1 0 " ]; then ok "keep-alive: the second request reuses the connection"; else bad "keep-alive" "connections per request: $conns"; fi

http health2 GET /health
if [ "$code" = 200 ]; then ok "/health 200 after the errors"; else bad "/health after the errors" "$code"; fi
http metrics2 GET /metrics
if grep -qE '^coli_requests_total\{code="200"\} [1-9]' "$tmp/metrics2.body" && grep -qE '^coli_requests_total\{code="400"\} [1-9]' "$tmp/metrics2.body" &&
    grep -qE '^coli_generated_tokens_total [1-9]' "$tmp/metrics2.body"; then
    ok "/metrics counts the 200s, the 400s and the generated tokens"
else bad "/metrics counters" "$(grep -E '^coli_(requests|generated)' "$tmp/metrics2.body" | head -n 6 | tr '\n' ' ')"; fi

wait "$slow_pid"
slow_pid=""
read -r slow_rc ms <"$tmp/slow.res" || slow_rc=""
if [ "$slow_rc" != 124 ] && [ -n "$slow_rc" ] && [ "${ms:-0}" -ge 8000 ] && [ "${ms:-0}" -le 15000 ]; then
    ok "half a header block, then silence: closed after $ms ms (10 s header deadline)"
else bad "header deadline" "$( [ "$slow_rc" = 124 ] && echo "still open after 20 s" || echo "closed after ${ms:-?} ms (cat exit ${slow_rc:-?})"); got: $(head -c 100 "$tmp/slow.raw" | tr '\r\n' '  ')"; fi

# --- agents: thinking as a field, a conversation's turns reuse what the slot holds
post think /v1/chat/completions "$(chat_body "$A" 16 '"chat_template_kwargs":{"enable_thinking":true}')"
want=$(q json "$tmp/refT16.json" "thought(path)")
got=$(q json "$tmp/think.body" "[d['choices'][0]['message'].get('reasoning_content', ''), d['choices'][0]['message']['content']]")
if [ "$code" = 200 ] && [ "$got" = "$want" ] && qt "$tmp/think.body" "len(d['choices'][0]['message'].get('reasoning_content', '')) > 0"; then
    ok "enable_thinking: the think block comes back as reasoning_content, the rest as content (= coli run --chat)"
else bad "enable_thinking" "$code got $got want $want"; fi
post thinkS /v1/chat/completions "$(chat_body "$A" 16 '"chat_template_kwargs":{"enable_thinking":true},"stream":true')" -N
q sse "$tmp/thinkS.body" 'd' >"$tmp/thinkS.sum" || echo '{}' >"$tmp/thinkS.sum"
if [ "$code" = 200 ] && [ "$(q json "$tmp/thinkS.sum" "[d['reasoning'], d['content']]")" = "$want" ]; then
    ok "enable_thinking, streaming: reasoning_content deltas, then content deltas, add up to the same"
else bad "enable_thinking streaming" "$code got $(q json "$tmp/thinkS.sum" "[d['reasoning'], d['content']]") want $want"; fi
# turn 2 of a conversation: resumes from the checkpoint where turn 1's answer opened
im_start=$("$COLI" tokenize -m "$M" -p '<|im_start|>' 2>/dev/null)
post turn1 /v1/chat/completions "$(chat_body "$A" 16)"
post turn1p /apply-template "$(chat_body "$A" 16)"
# (a prompt ends in newlines, which $(...) would drop: the x keeps them)
p1=$(q raw "$tmp/turn1p.body" "d['prompt']"; printf x)
"$COLI" tokenize -m "$M" -p "${p1%x}" >"$tmp/turn1.ids" 2>/dev/null
mark=$(grep -nx -- "$im_start" "$tmp/turn1.ids" | tail -n 1 | cut -d: -f1)
mark=$((${mark:-1} - 1))
C1=$(q json "$tmp/turn1.body" "d['choices'][0]['message']['content']")
turn2="{\"model\":\"$MODEL_ID\",\"messages\":[{\"role\":\"user\",\"content\":\"$A\"},{\"role\":\"assistant\",\"content\":$C1},{\"role\":\"user\",\"content\":\"$B\"}],\"max_tokens\":16,\"temperature\":0"
post turn2 /v1/chat/completions "$turn2}"
post turn2p /apply-template "$turn2}"
p2=$(q raw "$tmp/turn2p.body" "d['prompt']"; printf x)
"$COLI" run -m "$M" -p "${p2%x}" -n 16 --json -t 1 2>/dev/null </dev/null | tail -n 1 >"$tmp/refTurn2.json"
want=$(q json "$tmp/refTurn2.json" "content(path)")
if [ "$code" = 200 ] && [ "$mark" -gt 0 ] && qt "$tmp/turn2.body" "d['usage']['prompt_tokens_details']['cached_tokens'] == $mark" &&
    [ "$(q json "$tmp/turn2.body" "d['choices'][0]['message']['content']")" = "$want" ]; then
    ok "turn 2 reuses turn 1 up to where its answer opened ($mark cached tokens), and answers as coli run on its whole prompt"
else bad "turn 2 reuse" "$code mark $mark: $(q json "$tmp/turn2.body" "[d['usage'], d['choices'][0]['message']['content']]") want $want"; fi
post turn2n /v1/chat/completions "$turn2,\"cache_prompt\":false}"
if [ "$code" = 200 ] && qt "$tmp/turn2n.body" "d['usage']['prompt_tokens_details']['cached_tokens'] == 0" &&
    [ "$(q json "$tmp/turn2n.body" "d['choices'][0]['message']['content']")" = "$want" ]; then
    ok "cache_prompt false: nothing cached, the same answer"
else bad "cache_prompt false" "$code $(q json "$tmp/turn2n.body" "[d.get('usage'), d['choices'][0]['message']['content']]")"; fi
http metrics2 GET /metrics
if grep -qE '^coli_prompt_tokens_cached_total [1-9]' "$tmp/metrics2.body"; then ok "/metrics counts the cached prompt tokens"
else bad "/metrics cached tokens" "$(grep cached "$tmp/metrics2.body")"; fi
if grep -q "chat template: Qwen3.6: the file's template (.*) is not one coli knows" "$tmp/serve.err"; then
    ok "the log says which chat template renders the golden file's unknown one"
else bad "template log line" "$(grep 'chat template' "$tmp/serve.err")"; fi
post media /v1/chat/completions '{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"hi"}]}],"max_tokens":2}'
if is_error media 400 invalid_request_error && qt "$tmp/media.body" "'image' in d['error']['message']"; then ok "an image part: 400, text only"
else bad "image part" "$code $(errbody media)"; fi
post refusal /v1/chat/completions '{"messages":[{"role":"system","content":"a"},{"role":"system","content":"b"},{"role":"user","content":"hi"}],"max_tokens":2}'
if is_error refusal 400 invalid_request_error && qt "$tmp/refusal.body" "'System message must be at the beginning.' in d['error']['message']"; then
    ok "a conversation the template refuses: 400 with the template's message"
else bad "template refusal" "$code $(errbody refusal)"; fi

# --- the fuzz client
if [ -n "$FUZZ" ]; then
    if [ -x "$FUZZ" ]; then
        rc=0
        timeout 120 "$FUZZ" 127.0.0.1 "$port" 300 >"$tmp/fuzz.out" 2>&1 </dev/null || rc=$?
        { grep -E '^FAIL - ' "$tmp/fuzz.out" | head -n 20; tail -n 1 "$tmp/fuzz.out"; } | sed 's/^/# fuzz: /'
        if [ "$rc" = 0 ]; then ok "fuzz client: 300 rounds, exit 0"; else bad "fuzz client" "exit $rc: $(tail -n 5 "$tmp/fuzz.out" | tr '\n' ' ' | head -c 400)"; fi
        http health3 GET /health
        if [ "$code" = 200 ]; then ok "/health 200 after the fuzz client"; else bad "/health after the fuzz client" "$code"; fi
    else
        bad "fuzz client" "$FUZZ is not executable"
    fi
fi

# --- the official openai client
if [ -n "$npm_pid" ]; then
    rc=0
    wait "$npm_pid" || rc=$?
    npm_pid=""
    if [ "$rc" != 0 ] || [ ! -d "$npm_prefix/node_modules/openai" ]; then
        npm_skip="npm install openai@4 @anthropic-ai/sdk@1 ollama@0.6 failed (exit $rc): $(tail -n 2 "$tmp/npm.log" | tr '\n' ' ' | head -c 200)"
    fi
fi
if [ -n "$npm_skip" ]; then
    ok "openai client # SKIP $npm_skip"
elif ! command -v node >/dev/null; then
    ok "openai client # SKIP no node"
else
    A="$A" R="$R" q json - "{'chat_prompt': E['A'], 'chat_text': content('$tmp/refA16.json'), 'raw_prompt': E['R'], 'raw_text': greedy('$tmp/refR16.json'), 'n': 16}" >"$tmp/expect.json"
    client "openai client script" "$tmp/node.out" timeout 60 node "$HERE/serve_openai.mjs" "$npm_prefix" "$base/v1" "$MODEL_ID" "$tmp/expect.json"
    if [ -d "$npm_prefix/node_modules/ollama" ]; then
        client "ollama client script" "$tmp/onode.out" timeout 60 node "$HERE/serve_ollama.mjs" "$npm_prefix" "$base" "$MODEL_ID" "$tmp/expect.json"
    else
        ok "ollama client # SKIP $npm_prefix holds no ollama"
    fi
fi

# --- the Anthropic Messages API, OpenAI's Responses API and Ollama's: a server with room for a tools block in its
# context (-c 1024), a default thinking budget that a thinking request without its own is held to, and a ping every 5 ms
# a stream is quiet (every stream below, and the SDK's, reads them; a Responses stream's are response.in_progress events)
if COLI_PING_SECONDS=0.005 start_server anth --port 0 --parallel 1 -c 1024 -t 1 --no-think --reasoning-budget 40; then
    client "serve_anthropic.py" "$tmp/anth.out" timeout 120 python3 "$HERE/serve_anthropic.py" "http://127.0.0.1:$sport" "$MODEL_ID" "$tmp/anth_expect.json"
    client "serve_responses.py" "$tmp/resp.out" timeout 120 python3 "$HERE/serve_responses.py" "http://127.0.0.1:$sport" "$MODEL_ID"
    client "serve_ollama.py" "$tmp/ollama.out" timeout 120 python3 "$HERE/serve_ollama.py" "http://127.0.0.1:$sport" "$MODEL_ID" 1024
    if [ -n "$npm_skip" ]; then
        ok "anthropic client # SKIP $npm_skip"
    elif [ ! -d "$npm_prefix/node_modules/@anthropic-ai/sdk" ]; then
        ok "anthropic client # SKIP $npm_prefix holds no @anthropic-ai/sdk"
    elif [ -s "$tmp/anth_expect.json" ]; then
        client "anthropic client script" "$tmp/anode.out" timeout 60 node "$HERE/serve_anthropic.mjs" "$npm_prefix" "http://127.0.0.1:$sport" "$MODEL_ID" "$tmp/anth_expect.json"
    fi
    # OpenAI's streams: an SSE comment while the prompt is computed, skipped by parsers (ours, and the SDK's below)
    main_base=$base
    base=http://127.0.0.1:$sport
    post pingS /v1/chat/completions "$(chat_body "$long" 8 '"stream":true')"
    scode=$code
    post pingW /v1/chat/completions "$(chat_body "$long" 8)"
    q sse "$tmp/pingS.body" 'd' >"$tmp/pingS.sum" || echo '{}' >"$tmp/pingS.sum"
    if [ "$scode" = 200 ] && grep -q '^: ping$' "$tmp/pingS.body" && qt "$tmp/pingS.sum" "not d['problems'] and d['done_last']" &&
        [ "$(q json "$tmp/pingS.sum" "d['content']")" = "$(q json "$tmp/pingW.body" "d['choices'][0]['message']['content']")" ]; then
        ok "a chat stream quiet for 5 ms gets ': ping' comments; events and text as without them"
    else bad "chat stream keep-alive" "$scode $(grep -c '^: ping' "$tmp/pingS.body") pings $(head -c 300 "$tmp/pingS.sum")"; fi
    base=$main_base
    if [ -z "$npm_skip" ] && command -v node >/dev/null && [ -s "$tmp/expect.json" ]; then
        client "openai client script (pings every 5 ms)" "$tmp/node2.out" timeout 60 node "$HERE/serve_openai.mjs" "$npm_prefix" "http://127.0.0.1:$sport/v1" "$MODEL_ID" "$tmp/expect.json"
    fi
    stop_server "$spid"
else
    bad "serve for the Anthropic API starts" "$(head -c 600 "$tmp/anth.err")"
fi

# --- the Qwen3.5 and Qwen3.6 templates, written into copies of the model: /apply-template
# renders every golden case byte for byte, or refuses it with the template's message
cat >"$tmp/tpl.py" <<'PY'
import json, sys, urllib.request, urllib.error
cases, port, label = json.load(open(sys.argv[1]))['cases'], sys.argv[2], sys.argv[3]
def render(c):
    body = {'messages': c['messages'], 'add_generation_prompt': c['add_generation_prompt']}
    if 'tools' in c: body['tools'] = c['tools']
    kw = {k: c[k] for k in ('enable_thinking', 'preserve_thinking') if k in c}
    if kw: body['chat_template_kwargs'] = kw
    req = urllib.request.Request('http://127.0.0.1:%s/apply-template' % port, json.dumps(body).encode(), {'Content-Type': 'application/json'})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
def check(name, c):
    status, d = render(c)
    if 'rendered' in c:
        ok = status == 200 and d.get('prompt') == c['rendered']
        why = 'status %d, %r' % (status, str(d)[:160])
    else:
        ok = status == 400 and c['error'] in d.get('error', {}).get('message', '')
        why = 'status %d, %r, want the refusal %r' % (status, str(d)[:160], c['error'])
    print(('ok - %s: %s' % (label, name)) if ok else ('FAIL - %s: %s: %s' % (label, name, why)))
for c in cases:
    check(c['name'], c)
    calls = [m for m in c['messages'] if isinstance(m, dict) and m.get('tool_calls')]
    if 'rendered' in c and calls and all(isinstance(t.get('function', t).get('arguments'), dict) for m in calls for t in m['tool_calls']):
        for m in calls:
            for t in m['tool_calls']:
                f = t.get('function', t)
                f['arguments'] = json.dumps(f['arguments'])
        check(c['name'] + ', arguments as a JSON string', c)
PY
for v in 35 36; do
    python3 -c "import json, sys; sys.stdout.write(json.load(open(sys.argv[1]))['template'])" "$GOLDEN/template-qwen$v.json" >"$tmp/t$v.jinja"
    if ! python3 "$HERE/gguf_template.py" "$M" "$tmp/tpl$v.gguf" "$tmp/t$v.jinja" 2>"$tmp/tpl$v.mk"; then
        bad "Qwen$v template copy" "$(head -c 200 "$tmp/tpl$v.mk")"
        continue
    fi
    if ! SERVE_MODEL="$tmp/tpl$v.gguf" start_server tpl$v --port 0 --parallel 1 -c 256 -t 1; then
        bad "serve on the Qwen$v template copy" "$(head -c 300 "$tmp/tpl$v.err")"
        continue
    fi
    if grep -q "chat template: Qwen3.${v#3}, the file's own" "$tmp/tpl$v.err"; then ok "Qwen3.${v#3} template copy: the log names it"
    else bad "Qwen3.${v#3} template log line" "$(grep 'chat template' "$tmp/tpl$v.err")"; fi
    timeout 120 python3 "$tmp/tpl.py" "$GOLDEN/template-qwen$v.json" "$sport" "template-qwen$v via serve" >"$tmp/tpl$v.out" 2>&1
    grep -E '^FAIL - ' "$tmp/tpl$v.out" | head -n 5
    np=$(grep -c '^ok - ' "$tmp/tpl$v.out")
    nf=$(grep -c '^FAIL - ' "$tmp/tpl$v.out")
    pass=$((pass + np))
    fail=$((fail + nf))
    [ "$np" -ge 76 ] || bad "template-qwen$v via serve" "only $np cases answered: $(tail -n 3 "$tmp/tpl$v.out" | tr '\n' ' ' | head -c 300)"
    stop_server "$spid"
done

# --- --api-key: a second server
if start_server auth --port 0 --parallel 1 -c 128 -t 1 --api-key sekrit --no-think --allow-origin 'https://a.example, https://Chat.Example.com'; then
    aport=$sport
    apid=$spid
    base=http://127.0.0.1:$aport
    http a_none GET /v1/models
    if is_error a_none 401 authentication_error; then ok "--api-key: no key, 401 authentication_error"; else bad "--api-key without a key" "$code $(errbody a_none)"; fi
    http a_wrong GET /v1/models -H 'Authorization: Bearer wrong'
    if is_error a_wrong 401 authentication_error; then ok "--api-key: wrong key, 401"; else bad "--api-key wrong key" "$code $(errbody a_wrong)"; fi
    post a_chat /v1/chat/completions "$(chat_body "$A" 4)"
    if [ "$code" = 401 ]; then ok "--api-key: chat without a key, 401"; else bad "--api-key chat without a key" "$code"; fi
    http a_metrics GET /metrics
    if [ "$code" = 401 ]; then ok "--api-key: /metrics without a key, 401"; else bad "--api-key /metrics without a key" "$code"; fi
    http a_right GET /v1/models -H 'Authorization: Bearer sekrit'
    if [ "$code" = 200 ] && qt "$tmp/a_right.body" "d['data'][0]['id'] == '$MODEL_ID'"; then ok "--api-key: right key, 200"; else bad "--api-key right key" "$code $(errbody a_right)"; fi
    post a_chat2 /v1/chat/completions "$(chat_body "$A" 16)" -H 'Authorization: Bearer sekrit'
    if [ "$code" = 200 ] && [ "$(q json "$tmp/a_chat2.body" "d['choices'][0]['message']['content']")" = "$(cat "$tmp/refA16.jstr")" ]; then ok "--api-key: chat with the key, the greedy text"; else bad "--api-key chat with the key" "$code $(errbody a_chat2)"; fi
    http a_health GET /health
    if [ "$code" = 200 ]; then ok "--api-key: /health without a key, 200"; else bad "--api-key /health" "$code"; fi
    http a_root GET /
    if [ "$code" = 200 ]; then ok "--api-key: / without a key, 200"; else bad "--api-key /" "$code"; fi
    abody="{\"model\":\"$MODEL_ID\",\"messages\":[{\"role\":\"user\",\"content\":\"$A\"}],\"max_tokens\":16,\"temperature\":0}"
    post a_msg /v1/messages "$abody" -H 'X-Api-Key: wrong'
    if [ "$code" = 401 ] && qt "$tmp/a_msg.body" "d == {'type': 'error', 'error': {'type': 'authentication_error', 'message': d['error']['message']}}"; then
        ok "--api-key: /v1/messages with a wrong X-Api-Key, 401 in Anthropic's shape"
    else bad "--api-key /v1/messages wrong key" "$code $(errbody a_msg)"; fi
    post a_msg2 /v1/messages "$abody" -H 'X-Api-Key: sekrit'
    if [ "$code" = 200 ] && [ "$(q json "$tmp/a_msg2.body" "d['content'][0]['text']")" = "$(cat "$tmp/refA16.jstr")" ]; then
        ok "--api-key: /v1/messages with X-Api-Key, the greedy text of coli run --chat"
    else bad "--api-key /v1/messages with the key" "$code $(errbody a_msg2)"; fi
    # browser pages (CORS): a preflight needs no key; listed and this machine's origins granted, others 403
    http o_pre OPTIONS /v1/chat/completions -H 'Origin: http://localhost:5173' -H 'Access-Control-Request-Method: POST' \
        -H 'Access-Control-Request-Headers: authorization, content-type, x-stainless-os'
    if [ "$code" = 200 ] && [ "$(header o_pre access-control-allow-origin)" = http://localhost:5173 ] &&
        [ "$(header o_pre access-control-allow-headers)" = "authorization, content-type, x-stainless-os" ] &&
        header o_pre access-control-allow-methods | grep -q POST && [ -z "$(header o_pre access-control-allow-private-network)" ]; then
        ok "--allow-origin: a preflight from a localhost page, no key: 200 granting its origin, POST and the headers it asked"
    else bad "CORS preflight" "$code $(tr -d '\r' <"$tmp/o_pre.hdr" | tr '\n' ' ')"; fi
    http o_pna OPTIONS /api/tags -H 'Origin: https://a.example' -H 'Access-Control-Request-Private-Network: true'
    if [ "$code" = 200 ] && [ "$(header o_pna access-control-allow-private-network)" = true ] && header o_pna access-control-allow-methods | grep -q GET; then
        ok "--allow-origin: a listed site's preflight asking for this machine's network: granted (Chrome's private network access)"
    else bad "CORS private network preflight" "$code $(tr -d '\r' <"$tmp/o_pna.hdr" | tr '\n' ' ')"; fi
    post o_chat /v1/chat/completions "$(chat_body "$A" 16)" -H 'Authorization: Bearer sekrit' -H 'Origin: https://chat.example.com'
    if [ "$code" = 200 ] && [ "$(header o_chat access-control-allow-origin)" = https://chat.example.com ] &&
        [ "$(q json "$tmp/o_chat.body" "d['choices'][0]['message']['content']")" = "$(cat "$tmp/refA16.jstr")" ]; then
        ok "--allow-origin: a chat from a listed origin (another letter case): granted, the greedy text"
    else bad "CORS chat from a listed origin" "$code $(header o_chat access-control-allow-origin) $(errbody o_chat)"; fi
    post o_stream /api/chat "{\"model\":\"$MODEL_ID\",\"messages\":[{\"role\":\"user\",\"content\":\"$A\"}],\"options\":{\"num_predict\":2}}" \
        -H 'Authorization: Bearer sekrit' -H 'Origin: https://a.example'
    if [ "$code" = 200 ] && [ "$(header o_stream access-control-allow-origin)" = https://a.example ] && [ "$(header o_stream vary)" = Origin ]; then
        ok "--allow-origin: a stream's head grants the page too"
    else bad "CORS stream head" "$code $(tr -d '\r' <"$tmp/o_stream.hdr" | tr '\n' ' ')"; fi
    post o_evil /v1/chat/completions "$(chat_body "$A" 4)" -H 'Authorization: Bearer sekrit' -H 'Origin: http://localhost.evil.example'
    if is_error o_evil 403 permission_error && [ -z "$(header o_evil access-control-allow-origin)" ] && grep -q "localhost.evil.example" "$tmp/o_evil.body"; then
        ok "--allow-origin: a page of another origin (its key right): 403 permission_error naming it"
    else bad "CORS other origin" "$code $(errbody o_evil)"; fi
    http o_evil2 OPTIONS /v1/messages -H 'Origin: https://a.example.evil'
    if [ "$code" = 403 ] && qt "$tmp/o_evil2.body" "d['type'] == 'error' and d['error']['type'] == 'permission_error'"; then
        ok "--allow-origin: another origin's preflight: 403 in the endpoint's shape"
    else bad "CORS other origin preflight" "$code $(errbody o_evil2)"; fi
    # SIGTERM while a long answer streams
    curl -sS -N --max-time 30 -o "$tmp/a_long.body" -H 'Authorization: Bearer sekrit' -H 'Content-Type: application/json' \
        --data-binary "$(chat_body "$A" 100 '"stream":true')" "$base/v1/chat/completions" 2>/dev/null &
    cpid=$!
    sleep 0.2
    stop_server "$apid"
    wait "$cpid" 2>/dev/null
    if [ "$src" = 0 ]; then ok "--api-key server: SIGTERM during a stream, exit 0"; else bad "--api-key server SIGTERM" "exit $src; $(tail -n 3 "$tmp/auth.err" | tr '\n' ' ')"; fi
    base=http://127.0.0.1:$port
else
    bad "--api-key server starts" "$(head -c 600 "$tmp/auth.err")"
fi

# --- a client that shuts its sending side after its request counts as gone (README): the stream
# the server then cancels still ends well-formed. ~3800 prompt tokens of the deep golden model on
# one thread take longer than the 200 ms after which the server looks.
if SERVE_MODEL="$GOLDEN/q35moe-deep-q8_0.gguf" start_server half --port 0 --parallel 1 -c 4096 -t 1; then
    timeout 60 python3 - "$sport" >"$tmp/half.out" 2>&1 <<'PY'
import json, socket, sys
body = json.dumps({'messages': [{'role': 'user', 'content': 'word ' * 1900}], 'max_tokens': 4, 'stream': True}).encode()
s = socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=50)
s.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
          b'Content-Length: %d\r\n\r\n' % len(body) + body)
s.shutdown(socket.SHUT_WR)
data = b''
while True:
    d = s.recv(65536)
    if not d: break
    data += d
whole = data.endswith(b'\r\n0\r\n\r\n') and b'\r\ndata: [DONE]\n\n\r\n' in data
print(('cancelled' if b'"code":"client_closed"' in data else 'answered') if whole else 'cut: %r' % data[-200:])
PY
    case $(cat "$tmp/half.out") in
    cancelled) ok "a half-closed client: its stream cancelled, ending with the client_closed error event, [DONE] and the last chunk" ;;
    answered) ok "a half-closed client: answered before the server looked (a fast machine), the stream whole" ;;
    *) bad "a half-closed client's stream" "$(head -c 300 "$tmp/half.out")" ;;
    esac
    # JSON mode with tools (a prompt the small server's context cannot hold): the object, no calls
    main_base=$base
    base=http://127.0.0.1:$sport
    post jsonT /v1/chat/completions "$(chat_body "$A" 120 "$tools,\"chat_template_kwargs\":{\"enable_thinking\":false},\"response_format\":{\"type\":\"json_object\"},\"logit_bias\":$closers")"
    if [ "$code" = 200 ] && qt "$tmp/jsonT.body" "d['choices'][0]['finish_reason'] == 'stop' and not d['choices'][0]['message'].get('tool_calls') and isinstance(json.loads(d['choices'][0]['message']['content']), dict)"; then
        ok "json_object chat with tools: the content a JSON object, no tool calls"
    else bad "json_object chat with tools" "$code $(errbody jsonT)"; fi
    # tool_choice forcing a call: the answer opens the template's call form (of that function)
    for tc in '"required"|<tool_call>\n<function=' '{"type":"function","function":{"name":"get_time"}}|<tool_call>\n<function=get_time>\n'; do
        post toolF /v1/chat/completions "$(chat_body "$A" 40 "$tools,\"chat_template_kwargs\":{\"enable_thinking\":false},\"tool_choice\":${tc%%|*}")"
        if [ "$code" = 200 ] && qt "$tmp/toolF.body" "(d['choices'][0]['message'].get('content') or '').strip().startswith('${tc#*|}') or d['choices'][0]['message'].get('tool_calls', [{}])[0].get('function', {}).get('name') == 'get_time'"; then
            ok "tool_choice ${tc%%|*}: the answer opens a call"
        else bad "tool_choice ${tc%%|*}" "$code $(errbody toolF)"; fi
    done
    post e_tool /v1/chat/completions "$(chat_body "$A" 4 "$tools,\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"nope\"}}")"
    if is_error e_tool 400 invalid_request_error && qt "$tmp/e_tool.body" "d['error']['param'] == 'tool_choice'"; then ok "tool_choice naming a function not in tools: 400"; else bad "tool_choice naming an unknown function" "$code $(errbody e_tool)"; fi
    post e_tool /v1/chat/completions "$(chat_body "$A" 4 "$tools,\"tool_choice\":\"required\",\"response_format\":{\"type\":\"json_object\"}")"
    if is_error e_tool 400 invalid_request_error && qt "$tmp/e_tool.body" "d['error']['param'] == 'response_format'"; then ok "tool_choice required with json_object: 400"; else bad "tool_choice required with json_object" "$code $(errbody e_tool)"; fi
    base=$main_base
    stop_server "$spid"
else
    bad "serve on the deep golden model" "$(head -c 300 "$tmp/half.err")"
fi

# --- --prompt-cache FILE: the conversations written at exit and read back at the next start, so a returning
# conversation reuses its tokens there (the same answer); another model's file, or a damaged one, is said and left
main_base=$base
pc_body=$(chat_body "Tell me about the sky and why it looks blue at noon, in detail" 8)
pc_start() { # pc_start LOG [SERVE_MODEL]: a server keeping its prompt cache in $tmp/pc.bin; sets base
    SERVE_MODEL=${2:-$M} start_server "$1" --port 0 --parallel 1 -c 512 -t 1 --no-think --prompt-cache "$tmp/pc.bin" && base=http://127.0.0.1:$sport
}
if pc_start pc1 && post pc1 /v1/chat/completions "$pc_body" && stop_server "$spid" && pc_start pc2 && post pc2 /v1/chat/completions "$pc_body" &&
    stop_server "$spid"; then
    if grep -q '^\[serve\] prompt cache: .*pc.bin does not exist yet' "$tmp/pc1.err" && grep -q '^\[serve\] prompt cache: 1 conversation saved to' "$tmp/pc1.err" &&
        grep -q '^\[serve\] prompt cache: 1 conversation ([0-9]* tokens, [0-9]* MiB) read from .* in [0-9.]* s$' "$tmp/pc2.err" &&
        P="$tmp/pc1.body" qt "$tmp/pc2.body" "d['choices'][0]['message'] == json.load(open(E['P']))['choices'][0]['message'] and d['usage']['prompt_tokens_details']['cached_tokens'] > 0"; then
        ok "--prompt-cache: written at exit, read at the next start; the conversation comes back: its tokens reused, the same answer"
    else bad "--prompt-cache across a restart" "$(grep 'prompt cache' "$tmp/pc1.err" "$tmp/pc2.err" | tr '\n' ' '); $(errbody pc2)"; fi
else bad "--prompt-cache servers" "$(tail -n 2 "$tmp/pc1.err" "$tmp/pc2.err" 2>/dev/null | tr '\n' ' ')"; fi
head -c 100 "$tmp/pc.bin" >"$tmp/pc.cut" && cp "$tmp/pc.bin" "$tmp/pc.whole" && mv "$tmp/pc.cut" "$tmp/pc.bin"
if pc_start pc3 && post pc3 /v1/chat/completions "$pc_body" && stop_server "$spid" && cp "$tmp/pc.whole" "$tmp/pc.bin" &&
    pc_start pc4 "$GOLDEN/q3next-q8_0.gguf" && stop_server "$spid"; then
    if grep -q '^\[serve\] prompt cache: .*pc.bin not read: a conversation is damaged or cut short' "$tmp/pc3.err" &&
        grep -q '^\[serve\] prompt cache: .*pc.bin not read: made for another model' "$tmp/pc4.err" &&
        P="$tmp/pc1.body" qt "$tmp/pc3.body" "d['choices'][0]['message'] == json.load(open(E['P']))['choices'][0]['message'] and d['usage']['prompt_tokens_details']['cached_tokens'] == 0"; then
        ok "--prompt-cache: a file cut short, or another model's, is said and left; the server answers as without"
    else bad "--prompt-cache refusals" "$(grep 'prompt cache' "$tmp/pc3.err" "$tmp/pc4.err" | tr '\n' ' '); $(errbody pc3)"; fi
else bad "--prompt-cache servers with a damaged file" "$(tail -n 2 "$tmp/pc3.err" "$tmp/pc4.err" 2>/dev/null | tr '\n' ' ')"; fi
base=$main_base

# --- SIGTERM: exit 0, heat saved
rm -f "$tmp/serve.heat"
http health4 GET /health
stop_server "$pid"
if [ "$src" = 0 ]; then ok "SIGTERM: exit status 0"; else bad "SIGTERM" "exit status $src; $(tail -n 3 "$tmp/serve.err" | tr '\n' ' ')"; fi
if [ -s "$tmp/serve.heat" ]; then ok "SIGTERM: heat file written"; else bad "heat file" "$tmp/serve.heat missing after exit; $(grep -i heat "$tmp/serve.err" | head -n 3 | tr '\n' ' ')"; fi
finish
