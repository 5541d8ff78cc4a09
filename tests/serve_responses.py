# serve_responses: OpenAI's Responses API (/v1/responses) of a running `coli serve` against its own chat completions
# (tests/test_serve.sh). Each Responses request goes beside the chat request it means, written here by hand; both
# greedy, so the two answers must agree: reasoning, text, function calls, status, token counts. Then a stream's events
# (rebuilt as the SDK's accumulator does), a Codex-shaped history, forced calls of a namespace's tool, input_tokens,
# JSON output, reasoning_tokens (and chat's reasoning_effort, the same mapping), and refusals. Prints `ok - ...` / `FAIL - ...` lines.
# usage: python3 tests/serve_responses.py BASE_URL MODEL_ID
import json, sys
from serve_api import bad, events_of, ok, post, send, start
import serve_api

base, model = sys.argv[1:3]
start(base, model, 'responses')


def greedy(body, n=16):
    return serve_api.greedy(body, n, 'max_output_tokens' if 'input' in body else 'max_tokens')


SCHEMA = {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}
ALARM_SCHEMA = {'type': 'object', 'properties': {'hour': {'type': 'integer'}, 'loud': {'type': 'boolean'}, 'day': {'enum': ['mon', 'tue']}},
                'required': ['hour', 'day']}
# function tools at the top and in a namespace, and one only OpenAI runs (left out: the chat request has no such tool)
TOOLS = [{'type': 'function', 'name': 'get_weather', 'description': 'The weather in a city', 'parameters': SCHEMA, 'strict': False},
         {'type': 'namespace', 'name': 'clock', 'description': 'Alarms', 'tools': [
             {'type': 'function', 'name': 'set_alarm', 'description': 'Set an alarm', 'parameters': ALARM_SCHEMA}]},
         {'type': 'web_search', 'external_web_access': False}]
CHAT_TOOLS = [{'type': 'function', 'function': {'name': 'get_weather', 'description': 'The weather in a city', 'parameters': SCHEMA}},
              {'type': 'function', 'function': {'name': 'set_alarm', 'description': 'Set an alarm', 'parameters': ALARM_SCHEMA}}]
THINK = {'chat_template_kwargs': {'enable_thinking': True}}
# Codex's shape: developer messages first (the first the system message, the second a user turn), the user's, then a
# turn's reasoning, text and call (one assistant message), the call's output (a tool message), and the next user message
CODEX_INPUT = [
    {'type': 'message', 'role': 'developer', 'content': [{'type': 'input_text', 'text': 'You are a coding agent.'}]},
    {'type': 'message', 'role': 'developer', 'content': [{'type': 'input_text', 'text': 'Skills: none.'}]},
    {'type': 'message', 'role': 'user', 'content': [{'type': 'input_text', 'text': 'Weather in Bern?'}]},
    {'type': 'reasoning', 'id': 'rs_1', 'summary': [], 'content': [{'type': 'reasoning_text', 'text': 'A tool knows.'}], 'encrypted_content': None},
    {'type': 'message', 'role': 'assistant', 'content': [{'type': 'output_text', 'text': 'Checking.', 'annotations': []}]},
    {'type': 'function_call', 'name': 'get_weather', 'arguments': '{"city": "Bern"}', 'call_id': 'call_1'},
    {'type': 'function_call_output', 'call_id': 'call_1', 'output': '12 C, cloudy'},
    {'role': 'user', 'content': 'And in Paris?'}]
CODEX_CHAT = [{'role': 'system', 'content': 'You are a coding agent.'}, {'role': 'user', 'content': 'Skills: none.'},
              {'role': 'user', 'content': [{'type': 'text', 'text': 'Weather in Bern?'}]},
              {'role': 'assistant', 'content': 'Checking.', 'reasoning_content': 'A tool knows.',
               'tool_calls': [{'id': 'call_1', 'type': 'function', 'function': {'name': 'get_weather', 'arguments': '{"city": "Bern"}'}}]},
              {'role': 'tool', 'tool_call_id': 'call_1', 'content': '12 C, cloudy'}, {'role': 'user', 'content': 'And in Paris?'}]
