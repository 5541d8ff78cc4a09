/* serve_agents: replays agent-style multi-turn conversations against a running `coli serve` and
 * prints how much of each prompt the server took from its cache and what the rest cost. A
 * benchmark, not a test: the figures are printed, never held against a target.
 *
 *   serve_agents HOST PORT [--turns N] [--max-tokens T] [--conversations C] [--no-reuse] [--timeout S]
 *
 *   HOST     a loopback address (127.x.x.x, ::1 or localhost); anything else is refused
 *   N        user turns per conversation (default 20)
 *   T        max_tokens of each request (default 500)
 *   C        conversations, interleaved one request at a time: turn 1 of each, then turn 2 of
 *            each, ... (default 1); more conversations than server slots evict each other
 *   --no-reuse  each request carries "cache_prompt":false: the baseline without prefix reuse
 *   S        a request not finished after S seconds is lost (default 300)
 *
 * Every request offers the same seven tools (read_file, search, apply_patch, ...), as a coding
 * agent's do. A conversation is a system message (the same for all, as one agent's instructions would be),
 * then per turn a new user message of 40-80 words that names its conversation and turn, so that
 * conversations part from their first user message on. Each request sends the whole history, as
 * a client does: POST /v1/chat/completions, stream, include_usage, temperature 0. The reply's
 * content deltas, joined, go back into the history as the assistant message; reasoning_content
 * is left out, as clients leave the thinking out. Events are read with tests/minijson.h, which
 * decodes \uXXXX escapes (surrogate pairs too); the history is escaped again when sent.
 *
 * Per request one line: prompt tokens, cached (usage.prompt_tokens_details.cached_tokens),
 * computed (prompt - cached), cached %, time to first token seen here (request sent -> first
 * delta with content, reasoning_content or tool_calls), the server's timings.prompt_ms, and
 * completion tokens; what the server does not send prints "-". Then per conversation and over
 * all, from turn 2 on: the share of prompt tokens cached, and prompt_ms and TTFT of turn 2
 * against the last turn, to show whether they grow with the history.
 * `ok - ` / `FAIL - ` lines (tests/check.h) say only whether the run worked: each request a 200
 * stream with a usage chunk that ends `data: [DONE]` in time. A lost request ends its
 * conversation (there is no reply to put into the history); exit status 0 unless one was lost.
 *
 * Build: gcc -std=c11 -O2 -Wall -Wextra -Wno-unused-function -pthread tests/serve_agents.c -o build/serve_agents
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
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

static void die(const char *msg)
{
    fprintf(stderr, "serve_agents: %s\n", msg);
    exit(2);
}

#include "check.h"
#include "http_client.h"
#include "minijson.h"

/* ---- a growable byte buffer ----------------------------------------------------------------- */

struct buf {
    char *p; /* NUL-terminated after every append (minijson's parser relies on it) */
    size_t n, cap;
};

static void buf_add(struct buf *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) die("out of memory");
        b->p = p, b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void buf_str(struct buf *b, const char *s) { buf_add(b, s, strlen(s)); }

/* A formatted piece of at most 511 bytes (numbers and short keys only). */
static void buf_printf(struct buf *b, const char *fmt, ...)
{
    char piece[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(piece, sizeof piece, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof piece) die("a formatted piece over 511 bytes");
    buf_add(b, piece, (size_t)n);
}

static void buf_free(struct buf *b)
{
    free(b->p);
    memset(b, 0, sizeof *b);
}

/* S[0..N) as a JSON string, quotes included. Bytes from 0x80 up pass unchanged: they are UTF-8,
 * from this file's texts or decoded by minijson from the server's strings. */
static void buf_json_string(struct buf *b, const char *s, size_t n)
{
    buf_add(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"') buf_str(b, "\\\"");
        else if (ch == '\\') buf_str(b, "\\\\");
        else if (ch == '\n') buf_str(b, "\\n");
        else if (ch == '\t') buf_str(b, "\\t");
        else if (ch < 0x20) buf_printf(b, "\\u%04x", ch);
        else buf_add(b, &s[i], 1);
    }
    buf_add(b, "\"", 1);
}

/* ---- one streaming request ------------------------------------------------------------------ */

