/* test_serve: the parts of `coli serve` that need no socket. The forward pass over a batch of
 * several sequences (each sequence's logits bit for bit those it gets alone), the engine's
 * slots (two greedy generations stepped together give the tokens each gives alone), the JSON
 * reader against valid and malformed documents, and stop strings cut and held back as a
 * stream arrives. The server over HTTP is tests/test_serve.sh.
 *
 * usage: test_serve [GOLDEN_DIR] [--quick] */
#define COLI_NO_MAIN
#include "../coli.c"
#include "check.h"

/* Two sequences through one batch (a prompt chunk beside a one-token decode step) against each
 * alone: the same logits, bit for bit. */
static void test_batch_identity(const char *dir, const char *name)
{
    char path[1024], label[300];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    struct model m;
    model_load(&m, path, 64);
    int V = m.cfg.n_vocab;
    const int a[6] = {11, 22, 33, 44, 55, 66}, b[3] = {7, 8, 9};
    struct model_seq qa, qb;
    model_seq_init(&m, &qa);
    model_seq_init(&m, &qb);
    float *alone_a = plat_alloc((size_t)V * sizeof(float)), *alone_b = plat_alloc((size_t)V * sizeof(float));
    struct model_run ra = {&qa, a, 5, NULL}, rb = {&qb, b, 3, NULL};
    int ok = !model_forward_runs(&m, &ra, 1);
    ra = (struct model_run){&qa, a + 5, 1, NULL};
    ok = ok && !model_forward_runs(&m, &ra, 1);
    if (ok) memcpy(alone_a, ra.logits, (size_t)V * sizeof(float));
    ok = ok && !model_forward_runs(&m, &rb, 1);
    if (ok) memcpy(alone_b, rb.logits, (size_t)V * sizeof(float));
    model_seq_reset(&m, &qa);
    model_seq_reset(&m, &qb);
    ra = (struct model_run){&qa, a, 5, NULL};
    ok = ok && !model_forward_runs(&m, &ra, 1);
    struct model_run both[2] = {{&qa, a + 5, 1, NULL}, {&qb, b, 3, NULL}};
    ok = ok && !model_forward_runs(&m, both, 2);
    snprintf(label, sizeof label, "%s: two sequences in one batch get the logits each gets alone", name);
    check(ok && !memcmp(both[0].logits, alone_a, (size_t)V * sizeof(float)) && !memcmp(both[1].logits, alone_b, (size_t)V * sizeof(float)) &&
              qa.pos == 6 && qb.pos == 3,
          label, "ok %d, positions %d %d", ok, qa.pos, qb.pos);
    struct model_run twice[2] = {{&qa, a, 1, NULL}, {&qa, a, 1, NULL}}, bad = {&qb, (const int[]){V}, 1, NULL};
    snprintf(label, sizeof label, "%s: a sequence twice in a batch, or a token outside the vocabulary, is refused", name);
    check(model_forward_runs(&m, twice, 2) && model_forward_runs(&m, &bad, 1) && strstr(m.error, "outside the vocabulary") && qa.pos == 6,
          label, "'%s'", m.error);
    free(alone_a);
    free(alone_b);
    model_seq_free(&m, &qa);
    model_seq_free(&m, &qb);
    model_free(&m);
}

/* Two greedy generations on two slots, stepped together, against each on its own. */
static void test_engine_slots(const char *dir, const char *name)
{
    char path[1024], label[300];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    struct model m;
    struct tok t;
    struct engine e;
    model_load(&m, path, 128);
    tok_load(&t, &m.file);
    engine_init(&e, &m, &t, 2);
    static const struct sample_params greedy = {0.0f, 0, 1.0f, 0.0f, 1.0f, 64, 0, 0.0f, 0.0f};
    const int pa[4] = {100, 200, 300, 400}, pb[140] = {5};
    struct engine_request ra = {pa, 4, 12, greedy, 1, 0, NULL, NULL, NULL, NULL}, rb = {pb, 70, 9, greedy, 1, 0, NULL, NULL, NULL, NULL};
    struct engine_gen ga, gb, ta, tb;
    engine_generate(&e, 0, &ra, &ga);
    engine_generate(&e, 1, &rb, &gb);
    model_seq_reset(&m, &e.slots[0].seq);
    model_seq_reset(&m, &e.slots[1].seq);
    engine_start(&e, 0, &ra, &ta);
    engine_start(&e, 1, &rb, &tb); /* 70 prompt tokens: two chunks, the second beside a decode step */
    int steps = 0;
    while (engine_step(&e)) steps++;
    snprintf(label, sizeof label, "%s: two slots stepped together give the tokens each gives alone", name);
    check(ga.n_tokens == 12 && gb.n_tokens == 9 && ta.n_tokens == 12 && tb.n_tokens == 9 && !memcmp(ga.tokens, ta.tokens, 12 * sizeof(int)) &&
              !memcmp(gb.tokens, tb.tokens, 9 * sizeof(int)) && ta.stop == ENGINE_STOP_LENGTH && steps < 12 + 9,
          label, "tokens %d %d %d %d, %d steps", ga.n_tokens, gb.n_tokens, ta.n_tokens, tb.n_tokens, steps);
    struct engine_request too_long = {pb, 129, 1, greedy, 1, 0, NULL, NULL, NULL, NULL};
    struct engine_gen gl;
    model_seq_reset(&m, &e.slots[0].seq);
    engine_generate(&e, 0, &too_long, &gl);
    snprintf(label, sizeof label, "%s: a prompt longer than the context stops at once (context), nothing fed", name);
    check(gl.stop == ENGINE_STOP_CONTEXT && gl.n_tokens == 0 && e.slots[0].seq.pos == 0, label, "stop %d", gl.stop);
    struct engine_gen *gens[] = {&ga, &gb, &ta, &tb, &gl};
    for (int i = 0; i < 5; i++) engine_gen_free(gens[i]);
    engine_free(&e);
    tok_free(&t);
    model_free(&m);
}

