/* test_model: the forward pass against the golden reference outputs (../shared/golden,
 * README §5) at the best CPU kernel level; bit-identity across levels, threads and batching;
 * refusal of bad models.
 *
 * usage: test_model [GOLDEN_DIR] [--quick]     (--quick: no identity runs; for sanitizers) */
#define COLI_NO_MAIN
#include "../coli.c"
#include "check.h"
#include "minijson.h"

#include <sys/wait.h>

#define GEN 32

/* T tokens of sequence Q through the model; the logits of the last. */
static float *forward(struct model *m, struct model_seq *q, const int *tokens, int T)
{
    struct model_run run = {q, tokens, T, NULL, 0, NULL, {0, 0, 0, 0, 0}, NULL};
    if (model_forward_runs(m, &run, 1)) die("forward: %s", m->error);
    return run.logits;
}


/* What one case produced: greedy tokens and the full logit row at every position. */
struct run {
    int tokens[GEN];
    float *logits; /* [GEN][n_vocab] */
};

static void run_case(struct model *m, const int *prompt, int n_prompt, int batched, struct run *r)
{
    int V = m->cfg.n_vocab;
    struct model_seq q;
    model_seq_init(m, &q);
    float *lg = NULL;
    if (batched)
        for (int i = 0; i < n_prompt; i += MODEL_BATCH) lg = forward(m, &q, prompt + i, n_prompt - i < MODEL_BATCH ? n_prompt - i : MODEL_BATCH);
    else
        for (int i = 0; i < n_prompt; i++) lg = forward(m, &q, prompt + i, 1);
    for (int g = 0; g < GEN; g++) {
        memcpy(r->logits + (size_t)g * V, lg, (size_t)V * sizeof(float));
        r->tokens[g] = sample_argmax(lg, V);
        if (g + 1 < GEN) lg = forward(m, &q, &r->tokens[g], 1);
    }
    model_seq_free(m, &q);
}

/* README §5: identical tokens up to a divergence allowed only on a reference near-tie;
 * every reference top-k logit within TOL up to there. Returns the first position that breaks
 * the rule (-1 when none) with *bad_diff its worst logit difference; *worst is the largest
 * difference at the positions compared. */
static int compare_case(const struct mj *c, const struct run *r, int V, double tol, double *worst, double *bad_diff)
{
    const struct mj *tokens = mj_get(c, "tokens"), *top = mj_get(c, "top");
    int d = GEN;
    for (int g = 0; g < GEN; g++)
        if ((int)mj_num(mj_at(tokens, (size_t)g), -1) != r->tokens[g]) { d = g; break; }
    *worst = 0;
    for (int g = 0; g < GEN && g <= d; g++) {
        const struct mj *tg = mj_at(top, (size_t)g);
        const float *row = r->logits + (size_t)g * V;
        double here = 0;
        for (size_t k = 0; k < mj_len(tg); k++) {
            int id = (int)mj_num(mj_at(mj_at(tg, k), 0), -1);
            here = fmax(here, fabs(row[id] - mj_num(mj_at(mj_at(tg, k), 1), 0)));
        }
        *worst = fmax(*worst, here);
        int bad = here > tol;
        if (g == d) { /* our token must be a reference near-tie: within tol of the reference's own */
            double ref_own = mj_num(mj_at(mj_at(tg, 0), 1), 0), ref_ours = -1e30;
            for (size_t k = 0; k < mj_len(tg); k++)
                if ((int)mj_num(mj_at(mj_at(tg, k), 0), -1) == r->tokens[g]) ref_ours = mj_num(mj_at(mj_at(tg, k), 1), 0);
            bad |= ref_own - ref_ours > tol;
        }
        if (bad) {
            *bad_diff = here;
            return g;
        }
    }
    return -1;
}

