// serve_anthropic: the official `@anthropic-ai/sdk` npm client against a running `coli serve` (tests/test_serve.sh).
// usage: node tests/serve_anthropic.mjs NPM_PREFIX BASE_URL MODEL_ID EXPECT.json
// NPM_PREFIX holds node_modules/@anthropic-ai/sdk; EXPECT.json (from tests/serve_anthropic.py): {system, messages, n,
// text, stop_reason, prompt_tokens}, the greedy answer the server gave that request. Prints `ok - ...` / `FAIL - ...`
// lines; exit status 1 on a failure.
import { createRequire } from 'node:module';
import { readFileSync } from 'node:fs';
import path from 'node:path';

const [prefix, baseURL, model, expectFile] = process.argv.slice(2);
if (!prefix || !baseURL || !model || !expectFile) {
    console.error('usage: node serve_anthropic.mjs NPM_PREFIX BASE_URL MODEL_ID EXPECT.json');
    process.exit(2);
}
const want = JSON.parse(readFileSync(expectFile, 'utf8'));
let failed = 0;
const ok = (name) => console.log(`ok - anthropic client: ${name}`);
const bad = (name, why) => {
    console.log(`FAIL - anthropic client: ${name}: ${String(why).replace(/\s+/g, ' ').slice(0, 400)}`);
    failed++;
};
const show = (v) => JSON.stringify(v);

// check NAME async-fn: fn returns null when fine, else why not; a throw is a failure too
async function check(name, fn) {
    try {
        const why = await fn();
        if (why == null) ok(name);
        else bad(name, why);
    } catch (e) {
        bad(name, `${e?.constructor?.name}: ${e?.message ?? e}`);
    }
}

let Anthropic, version;
try {
    const require = createRequire(path.join(prefix, 'package.json'));
    const m = require('@anthropic-ai/sdk');
    Anthropic = m.default ?? m.Anthropic ?? m;
    version = JSON.parse(readFileSync(path.join(prefix, 'node_modules', '@anthropic-ai', 'sdk', 'package.json'), 'utf8')).version;
} catch (e) {
    bad('import @anthropic-ai/sdk', e?.message ?? e);
    process.exit(1);
}
const client = new Anthropic({ baseURL, apiKey: 'none', maxRetries: 0, timeout: 20000 });
const req = { model, system: want.system, messages: want.messages, max_tokens: want.n, temperature: 0 };
const textOf = (msg) => msg.content.filter((b) => b.type === 'text').map((b) => b.text).join('');

await check(`messages.create: the greedy answer (@anthropic-ai/sdk ${version})`, async () => {
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

process.exit(failed ? 1 : 0);