static void test_json(void)
{
    static const char *const good[] = {
        "{}", "[]", " {\"a\" : [1, -2.5e3, true, false, null, \"x\"]} ", "\"\\u00e9\\ud83d\\ude00\\n\"", "0", "-0.0e+1", "\"caf\xc3\xa9\"",
    };
    static const char *const bad[] = {
        "", "{", "[1,]", "{\"a\":1,}", "{'a':1}", "01", "1.", ".5", "-", "tru", "nul", "1e999", "\"\\ud800\"", "\"\\udc00\"",
        "\"\\ud800\\u0041\"", "\"a\x01\"", "\"\xc3\"", "\"\xed\xa0\x80\"", "\"\xc0\xaf\"", "\"\\x\"", "[1 2]", "{\"a\" 1}", "1 2", "NaN", "[-]",
    };
    const char *why;
    int all = 1;
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        struct serve_json *v = serve_json_parse(good[i], strlen(good[i]), &why);
        if (!v) printf("# rejected %s: %s\n", good[i], why);
        all &= v != NULL;
        serve_json_free(v);
    }
    check(all, "JSON: valid documents parse", "see above");
    all = 1;
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        struct serve_json *v = serve_json_parse(bad[i], strlen(bad[i]), &why);
        if (v) printf("# accepted %s\n", bad[i]);
        all &= v == NULL && why != NULL;
        serve_json_free(v);
    }
    check(all, "JSON: malformed documents are refused with a reason", "see above");
    char deep[200];
    memset(deep, '[', 100);
    memset(deep + 100, ']', 100);
    struct serve_json *v = serve_json_parse(deep, 200, &why);
    check(!v && why && strstr(why, "deep"), "JSON: nesting past the limit is refused", "%s", why ? why : "accepted");
    const char *doc = "{\"s\":\"\\u00e9\\ud83d\\ude00\",\"n\":[1,2]}";
    v = serve_json_parse(doc, strlen(doc), &why);
    const struct serve_json *s = serve_json_get(v, "s"), *n = serve_json_get(v, "n");
    check(s && !strcmp(s->str, "\xc3\xa9\xf0\x9f\x98\x80") && n && n->child && n->child->next && n->child->next->number == 2,
          "JSON: escapes decode to UTF-8, members are found", "");
    serve_json_free(v);
}

/* A job's text as a stream arrives piece by piece: what is released never holds the start of
 * a stop string that may still come; a stop cuts the text before it. */
static void test_stop_strings(void)
{
    struct serve_job j;
    memset(&j, 0, sizeof j);
    j.stop[0] = "END";
    j.stop[1] = "xy";
    j.n_stop = 2;
    j.longest_stop = 3;
    const char *pieces[] = {"Hello E", "N", "D world"};
    int stopped = 0;
    size_t released[3];
    for (int i = 0; i < 3 && !stopped; i++) {
        stopped = serve_job_append(&j, pieces[i], strlen(pieces[i]));
        released[i] = j.released;
    }
    check(released[0] == 6 && released[1] == 6 && stopped && j.len == 6 && !memcmp(j.text, "Hello ", 6),
          "stop strings: held back while they may come, cut when they do", "released %zu %zu, len %zu", released[0], released[1], j.len);
    free(j.text);
    memset(&j, 0, sizeof j);
    j.stop[0] = "END";
    j.n_stop = 1;
    j.longest_stop = 3;
    serve_job_append(&j, "EN", 2);
    int s2 = serve_job_append(&j, "d", 1);
    check(!s2 && j.released == 3, "stop strings: a start that does not finish is released", "released %zu", j.released);
    free(j.text);
}

int main(int argc, char **argv)
{
    const char *dir;
    int quick;
    check_args(argc, argv, &dir, &quick);
    plat_cpu_detect();
    quant_init();
    test_json();
    test_stop_strings();
    char probe[1024];
    snprintf(probe, sizeof probe, "%s/q35moe-q8_0.gguf", dir);
    if (access(probe, R_OK)) {
        check(1, "batches and slots # SKIP golden data absent", "");
        return check_done();
    }
    test_batch_identity(dir, "q35moe-q8_0.gguf");
    test_batch_identity(dir, "q3next-q8_0.gguf");
    test_engine_slots(dir, "q35moe-q8_0.gguf");
    return check_done();
}
