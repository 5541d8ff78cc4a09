/* Tests for coli §3 quant and the §4 matrix products. Usage: test_quant [golden_dir] [--quick]
 * (--quick, for the sanitizer build: not the IQ3 grid derivations) */
#define COLI_NO_MAIN
#include "../coli.c"
#include "check.h"

/* ---- deterministic random ---- */
static uint64_t rng_state = 0x9e3779b97f4a7c15ULL;
static uint64_t rng_u64(void) {
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return rng_state;
}
static float rng_unit(void) { return (float)((rng_u64() >> 40) / 16777216.0) * 2.0f - 1.0f; }

static const enum gguf_type all_types[] = { GGUF_TYPE_F32, GGUF_TYPE_F16, GGUF_TYPE_BF16,
    GGUF_TYPE_Q8_0, GGUF_TYPE_Q4_0, GGUF_TYPE_Q4_1, GGUF_TYPE_Q5_0, GGUF_TYPE_Q5_1,
    GGUF_TYPE_Q4_K, GGUF_TYPE_Q5_K, GGUF_TYPE_Q6_K, GGUF_TYPE_Q2_K, GGUF_TYPE_Q3_K,
    GGUF_TYPE_IQ4_NL, GGUF_TYPE_IQ4_XS, GGUF_TYPE_IQ3_XXS, GGUF_TYPE_IQ3_S, GGUF_TYPE_MXFP4 };
#define N_TYPES (int)(sizeof all_types / sizeof all_types[0])

/* W_FULL: every quant byte with all bits set (the unsigned formats' largest quants; MXFP4: code 7,
 * its largest value): the widest integer sums */
enum wmode { W_RANDOM, W_ZERO, W_MAX, W_DENORM_SCALE, W_NEGZERO, W_FULL };
/* X_ONES / X_MINUS_ONES: every activation quant at 127 / -127, the same sign throughout */
enum xmode { X_RANDOM, X_ZERO, X_BIG, X_DENORM, X_NEGZERO, X_ONES, X_MINUS_ONES };

/* fp16 scale for a weight mode: modest random, 65504, subnormal, or -0. */
static uint16_t w_scale(enum wmode m) {
    switch (m) {
    case W_MAX: return 0x7bff;
    case W_DENORM_SCALE: return (uint16_t)((rng_u64() & 0x83ff) | 1);
    case W_NEGZERO: return 0x8000;
    case W_ZERO: return 0;
    default: return (uint16_t)((rng_u64() & 0x83ff) | ((uint16_t)(3 + rng_u64() % 12) << 10));
    }
}

/* Fills a weight row of n elements of type t; scale fields are valid finite fp16. */
static void fill_weights(enum gguf_type t, uint8_t *w, int64_t n, enum wmode m) {
    const struct gguf_type_info *ti = gguf_type_get(t);
    int64_t nb = n / ti->block_elems, bytes = nb * ti->block_bytes;
    for (int64_t i = 0; i < bytes; i++)
        w[i] = m == W_ZERO || m == W_NEGZERO ? 0 : m == W_MAX ? ((rng_u64() & 1) ? 0xff : 0x00)
             : m == W_FULL ? (t == GGUF_TYPE_MXFP4 ? 0x77 : 0xff) : (uint8_t)rng_u64();
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = w + b * ti->block_bytes;
        uint16_t s0 = w_scale(m), s1 = w_scale(m);
        if (t == GGUF_TYPE_F32) {
            float f = m == W_RANDOM ? rng_unit() : m == W_MAX ? 3.0e38f : m == W_NEGZERO ? -0.0f
                    : m == W_DENORM_SCALE ? 1e-40f : 0.0f;
            memcpy(blk, &f, 4);
        } else if (t == GGUF_TYPE_BF16) {
            uint16_t h = m == W_RANDOM ? quant_f32_to_bf16(rng_unit()) : m == W_MAX ? 0x7f7f : s0;
            memcpy(blk, &h, 2);
        } else if (t == GGUF_TYPE_Q6_K) {
            memcpy(blk + 208, &s0, 2);
        } else if (t == GGUF_TYPE_Q2_K) {
            memcpy(blk + 80, &s0, 2);
            memcpy(blk + 82, &s1, 2);
        } else if (t == GGUF_TYPE_Q3_K) {
            memcpy(blk + 108, &s0, 2);
        } else if (t == GGUF_TYPE_MXFP4) {   /* E8M0: 2^(e-128), e = 0 and 1 subnormal */
            blk[0] = m == W_MAX ? 254 : m == W_DENORM_SCALE ? (uint8_t)(rng_u64() & 1)
                   : m == W_RANDOM || m == W_FULL ? (uint8_t)(118 + rng_u64() % 16) : 0;
        } else {
            memcpy(blk, &s0, 2);
            if (t == GGUF_TYPE_Q4_1 || t == GGUF_TYPE_Q5_1 || t == GGUF_TYPE_Q4_K || t == GGUF_TYPE_Q5_K)
                memcpy(blk + 2, &s1, 2);
        }
    }
}

static void fill_x(float *x, int64_t n, enum xmode m) {
    for (int64_t i = 0; i < n; i++) {
        switch (m) {
        case X_ZERO: x[i] = 0.0f; break;
        case X_NEGZERO: x[i] = -0.0f; break;
        case X_BIG: x[i] = rng_unit() * 60000.0f; break;
        case X_DENORM: x[i] = rng_unit() * 1e-40f; break;
        case X_ONES: x[i] = 1.0f; break;
        case X_MINUS_ONES: x[i] = -1.0f; break;
        default: x[i] = rng_unit() * (1.0f + (float)(i / 32 % 5)); break;
        }
    }
}

static int type_block(enum gguf_type t) { return gguf_type_get(t)->block_elems; }

/* ---- fp16 / bf16 ---- */
static void test_conversions(void) {
    int bad = 0, first = -1;
    for (int h = 0; h < 65536; h++) {
        if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue;
        if (quant_f32_to_f16(quant_f16_to_f32((uint16_t)h)) != h) { bad++; if (first < 0) first = h; }
    }
    check(!bad, "f16 round trip of all non-NaN patterns", "%d bad, first 0x%04x", bad, first);
    bad = 0; first = -1;
    for (int h = 0; h < 65536; h++) {
        if ((h & 0x7f80) == 0x7f80 && (h & 0x7f)) continue;
        if (quant_f32_to_bf16(quant_bf16_to_f32((uint16_t)h)) != h) { bad++; if (first < 0) first = h; }
    }
    check(!bad, "bf16 round trip of all non-NaN patterns", "%d bad, first 0x%04x", bad, first);
    static const struct { float f; uint16_t h; } f16c[] = {
        {1.0f, 0x3c00}, {-2.0f, 0xc000}, {65504.0f, 0x7bff}, {65519.0f, 0x7bff}, {65520.0f, 0x7c00},
        {1e9f, 0x7c00}, {-1e9f, 0xfc00}, {1.0f + 1.0f / 2048, 0x3c00} /* tie -> even */,
        {1.0f + 3.0f / 2048, 0x3c02} /* tie -> even (up) */, {5.960464477539063e-08f, 0x0001},
        {2.98023223876953125e-08f, 0x0000} /* 2^-25 ties to 0 */, {3.0e-08f, 0x0001},
        {8.940696716308594e-08f, 0x0002} /* 1.5 * 2^-24 ties to even 2 */, {6.097555160522461e-05f, 0x03ff},
        {6.103515625e-05f, 0x0400}, {-0.0f, 0x8000}, {1e-30f, 0x0000}, {0.1f, 0x2e66}, {INFINITY, 0x7c00} };
    bad = 0;
    for (size_t i = 0; i < sizeof f16c / sizeof f16c[0]; i++)
        if (quant_f32_to_f16(f16c[i].f) != f16c[i].h) {
            printf("# f16(%g) = 0x%04x, want 0x%04x\n", f16c[i].f, quant_f32_to_f16(f16c[i].f), f16c[i].h);
            bad++;
        }
    check(!bad, "f16 rounding of chosen values", "%d wrong", bad);
    static const struct { float f; uint16_t h; } bfc[] = {
        {1.0f, 0x3f80}, {1.00390625f, 0x3f80} /* tie -> even */, {1.01171875f, 0x3f82} /* tie -> up even */,
        {0x1.010002p+0f, 0x3f81}, {3.4e38f, 0x7f80} /* rounds to inf */, {-0.0f, 0x8000}, {1e-40f, 0x0001},
        {0.1f, 0x3dcd} };
    bad = 0;
    for (size_t i = 0; i < sizeof bfc / sizeof bfc[0]; i++)
        if (quant_f32_to_bf16(bfc[i].f) != bfc[i].h) {
            printf("# bf16(%g) = 0x%04x, want 0x%04x\n", bfc[i].f, quant_f32_to_bf16(bfc[i].f), bfc[i].h);
            bad++;
        }
    check(!bad, "bf16 rounding of chosen values", "%d wrong", bad);
    uint16_t nan16 = quant_f32_to_f16(NAN), nanb = quant_f32_to_bf16(NAN);
    check((nan16 & 0x7c00) == 0x7c00 && (nan16 & 0x3ff) && (nanb & 0x7f80) == 0x7f80 && (nanb & 0x7f),
          "NaN stays NaN", "f16 0x%04x bf16 0x%04x", nan16, nanb);
}

/* ---- golden dequant: minimal GGUF v3 reader and JSON scanning ---- */
struct gg_file { uint8_t *buf; size_t size, pos; int ok; };

static uint64_t gg_u(struct gg_file *g, int nbytes) {
    uint64_t v = 0;
    if (g->pos + (size_t)nbytes > g->size) { g->ok = 0; return 0; }
    memcpy(&v, g->buf + g->pos, (size_t)nbytes);
    g->pos += (size_t)nbytes;
    return v;
}

static void gg_skip_value(struct gg_file *g, uint32_t type) {
    static const int sizes[13] = { 1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8 };
    if (type == 8) { uint64_t len = gg_u(g, 8); g->pos += len; }
    else if (type == 9) {
        uint32_t et = (uint32_t)gg_u(g, 4);
        uint64_t cnt = gg_u(g, 8);
        for (uint64_t i = 0; i < cnt && g->ok; i++) gg_skip_value(g, et);
    } else if (type < 13) g->pos += (size_t)sizes[type];
    else g->ok = 0;
    if (g->pos > g->size) g->ok = 0;
}

static uint8_t *read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = plat_alloc((size_t)n + 1);
    if (fread(b, 1, (size_t)n, f) != (size_t)n) { fclose(f); free(b); return NULL; }
    fclose(f);
    b[n] = 0;
    *size = (size_t)n;
    return b;
}

/* Finds tensor `name`; returns a pointer to its data and sets *type and *ne0, or NULL. */
static const uint8_t *gg_find_tensor(struct gg_file *g, const char *name, uint32_t *type, uint64_t *ne0) {
    g->pos = 0; g->ok = 1;
    if (gg_u(g, 4) != 0x46554747u) return NULL;  /* "GGUF" */
    gg_u(g, 4);
    uint64_t nt = gg_u(g, 8), nkv = gg_u(g, 8), align = 32, found_off = 0;
    int found = 0;
    for (uint64_t i = 0; i < nkv && g->ok; i++) {
        uint64_t klen = gg_u(g, 8);
        const char *key = (const char *)g->buf + g->pos;
        g->pos += klen;
        uint32_t vt = (uint32_t)gg_u(g, 4);
        if (klen == 17 && !memcmp(key, "general.alignment", 17) && vt == 4) align = gg_u(g, 4);
        else gg_skip_value(g, vt);
    }
    for (uint64_t i = 0; i < nt && g->ok; i++) {
        uint64_t nlen = gg_u(g, 8);
        int match = nlen == strlen(name) && g->pos + nlen <= g->size && !memcmp(g->buf + g->pos, name, nlen);
        g->pos += nlen;
        uint32_t nd = (uint32_t)gg_u(g, 4);
        uint64_t d0 = 0;
        for (uint32_t k = 0; k < nd; k++) { uint64_t d = gg_u(g, 8); if (!k) d0 = d; }
        uint32_t ty = (uint32_t)gg_u(g, 4);
        uint64_t off = gg_u(g, 8);
        if (match) { found = 1; found_off = off; *type = ty; *ne0 = d0; }
    }
    if (!g->ok || !found) return NULL;
    size_t data = (g->pos + align - 1) / align * align;
    return data + found_off <= g->size ? g->buf + data + found_off : NULL;
}

/* Copies the JSON string value after `key` (searched from *p, before end) into out. */
static int json_str(const char **p, const char *end, const char *key, char *out, size_t cap) {
    const char *k = strstr(*p, key);
    if (!k || k >= end) return 0;
    const char *q = strchr(k + strlen(key), '"');
    if (!q) return 0;
    const char *e = strchr(q + 1, '"');
    if (!e || (size_t)(e - q - 1) >= cap) return 0;
    memcpy(out, q + 1, (size_t)(e - q - 1));
    out[e - q - 1] = 0;
    *p = e + 1;
    return 1;
}

