// serve_openai: the official `openai` npm client against a running `coli serve` (tests/test_serve.sh).
// usage: node tests/serve_openai.mjs NPM_PREFIX BASE_URL MODEL_ID EXPECT.json
// NPM_PREFIX holds node_modules/openai; EXPECT.json: {chat_prompt, chat_text, raw_prompt, raw_text, n}
// (the greedy texts of `coli run`). Prints `ok - ...` / `FAIL - ...` lines; exit status 1 on a failure.
import { setup } from './npm_client.mjs';

const { baseURL, model, want, check, done, Client: OpenAI, version } =
    await setup('serve_openai.mjs', 'openai client', 'openai', 'OpenAI');
const show = (v) => JSON.stringify(v);
const client = new OpenAI({ baseURL, apiKey: 'none', maxRetries: 0, timeout: 20000 });
const chatReq = { model, messages: [{ role: 'user', content: want.chat_prompt }], max_tokens: want.n, temperature: 0 };

await check(`models.list has ${model} (openai ${version})`, async () => {
    const ids = [];
    for await (const m of client.models.list()) ids.push(m.id);
    return ids.includes(model) ? null : `ids ${show(ids)}`;
});

await check(`models.retrieve(${model})`, async () => {
    const m = await client.models.retrieve(model);
    return m.id === model && m.object === 'model' ? null : `model ${show(m)}`;
});

await check('chat.completions.create: the greedy text of coli run --chat', async () => {
    const r = await client.chat.completions.create(chatReq);
    const c = r.choices?.[0];
    if (r.object !== 'chat.completion') return `object ${show(r.object)}`;
    if (c?.message?.role !== 'assistant') return `role ${show(c?.message?.role)}`;
    if (c.message.content !== want.chat_text) return `content ${show(c.message.content)}, want ${show(want.chat_text)}`;
    if (!['stop', 'length'].includes(c.finish_reason)) return `finish_reason ${show(c.finish_reason)}`;
    const u = r.usage;
    if (!u || u.prompt_tokens + u.completion_tokens !== u.total_tokens) return `usage ${show(u)}`;
    return null;
});

await check('chat.completions.create stream (for await): the same text, finish_reason, usage', async () => {
    const stream = await client.chat.completions.create({ ...chatReq, stream: true, stream_options: { include_usage: true } });
    let text = '';
    let role = null;
    let finish = null;
    let usage = null;
    let n = 0;
    for await (const chunk of stream) {
        n++;
        if (chunk.object !== 'chat.completion.chunk') return `object ${show(chunk.object)}`;
        if (chunk.usage) usage = chunk.usage;
        const c = chunk.choices?.[0];
        if (!c) continue;
        if (c.delta?.role && role == null) role = c.delta.role;
        text += c.delta?.content ?? '';
        if (c.finish_reason) finish = c.finish_reason;
    }
    if (role !== 'assistant') return `role ${show(role)}`;
    if (text !== want.chat_text) return `content ${show(text)}, want ${show(want.chat_text)}`;
    if (!['stop', 'length'].includes(finish)) return `finish_reason ${show(finish)}`;
    if (!usage || usage.prompt_tokens + usage.completion_tokens !== usage.total_tokens) return `usage ${show(usage)} (${n} chunks)`;
    return null;
});

await check('completions.create: the greedy text of coli run -p', async () => {
    const r = await client.completions.create({ model, prompt: want.raw_prompt, max_tokens: want.n, temperature: 0 });
    if (r.object !== 'text_completion') return `object ${show(r.object)}`;
    if (r.choices?.[0]?.text !== want.raw_text) return `text ${show(r.choices?.[0]?.text)}, want ${show(want.raw_text)}`;
    return null;
});

await check('completions.create stream: the same text', async () => {
    const stream = await client.completions.create({ model, prompt: want.raw_prompt, max_tokens: want.n, temperature: 0, stream: true });
    let text = '';
    for await (const chunk of stream) text += chunk.choices?.[0]?.text ?? '';
    return text === want.raw_text ? null : `text ${show(text)}, want ${show(want.raw_text)}`;
});

