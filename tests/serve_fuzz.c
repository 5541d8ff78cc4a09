/* serve_fuzz: throws malformed and hostile HTTP requests at a running `coli serve` and checks that
 * it neither crashes nor hangs, and that it answers as its contract says (400 for bad HTTP and bad
 * JSON, 400 naming the field for a wrong type, 405 with Allow, 413, 431, ...).
 *
 *   serve_fuzz HOST PORT N [--seed S] [--threads T] [--only I] [--max-seconds S]
 *
 *   HOST     a loopback address (127.x.x.x, ::1 or localhost); anything else is refused, since
 *            the requests are hostile
 *   N        how many requests (the slow clients come on top)
 *   --seed   request I is a pure function of (S, I): same seed, same bytes (default 1)
 *   --threads  concurrent clients (default 4)
 *   --only I   send request I alone and print its bytes and the reply: to replay a failure
 *   --max-seconds  no new request after this long (default 1200); stopping early fails the run
 *
 * Per request: connect, send, read the reply (15 s at most), classify it as a status line, a close
 * by the server without one, a timeout (a hang: always a failure) or a malformed reply. A few slow
 * clients run alongside, in their own threads, and must be closed by the server's 10 s header
 * deadline. GET /health must answer 200 within 5 s after every 1000 requests and at the end,
 * and once while 100 idle connections are held open.
 * Prints counts by status and by category, then `ok - ` / `FAIL - ` lines and the closing
 * `N passed, N failed` (the style of tests/check.h); exit status 0 only when nothing failed.
 *
 * Build: gcc -std=c11 -O2 -Wall -Wextra -pthread tests/serve_fuzz.c -o build/serve_fuzz
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define REPLY_TIMEOUT 15.0 /* s: no reply by then is a hang */
#define HEALTH_TIMEOUT 5.0
#define HEALTH_EVERY 1000
#define SLOW_REPLY 5.0   /* s: replies slower than this are counted (not failed) */
#define MAX_RESP 12      /* responses one pipelined case may expect */
#define MAX_EXAMPLES 3   /* failures kept per category for the report */
#define MAX_CONNFAIL 20  /* consecutive connect failures: the server is gone, stop */
#define SLOW_LIMIT 35.0  /* s: a slow client gives up (the idle timeout of 30 s shows as such) */
#define IDLE_CONNS 100   /* idle connections held open while /health must still answer */

/* ---- small utilities ---------------------------------------------------------------------- */

static void sleep_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static void die(const char *msg)
{
    fprintf(stderr, "serve_fuzz: %s\n", msg);
    exit(2);
}

/* splitmix64: tiny, good enough, and a pure function of its state (determinism per request). */
static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static unsigned rnd(uint64_t *s, unsigned n) { return n ? (unsigned)(rng_next(s) % n) : 0; }

/* A growable byte buffer: requests hold NULs and invalid UTF-8, so no C strings. */
struct buf {
    char *p;
    size_t n, cap;
};

/* Room for N more bytes and a NUL. */
static void breserve(struct buf *b, size_t n)
{
    if (b->n + n + 1 <= b->cap) return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + n + 1) cap *= 2;
    b->p = realloc(b->p, cap);
    if (!b->p) die("out of memory");
    b->cap = cap;
}

