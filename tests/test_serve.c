/* test_serve: the parts of `coli serve` that need no socket. The forward pass over a batch of
 * several sequences (each sequence's logits bit for bit those it gets alone), the engine's
 * slots (two greedy generations stepped together give the tokens each gives alone), the JSON
 * reader against valid and malformed documents, stop strings cut and held back as a stream
 * arrives, and what each endpoint answers while the model loads (over a socket pair: that
 * window is too short to hit from a client). The server over HTTP is tests/test_serve.sh.
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
    model_load(&m, path, 64, 0);
    int V = m.cfg.n_vocab;
    const int a[6] = {11, 22, 33, 44, 55, 66}, b[3] = {7, 8, 9};
    struct model_seq qa, qb;
    model_seq_init(&m, &qa);
    model_seq_init(&m, &qb);
    float *alone_a = plat_alloc((size_t)V * sizeof(float)), *alone_b = plat_alloc((size_t)V * sizeof(float));
    struct model_run ra = {&qa, a, 5, NULL, 0, NULL, {0, 0, 0, 0, 0}, NULL}, rb = {&qb, b, 3, NULL, 0, NULL, {0, 0, 0, 0, 0}, NULL};
    int ok = !model_forward_runs(&m, &ra, 1);
    ra = (struct model_run){&qa, a + 5, 1, NULL, 0, NULL, {0, 0, 0, 0, 0}, NULL};
    ok = ok && !model_forward_runs(&m, &ra, 1);
    if (ok) memcpy(alone_a, ra.logits, (size_t)V * sizeof(float));
    ok = ok && !model_forward_runs(&m, &rb, 1);
    if (ok) memcpy(alone_b, rb.logits, (size_t)V * sizeof(float));
    model_seq_reset(&m, &qa);
    model_seq_reset(&m, &qb);
    ra = (struct model_run){&qa, a, 5, NULL, 0, NULL, {0, 0, 0, 0, 0}, NULL};
    ok = ok && !model_forward_runs(&m, &ra, 1);
    struct model_run both[2] = {{&qa, a + 5, 1, NULL, 0, NULL, {0, 0, 0, 0, 0}, NULL}, {&qb, b, 3, NULL, 0, NULL, {0, 0, 0, 0, 0}, NULL}};
    ok = ok && !model_forward_runs(&m, both, 2);
    snprintf(label, sizeof label, "%s: two sequences in one batch get the logits each gets alone", name);
    check(ok && !memcmp(both[0].logits, alone_a, (size_t)V * sizeof(float)) && !memcmp(both[1].logits, alone_b, (size_t)V * sizeof(float)) &&
              qa.pos == 6 && qb.pos == 3,
          label, "ok %d, positions %d %d", ok, qa.pos, qb.pos);
    struct model_run twice[2] = {{&qa, a, 1, NULL, 0, NULL, {0, 0, 0, 0, 0}, NULL}, {&qa, a, 1, NULL, 0, NULL, {0, 0, 0, 0, 0}, NULL}},
                     bad = {&qb, (const int[]){V}, 1, NULL, 0, NULL, {0, 0, 0, 0, 0}, NULL};
    snprintf(label, sizeof label, "%s: a sequence twice in a batch, or a token outside the vocabulary, is refused", name);
    check(model_forward_runs(&m, twice, 2) && model_forward_runs(&m, &bad, 1) && strstr(m.error, "outside the vocabulary") && qa.pos == 6,
          label, "'%s'", m.error);
    free(alone_a);
    free(alone_b);
    model_seq_free(&m, &qa);
    model_seq_free(&m, &qb);
    model_free(&m);
}

/* serve_marks on prompts of the golden vocabulary: a Codex-shaped one (system, two user turns of standing context, the
 * question, the generation prompt) is marked where the second and third turns open and at the answer's turn; a
 * two-turn one at its user turn and its answer's; one with no turn after the system's, nowhere. */
static void test_marks(const char *dir)
{
    static const char *const texts[3] = {
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nskills<|im_end|>\n<|im_start|>user\nenv<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
        "<|im_start|>assistant\n",
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", "just text"};
    char path[1024];
    struct gguf_file g;
    struct tok t;
    snprintf(path, sizeof path, "%s/q35moe-q8_0.gguf", dir);
    gguf_open(&g, path);
    tok_load(&t, &g);
    const int im_start = tok_find(&t, "<|im_start|>");
    int right = 0;
    for (int k = 0; k < 3; k++) {
        struct serve_job j;
        int at[8], n_at = 0;
        memset(&j, 0, sizeof j);
        j.req.n_prompt = tok_encode(&t, texts[k], strlen(texts[k]), 1, &j.prompt);
        for (int i = 1; i < j.req.n_prompt && n_at < 8; i++)
            if (j.prompt[i] == im_start) at[n_at++] = i;
        serve_marks(&t, &j);
        const int *m = j.req.mark;
        right += k == 0 ? n_at == 4 && m[0] == at[0] && m[1] == at[1] && m[2] == at[3]
               : k == 1 ? n_at == 2 && m[0] == at[0] && m[1] == at[1] && !m[2]
                        : !m[0] && !m[1] && !m[2];
        free(j.prompt);
    }
    check(right == 3, "marks: the second and third turns' openings and the answer's; two turns: both; no turn: none", "%d of 3", right);
    tok_free(&t);
    gguf_close(&g);
}

/* Two greedy generations on two slots, stepped together, against each on its own. */
static void test_engine_slots(const char *dir, const char *name)
{
    char path[1024], label[300];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    struct model m;
    struct tok t;
    struct engine e;
    model_load(&m, path, 128, 0);
    tok_load(&t, &m.file);
    engine_init(&e, &m, &t, 2, 0);
    static const struct sample_params greedy = {0.0f, 0, 1.0f, 0.0f, 1.0f, 64, 0, 0.0f, 0.0f};
    const int pa[4] = {100, 200, 300, 400}, pb[140] = {5};
    struct engine_request ra = {.prompt = pa, .n_prompt = 4, .n_max = 12, .sample = greedy, .ignore_eog = 1}, rb = {.prompt = pb, .n_prompt = 70, .n_max = 9, .sample = greedy, .ignore_eog = 1};
    struct engine_gen ga, gb, ta, tb;
    engine_generate(&e, 0, &ra, &ga);
    engine_generate(&e, 1, &rb, &gb);
    engine_forget(&e, 0);
    engine_forget(&e, 1);
    engine_start(&e, 0, &ra, &ta);
    int steps = engine_step(&e) > 0; /* slot 0's prompt and first token */
    engine_start(&e, 1, &rb, &tb);   /* 70 prompt tokens beside slot 0's decoding: two chunks */
    steps += engine_step(&e) > 0;
    int first_chunk = e.slots[1].fed;
    while (engine_step(&e)) steps++;
    snprintf(label, sizeof label, "%s: two slots stepped together give the tokens each gives alone", name);
    check(ga.n_tokens == 12 && gb.n_tokens == 9 && ta.n_tokens == 12 && tb.n_tokens == 9 && !memcmp(ga.tokens, ta.tokens, 12 * sizeof(int)) &&
              !memcmp(gb.tokens, tb.tokens, 9 * sizeof(int)) && ta.stop == ENGINE_STOP_LENGTH && steps < 12 + 9,
          label, "tokens %d %d %d %d, %d steps", ga.n_tokens, gb.n_tokens, ta.n_tokens, tb.n_tokens, steps);
    snprintf(label, sizeof label, "%s: a prompt beside a decoding slot goes in chunks of the step beside decode", name);
    check(first_chunk == ENGINE_STEP_BESIDE_DECODE - 1, label, "first chunk %d tokens", first_chunk);
    struct engine_request too_long = {.prompt = pb, .n_prompt = 129, .n_max = 1, .sample = greedy, .ignore_eog = 1};
    struct engine_gen gl;
    engine_forget(&e, 0);
    engine_generate(&e, 0, &too_long, &gl);
    snprintf(label, sizeof label, "%s: a prompt longer than the context stops at once (context), nothing fed", name);
    check(gl.stop == ENGINE_STOP_CONTEXT && gl.n_tokens == 0 && e.slots[0].seq.pos == 0, label, "stop %d", gl.stop);
    struct engine_gen *gens[] = {&ga, &gb, &ta, &tb, &gl};
    for (int i = 0; i < 5; i++) engine_gen_free(gens[i]);
    engine_free(&e);
    tok_free(&t);
    model_free(&m);
}

/* A golden model, its vocabulary and an engine of one slot over it (the engine points at both: it must not move). */
struct fixture { struct model m; struct tok t; struct engine e; };

static void fixture_open(struct fixture *f, const char *dir, const char *name, int n_ctx)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    model_load(&f->m, path, n_ctx, 0);
    tok_load(&f->t, &f->m.file);
    engine_init(&f->e, &f->m, &f->t, 1, 0);
}

static void fixture_close(struct fixture *f)
{
    engine_free(&f->e);
    tok_free(&f->t);
    model_free(&f->m);
}

/* A sink keeping each token's log-probabilities (engine_gen.logprobs holds the last one's). */
struct logprob_log { const struct engine_gen *g; struct engine_logprobs lp[16]; int n; };
static int logprob_sink(void *ctx, int id, const char *piece, size_t len)
{
    struct logprob_log *log = ctx;
    (void)id, (void)piece, (void)len;
    if (log->n < 16) log->lp[log->n++] = log->g->logprobs;
    return 0;
}

/* Log-probabilities against a log-softmax in double (libm's exp and log) of the logits the model
 * gives the same prompt alone; a bias moves the token, not the log-probabilities; the tokens are
 * those of a request without either. */
static void test_engine_logprobs(const char *dir, const char *name)
{
    char label[300];
    struct fixture f;
    fixture_open(&f, dir, name, 64);
    const int V = f.m.cfg.n_vocab, prompt[5] = {785, 272, 391, 275, 278};
    static const struct sample_params greedy = {0.0f, 0, 1.0f, 0.0f, 1.0f, 64, 0, 0.0f, 0.0f};
    struct model_seq q;
    model_seq_init(&f.m, &q);
    struct model_run run = {&q, prompt, 5, NULL, 0, NULL, {0, 0, 0, 0, 0}, NULL};
    double *ref = plat_alloc((size_t)V * sizeof *ref), max = -INFINITY, sum = 0;
    int ok = !model_forward_runs(&f.m, &run, 1), best[5] = {-1, -1, -1, -1, -1};
    for (int i = 0; ok && i < V; i++) max = run.logits[i] > max ? run.logits[i] : max;
    for (int i = 0; ok && i < V; i++) sum += exp(run.logits[i] - max);
    for (int i = 0; ok && i < V; i++) ref[i] = run.logits[i] - max - log(sum);
    for (int k = 0; ok && k < 5; k++) /* the five best, lower id first among equals */
        for (int i = 0; i < V; i++) {
            int taken = 0;
            for (int j = 0; j < k; j++) taken |= best[j] == i;
            if (!taken && (best[k] < 0 || ref[i] > ref[best[k]])) best[k] = i;
        }
    struct engine_gen plain, with, biased;
    struct logprob_log log = {&with, {{{0, 0}, {{0, 0}}, 0}}, 0}, log_biased = {&biased, {{{0, 0}, {{0, 0}}, 0}}, 0};
    struct engine_request r = {.prompt = prompt, .n_prompt = 5, .n_max = 8, .sample = greedy, .ignore_eog = 1};
    engine_generate(&f.e, 0, &r, &plain);
    engine_forget(&f.e, 0);
    r.logprobs = 1, r.top_logprobs = 5, r.sink = logprob_sink, r.sink_ctx = &log;
    engine_generate(&f.e, 0, &r, &with);
    engine_forget(&f.e, 0);
    const struct engine_bias ban = {best[0], -100.0f};
    r.n_max = 1, r.bias = &ban, r.n_bias = 1, r.sink_ctx = &log_biased;
    engine_generate(&f.e, 0, &r, &biased);
    double worst = 0;
    for (int k = 0; ok && k < 5; k++) worst = fmax(worst, fabs(log.lp[0].top[k].logprob - ref[best[k]]) + (log.lp[0].top[k].id != best[k]));
    snprintf(label, sizeof label, "%s: logprobs = a double log-softmax of the logits (token and 5 best, in order)", name);
    check(ok && log.n == 8 && log.lp[0].n_top == 5 && log.lp[0].token.id == best[0] && fabs(log.lp[0].token.logprob - ref[best[0]]) < 1e-5 && worst < 1e-5, label,
          "%d tokens, token %d (want %d), worst %g", log.n, log.lp[0].token.id, best[0], worst);
    snprintf(label, sizeof label, "%s: asking for logprobs leaves the tokens as they were", name);
    check(plain.n_tokens == 8 && with.n_tokens == 8 && !memcmp(plain.tokens, with.tokens, 8 * sizeof(int)), label, "%d %d tokens", plain.n_tokens, with.n_tokens);
    snprintf(label, sizeof label, "%s: a bias of -100 on the best token gives the runner-up, its log-probability unbiased", name);
    check(biased.n_tokens == 1 && biased.tokens[0] == best[1] && log_biased.n == 1 && fabs(log_biased.lp[0].token.logprob - ref[best[1]]) < 1e-5, label,
          "token %d (want %d)", biased.n_tokens ? biased.tokens[0] : -1, best[1]);
    engine_gen_free(&plain);
    engine_gen_free(&with);
    engine_gen_free(&biased);
    free(ref);
    model_seq_free(&f.m, &q);
    fixture_close(&f);
}