/* Tests every dequant entry of one golden json against its gguf; returns entries checked. */
static int golden_file(const char *dir, const char *stem) {
    char path[1024];
    size_t jsz, gsz;
    snprintf(path, sizeof path, "%s/%s.json", dir, stem);
    char *js = (char *)read_file(path, &jsz);
    snprintf(path, sizeof path, "%s/%s.gguf", dir, stem);
    struct gg_file g = { read_file(path, &gsz), 0, 0, 1 };
    g.size = gsz;
    if (!js || !g.buf) { check(0, stem, "cannot read %s files", stem); free(js); free(g.buf); return 0; }
    const char *p = strstr(js, "\"dequant\"");
    const char *end = p ? strstr(p, "\"tensors\"") : NULL;
    if (!end) end = js + jsz;
    int count = 0;
    char tname[256], tyname[32], name[400];
    while (p && json_str(&p, end, "\"tensor\":", tname, sizeof tname) && json_str(&p, end, "\"type\":", tyname, sizeof tyname)) {
        const char *r = strstr(p, "\"row\":"), *v = strstr(p, "\"values\":");
        if (!r || !v || v >= end) break;
        long row = strtol(r + 6, NULL, 10);
        const char *q = strchr(v, '[') + 1;
        float want[4096];
        int nv = 0;
        while (*q && *q != ']' && nv < 4096) {
            char *e;
            want[nv++] = strtof(q, &e);
            q = e;
            while (*q == ',' || *q == ' ' || *q == '\n') q++;
        }
        p = q;
        uint32_t type = 0; uint64_t ne0 = 0;
        const uint8_t *data = gg_find_tensor(&g, tname, &type, &ne0);
        snprintf(name, sizeof name, "golden dequant %s %s %s row %ld", stem, tyname, tname, row);
        const struct gguf_type_info *ti = data ? gguf_type_get((int)type) : NULL;
        if (!ti || ne0 != (uint64_t)nv || strcmp(ti->name, tyname)) { check(0, name, "tensor missing or mismatched"); continue; }
        float got[4096];
        size_t rb = (size_t)(ne0 / (uint64_t)ti->block_elems) * (size_t)ti->block_bytes;
        quant_dequant_row((enum gguf_type)type, data + (size_t)row * rb, got, nv);
        int bad = -1;
        for (int i = 0; i < nv && bad < 0; i++) if (memcmp(&got[i], &want[i], 4)) bad = i;
        check(bad < 0, name, "element %d: got %.9g want %.9g", bad, bad < 0 ? 0.0 : got[bad], bad < 0 ? 0.0 : want[bad]);
        count++;
    }
    free(js); free(g.buf);
    return count;
}

static void test_golden(const char *dir) {
    static const char *stems[] = { "q35moe-f16", "q35moe-bf16", "q35moe-q8_0", "q35moe-q4_0",
        "q35moe-q4_1", "q35moe-q5_0", "q35moe-q5_1", "q35moe-k", "q35moe-q6_k", "q35moe-q5_k",
        "q35moe-q3_k_m", "q35moe-q3_k", "q35moe-q2_k", "q35moe-iq4_xs", "q35moe-iq4_nl", "q35moe-iq3_xxs",
        "q35moe-iq3_s", "q35moe-mxfp4" };
    char path[1024];
    snprintf(path, sizeof path, "%s/q35moe-q4_0.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f) { printf("ok - golden dequant # SKIP golden data absent (%s)\n", dir); n_pass++; return; }
    fclose(f);
    int total = 0;
    for (size_t i = 0; i < sizeof stems / sizeof stems[0]; i++) total += golden_file(dir, stems[i]);
    check(total >= 30, "golden dequant entry count", "only %d entries found", total);
}

/* ---- the IQ3 grids, derived again from the golden files ----
 * quant_iq3xxs_keys and quant_iq3s_keys (coli.c §3) list each format's points, sorted by key
 * (3-bit level of coordinate j at bits 3j). Here they are derived from the reference's output:
 *   - pinned: points the golden `dequant` rows show (value / the 32-block's scale is the level);
 *   - the rest: q35moe-iq3_* and q35moe-q6_k quantize the same F32 weights, so the Q6_K
 *     values stand in for them. Each 32-block gets the scale that best fits its 8 points
 *     (least squares), and the sorted list of keys that minimises the squared error of all
 *     blocks is found by dynamic programming over (entry, key).
 * IQ3_XXS: the derivation gives coli's table, and with every other pin dropped it still gives
 * every dropped point (that is how far the statistics alone can be trusted). IQ3_S has twice
 * the points for the same data, and the statistics leave a few entries open: there the
 * reference's logits decide (the golden short case's first row, coli's entry against the
 * statistics' choice). */
struct iq3_format {
    enum gguf_type type;
    const char *stem;       /* the golden file */
    int n_points, block_bytes;
    const uint16_t *keys;   /* coli's */
};
static const struct iq3_format iq3_xxs = { GGUF_TYPE_IQ3_XXS, "q35moe-iq3_xxs", 256, 98, quant_iq3xxs_keys };
static const struct iq3_format iq3_s = { GGUF_TYPE_IQ3_S, "q35moe-iq3_s", 512, 110, quant_iq3s_keys };

struct iq3_data { int n_blocks; float *x, *scale; uint16_t *idx; int pin[512]; };

static int iq3_level(const struct iq3_format *f, int l) {
    return f->type == GGUF_TYPE_IQ3_XXS ? quant_iq3_levels[l] : 2 * l + 1;
}

/* 32-block IB of super-block SB: its scale and its 8 point indices. */
static void iq3_block(const struct iq3_format *f, const uint8_t *sb, int ib, float *db, uint16_t *idx) {
    const float d = quant_f16_to_f32(quant_rd16(sb));
    if (f->type == GGUF_TYPE_IQ3_S) {
        *db = d * (float)(1 + 2 * quant_iq3s_scale(sb, ib));
        for (int k = 0; k < 8; k++) idx[k] = (uint16_t)quant_iq3s_index(sb, ib, k);
        return;
    }
    uint32_t aux;
    memcpy(&aux, sb + 66 + 4 * ib, 4);
    *db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
    for (int k = 0; k < 8; k++) idx[k] = sb[2 + 8 * ib + k];
}

static int iq3_level_key(const struct iq3_format *f, const int *lv) {
    int key = 0;
    for (int j = 3; j >= 0; j--) {
        int l = 0;
        while (l < 8 && iq3_level(f, l) != lv[j]) l++;
        if (l == 8) return -1;
        key = key * 8 + l;
    }
    return key;
}

/* The points the golden dequant rows of F's file show (d->pin), from the file G. */
static void iq3_pins(const struct iq3_format *f, const struct gguf_file *g, const struct json *root, struct iq3_data *d) {
    for (int e = 0; e < 512; e++) d->pin[e] = -1;
    for (const struct json *e = root ? json_get(root, "dequant")->child : NULL; e; e = e->next) {
        const struct gguf_tensor *a = gguf_tensor_find(g, json_get(e, "tensor")->str);
        const int64_t cols = a->shape[a->n_dims - 1];
        const uint8_t *row = a->data + (size_t)json_get(e, "row")->number * (size_t)(cols / 256 * f->block_bytes);
        const struct json *v = json_get(e, "values")->child;
        for (int k = 0; v && k < cols / 32; k++) {
            float db;
            uint16_t idx[8];
            iq3_block(f, row + k / 8 * f->block_bytes, k % 8, &db, idx);
            for (int q = 0; q < 8; q++) {
                int lv[4];
                for (int j = 0; j < 4 && v; j++, v = v->next) lv[j] = (int)lrintf(fabsf((float)v->number) / db);
                d->pin[idx[q]] = iq3_level_key(f, lv);
            }
        }
    }
}

static int iq3_load(const char *dir, const struct iq3_format *f, struct iq3_data *d) {
    char p1[1024], p2[1024], p3[1024];
    snprintf(p1, sizeof p1, "%s/%s.gguf", dir, f->stem);
    snprintf(p2, sizeof p2, "%s/q35moe-q6_k.gguf", dir);
    snprintf(p3, sizeof p3, "%s/%s.json", dir, f->stem);
    struct plat_map jm;
    if (access(p1, R_OK) || access(p2, R_OK) || plat_map_file(p3, &jm)) return 0;
    struct gguf_file g, h;
    gguf_open(&g, p1);
    gguf_open(&h, p2);
    int64_t total = 0;
    for (int64_t t = 0; t < g.n_tensors; t++) if (g.tensors[t].type == (int)f->type) total += g.tensors[t].n_elems;
    d->x = plat_alloc((size_t)total * 4);
    d->scale = plat_alloc((size_t)total / 32 * 4);
    d->idx = plat_alloc((size_t)total / 4 * sizeof *d->idx);
    d->n_blocks = 0;
    for (int64_t t = 0; t < g.n_tensors; t++) {
        const struct gguf_tensor *a = &g.tensors[t], *b = gguf_tensor_find(&h, a->name);
        if (a->type != (int)f->type || !b || b->type != GGUF_TYPE_Q6_K || b->n_elems != a->n_elems) continue;
        float *x = d->x + (size_t)d->n_blocks * 32;
        quant_dequant_row(GGUF_TYPE_Q6_K, b->data, x, a->n_elems);
        for (int64_t i = 0; i < a->n_elems; i++) x[i] = fabsf(x[i]);
        for (int64_t k = 0; k < a->n_elems / 32; k++, d->n_blocks++)
            iq3_block(f, a->data + k / 8 * f->block_bytes, (int)(k % 8), &d->scale[d->n_blocks], d->idx + (size_t)d->n_blocks * 8);
    }
    const char *err;
    struct json *root = json_parse((const char *)jm.data, jm.size, &err);
    iq3_pins(f, &g, root, d);
    json_free(root);
    plat_unmap_file(&jm);
    gguf_close(&g);
    gguf_close(&h);
    return 1;
}

/* The sorted keys (out) minimising Σ_blocks |x - s_b * point|^2 with PIN fixed where >= 0. */
static void iq3_solve(const struct iq3_format *f, const struct iq3_data *d, const int *pin, int *out) {
    static double S[512][4], W[512][4], cost[512][4096];
    static short from[512][4096];
    const int np = f->n_points;
    memset(S, 0, sizeof S);
    memset(W, 0, sizeof W);
    for (int b = 0; b < d->n_blocks; b++)
        for (int q = 0; q < 32; q++) {
            const int e = d->idx[(size_t)b * 8 + q / 4];
            S[e][q % 4] += (double)d->scale[b] * d->x[(size_t)b * 32 + q];
            W[e][q % 4] += (double)d->scale[b] * d->scale[b];
        }
    for (int e = 0; e < np; e++) {
        double best = e ? 1e300 : 0;
        int arg = -1;
        for (int key = 0; key < 4096; key++) {
            double c = 0;
            for (int j = 0; j < 4; j++) {
                const double g = iq3_level(f, key >> 3 * j & 7);
                c += W[e][j] * g * g - 2 * S[e][j] * g;
            }
            cost[e][key] = pin[e] >= 0 && key != pin[e] ? 1e300 : best + c;
            from[e][key] = (short)arg;
            if (e && cost[e - 1][key] < best) { best = cost[e - 1][key]; arg = key; }
        }
    }
    int key = 0;
    for (int k = 1; k < 4096; k++) if (cost[np - 1][k] < cost[np - 1][key]) key = k;
    for (int e = np - 1; e >= 0; e--) { out[e] = key; key = from[e][key]; }
}

/* Refits each block's scale to the points of KEYS (least squares). */
static void iq3_refit(const struct iq3_format *f, struct iq3_data *d, const int *keys) {
    for (int b = 0; b < d->n_blocks; b++) {
        double num = 0, den = 0;
        for (int q = 0; q < 32; q++) {
            const double g = iq3_level(f, keys[d->idx[(size_t)b * 8 + q / 4]] >> 3 * (q % 4) & 7);
            num += d->x[(size_t)b * 32 + q] * g;
            den += g * g;
        }
        d->scale[b] = (float)(num / den);
    }
}

/* The statistics' table: solved with the pins, the scales refitted to it, solved again. */
static void iq3_derive(const struct iq3_format *f, struct iq3_data *d, const int *pin, int *keys) {
    iq3_solve(f, d, pin, keys);
    iq3_refit(f, d, keys);
    iq3_solve(f, d, pin, keys);
}

static void test_iq3xxs_lattice(const char *dir) {
    struct iq3_data d;
    if (!iq3_load(dir, &iq3_xxs, &d)) { printf("ok - IQ3_XXS lattice derived # SKIP golden data absent (%s)\n", dir); n_pass++; return; }
    int keys[256], held[256], half[512], n_pinned = 0, dropped = 0, wrong = 0, differ = 0;
    iq3_derive(&iq3_xxs, &d, d.pin, keys);
    for (int e = 0; e < 256; e++) {
        half[e] = d.pin[e] >= 0 && n_pinned++ % 2 ? -1 : d.pin[e];
        differ += keys[e] != quant_iq3xxs_keys[e];
    }
    iq3_solve(&iq3_xxs, &d, half, held);
    for (int e = 0; e < 256; e++)
        if (d.pin[e] >= 0 && half[e] < 0) { dropped++; wrong += held[e] != d.pin[e]; }
    check(!differ && n_pinned > 100, "IQ3_XXS lattice: derived from the golden files, equal to coli's",
          "%d of 256 differ (%d pinned)", differ, n_pinned);
    check(!wrong && dropped > 50, "IQ3_XXS lattice: the statistics alone find every dropped pin",
          "%d of %d wrong", wrong, dropped);
    free(d.x); free(d.scale); free(d.idx);
}

/* Largest |difference| between the golden file's full first logit row (the short case) and
 * coli's with the IQ3_S grid as it is now; -1 when the files are absent. */
static double iq3s_first_row_error(const char *dir) {
    static struct model m;
    static int *prompt, n_prompt = -1;
    static float *want;
    char path[1024];
    if (n_prompt < 0) {
        struct plat_map jm;
        snprintf(path, sizeof path, "%s/q35moe-iq3_s.json", dir);
        if (plat_map_file(path, &jm)) return -1;
        const char *err;
        struct json *root = json_parse((const char *)jm.data, jm.size, &err);
        const struct json *pt = json_get(json_get(root, "cases")->child, "prompt_tokens");
        n_prompt = 0;
        for (const struct json *t = pt->child; t; t = t->next) n_prompt++;
        prompt = plat_alloc((size_t)n_prompt * sizeof *prompt);
        n_prompt = 0;
        for (const struct json *t = pt->child; t; t = t->next) prompt[n_prompt++] = (int)t->number;
        json_free(root);
        plat_unmap_file(&jm);
        snprintf(path, sizeof path, "%s/q35moe-iq3_s.gguf", dir);
        model_load(&m, path, 256, 0);
        want = plat_alloc((size_t)m.cfg.n_vocab * sizeof *want);
        snprintf(path, sizeof path, "%s/q35moe-iq3_s.logits0.f32", dir);
        FILE *fl = fopen(path, "rb");
        if (!fl || fread(want, sizeof *want, (size_t)m.cfg.n_vocab, fl) != (size_t)m.cfg.n_vocab) die("%s: cannot read", path);
        fclose(fl);
    }
    struct model_seq q;
    model_seq_init(&m, &q);
    struct model_run run = {&q, prompt, n_prompt, NULL, 0, NULL, {0, 0, 0, 0, 0}, NULL};
    if (model_forward_runs(&m, &run, 1)) die("forward: %s", m.error);
    double worst = 0;
    for (int v = 0; v < m.cfg.n_vocab; v++) worst = fmax(worst, fabs(run.logits[v] - want[v]));
    model_seq_free(&m, &q);
    return worst;
}

/* Entry E of coli's IQ3_S tables (the grid, and the pair planes of the VBMI lookups) set to KEY. */
static void iq3s_set_point(int e, int key) {
    uint32_t g = 0;
    for (int j = 0; j < 4; j++) g |= (uint32_t)(2 * (key >> 3 * j & 7) + 1) << 8 * j;
    quant_iq3s_grid[e] = g;
    for (int h = 0; h < 2; h++) quant_iq3s_pairs[h][e] = (uint8_t)quant_iq3_pair((uint16_t)key, h);
}

static void test_iq3s_grid(const char *dir) {
    struct iq3_data d;
    if (!iq3_load(dir, &iq3_s, &d)) { printf("ok - IQ3_S grid derived # SKIP golden data absent (%s)\n", dir); n_pass++; return; }
    int keys[512], n_pinned = 0, pins_differ = 0, sorted = 1, differ = 0, worse = 0;
    for (int e = 0; e < 512; e++) {
        if (d.pin[e] >= 0) { n_pinned++; pins_differ += d.pin[e] != quant_iq3s_keys[e]; }
        sorted &= !e || quant_iq3s_keys[e] > quant_iq3s_keys[e - 1];
    }
    check(!pins_differ && n_pinned > 200 && sorted, "IQ3_S grid: every point the golden dequant rows show is coli's, sorted",
          "%d of %d pinned differ", pins_differ, n_pinned);
    iq3_derive(&iq3_s, &d, d.pin, keys);
    quant_set_level(quant_level_max());
    const double mine = iq3s_first_row_error(dir);
    char why[512] = "";
    for (int e = 0; e < 512; e++) {
        if (keys[e] == quant_iq3s_keys[e]) continue;
        differ++;
        iq3s_set_point(e, keys[e]);
        const double theirs = iq3s_first_row_error(dir);
        iq3s_set_point(e, quant_iq3s_keys[e]);
        if (theirs <= mine) {
            worse++;
            snprintf(why + strlen(why), sizeof why - strlen(why), " entry %d: %.3g against %.3g;", e, theirs, mine);
        }
    }
    char name[200];
    snprintf(name, sizeof name, "IQ3_S grid: the statistics give coli's table but for %d entries (at most 16)", differ);
    check(differ <= 16, name, "%d of 512 differ", differ);
    snprintf(name, sizeof name, "IQ3_S grid: there the reference's first logit row is closer with coli's (%.2g)", mine);
    check(!worse && differ > 0, name, "%d of %d are closer to the reference:%s", worse, differ, why);
    free(d.x); free(d.scale); free(d.idx);
}

/* ---- dot kernels ---- */
static int max_level;

/* Dot at `level` of a prepared act. */
static float dot_at(int level, enum gguf_type t, const void *w, const void *act, int64_t n) {
    quant_set_level(level);
    return quant_dot(t, w, act, n);
}

/* Every SIMD level gives the scalar bits for one (type, n, modes); returns 0 on success. */
static int simd_case(enum gguf_type t, int64_t n, enum wmode wm, enum xmode xm, char *why, size_t cap) {
    const struct gguf_type_info *ti = gguf_type_get(t);
    uint8_t *w = plat_alloc((size_t)(n / ti->block_elems * ti->block_bytes));
    float *x = plat_alloc((size_t)n * 4);
    void *act = plat_alloc_aligned(quant_act_bytes(t, n));
    fill_weights(t, w, n, wm);
    fill_x(x, n, xm);
    quant_act_prepare(t, x, n, act);
    float ref = dot_at(QUANT_LEVEL_SCALAR, t, w, act, n);
    int bad = 0;
    for (int l = QUANT_LEVEL_AVX2; l <= max_level && !bad; l++) {
        float got = dot_at(l, t, w, act, n);
        if (memcmp(&got, &ref, 4)) {
            snprintf(why, cap, "n=%lld wmode %d xmode %d: %s %.9g vs scalar %.9g", (long long)n, wm, xm,
                     quant_level_names[l], got, ref);
            bad = 1;
        }
    }
    free(w); free(x); free(act);
    return bad;
}

/* Blocks of raw random bytes, scale fields included (NaN, infinity, denormal fp16 and E8M0
 * scales, every index and sign pattern): what a corrupt or hostile file holds. Every level must
 * read only the row (the sanitizer build checks that) and give the scalar bits, or NaN where
 * the scalar result is NaN (NaN payloads may differ by operation order); dequantisation must
 * not read past the row either. */
static void test_raw_blocks(void) {
    for (int ti = 0; ti < N_TYPES; ti++) {
        const enum gguf_type t = all_types[ti];
        const struct gguf_type_info *info = gguf_type_get(t);
        const int64_t n = info->block_elems == 1 ? 512 : 8 * info->block_elems;
        const size_t bytes = (size_t)(n / info->block_elems * info->block_bytes);
        uint8_t *w = plat_alloc(bytes);
        float *x = plat_alloc((size_t)n * 4), *y = plat_alloc((size_t)n * 4);
        void *act = plat_alloc_aligned(quant_act_bytes(t, n));
        int bad = 0, nonfinite = 0;
        char why[200] = "";
        for (int rep = 0; rep < 64 && !bad; rep++) {
            for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)rng_u64();
            fill_x(x, n, X_RANDOM);
            quant_act_prepare(t, x, n, act);
            quant_dequant_row(t, w, y, n);
            const float ref = dot_at(QUANT_LEVEL_SCALAR, t, w, act, n);
            nonfinite += !isfinite(ref);
            for (int l = QUANT_LEVEL_AVX2; l <= max_level && !bad; l++) {
                const float got = dot_at(l, t, w, act, n);
                if (memcmp(&got, &ref, 4) && !(isnan(got) && isnan(ref))) {
                    bad = 1;
                    snprintf(why, sizeof why, "rep %d: %s %.9g vs scalar %.9g", rep, quant_level_names[l], got, ref);
                }
            }
        }
        char name[160];
        snprintf(name, sizeof name, "%s: raw random blocks (%d of 64 non-finite): every level gives the scalar result",
                 info->name, nonfinite);
        check(!bad, name, "%s", why);
        free(w); free(x); free(y); free(act);
    }
}

