/* gguf_writer.h — a small GGUF v3 writer for coli's tests (test_gguf.c) and the random-model
 * generator (gen_model.c). Test-side code only; coli itself never writes GGUF.
 *
 * The header (metadata and tensor infos) is built in memory; tensor data is either appended
 * to an in-memory image (small test files, gw_image) or streamed by the caller after
 * gw_header (gen_model.c: tensor by tensor, bounded memory). Every write returns the byte
 * position it wrote at, so tests can corrupt exactly one field of an otherwise valid file.
 *
 * Layout written (GGUF v3, little-endian): "GGUF", u32 version, u64 n_tensors, u64 n_kv,
 * the key-value pairs, the tensor infos (name, u32 rank, u64 ne[rank] innermost first,
 * u32 type, u64 offset from the data section), zero padding up to the alignment, the data
 * section (each tensor at its aligned offset). */
#ifndef GGUF_WRITER_H
#define GGUF_WRITER_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum gw_value {
    GW_U8 = 0, GW_I8 = 1, GW_U16 = 2, GW_I16 = 3, GW_U32 = 4, GW_I32 = 5, GW_F32 = 6, GW_BOOL = 7,
    GW_STR = 8, GW_ARR = 9, GW_U64 = 10, GW_I64 = 11, GW_F64 = 12
};

/* Tensor type ids as GGUF numbers them (the subset the tests and generator write). */
enum gw_type {
    GW_TYPE_F32 = 0, GW_TYPE_F16 = 1, GW_TYPE_Q4_0 = 2, GW_TYPE_Q4_1 = 3, GW_TYPE_Q5_0 = 6,
    GW_TYPE_Q5_1 = 7, GW_TYPE_Q8_0 = 8, GW_TYPE_Q2_K = 10, GW_TYPE_Q3_K = 11, GW_TYPE_Q4_K = 12,
    GW_TYPE_Q5_K = 13, GW_TYPE_Q6_K = 14, GW_TYPE_BF16 = 30
};

/* Elements and bytes per block; 0 elements for a type the writer does not know. */
static void gw_type_block(int type, int *elems, int *bytes)
{
    static const struct { int type, elems, bytes; } t[] = {
        {GW_TYPE_F32, 1, 4}, {GW_TYPE_F16, 1, 2}, {GW_TYPE_BF16, 1, 2}, {GW_TYPE_Q4_0, 32, 18},
        {GW_TYPE_Q4_1, 32, 20}, {GW_TYPE_Q5_0, 32, 22}, {GW_TYPE_Q5_1, 32, 24}, {GW_TYPE_Q8_0, 32, 34},
        {GW_TYPE_Q2_K, 256, 84}, {GW_TYPE_Q3_K, 256, 110}, {GW_TYPE_Q4_K, 256, 144}, {GW_TYPE_Q5_K, 256, 176},
        {GW_TYPE_Q6_K, 256, 210},
    };
    *elems = *bytes = 0;
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (t[i].type == type) { *elems = t[i].elems; *bytes = t[i].bytes; }
}

/* Bytes of a tensor of N elements of TYPE (N a multiple of the block); 0 if unknown. */
static uint64_t gw_type_size(int type, uint64_t n)
{
    int e, b;
    gw_type_block(type, &e, &b);
    return e ? n / (uint64_t)e * (uint64_t)b : 0;
}

/* A growable byte buffer; dies (test-side: abort with a message) when out of memory. */
struct gw_buf {
    uint8_t *p;
    size_t n, cap;
};

static void gw_reserve(struct gw_buf *b, size_t extra)
{
    if (b->n + extra <= b->cap) return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + extra) cap *= 2;
    b->p = realloc(b->p, cap);
    if (!b->p) { fprintf(stderr, "gguf_writer: out of memory (%zu bytes)\n", cap); abort(); }
    b->cap = cap;
}

static size_t gw_put(struct gw_buf *b, const void *src, size_t n)
{
    size_t at = b->n;
    gw_reserve(b, n);
    if (src) memcpy(b->p + b->n, src, n);
    else memset(b->p + b->n, 0, n);
    b->n += n;
    return at;
}