/* Where this engine and the reference part by more than README §5 allows, measured and
 * explained (issue 3's note): these are not tolerated silently. The case must pass the rule
 * strictly up to POSITION, and there stay within MAX_DIFF; any other outcome fails.
 *   q6_k long: an independent implementation's last-bit differences (summation order, the
 *   reference's chunked DeltaNet prefill and vectorised expf) cross Q8_K rounding boundaries
 *   during the 156-token prompt (logits off by 5e-3 from position 0, the other three cases
 *   agree to 2e-7); at position 9 an expert choice in layer 2, margin 0.0033 in probability,
 *   then goes the other way and moves the logits by 0.13.
 *   iq4_xs short: logits agree to 3.6e-7 through position 10 (the arithmetic is the same); then
 *   discrete steps, 0.0084 at 11 with no router near-tie (smallest gap below the top 8, in
 *   probability, 0.03), i.e. an activation crossing a Q8_K rounding boundary, and 0.19 at
 *   position 15 alone (back to 0.019 at 16), after a step whose router gap was 0.003.
 *   mxfp4 mixed: the 187-token prompt has a router near-tie (gap 4.8e-6 in probability): 4e-3
 *   from position 0, 0.0504 at position 2 (tolerance 0.05).
 *   q3_k_m chat: the 36-token prompt's router gap is 7.4e-5: 0.013 from position 0, 0.073 at 5,
 *   after a step with gap 0.0027.
 *   iq3_s mixed: 0.157 at position 0. The 187-token prompt has a router gap of 4.4e-4 (layer 1);
 *   scaling every IQ3_S super-block result by 1 + k * 2^-24 (a scratch build, k = -6..6) moves
 *   this case's first row between 0.0074 and 0.17, and at k = -2 the short case's whole first
 *   row matches the reference to 1.8e-7: the arithmetic and the grid are the reference's, and
 *   this prompt sits on a near-tie that last bits decide.
 * (Measured with a router-gap probe on the scalar path; scripts are not kept.) */
static const struct { const char *model, *name; int position; double max_diff; } known_deviations[] = {
    {"q35moe-q6_k.gguf", "long", 9, 0.15},
    {"q35moe-iq4_xs.gguf", "short", 15, 0.2},
    {"q35moe-mxfp4.gguf", "mixed", 2, 0.06},
    {"q35moe-q3_k_m.gguf", "chat", 5, 0.08},
    {"q35moe-iq3_s.gguf", "mixed", 0, 0.17},
};

/* Applies compare_case and the known deviations; reports one check. */
static void check_case(const char *model, const char *cname, const struct mj *c, const struct run *r, int V, double tol)
{
    char name[320];
    double worst, bad_diff = 0;
    int bad = compare_case(c, r, V, tol, &worst, &bad_diff);
    snprintf(name, sizeof name, "%s %s: golden tokens and logits (%s), max |diff| %.2g (tol %g)", model, cname, quant_level_name(), worst, tol);
    for (size_t i = 0; bad >= 0 && i < sizeof known_deviations / sizeof *known_deviations; i++)
        if (!strcmp(model, known_deviations[i].model) && !strcmp(cname, known_deviations[i].name)) {
            int as_known = bad == known_deviations[i].position && bad_diff <= known_deviations[i].max_diff;
            snprintf(name, sizeof name, "%s %s: golden rule holds before position %d, then the known deviation (%.2g <= %g)", model, cname, bad,
                     bad_diff, known_deviations[i].max_diff);
            check(as_known, name, "the deviation changed: first bad position %d, |diff| %.3g", bad, bad_diff);
            return;
        }
    check(bad < 0, name, "rule broken at position %d (|diff| %.3g)", bad, bad_diff);
}

static uint64_t hash_bytes(const void *p, size_t n, uint64_t h)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static int read_exact(const char *path, void *buf, size_t n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    size_t got = fread(buf, 1, n, f);
    fclose(f);
    return got == n;
}

/* Whether LEVEL runs OTHER's kernels for every format in F (then its runs would repeat
 * OTHER's); leaves OTHER set. */
static int same_kernels(const struct gguf_file *f, int level, int other)
{
    quant_dot_fn at_level[GGUF_TYPE_COUNT];
    quant_set_level(level);
    memcpy(at_level, quant_dot_table, sizeof at_level);
    quant_set_level(other);
    for (int64_t i = 0; i < f->n_tensors; i++)
        if (at_level[f->tensors[i].type] != quant_dot_table[f->tensors[i].type]) return 0;
    return 1;
}

static const char *const level_names[] = {"scalar", "avx2", "avx512", "avx512vbmi"};

/* Hash of a case's greedy tokens and logits. */
static uint64_t run_hash(const struct run *r, int V)
{
    return hash_bytes(r->logits, (size_t)GEN * V * sizeof(float), hash_bytes(r->tokens, sizeof r->tokens, 14695981039346656037ull));
}