/* What one request gave; a figure the server did not send is -1. */
struct turn {
    int answered;     /* a 200 stream with a usage chunk, ending data: [DONE] */
    char why[200];    /* when not answered: what went wrong */
    int prompt_tokens, cached_tokens, completion_tokens;
    double ttft;      /* s, request sent -> first delta with content, reasoning or tool calls */
    double prompt_ms; /* the server's timings.prompt_ms: its own prompt processing */
};

/* The event-stream parser's state across chunk boundaries. */
struct stream {
    struct buf event;    /* the event being assembled */
    struct buf *content; /* the content deltas, joined: the assistant message */
    int done, usage;
    char error[160];     /* the first bad event, if any */
    double t_sent;
    struct turn *turn;
};

static int lost(struct turn *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->why, sizeof t->why, fmt, ap);
    va_end(ap);
    t->answered = 0;
    return -1;
}

/* The usage and timings of the last chunk into the turn; absent members stay -1. */
static void stream_usage(struct stream *s, const struct mj *ev)
{
    struct turn *t = s->turn;
    const struct mj *usage = mj_get(ev, "usage"), *timings = mj_get(ev, "timings");
    if (usage && usage->type == MJ_OBJ) {
        s->usage = 1;
        t->prompt_tokens = (int)mj_num(mj_get(usage, "prompt_tokens"), -1);
        t->completion_tokens = (int)mj_num(mj_get(usage, "completion_tokens"), -1);
        t->cached_tokens = (int)mj_num(mj_get(mj_get(usage, "prompt_tokens_details"), "cached_tokens"), -1);
    }
    if (timings && timings->type == MJ_OBJ) t->prompt_ms = mj_num(mj_get(timings, "prompt_ms"), -1);
}

/* One data payload D (NUL-terminated): [DONE], an error event, or a chunk. */
static void stream_data(struct stream *s, const char *d)
{
    if (!strcmp(d, "[DONE]")) {
        s->done = 1;
        return;
    }
    const char *why;
    size_t at;
    struct mj *ev = mj_parse(d, strlen(d), &why, &at);
    if (!ev) {
        if (!s->error[0]) snprintf(s->error, sizeof s->error, "an event that is not JSON (%s at byte %zu)", why, at);
        return;
    }
    if (mj_get(ev, "error") && !s->error[0]) snprintf(s->error, sizeof s->error, "an error event: %.120s", d);
    const struct mj *delta = mj_get(mj_at(mj_get(ev, "choices"), 0), "delta");
    size_t content_n = 0, reasoning_n = 0;
    const char *content = mj_str(mj_get(delta, "content"), &content_n);
    mj_str(mj_get(delta, "reasoning_content"), &reasoning_n); /* counted for TTFT, kept out of the history */
    if (content) buf_add(s->content, content, content_n);
    int carries = content_n || reasoning_n || mj_len(mj_get(delta, "tool_calls"));
    if (carries && s->turn->ttft < 0) s->turn->ttft = now_s() - s->t_sent;
    stream_usage(s, ev);
    mj_free(ev);
}

/* One complete event: its data lines, each one JSON payload (coli sends one line per event). */
static void stream_event(struct stream *s, char *ev)
{
    for (char *line = ev; line && *line;) {
        char *next = strchr(line, '\n');
        if (next) *next++ = 0;
        size_t l = strlen(line);
        if (l && line[l - 1] == '\r') line[--l] = 0;
        if (!strncmp(line, "data:", 5)) stream_data(s, line + 5 + (line[5] == ' '));
        line = next;
    }
}

/* Feeds decoded body bytes; events end with a blank line ("\n\n", or "\r\n\r\n"). */
static void stream_feed(struct stream *s, const char *d, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        buf_add(&s->event, &d[i], 1);
        const char *e = s->event.p;
        size_t m = s->event.n;
        if (d[i] == '\n' && ((m >= 2 && e[m - 2] == '\n') || (m >= 4 && !memcmp(e + m - 4, "\r\n\r\n", 4)))) {
            stream_event(s, s->event.p);
            s->event.n = 0;
        }
    }
}