static void bput(struct buf *b, const void *d, size_t n)
{
    breserve(b, n);
    memcpy(b->p + b->n, d, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void bputs(struct buf *b, const char *s) { bput(b, s, strlen(s)); }

static void bfill(struct buf *b, char ch, size_t n)
{
    breserve(b, n);
    memset(b->p + b->n, ch, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void brep(struct buf *b, const char *s, size_t times)
{
    for (size_t i = 0; i < times; i++) bputs(b, s);
}

__attribute__((format(printf, 2, 3))) static void bprintf(struct buf *b, const char *fmt, ...)
{
    char tmp[4096];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) die("bprintf");
    bput(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

/* Writes bytes C-escaped into OUT (cap bytes): the head and the tail of long requests. */
static void escape(const char *p, size_t n, char *out, size_t cap)
{
    size_t o = 0, head = n > 400 ? 300 : n;
    for (size_t i = 0; i < n && o + 8 < cap; i++) {
        if (i == head && n > 400) {
            o += (size_t)snprintf(out + o, cap - o, "[... %zu bytes ...]", n - 380);
            i = n - 80;
        }
        unsigned char ch = (unsigned char)p[i];
        if (ch == '\r') o += (size_t)snprintf(out + o, cap - o, "\\r");
        else if (ch == '\n') o += (size_t)snprintf(out + o, cap - o, "\\n");
        else if (ch == '\\') o += (size_t)snprintf(out + o, cap - o, "\\\\");
        else if (ch >= 32 && ch < 127) out[o++] = (char)ch;
        else o += (size_t)snprintf(out + o, cap - o, "\\x%02x", ch);
    }
    out[o < cap ? o : cap - 1] = 0;
}

#include "check.h"
#include "http_client.h"

/* ---- one reply ------------------------------------------------------------------------------ */

enum kind { R_STATUS, R_CLOSED, R_TIMEOUT, R_BAD, R_CONNFAIL };
static const char *kind_name[] = {"status", "closed", "timeout", "malformed reply", "connect failed"};

struct reply {
    int kind, status;
    int has_allow, conn_close; /* headers seen */
    double secs;               /* sent -> reply complete */
    size_t body_n;             /* decoded body bytes */
    char body[2048];           /* the body's head, NUL-terminated */
    char tail[40];             /* the body's last bytes: a stream ends with data: [DONE] */
    size_t tail_n;
    char why[120];             /* what was wrong with a malformed reply */
};

static void body_add(struct reply *r, const char *p, size_t n)
{
    if (r->body_n < sizeof r->body - 1) {
        size_t k = sizeof r->body - 1 - r->body_n;
        k = n < k ? n : k;
        memcpy(r->body + r->body_n, p, k);
        r->body[r->body_n + k] = 0;
    }
    r->body_n += n;
    size_t cap = sizeof r->tail;
    if (n >= cap) memcpy(r->tail, p + n - cap, cap), r->tail_n = cap;
    else {
        size_t keep = r->tail_n + n > cap ? cap - n : r->tail_n;
        memmove(r->tail, r->tail + r->tail_n - keep, keep);
        memcpy(r->tail + keep, p, n);
        r->tail_n = keep + n;
    }
}

static int bad(struct reply *r, const char *why)
{
    r->kind = R_BAD;
    snprintf(r->why, sizeof r->why, "%s", why);
    return R_BAD;
}

/* Consumes N body bytes; 1 done, else why it stopped. */
static int take_body(struct conn *c, unsigned long long n, double deadline, struct reply *r)
{
    while (n) {
        if (c->beg == c->end) {
            int k = conn_fill(c, deadline);
            if (k <= 0) return k == -1 ? -1 : 0;
        }
        size_t k = c->end - c->beg;
        if (k > n) k = (size_t)n;
        body_add(r, c->buf + c->beg, k);
        c->beg += k, n -= k;
    }
    return 1;
}

/* A chunked body; 1 done, 0 truncated, -1 deadline, -2 malformed. */
static int take_chunked(struct conn *c, double deadline, struct reply *r)
{
    char line[256];
    for (;;) {
        long n = conn_line(c, deadline, line, sizeof line);
        if (n < 0) return n == L_TIMEOUT ? -1 : n == L_EOF ? 0 : -2;
        char *end;
        errno = 0;
        unsigned long long size = strtoull(line, &end, 16);
        if (end == line || errno || (*end && *end != ';' && *end != ' ')) return -2;
        if (size == 0) { /* trailers up to the empty line */
            while ((n = conn_line(c, deadline, line, sizeof line)) > 0) {}
            return n == 0 ? 1 : n == L_TIMEOUT ? -1 : 0;
        }
        int k = take_body(c, size, deadline, r);
        if (k != 1) return k;
        n = conn_line(c, deadline, line, sizeof line);
        if (n != 0) return n == L_TIMEOUT ? -1 : n == L_EOF ? 0 : -2; /* the CR LF after the data */
    }
}

/* Reads one complete response (interim 1xx skipped); returns r->kind. HEAD: no body. */
static int read_reply(struct conn *c, int head, double deadline, struct reply *r)
{
    char line[8192];
    memset(r, 0, sizeof *r);
    for (;;) {
        long n = conn_line(c, deadline, line, sizeof line);
        if (n == L_TIMEOUT) return r->kind = R_TIMEOUT;
        if (n == L_LONG) return bad(r, "status line over 256 KiB");
        if (n == L_EOF) return c->beg == c->end ? (r->kind = R_CLOSED) : bad(r, "closed in the middle of the status line");
        if (strncmp(line, "HTTP/1.", 7) || (line[7] != '0' && line[7] != '1') || line[8] != ' ' ||
            line[9] < '1' || line[9] > '5' || line[10] < '0' || line[10] > '9' || line[11] < '0' || line[11] > '9' ||
            (line[12] && line[12] != ' ')) {
            char e[100], msg[120];
            escape(line, strlen(line), e, 60);
            snprintf(msg, sizeof msg, "bad status line '%s'", e);
            return bad(r, msg);
        }
        r->status = atoi(line + 9);
        long long clen = -1;
        int chunked = 0;
        while ((n = conn_line(c, deadline, line, sizeof line)) > 0) {
            if (!strncasecmp(line, "content-length:", 15)) clen = atoll(line + 15);
            else if (!strncasecmp(line, "transfer-encoding:", 18) && strcasestr(line, "chunked")) chunked = 1;
            else if (!strncasecmp(line, "connection:", 11) && strcasestr(line, "close")) r->conn_close = 1;
            else if (!strncasecmp(line, "allow:", 6)) r->has_allow = 1;
        }
        if (n == L_TIMEOUT) return r->kind = R_TIMEOUT;
        if (n < 0) return bad(r, n == L_EOF ? "reply headers cut short" : "reply header line over 256 KiB");
        if (r->status >= 200) {
            int k = 1;
            if (head || r->status == 204 || r->status == 304) k = 1;
            else if (chunked) k = take_chunked(c, deadline, r);
            else if (clen >= 0) k = take_body(c, (unsigned long long)clen, deadline, r);
            else /* neither: the body runs to the close */
                do body_add(r, c->buf + c->beg, c->end - c->beg), c->beg = c->end;
                while ((k = conn_fill(c, deadline)) == 1);
            if (k == -1) return r->kind = R_TIMEOUT;
            if (k == -2) return bad(r, "malformed chunked encoding in the reply");
            if (k == 0 && (chunked || clen >= 0)) return bad(r, "reply body cut short");
            return r->kind = R_STATUS;
        }
    }
}

/* ---- the cases ------------------------------------------------------------------------------ */

/* One request to send and what may come back. expect[k] lists the acceptable outcomes of the
 * k-th response: status codes ("400"), classes ("4xx"), "close" (the server closing without a
 * status line) or "any" (anything but a hang or a malformed reply). */
struct fcase {
    struct buf req;
    size_t split;              /* nonzero: send req[0..split), pause (or await 100), then the rest */
    int wait100;               /* between the parts, expect "HTTP/1.1 100 Continue" */
    int shut_wr;               /* half-close after sending, so the server sees EOF, not silence */
    int abort;                 /* 1: close right after sending; 2: after the first bytes back */
    int head;                  /* HEAD request: no body in the reply */
    int n_resp;                /* responses to read (pipelining) */
    const char *expect[MAX_RESP];
    unsigned sse;              /* bit k: response k, if 200, is an SSE stream ending data: [DONE] */
    const char *param;         /* a 400 must name one of these fields ("a|b") in error.param */
    const char *body_has;      /* a 200 to response 0 must contain this */
    const char *error_has;     /* an error's body must contain this (its API's shape) */
    int want_allow;            /* a 405 must carry Allow */
    int want_close;            /* after the last response the server must close (HTTP/1.0) */
    char variant[64];          /* which variant, for the report */
};

#define GEN "200 503" /* a generation may also meet a full queue */
#define HOST "Host: 127.0.0.1\r\n"

static const char *words[] = {"hi", "hello", "count to three", "what is 2+2", "name a colour", "say yes", "ok"};

/* A small valid chat body: max_tokens 1..4, sometimes sampled, sometimes streamed. */
static void chat_body(struct buf *b, uint64_t *r, int stream)
{
    bprintf(b, "{\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],\"max_tokens\":%u", words[rnd(r, 7)], 1 + rnd(r, 4));
    if (rnd(r, 2)) bprintf(b, ",\"temperature\":%.2f,\"seed\":%u", rnd(r, 100) / 50.0, rnd(r, 1000));
    if (!rnd(r, 4)) bprintf(b, ",\"thinking_budget_tokens\":%u%s", rnd(r, 3), rnd(r, 2) ? ",\"thinking_budget_message\":\" ok\"" : "");
    if (stream) bputs(b, ",\"stream\":true,\"stream_options\":{\"include_usage\":true}");
    bputs(b, "}");
}

static void completion_body(struct buf *b, uint64_t *r, int stream)
{
    bprintf(b, "{\"prompt\":\"%s\",\"max_tokens\":%u%s}", words[rnd(r, 7)], 1 + rnd(r, 4), stream ? ",\"stream\":true" : "");
}

static void post(struct buf *b, const char *path, const char *body, size_t n, const char *extra)
{
    bprintf(b, "POST %s HTTP/1.1\r\n" HOST "Content-Type: application/json\r\n%sContent-Length: %zu\r\n\r\n", path, extra ? extra : "", n);
    bput(b, body, n);
}

static void get(struct buf *b, const char *path, const char *extra)
{
    bprintf(b, "GET %s HTTP/1.1\r\n" HOST "%s\r\n", path, extra ? extra : "");
}

static void name(struct fcase *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->variant, sizeof c->variant, fmt, ap);
    va_end(ap);
}

/* An Anthropic request with a tool, a call, its result and thinking: for the messages cases and mutation. */
#define ANTHROPIC_BODY                                                                                                        \
    "{\"max_tokens\":2,\"tools\":[{\"name\":\"f\",\"input_schema\":{\"type\":\"object\"}}],\"tool_choice\":{\"type\":\"auto\"},"        \
    "\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"assistant\",\"content\":[{\"type\":\"thinking\",\"thinking\":\"t\"," \
    "\"signature\":\"\"},{\"type\":\"tool_use\",\"id\":\"a\",\"name\":\"f\",\"input\":{\"k\":[1,{}]}}]},{\"role\":\"user\",\"content\":"  \
    "[{\"type\":\"tool_result\",\"tool_use_id\":\"a\",\"content\":[{\"type\":\"text\",\"text\":\"r\"}]},{\"type\":\"text\",\"text\":"     \
    "\"go\"}]}],\"thinking\":{\"type\":\"adaptive\"}}"

/* A Responses request shaped as Codex sends one: developer messages, a turn's reasoning, text and call, its output, tools
 * of every kind (function, namespace, hosted): for the responses cases and mutation. */
#define RESPONSES_BODY                                                                                                                 \
    "{\"max_output_tokens\":2,\"input\":[{\"type\":\"message\",\"role\":\"developer\",\"content\":[{\"type\":\"input_text\",\"text\":\"d\"}]},"      \
    "{\"role\":\"user\",\"content\":\"x\"},{\"type\":\"reasoning\",\"summary\":[],\"content\":[{\"type\":\"reasoning_text\",\"text\":\"t\"}]},"    \
    "{\"type\":\"message\",\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",\"text\":\"a\"}]},{\"type\":\"function_call\","         \
    "\"call_id\":\"c\",\"name\":\"f\",\"arguments\":\"{}\"},{\"type\":\"function_call_output\",\"call_id\":\"c\",\"output\":\"r\"}],"           \
    "\"tools\":[{\"type\":\"function\",\"name\":\"f\",\"parameters\":{\"type\":\"object\"}},{\"type\":\"namespace\",\"name\":\"n\",\"tools\":" \
    "[{\"type\":\"function\",\"name\":\"g\"}]},{\"type\":\"web_search\"}],\"reasoning\":{\"effort\":\"low\"},\"store\":false}"

/* Any valid request, for truncation and mutation. */
static void valid_request(struct buf *b, uint64_t *r)
{
    struct buf body = {0};
    switch (rnd(r, 6)) {
    case 0: get(b, "/health", NULL); break;
    case 1: get(b, "/v1/models", "Connection: close\r\n"); break;
    case 2: chat_body(&body, r, (int)rnd(r, 2)), post(b, "/v1/chat/completions", body.p, body.n, NULL); break;
    case 3: post(b, "/v1/messages", ANTHROPIC_BODY, strlen(ANTHROPIC_BODY), NULL); break;
    case 4: post(b, "/v1/responses", RESPONSES_BODY, strlen(RESPONSES_BODY), NULL); break;
    default: completion_body(&body, r, 0), post(b, "/v1/completions", body.p, body.n, NULL); break;
    }
    free(body.p);
}

static void gen_trunc_reqline(struct fcase *c, uint64_t *r)
{
    static const char *lines[] = {"GET /health HTTP/1.1", "POST /v1/chat/completions HTTP/1.1", "GET /v1/models HTTP/1.0"};
    const char *l = lines[rnd(r, 3)];
    size_t cut = rnd(r, (unsigned)strlen(l) + 2); /* up to the line and its CR */
    bput(&c->req, l, cut < strlen(l) ? cut : strlen(l));
    if (cut > strlen(l)) bputs(&c->req, "\r");
    c->shut_wr = 1;
    c->expect[0] = "400 408 close"; /* 408: coli's word for a head that did not come whole */
    name(c, "cut at %zu", cut);
}

static void gen_trunc_headers(struct fcase *c, uint64_t *r)
{
    struct buf full = {0};
    valid_request(&full, r);
    size_t hdr_end = (size_t)(strstr(full.p, "\r\n\r\n") - full.p) + 2; /* keep the last header's CR LF at most */
    size_t first_nl = (size_t)(strchr(full.p, '\n') - full.p) + 1;
    size_t cut = first_nl + rnd(r, (unsigned)(hdr_end - first_nl + 1));
    bput(&c->req, full.p, cut);
    free(full.p);
    c->shut_wr = 1;
    c->expect[0] = "400 408 close";
    name(c, "cut at %zu of %zu", cut, hdr_end + 2);
}

static void gen_long_line(struct fcase *c, uint64_t *r)
{
    size_t len = 16 * 1024 + rnd(r, 64 * 1024);
    switch (rnd(r, 3)) {
    case 0:
        bputs(&c->req, "GET /health HTTP/1.1\r\n" HOST "X-Long: "), bfill(&c->req, 'a', len), bputs(&c->req, "\r\n\r\n");
        name(c, "header value %zu", len);
        break;
    case 1:
        bputs(&c->req, "GET /health HTTP/1.1\r\n" HOST "X-"), bfill(&c->req, 'N', len), bputs(&c->req, ": v\r\n\r\n");
        name(c, "header name %zu", len);
        break;
    default:
        bputs(&c->req, "GET /"), bfill(&c->req, 'p', len), bputs(&c->req, " HTTP/1.1\r\n" HOST "\r\n");
        name(c, "request line %zu", len);
        break;
    }
    c->expect[0] = "431 414 400 close"; /* close: it may close while we still send */
}

/* Over the limits: a block > 16 KiB of short-enough lines, > 100 lines; and just under both. */
static void gen_header_block(struct fcase *c, uint64_t *r)
{
    bputs(&c->req, "GET /health HTTP/1.1\r\n" HOST);
    unsigned v = rnd(r, 4);
    if (v == 0) {
        unsigned n = 17 + rnd(r, 40);
        for (unsigned i = 0; i < n; i++) bprintf(&c->req, "X-Pad-%u: ", i), bfill(&c->req, 'b', 1000), bputs(&c->req, "\r\n");
        c->expect[0] = "431 close";
        name(c, "%u x 1 KiB", n);
    } else if (v == 1) {
        unsigned n = 101 + rnd(r, 400);
        for (unsigned i = 0; i < n; i++) bprintf(&c->req, "X-H%u: %u\r\n", i, i);
        c->expect[0] = "431 close";
        name(c, "%u headers", n + 1);
    } else if (v == 2) { /* 99 lines in all: within the limit of 100 */
        for (unsigned i = 0; i < 98; i++) bprintf(&c->req, "X-H%u: %u\r\n", i, i);
        c->expect[0] = "200";
        name(c, "99 headers (allowed)");
    } else { /* 14 KiB: within 16 KiB */
        for (unsigned i = 0; i < 14; i++) bprintf(&c->req, "X-Pad-%u: ", i), bfill(&c->req, 'b', 1000), bputs(&c->req, "\r\n");
        c->expect[0] = "200";
        name(c, "14 KiB block (allowed)");
    }
    bputs(&c->req, "\r\n");
}

static void gen_content_length(struct fcase *c, uint64_t *r)
{
    static const struct { const char *v, *expect; } cl[] = {
        {"-1", "400 close"}, {"abc", "400 close"}, {"12abc", "400 close"}, {"0x20", "400 close"}, {"1e2", "400 close"},
        {"", "400 close"}, {"+%zu", "400 close"}, {"99999999999999999999999", "400 413 close"},
        {"18446744073709551616", "400 413 close"}, {"9223372036854775807", "400 413 close"}, {"9000000", "413 close"},
        {"%zu\r\nContent-Length: %zu1", "400 close"}, {"%zu\r\nContent-Length: %zu", GEN " 400"},
        {"%zu, %zu", GEN " 400"}, {" %zu ", GEN " 400"}, {"-0", "400 close"},
    };
    unsigned k = rnd(r, sizeof cl / sizeof *cl);
    struct buf body = {0};
    chat_body(&body, r, 0);
    char v[128];
    snprintf(v, sizeof v, cl[k].v, body.n, body.n);
    bprintf(&c->req, "POST /v1/chat/completions HTTP/1.1\r\n" HOST "Content-Type: application/json\r\nContent-Length: %s\r\n\r\n", v);
    bput(&c->req, body.p, body.n);
    free(body.p);
    /* a legal one is not half-closed: the server takes the EOF for the client's leaving and
     * cancels its generation, which then gets no answer when it takes longer than the check */
    c->shut_wr = !strstr(cl[k].expect, GEN);
    c->expect[0] = cl[k].expect;
    char e[80];
    escape(v, strlen(v), e, sizeof e);
    name(c, "Content-Length '%s'", e);
}

static void gen_body_short(struct fcase *c, uint64_t *r)
{
    struct buf body = {0};
    chat_body(&body, r, (int)rnd(r, 2));
    size_t claim = body.n + 1 + rnd(r, rnd(r, 2) ? 16 : 1000000);
    bprintf(&c->req, "POST /v1/chat/completions HTTP/1.1\r\n" HOST "Content-Length: %zu\r\n\r\n", claim);
    bput(&c->req, body.p, body.n);
    free(body.p);
    c->shut_wr = 1;
    c->expect[0] = "400 408 413 close";
    name(c, "%zu of %zu bytes", body.n, claim);
}

static void gen_chunked(struct fcase *c, uint64_t *r)
{
    static const struct { const char *what, *size, *expect; } bad[] = {
        {"non-hex", "zz", "400 close"}, {"negative", "-5", "400 close"}, {"huge", "ffffffffffffffffffffffff", "400 413 close"},
        {"2^63-1", "7fffffffffffffff", "400 413 close"}, {"empty", "", "400 close"}, {"0x prefix", "0x10", "400 close"},
        {"leading space", " 5", "400 close"}, {"over 8 MiB", "900000", "413 400 close"},
    };
    struct buf body = {0};
    chat_body(&body, r, 0);
    bputs(&c->req, "POST /v1/chat/completions HTTP/1.1\r\n" HOST "Transfer-Encoding: chunked\r\n\r\n");
    unsigned v = rnd(r, 14);
    c->expect[0] = "400 close";
    c->shut_wr = 1;
    if (v < 8) {
        bprintf(&c->req, "%s\r\n", bad[v].size), bput(&c->req, body.p, body.n), bputs(&c->req, "\r\n0\r\n\r\n");
        c->expect[0] = bad[v].expect;
        name(c, "size %s", bad[v].what);
    } else if (v == 8) {
        bprintf(&c->req, "%zx\r\n", body.n), bput(&c->req, body.p, body.n), bputs(&c->req, "XX0\r\n\r\n");
        name(c, "no CR LF after the data");
    } else if (v == 9) {
        bprintf(&c->req, "%zx\r\n", body.n + 100), bput(&c->req, body.p, body.n);
        c->expect[0] = "400 408 close";
        name(c, "truncated chunk");
    } else if (v == 10) {
        bprintf(&c->req, "%zx\r\n", body.n), bput(&c->req, body.p, body.n), bputs(&c->req, "\r\n");
        c->expect[0] = "400 408 close";
        name(c, "no last chunk");
    } else if (v == 11) { /* legal: extensions, upper-case hex, leading zeros, a trailer */
        bprintf(&c->req, "00%zX;ext=1\r\n", body.n), bput(&c->req, body.p, body.n), bputs(&c->req, "\r\n0\r\nX-Trailer: t\r\n\r\n");
        c->expect[0] = GEN " 400";
        c->shut_wr = 0;
        name(c, "extension and trailer (legal)");
    } else if (v == 12) { /* 9 MiB of real chunks: over the body limit */
        for (int i = 0; i < 9; i++) bputs(&c->req, "100000\r\n"), bfill(&c->req, ' ', 0x100000), bputs(&c->req, "\r\n");
        bputs(&c->req, "0\r\n\r\n");
        c->expect[0] = "413 400 close";
        name(c, "9 MiB of chunks");
    } else { /* chunked and Content-Length together: chunked wins, or 400 */
        c->req.n = 0;
        bprintf(&c->req, "POST /v1/chat/completions HTTP/1.1\r\n" HOST "Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n%zx\r\n", body.n);
        bput(&c->req, body.p, body.n), bputs(&c->req, "\r\n0\r\n\r\n");
        c->expect[0] = GEN " 400";
        c->shut_wr = 0;
        name(c, "chunked with Content-Length");
    }
    free(body.p);
}

/* Header bytes: NUL, invalid UTF-8, control characters, odd syntax. */
static void gen_header_bytes(struct fcase *c, uint64_t *r)
{
    static const struct { const char *h; size_t n; const char *expect, *what; } hs[] = {
#define H(s, e, w) {s, sizeof(s) - 1, e, w}
        H("X-Nul: a\0b\r\n", "400 200", "NUL in a value"), H("X-\0Nul: a\r\n", "400 close", "NUL in a name"),
        H("X-Utf: \xff\xfe\xc0\xaf\r\n", "200 400", "invalid UTF-8 value"), H("X-\xc3\xa9: v\r\n", "400 200", "UTF-8 name"),
        H("X-Cr: a\rb\r\n", "400 200", "bare CR"), H("NoColon\r\n", "400 close", "no colon"),
        H("Space : v\r\n", "400 close", "space before colon"), H(": empty-name\r\n", "400 close", "empty name"),
        H("X-Fold: a\r\n folded\r\n", "400 200", "obs-fold"), H("X(Y): z\r\n", "400 200", "bad name chars"),
        H("X-Ctl: \x01\x02\x7f\r\n", "400 200", "control chars"), H("Authorization: Bearer \xff\r\n", "200 400", "junk bearer"),
        H("Expect: 100-continue\r\n", "200 417", "Expect on a GET"), H("Expect: teapot\r\n", "417 200 400", "unknown Expect"),
        H("Connection: close, keep-alive, \xff\r\n", "200 400", "odd Connection"), H(HOST, "200 400", "duplicate Host"),
        H("X-Lf: a\nX-Other: b\n", "200 400 close", "bare LF line ends"),
        H("Origin: http://localhost:1\r\n", "200", "a page of this machine"), H("Origin: https://evil.example\r\n", "403", "a page of another site"),
        H("Origin: http://localhost:\xff\r\n", "403", "a junk origin port"), H("Origin: \r\n", "200", "an empty Origin"),
        H("Origin: http://localhost.example.example.example.example.example.example.example.example.example.example.example.example"
          ".example.example.example.example.example.example.example.example.example.example.example.example.example.example.example"
          ".example.example.example.example.example.example\r\n", "400", "an Origin over 255 bytes"),
        H("Access-Control-Request-Headers: \xff, \x80\r\n", "200", "junk preflight headers on a GET"),
#undef H
    };
    unsigned k = rnd(r, sizeof hs / sizeof *hs);
    bputs(&c->req, "GET /health HTTP/1.1\r\n" HOST);
    bput(&c->req, hs[k].h, hs[k].n);
    bputs(&c->req, "\r\n");
    c->expect[0] = hs[k].expect;
    name(c, "%s", hs[k].what);
}

static void gen_path(struct fcase *c, uint64_t *r)
{
    static const struct { const char *p; size_t n; const char *expect; } ps[] = {
#define P(s, e) {s, sizeof(s) - 1, e}
        P("/health\0x", "400 404 close"), P("/\xff\xfe", "400 404"), P("/%00", "400 404"), P("/../../../etc/passwd", "400 404"),
        P("*", "400 404 405"), P("", "400 close"), P("health", "400 404"), P("http://127.0.0.1/health", "200 400 404"),
        P("/health?x=1&y=%zz", "200 400 404"), P("/v1/models/", "200 404"), P("//health", "200 400 404"),
        P("/HEALTH", "200 404"), P("/v1/chat/completions/../../health", "200 400 404"), P("/\r", "400 close"),
        P("/v1/\xc0\xaf", "400 404"), P("/%2e%2e/health", "200 400 404"), P("/health#frag", "200 400 404"),
#undef P
    };
    unsigned k = rnd(r, sizeof ps / sizeof *ps + 1);
    bputs(&c->req, "GET ");
    char e[64];
    if (k < sizeof ps / sizeof *ps) {
        bput(&c->req, ps[k].p, ps[k].n), c->expect[0] = ps[k].expect;
        escape(ps[k].p, ps[k].n, e, sizeof e);
        name(c, "path '%s'", e);
    } else {
        bputs(&c->req, "/"), brep(&c->req, "x/", 4000), c->expect[0] = "404 414 400 431";
        name(c, "8 KB path");
    }
    bputs(&c->req, " HTTP/1.1\r\n" HOST "\r\n");
}

/* Invalid JSON and JSON at its edges, as a chat body. */
static void gen_bad_json(struct fcase *c, uint64_t *r)
{
#define MSG "{\"messages\":[{\"role\":\"user\",\"content\":"
    static const struct { const char *s; size_t n; const char *expect, *what; } js[] = {
#define J(s, e, w) {s, sizeof(s) - 1, e, w}
        J("", "400", "empty body"), J("null", "400", "null"), J("[]", "400", "array"), J("123", "400", "number"),
        J("\"str\"", "400", "string"), J("{}", "400", "no messages"), J(MSG "\"hi\"}],\"max_tokens\":2} x", "400", "trailing garbage"),
        J(MSG "\"hi\"}],\"max_tokens\":2}{}", "400", "two objects"), J(MSG "\"hi\"}],\"max_tokens\":1e999999}", "400", "max_tokens 1e999999"),
        J(MSG "\"hi\"}],\"max_tokens\":2,\"seed\":1e999999}", "400 200 503", "seed 1e999999"),
        J(MSG "\"hi\"}],\"max_tokens\":123456789012345678901234567890}", GEN " 400", "max_tokens 30 digits"),
        J(MSG "\"hi\"}],\"max_tokens\":2,\"temperature\":123456789012345678901234567890}", GEN " 400", "temperature 30 digits"),
        J(MSG "\"hi\"}],\"max_tokens\":2,\"temperature\":-0}", GEN " 400", "-0"),
        J(MSG "\"hi\"}],\"max_tokens\":01}", "400", "leading zero"), J(MSG "\"hi\"}],\"max_tokens\":+1}", "400", "plus sign"),
        J(MSG "\"hi\"}],\"max_tokens\":1.}", "400", "1."), J(MSG "\"hi\"}],\"max_tokens\":.5}", "400", ".5"),
        J(MSG "\"hi\"}],\"max_tokens\":1e}", "400", "1e"), J(MSG "\"hi\"}],\"max_tokens\":NaN}", "400", "NaN"),
        J(MSG "\"hi\"}],\"max_tokens\":Infinity}", "400", "Infinity"), J(MSG "\"hi\"}],\"max_tokens\":0x10}", "400", "hex number"),
        J(MSG "\"\\x41\"}],\"max_tokens\":2}", "400", "escape \\x"), J(MSG "\"\\u12\"}],\"max_tokens\":2}", "400", "short \\u"),
        J(MSG "\"\\u12G4\"}],\"max_tokens\":2}", "400", "bad hex \\u"), J(MSG "\"abc}],\"max_tokens\":2}", "400", "unterminated string"),
        J(MSG "\"a\x01b\"}],\"max_tokens\":2}", "400", "raw control char"), J(MSG "\"a\nb\"}],\"max_tokens\":2}", "400", "raw newline"),
        J(MSG "\"a\0b\"}],\"max_tokens\":2}", "400", "raw NUL"), J(MSG "\"\\u0000\"}],\"max_tokens\":2}", GEN " 400", "\\u0000"),
        J(MSG "\"\\ud800\"}],\"max_tokens\":2}", GEN " 400", "lone \\ud800"), J(MSG "\"\\udc00x\"}],\"max_tokens\":2}", GEN " 400", "lone \\udc00"),
        J(MSG "\"\\ud800\\u0041\"}],\"max_tokens\":2}", GEN " 400", "high + non-low surrogate"),
        J(MSG "\"\\ud83d\\ude00\"}],\"max_tokens\":2}", GEN, "valid surrogate pair"),
        J(MSG "\"\xff\xfe\"}],\"max_tokens\":2}", GEN " 400", "invalid UTF-8"), J(MSG "\"\xc0\x80\"}],\"max_tokens\":2}", GEN " 400", "overlong UTF-8"),
        J(MSG "\"\xe2\x82\"}],\"max_tokens\":2}", GEN " 400", "truncated UTF-8"), J(MSG "\"\xed\xa0\x80\"}],\"max_tokens\":2}", GEN " 400", "UTF-8 surrogate"),
        J("\xef\xbb\xbf" MSG "\"hi\"}],\"max_tokens\":2}", GEN " 400", "BOM"),
        J(MSG "\"a\"}],\"messages\":[{\"role\":\"user\",\"content\":\"b\"}],\"max_tokens\":2}", GEN " 400", "duplicate key"),
        J("{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":2,}", "400", "trailing comma"),
        J("{'messages':[]}", "400", "single quotes"), J("{\"messages\" [1]}", "400", "missing colon"),
#undef J
    };
    unsigned n = sizeof js / sizeof *js, k = rnd(r, n + 6);
    struct buf body = {0};
    const char *expect = "400";
    if (k < n) bput(&body, js[k].s, js[k].n), expect = js[k].expect, name(c, "%s", js[k].what);
    else if (k == n) { /* truncated valid body */
        chat_body(&body, r, 0);
        body.n = rnd(r, (unsigned)body.n);
        name(c, "truncated at %zu", body.n);
    } else if (k == n + 1) bfill(&body, '[', 100000), name(c, "100000 '['");
    else if (k == n + 2) bputs(&body, "{\"messages\":"), bfill(&body, '[', 100000), name(c, "messages: 100000 '['");
    else if (k == n + 3) brep(&body, "{\"a\":", 50000), name(c, "50000 nested objects");
    else if (k == n + 4) { /* deep but valid, in a field that is ignored */
        bputs(&body, "{\"x\":"), bfill(&body, '[', 1000), bfill(&body, ']', 1000);
        bputs(&body, ",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":2}");
        expect = GEN " 400", name(c, "1000 deep in an unknown field");
    } else { /* a prompt longer than the context: 400 naming both lengths */
        bputs(&body, MSG "\"");
        if (rnd(r, 2)) brep(&body, "lorem ipsum dolor ", 3000), name(c, "54 KB prompt of words");
        else bfill(&body, 'x', 20000), name(c, "20 KB single-word prompt");
        bputs(&body, "\"}],\"max_tokens\":2}");
        expect = "400";
    }
    post(&c->req, "/v1/chat/completions", body.p, body.n, "Connection: close\r\n");
    free(body.p);
    c->expect[0] = expect;
#undef MSG
}

/* /tokenize and /detokenize: bodies valid, odd and wrong (ids below 10: any model's vocabulary holds them). */
static void gen_tokenizer(struct fcase *c, uint64_t *r)
{
    static const struct { const char *path, *body, *expect; } ts[] = {
        {"/tokenize", "{\"content\":\"hi\"}", "200"}, {"/tokenize", "{\"content\":\"<|im_start|>a\",\"with_pieces\":true}", "200"},
        {"/tokenize", "{\"content\":\"\xff\xfe\"}", "200 400"}, {"/tokenize", "{\"content\":\"\\u0000x\",\"parse_special\":false}", "200"},
        {"/tokenize", "{\"content\":\"\"}", "200"}, {"/tokenize", "{\"content\":null}", "400"}, {"/tokenize", "{}", "400"},
        {"/tokenize", "[\"hi\"]", "400"}, {"/detokenize", "{\"tokens\":[0,1,9]}", "200"}, {"/detokenize", "{\"tokens\":[]}", "200"},
        {"/detokenize", "{\"tokens\":[-1]}", "400"}, {"/detokenize", "{\"tokens\":[1.5]}", "400"}, {"/detokenize", "{\"tokens\":[1e300]}", "400"},
        {"/detokenize", "{\"tokens\":[\"a\"]}", "400"}, {"/detokenize", "{\"tokens\":{}}", "400"}, {"/detokenize", "{}", "400"},
    };
    unsigned n = sizeof ts / sizeof *ts, k = rnd(r, n + 2);
    struct buf body = {0};
    const char *path = k < n ? ts[k].path : k == n ? "/tokenize" : "/detokenize";
    if (k < n) bputs(&body, ts[k].body), c->expect[0] = ts[k].expect, name(c, "%s %.40s", path, ts[k].body);
    else if (k == n) bputs(&body, "{\"content\":\""), brep(&body, "lorem ipsum ", 5000), bputs(&body, "\"}"), name(c, "/tokenize 60 KB");
    else bputs(&body, "{\"tokens\":["), brep(&body, "7,", 50000), bputs(&body, "7]}"), name(c, "/detokenize 50001 ids");
    if (k >= n) c->expect[0] = "200";
    post(&c->req, path, body.p, body.n, NULL);
    free(body.p);
}

/* Anthropic's /v1/messages and /v1/messages/count_tokens: bodies valid (every block kind), odd and wrong in each field.
 * An error comes in Anthropic's shape; a 200 is a message (or its events), or a count (which reads no generation
 * settings: a bad max_tokens or schema is counted all the same). */
static void gen_messages(struct fcase *c, uint64_t *r)
{
#define U "{\"role\":\"user\",\"content\":\"x\"}"
    static const struct { const char *body, *expect, *count; } ms[] = {
        {"{\"max_tokens\":2,\"messages\":[" U "]}", GEN, NULL},
        {"{\"max_tokens\":2,\"system\":[{\"type\":\"text\",\"text\":\"s\"}],\"stream\":true,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
         "\"text\":\"hi\",\"cache_control\":{\"type\":\"ephemeral\"}}]}]}", GEN, NULL},
        {ANTHROPIC_BODY, GEN " 400", NULL}, /* 400: its tools block may not fit a small -c */
        {"{\"max_tokens\":2,\"messages\":[{\"role\":\"system\",\"content\":\"\"}," U ",{\"role\":\"system\",\"content\":\"r\"}]}", GEN, NULL},
        {"{\"max_tokens\":1,\"messages\":[" U "],\"output_format\":{\"type\":\"json_schema\",\"schema\":{\"type\":\"object\"}}}", GEN, NULL},
        {"{\"max_tokens\":1,\"messages\":[" U "],\"tool_choice\":{\"type\":\"any\"}}", "400", NULL},
        {"{\"max_tokens\":1,\"messages\":[" U "],\"output_format\":{\"type\":\"json_schema\",\"schema\":{\"type\":\"object\",\"pattern\":\"x\"}}}", "400", "200"},
        {"{\"messages\":[" U "],\"max_tokens\":\"2\"}", "400", "200"}, {"{\"messages\":[" U "],\"stop_sequences\":\"x\"}", "400", NULL},
        {"{\"messages\":[" U "],\"thinking\":\"on\"}", "400", NULL},
        {"{\"max_tokens\":3,\"messages\":[" U "],\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":1}}", GEN, NULL},
        {"{\"max_tokens\":1,\"system\":[{\"type\":\"text\",\"text\":\"x-anthropic-billing-header: cch=1;\"}],\"messages\":[" U "]}", GEN, NULL},
        {"{\"messages\":[" U "],\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":-1}}", "400", NULL}, {"{\"messages\":[" U "],\"tool_choice\":\"auto\"}", "400", NULL},
        {"{\"messages\":[" U "],\"tool_choice\":{\"type\":\"tool\"}}", "400", NULL}, {"{\"messages\":[" U "],\"tools\":{}}", "400", NULL},
        {"{\"messages\":[" U "],\"tools\":[{\"name\":5,\"input_schema\":{}}]}", "400", NULL}, {"{\"messages\":[" U "],\"tools\":[null]}", "400", NULL},
        {"{\"messages\":[" U "],\"system\":[{\"type\":\"image\"}]}", "400", NULL}, {"{\"messages\":[" U ",{\"role\":\"system\",\"content\":5}]}", "400", NULL},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":[{\"type\":\"tool_use\",\"name\":\"f\",\"input\":[]}]}]}", "400", NULL},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":[{\"type\":\"thinking\",\"thinking\":5}]}]}", "400", NULL},
        {"{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"content\":[{\"type\":\"tool_result\"}]}]}]}", "400", NULL},
        {"{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"content\":7}]}]}", "400", NULL},
        {"{\"messages\":[{\"role\":\"user\",\"content\":[null]}]}", "400", NULL}, {"{\"messages\":[{\"role\":\"user\",\"content\":{}}]}", "400", NULL},
        {"{\"messages\":[{\"role\":\"user\"}]}", "400", NULL}, {"{\"messages\":[null]}", "400", NULL}, {"{\"messages\":null}", "400", NULL},
        {"{\"messages\":[]}", GEN " 400", NULL}, {"[]", "400", NULL}, {"{\"messages\":[{\"role\":\"user\",\"content\":\"\\u0000\"}],\"max_tokens\":1}", GEN " 400", NULL},
    };
#undef U
    unsigned n = sizeof ms / sizeof *ms, k = rnd(r, n);
    int count = rnd(r, 4) == 0, valid = !strcmp(ms[k].expect, GEN);
    const char *path = count ? "/v1/messages/count_tokens" : "/v1/messages";
    c->expect[0] = count && ms[k].count ? ms[k].count : count && valid ? "200" : ms[k].expect;
    c->body_has = count ? "{\"input_tokens\":" : "\"type\":\"message";
    c->error_has = "{\"type\":\"error\",\"error\":{\"type\":\"";
    name(c, "%s %.44s", count ? "count" : "create", ms[k].body);
    post(&c->req, path, ms[k].body, strlen(ms[k].body), NULL);
}