CASES = [
    ('instructions and a string input',
     {'instructions': 'You are terse.', 'input': 'Hello'},
     {'messages': [{'role': 'system', 'content': 'You are terse.'}, {'role': 'user', 'content': 'Hello'}]}),
    ('a Codex-shaped history, thinking on (reasoning.effort high), tools',
     {'input': CODEX_INPUT, 'tools': TOOLS, 'reasoning': {'effort': 'high', 'summary': 'auto'}, 'store': False, 'include': ['reasoning.encrypted_content'],
      'prompt_cache_key': 'k'},
     dict(THINK, messages=CODEX_CHAT, tools=CHAT_TOOLS)),
    ('a call of a namespace\'s tool forced (tool_choice function)',
     {'input': 'Wake me up', 'tools': TOOLS, 'tool_choice': {'type': 'function', 'name': 'set_alarm'}},
     {'messages': [{'role': 'user', 'content': 'Wake me up'}], 'tools': CHAT_TOOLS,
      'tool_choice': {'type': 'function', 'function': {'name': 'set_alarm'}}}),
]


def items_of(output):
    """(reasoning, text, [(name, namespace, arguments)]) of a response's output items."""
    def texts(kind, part):
        return ''.join(p['text'] for it in output if it['type'] == kind for p in it['content'] if p['type'] == part)
    calls = [(it['name'], it.get('namespace'), json.loads(it['arguments'])) for it in output if it['type'] == 'function_call']
    return texts('reasoning', 'reasoning_text'), texts('message', 'output_text'), calls


def chat_fields(d):
    m = d['choices'][0]['message']
    calls = [(c['function']['name'], 'clock' if c['function']['name'] == 'set_alarm' else None, json.loads(c['function']['arguments']))
             for c in m.get('tool_calls') or []]
    return m.get('reasoning_content') or '', m.get('content') or '', calls


def same_answer(resp, chat):
    """None if response RESP says what chat completion CHAT says, else why not."""
    if resp.get('object') != 'response' or not str(resp.get('id', '')).startswith('resp_'):
        return 'not a response: %r' % resp
    got, want = items_of(resp['output']), chat_fields(chat)
    if list(got) != list(want):
        return 'items %r, the chat answer %r' % (got, want)
    finish = chat['choices'][0]['finish_reason']
    if resp['status'] != ('incomplete' if finish == 'length' else 'completed'):
        return 'status %r, finish_reason %r' % (resp['status'], finish)
    if (finish == 'length') != (resp['incomplete_details'] == {'reason': 'max_output_tokens'}):
        return 'incomplete_details %r' % resp['incomplete_details']
    u, cu = resp['usage'], chat['usage']
    if (u['input_tokens'], u['output_tokens'], u['total_tokens']) != (cu['prompt_tokens'], cu['completion_tokens'], cu['total_tokens']):
        return 'usage %r, the chat usage %r' % (u, cu)
    return None


def rebuild(events):
    """The response a stream's events build, checked as the openai SDK's accumulator checks them: response.created
    first, each delta to an item and content part already added, the done events' texts what the deltas made."""
    assert events[0][0] == 'response.created' and events[0][1]['response']['status'] == 'in_progress', 'first %r' % (events[0],)
    assert events[-1][0] in ('response.completed', 'response.incomplete', 'response.failed'), 'last %s' % events[-1][0]
    assert [d['sequence_number'] for _, d in events] == list(range(len(events))), 'sequence numbers'
    out, open_index = [], None
    for name, d in events[1:-1]:
        k = d.get('output_index')
        if name == 'response.in_progress':
            assert not out, 'in_progress after an item'
        elif name == 'response.output_item.added':
            assert open_index is None and k == len(out), 'item %r added at %d' % (k, len(out))
            out.append(d['item'])
            open_index = k
        elif name == 'response.content_part.added':
            assert k == open_index and d['content_index'] == 0 and d['item_id'] == out[k]['id'], 'part of %r' % k
            out[k]['content'].append(d['part'])
        elif name in ('response.output_text.delta', 'response.reasoning_text.delta'):
            assert k == open_index and out[k]['type'] == ('message' if 'output' in name else 'reasoning'), '%s of %r' % (name, out[k]['type'])
            out[k]['content'][0]['text'] += d['delta']
        elif name == 'response.function_call_arguments.delta':
            assert k == open_index and out[k]['type'] == 'function_call', 'arguments of %r' % out[k]['type']
            out[k]['arguments'] += d['delta']
        elif name in ('response.output_text.done', 'response.reasoning_text.done'):
            assert d['text'] == out[k]['content'][0]['text'], '%s text %r, the deltas %r' % (name, d['text'], out[k]['content'][0]['text'])
        elif name == 'response.content_part.done':
            assert d['part'] == out[k]['content'][0], 'part %r, built %r' % (d['part'], out[k]['content'][0])
        elif name == 'response.function_call_arguments.done':
            assert d['arguments'] == out[k]['arguments'], 'arguments %r' % d['arguments']
        elif name == 'response.output_item.done':
            assert k == open_index, 'item %r done while %r is open' % (k, open_index)
            built = dict(out[k], status='completed') if 'status' in out[k] else out[k]
            assert d['item'] == built, 'item %r, built %r' % (d['item'], built)
            out[k], open_index = d['item'], None
        else:
            raise AssertionError('unexpected event %s' % name)
    final = events[-1][1]['response']
    assert open_index is None or final['status'] == 'failed', 'item %r left open' % open_index
    assert final['output'] == out, 'the final output %r, the items built %r' % (final['output'], out)
    return final


