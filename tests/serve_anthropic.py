# serve_anthropic: the Anthropic Messages API of a running `coli serve` against its own chat completions
# (tests/test_serve.sh). Each Anthropic request goes beside the chat request it means, written here by hand; both
# greedy, so the two answers must agree: text, thinking, tool calls, how they stopped, token counts. Then a stream's
# events, count_tokens, stop_sequences, prefills, forced and chosen tool calls, thinking budgets and errors. Prints `ok - ...` / `FAIL - ...` lines and writes EXPECT.json (the
# first case's answer) for tests/serve_anthropic.mjs.
# usage: python3 tests/serve_anthropic.py BASE_URL MODEL_ID EXPECT.json
import json, sys
from serve_api import bad, events_of, greedy, ok, post, send, start
import serve_api

base, model, expect_path = sys.argv[1:4]
start(base, model, 'messages')


SCHEMA = {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}
TOOLS = [{'name': 'get_weather', 'description': 'The weather in a city', 'input_schema': SCHEMA}]
CHAT_TOOLS = [{'type': 'function', 'function': {'name': 'get_weather', 'description': 'The weather in a city', 'parameters': SCHEMA}}]
CASES = [
    ('a system prompt and a user message',
     {'system': 'You are terse.', 'messages': [{'role': 'user', 'content': 'Hello'}]},
     {'messages': [{'role': 'system', 'content': 'You are terse.'}, {'role': 'user', 'content': 'Hello'}]}),
    ('thinking on, tools, a call and its result in the history',
     {'system': [{'type': 'text', 'text': 'Use tools.'}], 'tools': TOOLS, 'thinking': {'type': 'enabled', 'budget_tokens': 512},
      'messages': [{'role': 'user', 'content': 'Weather in Bern?'},
                   {'role': 'assistant', 'content': [{'type': 'text', 'text': 'Checking.'},
                                                     {'type': 'tool_use', 'id': 'toolu_1', 'name': 'get_weather', 'input': {'city': 'Bern'}}]},
                   {'role': 'user', 'content': [{'type': 'tool_result', 'tool_use_id': 'toolu_1', 'content': '12 C, cloudy'},
                                                {'type': 'text', 'text': 'And in Paris?'}]}]},
     {'tools': CHAT_TOOLS, 'chat_template_kwargs': {'enable_thinking': True},
      'messages': [{'role': 'system', 'content': 'Use tools.'}, {'role': 'user', 'content': 'Weather in Bern?'},
                   {'role': 'assistant', 'content': 'Checking.',
                    'tool_calls': [{'id': 'toolu_1', 'type': 'function', 'function': {'name': 'get_weather', 'arguments': '{"city": "Bern"}'}}]},
                   {'role': 'tool', 'tool_call_id': 'toolu_1', 'content': '12 C, cloudy'}, {'role': 'user', 'content': 'And in Paris?'}]}),
    ('a forced call (tool_choice tool)',
     {'tools': TOOLS, 'tool_choice': {'type': 'tool', 'name': 'get_weather'}, 'messages': [{'role': 'user', 'content': 'Weather in Rome?'}]},
     {'tools': CHAT_TOOLS, 'tool_choice': {'type': 'function', 'function': {'name': 'get_weather'}},
      'messages': [{'role': 'user', 'content': 'Weather in Rome?'}]}),
]
STOP_REASON = {'stop': 'end_turn', 'length': 'max_tokens', 'tool_calls': 'tool_use'}


def blocks_of(content):
    """(thinking, text, [(name, input)]) of a message's content blocks."""
    join = lambda kind, key: ''.join(b[key] for b in content if b['type'] == kind)
    return join('thinking', 'thinking'), join('text', 'text'), [(b['name'], b['input']) for b in content if b['type'] == 'tool_use']


def chat_fields(d):
    m = d['choices'][0]['message']
    calls = [(c['function']['name'], json.loads(c['function']['arguments'])) for c in m.get('tool_calls') or []]
    return m.get('reasoning_content') or '', m.get('content') or '', calls