/* Whether TOKENS[0..n) decode to the start of a JSON object (SCHEMA's if not NULL; sample_json, from nothing); *WHOLE:
 * it closed at the last. */
static int json_prefix(const struct tok *t, const struct sample_schema *schema, const int *tokens, int n, int *whole)
{
    struct sample_json s = sample_json_start(schema);
    char buf[256];
    for (int i = 0; i < n; i++) {
        size_t len = tok_decode(t, tokens[i], buf, sizeof buf);
        if (len > sizeof buf || !sample_json_accepts(&s, buf, len)) return 0;
    }
    *whole = s.state == SJ_DONE;
    return 1;
}

/* How many tokens engine_json_mask keeps or masks otherwise than trying each token's bytes from each of STATES[0..n)
 * (under SCHEMA if not NULL); ROW: n_vocab floats of scratch. */
static int mask_differs(struct fixture *f, const struct sample_schema *schema, const char *const *states, int n, float *row)
{
    int differ = 0;
    for (int k = 0; k < n; k++) {
        struct engine_slot sl = {.json = sample_json_start(schema)};
        sample_json_accepts(&sl.json, states[k], strlen(states[k]));
        memset(row, 0, (size_t)f->m.cfg.n_vocab * sizeof *row);
        (void)engine_json_mask(&f->e, &sl, row);
        for (int i = 0; i < f->m.cfg.n_vocab; i++) {
            char buf[256];
            struct sample_json s = sl.json;
            size_t len = i < f->t.n_vocab && f->t.type[i] == TOK_T_NORMAL ? tok_decode(&f->t, i, buf, sizeof buf) : 0;
            differ += (row[i] == 0) != (len && sample_json_accepts(&s, buf, len));
        }
    }
    return differ;
}

/* JSON mode in the engine: from the first token, or after a given one (a think block's end) with the tokens before it
 * untouched; the answer a JSON object's start, ending where the object closes. A forced prefix likewise. */
static void test_engine_json(const char *dir, const char *name)
{
    char label[300];
    struct fixture f;
    fixture_open(&f, dir, name, 128);
    const int prompt[5] = {785, 272, 391, 275, 278};
    const struct engine_bias closers[] = {{tok_find(&f.t, "\""), 4}, {tok_find(&f.t, "}"), 4}, {tok_find(&f.t, ":"), 3}, {tok_find(&f.t, "1"), 3}};
    static const struct sample_params greedy = {0.0f, 0, 1.0f, 0.0f, 1.0f, 64, 0, 0.0f, 0.0f};
    struct engine_request r = {.prompt = prompt, .n_prompt = 5, .n_max = 12, .sample = greedy, .ignore_eog = 1};
    struct engine_gen plain, from_start, after, closed;
    engine_generate(&f.e, 0, &r, &plain);
    engine_forget(&f.e, 0);
    r.json = 1, r.after = -1;
    engine_generate(&f.e, 0, &r, &from_start);
    engine_forget(&f.e, 0);
    r.after = plain.tokens[3];
    engine_generate(&f.e, 0, &r, &after);
    engine_forget(&f.e, 0);
    r.after = -1, r.n_max = 60, r.bias = closers, r.n_bias = 4;
    engine_generate(&f.e, 0, &r, &closed);
    int whole = 0, whole_after = 0, whole_closed = 0;
    snprintf(label, sizeof label, "%s: JSON mode: 12 tokens, the start of an object", name);
    check(from_start.n_tokens == 12 && json_prefix(&f.t, NULL, from_start.tokens, 12, &whole) && !whole && from_start.stop == ENGINE_STOP_LENGTH, label,
          "%d tokens, whole %d, stop %d", from_start.n_tokens, whole, from_start.stop);
    snprintf(label, sizeof label, "%s: JSON mode after a token: the tokens up to it unmasked, then an object's start", name);
    check(after.n_tokens == 12 && !memcmp(after.tokens, plain.tokens, 4 * sizeof(int)) && json_prefix(&f.t, NULL, after.tokens + 4, 8, &whole_after) &&
              memcmp(after.tokens + 4, plain.tokens + 4, 8 * sizeof(int)),
          label, "%d tokens", after.n_tokens);
    snprintf(label, sizeof label, "%s: JSON mode with closers favoured: the object closes, the answer ends there", name);
    check(closed.n_tokens < 60 && json_prefix(&f.t, NULL, closed.tokens, closed.n_tokens, &whole_closed) && whole_closed && closed.stop == ENGINE_STOP_EOG,
          label, "%d tokens, whole %d, stop %d", closed.n_tokens, whole_closed, closed.stop);
    static const char *const states[] = {"", " {", "{\"k", "{\"k\\", "{\"k\":-1", "{\"k\":[tr", "{\"k\":\"\xc3", "{\"k\":{}"};
    float *row = plat_alloc((size_t)f.m.cfg.n_vocab * sizeof *row);
    snprintf(label, sizeof label, "%s: the JSON mask = every token's bytes tried, in 8 states (in and out of strings)", name);
    check(!mask_differs(&f, NULL, states, 8, row), label, "%d tokens differ", mask_differs(&f, NULL, states, 8, row));
    /* a forced prefix (as a forced tool call's), after plain's third token: those three unmasked, then the prefix */
    struct engine_gen forced;
    const char *prefix = "<tool_call>\n<function=get_time>\n";
    struct engine_request rp = {.prompt = prompt, .n_prompt = 5, .n_max = 40, .sample = greedy, .ignore_eog = 1, .prefix = prefix,
                                .prefix_len = strlen(prefix), .after = plain.tokens[2]};
    engine_forget(&f.e, 0);
    engine_generate(&f.e, 0, &rp, &forced);
    char text[512];
    size_t at = 0;
    for (int i = 3; i < forced.n_tokens; i++) at += tok_decode(&f.t, forced.tokens[i], text + at, sizeof text - at);
    text[at < sizeof text ? at : sizeof text - 1] = 0;
    snprintf(label, sizeof label, "%s: a forced prefix after a token: the tokens up to it unmasked, then the prefix", name);
    check(forced.n_tokens == 40 && !memcmp(forced.tokens, plain.tokens, 3 * sizeof(int)) && !strncmp(text + strspn(text, " \t\r\n"), prefix, strlen(prefix)),
          label, "%d tokens, then '%.60s'", forced.n_tokens, text);
    engine_gen_free(&forced);
    struct engine_slot done = {.req = {.json = 1}, .json = {.state = SJ_DONE}};
    snprintf(label, sizeof label, "%s: JSON mode where no token can come: no row to sample (the generation fails, said)", name);
    check(!engine_sampling_row(&f.e, &done, row), label, "a row");
    free(row);
    struct engine_gen *gens[] = {&plain, &from_start, &after, &closed};
    for (int i = 0; i < 4; i++) engine_gen_free(gens[i]);
    fixture_close(&f);
}

/* The tokens a think block's bound (struct engine_think) forces after THOUGHT[0..n): CLOSE's, a newline unless the
 * thoughts (CLOSE's text included) end in one, then END; into OUT, returning how many. */
static int think_close_expected(const struct tok *t, const int *thought, int n, const int *close, int n_close, int newline, int end, int *out)
{
    char text[1024];
    size_t len = 0;
    int k = 0;
    for (int i = 0; i < n; i++) len += tok_decode(t, thought[i], text + len, sizeof text - len);
    for (int i = 0; i < n_close; i++) len += tok_decode(t, close[i], text + len, sizeof text - len), out[k++] = close[i];
    if (!len || text[len - 1] != '\n') out[k++] = newline;
    out[k++] = end;
    return k;
}

/* A think block's bound in the engine: the answer's first BUDGET tokens are the unbounded answer's, then the close is
 * forced (a message's tokens, a newline unless the thoughts end in one, </think>), each fed as if sampled: what follows
 * is what the prompt with those tokens appended gives, computed afresh. A block the model closes within its budget,
 * and an answer with no think block, are untouched. */
static void test_engine_think_budget(const char *dir, const char *name)
{
    char label[300];
    struct fixture f;
    fixture_open(&f, dir, name, 128);
    static const struct sample_params greedy = {0.0f, 0, 1.0f, 0.0f, 1.0f, 64, 0, 0.0f, 0.0f};
    const int end = tok_find(&f.t, "</think>"), n_max = 24;
    int prompt[64] = {785, 272, 391, 275, 278}, *told = NULL, *told_line = NULL;
    const int n_told = tok_encode(&f.t, " Enough.", 8, 0, &told), n_told_line = tok_encode(&f.t, " Enough.\n", 9, 0, &told_line);
    struct engine_request r = {.prompt = prompt, .n_prompt = 5, .n_max = n_max, .sample = greedy, .ignore_eog = 1, .after = end};
    struct engine_gen plain, g;
    engine_generate(&f.e, 0, &r, &plain);
    int opened = end >= 0 && f.e.newline >= 0;
    for (int i = 0; i < 8; i++) opened &= plain.tokens[i] != end;
    snprintf(label, sizeof label, "%s: the vocabulary has </think> and a newline token; the unbounded answer's first 8 tokens stay in the block", name);
    check(opened, label, "</think> %d, newline %d", end, f.e.newline);
    const struct { int budget; const int *close; int n_close; } bounds[] = {{0, NULL, 0}, {1, NULL, 0}, {3, NULL, 0}, {5, NULL, 0},
                                                                          {2, told, n_told}, {2, told_line, n_told_line}};
    int right = 0, fed = 0;
    for (size_t b = 0; opened && b < sizeof bounds / sizeof *bounds; b++) {
        struct engine_think bound = {bounds[b].budget, bounds[b].close, bounds[b].n_close};
        int forced[32], n_forced = think_close_expected(&f.t, plain.tokens, bound.budget, bound.close, bound.n_close, f.e.newline, end, forced);
        r.think = &bound;
        engine_forget(&f.e, 0);
        engine_generate(&f.e, 0, &r, &g);
        const int k = bound.budget + n_forced;
        right += g.n_tokens == n_max && !memcmp(g.tokens, plain.tokens, (size_t)bound.budget * sizeof(int)) &&
                 !memcmp(g.tokens + bound.budget, forced, (size_t)n_forced * sizeof(int));
        struct engine_request after = {.prompt = prompt, .n_prompt = 5 + k, .n_max = n_max - k, .sample = greedy, .ignore_eog = 1, .after = -1};
        struct engine_gen rest;
        memcpy(prompt + 5, g.tokens, (size_t)k * sizeof(int));
        engine_forget(&f.e, 0);
        engine_generate(&f.e, 0, &after, &rest);
        fed += rest.n_tokens == n_max - k && !memcmp(rest.tokens, g.tokens + k, (size_t)rest.n_tokens * sizeof(int));
        engine_gen_free(&rest);
        engine_gen_free(&g);
    }
    snprintf(label, sizeof label, "%s: budgets 0, 1, 3, 5 and 2 with a message (with and without its newline): the thoughts, then the close forced", name);
    check(right == 6, label, "%d of 6", right);
    snprintf(label, sizeof label, "%s: the forced tokens are fed as sampled ones: the rest = the prompt with them appended, computed afresh", name);
    check(fed == 6, label, "%d of 6", fed);
    struct engine_think bound = {3, NULL, 0};
    r.think = &bound, r.after = plain.tokens[1]; /* the model "closes" its block at its second token, within the budget */
    engine_forget(&f.e, 0);
    engine_generate(&f.e, 0, &r, &g);
    int same = g.n_tokens == n_max && !memcmp(g.tokens, plain.tokens, (size_t)n_max * sizeof(int));
    engine_gen_free(&g);
    r.after = -1; /* no think block: nothing to bound */
    engine_forget(&f.e, 0);
    engine_generate(&f.e, 0, &r, &g);
    same += g.n_tokens == n_max && !memcmp(g.tokens, plain.tokens, (size_t)n_max * sizeof(int));
    engine_gen_free(&g);
    snprintf(label, sizeof label, "%s: a block closed within its budget, or no block at all: the unbounded answer", name);
    check(same == 2, label, "%d of 2", same);
    engine_gen_free(&plain);
    free(told);
    free(told_line);
    fixture_close(&f);
}

/* JSON mode under a schema in the engine: with closers favoured, an object the schema admits, the answer ending where
 * it closes; the mask = every token's bytes tried, inside a name, an enum's value (one with a space), a free string and
 * an integer, after a space. */
static void test_engine_schema(const char *dir, const char *name)
{
    static const char *const text = "{\"type\":\"object\",\"properties\":{\"ab\":{\"enum\":[\"x y\",12,true]},\"abc\":{\"type\":\"string\"},"
                                    "\"n\":{\"type\":\"integer\"}},\"required\":[\"n\"]}";
    static const char *const states[] = {"", "{\"a", "{\"ab\":", "{\"ab\": ", "{\"ab\":\"x", "{\"ab\":1", "{\"abc\":\"q", "{\"n\":-"};
    char label[300], why[SAMPLE_SCHEMA_ERROR];
    struct fixture f;
    fixture_open(&f, dir, name, 128);
    const char *error;
    struct json *j = json_parse(text, strlen(text), &error);
    struct sample_schema *schema = sample_schema_compile(j, why);
    const int prompt[5] = {785, 272, 391, 275, 278};
    const struct engine_bias closers[] = {{tok_find(&f.t, "\""), 4}, {tok_find(&f.t, "}"), 4}, {tok_find(&f.t, ":"), 3}, {tok_find(&f.t, "1"), 3}};
    static const struct sample_params greedy = {0.0f, 0, 1.0f, 0.0f, 1.0f, 64, 0, 0.0f, 0.0f};
    struct engine_request r = {.prompt = prompt, .n_prompt = 5, .n_max = 80, .sample = greedy, .ignore_eog = 1, .json = 1, .schema = schema,
                               .after = -1, .bias = closers, .n_bias = 4};
    struct engine_gen g;
    engine_generate(&f.e, 0, &r, &g);
    int whole = 0;
    snprintf(label, sizeof label, "%s: JSON mode under a schema: an object it admits, the answer ending where it closes", name);
    check(g.n_tokens < 80 && json_prefix(&f.t, schema, g.tokens, g.n_tokens, &whole) && whole && g.stop == ENGINE_STOP_EOG, label,
          "%d tokens, whole %d, stop %d: '%.80s'", g.n_tokens, whole, g.stop, g.text);
    float *row = plat_alloc((size_t)f.m.cfg.n_vocab * sizeof *row);
    snprintf(label, sizeof label, "%s: the JSON mask under a schema = every token's bytes tried, in 8 states", name);
    check(!mask_differs(&f, schema, states, 8, row), label, "%d tokens differ", mask_differs(&f, schema, states, 8, row));
    free(row);
    engine_gen_free(&g);
    sample_schema_free(schema);
    json_free(j);
    fixture_close(&f);
}