/* OpenAI's /v1/responses and /v1/responses/input_tokens: bodies valid (every item and tool kind, streamed too), odd and
 * wrong in each field. An error comes in OpenAI's shape; a 200 is a response (or its events), or a count. */
static void gen_responses(struct fcase *c, uint64_t *r)
{
#define U "{\"role\":\"user\",\"content\":\"x\"}"
    static const struct { const char *body, *expect; } rs[] = {
        {"{\"max_output_tokens\":2,\"input\":\"x\"}", GEN}, {"{\"max_output_tokens\":2,\"instructions\":\"s\",\"stream\":true,\"input\":[" U "]}", GEN},
        {RESPONSES_BODY, GEN " 400"}, /* 400: its tools block may not fit a small -c */
        {"{\"max_output_tokens\":2,\"input\":[" U ",{\"role\":\"system\",\"content\":\"late\"}," U "]}", GEN},
        {"{\"max_output_tokens\":2,\"input\":[{\"type\":\"reasoning\",\"summary\":[{\"type\":\"summary_text\",\"text\":\"s\"}]}," U "]}", GEN},
        {"{\"max_output_tokens\":2,\"input\":[{\"type\":\"reasoning\",\"encrypted_content\":\"e\"}," U "]}", GEN},
        {"{\"max_output_tokens\":1,\"input\":\"x\",\"text\":{\"format\":{\"type\":\"json_schema\",\"name\":\"n\",\"schema\":{\"type\":\"object\"}}}}", GEN},
        {"{\"max_output_tokens\":1,\"input\":\"x\",\"text\":{\"format\":{\"type\":\"json_object\"}}}", GEN},
        {"{\"max_output_tokens\":1,\"input\":\"x\",\"reasoning\":{\"effort\":\"none\"},\"tool_choice\":\"none\"}", GEN},
        {"{\"input\":\"x\",\"previous_response_id\":\"resp_1\"}", "400"}, {"{\"input\":\"x\",\"background\":true}", "400"},
        {"{\"input\":\"x\",\"max_output_tokens\":0}", "400"}, {"{\"input\":5}", "400"}, {"{\"input\":null}", "400"}, {"{}", "400"},
        {"{\"input\":[null]}", "400"}, {"{\"input\":[{\"type\":\"item_reference\",\"id\":\"i\"}]}", "400"},
        {"{\"input\":[{\"role\":\"user\",\"content\":[{\"type\":\"input_file\"}]}]}", "400"}, {"{\"input\":[{\"role\":\"user\",\"content\":{}}]}", "400"},
        {"{\"input\":[{\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",\"text\":5}]}]}", "400"},
        {"{\"input\":[{\"type\":\"function_call\",\"name\":\"f\",\"arguments\":{}}]}", "400"},
        {"{\"input\":[{\"type\":\"function_call_output\",\"output\":\"r\"}]}", "400"}, {"{\"input\":[{\"role\":\"tool\",\"content\":\"x\"}]}", "400"},
        {"{\"input\":\"x\",\"instructions\":[]}", "400"}, {"{\"input\":\"x\",\"tools\":{}}", "400"}, {"{\"input\":\"x\",\"tools\":[{\"type\":\"function\"}]}", "400"},
        {"{\"input\":\"x\",\"tool_choice\":{\"type\":\"file_search\"}}", "400"}, {"{\"input\":\"x\",\"reasoning\":{\"effort\":7}}", "400"},
        {"{\"input\":\"x\",\"text\":{\"format\":{\"type\":\"xml\"}}}", "400"}, {"{\"input\":[],\"max_output_tokens\":1}", GEN " 400"},
        {"{\"input\":\"\\u0000\",\"max_output_tokens\":1}", GEN " 400"},
    };
#undef U
    unsigned k = rnd(r, sizeof rs / sizeof *rs);
    int count = rnd(r, 4) == 0; /* input_tokens: no generation, so no 503, and any context holds the prompt */
    c->expect[0] = !count || !strcmp(rs[k].expect, "400") ? rs[k].expect : "200 400";
    c->body_has = count ? "\"object\":\"response.input_tokens\"" : "\"object\":\"response\"";
    c->error_has = "{\"error\":{";
    name(c, "%s %.56s", count ? "count" : "create", rs[k].body);
    post(&c->req, count ? "/v1/responses/input_tokens" : "/v1/responses", rs[k].body, strlen(rs[k].body), NULL);
}