/* Reads the chunked body into the event parser; 0 or -1 (the turn's why says why). */
static int read_chunked(struct conn *c, double deadline, struct stream *s)
{
    char line[256];
    for (;;) {
        long n = conn_line(c, deadline, line, sizeof line);
        if (n < 0) return lost(s->turn, n == L_TIMEOUT ? "timed out in the stream" : "stream cut short (no last chunk)");
        char *end;
        unsigned long size = strtoul(line, &end, 16);
        if (end == line || (*end && *end != ';')) return lost(s->turn, "bad chunk size line '%.40s'", line);
        if (size == 0) {
            while (conn_line(c, deadline, line, sizeof line) > 0) {} /* trailers */
            return 0;
        }
        while (size) {
            if (c->beg == c->end) {
                int k = conn_fill(c, deadline);
                if (k != 1) return lost(s->turn, k == -1 ? "timed out in the stream" : "stream cut short in a chunk");
            }
            size_t k = c->end - c->beg < size ? c->end - c->beg : size;
            stream_feed(s, c->buf + c->beg, k);
            c->beg += k, size -= k;
        }
        long e = conn_line(c, deadline, line, sizeof line);
        if (e != 0) return lost(s->turn, e == L_TIMEOUT ? "timed out in the stream" : "no CR LF after a chunk's data");
    }
}

/* Status line and headers; the status, or -1. */
static int read_head(struct conn *c, double deadline, struct turn *t, int *chunked)
{
    char line[4096];
    int status = 0;
    do { /* interim 1xx replies are skipped */
        long n = conn_line(c, deadline, line, sizeof line);
        if (n < 0) return lost(t, n == L_TIMEOUT ? "no reply in time" : "closed without a reply");
        if (strncmp(line, "HTTP/1.", 7) || strlen(line) < 12) return lost(t, "bad status line '%.60s'", line);
        status = atoi(line + 9);
        *chunked = 0;
        while ((n = conn_line(c, deadline, line, sizeof line)) > 0)
            if (!strncasecmp(line, "transfer-encoding:", 18) && strcasestr(line, "chunked")) *chunked = 1;
        if (n < 0) return lost(t, "reply headers cut short");
    } while (status < 200);
    return status;
}

static double g_timeout = 300;

/* The reply after the request went out: status, headers, the stream into S. */
static void read_reply(struct conn *c, double deadline, struct stream *s)
{
    struct turn *t = s->turn;
    int chunked = 0, status = read_head(c, deadline, t, &chunked);
    if (status < 0) return;
    if (status != 200) {
        char reply[160] = "";
        long n = conn_line(c, now_s() + 2, reply, sizeof reply);
        lost(t, "status %d: %s", status, n >= 0 ? reply : "");
    } else if (!chunked) lost(t, "a 200 stream without Transfer-Encoding: chunked");
    else if (read_chunked(c, deadline, s) == 0) {
        if (s->error[0]) lost(t, "%s", s->error);
        else if (!s->done) lost(t, "the stream ended without data: [DONE]");
        else if (!s->usage) lost(t, "no usage chunk (stream_options.include_usage)");
        else t->answered = 1;
    }
}

/* Sends BODY as a chat completion and reads the stream: the figures into T, the content deltas
 * appended to CONTENT. */
static void one_request(const struct buf *body, struct turn *t, struct buf *content)
{
    memset(t, 0, sizeof *t);
    t->prompt_tokens = t->cached_tokens = t->completion_tokens = -1;
    t->ttft = t->prompt_ms = -1;
    struct conn *c = malloc(sizeof *c);
    if (!c) die("out of memory");
    c->beg = c->end = 0;
    c->fd = connect_srv();
    if (c->fd < 0) {
        lost(t, "cannot connect: %s", strerror(errno));
        free(c);
        return;
    }
    char head[256];
    int hn = snprintf(head, sizeof head,
                      "POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                      "Accept: text/event-stream\r\nConnection: close\r\nContent-Length: %zu\r\n\r\n",
                      srv_name, body->n);
    double deadline = now_s() + g_timeout;
    struct stream s = {.content = content, .turn = t};
    if (send_all(c->fd, head, (size_t)hn, deadline) < 0 || send_all(c->fd, body->p, body->n, deadline) < 0)
        lost(t, "sending failed");
    else {
        s.t_sent = now_s();
        read_reply(c, deadline, &s);
    }
    buf_free(&s.event);
    close(c->fd);
    free(c);
}

/* ---- the conversations ---------------------------------------------------------------------- */