static const struct sample_params greedy_params = {0.0f, 0, 1.0f, 0.0f, 1.0f, 64, 0, 0.0f, 0.0f};

/* A greedy WHOLE request of PROMPT[0..n) (checkpoints at the marks SHARED and ANSWER) for N_MAX
 * tokens, with the top logits of every position. */
static struct engine_request whole_request(const int *prompt, int n, int shared, int answer, int n_max)
{
    return (struct engine_request){.prompt = prompt, .n_prompt = n, .whole = 1, .reuse = 1, .mark = {shared, answer}, .n_max = n_max,
                                  .sample = greedy_params, .ignore_eog = 1, .want_top = 1};
}

/* Whether G and FRESH (the same prompt from nothing) generated the same tokens with the same
 * top logits, bit for bit. */
static int same_generation(const struct engine_gen *g, const struct engine_gen *fresh)
{
    return g->n_tokens == fresh->n_tokens && g->n_tokens > 0 && !memcmp(g->tokens, fresh->tokens, (size_t)g->n_tokens * sizeof(int)) &&
           !memcmp(g->top, fresh->top, (size_t)g->n_tokens * sizeof *g->top);
}

/* REQ on engine E (which may reuse what it holds) against REQ computed from nothing on FRESH:
 * the same tokens and logits. Returns the tokens E reused. */
static int run_against_fresh(struct engine *e, struct engine *fresh, struct engine_request req, const char *label)
{
    struct engine_gen g, f;
    int slot = engine_admit(e, &req, &g);
    while (e->slots[slot].gen) engine_step(e);
    req.reuse = 0;
    engine_admit(fresh, &req, &f);
    while (engine_step(fresh)) {}
    check(same_generation(&g, &f), label, "%d cached; tokens %d and %d; stops %d %d", g.n_cached, g.n_tokens, f.n_tokens, g.stop, f.stop);
    int cached = g.n_cached;
    engine_gen_free(&g);
    engine_gen_free(&f);
    return cached;
}

/* What the prompt-cache tests share: a golden model (KV cache in format KV), its tokenizer, an engine of one slot and
 * 64 MiB of prompt cache, and one without, computing every prompt from nothing. */
struct reuse_fixture {
    struct model m;
    struct tok t;
    struct engine e, fresh;
};

static void reuse_fixture_open(struct reuse_fixture *f, const char *dir, const char *file, enum ops_kv kv)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    model_load(&f->m, path, 256, kv);
    tok_load(&f->t, &f->m.file);
    engine_init(&f->e, &f->m, &f->t, 1, 64 << 20);
    engine_init(&f->fresh, &f->m, &f->t, 1, 0);
}

static void reuse_fixture_close(struct reuse_fixture *f)
{
    engine_free(&f->e);
    engine_free(&f->fresh);
    tok_free(&f->t);
    model_free(&f->m);
}

/* The prompt cache: a prompt that departs from a slot's past after its checkpoint resumes from
 * the checkpoint; one that continues the past resumes from the state; a conversation parked
 * in RAM comes back; and each gives the logits of the same prompt computed from nothing
 * (with the KV cache in format KV). */
static void test_prefix_reuse(const char *dir, const char *file, enum ops_kv kv)
{
    char label[512], name[128];
    snprintf(name, sizeof name, "%s%s", file, kv == OPS_KV_F16 ? " --kv f16" : kv == OPS_KV_Q8_0 ? " --kv q8_0" : "");
    struct reuse_fixture fx;
    reuse_fixture_open(&fx, dir, file, kv);
    int p1[40], p2[50], other[30], p3[100];
    for (int i = 0; i < 40; i++) p1[i] = 100 + 7 * i;
    memcpy(p2, p1, 34 * sizeof(int));
    for (int i = 34; i < 50; i++) p2[i] = 900 + i;
    for (int i = 0; i < 30; i++) other[i] = 1500 + i;
    struct engine_gen g;
    struct engine_request r1 = whole_request(p1, 40, 10, 30, 6);
    engine_admit(&fx.e, &r1, &g);
    while (engine_step(&fx.e)) {}
    snprintf(label, sizeof label, "%s: a prompt keeps checkpoints at its marks; the state holds prompt and answer but the last token", name);
    check(fx.e.slots[0].past.n_cp == 2 && fx.e.slots[0].past.cp[0].pos == 10 && fx.e.slots[0].past.cp[1].pos == 30 && fx.e.slots[0].past.n == 45 &&
              g.n_cached == 0,
          label, "%d checkpoints (first at %d), %d tokens held", fx.e.slots[0].past.n_cp, fx.e.slots[0].past.cp[0].pos, fx.e.slots[0].past.n);
    engine_gen_free(&g);
    snprintf(label, sizeof label, "%s: departing after the checkpoint resumes from it: the logits of the prompt from nothing", name);
    int cached = run_against_fresh(&fx.e, &fx.fresh, whole_request(p2, 50, 0, 45, 5), label);
    snprintf(label, sizeof label, "%s: ... 30 of its tokens reused (the checkpoint, not the deeper common prefix of 34)", name);
    check(cached == 30, label, "%d", cached);
    int held = fx.e.slots[0].past.n;
    memcpy(p3, fx.e.slots[0].past.tokens, (size_t)held * sizeof(int));
    for (int i = held; i < held + 3; i++) p3[i] = 40 + i;
    snprintf(label, sizeof label, "%s: a prompt that continues the state resumes from it: the same logits", name);
    cached = run_against_fresh(&fx.e, &fx.fresh, whole_request(p3, held + 3, 0, 0, 4), label);
    snprintf(label, sizeof label, "%s: ... all %d tokens the state held reused", name, held);
    check(cached == held, label, "%d", cached);
    held = fx.e.slots[0].past.n;
    memcpy(p3, fx.e.slots[0].past.tokens, (size_t)held * sizeof(int));
    p3[held] = 77;
    snprintf(label, sizeof label, "%s: another conversation on the one slot", name);
    cached = run_against_fresh(&fx.e, &fx.fresh, whole_request(other, 30, 0, 0, 3), label);
    snprintf(label, sizeof label, "%s: ... parks the first one in RAM", name);
    check(fx.e.n_parked == 1 && cached == 0, label, "%d parked, %d cached", fx.e.n_parked, cached);
    snprintf(label, sizeof label, "%s: the parked conversation comes back for its next turn: the same logits", name);
    cached = run_against_fresh(&fx.e, &fx.fresh, whole_request(p3, held + 1, 0, 0, 3), label);
    snprintf(label, sizeof label, "%s: ... all %d tokens it held reused, and the other one parked in its place", name, held);
    check(cached == held && fx.e.n_parked == 1, label, "%d cached, %d parked", cached, fx.e.n_parked);
    held = fx.e.slots[0].past.n;
    memcpy(p3, fx.e.slots[0].past.tokens, (size_t)held * sizeof(int));
    p3[held] = 78;
    int branch[50];
    memcpy(branch, p3, 12 * sizeof(int));
    for (int i = 12; i < 50; i++) branch[i] = 2000 + i;
    snprintf(label, sizeof label, "%s: a conversation that shares only the first checkpoint's prefix", name);
    cached = run_against_fresh(&fx.e, &fx.fresh, whole_request(branch, 50, 0, 0, 3), label);
    snprintf(label, sizeof label, "%s: ... reuses it, and parks a copy of the one it branched from", name);
    check(cached == 10 && fx.e.n_parked == 2, label, "%d cached, %d parked", cached, fx.e.n_parked);
    snprintf(label, sizeof label, "%s: the copy comes back whole for its next turn: the same logits", name);
    cached = run_against_fresh(&fx.e, &fx.fresh, whole_request(p3, held + 1, 0, 0, 3), label);
    check(cached == held, label, "%d cached of %d", cached, held);
    engine_free(&fx.e);
    engine_init(&fx.e, &fx.m, &fx.t, 1, 0);
    engine_admit(&fx.e, &r1, &g);
    while (engine_step(&fx.e)) {}
    engine_gen_free(&g);
    snprintf(label, sizeof label, "%s: with no cache budget there are no checkpoints: the departing prompt is computed from nothing", name);
    cached = run_against_fresh(&fx.e, &fx.fresh, whole_request(p2, 50, 0, 45, 2), label);
    check(cached == 0 && fx.e.slots[0].past.n_cp == 0 && fx.e.cache_bytes == 0, label, "%d cached", cached);
    reuse_fixture_close(&fx);
}

/* A conversation of more turns than a sequence keeps checkpoints: each turn's checkpoint recycles the oldest turn's,
 * never the two shared-prefix marks', so a new conversation sharing the second (an agent's standing instructions)
 * resumes there with the logits of its prompt from nothing. */
static void test_checkpoint_recycling(const char *dir, const char *file)
{
    char label[512];
    struct reuse_fixture fx;
    reuse_fixture_open(&fx, dir, file, OPS_KV_F32);
    int conv[120], other[40];
    for (int i = 0; i < 30; i++) conv[i] = 300 + 11 * i;
    int n = 30, answer_mark = 0;
    for (int turn = 0; turn < ENGINE_MAX_CHECKPOINTS; turn++) {
        answer_mark = n - 1;
        struct engine_request r = whole_request(conv, n, 10, answer_mark, 2);
        r.mark[1] = 20, r.mark[2] = answer_mark;
        struct engine_gen g;
        engine_admit(&fx.e, &r, &g);
        while (engine_step(&fx.e)) {}
        engine_gen_free(&g);
        n = fx.e.slots[0].past.n;
        memcpy(conv, fx.e.slots[0].past.tokens, (size_t)n * sizeof(int));
        for (int i = 0; i < 4; i++) conv[n + i] = 700 + 13 * turn + i;
        n += 4;
    }
    const struct engine_past *p = &fx.e.slots[0].past;
    snprintf(label, sizeof label, "%s: %d turns: the checkpoints of both shared marks (10, 20) and of the last answer (%d) kept", file,
             ENGINE_MAX_CHECKPOINTS, answer_mark);
    check(p->n_cp == ENGINE_MAX_CHECKPOINTS && p->cp[0].pos == 10 && p->cp[1].pos == 20 && p->cp[p->n_cp - 1].pos == answer_mark, label,
          "%d checkpoints at %d, %d, ..., %d", p->n_cp, p->cp[0].pos, p->cp[1].pos, p->cp[p->n_cp - 1].pos);
    memcpy(other, conv, 22 * sizeof(int));
    for (int i = 22; i < 40; i++) other[i] = 1900 + i;
    snprintf(label, sizeof label, "%s: a new conversation sharing 22 tokens: the logits of its prompt from nothing", file);
    int cached = run_against_fresh(&fx.e, &fx.fresh, whole_request(other, 40, 10, 39, 3), label);
    snprintf(label, sizeof label, "%s: ... resumed from the second mark's checkpoint", file);
    check(cached == 20, label, "%d cached", cached);
    const int held = n - 4;
    int unrelated[30], third[40];
    for (int i = 0; i < 30; i++) unrelated[i] = 1200 + i;
    for (int i = 0; i < 40; i++) third[i] = i < 22 ? conv[i] : 1700 + i;
    snprintf(label, sizeof label, "%s: a conversation sharing nothing: the same logits", file);
    cached = run_against_fresh(&fx.e, &fx.fresh, whole_request(unrelated, 30, 10, 29, 2), label);
    snprintf(label, sizeof label, "%s: ... both others parked", file);
    check(cached == 0 && fx.e.n_parked == 2, label, "%d cached, %d parked", cached, fx.e.n_parked);
    snprintf(label, sizeof label, "%s: another sharing 22 tokens branches from a parked one: its logits from nothing", file);
    cached = run_against_fresh(&fx.e, &fx.fresh, whole_request(third, 40, 10, 39, 3), label);
    snprintf(label, sizeof label, "%s: ... from the second mark's checkpoint", file);
    check(cached == 20, label, "%d cached", cached);
    conv[held] = 99;
    snprintf(label, sizeof label, "%s: ... the one it branched from stays parked whole: its next turn gives the same logits", file);
    cached = run_against_fresh(&fx.e, &fx.fresh, whole_request(conv, held + 1, 10, held, 2), label);
    snprintf(label, sizeof label, "%s: ... reusing all %d tokens it held", file, held);
    check(cached == held, label, "%d cached", cached);
    reuse_fixture_close(&fx);
}

