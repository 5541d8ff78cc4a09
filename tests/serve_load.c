/* serve_load: measures a running `coli serve` under load with streaming chat completions.
 *
 *   serve_load HOST PORT K M [--max-tokens T] [--prompt TEXT] [--timeout S]
 *
 *   HOST     a loopback address (127.x.x.x, ::1 or localhost); anything else is refused
 *   K, M     phase 1: one client alone runs M requests, one after the other;
 *            phase 2: K clients at once, M requests each
 *   T        max_tokens of each request (default 64); the server may stop earlier at the
 *            end-of-generation token, so completion tokens are counted from the usage chunk
 *   TEXT     the user message (default: a short story request)
 *   S        a request not finished after S seconds is lost (default 300)
 *
 * Each request: POST /v1/chat/completions with stream:true, stream_options.include_usage:true,
 * temperature 0; the reply is read as HTTP/1.1 chunked transfer-encoding carrying server-sent
 * events. Answered means a 200 stream with a usage chunk that ends `data: [DONE]`, or an explicit
 * 503 (counted apart as "rejected: queue full"); anything else is lost and fails the run.
 * Per phase: requests OK / rejected / lost, completion tokens, wall time, aggregate tok/s
 * (completion tokens / wall), time to first token (request sent -> first content delta: mean,
 * p50, p90, max, standard deviation), then phase 2's aggregate tok/s over phase 1's.
 * Ends with `ok - ` / `FAIL - ` lines and `N passed, N failed` (tests/check.h's style); exit
 * status 0 only when no request was lost.
 *
 * Build: gcc -std=c11 -O2 -Wall -Wextra -pthread tests/serve_load.c -o build/serve_load
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static void die(const char *msg)
{
    fprintf(stderr, "serve_load: %s\n", msg);
    exit(2);
}

#include "check.h"
#include "http_client.h"

/* ---- one streaming request ------------------------------------------------------------------ */

enum outcome { OK, REJECTED, LOST };

struct result {
    enum outcome outcome;
    char why[200];      /* for LOST: what went wrong */
    int tokens;         /* completion_tokens of the usage chunk */
    int deltas;         /* content deltas seen (a cross-check of tokens) */
    double ttft, secs;  /* request sent -> first content delta, -> [DONE] */
    char text[1024];    /* the content's head: greedy runs of one prompt should agree */
    size_t text_n;
};

/* The state of the event-stream parser across chunk boundaries. */
struct sse {
    char ev[16384];     /* the event being assembled (events are small: one token each) */
    size_t n;
    int done, usage, error;
    double t_sent;
    struct result *res;
};

static int lost(struct result *r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->why, sizeof r->why, fmt, ap);
    va_end(ap);
    r->outcome = LOST;
    return -1;
}

/* Appends JSON string S (at its opening quote's next byte) to the result's text, decoded
 * enough for a comparison (escapes kept as their letter); returns whether it was non-empty. */
static int take_string(struct result *r, const char *s, const char *end)
{
    int any = 0;
    for (; s < end && *s != '"'; s++) {
        if (*s == '\\' && s + 1 < end) s++;
        any = 1;
        if (r->text_n < sizeof r->text - 1) r->text[r->text_n++] = *s, r->text[r->text_n] = 0;
    }
    return any;
}

/* An error event is an object whose first key is "error" (a content delta may well be the
 * text "error", so a mere substring says nothing). */
static int is_error_event(const char *d)
{
    while (*d == ' ') d++;
    if (*d++ != '{') return 0;
    while (*d == ' ') d++;
    return !strncmp(d, "\"error\"", 7);
}

/* One complete event: its data lines. */
static void sse_event(struct sse *p, char *ev, size_t n)
{
    ev[n] = 0;
    for (char *line = ev; line && *line;) {
        char *next = strchr(line, '\n');
        if (next) *next++ = 0;
        size_t l = strlen(line);
        if (l && line[l - 1] == '\r') line[--l] = 0;
        if (!strncmp(line, "data:", 5)) {
            char *d = line + 5 + (line[5] == ' ');
            if (!strcmp(d, "[DONE]")) p->done = 1;
            else if (is_error_event(d)) p->error = 1;
            else {
                char *u = strstr(d, "\"usage\"");
                char *ct = u ? strstr(u, "\"completion_tokens\"") : NULL;
                if (ct && (ct = strchr(ct, ':'))) p->usage = 1, p->res->tokens = atoi(ct + 1);
                char *delta = strstr(d, "\"delta\"");
                char *c = delta ? strstr(delta, "\"content\"") : NULL;
                if (c && (c = strchr(c + 9, '"')) && take_string(p->res, c + 1, d + strlen(d))) {
                    if (!p->res->deltas) p->res->ttft = now_s() - p->t_sent;
                    p->res->deltas++;
                }
            }
        }
        line = next;
    }
}