static void test_simd_vs_scalar(void) {
    static const int units[] = { 1, 31, 32, 33, 64, 100 };
    for (int ti = 0; ti < N_TYPES; ti++) {
        enum gguf_type t = all_types[ti];
        int be = type_block(t), bad = 0;
        char why[256] = "", name[128];
        int64_t lens[16];
        int nl = 0;
        for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) lens[nl++] = units[i] * be;
        lens[nl++] = 2048; lens[nl++] = 512;
        if (be == 1) { lens[nl++] = 7; lens[nl++] = 1000; }
        for (int i = 0; i < nl && !bad; i++)
            for (int rep = 0; rep < 4 && !bad; rep++) bad = simd_case(t, lens[i], W_RANDOM, X_RANDOM, why, sizeof why);
        snprintf(name, sizeof name, "%s simd == scalar, random rows", gguf_type_get(t)->name);
        check(!bad, name, "%s", why);
        static const struct { enum wmode w; enum xmode x; const char *what; } ex[] = {
            { W_ZERO, X_ZERO, "all zero" }, { W_MAX, X_BIG, "max scales and quants" },
            { W_RANDOM, X_DENORM, "denormal activations" }, { W_DENORM_SCALE, X_RANDOM, "denormal scales" },
            { W_NEGZERO, X_NEGZERO, "negative zero" }, { W_MAX, X_DENORM, "max weights, denormal x" },
            { W_FULL, X_ONES, "every quant at its largest, x at 127" },
            { W_FULL, X_MINUS_ONES, "every quant at its largest, x at -127" } };
        for (size_t e = 0; e < sizeof ex / sizeof ex[0]; e++) {
            bad = 0;
            for (int i = 0; i < nl && !bad; i++) bad = simd_case(t, lens[i], ex[e].w, ex[e].x, why, sizeof why);
            snprintf(name, sizeof name, "%s simd == scalar, %s", gguf_type_get(t)->name, ex[e].what);
            check(!bad, name, "%s", why);
        }
    }
}

/* Dequantised activation (what the kernels multiply with), for the double reference. */
static void act_dequant(enum gguf_type t, const void *act, int64_t n, double *xd) {
    switch (quant_act_kind(t)) {
    case QUANT_ACT_FLOAT: for (int64_t i = 0; i < n; i++) xd[i] = ((const float *)act)[i]; break;
    case QUANT_ACT_Q8: {
        struct quant_q8_view a = quant_q8_view(act, n);
        for (int64_t i = 0; i < n; i++) xd[i] = (double)a.d[i / 32] * a.qs[i];
        break;
    }
    default: {
        struct quant_q8k_view a = quant_q8k_view(act, n);
        for (int64_t i = 0; i < n; i++) xd[i] = (double)a.d[i / 256] * a.qs[i];
    }
    }
}

static void test_scalar_vs_double(void) {
    for (int ti = 0; ti < N_TYPES; ti++) {
        enum gguf_type t = all_types[ti];
        const struct gguf_type_info *inf = gguf_type_get(t);
        double worst = 0;
        for (int rep = 0; rep < 20; rep++) {
            int64_t n = (rep % 2 ? 2048 : 512) + (inf->block_elems == 1 ? rep : 0);
            uint8_t *w = plat_alloc((size_t)(n / inf->block_elems * inf->block_bytes));
            float *x = plat_alloc((size_t)n * 4), *wf = plat_alloc((size_t)n * 4);
            double *xd = plat_alloc((size_t)n * 8);
            void *act = plat_alloc_aligned(quant_act_bytes(t, n));
            fill_weights(t, w, n, W_RANDOM);
            fill_x(x, n, X_RANDOM);
            quant_act_prepare(t, x, n, act);
            quant_dequant_row(t, w, wf, n);
            act_dequant(t, act, n, xd);
            double ref = 0, mag = 0;
            for (int64_t i = 0; i < n; i++) { ref += (double)wf[i] * xd[i]; mag += fabs((double)wf[i] * xd[i]); }
            double err = fabs(dot_at(QUANT_LEVEL_SCALAR, t, w, act, n) - ref) / (mag > 0 ? mag : 1);
            if (err > worst) worst = err;
            free(w); free(x); free(wf); free(xd); free(act);
        }
        /* Q4_1/Q5_1 multiply their min by Q8_1's block sum stored in fp16 (2^-11 relative),
         * as the reference does; the other formats are exact up to float accumulation */
        double tol = t == GGUF_TYPE_Q4_1 || t == GGUF_TYPE_Q5_1 ? 1e-3 : 1e-5;
        char name[96];
        snprintf(name, sizeof name, "%s scalar dot vs double reference (relative %.1g)", inf->name, tol);
        check(worst < tol, name, "relative error %.3g", worst);
    }
}

