/* test_sample: §10 sampling on hand-made logit rows whose answers are known.
 * usage: test_sample [ignored...] */
#define COLI_NO_MAIN
#include "../coli.c"
#include "check.h"
#include "minijson.h"

#define V 1000

static struct sample_candidate cand[V];

/* Draws N tokens from a fresh copy of LOGITS each time; counts how often each id comes up. */
static void draw(const struct sample_params *p, const float *logits, int n, int *count)
{
    uint64_t rng = p->seed;
    float row[V];
    memset(count, 0, V * sizeof *count);
    for (int i = 0; i < n; i++) {
        memcpy(row, logits, sizeof row);
        count[sample_next(p, row, V, NULL, 0, &rng, cand)]++;
    }
}

/* The vector argmax and finiteness check at each level the CPU has (AVX2, AVX-512) against
 * their plain loops, on rows that end inside and past the vectors: a random row with its best
 * in a random place (a tie placed after it), all equal, all -inf, NaN at 0 and elsewhere, and
 * infinities and NaN at every place of short rows. */
static void test_vector_scans(void)
{
    static const int lengths[] = { 1, 7, 8, 9, 15, 16, 17, 47, 1000, 248320 };
    enum { N = 248320 };
    float *row = malloc(N * sizeof *row);
    uint64_t rng = 99;
    const int has_avx2 = plat_cpu.avx2, has_avx512 = plat_cpu.avx512f;
    int bad_max = 0, bad_finite = 0;
    char levels[32] = "";
    for (int level = 1; level <= 2; level++) {
        if (!(level == 1 ? has_avx2 : has_avx512)) continue;
        strcat(levels, level == 1 ? " AVX2" : " AVX-512");
        for (size_t c = 0; c < sizeof lengths / sizeof *lengths; c++)
            for (int kind = 0; kind < 6; kind++) {
                const int n = lengths[c];
                for (int i = 0; i < n; i++) row[i] = (float)(sample_next_u64(&rng) >> 40) / 1048576.0f;
                const int at = (int)(sample_next_u64(&rng) % (uint64_t)n);
                if (kind == 0) { row[at] = 100.0f; row[(at + 1) % n] = 100.0f; }
                for (int i = 0; kind == 1 && i < n; i++) row[i] = 2.0f;
                for (int i = 0; kind == 2 && i < n; i++) row[i] = -INFINITY;
                if (kind == 3) row[0] = NAN;
                if (kind == 4) row[at] = NAN;
                if (kind == 5) row[at] = -INFINITY;
                plat_cpu.avx2 = plat_cpu.avx512f = 0;
                const int want = sample_argmax(row, n), want_finite = sample_all_finite(row, n);
                plat_cpu.avx2 = 1;
                plat_cpu.avx512f = level == 2;
                bad_max += sample_argmax(row, n) != want;
                bad_finite += sample_all_finite(row, n) != want_finite;
            }
        for (int n = 1; n <= 40; n++)
            for (int at = 0; at < n; at++)
                for (int v = 0; v < 3; v++) {
                    for (int i = 0; i < n; i++) row[i] = 1.0f;
                    row[at] = v == 0 ? INFINITY : v == 1 ? -INFINITY : NAN;
                    bad_finite += sample_all_finite(row, n) != 0;
                }
    }
    plat_cpu.avx2 = has_avx2;
    plat_cpu.avx512f = has_avx512;
    char name[160];
    snprintf(name, sizeof name, "argmax and the finiteness check at%s: the plain loops' answers", *levels ? levels : " no SIMD level (none here)");
    check(!bad_max && !bad_finite, name, "%d argmax and %d finiteness answers differ", bad_max, bad_finite);
    free(row);
}

/* The draw's weights: ops_exp_shifted at every level the CPU has against the scalar
 * ops_exp((x - max) / t), bit for bit, on rows ending inside and past the vectors (weights that
 * underflow to 0 and a -inf logit among them); and seeded temperature draws over the whole row
 * (no top-k: the vector path) give the same tokens at every level. */
static void test_draw_weights(const float *logits)
{
    enum { N = 203 };
    static const int lengths[] = {1, 7, 8, 9, 15, 16, 17, 31, 33, N};
    static const float temps[] = {0.25f, 0.7f, 1.0f, 1.3f};
    float x[N], want[N], got[N];
    for (int i = 0; i < N; i++) x[i] = (float)((i * 7919) % 4001 - 3000) / 97.0f;
    x[5] = -INFINITY;
    int bad = 0, bad_draws = 0, ref[V], count[V];
    struct sample_params plain = {0.8f, 0, 1.0f, 0.0f, 1.0f, 64, 11, 0.0f, 0.0f};
    for (int level = 0; level <= quant_level_max(); level++) {
        quant_set_level(level);
        for (size_t l = 0; l < sizeof lengths / sizeof lengths[0]; l++)
            for (size_t t = 0; t < sizeof temps / sizeof temps[0]; t++) {
                const int n = lengths[l];
                for (int i = 0; i < n; i++) want[i] = ops_exp((x[i] - 10.5f) / temps[t]);
                ops_exp_shifted(got, x, n, 10.5f, temps[t]);
                bad += memcmp(got, want, (size_t)n * sizeof *got) != 0;
            }
        draw(&plain, logits, 300, level ? count : ref);
        bad_draws += level && memcmp(count, ref, sizeof ref) != 0;
    }
    char name[160];
    snprintf(name, sizeof name, "the draw's weights at %d SIMD levels: ops_exp's bits, the same seeded draws", quant_level_max() + 1);
    check(!bad && !bad_draws, name, "%d weight rows and %d levels' draws differ", bad, bad_draws);
    quant_set_level(0);
}

/* sample_top against a sort of every candidate (sample_by_logit_desc), on rows with many ties,
 * one rising row (its fallback) and K from 1 to the whole row. */