static size_t gw_u16(struct gw_buf *b, uint16_t v) { return gw_put(b, &v, 2); }
static size_t gw_u32(struct gw_buf *b, uint32_t v) { return gw_put(b, &v, 4); }
static size_t gw_u64(struct gw_buf *b, uint64_t v) { return gw_put(b, &v, 8); }
static size_t gw_strn(struct gw_buf *b, const char *s, size_t n)
{
    size_t at = gw_u64(b, n);
    gw_put(b, s, n);
    return at;
}
static size_t gw_str(struct gw_buf *b, const char *s) { return gw_strn(b, s, strlen(s)); }

/* Overwrites N bytes at AT (which must lie inside the buffer). */
static void gw_patch(struct gw_buf *b, size_t at, const void *src, size_t n)
{
    if (at > b->n || n > b->n - at) { fprintf(stderr, "gguf_writer: patch outside the buffer\n"); abort(); }
    memcpy(b->p + at, src, n);
}
static void gw_patch_u32(struct gw_buf *b, size_t at, uint32_t v) { gw_patch(b, at, &v, 4); }
static void gw_patch_u64(struct gw_buf *b, size_t at, uint64_t v) { gw_patch(b, at, &v, 8); }

static void gw_buf_free(struct gw_buf *b)
{
    free(b->p);
    memset(b, 0, sizeof *b);
}

/* Where one tensor info was written (positions relative to the tensor-info buffer) and
 * where its data goes (relative to the data section). */
struct gw_tensor {
    size_t info_at, rank_at, dims_at, type_at, offset_at;
    uint64_t offset, bytes;
};

struct gw_file {
    uint32_t version;
    uint64_t alignment;     /* padding used by the writer; general.alignment is the caller's */
    struct gw_buf kv, ti;   /* encoded key-value pairs and tensor infos */
    uint64_t n_kv, n_tensors;
    struct gw_tensor *t;    /* [n_tensors] */
    uint64_t data_end;      /* bytes of the data section so far */
    size_t data_start;      /* set by gw_header: where the data section begins in the file */
};

static void gw_init(struct gw_file *f)
{
    memset(f, 0, sizeof *f);
    f->version = 3;
    f->alignment = 32;
}

static void gw_free(struct gw_file *f)
{
    gw_buf_free(&f->kv);
    gw_buf_free(&f->ti);
    free(f->t);
    memset(f, 0, sizeof *f);
}

/* File positions of the two variable sections (valid once all pairs are written). */
static size_t gw_kv_base(const struct gw_file *f) { (void)f; return 24; }
static size_t gw_ti_base(const struct gw_file *f) { return 24 + f->kv.n; }

/* Key and value type; returns the position (in f->kv) of the key's length field. */
static size_t gw_key(struct gw_file *f, const char *key, size_t key_len, uint32_t type)
{
    size_t at = gw_strn(&f->kv, key, key_len);
    gw_u32(&f->kv, type);
    f->n_kv++;
    return at;
}

/* Position (in f->kv) of the value of the pair whose key starts at KEY_AT. */
static size_t gw_kv_value_at(const struct gw_file *f, size_t key_at)
{
    uint64_t n;
    memcpy(&n, f->kv.p + key_at, 8);
    return key_at + 8 + (size_t)n + 4;
}

static const int gw_value_size[13] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

/* A scalar of TYPE (not STR or ARR) whose bytes are at V. */
static size_t gw_kv_scalar(struct gw_file *f, const char *key, uint32_t type, const void *v)
{
    size_t at = gw_key(f, key, strlen(key), type);
    gw_put(&f->kv, v, (size_t)gw_value_size[type]);
    return at;
}
static size_t gw_kv_u32(struct gw_file *f, const char *key, uint32_t v) { return gw_kv_scalar(f, key, GW_U32, &v); }
static size_t gw_kv_i32(struct gw_file *f, const char *key, int32_t v) { return gw_kv_scalar(f, key, GW_I32, &v); }
static size_t gw_kv_u16(struct gw_file *f, const char *key, uint16_t v) { return gw_kv_scalar(f, key, GW_U16, &v); }
static size_t gw_kv_f32(struct gw_file *f, const char *key, float v) { return gw_kv_scalar(f, key, GW_F32, &v); }
static size_t gw_kv_bool(struct gw_file *f, const char *key, int v)
{
    uint8_t b = v != 0;
    return gw_kv_scalar(f, key, GW_BOOL, &b);
}
static size_t gw_kv_str(struct gw_file *f, const char *key, const char *s)
{
    size_t at = gw_key(f, key, strlen(key), GW_STR);
    gw_str(&f->kv, s);
    return at;
}