/* Bit-identity with the first runs (ref_hash) of the first n_cases cases at (level, threads). */
static void check_identity(struct model *m, const struct mj *cases, int n_cases, const uint64_t *ref_hash,
                           const char *model_file, int level, int threads, struct run *r)
{
    char name[256];
    int same = 1, V = m->cfg.n_vocab;
    quant_set_level(level);
    omp_set_num_threads(threads);
    for (int ci = 0; ci < n_cases; ci++) {
        const struct mj *pt = mj_get(mj_at(cases, (size_t)ci), "prompt_tokens");
        int *prompt = plat_alloc(mj_len(pt) * sizeof *prompt);
        for (size_t i = 0; i < mj_len(pt); i++) prompt[i] = (int)mj_num(mj_at(pt, i), -1);
        run_case(m, prompt, (int)mj_len(pt), 1, r);
        same &= run_hash(r, V) == ref_hash[ci];
        free(prompt);
    }
    snprintf(name, sizeof name, "%s: %s with %d thread%s bit-identical to %s, 1 thread (%d case%s)", model_file,
             level_names[level], threads, threads > 1 ? "s" : "", level_names[quant_level_max()], n_cases, n_cases > 1 ? "s" : "");
    check(same, name, "tokens or logits differ");
}

/* The trunk copied into the model's own memory as a run has it (model_own_trunk: the formats
 * with an interleaved form interleaved), then bit-identity with the first runs at the best
 * level, 2 threads. */
static void check_owned_trunk(struct model *m, const struct mj *cases, int n_cases, const uint64_t *ref_hash, const char *model_file,
                              struct run *r)
{
    quant_set_level(quant_level_max());
    model_own_trunk(m);
    struct place_item *it = model_trunk_items(m);
    int n = 0, interleaved = 0;
    for (; it[n].m; n++) interleaved += it[n].m->interleaved;
    free(it);
    printf("# %s: the trunk's own copy, %d of %d matrices interleaved\n", model_file, interleaved, n);
    check_identity(m, cases, n_cases, ref_hash, model_file, quant_level_max(), 2, r);
}

/* Golden case file JSON_NAME in DIR (NULL, said as a failure, when unreadable); *MODEL_FILE is
 * the model it names, and PATH its path. */
static struct mj *open_cases(const char *dir, const char *json_name, char *path, size_t size, const char **model_file)
{
    snprintf(path, size, "%s/%s", dir, json_name);
    struct mj *root = mj_load(path);
    if (!root) {
        check(0, json_name, "cannot read");
        return NULL;
    }
    size_t len = 0;
    *model_file = mj_str(mj_get(root, "model"), &len);
    snprintf(path, size, "%s/%s", dir, *model_file);
    return root;
}

/* Every case of one golden model file: the reference comparison once at the best level, then
 * bit-identity against that first run: of token-by-token prefill, of 2 threads, and of every
 * lower level with kernels of its own (on 2 cases: the scalar kernels are slow, and
 * test_quant checks every kernel's bits against the scalar one). */