/* About 90 words, sent first in every conversation: a prefix all of them share. */
static const char system_prompt[] =
    "You are a coding agent working inside a C repository: a single-file inference engine with a "
    "small HTTP server, its tests and a build script. You read files, propose minimal changes and "
    "explain how you checked them. Keep answers short and concrete: name the file and the function, "
    "show the change as a unified diff, and say which test covers it. Do not rewrite code that works, "
    "do not invent APIs, and ask one clear question when the request is ambiguous instead of guessing. "
    "Prefer plain C11, static functions and comments that say why.";

/* The tools every request offers, as a coding agent's do: rendered into the system turn, they
 * are most of the prefix that every turn of every conversation shares (about 1,300 tokens). */
static const char agent_tools[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"read_file\",\"description\":\"Read a text file of the repository. Returns the "
    "lines asked for, numbered from 1, or an error when the file does not exist or is binary. Use it before proposing any change "
    "to a file, and read enough context around the lines you mean to change.\",\"parameters\":{\"type\":\"object\",\"properties\":"
    "{\"path\":{\"type\":\"string\",\"description\":\"Path relative to the repository root, e.g. src/serve.c\"},\"first_line\":"
    "{\"type\":\"integer\",\"description\":\"First line to return (1-based); default 1\"},\"last_line\":{\"type\":\"integer\","
    "\"description\":\"Last line to return; default the end of the file, at most 400 lines after first_line\"}},\"required\":[\"path\"]}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"search\",\"description\":\"Search the repository for a regular expression "
    "(POSIX extended). Returns up to max_results matches as path:line:text, sorted by path. Binary files and the build directory "
    "are skipped.\",\"parameters\":{\"type\":\"object\",\"properties\":{\"pattern\":{\"type\":\"string\",\"description\":"
    "\"The regular expression\"},\"path\":{\"type\":\"string\",\"description\":\"A folder or file to search in; default the whole "
    "repository\"},\"max_results\":{\"type\":\"integer\",\"description\":\"Default 50\"},\"case_sensitive\":{\"type\":\"boolean\"}},"
    "\"required\":[\"pattern\"]}}},{\"type\":\"function\",\"function\":{\"name\":\"apply_patch\",\"description\":\"Apply a unified "
    "diff to the working tree. The patch must apply cleanly: context lines must match exactly. Returns the files changed, or the "
    "first hunk that failed and why. Never touches files outside the repository.\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"patch\":{\"type\":\"string\",\"description\":\"A unified diff with a/ and b/ prefixes\"},\"dry_run\":"
    "{\"type\":\"boolean\",\"description\":\"Check that it applies without writing anything\"}},\"required\":[\"patch\"]}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"run_command\",\"description\":\"Run a shell command in the repository root "
    "with a time limit and return its exit status, standard output and standard error (each cut to its last 20,000 characters). "
    "The network is not reachable. Use it to build, to run one test, or to inspect the tree; do not start servers that outlive "
    "the command.\",\"parameters\":{\"type\":\"object\",\"properties\":{\"command\":{\"type\":\"string\"},\"timeout_s\":"
    "{\"type\":\"integer\",\"description\":\"Seconds before the command is killed; default 120, at most 600\"}},\"required\":"
    "[\"command\"]}}},{\"type\":\"function\",\"function\":{\"name\":\"list_files\",\"description\":\"List the files under a folder "
    "with their sizes in bytes, recursively up to a depth, ignoring what .gitignore ignores.\",\"parameters\":{\"type\":\"object\","
    "\"properties\":{\"path\":{\"type\":\"string\"},\"depth\":{\"type\":\"integer\",\"description\":\"Default 2\"}},\"required\":"
    "[]}}},{\"type\":\"function\",\"function\":{\"name\":\"git_diff\",\"description\":\"Show the working tree's changes against a "
    "revision as a unified diff, or only the names and line counts with stat.\",\"parameters\":{\"type\":\"object\",\"properties\":"
    "{\"revision\":{\"type\":\"string\",\"description\":\"Default HEAD\"},\"stat\":{\"type\":\"boolean\"},\"paths\":{\"type\":"
    "\"array\",\"items\":{\"type\":\"string\"}}},\"required\":[]}}},{\"type\":\"function\",\"function\":{\"name\":\"ask_user\","
    "\"description\":\"Ask the user one question when the request cannot be done without an answer, with up to four suggested "
    "answers. The conversation waits for the reply.\",\"parameters\":{\"type\":\"object\",\"properties\":{\"question\":{\"type\":"
    "\"string\"},\"choices\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":4}},\"required\":[\"question\"]}}}]";