/* Feeds decoded body bytes; events end with a blank line ("\n\n", or "\r\n\r\n"). */
static int sse_feed(struct sse *p, const char *d, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (p->n == sizeof p->ev - 1) return -1;
        p->ev[p->n++] = d[i];
        size_t m = p->n;
        if (d[i] == '\n' && ((m >= 2 && p->ev[m - 2] == '\n') || (m >= 4 && !memcmp(p->ev + m - 4, "\r\n\r\n", 4)))) {
            sse_event(p, p->ev, m);
            p->n = 0;
        }
    }
    return 0;
}

/* Reads the chunked body into the event parser; 0 or -1 (r->why says why). */
static int read_chunked(struct conn *c, double deadline, struct sse *p)
{
    char line[256];
    for (;;) {
        long n = conn_line(c, deadline, line, sizeof line);
        if (n < 0) return lost(p->res, n == -1 ? "timed out in the stream" : "stream cut short (no last chunk)");
        char *end;
        unsigned long size = strtoul(line, &end, 16);
        if (end == line || (*end && *end != ';')) return lost(p->res, "bad chunk size line '%.40s'", line);
        if (size == 0) {
            while ((n = conn_line(c, deadline, line, sizeof line)) > 0) {} /* trailers */
            return 0;
        }
        while (size) {
            if (c->beg == c->end) {
                int k = conn_fill(c, deadline);
                if (k != 1) return lost(p->res, k == -1 ? "timed out in the stream" : "stream cut short in a chunk");
            }
            size_t k = c->end - c->beg < size ? c->end - c->beg : size;
            if (sse_feed(p, c->buf + c->beg, k) < 0) return lost(p->res, "an event over 16 KiB");
            c->beg += k, size -= k;
        }
        long e = conn_line(c, deadline, line, sizeof line);
        if (e != 0) return lost(p->res, e == -1 ? "timed out in the stream" : e == -2 ? "stream cut short after a chunk" : "no CR LF after a chunk's data");
    }
}

/* Status line and headers; the status, or -1. */
static int read_head(struct conn *c, double deadline, struct result *r, int *chunked, long *clen)
{
    char line[4096];
    int status = 0;
    do { /* interim 1xx replies are skipped */
        long n = conn_line(c, deadline, line, sizeof line);
        if (n < 0) return lost(r, n == -1 ? "no reply in time" : "closed without a reply");
        if (strncmp(line, "HTTP/1.", 7) || strlen(line) < 12) return lost(r, "bad status line '%.60s'", line);
        status = atoi(line + 9);
        *chunked = 0, *clen = -1;
        while ((n = conn_line(c, deadline, line, sizeof line)) > 0) {
            if (!strncasecmp(line, "transfer-encoding:", 18) && strcasestr(line, "chunked")) *chunked = 1;
            else if (!strncasecmp(line, "content-length:", 15)) *clen = atol(line + 15);
        }
        if (n < 0) return lost(r, "reply headers cut short");
    } while (status < 200);
    return status;
}

static char *g_body;   /* the request, the same for all */
static size_t g_body_n;
static double g_timeout = 300;

/* Runs one streaming chat completion into R. */
static void one_request(struct result *r)
{
    memset(r, 0, sizeof *r);
    struct conn *c = malloc(sizeof *c);
    if (!c) die("out of memory");
    c->beg = c->end = 0;
    c->fd = connect_srv();
    if (c->fd < 0) {
        lost(r, "cannot connect: %s", strerror(errno));
        free(c);
        return;
    }
    double t0 = now_s(), deadline = t0 + g_timeout;
    int chunked;
    long clen;
    if (send_all(c->fd, g_body, g_body_n, deadline) < 0) {
        lost(r, "sending failed");
        goto out;
    }
    struct sse *p = calloc(1, sizeof *p);
    if (!p) die("out of memory");
    p->t_sent = now_s(), p->res = r;
    int status = read_head(c, deadline, r, &chunked, &clen);
    if (status == 503) r->outcome = REJECTED;
    else if (status > 0 && status != 200) {
        char body[160] = "";
        long n = conn_line(c, now_s() + 2, body, sizeof body);
        lost(r, "status %d: %s", status, n >= 0 ? body : "");
    } else if (status == 200 && !chunked) lost(r, "a 200 stream without Transfer-Encoding: chunked");
    else if (status == 200 && read_chunked(c, deadline, p) == 0) {
        if (p->error) lost(r, "an error event in the stream");
        else if (!p->done) lost(r, "the stream ended without data: [DONE]");
        else if (!p->usage) lost(r, "no usage chunk (stream_options.include_usage)");
        else r->outcome = OK;
    }
    r->secs = now_s() - p->t_sent;
    free(p);
out:
    close(c->fd);
    free(c);
}