/* Ollama's /api/chat, /api/generate and /api/show: bodies valid (streamed or not, raw, loads), odd and wrong in each
 * field. An error comes in Ollama's shape, {"error": MESSAGE}; a 200 is a done line (or lines), or the model shown. */
static void gen_ollama(struct fcase *c, uint64_t *r)
{
#define U "{\"role\":\"user\",\"content\":\"x\"}"
    static const struct { const char *path, *body, *expect; } os[] = {
        {"/api/chat", "{\"messages\":[" U "],\"stream\":false,\"options\":{\"num_predict\":2}}", GEN},
        {"/api/chat", "{\"messages\":[" U "],\"options\":{\"num_predict\":2,\"temperature\":0.5,\"stop\":[\"a\"]},\"think\":true}", GEN},
        {"/api/chat", "{\"messages\":[{\"role\":\"assistant\",\"content\":\"\",\"thinking\":\"t\",\"tool_calls\":[{\"function\":{\"name\":\"f\","
         "\"arguments\":{\"k\":1}}}]},{\"role\":\"tool\",\"content\":\"r\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
         "\"options\":{\"num_predict\":1}}", GEN " 400"},
        {"/api/chat", "{\"messages\":[]}", "200"}, {"/api/generate", "{}", "200"}, {"/api/generate", "{\"prompt\":\"\",\"stream\":true}", "200"},
        {"/api/generate", "{\"prompt\":\"x\",\"raw\":true,\"options\":{\"num_predict\":2}}", GEN},
        {"/api/generate", "{\"prompt\":\"x\",\"system\":\"s\",\"format\":\"json\",\"options\":{\"num_predict\":2}}", GEN},
        {"/api/generate", "{\"prompt\":\"x\",\"format\":{\"type\":\"object\"},\"stream\":false,\"options\":{\"num_predict\":1}}", GEN},
        {"/api/show", "{\"model\":\"anything\"}", "200"}, {"/api/show", "{}", "200"},
        {"/api/chat", "{\"messages\":5}", "400"}, {"/api/chat", "{\"messages\":[5]}", "400"}, {"/api/chat", "{\"messages\":[{\"content\":\"x\"}]}", "400"},
        {"/api/chat", "{\"messages\":[" U "],\"options\":[]}", "400"}, {"/api/chat", "{\"messages\":[" U "],\"options\":{\"num_predict\":0.5}}", "400"},
        {"/api/chat", "{\"messages\":[" U "],\"think\":7}", "400"}, {"/api/chat", "{\"messages\":[" U "],\"stream\":\"yes\"}", "400"},
        {"/api/chat", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"images\":[\"aGk=\"]}]}", "400"},
        {"/api/chat", "{\"messages\":[{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"function\":{}}]}]}", "400"},
        {"/api/generate", "{\"prompt\":5}", "400"}, {"/api/generate", "{\"prompt\":\"x\",\"suffix\":\"y\"}", "400"},
        {"/api/generate", "{\"prompt\":\"x\",\"raw\":\"no\"}", "400"}, {"/api/generate", "{\"prompt\":\"x\",\"format\":7}", "400"},
        {"/api/generate", "{\"prompt\":\"x\",\"context\":[1,2]}", "400"}, {"/api/generate", "[]", "400"},
    };
#undef U
    unsigned k = rnd(r, sizeof os / sizeof *os);
    c->expect[0] = os[k].expect;
    c->body_has = strcmp(os[k].path, "/api/show") ? "\"done\":true" : "\"model_info\"";
    c->error_has = "{\"error\":\"";
    name(c, "%s %.56s", os[k].path, os[k].body);
    post(&c->req, os[k].path, os[k].body, strlen(os[k].body), NULL);
}