static void test_top(void)
{
    enum { N = 5000 };
    static float w[N];
    static struct sample_candidate got[N], all[N];
    static const int ks[] = {1, 2, 20, 64, 256, 257, 1024, N};
    uint64_t rng = 5;
    int bad = 0;
    for (int row = 0; row < 3; row++) {
        for (int i = 0; i < N; i++)
            w[i] = row == 2 ? (float)i : (float)(sample_next_u64(&rng) % (row ? 40 : 100000)); /* row 1: ties */
        for (int i = 0; i < N; i++) all[i] = (struct sample_candidate){i, w[i]};
        qsort(all, N, sizeof *all, sample_by_logit_desc);
        for (size_t k = 0; k < sizeof ks / sizeof ks[0]; k++) {
            sample_top(w, N, ks[k], got);
            bad += memcmp(got, all, (size_t)ks[k] * sizeof *got) != 0;
        }
    }
    check(!bad, "top-k selection: the K first of a full sort (ties to the lower id), also for a rising row", "%d selections differ", bad);
}

/* A draw over the whole row of V weights C (in id order) by the documented slices: V < 32 x 256,
 * so each is 32 tokens, summed in order, the sums in order the total; the draw passes whole
 * slices while it reaches their sum, then the slice's tokens, the first its rest falls short of
 * (the last of weight above 0 where it passes them all). */
static int reference_slices(const struct sample_candidate *c, uint64_t *rng)
{
    double sums[256] = {0}, total = 0.0;
    for (int i = 0; i < V; i++) sums[i / 32] += c[i].logit;
    for (int s = 0; s < 256; s++) total += sums[s];
    double r = (double)(sample_next_u64(rng) >> 11) * (1.0 / 9007199254740992.0) * total;
    int s = 0, last = 0, positive = -1;
    while (s < 256 && r >= sums[s]) {
        if (sums[s] > 0) last = s;
        r -= sums[s++];
    }
    if (s == 256) s = last, r = INFINITY;
    for (int i = 32 * s; i < V && i < 32 * s + 32; i++) {
        if (c[i].logit > 0) positive = i;
        if (r < c[i].logit) return i;
        r -= c[i].logit;
    }
    return positive;
}

/* The documented draw, rendered plainly: every candidate sorted (sample_by_logit_desc), the
 * top-k kept, weights ops_exp((logit - max) / temp), the nucleus cut, a draw over the kept ones
 * best first; with neither top-k nor a nucleus, over every token by reference_slices. */
static int reference_next(const struct sample_params *p, const float *logits, uint64_t *rng)
{
    static struct sample_candidate c[V];
    float max = logits[0];
    for (int i = 0; i < V; i++) max = logits[i] > max ? logits[i] : max;
    const int nucleus = p->top_p < 1.0f || p->min_p > 0.0f, sorted = nucleus || (p->top_k > 0 && p->top_k < V);
    for (int i = 0; i < V; i++) c[i] = (struct sample_candidate){i, logits[i]};
    if (sorted) qsort(c, V, sizeof *c, sample_by_logit_desc);
    int n = p->top_k > 0 && p->top_k < V ? p->top_k : V;
    double total = 0.0;
    for (int i = 0; i < n; i++) total += c[i].logit = ops_exp((c[i].logit - max) / p->temp);
    if (!sorted) return reference_slices(c, rng);
    if (nucleus) {
        double mass = 0.0, kept = 0.0;
        int keep = 0;
        while (keep < n && !(c[keep].logit < p->min_p * c[0].logit) && !(mass >= p->top_p * total)) mass += c[keep++].logit;
        n = keep;
        for (int i = 0; i < n; i++) kept += c[i].logit;
        total = kept;
    }
    double r = (double)(sample_next_u64(rng) >> 11) * (1.0 / 9007199254740992.0) * total;
    for (int i = 0; i < n; i++)
        if ((r -= c[i].logit) < 0) return c[i].id;
    return c[n - 1].id;
}

/* sample_next against reference_next: 200 seeded draws for each of six settings, on a row of
 * logits in [-15, 5) on a grid of 0.01 (ties among them). */
static void test_against_reference(void)
{
    float logits[V];
    uint64_t r = 9;
    for (int i = 0; i < V; i++) logits[i] = (float)(sample_next_u64(&r) % 2000) / 100.0f - 15.0f;
    static const struct sample_params settings[] = {
        {0.6f, 20, 0.95f, 0.0f, 1.0f, 64, 1, 0.0f, 0.0f}, {1.0f, 0, 1.0f, 0.0f, 1.0f, 64, 2, 0.0f, 0.0f},
        {0.7f, 0, 0.9f, 0.0f, 1.0f, 64, 3, 0.0f, 0.0f},   {1.3f, 5, 1.0f, 0.0f, 1.0f, 64, 4, 0.0f, 0.0f},
        {0.9f, 0, 1.0f, 0.05f, 1.0f, 64, 5, 0.0f, 0.0f},  {2.0f, 300, 0.99f, 0.0f, 1.0f, 64, 6, 0.0f, 0.0f},
    };
    int bad = 0;
    float row[V];
    for (size_t s = 0; s < sizeof settings / sizeof settings[0]; s++) {
        uint64_t a = settings[s].seed, b = settings[s].seed;
        for (int d = 0; d < 200; d++) {
            memcpy(row, logits, sizeof row);
            bad += sample_next(&settings[s], row, V, NULL, 0, &a, cand) != reference_next(&settings[s], logits, &b);
        }
    }
    check(!bad, "temperature draws: the documented procedure's tokens, top-k, top-p and min-p", "%d of 1200 tokens differ", bad);
}

/* Where DOC stops being the start of a JSON object in JSON mode (its byte count if never), and whether the object was
 * whole exactly at its last byte (never before). */
static int json_reject_at(const char *doc, size_t n, int *whole)
{
    struct sample_json s = {0};
    *whole = 0;
    for (size_t i = 0; i < n; i++) {
        if (s.state == SJ_DONE || !sample_json_step(&s, (unsigned char)doc[i])) return (int)i;
        *whole = s.state == SJ_DONE && i + 1 == n;
    }
    return (int)n;
}

