/* test_tok.c: tests of section 9 (tokenizer) against the golden reference (llama.cpp b9793).
 * Build: gcc -O2 -std=c11 -Wall -Wextra test_tok.c -o test_tok
 * Run:   ./test_tok [GOLDEN_DIR]       (default shared/golden)
 * Prints "ok - name" / "FAIL - name: detail" per check, then "N passed, N failed". */
#define COLI_NO_MAIN
#include "../coli.c"
#include "minijson.h"
#include <time.h>

static int n_pass, n_fail;
static const char *golden_dir = "../shared/golden";

/* Prints name with control characters escaped, so every check stays on one line. */
static void put_name(const char *name)
{
    for (const char *p = name; *p; p++) {
        if (*p == '\n') fputs("\\n", stdout);
        else if (*p == '\r') fputs("\\r", stdout);
        else if (*p == '\t') fputs("\\t", stdout);
        else if ((unsigned char)*p < 0x20) printf("\\x%02x", (unsigned char)*p);
        else putchar(*p);
    }
}

static void check(int ok, const char *name, const char *fmt, ...)
{
    va_list ap;
    if (ok) {
        fputs("ok - ", stdout);
        put_name(name);
        putchar('\n');
        n_pass++;
        return;
    }
    fputs("FAIL - ", stdout);
    put_name(name);
    fputs(": ", stdout);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
    n_fail++;
}

static char *path_of(const char *file)
{
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", golden_dir, file);
    return buf;
}

static double now(void)
{
    return (double)clock() / CLOCKS_PER_SEC;
}

/* Decodes ids back to bytes (malloc'd, NUL-terminated), *len set. */
static char *decode_all(const struct tok *t, const int *ids, int n, size_t *len)
{
    size_t cap = 16, o = 0;
    char *out = plat_alloc(cap);
    for (int i = 0; i < n; i++) {
        size_t need = tok_decode(t, ids[i], NULL, 0);
        if (o + need + 1 > cap) out = plat_realloc(out, cap = 2 * (o + need + 1));
        o += tok_decode(t, ids[i], out + o, cap - o);
    }
    out[o] = 0;
    *len = o;
    return out;
}

/* Formats the first difference of two id lists for a failure message. */
static const char *diff_ids(const int *got, int ng, const struct mj *want)
{
    static char msg[256];
    int nw = (int)mj_len(want), i;
    for (i = 0; i < ng && i < nw; i++)
        if (got[i] != (int)mj_num(mj_at(want, (size_t)i), -1)) break;
    snprintf(msg, sizeof msg, "%d ids, want %d; first difference at %d (got %d, want %d)", ng, nw, i,
             i < ng ? got[i] : -1, i < nw ? (int)mj_num(mj_at(want, (size_t)i), -1) : -1);
    return msg;
}

static int ids_equal(const int *got, int ng, const struct mj *want)
{
    if (!want || ng != (int)mj_len(want)) return 0;
    for (int i = 0; i < ng; i++)
        if (got[i] != (int)mj_num(mj_at(want, (size_t)i), -1)) return 0;
    return 1;
}

static void load_tok(struct tok *t, struct gguf_file *g, const char *file)
{
    char name[256];
    gguf_open(g, path_of(file));
    double t0 = now();
    tok_load(t, g);
    double dt = now() - t0;
    snprintf(name, sizeof name, "%s: tok_load %d tokens in %.3f s (< 0.5 s)", file, t->n_vocab, dt);
    check(dt < 0.5, name, "too slow");
}

static void check_eog(const struct tok *t, const struct mj *root, const char *file)
{
    const struct mj *want = mj_get(root, "eog_ids");
    char name[256];
    int ok = want != NULL, n_eog = 0;
    for (int id = 0; id < t->n_vocab; id++) {
        int in_want = 0;
        for (size_t k = 0; k < mj_len(want); k++)
            in_want |= (int)mj_num(mj_at(want, k), -1) == id;
        if (tok_is_eog(t, id) != in_want) ok = 0;
        n_eog += tok_is_eog(t, id);
    }
    snprintf(name, sizeof name, "%s: eog set equals eog_ids", file);
    check(ok, name, "%d eog tokens, want %zu", n_eog, mj_len(want));
}