/* Loads PATH into a fresh engine over M and T (BUDGET bytes of prompt cache): the count engine_cache_load gives, the
 * engine left for the caller to free; WHY its reason. */
static int cache_load_into(struct engine *e, struct model *m, struct tok *t, int64_t budget, const char *path, uint64_t identity, char *why)
{
    engine_init(e, m, t, 1, budget);
    return engine_cache_load(e, path, identity, why, 256);
}

/* The prompt cache in a file (serve --prompt-cache): an engine's conversations, its slot's and one parked, written and
 * read into another engine, come back for their next turns with the logits of those prompts from nothing (KV in format
 * KV); the most recent first when the budget holds one; a file of another model, cut short at any of 40 places, or
 * with a token outside the vocabulary, a count out of range, a checkpoint's position out of order or KV bytes changed
 * (the record's hash), is refused whole, nothing kept. */
static void test_prompt_cache_file(const char *dir, const char *file, enum ops_kv kv)
{
    char path[1024], label[512], name[128], cache[64], why[256];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    snprintf(name, sizeof name, "%s%s", file, kv == OPS_KV_Q8_0 ? " --kv q8_0" : "");
    snprintf(cache, sizeof cache, "/tmp/test_serve_cache.%ld", (long)getpid());
    struct reuse_fixture fx;
    struct engine back;
    reuse_fixture_open(&fx, dir, file, kv);
    const uint64_t identity = model_identity(&fx.m);
    int first[40], other[30], next_first[64], next_other[48];
    for (int i = 0; i < 40; i++) first[i] = 100 + 7 * i;
    for (int i = 0; i < 30; i++) other[i] = 1500 + i;
    struct engine_gen g;
    struct engine_request r1 = whole_request(first, 40, 10, 30, 6), r2 = whole_request(other, 30, 8, 20, 5);
    engine_admit(&fx.e, &r1, &g);
    while (engine_step(&fx.e)) {}
    engine_gen_free(&g);
    engine_admit(&fx.e, &r2, &g); /* parks the first */
    while (engine_step(&fx.e)) {}
    engine_gen_free(&g);
    const int n_first = fx.e.parked[0].past.n, n_other = fx.e.slots[0].past.n;
    memcpy(next_first, fx.e.parked[0].past.tokens, (size_t)n_first * sizeof(int));
    memcpy(next_other, fx.e.slots[0].past.tokens, (size_t)n_other * sizeof(int));
    next_first[n_first] = 61, next_other[n_other] = 62;
    int saved = engine_cache_save(&fx.e, cache, identity, why, sizeof why);
    int loaded = cache_load_into(&back, &fx.m, &fx.t, 64 << 20, cache, identity, why);
    snprintf(label, sizeof label, "%s: a slot's conversation and a parked one written to a file and read into another engine", name);
    check(saved == 2 && loaded == 2 && back.n_parked == 2 && back.parked[0].past.n == n_other && back.parked[1].past.n == n_first &&
              back.parked[1].past.n_cp == 2 && back.cache_bytes == fx.e.cache_bytes + model_kv_bytes(&fx.m, n_other) + fx.e.checkpoint_bytes + n_other * (int64_t)sizeof(int),
          label, "saved %d, loaded %d (%s), %d parked, bytes %lld against %lld", saved, loaded, loaded < 0 ? why : "", back.n_parked,
          (long long)back.cache_bytes, (long long)fx.e.cache_bytes);
    snprintf(label, sizeof label, "%s: the parked one's next turn from the file: the logits from nothing", name);
    int cached = run_against_fresh(&back, &fx.fresh, whole_request(next_first, n_first + 1, 0, 0, 4), label);
    snprintf(label, sizeof label, "%s: the slot's next turn from the file: the logits from nothing", name);
    int cached_other = run_against_fresh(&back, &fx.fresh, whole_request(next_other, n_other + 1, 0, 0, 4), label);
    snprintf(label, sizeof label, "%s: ... each reusing all the tokens it held (%d and %d)", name, n_first, n_other);
    check(cached == n_first && cached_other == n_other, label, "%d and %d", cached, cached_other);
    engine_free(&back);
    const int64_t one = fx.e.parked[0].bytes + 2 * fx.e.checkpoint_bytes; /* the first conversation's share, the larger */
    loaded = cache_load_into(&back, &fx.m, &fx.t, one, cache, identity, why);
    snprintf(label, sizeof label, "%s: a budget that holds one: the most recently used, none evicted", name);
    check(loaded == 1 && back.n_parked == 1 && back.parked[0].past.n == n_other, label, "%d loaded (%s)", loaded, loaded < 0 ? why : "");
    engine_free(&back);
    loaded = cache_load_into(&back, &fx.m, &fx.t, 64 << 20, cache, identity + 1, why);
    snprintf(label, sizeof label, "%s: another model's file is refused, said", name);
    check(loaded == -1 && back.n_parked == 0 && strstr(why, "another model"), label, "%d loaded: %s", loaded, why);
    engine_free(&back);
    struct model short_ctx; /* the same model with a context of 40: the conversation of 45 tokens left out, not the file */
    model_load(&short_ctx, path, 40, kv);
    loaded = cache_load_into(&back, &short_ctx, &fx.t, 64 << 20, cache, model_identity(&short_ctx), why);
    snprintf(label, sizeof label, "%s: a context shorter than a conversation: that one skipped, the other read", name);
    check(model_identity(&short_ctx) == identity && loaded == 1 && back.parked[0].past.n == n_other, label, "%d loaded (%s)", loaded,
          loaded < 0 ? why : "");
    engine_free(&back);
    model_free(&short_ctx);
    FILE *f = fopen(cache, "rb");
    fseek(f, 0, SEEK_END);
    const long size = ftell(f);
    unsigned char *bytes = plat_alloc((size_t)size);
    fseek(f, 0, SEEK_SET);
    int refused = fread(bytes, 1, (size_t)size, f) == (size_t)size, cuts = 0;
    fclose(f);
    for (int k = 0; refused && k < 40; k++) { /* cut short: at the header, in the first record's tokens, ..., the last byte */
        const long at = k < 39 ? (long)((double)size * k / 39.0) : size - 1;
        f = fopen(cache, "wb");
        fwrite(bytes, 1, (size_t)at, f);
        fclose(f);
        loaded = cache_load_into(&back, &fx.m, &fx.t, 64 << 20, cache, identity, why);
        refused = loaded == -1 && back.n_parked == 0 && back.cache_bytes == 0, cuts++;
        engine_free(&back);
    }
    const struct { long at; int32_t value; } damage[] = {{32, 1 << 30}, {32, -1}, {24, 1 << 20}, {28, 9}, {32 + 4L * n_other, 0}, {size - 16, 0x3c3c3c3c}};
    for (size_t k = 0; refused && k < sizeof damage / sizeof *damage; k++) { /* tokens, counts, a checkpoint's position, KV bytes */
        unsigned char *copy = plat_alloc((size_t)size);
        memcpy(copy, bytes, (size_t)size);
        memcpy(copy + damage[k].at, &damage[k].value, 4);
        f = fopen(cache, "wb");
        fwrite(copy, 1, (size_t)size, f);
        fclose(f);
        loaded = cache_load_into(&back, &fx.m, &fx.t, 64 << 20, cache, identity, why);
        refused = loaded == -1 && back.n_parked == 0 && back.cache_bytes == 0;
        engine_free(&back);
        free(copy);
    }
    snprintf(label, sizeof label, "%s: a file cut short (40 places) or damaged (tokens, counts, a checkpoint's position, KV bytes): refused, nothing kept", name);
    check(refused && cuts == 40, label, "%d cuts refused; the last: %d loaded, %s", cuts, loaded, why);
    unlink(cache);
    free(bytes);
    reuse_fixture_close(&fx);
}

/* The fields of a chat answer fed in PIECES (NULL-terminated) to a parser for a request with
 * TOOLS (JSON text, or NULL), thinking at first when THINK. */
static void parse_answer(struct serve_job *j, const char *const *pieces, const char *tools, int think)
{
    const char *why;
    memset(j, 0, sizeof *j);
    j->body = tools ? json_parse(tools, strlen(tools), &why) : NULL;
    j->tools = j->body;
    j->answer.part = think ? SERVE_PART_REASONING : SERVE_PART_CONTENT;
    for (int i = 0; pieces[i]; i++) serve_answer_feed(&j->answer, j->tools, pieces[i], strlen(pieces[i]), 0);
    serve_answer_feed(&j->answer, j->tools, "", 0, 1);
}

static void free_answer(struct serve_job *j)
{
    serve_answer_free(&j->answer);
    json_free(j->body);
}

static int field_is(const struct serve_job *j, enum serve_part part, const char *want)
{
    const struct tok_buf *f = &j->answer.field[part];
    return f->n == strlen(want) && (!f->n || !memcmp(f->p, want, f->n));
}

/* Thinking, content and tool calls split out of an answer however its text is cut into pieces. */
static void test_answer_fields(void)
{
    static const char tools[] = "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\",\"properties\":"
                                "{\"city\":{\"type\":\"string\"},\"days\":{\"type\":\"integer\"},\"metric\":{\"type\":\"boolean\"},\"zip\":{\"type\":\"string\"}}}}}]";
    struct serve_job j;
    const char *think[] = {"\nLet me ", "think.\n</th", "ink>\n\nThe answer", " is 4.\n", NULL};
    parse_answer(&j, think, NULL, 1);
    check(field_is(&j, SERVE_PART_REASONING, "Let me think.") && field_is(&j, SERVE_PART_CONTENT, "The answer is 4.") && !j.answer.n_calls,
          "answer: the think block becomes reasoning_content, split across pieces; the rest is content", "[%s] [%s]",
          j.answer.field[0].p, j.answer.field[1].p);
    free_answer(&j);
    const char *call[] = {"I'll check.\n\n<tool", "_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n<parameter=days>\n3\n</para",
                          "meter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=zip>\n8001\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                          "<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n</function>\n</tool_call>", NULL};
    parse_answer(&j, call, tools, 0);
    check(field_is(&j, SERVE_PART_CONTENT, "I'll check.") && j.answer.n_calls == 2 && !strcmp(j.answer.calls[0].name, "get_weather") &&
              !strcmp(j.answer.calls[0].arguments, "{\"city\": \"Zürich\", \"days\": 3, \"metric\": true, \"zip\": \"8001\"}") &&
              !strcmp(j.answer.calls[1].arguments, "{\"city\": \"Bern\"}"),
          "answer: two tool calls, their arguments typed by the schema (a string that looks like a number stays a string)", "%d calls: %s",
          j.answer.n_calls, j.answer.n_calls ? j.answer.calls[0].arguments : "");
    free_answer(&j);
    static const char enum_tools[] = "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\",\"properties\":"
                                     "{\"a\":{\"enum\":[\"12\",7]},\"b\":{\"enum\":[\"12\",7]},\"c\":{\"enum\":[\"true\"]}}}}}]";
    const char *enums[] = {"<tool_call>\n<function=f>\n<parameter=a>\n12\n</parameter>\n<parameter=b>\n7\n</parameter>\n<parameter=c>\ntrue\n"
                           "</parameter>\n</function>\n</tool_call>", NULL};
    parse_answer(&j, enums, enum_tools, 0);
    check(j.answer.n_calls == 1 && !strcmp(j.answer.calls[0].arguments, "{\"a\": \"12\", \"b\": 7, \"c\": \"true\"}"),
          "answer: a value of an enum without a type is typed only as one of its values (\"12\" among strings stays one)", "%s",
          j.answer.n_calls ? j.answer.calls[0].arguments : "no call");
    free_answer(&j);
    const char *broken[] = {"<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</function>\n</tool_call>", NULL};
    parse_answer(&j, broken, tools, 0);
    check(!j.answer.n_calls && field_is(&j, SERVE_PART_CONTENT, broken[0]), "answer: a call written badly comes back as text", "[%s]",
          j.answer.field[1].p);
    free_answer(&j);
    parse_answer(&j, call, NULL, 0);
    check(!j.answer.n_calls && j.answer.field[1].n > 100, "answer: without tools in the request, <tool_call> is text", "%d calls", j.answer.n_calls);
    free_answer(&j);
    const char *unclosed[] = {"still thinking when the tokens ran out </thi", NULL};
    parse_answer(&j, unclosed, NULL, 1);
    check(field_is(&j, SERVE_PART_REASONING, "still thinking when the tokens ran out </thi") && !j.answer.field[1].n,
          "answer: a think block never closed is all reasoning", "[%s]", j.answer.field[0].p);
    free_answer(&j);
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
        struct json *v = json_parse(good[i], strlen(good[i]), &why);
        if (!v) printf("# rejected %s: %s\n", good[i], why);
        all &= v != NULL;
        json_free(v);
    }
    check(all, "JSON: valid documents parse", "see above");
    all = 1;
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        struct json *v = json_parse(bad[i], strlen(bad[i]), &why);
        if (v) printf("# accepted %s\n", bad[i]);
        all &= v == NULL && why != NULL;
        json_free(v);
    }
    check(all, "JSON: malformed documents are refused with a reason", "see above");
    char deep[200];
    memset(deep, '[', 100);
    memset(deep + 100, ']', 100);
    struct json *v = json_parse(deep, 200, &why);
    check(!v && why && strstr(why, "deep"), "JSON: nesting past the limit is refused", "%s", why ? why : "accepted");
    const char *doc = "{\"s\":\"\\u00e9\\ud83d\\ude00\",\"n\":[1,2]}";
    v = json_parse(doc, strlen(doc), &why);
    const struct json *s = json_get(v, "s"), *n = json_get(v, "n");
    check(s && !strcmp(s->str, "\xc3\xa9\xf0\x9f\x98\x80") && n && n->child && n->child->next && n->child->next->number == 2,
          "JSON: escapes decode to UTF-8, members are found", "");
    json_free(v);
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

