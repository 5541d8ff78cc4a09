/* minijson.h: a small JSON reader for the tests (golden case files).  Parses a whole document
 * into a tree; strings are decoded to UTF-8 (\uXXXX escapes, surrogate pairs joined; a lone
 * surrogate is written as its 3-byte form) and keep their length, so NULs survive.
 *
 *   struct mj *root = mj_load("x.json");            NULL (message on stderr) on error
 *   const struct mj *v = mj_get(root, "cases");     object member, NULL if absent
 *   mj_len(v), mj_at(v, i)                          array (or object) size / element
 *   mj_key(obj, i, &len)                            key of object member i
 *   mj_num(v, dflt), mj_str(v, &len)                number (dflt if not one), string (NULL if not)
 *   mj_free(root)
 * Everything is static inline so that a test may include it and use only part of it. */
#ifndef MINIJSON_H
#define MINIJSON_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum mj_type { MJ_NULL, MJ_BOOL, MJ_NUM, MJ_STR, MJ_ARR, MJ_OBJ };

struct mj {
    enum mj_type type;
    double num;                 /* MJ_NUM; MJ_BOOL: 0 or 1 */
    char *str; size_t len;      /* MJ_STR, NUL-terminated */
    char *key; size_t key_len;  /* member name when inside an object */
    struct mj *kids; size_t n;  /* MJ_ARR elements, MJ_OBJ members */
};

struct mj_parser { const char *p, *end; const char *err; int depth; };

static inline void mj_free_kids(struct mj *v)
{
    for (size_t i = 0; i < v->n; i++) mj_free_kids(&v->kids[i]);
    free(v->kids);
    free(v->str);
    free(v->key);
}

static inline void mj_free(struct mj *v)
{
    if (!v) return;
    mj_free_kids(v);
    free(v);
}