/* The Q8 act's inverse scale is 127/amax, as in the x86 reference's quantize_row_q8_0, not
 * 1/(amax/127) as in its portable code: the two differ in the last bit for some amax, and then
 * an x near a .5 rounds to different q (issue 14's Q8_0 drift). The test finds such an
 * (amax, x) and checks which q coli stores, at every level. */
static void test_act_inverse_scale(void) {
    float amax = 0.0f, x = 0.0f;
    for (int k = 0; k < 4096 && x == 0.0f; k++) {
        const float a = 1.0f + (float)k * 0x1p-12f, ia = 127.0f / a, ib = 1.0f / (a / 127.0f);
        for (int m = 0; m < 126 && ia != ib && x == 0.0f; m++) {
            float v = ((float)m + 0.5f) / ia;
            for (int step = 0; step < 8 && x == 0.0f; step++, v = nextafterf(v, 2.0f))
                if (lrintf(v * ia) != lrintf(v * ib)) { amax = a; x = v; }
        }
    }
    check(x != 0.0f, "Q8 act: an x that 127/amax and 1/(amax/127) round apart exists", "none found");
    _Alignas(64) float blk[32] = { amax, x };
    _Alignas(64) uint8_t act[32 + 12];
    const long want = lrintf(x * (127.0f / amax));
    for (int l = 0; l <= max_level; l++) {
        char name[96];
        quant_set_level(l);
        quant_act_prepare(GGUF_TYPE_Q8_0, blk, 32, act);
        const struct quant_q8_view q = quant_q8_view(act, 32);
        snprintf(name, sizeof name, "Q8 act: the reference's 127/amax (%s)", quant_level_names[l]);
        check(q.qs[0] == 127 && q.qs[1] == want, name, "q %d, want %ld (amax %a, x %a)", q.qs[1], want, amax, x);
    }
    quant_set_level(max_level);
}

/* quant_act_prepare details the kernels rely on. */
static void test_act(void) {
    float x[256];
    for (int i = 0; i < 256; i++) x[i] = (float)(i - 128) / 64.0f;
    x[5] = -3.0f;                     /* the signed max: Q8_K scale must be negative of 127/-3 */
    _Alignas(64) uint8_t act[512];
    quant_act_prepare(GGUF_TYPE_Q4_K, x, 256, act);
    struct quant_q8k_view k = quant_q8k_view(act, 256);
    int s0 = 0;
    for (int i = 0; i < 16; i++) s0 += k.qs[i];
    check(k.qs[5] == -127 && k.d[0] == 1.0f / (-127.0f / -3.0f) && k.bsums[0] == s0,
          "Q8_K act: signed max, d = 1/iscale, bsums", "q5 %d d %g bsum %d/%d", k.qs[5], k.d[0], k.bsums[0], s0);
    quant_act_prepare(GGUF_TYPE_Q4_0, x, 256, act);
    struct quant_q8_view q = quant_q8_view(act, 256);
    int sum = 0;
    for (int i = 0; i < 32; i++) sum += q.qs[i];
    check(q.qs[5] == -127 && q.d[0] == quant_f16_to_f32(quant_f32_to_f16(3.0f / 127.0f)) && q.s[0] == sum,
          "Q8 act: amax/127 scale fp16-rounded, block sums", "q5 %d d %g s %d/%d", q.qs[5], q.d[0], q.s[0], sum);
}

/* quant_act_prepare gives the same bytes at every level, extremes included (the SIMD
 * preparations must find the same scale, signed max and rounding as the scalar ones). */
static void test_act_levels(void) {
    static const enum gguf_type kinds[] = { GGUF_TYPE_Q4_0, GGUF_TYPE_Q4_K, GGUF_TYPE_F16, GGUF_TYPE_BF16 };
    const int64_t n = 4096;
    float *x = plat_alloc(sizeof(float) * n);
    uint8_t *ref = plat_alloc_aligned(quant_act_bytes(GGUF_TYPE_F32, n)), *got = plat_alloc_aligned(quant_act_bytes(GGUF_TYPE_F32, n));
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        int bad = 0;
        for (int xm = X_RANDOM; xm <= X_NEGZERO + 2 && !bad; xm++) {
            fill_x(x, n, xm <= X_NEGZERO ? (enum xmode)xm : X_RANDOM);
            if (xm == X_NEGZERO + 1)   /* ties: equal magnitudes of both signs, the negative first */
                for (int64_t i = 0; i < n; i++) x[i] = (i % 3 ? 0.5f : -1.0f) * (i % 2 ? 1.0f : -1.0f);
            if (xm == X_NEGZERO + 2) { x[3] = INFINITY; x[300] = NAN; x[700] = -INFINITY; x[1000] = 1e-38f; }
            size_t bytes = quant_act_bytes(kinds[k], n);
            quant_set_level(QUANT_LEVEL_SCALAR);
            quant_act_prepare(kinds[k], x, n, ref);
            for (int l = QUANT_LEVEL_AVX2; l <= max_level && !bad; l++) {
                quant_set_level(l);
                quant_act_prepare(kinds[k], x, n, got);
                bad = memcmp(ref, got, bytes) ? xm + 1 : 0;
            }
        }
        char name[96];
        snprintf(name, sizeof name, "act for %s identical at every level", gguf_type_get(kinds[k])->name);
        check(!bad, name, "x mode %d differs", bad - 1);
    }
    free(x); free(ref); free(got);
}

/* ---- ops_matvec / ops_matmat ---- */
/* Attention over cached rows (fp32, fp16 and Q8_0 caches): every level gives the scalar bits,
 * for head sizes with and without a tail past the vectors, 1, 3, 4 and 8 heads at once (the
 * SIMD levels' tiles take 4 and 8), a last Q8_0 key group part full; and the order is the
 * documented one, checked against a rendering of its own: for float keys 16 partials, then
 * the butterfly; for Q8_0 keys the blocks' integer sums of the query quantised by quant_act_q8
 * against the row quantised the same way, each scaled by dk * dq, added in order; the values
 * one fused multiply-add a row, in order. Q8_0 values give what fp32 rows of the widened
 * values give. */
static void test_attention(void) {
    static const int hds[] = { 1, 15, 16, 17, 32, 64, 100, 128, 256 }, nqs[] = { 1, 3, 4, 8 };
    static const char *const kv_names[] = { "fp32", "fp16", "Q8_0" };
    /* value rows in two chunks of OPS_ATTN_CHUNK and a tail, Q8_0 keys in 4 groups and 11; the
     * float caches' rows 300 elements apart (no power of two), Q8_0's 320 (whole blocks) */
    enum { N = 75, STRIDE = 320 };
    float *q = plat_alloc(8 * 256 * sizeof(float)), *k = plat_alloc(N * STRIDE * sizeof(float));
    uint8_t *kc = plat_alloc((N + OPS_KV_GROUP) * STRIDE * 4), *vc = plat_alloc((N + OPS_KV_GROUP) * STRIDE * 4);
    uint8_t *qa = plat_alloc(256 + 256 / 32 * 12), *ka = plat_alloc(256 + 256 / 32 * 12);
    float *ref = plat_alloc(8 * (N + 256) * sizeof(float)), *got = plat_alloc(8 * (N + 256) * sizeof(float));
    int bad = 0, bad_order = 0, bad_values = 0;
    char why[200] = "";
    for (int kv = OPS_KV_F32; kv <= OPS_KV_Q8_0; kv++)
        for (size_t h = 0; h < sizeof hds / sizeof *hds; h++)
            for (size_t c = 0; c < sizeof nqs / sizeof *nqs; c++) {
                const int hd = hds[h], nq = nqs[c];
                const size_t cs = kv == OPS_KV_Q8_0 ? STRIDE : 300;
                if (kv == OPS_KV_Q8_0 && hd % 32) continue;
                const float *qs[8];
                float *rs[8], *gs[8], *ro[8], *go[8];
                for (int j = 0; j < nq; j++) {
                    qs[j] = q + j * 256;
                    rs[j] = ref + j * (N + 256); ro[j] = rs[j] + N;
                    gs[j] = got + j * (N + 256); go[j] = gs[j] + N;
                }
                fill_x(q, 8 * 256, X_RANDOM);
                fill_x(k, N * STRIDE, X_RANDOM);
                for (int p = 0; p < N; p++) { /* the same rows as keys and as values */
                    ops_kv_store(kc, cs, p, k + p * STRIDE, hd, (enum ops_kv)kv, 1);
                    ops_kv_store(vc, cs, p, k + p * STRIDE, hd, (enum ops_kv)kv, 0);
                }
                memset(ref, 0, 8 * (N + 256) * sizeof(float));
                memset(got, 0, 8 * (N + 256) * sizeof(float));
                for (int l = QUANT_LEVEL_SCALAR; l <= max_level; l++) {
                    quant_set_level(l);
                    float *const *sc = l == QUANT_LEVEL_SCALAR ? rs : gs, *const *o = l == QUANT_LEVEL_SCALAR ? ro : go;
                    for (int j = 0; j < nq; j++) memset(o[j], 0, (size_t)hd * sizeof(float));
                    ops_scores(qs, nq, kc, cs, N, hd, 0.125f, sc, (enum ops_kv)kv);
                    ops_attend((const float *const *)sc, nq, vc, cs, N, hd, o, (enum ops_kv)kv);
                    if (l > QUANT_LEVEL_SCALAR && memcmp(got, ref, 8 * (N + 256) * sizeof(float)) && !bad++)
                        snprintf(why, sizeof why, "%s cache, head size %d, %d heads: %s differs", kv_names[kv], hd, nq,
                                 quant_level_names[l]);
                }
                for (int j = 0; j < nq; j++) {
                    if (kv == OPS_KV_Q8_0) quant_act_q8(qs[j], hd, qa);
                    for (int p = 0; p < N; p++) {
                        float want;
                        if (kv == OPS_KV_Q8_0) {
                            quant_act_q8(k + p * STRIDE, hd, ka);
                            const float *dq = (const float *)(qa + hd), *dk = (const float *)(ka + hd);
                            float acc = 0.0f;
                            for (int b = 0; b < hd / 32; b++) {
                                int32_t isum = 0;
                                for (int i = 32 * b; i < 32 * b + 32; i++) isum += (int8_t)ka[i] * (int8_t)qa[i];
                                acc = acc + (dk[b] * dq[b]) * (float)isum;
                            }
                            want = acc * 0.125f;
                        } else {
                            float part[16] = {0};
                            for (int i = 0; i < hd; i++)
                                part[i % 16] += qs[j][i] * ops_kv_at(ops_kv_row(vc, cs, p, (enum ops_kv)kv), i, (enum ops_kv)kv);
                            for (int s2 = 8; s2 > 0; s2 /= 2)
                                for (int i = 0; i < s2; i++) part[i] += part[i + s2];
                            want = part[0] * 0.125f;
                        }
                        bad_order += memcmp(&want, &rs[j][p], 4) != 0;
                    }
                }
                for (int j = 0; j < nq; j++)
                    for (int i = 0; i < hd; i++) {
                        float want = 0.0f;
                        for (int p = 0; p < N; p++) want = fmaf(rs[j][p], ops_kv_at(ops_kv_row(vc, cs, p, (enum ops_kv)kv), i, (enum ops_kv)kv), want);
                        bad_order += memcmp(&want, &ro[j][i], 4) != 0;
                    }
                if (kv == OPS_KV_Q8_0) { /* the values again from fp32 rows of the widened values */
                    float *wide = (float *)kc;
                    for (int p = 0; p < N; p++)
                        for (int i = 0; i < hd; i++) wide[p * STRIDE + i] = ops_kv_at(ops_kv_row(vc, cs, p, OPS_KV_Q8_0), i, OPS_KV_Q8_0);
                    for (int j = 0; j < nq; j++) memset(go[j], 0, (size_t)hd * sizeof(float));
                    ops_attend((const float *const *)rs, nq, wide, STRIDE, N, hd, go, OPS_KV_F32);
                    for (int j = 0; j < nq; j++) bad_values += memcmp(go[j], ro[j], (size_t)hd * sizeof(float)) != 0;
                }
            }
    check(!bad_order, "attention scores and values (fp32, fp16 and Q8_0 caches): the documented order", "%d scores or values differ", bad_order);
    check(!bad, "attention scores and values (fp32, fp16 and Q8_0 caches): every level gives the scalar bits", "%s", why);
    check(!bad_values, "attention values from a Q8_0 cache: the sums of fp32 rows of its widened values", "%d heads differ", bad_values);
    free(q); free(k); free(kc); free(vc); free(qa); free(ka); free(ref); free(got);
}