/* Valid JSON with a wrong type (or a bad value) in one field: 400 whose error.param names it. */
static void gen_wrong_type(struct fcase *c, uint64_t *r)
{
    static const struct { const char *field, *value, *expect; int type_error; } ws[] = {
        {"messages", "5", "400", 1}, {"messages", "\"hi\"", "400", 1}, {"messages", "{}", "400", 1}, {"messages", "null", "400", 1},
        {"messages", "true", "400", 1}, {"messages", "[]", "400", 0}, {"messages", "[1]", "400", 1}, {"messages", "[\"hi\"]", "400", 1},
        {"messages", "[{\"role\":1,\"content\":\"x\"}]", "400", 1}, {"messages", "[{\"role\":\"user\",\"content\":{}}]", "400", 1},
        {"messages", "[{\"role\":\"user\",\"content\":5}]", "400", 1}, {"messages", "[{\"role\":\"user\"}]", "400", 0},
        {"messages", "[{\"content\":\"x\"}]", "400", 0}, {"messages", "[{\"role\":\"wizard\",\"content\":\"x\"}]", "400", 0},
        {"messages", "[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"hi\"}]}]", GEN " 400", 0},
        {"prompt", "5", "400", 1}, {"prompt", "{}", "400", 1}, {"prompt", "null", "400", 1}, {"prompt", "true", "400", 1},
        {"prompt", "[1,2]", GEN " 400", 0}, {"prompt", "[\"a\",\"b\"]", GEN " 400", 0},
        {"max_tokens", "\"4\"", "400", 1}, {"max_tokens", "true", "400", 1}, {"max_tokens", "{}", "400", 1},
        {"max_tokens", "[]", "400", 1}, {"max_tokens", "4.5", "400", 1}, {"max_tokens", "-1", "400", 0},
        {"max_tokens", "0", GEN " 400", 0}, {"max_tokens", "1e12", GEN " 400", 0}, {"max_tokens", "null", GEN " 400", 0},
        {"max_completion_tokens", "\"4\"", "400", 1}, {"max_completion_tokens", "-1", "400", 0},
        {"temperature", "\"hot\"", "400", 1}, {"temperature", "true", "400", 1}, {"temperature", "[]", "400", 1},
        {"temperature", "-1", GEN " 400", 0}, {"temperature", "1e308", GEN " 400", 0},
        {"top_p", "\"x\"", "400", 1}, {"top_p", "2", GEN " 400", 0}, {"top_p", "-0.5", GEN " 400", 0},
        {"top_k", "\"x\"", "400", 1}, {"top_k", "1.5", GEN " 400", 0}, {"top_k", "-1", GEN " 400", 0},
        {"min_p", "\"x\"", "400", 1}, {"min_p", "{}", "400", 1}, {"seed", "\"x\"", "400", 1}, {"seed", "{}", "400", 1},
        {"seed", "-1", GEN " 400", 0}, {"seed", "1e30", GEN " 400", 0},
        {"stop", "123", "400", 1}, {"stop", "[1]", "400", 1}, {"stop", "{\"a\":1}", "400", 1}, {"stop", "@5", "400", 0},
        {"stop", "@100", "400", 0}, {"stop", "[\"\"]", GEN " 400", 0}, {"stop", "\"\"", GEN " 400", 0}, {"stop", "[]", GEN " 400", 0},
        {"stop", "null", GEN " 400", 0}, {"stream", "\"yes\"", "400", 1}, {"stream", "1", "400", 1}, {"stream", "{}", "400", 1},
        {"stream_options", "1", "400", 1}, {"stream_options", "\"x\"", "400", 1},
        {"stream_options", "{\"include_usage\":\"y\"}", "400", 1}, {"repeat_penalty", "\"x\"", "400", 1},
        {"presence_penalty", "\"x\"", "400", 1}, {"frequency_penalty", "[]", "400", 1},
        {"unknown_field", "{\"deep\":[1,{\"x\":null}]}", GEN, 0}, {"n", "2", GEN " 400", 0}, {"logprobs", "true", GEN " 400", 0},
        {"logprobs", "\"x\"", "400", 1}, {"logprobs", "21", "400", 1}, {"logprobs", "3", GEN " 400", 0},
        {"top_logprobs", "\"x\"", GEN " 400", 0}, {"top_logprobs", "21", GEN " 400", 0}, {"logit_bias", "[1]", "400", 1},
        {"logit_bias", "{\"x\":1}", "400", 1}, {"logit_bias", "{\"1\":1e9}", "400", 1}, {"logit_bias", "{\"99999999\":1}", "400", 1},
        {"logit_bias", "{\"\":1}", "400", 1}, {"logit_bias", "{\"1\":-100,\"2\":100}", GEN, 0}, {"tool_choice", "\"required\"", GEN " 400", 0},
        {"tool_choice", "5", GEN " 400", 0}, {"parallel_tool_calls", "\"x\"", GEN " 400", 0}, {"parallel_tool_calls", "false", GEN, 0},
        {"echo", "true", GEN " 400", 0}, {"best_of", "3", GEN " 400", 0}, {"suffix", "\"x\"", GEN " 400", 0},
        {"response_format", "{\"type\":\"json_object\"}", GEN, 0}, {"response_format", "{\"type\":\"json_schema\"}", "400", 1},
        {"response_format", "5", "400", 1}, {"response_format", "{\"type\":\"json_schema\",\"json_schema\":5}", "400", 1},
        {"response_format", "{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"a\",\"schema\":{\"type\":\"object\",\"properties\":"
                            "{\"a\":{\"type\":\"integer\"},\"b\":{\"$ref\":\"#\"}},\"required\":[\"a\"]}}}", GEN, 0},
        {"response_format", "{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{\"$ref\":\"#\"}}}", "400", 1},
        {"response_format", "{\"type\":\"json_schema\",\"json_schema\":{\"schema\":[]}}", "400", 1},
        {"response_format", "{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{\"type\":\"object\",\"properties\":{\"a\":{\"enum\":[]}}}}}", "400", 1},
        {"response_format", "{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{\"type\":\"object\",\"properties\":{\"a\":{\"anyOf\":5}}}}}", "400", 1},
        {"thinking_budget_tokens", "\"2\"", "400", 1}, {"thinking_budget_tokens", "-2", "400", 0}, {"thinking_budget_tokens", "1.5", "400", 1},
        {"thinking_budget_tokens", "0", GEN " 400", 0}, {"thinking_budget_tokens", "1e12", "400", 0}, {"thinking_budget_message", "7", "400", 1},
        {"thinking_budget_message", "\"\\u0000<think>\"", GEN, 0},
    };
    unsigned k = rnd(r, sizeof ws / sizeof *ws);
    const char *f = ws[k].field;
    int completions = !strcmp(f, "prompt") || (strcmp(f, "messages") && rnd(r, 3) == 0);
    struct buf v = {0}, body = {0};
    if (ws[k].value[0] == '@') { /* more stop strings than the 4 allowed */
        int n = atoi(ws[k].value + 1);
        bputs(&v, "[");
        for (int i = 0; i < n; i++) bprintf(&v, "%s\"s%d\"", i ? "," : "", i);
        bputs(&v, "]");
    } else
        bputs(&v, ws[k].value);
    bputs(&body, "{");
    if (!strcmp(f, "messages") || !strcmp(f, "prompt")) bprintf(&body, "\"%s\":%s", f, v.p);
    else bputs(&body, completions ? "\"prompt\":\"hi\"" : "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]");
    if (strcmp(f, "max_tokens") && strcmp(f, "max_completion_tokens")) bputs(&body, ",\"max_tokens\":2");
    if (strcmp(f, "messages") && strcmp(f, "prompt")) bprintf(&body, ",\"%s\":%s", f, v.p);
    bputs(&body, "}");
    post(&c->req, completions ? "/v1/completions" : "/v1/chat/completions", body.p, body.n, NULL);
    c->expect[0] = ws[k].expect;
    if (ws[k].type_error)
        c->param = !strcmp(f, "messages") ? "messages|content|role" : !strcmp(f, "stream_options") ? "stream_options|include_usage" : f;
    char e[48];
    escape(v.p, v.n, e, sizeof e);
    name(c, "%s %s%s", f, e, completions ? " (completions)" : "");
    free(v.p), free(body.p);
}