/* parallel_tool_calls false: the answer cut after its first call's </tool_call> (a tag split between pieces found), not
 * inside a think block the answer opens in; the text up to the cut parses as one call. */
static void test_one_call(void)
{
    static const struct { int think; const char *pieces[4]; size_t end; } cases[] = {
        {0, {"<tool_call>\n<function=f>\n</function>\n</tool", "_call>\n<tool_call>\n<function=g>", NULL}, 49},
        {1, {"a </tool_call> b</thi", "nk>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>\n", "<tool_call>", NULL}, 75},
        {1, {"thinking <tool_call>\n<function=f>\n</function>\n</tool_call>", " on", NULL}, 0},
    };
    struct json tools = {.kind = JSON_ARRAY};
    int right = 0;
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        struct serve_job j;
        memset(&j, 0, sizeof j);
        j.one_call = 1, j.tools = &tools, j.think = cases[k].think;
        int stopped = 0;
        for (int i = 0; cases[k].pieces[i] && !stopped; i++) stopped = serve_job_append(&j, cases[k].pieces[i], strlen(cases[k].pieces[i]));
        struct serve_answer a = {.part = j.think ? SERVE_PART_REASONING : SERVE_PART_CONTENT};
        serve_answer_feed(&a, &tools, j.text, j.len, 1);
        right += cases[k].end ? stopped && j.len == cases[k].end && j.call_end == cases[k].end && a.n_calls == 1 && j.released == j.len
                              : !stopped && !j.call_end && a.n_calls == 0;
        serve_answer_free(&a);
        free(j.text);
    }
    check(right == 3, "parallel_tool_calls false: the answer ends after its first call, not inside thinking", "%d of 3", right);
}

/* The prompt of chat request TEXT rendered by KIND's template (malloc'd), or NULL with E set. */
static char *render_chat(enum tok_template kind, const char *text, struct serve_error *e)
{
    struct tok t;
    struct serve srv;
    memset(&t, 0, sizeof t);
    memset(&srv, 0, sizeof srv);
    t.chat_template = kind;
    srv.tok = &t;
    srv.think = 1;
    size_t len;
    struct json *body = serve_parse_body(text, strlen(text), e);
    char *out = body ? serve_chat_text(&srv, body, NULL, 1, &len, e) : NULL;
    json_free(body);
    return out;
}

/* A request of another API (Anthropic's, Responses) beside the chat request it means, written by hand. */
struct request_pair { const char *name, *request, *chat; };
struct refusal { const char *body, *words; };
typedef char *request_fn(const struct json *body, struct serve_error *e);

/* Whether each of N PAIRS' requests, translated by FN, renders the prompt of its chat request, byte for byte, in both
 * templates (each that does not, said). */
static int same_prompts(const struct request_pair *pairs, size_t n, request_fn *fn)
{
    int same = 0, count = 0;
    for (size_t i = 0; i < n; i++)
        for (enum tok_template kind = TOK_TEMPLATE_QWEN35; kind <= TOK_TEMPLATE_QWEN36; kind++, count++) {
            struct serve_error e = {0};
            struct json *body = serve_parse_body(pairs[i].request, strlen(pairs[i].request), &e);
            char *chat = body ? fn(body, &e) : NULL;
            char *a = chat ? render_chat(kind, chat, &e) : NULL, *b = render_chat(kind, pairs[i].chat, &e);
            same += a && b && !strcmp(a, b);
            if (!(a && b && !strcmp(a, b))) printf("# %s (%s): %s\n#  vs %s\n", pairs[i].name, tok_template_names[kind], a ? a : e.message, b ? b : e.message);
            json_free(body);
            free(chat), free(a), free(b);
        }
    return same == count;
}

/* Anthropic requests against the chat requests they mean, written by hand: each renders the same prompt, byte for
 * byte, in both templates; the options map to their chat fields; what cannot be translated is refused by name. */
static void test_messages_request(void)
{
    static const struct request_pair pairs[] = {
        {"system string", "{\"system\":\"Be brief.\",\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}]}",
         "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi\"}]}"},
        {"text blocks", "{\"system\":[{\"type\":\"text\",\"text\":\"A\"},{\"type\":\"text\",\"text\":\"B\",\"cache_control\":{\"type\":\"ephemeral\"}}],"
         "\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"one \"},{\"type\":\"text\",\"text\":\"two\"}]},"
         "{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":\"three\"}]},{\"role\":\"user\",\"content\":\"four\"}],\"system_extra\":1}",
         "{\"messages\":[{\"role\":\"system\",\"content\":\"AB\"},{\"role\":\"user\",\"content\":\"one two\"},{\"role\":\"assistant\",\"content\":\"three\"},"
         "{\"role\":\"user\",\"content\":\"four\"}]}"},
        {"tools, thinking, a call and its result",
         "{\"tools\":[{\"name\":\"get_weather\",\"description\":\"Weather\",\"input_schema\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}}}}],"
         "\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Bern?\"},{\"role\":\"assistant\",\"content\":[{\"type\":\"thinking\",\"thinking\":"
         "\"Need the tool.\",\"signature\":\"x\"},{\"type\":\"text\",\"text\":\"Checking.\"},{\"type\":\"tool_use\",\"id\":\"toolu_1\",\"name\":\"get_weather\","
         "\"input\":{\"city\":\"Bern\",\"days\":2}}]},{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"tool_use_id\":\"toolu_1\",\"content\":"
         "\"12 C\"},{\"type\":\"text\",\"text\":\"And tomorrow?\"}]}],\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":1024}}",
         "{\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather\",\"parameters\":{\"type\":\"object\","
         "\"properties\":{\"city\":{\"type\":\"string\"}}}}}],\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Bern?\"},{\"role\":\"assistant\","
         "\"content\":\"Checking.\",\"reasoning_content\":\"Need the tool.\",\"tool_calls\":[{\"id\":\"toolu_1\",\"type\":\"function\",\"function\":"
         "{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Bern\",\"days\":2}}}]},{\"role\":\"tool\",\"tool_call_id\":\"toolu_1\",\"content\":\"12 C\"},"
         "{\"role\":\"user\",\"content\":\"And tomorrow?\"}],\"chat_template_kwargs\":{\"enable_thinking\":true}}"},
        {"two calls, results as blocks, thinking off",
         "{\"tools\":[{\"name\":\"f\",\"input_schema\":{\"type\":\"object\"}}],\"messages\":[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\","
         "\"content\":[{\"type\":\"tool_use\",\"id\":\"a\",\"name\":\"f\",\"input\":{}},{\"type\":\"redacted_thinking\",\"data\":\"zz\"},{\"type\":\"tool_use\","
         "\"id\":\"b\",\"name\":\"f\",\"input\":{\"x\":[1,2]}}]},{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"tool_use_id\":\"a\",\"content\":"
         "[{\"type\":\"text\",\"text\":\"r1\"}]},{\"type\":\"tool_result\",\"tool_use_id\":\"b\",\"content\":\"r2\",\"is_error\":true}]}],"
         "\"thinking\":{\"type\":\"disabled\"}}",
         "{\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\"}}}],\"messages\":[{\"role\":\"user\",\"content\":"
         "\"q\"},{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":{}}},"
         "{\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":{\"x\":[1,2]}}}]},{\"role\":\"tool\",\"content\":\"r1\"},{\"role\":\"tool\","
         "\"content\":\"r2\"}],\"chat_template_kwargs\":{\"enable_thinking\":false}}"},
        {"Claude Code's billing block (its nonce changes every request) left out of the system prompt",
         "{\"system\":[{\"type\":\"text\",\"text\":\"x-anthropic-billing-header: cc_version=2.1.197.a1b; cc_entrypoint=sdk-cli; cch=3f9a2;\"},"
         "{\"type\":\"text\",\"text\":\"You are terse.\"}],\"messages\":[{\"role\":\"system\",\"content\":[{\"type\":\"text\",\"text\":"
         "\"x-anthropic-billing-header: cch=00000;\"}]},{\"role\":\"user\",\"content\":\"Hi\"}]}",
         "{\"messages\":[{\"role\":\"system\",\"content\":\"You are terse.\"},{\"role\":\"user\",\"content\":\"Hi\"}]}"},
        {"system messages: the first one opens the chat, a later one is a user turn in its place",
         "{\"messages\":[{\"role\":\"system\",\"content\":[{\"type\":\"text\",\"text\":\"S\"}]},{\"role\":\"user\",\"content\":\"u1\"},"
         "{\"role\":\"system\",\"content\":\"reminder\"},{\"role\":\"assistant\",\"content\":\"a1\"},{\"role\":\"user\",\"content\":\"u2\"}]}",
         "{\"messages\":[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"user\",\"content\":\"u1\"},{\"role\":\"user\",\"content\":\"reminder\"},"
         "{\"role\":\"assistant\",\"content\":\"a1\"},{\"role\":\"user\",\"content\":\"u2\"}]}"},
    };
    check(same_prompts(pairs, sizeof pairs / sizeof *pairs, serve_messages_request),
          "messages: Anthropic requests render the prompts of the chat requests they mean", "");
}

/* BODY (a request of another API) translated by FN and parsed back, or NULL with E set. */
static struct json *translate_by(request_fn *fn, const char *body_text, struct serve_error *e)
{
    const char *why;
    struct json *body = serve_parse_body(body_text, strlen(body_text), e);
    char *chat = body ? fn(body, e) : NULL;
    struct json *out = chat ? json_parse(chat, strlen(chat), &why) : NULL;
    json_free(body);
    free(chat);
    return out;
}

static struct json *translate(const char *body_text, struct serve_error *e) { return translate_by(serve_messages_request, body_text, e); }

/* Whether each of N bodies, translated by FN, is a 400 whose message holds its words (each that is not, said). */
static int all_refused(const struct refusal *refused, size_t n, request_fn *fn)
{
    size_t right = 0;
    for (size_t i = 0; i < n; i++) {
        struct serve_error e = {0};
        struct json *a = translate_by(fn, refused[i].body, &e);
        int ok = !a && e.status == 400 && strstr(e.message, refused[i].words);
        if (!ok) printf("# %s: %s\n", refused[i].body, a ? "translated" : e.message);
        right += ok;
        json_free(a);
    }
    return right == n;
}

static double number_at(const struct json *v) { return v && v->kind == JSON_NUMBER ? v->number : -1; }

/* The options of Anthropic requests as their chat fields; what cannot be translated refused with words that name it. */
static void test_messages_options(void)
{
    static const struct refusal refused[] = {
        {"{\"messages\":[{\"role\":\"tool\",\"content\":\"x\"}]}", "'role' must be"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"system\",\"content\":[{\"type\":\"image\"}]}]}", "system messages"},
        {"{\"messages\":[],\"tools\":[{\"type\":\"web_search_20250305\",\"name\":\"web_search\"}]}", "server tools"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"document\",\"source\":{}}]}]}", "'document'"},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":[{\"type\":\"image\",\"source\":{}}]}]}", "assistant's content blocks of type 'image'"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"content\":[{\"type\":\"document\"}]}]}]}", "tool_result"},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":[{\"type\":\"tool_use\",\"input\":{}}]}]}", "tool_use block"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":[]}]}", "'content'"},
        {"{\"messages\":{}}", "'messages' must be a list"},
        {"{\"system\":5,\"messages\":[]}", "'system'"},
        {"{\"messages\":[],\"thinking\":{\"type\":\"on\"}}", "'thinking'"},
        {"{\"messages\":[],\"stop_sequences\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}", "'stop_sequences'"},
        {"{\"messages\":[],\"stop_sequences\":[\"\"]}", "'stop_sequences'"},
        {"{\"messages\":[],\"tool_choice\":{\"type\":\"x\"}}", "'tool_choice'"},
        {"{\"messages\":[],\"output_format\":{\"type\":\"json_object\"}}", "'output_format'"},
    };
    struct serve_error e = {0};
    struct json *a = translate("{\"messages\":[],\"tool_choice\":{\"type\":\"any\"},\"stop_sequences\":[\"a\",\"b\"],\"max_tokens\":7,"
                               "\"temperature\":0.5,\"top_k\":3,\"metadata\":{\"user_id\":\"u\"}}", &e);
    const struct json *stop = json_get(a, "stop");
    check(a && tok_json_is(json_get(a, "tool_choice"), "required") && stop && tok_json_is(stop->child, "a") && tok_json_is(stop->child->next, "b") &&
              number_at(json_get(a, "max_tokens")) == 7 && number_at(json_get(a, "temperature")) == 0.5 && number_at(json_get(a, "top_k")) == 3 &&
              !json_get(a, "metadata"),
          "messages: tool_choice any is \"required\", stop_sequences stop, sampling fields pass", "%s", a ? "" : e.message);
    json_free(a);
    a = translate("{\"messages\":[],\"tool_choice\":{\"type\":\"tool\",\"name\":\"f\",\"disable_parallel_tool_use\":true},"
                  "\"output_format\":{\"type\":\"json_schema\",\"schema\":{\"type\":\"object\"}}}", &e);
    const struct json *parallel = json_get(a, "parallel_tool_calls");
    check(a && tok_json_is(json_get(json_get(json_get(a, "tool_choice"), "function"), "name"), "f") && parallel && parallel->kind == JSON_BOOL &&
              !parallel->boolean && tok_json_is(json_get(json_get(json_get(json_get(a, "response_format"), "json_schema"), "schema"), "type"), "object"),
          "messages: tool_choice tool names the function, disable_parallel_tool_use, output_format's schema", "%s", a ? "" : e.message);
    json_free(a);
    a = translate("{\"messages\":[],\"tool_choice\":{\"type\":\"none\"},\"output_config\":{\"format\":{\"type\":\"json_schema\",\"schema\":{}}}}", &e);
    check(a && tok_json_is(json_get(a, "tool_choice"), "none") && json_get(json_get(json_get(a, "response_format"), "json_schema"), "schema"),
          "messages: tool_choice none, output_config.format", "%s", a ? "" : e.message);
    json_free(a);
    check(all_refused(refused, sizeof refused / sizeof *refused, serve_messages_request), "messages: what cannot be translated is a 400 naming it", "");
}