/* Attention in splits (ops_attention) over contexts of one split, one and a row, and three with
 * a short last, fp32, fp16 and Q8_0 caches, 1, 4 and 8 heads: every level gives the scalar
 * bits; the scalar bits are those of a rendering of the documented order (each split's scores,
 * softmax and values by the kernels checked above, then the merge written out here); and the
 * result is one softmax over all the rows, computed in double, to within 3e-6 of the values'
 * largest magnitude (a merge that dropped a split's share or weighed it by the wrong maximum
 * is off by far more). */
static void test_attention_splits(void) {
    static const int ns[] = { OPS_ATTN_SPLIT, OPS_ATTN_SPLIT + 1, 2 * OPS_ATTN_SPLIT + 88 }, nqs[] = { 1, 4, 8 };
    enum { N = 2 * OPS_ATTN_SPLIT + 88, HD = 64, MAXQ = 8 };
    float *q = plat_alloc(MAXQ * HD * sizeof(float)), *rows = plat_alloc((size_t)N * HD * sizeof(float));
    uint8_t *kc = plat_alloc((N + OPS_KV_GROUP) * HD * 4), *vc = plat_alloc((N + OPS_KV_GROUP) * HD * 4);
    float *scratch = plat_alloc(2 * MAXQ * (N + HD) * sizeof(float)), *out = plat_alloc(3 * MAXQ * HD * sizeof(float));
    int bad_level = 0, bad_order = 0;
    double worst = 0;
    char why[200] = "";
    fill_x(q, MAXQ * HD, X_RANDOM);
    for (int i = 0; i < MAXQ * HD; i++) q[i] *= 4.0f; /* scores spread over several units, so the splits' maxima differ */
    fill_x(rows, N * HD, X_RANDOM);
    for (int kv = OPS_KV_F32; kv <= OPS_KV_Q8_0; kv++) {
        for (int p = 0; p < N; p++) {
            ops_kv_store(kc, HD, p, rows + p * HD, HD, (enum ops_kv)kv, 1);
            ops_kv_store(vc, HD, p, rows + (size_t)(N - 1 - p) * HD, HD, (enum ops_kv)kv, 0);
        }
        const size_t row = ops_kv_row_bytes(HD, (enum ops_kv)kv);
        for (size_t c = 0; c < sizeof ns / sizeof *ns; c++)
            for (size_t h = 0; h < sizeof nqs / sizeof *nqs; h++) {
                const int n = ns[c], nq = nqs[h];
                const float *qs[MAXQ];
                float *sc[MAXQ], *ref[MAXQ], *got[MAXQ], *ren[MAXQ];
                for (int j = 0; j < nq; j++) {
                    qs[j] = q + j * HD;
                    sc[j] = scratch + (size_t)j * (N + HD);
                    ref[j] = out + j * HD, got[j] = out + (MAXQ + j) * HD, ren[j] = out + (2 * MAXQ + j) * HD;
                }
                for (int l = QUANT_LEVEL_SCALAR; l <= max_level; l++) {
                    quant_set_level(l);
                    float *const *o = l == QUANT_LEVEL_SCALAR ? ref : got;
                    for (int j = 0; j < nq; j++) memset(o[j], 0, HD * sizeof(float));
                    ops_attention(qs, nq, kc, vc, n, HD, 0.125f, sc, o, (enum ops_kv)kv);
                    for (int j = 0; l > QUANT_LEVEL_SCALAR && j < nq; j++)
                        if (memcmp(got[j], ref[j], HD * sizeof(float)) && !bad_level++)
                            snprintf(why, sizeof why, "%d rows, %d heads, cache %d: %s differs", n, nq, kv, quant_level_names[l]);
                }
                quant_set_level(QUANT_LEVEL_SCALAR);
                for (int j = 0; j < nq; j++) { /* the documented order, one head at a time */
                    float *s = scratch + (size_t)(MAXQ + j) * (N + HD), m = 0, part[HD];
                    double total = 0;
                    for (int p0 = 0; p0 < n; p0 += OPS_ATTN_SPLIT) {
                        const int k = n - p0 < OPS_ATTN_SPLIT ? n - p0 : OPS_ATTN_SPLIT;
                        double sum_c;
                        float *oc = p0 ? part : ren[j];
                        memset(oc, 0, HD * sizeof(float));
                        ops_scores(&qs[j], 1, kc + p0 * row, HD, k, HD, 0.125f, &s, (enum ops_kv)kv);
                        const float m_c = ops_softmax(s, k, &sum_c);
                        ops_attend((const float *const *)&s, 1, vc + p0 * row, HD, k, HD, &oc, (enum ops_kv)kv);
                        if (!p0) { m = m_c, total = sum_c; continue; }
                        const float mn = m_c > m ? m_c : m;
                        const double a = (double)ops_exp(m - mn) * total, b = (double)ops_exp(m_c - mn) * sum_c;
                        for (int i = 0; i < HD; i++) ren[j][i] = fmaf((float)(b / (a + b)), part[i], (float)(a / (a + b)) * ren[j][i]);
                        m = mn, total = a + b;
                    }
                    bad_order += memcmp(ren[j], ref[j], HD * sizeof(float)) != 0;
                }
                for (int j = 0; kv != OPS_KV_Q8_0 && j < nq; j++) { /* one softmax over all n rows, in double */
                    double sd[N], mx = -INFINITY, z = 0, vmax = 0;
                    for (int p = 0; p < n; p++) {
                        const void *kr = ops_kv_row(kc, HD, p, (enum ops_kv)kv);
                        double dot = 0;
                        for (int i = 0; i < HD; i++) dot += (double)qs[j][i] * ops_kv_at(kr, i, (enum ops_kv)kv);
                        sd[p] = dot * 0.125;
                        mx = fmax(mx, sd[p]);
                    }
                    for (int p = 0; p < n; p++) z += sd[p] = exp(sd[p] - mx);
                    for (int i = 0; i < HD; i++) {
                        double want = 0;
                        for (int p = 0; p < n; p++) {
                            const double v = ops_kv_at(ops_kv_row(vc, HD, p, (enum ops_kv)kv), i, (enum ops_kv)kv);
                            want += sd[p] / z * v;
                            vmax = fmax(vmax, fabs(v));
                        }
                        worst = fmax(worst, fabs(want - ref[j][i]) / vmax);
                    }
                }
            }
    }
    check(!bad_level, "attention in splits: every level gives the scalar bits", "%s", why);
    check(!bad_order, "attention in splits: each split's softmax and values, merged in order as documented", "%d heads differ", bad_order);
    check(worst < 3e-6, "attention in splits: one softmax over all the rows (fp32 and fp16 caches, within 3e-6 of the values)", "worst %.3g", worst);
    free(q); free(rows); free(kc); free(vc); free(scratch); free(out);
}

/* Softmax at every level against a rendering of its documented order (the maximum, ops_exp,
 * 16 strided partials in double, the butterfly, one scale), on lengths with and without a tail
 * past the vectors and values at the edges: -inf, a NaN first or later, scores far below the
 * maximum (e^x is 0). A partial that takes a lane's values twice or skips one shows here; the
 * order of the double sum itself rarely shows after the division to float. */
static void test_softmax(void) {
    static const int ns[] = { 1, 5, 16, 17, 50, 100, 4099 };
    enum { N = 4099 };
    float *x = plat_alloc(N * sizeof(float)), *want = plat_alloc(N * sizeof(float)), *got = plat_alloc(N * sizeof(float));
    int bad = 0;
    char why[200] = "";
    for (int edge = 0; edge < 4; edge++)
        for (size_t c = 0; c < sizeof ns / sizeof *ns; c++) {
            const int n = ns[c];
            fill_x(x, n, X_RANDOM);
            for (int i = 0; i < n; i++) x[i] *= (float)(i % 150);
            if (edge == 1) for (int i = 1; i < n; i += 7) x[i] = -INFINITY;
            if (edge == 2) x[n / 2] = NAN;
            if (edge == 3) x[0] = NAN;
            float max = x[0];
            for (int i = 1; i < n; i++) max = x[i] > max ? x[i] : max;
            double part[16] = {0};
            for (int i = 0; i < n; i++) { want[i] = ops_exp(x[i] - max); part[i % 16] += want[i]; }
            for (int s2 = 8; s2 > 0; s2 /= 2)
                for (int j = 0; j < s2; j++) part[j] += part[j + s2];
            const float inv = (float)(1.0 / part[0]);
            for (int i = 0; i < n; i++) want[i] *= inv;
            for (int l = QUANT_LEVEL_SCALAR; l <= max_level; l++) {
                quant_set_level(l);
                memcpy(got, x, n * sizeof(float));
                double sum;
                const float got_max = ops_softmax(got, n, &sum);
                if ((memcmp(got, want, n * sizeof(float)) || memcmp(&got_max, &max, 4) || memcmp(&sum, &part[0], 8)) && !bad++)
                    snprintf(why, sizeof why, "%d values, edge case %d: %s differs", n, edge, quant_level_names[l]);
            }
        }
    check(!bad, "softmax: every level gives the documented order's bits, its maximum and sum", "%s", why);
    free(x); free(want); free(got);
}

/* The norms' sums of squares at every level against a rendering of their documented order
 * (x[i]^2 in double into partial i % 16, the butterfly), compared as doubles, so any other
 * order shows: the values span 2^-20..2^20, where a double sum's rounding depends on its
 * order. Lengths with and without a tail past the vectors; then RMSNorm (with and without
 * weights) and the L2 norm on that sum. */
static void test_norms(void) {
    static const int ns[] = { 1, 5, 16, 17, 128, 2048, 4099 };
    enum { N = 4099 };
    float *x = plat_alloc(N * sizeof(float)), *w = plat_alloc(N * sizeof(float)), *want = plat_alloc(N * sizeof(float));
    float *got = plat_alloc(N * sizeof(float));
    int bad = 0;
    char why[200] = "";
    fill_x(w, N, X_RANDOM);
    for (size_t c = 0; c < sizeof ns / sizeof *ns; c++) {
        const int n = ns[c];
        fill_x(x, n, X_RANDOM);
        for (int i = 0; i < n; i++) x[i] = ldexpf(x[i], (int)(rng_u64() % 41) - 20);
        double part[16] = {0};
        for (int i = 0; i < n; i++) part[i % 16] += (double)x[i] * x[i];
        for (int s2 = 8; s2 > 0; s2 /= 2)
            for (int j = 0; j < s2; j++) part[j] += part[j + s2];
        const float scale = 1.0f / sqrtf((float)(part[0] / n) + 1e-6f), norm = sqrtf((float)part[0]);
        for (int l = QUANT_LEVEL_SCALAR; l <= max_level; l++) {
            quant_set_level(l);
            const double sum = ops_sum_squares(x, n);
            if (memcmp(&sum, &part[0], sizeof sum) && !bad++)
                snprintf(why, sizeof why, "%d values: %s sums %a, not %a", n, quant_level_names[l], sum, part[0]);
            for (int weighted = 0; weighted < 2; weighted++) {
                for (int i = 0; i < n; i++) want[i] = weighted ? x[i] * scale * w[i] : x[i] * scale;
                ops_rmsnorm(got, x, weighted ? w : NULL, n, 1e-6f);
                if (memcmp(got, want, n * sizeof(float)) && !bad++)
                    snprintf(why, sizeof why, "%d values: %s RMSNorm (weights %d) differs", n, quant_level_names[l], weighted);
            }
            for (int i = 0; i < n; i++) want[i] = x[i] * (1.0f / (norm > 1e-6f ? norm : 1e-6f));
            memcpy(got, x, n * sizeof(float));
            ops_l2norm(got, n, 1e-6f);
            if (memcmp(got, want, n * sizeof(float)) && !bad++)
                snprintf(why, sizeof why, "%d values: %s L2 norm differs", n, quant_level_names[l]);
        }
    }
    check(!bad, "norms: every level sums the squares in the documented order", "%s", why);
    free(x); free(w); free(want); free(got);
}

/* coli's own ln, ln(1 + y), e^x and sin/cos (§4: the same bits on every libc and a device)
 * against this build's libm in double: within 2 units in the last place (relative 4.5e-16;
 * sin/cos absolute 2.3e-16, angles up to 2^20), on random arguments across their ranges. Then
 * what the forward pass makes of them: softplus equals ln(1 + e^x) computed by libm in double
 * and rounded (a 1.8e9-value sweep matched everywhere; libm's log1pf differed in 0.7%), and
 * RoPE's table stays within 2e-7 of libm's cos/sin of pos * pow(base, -2j/d). */
