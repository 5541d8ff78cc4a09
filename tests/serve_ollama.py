# serve_ollama: Ollama's API (/api/chat, /api/generate, /api/show, /api/tags, /api/version) of a running `coli serve`
# against its own chat and text completions (tests/test_serve.sh). Each Ollama request goes beside the request it
# means, written here by hand; both greedy, so the answers must agree: content, thinking, how they stopped, token
# counts. Then streams of JSON lines, raw generations, load requests, JSON formats and refusals. Prints `ok - ...` /
# `FAIL - ...` lines.
# usage: python3 tests/serve_ollama.py BASE_URL MODEL_ID N_CTX
import json, sys
from serve_api import bad, ok, post, send, start
import serve_api

base, model, n_ctx = sys.argv[1], sys.argv[2], int(sys.argv[3])
start(base, model, 'ollama')


def greedy(body, n=16):
    """An Ollama request: greedy, N tokens at most, not streamed."""
    return dict(body, model=model, stream=False, options=dict(body.get('options', {}), temperature=0, num_predict=n))


def twin(body, n=16):  # the OpenAI request beside it
    return serve_api.greedy(body, n)


SCHEMA = {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}
TOOLS = [{'type': 'function', 'function': {'name': 'get_weather', 'description': 'The weather in a city', 'parameters': SCHEMA}}]
CASES = [
    ('a system prompt and a user message', 'chat',
     {'messages': [{'role': 'system', 'content': 'You are terse.'}, {'role': 'user', 'content': 'Hello'}]},
     {'messages': [{'role': 'system', 'content': 'You are terse.'}, {'role': 'user', 'content': 'Hello'}]}),
    ('think on, tools, a call (arguments an object) and its result in the history', 'chat',
     {'think': True, 'tools': TOOLS,
      'messages': [{'role': 'user', 'content': 'Weather in Bern?'},
                   {'role': 'assistant', 'content': '', 'thinking': 'A tool knows.',
                    'tool_calls': [{'function': {'name': 'get_weather', 'arguments': {'city': 'Bern'}}}]},
                   {'role': 'tool', 'content': '12 C, cloudy', 'tool_name': 'get_weather'}]},
     {'chat_template_kwargs': {'enable_thinking': True}, 'tools': TOOLS,
      'messages': [{'role': 'user', 'content': 'Weather in Bern?'},
                   {'role': 'assistant', 'content': '', 'reasoning_content': 'A tool knows.',
                    'tool_calls': [{'type': 'function', 'function': {'name': 'get_weather', 'arguments': '{"city": "Bern"}'}}]},
                   {'role': 'tool', 'content': '12 C, cloudy'}]}),
    ('a generation with a system prompt, think "high"', 'generate',
     {'system': 'You are terse.', 'prompt': 'Why is the sky blue?', 'think': 'high'},
     {'chat_template_kwargs': {'enable_thinking': True},
      'messages': [{'role': 'system', 'content': 'You are terse.'}, {'role': 'user', 'content': 'Why is the sky blue?'}]}),
]


def fields_of(d, chat):
    """(thinking, text, calls) of an Ollama answer."""
    m = d['message'] if chat else d
    calls = [(c['function']['name'], c['function']['arguments']) for c in m.get('tool_calls') or []]
    return m.get('thinking', ''), m['content' if chat else 'response'], calls


def chat_fields(d):
    m = d['choices'][0]['message']
    calls = [(c['function']['name'], json.loads(c['function']['arguments'])) for c in m.get('tool_calls') or []]
    return m.get('reasoning_content') or '', m.get('content') or '', calls


def same_answer(d, chat, want):
    """None if Ollama answer D says what chat completion WANT says, else why not."""
    if d.get('model') != model or d.get('done') is not True or not str(d.get('created_at', '')).endswith('Z'):
        return 'not a done answer: %r' % d
    if list(fields_of(d, chat)) != list(chat_fields(want)):
        return 'fields %r, the chat answer %r' % (fields_of(d, chat), chat_fields(want))
    finish = want['choices'][0]['finish_reason']
    if d['done_reason'] != ('length' if finish == 'length' else 'stop'):
        return 'done_reason %r, finish_reason %r' % (d['done_reason'], finish)
    u = want['usage']
    if d['eval_count'] != u['completion_tokens'] or not 0 <= d['prompt_eval_count'] <= u['prompt_tokens']:
        return 'counts %r, the chat usage %r' % ({k: d[k] for k in d if k.endswith('count')}, u)
    if not all(isinstance(d[k], (int, float)) and d[k] >= 0 for k in ('total_duration', 'prompt_eval_duration', 'eval_duration')):
        return 'durations %r' % d
    return None