answers = []
for name, resp_body, chat in CASES:
    s1, resp = post('/v1/responses', greedy(resp_body, 300))
    s2, want = post('/v1/chat/completions', greedy(chat, 300))
    why = 'status %d %d: %r' % (s1, s2, resp) if (s1, s2) != (200, 200) else same_answer(resp, want)
    if why:
        bad(name, why)
    else:
        ok('%s: the answer of the chat request it means' % name)
    answers.append(resp)


def alarm_ok(args):
    return (isinstance(args, dict) and set(args) <= {'hour', 'loud', 'day'} and type(args.get('hour')) is int and args.get('day') in ('mon', 'tue')
            and type(args.get('loud', True)) is bool)


try:
    calls = [it for it in answers[2]['output'] if it['type'] == 'function_call']
    assert len(calls) == 1 and calls[0]['name'] == 'set_alarm' and calls[0]['namespace'] == 'clock', 'items %r' % answers[2]['output']
    assert alarm_ok(json.loads(calls[0]['arguments'])) and calls[0]['call_id'].startswith('call_') and calls[0]['status'] == 'completed', calls[0]
    ok('the forced call: a function_call item naming its namespace (clock), typed arguments %s' % calls[0]['arguments'][:60])
except (AssertionError, KeyError, IndexError, TypeError, ValueError) as e:
    bad('the forced call', '%s: %s' % (type(e).__name__, e))

# streamed: the events rebuild the unstreamed response (this server pings every 5 ms: response.in_progress events
# while the prompt is computed)
for k in (1, 2):
    status, headers, text = send('POST', '/v1/responses', dict(greedy(CASES[k][1], 300), stream=True))
    try:
        assert status == 200 and headers.get('Content-Type', '').startswith('text/event-stream'), 'status %d %s' % (status, headers.get('Content-Type'))
        events = events_of(text)
        built, whole = rebuild(events), answers[k]
        assert items_of(built['output']) == items_of(whole['output']), 'streamed %r, whole %r' % (items_of(built['output']), items_of(whole['output']))
        assert (built['status'], built['usage']['output_tokens']) == (whole['status'], whole['usage']['output_tokens']), 'streamed %r' % built
        ok('%s, streamed: %d events in order (%d in_progress) rebuild the response' %
           (CASES[k][0], len(events), sum(n == 'response.in_progress' for n, _ in events)))
    except (AssertionError, ValueError, KeyError, IndexError, TypeError) as e:
        bad('%s, streamed' % CASES[k][0], '%s: %s' % (type(e).__name__, e))

# input_tokens: the prompt's tokens, as the response's usage counts them
status, d = post('/v1/responses/input_tokens', dict(CASES[1][1], model=model))
if status == 200 and d == {'object': 'response.input_tokens', 'input_tokens': answers[1]['usage']['input_tokens']}:
    ok('input_tokens: {"object": "response.input_tokens", "input_tokens": N}, N the prompt tokens of the response')