/* ---- phases --------------------------------------------------------------------------------- */

struct client {
    pthread_t th;
    struct result *res; /* M of them */
    int m;
};

static void *client_main(void *arg)
{
    struct client *cl = arg;
    for (int j = 0; j < cl->m; j++) one_request(&cl->res[j]);
    return NULL;
}

struct phase {
    int ok, rejected, lost;
    long tokens, deltas;
    double wall, tps;
    double ttft_mean, ttft_p50, ttft_p90, ttft_max, ttft_sd;
    double per_req_tps; /* mean over OK requests of (tokens-1) / (secs - ttft): decode speed each saw */
};

static int by_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The nearest-rank percentile PCT of the N sorted values V: the ceil(PCT/100 * N)-th. */
static double percentile(const double *v, int n, int pct)
{
    int k = (pct * n + 99) / 100 - 1;
    return v[k < 0 ? 0 : k >= n ? n - 1 : k];
}

/* Newton's square root: the build line links no libm. */
static double square_root(double x)
{
    if (x <= 0) return 0;
    double y = x > 1 ? x : 1;
    for (int i = 0; i < 200; i++) {
        double next = 0.5 * (y + x / y);
        if (next >= y) break;
        y = next;
    }
    return y;
}

/* Runs K clients of M requests each; results in RES[k*M + j]. */
static void run_phase(int k, int m, struct result *res, struct phase *ph)
{
    struct client *cl = calloc((size_t)k, sizeof *cl);
    if (!cl) die("out of memory");
    double t0 = now_s();
    for (int i = 0; i < k; i++) {
        cl[i].res = res + (size_t)i * m, cl[i].m = m;
        if (pthread_create(&cl[i].th, NULL, client_main, &cl[i])) die("pthread_create");
    }
    for (int i = 0; i < k; i++) pthread_join(cl[i].th, NULL);
    memset(ph, 0, sizeof *ph);
    ph->wall = now_s() - t0;
    free(cl);

    double *tt = malloc(sizeof(double) * (size_t)(k * m) + 1);
    if (!tt) die("out of memory");
    int nt = 0;
    double sum = 0, rate_sum = 0;
    for (int i = 0; i < k * m; i++) {
        struct result *r = &res[i];
        if (r->outcome == REJECTED) ph->rejected++;
        if (r->outcome == LOST) ph->lost++;
        if (r->outcome != OK) continue;
        ph->ok++, ph->tokens += r->tokens, ph->deltas += r->deltas;
        if (r->deltas) tt[nt++] = r->ttft, sum += r->ttft;
        if (r->tokens > 1 && r->secs > r->ttft) rate_sum += (r->tokens - 1) / (r->secs - r->ttft);
    }
    ph->tps = ph->wall > 0 ? ph->tokens / ph->wall : 0;
    ph->per_req_tps = ph->ok ? rate_sum / ph->ok : 0;
    if (nt) {
        qsort(tt, (size_t)nt, sizeof *tt, by_double);
        ph->ttft_mean = sum / nt;
        double var = 0;
        for (int i = 0; i < nt; i++) var += (tt[i] - ph->ttft_mean) * (tt[i] - ph->ttft_mean);
        ph->ttft_sd = square_root(var / nt);
        ph->ttft_p50 = percentile(tt, nt, 50), ph->ttft_p90 = percentile(tt, nt, 90), ph->ttft_max = tt[nt - 1];
    }
    free(tt);
}

static void print_phase(const char *title, const struct phase *ph, const struct result *res, int n, int m)
{
    printf("# %s\n", title);
    printf("#   requests: %d OK, %d rejected (queue full), %d lost\n", ph->ok, ph->rejected, ph->lost);
    printf("#   completion tokens: %ld (content deltas %ld), wall %.3f s, aggregate %.2f tok/s\n", ph->tokens, ph->deltas, ph->wall, ph->tps);
    printf("#   time to first token: mean %.3f s, p50 %.3f, p90 %.3f, max %.3f, sd %.3f\n", ph->ttft_mean, ph->ttft_p50,
           ph->ttft_p90, ph->ttft_max, ph->ttft_sd);
    printf("#   decode per request (after the first token): mean %.2f tok/s\n", ph->per_req_tps);
    int shown = 0;
    for (int i = 0; i < n && shown < 5; i++)
        if (res[i].outcome == LOST) printf("#   lost: client %d, request %d: %s\n", i / m, i % m, res[i].why), shown++;
}

/* How many different texts the OK requests produced (greedy: one expected, unless concurrency
 * changes the numerics). */