/* An array of N numbers of ELEM (not STR or ARR) stored contiguously at DATA. */
static size_t gw_kv_array(struct gw_file *f, const char *key, uint32_t elem, uint64_t n, const void *data)
{
    size_t at = gw_key(f, key, strlen(key), GW_ARR);
    gw_u32(&f->kv, elem);
    gw_u64(&f->kv, n);
    gw_put(&f->kv, data, (size_t)n * (size_t)gw_value_size[elem]);
    return at;
}

static size_t gw_kv_strings(struct gw_file *f, const char *key, uint64_t n, const char *const *s)
{
    size_t at = gw_key(f, key, strlen(key), GW_ARR);
    gw_u32(&f->kv, GW_STR);
    gw_u64(&f->kv, n);
    for (uint64_t i = 0; i < n; i++) gw_str(&f->kv, s[i]);
    return at;
}

/* Adds a tensor info: NE innermost first (GGUF order), BYTES of data at the next offset
 * aligned to f->alignment. Returns the tensor's index. */
static size_t gw_tensor(struct gw_file *f, const char *name, uint32_t rank, const uint64_t *ne, uint32_t type, uint64_t bytes)
{
    f->t = realloc(f->t, (size_t)(f->n_tensors + 1) * sizeof *f->t);
    if (!f->t) abort();
    struct gw_tensor *t = &f->t[f->n_tensors];
    uint64_t a = f->alignment ? f->alignment : 1;
    t->offset = (f->data_end + a - 1) / a * a;
    t->bytes = bytes;
    f->data_end = t->offset + bytes;
    t->info_at = gw_str(&f->ti, name);
    t->rank_at = gw_u32(&f->ti, rank);
    t->dims_at = f->ti.n;
    for (uint32_t d = 0; d < rank; d++) gw_u64(&f->ti, ne[d]);
    t->type_at = gw_u32(&f->ti, type);
    t->offset_at = gw_u64(&f->ti, t->offset);
    return (size_t)f->n_tensors++;
}

/* The file's header: everything before the data section, padding included. Sets data_start. */
static void gw_header(struct gw_file *f, struct gw_buf *out)
{
    gw_put(out, "GGUF", 4);
    gw_u32(out, f->version);
    gw_u64(out, f->n_tensors);
    gw_u64(out, f->n_kv);
    gw_put(out, f->kv.p, f->kv.n);
    gw_put(out, f->ti.p, f->ti.n);
    uint64_t a = f->alignment ? f->alignment : 1;
    size_t pad = (size_t)((a - out->n % a) % a);
    gw_put(out, NULL, pad);
    f->data_start = out->n;
}

/* A whole file in memory: header, then each tensor's bytes from DATA[i] (NULL: a pattern
 * derived from the tensor index), at its offset. */
static void gw_image(struct gw_file *f, struct gw_buf *out, const void *const *data)
{
    gw_header(f, out);
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        size_t at = f->data_start + (size_t)f->t[i].offset;
        if (out->n < at) gw_put(out, NULL, at - out->n);
        size_t p = gw_put(out, data ? data[i] : NULL, (size_t)f->t[i].bytes);
        if (!data || !data[i])
            for (uint64_t k = 0; k < f->t[i].bytes; k++) out->p[p + k] = (uint8_t)(i * 37 + k * 7 + 1);
    }
}

static int gw_write_file(const char *path, const void *p, size_t n)
{
    FILE *fp = fopen(path, "wb");
    if (!fp) return -1;
    size_t w = n ? fwrite(p, 1, n, fp) : 0;
    return (fclose(fp) != 0 || w != n) ? -1 : 0;
}

#endif