/* Random nested JSON of depth at most D into B (valid by construction: RFC 8259's grammar). */
static void json_random(char *b, size_t *n, int d, uint64_t *r)
{
    static const char *const atoms[] = {"0", "-12", "3.25", "1e9", "-0.5E-3", "true", "false", "null", "\"\"", "\"a\\n\\u00e9\\\"\"",
                                        "\"\xc3\xa9\xe6\x97\xa5\xf0\x9f\x98\x80\""};
    const int kind = d > 0 ? (int)(sample_next_u64(r) % 3) : 2, items = (int)(sample_next_u64(r) % 4);
    if (kind == 2) {
        const char *a = atoms[sample_next_u64(r) % (sizeof atoms / sizeof *atoms)];
        memcpy(b + *n, a, strlen(a)), *n += strlen(a);
        return;
    }
    b[(*n)++] = kind ? '{' : '[';
    for (int i = 0; i < items; i++) {
        if (i) b[(*n)++] = ',';
        if (sample_next_u64(r) % 2) b[(*n)++] = '\n', b[(*n)++] = ' ';
        if (kind) *n += (size_t)sprintf(b + *n, "\"k%d\" : ", i);
        json_random(b, n, d - 1, r);
    }
    b[(*n)++] = kind ? '}' : ']';
}

/* JSON mode's automaton: RFC 8259 objects whole at their last byte; a broken one refused at the byte that breaks it. */
static void test_json_mode(void)
{
    static const char *const valid[] = {
        "{}", " \n{\"a\":1}", "{ \"k\" : [ 1 , 2 ] }", "{\"\xc3\xa9\":\"\xe6\x97\xa5\"}",
        "{\"a\":[1,-2.5e+3,0,0.0,1E9,true,false,null,\"x\\n\\u00e9\\\"\\/\",{},[]],\"b\":{\"c\":[[]]}}",
    };
    /* the text, and the byte (counted from 0) where it stops being an object's start */
    static const struct { const char *doc; int at; } broken[] = {
        {"[1]", 0}, {"\"a\"", 0}, {"x{}", 0}, {"{\"a\":01}", 6}, {"{\"a\":1,}", 7}, {"{\"a\" 1}", 5}, {"{\"a\":tru}", 8},
        {"{\"a\":\"\x01\"}", 6}, {"{\"a\":\"\\q\"}", 7}, {"{\"a\":\"\\u12G4\"}", 10}, {"{\"a\":[1,]}", 8},
        {"{\"a\":1}}", 7}, {"{\"a\":-}", 6}, {"{\"a\":1.}", 7}, {"{\"a\":1e}", 7}, {"{'a':1}", 1},
        {"{\"a\":\"\xff\"}", 6}, {"{\"a\":\"\xc3(\"}", 7}, {"{\"a\":.5}", 5}, {"{\"a\":+1}", 5}, {"{1:2}", 1},
        {"{\"a\"::1}", 5}, {"{\"a\":[}", 6}, {"{,}", 1}, {"{\"a\":nul}", 8}, {"{} ", 2},
    };
    int whole;
    for (size_t k = 0; k < sizeof valid / sizeof *valid; k++) {
        size_t n = strlen(valid[k]);
        int at = json_reject_at(valid[k], n, &whole);
        check(at == (int)n && whole, "JSON mode: a valid object is taken, whole at its last byte", "'%s': refused at %d, whole %d", valid[k], at, whole);
    }
    for (size_t k = 0; k < sizeof broken / sizeof *broken; k++) {
        int at = json_reject_at(broken[k].doc, strlen(broken[k].doc), &whole);
        check(at == broken[k].at, "JSON mode: a broken object is refused where it breaks", "'%s': at %d, want %d", broken[k].doc, at, broken[k].at);
    }
    static const struct { const char *doc; int at; } digits[] = {
        {"{\"a\":1234567890123456,\"b\":-1.1234567890123456e1234567890123456}", -1}, {"{\"a\":12345678901234567}", 21},
        {"{\"a\":0.12345678901234567}", 23}, {"{\"a\":1E+12345678901234567}", 24},
    };
    for (size_t k = 0; k < sizeof digits / sizeof *digits; k++) {
        const int n = (int)strlen(digits[k].doc), at = json_reject_at(digits[k].doc, (size_t)n, &whole);
        check(at == (digits[k].at < 0 ? n : digits[k].at), "JSON mode: 16 digits in a number's part at most", "'%s': at %d", digits[k].doc, at);
    }
    char deep[200], spaces[64];
    memset(deep, '[', sizeof deep);
    memcpy(deep, "{\"a\":", 5);
    memset(spaces, ' ', sizeof spaces);
    spaces[0] = '{';
    check(json_reject_at(deep, sizeof deep, &whole) == 5 + SAMPLE_JSON_DEPTH - 1, "JSON mode: 64 containers open at most", "at %d", json_reject_at(deep, sizeof deep, &whole));
    check(json_reject_at(spaces, sizeof spaces, &whole) == 1 + SAMPLE_JSON_SPACES, "JSON mode: 32 whitespace bytes in a row at most", "at %d",
          json_reject_at(spaces, sizeof spaces, &whole));
    uint64_t r = 5;
    int taken = 0;
    for (int k = 0; k < 500; k++) {
        char b[1 << 16];
        size_t n = 0;
        b[n++] = '{';
        n += (size_t)sprintf(b + n, "\"x\":");
        json_random(b, &n, 5, &r);
        b[n++] = '}';
        taken += json_reject_at(b, n, &whole) == (int)n && whole;
    }
    check(taken == 500, "JSON mode: 500 random nested objects taken whole", "%d", taken);
}

/* ---- JSON schema: the test's own validator and generator (JSON Schema's meaning, read with minijson) ---- */

static const struct mj *schema_ref(const struct mj *root, const struct mj *ref)
{
    const char *r = mj_str(ref, NULL);
    if (!strcmp(r, "#")) return root;
    if (!strncmp(r, "#/$defs/", 8)) return mj_get(mj_get(root, "$defs"), r + 8);
    return mj_get(mj_get(root, "definitions"), r + 14);
}

static int mj_same(const struct mj *a, const struct mj *b)
{
    return a->type == b->type && (a->type != MJ_STR || (a->len == b->len && !memcmp(a->str, b->str, a->len))) &&
           ((a->type != MJ_NUM && a->type != MJ_BOOL) || a->num == b->num);
}