else:
    bad('input_tokens', '%d %r, want %d' % (status, d, answers[1]['usage']['input_tokens']))
status, d = post('/v1/responses/input_tokens', {'model': model, 'input': 5})
if status == 400 and d['error']['param'] == 'input':
    ok('input_tokens of a bad input: 400 naming input')
else:
    bad('input_tokens of a bad input', '%d %r' % (status, d))

# the next turn of an agent's loop: the history it sends back (the items it got, then its next message) reuses the
# last prompt up to its generation prompt, where the re-rendered answer (its thinking dropped) departs
s1, last = post('/v1/responses', greedy(CASES[1][1], 300))
s2, opening = post('/tokenize', {'content': '<|im_start|>assistant\n<think>\n'})
follow = CODEX_INPUT + last['output'] + [{'role': 'user', 'content': 'Thanks.'}]
status, d = post('/v1/responses', greedy({'input': follow, 'tools': TOOLS, 'reasoning': {'effort': 'high'}}, 4))
try:
    asked, reused = last['usage']['input_tokens'], d['usage']['input_tokens_details']['cached_tokens']
    assert (s1, s2, status) == (200, 200, 200) and not items_of(last['output'])[2], '%d %d %d, %r' % (s1, s2, status, last['output'])
    assert reused == asked - len(opening['tokens']) and d['usage']['input_tokens'] > asked, 'usage %r, the last prompt %d' % (d['usage'], asked)
    ok('the history sent back with the answer\'s items: %d of %d prompt tokens reused (the last prompt up to its opening of %d tokens)' %
       (reused, d['usage']['input_tokens'], len(opening['tokens'])))
except (AssertionError, KeyError, TypeError) as e:
    bad('the history sent back', '%s: %s' % (type(e).__name__, e))

# reasoning_tokens: all of an answer cut inside its think block; none without one; a budget's, its end forced
why = 'Why is the sky blue?'
for label, body, test in [('cut while thinking', {'reasoning': {'effort': 'low'}}, lambda u: u['output_tokens'] == 8 and u['reasoning'] == 8),
                          ('reasoning.effort none', {'reasoning': {'effort': 'none'}}, lambda u: u['reasoning'] == 0),
                          ('thinking_budget_tokens 3', {'reasoning': {'effort': 'low'}, 'thinking_budget_tokens': 3},
                           lambda u: 3 < u['reasoning'] <= 5 < u['output_tokens'])]:
    status, d = post('/v1/responses', greedy(dict(body, input=why), 8 if 'cut' in label else 40))
    u = d.get('usage') or {}
    u['reasoning'] = (u.get('output_tokens_details') or {}).get('reasoning_tokens')
    if status == 200 and isinstance(u['reasoning'], int) and test(u):
        ok('reasoning_tokens, %s: %d of %d' % (label, u['reasoning'], u['output_tokens']))
    else:
        bad('reasoning_tokens, %s' % label, '%d %r' % (status, d))

# chat's reasoning_effort: the same mapping ("none" no think block, any other one), the same reasoning_tokens
for effort, thinking in [('none', False), ('low', True)]:
    s1, chat = post('/v1/chat/completions', greedy({'messages': [{'role': 'user', 'content': why}], 'reasoning_effort': effort}, 24))
    s2, twin = post('/v1/chat/completions', greedy({'messages': [{'role': 'user', 'content': why}], 'chat_template_kwargs': {'enable_thinking': thinking}}, 24))
    s3, resp = post('/v1/responses', greedy({'input': why, 'reasoning': {'effort': effort}}, 24))
    try:
        assert (s1, s2, s3) == (200, 200, 200), (s1, s2, s3)
        assert chat['choices'][0]['message'] == twin['choices'][0]['message'], 'message %r, enable_thinking %r' % (chat['choices'][0], twin['choices'][0])
        counted = chat['usage']['completion_tokens_details']['reasoning_tokens']
        assert counted == resp['usage']['output_tokens_details']['reasoning_tokens'] and (counted > 0) == thinking, 'chat %r, response %r' % (
            chat['usage'], resp['usage'])
        ok('chat reasoning_effort %s: the answer of enable_thinking %s, %d reasoning_tokens as the response counts them' % (effort, thinking, counted))
    except (AssertionError, KeyError, IndexError, TypeError) as e:
        bad('chat reasoning_effort %s' % effort, '%s: %s' % (type(e).__name__, e))