static void test_own_libm(void) {
    double worst[4] = {0};
    for (int i = 0; i < 200000; i++) {
        const double u = (double)(rng_u64() >> 11) / 9007199254740992.0, x = (2 * u - 1) * 700;
        const double z = exp((2 * u - 1) * 600), y = exp((2 * u - 1) * 40), t = u * 1647099.0;
        const float yf = (float)y;
        double sn, cs;
        ops_sincos(t, &sn, &cs);
        const double err[4] = { fabs(ops_exp_double(x) - exp(x)) / exp(x), fabs(ops_ln(z) - log(z)) / fmax(fabs(log(z)), 1e-300),
                                fabs(ops_log1p(yf) - log1p((double)yf)) / log1p((double)yf), fmax(fabs(sn - sin(t)), fabs(cs - cos(t))) };
        for (int k = 0; k < 4; k++) worst[k] = fmax(worst[k], err[k]);
    }
    check(worst[0] <= 4.5e-16 && worst[1] <= 4.5e-16 && worst[2] <= 4.5e-16 && worst[3] <= 2.3e-16,
          "own exp, ln, log1p, sin/cos: within 2 ulps of libm's double", "worst %.3g %.3g %.3g %.3g", worst[0], worst[1], worst[2], worst[3]);
    int differ = 0;
    for (int i = 0; i < 1000000; i++) {
        const float x = -110.0f + 131.0f * (float)(rng_u64() >> 40) / 16777216.0f;
        const float want = x > 20.0f ? x : (float)log1p((double)ops_exp(x));
        differ += memcmp(&want, &(float){ops_softplus(x)}, 4) != 0;
    }
    check(!differ, "softplus: libm's ln(1 + e^x) in double, rounded", "%d of 1000000 differ", differ);
    struct model_config c = {0};
    float table[64], far = 0.0f;
    differ = 0;
    c.rope_dims = 64;
    c.rope_base = 10000000.0f;
    for (int pos = 0; pos < 262144; pos += 61) {
        model_rope_table(&c, pos, table);
        for (int j = 0; j < 32; j++) {
            const double theta = pos * pow((double)c.rope_base, -2.0 * j / c.rope_dims);
            const float want[2] = { (float)cos(theta), (float)sin(theta) };
            for (int k = 0; k < 2; k++) {
                differ += want[k] != table[32 * k + j];
                far = fmaxf(far, fabsf(want[k] - table[32 * k + j]));
            }
        }
    }
    check(far <= 2e-7f && differ < 100, "RoPE table: libm's cos/sin of the same angles but for a rare last bit", "%d differ, by up to %g", differ, far);
}

/* The KV cache's fp16 rows as the attention kernels widen them, at every level: a value row
 * times a weight of 1 added to 0 is the row itself (a -0 becomes +0, as it does in the scalar
 * sum), so quant_f16_to_f32's bits must come out for every pattern the cache can hold, with
 * rows of 256 and of 255 (a tail past the vectors). Signalling NaNs are left out: F16C quiets
 * them and the scalar keeps them, but quant_f32_to_f16, which fills the cache, never makes one. */
static void test_widen_f16(void) {
    enum { N = 65536 };
    uint16_t *h = plat_alloc(N * sizeof *h);
    float *got = plat_alloc(256 * sizeof *got), one = 1.0f;
    int bad = 0;
    char why[160] = "";
    for (int i = 0; i < N; i++) h[i] = (i & 0x7c00) == 0x7c00 && (i & 0x3ff) && !(i & 0x200) ? 0x7e00 : (uint16_t)i;
    const float *w[1] = { &one };
    float *o[1] = { got };
    for (int l = QUANT_LEVEL_SCALAR; l <= max_level; l++) {
        quant_set_level(l);
        for (int hd = 255; hd <= 256; hd++)
            for (int r = 0; r + hd <= N; r += hd) {
                memset(got, 0, 256 * sizeof *got);
                ops_attend(w, 1, h + r, (size_t)hd, 1, hd, o, OPS_KV_F16);
                for (int i = 0; i < hd; i++) {
                    const float want = 0.0f + quant_f16_to_f32(h[r + i]);
                    if (memcmp(&want, &got[i], 4) && !bad++)
                        snprintf(why, sizeof why, "%s: 0x%04x gives %a, not %a", quant_level_names[l], h[r + i], got[i], want);
                }
            }
    }
    check(!bad, "fp16 cache rows: every level widens them to quant_f16_to_f32's bits", "%s", why);
    free(h); free(got);
}

/* The gated delta rule at every level against the plain serial row loop (state [dk][dv]),
 * token by token, on shapes with vector tails and runs of 1 and 3 tokens (one call for the
 * run, each token's second pass and the next one's first as one): the same bits. */
static void test_delta_rule(void) {
    static const int shapes[][2] = { {128, 128}, {16, 16}, {32, 48}, {7, 21}, {64, 200} };
    enum { TOKENS = 3 };
    const float beta[TOKENS] = {0.3f, 0.7f, 0.55f}, decay[TOKENS] = {0.9f, 0.97f, 0.6f};
    int bad = 0, bad_order = 0;
    char why[160] = "";
    for (size_t c = 0; c < sizeof shapes / sizeof *shapes; c++)
        for (int n = 1; n <= TOKENS; n += TOKENS - 1) {
            const int dk = shapes[c][0], dv = shapes[c][1], stride = 2 * dk + dv + 5;
            float *s0 = plat_alloc((size_t)dk * dv * sizeof(float)), *s = plat_alloc((size_t)dk * dv * sizeof(float));
            float *x = plat_alloc((size_t)n * stride * sizeof(float)), *ref = plat_alloc((size_t)dk * dv * sizeof(float));
            float *want = plat_alloc((size_t)n * dv * sizeof(float)), *out = plat_alloc((size_t)n * dv * sizeof(float));
            fill_x(s0, dk * dv, X_RANDOM);
            fill_x(x, n * stride, X_RANDOM);
            memcpy(ref, s0, (size_t)dk * dv * sizeof(float));
            for (int t = 0; t < n; t++) {
                const float *q = x + t * stride, *k = q + dk, *v = k + dk;
                for (int j = 0; j < dv; j++) {
                    float pred = 0, o = 0;
                    for (int i = 0; i < dk; i++) { ref[i * dv + j] *= decay[t]; pred += ref[i * dv + j] * k[i]; }
                    const float delta = beta[t] * (v[j] - pred);
                    for (int i = 0; i < dk; i++) { ref[i * dv + j] += k[i] * delta; o += ref[i * dv + j] * q[i]; }
                    want[t * dv + j] = o;
                }
            }
            const struct ops_delta_tokens a = {x, x + dk, x + 2 * dk, beta, decay, (size_t)stride, (size_t)dv, out, n};
            for (int l = QUANT_LEVEL_SCALAR; l <= max_level; l++) {
                quant_set_level(l);
                memcpy(s, s0, (size_t)dk * dv * sizeof(float));
                ops_delta_rule(s, dk, dv, &a);
                const int differs = memcmp(out, want, (size_t)n * dv * sizeof(float)) || memcmp(s, ref, (size_t)dk * dv * sizeof(float));
                if (l == QUANT_LEVEL_SCALAR) bad_order += differs;
                else if (differs && !bad++)
                    snprintf(why, sizeof why, "dk %d, dv %d, %d tokens: %s differs", dk, dv, n, quant_level_names[l]);
            }
            free(s0); free(s); free(x); free(ref); free(want); free(out);
        }
    check(!bad_order, "delta rule: each row's dots are serial sums, the state i-major, a run's tokens in turn", "%d cases differ", bad_order);
    check(!bad, "delta rule: every level gives the scalar bits", "%s", why);
}

/* ops_swiglu and the sigmoid gate at every level against ops_silu and ops_sigmoid value by
 * value, over random values and the edges of ops_exp (its cut-offs at 88.8 and -104,
 * infinities, NaN, subnormals, -0). */
static void test_swiglu(void) {
    enum { N = 4099 };
    float *g = plat_alloc(N * sizeof(float)), *u = plat_alloc(N * sizeof(float)), *got = plat_alloc(N * sizeof(float));
    const float edges[] = { 0.0f, -0.0f, 88.8f, -88.8f, 88.79999f, -88.80001f, 104.0f, -104.0f, 103.99999f, 104.00001f,
                            INFINITY, -INFINITY, NAN, 1e-40f, -1e-40f, 1e-30f, 20.0f, -20.0f, 0.5f, -0.5f };
    fill_x(g, N, X_RANDOM);
    fill_x(u, N, X_RANDOM);
    for (int i = 0; i < N; i++) g[i] *= (float)(i % 200);
    memcpy(g, edges, sizeof edges);
    int bad = 0;
    char why[160] = "";
    for (int l = QUANT_LEVEL_AVX2; l <= max_level; l++) {
        quant_set_level(l);
        for (int mode = 0; mode < 3; mode++) { /* silu, silu * u, u * sigmoid into u (the attention gate) */
            memcpy(got, mode == 2 ? u : g, N * sizeof(float));
            if (mode == 2) ops_gate(got, g, got, N, 1);
            else ops_swiglu(got, mode ? u : NULL, N);
            for (int i = 0; i < N; i++) {
                const float want = mode == 2 ? ops_sigmoid(g[i]) * u[i] : mode ? ops_silu(g[i]) * u[i] : ops_silu(g[i]);
                /* a NaN's sign is no part of the contract: the same scalar ops_sigmoid gave +NaN
                 * inlined here and -NaN called on its own */
                const int same = isnan(want) ? isnan(got[i]) : !memcmp(&want, &got[i], 4);
                if (!same && !bad++)
                    snprintf(why, sizeof why, "%s: %s(%a)%s = %a, not %a", quant_level_names[l], mode == 2 ? "sigmoid" : "silu", g[i],
                             mode ? " * u" : "", got[i], want);
            }
        }
    }
    check(!bad, "silu / SwiGLU / sigmoid gate: every level gives ops_silu's and ops_sigmoid's bits", "%s", why);
    free(g); free(u); free(got);
}

static void test_ops(void) {
    quant_set_level(max_level);
    const int rows = 37, ncol = 5;
    for (int ti = 0; ti < N_TYPES; ti++) {
        enum gguf_type t = all_types[ti];
        const struct gguf_type_info *inf = gguf_type_get(t);
        int64_t cols = inf->block_elems == 256 ? 768 : 544;
        size_t rb = (size_t)(cols / inf->block_elems * inf->block_bytes);
        uint8_t *w = plat_alloc(rb * rows);
        for (int r = 0; r < rows; r++) fill_weights(t, w + r * rb, cols, W_RANDOM);
        struct ops_matrix m = { t, w, rows, cols, rb, 0 };
        float *x = plat_alloc(sizeof(float) * cols * ncol);
        float *y1 = plat_alloc(sizeof(float) * rows * ncol), *y2 = plat_alloc(sizeof(float) * rows * ncol);
        float *yv = plat_alloc(sizeof(float) * rows), *yv2 = plat_alloc(sizeof(float) * rows);
        fill_x(x, cols * ncol, X_RANDOM);
        int bad_mm = 0, bad_thr = 0;
        for (int th = 1; th <= 2; th++) {
            omp_set_num_threads(th);
            ops_matmat(&m, x, th == 1 ? y1 : y2, ncol);
            for (int j = 0; j < ncol; j++) {
                ops_matvec(&m, x + j * cols, yv);
                if (memcmp(yv, (th == 1 ? y1 : y2) + j * rows, sizeof(float) * rows)) bad_mm++;
                if (th == 2) {
                    omp_set_num_threads(1);
                    ops_matvec(&m, x + j * cols, yv2);
                    omp_set_num_threads(2);
                    if (memcmp(yv, yv2, sizeof(float) * rows)) bad_thr++;
                }
            }
        }
        char name[96];
        snprintf(name, sizeof name, "%s matmat == matvec per column (1 and 2 threads)", inf->name);
        check(!bad_mm, name, "%d columns differ", bad_mm);
        snprintf(name, sizeof name, "%s matvec identical on 1 and 2 threads", inf->name);
        check(!bad_thr && !memcmp(y1, y2, sizeof(float) * rows * ncol), name, "%d columns differ", bad_thr);
        free(w); free(x); free(y1); free(y2); free(yv); free(yv2);
    }
}

/* A random matrix of TYPE (every MAX_EVERY-th row W_MAX, the one after it W_FULL) and MAXC random
 * columns, prepared, but for columns 3 and 4: X_ONES and X_MINUS_ONES. */
struct matmat_case {
    struct ops_matrix m;
    float *x, *y;
    float *ref; /* the scalar dot of column j and row r at j * rows + r (matmat_case_refs) */
    uint8_t *act;
    size_t stride;
    int maxc;
};

/* C's reference results, once for all its columns: one per column count tried made the sanitizer run slow. */
static void matmat_case_refs(struct matmat_case *c) {
    const struct ops_matrix *m = &c->m;
    for (int j = 0; j < c->maxc; j++)
        for (int r = 0; r < m->rows; r++)
            c->ref[(size_t)j * m->rows + r] = dot_at(QUANT_LEVEL_SCALAR, m->type, m->data + r * m->row_bytes, c->act + j * c->stride, m->cols);
}