static void test_golden_model(const char *dir, const char *json_name, int quick)
{
    char path[1024], name[256];
    const char *model_file;
    struct mj *root = open_cases(dir, json_name, path, sizeof path, &model_file);
    if (!root) return;
    size_t len = 0;
    double tol = mj_num(mj_get(mj_get(root, "tolerance"), "logit_abs"), 0);
    const struct mj *cases = mj_get(root, "cases");
    if (check_golden_unsupported(path, model_file)) {
        mj_free(root);
        return;
    }
    struct model m;
    struct tok t;
    model_load(&m, path, 1024, 0);
    tok_load(&t, &m.file);
    int V = m.cfg.n_vocab, n_cases = (int)mj_len(cases);
    struct run r = {.logits = plat_alloc((size_t)GEN * V * sizeof(float))};
    uint64_t ref_hash[8] = {0};

    for (int ci = 0; ci < n_cases && ci < 8; ci++) {
        const struct mj *c = mj_at(cases, (size_t)ci), *pt = mj_get(c, "prompt_tokens");
        const char *cname = mj_str(mj_get(c, "name"), &len);
        const char *text = mj_str(mj_get(c, "prompt"), &len);
        int *ids = NULL, n = tok_encode(&t, text, len, 1, &ids), same = n == (int)mj_len(pt);
        for (int i = 0; same && i < n; i++) same = ids[i] == (int)mj_num(mj_at(pt, (size_t)i), -1);
        snprintf(name, sizeof name, "%s %s: prompt ids", model_file, cname);
        check(same, name, "tokenizer gives %d ids, reference %zu", n, mj_len(pt));
        int *prompt = plat_alloc(mj_len(pt) * sizeof *prompt);
        for (size_t i = 0; i < mj_len(pt); i++) prompt[i] = (int)mj_num(mj_at(pt, i), -1);

        quant_set_level(quant_level_max());
        omp_set_num_threads(1);
        run_case(&m, prompt, (int)mj_len(pt), 1, &r);
        check_case(model_file, cname, c, &r, V, tol);
        ref_hash[ci] = run_hash(&r, V);

        const char *lf = mj_str(mj_get(c, "logits_file"), &len);
        if (lf) {
            float *row = plat_alloc((size_t)V * sizeof(float));
            snprintf(path, sizeof path, "%s/%s", dir, lf);
            double worst = 0;
            int ok = read_exact(path, row, (size_t)V * sizeof(float));
            for (int i = 0; ok && i < V; i++) worst = fmax(worst, fabs(row[i] - r.logits[i]));
            snprintf(name, sizeof name, "%s %s: full first logit row within %g (max %.2g)", model_file, cname, tol, worst);
            check(ok && worst <= tol, name, "max |diff| %g", worst);
            free(row);
        }
        if (ci == 0 && !quick) {
            run_case(&m, prompt, (int)mj_len(pt), 0, &r);
            snprintf(name, sizeof name, "%s %s: token-by-token prefill bit-identical to batched", model_file, cname);
            check(run_hash(&r, V) == ref_hash[ci], name, "logits differ");
        }
        free(prompt);
        free(ids);
    }

    const int best = quant_level_max(), all = n_cases < 8 ? n_cases : 8;
    if (!quick) check_identity(&m, cases, all, ref_hash, model_file, best, 2, &r);
    for (int level = QUANT_LEVEL_SCALAR; !quick && level < best; level++) {
        if (same_kernels(&m.file, level, best)) {
            printf("ok - %s: level %s # SKIP its formats run the %s kernels there\n", model_file, level_names[level], level_names[best]);
            n_pass++;
            continue;
        }
        check_identity(&m, cases, all < 2 ? all : 2, ref_hash, model_file, level, 1, &r);
    }
    for (int level = best + 1; !quick && level < QUANT_LEVEL_COUNT; level++) {
        printf("ok - %s: level %s # SKIP not on this CPU\n", model_file, level_names[level]);
        n_pass++;
    }
    if (!quick) check_owned_trunk(&m, cases, all < 2 ? all : 2, ref_hash, model_file, &r);
    free(r.logits);
    tok_free(&t);
    model_free(&m);
    mj_free(root);
}

static void load_model(const char *path)
{
    struct model m;
    model_load(&m, path, 64, OPS_KV_F32);
}

static void load_model_kv_q8_0(const char *path)
{
    struct model m;
    model_load(&m, path, 64, OPS_KV_Q8_0);
}

/* Loads PATH in a child (by LOAD); expects exit 1 and one stderr line `coli: ...` containing WANT. */
static void expect_refusal_by(void (*load)(const char *), const char *label, const char *path, const char *want)
{
    char buf[1024];
    int status = check_child_stderr(load, path, buf, sizeof buf);
    char *nl = strchr(buf, '\n');
    int one_line = nl && nl[1] == 0 && !strncmp(buf, "coli: ", 6);
    check(WIFEXITED(status) && WEXITSTATUS(status) == 1 && one_line && strstr(buf, want), label, "status %d, stderr '%s'", status, buf);
}

static void expect_refusal(const char *label, const char *path, const char *want) { expect_refusal_by(load_model, label, path, want); }

/* A copy of golden file SRC with the first occurrence of FROM (N bytes) replaced by TO. */
static int patched_copy(const char *src, const char *dst, const void *from, const void *to, size_t n)
{
    struct plat_map map;
    if (plat_map_file(src, &map) != 0) return 0;
    uint8_t *copy = plat_alloc(map.size);
    memcpy(copy, map.data, map.size);
    plat_unmap_file(&map);
    uint8_t *hit = memmem(copy, map.size, from, n);
    int ok = hit != NULL;
    if (ok) memcpy(hit, to, n);
    FILE *f = fopen(dst, "wb");
    ok = ok && f && fwrite(copy, 1, map.size, f) == map.size;
    if (f) fclose(f);
    free(copy);
    return ok;
}