static int schema_type_is(const char *t, const struct mj *v)
{
    return (!strcmp(t, "object") && v->type == MJ_OBJ) || (!strcmp(t, "array") && v->type == MJ_ARR) || (!strcmp(t, "string") && v->type == MJ_STR) ||
           (!strcmp(t, "number") && v->type == MJ_NUM) || (!strcmp(t, "integer") && v->type == MJ_NUM && v->num == floor(v->num)) ||
           (!strcmp(t, "boolean") && v->type == MJ_BOOL) || (!strcmp(t, "null") && v->type == MJ_NULL);
}

/* Whether V is valid under schema SC (of ROOT), by JSON Schema's rules for the keywords coli follows. */
static int schema_valid(const struct mj *root, const struct mj *sc, const struct mj *v)
{
    if (sc->type == MJ_BOOL) return sc->num != 0;
    const struct mj *ref = mj_get(sc, "$ref"), *any = mj_get(sc, "anyOf"), *one = mj_get(sc, "oneOf"), *type = mj_get(sc, "type");
    const struct mj *list = mj_get(sc, "enum"), *cnst = mj_get(sc, "const"), *props = mj_get(sc, "properties"), *req = mj_get(sc, "required");
    const struct mj *extra = mj_get(sc, "additionalProperties"), *items = mj_get(sc, "items");
    if (ref) return schema_valid(root, schema_ref(root, ref), v);
    if (any || one) {
        size_t valid = 0;
        for (size_t i = 0; i < mj_len(any ? any : one); i++) valid += schema_valid(root, mj_at(any ? any : one, i), v);
        return any ? valid > 0 : valid == 1;
    }
    int typed = !type || (type->type == MJ_STR && schema_type_is(type->str, v));
    for (size_t i = 0; type && type->type == MJ_ARR && i < mj_len(type); i++) typed |= schema_type_is(mj_at(type, i)->str, v);
    if (!typed || (cnst && !mj_same(cnst, v))) return 0;
    int listed = !list;
    for (size_t i = 0; list && i < mj_len(list); i++) listed |= mj_same(mj_at(list, i), v);
    if (!listed) return 0;
    for (size_t i = 0; v->type == MJ_OBJ && req && i < mj_len(req); i++)
        if (!mj_get(v, mj_at(req, i)->str)) return 0;
    for (size_t i = 0; v->type == MJ_OBJ && i < v->n; i++) {
        const struct mj *p = props ? mj_get(props, v->kids[i].key) : NULL, *s = p ? p : extra;
        if (s && !schema_valid(root, s, &v->kids[i])) return 0;
    }
    if (v->type == MJ_ARR && (v->n < (size_t)mj_num(mj_get(sc, "minItems"), 0) || v->n > (size_t)mj_num(mj_get(sc, "maxItems"), 1e9))) return 0;
    for (size_t i = 0; v->type == MJ_ARR && items && i < v->n; i++)
        if (!schema_valid(root, items, &v->kids[i])) return 0;
    return 1;
}

static int coin(uint64_t *r, int n) { return (int)(sample_next_u64(r) % (uint64_t)n); }

static void put(char *b, size_t *n, const char *s)
{
    memcpy(b + *n, s, strlen(s));
    *n += strlen(s);
}

/* A random document valid under SC into B, as coli writes one: properties in the schema's order (optional ones
 * sometimes), anyOf's branch at random, enum values as sent, whitespace here and there. */
static void schema_generate(const struct mj *root, const struct mj *sc, char *b, size_t *n, int depth, uint64_t *r)
{
    static const char *const strings[] = {"\"\"", "\"abc\"", "\"a\\n\\u00e9\\\"\"", "\"\xc3\xa9\xe6\x97\xa5\""};
    static const char *const numbers[] = {"0", "-1.5", "3e2", "42"}, *const integers[] = {"0", "-7", "12"};
    const struct mj *ref = mj_get(sc, "$ref"), *any = mj_get(sc, "anyOf"), *type = mj_get(sc, "type"), *list = mj_get(sc, "enum");
    if (ref) return schema_generate(root, schema_ref(root, ref), b, n, depth, r);
    if (any) return schema_generate(root, mj_at(any, (size_t)coin(r, (int)mj_len(any))), b, n, depth, r);
    if (list || mj_get(sc, "const")) {
        const struct mj *v = list ? mj_at(list, (size_t)coin(r, (int)mj_len(list))) : mj_get(sc, "const");
        if (v->type == MJ_STR) *n += (size_t)sprintf(b + *n, "\"%s\"", v->str);
        else if (v->type == MJ_NUM) *n += (size_t)sprintf(b + *n, "%.17g", v->num);
        else put(b, n, v->type == MJ_NULL ? "null" : v->num ? "true" : "false");
        return;
    }
    if (!type) return json_random(b, n, depth < 3 ? 3 - depth : 0, r);
    const char *t = type->type == MJ_STR ? type->str : mj_at(type, (size_t)coin(r, (int)mj_len(type)))->str;
    const struct mj *props = mj_get(sc, "properties"), *extra = mj_get(sc, "additionalProperties"), *req = mj_get(sc, "required");
    if (!strcmp(t, "object")) {
        int first = 1;
        put(b, n, coin(r, 2) ? "{" : "{ ");
        for (size_t i = 0; i < (props ? props->n : (extra && extra->type == MJ_BOOL && !extra->num) ? 0 : (size_t)coin(r, 3)); i++) {
            int required = 0;
            for (size_t k = 0; props && req && k < mj_len(req); k++) required |= !strcmp(mj_at(req, k)->str, props->kids[i].key);
            if (props && !required && (depth > 3 || coin(r, 2))) continue;
            put(b, n, first ? "" : coin(r, 2) ? "," : ",\n  ");
            *n += props ? (size_t)sprintf(b + *n, "\"%s\":", props->kids[i].key) : (size_t)sprintf(b + *n, "\"k%zu\" : ", i);
            schema_generate(root, props ? &props->kids[i] : extra ? extra : &(struct mj){.type = MJ_BOOL, .num = 1}, b, n, depth + 1, r);
            first = 0;
        }
        put(b, n, "}");
    } else if (!strcmp(t, "array")) {
        const int lo = (int)mj_num(mj_get(sc, "minItems"), 0), hi = (int)mj_num(mj_get(sc, "maxItems"), lo + 3);
        const int count = lo + coin(r, (hi < lo + 3 ? hi : lo + 3) - lo + 1);
        put(b, n, "[");
        for (int i = 0; i < count; i++) {
            put(b, n, i ? ", " : "");
            schema_generate(root, mj_get(sc, "items"), b, n, depth + 1, r);
        }
        put(b, n, "]");
    } else if (!strcmp(t, "string")) put(b, n, strings[coin(r, 4)]);
    else if (!strcmp(t, "number")) put(b, n, numbers[coin(r, 4)]);
    else if (!strcmp(t, "integer")) put(b, n, integers[coin(r, 3)]);
    else if (!strcmp(t, "boolean")) put(b, n, coin(r, 2) ? "true" : "false");
    else put(b, n, "null");
}