static int distinct_texts(const struct result *res, int n)
{
    int distinct = 0;
    for (int i = 0; i < n; i++) {
        if (res[i].outcome != OK) continue;
        int seen = 0;
        for (int j = 0; j < i && !seen; j++) seen = res[j].outcome == OK && !strcmp(res[i].text, res[j].text);
        distinct += !seen;
    }
    return distinct;
}

/* ---- main ----------------------------------------------------------------------------------- */

/* TEXT as the inside of a JSON string. */
static char *json_escape(const char *s)
{
    char *o = malloc(strlen(s) * 6 + 1), *q = o;
    if (!o) die("out of memory");
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') *q++ = '\\', *q++ = (char)ch;
        else if (ch < 0x20) q += sprintf(q, "\\u%04x", ch);
        else *q++ = (char)ch;
    }
    *q = 0;
    return o;
}

static void build_request(const char *prompt, int max_tokens)
{
    char *p = json_escape(prompt);
    size_t cap = strlen(p) + 512;
    char *body = malloc(cap);
    if (!body) die("out of memory");
    int bn = snprintf(body, cap,
                      "{\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],\"stream\":true,"
                      "\"stream_options\":{\"include_usage\":true},\"temperature\":0,\"max_tokens\":%d}",
                      p, max_tokens);
    g_body = malloc(cap + 256);
    if (!g_body) die("out of memory");
    g_body_n = (size_t)snprintf(g_body, cap + 256,
                                "POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                                "Accept: text/event-stream\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s",
                                srv_name, bn, body);
    free(p), free(body);
}

static void usage(void)
{
    fprintf(stderr, "usage: serve_load HOST PORT K M [--max-tokens T] [--prompt TEXT] [--timeout S]\n"
                    "  HOST must be loopback: 127.x.x.x, ::1 or localhost\n");
    exit(2);
}

int main(int argc, char **argv)
{
    if (argc < 5) usage();
    int k = atoi(argv[3]), m = atoi(argv[4]), max_tokens = 64;
    const char *prompt = "Write a short story about a robot who learns to paint.";
    for (int a = 5; a < argc; a++) {
        if (!strcmp(argv[a], "--max-tokens") && a + 1 < argc) max_tokens = atoi(argv[++a]);
        else if (!strcmp(argv[a], "--prompt") && a + 1 < argc) prompt = argv[++a];
        else if (!strcmp(argv[a], "--timeout") && a + 1 < argc) g_timeout = atof(argv[++a]);
        else usage();
    }
    if (k < 1 || k > 1024 || m < 1 || m > 100000 || max_tokens < 1 || g_timeout <= 0) usage();
    if (resolve_loopback(argv[1], argv[2]) < 0) {
        fprintf(stderr, "serve_load: refusing '%s' port '%s': only a loopback address and a port 1-65535\n", argv[1], argv[2]);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    setvbuf(stdout, NULL, _IOLBF, 0);
    build_request(prompt, max_tokens);
    printf("# serve_load: %s, phase 1: 1 client x %d, phase 2: %d clients x %d, max_tokens %d\n", srv_name, m, k, m, max_tokens);
    if (!wait_health()) {
        check(0, "server up (GET /health 200)", "no 200 within 120 s");
        printf("%d passed, %d failed\n", n_pass, n_fail);
        return 1;
    }

    struct result *r1 = calloc((size_t)m, sizeof *r1), *r2 = calloc((size_t)k * m, sizeof *r2);
    if (!r1 || !r2) die("out of memory");
    struct phase p1, p2;
    run_phase(1, m, r1, &p1);
    print_phase("phase 1: 1 client", &p1, r1, m, m);
    run_phase(k, m, r2, &p2);
    char title[64];
    snprintf(title, sizeof title, "phase 2: %d concurrent clients", k);
    print_phase(title, &p2, r2, k * m, m);
    printf("# phase 2 / phase 1 aggregate tok/s: %.2f\n", p1.tps > 0 ? p2.tps / p1.tps : 0.0);
    printf("# greedy texts: %d distinct in phase 1, %d in phase 2 (%s)\n", distinct_texts(r1, m), distinct_texts(r2, k * m),
           p1.ok && p2.ok && !strcmp(r1[0].text, r2[0].text) ? "phase 2's first equals phase 1's" : "phase 2's first differs");

    check(p1.lost == 0, "phase 1: every request answered", "%d of %d lost", p1.lost, m);
    check(p2.lost == 0, "phase 2: every request answered (200 stream to [DONE], or 503)", "%d of %d lost", p2.lost, k * m);
    check(p1.ok + p2.ok > 0, "at least one request completed", "all rejected");
    printf("%d passed, %d failed\n", n_pass, n_fail);
    free(r1), free(r2), free(g_body);
    return n_fail != 0;
}