static void test_bad_models(const char *dir)
{
    char src[1024], dst[] = "/tmp/coli_test_model_XXXXXX";
    int fd = mkstemp(dst);
    if (fd < 0) { check(0, "bad models", "mkstemp"); return; }
    close(fd);
    snprintf(src, sizeof src, "%s/q35moe-f32.gguf", dir);
    /* the architecture value: u64 length 9, then the name (keys carry other lengths) */
    int ok = patched_copy(src, dst, "\x09\0\0\0\0\0\0\0qwen35moe", "\x09\0\0\0\0\0\0\0qwen35mox", 17);
    if (ok) expect_refusal("unknown architecture refused", dst, "unsupported architecture 'qwen35mox'");
    ok = patched_copy(src, dst, "blk.0.ssm_a", "blk.0.ssm_b", 11);
    if (ok) expect_refusal("missing tensor refused", dst, "missing tensor 'blk.0.ssm_a'");
    /* attn_qkv of layer 0 is [128][64] (GGUF ne {64, 128}); swap to {128, 64} */
    uint8_t from[22 + 4 + 16], to[sizeof from];
    uint64_t ne_from[2] = {64, 128}, ne_to[2] = {128, 64};
    uint32_t dims = 2;
    memcpy(from, "blk.0.attn_qkv.weight", 21);
    memcpy(from + 21, &dims, 4);
    memcpy(from + 25, ne_from, 16);
    memcpy(to, from, 25);
    memcpy(to + 25, ne_to, 16);
    ok = patched_copy(src, dst, from, to, 41);
    if (ok) expect_refusal("wrong shape refused", dst, "tensor 'blk.0.attn_qkv.weight' has shape [64][128], expected [128][64]");
    /* heads of 48 (attention.key_length and value_length, u32s, 32 -> 48): not whole Q8_0 blocks */
    ok = ok && patched_copy(src, dst, "attention.key_length\x04\0\0\0\x20", "attention.key_length\x04\0\0\0\x30", 25) &&
         patched_copy(dst, dst, "attention.value_length\x04\0\0\0\x20", "attention.value_length\x04\0\0\0\x30", 27);
    if (ok) expect_refusal_by(load_model_kv_q8_0, "--kv q8_0 refused for heads of 48", dst, "--kv q8_0: this model's attention heads have 48 dimensions");
    check(ok, "bad-model fixtures built", "patching %s failed", src);
    unlink(dst);
}

/* Chat's rewind (model_checkpoint): after a prefix, save; feed more tokens; restore; feed
 * them again: the same logits, bit for bit, as the first time. */
static void test_checkpoint(const char *dir, const char *name)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    struct model m;
    struct model_checkpoint cp = {0, NULL};
    const int prefix[5] = {11, 22, 33, 44, 55}, more[4] = {66, 77, 88, 99};
    model_load(&m, path, 64, 0);
    struct model_seq q;
    model_seq_init(&m, &q);
    int V = m.cfg.n_vocab;
    float *first = plat_alloc((size_t)V * sizeof *first);
    forward(&m, &q, prefix, 5);
    model_checkpoint(&m, &q, &cp, 1);
    memcpy(first, forward(&m, &q, more, 4), (size_t)V * sizeof *first);
    forward(&m, &q, more, 2);
    model_checkpoint(&m, &q, &cp, 0);
    int same = q.pos == 5 && !memcmp(first, forward(&m, &q, more, 4), (size_t)V * sizeof *first);
    char label[300];
    snprintf(label, sizeof label, "%s: rewound to a checkpoint, the same tokens give the same logits", name);
    check(same, label, "rewound logits differ (pos %d)", q.pos);
    free(first);
    free(cp.recurrent);
    model_seq_free(&m, &q);
    model_free(&m);
}