def same_answer(name, msg, chat):
    """None if Anthropic message MSG says what chat completion CHAT says, else why not."""
    if msg.get('type') != 'message' or msg.get('role') != 'assistant' or not str(msg.get('id', '')).startswith('msg_'):
        return 'not a message: %r' % msg
    got, want = blocks_of(msg['content']), chat_fields(chat)
    if list(got) != list(want):
        return 'blocks %r, the chat answer %r' % (got, want)
    if msg['stop_reason'] != STOP_REASON[chat['choices'][0]['finish_reason']]:
        return 'stop_reason %r, finish_reason %r' % (msg['stop_reason'], chat['choices'][0]['finish_reason'])
    u, cu = msg['usage'], chat['usage']
    if u['input_tokens'] + u['cache_read_input_tokens'] != cu['prompt_tokens'] or u['output_tokens'] != cu['completion_tokens']:
        return 'usage %r, the chat usage %r' % (u, cu)
    return None


def rebuild(events):
    """The message a stream of events builds, checking their order as the SDK's accumulator relies on it."""
    assert events[0][0] == 'message_start' and events[-1][0] == 'message_stop', 'first %s, last %s' % (events[0][0], events[-1][0])
    msg, open_index = events[0][1]['message'], None
    for name, d in events[1:-1]:
        if name == 'ping':
            continue
        if name == 'content_block_start':
            assert open_index is None and d['index'] == len(msg['content']), 'block %d starts at %d' % (d['index'], len(msg['content']))
            msg['content'].append(dict(d['content_block'], partial=''))
            open_index = d['index']
        elif name == 'content_block_delta':
            assert d['index'] == open_index, 'a delta of block %d while %r is open' % (d['index'], open_index)
            delta, block = d['delta'], msg['content'][d['index']]
            key = {'text_delta': 'text', 'thinking_delta': 'thinking', 'input_json_delta': 'partial_json'}[delta['type']]
            if key == 'partial_json':
                block['partial'] += delta[key]
            else:
                block[key] += delta[key]
        elif name == 'content_block_stop':
            assert d['index'] == open_index, 'block %d stops while %r is open' % (d['index'], open_index)
            block = msg['content'][open_index]
            if block['type'] == 'tool_use':
                block['input'] = json.loads(block['partial'])
            open_index = None
        elif name == 'message_delta':
            assert open_index is None, 'message_delta with block %d open' % open_index
            msg.update(d['delta'])
            msg['usage'].update(d['usage'])
        else:
            raise AssertionError('unexpected event %s' % name)
    return msg


answers = []
for name, anthropic, chat in CASES:
    s1, msg = post('/v1/messages', greedy(anthropic))
    s2, want = post('/v1/chat/completions', greedy(chat))
    why = 'status %d %d: %r' % (s1, s2, msg) if (s1, s2) != (200, 200) else same_answer(name, msg, want)
    if why:
        bad(name, why)
    else:
        ok('%s: the answer of the chat request it means' % name)
    answers.append((msg, want))
forced = answers[2][0]
if forced.get('content') and (forced['content'][0].get('type') == 'tool_use' or forced['content'][0].get('text', '').startswith('<tool_call>')):
    ok('tool_choice tool: the answer opens the call (a tool_use block, or its text when the model wrote it badly)')
else:
    bad('tool_choice tool', forced)

# streamed: the events rebuild the unstreamed message
status, headers, text = send('POST', '/v1/messages', dict(greedy(CASES[1][1]), stream=True))
try:
    assert status == 200 and headers.get('Content-Type', '').startswith('text/event-stream'), 'status %d %s' % (status, headers.get('Content-Type'))
    built, whole = rebuild(events_of(text)), answers[1][0]
    for block in built['content']:
        block.pop('partial')
    assert blocks_of(built['content']) == blocks_of(whole['content']), 'streamed %r, whole %r' % (blocks_of(built['content']), blocks_of(whole['content']))
    assert (built['stop_reason'], built['stop_sequence']) == (whole['stop_reason'], whole['stop_sequence']), 'stop %r' % built['stop_reason']
    u, w = built['usage'], whole['usage']
    assert u['output_tokens'] == w['output_tokens'] and u['input_tokens'] + u['cache_read_input_tokens'] == w['input_tokens'] + w['cache_read_input_tokens'], \
        'usage %r, whole %r' % (u, w)
    ok('stream: named events in order (message_start, blocks started, their deltas, stopped, message_delta, message_stop) rebuild the answer')
except (AssertionError, ValueError, KeyError, IndexError) as e:
    bad('stream', '%s: %s' % (type(e).__name__, e))