/* A random walk of the automaton under SC: at each byte one of the printable ones it takes (closers favoured past 40
 * bytes); the document's length when it completes, 0 if not within CAP. *DEAD: a state that took no byte at all. */
static size_t schema_walk(const struct sample_schema *sc, char *b, size_t cap, uint64_t *r, int *dead)
{
    struct sample_json s = sample_json_start(sc);
    size_t n = 0;
    while (s.state != SJ_DONE && n + 1 < cap) {
        unsigned char ok[256], closers[8];
        int k = 0, c_n = 0, any = 0;
        for (int c = 0; c < 256; c++) {
            struct sample_json t = s;
            if (!sample_json_step(&t, (unsigned char)c)) continue;
            any = 1;
            if (c >= 0x20 && c < 0x7f && c != '\\') ok[k++] = (unsigned char)c;
            if (c == '"' || c == '}' || c == ']') closers[c_n++] = (unsigned char)c;
        }
        *dead |= !any;
        if (!k) return 0;
        const unsigned char c = n > 40 && c_n && coin(r, 4) ? closers[coin(r, c_n)] : ok[coin(r, k)];
        sample_json_step(&s, c);
        b[n++] = (char)c;
    }
    return s.state == SJ_DONE ? n : 0;
}

/* Where DOC stops being the start of an object SC admits (its length if never); *WHOLE: complete at its last byte. */
static int schema_reject_at(const struct sample_schema *sc, const char *doc, int *whole)
{
    struct sample_json s = sample_json_start(sc);
    const int n = (int)strlen(doc);
    *whole = 0;
    for (int i = 0; i < n; i++) {
        if (s.state == SJ_DONE || !sample_json_step(&s, (unsigned char)doc[i])) return i;
        *whole = s.state == SJ_DONE && i + 1 == n;
    }
    return n;
}

static struct sample_schema *schema_from(const char *text, char *why)
{
    const char *err = NULL;
    struct json *j = json_parse(text, strlen(text), &err);
    struct sample_schema *s = j ? sample_schema_compile(j, why) : NULL;
    if (!j) snprintf(why, SAMPLE_SCHEMA_ERROR, "not JSON: %s", err);
    json_free(j);
    return s;
}

static const char *const schema_person =
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":3},\"color\":{\"enum\":[\"red\",\"green\",\"blue\"]},"
    "\"score\":{\"anyOf\":[{\"type\":\"number\"},{\"type\":\"null\"}]},\"ok\":{\"type\":\"boolean\"}},\"required\":[\"name\",\"age\",\"color\"]}";
static const char *const schema_tree =
    "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},\"kids\":{\"type\":\"array\","
    "\"items\":{\"$ref\":\"#/$defs/node\"},\"maxItems\":2}},\"required\":[\"v\"],\"additionalProperties\":false}},\"$ref\":\"#/$defs/node\"}";
static const char *const schema_mixed =
    "{\"type\":\"object\",\"properties\":{\"counts\":{\"type\":\"object\",\"additionalProperties\":{\"type\":\"integer\"}},"
    "\"level\":{\"enum\":[1,12,-3,2.5,\"x\",true,null]},\"version\":{\"const\":\"v1\"},\"pair\":{\"type\":\"array\","
    "\"items\":{\"type\":\"number\"},\"minItems\":2,\"maxItems\":2},\"empty\":{\"type\":\"object\",\"additionalProperties\":false},"
    "\"any\":{},\"maybe\":{\"type\":[\"string\",\"null\"]}},\"required\":[\"counts\",\"level\",\"version\",\"pair\",\"empty\",\"any\",\"maybe\"]}";

/* JSON mode under a schema: hand-made documents taken or refused where the schema breaks; the automaton's random
 * walks valid by the test's validator, never stuck; the test's random valid documents taken whole. */