/* --kv KV (f16 or q8_0) on the model of golden case file JSON_NAME, its first two cases: every
 * logit within TOL of the f32 cache's while the greedy tokens agree (observed: f16 2.7e-3 and
 * 2.9e-3, q8_0 1.5e-2 and 4.1e-3), a token that differs only where the f32 cache's logits of the
 * two were within 2 TOL (q3next-q8_0's first case, its 8th token, under q8_0: a margin of 1.4e-4), BYTES_NUM /
 * BYTES_DEN of the f32 cache's bytes a token; and its own
 * bits at the lower levels, on 2 threads and token by token (the value rows come in chunks of
 * OPS_ATTN_CHUNK and Q8_0 keys in groups of OPS_KV_GROUP, which the cases' contexts cross). */
static void test_kv_format(const char *dir, const char *json_name, enum ops_kv kv, double tol, int bytes_num, int bytes_den, int quick)
{
    char path[1024], name[300];
    const char *model_file, *kv_name = kv == OPS_KV_F16 ? "f16" : "q8_0";
    struct mj *root = open_cases(dir, json_name, path, sizeof path, &model_file);
    if (!root) return;
    const struct mj *cases = mj_get(root, "cases");
    struct model m32, mk;
    model_load(&m32, path, 256, OPS_KV_F32);
    model_load(&mk, path, 256, kv);
    const int V = mk.cfg.n_vocab, n_cases = mj_len(cases) < 2 ? (int)mj_len(cases) : 2;
    struct run r32 = {.logits = plat_alloc((size_t)GEN * V * sizeof(float))}, rk = {.logits = plat_alloc((size_t)GEN * V * sizeof(float))};
    uint64_t ref_hash[2] = {0};
    double worst = 0, worst_tie = 0;
    quant_set_level(quant_level_max());
    omp_set_num_threads(1);
    for (int ci = 0; ci < n_cases; ci++) {
        const struct mj *pt = mj_get(mj_at(cases, (size_t)ci), "prompt_tokens");
        int *prompt = plat_alloc(mj_len(pt) * sizeof *prompt);
        for (size_t i = 0; i < mj_len(pt); i++) prompt[i] = (int)mj_num(mj_at(pt, i), -1);
        run_case(&m32, prompt, (int)mj_len(pt), 1, &r32);
        run_case(&mk, prompt, (int)mj_len(pt), 1, &rk);
        int agree = 0; /* steps read on the same context: up to the first token that differs */
        while (agree < GEN && r32.tokens[agree] == rk.tokens[agree]) agree++;
        for (size_t i = 0; i < (size_t)(agree < GEN ? agree + 1 : GEN) * V; i++) worst = fmax(worst, fabs(r32.logits[i] - rk.logits[i]));
        if (agree < GEN) { /* only a near-tie of the f32 cache's logits may go the other way */
            const float *l = r32.logits + (size_t)agree * V;
            worst_tie = fmax(worst_tie, l[r32.tokens[agree]] - l[rk.tokens[agree]]);
        }
        ref_hash[ci] = run_hash(&rk, V);
        if (ci == 0 && !quick) {
            run_case(&mk, prompt, (int)mj_len(pt), 0, &rk);
            snprintf(name, sizeof name, "%s --kv %s: token-by-token prefill bit-identical to batched", model_file, kv_name);
            check(run_hash(&rk, V) == ref_hash[0], name, "logits differ");
        }
        free(prompt);
    }
    snprintf(name, sizeof name, "%s --kv %s: logits within %g of the f32 cache's (max %.2g), the same greedy tokens but at a tie within %g",
             model_file, kv_name, tol, worst, 2 * tol);
    check(worst <= tol && worst_tie <= 2 * tol, name, "max |diff| %g, a token differs where the f32 cache's margin was %g", worst, worst_tie);
    snprintf(name, sizeof name, "%s --kv %s: %d/%d of the f32 cache's bytes a token", model_file, kv_name, bytes_num, bytes_den);
    check(bytes_den * model_kv_bytes_per_token(&mk) == bytes_num * model_kv_bytes_per_token(&m32), name, "%lld against %lld",
          (long long)model_kv_bytes_per_token(&mk), (long long)model_kv_bytes_per_token(&m32));
    snprintf(name, sizeof name, "%s --kv %s", model_file, kv_name);
    if (!quick) {
        check_identity(&mk, cases, n_cases, ref_hash, name, quant_level_max(), 2, &rk);
        check_identity(&mk, cases, n_cases, ref_hash, name, QUANT_LEVEL_SCALAR, 1, &rk);
        if (quant_level_max() > QUANT_LEVEL_AVX2) check_identity(&mk, cases, n_cases, ref_hash, name, QUANT_LEVEL_AVX2, 1, &rk);
    }
    free(r32.logits);
    free(rk.logits);
    model_free(&m32);
    model_free(&mk);
    mj_free(root);
}