static struct matmat_case matmat_case_new(enum gguf_type t, int rows, int64_t cols, int maxc, int max_every) {
    const struct gguf_type_info *inf = gguf_type_get(t);
    size_t rb = (size_t)(cols / inf->block_elems * inf->block_bytes);
    uint8_t *w = plat_alloc(rb * rows);
    for (int r = 0; r < rows; r++)
        fill_weights(t, w + r * rb, cols, r % max_every == 0 ? W_MAX : r % max_every == 1 ? W_FULL : W_RANDOM);
    struct matmat_case c = { { t, w, rows, cols, rb, 0 }, plat_alloc(sizeof(float) * cols * maxc), plat_alloc(sizeof(float) * rows * maxc),
                             plat_alloc(sizeof(float) * rows * maxc), NULL, 0, maxc };
    fill_x(c.x, cols * maxc, X_RANDOM);
    for (int j = 3; j < 5 && j < maxc; j++) fill_x(c.x + (size_t)j * cols, cols, j == 3 ? X_ONES : X_MINUS_ONES);
    c.stride = ops_act_stride(&c.m);
    c.act = plat_alloc_aligned(c.stride * maxc);
    for (int j = 0; j < maxc; j++) quant_act_prepare(t, c.x + (size_t)j * cols, cols, c.act + j * c.stride);
    matmat_case_refs(&c);
    return c;
}

/* How many outputs of ops_matmat over NC columns at LEVEL differ from the scalar dot. */
static int matmat_wrong_at(struct matmat_case *c, int level, int nc) {
    const struct ops_matrix *m = &c->m;
    int bad = 0;
    quant_set_level(level);
    ops_matmat(m, c->x, c->y, nc);
    for (size_t at = 0; at < (size_t)nc * m->rows; at++) bad += memcmp(&c->ref[at], &c->y[at], 4) != 0;
    return bad;
}

static int matmat_wrong(struct matmat_case *c, int nc) { return matmat_wrong_at(c, max_level, nc); }

static void matmat_case_free(struct matmat_case *c) {
    free((void *)c->m.data); free(c->x); free(c->y); free(c->ref); free(c->act);
}

/* Multi-column kernels: ops_matmat at the best level against the scalar dot of every column, for
 * 1..64 columns (every pass split of QUANT_NCOL, and quant_tile's from where it starts on), an
 * odd row count and rows with tails (legacy blocks not a multiple of 16, K units not a multiple
 * of 4). */
static void test_matmat_columns(void) {
    const int maxc = 64;
    for (int ti = 0; ti < N_TYPES; ti++) {
        enum gguf_type t = all_types[ti];
        const struct gguf_type_info *inf = gguf_type_get(t);
        struct matmat_case c = matmat_case_new(t, 19, inf->block_elems == 256 ? 1280 : inf->block_elems == 32 ? 1056 : 1000, maxc, 7);
        int first = 0;
        for (int nc = 1; nc <= maxc && !first; nc++)
            if (matmat_wrong(&c, nc)) first = nc;
        char name[96];
        snprintf(name, sizeof name, "%s matmat of 1..64 columns == scalar dot", inf->name);
        check(!first, name, "first wrong at %d columns", first);
        matmat_case_free(&c);
    }
}

/* Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, IQ4_NL and MXFP4 rows of more than 32 super-blocks through quant_tile (3 tiles
 * of 16 rows, from the columns where the tiles start and 5 more, on 1 and 2 threads: each thread its
 * own scratch): every partial of the canonical order in use, one of them twice (K), or several times. */
static void test_tile_long_rows(void) {
    const enum gguf_type types[] = { GGUF_TYPE_Q4_K, GGUF_TYPE_Q5_K, GGUF_TYPE_Q6_K, GGUF_TYPE_Q8_0, GGUF_TYPE_Q4_0, GGUF_TYPE_IQ4_NL,
                                     GGUF_TYPE_MXFP4 };
    for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
        const enum gguf_type t = types[ti];
        const int from = t == GGUF_TYPE_Q6_K ? QUANT_TILE_MIN_NC_Q6K
                         : t == GGUF_TYPE_Q4_K || t == GGUF_TYPE_Q5_K ? QUANT_TILE_MIN_NC_K : QUANT_TILE_MIN_NC_LEGACY;
        struct matmat_case c = matmat_case_new(types[ti], 48, 33 * 256, from + 5, 5);
        int bad = 0;
        for (int k = 0; k < 4; k++) {
            omp_set_num_threads(1 + k / 2);
            bad += matmat_wrong(&c, from + 5 * (k % 2));
        }
        omp_set_num_threads(2);
        char name[112];
        snprintf(name, sizeof name, "%s tiles: rows of 33 super-blocks, %d and %d columns, 1 and 2 threads == scalar dot",
                 gguf_type_get(types[ti])->name, from, from + 5);
        check(!bad, name, "%d outputs differ", bad);
        matmat_case_free(&c);
    }
}

/* The AVX2 tiles (Q4_K, Q5_K, Q6_K, Q4_0), and where the CPU has AVX-VNNI its tiles (Q4_K,
 * Q5_K, Q4_0, Q8_0, IQ4_NL, MXFP4: the steps by vpdpbusd into int32, a vpmulld by each K
 * scale), rows of 2 and of 9 super-blocks (16 rows to a tile, 3 left), from the columns where
 * they start, past a pass of 4, on 1 and 2 threads, against the scalar dot. */
static void test_avx2_tiles(void) {
    const enum gguf_type types[] = { GGUF_TYPE_Q4_K, GGUF_TYPE_Q5_K, GGUF_TYPE_Q6_K, GGUF_TYPE_Q4_0,
                                     GGUF_TYPE_Q8_0, GGUF_TYPE_IQ4_NL, GGUF_TYPE_MXFP4 };
    const int columns[] = { QUANT_AVX2_TILE_MIN_NC, QUANT_AVX2_TILE_MIN_NC_LONG_K + 1, QUANT_TILE_MIN_NC_LEGACY + 5 };
    if (max_level < QUANT_LEVEL_AVX2) {
        printf("ok - AVX2 tiles # SKIP: this CPU has no AVX2\n");
        n_pass++;
        return;
    }
    const int has_vnni = plat_cpu.avxvnni;
    for (int vnni = 0; vnni <= has_vnni; vnni++)
        for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
            const int only_vnni = types[ti] == GGUF_TYPE_Q8_0 || types[ti] == GGUF_TYPE_IQ4_NL || types[ti] == GGUF_TYPE_MXFP4;
            if (vnni ? types[ti] == GGUF_TYPE_Q6_K : only_vnni) continue; /* no VNNI tile of Q6_K; these three have no other */
            for (int units = 2; units <= 9; units += 7) {
                struct matmat_case c = matmat_case_new(types[ti], 19, (int64_t)units * QUANT_QK_K, QUANT_TILE_MIN_NC_LEGACY + 5, 5);
                int bad = 0;
                plat_cpu.avxvnni = vnni;
                for (int k = 0; k < 6; k++) {
                    omp_set_num_threads(1 + k % 2);
                    bad += matmat_wrong_at(&c, QUANT_LEVEL_AVX2, columns[k / 2]);
                }
                plat_cpu.avxvnni = has_vnni;
                omp_set_num_threads(2);
                char name[128];
                snprintf(name, sizeof name, "%s AVX2 tiles%s: rows of %d super-blocks, %d, %d and %d columns == scalar dot",
                         gguf_type_get(types[ti])->name, vnni ? " by AVX-VNNI" : "", units, columns[0], columns[1], columns[2]);
                check(!bad, name, "%d outputs differ", bad);
                matmat_case_free(&c);
            }
        }
    quant_set_level(QUANT_LEVEL_AVX2);
    check(quant_tile_ok(GGUF_TYPE_Q8_0, QUANT_TILE_MIN_NC_LEGACY, QUANT_QK_K) == has_vnni && quant_tile_ok(GGUF_TYPE_MXFP4, QUANT_TILE_MIN_NC_LEGACY, QUANT_QK_K) == has_vnni &&
              quant_tile_ok(GGUF_TYPE_IQ4_NL, QUANT_TILE_MIN_NC_LEGACY, QUANT_QK_K) == has_vnni && quant_tile_ok(GGUF_TYPE_Q4_0, QUANT_TILE_MIN_NC_LEGACY, QUANT_QK_K),
          "AVX2 tiles: Q8_0, IQ4_NL and MXFP4 by AVX-VNNI only, Q4_0 always", "avxvnni %d", has_vnni);
}

/* Interleaved Q4_K, Q5_K, Q6_K, Q2_K, Q3_K and IQ4_XS, and at the avx512vbmi level IQ3_XXS and
 * IQ3_S (quant_interleave, as §8 model_own_trunk makes the trunk's), each by the kernel of every
 * level that interleaves it (AVX2 with AVX-VNNI: all but Q5_K and IQ3): ops_matmat on the interleaved
 * copy against the scalar dot of each original row, for rows of 1, 8 and 33 super-blocks (33:
 * past the 32 partials, and the d bytes of Q3_K, Q6_K and IQ3 for an odd number of units, their
 * vectors then off the 64-byte grid), 16 and 48 rows, 1..5, 9, 17 and 34 columns (every
 * remainder of the kernels' passes of 4; 34, on rows that keep operands for the later passes),
 * 1 and 2 threads, with the special weight and activation modes. */
/* At LEVEL (an AVX-512 one), quant_interleave's transposes write the bytes of its reference, the
 * dword-by-dword copy, for each of the N TYPES it takes there: 48 rows of 1 and 3 super-blocks. */
static void test_interleave_bytes(const enum gguf_type *types, int n, int level) {
    if (level < QUANT_LEVEL_AVX512) {
        printf("ok - interleave by transposes == dword by dword # SKIP no AVX-512 on this CPU\n");
        n_pass++;
        return;
    }
    quant_set_level(level);
    int bad = 0;
    char why[160] = "";
    for (int ti = 0; ti < n && !bad; ti++)
        for (int units = 1; units <= 3 && quant_interleave_ok(types[ti], QUANT_TILE_ROWS) && !bad; units += 2) {
            const size_t rb = (size_t)units * gguf_type_get(types[ti])->block_bytes, bytes = rb * 48;
            uint8_t *src = plat_alloc_aligned(bytes), *fast = plat_alloc_aligned(bytes), *ref = plat_alloc_aligned(bytes);
            uint64_t rng = 0x1234 + (uint64_t)ti;
            for (size_t i = 0; i < bytes; i++) src[i] = (uint8_t)(sample_next_u64(&rng) >> 56);
            memset(fast, 0xa5, bytes);
            memset(ref, 0x5a, bytes);
            quant_interleave(types[ti], fast, src, rb, 48);
            quant_interleave_groups_scalar(types[ti], ref, src, rb, 0, 3);
            if (memcmp(fast, ref, bytes))
                snprintf(why, sizeof why, "%s, %d super-blocks a row", gguf_type_get(types[ti])->name, units), bad = 1;
            free(src), free(fast), free(ref);
        }
    check(!bad, "interleave by transposes (quant_interleave at avx512) == dword by dword, every interleaved type", "%s", why);
}

