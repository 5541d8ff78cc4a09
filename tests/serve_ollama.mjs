// serve_ollama: the official `ollama` npm client against a running `coli serve` (tests/test_serve.sh).
// usage: node tests/serve_ollama.mjs NPM_PREFIX BASE_URL MODEL_ID EXPECT.json
// EXPECT.json: serve_openai.mjs's ({chat_prompt, chat_text, raw_prompt, raw_text, n}: the greedy texts of `coli run`).
// Prints `ok - ...` / `FAIL - ...` lines; exit status 1 on a failure.
import { setup } from './npm_client.mjs';

const { baseURL, model, want, check, done, Client: Ollama, version } = await setup('serve_ollama.mjs', 'ollama client', 'ollama', 'Ollama');
const show = (v) => JSON.stringify(v);
const client = new Ollama({ host: baseURL });
const options = { temperature: 0, num_predict: want.n };
const messages = [{ role: 'user', content: want.chat_prompt }];

await check(`list has ${model}, show its details (ollama ${version})`, async () => {
    const { models } = await client.list();
    const info = await client.show({ model });
    if (!models.some((m) => m.name === model && m.details?.format === 'gguf')) return `models ${show(models)}`;
    return info.details?.family && Object.keys(info.model_info ?? {}).some((k) => k.endsWith('.context_length')) ? null : `show ${show(info)}`;
});

await check('chat: the greedy text of coli run --chat', async () => {
    const r = await client.chat({ model, messages, options });
    if (r.message?.content !== want.chat_text) return `content ${show(r.message?.content)}, want ${show(want.chat_text)}`;
    return r.done && ['stop', 'length'].includes(r.done_reason) && r.eval_count > 0 ? null : `done ${show(r)}`;
});

await check('chat stream (for await): the same text, the last part done', async () => {
    let text = '';
    let last = null;
    for await (const part of await client.chat({ model, messages, options, stream: true })) {
        text += part.message?.content ?? '';
        last = part;
    }
    if (text !== want.chat_text) return `content ${show(text)}, want ${show(want.chat_text)}`;
    return last?.done && last.eval_count > 0 ? null : `last part ${show(last)}`;
});

await check('generate raw: the greedy text of coli run -p', async () => {
    const r = await client.generate({ model, prompt: want.raw_prompt, raw: true, options });
    return r.response === want.raw_text ? null : `response ${show(r.response)}, want ${show(want.raw_text)}`;
});

await check('a bad option: ResponseError, status 400, the message naming it', async () => {
    try {
        await client.chat({ model, messages, options: { num_predict: 0 } });
    } catch (e) {
        return e.status_code === 400 && /num_predict/.test(e.error ?? e.message) ? null : `threw ${e?.name} ${e?.status_code}: ${e?.message}`;
    }
    return 'no error';
});

done();