static const char *const projects[] = {
    "the tokenizer", "the HTTP server", "the GGUF reader", "the expert cache",
    "the sampler", "the JSON parser", "the chat template renderer", "the thread pool",
};
static const char *const files[] = {
    "src/tok.c", "src/serve.c", "src/gguf.c", "src/experts.c", "src/sample.c",
    "src/json.c", "src/template.c", "src/pool.c", "tests/test_serve.sh", "build.sh", "README.md",
};
/* Each about 20 words. */
static const char *const asks[] = {
    "Find where a request larger than the limit is refused and make the error say which limit it hit and its value.",
    "A user reports that the second answer in a chat is slower than the first; find what is recomputed and why.",
    "Add a counter of how many times this path runs, exposed with the other metrics, and document what it counts.",
    "Explain what happens when two threads reach this function at the same time, and fix it if anything can race.",
    "The error message on a malformed input names no position; make it give the byte offset and the expected token.",
    "Shorten the function that has grown past one screen by splitting out the step that parses its arguments.",
    "Write a test for the case where the input is empty, and say what the function should return for it.",
    "Measure how long this step takes on a long input and say whether it is worth caching the result.",
};
/* Each about 15 words. */
static const char *const constraints[] = {
    "Keep the public behaviour the same for every input that worked before, byte for byte.",
    "The change must not allocate on the hot path; reuse the buffers that are already there.",
    "Assume the machine has two cores and little memory, so nothing may hold the whole file.",
    "Any new error must follow the one-line format the rest of the program already uses.",
    "Do not touch the build flags; the binary must stay static and run on any x86-64.",
    "The fix has to be small enough to review in five minutes, with a test beside it.",
};

#define COUNT(a) ((int)(sizeof(a) / sizeof *(a)))

/* The user message of conversation C, turn T (from 0), about 60 words: its numbers and project make
 * it differ per conversation, the rest varies per turn. */
static void user_message(struct buf *out, int c, int t)
{
    out->n = 0;
    buf_printf(out, "Session %d, step %d, on %s. Open %s and %s first. ", c + 1, t + 1, projects[c % COUNT(projects)],
               files[(c * 5 + t * 3) % COUNT(files)], files[(c * 3 + t * 7 + 1) % COUNT(files)]);
    buf_str(out, asks[(t + c * 3) % COUNT(asks)]);
    buf_str(out, " ");
    buf_str(out, constraints[(t * 5 + c) % COUNT(constraints)]);
    buf_str(out, " Reply with the diff, then one paragraph on how you checked it.");
}

struct conversation {
    struct buf messages; /* the history so far: JSON message objects, comma-separated */
    struct turn *turns;  /* [n_turns] */
    int n_answered;      /* turns 0 .. n_answered-1 were answered; a lost turn ends the conversation */
    int ended;
};

static void add_message(struct buf *messages, const char *role, const char *text, size_t n)
{
    if (messages->n) buf_add(messages, ",", 1);
    buf_printf(messages, "{\"role\":\"%s\",\"content\":", role);
    buf_json_string(messages, text, n);
    buf_add(messages, "}", 1);
}

static int g_max_tokens = 500, g_no_reuse;

/* A count, or "-" when the server did not send it. */
static const char *int_or_dash(char *out, size_t cap, long v)
{
    if (v < 0) return "-";
    snprintf(out, cap, "%ld", v);
    return out;
}

static const char *real_or_dash(char *out, size_t cap, const char *fmt, double v)
{
    if (v < 0) return "-";
    snprintf(out, cap, fmt, v);
    return out;
}