await check('chat.completions.create with logprobs, top_logprobs 2, logit_bias: a token each, the text unchanged', async () => {
    const r = await client.chat.completions.create({ ...chatReq, logprobs: true, top_logprobs: 2, logit_bias: { '0': 0 } });
    const c = r.choices?.[0];
    const lp = c?.logprobs?.content;
    if (c?.message?.content !== want.chat_text) return `content ${show(c?.message?.content)}, want ${show(want.chat_text)}`;
    if (!Array.isArray(lp) || lp.length !== r.usage.completion_tokens - (c.finish_reason === 'stop' ? 1 : 0)) return `logprobs ${show(c?.logprobs)}`;
    const badEntry = lp.find((t) => typeof t.logprob !== 'number' || t.top_logprobs?.length !== 2 || t.top_logprobs[0].logprob !== t.logprob);
    return badEntry ? `entry ${show(badEntry)}` : null;
});

await check('response_format json_schema: the text an object the schema admits (at most 5 x 32 whitespace bytes: it closes)', async () => {
    const schema = { type: 'object', properties: { c: { enum: ['red', 'blue'] } }, required: ['c'], additionalProperties: false };
    const r = await client.completions.create({ model, prompt: want.raw_prompt, max_tokens: 300, temperature: 1, seed: 4,
        response_format: { type: 'json_schema', json_schema: { name: 'color', strict: true, schema } } });
    const c = r.choices?.[0];
    let v;
    try { v = JSON.parse(c?.text); } catch (e) { return `text ${show(c?.text)}: ${e.message}`; }
    return c.finish_reason === 'stop' && ['red', 'blue'].includes(v.c) && Object.keys(v).join() === 'c' ? null : `${c.finish_reason}: ${show(c.text)}`;
});

const respReq = { model, input: want.chat_prompt, max_output_tokens: want.n, temperature: 0 };
await check('responses.create: output_text the greedy text of coli run --chat', async () => {
    const r = await client.responses.create(respReq);
    if (r.object !== 'response' || !['completed', 'incomplete'].includes(r.status)) return `object ${show(r.object)}, status ${show(r.status)}`;
    if (r.output_text !== want.chat_text) return `output_text ${show(r.output_text)}, want ${show(want.chat_text)}`;
    const u = r.usage;
    if (!u || u.input_tokens + u.output_tokens !== u.total_tokens) return `usage ${show(u)}`;
    return null;
});

await check('responses.stream: its deltas and finalResponse() (the SDK accumulates every event) the same text', async () => {
    const stream = client.responses.stream(respReq);
    let deltas = '';
    let last = null; // the response of the stream's last event (an answer cut at max_output_tokens ends in response.incomplete)
    stream.on('response.output_text.delta', (e) => { deltas += e.delta; });
    stream.on('event', (e) => { last = e.response ?? last; });
    const r = await stream.finalResponse();
    const text = r.output.filter((it) => it.type === 'message').flatMap((it) => it.content).map((p) => p.text).join('');
    if (text !== want.chat_text || deltas !== want.chat_text) return `text ${show(text)}, deltas ${show(deltas)}, want ${show(want.chat_text)}`;
    return ['completed', 'incomplete'].includes(last?.status) && last.usage?.output_tokens > 0 ? null : `the last event's response ${show(last)}`;
});

await check('a bad parameter: APIError (BadRequestError) with status 400, param max_tokens', async () => {
    try {
        await client.chat.completions.create({ ...chatReq, max_tokens: 'x' });
    } catch (e) {
        if (!(e instanceof OpenAI.APIError)) return `threw ${e?.constructor?.name}: ${e?.message}`;
        if (e.status !== 400) return `status ${e.status}`;
        if (OpenAI.BadRequestError && !(e instanceof OpenAI.BadRequestError)) return `not a BadRequestError: ${e.constructor.name}`;
        if (e.param !== 'max_tokens') return `param ${show(e.param)}, error ${show(e.error)}`;
        return null;
    }
    return 'no error';
});

done();