/* The golden tokenizer cases: ids, decoded text and round trip. */
static void run_tokenizer_cases(const struct tok *t, const char *json)
{
    struct mj *root = mj_load(path_of(json));
    char name[256];
    check(root != NULL, json, "cannot parse");
    if (!root) return;
    check_eog(t, root, json);
    const struct mj *cases = mj_get(root, "cases");
    for (size_t c = 0; c < mj_len(cases); c++) {
        size_t len = 0, dlen = 0, glen;
        const char *text = mj_str(mj_get(mj_at(cases, c), "text"), &len);
        const char *dec = mj_str(mj_get(mj_at(cases, c), "decoded"), &dlen);
        const struct mj *want = mj_get(mj_at(cases, c), "ids");
        int *ids, n = tok_encode(t, text, len, 1, &ids);
        char *got = decode_all(t, ids, n, &glen);
        snprintf(name, sizeof name, "%s case %zu ids (%.40s)", json, c, text);
        check(ids_equal(ids, n, want), name, "%s", diff_ids(ids, n, want));
        snprintf(name, sizeof name, "%s case %zu decode", json, c);
        check(dec && glen == dlen && !memcmp(got, dec, glen) && glen == len && !memcmp(got, text, len),
              name, "got \"%s\"", got);
        free(got);
        free(ids);
    }
    mj_free(root);
}

/* The prompts of the model case files: prompt -> prompt_tokens, and the eog set. */
static void run_model_cases(const char *gguf, const char *json)
{
    struct gguf_file g;
    struct tok t;
    struct mj *root = mj_load(path_of(json));
    char name[256];
    check(root != NULL, json, "cannot parse");
    if (!root) return;
    load_tok(&t, &g, gguf);
    check_eog(&t, root, json);
    const struct mj *cases = mj_get(root, "cases");
    for (size_t c = 0; c < mj_len(cases); c++) {
        size_t len = 0;
        const char *text = mj_str(mj_get(mj_at(cases, c), "prompt"), &len);
        const char *cname = mj_str(mj_get(mj_at(cases, c), "name"), NULL);
        const struct mj *want = mj_get(mj_at(cases, c), "prompt_tokens");
        int *ids, n = tok_encode(&t, text, len, 1, &ids);
        snprintf(name, sizeof name, "%s case %s prompt_tokens", json, cname ? cname : "?");
        check(ids_equal(ids, n, want), name, "%s", diff_ids(ids, n, want));
        free(ids);
    }
    mj_free(root);
    tok_free(&t);
    gguf_close(&g);
}

static void check_find(const struct tok *t, const char *text, int want, const char *file)
{
    char name[256];
    int got = tok_find(t, text);
    snprintf(name, sizeof name, "%s: tok_find(\"%s\") = %d", file, text, want);
    check(got == want, name, "got %d", got);
}