static void gen_method(struct fcase *c, uint64_t *r)
{
    static const struct { const char *line; size_t n; const char *expect; int allow, head; } ms[] = {
#define M(s, e, a, h) {s, sizeof(s) - 1, e, a, h}
        M("GET /v1/chat/completions", "405", 1, 0), M("GET /v1/completions", "405", 1, 0), M("POST /health", "405", 1, 0),
        M("POST /v1/models", "405", 1, 0), M("PUT /v1/chat/completions", "405", 1, 0), M("DELETE /health", "405", 1, 0),
        M("PATCH /metrics", "405", 1, 0), M("FOO /health", "405 400 501", 0, 0), M("get /health", "400 405 501", 0, 0),
        M("G\0T /health", "400 405 501 close", 0, 0), M("OPTIONS /v1/chat/completions", "any", 0, 0),
        M("HEAD /health", "200 405", 0, 1), M("CONNECT 127.0.0.1:80", "400 404 405 501 close", 0, 0),
        M("TRACE /", "400 404 405 501", 0, 0), M("GET\t/health", "400 200 close", 0, 0), M("GET  /health", "400 200 404 close", 0, 0),
#undef M
    };
    unsigned k = rnd(r, sizeof ms / sizeof *ms + 1);
    if (k < sizeof ms / sizeof *ms) {
        size_t n = ms[k].n;
        bput(&c->req, ms[k].line, n);
        bputs(&c->req, " HTTP/1.1\r\n" HOST "Content-Length: 0\r\n\r\n");
        c->expect[0] = ms[k].expect;
        c->want_allow = ms[k].allow;
        c->head = ms[k].head;
        char e[40];
        escape(ms[k].line, n, e, sizeof e);
        name(c, "%s", e);
    } else {
        bfill(&c->req, 'A', 10000), bputs(&c->req, " /health HTTP/1.1\r\n" HOST "\r\n");
        c->expect[0] = "400 405 501 414 431 close";
        name(c, "10 KB method");
    }
}

static void gen_version(struct fcase *c, uint64_t *r)
{
    static const struct { const char *req, *expect; int close; } vs[] = {
        {"GET /health\r\n\r\n", "400 505 close", 0}, {"GET /health HTTP/2.0\r\n" HOST "\r\n", "400 505 close", 0},
        {"GET /health HTTP/1.2\r\n" HOST "\r\n", "200 400 505", 0}, {"GET /health HTTP/9.9\r\n" HOST "\r\n", "400 505 close", 0},
        {"GET /health HTTP/1\r\n" HOST "\r\n", "400 505 close", 0}, {"GET /health http/1.1\r\n" HOST "\r\n", "400 close", 0},
        {"GET /health HTTP/1.1 extra\r\n" HOST "\r\n", "400 close", 0}, {"GET /health HTTP/1.0\r\n\r\n", "200", 1},
        {"GET /health HTTP/1.1\r\n\r\n", "200 400", 0}, {"\r\n\r\nGET /health HTTP/1.1\r\n" HOST "\r\n", "200 400 close", 0},
        {"GET /health HTTP/1.10\r\n" HOST "\r\n", "200 400 505 close", 0}, {"GET /health HTTP/01.1\r\n" HOST "\r\n", "200 400 505 close", 0},
        {"GET /health HTTP/1.1\r\n" HOST "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n", "200", 0},
    };
    unsigned k = rnd(r, sizeof vs / sizeof *vs);
    bputs(&c->req, vs[k].req);
    c->expect[0] = vs[k].expect;
    c->want_close = vs[k].close;
    char e[48];
    escape(vs[k].req, strcspn(vs[k].req, "\r"), e, sizeof e);
    name(c, "%s", e);
}

/* The HTTP/2 connection preface and a frame or two: the server must refuse, not wait. */
static void gen_h2(struct fcase *c, uint64_t *r)
{
    static const char settings[] = "\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64";
    bputs(&c->req, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
    bput(&c->req, settings, sizeof settings - 1);
    unsigned frames = rnd(r, 3);
    for (unsigned i = 0; i < frames; i++) {
        unsigned char f[9 + 16];
        for (unsigned j = 0; j < sizeof f; j++) f[j] = (unsigned char)rng_next(r);
        f[0] = 0, f[1] = 0, f[2] = 16;
        bput(&c->req, f, sizeof f);
    }
    c->shut_wr = (int)rnd(r, 2);
    c->expect[0] = "400 405 501 505 close";
    name(c, "preface + %u frames%s", frames, c->shut_wr ? ", half-closed" : "");
}

/* Several requests in one write; the answers must come back complete and in order. */
static void gen_pipeline(struct fcase *c, uint64_t *r)
{
    unsigned n = 2 + rnd(r, 7), bad_at = rnd(r, 4) == 0 ? rnd(r, n) : n;
    struct buf body = {0};
    for (unsigned i = 0; i < n; i++) {
        body.n = 0;
        if (i == bad_at) { /* a malformed request: 400, then the server closes */
            bputs(&c->req, "GARBAGE\r\n\r\n");
            c->expect[i] = "400 close";
            n = i + 1;
            break;
        }
        switch (rnd(r, 8)) {
        case 0: get(&c->req, "/health", NULL), c->expect[i] = "200"; break;
        case 1: get(&c->req, "/v1/models", NULL), c->expect[i] = "200"; break;
        case 2: get(&c->req, "/metrics", NULL), c->expect[i] = "200"; break;
        case 3: get(&c->req, "/nope", NULL), c->expect[i] = "404"; break;
        case 4: bputs(&c->req, "POST /health HTTP/1.1\r\n" HOST "Content-Length: 0\r\n\r\n"), c->expect[i] = "405"; break;
        case 5: chat_body(&body, r, 1), post(&c->req, "/v1/chat/completions", body.p, body.n, NULL), c->expect[i] = GEN, c->sse |= 1u << i; break;
        case 6: completion_body(&body, r, 0), post(&c->req, "/v1/completions", body.p, body.n, NULL), c->expect[i] = GEN; break;
        default: /* a chunked body inside the pipeline */
            chat_body(&body, r, 0);
            bprintf(&c->req, "POST /v1/chat/completions HTTP/1.1\r\n" HOST "Transfer-Encoding: chunked\r\n\r\n%zx\r\n", body.n);
            bput(&c->req, body.p, body.n), bputs(&c->req, "\r\n0\r\n\r\n");
            c->expect[i] = GEN;
            break;
        }
    }
    free(body.p);
    c->n_resp = (int)n;
    name(c, "%u requests%s", n, bad_at < n ? ", the last malformed" : "");
}

static void gen_random(struct fcase *c, uint64_t *r)
{
    unsigned n = 1 + rnd(r, 4096), v = rnd(r, 3);
    if (v == 2) bputs(&c->req, "GET / HTTP/1.1\r\n"); /* garbage after a valid start */
    for (unsigned i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)rng_next(r);
        if (v == 1) ch = (unsigned char)(" \r\n:/GETPOSTHTP1.0{}\"[]"[ch % 23]); /* HTTP-ish alphabet */
        bput(&c->req, &ch, 1);
    }
    c->shut_wr = 1; /* else the server rightly waits 10 s for the header block */
    c->expect[0] = "any";
    name(c, "%s %u bytes", v == 0 ? "random" : v == 1 ? "http-alphabet" : "valid start +", n);
}

/* A valid request with a few random edits. */
static void gen_mutate(struct fcase *c, uint64_t *r)
{
    valid_request(&c->req, r);
    unsigned edits = 1 + rnd(r, 8);
    for (unsigned e = 0; e < edits && c->req.n > 1; e++) {
        size_t at = rnd(r, (unsigned)c->req.n);
        unsigned op = rnd(r, 4);
        if (op == 0) c->req.p[at] = (char)rng_next(r);
        else if (op == 1) memmove(c->req.p + at, c->req.p + at + 1, c->req.n - at - 1), c->req.n--;
        else if (op == 2) c->req.p[at] ^= (char)(1 << rnd(r, 8));
        else { /* insert a byte: CR, LF, NUL, quote or random */
            static const char ins[] = "\r\n\0\"\\{";
            char ch = rnd(r, 2) ? ins[rnd(r, 6)] : (char)rng_next(r);
            bput(&c->req, "", 1);
            memmove(c->req.p + at + 1, c->req.p + at, c->req.n - at - 1);
            c->req.p[at] = ch;
        }
    }
    c->shut_wr = 1;
    c->expect[0] = "any";
    name(c, "%u edits", edits);
}

/* Requests that must work: keep the server honest between the hostile ones. */
static void gen_valid(struct fcase *c, uint64_t *r)
{
    struct buf body = {0};
    unsigned v = rnd(r, 9);
    c->expect[0] = GEN;
    if (v == 0) get(&c->req, "/health", NULL), c->expect[0] = "200", c->body_has = "ok", name(c, "health");
    else if (v == 1) get(&c->req, "/v1/models", NULL), c->expect[0] = "200", c->body_has = "\"list\"", name(c, "models");
    else if (v == 2) get(&c->req, "/metrics", NULL), c->expect[0] = "200", c->body_has = "coli_requests_total", name(c, "metrics");
    else if (v == 3) chat_body(&body, r, 0), post(&c->req, "/v1/chat/completions", body.p, body.n, NULL), c->body_has = "chat.completion", name(c, "chat");
    else if (v == 4) chat_body(&body, r, 1), post(&c->req, "/v1/chat/completions", body.p, body.n, NULL), c->sse = 1, name(c, "chat stream");
    else if (v == 5) completion_body(&body, r, (int)rnd(r, 2)), post(&c->req, "/v1/completions", body.p, body.n, NULL), c->sse = 1, name(c, "completion");
    else if (v == 6) { /* Expect: 100-continue: the body only after the 100 */
        chat_body(&body, r, 0);
        post(&c->req, "/v1/chat/completions", body.p, body.n, "Expect: 100-continue\r\n");
        c->split = c->req.n - body.n, c->wait100 = 1;
        name(c, "Expect: 100-continue");
    } else if (v == 7) { /* headers and body in separate writes, 50 ms apart */
        chat_body(&body, r, 0);
        post(&c->req, "/v1/chat/completions", body.p, body.n, NULL);
        c->split = c->req.n - body.n + rnd(r, (unsigned)body.n);
        name(c, "split write");
    } else get(&c->req, "/nope", NULL), c->expect[0] = "404", name(c, "unknown path");
    free(body.p);
}

/* Clients that leave: right after sending, or after the first bytes, sometimes with a reset. */
static void gen_abort(struct fcase *c, uint64_t *r)
{
    struct buf body = {0};
    chat_body(&body, r, (int)rnd(r, 2));
    post(&c->req, "/v1/chat/completions", body.p, body.n, NULL);
    free(body.p);
    c->abort = 1 + (int)rnd(r, 2);
    if (rnd(r, 4) == 0) c->req.n -= body.n / 2, c->abort = 1; /* gone mid-body */
    c->expect[0] = "any";
    name(c, "%s", c->abort == 1 ? "close after send" : "close after first bytes");
}

static const struct category {
    const char *name;
    void (*gen)(struct fcase *, uint64_t *);
    unsigned weight;
} cats[] = {
    {"trunc_reqline", gen_trunc_reqline, 5}, {"trunc_headers", gen_trunc_headers, 5}, {"long_line", gen_long_line, 4},
    {"header_block", gen_header_block, 5},   {"content_length", gen_content_length, 7}, {"body_short", gen_body_short, 4},
    {"chunked", gen_chunked, 7},             {"header_bytes", gen_header_bytes, 7},   {"path", gen_path, 5},
    {"bad_json", gen_bad_json, 10},          {"wrong_type", gen_wrong_type, 12},      {"method", gen_method, 5},
    {"version", gen_version, 5},             {"h2_preface", gen_h2, 2},               {"pipeline", gen_pipeline, 5},
    {"random", gen_random, 4},               {"mutate", gen_mutate, 6},               {"valid", gen_valid, 6},
    {"abort", gen_abort, 3},                 {"tokenizer", gen_tokenizer, 3},         {"messages", gen_messages, 4},
    {"responses", gen_responses, 4},        {"ollama", gen_ollama, 4},
};
#define N_CATS (int)(sizeof cats / sizeof *cats)

/* Request I of seed S: the category and bytes depend on nothing else. */
static int make_case(uint64_t seed, long i, struct fcase *c)
{
    uint64_t r = seed * 0x2545F4914F6CDD1Dull + (uint64_t)i * 0x9E3779B97F4A7C15ull;
    rng_next(&r);
    unsigned total = 0;
    for (int k = 0; k < N_CATS; k++) total += cats[k].weight;
    unsigned pick = rnd(&r, total);
    int k = 0;
    while (pick >= cats[k].weight) pick -= cats[k++].weight;
    memset(c, 0, sizeof *c);
    c->n_resp = 1;
    cats[k].gen(c, &r);
    return k;
}