# count_tokens: the prompt's tokens, as the chat request's usage counts them
status, d = post('/v1/messages/count_tokens', dict(CASES[1][1], model=model))
if status == 200 and d == {'input_tokens': answers[1][1]['usage']['prompt_tokens']}:
    ok('count_tokens: {"input_tokens": N}, N the prompt tokens of the chat request it means')
else:
    bad('count_tokens', '%d %r, want %d' % (status, d, answers[1][1]['usage']['prompt_tokens']))

# stop_sequences: the text cut before the first one, which is named
text = blocks_of(answers[0][0]['content'])[1]
stop = next((text[i:i + 3] for i in range(len(text) // 3, len(text) - 3) if text.find(text[i:i + 3]) >= 2 and text[i:i + 3].strip()), None)
if stop is None:
    bad('stop_sequences', 'no stop string to pick in %r' % text)
else:
    status, d = post('/v1/messages', greedy(dict(CASES[0][1], stop_sequences=['zzzz', stop])))
    got = blocks_of(d.get('content', []))[1] if status == 200 else None
    if got == text[:text.find(stop)].strip() and d['stop_reason'] == 'stop_sequence' and d['stop_sequence'] == stop:
        ok('stop_sequences: cut before the first, stop_reason stop_sequence naming it')
    else:
        bad('stop_sequences', '%d %r for %r in %r' % (status, d, stop, text))

# a prefill (the last message the assistant's): the answer goes on from it, as the raw completion of the conversation's
# prompt (thinking off) followed by the prefill's text; a chat with continue_final_message the same
status, d = post('/apply-template', {'messages': [{'role': 'user', 'content': 'Hello'}], 'chat_template_kwargs': {'enable_thinking': False}})
prompt = d.get('prompt', '') + 'Sure, here'
s1, msg = post('/v1/messages', greedy({'messages': [{'role': 'user', 'content': 'Hello'}, {'role': 'assistant', 'content': 'Sure, here'}]}))
s2, comp = post('/v1/completions', greedy({'prompt': prompt}))
s3, chat = post('/v1/chat/completions', greedy({'messages': [{'role': 'user', 'content': 'Hello'}, {'role': 'assistant', 'content': 'Sure, here'}],
                                                'continue_final_message': True}))
try:
    want = comp['choices'][0]['text'].strip(' \t\r\n')
    got = blocks_of(msg['content'])[1]
    assert (status, s1, s2, s3) == (200,) * 4, 'status %r' % ((status, s1, s2, s3),)
    assert got == want and chat['choices'][0]['message']['content'] == want, 'prefill %r, chat %r, completion %r' % (got, chat['choices'][0]['message'], want)
    assert msg['usage']['input_tokens'] + msg['usage']['cache_read_input_tokens'] == comp['usage']['prompt_tokens'], 'usage %r, %r' % (msg['usage'], comp['usage'])
    ok('a prefill: the answer goes on from the assistant\'s text (= the raw completion of the prompt and it; = continue_final_message)')
except (AssertionError, KeyError, IndexError, TypeError) as e:
    bad('prefill', '%s: %s' % (type(e).__name__, e))
status, d = post('/v1/chat/completions', greedy({'messages': [{'role': 'user', 'content': 'Hello'}], 'continue_final_message': True}))
s2, d2 = post('/v1/messages', greedy({'messages': [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': '{'}],
                                      'output_format': {'type': 'json_schema', 'schema': {'type': 'object'}}}))
if status == 400 and d['error']['param'] == 'continue_final_message' and s2 == 400 and 'continue_final_message' in d2['error']['message']:
    ok('continue_final_message without an assistant\'s message last, or with a JSON format: 400')
else:
    bad('continue_final_message refusals', '%d %r; %d %r' % (status, d, s2, d2))

# a forced call of a tool whose parameters are all typed: the whole call is held to the form (sample_call), so even
# these random weights give a call the parser reads, each value of its type; the same through both APIs, streamed too
ALARM_SCHEMA = {'type': 'object', 'properties': {'hour': {'type': 'integer'}, 'loud': {'type': 'boolean'}, 'day': {'enum': ['mon', 'tue']}},
                'required': ['hour', 'day']}
ALARM = [{'name': 'set_alarm', 'description': 'Set an alarm', 'input_schema': ALARM_SCHEMA}]
CHAT_ALARM = [{'type': 'function', 'function': {'name': 'set_alarm', 'description': 'Set an alarm', 'parameters': ALARM_SCHEMA}}]


def alarm_ok(args):
    return (isinstance(args, dict) and set(args) <= {'hour', 'loud', 'day'} and type(args.get('hour')) is int and args.get('day') in ('mon', 'tue')
            and type(args.get('loud', True)) is bool)


ask = [{'role': 'user', 'content': 'Wake me up'}]
for label, choice, chat_choice in [('any', {'type': 'any'}, 'required'),
                                   ('tool', {'type': 'tool', 'name': 'set_alarm'}, {'type': 'function', 'function': {'name': 'set_alarm'}})]:
    s1, msg = post('/v1/messages', greedy({'tools': ALARM, 'tool_choice': choice, 'messages': ask}, 300))
    s2, chat = post('/v1/chat/completions', greedy({'tools': CHAT_ALARM, 'tool_choice': chat_choice, 'messages': ask}, 300))
    s3, headers, text = send('POST', '/v1/messages', dict(greedy({'tools': ALARM, 'tool_choice': choice, 'messages': ask}, 300), stream=True))
    try:
        assert (s1, s2, s3) == (200, 200, 200), 'status %r' % ((s1, s2, s3),)
        calls = [b for b in msg['content'] if b['type'] == 'tool_use']
        chat_calls = chat['choices'][0]['message'].get('tool_calls') or []
        assert len(calls) == 1 and calls[0]['name'] == 'set_alarm' and alarm_ok(calls[0]['input']), 'message %r' % msg['content']
        assert msg['stop_reason'] == 'tool_use' and chat['choices'][0]['finish_reason'] == 'tool_calls', 'stop %r' % msg['stop_reason']
        assert [(c['function']['name'], json.loads(c['function']['arguments'])) for c in chat_calls] == [('set_alarm', calls[0]['input'])], \
            'chat %r' % chat_calls
        built = rebuild(events_of(text))
        assert [(b['type'], b.get('name'), b.get('input')) for b in built['content']] == [('tool_use', 'set_alarm', calls[0]['input'])], \
            'streamed %r' % built['content']
        ok('tool_choice %s on a typed tool: a call the parser reads (%s), the same as chat\'s, streamed as a tool_use block' %
           (label, json.dumps(calls[0]['input'], sort_keys=True)[:60]))
    except (AssertionError, KeyError, IndexError, TypeError, ValueError) as e:
        bad('tool_choice %s on a typed tool' % label, '%s: %s' % (type(e).__name__, e))

# a call the model chooses to open (tool_choice auto; a bias makes it open one whenever it may): each call it opens is
# held to the form too, and the answer is free between them, so it goes on opening calls until max_tokens
status, d = post('/tokenize', {'content': '<tool_call>'})
bias = {str(d['tokens'][0]): 100} if status == 200 and len(d.get('tokens', [])) == 1 else None
if bias is None:
    bad('auto calls', 'the vocabulary has no <tool_call> token: %r' % d)
else:
    s1, msg = post('/v1/messages', dict(greedy({'tools': ALARM, 'messages': ask}, 400), logit_bias=bias))
    s2, chat = post('/v1/chat/completions', dict(greedy({'tools': CHAT_ALARM, 'messages': ask}, 400), logit_bias=bias))
    try:
        assert (s1, s2) == (200, 200), 'status %r: %r %r' % ((s1, s2), msg, chat)
        calls = [b['input'] for b in msg['content'] if b['type'] == 'tool_use']
        chat_calls = [json.loads(c['function']['arguments']) for c in chat['choices'][0]['message'].get('tool_calls') or []]
        assert len(calls) >= 2 and all(alarm_ok(a) for a in calls), 'calls %r' % msg['content']
        assert calls == chat_calls, 'chat %r' % chat_calls
        ok('tool_choice auto, the model pushed to open calls: each of its %d calls the parser reads, typed; the same as chat\'s' % len(calls))
    except (AssertionError, KeyError, IndexError, TypeError, ValueError) as e:
        bad('auto calls', '%s: %s' % (type(e).__name__, e))

# a thinking budget (thinking_budget_tokens, Anthropic's budget_tokens, the server's --reasoning-budget 40): the thoughts
# are the unbounded answer's first N tokens (and a message if asked), then </think> is forced and the answer goes on to
# max_tokens. (That the forced tokens are fed as sampled ones is test_serve.c's, by token ids: a raw prompt of this
# text would be tokenized otherwise, "\n\n" one token where the close put two.)
think = {'chat_template_kwargs': {'enable_thinking': True}}
why = [{'role': 'user', 'content': 'Why is the sky blue?'}]
status, d = post('/apply-template', dict(think, messages=why))
opened = d.get('prompt', '')


def thoughts(n):
    """The raw text of the first N tokens the model thinks, unbounded."""
    status, comp = post('/v1/completions', greedy({'prompt': opened}, n))
    return comp['choices'][0]['text'] if status == 200 and comp['choices'][0]['finish_reason'] == 'length' and '</think>' not in comp['choices'][0]['text'] else None


for label, fields, n, message in [('thinking_budget_tokens 5', {'thinking_budget_tokens': 5}, 5, ''),
                                  ('thinking_budget_tokens 0', {'thinking_budget_tokens': 0}, 0, ''),
                                  ('thinking_budget_tokens 3 with a message', {'thinking_budget_tokens': 3, 'thinking_budget_message': ' Time to answer.'}, 3,
                                   ' Time to answer.'),
                                  ('the server\'s --reasoning-budget 40', {}, 40, '')]:
    before = thoughts(n) if n else ''
    status, chat = post('/v1/chat/completions', greedy(dict(think, messages=why, **fields), n + 30))
    try:
        assert before is not None and opened.endswith('<think>\n'), 'the prompt %r, the unbounded thoughts %r' % (opened[-20:], before)
        m = chat['choices'][0]['message']
        assert status == 200 and m.get('reasoning_content', '') == (before + message).strip('\n'), 'reasoning %r, want %r' % (m, before + message)
        assert m.get('content') and chat['usage']['completion_tokens'] > n + 1, \
            'content %r, %r' % (m.get('content'), chat['usage'])
        ok('%s: the unbounded thoughts cut there, </think> forced, the answer on after it' % label)
    except (AssertionError, KeyError, IndexError, TypeError) as e:
        bad(label, '%s: %s' % (type(e).__name__, e))
status, unbounded = post('/v1/chat/completions', greedy(dict(think, messages=why, thinking_budget_tokens=-1), 50))
unbounded = unbounded.get('choices', [{}])[0].get('message', {}).get('reasoning_content', '')
if status == 200 and unbounded.startswith(thoughts(40).strip('\n')) and len(unbounded) > len(thoughts(40).strip('\n')):
    ok('thinking_budget_tokens -1: no bound, even beside the server\'s --reasoning-budget')
else:
    bad('thinking_budget_tokens -1', '%d %r' % (status, unbounded))
s1, msg = post('/v1/messages', greedy({'messages': why, 'thinking': {'type': 'enabled', 'budget_tokens': 4}}, 24))
s2, chat = post('/v1/chat/completions', greedy(dict(think, messages=why, thinking_budget_tokens=4), 24))
why_not = 'status %d %d' % (s1, s2) if (s1, s2) != (200, 200) else same_answer('budget_tokens', msg, chat)
if why_not:
    bad('budget_tokens', why_not)
else:
    ok('budget_tokens 4: the thinking block and text of the chat request with thinking_budget_tokens 4')
for label, path, body, param in [('a budget on a raw prompt', '/v1/completions', greedy({'prompt': opened, 'thinking_budget_tokens': 4}), 'thinking_budget_tokens'),
                                 ('a budget of -2', '/v1/chat/completions', greedy({'messages': why, 'thinking_budget_tokens': -2}), 'thinking_budget_tokens'),
                                 ('a message that is not a string', '/v1/chat/completions', greedy({'messages': why, 'thinking_budget_message': 7}),
                                  'thinking_budget_message')]:
    status, d = post(path, body)
    if status == 400 and d.get('error', {}).get('param') == param:
        ok('%s: 400 naming %s' % (label, param))
    else:
        bad(label, '%d %r' % (status, d))
status, d = post('/v1/messages', greedy({'messages': why, 'thinking': {'type': 'enabled', 'budget_tokens': 1.5}}))
if status == 400 and 'budget_tokens' in d.get('error', {}).get('message', ''):
    ok('budget_tokens 1.5: 400 naming it')
else:
    bad('budget_tokens 1.5', '%d %r' % (status, d))

# an answer that fills the context before max_tokens (1024 here): stop_reason model_context_window_exceeded, where the
# same request with room for its max_tokens stops with max_tokens
s1, full = post('/v1/messages', dict(greedy({'messages': why}, 5000), ignore_eos=True))
s2, short = post('/v1/messages', dict(greedy({'messages': why}, 8), ignore_eos=True))
try:
    u = full['usage']
    assert (s1, s2) == (200, 200), 'status %r' % ((s1, s2),)
    assert full['stop_reason'] == 'model_context_window_exceeded' and u['input_tokens'] + u['cache_read_input_tokens'] + u['output_tokens'] == 1024, \
        'stop_reason %r, usage %r' % (full['stop_reason'], u)
    assert short['stop_reason'] == 'max_tokens', 'max_tokens 8: stop_reason %r' % short['stop_reason']
    ok('max_tokens beyond the context: stop_reason model_context_window_exceeded when it fills (max_tokens within it: max_tokens)')
except (AssertionError, KeyError, TypeError) as e:
    bad('context window exceeded', '%s: %s' % (type(e).__name__, e))

# a long prompt streamed: ping events while it is computed (this server: COLI_PING_SECONDS=0.005), so a client's idle
# watchdog sees bytes; the events still rebuild the unstreamed message
long_ask = {'messages': [{'role': 'user', 'content': 'word ' * 480}], 'cache_prompt': False}  # 973 tokens, computed each time
s1, whole = post('/v1/messages', greedy(long_ask, 4))
s2, headers, text = send('POST', '/v1/messages', dict(greedy(long_ask, 4), stream=True))
try:
    assert (s1, s2) == (200, 200), 'status %r' % ((s1, s2),)
    events = events_of(text)
    pings = [i for i, (name, _) in enumerate(events) if name == 'ping']
    built = rebuild(events)
    for block in built['content']:
        block.pop('partial')
    assert pings and pings[0] == 1, 'pings at %r of %d events' % (pings, len(events))
    assert blocks_of(built['content']) == blocks_of(whole['content']) and built['stop_reason'] == whole['stop_reason'], \
        'streamed %r, whole %r' % (blocks_of(built['content']), blocks_of(whole['content']))
    ok('a long prompt streamed: %d ping events while it was computed, then the same message' % len(pings))
except (AssertionError, ValueError, KeyError, IndexError) as e:
    bad('pings', '%s: %s' % (type(e).__name__, e))

# errors in Anthropic's shape
def is_error(status, text, want_status, want_type, words):
    try:
        d = json.loads(text)
        return status == want_status and d['type'] == 'error' and d['error']['type'] == want_type and words in d['error']['message']
    except (ValueError, KeyError, TypeError):
        return False


for label, method, path, body, want_status, want_type, words in [
        ('a body that is not JSON', 'POST', '/v1/messages', b'{"messages": [', 400, 'invalid_request_error', 'not valid JSON'),
        ('a server tool', 'POST', '/v1/messages', greedy({'messages': [{'role': 'user', 'content': 'hi'}],
                                                          'tools': [{'type': 'web_search_20250305', 'name': 'web_search'}]}),
         400, 'invalid_request_error', 'server tools'),
        ('a prompt longer than the context', 'POST', '/v1/messages', greedy({'messages': [{'role': 'user', 'content': 'word ' * 1500}]}),
         400, 'invalid_request_error', 'context'),
        ('GET /v1/messages', 'GET', '/v1/messages', None, 405, 'invalid_request_error', 'takes POST'),
        ('an unknown path under /v1/messages', 'POST', '/v1/messages/batches', b'{}', 404, 'not_found_error', 'no endpoint')]:
    status, _, text = send(method, path, body)
    if is_error(status, text, want_status, want_type, words):
        ok('%s: %d %s, in Anthropic\'s error shape' % (label, want_status, want_type))
    else:
        bad(label, '%d %s' % (status, text[:300]))

first = answers[0][0]
with open(expect_path, 'w') as f:
    json.dump({'system': CASES[0][1]['system'], 'messages': CASES[0][1]['messages'], 'n': 16, 'text': blocks_of(first.get('content', []))[1],
               'stop_reason': first.get('stop_reason'), 'prompt_tokens': answers[0][1]['usage']['prompt_tokens']}, f)
sys.exit(1 if serve_api.failed else 0)