/* Attention past one split (OPS_ATTN_SPLIT rows) on the model of golden case file JSON_NAME
 * (2 head groups): a prompt of its first case's tokens repeated to 700, in batches (the second
 * and third over 2 and 3 splits), then 32 greedy tokens, in each KV format: on 1 thread (a
 * group's splits one after the other), on 2 (a task a group) and on 3 (more threads than
 * groups: model_attention_spread, a split a task); the same bits each time. (That splits give
 * one softmax over all the rows is test_quant's check, and every level the same bits too.) */
static void test_long_context(const char *dir, const char *json_name)
{
    char path[1024], name[300];
    const char *model_file;
    struct mj *root = open_cases(dir, json_name, path, sizeof path, &model_file);
    if (!root) return;
    const struct mj *pt = mj_get(mj_at(mj_get(root, "cases"), 0), "prompt_tokens");
    enum { N = 700 };
    int *prompt = plat_alloc(N * sizeof *prompt);
    for (int i = 0; i < N; i++) prompt[i] = (int)mj_num(mj_at(pt, (size_t)i % mj_len(pt)), -1);
    static const int threads[] = {2, 3};
    for (int kv = OPS_KV_F32; kv <= OPS_KV_Q8_0; kv++) {
        struct model m;
        model_load(&m, path, N + GEN, (enum ops_kv)kv);
        const int V = m.cfg.n_vocab;
        struct run r = {.logits = plat_alloc((size_t)GEN * V * sizeof(float))};
        quant_set_level(quant_level_max());
        omp_set_num_threads(1);
        run_case(&m, prompt, N, 1, &r);
        const uint64_t ref = run_hash(&r, V);
        int same = 1;
        for (size_t i = 0; i < sizeof threads / sizeof *threads; i++) {
            omp_set_num_threads(threads[i]);
            run_case(&m, prompt, N, 1, &r);
            same &= run_hash(&r, V) == ref;
        }
        snprintf(name, sizeof name, "%s, KV %s: a context of %d-%d rows (3 splits) bit-identical on 1, 2 and 3 threads",
                 model_file, kv == OPS_KV_F32 ? "f32" : kv == OPS_KV_F16 ? "f16" : "q8_0", N, N + GEN);
        check(same, name, "tokens or logits differ");
        free(r.logits);
        model_free(&m);
    }
    omp_set_num_threads(1);
    quant_set_level(quant_level_max());
    free(prompt);
    mj_free(root);
}

/* Golden files the quick (sanitizer) run leaves to test_quant and two files of the same kind,
 * to keep the suite within its time. */
static int sanitizer_covered_elsewhere(const char *json_name)
{
    static const char *const skip[] = {"q35moe-q3_k.json", "q35moe-q3_k_m.json", "q35moe-iq4_xs.json",
                                       "q35moe-iq4_nl.json", "q35moe-iq3_xxs.json", "q35moe-iq3_s.json"};
    for (size_t i = 0; i < sizeof skip / sizeof *skip; i++)
        if (!strcmp(json_name, skip[i])) return 1;
    return 0;
}

/* The shipped binary is built against musl, these tests against glibc: the same forward pass
 * must give the same bits under both libcs (coli's own exp, ln and sin/cos, §4). `./coli run
 * --json` on the first case of JSON_NAME against run_case here: the same prompt ids, greedy
 * tokens and top-5 logits (printed with 9 digits, so each float round-trips), up to where the
 * run stops. */