static void test_json_schema(void)
{
    static const char *const texts[] = {schema_person, schema_tree, schema_mixed};
    static const struct { int schema; const char *doc; int at; } cases[] = {
        {0, "{\"name\":\"x\",\"age\":3,\"color\":\"red\"}", -1},
        {0, "{ \"name\" : \"x\" , \"age\" : -3 , \"tags\" : [\"a\"] , \"color\" : \"blue\" , \"score\" : null , \"ok\" : true }", -1},
        {0, "{\"age\":3}", 2},                           /* name is required first */
        {0, "{\"name\":\"x\",\"age\":1.5}", 19},          /* an integer */
        {0, "{\"name\":\"x\",\"age\":3}", 19},            /* color is required */
        {0, "{\"name\":\"x\",\"age\":3,\"color\":\"r\"}", 30}, /* not one of the enum's */
        {0, "{\"name\":\"x\",\"age\":3,\"color\":\"red\",\"tags\":[]}", 35}, /* the schema's order */
        {0, "{\"name\":\"x\",\"age\":3,\"tags\":[\"a\",\"b\",\"c\",\"d\"]}", 39}, /* maxItems 3 */
        {0, "{\"name\":\"x\",\"age\":3,\"color\":\"red\",\"score\":\"1\"}", 42}, /* anyOf: a number or null */
        {0, "{\"name\":1}", 8},
        {1, "{\"v\":1,\"kids\":[{\"v\":2},{\"v\":3,\"kids\":[]}]}", -1},
        {1, "{\"v\":1,\"kids\":[{\"v\":2},{\"v\":3},{\"v\":4}]}", 30}, /* maxItems 2 */
        {1, "{\"v\":1,\"w\":2}", 8},                      /* no other properties */
        {2, "{\"counts\":{\"a\":1,\"b\":2},\"level\":12,\"version\":\"v1\",\"pair\":[1,2],\"empty\":{},\"any\":[{\"q\":null}],\"maybe\":null}", -1},
        {2, "{\"counts\":{},\"level\":1,\"version\":\"v1\",\"pair\":[0.5,-1e3],\"empty\":{ },\"any\":\"s\",\"maybe\":\"m\"}", -1},
        {2, "{\"counts\":{\"a\":1.5}", 16},
        {2, "{\"counts\":{},\"level\":13", 22},              /* 1 and 12, not 13 */
        {2, "{\"counts\":{},\"level\":2.50", 24},
        {2, "{\"counts\":{},\"level\":1,\"version\":\"v2\"", 35},
        {2, "{\"counts\":{},\"level\":1,\"version\":\"v1\",\"pair\":[1]", 47}, /* minItems 2 */
        {2, "{\"counts\":{},\"level\":1,\"version\":\"v1\",\"pair\":[1,2,3]", 49},
        {2, "{\"counts\":{},\"level\":1,\"version\":\"v1\",\"pair\":[1,2],\"empty\":{\"a\"", 60},
    };
    char why[SAMPLE_SCHEMA_ERROR], label[200];
    struct sample_schema *sc[3];
    for (int k = 0; k < 3; k++) {
        sc[k] = schema_from(texts[k], why);
        check(sc[k] != NULL, "JSON schema: compiled", "schema %d: %s", k, why);
        if (!sc[k]) return;
    }
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        int whole, at = schema_reject_at(sc[cases[k].schema], cases[k].doc, &whole);
        const int want = cases[k].at < 0 ? (int)strlen(cases[k].doc) : cases[k].at;
        check(at == want && (cases[k].at >= 0 || whole), "JSON schema: a document taken whole, or refused where it breaks the schema",
              "'%s': at %d (want %d), whole %d", cases[k].doc, at, want, whole);
    }
    uint64_t r = 11;
    for (int k = 0; k < 3; k++) {
        const char *err = NULL;
        struct mj *root = mj_parse(texts[k], strlen(texts[k]), &err, NULL);
        int walked = 0, valid = 0, dead = 0, taken = 0;
        char *b = plat_alloc(1 << 16);
        for (int w = 0; w < 300; w++) {
            size_t n = schema_walk(sc[k], b, 4096, &r, &dead);
            struct mj *doc = n ? mj_parse(b, n, &err, NULL) : NULL;
            walked += n > 0;
            valid += doc && schema_valid(root, root, doc);
            mj_free(doc);
        }
        for (int g = 0; g < 300; g++) {
            size_t n = 0;
            int whole;
            schema_generate(root, root, b, &n, 0, &r);
            b[n] = 0;
            taken += schema_reject_at(sc[k], b, &whole) == (int)n && whole;
        }
        snprintf(label, sizeof label, "JSON schema %d: random walks of the automaton complete, valid by the test's validator, never stuck", k);
        check(walked >= 270 && valid == walked && !dead, label, "%d of 300 complete, %d valid, stuck %d", walked, valid, dead);
        snprintf(label, sizeof label, "JSON schema %d: 300 random valid documents taken whole", k);
        check(taken == 300, label, "%d", taken);
        free(b);
        mj_free(root);
        sample_schema_free(sc[k]);
    }
    static const struct { const char *schema, *says; } refused[] = {
        {"{\"type\":\"string\"}", "root must be an object"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\",\"pattern\":\"x\"}}}", "'pattern'"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"anyOf\":[{\"type\":\"string\"},{\"enum\":[\"x\"]}]}}}", "both admit a string"},
        {"{\"type\":\"object\",\"required\":[\"b\"],\"properties\":{\"a\":{}}}", "\"b\", which 'properties' lacks"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#/components/x\"}}}", "'$ref' \"#/components/x\""},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"array\",\"minItems\":3,\"maxItems\":2}}}", "'minItems' is above"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"text\"}}}", "'type' must be"},
        {"{\"$defs\":{\"a\":{\"$ref\":\"#/$defs/a\"}},\"$ref\":\"#/$defs/a\"}", "deeper than"},
        {"{\"$defs\":{\"a\":{\"anyOf\":[{\"$ref\":\"#/$defs/a\"},{\"type\":\"null\"}]}},\"type\":\"object\",\"properties\":{\"x\":{\"$ref\":\"#/$defs/a\"}}}",
         "holds itself"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"enum\":[[1]]}}}", "objects or lists"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\",\"enum\":[1,2]}}}", "no value of the schema's 'type'"},
    };
    char deep[2048] = "{\"type\":\"object\",\"properties\":{\"a\":";
    for (int k = 0; k < 40; k++) strcat(deep, "{\"type\":\"array\",\"items\":");
    strcat(deep, "{}");
    for (int k = 0; k < 42; k++) strcat(deep, "}");
    struct sample_schema *s = schema_from(deep, why);
    check(!s && strstr(why, "deeper than 32"), "JSON schema: 40 schemas deep refused", "%s", s ? "compiled" : why);
    sample_schema_free(s);
    int said = 0;
    for (size_t k = 0; k < sizeof refused / sizeof *refused; k++) {
        struct sample_schema *s = schema_from(refused[k].schema, why);
        said += !s && strstr(why, refused[k].says) != NULL;
        if (s || !strstr(why, refused[k].says)) printf("# %s: %s\n", refused[k].schema, s ? "compiled" : why);
        sample_schema_free(s);
    }
    check(said == (int)(sizeof refused / sizeof *refused), "JSON schema: what coli does not follow is refused, saying what", "%d of %zu", said,
          sizeof refused / sizeof *refused);
}