def lines_of(text):
    """The JSON objects of a stream of lines; raises on a malformed one."""
    assert text.endswith('\n'), 'the stream does not end in a newline'
    return [json.loads(line) for line in text[:-1].split('\n')]


answers = []
for name, kind, body, chat in CASES:
    s1, d = post('/api/' + kind, greedy(body, 40))
    s2, want = post('/v1/chat/completions', twin(chat, 40))
    why = 'status %d %d: %r' % (s1, s2, d) if (s1, s2) != (200, 200) else same_answer(d, kind == 'chat', want)
    if why:
        bad(name, why)
    else:
        ok('%s: the answer of the chat request it means' % name)
    answers.append(d)

# streamed (Ollama's default): JSON lines whose thinking and text pieces make the whole answer, the last one done
for k in (1, 2):
    name, kind, body, _ = CASES[k]
    status, headers, text = send('POST', '/api/' + kind, dict(greedy(body, 40), stream=True))
    try:
        assert status == 200 and headers.get('Content-Type') == 'application/x-ndjson', 'status %d %s' % (status, headers.get('Content-Type'))
        lines = lines_of(text)
        chat = kind == 'chat'
        assert all(not line['done'] for line in lines[:-1]) and lines[-1]['done'], 'done flags %r' % [line['done'] for line in lines]
        pieces = [fields_of(line, chat) for line in lines]
        built = (''.join(p[0] for p in pieces), ''.join(p[1] for p in pieces), [c for p in pieces for c in p[2]])
        whole = answers[k]
        assert built == fields_of(whole, chat), 'streamed %r, whole %r' % (built, fields_of(whole, chat))
        assert (lines[-1]['done_reason'], lines[-1]['eval_count']) == (whole['done_reason'], whole['eval_count']), 'last %r' % lines[-1]
        ok('%s, streamed: %d JSON lines build the answer, the last done' % (name, len(lines)))
    except (AssertionError, ValueError, KeyError, IndexError, TypeError) as e:
        bad('%s, streamed' % name, '%s: %s' % (type(e).__name__, e))

# raw: the prompt's completion, byte for byte, streamed or not
prompt = 'The capital of France is'
s1, d = post('/api/generate', greedy({'prompt': prompt, 'raw': True}))
s2, want = post('/v1/completions', twin({'prompt': prompt}))
status, _, text = send('POST', '/api/generate', dict(greedy({'prompt': prompt, 'raw': True}), stream=True))
try:
    want_text = want['choices'][0]['text']
    assert (s1, s2, status) == (200, 200, 200) and d['response'] == want_text, '%r, want %r' % (d, want_text)
    assert ''.join(line['response'] for line in lines_of(text)) == want_text, 'streamed %r' % text[:300]
    ok('raw: the completion of the prompt (%r), streamed the same' % want_text)
except (AssertionError, ValueError, KeyError, IndexError, TypeError) as e:
    bad('raw', '%s: %s' % (type(e).__name__, e))

# format: a JSON schema is the chat's response_format
schema = {'type': 'object', 'properties': {'c': {'enum': ['red', 'blue']}}, 'required': ['c'], 'additionalProperties': False}
s1, d = post('/api/chat', greedy({'messages': [{'role': 'user', 'content': 'A color'}], 'format': schema}, 300))
s2, want = post('/v1/chat/completions', twin({'messages': [{'role': 'user', 'content': 'A color'}],
                                              'response_format': {'type': 'json_schema', 'json_schema': {'schema': schema}}}, 300))