static void test_binary_same_bits(const char *dir, const char *json_name)
{
    char path[1024], cmd[2048], name[256];
    const char *model_file;
    if (access("./coli", X_OK)) {
        printf("ok - %s: ./coli gives the same bits # SKIP no ./coli built here\n", json_name);
        n_pass++;
        return;
    }
    struct mj *root = open_cases(dir, json_name, path, sizeof path, &model_file);
    if (!root) return;
    size_t len = 0;
    const struct mj *c = mj_at(mj_get(root, "cases"), 0), *pt = mj_get(c, "prompt_tokens");
    const char *text = mj_str(mj_get(c, "prompt"), &len);
    snprintf(cmd, sizeof cmd, "./coli run -m '%s' -p '%s' -n %d --json -t 2 2>/dev/null", path, text, GEN);
    FILE *f = popen(cmd, "r");
    char *out = plat_alloc(1 << 20);
    size_t n = f ? fread(out, 1, (1 << 20) - 1, f) : 0;
    if (f) pclose(f);
    struct mj *got = mj_parse(out, n, NULL, NULL);
    struct model m;
    model_load(&m, path, 1024, 0);
    const int V = m.cfg.n_vocab, n_prompt = (int)mj_len(pt);
    struct run r = {.logits = plat_alloc((size_t)GEN * V * sizeof(float))};
    int *prompt = plat_alloc((size_t)n_prompt * sizeof *prompt), bad = 0;
    for (int i = 0; i < n_prompt; i++) prompt[i] = (int)mj_num(mj_at(pt, (size_t)i), -1);
    quant_set_level(quant_level_max());
    run_case(&m, prompt, n_prompt, 1, &r);
    const struct mj *ids = mj_get(got, "prompt_tokens"), *toks = mj_get(got, "tokens"), *top = mj_get(got, "top");
    const int n_gen = (int)mj_len(toks); /* fewer than GEN where an end-of-generation token stops the run */
    bad |= !got || mj_len(ids) != (size_t)n_prompt || n_gen < 1 || n_gen > GEN || mj_len(top) != (size_t)n_gen;
    for (int i = 0; !bad && i < n_prompt; i++) bad |= (int)mj_num(mj_at(ids, (size_t)i), -1) != prompt[i];
    for (int g = 0; !bad && g < n_gen; g++) {
        bad |= (int)mj_num(mj_at(toks, (size_t)g), -1) != r.tokens[g];
        for (size_t k = 0; k < mj_len(mj_at(top, (size_t)g)); k++) {
            const struct mj *pair = mj_at(mj_at(top, (size_t)g), k);
            const int id = (int)mj_num(mj_at(pair, 0), -1);
            bad |= id < 0 || id >= V || (float)mj_num(mj_at(pair, 1), 0) != r.logits[(size_t)g * V + (id < 0 || id >= V ? 0 : id)];
        }
    }
    snprintf(name, sizeof name, "%s: ./coli (musl) gives this build's (glibc) prompt ids, tokens and top logits bit for bit", model_file);
    check(!bad, name, "%s", got ? "they differ" : "no JSON from ./coli run");
    free(prompt); free(r.logits); free(out);
    mj_free(got);
    model_free(&m);
    mj_free(root);
}

int main(int argc, char **argv)
{
    const char *dir;
    int quick;
    char *names[64];
    check_args(argc, argv, &dir, &quick);
    plat_cpu_detect();
    quant_init();
    int n = check_golden_cases(dir, names, 64);
    if (n < 0) {
        check(1, "golden models # SKIP golden data absent", "");
        return check_done();
    }
    for (int i = 0; i < n; i++) {
        if (quick && sanitizer_covered_elsewhere(names[i])) {
            printf("ok - %s # SKIP in the quick run: test_quant runs its format's kernels under the sanitizers, "
                   "q35moe-q2_k and -mxfp4 its model path\n", names[i]);
            n_pass++;
        } else {
            test_golden_model(dir, names[i], quick);
        }
        free(names[i]);
    }
    test_checkpoint(dir, "q35moe-q8_0.gguf");
    test_checkpoint(dir, "q3next-q8_0.gguf");
    if (!quick) test_long_context(dir, "q35moe-q8_0.json");
    test_kv_format(dir, "q35moe-q8_0.json", OPS_KV_F16, 1e-2, 1, 2, quick);
    test_kv_format(dir, "q3next-q8_0.json", OPS_KV_F16, 1e-2, 1, 2, quick);
    test_kv_format(dir, "q35moe-q8_0.json", OPS_KV_Q8_0, 5e-2, 17, 64, quick);
    test_kv_format(dir, "q3next-q8_0.json", OPS_KV_Q8_0, 5e-2, 17, 64, quick);
    if (!quick) {
        test_binary_same_bits(dir, "q35moe-f32.json");
        test_binary_same_bits(dir, "q3next-f32.json");
        test_binary_same_bits(dir, "q35moe-q8_0.json");
    }
    test_bad_models(dir);
    return check_done();
}
