// serve_anthropic: the official `@anthropic-ai/sdk` npm client against a running `coli serve` (tests/test_serve.sh).
// usage: node tests/serve_anthropic.mjs NPM_PREFIX BASE_URL MODEL_ID EXPECT.json
// NPM_PREFIX holds node_modules/@anthropic-ai/sdk; EXPECT.json (from tests/serve_anthropic.py): {system, messages, n,
// text, stop_reason, prompt_tokens}, the greedy answer the server gave that request. Prints `ok - ...` / `FAIL - ...`
// lines; exit status 1 on a failure.
import { setup } from './npm_client.mjs';

const { baseURL, model, want, check, done, Client: Anthropic, version } =
    await setup('serve_anthropic.mjs', 'anthropic client', '@anthropic-ai/sdk', 'Anthropic');
const show = (v) => JSON.stringify(v);
const client = new Anthropic({ baseURL, apiKey: 'none', maxRetries: 0, timeout: 20000 });
const req = { model, system: want.system, messages: want.messages, max_tokens: want.n, temperature: 0 };
const textOf = (msg) => msg.content.filter((b) => b.type === 'text').map((b) => b.text).join('');

await check(`models.list has ${model} (@anthropic-ai/sdk ${version})`, async () => {
    const models = [];
    for await (const m of client.models.list()) models.push(m);
    const m = models.find((x) => x.id === model);
    return m && m.type === 'model' && !Number.isNaN(Date.parse(m.created_at)) ? null : `models ${show(models)}`;
});

await check(`models.retrieve(${model})`, async () => {
    const m = await client.models.retrieve(model);
    return m.id === model && m.type === 'model' && m.display_name === model ? null : `model ${show(m)}`;
});

await check('messages.create: the greedy answer', async () => {
    const msg = await client.messages.create(req);
    if (msg.type !== 'message' || msg.role !== 'assistant') return `type ${show(msg.type)}, role ${show(msg.role)}`;
    if (textOf(msg) !== want.text) return `text ${show(textOf(msg))}, want ${show(want.text)}`;
    if (msg.stop_reason !== want.stop_reason) return `stop_reason ${show(msg.stop_reason)}`;
    const u = msg.usage;
    if (u.input_tokens + u.cache_read_input_tokens !== want.prompt_tokens || !(u.output_tokens > 0)) return `usage ${show(u)}`;
    return null;
});

await check('messages.stream: text events and finalMessage() give the same answer', async () => {
    let text = '';
    const stream = client.messages.stream(req).on('text', (t) => {
        text += t;
    });
    const msg = await stream.finalMessage();
    if (text !== want.text) return `text events ${show(text)}, want ${show(want.text)}`;
    if (textOf(msg) !== want.text || msg.stop_reason !== want.stop_reason) return `finalMessage ${show(msg)}`;
    if (msg.usage.input_tokens + msg.usage.cache_read_input_tokens !== want.prompt_tokens) return `usage ${show(msg.usage)}`;
    return null;
});

await check('messages.countTokens: the prompt tokens', async () => {
    const r = await client.messages.countTokens({ model, system: want.system, messages: want.messages });
    return r.input_tokens === want.prompt_tokens ? null : `${show(r)}, want ${want.prompt_tokens}`;
});

await check('a bad request throws BadRequestError (400, invalid_request_error)', async () => {
    try {
        await client.messages.create({ ...req, thinking: { type: 'sometimes' } });
    } catch (e) {
        if (e instanceof Anthropic.BadRequestError && e.status === 400 && e.error?.error?.type === 'invalid_request_error') return null;
        return `${e?.constructor?.name} ${e?.status} ${show(e?.error)}`;
    }
    return 'no error';
});

done();