static void test_interleaved(void) {
    quant_set_level(max_level);
    if (!quant_interleave_ok(GGUF_TYPE_Q4_K, QUANT_TILE_ROWS)) {
        printf("ok - interleaved Q4_K, Q5_K, Q6_K, Q2_K, Q3_K and IQ4_XS # SKIP no AVX-VNNI or AVX-512 VNNI on this CPU\n");
        n_pass++;
        return;
    }
    int sizes_ok = 1;
    for (size_t i = 0; i < sizeof quant_kernels / sizeof quant_kernels[0]; i++)
        if (quant_interleave_ok(quant_kernels[i].type, QUANT_TILE_ROWS))
            sizes_ok &= quant_interleaved_block_bytes(quant_kernels[i].type) == gguf_type_get(quant_kernels[i].type)->block_bytes;
    check(sizes_ok, "interleaved: the passes' block sizes are the formats'", "quant_interleaved_block_bytes disagrees with gguf_types");
    check(!quant_interleave_ok(GGUF_TYPE_Q4_K, QUANT_TILE_ROWS + 8) && !quant_interleave_ok(GGUF_TYPE_Q8_0, QUANT_TILE_ROWS),
          "interleaved: Q4_K, Q5_K, Q6_K, Q2_K, Q3_K and IQ4_XS in whole groups of 16 rows only", "another type or row count accepted");
    quant_set_level(QUANT_LEVEL_AVX2);
    check(quant_interleave_ok(GGUF_TYPE_Q4_K, QUANT_TILE_ROWS) == plat_cpu.avxvnni && quant_interleave_ok(GGUF_TYPE_Q2_K, QUANT_TILE_ROWS) == plat_cpu.avxvnni &&
              quant_interleave_ok(GGUF_TYPE_Q3_K, QUANT_TILE_ROWS) == plat_cpu.avxvnni && quant_interleave_ok(GGUF_TYPE_Q6_K, QUANT_TILE_ROWS) == plat_cpu.avxvnni &&
              quant_interleave_ok(GGUF_TYPE_IQ4_XS, QUANT_TILE_ROWS) == plat_cpu.avxvnni && !quant_interleave_ok(GGUF_TYPE_Q5_K, QUANT_TILE_ROWS),
          "interleaved at avx2: Q4_K, Q2_K, Q3_K, Q6_K and IQ4_XS, with AVX-VNNI", "another set of types");
    if (max_level >= QUANT_LEVEL_AVX512) {
        quant_set_level(QUANT_LEVEL_AVX512);
        check(!quant_interleave_ok(GGUF_TYPE_IQ3_XXS, QUANT_TILE_ROWS) && !quant_interleave_ok(GGUF_TYPE_IQ3_S, QUANT_TILE_ROWS),
              "interleaved: IQ3_XXS and IQ3_S not below the avx512vbmi level", "accepted at avx512");
    }
    static const enum gguf_type types[] = { GGUF_TYPE_Q4_K, GGUF_TYPE_Q5_K, GGUF_TYPE_Q6_K, GGUF_TYPE_Q2_K, GGUF_TYPE_Q3_K, GGUF_TYPE_IQ4_XS,
                                            GGUF_TYPE_IQ3_XXS, GGUF_TYPE_IQ3_S };
    test_interleave_bytes(types, (int)(sizeof types / sizeof *types), max_level);
    static const int units[] = { 1, 8, 33 }, row_counts[] = { 16, 48 }, columns[] = { 1, 2, 3, 4, 5, 9, 17, 34 };
    static const struct { enum wmode w; enum xmode x; } modes[] = {
        { W_RANDOM, X_RANDOM }, { W_NEGZERO, X_NEGZERO }, { W_MAX, X_BIG }, { W_DENORM_SCALE, X_DENORM },
        { W_FULL, X_ONES }, { W_FULL, X_MINUS_ONES } };
    const int maxc = 34;
    for (int ti = 0; ti < (int)(sizeof types / sizeof *types); ti++)
        for (int level = max_level; level >= QUANT_LEVEL_AVX2; level = level > QUANT_LEVEL_AVX512 ? QUANT_LEVEL_AVX2 : level - 1) {
            int bad = 0;
            char why[160] = "", name[112];
            quant_set_level(level);
            if (!quant_interleave_ok(types[ti], QUANT_TILE_ROWS)) {
                if (level == max_level) {
                    printf("ok - interleaved %s # SKIP no avx512vbmi kernels on this CPU\n", gguf_type_get(types[ti])->name);
                    n_pass++;
                }
                continue;
            }
            for (size_t ui = 0; ui < sizeof units / sizeof *units && !bad; ui++)
                for (size_t ri = 0; ri < sizeof row_counts / sizeof *row_counts && !bad; ri++)
                    for (size_t mi = 0; mi < sizeof modes / sizeof *modes && !bad; mi++) {
                        const int rows = row_counts[ri];
                        struct matmat_case c = matmat_case_new(types[ti], rows, (int64_t)units[ui] * QUANT_QK_K, maxc, 5);
                        const struct ops_matrix *m = &c.m;
                        for (int r = 0; r < rows; r++) fill_weights(m->type, (uint8_t *)m->data + r * m->row_bytes, m->cols, r % 3 ? modes[mi].w : W_RANDOM);
                        fill_x(c.x, m->cols * maxc, modes[mi].x);
                        for (int j = 0; j < maxc; j++) quant_act_prepare(m->type, c.x + (size_t)j * m->cols, m->cols, c.act + j * c.stride);
                        struct ops_matrix im = *m;
                        uint8_t *packed = plat_alloc_aligned(m->row_bytes * (size_t)rows);
                        quant_interleave(m->type, packed, m->data, m->row_bytes, rows);
                        im.data = packed;
                        im.interleaved = 1;
                        matmat_case_refs(&c);
                        const float *ref = c.ref;
                        for (int k = 0; k < 2 * (int)(sizeof columns / sizeof *columns) && !bad; k++) {
                            const int nc = columns[k / 2];
                            if (nc >= QUANT_KEPT_MIN_NC && units[ui] > QUANT_FIELDS_MAX_NU) continue; /* kept only up to that */
                            omp_set_num_threads(1 + k % 2);
                            quant_set_level(level); /* dot_at leaves the scalar level */
                            ops_matmat(&im, c.x, c.y, nc);
                            for (int j = 0; j < nc && !bad; j++)
                                for (int r = 0; r < rows && !bad; r++) {
                                    const size_t at = (size_t)j * rows + r;
                                    if (memcmp(&ref[at], &c.y[at], 4)) {
                                        snprintf(why, sizeof why, "%d super-blocks, %d rows, mode %zu, %d columns, %d threads: row %d column %d %.9g vs %.9g",
                                                 units[ui], rows, mi, nc, 1 + k % 2, r, j, c.y[at], ref[at]);
                                        bad = 1;
                                    }
                                }
                        }
                        free(packed);
                        matmat_case_free(&c);
                    }
            omp_set_num_threads(2);
            snprintf(name, sizeof name, "interleaved %s at %s: 1..5, 9, 17 and 34 columns, 1 and 2 threads == scalar dot of the rows",
                     gguf_type_get(types[ti])->name, quant_level_names[level]);
            check(!bad, name, "%s", why);
        }
}

/* Several columns over K rows of 2 super-blocks (quant_pairs: 4 rows to a vector; at AVX2 the
 * first 16 rows of Q4_K and Q5_K go through quant_tile from 4 columns), 2..9 columns (every pass
 * split of QUANT_NCOL; one column goes through quant_dotr), 19 rows (a short group of rows at
 * the end). */
static void test_pairs_columns(void) {
    const enum gguf_type types[] = { GGUF_TYPE_Q4_K, GGUF_TYPE_Q5_K, GGUF_TYPE_Q6_K, GGUF_TYPE_Q2_K, GGUF_TYPE_Q3_K, GGUF_TYPE_IQ4_XS };
    for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
        struct matmat_case c = matmat_case_new(types[ti], 19, 2 * QUANT_QK_K, 19, 7);
        int first = 0;
        for (int nc = 2; nc <= 19 && !first; nc++) /* past 16: IQ4_XS puts 16 columns in its order at a time */
            if (matmat_wrong(&c, nc)) first = nc;
        char name[96];
        snprintf(name, sizeof name, "%s rows of 2 super-blocks, 2..19 columns == scalar dot", gguf_type_get(types[ti])->name);
        check(!first, name, "first wrong at %d columns", first);
        matmat_case_free(&c);
    }
}

/* Single-column products through the rows kernels (several short K rows to one vector): ops_matvec
 * at the best level against the scalar dot of every row, for rows of 1..10 super-blocks (every
 * slot width, and long rows; Q2_K and Q3_K rows of 4, 6, 8 and 10 go in pairs, the last group of
 * 10 short) and of 33 (past QUANT_REORDER_MAX: Q4_K, Q5_K, IQ4_XS and the IQ3 rows then read the
 * act as it is), row counts that leave every remainder of a row group, with the special weight
 * and activation modes (negative zero, max, denormal). */
static void test_matvec_rows(void) {
    static const int units[] = { 1, 2, 3, 4, 5, 6, 8, 9, 10, 33 }, row_counts[] = { 1, 2, 3, 5, 7, 8, 9, 16, 17, 33 };
    _Static_assert(33 * 256 > QUANT_REORDER_MAX, "the longest rows must pass the reordered act");
    static const struct { enum wmode w; enum xmode x; } modes[] = {
        { W_RANDOM, X_RANDOM }, { W_NEGZERO, X_NEGZERO }, { W_MAX, X_BIG }, { W_DENORM_SCALE, X_DENORM },
        { W_FULL, X_ONES }, { W_FULL, X_MINUS_ONES } };
    for (int ti = 0; ti < N_TYPES; ti++) {
        enum gguf_type t = all_types[ti];
        const struct gguf_type_info *inf = gguf_type_get(t);
        int bad = 0;
        char why[160] = "";
        for (size_t ui = 0; ui < sizeof units / sizeof units[0] && !bad; ui++)
            for (size_t ri = 0; ri < sizeof row_counts / sizeof row_counts[0] && !bad; ri++)
                for (size_t mi = 0; mi < sizeof modes / sizeof modes[0] && !bad; mi++) {
                    const int64_t cols = (int64_t)units[ui] * 256, rows = row_counts[ri];
                    const size_t rb = (size_t)(cols / inf->block_elems * inf->block_bytes);
                    uint8_t *w = plat_alloc(rb * (size_t)rows);
                    float *x = plat_alloc(sizeof(float) * (size_t)cols), *y = plat_alloc(sizeof(float) * (size_t)rows);
                    for (int64_t r = 0; r < rows; r++) fill_weights(t, w + r * rb, cols, r % 3 ? modes[mi].w : W_RANDOM);
                    fill_x(x, cols, modes[mi].x);
                    struct ops_matrix m = { t, w, rows, cols, rb, 0 };
                    void *act = plat_alloc_aligned(ops_act_stride(&m));
                    quant_act_prepare(t, x, cols, act);
                    quant_set_level(max_level);
                    ops_matvec(&m, x, y);
                    for (int64_t r = 0; r < rows && !bad; r++) {
                        float ref = dot_at(QUANT_LEVEL_SCALAR, t, w + r * rb, act, cols);
                        if (memcmp(&ref, &y[r], 4)) {
                            snprintf(why, sizeof why, "%lld columns, %lld rows, mode %zu: row %lld %.9g vs scalar %.9g",
                                     (long long)cols, (long long)rows, mi, (long long)r, y[r], ref);
                            bad = 1;
                        }
                    }
                    free(w); free(x); free(y); free(act);
                }
        char name[96];
        snprintf(name, sizeof name, "%s matvec of short and long rows == scalar dot per row", inf->name);
        check(!bad, name, "%s", why);
    }
}

static void test_levels(void) {
    for (int l = 0; l <= max_level; l++) {
        quant_set_level(l);
        check(!strcmp(quant_level_name(), quant_level_names[l]), "quant_level_name", "%s", quant_level_name());
    }
    unsetenv("COLI_CPU");
    quant_init();
    check(!strcmp(quant_level_name(), quant_level_names[max_level]), "quant_init picks the best level",
          "%s", quant_level_name());
    setenv("COLI_CPU", "scalar", 1);
    quant_init();
    check(!strcmp(quant_level_name(), "scalar"), "COLI_CPU=scalar forces scalar", "%s", quant_level_name());
    unsetenv("COLI_CPU");
    /* which products read their act in lanes (the matmat and matvec checks pass either way) */
    int wrong = 0;
    char why[96] = "";
    for (int l = 0; l <= max_level; l++) {
        quant_set_level(l);
        for (int ti = 0; ti < N_TYPES; ti++) {
            const enum gguf_type t = all_types[ti];
            const int want = gguf_type_get(t)->block_elems == QUANT_QK && l >= QUANT_LEVEL_AVX512; /* the legacy formats' blocks */
            if (quant_act_in_lanes(t, 16 * QUANT_QK) != want || quant_act_in_lanes(t, 15 * QUANT_QK) || quant_act_in_lanes(t, 33 * QUANT_QK) != want)
                if (!wrong++) snprintf(why, sizeof why, "%s at %s", gguf_type_get(t)->name, quant_level_names[l]);
        }
    }
    check(!wrong, "acts in lanes: the legacy formats at the AVX-512 levels, rows of 16 blocks and more", "%s", why);
}

int main(int argc, char **argv) {
    plat_cpu_detect();
    max_level = quant_level_max();
    const char *golden = "../shared/golden";
    int bench = 0, quick = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--bench")) bench = 1;
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else golden = argv[i];
    }
    if (bench) { quant_init(); ops_bench_kernels(); return 0; }
    printf("# levels up to %s\n", quant_level_names[max_level]);
    test_levels();
    test_conversions();
    test_act();
    test_act_inverse_scale();
    test_act_levels();
    test_golden(golden);
    if (quick) {
        printf("ok - IQ3 grids derived # SKIP in the quick run: statistics and model runs, no kernel of their own\n");
        n_pass++;
    } else {
        test_iq3xxs_lattice(golden);
        test_iq3s_grid(golden);
    }
    test_simd_vs_scalar();
    test_raw_blocks();
    test_matvec_rows();
    test_scalar_vs_double();
    test_ops();
    test_attention();
    test_attention_splits();
    test_delta_rule();
    test_swiglu();
    test_softmax();
    test_norms();
    test_own_libm();
    test_widen_f16();
    test_matmat_columns();
    test_tile_long_rows();
    test_avx2_tiles();
    test_interleaved();
    test_pairs_columns();
    free(ops_act_buf.buf);
    free(ops_tile_buf.buf);
    return check_done();
}