/* The call form's tools for test_tool_call: every kind of value, two required, and a tool whose name begins the other's. */
static const char call_tools[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"set_alarm\",\"parameters\":{\"type\":\"object\",\"properties\":{\"hour\":{\"type\":"
    "\"integer\"},\"loud\":{\"type\":\"boolean\"},\"day\":{\"enum\":[\"mon\",\"tue\",7]},\"ratio\":{\"type\":\"number\"},\"note\":{\"type\":"
    "\"string\"}},\"required\":[\"hour\",\"day\"]}}},{\"type\":\"function\",\"function\":{\"name\":\"set\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{}}}}]";

/* Whether call text T (after "<tool_call>\n<function=") parses as the server parses calls (serve_parse_call), of a tool
 * in TOOLS, each value of its schema's type (minijson reads the arguments) and the required keys there. */
static int call_valid(const struct json *tools, const char *t, size_t n)
{
    static const char open[] = "<tool_call>\n<function=";
    char *whole = plat_alloc(sizeof open + n);
    memcpy(whole, open, sizeof open - 1);
    memcpy(whole + sizeof open - 1, t, n);
    struct serve_answer a = {0};
    int ok = serve_parse_call(&a, tools, whole, sizeof open - 1 + n) && a.n_calls == 1;
    const char *err;
    size_t off;
    struct mj *args = ok ? mj_parse(a.calls[0].arguments, strlen(a.calls[0].arguments), &err, &off) : NULL;
    if (ok && !strcmp(a.calls[0].name, "set")) ok = args && mj_len(args) == 0;
    else if (ok) {
        const struct mj *hour = mj_get(args, "hour"), *loud = mj_get(args, "loud"), *day = mj_get(args, "day"), *ratio = mj_get(args, "ratio");
        const struct mj *note = mj_get(args, "note");
        ok = !strcmp(a.calls[0].name, "set_alarm") && hour && hour->type == MJ_NUM && hour->num == floor(hour->num) && day &&
             ((day->type == MJ_STR && (!strcmp(day->str, "mon") || !strcmp(day->str, "tue"))) || (day->type == MJ_NUM && day->num == 7)) &&
             (!loud || loud->type == MJ_BOOL) && (!ratio || ratio->type == MJ_NUM) && (!note || note->type == MJ_STR);
    }
    mj_free(args);
    serve_answer_free(&a);
    free(whole);
    return ok;
}

/* A forced call's automaton (sample_call) under call_tools: calls taken whole, and ended there; others refused at the
 * byte marked '|' (an unknown name or key, a key twice, </function> before a required key, an integer's fraction or
 * leading zero or 17th digit, an exponent, a boolean or enum value not listed, a text value's </parameter> without the
 * newline before it, anything after the call); random walks of it (forced to a tool, after the opening, or after
 * <tool_call> alone as when the model opens a call) end as calls the server's parser reads, of a known tool, each value
 * of its type, the required keys there; tools the form cannot hold are not compiled. */
static void test_tool_call(void)
{
    static const char *const docs[] = {
        "set_alarm>\n<parameter=hour>\n7\n</parameter>\n<parameter=day>\nmon\n</parameter>\n</function>\n</tool_call>",
        "set>\n</function>\n</tool_call>",
        "set_alarm>\n<parameter=day>\n7\n</parameter>\n<parameter=note>\na\n</param\n</parameter>\n<parameter=loud>\nFalse\n</parameter>\n"
        "<parameter=ratio>\n-0.25\n</parameter>\n<parameter=hour>\n-0\n</parameter>\n</function>\n</tool_call>",
        "set_alarm>\n<parameter=note>\n</parameter>\n<parameter=hour>\n1234567890123456\n</parameter>\n<parameter=day>\ntue\n</parameter>\n"
        "</function>\n</tool_call>",
        "se|x>", "set_alarm>\n<parameter=h|x>", "set_alarm>\n<parameter=hour>\n1\n</parameter>\n<parameter=|hour>",
        "set_alarm>\n<parameter=hour>\n1\n</parameter>\n<|/function>", "set_alarm>\n<parameter=hour>\n1|.5", "set_alarm>\n<parameter=hour>\n0|7",
        "set_alarm>\n<parameter=hour>\n1234567890123456|7", "set_alarm>\n<parameter=ratio>\n1.5|e3", "set_alarm>\n<parameter=hour>\n-|\n",
        "set_alarm>\n<parameter=loud>\n|yes", "set_alarm>\n<parameter=day>\n|wed", "set_alarm>\n<parameter=note>\nab</parameter|>",
        "set>\n</function>\n</tool_call>|\n", "set>\n<|parameter=",
    };
    const char *why;
    struct json *tools = json_parse(call_tools, strlen(call_tools), &why);
    struct sample_call_spec *spec = sample_call_compile(tools);
    int right = 0, n = (int)(sizeof docs / sizeof *docs);
    for (int d = 0; spec && d < n; d++) {
        const char *bar = strchr(docs[d], '|');
        const size_t len = strlen(docs[d]), at = bar ? (size_t)(bar - docs[d]) : len;
        struct sample_call c = sample_call_start(spec, -1);
        size_t i = 0;
        for (; i < len; i++)
            if (docs[d][i] != '|' && !sample_call_step(&c, (unsigned char)docs[d][i])) break;
        const int ok = bar ? i == at + 1 : i == len && c.phase == SCP_DONE && call_valid(tools, docs[d], len);
        if (!ok) printf("# call %d: stopped at byte %zu of %zu (want %s %zu), phase %d\n", d, i, len, bar ? "refused at" : "whole", at, c.phase);
        right += ok;
    }
    check(spec && right == n, "tool call: calls taken whole (and parsed, typed), others refused at the byte where they break", "%d of %d", right, n);
    int done = 0, valid = 0, dead = 0;
    uint64_t r = 77;
    for (int w = 0; spec && w < 300; w++) {
        char text[4096];
        size_t len = 0;
        struct sample_call c = sample_call_start(spec, w % 3 == 0 ? 0 : w % 3 == 1 ? -1 : -2);
        size_t skip = w % 3 == 2 ? strlen("\n<function=") : 0; /* a call the model opened starts after <tool_call> */
        if (!(w % 3)) len = (size_t)sprintf(text, "set_alarm>\n"); /* a call forced to set_alarm starts after its name */
        while (c.phase != SCP_DONE && len + 16 < sizeof text) {
            unsigned char ok[128];
            int k = 0;
            for (int b = 0; b < 128; b++) {
                struct sample_call t = c;
                if ((b == '\n' || (b >= 0x20 && b < 0x7f)) && sample_call_step(&t, (unsigned char)b)) ok[k++] = (unsigned char)b;
            }
            dead += !k;
            if (!k) break;
            const char *end = c.phase == SCP_TEXT && coin(&r, 8) == 0 ? "\n</parameter>\n" : NULL; /* a text value ends now and then */
            for (; end && *end; end++) sample_call_step(&c, (unsigned char)*end), text[len++] = *end;
            if (end) continue;
            const unsigned char b = ok[coin(&r, k)];
            sample_call_step(&c, b);
            text[len++] = (char)b;
        }
        done += c.phase == SCP_DONE;
        valid += c.phase == SCP_DONE && (!skip || !memcmp(text, "\n<function=", skip)) && call_valid(tools, text + skip, len - skip);
    }
    check(done >= 270 && valid == done && !dead, "tool call: random walks end as calls the parser reads, typed, the required keys there",
          "%d of 300 ended, %d valid, %d dead states", done, valid, dead);
    static const char *const refused[] = {
        "[{\"type\":\"function\",\"function\":{\"name\":\"a>b\",\"parameters\":{}}}]",
        "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"properties\":{\"x\\ny\":{}}}}}]",
        "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"properties\":{\"x\":{\"enum\":[\"a</parameter>\"]}}}}}]",
        "{\"name\":\"f\"}", "[]"};
    int none = 0;
    for (size_t k = 0; k < sizeof refused / sizeof *refused; k++) {
        struct json *t = json_parse(refused[k], strlen(refused[k]), &why);
        struct sample_call_spec *sp = sample_call_compile(t);
        none += !sp;
        sample_call_free(sp);
        json_free(t);
    }
    check(none == 5, "tool call: a name with '>', a key with a newline, an enum value holding </parameter>, no tools: not compiled", "%d of 5", none);
    sample_call_free(spec);
    json_free(tools);
}

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    float logits[V], row[V];
    int count[V];
    for (int i = 0; i < V; i++) logits[i] = -10.0f + (float)(i % 7) * 0.01f;
    logits[500] = 3.0f;
    logits[700] = 3.0f; /* a tie with 500: greedy takes the lower id */
    logits[100] = 2.0f;
    uint64_t rng = 1;
    plat_cpu_detect();
    test_vector_scans();
    test_draw_weights(logits);
    test_top();
    test_against_reference();
    test_json_mode();
    test_json_schema();
    test_tool_call();
    struct sample_params greedy = {0.0f, 0, 1.0f, 0.0f, 1.0f, 64, 1, 0.0f, 0.0f};
    memcpy(row, logits, sizeof row);
    int greedy_id = sample_next(&greedy, row, V, NULL, 0, &rng, cand);
    check(greedy_id == 500, "greedy: argmax, lowest id on a tie", "token %d", greedy_id);

    struct sample_params top1 = {1.0f, 1, 1.0f, 0.0f, 1.0f, 64, 7, 0.0f, 0.0f};
    draw(&top1, logits, 200, count);
    check(count[500] + count[700] == 200 && (count[500] == 200 || count[700] == 200), "top-k 1: always one of the best", "500: %d, 700: %d of 200", count[500], count[700]);

    /* p(500) = p(700) = e^3 / (2e^3 + e^2 + ~997 e^-10) ~ 0.4223, p(100) ~ 0.1554 */
    struct sample_params plain = {1.0f, 0, 1.0f, 0.0f, 1.0f, 64, 11, 0.0f, 0.0f};
    draw(&plain, logits, 20000, count);
    double f500 = count[500] / 20000.0, f100 = count[100] / 20000.0;
    check(fabs(f500 - 0.4223) < 0.02 && fabs(f100 - 0.1554) < 0.015, "temperature 1: frequencies follow softmax", "500: %.4f, 100: %.4f", f500, f100);

    struct sample_params nucleus = {1.0f, 0, 0.8f, 0.0f, 1.0f, 64, 3, 0.0f, 0.0f};
    draw(&nucleus, logits, 2000, count);
    check(count[500] + count[700] == 2000, "top-p 0.8: only the two best (0.84 of the mass)", "500 and 700: %d of 2000", count[500] + count[700]);

    struct sample_params minp = {1.0f, 0, 1.0f, 0.5f, 1.0f, 64, 5, 0.0f, 0.0f};
    draw(&minp, logits, 2000, count);
    check(count[100] == 0 && count[500] > 0 && count[700] > 0, "min-p 0.5: drops what is below half the best", "100: %d, 500: %d, 700: %d", count[100], count[500], count[700]);

    struct sample_params a = plain, b = plain;
    int ca[V], cb[V];
    draw(&a, logits, 500, ca);
    draw(&b, logits, 500, cb);
    check(!memcmp(ca, cb, sizeof ca), "same seed, same draws", "the counts differ");

    int history[3] = {500, 500, 42};
    struct sample_params pen = {0.0f, 0, 1.0f, 0.0f, 2.0f, 64, 1, 0.0f, 0.0f};
    memcpy(row, logits, sizeof row);
    int id = sample_next(&pen, row, V, history, 3, &rng, cand);
    check(id == 700 && row[500] == 1.5f && row[42] == logits[42] * 2.0f, "repetition penalty: divides positive, multiplies negative, once per token",
          "token %d, 500: %g, 42: %g", id, row[500], row[42]);

    struct sample_params pf = {0.0f, 0, 1.0f, 0.0f, 1.0f, 64, 1, 0.25f, 0.5f};
    memcpy(row, logits, sizeof row);
    sample_next(&pf, row, V, history, 3, &rng, cand);
    check(row[500] == logits[500] - (0.25f + 0.5f * 2) && row[42] == logits[42] - (0.25f + 0.5f) && row[700] == logits[700],
          "presence and frequency penalties: once per token seen, and per time seen", "500: %g, 42: %g, 700: %g", row[500], row[42],
          row[700]);

    return check_done();
}