/* ---- running a case and judging it ---------------------------------------------------------- */

/* Does the outcome match one of the space-separated tokens of EXPECT? */
static int matches(const char *expect, const struct reply *rp)
{
    if (rp->kind == R_TIMEOUT || rp->kind == R_BAD || rp->kind == R_CONNFAIL) return 0;
    char code[4];
    snprintf(code, sizeof code, "%03d", rp->status);
    for (const char *t = expect; *t;) {
        size_t n = strcspn(t, " ");
        if (n == 3 && !strncmp(t, "any", 3)) return 1;
        if (n == 5 && !strncmp(t, "close", 5) && rp->kind == R_CLOSED) return 1;
        if (n == 3 && rp->kind == R_STATUS && t[0] == code[0] &&
            ((t[1] == 'x' && t[2] == 'x') || (t[1] == code[1] && t[2] == code[2])))
            return 1;
        t += n;
        while (*t == ' ') t++;
    }
    return 0;
}

/* Why reply K of case C breaks the contract, or NULL. */
static const char *judge(const struct fcase *c, int k, const struct reply *rp, char *why, size_t cap)
{
    const char *exp = c->expect[k] ? c->expect[k] : c->expect[0];
    if (!matches(exp, rp)) {
        if (rp->kind == R_STATUS) snprintf(why, cap, "got %d, expected %s", rp->status, exp);
        else snprintf(why, cap, "got %s%s%s, expected %s", kind_name[rp->kind], rp->kind == R_BAD ? ": " : "", rp->why, exp);
        return why;
    }
    if (rp->kind != R_STATUS) return NULL;
    int st = rp->status;
    size_t bn = rp->body_n < sizeof rp->body ? rp->body_n : sizeof rp->body - 1;
    if (st >= 400 && !c->head && !memmem(rp->body, bn, "\"error\"", 7)) return snprintf(why, cap, "%d without an error object", st), why;
    if (st >= 400 && c->error_has && !memmem(rp->body, bn, c->error_has, strlen(c->error_has)))
        return snprintf(why, cap, "%d without '%s' in the body", st, c->error_has), why;
    if (st == 400 && c->param) {
        char pat[160];
        int found = 0;
        for (const char *f = c->param; *f && !found;) {
            size_t n = strcspn(f, "|");
            snprintf(pat, sizeof pat, "\"param\":\"%.*s", (int)n, f);
            if (memmem(rp->body, bn, pat, strlen(pat))) found = 1;
            /* also with a space after the colon */
            snprintf(pat, sizeof pat, "\"param\": \"%.*s", (int)n, f);
            if (memmem(rp->body, bn, pat, strlen(pat))) found = 1;
            f += n + (f[n] == '|');
        }
        if (!found) return snprintf(why, cap, "400 whose error.param is not %s", c->param), why;
    }
    if (st == 405 && c->want_allow && !rp->has_allow) return snprintf(why, cap, "405 without Allow"), why;
    if (st == 200 && k == 0 && c->body_has && !memmem(rp->body, bn, c->body_has, strlen(c->body_has)))
        return snprintf(why, cap, "200 without '%s' in the body", c->body_has), why;
    if (st == 200 && (c->sse >> k & 1) && memmem(rp->body, bn, "data:", 5) && !memmem(rp->tail, rp->tail_n, "data: [DONE]", 12))
        return snprintf(why, cap, "event stream not ending with data: [DONE]"), why;
    return NULL;
}

/* Waits (3 s) for a complete interim head "HTTP/1.1 100 ..."; consumes it and returns 1. Any
 * other reply (a 4xx instead) stays in the buffer for read_reply. */
static int await_100(struct conn *cn)
{
    double dl = now_s() + 3.0;
    char *end;
    while (!(end = memmem(cn->buf + cn->beg, cn->end - cn->beg, "\r\n\r\n", 4)))
        if (conn_fill(cn, dl) != 1) return 0;
    if (strncmp(cn->buf + cn->beg, "HTTP/1.1 100", 12)) return 0;
    cn->beg = (size_t)(end + 4 - cn->buf);
    return 1;
}

/* Sends case C; returns 0, or -1 when sending itself timed out (a server that stops reading). */
static int send_case(struct conn *cn, const struct fcase *c, int *no_100)
{
    double dl = now_s() + REPLY_TIMEOUT;
    size_t first = c->split ? c->split : c->req.n;
    int s = send_all(cn->fd, c->req.p, first, dl);
    if (s == -1) return -1;
    if (s == 0 && c->split) {
        if (c->wait100) *no_100 = !await_100(cn);
        else sleep_ms(50);
        if (send_all(cn->fd, c->req.p + first, c->req.n - first, dl) == -1) return -1;
    }
    if (c->shut_wr) shutdown(cn->fd, SHUT_WR);
    return 0;
}

/* A client that leaves; a reset (SO_LINGER 0) half the time. */
static void leave(struct conn *cn, const struct fcase *c)
{
    if (c->abort == 2) {
        double dl = now_s() + 2.0;
        conn_fill(cn, dl);
    }
    if (c->req.n & 1) {
        struct linger l = {1, 0};
        setsockopt(cn->fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    }
}

/* ---- statistics ----------------------------------------------------------------------------- */

struct catstat {
    long n, fails, slow;
    double max_s;
    long by_code[600], closed, timeouts, bad;
    int n_ex;
    char ex[MAX_EXAMPLES][1400];
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct catstat stats[N_CATS];
static long by_code[600], n_closed, n_timeout, n_bad, n_connfail, n_aborted, n_no100;
static long hang_ex_n, bad_ex_n;
static char hang_ex[MAX_EXAMPLES][1400], bad_ex[MAX_EXAMPLES][1400];
static int consecutive_connfail, stop_all;
static uint64_t g_seed;
static int verbose;

static void example(char *dst, size_t cap, long i, int k, const struct fcase *c, const char *why)
{
    char e[1000];
    escape(c->req.p, c->req.n, e, sizeof e);
    snprintf(dst, cap, "#%ld %s [%s]: %s; sent %zu bytes%s: \"%s\"", i, cats[k].name, c->variant, why, c->req.n,
             c->shut_wr ? " then half-closed" : "", e);
}

/* A broken contract (or a hang, or a malformed reply) for request I of category K, under the lock. */
static void note_failure(int k, long i, const struct fcase *c, int kind, const char *why)
{
    char *slot = NULL;
    if (kind == R_TIMEOUT) slot = hang_ex_n < MAX_EXAMPLES ? hang_ex[hang_ex_n] : NULL, hang_ex_n++;
    else if (kind == R_BAD) slot = bad_ex_n < MAX_EXAMPLES ? bad_ex[bad_ex_n] : NULL, bad_ex_n++;
    else stats[k].fails++, slot = stats[k].n_ex < MAX_EXAMPLES ? stats[k].ex[stats[k].n_ex++] : NULL;
    if (slot) example(slot, sizeof hang_ex[0], i, k, c, why);
}

/* Counts one reply of request I (category K); WHY, if set, is what was wrong with it. */
static void record(int k, long i, const struct fcase *c, const struct reply *rp, const char *why)
{
    pthread_mutex_lock(&mu);
    struct catstat *s = &stats[k];
    if (rp->kind == R_STATUS) by_code[rp->status]++, s->by_code[rp->status]++;
    else if (rp->kind == R_CLOSED) n_closed++, s->closed++;
    else if (rp->kind == R_TIMEOUT) n_timeout++, s->timeouts++;
    else if (rp->kind == R_BAD) n_bad++, s->bad++;
    if (rp->secs > s->max_s) s->max_s = rp->secs;
    if (rp->secs > SLOW_REPLY) s->slow++;
    if (why) note_failure(k, i, c, rp->kind, why);
    pthread_mutex_unlock(&mu);
}

static void print_reply(const struct reply *rp)
{
    char e[4200];
    escape(rp->body, rp->body_n < sizeof rp->body ? rp->body_n : sizeof rp->body - 1, e, sizeof e);
    printf("# reply: %s %d after %.3f s, body %zu bytes: %s\n", kind_name[rp->kind], rp->status, rp->secs, rp->body_n, e);
}

/* Runs request I: connect, send, read every reply, judge, record. */
static void run_one(long i)
{
    struct fcase c;
    int k = make_case(g_seed, i, &c);
    struct conn *cn = malloc(sizeof *cn);
    if (!cn) die("out of memory");
    cn->beg = cn->end = 0;
    struct reply rp;
    memset(&rp, 0, sizeof rp);
    char why[200];
    if (verbose) {
        char e[8000];
        escape(c.req.p, c.req.n, e, sizeof e);
        printf("# request #%ld %s [%s], %zu bytes: %s\n", i, cats[k].name, c.variant, c.req.n, e);
    }
    cn->fd = connect_srv();
    if (cn->fd < 0) {
        rp.kind = R_CONNFAIL;
        pthread_mutex_lock(&mu);
        n_connfail++;
        if (++consecutive_connfail >= MAX_CONNFAIL) stop_all = 1;
        pthread_mutex_unlock(&mu);
        goto out;
    }
    pthread_mutex_lock(&mu);
    consecutive_connfail = 0;
    pthread_mutex_unlock(&mu);
    int no_100 = 0;
    double t0 = now_s();
    if (send_case(cn, &c, &no_100) < 0) {
        rp.kind = R_TIMEOUT, rp.secs = now_s() - t0;
        record(k, i, &c, &rp, "sending timed out: the server stopped reading");
        goto out;
    }
    if (no_100) {
        pthread_mutex_lock(&mu);
        n_no100++;
        pthread_mutex_unlock(&mu);
    }
    if (c.abort) {
        leave(cn, &c);
        pthread_mutex_lock(&mu);
        n_aborted++, stats[k].n++;
        pthread_mutex_unlock(&mu);
        goto out;
    }
    for (int r = 0; r < c.n_resp; r++) {
        double t1 = now_s();
        read_reply(cn, c.head, t1 + REPLY_TIMEOUT, &rp);
        rp.secs = now_s() - t1;
        if (verbose) print_reply(&rp);
        const char *bad_why = judge(&c, r, &rp, why, sizeof why);
        char which[240];
        if (bad_why && c.n_resp > 1) { /* which response of the pipeline */
            snprintf(which, sizeof which, "response %d of %d: %s", r + 1, c.n_resp, bad_why);
            bad_why = which;
        }
        record(k, i, &c, &rp, bad_why);
        if (rp.kind != R_STATUS) break;
    }
    if (c.want_close && rp.kind == R_STATUS) { /* HTTP/1.0: the server closes after the reply */
        if (conn_fill(cn, now_s() + 3.0) != 0) {
            pthread_mutex_lock(&mu);
            note_failure(k, i, &c, R_STATUS, "HTTP/1.0 without keep-alive: the connection stays open after the reply");
            pthread_mutex_unlock(&mu);
        }
    }
    pthread_mutex_lock(&mu);
    stats[k].n++;
    pthread_mutex_unlock(&mu);
out:
    if (cn->fd >= 0) close(cn->fd);
    free(cn);
    free(c.req.p);
}

/* ---- workers, health, slow clients ---------------------------------------------------------- */

static long next_i, end_i;
static double t_end; /* no new request after this time: the run is bounded */
static int out_of_time;
static long n_started; /* requests actually sent (fewer than N when stopped early) */

static void *worker(void *arg)
{
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&mu);
        if (now_s() > t_end) out_of_time = stop_all = 1;
        long i = stop_all ? end_i : next_i++;
        n_started += i < end_i;
        pthread_mutex_unlock(&mu);
        if (i >= end_i) return NULL;
        run_one(i);
    }
}

/* GET /health answers 200 within TIMEOUT s? */
static int health(double timeout, int *status, double *secs)
{
    double t0 = now_s();
    *status = 0;
    struct conn *cn = malloc(sizeof *cn);
    if (!cn) die("out of memory");
    cn->beg = cn->end = 0;
    cn->fd = connect_srv();
    int ok = 0;
    if (cn->fd >= 0) {
        const char *req = "GET /health HTTP/1.1\r\n" HOST "Connection: close\r\n\r\n";
        struct reply rp;
        if (send_all(cn->fd, req, strlen(req), t0 + timeout) == 0 && read_reply(cn, 0, t0 + timeout, &rp) == R_STATUS) {
            *status = rp.status;
            ok = rp.status == 200;
        }
        close(cn->fd);
    }
    free(cn);
    *secs = now_s() - t0;
    return ok;
}