/* A plain turn as run --chat and chat render it, thinking and not. */
static void check_chat_turn(void)
{
    struct tok t = {0};
    t.chat_template = TOK_TEMPLATE_QWEN36;
    char *s = tok_chat_render_turn(&t, " You are helpful. ", "Hi\n", 1);
    check(!strcmp(s, "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"),
          "chat: a system and a user turn, thinking", "got [%s]", s);
    free(s);
    s = tok_chat_render_turn(&t, NULL, "Hi", 0);
    check(!strcmp(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"), "chat: a user turn, not thinking",
          "got [%s]", s);
    free(s);
    char about[200];
    check(tok_template_detect("{{ messages }}", 14, about, sizeof about) == TOK_TEMPLATE_QWEN36 && strstr(about, "not one coli knows"),
          "chat: an unknown template is rendered as Qwen3.6, and the log says so", "got [%s]", about);
    check(tok_template_detect(NULL, 0, about, sizeof about) == TOK_TEMPLATE_QWEN36 && strstr(about, "no chat template"),
          "chat: a file without a template is rendered as Qwen3.6", "got [%s]", about);
}

/* The flag NAME of a template case: -1 when absent (not passed to the template). */
static int case_flag(const struct json *c, const char *name)
{
    const struct json *v = json_get(c, name);
    return v && v->kind == JSON_BOOL ? v->boolean : -1;
}

/* The golden chat-template cases of FILE: the template text is recognised by its sha256, and
 * each conversation renders byte for byte, or is refused with the template's own message. */
static void run_template_cases(const char *file, enum tok_template kind)
{
    char path[1024], name[300];
    snprintf(path, sizeof path, "%s/%s", golden_dir, file);
    FILE *f = fopen(path, "rb");
    char *text = NULL;
    size_t n = 0, cap = 0, got;
    char chunk[65536];
    while (f && (got = fread(chunk, 1, sizeof chunk, f)) > 0) {
        text = tok_grow(text, &cap, n + got + 1, 1);
        memcpy(text + n, chunk, got);
        n += got;
    }
    if (f) fclose(f);
    const char *why = "unreadable";
    struct json *root = text ? json_parse(text, n, &why) : NULL;
    free(text);
    check(root != NULL, file, "cannot read it: %s", why);
    if (!root) return;
    const struct json *tpl = json_get(root, "template");
    char about[200];
    snprintf(name, sizeof name, "%s: the template is known by its sha256", file);
    check(tpl && tok_template_detect(tpl->str, tpl->len, about, sizeof about) == kind && strstr(about, "the file's own"), name, "got [%s]", about);
    const struct json *cases = json_get(root, "cases");
    int n_cases = 0;
    for (const struct json *c = cases ? cases->child : NULL; c; c = c->next, n_cases++) {
        struct tok_chat_flags flags = {case_flag(c, "add_generation_prompt") == 1, case_flag(c, "enable_thinking"), case_flag(c, "preserve_thinking")};
        const struct json *want = json_get(c, "rendered"), *error = json_get(c, "error");
        struct tok_chat_rendered out;
        char *s = tok_chat_template_render(kind, json_get(c, "messages"), json_get(c, "tools"), &flags, &out);
        snprintf(name, sizeof name, "%s: %s", file, json_get(c, "name")->str);
        if (want) {
            size_t at = 0;
            while (s && at < out.len && at < want->len && s[at] == want->str[at]) at++;
            check(s && out.len == want->len && at == want->len, name, "%s; first difference at byte %zu: got [%.60s] want [%.60s]",
                  s ? "rendered differently" : out.error, at, s ? s + at : "", want->str + (at < want->len ? at : want->len));
        } else
            check(!s && out.error && !strcmp(out.error, error->str), name, "want the refusal [%s], got %s", error->str, s ? "a rendering" : out.error);
        free(s);
    }
    snprintf(name, sizeof name, "%s: has cases", file);
    check(n_cases > 0, name, "none");
    json_free(root);
}

/* Streams the decoded pieces of text's tokens through tok_utf8_stream: every push must emit
 * only whole characters, some push must hold bytes back, and the output must equal the text. */
static void check_stream(const struct tok *t, const char *text, const char *file)
{
    struct tok_utf8_stream st;
    int *ids, n = tok_encode(t, text, strlen(text), 1, &ids), held = 0, whole = 1;
    char out[4096], piece[256], chunk[512];
    size_t o = 0, len = strlen(text);
    memset(&st, 0, sizeof st);
    for (int i = 0; i < n; i++) {
        size_t pn = tok_decode(t, ids[i], piece, sizeof piece);
        size_t k = tok_stream_push(&st, piece, pn, chunk, sizeof chunk);
        held |= k < pn;
        for (size_t j = 0; j < k;) {   /* each chunk must be whole UTF-8 characters */
            uint32_t cp;
            size_t l = tok_utf8_get((const unsigned char *)chunk + j, k - j, &cp);
            if (!l) { whole = 0; break; }
            j += l;
        }
        memcpy(out + o, chunk, k);
        o += k;
    }
    o += tok_stream_flush(&st, out + o);
    char name[256];
    snprintf(name, sizeof name, "%s: streaming decode holds split characters (%d tokens)", file, n);
    check(held && whole && o == len && !memcmp(out, text, len), name, "held %d whole %d len %zu/%zu",
          held, whole, o, len);
    free(ids);
    /* Broken sequences pass through verbatim, and a dangling lead byte comes out at flush. */
    memset(&st, 0, sizeof st);
    o = tok_stream_push(&st, "a\xE2\x82" "b\x80\xF0\x9F", 7, out, sizeof out);
    o += tok_stream_flush(&st, out + o);
    check(o == 7 && !memcmp(out, "a\xE2\x82" "b\x80\xF0\x9F", 7), "stream: invalid bytes pass through",
          "got %zu bytes", o);
}

static void check_roundtrip(const struct tok *t, const char *text, size_t len, const char *name)
{
    int *ids, n = tok_encode(t, text, len, 1, &ids);
    size_t glen;
    char *got = decode_all(t, ids, n, &glen);
    check(glen == len && !memcmp(got, text, len), name, "%d ids, decoded %zu of %zu bytes", n, glen, len);
    free(got);
    free(ids);
}

/* Invalid UTF-8 must not crash and must round-trip byte for byte; random bytes too. */
static void check_invalid_utf8(const struct tok *t, const char *file)
{
    static const char bad[] = "\xFF\xFE abc \xC3 x\xE2\x82 \xED\xA0\x80 \xC0\xAF \xF4\x90\x80\x80"
                              "'\xC3s \x80\x80\x80word\xE2\x82\n\n \xF0\x9F\x98";
    char name[256], buf[512];
    snprintf(name, sizeof name, "%s: invalid UTF-8 round-trips", file);
    check_roundtrip(t, bad, sizeof bad - 1, name);
    unsigned seed = 12345;
    int ok = 1;
    for (int r = 0; r < 300 && ok; r++) {
        size_t len = (size_t)(r % 97) + 1, glen;
        for (size_t i = 0; i < len; i++) {
            seed = seed * 1103515245u + 12345u;
            unsigned v = seed >> 16;
            /* Bias towards the interesting bytes: spaces, newlines, apostrophes, high bytes. */
            buf[i] = (char)(v % 4 == 0 ? " \n\r\t'sA0<|>"[v / 4 % 12] : (int)(v >> 3 & 0xFF));
        }
        int *ids, n = tok_encode(t, buf, len, r & 1, &ids);
        char *got = decode_all(t, ids, n, &glen);
        ok = glen == len && !memcmp(got, buf, len);
        free(got);
        free(ids);
    }
    snprintf(name, sizeof name, "%s: 300 random byte strings round-trip", file);
    check(ok, name, "a string did not round-trip");
}

static void check_perf(const struct tok *t, const char *file)
{
    size_t len = 100000;
    char *s = plat_alloc(len), name[256];
    int *ids, n;
    memset(s, 'a', len);
    double t0 = now();
    n = tok_encode(t, s, len, 1, &ids);
    double dt = now() - t0;
    snprintf(name, sizeof name, "%s: 100 kB single word encodes in %.3f s (< 1 s), %d ids", file, dt, n);
    check(dt < 1.0 && n > 0, name, "too slow");
    free(ids);
    for (size_t i = 0; i < len; i++) s[i] = "Hello wörld, 123 ünïcödé\n\t  日本語 'll"[i % 41];
    t0 = now();
    n = tok_encode(t, s, len, 1, &ids);
    dt = now() - t0;
    snprintf(name, sizeof name, "%s: 100 kB of mixed text encodes in %.3f s (< 1 s), %d ids", file, dt, n);
    check(dt < 1.0 && n > 0, name, "too slow");
    free(ids);
    free(s);
}

/* parse_special = 0: control tokens are plain text, user-defined tokens are still matched. */
static void check_parse_special(const struct tok *t, const char *file)
{
    char name[256];
    const char *s = "<|im_start|>user<think>";
    int *ids, n = tok_encode(t, s, strlen(s), 0, &ids), has_ctrl = 0, has_think = 0;
    for (int i = 0; i < n; i++) {
        has_ctrl |= ids[i] == tok_find(t, "<|im_start|>");
        has_think |= ids[i] == tok_find(t, "<think>");
    }
    snprintf(name, sizeof name, "%s: parse_special=0 keeps control text, matches <think>", file);
    check(!has_ctrl && has_think && ids[n - 1] == tok_find(t, "<think>"), name, "%d ids", n);
    free(ids);
    n = tok_encode(t, "", 0, 1, &ids);
    snprintf(name, sizeof name, "%s: empty text gives no ids", file);
    check(n == 0, name, "%d ids", n);
    free(ids);
}

static void check_decode_types(const struct tok *t, const char *file)
{
    char buf[64], name[256];
    int pad = tok_find(t, "[PAD2074]"), end = tok_find(t, "<|im_end|>");
    size_t n = tok_decode(t, end, buf, sizeof buf);
    snprintf(name, sizeof name, "%s: control token decodes to its text", file);
    check(n == 10 && !memcmp(buf, "<|im_end|>", 10), name, "got %zu bytes", n);
    snprintf(name, sizeof name, "%s: UNUSED [PAD2074] decodes to nothing", file);
    check(pad >= 0 && tok_decode(t, pad, buf, sizeof buf) == 0, name, "id %d", pad);
    int *ids, k = tok_encode(t, " the", 4, 1, &ids);
    n = tok_decode(t, ids[0], buf, 2);
    snprintf(name, sizeof name, "%s: tok_decode reports the full length when cap is short", file);
    check(k == 1 && n == 4 && !memcmp(buf, " t", 2), name, "%d ids, got %zu", k, n);
    free(ids);
}

/* Pre-token byte lengths of text under pre-tokenizer pre must equal want[0..n) (from Python's
 * `regex` module on the same pattern).  The golden cases cannot tell qwen2 from qwen35 apart
 * (in the cut vocabulary marks become byte tokens either way), so the \p{M} rule is tested here. */
static void check_split(enum tok_pre pre, const char *text, const size_t *want, size_t n, const char *name)
{
    struct tok_work w;
    size_t len = strlen(text), k = 0, got[64], ng = 0;
    memset(&w, 0, sizeof w);
    w.unit = tok_grow(NULL, &w.unit_cap, len + 1, sizeof *w.unit);
    for (size_t j = 0; j < len; k++) {
        uint32_t cp;
        size_t l = tok_utf8_get((const unsigned char *)text + j, len - j, &cp);
        w.unit[k].off = j;
        w.unit[k].cls = l ? tok_cp_class(cp) : 0;
        j += l ? l : 1;
    }
    w.unit[k].off = len;
    unsigned body = pre == TOK_PRE_QWEN35 ? TOK_C_L | TOK_C_M : TOK_C_L;
    for (size_t u = 0, m; u < k && ng < 64; u += m) {
        m = tok_pre_match(w.unit, k, u, text, body);
        got[ng++] = w.unit[u + m].off - w.unit[u].off;
    }
    check(ng == n && !memcmp(got, want, n * sizeof *want), name, "%zu pieces, want %zu", ng, n);
    free(w.unit);
}

static void check_splits(void)
{
    const char *marks = "x\u0301\u0302\u0303 \u0939\u093f\u0928\u094d\u0926\u0940 a\u0332b\u0332 \u0301x";
    const char *spaces = "a  \u00a0b\u3000 \x0b\x0c\n \t9\u00bd\u2167\u00b2 'LL'Re .\r\n\r\n  ";
    static const size_t q2[] = {1, 6, 4, 6, 6, 3, 2, 3, 2, 3, 1}, q35[] = {7, 19, 7, 4};
    static const size_t sp[] = {1, 2, 3, 7, 1, 1, 1, 2, 3, 2, 2, 2, 3, 6, 2};
    check_split(TOK_PRE_QWEN2, marks, q2, sizeof q2 / sizeof q2[0], "split: qwen2 keeps marks out of words");
    check_split(TOK_PRE_QWEN35, marks, q35, sizeof q35 / sizeof q35[0], "split: qwen35 keeps marks in words");
    check_split(TOK_PRE_QWEN2, spaces, sp, sizeof sp / sizeof sp[0], "split: Unicode spaces, numbers, contractions");
}

int main(int argc, char **argv)
{
    struct gguf_file g;
    struct tok t;
    if (argc > 1) golden_dir = argv[1];
    check_chat_turn();
    check_splits();
    if (access(golden_dir, F_OK) != 0) {
        printf("ok - golden tokenizer cases # SKIP %s absent\n", golden_dir);
        printf("%d passed, %d failed\n", n_pass + 1, n_fail);
        return n_fail != 0;
    }

    run_template_cases("template-qwen35.json", TOK_TEMPLATE_QWEN35);
    run_template_cases("template-qwen36.json", TOK_TEMPLATE_QWEN36);
    load_tok(&t, &g, "tokenizer-qwen3.gguf");
    run_tokenizer_cases(&t, "tokenizer-qwen3.json");
    check_find(&t, "<think>", 151667, "qwen3");
    check_find(&t, "<|im_start|>", 151644, "qwen3");
    check_find(&t, "no such token text", -1, "qwen3");
    check(t.eos_id == 151645 && t.pad_id == 151643 && t.eot_id == 151645, "qwen3: eos/pad/eot ids",
          "eos %d pad %d eot %d", t.eos_id, t.pad_id, t.eot_id);
    check(t.pre == TOK_PRE_QWEN2, "qwen3: pre-tokenizer qwen2", "pre %d", (int)t.pre);
    check_stream(&t, "Zürich 日本 👨‍👩‍👧 ✔️ 🇫🇷", "qwen3");
    check_invalid_utf8(&t, "qwen3");
    check_perf(&t, "qwen3");
    check_parse_special(&t, "qwen3");
    tok_free(&t);
    gguf_close(&g);

    load_tok(&t, &g, "q35moe-f32.gguf");
    run_tokenizer_cases(&t, "tokenizer-q35moe.json");
    check_find(&t, "<think>", 2072, "q35moe");
    check_find(&t, "<|im_start|>", 2049, "q35moe");
    check(t.eos_id == 2050 && t.pad_id == 2048, "q35moe: eos/pad ids", "eos %d pad %d", t.eos_id, t.pad_id);
    check(t.pre == TOK_PRE_QWEN35, "q35moe: pre-tokenizer qwen35", "pre %d", (int)t.pre);
    check_stream(&t, "café 😀 ok", "q35moe");
    check_invalid_utf8(&t, "q35moe");
    check_perf(&t, "q35moe");
    check_parse_special(&t, "q35moe");
    check_decode_types(&t, "q35moe");
    tok_free(&t);
    gguf_close(&g);

    run_model_cases("q35moe-f32.gguf", "q35moe-f32.json");
    run_model_cases("q3next-f32.gguf", "q3next-f32.json");

    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail != 0;
}