static inline void mj_ws(struct mj_parser *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

static inline int mj_fail(struct mj_parser *ps, const char *msg)
{
    if (!ps->err) ps->err = msg;
    return 0;
}

static inline int mj_hex4(struct mj_parser *ps, uint32_t *out)
{
    uint32_t v = 0;
    if (ps->end - ps->p < 4) return mj_fail(ps, "truncated \\u escape");
    for (int i = 0; i < 4; i++) {
        char c = *ps->p++;
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
        else return mj_fail(ps, "bad \\u escape");
    }
    *out = v;
    return 1;
}

static inline size_t mj_put_utf8(uint32_t cp, char *o)
{
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xC0 | cp >> 6); o[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | cp >> 12); o[1] = (char)(0x80 | (cp >> 6 & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | cp >> 18); o[1] = (char)(0x80 | (cp >> 12 & 0x3F));
    o[2] = (char)(0x80 | (cp >> 6 & 0x3F)); o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Parses a string at ps->p (just after the opening quote) into a malloc'd buffer; the decoded
 * text is never longer than the source, so one allocation of the source length suffices. */
static inline int mj_string(struct mj_parser *ps, char **out, size_t *len)
{
    const char *q = ps->p;
    size_t n = 0;
    char *s;
    while (q < ps->end && *q != '"') q += *q == '\\' ? 2 : 1;
    if (q >= ps->end) return mj_fail(ps, "unterminated string");
    s = malloc((size_t)(q - ps->p) + 1);
    if (!s) return mj_fail(ps, "out of memory");
    while (ps->p < ps->end && *ps->p != '"') {
        char c = *ps->p++;
        uint32_t cp, lo;
        if (c != '\\') { s[n++] = c; continue; }
        if (ps->p >= ps->end) break;
        switch (c = *ps->p++) {
        case 'n': s[n++] = '\n'; break;
        case 't': s[n++] = '\t'; break;
        case 'r': s[n++] = '\r'; break;
        case 'b': s[n++] = '\b'; break;
        case 'f': s[n++] = '\f'; break;
        case '"': case '\\': case '/': s[n++] = c; break;
        case 'u':
            if (!mj_hex4(ps, &cp)) { free(s); return 0; }
            if (cp >= 0xD800 && cp < 0xDC00 && ps->end - ps->p >= 6 && ps->p[0] == '\\' && ps->p[1] == 'u') {
                const char *save = ps->p;
                ps->p += 2;
                if (!mj_hex4(ps, &lo)) { free(s); return 0; }
                if (lo >= 0xDC00 && lo < 0xE000) cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                else ps->p = save;
            }
            n += mj_put_utf8(cp, s + n);
            break;
        default: free(s); return mj_fail(ps, "bad escape");
        }
    }
    if (ps->p >= ps->end) { free(s); return mj_fail(ps, "unterminated string"); }
    ps->p++;
    s[n] = 0;
    *out = s;
    *len = n;
    return 1;
}

static inline int mj_value(struct mj_parser *ps, struct mj *v);

/* Parses the elements of an array (close ']') or members of an object (close '}'). */
static inline int mj_container(struct mj_parser *ps, struct mj *v, char close)
{
    size_t cap = 0;
    mj_ws(ps);
    if (ps->p < ps->end && *ps->p == close) { ps->p++; return 1; }
    for (;;) {
        struct mj kid;
        memset(&kid, 0, sizeof kid);
        mj_ws(ps);
        if (close == '}') {
            if (ps->p >= ps->end || *ps->p != '"') return mj_fail(ps, "expected a key");
            ps->p++;
            if (!mj_string(ps, &kid.key, &kid.key_len)) return 0;
            mj_ws(ps);
            if (ps->p >= ps->end || *ps->p++ != ':') { free(kid.key); return mj_fail(ps, "expected ':'"); }
        }
        if (!mj_value(ps, &kid)) { mj_free_kids(&kid); return 0; }
        if (v->n == cap) {
            struct mj *k = realloc(v->kids, (cap = cap ? 2 * cap : 8) * sizeof *k);
            if (!k) { mj_free_kids(&kid); return mj_fail(ps, "out of memory"); }
            v->kids = k;
        }
        v->kids[v->n++] = kid;
        mj_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') { ps->p++; continue; }
        if (ps->p < ps->end && *ps->p == close) { ps->p++; return 1; }
        return mj_fail(ps, "expected ',' or a closing bracket");
    }
}

static inline int mj_value(struct mj_parser *ps, struct mj *v)
{
    mj_ws(ps);
    if (ps->p >= ps->end) return mj_fail(ps, "unexpected end");
    if (++ps->depth > 512) return mj_fail(ps, "nested too deeply");
    char c = *ps->p;
    int ok = 1;
    if (c == '{' || c == '[') {
        ps->p++;
        v->type = c == '{' ? MJ_OBJ : MJ_ARR;
        ok = mj_container(ps, v, c == '{' ? '}' : ']');
    } else if (c == '"') {
        ps->p++;
        v->type = MJ_STR;
        ok = mj_string(ps, &v->str, &v->len);
    } else if (ps->end - ps->p >= 4 && !memcmp(ps->p, "true", 4)) {
        v->type = MJ_BOOL; v->num = 1; ps->p += 4;
    } else if (ps->end - ps->p >= 5 && !memcmp(ps->p, "false", 5)) {
        v->type = MJ_BOOL; v->num = 0; ps->p += 5;
    } else if (ps->end - ps->p >= 4 && !memcmp(ps->p, "null", 4)) {
        v->type = MJ_NULL; ps->p += 4;
    } else {
        char *e;
        v->type = MJ_NUM;
        v->num = strtod(ps->p, &e);   /* the buffer is NUL-terminated: strtod cannot run off */
        if (e == ps->p || e > ps->end) ok = mj_fail(ps, "bad value");
        else ps->p = e;
    }
    ps->depth--;
    return ok;
}

/* Parses text[0..len), which must be followed by a NUL byte (strtod relies on it).  Returns the
 * tree or NULL; on error *err gets a message and *err_off the byte offset. */
static inline struct mj *mj_parse(const char *text, size_t len, const char **err, size_t *err_off)
{
    struct mj_parser ps = {text, text + len, NULL, 0};
    struct mj *root = calloc(1, sizeof *root);
    if (root && mj_value(&ps, root)) {
        mj_ws(&ps);
        if (ps.p == ps.end) return root;
        mj_fail(&ps, "trailing data");
    }
    *err = ps.err ? ps.err : "out of memory";
    *err_off = (size_t)(ps.p - text);
    mj_free(root);
    return NULL;
}

/* Reads and parses a file; NULL with a message on stderr if it cannot. */
static inline struct mj *mj_load(const char *path)
{
    FILE *f = fopen(path, "rb");
    char *buf = NULL;
    long size;
    struct mj *root = NULL;
    const char *err;
    size_t off;
    if (!f) { fprintf(stderr, "minijson: cannot open %s\n", path); return NULL; }
    if (fseek(f, 0, SEEK_END) == 0 && (size = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0
        && (buf = malloc((size_t)size + 1)) && fread(buf, 1, (size_t)size, f) == (size_t)size) {
        buf[size] = 0;
        root = mj_parse(buf, (size_t)size, &err, &off);
        if (!root) fprintf(stderr, "minijson: %s: %s at byte %zu\n", path, err, off);
    } else {
        fprintf(stderr, "minijson: cannot read %s\n", path);
    }
    free(buf);
    fclose(f);
    return root;
}

static inline const struct mj *mj_get(const struct mj *obj, const char *key)
{
    size_t kl = strlen(key);
    if (!obj || obj->type != MJ_OBJ) return NULL;
    for (size_t i = 0; i < obj->n; i++)
        if (obj->kids[i].key_len == kl && !memcmp(obj->kids[i].key, key, kl)) return &obj->kids[i];
    return NULL;
}

static inline size_t mj_len(const struct mj *v)
{
    return v && (v->type == MJ_ARR || v->type == MJ_OBJ) ? v->n : 0;
}

static inline const struct mj *mj_at(const struct mj *v, size_t i)
{
    return i < mj_len(v) ? &v->kids[i] : NULL;
}

static inline const char *mj_key(const struct mj *obj, size_t i, size_t *len)
{
    if (!obj || obj->type != MJ_OBJ || i >= obj->n) return NULL;
    *len = obj->kids[i].key_len;
    return obj->kids[i].key;
}

static inline double mj_num(const struct mj *v, double dflt)
{
    return v && (v->type == MJ_NUM || v->type == MJ_BOOL) ? v->num : dflt;
}

static inline const char *mj_str(const struct mj *v, size_t *len)
{
    if (!v || v->type != MJ_STR) return NULL;
    if (len) *len = v->len;
    return v->str;
}

#endif