/* Element I of list V, or NULL. */
static const struct json *nth(const struct json *v, int i)
{
    const struct json *c = v && v->kind == JSON_ARRAY ? v->child : NULL;
    while (c && i-- > 0) c = c->next;
    return c;
}

/* The one tool the answer tests' requests offer. */
static const char weather_tools[] = "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\"}}}]";

/* A finished chat job J, and its server SRV (model "m"): its answer TEXT, opened in a think block, TOOLS (JSON text) in
 * the request; the end of the turn after 7 tokens of a 10-token prompt, 4 of them reused. */
static void answered_job(struct serve *srv, struct serve_job *j, const char *tools, const char *text)
{
    const char *why;
    memset(srv, 0, sizeof *srv);
    memset(j, 0, sizeof *j);
    srv->model_id = "m";
    j->body = json_parse(tools, strlen(tools), &why);
    j->tools = j->body;
    j->chat = j->think = j->done = 1;
    j->answer.part = SERVE_PART_REASONING;
    j->text = plat_strdup(text);
    j->len = strlen(text);
    j->gen.stop = ENGINE_STOP_EOG, j->gen.n_prompt = 10, j->gen.n_cached = 4, j->gen.n_tokens = 7;
}

static void answered_job_free(struct serve_job *j)
{
    serve_answer_free(&j->answer);
    json_free(j->body), json_free(j->asked);
    free(j->text);
}

/* J's answer (its TEXT) fed in pieces of 5 bytes, as a stream takes it, with the events EVENTS_OF writes for each (its
 * opening first, its end with the last piece): malloc'd, *LEN bytes. */
static char *stream_in_pieces(struct serve *srv, struct serve_job *j, const char *text, serve_events_fn *events_of, void *state, size_t *len)
{
    struct serve_conn conn;
    char *out = NULL;
    memset(&conn, 0, sizeof conn);
    conn.srv = srv;
    serve_answer_free(&j->answer);
    j->answer.part = SERVE_PART_REASONING;
    FILE *f = open_memstream(&out, len);
    events_of(f, &conn, j, state, NULL, -1, 0);
    for (size_t at = 0; at < j->len; at += 5) {
        size_t piece = j->len - at < 5 ? j->len - at : 5;
        serve_answer_feed(&j->answer, j->tools, text + at, piece, at + piece == j->len);
        events_of(f, &conn, j, state, text + at, (long)piece, at + piece == j->len);
    }
    fclose(f);
    return out;
}

/* The next server-sent event at *AT ("event: NAME\ndata: JSON\n\n"): its data parsed, *AT moved past it; NULL at the end,
 * or (*BAD set) for one malformed or whose data's type is not its name. */
static struct json *next_event(char **at, int *bad)
{
    char *ev = *at, *end = strstr(ev, "\n\n"), *nl = strchr(ev, '\n');
    const char *why;
    if (!*ev) return NULL;
    if (!end || !nl || strncmp(ev, "event: ", 7) || strncmp(nl + 1, "data: ", 6)) return *bad = 1, NULL;
    *end = 0, *nl = 0;
    *at = end + 2;
    struct json *d = json_parse(nl + 7, strlen(nl + 7), &why);
    if (!d || !tok_json_is(json_get(d, "type"), ev + 7)) *bad = 1, json_free(d), d = NULL;
    return d;
}

/* A thinking, text and tool_use answer in Anthropic's shape, whole and as a stream of events fed in pieces of 5 bytes:
 * the stream's events (each named as its data's type) rebuild the whole answer's blocks; usage splits the prompt into
 * computed and cached; stop_reason and stop_sequence follow the generation's end. */
static void test_messages_answer(void)
{
    static const char text[] = "Let me see.\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n"
                               "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>";
    struct serve srv;
    struct serve_job j;
    const char *why;
    answered_job(&srv, &j, weather_tools, text);
    size_t n;
    char *out = serve_message_json(&srv, &j, &n);
    struct json *m = json_parse(out, n, &why);
    const struct json *content = json_get(m, "content"), *usage = json_get(m, "usage"), *input = json_get(nth(content, 2), "input");
    check(m && tok_json_is(json_get(m, "type"), "message") && tok_json_is(json_get(m, "role"), "assistant") &&
              tok_json_is(json_get(nth(content, 0), "thinking"), "Let me see.") && tok_json_is(json_get(nth(content, 1), "text"), "Checking.") &&
              tok_json_is(json_get(nth(content, 2), "type"), "tool_use") && tok_json_is(json_get(nth(content, 2), "name"), "get_weather") &&
              tok_json_is(json_get(input, "city"), "Bern") && number_at(json_get(input, "days")) == 2 && !nth(content, 3) &&
              tok_json_is(json_get(m, "stop_reason"), "tool_use") && json_get(m, "stop_sequence")->kind == JSON_NULL &&
              number_at(json_get(usage, "input_tokens")) == 6 && number_at(json_get(usage, "cache_read_input_tokens")) == 4 &&
              number_at(json_get(usage, "output_tokens")) == 7,
          "messages: an answer's thinking, text and tool_use blocks, stop_reason tool_use, usage", "%.600s", out);
    /* the same text streamed */
    struct serve_blocks b = {{{0, 0}, 0}, 0, -1, 1};
    size_t len;
    char *events = stream_in_pieces(&srv, &j, text, serve_messages_events, &b, &len), *at = events;
    struct tok_buf block[4] = {{0}};
    char kind[4][16] = {""};
    int bad = 0, order = 1, opened = 0, stopped = 0, ends = len > 16 && !strcmp(events + len - 16, "message_stop\"}\n\n");
    const char *stop_reason = "";
    for (struct json *d; (d = next_event(&at, &bad)); json_free(d)) {
        const char *type = json_get(d, "type")->str;
        int index = (int)number_at(json_get(d, "index"));
        const struct json *delta = json_get(d, "delta");
        if (!strcmp(type, "content_block_start")) {
            order &= index == opened && index == stopped && index < 4;
            if (index >= 0 && index < 4) snprintf(kind[index], sizeof kind[index], "%s", json_get(json_get(d, "content_block"), "type")->str);
            opened++;
        } else if (!strcmp(type, "content_block_delta") && index >= 0 && index < 4) {
            order &= index == opened - 1 && index == stopped;
            const struct json *piece = json_get(delta, "text") ? json_get(delta, "text") : json_get(delta, "thinking") ? json_get(delta, "thinking")
                                                                                                                          : json_get(delta, "partial_json");
            if (piece) tok_buf_put(&block[index], piece->str, piece->len);
        } else if (!strcmp(type, "content_block_stop")) order &= index == stopped++ && index == opened - 1;
        else if (!strcmp(type, "message_delta")) stop_reason = tok_json_is(json_get(delta, "stop_reason"), "tool_use") ? "tool_use" : "other";
    }
    struct json *streamed_input = block[2].p ? json_parse(block[2].p, block[2].n, &why) : NULL;
    check(!bad && order && opened == 3 && stopped == 3 && !strcmp(kind[0], "thinking") && !strcmp(kind[1], "text") && !strcmp(kind[2], "tool_use") &&
              block[0].p && !strcmp(block[0].p, "Let me see.") && block[1].p && !strcmp(block[1].p, "Checking.") &&
              tok_json_is(json_get(streamed_input, "city"), "Bern") && number_at(json_get(streamed_input, "days")) == 2 &&
              !strcmp(stop_reason, "tool_use") && ends,
          "messages: the stream's events rebuild the same blocks, in order, and end with message_stop", "bad %d, order %d, %d opened, %d stopped, ends %d",
          bad, order, opened, stopped, ends);
    for (int k = 0; k < 4; k++) free(block[k].p);
    json_free(streamed_input);
    free(events);
    json_free(m);
    free(out);
    /* a stop string's end, and a length's */
    serve_answer_free(&j.answer);
    j.answer.part = SERVE_PART_CONTENT;
    j.think = 0, j.tools = NULL;
    j.stop[0] = "END", j.n_stop = 1, j.stop_hit = 1, j.gen.stop = ENGINE_STOP_SINK;
    out = serve_message_json(&srv, &j, &n);
    m = json_parse(out, n, &why);
    int stop_seq = tok_json_is(json_get(m, "stop_reason"), "stop_sequence") && tok_json_is(json_get(m, "stop_sequence"), "END");
    json_free(m), free(out);
    serve_answer_free(&j.answer);
    j.stop_hit = 0, j.gen.stop = ENGINE_STOP_LENGTH;
    out = serve_message_json(&srv, &j, &n);
    m = json_parse(out, n, &why);
    check(stop_seq && tok_json_is(json_get(m, "stop_reason"), "max_tokens") && json_get(m, "stop_sequence")->kind == JSON_NULL,
          "messages: stop_reason stop_sequence names the string; max_tokens at the length", "%.300s", out);
    json_free(m), free(out);
    answered_job_free(&j);
}

/* Responses requests against the chat requests they mean, written by hand: each renders the same prompt, byte for byte,
 * in both templates (the items grouped into turns as a chat client would send them); the options map to their chat
 * fields; what cannot be translated is refused by name. */