status, d = post('/v1/chat/completions', greedy({'messages': [{'role': 'user', 'content': why}], 'reasoning_effort': 'extreme'}))
if status == 400 and d['error']['param'] == 'reasoning_effort':
    ok('chat reasoning_effort "extreme": 400 naming it')
else:
    bad('chat reasoning_effort "extreme"', '%d %r' % (status, d))

# text.format json_schema: the chat's response_format
schema = {'type': 'object', 'properties': {'c': {'enum': ['red', 'blue']}}, 'required': ['c'], 'additionalProperties': False}
s1, d = post('/v1/responses', greedy({'input': 'A color', 'text': {'format': {'type': 'json_schema', 'name': 'color', 'schema': schema, 'strict': True}}}, 300))
s2, chat = post('/v1/chat/completions', greedy({'messages': [{'role': 'user', 'content': 'A color'}],
                                                'response_format': {'type': 'json_schema', 'json_schema': {'schema': schema}}}, 300))
try:
    text = items_of(d['output'])[1]
    assert (s1, s2) == (200, 200) and text == chat['choices'][0]['message']['content'], '%d %d: %r, chat %r' % (s1, s2, text, chat)
    assert json.loads(text)['c'] in ('red', 'blue'), text
    ok('text.format json_schema: an object the schema admits (%s), the chat\'s response_format answer' % json.dumps(json.loads(text)))
except (AssertionError, KeyError, IndexError, TypeError, ValueError) as e:
    bad('text.format json_schema', '%s: %s' % (type(e).__name__, e))

# refusals: 400 in OpenAI's error shape, naming the parameter
for label, body, param in [
        ('previous_response_id (nothing is stored)', {'input': 'Hi', 'previous_response_id': 'resp_1'}, 'previous_response_id'),
        ('a conversation id', {'input': 'Hi', 'conversation': 'conv_1'}, 'conversation'),
        ('background', {'input': 'Hi', 'background': True}, 'background'),
        ('no input', {'instructions': 'Hi'}, 'input'),
        ('an item_reference', {'input': [{'type': 'item_reference', 'id': 'msg_1'}]}, 'input'),
        ('an input_file part', {'input': [{'role': 'user', 'content': [{'type': 'input_file', 'file_id': 'f'}]}]}, 'input'),
        ('a function_call without call_id', {'input': [{'type': 'function_call', 'name': 'f', 'arguments': '{}'}]}, 'input'),
        ('a role of "tool"', {'input': [{'role': 'tool', 'content': 'x'}]}, 'input'),
        ('a hosted tool_choice', {'input': 'Hi', 'tools': TOOLS, 'tool_choice': {'type': 'web_search'}}, 'tool_choice'),
        ('reasoning.effort "extreme"', {'input': 'Hi', 'reasoning': {'effort': 'extreme'}}, 'reasoning'),
        ('text.format json_schema without a schema', {'input': 'Hi', 'text': {'format': {'type': 'json_schema'}}}, 'text'),
        ('max_output_tokens 0', {'input': 'Hi', 'max_output_tokens': 0}, 'max_output_tokens'),
        ('a prompt longer than the context', {'input': 'word ' * 1500}, 'input')]:
    status, _, text = send('POST', '/v1/responses', dict(body, model=model))
    try:
        err = json.loads(text)['error']
        assert status == 400 and err['type'] == 'invalid_request_error' and err['param'] == param, '%d %r' % (status, err)
        ok('%s: 400 naming %s' % (label, param))
    except (AssertionError, ValueError, KeyError, TypeError) as e:
        bad(label, '%s: %d %s' % (e, status, text[:300]))
status, _, text = send('POST', '/v1/responses', dict(greedy({'input': [{'role': 'user', 'content': [{'type': 'input_image', 'image_url': 'data:'}]}]})))
if status == 400 and 'image' in json.loads(text)['error']['message']:
    ok('an input_image part: 400, images are not supported')
else:
    bad('an input_image part', '%d %s' % (status, text[:300]))
sys.exit(1 if serve_api.failed else 0)