try:
    assert (s1, s2) == (200, 200) and d['message']['content'] == want['choices'][0]['message']['content'], '%r, chat %r' % (d, want)
    assert json.loads(d['message']['content'])['c'] in ('red', 'blue'), d['message']['content']
    ok('format (a schema): an object the schema admits (%s), the chat\'s response_format answer' % json.dumps(json.loads(d['message']['content'])))
except (AssertionError, KeyError, TypeError, ValueError) as e:
    bad('format', '%s: %s' % (type(e).__name__, e))

# an empty prompt, or no messages: the model is loaded, done at once
for label, kind, body in [('generate, no prompt', 'generate', {}), ('chat, no messages', 'chat', {'messages': []})]:
    status, d = post('/api/' + kind, dict(body, model=model))
    if status == 200 and d.get('done') is True and d.get('done_reason') == 'load' and 'eval_count' not in d:
        ok('%s: done_reason load, nothing generated' % label)
    else:
        bad(label, '%d %r' % (status, d))

# the model: /api/tags, /api/show, /api/version
status, tags = post('/api/show', {'model': model})
s2, _, text = send('GET', '/api/tags')
s3, _, version = send('GET', '/api/version')
try:
    listed = json.loads(text)['models']
    assert (status, s2, s3) == (200, 200, 200), (status, s2, s3)
    assert [m['name'] for m in listed] == [model] and listed[0]['details']['format'] == 'gguf' and listed[0]['size'] > 0, listed
    info, details = tags['model_info'], tags['details']
    arch = info['general.architecture']
    assert details == listed[0]['details'] and arch == details['family'] and info[arch + '.context_length'] == n_ctx, tags
    assert set(tags['capabilities']) >= {'completion', 'tools'} and info['general.parameter_count'] > 0, tags
    assert json.loads(version)['version'].count('.') == 2, version
    ok('tags lists %s (%s, %s), show its details, context_length %d and capabilities; version %s' %
       (model, details['parameter_size'], details['quantization_level'], n_ctx, json.loads(version)['version']))
except (AssertionError, KeyError, TypeError, ValueError, IndexError) as e:
    bad('the model', '%s: %s' % (type(e).__name__, e))

# refusals in Ollama's shape, {"error": MESSAGE}
for label, method, path, body, want_status, words in [
        ('messages not a list', 'POST', '/api/chat', {'messages': 5}, 400, "'messages'"),
        ('an image', 'POST', '/api/chat', {'messages': [{'role': 'user', 'content': 'x', 'images': ['aGk=']}]}, 400, 'images'),
        ('a suffix (fill in the middle)', 'POST', '/api/generate', {'prompt': 'x', 'suffix': 'y'}, 400, "'suffix'"),
        ('a template of its own', 'POST', '/api/generate', {'prompt': 'x', 'template': '{{ .Prompt }}'}, 400, "'template'"),
        ('num_predict 0', 'POST', '/api/chat', {'messages': [{'role': 'user', 'content': 'x'}], 'options': {'num_predict': 0}}, 400, 'num_predict'),
        ('think "max"', 'POST', '/api/chat', {'messages': [{'role': 'user', 'content': 'x'}], 'think': 'max'}, 400, "'think'"),
        ('format "xml"', 'POST', '/api/generate', {'prompt': 'x', 'format': 'xml'}, 400, "'format'"),
        ('a prompt longer than the context', 'POST', '/api/generate', {'prompt': 'word ' * 1500}, 400, 'context'),
        ('a body that is not JSON', 'POST', '/api/chat', b'{"messages": [', 400, 'not valid JSON'),
        ('GET /api/chat', 'GET', '/api/chat', None, 405, 'takes POST'),
        ('an endpoint coli does not have', 'POST', '/api/pull', {'model': 'x'}, 404, 'no endpoint')]:
    status, _, text = send(method, path, dict(body, model=model, stream=False) if isinstance(body, dict) else body)
    try:
        d = json.loads(text)
        assert status == want_status and list(d) == ['error'] and words in d['error'], '%d %s' % (status, text[:300])
        ok('%s: %d {"error": ...} naming it' % (label, want_status))
    except (AssertionError, ValueError, TypeError) as e:
        bad(label, '%s: %s' % (type(e).__name__, e))
sys.exit(1 if serve_api.failed else 0)