static void print_turn(int c, int t, const struct turn *r)
{
    if (!r->answered) {
        printf("# %4d %4d  lost: %s\n", c, t + 1, r->why);
        return;
    }
    int cached = r->cached_tokens >= 0 && r->prompt_tokens >= r->cached_tokens;
    char s[7][32];
    printf("# %4d %4d %7s %7s %8s %7s %8s %10s %10s\n", c, t + 1, int_or_dash(s[0], 32, r->prompt_tokens),
           int_or_dash(s[1], 32, r->cached_tokens), int_or_dash(s[2], 32, cached ? r->prompt_tokens - r->cached_tokens : -1),
           real_or_dash(s[3], 32, "%.1f", cached && r->prompt_tokens > 0 ? 100.0 * r->cached_tokens / r->prompt_tokens : -1),
           real_or_dash(s[4], 32, "%.3f", r->ttft), real_or_dash(s[5], 32, "%.1f", r->prompt_ms),
           int_or_dash(s[6], 32, r->completion_tokens));
}

/* Runs turn T of conversation C: the new user message, the request with the whole history, the
 * reply into the history. */
static void run_turn(struct conversation *cv, int c, int t)
{
    struct buf text = {0}, body = {0}, reply = {0};
    user_message(&text, c, t);
    add_message(&cv->messages, "user", text.p, text.n);
    buf_str(&body, "{\"model\":\"coli\",\"messages\":[");
    buf_add(&body, cv->messages.p, cv->messages.n);
    buf_str(&body, "],\"tools\":");
    buf_str(&body, agent_tools);
    buf_printf(&body, ",\"max_tokens\":%d,\"temperature\":0,\"stream\":true,\"stream_options\":{\"include_usage\":true}%s}",
               g_max_tokens, g_no_reuse ? ",\"cache_prompt\":false" : "");
    struct turn *r = &cv->turns[t];
    one_request(&body, r, &reply);
    print_turn(c, t, r);
    if (r->answered) {
        add_message(&cv->messages, "assistant", reply.p, reply.n);
        cv->n_answered = t + 1;
    } else
        cv->ended = 1;
    buf_free(&text);
    buf_free(&body);
    buf_free(&reply);
}

/* ---- the figures ---------------------------------------------------------------------------- */

/* Over the N conversations CV, from turn 2 on: the share of prompt tokens cached; and prompt_ms
 * and TTFT of turn 2 against each conversation's last answered turn, as means over the
 * conversations where both are known (so that the two means cover the same conversations). */
static void print_summary(const char *label, const struct conversation *cv, int n)
{
    long prompt = 0, cached = 0;
    int cached_known = 1, n_ms = 0, n_ttft = 0, last = 0;
    double ms[2] = {0, 0}, ttft[2] = {0, 0};
    for (int i = 0; i < n; i++) {
        for (int t = 1; t < cv[i].n_answered; t++) {
            const struct turn *r = &cv[i].turns[t];
            prompt += r->prompt_tokens > 0 ? r->prompt_tokens : 0;
            cached += r->cached_tokens > 0 ? r->cached_tokens : 0;
            cached_known &= r->cached_tokens >= 0 && r->prompt_tokens >= 0;
        }
        if (cv[i].n_answered < 2) continue;
        const struct turn *a = &cv[i].turns[1], *z = &cv[i].turns[cv[i].n_answered - 1];
        if (cv[i].n_answered > last) last = cv[i].n_answered;
        if (a->prompt_ms >= 0 && z->prompt_ms >= 0) ms[0] += a->prompt_ms, ms[1] += z->prompt_ms, n_ms++;
        if (a->ttft >= 0 && z->ttft >= 0) ttft[0] += a->ttft, ttft[1] += z->ttft, n_ttft++;
    }
    if (last < 2) {
        printf("# %s: fewer than 2 turns answered, nothing to compare\n", label);
        return;
    }
    char s[3][32], turns[32];
    if (last == 2) snprintf(turns, sizeof turns, "turn 2");
    else snprintf(turns, sizeof turns, "turns 2-%d", last);
    printf("# %s, %s: %s of %ld prompt tokens cached (%s)\n", label, turns, int_or_dash(s[0], 32, cached_known ? cached : -1), prompt,
           real_or_dash(s[1], 32, "%.1f%%", cached_known && prompt ? 100.0 * cached / prompt : -1));
    printf("#   server prompt_ms: turn 2 %s, last turn %s, last / turn 2 %s\n", real_or_dash(s[0], 32, "%.1f", n_ms ? ms[0] / n_ms : -1),
           real_or_dash(s[1], 32, "%.1f", n_ms ? ms[1] / n_ms : -1), real_or_dash(s[2], 32, "%.2f", n_ms && ms[0] > 0 ? ms[1] / ms[0] : -1));
    printf("#   client TTFT s: turn 2 %s, last turn %s, last / turn 2 %s\n", real_or_dash(s[0], 32, "%.3f", n_ttft ? ttft[0] / n_ttft : -1),
           real_or_dash(s[1], 32, "%.3f", n_ttft ? ttft[1] / n_ttft : -1),
           real_or_dash(s[2], 32, "%.2f", n_ttft && ttft[0] > 0 ? ttft[1] / ttft[0] : -1));
}

