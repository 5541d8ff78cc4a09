// npm_client: what tests/serve_openai.mjs, tests/serve_anthropic.mjs and tests/serve_ollama.mjs share: their command
// line, the `ok - ` / `FAIL - ` lines tests/test_serve.sh counts, a check that turns a throw into a failure, and the
// client class loaded from an npm prefix (setup: all three).
import { createRequire } from 'node:module';
import { existsSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

// NPM_PREFIX BASE_URL MODEL_ID EXPECT.json from the command line, EXPECT.json read; a usage line and exit 2 if short.
function clientArgs(script) {
    const [prefix, baseURL, model, expectFile] = process.argv.slice(2);
    if (!prefix || !baseURL || !model || !expectFile) {
        console.error(`usage: node ${script} NPM_PREFIX BASE_URL MODEL_ID EXPECT.json`);
        process.exit(2);
    }
    return { prefix, baseURL, model, want: JSON.parse(readFileSync(expectFile, 'utf8')) };
}

// Lines labelled LABEL: ok(name), bad(name, why); check(name, fn) awaits fn, which returns null when fine, else why
// not (a throw fails too); done() exits, 1 if anything failed.
function reporter(label) {
    let failed = 0;
    const ok = (name) => console.log(`ok - ${label}: ${name}`);
    const bad = (name, why) => {
        console.log(`FAIL - ${label}: ${name}: ${String(why).replace(/\s+/g, ' ').slice(0, 400)}`);
        failed++;
    };
    async function check(name, fn) {
        try {
            const why = await fn();
            if (why == null) ok(name);
            else bad(name, why);
        } catch (e) {
            bad(name, `${e?.constructor?.name}: ${e?.message ?? e}`);
        }
    }
    return { ok, bad, check, done: () => process.exit(failed ? 1 : 0) };
}

// Package NAME from PREFIX's node_modules, its ES module entry if it has one, else require(): {module, version}.
async function loadPackage(prefix, name) {
    const dir = path.join(prefix, 'node_modules', name);
    const mjs = path.join(dir, 'index.mjs');
    const module = existsSync(mjs) ? await import(pathToFileURL(mjs).href) : createRequire(path.join(prefix, 'package.json'))(name);
    let version = '?';
    try {
        version = JSON.parse(readFileSync(path.join(dir, 'package.json'), 'utf8')).version;
    } catch {
        /* a package without its package.json still runs */
    }
    return { module, version };
}

// SCRIPT's command line, LABEL's reporter, and package NAME's client class (its export CLASS, or the default); a line
// FAIL and exit 1 when it cannot be loaded: {baseURL, model, want, ok, bad, check, done, Client, version}. (The ollama
// package's default export is an instance, so the named class comes first.)
export async function setup(script, label, name, exportName) {
    const args = clientArgs(script), report = reporter(label);
    try {
        const pkg = await loadPackage(args.prefix, name);
        return { ...args, ...report, Client: pkg.module[exportName] ?? pkg.module.default ?? pkg.module, version: pkg.version };
    } catch (e) {
        report.bad(`import ${name}`, e?.message ?? e);
        return report.done();
    }
}
