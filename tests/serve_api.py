# serve_api: what the live API scripts share (tests/serve_anthropic.py, tests/serve_responses.py): ok/FAIL lines,
# requests to the server under test, greedy bodies, and a server-sent event stream read strictly.
import json, urllib.request, urllib.error

base = model = None  # set by start()
label = ''
failed = 0


def start(base_url, model_id, what):
    """Points the helpers at BASE_URL serving MODEL_ID; WHAT prefixes every ok/FAIL line."""
    global base, model, label
    base, model, label = base_url, model_id, what


def ok(name):
    print('ok - %s: %s' % (label, name))


def bad(name, why):
    global failed
    failed += 1
    print('FAIL - %s: %s: %s' % (label, name, str(why).replace('\n', ' ')[:500]))


def send(method, path, body=None, headers=None):
    """(status, headers, text) of a request to the server."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data, {'Content-Type': 'application/json', **(headers or {})}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read().decode('utf-8', 'replace')
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode('utf-8', 'replace')


def post(path, body):
    status, _, text = send('POST', path, body)
    return status, json.loads(text)


def greedy(body, n=16, key='max_tokens'):
    return dict(body, model=model, temperature=0, **{key: n})


def events_of(text):
    """The (name, data) pairs of an event stream; raises on a malformed one."""
    out = []
    assert text.endswith('\n\n'), 'the stream does not end in a blank line'
    for ev in text[:-2].split('\n\n'):
        lines = ev.split('\n')
        assert len(lines) == 2 and lines[0].startswith('event: ') and lines[1].startswith('data: '), 'not an event: %r' % ev[:100]
        data = json.loads(lines[1][6:])
        assert data['type'] == lines[0][7:], 'event %r holds %r' % (lines[0], data['type'])
        out.append((lines[0][7:], data))
    return out