/* Opens IDLE_CONNS connections that send nothing and asks /health meanwhile: a server must not
 * be held up by connections that merely exist. */
static int idle_status, idle_opened;
static double idle_secs;

static int idle_connections(void)
{
    int fds[IDLE_CONNS];
    for (idle_opened = 0; idle_opened < IDLE_CONNS; idle_opened++)
        if ((fds[idle_opened] = connect_srv()) < 0) break;
    int ok = health(HEALTH_TIMEOUT, &idle_status, &idle_secs);
    for (int i = 0; i < idle_opened; i++) close(fds[i]);
    return ok;
}

/* A slow client: 0 a header byte every 200 ms, 1 silence after connecting, 2 a request line then
 * silence (all three must be closed by the 10 s header deadline), 3 a body byte every 150 ms
 * (headers complete at once: must be answered normally). */
struct slow {
    pthread_t th;
    int variant;
    double secs;
    int status, closed;
};

static void *slow_main(void *arg)
{
    struct slow *s = arg;
    double t0 = now_s();
    int fd = connect_srv();
    if (fd < 0) return NULL;
    struct conn *cn = malloc(sizeof *cn);
    if (!cn) die("out of memory");
    cn->fd = fd, cn->beg = cn->end = 0;
    if (s->variant == 3) {
        const char *body = "{\"prompt\":\"hi\",\"max_tokens\":1}";
        char head[256];
        snprintf(head, sizeof head, "POST /v1/completions HTTP/1.1\r\n" HOST "Content-Length: %zu\r\n\r\n", strlen(body));
        send_all(fd, head, strlen(head), t0 + 5);
        for (const char *p = body; *p; p++) sleep_ms(150), send_all(fd, p, 1, now_s() + 5);
        struct reply rp;
        if (read_reply(cn, 0, now_s() + REPLY_TIMEOUT, &rp) == R_STATUS) s->status = rp.status;
    } else {
        const char *drip = "GET /health HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
        if (s->variant == 2) send_all(fd, "GET /health HTTP/1.1\r\n", 22, t0 + 5);
        for (size_t k = 0; now_s() - t0 < SLOW_LIMIT; k++) {
            struct pollfd p = {fd, POLLIN, 0};
            if (poll(&p, 1, 200) == 1) { /* an answer (408?) or the close */
                char b[512];
                ssize_t n = recv(fd, b, sizeof b, 0);
                if (n > 0 && !s->status && !strncmp(b, "HTTP/1.", 7) && n > 12) s->status = atoi(b + 9);
                if (n <= 0 && (n == 0 || (errno != EAGAIN && errno != EINTR))) {
                    s->closed = 1;
                    break;
                }
            } else if (s->variant == 0 && k < strlen(drip) && send_all(fd, drip + k, 1, now_s() + 1) == -2) {
                s->closed = 1;
                break;
            }
        }
    }
    s->secs = now_s() - t0;
    close(fd);
    free(cn);
    return NULL;
}

/* ---- the report ----------------------------------------------------------------------------- */

/* "400:12 close:3" for one category, the commonest codes first. */
static void summarize(const struct catstat *s, char *out, size_t cap)
{
    size_t o = 0;
    long seen[600];
    memcpy(seen, s->by_code, sizeof seen);
    for (;;) {
        int best = -1;
        for (int c = 0; c < 600; c++)
            if (seen[c] && (best < 0 || seen[c] > seen[best])) best = c;
        if (best < 0 || o + 16 > cap) break;
        o += (size_t)snprintf(out + o, cap - o, "%d:%ld ", best, seen[best]);
        seen[best] = 0;
    }
    if (s->closed) o += (size_t)snprintf(out + o, cap - o, "close:%ld ", s->closed);
    if (s->timeouts) o += (size_t)snprintf(out + o, cap - o, "TIMEOUT:%ld ", s->timeouts);
    if (s->bad) o += (size_t)snprintf(out + o, cap - o, "MALFORMED:%ld ", s->bad);
    out[o] = 0;
}

static void report_tables(long sent, double wall)
{
    printf("# %ld requests (%ld left early on purpose), %.1f s, %.0f req/s\n# by status:", sent, n_aborted, wall, sent / wall);
    for (int c = 0; c < 600; c++)
        if (by_code[c]) printf(" %d:%ld", c, by_code[c]);
    printf(" close:%ld timeout:%ld malformed:%ld connect-failed:%ld\n", n_closed, n_timeout, n_bad, n_connfail);
    printf("# %-15s %6s %6s %8s  outcomes\n", "category", "n", "fails", "max s");
    for (int k = 0; k < N_CATS; k++) {
        char sum[400];
        summarize(&stats[k], sum, sizeof sum);
        printf("# %-15s %6ld %6ld %8.3f  %s%s\n", cats[k].name, stats[k].n, stats[k].fails, stats[k].max_s, sum,
               stats[k].slow ? "(some over 5 s)" : "");
    }
}

static void usage(void)
{
    fprintf(stderr, "usage: serve_fuzz HOST PORT N [--seed S] [--threads T] [--only I] [--max-seconds S]\n"
                    "  HOST must be loopback: 127.x.x.x, ::1 or localhost\n");
    exit(2);
}

int main(int argc, char **argv)
{
    if (argc < 4) usage();
    long n = atol(argv[3]), only = -1;
    int threads = 4;
    double max_seconds = 1200;
    g_seed = 1;
    for (int a = 4; a < argc; a++) {
        if (!strcmp(argv[a], "--seed") && a + 1 < argc) g_seed = strtoull(argv[++a], NULL, 0);
        else if (!strcmp(argv[a], "--threads") && a + 1 < argc) threads = atoi(argv[++a]);
        else if (!strcmp(argv[a], "--only") && a + 1 < argc) only = atol(argv[++a]);
        else if (!strcmp(argv[a], "--max-seconds") && a + 1 < argc) max_seconds = atof(argv[++a]);
        else usage();
    }
    if (n < 0 || threads < 1 || threads > 64) usage();
    if (resolve_loopback(argv[1], argv[2]) < 0) {
        fprintf(stderr, "serve_fuzz: refusing '%s' port '%s': only a loopback address and a port 1-65535\n", argv[1], argv[2]);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN); /* a server that closes first must not kill the client */
    setvbuf(stdout, NULL, _IOLBF, 0);

    int st;
    double hs;
    double t_wait = now_s();
    while (!health(HEALTH_TIMEOUT, &st, &hs) && now_s() - t_wait < 120) sleep_ms(500); /* the model may still load */
    if (st != 200) {
        check(0, "server up (GET /health 200)", "last status %d after %.0f s of waiting", st, now_s() - t_wait);
        return printf("%d passed, %d failed\n", n_pass, n_fail), 1;
    }
    if (only >= 0) {
        verbose = 1, next_i = only, end_i = only + 1, t_end = now_s() + REPLY_TIMEOUT * MAX_RESP;
        worker(NULL);
        int fails = n_timeout + n_bad > 0;
        for (int k = 0; k < N_CATS; k++) fails += stats[k].fails > 0;
        for (int k = 0; k < N_CATS; k++)
            for (int e = 0; e < stats[k].n_ex; e++) printf("# %s\n", stats[k].ex[e]);
        for (int e = 0; e < hang_ex_n && e < MAX_EXAMPLES; e++) printf("# %s\n", hang_ex[e]);
        for (int e = 0; e < bad_ex_n && e < MAX_EXAMPLES; e++) printf("# %s\n", bad_ex[e]);
        check(!fails, "the request", "see above");
        return check_done();
    }
    printf("# serve_fuzz: %ld requests to %s, seed %llu, %d threads\n", n, srv_name, (unsigned long long)g_seed, threads);
    int idle_ok = idle_connections();

    /* Slow clients run alongside the whole time, bounded in number (and each by SLOW_LIMIT). */
    struct slow slow[5] = {{.variant = 0}, {.variant = 1}, {.variant = 3}, {.variant = 2}, {.variant = 0}};
    int n_slow = n >= 1000 ? 5 : 3;
    for (int s = 0; s < n_slow; s++) pthread_create(&slow[s].th, NULL, slow_main, &slow[s]);

    double t0 = now_s();
    t_end = t0 + max_seconds;
    pthread_t th[64];
    long done = 0;
    int health_fails = 0;
    char health_bad[600] = "";
    while (done < n && !stop_all) { /* batches of HEALTH_EVERY, each followed by a health check */
        next_i = done, end_i = done + HEALTH_EVERY < n ? done + HEALTH_EVERY : n;
        for (int t = 0; t < threads; t++) pthread_create(&th[t], NULL, worker, NULL);
        for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
        done = end_i;
        if (!health(HEALTH_TIMEOUT, &st, &hs)) {
            health_fails++;
            size_t l = strlen(health_bad);
            if (l < sizeof health_bad - 80) snprintf(health_bad + l, sizeof health_bad - l, " after %ld: status %d in %.1f s;", done, st, hs);
        }
        if (done % 5000 == 0 || done == n) fprintf(stderr, "serve_fuzz: %ld/%ld sent, %.0f s\n", done, n, now_s() - t0);
    }
    double wall = now_s() - t0;
    for (int s = 0; s < n_slow; s++) pthread_join(slow[s].th, NULL);

    report_tables(n_started, wall);
    check(!stop_all && n_connfail == 0, "the server accepts every connection (no crash)",
          "%ld connections refused or timed out%s", n_connfail, stop_all ? "; stopped: the server is gone" : "");
    check(!health_fails, "GET /health 200 within 5 s after every 1000 requests and at the end", "%s", health_bad);
    check(n_timeout == 0, "no request hung (reply within 15 s)", "%ld timed out, e.g. %s", n_timeout, hang_ex[0]);
    for (int e = 1; e < hang_ex_n && e < MAX_EXAMPLES; e++) printf("#   %s\n", hang_ex[e]);
    check(n_bad == 0, "every reply is well-formed HTTP", "%ld malformed, e.g. %s", n_bad, bad_ex[0]);
    for (int e = 1; e < bad_ex_n && e < MAX_EXAMPLES; e++) printf("#   %s\n", bad_ex[e]);
    check(n_no100 == 0, "Expect: 100-continue answered with 100 Continue (valid requests)", "%ld without a 100 within 3 s", n_no100);
    check(idle_ok, "GET /health answers while 100 idle connections are open", "status %d after %.1f s (%d connections opened)",
          idle_status, idle_secs, idle_opened);
    check(!out_of_time, "the run finished within --max-seconds", "stopped after %ld of %ld requests", n_started, n);
    for (int s = 0; s < n_slow; s++) {
        char nm[100];
        static const char *what[] = {"a header byte every 200 ms", "silent after connecting", "request line then silence",
                                     "a body byte every 150 ms"};
        snprintf(nm, sizeof nm, "slow client %d (%s)", s, what[slow[s].variant]);
        if (slow[s].variant == 3)
            check(slow[s].status == 200 || slow[s].status == 503, nm, "status %d after %.1f s", slow[s].status, slow[s].secs);
        else
            check(slow[s].closed && slow[s].secs >= 8.0 && slow[s].secs <= 16.0, nm, "%s after %.1f s (status %d); the header deadline is 10 s",
                  slow[s].closed ? "closed" : "still open", slow[s].secs, slow[s].status);
    }
    for (int k = 0; k < N_CATS; k++) {
        char nm[80];
        snprintf(nm, sizeof nm, "%s: answers as the contract says", cats[k].name);
        check(!stats[k].fails, nm, "%ld of %ld, e.g. %s", stats[k].fails, stats[k].n, stats[k].ex[0]);
        for (int e = 1; e < stats[k].n_ex; e++) printf("#   %s\n", stats[k].ex[e]);
    }
    printf("# wall %.1f s\n", now_s() - t0);
    return check_done();
}
