/* http_client.h: the HTTP client side that tests/serve_fuzz.c and tests/serve_load.c share:
 * a loopback-only address, non-blocking connections, sends and buffered line reads, every wait
 * bounded by a deadline. Include after the system headers (both files list them). */
#ifndef COLI_TEST_HTTP_CLIENT_H
#define COLI_TEST_HTTP_CLIENT_H

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* ---- the connection: loopback only, non-blocking, every wait bounded by a deadline --------- */

static struct sockaddr_storage srv_addr;
static socklen_t srv_len;
static char srv_name[80];

/* Resolves HOST:PORT into srv_addr; refuses anything that is not a loopback address. */
static int resolve_loopback(const char *host, const char *port_s)
{
    char h[64];
    size_t n = strlen(host);
    if (n >= sizeof h) return -1;
    if (host[0] == '[' && n > 2 && host[n - 1] == ']') memcpy(h, host + 1, n - 2), h[n - 2] = 0;
    else memcpy(h, host, n + 1);
    if (!strcasecmp(h, "localhost")) strcpy(h, "127.0.0.1");
    char *end;
    long port = strtol(port_s, &end, 10);
    if (*end || port < 1 || port > 65535) return -1;
    memset(&srv_addr, 0, sizeof srv_addr);
    struct sockaddr_in *a4 = (struct sockaddr_in *)&srv_addr;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&srv_addr;
    if (inet_pton(AF_INET, h, &a4->sin_addr) == 1) {
        if ((ntohl(a4->sin_addr.s_addr) >> 24) != 127) return -1;
        a4->sin_family = AF_INET;
        a4->sin_port = htons((uint16_t)port);
        srv_len = sizeof *a4;
    } else if (inet_pton(AF_INET6, h, &a6->sin6_addr) == 1) {
        if (!IN6_IS_ADDR_LOOPBACK(&a6->sin6_addr)) return -1;
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons((uint16_t)port);
        srv_len = sizeof *a6;
    } else
        return -1;
    snprintf(srv_name, sizeof srv_name, "%s:%ld", h, port);
    return 0;
}

/* A connected non-blocking socket, or -1 (5 s at most). */
static int connect_srv(void)
{
    int fd = socket(srv_addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (struct sockaddr *)&srv_addr, srv_len) < 0 && errno != EINPROGRESS) goto fail;
    struct pollfd p = {fd, POLLOUT, 0};
    if (poll(&p, 1, 5000) != 1) goto fail;
    int err = 0;
    socklen_t el = sizeof err;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) < 0 || err) goto fail;
    return fd;
fail:
    close(fd);
    return -1;
}

/* Sends all of P; 0 done, -1 deadline, -2 the server closed or reset (fine: it may reject early). */
static int send_all(int fd, const char *p, size_t n, double deadline)
{
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k > 0) {
            p += k, n -= (size_t)k;
            continue;
        }
        if (k < 0 && errno != EAGAIN && errno != EINTR) return -2;
        int ms = (int)((deadline - now_s()) * 1000);
        if (ms <= 0) return -1;
        struct pollfd q = {fd, POLLOUT, 0};
        poll(&q, 1, ms);
    }
    return 0;
}

/* Buffered reads from the server. */
struct conn {
    int fd;
    char buf[256 * 1024];
    size_t beg, end;
};

/* Reads more bytes: 1 got some, 0 EOF or reset, -1 deadline, -3 a line over the buffer. */
static int conn_fill(struct conn *c, double deadline)
{
    if (c->beg == c->end) c->beg = c->end = 0;
    if (c->end == sizeof c->buf) {
        if (!c->beg) return -3;
        memmove(c->buf, c->buf + c->beg, c->end - c->beg);
        c->end -= c->beg, c->beg = 0;
    }
    for (;;) {
        ssize_t k = recv(c->fd, c->buf + c->end, sizeof c->buf - c->end, 0);
        if (k > 0) {
            c->end += (size_t)k;
            return 1;
        }
        if (k == 0 || (errno != EAGAIN && errno != EINTR)) return 0;
        int ms = (int)((deadline - now_s()) * 1000);
        if (ms <= 0) return -1;
        struct pollfd q = {c->fd, POLLIN, 0};
        poll(&q, 1, ms);
    }
}

enum { L_TIMEOUT = -1, L_EOF = -2, L_LONG = -3 };

/* The next line (without CR LF) copied into OUT (cut to CAP); returns its length or an L_ code. */
static long conn_line(struct conn *c, double deadline, char *out, size_t cap)
{
    for (;;) {
        char *nl = memchr(c->buf + c->beg, '\n', c->end - c->beg);
        if (nl) {
            size_t len = (size_t)(nl - (c->buf + c->beg));
            size_t keep = len && nl[-1] == '\r' ? len - 1 : len;
            size_t k = keep < cap - 1 ? keep : cap - 1;
            memcpy(out, c->buf + c->beg, k);
            out[k] = 0;
            c->beg += len + 1;
            return (long)keep;
        }
        int r = conn_fill(c, deadline);
        if (r != 1) return r == 0 ? L_EOF : r;
    }
}

/* GET /health 200, waiting up to 120 s for the model to load. (The includer defines die.) */
static int wait_health(void)
{
    double t0 = now_s();
    while (now_s() - t0 < 120) {
        int fd = connect_srv();
        if (fd >= 0) {
            const char *req = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
            struct conn *c = malloc(sizeof *c);
            if (!c) die("out of memory");
            c->fd = fd, c->beg = c->end = 0;
            char line[256];
            int ok = send_all(fd, req, strlen(req), now_s() + 5) == 0 && conn_line(c, now_s() + 5, line, sizeof line) > 12 &&
                     atoi(line + 9) == 200;
            close(fd);
            free(c);
            if (ok) return 1;
        }
        struct timespec ts = {0, 500000000L};
        nanosleep(&ts, NULL);
    }
    return 0;
}

#endif