static void test_responses_request(void)
{
    static const struct request_pair pairs[] = {
        {"instructions and the opening developer message one system message, any other a user turn in its place",
         "{\"instructions\":\"I\",\"input\":[{\"role\":\"developer\",\"content\":\"D1\"},{\"type\":\"message\",\"role\":\"system\",\"content\":"
         "[{\"type\":\"input_text\",\"text\":\"D2\"}]},{\"role\":\"user\",\"content\":\"u1\"},{\"role\":\"developer\",\"content\":\"late\"},"
         "{\"role\":\"user\",\"content\":[{\"type\":\"input_text\",\"text\":\"u\"},{\"type\":\"input_text\",\"text\":\"2\"}]}]}",
         "{\"messages\":[{\"role\":\"system\",\"content\":\"I\\n\\nD1\"},{\"role\":\"user\",\"content\":\"D2\"},{\"role\":\"user\",\"content\":\"u1\"},"
         "{\"role\":\"user\",\"content\":\"late\"},{\"role\":\"user\",\"content\":\"u2\"}]}"},
        {"a turn's reasoning, text and calls one assistant message, their outputs tool messages; tools of a namespace flattened, "
         "hosted ones left out",
         "{\"tools\":[{\"type\":\"function\",\"name\":\"f\",\"description\":\"F\",\"parameters\":{\"type\":\"object\"},\"strict\":true},{\"type\":\"namespace\","
         "\"name\":\"ns\",\"description\":\"N\",\"tools\":[{\"type\":\"function\",\"name\":\"g\",\"parameters\":{\"type\":\"object\",\"properties\":"
         "{\"k\":{\"type\":\"string\"}}}}]},{\"type\":\"web_search\"},{\"type\":\"custom\",\"name\":\"apply_patch\"}],\"reasoning\":{\"effort\":\"high\"},"
         "\"input\":[{\"role\":\"user\",\"content\":\"q\"},{\"type\":\"reasoning\",\"id\":\"rs_1\",\"summary\":[{\"type\":\"summary_text\",\"text\":\"S\"}],"
         "\"content\":[{\"type\":\"reasoning_text\",\"text\":\"R\"}]},{\"type\":\"message\",\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\","
         "\"text\":\"T\",\"annotations\":[]}]},{\"type\":\"function_call\",\"call_id\":\"a\",\"name\":\"f\",\"arguments\":\"{}\"},{\"type\":\"function_call\","
         "\"call_id\":\"b\",\"name\":\"g\",\"arguments\":\"{\\\"k\\\":\\\"v\\\"}\"},{\"type\":\"function_call_output\",\"call_id\":\"a\",\"output\":\"r1\"},"
         "{\"type\":\"function_call_output\",\"call_id\":\"b\",\"output\":[{\"type\":\"input_text\",\"text\":\"r2\"}]}]}",
         "{\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"description\":\"F\",\"parameters\":{\"type\":\"object\"}}},{\"type\":\"function\","
         "\"function\":{\"name\":\"g\",\"parameters\":{\"type\":\"object\",\"properties\":{\"k\":{\"type\":\"string\"}}}}}],\"chat_template_kwargs\":"
         "{\"enable_thinking\":true},\"messages\":[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"T\",\"reasoning_content\":\"R\","
         "\"tool_calls\":[{\"id\":\"a\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}},{\"id\":\"b\",\"type\":\"function\","
         "\"function\":{\"name\":\"g\",\"arguments\":\"{\\\"k\\\":\\\"v\\\"}\"}}]},{\"role\":\"tool\",\"tool_call_id\":\"a\",\"content\":\"r1\"},"
         "{\"role\":\"tool\",\"tool_call_id\":\"b\",\"content\":\"r2\"}]}"},
        {"items out of a turn's order start another assistant message; a summary stands in for reasoning text; encrypted reasoning adds nothing",
         "{\"reasoning\":{\"effort\":\"low\"},\"input\":[{\"role\":\"user\",\"content\":\"q\"},{\"type\":\"reasoning\",\"encrypted_content\":\"zz\"},"
         "{\"role\":\"assistant\",\"content\":\"A1\"},{\"type\":\"reasoning\",\"summary\":[{\"type\":\"summary_text\",\"text\":\"S1\"},{\"type\":"
         "\"summary_text\",\"text\":\"S2\"}]},{\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",\"text\":\"A2\"},{\"type\":\"refusal\","
         "\"refusal\":\" no\"}]},{\"role\":\"assistant\",\"content\":\"A3\"}]}",
         "{\"chat_template_kwargs\":{\"enable_thinking\":true},\"messages\":[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"A1\"},"
         "{\"role\":\"assistant\",\"content\":\"A2 no\",\"reasoning_content\":\"S1\\n\\nS2\"},{\"role\":\"assistant\",\"content\":\"A3\"}]}"},
        {"a string input, reasoning.effort none",
         "{\"input\":\"hi\",\"reasoning\":{\"effort\":\"none\",\"summary\":\"auto\"},\"store\":false,\"include\":[\"reasoning.encrypted_content\"]}",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"chat_template_kwargs\":{\"enable_thinking\":false}}"},
    };
    static const struct refusal refused[] = {
        {"{\"input\":\"x\",\"previous_response_id\":\"resp_1\"}", "stores no responses"}, {"{\"input\":\"x\",\"conversation\":{\"id\":\"c\"}}", "stores no"},
        {"{\"input\":\"x\",\"background\":true}", "'background'"}, {"{\"instructions\":\"x\"}", "'input' must be"},
        {"{\"input\":[{\"type\":\"item_reference\",\"id\":\"x\"}]}", "'item_reference' are not supported"},
        {"{\"input\":[{\"role\":\"user\",\"content\":[{\"type\":\"input_file\",\"file_id\":\"f\"}]}]}", "'input_file'"},
        {"{\"input\":[{\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\"}]}]}", "has no text"},
        {"{\"input\":[{\"type\":\"function_call\",\"name\":\"f\",\"arguments\":\"{}\"}]}", "'call_id'"},
        {"{\"input\":[{\"type\":\"function_call_output\",\"output\":\"r\"}]}", "'call_id'"},
        {"{\"input\":[{\"role\":\"tool\",\"content\":\"x\"}]}", "'role' must be"}, {"{\"input\":\"x\",\"instructions\":5}", "'instructions'"},
        {"{\"input\":\"x\",\"tools\":[{\"type\":\"function\"}]}", "needs a 'name'"}, {"{\"input\":\"x\",\"tool_choice\":{\"type\":\"web_search\"}}", "hosted"},
        {"{\"input\":\"x\",\"reasoning\":{\"effort\":\"max\"}}", "'reasoning.effort'"}, {"{\"input\":\"x\",\"text\":{\"format\":{\"type\":\"yaml\"}}}", "'text.format'"},
        {"{\"input\":\"x\",\"max_output_tokens\":0}", "'max_output_tokens'"},
    };
    check(same_prompts(pairs, sizeof pairs / sizeof *pairs, serve_responses_request),
          "responses: Responses requests render the prompts of the chat requests they mean", "");
    struct serve_error e = {0};
    struct json *a = translate_by(serve_responses_request, "{\"input\":\"x\",\"max_output_tokens\":7,\"temperature\":0.5,\"top_k\":3,\"parallel_tool_calls\":"
                                  "false,\"tool_choice\":{\"type\":\"function\",\"name\":\"g\"},\"text\":{\"format\":{\"type\":\"json_schema\",\"name\":\"n\","
                                  "\"schema\":{\"type\":\"object\"},\"strict\":true}},\"metadata\":{\"k\":\"v\"},\"prompt_cache_key\":\"p\"}", &e);
    const struct json *parallel = json_get(a, "parallel_tool_calls");
    check(a && number_at(json_get(a, "max_tokens")) == 7 && number_at(json_get(a, "temperature")) == 0.5 && number_at(json_get(a, "top_k")) == 3 &&
              parallel && parallel->kind == JSON_BOOL && !parallel->boolean &&
              tok_json_is(json_get(json_get(json_get(a, "tool_choice"), "function"), "name"), "g") &&
              tok_json_is(json_get(json_get(json_get(json_get(a, "response_format"), "json_schema"), "schema"), "type"), "object") &&
              !json_get(a, "metadata") && !json_get(a, "prompt_cache_key"),
          "responses: max_output_tokens is max_tokens, sampling passes, tool_choice function, text.format's schema", "%s", a ? "" : e.message);
    json_free(a);
    check(all_refused(refused, sizeof refused / sizeof *refused, serve_responses_request), "responses: what cannot be translated is a 400 naming it", "");
}

/* Items I and K's texts, names, namespaces, arguments and types alike (their ids aside). */
static int same_item(const struct json *a, const struct json *b)
{
    static const char *const keys[] = {"type", "name", "namespace", "arguments", "status", "role"};
    for (size_t k = 0; k < sizeof keys / sizeof *keys; k++) {
        const struct json *x = json_get(a, keys[k]), *y = json_get(b, keys[k]);
        if (!x != !y || (x && (x->kind != JSON_STRING || !tok_json_is(y, x->str)))) return 0;
    }
    const struct json *x = json_get(nth(json_get(a, "content"), 0), "text"), *y = json_get(nth(json_get(b, "content"), 0), "text");
    return !x == !y && (!x || tok_json_is(y, x->str));
}

/* A reasoning, text and two-call answer (one call of a namespace's tool) as a response, whole and as a stream of events
 * fed in pieces of 5 bytes: the items, usage (reasoning_tokens) and status; the stream's events, named as their data's
 * types and numbered in order, whose deltas build each item's text, end in response.completed with the same items. */
static void test_responses_answer(void)
{
    static const char tools[] = "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\"}}},"
                                "{\"type\":\"function\",\"function\":{\"name\":\"set_alarm\",\"parameters\":{\"type\":\"object\"}}}]";
    static const char asked[] = "{\"tools\":[{\"type\":\"function\",\"name\":\"get_weather\"},{\"type\":\"namespace\",\"name\":\"clock\",\"tools\":"
                                "[{\"type\":\"function\",\"name\":\"set_alarm\"}]}]}";
    static const char text[] = "Let me see.\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n"
                               "</function>\n</tool_call>\n<tool_call>\n<function=set_alarm>\n<parameter=hour>\n7\n</parameter>\n</function>\n</tool_call>";
    struct serve srv;
    struct serve_job j;
    const char *why;
    answered_job(&srv, &j, tools, text);
    j.asked = json_parse(asked, strlen(asked), &why);
    j.gen.n_tokens = 30, j.gen.n_thought = 6;
    size_t n;
    char *out = serve_response_json(&srv, &j, &n);
    struct json *whole = json_parse(out, n, &why);
    const struct json *items = json_get(whole, "output"), *usage = json_get(whole, "usage");
    check(whole && tok_json_is(json_get(whole, "object"), "response") && tok_json_is(json_get(whole, "status"), "completed") &&
              tok_json_is(json_get(nth(items, 0), "type"), "reasoning") && tok_json_is(json_get(nth(json_get(nth(items, 0), "content"), 0), "text"), "Let me see.") &&
              tok_json_is(json_get(nth(json_get(nth(items, 1), "content"), 0), "text"), "Checking.") &&
              tok_json_is(json_get(nth(items, 2), "name"), "get_weather") && !json_get(nth(items, 2), "namespace") &&
              tok_json_is(json_get(nth(items, 2), "arguments"), "{\"city\": \"Bern\"}") && tok_json_is(json_get(nth(items, 3), "namespace"), "clock") &&
              tok_json_is(json_get(nth(items, 3), "arguments"), "{\"hour\": 7}") && !nth(items, 4) &&
              number_at(json_get(usage, "input_tokens")) == 10 && number_at(json_get(json_get(usage, "input_tokens_details"), "cached_tokens")) == 4 &&
              number_at(json_get(json_get(usage, "output_tokens_details"), "reasoning_tokens")) == 6 && number_at(json_get(usage, "total_tokens")) == 40,
          "responses: an answer's reasoning, message and function_call items (a namespace named), status, usage", "%.700s", out);
    struct serve_resp_stream rs = {{{{0, 0}, 0}, NULL, 0, 0, -1, 0}, 1, 0};
    size_t len;
    char *events = stream_in_pieces(&srv, &j, text, serve_responses_events, &rs, &len), *at = events;
    struct tok_buf built[4] = {{0}};
    int bad = 0, numbered = 1, count = 0, same = 0;
    for (struct json *d; (d = next_event(&at, &bad)); json_free(d), count++) {
        const char *type = json_get(d, "type")->str;
        int k = (int)number_at(json_get(d, "output_index"));
        numbered &= number_at(json_get(d, "sequence_number")) == count;
        if (strstr(type, ".delta") && k >= 0 && k < 4) tok_buf_put(&built[k], json_get(d, "delta")->str, json_get(d, "delta")->len);
        if (!strcmp(type, "response.completed")) {
            const struct json *final = json_get(json_get(d, "response"), "output");
            for (int i = 0; i < 4; i++) {
                const struct json *it = nth(final, i), *t = json_get(nth(json_get(it, "content"), 0), "text");
                const struct json *piece = t ? t : json_get(it, "arguments");
                same += same_item(it, nth(items, i)) && piece && built[i].p && !strcmp(piece->str, built[i].p);
            }
            same -= nth(final, 4) != NULL;
        }
    }
    check(!bad && numbered && same == 4, "responses: the stream's events, numbered in order, build the same items and end in response.completed",
          "bad %d, numbered %d, %d of 4 items the same", bad, numbered, same);
    for (int k = 0; k < 4; k++) free(built[k].p);
    free(rs.out.items), free(events), free(out);
    json_free(whole);
    answered_job_free(&j);
}

/* serve_ollama_request of an /api/chat or /api/generate body, as a request_fn. */
static char *ollama_request(const struct json *body, int generate, struct serve_error *e)
{
    int raw, load;
    return serve_ollama_request(body, generate, &raw, &load, e);
}
static char *ollama_chat_request(const struct json *body, struct serve_error *e) { return ollama_request(body, 0, e); }
static char *ollama_generate_request(const struct json *body, struct serve_error *e) { return ollama_request(body, 1, e); }

/* Ollama requests against the chat requests they mean, written by hand: each renders the same prompt in both templates;
 * the options map to their chat fields; loads, raw prompts and what cannot be translated are told apart. */
static void test_ollama_request(void)
{
    static const struct request_pair chats[] = {
        {"messages with thinking, a call's object arguments and its result; tools; think on",
         "{\"think\":true,\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\"}}}],\"messages\":[{\"role\":\"system\","
         "\"content\":\"S\"},{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"\",\"thinking\":\"T\",\"tool_calls\":[{\"function\":"
         "{\"name\":\"f\",\"arguments\":{\"k\":\"v\",\"n\":2}}}]},{\"role\":\"tool\",\"content\":\"r\",\"tool_name\":\"f\"}],\"keep_alive\":\"5m\"}",
         "{\"chat_template_kwargs\":{\"enable_thinking\":true},\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":"
         "\"object\"}}}],\"messages\":[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":\"\","
         "\"reasoning_content\":\"T\",\"tool_calls\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"k\\\": \\\"v\\\", \\\"n\\\": 2}\"}}]},"
         "{\"role\":\"tool\",\"content\":\"r\"}]}"},
        {"think false", "{\"think\":false,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}",
         "{\"chat_template_kwargs\":{\"enable_thinking\":false},\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}"},
    };
    static const struct request_pair generations[] = {
        {"a system prompt and the prompt, think \"low\"", "{\"system\":\"S\",\"prompt\":\"p\",\"think\":\"low\",\"images\":[],\"template\":\"\"}",
         "{\"chat_template_kwargs\":{\"enable_thinking\":true},\"messages\":[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"user\",\"content\":\"p\"}]}"},
        {"the prompt alone", "{\"prompt\":\"p\"}", "{\"messages\":[{\"role\":\"user\",\"content\":\"p\"}]}"},
    };
    static const struct refusal refused[] = {
        {"{\"messages\":{}}", "'messages' must be a list"}, {"{\"messages\":[{\"content\":\"x\"}]}", "needs a 'role'"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"images\":[\"aGk=\"]}]}", "images are not supported"},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"function\":{\"arguments\":{}}}]}]}", "a tool call needs"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"options\":{\"num_predict\":0}}", "'options.num_predict'"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"options\":5}", "'options' must be"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"think\":\"max\"}", "'think'"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"format\":\"xml\"}", "'format'"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stream\":1}", "'stream'"},
    };
    check(same_prompts(chats, sizeof chats / sizeof *chats, ollama_chat_request) &&
              same_prompts(generations, sizeof generations / sizeof *generations, ollama_generate_request),
          "ollama: chat and generate requests render the prompts of the chat requests they mean", "");
    struct serve_error e = {0};
    int loads = 0, raw = 0, load = 0;
    static const char *const bodies[] = {"{\"messages\":[]}", "{\"prompt\":\"\"}", "{\"stream\":false}", "{\"prompt\":\"p\",\"raw\":true}"};
    for (int k = 0; k < 4; k++) {
        struct json *body = serve_parse_body(bodies[k], strlen(bodies[k]), &e);
        char *out = serve_ollama_request(body, k > 0, &raw, &load, &e);
        loads += k < 3 ? load && !out : !load && raw && out && !strncmp(out, "{\"prompt\":\"p\"", 13);
        json_free(body), free(out);
    }
    check(loads == 4, "ollama: no messages, an empty prompt or none ask for a load; raw is the completion of the prompt", "%d of 4", loads);
    struct json *b = translate_by(ollama_chat_request, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"options\":{\"num_predict\":7,"
                                  "\"temperature\":0.5,\"top_k\":3,\"stop\":[\"x\"],\"num_ctx\":4096},\"format\":{\"type\":\"object\"},\"stream\":false}", &e);
    struct json *c = translate_by(ollama_chat_request, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"options\":{\"num_predict\":-1},"
                                  "\"format\":\"json\"}", &e);
    const struct json *stream = json_get(b, "stream");
    check(b && number_at(json_get(b, "max_tokens")) == 7 && number_at(json_get(b, "temperature")) == 0.5 && number_at(json_get(b, "top_k")) == 3 &&
              tok_json_is(json_get(b, "stop")->child, "x") && !json_get(b, "num_ctx") && stream && !stream->boolean &&
              tok_json_is(json_get(json_get(json_get(json_get(b, "response_format"), "json_schema"), "schema"), "type"), "object") && c &&
              !json_get(c, "max_tokens") && tok_json_is(json_get(json_get(c, "response_format"), "type"), "json_object") && json_get(c, "stream")->boolean,
          "ollama: options as the request's fields (num_predict max_tokens, -1 none), format, streamed unless false", "%s", e.message);
    json_free(b), json_free(c);
    check(all_refused(refused, sizeof refused / sizeof *refused, ollama_chat_request), "ollama: what cannot be translated is a 400 naming it", "");
}