/* ---- main ----------------------------------------------------------------------------------- */

static void usage(void)
{
    fprintf(stderr, "usage: serve_agents HOST PORT [--turns N] [--max-tokens T] [--conversations C] [--no-reuse] [--timeout S]\n"
                    "  HOST must be loopback: 127.x.x.x, ::1 or localhost\n");
    exit(2);
}

/* Runs the conversations interleaved and prints the figures; returns how many requests were lost. */
static int run_all(struct conversation *cv, int n_conv, int n_turns)
{
    printf("# %4s %4s %7s %7s %8s %7s %8s %10s %10s\n", "conv", "turn", "prompt", "cached", "computed", "cached%", "ttft_s",
           "prompt_ms", "completion");
    for (int t = 0; t < n_turns; t++)
        for (int c = 0; c < n_conv; c++)
            if (!cv[c].ended) run_turn(&cv[c], c, t);
    int n_lost = 0;
    char label[64];
    for (int c = 0; c < n_conv; c++) {
        n_lost += cv[c].ended;
        snprintf(label, sizeof label, "conversation %d", c);
        print_summary(label, &cv[c], 1);
    }
    if (n_conv > 1) print_summary("all conversations (means)", cv, n_conv);
    return n_lost;
}

int main(int argc, char **argv)
{
    if (argc < 3) usage();
    int n_turns = 20, n_conv = 1;
    for (int a = 3; a < argc; a++) {
        if (!strcmp(argv[a], "--turns") && a + 1 < argc) n_turns = atoi(argv[++a]);
        else if (!strcmp(argv[a], "--max-tokens") && a + 1 < argc) g_max_tokens = atoi(argv[++a]);
        else if (!strcmp(argv[a], "--conversations") && a + 1 < argc) n_conv = atoi(argv[++a]);
        else if (!strcmp(argv[a], "--no-reuse")) g_no_reuse = 1;
        else if (!strcmp(argv[a], "--timeout") && a + 1 < argc) g_timeout = atof(argv[++a]);
        else usage();
    }
    if (n_turns < 1 || n_turns > 10000 || g_max_tokens < 1 || n_conv < 1 || n_conv > 1000 || g_timeout <= 0) usage();
    if (resolve_loopback(argv[1], argv[2]) < 0) {
        fprintf(stderr, "serve_agents: refusing '%s' port '%s': only a loopback address and a port 1-65535\n", argv[1], argv[2]);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("# serve_agents: %s, %d conversation%s x %d turns, max_tokens %d, prompt reuse %s\n", srv_name, n_conv, n_conv > 1 ? "s" : "",
           n_turns, g_max_tokens, g_no_reuse ? "off (cache_prompt:false)" : "on");
    if (!wait_health()) {
        check(0, "server up (GET /health 200)", "no 200 within 120 s");
        return check_done();
    }
    struct conversation *cv = calloc((size_t)n_conv, sizeof *cv);
    if (!cv) die("out of memory");
    for (int c = 0; c < n_conv; c++) {
        cv[c].turns = calloc((size_t)n_turns, sizeof *cv[c].turns);
        if (!cv[c].turns) die("out of memory");
        add_message(&cv[c].messages, "system", system_prompt, strlen(system_prompt));
    }
    double t0 = now_s();
    int n_lost = run_all(cv, n_conv, n_turns);
    printf("# wall %.1f s\n", now_s() - t0);
    check(n_lost == 0, "every request answered (a 200 stream with usage, ending data: [DONE], in time)",
          "%d conversation%s ended by a lost request (see the lost lines)", n_lost, n_lost == 1 ? "" : "s");
    for (int c = 0; c < n_conv; c++) buf_free(&cv[c].messages), free(cv[c].turns);
    free(cv);
    return check_done();
}