/* A thinking, text and call answer as /api/chat's, whole and as lines fed in pieces of 5 bytes: the lines' pieces make
 * the whole answer's message, the last line done with its reason and counts. */
static void test_ollama_answer(void)
{
    static const char text[] = "Let me see.\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n"
                               "</function>\n</tool_call>";
    struct serve srv;
    struct serve_job j;
    const char *why;
    answered_job(&srv, &j, weather_tools, text);
    j.gen.n_tokens = 30, j.gen.prompt_s = 0.5, j.gen.decode_s = 1.5;
    size_t n;
    char *out = serve_ollama_json(&srv, &j, 1, &n);
    struct json *whole = json_parse(out, n, &why);
    const struct json *m = json_get(whole, "message"), *call = json_get(nth(json_get(m, "tool_calls"), 0), "function");
    check(whole && tok_json_is(json_get(m, "content"), "Checking.") && tok_json_is(json_get(m, "thinking"), "Let me see.") &&
              tok_json_is(json_get(call, "name"), "get_weather") && tok_json_is(json_get(json_get(call, "arguments"), "city"), "Bern") &&
              json_get(whole, "done")->boolean && tok_json_is(json_get(whole, "done_reason"), "stop") && number_at(json_get(whole, "prompt_eval_count")) == 6 &&
              number_at(json_get(whole, "eval_count")) == 30 && number_at(json_get(whole, "total_duration")) == 2e9 && !memchr(out, '\n', n),
          "ollama: an answer's content, thinking and tool_calls (arguments an object), done_reason, counts, durations in ns", "%.500s", out);
    struct serve_ollama_stream st = {{{0, 0}, 0}, 1};
    size_t len;
    char *lines = stream_in_pieces(&srv, &j, text, serve_ollama_events, &st, &len);
    struct tok_buf built[2] = {{0}};
    int count = 0, calls = 0, done_last = 0, parsed = 1;
    for (char *line = lines, *end; line && *line; line = end + 1, count++) {
        end = strchr(line, '\n');
        if (!end) { parsed = 0; break; }
        *end = 0;
        struct json *d = json_parse(line, strlen(line), &why);
        const struct json *msg = json_get(d, "message"), *t = json_get(msg, "thinking"), *c = json_get(msg, "content");
        parsed &= d && c && c->kind == JSON_STRING;
        if (t) tok_buf_put(&built[0], t->str, t->len);
        if (c) tok_buf_put(&built[1], c->str, c->len);
        calls += json_get(msg, "tool_calls") != NULL;
        done_last = json_get(d, "done") && json_get(d, "done")->boolean && !end[1];
        json_free(d);
    }
    check(parsed && built[0].p && !strcmp(built[0].p, "Let me see.") && built[1].p && !strcmp(built[1].p, "Checking.") && calls == 1 && done_last,
          "ollama: the stream's lines build the same thinking, content and call, the last one done", "%d lines, parsed %d, %d calls, done last %d",
          count, parsed, calls, done_last);
    free(built[0].p), free(built[1].p), free(lines), free(out);
    json_free(whole);
    answered_job_free(&j);
}

/* continue_final_message (and an Anthropic request whose last message is the assistant's: a prefill): the prompt is the
 * conversation before that message, its generation prompt with thinking off, and the message's content, open; in both
 * templates. Without an assistant's message last it is a 400. */
static void test_continue_final_message(void)
{
    static const char *const asks[] = {
        "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":\"assistant\",\"content\":\"Sure: {\\\"a\\\":\"}],\"continue_final_message\":true}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":\"assistant\",\"content\":\"Sure: {\\\"a\\\":\"}],\"continue_final_message\":true,"
        "\"chat_template_kwargs\":{\"enable_thinking\":true}}"};
    const char *before = "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"chat_template_kwargs\":{\"enable_thinking\":false}}";
    const char *prefill = "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":\"Sure: {\\\"a\\\":\"}]}]}";
    int same = 0, n = 0;
    for (enum tok_template kind = TOK_TEMPLATE_QWEN35; kind <= TOK_TEMPLATE_QWEN36; kind++) {
        struct serve_error e = {0};
        char *want = render_chat(kind, before, &e);
        struct tok_buf expect = {NULL, 0, 0};
        tok_buf_puts(&expect, want ? want : "?");
        tok_buf_puts(&expect, "Sure: {\"a\":");
        struct json *translated = translate(prefill, &e);
        struct tok_buf anthropic = {NULL, 0, 0};
        if (translated) tok_json_dump(&anthropic, translated);
        for (int k = 0; k < 3; k++, n++) {
            char *got = render_chat(kind, k < 2 ? asks[k] : anthropic.p ? anthropic.p : "", &e);
            same += got && !strcmp(got, expect.p);
            if (!(got && !strcmp(got, expect.p))) printf("# %s, case %d: %s\n#  want %s\n", tok_template_names[kind], k, got ? got : e.message, expect.p);
            free(got);
        }
        free(want), free(expect.p), free(anthropic.p);
        json_free(translated);
    }
    check(same == n, "continue_final_message: the conversation before, its generation prompt (thinking off), the message's content open",
          "%d of %d", same, n);
    struct serve_error e = {0};
    char *text = render_chat(TOK_TEMPLATE_QWEN36, "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"continue_final_message\":true}", &e);
    check(!text && e.status == 400 && !strcmp(e.param, "continue_final_message") && strstr(e.message, "assistant"),
          "continue_final_message without an assistant's message last: 400 naming it", "%s", text ? text : e.message);
    free(text);
}

/* Requests routed while the model loads (ready 0: no tokenizer, no engine yet): each endpoint
 * that needs the model answers 503 with the code "loading", /health says "loading", and none
 * touches the tokenizer (a chat request read its template through NULL: a segfault). */
/* Which browser pages may use the server: this machine's and desktop apps' by default, listed ones exactly, any with "*";
 * look-alike hosts, bad ports and the opaque origin never. */
static void test_origins(void)
{
    static const char *const granted[] = {"http://localhost", "http://localhost:5173", "https://127.0.0.1:8443", "http://[::1]:80",
                                          "HTTP://LocalHost:3000", "http://0.0.0.0:8080", "app://.", "file://", "tauri://localhost",
                                          "vscode-webview://1abc"};
    static const char *const refused[] = {"http://localhost.evil.example", "http://localhost:", "http://localhost:123456",
                                          "http://localhost:80x", "http://127.0.0.1.nip.io", "https://evil.example", "null",
                                          "ftp://localhost", "http://localhostx", "https://[::1]x"};
    int wrong = 0;
    char why[200] = "";
    for (size_t i = 0; i < sizeof granted / sizeof *granted; i++)
        if (!serve_origin_allowed(NULL, granted[i]) && !wrong++) snprintf(why, sizeof why, "%s refused", granted[i]);
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++)
        if (serve_origin_allowed(NULL, refused[i]) && !wrong++) snprintf(why, sizeof why, "%s granted", refused[i]);
    check(!wrong, "origins: this machine's pages and desktop apps' granted by default, look-alikes refused", "%s", why);
    const char *list = " https://a.example ,,https://Chat.Example.com";
    check(serve_origin_allowed(list, "https://a.example") && serve_origin_allowed(list, "https://chat.example.com") &&
              !serve_origin_allowed(list, "https://a.example.evil") && !serve_origin_allowed(list, "https://a.exampl") &&
              !serve_origin_allowed(list, "http://a.example") && !serve_origin_allowed(list, ""),
          "origins: --allow-origin's entries exactly, spaces and empty entries aside", "a listed origin refused or another granted");
    check(serve_origin_allowed("https://a.example,*", "https://evil.example"), "origins: '*' grants any", "refused");
}

static void test_loading_answers(void)
{
    static const struct { const char *method, *path, *want; } reqs[] = {
        {"POST", "/v1/chat/completions", "\"code\":\"loading\""}, {"POST", "/v1/completions", "\"code\":\"loading\""},
        {"POST", "/apply-template", "\"code\":\"loading\""}, {"POST", "/tokenize", "\"code\":\"loading\""},
        {"POST", "/detokenize", "\"code\":\"loading\""}, {"GET", "/health", "{\"status\":\"loading\"}"},
        {"POST", "/v1/messages", "{\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\""},
        {"POST", "/v1/messages/count_tokens", "{\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\""}};
    const char *body = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"prompt\":\"hi\",\"max_tokens\":4}";
    struct serve srv;
    memset(&srv, 0, sizeof srv);
    pthread_mutex_init(&srv.mu, NULL);
    pthread_cond_init(&srv.cv, NULL);
    pthread_mutex_init(&srv.stats_mu, NULL);
    srv.model_id = "m";
    srv.queue_max = 4;
    for (size_t i = 0; i < sizeof reqs / sizeof *reqs; i++) {
        int sv[2];
        char got[2048] = "", label[160];
        size_t n = 0;
        if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) { check(0, "loading: a socket pair", "%s", strerror(errno)); return; }
        struct serve_conn *c = plat_zalloc(1, sizeof *c);
        struct serve_request r;
        memset(&r, 0, sizeof r);
        c->srv = &srv;
        c->fd = sv[0];
        snprintf(r.method, sizeof r.method, "%s", reqs[i].method);
        snprintf(r.path, sizeof r.path, "%s", reqs[i].path);
        r.body = plat_strdup(body);
        r.body_len = strlen(body);
        r.content_length = (long long)r.body_len;
        serve_route(c, &r);
        close(sv[0]);
        for (ssize_t k; n + 1 < sizeof got && (k = read(sv[1], got + n, sizeof got - 1 - n)) > 0;) n += (size_t)k;
        got[n] = 0;
        close(sv[1]);
        snprintf(label, sizeof label, "while the model loads, %s %s answers 503 %s", reqs[i].method, reqs[i].path, reqs[i].want);
        check(!strncmp(got, "HTTP/1.1 503", 12) && strstr(got, reqs[i].want), label, "got '%.200s'", got);
        free(r.body);
        free(c);
    }
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
    test_one_call();
    test_answer_fields();
    test_messages_request();
    test_messages_options();
    test_messages_answer();
    test_responses_request();
    test_responses_answer();
    test_ollama_request();
    test_ollama_answer();
    test_continue_final_message();
    test_loading_answers();
    test_origins();
    char probe[1024];
    snprintf(probe, sizeof probe, "%s/q35moe-q8_0.gguf", dir);
    if (access(probe, R_OK)) {
        check(1, "batches and slots # SKIP golden data absent", "");
        return check_done();
    }
    test_batch_identity(dir, "q35moe-q8_0.gguf");
    test_batch_identity(dir, "q3next-q8_0.gguf");
    test_marks(dir);
    test_engine_slots(dir, "q35moe-q8_0.gguf");
    test_engine_logprobs(dir, "q35moe-q8_0.gguf");
    test_engine_json(dir, "q35moe-q8_0.gguf");
    test_engine_schema(dir, "q35moe-q8_0.gguf");
    test_engine_think_budget(dir, "q35moe-q8_0.gguf");
    test_prefix_reuse(dir, "q35moe-q8_0.gguf", OPS_KV_F32);
    test_checkpoint_recycling(dir, "q35moe-q8_0.gguf");
    test_prefix_reuse(dir, "q3next-q8_0.gguf", OPS_KV_F32);
    test_prefix_reuse(dir, "q35moe-q8_0.gguf", OPS_KV_F16);  /* a parked fp16 cache */
    test_prefix_reuse(dir, "q35moe-q8_0.gguf", OPS_KV_Q8_0); /* Q8_0: keys parked in whole groups */
    test_prompt_cache_file(dir, "q35moe-q8_0.gguf", OPS_KV_F32);
    test_prompt_cache_file(dir, "q3next-q8_0.gguf", OPS_KV_Q8_0);
    return check_done();
}
