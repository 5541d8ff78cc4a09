/* coli — one static binary that runs mixture-of-experts language models (first family:
 * Qwen3.5 / Qwen3.6 / Qwen3-Next, GGUF files) on the machines people already own.
 *
 * Build: ./build.sh        (musl-gcc -static -O2 -fopenmp; see build.sh)
 * Test:  ./build.sh test
 * Use:   ./coli run -m MODEL.gguf -p "Hello"      (./coli --help for the rest)
 *
 * TABLE OF CONTENTS (bottom-up: a section uses only the sections above it)
 *   §1  platform   plat_    logging, die, allocation, files, time, memory, CPU features, OpenMP shim
 *   §2  gguf       gguf_    GGUF v2/v3 reader (split files too), strictly validated, memory-mapped;
 *                           the writer of a file's head (synthetic models)
 *   §3  quant      quant_   block formats, dequantisation, activation quantisation, dot products
 *   §4  ops        ops_     matrix-vector / matrix-matrix products, norms, RoPE, softmax, activations,
 *                           attention over the KV cache (fp32, fp16, Q8_0)
 *   §5  cuda       cuda_    the system's CUDA driver via foreign dlopen, devices, embedded PTX, device GEMVs
 *   §6  experts    expert_  the expert store: RAM cache with a budget, pread readers, heat, statistics
 *   §7  place      place_   what lives in VRAM, trunk then experts by value per byte; COLI_PLACE, plan's dry run
 *   §8  model      model_   hyper-parameters, weight binding, forward pass (qwen35moe, qwen35, qwen3next)
 *   §9  tokenizer  tok_     byte-level BPE from GGUF metadata, special tokens; JSON values (json_); the chat templates
 *   §10 sample     sample_  greedy, temperature, top-k, top-p, min-p, repetition penalty, seed
 *   §11 engine     engine_  generation: slots (a sequence and its request each) stepped together as one batch; the prompt cache
 *   §12 serve      serve_   the OpenAI-compatible HTTP server: HTTP/1.1, the job queue, streaming, reasoning and tool calls
 *   §13 frontends  cmd_     run, chat, serve, plan, bench, info, tokenize; synthetic models (--synthetic)
 *   §14 main       arg_     argument parsing and dispatch
 *
 * Conventions: everything is static; every function carries its section prefix (§9's JSON
 * values: json_, as they are the server's too); shapes are written outermost first,
 * `[rows][cols]`, in elements. Errors go through die(): one line `coli: <what>: <why>` and
 * exit status 1 (2 for usage errors); once `serve` answers requests, nothing dies.
 */
/* Tests include this file, several of them into one binary (tests/suite.c): once is enough. */
#ifndef COLI_C
#define COLI_C
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <strings.h>
#include <immintrin.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include "vendor/unicode_tables.h"

#define COLI_VERSION "0.1.0"

/* ==== §1 platform ==== */
/* Owns: the process's error path (die), allocation that cannot fail silently, whole-file
 *   mapping and copies of weights out of it, monotonic time, the memory figures
 *   (cgroup-aware), the CPU's features, and the glue that lets Debian's glibc-built libgomp.a
 *   link into a static musl binary.
 * Promises: die() never returns and prints exactly one line. plat_alloc* never return NULL.
 *   plat_cpu is filled by plat_cpu_detect() before anything reads it.
 * May call: libc; OpenMP (plat_copy_weights, plat_prefault_parallel).
 * Workload: start-up and error paths; nothing here is on the per-token path. */

/* Prints `coli: MESSAGE` as one line: control characters that came from a file (a tensor
 * name with a newline, say) are written as \xNN so the error stays one line. */
static void plat_vreport(const char *fmt, va_list ap)
{
    char msg[1024];
    vsnprintf(msg, sizeof msg, fmt, ap);
    fflush(stdout);
    fputs("coli: ", stderr);
    for (const unsigned char *p = (const unsigned char *)msg; *p; p++) {
        if (*p < 0x20 || *p == 0x7f) fprintf(stderr, "\\x%02x", *p);
        else fputc(*p, stderr);
    }
    fputc('\n', stderr);
}

static void die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    plat_vreport(fmt, ap);
    va_end(ap);
    exit(1);
}

/* A command-line mistake: one line, exit status 2. */
static void die_usage(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
static void die_usage(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    plat_vreport(fmt, ap);
    va_end(ap);
    exit(2);
}

/* Informational lines on stderr (stdout carries only generated text and --json). */
static int plat_quiet;
static void plat_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void plat_log(const char *fmt, ...)
{
    va_list ap;
    if (plat_quiet) return;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

static void *plat_alloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) die("out of memory allocating %zu bytes", n);
    return p;
}

static void *plat_zalloc(size_t count, size_t size)
{
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p) die("out of memory allocating %zu x %zu bytes", count, size);
    return p;
}

static void *plat_realloc(void *old, size_t n)
{
    void *p = realloc(old, n ? n : 1);
    if (!p) die("out of memory allocating %zu bytes", n);
    return p;
}

/* 64-byte aligned (one cache line, one AVX-512 register); release with free(). */
static void *plat_alloc_aligned(size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? (n + 63) & ~(size_t)63 : 64)) die("out of memory allocating %zu bytes", n);
    return p;
}

static char *plat_strdup(const char *s)
{
    size_t n = strlen(s);
    char *d = plat_alloc(n + 1);
    memcpy(d, s, n + 1);
    return d;
}

/* a*b, or die naming what overflowed: sizes from files are never trusted. */
static size_t plat_mul_size(size_t a, size_t b, const char *what)
{
    if (b && a > SIZE_MAX / b) die("%s: size overflow", what);
    return a * b;
}

/* A / B, or 0 when B is not positive (a rate before anything was timed). */
static double plat_ratio(double a, double b) { return b > 0 ? a / b : 0.0; }

static double plat_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A read-only mapping of a whole file. */
struct plat_map {
    const uint8_t *data;
    size_t size;
    int fd;
};

/* Maps PATH read-only; returns 0, or -1 with errno set (the caller words the error): EISDIR
 * for a directory, EINVAL for another file that is not a regular one (a FIFO, a device). */
static int plat_map_file(const char *path, struct plat_map *m)
{
    struct stat st;
    m->data = NULL;
    m->size = 0;
    m->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (m->fd < 0) return -1;
    const int bad = fstat(m->fd, &st) != 0 ? errno : S_ISDIR(st.st_mode) ? EISDIR : !S_ISREG(st.st_mode) ? EINVAL : 0;
    if (bad) {
        close(m->fd);
        errno = bad;
        return -1;
    }
    m->size = (size_t)st.st_size;
    if (m->size == 0) return 0;
    void *p = mmap(NULL, m->size, PROT_READ, MAP_PRIVATE, m->fd, 0);
    if (p == MAP_FAILED) {
        close(m->fd);
        return -1;
    }
    m->data = p;
    return 0;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; musl's headers may predate it */
#endif

/* Faults in the pages of [P, P + N) now, writable, keeping their contents: memory allocated at
 * load that every forward pass writes (the recurrent state, the batch's scratch) would else
 * fault page by page in the first prompt. On this project's VMs that is slow: a 10-layer slice's
 * first 16-token batch spent 40 ms more in DeltaNet than later ones, for 16 MiB of state. */
static void plat_prefault(void *p, size_t n)
{
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = ((uintptr_t)p + page - 1) & ~(page - 1);
    const uintptr_t b = ((uintptr_t)p + n) & ~(page - 1);
    if (b > a && !madvise((void *)a, b - a, MADV_POPULATE_WRITE)) return;
    for (volatile char *c = p; c < (char *)p + n; c += page) *c = *c; /* before 5.14: a write a page */
}

/* plat_prefault over the N bytes at P by every thread, 4 MiB at a time. The kernel zeroes a
 * page as it maps it, and a copy that faults its destination as it goes pays that on whichever
 * thread touches a 2 MiB huge page first while the others wait for it: copying the 10-layer
 * slice's experts spent 28% of its samples in OpenMP's barrier. */
static void plat_prefault_parallel(void *p, size_t n)
{
    const size_t piece = (size_t)4 << 20;
    #pragma omp parallel for schedule(dynamic, 1)
    for (size_t off = 0; off < n; off += piece) plat_prefault((char *)p + off, n - off < piece ? n - off : piece);
}

/* N bytes of anonymous memory for weights copied out of a file mapping, with transparent huge
 * pages asked for (fewer TLB misses where the system has them on); NULL when N is 0 or there is
 * no memory for it (the caller then keeps computing in place). Free with munmap. */
static void *plat_weight_arena(size_t n)
{
    void *p = n ? mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) : MAP_FAILED;
    if (p == MAP_FAILED) return NULL;
    madvise(p, n, MADV_HUGEPAGE);
    return p;
}

/* A file of SIZE bytes that lives in memory only (memfd: sparse, a page exists once written),
 * with a name every open(2) accepts written to PATH: /proc/self/fd/N. Returns the descriptor,
 * or -1 with errno set. */
static int plat_memory_file(const char *name, uint64_t size, char *path, size_t path_n)
{
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0) return -1;
    if (ftruncate(fd, (off_t)size) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    snprintf(path, path_n, "/proc/self/fd/%d", fd);
    return fd;
}

/* One line of progress on a terminal for a long step of loading, "[coli] WHAT: 1.20 of 3.40
 * GiB, 2.1 GB/s, 1 s left", redrawn at most four times a second and wiped at the end, so that
 * the log after it reads as before. Silent when stderr is not a terminal, or with --quiet. */
static int plat_quiet;
static struct { const char *what; uint64_t total, done; double t0, shown; int on; } plat_progress;

static void plat_progress_begin(const char *what, uint64_t total)
{
    plat_progress.what = what;
    plat_progress.total = total;
    plat_progress.done = 0;
    plat_progress.t0 = plat_progress.shown = plat_now();
    plat_progress.on = !plat_quiet && total > 0 && isatty(STDERR_FILENO);
}

static void plat_progress_add(uint64_t n)
{
    double now = plat_now(), rate;
    plat_progress.done += n;
    if (!plat_progress.on || now - plat_progress.shown < 0.25) return;
    plat_progress.shown = now;
    rate = plat_progress.done / (now - plat_progress.t0);
    fprintf(stderr, "\r[coli] %s: %.2f of %.2f GiB, %.1f GB/s, %.0f s left\033[K", plat_progress.what, plat_progress.done / 1073741824.0,
            plat_progress.total / 1073741824.0, rate / 1e9, rate > 0 ? (plat_progress.total - plat_progress.done) / rate : 0.0);
}

static void plat_progress_end(void)
{
    if (plat_progress.on && plat_progress.shown > plat_progress.t0) fputs("\r\033[K", stderr);
    plat_progress.on = 0;
}

/* memcpy of weights out of a file mapping into plat_weight_arena memory, in 2 MiB pieces over
 * the threads: the page faults on both sides (reading the file's pages, zeroing new ones) are
 * most of the cost, and they run in parallel. 64 MiB at a time, for the progress line. */
static void plat_copy_weights(uint8_t *dst, const uint8_t *src, size_t n)
{
    const size_t piece = (size_t)2 << 20, segment = (size_t)64 << 20;
    for (size_t seg = 0; seg < n; seg += segment) {
        size_t end = n - seg < segment ? n : seg + segment;
        #pragma omp parallel for schedule(dynamic, 1)
        for (size_t off = seg; off < end; off += piece) memcpy(dst + off, src + off, end - off < piece ? end - off : piece);
        plat_progress_add(end - seg);
    }
}

/* Drops this process's pages of the LEN bytes at P in a file mapping (after they were copied
 * elsewhere), so they no longer count as ours; the page cache keeps them, for the next start,
 * until memory is wanted. Pages shared with bytes around are kept. */
static void plat_unmap_range(const uint8_t *p, size_t len)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = ((uintptr_t)p + page - 1) & ~(page - 1), b = ((uintptr_t)p + len) & ~(page - 1);
    if (b > a) madvise((void *)a, b - a, MADV_DONTNEED);
}

static void plat_unmap_file(struct plat_map *m)
{
    if (m->data) munmap((void *)m->data, m->size);
    if (m->fd >= 0) close(m->fd);
    m->data = NULL;
    m->fd = -1;
}

/* First integer after KEY in a small text file (/proc/meminfo, cgroup files); -1 if absent. */
static int64_t plat_read_number(const char *path, const char *key)
{
    char buf[8192];
    FILE *f = fopen(path, "re");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = key ? strstr(buf, key) : buf;
    if (!p) return -1;
    p += key ? strlen(key) : 0;
    while (*p == ' ' || *p == ':' || *p == '\t') p++;
    if (!isdigit((unsigned char)*p)) return -1;
    return strtoll(p, NULL, 10);
}

/* The v1 memory cgroup directory of this process ("/sys/fs/cgroup/memory/a/b"), from
 * /proc/self/cgroup; the mount's root when it cannot be found (a namespaced container). */
static void plat_memcg_dir(char *dir, size_t n)
{
    char line[512];
    snprintf(dir, n, "/sys/fs/cgroup/memory");
    FILE *f = fopen("/proc/self/cgroup", "re");
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        char *p = strstr(line, ":memory:");
        if (!p) continue;
        p += 8;
        p[strcspn(p, "\n")] = 0;
        if (strcmp(p, "/")) snprintf(dir, n, "/sys/fs/cgroup/memory%s", p);
        break;
    }
    fclose(f);
}

/* Bytes this process may still use: MemAvailable, lowered by a cgroup (v2 or v1) limit
 * minus that cgroup's current usage. Containers report the host's MemAvailable, so the
 * cgroup figure is the one that decides whether we get killed. v1: the limit is the
 * hierarchical one (a parent's limit binds too), and inactive file pages count as free
 * (the kernel reclaims them before it kills). */
static int64_t plat_mem_available(void)
{
    char dir[400], path[512];
    int64_t avail = plat_read_number("/proc/meminfo", "MemAvailable");
    avail = avail < 0 ? -1 : avail * 1024;
    int64_t limit = plat_read_number("/sys/fs/cgroup/memory.max", NULL);
    int64_t used = plat_read_number("/sys/fs/cgroup/memory.current", NULL);
    if (limit < 0) {
        plat_memcg_dir(dir, sizeof dir);
        snprintf(path, sizeof path, "%s/memory.stat", dir);
        limit = plat_read_number(path, "hierarchical_memory_limit");
        int64_t inactive = plat_read_number(path, "total_inactive_file");
        snprintf(path, sizeof path, "%s/memory.usage_in_bytes", dir);
        used = plat_read_number(path, NULL);
        if (used > 0 && inactive > 0) used = used > inactive ? used - inactive : 0;
    }
    if (limit > 0 && limit < ((int64_t)1 << 60) && used >= 0) {
        int64_t room = limit > used ? limit - used : 0;
        if (avail < 0 || room < avail) avail = room;
    }
    return avail;
}

static int64_t plat_mem_total(void)
{
    int64_t total = plat_read_number("/proc/meminfo", "MemTotal");
    return total < 0 ? -1 : total * 1024;
}

struct plat_cpu {
    int avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512vnni, avx512vbmi, avx512bitalg;
    int avxvnni; /* VEX-encoded VPDPBUSD on ymm: Intel client cores from Alder Lake on, AMD Zen 5 */
    char name[64];
};
static struct plat_cpu plat_cpu;

static void plat_cpuid(unsigned leaf, unsigned sub, unsigned r[4])
{
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

/* Fills plat_cpu. A feature counts only when the OS also saves its registers (XGETBV):
 * a hypervisor may expose AVX-512 in CPUID while not enabling the zmm state. */
static void plat_cpu_detect(void)
{
    unsigned r[4], max_leaf;
    memset(&plat_cpu, 0, sizeof plat_cpu);
    plat_cpuid(0, 0, r);
    max_leaf = r[0];
    plat_cpuid(1, 0, r);
    int osxsave = (r[2] >> 27) & 1, avx = (r[2] >> 28) & 1;
    unsigned long long xcr0 = 0;
    if (osxsave) {
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        xcr0 = ((unsigned long long)hi << 32) | lo;
    }
    int ymm_ok = avx && (xcr0 & 6) == 6, zmm_ok = ymm_ok && (xcr0 & 0xe0) == 0xe0;
    plat_cpu.fma = ymm_ok && ((r[2] >> 12) & 1);
    plat_cpu.f16c = ymm_ok && ((r[2] >> 29) & 1);
    if (max_leaf >= 7) {
        plat_cpuid(7, 0, r);
        plat_cpu.avx2 = ymm_ok && ((r[1] >> 5) & 1);
        plat_cpu.avx512f = zmm_ok && ((r[1] >> 16) & 1);
        plat_cpu.avx512bw = zmm_ok && ((r[1] >> 30) & 1);
        plat_cpu.avx512vl = zmm_ok && ((r[1] >> 31) & 1);
        plat_cpu.avx512vnni = zmm_ok && ((r[2] >> 11) & 1);
        plat_cpu.avx512vbmi = zmm_ok && ((r[2] >> 1) & 1);
        plat_cpu.avx512bitalg = zmm_ok && ((r[2] >> 12) & 1);
        if (r[0] >= 1) {
            plat_cpuid(7, 1, r);
            plat_cpu.avxvnni = plat_cpu.avx2 && ((r[0] >> 4) & 1);
        }
    }
    plat_cpuid(0x80000000u, 0, r);
    if (r[0] >= 0x80000004u) {
        for (unsigned i = 0; i < 3; i++) plat_cpuid(0x80000002u + i, 0, (unsigned *)(plat_cpu.name + 16 * i));
        plat_cpu.name[48] = 0;
        char *s = plat_cpu.name;
        while (*s == ' ') s++;
        memmove(plat_cpu.name, s, strlen(s) + 1);
    } else {
        strcpy(plat_cpu.name, "unknown x86-64");
    }
}

/* Debian's libgomp.a is built against glibc and needs two symbols musl lacks. They are
 * defined here, outside the static-everything rule because the linker must see them.
 * Binding threads is not supported through this path (libgomp ignores ENOSYS). */
#ifndef __GLIBC__
long __sysconf(int name);
long __sysconf(int name) { return sysconf(name); }
int pthread_attr_setaffinity_np(pthread_attr_t *attr, size_t size, const void *set);
int pthread_attr_setaffinity_np(pthread_attr_t *attr, size_t size, const void *set)
{
    (void)attr; (void)size; (void)set;
    return ENOSYS;
}
#endif

/* musl gives new threads 128 KiB of stack; OpenMP workers get 8 MiB unless the user chose.
 * Priority 101 runs this before libgomp's own constructor reads OMP_STACKSIZE. */
__attribute__((constructor(101))) static void plat_default_thread_stack(void)
{
    setenv("OMP_STACKSIZE", "8M", 0);
}

static int plat_threads(void) { return omp_get_max_threads(); }

/* SHA-256 (FIPS 180-4) of DATA[0..n): what names a chat template (§9). */
static void plat_sha256(const void *data, size_t n, uint8_t out[32])
{
    static const uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
    uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    const uint8_t *p = data;
    size_t blocks = (n + 9 + 63) / 64; /* the message, a 0x80 byte and the 64-bit length, padded */
    for (size_t b = 0; b < blocks; b++) {
        uint8_t block[64];
        for (size_t i = 0; i < 64; i++) {
            size_t at = b * 64 + i;
            block[i] = at < n ? p[at] : at == n ? 0x80 : 0;
        }
        if (b == blocks - 1)
            for (int i = 0; i < 8; i++) block[63 - i] = (uint8_t)(((uint64_t)n * 8) >> (8 * i));
        uint32_t w[64], v[8];
        for (int i = 0; i < 16; i++)
            w[i] = (uint32_t)block[4 * i] << 24 | (uint32_t)block[4 * i + 1] << 16 | (uint32_t)block[4 * i + 2] << 8 | block[4 * i + 3];
#define PLAT_ROTR(x, r) ((x) >> (r) | (x) << (32 - (r)))
        for (int i = 16; i < 64; i++) {
            uint32_t s0 = PLAT_ROTR(w[i - 15], 7) ^ PLAT_ROTR(w[i - 15], 18) ^ (w[i - 15] >> 3);
            uint32_t s1 = PLAT_ROTR(w[i - 2], 17) ^ PLAT_ROTR(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        memcpy(v, h, sizeof v);
        for (int i = 0; i < 64; i++) {
            uint32_t t1 = v[7] + (PLAT_ROTR(v[4], 6) ^ PLAT_ROTR(v[4], 11) ^ PLAT_ROTR(v[4], 25)) + ((v[4] & v[5]) ^ (~v[4] & v[6])) + k[i] + w[i];
            uint32_t t2 = (PLAT_ROTR(v[0], 2) ^ PLAT_ROTR(v[0], 13) ^ PLAT_ROTR(v[0], 22)) + ((v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]));
            memmove(v + 1, v, 7 * sizeof *v);
            v[4] += t1;
            v[0] = t1 + t2;
        }
#undef PLAT_ROTR
        for (int i = 0; i < 8; i++) h[i] += v[i];
    }
    for (int i = 0; i < 32; i++) out[i] = (uint8_t)(h[i / 4] >> (24 - 8 * (i % 4)));
}

/* ==== §2 gguf ==== */
/* Owns: reading GGUF v2/v3 files (and split sets NAME-0000k-of-0000N.gguf): the header, every
 *   metadata value, the tensor infos, the memory mapping of tensor data.
 * Promises: gguf_open() validates everything before anything is used: counts, string and
 *   array lengths, tensor rank and dimensions (products overflow-checked), type ids, block
 *   divisibility, alignment, that each tensor lies inside its file, no overlaps, no duplicate
 *   names. A bad file dies with `coli: FILE: what is wrong (where)`. Tensor shapes are
 *   converted once, here, from GGUF's innermost-first order to outermost-first `shape[]`.
 * May call: §1.
 * Workload: start-up; lookups by name are a binary search over the sorted tensor list. */

enum gguf_type {
    GGUF_TYPE_F32 = 0, GGUF_TYPE_F16 = 1, GGUF_TYPE_Q4_0 = 2, GGUF_TYPE_Q4_1 = 3,
    GGUF_TYPE_Q5_0 = 6, GGUF_TYPE_Q5_1 = 7, GGUF_TYPE_Q8_0 = 8, GGUF_TYPE_Q8_1 = 9,
    GGUF_TYPE_Q2_K = 10, GGUF_TYPE_Q3_K = 11, GGUF_TYPE_Q4_K = 12, GGUF_TYPE_Q5_K = 13,
    GGUF_TYPE_Q6_K = 14, GGUF_TYPE_Q8_K = 15, GGUF_TYPE_IQ2_XXS = 16, GGUF_TYPE_IQ2_XS = 17,
    GGUF_TYPE_IQ3_XXS = 18, GGUF_TYPE_IQ1_S = 19, GGUF_TYPE_IQ4_NL = 20, GGUF_TYPE_IQ3_S = 21,
    GGUF_TYPE_IQ2_S = 22, GGUF_TYPE_IQ4_XS = 23, GGUF_TYPE_I8 = 24, GGUF_TYPE_I16 = 25,
    GGUF_TYPE_I32 = 26, GGUF_TYPE_I64 = 27, GGUF_TYPE_F64 = 28, GGUF_TYPE_IQ1_M = 29,
    GGUF_TYPE_BF16 = 30, GGUF_TYPE_TQ1_0 = 34, GGUF_TYPE_TQ2_0 = 35, GGUF_TYPE_MXFP4 = 39,
    GGUF_TYPE_COUNT = 40
};

enum gguf_value_type {
    GGUF_VALUE_UINT8 = 0, GGUF_VALUE_INT8 = 1, GGUF_VALUE_UINT16 = 2, GGUF_VALUE_INT16 = 3,
    GGUF_VALUE_UINT32 = 4, GGUF_VALUE_INT32 = 5, GGUF_VALUE_FLOAT32 = 6, GGUF_VALUE_BOOL = 7,
    GGUF_VALUE_STRING = 8, GGUF_VALUE_ARRAY = 9, GGUF_VALUE_UINT64 = 10, GGUF_VALUE_INT64 = 11,
    GGUF_VALUE_FLOAT64 = 12, GGUF_VALUE_COUNT = 13
};

struct gguf_type_info {
    const char *name;
    int block_elems; /* elements per block */
    int block_bytes; /* bytes per block */
    int computes;    /* coli has kernels for it (§3); the others are only described */
};

/* Every block layout of the GGUF spec, so that any file's tensors can be placed and described;
 * ids that are not in the spec (4, 5, 31-33, 36-38: formats removed from it) are refused. */
static const struct gguf_type_info gguf_types[GGUF_TYPE_COUNT] = {
    [GGUF_TYPE_F32] = {"F32", 1, 4, 1},          [GGUF_TYPE_F16] = {"F16", 1, 2, 1},
    [GGUF_TYPE_BF16] = {"BF16", 1, 2, 1},        [GGUF_TYPE_Q8_0] = {"Q8_0", 32, 34, 1},
    [GGUF_TYPE_Q4_0] = {"Q4_0", 32, 18, 1},      [GGUF_TYPE_Q4_1] = {"Q4_1", 32, 20, 1},
    [GGUF_TYPE_Q5_0] = {"Q5_0", 32, 22, 1},      [GGUF_TYPE_Q5_1] = {"Q5_1", 32, 24, 1},
    [GGUF_TYPE_Q2_K] = {"Q2_K", 256, 84, 1},     [GGUF_TYPE_Q3_K] = {"Q3_K", 256, 110, 1},
    [GGUF_TYPE_Q4_K] = {"Q4_K", 256, 144, 1},    [GGUF_TYPE_Q5_K] = {"Q5_K", 256, 176, 1},
    [GGUF_TYPE_Q6_K] = {"Q6_K", 256, 210, 1},    [GGUF_TYPE_IQ4_NL] = {"IQ4_NL", 32, 18, 1},
    [GGUF_TYPE_IQ4_XS] = {"IQ4_XS", 256, 136, 1}, [GGUF_TYPE_IQ3_XXS] = {"IQ3_XXS", 256, 98, 1},
    [GGUF_TYPE_IQ3_S] = {"IQ3_S", 256, 110, 1},  [GGUF_TYPE_MXFP4] = {"MXFP4", 32, 17, 1},
    [GGUF_TYPE_Q8_1] = {"Q8_1", 32, 36, 0},      [GGUF_TYPE_Q8_K] = {"Q8_K", 256, 292, 0},
    [GGUF_TYPE_IQ2_XXS] = {"IQ2_XXS", 256, 66, 0}, [GGUF_TYPE_IQ2_XS] = {"IQ2_XS", 256, 74, 0},
    [GGUF_TYPE_IQ2_S] = {"IQ2_S", 256, 82, 0},   [GGUF_TYPE_IQ1_S] = {"IQ1_S", 256, 50, 0},
    [GGUF_TYPE_IQ1_M] = {"IQ1_M", 256, 56, 0},   [GGUF_TYPE_TQ1_0] = {"TQ1_0", 256, 54, 0},
    [GGUF_TYPE_TQ2_0] = {"TQ2_0", 256, 66, 0},   [GGUF_TYPE_I8] = {"I8", 1, 1, 0},
    [GGUF_TYPE_I16] = {"I16", 1, 2, 0},          [GGUF_TYPE_I32] = {"I32", 1, 4, 0},
    [GGUF_TYPE_I64] = {"I64", 1, 8, 0},          [GGUF_TYPE_F64] = {"F64", 1, 8, 0},
};

/* NULL for a type id that is not in the GGUF spec. */
static const struct gguf_type_info *gguf_type_get(int type)
{
    if (type < 0 || type >= GGUF_TYPE_COUNT || !gguf_types[type].name) return NULL;
    return &gguf_types[type];
}

/* Bytes of a row of N elements of TYPE; the caller has checked N % block_elems == 0. */
static size_t gguf_row_bytes(int type, int64_t n)
{
    const struct gguf_type_info *ti = gguf_type_get(type);
    return (size_t)(n / ti->block_elems) * (size_t)ti->block_bytes;
}

struct gguf_kv {
    const char *key; /* points into the mapping; not NUL-terminated */
    size_t key_len;
    uint32_t type;      /* enum gguf_value_type */
    uint32_t elem_type; /* for arrays */
    uint64_t count;     /* array length; 1 for scalars */
    const uint8_t *data;      /* the value (for arrays: the first element) */
    const uint64_t *str_offs; /* string arrays: offset of element i from data (validated) */
    int part;
};

struct gguf_tensor {
    char *name;
    int type;
    int n_dims;
    int64_t shape[4]; /* outermost first: a matrix is [rows][cols], experts [n][rows][cols] */
    int64_t n_elems;
    uint64_t offset; /* from the start of its part's data section */
    uint64_t bytes;
    const uint8_t *data;
    int part;
};

#define GGUF_MAX_PARTS 64

struct gguf_file {
    char *path;
    int n_parts;
    struct plat_map parts[GGUF_MAX_PARTS];
    uint32_t version;
    size_t alignment;
    struct gguf_kv *kvs;
    int64_t n_kvs;
    struct gguf_tensor *tensors; /* sorted by name */
    int64_t n_tensors;
    uint64_t tensor_bytes;
    int n_parts_expected; /* split.count of the first part */
};

/* A bounds-checked cursor over one part's bytes. */
struct gguf_reader {
    const char *path;
    const uint8_t *base;
    size_t size, pos;
};

static void gguf_fail(const struct gguf_reader *r, const char *what, const char *where)
    __attribute__((noreturn));
static void gguf_fail(const struct gguf_reader *r, const char *what, const char *where)
{
    die("%s: %s (%s, at byte %zu)", r->path, what, where, r->pos);
}

static const uint8_t *gguf_take(struct gguf_reader *r, uint64_t n, const char *where)
{
    if (n > r->size - r->pos) gguf_fail(r, "file is truncated", where);
    const uint8_t *p = r->base + r->pos;
    r->pos += (size_t)n;
    return p;
}

static uint32_t gguf_u32(struct gguf_reader *r, const char *where)
{
    uint32_t v;
    memcpy(&v, gguf_take(r, 4, where), 4);
    return v;
}

static uint64_t gguf_u64(struct gguf_reader *r, const char *where)
{
    uint64_t v;
    memcpy(&v, gguf_take(r, 8, where), 8);
    return v;
}

/* A string: u64 length then bytes. The length is checked against the bytes left. */
static const char *gguf_string(struct gguf_reader *r, size_t *len, const char *where)
{
    uint64_t n = gguf_u64(r, where);
    if (n > r->size - r->pos) gguf_fail(r, "string length runs past the end of the file", where);
    *len = (size_t)n;
    return (const char *)gguf_take(r, n, where);
}

static const uint8_t gguf_value_sizes[GGUF_VALUE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

/* Reads the value of KV (its type already set) and validates its extent. */
static void gguf_read_value(struct gguf_reader *r, struct gguf_kv *kv)
{
    kv->count = 1;
    if (kv->type >= GGUF_VALUE_COUNT) gguf_fail(r, "unknown metadata value type", "metadata value");
    if (kv->type == GGUF_VALUE_STRING) {
        size_t len;
        kv->data = (const uint8_t *)gguf_string(r, &len, "metadata string") - 8;
        return;
    }
    if (kv->type != GGUF_VALUE_ARRAY) {
        kv->data = gguf_take(r, gguf_value_sizes[kv->type], "metadata value");
        return;
    }
    kv->elem_type = gguf_u32(r, "array element type");
    if (kv->elem_type >= GGUF_VALUE_COUNT || kv->elem_type == GGUF_VALUE_ARRAY)
        gguf_fail(r, "unsupported array element type", "array element type");
    kv->count = gguf_u64(r, "array length");
    kv->data = r->base + r->pos;
    if (kv->elem_type != GGUF_VALUE_STRING) {
        uint64_t es = gguf_value_sizes[kv->elem_type];
        if (kv->count > (r->size - r->pos) / es) gguf_fail(r, "array length runs past the end of the file", "array");
        r->pos += (size_t)(kv->count * es);
        return;
    }
    /* Each string takes at least its 8-byte length: bounds the count before allocating. */
    if (kv->count > (r->size - r->pos) / 8) gguf_fail(r, "array length runs past the end of the file", "string array");
    uint64_t *offs = plat_alloc(plat_mul_size((size_t)kv->count, sizeof *offs, r->path));
    for (uint64_t i = 0; i < kv->count; i++) {
        size_t len;
        offs[i] = (uint64_t)(r->pos - (size_t)(kv->data - r->base));
        gguf_string(r, &len, "string array element");
    }
    kv->str_offs = offs;
}

static int gguf_kv_compare(const void *a, const void *b)
{
    const struct gguf_kv *x = a, *y = b;
    size_t n = x->key_len < y->key_len ? x->key_len : y->key_len;
    int c = memcmp(x->key, y->key, n);
    return c ? c : (x->key_len > y->key_len) - (x->key_len < y->key_len);
}

static int64_t gguf_scalar_int(const struct gguf_file *g, const char *key, uint32_t type, const uint8_t *p);

/* Part PART of a split set must say so: split.no = PART and split.count as the first part. */
static void gguf_check_split_part(struct gguf_file *g, struct gguf_reader *r, const struct gguf_kv *kvs, uint64_t n, int part)
{
    int64_t no = -1, count = -1;
    for (uint64_t i = 0; i < n; i++) {
        if (kvs[i].key_len == 8 && !memcmp(kvs[i].key, "split.no", 8)) no = gguf_scalar_int(g, "split.no", kvs[i].type, kvs[i].data);
        if (kvs[i].key_len == 11 && !memcmp(kvs[i].key, "split.count", 11)) count = gguf_scalar_int(g, "split.count", kvs[i].type, kvs[i].data);
    }
    if (no != part || count != g->n_parts_expected)
        die("%s: not part %d of the %d-part set (split.no %lld, split.count %lld)", r->path, part + 1, g->n_parts_expected,
            (long long)no, (long long)count);
}

/* Reads N key-value pairs. Only the first part's metadata describes the model; the other
 * parts' pairs are validated, checked to belong to the set, and dropped. Keys are sorted for
 * lookup. */
static void gguf_read_kvs(struct gguf_file *g, struct gguf_reader *r, uint64_t n, int part)
{
    /* a key-value pair takes at least 8 (key length) + 4 (type) + 1 bytes */
    if (n > (r->size - r->pos) / 13) gguf_fail(r, "metadata count is larger than the file allows", "header");
    struct gguf_kv *kvs = plat_zalloc((size_t)n, sizeof *kvs);
    for (uint64_t i = 0; i < n; i++) {
        kvs[i].key = gguf_string(r, &kvs[i].key_len, "metadata key");
        if (kvs[i].key_len == 0) gguf_fail(r, "empty metadata key", "metadata key");
        kvs[i].type = gguf_u32(r, "metadata value type");
        gguf_read_value(r, &kvs[i]);
    }
    qsort(kvs, (size_t)n, sizeof *kvs, gguf_kv_compare);
    for (uint64_t i = 1; i < n; i++)
        if (gguf_kv_compare(&kvs[i - 1], &kvs[i]) == 0)
            die("%s: duplicate metadata key '%.*s'", r->path, (int)kvs[i].key_len, kvs[i].key);
    if (part > 0) {
        gguf_check_split_part(g, r, kvs, n, part);
        for (uint64_t i = 0; i < n; i++) free((void *)kvs[i].str_offs);
        free(kvs);
        return;
    }
    g->kvs = kvs;
    g->n_kvs = (int64_t)n;
}

/* Reads one tensor info and checks what can be checked before the data section is known. */
static void gguf_read_tensor_info(struct gguf_reader *r, struct gguf_tensor *t, int part)
{
    size_t len;
    const char *name = gguf_string(r, &len, "tensor name");
    if (len == 0 || len > 256 || memchr(name, 0, len)) gguf_fail(r, "bad tensor name", "tensor name");
    t->name = plat_alloc(len + 1);
    memcpy(t->name, name, len);
    t->name[len] = 0;
    t->part = part;
    uint32_t n_dims = gguf_u32(r, "tensor rank");
    if (n_dims < 1 || n_dims > 4) die("%s: tensor '%s' has rank %u (1 to 4 allowed)", r->path, t->name, n_dims);
    t->n_dims = (int)n_dims;
    t->n_elems = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        uint64_t ne = gguf_u64(r, "tensor dimension");
        if (ne == 0 || ne > (uint64_t)INT64_MAX / (uint64_t)t->n_elems)
            die("%s: tensor '%s' has a bad dimension %llu", r->path, t->name, (unsigned long long)ne);
        t->shape[n_dims - 1 - d] = (int64_t)ne; /* GGUF lists the innermost dimension first */
        t->n_elems *= (int64_t)ne;
    }
    t->type = (int)gguf_u32(r, "tensor type");
    const struct gguf_type_info *ti = gguf_type_get(t->type);
    if (!ti) die("%s: tensor '%s' has type id %d, which is not in the GGUF spec", r->path, t->name, t->type);
    int64_t cols = t->shape[n_dims - 1];
    if (cols % ti->block_elems)
        die("%s: tensor '%s' has rows of %lld, not a multiple of the %s block (%d)", r->path, t->name,
            (long long)cols, ti->name, ti->block_elems);
    uint64_t blocks = (uint64_t)(t->n_elems / ti->block_elems);
    if (blocks > UINT64_MAX / (uint64_t)ti->block_bytes) die("%s: tensor '%s' is too large", r->path, t->name);
    t->bytes = blocks * (uint64_t)ti->block_bytes;
    t->offset = gguf_u64(r, "tensor offset");
}

/* Places the tensors of one part inside its data section: aligned, inside the file. */
static void gguf_place_tensors(struct gguf_file *g, struct gguf_reader *r, int64_t first, int64_t count)
{
    size_t data_start = (r->pos + g->alignment - 1) / g->alignment * g->alignment;
    if (count == 0) return; /* a vocabulary-only file may end without padding */
    if (data_start > r->size) gguf_fail(r, "file ends before its data section", "data section");
    size_t data_size = r->size - data_start;
    for (int64_t i = first; i < first + count; i++) {
        struct gguf_tensor *t = &g->tensors[i];
        if (t->offset % g->alignment)
            die("%s: tensor '%s' offset %llu is not aligned to %zu", r->path, t->name,
                (unsigned long long)t->offset, g->alignment);
        if (t->offset > data_size || t->bytes > data_size - t->offset)
            die("%s: tensor '%s' lies past the end of the file (offset %llu, %llu bytes, data section %zu bytes)",
                r->path, t->name, (unsigned long long)t->offset, (unsigned long long)t->bytes, data_size);
        t->data = r->base + data_start + t->offset;
        g->tensor_bytes += t->bytes;
    }
}

static int gguf_tensor_by_name(const void *a, const void *b)
{
    return strcmp(((const struct gguf_tensor *)a)->name, ((const struct gguf_tensor *)b)->name);
}

static int gguf_tensor_by_place(const void *a, const void *b)
{
    const struct gguf_tensor *x = a, *y = b;
    if (x->part != y->part) return x->part - y->part;
    return (x->offset > y->offset) - (x->offset < y->offset);
}

/* No two tensors may share bytes, and no name may appear twice. */
static void gguf_check_tensor_set(struct gguf_file *g)
{
    struct gguf_tensor *t = g->tensors;
    int64_t n = g->n_tensors;
    qsort(t, (size_t)n, sizeof *t, gguf_tensor_by_place);
    for (int64_t i = 1; i < n; i++)
        if (t[i].part == t[i - 1].part && t[i - 1].offset + t[i - 1].bytes > t[i].offset)
            die("%s: tensors '%s' and '%s' overlap", g->path, t[i - 1].name, t[i].name);
    qsort(t, (size_t)n, sizeof *t, gguf_tensor_by_name);
    for (int64_t i = 1; i < n; i++)
        if (strcmp(t[i - 1].name, t[i].name) == 0) die("%s: duplicate tensor name '%s'", g->path, t[i].name);
}

/* NULL when KEY is absent. */
static const struct gguf_kv *gguf_kv_find(const struct gguf_file *g, const char *key)
{
    struct gguf_kv probe = {.key = key, .key_len = strlen(key)};
    return bsearch(&probe, g->kvs, (size_t)g->n_kvs, sizeof *g->kvs, gguf_kv_compare);
}

static int gguf_find_key(const struct gguf_file *g, const char *key)
{
    const struct gguf_kv *kv = gguf_kv_find(g, key);
    return kv ? (int)(kv - g->kvs) : -1;
}

static void gguf_wrong_type(const struct gguf_file *g, const char *key, const char *want) __attribute__((noreturn));
static void gguf_wrong_type(const struct gguf_file *g, const char *key, const char *want)
{
    die("%s: metadata '%s' is not %s", g->path, key, want);
}

/* A string value (not NUL-terminated; *len bytes), or NULL when absent. */
static const char *gguf_get_string(const struct gguf_file *g, const char *key, size_t *len)
{
    const struct gguf_kv *kv = gguf_kv_find(g, key);
    if (!kv) return NULL;
    if (kv->type != GGUF_VALUE_STRING) gguf_wrong_type(g, key, "a string");
    uint64_t n;
    memcpy(&n, kv->data, 8);
    *len = (size_t)n;
    return (const char *)kv->data + 8;
}

/* A scalar read as int64 from any integer or bool type; values past int64 are refused. */
static int64_t gguf_scalar_int(const struct gguf_file *g, const char *key, uint32_t type, const uint8_t *p)
{
    switch (type) {
    case GGUF_VALUE_UINT8: case GGUF_VALUE_BOOL: return *p;
    case GGUF_VALUE_INT8: return (int8_t)*p;
    case GGUF_VALUE_UINT16: { uint16_t v; memcpy(&v, p, 2); return v; }
    case GGUF_VALUE_INT16: { int16_t v; memcpy(&v, p, 2); return v; }
    case GGUF_VALUE_UINT32: { uint32_t v; memcpy(&v, p, 4); return v; }
    case GGUF_VALUE_INT32: { int32_t v; memcpy(&v, p, 4); return v; }
    case GGUF_VALUE_INT64: { int64_t v; memcpy(&v, p, 8); return v; }
    case GGUF_VALUE_UINT64: {
        uint64_t v;
        memcpy(&v, p, 8);
        if (v > (uint64_t)INT64_MAX) die("%s: metadata '%s' is out of range", g->path, key);
        return (int64_t)v;
    }
    default: gguf_wrong_type(g, key, "an integer");
    }
}

static int64_t gguf_get_int(const struct gguf_file *g, const char *key, int64_t dflt)
{
    const struct gguf_kv *kv = gguf_kv_find(g, key);
    return kv ? gguf_scalar_int(g, key, kv->type, kv->data) : dflt;
}

static double gguf_get_float(const struct gguf_file *g, const char *key, double dflt)
{
    const struct gguf_kv *kv = gguf_kv_find(g, key);
    if (!kv) return dflt;
    if (kv->type == GGUF_VALUE_FLOAT32) { float v; memcpy(&v, kv->data, 4); return v; }
    if (kv->type == GGUF_VALUE_FLOAT64) { double v; memcpy(&v, kv->data, 8); return v; }
    return (double)gguf_scalar_int(g, key, kv->type, kv->data);
}

/* Element count of an array of ELEM_TYPE (0 when absent); *data points at its payload. */
static size_t gguf_get_array(const struct gguf_file *g, const char *key, int elem_type, const void **data)
{
    const struct gguf_kv *kv = gguf_kv_find(g, key);
    *data = NULL;
    if (!kv) return 0;
    if (kv->type != GGUF_VALUE_ARRAY || (int)kv->elem_type != elem_type) gguf_wrong_type(g, key, "an array of the expected type");
    *data = kv->data;
    return (size_t)kv->count;
}

/* Element I of a string array (the caller checked I against gguf_get_array's count). */
static const char *gguf_array_string(const struct gguf_file *g, const char *key, size_t i, size_t *len)
{
    const struct gguf_kv *kv = gguf_kv_find(g, key);
    if (!kv || kv->type != GGUF_VALUE_ARRAY || kv->elem_type != GGUF_VALUE_STRING) gguf_wrong_type(g, key, "a string array");
    if (i >= kv->count) die("%s: metadata '%s' has no element %zu", g->path, key, i);
    const uint8_t *p = kv->data + kv->str_offs[i];
    uint64_t n;
    memcpy(&n, p, 8);
    *len = (size_t)n;
    return (const char *)p + 8;
}

/* Reads the header, metadata and tensor infos of one part (already mapped into parts[part]). */
static void gguf_read_part(struct gguf_file *g, int part, const char *path)
{
    struct gguf_reader r = {path, g->parts[part].data, g->parts[part].size, 0};
    const uint8_t *magic = gguf_take(&r, 4, "magic");
    if (memcmp(magic, "GGUF", 4) != 0) die("%s: not a GGUF file (bad magic)", path);
    uint32_t version = gguf_u32(&r, "version");
    if (version != 2 && version != 3) die("%s: unsupported GGUF version %u (2 and 3 are read)", path, version);
    if (part == 0) g->version = version;
    uint64_t n_tensors = gguf_u64(&r, "tensor count");
    uint64_t n_kvs = gguf_u64(&r, "metadata count");
    /* a tensor info takes at least 8 + 1 (name) + 4 + 8 + 4 + 8 bytes */
    if (n_tensors > (r.size - r.pos) / 33) gguf_fail(&r, "tensor count is larger than the file allows", "header");
    gguf_read_kvs(g, &r, n_kvs, part);
    if (part == 0) {
        int64_t a = gguf_get_int(g, "general.alignment", 32);
        if (a < 1 || a > 65536 || (a & (a - 1))) die("%s: general.alignment %lld is not a power of two up to 65536", path, (long long)a);
        g->alignment = (size_t)a;
    }
    int64_t first = g->n_tensors;
    g->tensors = plat_realloc(g->tensors, plat_mul_size((size_t)(first + (int64_t)n_tensors), sizeof *g->tensors, path));
    memset(g->tensors + first, 0, (size_t)n_tensors * sizeof *g->tensors);
    for (uint64_t i = 0; i < n_tensors; i++) {
        gguf_read_tensor_info(&r, &g->tensors[first + (int64_t)i], part);
        g->n_tensors++;
    }
    gguf_place_tensors(g, &r, first, (int64_t)n_tensors);
}

static void gguf_map_part(struct gguf_file *g, int part, const char *path)
{
    if (plat_map_file(path, &g->parts[part]) != 0)
        die("%s: cannot open: %s", path, errno == EINVAL ? "not a regular file" : strerror(errno));
    g->n_parts = part + 1;
}

/* Opens PATH; for a split set, PATH is the first part and the others are found beside it. */
static void gguf_open(struct gguf_file *g, const char *path)
{
    memset(g, 0, sizeof *g);
    g->path = plat_strdup(path);
    gguf_map_part(g, 0, path);
    gguf_read_part(g, 0, path);
    int64_t n_split = gguf_get_int(g, "split.count", 1);
    if (n_split > 1) {
        size_t len = strlen(path);
        const char *tail = len >= 20 ? path + len - 20 : NULL; /* "-00001-of-0000N.gguf" */
        if (n_split > GGUF_MAX_PARTS || !tail || strncmp(tail, "-00001-of-", 10) != 0)
            die("%s: split model of %lld parts must be opened from its part NAME-00001-of-%05lld.gguf",
                path, (long long)n_split, (long long)n_split);
        g->n_parts_expected = (int)n_split;
        for (int p = 1; p < n_split; p++) {
            char *name = plat_alloc(len + 1);
            snprintf(name, len + 1, "%.*s-%05d-of-%05lld.gguf", (int)(len - 20), path, p + 1, (long long)n_split);
            gguf_map_part(g, p, name);
            gguf_read_part(g, p, name);
            free(name);
        }
    }
    gguf_check_tensor_set(g);
}

static void gguf_close(struct gguf_file *g)
{
    for (int64_t i = 0; i < g->n_kvs; i++) free((void *)g->kvs[i].str_offs);
    for (int64_t i = 0; i < g->n_tensors; i++) free(g->tensors[i].name);
    for (int p = 0; p < g->n_parts; p++) plat_unmap_file(&g->parts[p]);
    free(g->kvs);
    free(g->tensors);
    free(g->path);
    memset(g, 0, sizeof *g);
}

/* NULL when absent. */
static const struct gguf_tensor *gguf_tensor_find(const struct gguf_file *g, const char *name)
{
    struct gguf_tensor probe = {.name = (char *)name};
    return bsearch(&probe, g->tensors, (size_t)g->n_tensors, sizeof *g->tensors, gguf_tensor_by_name);
}

/* ---- writing: the head of a GGUF v3 file (header, metadata, tensor infos) built in memory ----
 * Keys first, then tensors, then gguf_image_end; the data section that follows is the caller's:
 * tensor i's bytes go at data_offset + its offset. The default alignment (32) is used. */
struct gguf_image {
    uint8_t *p;
    size_t n, cap;
    uint64_t n_kvs, n_tensors, data_bytes; /* data_bytes: the data section so far */
};

static void gguf_image_put(struct gguf_image *im, const void *v, size_t n)
{
    if (im->n + n > im->cap) im->p = plat_realloc(im->p, im->cap = 2 * (im->n + n));
    memcpy(im->p + im->n, v, n);
    im->n += n;
}

static void gguf_image_u32(struct gguf_image *im, uint32_t v) { gguf_image_put(im, &v, 4); }
static void gguf_image_u64(struct gguf_image *im, uint64_t v) { gguf_image_put(im, &v, 8); }

static void gguf_image_string(struct gguf_image *im, const char *s)
{
    gguf_image_u64(im, strlen(s));
    gguf_image_put(im, s, strlen(s));
}

/* The magic, version 3, and room for the two counts gguf_image_end writes. */
static void gguf_image_begin(struct gguf_image *im)
{
    memset(im, 0, sizeof *im);
    gguf_image_put(im, "GGUF", 4);
    gguf_image_u32(im, 3);
    gguf_image_u64(im, 0);
    gguf_image_u64(im, 0);
}

/* A key of TYPE; the caller puts its value (an array's: elem type, count, elements) next. */
static void gguf_image_key(struct gguf_image *im, const char *key, uint32_t type)
{
    gguf_image_string(im, key);
    gguf_image_u32(im, type);
    im->n_kvs++;
}

static void gguf_image_key_u32(struct gguf_image *im, const char *key, uint32_t v)
{
    gguf_image_key(im, key, GGUF_VALUE_UINT32);
    gguf_image_u32(im, v);
}

static void gguf_image_key_f32(struct gguf_image *im, const char *key, float v)
{
    gguf_image_key(im, key, GGUF_VALUE_FLOAT32);
    gguf_image_put(im, &v, 4);
}

static void gguf_image_key_string(struct gguf_image *im, const char *key, const char *v)
{
    gguf_image_key(im, key, GGUF_VALUE_STRING);
    gguf_image_string(im, v);
}

/* An array key of COUNT elements of ELEM_TYPE, which the caller puts next. */
static void gguf_image_key_array(struct gguf_image *im, const char *key, uint32_t elem_type, uint64_t count)
{
    gguf_image_key(im, key, GGUF_VALUE_ARRAY);
    gguf_image_u32(im, elem_type);
    gguf_image_u64(im, count);
}

/* A tensor of TYPE and SHAPE (outermost first, as gguf_tensor.shape); returns its offset in the
 * data section. The caller has checked the rows against TYPE's block. */
static uint64_t gguf_image_tensor(struct gguf_image *im, const char *name, int type, int n_dims, const int64_t *shape)
{
    uint64_t elems = 1, at = im->data_bytes;
    gguf_image_string(im, name);
    gguf_image_u32(im, (uint32_t)n_dims);
    for (int d = n_dims - 1; d >= 0; d--) {
        gguf_image_u64(im, (uint64_t)shape[d]);
        elems *= (uint64_t)shape[d];
    }
    gguf_image_u32(im, (uint32_t)type);
    gguf_image_u64(im, at);
    const struct gguf_type_info *ti = gguf_type_get(type);
    im->data_bytes += (elems / (uint64_t)ti->block_elems * (uint64_t)ti->block_bytes + 31) & ~(uint64_t)31;
    im->n_tensors++;
    return at;
}

/* Writes the counts and pads the head to the alignment; returns where the data section starts. */
static size_t gguf_image_end(struct gguf_image *im)
{
    memcpy(im->p + 8, &im->n_tensors, 8);
    memcpy(im->p + 16, &im->n_kvs, 8);
    static const uint8_t zeros[32];
    gguf_image_put(im, zeros, (32 - im->n % 32) % 32);
    return im->n;
}

/* ==== §3 quant ==== */
/* Owns: the weight block formats (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K,
 *   Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, IQ3_XXS, IQ3_S, MXFP4) and their tables, fp16/bf16 conversion,
 *   activation quantisation and the row·vector dot kernels with their per-CPU dispatch table
 *   (scalar, AVX2, AVX-512 with VNNI, for every format).
 * Promises: quant_dequant_row is bit-exact with ggml's dequantize_row_*. quant_dot follows the
 *   canonical order (unit u -> partial p[u % 32], then butterfly 16,8,4,2,1), so every level
 *   gives the same bits as the scalar reference for the same inputs; integer parts are exact.
 *   quant_dotn (one row, many columns), quant_dotr (many rows, one column), quant_pairs (rows
 *   of 2 K super-blocks, many columns), quant_tile (16 rows, many columns) and
 *   quant_act_prepare give the same bits at every level.
 * May call: die, plat_alloc*, plat_cpu, gguf_type_get, getenv.
 * Workload: decode bound to memory bandwidth; one activation prepare per vector (SIMD, ~1 ns
 *   per element), then one quant_dotn per weight row (quant_dotr per chunk of rows for a single
 *   column), called concurrently from OpenMP threads (the kernels are pure; only
 *   quant_init/quant_set_level write globals, before any parallel region). AVX-512, one core,
 *   4096-column rows in L2: Q4_0 ~10 weight bytes per TSC cycle, Q8_0 ~19, Q4_K ~7.5, Q6_K ~11;
 *   with 64 columns per weight row 1.5-2x that per column. Zen 4 (2.6 GHz TSC), one core, 1 MiB
 *   of such rows: IQ4_NL ~9, MXFP4 ~7.3, IQ4_XS ~6.3, Q2_K ~5.8, Q3_K ~5.5, IQ3_XXS ~2.4 (its
 *   AVX2 kernels 4.4, 4.5, 5.6, 5.1, 4.3, 1.7). AVX2 (AMD EPYC Zen 1, 2.0 GHz TSC), one core,
 *   one column, a 1024x4096 matrix in cache, TSC cycles per 256 weights: Q4_K ~33-36, Q6_K ~42,
 *   Q4_0 ~37, Q8_0 ~48, Q3_K ~42, IQ4_XS ~46, IQ3_XXS ~87-91, IQ3_S ~100, F16 and BF16 ~105
 *   (the legacy, K and IQ formats decode once for up to 4 columns, the float ones for 2:
 *   prompts 15-50% faster; 16 columns of IQ3 2.1-2.3x, of IQ4_XS 1.3x; Q4_K, Q5_K, Q6_K and
 *   Q4_0 through quant_tile at this level too, 1.1-2x by the columns and the rows); 512-column
 *   rows take 116 instructions per super-block through quant_dotr, 154 one by one, against 102
 *   (callgrind). */

/* avx512vbmi: the AVX-512 kernels, with the IQ3 formats' lookups done by VBMI byte permutes
 * (quant_avx512_iq3_vbmi_points) and their signs taken apart by BITALG's bit shuffle; it needs
 * both (every CPU with VBMI but Cannon Lake has BITALG). The same bits, a level of its own so
 * that both are tested. */
enum quant_level { QUANT_LEVEL_SCALAR, QUANT_LEVEL_AVX2, QUANT_LEVEL_AVX512, QUANT_LEVEL_AVX512VBMI, QUANT_LEVEL_COUNT };

#define QUANT_NPART 32   /* partial sums of the canonical order (= a GPU warp) */
#define QUANT_QK 32      /* elements per legacy block */
#define QUANT_QK_K 256   /* elements per K super-block */

typedef float (*quant_dot_fn)(const void *wrow, const void *act, int64_t n);
/* y[c*ys] = dot of wrow with the act at acts + c*stride, for c < nc. */
typedef void (*quant_dotn_fn)(const void *wrow, const uint8_t *acts, size_t stride, int nc,
                              int64_t n, float *y, size_t ys);

/* y[r] = dot of the row at wrows + r*row_bytes with act, for r < nrows. */
typedef void (*quant_dotr_fn)(const uint8_t *wrows, size_t row_bytes, int nrows, const void *act,
                              int64_t n, float *y);

static quant_dot_fn quant_dot_table[GGUF_TYPE_COUNT];
static quant_dotn_fn quant_dotn_table[GGUF_TYPE_COUNT];
static quant_dotr_fn quant_dotr_table[GGUF_TYPE_COUNT];
/* y[c*ys + r] = dot of the row at wrows + r*row_bytes with the act at acts + c*stride, for r <
 * nrows and c < nc: rows of 2 K super-blocks (512 columns) only. */
typedef void (*quant_pairs_fn)(const uint8_t *wrows, size_t row_bytes, int nrows, const uint8_t *acts, size_t stride,
                               int nc, float *y, size_t ys);
static quant_pairs_fn quant_pairs_table[GGUF_TYPE_COUNT];
static int quant_level;

static float quant_bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t quant_f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
/* GGUF is little-endian and so is every target of coli; memcpy keeps unaligned reads legal. */
static uint16_t quant_rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static int32_t quant_rd32(const void *p) { int32_t v; memcpy(&v, p, 4); return v; }

/* Exact: every fp16 value (incl. subnormals, inf, nan) is representable in f32. */
static float quant_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return quant_bits_to_f32(sign | 0x7f800000 | man << 13);
    if (exp == 0) {
        /* subnormal: man * 2^-24 is exact in f32 */
        float v = (float)man * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    return quant_bits_to_f32(sign | (exp + 112) << 23 | man << 13);
}

/* Round-to-nearest-even of the low `shift` bits of v away; shift in 1..31. */
static uint32_t quant_round_shift(uint32_t v, int shift) {
    uint32_t r = v >> shift, rem = v & ((1u << shift) - 1), half = 1u << (shift - 1);
    return r + (rem > half || (rem == half && (r & 1)));
}

/* Nearest-even f32 -> fp16; overflow gives inf, tiny values give (signed) zero or subnormals,
 * NaN stays a quiet NaN. */
static uint16_t quant_f32_to_f16(float f) {
    uint32_t x = quant_f32_to_bits(f), sign = (x >> 16) & 0x8000;
    x &= 0x7fffffff;
    if (x > 0x7f800000) return (uint16_t)(sign | 0x7e00 | ((x >> 13) & 0x3ff));
    if (x >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* >= 65520 rounds to inf */
    if (x < 0x38800000) {                                   /* below 2^-14: subnormal */
        int e = (int)(x >> 23);
        if (e < 102) return (uint16_t)sign;                 /* < 2^-25: rounds to zero */
        return (uint16_t)(sign | quant_round_shift((x & 0x7fffff) | 0x800000, 126 - e));
    }
    /* rebias the exponent (127 -> 15); a carry out of the mantissa bumps the exponent */
    return (uint16_t)(sign | quant_round_shift(x - 0x38000000, 13));
}

static float quant_bf16_to_f32(uint16_t h) { return quant_bits_to_f32((uint32_t)h << 16); }

/* Nearest-even f32 -> bf16; NaN stays a quiet NaN. */
static uint16_t quant_f32_to_bf16(float f) {
    uint32_t x = quant_f32_to_bits(f);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

/* ggml's nearest_int: round half to even for |v| < 2^22, independent of the FPU mode. */
static int quant_nearest_int(float v) {
    float t = v + 12582912.0f;
    return (int)(quant_f32_to_bits(t) & 0x007fffff) - 0x00400000;
}

/* ---- dequantisation (ggml's operation order, kept literally) ---- */

/* Legacy 32-blocks. The int->float conversion then one multiply (and add) matches ggml. */
static void quant_dequant_legacy(enum gguf_type t, const uint8_t *b, float *y) {
    float d = quant_f16_to_f32(quant_rd16(b));
    if (t == GGUF_TYPE_Q8_0) {
        for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
        return;
    }
    int has_min = t == GGUF_TYPE_Q4_1 || t == GGUF_TYPE_Q5_1;
    float m = has_min ? quant_f16_to_f32(quant_rd16(b + 2)) : 0.0f;
    int five = t == GGUF_TYPE_Q5_0 || t == GGUF_TYPE_Q5_1;
    uint32_t qh = 0;
    if (five) memcpy(&qh, b + 2 + 2 * has_min, 4);
    const uint8_t *qs = b + 2 + 2 * has_min + 4 * five;
    int off = has_min ? 0 : (five ? 16 : 8);
    for (int j = 0; j < 16; j++) {
        int x0 = qs[j] & 0x0f, x1 = qs[j] >> 4;
        if (five) {
            x0 |= (int)(((qh >> j) << 4) & 0x10);
            x1 |= (int)((qh >> (j + 12)) & 0x10);
        }
        x0 -= off; x1 -= off;
        if (has_min) { y[j] = (float)x0 * d + m; y[j + 16] = (float)x1 * d + m; }
        else { y[j] = (float)x0 * d; y[j + 16] = (float)x1 * d; }
    }
}

/* 6-bit scale j and min j of a Q4_K/Q5_K super-block (ggml get_scale_min_k4). */
static void quant_k4_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* All 8 scales (byte j of *sc) and mins (byte j of *m) of quant_k4_scale_min at once, with
 * 32-bit word operations. */
static inline void quant_k4_unpack(const uint8_t *q, uint64_t *sc, uint64_t *m) {
    uint32_t u[3];
    memcpy(u, q, 12);
    *sc = (u[0] & 0x3f3f3f3f) | (uint64_t)((u[2] & 0x0f0f0f0f) | ((u[0] >> 6 & 0x03030303) << 4)) << 32;
    *m = (u[1] & 0x3f3f3f3f) | (uint64_t)((u[2] >> 4 & 0x0f0f0f0f) | ((u[1] >> 6 & 0x03030303) << 4)) << 32;
}

/* Q4_K (qh == NULL) and Q5_K super-block: y = d1*q - m1, as ggml. */
static void quant_dequant_q45k(const uint8_t *b, int five, float *y) {
    float d = quant_f16_to_f32(quant_rd16(b)), dmin = quant_f16_to_f32(quant_rd16(b + 2));
    const uint8_t *sc12 = b + 4, *qh = b + 16, *ql = b + 16 + (five ? 32 : 0);
    for (int j = 0; j < 4; j++) {
        int sc, m;
        quant_k4_scale_min(2 * j, sc12, &sc, &m);
        const float d1 = d * (float)sc, m1 = dmin * (float)m;
        quant_k4_scale_min(2 * j + 1, sc12, &sc, &m);
        const float d2 = d * (float)sc, m2 = dmin * (float)m;
        for (int l = 0; l < 32; l++) {
            int q0 = ql[32 * j + l] & 0xF, q1 = ql[32 * j + l] >> 4;
            if (five) {
                q0 += (qh[l] >> (2 * j)) & 1 ? 16 : 0;
                q1 += (qh[l] >> (2 * j + 1)) & 1 ? 16 : 0;
            }
            y[64 * j + l] = d1 * (float)q0 - m1;
            y[64 * j + 32 + l] = d2 * (float)q1 - m2;
        }
    }
}

/* Q6_K super-block: y = d * sc * q evaluated left to right, as ggml. */
static void quant_dequant_q6k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = quant_f16_to_f32(quant_rd16(b + 208));
    for (int n = 0; n < 2; n++, y += 128, ql += 64, qh += 32, sc += 8) {
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
    }
}

/* Plain integer helpers that the SIMD kernels also call: always inlined, so that they compile
 * with the caller's instruction set (a call out of AVX code to SSE code pays for the switch). */
#define QUANT_SHARED_INLINE static inline __attribute__((always_inline))

/* The K-like formats whose super-block result takes off a min term (dmin * Σ m * bsum). */
QUANT_SHARED_INLINE int quant_k_has_min(enum gguf_type t) {
    return t == GGUF_TYPE_Q4_K || t == GGUF_TYPE_Q5_K || t == GGUF_TYPE_Q2_K;
}

/* Byte offset of a K-like super-block's fp16 d (its dmin, where it has one, follows). */
QUANT_SHARED_INLINE int quant_k_d_offset(enum gguf_type t) {
    return t == GGUF_TYPE_Q6_K ? 208 : t == GGUF_TYPE_Q2_K ? 80 : t == GGUF_TYPE_Q3_K ? 108 : 0;
}

/* The 16 signed 6-bit scales of a Q3_K super-block (ggml's kmask1/kmask2 unpacking). */
QUANT_SHARED_INLINE void quant_q3k_scales(const uint8_t *p, int8_t *sc) {
    uint32_t a[4];
    memcpy(a, p, 12);
    const uint32_t t = a[2];
    a[2] = ((a[0] >> 4) & 0x0f0f0f0f) | (((t >> 4) & 0x03030303) << 4);
    a[3] = ((a[1] >> 4) & 0x0f0f0f0f) | (((t >> 6) & 0x03030303) << 4);
    a[0] = (a[0] & 0x0f0f0f0f) | ((t & 0x03030303) << 4);
    a[1] = (a[1] & 0x0f0f0f0f) | (((t >> 2) & 0x03030303) << 4);
    /* each byte less 32, four at a time: the high bit set first keeps borrows inside a byte */
    for (int i = 0; i < 4; i++) a[i] = ((a[i] | 0x80808080u) - 0x20202020u) ^ 0x80808080u;
    memcpy(sc, a, 16);
}

/* The integer quants of a Q2_K (0..3) or Q3_K (-4..3) super-block in element order. Both keep
 * 2 bits per weight in 32-byte halves (shift 0, 2, 4, 6 give 4 x 32 weights); Q3_K's third bit
 * is in hmask, bit (half * 4 + shift / 2) of byte l, and subtracts 4 where clear. */
static void quant_q23k_quants(enum gguf_type t, const uint8_t *b, int8_t *q) {
    const int three = t == GGUF_TYPE_Q3_K;
    const uint8_t *qs = b + (three ? 32 : 16);
    for (int n = 0; n < 2; n++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < 32; l++) {
                int v = (qs[32 * n + l] >> 2 * k) & 3;
                if (three && !(b[l] >> (4 * n + k) & 1)) v -= 4;
                q[128 * n + 32 * k + l] = (int8_t)v;
            }
}

/* Q2_K super-block: 16 sub-blocks of 16, each with a 4-bit scale (low nibble) and min:
 * y = (d*sc)*q - (dmin*m), as ggml. */
static void quant_dequant_q2k(const uint8_t *b, float *y) {
    const float d = quant_f16_to_f32(quant_rd16(b + 80)), dmin = quant_f16_to_f32(quant_rd16(b + 82));
    int8_t q[QUANT_QK_K];
    quant_q23k_quants(GGUF_TYPE_Q2_K, b, q);
    for (int g = 0; g < 16; g++) {
        const float dl = d * (float)(b[g] & 0xF), ml = dmin * (float)(b[g] >> 4);
        for (int l = 0; l < 16; l++) y[16 * g + l] = dl * (float)q[16 * g + l] - ml;
    }
}

/* Q3_K super-block: y = (d*sc)*q with 16 signed scales, as ggml. */
static void quant_dequant_q3k(const uint8_t *b, float *y) {
    const float d = quant_f16_to_f32(quant_rd16(b + 108));
    int8_t q[QUANT_QK_K], sc[16];
    quant_q23k_quants(GGUF_TYPE_Q3_K, b, q);
    quant_q3k_scales(b + 96, sc);
    for (int g = 0; g < 16; g++) {
        const float dl = d * (float)sc[g];
        for (int l = 0; l < 16; l++) y[16 * g + l] = dl * (float)q[16 * g + l];
    }
}

/* The non-linear 4-bit grids. IQ4_NL/IQ4_XS: the reference's int8 table, read off its own
 * dequantisation of the golden files (value / d; tests/test_quant.c derives it again). MXFP4:
 * the OCP E2M1 values doubled, code = sign | exponent(2) | mantissa(1), with the block's E8M0
 * scale halved to match (quant_e8m0_half); generated by quant_tables_init. */
static const int8_t quant_iq4nl_values[16] = { -127, -104, -83, -65, -49, -35, -22, -10,
                                                 1, 13, 25, 38, 53, 69, 89, 113 };
static int8_t quant_mxfp4_values[16];
static int8_t quant_mxfp4_offset_values[16]; /* the same + 12, 0..24: unsigned operands for maddubs (AVX2) */

/* 2^(e-128): an E8M0 scale times one half, as ggml's E8M0_TO_FP32_HALF (e = 0, 1: subnormal). */
QUANT_SHARED_INLINE float quant_e8m0_half(uint8_t e) {
    return quant_bits_to_f32(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

/* IQ4_NL (d fp16, 16 bytes of codes) and MXFP4 (e E8M0, 16 bytes) 32-blocks: y = d * value. */
static void quant_dequant_nl(enum gguf_type t, const uint8_t *b, float *y) {
    const int mx = t == GGUF_TYPE_MXFP4;
    const int8_t *v = mx ? quant_mxfp4_values : quant_iq4nl_values;
    const uint8_t *qs = b + (mx ? 1 : 2);
    const float d = mx ? quant_e8m0_half(b[0]) : quant_f16_to_f32(quant_rd16(b));
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)v[qs[j] & 0xF];
        y[j + 16] = d * (float)v[qs[j] >> 4];
    }
}

/* IQ3_XXS: each group of 4 weights is one of 256 points of the 4-D lattice {4,12,..,52,62}^4
 * (a byte index) with 8 signs per 8 weights from 7 stored bits (the eighth makes the count of
 * minus signs even). The points are data of the format: quant_iq3xxs_keys lists them, sorted,
 * as 3-bit level indices (level of coordinate j in bits 3j..3j+2). coli derives that list from
 * the golden files (tests/test_quant.c, test_iq3xxs_lattice: pinned where the reference's
 * dequantisation shows a point, elsewhere the sorted list that best explains the quantizer's
 * choices on the same weights) and checks that it gives this table. */
static const uint8_t quant_iq3_levels[8] = { 4, 12, 20, 28, 36, 44, 52, 62 };
static const uint16_t quant_iq3xxs_keys[256] = {
    0, 2, 4, 9, 11, 15, 16, 18, 25, 34, 59, 61, 65, 67, 72, 74,
    81, 85, 88, 90, 97, 108, 120, 128, 130, 132, 137, 144, 146, 153, 155, 159,
    169, 175, 189, 193, 199, 200, 202, 213, 248, 267, 287, 292, 303, 315, 317, 321,
    327, 346, 362, 413, 436, 456, 460, 462, 483, 497, 513, 515, 520, 522, 529, 531,
    536, 538, 540, 551, 552, 576, 578, 585, 592, 594, 641, 643, 648, 650, 657, 664,
    698, 704, 706, 720, 729, 742, 758, 769, 773, 808, 848, 852, 870, 889, 901, 978,
    992, 1024, 1026, 1033, 1035, 1040, 1042, 1046, 1049, 1058, 1089, 1091, 1093, 1096, 1098, 1105,
    1112, 1139, 1143, 1144, 1152, 1154, 1161, 1167, 1168, 1170, 1183, 1184, 1197, 1217, 1224, 1228,
    1272, 1276, 1309, 1323, 1347, 1367, 1377, 1404, 1473, 1475, 1486, 1509, 1537, 1544, 1546, 1553,
    1555, 1576, 1589, 1594, 1600, 1602, 1616, 1625, 1636, 1638, 1665, 1667, 1672, 1685, 1706, 1722,
    1737, 1755, 1816, 1831, 1850, 1856, 1862, 1874, 1901, 1932, 1950, 1971, 2011, 2032, 2052, 2063,
    2077, 2079, 2091, 2095, 2172, 2192, 2207, 2208, 2224, 2230, 2247, 2277, 2308, 2345, 2356, 2389,
    2403, 2424, 2501, 2504, 2506, 2520, 2570, 2593, 2616, 2624, 2630, 2646, 2669, 2700, 2714, 2746,
    2754, 2795, 2824, 2835, 2839, 2874, 2882, 2905, 2984, 3028, 3042, 3092, 3108, 3110, 3124, 3153,
    3185, 3215, 3252, 3288, 3294, 3364, 3397, 3434, 3483, 3523, 3537, 3587, 3589, 3591, 3592, 3610,
    3626, 3670, 3680, 3722, 3749, 3754, 3776, 3789, 3803, 3824, 3857, 3873, 3904, 3906, 3924, 3992,
};
static uint32_t quant_iq3xxs_grid[256];  /* byte j = coordinate j (quant_tables_init) */

/* IQ3_S: each group of 4 weights is one of 512 points of {1,3,..,15}^4 (a 9-bit index: a qs
 * byte and a bit of qh), with a stored sign bit per weight. quant_iq3s_keys lists the points,
 * sorted, as 3-bit level indices ((v-1)/2 of coordinate j in bits 3j..3j+2). Derived from the
 * golden files: 235 points the reference's dequantisation shows, the rest from a likelihood of
 * the quantizer's choices on the same weights. tests/test_quant.c (test_iq3s_grid) derives it
 * again by least squares, which agrees but for 7 entries, and there the reference's logits
 * choose this table's points. */
static const uint16_t quant_iq3s_keys[512] = {
    0, 1, 2, 5, 7, 8, 9, 10, 12, 14, 16, 17, 21, 27, 32, 34,
    37, 39, 41, 43, 48, 50, 57, 60, 63, 64, 65, 66, 68, 72, 73, 77,
    80, 83, 87, 89, 93, 100, 113, 117, 122, 128, 129, 133, 135, 136, 139, 142,
    145, 149, 152, 156, 162, 165, 167, 169, 171, 184, 187, 195, 201, 205, 208, 210,
    217, 219, 222, 228, 232, 234, 247, 249, 253, 256, 267, 271, 273, 276, 282, 288,
    291, 297, 312, 322, 324, 336, 338, 342, 347, 353, 357, 359, 374, 379, 390, 393,
    395, 409, 426, 441, 448, 450, 452, 464, 466, 470, 475, 488, 492, 512, 513, 514,
    516, 520, 521, 523, 525, 527, 528, 530, 537, 540, 542, 556, 558, 561, 570, 576,
    577, 579, 582, 584, 588, 593, 600, 603, 609, 616, 618, 632, 638, 640, 650, 653,
    655, 656, 660, 666, 672, 675, 685, 688, 698, 705, 708, 711, 712, 715, 721, 727,
    728, 732, 737, 754, 760, 771, 773, 778, 780, 793, 795, 802, 806, 808, 812, 833,
    840, 843, 849, 856, 858, 873, 912, 916, 919, 932, 934, 961, 963, 968, 970, 977,
    989, 993, 1010, 1016, 1024, 1025, 1027, 1029, 1031, 1032, 1034, 1036, 1038, 1041, 1043, 1047,
    1048, 1050, 1057, 1059, 1061, 1064, 1066, 1079, 1080, 1083, 1085, 1088, 1090, 1096, 1099, 1103,
    1106, 1109, 1113, 1116, 1122, 1129, 1153, 1156, 1159, 1169, 1171, 1176, 1183, 1185, 1195, 1199,
    1209, 1212, 1216, 1218, 1221, 1225, 1234, 1236, 1241, 1243, 1250, 1256, 1270, 1281, 1287, 1296,
    1299, 1306, 1309, 1313, 1338, 1341, 1348, 1353, 1362, 1375, 1376, 1387, 1400, 1408, 1410, 1415,
    1425, 1453, 1457, 1477, 1481, 1494, 1496, 1507, 1512, 1538, 1545, 1547, 1549, 1551, 1554, 1561,
    1563, 1565, 1570, 1572, 1575, 1577, 1587, 1593, 1601, 1603, 1605, 1612, 1617, 1619, 1632, 1648,
    1658, 1662, 1664, 1674, 1680, 1690, 1692, 1704, 1729, 1736, 1740, 1745, 1747, 1751, 1752, 1761,
    1763, 1767, 1773, 1787, 1795, 1801, 1806, 1810, 1817, 1834, 1840, 1844, 1857, 1864, 1866, 1877,
    1882, 1892, 1902, 1915, 1934, 1953, 1985, 1987, 2000, 2002, 2013, 2048, 2052, 2058, 2064, 2068,
    2071, 2074, 2081, 2088, 2104, 2114, 2119, 2121, 2123, 2130, 2136, 2141, 2147, 2153, 2157, 2177,
    2179, 2184, 2189, 2193, 2203, 2208, 2223, 2226, 2232, 2244, 2249, 2251, 2256, 2258, 2265, 2269,
    2304, 2306, 2324, 2335, 2336, 2361, 2373, 2375, 2385, 2418, 2443, 2460, 2480, 2504, 2509, 2520,
    2531, 2537, 2562, 2568, 2572, 2578, 2592, 2596, 2599, 2602, 2614, 2620, 2625, 2627, 2629, 2634,
    2641, 2650, 2682, 2688, 2697, 2707, 2712, 2718, 2731, 2754, 2759, 2760, 2775, 2788, 2793, 2805,
    2811, 2817, 2820, 2832, 2842, 2854, 2890, 2902, 2921, 2923, 2978, 3010, 3012, 3026, 3081, 3083,
    3085, 3097, 3099, 3120, 3136, 3152, 3159, 3188, 3210, 3228, 3234, 3245, 3250, 3256, 3264, 3276,
    3281, 3296, 3349, 3363, 3378, 3392, 3395, 3420, 3440, 3461, 3488, 3529, 3531, 3584, 3588, 3591,
    3600, 3602, 3614, 3616, 3628, 3634, 3650, 3657, 3668, 3683, 3685, 3713, 3716, 3720, 3726, 3729,
    3736, 3753, 3778, 3802, 3805, 3819, 3841, 3845, 3851, 3856, 3880, 3922, 3938, 3970, 3993, 4032,
};
static uint32_t quant_iq3s_grid[512];    /* byte j = coordinate j (quant_tables_init) */
/* The level indices of coordinates 2h (low nibble) and 2h + 1 (high) of each point, plane h
 * of the tables the VBMI lookups permute (quant_tables_init). */
static uint8_t quant_iq3xxs_pairs[2][256] __attribute__((aligned(64)));
static uint8_t quant_iq3s_pairs[2][512] __attribute__((aligned(64)));
static uint64_t quant_iq_sign_bytes[128]; /* by 7 stored sign bits: byte j is -1 or +1, weight j's sign */
static uint8_t quant_iq_sign_table[128] __attribute__((aligned(64))); /* quant_iq_signs of each */

/* Sign byte for 7 stored bits: bit 7 set when the 7 hold an odd count (ggml's ksigns). The
 * parity is folded by hand: __builtin_popcount is a library call without -mpopcnt. */
QUANT_SHARED_INLINE uint8_t quant_iq_signs(uint32_t bits7) {
    uint32_t p = bits7 ^ bits7 >> 4;
    p ^= p >> 2;
    p ^= p >> 1;
    return (uint8_t)(bits7 | (p & 1) << 7);
}

/* The 4 sign bytes of an IQ3_XXS 32-block (byte l for weights 8l..8l+7) from its word. */
static uint32_t quant_iq3xxs_signs(uint32_t aux) {
    uint32_t s = 0;
    for (int l = 0; l < 4; l++) s |= (uint32_t)quant_iq_signs(aux >> 7 * l & 127) << 8 * l;
    return s;
}

/* The 6-bit scale of 32-block ib of an IQ4_XS super-block, less 32. */
QUANT_SHARED_INLINE int quant_iq4xs_scale(const uint8_t *b, int ib) {
    return (((b[4 + ib / 2] >> 4 * (ib % 2)) & 0xF) | (((quant_rd16(b + 2) >> 2 * ib) & 3) << 4)) - 32;
}

/* Byte of pair H of the planes above for a key of quant_iq3xxs_keys / quant_iq3s_keys. */
static int quant_iq3_pair(uint16_t key, int h) { return (key >> 6 * h & 7) | (key >> (6 * h + 3) & 7) << 4; }

/* Fills the generated tables; called by quant_set_level, so before any dot or dequant. */
static void quant_tables_init(void) {
    for (int c = 0; c < 16; c++) {
        const int e = (c >> 1) & 3, m = c & 1, v = e ? (2 + m) << (e - 1) : m;
        quant_mxfp4_values[c] = (int8_t)(c & 8 ? -v : v);
        quant_mxfp4_offset_values[c] = (int8_t)(quant_mxfp4_values[c] + 12);
    }
    for (int k = 0; k < 256; k++) {
        uint32_t g = 0;
        for (int j = 0; j < 4; j++) g |= (uint32_t)quant_iq3_levels[quant_iq3xxs_keys[k] >> 3 * j & 7] << 8 * j;
        quant_iq3xxs_grid[k] = g;
        for (int h = 0; h < 2; h++) quant_iq3xxs_pairs[h][k] = (uint8_t)quant_iq3_pair(quant_iq3xxs_keys[k], h);
    }
    for (int k = 0; k < 512; k++) {
        uint32_t g = 0;
        for (int j = 0; j < 4; j++) g |= (uint32_t)(2 * (quant_iq3s_keys[k] >> 3 * j & 7) + 1) << 8 * j;
        quant_iq3s_grid[k] = g;
        for (int h = 0; h < 2; h++) quant_iq3s_pairs[h][k] = (uint8_t)quant_iq3_pair(quant_iq3s_keys[k], h);
    }
    for (uint32_t bits = 0; bits < 128; bits++) {
        uint64_t m = 0;
        for (int j = 0; j < 8; j++) m |= (uint64_t)(quant_iq_signs(bits) >> j & 1 ? 0xff : 0x01) << 8 * j;
        quant_iq_sign_bytes[bits] = m;
        quant_iq_sign_table[bits] = quant_iq_signs(bits);
    }
}

/* IQ3_S super-block: d fp16 | qs[64] | qh[8] | signs[32] | scales[4]. The grid index of group
 * K (weights 4K..4K+3) of 32-block IB: its qs byte, and bit K of the block's qh byte as bit 8. */
#define QUANT_IQ3S_QH 66
#define QUANT_IQ3S_SIGNS 74
#define QUANT_IQ3S_SCALES 106
QUANT_SHARED_INLINE int quant_iq3s_index(const uint8_t *b, int ib, int k) {
    return b[2 + 8 * ib + k] | (b[QUANT_IQ3S_QH + ib] >> k & 1) << 8;
}

/* The 4-bit scale s of 32-block IB of an IQ3_S super-block (its weight is d*(1+2s)). */
QUANT_SHARED_INLINE int quant_iq3s_scale(const uint8_t *b, int ib) {
    return b[QUANT_IQ3S_SCALES + ib / 2] >> 4 * (ib % 2) & 15;
}

/* The signed values of an IQ4_XS (IQ4_NL table), IQ3_XXS or IQ3_S (grid point times sign)
 * super-block in element order, and the 8 integer scales of its 32-blocks: IQ4_XS's 6-bit ones
 * less 32; IQ3_XXS's s in d*(0.5+s)*0.5, whose word also holds 4 x 7 sign bits; IQ3_S's s in
 * d*(1+2s), with a stored sign bit per weight. */
static void quant_iq_values(enum gguf_type t, const uint8_t *b, int8_t *v, int *sc) {
    for (int ib = 0; ib < 8; ib++, v += 32) {
        if (t == GGUF_TYPE_IQ3_S) {
            sc[ib] = quant_iq3s_scale(b, ib);
            for (int j = 0; j < 32; j++) {
                const int g = (int)(quant_iq3s_grid[quant_iq3s_index(b, ib, j / 4)] >> 8 * (j % 4) & 0xff);
                v[j] = (int8_t)(b[QUANT_IQ3S_SIGNS + 4 * ib + j / 8] >> j % 8 & 1 ? -g : g);
            }
            continue;
        }
        if (t == GGUF_TYPE_IQ4_XS) {
            const uint8_t *qs = b + 8 + 16 * ib;
            sc[ib] = quant_iq4xs_scale(b, ib);
            for (int j = 0; j < 16; j++) {
                v[j] = quant_iq4nl_values[qs[j] & 0xF];
                v[j + 16] = quant_iq4nl_values[qs[j] >> 4];
            }
            continue;
        }
        uint32_t aux;
        memcpy(&aux, b + 66 + 4 * ib, 4);
        sc[ib] = (int)(aux >> 28);
        const uint32_t signs = quant_iq3xxs_signs(aux);
        for (int j = 0; j < 32; j++) {
            const int g = (int)(quant_iq3xxs_grid[b[2 + 8 * ib + j / 4]] >> 8 * (j % 4) & 0xff);
            v[j] = (int8_t)(signs >> j & 1 ? -g : g);
        }
    }
}

/* IQ4_XS: y = (d*s) * v; IQ3_XXS: y = (d*(0.5+s)*0.5) * v; IQ3_S: y = (d*(1+2s)) * v, as ggml
 * (the sign comes last there, which is the same number). */
static void quant_dequant_iq(enum gguf_type t, const uint8_t *b, float *y) {
    const float d = quant_f16_to_f32(quant_rd16(b));
    int8_t v[QUANT_QK_K];
    int sc[8];
    quant_iq_values(t, b, v, sc);
    for (int ib = 0; ib < 8; ib++) {
        const float db = t == GGUF_TYPE_IQ4_XS ? d * (float)sc[ib]
                       : t == GGUF_TYPE_IQ3_S ? d * (float)(1 + 2 * sc[ib]) : d * (0.5f + (float)sc[ib]) * 0.5f;
        for (int j = 0; j < 32; j++) y[32 * ib + j] = db * (float)v[32 * ib + j];
    }
}

/* Writes n floats of a GGUF row of `type` to dst. Caller: type supported, n a multiple of the
 * block size, src holds the row's n/block_elems blocks. Bit-exact with ggml. */
static void quant_dequant_row(enum gguf_type type, const void *src, float *dst, int64_t n) {
    const uint8_t *s = src;
    const struct gguf_type_info *ti = gguf_type_get(type);
    if (!ti || n % ti->block_elems) die("dequant: bad type %d or length %lld", (int)type, (long long)n);
    int64_t nb = n / ti->block_elems;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = s + i * ti->block_bytes;
        float *y = dst + i * ti->block_elems;
        switch (type) {
        case GGUF_TYPE_F32: memcpy(y, b, 4); break;
        case GGUF_TYPE_F16: *y = quant_f16_to_f32(quant_rd16(b)); break;
        case GGUF_TYPE_BF16: *y = quant_bf16_to_f32(quant_rd16(b)); break;
        case GGUF_TYPE_Q4_K: quant_dequant_q45k(b, 0, y); break;
        case GGUF_TYPE_Q5_K: quant_dequant_q45k(b, 1, y); break;
        case GGUF_TYPE_Q6_K: quant_dequant_q6k(b, y); break;
        case GGUF_TYPE_Q2_K: quant_dequant_q2k(b, y); break;
        case GGUF_TYPE_Q3_K: quant_dequant_q3k(b, y); break;
        case GGUF_TYPE_IQ4_NL: case GGUF_TYPE_MXFP4: quant_dequant_nl(type, b, y); break;
        case GGUF_TYPE_IQ4_XS: case GGUF_TYPE_IQ3_XXS: case GGUF_TYPE_IQ3_S: quant_dequant_iq(type, b, y); break;
        default: quant_dequant_legacy(type, b, y); break;
        }
    }
}

/* Byte offsets of the fp16 fields (scale d, and dmin or m) in a block of TYPE; -1: none. */
static void quant_fp16_fields(enum gguf_type t, int at[2])
{
    at[0] = 0;
    at[1] = t == GGUF_TYPE_Q4_1 || t == GGUF_TYPE_Q5_1 || t == GGUF_TYPE_Q4_K || t == GGUF_TYPE_Q5_K ? 2 : -1;
    if (t == GGUF_TYPE_Q2_K) at[0] = 80, at[1] = 82;
    if (t == GGUF_TYPE_Q3_K) at[0] = 108;
    if (t == GGUF_TYPE_Q6_K) at[0] = 208;
}

/* Rewrites the float-valued fields of BYTES bytes of random blocks of TYPE (whole blocks) so
 * that every one is finite and normal, of magnitude in [2^E, 2^(E+1)) with its random sign:
 * F32, F16 and BF16 elements, the fp16 scales, MXFP4's E8M0 exponent (2^E). Random bits alone
 * would give NaN, infinities and denormals (slow, so unrepresentative of real weights). */
static void quant_sanitize_random(enum gguf_type t, uint8_t *w, size_t bytes, int e)
{
    const size_t bb = (size_t)gguf_type_get(t)->block_bytes, nb = bytes / bb;
    int at[2];
    quant_fp16_fields(t, at);
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < nb; i++) {
        uint8_t *p = w + i * bb;
        if (t == GGUF_TYPE_F32) {
            uint32_t v;
            memcpy(&v, p, 4);
            v = (v & 0x807fffffu) | (uint32_t)(127 + e) << 23;
            memcpy(p, &v, 4);
        } else if (t == GGUF_TYPE_MXFP4) {
            p[0] = (uint8_t)(127 + e);
        } else {
            for (int k = 0; k < 2 && at[k] >= 0; k++) {
                uint16_t h = quant_rd16(p + at[k]);
                h = t == GGUF_TYPE_BF16 ? (uint16_t)((h & 0x807f) | (127 + e) << 7) : (uint16_t)((h & 0x83ff) | (15 + e) << 10);
                memcpy(p + at[k], &h, 2);
            }
        }
    }
}

/* ---- activations ----
 * Layouts (act is 64-byte aligned; n is a multiple of the block, so every part stays aligned):
 *   F32/F16/BF16 weights: n floats (x, rounded to f16/bf16 for F16/BF16 weights).
 *   legacy weights (Q8 act, shared by Q8_0 and Q8_1 users): qs[n] int8 | d[n/32] float
 *     (fp16-rounded scale) | s[n/32] int32 (sum of the block's qs) | sd[n/32] float
 *     (Q8_1's s = fp16(d * sum), rounded as the reference stores it: Q4_1/Q5_1 weights
 *     multiply their min by it, and the rounding is visible in the logits).
 *   K weights (Q8_K act): qs[n] int8 | d[n/256] float | bsums[n/16] int16. */
struct quant_q8_view { const int8_t *qs; const float *d; const int32_t *s; const float *sd; };
struct quant_q8k_view { const int8_t *qs; const float *d; const int16_t *bsums; };

enum quant_act_kind { QUANT_ACT_FLOAT, QUANT_ACT_Q8, QUANT_ACT_Q8K };

static enum quant_act_kind quant_act_kind(enum gguf_type wtype) {
    switch (wtype) {
    case GGUF_TYPE_F32: case GGUF_TYPE_F16: case GGUF_TYPE_BF16: return QUANT_ACT_FLOAT;
    case GGUF_TYPE_Q8_0: case GGUF_TYPE_Q4_0: case GGUF_TYPE_Q4_1:
    case GGUF_TYPE_Q5_0: case GGUF_TYPE_Q5_1: case GGUF_TYPE_IQ4_NL: case GGUF_TYPE_MXFP4:
        return QUANT_ACT_Q8;
    case GGUF_TYPE_Q4_K: case GGUF_TYPE_Q5_K: case GGUF_TYPE_Q6_K: case GGUF_TYPE_Q2_K:
    case GGUF_TYPE_Q3_K: case GGUF_TYPE_IQ4_XS: case GGUF_TYPE_IQ3_XXS: case GGUF_TYPE_IQ3_S:
        return QUANT_ACT_Q8K;
    default: die("quant: unsupported weight type %d", (int)wtype);
    }
    return QUANT_ACT_FLOAT;
}

static struct quant_q8_view quant_q8_view(const void *act, int64_t n) {
    const uint8_t *a = act;
    return (struct quant_q8_view){ (const int8_t *)a, (const float *)(a + n),
                                   (const int32_t *)(a + n + 4 * (n / QUANT_QK)),
                                   (const float *)(a + n + 8 * (n / QUANT_QK)) };
}

static struct quant_q8k_view quant_q8k_view(const void *act, int64_t n) {
    const uint8_t *a = act;
    return (struct quant_q8k_view){ (const int8_t *)a, (const float *)(a + n),
                                    (const int16_t *)(a + n + 4 * (n / QUANT_QK_K)) };
}

/* Bytes of the prepared activation for n elements against weights of wtype. */
static size_t quant_act_bytes(enum gguf_type wtype, int64_t n) {
    switch (quant_act_kind(wtype)) {
    case QUANT_ACT_FLOAT: return (size_t)n * 4;
    case QUANT_ACT_Q8: return (size_t)n + (size_t)(n / QUANT_QK) * 12;
    default: return (size_t)n + (size_t)(n / QUANT_QK_K) * 4 + (size_t)(n / 16) * 2;
    }
}

/* Q8 blocks: d = amax/127, q = nearest-even(x * (127/amax)), stored scale fp16(d): the x86
 * reference's quantize_row_q8_0 (its AVX2 code, which its AVX-512 builds run too). 127/amax is
 * not always 1/d to the last bit (ggml's portable code and its NEON path use 1/d); either way
 * some q land on the other side of a .5, and each such step can tip a router near-tie
 * (issue 14's Q8_0 drift; test_quant's "Q8 act: the reference's 127/amax" pins it). A block
 * whose fp16(d) is zero contributes exactly zero, so its q are set to 0 rather than computed
 * with an overflowing 127/amax. */
static void quant_act_q8(const float *x, int64_t n, void *act) {
    uint8_t *a = act;
    int8_t *qs = (int8_t *)a;
    float *dd = (float *)(a + n);
    int32_t *ss = (int32_t *)(a + n + 4 * (n / QUANT_QK));
    float *sd = (float *)(a + n + 8 * (n / QUANT_QK));
    for (int64_t b = 0; b < n / QUANT_QK; b++) {
        const float *xb = x + b * QUANT_QK;
        float amax = 0.0f;
        for (int j = 0; j < QUANT_QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.0f, d16 = quant_f16_to_f32(quant_f32_to_f16(d));
        const float id = d16 != 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < QUANT_QK; j++) {
            int q = quant_nearest_int(xb[j] * id);
            qs[b * QUANT_QK + j] = (int8_t)q;
            sum += q;
        }
        dd[b] = d16;
        ss[b] = sum;
        sd[b] = quant_f16_to_f32(quant_f32_to_f16(d * (float)sum));
    }
}

/* Q8_K blocks (ggml quantize_row_q8_K_ref): scale from the signed value of largest magnitude.
 * Blocks so tiny that -127/max overflows (|max| < ~3.7e-37) are stored as zero (d = 0). */
static void quant_act_q8k(const float *x, int64_t n, void *act) {
    uint8_t *a = act;
    int8_t *qs = (int8_t *)a;
    float *dd = (float *)(a + n);
    int16_t *bs = (int16_t *)(a + n + 4 * (n / QUANT_QK_K));
    for (int64_t b = 0; b < n / QUANT_QK_K; b++) {
        const float *xb = x + b * QUANT_QK_K;
        int8_t *q = qs + b * QUANT_QK_K;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QUANT_QK_K; j++)
            if (fabsf(xb[j]) > amax) { amax = fabsf(xb[j]); max = xb[j]; }
        float iscale = amax != 0.0f ? -127.0f / max : 0.0f;
        if (isinf(iscale)) iscale = 0.0f;
        for (int j = 0; j < QUANT_QK_K; j++) {
            int v = iscale != 0.0f ? quant_nearest_int(iscale * xb[j]) : 0;
            q[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += q[16 * g + j];
            bs[b * 16 + g] = (int16_t)s;
        }
        dd[b] = iscale != 0.0f ? 1.0f / iscale : 0.0f;
    }
}

/* ---- scalar dot kernels: the canonical reference ---- */

/* Butterfly over the 32 partials: s = 16,8,4,2,1, p[i] += p[i+s]. */
static float quant_reduce32(float *p) {
    for (int s = QUANT_NPART / 2; s > 0; s /= 2)
        for (int i = 0; i < s; i++) p[i] = p[i] + p[i + s];
    return p[0];
}

/* Adds elements [i0, i1) of a float-format row times x into p[i % 32]. */
static void quant_float_units(enum gguf_type t, const uint8_t *w, const float *x,
                              int64_t i0, int64_t i1, float *p) {
    for (int64_t i = i0; i < i1; i++) {
        float wv;
        if (t == GGUF_TYPE_F32) memcpy(&wv, w + 4 * i, 4);
        else if (t == GGUF_TYPE_F16) wv = quant_f16_to_f32(quant_rd16(w + 2 * i));
        else wv = quant_bf16_to_f32(quant_rd16(w + 2 * i));
        p[i % QUANT_NPART] = p[i % QUANT_NPART] + wv * x[i];
    }
}

/* The float combine of one legacy block; shared by every level so the bits agree:
 *   no min: r = (dw*dx) * (float)isum;  with min: r + mw * sd (sd = fp16(d_x * sum q_x), as Q8_1 stores it). */
static inline float quant_legacy_combine(float dw, float mw, float dx, int32_t isum,
                                         float sd, int has_min) {
    float r = (dw * dx) * (float)isum;
    return has_min ? r + mw * sd : r;
}

/* Adds legacy blocks [b0, b1) of a weight row times a Q8 act into p[b % 32]. Weight quants
 * are used as ggml defines them (Q4_0 q-8, Q5_0 q-16, Q4_1/Q5_1 unsigned q plus min). */
static void quant_legacy_units(enum gguf_type t, const uint8_t *w, struct quant_q8_view a,
                               int64_t b0, int64_t b1, float *p) {
    const int bb = gguf_type_get(t)->block_bytes;
    const int has_min = t == GGUF_TYPE_Q4_1 || t == GGUF_TYPE_Q5_1;
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *blk = w + b * bb;
        const int8_t *qx = a.qs + b * QUANT_QK;
        float dq[QUANT_QK], dw = t == GGUF_TYPE_MXFP4 ? quant_e8m0_half(blk[0]) : quant_f16_to_f32(quant_rd16(blk));
        float mw = has_min ? quant_f16_to_f32(quant_rd16(blk + 2)) : 0.0f;
        int32_t isum = 0;
        if (t == GGUF_TYPE_IQ4_NL || t == GGUF_TYPE_MXFP4) {
            const int8_t *v = t == GGUF_TYPE_MXFP4 ? quant_mxfp4_values : quant_iq4nl_values;
            const uint8_t *qs = blk + (t == GGUF_TYPE_MXFP4 ? 1 : 2);
            for (int j = 0; j < 16; j++) isum += v[qs[j] & 0xF] * qx[j] + v[qs[j] >> 4] * qx[j + 16];
        } else if (t == GGUF_TYPE_Q8_0) {
            for (int j = 0; j < QUANT_QK; j++) isum += (int8_t)blk[2 + j] * qx[j];
        } else {
            /* dequantise with unit scale and zero min to get the exact integer quants */
            uint8_t tmp[24];
            memcpy(tmp, blk, (size_t)bb);
            tmp[0] = 0x00; tmp[1] = 0x3c;                    /* d = 1.0 */
            if (has_min) { tmp[2] = 0; tmp[3] = 0; }         /* m = 0 */
            quant_dequant_legacy(t, tmp, dq);
            for (int j = 0; j < QUANT_QK; j++) isum += (int32_t)dq[j] * qx[j];
        }
        float r = quant_legacy_combine(dw, mw, a.d[b], isum, a.sd[b], has_min);
        p[b % QUANT_NPART] = p[b % QUANT_NPART] + r;
    }
}

/* Q4_K/Q5_K: exact integer parts of one super-block given decoded 6-bit scales:
 * returns Σ_j sc_j * Σ_{32 in j} q*x (q unsigned 0..15 / 0..31). */
static int32_t quant_q45k_isum_scalar(const uint8_t *b, const int8_t *qx, const int *sc, int five) {
    const uint8_t *qh = b + 16, *ql = b + 16 + (five ? 32 : 0);
    int32_t sumi = 0;
    for (int j = 0; j < 4; j++) {
        int32_t s0 = 0, s1 = 0;
        for (int l = 0; l < 32; l++) {
            int q0 = ql[32 * j + l] & 0xF, q1 = ql[32 * j + l] >> 4;
            if (five) {
                q0 |= ((qh[l] >> (2 * j)) & 1) << 4;
                q1 |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
            }
            s0 += q0 * qx[64 * j + l];
            s1 += q1 * qx[64 * j + 32 + l];
        }
        sumi += sc[2 * j] * s0 + sc[2 * j + 1] * s1;
    }
    return sumi;
}

/* Q6_K: Σ_j sc_j * Σ_{16 in j} (q-32)*x, exact. */
static int32_t quant_q6k_isum_scalar(const uint8_t *b, const int8_t *qx) {
    float y[QUANT_QK_K];
    uint8_t tmp[210];
    memcpy(tmp, b, 208);
    for (int j = 0; j < 16; j++) tmp[192 + j] = 1;   /* sc = 1, d = 1: y = q - 32 exactly */
    tmp[208] = 0x00; tmp[209] = 0x3c;
    quant_dequant_q6k(tmp, y);
    int32_t sumi = 0;
    for (int j = 0; j < 16; j++) {
        int32_t s = 0;
        for (int l = 0; l < 16; l++) s += (int32_t)y[16 * j + l] * qx[16 * j + l];
        sumi += (int8_t)b[192 + j] * s;
    }
    return sumi;
}

/* Σ_g scale_g * Σ_{16 in g} q*x over the 16-weight groups of a Q2_K (scale: the low nibble;
 * *summ = Σ_g min_g * bsum_g) or Q3_K super-block, exact. */
static int32_t quant_q23k_isum_scalar(enum gguf_type t, const uint8_t *b, const int8_t *qx,
                                      const int16_t *bs, int32_t *summ) {
    int8_t q[QUANT_QK_K], sc[16];
    quant_q23k_quants(t, b, q);
    if (t == GGUF_TYPE_Q3_K) quant_q3k_scales(b + 96, sc);
    else for (int g = 0; g < 16; g++) sc[g] = (int8_t)(b[g] & 0xF);
    int32_t sumi = 0, sm = 0;
    for (int g = 0; g < 16; g++) {
        int32_t s = 0;
        for (int l = 0; l < 16; l++) s += q[16 * g + l] * qx[16 * g + l];
        sumi += sc[g] * s;
        if (t == GGUF_TYPE_Q2_K) sm += (b[g] >> 4) * bs[g];
    }
    *summ = sm;
    return sumi;
}

/* Σ_ib s_ib * Σ_{32 in ib} v*x of an IQ4_XS (s as stored, less 32), IQ3_XXS (s = 2*scale+1,
 * i.e. d*(0.5+scale)*0.5 = (d/4)*s) or IQ3_S (s = 2*scale+1) super-block, exact. */
static int32_t quant_iq_isum_scalar(enum gguf_type t, const uint8_t *b, const int8_t *qx) {
    int8_t v[QUANT_QK_K];
    int sc[8];
    quant_iq_values(t, b, v, sc);
    int32_t sumi = 0;
    for (int ib = 0; ib < 8; ib++) {
        int32_t s = 0;
        for (int l = 0; l < 32; l++) s += v[32 * ib + l] * qx[32 * ib + l];
        sumi += (t == GGUF_TYPE_IQ4_XS ? sc[ib] : 2 * sc[ib] + 1) * s;
    }
    return sumi;
}

/* One super-block's result for the K-like formats besides Q4_K/Q5_K/Q6_K:
 *   Q2_K:    (d*dx)*(float)isum - (dmin*dx)*(float)summ
 *   Q3_K, IQ4_XS, IQ3_S: (d*dx)*(float)isum
 *   IQ3_XXS: ((d*dx)*(float)isum) * 0.25 (the reference's final quarter, exact) */
static float quant_dot_k_unit(enum gguf_type t, const uint8_t *b, const int8_t *qx, const int16_t *bs,
                              float dx) {
    int32_t summ = 0;
    switch (t) {
    case GGUF_TYPE_Q2_K: {
        int32_t isum = quant_q23k_isum_scalar(t, b, qx, bs, &summ);
        return (quant_f16_to_f32(quant_rd16(b + 80)) * dx) * (float)isum
             - (quant_f16_to_f32(quant_rd16(b + 82)) * dx) * (float)summ;
    }
    case GGUF_TYPE_Q3_K:
        return (quant_f16_to_f32(quant_rd16(b + 108)) * dx) * (float)quant_q23k_isum_scalar(t, b, qx, bs, &summ);
    case GGUF_TYPE_IQ4_XS: case GGUF_TYPE_IQ3_S:
        return (quant_f16_to_f32(quant_rd16(b)) * dx) * (float)quant_iq_isum_scalar(t, b, qx);
    default:
        return ((quant_f16_to_f32(quant_rd16(b)) * dx) * (float)quant_iq_isum_scalar(t, b, qx)) * 0.25f;
    }
}

/* Dot of a K-quant row with a Q8_K act in canonical order; every level keeps this float combine:
 *   Q4_K/Q5_K: r = (d*dx)*(float)Σ sc_j*isum_j - (dmin*dx)*(float)Σ m_j*bsum_j
 *   Q6_K:      r = (d*dx)*(float)Σ sc_j*isum_j */
static float quant_dot_k(enum gguf_type t, const uint8_t *w, const void *act, int64_t n) {
    struct quant_q8k_view a = quant_q8k_view(act, n);
    const int bb = gguf_type_get(t)->block_bytes;
    float p[QUANT_NPART] = {0};
    for (int64_t u = 0; u < n / QUANT_QK_K; u++) {
        const uint8_t *b = w + u * bb;
        const int8_t *qx = a.qs + u * QUANT_QK_K;
        const int16_t *bs = a.bsums + u * 16;
        float r, dx = a.d[u];
        if (t == GGUF_TYPE_Q6_K) {
            r = (quant_f16_to_f32(quant_rd16(b + 208)) * dx) * (float)quant_q6k_isum_scalar(b, qx);
        } else if (t != GGUF_TYPE_Q4_K && t != GGUF_TYPE_Q5_K) {
            r = quant_dot_k_unit(t, b, qx, bs, dx);
        } else {
            int sc[8], m[8];
            int32_t summ = 0;
            for (int j = 0; j < 8; j++) {
                quant_k4_scale_min(j, b + 4, &sc[j], &m[j]);
                summ += m[j] * (bs[2 * j] + bs[2 * j + 1]);
            }
            int32_t sumi = quant_q45k_isum_scalar(b, qx, sc, t == GGUF_TYPE_Q5_K);
            float d = quant_f16_to_f32(quant_rd16(b)), dmin = quant_f16_to_f32(quant_rd16(b + 2));
            r = (d * dx) * (float)sumi - (dmin * dx) * (float)summ;
        }
        p[u % QUANT_NPART] = p[u % QUANT_NPART] + r;
    }
    return quant_reduce32(p);
}

static float quant_dot_float_scalar(enum gguf_type t, const void *w, const void *act, int64_t n) {
    float p[QUANT_NPART] = {0};
    quant_float_units(t, w, act, 0, n, p);
    return quant_reduce32(p);
}

static float quant_dot_legacy_scalar(enum gguf_type t, const void *w, const void *act, int64_t n) {
    float p[QUANT_NPART] = {0};
    quant_legacy_units(t, w, quant_q8_view(act, n), 0, n / QUANT_QK, p);
    return quant_reduce32(p);
}

#define QUANT_SCALAR_WRAP(name, body) \
    static float name(const void *w, const void *act, int64_t n) { return body; }
QUANT_SCALAR_WRAP(quant_dot_f32_scalar, quant_dot_float_scalar(GGUF_TYPE_F32, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_f16_scalar, quant_dot_float_scalar(GGUF_TYPE_F16, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_bf16_scalar, quant_dot_float_scalar(GGUF_TYPE_BF16, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_q8_0_scalar, quant_dot_legacy_scalar(GGUF_TYPE_Q8_0, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_q4_0_scalar, quant_dot_legacy_scalar(GGUF_TYPE_Q4_0, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_q4_1_scalar, quant_dot_legacy_scalar(GGUF_TYPE_Q4_1, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_q5_0_scalar, quant_dot_legacy_scalar(GGUF_TYPE_Q5_0, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_q5_1_scalar, quant_dot_legacy_scalar(GGUF_TYPE_Q5_1, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_q4_k_scalar, quant_dot_k(GGUF_TYPE_Q4_K, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_q5_k_scalar, quant_dot_k(GGUF_TYPE_Q5_K, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_q6_k_scalar, quant_dot_k(GGUF_TYPE_Q6_K, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_q2_k_scalar, quant_dot_k(GGUF_TYPE_Q2_K, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_q3_k_scalar, quant_dot_k(GGUF_TYPE_Q3_K, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_iq4_xs_scalar, quant_dot_k(GGUF_TYPE_IQ4_XS, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_iq3_xxs_scalar, quant_dot_k(GGUF_TYPE_IQ3_XXS, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_iq3_s_scalar, quant_dot_k(GGUF_TYPE_IQ3_S, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_iq4_nl_scalar, quant_dot_legacy_scalar(GGUF_TYPE_IQ4_NL, w, act, n))
QUANT_SCALAR_WRAP(quant_dot_mxfp4_scalar, quant_dot_legacy_scalar(GGUF_TYPE_MXFP4, w, act, n))

/* Software prefetch distance of the SIMD kernels, in weight bytes: far enough ahead that a
 * line arrives before the kernel reaches it, which grows with the memory's latency times the
 * rate a core consumes weights. Measured on an AMD EPYC (Zen 5-class) VM reading 70-90 GB/s
 * with 2 threads, one 768 MiB matrix of 4096 columns, the distances alternated in one process,
 * medians of 9 in GB/s for 1, 2, 4 and 8 KiB ahead: AVX-512 Q4_K 47.4 51.5 55.4 50.1, Q5_K 44.2
 * 47.3 52.8 49.2, Q6_K 54.0 59.7 62.0 61.2, Q8_0 53.5 54.4 58.2 59.2, Q4_0 42.8 44.6 45.3 43.4;
 * AVX2 Q4_K 43.5 46.1 47.7 42.1; 512-column Q4_K rows (the experts' down) 42.2 46.9 51.7 52.2;
 * no format lost at 4 KiB. An older host reading ~30 GB/s had its best at 1 KiB. */
#define QUANT_PREFETCH 4096

/* The 8 super-blocks of a K group unrolled: their integer parts stay in registers (Q6_K 154 ->
 * 107 instructions a super-block, Q4_K 115 -> 102), at ~15 s more compile time. COLI_ROLLED
 * leaves the loops rolled (same results): the test builds that do not check the kernels' speed
 * or the shipped code's bits (build.sh) define it. */
#define QUANT_PRAGMA(x) _Pragma(#x)
#ifdef COLI_ROLLED
#define QUANT_GROUP_UNROLL
#define QUANT_UNROLL(n)
#else
#define QUANT_GROUP_UNROLL _Pragma("GCC unroll 8")
#define QUANT_UNROLL(n) QUANT_PRAGMA(GCC unroll n) /* the AVX2 multi-column kernels: ~30 s more per sanitizer build;
                                                   * the AVX-512 loops: ~4 s more for test_quant's */
#endif

/* ---- AVX2 kernels: same units, same float steps, integer parts in SIMD ---- */
#define QUANT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QUANT_AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

/* Canonical butterfly on 4 accumulators holding partials 0-7, 8-15, 16-23, 24-31. */
QUANT_AVX2_INLINE float quant_avx2_reduce(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    a0 = _mm256_add_ps(a0, a2);                                   /* s = 16 */
    a1 = _mm256_add_ps(a1, a3);
    a0 = _mm256_add_ps(a0, a1);                                   /* s = 8 */
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1)); /* 4 */
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));                       /* s = 2 */
    v = _mm_add_ss(v, _mm_movehdup_ps(v));                        /* s = 1 */
    return _mm_cvtss_f32(v);
}

/* Adds R, a group's 8 unit results, to acc[0], then rotates the four accumulators so that the
 * next group's comes first: after G groups acc[i] holds partials 8*((G+i)%4) on. A rotation
 * keeps them in registers where acc[g % 4] would put them in memory. */
QUANT_AVX2_INLINE void quant_avx2_acc_add(__m256 *acc, __m256 r) {
    const __m256 a = _mm256_add_ps(acc[0], r);
    acc[0] = acc[1]; acc[1] = acc[2]; acc[2] = acc[3]; acc[3] = a;
}

/* quant_avx2_reduce of the accumulators of quant_avx2_acc_add after G groups. */
QUANT_AVX2_INLINE float quant_avx2_reduce_rotated(const __m256 *acc, int64_t groups) {
    switch (groups % 4) {
    case 1: return quant_avx2_reduce(acc[3], acc[0], acc[1], acc[2]);
    case 2: return quant_avx2_reduce(acc[2], acc[3], acc[0], acc[1]);
    case 3: return quant_avx2_reduce(acc[1], acc[2], acc[3], acc[0]);
    default: return quant_avx2_reduce(acc[0], acc[1], acc[2], acc[3]);
    }
}

/* The low 128-bit lanes of A and C side by side plus their high lanes side by side: the last
 * step of the horizontal sums. Zen 1 crosses lanes with vperm2i128 at ~2.5 cycles, where an
 * extract and an insert take ~0.5 each. */
QUANT_AVX2_INLINE __m256i quant_avx2_add_lanes(__m256i a, __m256i c) {
    const __m256i lo = _mm256_inserti128_si256(a, _mm256_castsi256_si128(c), 1);
    const __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm256_extracti128_si256(a, 1)),
                                               _mm256_extracti128_si256(c, 1), 1);
    return _mm256_add_epi32(lo, hi);
}

/* The 128-bit lane L of V in both lanes (an extract and an insert: see quant_avx2_add_lanes). */
QUANT_AVX2_INLINE __m256i quant_avx2_lane_twice(__m256i v, int l) {
    const __m128i h = l ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(h), h, 1);
}

/* Lane k of the result = sum of the 8 lanes of s[k] (exact). */
QUANT_AVX2_INLINE __m256i quant_avx2_hsum8(const __m256i *s) {
    __m256i a = _mm256_hadd_epi32(s[0], s[1]), b = _mm256_hadd_epi32(s[2], s[3]);
    __m256i c = _mm256_hadd_epi32(s[4], s[5]), d = _mm256_hadd_epi32(s[6], s[7]);
    a = _mm256_hadd_epi32(a, b);
    c = _mm256_hadd_epi32(c, d);
    return quant_avx2_add_lanes(a, c);
}

/* quant_avx2_hsum8 where only s[0..count) may be nonzero (the other lanes come out 0). */
QUANT_AVX2_INLINE __m256i quant_avx2_hsum_upto8(const __m256i *s, int count) {
    if (count > 4) return quant_avx2_hsum8(s);
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    return _mm256_zextsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)));
}

/* 16 int16 pair sums of v*x for signed bytes, |x| <= 127 (v = -128 works: sign(v, v) reads as
 * 128 unsigned), so no pair saturates. */
QUANT_AVX2_INLINE __m256i quant_avx2_signed_pairs(__m256i v, __m256i x) {
    return _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(x, v));
}

/* Columns per pass of the AVX2 multi-column kernels: a group's 8 decoded weight blocks are
 * shared by every column, each column's 8 block products and 4 accumulators come in turn. */
#define QUANT_AVX2_NCOL 4

/* The 16 bytes at P in the low 128-bit lane, those at Q in the high one. */
QUANT_AVX2_INLINE __m256i quant_avx2_halves(const void *p, const void *q) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                   _mm_loadu_si128((const __m128i *)q), 1);
}

/* A legacy group's 8 blocks go as 4 pairs, block j beside block j + 4 (j < 4), each pair's
 * elements 0-15 in one vector (LO: block j's in the low 128-bit lane, block j + 4's in the high)
 * and 16-31 in another (HI). Then the two products of a pair add up within each lane, and the
 * horizontal sums of quant_avx2_legacy_sums leave block k's total in lane k: half the horizontal
 * adds of summing 8 whole blocks, and no lane-crossing step (Zen 1, one core, in cache: a Q4_0
 * group of 8 blocks 47 -> 37-43 TSC cycles). */

/* The weight operands of the pair of blocks at BJ and BJ4 (quant_avx2_legacy_sums' layout):
 * signed values (Q8_0, IQ4_NL), else unsigned quants (MXFP4's values + 12). */
QUANT_AVX2_INLINE void quant_avx2_legacy_w2(enum gguf_type t, const uint8_t *bj, const uint8_t *bj4, __m256i *lo,
                                            __m256i *hi) {
    if (t == GGUF_TYPE_Q8_0) {
        *lo = quant_avx2_halves(bj + 2, bj4 + 2);
        *hi = quant_avx2_halves(bj + 18, bj4 + 18);
        return;
    }
    const int has_min = t == GGUF_TYPE_Q4_1 || t == GGUF_TYPE_Q5_1;
    const int five = t == GGUF_TYPE_Q5_0 || t == GGUF_TYPE_Q5_1;
    const int qs = t == GGUF_TYPE_MXFP4 ? 1 : 2 + 2 * has_min + 4 * five;
    const __m256i m4 = _mm256_set1_epi8(0x0f), v = quant_avx2_halves(bj + qs, bj4 + qs);
    *lo = _mm256_and_si256(v, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (t == GGUF_TYPE_IQ4_NL || t == GGUF_TYPE_MXFP4) {
        const int8_t *values = t == GGUF_TYPE_IQ4_NL ? quant_iq4nl_values : quant_mxfp4_offset_values;
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)values));
        *lo = _mm256_shuffle_epi8(table, *lo);
        *hi = _mm256_shuffle_epi8(table, *hi);
    }
    if (five) { /* bit 4 of element i is bit i of qh: bytes 0-1 of it for LO, 2-3 for HI */
        uint32_t hj, hj4;
        memcpy(&hj, bj + 2 + 2 * has_min, 4);
        memcpy(&hj4, bj4 + 2 + 2 * has_min, 4);
        const __m256i h = _mm256_set_m128i(_mm_set1_epi32((int)hj4), _mm_set1_epi32((int)hj));
        const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ULL), b5 = _mm256_set1_epi8(0x10);
        const __m256i lo_bytes = _mm256_set_epi64x(0x0101010101010101, 0, 0x0101010101010101, 0);
        const __m256i hi_bytes = _mm256_add_epi8(lo_bytes, _mm256_set1_epi8(2));
        const __m256i l = _mm256_and_si256(_mm256_shuffle_epi8(h, lo_bytes), bits);
        const __m256i u = _mm256_and_si256(_mm256_shuffle_epi8(h, hi_bytes), bits);
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_cmpeq_epi8(l, bits), b5));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_cmpeq_epi8(u, bits), b5));
    }
}

/* Σ q_w*q_x of the pair (LO, HI) against the activation's blocks at XJ and XJ4, lane by lane:
 * 16 int16 (each at most 2 * 2 * 31 * 127 = 15748), or 8 int32 for the signed types, whose
 * pairs reach 2 * 128 * 127. Q4_0/Q5_0 quants and MXFP4's values are still offset (the caller
 * subtracts 8/16/12 * Σq_x). */
QUANT_AVX2_INLINE __m256i quant_avx2_legacy_pair(enum gguf_type t, __m256i lo, __m256i hi, const int8_t *xj,
                                                 const int8_t *xj4) {
    const __m256i xl = quant_avx2_halves(xj, xj4), xh = quant_avx2_halves(xj + 16, xj4 + 16);
    if (t != GGUF_TYPE_Q8_0 && t != GGUF_TYPE_IQ4_NL)
        return _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_madd_epi16(quant_avx2_signed_pairs(lo, xl), ones),
                            _mm256_madd_epi16(quant_avx2_signed_pairs(hi, xh), ones));
}

/* Lane k = block k's sum, from the pairs' P[j] (quant_avx2_legacy_pair). Sums stay 16-bit as
 * long as they cannot wrap: 4 of 4-bit quants' P (4 * 2 * 2 * 15 * 127 = 30480), 2 of the
 * 5-bit ones' and MXFP4's. */
QUANT_AVX2_INLINE __m256i quant_avx2_legacy_sums(enum gguf_type t, const __m256i *p) {
    if (t == GGUF_TYPE_Q8_0 || t == GGUF_TYPE_IQ4_NL)
        return _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i a = _mm256_hadd_epi16(p[0], p[1]), b = _mm256_hadd_epi16(p[2], p[3]);
    if (t == GGUF_TYPE_Q4_0 || t == GGUF_TYPE_Q4_1) return _mm256_madd_epi16(_mm256_hadd_epi16(a, b), ones);
    return _mm256_hadd_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(b, ones));
}

/* fp16 fields at byte offset `off` of 8 consecutive blocks of `bb` bytes, as floats. */
QUANT_AVX2_INLINE __m256 quant_avx2_scales8(const uint8_t *b, int bb, int off) {
    __m128i h = _mm_set_epi16((short)quant_rd16(b + 7 * bb + off), (short)quant_rd16(b + 6 * bb + off),
                              (short)quant_rd16(b + 5 * bb + off), (short)quant_rd16(b + 4 * bb + off),
                              (short)quant_rd16(b + 3 * bb + off), (short)quant_rd16(b + 2 * bb + off),
                              (short)quant_rd16(b + 1 * bb + off), (short)quant_rd16(b + off));
    return _mm256_cvtph_ps(h);
}

/* quant_e8m0_half of the first byte of 8 consecutive blocks of `bb` bytes. */
QUANT_AVX2_INLINE __m256 quant_avx2_e8m0_half8(const uint8_t *b, int bb) {
    const __m256i e = _mm256_set_epi32(b[7 * bb], b[6 * bb], b[5 * bb], b[4 * bb], b[3 * bb], b[2 * bb], b[bb], b[0]);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, small));
}

/* Legacy dot of one row with NC columns (acts STRIDE apart, results y[c*ys]): groups of 8
 * blocks give one vector of unit results per column, added to its accumulator (g % 4), i.e.
 * partials b % 32; a tail of < 8 blocks goes through the scalar units. Every column takes the
 * single-column steps, so matmat gives matvec's bits. */
QUANT_AVX2_INLINE void quant_avx2_legacy(enum gguf_type t, const uint8_t *w, const uint8_t *acts, size_t stride,
                                         int64_t n, float *y, size_t ys, int NC) {
    const int bb = gguf_type_get(t)->block_bytes;
    const int has_min = t == GGUF_TYPE_Q4_1 || t == GGUF_TYPE_Q5_1;
    const int off = t == GGUF_TYPE_Q4_0 ? 8 : t == GGUF_TYPE_Q5_0 ? 16 : t == GGUF_TYPE_MXFP4 ? 12 : 0;
    const int64_t nb = n / QUANT_QK, nb8 = nb & ~(int64_t)7;
    struct quant_q8_view a[QUANT_AVX2_NCOL];
    __m256 acc[QUANT_AVX2_NCOL][4];
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        a[c] = quant_q8_view(acts + (size_t)c * stride, n);
        acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb8; b += 8) {
        const uint8_t *wb = w + b * bb;
        for (int q = 0; q < 8 * bb; q += 64) _mm_prefetch((const char *)wb + QUANT_PREFETCH + q, _MM_HINT_T0);
        __m256i lo[4], hi[4]; /* one column decodes as it goes: held 8 registers cost MXFP4 20% */
        QUANT_UNROLL(4)
        for (int j = 0; j < 4 && NC > 1; j++) quant_avx2_legacy_w2(t, wb + j * bb, wb + (j + 4) * bb, &lo[j], &hi[j]);
        const __m256 dw = t == GGUF_TYPE_MXFP4 ? quant_avx2_e8m0_half8(wb, bb) : quant_avx2_scales8(wb, bb, 0);
        const __m256 mw = has_min ? quant_avx2_scales8(wb, bb, 2) : _mm256_setzero_ps();
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) {
            __m256i p[4];
            QUANT_UNROLL(4)
            for (int j = 0; j < 4; j++) {
                if (NC == 1) quant_avx2_legacy_w2(t, wb + j * bb, wb + (j + 4) * bb, &lo[j], &hi[j]);
                const int8_t *xj = a[c].qs + (b + j) * QUANT_QK;
                p[j] = quant_avx2_legacy_pair(t, lo[j], hi[j], xj, xj + 4 * QUANT_QK);
            }
            __m256i isum = quant_avx2_legacy_sums(t, p);
            if (off) isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i *)(a[c].s + b)), _mm256_set1_epi32(off)));
            __m256 r = _mm256_mul_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(a[c].d + b)), _mm256_cvtepi32_ps(isum));
            if (has_min) r = _mm256_add_ps(r, _mm256_mul_ps(mw, _mm256_loadu_ps(a[c].sd + b)));
            quant_avx2_acc_add(acc[c], r);
        }
    }
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        if (nb8 == nb) { y[c * ys] = quant_avx2_reduce_rotated(acc[c], nb8 / 8); continue; }
        float p[QUANT_NPART];
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(p + 8 * ((nb8 / 8 + k) % 4), acc[c][k]);
        quant_legacy_units(t, w, a[c], nb8, nb, p);
        y[c * ys] = quant_reduce32(p);
    }
}

/* 8 weights of a float format as f32 (exact conversions). */
QUANT_AVX2_INLINE __m256 quant_avx2_load_w8(enum gguf_type t, const uint8_t *w) {
    if (t == GGUF_TYPE_F32) return _mm256_loadu_ps((const float *)w);
    __m128i h = _mm_loadu_si128((const __m128i *)w);
    if (t == GGUF_TYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Float row dot with NC (1 or 2) columns at ACTS, STRIDE apart: element i -> partial i % 32,
 * i.e. accumulator (i/8) % 4 of its column, lane i % 8. Each weight vector is converted once
 * for both columns; two columns' 8 accumulators and the 4 weight vectors fit the 16 registers,
 * where four columns would spill (rolled, the accumulators lived on the stack and F16 ran 60%
 * slower on Zen 1). */
QUANT_AVX2_INLINE void quant_avx2_float(enum gguf_type t, const uint8_t *w, const uint8_t *acts, size_t stride,
                                        int64_t n, float *y, size_t ys, int NC) {
    const int es = t == GGUF_TYPE_F32 ? 4 : 2;
    const int64_t n32 = n & ~(int64_t)31;
    __m256 acc[2][4];
    QUANT_UNROLL(2)
    for (int c = 0; c < NC; c++)
        for (int k = 0; k < 4; k++) acc[c][k] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n32; i += 32) {
        QUANT_UNROLL(4)
        for (int k = 0; k < 4; k++) {
            if (k % (4 / es) == 0) _mm_prefetch((const char *)w + (i + 8 * k) * es + QUANT_PREFETCH, _MM_HINT_T0);
            const __m256 wk = quant_avx2_load_w8(t, w + (i + 8 * k) * es);
            QUANT_UNROLL(2)
            for (int c = 0; c < NC; c++) {
                const float *x = (const float *)(acts + (size_t)c * stride);
                acc[c][k] = _mm256_add_ps(acc[c][k], _mm256_mul_ps(wk, _mm256_load_ps(x + i + 8 * k)));
            }
        }
    }
    QUANT_UNROLL(2)
    for (int c = 0; c < NC; c++) {
        if (n32 == n) {
            y[c * ys] = quant_avx2_reduce(acc[c][0], acc[c][1], acc[c][2], acc[c][3]);
            continue;
        }
        float p[QUANT_NPART];
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(p + 8 * k, acc[c][k]);
        quant_float_units(t, w, (const float *)(acts + (size_t)c * stride), n32, n, p);
        y[c * ys] = quant_reduce32(p);
    }
}

/* The K formats' scales multiply their int16 products (maddubs) in vpmaddwd, which Zen 1 runs
 * on one pipe at two cycles a vector, as the products themselves. So the products of 2 or 4
 * steps of 32 weights are first folded into one vector of sums (adds and unpacks, on the other
 * pipes), each 128-bit lane's qword or dword one step's, and one multiply applies their scales:
 * Q4_K 6% faster there. Sums of up to 4 products stay in int16 for quants of up to 5 bits (4 *
 * 2 * 31 * 127 = 31496); Q6_K's (6 bits: 2 * 2 * 63 * 127 = 32004) fold by 2 only. */

/* Steps A and B (16 int16 each) -> qword 0 of each lane from A, qword 1 from B. */
QUANT_AVX2_INLINE __m256i quant_avx2_fold2(__m256i a, __m256i b) {
    return _mm256_add_epi16(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
}

/* Steps A and B -> dwords 0 and 2 of each lane from A, 1 and 3 from B: fold4's first step. */
QUANT_AVX2_INLINE __m256i quant_avx2_fold32(__m256i a, __m256i b) {
    return _mm256_add_epi16(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}

/* Steps P[0..3] -> dword d of each lane from P[d]. */
QUANT_AVX2_INLINE __m256i quant_avx2_fold4(const __m256i *p) {
    return quant_avx2_fold2(quant_avx2_fold32(p[0], p[1]), quant_avx2_fold32(p[2], p[3]));
}

/* A vpshufb control for one qword: int16 j <- int16 I_j of the same 128-bit lane (bytes 2i and
 * 2i + 1). Closed form, so that constant indices fold to a constant. */
QUANT_AVX2_INLINE uint64_t quant_avx2_words(int i0, int i1, int i2, int i3) {
    return (uint64_t)(0x0202u * (unsigned)i0 + 0x0100u) | (uint64_t)(0x0202u * (unsigned)i1 + 0x0100u) << 16 |
           (uint64_t)(0x0202u * (unsigned)i2 + 0x0100u) << 32 | (uint64_t)(0x0202u * (unsigned)i3 + 0x0100u) << 48;
}

/* H's int16 (scales) picked by quant_avx2_words controls: the low lane's qwords by L0, L1, the
 * high lane's by H0, H1. */
QUANT_AVX2_INLINE __m256i quant_avx2_pick(__m256i h, uint64_t l0, uint64_t l1, uint64_t h0, uint64_t h1) {
    return _mm256_shuffle_epi8(h, _mm256_set_epi64x((long long)h1, (long long)h0, (long long)l1, (long long)l0));
}

/* The scales of a fold of Q4_K/Q5_K steps F..F+3 (quant_avx2_fold4; SC16: the 8 scales in both
 * lanes), or of Q6_K steps F, F+1 (quant_avx2_fold2; SC16: the 16 scales, step i's two 16-weight
 * halves' 2i and 2i + 1 in the low and high lane). */
QUANT_AVX2_INLINE __m256i quant_avx2_k_scales(enum gguf_type t, __m256i sc16, int f) {
    if (t != GGUF_TYPE_Q6_K) {
        const uint64_t a = quant_avx2_words(f, f, f + 1, f + 1), b = quant_avx2_words(f + 2, f + 2, f + 3, f + 3);
        return quant_avx2_pick(sc16, a, b, a, b);
    }
    const int k = 2 * (f % 4); /* within the lane-pair of scales 8 (f / 4) on */
    return quant_avx2_pick(quant_avx2_lane_twice(sc16, f / 4), quant_avx2_words(k, k, k, k),
                           quant_avx2_words(k + 2, k + 2, k + 2, k + 2), quant_avx2_words(k + 1, k + 1, k + 1, k + 1),
                           quant_avx2_words(k + 3, k + 3, k + 3, k + 3));
}

/* Each byte of V shifted so that its bit FROM lands on bit TO, then masked by MASK: the high
 * bits of Q5_K (one, to bit 4), Q6_K (two, to bits 4-5) and Q3_K (one, to bit 2) in place with
 * one 16-bit shift, where shift, mask, shift took two. Exact per byte as long as the bits kept
 * come from their own byte, as they do for these. Zen 1 shifts on one pipe, and they were Q6_K's
 * bottleneck there: 27.7 -> 24.3 ns a super-block (one core, in cache). */
QUANT_AVX2_INLINE __m256i quant_avx2_bits_to(__m256i v, int from, int to, int mask) {
    const __m256i shifted = from < to ? _mm256_slli_epi16(v, to - from) : from == to ? v : _mm256_srli_epi16(v, from - to);
    return _mm256_and_si256(shifted, _mm256_set1_epi8((char)mask));
}

/* Bits 2K and 2K + 1 of each byte of H (Q6_K's high bits of step K) at bits 4-5. Zen 1 shifts
 * on one pipe at ~1.7 cycles a vector, so the two that move bits up are byte lookups (the low
 * nibble of H -> its bits 2K, 2K + 1 at bits 4-5), and step 2's bits are already in place. */
QUANT_AVX2_INLINE __m256i quant_avx2_q6k_high(__m256i h, int k) {
    if (k == 2) return _mm256_and_si256(h, _mm256_set1_epi8(0x30));
    if (k == 3) return quant_avx2_bits_to(h, 6, 4, 0x30);
    /* entry i: (i & 3) << 4 for step 0, (i >> 2) << 4 for step 1 */
    const __m256i table = k == 0 ? _mm256_set1_epi64x(0x3020100030201000LL)
                                 : _mm256_set_epi64x(0x3030303020202020LL, 0x1010101000000000LL, 0x3030303020202020LL, 0x1010101000000000LL);
    return _mm256_shuffle_epi8(table, _mm256_and_si256(h, _mm256_set1_epi8(0x0f)));
}

/* Q4_K/Q5_K integer part, 8 lanes summing to Σ_j sc_j * Σ q*x (sc_j = byte j of sc): the scales
 * applied with madd on folds of 4 steps' int16 products (quant_avx2_fold4; the scales' layout
 * is Q4_K's and Q5_K's alike). */
QUANT_AVX2_INLINE __m256i quant_q45k_isum_avx2(const uint8_t *b, const int8_t *qx, uint64_t sc, int five) {
    const uint8_t *ql = b + 16 + (five ? 32 : 0);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
    __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
    __m256i acc = _mm256_setzero_si256();
    #pragma GCC unroll 2
    for (int g = 0; g < 2; g++) {
        __m256i p[4];
        #pragma GCC unroll 2
        for (int h = 0; h < 2; h++) { /* 64 weights: steps 2j (low nibbles) and 2j + 1 (high) */
            const int j = 2 * g + h;
            __m256i q = _mm256_loadu_si256((const __m256i *)(ql + 32 * j));
            __m256i q0 = _mm256_and_si256(q, m4), q1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if (five) {
                q0 = _mm256_or_si256(q0, quant_avx2_bits_to(qh, 2 * j, 4, 0x10));
                q1 = _mm256_or_si256(q1, quant_avx2_bits_to(qh, 2 * j + 1, 4, 0x10));
            }
            p[2 * h] = _mm256_maddubs_epi16(q0, _mm256_load_si256((const __m256i *)(qx + 64 * j)));
            p[2 * h + 1] = _mm256_maddubs_epi16(q1, _mm256_load_si256((const __m256i *)(qx + 64 * j + 32)));
        }
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(quant_avx2_fold4(p), quant_avx2_k_scales(GGUF_TYPE_Q4_K, sc16, 4 * g)));
    }
    return acc;
}

/* Q6_K integer part before the offset, 8 lanes summing to Σ_j sc_j * Σ q*x with q unsigned
 * (0..63); SC holds the 16 scales as int16. */
QUANT_AVX2_INLINE __m256i quant_q6k_isum_avx2(const uint8_t *b, const int8_t *qx, __m256i sc) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i acc = _mm256_setzero_si256();
    #pragma GCC unroll 2
    for (int c = 0; c < 2; c++) {
        const uint8_t *ql = b + 64 * c, *qhp = b + 128 + 32 * c;
        __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
        __m256i h = _mm256_loadu_si256((const __m256i *)qhp);
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), quant_avx2_q6k_high(h, 0));
        q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), quant_avx2_q6k_high(h, 1));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), quant_avx2_q6k_high(h, 2));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), quant_avx2_q6k_high(h, 3));
        #pragma GCC unroll 2
        for (int k = 0; k < 4; k += 2) {
            const int8_t *x = qx + 128 * c + 32 * k;
            const __m256i p0 = _mm256_maddubs_epi16(q[k], _mm256_load_si256((const __m256i *)x));
            const __m256i p1 = _mm256_maddubs_epi16(q[k + 1], _mm256_load_si256((const __m256i *)(x + 32)));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(quant_avx2_fold2(p0, p1), quant_avx2_k_scales(GGUF_TYPE_Q6_K, sc, 4 * c + k)));
        }
    }
    return acc;
}

/* Q2_K / Q3_K integer parts with unsigned quants q' (Q2_K: q, 0..3; Q3_K: q + 4, 0..7, i.e. the
 * hmask bit as the third bit) for NC columns at QX[c]: ACC[c]'s 8 lanes sum to Σ_g sc_g * Σ_{16
 * in g} q'*x; SC holds the 16 scales as int16. Each half's quants are decoded once for all the
 * columns. quant_avx2_q23k_finish takes off Q3_K's offset and gives Q2_K's min term. */
QUANT_AVX2_INLINE void quant_q23k_isums_avx2(enum gguf_type t, const uint8_t *b, const int8_t *const *qx, int NC,
                                             __m256i sc, __m256i *acc) {
    const int three = t == GGUF_TYPE_Q3_K;
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i half[2] = { quant_avx2_lane_twice(sc, 0), quant_avx2_lane_twice(sc, 1) };
    const __m256i hbits = three ? _mm256_loadu_si256((const __m256i *)b) : _mm256_setzero_si256();
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_si256();
    #pragma GCC unroll 2
    for (int n = 0; n < 2; n++) {
        __m256i q2 = _mm256_loadu_si256((const __m256i *)(b + (three ? 32 : 16) + 32 * n)), q[4];
        #pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            /* step (n, k) takes bits 2k of the quants and bit 4n + k of hmask */
            q[k] = _mm256_and_si256(q2, m3);
            q2 = _mm256_srli_epi16(q2, 2);
            if (three) q[k] = _mm256_or_si256(q[k], quant_avx2_bits_to(hbits, 4 * n + k, 2, 0x04));
        }
        /* step k's 16-weight halves have scales 2k (low lane) and 2k + 1 (high) of half n */
        const __m256i sc_n = quant_avx2_pick(half[n], quant_avx2_words(0, 0, 2, 2), quant_avx2_words(4, 4, 6, 6),
                                             quant_avx2_words(1, 1, 3, 3), quant_avx2_words(5, 5, 7, 7));
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) {
            __m256i p[4];
            #pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                p[k] = _mm256_maddubs_epi16(q[k], _mm256_load_si256((const __m256i *)(qx[c] + 128 * n + 32 * k)));
            acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(quant_avx2_fold4(p), sc_n));
        }
    }
}

/* quant_q3k_scales in SIMD, as 16 int16: of the 12 bytes at P, bytes 0-7 hold the low nibbles
 * (scales 0-7 low, 8-15 high), bytes 8-11 the top 2 bits of all 16. The 16-byte load starts 4
 * bytes early, inside the block, so that it ends inside it too. */
QUANT_AVX2_INLINE __m256i quant_avx2_q3k_scales(const uint8_t *p) {
    const __m128i v = _mm_srli_si128(_mm_loadu_si128((const __m128i *)(p - 4)), 4);
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, 0x44), _mm_set_epi32(4, 4, 0, 0)),
                                     _mm_set1_epi8(0x0f));
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, 0xaa), _mm_set_epi32(6, 4, 2, 0)),
                                     _mm_set1_epi8(3));
    return _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi32(hi, 4)), _mm_set1_epi8(32)));
}

/* The 16 scales of a Q2_K / Q3_K super-block as int16 (*SC), and Q2_K's 16 mins (*MINS). */
QUANT_AVX2_INLINE void quant_avx2_q23k_scales(enum gguf_type t, const uint8_t *b, __m256i *sc, __m256i *mins) {
    if (t == GGUF_TYPE_Q3_K) {
        *sc = quant_avx2_q3k_scales(b + 96);
        *mins = _mm256_setzero_si256();
        return;
    }
    const __m128i packed = _mm_loadu_si128((const __m128i *)b), m4 = _mm_set1_epi8(0x0f);
    *sc = _mm256_cvtepu8_epi16(_mm_and_si128(packed, m4));
    *mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), m4));
}

/* A column's Q2_K / Q3_K integer parts from its quant_q23k_isums_avx2 sum and its 16 bsums BS:
 * Q3_K's offset of 4 comes off as 4 * Σ sc_g * bsum_g; Q2_K's min term is Σ min_g * bsum_g. */
QUANT_AVX2_INLINE void quant_avx2_q23k_finish(enum gguf_type t, __m256i isum, __m256i bs, __m256i sc, __m256i mins,
                                              __m256i *is, __m256i *sm) {
    if (t == GGUF_TYPE_Q3_K) {
        *is = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_madd_epi16(bs, sc), 2));
        *sm = _mm256_setzero_si256();
    } else {
        *is = isum;
        *sm = _mm256_madd_epi16(bs, mins);
    }
}

/* The stored signs of an IQ3_S 32-block (4 bytes at S, bit j of byte l for weight 8l+j) as
 * bytes -1 / +1 in weight order. */
QUANT_AVX2_INLINE __m256i quant_avx2_iq3s_signs(const uint8_t *s) {
    uint32_t bits;
    memcpy(&bits, s, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303ll, 0x0202020202020202ll, 0x0101010101010101ll, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(1));
}

/* IQ4_XS integer parts for NC columns at QX[c]: ACC[c]'s 8 lanes sum to quant_iq_isum_scalar's,
 * 32-blocks of the table's signed values times the 32-block's integer scale. One 32-byte load
 * holds blocks k and k + 1 in its lanes, their low nibbles weights 0-15 and high nibbles 16-31,
 * decoded once for all the columns, so each column's x comes in those halves (for 16 columns
 * as fast as blocks decoded in element order, and one column 5% faster). The values reach 127,
 * so each product takes its own scale multiply. */
QUANT_AVX2_INLINE void quant_iq4xs_isums_avx2(const uint8_t *b, const int8_t *const *qx, int NC, __m256i *acc) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)quant_iq4nl_values));
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_si256();
    #pragma GCC unroll 4
    for (int k = 0; k < 8; k += 2) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 8 + 16 * k));
        const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, m4));
        const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        const __m256i alo = _mm256_sign_epi8(lo, lo), ahi = _mm256_sign_epi8(hi, hi);
        const __m256i scales = _mm256_inserti128_si256(_mm256_set1_epi16((short)quant_iq4xs_scale(b, k)),
                                                        _mm_set1_epi16((short)quant_iq4xs_scale(b, k + 1)), 1);
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) {
            const int8_t *x = qx[c] + 32 * k;
            const __m256i pl = _mm256_maddubs_epi16(alo, _mm256_sign_epi8(quant_avx2_halves(x, x + 32), lo));
            const __m256i ph = _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(quant_avx2_halves(x + 16, x + 48), hi));
            acc[c] = _mm256_add_epi32(acc[c], _mm256_add_epi32(_mm256_madd_epi16(pl, scales), _mm256_madd_epi16(ph, scales)));
        }
    }
}

/* The 8 grid points of an IQ3_XXS 32-block from its 8 index bytes Q (one load; the bytes come
 * apart in integer registers, where 8 byte loads took the load ports the grid needs). */
QUANT_AVX2_INLINE __m256i quant_avx2_iq3xxs_points(uint64_t q) {
    const uint32_t *g = quant_iq3xxs_grid;
    return _mm256_set_epi32((int)g[q >> 56], (int)g[q >> 48 & 255], (int)g[q >> 40 & 255], (int)g[q >> 32 & 255],
                            (int)g[q >> 24 & 255], (int)g[q >> 16 & 255], (int)g[q >> 8 & 255], (int)g[q & 255]);
}

/* IQ3_XXS integer parts for NC columns at QX[c], ACC[c]'s 8 lanes summing to
 * quant_iq_isum_scalar's; each 32-block's points and signs are decoded once for all the columns.
 * Its points are at most 62, so two 32-blocks' products add in int16 (2 * 2 * 62 * 127 = 31496)
 * and one multiply applies both scales (2 s + 1, from the top 4 bits of each block's word), as
 * quant_avx2_fold2 lays them out. */
QUANT_AVX2_INLINE void quant_iq3xxs_isums_avx2(const uint8_t *b, const int8_t *const *qx, int NC, __m256i *acc) {
    const __m256i words = _mm256_loadu_si256((const __m256i *)(b + 66));
    const __m256i sc = _mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(words, 28), 1), _mm256_set1_epi32(1));
    const __m256i half[2] = { quant_avx2_lane_twice(sc, 0), quant_avx2_lane_twice(sc, 1) };
    __m256i first[QUANT_AVX2_NCOL]; /* each column's product of the even block, until its odd one */
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_si256();
    #pragma GCC unroll 8
    for (int ib = 0; ib < 8; ib++) {
        uint64_t q;
        uint32_t aux;
        memcpy(&q, b + 2 + 8 * ib, 8);
        memcpy(&aux, b + 66 + 4 * ib, 4);
        const uint64_t *sb = quant_iq_sign_bytes;
        const __m256i sign = _mm256_set_epi64x((long long)sb[aux >> 21 & 127], (long long)sb[aux >> 14 & 127],
                                               (long long)sb[aux >> 7 & 127], (long long)sb[aux & 127]);
        const __m256i points = quant_avx2_iq3xxs_points(q);
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) {
            const __m256i x = _mm256_load_si256((const __m256i *)(qx[c] + 32 * ib));
            const __m256i p = _mm256_maddubs_epi16(points, _mm256_sign_epi8(x, sign));
            if (ib % 2 == 0) {
                first[c] = p;
            } else {
                const int k = ib % 4 - 1;
                const uint64_t lo = quant_avx2_words(2 * k, 2 * k, 2 * k, 2 * k);
                const uint64_t hi = quant_avx2_words(2 * k + 2, 2 * k + 2, 2 * k + 2, 2 * k + 2);
                const __m256i scales = quant_avx2_pick(half[ib / 4], lo, hi, lo, hi);
                acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(quant_avx2_fold2(first[c], p), scales));
            }
        }
    }
}

/* The grid points of an IQ3_S 32-block IB: its 8 qs bytes with bit j of its qh byte as bit 8
 * of index j. The qh bits move into two words of four 16-bit indices (even and odd j) by a
 * multiply: bit 2k lands at 16k + 8 and the cross terms at bits that are not (2a + 8 + 14b,
 * all apart), so nothing carries. */
QUANT_AVX2_INLINE __m256i quant_avx2_iq3s_grid8(const uint8_t *b, int ib) {
    const uint64_t spread = (1ull << 8) + (1ull << 22) + (1ull << 36) + (1ull << 50), at8 = 0x0100010001000100ull;
    const uint64_t byte16 = 0x00ff00ff00ff00ffull, h = b[QUANT_IQ3S_QH + ib];
    uint64_t q;
    memcpy(&q, b + 2 + 8 * ib, 8);
    const uint64_t even = (q & byte16) | ((h & 0x55) * spread & at8);
    const uint64_t odd = (q >> 8 & byte16) | ((h >> 1 & 0x55) * spread & at8);
    const uint32_t *g = quant_iq3s_grid;
    return _mm256_set_epi32((int)g[odd >> 48], (int)g[even >> 48], (int)g[odd >> 32 & 0xffff],
                            (int)g[even >> 32 & 0xffff], (int)g[odd >> 16 & 0xffff], (int)g[even >> 16 & 0xffff],
                            (int)g[odd & 0xffff], (int)g[even & 0xffff]);
}

/* IQ3_S integer parts for NC columns at QX[c], ACC[c]'s 8 lanes summing to
 * quant_iq_isum_scalar's; each 32-block's points and signs are decoded once for all the columns.
 * Its points are at most 15, so four 32-blocks' products add in int16 (4 * 2 * 15 * 127 = 15240)
 * and one multiply applies their scales (2 s + 1), as quant_avx2_fold4 lays them out (its first
 * step taken as each pair of products comes, so that a column holds two vectors, not four). */
QUANT_AVX2_INLINE void quant_iq3s_isums_avx2(const uint8_t *b, const int8_t *const *qx, int NC, __m256i *acc) {
    uint32_t packed;
    memcpy(&packed, b + QUANT_IQ3S_SCALES, 4);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i s = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)packed), shifts), _mm256_set1_epi32(15));
    const __m256i sc = _mm256_or_si256(_mm256_slli_epi32(s, 1), _mm256_set1_epi32(1)); /* block k's in dword k */
    __m256i even[QUANT_AVX2_NCOL], pair[QUANT_AVX2_NCOL]; /* a column's last even product; its first pair's fold */
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_si256();
    #pragma GCC unroll 8
    for (int ib = 0; ib < 8; ib++) {
        const __m256i sign = quant_avx2_iq3s_signs(b + QUANT_IQ3S_SIGNS + 4 * ib);
        const __m256i points = quant_avx2_iq3s_grid8(b, ib);
        const uint64_t lo = quant_avx2_words(0, 0, 2, 2), hi = quant_avx2_words(4, 4, 6, 6);
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) {
            const __m256i x = _mm256_load_si256((const __m256i *)(qx[c] + 32 * ib));
            const __m256i p = _mm256_maddubs_epi16(points, _mm256_sign_epi8(x, sign));
            if (ib % 2 == 0) {
                even[c] = p;
            } else if (ib % 4 == 1) {
                pair[c] = quant_avx2_fold32(even[c], p);
            } else {
                const __m256i scales = quant_avx2_pick(quant_avx2_lane_twice(sc, ib / 4), lo, hi, lo, hi);
                acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(quant_avx2_fold2(pair[c], quant_avx2_fold32(even[c], p)), scales));
            }
        }
    }
}

QUANT_SHARED_INLINE int quant_avx2_iq(enum gguf_type t) { return t == GGUF_TYPE_IQ4_XS || t == GGUF_TYPE_IQ3_XXS || t == GGUF_TYPE_IQ3_S; }

/* An IQ4_XS, IQ3_XXS or IQ3_S super-block's integer parts for NC columns. */
QUANT_AVX2_INLINE void quant_avx2_iq_isums(enum gguf_type t, const uint8_t *b, const int8_t *const *qx, int NC, __m256i *acc) {
    if (t == GGUF_TYPE_IQ4_XS) quant_iq4xs_isums_avx2(b, qx, NC, acc);
    else if (t == GGUF_TYPE_IQ3_XXS) quant_iq3xxs_isums_avx2(b, qx, NC, acc);
    else quant_iq3s_isums_avx2(b, qx, NC, acc);
}

/* One K-like super-block's integer parts, 8 lanes each: *isum's lanes sum to the isum of
 * quant_dot_k's float step, *summ's to its min term (Q4_K, Q5_K, Q2_K; else zero). Q6_K's
 * offset of 32 and Q3_K's of 4 come off here, as that many times Σ sc_g * bsum_g. */
QUANT_AVX2_INLINE void quant_avx2_k_ints(enum gguf_type t, const uint8_t *b, const int8_t *qx, const int16_t *bsums,
                                         __m256i *isum, __m256i *summ) {
    const __m256i bs = _mm256_loadu_si256((const __m256i *)bsums);
    *summ = _mm256_setzero_si256();
    if (t == GGUF_TYPE_Q6_K) {
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
        *isum = _mm256_sub_epi32(quant_q6k_isum_avx2(b, qx, sc), _mm256_slli_epi32(_mm256_madd_epi16(bs, sc), 5));
    } else if (t == GGUF_TYPE_Q2_K || t == GGUF_TYPE_Q3_K) {
        __m256i sc, mins, acc;
        quant_avx2_q23k_scales(t, b, &sc, &mins);
        quant_q23k_isums_avx2(t, b, &qx, 1, sc, &acc);
        quant_avx2_q23k_finish(t, acc, bs, sc, mins, isum, summ);
    } else if (quant_avx2_iq(t)) {
        quant_avx2_iq_isums(t, b, &qx, 1, isum);
    } else {
        uint64_t sc, mn;
        quant_k4_unpack(b + 4, &sc, &mn);
        const __m128i m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn));
        *summ = _mm256_madd_epi16(bs, _mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16)));
        *isum = quant_q45k_isum_avx2(b, qx, sc, t == GGUF_TYPE_Q5_K);
    }
}

/* Slot K of the group at unit U: super-block U + K's integer parts (prefetching ahead), or
 * zeros from COUNT on. */
QUANT_AVX2_INLINE void quant_avx2_k_slot(enum gguf_type t, const uint8_t *wb, int bb, struct quant_q8k_view a,
                                         int64_t u, int k, int count, __m256i *is, __m256i *sm) {
    is[k] = sm[k] = _mm256_setzero_si256();
    if (k >= count) return;
    for (int q = 0; q < bb; q += 64) _mm_prefetch((const char *)wb + k * bb + QUANT_PREFETCH + q, _MM_HINT_T0);
    quant_avx2_k_ints(t, wb + k * bb, a.qs + (u + k) * QUANT_QK_K, a.bsums + (u + k) * 16, &is[k], &sm[k]);
}

/* All ones in the first COUNT (0..8) of 8 lanes, loaded from quant_avx2_lane_ones + 8 - COUNT. */
static const int32_t quant_avx2_lane_ones[16] = { -1, -1, -1, -1, -1, -1, -1, -1 };

/* The fp16 fields at byte OFF of a group's blocks, as floats: lane l = block l % 2^SHIFT of row
 * l >> SHIFT (rows RB bytes apart from B, blocks BB); the lanes past NR rows or past PER blocks
 * of a row +0, and only the blocks in the group are read. Inlined with constant shape, the
 * tests fold away. */
QUANT_AVX2_INLINE __m256 quant_avx2_group_scales(const uint8_t *b, size_t rb, int bb, int shift, int nr,
                                                 int per, int off) {
    uint64_t lo = 0, hi = 0;
    #pragma GCC unroll 8
    for (int l = 0; l < 8; l++) {
        const int i = l >> shift, k = l & ((1 << shift) - 1);
        const uint64_t h = i < nr && k < per ? quant_rd16(b + (size_t)i * rb + (size_t)k * bb + off) : 0;
        if (l < 4) lo |= h << 16 * l;
        else hi |= h << 16 * (l - 4);
    }
    return _mm256_cvtph_ps(_mm_set_epi64x((long long)hi, (long long)lo));
}

/* K-quant row dot: groups of 8 super-blocks (the last may be short) give one vector of unit
 * results, lane k = unit u + k, added to accumulator (u/8) % 4, i.e. partials u % 32, with
 * quant_dot_k's float steps in each lane. A short group's empty lanes hold +0 (d, dx and the
 * integer parts zero), and a partial plus +0 is the partial: the scalar bits either way. No
 * scalar helper is called (an SSE call from AVX code pays transitions: it made Q6_K 4x slower). */
QUANT_AVX2_INLINE float quant_avx2_k(enum gguf_type t, const uint8_t *w, const void *act, int64_t n) {
    struct quant_q8k_view a = quant_q8k_view(act, n);
    const int bb = gguf_type_get(t)->block_bytes;
    const int has_min = quant_k_has_min(t), doff = quant_k_d_offset(t);
    const int64_t nu = n / QUANT_QK_K;
    __m256 acc[4] = { _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps() };
    for (int64_t u = 0; u < nu; u += 8) {
        const int count = nu - u < 8 ? (int)(nu - u) : 8;
        const uint8_t *wb = w + u * bb;
        __m256i is[8], sm[8];
        if (t == GGUF_TYPE_IQ3_XXS || t == GGUF_TYPE_IQ3_S) {
            /* ~390 instructions a super-block: unrolled 8 times they overflow the op cache */
            for (int k = 0; k < 8; k++) quant_avx2_k_slot(t, wb, bb, a, u, k, count, is, sm);
        } else {
            QUANT_GROUP_UNROLL
            for (int k = 0; k < 8; k++) quant_avx2_k_slot(t, wb, bb, a, u, k, count, is, sm);
        }
        /* dx of the group's units; past them the load reads the act's bsums, which follow d */
        const __m256 dx = _mm256_and_ps(_mm256_loadu_ps(a.d + u), _mm256_loadu_ps((const float *)(quant_avx2_lane_ones + 8 - count)));
        const __m256 d = count == 8 ? quant_avx2_scales8(wb, bb, doff) : quant_avx2_group_scales(wb, 0, bb, 3, 1, count, doff);
        __m256 r = _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(quant_avx2_hsum_upto8(is, count)));
        if (has_min) {
            const __m256 dmin = count == 8 ? quant_avx2_scales8(wb, bb, doff + 2)
                                           : quant_avx2_group_scales(wb, 0, bb, 3, 1, count, doff + 2);
            r = _mm256_sub_ps(r, _mm256_mul_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(quant_avx2_hsum_upto8(sm, count))));
        }
        if (t == GGUF_TYPE_IQ3_XXS) r = _mm256_mul_ps(r, _mm256_set1_ps(0.25f));
        quant_avx2_acc_add(acc, r);
    }
    return quant_avx2_reduce_rotated(acc, (nu + 7) / 8);
}

/* Step I (0..7: weights 32 I..32 I+31) of a Q4_K, Q5_K or Q6_K super-block B: its unsigned
 * quants. Inlined with a constant I, the loads it repeats fold. */
QUANT_AVX2_INLINE __m256i quant_avx2_k_step(enum gguf_type t, const uint8_t *b, int i) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    if (t == GGUF_TYPE_Q6_K) {
        const int c = i / 4, k = i % 4;
        const __m256i l = _mm256_loadu_si256((const __m256i *)(b + 64 * c + 32 * (k & 1)));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * c));
        const __m256i lo = k < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
        return _mm256_or_si256(lo, quant_avx2_q6k_high(h, k));
    }
    const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + (t == GGUF_TYPE_Q5_K ? 32 : 0) + 32 * (i / 2)));
    __m256i v = i % 2 ? _mm256_and_si256(_mm256_srli_epi16(q, 4), m4) : _mm256_and_si256(q, m4);
    if (t == GGUF_TYPE_Q5_K) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        v = _mm256_or_si256(v, quant_avx2_bits_to(qh, i, 4, 0x10));
    }
    return v;
}

/* quant_avx2_k_ints_cols for Q2_K / Q3_K. */
QUANT_AVX2_INLINE void quant_avx2_q23k_ints_cols(enum gguf_type t, const uint8_t *b, const struct quant_q8k_view *a, int64_t u,
                                                 int k, __m256i (*is)[8], __m256i (*sm)[8], int NC) {
    __m256i sc, mins, acc[QUANT_AVX2_NCOL];
    const int8_t *qx[QUANT_AVX2_NCOL];
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) qx[c] = a[c].qs + u * QUANT_QK_K;
    quant_avx2_q23k_scales(t, b, &sc, &mins);
    quant_q23k_isums_avx2(t, b, qx, NC, sc, acc);
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        const __m256i bs = _mm256_loadu_si256((const __m256i *)(a[c].bsums + u * 16));
        quant_avx2_q23k_finish(t, acc[c], bs, sc, mins, &is[c][k], &sm[c][k]);
    }
}

/* quant_avx2_k_ints of super-block B (unit U) for NC columns A, into is[c][k] and sm[c][k],
 * each step decoded once for all: the same integers per column (in other lanes: exact sums). */
QUANT_AVX2_INLINE void quant_avx2_k_ints_cols(enum gguf_type t, const uint8_t *b, const struct quant_q8k_view *a, int64_t u,
                                              int k, __m256i (*is)[8], __m256i (*sm)[8], int NC) {
    if (t == GGUF_TYPE_Q2_K || t == GGUF_TYPE_Q3_K) {
        quant_avx2_q23k_ints_cols(t, b, a, u, k, is, sm, NC);
        return;
    }
    if (quant_avx2_iq(t)) {
        const int8_t *qx[QUANT_AVX2_NCOL];
        __m256i acc[QUANT_AVX2_NCOL];
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) qx[c] = a[c].qs + u * QUANT_QK_K;
        quant_avx2_iq_isums(t, b, qx, NC, acc);
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) {
            is[c][k] = acc[c];
            sm[c][k] = _mm256_setzero_si256();
        }
        return;
    }
    __m256i sc16, bs_mul, acc[QUANT_AVX2_NCOL];
    if (t == GGUF_TYPE_Q6_K) {
        sc16 = bs_mul = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    } else {
        uint64_t sc, mn;
        quant_k4_unpack(b + 4, &sc, &mn);
        const __m128i m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn));
        sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
        bs_mul = _mm256_set_m128i(_mm_unpackhi_epi16(m16, m16), _mm_unpacklo_epi16(m16, m16));
    }
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_si256();
    const int per = t == GGUF_TYPE_Q6_K ? 2 : 4; /* steps to a fold */
    QUANT_UNROLL(4)
    for (int f = 0; f < 8; f += per) {
        __m256i q[4];
        QUANT_UNROLL(4)
        for (int h = 0; h < per; h++) q[h] = quant_avx2_k_step(t, b, f + h);
        const __m256i sc = quant_avx2_k_scales(t, sc16, f);
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) {
            __m256i p[4];
            QUANT_UNROLL(4)
            for (int h = 0; h < per; h++)
                p[h] = _mm256_maddubs_epi16(q[h], _mm256_load_si256((const __m256i *)(a[c].qs + u * QUANT_QK_K + 32 * (f + h))));
            acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(per == 2 ? quant_avx2_fold2(p[0], p[1]) : quant_avx2_fold4(p), sc));
        }
    }
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        const __m256i bs = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(a[c].bsums + u * 16)), bs_mul);
        is[c][k] = t == GGUF_TYPE_Q6_K ? _mm256_sub_epi32(acc[c], _mm256_slli_epi32(bs, 5)) : acc[c];
        sm[c][k] = t == GGUF_TYPE_Q6_K ? _mm256_setzero_si256() : bs;
    }
}

/* The float steps of one group of COUNT (1..8) super-blocks at unit U for NC columns (both
 * levels' multi-column K kernels): each column's integer parts IS and SM to unit results, lane
 * k = unit u + k (+0 past COUNT), added to its accumulators ACC as quant_avx2_k adds them. */
QUANT_AVX2_INLINE void quant_avx2_group_finish(enum gguf_type t, const uint8_t *wb, int bb, int count,
                                               const struct quant_q8k_view *a, int64_t u, __m256i (*is)[8],
                                               __m256i (*sm)[8], __m256 (*acc)[4], int NC) {
    const int has_min = quant_k_has_min(t), doff = quant_k_d_offset(t);
    /* dx of the group's units; past them the load reads the act's bsums, which follow d */
    const __m256 lanes = _mm256_loadu_ps((const float *)(quant_avx2_lane_ones + 8 - count));
    const __m256 d = count == 8 ? quant_avx2_scales8(wb, bb, doff) : quant_avx2_group_scales(wb, 0, bb, 3, 1, count, doff);
    const __m256 dmin = !has_min ? d : count == 8 ? quant_avx2_scales8(wb, bb, doff + 2) : quant_avx2_group_scales(wb, 0, bb, 3, 1, count, doff + 2);
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        const __m256 dx = _mm256_and_ps(_mm256_loadu_ps(a[c].d + u), lanes);
        __m256 r = _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(quant_avx2_hsum_upto8(is[c], count)));
        if (has_min) r = _mm256_sub_ps(r, _mm256_mul_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(quant_avx2_hsum_upto8(sm[c], count))));
        if (t == GGUF_TYPE_IQ3_XXS) r = _mm256_mul_ps(r, _mm256_set1_ps(0.25f));
        quant_avx2_acc_add(acc[c], r);
    }
}

/* K or IQ (IQ4_XS, IQ3_XXS, IQ3_S) dot of one row with NC (2..QUANT_AVX2_NCOL) columns:
 * quant_avx2_k's steps for every column, each super-block step decoded once for all of them. */
QUANT_AVX2_INLINE void quant_avx2_k_cols(enum gguf_type t, const uint8_t *w, const uint8_t *acts, size_t stride, int64_t n,
                                         float *y, size_t ys, int NC) {
    const int bb = gguf_type_get(t)->block_bytes;
    const int64_t nu = n / QUANT_QK_K;
    struct quant_q8k_view a[QUANT_AVX2_NCOL];
    __m256 acc[QUANT_AVX2_NCOL][4];
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        a[c] = quant_q8k_view(acts + (size_t)c * stride, n);
        acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = _mm256_setzero_ps();
    }
    for (int64_t u = 0; u < nu; u += 8) {
        const int count = nu - u < 8 ? (int)(nu - u) : 8;
        const uint8_t *wb = w + u * bb;
        __m256i is[QUANT_AVX2_NCOL][8], sm[QUANT_AVX2_NCOL][8];
        for (int k = 0; k < 8; k++) {
            if (k >= count) {
                for (int c = 0; c < NC; c++) is[c][k] = sm[c][k] = _mm256_setzero_si256();
                continue;
            }
            for (int q = 0; q < bb; q += 64) _mm_prefetch((const char *)wb + k * bb + QUANT_PREFETCH + q, _MM_HINT_T0);
            quant_avx2_k_ints_cols(t, wb + k * bb, a, u + k, k, is, sm, NC);
        }
        quant_avx2_group_finish(t, wb, bb, count, a, u, is, sm, acc, NC);
    }
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) y[c * ys] = quant_avx2_reduce_rotated(acc[c], (nu + 7) / 8);
}

/* Lane L of a group of quant_avx2_k_rows: super-block L % 2 of row L / 2, or zero integer parts
 * past the group's NR rows. */
QUANT_AVX2_INLINE void quant_avx2_pairs_lane(enum gguf_type t, const uint8_t *wr, size_t rb, int bb, struct quant_q8k_view a,
                                             int nr, int l, __m256i *is, __m256i *sm) {
    const int i = l / 2, k = l % 2;
    is[l] = sm[l] = _mm256_setzero_si256();
    if (i < nr) quant_avx2_k_ints(t, wr + (size_t)i * rb + (size_t)k * bb, a.qs + k * QUANT_QK_K, a.bsums + k * 16, &is[l], &sm[l]);
}

/* The float steps of a group of quant_avx2_pairs_group (both levels): the integer parts IS and
 * SM of NR rows' 2 super-blocks each in lanes 2 * row + unit, to the row results in Y. */
QUANT_AVX2_INLINE void quant_avx2_pairs_finish(enum gguf_type t, const uint8_t *wr, size_t rb, int nr, __m256 dx,
                                               const __m256i *is, const __m256i *sm, float *y) {
    const int bb = gguf_type_get(t)->block_bytes, doff = quant_k_d_offset(t);
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(quant_avx2_group_scales(wr, rb, bb, 1, nr, 2, doff), dx), _mm256_cvtepi32_ps(quant_avx2_hsum8(is)));
    if (quant_k_has_min(t))
        v = _mm256_sub_ps(v, _mm256_mul_ps(_mm256_mul_ps(quant_avx2_group_scales(wr, rb, bb, 1, nr, 2, doff + 2), dx),
                                           _mm256_cvtepi32_ps(quant_avx2_hsum8(sm))));
    if (t == GGUF_TYPE_IQ3_XXS) v = _mm256_mul_ps(v, _mm256_set1_ps(0.25f));
    v = _mm256_add_ps(_mm256_setzero_ps(), v);       /* the partials p[0], p[1] of each row */
    v = _mm256_add_ps(v, _mm256_movehdup_ps(v));      /* the butterfly's last step, p[0] + p[1] */
    float out[8];
    _mm256_storeu_ps(out, v);
    for (int i = 0; i < nr; i++) y[i] = out[2 * i];
}

/* NR (1..4) rows of 2 super-blocks from WR, in lanes 2 * row + unit; the row results go to Y. */
QUANT_AVX2_INLINE void quant_avx2_pairs_group(enum gguf_type t, const uint8_t *wr, size_t rb, struct quant_q8k_view a,
                                              __m256 dx, int nr, float *y) {
    const int bb = gguf_type_get(t)->block_bytes;
    __m256i is[8], sm[8];
    for (size_t q = 0; q < (size_t)nr * rb; q += 64) _mm_prefetch((const char *)wr + QUANT_PREFETCH + q, _MM_HINT_T0);
    if (t == GGUF_TYPE_IQ3_XXS || t == GGUF_TYPE_IQ3_S) { /* as in quant_avx2_k: too long a body to unroll */
        for (int l = 0; l < 8; l++) quant_avx2_pairs_lane(t, wr, rb, bb, a, nr, l, is, sm);
    } else {
        QUANT_GROUP_UNROLL
        for (int l = 0; l < 8; l++) quant_avx2_pairs_lane(t, wr, rb, bb, a, nr, l, is, sm);
    }
    quant_avx2_pairs_finish(t, wr, rb, nr, dx, is, sm, y);
}

/* K-quant rows of 2 super-blocks (512 columns: the down products of the 35B-A3B's experts and of
 * qwen3next's), 4 rows to one group of 8 lanes, which shares among 4 rows the horizontal sums,
 * the float steps and the reduction that a 2-super-block row pays alone in quant_avx2_k. Each
 * lane takes quant_dot_k's float steps; 0 + r is the partial (the single-row kernel's first add),
 * and p[0] + p[1] is the whole canonical butterfly: the other 30 partials are +0, and adding +0
 * to a partial that is never -0 changes nothing. Other rows go one by one through quant_avx2_k. */
QUANT_AVX2_INLINE void quant_avx2_k_rows(enum gguf_type t, const uint8_t *w, size_t rb, int nrows,
                                         const void *act, int64_t n, float *y) {
    if (n != 2 * QUANT_QK_K) {
        for (int r = 0; r < nrows; r++) y[r] = quant_avx2_k(t, w + (size_t)r * rb, act, n);
        return;
    }
    const struct quant_q8k_view a = quant_q8k_view(act, n);
    const __m256 dx = _mm256_setr_ps(a.d[0], a.d[1], a.d[0], a.d[1], a.d[0], a.d[1], a.d[0], a.d[1]);
    int r = 0;
    for (; r + 4 <= nrows; r += 4) quant_avx2_pairs_group(t, w + (size_t)r * rb, rb, a, dx, 4, y + r);
    if (r < nrows) quant_avx2_pairs_group(t, w + (size_t)r * rb, rb, a, dx, nrows - r, y + r);
}

#define QUANT_AVX2_WRAP(name, body) \
    static QUANT_AVX2 float name(const void *w, const void *act, int64_t n) { return body; }
QUANT_AVX2_WRAP(quant_dot_q4_k_avx2, quant_avx2_k(GGUF_TYPE_Q4_K, w, act, n))
QUANT_AVX2_WRAP(quant_dot_q5_k_avx2, quant_avx2_k(GGUF_TYPE_Q5_K, w, act, n))
QUANT_AVX2_WRAP(quant_dot_q6_k_avx2, quant_avx2_k(GGUF_TYPE_Q6_K, w, act, n))
QUANT_AVX2_WRAP(quant_dot_q2_k_avx2, quant_avx2_k(GGUF_TYPE_Q2_K, w, act, n))
QUANT_AVX2_WRAP(quant_dot_q3_k_avx2, quant_avx2_k(GGUF_TYPE_Q3_K, w, act, n))
QUANT_AVX2_WRAP(quant_dot_iq4_xs_avx2, quant_avx2_k(GGUF_TYPE_IQ4_XS, w, act, n))
QUANT_AVX2_WRAP(quant_dot_iq3_xxs_avx2, quant_avx2_k(GGUF_TYPE_IQ3_XXS, w, act, n))
QUANT_AVX2_WRAP(quant_dot_iq3_s_avx2, quant_avx2_k(GGUF_TYPE_IQ3_S, w, act, n))

/* One row with nc columns in passes of NCOL (4), each pass size a constant so that the column
 * loops unroll and the accumulators stay in registers (3 columns left go as 2 + 1: a copy of
 * the kernel fewer to compile); KERNEL(type, w, acts, stride, n, y, ys, NC) computes NC
 * columns. The AVX-512 kernels are wrapped the same way. */
#define QUANT_COLUMNS_FIXED(name, target, kernel, type, ncol)                                          \
    static target void name(const void *w, const uint8_t *acts, size_t stride, int nc, int64_t n,      \
                            float *y, size_t ys) {                                                     \
        for (; nc >= ncol; nc -= ncol, acts += ncol * stride, y += ncol * ys)                          \
            kernel(type, w, acts, stride, n, y, ys, ncol);                                             \
        if (nc >= 2) kernel(type, w, acts, stride, n, y, ys, 2);                                       \
        if (nc & 1) kernel(type, w, acts + (size_t)(nc - 1) * stride, stride, n, y + (size_t)(nc - 1) * ys, ys, 1); \
    }

/* COLI_ROLLED builds pass the pass size at run time instead, and the single-column dot is the
 * multi-column kernel's one-column call: one copy of each kernel, not four (the same bits; the
 * sanitizer build of test_quant takes ~19 s where fixed sizes at both levels take ~29). */
#ifdef COLI_ROLLED
#define QUANT_COLUMNS(name, target, kernel, type, ncol)                                                \
    static target void name(const void *w, const uint8_t *acts, size_t stride, int nc, int64_t n,      \
                            float *y, size_t ys) {                                                     \
        for (int k; nc > 0; nc -= k, acts += (size_t)k * stride, y += (size_t)k * ys)                  \
            kernel(type, w, acts, stride, n, y, ys, k = nc < ncol ? nc : ncol);                        \
    }
#define QUANT_SINGLE_COLUMN(name, target, kernel, type)                                                \
    static target float name(const void *w, const void *act, int64_t n) {                              \
        float y;                                                                                       \
        name##n(w, act, 0, 1, n, &y, 0);                                                               \
        return y;                                                                                      \
    }
#else
#define QUANT_COLUMNS QUANT_COLUMNS_FIXED
#define QUANT_SINGLE_COLUMN QUANT_COLUMN
#endif

/* The single-column dot of such a kernel: its 1-column pass. */
#define QUANT_COLUMN(name, target, kernel, type)                                                       \
    static target float name(const void *w, const void *act, int64_t n) {                              \
        float y;                                                                                       \
        kernel(type, w, act, 0, n, &y, 0, 1);                                                          \
        return y;                                                                                      \
    }
#define QUANT_AVX2_COLUMNS(name, kernel, type)                                                         \
    QUANT_COLUMNS(name##n, QUANT_AVX2, kernel, type, QUANT_AVX2_NCOL)                                  \
    QUANT_SINGLE_COLUMN(name, QUANT_AVX2, kernel, type)
#define QUANT_AVX2_FLOAT_COLUMNS(name, type)                                                         \
    QUANT_COLUMNS(name##n, QUANT_AVX2, quant_avx2_float, type, 2)                                      \
    QUANT_SINGLE_COLUMN(name, QUANT_AVX2, quant_avx2_float, type)
QUANT_AVX2_FLOAT_COLUMNS(quant_dot_f32_avx2, GGUF_TYPE_F32)
QUANT_AVX2_FLOAT_COLUMNS(quant_dot_f16_avx2, GGUF_TYPE_F16)
QUANT_AVX2_FLOAT_COLUMNS(quant_dot_bf16_avx2, GGUF_TYPE_BF16)
QUANT_AVX2_COLUMNS(quant_dot_q8_0_avx2, quant_avx2_legacy, GGUF_TYPE_Q8_0)
QUANT_AVX2_COLUMNS(quant_dot_q4_0_avx2, quant_avx2_legacy, GGUF_TYPE_Q4_0)
QUANT_AVX2_COLUMNS(quant_dot_q4_1_avx2, quant_avx2_legacy, GGUF_TYPE_Q4_1)
QUANT_AVX2_COLUMNS(quant_dot_q5_0_avx2, quant_avx2_legacy, GGUF_TYPE_Q5_0)
QUANT_AVX2_COLUMNS(quant_dot_q5_1_avx2, quant_avx2_legacy, GGUF_TYPE_Q5_1)
QUANT_AVX2_COLUMNS(quant_dot_iq4_nl_avx2, quant_avx2_legacy, GGUF_TYPE_IQ4_NL)
QUANT_AVX2_COLUMNS(quant_dot_mxfp4_avx2, quant_avx2_legacy, GGUF_TYPE_MXFP4)

/* NC columns of a K or IQ row: quant_avx2_k_cols, a single column through
 * quant_avx2_k (its steps, with nothing held between decode and use). */
QUANT_AVX2_INLINE void quant_avx2_k_n(enum gguf_type t, const uint8_t *w, const uint8_t *acts, size_t stride, int64_t n,
                                      float *y, size_t ys, int NC) {
    if (NC == 1) *y = quant_avx2_k(t, w, acts, n);
    else quant_avx2_k_cols(t, w, acts, stride, n, y, ys, NC);
}
#define QUANT_AVX2_K_COLUMNS(name, type) QUANT_COLUMNS(name, QUANT_AVX2, quant_avx2_k_n, type, QUANT_AVX2_NCOL)
QUANT_AVX2_K_COLUMNS(quant_dot_q4_k_avx2n, GGUF_TYPE_Q4_K)
QUANT_AVX2_K_COLUMNS(quant_dot_q5_k_avx2n, GGUF_TYPE_Q5_K)
QUANT_AVX2_K_COLUMNS(quant_dot_q6_k_avx2n, GGUF_TYPE_Q6_K)
QUANT_AVX2_K_COLUMNS(quant_dot_q2_k_avx2n, GGUF_TYPE_Q2_K)
QUANT_AVX2_K_COLUMNS(quant_dot_q3_k_avx2n, GGUF_TYPE_Q3_K)
QUANT_AVX2_K_COLUMNS(quant_dot_iq4_xs_avx2n, GGUF_TYPE_IQ4_XS)
QUANT_AVX2_K_COLUMNS(quant_dot_iq3_xxs_avx2n, GGUF_TYPE_IQ3_XXS)
QUANT_AVX2_K_COLUMNS(quant_dot_iq3_s_avx2n, GGUF_TYPE_IQ3_S)

#define QUANT_AVX2_ROWS(name, type)                                                                  \
    static QUANT_AVX2 void name(const uint8_t *w, size_t rb, int nrows, const void *act, int64_t n, \
                                float *y) { quant_avx2_k_rows(type, w, rb, nrows, act, n, y); }
QUANT_AVX2_ROWS(quant_dotr_q4_k_avx2, GGUF_TYPE_Q4_K)
QUANT_AVX2_ROWS(quant_dotr_q5_k_avx2, GGUF_TYPE_Q5_K)
QUANT_AVX2_ROWS(quant_dotr_q6_k_avx2, GGUF_TYPE_Q6_K)
QUANT_AVX2_ROWS(quant_dotr_q2_k_avx2, GGUF_TYPE_Q2_K)
QUANT_AVX2_ROWS(quant_dotr_q3_k_avx2, GGUF_TYPE_Q3_K)
QUANT_AVX2_ROWS(quant_dotr_iq4_xs_avx2, GGUF_TYPE_IQ4_XS)
QUANT_AVX2_ROWS(quant_dotr_iq3_xxs_avx2, GGUF_TYPE_IQ3_XXS)
QUANT_AVX2_ROWS(quant_dotr_iq3_s_avx2, GGUF_TYPE_IQ3_S)

/* ---- AVX-512 kernels (VNNI): same units, same float steps ----
 * The block formats also come in multi-column form (quant_dotn): each weight block is decoded
 * once and applied to up to QUANT_NCOL activation columns, every column going through exactly
 * the single-column steps, so matmat gives matvec's bits. Only AVX512F/BW/VL/VNNI: VBMI's byte
 * permutes would shorten the IQ3_XXS lattice lookup and the MXFP4 unpack, but Cascade Lake and
 * Cooper Lake (VNNI without VBMI) lack them. */
#define QUANT_AVX512_INLINE static inline __attribute__((always_inline, \
    target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define QUANT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* Columns per pass of the multi-column kernels: the legacy kernel then holds 4 x 4 integer and
 * 4 x 2 float accumulators, which with the decoded weights fills the 32 zmm registers. */
#define QUANT_NCOL 4

/* Canonical butterfly on two accumulators holding partials 0-15 and 16-31. */
QUANT_AVX512_INLINE float quant_avx512_reduce(__m512 a0, __m512 a1) {
    a0 = _mm512_add_ps(a0, a1);                                                   /* s = 16 */
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a0),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a0), 1))); /* 8 */
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));      /* 4 */
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}

/* 16 weights of a float format as f32 (exact conversions). */
QUANT_AVX512_INLINE __m512 quant_avx512_load_w16(enum gguf_type t, const uint8_t *w) {
    if (t == GGUF_TYPE_F32) return _mm512_loadu_ps(w);
    __m256i h = _mm256_loadu_si256((const __m256i *)w);
    if (t == GGUF_TYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Float row dot with NC columns: accumulators hold partials 0-15 and 16-31. */
QUANT_AVX512_INLINE void quant_avx512_float(enum gguf_type t, const uint8_t *w, const uint8_t *acts,
                                            size_t stride, int64_t n, float *y, size_t ys, int NC) {
    const int es = t == GGUF_TYPE_F32 ? 4 : 2;
    const int64_t n32 = n & ~(int64_t)31;
    __m512 acc[QUANT_NCOL][2];
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) acc[c][0] = acc[c][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n32; i += 32) {
        for (int q = 0; q < 32 * es; q += 64) _mm_prefetch((const char *)w + i * es + QUANT_PREFETCH + q, _MM_HINT_T0);
        __m512 w0 = quant_avx512_load_w16(t, w + i * es), w1 = quant_avx512_load_w16(t, w + (i + 16) * es);
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) {
            const float *x = (const float *)(acts + (size_t)c * stride);
            acc[c][0] = _mm512_add_ps(acc[c][0], _mm512_mul_ps(w0, _mm512_load_ps(x + i)));
            acc[c][1] = _mm512_add_ps(acc[c][1], _mm512_mul_ps(w1, _mm512_load_ps(x + i + 16)));
        }
    }
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        if (n32 == n) { y[c * ys] = quant_avx512_reduce(acc[c][0], acc[c][1]); continue; }
        float p[QUANT_NPART];
        _mm512_storeu_ps(p, acc[c][0]);
        _mm512_storeu_ps(p + 16, acc[c][1]);
        quant_float_units(t, w, (const float *)(acts + (size_t)c * stride), n32, n, p);
        y[c * ys] = quant_reduce32(p);
    }
}

/* quant_e8m0_half of the low byte of each lane of G. */
QUANT_AVX512_INLINE __m512 quant_avx512_e8m0_half(__m512i g) {
    const __m512i e = _mm512_and_si512(g, _mm512_set1_epi32(0xff));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(normal, small, subnormal));
}

/* The scales of the 16 blocks at B of Q4_0 or IQ4_NL (fp16, word 9k of the group) or MXFP4
 * (E8M0, byte 17k): two word permutes of two loads each, blocks 0-7 from the first bytes and
 * 8-15 from byte 144 (MXFP4 136) on, instead of a gather (~13 cycles for 16 lanes). */
QUANT_AVX512_INLINE __m512 quant_avx512_scales16(enum gguf_type t, const uint8_t *b) {
    const int mx = t == GGUF_TYPE_MXFP4, second = mx ? 136 : 144;
    int16_t w[32], shift[32];
    for (int k = 0; k < 32; k++) { /* words 16-31 unused */
        w[k] = (int16_t)(k < 16 ? (mx ? 17 * k / 2 : 9 * k) - (k < 8 ? 0 : second / 2) : 0);
        shift[k] = (int16_t)(mx && k % 2 ? 8 : 0);
    }
    const __m512i idx = _mm512_loadu_si512(w);
    const __m512i h = _mm512_mask_blend_epi16(0xff00, _mm512_permutex2var_epi16(_mm512_loadu_si512(b), idx, _mm512_loadu_si512(b + 64)),
                                              _mm512_permutex2var_epi16(_mm512_loadu_si512(b + second), idx,
                                                                        _mm512_loadu_si512(b + second + 64)));
    if (!mx) return _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    const __m512i e = _mm512_srlv_epi16(h, _mm512_loadu_si512(shift));
    return quant_avx512_e8m0_half(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(e)));
}

/* Unsigned quants of the 4 legacy blocks at b, one 128-bit lane per block: *lo holds elements
 * 0-15, *hi elements 16-31. Q8_0 and the table formats (IQ4_NL, MXFP4) are offset by 128 (the
 * caller subtracts 128 * Σx, as it subtracts 8 or 16 for Q4_0/Q5_0), so vpdpbusd (unsigned x
 * signed) applies to every format. */
QUANT_AVX512_INLINE void quant_avx512_legacy_quad(enum gguf_type t, const uint8_t *b, int bb,
                                                  __m512i *lo, __m512i *hi) {
    if (t == GGUF_TYPE_Q8_0) {
        __m512i p0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2))),
                                        _mm256_loadu_si256((const __m256i *)(b + bb + 2)), 1);
        __m512i p1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2 * bb + 2))),
                                        _mm256_loadu_si256((const __m256i *)(b + 3 * bb + 2)), 1);
        const __m512i s = _mm512_set1_epi8((char)0x80);
        *lo = _mm512_xor_si512(_mm512_shuffle_i64x2(p0, p1, _MM_SHUFFLE(2, 0, 2, 0)), s);
        *hi = _mm512_xor_si512(_mm512_shuffle_i64x2(p0, p1, _MM_SHUFFLE(3, 1, 3, 1)), s);
        return;
    }
    const int has_min = t == GGUF_TYPE_Q4_1 || t == GGUF_TYPE_Q5_1;
    const int five = t == GGUF_TYPE_Q5_0 || t == GGUF_TYPE_Q5_1;
    const int qo = t == GGUF_TYPE_MXFP4 ? 1 : 2 + 2 * has_min + 4 * five;
    /* four loads and three inserts: one word permute of two wider loads took the 18-byte blocks
     * (Q4_0, IQ4_NL) at 19 GB/s a core from memory against 25-29 (Zen 5) */
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(b + qo)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b + bb + qo)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b + 2 * bb + qo)), 2);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(b + 3 * bb + qo)), 3);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512i l = _mm512_and_si512(v, m4), h = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    if (t == GGUF_TYPE_IQ4_NL || t == GGUF_TYPE_MXFP4) {
        const int8_t *values = t == GGUF_TYPE_MXFP4 ? quant_mxfp4_values : quant_iq4nl_values;
        const __m512i tab = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)values)),
                                             _mm512_set1_epi8((char)0x80));
        l = _mm512_shuffle_epi8(tab, l);
        h = _mm512_shuffle_epi8(tab, h);
    }
    if (five) {
        /* bit j of a block's qh is element j's fifth bit: bits 0-15 go to lo, 16-31 to hi. Each
         * block's lane holds its qh four times; a byte shuffle gives byte i the qh byte with
         * element i's bit, a test picks the bit. Building the two masks with scalar shifts
         * and ors took ~28 integer operations a quad, the most of Q5_0/Q5_1's time. */
        const uint8_t *qh = b + 2 + 2 * has_min;
        __m512i q = _mm512_castsi128_si512(_mm_set1_epi32((int)quant_rd32(qh)));
        q = _mm512_inserti32x4(q, _mm_set1_epi32((int)quant_rd32(qh + bb)), 1);
        q = _mm512_inserti32x4(q, _mm_set1_epi32((int)quant_rd32(qh + 2 * bb)), 2);
        q = _mm512_inserti32x4(q, _mm_set1_epi32((int)quant_rd32(qh + 3 * bb)), 3);
        const __m512i bit = _mm512_broadcast_i32x4(_mm_set1_epi64x(0x8040201008040201));
        const __m512i byte_lo = _mm512_broadcast_i32x4(_mm_set_epi64x(0x0101010101010101, 0));
        const __m512i byte_hi = _mm512_add_epi8(byte_lo, _mm512_set1_epi8(2)), b4 = _mm512_set1_epi8(0x10);
        l = _mm512_mask_add_epi8(l, _mm512_test_epi8_mask(_mm512_shuffle_epi8(q, byte_lo), bit), l, b4);
        h = _mm512_mask_add_epi8(h, _mm512_test_epi8_mask(_mm512_shuffle_epi8(q, byte_hi), bit), h, b4);
    }
    *lo = l;
    *hi = h;
}

/* Lane u = sum of the 4 int32 of block u, where q[j] holds blocks 4j..4j+3 in its 128-bit lanes
 * (two unpack rounds leave block 4j+k in lane 4k+j; the permute undoes that). */
QUANT_AVX512_INLINE __m512i quant_avx512_quad_sums(const __m512i *q) {
    __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(q[0], q[1]), _mm512_unpackhi_epi32(q[0], q[1]));
    __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(q[2], q[3]), _mm512_unpackhi_epi32(q[2], q[3]));
    __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    return _mm512_permutexvar_epi32(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), s);
}

/* The 512 activation quants of 16 blocks at QX in legacy_quad's lane order: xl[k] and xh[k]
 * pair with quad k's lo and hi. */
QUANT_AVX512_INLINE void quant_avx512_legacy_acts(const int8_t *qx, __m512i *xl, __m512i *xh) {
    QUANT_UNROLL(4)
    for (int k = 0; k < 4; k++) {
        __m512i x0 = _mm512_load_si512(qx + 128 * k), x1 = _mm512_load_si512(qx + 128 * k + 64);
        xl[k] = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(2, 0, 2, 0));
        xh[k] = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* Σ q_w*q_x of 16 blocks, w as from legacy_quad, x as from legacy_acts. */
QUANT_AVX512_INLINE __m512i quant_avx512_legacy_isum(const __m512i *wl, const __m512i *wh, const __m512i *xl, const __m512i *xh) {
    __m512i q[4];
    QUANT_UNROLL(4)
    for (int k = 0; k < 4; k++) q[k] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wl[k], xl[k]), wh[k], xh[k]);
    return quant_avx512_quad_sums(q);
}

/* The 16 legacy blocks at WB decoded: unsigned quants in wl/wh (quad k: blocks 4k..4k+3), the
 * block scales in *dw, the mins in *mw (Q4_1, Q5_1; else zero). */
QUANT_AVX512_INLINE void quant_avx512_legacy_group(enum gguf_type t, const uint8_t *wb, __m512i *wl, __m512i *wh, __m512 *dw,
                                                   __m512 *mw) {
    const int bb = gguf_type_get(t)->block_bytes;
    for (int q = 0; q < 16 * bb; q += 64) _mm_prefetch((const char *)wb + QUANT_PREFETCH + q, _MM_HINT_T0);
    QUANT_UNROLL(4)
    for (int k = 0; k < 4; k++) quant_avx512_legacy_quad(t, wb + 4 * k * bb, bb, &wl[k], &wh[k]);
    *mw = _mm512_setzero_ps();
    if (bb == 18 || t == GGUF_TYPE_MXFP4) {
        *dw = quant_avx512_scales16(t, wb);
    } else {
        /* the 32 bits at each block start: fp16 d, then fp16 m for Q4_1/Q5_1 */
        const __m512i gidx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                _mm512_set1_epi32(bb));
        const __m512i g = _mm512_i32gather_epi32(gidx, wb, 1);
        *dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
        *mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
    }
}

/* How far the quants of T sit above the signed ones, as a shift: the caller takes off
 * Σx << shift (Q4_0 8, Q5_0 16, the formats offset by 128 in legacy_quad 128); 0 for none. */
QUANT_AVX512_INLINE int quant_avx512_legacy_shift(enum gguf_type t) {
    const int offset128 = t == GGUF_TYPE_Q8_0 || t == GGUF_TYPE_IQ4_NL || t == GGUF_TYPE_MXFP4;
    return t == GGUF_TYPE_Q4_0 ? 3 : t == GGUF_TYPE_Q5_0 ? 4 : offset128 ? 7 : 0;
}

/* quant_legacy_combine for 16 blocks of one column: ISUM less the quants' offset OFF (Σx << shift),
 * then (dw * dx) * isum, plus mw * sd with a min. */
QUANT_AVX512_INLINE __m512 quant_avx512_legacy_unit(enum gguf_type t, __m512i isum, __m512i off, __m512 dw, __m512 dx, __m512 mw,
                                                    __m512 sd) {
    if (quant_avx512_legacy_shift(t)) isum = _mm512_sub_epi32(isum, off);
    const __m512 r = _mm512_mul_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(isum));
    return t == GGUF_TYPE_Q4_1 || t == GGUF_TYPE_Q5_1 ? _mm512_add_ps(r, _mm512_mul_ps(mw, sd)) : r;
}

/* The offset legacy_unit takes off for blocks B..B+15 of act A. */
QUANT_AVX512_INLINE __m512i quant_avx512_legacy_off(enum gguf_type t, const struct quant_q8_view *a, int64_t b) {
    const int sh = quant_avx512_legacy_shift(t);
    return sh ? _mm512_slli_epi32(_mm512_loadu_si512(a->s + b), sh) : _mm512_setzero_si512();
}

/* The mins' act sums of blocks B..B+15 (Q4_1, Q5_1), else zero. */
QUANT_AVX512_INLINE __m512 quant_avx512_legacy_sd(enum gguf_type t, const struct quant_q8_view *a, int64_t b) {
    return t == GGUF_TYPE_Q4_1 || t == GGUF_TYPE_Q5_1 ? _mm512_loadu_ps(a->sd + b) : _mm512_setzero_ps();
}

/* Legacy dot of one row with NC columns (acts at `stride`, results y[c*ys]): groups of 16
 * blocks give one vector of unit results added to accumulator (g % 2), i.e. partials b % 32;
 * a tail of < 16 blocks goes through the scalar units. */
QUANT_AVX512_INLINE void quant_avx512_legacy(enum gguf_type t, const uint8_t *w, const uint8_t *acts,
                                             size_t stride, int64_t n, float *y, size_t ys, int NC) {
    const int bb = gguf_type_get(t)->block_bytes;
    const int64_t nb = n / QUANT_QK, nb16 = nb & ~(int64_t)15;
    struct quant_q8_view a[QUANT_NCOL];
    __m512 acc[QUANT_NCOL][2];
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        a[c] = quant_q8_view(acts + (size_t)c * stride, n);
        acc[c][0] = acc[c][1] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb16; b += 16) {
        __m512i wl[4], wh[4];
        __m512 dw, mw;
        quant_avx512_legacy_group(t, w + b * bb, wl, wh, &dw, &mw);
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) {
            __m512i xl[4], xh[4];
            quant_avx512_legacy_acts(a[c].qs + b * QUANT_QK, xl, xh);
            const __m512 r = quant_avx512_legacy_unit(t, quant_avx512_legacy_isum(wl, wh, xl, xh), quant_avx512_legacy_off(t, &a[c], b),
                                                      dw, _mm512_loadu_ps(a[c].d + b), mw, quant_avx512_legacy_sd(t, &a[c], b));
            /* into acc[0], then swapped (in registers, where acc[(b / 16) % 2] is memory):
             * after an odd count of groups acc[1] holds partials 0-15 */
            const __m512 sum = _mm512_add_ps(acc[c][0], r);
            acc[c][0] = acc[c][1];
            acc[c][1] = sum;
        }
    }
    const int odd = (int)(nb16 / 16) & 1;
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        const __m512 lo = odd ? acc[c][1] : acc[c][0], hi = odd ? acc[c][0] : acc[c][1];
        if (nb16 == nb) { y[c * ys] = quant_avx512_reduce(lo, hi); continue; }
        float p[QUANT_NPART];
        _mm512_storeu_ps(p, lo);
        _mm512_storeu_ps(p + 16, hi);
        quant_legacy_units(t, w, a[c], nb16, nb, p);
        y[c * ys] = quant_reduce32(p);
    }
}

/* quant_avx512_reduce(v[i], 0) for 4 rows at once, row i's sum in lane i: the same adds, the
 * rows side by side in the vector instead of one per vector. */
QUANT_AVX512_INLINE __m128 quant_avx512_reduce4(const __m512 *v) {
    const __m512 z = _mm512_setzero_ps(), a0 = _mm512_add_ps(v[0], z), a1 = _mm512_add_ps(v[1], z);
    const __m512 a2 = _mm512_add_ps(v[2], z), a3 = _mm512_add_ps(v[3], z);
    /* s = 8: rows 0,1 (2,3) in halves, lane i + lane i+8 */
    const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(3, 2, 3, 2)));
    /* s = 4: row i in 128-bit lane i */
    const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(h01, h23, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 p = _mm512_add_ps(q, _mm512_permute_ps(q, _MM_SHUFFLE(3, 2, 3, 2)));  /* s = 2 */
    const __m512 o = _mm512_add_ps(p, _mm512_movehdup_ps(p));                          /* s = 1 */
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), o));
}

/* Rows kernel of the legacy formats: rows of 16 blocks (the 35B-A3B's expert and shared-expert
 * down products) 4 at a time, the act's lanes ordered once for all of them and their 4
 * butterflies in one (quant_avx512_reduce4). A dot per row paid for both on every row, together
 * as much as the row's own work. Other lengths go through DOT, one row at a time. */
QUANT_AVX512_INLINE void quant_avx512_legacy_rows(enum gguf_type t, quant_dot_fn dot, const uint8_t *w, size_t rb, int nrows,
                                                  const void *act, int64_t n, float *y) {
    if (n != 16 * QUANT_QK) {
        for (int r = 0; r < nrows; r++) y[r] = dot(w + (size_t)r * rb, act, n);
        return;
    }
    const struct quant_q8_view a = quant_q8_view(act, n);
    __m512i xl[4], xh[4];
    quant_avx512_legacy_acts(a.qs, xl, xh);
    const __m512i off = quant_avx512_legacy_off(t, &a, 0);
    const __m512 dx = _mm512_loadu_ps(a.d), sd = quant_avx512_legacy_sd(t, &a, 0);
    for (int r = 0; r < nrows; r += 4) {
        __m512 v[4];
        for (int i = 0; i < 4; i++) {
            v[i] = _mm512_setzero_ps();
            if (r + i >= nrows) continue;
            __m512i wl[4], wh[4];
            __m512 dw, mw;
            quant_avx512_legacy_group(t, w + (size_t)(r + i) * rb, wl, wh, &dw, &mw);
            v[i] = quant_avx512_legacy_unit(t, quant_avx512_legacy_isum(wl, wh, xl, xh), off, dw, dx, mw, sd);
        }
        float s[4];
        _mm_storeu_ps(s, quant_avx512_reduce4(v));
        for (int i = 0; i < 4 && r + i < nrows; i++) y[r + i] = s[i];
    }
}

/* A K-like super-block decoded for the column loop: q[k] holds the unsigned quants of elements
 * 64k..64k+63 (IQ4_XS, IQ3_XXS, IQ3_S: their magnitudes, with bit i of neg[k] set where element
 * 64k+i is negative), sc[k] the int16 scale of each vpmaddubsw pair of q[k]; m multiplies the
 * act's 16 bsums (Q4_K/Q5_K: each 32-min twice; Q2_K: the 16 mins; Q6_K, Q3_K: the 16 scales,
 * for the offset of 32 or 4; unused by the IQ formats). An act in the decode's own order
 * (QUANT_DECODE_REORDERED) changes which elements a register holds, and an IQ3 decode in
 * coordinate planes keeps its scales as dwords in sc[0] (quant_avx512_iq3_planes_dot). */
struct quant_avx512_kblock { __m512i q[4], sc[4]; __m256i m; __mmask64 neg[4]; };

/* Word index vector: word i takes entry base + i / per of the source. */
QUANT_AVX512_INLINE __m512i quant_avx512_widx(int base, int per) {
    int16_t ix[32];
    for (int i = 0; i < 32; i++) ix[i] = (int16_t)(base + i / per);
    return _mm512_loadu_si512(ix);
}

/* quant_k4_unpack's 8 scales (bytes 0-7 of the result) and 8 mins (bytes 8-15) in vector
 * form; the 16-byte load reads 4 bytes of quants past the 12 packed ones, masked off. */
QUANT_AVX512_INLINE __m128i quant_avx512_k4_fields(const uint8_t *packed) {
    const __m128i v = _mm_loadu_si128((const __m128i *)packed);
    /* u0 u2 u1 u2>>4: the low 6 bits of scales 0-3, the low 4 of scales 4-7, then the mins' */
    const __m128i x = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));
    const __m128i top = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(x, _MM_SHUFFLE(2, 2, 0, 0)), 2),
                                      _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(_mm_and_si128(x, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f)), top);
}

/* Q4_K / Q5_K super-block. The scales and mins of quant_avx512_k4_fields become words by
 * vpshufb (index byte i, then 0x80: a zero high byte): measured 8% faster on Q4_K than the
 * scalar quant_k4_unpack and word permutes. A 64-byte load's low nibbles are sub-blocks 4h and
 * 4h + 2, its high ones 4h + 1 and 4h + 3: NIBBLES (the act's 32-blocks in that order,
 * quant_avx512_nibble_order) keeps them so, else two lane shuffles put them in element order. */
QUANT_AVX512_INLINE void quant_avx512_q45k_decode(const uint8_t *b, int five, int nibbles, struct quant_avx512_kblock *k) {
    const __m512i fields = _mm512_broadcast_i32x4(quant_avx512_k4_fields(b + 4));
    /* each min twice (two bsums per 32-block) */
    const __m256i mins = _mm256_setr_epi16(0x8008, 0x8008, 0x8009, 0x8009, 0x800a, 0x800a, 0x800b, 0x800b,
                                           0x800c, 0x800c, 0x800d, 0x800d, 0x800e, 0x800e, 0x800f, 0x800f);
    k->m = _mm256_shuffle_epi8(_mm512_castsi512_si256(fields), mins);
    const uint8_t *ql = b + 16 + 32 * five;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    QUANT_UNROLL(4)
    for (int h = 0; h < 2; h++) {
        /* 64 bytes: low nibbles are sub-blocks 4h and 4h+2, high nibbles 4h+1 and 4h+3 */
        __m512i l = _mm512_loadu_si512(ql + 64 * h);
        __m512i a0 = _mm512_and_si512(l, m4), a1 = _mm512_and_si512(_mm512_srli_epi16(l, 4), m4);
        k->q[2 * h] = nibbles ? a0 : _mm512_shuffle_i64x2(a0, a1, _MM_SHUFFLE(1, 0, 1, 0));
        k->q[2 * h + 1] = nibbles ? a1 : _mm512_shuffle_i64x2(a0, a1, _MM_SHUFFLE(3, 2, 3, 2));
    }
    QUANT_UNROLL(4)
    for (int j = 0; j < 4; j++) {
        /* the sub-blocks of q[j]'s two halves */
        const int s0 = nibbles ? 4 * (j / 2) + j % 2 : 2 * j, s1 = nibbles ? s0 + 2 : s0 + 1;
        const __m512i scale = _mm512_inserti64x4(_mm512_set1_epi16((short)(0x8000 | s0)), _mm256_set1_epi16((short)(0x8000 | s1)), 1);
        k->sc[j] = _mm512_shuffle_epi8(fields, scale);
        if (five) {
            /* bit s of qh[l] is the fifth bit of element l of sub-block s */
            __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
            __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << s0)), _mm256_set1_epi8((char)(1 << s1)), 1);
            k->q[j] = _mm512_mask_add_epi8(k->q[j], _mm512_test_epi8_mask(qh, bit), k->q[j], _mm512_set1_epi8(0x10));
        }
    }
}

/* The 16 scales of a super-block's 16-groups (SC, int16) as the word multipliers of its 4
 * registers of 64 values: lane L (128 bits) of register j is group 4j + L. One word permute
 * puts groups L, 4 + L, 8 + L and 12 + L in lane L, then an in-lane byte shuffle makes each
 * register (measured, one core in cache: Q6_K 3.87-3.91 -> 3.70-3.73 ns a super-block, Q3_K
 * 5.35-5.43 -> 5.16-5.25, against a word permute a register). */
QUANT_AVX512_INLINE void quant_avx512_group_scales(__m256i sc, __m512i out[4]) {
    int16_t ix[32];
    for (int i = 0; i < 32; i++) ix[i] = (int16_t)(i % 8 < 4 ? 4 * (i % 8) + i / 8 : 0);
    const __m512i by_lane = _mm512_permutexvar_epi16(_mm512_loadu_si512(ix), _mm512_castsi256_si512(sc));
    QUANT_UNROLL(4)
    for (int j = 0; j < 4; j++) out[j] = _mm512_shuffle_epi8(by_lane, _mm512_set1_epi16((short)(0x0100 * (2 * j + 1) + 2 * j)));
}

QUANT_AVX512_INLINE void quant_avx512_q6k_decode(const uint8_t *b, struct quant_avx512_kblock *k) {
    __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    /* per 256-bit half: two high bits of qh at bits 0/2 (low nibbles), 4/6 (high nibbles) -> 4 */
    const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i shr = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    QUANT_UNROLL(4)
    for (int c = 0; c < 2; c++) {
        __m512i l = _mm512_loadu_si512(b + 64 * c);
        __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * c)));
        __m512i hl = _mm512_and_si512(_mm512_sllv_epi16(qh, shl), m30), hh = _mm512_and_si512(_mm512_srlv_epi16(qh, shr), m30);
        k->q[2 * c] = _mm512_or_si512(_mm512_and_si512(l, m4), hl);
        k->q[2 * c + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4), hh);
    }
    quant_avx512_group_scales(sc, k->sc);
    k->m = sc;
}

/* Q2_K (quants 0..3) or Q3_K (quants + 4, 0..7: the hmask bit as the third bit) super-block.
 * q[j] takes the 32 quant bytes of half j / 2 (elements 128 (j / 2) on) shifted by 4 (j % 2) in
 * its low 256 bits and 2 more in its high ones: quant_q23k_quants' element order. */
QUANT_AVX512_INLINE void quant_avx512_q23k_decode(enum gguf_type t, const uint8_t *b, struct quant_avx512_kblock *k) {
    const int three = t == GGUF_TYPE_Q3_K;
    __m256i sc;
    if (three) {
        sc = k->m = quant_avx2_q3k_scales(b + 96);
    } else {
        const __m128i packed = _mm_loadu_si128((const __m128i *)b), m4 = _mm_set1_epi8(0x0f);
        sc = _mm256_cvtepu8_epi16(_mm_and_si128(packed, m4));
        k->m = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), m4));
    }
    const __m512i hmask = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)b));
    QUANT_UNROLL(4)
    for (int j = 0; j < 4; j++) {
        const int h = j / 2, s = 4 * (j % 2);
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + (three ? 32 : 16) + 32 * h)));
        const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16((short)s), _mm256_set1_epi16((short)(s + 2)), 1);
        k->q[j] = _mm512_and_si512(_mm512_srlv_epi16(v, shift), _mm512_set1_epi8(3));
        if (three) {
            /* element l of step (h, k) has its third bit at bit 4h + k of hmask byte l */
            const int bit = 4 * h + s / 2;
            const __m512i sel = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << bit)), _mm256_set1_epi8((char)(2 << bit)), 1);
            k->q[j] = _mm512_mask_add_epi8(k->q[j], _mm512_test_epi8_mask(hmask, sel), k->q[j], _mm512_set1_epi8(4));
        }
    }
    quant_avx512_group_scales(sc, k->sc);
}

/* The scales of an IQ super-block's 8 32-blocks (S8, int32) as the multipliers of each vpmaddubsw
 * pair: word i of sc[j] is block 2j + i / 16's. */
QUANT_AVX512_INLINE void quant_avx512_iq_scales(__m256i s8, struct quant_avx512_kblock *k) {
    const __m512i s16 = _mm512_castsi128_si512(_mm256_cvtepi32_epi16(s8));
    QUANT_UNROLL(4)
    for (int j = 0; j < 4; j++) k->sc[j] = _mm512_permutexvar_epi16(quant_avx512_widx(2 * j, 16), s16);
}

/* IQ4_XS super-block: the IQ4_NL table's magnitudes and signs (codes 0-7 are its negative
 * values), and the 6-bit scales less 32 (quant_iq4xs_scale). A block's 16 bytes hold its
 * elements 0-15 in the low nibbles, 16-31 in the high ones: a 64-byte load's low nibbles are
 * the first halves of 4 blocks, its high ones their second halves. NIBBLES (the act in that
 * order, quant_avx512_nibble_order) keeps them so, with the scales of the 4 blocks in the 4
 * lanes; else one permute per 2 blocks puts both in element order. */
QUANT_AVX512_INLINE void quant_avx512_iq4xs_decode(const uint8_t *b, int nibbles, struct quant_avx512_kblock *k) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), b3 = _mm512_set1_epi8(0x08);
    const __m512i tab = _mm512_abs_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)quant_iq4nl_values)));
    const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    QUANT_UNROLL(2)
    for (int h = 0; h < 2; h++) {
        const __m512i v = _mm512_loadu_si512(b + 8 + 64 * h);
        const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        const __m512i code[2] = { nibbles ? lo : _mm512_permutex2var_epi64(lo, first, hi), nibbles ? hi : _mm512_permutex2var_epi64(lo, second, hi) };
        QUANT_UNROLL(2)
        for (int i = 0; i < 2; i++) {
            k->neg[2 * h + i] = _mm512_testn_epi8_mask(code[i], b3);
            k->q[2 * h + i] = _mm512_shuffle_epi8(tab, code[i]);
        }
    }
    uint32_t lo4;
    memcpy(&lo4, b + 4, 4);
    const __m256i lo = _mm256_srlv_epi32(_mm256_set1_epi32((int)lo4), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    const __m256i hi = _mm256_srlv_epi32(_mm256_set1_epi32(quant_rd16(b + 2)), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    const __m256i s6 = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xf)), _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(3)), 4));
    const __m256i s8 = _mm256_sub_epi32(s6, _mm256_set1_epi32(32));
    if (!nibbles) {
        quant_avx512_iq_scales(s8, k);
        return;
    }
    const __m512i s16 = _mm512_castsi128_si512(_mm256_cvtepi32_epi16(s8));
    k->sc[0] = k->sc[1] = _mm512_permutexvar_epi16(quant_avx512_widx(0, 8), s16);
    k->sc[2] = k->sc[3] = _mm512_permutexvar_epi16(quant_avx512_widx(4, 8), s16);
}

/* The IQ3_XXS lattice points of the 32 index bytes at Q, elements 0-63 in *lo and 64-127 in
 * *hi, from registers rather than memory (a gather of 16 table words costs ~20 cycles): each
 * index's key (quant_iq3xxs_keys, 256 words in KEYS[8]: four two-register permutes, the
 * index's top 2 bits pick one) gives the levels of coordinates 0-1 (key bits 0-5) and 2-3
 * (bits 6-11) from the 64 level pairs in PAIRS[2], and two more permutes interleave them. */
QUANT_AVX512_INLINE void quant_avx512_iq3xxs_points(const uint8_t *q, const __m512i *keys, const __m512i *pairs,
                                                    __m512i *lo, __m512i *hi) {
    const __m512i idx = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)q));
    const __mmask32 m6 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(0x40));
    const __mmask32 m7 = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(0x80));
    const __m512i k01 = _mm512_mask_blend_epi16(m6, _mm512_permutex2var_epi16(keys[0], idx, keys[1]),
                                                _mm512_permutex2var_epi16(keys[2], idx, keys[3]));
    const __m512i k23 = _mm512_mask_blend_epi16(m6, _mm512_permutex2var_epi16(keys[4], idx, keys[5]),
                                                _mm512_permutex2var_epi16(keys[6], idx, keys[7]));
    const __m512i key = _mm512_mask_blend_epi16(m7, k01, k23);
    const __m512i l01 = _mm512_permutex2var_epi16(pairs[0], key, pairs[1]);
    const __m512i l23 = _mm512_permutex2var_epi16(pairs[0], _mm512_srli_epi16(key, 6), pairs[1]);
    /* word 2i: l01[i], word 2i + 1: l23[i] */
    const __m512i second = _mm512_set1_epi16(32);
    *lo = _mm512_permutex2var_epi16(l01, _mm512_mask_add_epi16(quant_avx512_widx(0, 2), 0xaaaaaaaa, quant_avx512_widx(0, 2), second), l23);
    *hi = _mm512_permutex2var_epi16(l01, _mm512_mask_add_epi16(quant_avx512_widx(16, 2), 0xaaaaaaaa, quant_avx512_widx(16, 2), second), l23);
}

/* Word c of the two registers: the levels of coordinates c % 8 (low byte) and c / 8 (high). */
QUANT_AVX512_INLINE void quant_avx512_iq3_pairs(__m512i *pairs) {
    const __m512i levels = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)quant_iq3_levels)));
    QUANT_UNROLL(2)
    for (int h = 0; h < 2; h++) {
        const __m512i c = _mm512_add_epi16(quant_avx512_widx(0, 1), _mm512_set1_epi16((short)(32 * h)));
        const __m512i l0 = _mm512_permutexvar_epi16(_mm512_and_si512(c, _mm512_set1_epi16(7)), levels);
        const __m512i l1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(c, 3), levels);
        pairs[h] = _mm512_or_si512(l0, _mm512_slli_epi16(l1, 8));
    }
}

/* The avx512vbmi level's IQ3 kernels are the AVX-512 ones with VBMI set: their decodes look
 * the points and signs up by VBMI byte permutes, and take sign bits apart by BITALG's bit
 * shuffle. Those four instructions go through asm: GCC inlines a function only into one whose
 * target includes the callee's, so kernels with a VBMI target could not use the AVX-512
 * functions. */

/* VPERMB: byte i of the result is TABLE[IDX[i] & 63]. */
QUANT_AVX512_INLINE __m512i quant_vbmi_permute(__m512i idx, __m512i table) {
    __m512i r;
    __asm__("vpermb %2, %1, %0" : "=v"(r) : "v"(idx), "v"(table));
    return r;
}

/* VPERMI2B: byte i of the result is byte IDX[i] & 127 of the 128 of LO then HI. */
QUANT_AVX512_INLINE __m512i quant_vbmi_permute2(__m512i lo, __m512i idx, __m512i hi) {
    __asm__("vpermi2b %2, %1, %0" : "+v"(idx) : "v"(lo), "vm"(hi));
    return idx;
}

/* VPMULTISHIFTQB: byte i of the result is the 8 bits of qword i / 8 of DATA from bit CTRL[i] & 63 on. */
QUANT_AVX512_INLINE __m512i quant_vbmi_multishift(__m512i ctrl, __m512i data) {
    __m512i r;
    __asm__("vpmultishiftqb %2, %1, %0" : "=v"(r) : "v"(ctrl), "v"(data));
    return r;
}

/* VPSHUFBITQMB (BITALG): bit i of the result is bit CTRL[i] & 63 of qword i / 8 of DATA. */
QUANT_AVX512_INLINE __mmask64 quant_bitalg_shuffle(__m512i ctrl, __m512i data) {
    __mmask64 r;
    __asm__("vpshufbitqmb %2, %1, %0" : "=k"(r) : "v"(data), "v"(ctrl));
    return r;
}

/* The 4 coordinate planes C of 64 IQ3 points by VBMI: the index bytes IDX (bit 8 in BIT8 for
 * IQ3_S's 512 points) look up both pair planes (NP registers each: quant_iq3xxs_pairs or
 * quant_iq3s_pairs) 128 entries a permute; the planes' nibbles become levels by VALUES
 * (vpshufb: their bit 3 is clear, so a nibble shifted in from the next byte never sets bit 7).
 * Byte i of plane j is coordinate j of point i. */
QUANT_AVX512_INLINE void quant_avx512_iq3_vbmi_lookup(__m512i idx, __mmask64 bit8, const uint8_t *planes, int np, __m128i values, __m512i *c) {
    const __m512i vt = _mm512_broadcast_i32x4(values);
    const __mmask64 bit7 = _mm512_movepi8_mask(idx);
    QUANT_UNROLL(2)
    for (int h = 0; h < 2; h++) {
        const __m512i *p = (const __m512i *)(planes + 64 * np * h);
        __m512i r = _mm512_mask_blend_epi8(bit7, quant_vbmi_permute2(_mm512_load_si512(p), idx, _mm512_load_si512(p + 1)),
                                           quant_vbmi_permute2(_mm512_load_si512(p + 2), idx, _mm512_load_si512(p + 3)));
        if (np == 8) {
            const __m512i r2 = _mm512_mask_blend_epi8(bit7, quant_vbmi_permute2(_mm512_load_si512(p + 4), idx, _mm512_load_si512(p + 5)),
                                                      quant_vbmi_permute2(_mm512_load_si512(p + 6), idx, _mm512_load_si512(p + 7)));
            r = _mm512_mask_blend_epi8(bit8, r, r2);
        }
        c[2 * h] = _mm512_shuffle_epi8(vt, r);
        c[2 * h + 1] = _mm512_shuffle_epi8(vt, _mm512_srli_epi16(r, 4));
    }
}

/* The 64 points of an IQ3 super-block into k->q, by quant_avx512_iq3_vbmi_lookup of the index
 * bytes at QS (bit 8 from the 64 bits at QH for IQ3_S; QH NULL for IQ3_XXS): byte i of plane
 * j is element 4i + j. IN_PLANES keeps them so (for an act in the same order,
 * quant_avx512_plane_order); else the coordinates are interleaved lane by lane, the indices
 * permuted first so that the interleave lands in element order: position 16L + 4j + i takes
 * point 16j + 4L + i. */
QUANT_AVX512_INLINE void quant_avx512_iq3_vbmi_points(const uint8_t *qs, const uint8_t *qh, const uint8_t *planes, int np,
                                                      __m128i values, int in_planes, struct quant_avx512_kblock *k) {
    static const uint8_t order[64] __attribute__((aligned(64))) = {
        0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
        8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63,
    };
    const __m512i perm = _mm512_load_si512(order);
    const __m512i idx = in_planes ? _mm512_loadu_si512(qs) : quant_vbmi_permute(perm, _mm512_loadu_si512(qs));
    __mmask64 bit8 = 0;
    if (qh) {
        uint64_t h;
        memcpy(&h, qh, 8);
        bit8 = in_planes ? _cvtu64_mask64(h) : _mm512_movepi8_mask(quant_vbmi_permute(perm, _mm512_movm_epi8(_cvtu64_mask64(h))));
    }
    __m512i c[4];
    quant_avx512_iq3_vbmi_lookup(idx, bit8, planes, np, values, c);
    if (in_planes) {
        QUANT_UNROLL(4)
        for (int j = 0; j < 4; j++) k->q[j] = c[j];
        return;
    }
    const __m512i w_lo = _mm512_unpacklo_epi8(c[0], c[1]), w_hi = _mm512_unpackhi_epi8(c[0], c[1]);
    const __m512i u_lo = _mm512_unpacklo_epi8(c[2], c[3]), u_hi = _mm512_unpackhi_epi8(c[2], c[3]);
    k->q[0] = _mm512_unpacklo_epi16(w_lo, u_lo);
    k->q[1] = _mm512_unpackhi_epi16(w_lo, u_lo);
    k->q[2] = _mm512_unpacklo_epi16(w_hi, u_hi);
    k->q[3] = _mm512_unpackhi_epi16(w_hi, u_hi);
}

/* The sign bytes of quant_iq_signs for an IQ3_XXS super-block's 8 words of signs and scales
 * (quant_iq_values): 7 bits each spread to a byte, their parity added as bit 7. */
QUANT_AVX512_INLINE __m256i quant_avx512_iq3xxs_signs(__m256i aux) {
    __m256i f = _mm256_and_si256(aux, _mm256_set1_epi32(0x7f));
    f = _mm256_or_si256(f, _mm256_and_si256(_mm256_slli_epi32(aux, 1), _mm256_set1_epi32(0x7f00)));
    f = _mm256_or_si256(f, _mm256_and_si256(_mm256_slli_epi32(aux, 2), _mm256_set1_epi32(0x7f0000)));
    f = _mm256_or_si256(f, _mm256_and_si256(_mm256_slli_epi32(aux, 3), _mm256_set1_epi32(0x7f000000)));
    /* bit 8i of p: the parity of byte i of f (the shifts bring in only bits of that byte) */
    __m256i p = _mm256_xor_si256(f, _mm256_srli_epi32(f, 4));
    p = _mm256_xor_si256(p, _mm256_srli_epi32(p, 2));
    p = _mm256_xor_si256(p, _mm256_srli_epi32(p, 1));
    return _mm256_or_si256(f, _mm256_and_si256(_mm256_slli_epi32(p, 7), _mm256_set1_epi32((int)0x80808080u)));
}

/* The sign masks and scales of an IQ3 super-block decoded in coordinate planes, from its 256
 * sign bits S (element order) and the scales S8 of its 32-blocks: bit i of k->neg[j] is the
 * sign of element 4i + j (dword q of S widened to qword q holds elements 32q..32q+31, so point
 * i's are in qword i / 8, at 4 (i % 8) + j); dword l of k->sc[0] is the scale of points
 * 4l..4l+3, block l / 2. */
QUANT_AVX512_INLINE void quant_avx512_iq3_plane_signs_scales(__m256i s, __m256i s8, struct quant_avx512_kblock *k) {
    const __m512i w = _mm512_cvtepu32_epi64(s);
    QUANT_UNROLL(4)
    for (int j = 0; j < 4; j++) k->neg[j] = quant_bitalg_shuffle(_mm512_set1_epi64(0x1c1814100c080400LL + 0x0101010101010101LL * j), w);
    k->sc[0] = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), _mm512_castsi256_si512(s8));
}

/* quant_avx512_iq3xxs_signs by VBMI, for the 16 words of AUX: VPMULTISHIFTQB takes the 8 bits
 * at each field's offset (0, 7, 14, 21 in each word), and their 7 low bits index
 * quant_iq_sign_table (VPERMI2B ignores bit 7). Measured: IQ3_XXS 5 ns a super-block faster
 * than the shifts and parity. */
QUANT_AVX512_INLINE __m512i quant_avx512_iq3xxs_signs_vbmi(__m512i aux) {
    const __m512i f = quant_vbmi_multishift(_mm512_set1_epi64(0x352e2720150e0700), aux);
    const __m512i *table = (const __m512i *)quant_iq_sign_table;
    return quant_vbmi_permute2(_mm512_load_si512(table), f, _mm512_load_si512(table + 1));
}

/* IQ3_XXS super-block: the lattice points (quant_avx512_iq3xxs_points, or VBMI's, in coordinate
 * planes where IN_PLANES says); one sign bit per element, from the sign bytes; and the scales
 * 2 s + 1 of quant_iq_isum_scalar. */
QUANT_AVX512_INLINE void quant_avx512_iq3xxs_decode(const uint8_t *b, int vbmi, int in_planes, struct quant_avx512_kblock *k) {
    const __m256i aux = _mm256_loadu_si256((const __m256i *)(b + 66));
    const __m256i scales = _mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(aux, 28), 1), _mm256_set1_epi32(1));
    if (in_planes) {
        quant_avx512_iq3_vbmi_points(b + 2, NULL, quant_iq3xxs_pairs[0], 4, _mm_loadl_epi64((const __m128i *)quant_iq3_levels), 1, k);
        quant_avx512_iq3_plane_signs_scales(_mm512_castsi512_si256(quant_avx512_iq3xxs_signs_vbmi(_mm512_castsi256_si512(aux))), scales, k);
        return;
    }
    if (vbmi) {
        quant_avx512_iq3_vbmi_points(b + 2, NULL, quant_iq3xxs_pairs[0], 4, _mm_loadl_epi64((const __m128i *)quant_iq3_levels), 0, k);
    } else {
        __m512i keys[8], pairs[2];
        QUANT_UNROLL(8)
        for (int i = 0; i < 8; i++) keys[i] = _mm512_loadu_si512(quant_iq3xxs_keys + 32 * i);
        quant_avx512_iq3_pairs(pairs);
        quant_avx512_iq3xxs_points(b + 2, keys, pairs, &k->q[0], &k->q[1]);
        quant_avx512_iq3xxs_points(b + 34, keys, pairs, &k->q[2], &k->q[3]);
    }
    uint64_t signs[4];
    _mm256_storeu_si256((__m256i *)signs, vbmi ? _mm512_castsi512_si256(quant_avx512_iq3xxs_signs_vbmi(_mm512_castsi256_si512(aux)))
                                               : quant_avx512_iq3xxs_signs(aux));
    QUANT_UNROLL(4)
    for (int j = 0; j < 4; j++) k->neg[j] = _cvtu64_mask64(signs[j]);
    quant_avx512_iq_scales(scales, k);
}

/* IQ3_S super-block: the grid points by VBMI byte permutes (VBMI: quant_avx512_iq3_vbmi_points,
 * in coordinate planes where IN_PLANES says), else 16 per register by one gather from
 * quant_iq3s_grid (512 words: too many to hold in registers as IQ3_XXS's keys are), their
 * indices the qs bytes with the qh bits as bit 8 (group m of a pair of 32-blocks: bit m of their
 * two qh bytes); a sign bit per element, in order, as the 64-bit masks; and the scales 2 s + 1. */
QUANT_AVX512_INLINE void quant_avx512_iq3s_decode(const uint8_t *b, int vbmi, int in_planes, struct quant_avx512_kblock *k) {
    const __m512i bit = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    uint32_t packed;
    memcpy(&packed, b + QUANT_IQ3S_SCALES, 4);
    const __m256i s = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)packed), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                       _mm256_set1_epi32(15));
    const __m256i scales = _mm256_or_si256(_mm256_slli_epi32(s, 1), _mm256_set1_epi32(1));
    if (vbmi) {
        quant_avx512_iq3_vbmi_points(b + 2, b + QUANT_IQ3S_QH, quant_iq3s_pairs[0], 8,
                                     _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0), in_planes, k);
    } else {
        QUANT_UNROLL(4)
        for (int j = 0; j < 4; j++) {
            const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * j)));
            const __m512i qh = _mm512_srlv_epi32(_mm512_set1_epi32(quant_rd16(b + QUANT_IQ3S_QH + 2 * j)), bit);
            const __m512i idx = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(qh, _mm512_set1_epi32(1)), 8));
            k->q[j] = _mm512_i32gather_epi32(idx, (const void *)quant_iq3s_grid, 4);
        }
    }
    if (in_planes) {
        quant_avx512_iq3_plane_signs_scales(_mm256_loadu_si256((const __m256i *)(b + QUANT_IQ3S_SIGNS)), scales, k);
        return;
    }
    QUANT_UNROLL(4)
    for (int j = 0; j < 4; j++) {
        uint64_t neg;
        memcpy(&neg, b + QUANT_IQ3S_SIGNS + 8 * j, 8);
        k->neg[j] = _cvtu64_mask64(neg);
    }
    quant_avx512_iq_scales(scales, k);
}

/* How a K super-block is decoded: the IQ3 formats by VBMI lookups (VBMI); for an act in the
 * decode's own order (REORDERED, quant_avx512_reorder_act): Q4_K, Q5_K and IQ4_XS in their
 * nibble order, the IQ3 formats at VBMI in coordinate planes. */
enum { QUANT_DECODE_VBMI = 1, QUANT_DECODE_REORDERED = 2 };

/* Whether HOW decodes the IQ3 type T in coordinate planes. */
QUANT_AVX512_INLINE int quant_avx512_in_planes(enum gguf_type t, int how) {
    return (how & QUANT_DECODE_REORDERED) && (t == GGUF_TYPE_IQ3_XXS || t == GGUF_TYPE_IQ3_S);
}

/* Super-block B of the K-like type T decoded for quant_avx512_kdot as HOW says. */
QUANT_AVX512_INLINE void quant_avx512_kdecode(enum gguf_type t, int how, const uint8_t *b, struct quant_avx512_kblock *k) {
    const int vbmi = (how & QUANT_DECODE_VBMI) != 0;
    switch (t) {
    case GGUF_TYPE_Q6_K: quant_avx512_q6k_decode(b, k); break;
    case GGUF_TYPE_Q2_K: case GGUF_TYPE_Q3_K: quant_avx512_q23k_decode(t, b, k); break;
    case GGUF_TYPE_IQ4_XS: quant_avx512_iq4xs_decode(b, (how & QUANT_DECODE_REORDERED) != 0, k); break;
    case GGUF_TYPE_IQ3_XXS: quant_avx512_iq3xxs_decode(b, vbmi, quant_avx512_in_planes(t, how), k); break;
    case GGUF_TYPE_IQ3_S: quant_avx512_iq3s_decode(b, vbmi, quant_avx512_in_planes(t, how), k); break;
    default: quant_avx512_q45k_decode(b, t == GGUF_TYPE_Q5_K, (how & QUANT_DECODE_REORDERED) != 0, k); break;
    }
}

/* quant_avx512_kdot of an IQ3 super-block decoded in coordinate planes: dword l of the 4
 * planes' products is points 4l..4l+3, all of one 32-block, so one multiply by its scale. */
QUANT_AVX512_INLINE __m256i quant_avx512_iq3_planes_dot(const struct quant_avx512_kblock *k, const int8_t *qx) {
    __m512i acc = _mm512_setzero_si512();
    QUANT_UNROLL(4)
    for (int j = 0; j < 4; j++) {
        const __m512i x = _mm512_load_si512(qx + 64 * j);
        acc = _mm512_dpbusd_epi32(acc, k->q[j], _mm512_mask_sub_epi8(x, k->neg[j], _mm512_setzero_si512(), x));
    }
    acc = _mm512_mullo_epi32(acc, k->sc[0]);
    return _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
}

/* One column's integer parts of a decoded super-block (as HOW decoded it), 8 lanes each: *is's
 * sum to the isum of quant_dot_k's float step (Q6_K's and Q3_K's quant offsets, 32 and 4, taken
 * off as that many times Σ sc_g * bsum_g), *ms's to its min term (Q4_K, Q5_K, Q2_K; else zero).
 * The IQ formats' signs apply to x: |x| <= 127, so a pair of products stays within int16. */
QUANT_AVX512_INLINE void quant_avx512_kdot(enum gguf_type t, int how, const struct quant_avx512_kblock *k, const int8_t *qx,
                                           const int16_t *bs, __m256i *is, __m256i *ms) {
    const int iq = t == GGUF_TYPE_IQ4_XS || t == GGUF_TYPE_IQ3_XXS || t == GGUF_TYPE_IQ3_S;
    *ms = _mm256_setzero_si256();
    if (quant_avx512_in_planes(t, how)) { /* IQ3: no min term */
        *is = quant_avx512_iq3_planes_dot(k, qx);
        return;
    }
    __m512i acc = _mm512_setzero_si512();
    QUANT_UNROLL(4)
    for (int j = 0; j < 4; j++) {
        __m512i x = _mm512_load_si512(qx + 64 * j);
        if (iq) x = _mm512_mask_sub_epi8(x, k->neg[j], _mm512_setzero_si512(), x);
        acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(k->q[j], x), k->sc[j]);
    }
    *is = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
    if (iq) return;
    const __m256i m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)bs), k->m);
    if (quant_k_has_min(t)) *ms = m;
    else *is = _mm256_sub_epi32(*is, _mm256_slli_epi32(m, t == GGUF_TYPE_Q6_K ? 5 : 2));
}

/* Slot I of the group at unit U: super-block U + I decoded (prefetching ahead) and its integer
 * parts for every column, or zeros from COUNT on. */
QUANT_AVX512_INLINE void quant_avx512_k_slot(enum gguf_type t, int how, const uint8_t *wb, int bb, const struct quant_q8k_view *a,
                                             int64_t u, int i, int count, __m256i (*is)[8], __m256i (*ms)[8], int NC) {
    if (i >= count) {
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) is[c][i] = ms[c][i] = _mm256_setzero_si256();
        return;
    }
    const uint8_t *b = wb + i * bb;
    for (int q = 0; q < bb; q += 64) _mm_prefetch((const char *)b + QUANT_PREFETCH + q, _MM_HINT_T0);
    struct quant_avx512_kblock k;
    quant_avx512_kdecode(t, how, b, &k);
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++)
        quant_avx512_kdot(t, how, &k, a[c].qs + (u + i) * QUANT_QK_K, a[c].bsums + (u + i) * 16, &is[c][i], &ms[c][i]);
}

/* K-like dot of one row with NC columns in quant_avx2_k's order and float steps: groups of 8
 * super-blocks give one vector of unit results per column (lane k = unit u + k) added to its
 * accumulator (u / 8) % 4, i.e. partials u % 32; a short group's empty lanes hold +0. Each
 * super-block is decoded once for all columns, as HOW says (quant_avx512_kdecode). */
QUANT_AVX512_INLINE void quant_avx512_k_loop(enum gguf_type t, int how, const uint8_t *w, const uint8_t *acts,
                                             size_t stride, int64_t n, float *y, size_t ys, int NC) {
    const int bb = gguf_type_get(t)->block_bytes;
    const int64_t nu = n / QUANT_QK_K;
    struct quant_q8k_view a[QUANT_NCOL];
    __m256 acc[QUANT_NCOL][4];
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        a[c] = quant_q8k_view(acts + (size_t)c * stride, n);
        acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = _mm256_setzero_ps();
    }
    for (int64_t u = 0; u < nu; u += 8) {
        const int count = nu - u < 8 ? (int)(nu - u) : 8;
        const uint8_t *wb = w + u * bb;
        __m256i is[QUANT_NCOL][8], ms[QUANT_NCOL][8];
        if (NC == 1) {
            QUANT_GROUP_UNROLL
            for (int i = 0; i < 8; i++) quant_avx512_k_slot(t, how, wb, bb, a, u, i, count, is, ms, NC);
        } else { /* several columns' parts live in memory anyway: unrolled, no faster */
            for (int i = 0; i < 8; i++) quant_avx512_k_slot(t, how, wb, bb, a, u, i, count, is, ms, NC);
        }
        quant_avx2_group_finish(t, wb, bb, count, a, u, is, ms, acc, NC);
    }
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) y[c * ys] = quant_avx2_reduce_rotated(acc[c], (nu + 7) / 8);
}

QUANT_AVX512_INLINE void quant_avx512_k(enum gguf_type t, const uint8_t *w, const uint8_t *acts, size_t stride,
                                        int64_t n, float *y, size_t ys, int NC) {
    quant_avx512_k_loop(t, 0, w, acts, stride, n, y, ys, NC);
}

QUANT_AVX512_INLINE void quant_avx512vbmi_k(enum gguf_type t, const uint8_t *w, const uint8_t *acts, size_t stride,
                                            int64_t n, float *y, size_t ys, int NC) {
    quant_avx512_k_loop(t, QUANT_DECODE_VBMI, w, acts, stride, n, y, ys, NC);
}

/* For an act in the decode's order (quant_avx512_reorder_act); the IQ3 formats' decode in
 * coordinate planes is the avx512vbmi level's. */
QUANT_AVX512_INLINE void quant_avx512_reordered_k(enum gguf_type t, const uint8_t *w, const uint8_t *acts, size_t stride,
                                                  int64_t n, float *y, size_t ys, int NC) {
    const int iq3 = t == GGUF_TYPE_IQ3_XXS || t == GGUF_TYPE_IQ3_S;
    quant_avx512_k_loop(t, QUANT_DECODE_REORDERED | (iq3 ? QUANT_DECODE_VBMI : 0), w, acts, stride, n, y, ys, NC);
}

/* Lane L of a group of quant_avx512_k_rows: super-block L % 2 of row L / 2, or zero integer
 * parts past the group's NR rows. */
QUANT_AVX512_INLINE void quant_avx512_pairs_lane(enum gguf_type t, int how, const uint8_t *wr, size_t rb, int bb,
                                                 struct quant_q8k_view a, int nr, int l, __m256i *is, __m256i *ms) {
    const int i = l / 2, k = l % 2;
    is[l] = ms[l] = _mm256_setzero_si256();
    if (i >= nr) return;
    struct quant_avx512_kblock kb;
    quant_avx512_kdecode(t, how, wr + (size_t)i * rb + (size_t)k * bb, &kb);
    quant_avx512_kdot(t, how, &kb, a.qs + k * QUANT_QK_K, a.bsums + k * 16, &is[l], &ms[l]);
}

/* quant_avx2_pairs_group on the AVX-512 decode: NR (1..4) rows of 2 super-blocks from WR in
 * lanes 2 * row + unit, the same float steps; the row results go to Y. The lane loop stays
 * rolled: unrolled, Q4_K spills (17 GB/s a core against 21; Q6_K 34 against 31). */
QUANT_AVX512_INLINE void quant_avx512_pairs_group(enum gguf_type t, int how, const uint8_t *wr, size_t rb, struct quant_q8k_view a,
                                                  __m256 dx, int nr, float *y) {
    const int bb = gguf_type_get(t)->block_bytes;
    __m256i is[8], ms[8];
    for (size_t q = 0; q < (size_t)nr * rb; q += 64) _mm_prefetch((const char *)wr + QUANT_PREFETCH + q, _MM_HINT_T0);
    for (int l = 0; l < 8; l++) quant_avx512_pairs_lane(t, how, wr, rb, bb, a, nr, l, is, ms);
    quant_avx2_pairs_finish(t, wr, rb, nr, dx, is, ms, y);
}

/* The largest row (elements) whose act quant_avx512_k_rows puts in the decode's order: its copy
 * lives on the stack (9.1 KiB). */
#define QUANT_REORDER_MAX 8192

/* The values of 128 at A in the order of the quants' low and high nibbles in a 64-byte load:
 * Q4_K / Q5_K 32-blocks 0, 2, 1, 3; IQ4_XS the first 16 values of blocks 0-3, then their last 16. */
QUANT_AVX512_INLINE void quant_avx512_nibble_order(enum gguf_type t, const uint8_t *a, uint8_t *buf) {
    /* the 16-byte pieces of the 128, as qwords of the two 64-byte halves */
    const __m512i first = t == GGUF_TYPE_IQ4_XS ? _mm512_set_epi64(13, 12, 9, 8, 5, 4, 1, 0) : _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0);
    const __m512i second = t == GGUF_TYPE_IQ4_XS ? _mm512_set_epi64(15, 14, 11, 10, 7, 6, 3, 2) : _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
    const __m512i lo = _mm512_loadu_si512(a), hi = _mm512_loadu_si512(a + 64);
    _mm512_store_si512(buf, _mm512_permutex2var_epi64(lo, first, hi));
    _mm512_store_si512(buf + 64, _mm512_permutex2var_epi64(lo, second, hi));
}

/* The values of 256 at A in the 4 coordinate planes of the IQ3 decode: byte i of plane j is
 * element 4i + j. A byte permute sorts each 64 by j (16 bytes each), and a 4x4 transpose of
 * 16-byte pieces gathers each j's. */
QUANT_AVX512_INLINE void quant_avx512_plane_order(const uint8_t *a, uint8_t *buf) {
    static const uint8_t by_coordinate[64] __attribute__((aligned(64))) = {
        0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61,
        2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62, 3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63,
    };
    __m512i g[4];
    QUANT_UNROLL(4)
    for (int c = 0; c < 4; c++) g[c] = quant_vbmi_permute(_mm512_load_si512(by_coordinate), _mm512_loadu_si512(a + 64 * c));
    const __m512i t01 = _mm512_shuffle_i64x2(g[0], g[1], _MM_SHUFFLE(1, 0, 1, 0)), t23 = _mm512_shuffle_i64x2(g[0], g[1], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i u01 = _mm512_shuffle_i64x2(g[2], g[3], _MM_SHUFFLE(1, 0, 1, 0)), u23 = _mm512_shuffle_i64x2(g[2], g[3], _MM_SHUFFLE(3, 2, 3, 2));
    _mm512_store_si512(buf, _mm512_shuffle_i64x2(t01, u01, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_store_si512(buf + 64, _mm512_shuffle_i64x2(t01, u01, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_store_si512(buf + 128, _mm512_shuffle_i64x2(t23, u23, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_store_si512(buf + 192, _mm512_shuffle_i64x2(t23, u23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* A copy at BUF of the Q8_K act of N elements for type T's weights with its values in the order
 * in which the decode finds the quants (QUANT_DECODE_REORDERED), so that it needs no lane
 * shuffles: quant_avx512_nibble_order, or the IQ3 formats' quant_avx512_plane_order. The integer
 * sums are exact in any order, so the bits do not change. */
QUANT_AVX512_INLINE const void *quant_avx512_reorder_act(enum gguf_type t, const void *act, int64_t n, uint8_t *buf) {
    const uint8_t *a = act;
    if (t == GGUF_TYPE_IQ3_XXS || t == GGUF_TYPE_IQ3_S)
        for (int64_t i = 0; i < n; i += QUANT_QK_K) quant_avx512_plane_order(a + i, buf + i);
    else
        for (int64_t i = 0; i < n; i += 128) quant_avx512_nibble_order(t, a + i, buf + i);
    memcpy(buf + n, a + n, quant_act_bytes(t, n) - (size_t)n);
    return buf;
}

/* quant_avx2_k_rows at this level: rows of 2 super-blocks 4 to a group of 8 lanes, other rows
 * one by one through DOT (the single-column kernel of type T, VBMI or not as these). Rows of
 * Q4_K, Q5_K, IQ4_XS and at VBMI the IQ3 formats (DOT_REORDERED given: their single-column
 * kernel for an act in the decode's order) up to QUANT_REORDER_MAX elements read the act so,
 * put so once for all NROWS rows. */
QUANT_AVX512_INLINE void quant_avx512_k_rows(enum gguf_type t, int vbmi, quant_dot_fn dot, quant_dot_fn dot_reordered, const uint8_t *w,
                                             size_t rb, int nrows, const void *act, int64_t n, float *y) {
    _Alignas(64) uint8_t reordered[QUANT_REORDER_MAX + QUANT_REORDER_MAX / 64 + QUANT_REORDER_MAX / 8];
    int how = vbmi ? QUANT_DECODE_VBMI : 0;
    if (dot_reordered && n <= QUANT_REORDER_MAX) {
        act = quant_avx512_reorder_act(t, act, n, reordered);
        dot = dot_reordered;
        how |= QUANT_DECODE_REORDERED;
    }
    if (n != 2 * QUANT_QK_K) {
        for (int r = 0; r < nrows; r++) y[r] = dot(w + (size_t)r * rb, act, n);
        return;
    }
    const struct quant_q8k_view a = quant_q8k_view(act, n);
    const __m256 dx = _mm256_setr_ps(a.d[0], a.d[1], a.d[0], a.d[1], a.d[0], a.d[1], a.d[0], a.d[1]);
    int r = 0;
    for (; r + 4 <= nrows; r += 4) quant_avx512_pairs_group(t, how, w + (size_t)r * rb, rb, a, dx, 4, y + r);
    if (r < nrows) quant_avx512_pairs_group(t, how, w + (size_t)r * rb, rb, a, dx, nrows - r, y + r);
}

/* quant_avx512_pairs_group for NC (1..QUANT_NCOL) columns, acts STRIDE apart: each lane's
 * super-block decoded once for all of them, the row results of column c to Y + c * YS. */
QUANT_AVX512_INLINE void quant_avx512_pairs_cols_group(enum gguf_type t, const uint8_t *wr, size_t rb, const uint8_t *acts,
                                                       size_t stride, int nr, int NC, float *y, size_t ys) {
    const int bb = gguf_type_get(t)->block_bytes;
    struct quant_q8k_view a[QUANT_NCOL];
    __m256i is[QUANT_NCOL][8], ms[QUANT_NCOL][8];
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) a[c] = quant_q8k_view(acts + (size_t)c * stride, 2 * QUANT_QK_K);
    for (size_t q = 0; q < (size_t)nr * rb; q += 64) _mm_prefetch((const char *)wr + QUANT_PREFETCH + q, _MM_HINT_T0);
    for (int l = 0; l < 8; l++) {
        const int i = l / 2, k = l % 2;
        if (i >= nr) {
            QUANT_UNROLL(4)
            for (int c = 0; c < NC; c++) is[c][l] = ms[c][l] = _mm256_setzero_si256();
            continue;
        }
        struct quant_avx512_kblock kb;
        quant_avx512_kdecode(t, 0, wr + (size_t)i * rb + (size_t)k * bb, &kb);
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) quant_avx512_kdot(t, 0, &kb, a[c].qs + k * QUANT_QK_K, a[c].bsums + k * 16, &is[c][l], &ms[c][l]);
    }
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        const __m256 dx = _mm256_setr_ps(a[c].d[0], a[c].d[1], a[c].d[0], a[c].d[1], a[c].d[0], a[c].d[1], a[c].d[0], a[c].d[1]);
        quant_avx2_pairs_finish(t, wr, rb, nr, dx, is[c], ms[c], y + (size_t)c * ys);
    }
}

/* quant_pairs at this level: 4 rows at a time, QUANT_NCOL columns at a time. One finish (the
 * float steps and the butterfly, in vector lanes) serves 4 rows instead of one row: quant_dotn's
 * per-row finish is as long as a row's two super-blocks of work. */
QUANT_AVX512_INLINE void quant_avx512_pairs_cols(enum gguf_type t, const uint8_t *w, size_t rb, int nrows, const uint8_t *acts,
                                                 size_t stride, int nc, float *y, size_t ys) {
    for (int r = 0; r < nrows; r += 4)
        for (int c0 = 0; c0 < nc; c0 += QUANT_NCOL) {
            const int nr = nrows - r < 4 ? nrows - r : 4;
            const uint8_t *wr = w + (size_t)r * rb, *ac = acts + (size_t)c0 * stride;
            float *yc = y + (size_t)c0 * ys + r;
            switch (nc - c0 < QUANT_NCOL ? nc - c0 : QUANT_NCOL) { /* the column count constant in each body */
            case 1: quant_avx512_pairs_cols_group(t, wr, rb, ac, stride, nr, 1, yc, ys); break;
            case 2: quant_avx512_pairs_cols_group(t, wr, rb, ac, stride, nr, 2, yc, ys); break;
            case 3: quant_avx512_pairs_cols_group(t, wr, rb, ac, stride, nr, 3, yc, ys); break;
            default: quant_avx512_pairs_cols_group(t, wr, rb, ac, stride, nr, 4, yc, ys); break;
            }
        }
}

/* f32 -> nearest-even fp16 -> f32 in F16C, as quant_f32_to_f16 (the scalar call would also
 * cost SSE/AVX transitions here: measured 4x slower). */
QUANT_AVX512_INLINE float quant_avx512_f16_round(float f) {
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
}

/* Q8 activation (see quant_act_q8), 32 elements at a time; float steps as the scalar. */
static QUANT_AVX512 void quant_act_q8_avx512(const float *x, int64_t n, void *act) {
    uint8_t *a = act;
    int8_t *qs = (int8_t *)a;
    float *dd = (float *)(a + n);
    int32_t *ss = (int32_t *)(a + n + 4 * (n / QUANT_QK));
    float *sd = (float *)(a + n + 8 * (n / QUANT_QK));
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512i mant = _mm512_set1_epi32(0x007fffff), bias = _mm512_set1_epi32(0x00400000);
    for (int64_t b = 0; b < n / QUANT_QK; b++) {
        __m512 x0 = _mm512_loadu_ps(x + b * QUANT_QK), x1 = _mm512_loadu_ps(x + b * QUANT_QK + 16);
        /* max(v, acc) returns acc when v is NaN, as fmaxf skips it */
        __m512 m = _mm512_max_ps(_mm512_abs_ps(x1), _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps()));
        const float amax = _mm512_reduce_max_ps(m);
        const float d = amax / 127.0f, d16 = quant_avx512_f16_round(d);
        const __m512 id = _mm512_set1_ps(d16 != 0.0f ? 127.0f / amax : 0.0f);
        __m512i q0 = _mm512_sub_epi32(_mm512_and_si512(_mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps(x0, id), magic)), mant), bias);
        __m512i q1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps(x1, id), magic)), mant), bias);
        _mm_storeu_si128((__m128i *)(qs + b * QUANT_QK), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(qs + b * QUANT_QK + 16), _mm512_cvtepi32_epi8(q1));
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        dd[b] = d16;
        ss[b] = sum;
        sd[b] = quant_avx512_f16_round(d * (float)sum);
    }
}

/* Q8_K activation (see quant_act_q8k): the signed max is the first element of largest
 * magnitude, found by comparing with the maximum. */
static QUANT_AVX512 void quant_act_q8k_avx512(const float *x, int64_t n, void *act) {
    uint8_t *a = act;
    int8_t *qs = (int8_t *)a;
    float *dd = (float *)(a + n);
    int16_t *bs = (int16_t *)(a + n + 4 * (n / QUANT_QK_K));
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512i mant = _mm512_set1_epi32(0x007fffff), bias = _mm512_set1_epi32(0x00400000);
    for (int64_t b = 0; b < n / QUANT_QK_K; b++) {
        const float *xb = x + b * QUANT_QK_K;
        __m512 m = _mm512_setzero_ps();
        for (int j = 0; j < QUANT_QK_K; j += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb + j)), m);
        const float amax = _mm512_reduce_max_ps(m);
        float max = 0.0f;
        for (int j = 0; amax != 0.0f && j < QUANT_QK_K; j += 16) {
            __mmask16 hit = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(xb + j)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
            if (hit) { max = xb[j + __builtin_ctz(hit)]; break; }
        }
        float iscale = amax != 0.0f ? -127.0f / max : 0.0f;
        if (isinf(iscale)) iscale = 0.0f;
        const __m512 is = _mm512_set1_ps(iscale);
        for (int j = 0; j < QUANT_QK_K; j += 16) {
            __m512i v = _mm512_setzero_si512();
            if (iscale != 0.0f)
                v = _mm512_sub_epi32(_mm512_and_si512(_mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps(is, _mm512_loadu_ps(xb + j)), magic)), mant), bias);
            v = _mm512_min_epi32(v, _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *)(qs + b * QUANT_QK_K + j), _mm512_cvtepi32_epi8(v));
            /* the bsum adds the stored int8 values */
            bs[b * 16 + j / 16] = (int16_t)_mm512_reduce_add_epi32(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24));
        }
        dd[b] = iscale != 0.0f ? 1.0f / iscale : 0.0f;
    }
}

/* x rounded to fp16 (F16C, nearest-even as quant_f32_to_f16) or bf16 (the integer steps of
 * quant_f32_to_bf16), 16 at a time; the tail goes through the scalar conversions. */
static QUANT_AVX512 void quant_act_round_avx512(enum gguf_type wtype, const float *x, int64_t n, float *f) {
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        if (wtype == GGUF_TYPE_F16) {
            v = _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        } else {
            __m512i u = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
            __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
            __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, abs), inf);
            r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));   /* quiet NaN */
            v = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
        }
        _mm512_storeu_ps(f + i, v);
    }
    for (; i < n; i++)
        f[i] = wtype == GGUF_TYPE_F16 ? quant_f16_to_f32(quant_f32_to_f16(x[i])) : quant_bf16_to_f32(quant_f32_to_bf16(x[i]));
}

#define QUANT_AVX512_WRAP(name, kernel, type)                                                        \
    QUANT_COLUMNS(name##n, QUANT_AVX512, kernel, type, QUANT_NCOL)                                   \
    QUANT_SINGLE_COLUMN(name, QUANT_AVX512, kernel, type)
QUANT_AVX512_WRAP(quant_dot_f32_avx512, quant_avx512_float, GGUF_TYPE_F32)
QUANT_AVX512_WRAP(quant_dot_f16_avx512, quant_avx512_float, GGUF_TYPE_F16)
QUANT_AVX512_WRAP(quant_dot_bf16_avx512, quant_avx512_float, GGUF_TYPE_BF16)
QUANT_AVX512_WRAP(quant_dot_q8_0_avx512, quant_avx512_legacy, GGUF_TYPE_Q8_0)
QUANT_AVX512_WRAP(quant_dot_q4_0_avx512, quant_avx512_legacy, GGUF_TYPE_Q4_0)
QUANT_AVX512_WRAP(quant_dot_q4_1_avx512, quant_avx512_legacy, GGUF_TYPE_Q4_1)
QUANT_AVX512_WRAP(quant_dot_q5_0_avx512, quant_avx512_legacy, GGUF_TYPE_Q5_0)
QUANT_AVX512_WRAP(quant_dot_q5_1_avx512, quant_avx512_legacy, GGUF_TYPE_Q5_1)
QUANT_AVX512_WRAP(quant_dot_q4_k_avx512, quant_avx512_k, GGUF_TYPE_Q4_K)
QUANT_AVX512_WRAP(quant_dot_q5_k_avx512, quant_avx512_k, GGUF_TYPE_Q5_K)
QUANT_AVX512_WRAP(quant_dot_q6_k_avx512, quant_avx512_k, GGUF_TYPE_Q6_K)
QUANT_AVX512_WRAP(quant_dot_q2_k_avx512, quant_avx512_k, GGUF_TYPE_Q2_K)
QUANT_AVX512_WRAP(quant_dot_q3_k_avx512, quant_avx512_k, GGUF_TYPE_Q3_K)
QUANT_AVX512_WRAP(quant_dot_iq4_xs_avx512, quant_avx512_k, GGUF_TYPE_IQ4_XS)
QUANT_AVX512_WRAP(quant_dot_iq3_xxs_avx512, quant_avx512_k, GGUF_TYPE_IQ3_XXS)
QUANT_AVX512_WRAP(quant_dot_iq3_s_avx512, quant_avx512_k, GGUF_TYPE_IQ3_S)
QUANT_AVX512_WRAP(quant_dot_iq3_xxs_avx512vbmi, quant_avx512vbmi_k, GGUF_TYPE_IQ3_XXS)
QUANT_AVX512_WRAP(quant_dot_iq3_s_avx512vbmi, quant_avx512vbmi_k, GGUF_TYPE_IQ3_S)
QUANT_AVX512_WRAP(quant_dot_iq4_nl_avx512, quant_avx512_legacy, GGUF_TYPE_IQ4_NL)
QUANT_AVX512_WRAP(quant_dot_mxfp4_avx512, quant_avx512_legacy, GGUF_TYPE_MXFP4)

/* The single-column kernels for an act in the decode's order (quant_avx512_reorder_act). */
QUANT_COLUMN(quant_dot_q4_k_avx512_reordered, QUANT_AVX512, quant_avx512_reordered_k, GGUF_TYPE_Q4_K)
QUANT_COLUMN(quant_dot_q5_k_avx512_reordered, QUANT_AVX512, quant_avx512_reordered_k, GGUF_TYPE_Q5_K)
QUANT_COLUMN(quant_dot_iq4_xs_avx512_reordered, QUANT_AVX512, quant_avx512_reordered_k, GGUF_TYPE_IQ4_XS)
QUANT_COLUMN(quant_dot_iq3_xxs_avx512vbmi_reordered, QUANT_AVX512, quant_avx512_reordered_k, GGUF_TYPE_IQ3_XXS)
QUANT_COLUMN(quant_dot_iq3_s_avx512vbmi_reordered, QUANT_AVX512, quant_avx512_reordered_k, GGUF_TYPE_IQ3_S)

#define QUANT_AVX512_ROWS(name, type, vbmi, dot, dot_reordered)                                      \
    static QUANT_AVX512 void name(const uint8_t *w, size_t rb, int nrows, const void *act, int64_t n, \
                                  float *y) { quant_avx512_k_rows(type, vbmi, dot, dot_reordered, w, rb, nrows, act, n, y); }
QUANT_AVX512_ROWS(quant_dotr_q4_k_avx512, GGUF_TYPE_Q4_K, 0, quant_dot_q4_k_avx512, quant_dot_q4_k_avx512_reordered)
QUANT_AVX512_ROWS(quant_dotr_q5_k_avx512, GGUF_TYPE_Q5_K, 0, quant_dot_q5_k_avx512, quant_dot_q5_k_avx512_reordered)
QUANT_AVX512_ROWS(quant_dotr_q6_k_avx512, GGUF_TYPE_Q6_K, 0, quant_dot_q6_k_avx512, NULL)
QUANT_AVX512_ROWS(quant_dotr_q2_k_avx512, GGUF_TYPE_Q2_K, 0, quant_dot_q2_k_avx512, NULL)
QUANT_AVX512_ROWS(quant_dotr_q3_k_avx512, GGUF_TYPE_Q3_K, 0, quant_dot_q3_k_avx512, NULL)
QUANT_AVX512_ROWS(quant_dotr_iq4_xs_avx512, GGUF_TYPE_IQ4_XS, 0, quant_dot_iq4_xs_avx512, quant_dot_iq4_xs_avx512_reordered)
QUANT_AVX512_ROWS(quant_dotr_iq3_xxs_avx512, GGUF_TYPE_IQ3_XXS, 0, quant_dot_iq3_xxs_avx512, NULL)
QUANT_AVX512_ROWS(quant_dotr_iq3_s_avx512, GGUF_TYPE_IQ3_S, 0, quant_dot_iq3_s_avx512, NULL)
QUANT_AVX512_ROWS(quant_dotr_iq3_xxs_avx512vbmi, GGUF_TYPE_IQ3_XXS, 1, quant_dot_iq3_xxs_avx512vbmi, quant_dot_iq3_xxs_avx512vbmi_reordered)
QUANT_AVX512_ROWS(quant_dotr_iq3_s_avx512vbmi, GGUF_TYPE_IQ3_S, 1, quant_dot_iq3_s_avx512vbmi, quant_dot_iq3_s_avx512vbmi_reordered)

#define QUANT_AVX512_LEGACY_ROWS(name, type, dot)                                                    \
    static QUANT_AVX512 void name(const uint8_t *w, size_t rb, int nrows, const void *act, int64_t n, \
                                  float *y) { quant_avx512_legacy_rows(type, dot, w, rb, nrows, act, n, y); }
QUANT_AVX512_LEGACY_ROWS(quant_dotr_q8_0_avx512, GGUF_TYPE_Q8_0, quant_dot_q8_0_avx512)
QUANT_AVX512_LEGACY_ROWS(quant_dotr_q4_0_avx512, GGUF_TYPE_Q4_0, quant_dot_q4_0_avx512)
QUANT_AVX512_LEGACY_ROWS(quant_dotr_q4_1_avx512, GGUF_TYPE_Q4_1, quant_dot_q4_1_avx512)
QUANT_AVX512_LEGACY_ROWS(quant_dotr_q5_0_avx512, GGUF_TYPE_Q5_0, quant_dot_q5_0_avx512)
QUANT_AVX512_LEGACY_ROWS(quant_dotr_q5_1_avx512, GGUF_TYPE_Q5_1, quant_dot_q5_1_avx512)
QUANT_AVX512_LEGACY_ROWS(quant_dotr_iq4_nl_avx512, GGUF_TYPE_IQ4_NL, quant_dot_iq4_nl_avx512)
QUANT_AVX512_LEGACY_ROWS(quant_dotr_mxfp4_avx512, GGUF_TYPE_MXFP4, quant_dot_mxfp4_avx512)

#define QUANT_AVX512_PAIRS(name, type)                                                                             \
    static QUANT_AVX512 void name(const uint8_t *w, size_t rb, int nrows, const uint8_t *acts, size_t stride, int nc, \
                                  float *y, size_t ys) { quant_avx512_pairs_cols(type, w, rb, nrows, acts, stride, nc, y, ys); }
QUANT_AVX512_PAIRS(quant_pairs_q4_k_avx512, GGUF_TYPE_Q4_K)
QUANT_AVX512_PAIRS(quant_pairs_q5_k_avx512, GGUF_TYPE_Q5_K)
QUANT_AVX512_PAIRS(quant_pairs_q6_k_avx512, GGUF_TYPE_Q6_K)
QUANT_AVX512_PAIRS(quant_pairs_q2_k_avx512, GGUF_TYPE_Q2_K)
QUANT_AVX512_PAIRS(quant_pairs_q3_k_avx512, GGUF_TYPE_Q3_K)
QUANT_AVX512_PAIRS(quant_pairs_iq4_xs_avx512, GGUF_TYPE_IQ4_XS)

/* ---- Q4_K, Q5_K, Q8_0 and Q4_0 tiles: 16 rows by a batch of columns (AVX-512 VNNI) ----
 * A prompt's product runs every row against many columns. quant_dotn decodes a row once for 4
 * columns, then reduces each super-block's 16 integer lanes to one sum per column. A tile instead
 * unpacks 16 rows once for all the columns, rows in lanes (dword r of q[k] holds elements
 * 4k..4k+3 of row r), so one vpdpbusd adds 4 products for each of 16 rows and no lane sum is
 * needed: a super-block's integer parts come out as one vector of 16 rows, then quant_dot_k's
 * float step and partials (u % 32, then the 16,8,4,2,1 butterfly) run on 16 rows at a time.
 * The same bits as quant_dot_k. One core, 16 rows of 2048 columns in cache: 512 columns 195-202
 * GMAC/s against quant_dotn's 65-74, 64 columns 160-180 against 87. In the model the trunk's
 * Q4_K and Q5_K products of a 512-token prompt took ~35% less time. 8 columns a pass were no
 * faster than 4. Q8_0 and Q4_0 tiles do the same per 32-element block (quant_legacy_units' float
 * step, its unit a block); one core, 256 rows of 2048 in cache, GMAC/s against quant_dotn: Q8_0
 * 512 columns 188-190 against 87-90, 256 177-190 against 88-93; Q4_0 256 columns 180 against
 * 116-118. The unpack (rows into lanes) is what a few columns pay for: by transposes, one core,
 * 200 experts' 512 x 2048 (cold, as an expert's are), GMAC/s at 8 / 16 / 32 columns against
 * quant_dotn: Q4_K 73-77 / 103-109 / 122-139 against 84-92; Q5_K 66-69 / 100-103 / 129-135
 * against 71-76; Q8_0 64-68 / 95-99 / 127-128 against 84-88; Q4_0 78-79 / 87-111 / 137 against
 * 84-113. By gathers they were 50-55 / 82-86 / 108-120 (Q4_K), 29 / 51-53 / 80-84 (Q8_0), 39-40 /
 * 66-67 / 98 (Q4_0): the tiles then started at 32 columns, now at QUANT_TILE_MIN_NC. */
#define QUANT_TILE_ROWS 16    /* = OPS_ROW_CHUNK, the rows of a work item */
#define QUANT_TILE_NC 4       /* columns a pass: each weight vector loaded once for them */
#define QUANT_TILE_MIN_NC 16

/* One super-block of 16 rows unpacked: q[k][4r..4r+3] elements 4k..4k+3 of row r; sc[j] the
 * scale of sub-block j in int32 lanes, mn[j] its min as the int16 pair (m, m), for vpdpwssd
 * against the pair of the act's 16-element sums that make sub-block j's. */
struct quant_q45k_tile { uint8_t q[64][64]; int32_t sc[8][16]; int16_t mn[8][32]; float d[16], dmin[16]; };

/* One Q8_0 or Q4_0 block of 16 rows unpacked: q[k][4r..4r+3] elements 4k..4k+3 of row r plus
 * 128 (Q8_0) or as stored, 0..15 (Q4_0: less 8), as vpdpbusd's unsigned bytes (the offset comes
 * off as that many times the act block's sum), d the scales. */
struct quant_legacy_tile { uint8_t q[8][64]; float d[16]; };

/* A K tile's bytes: quant_q45k_tile's (AVX-512), the same as quant_avx2_k_tile's. */
#define QUANT_K_TILE_BYTES sizeof(struct quant_q45k_tile)

/* Bytes of scratch quant_tile needs for rows of N elements of type T: the unpacked rows, then the
 * partials of QUANT_TILE_NC columns. */
static size_t quant_tile_bytes(enum gguf_type t, int64_t n) {
    size_t rows = t == GGUF_TYPE_Q8_0 || t == GGUF_TYPE_Q4_0 ? (size_t)(n / QUANT_QK) * sizeof(struct quant_legacy_tile)
                                                             : (size_t)(n / QUANT_QK_K) * QUANT_K_TILE_BYTES;
    return rows + (size_t)QUANT_TILE_NC * QUANT_NPART * 16 * sizeof(float);
}

/* The lane offsets of 16 rows RB bytes apart, for gathers across them. */
QUANT_AVX512_INLINE __m512i quant_tile_rows(size_t rb) {
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32((int)rb));
}

/* Bits [8 BYTE, 8 BYTE + BITS) of each lane. */
QUANT_AVX512_INLINE __m512i quant_tile_field(__m512i v, int byte, int bits) {
    return _mm512_and_si512(_mm512_srli_epi32(v, 8 * byte), _mm512_set1_epi32((1 << bits) - 1));
}

/* Lane r of out[m] = dword m (< 8) of the 32 bytes at P + r * RB, for 16 rows: an 8x8 dword
 * transpose in each 256-bit half (rows r and r + 4 share a register), then one lane shuffle an
 * output. 40 operations instead of 8 gathers. */
QUANT_AVX512_INLINE void quant_tile_transpose(const uint8_t *p, size_t rb, __m512i *out) {
    __m512i z[8], t[8], u[8];
    QUANT_UNROLL(8)
    for (int i = 0; i < 8; i++) {
        const size_t r = i < 4 ? (size_t)i : (size_t)i + 4; /* rows 0-3 and 8-11, each beside the row 4 on */
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + r * rb))),
                                  _mm256_loadu_si256((const __m256i *)(p + (r + 4) * rb)), 1);
    }
    QUANT_UNROLL(4)
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
    }
    QUANT_UNROLL(2)
    for (int g = 0; g < 8; g += 4) { /* u[g + k]: dword k of 4 rows in lanes 0 and 2, dword k + 4 in lanes 1 and 3 */
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    QUANT_UNROLL(4)
    for (int k = 0; k < 4; k++) {
        out[k] = _mm512_shuffle_i32x4(u[k], u[k + 4], _MM_SHUFFLE(2, 0, 2, 0));
        out[k + 4] = _mm512_shuffle_i32x4(u[k], u[k + 4], _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* quant_tile_transpose for 16 bytes a row (dwords m < 4): rows r, r + 4, r + 8, r + 12 in one
 * register, then a 4x4 dword transpose in each 128-bit lane. */
QUANT_AVX512_INLINE void quant_tile_transpose4(const uint8_t *p, size_t rb, __m512i *out) {
    __m512i z[4], t[4];
    QUANT_UNROLL(4)
    for (int i = 0; i < 4; i++) {
        z[i] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + (size_t)i * rb)));
        z[i] = _mm512_inserti32x4(z[i], _mm_loadu_si128((const __m128i *)(p + (size_t)(i + 4) * rb)), 1);
        z[i] = _mm512_inserti32x4(z[i], _mm_loadu_si128((const __m128i *)(p + (size_t)(i + 8) * rb)), 2);
        z[i] = _mm512_inserti32x4(z[i], _mm_loadu_si128((const __m128i *)(p + (size_t)(i + 12) * rb)), 3);
    }
    t[0] = _mm512_unpacklo_epi32(z[0], z[1]);
    t[1] = _mm512_unpackhi_epi32(z[0], z[1]);
    t[2] = _mm512_unpacklo_epi32(z[2], z[3]);
    t[3] = _mm512_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm512_unpacklo_epi64(t[0], t[2]);
    out[1] = _mm512_unpackhi_epi64(t[0], t[2]);
    out[2] = _mm512_unpacklo_epi64(t[1], t[3]);
    out[3] = _mm512_unpackhi_epi64(t[1], t[3]);
}

/* quant_k4_scale_min of sub-block J for 16 rows in lanes, from U0-U2, dwords 1-3 (bytes 4-15)
 * of each row's super-block: *SC the scale, *MN the min as the int16 pair (m, m), for vpdpwssd
 * against the act's two 16-element sums that make sub-block J's. */
QUANT_AVX512_INLINE void quant_tile_k4_field(__m512i u0, __m512i u1, __m512i u2, int j, __m512i *sc, __m512i *mn) {
    const __m512i six = _mm512_set1_epi32(63), bs = quant_tile_field(u0, j % 4, 8), bm = quant_tile_field(u1, j % 4, 8);
    __m512i m;
    if (j < 4) {
        *sc = _mm512_and_si512(bs, six);
        m = _mm512_and_si512(bm, six);
    } else {
        *sc = _mm512_or_si512(quant_tile_field(u2, j - 4, 4), _mm512_slli_epi32(_mm512_srli_epi32(bs, 6), 4));
        m = _mm512_or_si512(_mm512_srli_epi32(quant_tile_field(u2, j - 4, 8), 4), _mm512_slli_epi32(_mm512_srli_epi32(bm, 6), 4));
    }
    *mn = _mm512_or_si512(m, _mm512_slli_epi32(m, 16));
}

/* Super-block U of the 16 rows at W (RB bytes apart) of a Q4_K or (FIVE) Q5_K matrix into T:
 * dword m of a 32-byte run of nibbles holds elements 4m..4m+3 of one sub-block (low nibbles)
 * and of the next (high), and Q5_K's dword m of qh their fifth bits (bit s of a byte:
 * sub-block s), each run turned rows-in-lanes by quant_tile_transpose; the scale bytes and d,
 * dmin come as 4 more dwords a row by gathers, unpacked as quant_k4_scale_min in 32-bit lanes.
 * Scalar loops took 3.2 us for 8 Q4_K super-blocks, gathers of every dword 1.8 (the section's
 * head has the transposes' figures). */
QUANT_AVX512_INLINE void quant_q45k_tile_unpack(const uint8_t *w, size_t rb, int64_t u, int five, struct quant_q45k_tile *t) {
    const __m512i rows = quant_tile_rows(rb);
    const uint8_t *b = w + (size_t)u * (five ? 176 : 144), *ql = b + 16 + 32 * five;
    const __m512i m4 = _mm512_set1_epi32(0x0f0f0f0f), ones = _mm512_set1_epi32(0x01010101);
    __m512i qh[8], v[8];
    QUANT_UNROLL(8)
    for (int m = 0; m < 8; m++) qh[m] = _mm512_setzero_si512();
    if (five) quant_tile_transpose(b + 16, rb, qh);
    QUANT_UNROLL(4)
    for (int h = 0; h < 4; h++) {
        quant_tile_transpose(ql + 32 * h, rb, v);
        QUANT_UNROLL(8)
        for (int m = 0; m < 8; m++) {
            const __m512i hi0 = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh[m], 2 * h), ones), 4);
            const __m512i hi1 = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh[m], 2 * h + 1), ones), 4);
            _mm512_storeu_si512(t->q[16 * h + m], _mm512_or_si512(_mm512_and_si512(v[m], m4), hi0));
            _mm512_storeu_si512(t->q[16 * h + 8 + m], _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v[m], 4), m4), hi1));
        }
    }
    const __m512i dd = _mm512_i32gather_epi32(rows, b, 1), u0 = _mm512_i32gather_epi32(rows, b + 4, 1);
    const __m512i u1 = _mm512_i32gather_epi32(rows, b + 8, 1), u2 = _mm512_i32gather_epi32(rows, b + 12, 1);
    _mm512_storeu_ps(t->d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd)));
    _mm512_storeu_ps(t->dmin, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16))));
    QUANT_UNROLL(8)
    for (int j = 0; j < 8; j++) {
        __m512i sc, mn;
        quant_tile_k4_field(u0, u1, u2, j, &sc, &mn);
        _mm512_storeu_si512(t->sc[j], sc);
        _mm512_storeu_si512(t->mn[j], mn);
    }
}

/* Partial PP (slot u % 32 of its column) plus R, for unit U: a slot's first unit (u < 32) is added
 * to +0 without reading the slot, so that no pass clears its partials first (the clearing
 * memsets were 8% of a prompt's time). 0 + r, as before: -0 becomes +0 the same way. */
QUANT_AVX512_INLINE void quant_tile_partial_add(float *pp, int64_t u, __m512 r) {
    _mm512_storeu_ps(pp, _mm512_add_ps(u < QUANT_NPART ? _mm512_setzero_ps() : _mm512_loadu_ps(pp), r));
}

/* quant_dot_k's float step for super-block U of 16 rows in lanes (scales D, DMIN) and the
 * integer parts of NC columns: each column's unit result added to its partial P[c][u % 32]. */
QUANT_AVX512_INLINE void quant_tile_k_step(__m512 d, __m512 dmin, const struct quant_q8k_view *a, int64_t u, const __m512i *isum,
                                           const __m512i *msum, float (*p)[QUANT_NPART][16], int NC) {
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        const __m512 dx = _mm512_set1_ps(a[c].d[u]);
        const __m512 r = _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum[c])),
                                       _mm512_mul_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(msum[c])));
        quant_tile_partial_add(p[c][u % QUANT_NPART], u, r);
    }
}

/* Super-block U of a tile against 4 columns: each one's unit result, 16 rows, added to its
 * partial P[c][u % 32]. */
QUANT_AVX512_INLINE void quant_tile_unit(const struct quant_q45k_tile *t, const struct quant_q8k_view *a, int64_t u,
                                         float (*p)[QUANT_NPART][16]) {
    __m512i isum[QUANT_TILE_NC], msum[QUANT_TILE_NC];
    QUANT_UNROLL(4)
    for (int c = 0; c < QUANT_TILE_NC; c++) isum[c] = msum[c] = _mm512_setzero_si512();
    QUANT_UNROLL(8)
    for (int j = 0; j < 8; j++) {
        __m512i s[QUANT_TILE_NC];
        QUANT_UNROLL(4)
        for (int c = 0; c < QUANT_TILE_NC; c++) s[c] = _mm512_setzero_si512();
        QUANT_UNROLL(8)
        for (int k = 8 * j; k < 8 * j + 8; k++) {
            const __m512i wq = _mm512_loadu_si512(t->q[k]);
            QUANT_UNROLL(4)
            for (int c = 0; c < QUANT_TILE_NC; c++)
                s[c] = _mm512_dpbusd_epi32(s[c], wq, _mm512_set1_epi32(quant_rd32(a[c].qs + u * QUANT_QK_K + 4 * k)));
        }
        const __m512i sc = _mm512_loadu_si512(t->sc[j]), mn = _mm512_loadu_si512(t->mn[j]);
        QUANT_UNROLL(4)
        for (int c = 0; c < QUANT_TILE_NC; c++) {
            isum[c] = _mm512_add_epi32(isum[c], _mm512_mullo_epi32(s[c], sc));
            msum[c] = _mm512_dpwssd_epi32(msum[c], mn, _mm512_set1_epi32(quant_rd32(a[c].bsums + u * 16 + 2 * j)));
        }
    }
    quant_tile_k_step(_mm512_loadu_ps(t->d), _mm512_loadu_ps(t->dmin), a, u, isum, msum, p, QUANT_TILE_NC);
}

/* The first CC columns' partials P (USED of them reached, the rest +0) summed by quant_reduce32's
 * butterfly into y[c * ys + r]. The adds of a partial from USED on, +0, are left out: a partial
 * (0 + r, then sums of such) is never -0, so adding +0 changes no bit. Not inlined: inlined, it
 * changed the register allocation of the kernels around it (one core in cache: Q8_0 tiles 2048
 * columns x 256 5% slower, then 4% faster out of line; interleaved Q4_K rows of 512, 16
 * columns, 100 -> 83 us). */
static QUANT_AVX512 __attribute__((noinline)) void quant_tile_finish(float (*p)[QUANT_NPART][16], int used, int cc, float *y, size_t ys) {
    for (int c = 0; c < cc; c++) {
        for (int s = QUANT_NPART / 2; s > 0; s /= 2)
            for (int i = 0; i < s && i + s < used; i++)
                _mm512_storeu_ps(p[c][i], _mm512_add_ps(_mm512_loadu_ps(p[c][i]), _mm512_loadu_ps(p[c][i + s])));
        _mm512_storeu_ps(y + (size_t)c * ys, _mm512_loadu_ps(p[c][0]));
    }
}

/* Before the 16 rows at W (RB bytes apart) are unpacked: the next 16 into L2 while these compute
 * (a thread's chunks are mostly consecutive); the unpack's gathers would otherwise wait on 16
 * rows' misses at a time. */
QUANT_AVX512_INLINE void quant_tile_prefetch_next(const uint8_t *w, size_t rb) {
    for (size_t q = 0; q < QUANT_TILE_ROWS * rb; q += 64) _mm_prefetch((const char *)w + QUANT_TILE_ROWS * rb + q, _MM_HINT_T1);
}

/* y[c * ys + r] = the dot of row r (of the 16 at W, RB bytes apart; Q4_K, or Q5_K if FIVE) with
 * column c (its act at ACTS + c * STRIDE), for c < NC; SCRATCH holds quant_tile_bytes(t, n). */
static QUANT_AVX512 void quant_tile_q45k_avx512(const uint8_t *w, size_t rb, int five, const uint8_t *acts, size_t stride, int nc,
                                               int64_t n, float *y, size_t ys, void *scratch) {
    const int64_t nu = n / QUANT_QK_K;
    const int used = nu < QUANT_NPART ? (int)nu : QUANT_NPART; /* partials a unit reaches */
    struct quant_q45k_tile *tiles = scratch;
    float (*p)[QUANT_NPART][16] = (void *)(tiles + nu);
    quant_tile_prefetch_next(w, rb);
    for (int64_t u = 0; u < nu; u++) quant_q45k_tile_unpack(w, rb, u, five, &tiles[u]);
    for (int c0 = 0; c0 < nc; c0 += QUANT_TILE_NC) {
        const int cc = nc - c0 < QUANT_TILE_NC ? nc - c0 : QUANT_TILE_NC;
        struct quant_q8k_view a[QUANT_TILE_NC]; /* a short pass repeats its first column, not stored */
        for (int c = 0; c < QUANT_TILE_NC; c++) a[c] = quant_q8k_view(acts + (size_t)(c0 + (c < cc ? c : 0)) * stride, n);
        for (int64_t u = 0; u < nu; u++) quant_tile_unit(&tiles[u], a, u, p);
        quant_tile_finish(p, used, cc, y + (size_t)c0 * ys, ys);
    }
}

/* Block B of the 16 rows at W (RB bytes apart) of a Q8_0 (FOUR: Q4_0) matrix into T: dword k of
 * the block's quants gathered across the rows (Q4_0: dword m of its 16 bytes holds elements
 * 4m..4m+3 in the low nibbles, 16 + 4m.. in the high ones), and d with 2 quant bytes (its fp16
 * in the low half). */
QUANT_AVX512_INLINE void quant_legacy_tile_unpack(const uint8_t *w, size_t rb, int four, int64_t b, struct quant_legacy_tile *t) {
    const __m512i rows = quant_tile_rows(rb);
    const uint8_t *blk = w + (size_t)b * (four ? 18 : 34);
    if (four) {
        const __m512i m4 = _mm512_set1_epi8(0x0f);
        __m512i v[4];
        quant_tile_transpose4(blk + 2, rb, v);
        QUANT_UNROLL(4)
        for (int m = 0; m < 4; m++) {
            _mm512_storeu_si512(t->q[m], _mm512_and_si512(v[m], m4));
            _mm512_storeu_si512(t->q[4 + m], _mm512_and_si512(_mm512_srli_epi32(v[m], 4), m4));
        }
    } else {
        __m512i v[8];
        quant_tile_transpose(blk + 2, rb, v);
        QUANT_UNROLL(8)
        for (int k = 0; k < 8; k++) _mm512_storeu_si512(t->q[k], _mm512_xor_si512(v[k], _mm512_set1_epi8((char)0x80)));
    }
    _mm512_storeu_ps(t->d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(rows, blk, 1))));
}

/* Block B of a legacy tile against 4 columns: quant_legacy_units' unit, (dw * dx) * isum, for 16
 * rows, added to each column's partial P[c][b % 32]. The integer sum starts at -OFFSET (128 or
 * 8) times the act block's sum: every addend an integer well inside int32, so the sum is exact. */
QUANT_AVX512_INLINE void quant_legacy_tile_unit(const struct quant_legacy_tile *t, const struct quant_q8_view *a, int64_t b, int offset,
                                                float (*p)[QUANT_NPART][16]) {
    __m512i s[QUANT_TILE_NC];
    QUANT_UNROLL(4)
    for (int c = 0; c < QUANT_TILE_NC; c++) s[c] = _mm512_set1_epi32(-offset * a[c].s[b]);
    QUANT_UNROLL(8)
    for (int k = 0; k < 8; k++) {
        const __m512i wq = _mm512_loadu_si512(t->q[k]);
        QUANT_UNROLL(4)
        for (int c = 0; c < QUANT_TILE_NC; c++)
            s[c] = _mm512_dpbusd_epi32(s[c], wq, _mm512_set1_epi32(quant_rd32(a[c].qs + b * QUANT_QK + 4 * k)));
    }
    const __m512 d = _mm512_loadu_ps(t->d);
    QUANT_UNROLL(4)
    for (int c = 0; c < QUANT_TILE_NC; c++) {
        const __m512 r = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(a[c].d[b])), _mm512_cvtepi32_ps(s[c]));
        quant_tile_partial_add(p[c][b % QUANT_NPART], b, r);
    }
}

/* quant_tile_q45k_avx512 for Q8_0 or (FOUR) Q4_0 rows: the same bits as quant_legacy_units. */
static QUANT_AVX512 void quant_tile_legacy_avx512(const uint8_t *w, size_t rb, int four, const uint8_t *acts, size_t stride, int nc,
                                                 int64_t n, float *y, size_t ys, void *scratch) {
    const int64_t nb = n / QUANT_QK;
    const int used = nb < QUANT_NPART ? (int)nb : QUANT_NPART;
    struct quant_legacy_tile *tiles = scratch;
    float (*p)[QUANT_NPART][16] = (void *)(tiles + nb);
    quant_tile_prefetch_next(w, rb);
    for (int64_t b = 0; b < nb; b++) quant_legacy_tile_unpack(w, rb, four, b, &tiles[b]);
    for (int c0 = 0; c0 < nc; c0 += QUANT_TILE_NC) {
        const int cc = nc - c0 < QUANT_TILE_NC ? nc - c0 : QUANT_TILE_NC;
        struct quant_q8_view a[QUANT_TILE_NC];
        for (int c = 0; c < QUANT_TILE_NC; c++) a[c] = quant_q8_view(acts + (size_t)(c0 + (c < cc ? c : 0)) * stride, n);
        for (int64_t b = 0; b < nb; b++) quant_legacy_tile_unit(&tiles[b], a, b, four ? 8 : 128, p);
        quant_tile_finish(p, used, cc, y + (size_t)c0 * ys, ys);
    }
}

/* ---- Q4_K, Q5_K, Q6_K and Q4_0 tiles at AVX2: 16 rows by a batch of columns ----
 * The AVX-512 tile's layout (rows in lanes: dword r of q[k] holds elements 4k..4k+3 of row r)
 * run 8 rows to a vector. Without VNNI a vpmaddubsw gives each row two int16 pair sums; a
 * sub-block's steps add in int16 (Q4_K all 8: 8 * 2 * 15 * 127 = 30480; Q5_K 4 at a time, its
 * quants reach 31) and one vpmaddwd applies the 8 rows' scales. quant_dotn instead decodes a row
 * once for 4 columns and then, per column, folds its products with shuffles before each scale
 * multiply and sums lanes at the end: on Zen 1 the multiplies share one pipe with nothing to
 * spare, and the tile needs fewer of them (a super-block of 8 rows and one column: 64 products,
 * 8 or 16 scale and 8 min multiplies, against 8 rows' 88) and few shuffles. Q6_K's quants go in
 * signed (q - 32), so that 4 steps add in int16; Q4_0's block adds its 8 steps in int16 and one
 * vpmaddwd (by ones) widens them. One core, cycles a 256 weights of all the columns against
 * quant_dotn: Q4_K 256 x 2048, 16 columns 576 -> 516-527, 64 2318 -> 1804; 2048 x 512 (an
 * expert's down product), 16 columns 860 -> 429; Q4_0 512 x 2048, 64 columns 2714 -> 1812; Q6_K
 * 2048 x 512, 16 columns 747 -> 452, 512 x 2048, 64 columns 2257 -> 1857. In the model (Zen 1,
 * 2 threads) a 512-token prompt of the Q4_K_M slice went from 36-37 to 44-48 tok/s. */

/* The columns from which the AVX2 tiles pay, against quant_dotn (one core, cycles a 256
 * weights; a pass of fewer than 4 columns computes 4): from 4 (Q4_0 rows of 2048: 4 columns +9%,
 * 6 +2%, 8 +29%; of 512, 4 columns: Q4_0 +43%, Q4_K +32%, Q5_K +22%; 2 and 3 columns even or
 * less), but K rows longer than 2 super-blocks from 12 (512 x 2048: Q4_K 8 columns -5%, 10
 * -8%, 12 +7%, 16 +12%; Q6_K 12 +6%, 16 +12%). */
#define QUANT_AVX2_TILE_MIN_NC 4
#define QUANT_AVX2_TILE_MIN_NC_LONG_K 12

/* One super-block of 16 rows unpacked for the AVX2 tile: q as in quant_q45k_tile; sc[j] and
 * mn[j] the scale and min of sub-block j as the int16 pair (v, v) in dword r for row r, for
 * vpmaddwd against the int16 pair sums of its products and the pair of the act's 16-element
 * sums; d and dmin as floats. */
struct quant_avx2_k_tile { uint8_t q[64][64]; int16_t sc[8][32], mn[8][32]; float d[16], dmin[16]; };
_Static_assert(sizeof(struct quant_avx2_k_tile) == QUANT_K_TILE_BYTES, "quant_tile_bytes counts either K tile");

/* Lane r of out[m] = dword m (< 4) of the 16 bytes at P + r * RB, for 8 rows: rows r and r + 4
 * loaded into one register's two lanes, then a 4x4 dword transpose in each lane, so that no
 * shuffle crosses lanes (Zen 1 pays ~2.5 cycles for one). */
QUANT_AVX2_INLINE void quant_avx2_tile_transpose4(const uint8_t *p, size_t rb, __m256i *out) {
    __m256i z[4];
    QUANT_UNROLL(4)
    for (int i = 0; i < 4; i++) z[i] = quant_avx2_halves(p + (size_t)i * rb, p + (size_t)(i + 4) * rb);
    const __m256i t0 = _mm256_unpacklo_epi32(z[0], z[1]), t1 = _mm256_unpackhi_epi32(z[0], z[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(z[2], z[3]), t3 = _mm256_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm256_unpacklo_epi64(t0, t2);
    out[1] = _mm256_unpackhi_epi64(t0, t2);
    out[2] = _mm256_unpacklo_epi64(t1, t3);
    out[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* quant_avx2_tile_transpose4 for 32 bytes a row (dwords m < 8). */
QUANT_AVX2_INLINE void quant_avx2_tile_transpose(const uint8_t *p, size_t rb, __m256i *out) {
    quant_avx2_tile_transpose4(p, rb, out);
    quant_avx2_tile_transpose4(p + 16, rb, out + 4);
}

/* The 16 fp16 values at H (a tile's rows' d) as floats at OUT. */
QUANT_AVX2_INLINE void quant_avx2_tile_floats(const uint16_t *h, float *out) {
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)));
    _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8))));
}

/* Super-block U of the 16 rows at W (RB bytes apart) of a Q4_K or (FIVE) Q5_K matrix into T, as
 * quant_q45k_tile_unpack lays out the quants (8 rows at a time); the scales, mins and d, dmin
 * row by row. */
QUANT_AVX2_INLINE void quant_avx2_k_tile_unpack(const uint8_t *w, size_t rb, int64_t u, int five, struct quant_avx2_k_tile *t) {
    const uint8_t *b = w + (size_t)u * (five ? 176 : 144);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    QUANT_UNROLL(2)
    for (int half = 0; half < 2; half++) {
        const uint8_t *bh = b + (size_t)8 * half * rb;
        __m256i qh[8], v[8];
        if (five) quant_avx2_tile_transpose(bh + 16, rb, qh);
        QUANT_UNROLL(4)
        for (int h = 0; h < 4; h++) {
            quant_avx2_tile_transpose(bh + 16 + 32 * five + 32 * h, rb, v);
            QUANT_UNROLL(8)
            for (int m = 0; m < 8; m++) {
                __m256i lo = _mm256_and_si256(v[m], m4), hi = _mm256_and_si256(_mm256_srli_epi16(v[m], 4), m4);
                if (five) {
                    lo = _mm256_or_si256(lo, quant_avx2_bits_to(qh[m], 2 * h, 4, 0x10));
                    hi = _mm256_or_si256(hi, quant_avx2_bits_to(qh[m], 2 * h + 1, 4, 0x10));
                }
                _mm256_storeu_si256((__m256i *)(t->q[16 * h + m] + 32 * half), lo);
                _mm256_storeu_si256((__m256i *)(t->q[16 * h + 8 + m] + 32 * half), hi);
            }
        }
    }
    uint16_t dd[16], dm[16];
    for (int r = 0; r < 16; r++) {
        const uint8_t *br = b + (size_t)r * rb;
        uint64_t sc, mn;
        dd[r] = quant_rd16(br);
        dm[r] = quant_rd16(br + 2);
        quant_k4_unpack(br + 4, &sc, &mn);
        for (int j = 0; j < 8; j++) {
            t->sc[j][2 * r] = t->sc[j][2 * r + 1] = (int16_t)(sc >> 8 * j & 0xff);
            t->mn[j][2 * r] = t->mn[j][2 * r + 1] = (int16_t)(mn >> 8 * j & 0xff);
        }
    }
    quant_avx2_tile_floats(dd, t->d);
    quant_avx2_tile_floats(dm, t->dmin);
}

/* quant_tile_partial_add for 8 rows: partial PP plus R for unit U (+0 plus R for a slot's first). */
QUANT_AVX2_INLINE void quant_avx2_tile_partial_add(float *pp, int64_t u, __m256 r) {
    _mm256_storeu_ps(pp, _mm256_add_ps(u < QUANT_NPART ? _mm256_setzero_ps() : _mm256_loadu_ps(pp), r));
}

/* quant_tile_prefetch_next at AVX2. */
QUANT_AVX2_INLINE void quant_avx2_tile_prefetch_next(const uint8_t *w, size_t rb) {
    for (size_t q = 0; q < QUANT_TILE_ROWS * rb; q += 64) _mm_prefetch((const char *)w + QUANT_TILE_ROWS * rb + q, _MM_HINT_T1);
}

/* Super-block U of a tile's rows 8 HALF.. against 4 columns: each one's unit result (quant_dot_k's
 * float step) added to its partial P[c][u % 32] in those rows' lanes; the products of PER steps
 * (8 or 4) add in int16 before their scale multiply. */
QUANT_AVX2_INLINE void quant_avx2_tile_unit(const struct quant_avx2_k_tile *t, int half, int per, const struct quant_q8k_view *a,
                                            int64_t u, float (*p)[QUANT_NPART][16]) {
    __m256i isum[QUANT_TILE_NC], msum[QUANT_TILE_NC];
    QUANT_UNROLL(4)
    for (int c = 0; c < QUANT_TILE_NC; c++) isum[c] = msum[c] = _mm256_setzero_si256();
    QUANT_UNROLL(8)
    for (int j = 0; j < 8; j++) {
        const __m256i sc = _mm256_loadu_si256((const __m256i *)(t->sc[j] + 16 * half));
        QUANT_UNROLL(2)
        for (int k0 = 8 * j; k0 < 8 * j + 8; k0 += per) {
            __m256i s[QUANT_TILE_NC];
            QUANT_UNROLL(4)
            for (int c = 0; c < QUANT_TILE_NC; c++) s[c] = _mm256_setzero_si256();
            QUANT_UNROLL(8)
            for (int k = k0; k < k0 + per; k++) {
                const __m256i wq = _mm256_loadu_si256((const __m256i *)(t->q[k] + 32 * half));
                QUANT_UNROLL(4)
                for (int c = 0; c < QUANT_TILE_NC; c++)
                    s[c] = _mm256_add_epi16(s[c], _mm256_maddubs_epi16(wq, _mm256_set1_epi32(quant_rd32(a[c].qs + u * QUANT_QK_K + 4 * k))));
            }
            QUANT_UNROLL(4)
            for (int c = 0; c < QUANT_TILE_NC; c++) isum[c] = _mm256_add_epi32(isum[c], _mm256_madd_epi16(s[c], sc));
        }
        const __m256i mn = _mm256_loadu_si256((const __m256i *)(t->mn[j] + 16 * half));
        QUANT_UNROLL(4)
        for (int c = 0; c < QUANT_TILE_NC; c++)
            msum[c] = _mm256_add_epi32(msum[c], _mm256_madd_epi16(mn, _mm256_set1_epi32(quant_rd32(a[c].bsums + u * 16 + 2 * j))));
    }
    const __m256 d = _mm256_loadu_ps(t->d + 8 * half), dmin = _mm256_loadu_ps(t->dmin + 8 * half);
    QUANT_UNROLL(4)
    for (int c = 0; c < QUANT_TILE_NC; c++) {
        const __m256 dx = _mm256_set1_ps(a[c].d[u]);
        const __m256 r = _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum[c])),
                                       _mm256_mul_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(msum[c])));
        quant_avx2_tile_partial_add(p[c][u % QUANT_NPART] + 8 * half, u, r);
    }
}

/* quant_tile_finish at AVX2: the first CC columns' partials P (USED of them reached) summed by
 * quant_reduce32's butterfly into y[c * ys + r]. */
static QUANT_AVX2 __attribute__((noinline)) void quant_tile_finish_avx2(float (*p)[QUANT_NPART][16], int used, int cc, float *y, size_t ys) {
    for (int c = 0; c < cc; c++) {
        for (int s = QUANT_NPART / 2; s > 0; s /= 2)
            for (int i = 0; i < s && i + s < used; i++)
                for (int h = 0; h < 16; h += 8)
                    _mm256_storeu_ps(p[c][i] + h, _mm256_add_ps(_mm256_loadu_ps(p[c][i] + h), _mm256_loadu_ps(p[c][i + s] + h)));
        _mm256_storeu_ps(y + (size_t)c * ys, _mm256_loadu_ps(p[c][0]));
        _mm256_storeu_ps(y + (size_t)c * ys + 8, _mm256_loadu_ps(p[c][0] + 8));
    }
}

/* One Q6_K super-block of 16 rows unpacked for the AVX2 tile: q[k] holds elements 4k..4k+3 of
 * row r in dword r as signed values (q - 32, so that |q| <= 32 and 4 steps' products add in
 * int16: 4 * 2 * 32 * 127 = 32512), sc[g] the scale of 16-element group g as the int16 pair
 * (v, v) in dword r, d as floats. */
struct quant_avx2_q6k_tile { int8_t q[64][64]; int16_t sc[16][32]; float d[16]; };
_Static_assert(sizeof(struct quant_avx2_q6k_tile) <= QUANT_K_TILE_BYTES, "quant_tile_bytes counts a Q6_K tile");

/* Super-block U of the 16 Q6_K rows at W (RB bytes apart) into T. Element 128n + 32i + l (l <
 * 32) is step 32n + 8i + l / 4: its low 4 bits are nibble i / 2 of ql byte 64n + 32 (i % 2) + l,
 * its high 2 bits bits 2i, 2i + 1 of qh byte 32n + l; each 32-byte run turned rows-in-lanes by
 * quant_avx2_tile_transpose. */
QUANT_AVX2_INLINE void quant_avx2_q6k_tile_unpack(const uint8_t *w, size_t rb, int64_t u, struct quant_avx2_q6k_tile *t) {
    const uint8_t *b = w + (size_t)u * 210;
    const __m256i m4 = _mm256_set1_epi8(0x0f), offset = _mm256_set1_epi8(32);
    QUANT_UNROLL(2)
    for (int half = 0; half < 2; half++) {
        const uint8_t *bh = b + (size_t)8 * half * rb;
        QUANT_UNROLL(2)
        for (int n = 0; n < 2; n++) {
            __m256i v[2][8], h[8];
            quant_avx2_tile_transpose(bh + 64 * n, rb, v[0]);
            quant_avx2_tile_transpose(bh + 64 * n + 32, rb, v[1]);
            quant_avx2_tile_transpose(bh + 128 + 32 * n, rb, h);
            QUANT_UNROLL(4)
            for (int i = 0; i < 4; i++) {
                QUANT_UNROLL(8)
                for (int m = 0; m < 8; m++) {
                    const __m256i src = v[i % 2][m];
                    const __m256i low = i < 2 ? _mm256_and_si256(src, m4) : _mm256_and_si256(_mm256_srli_epi16(src, 4), m4);
                    const __m256i q = _mm256_or_si256(low, quant_avx2_bits_to(h[m], 2 * i, 4, 0x30));
                    _mm256_storeu_si256((__m256i *)(t->q[32 * n + 8 * i + m] + 32 * half), _mm256_sub_epi8(q, offset));
                }
            }
        }
    }
    uint16_t dd[16];
    for (int r = 0; r < 16; r++) {
        const uint8_t *br = b + (size_t)r * rb;
        dd[r] = quant_rd16(br + 208);
        for (int g = 0; g < 16; g++) t->sc[g][2 * r] = t->sc[g][2 * r + 1] = (int8_t)br[192 + g];
    }
    quant_avx2_tile_floats(dd, t->d);
}

/* Super-block U of a Q6_K tile's rows 8 HALF.. against 4 columns: (d * dx) * isum added to each
 * column's partial P[c][u % 32] in those rows' lanes. A step multiplies the quants' magnitudes by
 * x with their signs, and a group's 4 steps add in int16 before its scale multiply: 80
 * multiplies a super-block of 8 rows and one column, against the column kernel's 104. */
QUANT_AVX2_INLINE void quant_avx2_q6k_tile_unit(const struct quant_avx2_q6k_tile *t, int half, const struct quant_q8k_view *a,
                                                int64_t u, float (*p)[QUANT_NPART][16]) {
    __m256i isum[QUANT_TILE_NC];
    QUANT_UNROLL(4)
    for (int c = 0; c < QUANT_TILE_NC; c++) isum[c] = _mm256_setzero_si256();
    QUANT_UNROLL(16)
    for (int g = 0; g < 16; g++) {
        __m256i s[QUANT_TILE_NC];
        QUANT_UNROLL(4)
        for (int c = 0; c < QUANT_TILE_NC; c++) s[c] = _mm256_setzero_si256();
        QUANT_UNROLL(4)
        for (int k = 4 * g; k < 4 * g + 4; k++) {
            const __m256i wq = _mm256_loadu_si256((const __m256i *)(t->q[k] + 32 * half)), mag = _mm256_abs_epi8(wq);
            QUANT_UNROLL(4)
            for (int c = 0; c < QUANT_TILE_NC; c++) {
                const __m256i x = _mm256_set1_epi32(quant_rd32(a[c].qs + u * QUANT_QK_K + 4 * k));
                s[c] = _mm256_add_epi16(s[c], _mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, wq)));
            }
        }
        const __m256i sc = _mm256_loadu_si256((const __m256i *)(t->sc[g] + 16 * half));
        QUANT_UNROLL(4)
        for (int c = 0; c < QUANT_TILE_NC; c++) isum[c] = _mm256_add_epi32(isum[c], _mm256_madd_epi16(s[c], sc));
    }
    const __m256 d = _mm256_loadu_ps(t->d + 8 * half);
    QUANT_UNROLL(4)
    for (int c = 0; c < QUANT_TILE_NC; c++) {
        const __m256 r = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(a[c].d[u])), _mm256_cvtepi32_ps(isum[c]));
        quant_avx2_tile_partial_add(p[c][u % QUANT_NPART] + 8 * half, u, r);
    }
}

/* quant_tile_q45k_avx512 at AVX2 for Q4_K, Q5_K or Q6_K rows (T a constant where it is inlined,
 * so that the steps a scale multiply takes, 8 or 4, unroll): the same bits as quant_dot_k. Each
 * super-block's tile takes QUANT_K_TILE_BYTES of SCRATCH. */
QUANT_AVX2_INLINE void quant_avx2_k_tile(enum gguf_type t, const uint8_t *w, size_t rb, const uint8_t *acts, size_t stride, int nc,
                                         int64_t n, float *y, size_t ys, void *scratch) {
    const int64_t nu = n / QUANT_QK_K;
    const int used = nu < QUANT_NPART ? (int)nu : QUANT_NPART;
    uint8_t *tiles = scratch;
    float (*p)[QUANT_NPART][16] = (void *)(tiles + (size_t)nu * QUANT_K_TILE_BYTES);
    quant_avx2_tile_prefetch_next(w, rb);
    for (int64_t u = 0; u < nu; u++) {
        void *tile = tiles + (size_t)u * QUANT_K_TILE_BYTES;
        if (t == GGUF_TYPE_Q6_K) quant_avx2_q6k_tile_unpack(w, rb, u, tile);
        else quant_avx2_k_tile_unpack(w, rb, u, t == GGUF_TYPE_Q5_K, tile);
    }
    for (int c0 = 0; c0 < nc; c0 += QUANT_TILE_NC) {
        const int cc = nc - c0 < QUANT_TILE_NC ? nc - c0 : QUANT_TILE_NC;
        struct quant_q8k_view a[QUANT_TILE_NC]; /* a short pass repeats its first column, not stored */
        for (int c = 0; c < QUANT_TILE_NC; c++) a[c] = quant_q8k_view(acts + (size_t)(c0 + (c < cc ? c : 0)) * stride, n);
        for (int64_t u = 0; u < nu; u++)
            for (int half = 0; half < 2; half++) {
                const void *tile = tiles + (size_t)u * QUANT_K_TILE_BYTES;
                if (t == GGUF_TYPE_Q6_K) quant_avx2_q6k_tile_unit(tile, half, a, u, p);
                else quant_avx2_tile_unit(tile, half, t == GGUF_TYPE_Q5_K ? 4 : 8, a, u, p);
            }
        quant_tile_finish_avx2(p, used, cc, y + (size_t)c0 * ys, ys);
    }
}

#define QUANT_AVX2_K_TILE(name, type)                                                                                     \
    static QUANT_AVX2 void name(const uint8_t *w, size_t rb, const uint8_t *acts, size_t stride, int nc, int64_t n, float *y, \
                                size_t ys, void *scratch) { quant_avx2_k_tile(type, w, rb, acts, stride, nc, n, y, ys, scratch); }
QUANT_AVX2_K_TILE(quant_tile_q4k_avx2, GGUF_TYPE_Q4_K)
QUANT_AVX2_K_TILE(quant_tile_q5k_avx2, GGUF_TYPE_Q5_K)
QUANT_AVX2_K_TILE(quant_tile_q6k_avx2, GGUF_TYPE_Q6_K)

/* Block B of the 16 Q4_0 rows at W (RB bytes apart) into T, as quant_legacy_tile_unpack lays it
 * out (8 rows at a time). */
QUANT_AVX2_INLINE void quant_avx2_q4_0_tile_unpack(const uint8_t *w, size_t rb, int64_t b, struct quant_legacy_tile *t) {
    const uint8_t *blk = w + (size_t)b * 18;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    QUANT_UNROLL(2)
    for (int half = 0; half < 2; half++) {
        __m256i v[4];
        quant_avx2_tile_transpose4(blk + (size_t)8 * half * rb + 2, rb, v);
        QUANT_UNROLL(4)
        for (int m = 0; m < 4; m++) {
            _mm256_storeu_si256((__m256i *)(t->q[m] + 32 * half), _mm256_and_si256(v[m], m4));
            _mm256_storeu_si256((__m256i *)(t->q[4 + m] + 32 * half), _mm256_and_si256(_mm256_srli_epi16(v[m], 4), m4));
        }
    }
    uint16_t dd[16];
    for (int r = 0; r < 16; r++) dd[r] = quant_rd16(blk + (size_t)r * rb);
    quant_avx2_tile_floats(dd, t->d);
}

/* Block B of a Q4_0 tile's rows 8 HALF.. against 4 columns: quant_legacy_units' unit, (dw * dx)
 * * isum, added to each column's partial P[c][b % 32] in those rows' lanes. The block's 8 steps
 * (quants 0..15 as stored) add in int16 (8 * 2 * 15 * 127 = 30480), one vpmaddwd widens them,
 * and the offset of 8 comes off as 8 times the act block's sum: the same integer. */
QUANT_AVX2_INLINE void quant_avx2_q4_0_tile_unit(const struct quant_legacy_tile *t, int half, const struct quant_q8_view *a,
                                                 int64_t b, float (*p)[QUANT_NPART][16]) {
    __m256i s[QUANT_TILE_NC];
    QUANT_UNROLL(4)
    for (int c = 0; c < QUANT_TILE_NC; c++) s[c] = _mm256_setzero_si256();
    QUANT_UNROLL(8)
    for (int k = 0; k < 8; k++) {
        const __m256i wq = _mm256_loadu_si256((const __m256i *)(t->q[k] + 32 * half));
        QUANT_UNROLL(4)
        for (int c = 0; c < QUANT_TILE_NC; c++)
            s[c] = _mm256_add_epi16(s[c], _mm256_maddubs_epi16(wq, _mm256_set1_epi32(quant_rd32(a[c].qs + b * QUANT_QK + 4 * k))));
    }
    const __m256 d = _mm256_loadu_ps(t->d + 8 * half);
    QUANT_UNROLL(4)
    for (int c = 0; c < QUANT_TILE_NC; c++) {
        const __m256i isum = _mm256_sub_epi32(_mm256_madd_epi16(s[c], _mm256_set1_epi16(1)), _mm256_set1_epi32(8 * a[c].s[b]));
        const __m256 r = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(a[c].d[b])), _mm256_cvtepi32_ps(isum));
        quant_avx2_tile_partial_add(p[c][b % QUANT_NPART] + 8 * half, b, r);
    }
}

/* quant_tile_legacy_avx512 for Q4_0 rows at AVX2: the same bits. */
static QUANT_AVX2 void quant_tile_q4_0_avx2(const uint8_t *w, size_t rb, const uint8_t *acts, size_t stride, int nc, int64_t n,
                                           float *y, size_t ys, void *scratch) {
    const int64_t nb = n / QUANT_QK;
    const int used = nb < QUANT_NPART ? (int)nb : QUANT_NPART;
    struct quant_legacy_tile *tiles = scratch;
    float (*p)[QUANT_NPART][16] = (void *)(tiles + nb);
    quant_avx2_tile_prefetch_next(w, rb);
    for (int64_t b = 0; b < nb; b++) quant_avx2_q4_0_tile_unpack(w, rb, b, &tiles[b]);
    for (int c0 = 0; c0 < nc; c0 += QUANT_TILE_NC) {
        const int cc = nc - c0 < QUANT_TILE_NC ? nc - c0 : QUANT_TILE_NC;
        struct quant_q8_view a[QUANT_TILE_NC];
        for (int c = 0; c < QUANT_TILE_NC; c++) a[c] = quant_q8_view(acts + (size_t)(c0 + (c < cc ? c : 0)) * stride, n);
        for (int64_t b = 0; b < nb; b++)
            for (int half = 0; half < 2; half++) quant_avx2_q4_0_tile_unit(&tiles[b], half, a, b, p);
        quant_tile_finish_avx2(p, used, cc, y + (size_t)c0 * ys, ys);
    }
}

/* ---- Interleaved K-like rows (Q4_K to Q6_K, Q2_K, Q3_K, IQ4_XS; IQ3 with VBMI; AVX2: Q4_K with AVX-VNNI): 16 rows side by side ----
 * A tile pays for turning 16 rows into lanes on every call, which one column (decode) cannot
 * repay: there quant_dotr runs a row at a time, and most of its instructions go to unpacking
 * scales and to each super-block's lane sums (Q4_K: ~75 a super-block, 15.7 cycles, 14 weights
 * a cycle, against 64 a vpdpbusd). A matrix the CPU owns (§8 model_own_trunk) is repacked
 * instead, in the same bytes (quant_interleave): for 16 rows and one super-block, a vector of
 * 16 dwords per dword of the block, lane r from row r, so that one 64-byte load masked to its
 * low or high nibbles (Q5_K: with the fifth bits or-ed in; Q6_K: with its 2 high bits; Q2_K:
 * shifted and masked; Q3_K: that with its hmask bit; IQ4_XS: looked up; IQ3: looked up by VBMI,
 * a vector per coordinate, with its signs) is vpdpbusd's operand
 * for 16 rows, as a tile's is, and the tile's integer and float steps run on it: the same bits
 * as quant_dot_k. Q4_K, one core, 2048 x 2048 in cache, one column: 69 -> 38 us; two threads
 * 40.5 -> 20.2 us; 16 columns (tiles before) 369 -> 169 us, 64 columns 1077 -> 654 us. */

/* Prefetch distance: twice QUANT_PREFETCH, as the kernel consumes bytes twice as fast. Measured
 * (a scratch harness, 2 threads, 20 layers' worth of Q4_K matrices of the 35B's shapes read
 * alternately with the plain ones): 4 KiB 53-55, 8 KiB 58-61, 12 KiB 55-56, 16 KiB 53-54 GB/s;
 * an L2 prefetch 16 or 24 KiB ahead besides lost. */
#define QUANT_INTERLEAVED_PREFETCH 8192

/* Whether T is an IQ3 format, whose interleaved blocks keep their d first (then 24 or 27 whole dwords). */
static int quant_interleaved_iq3(enum gguf_type t) { return t == GGUF_TYPE_IQ3_XXS || t == GGUF_TYPE_IQ3_S; }

/* Whether the AVX2 level has a kernel for interleaved rows of T (quant_interleaved_avx2: Q4_K, on
 * a CPU with AVX-VNNI). Q5_K's was bit-exact too, but its fifth bits cost what the layout saved:
 * one core, in cache, 512 x 2048 at 1 / 4 / 16 / 64 columns, 32.5 / 60.5 / 68.0 / 67.4 GMAC/s
 * against the rows' and tiles' 31.1 / 47.6 / 63.7 / 70.7 (Q4_K: 47.9 / 74.7 / 79.0 / 80.4
 * against 37.6 / 51.9 / 57.6 / 63.1). */
static int quant_interleaved_avx2_ok(enum gguf_type t) { return plat_cpu.avxvnni && t == GGUF_TYPE_Q4_K; }

/* Whether a matrix of ROWS rows of type T has an interleaved form at this level. Q6_K's rows
 * already read at the bandwidth; its interleaved form makes a prompt's products 1.45-1.7x
 * faster for one column 0-4% slower in the model (README, Weight formats), and is kept for them. */
static int quant_interleave_ok(enum gguf_type t, int64_t rows) {
    const int format = t == GGUF_TYPE_Q4_K || t == GGUF_TYPE_Q5_K || t == GGUF_TYPE_Q6_K || t == GGUF_TYPE_Q2_K || t == GGUF_TYPE_Q3_K ||
                       t == GGUF_TYPE_IQ4_XS || (quant_interleaved_iq3(t) && quant_level >= QUANT_LEVEL_AVX512VBMI); /* IQ3: VBMI lookups */
    if (rows <= 0 || rows % QUANT_TILE_ROWS) return 0;
    return quant_level >= QUANT_LEVEL_AVX512 ? format : quant_level == QUANT_LEVEL_AVX2 && quant_interleaved_avx2_ok(t);
}

/* Vector K of an interleaved super-block of type T holds the dword at which byte of each row's
 * block. Q4_K, Q5_K: the 32 of nibbles first (32-byte run k / 8, its dword k % 8), then Q5_K's 8
 * of fifth bits, the 3 of scales and mins, and last dword 0 (d and dmin). The IQ3 formats theirs
 * from byte 2 on, their d left over (IQ3_XXS: 16 of grid indices, 8 of signs and scales; IQ3_S:
 * 16 of indices, 2 of their high bits, 8 of signs, 1 of scales). The others theirs as they are
 * (Q2_K: 4 of scales and mins, 16 of quants, d and dmin; Q3_K: 8 of hmask, 16 of quants, 3 of
 * scales, its d left over; Q6_K: 32 of ql, 16 of qh, 4 of scales, its d left over; IQ4_XS: d
 * with the scales' high bits, their low bits, 32 of codes). */
static int quant_interleaved_offset(enum gguf_type t, int k) {
    if (quant_interleaved_iq3(t)) return 2 + 4 * k;
    if (t != GGUF_TYPE_Q4_K && t != GGUF_TYPE_Q5_K) return 4 * k;
    const int five = t == GGUF_TYPE_Q5_K, nibbles = 4 + 8 * five;
    return 4 * (k < 32 ? nibbles + k : k < 32 + 8 * five ? 4 + (k - 32) : k < 35 + 8 * five ? 1 + (k - 32 - 8 * five) : 0);
}

/* DST = the ROWS rows of type T (RB bytes each) at SRC interleaved: for each 16 rows and
 * super-block, one vector of 16 dwords (lane r from row r) per whole dword of the block, in
 * quant_interleaved_offset's order. A block that is not whole dwords (Q3_K: 110 bytes, Q6_K:
 * 210, each its d last; IQ3_XXS: 98, IQ3_S: 110, each its d first) leaves 2 bytes a row: those
 * of the 16 rows' super-blocks come first in the group, 32 bytes for each, so that a pass reads
 * them in its stream and every vector stays 64-byte aligned (rows of an even number of
 * super-blocks: every matrix of the Qwen3.5/3.6 models). 16 rows keep their 16 RB bytes.
 * Caller: quant_interleave_ok. */
static void quant_interleave(enum gguf_type t, uint8_t *dst, const uint8_t *src, size_t rb, int64_t rows) {
    const int bb = gguf_type_get(t)->block_bytes, dwords = bb / 4, rest = bb % 4;
    const int64_t nu = (int64_t)rb / bb;
    const size_t unit = (size_t)64 * dwords; /* a super-block's vectors */
    int from[64]; /* byte offsets in a block, vector by vector: a table, not a call a dword (twice as fast: 9.5 GB/s on 2 threads) */
    for (int k = 0; k < dwords; k++) from[k] = quant_interleaved_offset(t, k);
    const int rest_at = quant_interleaved_iq3(t) ? 0 : 4 * dwords;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < rows / QUANT_TILE_ROWS; g++)
        for (int64_t u = 0; u < nu; u++) {
            uint8_t *v = dst + (size_t)g * QUANT_TILE_ROWS * rb + (size_t)nu * QUANT_TILE_ROWS * rest + (size_t)u * unit;
            const uint8_t *b = src + (size_t)g * QUANT_TILE_ROWS * rb + (size_t)u * (size_t)bb;
            for (int k = 0; k < dwords; k++)
                for (int r = 0; r < QUANT_TILE_ROWS; r++) memcpy(v + 64 * k + 4 * r, b + (size_t)r * rb + from[k], 4);
            uint8_t *tail = dst + (size_t)g * QUANT_TILE_ROWS * rb + (size_t)u * QUANT_TILE_ROWS * rest;
            for (int r = 0; r < QUANT_TILE_ROWS && rest; r++) memcpy(tail + rest * r, b + (size_t)r * rb + rest_at, (size_t)rest);
        }
}

/* Bit BIT of each byte of V moved to bit 4 (other bits left for the caller to mask). */
QUANT_AVX512_INLINE __m512i quant_bit_to_4(__m512i v, int bit) {
    return bit <= 4 ? _mm512_slli_epi32(v, 4 - bit) : _mm512_srli_epi32(v, bit - 4);
}

/* Super-block U of 16 interleaved Q4_K (FIVE: Q5_K) rows at T against NC columns, as
 * quant_tile_unit: the 32-byte run h of each row is sub-block 2h in its low nibbles and 2h + 1
 * in its high ones, and Q5_K's fifth bits of both are bits 2h and 2h + 1 of its qh bytes. */
QUANT_AVX512_INLINE void quant_interleaved_unit(const uint8_t *t, int five, const struct quant_q8k_view *a, int64_t u,
                                                float (*p)[QUANT_NPART][16], int NC) {
    const uint8_t *sm = t + 64 * (32 + 8 * five); /* scales and mins, then d and dmin */
    const __m512i m4 = _mm512_set1_epi8(0x0f), u0 = _mm512_loadu_si512(sm), u1 = _mm512_loadu_si512(sm + 64);
    const __m512i u2 = _mm512_loadu_si512(sm + 128);
    __m512i isum[QUANT_TILE_NC], msum[QUANT_TILE_NC];
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) isum[c] = msum[c] = _mm512_setzero_si512();
    QUANT_UNROLL(4)
    for (int h = 0; h < 4; h++) {
        __m512i s[2][QUANT_TILE_NC];
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) s[0][c] = s[1][c] = _mm512_setzero_si512();
        QUANT_UNROLL(8)
        for (int m = 0; m < 8; m++) {
            const __m512i v = _mm512_loadu_si512(t + 64 * (8 * h + m));
            __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            if (five) { /* lo | (qh's bit 2h at bit 4 & 0x10), hi the same with bit 2h + 1 */
                const __m512i qh = _mm512_loadu_si512(t + 64 * (32 + m));
                lo = _mm512_ternarylogic_epi32(lo, quant_bit_to_4(qh, 2 * h), _mm512_set1_epi8(0x10), 0xf8);
                hi = _mm512_ternarylogic_epi32(hi, quant_bit_to_4(qh, 2 * h + 1), _mm512_set1_epi8(0x10), 0xf8);
            }
            QUANT_UNROLL(4)
            for (int c = 0; c < NC; c++) {
                const int8_t *x = a[c].qs + u * QUANT_QK_K + 64 * h + 4 * m;
                s[0][c] = _mm512_dpbusd_epi32(s[0][c], lo, _mm512_set1_epi32(quant_rd32(x)));
                s[1][c] = _mm512_dpbusd_epi32(s[1][c], hi, _mm512_set1_epi32(quant_rd32(x + 32)));
            }
        }
        QUANT_UNROLL(2)
        for (int i = 0; i < 2; i++) {
            __m512i sc, mn;
            quant_tile_k4_field(u0, u1, u2, 2 * h + i, &sc, &mn);
            QUANT_UNROLL(4)
            for (int c = 0; c < NC; c++) {
                isum[c] = _mm512_add_epi32(isum[c], _mm512_mullo_epi32(s[i][c], sc));
                msum[c] = _mm512_dpwssd_epi32(msum[c], mn, _mm512_set1_epi32(quant_rd32(a[c].bsums + u * 16 + 2 * (2 * h + i))));
            }
        }
    }
    const __m512i dd = _mm512_loadu_si512(sm + 192);
    quant_tile_k_step(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd)), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16))), a, u,
                      isum, msum, p, NC);
}

/* Vector M of run (H, J) of an interleaved Q2_K, Q3_K or Q6_K super-block at T
 * (quant_interleaved_q236k_unit's terms): vpdpbusd's unsigned operand for elements 128h + 32j +
 * 4m.. of each row, q (Q2_K), q + 4 (Q3_K) or q + 32 (Q6_K). */
QUANT_AVX512_INLINE __m512i quant_interleaved_q236k_quants(enum gguf_type type, const uint8_t *t, int h, int j, int m) {
    if (type == GGUF_TYPE_Q2_K) return _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(t + 64 * (4 + 8 * h + m)), 2 * j), _mm512_set1_epi8(3));
    if (type == GGUF_TYPE_Q3_K) {
        const int bit = 4 * h + j; /* of hmask, to bit 2 */
        const __m512i low = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(t + 64 * (8 + 8 * h + m)), 2 * j), _mm512_set1_epi8(3));
        const __m512i hm = _mm512_loadu_si512(t + 64 * m);
        const __m512i high = bit >= 2 ? _mm512_srli_epi16(hm, bit - 2) : _mm512_slli_epi16(hm, 2 - bit);
        return _mm512_ternarylogic_epi32(low, high, _mm512_set1_epi8(4), 0xf8); /* low | (high & 4) */
    }
    const __m512i v = _mm512_loadu_si512(t + 64 * (16 * h + 8 * (j % 2) + m)), qh = _mm512_loadu_si512(t + 64 * (32 + 8 * h + m));
    const __m512i low = _mm512_and_si512(j < 2 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
    const __m512i high = j < 2 ? _mm512_slli_epi16(qh, 4 - 2 * j) : j == 2 ? qh : _mm512_srli_epi16(qh, 2); /* bits 2j to 4 */
    return _mm512_ternarylogic_epi32(low, high, _mm512_set1_epi8(0x30), 0xf8);
}

/* Scales G and G + 1 (G even) of an interleaved Q3_K or Q6_K super-block at T as the int16
 * pair (scale G, scale G + 1) in each 32-bit lane. Both first make the int8 scales 4G' .. 4G' + 3
 * (G' = G / 4) in the bytes of a lane: Q6_K's are stored so; Q3_K's as quant_q3k_scales unpacks
 * them, a nibble of scale dword 0 or 1 and 2 bits of dword 2, less 32, four at a time (a scale a
 * lane at a time: Q6_K's one column 13% slower in cache). */
QUANT_AVX512_INLINE __m512i quant_interleaved_q36k_pair(enum gguf_type type, const uint8_t *t, int g) {
    const int k = g / 4;
    __m512i v;
    if (type == GGUF_TYPE_Q6_K) v = _mm512_loadu_si512(t + 64 * (48 + k));
    else {
        const __m512i nib = _mm512_loadu_si512(t + 64 * (24 + k % 2)), top = _mm512_loadu_si512(t + 64 * 26);
        const __m512i low = _mm512_and_si512(k >= 2 ? _mm512_srli_epi16(nib, 4) : nib, _mm512_set1_epi8(0x0f));
        const __m512i high = k < 2 ? _mm512_slli_epi16(top, 4 - 2 * k) : k == 2 ? top : _mm512_srli_epi16(top, 2); /* bits 2k to 4 */
        v = _mm512_sub_epi8(_mm512_ternarylogic_epi32(low, high, _mm512_set1_epi8(0x30), 0xf8), _mm512_set1_epi8(32));
    }
    const __m512i even = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), odd = _mm512_srai_epi16(v, 8); /* bytes 0, 2 and 1, 3 as int16 */
    return g % 4 ? _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(even, 16), odd)
                 : _mm512_mask_blend_epi16(0xAAAAAAAA, even, _mm512_slli_epi32(odd, 16));
}

/* Groups G and G + 1 (G even) of an interleaved super-block at T: *SA, *SB their scales in 32-bit
 * lanes, *PAIR the int16 pair a vpdpwssd takes against the act's two 16-sums: Q2_K's mins
 * (scale and min the low and high nibbles of bytes G % 4, G % 4 + 1 of dword G / 4), the scales
 * of Q3_K and Q6_K (their offset, 4 or 32 times those sums). */
QUANT_AVX512_INLINE void quant_interleaved_q236k_groups(enum gguf_type type, const uint8_t *t, int g, __m512i *sa, __m512i *sb, __m512i *pair) {
    if (type == GGUF_TYPE_Q2_K) {
        const __m512i sm = _mm512_loadu_si512(t + 64 * (g / 4));
        *sa = quant_tile_field(sm, g % 4, 4);
        *sb = quant_tile_field(sm, g % 4 + 1, 4);
        const __m512i min_a = _mm512_srli_epi32(quant_tile_field(sm, g % 4, 8), 4), min_b = _mm512_srli_epi32(quant_tile_field(sm, g % 4 + 1, 8), 4);
        *pair = _mm512_or_si512(min_a, _mm512_slli_epi32(min_b, 16));
        return;
    }
    *pair = quant_interleaved_q36k_pair(type, t, g);
    *sa = _mm512_srai_epi32(_mm512_slli_epi32(*pair, 16), 16);
    *sb = _mm512_srai_epi32(*pair, 16);
}

/* Super-block U of 16 interleaved Q2_K, Q3_K or Q6_K rows at T (Q3_K's and Q6_K's 16 d at D)
 * against NC columns. All three keep element 128h + 32j + l of a row in a byte l of their runs of
 * half h: Q2_K in bits 2j of quant byte 32h + l; Q3_K the same, with bit 4h + j of hmask byte l
 * its third (clear: less 4); Q6_K in a nibble of ql byte 64h + l (+ 32 for odd j, the high
 * nibble for j >= 2), with bits 2j of qh byte 32h + l its fifth and sixth (less 32). So dword m
 * of those runs, shifted, masked and or-ed, is elements 128h + 32j + 4m.. of group 8h + 2j + m / 4
 * (Q3_K, Q6_K: plus 4 or 32). Each group's products by its scale; a vpdpwssd of the act's sums
 * with Q2_K's mins, or with the scales for the 4 or 32 to come off; then the float step of
 * quant_dot_k_unit (Q2_K, Q3_K) or quant_dot_k (Q6_K). */
QUANT_AVX512_INLINE void quant_interleaved_q236k_unit(enum gguf_type type, const uint8_t *t, const uint8_t *d, const struct quant_q8k_view *a,
                                                      int64_t u, float (*p)[QUANT_NPART][16], int NC) {
    __m512i isum[QUANT_TILE_NC], sums[QUANT_TILE_NC]; /* sums: Q2_K's min term, the others' offset */
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) isum[c] = sums[c] = _mm512_setzero_si512();
    QUANT_UNROLL(2)
    for (int h = 0; h < 2; h++)
        QUANT_UNROLL(4)
        for (int j = 0; j < 4; j++) {
            __m512i s[2][QUANT_TILE_NC];
            QUANT_UNROLL(4)
            for (int c = 0; c < NC; c++) s[0][c] = s[1][c] = _mm512_setzero_si512();
            QUANT_UNROLL(8)
            for (int m = 0; m < 8; m++) {
                const __m512i q = quant_interleaved_q236k_quants(type, t, h, j, m);
                QUANT_UNROLL(4)
                for (int c = 0; c < NC; c++) {
                    const int8_t *x = a[c].qs + u * QUANT_QK_K + 128 * h + 32 * j + 4 * m;
                    s[m / 4][c] = _mm512_dpbusd_epi32(s[m / 4][c], q, _mm512_set1_epi32(quant_rd32(x)));
                }
            }
            const int g = 8 * h + 2 * j; /* groups g and g + 1 */
            __m512i sa, sb, pair;
            quant_interleaved_q236k_groups(type, t, g, &sa, &sb, &pair);
            QUANT_UNROLL(4)
            for (int c = 0; c < NC; c++) {
                isum[c] = _mm512_add_epi32(isum[c], _mm512_add_epi32(_mm512_mullo_epi32(s[0][c], sa), _mm512_mullo_epi32(s[1][c], sb)));
                sums[c] = _mm512_dpwssd_epi32(sums[c], pair, _mm512_set1_epi32(quant_rd32(a[c].bsums + u * 16 + g)));
            }
        }
    if (type == GGUF_TYPE_Q2_K) {
        const __m512i dd = _mm512_loadu_si512(t + 64 * 20);
        quant_tile_k_step(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd)), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16))), a, u,
                          isum, sums, p, NC);
        return;
    }
    const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d));
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        const __m512i is = _mm512_sub_epi32(isum[c], _mm512_slli_epi32(sums[c], type == GGUF_TYPE_Q6_K ? 5 : 2));
        const __m512 r = _mm512_mul_ps(_mm512_mul_ps(dd, _mm512_set1_ps(a[c].d[u])), _mm512_cvtepi32_ps(is));
        quant_tile_partial_add(p[c][u % QUANT_NPART], u, r);
    }
}

/* Super-block U of 16 interleaved IQ4_XS rows at T against NC columns: 32-block ib's dword m
 * (m < 4) holds the codes of elements 4m.. in its low nibbles and 16 + 4m.. in its high ones;
 * a byte shuffle gives their IQ4_NL values plus 128, vpdpbusd's unsigned operand, and the 128
 * comes off as 128 times the block's act sum. Each block's sum by its scale (less 32), then
 * quant_dot_k_unit's float step, (d * dx) * isum. */
QUANT_AVX512_INLINE void quant_interleaved_iq4xs_unit(const uint8_t *t, const struct quant_q8k_view *a, int64_t u,
                                                      float (*p)[QUANT_NPART][16], int NC) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), u0 = _mm512_loadu_si512(t), u1 = _mm512_loadu_si512(t + 64);
    const __m512i tab = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)quant_iq4nl_values)), _mm512_set1_epi8((char)0x80));
    __m512i isum[QUANT_TILE_NC];
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) isum[c] = _mm512_setzero_si512();
    QUANT_UNROLL(8)
    for (int ib = 0; ib < 8; ib++) {
        __m512i s[2][QUANT_TILE_NC];
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) { /* less 128 times the block's act sum (its two 16-sums) */
            const __m512i sums = _mm512_set1_epi32(quant_rd32(a[c].bsums + u * 16 + 2 * ib));
            s[0][c] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_set1_epi16(-128), sums);
            s[1][c] = _mm512_setzero_si512();
        }
        QUANT_UNROLL(4)
        for (int m = 0; m < 4; m++) {
            const __m512i v = _mm512_loadu_si512(t + 64 * (2 + 4 * ib + m));
            const __m512i lo = _mm512_shuffle_epi8(tab, _mm512_and_si512(v, m4));
            const __m512i hi = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
            QUANT_UNROLL(4)
            for (int c = 0; c < NC; c++) {
                const int8_t *x = a[c].qs + u * QUANT_QK_K + 32 * ib + 4 * m;
                s[0][c] = _mm512_dpbusd_epi32(s[0][c], lo, _mm512_set1_epi32(quant_rd32(x)));
                s[1][c] = _mm512_dpbusd_epi32(s[1][c], hi, _mm512_set1_epi32(quant_rd32(x + 16)));
            }
        }
        /* quant_iq4xs_scale: 4 low bits from the scales' dword, 2 high bits from dword 0's top half */
        const __m512i low = _mm512_and_si512(_mm512_srli_epi32(u1, 4 * ib), _mm512_set1_epi32(0xf));
        const __m512i high = _mm512_and_si512(_mm512_srli_epi32(u0, 16 + 2 * ib), _mm512_set1_epi32(3));
        const __m512i ls = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32));
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) isum[c] = _mm512_add_epi32(isum[c], _mm512_mullo_epi32(_mm512_add_epi32(s[0][c], s[1][c]), ls));
    }
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(u0));
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        const __m512 r = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(a[c].d[u])), _mm512_cvtepi32_ps(isum[c]));
        quant_tile_partial_add(p[c][u % QUANT_NPART], u, r);
    }
}

/* Super-block U of 16 interleaved IQ3_XXS or IQ3_S rows at T (their 16 d at D) against NC
 * columns, by VBMI. Vector 2 ib + h of grid indices holds in lane r points 4h.. of 32-block ib of
 * row r (IQ3_S: bit 8 of point 4h + k is bit 8 (ib % 4) + 4h + k of high-bit dword ib / 4); their
 * lookup gives 4 coordinate planes, byte 4r + k of plane j the coordinate j of point k, element
 * 16h + 4k + j of the block: against the act in the same planes (quant_avx512_plane_order, a
 * super-block at a time) one vpdpbusd per plane. Each row's 32 sign bits of the block (IQ3_XXS:
 * from its word of 7-bit fields; IQ3_S: as stored), bit e for element e, become a byte mask per
 * plane by BITALG's bit shuffle, and vpdpbusd's unsigned operand is 128 + the signed value; the
 * 128 comes off as 128 times the block's act sum. Each block's sum by its 2 s + 1, then
 * quant_dot_k_unit's float step. */
QUANT_AVX512_INLINE void quant_interleaved_iq3_unit(enum gguf_type type, const uint8_t *t, const uint8_t *d, const struct quant_q8k_view *a,
                                                    int64_t u, float (*p)[QUANT_NPART][16], int NC) {
    const int xxs = type == GGUF_TYPE_IQ3_XXS;
    const __m128i flip = _mm_set1_epi8((char)0x80); /* levels plus 128: their sign is 0 - that, mod 256 */
    const __m128i values = _mm_or_si128(flip, xxs ? _mm_loadl_epi64((const __m128i *)quant_iq3_levels)
                                                  : _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0));
    _Alignas(64) int8_t x[QUANT_TILE_NC][QUANT_QK_K];
    __m512i isum[QUANT_TILE_NC];
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        quant_avx512_plane_order((const uint8_t *)a[c].qs + u * QUANT_QK_K, (uint8_t *)x[c]);
        isum[c] = _mm512_setzero_si512();
    }
    for (int ib = 0; ib < 8; ib++) {
        __m512i signs, ls; /* a lane's 32 sign bits of the block, and its 4-bit scale */
        if (xxs) {
            const __m512i aux = _mm512_loadu_si512(t + 64 * (16 + ib));
            signs = quant_avx512_iq3xxs_signs_vbmi(aux);
            ls = _mm512_srli_epi32(aux, 28);
        } else {
            signs = _mm512_loadu_si512(t + 64 * (18 + ib));
            ls = _mm512_and_si512(_mm512_srli_epi32(_mm512_loadu_si512(t + 64 * 26), 4 * ib), _mm512_set1_epi32(15));
        }
        __m512i s[QUANT_TILE_NC];
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++)
            s[c] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_set1_epi16(-128), _mm512_set1_epi32(quant_rd32(a[c].bsums + u * 16 + 2 * ib)));
        QUANT_UNROLL(2)
        for (int h = 0; h < 2; h++) {
            __mmask64 bit8 = 0; /* the bit shuffles' byte 4r + k reads bit 32 (r % 2) + ... of qword r / 2: lane r's */
            if (!xxs)
                bit8 = quant_bitalg_shuffle(_mm512_set1_epi64(0x2322212003020100LL + 0x0101010101010101LL * (8 * (ib % 4) + 4 * h)),
                                            _mm512_loadu_si512(t + 64 * (16 + ib / 4)));
            __m512i plane[4];
            quant_avx512_iq3_vbmi_lookup(_mm512_loadu_si512(t + 64 * (2 * ib + h)), bit8, xxs ? quant_iq3xxs_pairs[0] : quant_iq3s_pairs[0],
                                         xxs ? 4 : 8, values, plane);
            QUANT_UNROLL(4)
            for (int j = 0; j < 4; j++) {
                const __mmask64 neg = quant_bitalg_shuffle(_mm512_set1_epi64(0x2c2824200c080400LL + 0x0101010101010101LL * (16 * h + j)), signs);
                const __m512i w = _mm512_mask_sub_epi8(plane[j], neg, _mm512_setzero_si512(), plane[j]);
                QUANT_UNROLL(4)
                for (int c = 0; c < NC; c++) s[c] = _mm512_dpbusd_epi32(s[c], w, _mm512_set1_epi32(quant_rd32(x[c] + 64 * j + 8 * ib + 4 * h)));
            }
        }
        const __m512i scale = _mm512_or_si512(_mm512_slli_epi32(ls, 1), _mm512_set1_epi32(1));
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) isum[c] = _mm512_add_epi32(isum[c], _mm512_mullo_epi32(s[c], scale));
    }
    const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d));
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        __m512 r = _mm512_mul_ps(_mm512_mul_ps(dd, _mm512_set1_ps(a[c].d[u])), _mm512_cvtepi32_ps(isum[c]));
        if (xxs) r = _mm512_mul_ps(r, _mm512_set1_ps(0.25f));
        quant_tile_partial_add(p[c][u % QUANT_NPART], u, r);
    }
}

/* Every super-block of 16 interleaved rows of type T at W against NC columns into their
 * partials P; PREFETCH: ahead of the reads. T and NC constants where inlined, so that each
 * pass's loop is unrolled (with the super-block's size read at run time, the prefetch loop
 * stayed a loop, and bench --kernels had Q4_K/i at 2048 x 2048 at 53-58 GB/s against 98). */
QUANT_AVX512_INLINE void quant_interleaved_pass(enum gguf_type t, const uint8_t *w, const struct quant_q8k_view *a, int64_t nu,
                                                float (*p)[QUANT_NPART][16], int NC, int prefetch) {
    const size_t bytes = (size_t)QUANT_TILE_ROWS * (t == GGUF_TYPE_Q5_K ? 176 : t == GGUF_TYPE_Q2_K ? 84 : t == GGUF_TYPE_Q3_K ? 108
                                                    : t == GGUF_TYPE_Q6_K ? 208 : t == GGUF_TYPE_IQ4_XS ? 136 : t == GGUF_TYPE_IQ3_XXS ? 96
                                                    : t == GGUF_TYPE_IQ3_S ? 108 : 144); /* Q3_K, Q6_K, IQ3: their whole dwords */
    const int d_first = t == GGUF_TYPE_Q3_K || t == GGUF_TYPE_Q6_K || quant_interleaved_iq3(t);
    const uint8_t *d = w, *v = w + (d_first ? (size_t)nu * 32 : 0);
    for (int64_t u = 0; u < nu; u++) {
        const uint8_t *b = v + (size_t)u * bytes;
        for (size_t q = 0; prefetch && q < bytes; q += 64) _mm_prefetch((const char *)b + QUANT_INTERLEAVED_PREFETCH + q, _MM_HINT_T0);
        if (t == GGUF_TYPE_Q2_K || t == GGUF_TYPE_Q3_K || t == GGUF_TYPE_Q6_K)
            quant_interleaved_q236k_unit(t, b, d + (size_t)u * 32, a, u, p, NC); /* Q2_K: D unread */
        else if (quant_interleaved_iq3(t)) quant_interleaved_iq3_unit(t, b, d + (size_t)u * 32, a, u, p, NC);
        else if (t == GGUF_TYPE_IQ4_XS) quant_interleaved_iq4xs_unit(b, a, u, p, NC);
        else quant_interleaved_unit(b, t == GGUF_TYPE_Q5_K, a, u, p, NC);
    }
}

/* quant_interleaved_pass with T as a constant in each branch. */
QUANT_AVX512_INLINE void quant_interleaved_columns(enum gguf_type t, const uint8_t *w, const struct quant_q8k_view *a, int64_t nu,
                                                   float (*p)[QUANT_NPART][16], int NC, int prefetch) {
    switch (t) {
    case GGUF_TYPE_Q5_K: quant_interleaved_pass(GGUF_TYPE_Q5_K, w, a, nu, p, NC, prefetch); break;
    case GGUF_TYPE_Q2_K: quant_interleaved_pass(GGUF_TYPE_Q2_K, w, a, nu, p, NC, prefetch); break;
    case GGUF_TYPE_Q3_K: quant_interleaved_pass(GGUF_TYPE_Q3_K, w, a, nu, p, NC, prefetch); break;
    case GGUF_TYPE_Q6_K: quant_interleaved_pass(GGUF_TYPE_Q6_K, w, a, nu, p, NC, prefetch); break;
    case GGUF_TYPE_IQ4_XS: quant_interleaved_pass(GGUF_TYPE_IQ4_XS, w, a, nu, p, NC, prefetch); break;
    case GGUF_TYPE_IQ3_XXS: quant_interleaved_pass(GGUF_TYPE_IQ3_XXS, w, a, nu, p, NC, prefetch); break;
    case GGUF_TYPE_IQ3_S: quant_interleaved_pass(GGUF_TYPE_IQ3_S, w, a, nu, p, NC, prefetch); break;
    default: quant_interleaved_pass(GGUF_TYPE_Q4_K, w, a, nu, p, NC, prefetch); break;
    }
}

/* The AVX2 level's interleaved kernels need AVX-VNNI (VPDPBUSD on ymm). With AVX2's
 * maddubs, add and madd a step instead, the interleaved rows were no faster than the plain ones
 * (one core, in cache, Q4_K 2048 x 2048 one column: 25-27 against 23-25 GB/s; 512 x 2048 at 4
 * columns 45 against 52 GMAC/s): the steps cost the same in either layout. */
#define QUANT_AVX2_VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define QUANT_AVX2_VNNI_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c,avxvnni")))

/* quant_tile_k4_field for 8 rows in lanes, from dwords 1-3 of their super-blocks (U0-U2):
 * sub-block J's scale *SC (a dword) and min *MN (the int16 pair (m, m), for vpmaddwd). */
QUANT_AVX2_VNNI_INLINE void quant_avx2_k4_field(__m256i u0, __m256i u1, __m256i u2, int j, __m256i *sc, __m256i *mn) {
    const __m256i six = _mm256_set1_epi32(63), byte = _mm256_set1_epi32(0xff), low4 = _mm256_set1_epi32(15);
    const __m256i bs = _mm256_and_si256(_mm256_srli_epi32(u0, 8 * (j % 4)), byte);
    const __m256i bm = _mm256_and_si256(_mm256_srli_epi32(u1, 8 * (j % 4)), byte);
    __m256i m;
    if (j < 4) {
        *sc = _mm256_and_si256(bs, six);
        m = _mm256_and_si256(bm, six);
    } else {
        const __m256i b2 = _mm256_srli_epi32(u2, 8 * (j - 4));
        *sc = _mm256_or_si256(_mm256_and_si256(b2, low4), _mm256_slli_epi32(_mm256_srli_epi32(bs, 6), 4));
        m = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(b2, 4), low4), _mm256_slli_epi32(_mm256_srli_epi32(bm, 6), 4));
    }
    *mn = _mm256_or_si256(m, _mm256_slli_epi32(m, 16));
}

/* Super-block U of rows 8 HALF.. of 16 interleaved Q4_K rows at G (bytes 32 HALF.. of each
 * vector) against NC columns, as quant_interleaved_unit at 8 lanes: a vector of run h holds
 * sub-block 2h in its low nibbles and 2h + 1 in its high ones, both from one load; the same
 * integers and float step. */
QUANT_AVX2_VNNI_INLINE void quant_avx2_interleaved_unit(const uint8_t *g, int half, const struct quant_q8k_view *a, int64_t u,
                                                        float (*p)[QUANT_NPART][16], int NC) {
    const uint8_t *sm = g + 64 * 32 + 32 * half; /* scales and mins, then d and dmin */
    const __m256i m4 = _mm256_set1_epi8(0x0f), u0 = _mm256_loadu_si256((const __m256i *)sm);
    const __m256i u1 = _mm256_loadu_si256((const __m256i *)(sm + 64)), u2 = _mm256_loadu_si256((const __m256i *)(sm + 128));
    __m256i isum[QUANT_TILE_NC], msum[QUANT_TILE_NC];
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) isum[c] = msum[c] = _mm256_setzero_si256();
    for (int h = 0; h < 4; h++) {
        __m256i s[2][QUANT_TILE_NC];
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) s[0][c] = s[1][c] = _mm256_setzero_si256();
        QUANT_UNROLL(8)
        for (int m = 0; m < 8; m++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(g + 64 * (8 * h + m) + 32 * half));
            const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            QUANT_UNROLL(4)
            for (int c = 0; c < NC; c++) {
                const int8_t *x = a[c].qs + u * QUANT_QK_K + 64 * h + 4 * m;
                s[0][c] = _mm256_dpbusd_avx_epi32(s[0][c], lo, _mm256_set1_epi32(quant_rd32(x)));
                s[1][c] = _mm256_dpbusd_avx_epi32(s[1][c], hi, _mm256_set1_epi32(quant_rd32(x + 32)));
            }
        }
        __m256i sc[2], mn[2];
        quant_avx2_k4_field(u0, u1, u2, 2 * h, &sc[0], &mn[0]);
        quant_avx2_k4_field(u0, u1, u2, 2 * h + 1, &sc[1], &mn[1]);
        QUANT_UNROLL(4)
        for (int c = 0; c < NC; c++) {
            isum[c] = _mm256_add_epi32(isum[c], _mm256_add_epi32(_mm256_mullo_epi32(s[0][c], sc[0]), _mm256_mullo_epi32(s[1][c], sc[1])));
            const __m256i b = _mm256_add_epi32(_mm256_madd_epi16(mn[0], _mm256_set1_epi32(quant_rd32(a[c].bsums + u * 16 + 4 * h))),
                                               _mm256_madd_epi16(mn[1], _mm256_set1_epi32(quant_rd32(a[c].bsums + u * 16 + 4 * h + 2))));
            msum[c] = _mm256_add_epi32(msum[c], b);
        }
    }
    const __m256i dd = _mm256_loadu_si256((const __m256i *)(sm + 192));
    const __m256i dl = _mm256_and_si256(dd, _mm256_set1_epi32(0xffff)), dh = _mm256_srli_epi32(dd, 16);
    const __m256 d = _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(dl), _mm256_extracti128_si256(dl, 1)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(dh), _mm256_extracti128_si256(dh, 1)));
    QUANT_UNROLL(4)
    for (int c = 0; c < NC; c++) {
        const __m256 dx = _mm256_set1_ps(a[c].d[u]);
        const __m256 r = _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum[c])),
                                       _mm256_mul_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(msum[c])));
        quant_avx2_tile_partial_add(p[c][u % QUANT_NPART] + 8 * half, u, r);
    }
}

/* Every super-block of 16 interleaved Q4_K rows at W against NC columns into their partials P,
 * both halves of each; PREFETCH: ahead of the reads. The halves read the same act bytes, and
 * without the barrier between them gcc kept all of a super-block's broadcasts of them live
 * across both and spilled them to the stack. */
QUANT_AVX2_VNNI_INLINE void quant_avx2_interleaved_pass(const uint8_t *w, const struct quant_q8k_view *a, int64_t nu,
                                                        float (*p)[QUANT_NPART][16], int NC, int prefetch) {
    const size_t bytes = (size_t)QUANT_TILE_ROWS * 144;
    for (int64_t u = 0; u < nu; u++) {
        const uint8_t *g = w + (size_t)u * bytes;
        for (size_t q = 0; prefetch && q < bytes; q += 64) _mm_prefetch((const char *)g + QUANT_INTERLEAVED_PREFETCH + q, _MM_HINT_T0);
        quant_avx2_interleaved_unit(g, 0, a, u, p, NC);
        __asm__ volatile("" ::: "memory");
        quant_avx2_interleaved_unit(g, 1, a, u, p, NC);
    }
}

/* quant_interleaved at the AVX2 level with AVX-VNNI, for Q4_K (quant_interleaved_avx2_ok):
 * columns 4 at a time, the last few one by one; the first pass prefetches. */
static QUANT_AVX2_VNNI void quant_interleaved_avx2(const uint8_t *w, const uint8_t *acts, size_t stride, int nc, int64_t n, float *y,
                                                  size_t ys) {
    const int64_t nu = n / QUANT_QK_K;
    const int used = nu < QUANT_NPART ? (int)nu : QUANT_NPART;
    float p[QUANT_TILE_NC][QUANT_NPART][16];
    for (int c0 = 0; c0 < nc;) {
        const int cc = nc - c0 >= QUANT_TILE_NC ? QUANT_TILE_NC : 1;
        struct quant_q8k_view a[QUANT_TILE_NC];
        for (int c = 0; c < cc; c++) a[c] = quant_q8k_view(acts + (size_t)(c0 + c) * stride, n);
        if (cc == QUANT_TILE_NC) quant_avx2_interleaved_pass(w, a, nu, p, QUANT_TILE_NC, c0 == 0);
        else quant_avx2_interleaved_pass(w, a, nu, p, 1, c0 == 0);
        quant_tile_finish_avx2(p, used, cc, y + (size_t)c0 * ys, ys);
        c0 += cc;
    }
}

/* quant_interleaved by AVX-512 VNNI: columns 4 at a time, the last few one by one. The first
 * pass prefetches; the later ones find the group (18 KiB for 2048 Q4_K columns) in the L1 or L2. */
static QUANT_AVX512 void quant_interleaved_avx512(enum gguf_type t, const uint8_t *w, const uint8_t *acts, size_t stride, int nc,
                                                 int64_t n, float *y, size_t ys) {
    const int64_t nu = n / QUANT_QK_K;
    const int used = nu < QUANT_NPART ? (int)nu : QUANT_NPART;
    float p[QUANT_TILE_NC][QUANT_NPART][16];
    for (int c0 = 0; c0 < nc;) {
        const int cc = nc - c0 >= QUANT_TILE_NC ? QUANT_TILE_NC : 1;
        struct quant_q8k_view a[QUANT_TILE_NC];
        for (int c = 0; c < cc; c++) a[c] = quant_q8k_view(acts + (size_t)(c0 + c) * stride, n);
        if (cc == QUANT_TILE_NC) quant_interleaved_columns(t, w, a, nu, p, QUANT_TILE_NC, c0 == 0);
        else quant_interleaved_columns(t, w, a, nu, p, 1, c0 == 0);
        quant_tile_finish(p, used, cc, y + (size_t)c0 * ys, ys);
        c0 += cc;
    }
}

/* ---- dispatch ---- */

/* Kernels per level; NULL means "use the level below" (dotn: below that, one dot per column).
 * A rows kernel (fnr) goes with the dot of its own level: it serves only where that dot does,
 * the one it matches in speed, and without one a level runs one dot per row. avx512vbmi has
 * kernels of its own only for the IQ3 formats. */
static const struct {
    enum gguf_type type;
    quant_dot_fn fn[QUANT_LEVEL_COUNT];
    quant_dotn_fn fnn[QUANT_LEVEL_COUNT];
    quant_dotr_fn fnr[QUANT_LEVEL_COUNT];
    quant_pairs_fn fnp[QUANT_LEVEL_COUNT];
} quant_kernels[] = {
    { GGUF_TYPE_F32,  { quant_dot_f32_scalar,  quant_dot_f32_avx2,  quant_dot_f32_avx512 }, { NULL, quant_dot_f32_avx2n, quant_dot_f32_avx512n }, { NULL, NULL, NULL }, { NULL } },
    { GGUF_TYPE_F16,  { quant_dot_f16_scalar,  quant_dot_f16_avx2,  quant_dot_f16_avx512 }, { NULL, quant_dot_f16_avx2n, quant_dot_f16_avx512n }, { NULL, NULL, NULL }, { NULL } },
    { GGUF_TYPE_BF16, { quant_dot_bf16_scalar, quant_dot_bf16_avx2, quant_dot_bf16_avx512 }, { NULL, quant_dot_bf16_avx2n, quant_dot_bf16_avx512n }, { NULL, NULL, NULL }, { NULL } },
    { GGUF_TYPE_Q8_0, { quant_dot_q8_0_scalar, quant_dot_q8_0_avx2, quant_dot_q8_0_avx512 }, { NULL, quant_dot_q8_0_avx2n, quant_dot_q8_0_avx512n }, { NULL, NULL, quant_dotr_q8_0_avx512 }, { NULL } },
    { GGUF_TYPE_Q4_0, { quant_dot_q4_0_scalar, quant_dot_q4_0_avx2, quant_dot_q4_0_avx512 }, { NULL, quant_dot_q4_0_avx2n, quant_dot_q4_0_avx512n }, { NULL, NULL, quant_dotr_q4_0_avx512 }, { NULL } },
    { GGUF_TYPE_Q4_1, { quant_dot_q4_1_scalar, quant_dot_q4_1_avx2, quant_dot_q4_1_avx512 }, { NULL, quant_dot_q4_1_avx2n, quant_dot_q4_1_avx512n }, { NULL, NULL, quant_dotr_q4_1_avx512 }, { NULL } },
    { GGUF_TYPE_Q5_0, { quant_dot_q5_0_scalar, quant_dot_q5_0_avx2, quant_dot_q5_0_avx512 }, { NULL, quant_dot_q5_0_avx2n, quant_dot_q5_0_avx512n }, { NULL, NULL, quant_dotr_q5_0_avx512 }, { NULL } },
    { GGUF_TYPE_Q5_1, { quant_dot_q5_1_scalar, quant_dot_q5_1_avx2, quant_dot_q5_1_avx512 }, { NULL, quant_dot_q5_1_avx2n, quant_dot_q5_1_avx512n }, { NULL, NULL, quant_dotr_q5_1_avx512 }, { NULL } },
    { GGUF_TYPE_Q4_K, { quant_dot_q4_k_scalar, quant_dot_q4_k_avx2, quant_dot_q4_k_avx512 }, { NULL, quant_dot_q4_k_avx2n, quant_dot_q4_k_avx512n }, { NULL, quant_dotr_q4_k_avx2, quant_dotr_q4_k_avx512 },
      { NULL, NULL, quant_pairs_q4_k_avx512 } },
    { GGUF_TYPE_Q5_K, { quant_dot_q5_k_scalar, quant_dot_q5_k_avx2, quant_dot_q5_k_avx512 }, { NULL, quant_dot_q5_k_avx2n, quant_dot_q5_k_avx512n }, { NULL, quant_dotr_q5_k_avx2, quant_dotr_q5_k_avx512 },
      { NULL, NULL, quant_pairs_q5_k_avx512 } },
    { GGUF_TYPE_Q6_K, { quant_dot_q6_k_scalar, quant_dot_q6_k_avx2, quant_dot_q6_k_avx512 }, { NULL, quant_dot_q6_k_avx2n, quant_dot_q6_k_avx512n }, { NULL, quant_dotr_q6_k_avx2, quant_dotr_q6_k_avx512 },
      { NULL, NULL, quant_pairs_q6_k_avx512 } },
    { GGUF_TYPE_Q2_K, { quant_dot_q2_k_scalar, quant_dot_q2_k_avx2, quant_dot_q2_k_avx512 }, { NULL, quant_dot_q2_k_avx2n, quant_dot_q2_k_avx512n }, { NULL, quant_dotr_q2_k_avx2, quant_dotr_q2_k_avx512 },
      { NULL, NULL, quant_pairs_q2_k_avx512 } },
    { GGUF_TYPE_Q3_K, { quant_dot_q3_k_scalar, quant_dot_q3_k_avx2, quant_dot_q3_k_avx512 }, { NULL, quant_dot_q3_k_avx2n, quant_dot_q3_k_avx512n }, { NULL, quant_dotr_q3_k_avx2, quant_dotr_q3_k_avx512 },
      { NULL, NULL, quant_pairs_q3_k_avx512 } },
    { GGUF_TYPE_IQ4_XS, { quant_dot_iq4_xs_scalar, quant_dot_iq4_xs_avx2, quant_dot_iq4_xs_avx512 }, { NULL, quant_dot_iq4_xs_avx2n, quant_dot_iq4_xs_avx512n }, { NULL, quant_dotr_iq4_xs_avx2, quant_dotr_iq4_xs_avx512 },
      { NULL, NULL, quant_pairs_iq4_xs_avx512 } },
    { GGUF_TYPE_IQ3_XXS, { quant_dot_iq3_xxs_scalar, quant_dot_iq3_xxs_avx2, quant_dot_iq3_xxs_avx512, quant_dot_iq3_xxs_avx512vbmi },
      { NULL, quant_dot_iq3_xxs_avx2n, quant_dot_iq3_xxs_avx512n, quant_dot_iq3_xxs_avx512vbmin }, { NULL, quant_dotr_iq3_xxs_avx2, quant_dotr_iq3_xxs_avx512, quant_dotr_iq3_xxs_avx512vbmi }, { NULL } },
    { GGUF_TYPE_IQ3_S, { quant_dot_iq3_s_scalar, quant_dot_iq3_s_avx2, quant_dot_iq3_s_avx512, quant_dot_iq3_s_avx512vbmi },
      { NULL, quant_dot_iq3_s_avx2n, quant_dot_iq3_s_avx512n, quant_dot_iq3_s_avx512vbmin }, { NULL, quant_dotr_iq3_s_avx2, quant_dotr_iq3_s_avx512, quant_dotr_iq3_s_avx512vbmi }, { NULL } },
    { GGUF_TYPE_IQ4_NL, { quant_dot_iq4_nl_scalar, quant_dot_iq4_nl_avx2, quant_dot_iq4_nl_avx512 }, { NULL, quant_dot_iq4_nl_avx2n, quant_dot_iq4_nl_avx512n }, { NULL, NULL, quant_dotr_iq4_nl_avx512 }, { NULL } },
    { GGUF_TYPE_MXFP4, { quant_dot_mxfp4_scalar, quant_dot_mxfp4_avx2, quant_dot_mxfp4_avx512 }, { NULL, quant_dot_mxfp4_avx2n, quant_dot_mxfp4_avx512n }, { NULL, NULL, quant_dotr_mxfp4_avx512 }, { NULL } },
};

static const char *const quant_level_names[QUANT_LEVEL_COUNT] = { "scalar", "avx2", "avx512", "avx512vbmi" };

/* Highest level plat_cpu allows. */
static int quant_level_max(void) {
    const struct plat_cpu *c = &plat_cpu;
    if (!(c->avx2 && c->fma && c->f16c)) return QUANT_LEVEL_SCALAR;
    if (!(c->avx512f && c->avx512bw && c->avx512vl && c->avx512vnni)) return QUANT_LEVEL_AVX2;
    return c->avx512vbmi && c->avx512bitalg ? QUANT_LEVEL_AVX512VBMI : QUANT_LEVEL_AVX512;
}

/* y[c * ys + r] = quant_dot of row r of the 16 interleaved rows of type T at W (a group of
 * quant_interleave's) with column c, for c < NC, bit for bit, whatever the level now: the AVX2
 * kernel at the AVX2 level where it has one, and on a CPU without AVX-512 (a matrix is
 * interleaved only where the CPU has its level's kernel), else the AVX-512 one. */
static void quant_interleaved(enum gguf_type t, const uint8_t *w, const uint8_t *acts, size_t stride, int nc, int64_t n, float *y,
                              size_t ys) {
    if ((quant_level == QUANT_LEVEL_AVX2 && quant_interleaved_avx2_ok(t)) || quant_level_max() < QUANT_LEVEL_AVX512)
        quant_interleaved_avx2(w, acts, stride, nc, n, y, ys);
    else quant_interleaved_avx512(t, w, acts, stride, nc, n, y, ys);
}

/* Fills the dot table for `level`. Caller: level <= quant_level_max(); no dot in flight. */
static void quant_set_level(int level) {
    if (level < 0 || level > quant_level_max()) die("quant: level %d not supported by this CPU", level);
    quant_tables_init();
    memset(quant_dot_table, 0, sizeof quant_dot_table);
    memset(quant_dotn_table, 0, sizeof quant_dotn_table);
    memset(quant_dotr_table, 0, sizeof quant_dotr_table);
    memset(quant_pairs_table, 0, sizeof quant_pairs_table);
    for (size_t i = 0; i < sizeof quant_kernels / sizeof quant_kernels[0]; i++) {
        int l = level;
        while (!quant_kernels[i].fn[l]) l--;
        quant_dot_table[quant_kernels[i].type] = quant_kernels[i].fn[l];
        quant_dotr_table[quant_kernels[i].type] = quant_kernels[i].fnr[l];
        for (l = level; l >= 0 && !quant_kernels[i].fnn[l]; l--) {}
        quant_dotn_table[quant_kernels[i].type] = l >= 0 ? quant_kernels[i].fnn[l] : NULL;
        for (l = level; l >= 0 && !quant_kernels[i].fnp[l]; l--) {}
        quant_pairs_table[quant_kernels[i].type] = l >= 0 ? quant_kernels[i].fnp[l] : NULL;
    }
    quant_level = level;
}

static const char *quant_level_name(void) { return quant_level_names[quant_level]; }

/* Picks the best level for plat_cpu, or the one COLI_CPU=scalar|avx2|avx512|avx512vbmi forces
 * (dies on an unknown value or a level this CPU lacks). Caller: plat_cpu filled. */
static void quant_init(void) {
    int level = quant_level_max();
    const char *env = getenv("COLI_CPU");
    if (env && *env) {
        int want = -1;
        for (int l = 0; l < QUANT_LEVEL_COUNT; l++)
            if (!strcmp(env, quant_level_names[l])) want = l;
        if (want < 0) die_usage("COLI_CPU=%s: unknown level (use scalar, avx2, avx512 or avx512vbmi)", env);
        if (want > level)
            die("COLI_CPU=%s: this CPU (%s) supports at most %s", env, plat_cpu.name, quant_level_names[level]);
        level = want;
    }
    quant_set_level(level);
}

/* Quantises/rounds x[n] into act (quant_act_bytes(wtype, n) bytes, 64-byte aligned) the way
 * the dot kernels of wtype expect. Caller: n is a multiple of wtype's block size. */
static void quant_act_prepare(enum gguf_type wtype, const float *x, int64_t n, void *act) {
    float *f = act;
    const int simd = quant_level >= QUANT_LEVEL_AVX512;
    switch (quant_act_kind(wtype)) {
    case QUANT_ACT_Q8: (simd ? quant_act_q8_avx512 : quant_act_q8)(x, n, act); return;
    case QUANT_ACT_Q8K: (simd ? quant_act_q8k_avx512 : quant_act_q8k)(x, n, act); return;
    default: break;
    }
    if (simd && wtype != GGUF_TYPE_F32)
        quant_act_round_avx512(wtype, x, n, f);
    else if (wtype == GGUF_TYPE_F16)
        for (int64_t i = 0; i < n; i++) f[i] = quant_f16_to_f32(quant_f32_to_f16(x[i]));
    else if (wtype == GGUF_TYPE_BF16)
        for (int64_t i = 0; i < n; i++) f[i] = quant_bf16_to_f32(quant_f32_to_bf16(x[i]));
    else
        memcpy(f, x, (size_t)n * 4);
}

/* Dot of one weight row (GGUF blocks of wtype) with an act from quant_act_prepare(wtype, ., n),
 * in canonical order. Caller: quant_init done, wtype supported, n a multiple of its block. */
static float quant_dot(enum gguf_type wtype, const void *wrow, const void *act, int64_t n) {
    return quant_dot_table[wtype](wrow, act, n);
}

/* y[c*ys] = quant_dot(wtype, wrow, acts + c*stride, n) for c < nc, bit for bit; a multi-column
 * kernel decodes each weight block once for all columns. Caller: as quant_dot, every act
 * 64-byte aligned. */
static void quant_dotn(enum gguf_type wtype, const void *wrow, const uint8_t *acts, size_t stride,
                       int nc, int64_t n, float *y, size_t ys) {
    if (quant_dotn_table[wtype]) { quant_dotn_table[wtype](wrow, acts, stride, nc, n, y, ys); return; }
    for (int c = 0; c < nc; c++) y[(size_t)c * ys] = quant_dot(wtype, wrow, acts + (size_t)c * stride, n);
}

/* y[r] = quant_dot(wtype, wrows + r*row_bytes, act, n) for r < nrows, bit for bit; a rows kernel
 * packs short rows several to a vector. Caller: as quant_dot. */
static void quant_dotr(enum gguf_type wtype, const uint8_t *wrows, size_t row_bytes, int nrows,
                       const void *act, int64_t n, float *y) {
    if (quant_dotr_table[wtype]) { quant_dotr_table[wtype](wrows, row_bytes, nrows, act, n, y); return; }
    for (int r = 0; r < nrows; r++) y[r] = quant_dot(wtype, wrows + (size_t)r * row_bytes, act, n);
}

/* y[c*ys + r] = quant_dot of row r of the NROWS at WROWS with column c, for c < NC, bit for bit,
 * when this level has a kernel for rows of N elements of WTYPE (K rows of 2 super-blocks: the
 * experts' down products); returns 0 when it has none. Caller: as quant_dotn. */
static int quant_pairs(enum gguf_type wtype, const uint8_t *wrows, size_t row_bytes, int nrows, const uint8_t *acts, size_t stride,
                       int nc, int64_t n, float *y, size_t ys) {
    if (n != 2 * QUANT_QK_K || !quant_pairs_table[wtype]) return 0;
    quant_pairs_table[wtype](wrows, row_bytes, nrows, acts, stride, nc, y, ys);
    return 1;
}

/* Whether quant_tile takes NC columns of rows of N elements of TYPE at this level. */
static int quant_tile_ok(enum gguf_type wtype, int nc, int64_t n) {
    const int k45 = wtype == GGUF_TYPE_Q4_K || wtype == GGUF_TYPE_Q5_K;
    if (quant_level == QUANT_LEVEL_AVX2) {
        const int k = k45 || wtype == GGUF_TYPE_Q6_K;
        return (k || wtype == GGUF_TYPE_Q4_0) && nc >= (k && n > 2 * QUANT_QK_K ? QUANT_AVX2_TILE_MIN_NC_LONG_K : QUANT_AVX2_TILE_MIN_NC);
    }
    return (k45 || wtype == GGUF_TYPE_Q8_0 || wtype == GGUF_TYPE_Q4_0) && nc >= QUANT_TILE_MIN_NC && quant_level >= QUANT_LEVEL_AVX512;
}

/* y[c * ys + r] = quant_dot of row r of the QUANT_TILE_ROWS rows at WROWS with column c, for
 * c < NC, bit for bit; SCRATCH holds quant_tile_bytes(wtype, n), one per thread. Caller: quant_tile_ok. */
static void quant_tile(enum gguf_type wtype, const uint8_t *wrows, size_t row_bytes, const uint8_t *acts, size_t stride, int nc,
                       int64_t n, float *y, size_t ys, void *scratch) {
    if (quant_level == QUANT_LEVEL_AVX2)
        (wtype == GGUF_TYPE_Q4_K   ? quant_tile_q4k_avx2
         : wtype == GGUF_TYPE_Q5_K ? quant_tile_q5k_avx2
         : wtype == GGUF_TYPE_Q6_K ? quant_tile_q6k_avx2
                                   : quant_tile_q4_0_avx2)(wrows, row_bytes, acts, stride, nc, n, y, ys, scratch);
    else if (wtype == GGUF_TYPE_Q8_0 || wtype == GGUF_TYPE_Q4_0)
        quant_tile_legacy_avx512(wrows, row_bytes, wtype == GGUF_TYPE_Q4_0, acts, stride, nc, n, y, ys, scratch);
    else quant_tile_q45k_avx512(wrows, row_bytes, wtype == GGUF_TYPE_Q5_K, acts, stride, nc, n, y, ys, scratch);
}

/* ==== §4 ops ==== */
/* Owns: the tensor operations of the forward pass; this part: matrix-vector and matrix-matrix
 *   products over GGUF weight matrices, and the kernel benchmark.
 * Promises: y = W·x with each output computed in quant_dot's canonical order (quant_dotn decodes
 *   a row once for all columns), so results never depend on the thread count, the row
 *   placement or matvec vs matmat.
 * May call: §3 quant, die, plat_alloc*, OpenMP.
 * Workload: the bulk of inference time; memory bound (every weight byte read once per token),
 *   parallel over row chunks. Called from one orchestrating thread only: the activation scratch
 *   is a single static buffer. */

/* A weight matrix: ROWS rows of ROW_BYTES at DATA, in GGUF's order or, where INTERLEAVED, in
 * quant_interleave's (16 rows a group, the same bytes a group: §8 model_own_trunk makes it). */
struct ops_matrix { enum gguf_type type; const uint8_t *data; int64_t rows, cols; size_t row_bytes; int interleaved; };

#define OPS_ROW_CHUNK 16 /* rows per OpenMP work item: keeps y writes off shared cache lines */
#define OPS_ACT_BLOCK (32 << 10) /* bytes of prepared columns a row chunk takes at a time (L1: 48 KiB) */

/* One product of a batch (ops_matmat_jobs): y[n][rows] = W·x[n][cols]. */
struct ops_job {
    struct ops_matrix w;
    const float *x;
    float *y;
    int n;
};

#define OPS_MAX_JOBS 64
#define OPS_PARALLEL_ELEMS 65536 /* elements of per-element work (acts to prepare, ~1 ns each; SwiGLU) from which two threads pay */

/* §5 cuda sets this when matrices are resident on a device: it runs there the jobs whose
 * matrices are, over their prepared columns at ACT + OFF[j] (ops_act_stride apart), and
 * marks them in DONE; the CPU computes the rest. The one place §4 reaches a device. */
static void (*ops_offload)(const struct ops_job *jobs, int n, const uint8_t *act, const size_t *off, uint8_t *done);

/* Scratch that only grows: one for the prepared activations, one for the threads' quant_tile
 * tiles (on the heap: 16 rows of 4096 columns take 90 KiB, most of a musl thread's stack). */
struct ops_scratch { void *buf; size_t cap; };
static struct ops_scratch ops_act_buf, ops_tile_buf;

/* Bytes of one prepared activation column of COLS for weights of TYPE (or of matrix W),
 * rounded up to keep every column 64-byte aligned. */
static size_t ops_act_stride_of(enum gguf_type type, int64_t cols) { return (quant_act_bytes(type, cols) + 63) & ~(size_t)63; }
static size_t ops_act_stride(const struct ops_matrix *w) { return ops_act_stride_of(w->type, w->cols); }

/* Returns S, grown to at least n bytes (contents not kept). Not thread-safe. */
static void *ops_scratch(struct ops_scratch *s, size_t n) {
    if (n > s->cap) {
        free(s->buf);
        s->buf = plat_alloc_aligned(n);
        s->cap = n;
    }
    return s->buf;
}

static void ops_check_matrix(const struct ops_matrix *w) {
    const struct gguf_type_info *ti = gguf_type_get(w->type);
    if (!ti) die("matmul: unsupported weight type %d", (int)w->type);
    if (w->cols % ti->block_elems)
        die("matmul: %s row of %lld elements is not a whole number of blocks", ti->name, (long long)w->cols);
}

/* The acts of the jobs that own one (OWN), column by column, in parallel once a prompt's batch
 * has enough of them to pay a parallel region (each column is prepared alone: the same bits). */
static void ops_prepare_acts(const struct ops_job *jobs, int n_jobs, const uint8_t *own, uint8_t *act, const size_t *off,
                             const size_t *stride) {
    int64_t first_col[OPS_MAX_JOBS + 1] = {0}, elems = 0;
    for (int j = 0; j < n_jobs; j++) {
        const int64_t n = own[j] && jobs[j].n > 0 ? jobs[j].n : 0;
        first_col[j + 1] = first_col[j] + n;
        elems += n * jobs[j].w.cols;
    }
    #pragma omp parallel for schedule(static) if (elems >= OPS_PARALLEL_ELEMS)
    for (int64_t i = 0; i < first_col[n_jobs]; i++) {
        int j = 0;
        while (i >= first_col[j + 1]) j++;
        const int64_t t = i - first_col[j];
        quant_act_prepare(jobs[j].w.type, jobs[j].x + (size_t)t * jobs[j].w.cols, jobs[j].w.cols, act + off[j] + (size_t)t * stride[j]);
    }
}

/* Rows [r0, r1) of W times the N prepared columns at ACT (STRIDE apart) into Y ([n][rows]): by
 * quant_pairs where it serves (K rows of 2 super-blocks), else by quant_dotn, a block of columns
 * at a time: the block's activations stay in the L1 while every
 * row of the chunk uses them, and the rows come again from the L2. Row by row, each row read
 * every column's activations from the L2 or beyond (an F32 router's 256 columns are 2 MiB). A
 * scratch harness, one core, 256 rows of 2048 by 256 columns, 16-row chunks, GMAC/s in blocks
 * against row by row: F32 57 against 21, Q8_0 91-93 against 77-80, Q6_K 112 against 89. */
static void ops_dotn_rows(const struct ops_matrix *w, int64_t r0, int64_t r1, const uint8_t *act, size_t stride, int n, float *y) {
    if (quant_pairs(w->type, w->data + (size_t)r0 * w->row_bytes, w->row_bytes, (int)(r1 - r0), act, stride, n, w->cols, y + r0,
                    (size_t)w->rows))
        return;
    int block = (int)(OPS_ACT_BLOCK / stride) & ~(QUANT_NCOL - 1); /* whole groups of the kernel's columns */
    if (block < QUANT_NCOL) block = QUANT_NCOL;
    for (int c0 = 0; c0 < n; c0 += block)
        for (int64_t r = r0; r < r1; r++)
            quant_dotn(w->type, w->data + (size_t)r * w->row_bytes, act + (size_t)c0 * stride, stride, n - c0 < block ? n - c0 : block, w->cols,
                       y + (size_t)c0 * w->rows + r, (size_t)w->rows);
}

/* The order in which the parallel loop takes the jobs' chunks of OPS_ROW_CHUNK rows: the jobs by
 * the work of a chunk (its bytes times its columns), least first, ORDER[k] the k-th, its chunks
 * from FIRST_CHUNK[k] on. Guided scheduling hands the first chunks out in long runs and the last
 * ones a few at a time, so the heaviest chunks (an F32 router's 16 rows are 128 KiB, a Q4_K
 * matrix's 18 KiB) even out between the threads at the end instead of all going into one
 * thread's first run. */
static void ops_chunk_order(const struct ops_job *jobs, int n_jobs, const uint8_t *done, int *order, int64_t *first_chunk) {
    for (int j = 0; j < n_jobs; j++) { /* insertion sort, stable */
        int k = j;
        for (; k > 0 && jobs[order[k - 1]].w.row_bytes * (size_t)jobs[order[k - 1]].n > jobs[j].w.row_bytes * (size_t)jobs[j].n; k--)
            order[k] = order[k - 1];
        order[k] = j;
    }
    first_chunk[0] = 0;
    for (int k = 0; k < n_jobs; k++) {
        const struct ops_job *job = &jobs[order[k]];
        first_chunk[k + 1] = first_chunk[k] + (done[order[k]] || job->n < 1 ? 0 : (job->w.rows + OPS_ROW_CHUNK - 1) / OPS_ROW_CHUNK);
    }
}

/* Every job's product (job j: y[n][rows] = W·x[n][cols]) in one parallel loop over all their
 * rows, so that several small products pay one parallel region and its barrier, and each
 * thread has rows of every matrix in flight. Jobs with the same x, n, type and width share one
 * prepared activation (and, on a device, one upload). Job j's y is bit-identical whatever the
 * batch, the thread count or the device. Caller: quant_init done; at most OPS_MAX_JOBS jobs;
 * no y overlaps an x; one caller at a time. */
static void ops_matmat_jobs(const struct ops_job *jobs, int n_jobs) {
    size_t off[OPS_MAX_JOBS + 1] = {0}, stride[OPS_MAX_JOBS] = {0}, end = 0;
    int64_t first_chunk[OPS_MAX_JOBS + 1];
    int order[OPS_MAX_JOBS];
    uint8_t done[OPS_MAX_JOBS] = {0}, own[OPS_MAX_JOBS] = {0};
    if (n_jobs > OPS_MAX_JOBS) die("internal: %d products in one batch (at most %d)", n_jobs, OPS_MAX_JOBS);
    for (int j = 0; j < n_jobs; j++) {
        const struct ops_matrix *w = &jobs[j].w;
        ops_check_matrix(w);
        int i = 0;
        while (i < j && (jobs[i].x != jobs[j].x || jobs[i].n != jobs[j].n || jobs[i].w.type != w->type || jobs[i].w.cols != w->cols)) i++;
        own[j] = i == j;
        off[j] = own[j] ? end : off[i];
        stride[j] = ops_act_stride(w);
        if (own[j]) end += stride[j] * (size_t)(jobs[j].n > 0 ? jobs[j].n : 0);
    }
    uint8_t *act = ops_scratch(&ops_act_buf, end);
    ops_prepare_acts(jobs, n_jobs, own, act, off, stride);
    if (ops_offload) ops_offload(jobs, n_jobs, act, off, done);
    size_t tile_bytes = 0;
    for (int j = 0; j < n_jobs; j++)
        if (!done[j] && !jobs[j].w.interleaved && quant_tile_ok(jobs[j].w.type, jobs[j].n, jobs[j].w.cols) &&
            quant_tile_bytes(jobs[j].w.type, jobs[j].w.cols) > tile_bytes)
            tile_bytes = quant_tile_bytes(jobs[j].w.type, jobs[j].w.cols);
    uint8_t *tiles = tile_bytes ? ops_scratch(&ops_tile_buf, tile_bytes * (size_t)plat_threads()) : NULL;
    ops_chunk_order(jobs, n_jobs, done, order, first_chunk);
    /* guided: long runs of rows per thread first (sequential streams for the prefetchers), then
     * shrinking pieces that even out a thread that fell behind (slice decode +5% over static;
     * dynamic, which interleaves the threads' rows, lost 7%) */
    #pragma omp parallel for schedule(guided)
    for (int64_t c = 0; c < first_chunk[n_jobs]; c++) {
        int k = 0;
        while (c >= first_chunk[k + 1]) k++;
        const int j = order[k];
        const struct ops_matrix *w = &jobs[j].w;
        int64_t r0 = (c - first_chunk[k]) * OPS_ROW_CHUNK, r1 = r0 + OPS_ROW_CHUNK < w->rows ? r0 + OPS_ROW_CHUNK : w->rows;
        if (w->interleaved)
            quant_interleaved(w->type, w->data + (size_t)r0 * w->row_bytes, act + off[j], stride[j], jobs[j].n, w->cols, jobs[j].y + r0,
                              (size_t)w->rows);
        else if (jobs[j].n == 1)
            quant_dotr(w->type, w->data + (size_t)r0 * w->row_bytes, w->row_bytes, (int)(r1 - r0), act + off[j], w->cols, jobs[j].y + r0);
        else if (r1 - r0 == QUANT_TILE_ROWS && quant_tile_ok(w->type, jobs[j].n, w->cols))
            quant_tile(w->type, w->data + (size_t)r0 * w->row_bytes, w->row_bytes, act + off[j], stride[j], jobs[j].n, w->cols, jobs[j].y + r0,
                       (size_t)w->rows, tiles + tile_bytes * (size_t)omp_get_thread_num());
        else
            ops_dotn_rows(w, r0, r1, act + off[j], stride[j], jobs[j].n, jobs[j].y);
    }
}

/* y[n][rows] = W·x[n][cols]. Caller: as ops_matmat_jobs. The weight row stays in cache while
 * the n columns use it. */
static void ops_matmat(const struct ops_matrix *w, const float *x, float *y, int n) {
    struct ops_job job = {*w, x, y, n};
    ops_matmat_jobs(&job, 1);
}

/* y[rows] = W·x[cols]. */
static void ops_matvec(const struct ops_matrix *w, const float *x, float *y) { ops_matmat(w, x, y, 1); }

/* ---- kernel benchmark ---- */

/* Sum of n uint64 (n a multiple of 16), one pass of pure reads. */
static QUANT_AVX2 uint64_t ops_bench_read(const uint64_t *p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n; i += 16) {
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(p + i + 4)));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *)(p + i + 8)));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *)(p + i + 12)));
    }
    uint64_t t[4];
    _mm256_storeu_si256((__m256i *)t, _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
    return t[0] + t[1] + t[2] + t[3];
}

/* Fills n bytes (the last n % 8 are left) with xorshift noise, a stream of its own per SEED, in
 * parallel (first touch per thread). */
static void ops_bench_fill(uint8_t *buf, size_t n, uint64_t seed) {
    #pragma omp parallel for schedule(static)
    for (size_t c = 0; c < n / 8; c += 4096) {
        uint64_t s = 0x9e3779b97f4a7c15ULL ^ ((c + seed * 0x2545f4914f6cdd1dULL) * 0xbf58476d1ce4e5b9ULL);
        size_t e = c + 4096 < n / 8 ? c + 4096 : n / 8;
        for (size_t i = c; i < e; i++) {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17;
            memcpy(buf + 8 * i, &s, 8);
        }
    }
}

/* Best-of-3 GB/s of a multi-threaded read of buf (n bytes, 64-aligned, multiple of 4 KiB). */
static double ops_bench_bandwidth(const uint8_t *buf, size_t n) {
    double best = 0;
    volatile uint64_t sink = 0;
    for (int rep = 0; rep < 3; rep++) {
        uint64_t total = 0;
        double t0 = omp_get_wtime();
        #pragma omp parallel for schedule(static) reduction(+ : total)
        for (size_t c = 0; c < n / 4096; c++) total += ops_bench_read((const uint64_t *)(buf + c * 4096), 512);
        double gbs = (double)n / (omp_get_wtime() - t0) / 1e9;
        sink += total;
        if (gbs > best) best = gbs;
    }
    (void)sink;
    return best;
}

/* GB/s of weight bytes for y = W·x on a rows x cols matrix of type t at w (already filled):
 * best of repeated runs for >= 0.2 s (3 runs at least). */
static double ops_bench_gemv(enum gguf_type t, uint8_t *w, int64_t rows, int64_t cols, int interleave, float *x, float *y) {
    const struct gguf_type_info *ti = gguf_type_get(t);
    size_t rb = (size_t)(cols / ti->block_elems) * (size_t)ti->block_bytes;
    if (interleave) rows -= rows % QUANT_TILE_ROWS;
    struct ops_matrix m = { t, w, rows, cols, rb, interleave };
    quant_sanitize_random(t, w, rb * (size_t)rows, -1);
    uint8_t *packed = interleave ? plat_alloc_aligned(rb * (size_t)rows) : NULL;
    if (packed) {
        quant_interleave(t, packed, w, rb, rows);
        m.data = packed;
    }
    ops_matvec(&m, x, y);
    double best = 1e30, start = omp_get_wtime();
    for (int rep = 0; rep < 3 || omp_get_wtime() - start < 0.2; rep++) {
        double t0 = omp_get_wtime();
        ops_matvec(&m, x, y);
        double dt = omp_get_wtime() - t0;
        if (dt < best) best = dt;
    }
    free(packed);
    return (double)rb * (double)rows / best / 1e9;
}

/* Bytes of the last-level cache (sysfs index3), 32 MiB if unknown. */
static size_t ops_bench_llc(void) {
    size_t kib = 32 * 1024;
    FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
    if (f) {
        unsigned long v;
        char unit = 'K';
        if (fscanf(f, "%lu%c", &v, &unit) >= 1) kib = unit == 'M' ? v * 1024 : v;
        fclose(f);
    }
    return kib * 1024;
}

/* The host's read bandwidth in GB/s, measured now on a buffer of 4x the last-level cache
 * (256 MiB to 1 GiB). */
static double ops_bench_host_gbps(void)
{
    size_t n = 4 * ops_bench_llc();
    n = (n < ((size_t)256 << 20) ? (size_t)256 << 20 : n > ((size_t)1 << 30) ? (size_t)1 << 30 : n) & ~(size_t)4095;
    uint8_t *buf = plat_alloc_aligned(n);
    ops_bench_fill(buf, n, 0);
    double gbps = ops_bench_bandwidth(buf, n);
    free(buf);
    return gbps;
}

/* One row of ops_bench_kernels: type T (INTERLEAVE: interleaved) at each shape, over BUF (BIG bytes). */
static void ops_bench_kernels_row(enum gguf_type t, int interleave, uint8_t *buf, size_t big, float *x, float *y) {
    const struct gguf_type_info *ti = gguf_type_get(t);
    const size_t block_row = (size_t)(512 / ti->block_elems) * (size_t)ti->block_bytes; /* 512 columns */
    double g1 = ops_bench_gemv(t, buf, 2048, 2048, interleave, x, y), g2 = ops_bench_gemv(t, buf, 8192, 2048, interleave, x, y);
    double g3 = ops_bench_gemv(t, buf, 2048, 512, interleave, x, y), bw0 = ops_bench_bandwidth(buf, big);
    double g4 = ops_bench_gemv(t, buf, (int64_t)(big / (8 * block_row)), 4096, interleave, x, y), bw1 = ops_bench_bandwidth(buf, big);
    double g5 = ops_bench_gemv(t, buf, (int64_t)(big / block_row), 512, interleave, x, y), bw2 = ops_bench_bandwidth(buf, big);
    char name[16];
    snprintf(name, sizeof name, "%s%s", ti->name, interleave ? "/i" : "");
    printf("%-8s %9.1f GB/s %9.1f GB/s %9.1f GB/s %9.1f GB/s (%3.0f%%) %9.1f GB/s (%3.0f%%)\n", name, g1, g2, g3, g4,
           200 * g4 / (bw0 + bw1), g5, 200 * g5 / (bw1 + bw2));
}

/* Prints GEMV throughput (GB/s of weight bytes) per format and shape, the large matrix's against
 * the read bandwidth measured beside it, on the current OpenMP thread count. Caller: quant_init
 * done. */
static void ops_bench_kernels(void) {
    size_t big = 4 * ops_bench_llc();
    big = big < ((size_t)1 << 30) ? (size_t)1 << 30 : big > ((size_t)3 << 29) ? (size_t)3 << 29 : big;
    big &= ~(size_t)4095;
    uint8_t *buf = plat_alloc_aligned(big);
    ops_bench_fill(buf, big, 0);
    double bw = ops_bench_bandwidth(buf, big);
    float *x = plat_alloc(sizeof(float) * 8192), *y = plat_alloc_aligned(big / 64 * sizeof(float));
    for (int i = 0; i < 8192; i++) x[i] = (float)((i * 7919) % 2001 - 1000) / 1000.0f;
    printf("quant level %s, %d threads, read bandwidth %.1f GB/s (%zu MiB buffer)\n",
           quant_level_name(), omp_get_max_threads(), bw, big >> 20);
    printf("%-8s %14s %14s %14s %22s %22s\n", "type", "2048x2048", "8192x2048", "2048x512", "large x4096 (ratio*)",
           "large x512 (ratio*)");
    for (size_t i = 0; i < sizeof quant_kernels / sizeof quant_kernels[0]; i++) { /* every format with kernels */
        ops_bench_kernels_row(quant_kernels[i].type, 0, buf, big, x, y);
        if (quant_interleave_ok(quant_kernels[i].type, QUANT_TILE_ROWS)) ops_bench_kernels_row(quant_kernels[i].type, 1, buf, big, x, y);
    }
    printf("* against the mean of the read bandwidth measured just before and just after: on a shared\n"
           "  machine it drifts by the minute, so the figure at the top is only the first of them. 512\n"
           "  columns is the experts' down product of the 35B-A3B (2 K super-blocks a row). /i: the\n"
           "  matrix interleaved, as coli's own copy of a trunk matrix is\n");
    free(buf); free(x); free(y);
}

/* ops: elementwise. Plain loops in a fixed order; the compiler vectorises what it can
 * without changing results (-ffp-contract=off, no -ffast-math). */

/* Sums in double of N values, the same bits at every SIMD level and on the GPU: value i goes
 * into partial i % OPS_SUM_PARTS, and the partials meet by the butterfly p[j] + p[j + s] for
 * s = 8, 4, 2, 1. A serial sum (the reference's order) is one add every 4 cycles: the norms'
 * sums of squares were 3.8% of a prompt's time (perf, Q4_K slice, pp2048), and a GPU warp could
 * not follow such a chain at all. */
#define OPS_SUM_PARTS 16

static double ops_parts_sum(double *part)
{
    for (int s = OPS_SUM_PARTS / 2; s > 0; s /= 2)
        for (int j = 0; j < s; j++) part[j] = part[j] + part[j + s];
    return part[0];
}

/* The partials of x[i]^2 over the whole groups of 16 (each square exact in double); returns how
 * many values are done. */
static QUANT_AVX512 int ops_squares_avx512(const float *x, int n, double *part)
{
    const int body = n / OPS_SUM_PARTS * OPS_SUM_PARTS;
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (int i = 0; i < body; i += 16) {
        const __m512d a = _mm512_cvtps_pd(_mm256_loadu_ps(x + i)), b = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8));
        lo = _mm512_add_pd(lo, _mm512_mul_pd(a, a));
        hi = _mm512_add_pd(hi, _mm512_mul_pd(b, b));
    }
    _mm512_storeu_pd(part, lo);
    _mm512_storeu_pd(part + 8, hi);
    return body;
}

static QUANT_AVX2 int ops_squares_avx2(const float *x, int n, double *part)
{
    const int body = n / OPS_SUM_PARTS * OPS_SUM_PARTS;
    __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    for (int i = 0; i < body; i += 16) {
        QUANT_UNROLL(4) /* the accumulators in registers (quant_avx2_float) */
        for (int a = 0; a < 4; a++) {
            const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4 * a));
            acc[a] = _mm256_add_pd(acc[a], _mm256_mul_pd(v, v));
        }
    }
    for (int a = 0; a < 4; a++) _mm256_storeu_pd(part + 4 * a, acc[a]);
    return body;
}

static double ops_sum_squares(const float *x, int n)
{
    double part[OPS_SUM_PARTS] = {0};
    int done = 0;
    if (quant_level >= QUANT_LEVEL_AVX512) done = ops_squares_avx512(x, n, part);
    else if (quant_level >= QUANT_LEVEL_AVX2) done = ops_squares_avx2(x, n, part);
    for (int i = done; i < n; i++) part[i % OPS_SUM_PARTS] += (double)x[i] * x[i];
    return ops_parts_sum(part);
}

/* y = x / sqrt(mean(x^2) + eps) * w, over N values (w may be NULL: no weight). In place is fine. */
static void ops_rmsnorm(float *y, const float *x, const float *w, int n, float eps)
{
    double ss = ops_sum_squares(x, n); /* in double, the scale formed in float, as ggml */
    float mean = (float)(ss / n);
    float scale = 1.0f / sqrtf(mean + eps);
    for (int i = 0; i < n; i++) y[i] = w ? x[i] * scale * w[i] : x[i] * scale;
}

/* x /= max(||x||, eps): the L2 normalisation of DeltaNet queries and keys (ggml's rule). */
static void ops_l2norm(float *x, int n, float eps)
{
    float norm = sqrtf((float)ops_sum_squares(x, n));
    float scale = 1.0f / (norm > eps ? norm : eps);
    for (int i = 0; i < n; i++) x[i] *= scale;
}

/* e^x with the same bits on every CPU and on the GPU (kernels.cu's exp_canonical, operation
 * for operation): x = n ln2 + r with |r| <= ln2/2, e^r by its Taylor series to r^10 in double
 * (relative error < 1e-12), scaled by 2^n, rounded once to float. libm's expf differs between
 * libcs and from CUDA's; this one differed from the correctly rounded e^x in 9 of 3.2e8 floats
 * tried (every 7th in [-104, 89]). */
static const double ops_exp_taylor[10] = {1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0,
                                           1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0}; /* 1/9! .. 1/0!, for Horner */

static float ops_exp(float x)
{
    if (x != x) return x;
    if (x > 88.8f) return INFINITY;
    if (x < -104.0f) return 0.0f;
    const double shift = 6755399441055744.0; /* 1.5 * 2^52: adding it rounds to an integer */
    double n = ((double)x * 1.4426950408889634 + shift) - shift;
    double r = (double)x - n * 0.6931471805599453, p = 1.0 / 3628800.0;
    for (int i = 0; i < 10; i++) p = p * r + ops_exp_taylor[i];
    uint64_t bits = (uint64_t)((int64_t)n + 1023) << 52;
    double scale;
    memcpy(&scale, &bits, sizeof scale);
    return (float)(p * scale);
}

/* The activations the GPU computes too (the experts' SwiGLU), hence ops_exp. */
static float ops_silu(float x) { return x / (1.0f + ops_exp(-x)); }
static float ops_sigmoid(float x) { return 1.0f / (1.0f + ops_exp(-x)); }

/* ops_exp of 4 floats widened to double lanes, step for step (the shift trick's integer read
 * from the sum's bits: bits(shift + n) = bits(shift) + n), before its special cases; for N
 * (1..4; constant where inlined) vectors in lockstep: each step for every vector before the
 * next step, so that N independent chains fill the pipes (one 10-step chain at a time left
 * them waiting on its latency). */
QUANT_AVX2_INLINE void ops_exp_cores_avx2(const __m128 *x, __m128 *e, int n) {
    const __m256d shift = _mm256_set1_pd(6755399441055744.0);
    __m256d t[4], r[4], p[4];
    QUANT_UNROLL(4)
    for (int v = 0; v < n; v++) {
        const __m256d xd = _mm256_cvtps_pd(x[v]);
        t[v] = _mm256_add_pd(_mm256_mul_pd(xd, _mm256_set1_pd(1.4426950408889634)), shift);
        r[v] = _mm256_sub_pd(xd, _mm256_mul_pd(_mm256_sub_pd(t[v], shift), _mm256_set1_pd(0.6931471805599453)));
        p[v] = _mm256_set1_pd(1.0 / 3628800.0);
    }
    for (int i = 0; i < 10; i++)
        QUANT_UNROLL(4)
        for (int v = 0; v < n; v++) p[v] = _mm256_add_pd(_mm256_mul_pd(p[v], r[v]), _mm256_set1_pd(ops_exp_taylor[i]));
    QUANT_UNROLL(4)
    for (int v = 0; v < n; v++) {
        const __m256i k = _mm256_sub_epi64(_mm256_castpd_si256(t[v]), _mm256_castpd_si256(shift));
        const __m256d scale = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(k, _mm256_set1_epi64x(1023)), 52));
        e[v] = _mm256_cvtpd_ps(_mm256_mul_pd(p[v], scale));
    }
}

/* ops_exp of 8 floats, for N (1 or 2) vectors in lockstep: its special cases by blends (NaN
 * last, as it is first there). */
QUANT_AVX2_INLINE void ops_exp8n_avx2(const __m256 *x, __m256 *e, int n) {
    __m128 half[4], eh[4];
    QUANT_UNROLL(2)
    for (int v = 0; v < n; v++) {
        half[2 * v] = _mm256_castps256_ps128(x[v]);
        half[2 * v + 1] = _mm256_extractf128_ps(x[v], 1);
    }
    ops_exp_cores_avx2(half, eh, 2 * n);
    QUANT_UNROLL(2)
    for (int v = 0; v < n; v++) {
        __m256 ev = _mm256_set_m128(eh[2 * v + 1], eh[2 * v]);
        ev = _mm256_blendv_ps(ev, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x[v], _mm256_set1_ps(88.8f), _CMP_GT_OQ));
        ev = _mm256_blendv_ps(ev, _mm256_setzero_ps(), _mm256_cmp_ps(x[v], _mm256_set1_ps(-104.0f), _CMP_LT_OQ));
        e[v] = _mm256_blendv_ps(ev, x[v], _mm256_cmp_ps(x[v], x[v], _CMP_UNORD_Q));
    }
}

/* ops_exp of 8 floats. */
QUANT_AVX2_INLINE __m256 ops_exp8_avx2(__m256 x) {
    __m256 e;
    ops_exp8n_avx2(&x, &e, 1);
    return e;
}

/* NUM / (1 + e^-x) of 8 floats: ops_silu with NUM = x, ops_sigmoid with NUM = 1. */
QUANT_AVX2_INLINE __m256 ops_silu8_avx2(__m256 x, __m256 num) {
    const __m256 e = ops_exp8_avx2(_mm256_xor_ps(x, _mm256_set1_ps(-0.0f))); /* -x, as the scalar: the sign bit flipped */
    return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

/* ops_exp_cores_avx2 on 8 double lanes, for N (1..8) vectors (softmax over 8 heads of 32k
 * scores: 0.33 ms on one core with one chain at a time, 0.27 with four in lockstep, 0.24 with
 * eight). */
QUANT_AVX512_INLINE void ops_exp_cores_avx512(const __m256 *x, __m256 *e, int n) {
    const __m512d shift = _mm512_set1_pd(6755399441055744.0);
    __m512d xd[8], t[8], r[8], p[8];
    QUANT_UNROLL(8)
    for (int v = 0; v < n; v++) {
        xd[v] = _mm512_cvtps_pd(x[v]);
        t[v] = _mm512_add_pd(_mm512_mul_pd(xd[v], _mm512_set1_pd(1.4426950408889634)), shift);
        r[v] = _mm512_sub_pd(xd[v], _mm512_mul_pd(_mm512_sub_pd(t[v], shift), _mm512_set1_pd(0.6931471805599453)));
        p[v] = _mm512_set1_pd(1.0 / 3628800.0);
    }
    for (int i = 0; i < 10; i++)
        QUANT_UNROLL(8)
        for (int v = 0; v < n; v++) p[v] = _mm512_add_pd(_mm512_mul_pd(p[v], r[v]), _mm512_set1_pd(ops_exp_taylor[i]));
    QUANT_UNROLL(8)
    for (int v = 0; v < n; v++) {
        const __m512i k = _mm512_sub_epi64(_mm512_castpd_si512(t[v]), _mm512_castpd_si512(shift));
        const __m512d scale = _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_add_epi64(k, _mm512_set1_epi64(1023)), 52));
        e[v] = _mm512_cvtpd_ps(_mm512_mul_pd(p[v], scale));
    }
}

/* ops_exp8n_avx2 with 16 floats and masks, for N (1..4) vectors. */
QUANT_AVX512_INLINE void ops_exp16n_avx512(const __m512 *x, __m512 *e, int n) {
    __m256 half[8], eh[8];
    QUANT_UNROLL(4)
    for (int v = 0; v < n; v++) {
        half[2 * v] = _mm512_castps512_ps256(x[v]);
        half[2 * v + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x[v]), 1));
    }
    ops_exp_cores_avx512(half, eh, 2 * n);
    QUANT_UNROLL(4)
    for (int v = 0; v < n; v++) {
        __m512 ev = _mm512_castpd_ps(
            _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(eh[2 * v])), _mm256_castps_pd(eh[2 * v + 1]), 1));
        ev = _mm512_mask_mov_ps(ev, _mm512_cmp_ps_mask(x[v], _mm512_set1_ps(88.8f), _CMP_GT_OQ), _mm512_set1_ps(INFINITY));
        ev = _mm512_mask_mov_ps(ev, _mm512_cmp_ps_mask(x[v], _mm512_set1_ps(-104.0f), _CMP_LT_OQ), _mm512_setzero_ps());
        e[v] = _mm512_mask_mov_ps(ev, _mm512_cmp_ps_mask(x[v], x[v], _CMP_UNORD_Q), x[v]);
    }
}

/* ops_exp of 16 floats. */
QUANT_AVX512_INLINE __m512 ops_exp16_avx512(__m512 x) {
    __m512 e;
    ops_exp16n_avx512(&x, &e, 1);
    return e;
}

/* ops_silu8_avx2 with 16 floats. */
QUANT_AVX512_INLINE __m512 ops_silu16_avx512(__m512 x, __m512 num) {
    const __m512 e = ops_exp16_avx512(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u))));
    return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

/* out[i] = f(x[i]) * u[i] for N values (U NULL: f alone), f ops_silu or (SIGMOID) ops_sigmoid,
 * their bits at every level: the SIMD levels run ops_exp's double steps in vector lanes (a
 * scalar ops_exp is ~20 ns: the 8192 channels of a DeltaNet conv took 0.2 ms a layer). OUT
 * may be X or U. */
static float ops_gate_one(float x, const float *u, int64_t i, int sigmoid)
{
    const float f = sigmoid ? ops_sigmoid(x) : ops_silu(x);
    return u ? f * u[i] : f;
}

static QUANT_AVX512 void ops_gate_avx512(float *out, const float *x, const float *u, int64_t n, int sigmoid) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 xv = _mm512_loadu_ps(x + i), f = ops_silu16_avx512(xv, sigmoid ? _mm512_set1_ps(1.0f) : xv);
        _mm512_storeu_ps(out + i, u ? _mm512_mul_ps(f, _mm512_loadu_ps(u + i)) : f);
    }
    for (; i < n; i++) out[i] = ops_gate_one(x[i], u, i, sigmoid);
}

static QUANT_AVX2 void ops_gate_avx2(float *out, const float *x, const float *u, int64_t n, int sigmoid) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i), f = ops_silu8_avx2(xv, sigmoid ? _mm256_set1_ps(1.0f) : xv);
        _mm256_storeu_ps(out + i, u ? _mm256_mul_ps(f, _mm256_loadu_ps(u + i)) : f);
    }
    for (; i < n; i++) out[i] = ops_gate_one(x[i], u, i, sigmoid);
}

static void ops_gate(float *out, const float *x, const float *u, int64_t n, int sigmoid) {
    if (quant_level >= QUANT_LEVEL_AVX512) ops_gate_avx512(out, x, u, n, sigmoid);
    else if (quant_level >= QUANT_LEVEL_AVX2) ops_gate_avx2(out, x, u, n, sigmoid);
    else
        for (int64_t i = 0; i < n; i++) out[i] = ops_gate_one(x[i], u, i, sigmoid);
}

/* ops_exp((x - sub) / div): a sampling weight (§10), the same under every libc, where expf's
 * last bit is each libc's own. */
static float ops_exp_shifted_one(float x, float sub, float div) { return ops_exp((x - sub) / div); }

/* out[i] = ops_exp_shifted_one(x[i], sub, div) for N values, its bits at every level (the
 * weights of a whole vocabulary). OUT may be X. */
static QUANT_AVX512 void ops_exp_shifted_avx512(float *out, const float *x, int64_t n, float sub, float div) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, ops_exp16_avx512(_mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(sub)), _mm512_set1_ps(div))));
    for (; i < n; i++) out[i] = ops_exp_shifted_one(x[i], sub, div);
}

static QUANT_AVX2 void ops_exp_shifted_avx2(float *out, const float *x, int64_t n, float sub, float div) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, ops_exp8_avx2(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(sub)), _mm256_set1_ps(div))));
    for (; i < n; i++) out[i] = ops_exp_shifted_one(x[i], sub, div);
}

static void ops_exp_shifted(float *out, const float *x, int64_t n, float sub, float div) {
    if (quant_level >= QUANT_LEVEL_AVX512) ops_exp_shifted_avx512(out, x, n, sub, div);
    else if (quant_level >= QUANT_LEVEL_AVX2) ops_exp_shifted_avx2(out, x, n, sub, div);
    else
        for (int64_t i = 0; i < n; i++) out[i] = ops_exp_shifted_one(x[i], sub, div);
}

/* g[i] = silu(g[i]) * u[i] (U NULL: silu alone). */
static void ops_swiglu(float *g, const float *u, int64_t n) { ops_gate(g, g, u, n, 0); }

/* ops_swiglu over ROWS rows of WIDTH, a row a task where there are enough of them (a prompt
 * batch's routed experts: 2048 rows of 512 a layer on the 35B). Each element is computed on
 * its own, so the split changes no bit. */
static void ops_swiglu_rows(float *g, const float *u, int64_t rows, int64_t width) {
    #pragma omp parallel for schedule(static) if (rows * width >= OPS_PARALLEL_ELEMS)
    for (int64_t r = 0; r < rows; r++) ops_swiglu(g + r * width, u ? u + r * width : NULL, width);
}

/* ---- the logarithm, exponential and sine/cosine the forward pass uses, in double ----
 * libm's differ between libcs in the last bit (musl's log1pf is FreeBSD's, glibc's its own),
 * and the device has its own again; these use only IEEE additions, multiplications and
 * divisions, so every build and a device twin get the same bits. Each is accurate to a few
 * units of 1e-16, so the floats rounded from them are libm's but for a rare last bit. */
static const double ops_ln2_hi = 6.93147180369123816490e-01, ops_ln2_lo = 1.90821492927058770002e-10; /* hi: 32 bits */

/* The exponent K and the mantissa M in [sqrt(1/2), sqrt(2)) of a positive normal X = M 2^K. */
static double ops_split_exponent(double x, int *k)
{
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    *k = (int)(bits >> 52) - 1023;
    bits = (bits & 0x000fffffffffffffull) | 0x3ff0000000000000ull;
    double m;
    memcpy(&m, &bits, sizeof m);
    if (m > 1.4142135623730951) m *= 0.5, ++*k;
    return m;
}

/* ln z for a positive normal z: z = m 2^k, ln m = 2 atanh(s) with s = (m - 1) / (m + 1),
 * |s| < 0.172, by its series to s^21 (the next term < 1e-17); m - 1 is exact. */
static double ops_ln(double z)
{
    int k;
    const double m = ops_split_exponent(z, &k), s = (m - 1.0) / (m + 1.0), s2 = s * s;
    double t = 1.0 / 21;
    for (int j = 19; j >= 1; j -= 2) t = t * s2 + 1.0 / j;
    return k * ops_ln2_hi + (2.0 * s * t + k * ops_ln2_lo);
}

/* ln(1 + y) for y >= 0 (NaN stays NaN). 1 + y holds a float's every bit only from 2^-29 up, so
 * below 2^-10 the series of ln(1 + y) itself, to y^6. */
static double ops_log1p(float y)
{
    if (!(y >= 0.0)) return y;
    if (y < 0.0009765625) return y * (1.0 - y * (0.5 - y * (1.0 / 3 - y * (0.25 - y * (0.2 - y / 6)))));
    return ops_ln(1.0 + y);
}

/* e^x in double for |x| < 700: x = n ln2 + r (ln2 in two parts, so r is exact to 1e-20),
 * e^r by its Taylor series to r^14 (|r| <= 0.35: the next term < 1e-17), scaled by 2^n. */
static double ops_exp_double(double x)
{
    const double shift = 6755399441055744.0; /* 1.5 * 2^52: adding it rounds to an integer */
    const double n = (x * 1.4426950408889634 + shift) - shift, r = (x - n * ops_ln2_hi) - n * ops_ln2_lo;
    double p = 1.0; /* 1 + r (1 + r/2 (1 + r/3 (...))) */
    for (int j = 14; j >= 1; j--) p = 1.0 + p * (r / j);
    uint64_t bits = (uint64_t)((int64_t)n + 1023) << 52;
    double scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* sin and cos of x in [0, 2^20 pi/2): x = k pi/2 + r with pi/2 in two parts (fdlibm's pio2_1,
 * whose product with k is exact below that bound, and the rest), then the Taylor series of r
 * (|r| <= pi/4) to r^17 and r^16 (the next terms < 1e-17), and the quadrant k mod 4. RoPE's
 * angles reach pos x 1: 2^18 at a 262k context. */
static void ops_sincos(double x, double *sine, double *cosine)
{
    const double pio2_1 = 1.57079632673412561417e+00, pio2_1t = 6.07710050650619224932e-11;
    const double shift = 6755399441055744.0, k = (x * 0.63661977236758134308 + shift) - shift;
    const double r = (x - k * pio2_1) - k * pio2_1t, r2 = r * r;
    double sn = 1.0, cs = 1.0;
    for (int j = 17; j >= 3; j -= 2) sn = 1.0 - sn * r2 / ((double)j * (j - 1));
    for (int j = 16; j >= 2; j -= 2) cs = 1.0 - cs * r2 / ((double)j * (j - 1));
    sn *= r;
    switch ((int64_t)k & 3) {
    case 0: *sine = sn, *cosine = cs; break;
    case 1: *sine = cs, *cosine = -sn; break;
    case 2: *sine = -sn, *cosine = -cs; break;
    default: *sine = -cs, *cosine = sn; break;
    }
}

/* log(1 + e^x), switching to x above 20 as the reference does; e^x rounded to float first, as
 * the reference's log1pf(expf(x)). */
static float ops_softplus(float x) { return x > 20.0f ? x : (float)ops_log1p(ops_exp(x)); }

/* In-place softmax over N values, the same bits at every level: the maximum (x[i] > max
 * picks x[i], so a NaN counts only as x[0], and the order does not matter), e^(x - max) by
 * ops_exp, their sum in double in ops_parts_sum's order, then one scale. Returns the maximum,
 * and the sum in *SUM where SUM is not NULL (attention's splits merge by them). Attention at 8k of
 * context takes 8192 of them per head and token: libm's expf and a serial sum were 40% of its
 * time. */

/* The SIMD levels: the maximum of all N, and the partials of the whole vectors (ops_softmax
 * does the tail); returns how many values are done. */
static QUANT_AVX512 int ops_softmax_avx512(float *x, int n, float *max, double *part)
{
    const int body = n / OPS_SUM_PARTS * OPS_SUM_PARTS;
    __m512 mv = _mm512_set1_ps(x[0]);
    for (int i = 0; i < body; i += 16) mv = _mm512_max_ps(_mm512_loadu_ps(x + i), mv); /* x > m ? x : m */
    float lanes[16];
    _mm512_storeu_ps(lanes, mv);
    for (int l = 0; l < 16; l++) *max = lanes[l] > *max ? lanes[l] : *max;
    for (int i = body; i < n; i++) *max = x[i] > *max ? x[i] : *max;
    const __m512 m = _mm512_set1_ps(*max);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (int i = 0; i < body; i += 64) {
        const int vectors = body - i >= 64 ? 4 : (body - i) / 16;
        __m512 d[4], e[4];
        for (int v = 0; v < vectors; v++) d[v] = _mm512_sub_ps(_mm512_loadu_ps(x + i + 16 * v), m);
        if (vectors == 4) ops_exp16n_avx512(d, e, 4);
        else
            for (int v = 0; v < vectors; v++) ops_exp16n_avx512(d + v, e + v, 1);
        for (int v = 0; v < vectors; v++) {
            _mm512_storeu_ps(x + i + 16 * v, e[v]);
            lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e[v])));
            hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e[v]), 1))));
        }
    }
    _mm512_storeu_pd(part, lo);
    _mm512_storeu_pd(part + 8, hi);
    return body;
}

static QUANT_AVX2 int ops_softmax_avx2(float *x, int n, float *max, double *part)
{
    const int body = n / OPS_SUM_PARTS * OPS_SUM_PARTS;
    __m256 mv = _mm256_set1_ps(x[0]);
    for (int i = 0; i < body; i += 8) mv = _mm256_max_ps(_mm256_loadu_ps(x + i), mv);
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int l = 0; l < 8; l++) *max = lanes[l] > *max ? lanes[l] : *max;
    for (int i = body; i < n; i++) *max = x[i] > *max ? x[i] : *max;
    const __m256 m = _mm256_set1_ps(*max);
    __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    for (int i = 0; i < body; i += 16) {
        const __m256 d[2] = {_mm256_sub_ps(_mm256_loadu_ps(x + i), m), _mm256_sub_ps(_mm256_loadu_ps(x + i + 8), m)};
        __m256 e[2];
        ops_exp8n_avx2(d, e, 2);
        QUANT_UNROLL(2)
        for (int h = 0; h < 2; h++) {
            _mm256_storeu_ps(x + i + 8 * h, e[h]);
            acc[2 * h] = _mm256_add_pd(acc[2 * h], _mm256_cvtps_pd(_mm256_castps256_ps128(e[h])));
            acc[2 * h + 1] = _mm256_add_pd(acc[2 * h + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(e[h], 1)));
        }
    }
    for (int a = 0; a < 4; a++) _mm256_storeu_pd(part + 4 * a, acc[a]);
    return body;
}

static float ops_softmax(float *x, int n, double *sum)
{
    float max = x[0];
    double part[OPS_SUM_PARTS] = {0};
    int done = 0; /* the values already replaced by their e^(x - max) and summed */
    if (quant_level >= QUANT_LEVEL_AVX512) done = ops_softmax_avx512(x, n, &max, part);
    else if (quant_level >= QUANT_LEVEL_AVX2) done = ops_softmax_avx2(x, n, &max, part);
    else
        for (int i = 1; i < n; i++) max = x[i] > max ? x[i] : max;
    for (int i = done; i < n; i++) {
        x[i] = ops_exp(x[i] - max);
        part[i % OPS_SUM_PARTS] += x[i];
    }
    const double total = ops_parts_sum(part);
    float inv = (float)(1.0 / total);
    #pragma omp simd
    for (int i = 0; i < n; i++) x[i] *= inv;
    if (sum) *sum = total;
    return max;
}

/* ---- attention over the KV cache ----
 * The heads of a GQA group read the same cached rows, and at long context those rows are the
 * memory traffic of a token, so both passes take NQ heads at once and read each row once. A
 * cache holds a KV head's rows STRIDE elements apart in one of the formats of enum ops_kv
 * (--kv): fp32, fp16, or Q8_0 (8.5 bits a value). Each SIMD body is inlined once per format,
 * so that the format is a constant in its loops.
 * Scores: out[j][p] = (q_j . k_p) * scale for N key rows. Float keys (fp16 widened exactly as
 * the kernels load it): each dot over HD elements in one canonical order at every level:
 * element i into partial i % 16, then the butterfly p[j] + p[j + s] for s = 8, 4, 2, 1. A
 * serial sum (the order before) kept the vector units idle at one add per 4 cycles. The SIMD
 * versions hold each head's 16 partials in registers (independent chains across heads).
 * Q8_0 keys: integer products against the query quantised (ops_scores_q8_0, below).
 * Values: o_j[i] = fma(w_j[p], v_p[i], o_j[i]) in increasing p, element by element (the
 * same operation at any width: fmaf, or the FMA instructions every AVX2 CPU has), the rows in
 * chunks of OPS_ATTN_CHUNK that every tile of accumulators passes over before the next chunk.
 * Fused, because a Q8_0 value's widening then runs beside the products: with a multiply and
 * an add, the FP pipes also had to take the conversions (8 heads x 32 dims a row: 13 cycles
 * against 9.5 fused, on Zen 5). A Q8_0 value is widened exactly (d * q has at most 18
 * significant bits), so the sums are those of fp32 rows holding those values.
 * Splits: a head's rows go in splits of OPS_ATTN_SPLIT, each its scores, its own softmax and
 * its values, then merged in order of the splits (ops_attn_merge). Why: a GPU computes the
 * splits of a long context side by side (one warp a split, not one a head), and it can only
 * give the CPU's bits if the order is the same on both sides. */
#define OPS_SCORE_PARTS 16
#define OPS_ATTN_HEADS 8 /* at most NQ; a GQA group of the 35B-A3B (16 heads on 2) */
#define OPS_ATTN_AHEAD 32 /* cached rows prefetched ahead (a hint: past the cache's end it reads nothing) */
#define OPS_ATTN_CHUNK 32 /* value rows a pass of tiles shares (8.5-32 KiB of rows of 256, read once from memory) */
#define OPS_ATTN_SPLIT 256 /* cached rows a split: a softmax of its own, merged in order (ops_attn_merge) */

/* The KV cache's formats. A Q8_0 row is a GGUF Q8_0 row (32-element blocks of an fp16 scale
 * and 32 int8), quantised as quant_act_q8 quantises an activation; Q8_0 keys are stored
 * OPS_KV_GROUP positions to a group instead (ops_scores_q8_0), in the same bytes. */
enum ops_kv { OPS_KV_F32, OPS_KV_F16, OPS_KV_Q8_0 };
#define OPS_KV_GROUP 16   /* Q8_0 key positions a group, one vector lane each */
#define OPS_KV_MAX_HD 512 /* the longest Q8_0 row: ops_scores_q8_0 quantises queries on the stack */

/* Bytes of a cached row of STRIDE elements (a multiple of QUANT_QK for Q8_0). */
static inline size_t ops_kv_row_bytes(size_t stride, enum ops_kv kv)
{
    return kv == OPS_KV_F32 ? 4 * stride : kv == OPS_KV_F16 ? 2 * stride : stride / QUANT_QK * (2 + QUANT_QK);
}

/* The Q8_0 block that holds element I of ROW. */
static inline const uint8_t *ops_kv_block(const void *row, int i)
{
    return (const uint8_t *)row + (size_t)(i / QUANT_QK) * (2 + QUANT_QK);
}

/* Element I of a cached row, widened exactly. */
static inline float ops_kv_at(const void *row, int i, enum ops_kv kv)
{
    if (kv == OPS_KV_F32) return ((const float *)row)[i];
    if (kv == OPS_KV_F16) return quant_f16_to_f32(((const uint16_t *)row)[i]);
    const uint8_t *b = ops_kv_block(row, i);
    return (float)(int8_t)b[2 + i % QUANT_QK] * quant_f16_to_f32(quant_rd16(b));
}

/* Row P of a cache STRIDE elements a row. */
static inline const void *ops_kv_row(const void *cache, size_t stride, int p, enum ops_kv kv)
{
    return (const uint8_t *)cache + (size_t)p * ops_kv_row_bytes(stride, kv);
}

static float ops_score_finish(float *part, const float *q, const void *k, int from, int hd, float scale, enum ops_kv kv)
{
    for (int i = from; i < hd; i++) part[i % OPS_SCORE_PARTS] = part[i % OPS_SCORE_PARTS] + q[i] * ops_kv_at(k, i, kv);
    for (int s = OPS_SCORE_PARTS / 2; s > 0; s /= 2)
        for (int j = 0; j < s; j++) part[j] = part[j] + part[j + s];
    return part[0] * scale;
}

/* The butterfly's last three steps in registers: S holds part[j] + part[j + 8] for j < 8
 * (the first step); then + 4, + 2, + 1 lane by lane, the same adds as ops_score_finish's. A
 * store and 15 scalar adds per score had cost as much as the score's products. */
QUANT_AVX2_INLINE float ops_butterfly8_avx2(__m256 s) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

/* 8 elements of a cached row from I on (I % 8 == 0 for Q8_0), as floats: fp16 by F16C's exact
 * widening, Q8_0 as q * d (exact, as ops_kv_at). */
QUANT_AVX2_INLINE __m256 ops_kv_load8(const void *row, int i, enum ops_kv kv) {
    if (kv == OPS_KV_F32) return _mm256_loadu_ps((const float *)row + i);
    if (kv == OPS_KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    const uint8_t *b = ops_kv_block(row, i);
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + i % QUANT_QK))));
    return _mm256_mul_ps(q, _mm256_set1_ps(_cvtsh_ss(quant_rd16(b))));
}

/* 16 elements of a cached row from I on (I % 16 == 0 for Q8_0), as floats. */
QUANT_AVX512_INLINE __m512 ops_kv_load16(const void *row, int i, enum ops_kv kv) {
    if (kv == OPS_KV_F32) return _mm512_loadu_ps((const float *)row + i);
    if (kv == OPS_KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
    const uint8_t *b = ops_kv_block(row, i);
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + i % QUANT_QK))));
    return _mm512_mul_ps(q, _mm512_set1_ps(_cvtsh_ss(quant_rd16(b))));
}

/* The cache lines of elements I0..I1 (with their Q8_0 scales) of row P + OPS_ATTN_AHEAD asked
 * for: a float key's whole row, or a value tile's part of it, so that the values' requests
 * spread over the pass instead of all coming with its first tile (which had left them at 32k
 * rows 1.4x slower than in cache). Always inlined: gcc counts a function of prefetches alone as
 * having no effect and drops its calls. */
QUANT_SHARED_INLINE void ops_kv_prefetch(const void *cache, size_t stride, int p, int i0, int i1, enum ops_kv kv)
{
    const char *row = ops_kv_row(cache, stride, p + OPS_ATTN_AHEAD, kv), *first, *last;
    if (kv == OPS_KV_Q8_0) {
        first = (const char *)ops_kv_block(row, i0);
        last = (const char *)ops_kv_block(row, i1 - 1) + 2 + (i1 - 1) % QUANT_QK;
    } else {
        const size_t size = kv == OPS_KV_F32 ? 4 : 2;
        first = row + (size_t)i0 * size;
        last = row + (size_t)i1 * size - 1;
    }
    for (const char *b = first; b < last; b += 64) _mm_prefetch(b, _MM_HINT_T0);
    _mm_prefetch(last, _MM_HINT_T0);
}

static void ops_scores_scalar(const float *const *q, int nq, const void *k, size_t stride, int n, int hd, float scale,
                              float *const *out, enum ops_kv kv)
{
    for (int p = 0; p < n; p++)
        for (int j = 0; j < nq; j++) {
            float part[OPS_SCORE_PARTS] = {0};
            out[j][p] = ops_score_finish(part, q[j], ops_kv_row(k, stride, p, kv), 0, hd, scale, kv);
        }
}

/* The scores of HEADS (1..4; constant where inlined, so that the 8 accumulators stay in
 * registers) heads from J0 against key row KR, into out[.][p]. */
QUANT_AVX2_INLINE void ops_scores_heads_avx2(const float *const *q, int j0, int heads, const void *kr, int p, int hd,
                                             float scale, float *const *out, enum ops_kv kv)
{
    const int body = hd / OPS_SCORE_PARTS * OPS_SCORE_PARTS;
    __m256 lo[4], hi[4];
    for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_ps();
    for (int i = 0; i < body; i += OPS_SCORE_PARTS) {
        const __m256 k0 = ops_kv_load8(kr, i, kv), k1 = ops_kv_load8(kr, i + 8, kv);
        QUANT_UNROLL(4)
        for (int j = 0; j < heads; j++) {
            lo[j] = _mm256_add_ps(lo[j], _mm256_mul_ps(_mm256_loadu_ps(q[j0 + j] + i), k0));
            hi[j] = _mm256_add_ps(hi[j], _mm256_mul_ps(_mm256_loadu_ps(q[j0 + j] + i + 8), k1));
        }
    }
    QUANT_UNROLL(4)
    for (int j = 0; j < heads; j++) {
        if (body == hd) {
            out[j0 + j][p] = ops_butterfly8_avx2(_mm256_add_ps(lo[j], hi[j])) * scale;
            continue;
        }
        float part[OPS_SCORE_PARTS];
        _mm256_storeu_ps(part, lo[j]);
        _mm256_storeu_ps(part + 8, hi[j]);
        out[j0 + j][p] = ops_score_finish(part, q[j0 + j], kr, body, hd, scale, kv);
    }
}

QUANT_AVX2_INLINE void ops_scores_rows_avx2(const float *const *q, int nq, const void *k, size_t stride, int n, int hd,
                                            float scale, float *const *out, enum ops_kv kv)
{
    for (int p = 0; p < n; p++) {
        ops_kv_prefetch(k, stride, p, 0, hd, kv);
        const void *kr = ops_kv_row(k, stride, p, kv);
        for (int j0 = 0; j0 < nq; j0 += 4) { /* 4 heads: 8 accumulators of the 16 registers */
            if (nq - j0 >= 4) ops_scores_heads_avx2(q, j0, 4, kr, p, hd, scale, out, kv);
            else ops_scores_heads_avx2(q, j0, nq - j0, kr, p, hd, scale, out, kv);
        }
    }
}

static QUANT_AVX2 void ops_scores_avx2(const float *const *q, int nq, const void *k, size_t stride, int n, int hd,
                                       float scale, float *const *out, enum ops_kv kv)
{
    if (kv == OPS_KV_F16) ops_scores_rows_avx2(q, nq, k, stride, n, hd, scale, out, OPS_KV_F16);
    else ops_scores_rows_avx2(q, nq, k, stride, n, hd, scale, out, OPS_KV_F32);
}

/* ops_scores_avx512's body; inlined with NQ constant, the accumulators stay in registers. With
 * NQ a variable they went to memory, a load and a store per add: 8 heads of 256 over 4096 cached
 * rows took 1.6 ms on one core, now 0.27. */
QUANT_AVX512_INLINE void ops_scores_heads_avx512(const float *const *q, int nq, const void *k, size_t stride, int n, int hd,
                                                 float scale, float *const *out, enum ops_kv kv)
{
    const int body = hd / OPS_SCORE_PARTS * OPS_SCORE_PARTS;
    for (int p = 0; p < n; p++) {
        const void *kr = ops_kv_row(k, stride, p, kv);
        ops_kv_prefetch(k, stride, p, 0, hd, kv);
        __m512 acc[OPS_ATTN_HEADS];
        QUANT_UNROLL(8)
        for (int j = 0; j < OPS_ATTN_HEADS; j++) acc[j] = _mm512_setzero_ps();
        for (int i = 0; i < body; i += OPS_SCORE_PARTS) {
            const __m512 kr16 = ops_kv_load16(kr, i, kv);
            QUANT_UNROLL(8)
            for (int j = 0; j < nq; j++) acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(_mm512_loadu_ps(q[j] + i), kr16));
        }
        QUANT_UNROLL(8)
        for (int j = 0; j < nq; j++) {
            if (body == hd) {
                const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc[j]),
                                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1)));
                out[j][p] = ops_butterfly8_avx2(s8) * scale;
                continue;
            }
            float part[OPS_SCORE_PARTS];
            _mm512_storeu_ps(part, acc[j]);
            out[j][p] = ops_score_finish(part, q[j], kr, body, hd, scale, kv);
        }
    }
}

static QUANT_AVX512 void ops_scores_avx512(const float *const *q, int nq, const void *k, size_t stride, int n, int hd,
                                           float scale, float *const *out, enum ops_kv kv)
{
    if (nq == OPS_ATTN_HEADS && kv == OPS_KV_F16) ops_scores_heads_avx512(q, OPS_ATTN_HEADS, k, stride, n, hd, scale, out, OPS_KV_F16);
    else if (nq == OPS_ATTN_HEADS) ops_scores_heads_avx512(q, OPS_ATTN_HEADS, k, stride, n, hd, scale, out, OPS_KV_F32);
    else ops_scores_heads_avx512(q, nq, k, stride, n, hd, scale, out, kv);
}

/* ---- Q8_0 keys ----
 * Scores against Q8_0 keys are integer products. The query is quantised as a Q8 activation
 * (quant_act_q8: per 32 elements a scale dq, fp16-rounded, and the sum of the quants). A group
 * of OPS_KV_GROUP key positions holds its quants with the positions in vector lanes,
 * [STRIDE/4][16][4] bytes (dword r of vector m: elements 4m..4m+3 of position r, each plus 128,
 * vpdpbusd's unsigned operand), then its scales, [STRIDE/32][16] fp16: as many bytes as 16 rows.
 * A score is, from acc = 0 over the blocks b in order, acc = acc + (dk_b * dq_b) *
 * (float)isum_b with isum_b = Σ k q exact, then acc * SCALE: one position's operations in each
 * lane, so every level gives the scalar bits. One vpdpbusd adds 4 products of 16 positions,
 * where float keys take a multiply and an add for 16; the quants are a quarter of fp32's bytes. */

/* Where a Q8_0 key group of STRIDE-element rows holds element I of position R's quants, and
 * the scale of its block B. */
static inline size_t ops_kq8_quant(int i, int r) { return (size_t)(i / 4) * 4 * OPS_KV_GROUP + 4 * (size_t)r + (size_t)(i % 4); }
static inline size_t ops_kq8_scale(size_t stride, int b, int r)
{
    return OPS_KV_GROUP * stride + 2 * ((size_t)b * OPS_KV_GROUP + (size_t)r);
}

/* Writes the HD floats at X as row P of a cache of STRIDE-element rows in format KV: fp16
 * rounded, or Q8_0 quantised (KEYS: in the key groups). */
static void ops_kv_store(void *cache, size_t stride, int p, const float *x, int hd, enum ops_kv kv, int keys)
{
    uint8_t *row = (uint8_t *)cache + (size_t)p * ops_kv_row_bytes(stride, kv);
    if (kv != OPS_KV_Q8_0) {
        if (kv == OPS_KV_F32) memcpy(row, x, (size_t)hd * sizeof(float));
        else
            for (int i = 0; i < hd; i++) ((uint16_t *)row)[i] = quant_f32_to_f16(x[i]);
        return;
    }
    _Alignas(64) uint8_t act[OPS_KV_MAX_HD + OPS_KV_MAX_HD / QUANT_QK * 12];
    quant_act_q8(x, hd, act);
    const struct quant_q8_view a = quant_q8_view(act, hd);
    uint8_t *group = (uint8_t *)cache + (size_t)(p / OPS_KV_GROUP) * OPS_KV_GROUP * ops_kv_row_bytes(stride, kv);
    const int r = p % OPS_KV_GROUP;
    for (int b = 0; b < hd / QUANT_QK; b++) {
        const uint16_t d = quant_f32_to_f16(a.d[b]); /* exact: quant_act_q8 rounded it so */
        if (!keys) {
            memcpy(row + (size_t)b * (2 + QUANT_QK), &d, 2);
            memcpy(row + (size_t)b * (2 + QUANT_QK) + 2, a.qs + b * QUANT_QK, QUANT_QK);
            continue;
        }
        memcpy(group + ops_kq8_scale(stride, b, r), &d, 2);
        for (int i = b * QUANT_QK; i < (b + 1) * QUANT_QK; i++) group[ops_kq8_quant(i, r)] = (uint8_t)(a.qs[i] + 128);
    }
}

/* Position R's score in the key group G against the quantised query A. */
static float ops_score_q8_0(const uint8_t *g, size_t stride, int r, const struct quant_q8_view *a, int hd, float scale)
{
    float acc = 0.0f;
    for (int b = 0; b < hd / QUANT_QK; b++) {
        int32_t isum = 0;
        for (int i = b * QUANT_QK; i < (b + 1) * QUANT_QK; i++) isum += ((int)g[ops_kq8_quant(i, r)] - 128) * a->qs[i];
        const float dk = quant_f16_to_f32(quant_rd16(g + ops_kq8_scale(stride, b, r)));
        acc = acc + (dk * a->d[b]) * (float)isum;
    }
    return acc * scale;
}

/* The 16 positions of a group in 8-lane halves. vpmaddubsw multiplies unsigned by signed bytes
 * into saturating 16-bit pairs, so the key is made signed again (k - 128, by the top bit) and
 * the product taken as |q| * (k with q's sign): |pair| <= 2 * 127 * 128, no saturation. */
QUANT_AVX2_INLINE void ops_scores_q8_0_half_avx2(const uint8_t *g, size_t stride, int half, const struct quant_q8_view *a, int hd,
                                                 float scale, float *out)
{
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < hd / QUANT_QK; b++) {
        __m256i s = _mm256_setzero_si256();
        QUANT_UNROLL(8)
        for (int m = 0; m < 8; m++) {
            const __m256i q = _mm256_set1_epi32(quant_rd32(a->qs + b * QUANT_QK + 4 * m));
            const __m256i k = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(g + ops_kq8_quant(b * QUANT_QK + 4 * m, 8 * half))), flip);
            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(k, q)), ones));
        }
        const __m256 dk = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + ops_kq8_scale(stride, b, 8 * half))));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dk, _mm256_set1_ps(a->d[b])), _mm256_cvtepi32_ps(s)));
    }
    _mm256_storeu_ps(out, _mm256_mul_ps(acc, _mm256_set1_ps(scale)));
}

static QUANT_AVX2 void ops_scores_q8_0_avx2(const struct quant_q8_view *a, int nq, const uint8_t *k, size_t stride, int n, int hd,
                                            float scale, float *const *out)
{
    float s[OPS_KV_GROUP];
    for (int p0 = 0; p0 < n; p0 += OPS_KV_GROUP) {
        const uint8_t *g = k + (size_t)p0 * ops_kv_row_bytes(stride, OPS_KV_Q8_0);
        const int count = n - p0 < OPS_KV_GROUP ? n - p0 : OPS_KV_GROUP;
        for (int j = 0; j < nq; j++) {
            ops_scores_q8_0_half_avx2(g, stride, 0, &a[j], hd, scale, s);
            if (count > 8) ops_scores_q8_0_half_avx2(g, stride, 1, &a[j], hd, scale, s + 8);
            memcpy(out[j] + p0, s, (size_t)count * sizeof(float));
        }
    }
}

/* A group's scores for NQ heads (constant where inlined: the heads' accumulators and a block's
 * 8 key vectors stay in registers), positions P0..P0 + COUNT. */
QUANT_AVX512_INLINE void ops_scores_q8_0_group_avx512(const uint8_t *g, size_t stride, const struct quant_q8_view *a, int nq,
                                                      int hd, float scale, float *const *out, int p0, int count)
{
    __m512 acc[OPS_ATTN_HEADS];
    QUANT_UNROLL(8)
    for (int j = 0; j < OPS_ATTN_HEADS; j++) acc[j] = _mm512_setzero_ps();
    for (int b = 0; b < hd / QUANT_QK; b++) {
        __m512i k[8];
        QUANT_UNROLL(8)
        for (int m = 0; m < 8; m++) k[m] = _mm512_loadu_si512(g + ops_kq8_quant(b * QUANT_QK + 4 * m, 0));
        const __m512 dk = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + ops_kq8_scale(stride, b, 0))));
        QUANT_UNROLL(8)
        for (int j = 0; j < nq; j++) {
            __m512i s = _mm512_set1_epi32(-128 * a[j].s[b]); /* the keys' +128 */
            QUANT_UNROLL(8)
            for (int m = 0; m < 8; m++) s = _mm512_dpbusd_epi32(s, k[m], _mm512_set1_epi32(quant_rd32(a[j].qs + b * QUANT_QK + 4 * m)));
            acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(_mm512_mul_ps(dk, _mm512_set1_ps(a[j].d[b])), _mm512_cvtepi32_ps(s)));
        }
    }
    QUANT_UNROLL(8)
    for (int j = 0; j < nq; j++)
        _mm512_mask_storeu_ps(out[j] + p0, (__mmask16)((1u << count) - 1), _mm512_mul_ps(acc[j], _mm512_set1_ps(scale)));
}

QUANT_AVX512_INLINE void ops_scores_q8_0_rows_avx512(const struct quant_q8_view *a, int nq, const uint8_t *k, size_t stride, int n,
                                                     int hd, float scale, float *const *out)
{
    for (int p0 = 0; p0 < n; p0 += OPS_KV_GROUP)
        ops_scores_q8_0_group_avx512(k + (size_t)p0 * ops_kv_row_bytes(stride, OPS_KV_Q8_0), stride, a, nq, hd, scale, out, p0,
                                     n - p0 < OPS_KV_GROUP ? n - p0 : OPS_KV_GROUP);
}

static QUANT_AVX512 void ops_scores_q8_0_avx512(const struct quant_q8_view *a, int nq, const uint8_t *k, size_t stride, int n, int hd,
                                                float scale, float *const *out)
{
    if (nq == OPS_ATTN_HEADS) ops_scores_q8_0_rows_avx512(a, OPS_ATTN_HEADS, k, stride, n, hd, scale, out);
    else ops_scores_q8_0_rows_avx512(a, nq, k, stride, n, hd, scale, out);
}

/* NQ heads' queries Q quantised as activations into ACT (a head each), their views into A:
 * what the integer scores against Q8_0 keys take; once a token, not once a split (quantising
 * in every split had made attention at 16k-32k 1.3-1.8 times slower). */
#define OPS_KV_Q8_ACT (OPS_KV_MAX_HD + OPS_KV_MAX_HD / QUANT_QK * 12)
static void ops_queries_q8_0(const float *const *q, int nq, int hd, uint8_t (*act)[OPS_KV_Q8_ACT], struct quant_q8_view *a)
{
    for (int j = 0; j < nq; j++) {
        quant_act_q8(q[j], hd, act[j]);
        a[j] = quant_q8_view(act[j], hd);
    }
}

/* The scores of NQ quantised queries A against N Q8_0 key rows K (ops_scores_q8_0). */
static void ops_scores_q8_0_of(const struct quant_q8_view *a, int nq, const uint8_t *k, size_t stride, int n, int hd, float scale,
                               float *const *out)
{
    if (quant_level >= QUANT_LEVEL_AVX512) ops_scores_q8_0_avx512(a, nq, k, stride, n, hd, scale, out);
    else if (quant_level >= QUANT_LEVEL_AVX2) ops_scores_q8_0_avx2(a, nq, k, stride, n, hd, scale, out);
    else
        for (int p = 0; p < n; p++)
            for (int j = 0; j < nq; j++)
                out[j][p] = ops_score_q8_0(k + (size_t)(p / OPS_KV_GROUP) * OPS_KV_GROUP * ops_kv_row_bytes(stride, OPS_KV_Q8_0), stride,
                                           p % OPS_KV_GROUP, &a[j], hd, scale);
}

/* ops_scores for Q8_0 keys: HD a multiple of QUANT_QK, at most OPS_KV_MAX_HD. */
static void ops_scores_q8_0(const float *const *q, int nq, const uint8_t *k, size_t stride, int n, int hd, float scale,
                            float *const *out)
{
    _Alignas(64) uint8_t act[OPS_ATTN_HEADS][OPS_KV_Q8_ACT];
    struct quant_q8_view a[OPS_ATTN_HEADS];
    ops_queries_q8_0(q, nq, hd, act, a);
    ops_scores_q8_0_of(a, nq, k, stride, n, hd, scale, out);
}

/* NQ (1..OPS_ATTN_HEADS) heads' scores against the same key rows K in format KV, STRIDE
 * elements a row. */
static void ops_scores(const float *const *q, int nq, const void *k, size_t stride, int n, int hd, float scale,
                       float *const *out, enum ops_kv kv)
{
    if (kv == OPS_KV_Q8_0) ops_scores_q8_0(q, nq, k, stride, n, hd, scale, out);
    else if (quant_level >= QUANT_LEVEL_AVX512) ops_scores_avx512(q, nq, k, stride, n, hd, scale, out, kv);
    else if (quant_level >= QUANT_LEVEL_AVX2) ops_scores_avx2(q, nq, k, stride, n, hd, scale, out, kv);
    else ops_scores_scalar(q, nq, k, stride, n, hd, scale, out, kv);
}

static void ops_attend_scalar(const float *const *w, int nq, const void *v, size_t stride, int n, int hd, float *const *o, enum ops_kv kv)
{
    for (int p = 0; p < n; p++)
        for (int j = 0; j < nq; j++)
            for (int i = 0; i < hd; i++) o[j][i] = fmaf(w[j][p], ops_kv_at(ops_kv_row(v, stride, p, kv), i, kv), o[j][i]);
}

/* Dims I0..I0 + 32 of HEADS heads (4 or 8; constant where inlined) over rows P0..P1, the
 * accumulators in registers (o in memory would be loaded and stored per row). WT holds the
 * rows' weights head by head, row p's at wt[HEADS * (p - p0)]: one base pointer for all of
 * them. The 32 dims are one Q8_0 block: one scale a row. */
QUANT_AVX512_INLINE void ops_attend_tile_avx512(const float *wt, int heads, const void *v, size_t stride, int p0, int p1,
                                                int i0, float *const *o, enum ops_kv kv)
{
    __m512 acc[OPS_ATTN_HEADS][2];
    QUANT_UNROLL(8)
    for (int j = 0; j < heads; j++)
        QUANT_UNROLL(2)
        for (int r = 0; r < 2; r++) acc[j][r] = _mm512_loadu_ps(o[j] + i0 + 16 * r);
    for (int p = p0; p < p1; p++) {
        const void *vr = ops_kv_row(v, stride, p, kv);
        ops_kv_prefetch(v, stride, p, i0, i0 + 32, kv);
        __m512 v0, v1;
        if (kv == OPS_KV_Q8_0) {
            const uint8_t *b = ops_kv_block(vr, i0);
            const __m512 d = _mm512_set1_ps(_cvtsh_ss(quant_rd16(b)));
            v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))), d);
            v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))), d);
        } else {
            v0 = ops_kv_load16(vr, i0, kv);
            v1 = ops_kv_load16(vr, i0 + 16, kv);
        }
        const float *a = wt + (size_t)heads * (size_t)(p - p0);
        QUANT_UNROLL(8)
        for (int j = 0; j < heads; j++) {
            const __m512 wj = _mm512_set1_ps(a[j]);
            acc[j][0] = _mm512_fmadd_ps(wj, v0, acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(wj, v1, acc[j][1]);
        }
    }
    QUANT_UNROLL(8)
    for (int j = 0; j < heads; j++)
        QUANT_UNROLL(2)
        for (int r = 0; r < 2; r++) _mm512_storeu_ps(o[j] + i0 + 16 * r, acc[j][r]);
}

/* The tiles over every chunk of rows, HEADS (4 or 8) heads and dims of a multiple of 32. */
QUANT_AVX512_INLINE void ops_attend_tiles_avx512(const float *const *w, int heads, const void *v, size_t stride, int n, int hd,
                                                 float *const *o, enum ops_kv kv)
{
    float wt[OPS_ATTN_CHUNK * OPS_ATTN_HEADS];
    for (int p0 = 0; p0 < n; p0 += OPS_ATTN_CHUNK) {
        const int p1 = n - p0 < OPS_ATTN_CHUNK ? n : p0 + OPS_ATTN_CHUNK;
        for (int p = p0; p < p1; p++)
            for (int j = 0; j < heads; j++) wt[heads * (p - p0) + j] = w[j][p];
        for (int i0 = 0; i0 < hd; i0 += 32) ops_attend_tile_avx512(wt, heads, v, stride, p0, p1, i0, o, kv);
    }
}

QUANT_AVX512_INLINE void ops_attend_rows_avx512(const float *const *w, int nq, const void *v, size_t stride, int n, int hd,
                                                float *const *o, enum ops_kv kv)
{
    if (hd % 32 == 0 && (nq == 8 || nq == 4)) {
        if (nq == 8) ops_attend_tiles_avx512(w, 8, v, stride, n, hd, o, kv);
        else ops_attend_tiles_avx512(w, 4, v, stride, n, hd, o, kv);
        return;
    }
    const int body = hd / 16 * 16;
    for (int p = 0; p < n; p++) {
        const void *vr = ops_kv_row(v, stride, p, kv);
        for (int j = 0; j < nq; j++) {
            const __m512 a = _mm512_set1_ps(w[j][p]);
            for (int i = 0; i < body; i += 16)
                _mm512_storeu_ps(o[j] + i, _mm512_fmadd_ps(a, ops_kv_load16(vr, i, kv), _mm512_loadu_ps(o[j] + i)));
            for (int i = body; i < hd; i++) o[j][i] = fmaf(w[j][p], ops_kv_at(vr, i, kv), o[j][i]);
        }
    }
}

static QUANT_AVX512 void ops_attend_avx512(const float *const *w, int nq, const void *v, size_t stride, int n, int hd,
                                           float *const *o, enum ops_kv kv)
{
    if (kv == OPS_KV_Q8_0) ops_attend_rows_avx512(w, nq, v, stride, n, hd, o, OPS_KV_Q8_0);
    else if (kv == OPS_KV_F16) ops_attend_rows_avx512(w, nq, v, stride, n, hd, o, OPS_KV_F16);
    else ops_attend_rows_avx512(w, nq, v, stride, n, hd, o, OPS_KV_F32);
}

/* ops_attend_tile_avx512 at this width: dims I0..I0 + 16 of heads J0..J0 + 4, 8 registers. */
QUANT_AVX2_INLINE void ops_attend_tile_avx2(const float *const *w, int j0, const void *v, size_t stride, int p0, int p1,
                                            int i0, float *const *o, enum ops_kv kv)
{
    __m256 acc[4][2];
    QUANT_UNROLL(4)
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < 2; r++) acc[j][r] = _mm256_loadu_ps(o[j0 + j] + i0 + 8 * r);
    for (int p = p0; p < p1; p++) {
        const void *vr = ops_kv_row(v, stride, p, kv);
        if (j0 == 0) ops_kv_prefetch(v, stride, p, i0, i0 + 16, kv);
        const __m256 v0 = ops_kv_load8(vr, i0, kv), v1 = ops_kv_load8(vr, i0 + 8, kv);
        QUANT_UNROLL(4)
        for (int j = 0; j < 4; j++) {
            const __m256 a = _mm256_set1_ps(w[j0 + j][p]);
            acc[j][0] = _mm256_fmadd_ps(a, v0, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(a, v1, acc[j][1]);
        }
    }
    QUANT_UNROLL(4)
    for (int j = 0; j < 4; j++)
        for (int r = 0; r < 2; r++) _mm256_storeu_ps(o[j0 + j] + i0 + 8 * r, acc[j][r]);
}

QUANT_AVX2_INLINE void ops_attend_rows_avx2(const float *const *w, int nq, const void *v, size_t stride, int n, int hd,
                                            float *const *o, enum ops_kv kv)
{
    if (nq % 4 == 0 && hd % 16 == 0) {
        for (int p0 = 0; p0 < n; p0 += OPS_ATTN_CHUNK) {
            const int p1 = n - p0 < OPS_ATTN_CHUNK ? n : p0 + OPS_ATTN_CHUNK;
            for (int j0 = 0; j0 < nq; j0 += 4)
                for (int i0 = 0; i0 < hd; i0 += 16) ops_attend_tile_avx2(w, j0, v, stride, p0, p1, i0, o, kv);
        }
        return;
    }
    const int body = hd / 8 * 8;
    for (int p = 0; p < n; p++) {
        const void *vr = ops_kv_row(v, stride, p, kv);
        for (int j = 0; j < nq; j++) {
            const __m256 a = _mm256_set1_ps(w[j][p]);
            for (int i = 0; i < body; i += 8)
                _mm256_storeu_ps(o[j] + i, _mm256_fmadd_ps(a, ops_kv_load8(vr, i, kv), _mm256_loadu_ps(o[j] + i)));
            for (int i = body; i < hd; i++) o[j][i] = fmaf(w[j][p], ops_kv_at(vr, i, kv), o[j][i]);
        }
    }
}

static QUANT_AVX2 void ops_attend_avx2(const float *const *w, int nq, const void *v, size_t stride, int n, int hd,
                                       float *const *o, enum ops_kv kv)
{
    if (kv == OPS_KV_Q8_0) ops_attend_rows_avx2(w, nq, v, stride, n, hd, o, OPS_KV_Q8_0);
    else if (kv == OPS_KV_F16) ops_attend_rows_avx2(w, nq, v, stride, n, hd, o, OPS_KV_F16);
    else ops_attend_rows_avx2(w, nq, v, stride, n, hd, o, OPS_KV_F32);
}

/* o_j += Σ_p w_j[p] * v_p for NQ heads (1..OPS_ATTN_HEADS) over the same value rows V in format
 * KV, STRIDE elements a row. */
static void ops_attend(const float *const *w, int nq, const void *v, size_t stride, int n, int hd, float *const *o, enum ops_kv kv)
{
    if (quant_level >= QUANT_LEVEL_AVX512) ops_attend_avx512(w, nq, v, stride, n, hd, o, kv);
    else if (quant_level >= QUANT_LEVEL_AVX2) ops_attend_avx2(w, nq, v, stride, n, hd, o, kv);
    else ops_attend_scalar(w, nq, v, stride, n, hd, o, kv);
}

/* o[i] = fma(wc, oc[i], wo * o[i]) for N values, the same bits at every level (fmaf is a
 * library call where the compiler may not assume FMA: 2048 of them a split of 8 heads made
 * decode's attention at 8k of context 15-70% slower). The SIMD levels return how many they did. */
static QUANT_AVX512 int ops_blend_avx512(float *o, const float *oc, float wo, float wc, int n)
{
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(o + i, _mm512_fmadd_ps(_mm512_set1_ps(wc), _mm512_loadu_ps(oc + i), _mm512_mul_ps(_mm512_set1_ps(wo), _mm512_loadu_ps(o + i))));
    return i;
}

static QUANT_AVX2 int ops_blend_avx2(float *o, const float *oc, float wo, float wc, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(_mm256_set1_ps(wc), _mm256_loadu_ps(oc + i), _mm256_mul_ps(_mm256_set1_ps(wo), _mm256_loadu_ps(o + i))));
    return i;
}

static void ops_blend(float *o, const float *oc, float wo, float wc, int n)
{
    int i = quant_level >= QUANT_LEVEL_AVX512 ? ops_blend_avx512(o, oc, wo, wc, n)
            : quant_level >= QUANT_LEVEL_AVX2 ? ops_blend_avx2(o, oc, wo, wc, n) : 0;
    for (; i < n; i++) o[i] = fmaf(wc, oc[i], wo * o[i]);
}

/* Folds a split's outputs OC (HD floats a head of NQ: its rows' values weighed by their own
 * softmax), with its largest scores MAX_C and its sums SUM_C of e^(s - MAX_C), into O, the
 * splits' before it merged, whose largest scores and sums are MAX and SUM: for each head, each
 * side's share of the new sum (its sum times e^(its max - the new max), in double) as a float
 * weight, then o = fma(wc, oc, wo * o) element by element. The first split is O as it is, so a
 * context of one split gives the bits of one softmax over all its rows. The 2 NQ exponentials
 * go in one call (ops_exp_shifted; a scalar ops_exp is ~20 ns). */
static void ops_attn_merge(float *const *o, float *max, double *sum, float *const *oc, const float *max_c, const double *sum_c, int nq,
                           int hd)
{
    float d[2 * OPS_ATTN_HEADS] = {0}, e[2 * OPS_ATTN_HEADS];
    for (int j = 0; j < nq; j++) {
        const float m = max_c[j] > max[j] ? max_c[j] : max[j];
        d[j] = max[j] - m, d[nq + j] = max_c[j] - m;
        max[j] = m;
    }
    ops_exp_shifted(e, d, 2 * nq, 0.0f, 1.0f); /* ops_exp((x - 0) / 1): ops_exp(x), bit for bit */
    for (int j = 0; j < nq; j++) {
        const double a = (double)e[j] * sum[j], b = (double)e[nq + j] * sum_c[j], total = a + b;
        ops_blend(o[j], oc[j], (float)(a / total), (float)(b / total), hd);
        sum[j] = total;
    }
}

/* Split P0.. (ROWS rows) of NQ heads' attention over one KV head's VALUES (rows of HD elements
 * in format KV) from its scores W (ROWS floats a head): their softmax (its maximum and sum into
 * MAX and SUM, a head each), then the values into OC (HD floats a head). */
static void ops_attention_values(float *const *w, int nq, const uint8_t *values, int p0, int rows, int hd, float *const *oc, float *max,
                                 double *sum, enum ops_kv kv)
{
    for (int j = 0; j < nq; j++) {
        max[j] = ops_softmax(w[j], rows, &sum[j]);
        memset(oc[j], 0, (size_t)hd * sizeof(float));
    }
    ops_attend((const float *const *)w, nq, values + (size_t)p0 * ops_kv_row_bytes((size_t)hd, kv), (size_t)hd, rows, hd, oc, kv);
}

/* The scores times SCALE of NQ heads' queries (Q, and QA: them quantised, for a Q8_0 cache)
 * against N key rows KEYS into W (N floats a head). */
static void ops_attention_scores(const float *const *q, const struct quant_q8_view *qa, int nq, const uint8_t *keys, int n, int hd,
                                 float scale, float *const *w, enum ops_kv kv)
{
    if (kv == OPS_KV_Q8_0) ops_scores_q8_0_of(qa, nq, keys, (size_t)hd, n, hd, scale, w);
    else ops_scores(q, nq, keys, (size_t)hd, n, hd, scale, w, kv);
}

/* Attention of NQ heads (1..OPS_ATTN_HEADS; queries Q, outputs O) over the first N rows of one
 * KV head's KEYS and VALUES (rows of HD elements in format KV): the scores of all N rows, then
 * split by split their softmax and values (ops_attention_values), each merged into O in order
 * (ops_attn_merge). SC: a scratch of N + HD floats a head (the scores, then a split's output).
 * The scores go in one pass rather than a split at a time: the bits are the same, and the key
 * rows stream without a break (a split at a time, between the values of the splits before and
 * after, attention at 32k of context with a Q8_0 cache took 12-13% more than one softmax over
 * all rows; this way 6-7% more). */
static void ops_attention(const float *const *q, int nq, const uint8_t *keys, const uint8_t *values, int n, int hd, float scale,
                          float *const *sc, float *const *o, enum ops_kv kv)
{
    float max[OPS_ATTN_HEADS], max_c[OPS_ATTN_HEADS], *w[OPS_ATTN_HEADS], *oc[OPS_ATTN_HEADS];
    double sum[OPS_ATTN_HEADS], sum_c[OPS_ATTN_HEADS];
    _Alignas(64) uint8_t act[OPS_ATTN_HEADS][OPS_KV_Q8_ACT];
    struct quant_q8_view qa[OPS_ATTN_HEADS];
    if (kv == OPS_KV_Q8_0) ops_queries_q8_0(q, nq, hd, act, qa);
    ops_attention_scores(q, qa, nq, keys, n, hd, scale, sc, kv);
    for (int p0 = 0; p0 < n; p0 += OPS_ATTN_SPLIT) {
        for (int j = 0; j < nq; j++) w[j] = sc[j] + p0, oc[j] = p0 ? sc[j] + n : o[j];
        ops_attention_values(w, nq, values, p0, n - p0 < OPS_ATTN_SPLIT ? n - p0 : OPS_ATTN_SPLIT, hd, oc, p0 ? max_c : max, p0 ? sum_c : sum,
                             kv);
        if (p0) ops_attn_merge(o, max, sum, oc, max_c, sum_c, nq, hd);
    }
}

/* ---- the gated delta rule ----
 * One token for one v-head (§5.3 of the architecture): for each row j of the state, decay it,
 * predict v_j from k, write the scaled error back, read o_j with q; each dot a serial sum over
 * the dk elements. S is stored i-major ([dk][dv]: element (j, i) at i * dv + j), so that a
 * vector holds the same element of 16 rows and the SIMD levels run 16 rows' serial sums side
 * by side: the same operations in the same order as the scalar rows, hence the same bits.
 * The step is bound by its float operations, not by the state's loads and stores: forming the
 * decayed state in both passes to store it once took 860-920 ns a head (128 x 128) against 800.
 * Serial sums one row at a time had made DeltaNet 12-15% of a 35B-A3B token (bench's
 * profile). */

/* Rows FROM..DV of the step, one at a time. */
static void ops_delta_rows_scalar(float *S, int dk, int dv, int from, const float *q, const float *k, const float *v,
                                  float beta, float decay, float *out)
{
    for (int j = from; j < dv; j++) {
        float pred = 0.0f, o = 0.0f;
        for (int i = 0; i < dk; i++) {
            float *s = S + (size_t)i * dv + j;
            *s = *s * decay;
            pred = pred + *s * k[i];
        }
        const float delta = beta * (v[j] - pred);
        for (int i = 0; i < dk; i++) {
            float *s = S + (size_t)i * dv + j;
            *s = *s + k[i] * delta;
            o = o + *s * q[i];
        }
        out[j] = o;
    }
}

/* Rows J0..J0 + 8 NB, NB vectors of 8 rows side by side (NB constant where inlined). */
QUANT_AVX2_INLINE void ops_delta_rows_avx2(float *S, int dk, int dv, int j0, int nb, const float *q, const float *k,
                                           const float *v, float beta, float decay, float *out)
{
    __m256 acc[4], delta[4];
    QUANT_UNROLL(4)
    for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps();
    for (int i = 0; i < dk; i++) {
        float *s = S + (size_t)i * dv + j0;
        const __m256 ki = _mm256_set1_ps(k[i]);
        QUANT_UNROLL(4)
        for (int b = 0; b < nb; b++) {
            const __m256 r = _mm256_mul_ps(_mm256_loadu_ps(s + 8 * b), _mm256_set1_ps(decay));
            _mm256_storeu_ps(s + 8 * b, r);
            acc[b] = _mm256_add_ps(acc[b], _mm256_mul_ps(r, ki));
        }
    }
    QUANT_UNROLL(4)
    for (int b = 0; b < nb; b++) {
        delta[b] = _mm256_mul_ps(_mm256_set1_ps(beta), _mm256_sub_ps(_mm256_loadu_ps(v + j0 + 8 * b), acc[b]));
        acc[b] = _mm256_setzero_ps();
    }
    for (int i = 0; i < dk; i++) {
        float *s = S + (size_t)i * dv + j0;
        const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
        QUANT_UNROLL(4)
        for (int b = 0; b < nb; b++) {
            const __m256 r = _mm256_add_ps(_mm256_loadu_ps(s + 8 * b), _mm256_mul_ps(ki, delta[b]));
            _mm256_storeu_ps(s + 8 * b, r);
            acc[b] = _mm256_add_ps(acc[b], _mm256_mul_ps(r, qi));
        }
    }
    QUANT_UNROLL(4)
    for (int b = 0; b < nb; b++) _mm256_storeu_ps(out + j0 + 8 * b, acc[b]);
}

static QUANT_AVX2 void ops_delta_rule_avx2(float *S, int dk, int dv, const float *q, const float *k, const float *v,
                                           float beta, float decay, float *out)
{
    int j = 0;
    for (; j + 32 <= dv; j += 32) ops_delta_rows_avx2(S, dk, dv, j, 4, q, k, v, beta, decay, out);
    for (; j + 8 <= dv; j += 8) ops_delta_rows_avx2(S, dk, dv, j, 1, q, k, v, beta, decay, out);
    ops_delta_rows_scalar(S, dk, dv, j, q, k, v, beta, decay, out);
}

/* ops_delta_rows_avx2 with 16 rows a vector. */
QUANT_AVX512_INLINE void ops_delta_rows_avx512(float *S, int dk, int dv, int j0, int nb, const float *q, const float *k,
                                               const float *v, float beta, float decay, float *out)
{
    __m512 acc[8], delta[8];
    QUANT_UNROLL(8)
    for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_ps();
    for (int i = 0; i < dk; i++) {
        float *s = S + (size_t)i * dv + j0;
        const __m512 ki = _mm512_set1_ps(k[i]);
        QUANT_UNROLL(8)
        for (int b = 0; b < nb; b++) {
            const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * b), _mm512_set1_ps(decay));
            _mm512_storeu_ps(s + 16 * b, r);
            acc[b] = _mm512_add_ps(acc[b], _mm512_mul_ps(r, ki));
        }
    }
    QUANT_UNROLL(8)
    for (int b = 0; b < nb; b++) {
        delta[b] = _mm512_mul_ps(_mm512_set1_ps(beta), _mm512_sub_ps(_mm512_loadu_ps(v + j0 + 16 * b), acc[b]));
        acc[b] = _mm512_setzero_ps();
    }
    for (int i = 0; i < dk; i++) {
        float *s = S + (size_t)i * dv + j0;
        const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
        QUANT_UNROLL(8)
        for (int b = 0; b < nb; b++) {
            const __m512 r = _mm512_add_ps(_mm512_loadu_ps(s + 16 * b), _mm512_mul_ps(ki, delta[b]));
            _mm512_storeu_ps(s + 16 * b, r);
            acc[b] = _mm512_add_ps(acc[b], _mm512_mul_ps(r, qi));
        }
    }
    QUANT_UNROLL(8)
    for (int b = 0; b < nb; b++) _mm512_storeu_ps(out + j0 + 16 * b, acc[b]);
}

static QUANT_AVX512 void ops_delta_rule_avx512(float *S, int dk, int dv, const float *q, const float *k, const float *v,
                                               float beta, float decay, float *out)
{
    int j = 0;
    for (; j + 128 <= dv; j += 128) ops_delta_rows_avx512(S, dk, dv, j, 8, q, k, v, beta, decay, out);
    for (; j + 16 <= dv; j += 16) ops_delta_rows_avx512(S, dk, dv, j, 1, q, k, v, beta, decay, out);
    ops_delta_rows_scalar(S, dk, dv, j, q, k, v, beta, decay, out);
}

static void ops_delta_rule(float *S, int dk, int dv, const float *q, const float *k, const float *v, float beta, float decay,
                           float *out)
{
    if (quant_level >= QUANT_LEVEL_AVX512) ops_delta_rule_avx512(S, dk, dv, q, k, v, beta, decay, out);
    else if (quant_level >= QUANT_LEVEL_AVX2) ops_delta_rule_avx2(S, dk, dv, q, k, v, beta, decay, out);
    else ops_delta_rows_scalar(S, dk, dv, 0, q, k, v, beta, decay, out);
}

/* NeoX ("rotate half") RoPE on the first ROT dims of one head vector: dim j pairs with
 * j + ROT/2. cos_sin holds [ROT/2] cosines then [ROT/2] sines for this position. */
static void ops_rope_neox(float *x, int rot, const float *cos_sin)
{
    int half = rot / 2;
    for (int j = 0; j < half; j++) {
        float c = cos_sin[j], s = cos_sin[half + j];
        float a = x[j], b = x[j + half];
        x[j] = a * c - b * s;
        x[j + half] = b * c + a * s;
    }
}

/* ==== §5 cuda ==== */
/* Owns: the system's CUDA driver, reached from this static binary at run time: the foreign
 *   dlopen (glibc's ld.so and the embedded glibc helper mapped into this process; in a glibc
 *   build, as the tests use, the native dlopen), the typed driver wrappers, the device list in
 *   PCI bus order, per-device contexts and the module JIT-compiled from the embedded kernels.ptx,
 *   device memory for resident trunk matrices and routed experts, the GEMV launches of the
 *   batches of products §4 offloads (ops_offload), the routed experts' batches and the layers
 *   and chains §8 runs there, and the CUDA graphs that replay a repeated window of launches.
 * Promises: every failure prints one `[cuda] ...` line with its reason and leaves coli on the
 *   CPU; results never change: a device GEMV computes the CPU's canonical order bit for bit, and
 *   a launch that fails is recomputed on the CPU. Device i is the i-th card in PCI bus order in
 *   every flag and line. No driver call is made unless cuda_start ran (COLI_CUDA=0 / --gpu off:
 *   never). Driver calls are serialised under one lock, with async signals blocked and, in the
 *   musl build, the thread pointer switched to glibc's (portable-notes.md §5.1-5.3).
 * May call: §1, §3 (activation layout), §4 (struct ops_matrix, the ops_offload hook).
 * Workload: start-up (loader, cuInit, JIT: ~0.1-1 s). Per batch of products over one input
 *   (§4 ops_matmat_jobs): one upload, a launch per product, one download: 2 + n wrapped calls;
 *   per layer's routed experts, and the shared expert where its shape lets it join them: one
 *   upload, 3 launches, one download; the rest of a layer after its mixer where one device
 *   holds all of it (output projection, residual and norm, router, routing, experts, their sum
 *   and residual: cuda_moe_layer_start): one upload, 11 launches, one download, and the next
 *   layer's norm and mixer projections in the same batch where they are there too (a launch
 *   for the norm, one a weight type, one a projection), after the last layer of a decode step
 *   the final norm and the output head. A layer whose routed experts are partly the CPU's is
 *   split: its routing comes down after the routing kernel, the CPU's experts' outputs go up
 *   before the sum (2 calls, one of them a wait, more). A layer whose projections the layer
 *   before made there runs its mixer there too, over its sequences' DeltaNet states or KV caches
 *   kept in device memory (a chain: 3 or 4 launches, no upload, no download; layer 0's
 *   projections from the embedded rows, which go up with the pass's first upload; see "chains"
 *   below; a split layer chains too, its routing still coming down). A decoded token of the
 *   35B-A3B (Q4_K_M mix) with everything resident then waits
 *   once, for the logits (41 before the chains, 161 as products and expert batches), and its
 *   launches (~870) are one window that repeats token after token: from the third decode step
 *   on it runs as one CUDA graph ("graphs" below), 4 driver calls a token (the upload, the
 *   graph, the logits and the ids down; the fake driver: 92 a token on a 4-layer slice and 178
 *   on 8 without graphs, 4 on both with). Chained layers split with the CPU wait once each
 *   (their routing) and make 4 calls (the routing down, the device's experts as a graph, the
 *   CPU's outputs up, the rest to the next layer's routing as a graph): on the 4-layer slice in
 *   1 GiB, 5 waits and 20 calls a decode step (102 without graphs). One wrapped call cost 0.25
 *   µs on the VM where it was measured (WRFSBASE; mostly the two sigprocmask calls). */

#include <pthread.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#ifndef __GLIBC__
#include <elf.h>
#include <setjmp.h>
#include <sys/auxv.h>
#endif

/* The driver API's types and the few constants coli uses (values from cuda.h, stable ABI). */
typedef int cuda_result;
typedef int cuda_device_id;
typedef unsigned long long cuda_ptr; /* CUdeviceptr: 64-bit since the _v2 API */
typedef struct cuda_opaque *cuda_handle; /* CUcontext, CUmodule, CUfunction, CUstream */

enum {
    CUDA_SUCCESS = 0, CUDA_ERROR_OUT_OF_MEMORY = 2, CUDA_ERROR_STUB_LIBRARY = 34, CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_NO_DEVICE = 100, CUDA_ERROR_INVALID_PTX = 218, CUDA_ERROR_JIT_COMPILER_NOT_FOUND = 221,
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222, CUDA_ERROR_NOT_FOUND = 500,
};
enum {
    CUDA_ATTR_SM_COUNT = 16, CUDA_ATTR_PCI_BUS = 33, CUDA_ATTR_PCI_DEVICE = 34,
    CUDA_ATTR_PCI_DOMAIN = 50, CUDA_ATTR_CC_MAJOR = 75, CUDA_ATTR_CC_MINOR = 76,
};
enum { CUDA_JIT_INFO_LOG = 3, CUDA_JIT_INFO_LOG_SIZE = 4, CUDA_JIT_ERROR_LOG = 5, CUDA_JIT_ERROR_LOG_SIZE = 6 };

/* A kernel node of a graph: CUDA_KERNEL_NODE_PARAMS as the unversioned cuGraphAddKernelNode
 * takes it (the _v1 layout; cuda.h's _v2 adds two fields after these). */
struct cuda_kernel_node {
    cuda_handle fn;
    unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared;
    void **params, **extra;
};

/* Driver entry points, resolved by their versioned names (notes §5.10: the plain cuMemAlloc is
 * the 32-bit-pointer ABI of CUDA 3). X(field, symbol, required). */
#define CUDA_API(X) \
    X(init, "cuInit", 1) X(driver_version, "cuDriverGetVersion", 1) X(get_error_string, "cuGetErrorString", 0) \
    X(device_count, "cuDeviceGetCount", 1) X(device_get, "cuDeviceGet", 1) X(device_name, "cuDeviceGetName", 1) \
    X(device_mem, "cuDeviceTotalMem_v2", 1) X(device_attr, "cuDeviceGetAttribute", 1) \
    X(ctx_retain, "cuDevicePrimaryCtxRetain", 1) X(ctx_release, "cuDevicePrimaryCtxRelease_v2", 1) \
    X(ctx_set, "cuCtxSetCurrent", 1) X(mem_info, "cuMemGetInfo_v2", 1) \
    X(mem_alloc, "cuMemAlloc_v2", 1) X(mem_free, "cuMemFree_v2", 1) X(htod, "cuMemcpyHtoD_v2", 1) \
    X(dtoh, "cuMemcpyDtoH_v2", 1) X(module_load, "cuModuleLoadDataEx", 1) X(module_unload, "cuModuleUnload", 1) \
    X(module_function, "cuModuleGetFunction", 1) X(launch, "cuLaunchKernel", 1) \
    X(event_create, "cuEventCreate", 0) X(event_record, "cuEventRecord", 0) X(event_sync, "cuEventSynchronize", 0) \
    X(event_elapsed, "cuEventElapsedTime", 0) X(event_destroy, "cuEventDestroy_v2", 0) X(event_query, "cuEventQuery", 0) \
    X(stream_create, "cuStreamCreate", 0) X(htod_async, "cuMemcpyHtoDAsync_v2", 0) \
    X(host_alloc, "cuMemHostAlloc", 0) X(host_free, "cuMemFreeHost", 0) X(dtod, "cuMemcpyDtoD_v2", 0) \
    X(graph_create, "cuGraphCreate", 0) X(graph_add_kernel, "cuGraphAddKernelNode", 0) \
    X(graph_instantiate, "cuGraphInstantiateWithFlags", 0) X(graph_launch, "cuGraphLaunch", 0) \
    X(graph_destroy, "cuGraphDestroy", 0) X(graph_exec_destroy, "cuGraphExecDestroy", 0)

struct cuda_api {
    cuda_result (*init)(unsigned flags);
    cuda_result (*driver_version)(int *v);
    cuda_result (*get_error_string)(cuda_result r, const char **s);
    cuda_result (*device_count)(int *n);
    cuda_result (*device_get)(cuda_device_id *d, int ordinal);
    cuda_result (*device_name)(char *name, int len, cuda_device_id d);
    cuda_result (*device_mem)(size_t *bytes, cuda_device_id d);
    cuda_result (*device_attr)(int *v, int attr, cuda_device_id d);
    cuda_result (*ctx_retain)(cuda_handle *ctx, cuda_device_id d);
    cuda_result (*ctx_release)(cuda_device_id d);
    cuda_result (*ctx_set)(cuda_handle ctx);
    cuda_result (*mem_info)(size_t *free_bytes, size_t *total);
    cuda_result (*mem_alloc)(cuda_ptr *p, size_t n);
    cuda_result (*mem_free)(cuda_ptr p);
    cuda_result (*htod)(cuda_ptr dst, const void *src, size_t n);
    cuda_result (*dtoh)(void *dst, cuda_ptr src, size_t n);
    cuda_result (*module_load)(cuda_handle *mod, const void *image, unsigned n_opt, int *opts, void **vals);
    cuda_result (*module_unload)(cuda_handle mod);
    cuda_result (*module_function)(cuda_handle *fn, cuda_handle mod, const char *name);
    cuda_result (*launch)(cuda_handle fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                          unsigned shared, cuda_handle stream, void **params, void **extra);
    cuda_result (*event_create)(cuda_handle *e, unsigned flags);
    cuda_result (*event_record)(cuda_handle e, cuda_handle stream);
    cuda_result (*event_sync)(cuda_handle e);
    cuda_result (*event_elapsed)(float *ms, cuda_handle start, cuda_handle end);
    cuda_result (*event_destroy)(cuda_handle e);
    cuda_result (*event_query)(cuda_handle e);
    cuda_result (*stream_create)(cuda_handle *st, unsigned flags);
    cuda_result (*htod_async)(cuda_ptr dst, const void *src, size_t n, cuda_handle st);
    cuda_result (*host_alloc)(void **p, size_t n, unsigned flags);
    cuda_result (*host_free)(void *p);
    cuda_result (*dtod)(cuda_ptr dst, cuda_ptr src, size_t n);
    cuda_result (*graph_create)(cuda_handle *graph, unsigned flags);
    cuda_result (*graph_add_kernel)(cuda_handle *node, cuda_handle graph, const cuda_handle *deps, size_t n_deps,
                                    const struct cuda_kernel_node *params);
    cuda_result (*graph_instantiate)(cuda_handle *exec, cuda_handle graph, unsigned long long flags);
    cuda_result (*graph_launch)(cuda_handle exec, cuda_handle stream);
    cuda_result (*graph_destroy)(cuda_handle graph);
    cuda_result (*graph_exec_destroy)(cuda_handle exec);
};
static struct cuda_api cuda_api;

/* glibc's dl* functions: from the foreign loader (musl build) or the native ones. */
struct cuda_dl {
    void *(*open)(const char *file, int mode);
    void *(*sym)(void *handle, const char *name);
    char *(*error)(void);
    int (*close)(void *handle);
};
static struct cuda_dl cuda_dl;

/* ---- the call wrapper: lock, async signals blocked, glibc's thread pointer ----
 * All musl threads share the one glibc TCB that ld.so set up (notes §5.2), so calls are
 * serialised; signals are blocked so that no musl handler runs on glibc's TCB (§5.3), and
 * threads the driver creates inherit the blocked mask. */

static pthread_mutex_t cuda_lock = PTHREAD_MUTEX_INITIALIZER;
static sigset_t cuda_saved_mask;
static uintptr_t cuda_glibc_tp, cuda_musl_tp;
static int cuda_fsgsbase; /* AT_HWCAP2 has FSGSBASE: WRFSBASE instead of a syscall */

static inline uintptr_t cuda_tp_get(void)
{
    uintptr_t tp;
    __asm__ volatile("mov %%fs:0, %0" : "=r"(tp));
    return tp;
}

/* Raw: musl's syscall() would write errno through whichever TCB %fs points at (notes §5.1). */
static inline void cuda_tp_set(uintptr_t tp)
{
    if (cuda_fsgsbase) {
        __asm__ volatile("wrfsbase %0" : : "r"(tp) : "memory");
    } else {
        long r;
        __asm__ volatile("syscall" : "=a"(r) : "0"((long)SYS_arch_prctl), "D"(0x1002L /* ARCH_SET_FS */), "S"(tp)
                         : "rcx", "r11", "memory");
        (void)r;
    }
}

static long cuda_calls; /* wrapped driver calls made (coli's only way to the driver) */

static void cuda_enter(void)
{
    sigset_t async;
    pthread_mutex_lock(&cuda_lock);
    cuda_calls++;
    sigfillset(&async);
    sigdelset(&async, SIGSEGV); sigdelset(&async, SIGBUS); sigdelset(&async, SIGFPE);
    sigdelset(&async, SIGILL); sigdelset(&async, SIGTRAP); sigdelset(&async, SIGABRT);
    pthread_sigmask(SIG_BLOCK, &async, &cuda_saved_mask);
    if (cuda_glibc_tp) {
        cuda_musl_tp = cuda_tp_get();
        cuda_tp_set(cuda_glibc_tp);
    }
}

static void cuda_leave(void)
{
    if (cuda_glibc_tp) cuda_tp_set(cuda_musl_tp);
    pthread_sigmask(SIG_SETMASK, &cuda_saved_mask, NULL);
    pthread_mutex_unlock(&cuda_lock);
}

/* Typed wrappers: the arguments are evaluated by the caller, before the switch, so nothing
 * in them can touch musl's TLS while %fs is glibc's. CUDA_WRAP's first make the launches the
 * window holds back (cuda_window_end, "graphs" below): a copy, a free, a switch of context or a
 * wait comes after the launches queued before it. CUDA_WRAP_NOW's are the launches and graphs
 * themselves, and the calls that touch no memory a launch may use. */
static cuda_result cuda_window_end(void);
#define CUDA_WRAP_NOW(name, params, args) \
    static cuda_result cuda_##name params { cuda_enter(); cuda_result r_ = cuda_api.name args; cuda_leave(); return r_; }
#define CUDA_WRAP(name, params, args) \
    static cuda_result cuda_##name params \
    { \
        cuda_result r_ = cuda_window_end(); \
        if (r_) return r_; \
        cuda_enter(); \
        r_ = cuda_api.name args; \
        cuda_leave(); \
        return r_; \
    }
CUDA_WRAP(init, (unsigned f), (f))
CUDA_WRAP_NOW(driver_version, (int *v), (v))
CUDA_WRAP(device_count, (int *n), (n))
CUDA_WRAP(device_get, (cuda_device_id *d, int i), (d, i))
CUDA_WRAP(device_name, (char *s, int n, cuda_device_id d), (s, n, d))
CUDA_WRAP(device_mem, (size_t *b, cuda_device_id d), (b, d))
CUDA_WRAP(device_attr, (int *v, int a, cuda_device_id d), (v, a, d))
CUDA_WRAP(ctx_retain, (cuda_handle *c, cuda_device_id d), (c, d))
CUDA_WRAP(ctx_release, (cuda_device_id d), (d))
CUDA_WRAP(ctx_set, (cuda_handle c), (c))
CUDA_WRAP(mem_info, (size_t *f, size_t *t), (f, t))
CUDA_WRAP(mem_alloc, (cuda_ptr *p, size_t n), (p, n))
CUDA_WRAP(mem_free, (cuda_ptr p), (p))
CUDA_WRAP(htod, (cuda_ptr d, const void *s, size_t n), (d, s, n))
CUDA_WRAP(dtoh, (void *d, cuda_ptr s, size_t n), (d, s, n))
CUDA_WRAP(dtod, (cuda_ptr d, cuda_ptr s, size_t n), (d, s, n))
CUDA_WRAP(module_load, (cuda_handle *m, const void *img, unsigned n, int *o, void **v), (m, img, n, o, v))
CUDA_WRAP(module_unload, (cuda_handle m), (m))
CUDA_WRAP(module_function, (cuda_handle *f, cuda_handle m, const char *s), (f, m, s))
static cuda_result cuda_launch_now(cuda_handle f, unsigned gx, unsigned gy, unsigned bx, void **p) /* cuda_launch: as the window allows */
{
    cuda_enter();
    cuda_result r = cuda_api.launch(f, gx, gy, 1, bx, 1, 1, 0, NULL, p, NULL);
    cuda_leave();
    return r;
}
CUDA_WRAP(event_create, (cuda_handle *e), (e, 0))
CUDA_WRAP(event_record, (cuda_handle e, cuda_handle st), (e, st))
CUDA_WRAP(event_sync, (cuda_handle e), (e))
CUDA_WRAP(event_elapsed, (float *ms, cuda_handle a, cuda_handle b), (ms, a, b))
CUDA_WRAP(event_destroy, (cuda_handle e), (e))
CUDA_WRAP_NOW(event_query, (cuda_handle e), (e)) /* a background copy's: to memory no launch reads yet */
CUDA_WRAP(stream_create, (cuda_handle *st), (st, 1)) /* CU_STREAM_NON_BLOCKING: no wait on the null stream's kernels */
CUDA_WRAP(htod_async, (cuda_ptr d, const void *src, size_t n, cuda_handle st), (d, src, n, st))
CUDA_WRAP(host_alloc, (void **p, size_t n), (p, n, 1)) /* CU_MEMHOSTALLOC_PORTABLE: pinned for every context */
CUDA_WRAP(host_free, (void *p), (p))
CUDA_WRAP_NOW(graph_create, (cuda_handle *g), (g, 0))
CUDA_WRAP_NOW(graph_add_kernel, (cuda_handle *node, cuda_handle g, const cuda_handle *after, const struct cuda_kernel_node *k),
              (node, g, after, *after != NULL, k))
CUDA_WRAP_NOW(graph_instantiate, (cuda_handle *exec, cuda_handle g), (exec, g, 0))
CUDA_WRAP_NOW(graph_launch, (cuda_handle exec), (exec, NULL)) /* the legacy stream, as every launch and copy */
CUDA_WRAP_NOW(graph_destroy, (cuda_handle g), (g))
CUDA_WRAP(graph_exec_destroy, (cuda_handle exec), (exec))
#undef CUDA_WRAP
#undef CUDA_WRAP_NOW

/* The driver's name for R ("CUDA_ERROR_OUT_OF_MEMORY") when it has one; coli's words for the
 * codes a user meets at start-up. Copied into BUF: the driver's strings are static, but are
 * read here under the wrapper like any other driver memory. */
static const char *cuda_error_name(cuda_result r, char *buf, size_t cap)
{
    const char *why = r == CUDA_ERROR_STUB_LIBRARY ? "the CUDA toolkit's stub library, not a driver"
                    : r == CUDA_ERROR_NO_DEVICE ? "no CUDA device"
                    : r == CUDA_ERROR_JIT_COMPILER_NOT_FOUND ? "no PTX JIT compiler (libnvidia-ptxjitcompiler.so.1; in a container set NVIDIA_DRIVER_CAPABILITIES=compute,utility)"
                    : r == CUDA_ERROR_UNSUPPORTED_PTX_VERSION ? "the driver is too old for this PTX"
                    : r == CUDA_ERROR_OUT_OF_MEMORY ? "out of device memory" : NULL;
    const char *s = NULL;
    if (!why && cuda_api.get_error_string) {
        cuda_enter();
        if (cuda_api.get_error_string(r, &s) != CUDA_SUCCESS) s = NULL;
        cuda_leave();
    }
    snprintf(buf, cap, "%s (error %d)", why ? why : s ? s : "driver error", r);
    return buf;
}

/* ---- foreign dlopen (musl build; portable-notes.md "How foreign dlopen works") ---- */
#ifndef __GLIBC__

/* The glibc helper built by build.sh; absent when coli.c is compiled without build.sh. */
#if __has_include("build/coli_helper")
__asm__(".section .rodata\n.balign 64\ncuda_helper_elf:\n.incbin \"build/coli_helper\"\ncuda_helper_end:\n.previous");
extern const uint8_t cuda_helper_elf[], cuda_helper_end[]; /* local asm labels of this file */
#define CUDA_HAVE_HELPER 1
#endif

/* An ELF image mapped into this process. */
struct cuda_elf {
    uintptr_t bias, entry, phdr;
    int phnum;
};

static int cuda_elf_check(const uint8_t *img, size_t n)
{
    const Elf64_Ehdr *eh = (const Elf64_Ehdr *)img;
    return n >= sizeof *eh && !memcmp(img, ELFMAG, SELFMAG) && img[EI_CLASS] == ELFCLASS64 && eh->e_type == ET_DYN &&
           eh->e_machine == EM_X86_64 && eh->e_phentsize == sizeof(Elf64_Phdr) && eh->e_phoff < n &&
           eh->e_phnum <= (n - eh->e_phoff) / sizeof(Elf64_Phdr);
}

/* Maps one PT_LOAD at BIAS: from FD when given (ld.so: like the kernel does), else an anonymous
 * copy of IMG (the helper when no memfd). Zeroes the bss. Returns 0 or -1. */
static int cuda_elf_segment(const Elf64_Phdr *p, uintptr_t bias, int fd, const uint8_t *img, size_t n)
{
    const uintptr_t pg = 4096, start = (bias + p->p_vaddr) & ~(pg - 1);
    const uintptr_t fend = bias + p->p_vaddr + p->p_filesz, end = (bias + p->p_vaddr + p->p_memsz + pg - 1) & ~(pg - 1);
    const size_t off = p->p_offset & ~(pg - 1);
    int prot = (p->p_flags & PF_R ? PROT_READ : 0) | (p->p_flags & PF_W ? PROT_WRITE : 0) | (p->p_flags & PF_X ? PROT_EXEC : 0);
    if (p->p_offset > n || p->p_filesz > n - p->p_offset || p->p_memsz < p->p_filesz) return -1;
    if (mmap((void *)start, end - start, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED | MAP_ANONYMOUS, -1, 0) == MAP_FAILED) return -1;
    if (p->p_filesz) {
        size_t len = fend - start;
        if (fd >= 0) {
            if (mmap((void *)start, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, (off_t)off) == MAP_FAILED) return -1;
        } else {
            memcpy((void *)start, img + off, len);
        }
        if (p->p_memsz > p->p_filesz) memset((void *)fend, 0, ((fend + pg - 1) & ~(pg - 1)) - fend);
    }
    return mprotect((void *)start, end - start, prot);
}

/* Maps the whole ELF image IMG[N] (FD: its file, or -1). Returns 0 or -1. */
static int cuda_elf_map(const uint8_t *img, size_t n, int fd, struct cuda_elf *e)
{
    const Elf64_Ehdr *eh = (const Elf64_Ehdr *)img;
    const Elf64_Phdr *ph = (const Elf64_Phdr *)(img + eh->e_phoff);
    uintptr_t lo = UINTPTR_MAX, hi = 0, phdr = 0;
    for (int i = 0; i < eh->e_phnum; i++) {
        if (ph[i].p_type == PT_PHDR) phdr = ph[i].p_vaddr;
        if (ph[i].p_type != PT_LOAD) continue;
        if (ph[i].p_vaddr < lo) lo = ph[i].p_vaddr & ~(uintptr_t)4095;
        if (ph[i].p_vaddr + ph[i].p_memsz > hi) hi = ph[i].p_vaddr + ph[i].p_memsz;
    }
    if (hi <= lo || hi - lo > (1u << 30)) return -1;
    void *base = mmap(NULL, hi - lo, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return -1;
    e->bias = (uintptr_t)base - lo;
    for (int i = 0; i < eh->e_phnum; i++)
        if (ph[i].p_type == PT_LOAD && cuda_elf_segment(&ph[i], e->bias, fd, img, n)) return -1;
    e->entry = e->bias + eh->e_entry;
    e->phdr = e->bias + (phdr ? phdr : lo + eh->e_phoff);
    e->phnum = eh->e_phnum;
    return 0;
}

/* Reads a whole small file; NULL if unreadable or larger than 64 MiB. */
static uint8_t *cuda_read_file(const char *path, size_t *n)
{
    struct plat_map m;
    if (plat_map_file(path, &m)) return NULL;
    if (m.size == 0 || m.size > (64u << 20)) {
        plat_unmap_file(&m);
        return NULL;
    }
    uint8_t *buf = plat_alloc(m.size);
    memcpy(buf, m.data, m.size);
    *n = m.size;
    plat_unmap_file(&m);
    return buf;
}

/* glibc's loader, not an impostor: an x86-64 ET_DYN without PT_INTERP whose bytes name
 * GLIBC_2.2.5 and GLIBC_PRIVATE (rejects musl's ld posing as ld-linux, NixOS's stub-ld). */
static int cuda_is_glibc_loader(const uint8_t *img, size_t n)
{
    if (!cuda_elf_check(img, n)) return 0;
    const Elf64_Ehdr *eh = (const Elf64_Ehdr *)img;
    const Elf64_Phdr *ph = (const Elf64_Phdr *)(img + eh->e_phoff);
    for (int i = 0; i < eh->e_phnum; i++)
        if (ph[i].p_type == PT_INTERP) return 0;
    return memmem(img, n, "GLIBC_2.2.5", 11) && memmem(img, n, "GLIBC_PRIVATE", 13);
}

/* The PT_INTERP named by the executable PATH, into OUT ("" if none). */
static void cuda_interp_of(const char *path, char *out, size_t cap)
{
    size_t n;
    uint8_t *img = cuda_read_file(path, &n);
    out[0] = 0;
    if (img && n >= sizeof(Elf64_Ehdr) && !memcmp(img, ELFMAG, SELFMAG) && img[EI_CLASS] == ELFCLASS64) {
        const Elf64_Ehdr *eh = (const Elf64_Ehdr *)img;
        for (int i = 0; eh->e_phoff < n && i < eh->e_phnum && eh->e_phoff + (i + 1) * sizeof(Elf64_Phdr) <= n; i++) {
            const Elf64_Phdr *p = (const Elf64_Phdr *)(img + eh->e_phoff) + i;
            if (p->p_type == PT_INTERP && p->p_offset < n && p->p_filesz < cap && p->p_filesz <= n - p->p_offset) {
                memcpy(out, img + p->p_offset, p->p_filesz);
                out[p->p_filesz] = 0;
            }
        }
    }
    free(img);
}

/* Finds glibc's loader (notes step 1): COLI_LDSO, then the PT_INTERP of /usr/bin/env and
 * /bin/sh (NixOS and Guix store paths), then the fixed places. Returns its image, or NULL. */
static uint8_t *cuda_find_loader(char *path, size_t cap, size_t *n)
{
    static const char *const fixed[] = {"/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
                                        "/usr/lib64/ld-linux-x86-64.so.2", "/usr/lib/ld-linux-x86-64.so.2"};
    const char *env = getenv("COLI_LDSO");
    for (int i = 0; i < 7; i++) {
        if (i == 0) snprintf(path, cap, "%s", env ? env : "");
        else if (i == 1 || i == 2) cuda_interp_of(i == 1 ? "/usr/bin/env" : "/bin/sh", path, cap);
        else snprintf(path, cap, "%s", fixed[i - 3]);
        if (env && i > 0) break; /* an explicit loader is the only one tried */
        uint8_t *img = path[0] ? cuda_read_file(path, n) : NULL;
        if (img && cuda_is_glibc_loader(img, *n)) return img;
        free(img);
    }
    return NULL;
}

static jmp_buf cuda_ld_home;
static void *cuda_ld_fns[4];

/* Called by the helper once ld.so has set glibc up. Touches no musl TLS (%fs is glibc's): stores
 * the four dl* pointers and glibc's thread pointer, and goes home with musl's longjmp, which,
 * unlike glibc's, does not demangle pointers through the TCB. */
__attribute__((noreturn, no_stack_protector, used)) static void cuda_ld_callback(void *const fns[4])
{
    for (int i = 0; i < 4; i++) cuda_ld_fns[i] = fns[i];
    cuda_glibc_tp = cuda_tp_get();
    longjmp(cuda_ld_home, 1);
}

/* Copies S onto the string area growing down from *TOP; returns the copy. */
static char *cuda_stack_str(char **top, const char *s)
{
    size_t n = strlen(s) + 1;
    *top -= n;
    memcpy(*top, s, n);
    return *top;
}

/* A fresh initial process stack for ld.so (notes step 5), 1 MiB, never freed: glibc keeps
 * pointers to argv, environ and auxv. argv = {"coli-helper", hex(callback)}; environ without
 * LD_PRELOAD/LD_AUDIT; auxv from getauxval with the helper as the program and ld.so as AT_BASE.
 * Returns the stack pointer (16-byte aligned, at argc), or 0. */
static uintptr_t cuda_ld_stack(const struct cuda_elf *helper, const struct cuda_elf *ld)
{
    extern char **environ;
    size_t size = 1 << 20, n_env = 0;
    char *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return 0;
    for (char **e = environ; *e; e++) n_env++;
    char *top = base + size, hex[32];
    snprintf(hex, sizeof hex, "%lx", (unsigned long)(uintptr_t)cuda_ld_callback);
    char *argv0 = cuda_stack_str(&top, "coli-helper"), *argv1 = cuda_stack_str(&top, hex);
    char **envs = plat_alloc((n_env + 1) * sizeof *envs);
    size_t k = 0;
    for (char **e = environ; *e; e++)
        if (strncmp(*e, "LD_PRELOAD=", 11) && strncmp(*e, "LD_AUDIT=", 9) && (size_t)(top - base) > strlen(*e) + 65536)
            envs[k++] = cuda_stack_str(&top, *e);
    uintptr_t aux[2 * 64 + 2];
    size_t na = 0;
    for (unsigned long t = 1; t < 64; t++) {
        unsigned long v = t == AT_PHDR ? helper->phdr : t == AT_PHENT ? sizeof(Elf64_Phdr) : t == AT_PHNUM ? (unsigned long)helper->phnum
                        : t == AT_ENTRY ? helper->entry : t == AT_BASE ? ld->bias : getauxval(t);
        if (v || t == AT_SECURE) { aux[na++] = t; aux[na++] = v; }
    }
    aux[na++] = AT_NULL;
    aux[na++] = 0;
    size_t words = 1 + 3 + k + 1 + na;
    uintptr_t *sp = (uintptr_t *)(((uintptr_t)top - words * sizeof(uintptr_t)) & ~(uintptr_t)15);
    size_t w = 0;
    sp[w++] = 2;
    sp[w++] = (uintptr_t)argv0;
    sp[w++] = (uintptr_t)argv1;
    sp[w++] = 0;
    for (size_t i = 0; i < k; i++) sp[w++] = (uintptr_t)envs[i];
    sp[w++] = 0;
    memcpy(sp + w, aux, na * sizeof *aux);
    free(envs);
    return (uintptr_t)sp;
}

/* One PROT_NONE page at the program break (notes §5.4): glibc and musl both cache the break,
 * and one shrinking it under the other crashed every time; with the fence every later brk
 * growth fails and both fall back to mmap. */
static void cuda_brk_fence(void)
{
    uintptr_t cur = (uintptr_t)syscall(SYS_brk, 0), page = (cur + 4095) & ~(uintptr_t)4095;
    if (cur) mmap((void *)page, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
}

/* Maps the helper, from a memfd where possible (SELinux execmem and PaX refuse executable
 * anonymous memory), else as an anonymous copy (vm.memfd_noexec refuses the memfd). */
static int cuda_map_helper(struct cuda_elf *e)
{
#ifdef CUDA_HAVE_HELPER
    size_t n = (size_t)(cuda_helper_end - cuda_helper_elf);
    int fd = (int)syscall(SYS_memfd_create, "coli-helper", 1u /* MFD_CLOEXEC */ | 0x10u /* MFD_EXEC */);
    if (fd < 0) fd = (int)syscall(SYS_memfd_create, "coli-helper", 1u);
    if (fd >= 0 && write(fd, cuda_helper_elf, n) != (ssize_t)n) {
        close(fd);
        fd = -1;
    }
    int r = cuda_elf_check(cuda_helper_elf, n) ? cuda_elf_map(cuda_helper_elf, n, fd, e) : -1;
    if (r && fd >= 0) r = cuda_elf_map(cuda_helper_elf, n, -1, e);
    if (fd >= 0) close(fd);
    return r;
#else
    (void)e;
    return -1;
#endif
}

/* Maps the helper and LD (image IMG[N] of file LD_PATH), jumps to ld.so's entry on a fresh
 * stack with all signals blocked, and comes back through cuda_ld_callback. Returns 0 with
 * cuda_dl filled and musl's state restored, or -1 with WHY set. */
static int cuda_ld_run(const char *ld_path, const uint8_t *img, size_t n, char *why, size_t cap)
{
    extern volatile int __thread_list_lock __attribute__((weak));
    struct cuda_elf helper, ld;
    if (cuda_map_helper(&helper)) return snprintf(why, cap, "cannot map the embedded glibc helper"), -1;
    int fd = open(ld_path, O_RDONLY | O_CLOEXEC);
    int r = fd < 0 ? -1 : cuda_elf_map(img, n, fd, &ld);
    if (fd >= 0) close(fd);
    if (r) return snprintf(why, cap, "cannot map %s", ld_path), -1;
    uintptr_t sp = cuda_ld_stack(&helper, &ld);
    if (!sp) return snprintf(why, cap, "no memory for the loader's stack"), -1;
    static sigset_t saved;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &saved);
    cuda_musl_tp = cuda_tp_get();
    if (!setjmp(cuda_ld_home)) {
        __asm__ volatile("mov %0, %%rsp\n\txor %%edx, %%edx\n\tjmp *%1" : : "r"(sp), "r"(ld.entry) : "rdx", "memory");
        __builtin_unreachable();
    }
    cuda_tp_set(cuda_musl_tp); /* first: nothing may touch TLS before this */
    pthread_sigmask(SIG_SETMASK, &saved, NULL);
    /* ld.so pointed the kernel's clear-on-exit tid at glibc's TCB; musl expects its lock */
    if (&__thread_list_lock) syscall(SYS_set_tid_address, &__thread_list_lock);
    cuda_dl.open = (void *(*)(const char *, int))cuda_ld_fns[0];
    cuda_dl.sym = (void *(*)(void *, const char *))cuda_ld_fns[1];
    cuda_dl.error = (char *(*)(void))cuda_ld_fns[2];
    cuda_dl.close = (int (*)(void *))cuda_ld_fns[3];
    return 0;
}

/* The loader start-up (notes steps 1-6): finds glibc's ld.so, fences brk, rehearses the start-up
 * in a child (ld.so _exit(127)s on a missing libc.so.6, which would kill coli), then does it
 * for real. Main thread only, before any other thread exists. Returns 0, or -1 with WHY. */
static int cuda_dl_start(char *why, size_t cap)
{
    char ld_path[PATH_MAX];
    size_t n = 0;
    uint8_t *img = cuda_find_loader(ld_path, sizeof ld_path, &n);
    if (!img) return snprintf(why, cap, "no glibc loader (ld-linux-x86-64.so.2) on this system%s", getenv("COLI_LDSO") ? " at COLI_LDSO" : ""), -1;
    cuda_fsgsbase = (getauxval(AT_HWCAP2) & 2) != 0; /* HWCAP2_FSGSBASE */
    cuda_brk_fence();
    fflush(NULL);
    int status = 0;
    pid_t pid = fork();
    if (pid == 0) _exit(cuda_ld_run(ld_path, img, n, why, cap) ? 1 : 0);
    int r = -1;
    if (pid < 0)
        snprintf(why, cap, "fork: %s", strerror(errno));
    else if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        snprintf(why, cap, "the glibc loader %s failed to start (%s %d)", ld_path, WIFEXITED(status) ? "exit status" : "signal",
                 WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
    else
        r = cuda_ld_run(ld_path, img, n, why, cap);
    free(img);
    return r;
}
#endif

#ifdef __GLIBC__
#include <dlfcn.h>
/* A glibc build (the tests, built with plain gcc and under ASan) has dlopen itself. */
static int cuda_dl_start(char *why, size_t cap)
{
    (void)why; (void)cap;
    cuda_dl = (struct cuda_dl){dlopen, dlsym, dlerror, dlclose};
    return 0;
}
#endif

static void *cuda_dlopen(const char *path)
{
    cuda_enter();
    void *h = cuda_dl.open(path, 2 /* glibc's RTLD_NOW | RTLD_LOCAL */);
    cuda_leave();
    return h;
}

static void *cuda_dlsym(void *h, const char *name)
{
    cuda_enter();
    void *p = cuda_dl.sym(h, name);
    cuda_leave();
    return p;
}

/* dlerror's text, copied while the lock is held (it lives in glibc's per-thread buffer). */
static void cuda_dlerror(char *buf, size_t cap)
{
    cuda_enter();
    const char *e = cuda_dl.error();
    size_t n = 0;
    if (e) while (e[n] && n + 1 < cap) { buf[n] = e[n]; n++; }
    buf[n] = 0;
    cuda_leave();
}

/* Signals 32-34 are musl's own (timers, cancellation, setxid). glibc < 2.34's libpthread, a
 * dependency of libcuda, installs handlers for 32 and 33 process-wide, after which musl's
 * pthread_cancel crashed (notes §5.3). Raw rt_sigaction: musl's sigaction refuses them. */
struct cuda_ksigaction { void *handler; unsigned long flags; void *restorer; uint64_t mask; };

static void cuda_musl_signals(struct cuda_ksigaction saved[3], int restore)
{
    for (int s = 32; s <= 34; s++) {
        if (!restore) syscall(SYS_rt_sigaction, s, NULL, &saved[s - 32], 8);
        else if (saved[s - 32].handler) syscall(SYS_rt_sigaction, s, &saved[s - 32], NULL, 8);
    }
}

/* Where libcuda.so.1 lives (notes §6), after COLI_LIBCUDA: glibc's own search first. The
 * forward-compatibility driver and the toolkit's stub are deliberately not searched. */
static const char *const cuda_lib_paths[] = {
    "libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1",
    "/usr/local/nvidia/lib64/libcuda.so.1", "/usr/lib/wsl/lib/libcuda.so.1",
    "/run/opengl-driver/lib/libcuda.so.1", "/usr/lib/libcuda.so.1",
};

/* Resolves every entry point of LIB into cuda_api; returns the first required one missing. */
static const char *cuda_resolve(void *lib)
{
#define CUDA_RESOLVE(field, sym, required) \
    *(void **)&cuda_api.field = cuda_dlsym(lib, sym); \
    if (required && !cuda_api.field) return sym;
    CUDA_API(CUDA_RESOLVE)
#undef CUDA_RESOLVE
    return NULL;
}

/* Opens the driver library PATH and runs cuInit. Returns 0; 1 to keep searching (not there,
 * or the stub: error 34); -1 to stop. WHY says what happened. */
static int cuda_try_driver(const char *path, char *why, size_t cap)
{
    char err[256], name[96];
    struct cuda_ksigaction sig[3];
    cuda_musl_signals(sig, 0);
    void *lib = cuda_dlopen(path);
    cuda_musl_signals(sig, 1);
    if (!lib) {
        cuda_dlerror(err, sizeof err);
        snprintf(why, cap, "cannot load %s: %s", path, err);
        return 1;
    }
    const char *missing = cuda_resolve(lib);
    if (missing) return snprintf(why, cap, "%s lacks %s: not a CUDA driver", path, missing), 1;
    cuda_result r = cuda_init(0);
    if (r == CUDA_SUCCESS) return 0;
    snprintf(why, cap, "%s: cuInit: %s", path, cuda_error_name(r, name, sizeof name));
    return r == CUDA_ERROR_STUB_LIBRARY ? 1 : -1;
}

/* Loads and initialises the driver: COLI_LIBCUDA alone when set, else the standard places.
 * Returns 0, or -1 with WHY (the most telling failure: a stub beats "not found"). */
static int cuda_load_driver(char *why, size_t cap)
{
    const char *named = getenv("COLI_LIBCUDA");
    char first[384] = "", msg[384];
    int stub = 0;
    if (named && *named) {
        int r = cuda_try_driver(named, why, cap);
        return r == 0 ? 0 : -1;
    }
    for (size_t i = 0; i < sizeof cuda_lib_paths / sizeof *cuda_lib_paths; i++) {
        int r = cuda_try_driver(cuda_lib_paths[i], msg, sizeof msg);
        if (r == 0) return 0;
        if (r < 0) return snprintf(why, cap, "%s", msg), -1;
        if (!first[0] || (!stub && strstr(msg, "(error 34)"))) snprintf(first, sizeof first, "%s", msg);
        stub |= strstr(msg, "(error 34)") != NULL;
    }
    if (stub) snprintf(why, cap, "%s", first);
    else snprintf(why, cap, "no libcuda.so.1 (the NVIDIA driver) found: %s", first);
    return -1;
}

/* ---- devices ---- */

/* The GPU kernels, PTX text assembled at build time into the binary, NUL-terminated because
 * cuModuleLoadDataEx reads PTX as a C string. */
__asm__(".section .rodata\n.balign 64\ncuda_ptx:\n.incbin \"kernels.ptx\"\n.byte 0\n.previous");
extern const char cuda_ptx[]; /* a local asm label of this file */

#define CUDA_MAX_DEVICES 16
#define CUDA_WARPS 4 /* warps (rows) per block of a GEMV launch */
#define CUDA_NEXT_MAX 4 /* a mixer's input projections: q, k, v; or qkv, z, beta, alpha */

/* The window and its graphs ("graphs" below). A kernel's parameters: FN's count N, and a bit of
 * WIDE for each 8 bytes wide (.u64; the others .u32 or .f32), from its .entry in the PTX. */
#define CUDA_PARAMS_MAX 16
struct cuda_signature { cuda_handle fn; int n; uint32_t wide; };
#define CUDA_SIGNATURES 256 /* a device's table of them by handle: over twice kernels.ptx's entries */

/* A launch: its kernel (SIG.fn), grid, block, and its parameters' values, each in an 8-byte slot
 * of the list's SLOTS from slot AT on. */
struct cuda_launch_record { struct cuda_signature sig; unsigned gx, gy, bx; size_t at; };

/* A list of launches (the window, a graph's): HASH covers each one's kernel, grid and values. */
struct cuda_launches {
    struct cuda_launch_record *rec;
    uint64_t *slots;
    int n, cap;
    size_t used, slots_cap;
    uint64_t hash;
};

/* A window seen on a device: its HASH and its N launches; EXEC once it is a graph, its launches
 * then in LIST; LAST: when it was last seen (cuda.clock). */
struct cuda_graph { uint64_t hash; int n; cuda_handle exec; struct cuda_launches list; long last; };
#define CUDA_GRAPHS 256     /* windows a device remembers: a token of a split model makes ~3 a layer */
#define CUDA_GRAPH_MIN 3    /* launches a window needs to become a graph */

struct cuda_device {
    cuda_device_id id;
    char name[128];
    int cc_major, cc_minor, sms, pci_domain, pci_bus, pci_dev;
    size_t vram_total, vram_free;
    int selected, usable;
    cuda_handle ctx, module;
    cuda_handle matvec[GGUF_TYPE_COUNT]; /* the kernel matvec_<type>, NULL where none */
    cuda_handle moe_gate_up[GGUF_TYPE_COUNT], moe_down[GGUF_TYPE_COUNT];
    cuda_handle quantize[3];             /* by enum quant_act_kind */
    cuda_handle moe_route, moe_combine, residual_norm; /* the rest of a layer (cuda_moe_layer_start) */
    cuda_handle deltanet_conv, deltanet_rule, deltanet_gate; /* a DeltaNet mixer there (cuda_deltanet_launch) */
    cuda_handle attn_prep, attn_split, attn_merge; /* an attention mixer there (cuda_attention_launch) */
    struct cuda_signature sig[CUDA_SIGNATURES]; /* its kernels' parameters, by handle */
    struct cuda_graph *graphs;           /* CUDA_GRAPHS windows seen, some built into graphs */
    int64_t budget, used;                /* bytes for resident weights, and those taken */
    cuda_ptr act, y;                     /* launch scratch: prepared activations, outputs */
    size_t act_cap, y_cap;
    cuda_ptr moe;                        /* expert batch scratch (cuda_moe_start) */
    size_t moe_cap, moe_out, moe_bytes;  /* its size; where the batch in flight left its outputs, their bytes */
    int moe_jobs;                        /* the batch in flight: its jobs; 0 none */
    cuda_ptr moe_prev;                   /* the layer scratch before: a chain's kept layer's outputs */
    size_t moe_prev_cap;
    cuda_ptr kept_x, kept_next[CUDA_NEXT_MAX]; /* where the kept layer left the hidden state and the next projections */
    cuda_ptr chain;                      /* a pass's chains: the tokens' state addresses, the ids, the layers' blocks */
    size_t chain_cap;
    int64_t states;                      /* bytes of sequences' states and KV caches held here (cuda_state_alloc) */
    cuda_handle copy_stream, copy_done;  /* background uploads (cuda_expert_upload_start) */
    uint8_t *copy_stage;                 /* their pinned staging */
    size_t copy_cap;
    int copying;                         /* an upload is under way */
};

/* An allocation holding weights on a device. For a trunk matrix, HOST is its weights in the
 * mapping and the products over it run there; an expert's has HOST NULL (§6 keeps where it is). */
struct cuda_resident { const uint8_t *host; int dev; cuda_ptr ptr; size_t bytes; };

static struct {
    int started, ready;        /* cuda_start ran; some device can compute */
    char why[512];             /* why there is no GPU path (when !ready) */
    int driver_version, n_devices, current;
    struct cuda_device dev[CUDA_MAX_DEVICES]; /* PCI bus order */
    struct cuda_resident *res, *experts; /* trunk matrices (searched per product); experts */
    int n_res, cap_res, n_experts, cap_experts;
    double call_us;            /* measured cost of one wrapped driver call */
    long waits;                /* driver calls that wait for the device (the downloads); cuda_calls
                                * counts them all */
    struct cuda_launches window; /* the launches since the last other call (graphs) */
    int made, following;       /* the window's first MADE launches are made; the rest are held,
                                * following the graphs of FOLLOW, whose launches they are so far */
    uint64_t follow[CUDA_GRAPHS / 64];
    int graphs;                /* windows that repeat become graphs: the driver has them, and
                                * COLI_CUDA_GRAPHS is not 0 */
    long clock, graph_runs;    /* windows ended; those run as one graph */
    long products, batches, jobs; /* trunk GEMVs and expert batches run on devices, the batches' jobs */
    uint8_t *stage;            /* host staging: an expert batch's upload, a product batch's download */
    size_t stage_cap;
    int stage_pinned;          /* the driver allocated it (cuda_stage) */
} cuda;

/* ---- graphs: a token's launches in one call ----
 * Every launch is recorded in the window (the launches since the last other driver call) with
 * its parameters' values. A window of CUDA_GRAPH_MIN launches or more that repeats one seen on
 * the device (the same kernels, grids and values: every address a kernel reads or writes) is
 * built into a CUDA graph, a node a launch, each after the one before. From then on a window
 * that follows a graph's launches holds them back, and at its end (the next other driver call,
 * or cuda_window_end where the CPU works meanwhile) the graph runs in one call; a launch that
 * departs from it is made, with those held, one by one as before. So which kernels run, in
 * which order, over which bytes, is the same either way, and so are the results: only the
 * driver calls change. A decoded token whose layers are all chained on one device is one window
 * (its upload before, its download after): from the third such token, one graph launch instead
 * of ~870.
 * Why built from recorded launches and not captured from a stream: a window is known to repeat
 * only once it has run, and capture needs a stream of its own where every copy and launch of
 * coli uses the legacy one, whose order is what makes a download wait for the kernels before it.
 * Why compare every value: positions, lengths, expert ids and states' addresses live in device
 * memory, so a decode step's launches repeat exactly; whatever does change (a scratch that grew,
 * another number of tokens) is a window of its own, never a stale graph. */

/* *SIG = kernel NAME's parameters, read from its `.entry NAME(` in the embedded PTX (a line
 * `.param .u64 NAME_param_0,` each). Returns 0, or -1 where there is no such entry or a
 * parameter of another kind. */
static int cuda_signature_read(const char *name, struct cuda_signature *sig)
{
    char head[80];
    snprintf(head, sizeof head, ".entry %s(", name);
    const char *p = strstr(cuda_ptx, head);
    if (!p) return -1;
    p += strlen(head);
    sig->n = 0;
    sig->wide = 0;
    for (;;) {
        p += strspn(p, " \t\r\n");
        if (*p == ')') return 0;
        if (sig->n == CUDA_PARAMS_MAX || strncmp(p, ".param .", 8)) return -1;
        p += 8;
        if (!strncmp(p, "u64 ", 4)) sig->wide |= 1u << sig->n;
        else if (strncmp(p, "u32 ", 4) && strncmp(p, "f32 ", 4)) return -1;
        sig->n++;
        p = strpbrk(p, ",)");
        if (!p) return -1;
        p += *p == ',';
    }
}

/* Device D's slot for kernel FN's signature: its own, or the empty one where it would go. */
static struct cuda_signature *cuda_signature_of(struct cuda_device *d, cuda_handle fn)
{
    size_t i = (size_t)((uintptr_t)fn >> 4) % CUDA_SIGNATURES;
    while (d->sig[i].fn && d->sig[i].fn != fn) i = (i + 1) % CUDA_SIGNATURES;
    return &d->sig[i];
}

static void cuda_window_reset(void)
{
    cuda.window.n = 0;
    cuda.window.used = 0;
    cuda.window.hash = 14695981039346656037ull; /* FNV-1a's offset basis */
    cuda.made = 0;
    cuda.following = 0;
}

static void cuda_launches_free(struct cuda_launches *l)
{
    free(l->rec);
    free(l->slots);
    *l = (struct cuda_launches){0};
}

/* Appends the launch of SIG's kernel over GX x GY blocks of BX threads with PARAMS to W. */
static void cuda_record(struct cuda_launches *w, const struct cuda_signature *sig, unsigned gx, unsigned gy, unsigned bx, void **params)
{
    if (w->n == w->cap) {
        w->cap = w->cap ? 2 * w->cap : 256;
        w->rec = plat_realloc(w->rec, (size_t)w->cap * sizeof *w->rec);
    }
    if (w->used + CUDA_PARAMS_MAX > w->slots_cap) {
        w->slots_cap = w->slots_cap ? 2 * w->slots_cap : 4096;
        w->slots = plat_realloc(w->slots, w->slots_cap * sizeof *w->slots);
    }
    w->rec[w->n++] = (struct cuda_launch_record){*sig, gx, gy, bx, w->used};
    uint64_t head[4] = {(uint64_t)(uintptr_t)sig->fn, gx, gy, bx}, *v = w->slots + w->used;
    for (int i = 0; i < sig->n; i++) {
        v[i] = 0;
        memcpy(&v[i], params[i], sig->wide >> i & 1 ? 8 : 4);
    }
    w->used += (size_t)sig->n;
    for (int i = 0; i < 4 + sig->n; i++) w->hash = (w->hash ^ (i < 4 ? head[i] : v[i - 4])) * 1099511628211ull; /* FNV-1a, a word a step */
}

/* Launch I of A and launch J of B: the same kernel, grid and values. */
static int cuda_record_same(const struct cuda_launches *a, int i, const struct cuda_launches *b, int j)
{
    const struct cuda_launch_record *x = &a->rec[i], *y = &b->rec[j];
    return x->sig.fn == y->sig.fn && x->gx == y->gx && x->gy == y->gy && x->bx == y->bx &&
           !memcmp(a->slots + x->at, b->slots + y->at, (size_t)x->sig.n * 8);
}

/* PARAMS[k] = where launch I of L keeps its k-th value, as cuLaunchKernel takes them. */
static void cuda_record_params(const struct cuda_launches *l, int i, void **params)
{
    for (int k = 0; k < l->rec[i].sig.n; k++) params[k] = &l->slots[l->rec[i].at + (size_t)k];
}

/* Makes the window's launches not made yet, one by one. The driver's result. */
static cuda_result cuda_window_make(void)
{
    cuda_result r = CUDA_SUCCESS;
    for (; cuda.made < cuda.window.n && !r; cuda.made++) {
        const struct cuda_launch_record *x = &cuda.window.rec[cuda.made];
        void *params[CUDA_PARAMS_MAX];
        cuda_record_params(&cuda.window, cuda.made, params);
        r = cuda_launch_now(x->sig.fn, x->gx, x->gy, x->bx, params);
    }
    cuda.made = cuda.window.n;
    return r;
}

/* Narrows the graphs of device D the window follows to those whose launch I is its own (at
 * I 0, from all of them: windows of different layers may begin alike). Returns whether any
 * is left. */
static int cuda_window_follow(const struct cuda_device *d, int i)
{
    int left = 0;
    for (int w = 0; w < CUDA_GRAPHS / 64; w++) {
        uint64_t kept = 0;
        for (uint64_t m = i == 0 ? ~0ull : cuda.follow[w]; m; m &= m - 1) {
            const int k = 64 * w + __builtin_ctzll(m);
            const struct cuda_graph *g = &d->graphs[k];
            if (g->exec && i < g->n && cuda_record_same(&g->list, i, &cuda.window, i)) kept |= m & -m;
        }
        cuda.follow[w] = kept;
        left |= kept != 0;
    }
    return left;
}

/* The graph of device D the window has followed to its end: -1 none. */
static int cuda_window_graph(const struct cuda_device *d)
{
    for (int w = 0; cuda.following && w < CUDA_GRAPHS / 64; w++)
        for (uint64_t m = cuda.follow[w]; m; m &= m - 1)
            if (d->graphs[64 * w + __builtin_ctzll(m)].n == cuda.window.n) return 64 * w + __builtin_ctzll(m);
    return -1;
}

/* Launches FN over a grid of GX x GY blocks of BX threads with PARAMS on the current device:
 * recorded in the window, then held while the window follows a graph, else made now (with
 * any held before it). The driver's result (a held launch's: at the window's end). */
static cuda_result cuda_launch(cuda_handle fn, unsigned gx, unsigned gy, unsigned bx, void **params)
{
    if (!cuda.graphs) return cuda_launch_now(fn, gx, gy, bx, params); /* nothing to learn: no record */
    struct cuda_device *d = &cuda.dev[cuda.current];
    const int i = cuda.window.n;
    cuda_record(&cuda.window, cuda_signature_of(d, fn), gx, gy, bx, params);
    if (i == 0) cuda.following = d->graphs != NULL;
    if (cuda.following && cuda_window_follow(d, i)) return CUDA_SUCCESS;
    cuda.following = 0;
    return cuda_window_make();
}

/* Builds G's launches into a graph: a kernel node each, after the one before. Returns the
 * driver's result (G->exec NULL where it failed). */
static cuda_result cuda_graph_build(struct cuda_graph *g)
{
    cuda_handle graph = NULL, node = NULL;
    cuda_result r = cuda_graph_create(&graph);
    for (int i = 0; i < g->list.n && !r; i++) {
        const struct cuda_launch_record *x = &g->list.rec[i];
        void *params[CUDA_PARAMS_MAX];
        cuda_record_params(&g->list, i, params);
        const struct cuda_kernel_node k = {x->sig.fn, x->gx, x->gy, 1, x->bx, 1, 1, 0, params, NULL};
        const cuda_handle after = node;
        r = cuda_graph_add_kernel(&node, graph, &after, &k);
    }
    g->exec = NULL;
    if (!r) r = cuda_graph_instantiate(&g->exec, graph);
    if (r) g->exec = NULL;
    if (graph) cuda_graph_destroy(graph);
    return r;
}

/* After the window's launches were made one by one on device D: where it repeats a window seen
 * there, it becomes a graph (its launches kept); else it is remembered in place of the window
 * seen longest ago. A graph that cannot be built ends graphs, in one line. */
static void cuda_window_learn(struct cuda_device *d)
{
    struct cuda_launches *w = &cuda.window;
    if (!cuda.graphs || w->n < CUDA_GRAPH_MIN || (!d->graphs && !(d->graphs = calloc(CUDA_GRAPHS, sizeof *d->graphs)))) return;
    int oldest = 0;
    for (int k = 0; k < CUDA_GRAPHS; k++) {
        struct cuda_graph *g = &d->graphs[k];
        if (g->n == w->n && g->hash == w->hash) {
            g->last = cuda.clock;
            if (g->exec) return;
            const struct cuda_launches spare = g->list;
            g->list = *w;
            *w = spare; /* the window's buffers to be, emptied by cuda_window_reset */
            char e[160];
            cuda_result r = cuda_graph_build(g);
            if (r) {
                cuda.graphs = 0;
                plat_log("[cuda] a graph of %d launches could not be built: %s; launches made one by one from here", g->n,
                         cuda_error_name(r, e, sizeof e));
            }
            return;
        }
        if (g->last < d->graphs[oldest].last) oldest = k;
    }
    struct cuda_graph *g = &d->graphs[oldest];
    if (g->exec) cuda_graph_exec_destroy(g->exec);
    *g = (struct cuda_graph){w->hash, w->n, NULL, g->list, cuda.clock};
}

/* Ends the window: a window that followed a graph to its end runs as that graph; else its
 * launches not made yet are made, and the window is learnt. The driver's result. */
static cuda_result cuda_window_end(void)
{
    if (!cuda.window.n) return CUDA_SUCCESS;
    struct cuda_device *d = &cuda.dev[cuda.current];
    const int k = cuda_window_graph(d);
    cuda_result r;
    cuda.clock++;
    if (k >= 0) {
        d->graphs[k].last = cuda.clock;
        r = cuda_graph_launch(d->graphs[k].exec);
        cuda.graph_runs++;
    } else if (!(r = cuda_window_make())) {
        cuda_window_learn(d);
    }
    cuda_window_reset();
    return r;
}

/* Whether graphs are built (the driver has them, COLI_CUDA_GRAPHS is not 0), said in a line
 * where the driver lacks them. */
static int cuda_graphs_on(void)
{
    const char *env = getenv("COLI_CUDA_GRAPHS");
    if (env && !strcmp(env, "0")) return 0;
    if (cuda_api.graph_create && cuda_api.graph_add_kernel && cuda_api.graph_instantiate && cuda_api.graph_launch &&
        cuda_api.graph_destroy && cuda_api.graph_exec_destroy)
        return 1;
    plat_log("[cuda] this driver has no CUDA graphs: a token's launches are made one by one (a driver of CUDA 11.4 or later has them)");
    return 0;
}

/* Frees device D's graphs: the driver's too where its context is current (IN_CONTEXT; else they
 * go with the context). */
static void cuda_graphs_free(struct cuda_device *d, int in_context)
{
    if (in_context) cuda_window_end(); /* what the window holds may follow them */
    for (int k = 0; d->graphs && k < CUDA_GRAPHS; k++) {
        if (d->graphs[k].exec && in_context) cuda_graph_exec_destroy(d->graphs[k].exec);
        cuda_launches_free(&d->graphs[k].list);
    }
    free(d->graphs);
    d->graphs = NULL;
}

static int cuda_pci_order(const void *a, const void *b)
{
    const struct cuda_device *x = a, *y = b;
    if (x->pci_domain != y->pci_domain) return x->pci_domain < y->pci_domain ? -1 : 1;
    if (x->pci_bus != y->pci_bus) return x->pci_bus < y->pci_bus ? -1 : 1;
    return (x->pci_dev > y->pci_dev) - (x->pci_dev < y->pci_dev);
}

/* Fills cuda.dev in PCI bus order, so that --gpu 1 names the same card everywhere whatever
 * CUDA_DEVICE_ORDER the driver uses. Returns the count; 0 with WHY when there is none. */
static int cuda_enumerate(char *why, size_t cap)
{
    int n = 0;
    char e[160];
    cuda_result r = cuda_device_count(&n);
    if (r != CUDA_SUCCESS) return snprintf(why, cap, "cuDeviceGetCount: %s", cuda_error_name(r, e, sizeof e)), 0;
    if (n <= 0) return snprintf(why, cap, "no CUDA device (driver %d.%d)", cuda.driver_version / 1000, cuda.driver_version % 1000 / 10), 0;
    if (n > CUDA_MAX_DEVICES) n = CUDA_MAX_DEVICES;
    for (int i = 0; i < n; i++) {
        struct cuda_device *d = &cuda.dev[i];
        memset(d, 0, sizeof *d);
        if (cuda_device_get(&d->id, i) || cuda_device_name(d->name, sizeof d->name - 1, d->id) || cuda_device_mem(&d->vram_total, d->id))
            return snprintf(why, cap, "cannot query device %d", i), 0;
        cuda_device_attr(&d->cc_major, CUDA_ATTR_CC_MAJOR, d->id);
        cuda_device_attr(&d->cc_minor, CUDA_ATTR_CC_MINOR, d->id);
        cuda_device_attr(&d->sms, CUDA_ATTR_SM_COUNT, d->id);
        cuda_device_attr(&d->pci_domain, CUDA_ATTR_PCI_DOMAIN, d->id);
        cuda_device_attr(&d->pci_bus, CUDA_ATTR_PCI_BUS, d->id);
        cuda_device_attr(&d->pci_dev, CUDA_ATTR_PCI_DEVICE, d->id);
    }
    qsort(cuda.dev, (size_t)n, sizeof cuda.dev[0], cuda_pci_order);
    return n;
}

/* Makes device I current (one driver call when it changes). */
static int cuda_use(int i)
{
    if (cuda.current == i) return 0;
    if (cuda_ctx_set(cuda.dev[i].ctx)) return -1;
    cuda.current = i;
    return 0;
}

/* The first line of the JIT log LOG, for a one-line message. */
static const char *cuda_first_line(char *log)
{
    char *nl = strchr(log, '\n');
    if (nl) *nl = 0;
    return log[0] ? log : "no log";
}

/* *FN = the kernel PREFIX + TYPE (lower case) of D's module, with its signature; NULL where it
 * has none. */
static void cuda_kernel(struct cuda_device *d, const char *prefix, const char *type, cuda_handle *fn)
{
    char name[64];
    struct cuda_signature sig;
    snprintf(name, sizeof name, "%s%s", prefix, type);
    for (char *p = name; *p; p++) *p = (char)tolower((unsigned char)*p);
    if (cuda_signature_read(name, &sig) || cuda_module_function(fn, d->module, name)) {
        *fn = NULL;
        return;
    }
    sig.fn = *fn;
    *cuda_signature_of(d, *fn) = sig;
}

/* Retains device I's primary context, reads its free memory, JIT-compiles the embedded PTX
 * and finds the kernels. Returns 0, or -1 with WHY. */
static int cuda_open_device(int i, char *why, size_t cap)
{
    struct cuda_device *d = &cuda.dev[i];
    char e[160], info[2048] = "", err[2048] = "";
    cuda_result r = cuda_ctx_retain(&d->ctx, d->id);
    if (r) return snprintf(why, cap, "cuda %d: no context: %s", i, cuda_error_name(r, e, sizeof e)), -1;
    cuda.current = -1;
    if ((r = cuda_use(i)) || (r = cuda_mem_info(&d->vram_free, &d->vram_total)))
        return snprintf(why, cap, "cuda %d: cannot use the context", i), -1;
    int opts[4] = {CUDA_JIT_INFO_LOG, CUDA_JIT_INFO_LOG_SIZE, CUDA_JIT_ERROR_LOG, CUDA_JIT_ERROR_LOG_SIZE};
    void *vals[4] = {info, (void *)(uintptr_t)(sizeof info - 1), err, (void *)(uintptr_t)(sizeof err - 1)};
    r = cuda_module_load(&d->module, cuda_ptx, 4, opts, vals);
    if (r) return snprintf(why, cap, "cuda %d: loading kernels.ptx: %s: %.200s", i, cuda_error_name(r, e, sizeof e), cuda_first_line(err)), -1;
    for (int t = 0; t < GGUF_TYPE_COUNT; t++) {
        if (!gguf_types[t].computes) continue;
        cuda_kernel(d, "matvec_", gguf_types[t].name, &d->matvec[t]);
        cuda_kernel(d, "moe_gate_up_", gguf_types[t].name, &d->moe_gate_up[t]);
        cuda_kernel(d, "moe_down_", gguf_types[t].name, &d->moe_down[t]);
    }
    cuda_kernel(d, "quantize_", "float", &d->quantize[QUANT_ACT_FLOAT]);
    cuda_kernel(d, "quantize_", "q8", &d->quantize[QUANT_ACT_Q8]);
    cuda_kernel(d, "quantize_", "q8k", &d->quantize[QUANT_ACT_Q8K]);
    cuda_kernel(d, "moe_", "route", &d->moe_route);
    cuda_kernel(d, "moe_", "combine", &d->moe_combine);
    cuda_kernel(d, "residual_", "norm", &d->residual_norm);
    cuda_kernel(d, "deltanet_", "conv", &d->deltanet_conv);
    cuda_kernel(d, "deltanet_", "rule", &d->deltanet_rule);
    cuda_kernel(d, "deltanet_", "gate", &d->deltanet_gate);
    cuda_kernel(d, "attn_", "prep", &d->attn_prep);
    cuda_kernel(d, "attn_", "split", &d->attn_split);
    cuda_kernel(d, "attn_", "merge", &d->attn_merge);
    d->usable = 1;
    return 0;
}

/* Marks the devices LIST selects ("all", or indices in PCI order such as "0,2"). Returns 0,
 * or -1 with WHY naming a bad entry. */
static int cuda_select(const char *list, char *why, size_t cap)
{
    if (!list || !strcmp(list, "all") || !*list) {
        for (int i = 0; i < cuda.n_devices; i++) cuda.dev[i].selected = 1;
        return 0;
    }
    for (const char *p = list; *p;) {
        char *end;
        long i = strtol(p, &end, 10);
        if (end == p || (*end && *end != ',')) return snprintf(why, cap, "--gpu %s: not a list of device numbers", list), -1;
        if (i < 0 || i >= cuda.n_devices)
            return snprintf(why, cap, "--gpu %s: there is no device %ld (%d found)", list, i, cuda.n_devices), -1;
        cuda.dev[i].selected = 1;
        p = *end ? end + 1 : end;
    }
    return 0;
}

/* Time of one wrapped call (cuDriverGetVersion: the driver does almost nothing), in µs. */
static double cuda_measure_call(void)
{
    int v, n = 2000;
    double t0 = plat_now();
    for (int i = 0; i < n; i++) cuda_driver_version(&v);
    return (plat_now() - t0) / n * 1e6;
}

static void cuda_stop(void);

/* Starts the GPU path: loader, driver, devices (LIST as --gpu), contexts, kernels. VRAM_BYTES
 * (-1: free memory less a reserve) caps each device's budget for resident weights. Main thread
 * only, before any other thread exists (notes §7.2). Every failure is one [cuda] line; cuda.ready
 * says whether a device can compute. */
/* VERBOSE: also say that there is no driver at all (on a machine without an NVIDIA card that is
 * not news; info and plan say it in their own lines). */
static void cuda_start(const char *list, int64_t vram_bytes, int verbose)
{
    char why[512] = "";
    const char *env = getenv("COLI_CUDA");
    cuda.started = 1;
    cuda.current = -1;
    cuda_window_reset();
    if ((list && !strcmp(list, "off")) || (env && !strcmp(env, "0"))) {
        snprintf(cuda.why, sizeof cuda.why, "off (%s)", list && !strcmp(list, "off") ? "--gpu off" : "COLI_CUDA=0");
        return;
    }
    if (cuda_dl_start(why, sizeof why) || cuda_load_driver(why, sizeof why) || cuda_driver_version(&cuda.driver_version) ||
        (cuda.n_devices = cuda_enumerate(why, sizeof why)) == 0 || cuda_select(list, why, sizeof why)) {
        snprintf(cuda.why, sizeof cuda.why, "%s", why[0] ? why : "cuDriverGetVersion failed");
        int absent = !strncmp(cuda.why, "no glibc loader", 15) || !strncmp(cuda.why, "no libcuda.so.1", 15);
        if (verbose || !absent) plat_log("[cuda] %s; running on the CPU", cuda.why);
        return;
    }
    cuda.call_us = cuda_measure_call();
    atexit(cuda_stop);
    for (int i = 0; i < cuda.n_devices; i++) {
        struct cuda_device *d = &cuda.dev[i];
        if (!d->selected) continue;
        if (cuda_open_device(i, why, sizeof why)) {
            plat_log("[cuda] %s; device %d stays unused", why, i);
            snprintf(cuda.why, sizeof cuda.why, "%s", why);
            continue;
        }
        /* keep room for the context, the JIT's code and the launch scratch */
        int64_t reserve = (int64_t)d->vram_total / 16 > (256 << 20) ? (int64_t)d->vram_total / 16 : (256 << 20);
        d->budget = (int64_t)d->vram_free > reserve ? (int64_t)d->vram_free - reserve : 0;
        if (vram_bytes >= 0 && vram_bytes < d->budget) d->budget = vram_bytes;
        cuda.ready = 1;
    }
    cuda.graphs = cuda.ready && cuda_graphs_on();
    cuda_calls = 0; /* from here, the work's */
}

/* Frees every resident matrix: residency is keyed by the host address of the weights, so it
 * must end before that memory is unmapped or reused. */
static void cuda_release_all(void)
{
    if (cuda.products || cuda.batches)
        plat_log("[cuda] %ld products and %ld expert batches (%ld experts' FFNs) ran on the device%s, %ld driver calls, %ld waits, %ld graph launches",
                 cuda.products, cuda.batches, cuda.jobs, cuda.n_devices > 1 ? "s" : "", cuda_calls, cuda.waits, cuda.graph_runs);
    cuda_calls = cuda.waits = cuda.products = cuda.batches = cuda.jobs = cuda.graph_runs = 0;
    for (int k = 0; k < cuda.n_res; k++)
        if (cuda_use(cuda.res[k].dev) == 0) cuda_mem_free(cuda.res[k].ptr);
    for (int k = 0; k < cuda.n_experts; k++)
        if (cuda_use(cuda.experts[k].dev) == 0) cuda_mem_free(cuda.experts[k].ptr);
    for (int i = 0; i < cuda.n_devices; i++) {
        if (cuda.dev[i].graphs) cuda_graphs_free(&cuda.dev[i], cuda_use(i) == 0); /* they name the weights' addresses */
        cuda.dev[i].used = cuda.dev[i].copying = 0;
    }
    cuda.n_res = cuda.n_experts = 0;
    ops_offload = NULL;
}

/* Frees the host staging buffer (cuda_stage), pinned or not. */
static void cuda_stage_free(void)
{
    if (cuda.stage_pinned) cuda_host_free(cuda.stage);
    else free(cuda.stage);
    cuda.stage = NULL;
    cuda.stage_cap = 0;
    cuda.stage_pinned = 0;
}

/* Gives the contexts back: glibc's and libcuda's destructors never run in this process
 * (notes §5.5). */
static void cuda_stop(void)
{
    cuda_release_all();
    for (int i = 0; i < cuda.n_devices; i++) {
        if (cuda.dev[i].copy_stage && cuda_use(i) == 0) cuda_host_free(cuda.dev[i].copy_stage);
        cuda.dev[i].copy_stage = NULL;
        cuda.dev[i].copy_cap = 0;
    }
    free(cuda.res);
    free(cuda.experts);
    cuda_stage_free();
    cuda.res = cuda.experts = NULL;
    cuda.cap_res = cuda.cap_experts = 0;
    for (int i = 0; i < cuda.n_devices; i++) {
        struct cuda_device *d = &cuda.dev[i];
        if (!d->ctx) continue;
        const int in_context = cuda_use(i) == 0;
        cuda_graphs_free(d, in_context);
        if (in_context) {
            if (d->act) cuda_mem_free(d->act);
            if (d->y) cuda_mem_free(d->y);
            if (d->moe) cuda_mem_free(d->moe);
            if (d->moe_prev) cuda_mem_free(d->moe_prev);
            if (d->chain) cuda_mem_free(d->chain);
            if (d->module) cuda_module_unload(d->module);
        }
        cuda_ctx_release(d->id);
        d->ctx = NULL;
        d->act = d->y = d->moe = d->moe_prev = d->chain = 0;
        d->act_cap = d->y_cap = d->moe_cap = d->moe_prev_cap = d->chain_cap = 0;
    }
    cuda_launches_free(&cuda.window);
    cuda.ready = 0;
}

/* What to do about WHY, the reason the GPU path does not run (cuda.why): coli info's doctor. */
static const char *cuda_advice(const char *why)
{
    static const char jit[] = "the driver cannot JIT-compile coli's PTX (ISA 6.0, sm_52 and up): update the NVIDIA driver";
    static const struct { const char *says, *advice; } table[] = {
        {"off (", "as asked: drop --gpu off / COLI_CUDA=0 to use a card"},
        {"no glibc loader", "the NVIDIA driver is a glibc library: run coli on the host, or in the GPU image "
                            "(docker build --target gpu; a FROM scratch image cannot load it)"},
        {"no libcuda.so.1", "install the NVIDIA driver (nvidia-smi should list the card); in a container, run it with "
                            "--gpus all and NVIDIA_DRIVER_CAPABILITIES=compute,utility; COLI_LIBCUDA=PATH names the library"},
        {"(error 34)", "that libcuda.so.1 is the CUDA toolkit's stub (a .../stubs directory comes first on the library "
                       "path): take that directory out of LD_LIBRARY_PATH, or set COLI_LIBCUDA to the driver's libcuda.so.1"},
        {"(error 100)", "the driver sees no device: check nvidia-smi, CUDA_VISIBLE_DEVICES and, in a container, --gpus"},
        {"(error 35)", "the driver is too old: update the NVIDIA driver"},
        {"(error 218)", jit}, {"(error 221)", jit}, {"(error 222)", jit},
        {"--gpu", "name devices that exist (coli info lists them in PCI bus order)"},
    };
    for (size_t i = 0; i < sizeof table / sizeof *table; i++)
        if (strstr(why, table[i].says)) return table[i].advice;
    return "coli info -v and the [cuda] lines of a run say more; the CPU path gives the same tokens";
}

/* coli info's lines: the driver and each device in PCI bus order, or why there is none and
 * what to do about it. */
static void cuda_print_info(void)
{
    if (!cuda.n_devices) {
        printf("cuda: none: %s\ncuda: to use a card: %s\n", cuda.why, cuda_advice(cuda.why));
        return;
    }
    printf("cuda: driver %d.%d, %d device%s, one wrapped driver call %.2f us, %s\n", cuda.driver_version / 1000,
           cuda.driver_version % 1000 / 10, cuda.n_devices, cuda.n_devices > 1 ? "s" : "", cuda.call_us,
           cuda.graphs ? "a token's launches as CUDA graphs" : "launches one by one (no CUDA graphs)");
    if (!cuda.ready) printf("cuda: no usable device: %s\ncuda: to use a card: %s\n", cuda.why, cuda_advice(cuda.why));
    for (int i = 0; i < cuda.n_devices; i++) {
        const struct cuda_device *d = &cuda.dev[i];
        printf("cuda %d: %s, compute %d.%d, %d SMs, %.1f GiB VRAM", i, d->name, d->cc_major, d->cc_minor, d->sms,
               d->vram_total / 1073741824.0);
        if (d->usable) printf(", %.1f GiB free", d->vram_free / 1073741824.0);
        printf(", PCI %04x:%02x:%02x.0", d->pci_domain, d->pci_bus, d->pci_dev);
        printf("%s\n", d->usable ? "" : d->selected ? " (unusable)" : " (not selected)");
    }
}

/* ---- resident weights and offloaded GEMVs ---- */

/* Ends the GPU path after a failure at run time (a launch, a copy): one line, then everything
 * runs on the CPU. The failed product is recomputed there, so no result changes. */
static void cuda_fail(const char *what, cuda_result r)
{
    char e[160];
    plat_log("[cuda] %s: %s; running on the CPU from here", what, cuda_error_name(r, e, sizeof e));
    ops_offload = NULL;
    cuda.ready = 0;
    cuda_window_reset(); /* what it held will not run */
    snprintf(cuda.why, sizeof cuda.why, "%s failed", what);
}

/* Grows device scratch *P (capacity *CAP) to N bytes. Returns the driver's result. */
static cuda_result cuda_scratch(cuda_ptr *p, size_t *cap, size_t n)
{
    if (n <= *cap) return CUDA_SUCCESS;
    if (*p) cuda_mem_free(*p);
    *p = 0;
    *cap = 0;
    cuda_result r = cuda_mem_alloc(p, n);
    if (r == CUDA_SUCCESS) *cap = n;
    return r;
}

/* Grows the host staging buffer to N bytes: pinned (page-locked) where the driver gives it, so
 * that a product batch's outputs and an expert batch's upload cross the bus by DMA straight
 * from it, not through the driver's own pinned bounce buffer and a second copy; else plain
 * memory, with the same results. */
static uint8_t *cuda_stage(size_t n)
{
    if (n <= cuda.stage_cap) return cuda.stage;
    void *p = NULL;
    cuda_stage_free();
    cuda.stage_pinned = cuda_api.host_alloc && cuda_api.host_free && cuda_host_alloc(&p, n) == CUDA_SUCCESS;
    cuda.stage = cuda.stage_pinned ? p : plat_alloc(n);
    cuda.stage_cap = n;
    return cuda.stage;
}

/* The device copy of the trunk matrix whose weights are at HOST, or NULL: a binary search of
 * the list (in address order, cuda_list), which a token asks ~10 times a layer. */
static const struct cuda_resident *cuda_resident_of(const uint8_t *host)
{
    int lo = 0, hi = cuda.n_res;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if ((uintptr_t)cuda.res[mid].host < (uintptr_t)host) lo = mid + 1;
        else hi = mid;
    }
    return lo < cuda.n_res && cuda.res[lo].host == host ? &cuda.res[lo] : NULL;
}

/* Device DEV's share of a batch of §4 jobs: those in MINE[0..n), their weights at RES[j] on
 * the device, over the activations at ACT + OFF[j]. One upload of the span of activations they read, one launch of
 * matvec_<type> per job (one warp per row, lane = unit % 32, shfl butterfly: the canonical
 * order), one download of all their outputs: 2 + n driver calls. Returns 0, or -1 after
 * cuda_fail. */
static int cuda_jobs_on(int dev, const struct ops_job *jobs, const struct cuda_resident *const *res, const int *mine, int n,
                        const uint8_t *act, const size_t *off)
{
    struct cuda_device *d = &cuda.dev[dev];
    size_t lo = SIZE_MAX, hi = 0, y_bytes = 0;
    for (int i = 0; i < n; i++) {
        const struct ops_job *jb = &jobs[mine[i]];
        size_t end = off[mine[i]] + ops_act_stride(&jb->w) * (size_t)jb->n;
        lo = off[mine[i]] < lo ? off[mine[i]] : lo;
        hi = end > hi ? end : hi;
        y_bytes += (size_t)jb->n * (size_t)jb->w.rows * sizeof(float);
    }
    cuda_result r;
    if ((r = cuda_use(dev)) || (r = cuda_scratch(&d->act, &d->act_cap, hi - lo)) || (r = cuda_scratch(&d->y, &d->y_cap, y_bytes)) ||
        (r = cuda_htod(d->act, act + lo, hi - lo))) {
        cuda_fail("device scratch", r);
        return -1;
    }
    for (size_t i = 0, y_off = 0; i < (size_t)n; y_off += (size_t)jobs[mine[i]].n * (size_t)jobs[mine[i]].w.rows * sizeof(float), i++) {
        const struct ops_matrix *w = &jobs[mine[i]].w;
        cuda_ptr wp = res[mine[i]]->ptr, ap = d->act + (off[mine[i]] - lo), yp = d->y + y_off;
        uint64_t rb = w->row_bytes, st = ops_act_stride(w);
        int rows = (int)w->rows, cols = (int)w->cols, columns = jobs[mine[i]].n;
        void *params[] = {&wp, &rb, &ap, &st, &yp, &rows, &cols, &columns};
        if ((r = cuda_launch(d->matvec[w->type], (unsigned)((w->rows + CUDA_WARPS - 1) / CUDA_WARPS), 1, 32 * CUDA_WARPS, params))) {
            cuda_fail("GEMV on the device", r);
            return -1;
        }
    }
    uint8_t *y = cuda_stage(y_bytes);
    if ((r = cuda_dtoh(y, d->y, y_bytes))) {
        cuda_fail("GEMV on the device", r);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        size_t b = (size_t)jobs[mine[i]].n * (size_t)jobs[mine[i]].w.rows * sizeof(float);
        memcpy(jobs[mine[i]].y, y, b);
        y += b;
    }
    cuda.waits++;
    cuda.products += n;
    return 0;
}

/* ops_offload: runs each job whose matrix is resident on its device (cuda_jobs_on), marking
 * it in DONE; a failure leaves the rest to the CPU, which computes the same bits. */
static void cuda_jobs(const struct ops_job *jobs, int n, const uint8_t *act, const size_t *off, uint8_t *done)
{
    const struct cuda_resident *res[OPS_MAX_JOBS];
    int mine[OPS_MAX_JOBS];
    for (int j = 0; j < n; j++) res[j] = jobs[j].n > 0 ? cuda_resident_of(jobs[j].w.data) : NULL;
    for (int dev = 0; dev < cuda.n_devices && cuda.ready; dev++) {
        int k = 0;
        for (int j = 0; j < n; j++)
            if (res[j] && res[j]->dev == dev) mine[k++] = j;
        if (k && cuda_jobs_on(dev, jobs, res, mine, k, act, off) == 0)
            for (int i = 0; i < k; i++) done[mine[i]] = 1;
    }
}

static size_t cuda_align(size_t n) { return (n + 255) & ~(size_t)255; }

/* The device bytes of N parts of BYTES[i], each at a 256-byte boundary. */
static size_t cuda_span(const size_t *bytes, int n)
{
    size_t total = 0;
    for (int i = 0; i < n; i++) total += cuda_align(bytes[i]);
    return total;
}

/* Whether TOTAL more bytes fit device DEV's budget (weights, and the sequences' states there). */
static int cuda_fits(int dev, size_t total)
{
    const struct cuda_device *d = &cuda.dev[dev];
    return cuda.ready && d->usable && d->used + d->states + (int64_t)total <= d->budget;
}

/* Lists TOTAL bytes at P on device DEV as resident (HOST: the trunk matrix they hold, NULL: an
 * expert's) and charges them to its budget. */
static void cuda_list(int dev, const uint8_t *host, cuda_ptr p, size_t total)
{
    struct cuda_resident **list = host ? &cuda.res : &cuda.experts;
    int *count = host ? &cuda.n_res : &cuda.n_experts, *cap = host ? &cuda.cap_res : &cuda.cap_experts;
    if (*count == *cap) {
        *cap = *cap ? 2 * *cap : 64;
        *list = plat_realloc(*list, (size_t)*cap * sizeof **list);
    }
    int at = *count; /* the trunk's list in address order: cuda_resident_of searches it by halves */
    while (host && at > 0 && (uintptr_t)(*list)[at - 1].host > (uintptr_t)host) at--;
    memmove(&(*list)[at + 1], &(*list)[at], (size_t)(*count - at) * sizeof **list);
    (*list)[at] = (struct cuda_resident){host, dev, p, total};
    (*count)++;
    cuda.dev[dev].used += (int64_t)total;
}

/* Copies N parts (SRC[i], BYTES[i]) into one new allocation on device DEV, each at a 256-byte
 * boundary, charged to its budget, and lists it: MATVEC, as the trunk matrix SRC[0] whose
 * products run there; else as an expert's (§6 keeps where it is). Returns the device address,
 * or 0 (nothing changed) when the budget or the device's memory is short: that is not a
 * failure of the GPU path, the weights just stay on the CPU. */
static cuda_ptr cuda_upload(int dev, const uint8_t *const *src, const size_t *bytes, int n, int matvec)
{
    size_t total = cuda_span(bytes, n);
    cuda_ptr p = 0;
    if (!cuda_fits(dev, total) || cuda_use(dev) || cuda_mem_alloc(&p, total)) return 0;
    for (size_t i = 0, off = 0; i < (size_t)n; off += cuda_align(bytes[i]), i++)
        if (cuda_htod(p + off, src[i], bytes[i])) {
            cuda_mem_free(p);
            return 0;
        }
    cuda_list(dev, matvec ? src[0] : NULL, p, total);
    return p;
}

/* Copies W's weights to device DEV and makes its GEMVs run there. Returns 0, or -1 (nothing
 * changed) as cuda_upload. */
static int cuda_make_resident(const struct ops_matrix *w, int dev)
{
    size_t bytes = (size_t)w->rows * w->row_bytes;
    if (!cuda.dev[dev].matvec[w->type] || !cuda_upload(dev, &w->data, &bytes, 1, 1)) return -1;
    ops_offload = cuda_jobs;
    return 0;
}

/* The probe (§7 asks it before placing the trunk): W's product on device DEV, one column, as
 * CUDA_PROBE_REPS launches, and the round trip of its input and output (CUDA_PROBE_REPS
 * copies each way), both timed by the device's own events, not the host's clock: a thread
 * descheduled once must not decide a placement. W's weights are copied there for it and freed after.
 * Fills *KERNEL and *ROUND_TRIP (seconds per product). Returns 0, or -1 when the device cannot
 * say: a driver without events, or no memory for the copy (nothing changes); a failed launch
 * ends the GPU path as anywhere else. */
#define CUDA_PROBE_REPS 8
static int cuda_probe_product(int dev, const struct ops_matrix *w, double *kernel, double *round_trip)
{
    struct cuda_device *d = &cuda.dev[dev];
    size_t wb = (size_t)w->rows * w->row_bytes, ab = ops_act_stride(w), yb = (size_t)w->rows * sizeof(float);
    cuda_ptr wp = 0, ap = 0, yp = 0;
    cuda_handle ev[2] = {NULL, NULL};
    float ms = 0;
    if (!cuda_api.event_create || !cuda_api.event_record || !cuda_api.event_sync || !cuda_api.event_elapsed ||
        !cuda_api.event_destroy || !d->matvec[w->type] || cuda_use(dev))
        return -1;
    uint8_t *host = plat_zalloc(ab + yb, 1); /* zero activations: the time does not depend on them */
    cuda_result r = cuda_mem_alloc(&wp, wb);
    if (!r) r = cuda_mem_alloc(&ap, ab);
    if (!r) r = cuda_mem_alloc(&yp, yb);
    if (!r) r = cuda_event_create(&ev[0]);
    if (!r) r = cuda_event_create(&ev[1]);
    int cannot = r != CUDA_SUCCESS;
    uint64_t rb = w->row_bytes, st = ab;
    int rows = (int)w->rows, cols = (int)w->cols, columns = 1;
    void *params[] = {&wp, &rb, &ap, &st, &yp, &rows, &cols, &columns};
    unsigned grid = (unsigned)((w->rows + CUDA_WARPS - 1) / CUDA_WARPS);
    if (!r) r = cuda_htod(wp, w->data, wb);
    if (!r) r = cuda_htod(ap, host, ab);
    if (!r) r = cuda_launch(d->matvec[w->type], grid, 1, 32 * CUDA_WARPS, params); /* warm-up */
    if (!r) r = cuda_event_record(ev[0], NULL);
    for (int i = 0; i < CUDA_PROBE_REPS && !r; i++) r = cuda_launch(d->matvec[w->type], grid, 1, 32 * CUDA_WARPS, params);
    if (!r) r = cuda_event_record(ev[1], NULL);
    if (!r) r = cuda_event_sync(ev[1]);
    if (!r) r = cuda_event_elapsed(&ms, ev[0], ev[1]);
    *kernel = ms / 1e3 / CUDA_PROBE_REPS;
    if (!r) r = cuda_event_record(ev[0], NULL);
    for (int i = 0; i < CUDA_PROBE_REPS && !r; i++)
        if (!(r = cuda_htod(ap, host, ab))) r = cuda_dtoh(host + ab, yp, yb);
    if (!r) r = cuda_event_record(ev[1], NULL);
    if (!r) r = cuda_event_sync(ev[1]);
    if (!r) r = cuda_event_elapsed(&ms, ev[0], ev[1]);
    *round_trip = ms / 1e3 / CUDA_PROBE_REPS;
    for (int i = 0; i < 2; i++)
        if (ev[i]) cuda_event_destroy(ev[i]);
    cuda_ptr bufs[3] = {wp, ap, yp};
    for (int i = 0; i < 3; i++)
        if (bufs[i]) cuda_mem_free(bufs[i]);
    free(host);
    if (r && !cannot) cuda_fail("the probe", r);
    return r ? -1 : 0;
}

/* ---- bench --kernels on a device ---- */

/* GB/s of weights of a random ROWS x COLS matrix of TYPE's product on device DEV, timed as the
 * probe times one; 0 where it cannot run. */
static double cuda_bench_gemv(int dev, enum gguf_type type, int64_t rows, int64_t cols)
{
    struct ops_matrix m = {type, NULL, rows, cols, gguf_row_bytes(type, cols), 0};
    size_t n = m.row_bytes * (size_t)rows;
    uint8_t *w = plat_alloc_aligned(n);
    ops_bench_fill(w, n, 0);
    quant_sanitize_random(type, w, n, -1);
    m.data = w;
    double kernel = 0, round_trip = 0;
    int r = cuda_probe_product(dev, &m, &kernel, &round_trip);
    free(w);
    return r || kernel <= 0 ? 0 : (double)n / kernel / 1e9;
}

/* Device DEV's memory bandwidth in GB/s: a device-to-device copy of 256 MiB, its bytes read and
 * written over its time (events around 4 copies); 0 where the driver has no such copy. */
static double cuda_bench_bandwidth(int dev)
{
    const size_t n = (size_t)256 << 20;
    cuda_ptr a = 0, b = 0;
    cuda_handle ev[2] = {NULL, NULL};
    float ms = 0;
    if (!cuda_api.dtod || !cuda_api.event_create || cuda_use(dev)) return 0;
    cuda_result r = cuda_mem_alloc(&a, n);
    if (!r) r = cuda_mem_alloc(&b, n);
    if (!r) r = cuda_event_create(&ev[0]);
    if (!r) r = cuda_event_create(&ev[1]);
    if (!r) r = cuda_dtod(b, a, n); /* warm-up */
    if (!r) r = cuda_event_record(ev[0], NULL);
    for (int i = 0; i < 4 && !r; i++) r = cuda_dtod(i % 2 ? a : b, i % 2 ? b : a, n);
    if (!r) r = cuda_event_record(ev[1], NULL);
    if (!r) r = cuda_event_sync(ev[1]);
    if (!r) r = cuda_event_elapsed(&ms, ev[0], ev[1]);
    for (int i = 0; i < 2; i++)
        if (ev[i]) cuda_event_destroy(ev[i]);
    if (a) cuda_mem_free(a);
    if (b) cuda_mem_free(b);
    return r || ms <= 0 ? 0 : 4 * 2.0 * (double)n / (ms / 1e3) / 1e9;
}

/* bench --kernels' table for device DEV: every format's GEMV at the CPU table's shapes but the
 * largest, which is 16384 x 4096 (beyond a card's L2 for 4-bit formats and up), that one
 * against the card's copy bandwidth. */
static void cuda_bench_kernels(int dev)
{
    double bw = cuda_bench_bandwidth(dev);
    printf("\ncuda %d: %s, copy bandwidth %.1f GB/s (read + write; 0: not measured)\n", dev, cuda.dev[dev].name, bw);
    printf("%-7s %14s %14s %14s %22s\n", "type", "2048x2048", "8192x2048", "2048x512", "16384x4096 (ratio)");
    for (size_t i = 0; i < sizeof quant_kernels / sizeof quant_kernels[0] && cuda.ready; i++) {
        enum gguf_type t = quant_kernels[i].type;
        if (!cuda.dev[dev].matvec[t]) continue;
        double g1 = cuda_bench_gemv(dev, t, 2048, 2048), g2 = cuda_bench_gemv(dev, t, 8192, 2048);
        double g3 = cuda_bench_gemv(dev, t, 2048, 512), g4 = cuda_bench_gemv(dev, t, 16384, 4096);
        printf("%-7s %9.1f GB/s %9.1f GB/s %9.1f GB/s %9.1f GB/s (%3.0f%%)\n", gguf_type_get(t)->name, g1, g2, g3, g4,
               100 * plat_ratio(g4, bw));
    }
}

/* ---- routed experts on the device ----
 * An expert in VRAM is its three matrices in one allocation. A batch is a list of jobs, one
 * per (expert, token): cuda_moe_start uploads the jobs and the tokens' activations (prepared
 * for the gate/up type by the CPU, as for its own products) in one copy and queues three
 * kernels: gate and up with silu(g) * u, the quantisation of that for the down type, and down.
 * The launches return at once, so the CPU computes the experts it holds meanwhile;
 * cuda_moe_finish downloads the outputs, one [dim] row per job, and the caller sums them with
 * the routing weights in its fixed order. 5 driver calls per device and layer. */

/* A routed expert resident on a device: where its gate, up and down matrices start. The layout
 * is kernels.cu's struct moe_job, whose column field says which activation a job reads. */
struct cuda_expert { cuda_ptr gate, up, down; };
struct cuda_moe_job { struct cuda_expert e; uint32_t column, pad; };

/* One layer's expert shapes: gate and up share a type (their activations are one upload). */
struct cuda_moe_shape { enum gguf_type up_type, down_type; size_t up_row_bytes, down_row_bytes; int dim, ff; };

static int cuda_moe_shape_same(const struct cuda_moe_shape *a, const struct cuda_moe_shape *b)
{
    return a->up_type == b->up_type && a->down_type == b->down_type && a->up_row_bytes == b->up_row_bytes &&
           a->down_row_bytes == b->down_row_bytes && a->dim == b->dim && a->ff == b->ff;
}

/* Whether device DEV has the kernels for experts of shape SH. */
static int cuda_moe_supported(int dev, const struct cuda_moe_shape *sh)
{
    const struct cuda_device *d = &cuda.dev[dev];
    return d->moe_gate_up[sh->up_type] && d->moe_down[sh->down_type] && d->quantize[quant_act_kind(sh->down_type)];
}

/* Copies one expert (W: gate, up, down) to device DEV into *E: 0, or -1 as cuda_upload. */
static int cuda_expert_upload(int dev, const struct ops_matrix w[3], struct cuda_expert *e)
{
    const uint8_t *src[3] = {w[0].data, w[1].data, w[2].data};
    size_t bytes[3];
    for (int j = 0; j < 3; j++) bytes[j] = (size_t)w[j].rows * w[j].row_bytes;
    cuda_ptr p = cuda_upload(dev, src, bytes, 3, 0);
    if (!p) return -1;
    *e = (struct cuda_expert){p, p + cuda_align(bytes[0]), p + cuda_align(bytes[0]) + cuda_align(bytes[1])};
    return 0;
}
/* ---- re-tiering: an expert's upload in the background ----
 * One upload at a time per device, on a stream of its own (non-blocking: the kernels on the
 * null stream do not wait for it) from pinned staging, so no token waits for it. §7 asks
 * cuda_expert_upload_ready at token boundaries and switches the expert over once it is there. */

/* Whether this driver can upload in the background. */
static int cuda_async_ok(void)
{
    return cuda_api.stream_create && cuda_api.htod_async && cuda_api.event_query && cuda_api.host_alloc && cuda_api.host_free &&
           cuda_api.event_create && cuda_api.event_record;
}

/* Starts copying expert W (gate, up, down) to device DEV in the background: its VRAM is
 * allocated and charged now, and *E says where it will be. Returns 0, or -1 with nothing
 * changed: no room, a driver without background copies, an upload under way there. */
static int cuda_expert_upload_start(int dev, const struct ops_matrix w[3], struct cuda_expert *e)
{
    struct cuda_device *d = &cuda.dev[dev];
    size_t bytes[3];
    for (int j = 0; j < 3; j++) bytes[j] = (size_t)w[j].rows * w[j].row_bytes;
    size_t total = cuda_span(bytes, 3);
    cuda_ptr p = 0;
    void *stage = NULL;
    if (!cuda_async_ok() || d->copying || !cuda_fits(dev, total) || cuda_use(dev)) return -1;
    if (!d->copy_done && (cuda_stream_create(&d->copy_stream) || cuda_event_create(&d->copy_done))) return -1;
    if (total > d->copy_cap) {
        if (d->copy_stage) cuda_host_free(d->copy_stage);
        d->copy_stage = NULL;
        d->copy_cap = 0;
        if (cuda_host_alloc(&stage, total)) return -1;
        d->copy_stage = stage;
        d->copy_cap = total;
    }
    if (cuda_mem_alloc(&p, total)) return -1;
    for (size_t j = 0, off = 0; j < 3; off += cuda_align(bytes[j]), j++) memcpy(d->copy_stage + off, w[j].data, bytes[j]);
    cuda_result r = cuda_htod_async(p, d->copy_stage, total, d->copy_stream);
    if (!r) r = cuda_event_record(d->copy_done, d->copy_stream);
    if (r) {
        cuda_mem_free(p);
        cuda_fail("an upload in the background", r);
        return -1;
    }
    cuda_list(dev, NULL, p, total);
    *e = (struct cuda_expert){p, p + cuda_align(bytes[0]), p + cuda_align(bytes[0]) + cuda_align(bytes[1])};
    d->copying = 1;
    return 0;
}

/* Whether device DEV's upload has arrived: 1 (or none was under way), 0 not yet, -1 the GPU
 * path has ended. */
static int cuda_expert_upload_ready(int dev)
{
    struct cuda_device *d = &cuda.dev[dev];
    if (!d->copying) return 1;
    if (!cuda.ready) return -1;
    cuda_result r = cuda_use(dev) ? CUDA_ERROR_NOT_READY : cuda_event_query(d->copy_done);
    if (r == CUDA_ERROR_NOT_READY) return 0;
    d->copying = 0;
    if (r) {
        cuda_fail("an upload in the background", r);
        return -1;
    }
    return 1;
}

/* Frees expert E's VRAM on device DEV (no upload under way there, so nothing waits) and takes
 * it off the budget: the expert computes on the CPU from now on. */
static void cuda_expert_free(int dev, const struct cuda_expert *e)
{
    for (int k = 0; k < cuda.n_experts; k++) {
        struct cuda_resident *r = &cuda.experts[k];
        if (r->dev != dev || r->ptr != e->gate) continue;
        if (cuda_use(dev) == 0) cuda_mem_free(r->ptr);
        cuda.dev[dev].used -= (int64_t)r->bytes;
        *r = cuda.experts[--cuda.n_experts];
        return;
    }
}

/* The device bytes of a batch of N jobs of shape SH: the hidden rows, their quantised form
 * (rows HQ_STRIDE bytes apart) and the outputs. */
static size_t cuda_moe_hq_stride(const struct cuda_moe_shape *sh) { return (quant_act_bytes(sh->down_type, sh->ff) + 63) & ~(size_t)63; }
static size_t cuda_moe_work_bytes(const struct cuda_moe_shape *sh, int n)
{
    return cuda_align((size_t)n * (size_t)sh->ff * 4) + cuda_align((size_t)n * cuda_moe_hq_stride(sh)) + (size_t)n * (size_t)sh->dim * 4;
}

/* Where the outputs [n][dim] of a batch whose work bytes start at WORK are: their last part. */
static cuda_ptr cuda_moe_outputs(cuda_ptr work, const struct cuda_moe_shape *sh, int n)
{
    return work + cuda_moe_work_bytes(sh, n) - (size_t)n * (size_t)sh->dim * 4;
}

/* Launches on the current device the preparation of ROWS rows of N floats at PX (N apart) for
 * weights of TYPE into PACT, STRIDE bytes a row: quant_act_prepare's bits. */
static cuda_result cuda_quantize_launch(struct cuda_device *d, enum gguf_type type, cuda_ptr px, cuda_ptr pact, size_t stride, int n, int rows)
{
    enum quant_act_kind kind = quant_act_kind(type);
    uint64_t st = stride;
    int mode = type == GGUF_TYPE_F16 ? 1 : type == GGUF_TYPE_BF16 ? 2 : 0;
    void *params[] = {&px, &pact, &st, &n, &mode};
    unsigned per_block = (kind == QUANT_ACT_Q8K ? 256 : 32) * CUDA_WARPS; /* elements a block quantises (a thread each for floats) */
    return cuda_launch(d->quantize[kind], (unsigned)(n + (int)per_block - 1) / per_block, (unsigned)rows, 32 * CUDA_WARPS, params);
}

/* Launches on the current device the N jobs at PJ (experts of shape SH) over the activation
 * columns at PA, STRIDE bytes apart: gate and up, the hidden rows' quantisation, down, the
 * outputs at PW + cuda_moe_work_bytes' last part. 3 launches; returns the driver's result. */
static cuda_result cuda_moe_launch(struct cuda_device *d, const struct cuda_moe_shape *sh, cuda_ptr pj, cuda_ptr pa, size_t stride, int n,
                                   cuda_ptr pw)
{
    cuda_ptr ph = pw, pq = ph + cuda_align((size_t)n * (size_t)sh->ff * 4), po = pq + cuda_align((size_t)n * cuda_moe_hq_stride(sh));
    uint64_t st = stride, hs = cuda_moe_hq_stride(sh), urb = sh->up_row_bytes, drb = sh->down_row_bytes;
    int ff = sh->ff, dim = sh->dim;
    void *gate_up[] = {&pj, &pa, &st, &ph, &urb, &ff, &dim};
    void *down[] = {&pj, &pq, &hs, &po, &drb, &dim, &ff};
    cuda_result r = cuda_launch(d->moe_gate_up[sh->up_type], (unsigned)(ff + CUDA_WARPS - 1) / CUDA_WARPS, (unsigned)n, 32 * CUDA_WARPS, gate_up);
    if (!r) r = cuda_quantize_launch(d, sh->down_type, ph, pq, hs, ff, n);
    if (!r) r = cuda_launch(d->moe_down[sh->down_type], (unsigned)(dim + CUDA_WARPS - 1) / CUDA_WARPS, (unsigned)n, 32 * CUDA_WARPS, down);
    return r;
}

/* Queues a batch on device DEV: N jobs (experts of shape SH) over the N_COLS activation
 * columns ACTS, STRIDE bytes apart, prepared for SH->up_type. Returns 0, or -1 after cuda_fail
 * or once the GPU path has ended (the caller computes the jobs on the CPU). */
static int cuda_moe_start(int dev, const struct cuda_moe_shape *sh, const struct cuda_moe_job *jobs, int n,
                          const uint8_t *acts, size_t stride, int n_cols)
{
    struct cuda_device *d = &cuda.dev[dev];
    if (!cuda.ready) return -1; /* another device failed this layer: no more driver calls */
    size_t jobs_b = cuda_align((size_t)n * sizeof *jobs), acts_b = cuda_align(stride * (size_t)n_cols);
    uint8_t *stage = cuda_stage(jobs_b + acts_b);
    memcpy(stage, jobs, (size_t)n * sizeof *jobs);
    memcpy(stage + jobs_b, acts, stride * (size_t)n_cols);
    cuda_result r;
    if ((r = cuda_use(dev)) || (r = cuda_scratch(&d->moe, &d->moe_cap, jobs_b + acts_b + cuda_moe_work_bytes(sh, n))) ||
        (r = cuda_htod(d->moe, stage, jobs_b + acts_b))) {
        cuda_fail("expert batch upload", r);
        return -1;
    }
    if ((r = cuda_moe_launch(d, sh, d->moe, d->moe + jobs_b, stride, n, d->moe + jobs_b + acts_b))) {
        cuda_fail("experts on the device", r);
        return -1;
    }
    d->moe_jobs = n;
    d->moe_bytes = (size_t)n * (size_t)sh->dim * 4;
    d->moe_out = cuda_moe_outputs(jobs_b + acts_b, sh, n);
    return 0;
}

/* A DeltaNet mixer on a device (cuda_deltanet_launch): its constants there (one allocation:
 * the conv's taps [K][conv_dim], dt_bias [nv], a [nv], the gated norm's weights), its shape, and
 * where its state lies in a sequence's (STATE_OFF floats in, its conv state's CONV_FLOATS first;
 * cuda_state_alloc). BA: beta and alpha come fused (Qwen3-Next). */
struct cuda_deltanet {
    cuda_ptr taps, dt_bias, ssm_a, norm;
    int conv_dim, K, nk, nv, dk, dv, tiled, ba, norm_per_head;
    float eps, qscale;
    uint64_t state_off, conv_floats;
};

/* An attention mixer on a device (cuda_attention_launch): its q and k norms there, its shape,
 * and in a pass's chain buffer the tokens' KV caches' addresses (KV), their positions (POS) and
 * their RoPE rows (ROPE: rot/2 cosines then sines); the layer's place in a sequence's caches on
 * the device (LAYER_OFF bytes: cuda_state_alloc), ROWS rows a head, in FORMAT (f32, f16 or
 * Q8_0, laid out as the CPU's). */
struct cuda_attention {
    cuda_ptr q_norm, k_norm, kv, pos, rope;
    int n_head, n_kv, hd, rot, format, splits; /* format: the cache's enum ops_kv; splits: of OPS_ATTN_SPLIT rows, for the batch's longest context */
    float eps, scale;
    uint64_t layer_off, rows;
};

/* The rest of a layer from its mixer's output on, on one device: the output projection WO,
 * the residual and the post-norm NORM (residual_norm), the router and the shared expert's gate
 * logit over that, the routing (moe_route: model_select_experts' bits), the routed experts
 * through TABLE (n_expert entries) and the shared expert SHEXP (of shape SHEXP_SH: in the
 * routed experts' batch where that is theirs, SH, else in a batch of its own), and their sum
 * added to the hidden state (moe_combine): model_forward_runs' steps, the same bits. WO, the
 * router and the gate logit matrices are resident there. */
struct cuda_moe_layer {
    struct cuda_moe_shape sh, shexp_sh;
    const struct ops_matrix *wo, *router, *gate_inp; /* gate_inp NULL: no shared expert */
    cuda_ptr wo_ptr, router_ptr, gate_inp_ptr;
    const float *norm;
    float eps;
    const struct cuda_expert *table; /* an entry of zeros: the CPU computes that expert */
    struct cuda_expert shexp;
    int n_expert, used, split;       /* split: the table has such entries */
    /* the next layer's start, where its matrices are there too (n_next > 0): its input norm
     * NEXT_NORM over the new hidden state, then its mixer's input projections NEXT[j] */
    const float *next_norm;
    int n_next;
    struct ops_matrix next[CUDA_NEXT_MAX];
    cuda_ptr next_ptr[CUDA_NEXT_MAX];
    /* in a chain (cuda_chain_begin): BLOCK holds the layer's jobs (the shared expert's already
     * there), table and norms, uploaded with the pass's first; moe_route leaves the ids at IDS
     * (0: in the layer's scratch, as a split layer's routing download reads them).
     * KEEP: the outputs stay on the device for the next layer (nothing comes back); DN: this
     * layer's mixer, a DeltaNet run there over what the layer before kept */
    cuda_ptr block, ids;
    int keep;
    const struct cuda_deltanet *dn;
    const struct cuda_attention *attn; /* or an attention mixer, likewise */
};

/* The routed experts moe_route can take (kernels.cu's ROUTE_MAX_EXPERTS), and choices a token. */
#define CUDA_ROUTE_MAX_EXPERTS 512
#define CUDA_ROUTE_MAX_USED 32

/* Whether layer L's shared expert runs in its routed experts' batch (it has their shape). */
static int cuda_moe_shexp_in_batch(const struct cuda_moe_layer *L) { return L->gate_inp && cuda_moe_shape_same(&L->sh, &L->shexp_sh); }

/* Whether device DEV can run the rest of layer L (cuda_moe_layer_start) over T tokens. */
static int cuda_moe_layer_supported(int dev, const struct cuda_moe_layer *L, int T)
{
    const struct cuda_device *d = &cuda.dev[dev];
    if (L->gate_inp && !cuda_moe_shexp_in_batch(L) && (!cuda_moe_supported(dev, &L->shexp_sh) || L->shexp_sh.dim != L->sh.dim)) return 0;
    for (int j = 0; j < L->n_next; j++)
        if (!d->matvec[L->next[j].type] || !d->quantize[quant_act_kind(L->next[j].type)] || L->next[j].cols != L->sh.dim) return 0;
    return d->moe_route && d->moe_combine && d->residual_norm && d->matvec[L->wo->type] && d->matvec[L->router->type] &&
           d->quantize[quant_act_kind(L->router->type)] && d->quantize[quant_act_kind(L->sh.up_type)] && cuda_moe_supported(dev, &L->sh) &&
           L->wo->rows == L->sh.dim && L->router->cols == L->sh.dim && L->n_expert <= CUDA_ROUTE_MAX_EXPERTS &&
           L->used <= CUDA_ROUTE_MAX_USED && L->used <= L->n_expert && (int64_t)T * (L->used + 1) <= 65535; /* a grid's height */
}

/* Where a layer's batch keeps what, in bytes from the start of the device's batch scratch: the
 * jobs (routed, then shared); what goes up (from the shared jobs to the end of the norms); what
 * the kernels make (the next projections' activations: one a type); the CPU's experts'
 * outputs (a split layer); then what comes back, in an order that keeps each download one
 * span: the normed input, the ids (a split layer's routing: xn, ids), the output and the next
 * projections (ids, out, next). */
struct cuda_moe_layout {
    size_t shared, table, x, mix, norm, next_norm, y, ar, au, as, logits, gate, w, work, swork, core, parts, cpu_y, xn, ids, out, end;
    size_t next_act[CUDA_NEXT_MAX], next_out[CUDA_NEXT_MAX];
};

/* Bytes of a token's split records (attn_split: HD + 4 floats a split of a head), and how many
 * of a batch of T one pair of attention launches takes: as many as fit cuda_attention_parts
 * bytes, at least one (a prompt at long context goes in groups; a decode step in one). */
static size_t cuda_attention_parts = (size_t)64 << 20; /* test_cuda lowers it, to see groups */

static size_t cuda_attention_token_parts(const struct cuda_attention *a)
{
    return (size_t)a->n_head * (size_t)a->splits * ((size_t)a->hd + 4) * 4;
}

static int cuda_attention_group(const struct cuda_attention *a, int T)
{
    const size_t fit = cuda_attention_parts / cuda_attention_token_parts(a);
    return fit < 1 ? 1 : fit < (size_t)T ? (int)fit : T;
}

static struct cuda_moe_layout cuda_moe_layout_of(const struct cuda_moe_layer *L, size_t stride_mix, int T)
{
    struct cuda_moe_layout o;
    const size_t rows = (size_t)T * (size_t)L->sh.dim * 4;
    const int apart = L->gate_inp && !cuda_moe_shexp_in_batch(L), n = T * L->used + (L->gate_inp && !apart ? T : 0);
    o.shared = (size_t)T * L->used * sizeof(struct cuda_moe_job);
    o.table = cuda_align((size_t)(T * L->used + (L->gate_inp ? T : 0)) * sizeof(struct cuda_moe_job));
    o.x = o.table + cuda_align((size_t)L->n_expert * sizeof *L->table);
    o.mix = o.x + cuda_align(rows);
    o.norm = o.mix + cuda_align(stride_mix * (size_t)T);
    o.next_norm = o.norm + cuda_align((size_t)L->sh.dim * 4);
    o.y = o.next_norm + cuda_align((size_t)L->sh.dim * 4);
    o.ar = o.y + cuda_align(rows);
    o.au = o.ar + cuda_align(ops_act_stride(L->router) * (size_t)T);
    o.as = o.au + cuda_align(ops_act_stride_of(L->sh.up_type, L->sh.dim) * (size_t)T); /* the shared expert's, of another type */
    o.logits = o.as + (apart && L->shexp_sh.up_type != L->sh.up_type ? cuda_align(ops_act_stride_of(L->shexp_sh.up_type, L->sh.dim) * (size_t)T) : 0);
    if (o.as == o.logits) o.as = o.au;
    o.gate = o.logits + cuda_align((size_t)T * L->n_expert * 4);
    o.w = o.gate + cuda_align((size_t)T * 4);
    o.work = o.w + cuda_align((size_t)T * L->used * 4);
    o.swork = o.work + cuda_align(cuda_moe_work_bytes(&L->sh, n));
    o.core = o.swork + (apart ? cuda_align(cuda_moe_work_bytes(&L->shexp_sh, T)) : 0);
    o.parts = o.core + (L->dn || L->attn ? cuda_align((size_t)T * (size_t)L->wo->cols * 4) : 0);
    size_t at = o.parts + (L->attn ? cuda_align((size_t)cuda_attention_group(L->attn, T) * cuda_attention_token_parts(L->attn)) : 0);
    for (int j = 0; j < L->n_next; j++) {
        int same = 0;
        while (L->next[same].type != L->next[j].type) same++;
        o.next_act[j] = same < j ? o.next_act[same] : at;
        at += same < j ? 0 : cuda_align(ops_act_stride_of(L->next[j].type, L->sh.dim) * (size_t)T);
    }
    o.cpu_y = at;
    o.xn = o.cpu_y + cuda_align(L->split ? (size_t)L->used * rows : 0);
    o.ids = o.xn + rows;
    o.out = o.ids + (size_t)T * L->used * 4;
    o.end = o.out + rows;
    for (int j = 0; j < L->n_next; j++) {
        o.next_out[j] = o.end;
        o.end += (size_t)T * (size_t)L->next[j].rows * 4;
    }
    return o;
}

/* Device addresses of what a layer reads from its upload, or, in a chain, from its block and
 * the layer before (cuda_moe_layer): the jobs, the table, the hidden state, the two norms, and
 * where the ids go. */
struct cuda_moe_inputs { cuda_ptr jobs, table, x, norm, next_norm, ids; };

static struct cuda_moe_inputs cuda_moe_inputs_of(const struct cuda_device *d, const struct cuda_moe_layer *L, struct cuda_moe_layout o)
{
    const cuda_ptr b = d->moe, k = L->block;
    struct cuda_moe_inputs in = {b, b + o.table, b + o.x, b + o.norm, b + o.next_norm, L->ids ? L->ids : b + o.ids};
    if (k) in.jobs = k, in.table = k + o.table, in.norm = k + o.x, in.next_norm = k + o.x + cuda_align((size_t)L->sh.dim * 4);
    if (L->dn || L->attn) in.x = d->kept_x;
    return in;
}

/* Writes layer L's shared expert's jobs and its table at BASE as the batch scratch lays them out
 * (jobs from 0, the table at o.table), its norms at BASE + NORM and BASE + NEXT_NORM. */
static void cuda_moe_fill(const struct cuda_moe_layer *L, struct cuda_moe_layout o, uint8_t *base, size_t norm, size_t next_norm, int T)
{
    for (int t = 0; L->gate_inp && t < T; t++) ((struct cuda_moe_job *)(base + o.shared))[t] = (struct cuda_moe_job){L->shexp, (uint32_t)t, 0};
    memcpy(base + o.table, L->table, (size_t)L->n_expert * sizeof *L->table);
    memcpy(base + norm, L->norm, (size_t)L->sh.dim * 4);
    if (L->n_next) memcpy(base + next_norm, L->next_norm, (size_t)L->sh.dim * 4);
}

/* Bytes of layer L's block in a chain for T tokens (cuda_chain_block_fill). */
static size_t cuda_chain_block_bytes(const struct cuda_moe_layer *L, int T)
{
    return cuda_moe_layout_of(L, 0, T).x + 2 * cuda_align((size_t)L->sh.dim * 4);
}

/* Layer L's block for T tokens at DST (cuda_chain_block_bytes): what its upload would carry but
 * the hidden state and the mixer's rows, laid out as cuda_moe_inputs_of reads it. */
static void cuda_chain_block_fill(const struct cuda_moe_layer *L, int T, uint8_t *dst)
{
    const struct cuda_moe_layout o = cuda_moe_layout_of(L, 0, T);
    cuda_moe_fill(L, o, dst, o.x, o.x + cuda_align((size_t)L->sh.dim * 4), T);
}

/* A layer's start on device D: the norm NORM over T hidden rows X into XN (residual_norm), then
 * each of its N mixer projections W[j] (resident at W_PTR[j]) over that: the activations a type
 * (at ACT[j]: projections of one type share them), the products into OUT[j]. Counts its calls;
 * returns the driver's result. */
static cuda_result cuda_project(struct cuda_device *d, cuda_ptr x, cuda_ptr norm, cuda_ptr xn, const struct ops_matrix *w, const cuda_ptr *w_ptr,
                                const cuda_ptr *act, const cuda_ptr *out, int n, int dim, float eps, int T)
{
    cuda_ptr none = 0;
    int columns = T;
    void *norm_params[] = {&x, &none, &norm, &xn, &dim, &eps};
    cuda_result r = cuda_launch(d->residual_norm, (unsigned)T, 1, 32, norm_params);
    for (int j = 0; j < n && !r; j++) {
        cuda_ptr pw = w_ptr[j], pa = act[j], py = out[j];
        uint64_t rb = w[j].row_bytes, st = ops_act_stride_of(w[j].type, dim);
        int rows = (int)w[j].rows;
        void *params[] = {&pw, &rb, &pa, &st, &py, &rows, &dim, &columns};
        int first = 1; /* the first projection of its type prepares the activations they share */
        for (int i = 0; i < j; i++) first &= act[i] != act[j];
        if (first) r = cuda_quantize_launch(d, w[j].type, xn, pa, st, dim, T);
        if (!r) r = cuda_launch(d->matvec[w[j].type], (unsigned)((w[j].rows + CUDA_WARPS - 1) / CUDA_WARPS), 1, 32 * CUDA_WARPS, params);
    }
    return r;
}

/* Launches the next layer's start after the rest of layer L (cuda_moe_layer_start): its norm
 * over the new hidden state, and its projections (cuda_project). Returns the driver's result. */
static cuda_result cuda_next_start(struct cuda_device *d, const struct cuda_moe_layer *L, struct cuda_moe_layout o, int T)
{
    cuda_ptr act[CUDA_NEXT_MAX], out[CUDA_NEXT_MAX];
    for (int j = 0; j < L->n_next; j++) act[j] = d->moe + o.next_act[j], out[j] = d->moe + o.next_out[j];
    return cuda_project(d, d->moe + o.out, cuda_moe_inputs_of(d, L, o).next_norm, d->moe + o.xn, L->next, L->next_ptr, act, out, L->n_next,
                        L->sh.dim, L->eps, T);
}

/* Layer L's DeltaNet mixer on device D over the projections the layer before kept there (its
 * qkv, z, beta and alpha or ba): the conv, SiLU, norms and scale (deltanet_conv), the gated
 * delta rule over each token's state (deltanet_rule: the state addresses lead the pass's chain
 * buffer), the gated norm (deltanet_gate), then the rows prepared for the output projection at
 * o.mix. 4 launches; the driver's result. */
static cuda_result cuda_deltanet_launch(struct cuda_device *d, const struct cuda_moe_layer *L, struct cuda_moe_layout o, size_t stride_mix,
                                        int T)
{
    const struct cuda_deltanet *dn = L->dn;
    cuda_ptr mixed = d->kept_next[0], z = d->kept_next[1], beta = d->kept_next[2], alpha = dn->ba ? beta : d->kept_next[3];
    cuda_ptr states = d->chain, core = d->moe + o.core, taps = dn->taps, dt_bias = dn->dt_bias, ssm_a = dn->ssm_a, norm = dn->norm;
    uint64_t off = dn->state_off, ssm_off = dn->state_off + dn->conv_floats;
    int conv_dim = dn->conv_dim, K = dn->K, nk = dn->nk, nv = dn->nv, dk = dn->dk, dv = dn->dv, q_end = nk * dk, tiled = dn->tiled;
    int ba = dn->ba, per_head = dn->norm_per_head;
    float eps = dn->eps, qscale = dn->qscale;
    void *conv[] = {&mixed, &taps, &states, &off, &conv_dim, &K, &dk, &q_end, &eps, &qscale, &T};
    void *rule[] = {&mixed, &beta, &alpha, &ba, &dt_bias, &ssm_a, &states, &ssm_off, &nk, &nv, &dk, &dv, &tiled, &conv_dim, &T, &core};
    void *gate[] = {&core, &z, &norm, &per_head, &dv, &eps};
    cuda_result r;
    if ((r = cuda_launch(d->deltanet_conv, (unsigned)((conv_dim + dk - 1) / dk), 1, 32, conv)) ||
        (r = cuda_launch(d->deltanet_rule, (unsigned)((dv + 31) / 32), (unsigned)nv, 32, rule)) ||
        (r = cuda_launch(d->deltanet_gate, (unsigned)nv, (unsigned)T, 32, gate)) ||
        (r = cuda_quantize_launch(d, L->wo->type, core, d->moe + o.mix, stride_mix, nv * dv, T)))
        return r;
    return CUDA_SUCCESS;
}

/* Layer L's attention mixer on device D over the projections the layer before kept there (q
 * with its gate, k, v): the q and k norms and RoPE, the new K and V rows into each token's cache
 * (attn_prep), each split's scores, softmax and values (attn_split) and their merge and gate
 * (attn_merge), a pair a group of tokens (cuda_attention_group), then the rows prepared for the
 * output projection at o.mix. 4 launches where the batch is one group; the driver's result. */
static cuda_result cuda_attention_launch(struct cuda_device *d, const struct cuda_moe_layer *L, struct cuda_moe_layout o, size_t stride_mix,
                                         int T)
{
    const struct cuda_attention *a = L->attn;
    cuda_ptr qg = d->kept_next[0], k = d->kept_next[1], v = d->kept_next[2], out = d->moe + o.core, qn = a->q_norm, kn = a->k_norm;
    cuda_ptr rope = a->rope, kv = a->kv, pos = a->pos, parts = d->moe + o.parts;
    uint64_t off = a->layer_off, rows = a->rows;
    int nh = a->n_head, nkv = a->n_kv, hd = a->hd, rot = a->rot, kvf = a->format, splits = a->splits, t0 = 0;
    const int group = cuda_attention_group(a, T);
    float eps = a->eps, scale = a->scale;
    void *prep[] = {&qg, &k, &v, &qn, &kn, &rope, &kv, &off, &pos, &nh, &nkv, &hd, &rot, &rows, &kvf, &eps};
    void *split[] = {&qg, &kv, &off, &pos, &t0, &nh, &nkv, &hd, &rows, &kvf, &scale, &splits, &parts};
    void *merge[] = {&qg, &pos, &t0, &nh, &hd, &splits, &parts, &out};
    cuda_result r = cuda_launch(d->attn_prep, (unsigned)(nh + nkv), (unsigned)T, 32, prep);
    for (; !r && t0 < T; t0 += group) {
        const unsigned tokens = (unsigned)(T - t0 < group ? T - t0 : group);
        if (!(r = cuda_launch(d->attn_split, (unsigned)(nh * splits), tokens, 32, split)))
            r = cuda_launch(d->attn_merge, (unsigned)nh, tokens, 32, merge);
    }
    return r ? r : cuda_quantize_launch(d, L->wo->type, out, d->moe + o.mix, stride_mix, nh * hd, T);
}

/* The layer's front on device D (uploaded): the output projection, the residual and norm, the
 * activations, the router and gate logit, the routing. 6 to 8 launches; the driver's result. */
static cuda_result cuda_moe_layer_front(struct cuda_device *d, const struct cuda_moe_layer *L, struct cuda_moe_layout o, size_t stride_mix,
                                        int T)
{
    const cuda_ptr b = d->moe;
    const struct cuda_moe_inputs in = cuda_moe_inputs_of(d, L, o);
    cuda_ptr pj = in.jobs, ptab = in.table, px = in.x, pmix = b + o.mix, pnorm = in.norm, py = b + o.y, pxn = b + o.xn, par = b + o.ar;
    cuda_ptr pl = b + o.logits, pg = b + o.gate, pw = b + o.w, pid = in.ids, pwo = L->wo_ptr, prw = L->router_ptr, pgw = L->gate_inp_ptr;
    uint64_t orb = L->wo->row_bytes, smix = stride_mix, rrb = L->router->row_bytes, sr = ops_act_stride(L->router);
    int ne = L->n_expert, k = L->used, one = 1, dim = L->sh.dim, ocols = (int)L->wo->cols, columns = T;
    float eps = L->eps;
    void *out_proj[] = {&pwo, &orb, &pmix, &smix, &py, &dim, &ocols, &columns};
    void *norm[] = {&px, &py, &pnorm, &pxn, &dim, &eps};
    void *router[] = {&prw, &rrb, &par, &sr, &pl, &ne, &dim, &columns};
    void *gate[] = {&pgw, &rrb, &par, &sr, &pg, &one, &dim, &columns};
    void *route[] = {&pl, &ne, &k, &ptab, &pj, &pw, &pid};
    cuda_result r;
    if ((r = cuda_launch(d->matvec[L->wo->type], (unsigned)(dim + CUDA_WARPS - 1) / CUDA_WARPS, 1, 32 * CUDA_WARPS, out_proj)) ||
        (r = cuda_launch(d->residual_norm, (unsigned)T, 1, 32, norm)) || (r = cuda_quantize_launch(d, L->router->type, pxn, par, sr, dim, T)) ||
        (r = cuda_quantize_launch(d, L->sh.up_type, pxn, b + o.au, ops_act_stride_of(L->sh.up_type, dim), dim, T)) ||
        (o.as != o.au && (r = cuda_quantize_launch(d, L->shexp_sh.up_type, pxn, b + o.as, ops_act_stride_of(L->shexp_sh.up_type, dim), dim, T))) ||
        (r = cuda_launch(d->matvec[L->router->type], (unsigned)(ne + CUDA_WARPS - 1) / CUDA_WARPS, 1, 32 * CUDA_WARPS, router)) ||
        (L->gate_inp && (r = cuda_launch(d->matvec[L->router->type], 1, 1, 32 * CUDA_WARPS, gate))) ||
        (r = cuda_launch(d->moe_route, (unsigned)T, 1, 32, route)))
        return r;
    return CUDA_SUCCESS;
}

/* The layer's end on device D: the experts' sum added to the hidden state (the CPU's experts'
 * outputs at o.cpu_y), then the next layer's start; marks what cuda_moe_finish downloads. */
static cuda_result cuda_moe_layer_end(struct cuda_device *d, const struct cuda_moe_layer *L, struct cuda_moe_layout o, int T)
{
    const cuda_ptr b = d->moe;
    const struct cuda_moe_inputs in = cuda_moe_inputs_of(d, L, o);
    const int in_batch = cuda_moe_shexp_in_batch(L), n = T * L->used + (in_batch ? T : 0);
    cuda_ptr pexp = cuda_moe_outputs(b + o.work, &L->sh, n), pw = b + o.w, pg = b + o.gate, px = in.x, pout = b + o.out, pj = in.jobs;
    cuda_ptr pcpu = b + o.cpu_y, psh = !L->gate_inp ? 0 : in_batch ? pexp + (size_t)T * L->used * L->sh.dim * 4 : cuda_moe_outputs(b + o.swork, &L->shexp_sh, T);
    int k = L->used, dim = L->sh.dim;
    void *combine[] = {&pexp, &pw, &pg, &px, &pout, &k, &dim, &psh, &pj, &pcpu};
    cuda_result r = cuda_launch(d->moe_combine, (unsigned)(dim + 127) / 128, (unsigned)T, 128, combine);
    if (!r && L->n_next) r = cuda_next_start(d, L, o, T);
    d->kept_x = b + o.out;
    for (int j = 0; j < L->n_next; j++) d->kept_next[j] = b + o.next_out[j];
    d->moe_jobs = T * L->used + (L->gate_inp ? T : 0);
    d->moe_out = o.ids;
    d->moe_bytes = o.end - o.ids;
    return r;
}

/* A layer's batch that stays on device D for the next layer (L->keep): done with, unread,
 * counted here. */
static void cuda_moe_kept(struct cuda_device *d)
{
    cuda.batches++;
    cuda.jobs += d->moe_jobs;
    d->moe_jobs = 0;
}

/* Queues the rest of layer L on device DEV for T tokens: X [T][dim] the hidden state before
 * the layer's first residual, MIX the mixer's output rows prepared for L->wo (STRIDE_MIX bytes
 * apart). One upload (the shared expert's jobs, the table, X, MIX, the norms), 10 launches, 1
 * for the shared expert's gate logit (4 more where it has a batch of its own: its activations
 * and its three kernels), and for the next layer's start a norm, a quantisation a
 * type and a product a projection; cuda_moe_finish then downloads the chosen ids [T][used]
 * (int32), the new hidden state [T][dim] and each next projection's outputs [T][rows]. A split
 * layer (some experts are the CPU's: no matrices in the table) first downloads its routing into
 * ROUTING (the normed input [T][dim], the ids [T][used]) and queues the device's experts: the
 * CPU computes its own, and cuda_moe_layer_resume takes their outputs for the end. In a chain
 * (L->dn or L->attn) nothing goes up: the mixer runs first from what the layer before kept
 * (X and MIX unread), and a layer that keeps (L->keep) is not downloaded (a split one's routing
 * comes down all the same, its resume keeps). Returns 0, or -1 after cuda_fail. */
static int cuda_moe_layer_start(int dev, const struct cuda_moe_layer *L, const float *x, const uint8_t *mix, size_t stride_mix, int T,
                                void *routing)
{
    struct cuda_device *d = &cuda.dev[dev];
    if (!cuda.ready) return -1;
    const int shared = L->gate_inp != NULL, apart = shared && !cuda_moe_shexp_in_batch(L), n = T * L->used + (shared && !apart ? T : 0);
    const int dim = L->sh.dim;
    const int mixer = L->dn || L->attn; /* the mixer runs here, from what the layer before kept */
    if (mixer) { /* the layer before left its outputs in this scratch: the other one is this layer's */
        const cuda_ptr kept = d->moe;
        const size_t cap = d->moe_cap;
        d->moe = d->moe_prev, d->moe_cap = d->moe_prev_cap, d->moe_prev = kept, d->moe_prev_cap = cap;
    }
    const struct cuda_moe_layout o = cuda_moe_layout_of(L, stride_mix, T);
    cuda_result r;
    if ((r = cuda_use(dev)) || (r = cuda_scratch(&d->moe, &d->moe_cap, o.end))) {
        cuda_fail("a layer on the device", r);
        return -1;
    }
    const struct cuda_moe_inputs in = cuda_moe_inputs_of(d, L, o);
    if (!mixer) {
        uint8_t *stage = cuda_stage(o.y);
        cuda_moe_fill(L, o, stage, o.norm, o.next_norm, T);
        memcpy(stage + o.x, x, (size_t)T * dim * 4);
        memcpy(stage + o.mix, mix, stride_mix * (size_t)T);
    }
    if ((L->dn ? (r = cuda_deltanet_launch(d, L, o, stride_mix, T))
               : L->attn ? (r = cuda_attention_launch(d, L, o, stride_mix, T))
                         : (r = cuda_htod(d->moe + o.shared, cuda.stage + o.shared, o.y - o.shared))) ||
        (r = cuda_moe_layer_front(d, L, o, stride_mix, T)) || (L->split && (r = cuda_dtoh(routing, d->moe + o.xn, o.out - o.xn))) ||
        (r = cuda_moe_launch(d, &L->sh, in.jobs, d->moe + o.au, ops_act_stride_of(L->sh.up_type, dim), n, d->moe + o.work)) ||
        (apart && (r = cuda_moe_launch(d, &L->shexp_sh, in.jobs + o.shared, d->moe + o.as, ops_act_stride_of(L->shexp_sh.up_type, dim), T,
                                       d->moe + o.swork))) ||
        (!L->split && (r = cuda_moe_layer_end(d, L, o, T))) || ((L->split || !L->keep) && (r = cuda_window_end()))) {
        cuda_fail("a layer on the device", r);
        return -1;
    }
    cuda.waits += L->split;
    if (L->keep && !L->split) cuda_moe_kept(d);
    return 0;
}

/* A split layer's end (cuda_moe_layer_start): the outputs of the CPU's CPU_JOBS experts in
 * CPU_Y [T * used][dim] (rows of the device's experts unread) up, then the sum and the next
 * layer's start. Returns 0, or -1 after cuda_fail. */
static int cuda_moe_layer_resume(int dev, const struct cuda_moe_layer *L, size_t stride_mix, const float *cpu_y, int cpu_jobs, int T)
{
    struct cuda_device *d = &cuda.dev[dev];
    if (!cuda.ready) return -1;
    const struct cuda_moe_layout o = cuda_moe_layout_of(L, stride_mix, T);
    cuda_result r;
    if ((r = cuda_use(dev)) || (r = cuda_htod(d->moe + o.cpu_y, cpu_y, (size_t)T * L->used * L->sh.dim * 4)) || (r = cuda_moe_layer_end(d, L, o, T)) ||
        (!L->keep && (r = cuda_window_end()))) {
        cuda_fail("a layer on the device", r);
        return -1;
    }
    d->moe_jobs -= cpu_jobs; /* the count of experts' FFNs the device ran */
    if (L->keep) cuda_moe_kept(d);
    return 0;
}

/* Downloads the outputs of device DEV's batch in flight into OUT (waiting for its kernels): a
 * batch's [jobs][dim] floats, a layer's as cuda_moe_layer_start says. Returns 0, or -1 when the
 * GPU path has ended (the caller computes the jobs). */
static int cuda_moe_finish(int dev, void *out)
{
    struct cuda_device *d = &cuda.dev[dev];
    int n = d->moe_jobs;
    cuda_result r;
    d->moe_jobs = 0;
    if (!cuda.ready) return -1;
    if ((r = cuda_use(dev)) || (r = cuda_dtoh(out, d->moe + d->moe_out, d->moe_bytes))) {
        cuda_fail("experts on the device", r);
        return -1;
    }
    cuda.waits++;
    cuda.batches++;
    cuda.jobs += n;
    return 0;
}

/* ---- chains: mixers run where the layer before left their inputs ----
 * A layer whose projections the layer before made on the same device (its rest kept there,
 * KEEP; layer 0's: cuda_chain_first, from the embedded rows) runs its mixer there too (DN: a
 * DeltaNet over its sequences' recurrent states held in device memory; ATTN: attention over
 * their KV caches there), and its rest after it: nothing crosses the bus between them. A pass
 * uploads once, before its first layer, what its chained layers need (cuda_chain_begin); a
 * chain's ids come back after its last layer (cuda_chain_ids). A sequence's states on a device are one allocation laid out as coli's
 * checkpoints, its KV caches another laid out as the CPU's (§8 keeps which copy is current). */

/* Device DEV's chain buffer for a pass: BYTES of STAGE (a head of what each token's mixers
 * read, the state addresses first; room for the ids; the chained layers' blocks: §8's
 * model_chain_head_of) uploaded. Returns its address, or 0 after cuda_fail. */
static cuda_ptr cuda_chain_begin(int dev, const uint8_t *stage, size_t bytes)
{
    struct cuda_device *d = &cuda.dev[dev];
    cuda_result r;
    if (!cuda.ready) return 0;
    if ((r = cuda_use(dev)) || (r = cuda_scratch(&d->chain, &d->chain_cap, bytes)) || (r = cuda_htod(d->chain, stage, bytes))) {
        cuda_fail("a chain of layers on the device", r);
        return 0;
    }
    return d->chain;
}

/* Downloads BYTES of ids from AT (in device DEV's chain buffer) into OUT, after the chain's last
 * layer came back (nothing left to wait for). Returns 0, or -1 after cuda_fail. */
static int cuda_chain_ids(int dev, cuda_ptr at, int *out, size_t bytes)
{
    cuda_result r;
    if (!cuda.ready) return -1;
    if ((r = cuda_use(dev)) || (r = cuda_dtoh(out, at, bytes))) {
        cuda_fail("a chain of layers on the device", r);
        return -1;
    }
    return 0;
}

/* The first layer's start in a chain on device DEV, from the embedded rows X [T][dim] and its
 * input norm NORM (both in the chain buffer): the norm and its N mixer projections W[j]
 * (resident at W_PTR[j]: cuda_project) into the layer scratch, kept there for the layer's
 * mixer as a layer before it would have. Returns 0, or -1 after cuda_fail. */
static int cuda_chain_first(int dev, cuda_ptr x, cuda_ptr norm, const struct ops_matrix *w, const cuda_ptr *w_ptr, int n, int dim, float eps,
                            int T)
{
    struct cuda_device *d = &cuda.dev[dev];
    cuda_ptr act[CUDA_NEXT_MAX], out[CUDA_NEXT_MAX];
    size_t at = cuda_align((size_t)T * (size_t)dim * 4), acts[CUDA_NEXT_MAX];
    for (int j = 0; j < n; j++) { /* xn, the activations a type, the outputs */
        int same = 0;
        while (w[same].type != w[j].type) same++;
        acts[j] = same < j ? acts[same] : at;
        at += same < j ? 0 : cuda_align(ops_act_stride_of(w[j].type, dim) * (size_t)T);
    }
    size_t need = at;
    for (int j = 0; j < n; j++) need += cuda_align((size_t)T * (size_t)w[j].rows * 4);
    cuda_result r;
    if (!cuda.ready) return -1;
    if ((r = cuda_use(dev)) || (r = cuda_scratch(&d->moe, &d->moe_cap, need))) {
        cuda_fail("a chain of layers on the device", r);
        return -1;
    }
    for (int j = 0; j < n; j++) {
        act[j] = d->moe + acts[j];
        out[j] = d->moe + at;
        at += cuda_align((size_t)T * (size_t)w[j].rows * 4);
    }
    if ((r = cuda_project(d, x, norm, d->moe, w, w_ptr, act, out, n, dim, eps, T))) {
        cuda_fail("a chain of layers on the device", r);
        return -1;
    }
    d->kept_x = x;
    for (int j = 0; j < n; j++) d->kept_next[j] = out[j];
    return 0;
}

/* A mixer's constants on device DEV (struct cuda_deltanet's TAPS..NORM, or cuda_attention's
 * norms: N parts, one allocation listed under the first), made resident there on first use.
 * The address, or 0 where they do not fit (they stay the CPU's: not a failure). */
static cuda_ptr cuda_floats_resident(int dev, const float *const *src, const size_t *bytes, int n)
{
    const struct cuda_resident *r = cuda_resident_of((const uint8_t *)src[0]);
    if (r) return r->dev == dev ? r->ptr : 0;
    return cuda_upload(dev, (const uint8_t *const *)src, bytes, n, 1);
}

/* Room for a sequence's recurrent states or KV caches on device DEV (BYTES, charged to its
 * budget): its address, or 0 where it does not fit. */
static cuda_ptr cuda_state_alloc(int dev, size_t bytes)
{
    cuda_ptr p = 0;
    if (!cuda_fits(dev, bytes) || cuda_use(dev) || cuda_mem_alloc(&p, bytes)) return 0;
    cuda.dev[dev].states += (int64_t)bytes;
    return p;
}

static void cuda_state_free(int dev, cuda_ptr p, size_t bytes)
{
    if (cuda.ready && cuda_use(dev) == 0) cuda_mem_free(p);
    cuda.dev[dev].states -= (int64_t)bytes;
}

/* Copies BYTES between HOST and P on device DEV (UP: to the device). Returns 0, or -1 after
 * cuda_fail. */
static int cuda_state_copy(int dev, cuda_ptr p, float *host, size_t bytes, int up)
{
    cuda_result r;
    if (!cuda.ready) return -1;
    if ((r = cuda_use(dev)) || (r = up ? cuda_htod(p, host, bytes) : cuda_dtoh(host, p, bytes))) {
        cuda_fail("a conversation's state copied to or from the device", r);
        return -1;
    }
    cuda.waits += !up;
    return 0;
}

/* The probe of device DEV for routed experts: a batch of N_JOBS jobs (at most
 * CUDA_PROBE_JOBS) over expert W of shape SH on one column, as decode runs one
 * (cuda_moe_start, then cuda_moe_finish), CUDA_PROBE_REPS times after one to warm up, timed by
 * the device's events. W is uploaded for it and freed after. Returns the seconds per batch, or
 * -1 when the device cannot say (no events, no kernels or room for it; a failed call ends the
 * GPU path as anywhere else). */
#define CUDA_PROBE_JOBS 16
static double cuda_probe_experts(int dev, const struct cuda_moe_shape *sh, const struct ops_matrix w[3], int n_jobs)
{
    struct cuda_expert e;
    struct cuda_moe_job jobs[CUDA_PROBE_JOBS];
    cuda_handle ev[2] = {NULL, NULL};
    float ms = 0;
    if (!cuda_api.event_create || !cuda_api.event_record || !cuda_api.event_sync || !cuda_api.event_elapsed || !cuda_api.event_destroy ||
        n_jobs > CUDA_PROBE_JOBS || !cuda_moe_supported(dev, sh) || cuda_expert_upload(dev, w, &e))
        return -1;
    for (int j = 0; j < n_jobs; j++) jobs[j] = (struct cuda_moe_job){e, 0, 0};
    size_t stride = ops_act_stride(&w[0]);
    uint8_t *act = plat_alloc_aligned(stride);
    float *x = plat_zalloc((size_t)sh->dim, sizeof *x), *out = plat_alloc((size_t)n_jobs * (size_t)sh->dim * sizeof *out);
    quant_act_prepare(sh->up_type, x, sh->dim, act);
    int ok = !cuda_event_create(&ev[0]) && !cuda_event_create(&ev[1]);
    for (int i = -1; i < CUDA_PROBE_REPS && ok; i++) {
        if (i == 0) ok = !cuda_event_record(ev[0], NULL);
        ok = ok && !cuda_moe_start(dev, sh, jobs, n_jobs, act, stride, 1) && !cuda_moe_finish(dev, out);
    }
    ok = ok && !cuda_event_record(ev[1], NULL) && !cuda_event_sync(ev[1]) && !cuda_event_elapsed(&ms, ev[0], ev[1]);
    for (int i = 0; i < 2; i++)
        if (ev[i]) cuda_event_destroy(ev[i]);
    if (cuda.ready) cuda_expert_free(dev, &e);
    free(act);
    free(x);
    free(out);
    return ok ? ms / 1e3 / CUDA_PROBE_REPS : -1;
}

/* ==== §6 experts ==== */
/* Owns: the routed experts of every layer as units (expert e of layer l: its slices of the
 *   merged ffn_{gate,up,down}_exps tensors), the RAM cache that holds a byte budget of them,
 *   the reader threads that fill it with pread, heat (how often each expert is routed,
 *   decayed) and its file, and the hit / read / prefetch statistics.
 * Promises: the matrices handed out hold exactly the file's bytes, so products over them are
 *   the products over the mapping, bit for bit. A failed or short read is never handed
 *   out: the layer gets nothing more from expert_next, and expert_recover reports the read's
 *   `FILE: ...` message and leaves the store as if it had never been asked. Only the main thread
 *   calls expert_* (reader threads touch only the slot they load and the store's queue,
 *   under its mutex). The store never touches the mapping's expert bytes when it caches,
 *   so the page cache does not hold a second copy (O_DIRECT; see EXPERT_IO_*). In mapped
 *   mode (budget < 0: everything fits) there is no cache: experts are handed out in place,
 *   from the mapping or, when memory holds the file's pages beside them (cfg.own), from the
 *   store's own copy (expert_own); only heat and statistics are kept.
 * May call: §1–§4, §5 (struct cuda_expert; whether the GPU path is still up), pthreads.
 * Workload: per decoded token, n_layers lookups of n_expert_used experts (320 on the
 *   35B-A3B, 1.77 MB each at Q4_0); a prompt batch of 64 tokens wants ~220 of 256 per layer.
 *   A miss is three preads of one expert's slices, done by EXPERT_READERS threads. */

#define EXPERT_READERS 4          /* reads in flight: 1.5 GB/s while reading, O_DIRECT, on a virtio disk rated ~1.1 GB/s */
#define EXPERT_ALIGN 4096         /* O_DIRECT needs offsets, lengths and buffers in disk blocks */
#define EXPERT_MIN_SLOTS 4        /* one computing, one loading, two pinned at most */
#define EXPERT_HEAT_VERSION 1
#define EXPERT_HEAT_HALF_LIFE 4096 /* tokens: heat halves over about a long conversation */
#define EXPERT_REPIN_TOKENS 64    /* tokens between re-choosing the pinned (hottest) experts */

/* One merged tensor of a layer: expert e is `m` with its data moved by e * stride bytes
 * (in the mapping). */
struct expert_tensor {
    struct ops_matrix m;
    size_t stride;
};

/* Where expert 0 of one merged tensor lies in the files, and one expert's bytes. */
struct expert_source {
    struct expert_tensor t;
    int part;
    uint64_t offset;  /* of expert 0 in its part */
    size_t bytes;     /* of one expert */
};

enum expert_io { EXPERT_IO_DIRECT, EXPERT_IO_BUFFERED };
enum expert_phase { EXPERT_PHASE_PROMPT, EXPERT_PHASE_DECODE };
enum expert_state { EXPERT_FREE, EXPERT_LOADING, EXPERT_READY, EXPERT_FAILED };

struct expert_config {
    int64_t budget;          /* bytes of cache; < 0: mapped mode (no cache) */
    const char *heat_path;   /* read at open, written by expert_heat_save; NULL: none */
    uint64_t fingerprint;    /* identifies the model a heat file belongs to */
    enum expert_io io;
    int own;                 /* mapped mode: copy the experts into the store's memory (expert_own) */
};

/* One cache entry: the three slices of one expert, each at part_cap[j] from buf. */
struct expert_slot {
    int32_t key;      /* layer * n_expert + expert; -1 when free */
    int state;        /* enum expert_state */
    int refs;         /* holders on the main thread; > 0: not evictable */
    int pinned;       /* one of the hottest: never evicted */
    int prev, next;   /* LRU list (evictable slots only) or free list; -1 ends */
    uint8_t *buf;     /* [slot_bytes] */
};

struct expert_stats {
    uint64_t lookups[2], hits[2], inflight[2]; /* [phase]: wanted; in memory; being read */
    uint64_t vram[2];                          /* [phase]: wanted and resident on a device */
    uint64_t predicted[2], predicted_used[2];  /* [phase]: prefetch guesses, guesses routed */
    uint64_t routed_seen[2];                   /* [phase]: routed experts where a guess was made */
    uint64_t bytes_read, reads, prefetches, warm_reads;
    double busy_s;   /* wall time with at least one read in flight */
    double wait_s[2]; /* [phase]: main thread blocked on reads */
    uint64_t swaps, swap_bytes; /* re-tiering (§7 place_retier): experts brought into VRAM, their bytes */
    double window_vram;         /* the share of routed experts VRAM served over the last re-tiering window */
    int windows;                /* re-tiering windows ended (none: window_vram is not set) */
};

struct expert_store {
    const struct gguf_file *file;
    int n_layers, n_expert, mapped, phase;
    struct expert_source (*src)[3];       /* [n_layers][gate, up, down] */
    struct expert_config cfg;
    /* cache */
    size_t part_cap[3], slot_bytes;       /* largest aligned slice over the layers */
    int n_slots, n_pin;
    struct expert_slot *slots;            /* [n_slots] */
    uint8_t *arena;                       /* [n_slots][slot_bytes], touched only when filled */
    int32_t *slot_of;                     /* [n_layers * n_expert] slot, or -1 */
    int lru_head, lru_tail, free_head;    /* head: least recently used */
    uint8_t *pin;                         /* [n_layers * n_expert] among the n_pin hottest */
    /* readers */
    int fds[GGUF_MAX_PARTS];
    pthread_t readers[EXPERT_READERS];
    int n_readers, stop, in_flight;
    double busy_since;
    pthread_mutex_t mu;
    pthread_cond_t wake, done;            /* readers wait on wake, the main thread on done */
    int *queue, q_head, q_len;            /* ring of slots to read, [n_slots] */
    int32_t *warm;                        /* keys to read while idle, hottest first */
    int n_warm, warm_next;
    char error[600];                      /* first failed read; empty while none */
    /* heat */
    float *heat;                          /* [n_layers * n_expert] routed tokens, decayed */
    double heat_tokens;                   /* tokens counted, decayed the same way */
    int heat_loaded;                      /* the heat file was read and fits this model */
    int decay_tokens, repin_tokens;       /* since the last decay / re-pin */
    /* the layer being computed */
    int layer, n_want, n_done, held;      /* held: the slot handed out, or -1 */
    int *want, *want_slot;                /* [n_expert] ids routed in this layer; slot held or -1 */
    uint8_t *guess;                       /* [n_expert] prefetch guesses for guess_layer */
    void *own;                            /* mapped mode: the experts' own copy (expert_own), or NULL */
    size_t own_bytes;
    uint8_t *hole;                        /* [n_layers * n_expert] 1: left out of own (in VRAM then); or NULL */
    int guess_layer;
    /* the VRAM tier (§7 place_model fills it, place_retier changes it; NULL: none) */
    struct expert_vram { int dev; struct cuda_expert e; } *vram; /* [n_layers * n_expert], dev -1: not resident */
    int32_t swap_key[CUDA_MAX_DEVICES];   /* the expert each device is uploading in the background; -1 none */
    struct cuda_expert swap_e[CUDA_MAX_DEVICES];
    int retier_tokens;                    /* since the re-tiering window began */
    uint64_t window_lookups, window_vram; /* the lookups and VRAM uses when the window began */
    int *on_device, n_on_device;          /* [n_expert] wanted ids of the layer being computed that are resident */
    struct expert_stats stats;
    /* mapped in place: the thread that maps the experts' pages ahead (expert_map_ahead) */
    pthread_t mapper;
    int mapper_on, mapper_stop;           /* mapper_stop: atomic */
    struct expert_range { uintptr_t lo, hi; } *map_ranges; /* [n_map_ranges] page-aligned */
    int n_map_ranges;
    size_t map_ahead_bytes;               /* mapped; with map_ahead_s, valid once the thread is joined */
    double map_ahead_s;
};


static size_t expert_round_up(size_t n) { return (n + EXPERT_ALIGN - 1) & ~(size_t)(EXPERT_ALIGN - 1); }

/* Whether expert KEY runs on a device: resident there, and the GPU path still up. */
static int expert_in_vram(const struct expert_store *s, int32_t key) { return s->vram && cuda.ready && s->vram[key].dev >= 0; }

/* Expert E of a merged tensor, read in place from the mapping. */
static struct ops_matrix expert_mapped(const struct expert_tensor *t, int e)
{
    struct ops_matrix m = t->m;
    m.data += (size_t)e * t->stride;
    return m;
}

/* Where expert E of layer L's matrix J is in the file's mapping. */
static const uint8_t *expert_file_slice(const struct expert_store *s, int l, int j, int e)
{
    const struct expert_source *src = &s->src[l][j];
    return s->file->parts[src->part].data + src->offset + (size_t)e * src->t.stride;
}

/* Mapped mode with an own copy: expert KEY's place there filled from the file if expert_own
 * left it out, before the CPU reads it. Main thread only. Only a device leaves holes, and with
 * one the copy is never interleaved. */
static void expert_fill_hole(struct expert_store *s, int32_t key)
{
    if (!s->hole || !s->hole[key]) return;
    int l = key / s->n_expert, e = key % s->n_expert;
    for (int j = 0; j < 3; j++) {
        const struct expert_tensor *t = &s->src[l][j].t;
        memcpy((uint8_t *)t->m.data + (size_t)e * t->stride, expert_file_slice(s, l, j, e), t->stride); /* the arena: writable */
    }
    s->hole[key] = 0;
}

static void expert_lru_unlink(struct expert_store *s, int i)
{
    struct expert_slot *x = &s->slots[i];
    if (x->prev >= 0) s->slots[x->prev].next = x->next;
    else s->lru_head = x->next;
    if (x->next >= 0) s->slots[x->next].prev = x->prev;
    else s->lru_tail = x->prev;
    x->prev = x->next = -1;
}

/* To the most recently used end. */
static void expert_lru_append(struct expert_store *s, int i)
{
    struct expert_slot *x = &s->slots[i];
    x->prev = s->lru_tail;
    x->next = -1;
    if (s->lru_tail >= 0) s->slots[s->lru_tail].next = i;
    else s->lru_head = i;
    s->lru_tail = i;
}

static int expert_listed(const struct expert_store *s, int i) { return s->slots[i].prev >= 0 || s->lru_head == i; }

/* The LRU list holds exactly the slots that may be evicted: read, unheld, not pinned. Call
 * after any change to a slot's state, refs or pinned (under mu). */
static void expert_relist(struct expert_store *s, int i)
{
    const struct expert_slot *x = &s->slots[i];
    int should = x->state == EXPERT_READY && x->refs == 0 && !x->pinned;
    if (expert_listed(s, i) == should) return;
    if (should) expert_lru_append(s, i);
    else expert_lru_unlink(s, i);
}

/* A slot to read into: a free one, else the least recently used evictable one, forgotten.
 * -1 when every slot is pinned, held or being read. Under mu. */
static int expert_victim(struct expert_store *s)
{
    int i = s->free_head;
    if (i >= 0) {
        s->free_head = s->slots[i].next;
        s->slots[i].next = -1;
        return i;
    }
    i = s->lru_head;
    if (i < 0) return -1;
    s->slots[i].state = EXPERT_FREE;
    expert_relist(s, i);
    s->slot_of[s->slots[i].key] = -1;
    s->slots[i].key = -1;
    return i;
}

/* Puts KEY in slot I as being read, held REFS times. Under mu. */
static void expert_claim(struct expert_store *s, int i, int32_t key, int refs)
{
    struct expert_slot *x = &s->slots[i];
    x->key = key;
    x->state = EXPERT_LOADING;
    x->refs = refs;
    x->pinned = s->pin[key];
    s->slot_of[key] = i;
}

/* Queues a read of KEY for the readers; returns its slot, or -1 when no slot can be had
 * without waiting. Under mu. */
static int expert_start_read(struct expert_store *s, int32_t key, int refs)
{
    int i = expert_victim(s);
    if (i < 0) return -1;
    expert_claim(s, i, key, refs);
    s->queue[(s->q_head + s->q_len) % s->n_slots] = i;
    s->q_len++;
    pthread_cond_signal(&s->wake);
    return i;
}

/* Where slice J (gate, up, down) of the expert in slot I starts. */
static uint8_t *expert_slice(const struct expert_store *s, int i, int j)
{
    size_t at = 0;
    for (int k = 0; k < j; k++) at += s->part_cap[k];
    return s->slots[i].buf + at;
}

/* Reads the three slices of KEY into slot I: whole disk blocks around each slice (O_DIRECT
 * needs them), the slice landing at its offset within its first block. Returns 0, or -1
 * with MSG saying why. Runs on a reader thread without the lock: the slot is LOADING, so
 * nobody else touches its buffer. */
static int expert_read(struct expert_store *s, int i, int32_t key, char *msg, size_t n)
{
    int layer = key / s->n_expert, e = key % s->n_expert;
    const struct expert_source *src = s->src[layer];
    for (int j = 0; j < 3; j++) {
        uint64_t off = src[j].offset + (uint64_t)e * src[j].t.stride;
        uint64_t a0 = off & ~(uint64_t)(EXPERT_ALIGN - 1), need = off + src[j].bytes - a0;
        size_t span = expert_round_up((size_t)need), got = 0;
        int fd = s->fds[src[j].part];
        uint8_t *dst = expert_slice(s, i, j);
        while (got < need) {
            ssize_t r = pread(fd, dst + got, span - got, (off_t)(a0 + got));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                snprintf(msg, n, "%s: reading expert %d of layer %d failed: %s", s->file->path, e, layer,
                         r < 0 ? strerror(errno) : "the file ended early (truncated while running?)");
                return -1;
            }
            got += (size_t)r;
        }
        if (s->cfg.io == EXPERT_IO_BUFFERED) posix_fadvise(fd, (off_t)a0, (off_t)span, POSIX_FADV_DONTNEED);
    }
    return 0;
}

/* Frees slot I, whose read failed and which nobody holds: the expert is read again when next
 * routed. Under mu. */
static void expert_free_failed(struct expert_store *s, int i)
{
    struct expert_slot *x = &s->slots[i];
    s->slot_of[x->key] = -1;
    *x = (struct expert_slot){-1, EXPERT_FREE, 0, 0, -1, s->free_head, x->buf};
    s->free_head = i;
}

/* The next slot a reader should fill: a queued read, else the next expert of the warm list
 * while free slots last (warming never evicts) and fewer than half the readers are busy, so
 * that a routed expert's read never queues behind more than two warming reads. -1: nothing
 * to do. Under mu. */
static int expert_next_job(struct expert_store *s)
{
    if (s->q_len > 0) {
        int i = s->queue[s->q_head];
        s->q_head = (s->q_head + 1) % s->n_slots;
        s->q_len--;
        return i;
    }
    while (s->warm_next < s->n_warm && s->free_head >= 0 && s->in_flight < EXPERT_READERS / 2) {
        int32_t key = s->warm[s->warm_next++];
        if (s->slot_of[key] >= 0) continue;
        int i = expert_victim(s);
        expert_claim(s, i, key, 0);
        s->stats.warm_reads++;
        return i;
    }
    return -1;
}

static void *expert_reader(void *arg)
{
    struct expert_store *s = arg;
    char msg[sizeof s->error];
    pthread_mutex_lock(&s->mu);
    for (;;) {
        int i = -1;
        while (!s->stop && (i = expert_next_job(s)) < 0) pthread_cond_wait(&s->wake, &s->mu);
        if (s->stop) break;
        int32_t key = s->slots[i].key;
        if (s->in_flight++ == 0) s->busy_since = plat_now();
        pthread_mutex_unlock(&s->mu);
        int bad = expert_read(s, i, key, msg, sizeof msg);
        pthread_mutex_lock(&s->mu);
        if (--s->in_flight == 0) s->stats.busy_s += plat_now() - s->busy_since;
        /* A failed read fails the forward pass only if it holds the slot; one nobody holds (a
         * warming read, or one whose pass has failed already and let go) must not fail the next. */
        if (bad && s->slots[i].refs == 0) expert_free_failed(s, i);
        else if (bad) {
            if (!s->error[0]) memcpy(s->error, msg, sizeof msg);
            s->slots[i].state = EXPERT_FAILED; /* freed by expert_recover */
        } else {
            const struct expert_source *src = s->src[key / s->n_expert];
            s->stats.bytes_read += src[0].bytes + src[1].bytes + src[2].bytes;
            s->stats.reads++;
            s->slots[i].state = EXPERT_READY;
            expert_relist(s, i);
        }
        pthread_cond_broadcast(&s->done);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* Keeps the page cache free of expert bytes: drops what is cached of them (left by an earlier
 * run, or read around a fault on a neighbouring trunk tensor: the disk reads ahead 8 MiB
 * here), and at open (MAP) tells the kernel not to read ahead around them in the mapping,
 * which the store never touches. */
static void expert_forget_mapping(struct expert_store *s, int map)
{
    long page = sysconf(_SC_PAGESIZE);
    for (int l = 0; l < s->n_layers; l++)
        for (int j = 0; j < 3; j++) {
            const struct expert_source *src = &s->src[l][j];
            size_t len = src->t.stride * (size_t)s->n_expert;
            posix_fadvise(s->fds[src->part], (off_t)src->offset, (off_t)len, POSIX_FADV_DONTNEED);
            uintptr_t a = ((uintptr_t)src->t.m.data + (uintptr_t)page - 1) & ~(uintptr_t)(page - 1);
            uintptr_t b = ((uintptr_t)src->t.m.data + len) & ~(uintptr_t)(page - 1);
            if (map && b > a) madvise((void *)a, b - a, MADV_RANDOM);
        }
}

/* Whether a read has failed since the last expert_recover: the layer being computed cannot
 * be finished, so expert_next hands nothing more out. Under mu. */
static int expert_failed(const struct expert_store *s) { return s->error[0] != 0; }

/* After a layer: 0 when every read went well. Else 1, with the first failed read's message in
 * MSG: the layer's holds are let go and the failed slots freed, so that the store serves the
 * next forward pass as if the failed reads had never been asked for (they are tried again
 * when next routed). Main thread. */
static int expert_recover(struct expert_store *s, char *msg, size_t n)
{
    if (s->mapped) return 0;
    pthread_mutex_lock(&s->mu);
    int failed = expert_failed(s);
    if (failed) {
        snprintf(msg, n, "%s", s->error);
        for (int k = s->n_done; k < s->n_want; k++)
            if (s->want_slot[k] >= 0) {
                s->slots[s->want_slot[k]].refs--;
                expert_relist(s, s->want_slot[k]);
            }
        s->n_done = s->n_want;
        for (int i = 0; i < s->n_slots; i++)
            if (s->slots[i].state == EXPERT_FAILED && !s->slots[i].refs) expert_free_failed(s, i);
        s->error[0] = 0;
    }
    pthread_mutex_unlock(&s->mu);
    return failed;
}

struct expert_rank {
    float heat;
    int32_t key;
};

/* Hottest first; the lower key first on ties, so the order is reproducible. */
static int expert_rank_cmp(const void *a, const void *b)
{
    const struct expert_rank *x = a, *y = b;
    if (x->heat != y->heat) return x->heat < y->heat ? 1 : -1;
    return (x->key > y->key) - (x->key < y->key);
}

/* Every expert with heat > 0 that the CPU computes (not in VRAM), hottest first, into OUT
 * [n_layers * n_expert]; returns how many. Pinning and warming go by it. */
static int expert_rank_by_heat(const struct expert_store *s, int32_t *out)
{
    int n = s->n_layers * s->n_expert, k = 0;
    struct expert_rank *r = plat_alloc((size_t)n * sizeof *r);
    for (int i = 0; i < n; i++)
        if (s->heat[i] > 0 && !expert_in_vram(s, i)) r[k++] = (struct expert_rank){s->heat[i], i};
    qsort(r, (size_t)k, sizeof *r, expert_rank_cmp);
    for (int i = 0; i < k; i++) out[i] = r[i].key;
    free(r);
    return k;
}

/* Pins the n_pin hottest experts (LFU for half the cache: with a skewed routing the hottest
 * pay most; the other half is LRU, for experts that recur over nearby tokens). Under mu. */
static void expert_repin(struct expert_store *s)
{
    size_t n = (size_t)s->n_layers * (size_t)s->n_expert;
    int32_t *order = plat_alloc(n * sizeof *order);
    int k = expert_rank_by_heat(s, order);
    memset(s->pin, 0, n);
    for (int i = 0; i < k && i < s->n_pin; i++) s->pin[order[i]] = 1;
    free(order);
    for (int i = 0; i < s->n_slots; i++) {
        struct expert_slot *x = &s->slots[i];
        if (x->key < 0 || x->pinned == s->pin[x->key]) continue;
        x->pinned = s->pin[x->key];
        expert_relist(s, i);
    }
}

/* Counts T more tokens: decays heat (half-life EXPERT_HEAT_HALF_LIFE tokens, applied every
 * 256 tokens, which costs one pass over n_layers * n_expert floats) and re-pins now and then.
 * Returns whether it re-pinned. */
static int expert_heat_tick(struct expert_store *s, int T)
{
    s->heat_tokens += T;
    s->decay_tokens += T;
    s->repin_tokens += T;
    if (s->decay_tokens >= 256) {
        float f = (float)pow(0.5, (double)s->decay_tokens / EXPERT_HEAT_HALF_LIFE);
        for (int i = 0; i < s->n_layers * s->n_expert; i++) s->heat[i] *= f;
        s->heat_tokens *= f;
        s->decay_tokens = 0;
    }
    if (s->mapped || s->repin_tokens < EXPERT_REPIN_TOKENS) return 0;
    expert_repin(s);
    s->repin_tokens = 0;
    return 1;
}

/* The heat file: "COLIHEAT", u32 version, u32 n_layers, u32 n_expert, u32 0, u64 model
 * fingerprint, f64 tokens, f32 heat[n_layers][n_expert], u64 FNV-1a of all bytes before it.
 * Little-endian (coli is x86-64 only). */
#define EXPERT_HEAT_HEADER 40

static uint64_t expert_fnv(const uint8_t *p, size_t n)
{
    uint64_t h = 14695981039346656037ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

/* Why the heat file image BUF [n] cannot be used, or NULL when it can. */
static const char *expert_heat_check(const struct expert_store *s, const uint8_t *buf, size_t n)
{
    size_t cells = (size_t)s->n_layers * (size_t)s->n_expert;
    uint32_t v[4];
    uint64_t fp, sum;
    if (n < EXPERT_HEAT_HEADER + 8 || memcmp(buf, "COLIHEAT", 8)) return "not a coli heat file";
    memcpy(v, buf + 8, sizeof v);
    if (v[0] != EXPERT_HEAT_VERSION) return "a heat file of another version";
    memcpy(&sum, buf + n - 8, 8);
    if (sum != expert_fnv(buf, n - 8)) return "corrupt (checksum mismatch)";
    memcpy(&fp, buf + 24, 8);
    if (v[1] != (uint32_t)s->n_layers || v[2] != (uint32_t)s->n_expert || fp != s->cfg.fingerprint)
        return "written for another model";
    if (n != EXPERT_HEAT_HEADER + cells * 4 + 8) return "corrupt (wrong size)";
    for (size_t i = 0; i < cells; i++) {
        float h;
        memcpy(&h, buf + EXPERT_HEAT_HEADER + 4 * i, 4);
        if (!(h >= 0 && h < 1e30f)) return "corrupt (a value out of range)";
    }
    return NULL;
}

/* Loads heat from cfg.heat_path when that file exists; a bad one is ignored with one line.
 * Returns whether heat was loaded. */
static int expert_heat_load(struct expert_store *s)
{
    const char *path = s->cfg.heat_path;
    struct plat_map map;
    if (!path || plat_map_file(path, &map) != 0) return 0;
    const char *why = expert_heat_check(s, map.data, map.size);
    if (why) plat_log("[experts] heat file %s: %s; ignored, starting cold", path, why);
    else {
        memcpy(s->heat, map.data + EXPERT_HEAT_HEADER, (size_t)s->n_layers * (size_t)s->n_expert * 4);
        memcpy(&s->heat_tokens, map.data + 32, 8);
    }
    plat_unmap_file(&map);
    return why == NULL;
}

/* Writes the heat to cfg.heat_path (through a temporary file and rename, so a reader never
 * sees half a file), creating its directory if missing. A failure is one line, not fatal:
 * heat changes speed only. */
static void expert_heat_save(const struct expert_store *s)
{
    const char *path = s->cfg.heat_path;
    if (!path || s->heat_tokens <= 0) return;
    size_t cells = (size_t)s->n_layers * (size_t)s->n_expert, n = EXPERT_HEAT_HEADER + cells * 4 + 8;
    uint8_t *buf = plat_zalloc(n, 1);
    uint32_t v[4] = {EXPERT_HEAT_VERSION, (uint32_t)s->n_layers, (uint32_t)s->n_expert, 0};
    memcpy(buf, "COLIHEAT", 8);
    memcpy(buf + 8, v, sizeof v);
    memcpy(buf + 24, &s->cfg.fingerprint, 8);
    memcpy(buf + 32, &s->heat_tokens, 8);
    memcpy(buf + EXPERT_HEAT_HEADER, s->heat, cells * 4);
    uint64_t sum = expert_fnv(buf, n - 8);
    memcpy(buf + n - 8, &sum, 8);
    char *tmp = plat_alloc(strlen(path) + 32), *dir = plat_strdup(path);
    for (char *p = strchr(dir + 1, '/'); p; p = strchr(p + 1, '/')) { /* mkdir -p of the directory */
        *p = 0;
        mkdir(dir, 0755);
        *p = '/';
    }
    sprintf(tmp, "%s.%ld.tmp", path, (long)getpid());
    FILE *f = fopen(tmp, "wbe");
    int ok = f && fwrite(buf, 1, n, f) == n;
    ok = (f && fclose(f) == 0) && ok && rename(tmp, path) == 0;
    if (!ok) {
        plat_log("[experts] cannot save heat to %s: %s", path, strerror(errno));
        unlink(tmp);
    }
    free(dir);
    free(tmp);
    free(buf);
}

/* The heat file to use when neither --heat nor HEAT_FILE names one: MODEL.heat beside the
 * model if it exists (shipped with it), else $XDG_CACHE_HOME/coli or ~/.cache/coli, named
 * after the model and its fingerprint (model directories are often read-only or shared).
 * Returns an allocated path. */
static char *expert_heat_default(const char *model_path, uint64_t fingerprint)
{
    size_t n = strlen(model_path) + 512;
    char *path = plat_alloc(n);
    snprintf(path, n, "%s.heat", model_path);
    if (access(path, R_OK) == 0) return path;
    const char *base = strrchr(model_path, '/'), *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    base = base ? base + 1 : model_path;
    if (xdg && *xdg == '/') snprintf(path, n, "%s/coli/%s.%016llx.heat", xdg, base, (unsigned long long)fingerprint);
    else if (home && *home == '/') snprintf(path, n, "%s/.cache/coli/%s.%016llx.heat", home, base, (unsigned long long)fingerprint);
    return path;
}

/* A consistent copy of the statistics (the readers update them), busy time up to now. */
static struct expert_stats expert_stats_get(struct expert_store *s)
{
    if (s->mapped) return s->stats;
    pthread_mutex_lock(&s->mu);
    struct expert_stats st = s->stats;
    if (s->in_flight > 0) st.busy_s += plat_now() - s->busy_since;
    pthread_mutex_unlock(&s->mu);
    return st;
}

/* Tells the store whether prompt tokens or decoded tokens follow (for the statistics). The
 * first decoded token ends warming: from then on the disk serves the decode's own misses and
 * prefetches, and on two cores every reader wake-up stalls the OpenMP team. */
static void expert_phase(struct expert_store *s, enum expert_phase phase)
{
    s->phase = phase;
    if (s->mapped || phase != EXPERT_PHASE_DECODE) return;
    pthread_mutex_lock(&s->mu);
    s->warm_next = s->n_warm;
    pthread_mutex_unlock(&s->mu);
}

/* Remembers the guess for LAYER (GUESS[0..n), repeats allowed) and starts reading those not
 * in memory, at most half the unpinned slots so a wrong guess cannot flush the cache;
 * guessed experts already in memory become most recently used. */
static void expert_prefetch(struct expert_store *s, int layer, const int *guess, int n)
{
    int ph = s->phase, issued = 0;
    memset(s->guess, 0, (size_t)s->n_expert);
    s->guess_layer = layer;
    for (int k = 0; k < n; k++) {
        s->stats.predicted[ph] += !s->guess[guess[k]];
        s->guess[guess[k]] = 1;
    }
    if (s->mapped) return;
    pthread_mutex_lock(&s->mu);
    for (int e = 0; e < s->n_expert && !expert_failed(s); e++) {
        int32_t key = layer * s->n_expert + e;
        if (!s->guess[e] || expert_in_vram(s, key)) continue;
        int i = s->slot_of[key];
        if (i >= 0 && expert_listed(s, i)) {
            expert_lru_unlink(s, i);
            expert_lru_append(s, i);
        } else if (i < 0 && issued < (s->n_slots - s->n_pin) / 2 && expert_start_read(s, key, 0) >= 0) {
            issued++;
            s->stats.prefetches++;
        }
    }
    pthread_mutex_unlock(&s->mu);
}

/* Starts reads for wanted experts that have no slot yet, in order, while slots can be had
 * without waiting; each read is held for the layer. Under mu. */
static void expert_fill(struct expert_store *s, int from)
{
    for (int k = from; k < s->n_want; k++) {
        if (s->want_slot[k] >= 0) continue;
        int32_t key = s->layer * s->n_expert + s->want[k];
        int i = s->slot_of[key];
        if (i >= 0) s->slots[i].refs++;
        else if ((i = expert_start_read(s, key, 1)) < 0) return;
        s->want_slot[k] = i;
        expert_relist(s, i);
    }
}

/* Begins the routed experts of LAYER for T tokens: WANT[0..n) distinct ids, COUNT[e] tokens
 * routed to expert e. Counts heat and hits; the ones resident on a device are listed in
 * on_device for the caller to run there; of the others, holds those already in memory and
 * starts reading the rest, so that they arrive while the caller runs the shared expert and
 * the experts in memory. expert_next hands them out. */
static void expert_begin(struct expert_store *s, int layer, const int *want, const int *count, int n, int T)
{
    int ph = s->phase;
    for (int k = 0; k < n; k++) s->heat[layer * s->n_expert + want[k]] += (float)count[want[k]];
    if (s->guess_layer == layer)
        for (int k = 0; k < n; k++) {
            s->stats.routed_seen[ph]++;
            s->stats.predicted_used[ph] += s->guess[want[k]];
        }
    s->guess_layer = -1;
    s->layer = layer;
    s->n_done = 0;
    s->stats.lookups[ph] += (uint64_t)n;
    s->n_want = s->n_on_device = 0;
    for (int k = 0; k < n; k++)
        if (expert_in_vram(s, layer * s->n_expert + want[k])) s->on_device[s->n_on_device++] = want[k];
        else s->want[s->n_want++] = want[k];
    s->stats.vram[ph] += (uint64_t)s->n_on_device;
    n = s->n_want;
    if (s->mapped) {
        s->stats.hits[ph] += (uint64_t)n;
        if (layer == 0) expert_heat_tick(s, T);
        return;
    }
    pthread_mutex_lock(&s->mu);
    if (expert_failed(s)) { /* the forward pass fails after this layer (expert_recover) */
        s->n_done = s->n_want;
        pthread_mutex_unlock(&s->mu);
        return;
    }
    int repinned = layer == 0 && expert_heat_tick(s, T);
    for (int k = 0; k < n; k++) {
        int i = s->slot_of[layer * s->n_expert + s->want[k]];
        s->want_slot[k] = i;
        if (i < 0) continue;
        s->stats.hits[ph] += s->slots[i].state == EXPERT_READY;
        s->stats.inflight[ph] += s->slots[i].state == EXPERT_LOADING;
        s->slots[i].refs++;
        expert_relist(s, i);
    }
    expert_fill(s, 0);
    pthread_mutex_unlock(&s->mu);
    if (repinned) expert_forget_mapping(s, 0); /* the first pass over the trunk has read around */
}

/* The next wanted expert whose bytes are in memory: its id, with its gate, up and down
 * matrices in W; -1 when the layer is done. Releases the expert handed out before. Prefers
 * one already read, else waits for a read under way, else for a slot to read into. The
 * order does not change results: each expert's output has its own place, summed later in
 * routing order. */
static int expert_next(struct expert_store *s, struct ops_matrix w[3])
{
    if (s->mapped) {
        if (s->n_done == s->n_want) return -1;
        int e = s->want[s->n_done++];
        expert_fill_hole(s, s->layer * s->n_expert + e);
        for (int j = 0; j < 3; j++) w[j] = expert_mapped(&s->src[s->layer][j].t, e);
        return e;
    }
    pthread_mutex_lock(&s->mu);
    if (s->held >= 0) {
        s->slots[s->held].refs--;
        expert_relist(s, s->held);
        s->held = -1;
    }
    if (s->n_done == s->n_want || expert_failed(s)) {
        pthread_mutex_unlock(&s->mu);
        return -1;
    }
    expert_fill(s, s->n_done);
    int k = -1;
    for (int j = s->n_done; j < s->n_want && k < 0; j++)
        if (s->want_slot[j] >= 0 && s->slots[s->want_slot[j]].state == EXPERT_READY) k = j;
    for (int j = s->n_done; j < s->n_want && k < 0; j++)
        if (s->want_slot[j] >= 0) k = j;
    double t0 = plat_now();
    if (k < 0) /* nothing held: a slot frees up when a read under way ends */
        for (k = s->n_done; !expert_failed(s) && (expert_fill(s, k), s->want_slot[k] < 0);) pthread_cond_wait(&s->done, &s->mu);
    int i = s->want_slot[k], e = s->want[k];
    while (!expert_failed(s) && i >= 0 && s->slots[i].state != EXPERT_READY) pthread_cond_wait(&s->done, &s->mu);
    s->stats.wait_s[s->phase] += plat_now() - t0;
    if (expert_failed(s)) {
        pthread_mutex_unlock(&s->mu);
        return -1;
    }
    s->want[k] = s->want[s->n_done];
    s->want_slot[k] = s->want_slot[s->n_done];
    s->n_done++;
    s->held = i;
    pthread_mutex_unlock(&s->mu);
    for (int j = 0; j < 3; j++) {
        const struct expert_source *src = &s->src[s->layer][j];
        w[j] = src->t.m;
        w[j].data = expert_slice(s, i, j) + ((src->offset + (uint64_t)e * src->t.stride) & (EXPERT_ALIGN - 1));
    }
    return e;
}

/* Opens the part files for reading experts: with O_DIRECT unless cfg.io says buffered or the
 * file system refuses it (tmpfs), then buffered reads dropped from the page cache after use.
 * Reopening /proc/self/fd/N reaches every part of a split set by its open descriptor. */
static void expert_open_files(struct expert_store *s)
{
    char path[64];
    for (int p = 0; p < s->file->n_parts; p++) {
        snprintf(path, sizeof path, "/proc/self/fd/%d", s->file->parts[p].fd);
        int fd = -1;
        if (s->cfg.io == EXPERT_IO_DIRECT) fd = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
        if (fd < 0 && s->cfg.io == EXPERT_IO_DIRECT) {
            plat_log("[experts] %s: no O_DIRECT here (%s); buffered reads, dropped from the page cache", s->file->path, strerror(errno));
            s->cfg.io = EXPERT_IO_BUFFERED;
            for (int q = 0; q < p; q++) close(s->fds[q]);
            p = -1;
            continue;
        }
        if (fd < 0) fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) die("%s: cannot reopen for reading experts: %s", s->file->path, strerror(errno));
        s->fds[p] = fd;
    }
}

/* Slot layout and count: each slice gets its largest size over the layers in whole disk
 * blocks plus one (a slice need not start on a block); the budget buys n_slots of those,
 * at least EXPERT_MIN_SLOTS, at most every expert. Half of them may be pinned. */
static void expert_size_slots(struct expert_store *s)
{
    for (int l = 0; l < s->n_layers; l++)
        for (int j = 0; j < 3; j++) {
            size_t cap = expert_round_up(s->src[l][j].bytes) + EXPERT_ALIGN;
            if (cap > s->part_cap[j]) s->part_cap[j] = cap;
        }
    s->slot_bytes = s->part_cap[0] + s->part_cap[1] + s->part_cap[2];
    int64_t n = s->cfg.budget / (int64_t)s->slot_bytes, all = (int64_t)s->n_layers * s->n_expert;
    s->n_slots = (int)(n < EXPERT_MIN_SLOTS ? EXPERT_MIN_SLOTS : n > all ? all : n);
    s->n_pin = s->n_slots / 2;
}

/* Allocates the cache (the arena is reserved, and each slot's pages become resident only
 * when first read into), opens the files, loads the heat and pins and queues the hottest
 * experts, and starts the readers. */
static void expert_start_cache(struct expert_store *s)
{
    int cells = s->n_layers * s->n_expert;
    expert_size_slots(s);
    size_t arena = plat_mul_size((size_t)s->n_slots, s->slot_bytes, "expert cache");
    void *p = mmap(NULL, arena, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) die("cannot reserve %zu bytes for the expert cache: %s", arena, strerror(errno));
    s->arena = p;
    s->slots = plat_zalloc((size_t)s->n_slots, sizeof *s->slots);
    for (int i = 0; i < s->n_slots; i++)
        s->slots[i] = (struct expert_slot){-1, EXPERT_FREE, 0, 0, -1, i + 1 < s->n_slots ? i + 1 : -1, s->arena + (size_t)i * s->slot_bytes};
    s->free_head = 0;
    s->lru_head = s->lru_tail = s->held = -1;
    s->slot_of = plat_alloc((size_t)cells * sizeof *s->slot_of);
    for (int i = 0; i < cells; i++) s->slot_of[i] = -1;
    s->queue = plat_alloc((size_t)s->n_slots * sizeof *s->queue);
    s->warm = plat_alloc((size_t)cells * sizeof *s->warm);
    s->n_warm = expert_rank_by_heat(s, s->warm);
    if (s->n_warm > s->n_slots) s->n_warm = s->n_slots;
    expert_repin(s);
    expert_open_files(s);
    expert_forget_mapping(s, 1);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->wake, NULL);
    pthread_cond_init(&s->done, NULL);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 << 10); /* musl's default 128 KiB is enough; the margin is cheap */
    for (s->n_readers = 0; s->n_readers < EXPERT_READERS; s->n_readers++)
        if (pthread_create(&s->readers[s->n_readers], &attr, expert_reader, s) != 0) die("cannot start an expert reader thread");
    pthread_attr_destroy(&attr);
}

/* The store for N_LAYERS layers of N_EXPERT experts whose slices are T[layer][gate, up,
 * down], in file G (which must outlive the store). Loads heat from cfg->heat_path if that
 * file exists (a bad one is ignored with a line). Budget < 0: mapped mode. */
static struct expert_store *expert_open(const struct gguf_file *g, const struct expert_tensor (*t)[3], int n_layers, int n_expert,
                                        const struct expert_config *cfg)
{
    struct expert_store *s = plat_zalloc(1, sizeof *s);
    size_t cells = (size_t)n_layers * (size_t)n_expert;
    s->file = g;
    s->n_layers = n_layers;
    s->n_expert = n_expert;
    s->cfg = *cfg;
    s->cfg.heat_path = cfg->heat_path ? plat_strdup(cfg->heat_path) : NULL;
    s->mapped = cfg->budget < 0;
    s->guess_layer = -1;
    s->src = plat_zalloc((size_t)n_layers, sizeof *s->src);
    for (int l = 0; l < n_layers; l++)
        for (int j = 0; j < 3; j++) {
            struct expert_source *src = &s->src[l][j];
            src->t = t[l][j];
            src->bytes = t[l][j].m.row_bytes * (size_t)t[l][j].m.rows;
            for (int p = 0; p < g->n_parts; p++)
                if (src->t.m.data >= g->parts[p].data && src->t.m.data < g->parts[p].data + g->parts[p].size) {
                    src->part = p;
                    src->offset = (uint64_t)(src->t.m.data - g->parts[p].data);
                }
        }
    s->heat = plat_zalloc(cells, sizeof *s->heat);
    s->pin = plat_zalloc(cells, 1);
    s->want = plat_zalloc((size_t)n_expert, sizeof *s->want);
    s->want_slot = plat_zalloc((size_t)n_expert, sizeof *s->want_slot);
    s->guess = plat_zalloc((size_t)n_expert, 1);
    s->on_device = plat_zalloc((size_t)n_expert, sizeof *s->on_device);
    s->heat_loaded = expert_heat_load(s);
    for (int d = 0; d < CUDA_MAX_DEVICES; d++) s->swap_key[d] = -1;
    return s;
}

/* The share of routed experts VRAM served over the last re-tiering window, or so far when none
 * has ended. */
static double expert_window_share(const struct expert_stats *st)
{
    return st->windows ? st->window_vram : plat_ratio((double)(st->vram[0] + st->vram[1]), (double)(st->lookups[0] + st->lookups[1]));
}

/* Ends a re-tiering window: the share of routed experts VRAM served since the last one. */
static void expert_window_end(struct expert_store *s)
{
    uint64_t lookups = s->stats.lookups[0] + s->stats.lookups[1], vram = s->stats.vram[0] + s->stats.vram[1];
    s->stats.window_vram = plat_ratio((double)(vram - s->window_vram), (double)(lookups - s->window_lookups));
    s->stats.windows++;
    s->window_lookups = lookups;
    s->window_vram = vram;
}

/* Whether every expert of layer L is resident on a device. */
static int expert_layer_in_vram(const struct expert_store *s, int l)
{
    for (int e = 0; e < s->n_expert; e++)
        if (!expert_in_vram(s, l * s->n_expert + e)) return 0;
    return 1;
}

/* RUN experts of tensor T from SRC to DST, as they are or (INTERLEAVE) interleaved one by one. */
static void expert_copy(const struct expert_tensor *t, int interleave, uint8_t *dst, const uint8_t *src, int run)
{
    if (!interleave) {
        plat_copy_weights(dst, src, (size_t)run * t->stride);
        return;
    }
    for (int e = 0; e < run; e++) quant_interleave(t->m.type, dst + (size_t)e * t->stride, src + (size_t)e * t->stride, t->m.row_bytes, t->m.rows);
    plat_progress_add((size_t)run * t->stride);
}

/* Mapped mode: copies the merged expert tensors into one anonymous arena and hands experts
 * out there; the process lets go of the file's pages, which the page cache keeps (the caller
 * asks for this only when memory holds both). A layer whose experts are all in VRAM stays in
 * the mapping (read only if the GPU path ends); in a layer partly in VRAM only the others are
 * copied: the resident ones' places in the arena stay untouched pages (no memory: huge pages
 * are turned off there), filled from the file by expert_fill_hole when the CPU first needs one
 * (re-tiering moved it off the device, or the GPU path ended). Why: on this machine Q4_0
 * experts stream at
 * 13-14 GB/s from anonymous memory and 8 GB/s in place from the page cache. Without the
 * memory for it the experts stay in place. Where no device takes part (S->vram unset: nothing
 * will upload from this copy), the types with an interleaved form (§3) are interleaved in it. */
static void expert_own(struct expert_store *s)
{
    size_t total = 0;
    for (int l = 0; l < s->n_layers; l++)
        for (int j = 0; j < 3 && !expert_layer_in_vram(s, l); j++) total += (s->src[l][j].t.stride * (size_t)s->n_expert + 63) & ~(size_t)63;
    uint8_t *arena = plat_weight_arena(total), *dst = arena;
    if (!arena) return;
    s->hole = plat_zalloc((size_t)s->n_layers * (size_t)s->n_expert, 1);
    plat_progress_begin("copying the experts", total);
    for (int l = 0; l < s->n_layers; l++)
        for (int j = 0; j < 3 && !expert_layer_in_vram(s, l); j++) {
            struct expert_source *src = &s->src[l][j];
            size_t stride = src->t.stride, len = stride * (size_t)s->n_expert;
            const int interleave = !s->vram && quant_interleave_ok(src->t.m.type, src->t.m.rows);
            int partial = 0;
            for (int e = 0; e < s->n_expert; e++) partial |= expert_in_vram(s, l * s->n_expert + e);
            if (partial) madvise(dst, len, MADV_NOHUGEPAGE);
            else plat_prefault_parallel(dst, len);
            for (int e = 0, run; e < s->n_expert; e += run) {
                int in_vram = expert_in_vram(s, l * s->n_expert + e);
                for (run = 1; e + run < s->n_expert && expert_in_vram(s, l * s->n_expert + e + run) == in_vram; run++) {}
                if (!in_vram) {
                    expert_copy(&src->t, interleave, dst + (size_t)e * stride, src->t.m.data + (size_t)e * stride, run);
                    continue;
                }
                plat_progress_add((size_t)run * stride);
                if (j > 0) continue;
                memset(s->hole + l * s->n_expert + e, 1, (size_t)run);
            }
            plat_unmap_range(src->t.m.data, len);
            src->t.m.data = dst;
            src->t.m.interleaved = interleave;
            dst += (len + 63) & ~(size_t)63;
        }
    plat_progress_end();
    s->own = arena;
    s->own_bytes = total;
}

/* Before expert_start: the cache's budget becomes BUDGET bytes (< 0: mapped mode), with OWN as
 * expert_config's (§7 has decided what lives in VRAM, which the budget no longer counts). */
static void expert_set_budget(struct expert_store *s, int64_t budget, int own)
{
    s->cfg.budget = budget;
    s->cfg.own = own;
    s->mapped = budget < 0;
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14; musl's headers may predate it */
#endif
#define EXPERT_MAP_CHUNK ((uintptr_t)4 << 20) /* bytes a populate call covers: a stop waits for one (~2 ms here), and so does a thread
                                               * that wants the address space while it holds it */

/* Mapped mode, in place: maps the experts' pages ahead of the forward passes, so that these do
 * not pay for it the first time they read an expert. Per chunk: MADV_POPULATE_READ fills the
 * page tables (reading from the disk what the page cache lacks; ~0.2 us a page here against
 * ~1.5 us a fault), then one read a page warms what lies below them (on this project's VMs the
 * hypervisor's own tables: ~1.8 us a page on the first touch, even with the page tables filled).
 * Without it the first 64-token batch of a 4-layer 35B-A3B slice ran its experts' gate/up at
 * 16-23 GMAC/s, the next ones at 60-110; with it the first at 38-99. A range the kernel refuses
 * (a file cut short) ends it: the forward pass then says what is wrong. A kernel without
 * MADV_POPULATE_READ (before 5.14) gets the reads alone; there a file cut short ends the process
 * with model_on_sigbus's one line, as a forward pass reading it would. The thread runs only on idle cores
 * (SCHED_IDLE): while a server waits, or bench waits for it; a prompt that starts at once still
 * maps what it reads itself, as before. */
static void *expert_map_ahead(void *arg)
{
    struct expert_store *s = arg;
    const double t0 = plat_now();
    /* only when a core is idle: the forward passes' threads come first (if refused: as any thread) */
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &(struct sched_param){0});
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    size_t bytes = 0;
    int ok = 1, populate = 1;
    for (int r = 0; r < s->n_map_ranges && ok; r++)
        for (uintptr_t a = s->map_ranges[r].lo; a < s->map_ranges[r].hi && ok; a += EXPERT_MAP_CHUNK) {
            const size_t len = s->map_ranges[r].hi - a < EXPERT_MAP_CHUNK ? s->map_ranges[r].hi - a : EXPERT_MAP_CHUNK;
            if (populate && madvise((void *)a, len, MADV_POPULATE_READ)) populate = 0, ok = errno == EINVAL;
            ok = ok && !__atomic_load_n(&s->mapper_stop, __ATOMIC_RELAXED);
            for (uintptr_t p = a; ok && p < a + len; p += page) (void)*(volatile const uint8_t *)p;
            if (ok) bytes += len;
        }
    s->map_ahead_bytes = bytes;
    s->map_ahead_s = plat_now() - t0;
    return NULL;
}

/* Starts expert_map_ahead over the experts the CPU computes: runs of them, as expert_own copies
 * (one in VRAM is read again only if the GPU path ends). */
static void expert_map_ahead_start(struct expert_store *s)
{
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    s->map_ranges = plat_alloc((size_t)s->n_layers * 3 * (size_t)s->n_expert * sizeof *s->map_ranges);
    for (int l = 0; l < s->n_layers; l++)
        for (int j = 0; j < 3; j++) {
            const struct expert_source *src = &s->src[l][j];
            const size_t stride = src->t.stride;
            for (int e = 0, run; e < s->n_expert; e += run) {
                const int in_vram = expert_in_vram(s, l * s->n_expert + e);
                for (run = 1; e + run < s->n_expert && expert_in_vram(s, l * s->n_expert + e + run) == in_vram; run++) {}
                const uintptr_t lo = (uintptr_t)(src->t.m.data + (size_t)e * stride);
                if (!in_vram) s->map_ranges[s->n_map_ranges++] = (struct expert_range){lo & ~(page - 1), lo + (size_t)run * stride};
            }
        }
    s->mapper_on = pthread_create(&s->mapper, NULL, expert_map_ahead, s) == 0;
}

/* Waits for expert_map_ahead to end (at once with STOP: after the call in progress). */
static void expert_map_ahead_join(struct expert_store *s, int stop)
{
    if (!s->mapper_on) return;
    if (stop) __atomic_store_n(&s->mapper_stop, 1, __ATOMIC_RELAXED);
    pthread_join(s->mapper, NULL);
    s->mapper_on = 0;
}

/* Starts the cache, or copies the experts in mapped mode when asked, else maps their pages
 * ahead (after §7 has placed experts in VRAM, which all of these then leave out). */
static void expert_start(struct expert_store *s)
{
    if (!s->mapped) expert_start_cache(s);
    else if (s->cfg.own) expert_own(s);
    else expert_map_ahead_start(s);
}

/* Stops the readers (each finishes the read it is in) and frees everything; NULL is fine. */
static void expert_close(struct expert_store *s)
{
    if (!s) return;
    if (!s->mapped && s->slots) { /* the cache was started */
        pthread_mutex_lock(&s->mu);
        s->stop = 1;
        pthread_cond_broadcast(&s->wake);
        pthread_mutex_unlock(&s->mu);
        for (int i = 0; i < s->n_readers; i++) pthread_join(s->readers[i], NULL);
        for (int p = 0; p < s->file->n_parts; p++) close(s->fds[p]);
        munmap(s->arena, (size_t)s->n_slots * s->slot_bytes);
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->wake);
        pthread_cond_destroy(&s->done);
    }
    expert_map_ahead_join(s, 1);
    free(s->map_ranges);
    if (s->own) munmap(s->own, s->own_bytes);
    free(s->hole);
    void *bufs[] = {s->src,  s->heat,  s->pin,   s->want, s->want_slot, s->guess,
                    s->vram, s->slots, s->slot_of, s->queue, s->warm, s->on_device, (void *)s->cfg.heat_path};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    free(s);
}

/* ==== §7 place ==== */
/* Owns: which weights live in VRAM (design.md §5), priced in bytes of host memory-bus traffic
 *   saved per token per byte of VRAM. A dense trunk matrix is read on every token: its bytes.
 *   A routed expert is read with the probability p_e that a token routes to it (its share of
 *   the heat, or top_k / n_expert without heat): p_e times its bytes, and twice that when the
 *   RAM cache would not hold it (an O_DIRECT read writes the bytes the product then reads;
 *   a buffered one four times).
 *   The host counts too: a trunk matrix in VRAM leaves its RAM to the expert cache when the
 *   cache's budget is what memory leaves, and an expert leaving the cache frees its slot for
 *   the first one that missed; both turn misses into hits (place_decide has the formulas).
 *   So with RAM to spare the trunk goes first (value 1 against p_e < 1), and with a fixed
 *   cache a resident expert routed on more than about every other token keeps its place. The
 *   trunk, component by component in a fixed order (lmhead, attnproj, dnproj, dnout, shexp,
 *   router, ffn), and the experts, hottest first, are merged by value; each goes to the
 *   selected device with the most room left that has a kernel for it, while it fits that
 *   device's budget (--vram, or free VRAM less a reserve). This runs before the expert store's
 *   cache starts, so that the cache holds only what the CPU computes. --place / COLI_PLACE may
 *   name a device (or cpu) per component or split its layers over devices (dnproj=0:20+1:20).
 *   Before the trunk, a probe times a trunk product on each device and the CPU (the trunk
 *   avoids a device slower than the CPU; with two devices or more whole placements are priced
 *   per token, place_choose_split). While running, place_retier swaps experts between VRAM
 *   and the CPU as the heat moves. coli plan runs the same decisions as a dry run
 *   (place_dry_run), so it cannot disagree with a run.
 * Promises: placement changes speed only: a resident matrix or expert computes the same bits
 *   (§5). One [place] line per component says where it went and with what numbers, and one
 *   the prices that decided between trunk and experts. A bad --place / COLI_PLACE, or one
 *   naming a device that is not there or not selected, is a usage error.
 * May call: §1, §4 (struct ops_matrix), §5 (devices, uploads), §6 (the store's experts, heat).
 * Workload: once per model load; place_retier once per forward pass (a pass over the heat). */

enum place_component { PLACE_LMHEAD, PLACE_ATTNPROJ, PLACE_DNPROJ, PLACE_DNOUT, PLACE_SHEXP, PLACE_ROUTER, PLACE_FFN, PLACE_EXPERTS, PLACE_COUNT };
static const char *const place_names[PLACE_COUNT] = {"lmhead", "attnproj", "dnproj", "dnout", "shexp", "router", "ffn", "experts"};

/* One movable matrix of the trunk, and its layer (-1: none, as lm_head). */
struct place_item { enum place_component comp; struct ops_matrix *m; int layer; };

enum { PLACE_ANY = -1, PLACE_CPU = -2 }; /* a rule's device: the one with the most room; none */
#define PLACE_MAX_SEGMENTS 64

/* Where one component goes: SEG[0..n) in layer order, each COUNT of the layers that have the
 * component to DEV (a device or PLACE_ANY); the layers after the last segment stay on the
 * CPU, so n = 0 keeps them all there. */
struct place_rule {
    int n;
    struct place_segment { int dev, count; } seg[PLACE_MAX_SEGMENTS];
};

/* coli plan: placement decides and charges the budgets as for a run, but allocates and copies
 * nothing (the probe's one matrix excepted, for a moment); its [place] and [probe] lines go
 * to stdout unless plan writes JSON there. */
static int place_dry_run, place_say_stdout;

/* The number at *P, digits only (no sign or space), *P moved past it; -1 when there is none
 * or it exceeds 10^7. */
static long place_number(const char **p)
{
    const char *start = *p;
    long v = 0;
    for (; isdigit((unsigned char)**p); (*p)++)
        if ((v = v * 10 + (**p - '0')) > 10000000) return -1;
    return *p == start ? -1 : v;
}

/* Parses the N bytes at V, DEVICE or DEVICE:LAYERS+DEVICE:LAYERS... (a DEVICE is a number or
 * cpu), into *R. Returns 0, or -1 when they are anything else (a split with a segment that
 * has no count, say). */
static int place_parse_rule(const char *v, size_t n, struct place_rule *r)
{
    const char *p = v, *end = v + n;
    for (r->n = 0; r->n < PLACE_MAX_SEGMENTS;) {
        struct place_segment *s = &r->seg[r->n++];
        if (end - p >= 3 && !strncmp(p, "cpu", 3)) {
            s->dev = PLACE_CPU;
            p += 3;
        } else s->dev = (int)place_number(&p);
        s->count = INT_MAX;
        if (p < end && *p == ':') {
            p++;
            s->count = (int)place_number(&p);
        }
        if (s->dev == -1 || s->count < 0 || (s->count == INT_MAX && (r->n > 1 || p < end))) return -1;
        if (p == end) return 0;
        if (*p++ != '+') return -1;
    }
    return -1;
}

/* Parses SPEC (auto | off | COMPONENT=RULE,...) into RULE[comp]. auto: everything to any
 * device; off: the experts only (the trunk stays); a list: what it names, as written, and the
 * components it leaves out stay on the CPU. */
static void place_parse(const char *spec, struct place_rule rule[PLACE_COUNT])
{
    int any = !spec || !strcmp(spec, "auto"), off = spec && !strcmp(spec, "off");
    for (int c = 0; c < PLACE_COUNT; c++)
        rule[c] = (struct place_rule){any || (off && c == PLACE_EXPERTS), {{PLACE_ANY, INT_MAX}}};
    for (const char *p = any || off ? "" : spec; *p;) {
        size_t n = strcspn(p, ","), k = strcspn(p, "=");
        struct place_rule r;
        if (k >= n || place_parse_rule(p + k + 1, n - k - 1, &r))
            die_usage("--place %s: '%.*s' is not COMPONENT=DEVICE or COMPONENT=DEVICE:LAYERS+DEVICE:LAYERS... "
                      "(e.g. lmhead=0,dnproj=0:20+1:20)", spec, (int)n, p);
        int c = 0;
        while (c < PLACE_COUNT && (strlen(place_names[c]) != k || strncmp(p, place_names[c], k))) c++;
        if (c == PLACE_COUNT) die_usage("--place: unknown component '%.*s'", (int)k, p);
        rule[c] = r;
        p += n + (p[n] == ',');
    }
}

/* The device rule R gives the ORDINAL-th layer (from 0) that has its component: a device,
 * PLACE_ANY or PLACE_CPU. */
static int place_rule_device(const struct place_rule *r, int ordinal)
{
    for (int i = 0; i < r->n; i++) {
        if (ordinal < r->seg[i].count) return r->seg[i].dev;
        ordinal -= r->seg[i].count;
    }
    return PLACE_CPU;
}

/* In a dry run: charges N parts of BYTES[i] to device DEV's budget as cuda_upload would.
 * Returns 0, or -1 (nothing charged) when they do not fit. */
static int place_charge(int dev, const size_t *bytes, int n)
{
    size_t total = cuda_span(bytes, n);
    if (!cuda_fits(dev, total)) return -1;
    cuda.dev[dev].used += (int64_t)total;
    return 0;
}

/* Makes W resident on device DEV (a dry run only charges it), and lets go of its pages in the
 * mapping. Returns 0, or -1 as cuda_make_resident: it stays on the CPU. */
static int place_matrix(const struct ops_matrix *w, int dev)
{
    size_t bytes = (size_t)w->rows * w->row_bytes;
    if (place_dry_run) return cuda.dev[dev].matvec[w->type] ? place_charge(dev, &bytes, 1) : -1;
    if (cuda_make_resident(w, dev)) return -1;
    plat_unmap_range(w->data, bytes); /* the CPU reads it again only if the GPU path ends */
    return 0;
}

/* Copies expert W (gate, up, down) to device DEV into *E (a dry run only charges it), and lets
 * go of its pages in the mapping. Returns 0, or -1 as cuda_expert_upload. */
static int place_expert(int dev, const struct ops_matrix w[3], struct cuda_expert *e)
{
    size_t bytes[3];
    for (int j = 0; j < 3; j++) bytes[j] = (size_t)w[j].rows * w[j].row_bytes;
    if (place_dry_run) return place_charge(dev, bytes, 3);
    if (cuda_expert_upload(dev, w, e)) return -1;
    for (int j = 0; j < 3; j++) plat_unmap_range(w[j].data, bytes[j]);
    return 0;
}

/* Prints LINE: logged on stderr by a run, on stdout by coli plan. */
static void place_say(const char *line)
{
    if (place_say_stdout) puts(line);
    else plat_log("%s", line);
}

/* The device shape of layer L's experts in S, or 0 when no kernel set fits them (gate and up
 * must share a type: the device reads one activation for both). */
static int place_expert_shape(const struct expert_store *s, int l, struct cuda_moe_shape *sh)
{
    const struct ops_matrix *g = &s->src[l][0].t.m, *u = &s->src[l][1].t.m, *d = &s->src[l][2].t.m;
    *sh = (struct cuda_moe_shape){g->type, d->type, g->row_bytes, d->row_bytes, (int)d->rows, (int)g->rows};
    return g->type == u->type && g->row_bytes == u->row_bytes && g->rows == u->rows && d->cols == g->rows && u->cols == d->rows;
}

/* Every expert of S (keys layer * n_expert + e), hottest first, then the cold ones in layer
 * order. Returns an allocated [n_layers * n_expert]. */
static int32_t *place_expert_order(const struct expert_store *s)
{
    int cells = s->n_layers * s->n_expert;
    int32_t *order = plat_alloc((size_t)cells * sizeof *order);
    uint8_t *listed = plat_zalloc((size_t)cells, 1);
    int ranked = expert_rank_by_heat(s, order);
    for (int i = 0; i < ranked; i++) listed[order[i]] = 1;
    for (int key = 0, k = ranked; key < cells; key++)
        if (!listed[key]) order[k++] = key;
    free(listed);
    return order;
}

/* Why an offer stayed on the CPU, or that it did not. */
enum place_why { PLACE_PLACED, PLACE_BY_RULE, PLACE_NO_ROOM, PLACE_NO_KERNEL };

/* One thing that may live in VRAM: a trunk matrix or a routed expert. The decision is a
 * function of these numbers alone (place_decide), so it is tested without a device. */
struct place_offer {
    enum place_component comp;
    int ordinal;       /* the layer its component's rule counts (an expert's: its layer) */
    size_t bytes;      /* the VRAM it takes, as cuda_upload charges it */
    size_t cpu_bytes;  /* what the CPU reads from memory each time it computes it instead */
    double p;          /* the probability that a token reads it: 1 for the trunk */
    uint32_t devices;  /* the devices with a kernel for it: bit d for device d */
    int home;          /* decided: a device, or PLACE_CPU */
    int why;           /* enum place_why */
    double value;      /* bytes saved per token per byte of VRAM, as priced when it was decided */
    int ref;           /* what it stands for: place_model's trunk item, or the expert's key */
};

/* What the host does with the routed experts that stay on the CPU: the RAM cache holds the
 * hottest of them (LRU with the hottest pinned comes close to that), the rest are read from
 * the file when a token routes to them. */
struct place_host {
    int64_t cache_bytes; /* the cache's budget; < 0: every expert stays in memory, none is read */
    size_t slot_bytes;   /* one cached expert */
    int cache_grows;     /* the budget is what memory leaves, so a trunk byte in VRAM is a cache byte */
    double miss_extra;   /* bus bytes a read from the file adds per byte the product reads */
};

struct place_rooms { int n; int64_t room[CUDA_MAX_DEVICES]; }; /* bytes each device has left; < 0 none */

/* The experts the cache holds once FREED bytes of trunk have left the host (INT64_MAX: all). */
static int64_t place_slots(const struct place_host *h, double freed)
{
    if (h->cache_bytes < 0) return INT64_MAX;
    return (int64_t)(((double)h->cache_bytes + (h->cache_grows ? freed : 0)) / (double)h->slot_bytes);
}

/* The expert of heat rank R (0: the hottest) among those on the CPU, when SKIPPED[N_SKIPPED]
 * were kept there and FROM..END are undecided (they stay, for now): its offer, or -1. */
static int place_cpu_rank(const int *skipped, int n_skipped, int from, int end, int64_t r)
{
    if (r < n_skipped) return skipped[r];
    return r - n_skipped < end - from ? from + (int)(r - n_skipped) : -1;
}

/* Sends O where RULE allows: to the device with a kernel for it and the most room that fits
 * it (charged to ROOMS), or to the CPU with the reason. */
static void place_home(struct place_offer *o, const struct place_rule rule[PLACE_COUNT], struct place_rooms *rooms)
{
    int want = place_rule_device(&rule[o->comp], o->ordinal), best = -1;
    uint32_t allowed = want == PLACE_ANY ? o->devices : want >= 0 ? o->devices & (1u << want) : 0;
    for (int d = 0; d < rooms->n; d++)
        if ((allowed >> d & 1) && rooms->room[d] >= (int64_t)o->bytes && (best < 0 || rooms->room[d] > rooms->room[best])) best = d;
    o->home = best >= 0 ? best : PLACE_CPU;
    o->why = want == PLACE_CPU ? PLACE_BY_RULE : !allowed ? PLACE_NO_KERNEL : best < 0 ? PLACE_NO_ROOM : PLACE_PLACED;
    if (best >= 0) rooms->room[best] -= (int64_t)o->bytes;
}

/* Decides O[N]: the trunk O[0..N_TRUNK) in its order, the experts O[N_TRUNK..N) hottest
 * first. Each step takes whichever head of the two lists saves more bus bytes per token per
 * byte of VRAM (ties: the trunk), priced in the state the earlier steps left, and sends it
 * home (place_home). The prices, for the first expert the RAM cache would not hold (m):
 *   trunk matrix: cpu_bytes (read every token), plus, when the cache grows by the RAM it
 *     frees, cpu_bytes / slot_bytes more hits at m's saving;
 *   expert: p * cpu_bytes, plus a miss's extra traffic: its own when it is a miss, else m's,
 *     whose slot it frees;
 * each over its VRAM bytes; a miss's extra traffic is miss_extra * p * cpu_bytes. */
static void place_decide(struct place_offer *o, int n_trunk, int n, const struct place_rule rule[PLACE_COUNT],
                         const struct place_host *h, struct place_rooms *rooms)
{
    int *skipped = plat_alloc((size_t)(n - n_trunk + 1) * sizeof *skipped), n_skipped = 0, t = 0, x = n_trunk;
    double freed = 0;
    while (t < n_trunk || x < n) {
        int64_t slots = place_slots(h, freed);
        int m = place_cpu_rank(skipped, n_skipped, x, n, slots);
        double hit = m < 0 ? 0 : h->miss_extra * o[m].p * (double)o[m].cpu_bytes, vt = 0, vx = 0;
        if (t < n_trunk) vt = (double)o[t].cpu_bytes * (1 + (h->cache_grows && m >= 0 ? hit / (double)h->slot_bytes : 0)) / (double)o[t].bytes;
        if (x < n) {
            double own = o[x].p * (double)o[x].cpu_bytes;
            vx = (own + (n_skipped >= slots ? h->miss_extra * own : hit)) / (double)o[x].bytes;
        }
        int i = t < n_trunk && (x == n || vt >= vx) ? t++ : x++;
        o[i].value = i < n_trunk ? vt : vx;
        place_home(&o[i], rule, rooms);
        if (i < n_trunk && o[i].home >= 0) freed += (double)o[i].cpu_bytes;
        if (i >= n_trunk && o[i].home < 0) skipped[n_skipped++] = i;
    }
    free(skipped);
}

/* The devices with a kernel for trunk matrix W. */
static uint32_t place_matrix_devices(const struct ops_matrix *w)
{
    uint32_t mask = 0;
    for (int d = 0; d < cuda.n_devices; d++)
        if (cuda.dev[d].usable && cuda.dev[d].matvec[w->type]) mask |= 1u << d;
    return mask;
}

/* The devices with kernels for layer L's experts in S. */
static uint32_t place_expert_devices(const struct expert_store *s, int l)
{
    struct cuda_moe_shape sh;
    uint32_t mask = 0;
    for (int d = 0; d < cuda.n_devices && place_expert_shape(s, l, &sh); d++)
        if (cuda.dev[d].usable && cuda_moe_supported(d, &sh)) mask |= 1u << d;
    return mask;
}

/* The offers of ITEMS[N] into O, component by component in place_names' order, each in layer
 * order (ref: the item). Returns their count. */
static int place_trunk_offers(const struct place_item *items, int n, struct place_offer *o)
{
    int k = 0;
    for (int c = 0; c < PLACE_EXPERTS; c++)
        for (int i = 0, ordinal = -1, layer = INT_MIN; i < n; i++) {
            if (items[i].comp != (enum place_component)c) continue;
            if (items[i].layer != layer) ordinal++; /* split rules count layers, not matrices */
            layer = items[i].layer;
            size_t b = (size_t)items[i].m->rows * items[i].m->row_bytes;
            o[k++] = (struct place_offer){c, ordinal, cuda_span(&b, 1), b, 1.0, place_matrix_devices(items[i].m), PLACE_CPU, 0, 0, i};
        }
    return k;
}

/* Expert KEY's matrices in S (gate, up, down) into W, their bytes into *CPU_BYTES (NULL: not
 * wanted); returns the VRAM they take. */
static size_t place_expert_parts(const struct expert_store *s, int32_t key, struct ops_matrix w[3], size_t *cpu_bytes)
{
    size_t part[3];
    for (int j = 0; j < 3; j++) {
        w[j] = expert_mapped(&s->src[key / s->n_expert][j].t, key % s->n_expert);
        part[j] = (size_t)w[j].rows * w[j].row_bytes;
    }
    if (cpu_bytes) *cpu_bytes = part[0] + part[1] + part[2];
    return cuda_span(part, 3);
}

/* The offers of S's experts into O, hottest first (ref: the key), each read with the
 * probability p_e that a token routes to it: its share of the heat over the n_layers layers
 * a token passes, times TOP_K; TOP_K / n_expert without heat. Returns their count. */
static int place_expert_offers(const struct expert_store *s, int top_k, struct place_offer *o)
{
    int cells = s->n_layers * s->n_expert;
    int32_t *order = place_expert_order(s);
    uint32_t *devices = plat_alloc((size_t)s->n_layers * sizeof *devices);
    double heat_total = 0;
    for (int l = 0; l < s->n_layers; l++) devices[l] = place_expert_devices(s, l);
    for (int i = 0; i < cells; i++) heat_total += s->heat[i];
    for (int i = 0; i < cells; i++) {
        int key = order[i], l = key / s->n_expert;
        struct ops_matrix w[3];
        size_t b, vram = place_expert_parts(s, key, w, &b);
        double p = heat_total > 0 ? s->heat[key] * s->n_layers * top_k / heat_total : (double)top_k / s->n_expert;
        o[i] = (struct place_offer){PLACE_EXPERTS, l, vram, b, p, devices[l], PLACE_CPU, 0, 0, key};
    }
    free(devices);
    free(order);
    return cells;
}

/* Uploads (a dry run charges) what place_decide sent to a device among O[N] (the trunk first,
 * N_TRUNK of ITEMS; then S's experts); what fails to upload stays on the CPU, for want of room. */
static void place_apply(struct place_offer *o, int n_trunk, int n, const struct place_item *items, struct expert_store *s)
{
    for (int i = 0; i < n; i++) {
        if (o[i].home < 0) continue;
        int failed;
        if (i < n_trunk) failed = place_matrix(items[o[i].ref].m, o[i].home);
        else {
            struct ops_matrix w[3];
            place_expert_parts(s, o[i].ref, w, NULL);
            failed = place_expert(o[i].home, w, &s->vram[o[i].ref].e);
            if (!failed) s->vram[o[i].ref].dev = o[i].home;
        }
        if (failed) {
            o[i].home = PLACE_CPU;
            o[i].why = PLACE_NO_ROOM;
        }
    }
}

/* Appends to LINE (LEN of CAP bytes used) what went to each device, COUNT[d], and the budget it
 * has left; then what stays on the CPU, CPU_TEXT (their count and size), and why, WHY[]. */
static void place_line_end(char *line, size_t cap, int len, const int *count, const int why[4], const char *cpu_text)
{
    static const char *const reason[4] = {"", "--place", "no room in the budget", "no kernel for the type"};
    static const char *const counted[4] = {"", "by --place", "with no room in the budget", "with no kernel for the type"};
    for (int i = 0; i < cuda.n_devices && len < (int)cap - 64; i++)
        if (count[i]) len += snprintf(line + len, cap - (size_t)len, " cuda %d: %d (%.1f GiB left)", i, count[i],
                                      (double)(cuda.dev[i].budget - cuda.dev[i].used) / 1073741824.0);
    int kinds = (why[1] > 0) + (why[2] > 0) + (why[3] > 0);
    if (kinds) len += snprintf(line + len, cap - (size_t)len, " cpu: %s (", cpu_text);
    for (int k = 1, said = 0; k < 4 && len < (int)cap - 64; k++)
        if (why[k] && kinds == 1) len += snprintf(line + len, cap - (size_t)len, "%s", reason[k]);
        else if (why[k]) len += snprintf(line + len, cap - (size_t)len, "%s%d %s", said++ ? ", " : "", why[k], counted[k]);
    if (kinds) snprintf(line + len, cap - (size_t)len, ")");
    place_say(line);
}

/* Where one component's offers went, for its [place] line and plan --json: their count and
 * host bytes; those placed, per device, with their VRAM; why the others stayed; the values
 * (lo..hi over all of them; first and last of those placed, in the order decided). */
struct place_summary {
    int total, placed, on[CUDA_MAX_DEVICES], why[4];
    double bytes, placed_bytes, vram_bytes, lo, hi, first, last;
};

static struct place_summary place_summarize(const struct place_offer *o, int n, enum place_component c)
{
    struct place_summary m = {.lo = DBL_MAX};
    for (int i = 0; i < n; i++) {
        if (o[i].comp != c) continue;
        m.total++;
        m.why[o[i].why]++;
        m.bytes += (double)o[i].cpu_bytes;
        m.lo = fmin(m.lo, o[i].value);
        m.hi = fmax(m.hi, o[i].value);
        if (o[i].home < 0) continue;
        m.on[o[i].home]++;
        m.placed_bytes += (double)o[i].cpu_bytes;
        m.vram_bytes += (double)o[i].bytes;
        m.last = o[i].value;
        if (!m.placed++) m.first = m.last;
    }
    if (!m.total) m.lo = 0;
    return m;
}

/* One [place] line for trunk component C (summary M): where its matrices went, at what value. */
static void place_say_component(const struct place_summary *m, enum place_component c)
{
    char line[512], value[32], cpu_text[64];
    if (m->hi - m->lo < 0.005) snprintf(value, sizeof value, "%.2f", m->hi);
    else snprintf(value, sizeof value, "%.2f..%.2f", m->lo, m->hi);
    int len = snprintf(line, sizeof line, "[place] %s: %d matri%s, %.1f MiB, value %s per byte ->", place_names[c], m->total,
                       m->total > 1 ? "ces" : "x", m->bytes / 1048576.0, value);
    snprintf(cpu_text, sizeof cpu_text, "%d, %.1f MiB", m->total - m->placed, (m->bytes - m->placed_bytes) / 1048576.0);
    place_line_end(line, sizeof line, len, m->on, m->why, cpu_text);
}

/* The [place] line of the experts (summary M): how many went where, their VRAM, and the values
 * of the first (hottest) and the last placed. */
static void place_say_experts(const struct place_summary *m)
{
    char line[512], cpu_text[16];
    int len = snprintf(line, sizeof line, "[place] experts: %d of %d, %.2f GiB, value %.3f..%.3f per byte ->", m->placed, m->total,
                       m->vram_bytes / 1073741824.0, m->first, m->last);
    snprintf(cpu_text, sizeof cpu_text, "%d", m->total - m->placed);
    place_line_end(line, sizeof line, len, m->on, m->why, cpu_text);
}

/* The [place] line of the prices that decided between the trunk O[0..N_TRUNK) and the experts
 * O[N_TRUNK..N): the host's terms (H), the last expert placed and the first kept on the CPU. */
static void place_say_prices(const struct place_offer *o, int n_trunk, int n, const struct place_host *h)
{
    int last = -1, kept = -1;
    for (int i = n_trunk; i < n; i++)
        if (o[i].home >= 0) last = i;
        else if (kept < 0 && o[i].why != PLACE_BY_RULE) kept = i;
    char line[512], cache[128], side[2][64];
    if (h->cache_bytes < 0) snprintf(cache, sizeof cache, "every expert in memory");
    else snprintf(cache, sizeof cache, "a RAM cache of %lld experts%s, a read from the file %.0fx a read from RAM", (long long)place_slots(h, 0),
                  h->cache_grows ? " and the RAM the trunk leaves" : "", 1 + h->miss_extra);
    for (int k = 0; k < 2; k++) {
        int i = k ? kept : last;
        if (i < 0) snprintf(side[k], sizeof side[k], "none");
        else snprintf(side[k], sizeof side[k], "p %.3f, value %.3f", o[i].p, o[i].value);
    }
    snprintf(line, sizeof line, "[place] prices: %s; last expert placed: %s; first kept on the CPU: %s", cache, side[0], side[1]);
    place_say(line);
}

/* A --place list naming a device that is not there, or not selected (--gpu), is a usage error.
 * Without a driver nothing is checked: everything stays on the CPU, as `cuda: none` says. */
static void place_check_devices(const char *spec, const struct place_rule rule[PLACE_COUNT])
{
    for (int c = 0; c < PLACE_COUNT && cuda.n_devices > 0; c++)
        for (int i = 0; i < rule[c].n; i++) {
            int d = rule[c].seg[i].dev;
            if (d >= cuda.n_devices) die_usage("--place %s: there is no CUDA device %d (%d found)", spec, d, cuda.n_devices);
            if (d >= 0 && !cuda.dev[d].selected) die_usage("--place %s: CUDA device %d is not selected (--gpu)", spec, d);
        }
}

/* ---- the probe ----
 * Before the trunk is placed (auto only: a list is obeyed as written), one representative trunk
 * product is timed on each device (cuda_probe_product: the kernel by the device's events, the
 * round trip of input and output by the host's clock) and on the CPU. A device whose product,
 * round trip included, is slower than the CPU's gets no trunk; its room goes to the experts. */

static int place_no_probe; /* --no-probe: every device is taken to be faster than the CPU, as said */

/* The probe's figures for one device, in seconds per product: its kernel and round trip, and
 * the CPU's product. */
struct place_probe { double kernel, round_trip, cpu; };

/* What the probe found, for the expected time per token: GB/s of the CPU's product and of each
 * device's kernel (0: not probed), and each device's round trip in seconds. (The expert batch
 * it times includes its copies, which the time model counts as round trips: it only decides
 * whether the experts may go to a device.) */
struct place_speed { double cpu_gbps, gbps[CUDA_MAX_DEVICES], round_trip[CUDA_MAX_DEVICES]; };

static int place_probe_slower(const struct place_probe *p) { return p->kernel + p->round_trip > p->cpu; }

/* Takes device DEV out of the trunk offers O[N_TRUNK]. */
static void place_withdraw_trunk(struct place_offer *o, int n_trunk, int dev)
{
    for (int i = 0; i < n_trunk; i++) o[i].devices &= ~(1u << dev);
}

#define PLACE_PROBE_BYTES ((size_t)64 << 20)

/* The matrix the probe times: the largest of ITEMS[N] up to PLACE_PROBE_BYTES (on the big
 * models a DeltaNet or attention projection, the kind the trunk has most of), or NULL. */
static const struct ops_matrix *place_probe_matrix(const struct place_item *items, int n)
{
    const struct ops_matrix *best = NULL;
    for (int i = 0; i < n; i++) {
        size_t b = (size_t)items[i].m->rows * items[i].m->row_bytes;
        if (b <= PLACE_PROBE_BYTES && (!best || b > (size_t)best->rows * best->row_bytes)) best = items[i].m;
    }
    return best;
}

/* The CPU's time for one product over W: the best of CUDA_PROBE_REPS after one to warm up. */
static double place_cpu_product(const struct ops_matrix *w)
{
    float *x = plat_zalloc((size_t)w->cols, sizeof *x), *y = plat_alloc((size_t)w->rows * sizeof *y);
    double t = DBL_MAX;
    ops_matvec(w, x, y);
    for (int i = 0; i < CUDA_PROBE_REPS; i++) {
        double t0 = plat_now();
        ops_matvec(w, x, y);
        t = fmin(t, plat_now() - t0);
    }
    free(x);
    free(y);
    return t;
}

/* The CPU's time for a batch of N_JOBS jobs over expert W (gate, up, down): the best of
 * CUDA_PROBE_REPS after one to warm up. */
static double place_cpu_experts(const struct ops_matrix w[3], int n_jobs)
{
    float *x = plat_zalloc((size_t)w[0].cols, sizeof *x), *g = plat_alloc((size_t)w[0].rows * sizeof *g);
    float *u = plat_alloc((size_t)w[0].rows * sizeof *u), *y = plat_alloc((size_t)w[2].rows * sizeof *y);
    double best = DBL_MAX;
    for (int rep = -1; rep < CUDA_PROBE_REPS; rep++) {
        double t0 = plat_now();
        for (int j = 0; j < n_jobs; j++) {
            ops_matvec(&w[0], x, g);
            ops_matvec(&w[1], x, u);
            ops_swiglu(g, u, w[0].rows);
            ops_matvec(&w[2], g, y);
        }
        if (rep >= 0) best = fmin(best, plat_now() - t0);
    }
    free(x);
    free(g);
    free(u);
    free(y);
    return best;
}

/* The experts' probe on device D: a batch of TOP_K jobs over expert W (shape SH, BYTES on the
 * CPU) there against CPU_S on the CPU; a [probe] line, and the experts among O[N_TRUNK..N)
 * withdrawn from D when it is slower. */
static void place_probe_experts(int d, const struct cuda_moe_shape *sh, const struct ops_matrix w[3], size_t bytes, int top_k, double cpu_s,
                                struct place_offer *o, int n_trunk, int n)
{
    char line[384];
    int jobs = top_k < CUDA_PROBE_JOBS ? top_k : CUDA_PROBE_JOBS;
    double t = cuda_probe_experts(d, sh, w, jobs), mib = (double)bytes / 1048576.0;
    if (t <= 0) {
        snprintf(line, sizeof line, "[probe] cuda %d: cannot time an expert batch there: taken to be faster than the CPU", d);
        if (cuda.ready) place_say(line);
        return;
    }
    snprintf(line, sizeof line, "[probe] cuda %d: a batch of %d experts (%.2f MiB each, %s) %.3f ms (%.1f GB/s), on the CPU %.3f ms (%.1f GB/s): %s",
             d, jobs, mib, gguf_types[w[0].type].name, t * 1e3, jobs * (double)bytes / 1e9 / t, cpu_s * 1e3, jobs * (double)bytes / 1e9 / cpu_s,
             t > cpu_s ? "slower than the CPU, no experts there" : "the experts may go there");
    place_say(line);
    for (int i = n_trunk; i < n && t > cpu_s; i++) o[i].devices &= ~(1u << d);
}

/* Probes each usable device with the largest probe matrix of ITEMS[N_ITEMS], and with a batch
 * of TOP_K experts of S (NULL: none) as decode runs it (a [probe] line each, the figures into
 * *SP), and withdraws from the offers O[N] (the trunk O[0..N_TRUNK)) the devices slower than
 * the CPU for them. */
static void place_probe_devices(const struct place_item *items, int n_items, const struct expert_store *s, int top_k, struct place_offer *o,
                                int n_trunk, int n, struct place_speed *sp)
{
    const struct ops_matrix *w = place_probe_matrix(items, n_items);
    if (!w) return;
    if (place_no_probe) {
        place_say("[probe] off (--no-probe): every device taken to be faster than the CPU for the trunk");
        return;
    }
    double mib = (double)w->rows * w->row_bytes / 1048576.0;
    struct place_probe p = {0, 0, place_cpu_product(w)};
    sp->cpu_gbps = mib * 1048576.0 / 1e9 / p.cpu;
    struct ops_matrix ew[3];
    struct cuda_moe_shape sh;
    size_t expert_bytes = 0;
    double cpu_experts = 0;
    int layer = -1;
    for (int l = 0; s && l < s->n_layers && layer < 0; l++)
        if (place_expert_devices(s, l)) layer = l;
    if (layer >= 0) {
        place_expert_shape(s, layer, &sh);
        place_expert_parts(s, layer * s->n_expert, ew, &expert_bytes);
        cpu_experts = place_cpu_experts(ew, top_k < CUDA_PROBE_JOBS ? top_k : CUDA_PROBE_JOBS);
    }
    for (int d = 0; d < cuda.n_devices && cuda.ready; d++) {
        char line[384];
        if (!cuda.dev[d].usable) continue;
        if (cuda_probe_product(d, w, &p.kernel, &p.round_trip)) {
            snprintf(line, sizeof line, "[probe] cuda %d: cannot time a product there (no events in this driver, or no memory): taken to be faster than the CPU", d);
            if (cuda.ready) place_say(line);
            continue;
        }
        int slower = place_probe_slower(&p);
        sp->gbps[d] = mib * 1048576.0 / 1e9 / p.kernel;
        sp->round_trip[d] = p.round_trip;
        snprintf(line, sizeof line, "[probe] cuda %d: a %.1f MiB %s product %.3f ms (kernel %.3f ms, %.1f GB/s; round trip %.3f ms), on the CPU %.3f ms (%.1f GB/s): %s",
                 d, mib, gguf_types[w->type].name, (p.kernel + p.round_trip) * 1e3, p.kernel * 1e3, mib * 1048576.0 / 1e9 / p.kernel,
                 p.round_trip * 1e3, p.cpu * 1e3, mib * 1048576.0 / 1e9 / p.cpu, slower ? "slower than the CPU, no trunk there" : "the trunk may go there");
        place_say(line);
        if (slower) place_withdraw_trunk(o, n_trunk, d);
        if (layer >= 0 && (place_expert_devices(s, layer) >> d & 1))
            place_probe_experts(d, &sh, ew, expert_bytes, top_k, cpu_experts, o, n_trunk, n);
    }
}

/* What place_model placed: for coli plan, and the RAM budget of what stays on the CPU. */
struct place_result {
    double trunk_cpu_bytes;                /* the trunk's host bytes now in VRAM */
    double expert_cpu_bytes;               /* the experts' host bytes now in VRAM */
    int64_t trunk_vram[CUDA_MAX_DEVICES];  /* each device's VRAM the trunk takes */
    struct place_summary comp[PLACE_COUNT];
    double cpu_per_token, file_per_token;  /* expected bytes per token: on the host bus; of them read from the file */
    double dev_per_token[CUDA_MAX_DEVICES];
    struct place_speed speed;              /* the probe's figures; zeros: not probed */
};

/* A --place list that does not fit says what: a line for each component with offers among O[N]
 * that the list sent to a device with no room for them, and the room the devices have left. */
static void place_say_misfits(const struct place_offer *o, int n, const char *spec)
{
    for (int c = 0; c < PLACE_COUNT && spec && strcmp(spec, "auto") && strcmp(spec, "off"); c++) {
        int misfits = 0, total = 0;
        double bytes = 0;
        for (int i = 0; i < n; i++) {
            if (o[i].comp != (enum place_component)c) continue;
            total++;
            if (o[i].why != PLACE_NO_ROOM) continue;
            misfits++;
            bytes += (double)o[i].bytes;
        }
        if (!misfits) continue;
        char line[512];
        int len = snprintf(line, sizeof line, "[place] --place %s: %d of %d %s (%.1f MiB) do not fit:", spec, misfits, total,
                           place_names[c], bytes / 1048576.0);
        for (int d = 0, said = 0; d < cuda.n_devices && len < (int)sizeof line - 48; d++)
            if (cuda.dev[d].usable) len += snprintf(line + len, sizeof line - (size_t)len, "%s cuda %d has %.2f MiB left", said++ ? "," : "", d,
                                                    (double)(cuda.dev[d].budget - cuda.dev[d].used) / 1048576.0);
        place_say(line);
    }
}

/* The bytes each bus is expected to read per token once O[N] are placed: a trunk matrix all of
 * it, an expert p times it; a CPU expert beyond what the RAM cache holds (the hottest, once the
 * trunk in VRAM has left FREED bytes to it) is read from the file too, as place_decide prices. */
static void place_expect(const struct place_offer *o, int n_trunk, int n, const struct place_host *h, double freed,
                         struct place_result *r)
{
    int64_t slots = place_slots(h, freed), rank = 0;
    for (int i = 0; i < n; i++) {
        double b = o[i].p * (double)o[i].cpu_bytes;
        if (o[i].home >= 0) r->dev_per_token[o[i].home] += b;
        else if (i < n_trunk || rank++ < slots) r->cpu_per_token += b;
        else {
            r->cpu_per_token += b * (1 + h->miss_extra);
            r->file_per_token += b;
        }
    }
}

/* The seconds per token device D's bus takes for what R puts there, at the speeds SP (0: not
 * probed). */
static double place_device_seconds(const struct place_result *r, const struct place_speed *sp, int d)
{
    return sp->gbps[d] > 0 ? r->dev_per_token[d] / (sp->gbps[d] * 1e9) : 0;
}

/* The expected seconds per token of the decisions in O[N] (the trunk O[0..N_TRUNK)) at the
 * probe's speeds SP: each bus's bytes (place_expect) over its speed, plus a device's round
 * trip for each call a token makes to it: one per trunk component and layer it holds, one
 * expert batch per layer (reads from the file not timed). Experts run at the trunk's speed. */
static double place_expected_seconds(const struct place_offer *o, int n_trunk, int n, const struct place_host *h, const struct place_speed *sp)
{
    struct place_result r = {0};
    int layers = 1;
    for (int i = 0; i < n; i++) {
        if (i < n_trunk && o[i].home >= 0) r.trunk_cpu_bytes += (double)o[i].cpu_bytes;
        if (o[i].ordinal >= layers) layers = o[i].ordinal + 1;
    }
    place_expect(o, n_trunk, n, h, r.trunk_cpu_bytes, &r);
    double seconds = r.cpu_per_token / (sp->cpu_gbps * 1e9);
    uint8_t *called = plat_zalloc((size_t)CUDA_MAX_DEVICES * PLACE_COUNT * (size_t)layers, 1);
    for (int d = 0; d < CUDA_MAX_DEVICES; d++) seconds += place_device_seconds(&r, sp, d);
    for (int i = 0; i < n; i++) {
        uint8_t *c = o[i].home >= 0 ? &called[((size_t)o[i].home * PLACE_COUNT + o[i].comp) * (size_t)layers + (size_t)o[i].ordinal] : NULL;
        if (c && !*c) seconds += sp->round_trip[o[i].home];
        if (c) *c = 1;
    }
    free(called);
    return seconds;
}

#define PLACE_SPLIT_GAIN 0.05 /* a split must save this share of mixed's time per token to be chosen */

/* With two or more probed devices: the trunk on device t (one the probe left it) and the
 * experts on device e, for each pair (t = e: all on one), against mixed by room, each decided on a copy of O[N] (the trunk
 * O[0..N_TRUNK)) with RULE, H and ROOMS and priced by place_expected_seconds at SP. The fastest
 * wins if it beats mixed by PLACE_SPLIT_GAIN (else mixed); O's device masks are narrowed to it.
 * One [probe] line with each candidate's time (measured figures, so not a [place] line: those
 * say the decisions, which plan and run share). */
static void place_choose_split(struct place_offer *o, int n_trunk, int n, const struct place_rule rule[PLACE_COUNT],
                               const struct place_host *h, const struct place_rooms *rooms, const struct place_speed *sp)
{
    int probed = 0, best_t = -1, best_e = -1;
    uint32_t trunk_ok = 0, experts_ok = 0; /* the devices the probe left the trunk, the experts */
    for (int d = 0; d < rooms->n; d++) probed += sp->gbps[d] > 0;
    for (int i = 0; i < n; i++) *(i < n_trunk ? &trunk_ok : &experts_ok) |= o[i].devices;
    if (probed < 2) return;
    struct place_offer *try = plat_alloc((size_t)n * sizeof *try);
    double best = INFINITY, mixed = INFINITY;
    char line[1024];
    int len = snprintf(line, sizeof line, "[probe] expected per token:");
    for (int t = -1; t < rooms->n; t++)
        for (int e = t < 0 ? -1 : 0; e < (t < 0 ? 0 : rooms->n) && len < (int)sizeof line - 80; e++) {
            if (t >= 0 && (!(trunk_ok >> t & 1) || !(experts_ok >> e & 1) || rooms->room[t] <= 0 || rooms->room[e] <= 0)) continue;
            memcpy(try, o, (size_t)n * sizeof *try);
            for (int i = 0; i < n && t >= 0; i++) try[i].devices &= 1u << (i < n_trunk ? t : e);
            struct place_rooms left = *rooms;
            place_decide(try, n_trunk, n, rule, h, &left);
            double sec = place_expected_seconds(try, n_trunk, n, h, sp);
            if (t < 0) len += snprintf(line + len, sizeof line - (size_t)len, " mixed by room %.3f ms", sec * 1e3);
            else if (t == e) len += snprintf(line + len, sizeof line - (size_t)len, ", all on cuda %d %.3f ms", t, sec * 1e3);
            else len += snprintf(line + len, sizeof line - (size_t)len, ", trunk on cuda %d and experts on cuda %d %.3f ms", t, e, sec * 1e3);
            if (t < 0) mixed = sec;
            else if (sec < best) {
                best = sec;
                best_t = t;
                best_e = e;
            }
        }
    free(try);
    if (!(best < mixed * (1 - PLACE_SPLIT_GAIN))) best_t = best_e = -1;
    if (best_t < 0) snprintf(line + len, sizeof line - (size_t)len, " -> mixed by room");
    else if (best_t == best_e) snprintf(line + len, sizeof line - (size_t)len, " -> all on cuda %d", best_t);
    else snprintf(line + len, sizeof line - (size_t)len, " -> trunk on cuda %d, experts on cuda %d", best_t, best_e);
    place_say(line);
    for (int i = 0; i < n && best_t >= 0; i++) o[i].devices &= 1u << (i < n_trunk ? best_t : best_e);
}

/* Prices and places the trunk ITEMS[N_ITEMS] and S's routed experts (S NULL: a dense model),
 * TOP_K of each layer's routed per token, as SPEC allows, with the host's terms H for what
 * stays; uploads (a dry run charges) what was decided, and says it: a [place] line per trunk
 * component, one for the experts, one of the prices. Fills *R. */
static void place_model(const struct place_item *items, int n_items, struct expert_store *s, int top_k, const char *spec,
                        const struct place_host *h, struct place_result *r)
{
    struct place_rule rule[PLACE_COUNT];
    memset(r, 0, sizeof *r);
    place_parse(spec, rule);
    place_check_devices(spec, rule);
    int cells = s ? s->n_layers * s->n_expert : 0;
    struct place_offer *o = plat_zalloc((size_t)(n_items + cells), sizeof *o);
    struct place_rooms rooms = {cuda.ready ? cuda.n_devices : 0, {0}};
    for (int d = 0; d < rooms.n; d++) rooms.room[d] = cuda.dev[d].usable ? cuda.dev[d].budget - cuda.dev[d].used : -1;
    int n_trunk = place_trunk_offers(items, n_items, o), n = n_trunk + (s ? place_expert_offers(s, top_k, o + n_trunk) : 0);
    int probe = cuda.ready && (!spec || !strcmp(spec, "auto"));
    if (probe) place_probe_devices(items, n_items, s, top_k, o, n_trunk, n, &r->speed);
    if (probe && cuda.ready) place_choose_split(o, n_trunk, n, rule, h, &rooms, &r->speed);
    if (!cuda.ready) rooms.n = 0; /* the probe's launch failed: the GPU path has ended */
    if (cuda.ready && s) {
        s->vram = plat_alloc((size_t)cells * sizeof *s->vram);
        for (int i = 0; i < cells; i++) s->vram[i].dev = -1;
    }
    place_decide(o, n_trunk, n, rule, h, &rooms); /* without a device (or after a failed probe): all on the CPU */
    if (cuda.ready) place_apply(o, n_trunk, n, items, s);
    for (int c = 0; c < PLACE_COUNT; c++) r->comp[c] = place_summarize(o, n, (enum place_component)c);
    if (cuda.ready) {
        for (int c = 0; c < PLACE_EXPERTS; c++)
            if (r->comp[c].total) place_say_component(&r->comp[c], (enum place_component)c);
        if (s) {
            place_say_experts(&r->comp[PLACE_EXPERTS]);
            place_say_prices(o, n_trunk, n, h);
        }
        place_say_misfits(o, n, spec);
    }
    for (int i = 0; i < n; i++) {
        if (o[i].home < 0) continue;
        if (i < n_trunk) r->trunk_vram[o[i].home] += (int64_t)o[i].bytes;
        *(i < n_trunk ? &r->trunk_cpu_bytes : &r->expert_cpu_bytes) += (double)o[i].cpu_bytes;
    }
    place_expect(o, n_trunk, n, h, r->trunk_cpu_bytes, r);
    free(o);
}

/* ---- re-tiering while running ----
 * The heat keeps counting as tokens go, so the experts placed at start (by a heat file from
 * other prompts, or none) drift from the ones this conversation routes to. At each token
 * boundary place_retier switches over the uploads that have arrived and, on each device with
 * no upload under way, swaps its coldest resident expert for the hottest one on the CPU it can
 * run and hold, when that one is clearly hotter: the cold one computes on the CPU from then
 * on, the hot one on the device from when its upload (in the background,
 * cuda_expert_upload_start) has arrived. One upload in flight per device paces it: on the
 * 35B-A3B at 5 tok/s that is 5 experts (9 MB) a second a card, far below what PCIe carries,
 * and a check is one pass over the heat (10240 floats). Tokens do not change: both sides
 * compute the same bits. */

#define PLACE_RETIER_WINDOW 64 /* tokens: the window of the VRAM statistics, the store's repin period */
#define PLACE_RETIER_GAIN 1.5  /* hysteresis: the expert brought in is routed 1.5x as often as the one it evicts */

/* Whether expert KEY of S is being uploaded to some device. */
static int place_uploading(const struct expert_store *s, int32_t key)
{
    for (int d = 0; d < cuda.n_devices; d++)
        if (s->swap_key[d] == key) return 1;
    return 0;
}

/* On device D: the coldest resident expert of S against the hottest on the CPU that D has
 * kernels and room for once the cold one is gone; swaps them when the hot one has been routed
 * and its heat is PLACE_RETIER_GAIN times the cold one's. */
static void place_retier_device(struct expert_store *s, int d)
{
    int cells = s->n_layers * s->n_expert, cold = -1, hot = -1;
    struct ops_matrix w[3];
    for (int key = 0; key < cells; key++)
        if (s->vram[key].dev == d) {
            if (cold < 0 || s->heat[key] < s->heat[cold]) cold = key;
        } else if (s->vram[key].dev < 0 && (hot < 0 || s->heat[key] > s->heat[hot]) && (place_expert_devices(s, key / s->n_expert) >> d & 1) &&
                   !place_uploading(s, key))
            hot = key;
    if (cold < 0 || hot < 0 || s->heat[hot] < 1 || !(s->heat[hot] > PLACE_RETIER_GAIN * s->heat[cold])) return;
    size_t cold_bytes = place_expert_parts(s, cold, w, NULL), hot_bytes = place_expert_parts(s, hot, w, NULL);
    if ((int64_t)hot_bytes > cuda.dev[d].budget - cuda.dev[d].used + (int64_t)cold_bytes) return;
    expert_fill_hole(s, hot); /* its bytes are what gets uploaded */
    cuda_expert_free(d, &s->vram[cold].e);
    s->vram[cold].dev = -1;
    if (cuda_expert_upload_start(d, w, &s->swap_e[d])) return; /* the cold one stays on the CPU: still the same bits */
    s->swap_key[d] = hot;
    s->stats.swap_bytes += hot_bytes;
}

/* At a token boundary, T tokens after the last call: the re-tiering above. */
static void place_retier(struct expert_store *s, int T)
{
    if (!s || !s->vram || !cuda.ready || !cuda_async_ok()) return;
    for (int d = 0; d < cuda.n_devices; d++) {
        int32_t key = s->swap_key[d];
        int arrived = key >= 0 ? cuda_expert_upload_ready(d) : 0;
        if (arrived == 0) continue;
        if (arrived > 0) {
            s->vram[key] = (struct expert_vram){d, s->swap_e[d]};
            s->stats.swaps++;
        }
        s->swap_key[d] = -1;
    }
    if ((s->retier_tokens += T) >= PLACE_RETIER_WINDOW) {
        s->retier_tokens = 0;
        expert_window_end(s);
    }
    for (int d = 0; d < cuda.n_devices && cuda.ready; d++)
        if (cuda.dev[d].usable && s->swap_key[d] < 0) place_retier_device(s, d);
}

/* ==== §8 model ==== */
/* Owns: the hyper-parameters (from GGUF metadata only), the binding of weights into the
 *   mapping, the run state (KV cache, DeltaNet conv and recurrent state, and which copy of the
 *   latter is current where §5's chains keep it on a device), the forward pass.
 * Promises: model_load refuses an unknown architecture, a missing tensor or a wrong shape
 *   with one line naming it. model_forward computes the same bits for a token whether it
 *   arrives alone or in a batch, on any number of threads and any kernel level: every
 *   product goes through ops_matmat (bit-identical per column to ops_matvec), sums run in a
 *   fixed order, and parallel loops split independent rows or heads only.
 * May call: §1–§4, §5 (what runs on devices), §6 experts (routed experts come from its store,
 *   in the mapping or cached).
 * Workload: per decoded token the whole dense trunk is read once plus n_expert_used experts
 *   per layer; prompts run in batches of MODEL_BATCH tokens, each routed expert's weights
 *   read once per batch. The architecture is qwen35-arch.md; section numbers cite it. */

enum model_arch { MODEL_ARCH_QWEN35MOE, MODEL_ARCH_QWEN35, MODEL_ARCH_QWEN3NEXT };
static const char *const model_arch_names[] = {"qwen35moe", "qwen35", "qwen3next"};

enum model_layer_kind { MODEL_LAYER_DELTANET, MODEL_LAYER_ATTENTION };

/* Tokens per forward call. A prompt batch reads every routed expert it routes to once, and
 * with 8 of 256 experts a token nearly all of them: 18 GB a batch on the 35B-A3B, 280 MB a
 * token at 64 tokens, 70 MB at 256 (35 -> 47 tok/s at pp512 here). Past 256, the products'
 * activations (2 KiB a token) outgrow the L2 and the prompt slowed again. Scratch: ~90 MB. */
#define MODEL_BATCH 256
#define MODEL_MAX_RUNS 16 /* sequences per forward call (the logits scratch is one row each) */
#define MODEL_MAX_DIM (1 << 20)

struct model_config {
    enum model_arch arch;
    int n_layers; /* trunk layers: block_count minus an MTP block (§7), which is skipped */
    int dim, n_vocab, ctx_train;
    float eps;
    /* gated attention (§4) */
    int n_head, n_kv_head, head_dim, rope_dims;
    float rope_base;
    int full_attn_interval; /* layer i is attention iff (i+1) % interval == 0 (§2) */
    /* gated DeltaNet (§5) */
    int conv_kernel, ssm_nk, ssm_nv, ssm_dk, ssm_dv;
    int vhead_tiled; /* qwen35*: v-head p uses k-head p % nk (§9.5); qwen3next: p / (nv/nk) */
    /* feed-forward (§6): routed experts plus a shared expert, or a dense SwiGLU (qwen35) */
    int n_expert, n_expert_used, expert_ff, shexp_ff, ff;
};

struct model_layer {
    enum model_layer_kind kind;
    const float *attn_norm, *post_norm; /* [dim] each, the +1 already folded in (§9.4) */
    /* attention */
    struct ops_matrix wq;      /* [n_head * 2 * head_dim][dim]: per head query then gate rows */
    struct ops_matrix wk, wv;  /* [n_kv_head * head_dim][dim] */
    struct ops_matrix wo;      /* [dim][n_head * head_dim] */
    const float *q_norm, *k_norm; /* [head_dim] */
    /* DeltaNet */
    struct ops_matrix wqkv;    /* [2*nk*dk + nv*dv][dim]: all q | all k | all v */
    struct ops_matrix wz;      /* [nv*dv][dim] output gate */
    struct ops_matrix wbeta, walpha; /* [nv][dim] (qwen35*) */
    struct ops_matrix wba;     /* [2*nv][dim] (qwen3next): per k-head group [b.. | a..] */
    const float *conv;         /* [conv_dim][conv_kernel] */
    float *conv_taps;          /* the same [conv_kernel][conv_dim], made at load (model_conv_taps): the
                                * conv runs across channels */
    const float *dt_bias, *ssm_a; /* [nv]; ssm_a = -exp(A_log) */
    const float *ssm_norm;     /* [dv] shared by all heads, or [nv*dv] */
    int ssm_norm_per_head;
    struct ops_matrix wout;    /* [dim][nv*dv] */
    /* feed-forward */
    struct ops_matrix router;  /* [n_expert][dim] */
    struct expert_tensor gate_exps, up_exps; /* expert: [expert_ff][dim] */
    struct expert_tensor down_exps;          /* expert: [dim][expert_ff] */
    struct ops_matrix shexp_gate_inp;        /* [1][dim] */
    struct ops_matrix shexp_gate, shexp_up;  /* [shexp_ff][dim] */
    struct ops_matrix shexp_down;            /* [dim][shexp_ff] */
    struct ops_matrix ffn_gate, ffn_up, ffn_down; /* dense qwen35: [ff][dim], [dim][ff] */
};

struct model_layer_state {
    void *k_cache, *v_cache;  /* [n_kv_head][model_kv_rows][head_dim] in format m->kv, K after
                               * norm and RoPE: a KV head's rows are one run of memory (its GQA
                               * group reads only them; rows of all heads side by side had halved
                               * the scores' read speed) */
    float *conv_state;        /* [conv_kernel - 1][conv_dim] raw inputs, oldest first */
    float *ssm_state;         /* [nv][dk][dv]: per head S i-major (ops_delta_rule), 16 rows to a vector */
    int on_dev;               /* 1 + the device whose copy of the DeltaNet state is current (model_seq's
                               * dev_state), 0: none */
    int host_stale;           /* only that copy is: the CPU's is older (model_state_to_host) */
    int host_rows, dev_rows;  /* attention: the KV rows current on the CPU and on that device (the
                               * first so many; model_kv_to_host) */
};

/* One sequence (a conversation): what the forward pass remembers of its tokens. Many may
 * share one model; each holds n_ctx tokens of context. */
struct model_seq {
    struct model_layer_state *state; /* [n_layers] */
    int pos;                         /* tokens already in the state */
    cuda_ptr dev_state[CUDA_MAX_DEVICES]; /* every DeltaNet layer's state on a device where a chain ran
                                           * it (§5), laid out as a checkpoint's; 0: none */
    cuda_ptr dev_kv[CUDA_MAX_DEVICES];    /* every attention layer's KV cache there, as the CPU's */
};

/* Layer IL's part in this pass's chains (model_chain_plan): DEV, the device of the chain its
 * rest is in (-1: none); MIXER, its mixer runs there too; SPLIT, some of its routed experts are
 * the CPU's (its routing came down in the middle: model_layer_rest); BLOCK and IDS, its addresses in that
 * device's chain buffer (BLOCK_OFF before it is uploaded). */
struct model_chain {
    int dev, mixer, split;
    size_t block_off;
    cuda_ptr block, ids;
};

/* A run of a forward batch: N tokens appended to SEQ; LOGITS receives those of its last
 * token ([n_vocab], valid until the next forward). */
struct model_run {
    struct model_seq *seq;
    const int *tokens;
    int n;
    float *logits;
};

/* Scratch for one batch of up to MODEL_BATCH tokens; shapes use B = MODEL_BATCH. */
struct model_scratch {
    float *x, *xn, *out;     /* [B][dim] residual stream, normed input, block output */
    float *qg;               /* [B][n_head * 2 * head_dim] */
    float *k, *v;            /* [B][n_kv_head * head_dim] */
    float *attn;             /* [B][n_head * head_dim] gated attention output */
    float *scores;           /* [n_head][n_ctx + head_dim] (model_scores_floats) */
    struct ops_scratch splits; /* model_attention_spread's records */
    float *rope;             /* [B][rope_dims] cos then sin per position */
    float *mixed;            /* [B][conv_dim] */
    float *z;                /* [B][nv * dv] */
    float *beta, *alpha;     /* [B][nv] */
    float *ba;               /* [B][2 * nv] */
    float *core;             /* [B][nv * dv] DeltaNet output before out_proj */
    float *router;           /* [B][n_expert] probabilities */
    int *top;                /* [B][n_expert_used] chosen experts, best first */
    float *top_w;            /* [B][n_expert_used] renormalised weights */
    int *slot_of;            /* [B * n_expert_used] assignment order grouped by expert */
    int *want, *want_count;  /* [n_expert] experts routed in a layer, tokens routed to each */
    float *ex_in;            /* [B * n_expert_used][dim] tokens gathered by expert */
    float *ex_g, *ex_u;      /* [B * n_expert_used][max(expert_ff, shexp_ff, ff)] */
    float *ex_y;             /* [B * n_expert_used][dim] the gathered tokens' expert outputs */
    float *ex_out;           /* [B * n_expert_used][dim] each assignment's expert output */
    /* routed experts on devices (§5), and the shared expert where it joins them: the jobs of a
     * layer, grouped by device */
    int *ex_dev;             /* [n_expert] the device an expert of this layer runs on, or -1 */
    struct cuda_expert *ex_table; /* [n_expert] where they are, when a device runs the whole layer */
    struct cuda_moe_job *dev_jobs; /* [B * (n_expert_used + 1)] */
    int *dev_slot;           /* [B * (n_expert_used + 1)] each job's assignment (ex_out row), or -1 - t:
                              * token t's shared expert (sh_out row) */
    float *dev_out;          /* [B * (n_expert_used + 1)][dim] the jobs' outputs as downloaded */
    int dev_first[CUDA_MAX_DEVICES], dev_count[CUDA_MAX_DEVICES], dev_failed[CUDA_MAX_DEVICES];
    float *sh_h;             /* [B][shexp_ff] silu(gate x) * up x of the shared expert, apart from ex_g */
    float *sh_out;           /* [B][dim] */
    float *sh_gate;          /* [B] */
    struct model_seq **tok_seq; /* [B] the sequence each token of the batch belongs to */
    int *tok_pos;            /* [B] its position there */
    float *logits;           /* [MODEL_MAX_RUNS][n_vocab] for the last token of each run */
    struct model_chain *chain;  /* [n_layers] this pass's chains */
    struct cuda_deltanet *dn;   /* [n_layers] the DeltaNet layers' constants on their chain's device */
    struct cuda_attention *attn_dev; /* [n_layers] the attention layers' */
    uint8_t *chain_stage[CUDA_MAX_DEVICES]; /* what cuda_chain_begin uploads there, of chain_bytes */
    size_t chain_bytes[CUDA_MAX_DEVICES], chain_cap[CUDA_MAX_DEVICES];
    int chain_first;            /* the first layer of the chain under way (its ids not yet down), or -1 */
};

/* Where the forward passes' time goes, for bench: seconds per phase, prompt steps and decode
 * steps apart (engine_step says which), summed since the model was loaded. model_phase_mark
 * charges the time since the previous mark to a phase (~20 ns a mark, ~10 marks a layer);
 * sampling is the engine's, after the pass. */
enum model_phase { MODEL_PHASE_PRODUCTS, MODEL_PHASE_EXPERTS, MODEL_PHASE_DELTANET, MODEL_PHASE_ATTENTION,
                   MODEL_PHASE_ROUTING, MODEL_PHASE_OTHER, MODEL_PHASE_SAMPLING, MODEL_PHASE_COUNT };
static const char *const model_phase_names[MODEL_PHASE_COUNT] = {"products", "experts", "deltanet", "attention",
                                                                  "routing", "other", "sampling"};
struct model_profile {
    double seconds[2][MODEL_PHASE_COUNT]; /* [decode] */
    long calls[2], waits[2], graphs[2];   /* [decode]: driver calls, waits, graph launches (§5) */
    double mark;
    int decode;
};

struct model {
    struct gguf_file file;
    struct model_config cfg;
    struct model_layer *layers;       /* [n_layers] */
    const struct gguf_tensor *embed;  /* [n_vocab][dim] */
    const float *out_norm;            /* [dim] */
    struct ops_matrix lm_head;        /* [n_vocab][dim] */
    int n_ctx;                        /* tokens of context each sequence holds */
    enum ops_kv kv;                   /* --kv: the KV cache's format (default f32, as the reference's
                                       * goldens; f16 half the bytes, q8_0 about a quarter) */
    struct model_scratch s;
    char error[640];                  /* why the last forward failed */
    int lost;                         /* ... because a device failed with sequences' states on it: the
                                       * caller feeds them again (model_seq_lost) */
    struct expert_store *experts;     /* routed experts (NULL for a dense model) */
    void *trunk;                      /* the trunk matrices' own copy (model_own_trunk), or NULL */
    size_t trunk_bytes;
    struct model_profile profile;
};

/* An architecture hyper-parameter: ARCH.KEY, required unless DFLT >= 0, within [lo, hi]. */
static int model_hparam(const struct gguf_file *g, const char *arch, const char *key, int64_t dflt, int64_t lo, int64_t hi)
{
    char full[160];
    snprintf(full, sizeof full, "%s.%s", arch, key);
    int64_t v = gguf_get_int(g, full, dflt);
    if (v < 0 && dflt < 0) die("%s: missing metadata '%s'", g->path, full);
    if (v < lo || v > hi) die("%s: metadata '%s' = %lld is out of range [%lld, %lld]", g->path, full, (long long)v, (long long)lo, (long long)hi);
    return (int)v;
}

static float model_hparam_float(const struct gguf_file *g, const char *arch, const char *key, double dflt)
{
    char full[160];
    snprintf(full, sizeof full, "%s.%s", arch, key);
    double v = gguf_get_float(g, full, dflt);
    if (!(v > 0) || v > 1e12) die("%s: metadata '%s' = %g is out of range", g->path, full, v);
    return (float)v;
}

static void model_read_config(struct model_config *c, const struct gguf_file *g)
{
    size_t len;
    const char *a = gguf_get_string(g, "general.architecture", &len);
    if (!a) die("%s: missing metadata 'general.architecture'", g->path);
    int found = -1;
    for (int i = 0; i < 3; i++)
        if (strlen(model_arch_names[i]) == len && !memcmp(a, model_arch_names[i], len)) found = i;
    if (found < 0) die("%s: unsupported architecture '%.*s' (coli runs qwen35moe, qwen35, qwen3next)", g->path, (int)len, a);
    c->arch = (enum model_arch)found;
    const char *n = model_arch_names[found];
    int blocks = model_hparam(g, n, "block_count", -1, 1, 4096);
    c->n_layers = blocks - model_hparam(g, n, "nextn_predict_layers", 0, 0, blocks - 1);
    c->dim = model_hparam(g, n, "embedding_length", -1, 1, MODEL_MAX_DIM);
    c->ctx_train = model_hparam(g, n, "context_length", -1, 1, 1 << 24);
    c->eps = model_hparam_float(g, n, "attention.layer_norm_rms_epsilon", 1e-6);
    c->n_head = model_hparam(g, n, "attention.head_count", -1, 1, 4096);
    c->n_kv_head = model_hparam(g, n, "attention.head_count_kv", -1, 1, c->n_head);
    c->head_dim = model_hparam(g, n, "attention.key_length", -1, 2, 65536);
    if (model_hparam(g, n, "attention.value_length", c->head_dim, 1, 65536) != c->head_dim)
        die("%s: attention value_length differs from key_length; coli needs them equal", g->path);
    if (c->n_head % c->n_kv_head) die("%s: head_count %d is not a multiple of head_count_kv %d", g->path, c->n_head, c->n_kv_head);
    c->rope_dims = model_hparam(g, n, "rope.dimension_count", c->head_dim, 2, c->head_dim);
    if (c->rope_dims % 2) die("%s: rope.dimension_count %d is odd", g->path, c->rope_dims);
    c->rope_base = model_hparam_float(g, n, "rope.freq_base", 10000.0);
    c->full_attn_interval = model_hparam(g, n, "full_attention_interval", 4, 1, 4096);
    c->conv_kernel = model_hparam(g, n, "ssm.conv_kernel", -1, 1, 64);
    c->ssm_dk = model_hparam(g, n, "ssm.state_size", -1, 1, 65536);
    c->ssm_nk = model_hparam(g, n, "ssm.group_count", -1, 1, 65536);
    c->ssm_nv = model_hparam(g, n, "ssm.time_step_rank", -1, 1, 65536);
    int inner = model_hparam(g, n, "ssm.inner_size", -1, 1, MODEL_MAX_DIM);
    if (c->ssm_nv % c->ssm_nk || inner % c->ssm_nv)
        die("%s: DeltaNet heads do not divide (group_count %d, time_step_rank %d, inner_size %d)", g->path, c->ssm_nk, c->ssm_nv, inner);
    c->ssm_dv = inner / c->ssm_nv;
    c->vhead_tiled = c->arch != MODEL_ARCH_QWEN3NEXT;
    int moe = c->arch != MODEL_ARCH_QWEN35;
    c->n_expert = model_hparam(g, n, "expert_count", moe ? -1 : 0, 0, 65536);
    c->n_expert_used = model_hparam(g, n, "expert_used_count", moe ? -1 : 0, moe, c->n_expert);
    c->expert_ff = model_hparam(g, n, "expert_feed_forward_length", moe ? -1 : 0, 0, MODEL_MAX_DIM);
    c->shexp_ff = model_hparam(g, n, "expert_shared_feed_forward_length", moe ? -1 : 0, 0, MODEL_MAX_DIM);
    c->ff = model_hparam(g, n, "feed_forward_length", moe ? 0 : -1, 0, MODEL_MAX_DIM);
}

#define MODEL_FORMAT_ADVICE "the smallest formats coli reads are Q2_K, IQ3_XXS, IQ3_S and Q3_K_M (then " \
    "IQ4_XS, Q4_K_M): download the model in one of those"

/* Dies, naming the format and what to download, on a tensor whose block format §3 lacks. */
static void model_check_format(const struct gguf_file *g, const struct gguf_tensor *t)
{
    if (gguf_types[t->type].computes) return;
    die("%s: tensor '%s' is %s, a format coli does not read yet; %s", g->path, t->name,
        gguf_types[t->type].name, MODEL_FORMAT_ADVICE);
}

/* The tensor NAME, which must have exactly the given shape (outermost first); dies otherwise. */
static const struct gguf_tensor *model_tensor_get(const struct gguf_file *g, const char *name, int n_dims, const int64_t *shape)
{
    const struct gguf_tensor *t = gguf_tensor_find(g, name);
    if (!t) die("%s: missing tensor '%s'", g->path, name);
    model_check_format(g, t);
    /* an outer 1 is the same as no dimension: [1][dim] may be stored as [dim] */
    int td = t->n_dims;
    const int64_t *ts = t->shape;
    while (td > 1 && ts[0] == 1) { ts++; td--; }
    while (n_dims > 1 && shape[0] == 1) { shape++; n_dims--; }
    int same = td == n_dims;
    for (int i = 0; same && i < n_dims; i++) same = ts[i] == shape[i];
    if (!same) {
        char want[96] = "", got[96] = "";
        for (int i = 0; i < n_dims; i++) snprintf(want + strlen(want), sizeof want - strlen(want), "[%lld]", (long long)shape[i]);
        for (int i = 0; i < t->n_dims; i++) snprintf(got + strlen(got), sizeof got - strlen(got), "[%lld]", (long long)t->shape[i]);
        die("%s: tensor '%s' has shape %s, expected %s", g->path, name, got, want);
    }
    return t;
}

static struct ops_matrix model_matrix(const struct gguf_file *g, const char *name, int64_t rows, int64_t cols)
{
    int64_t shape[2] = {rows, cols};
    const struct gguf_tensor *t = model_tensor_get(g, name, 2, shape);
    struct ops_matrix m = {(enum gguf_type)t->type, t->data, rows, cols, gguf_row_bytes(t->type, cols), 0};
    return m;
}

/* A small F32 tensor of N values (norms, biases, conv taps). */
static const float *model_vector(const struct gguf_file *g, const char *name, int n_dims, const int64_t *shape)
{
    const struct gguf_tensor *t = model_tensor_get(g, name, n_dims, shape);
    if (t->type != GGUF_TYPE_F32) die("%s: tensor '%s' is %s; coli needs F32 here", g->path, name, gguf_types[t->type].name);
    return (const float *)t->data;
}

static struct expert_tensor model_experts_get(const struct gguf_file *g, const char *name, int64_t n, int64_t rows, int64_t cols)
{
    int64_t shape[3] = {n, rows, cols};
    const struct gguf_tensor *t = model_tensor_get(g, name, 3, shape);
    struct expert_tensor e;
    e.m = (struct ops_matrix){(enum gguf_type)t->type, t->data, rows, cols, gguf_row_bytes(t->type, cols), 0};
    e.stride = e.m.row_bytes * (size_t)rows;
    return e;
}

static const char *model_name(char *buf, int layer, const char *suffix)
{
    snprintf(buf, 96, "blk.%d.%s", layer, suffix);
    return buf;
}

static void model_bind_attention(struct model_layer *l, const struct gguf_file *g, const struct model_config *c, int i)
{
    char nm[96];
    int64_t hd = c->head_dim, one[1] = {hd};
    l->wq = model_matrix(g, model_name(nm, i, "attn_q.weight"), c->n_head * 2 * hd, c->dim);
    l->wk = model_matrix(g, model_name(nm, i, "attn_k.weight"), c->n_kv_head * hd, c->dim);
    l->wv = model_matrix(g, model_name(nm, i, "attn_v.weight"), c->n_kv_head * hd, c->dim);
    l->wo = model_matrix(g, model_name(nm, i, "attn_output.weight"), c->dim, c->n_head * hd);
    l->q_norm = model_vector(g, model_name(nm, i, "attn_q_norm.weight"), 1, one);
    l->k_norm = model_vector(g, model_name(nm, i, "attn_k_norm.weight"), 1, one);
}

static void model_bind_deltanet(struct model_layer *l, const struct gguf_file *g, const struct model_config *c, int i)
{
    char nm[96];
    int64_t nv = c->ssm_nv, vdim = nv * c->ssm_dv, conv_dim = 2 * (int64_t)c->ssm_nk * c->ssm_dk + vdim;
    int64_t conv_shape[2] = {conv_dim, c->conv_kernel}, heads[1] = {nv}, dv[1] = {c->ssm_dv};
    l->wqkv = model_matrix(g, model_name(nm, i, "attn_qkv.weight"), conv_dim, c->dim);
    l->wz = model_matrix(g, model_name(nm, i, "attn_gate.weight"), vdim, c->dim);
    if (c->arch == MODEL_ARCH_QWEN3NEXT) {
        l->wba = model_matrix(g, model_name(nm, i, "ssm_ba.weight"), 2 * nv, c->dim);
    } else {
        l->wbeta = model_matrix(g, model_name(nm, i, "ssm_beta.weight"), nv, c->dim);
        l->walpha = model_matrix(g, model_name(nm, i, "ssm_alpha.weight"), nv, c->dim);
    }
    l->conv = model_vector(g, model_name(nm, i, "ssm_conv1d.weight"), 2, conv_shape);
    l->dt_bias = model_vector(g, model_name(nm, i, "ssm_dt.bias"), 1, heads);
    l->ssm_a = model_vector(g, model_name(nm, i, "ssm_a"), 1, heads);
    const struct gguf_tensor *norm = gguf_tensor_find(g, model_name(nm, i, "ssm_norm.weight"));
    int64_t per_head[2] = {nv, c->ssm_dv};
    l->ssm_norm_per_head = norm && norm->n_elems == vdim && nv > 1;
    l->ssm_norm = l->ssm_norm_per_head ? model_vector(g, nm, 2, per_head) : model_vector(g, nm, 1, dv);
    l->wout = model_matrix(g, model_name(nm, i, "ssm_out.weight"), c->dim, vdim);
}

static void model_bind_ffn(struct model_layer *l, const struct gguf_file *g, const struct model_config *c, int i)
{
    char nm[96];
    if (c->n_expert == 0) {
        l->ffn_gate = model_matrix(g, model_name(nm, i, "ffn_gate.weight"), c->ff, c->dim);
        l->ffn_up = model_matrix(g, model_name(nm, i, "ffn_up.weight"), c->ff, c->dim);
        l->ffn_down = model_matrix(g, model_name(nm, i, "ffn_down.weight"), c->dim, c->ff);
        return;
    }
    l->router = model_matrix(g, model_name(nm, i, "ffn_gate_inp.weight"), c->n_expert, c->dim);
    l->gate_exps = model_experts_get(g, model_name(nm, i, "ffn_gate_exps.weight"), c->n_expert, c->expert_ff, c->dim);
    l->up_exps = model_experts_get(g, model_name(nm, i, "ffn_up_exps.weight"), c->n_expert, c->expert_ff, c->dim);
    l->down_exps = model_experts_get(g, model_name(nm, i, "ffn_down_exps.weight"), c->n_expert, c->dim, c->expert_ff);
    if (c->shexp_ff == 0) return;
    l->shexp_gate_inp = model_matrix(g, model_name(nm, i, "ffn_gate_inp_shexp.weight"), 1, c->dim);
    l->shexp_gate = model_matrix(g, model_name(nm, i, "ffn_gate_shexp.weight"), c->shexp_ff, c->dim);
    l->shexp_up = model_matrix(g, model_name(nm, i, "ffn_up_shexp.weight"), c->shexp_ff, c->dim);
    l->shexp_down = model_matrix(g, model_name(nm, i, "ffn_down_shexp.weight"), c->dim, c->shexp_ff);
}

/* Binds every weight of the trunk; the file stays open (and mapped) in m->file. */
static void model_bind(struct model *m)
{
    const struct gguf_file *g = &m->file;
    struct model_config *c = &m->cfg;
    char nm[96];
    int64_t dim1[1] = {c->dim};
    const struct gguf_tensor *embed = gguf_tensor_find(g, "token_embd.weight");
    if (!embed) die("%s: missing tensor 'token_embd.weight'", g->path);
    model_check_format(g, embed);
    if (embed->n_dims != 2 || embed->shape[1] != c->dim) die("%s: tensor 'token_embd.weight' has the wrong shape", g->path);
    c->n_vocab = (int)embed->shape[0];
    m->embed = embed;
    m->out_norm = model_vector(g, "output_norm.weight", 1, dim1);
    m->lm_head = gguf_tensor_find(g, "output.weight") ? model_matrix(g, "output.weight", c->n_vocab, c->dim)
                                                       : model_matrix(g, "token_embd.weight", c->n_vocab, c->dim);
    m->layers = plat_zalloc((size_t)c->n_layers, sizeof *m->layers);
    for (int i = 0; i < c->n_layers; i++) {
        struct model_layer *l = &m->layers[i];
        l->kind = (i + 1) % c->full_attn_interval == 0 ? MODEL_LAYER_ATTENTION : MODEL_LAYER_DELTANET;
        l->attn_norm = model_vector(g, model_name(nm, i, "attn_norm.weight"), 1, dim1);
        l->post_norm = model_vector(g, model_name(nm, i, "post_attention_norm.weight"), 1, dim1);
        if (l->kind == MODEL_LAYER_ATTENTION) model_bind_attention(l, g, c, i);
        else model_bind_deltanet(l, g, c, i);
        model_bind_ffn(l, g, c, i);
    }
}

static int64_t model_conv_dim(const struct model_config *c)
{
    return 2 * (int64_t)c->ssm_nk * c->ssm_dk + (int64_t)c->ssm_nv * c->ssm_dv;
}

/* Floats of one DeltaNet layer's recurrent state: its conv state, then its ssm state. */
static size_t model_recurrent_floats(const struct model_config *c)
{
    return (size_t)model_conv_dim(c) * (size_t)(c->conv_kernel - 1) + (size_t)c->ssm_nv * c->ssm_dv * c->ssm_dk;
}

/* Bytes of one cached row (a KV head's head_dim values at one position) in the cache's format. */
static size_t model_kv_row_bytes(const struct model *m) { return ops_kv_row_bytes((size_t)m->cfg.head_dim, m->kv); }

/* N positions of the KV cache rounded up to whole groups of OPS_KV_GROUP rows (Q8_0 keys are
 * stored a group at a time). */
static int64_t model_kv_whole_groups(int64_t n) { return (n + OPS_KV_GROUP - 1) / OPS_KV_GROUP * OPS_KV_GROUP; }

/* Rows a KV head's cache holds: n_ctx in whole groups. */
static int64_t model_kv_rows(const struct model *m) { return model_kv_whole_groups(m->n_ctx); }

/* Dies unless the model's heads suit the KV cache's format (Q8_0: whole blocks, at most
 * OPS_KV_MAX_HD). */
static void model_check_kv(const struct model *m)
{
    const int hd = m->cfg.head_dim;
    if (m->kv == OPS_KV_Q8_0 && (hd % QUANT_QK || hd > OPS_KV_MAX_HD))
        die("--kv q8_0: this model's attention heads have %d dimensions, not a multiple of %d up to %d (use --kv f16)", hd,
            QUANT_QK, OPS_KV_MAX_HD);
}

/* Bytes of KV cache one token of context takes (every attention layer). */
static int64_t model_kv_bytes_per_token(const struct model *m)
{
    int64_t n = 0;
    for (int i = 0; i < m->cfg.n_layers; i++)
        if (m->layers[i].kind == MODEL_LAYER_ATTENTION)
            n += 2 * (int64_t)m->cfg.n_kv_head * (int64_t)model_kv_row_bytes(m);
    return n;
}

/* Bytes of a sequence's recurrent state: every DeltaNet layer's (what a checkpoint copies). */
static int64_t model_recurrent_bytes(const struct model *m)
{
    int64_t state = 0;
    for (int i = 0; i < m->cfg.n_layers; i++)
        if (m->layers[i].kind == MODEL_LAYER_DELTANET) state += (int64_t)model_recurrent_floats(&m->cfg) * 4;
    return state;
}

/* Bytes one sequence takes at full context: its KV cache and its recurrent state. */
static int64_t model_seq_bytes(const struct model *m)
{
    return model_kv_bytes_per_token(m) * m->n_ctx + model_recurrent_bytes(m);
}

/* [a][b] floats of scratch; TOUCHED: faulted in now (plat_prefault), for the buffers a batch
 * writes from its first token on, not those sized for a whole context or every run at once. */
static float *model_buf(int64_t a, int64_t b, int touched)
{
    const size_t n = plat_mul_size(plat_mul_size((size_t)a, (size_t)b, "scratch"), sizeof(float), "scratch");
    float *p = plat_alloc_aligned(n);
    if (touched) plat_prefault(p, n);
    return p;
}

/* The rows of dim floats dev_out holds: a batch's device jobs' outputs, and what the rest of a
 * layer on a device brings back (model_rest_device checks that it fits). */
static size_t model_dev_out_rows(const struct model_config *c) { return (size_t)MODEL_BATCH * (size_t)(c->n_expert_used + 1); }

/* Floats of a head's scratch in s->scores: its scores over the whole context, then the output
 * of the split at hand. */
static size_t model_scores_floats(const struct model *m) { return (size_t)m->n_ctx + (size_t)m->cfg.head_dim; }

static void model_alloc_scratch(struct model *m)
{
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->s;
    int64_t B = MODEL_BATCH, nvdv = (int64_t)c->ssm_nv * c->ssm_dv, used = c->n_expert_used;
    int64_t ffmax = c->expert_ff > c->shexp_ff ? c->expert_ff : c->shexp_ff;
    if (c->ff > ffmax) ffmax = c->ff;
    s->x = model_buf(B, c->dim, 1);
    s->xn = model_buf(B, c->dim, 1);
    s->out = model_buf(B, c->dim, 1);
    s->qg = model_buf(B, (int64_t)c->n_head * 2 * c->head_dim, 1);
    s->k = model_buf(B, (int64_t)c->n_kv_head * c->head_dim, 1);
    s->v = model_buf(B, (int64_t)c->n_kv_head * c->head_dim, 1);
    s->attn = model_buf(B, (int64_t)c->n_head * c->head_dim, 1);
    s->scores = model_buf(c->n_head, (int64_t)model_scores_floats(m), 0);
    s->rope = model_buf(B, c->rope_dims, 1);
    s->mixed = model_buf(B, model_conv_dim(c), 1);
    s->z = model_buf(B, nvdv, 1);
    s->beta = model_buf(B, c->ssm_nv, 1);
    s->alpha = model_buf(B, c->ssm_nv, 1);
    s->ba = model_buf(B, 2 * (int64_t)c->ssm_nv, 1);
    s->core = model_buf(B, nvdv, 1);
    s->router = model_buf(B, c->n_expert > 0 ? c->n_expert : 1, 1);
    s->top = plat_zalloc((size_t)(B * (used ? used : 1)), sizeof(int));
    s->top_w = model_buf(B, used ? used : 1, 1);
    s->slot_of = plat_zalloc((size_t)(B * (used ? used : 1)), sizeof(int));
    s->want = plat_zalloc((size_t)(c->n_expert ? c->n_expert : 1), sizeof(int));
    s->want_count = plat_zalloc((size_t)(c->n_expert ? c->n_expert : 1), sizeof(int));
    s->ex_in = model_buf(B * (used ? used : 1), c->dim, 1);
    s->ex_g = model_buf(B * (used ? used : 1), ffmax ? ffmax : 1, 1);
    s->ex_u = model_buf(B * (used ? used : 1), ffmax ? ffmax : 1, 1);
    s->ex_y = model_buf(B * (used ? used : 1), c->dim, 1);
    s->ex_out = model_buf(B * (used ? used : 1), c->dim, 1);
    s->ex_dev = plat_zalloc((size_t)(c->n_expert ? c->n_expert : 1), sizeof(int));
    s->ex_table = plat_zalloc((size_t)(c->n_expert ? c->n_expert : 1), sizeof *s->ex_table);
    s->dev_jobs = plat_zalloc((size_t)(B * (used + 1)), sizeof *s->dev_jobs);
    s->dev_slot = plat_zalloc((size_t)(B * (used + 1)), sizeof(int));
    s->dev_out = model_buf((int64_t)model_dev_out_rows(c), c->dim, 0);
    s->sh_h = model_buf(B, c->shexp_ff ? c->shexp_ff : 1, 1);
    s->sh_out = model_buf(B, c->dim, 1);
    s->sh_gate = model_buf(B, 1, 1);
    s->tok_seq = plat_zalloc((size_t)B, sizeof *s->tok_seq);
    s->tok_pos = plat_zalloc((size_t)B, sizeof *s->tok_pos);
    s->logits = model_buf(MODEL_MAX_RUNS, c->n_vocab, 0); /* pages never written cost nothing */
    s->chain = plat_zalloc((size_t)c->n_layers, sizeof *s->chain);
    s->dn = plat_zalloc((size_t)c->n_layers, sizeof *s->dn);
    s->attn_dev = plat_zalloc((size_t)c->n_layers, sizeof *s->attn_dev);
}

/* A new sequence at position 0 with zero state. */
static void model_seq_init(const struct model *m, struct model_seq *q)
{
    const struct model_config *c = &m->cfg;
    q->pos = 0;
    q->state = plat_zalloc((size_t)c->n_layers, sizeof *q->state);
    for (int i = 0; i < c->n_layers; i++) {
        struct model_layer_state *st = &q->state[i];
        if (m->layers[i].kind == MODEL_LAYER_ATTENTION) {
            /* calloc: pages of context never reached are never touched */
            size_t n = plat_mul_size((size_t)model_kv_rows(m), (size_t)c->n_kv_head, "KV cache");
            st->k_cache = plat_zalloc(n, model_kv_row_bytes(m));
            st->v_cache = plat_zalloc(n, model_kv_row_bytes(m));
        } else {
            const size_t conv = (size_t)model_conv_dim(c) * (size_t)(c->conv_kernel - 1) + 1, ssm = (size_t)c->ssm_nv * c->ssm_dv * c->ssm_dk;
            st->conv_state = plat_zalloc(conv, sizeof(float));
            st->ssm_state = plat_zalloc(ssm, sizeof(float));
            plat_prefault(st->conv_state, conv * sizeof(float)); /* every token writes all of it */
            plat_prefault(st->ssm_state, ssm * sizeof(float));
        }
    }
}

/* ---- a sequence's state on devices ----
 * Where a chain (§5) runs a layer's mixer on a device, the DeltaNet state or the KV cache of
 * each of its sequences lives there between passes; the CPU's copy is brought up to date only
 * where the CPU needs it: its own pass over that layer, a checkpoint, a conversation parked. A
 * device that fails with the only current copy loses it: the sequence is then fed its tokens
 * again (model_seq_lost, the engine's replay). */

/* Layer IL's state's place in a sequence's state on a device, in floats: DeltaNet layers in
 * order, model_recurrent_floats apiece, as a checkpoint lays them. */
static uint64_t model_state_off(const struct model *m, int il)
{
    uint64_t n = 0;
    for (int i = 0; i < il; i++) n += m->layers[i].kind == MODEL_LAYER_DELTANET;
    return n * model_recurrent_floats(&m->cfg);
}

/* Copies layer IL's state of Q between the CPU and its place on device DEV (UP: there). */
static int model_state_copy(const struct model *m, struct model_seq *q, int il, int dev, int up)
{
    struct model_layer_state *st = &q->state[il];
    const size_t conv = (size_t)model_conv_dim(&m->cfg) * (size_t)(m->cfg.conv_kernel - 1), per = model_recurrent_floats(&m->cfg);
    const cuda_ptr p = q->dev_state[dev] + model_state_off(m, il) * sizeof(float);
    return cuda_state_copy(dev, p, st->conv_state, conv * sizeof(float), up) ||
           cuda_state_copy(dev, p + conv * sizeof(float), st->ssm_state, (per - conv) * sizeof(float), up) ? -1 : 0;
}

/* Makes the CPU's copy of layer IL's state of Q current. 0, or -1 where the device that held
 * the current one failed. */
static int model_state_to_host(const struct model *m, struct model_seq *q, int il)
{
    struct model_layer_state *st = &q->state[il];
    if (!st->host_stale) return 0;
    if (model_state_copy(m, q, il, st->on_dev - 1, 0)) return -1;
    st->host_stale = 0;
    return 0;
}

/* Makes device DEV's copy of layer IL's state of Q (its room there taken) current; the CPU's is
 * then stale, as the device is about to compute it. 0, or -1 where a device failed. */
static int model_state_to_device(const struct model *m, struct model_seq *q, int il, int dev)
{
    struct model_layer_state *st = &q->state[il];
    if (st->on_dev != dev + 1 && (model_state_to_host(m, q, il) || model_state_copy(m, q, il, dev, 1))) return -1;
    st->on_dev = dev + 1;
    st->host_stale = 1;
    return 0;
}

/* Bytes of a sequence's KV caches on a device (every attention layer's, as the CPU's), and
 * layer IL's place in them. */
static size_t model_kv_dev_bytes(const struct model *m) { return (size_t)model_kv_bytes_per_token(m) * (size_t)model_kv_rows(m); }
static uint64_t model_kv_off(const struct model *m, int il)
{
    uint64_t n = 0;
    for (int i = 0; i < il; i++) n += m->layers[i].kind == MODEL_LAYER_ATTENTION;
    return n * 2 * (uint64_t)m->cfg.n_kv_head * (uint64_t)model_kv_rows(m) * model_kv_row_bytes(m);
}

/* Copies KV rows [R0, R1) of attention layer IL of Q between the CPU and device DEV (UP: there),
 * a run a head, keys and values. */
static int model_kv_copy_rows(const struct model *m, struct model_seq *q, int il, int dev, int r0, int r1, int up)
{
    const size_t row = model_kv_row_bytes(m), head = (size_t)model_kv_rows(m) * row, n_kv = (size_t)m->cfg.n_kv_head;
    const cuda_ptr base = q->dev_kv[dev] + model_kv_off(m, il);
    uint8_t *cache[2] = {q->state[il].k_cache, q->state[il].v_cache};
    for (size_t c = 0; c < 2 && r1 > r0; c++)
        for (size_t h = 0; h < n_kv; h++)
            if (cuda_state_copy(dev, base + (c * n_kv + h) * head + (size_t)r0 * row, (float *)(void *)(cache[c] + h * head + (size_t)r0 * row),
                                (size_t)(r1 - r0) * row, up))
                return -1;
    return 0;
}

/* Makes the CPU's KV rows of attention layer IL of Q current up to row POS (those a device
 * holds newer come down). 0, or -1 where that device failed. */
static int model_kv_to_host(const struct model *m, struct model_seq *q, int il, int pos)
{
    struct model_layer_state *st = &q->state[il];
    const int upto = st->dev_rows < pos ? st->dev_rows : pos;
    if (st->on_dev && st->host_rows < upto && model_kv_copy_rows(m, q, il, st->on_dev - 1, st->host_rows, upto, 0)) return -1;
    if (st->host_rows < pos) st->host_rows = pos;
    return 0;
}

/* Makes device DEV's KV rows of attention layer IL of Q current up to row POS. */
static int model_kv_to_device(const struct model *m, struct model_seq *q, int il, int dev, int pos)
{
    struct model_layer_state *st = &q->state[il];
    if (st->on_dev != dev + 1) {
        if (model_kv_to_host(m, q, il, pos)) return -1;
        st->on_dev = dev + 1, st->dev_rows = 0;
    }
    if (st->dev_rows < pos && (model_kv_to_host(m, q, il, pos) || model_kv_copy_rows(m, q, il, dev, st->dev_rows, pos, 1))) return -1;
    if (st->dev_rows < pos) st->dev_rows = pos;
    return 0;
}

/* Makes the CPU's copy of everything in Q current (a conversation parked in RAM). 0, or -1
 * where a device that held some of it failed. */
static int model_seq_to_host(const struct model *m, struct model_seq *q)
{
    for (int i = 0; i < m->cfg.n_layers; i++)
        if (m->layers[i].kind == MODEL_LAYER_ATTENTION ? model_kv_to_host(m, q, i, q->pos) : model_state_to_host(m, q, i)) return -1;
    return 0;
}

/* Q's CPU copy was just written (reset, or a checkpoint restored, Q's position set): the
 * devices' DeltaNet states are outdated, and every KV row from the position on. */
static void model_states_written(const struct model *m, struct model_seq *q)
{
    for (int i = 0; i < m->cfg.n_layers; i++) {
        struct model_layer_state *st = &q->state[i];
        if (m->layers[i].kind == MODEL_LAYER_DELTANET) st->on_dev = st->host_stale = 0;
        if (st->host_rows > q->pos) st->host_rows = q->pos;
        if (st->dev_rows > q->pos) st->dev_rows = q->pos;
    }
}

/* Whether Q's state was lost with a device that failed (only its copy was current). */
static int model_seq_lost(const struct model *m, const struct model_seq *q)
{
    for (int i = 0; i < m->cfg.n_layers && !cuda.ready; i++)
        if (q->state[i].host_stale || (q->state[i].on_dev && q->state[i].host_rows < q->pos && q->state[i].dev_rows > q->state[i].host_rows))
            return 1;
    return 0;
}

/* Forgets the conversation: position 0, zero state (the KV cache beyond pos is never read). */
static void model_seq_reset(const struct model *m, struct model_seq *q)
{
    const struct model_config *c = &m->cfg;
    for (int i = 0; i < c->n_layers; i++) {
        struct model_layer_state *st = &q->state[i];
        if (st->conv_state) {
            memset(st->conv_state, 0, (size_t)model_conv_dim(c) * (size_t)(c->conv_kernel - 1) * sizeof(float));
            memset(st->ssm_state, 0, (size_t)c->ssm_nv * (size_t)c->ssm_dv * (size_t)c->ssm_dk * sizeof(float));
        }
    }
    q->pos = 0;
    model_states_written(m, q);
}

static void model_seq_free(const struct model *m, struct model_seq *q)
{
    for (int dev = 0; dev < CUDA_MAX_DEVICES; dev++) {
        if (q->dev_state[dev]) cuda_state_free(dev, q->dev_state[dev], (size_t)model_recurrent_bytes(m));
        if (q->dev_kv[dev]) cuda_state_free(dev, q->dev_kv[dev], model_kv_dev_bytes(m));
    }
    for (int i = 0; q->state && i < m->cfg.n_layers; i++) {
        free(q->state[i].k_cache);
        free(q->state[i].v_cache);
        free(q->state[i].conv_state);
        free(q->state[i].ssm_state);
    }
    free(q->state);
    q->state = NULL;
}

/* The message for a fault on the mapping: the file shrank or the disk failed under it. A
 * signal handler may only write(2), so the line is made when the model is loaded. */
static char model_sigbus_line[1100];

static void model_on_sigbus(int sig)
{
    (void)sig;
    ssize_t r = write(2, model_sigbus_line, strlen(model_sigbus_line));
    (void)r;
    _exit(1);
}

/* The part of M's file that holds P (and P's offset in it), or -1. */
static int model_part_of(const struct model *m, const uint8_t *p, off_t *offset)
{
    for (int i = 0; i < m->file.n_parts; i++)
        if (p >= m->file.parts[i].data && p < m->file.parts[i].data + m->file.parts[i].size) {
            *offset = (off_t)(p - m->file.parts[i].data);
            return i;
        }
    return -1;
}

/* Identifies the model a heat file belongs to: the expert geometry and where the experts lie,
 * and the first 4 KiB of every router (trunk bytes, read on every token anyway). Two files
 * with the same routers route alike, so their heat is interchangeable. */
static uint64_t model_fingerprint(const struct model *m)
{
    const struct model_config *c = &m->cfg;
    int64_t geo[4] = {c->n_layers, c->n_expert, c->dim, c->expert_ff};
    uint64_t h = expert_fnv((const uint8_t *)geo, sizeof geo);
    for (int i = 0; i < c->n_layers; i++) {
        const struct model_layer *l = &m->layers[i];
        const struct expert_tensor *t[3] = {&l->gate_exps, &l->up_exps, &l->down_exps};
        for (int j = 0; j < 3; j++) {
            off_t offset = 0;
            int part = model_part_of(m, t[j]->m.data, &offset);
            uint64_t d[3] = {(uint64_t)t[j]->m.type, (uint64_t)(part > 0 ? part : 0), (uint64_t)offset}; /* type, part, offset */
            h = h * 31 + expert_fnv((const uint8_t *)d, sizeof d);
        }
        size_t n = l->router.row_bytes * (size_t)l->router.rows;
        h = h * 31 + expert_fnv(l->router.data, n < 4096 ? n : 4096);
    }
    return h;
}

/* Bytes of routed experts in the file. */
static uint64_t model_expert_bytes(const struct model *m)
{
    uint64_t n = 0;
    for (int i = 0; m->cfg.n_expert && i < m->cfg.n_layers; i++) {
        const struct model_layer *l = &m->layers[i];
        n += (uint64_t)(l->gate_exps.stride + l->up_exps.stride + l->down_exps.stride) * (uint64_t)m->cfg.n_expert;
    }
    return n;
}

/* (Re)opens the store of routed experts with CFG (a dense model has none); a cache is not
 * started until expert_start. */
static void model_store_experts(struct model *m, const struct expert_config *cfg)
{
    const struct model_config *c = &m->cfg;
    if (c->n_expert == 0) return;
    expert_close(m->experts);
    struct expert_tensor (*t)[3] = plat_alloc((size_t)c->n_layers * sizeof *t);
    for (int i = 0; i < c->n_layers; i++) {
        t[i][0] = m->layers[i].gate_exps;
        t[i][1] = m->layers[i].up_exps;
        t[i][2] = m->layers[i].down_exps;
    }
    m->experts = expert_open(&m->file, (const struct expert_tensor(*)[3])t, c->n_layers, c->n_expert, cfg);
    free(t);
}

/* Every dense trunk matrix the model has, with its placement component and layer, in layer
 * order; an allocated list ended by an item with m NULL. */
static struct place_item *model_trunk_items(struct model *m)
{
    struct place_item *it = plat_alloc((size_t)(m->cfg.n_layers * 18 + 2) * sizeof *it);
    int n = 0;
    it[n++] = (struct place_item){PLACE_LMHEAD, &m->lm_head, -1};
    for (int il = 0; il < m->cfg.n_layers; il++) {
        struct model_layer *l = &m->layers[il];
        const struct place_item per[] = {
            {PLACE_ATTNPROJ, &l->wq, il}, {PLACE_ATTNPROJ, &l->wk, il}, {PLACE_ATTNPROJ, &l->wv, il},
            {PLACE_ATTNPROJ, &l->wo, il}, {PLACE_DNPROJ, &l->wqkv, il}, {PLACE_DNPROJ, &l->wz, il},
            {PLACE_DNPROJ, &l->wbeta, il}, {PLACE_DNPROJ, &l->walpha, il}, {PLACE_DNPROJ, &l->wba, il},
            {PLACE_DNOUT, &l->wout, il}, {PLACE_ROUTER, &l->router, il}, {PLACE_ROUTER, &l->shexp_gate_inp, il},
            {PLACE_SHEXP, &l->shexp_gate, il}, {PLACE_SHEXP, &l->shexp_up, il}, {PLACE_SHEXP, &l->shexp_down, il},
            {PLACE_FFN, &l->ffn_gate, il}, {PLACE_FFN, &l->ffn_up, il}, {PLACE_FFN, &l->ffn_down, il}};
        for (size_t k = 0; k < sizeof per / sizeof *per; k++)
            if (per[k].m->data && per[k].m->rows) it[n++] = per[k];
    }
    it[n] = (struct place_item){PLACE_COUNT, NULL, -1};
    return it;
}

/* Bytes a decoded token reads from the weights: every dense trunk matrix (*TRUNK of them) and,
 * in each MoE layer, n_expert_used routed experts of the layer's size (the embedding's one row
 * left out). */
static double model_decode_bytes(struct model *m, double *trunk)
{
    struct place_item *it = model_trunk_items(m);
    *trunk = 0;
    for (int i = 0; it[i].m; i++) *trunk += (double)it[i].m->rows * (double)it[i].m->row_bytes;
    free(it);
    return *trunk + (m->cfg.n_expert ? (double)model_expert_bytes(m) * m->cfg.n_expert_used / m->cfg.n_expert : 0);
}

/* Copies the dense trunk matrices that stay on the CPU (none resident on a device) out of the
 * mapping into one anonymous arena and computes from there; the process lets go of the file's
 * pages (the page cache keeps them for the next start, and gives them up first when memory is
 * short). Why: on this machine a 515 MiB Q8_0 lm_head streams at 22.4 GB/s from anonymous
 * memory but 17 GB/s in place from the page cache; the 35B's 10-layer slice decodes 11.7 ->
 * 14.7 tok/s, the 35B 3.8-4.3 -> 4.5-4.6. The routed experts are §6's (expert_own copies
 * them where memory allows: model_copies). A matrix with an interleaved form (§3
 * quant_interleave: Q4_K, Q5_K, Q6_K, Q2_K, Q3_K and IQ4_XS at AVX-512, IQ3_XXS and IQ3_S at
 * avx512vbmi) is copied into it interleaved. */
static void model_own_trunk(struct model *m)
{
    struct place_item *it = model_trunk_items(m);
    size_t total = 0;
    for (int i = 0; it[i].m; i++)
        if (!cuda_resident_of(it[i].m->data)) total += ((size_t)it[i].m->rows * it[i].m->row_bytes + 63) & ~(size_t)63;
    uint8_t *arena = plat_weight_arena(total), *dst = arena;
    if (!arena) { /* nothing to copy, or no memory for it: compute in place */
        free(it);
        return;
    }
    plat_prefault_parallel(arena, total);
    plat_progress_begin("copying the trunk", total);
    for (int i = 0; it[i].m; i++) {
        struct ops_matrix *w = it[i].m;
        size_t bytes = (size_t)w->rows * w->row_bytes;
        if (cuda_resident_of(w->data)) continue;
        if (quant_interleave_ok(w->type, w->rows)) {
            quant_interleave(w->type, dst, w->data, w->row_bytes, w->rows);
            plat_progress_add(bytes);
            w->interleaved = 1;
        } else {
            plat_copy_weights(dst, w->data, bytes);
        }
        if (w->data != m->embed->data) plat_unmap_range(w->data, bytes);
        w->data = dst;
        dst += (bytes + 63) & ~(size_t)63;
    }
    plat_progress_end();
    m->trunk = arena;
    m->trunk_bytes = total;
    free(it);
}

/* The RAM the routed experts may take, and how it was reckoned. */
struct model_budget { int64_t budget, avail, trunk, kv, state, reserve, margin; };

/* RAM bytes, or (RAM < 0) what memory leaves after the trunk (all of it: §7 gives back what
 * it places), the KV cache at full context and the recurrent state of N_SEQS sequences,
 * RESERVE bytes (the server's prompt cache), less a margin of 1/16 plus 256 MiB (scratch,
 * thread stacks, the allocator). */
static struct model_budget model_expert_budget(const struct model *m, int n_seqs, int64_t reserve, int64_t ram)
{
    uint64_t trunk = m->file.tensor_bytes - model_expert_bytes(m);
    if (m->lm_head.data != m->embed->data) trunk -= m->embed->bytes; /* only the prompt's rows are ever read */
    struct model_budget b = {ram, plat_mem_available(), (int64_t)trunk, model_kv_bytes_per_token(m) * m->n_ctx * n_seqs,
                             model_recurrent_bytes(m) * n_seqs, reserve, 0};
    b.margin = b.avail / 16 + (256 << 20);
    if (ram < 0) b.budget = b.avail - b.trunk - b.kv - b.state - reserve - b.margin;
    return b;
}

/* The context to use: the request, else the model's length capped so that the KV cache
 * takes at most half of the memory still available, or an eighth when the weights and that
 * KV cache do not fit together (the rest is the expert cache's, §6); but where the weights
 * fit with room for MODEL_MIN_CTX tokens beside them, no more than that room, so that every
 * routed expert stays in memory rather than a context mostly unused pushing some of them to
 * the disk (the 35B-A3B geometry on a 24 GB machine: an eighth, 75k tokens, left 3% of them
 * out, and `coli run -p Hello` read 9 GiB from the disk at 1 tok/s). */
#define MODEL_MIN_CTX 4096

static int model_choose_ctx(const struct model *m, int request)
{
    if (request > 0) return request < m->cfg.ctx_train ? request : m->cfg.ctx_train;
    int64_t per = model_kv_bytes_per_token(m), avail = plat_mem_available();
    int64_t ctx = m->cfg.ctx_train, need = (int64_t)m->file.tensor_bytes + per * ctx, share = avail > 0 && need > avail ? 8 : 2;
    if (per > 0 && avail > 0 && ctx > avail / share / per) ctx = avail / share / per;
    if (per > 0 && avail > 0 && share == 8) {
        const struct model_budget b = model_expert_budget(m, 1, 0, -1);
        const int64_t room = b.budget + b.kv - (int64_t)model_expert_bytes(m) - (128 << 20); /* b.kv: whatever m->n_ctx is now */
        if (room / per >= MODEL_MIN_CTX && room / per < ctx) ctx = room / per;
    }
    return ctx < 256 ? 256 : (int)ctx;
}

/* Every DeltaNet layer's conv weights tap-major: conv[ch][j] to conv_taps[j][ch]. */
static void model_conv_taps(struct model *m)
{
    const int64_t n = model_conv_dim(&m->cfg);
    const int K = m->cfg.conv_kernel;
    for (int i = 0; i < m->cfg.n_layers; i++) {
        struct model_layer *l = &m->layers[i];
        if (l->kind != MODEL_LAYER_DELTANET) continue;
        l->conv_taps = plat_alloc((size_t)n * (size_t)K * sizeof(float));
        for (int64_t ch = 0; ch < n; ch++)
            for (int j = 0; j < K; j++) l->conv_taps[j * n + ch] = l->conv[ch * K + j];
    }
}

/* Opens PATH, reads the configuration, binds the weights, allocates state for N_CTX tokens
 * (0: choose) with the KV cache in format KV. Routed experts are read in place from the
 * mapping until model_place_weights. */
static void model_load(struct model *m, const char *path, int n_ctx, enum ops_kv kv)
{
    memset(m, 0, sizeof *m);
    m->kv = kv;
    gguf_open(&m->file, path);
    model_read_config(&m->cfg, &m->file);
    model_check_kv(m);
    model_bind(m);
    model_conv_taps(m);
    m->n_ctx = model_choose_ctx(m, n_ctx);
    model_alloc_scratch(m);
    struct expert_config mapped = {-1, NULL, 0, EXPERT_IO_DIRECT, 0};
    model_store_experts(m, &mapped); /* mapped: nothing to start */
    snprintf(model_sigbus_line, sizeof model_sigbus_line,
             "coli: %.1000s: the model file became unreadable while running (truncated, or an I/O error)\n", path);
    struct sigaction sa = {.sa_handler = model_on_sigbus};
    sigaction(SIGBUS, &sa, NULL);
}

static void model_free(struct model *m)
{
    struct model_scratch *s = &m->s;
    float *bufs[] = {s->x, s->xn, s->out, s->qg, s->k, s->v, s->attn, s->scores, s->rope, s->mixed, s->z,
                     s->beta, s->alpha, s->ba, s->core, s->router, s->top_w, s->ex_in, s->ex_g, s->ex_u,
                     s->ex_out, s->sh_h, s->sh_out, s->sh_gate, s->logits, s->dev_out, s->ex_y};
    void *ints[] = {s->top, s->slot_of, s->want, s->want_count, s->ex_dev, s->ex_table, s->dev_jobs, s->dev_slot, s->tok_seq, s->tok_pos,
                    s->chain, s->dn, s->attn_dev};
    for (int i = 0; i < CUDA_MAX_DEVICES; i++) free(s->chain_stage[i]);
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    free(s->splits.buf);
    for (size_t i = 0; i < sizeof ints / sizeof *ints; i++) free(ints[i]);
    expert_close(m->experts);
    for (int i = 0; m->layers && i < m->cfg.n_layers; i++) free(m->layers[i].conv_taps);
    free(m->layers);
    if (m->trunk) munmap(m->trunk, m->trunk_bytes);
    gguf_close(&m->file);
}

/* cos then sin of pos * base^(-2j/rot) for j < rot/2 (§4.3; mRoPE reduces to this for text, §4.4). */
static void model_rope_table(const struct model_config *c, int pos, float *cos_sin)
{
    const int half = c->rope_dims / 2;
    const double ln_base = ops_ln(c->rope_base);
    for (int j = 0; j < half; j++) {
        double sine, cosine;
        ops_sincos(pos * ops_exp_double(-2.0 * j / c->rope_dims * ln_base), &sine, &cosine);
        cos_sin[j] = (float)cosine;
        cos_sin[half + j] = (float)sine;
    }
}

static void model_phase_mark(struct model *m, enum model_phase phase)
{
    double now = plat_now();
    m->profile.seconds[m->profile.decode][phase] += now - m->profile.mark;
    m->profile.mark = now;
}

/* Row POS of KV head H in CACHE (KEYS: the key cache): the floats at SRC in format m->kv. */
static void model_kv_store(const struct model *m, void *cache, int h, int pos, const float *src, int keys)
{
    const size_t hd = (size_t)m->cfg.head_dim;
    ops_kv_store((uint8_t *)cache + (size_t)h * (size_t)model_kv_rows(m) * model_kv_row_bytes(m), hd, pos, src, (int)hd, m->kv, keys);
}

/* KV head KVH's rows in layer state ST's key cache (KEYS) or value cache. */
static const uint8_t *model_kv_head(const struct model *m, const struct model_layer_state *st, int kvh, int keys)
{
    return (const uint8_t *)(keys ? st->k_cache : st->v_cache) + (size_t)kvh * (size_t)model_kv_rows(m) * model_kv_row_bytes(m);
}

/* Attention where a batch has fewer head groups than threads (decode, mostly): each split of
 * each group of SHARE heads of each token a task (ops_attention_scores, ops_attention_values:
 * the group's heads read its rows once), their records in s->splits, then each head's splits
 * merged in order and gated, a head a task: ops_attention's bits. 0 (nothing done) where no
 * context spans two splits, or the records would pass MODEL_SPREAD_BYTES (a long prompt). */
#define MODEL_SPREAD_BYTES ((size_t)64 << 20)

static int model_attention_spread(struct model *m, int il, int T, int share, float scale)
{
    struct model_scratch *s = &m->s;
    const int hd = m->cfg.head_dim, nh = m->cfg.n_head, groups = nh / share, group = nh / m->cfg.n_kv_head;
    const size_t rec = (size_t)hd + OPS_ATTN_SPLIT; /* a split's output, then its scores */
    int first[MODEL_BATCH + 1] = {0};               /* token t's splits: first[t] .. first[t + 1] - 1 */
    for (int t = 0; t < T; t++) first[t + 1] = first[t] + (s->tok_pos[t] + OPS_ATTN_SPLIT) / OPS_ATTN_SPLIT;
    const size_t n = (size_t)first[T] * (size_t)nh, acts = m->kv == OPS_KV_Q8_0 ? (size_t)T * nh * OPS_KV_Q8_ACT : 0;
    const size_t bytes = acts + n * (sizeof(double) + sizeof(float) + rec * sizeof(float));
    if (first[T] == T || bytes > MODEL_SPREAD_BYTES) return 0;
    uint8_t (*act)[OPS_KV_Q8_ACT] = ops_scratch(&s->splits, bytes); /* a Q8_0 cache's queries, quantised once: [T][nh] */
    double *sum = (double *)((uint8_t *)act + acts);
    float *max = (float *)(sum + n), *rows = max + n;
    #pragma omp parallel for schedule(static)
    for (int k = 0; k < (acts ? T * nh : 0); k++) quant_act_q8(s->qg + (size_t)k * 2 * hd, hd, act[k]);
    #pragma omp parallel for schedule(static)
    for (int k = 0; k < first[T] * groups; k++) {
        const int split = k / groups, h0 = k % groups * share;
        int t = 0;
        while (first[t + 1] <= split) t++;
        const int p0 = (split - first[t]) * OPS_ATTN_SPLIT, left = s->tok_pos[t] + 1 - p0;
        const struct model_layer_state *st = &s->tok_seq[t]->state[il];
        const float *q[OPS_ATTN_HEADS];
        float *w[OPS_ATTN_HEADS], *oc[OPS_ATTN_HEADS];
        struct quant_q8_view qa[OPS_ATTN_HEADS];
        for (int j = 0; j < share; j++) {
            q[j] = s->qg + ((size_t)t * nh + h0 + j) * 2 * hd;
            if (acts) qa[j] = quant_q8_view(act[(size_t)t * nh + h0 + j], hd);
            oc[j] = rows + ((size_t)split * nh + h0 + j) * rec;
            w[j] = oc[j] + hd;
        }
        const size_t at = (size_t)split * nh + h0, row = model_kv_row_bytes(m);
        const int len = left < OPS_ATTN_SPLIT ? left : OPS_ATTN_SPLIT;
        ops_attention_scores(q, qa, share, model_kv_head(m, st, h0 / group, 1) + (size_t)p0 * row, len, hd, scale, w, m->kv);
        ops_attention_values(w, share, model_kv_head(m, st, h0 / group, 0), p0, len, hd, oc, max + at, sum + at, m->kv);
    }
    #pragma omp parallel for schedule(static)
    for (int k = 0; k < T * nh; k++) {
        const int t = k / nh, h = k % nh;
        const size_t at = (size_t)first[t] * nh + h;
        float *o = s->attn + (size_t)k * hd, top = max[at];
        double total = sum[at];
        memcpy(o, rows + at * rec, (size_t)hd * sizeof(float));
        for (size_t c = at + nh; c < (size_t)first[t + 1] * nh; c += nh) {
            float *oc = rows + c * rec;
            ops_attn_merge(&o, &top, &total, &oc, &max[c], &sum[c], 1, hd);
        }
        ops_gate(o, s->qg + (size_t)k * 2 * hd + hd, o, hd, 1);
    }
    return 1;
}

/* Layer IL's mixer input projections over xn for T tokens into JOBS (attention: q with its
 * gate, k, v; DeltaNet: qkv, z, and beta and alpha, fused in qwen3next); returns how many. */
static int model_mixer_jobs(struct model *m, int il, int T, struct ops_job *jobs)
{
    const struct model_layer *l = &m->layers[il];
    struct model_scratch *s = &m->s;
    if (l->kind == MODEL_LAYER_ATTENTION) {
        jobs[0] = (struct ops_job){l->wq, s->xn, s->qg, T};
        jobs[1] = (struct ops_job){l->wk, s->xn, s->k, T};
        jobs[2] = (struct ops_job){l->wv, s->xn, s->v, T};
        return 3;
    }
    jobs[0] = (struct ops_job){l->wqkv, s->xn, s->mixed, T};
    jobs[1] = (struct ops_job){l->wz, s->xn, s->z, T};
    if (m->cfg.arch == MODEL_ARCH_QWEN3NEXT) {
        jobs[2] = (struct ops_job){l->wba, s->xn, s->ba, T};
        return 3;
    }
    jobs[2] = (struct ops_job){l->wbeta, s->xn, s->beta, T};
    jobs[3] = (struct ops_job){l->walpha, s->xn, s->alpha, T};
    return 4;
}

/* Gated attention (§4) for the T tokens of a batch, each at its position in its sequence's
 * KV cache (tok_seq, tok_pos), from its projections (qg, k, v: model_mixer_jobs); returns the
 * rows its output projection takes (attn). */
static const float *model_attention(struct model *m, int il, int T)
{
    const struct model_config *c = &m->cfg;
    const struct model_layer *l = &m->layers[il];
    struct model_scratch *s = &m->s;
    int hd = c->head_dim, nh = c->n_head, kvw = c->n_kv_head * hd, group = nh / c->n_kv_head;
    float scale = 1.0f / sqrtf((float)hd);

    /* per-head q/k RMSNorm, then partial RoPE; K and V go to the cache (a token a task: its
     * own rows, and its own position in its sequence's cache) */
    #pragma omp parallel for schedule(static) if (T >= 8)
    for (int t = 0; t < T; t++) {
        float *cs = s->rope + (size_t)t * c->rope_dims;
        struct model_layer_state *st = &s->tok_seq[t]->state[il];
        model_rope_table(c, s->tok_pos[t], cs);
        for (int h = 0; h < nh; h++) {
            float *q = s->qg + ((size_t)t * nh + h) * 2 * hd;
            ops_rmsnorm(q, q, l->q_norm, hd, c->eps);
            ops_rope_neox(q, c->rope_dims, cs);
        }
        for (int h = 0; h < c->n_kv_head; h++) {
            float *k = s->k + (size_t)t * kvw + (size_t)h * hd;
            ops_rmsnorm(k, k, l->k_norm, hd, c->eps);
            ops_rope_neox(k, c->rope_dims, cs);
            model_kv_store(m, st->k_cache, h, s->tok_pos[t], k, 1);
            model_kv_store(m, st->v_cache, h, s->tok_pos[t], s->v + (size_t)t * kvw + (size_t)h * hd, 0);
        }
    }

    /* causal softmax attention (GQA: head h reads KV head h / group), then the sigmoid output
     * gate. A task is a run of SHARE heads of one group over every token of the batch: they
     * read each cached row once between them. Where there are fewer such tasks than threads,
     * each split of a group is a task of its own (model_attention_spread: decode, or a batch
     * whose records stay small); else, or where no context spans two splits, SHARE halves while
     * there are fewer tasks than threads. The bits depend on neither. */
    int share = group < OPS_ATTN_HEADS ? group : OPS_ATTN_HEADS;
    if (nh / share < plat_threads() && model_attention_spread(m, il, T, share, scale)) {
        model_phase_mark(m, MODEL_PHASE_ATTENTION);
        return s->attn;
    }
    while (share > 1 && (nh / share < plat_threads() || group % share)) share /= 2;
    #pragma omp parallel for schedule(static)
    for (int h0 = 0; h0 < nh; h0 += share) {
        const float *q[OPS_ATTN_HEADS];
        float *sc[OPS_ATTN_HEADS], *o[OPS_ATTN_HEADS];
        for (int t = 0; t < T; t++) {
            const struct model_layer_state *st = &s->tok_seq[t]->state[il];
            for (int j = 0; j < share; j++) {
                q[j] = s->qg + ((size_t)t * nh + h0 + j) * 2 * hd;
                sc[j] = s->scores + (size_t)(h0 + j) * model_scores_floats(m);
                o[j] = s->attn + ((size_t)t * nh + h0 + j) * hd;
            }
            ops_attention(q, share, model_kv_head(m, st, h0 / group, 1), model_kv_head(m, st, h0 / group, 0), s->tok_pos[t] + 1, hd, scale,
                          sc, o, m->kv);
            for (int j = 0; j < share; j++) ops_gate(o[j], q[j] + hd, o[j], hd, 1);
        }
    }
    model_phase_mark(m, MODEL_PHASE_ATTENTION);
    return s->attn;
}

/* Depthwise causal conv over channels C0..C1 (at most MODEL_CONV_BLOCK) of one token, in place
 * (§5.3): each channel's sum from 0 over its taps, oldest first, then its input. The state
 * keeps the last conv_kernel-1 raw inputs; state and taps are tap-major, so each loop runs
 * across channels in vector lanes (omp simd: gcc -O2 left these loops scalar) and each
 * channel's sum keeps its order. */
#define MODEL_CONV_BLOCK 256

static void model_conv_step(const struct model_config *c, const float *taps, float *state, float *x, int64_t c0, int64_t c1)
{
    const int K = c->conv_kernel, w = (int)(c1 - c0);
    const int64_t n = model_conv_dim(c);
    float sum[MODEL_CONV_BLOCK];
    taps += c0, state += c0, x += c0;
    #pragma omp simd
    for (int i = 0; i < w; i++) sum[i] = 0.0f;
    for (int j = 0; j < K - 1; j++) {
        #pragma omp simd
        for (int i = 0; i < w; i++) sum[i] += taps[j * n + i] * state[j * n + i];
    }
    #pragma omp simd
    for (int i = 0; i < w; i++) sum[i] += taps[(K - 1) * n + i] * x[i];
    for (int j = 0; j + 1 < K - 1; j++) {
        #pragma omp simd
        for (int i = 0; i < w; i++) state[j * n + i] = state[(j + 1) * n + i];
    }
    if (K > 1) {
        #pragma omp simd
        for (int i = 0; i < w; i++) state[(K - 2) * n + i] = x[i];
    }
    #pragma omp simd
    for (int i = 0; i < w; i++) x[i] = sum[i];
}

/* Channels C0..C1 of DeltaNet layer IL's conv input (mixed) for the T tokens of a batch, in
 * order (a sequence's tokens follow one another through its state), each token's channels
 * then through the SiLU, the L2 norm of each q and k head among them, and q's scale. C0..C1
 * holds whole heads, so a task needs no other's channels. */
static void model_conv_task(struct model *m, int il, int T, int64_t c0, int64_t c1)
{
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->s;
    const int64_t conv_dim = model_conv_dim(c), dk = c->ssm_dk, q_end = (int64_t)c->ssm_nk * dk;
    const float qscale = 1.0f / sqrtf((float)dk);
    for (int t = 0; t < T; t++) {
        float *x = s->mixed + (size_t)t * conv_dim;
        for (int64_t b = c0; b < c1; b += MODEL_CONV_BLOCK)
            model_conv_step(c, m->layers[il].conv_taps, s->tok_seq[t]->state[il].conv_state, x, b, c1 - b < MODEL_CONV_BLOCK ? c1 : b + MODEL_CONV_BLOCK);
        ops_swiglu(x + c0, NULL, c1 - c0);
        for (int64_t h = c0; h < c1 && h < 2 * q_end; h += dk) ops_l2norm(x + h, (int)dk, c->eps); /* q's heads, then k's */
        for (int64_t i = c0; i < c1 && i < q_end; i++) x[i] *= qscale;
    }
}

/* qwen3next's fused beta and alpha logits (ba), stored per k-head group as [b x r | a x r]
 * (§5.2), into beta and alpha per v-head in natural order (qwen35* projects them apart). */
static void model_split_ba(struct model *m, int T)
{
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->s;
    int nv = c->ssm_nv, r = nv / c->ssm_nk;
    for (int t = 0; t < T; t++)
        for (int g = 0; g < c->ssm_nk; g++)
            for (int j = 0; j < r; j++) {
                s->beta[(size_t)t * nv + g * r + j] = s->ba[(size_t)t * 2 * nv + g * 2 * r + j];
                s->alpha[(size_t)t * nv + g * r + j] = s->ba[(size_t)t * 2 * nv + g * 2 * r + r + j];
            }
}

/* Gated DeltaNet (§5) for the T tokens of a batch, one after another through their sequences'
 * recurrent states, from its projections (mixed, z, beta and alpha or ba: model_mixer_jobs);
 * returns the rows its output projection takes (core). */
static const float *model_gated_deltanet(struct model *m, int il, int T)
{
    const struct model_config *c = &m->cfg;
    const struct model_layer *l = &m->layers[il];
    struct model_scratch *s = &m->s;
    int nk = c->ssm_nk, nv = c->ssm_nv, dk = c->ssm_dk, dv = c->ssm_dv, r = nv / nk;
    int64_t conv_dim = model_conv_dim(c), vdim = (int64_t)nv * dv;

    if (c->arch == MODEL_ARCH_QWEN3NEXT) model_split_ba(m, T);

    /* The conv, SiLU, norms and scale in tasks of whole heads across threads, round robin so
     * that each thread has q/k heads (normed) and v channels (not). One thread, a token at a
     * time, had the conv at a quarter of the DeltaNet phase. */
    const int64_t task = c->ssm_dk * (MODEL_CONV_BLOCK > c->ssm_dk ? MODEL_CONV_BLOCK / c->ssm_dk : 1);
    #pragma omp parallel for schedule(static, 1)
    for (int64_t c0 = 0; c0 < conv_dim; c0 += task) model_conv_task(m, il, T, c0, conv_dim - c0 < task ? conv_dim : c0 + task);
    /* Head by head, each over the batch's tokens in order: a head's state (dk x dv floats, 64 KiB
     * on the 35B) stays in this thread's cache for the whole batch, and a batch pays one
     * parallel region instead of one a token. Each (token, head) does what it did alone. */
    #pragma omp parallel for schedule(static)
    for (int h = 0; h < nv; h++) {
        int g = c->vhead_tiled ? h % nk : h / r;
        for (int t = 0; t < T; t++) {
            const float *x = s->mixed + (size_t)t * conv_dim;
            float *o = s->core + (size_t)t * vdim + (size_t)h * dv, *z = s->z + (size_t)t * vdim + (size_t)h * dv;
            float beta = ops_sigmoid(s->beta[(size_t)t * nv + h]);
            float decay = ops_exp(ops_softplus(s->alpha[(size_t)t * nv + h] + l->dt_bias[h]) * l->ssm_a[h]);
            ops_delta_rule(s->tok_seq[t]->state[il].ssm_state + (size_t)h * dv * dk, dk, dv, x + (size_t)g * dk,
                           x + (size_t)(nk + g) * dk, x + 2 * (size_t)nk * dk + (size_t)h * dv, beta, decay, o);
            /* gated RMSNorm: norm(o) * w * silu(z) */
            ops_rmsnorm(o, o, l->ssm_norm + (l->ssm_norm_per_head ? (size_t)h * dv : 0), dv, c->eps);
            ops_swiglu(z, NULL, dv);
            for (int i = 0; i < dv; i++) o[i] *= z[i];
        }
    }
    model_phase_mark(m, MODEL_PHASE_DELTANET);
    return s->core;
}

/* SwiGLU feed-forward over N rows: down(silu(gate x) * up x). in [n][cols of gate],
 * out [n][rows of down]; uses ex_g and ex_u. */
static void model_swiglu(struct model *m, const struct ops_matrix *gate, const struct ops_matrix *up,
                         const struct ops_matrix *down, const float *in, float *out, int n)
{
    struct model_scratch *s = &m->s;
    const struct ops_job gate_up[] = {{*gate, in, s->ex_g, n}, {*up, in, s->ex_u, n}};
    ops_matmat_jobs(gate_up, 2);
    ops_swiglu_rows(s->ex_g, s->ex_u, n, down->cols);
    ops_matmat(down, s->ex_g, out, n);
}

/* Routing (§6) from the router logits in s->router: softmax over all experts, the
 * n_expert_used best (ties: lower id first), weights renormalised over the chosen ones. */
static void model_select_experts(struct model *m, int T)
{
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->s;
    int used = c->n_expert_used;
    #pragma omp parallel for schedule(static) if (T >= 8)
    for (int t = 0; t < T; t++) {
        float *p = s->router + (size_t)t * c->n_expert;
        int *top = s->top + (size_t)t * used;
        float *w = s->top_w + (size_t)t * used;
        double sum = 0.0; /* as the reference: the weights' sum in double, the division in float */
        ops_softmax(p, c->n_expert, NULL);
        for (int k = 0; k < used; k++) {
            int best = -1;
            for (int e = 0; e < c->n_expert; e++) {
                int taken = 0;
                for (int j = 0; j < k; j++) taken |= top[j] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            top[k] = best;
            w[k] = p[best];
            sum += p[best];
        }
        for (int k = 0; k < used; k++) w[k] /= (float)sum;
    }
}

/* Router: layer L's logits of xn, then model_select_experts. */
static void model_route(struct model *m, const struct model_layer *l, int T)
{
    ops_matmat(&l->router, m->s.xn, m->s.router, T);
    model_select_experts(m, T);
}

/* Tells the store which experts layer IL routed its T tokens to (s->top), so that it reads
 * the missing ones while the shared expert runs. */
static void model_want_experts(struct model *m, int il, int T)
{
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->s;
    int n_assign = T * c->n_expert_used, n_want = 0;
    memset(s->want_count, 0, (size_t)c->n_expert * sizeof *s->want_count);
    for (int a = 0; a < n_assign; a++) s->want_count[s->top[a]]++;
    for (int e = 0; e < c->n_expert; e++)
        if (s->want_count[e]) s->want[n_want++] = e;
    expert_begin(m->experts, il, s->want, s->want_count, n_want, T);
}

/* Lists the assignments (of T tokens) routed to expert E in slot_of from row FIRST on;
 * returns how many. model_gather_rows then copies their tokens. */
static int model_gather_tokens(struct model *m, int e, int T, int first)
{
    struct model_scratch *s = &m->s;
    int used = m->cfg.n_expert_used, rows = first;
    for (int a = 0; a < T * used; a++)
        if (s->top[a] == e) s->slot_of[rows++] = a;
    return rows - first;
}

/* Rows [first, first + n) of ex_in: the tokens of those assignments (slot_of), copied in
 * parallel (a prompt batch's experts gather 4096 rows of 8 KiB on the 35B). */
static void model_gather_rows(struct model *m, int first, int n)
{
    struct model_scratch *s = &m->s;
    int used = m->cfg.n_expert_used;
    size_t dim = (size_t)m->cfg.dim;
    #pragma omp parallel for schedule(static) if (n >= 64)
    for (int r = first; r < first + n; r++) memcpy(s->ex_in + r * dim, s->xn + (size_t)(s->slot_of[r] / used) * dim, dim * sizeof(float));
}

/* Rows [0, n) of SRC (one per assignment listed in slot_of) into ex_out at their assignments. */
static void model_scatter_rows(struct model *m, const float *src, int n)
{
    struct model_scratch *s = &m->s;
    size_t dim = (size_t)m->cfg.dim;
    #pragma omp parallel for schedule(static) if (n >= 64)
    for (int r = 0; r < n; r++) memcpy(s->ex_out + (size_t)s->slot_of[r] * dim, src + r * dim, dim * sizeof(float));
}

/* The routed experts the CPU computes for T tokens when the store hands them out in place (a
 * pointer stays valid after the next expert_next): each expert's tokens are gathered into
 * ex_in, then up to OPS_MAX_JOBS / 2 experts at a time run as two batches of products, gates
 * and ups, then downs, so that a layer pays a few parallel regions rather than two per expert.
 * Each output is bit-identical to the expert's own ops_matmat; it lands in ex_out[assignment]. */
static void model_routed_experts_mapped(struct model *m, int T)
{
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->s;
    int ff = c->expert_ff, n = 0, rows = 0;
    size_t dim = (size_t)c->dim;
    struct ops_job up[OPS_MAX_JOBS], down[OPS_MAX_JOBS / 2];
    struct ops_matrix w[3];
    for (int e = 0; e >= 0;) {
        if ((e = expert_next(m->experts, w)) >= 0) {
            int first = rows, count = model_gather_tokens(m, e, T, first);
            /* an expert of one token reads that token's row in place: experts of the same token
             * then share one prepared activation (decode: one for the layer's gates and ups, not 8) */
            const float *x = count == 1 ? s->xn + (size_t)(s->slot_of[first] / c->n_expert_used) * dim : s->ex_in + first * dim;
            float *g = s->ex_g + (size_t)first * ff, *u = s->ex_u + (size_t)first * ff;
            up[2 * n] = (struct ops_job){w[0], x, g, count};
            up[2 * n + 1] = (struct ops_job){w[1], x, u, count};
            down[n++] = (struct ops_job){w[2], g, s->ex_y + first * dim, count};
            rows += count;
        }
        if (!n || (e >= 0 && n < OPS_MAX_JOBS / 2)) continue;
        if (rows > n) model_gather_rows(m, 0, rows); /* else every expert has one token, read in place */
        ops_matmat_jobs(up, 2 * n);
        ops_swiglu_rows(s->ex_g, s->ex_u, rows, ff);
        ops_matmat_jobs(down, n);
        model_scatter_rows(m, s->ex_y, rows);
        n = rows = 0;
    }
}

/* Routed experts for T tokens on the CPU (those expert_next hands out): each runs once over
 * the tokens that chose it, its output landing in ex_out[t * used + k]. The store hands the
 * experts out as their bytes arrive; each output has its own place, so that order does not
 * change the sums. */
static void model_routed_experts(struct model *m, int T)
{
    struct model_scratch *s = &m->s;
    struct ops_matrix w[3]; /* gate, up, down */
    if (m->experts->mapped) {
        model_routed_experts_mapped(m, T);
        return;
    }
    for (int e; (e = expert_next(m->experts, w)) >= 0;) {
        int n = model_gather_tokens(m, e, T, 0);
        model_gather_rows(m, 0, n);
        model_swiglu(m, &w[0], &w[1], &w[2], s->ex_in, s->ex_in, n);
        model_scatter_rows(m, s->ex_in, n);
    }
}

/* Layer IL's shared expert on device DEV: its three matrices' addresses there into *E and its
 * shape into *SH. 1, or 0 where one of them is not there (or gate and up differ in type). */
static int model_shexp_on(const struct model *m, int il, int dev, struct cuda_expert *e, struct cuda_moe_shape *sh)
{
    const struct model_layer *l = &m->layers[il];
    const struct ops_matrix *gm = &l->shexp_gate, *um = &l->shexp_up, *dm = &l->shexp_down;
    const struct cuda_resident *g = cuda_resident_of(gm->data), *u = cuda_resident_of(um->data), *d = cuda_resident_of(dm->data);
    if (!g || !u || !d || g->dev != dev || u->dev != dev || d->dev != dev || gm->type != um->type || gm->row_bytes != um->row_bytes) return 0;
    *e = (struct cuda_expert){g->ptr, u->ptr, d->ptr};
    *sh = (struct cuda_moe_shape){gm->type, dm->type, gm->row_bytes, dm->row_bytes, (int)gm->cols, (int)gm->rows};
    return 1;
}

/* The device whose expert batch also runs layer IL's shared expert, with its three matrices
 * there in *E: the one holding them, where they have the routed experts' shape (the batch's
 * activations and kernels then serve it too); -1 where none does, and the shared expert runs as
 * products. In the batch it costs no download and no launch of its own: 5 driver calls a layer
 * fewer, one wait fewer. */
static int model_shexp_device(const struct model *m, int il, struct cuda_expert *e)
{
    struct cuda_moe_shape sh, shs;
    if (!cuda.ready || !m->cfg.shexp_ff || !m->experts || !place_expert_shape(m->experts, il, &sh)) return -1;
    const struct cuda_resident *g = cuda_resident_of(m->layers[il].shexp_gate.data);
    if (!g || !model_shexp_on(m, il, g->dev, e, &shs) || !cuda_moe_shape_same(&sh, &shs) || !cuda_moe_supported(g->dev, &sh)) return -1;
    return g->dev;
}

/* Queues on each device the jobs (token, expert) of layer IL whose expert is resident there
 * (the store listed them in on_device), and on device SHD (-1: none) each token's shared
 * expert SH: they run while the CPU computes the other experts. */
static void model_experts_device_start(struct model *m, int il, int T, int shd, struct cuda_expert sh_e)
{
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->s;
    struct expert_store *x = m->experts;
    int used = c->n_expert_used, n = 0;
    memset(s->dev_count, 0, sizeof s->dev_count);
    if (!x->n_on_device && shd < 0) return;
    for (int e = 0; e < c->n_expert; e++) s->ex_dev[e] = -1;
    for (int k = 0; k < x->n_on_device; k++) s->ex_dev[x->on_device[k]] = x->vram[il * c->n_expert + x->on_device[k]].dev;
    struct cuda_moe_shape sh;
    place_expert_shape(x, il, &sh);
    size_t stride = ops_act_stride(&x->src[il][0].t.m);
    uint8_t *acts = ops_scratch(&ops_act_buf, stride * (size_t)T); /* cuda_moe_start copies it before returning */
    for (int t = 0; t < T; t++) quant_act_prepare(sh.up_type, s->xn + (size_t)t * c->dim, c->dim, acts + (size_t)t * stride);
    for (int d = 0; d < cuda.n_devices; d++) {
        s->dev_first[d] = n;
        for (int a = 0; a < T * used; a++)
            if (s->ex_dev[s->top[a]] == d) {
                s->dev_jobs[n] = (struct cuda_moe_job){x->vram[il * c->n_expert + s->top[a]].e, (uint32_t)(a / used), 0};
                s->dev_slot[n++] = a;
            }
        if (d == shd)
            for (int t = 0; t < T; t++) {
                s->dev_jobs[n] = (struct cuda_moe_job){sh_e, (uint32_t)t, 0};
                s->dev_slot[n++] = -1 - t;
            }
        s->dev_count[d] = n - s->dev_first[d];
        s->dev_failed[d] = s->dev_count[d] && cuda_moe_start(d, &sh, s->dev_jobs + s->dev_first[d], s->dev_count[d], acts, stride, T);
    }
}

/* Where job J's output goes: its assignment's ex_out row, or its token's sh_out row. */
static float *model_device_job_out(struct model_scratch *s, int j, size_t dim)
{
    int slot = s->dev_slot[j];
    return slot >= 0 ? s->ex_out + (size_t)slot * dim : s->sh_out + (size_t)(-1 - slot) * dim;
}

/* Collects the device jobs of layer IL into ex_out and sh_out; a device that failed (the GPU
 * path has ended, §5 said why) has its jobs computed here on the CPU from the mapping, the same
 * bits. */
static void model_experts_device_finish(struct model *m, int il)
{
    const struct model_config *c = &m->cfg;
    const struct model_layer *l = &m->layers[il];
    struct model_scratch *s = &m->s;
    size_t dim = (size_t)c->dim;
    for (int d = 0; d < cuda.n_devices; d++) {
        int first = s->dev_first[d], n = s->dev_count[d];
        if (!n) continue;
        if (!s->dev_failed[d] && cuda_moe_finish(d, s->dev_out + first * dim) == 0) {
            for (int j = first; j < first + n; j++) memcpy(model_device_job_out(s, j, dim), s->dev_out + j * dim, dim * sizeof(float));
            continue;
        }
        for (int j = first; j < first + n; j++) {
            if (s->dev_slot[j] < 0) {
                int t = -1 - s->dev_slot[j];
                model_swiglu(m, &l->shexp_gate, &l->shexp_up, &l->shexp_down, s->xn + (size_t)t * dim, model_device_job_out(s, j, dim), 1);
                continue;
            }
            int a = s->dev_slot[j], e = s->top[a];
            struct ops_matrix w[3];
            expert_fill_hole(m->experts, il * c->n_expert + e);
            for (int k = 0; k < 3; k++) w[k] = expert_mapped(&m->experts->src[il][k].t, e);
            model_swiglu(m, &w[0], &w[1], &w[2], s->xn + (size_t)(a / c->n_expert_used) * dim, s->ex_out + (size_t)a * dim, 1);
        }
    }
}

/* Whether trunk matrix W is on a device that has this layer's expert batch queued: a product there
 * would wait for the batch (its upload is on the same stream), and the CPU with it. */
static int model_behind_device_batch(const struct model *m, const struct ops_matrix *w)
{
    const struct cuda_resident *r = cuda.ready ? cuda_resident_of(w->data) : NULL;
    return r && m->s.dev_count[r->dev] > 0 && !m->s.dev_failed[r->dev];
}

/* The device that runs the rest of layer IL after its mixer (cuda_moe_layer_start) for T
 * tokens, with *L filled: the one that holds the output projection WO, the layer's router and
 * its shared expert's gate logit (of the router's type), its shared expert (model_shexp_on),
 * and those of its routed experts that any device holds (the CPU computes the others: a split
 * layer); -1 where none does. What follows, the norm NEXT_NORM and the products
 * NEXT[0..n_next) over it (the next layer's mixer projections, or the output head), goes with it
 * where those matrices are there too. */
static int model_rest_device(struct model *m, int il, int T, const struct ops_matrix *wo, const float *next_norm, const struct ops_job *next,
                             int n_next, struct cuda_moe_layer *L)
{
    const struct model_config *c = &m->cfg;
    const struct model_layer *l = &m->layers[il];
    struct expert_store *x = m->experts;
    struct cuda_expert sh_e = {0, 0, 0};
    struct cuda_moe_shape sh_shape = {0};
    if (!cuda.ready || !x) return -1;
    const struct cuda_resident *out = cuda_resident_of(wo->data), *router = cuda_resident_of(l->router.data);
    const struct cuda_resident *gate = c->shexp_ff ? cuda_resident_of(l->shexp_gate_inp.data) : NULL;
    const int dev = router ? router->dev : -1;
    if (dev < 0 || !out || out->dev != dev ||
        (c->shexp_ff && (!gate || gate->dev != dev || l->shexp_gate_inp.type != l->router.type || !model_shexp_on(m, il, dev, &sh_e, &sh_shape))))
        return -1;
    int split = 0;
    for (int e = 0; e < c->n_expert; e++) {
        const int32_t key = il * c->n_expert + e;
        if (expert_in_vram(x, key) && x->vram[key].dev != dev) return -1; /* on another device: the batches of model_ffn */
        split |= !expert_in_vram(x, key);
        m->s.ex_table[e] = expert_in_vram(x, key) ? x->vram[key].e : (struct cuda_expert){0, 0, 0};
    }
    *L = (struct cuda_moe_layer){.wo = wo, .router = &l->router, .gate_inp = gate ? &l->shexp_gate_inp : NULL, .wo_ptr = out->ptr,
                                 .router_ptr = router->ptr, .gate_inp_ptr = gate ? gate->ptr : 0, .norm = l->post_norm, .eps = c->eps,
                                 .table = m->s.ex_table, .shexp = sh_e, .shexp_sh = sh_shape, .n_expert = c->n_expert,
                                 .used = c->n_expert_used, .split = split};
    place_expert_shape(x, il, &L->sh);
    size_t floats = (size_t)T * (size_t)(c->dim + c->n_expert_used); /* what comes back must fit dev_out */
    for (int j = 0; j < n_next; j++) {
        const struct cuda_resident *r = cuda_resident_of(next[j].w.data);
        if (!r || r->dev != dev) break;
        L->next[j] = next[j].w;
        L->next_ptr[j] = r->ptr;
        floats += (size_t)T * (size_t)next[j].w.rows;
        L->n_next = j + 1;
    }
    if (L->n_next < n_next || floats > model_dev_out_rows(c) * (size_t)c->dim) L->n_next = 0;
    L->next_norm = L->n_next ? next_norm : NULL;
    if (!cuda_moe_layer_supported(dev, L, T)) L->n_next = 0; /* without the next layer's part, then */
    return cuda_moe_layer_supported(dev, L, T) ? dev : -1;
}

/* The end of the chain that ends with layer LAST on device DEV: its layers' ids down, and the
 * store told of each layer's experts in order, as each layer would have. 0, or -1 after a
 * failure (the GPU path has ended). */
static int model_chain_end(struct model *m, int last, int T, int dev)
{
    struct model_scratch *s = &m->s;
    const int first = s->chain_first;
    const size_t per = (size_t)T * (size_t)m->cfg.n_expert_used;
    int *ids = (int *)s->dev_out; /* read out already: room for every layer's ids */
    s->chain_first = -1;
    if (cuda_chain_ids(dev, s->chain[first].ids, ids, (size_t)(last - first + 1) * per * sizeof(int))) return -1;
    for (int il = first; il <= last; il++) {
        if (s->chain[il].split) continue; /* told at its routing */
        memcpy(s->top, ids + (size_t)(il - first) * per, per * sizeof(int));
        model_want_experts(m, il, T);
    }
    return 0;
}

/* The rest of layer IL for T tokens on device DEV (model_rest_device) from the mixer's rows
 * MIX: the new hidden state into x, the chosen experts into top (for the store's heat and
 * statistics, as the CPU's routing would tell it), the next layer's projections (L->n_next of
 * NEXT) into their outputs. A split layer's CPU experts run here while the device runs its
 * own. Returns 0; -1 where the device failed (the GPU path has ended, x is as it was: the
 * caller computes the layer); -2 where the store could not read an expert (m->error). */
static int model_rest_on_device(struct model *m, int il, int T, int dev, const struct cuda_moe_layer *L, const float *mix,
                                const struct ops_job *next)
{
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->s;
    const size_t stride = ops_act_stride(L->wo), dim = (size_t)c->dim, ids = (size_t)T * (size_t)c->n_expert_used;
    uint8_t *act = mix ? ops_scratch(&ops_act_buf, stride * (size_t)T) : NULL; /* copied before cuda_moe_layer_start returns */
    for (int t = 0; act && t < T; t++) quant_act_prepare(L->wo->type, mix + (size_t)t * L->wo->cols, L->wo->cols, act + (size_t)t * stride);
    if (cuda_moe_layer_start(dev, L, s->x, act, stride, T, s->dev_out)) return -1;
    if (L->split) { /* the routing came back: the CPU's experts of xn into ex_out, then up */
        memcpy(s->xn, s->dev_out, (size_t)T * dim * sizeof(float));
        memcpy(s->top, s->dev_out + (size_t)T * dim, ids * sizeof(int));
        model_want_experts(m, il, T);
        int cpu_jobs = 0;
        for (int k = 0; k < m->experts->n_want; k++) cpu_jobs += s->want_count[m->experts->want[k]];
        model_routed_experts(m, T);
        if (expert_recover(m->experts, m->error, sizeof m->error)) return -2;
        if (cuda_moe_layer_resume(dev, L, stride, s->ex_out, cpu_jobs, T)) return -1;
    }
    if (L->keep) return 0; /* the next layer takes it from here, on the device */
    if (cuda_moe_finish(dev, s->dev_out)) return -1;
    memcpy(s->top, s->dev_out, ids * sizeof(int));
    memcpy(s->x, s->dev_out + ids, (size_t)T * dim * sizeof(float));
    const float *y = s->dev_out + ids + (size_t)T * dim;
    for (int j = 0; j < L->n_next; y += (size_t)T * (size_t)next[j].w.rows, j++)
        memcpy(next[j].y, y, (size_t)T * (size_t)next[j].w.rows * sizeof(float));
    if (s->chain_first >= 0) return model_chain_end(m, il, T, dev);
    if (!L->split) model_want_experts(m, il, T);
    return 0;
}

/* Mixture of experts (§6): out = sum_k w_k E_k(xn) + sigmoid(g . xn) S(xn), summed in the
 * order of the chosen experts, best first. The experts resident on a device are queued there
 * first, with the shared expert where it can join them (model_shexp_device). Otherwise the
 * shared expert's down product runs while they run and while the store reads the routed experts
 * that are not in memory, unless it would wait for them on their device: then after the CPU's
 * experts. A dense SwiGLU for qwen35. */
static void model_ffn(struct model *m, int il, int T)
{
    const struct model_config *c = &m->cfg;
    const struct model_layer *l = &m->layers[il];
    struct model_scratch *s = &m->s;
    if (c->n_expert == 0) {
        model_swiglu(m, &l->ffn_gate, &l->ffn_up, &l->ffn_down, s->xn, s->out, T);
        model_phase_mark(m, MODEL_PHASE_PRODUCTS);
        return;
    }
    /* every product of xn at once: the router, the shared expert's gate logit, gate and up
     * (unless the shared expert runs in a device's expert batch) */
    struct cuda_expert sh_e = {0, 0, 0};
    int shd = model_shexp_device(m, il, &sh_e), shexp_apart = c->shexp_ff && shd < 0;
    const struct ops_job first[] = {{l->router, s->xn, s->router, T}, {l->shexp_gate_inp, s->xn, s->sh_gate, T},
                                    {l->shexp_gate, s->xn, s->sh_h, T}, {l->shexp_up, s->xn, s->ex_u, T}};
    ops_matmat_jobs(first, shexp_apart ? 4 : c->shexp_ff ? 2 : 1);
    if (shexp_apart) ops_swiglu_rows(s->sh_h, s->ex_u, T, c->shexp_ff);
    model_phase_mark(m, MODEL_PHASE_PRODUCTS);
    model_select_experts(m, T);
    model_want_experts(m, il, T);
    model_phase_mark(m, MODEL_PHASE_ROUTING);
    model_experts_device_start(m, il, T, shd, sh_e);
    model_phase_mark(m, MODEL_PHASE_EXPERTS);
    int shexp_late = shexp_apart && model_behind_device_batch(m, &l->shexp_down);
    if (shexp_apart && !shexp_late) ops_matmat(&l->shexp_down, s->sh_h, s->sh_out, T);
    model_phase_mark(m, MODEL_PHASE_PRODUCTS);
    model_routed_experts(m, T);
    model_phase_mark(m, MODEL_PHASE_EXPERTS);
    if (shexp_late) ops_matmat(&l->shexp_down, s->sh_h, s->sh_out, T);
    model_phase_mark(m, MODEL_PHASE_PRODUCTS);
    model_experts_device_finish(m, il);
    model_phase_mark(m, MODEL_PHASE_EXPERTS);
    #pragma omp parallel for schedule(static) if (T >= 16)
    for (int t = 0; t < T; t++) {
        float *o = s->out + (size_t)t * c->dim;
        for (int k = 0; k < c->n_expert_used; k++) {
            const float *e = s->ex_out + ((size_t)t * c->n_expert_used + k) * c->dim;
            float w = s->top_w[(size_t)t * c->n_expert_used + k];
            for (int i = 0; i < c->dim; i++) o[i] = k ? o[i] + e[i] * w : e[i] * w;
        }
        if (!c->shexp_ff) continue;
        float g = ops_sigmoid(s->sh_gate[t]);
        const float *sh = s->sh_out + (size_t)t * c->dim;
        for (int i = 0; i < c->dim; i++) o[i] += sh[i] * g;
    }
}

/* Guesses layer IL's routed experts before its attention runs, by applying its router to the
 * hidden state as it enters the layer (one block changes the residual little), so the store
 * reads them while the attention runs. Uses xn, router and top, which the layer overwrites. */
static void model_prefetch(struct model *m, int il, int T)
{
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->s;
    const struct model_layer *l = &m->layers[il];
    for (int t = 0; t < T; t++) ops_rmsnorm(s->xn + (size_t)t * c->dim, s->x + (size_t)t * c->dim, l->post_norm, c->dim, c->eps);
    model_route(m, l, T);
    expert_prefetch(m->experts, il, s->top, T * c->n_expert_used);
}

/* For each of T tokens: x += out where ADD, then xn = rmsnorm(x) * NORM where NORM is given.
 * A token a task when a prompt batch has enough of them to pay the parallel region. */
static void model_residual_norm(struct model *m, int T, int add, const float *norm)
{
    struct model_scratch *s = &m->s;
    const size_t dim = (size_t)m->cfg.dim;
    #pragma omp parallel for schedule(static) if (T >= 8)
    for (int t = 0; t < T; t++) {
        float *x = s->x + (size_t)t * dim;
        if (add)
            for (size_t i = 0; i < dim; i++) x[i] += s->out[(size_t)t * dim + i];
        if (norm) ops_rmsnorm(s->xn + (size_t)t * dim, x, norm, (int)dim, m->cfg.eps);
    }
}

/* Layer IL's input norm and mixer projections for T tokens, the products where their
 * matrices are. */
static void model_project(struct model *m, int il, int T)
{
    struct ops_job jobs[CUDA_NEXT_MAX];
    model_residual_norm(m, T, 0, m->layers[il].attn_norm);
    model_phase_mark(m, MODEL_PHASE_OTHER);
    ops_matmat_jobs(jobs, model_mixer_jobs(m, il, T, jobs));
    model_phase_mark(m, MODEL_PHASE_PRODUCTS);
}

/* The device that runs the rest of layer IL for T tokens (model_rest_device), with *L and
 * NEXT filled: what follows it is the next layer's mixer projections, or after the last layer,
 * where HEAD (each token is its run's last), the final norm and the output head into logits. */
static int model_rest_plan(struct model *m, int il, int T, int head, struct ops_job *next, struct cuda_moe_layer *L)
{
    const struct model_layer *l = &m->layers[il];
    const struct ops_matrix *wo = l->kind == MODEL_LAYER_ATTENTION ? &l->wo : &l->wout;
    const int last = il + 1 == m->cfg.n_layers;
    next[0] = (struct ops_job){m->lm_head, m->s.xn, m->s.logits, T};
    int n_next = !cuda.ready ? 0 : !last ? model_mixer_jobs(m, il + 1, T, next) : head;
    return model_rest_device(m, il, T, wo, last ? m->out_norm : m->layers[il + 1].attn_norm, next, n_next, L);
}

/* The rest of layer IL for T tokens after its mixer left its rows in MIX (NULL: the mixer runs
 * on the device, model_chain_plan): the output projection, the residual and the post-norm, the
 * FFN and its residual. All of it on one device where one holds it all (model_rest_device),
 * with what follows it where its matrices are there too (model_rest_plan); else step by step.
 * Returns 1 where what follows was made (kept on the device where the next layer's mixer runs
 * there), 0 where not, or -1 with m->error where an expert could not be read or a chain's
 * device failed (m->lost). */
static int model_layer_rest(struct model *m, int il, int T, const float *mix, int head)
{
    const struct model_layer *l = &m->layers[il];
    const struct model_chain *ch = &m->s.chain[il];
    struct ops_job next[CUDA_NEXT_MAX];
    struct cuda_moe_layer L;
    int dev = model_rest_plan(m, il, T, head, next, &L);
    if (ch->dev >= 0) {
        L.keep = il + 1 < m->cfg.n_layers && m->s.chain[il + 1].mixer;
        L.dn = ch->mixer && l->kind == MODEL_LAYER_DELTANET ? &m->s.dn[il] : NULL;
        L.attn = ch->mixer && l->kind == MODEL_LAYER_ATTENTION ? &m->s.attn_dev[il] : NULL;
        L.block = ch->block, L.ids = L.split ? 0 : ch->ids; /* a split layer's come down with its routing */
        m->s.chain[il].split = L.split;
        if (m->s.chain_first < 0) m->s.chain_first = il;
    }
    int done = dev >= 0 && dev == (ch->dev >= 0 ? ch->dev : dev) ? model_rest_on_device(m, il, T, dev, &L, mix, next) : -1;
    if (done == -2) return -1;
    if (done == 0) {
        model_phase_mark(m, MODEL_PHASE_EXPERTS);
        return L.n_next > 0;
    }
    if (ch->dev >= 0) {
        m->lost = 1;
        snprintf(m->error, sizeof m->error, "the device failed in the middle of a pass");
        return -1;
    }
    const struct ops_matrix *wo = l->kind == MODEL_LAYER_ATTENTION ? &l->wo : &l->wout;
    ops_matmat(wo, mix, m->s.out, T);
    model_phase_mark(m, MODEL_PHASE_PRODUCTS);
    model_residual_norm(m, T, 1, l->post_norm);
    model_phase_mark(m, MODEL_PHASE_OTHER);
    model_ffn(m, il, T);
    if (m->experts && expert_recover(m->experts, m->error, sizeof m->error)) return -1;
    model_residual_norm(m, T, 1, NULL);
    return 0;
}

/* ---- chains: a pass's mixers on the device after the layer before (§5) ---- */

/* Layer IL's DeltaNet constants on device DEV (resident from here on) into s->dn[il]. 1, or 0
 * where the device lacks the kernels or the room. */
static int model_deltanet_on(struct model *m, int il, int dev)
{
    const struct model_config *c = &m->cfg;
    const struct model_layer *l = &m->layers[il];
    const struct cuda_device *d = &cuda.dev[dev];
    const int64_t conv_dim = model_conv_dim(c);
    const float *src[] = {l->conv_taps, l->dt_bias, l->ssm_a, l->ssm_norm};
    const size_t bytes[] = {(size_t)c->conv_kernel * (size_t)conv_dim * 4, (size_t)c->ssm_nv * 4, (size_t)c->ssm_nv * 4,
                            (size_t)(l->ssm_norm_per_head ? c->ssm_nv : 1) * (size_t)c->ssm_dv * 4};
    if (!d->deltanet_conv || !d->deltanet_rule || !d->deltanet_gate || c->ssm_nv % c->ssm_nk) return 0;
    const cuda_ptr p = cuda_floats_resident(dev, src, bytes, 4);
    if (!p) return 0;
    m->s.dn[il] = (struct cuda_deltanet){p, p + cuda_align(bytes[0]), p + cuda_align(bytes[0]) + cuda_align(bytes[1]),
                                         p + cuda_span(bytes, 3), (int)conv_dim, c->conv_kernel, c->ssm_nk, c->ssm_nv, c->ssm_dk,
                                         c->ssm_dv, c->vhead_tiled, c->arch == MODEL_ARCH_QWEN3NEXT, l->ssm_norm_per_head, c->eps,
                                         1.0f / sqrtf((float)c->ssm_dk), model_state_off(m, il),
                                         (uint64_t)conv_dim * (uint64_t)(c->conv_kernel - 1)};
    return 1;
}

/* Layer IL's attention constants on device DEV into s->attn_dev[il] (its chain addresses come
 * with the upload). 1, or 0 where the device lacks the kernels or the room, or the heads' shape
 * is not the kernels' (whole warps, at most 512). */
static int model_attention_on(struct model *m, int il, int dev)
{
    const struct model_config *c = &m->cfg;
    const struct model_layer *l = &m->layers[il];
    const struct cuda_device *d = &cuda.dev[dev];
    const float *src[] = {l->q_norm, l->k_norm};
    const size_t bytes[] = {(size_t)c->head_dim * 4, (size_t)c->head_dim * 4};
    if (!d->attn_prep || !d->attn_split || !d->attn_merge || c->head_dim % 32 || c->head_dim > 512 || c->n_head % c->n_kv_head)
        return 0;
    const cuda_ptr p = cuda_floats_resident(dev, src, bytes, 2);
    if (!p) return 0;
    m->s.attn_dev[il] = (struct cuda_attention){p, p + cuda_align(bytes[0]), 0, 0, 0, c->n_head, c->n_kv_head, c->head_dim, c->rope_dims,
                                                (int)m->kv, 0, c->eps, 1.0f / sqrtf((float)c->head_dim), model_kv_off(m, il),
                                                (uint64_t)model_kv_rows(m)};
    return 1;
}

/* A chain buffer for T tokens: its head (the tokens' DeltaNet state addresses, KV cache
 * addresses, positions and RoPE rows, and where layer 0 is chained its embedded rows and input
 * norm, at these offsets), then the ids of every layer (layer il's at il T used ints from the
 * ids' start), then the chained layers' blocks. */
struct model_chain_head { size_t kv, pos, rope, x, norm, ids, blocks; };

static struct model_chain_head model_chain_head_of(const struct model *m, int T)
{
    struct model_chain_head h;
    h.kv = cuda_align((size_t)T * 8);
    h.pos = h.kv + cuda_align((size_t)T * 8);
    h.rope = h.pos + cuda_align((size_t)T * 4);
    h.x = h.rope + cuda_align((size_t)T * (size_t)m->cfg.rope_dims * 4);
    h.norm = h.x + cuda_align((size_t)T * (size_t)m->cfg.dim * 4);
    h.ids = h.norm + cuda_align((size_t)m->cfg.dim * 4);
    h.blocks = h.ids + cuda_align((size_t)m->cfg.n_layers * (size_t)T * (size_t)m->cfg.n_expert_used * sizeof(int));
    return h;
}

/* Room on device DEV for what layer IL keeps of each of the runs' sequences (its DeltaNet state,
 * or its KV cache), from their first pass there on. 1, or 0 where it does not fit. */
static int model_chain_room(const struct model *m, const struct model_run *runs, int n_runs, int il, int dev)
{
    const int attention = m->layers[il].kind == MODEL_LAYER_ATTENTION;
    const size_t bytes = attention ? model_kv_dev_bytes(m) : (size_t)model_recurrent_bytes(m);
    for (int r = 0; r < n_runs; r++) {
        cuda_ptr *p = attention ? &runs[r].seq->dev_kv[dev] : &runs[r].seq->dev_state[dev];
        if (!*p && !(*p = cuda_state_alloc(dev, bytes))) return 0;
    }
    return 1;
}

/* Layer 0's mixer projections for T tokens into JOBS and their device addresses into PTR where
 * device DEV holds them all and can run them (cuda_project); how many, or 0. */
static int model_first_projections(struct model *m, int T, int dev, struct ops_job *jobs, cuda_ptr *ptr)
{
    const struct cuda_device *d = &cuda.dev[dev];
    const int n = model_mixer_jobs(m, 0, T, jobs);
    for (int j = 0; j < n; j++) {
        const struct cuda_resident *r = cuda_resident_of(jobs[j].w.data);
        const enum gguf_type t = jobs[j].w.type;
        if (!r || r->dev != dev || !d->matvec[t] || !d->quantize[quant_act_kind(t)] || jobs[j].w.cols != m->cfg.dim) return 0;
        ptr[j] = r->ptr;
    }
    return n;
}

/* Chains layer IL for this pass's T tokens (of N_RUNS runs) to device DEV, which makes its
 * projections and would run its rest L whole (DEV < 0: nothing does both), where its mixer can
 * run there too (its constants and every run's state fit): stages IL's block for
 * cuda_chain_begin. */
static void model_chain_layer(struct model *m, const struct model_run *runs, int n_runs, int T, int il, int dev, const struct cuda_moe_layer *L)
{
    struct model_scratch *s = &m->s;
    const int attention = m->layers[il].kind == MODEL_LAYER_ATTENTION;
    if (dev < 0 || !(attention ? model_attention_on(m, il, dev) : model_deltanet_on(m, il, dev)) ||
        !model_chain_room(m, runs, n_runs, il, dev))
        return;
    size_t *used = &s->chain_bytes[dev], bytes = cuda_chain_block_bytes(L, T);
    if (!*used) *used = model_chain_head_of(m, T).blocks;
    if (*used + bytes > s->chain_cap[dev]) {
        s->chain_cap[dev] = 2 * (*used + bytes);
        s->chain_stage[dev] = plat_realloc(s->chain_stage[dev], s->chain_cap[dev]);
    }
    cuda_chain_block_fill(L, T, s->chain_stage[dev] + *used);
    s->chain[il] = (struct model_chain){dev, 1, 0, *used, 0, 0};
    if (il > 0) s->chain[il - 1].dev = dev;
    *used += bytes;
}

/* Each layer's chain for this pass (model_chain_layer), each layer's rest planned once: layer
 * il's projections are made where the layer before's rest runs whole and makes them all, layer
 * 0's where its rest's device holds them (from the embedded rows). */
static void model_chain_layers(struct model *m, const struct model_run *runs, int n_runs, int T)
{
    struct ops_job next[CUDA_NEXT_MAX];
    cuda_ptr ptr[CUDA_NEXT_MAX];
    struct cuda_moe_layer L;
    const int n = m->cfg.n_layers;
    if (!cuda.ready || !m->experts || n > m->cfg.dim) return; /* the ids come down through dev_out */
    for (int il = 0, made = -1; il < n; il++) {
        const int dev = model_rest_plan(m, il, T, T == n_runs, next, &L);
        if (il == 0 && dev >= 0 && model_first_projections(m, T, dev, next, ptr)) made = dev;
        model_chain_layer(m, runs, n_runs, T, il, made == dev ? dev : -1, &L);
        made = dev >= 0 && il + 1 < n && L.n_next == model_mixer_jobs(m, il + 1, T, next) ? dev : -1;
    }
}

/* Uploads each device's staged chains (the head filled in first), sets the chained layers'
 * addresses there, and where layer 0 is chained starts it (cuda_chain_first). -1 where a device
 * failed. */
static int model_chain_upload(struct model *m, int T)
{
    struct model_scratch *s = &m->s;
    const struct model_chain_head h = model_chain_head_of(m, T);
    int longest = 0; /* rows of the batch's longest context */
    for (int t = 0; t < T; t++) longest = s->tok_pos[t] + 1 > longest ? s->tok_pos[t] + 1 : longest;
    for (int dev = 0; dev < cuda.n_devices; dev++) {
        uint8_t *stage = s->chain_stage[dev];
        if (!s->chain_bytes[dev]) continue;
        for (int t = 0; t < T; t++) {
            memcpy(stage + (size_t)t * 8, &s->tok_seq[t]->dev_state[dev], 8);
            memcpy(stage + h.kv + (size_t)t * 8, &s->tok_seq[t]->dev_kv[dev], 8);
            memcpy(stage + h.pos + (size_t)t * 4, &s->tok_pos[t], 4);
            model_rope_table(&m->cfg, s->tok_pos[t], (float *)(void *)(stage + h.rope) + (size_t)t * m->cfg.rope_dims);
        }
        memcpy(stage + h.x, s->x, (size_t)T * (size_t)m->cfg.dim * 4);
        memcpy(stage + h.norm, m->layers[0].attn_norm, (size_t)m->cfg.dim * 4);
        const cuda_ptr base = cuda_chain_begin(dev, stage, s->chain_bytes[dev]);
        if (!base) return -1;
        for (int il = 0; il < m->cfg.n_layers; il++) {
            struct model_chain *ch = &s->chain[il];
            if (ch->dev != dev) continue;
            ch->block = ch->mixer ? base + ch->block_off : 0;
            ch->ids = base + h.ids + (size_t)il * (size_t)T * (size_t)m->cfg.n_expert_used * sizeof(int);
            struct cuda_attention *a = &s->attn_dev[il]; /* read where the layer is attention */
            a->kv = base + h.kv, a->pos = base + h.pos, a->rope = base + h.rope;
            a->splits = (longest + OPS_ATTN_SPLIT - 1) / OPS_ATTN_SPLIT;
        }
        struct ops_job first[CUDA_NEXT_MAX];
        cuda_ptr ptr[CUDA_NEXT_MAX];
        const int n = s->chain[0].mixer && s->chain[0].dev == dev ? model_first_projections(m, T, dev, first, ptr) : 0;
        struct ops_matrix w[CUDA_NEXT_MAX];
        for (int j = 0; j < n; j++) w[j] = first[j].w;
        if (n && cuda_chain_first(dev, base + h.x, base + h.norm, w, ptr, n, m->cfg.dim, m->cfg.eps, T)) return -1;
    }
    return 0;
}

/* Brings run R's state of layer IL where this pass computes it: on DEV (>= 0), else on the
 * CPU, and marks what the pass leaves where. 0, or -1 where a device holding it failed. */
static int model_state_for_pass(struct model *m, const struct model_run *run, int il, int dev)
{
    struct model_seq *q = run->seq;
    struct model_layer_state *st = &q->state[il];
    if (m->layers[il].kind == MODEL_LAYER_DELTANET) {
        if (dev >= 0) return model_state_to_device(m, q, il, dev);
        if (model_state_to_host(m, q, il)) return -1;
        st->on_dev = 0; /* the CPU computes it: the device's copy falls behind */
        return 0;
    }
    if (dev >= 0 ? model_kv_to_device(m, q, il, dev, q->pos) : model_kv_to_host(m, q, il, q->pos)) return -1;
    int *written = dev >= 0 ? &st->dev_rows : &st->host_rows, *other = dev >= 0 ? &st->host_rows : &st->dev_rows;
    *written = q->pos + run->n;
    if (*other > q->pos) *other = q->pos; /* its rows from here on are about to change */
    return 0;
}

/* This pass's chains (model_chain_layer, model_chain_upload), and every run's states made
 * current where the pass computes them: on a chain's device, else on the CPU. Returns 0, or -1
 * with m->error and m->lost where a device holding states failed. */
static int model_chain_plan(struct model *m, const struct model_run *runs, int n_runs, int T)
{
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->s;
    s->chain_first = -1;
    memset(s->chain_bytes, 0, sizeof s->chain_bytes);
    for (int il = 0; il < c->n_layers; il++) s->chain[il] = (struct model_chain){-1, 0, 0, 0, 0, 0};
    model_chain_layers(m, runs, n_runs, T);
    if (model_chain_upload(m, T))
        for (int il = 0; il < c->n_layers; il++) s->chain[il] = (struct model_chain){-1, 0, 0, 0, 0, 0};
    for (int r = 0; r < n_runs; r++)
        for (int il = 0; il < c->n_layers; il++)
            if (model_state_for_pass(m, &runs[r], il, s->chain[il].mixer ? s->chain[il].dev : -1)) {
                m->lost = 1;
                snprintf(m->error, sizeof m->error, "the device that held this conversation's state failed");
                return -1;
            }
    return 0;
}

/* Whether the runs fit a batch: 1..MODEL_MAX_RUNS runs of distinct sequences, at most
 * MODEL_BATCH tokens in all, each within its sequence's context and the vocabulary. Otherwise
 * says why in m->error. */
static int model_runs_valid(struct model *m, const struct model_run *runs, int n_runs)
{
    int total = 0;
    if (n_runs < 1 || n_runs > MODEL_MAX_RUNS) return snprintf(m->error, sizeof m->error, "a batch of %d sequences", n_runs), 0;
    for (int r = 0; r < n_runs; r++) {
        const struct model_run *run = &runs[r];
        for (int j = 0; j < r; j++)
            if (runs[j].seq == run->seq) return snprintf(m->error, sizeof m->error, "a sequence twice in one batch"), 0;
        if (run->n < 1 || run->n > MODEL_BATCH - total || run->seq->pos + run->n > m->n_ctx)
            return snprintf(m->error, sizeof m->error, "%d tokens at %d of %d", run->n, run->seq->pos, m->n_ctx), 0;
        for (int t = 0; t < run->n; t++)
            if (run->tokens[t] < 0 || run->tokens[t] >= m->cfg.n_vocab)
                return snprintf(m->error, sizeof m->error, "token id %d is outside the vocabulary (%d)", run->tokens[t], m->cfg.n_vocab), 0;
        total += run->n;
    }
    return 1;
}

/* The token embeddings of the runs into x, and each token's sequence and position; returns T. */
static int model_embed_runs(struct model *m, const struct model_run *runs, int n_runs)
{
    struct model_scratch *s = &m->s;
    size_t dim = (size_t)m->cfg.dim, row_bytes = gguf_row_bytes(m->embed->type, m->cfg.dim);
    int T = 0;
    for (int r = 0; r < n_runs; r++)
        for (int t = 0; t < runs[r].n; t++, T++) {
            s->tok_seq[T] = runs[r].seq;
            s->tok_pos[T] = runs[r].seq->pos + t;
            quant_dequant_row((enum gguf_type)m->embed->type, m->embed->data + (size_t)runs[r].tokens[t] * row_bytes, s->x + T * dim, m->cfg.dim);
        }
    return T;
}

/* Runs a batch: the tokens of N_RUNS sequences (runs[r].n tokens appended to runs[r].seq)
 * through every layer together, so each weight is read once for all of them, and the logits
 * of each run's last token into runs[r].logits. A token's bits do not depend on its
 * neighbours in the batch (see the section's promise). Returns 0, or -1 with m->error saying
 * why: runs that do not fit (nothing computed), or an expert that could not be read (the
 * runs' sequences are then left half-advanced: the caller resets them). */
static int model_forward_runs(struct model *m, struct model_run *runs, int n_runs)
{
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->s;
    size_t dim = (size_t)c->dim;
    if (!model_runs_valid(m, runs, n_runs)) return -1;
    m->profile.mark = plat_now();
    int T = model_embed_runs(m, runs, n_runs);
    m->lost = 0;
    place_retier(m->experts, T); /* between tokens: nothing is in flight on a device */
    if (model_chain_plan(m, runs, n_runs, T)) return -1;
    int projected = s->chain[0].mixer; /* made what follows: this layer's projections (layer 0's: cuda_chain_first), or the logits */
    for (int il = 0; il < c->n_layers; il++) {
        const int on_device = s->chain[il].mixer; /* its mixer, from the projections the layer before kept there */
        model_phase_mark(m, MODEL_PHASE_OTHER);
        if (m->experts && !m->experts->mapped && !on_device) model_prefetch(m, il, T);
        model_phase_mark(m, MODEL_PHASE_ROUTING);
        if (!projected) model_project(m, il, T);
        const float *mix = on_device                                   ? NULL
                           : m->layers[il].kind == MODEL_LAYER_ATTENTION ? model_attention(m, il, T)
                                                                         : model_gated_deltanet(m, il, T);
        if ((projected = model_layer_rest(m, il, T, mix, T == n_runs)) < 0) return -1;
    }
    for (int r = 0, last = 0; r < n_runs; r++) {
        last += runs[r].n;
        ops_rmsnorm(s->xn + r * dim, s->x + (last - 1) * dim, m->out_norm, c->dim, c->eps);
        runs[r].seq->pos += runs[r].n;
        runs[r].logits = s->logits + (size_t)r * c->n_vocab;
    }
    model_phase_mark(m, MODEL_PHASE_OTHER);
    if (!projected) ops_matmat(&m->lm_head, s->xn, s->logits, n_runs); /* else the last layer's rest made the logits */
    model_phase_mark(m, MODEL_PHASE_PRODUCTS);
    /* A NaN or infinity in the hidden state (a corrupt scale in the file) would reach the
     * logits as zeros through the lm_head's activation quantisation, which skips NaN: keep
     * it visible as NaN logits. */
    for (int r = 0; r < n_runs; r++)
        for (int i = 0; i < c->dim; i++)
            if (!isfinite(s->xn[(size_t)r * dim + i])) {
                for (int v = 0; v < c->n_vocab; v++) runs[r].logits[v] = NAN;
                break;
            }
    return 0;
}

/* Seconds of a token's output head (the final norm and the lm_head product, as
 * model_forward_runs ends it) on the hidden state the last pass left: the median of 5. What a
 * token costs besides its layers (bench --synthetic scales the layers only). */
static double model_head_seconds(struct model *m)
{
    double t[5];
    for (int k = 0; k < 5; k++) {
        double t0 = plat_now();
        ops_rmsnorm(m->s.xn, m->s.x, m->out_norm, m->cfg.dim, m->cfg.eps);
        ops_matmat(&m->lm_head, m->s.xn, m->s.logits, 1);
        t[k] = plat_now() - t0;
        for (int j = k; j > 0 && t[j] < t[j - 1]; j--) {
            double x = t[j];
            t[j] = t[j - 1], t[j - 1] = x;
        }
    }
    return t[2];
}

/* A copy of everything a forward pass changes besides the KV cache beyond pos: rewinding to
 * it undoes the tokens fed since (chat uses it when Ctrl-C cancels a prompt). */
struct model_checkpoint {
    int pos;
    float *recurrent; /* every DeltaNet layer's conv state then ssm state, in layer order */
};

/* Saves (SAVE = 1) or restores (0) the state of Q; the checkpoint's buffer is allocated once. A
 * state lost with a failed device is saved as the empty sequence's (position 0, zero state),
 * which any prompt may start from. */
static void model_checkpoint(const struct model *m, struct model_seq *q, struct model_checkpoint *cp, int save)
{
    const struct model_config *c = &m->cfg;
    size_t conv = (size_t)model_conv_dim(c) * (size_t)(c->conv_kernel - 1), per = model_recurrent_floats(c), n_deltanet = 0;
    for (int i = 0; i < c->n_layers; i++) n_deltanet += q->state[i].conv_state != NULL;
    if (!cp->recurrent) cp->recurrent = plat_alloc(plat_mul_size(per * sizeof(float), n_deltanet ? n_deltanet : 1, "checkpoint"));
    for (int i = 0; save && i < c->n_layers; i++)
        if (model_state_to_host(m, q, i)) {
            memset(cp->recurrent, 0, per * n_deltanet * sizeof(float));
            cp->pos = 0;
            return;
        }
    float *p = cp->recurrent;
    for (int i = 0; i < c->n_layers; i++) {
        struct model_layer_state *st = &q->state[i];
        if (!st->conv_state) continue;
        if (save) {
            memcpy(p, st->conv_state, conv * sizeof(float));
            memcpy(p + conv, st->ssm_state, (per - conv) * sizeof(float));
        } else {
            memcpy(st->conv_state, p, conv * sizeof(float));
            memcpy(st->ssm_state, p + conv, (per - conv) * sizeof(float));
        }
        p += per;
    }
    if (save) cp->pos = q->pos;
    else q->pos = cp->pos;
    if (!save) model_states_written(m, q);
}

/* Bytes of the KV cache's first N positions as model_kv_copy copies them: whole groups of
 * OPS_KV_GROUP rows. */
static int64_t model_kv_bytes(const struct model *m, int n)
{
    return model_kv_bytes_per_token(m) * model_kv_whole_groups(n);
}

/* Copies the KV cache of Q's first N positions into BUF (SAVE) or back from it: every attention
 * layer's K rows then V rows, each KV head's rows in turn, model_kv_bytes(m, N) bytes. What an
 * idle conversation parked in RAM keeps (§11); SAVE reads the CPU's copy (model_seq_to_host
 * makes it current). */
static void model_kv_copy(const struct model *m, struct model_seq *q, void *buf, int n, int save)
{
    size_t rows = (size_t)model_kv_whole_groups(n) * model_kv_row_bytes(m);
    size_t head = (size_t)model_kv_rows(m) * model_kv_row_bytes(m);
    char *b = buf;
    for (int i = 0; i < m->cfg.n_layers; i++) {
        char *cache[2] = {q->state[i].k_cache, q->state[i].v_cache};
        for (int c = 0; c < 2 && cache[c]; c++)
            for (int h = 0; h < m->cfg.n_kv_head; h++, b += rows) {
                if (save) memcpy(b, cache[c] + h * head, rows);
                else memcpy(cache[c] + h * head, b, rows);
            }
        if (!save) q->state[i].host_rows = n, q->state[i].dev_rows = 0; /* another conversation's rows: the devices' are not its */
    }
}

/* How many times memory must hold the routed experts for the store to copy them out of the
 * mapping (expert_own) rather than read them in place. The copy is faster, being interleaved
 * where its type has such a form (§3) and in pages of its own: 0-60% faster decode on the
 * 10-layer Q4_K slice of the 35B-A3B, by how the page cache held the file (README, Models
 * larger than memory). Where memory holds the copy beside the file's pages, the page cache
 * keeps them for the next start. A server copies where memory holds the experts once: the
 * file's pages give way and its next start reads the file again (seconds on an SSD), which a
 * process that serves for hours pays back many times. */
enum model_copies { MODEL_COPY_OVER_FILE_PAGES = 1, MODEL_COPY_BESIDE_FILE_PAGES = 2 };

/* How many sequences to hold at once when not told: as many as a quarter of the memory still
 * available holds at full context, 1 to 4 (more slots batch more tokens per weight read, but
 * each takes memory from the expert cache), and, unless RAM (--ram) fixes the experts' budget,
 * no more than leave every routed expert in memory where one sequence would: each token reads
 * experts, and those left out come from the disk (the 35B-A3B geometry on a 24 GB machine: 4
 * sequences of 32k left a third out). It counts every expert in RAM: those a device takes
 * would leave room for more. */
static int model_choose_seqs(const struct model *m, int64_t ram)
{
    int64_t avail = plat_mem_available(), per = model_seq_bytes(m), n = per > 0 && avail > 0 ? avail / 4 / per : 1;
    n = n < 1 ? 1 : n > 4 ? 4 : n;
    const int64_t experts = (int64_t)model_expert_bytes(m);
    if (ram < 0 && m->cfg.n_expert && model_expert_budget(m, 1, 0, -1).budget >= experts)
        while (n > 1 && model_expert_budget(m, (int)n, 0, -1).budget < experts) n--;
    return (int)n;
}

/* Opens the store of routed experts behind BUDGET bytes of RAM (HEAT: the heat file, NULL:
 * expert_heat_default, "": none kept), decides with §7 what lives in VRAM, the trunk and the experts priced
 * together (GROWS: the budget is what memory leaves, so the trunk placed leaves its RAM to the
 * experts), and gives the store the budget that leaves for what stays on the CPU. When it
 * holds every such expert they stay in the mapping, or are copied into the store's memory
 * where GROWS and the budget holds COPIES times them (model_copies). Room is kept on the
 * devices for N_SEQS sequences' states. Fills *R. */
static void model_place(struct model *m, int n_seqs, int64_t budget, int grows, enum model_copies copies, const char *heat,
                        enum expert_io io, const char *place, struct place_result *r)
{
    const struct model_config *c = &m->cfg;
    struct place_item *it = model_trunk_items(m);
    int n = 0;
    while (it[n].m) n++;
    struct place_host h = {-1, 1, grows, io == EXPERT_IO_DIRECT ? 1.0 : 3.0};
    int64_t experts = (int64_t)model_expert_bytes(m);
    if (c->n_expert) {
        uint64_t fp = model_fingerprint(m);
        char *heat_path = !heat ? expert_heat_default(m->file.path, fp) : *heat ? plat_strdup(heat) : NULL;
        struct stat st;
        if (heat_path && stat(heat_path, &st) == 0 && !S_ISREG(st.st_mode)) {
            /* saving renames a file over the path: over /dev/null, say, as root */
            plat_log("[experts] heat %s is not a regular file: no heat kept", heat_path);
            free(heat_path);
            heat_path = NULL;
        }
        struct expert_config cfg = {budget >= experts ? -1 : budget, heat_path, fp, io, 0};
        model_store_experts(m, &cfg);
        free(heat_path);
        if (!m->experts->mapped) {
            expert_size_slots(m->experts);
            h.cache_bytes = budget;
            h.slot_bytes = m->experts->slot_bytes;
        }
    }
    /* the N_SEQS sequences' DeltaNet states where chains run them (§5) take room beside the
     * weights: kept free on each device whose budget it leaves three quarters of */
    const int64_t states = (int64_t)n_seqs * model_recurrent_bytes(m);
    int64_t kept[CUDA_MAX_DEVICES] = {0};
    for (int d = 0; cuda.ready && d < cuda.n_devices; d++) cuda.dev[d].budget -= kept[d] = 4 * states <= cuda.dev[d].budget ? states : 0;
    place_model(it, n, m->experts, c->n_expert_used, place, &h, r);
    for (int d = 0; d < cuda.n_devices; d++) cuda.dev[d].budget += kept[d];
    free(it);
    if (!c->n_expert) return;
    int64_t left = budget + (grows ? (int64_t)r->trunk_cpu_bytes : 0), cpu = experts - (int64_t)r->expert_cpu_bytes;
    expert_set_budget(m->experts, left >= cpu ? -1 : left, grows && left >= (int64_t)copies * experts);
}

/* Places the weights (model_place) with the experts behind a RAM budget (model_expert_budget:
 * for N_SEQS sequences, RESERVE bytes kept, RAM bytes given or < 0), HEAT the heat file,
 * starts the store, and says what it chose in one line. */
static void model_place_weights(struct model *m, int n_seqs, int64_t reserve, int64_t ram, enum model_copies copies, const char *heat,
                                enum expert_io io, const char *place)
{
    const struct model_config *c = &m->cfg;
    struct model_budget b = model_expert_budget(m, n_seqs, reserve, ram);
    struct place_result r;
    model_place(m, n_seqs, b.budget, ram < 0, copies, heat, io, place, &r);
    if (c->n_expert == 0) return;
    struct expert_store *s = m->experts;
    expert_start(s);
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t lo = ((uintptr_t)m->embed->data + (uintptr_t)page - 1) & ~(uintptr_t)(page - 1);
    uintptr_t hi = ((uintptr_t)m->embed->data + m->embed->bytes) & ~(uintptr_t)(page - 1);
    if (!s->mapped && m->lm_head.data != m->embed->data && hi > lo)
        madvise((void *)lo, hi - lo, MADV_RANDOM); /* a row per token: reading 8 MiB around each is waste */
    const char *heat_path = s->cfg.heat_path ? s->cfg.heat_path : "none";
    const char *heat_state = !s->cfg.heat_path ? "not kept" : s->heat_loaded ? "loaded" : access(heat_path, F_OK) ? "none yet" : "ignored";
    char how[160] = "read in place from the mapping";
    if (s->own)
        snprintf(how, sizeof how, "copied there%s (%s)",
                 memchr(s->hole, 1, (size_t)c->n_layers * c->n_expert) ? " but for those in VRAM" : "",
                 copies == MODEL_COPY_OVER_FILE_PAGES ? "a server copies them where memory holds them once"
                                                      : "memory holds the file's pages too");
    if (s->mapped)
        plat_log("[experts] all %d routed experts (%.2f GiB) fit in memory: %s; heat %s (%s)", c->n_layers * c->n_expert,
                 model_expert_bytes(m) / 1073741824.0, how, heat_path, heat_state);
    else
        plat_log("[experts] cache %.2f GiB%s: %d of %d experts (%.2f MiB each), up to %d pinned; %s, %d readers; heat %s (%s)",
                 (double)s->n_slots * s->slot_bytes / 1073741824.0, ram < 0 ? "" : " (--ram)", s->n_slots, c->n_layers * c->n_expert,
                 s->slot_bytes / 1048576.0, s->n_pin, s->cfg.io == EXPERT_IO_DIRECT ? "O_DIRECT" : "buffered+fadvise", s->n_readers,
                 heat_path, heat_state);
    if (!s->mapped && ram < 0)
        plat_log("[experts] budget = %.2f GiB available - %.2f trunk + %.2f of it in VRAM - %.2f KV (context %d x %d) - %.2f state"
                 " - %.2f prompt cache - %.2f margin", b.avail / 1073741824.0, b.trunk / 1073741824.0, r.trunk_cpu_bytes / 1073741824.0,
                 b.kv / 1073741824.0, m->n_ctx, n_seqs, b.state / 1073741824.0, b.reserve / 1073741824.0, b.margin / 1073741824.0);
}

/* ==== §9 tokenizer ==== */
/* Owns: the vocabulary (struct tok): token texts and types, the text->id and merge hash tables,
 *   the special-token list, the end-of-generation set; byte-level BPE encoding with the Qwen
 *   pre-tokenizers (qwen2, qwen35) as hand-written matchers; decoding; UTF-8-safe streaming of
 *   decoded pieces; JSON values (read strictly, written as Python's json.dumps writes them); the
 *   chat templates of Qwen3.5 and Qwen3.6, rendered from JSON messages and tools.
 * Promises: token ids equal llama.cpp's (b9793) for these tokenizers: no BOS, special-token texts
 *   parsed when asked, no Unicode normalisation; every byte string encodes (invalid UTF-8 too) and
 *   decodes back to the same bytes.  All strings are (pointer, length): NULs are ordinary bytes.
 *   A chat renders byte for byte as the model's Jinja template does (the golden cases of
 *   template-qwen35.json and -qwen36.json), refusals included; nothing here dies on a message.
 * May call: die, plat_alloc, plat_realloc, plat_sha256; the GGUF accessors of §2 (gguf_get_string,
 *   gguf_get_int, gguf_get_array, gguf_array_string); the range tables of vendor/unicode_tables.h.
 * Workload: tok_load once per model (152k tokens and 151k merges: one pass each into open-address
 *   hash tables, ~50 ms); tok_encode once per prompt, linear in the text apart from BPE, which is
 *   O(w log w) per pre-token word of w bytes (a heap of ranked pairs), so a 100 kB word is fine;
 *   tok_decode / tok_stream_push once per generated token, O(token length).
 */

/* Token types as stored in tokenizer.ggml.token_type. */
enum tok_type {
    TOK_T_UNDEFINED = 0, TOK_T_NORMAL = 1, TOK_T_UNKNOWN = 2, TOK_T_CONTROL = 3,
    TOK_T_USER_DEFINED = 4, TOK_T_UNUSED = 5, TOK_T_BYTE = 6
};

/* Pre-tokenizer regexes; they differ only in whether combining marks (\p{M}) join words. */
enum tok_pre { TOK_PRE_QWEN2, TOK_PRE_QWEN35 };

#define TOK_MAX_EOG 16

/* The chat templates coli renders itself, found by the sha256 of the file's
 * tokenizer.chat_template. Qwen3.6 is Qwen3.5 with two lines changed: preserve_thinking, and
 * scalar tool arguments written as JSON rather than with Python's str(). */
enum tok_template { TOK_TEMPLATE_QWEN35, TOK_TEMPLATE_QWEN36 };
static const char *const tok_template_names[] = {"Qwen3.5", "Qwen3.6"};

static const struct { const char *sha256; enum tok_template kind; } tok_templates_known[] = {
    {"a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715", TOK_TEMPLATE_QWEN35},
    {"e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259", TOK_TEMPLATE_QWEN36},
};

/* Which renderer a file's template TEXT[0..n) gets (TEXT NULL: the file has none), and a line
 * saying so into SAY. Another template is rendered as Qwen3.6: every Qwen3.5/3.6 file coli
 * runs speaks its ChatML, tools and think blocks. */
static enum tok_template tok_template_detect(const char *text, size_t n, char *say, size_t say_len)
{
    uint8_t digest[32];
    char hex[65];
    plat_sha256(text ? text : "", text ? n : 0, digest);
    for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", digest[i]);
    for (size_t i = 0; text && i < sizeof tok_templates_known / sizeof tok_templates_known[0]; i++)
        if (!strcmp(hex, tok_templates_known[i].sha256)) {
            enum tok_template kind = tok_templates_known[i].kind;
            snprintf(say, say_len, "%s, the file's own (sha256 %.8s…)", tok_template_names[kind], hex);
            return kind;
        }
    if (text) snprintf(say, say_len, "%s: the file's template (%zu bytes, sha256 %.8s…) is not one coli knows", tok_template_names[TOK_TEMPLATE_QWEN36], n, hex);
    else snprintf(say, say_len, "%s: the file has no chat template", tok_template_names[TOK_TEMPLATE_QWEN36]);
    return TOK_TEMPLATE_QWEN36;
}

struct tok {
    int n_vocab;
    char *text;             /* all token texts back to back, in vocabulary form */
    uint32_t *text_off;     /* token i is text[text_off[i] .. text_off[i+1]) */
    uint8_t *type;          /* enum tok_type of each token */
    size_t max_piece;       /* longest decoded piece: tok_decode never needs more */
    int32_t *text_tab;      /* text -> id, open addressing, -1 = empty slot */
    uint32_t text_mask;     /* slots - 1 (a power of two) */
    uint64_t *merge_key;    /* (left id << 32 | right id) + 1 of each merge; 0 = empty slot */
    int32_t *merge_rank;    /* position in tokenizer.ggml.merges: lower merges first */
    int32_t *merge_out;     /* the token the pair merges into */
    uint32_t merge_mask;
    int *special;           /* tokens matched verbatim in text before BPE, longest first */
    int n_special;
    int byte_id[256];       /* token of each single byte */
    int16_t cp_byte[324];   /* inverse byte-level map: code point -> byte, -1 if none */
    int eos_id, eot_id, pad_id;  /* -1 when absent */
    int eog[TOK_MAX_EOG];   /* end-of-generation tokens */
    int n_eog;
    enum tok_pre pre;
    enum tok_template chat_template; /* the renderer of chat messages (tok_chat_template_render) */
    char chat_template_about[200];   /* which one, and why: for the log */
};

/* ---- byte-level map and hashing ---- */

/* GPT-2's byte->code point map: printable Latin-1 bytes stand for themselves, the other 68 bytes
 * take the code points 256, 257, ... in byte order, so every byte becomes a visible character. */
static uint32_t tok_byte_cp(int b)
{
    int shift = 0;
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF))
        return (uint32_t)b;
    for (int c = 0; c < b; c++)
        shift += !((c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF));
    return 256u + (uint32_t)shift;
}

/* Writes code point cp (< 0x110000) as UTF-8 into out; returns its length. */
static size_t tok_utf8_put(uint32_t cp, char *out)
{
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | cp >> 6); out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | cp >> 12); out[1] = (char)(0x80 | (cp >> 6 & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | cp >> 18); out[1] = (char)(0x80 | (cp >> 12 & 0x3F));
    out[2] = (char)(0x80 | (cp >> 6 & 0x3F)); out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Decodes one well-formed UTF-8 sequence at s (n > 0 bytes available) into *cp; returns its
 * length, or 0 if s[0] does not start one (stray continuation, overlong form, surrogate, above
 * U+10FFFF, truncated).  The encoder then treats that single byte as a unit of its own. */
static size_t tok_utf8_get(const unsigned char *s, size_t n, uint32_t *cp)
{
    unsigned c = s[0];
    size_t len;
    uint32_t lo = 0x80, hi = 0xBF, v;
    if (c < 0x80) { *cp = c; return 1; }
    if (c < 0xC2 || c > 0xF4) return 0;
    len = c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    if (n < len) return 0;
    if (c == 0xE0) lo = 0xA0;            /* overlong */
    else if (c == 0xED) hi = 0x9F;       /* surrogates */
    else if (c == 0xF0) lo = 0x90;       /* overlong */
    else if (c == 0xF4) hi = 0x8F;       /* above U+10FFFF */
    if (s[1] < lo || s[1] > hi) return 0;
    v = c & (0x7F >> len);
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        v = v << 6 | (s[i] & 0x3F);
    }
    *cp = v;
    return len;
}

/* Converts vocabulary-form text (byte-level characters) to the raw bytes it stands for: writes
 * at most cap bytes to out and returns the full count (<= len), or -1 if some character is not
 * one of the 256 byte characters.  cap 0 only validates. */
static long tok_unbyte(const struct tok *t, const char *s, size_t len, char *out, size_t cap)
{
    size_t i = 0, o = 0;
    while (i < len) {
        uint32_t cp;
        size_t k = tok_utf8_get((const unsigned char *)s + i, len - i, &cp);
        if (!k || cp >= sizeof t->cp_byte / sizeof t->cp_byte[0] || t->cp_byte[cp] < 0) return -1;
        if (o < cap) out[o] = (char)t->cp_byte[cp];
        o++;
        i += k;
    }
    return (long)o;
}

/* FNV-1a: token texts are short, and this spreads them well enough for linear probing. */
static uint32_t tok_hash(const char *s, size_t len)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)s[i]) * 16777619u;
    return h;
}

static uint32_t tok_hash_pair(uint64_t key)
{
    return (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> 32);
}

/* Smallest power of two >= 2n: keeps the tables at most half full. */
static uint32_t tok_table_size(size_t n)
{
    uint32_t s = 16;
    while (s < 2 * n) s <<= 1;
    return s;
}

/* Id of the token whose vocabulary-form text is s[0..len), or -1. */
static int tok_lookup(const struct tok *t, const char *s, size_t len)
{
    if (!len) return -1;
    for (uint32_t h = tok_hash(s, len) & t->text_mask;; h = (h + 1) & t->text_mask) {
        int id = t->text_tab[h];
        if (id < 0) return -1;
        if (t->text_off[id + 1] - t->text_off[id] == len && !memcmp(t->text + t->text_off[id], s, len))
            return id;
    }
}

/* Exact lookup by vocabulary-form text, NUL-terminated (e.g. "<think>", "<|im_start|>");
 * returns the id or -1.  Normal tokens are stored byte-level encoded (a space is "Ġ"). */
static int tok_find(const struct tok *t, const char *text)
{
    return tok_lookup(t, text, strlen(text));
}

/* Merge table lookup: the rank of merging tokens a,b (and *out the result), or -1. */
static int tok_merge_rank(const struct tok *t, int a, int b, int *out)
{
    uint64_t key = ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) + 1;
    for (uint32_t h = tok_hash_pair(key) & t->merge_mask;; h = (h + 1) & t->merge_mask) {
        if (!t->merge_key[h]) return -1;
        if (t->merge_key[h] == key) { *out = t->merge_out[h]; return t->merge_rank[h]; }
    }
}

/* ---- loading ---- */

/* Reads tokenizer.ggml.model / .pre; dies on anything but byte-level BPE with a Qwen regex. */
static void tok_load_kind(struct tok *t, const struct gguf_file *g)
{
    size_t n;
    const char *s = gguf_get_string(g, "tokenizer.ggml.model", &n);
    if (!s) die("tokenizer: no tokenizer.ggml.model in the model file");
    if (n != 4 || memcmp(s, "gpt2", 4)) die("unsupported tokenizer model %.*s", (int)n, s);
    s = gguf_get_string(g, "tokenizer.ggml.pre", &n);
    if (!s) die("tokenizer: no tokenizer.ggml.pre in the model file");
    /* "deepseek-r1-qwen" is llama.cpp's name for Qwen2's regex in the R1 distills. */
    if ((n == 5 && !memcmp(s, "qwen2", 5)) || (n == 16 && !memcmp(s, "deepseek-r1-qwen", 16)))
        t->pre = TOK_PRE_QWEN2;
    else if (n == 6 && !memcmp(s, "qwen35", 6))
        t->pre = TOK_PRE_QWEN35;
    else
        die("unsupported pre-tokenizer %.*s", (int)n, s);
}

/* Reads token texts and types, checks that every normal token is byte-level text, and
 * builds the text -> id table (the last of duplicate texts wins, as in llama.cpp). */
static void tok_load_vocab(struct tok *t, const struct gguf_file *g)
{
    const void *data;
    size_t n = gguf_get_array(g, "tokenizer.ggml.tokens", GGUF_VALUE_STRING, &data), len, total = 0;
    if (!n) die("tokenizer: no tokenizer.ggml.tokens in the model file");
    if (n > (1u << 30)) die("tokenizer: %zu tokens is too many", n);
    for (size_t i = 0; i < n; i++) {
        gguf_array_string(g, "tokenizer.ggml.tokens", i, &len);
        total += len;
    }
    if (total > UINT32_MAX) die("tokenizer: token texts too large");
    t->n_vocab = (int)n;
    t->text = plat_alloc(total);
    t->text_off = plat_alloc((n + 1) * sizeof *t->text_off);
    t->type = plat_alloc(n);
    t->text_off[0] = 0;
    for (size_t i = 0; i < n; i++) {
        const char *s = gguf_array_string(g, "tokenizer.ggml.tokens", i, &len);
        memcpy(t->text + t->text_off[i], s, len);
        t->text_off[i + 1] = t->text_off[i] + (uint32_t)len;
        t->max_piece = len > t->max_piece ? len : t->max_piece;
    }
    size_t nt = gguf_get_array(g, "tokenizer.ggml.token_type", GGUF_VALUE_INT32, &data);
    if (nt && nt != n) die("tokenizer: %zu token types for %zu tokens", nt, n);
    for (size_t i = 0; i < n; i++) {
        int32_t ty = TOK_T_NORMAL;
        if (nt) memcpy(&ty, (const char *)data + 4 * i, 4);   /* the payload may be unaligned */
        if (ty < TOK_T_UNDEFINED || ty > TOK_T_BYTE) die("tokenizer: token %zu has type %d", i, (int)ty);
        t->type[i] = (uint8_t)ty;
    }
    t->text_mask = tok_table_size(n) - 1;
    t->text_tab = plat_alloc(((size_t)t->text_mask + 1) * sizeof *t->text_tab);
    memset(t->text_tab, 0xFF, ((size_t)t->text_mask + 1) * sizeof *t->text_tab);
    for (size_t i = 0; i < n; i++) {
        const char *s = t->text + t->text_off[i];
        len = t->text_off[i + 1] - t->text_off[i];
        if (t->type[i] == TOK_T_NORMAL && tok_unbyte(t, s, len, NULL, 0) < 0)
            die("tokenizer: token %zu (%.*s) is not byte-level text", i, (int)len, s);
        if (!len) continue;     /* an empty text can never be matched */
        uint32_t h = tok_hash(s, len) & t->text_mask;
        for (;; h = (h + 1) & t->text_mask) {
            int id = t->text_tab[h];
            if (id < 0 || (t->text_off[id + 1] - t->text_off[id] == len
                           && !memcmp(t->text + t->text_off[id], s, len)))
                break;
        }
        t->text_tab[h] = (int32_t)i;
    }
}

/* Reads tokenizer.ggml.merges ("left right" in vocabulary form, best first) into the pair table.
 * Dies if a merge names a token, or forms a text, that is not in the vocabulary: such a
 * vocabulary is inconsistent (Hugging Face refuses it too).  The first of duplicate pairs wins. */
static void tok_load_merges(struct tok *t, const struct gguf_file *g)
{
    const void *data;
    size_t n = gguf_get_array(g, "tokenizer.ggml.merges", GGUF_VALUE_STRING, &data), len;
    if (n > INT32_MAX) die("tokenizer: too many merges");
    t->merge_mask = tok_table_size(n) - 1;
    t->merge_key = plat_alloc(((size_t)t->merge_mask + 1) * sizeof *t->merge_key);
    t->merge_rank = plat_alloc(((size_t)t->merge_mask + 1) * sizeof *t->merge_rank);
    t->merge_out = plat_alloc(((size_t)t->merge_mask + 1) * sizeof *t->merge_out);
    memset(t->merge_key, 0, ((size_t)t->merge_mask + 1) * sizeof *t->merge_key);
    char *joined = NULL;
    size_t joined_cap = 0;
    for (size_t i = 0; i < n; i++) {
        const char *s = gguf_array_string(g, "tokenizer.ggml.merges", i, &len);
        /* Search from 1, as llama.cpp does, so that a left part may itself start with ' '. */
        const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
        if (!sp) die("tokenizer: merge %zu (%.*s) has no separator", i, (int)len, s);
        size_t ll = (size_t)(sp - s), rl = len - ll - 1;
        if (len > joined_cap) joined = plat_realloc(joined, joined_cap = len);
        memcpy(joined, s, ll);
        memcpy(joined + ll, sp + 1, rl);
        int a = tok_lookup(t, s, ll), b = tok_lookup(t, sp + 1, rl), c = tok_lookup(t, joined, ll + rl);
        if (a < 0 || b < 0 || c < 0)
            die("tokenizer: merge %zu (%.*s) is not made of vocabulary tokens", i, (int)len, s);
        uint64_t key = ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) + 1;
        uint32_t h = tok_hash_pair(key) & t->merge_mask;
        while (t->merge_key[h] && t->merge_key[h] != key) h = (h + 1) & t->merge_mask;
        if (t->merge_key[h]) continue;
        t->merge_key[h] = key;
        t->merge_rank[h] = (int32_t)i;
        t->merge_out[h] = c;
    }
    free(joined);
}

/* Sort key of a special token: longer texts first (so "<|im_start|>" is never cut by a shorter
 * token occurring inside it), equal lengths by id so the order is deterministic. */
static int tok_u64_cmp(const void *pa, const void *pb)
{
    uint64_t a = *(const uint64_t *)pa, b = *(const uint64_t *)pb;
    return (a > b) - (a < b);
}

/* Reads an optional token id key; dies if it names no token. */
static int tok_load_id(const struct tok *t, const struct gguf_file *g, const char *key)
{
    int64_t id = gguf_get_int(g, key, -1);
    if (id < -1 || id >= t->n_vocab) die("tokenizer: %s = %lld is not a token", key, (long long)id);
    return (int)id;
}

/* Adds id to the end-of-generation set unless absent (-1) or already there. */
static void tok_add_eog(struct tok *t, int id)
{
    if (id < 0) return;
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return;
    t->eog[t->n_eog++] = id;
}

/* Special tokens, eos/eot/pad and the end-of-generation set.  Special = CONTROL, USER_DEFINED and
 * UNKNOWN (llama.cpp's set; UNUSED "[PAD…]" tokens stay ordinary text).  The eog set follows
 * llama.cpp: eos plus every token whose text is one of the turn/document/FIM-separator ends. */
static void tok_load_specials(struct tok *t, const struct gguf_file *g)
{
    static const char *const eog_texts[] = {
        "<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "</s>",
    };
    uint64_t *keys = plat_alloc((size_t)t->n_vocab * sizeof *keys);
    int n = 0;
    for (int i = 0; i < t->n_vocab; i++) {
        int ty = t->type[i];
        uint32_t len = t->text_off[i + 1] - t->text_off[i];
        if ((ty == TOK_T_CONTROL || ty == TOK_T_USER_DEFINED || ty == TOK_T_UNKNOWN) && len)
            keys[n++] = (uint64_t)(UINT32_MAX - len) << 32 | (uint32_t)i;
    }
    qsort(keys, (size_t)n, sizeof *keys, tok_u64_cmp);
    t->special = plat_alloc((size_t)(n ? n : 1) * sizeof *t->special);
    for (int i = 0; i < n; i++) t->special[i] = (int)(uint32_t)keys[i];
    t->n_special = n;
    free(keys);
    t->eos_id = tok_load_id(t, g, "tokenizer.ggml.eos_token_id");
    t->pad_id = tok_load_id(t, g, "tokenizer.ggml.padding_token_id");
    t->eot_id = tok_find(t, "<|im_end|>");
    if (t->eot_id < 0) t->eot_id = t->eos_id;
    t->n_eog = 0;
    tok_add_eog(t, t->eos_id);
    for (size_t i = 0; i < sizeof eog_texts / sizeof eog_texts[0]; i++)
        tok_add_eog(t, tok_find(t, eog_texts[i]));
}

/* Loads the tokenizer of a GGUF model.  Needs tokenizer.ggml.{model,pre,tokens,merges}; dies
 * with a message naming the problem if the tokenizer is not Qwen's byte-level BPE or is
 * inconsistent.  The struct owns copies of everything: g may be closed afterwards. */
static void tok_load(struct tok *t, const struct gguf_file *g)
{
    memset(t, 0, sizeof *t);
    tok_load_kind(t, g);
    for (size_t cp = 0; cp < sizeof t->cp_byte / sizeof t->cp_byte[0]; cp++) t->cp_byte[cp] = -1;
    for (int b = 0; b < 256; b++) t->cp_byte[tok_byte_cp(b)] = (int16_t)b;
    tok_load_vocab(t, g);
    for (int b = 0; b < 256; b++) {
        char u[4];
        t->byte_id[b] = tok_lookup(t, u, tok_utf8_put(tok_byte_cp(b), u));
        if (t->byte_id[b] < 0) die("tokenizer: no token for byte 0x%02x", b);
    }
    tok_load_merges(t, g);
    tok_load_specials(t, g);
    size_t len = 0;
    const char *tpl = gguf_get_string(g, "tokenizer.chat_template", &len);
    t->chat_template = tok_template_detect(tpl, len, t->chat_template_about, sizeof t->chat_template_about);
}

/* Frees what tok_load allocated; t is zeroed and may be loaded again. */
static void tok_free(struct tok *t)
{
    free(t->text);
    free(t->text_off);
    free(t->type);
    free(t->text_tab);
    free(t->merge_key);
    free(t->merge_rank);
    free(t->merge_out);
    free(t->special);
    memset(t, 0, sizeof *t);
}

/* True if generating id ends the turn (eos, <|im_end|>, <|endoftext|>, FIM separators, </s>). */
static int tok_is_eog(const struct tok *t, int id)
{
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return 1;
    return 0;
}

/* ---- encoding ---- */

/* Pre-tokenizer character classes as bits; \r is both WS and NL, ' ' both WS and SP.  A byte
 * that is not valid UTF-8 has class 0, like punctuation: it joins the [^\s\p{L}\p{N}]+ runs. */
enum { TOK_C_L = 1, TOK_C_N = 2, TOK_C_M = 4, TOK_C_WS = 8, TOK_C_NL = 16, TOK_C_SP = 32 };

/* Binary search of cp in a sorted table of inclusive ranges. */
static int tok_in_ranges(const uint32_t (*r)[2], size_t n, uint32_t cp)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (cp < r[mid][0]) hi = mid;
        else if (cp > r[mid][1]) lo = mid + 1;
        else return 1;
    }
    return 0;
}

#define TOK_IN(table, cp) tok_in_ranges(table, sizeof table / sizeof table[0], cp)

/* Class bits of code point cp: \p{L}, \p{N}, \p{M} from the general category, \s = White_Space. */
static unsigned tok_cp_class(uint32_t cp)
{
    if (cp < 0x80) {
        if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return TOK_C_L;
        if (cp >= '0' && cp <= '9') return TOK_C_N;
        if (cp == '\r' || cp == '\n') return TOK_C_WS | TOK_C_NL;
        if (cp == ' ') return TOK_C_WS | TOK_C_SP;
        return cp >= 0x09 && cp <= 0x0D ? TOK_C_WS : 0;
    }
    if (TOK_IN(tok_ranges_letter, cp)) return TOK_C_L;
    if (TOK_IN(tok_ranges_number, cp)) return TOK_C_N;
    if (TOK_IN(tok_ranges_mark, cp)) return TOK_C_M;
    return TOK_IN(tok_ranges_white_space, cp) ? TOK_C_WS : 0;
}

struct tok_unit { size_t off; unsigned cls; };    /* a code point (or invalid byte) of the text */
struct tok_sym { int32_t id, prev, next; };       /* a BPE symbol: id -1 once merged away */
struct tok_pair { int32_t rank, left, id_left, id_right, out; };  /* a mergeable neighbour pair */

/* Scratch of one tok_encode call, reused across its words, and the ids produced. */
struct tok_work {
    struct tok_unit *unit; size_t unit_cap;
    struct tok_sym *sym; size_t sym_cap;
    struct tok_pair *heap; size_t heap_n, heap_cap;
    int *ids; size_t n_ids, ids_cap;
};

/* Ensures p holds at least need elements of elem bytes (cap in *cap), doubling; returns p. */
static void *tok_grow(void *p, size_t *cap, size_t need, size_t elem)
{
    size_t c = *cap ? *cap : 16;
    if (need <= *cap) return p;
    while (c < need) c *= 2;
    *cap = c;
    return plat_realloc(p, c * elem);
}

static void tok_emit(struct tok_work *w, int id)
{
    w->ids = tok_grow(w->ids, &w->ids_cap, w->n_ids + 1, sizeof *w->ids);
    w->ids[w->n_ids++] = id;
}

/* Lower-cased ASCII letter at unit i, or 0 (past the end, not a letter, not ASCII). */
static int tok_ascii_at(const struct tok_unit *u, size_t n, size_t i, const char *s)
{
    unsigned char c;
    if (i >= n || !(u[i].cls & TOK_C_L)) return 0;
    c = (unsigned char)s[u[i].off];
    return c < 0x80 ? c | 0x20 : 0;
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d) at unit i: the match length in units, or 0.  Case folding is
 * ASCII only (llama.cpp writes it '[sS]|...'; Unicode folding would also take U+017F). */
static size_t tok_contraction(const struct tok_unit *u, size_t n, size_t i, const char *s)
{
    int a, b;
    if (s[u[i].off] != '\'') return 0;
    a = tok_ascii_at(u, n, i + 1, s);
    b = tok_ascii_at(u, n, i + 2, s);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (((a == 'r' || a == 'v') && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

/* Length in units of the pre-token starting at unit i < n, by the Qwen regex (alternatives in
 * order, the first that matches wins):
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d) | [^\r\n\p{L}\p{N}]?B+ | \p{N} | ' '?[^\s B \p{N}]+[\r\n]*
 *   | \s*[\r\n]+ | \s+(?!\S) | \s+
 * where B is \p{L} (qwen2) or [\p{L}\p{M}] (qwen35): the body class passed in `body`.  Every
 * unit is in B, \p{N}, \s or the punctuation class, so the result is always >= 1. */
static size_t tok_pre_match(const struct tok_unit *u, size_t n, size_t i, const char *s, unsigned body)
{
    unsigned c = u[i].cls, punct_not = TOK_C_WS | TOK_C_N | body;
    size_t j = tok_contraction(u, n, i, s), nl = 0, end;
    if (j) return j;
    /* The optional prefix is taken only when a body run follows it (else backtrack without it). */
    j = i;
    if (!(c & (body | TOK_C_N | TOK_C_NL)) && i + 1 < n && (u[i + 1].cls & body)) j = i + 1;
    if (u[j].cls & body) {
        while (j < n && (u[j].cls & body)) j++;
        return j - i;
    }
    if (c & TOK_C_N) return 1;
    j = i + ((c & TOK_C_SP) && i + 1 < n && !(u[i + 1].cls & punct_not));
    if (!(u[j].cls & punct_not)) {
        while (j < n && !(u[j].cls & punct_not)) j++;
        while (j < n && (u[j].cls & TOK_C_NL)) j++;
        return j - i;
    }
    /* u[i] is whitespace.  \s*[\r\n]+ backtracks to end just after the run's last \r or \n. */
    for (end = i; end < n && (u[end].cls & TOK_C_WS); end++)
        if (u[end].cls & TOK_C_NL) nl = end + 1;
    if (nl) return nl - i;
    /* \s+(?!\S): before a non-space, give back one space (it prefixes the next word); a single
     * space there fails the lookahead and falls through to \s+. */
    if (end < n && end - i >= 2) return end - 1 - i;
    return end - i;
}

/* Heap order of candidate merges: lowest rank first, then leftmost (llama.cpp's order). */
static int tok_pair_less(const struct tok_pair *a, const struct tok_pair *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

/* Pushes the neighbour pair (left, right) if the vocabulary merges it; -1 means no symbol. */
static void tok_heap_push(const struct tok *t, struct tok_work *w, int32_t left, int32_t right)
{
    struct tok_pair p;
    size_t i;
    if (left < 0 || right < 0) return;
    p.left = left;
    p.id_left = w->sym[left].id;
    p.id_right = w->sym[right].id;
    p.rank = tok_merge_rank(t, p.id_left, p.id_right, &p.out);
    if (p.rank < 0) return;
    w->heap = tok_grow(w->heap, &w->heap_cap, w->heap_n + 1, sizeof *w->heap);
    for (i = w->heap_n++; i > 0 && tok_pair_less(&p, &w->heap[(i - 1) / 2]); i = (i - 1) / 2)
        w->heap[i] = w->heap[(i - 1) / 2];
    w->heap[i] = p;
}

/* Removes and returns the best pair; the heap must not be empty. */
static struct tok_pair tok_heap_pop(struct tok_work *w)
{
    struct tok_pair top = w->heap[0], last = w->heap[--w->heap_n];
    size_t i = 0, n = w->heap_n, c;
    while ((c = 2 * i + 1) < n) {
        if (c + 1 < n && tok_pair_less(&w->heap[c + 1], &w->heap[c])) c++;
        if (!tok_pair_less(&w->heap[c], &last)) break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    w->heap[i] = last;
    return top;
}

/* Byte-level BPE of one pre-token word s[0..len): one symbol per byte, then repeatedly merge the
 * neighbour pair of lowest rank (leftmost on ties).  A heap entry is stale once either symbol has
 * changed; it is then skipped.  O(len log len), so long words do not go quadratic. */
static void tok_bpe_word(const struct tok *t, const char *s, size_t len, struct tok_work *w)
{
    if (len > INT32_MAX) die("tokenizer: a %zu-byte word is too long", len);
    w->sym = tok_grow(w->sym, &w->sym_cap, len, sizeof *w->sym);
    for (size_t i = 0; i < len; i++) {
        w->sym[i].id = t->byte_id[(unsigned char)s[i]];
        w->sym[i].prev = (int32_t)i - 1;
        w->sym[i].next = i + 1 < len ? (int32_t)i + 1 : -1;
    }
    w->heap_n = 0;
    for (size_t i = 1; i < len; i++) tok_heap_push(t, w, (int32_t)i - 1, (int32_t)i);
    while (w->heap_n) {
        struct tok_pair p = tok_heap_pop(w);
        struct tok_sym *l = &w->sym[p.left];
        int32_t r = l->next;
        if (l->id != p.id_left || r < 0 || w->sym[r].id != p.id_right) continue;
        l->id = p.out;
        w->sym[r].id = -1;
        l->next = w->sym[r].next;
        if (l->next >= 0) w->sym[l->next].prev = p.left;
        tok_heap_push(t, w, l->prev, p.left);
        tok_heap_push(t, w, p.left, l->next);
    }
    for (int32_t i = len ? 0 : -1; i >= 0; i = w->sym[i].next) tok_emit(w, w->sym[i].id);
}

/* Pre-tokenizes s[0..len) (no special tokens in it) and BPE-encodes each word into w->ids. */
static void tok_encode_raw(const struct tok *t, const char *s, size_t len, struct tok_work *w)
{
    unsigned body = t->pre == TOK_PRE_QWEN35 ? TOK_C_L | TOK_C_M : TOK_C_L;
    size_t n = 0;
    w->unit = tok_grow(w->unit, &w->unit_cap, len + 1, sizeof *w->unit);
    for (size_t i = 0; i < len; n++) {
        uint32_t cp;
        size_t k = tok_utf8_get((const unsigned char *)s + i, len - i, &cp);
        w->unit[n].off = i;
        w->unit[n].cls = k ? tok_cp_class(cp) : 0;
        i += k ? k : 1;
    }
    w->unit[n].off = len;
    for (size_t i = 0, m; i < n; i += m) {
        m = tok_pre_match(w->unit, n, i, s, body);
        tok_bpe_word(t, s + w->unit[i].off, w->unit[i + m].off - w->unit[i].off, w);
    }
}

/* A piece of the input: a special token (id >= 0) or raw text for the pre-tokenizer (id -1). */
struct tok_frag { size_t off, len; int id; };

/* First occurrence of nd[0..m) (m >= 1) in hay[0..n), or NULL. */
static const char *tok_memmem(const char *hay, size_t n, const char *nd, size_t m)
{
    const char *last = hay + (n - m);
    if (m > n) return NULL;
    for (const char *p = hay; p <= last; p++) {
        p = memchr(p, nd[0], (size_t)(last - p) + 1);
        if (!p) return NULL;
        if (!memcmp(p, nd, m)) return p;
    }
    return NULL;
}

static void tok_frag_push(struct tok_frag **f, size_t *n, size_t *cap, size_t off, size_t len, int id)
{
    *f = tok_grow(*f, cap, *n + 1, sizeof **f);
    (*f)[(*n)++] = (struct tok_frag){off, len, id};
}

/* Cuts special-token texts out of text, as llama.cpp does: each special token in turn, longest
 * first, is cut out of every raw fragment left, leftmost occurrence first; so special tokens are
 * never split.  CONTROL/UNKNOWN tokens only if parse_special; USER_DEFINED ones (<think>,
 * <tool_call>) always, as Hugging Face does for added non-special tokens.  Returns the number
 * of fragments, in text order, in malloc'd *out. */
static size_t tok_split_special(const struct tok *t, const char *text, size_t len, int parse_special,
                                struct tok_frag **out)
{
    struct tok_frag *f = NULL, *g = NULL, *tmp;
    size_t n = 0, cap = 0, n2, cap2 = 0;
    if (len) tok_frag_push(&f, &n, &cap, 0, len, -1);
    for (int k = 0; k < t->n_special; k++) {
        int id = t->special[k];
        const char *st = t->text + t->text_off[id];
        size_t sl = t->text_off[id + 1] - t->text_off[id];
        if (!parse_special && t->type[id] != TOK_T_USER_DEFINED) continue;
        n2 = 0;
        for (size_t i = 0; i < n; i++) {
            size_t off = f[i].off, end = f[i].off + f[i].len;
            const char *p;
            if (f[i].id >= 0) { tok_frag_push(&g, &n2, &cap2, off, f[i].len, f[i].id); continue; }
            while ((p = tok_memmem(text + off, end - off, st, sl))) {
                size_t at = (size_t)(p - text);
                if (at > off) tok_frag_push(&g, &n2, &cap2, off, at - off, -1);
                tok_frag_push(&g, &n2, &cap2, at, sl, id);
                off = at + sl;
            }
            if (off < end) tok_frag_push(&g, &n2, &cap2, off, end - off, -1);
        }
        tmp = f; f = g; g = tmp;      /* the new list becomes current; the old one is reused */
        n = n2;
        n2 = cap; cap = cap2; cap2 = n2;  /* (n2 is free here: swap the capacities through it) */
    }
    free(g);
    *out = f;
    return n;
}

/* Encodes text[0..len) to token ids: special tokens (see tok_split_special), then the
 * pre-tokenizer and byte-level BPE on the rest.  No BOS is added.  Any bytes are accepted:
 * invalid UTF-8 is encoded byte by byte and decodes back to the same bytes.  Returns the
 * count; *ids_out is malloc'd (also when the count is 0) and the caller frees it. */
static int tok_encode(const struct tok *t, const char *text, size_t len, int parse_special, int **ids_out)
{
    struct tok_work w;
    struct tok_frag *f;
    size_t n;
    memset(&w, 0, sizeof w);
    n = tok_split_special(t, text, len, parse_special, &f);
    for (size_t i = 0; i < n; i++) {
        if (f[i].id >= 0) tok_emit(&w, f[i].id);
        else tok_encode_raw(t, text + f[i].off, f[i].len, &w);
    }
    free(f);
    free(w.unit);
    free(w.sym);
    free(w.heap);
    if (w.n_ids > INT32_MAX) die("tokenizer: text too long (%zu tokens)", w.n_ids);
    *ids_out = w.ids ? w.ids : plat_alloc(sizeof **ids_out);
    return (int)w.n_ids;
}

/* ---- decoding ---- */

/* Writes the bytes of token id to buf, at most cap of them (t->max_piece always suffices), and
 * returns the full count, like snprintf (buf may be NULL when cap is 0).  NORMAL tokens give their raw bytes (byte-level
 * decoded), CONTROL / USER_DEFINED / UNKNOWN tokens their text verbatim, UNUSED ("[PAD…]"),
 * BYTE and UNDEFINED tokens nothing, as in llama.cpp.  Dies on an id outside the vocabulary. */
static size_t tok_decode(const struct tok *t, int id, char *buf, size_t cap)
{
    const char *s;
    size_t len;
    if (id < 0 || id >= t->n_vocab) die("tokenizer: token id %d out of range", id);
    s = t->text + t->text_off[id];
    len = t->text_off[id + 1] - t->text_off[id];
    switch (t->type[id]) {
    case TOK_T_NORMAL:
        return (size_t)tok_unbyte(t, s, len, buf, cap);   /* validated at load: never -1 */
    case TOK_T_CONTROL: case TOK_T_USER_DEFINED: case TOK_T_UNKNOWN:
        if (cap) memcpy(buf, s, len < cap ? len : cap);
        return len;
    default:
        return 0;
    }
}

/* Streaming UTF-8 guard for printing decoded tokens: a character split across tokens (an emoji
 * is often 2-4 byte tokens) is held back until complete.  Zero-initialise it, push every decoded
 * piece, and flush at the end.  Invalid sequences are passed through verbatim, never dropped. */
struct tok_utf8_stream {
    unsigned char pend[4];   /* the incomplete character so far */
    int n_pend, need;        /* bytes held, bytes the lead byte announced */
};

/* Appends bytes[0..n) and writes to out everything that is complete (at most n + 3 bytes; cap
 * must be at least that).  Returns the number of bytes written. */
static size_t tok_stream_push(struct tok_utf8_stream *s, const char *bytes, size_t n, char *out, size_t cap)
{
    size_t o = 0;
    if (cap < n + 3) die("tok_stream_push: output buffer of %zu bytes is too small", cap);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)bytes[i];
        if (s->n_pend && (c & 0xC0) == 0x80) {
            s->pend[s->n_pend++] = c;
            if (s->n_pend < s->need) continue;
            memcpy(out + o, s->pend, (size_t)s->n_pend);
            o += (size_t)s->n_pend;
            s->n_pend = 0;
            continue;
        }
        /* Not a continuation: a held sequence is broken off; it goes out as it is. */
        memcpy(out + o, s->pend, (size_t)s->n_pend);
        o += (size_t)s->n_pend;
        s->n_pend = 0;
        if (c >= 0xC2 && c <= 0xF4) {
            s->pend[0] = c;
            s->n_pend = 1;
            s->need = c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
        } else {
            out[o++] = (char)c;
        }
    }
    return o;
}

/* Writes the held bytes of an unfinished character (at most 3) to out and resets the stream;
 * returns their count. */
static size_t tok_stream_flush(struct tok_utf8_stream *s, char *out)
{
    size_t n = (size_t)s->n_pend;
    memcpy(out, s->pend, n);
    s->n_pend = 0;
    return n;
}

/* ---- JSON values (RFC 8259, read strictly: no trailing commas, comments, NaN, lone
 * surrogates or invalid UTF-8). Chat messages and tools are JSON, for the server and the
 * template alike; objects keep their members in order and numbers their text. ---- */

#define JSON_MAX_DEPTH 64

/* A growing NUL-terminated string. */
struct tok_buf { char *p; size_t n, cap; };

static void tok_buf_put(struct tok_buf *b, const char *s, size_t len)
{
    b->p = tok_grow(b->p, &b->cap, b->n + len + 1, 1);
    memcpy(b->p + b->n, s, len);
    b->n += len;
    b->p[b->n] = 0;
}



enum json_kind { JSON_NULL, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT };

struct json {
    enum json_kind kind;
    int boolean;
    double number;
    char *str;                 /* STRING: the decoded UTF-8, NUL-terminated (may hold NULs);
                                * NUMBER: its text */
    size_t len;
    char *name;                /* a member of an object: its name, NUL-terminated */
    struct json *child;  /* ARRAY, OBJECT: the first element or member */
    struct json *next;   /* the next element or member of the parent */
};

struct json_parser {
    const unsigned char *p, *end;
    int depth;
    const char *error;         /* the first error, NULL while none */
};

static void json_free(struct json *v)
{
    while (v) {
        struct json *next = v->next;
        json_free(v->child);
        free(v->str);
        free(v->name);
        free(v);
        v = next;
    }
}

/* The length of the well-formed UTF-8 character at S (N bytes left): 1-4, or 0 if it is not
 * one (overlong forms, surrogates and code points past U+10FFFF are not). */
static int tok_utf8_len(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    if (c < 0x80) return 1;
    int len = c >= 0xF0 && c < 0xF5 ? 4 : c >= 0xE0 && c < 0xF0 ? 3 : c >= 0xC2 && c < 0xE0 ? 2 : 0;
    if (!len || (size_t)len > n) return 0;
    for (int k = 1; k < len; k++)
        if ((s[k] & 0xC0) != 0x80) return 0;
    if (len == 3 && ((c == 0xE0 && s[1] < 0xA0) || (c == 0xED && s[1] >= 0xA0))) return 0;
    if (len == 4 && ((c == 0xF0 && s[1] < 0x90) || (c == 0xF4 && s[1] >= 0x90))) return 0;
    return len;
}

/* S as a JSON string, appended to B, as Python's json.dumps(ensure_ascii=False) writes it:
 * the short escapes, \u00XX for the other control characters, everything else raw. Invalid
 * UTF-8 (never in text the reader decoded) becomes U+FFFD, so the output stays valid JSON. */
static void json_put_string(struct tok_buf *b, const char *s, size_t n)
{
    tok_buf_put(b, "\"", 1);
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        int len = tok_utf8_len((const unsigned char *)s + i, n - i);
        const char *short_form = c == '"' ? "\\\"" : c == '\\' ? "\\\\" : c == '\n' ? "\\n" : c == '\r' ? "\\r"
                               : c == '\t' ? "\\t" : c == '\b' ? "\\b" : c == '\f' ? "\\f" : NULL;
        char u[8];
        if (short_form) tok_buf_put(b, short_form, 2);
        else if (c < 0x20) tok_buf_put(b, u, (size_t)snprintf(u, sizeof u, "\\u%04x", c));
        else if (len) tok_buf_put(b, s + i, (size_t)len);
        else tok_buf_put(b, "\\ufffd", 6);
        i += len ? (size_t)len : 1;
    }
    tok_buf_put(b, "\"", 1);
}

static void json_write_string(FILE *f, const char *s, size_t n)
{
    struct tok_buf b = {NULL, 0, 0};
    json_put_string(&b, s, n);
    fwrite(b.p, 1, b.n, f);
    free(b.p);
}

static struct json *json_fail(struct json_parser *ps, const char *why)
{
    if (!ps->error) ps->error = why;
    return NULL;
}

static void json_skip_space(struct json_parser *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r')) ps->p++;
}

/* Four hex digits after \u; -1 if they are not. */
static long json_hex4(struct json_parser *ps)
{
    if (ps->end - ps->p < 4) return -1;
    long v = 0;
    for (int i = 0; i < 4; i++) {
        int c = ps->p[i], d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    ps->p += 4;
    return v;
}

/* An escape after the backslash, appended to B as UTF-8; 0, or -1 when malformed. */
static int json_escape(struct json_parser *ps, struct tok_buf *b)
{
    static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
    if (ps->p >= ps->end) return -1;
    const char *k = *ps->p ? strchr(from, *ps->p) : NULL;
    if (k) {
        tok_buf_put(b, &to[k - from], 1);
        ps->p++;
        return 0;
    }
    if (*ps->p++ != 'u') return -1;
    long cp = json_hex4(ps);
    if (cp >= 0xDC00 && cp <= 0xDFFF) return -1; /* a low surrogate alone */
    if (cp >= 0xD800 && cp <= 0xDBFF) {
        if (ps->end - ps->p < 2 || ps->p[0] != '\\' || ps->p[1] != 'u') return -1;
        ps->p += 2;
        long lo = json_hex4(ps);
        if (lo < 0xDC00 || lo > 0xDFFF) return -1;
        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    if (cp < 0) return -1;
    char u[4];
    int n = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
    if (n == 1) u[0] = (char)cp;
    else {
        for (int i = n - 1; i > 0; i--, cp >>= 6) u[i] = (char)(0x80 | (cp & 0x3F));
        u[0] = (char)((n == 2 ? 0xC0 : n == 3 ? 0xE0 : 0xF0) | cp);
    }
    tok_buf_put(b, u, (size_t)n);
    return 0;
}

/* A string at p (on its opening quote): the decoded bytes, or NULL on an error. */
static char *json_string(struct json_parser *ps, size_t *len)
{
    struct tok_buf b = {NULL, 0, 0};
    tok_buf_put(&b, "", 0);
    for (ps->p++;;) {
        if (ps->p >= ps->end) { json_fail(ps, "unterminated string"); break; }
        unsigned char c = *ps->p;
        int n = tok_utf8_len(ps->p, (size_t)(ps->end - ps->p));
        if (c == '"') {
            ps->p++;
            *len = b.n;
            return b.p;
        }
        if (c < 0x20) { json_fail(ps, "a control character in a string"); break; }
        if (c == '\\') {
            ps->p++;
            if (json_escape(ps, &b)) { json_fail(ps, "a bad escape in a string"); break; }
            continue;
        }
        if (!n) { json_fail(ps, "invalid UTF-8 in a string"); break; }
        tok_buf_put(&b, (const char *)ps->p, (size_t)n);
        ps->p += n;
    }
    free(b.p);
    return NULL;
}

/* A number by the JSON grammar, read with strtod; a number too large for a double is an error. */
static struct json *json_number(struct json_parser *ps, struct json *v)
{
    const unsigned char *s = ps->p, *q = s;
    if (q < ps->end && *q == '-') q++;
    if (q < ps->end && *q == '0') q++;
    else if (q < ps->end && *q >= '1' && *q <= '9') while (q < ps->end && isdigit(*q)) q++;
    else return json_fail(ps, "a bad number");
    if (q < ps->end && *q == '.') {
        if (++q >= ps->end || !isdigit(*q)) return json_fail(ps, "a bad number");
        while (q < ps->end && isdigit(*q)) q++;
    }
    if (q < ps->end && (*q == 'e' || *q == 'E')) {
        if (++q < ps->end && (*q == '+' || *q == '-')) q++;
        if (q >= ps->end || !isdigit(*q)) return json_fail(ps, "a bad number");
        while (q < ps->end && isdigit(*q)) q++;
    }
    char buf[400];
    if ((size_t)(q - s) >= sizeof buf) return json_fail(ps, "a number too long");
    memcpy(buf, s, (size_t)(q - s));
    buf[q - s] = 0;
    v->kind = JSON_NUMBER;
    v->number = strtod(buf, NULL);
    v->str = plat_strdup(buf); /* the text as sent: the template copies it (tojson) */
    v->len = (size_t)(q - s);
    if (!isfinite(v->number)) return json_fail(ps, "a number out of range");
    ps->p = q;
    return v;
}

static struct json *json_value(struct json_parser *ps);

/* The elements of an array or the members of an object (OBJECT), after the opening bracket. */
static struct json *json_items(struct json_parser *ps, struct json *v, int object)
{
    struct json **tail = &v->child;
    char close = object ? '}' : ']';
    json_skip_space(ps);
    if (ps->p < ps->end && *ps->p == close) { ps->p++; return v; }
    for (;;) {
        char *name = NULL;
        size_t name_len;
        json_skip_space(ps);
        if (object) {
            if (ps->p >= ps->end || *ps->p != '"') return json_fail(ps, "an object member without a name");
            if (!(name = json_string(ps, &name_len))) return NULL;
            json_skip_space(ps);
            if (ps->p >= ps->end || *ps->p++ != ':') { free(name); return json_fail(ps, "a member name without ':'"); }
        }
        struct json *item = json_value(ps);
        if (!item) { free(name); return NULL; }
        item->name = name;
        *tail = item;
        tail = &item->next;
        json_skip_space(ps);
        if (ps->p < ps->end && *ps->p == ',') { ps->p++; continue; }
        if (ps->p < ps->end && *ps->p == close) { ps->p++; return v; }
        return json_fail(ps, object ? "an object without ',' or '}'" : "an array without ',' or ']'");
    }
}

static struct json *json_value(struct json_parser *ps)
{
    json_skip_space(ps);
    if (ps->p >= ps->end) return json_fail(ps, "a value is missing");
    struct json *v = plat_zalloc(1, sizeof *v), *ok = v;
    unsigned char c = *ps->p;
    size_t left = (size_t)(ps->end - ps->p);
    if (c == '{' || c == '[') {
        v->kind = c == '{' ? JSON_OBJECT : JSON_ARRAY;
        ps->p++;
        if (++ps->depth > JSON_MAX_DEPTH) ok = json_fail(ps, "nested too deep");
        else ok = json_items(ps, v, c == '{');
        ps->depth--;
    } else if (c == '"') {
        v->kind = JSON_STRING;
        ok = (v->str = json_string(ps, &v->len)) ? v : NULL;
    } else if (left >= 4 && !memcmp(ps->p, "null", 4)) ps->p += 4;
    else if (left >= 4 && !memcmp(ps->p, "true", 4)) { v->kind = JSON_BOOL; v->boolean = 1; ps->p += 4; }
    else if (left >= 5 && !memcmp(ps->p, "false", 5)) { v->kind = JSON_BOOL; ps->p += 5; }
    else ok = json_number(ps, v);
    if (!ok) {
        json_free(v);
        return NULL;
    }
    return v;
}

/* The document TEXT[0..n): its root, or NULL with *ERROR saying why. */
static struct json *json_parse(const char *text, size_t n, const char **error)
{
    struct json_parser ps = {(const unsigned char *)text, (const unsigned char *)text + n, 0, NULL};
    struct json *v = json_value(&ps);
    json_skip_space(&ps);
    if (v && ps.p != ps.end) {
        json_free(v);
        v = json_fail(&ps, "text after the value");
    }
    *error = ps.error;
    return v;
}

/* The member NAME of object V, or NULL (also when V is not an object). */
static const struct json *json_get(const struct json *v, const char *name)
{
    if (!v || v->kind != JSON_OBJECT) return NULL;
    for (const struct json *m = v->child; m; m = m->next)
        if (!strcmp(m->name, name)) return m;
    return NULL;
}

/* ---- chat template ---- */

static void tok_buf_puts(struct tok_buf *b, const char *s) { tok_buf_put(b, s, strlen(s)); }

/* Python's str.isspace() of code point CP: what Jinja's |trim strips (Unicode White_Space and
 * the four separators U+001C..U+001F; not U+200B). */
static int tok_py_space(uint32_t cp)
{
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

/* The code point of the well-formed UTF-8 character at S, LEN its bytes. */
static uint32_t tok_utf8_cp(const unsigned char *s, int len)
{
    uint32_t cp = len == 1 ? s[0] : s[0] & (0x7F >> len);
    for (int k = 1; k < len; k++) cp = cp << 6 | (s[k] & 0x3F);
    return cp;
}

/* |trim: B[*from..*to) without its leading and trailing whitespace (B is valid UTF-8). */
static void tok_py_trim(const char *b, size_t *from, size_t *to)
{
    const unsigned char *s = (const unsigned char *)b;
    while (*from < *to) {
        int len = tok_utf8_len(s + *from, *to - *from);
        if (!len || !tok_py_space(tok_utf8_cp(s + *from, len))) break;
        *from += (size_t)len;
    }
    while (*to > *from) {
        size_t start = *to - 1;
        while (start > *from && (s[start] & 0xC0) == 0x80) start--;
        int len = tok_utf8_len(s + start, *to - start);
        if (!len || !tok_py_space(tok_utf8_cp(s + start, len))) break;
        *to = start;
    }
}

/* A rendering in progress: the text, and the first refusal. */
struct tok_render {
    enum tok_template kind;
    struct tok_buf out;
    const char *error;
    int n_media;
};

static int tok_render_fail(struct tok_render *r, const char *why)
{
    if (!r->error) r->error = why;
    return -1;
}

/* V as Python's json.dumps(v, ensure_ascii=False) writes it (the template's |tojson):
 * ", " and ": " between items, numbers as sent, non-ASCII characters raw. */
static void tok_json_dump(struct tok_buf *b, const struct json *v)
{
    if (v->kind == JSON_NULL) tok_buf_puts(b, "null");
    else if (v->kind == JSON_BOOL) tok_buf_puts(b, v->boolean ? "true" : "false");
    else if (v->kind == JSON_NUMBER) tok_buf_put(b, v->str, v->len);
    else if (v->kind == JSON_STRING) json_put_string(b, v->str, v->len);
    else {
        int object = v->kind == JSON_OBJECT;
        tok_buf_puts(b, object ? "{" : "[");
        for (const struct json *m = v->child; m; m = m->next) {
            if (m != v->child) tok_buf_puts(b, ", ");
            if (object) {
                json_put_string(b, m->name, strlen(m->name));
                tok_buf_puts(b, ": ");
            }
            tok_json_dump(b, m);
        }
        tok_buf_puts(b, object ? "}" : "]");
    }
}

/* V as Jinja prints it (Python's str()) where V is a string or a scalar. */
static void tok_json_print(struct tok_buf *b, const struct json *v)
{
    if (v->kind == JSON_STRING) tok_buf_put(b, v->str, v->len);
    else if (v->kind == JSON_NULL) tok_buf_puts(b, "None");
    else if (v->kind == JSON_BOOL) tok_buf_puts(b, v->boolean ? "True" : "False");
    else tok_json_dump(b, v);
}

/* Jinja's `KEY in V`: a member of an object, a substring of a string, an element of a list. */
static int tok_json_in(const struct json *v, const char *key)
{
    if (v->kind == JSON_OBJECT) return json_get(v, key) != NULL;
    if (v->kind == JSON_STRING) return memmem(v->str, v->len, key, strlen(key)) != NULL;
    for (const struct json *e = v->kind == JSON_ARRAY ? v->child : NULL; e; e = e->next)
        if (e->kind == JSON_STRING && e->len == strlen(key) && !memcmp(e->str, key, e->len)) return 1;
    return 0;
}

static int tok_json_is(const struct json *v, const char *s)
{
    return v && v->kind == JSON_STRING && v->len == strlen(s) && !memcmp(v->str, s, v->len);
}

static int tok_role_is(const struct json *m, const char *role) { return tok_json_is(json_get(m, "role"), role); }

/* render_content(): a message's CONTENT (NULL: absent) as text into B. A part's text that is
 * not a string or a scalar (Python would print its repr) is refused. */
static int tok_render_content(struct tok_render *r, const struct json *c, int is_system, struct tok_buf *b)
{
    tok_buf_put(b, "", 0);
    if (!c || c->kind == JSON_NULL) return 0;
    if (c->kind == JSON_STRING) {
        tok_buf_put(b, c->str, c->len);
        return 0;
    }
    if (c->kind != JSON_ARRAY) return tok_render_fail(r, "Unexpected content type.");
    for (const struct json *item = c->child; item; item = item->next) {
        if (item->kind == JSON_NULL || item->kind == JSON_BOOL || item->kind == JSON_NUMBER)
            return tok_render_fail(r, "Unexpected item type in content.");
        int image = tok_json_in(item, "image") || tok_json_in(item, "image_url") || tok_json_is(json_get(item, "type"), "image");
        int video = !image && (tok_json_in(item, "video") || tok_json_is(json_get(item, "type"), "video"));
        const struct json *text = json_get(item, "text");
        if ((image || video) && is_system) return tok_render_fail(r, image ? "System message cannot contain images." : "System message cannot contain videos.");
        if (image || video) {
            tok_buf_puts(b, image ? "<|vision_start|><|image_pad|><|vision_end|>" : "<|vision_start|><|video_pad|><|vision_end|>");
            r->n_media++;
        } else if (!tok_json_in(item, "text")) return tok_render_fail(r, "Unexpected item type in content.");
        else if (text && (text->kind == JSON_ARRAY || text->kind == JSON_OBJECT)) return tok_render_fail(r, "a content part's text must be a string");
        else if (text) tok_json_print(b, text);
    }
    return 0;
}

/* render_content(message.content)|trim into B: B->p + *from .. B->n is the trimmed text. */
static int tok_render_trimmed(struct tok_render *r, const struct json *m, int is_system, struct tok_buf *b, size_t *from)
{
    b->n = 0;
    *from = 0;
    if (tok_render_content(r, json_get(m, "content"), is_system, b)) return -1;
    tok_py_trim(b->p, from, &b->n);
    b->p[b->n] = 0;
    return 0;
}

/* The system turn: the tools block, when there are tools, then the system message's text. */
static int tok_render_system(struct tok_render *r, const struct json *first, const struct json *tools)
{
    struct tok_buf c = {NULL, 0, 0};
    size_t from = 0;
    int has_system = tok_role_is(first, "system"), tools_on = tools && tools->kind == JSON_ARRAY && tools->child;
    if (has_system && tok_render_trimmed(r, first, 1, &c, &from)) { free(c.p); return -1; }
    if (tools_on) {
        tok_buf_puts(&r->out, "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>");
        for (const struct json *t = tools->child; t; t = t->next) {
            tok_buf_puts(&r->out, "\n");
            tok_json_dump(&r->out, t);
        }
        tok_buf_puts(&r->out,
                     "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
                     "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
                     "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
                     "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
                     "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
                     "within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
                     "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
                     "but NOT after\n- If there is no function call available, answer the question like normal with your current "
                     "knowledge and do not tell the user about function calls\n</IMPORTANT>");
        if (c.n > from) {
            tok_buf_puts(&r->out, "\n\n");
            tok_buf_put(&r->out, c.p + from, c.n - from);
        }
        tok_buf_puts(&r->out, "<|im_end|>\n");
    } else if (has_system) {
        tok_buf_puts(&r->out, "<|im_start|>system\n");
        tok_buf_put(&r->out, c.p + from, c.n - from);
        tok_buf_puts(&r->out, "<|im_end|>\n");
    }
    free(c.p);
    return 0;
}

/* The index of the last user message that is a query (not a wrapped tool response), or -1. */
static int tok_render_last_query(struct tok_render *r, const struct json *const *msgs, int n)
{
    struct tok_buf c = {NULL, 0, 0};
    int found = -1;
    for (int i = n - 1; i >= 0 && found < 0 && !r->error; i--) {
        size_t from;
        if (!tok_role_is(msgs[i], "user") || tok_render_trimmed(r, msgs[i], 0, &c, &from)) continue;
        const char *t = c.p + from;
        size_t len = c.n - from;
        int wrapped = len >= 16 && !strncmp(t, "<tool_response>", 15) && !memcmp(t + len - 16, "</tool_response>", 16);
        if (!wrapped) found = i;
    }
    free(c.p);
    return found;
}

/* One tool call of an assistant turn: <tool_call><function=NAME> and its parameters. Arguments
 * may be an object or, as OpenAI clients send them, a JSON string holding one. */
static int tok_render_tool_call(struct tok_render *r, const struct json *call, int first, int content_empty)
{
    const struct json *f = json_get(call, "function") ? json_get(call, "function") : call, *name = json_get(f, "name");
    if (!name || name->kind != JSON_STRING) return tok_render_fail(r, "a tool call needs a function name");
    tok_buf_puts(&r->out, first ? (content_empty ? "" : "\n\n") : "\n");
    tok_buf_puts(&r->out, "<tool_call>\n<function=");
    tok_buf_put(&r->out, name->str, name->len);
    tok_buf_puts(&r->out, ">\n");
    const struct json *args = json_get(f, "arguments");
    struct json *parsed = NULL;
    if (args && args->kind == JSON_STRING) {
        const char *why;
        if (!(args = parsed = json_parse(args->str, args->len, &why))) return tok_render_fail(r, "a tool call's arguments string is not JSON");
    }
    if (args && args->kind != JSON_OBJECT) {
        json_free(parsed);
        return tok_render_fail(r, "a tool call's arguments must be an object, or a JSON string holding one");
    }
    for (const struct json *a = args ? args->child : NULL; a; a = a->next) {
        tok_buf_puts(&r->out, "<parameter=");
        tok_buf_puts(&r->out, a->name);
        tok_buf_puts(&r->out, ">\n");
        if (a->kind == JSON_STRING || (r->kind == TOK_TEMPLATE_QWEN35 && a->kind != JSON_OBJECT && a->kind != JSON_ARRAY))
            tok_json_print(&r->out, a);
        else tok_json_dump(&r->out, a);
        tok_buf_puts(&r->out, "\n</parameter>\n");
    }
    json_free(parsed);
    tok_buf_puts(&r->out, "</function>\n</tool_call>");
    return 0;
}

/* An assistant turn whose trimmed content is C[from..n): its thinking split from the content
 * as the template does, shown when SHOW_THINK, then its tool calls. */
static int tok_render_assistant(struct tok_render *r, const struct json *m, struct tok_buf *c, size_t from, int show_think)
{
    const char *content = c->p + from, *reasoning = "", *close = strstr(content, "</think>");
    size_t reasoning_len = 0, rfrom = 0;
    const struct json *rc = json_get(m, "reasoning_content");
    if (rc && rc->kind == JSON_STRING) {
        reasoning = rc->str;
        reasoning_len = rc->len;
    } else if (close) {
        const char *end = close, *open;
        while (end > content && end[-1] == '\n') end--;
        for (reasoning = content; (open = memmem(reasoning, (size_t)(end - reasoning), "<think>", 7)); reasoning = open + 7) {}
        while (reasoning < end && *reasoning == '\n') reasoning++;
        reasoning_len = (size_t)(end - reasoning);
        for (const char *next; (next = strstr(close + 8, "</think>")); close = next) {}
        for (content = close + 8; *content == '\n'; content++) {}
    }
    tok_py_trim(reasoning, &rfrom, &reasoning_len);
    tok_buf_puts(&r->out, "<|im_start|>assistant\n");
    if (show_think) {
        tok_buf_puts(&r->out, "<think>\n");
        tok_buf_put(&r->out, reasoning + rfrom, reasoning_len - rfrom);
        tok_buf_puts(&r->out, "\n</think>\n\n");
    }
    size_t cfrom = 0, clen = (size_t)(c->p + c->n - content);
    tok_buf_put(&r->out, content, clen);
    tok_py_trim(content, &cfrom, &clen);
    const struct json *calls = json_get(m, "tool_calls");
    if (calls && calls->kind == JSON_STRING && calls->len) return tok_render_fail(r, "'tool_calls' must be a list");
    int k = 0;
    for (const struct json *call = calls && calls->kind == JSON_ARRAY ? calls->child : NULL; call; call = call->next, k++)
        if (tok_render_tool_call(r, call, k == 0, clen == cfrom)) return -1;
    tok_buf_puts(&r->out, "<|im_end|>\n");
    return 0;
}

/* A tool result: consecutive ones share one user turn. */
static void tok_render_tool(struct tok_render *r, const struct json *const *msgs, int n, int i, const char *content)
{
    if (i > 0 && !tok_role_is(msgs[i - 1], "tool")) tok_buf_puts(&r->out, "<|im_start|>user");
    tok_buf_puts(&r->out, "\n<tool_response>\n");
    tok_buf_puts(&r->out, content);
    tok_buf_puts(&r->out, "\n</tool_response>");
    if (i == n - 1 || !tok_role_is(msgs[i + 1], "tool")) tok_buf_puts(&r->out, "<|im_end|>\n");
}

/* How a conversation is rendered: the template's flags (-1: not passed). */
struct tok_chat_flags { int add_generation_prompt, enable_thinking, preserve_thinking; };

/* The turns, in order, after the system turn. */
static int tok_render_turns(struct tok_render *r, const struct json *const *msgs, int n, int last_query, const struct tok_chat_flags *f)
{
    struct tok_buf c = {NULL, 0, 0};
    for (int i = 0; i < n && !r->error; i++) {
        const struct json *m = msgs[i];
        size_t from;
        if (tok_render_trimmed(r, m, 0, &c, &from)) break;
        if (tok_role_is(m, "system")) {
            if (i > 0) tok_render_fail(r, "System message must be at the beginning.");
        } else if (tok_role_is(m, "user")) {
            tok_buf_puts(&r->out, "<|im_start|>user\n");
            tok_buf_put(&r->out, c.p + from, c.n - from);
            tok_buf_puts(&r->out, "<|im_end|>\n");
        } else if (tok_role_is(m, "assistant")) {
            int preserve = r->kind == TOK_TEMPLATE_QWEN36 && f->preserve_thinking == 1;
            tok_render_assistant(r, m, &c, from, preserve || i > last_query);
        } else if (tok_role_is(m, "tool")) tok_render_tool(r, msgs, n, i, c.p + from);
        else tok_render_fail(r, "Unexpected message role.");
    }
    free(c.p);
    return r->error ? -1 : 0;
}

/* What a rendering gave besides its text. */
struct tok_chat_rendered {
    size_t len;        /* bytes of the text (it may hold NULs from the messages) */
    const char *error; /* the template's refusal; NULL when rendered */
    int n_media;       /* image and video parts rendered as their placeholders */
};

/* Renders MESSAGES (a JSON list) and TOOLS (a list, or NULL) as template KIND does, byte for
 * byte. Returns the malloc'd prompt, or NULL when the template refuses (OUT->error says why). */
static char *tok_chat_template_render(enum tok_template kind, const struct json *messages, const struct json *tools,
                                      const struct tok_chat_flags *f, struct tok_chat_rendered *out)
{
    struct tok_render r = {kind, {NULL, 0, 0}, NULL, 0};
    int n = 0;
    for (const struct json *m = messages && messages->kind == JSON_ARRAY ? messages->child : NULL; m; m = m->next) n++;
    const struct json **msgs = plat_zalloc(n ? (size_t)n : 1, sizeof *msgs);
    n = 0;
    for (const struct json *m = messages && messages->kind == JSON_ARRAY ? messages->child : NULL; m; m = m->next) msgs[n++] = m;
    tok_buf_put(&r.out, "", 0);
    if (!n) tok_render_fail(&r, "No messages provided.");
    else if (!tok_render_system(&r, msgs[0], tools)) {
        int last_query = tok_render_last_query(&r, msgs, n);
        if (last_query < 0) tok_render_fail(&r, "No user query found in messages.");
        else if (!tok_render_turns(&r, msgs, n, last_query, f) && f->add_generation_prompt)
            tok_buf_puts(&r.out, f->enable_thinking == 0 ? "<|im_start|>assistant\n<think>\n\n</think>\n\n" : "<|im_start|>assistant\n<think>\n");
    }
    free(msgs);
    *out = (struct tok_chat_rendered){r.out.n, r.error, r.n_media};
    if (r.error) {
        free(r.out.p);
        return NULL;
    }
    return r.out.p;
}

/* The prompt of a conversation of plain text: SYSTEM (NULL: none), USER, then the generation
 * prompt, thinking or not: what `run --chat` and each turn of `chat` feed. */
static char *tok_chat_render_turn(const struct tok *t, const char *system, const char *user, int think)
{
    struct json user_content = {.kind = JSON_STRING, .str = (char *)user, .len = strlen(user), .name = (char *)"content"};
    struct json user_role = {.kind = JSON_STRING, .str = (char *)"user", .len = 4, .name = (char *)"role", .next = &user_content};
    struct json user_msg = {.kind = JSON_OBJECT, .child = &user_role};
    struct json system_content = {.kind = JSON_STRING, .str = (char *)system, .len = system ? strlen(system) : 0, .name = (char *)"content"};
    struct json system_role = {.kind = JSON_STRING, .str = (char *)"system", .len = 6, .name = (char *)"role", .next = &system_content};
    struct json system_msg = {.kind = JSON_OBJECT, .child = &system_role, .next = &user_msg};
    struct json list = {.kind = JSON_ARRAY, .child = system ? &system_msg : &user_msg};
    struct tok_chat_flags f = {1, think ? -1 : 0, -1};
    struct tok_chat_rendered out;
    char *text = tok_chat_template_render(t->chat_template, &list, NULL, &f, &out);
    if (!text) die("the chat template refused the conversation: %s", out.error);
    return text;
}

/* ==== §10 sample ==== */
/* Owns: turning a row of logits into the next token: greedy, or repetition penalty,
 *   temperature, top-k, top-p, min-p and a seeded draw.
 * Promises: greedy (temp 0) is the argmax over all logits, the lowest id on ties, nothing
 *   masked. With the same seed and logits, the same token, at every SIMD level and under every
 *   libc (the draw's weights are ops_exp's). The logits row may be modified.
 * May call: §1, §4 (ops_exp_shifted_one, ops_exp_shifted).
 * Workload: once per generated token over n_vocab logits (248k for the 35B): the argmax, then
 *   the top-k in one pass against the K-th best so far (sample_top), or the weights of every
 *   logit in vector lanes; only the kept candidates are sorted. */

struct sample_params {
    float temp;           /* 0: greedy */
    int top_k;            /* 0: all */
    float top_p;          /* 1: off */
    float min_p;          /* 0: off */
    float repeat_penalty; /* 1: off */
    int repeat_last_n;    /* how many recent tokens the penalties look at */
    uint64_t seed;
    float presence_penalty, frequency_penalty; /* 0: off; subtracted once per token seen, and per time seen */
};

struct sample_candidate {
    int id;
    float logit;
};

/* splitmix64: small, fast, and the same stream on every platform. */
static uint64_t sample_next_u64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The first index of the largest logit. A NaN never wins, but for one at 0: nothing is greater
 * than the value the loop starts from. The best value is held in a variable: compared through
 * logits[best], the loop took 1.03 ms on a 248k vocabulary, 5% of a 10-layer slice's decode
 * token; 0.17 ms so, and 0.03 ms with AVX-512 (sample_argmax_avx512). */
static int sample_argmax_scalar(const float *logits, int from, int n, int best)
{
    float top = logits[best];
    for (int i = from; i < n; i++)
        if (logits[i] > top) top = logits[i], best = i;
    return best;
}

/* The index of the best of LANES lane values (value LANES[l] first seen at WHERE[l]): the
 * largest value, the lowest index among equals (all -inf: index 0). */
static int sample_best_lane(const float *value, const int32_t *where, int lanes)
{
    int first = 0;
    for (int l = 1; l < lanes; l++)
        if (value[l] > value[first] || (value[l] == value[first] && where[l] < where[first])) first = l;
    return where[first];
}

/* 16 lanes, lane l the first best of logits l, l + 16, ...: from -inf up by "greater", so a
 * NaN never enters (the caller keeps a NaN at 0 for the scalar loop); then the best lane
 * (sample_best_lane), and the tail. */
__attribute__((target("avx512f"))) static int sample_argmax_avx512(const float *logits, int n)
{
    const int body = n / 16 * 16;
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i at = _mm512_setzero_si512(), index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int i = 0; i < body; i += 16, index = _mm512_add_epi32(index, _mm512_set1_epi32(16))) {
        const __m512 v = _mm512_loadu_ps(logits + i);
        const __mmask16 up = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, up, v);
        at = _mm512_mask_mov_epi32(at, up, index);
    }
    float lanes[16];
    int32_t where[16];
    _mm512_storeu_ps(lanes, best);
    _mm512_storeu_si512(where, at);
    return sample_argmax_scalar(logits, body, n, sample_best_lane(lanes, where, 16));
}

/* sample_argmax_avx512 in 8 lanes (0.2 -> ~0.05 ms over 248k logits on a Zen 1 EPYC). */
__attribute__((target("avx2"))) static int sample_argmax_avx2(const float *logits, int n)
{
    const int body = n / 8 * 8;
    __m256 best = _mm256_set1_ps(-INFINITY);
    __m256i at = _mm256_setzero_si256(), index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int i = 0; i < body; i += 8, index = _mm256_add_epi32(index, _mm256_set1_epi32(8))) {
        const __m256 v = _mm256_loadu_ps(logits + i), up = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
        best = _mm256_blendv_ps(best, v, up);
        at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(index), up));
    }
    float lanes[8];
    int32_t where[8];
    _mm256_storeu_ps(lanes, best);
    _mm256_storeu_si256((__m256i *)where, at);
    return sample_argmax_scalar(logits, body, n, sample_best_lane(lanes, where, 8));
}

static int sample_argmax(const float *logits, int n)
{
    if (plat_cpu.avx512f && logits[0] == logits[0]) return sample_argmax_avx512(logits, n);
    if (plat_cpu.avx2 && logits[0] == logits[0]) return sample_argmax_avx2(logits, n);
    return sample_argmax_scalar(logits, 1, n, 0);
}

/* Whether no logit is NaN or infinite: every exponent field below all-ones, 16 at a time. */
__attribute__((target("avx512f"))) static int sample_all_finite_avx512(const float *logits, int n)
{
    const __m512i exponent = _mm512_set1_epi32(0x7f800000);
    __mmask16 bad = 0;
    int i = 0;
    for (; i + 16 <= n; i += 16)
        bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_loadu_si512(logits + i), exponent), exponent);
    for (; i < n; i++) bad |= !isfinite(logits[i]);
    return !bad;
}

/* sample_all_finite_avx512 in 8 lanes. */
__attribute__((target("avx2"))) static int sample_all_finite_avx2(const float *logits, int n)
{
    const __m256i exponent = _mm256_set1_epi32(0x7f800000);
    __m256i bad = _mm256_setzero_si256();
    int i = 0;
    for (; i + 8 <= n; i += 8)
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(logits + i)), exponent), exponent));
    int any = !_mm256_testz_si256(bad, bad);
    for (; i < n; i++) any |= !isfinite(logits[i]);
    return !any;
}

static int sample_all_finite(const float *logits, int n)
{
    if (plat_cpu.avx512f) return sample_all_finite_avx512(logits, n);
    if (plat_cpu.avx2) return sample_all_finite_avx2(logits, n);
    for (int i = 0; i < n; i++)
        if (!isfinite(logits[i])) return 0;
    return 1;
}

/* Whether candidate A comes before B: the larger logit (or weight) first, the lower id on a tie.
 * A strict total order, so the K best are one set, in one order, however they are found. */
static int sample_before(const struct sample_candidate *a, const struct sample_candidate *b)
{
    return a->logit > b->logit || (a->logit == b->logit && a->id < b->id);
}

static int sample_by_logit_desc(const void *a, const void *b)
{
    return sample_before(a, b) ? -1 : sample_before(b, a);
}

/* Penalises tokens seen in the last repeat_last_n of HISTORY: the CTRL rule (divide a positive
 * logit by repeat_penalty, multiply a negative one), then the presence and frequency penalties. */
static void sample_apply_penalty(const struct sample_params *p, float *logits, const int *history, int n_hist)
{
    if (p->repeat_penalty == 1.0f && p->presence_penalty == 0.0f && p->frequency_penalty == 0.0f) return;
    int from = n_hist > p->repeat_last_n ? n_hist - p->repeat_last_n : 0;
    for (int i = from; i < n_hist; i++) {
        float *l = &logits[history[i]];
        int seen = 0, count = 1;
        for (int j = from; j < i; j++) seen |= history[j] == history[i];
        if (seen) continue;
        for (int j = i + 1; j < n_hist; j++) count += history[j] == history[i];
        *l = *l > 0 ? *l / p->repeat_penalty : *l * p->repeat_penalty;
        *l -= p->presence_penalty + p->frequency_penalty * (float)count; /* as the OpenAI API defines them */
    }
}

/* Moves the K first of cand[0..n) (sample_before) to cand[0..K), in no particular order, by
 * quickselect; expected O(n). */
static void sample_select(struct sample_candidate *cand, int n, int k)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const struct sample_candidate pivot = cand[(lo + hi) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (sample_before(&cand[i], &pivot)) i++;
            while (sample_before(&pivot, &cand[j])) j--;
            if (i <= j) {
                struct sample_candidate t = cand[i];
                cand[i++] = cand[j];
                cand[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

/* The K (1..n) first of the candidates (i, W[i]), i < N, into cand[0..K) in order. One pass
 * compares each value with the K-th so far and inserts the few that beat it (a later id loses a
 * tie): 0.1 ms over 248k logits, where a quickselect over all of them took 3.6 ms (Zen 1). Large
 * K, or values that keep beating it (a rising row), take the quickselect and a sort instead:
 * the same candidates in the same order. */
static void sample_top(const float *w, int n, int k, struct sample_candidate *cand)
{
    const int scan = k <= 256;
    int have = 0, inserts = 0, i = 0;
    for (; scan && i < n; i++) {
        if (have == k && !(w[i] > cand[k - 1].logit)) continue;
        if (++inserts > 8 * k + 1024) break;
        int at = have < k ? have++ : k - 1;
        for (; at > 0 && w[i] > cand[at - 1].logit; at--) cand[at] = cand[at - 1];
        cand[at] = (struct sample_candidate){i, w[i]};
    }
    if (scan && i == n) return;
    for (i = 0; i < n; i++) cand[i] = (struct sample_candidate){i, w[i]};
    sample_select(cand, n, k);
    qsort(cand, (size_t)k, sizeof *cand, sample_by_logit_desc);
}

/* How many of cand[0..n) (weights, best first) top-p and min-p keep; N where the cut is not
 * among them. TOTAL is the sum of every weight. */
static int sample_nucleus_cut(const struct sample_params *p, const struct sample_candidate *cand, int n, double total)
{
    double mass = 0.0;
    for (int keep = 0; keep < n; keep++) {
        if (cand[keep].logit < p->min_p * cand[0].logit) return keep;
        mass += cand[keep].logit;
        if (mass >= p->top_p * total) return keep + 1;
    }
    return n;
}

/* The candidates top-p and min-p keep of the N weights W (TOTAL their sum), best first into
 * CAND; returns how many. Orders only a prefix that grows until the cut is inside it: the cut
 * is usually among the first few dozen of 248k tokens. */
static int sample_nucleus(const struct sample_params *p, const float *w, int n, double total, struct sample_candidate *cand)
{
    for (int size = n < 64 ? n : 64;; size = size * 4 < n ? size * 4 : n) {
        sample_top(w, n, size, cand);
        const int keep = sample_nucleus_cut(p, cand, size, total);
        if (keep < size || size == n) return keep;
    }
}

/* A uniform draw in [0, TOTAL), from the caller's splitmix64 state. */
static double sample_uniform(uint64_t *rng, double total)
{
    return (double)(sample_next_u64(rng) >> 11) * (1.0 / 9007199254740992.0) * total;
}

/* The next token. HISTORY (the tokens so far) feeds the repetition penalty; RNG is the
 * caller's splitmix64 state, seeded from p->seed. CAND is scratch of n_vocab entries; LOGITS
 * are left changed. The draw walks the candidates best first (sample_before), or with neither
 * top-k nor a nucleus every token in id order, each weighted by ops_exp((logit - max) / temp). */
static int sample_next(const struct sample_params *p, float *logits, int n_vocab, const int *history, int n_hist,
                       uint64_t *rng, struct sample_candidate *cand)
{
    sample_apply_penalty(p, logits, history, n_hist);
    if (p->temp <= 0.0f) return sample_argmax(logits, n_vocab);
    const float max = logits[sample_argmax(logits, n_vocab)];
    const int nucleus = p->top_p < 1.0f || p->min_p > 0.0f;
    double total = 0.0;
    int n;
    if (p->top_k > 0 && p->top_k < n_vocab) {
        n = p->top_k;
        sample_top(logits, n_vocab, n, cand);
        for (int i = 0; i < n; i++) total += cand[i].logit = ops_exp_shifted_one(cand[i].logit, max, p->temp);
        if (nucleus) n = sample_nucleus_cut(p, cand, n, total);
    } else {
        ops_exp_shifted(logits, logits, n_vocab, max, p->temp); /* the weights, in place */
        for (int i = 0; i < n_vocab; i++) total += logits[i];
        if (!nucleus) {
            double r = sample_uniform(rng, total);
            for (int i = 0; i < n_vocab; i++)
                if ((r -= logits[i]) < 0) return i;
            return n_vocab - 1;
        }
        n = sample_nucleus(p, logits, n_vocab, total, cand);
    }
    if (nucleus) {
        total = 0.0;
        for (int i = 0; i < n; i++) total += cand[i].logit;
    }
    double r = sample_uniform(rng, total);
    for (int i = 0; i < n; i++)
        if ((r -= cand[i].logit) < 0) return cand[i].id;
    return cand[n - 1].id;
}

/* ==== §11 engine ==== */
/* Owns: generation. Slots, each a sequence (§8) with the request it is serving: its prompt is
 *   fed, then tokens are sampled and fed one per step until a stop; one step runs the tokens of
 *   every busy slot through the model as one batch. What a generation produced (engine_gen).
 *   The prompt cache: what each slot's sequence holds (its tokens, checkpoints of its DeltaNet
 *   state) and conversations parked in RAM, within a budget; a request goes where most of its
 *   prompt is already computed.
 * Promises: nothing here prints, reads a process-wide flag or dies: a forward pass that fails
 *   ends the generations of its batch with ENGINE_STOP_ERROR and the reason, and resets their
 *   sequences; the other slots go on. A slot's tokens do not depend on the slots beside it in
 *   a batch (§8's promise), so greedy output is the same alone or in parallel; nor on what was
 *   reused: resuming from a checkpoint or a parked conversation gives the logits of the whole
 *   prompt computed from nothing, bit for bit. Runs on one thread (the one that loaded the
 *   model); a sink is called there.
 * May call: §1–§10.
 * Workload: one engine_step per generated token of the busy slots: their decode tokens first,
 *   then prompt chunks, MODEL_BATCH tokens at most (ENGINE_STEP_BESIDE_DECODE in all where some
 *   slot decodes); sampling is one pass over n_vocab per
 *   token. Admitting a request compares its prompt with each idle slot's and parked
 *   conversation's tokens; parking copies a conversation's KV rows (40 KiB a token on the
 *   35B-A3B) and its state. */

enum engine_stop { ENGINE_RUNNING, ENGINE_STOP_EOG, ENGINE_STOP_LENGTH, ENGINE_STOP_CONTEXT, ENGINE_STOP_CANCEL, ENGINE_STOP_SINK, ENGINE_STOP_ERROR };
static const char *const engine_stop_names[] = {"running", "eog", "length", "context", "interrupt", "stop", "error"};

/* What a caller asks of a slot. The arrays must outlive the generation. */
struct engine_request {
    const int *prompt;       /* [n_prompt]: fed after what the slot's sequence holds, or (WHOLE) all of it */
    int n_prompt;
    int whole;               /* the prompt is the sequence from position 0: what the slot holds of it is reused */
    int reuse;               /* WHOLE: may reuse (0: computed from nothing, for comparison) */
    int mark[2];             /* WHOLE: prompt positions to keep checkpoints at, ascending (0: none); the
                              * server marks where the first turn after the system turn opens (a
                              * prefix other conversations share) and where the answer's turn opens
                              * (the next turn of this one departs there) */
    int n_max;               /* tokens to generate at most */
    struct sample_params sample;
    int ignore_eog, want_top; /* want_top: record the five best logits of every position */
    /* Called on the engine's thread with each generated token and its text (the bytes of the
     * token, maybe part of a UTF-8 character); nonzero stops the generation (ENGINE_STOP_SINK). */
    int (*sink)(void *ctx, int id, const char *piece, size_t len);
    void *sink_ctx;
    const volatile sig_atomic_t *cancel; /* nonzero: stop at the next token; NULL: never */
    struct model_checkpoint *rewind; /* with cancel while the prompt is fed: the sequence is rewound */
};

/* What one generation produced; arrays grow with the tokens. */
struct engine_gen {
    int *tokens;
    int n_tokens, n_prompt;
    int n_cached;        /* prompt tokens the slot already held: reused, not computed */
    float (*top)[5][2];  /* [n_tokens][5] (id, logit) of the position that chose each token */
    char *text;
    size_t text_len, text_cap;
    double prompt_s, decode_s;
    enum engine_stop stop;
    char error[640];     /* ENGINE_STOP_ERROR: why */
};

#define ENGINE_MAX_CHECKPOINTS 4 /* DeltaNet states kept per sequence */
#define ENGINE_STEP_BESIDE_DECODE 64 /* tokens of a step that has decoding slots (engine_plan_step) */

/* A sequence's past, matched against the next prompt: the tokens its state holds, and copies
 * of the DeltaNet state at some of their positions. The KV cache is good for any prefix of the
 * tokens, a recurrent state only where it was taken: a prompt that departs from the tokens at
 * position p resumes from the deepest copy at or before p, never a later one. */
struct engine_past {
    int *tokens;             /* [n_ctx]: tokens[0..n) are in the state */
    int n;
    struct model_checkpoint cp[ENGINE_MAX_CHECKPOINTS]; /* positions ascending, <= n */
    int n_cp;
    double used;             /* when it last served: the least recently used is parked or evicted first */
};

/* A conversation parked in RAM while its slot serves another: its past, its state at past.n,
 * and its KV cache of past.n positions. */
struct engine_parked {
    struct engine_past past;
    struct model_checkpoint live;
    float *kv;
    int64_t bytes;           /* what parking added: the KV copy, the live state, the tokens */
};

struct engine_slot {
    struct model_seq seq;
    struct engine_past past;
    struct engine_request req;
    struct engine_gen *gen;  /* NULL: the slot is idle */
    int fed;                 /* prompt tokens fed so far */
    int next;                /* the sampled token to feed in the next step, or -1 */
    int *history;            /* [n_prompt + n_max] the prompt then the tokens generated (repetition penalty) */
    uint64_t rng;
    double t_start, t_prompt;
};

struct engine {
    struct model *m;
    const struct tok *tok;
    struct engine_slot *slots; /* [n_slots] */
    int n_slots;
    struct engine_parked *parked;
    int n_parked;
    int64_t cache_budget;      /* bytes for checkpoints and parked conversations (the prompt cache) */
    int64_t cache_bytes;       /* in use */
    int64_t checkpoint_bytes;  /* one checkpoint's */
    struct sample_candidate *cand; /* [n_vocab] sampling scratch */
    char *piece;               /* [tok->max_piece + 1] */
};

/* N_SLOTS sequences; CACHE_BUDGET bytes for the prompt cache (0: checkpoints are not kept and
 * idle conversations not parked). */
static void engine_init(struct engine *e, struct model *m, const struct tok *tok, int n_slots, int64_t cache_budget)
{
    memset(e, 0, sizeof *e);
    e->m = m;
    e->tok = tok;
    e->n_slots = n_slots;
    e->cache_budget = cache_budget;
    e->checkpoint_bytes = model_recurrent_bytes(m);
    e->slots = plat_zalloc((size_t)n_slots, sizeof *e->slots);
    for (int i = 0; i < n_slots; i++) {
        model_seq_init(m, &e->slots[i].seq);
        e->slots[i].past.tokens = plat_alloc((size_t)m->n_ctx * sizeof(int));
    }
    e->cand = plat_alloc((size_t)m->cfg.n_vocab * sizeof *e->cand);
    e->piece = plat_alloc((size_t)tok->max_piece + 1);
}

static void engine_past_free(struct engine_past *p)
{
    for (int k = 0; k < p->n_cp; k++) free(p->cp[k].recurrent);
    free(p->tokens);
    memset(p, 0, sizeof *p);
}

static void engine_parked_free(struct engine_parked *z)
{
    engine_past_free(&z->past);
    free(z->live.recurrent);
    free(z->kv);
}

static void engine_free(struct engine *e)
{
    for (int i = 0; i < e->n_slots; i++) {
        model_seq_free(e->m, &e->slots[i].seq);
        engine_past_free(&e->slots[i].past);
        free(e->slots[i].history);
    }
    for (int k = 0; k < e->n_parked; k++) engine_parked_free(&e->parked[k]);
    free(e->parked);
    free(e->slots);
    free(e->cand);
    free(e->piece);
}

static void engine_gen_free(struct engine_gen *g)
{
    free(g->tokens);
    free(g->top);
    free(g->text);
    memset(g, 0, sizeof *g);
}

/* The five largest logits, best first (lowest id on ties). */
static void engine_top5(const float *logits, int n, float out[5][2])
{
    int ids[5] = {-1, -1, -1, -1, -1};
    for (int i = 0; i < n; i++) {
        int k = 5;
        while (k > 0 && (ids[k - 1] < 0 || logits[i] > logits[ids[k - 1]])) k--;
        if (k == 5) continue;
        memmove(ids + k + 1, ids + k, (size_t)(4 - k) * sizeof *ids);
        ids[k] = i;
    }
    for (int k = 0; k < 5; k++) {
        out[k][0] = (float)ids[k];
        out[k][1] = ids[k] >= 0 ? logits[ids[k]] : 0.0f;
    }
}

static void engine_gen_append(struct engine_gen *g, int id, float top[5][2], const char *piece, size_t len)
{
    g->tokens = plat_realloc(g->tokens, (size_t)(g->n_tokens + 1) * sizeof *g->tokens);
    g->top = plat_realloc(g->top, (size_t)(g->n_tokens + 1) * sizeof *g->top);
    g->tokens[g->n_tokens] = id;
    memcpy(g->top[g->n_tokens], top, sizeof *g->top);
    g->n_tokens++;
    if (g->text_len + len + 1 > g->text_cap) {
        g->text_cap = (g->text_len + len + 1) * 2;
        g->text = plat_realloc(g->text, g->text_cap);
    }
    memcpy(g->text + g->text_len, piece, len);
    g->text_len += len;
    g->text[g->text_len] = 0;
}

static int engine_cancelled(const struct engine_slot *sl) { return sl->req.cancel && *sl->req.cancel; }

/* ---- the prompt cache: checkpoints, and idle conversations parked in RAM ---- */

/* How many of PROMPT's N tokens past P can give without computing them: the state itself
 * when all of P's tokens begin the prompt, else the deepest checkpoint within the common
 * prefix. One prompt token is always left to compute (its logits choose the first answer
 * token). *CP: -1 the state as it is, -2 none (from nothing), else the checkpoint's index. */
static int engine_reuse(const struct engine_past *p, const int *prompt, int n, int *cp)
{
    int common = 0;
    while (common < p->n && common < n && p->tokens[common] == prompt[common]) common++;
    int limit = common < n - 1 ? common : n - 1;
    *cp = -1;
    if (p->n <= limit) return p->n;
    for (*cp = p->n_cp - 1; *cp >= 0; (*cp)--)
        if (p->cp[*cp].pos <= limit) return p->cp[*cp].pos;
    *cp = -2;
    return 0;
}

/* Checkpoints of P past position POS go (their state is another prompt's). */
static void engine_past_cut(struct engine *e, struct engine_past *p, int pos)
{
    while (p->n_cp && p->cp[p->n_cp - 1].pos > pos) {
        free(p->cp[--p->n_cp].recurrent);
        p->cp[p->n_cp].recurrent = NULL;
        e->cache_bytes -= e->checkpoint_bytes;
    }
    if (p->n > pos) p->n = pos;
}

/* Evicts the least recently used parked conversation; 0 when there is none. */
static int engine_evict(struct engine *e)
{
    if (!e->n_parked) return 0;
    int lru = 0;
    for (int k = 1; k < e->n_parked; k++)
        if (e->parked[k].past.used < e->parked[lru].past.used) lru = k;
    struct engine_parked *z = &e->parked[lru];
    e->cache_bytes -= z->bytes + (int64_t)z->past.n_cp * e->checkpoint_bytes;
    engine_parked_free(z);
    e->parked[lru] = e->parked[--e->n_parked];
    return 1;
}

/* Whether BYTES more fit the cache budget, parked conversations evicted to make room. */
static int engine_cache_room(struct engine *e, int64_t bytes)
{
    while (e->cache_bytes + bytes > e->cache_budget && engine_evict(e)) {}
    return e->cache_bytes + bytes <= e->cache_budget;
}

/* Keeps slot SL's DeltaNet state at its position: a new checkpoint, or, when the slot has
 * ENGINE_MAX_CHECKPOINTS, the buffer of the second shallowest (the shallowest is kept: it is
 * where prefixes that conversations share end, a system prompt and its tools). */
static void engine_checkpoint(struct engine *e, struct engine_slot *sl)
{
    struct engine_past *p = &sl->past;
    if (p->n_cp && p->cp[p->n_cp - 1].pos == sl->seq.pos) return;
    if (p->n_cp == ENGINE_MAX_CHECKPOINTS) {
        struct model_checkpoint recycled = p->cp[1];
        memmove(p->cp + 1, p->cp + 2, (size_t)(p->n_cp - 2) * sizeof *p->cp);
        p->cp[p->n_cp - 1] = recycled;
    } else {
        if (!engine_cache_room(e, e->checkpoint_bytes)) return;
        e->cache_bytes += e->checkpoint_bytes;
        p->cp[p->n_cp++] = (struct model_checkpoint){0, NULL};
    }
    model_checkpoint(e->m, &sl->seq, &p->cp[p->n_cp - 1], 1);
}

/* Slot I forgets its conversation. */
static void engine_forget(struct engine *e, int i)
{
    struct engine_slot *sl = &e->slots[i];
    engine_past_cut(e, &sl->past, 0);
    model_seq_reset(e->m, &sl->seq);
}

/* Copies idle slot I's conversation into RAM, if the budget holds it. The slot is left empty,
 * or (KEEP > 0) keeps its tokens and its checkpoints up to position KEEP: another conversation
 * that shares that much of it is about to start there. */
static void engine_park(struct engine *e, int i, int keep)
{
    struct engine_slot *sl = &e->slots[i];
    struct engine_past *p = &sl->past;
    int n = p->n, n_keep = 0;
    while (keep && n_keep < p->n_cp && p->cp[n_keep].pos <= keep) n_keep++;
    int64_t kv = model_kv_bytes(e->m, n), bytes = kv + e->checkpoint_bytes + (int64_t)n * (int64_t)sizeof(int);
    int room = n && e->cache_budget && engine_cache_room(e, bytes + n_keep * e->checkpoint_bytes);
    float *rows = room && !model_seq_to_host(e->m, &sl->seq) ? malloc((size_t)kv) : NULL; /* no room (or its device failed): forgotten, never fatal */
    if (!rows) {
        if (!keep) engine_forget(e, i);
        return;
    }
    e->parked = plat_realloc(e->parked, (size_t)(e->n_parked + 1) * sizeof *e->parked);
    struct engine_parked *z = &e->parked[e->n_parked++];
    *z = (struct engine_parked){*p, {0, NULL}, rows, bytes};
    model_checkpoint(e->m, &sl->seq, &z->live, 1);
    model_kv_copy(e->m, &sl->seq, z->kv, n, 1);
    z->past.tokens = plat_alloc((size_t)n * sizeof(int));
    memcpy(z->past.tokens, p->tokens, (size_t)n * sizeof(int));
    e->cache_bytes += bytes + n_keep * e->checkpoint_bytes;
    struct engine_past left = {p->tokens, keep ? n : 0, {{0, NULL}}, n_keep, p->used};
    for (int k = 0; k < n_keep; k++) {
        left.cp[k] = (struct model_checkpoint){p->cp[k].pos, plat_alloc((size_t)e->checkpoint_bytes)};
        memcpy(left.cp[k].recurrent, p->cp[k].recurrent, (size_t)e->checkpoint_bytes);
    }
    *p = left;
    if (!keep) model_seq_reset(e->m, &sl->seq);
}

/* Puts parked conversation Z (taken out of the list) back into empty slot I. */
static void engine_unpark(struct engine *e, struct engine_parked *z, int i)
{
    struct engine_slot *sl = &e->slots[i];
    int n = z->past.n;
    model_kv_copy(e->m, &sl->seq, z->kv, n, 0);
    model_checkpoint(e->m, &sl->seq, &z->live, 0);
    free(sl->past.tokens);
    sl->past = z->past;
    sl->past.tokens = plat_realloc(sl->past.tokens, (size_t)e->m->n_ctx * sizeof(int));
    z->past = (struct engine_past){0};
    e->cache_bytes -= z->bytes;
    engine_parked_free(z);
}

/* Ends slot SL's generation with STOP; an error leaves its sequence reset (half-fed). */
static void engine_finish(struct engine *e, struct engine_slot *sl, enum engine_stop stop, const char *why)
{
    double now = plat_now();
    struct engine_gen *g = sl->gen;
    g->stop = stop;
    if (sl->t_prompt > 0) g->decode_s = now - sl->t_prompt;
    else g->prompt_s = now - sl->t_start;
    if (stop == ENGINE_STOP_ERROR) {
        snprintf(g->error, sizeof g->error, "%s", why);
        engine_forget(e, (int)(sl - e->slots));
    }
    sl->gen = NULL;
    sl->next = -1;
}

/* Starts REQ on slot I (idle), its results going to G. A WHOLE prompt resumes from what the
 * slot holds of it (engine_reuse). A prompt that does not fit the sequence's context ends at
 * once with ENGINE_STOP_CONTEXT and nothing generated. */
static void engine_start(struct engine *e, int i, const struct engine_request *req, struct engine_gen *g)
{
    struct engine_slot *sl = &e->slots[i];
    memset(g, 0, sizeof *g);
    g->n_prompt = req->n_prompt;
    sl->req = *req;
    sl->gen = g;
    sl->fed = 0;
    if (req->whole && req->n_prompt > 0) {
        int cp, reuse = req->reuse ? engine_reuse(&sl->past, req->prompt, req->n_prompt, &cp) : 0;
        if (!req->reuse || cp == -2) model_seq_reset(e->m, &sl->seq);
        else if (cp >= 0) model_checkpoint(e->m, &sl->seq, &sl->past.cp[cp], 0);
        engine_past_cut(e, &sl->past, reuse);
        sl->fed = g->n_cached = reuse;
    }
    sl->past.used = plat_now();
    sl->next = -1;
    sl->rng = req->sample.seed;
    sl->t_start = plat_now();
    sl->t_prompt = 0;
    free(sl->history);
    sl->history = plat_alloc(((size_t)req->n_prompt + (size_t)req->n_max + 1) * sizeof *sl->history);
    memcpy(sl->history, req->prompt, (size_t)req->n_prompt * sizeof *sl->history);
    if (req->n_prompt < 1) engine_finish(e, sl, ENGINE_STOP_ERROR, "the prompt is empty");
    else if ((req->whole ? 0 : sl->seq.pos) + req->n_prompt > e->m->n_ctx) engine_finish(e, sl, ENGINE_STOP_CONTEXT, NULL);
    else if (req->rewind) model_checkpoint(e->m, &sl->seq, req->rewind, 1);
}

/* Samples slot SL's next token from LOGITS, hands it to the sink, and decides whether the
 * generation goes on (the token is then fed in the next step) or stops. */
static void engine_sample(struct engine *e, struct engine_slot *sl, float *logits)
{
    struct engine_gen *g = sl->gen;
    const struct engine_request *r = &sl->req;
    int n_vocab = e->m->cfg.n_vocab, n_hist = r->n_prompt + g->n_tokens;
    float top[5][2] = {{-1, 0}};
    if (!sample_all_finite(logits, n_vocab)) {
        engine_finish(e, sl, ENGINE_STOP_ERROR, "the logits are not finite (NaN or infinite): the model file "
                      "holds a corrupt weight block (a NaN or infinite scale)");
        return;
    }
    if (r->want_top) engine_top5(logits, n_vocab, top); /* a pass over the vocabulary: only when asked */
    int id = sample_next(&r->sample, logits, n_vocab, sl->history, n_hist, &sl->rng, e->cand);
    sl->history[n_hist] = id;
    /* an embedding row beyond the vocabulary (padding) has no text */
    int len = id < e->tok->n_vocab ? tok_decode(e->tok, id, e->piece, e->tok->max_piece + 1) : 0;
    engine_gen_append(g, id, top, e->piece, (size_t)len);
    if (r->sink && r->sink(r->sink_ctx, id, e->piece, (size_t)len)) engine_finish(e, sl, ENGINE_STOP_SINK, NULL);
    else if (tok_is_eog(e->tok, id) && !r->ignore_eog) engine_finish(e, sl, ENGINE_STOP_EOG, NULL);
    else if (engine_cancelled(sl)) engine_finish(e, sl, ENGINE_STOP_CANCEL, NULL);
    else if (g->n_tokens >= r->n_max) engine_finish(e, sl, ENGINE_STOP_LENGTH, NULL);
    else if (sl->seq.pos + 1 > e->m->n_ctx) engine_finish(e, sl, ENGINE_STOP_CONTEXT, NULL);
    else sl->next = id;
}

/* The runs of the next step: each decoding slot's token, then the prompts' next chunks while
 * MODEL_BATCH tokens last, or ENGINE_STEP_BESIDE_DECODE where some slot decodes: its next
 * token waits for the whole step, and a step of MODEL_BATCH prompt tokens takes seconds on a
 * large model. OWNER[r] is run r's slot. Returns the number of runs. */
static int engine_plan_step(struct engine *e, struct model_run *runs, int *owner)
{
    int n = 0, room = MODEL_BATCH;
    for (int i = 0; i < e->n_slots && n < MODEL_MAX_RUNS; i++) {
        struct engine_slot *sl = &e->slots[i];
        if (!sl->gen || sl->next < 0) continue;
        runs[n] = (struct model_run){&sl->seq, &sl->next, 1, NULL};
        owner[n++] = i;
        room--;
    }
    if (n) room = ENGINE_STEP_BESIDE_DECODE - n;
    for (int i = 0; i < e->n_slots && n < MODEL_MAX_RUNS && room > 0; i++) {
        struct engine_slot *sl = &e->slots[i];
        if (!sl->gen || sl->next >= 0) continue;
        int k = sl->req.n_prompt - sl->fed < room ? sl->req.n_prompt - sl->fed : room;
        for (int m = 1; m >= 0; m--) /* end the chunk at the next mark */
            if (sl->req.whole && sl->req.mark[m] > sl->fed && sl->fed + k > sl->req.mark[m]) k = sl->req.mark[m] - sl->fed;
        runs[n] = (struct model_run){&sl->seq, sl->req.prompt + sl->fed, k, NULL};
        owner[n++] = i;
        room -= k;
    }
    return n;
}

/* Slot SL after a prompt chunk: cancelled (rewound to its checkpoint if it has one), still
 * reading its prompt, or done with it and sampling its first token. */
static void engine_prompt_fed(struct engine *e, struct engine_slot *sl, int n, float *logits)
{
    sl->fed += n;
    if (sl->req.whole && (sl->fed == sl->req.mark[0] || sl->fed == sl->req.mark[1])) engine_checkpoint(e, sl);
    if (engine_cancelled(sl)) {
        if (sl->req.rewind) {
            model_checkpoint(e->m, &sl->seq, sl->req.rewind, 0);
            engine_past_cut(e, &sl->past, sl->seq.pos);
        }
        engine_finish(e, sl, ENGINE_STOP_CANCEL, NULL);
        return;
    }
    if (sl->fed < sl->req.n_prompt) return;
    sl->t_prompt = plat_now();
    sl->gen->prompt_s = sl->t_prompt - sl->t_start;
    if (sl->req.n_max > 0) engine_sample(e, sl, logits);
    else engine_finish(e, sl, ENGINE_STOP_LENGTH, NULL);
}

/* Rebuilds on the CPU the states a failed device held (model_seq_lost), and those of the slots
 * of a pass that failed with it (OWNER[0..n), their states half advanced: m->lost): each such
 * slot is reset and fed its tokens again, the same bits as before. Returns 0, or -1 with
 * m->error (the slot that failed is forgotten). */
static int engine_replay(struct engine *e, const int *owner, int n)
{
    int fed = 0, rebuilt = 0;
    for (int i = 0; i < e->n_slots; i++) {
        struct engine_slot *sl = &e->slots[i];
        int in_batch = 0, pos = sl->seq.pos;
        for (int r = 0; r < n; r++) in_batch |= owner[r] == i;
        if (!in_batch && !model_seq_lost(e->m, &sl->seq)) continue;
        model_seq_reset(e->m, &sl->seq);
        for (int at = 0; at < pos;) {
            struct model_run run = {&sl->seq, sl->past.tokens + at, pos - at < MODEL_BATCH ? pos - at : MODEL_BATCH, NULL};
            if (sl->past.n < pos) snprintf(e->m->error, sizeof e->m->error, "a conversation's tokens are not all known");
            if (sl->past.n < pos || model_forward_runs(e->m, &run, 1)) {
                engine_forget(e, i);
                return -1;
            }
            at += run.n;
        }
        fed += pos;
        rebuilt++;
    }
    if (rebuilt) plat_log("[cuda] the states of %d conversations rebuilt on the CPU: %d tokens of context fed again", rebuilt, fed);
    return 0;
}

/* One forward batch over the busy slots, then each one's next token. Returns how many slots
 * are still busy. */
static int engine_step(struct engine *e)
{
    struct model_run runs[MODEL_MAX_RUNS];
    int owner[MODEL_MAX_RUNS], n = engine_plan_step(e, runs, owner), prompt = 0;
    for (int r = 0; r < n; r++) prompt |= e->slots[owner[r]].next < 0;
    if (n && e->m->experts) expert_phase(e->m->experts, prompt ? EXPERT_PHASE_PROMPT : EXPERT_PHASE_DECODE);
    struct model_profile *pf = &e->m->profile;
    const long calls = cuda_calls, waits = cuda.waits, graphs = cuda.graph_runs;
    pf->decode = !prompt;
    int failed = n && model_forward_runs(e->m, runs, n);
    if (failed && e->m->lost) failed = engine_replay(e, owner, n) || model_forward_runs(e->m, runs, n);
    pf->calls[!prompt] += cuda_calls - calls, pf->waits[!prompt] += cuda.waits - waits, pf->graphs[!prompt] += cuda.graph_runs - graphs;
    if (failed)
        for (int r = 0; r < n; r++) engine_finish(e, &e->slots[owner[r]], ENGINE_STOP_ERROR, e->m->error);
    else
        for (int r = 0; r < n; r++) {
            struct engine_slot *sl = &e->slots[owner[r]];
            int at = sl->seq.pos - runs[r].n; /* where the run's tokens now are in the state */
            memcpy(sl->past.tokens + at, runs[r].tokens, (size_t)runs[r].n * sizeof(int));
            sl->past.n = sl->seq.pos;
            if (sl->next >= 0) engine_sample(e, sl, runs[r].logits);
            else engine_prompt_fed(e, sl, runs[r].n, runs[r].logits);
        }
    if (n) model_phase_mark(e->m, MODEL_PHASE_SAMPLING);
    int busy = 0;
    for (int i = 0; i < e->n_slots; i++) busy += e->slots[i].gen != NULL;
    return busy;
}

/* Runs REQ on slot I to its end (run, chat and bench: one conversation at a time). The last
 * sampled token is not fed: the slot's sequence ends before it. */
static void engine_generate(struct engine *e, int i, const struct engine_request *req, struct engine_gen *g)
{
    engine_start(e, i, req, g);
    while (e->slots[i].gen) engine_step(e);
}

/* Starts REQ (WHOLE) on the idle slot that can reuse the most of its prompt: a slot's own
 * past, or a parked conversation brought back into the least recently used slot (whose own
 * is parked in turn). A prompt nothing holds goes to an empty slot, else the least recently
 * used one, whose conversation is parked. A prompt that shares only the start of a slot's
 * conversation (departing before its latest checkpoint: another conversation with the same
 * system prompt) parks a copy of it first. Returns the slot, or -1 when none is idle. */
static int engine_admit(struct engine *e, const struct engine_request *req, struct engine_gen *g)
{
    int best = -1, best_reuse = -1, victim = -1, cp, parked = -1;
    if (!cuda.ready) engine_replay(e, NULL, 0); /* nothing below may read a state the device took with it */
    for (int i = 0; i < e->n_slots; i++) {
        struct engine_slot *sl = &e->slots[i];
        if (sl->gen) continue;
        int r = req->reuse ? engine_reuse(&sl->past, req->prompt, req->n_prompt, &cp) : 0;
        if (r > best_reuse) best = i, best_reuse = r;
        struct engine_slot *v = victim >= 0 ? &e->slots[victim] : NULL;
        if (!v || (v->past.n > 0 && (sl->past.n == 0 || sl->past.used < v->past.used))) victim = i;
    }
    if (victim < 0) return -1;
    for (int k = 0; k < e->n_parked && req->reuse; k++) {
        int r = engine_reuse(&e->parked[k].past, req->prompt, req->n_prompt, &cp);
        if (r > best_reuse) parked = k, best_reuse = r;
    }
    if (parked >= 0) {
        struct engine_parked z = e->parked[parked];
        e->parked[parked] = e->parked[--e->n_parked]; /* out of the list, so that parking the victim cannot evict it */
        engine_park(e, victim, 0);
        engine_unpark(e, &z, victim);
        best = victim;
    } else if (best_reuse == 0) {
        best = victim;
        engine_park(e, victim, 0);
    } else {
        const struct engine_past *p = &e->slots[best].past;
        if (p->n_cp && best_reuse < p->cp[p->n_cp - 1].pos) engine_park(e, best, best_reuse);
    }
    engine_start(e, best, req, g);
    return best;
}

/* ==== §12 serve ==== */
/* Owns: `coli serve`, the OpenAI-compatible HTTP server: the listening socket and a thread per
 *   connection, HTTP/1.1 requests read under limits, the JSON answers, the queue of generation
 *   jobs between the connections and the engine, streaming (server-sent events), stop strings,
 *   an answer split into reasoning_content, content and tool_calls, the API key, /health,
 *   /metrics and /apply-template.
 * Promises: after start-up nothing here dies: a bad request gets an OpenAI-shaped error and the
 *   server lives on. Connection threads never touch model state: they parse, tokenize (the
 *   vocabulary is read-only), queue a job and send what the engine's sink hands them; only
 *   the engine thread (serve_run, the one that loaded the model) runs the engine. A job is its
 *   connection's, but shared under its own mutex while queued or running; the engine lets go
 *   of it by setting done.
 * May call: §1–§11, POSIX sockets, pthreads.
 * Workload: per generated token one sink call (a lock, a copy, a signal) and one write per
 *   streaming client. Why no library: Debian has no HTTP parser that builds from source into a
 *   static musl binary (llhttp is generated code inside node's tree; libmicrohttpd brings its
 *   own threads, polling and TLS), and a strict JSON reader with our limits is shorter than the
 *   glue to cJSON. */

#define SERVE_MAX_HEAD (16 << 10)    /* request line and headers; more is 431 */
#define SERVE_MAX_HEADERS 100
#define SERVE_MAX_BODY (8 << 20)     /* a request body; more is 413 */
#define SERVE_HEAD_TIMEOUT 10.0      /* seconds for a request's head once its first byte came */
#define SERVE_IDLE_TIMEOUT 30.0      /* seconds a kept-alive connection may wait for its next request */
#define SERVE_BODY_TIMEOUT 30.0
#define SERVE_MAX_CONNS 256          /* connections at once; more are answered 503 and closed */
#define SERVE_MAX_STOP 4             /* stop strings per request, as the OpenAI API allows */
#define SERVE_DEFAULT_CTX 32768      /* context per slot unless -c says */
#define SERVE_DEFAULT_CACHE (8LL << 30) /* the prompt cache: an eighth of free memory, this at most, unless --cache-ram says */

/* ---- HTTP/1.1 ---- */

/* One client connection; BUF holds what was read and not yet used (a pipelined request). */
struct serve_conn {
    struct serve *srv;
    int fd, served;            /* requests answered on it */
    char buf[SERVE_MAX_HEAD + 1];
    size_t len;
};

/* A request as read: the head's facts that matter here, and the body. */
struct serve_request {
    char method[16], path[2048];
    int keep_alive, expect_continue, chunked;
    long long content_length;  /* -1: none */
    char auth[512];            /* the Authorization header's value */
    char *body;                /* [body_len + 1], NUL-terminated */
    size_t body_len;
};

/* An answer that is an error, in the OpenAI shape. */
struct serve_error {
    int status;
    const char *type, *code; /* code may be NULL */
    char param[64];          /* "" when no field is to blame */
    char message[600];
};

static const char *serve_status_text(int status)
{
    switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Content Too Large";
    case 417: return "Expectation Failed";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Error";
    }
}

/* Writes all of P; waits at most SERVE_BODY_TIMEOUT for a client that does not read. Returns 0,
 * or -1 when the client is gone or stuck. */
static int serve_write(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd pf = {fd, POLLOUT, 0};
            if (poll(&pf, 1, (int)(SERVE_BODY_TIMEOUT * 1000)) <= 0) return -1;
            continue;
        }
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Reads more into C's buffer until DEADLINE (plat_now time). Returns the bytes read, 0 when the
 * client closed, -1 on a timeout, an error or a full buffer. */
static ssize_t serve_fill(struct serve_conn *c, double deadline)
{
    if (c->len >= SERVE_MAX_HEAD) return -1;
    for (;;) {
        double left = deadline - plat_now();
        struct pollfd pf = {c->fd, POLLIN, 0};
        if (left <= 0) return -1;
        int r = poll(&pf, 1, (int)(left * 1000) + 1);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        ssize_t got = recv(c->fd, c->buf + c->len, SERVE_MAX_HEAD - c->len, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return -1;
        c->len += (size_t)got;
        return got;
    }
}

/* Takes N bytes off the front of C's buffer. */
static void serve_consume(struct serve_conn *c, size_t n)
{
    memmove(c->buf, c->buf + n, c->len - n);
    c->len -= n;
}

static int serve_token_char(int c) { return c > 0x20 && c < 0x7f && !strchr("()<>@,;:\\\"/[]?={}", c); }

/* Whether the comma-separated header value V holds TOKEN (case-insensitive). */
static int serve_has_token(const char *v, const char *token)
{
    size_t n = strlen(token);
    for (const char *p = v; *p;) {
        while (*p == ' ' || *p == '\t' || *p == ',') p++;
        const char *e = p;
        while (*e && *e != ',') e++;
        const char *t = e;
        while (t > p && (t[-1] == ' ' || t[-1] == '\t')) t--;
        if ((size_t)(t - p) == n && !strncasecmp(p, token, n)) return 1;
        p = e;
    }
    return 0;
}

/* One header line NAME: VALUE into R; -1 with E set when it is malformed. */
static int serve_header(struct serve_request *r, char *line, struct serve_error *e)
{
    char *colon = strchr(line, ':'), *v;
    if (!colon || colon == line) return snprintf(e->message, sizeof e->message, "a malformed header line"), -1;
    for (char *p = line; p < colon; p++)
        if (!serve_token_char((unsigned char)*p)) return snprintf(e->message, sizeof e->message, "a malformed header name"), -1;
    *colon = 0;
    for (v = colon + 1; *v == ' ' || *v == '\t'; v++) {}
    for (char *t = v + strlen(v); t > v && (t[-1] == ' ' || t[-1] == '\t');) *--t = 0;
    for (char *p = v; *p; p++)
        if ((unsigned char)*p < 0x20 && *p != '\t') return snprintf(e->message, sizeof e->message, "a control character in a header"), -1;
    if (!strcasecmp(line, "content-length")) {
        char *end;
        errno = 0;
        long long n = strtoll(v, &end, 10);
        if (!isdigit((unsigned char)*v) || *end || errno || (r->content_length >= 0 && r->content_length != n))
            return snprintf(e->message, sizeof e->message, "a bad Content-Length"), -1;
        r->content_length = n;
    } else if (!strcasecmp(line, "transfer-encoding")) {
        if (strcasecmp(v, "chunked")) return e->status = 501, snprintf(e->message, sizeof e->message, "Transfer-Encoding other than chunked"), -1;
        r->chunked = 1;
    } else if (!strcasecmp(line, "connection")) {
        if (serve_has_token(v, "close")) r->keep_alive = 0;
        else if (serve_has_token(v, "keep-alive")) r->keep_alive = 1;
    } else if (!strcasecmp(line, "expect")) {
        if (strcasecmp(v, "100-continue")) return e->status = 417, snprintf(e->message, sizeof e->message, "an Expect other than 100-continue"), -1;
        r->expect_continue = 1;
    } else if (!strcasecmp(line, "authorization")) snprintf(r->auth, sizeof r->auth, "%s", v);
    return 0;
}

/* The request line and headers in HEAD (NUL-terminated, CRLF line ends, without the blank
 * line) into R. Returns 0, or -1 with E set (status 400 unless said). */
static int serve_parse_head(char *head, struct serve_request *r, struct serve_error *e)
{
    char *line = head, *eol = strstr(line, "\r\n"), version[16];
    int n_headers = 0;
    if (eol) *eol = 0;
    for (const char *p = line; *p; p++) /* sscanf's spaces would also take a CR or a tab */
        if ((unsigned char)*p < 0x20 || *p == 0x7f) return snprintf(e->message, sizeof e->message, "a control character in the request line"), -1;
    int n = 0;
    if (sscanf(line, "%15[A-Z] %2047[!-~] HTTP/%15[0-9.]%n", r->method, r->path, version, &n) != 3 || line[n] || r->path[0] != '/')
        return snprintf(e->message, sizeof e->message, "a malformed request line"), -1;
    if (strcmp(version, "1.1") && strcmp(version, "1.0"))
        return e->status = 505, snprintf(e->message, sizeof e->message, "HTTP/%s is not supported (HTTP/1.1 is)", version), -1;
    r->keep_alive = !strcmp(version, "1.1");
    while (eol) {
        line = eol + 2;
        if ((eol = strstr(line, "\r\n"))) *eol = 0;
        if (!*line) break;
        if (++n_headers > SERVE_MAX_HEADERS)
            return e->status = 431, snprintf(e->message, sizeof e->message, "more than %d header lines", SERVE_MAX_HEADERS), -1;
        if (*line == ' ' || *line == '\t') return snprintf(e->message, sizeof e->message, "a folded header line"), -1;
        if (serve_header(r, line, e)) return -1;
    }
    if (r->chunked && r->content_length >= 0) return snprintf(e->message, sizeof e->message, "both Content-Length and chunked"), -1;
    char *q = strchr(r->path, '?');
    if (q) *q = 0;
    return 0;
}

/* Takes one CRLF-ended line off C's buffer into LINE (at most CAP-1 bytes), reading more until
 * DEADLINE; -1 if it does not come whole. */
static int serve_take_line(struct serve_conn *c, char *line, size_t cap, double deadline)
{
    for (;;) {
        char *eol = memmem(c->buf, c->len, "\r\n", 2);
        if (eol) {
            size_t n = (size_t)(eol - c->buf);
            if (n >= cap) return -1;
            memcpy(line, c->buf, n);
            line[n] = 0;
            serve_consume(c, n + 2);
            return 0;
        }
        if (c->len >= cap || serve_fill(c, deadline) <= 0) return -1;
    }
}

/* Appends N body bytes from C (buffered first, then read) to R's body; -1 if they do not come. */
static int serve_take_bytes(struct serve_conn *c, struct serve_request *r, size_t n, double deadline)
{
    while (n > 0) {
        if (!c->len && serve_fill(c, deadline) <= 0) return -1;
        size_t k = c->len < n ? c->len : n;
        memcpy(r->body + r->body_len, c->buf, k);
        r->body_len += k;
        serve_consume(c, k);
        n -= k;
    }
    r->body[r->body_len] = 0;
    return 0;
}

/* A chunked body (RFC 9112 §7.1): hex sizes, extensions ignored, trailers dropped. */
static int serve_read_chunked(struct serve_conn *c, struct serve_request *r, double deadline, struct serve_error *e)
{
    char line[1024];
    for (;;) {
        char *end;
        if (serve_take_line(c, line, sizeof line, deadline)) return snprintf(e->message, sizeof e->message, "a chunked body ended early"), -1;
        errno = 0;
        unsigned long long n = strtoull(line, &end, 16);
        if (!isxdigit((unsigned char)line[0]) || errno || (*end && *end != ';' && *end != ' ' && *end != '\t'))
            return snprintf(e->message, sizeof e->message, "a bad chunk size"), -1;
        if (n > (unsigned long long)(SERVE_MAX_BODY - r->body_len))
            return e->status = 413, snprintf(e->message, sizeof e->message, "the body is over %d bytes", SERVE_MAX_BODY), -1;
        if (n == 0) break;
        if (serve_take_bytes(c, r, (size_t)n, deadline) || serve_take_line(c, line, sizeof line, deadline) || line[0])
            return snprintf(e->message, sizeof e->message, "a chunk of the wrong size"), -1;
    }
    do { /* trailer lines, then the empty line */
        if (serve_take_line(c, line, sizeof line, deadline)) return snprintf(e->message, sizeof e->message, "a chunked body ended early"), -1;
    } while (line[0]);
    return 0;
}

/* The body of R, by Content-Length or chunked. */
static int serve_read_body(struct serve_conn *c, struct serve_request *r, struct serve_error *e)
{
    double deadline = plat_now() + SERVE_BODY_TIMEOUT;
    if (r->content_length > SERVE_MAX_BODY)
        return e->status = 413, snprintf(e->message, sizeof e->message, "the body is over %d bytes", SERVE_MAX_BODY), -1;
    r->body = plat_alloc(r->chunked ? SERVE_MAX_BODY + 1 : (size_t)(r->content_length > 0 ? r->content_length : 0) + 1);
    r->body[0] = 0;
    if (r->expect_continue && serve_write(c->fd, "HTTP/1.1 100 Continue\r\n\r\n", 25)) return -1;
    if (r->chunked) return serve_read_chunked(c, r, deadline, e);
    if (r->content_length > 0 && serve_take_bytes(c, r, (size_t)r->content_length, deadline))
        return snprintf(e->message, sizeof e->message, "the body is shorter than its Content-Length"), -1;
    return 0;
}

/* Reads the next request on C into R. Returns 1 for a request, 0 when the client closed or
 * stayed idle (nothing to answer), -1 with E set for a request to refuse (then close). */
static int serve_read_request(struct serve_conn *c, struct serve_request *r, struct serve_error *e)
{
    memset(r, 0, sizeof *r);
    r->content_length = -1;
    *e = (struct serve_error){400, "invalid_request_error", NULL, "", "a malformed request"};
    /* a new connection must send its request soon; a kept-alive one may wait for the next */
    double deadline = plat_now() + (c->served++ ? SERVE_IDLE_TIMEOUT : SERVE_HEAD_TIMEOUT);
    char *end;
    while (!(end = memmem(c->buf, c->len, "\r\n\r\n", 4))) {
        if (c->len >= SERVE_MAX_HEAD) return e->status = 431, snprintf(e->message, sizeof e->message, "the request head is over %d bytes", SERVE_MAX_HEAD), -1;
        ssize_t got = serve_fill(c, deadline);
        if (got < 0 && c->len) return e->status = 408, snprintf(e->message, sizeof e->message, "the request head did not come in time"), -1;
        if (got == 0 && c->len) return snprintf(e->message, sizeof e->message, "the request ended in its head"), -1;
        if (got <= 0) return 0;
        /* a bare LF in the head so far (not in a body behind it): else a head ended by bare LFs
         * would wait out its deadline */
        const char *head_end = memmem(c->buf, c->len, "\r\n\r\n", 4);
        size_t stop = head_end ? (size_t)(head_end - c->buf) + 4 : c->len;
        for (size_t i = c->len - (size_t)got; i < stop; i++)
            if (c->buf[i] == '\n' && (i == 0 || c->buf[i - 1] != '\r'))
                return snprintf(e->message, sizeof e->message, "a line ending without CR in the request head"), -1;
        if ((size_t)got == c->len) deadline = plat_now() + SERVE_HEAD_TIMEOUT; /* the first bytes: the head must follow soon */
    }
    size_t head_len = (size_t)(end - c->buf);
    char head[SERVE_MAX_HEAD + 1];
    memcpy(head, c->buf, head_len);
    head[head_len] = 0;
    serve_consume(c, head_len + 4);
    if (memchr(head, 0, head_len)) return snprintf(e->message, sizeof e->message, "a NUL byte in the request head"), -1;
    if (serve_parse_head(head, r, e) || serve_read_body(c, r, e)) return -1;
    return 1;
}

/* Sends a whole answer: status, headers (EXTRA: more header lines, each ending in CRLF), body. */
static int serve_respond(struct serve_conn *c, int status, const char *type, const char *body, size_t n, const char *extra, int keep_alive)
{
    char head[1024];
    int h = snprintf(head, sizeof head, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\nConnection: %s\r\n%s\r\n", status,
                     serve_status_text(status), type, n, keep_alive ? "keep-alive" : "close", extra ? extra : "");
    return serve_write(c->fd, head, (size_t)h) || serve_write(c->fd, body, n) ? -1 : 0;
}

/* The OpenAI error object for E. */
static char *serve_error_json(const struct serve_error *e, size_t *n)
{
    char *out = NULL;
    FILE *f = open_memstream(&out, n);
    fputs("{\"error\":{\"message\":", f);
    json_write_string(f, e->message, strlen(e->message));
    fprintf(f, ",\"type\":\"%s\",\"param\":", e->type ? e->type : "invalid_request_error");
    if (e->param[0]) json_write_string(f, e->param, strlen(e->param));
    else fputs("null", f);
    fprintf(f, ",\"code\":");
    if (e->code) fprintf(f, "\"%s\"", e->code);
    else fputs("null", f);
    fputs("}}", f);
    fclose(f);
    return out;
}

/* ---- the server: jobs, the queue, the engine loop ---- */

/* Counters for /metrics and the log, under serve.stats_mu. */
#define SERVE_STATUS_KINDS 16
struct serve_stats {
    int status[SERVE_STATUS_KINDS];          /* the status codes answered so far, first come first */
    uint64_t by_status[SERVE_STATUS_KINDS];  /* how often each */
    uint64_t prompt_tokens, cached_tokens, generated_tokens, requests_done;
    double prompt_s, decode_s; /* summed over the generations */
    struct expert_stats experts; /* the store's figures, copied by the engine thread */
    int slots_busy;
};

struct serve {
    int listen_fd, wake_pipe[2];
    const char *model_id;
    const char *api_key;       /* NULL: none */
    struct engine *engine;     /* set when loaded */
    const struct tok *tok;
    int ready, n_slots, queue_max, default_max;
    struct sample_params sample; /* the command line's sampling: a request's defaults */
    int think;                 /* the chat template's thinking block unless a request says */
    pthread_mutex_t mu;        /* the queue, the connection list */
    pthread_cond_t cv;         /* the engine waits on it for jobs */
    struct serve_job *queue_head, *queue_tail;
    int queue_len, n_conns;
    int conn_fds[SERVE_MAX_CONNS];
    pthread_mutex_t stats_mu;
    struct serve_stats stats;
    double started;
};

/* One tool call the model wrote. */
struct serve_tool_call {
    char *name;
    char *arguments; /* a JSON object's text */
};

enum serve_part { SERVE_PART_REASONING, SERVE_PART_CONTENT, SERVE_PART_CALL };

/* A chat answer split into its fields as it comes: the text of the think block, the content,
 * and the <tool_call> blocks that parse. Only the connection thread touches it. */
struct serve_answer {
    enum serve_part part;      /* where the text that comes next belongs */
    struct tok_buf pending;    /* text not placed yet: maybe the start of a tag, or trailing space */
    struct tok_buf field[2];   /* [SERVE_PART_REASONING], [SERVE_PART_CONTENT] */
    struct serve_tool_call *calls;
    int n_calls;
};

/* One generation request between its connection thread and the engine. */
struct serve_job {
    struct serve_job *next;    /* in the queue */
    int chat;                  /* /v1/chat/completions (else /v1/completions) */
    int stream, include_usage;
    int think;                 /* chat: the answer opens inside a think block */
    struct json *body;         /* the request, parsed */
    const struct json *tools;  /* chat: the body's tools, NULL when none (no tool calls are parsed) */
    struct serve_answer answer;
    int *prompt;               /* [n_prompt] */
    struct engine_request req;
    char *stop[SERVE_MAX_STOP];
    int n_stop;
    size_t longest_stop;       /* bytes of the longest stop string */
    struct tok_utf8_stream utf8;
    volatile sig_atomic_t cancel; /* the client went away: set by the connection thread */
    /* shared with the engine's sink, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char *text;                /* [len] the answer so far in whole characters, cut before a stop string */
    size_t len, cap, released; /* text[0..released) can no longer turn into a stop string */
    int done;                  /* the engine has let go; gen is final */
    struct engine_gen gen;
};

static volatile sig_atomic_t serve_stopping;
static int serve_wake_fd = -1;

static void serve_on_signal(int sig)
{
    (void)sig;
    serve_stopping = 1;
    if (serve_wake_fd >= 0) {
        ssize_t r = write(serve_wake_fd, "x", 1);
        (void)r;
    }
}

static void serve_count(struct serve *srv, int status)
{
    pthread_mutex_lock(&srv->stats_mu);
    int k = 0;
    while (k < SERVE_STATUS_KINDS - 1 && srv->stats.status[k] && srv->stats.status[k] != status) k++;
    srv->stats.status[k] = status; /* the few codes a server answers fit; the last cell takes the rest */
    srv->stats.by_status[k]++;
    pthread_mutex_unlock(&srv->stats_mu);
}

/* Sends E as the answer, counts it and logs it; the connection closes after a refused request. */
static void serve_fail(struct serve_conn *c, const struct serve_error *e, int keep_alive)
{
    size_t n;
    char *body = serve_error_json(e, &n);
    const char *extra = e->status == 503 ? "Retry-After: 1\r\n" : NULL;
    serve_respond(c, e->status, "application/json", body, n, extra, keep_alive);
    free(body);
    serve_count(c->srv, e->status);
    plat_log("[serve] %d: %s", e->status, e->message);
}

static void serve_answer_free(struct serve_answer *a)
{
    free(a->pending.p);
    free(a->field[0].p);
    free(a->field[1].p);
    for (int i = 0; i < a->n_calls; i++) {
        free(a->calls[i].name);
        free(a->calls[i].arguments);
    }
    free(a->calls);
    memset(a, 0, sizeof *a);
}

static void serve_job_free(struct serve_job *j)
{
    serve_answer_free(&j->answer);
    json_free(j->body);
    free(j->prompt);
    for (int i = 0; i < j->n_stop; i++) free(j->stop[i]);
    free(j->text);
    engine_gen_free(&j->gen);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
}

/* Where the first stop string starts in J's text at or after FROM, or -1. */
static long serve_find_stop(const struct serve_job *j, size_t from)
{
    long best = -1;
    for (int i = 0; i < j->n_stop; i++) {
        const char *hit = memmem(j->text + from, j->len - from, j->stop[i], strlen(j->stop[i]));
        if (hit && (best < 0 || hit - j->text < best)) best = hit - j->text;
    }
    return best;
}

/* How many bytes at the end of J's text could be the start of a stop string. */
static size_t serve_stop_holdback(const struct serve_job *j)
{
    size_t hold = 0;
    for (int i = 0; i < j->n_stop; i++) {
        size_t n = strlen(j->stop[i]);
        for (size_t k = n - 1 < j->len ? n - 1 : j->len; k > hold; k--)
            if (!memcmp(j->text + j->len - k, j->stop[i], k)) hold = k;
    }
    return hold;
}

/* Appends whole characters to J's text and finds stop strings in what came; 1 on a stop. Under mu. */
static int serve_job_append(struct serve_job *j, const char *s, size_t n)
{
    size_t from = j->len;
    j->text = tok_grow(j->text, &j->cap, j->len + n + 1, 1);
    memcpy(j->text + j->len, s, n);
    j->len += n;
    long at = serve_find_stop(j, from + 1 > j->longest_stop ? from + 1 - j->longest_stop : 0);
    if (at >= 0) j->len = (size_t)at;
    j->released = j->len - (at >= 0 ? 0 : serve_stop_holdback(j));
    return at >= 0;
}

/* The engine's sink for a job (engine thread): the piece of token ID joins the answer; the
 * end-of-generation token's text does not. Nonzero stops: a stop string came. */
static int serve_sink(void *ctx, int id, const char *piece, size_t len)
{
    struct serve_job *j = ctx;
    char out[512];
    int stop = 0;
    (void)id;
    pthread_mutex_lock(&j->mu);
    while (len > 0 && !stop) {
        size_t take = len < 256 ? len : 256;
        stop = serve_job_append(j, out, tok_stream_push(&j->utf8, piece, take, out, sizeof out));
        piece += take;
        len -= take;
    }
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
    return stop;
}

/* The engine has finished J: what the UTF-8 stream held back joins the text unless a stop
 * string ended it, everything left is released, and the connection is woken. */
static void serve_job_done(struct serve *srv, struct serve_job *j)
{
    char tail[8];
    pthread_mutex_lock(&srv->stats_mu);
    srv->stats.prompt_tokens += (uint64_t)j->gen.n_prompt;
    srv->stats.cached_tokens += (uint64_t)j->gen.n_cached;
    srv->stats.generated_tokens += (uint64_t)j->gen.n_tokens;
    srv->stats.prompt_s += j->gen.prompt_s;
    srv->stats.decode_s += j->gen.decode_s;
    srv->stats.requests_done++;
    pthread_mutex_unlock(&srv->stats_mu);
    pthread_mutex_lock(&j->mu);
    size_t n = tok_stream_flush(&j->utf8, tail);
    if (j->gen.stop != ENGINE_STOP_SINK) {
        serve_job_append(j, tail, n);
        j->released = j->len;
    }
    j->done = 1; /* from here on the job is its connection's, which may free it at once */
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

/* Whether the model is loaded (set once, under mu, after the engine and tokenizer it
 * publishes): until then nothing may touch them. */
static int serve_ready(struct serve *srv)
{
    pthread_mutex_lock(&srv->mu);
    int ready = srv->ready;
    pthread_mutex_unlock(&srv->mu);
    return ready;
}

/* E: the 503 of a request that came while the model loads. */
static void serve_loading(struct serve_error *e)
{
    *e = (struct serve_error){503, "server_error", "loading", "", "the model is still loading"};
}

/* Queues J for the engine; 503 in E when the queue is full or the model still loading. */
static int serve_submit(struct serve *srv, struct serve_job *j, struct serve_error *e)
{
    pthread_mutex_lock(&srv->mu);
    const int ready = srv->ready, ok = ready && !serve_stopping && srv->queue_len < srv->queue_max;
    if (ok) {
        if (srv->queue_tail) srv->queue_tail->next = j;
        else srv->queue_head = j;
        srv->queue_tail = j;
        srv->queue_len++;
        pthread_cond_signal(&srv->cv);
    }
    pthread_mutex_unlock(&srv->mu);
    if (!ok && !ready) serve_loading(e);
    else if (!ok) {
        e->status = 503;
        e->type = "server_error";
        e->code = serve_stopping ? "shutting_down" : "queue_full";
        snprintf(e->message, sizeof e->message, "%s", serve_stopping ? "the server is shutting down" : "the queue is full; try again");
    }
    return ok ? 0 : -1;
}

/* The next queued job, or NULL. Under mu. */
static struct serve_job *serve_dequeue(struct serve *srv)
{
    struct serve_job *j = srv->queue_head;
    if (!j) return NULL;
    srv->queue_head = j->next;
    if (!srv->queue_head) srv->queue_tail = NULL;
    srv->queue_len--;
    return j;
}

/* Gives queued jobs to idle slots, each to the one that holds the most of its prompt
 * (engine_admit); JOBS[i] is slot i's job. Waits for work while there is none. Returns 0 when
 * stopping. */
static int serve_admit(struct serve *srv, struct serve_job **jobs)
{
    struct engine *e = srv->engine;
    int busy = 0;
    for (int i = 0; i < e->n_slots; i++) busy += jobs[i] != NULL;
    pthread_mutex_lock(&srv->mu);
    while (!busy && !srv->queue_len && !serve_stopping) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 250 * 1000000L; /* signals set serve_stopping without the lock */
        if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
        pthread_cond_timedwait(&srv->cv, &srv->mu, &ts);
    }
    struct serve_job *admitted[MODEL_MAX_RUNS];
    int n = 0;
    for (int i = 0; i < e->n_slots && !serve_stopping; i++)
        if (!jobs[i] && srv->queue_len) admitted[n++] = serve_dequeue(srv);
    pthread_mutex_unlock(&srv->mu);
    for (int k = 0; k < n; k++) {
        int i = engine_admit(e, &admitted[k]->req, &admitted[k]->gen);
        if (e->slots[i].gen) jobs[i] = admitted[k];
        else serve_job_done(srv, admitted[k]); /* ended at once (too long for the context): its slot is idle again */
    }
    return !serve_stopping;
}

/* Hands finished slots' jobs back to their connections and publishes the figures. */
static void serve_collect(struct serve *srv, struct serve_job **jobs)
{
    struct engine *e = srv->engine;
    int busy = 0;
    for (int i = 0; i < e->n_slots; i++) {
        if (jobs[i] && !e->slots[i].gen) {
            serve_job_done(srv, jobs[i]);
            jobs[i] = NULL;
        }
        busy += jobs[i] != NULL;
    }
    struct expert_stats st = {0};
    if (e->m->experts) st = expert_stats_get(e->m->experts);
    pthread_mutex_lock(&srv->stats_mu);
    srv->stats.experts = st;
    srv->stats.slots_busy = busy;
    pthread_mutex_unlock(&srv->stats_mu);
}

/* The engine thread: steps every busy slot together until a signal says stop; then the running
 * generations are cancelled (each ends at its next token) and the queued ones refused. */
static void serve_run(struct serve *srv)
{
    struct engine *e = srv->engine;
    struct serve_job **jobs = plat_zalloc((size_t)e->n_slots, sizeof *jobs);
    while (serve_admit(srv, jobs)) {
        engine_step(e);
        serve_collect(srv, jobs);
    }
    int running = 0, refused = 0;
    for (int i = 0; i < e->n_slots; i++)
        if (jobs[i]) {
            jobs[i]->cancel = 1;
            running++;
        }
    while (engine_step(e)) {}
    serve_collect(srv, jobs);
    pthread_mutex_lock(&srv->mu);
    for (struct serve_job *j; (j = serve_dequeue(srv)); refused++) {
        j->gen.stop = ENGINE_STOP_ERROR;
        snprintf(j->gen.error, sizeof j->gen.error, "the server is shutting down");
        serve_job_done(srv, j);
    }
    pthread_mutex_unlock(&srv->mu);
    plat_log("[serve] stopping: %d running generation%s cancelled, %d queued refused", running, running == 1 ? "" : "s", refused);
    free(jobs);
}

/* ---- requests ---- */

/* E as a 400 naming PARAM. Returns -1. */
static int serve_bad(struct serve_error *e, const char *param, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int serve_bad(struct serve_error *e, const char *param, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    e->status = 400;
    e->type = "invalid_request_error";
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return -1;
}

/* The number NAME of BODY into *OUT when present: within [LO, HI], and whole if WHOLE. Returns
 * 0 (absent or set), -1 with E set. */
static int serve_number(const struct json *body, const char *name, double lo, double hi, int whole, double *out, struct serve_error *e)
{
    const struct json *v = json_get(body, name);
    if (!v || v->kind == JSON_NULL) return 0;
    if (v->kind != JSON_NUMBER) return serve_bad(e, name, "'%s' must be a number", name);
    if (whole && v->number != floor(v->number)) return serve_bad(e, name, "'%s' must be a whole number", name);
    if (!(v->number >= lo && v->number <= hi)) return serve_bad(e, name, "'%s' must be in [%g, %g]", name, lo, hi);
    *out = v->number;
    return 0;
}

static int serve_bool(const struct json *body, const char *name, int *out, struct serve_error *e)
{
    const struct json *v = json_get(body, name);
    if (!v || v->kind == JSON_NULL) return 0;
    if (v->kind != JSON_BOOL) return serve_bad(e, name, "'%s' must be true or false", name);
    *out = v->boolean;
    return 0;
}

/* The sampling fields of BODY over the server's defaults. */
static int serve_sampling(const struct json *body, struct sample_params *p, struct serve_error *e)
{
    double temp = p->temp, top_p = p->top_p, top_k = p->top_k, min_p = p->min_p, seed = (double)(p->seed & 0xFFFFFFFFFFFFF);
    double rep = p->repeat_penalty, presence = p->presence_penalty, frequency = p->frequency_penalty;
    if (serve_number(body, "temperature", 0, 100, 0, &temp, e) || serve_number(body, "top_p", 0, 1, 0, &top_p, e) ||
        serve_number(body, "top_k", 0, 1e9, 1, &top_k, e) || serve_number(body, "min_p", 0, 1, 0, &min_p, e) ||
        serve_number(body, "seed", -9007199254740991.0, 9007199254740991.0, 1, &seed, e) ||
        serve_number(body, "repeat_penalty", 0.01, 100, 0, &rep, e) || serve_number(body, "presence_penalty", -2, 2, 0, &presence, e) ||
        serve_number(body, "frequency_penalty", -2, 2, 0, &frequency, e))
        return -1;
    *p = (struct sample_params){(float)temp, (int)top_k, (float)top_p, (float)min_p, (float)rep, p->repeat_last_n, (uint64_t)(int64_t)seed,
                                (float)presence, (float)frequency};
    return 0;
}

/* stop: a string or a list of up to SERVE_MAX_STOP non-empty strings, into J. */
static int serve_stops(const struct json *body, struct serve_job *j, struct serve_error *e)
{
    const struct json *v = json_get(body, "stop");
    if (!v || v->kind == JSON_NULL) return 0;
    const struct json *s = v->kind == JSON_ARRAY ? v->child : v->kind == JSON_STRING ? v : NULL;
    if (!s && v->kind != JSON_ARRAY) return serve_bad(e, "stop", "'stop' must be a string or a list of strings");
    for (; s; s = v->kind == JSON_ARRAY ? s->next : NULL) {
        if (s->kind != JSON_STRING || !s->len || strlen(s->str) != s->len) return serve_bad(e, "stop", "'stop' must hold non-empty strings");
        if (j->n_stop == SERVE_MAX_STOP) return serve_bad(e, "stop", "at most %d stop strings", SERVE_MAX_STOP);
        j->stop[j->n_stop++] = plat_strdup(s->str);
        if (s->len > j->longest_stop) j->longest_stop = s->len;
    }
    return 0;
}

/* The chat prompt of BODY's messages and tools, rendered by the model's template: a malloc'd
 * string (*LEN bytes). J (if any) learns whether the answer opens inside a think block. SHOW:
 * for /apply-template, which also renders image and video parts (the engine reads text only)
 * and takes add_generation_prompt. */
static char *serve_chat_text(struct serve *srv, const struct json *body, struct serve_job *j, int show, size_t *len, struct serve_error *e)
{
    const struct json *msgs = json_get(body, "messages"), *tools = json_get(body, "tools"), *kw = json_get(body, "chat_template_kwargs");
    struct tok_chat_flags f = {1, srv->think ? -1 : 0, -1};
    if (!msgs) return serve_bad(e, "messages", "'messages' is required"), NULL;
    if (msgs->kind != JSON_ARRAY) return serve_bad(e, "messages", "'messages' must be a list"), NULL;
    int i = 0;
    for (const struct json *m = msgs->child; m; m = m->next, i++) {
        const struct json *c = json_get(m, "content");
        if (m->kind == JSON_OBJECT && !tok_role_is(m, "assistant") && (!c || c->kind == JSON_NULL))
            return serve_bad(e, "messages", "message %d needs 'content' (only an assistant's may be missing)", i), NULL;
    }
    if (show && serve_bool(body, "add_generation_prompt", &f.add_generation_prompt, e)) return NULL;
    if (tools && tools->kind != JSON_ARRAY && tools->kind != JSON_NULL) return serve_bad(e, "tools", "'tools' must be a list"), NULL;
    if (kw && kw->kind != JSON_OBJECT && kw->kind != JSON_NULL) return serve_bad(e, "chat_template_kwargs", "'chat_template_kwargs' must be an object"), NULL;
    if (serve_bool(kw, "enable_thinking", &f.enable_thinking, e) || serve_bool(kw, "preserve_thinking", &f.preserve_thinking, e)) return NULL;
    struct tok_chat_rendered out;
    char *text = tok_chat_template_render(srv->tok->chat_template, msgs, tools, &f, &out);
    if (!text) return serve_bad(e, "messages", "the chat template refuses these messages: %s", out.error), NULL;
    if (out.n_media && !show) {
        free(text);
        return serve_bad(e, "messages", "image and video parts are not supported: coli runs the model on text only"), NULL;
    }
    if (j) {
        j->think = f.enable_thinking != 0;
        j->tools = tools && tools->kind == JSON_ARRAY && tools->child ? tools : NULL;
    }
    *len = out.len;
    return text;
}

/* The prompt of a completion: a string, or a list of token ids. Into J. */
static int serve_completion_prompt(struct serve *srv, const struct json *body, struct serve_job *j, struct serve_error *e)
{
    const struct json *p = json_get(body, "prompt");
    if (!p) return serve_bad(e, "prompt", "'prompt' is required");
    if (p->kind == JSON_ARRAY && p->child && p->child->kind == JSON_STRING && !p->child->next) p = p->child;
    if (p->kind == JSON_STRING) {
        j->req.n_prompt = tok_encode(srv->tok, p->str, p->len, 1, &j->prompt);
        return 0;
    }
    if (p->kind != JSON_ARRAY) return serve_bad(e, "prompt", "'prompt' must be a string or a list of token ids");
    for (const struct json *t = p->child; t; t = t->next) {
        if (t->kind != JSON_NUMBER || t->number != floor(t->number) || t->number < 0 || t->number >= srv->engine->m->cfg.n_vocab)
            return serve_bad(e, "prompt", "'prompt' token ids must be whole numbers in [0, %d)", srv->engine->m->cfg.n_vocab);
        j->prompt = plat_realloc(j->prompt, (size_t)(j->req.n_prompt + 1) * sizeof *j->prompt);
        j->prompt[j->req.n_prompt++] = (int)t->number;
    }
    return 0;
}

/* The generation settings of BODY into J: max tokens within the context left after the prompt,
 * sampling, stops, streaming. */
static int serve_settings(struct serve *srv, const struct json *body, struct serve_job *j, struct serve_error *e)
{
    int n_ctx = srv->engine->m->n_ctx;
    double max = -1, n = 1;
    const struct json *opts = json_get(body, "stream_options");
    if (serve_number(body, "max_tokens", 1, 1e9, 1, &max, e) || serve_number(body, "max_completion_tokens", 1, 1e9, 1, &max, e) ||
        serve_number(body, "n", 1, 1, 1, &n, e) || serve_bool(body, "stream", &j->stream, e) || serve_sampling(body, &j->req.sample, e) ||
        serve_stops(body, j, e))
        return -1;
    if (opts && opts->kind != JSON_OBJECT && opts->kind != JSON_NULL) return serve_bad(e, "stream_options", "'stream_options' must be an object");
    if (serve_bool(opts, "include_usage", &j->include_usage, e)) return -1;
    const struct json *format = json_get(body, "response_format");
    if (format && format->kind != JSON_NULL && !tok_json_is(json_get(format, "type"), "text"))
        return serve_bad(e, "response_format", "only {\"type\": \"text\"}: coli does not constrain sampling to JSON yet; drop "
                         "response_format and ask for JSON in the messages");
    if (j->req.n_prompt < 1) return serve_bad(e, j->chat ? "messages" : "prompt", "the prompt is empty");
    if (j->req.n_prompt >= n_ctx)
        return serve_bad(e, j->chat ? "messages" : "prompt", "the prompt has %d tokens but the context holds %d (and one more to generate): shorten it, or start coli serve with a larger -c", j->req.n_prompt, n_ctx);
    int room = n_ctx - j->req.n_prompt;
    j->req.n_max = max > 0 ? (max < room ? (int)max : room) : srv->default_max > 0 && srv->default_max < room ? srv->default_max : room;
    return 0;
}

/* Where J's prompt is to keep checkpoints (engine_request.mark): where the turn after the
 * first opens (the system prompt and the tools end there, which other conversations share)
 * and where the answer's turn opens, at the last <|im_start|>: the next turn re-renders this
 * answer without its thinking, so it departs from this prompt there. */
static void serve_marks(const struct tok *t, struct serve_job *j)
{
    int im_start = tok_find(t, "<|im_start|>"), n = j->req.n_prompt;
    for (int i = 1; i < n && im_start >= 0 && !j->req.mark[0]; i++)
        if (j->prompt[i] == im_start) j->req.mark[0] = i;
    for (int i = n - 1; i > j->req.mark[0] && im_start >= 0 && !j->req.mark[1]; i--)
        if (j->prompt[i] == im_start) j->req.mark[1] = i;
}

/* A job for BODY (a chat or a completion); NULL with E set when the request is bad. */
static struct serve_job *serve_job_new(struct serve *srv, int chat, const char *body_text, size_t n, struct serve_error *e)
{
    const char *why = NULL;
    struct json *body = json_parse(body_text, n, &why);
    if (!body) return serve_bad(e, NULL, "the body is not valid JSON: %s", why), NULL;
    struct serve_job *j = plat_zalloc(1, sizeof *j);
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->chat = chat;
    j->req.reuse = 1;
    j->req.sample = srv->sample;
    j->req.sample.seed = (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)j;
    j->body = body;
    int bad = body->kind != JSON_OBJECT ? serve_bad(e, NULL, "the body must be a JSON object") : 0;
    if (!bad && chat) {
        size_t len;
        char *text = serve_chat_text(srv, body, j, 0, &len, e);
        if (text) j->req.n_prompt = tok_encode(srv->tok, text, len, 1, &j->prompt);
        bad = !text;
        free(text);
        j->answer.part = j->think ? SERVE_PART_REASONING : SERVE_PART_CONTENT;
    } else if (!bad) bad = serve_completion_prompt(srv, body, j, e);
    bad = bad || serve_settings(srv, body, j, e) || serve_bool(body, "cache_prompt", &j->req.reuse, e);
    if (bad) {
        serve_job_free(j);
        return NULL;
    }
    j->req.prompt = j->prompt;
    j->req.whole = 1;
    serve_marks(srv->tok, j);
    j->req.sink = serve_sink;
    j->req.sink_ctx = j;
    j->req.cancel = &j->cancel;
    return j;
}

/* ---- answers ---- */

static unsigned long long serve_next_id(void)
{
    static unsigned long long counter;
    return __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
}

static int serve_is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* Whether KEY's schema in tool NAME of TOOLS (a list of {"type":"function","function":{...}})
 * allows a value of kind KIND: its "type" names it (or lists it), or it says no type. */
static int serve_schema_allows(const struct json *tools, const char *name, const char *key, enum json_kind kind, int integer)
{
    static const char *const names[] = {"null", "boolean", "number", "string", "array", "object"};
    const struct json *props = NULL;
    for (const struct json *t = tools ? tools->child : NULL; t && !props; t = t->next) {
        const struct json *f = json_get(t, "function") ? json_get(t, "function") : t;
        if (tok_json_is(json_get(f, "name"), name)) props = json_get(json_get(f, "parameters"), "properties");
    }
    const struct json *type = json_get(json_get(props, key), "type");
    if (!type) return 1;
    for (const struct json *k = type->kind == JSON_ARRAY ? type->child : type; k; k = type->kind == JSON_ARRAY ? k->next : NULL)
        if (tok_json_is(k, names[kind]) || (kind == JSON_NUMBER && integer && tok_json_is(k, "integer"))) return 1;
    return 0;
}

/* A parameter's text V[0..n) as the JSON value its schema asks for: a number, boolean, null,
 * object or list where the text is one and the schema allows it (Python's True and False, which
 * Qwen3.5's template writes, count as booleans), else a string. Appended to B. */
static void serve_typed_value(struct tok_buf *b, const struct json *tools, const char *name, const char *key, const char *v, size_t n)
{
    const char *why;
    struct json *parsed = NULL, py_bool = {.kind = JSON_BOOL, .boolean = n == 4 && !memcmp(v, "True", 4)};
    const struct json *value = NULL;
    if ((n == 4 && !memcmp(v, "True", 4)) || (n == 5 && !memcmp(v, "False", 5))) value = &py_bool;
    else value = parsed = json_parse(v, n, &why);
    int integer = value && value->kind == JSON_NUMBER && !strpbrk(value->str, ".eE");
    if (value && value->kind != JSON_STRING && serve_schema_allows(tools, name, key, value->kind, integer)) tok_json_dump(b, value);
    else json_put_string(b, v, n);
    json_free(parsed);
}

/* Skips space at *P (before END), then LIT; 0 if LIT is not there. */
static int serve_expect(const char **p, const char *end, const char *lit)
{
    while (*p < end && serve_is_space(**p)) (*p)++;
    size_t n = strlen(lit);
    if ((size_t)(end - *p) < n || memcmp(*p, lit, n)) return 0;
    *p += n;
    return 1;
}

/* The text up to '>' at *P as a NUL-terminated copy (a name: one line, not empty), or NULL. */
static char *serve_tag_name(const char **p, const char *end)
{
    const char *q = *p;
    while (q < end && *q != '>' && *q != '\n' && *q != '<') q++;
    if (q == *p || q >= end || *q != '>') return NULL;
    char *name = plat_alloc((size_t)(q - *p) + 1);
    memcpy(name, *p, (size_t)(q - *p));
    name[q - *p] = 0;
    *p = q + 1;
    return name;
}

/* The block B[0..n) as the template teaches the model to write a call:
 *   <tool_call> <function=NAME> (<parameter=KEY>\nVALUE\n</parameter>)* </function> </tool_call>
 * appended to A's calls with its arguments typed by the tools' schemas; 0 if it is not that. */
static int serve_parse_call(struct serve_answer *a, const struct json *tools, const char *b, size_t n)
{
    const char *p = b, *end = b + n;
    char *name = NULL, *key = NULL;
    struct tok_buf args = {NULL, 0, 0};
    int ok = serve_expect(&p, end, "<tool_call>") && serve_expect(&p, end, "<function=") && (name = serve_tag_name(&p, end));
    tok_buf_puts(&args, "{");
    while (ok && !serve_expect(&p, end, "</function>")) {
        const char *close;
        ok = serve_expect(&p, end, "<parameter=") && (key = serve_tag_name(&p, end)) &&
             (close = memmem(p, (size_t)(end - p), "</parameter>", 12));
        if (!ok) break;
        const char *v = p, *v_end = close;
        if (v < v_end && *v == '\n') v++;
        if (v_end > v && v_end[-1] == '\n') v_end--;
        if (args.n > 1) tok_buf_puts(&args, ", ");
        json_put_string(&args, key, strlen(key));
        tok_buf_puts(&args, ": ");
        serve_typed_value(&args, tools, name, key, v, (size_t)(v_end - v));
        free(key);
        key = NULL;
        p = close + 12;
    }
    ok = ok && serve_expect(&p, end, "</tool_call>");
    while (ok && p < end && serve_is_space(*p)) p++;
    free(key);
    if (!ok || p != end) {
        free(name);
        free(args.p);
        return 0;
    }
    tok_buf_puts(&args, "}");
    a->calls = plat_realloc(a->calls, (size_t)(a->n_calls + 1) * sizeof *a->calls);
    a->calls[a->n_calls++] = (struct serve_tool_call){name, args.p};
    return 1;
}

/* Moves S[0..n) into field PART, without the field's leading space and, unless the field's
 * text ENDS here, without its trailing space (which waits for what follows). Returns the bytes
 * taken from S. */
static size_t serve_answer_place(struct serve_answer *a, enum serve_part part, const char *s, size_t n, int ends)
{
    struct tok_buf *f = &a->field[part];
    size_t from = 0, to = n;
    if (!f->n) while (from < n && serve_is_space(s[from])) from++;
    while (to > from && serve_is_space(s[to - 1])) to--;
    if (to > from) tok_buf_put(f, s + from, to - from);
    return ends ? n : to;
}

/* The longest end of S[0..n) that begins TAG: text that may still turn into it. */
static size_t serve_tag_holdback(const char *s, size_t n, const char *tag)
{
    size_t len = strlen(tag);
    for (size_t k = len - 1 < n ? len - 1 : n; k > 0; k--)
        if (!memcmp(s + n - k, tag, k)) return k;
    return 0;
}

/* Feeds released answer text S[0..n) (whole characters) to A; FINAL: nothing more comes.
 * Thinking ends at </think>; with tools, a <tool_call> block becomes a call, or text if it
 * does not parse. */
static void serve_answer_feed(struct serve_answer *a, const struct json *tools, const char *s, size_t n, int final)
{
    tok_buf_put(&a->pending, s, n);
    for (int more = 1; more;) {
        char *p = a->pending.p;
        size_t len = a->pending.n, used;
        if (a->part == SERVE_PART_CALL) {
            char *close = memmem(p, len, "</tool_call>", 12);
            if (!close && !final) return;
            used = close ? (size_t)(close + 12 - p) : len;
            if (!serve_parse_call(a, tools, p, used)) serve_answer_place(a, SERVE_PART_CONTENT, p, used, 0);
            a->part = SERVE_PART_CONTENT;
        } else {
            const char *tag = a->part == SERVE_PART_REASONING ? "</think>" : tools ? "<tool_call>" : NULL;
            char *at = tag ? memmem(p, len, tag, strlen(tag)) : NULL;
            more = at != NULL;
            if (!at) used = serve_answer_place(a, a->part, p, len - (final || !tag ? 0 : serve_tag_holdback(p, len, tag)), final);
            else if (a->part == SERVE_PART_REASONING) {
                used = serve_answer_place(a, a->part, p, (size_t)(at - p), 1) + 8;
                a->part = SERVE_PART_CONTENT;
            } else {
                used = serve_answer_place(a, a->part, p, (size_t)(at - p), 1);
                a->part = SERVE_PART_CALL;
            }
        }
        memmove(p, p + used, len - used);
        a->pending.n = len - used;
        p[a->pending.n] = 0;
    }
}

static const char *serve_finish_reason(const struct serve_job *j)
{
    if (j->answer.n_calls && j->gen.stop == ENGINE_STOP_EOG) return "tool_calls";
    return j->gen.stop == ENGINE_STOP_LENGTH || j->gen.stop == ENGINE_STOP_CONTEXT ? "length" : "stop";
}

/* usage (cached_tokens: the prompt tokens reused, not computed), and the server's own times. */
static void serve_usage(FILE *f, const struct serve_job *j)
{
    fprintf(f, "\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"total_tokens\":%d,\"prompt_tokens_details\":{\"cached_tokens\":%d}},",
            j->gen.n_prompt, j->gen.n_tokens, j->gen.n_prompt + j->gen.n_tokens, j->gen.n_cached);
    fprintf(f, "\"timings\":{\"prompt_ms\":%.3f,\"decode_ms\":%.3f}", j->gen.prompt_s * 1e3, j->gen.decode_s * 1e3);
}

/* The head of a chat or completion object (or chunk): id, object, created, model. */
static void serve_object_head(FILE *f, struct serve *srv, const struct serve_job *j, unsigned long long id, time_t created)
{
    const char *object = j->chat ? (j->stream ? "chat.completion.chunk" : "chat.completion") : "text_completion";
    fprintf(f, "{\"id\":\"%s-%llx\",\"object\":\"%s\",\"created\":%lld,\"model\":", j->chat ? "chatcmpl" : "cmpl", id, object, (long long)created);
    json_write_string(f, srv->model_id, strlen(srv->model_id));
}

/* Call K of J's answer as OpenAI writes a tool call (with its INDEX in a stream delta). */
static void serve_write_call(FILE *f, const struct serve_job *j, unsigned long long id, int k, int index)
{
    const struct serve_tool_call *call = &j->answer.calls[k];
    fputc('{', f);
    if (index) fprintf(f, "\"index\":%d,", k);
    fprintf(f, "\"id\":\"call_%llx_%d\",\"type\":\"function\",\"function\":{\"name\":", id, k);
    json_write_string(f, call->name, strlen(call->name));
    fputs(",\"arguments\":", f);
    json_write_string(f, call->arguments, strlen(call->arguments));
    fputs("}}", f);
}

/* A chat answer's message: content (null when there are only calls), reasoning_content when
 * the model thought, tool_calls when it called. */
static void serve_write_message(FILE *f, const struct serve_job *j, unsigned long long id)
{
    const struct serve_answer *a = &j->answer;
    fputs("\"message\":{\"role\":\"assistant\",\"content\":", f);
    if (a->n_calls && !a->field[SERVE_PART_CONTENT].n) fputs("null", f);
    else json_write_string(f, a->field[SERVE_PART_CONTENT].p ? a->field[SERVE_PART_CONTENT].p : "", a->field[SERVE_PART_CONTENT].n);
    if (a->field[SERVE_PART_REASONING].n) {
        fputs(",\"reasoning_content\":", f);
        json_write_string(f, a->field[SERVE_PART_REASONING].p, a->field[SERVE_PART_REASONING].n);
    }
    if (a->n_calls) fputs(",\"tool_calls\":[", f);
    for (int k = 0; k < a->n_calls; k++) {
        if (k) fputc(',', f);
        serve_write_call(f, j, id, k, 0);
    }
    fputs(a->n_calls ? "]}" : "}", f);
}

/* The whole answer of a finished job that did not stream. */
static char *serve_answer_json(struct serve *srv, struct serve_job *j, size_t *n)
{
    char *out = NULL;
    unsigned long long id = serve_next_id();
    FILE *f = open_memstream(&out, n);
    serve_object_head(f, srv, j, id, time(NULL));
    fputs(",\"choices\":[{\"index\":0,", f);
    if (j->chat) {
        serve_answer_feed(&j->answer, j->tools, j->text ? j->text : "", j->len, 1);
        serve_write_message(f, j, id);
    } else {
        fputs("\"text\":", f);
        json_write_string(f, j->text ? j->text : "", j->len);
    }
    fprintf(f, ",\"finish_reason\":\"%s\"}],", serve_finish_reason(j));
    serve_usage(f, j);
    fputs("}", f);
    fclose(f);
    return out;
}

/* The error of a generation that failed (a model file that became unreadable, say: 500) or was
 * cancelled because the server is stopping (503). */
static struct serve_error serve_gen_error(const struct serve_job *j)
{
    struct serve_error e = {500, "server_error", "generation_failed", "", ""};
    if (j->gen.stop == ENGINE_STOP_CANCEL) {
        e.status = 503;
        e.code = "shutting_down";
        snprintf(e.message, sizeof e.message, "the server is shutting down");
    } else snprintf(e.message, sizeof e.message, "the generation failed: %.500s", j->gen.error);
    return e;
}

/* One server-sent event as one chunk of a chunked body. */
static int serve_event(int fd, const char *data, size_t n)
{
    char head[32];
    int h = snprintf(head, sizeof head, "%zx\r\ndata: ", n + 8);
    return serve_write(fd, head, (size_t)h) || serve_write(fd, data, n) || serve_write(fd, "\n\n\r\n", 4) ? -1 : 0;
}

/* A streamed chunk: CHOICE (the members of the choice after its index: a delta, or a
 * completion's text) with FINISH (NULL: null), or the usage (CHOICE NULL). */
static int serve_chunk(struct serve_conn *c, const struct serve_job *j, unsigned long long id, time_t created, const char *choice, const char *finish)
{
    char *out = NULL;
    size_t len;
    FILE *f = open_memstream(&out, &len);
    serve_object_head(f, c->srv, j, id, created);
    if (!choice) {
        fputs(",\"choices\":[],", f);
        serve_usage(f, j);
    } else {
        fprintf(f, ",\"choices\":[{\"index\":0,%s,\"finish_reason\":", choice);
        if (finish) fprintf(f, "\"%s\"}]", finish);
        else fputs("null}]", f);
    }
    fputs("}", f);
    fclose(f);
    int r = serve_event(c->fd, out, len);
    free(out);
    return r;
}

/* A chunk of new text: a chat delta of FIELD, or a completion's text. */
static int serve_text_chunk(struct serve_conn *c, const struct serve_job *j, unsigned long long id, time_t created, const char *field,
                            const char *text, size_t n)
{
    char *choice = NULL;
    size_t len;
    FILE *f = open_memstream(&choice, &len);
    if (j->chat) fprintf(f, "\"delta\":{\"%s\":", field);
    else fputs("\"text\":", f);
    json_write_string(f, text, n);
    if (j->chat) fputc('}', f);
    fclose(f);
    int r = serve_chunk(c, j, id, created, choice, NULL);
    free(choice);
    return r;
}

/* What a chat stream has sent of each field of the answer. */
struct serve_sent { size_t field[2]; int calls; };

/* Sends what the answer's fields gained since SENT: thinking, content, then whole calls. */
static int serve_send_answer(struct serve_conn *c, struct serve_job *j, unsigned long long id, time_t created, struct serve_sent *sent)
{
    static const char *const names[2] = {"reasoning_content", "content"};
    const struct serve_answer *a = &j->answer;
    int gone = 0;
    for (int k = 0; k < 2 && !gone; k++)
        if (a->field[k].n > sent->field[k]) {
            gone = serve_text_chunk(c, j, id, created, names[k], a->field[k].p + sent->field[k], a->field[k].n - sent->field[k]);
            sent->field[k] = a->field[k].n;
        }
    for (; sent->calls < a->n_calls && !gone; sent->calls++) {
        char *choice = NULL;
        size_t len;
        FILE *f = open_memstream(&choice, &len);
        fputs("\"delta\":{\"tool_calls\":[", f);
        serve_write_call(f, j, id, sent->calls, 1);
        fputs("]}", f);
        fclose(f);
        gone = serve_chunk(c, j, id, created, choice, NULL);
        free(choice);
    }
    return gone;
}

/* Whether the client of FD has gone: it hung up (a pipelined request waiting is not that). */
static int serve_client_gone(int fd)
{
    struct pollfd pf = {fd, POLLRDHUP, 0};
    return poll(&pf, 1, 0) > 0 && (pf.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

/* Waits until J has text past SENT or is done, cancelling it if the client goes; returns the
 * bytes released, copied into *PIECE (malloc'd, or NULL). */
static size_t serve_job_wait(struct serve_conn *c, struct serve_job *j, size_t sent, char **piece)
{
    *piece = NULL;
    pthread_mutex_lock(&j->mu);
    while (!j->done && j->released <= sent) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 200 * 1000000L; /* how soon a client that left is noticed while the prompt runs */
        if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
        if (pthread_cond_timedwait(&j->cv, &j->mu, &ts) == ETIMEDOUT && serve_client_gone(c->fd)) j->cancel = 1;
    }
    size_t n = j->released > sent ? j->released - sent : 0;
    if (n) {
        *piece = plat_alloc(n);
        memcpy(*piece, j->text + sent, n);
    }
    pthread_mutex_unlock(&j->mu);
    return n;
}

/* Streams J's answer as it comes. Returns -1 when the client went away. */
static int serve_stream(struct serve_conn *c, struct serve_job *j)
{
    static const char head[] = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                               "Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n";
    unsigned long long id = serve_next_id();
    time_t created = time(NULL);
    int gone = serve_write(c->fd, head, sizeof head - 1) ||
               (j->chat && serve_chunk(c, j, id, created, "\"delta\":{\"role\":\"assistant\",\"content\":\"\"}", NULL));
    size_t released = 0;
    struct serve_sent sent = {{0, 0}, 0};
    for (int done = 0; !done;) {
        char *piece;
        size_t n = serve_job_wait(c, j, released, &piece);
        released += n;
        pthread_mutex_lock(&j->mu);
        done = j->done && j->released <= released;
        pthread_mutex_unlock(&j->mu);
        if (j->chat) serve_answer_feed(&j->answer, j->tools, piece ? piece : "", n, done);
        if (!gone) gone = j->chat ? serve_send_answer(c, j, id, created, &sent) : n && serve_text_chunk(c, j, id, created, NULL, piece, n);
        free(piece);
        if (gone) j->cancel = 1;
    }
    if (gone || (j->gen.stop == ENGINE_STOP_CANCEL && !serve_stopping)) return -1;
    if (j->gen.stop == ENGINE_STOP_ERROR || j->gen.stop == ENGINE_STOP_CANCEL) {
        struct serve_error e = serve_gen_error(j);
        size_t n;
        char *body = serve_error_json(&e, &n);
        gone = serve_event(c->fd, body, n);
        free(body);
    } else {
        gone = serve_chunk(c, j, id, created, j->chat ? "\"delta\":{}" : "\"text\":\"\"", serve_finish_reason(j)) ||
               (j->include_usage && serve_chunk(c, j, id, created, NULL, NULL));
    }
    return gone || serve_event(c->fd, "[DONE]", 6) || serve_write(c->fd, "0\r\n\r\n", 5) ? -1 : 0;
}

/* A generation endpoint: the request becomes a job, queued, then answered whole or streamed.
 * Returns -1 when the connection is to close. */
static int serve_generate(struct serve_conn *c, const struct serve_request *r, int chat)
{
    struct serve_error e = {400, "invalid_request_error", NULL, "", ""};
    struct serve_job *j = NULL;
    if (!serve_ready(c->srv)) serve_loading(&e); /* the job's prompt needs the tokenizer */
    else j = serve_job_new(c->srv, chat, r->body, r->body_len, &e);
    if (!j || serve_submit(c->srv, j, &e)) {
        serve_fail(c, &e, r->keep_alive);
        if (j) serve_job_free(j);
        return r->keep_alive ? 0 : -1;
    }
    int status = 200, rc;
    if (j->stream) rc = serve_stream(c, j);
    else {
        char *piece;
        serve_job_wait(c, j, SIZE_MAX, &piece); /* releases nothing past SIZE_MAX: waits for the end */
        if (j->gen.stop == ENGINE_STOP_CANCEL && !serve_stopping) rc = -1; /* the client left */
        else if (j->gen.stop == ENGINE_STOP_ERROR || j->gen.stop == ENGINE_STOP_CANCEL) {
            e = serve_gen_error(j);
            serve_fail(c, &e, r->keep_alive);
            status = e.status;
            rc = 0;
        } else {
            size_t n;
            char *body = serve_answer_json(c->srv, j, &n);
            rc = serve_respond(c, 200, "application/json", body, n, NULL, r->keep_alive);
            free(body);
        }
    }
    if (status == 200) serve_count(c->srv, 200);
    plat_log("[serve] %s %s: prompt %d tokens, %d cached (%d computed at %.1f tok/s), %d generated (%.1f tok/s), %s%s", r->method, r->path,
             j->gen.n_prompt, j->gen.n_cached, j->gen.n_prompt - j->gen.n_cached, plat_ratio(j->gen.n_prompt - j->gen.n_cached, j->gen.prompt_s), j->gen.n_tokens,
             j->gen.decode_s > 0 && j->gen.n_tokens > 1 ? (j->gen.n_tokens - 1) / j->gen.decode_s : 0.0, engine_stop_names[j->gen.stop],
             rc ? " (client gone)" : "");
    serve_job_free(j);
    return rc || !r->keep_alive ? -1 : 0;
}

/* ---- endpoints, connections, the listening socket ---- */

/* /metrics in the Prometheus text format. */
static char *serve_metrics(struct serve *srv, size_t *n)
{
    struct serve_stats st;
    pthread_mutex_lock(&srv->stats_mu);
    st = srv->stats;
    pthread_mutex_unlock(&srv->stats_mu);
    pthread_mutex_lock(&srv->mu);
    int queued = srv->queue_len;
    pthread_mutex_unlock(&srv->mu);
    char *out = NULL;
    FILE *f = open_memstream(&out, n);
    fputs("# TYPE coli_requests_total counter\n", f);
    for (int k = 0; k < SERVE_STATUS_KINDS && st.status[k]; k++)
        fprintf(f, "coli_requests_total{code=\"%d\"} %llu\n", st.status[k], (unsigned long long)st.by_status[k]);
    fprintf(f, "# TYPE coli_prompt_tokens_total counter\ncoli_prompt_tokens_total %llu\n", (unsigned long long)st.prompt_tokens);
    fprintf(f, "# TYPE coli_generated_tokens_total counter\ncoli_generated_tokens_total %llu\n", (unsigned long long)st.generated_tokens);
    fprintf(f, "# TYPE coli_prompt_tokens_cached_total counter\ncoli_prompt_tokens_cached_total %llu\n", (unsigned long long)st.cached_tokens);
    fprintf(f, "# TYPE coli_prompt_tokens_per_second gauge\ncoli_prompt_tokens_per_second %.3f\n",
            plat_ratio(st.prompt_tokens - st.cached_tokens, st.prompt_s));
    fprintf(f, "# TYPE coli_decode_tokens_per_second gauge\ncoli_decode_tokens_per_second %.3f\n",
            plat_ratio(st.generated_tokens > st.requests_done ? st.generated_tokens - st.requests_done : 0, st.decode_s));
    fprintf(f, "# TYPE coli_queue_length gauge\ncoli_queue_length %d\n", queued);
    fprintf(f, "# TYPE coli_slots_busy gauge\ncoli_slots_busy %d\n# TYPE coli_slots_total gauge\ncoli_slots_total %d\n", st.slots_busy, srv->n_slots);
    fputs("# TYPE coli_expert_hit_rate gauge\n# TYPE coli_expert_vram_rate gauge\n", f);
    for (int ph = 0; ph < 2; ph++) {
        const char *name = ph ? "decode" : "prompt";
        fprintf(f, "coli_expert_hit_rate{phase=\"%s\"} %.4f\n", name, plat_ratio(st.experts.hits[ph], st.experts.lookups[ph]));
        fprintf(f, "coli_expert_vram_rate{phase=\"%s\"} %.4f\n", name, plat_ratio(st.experts.vram[ph], st.experts.lookups[ph]));
    }
    int64_t rss = plat_read_number("/proc/self/status", "VmRSS");
    fprintf(f, "# TYPE coli_resident_bytes gauge\ncoli_resident_bytes %lld\n", (long long)(rss < 0 ? -1 : rss * 1024));
    fputs("# TYPE coli_vram_used_bytes gauge\n", f);
    for (int d = 0; d < cuda.n_devices; d++) fprintf(f, "coli_vram_used_bytes{device=\"%d\"} %lld\n", d, (long long)cuda.dev[d].used);
    fclose(f);
    return out;
}

/* GET endpoints: /health, /v1/models, /metrics. */
static int serve_get(struct serve_conn *c, const struct serve_request *r)
{
    struct serve *srv = c->srv;
    char *out = NULL;
    size_t n = 0;
    int status = 200;
    if (!strcmp(r->path, "/health")) {
        status = serve_ready(srv) ? 200 : 503;
        out = plat_strdup(status == 200 ? "{\"status\":\"ok\"}" : "{\"status\":\"loading\"}");
        n = strlen(out);
    } else if (!strcmp(r->path, "/v1/models")) {
        FILE *f = open_memstream(&out, &n);
        fputs("{\"object\":\"list\",\"data\":[{\"id\":", f);
        json_write_string(f, srv->model_id, strlen(srv->model_id));
        fprintf(f, ",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"coli\"}]}", (long long)srv->started);
        fclose(f);
    } else out = serve_metrics(srv, &n);
    int metrics = !strcmp(r->path, "/metrics");
    int rc = serve_respond(c, status, metrics ? "text/plain; version=0.0.4" : "application/json", out, n,
                           status == 503 ? "Retry-After: 1\r\n" : NULL, r->keep_alive);
    free(out);
    serve_count(srv, status);
    return rc || !r->keep_alive ? -1 : 0;
}

/* POST /apply-template: the prompt a chat request's messages render to, as {"prompt": TEXT}
 * (llama.cpp's endpoint of that name), so that a client can see what the model is given. */
static int serve_apply_template(struct serve_conn *c, const struct serve_request *r)
{
    struct serve_error e = {400, "invalid_request_error", NULL, "", ""};
    const char *why = NULL;
    struct json *body = json_parse(r->body, r->body_len, &why);
    size_t len = 0;
    char *text = NULL;
    if (!serve_ready(c->srv)) serve_loading(&e);
    else if (!body) serve_bad(&e, NULL, "the body is not valid JSON: %s", why);
    else if (body->kind != JSON_OBJECT) serve_bad(&e, NULL, "the body must be a JSON object");
    else text = serve_chat_text(c->srv, body, NULL, 1, &len, &e);
    json_free(body);
    if (!text) {
        serve_fail(c, &e, r->keep_alive);
        return r->keep_alive ? 0 : -1;
    }
    char *out = NULL;
    size_t n;
    FILE *f = open_memstream(&out, &n);
    fputs("{\"prompt\":", f);
    json_write_string(f, text, len);
    fputs("}", f);
    fclose(f);
    int rc = serve_respond(c, 200, "application/json", out, n, NULL, r->keep_alive);
    free(out);
    free(text);
    serve_count(c->srv, 200);
    return rc || !r->keep_alive ? -1 : 0;
}

/* Whether R carries the server's key (always, when there is none). */
static int serve_authorized(const struct serve *srv, const struct serve_request *r)
{
    if (!srv->api_key) return 1;
    if (strncasecmp(r->auth, "Bearer ", 7)) return 0;
    const char *given = r->auth + 7;
    size_t a = strlen(given), b = strlen(srv->api_key);
    unsigned diff = a != b;
    for (size_t i = 0; i < a && i < b; i++) diff |= (unsigned char)(given[i] ^ srv->api_key[i]); /* time independent of where they differ */
    return !diff;
}

/* Answers one request; -1 when the connection is to close. */
static int serve_route(struct serve_conn *c, const struct serve_request *r)
{
    static const struct { const char *path, *method; } routes[] = {
        {"/health", "GET"}, {"/v1/models", "GET"}, {"/metrics", "GET"}, {"/v1/chat/completions", "POST"}, {"/v1/completions", "POST"},
        {"/apply-template", "POST"}};
    struct serve_error e = {404, "not_found_error", NULL, "", ""};
    int k = -1;
    for (int i = 0; i < (int)(sizeof routes / sizeof routes[0]); i++)
        if (!strcmp(r->path, routes[i].path)) k = i;
    if (k < 0) snprintf(e.message, sizeof e.message, "no endpoint %.200s", r->path);
    else if (strcmp(r->method, routes[k].method)) {
        e = (struct serve_error){405, "invalid_request_error", "method_not_allowed", "", ""};
        snprintf(e.message, sizeof e.message, "%.200s takes %s", r->path, routes[k].method);
    } else if (k > 0 && !serve_authorized(c->srv, r)) {
        e = (struct serve_error){401, "authentication_error", "invalid_api_key", "", "a missing or wrong API key (Authorization: Bearer KEY)"};
    } else return k < 3 ? serve_get(c, r) : k == 5 ? serve_apply_template(c, r) : serve_generate(c, r, k == 3);
    char allow[64];
    snprintf(allow, sizeof allow, "Allow: %s\r\n", k >= 0 ? routes[k].method : "GET");
    size_t n;
    char *body = serve_error_json(&e, &n);
    int rc = serve_respond(c, e.status, "application/json", body, n, e.status == 405 ? allow : e.status == 401 ? "WWW-Authenticate: Bearer\r\n" : NULL,
                           r->keep_alive);
    free(body);
    serve_count(c->srv, e.status);
    return rc || !r->keep_alive ? -1 : 0;
}

/* Lists FD among the open connections (so that stopping can shut them) or takes it off. */
static void serve_track(struct serve *srv, int fd, int add)
{
    pthread_mutex_lock(&srv->mu);
    for (int i = 0; i < SERVE_MAX_CONNS; i++)
        if (srv->conn_fds[i] == (add ? -1 : fd)) {
            srv->conn_fds[i] = add ? fd : -1;
            break;
        }
    srv->n_conns += add ? 1 : -1;
    pthread_mutex_unlock(&srv->mu);
}

/* Before closing on a refused request: stop sending, then read (for a second at most) what the
 * client still sends, so that the kernel does not answer its unread bytes with a reset that
 * could destroy the error answer before the client reads it. */
static void serve_linger(int fd)
{
    char sink[4096];
    shutdown(fd, SHUT_WR);
    for (int i = 0; i < 16; i++) {
        struct pollfd pf = {fd, POLLIN, 0};
        if (poll(&pf, 1, 1000) <= 0 || recv(fd, sink, sizeof sink, 0) <= 0) break;
    }
}

/* A connection's thread: requests one after another until the client closes, stays idle, or a
 * request is refused. */
static void *serve_conn_main(void *arg)
{
    struct serve_conn *c = arg;
    struct serve_request r;
    struct serve_error e;
    int got;
    while ((got = serve_read_request(c, &r, &e)) == 1 && !serve_route(c, &r) && !serve_stopping) free(r.body);
    if (got < 0) {
        serve_fail(c, &e, 0);
        serve_linger(c->fd);
    }
    free(r.body);
    serve_track(c->srv, c->fd, 0);
    close(c->fd);
    free(c);
    return NULL;
}

/* The acceptor's thread: a thread per connection, SERVE_MAX_CONNS at most (503 beyond). */
static void *serve_accept_main(void *arg)
{
    struct serve *srv = arg;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 << 10); /* a head buffer of 16 KiB twice, and little else */
    while (!serve_stopping) {
        struct pollfd pf[2] = {{srv->listen_fd, POLLIN, 0}, {srv->wake_pipe[0], POLLIN, 0}};
        if (poll(pf, 2, -1) <= 0 || !(pf[0].revents & POLLIN)) continue;
        int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) continue;
        pthread_mutex_lock(&srv->mu);
        int full = srv->n_conns >= SERVE_MAX_CONNS;
        pthread_mutex_unlock(&srv->mu);
        struct serve_conn *c = plat_zalloc(1, sizeof *c);
        c->srv = srv;
        c->fd = fd;
        if (full) {
            struct serve_error e = {503, "server_error", "too_many_connections", "", "too many connections; try again"};
            serve_fail(c, &e, 0);
            close(fd);
            free(c);
            continue;
        }
        serve_track(srv, fd, 1);
        pthread_t t;
        if (pthread_create(&t, &attr, serve_conn_main, c)) {
            serve_track(srv, fd, 0);
            close(fd);
            free(c);
        }
    }
    pthread_attr_destroy(&attr);
    return NULL;
}

/* Binds HOST:PORT (PORT 0: any free one) and listens; dies when it cannot (start-up). Returns the
 * port bound. */
static int serve_listen(struct serve *srv, const char *host, int port)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV}, *ai = NULL;
    char service[16];
    snprintf(service, sizeof service, "%d", port);
    int rc = getaddrinfo(host, service, &hints, &ai);
    if (rc) die("serve: cannot use the address %s: %s", host, gai_strerror(rc));
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol), one = 1;
    if (fd < 0) die("serve: socket: %s", strerror(errno));
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) || listen(fd, 128)) die("serve: cannot listen on %s:%d: %s", host, port, strerror(errno));
    freeaddrinfo(ai);
    struct sockaddr_storage sa;
    socklen_t len = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &len);
    srv->listen_fd = fd;
    return ntohs(sa.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&sa)->sin6_port : ((struct sockaddr_in *)&sa)->sin_port);
}

/* Whether HOST is a loopback address (then nothing outside this machine can reach the server). */
static int serve_is_loopback(const char *host)
{
    return !strcmp(host, "localhost") || !strncmp(host, "127.", 4) || !strcmp(host, "::1");
}

/* Starts answering on HOST:PORT before the model loads (/health says 503 until serve_ready):
 * signals, the acceptor thread. Logs the address. */
static void serve_start(struct serve *srv, const char *host, int port, pthread_t *acceptor)
{
    srv->started = (double)time(NULL);
    pthread_mutex_init(&srv->mu, NULL);
    pthread_cond_init(&srv->cv, NULL);
    pthread_mutex_init(&srv->stats_mu, NULL);
    for (int i = 0; i < SERVE_MAX_CONNS; i++) srv->conn_fds[i] = -1;
    int bound = serve_listen(srv, host, port);
    if (pipe2(srv->wake_pipe, O_CLOEXEC)) die("serve: pipe: %s", strerror(errno));
    serve_wake_fd = srv->wake_pipe[1];
    struct sigaction sa = {.sa_handler = serve_on_signal}, ign = {.sa_handler = SIG_IGN};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGPIPE, &ign, NULL); /* a client that left is an error from send, not a signal */
    const char *bracket = strchr(host, ':') ? "[" : "", *close_bracket = strchr(host, ':') ? "]" : "";
    plat_log("[serve] listening on http://%s%s%s:%d (loading the model)", bracket, host, close_bracket, bound);
    if (!serve_is_loopback(host)) plat_log("[serve] %s is not a loopback address: other machines can reach this server%s", host, srv->api_key ? "" : " (no --api-key)");
    if (pthread_create(acceptor, NULL, serve_accept_main, srv)) die("serve: cannot start the acceptor thread");
}

/* Stops: no more connections; the open ones are shut (each thread ends at its next read or
 * write) and waited for, two seconds at most. */
static void serve_stop(struct serve *srv, pthread_t acceptor)
{
    serve_stopping = 1;
    ssize_t w = write(srv->wake_pipe[1], "x", 1);
    (void)w;
    pthread_join(acceptor, NULL);
    close(srv->listen_fd);
    pthread_mutex_lock(&srv->mu);
    for (int i = 0; i < SERVE_MAX_CONNS; i++)
        if (srv->conn_fds[i] >= 0) shutdown(srv->conn_fds[i], SHUT_RDWR);
    pthread_mutex_unlock(&srv->mu);
    for (int tries = 0; tries < 200; tries++) {
        pthread_mutex_lock(&srv->mu);
        int left = srv->n_conns;
        pthread_mutex_unlock(&srv->mu);
        if (!left) break;
        usleep(10000);
    }
    serve_wake_fd = -1;
    close(srv->wake_pipe[0]);
    close(srv->wake_pipe[1]);
}

/* ==== §13 frontends ==== */
/* Owns: the commands a user runs (run, chat, plan, bench, info, tokenize): loading a
 *   session, the generation loop, streaming text, statistics, the --json record; the
 *   synthetic models plan, bench and info run on (a geometry's GGUF written in memory).
 * Promises: stdout carries only generated text (and the one --json line); everything else
 *   goes to stderr. A full context is a message, never a crash. Ctrl-C in chat stops the
 *   answer and keeps the session.
 * May call: §1–§10.
 * Workload: the generation loop calls model_forward once per token; the rest is start-up. */

struct cmd_options {
    const char *model, *prompt, *system;
    const char *synthetic;   /* --synthetic NAME[:QUANT[:LAYERS]] (plan, bench, info): instead of -m */
    int n_predict, n_bench_prompt, n_ctx, threads;
    enum ops_kv kv;          /* --kv */
    int chat, json, think, hide_think, ignore_eog, kernels;
    int seed_given;          /* --seed: bench draws its random prompt from it (else from 42) */
    int verbose;             /* -v: also what is only worth saying when something is wrong */
    struct sample_params sample;
    /* resources (design.md §3); -1 / NULL: not given */
    int64_t ram_bytes;       /* --ram: the expert cache's budget */
    const char *heat_path;   /* --heat or HEAT_FILE */
    const char *gpu_list;    /* --gpu LIST|off, or COLI_GPUS */
    int64_t vram_bytes;      /* --vram per device, or CUDA_EXPERT_GB */
    const char *place;       /* --place SPEC, or COLI_PLACE */
    enum expert_io expert_io; /* COLI_EXPERT_IO=direct|buffered: how the expert store reads */
    /* serve */
    const char *host, *api_key; /* --host (default 127.0.0.1); --api-key or COLI_API_KEY */
    int port, parallel, queue;  /* --port 8080; --parallel N slots (0: chosen from memory); --queue N */
    int64_t cache_ram;          /* --cache-ram SIZE: the prompt cache (-1: chosen from memory) */
};

struct cmd_session {
    struct model model;
    struct tok tok;
    struct engine engine;
    int think_open, think_close; /* <think> and </think> ids, -1 if absent */
};

static volatile sig_atomic_t cmd_interrupt;

static void cmd_on_sigint(int sig)
{
    (void)sig;
    cmd_interrupt = 1;
}

/* The server's default prompt cache for N_SLOTS conversations: an eighth of free memory,
 * SERVE_DEFAULT_CACHE at most, but never so much that the routed experts, which would fit in
 * memory without it, no longer do: it then takes what they leave. Every token reads experts,
 * and those left out are read from the disk; a prompt cache spares recomputing a prefix now
 * and then (README, Serve). It counts every expert in RAM: those a device takes would leave
 * more. RAM: --ram (given: the experts' budget is the user's). */
static int64_t cmd_prompt_cache(const struct model *m, int n_slots, int64_t ram)
{
    const int64_t avail = plat_mem_available(), eighth = avail > 0 ? avail / 8 : 0;
    const int64_t cache = eighth < SERVE_DEFAULT_CACHE ? eighth : SERVE_DEFAULT_CACHE;
    if (ram >= 0 || !m->cfg.n_expert) return cache;
    const int64_t fit = model_expert_budget(m, n_slots, 0, -1).budget - (int64_t)model_expert_bytes(m);
    if (fit < 0 || fit >= cache) return cache;
    const int64_t slack = 128 << 20, room = fit > slack ? fit - slack : 0; /* free memory moves a little before the placement reads it */
    plat_log("[serve] prompt cache: %.2f GiB, what memory leaves once the routed experts fit (%.2f GiB would have left them out)",
             room / 1073741824.0, cache / 1073741824.0);
    return room;
}

/* Loads O's model for N_SLOTS conversations at once (the engine's slots; 0: as many as memory
 * holds, model_choose_seqs), with CACHE bytes kept for the prompt cache (§11; the server's: < 0
 * its default, cmd_prompt_cache; 0 elsewhere) and the experts copied where memory holds them
 * COPIES times (model_copies). */
static void cmd_open(struct cmd_session *s, const struct cmd_options *o, int n_slots, int64_t cache, enum model_copies copies)
{
    double t0 = plat_now();
    if (!o->model) die_usage("no model given (-m MODEL.gguf)");
    model_load(&s->model, o->model, o->n_ctx, o->kv);
    tok_load(&s->tok, &s->model.file);
    if (s->tok.n_vocab > s->model.cfg.n_vocab)
        die("%s: the tokenizer has %d tokens but the embedding only %d rows", o->model, s->tok.n_vocab, s->model.cfg.n_vocab);
    s->think_open = tok_find(&s->tok, "<think>");
    s->think_close = tok_find(&s->tok, "</think>");
    const struct model_config *c = &s->model.cfg;
    if (n_slots <= 0) {
        n_slots = model_choose_seqs(&s->model, o->ram_bytes);
        plat_log("[coli] %d conversation%s at once (--parallel): each holds %.1f MiB of KV cache and state at context %d", n_slots,
                 n_slots == 1 ? "" : "s", model_seq_bytes(&s->model) / 1048576.0, s->model.n_ctx);
    }
    if (cache < 0) cache = cmd_prompt_cache(&s->model, n_slots, o->ram_bytes);
    /* the experts' budget counts the trunk's copy still to come (measured after it, the copy
     * and the file's pages it has just read would both be taken for used memory) */
    model_place_weights(&s->model, n_slots, cache, o->ram_bytes, copies, o->heat_path, o->expert_io, o->place);
    model_own_trunk(&s->model);
    engine_init(&s->engine, &s->model, &s->tok, n_slots, cache);
    /* said last: the copies of the trunk and the experts above are most of the time */
    plat_log("[coli] %s: %s, %d layers, dim %d, %d experts (top %d), vocab %d; context %d of %d tokens%s; %d threads, %s kernels; loaded in %.2f s",
             o->synthetic ? o->synthetic : o->model, model_arch_names[c->arch], c->n_layers, c->dim, c->n_expert, c->n_expert_used, c->n_vocab,
             s->model.n_ctx, c->ctx_train, s->model.kv == OPS_KV_F16 ? " (KV cache fp16)" : s->model.kv == OPS_KV_Q8_0 ? " (KV cache q8_0)" : "", plat_threads(), quant_level_name(), plat_now() - t0);
}

/* Saves the heat (the next run starts warm) and frees the session. */
static void cmd_close(struct cmd_session *s)
{
    if (s->model.experts) expert_heat_save(s->model.experts);
    cuda_release_all(); /* residency is keyed by addresses in the mapping model_free unmaps */
    engine_free(&s->engine);
    tok_free(&s->tok);
    model_free(&s->model);
}

/* How generated pieces reach the terminal: whole UTF-8 characters only; the thinking
 * block dimmed (on a terminal) or hidden. */
struct cmd_printer {
    const struct cmd_session *s;
    struct tok_utf8_stream utf8;
    int in_think, hide_think, dim;
};

/* An engine sink: prints the piece of token ID; never stops the generation. */
static int cmd_print_piece(void *ctx, int id, const char *piece, size_t len)
{
    struct cmd_printer *p = ctx;
    char out[512];
    int tag_open = id >= 0 && id == p->s->think_open, tag_close = id >= 0 && id == p->s->think_close;
    if (tag_open) {
        p->in_think = 1;
        if (p->dim && !p->hide_think) fputs("\033[2m", stdout);
    }
    if (!(p->in_think && p->hide_think)) {
        while (len > 0) {
            size_t take = len < 256 ? len : 256;
            size_t n = tok_stream_push(&p->utf8, piece, take, out, sizeof out);
            fwrite(out, 1, n, stdout);
            piece += take;
            len -= take;
        }
    }
    if (tag_close) {
        if (p->dim && !p->hide_think) fputs("\033[0m", stdout);
        p->in_think = 0;
    }
    fflush(stdout);
    return 0;
}

/* The engine request of a one-conversation command: O's sampling and flags, PROMPT, N_MAX
 * tokens, Ctrl-C (cmd_interrupt) cancelling, PRINTER (or NULL) printing. */
static struct engine_request cmd_request(const struct cmd_options *o, const int *prompt, int n_prompt, int n_max,
                                         struct cmd_printer *printer)
{
    struct engine_request r = {prompt, n_prompt, 0, 0, {0, 0}, n_max, o->sample, o->ignore_eog, o->json, NULL, printer, &cmd_interrupt, NULL};
    if (printer) r.sink = cmd_print_piece;
    return r;
}

/* Peak resident set of this process in bytes (VmHWM); -1 if unknown. */
static int64_t cmd_peak_rss(void)
{
    int64_t kib = plat_read_number("/proc/self/status", "VmHWM");
    return kib < 0 ? -1 : kib * 1024;
}

/* The expert store's figures since the session opened: hit rates (an expert already in
 * memory when its layer routed to it), reads, the disk's throughput while reading, how
 * many routed experts the prefetch guessed, time the forward pass waited for reads. */
static void cmd_print_expert_stats(struct expert_store *x)
{
    struct expert_stats st = expert_stats_get(x);
    const double gib = 1073741824.0;
    plat_log("[experts] %s; in VRAM: prompt %.1f%%, decode %.1f%%; in RAM: prompt %.1f%% of %llu, decode %.1f%% of %llu (%.1f%% more under way); read %.2f GiB (%llu experts, %llu prefetched, %llu warming), %.2f GB/s while reading",
             x->mapped ? "mapped" : "cached", 100 * plat_ratio(st.vram[0], st.lookups[0]), 100 * plat_ratio(st.vram[1], st.lookups[1]),
             100 * plat_ratio(st.hits[0], st.lookups[0]), (unsigned long long)st.lookups[0],
             100 * plat_ratio(st.hits[1], st.lookups[1]), (unsigned long long)st.lookups[1], 100 * plat_ratio(st.inflight[1], st.lookups[1]),
             st.bytes_read / gib, (unsigned long long)st.reads, (unsigned long long)st.prefetches, (unsigned long long)st.warm_reads,
             plat_ratio(st.bytes_read / 1e9, st.busy_s));
    plat_log("[experts] prefetch guessed %.1f%% of routed experts (prompt %.1f%%); waited for reads %.2f s (prompt %.2f s); peak RSS %.2f GiB",
             100 * plat_ratio(st.predicted_used[1], st.routed_seen[1]), 100 * plat_ratio(st.predicted_used[0], st.routed_seen[0]),
             st.wait_s[1], st.wait_s[0], cmd_peak_rss() / gib);
    char window[48] = "so far";
    if (st.windows) snprintf(window, sizeof window, "over the last %d tokens", PLACE_RETIER_WINDOW);
    if (x->vram)
        plat_log("[experts] re-tiering: %llu swaps, %.1f MiB uploaded in the background; VRAM served %.1f%% of the routed experts %s",
                 (unsigned long long)st.swaps, st.swap_bytes / 1048576.0, 100 * expert_window_share(&st), window);
}

static void cmd_print_stats(const struct cmd_session *s, const struct engine_gen *g)
{
    int n_fwd = g->n_tokens > 1 ? g->n_tokens - 1 : 0;
    plat_log("[stats] prompt %d tokens, %.1f tok/s; generated %d tokens, %.1f tok/s",
             g->n_prompt, g->prompt_s > 0 ? g->n_prompt / g->prompt_s : 0.0, g->n_tokens,
             g->decode_s > 0 ? n_fwd / g->decode_s : 0.0);
    if (s->model.experts) cmd_print_expert_stats(s->model.experts);
}

/* The "experts" object of --json: the figures of cmd_print_expert_stats. */
static void cmd_json_experts(FILE *f, struct expert_store *x)
{
    struct expert_stats st = expert_stats_get(x);
    fprintf(f, "{\"mode\":\"%s\",\"budget_bytes\":%lld,\"slots\":%d,\"pinned\":%d,\"io\":\"%s\"", x->mapped ? "mapped" : "cached",
            x->mapped ? -1LL : (long long)x->n_slots * (long long)x->slot_bytes, x->n_slots, x->n_pin,
            x->mapped ? "mmap" : x->cfg.io == EXPERT_IO_DIRECT ? "direct" : "buffered");
    fprintf(f, ",\"lookups_prompt\":%llu,\"lookups_decode\":%llu,\"hit_rate_prompt\":%.4f,\"hit_rate_decode\":%.4f",
            (unsigned long long)st.lookups[0], (unsigned long long)st.lookups[1], plat_ratio(st.hits[0], st.lookups[0]),
            plat_ratio(st.hits[1], st.lookups[1]));
    fprintf(f, ",\"vram_rate_prompt\":%.4f,\"vram_rate_decode\":%.4f", plat_ratio(st.vram[0], st.lookups[0]), plat_ratio(st.vram[1], st.lookups[1]));
    fprintf(f, ",\"swaps\":%llu,\"swap_bytes\":%llu,\"vram_rate_window\":%.4f", (unsigned long long)st.swaps,
            (unsigned long long)st.swap_bytes, expert_window_share(&st));
    fprintf(f, ",\"bytes_read\":%llu,\"reads\":%llu,\"prefetches\":%llu,\"warm_reads\":%llu,\"disk_gb_s\":%.3f,\"read_busy_s\":%.3f",
            (unsigned long long)st.bytes_read, (unsigned long long)st.reads, (unsigned long long)st.prefetches,
            (unsigned long long)st.warm_reads, plat_ratio(st.bytes_read / 1e9, st.busy_s), st.busy_s);
    fprintf(f, ",\"prefetch_accuracy_prompt\":%.4f,\"prefetch_accuracy_decode\":%.4f,\"wait_prompt_s\":%.3f,\"wait_decode_s\":%.3f",
            plat_ratio(st.predicted_used[0], st.routed_seen[0]), plat_ratio(st.predicted_used[1], st.routed_seen[1]), st.wait_s[0], st.wait_s[1]);
    fprintf(f, ",\"peak_rss_bytes\":%lld}", (long long)cmd_peak_rss());
}

static void cmd_json_ids(FILE *f, const int *ids, int n)
{
    fputc('[', f);
    for (int i = 0; i < n; i++) fprintf(f, "%s%d", i ? "," : "", ids[i]);
    fputc(']', f);
}

static void cmd_print_json(struct cmd_session *s, const int *prompt, const struct engine_gen *g)
{
    int n_fwd = g->n_tokens > 1 ? g->n_tokens - 1 : 0;
    printf("{\"prompt_tokens\":");
    cmd_json_ids(stdout, prompt, g->n_prompt);
    printf(",\"tokens\":");
    cmd_json_ids(stdout, g->tokens, g->n_tokens);
    printf(",\"text\":");
    json_write_string(stdout, g->text ? g->text : "", g->text_len);
    printf(",\"top\":[");
    for (int i = 0; i < g->n_tokens; i++) {
        printf("%s[", i ? "," : "");
        for (int k = 0; k < 5 && g->top[i][k][0] >= 0; k++) printf("%s[%d,%.9g]", k ? "," : "", (int)g->top[i][k][0], g->top[i][k][1]);
        printf("]");
    }
    printf("],\"stop\":\"%s\"", engine_stop_names[g->stop]);
    printf(",\"timings\":{\"prompt_tok_s\":%.3f,\"decode_tok_s\":%.3f,\"prompt_s\":%.6f,\"decode_s\":%.6f}",
           g->prompt_s > 0 ? g->n_prompt / g->prompt_s : 0.0, g->decode_s > 0 ? n_fwd / g->decode_s : 0.0, g->prompt_s, g->decode_s);
    if (s->model.experts) {
        printf(",\"experts\":");
        cmd_json_experts(stdout, s->model.experts);
    }
    printf(",\"n_ctx\":%d,\"threads\":%d,\"kernels\":\"%s\"}\n", s->model.n_ctx, plat_threads(), quant_level_name());
}

/* coli run: one prompt (raw text, or the chat template with --chat), one answer. */
static int cmd_run(const struct cmd_options *o)
{
    struct cmd_session s;
    if (!o->prompt) die_usage("run needs a prompt (-p TEXT)");
    cmd_open(&s, o, 1, 0, MODEL_COPY_BESIDE_FILE_PAGES);
    struct sigaction sa = {.sa_handler = cmd_on_sigint};
    sigaction(SIGINT, &sa, NULL); /* Ctrl-C ends the generation; the heat is still saved */
    char *text = NULL;
    if (o->chat) text = tok_chat_render_turn(&s.tok, o->system, o->prompt, o->think);
    const char *t = text ? text : o->prompt;
    int *ids = NULL, n = tok_encode(&s.tok, t, strlen(t), 1, &ids);
    if (n == 0) die("the prompt is empty after tokenization");
    if (n > s.model.n_ctx) die("the prompt has %d tokens but the context holds %d (-c to raise it)", n, s.model.n_ctx);
    struct cmd_printer printer = {.s = &s, .in_think = o->chat && o->think, .hide_think = o->hide_think};
    struct engine_request req = cmd_request(o, ids, n, o->n_predict, o->json ? NULL : &printer);
    struct engine_gen g;
    engine_generate(&s.engine, 0, &req, &g);
    if (g.stop == ENGINE_STOP_ERROR) die("%s", g.error);
    if (o->json) cmd_print_json(&s, ids, &g);
    else {
        char tail[16];
        fwrite(tail, 1, tok_stream_flush(&printer.utf8, tail), stdout);
        putchar('\n');
    }
    if (g.stop == ENGINE_STOP_CONTEXT) plat_log("[coli] stopped: the context (%d tokens) is full", s.model.n_ctx);
    if (g.stop == ENGINE_STOP_CANCEL) plat_log("[coli] stopped: interrupted");
    cmd_print_stats(&s, &g);
    engine_gen_free(&g);
    free(ids);
    free(text);
    cmd_close(&s);
    return 0;
}

/* coli tokenize: one id per line. Needs only the vocabulary, so vocabulary-only files work. */
static int cmd_tokenize(const struct cmd_options *o)
{
    struct gguf_file g;
    struct tok t;
    if (!o->model) die_usage("tokenize needs a model (-m MODEL.gguf)");
    if (!o->prompt) die_usage("tokenize needs text (-p TEXT)");
    gguf_open(&g, o->model);
    tok_load(&t, &g);
    int *ids = NULL, n = tok_encode(&t, o->prompt, strlen(o->prompt), 1, &ids);
    for (int i = 0; i < n; i++) printf("%d\n", ids[i]);
    free(ids);
    tok_free(&t);
    gguf_close(&g);
    return 0;
}

/* The tokens of one chat turn: whatever the previous answer left unfed, then the user's
 * turn and the generation prompt (the system turn first in a new conversation). */
static int cmd_chat_turn_tokens(struct cmd_session *s, const struct cmd_options *o, const char *line, const int *pending,
                                int n_pending, int **ids_out)
{
    int first = s->engine.slots[0].seq.pos == 0 && n_pending == 0;
    char *turn = tok_chat_render_turn(&s->tok, first ? o->system : NULL, line, o->think);
    size_t len = strlen(turn);
    char *text = plat_alloc(len + 2);
    snprintf(text, len + 2, "%s%s", first ? "" : "\n", turn); /* "\n" ends the previous <|im_end|> line */
    int *body = NULL, n_body = tok_encode(&s->tok, text, strlen(text), 1, &body);
    int *ids = plat_alloc((size_t)(n_pending + n_body) * sizeof *ids);
    memcpy(ids, pending, (size_t)n_pending * sizeof *ids);
    memcpy(ids + n_pending, body, (size_t)n_body * sizeof *ids);
    free(body);
    free(text);
    free(turn);
    *ids_out = ids;
    return n_pending + n_body;
}

/* Reads one line from stdin without its newline; NULL at end of input or on Ctrl-C. */
static char *cmd_read_line(char **buf, size_t *cap)
{
    ssize_t n = getline(buf, cap, stdin);
    if (n < 0) return NULL;
    while (n > 0 && ((*buf)[n - 1] == '\n' || (*buf)[n - 1] == '\r')) (*buf)[--n] = 0;
    return *buf;
}

/* The part of the model tensor NAME belongs to, for coli info. */
static const char *cmd_tensor_group(const char *name)
{
    if (strstr(name, "norm")) return "norms";
    if (!strncmp(name, "token_embd", 10)) return "embedding";
    if (!strncmp(name, "output", 6)) return "output head";
    if (strstr(name, "_exps")) return "routed experts";
    if (strstr(name, "_shexp")) return "shared expert";
    if (strstr(name, "ffn_gate_inp")) return "router";
    if (strstr(name, "attn_")) return "attention";
    if (strstr(name, "ssm_")) return "deltanet";
    if (strstr(name, "ffn_")) return "feed-forward";
    return "other";
}

/* coli info's lines per tensor group: each type in it, with its tensors and MiB. */
static void cmd_info_groups(const struct gguf_file *g)
{
    static const char *const groups[] = {"embedding", "attention", "deltanet", "router", "routed experts",
                                         "shared expert", "feed-forward", "output head", "norms", "other"};
    for (size_t k = 0; k < sizeof groups / sizeof *groups; k++) {
        int64_t count[GGUF_TYPE_COUNT] = {0};
        uint64_t bytes[GGUF_TYPE_COUNT] = {0};
        for (int64_t i = 0; i < g->n_tensors; i++)
            if (!strcmp(cmd_tensor_group(g->tensors[i].name), groups[k])) {
                count[g->tensors[i].type]++;
                bytes[g->tensors[i].type] += g->tensors[i].bytes;
            }
        char line[512] = "";
        for (int t = 0; t < GGUF_TYPE_COUNT; t++)
            if (count[t])
                snprintf(line + strlen(line), sizeof line - strlen(line), "%s%s %lld (%.1f MiB)", *line ? ", " : "",
                         gguf_types[t].name, (long long)count[t], bytes[t] / 1048576.0);
        if (*line) printf("  %-15s %s\n", groups[k], line);
    }
}

/* coli chat: an interactive conversation. The state carries over between turns, so each
 * turn only feeds its new tokens. Answers keep their thinking in the context. */
static int cmd_chat(const struct cmd_options *o)
{
    struct cmd_session s;
    cmd_open(&s, o, 1, 0, MODEL_COPY_BESIDE_FILE_PAGES);
    struct model_seq *seq = &s.engine.slots[0].seq;
    struct sigaction sa = {.sa_handler = cmd_on_sigint};
    sigaction(SIGINT, &sa, NULL); /* no SA_RESTART: Ctrl-C at the prompt ends the read */
    int tty = isatty(STDOUT_FILENO), im_end = tok_find(&s.tok, "<|im_end|>");
    if (im_end < 0) die("%s: the vocabulary has no <|im_end|>; it is not a chat model", o->model);
    int pending[2], n_pending = 0;
    struct model_checkpoint checkpoint = {0};
    char *line = NULL;
    size_t cap = 0;
    fprintf(stderr, "coli chat: /reset starts over, /exit (or Ctrl-D) leaves, Ctrl-C stops an answer.\n");
    for (;;) {
        fputs(tty ? "\033[1m> \033[0m" : "> ", stdout);
        fflush(stdout);
        cmd_interrupt = 0;
        if (!cmd_read_line(&line, &cap)) break;
        if (!line[0]) continue;
        if (!strcmp(line, "/exit") || !strcmp(line, "/quit")) break;
        if (!strcmp(line, "/reset")) {
            engine_forget(&s.engine, 0);
            n_pending = 0;
            fprintf(stderr, "(conversation cleared)\n");
            continue;
        }
        int *ids = NULL, n = cmd_chat_turn_tokens(&s, o, line, pending, n_pending, &ids);
        int room = s.model.n_ctx - seq->pos - n;
        if (room < 2) {
            fprintf(stderr, "(the context is full: %d of %d tokens used; /reset to start a new conversation)\n", seq->pos, s.model.n_ctx);
            free(ids);
            continue;
        }
        struct cmd_printer printer = {.s = &s, .in_think = o->think, .hide_think = o->hide_think, .dim = tty};
        if (printer.in_think && tty && !o->hide_think) fputs("\033[2m", stdout);
        struct engine_request req = cmd_request(o, ids, n, o->n_predict > 0 && o->n_predict < room ? o->n_predict : room, &printer);
        req.rewind = &checkpoint;
        struct engine_gen g;
        engine_generate(&s.engine, 0, &req, &g);
        if (g.stop == ENGINE_STOP_ERROR) die("%s", g.error);
        char tail[16];
        fwrite(tail, 1, tok_stream_flush(&printer.utf8, tail), stdout);
        fputs(tty ? "\033[0m\n" : "\n", stdout);
        if (g.n_tokens == 0) { /* cancelled while the prompt was read: the model was rewound */
            fprintf(stderr, "(cancelled; the message was not sent)\n");
            engine_gen_free(&g);
            free(ids);
            continue;
        }
        if (g.stop == ENGINE_STOP_CANCEL) fprintf(stderr, "(stopped)\n");
        if (g.stop == ENGINE_STOP_CONTEXT) fprintf(stderr, "(the context is full; /reset to start a new conversation)\n");
        cmd_print_stats(&s, &g);
        /* the last sampled token was never fed; close the turn the way the template does */
        n_pending = 0;
        if (g.tokens[g.n_tokens - 1] != im_end) pending[n_pending++] = g.tokens[g.n_tokens - 1];
        pending[n_pending++] = im_end;
        engine_gen_free(&g);
        free(ids);
    }
    putchar('\n');
    free(line);
    free(checkpoint.recurrent);
    cmd_close(&s);
    return 0;
}

/* ---- synthetic models: `--synthetic NAME[:QUANT[:LAYERS]]` for plan, bench and info ----
 * A model nobody has downloaded yet: the head of its GGUF file (metadata, a vocabulary of the
 * 256 byte tokens and fillers, every tensor of the geometry as the converter names and shapes it,
 * qwen35-arch.md §9) is written by gguf_image_* into a memory file (§1), which gguf_open and
 * model_bind then read as any other file. plan and info leave the data section a hole (no
 * memory); bench fills it with random valid blocks (quant_sanitize_random), on which the
 * kernels take the time they take on real weights. */

struct cmd_geometry {
    const char *name, *about;
    enum model_arch arch;
    int n_layers, dim, n_vocab, ctx, n_head, n_kv_head, head_dim, rope_dims, interval;
    int ssm_nk, ssm_nv, ssm_d, conv, n_expert, n_expert_used, expert_ff, shexp_ff;
};

/* qwen35-arch.md §1.1 and §1.2; tiny is tests/gen_model.c's tiny preset (and the golden files'). */
static const struct cmd_geometry cmd_geometries[] = {
    {"35b-a3b", "Qwen3.5/3.6-35B-A3B", MODEL_ARCH_QWEN35MOE, 40, 2048, 248320, 262144, 16, 2, 256, 64, 4, 16, 32, 128, 4, 256, 8, 512, 512},
    {"80b-a3b-next", "Qwen3-Next-80B-A3B", MODEL_ARCH_QWEN3NEXT, 48, 2048, 151936, 262144, 16, 2, 256, 64, 4, 16, 32, 128, 4, 512, 10, 512, 512},
    {"tiny", "a 4-layer model of that shape", MODEL_ARCH_QWEN35MOE, 4, 64, 2112, 4096, 4, 2, 32, 8, 4, 2, 4, 16, 4, 8, 2, 32, 32},
};

/* QUANT: q4_k_m, the mix llama.cpp's Q4_K_M gives these tensors (Q4_K; Q6_K for the output head
 * and, on the layers that get more bits, attn_v and the down projections; Q5_K for attn_qkv),
 * or a type name: the routed experts in it and every other matrix in Q8_0 (the mix of this
 * project's benchmark files, tests/gen_model.c). Norms, routers and the DeltaNet's conv, a and
 * dt stay F32, as in every published file. */
struct cmd_synthetic {
    const struct cmd_geometry *g;
    int n_layers;               /* of the model described (NAME's, or LAYERS) */
    int k_mix;                  /* q4_k_m */
    enum gguf_type experts_type;
    const char *spec;
};

/* One tensor of a synthetic model: shape outermost first; E the magnitude of its float fields
 * (quant_sanitize_random). */
struct cmd_synthetic_tensor {
    char name[64];
    int type, n_dims, e, negative;
    int64_t shape[3];
    uint64_t offset, bytes;
};

/* Parses SPEC; a usage error names what is wrong. */
static void cmd_synthetic_parse(const char *spec, struct cmd_synthetic *sy)
{
    char name[64] = "", quant[32] = "q4_k_m";
    int layers = 0, n = 0;
    const char *c1 = strchr(spec, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
    size_t nl = c1 ? (size_t)(c1 - spec) : strlen(spec), ql = c1 ? (c2 ? (size_t)(c2 - c1 - 1) : strlen(c1 + 1)) : 0;
    if (nl >= sizeof name || ql >= sizeof quant || (c2 && (sscanf(c2 + 1, "%d%n", &layers, &n) != 1 || c2[1 + n] || layers < 1 || layers > 4096)))
        die_usage("--synthetic %s: write NAME[:QUANT[:LAYERS]], e.g. 35b-a3b:q4_k_m or 35b-a3b:q4_0:10", spec);
    memcpy(name, spec, nl);
    if (c1) memcpy(quant, c1 + 1, ql), quant[ql] = 0;
    memset(sy, 0, sizeof *sy);
    sy->spec = spec;
    for (size_t i = 0; i < sizeof cmd_geometries / sizeof *cmd_geometries; i++)
        if (!strcmp(name, cmd_geometries[i].name)) sy->g = &cmd_geometries[i];
    if (!sy->g) die_usage("--synthetic %s: unknown geometry '%s' (35b-a3b, 80b-a3b-next, tiny)", spec, name);
    sy->n_layers = layers ? layers : sy->g->n_layers;
    int found = -1;
    for (int t = 0; t < GGUF_TYPE_COUNT; t++)
        if (gguf_types[t].name && gguf_types[t].computes && !strcasecmp(quant, gguf_types[t].name)) found = t;
    sy->k_mix = !strcasecmp(quant, "q4_k_m");
    if (!sy->k_mix && found < 0)
        die_usage("--synthetic %s: unknown QUANT '%s' (q4_k_m, or a format coli reads: q8_0, q4_0, q4_k, iq4_xs, ...)", spec, quant);
    sy->experts_type = found < 0 ? GGUF_TYPE_Q8_0 : (enum gguf_type)found;
}

/* The type of matrix WHAT of layer IL (-1: none) under SY's mix. */
static int cmd_synthetic_type(const struct cmd_synthetic *sy, const char *what, int il)
{
    int n = sy->n_layers, more_bits = il >= 0 && (il < n / 8 || il >= 7 * n / 8 || (il - n / 8) % 3 == 2);
    if (!sy->k_mix) return strstr(what, "_exps") ? (int)sy->experts_type : GGUF_TYPE_Q8_0;
    if (!strcmp(what, "output.weight")) return GGUF_TYPE_Q6_K;
    if (!strcmp(what, "attn_qkv.weight")) return GGUF_TYPE_Q5_K;
    if (more_bits && (!strcmp(what, "attn_v.weight") || !strncmp(what, "ffn_down_", 9))) return GGUF_TYPE_Q6_K;
    return GGUF_TYPE_Q4_K;
}

struct cmd_synthetic_plan { struct cmd_synthetic_tensor *t; int n; };

/* Adds tensor WHAT of layer IL: a matrix (TYPE < 0: typed by the mix) or an F32 vector. */
static void cmd_synthetic_add(struct cmd_synthetic_plan *p, const struct cmd_synthetic *sy, int il, const char *what, int type,
                              int n_dims, int64_t a, int64_t b, int64_t c)
{
    struct cmd_synthetic_tensor *t = &p->t[p->n++];
    memset(t, 0, sizeof *t);
    if (il >= 0) snprintf(t->name, sizeof t->name, "blk.%d.%s", il, what);
    else snprintf(t->name, sizeof t->name, "%s", what);
    t->type = type >= 0 ? type : cmd_synthetic_type(sy, what, il);
    t->n_dims = n_dims;
    t->shape[0] = a, t->shape[1] = b, t->shape[2] = c;
    t->e = strstr(what, "norm") ? 0 : t->type <= GGUF_TYPE_F16 || t->type == GGUF_TYPE_BF16 ? -7 : -12;
    t->negative = !strcmp(what, "ssm_a"); /* a decay: positive would grow the state without end */
    if (!strcmp(what, "ssm_a")) t->e = -1;
    const struct gguf_type_info *ti = gguf_type_get(t->type);
    t->bytes = gguf_row_bytes(t->type, a * (n_dims > 1 ? b : 1) * (n_dims > 2 ? c : 1));
    if (t->shape[n_dims - 1] % ti->block_elems)
        die_usage("--synthetic %s: tensor %s has rows of %lld, not a multiple of the %s block (%d)", sy->spec, t->name,
                  (long long)t->shape[n_dims - 1], ti->name, ti->block_elems);
}

/* Every tensor of the first L layers in file order (the embedding, the layers, the head). */
static struct cmd_synthetic_plan cmd_synthetic_tensors(const struct cmd_synthetic *sy, int layers)
{
    const struct cmd_geometry *g = sy->g;
    const int F32 = GGUF_TYPE_F32, M = -1;
    int64_t d = g->dim, hd = g->head_dim, nv = g->ssm_nv, vdim = nv * g->ssm_d, conv = 2 * (int64_t)g->ssm_nk * g->ssm_d + vdim;
    int64_t E = g->n_expert, eff = g->expert_ff, sff = g->shexp_ff;
    struct cmd_synthetic_plan p = {plat_zalloc((size_t)layers * 20 + 3, sizeof *p.t), 0};
    cmd_synthetic_add(&p, sy, -1, "token_embd.weight", M, 2, g->n_vocab, d, 0);
    for (int i = 0; i < layers; i++) {
        cmd_synthetic_add(&p, sy, i, "attn_norm.weight", F32, 1, d, 0, 0);
        cmd_synthetic_add(&p, sy, i, "post_attention_norm.weight", F32, 1, d, 0, 0);
        if ((i + 1) % g->interval == 0) {
            cmd_synthetic_add(&p, sy, i, "attn_q.weight", M, 2, 2 * g->n_head * hd, d, 0);
            cmd_synthetic_add(&p, sy, i, "attn_k.weight", M, 2, g->n_kv_head * hd, d, 0);
            cmd_synthetic_add(&p, sy, i, "attn_v.weight", M, 2, g->n_kv_head * hd, d, 0);
            cmd_synthetic_add(&p, sy, i, "attn_output.weight", M, 2, d, g->n_head * hd, 0);
            cmd_synthetic_add(&p, sy, i, "attn_q_norm.weight", F32, 1, hd, 0, 0);
            cmd_synthetic_add(&p, sy, i, "attn_k_norm.weight", F32, 1, hd, 0, 0);
        } else {
            cmd_synthetic_add(&p, sy, i, "attn_qkv.weight", M, 2, conv, d, 0);
            cmd_synthetic_add(&p, sy, i, "attn_gate.weight", M, 2, vdim, d, 0);
            cmd_synthetic_add(&p, sy, i, "ssm_conv1d.weight", F32, 2, conv, g->conv, 0);
            cmd_synthetic_add(&p, sy, i, "ssm_dt.bias", F32, 1, nv, 0, 0);
            cmd_synthetic_add(&p, sy, i, "ssm_a", F32, 1, nv, 0, 0);
            if (g->arch == MODEL_ARCH_QWEN3NEXT) cmd_synthetic_add(&p, sy, i, "ssm_ba.weight", M, 2, 2 * nv, d, 0);
            else {
                cmd_synthetic_add(&p, sy, i, "ssm_beta.weight", M, 2, nv, d, 0);
                cmd_synthetic_add(&p, sy, i, "ssm_alpha.weight", M, 2, nv, d, 0);
            }
            cmd_synthetic_add(&p, sy, i, "ssm_norm.weight", F32, 1, g->ssm_d, 0, 0);
            cmd_synthetic_add(&p, sy, i, "ssm_out.weight", M, 2, d, vdim, 0);
        }
        cmd_synthetic_add(&p, sy, i, "ffn_gate_inp.weight", F32, 2, E, d, 0);
        cmd_synthetic_add(&p, sy, i, "ffn_gate_exps.weight", M, 3, E, eff, d);
        cmd_synthetic_add(&p, sy, i, "ffn_up_exps.weight", M, 3, E, eff, d);
        cmd_synthetic_add(&p, sy, i, "ffn_down_exps.weight", M, 3, E, d, eff);
        cmd_synthetic_add(&p, sy, i, "ffn_gate_inp_shexp.weight", F32, 2, 1, d, 0);
        cmd_synthetic_add(&p, sy, i, "ffn_gate_shexp.weight", M, 2, sff, d, 0);
        cmd_synthetic_add(&p, sy, i, "ffn_up_shexp.weight", M, 2, sff, d, 0);
        cmd_synthetic_add(&p, sy, i, "ffn_down_shexp.weight", M, 2, d, sff, 0);
    }
    cmd_synthetic_add(&p, sy, -1, "output_norm.weight", F32, 1, d, 0, 0);
    cmd_synthetic_add(&p, sy, -1, "output.weight", M, 2, g->n_vocab, d, 0);
    return p;
}

/* The metadata of a model of SY's geometry with L layers, and its vocabulary: the 256 byte
 * symbols, then <|endoftext|> (eos) and unused fillers up to the embedding's rows. */
static void cmd_synthetic_keys(struct gguf_image *im, const struct cmd_synthetic *sy, int layers)
{
    const struct cmd_geometry *g = sy->g;
    const char *a = model_arch_names[g->arch];
    char key[96], text[32];
    gguf_image_key_string(im, "general.architecture", a);
    gguf_image_key_string(im, "general.name", sy->spec);
    const struct { const char *k; int v; } u[] = {
        {"block_count", layers}, {"context_length", g->ctx}, {"embedding_length", g->dim},
        {"attention.head_count", g->n_head}, {"attention.head_count_kv", g->n_kv_head},
        {"attention.key_length", g->head_dim}, {"attention.value_length", g->head_dim},
        {"rope.dimension_count", g->rope_dims}, {"full_attention_interval", g->interval},
        {"ssm.conv_kernel", g->conv}, {"ssm.state_size", g->ssm_d}, {"ssm.group_count", g->ssm_nk},
        {"ssm.time_step_rank", g->ssm_nv}, {"ssm.inner_size", g->ssm_nv * g->ssm_d},
        {"expert_count", g->n_expert}, {"expert_used_count", g->n_expert_used},
        {"expert_feed_forward_length", g->expert_ff}, {"expert_shared_feed_forward_length", g->shexp_ff},
    };
    for (size_t i = 0; i < sizeof u / sizeof *u; i++) {
        snprintf(key, sizeof key, "%s.%s", a, u[i].k);
        gguf_image_key_u32(im, key, (uint32_t)u[i].v);
    }
    snprintf(key, sizeof key, "%s.rope.freq_base", a);
    gguf_image_key_f32(im, key, 1e7f);
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", a);
    gguf_image_key_f32(im, key, 1e-6f);
    gguf_image_key_string(im, "tokenizer.ggml.model", "gpt2");
    gguf_image_key_string(im, "tokenizer.ggml.pre", g->arch == MODEL_ARCH_QWEN3NEXT ? "qwen2" : "qwen35");
    gguf_image_key_array(im, "tokenizer.ggml.tokens", GGUF_VALUE_STRING, (uint64_t)g->n_vocab);
    for (int i = 0; i < g->n_vocab; i++) {
        if (i < 256) text[tok_utf8_put(tok_byte_cp(i), text)] = 0;
        else if (i == 256) strcpy(text, "<|endoftext|>");
        else snprintf(text, sizeof text, "[PAD%d]", i);
        gguf_image_string(im, text);
    }
    gguf_image_key_array(im, "tokenizer.ggml.token_type", GGUF_VALUE_INT32, (uint64_t)g->n_vocab);
    for (int i = 0; i < g->n_vocab; i++) gguf_image_u32(im, i < 256 ? TOK_T_NORMAL : i == 256 ? TOK_T_CONTROL : TOK_T_UNUSED);
    gguf_image_key_u32(im, "tokenizer.ggml.eos_token_id", 256);
}

/* A memory file holding SY's model with its first L layers (see the subsection's head): with
 * FILL, random weights in its data section. Writes the file's name to PATH; returns its
 * descriptor (closed by the caller when the model is). Dies when memory refuses it. */
static int cmd_synthetic_file(const struct cmd_synthetic *sy, int layers, int fill, char *path, size_t path_n)
{
    struct cmd_synthetic_plan p = cmd_synthetic_tensors(sy, layers);
    struct gguf_image im;
    gguf_image_begin(&im);
    cmd_synthetic_keys(&im, sy, layers);
    for (int i = 0; i < p.n; i++) p.t[i].offset = gguf_image_tensor(&im, p.t[i].name, p.t[i].type, p.t[i].n_dims, p.t[i].shape);
    size_t head = gguf_image_end(&im);
    int fd = plat_memory_file("coli-synthetic", head + im.data_bytes, path, path_n);
    if (fd < 0 || pwrite(fd, im.p, head, 0) != (ssize_t)head) die("--synthetic %s: no memory file: %s", sy->spec, strerror(errno));
    if (fill) {
        uint8_t *map = mmap(NULL, head + im.data_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (map == MAP_FAILED) die("--synthetic %s: cannot map its memory file: %s", sy->spec, strerror(errno));
        plat_progress_begin("writing random weights", im.data_bytes);
        for (int i = 0; i < p.n; i++) {
            struct cmd_synthetic_tensor *t = &p.t[i];
            uint8_t *w = map + head + t->offset;
            size_t bytes = t->bytes;
            ops_bench_fill(w, bytes, (uint64_t)i + 1);
            quant_sanitize_random((enum gguf_type)t->type, w, bytes, t->e);
            for (size_t k = 3; t->negative && k < bytes; k += 4) w[k] |= 0x80;
            plat_progress_add(bytes);
        }
        plat_progress_end();
        munmap(map, head + im.data_bytes);
    }
    free(im.p);
    free(p.t);
    return fd;
}

/* Bytes of SY's model with L layers: all of them, and the trunk's (what is read every token and
 * copied out of the file: all but the routed experts and the embedding). */
static void cmd_synthetic_bytes(const struct cmd_synthetic *sy, int layers, uint64_t *all, uint64_t *trunk)
{
    struct cmd_synthetic_plan p = cmd_synthetic_tensors(sy, layers);
    *all = *trunk = 0;
    for (int i = 0; i < p.n; i++) {
        const struct cmd_synthetic_tensor *t = &p.t[i];
        *all += t->bytes;
        if (t->n_dims < 3 && strcmp(t->name, "token_embd.weight")) *trunk += t->bytes;
    }
    free(p.t);
}

static void cmd_info_machine(void)
{
    int64_t total = plat_mem_total(), avail = plat_mem_available();
    printf("cpu: %s\n", plat_cpu.name);
    printf("cpu features: avx2 %s, fma %s, f16c %s, avxvnni %s, avx512f %s, avx512bw %s, avx512vl %s, avx512vnni %s\n",
           plat_cpu.avx2 ? "yes" : "no", plat_cpu.fma ? "yes" : "no", plat_cpu.f16c ? "yes" : "no", plat_cpu.avxvnni ? "yes" : "no",
           plat_cpu.avx512f ? "yes" : "no", plat_cpu.avx512bw ? "yes" : "no", plat_cpu.avx512vl ? "yes" : "no",
           plat_cpu.avx512vnni ? "yes" : "no");
    printf("kernels: %s\n", quant_level_name());
    printf("cores: %ld online, %d threads\n", sysconf(_SC_NPROCESSORS_ONLN), plat_threads());
    printf("memory: %.1f GiB total, %.1f GiB available (cgroup-aware)\n", total / 1073741824.0, avail / 1073741824.0);
    cuda_print_info();
}

/* NAME: what to call the model at PATH. */
static void cmd_info_model(const char *path, const char *name)
{
    struct gguf_file g;
    struct model_config c;
    gguf_open(&g, path);
    model_read_config(&c, &g);
    printf("model: %s (GGUF v%u, %d part%s)\n", name, g.version, g.n_parts, g.n_parts > 1 ? "s" : "");
    printf("architecture: %s\n", model_arch_names[c.arch]);
    printf("layers: %d (every %d%s full attention, the rest Gated DeltaNet)\n", c.n_layers, c.full_attn_interval,
           c.full_attn_interval == 1 ? "st" : c.full_attn_interval == 2 ? "nd" : c.full_attn_interval == 3 ? "rd" : "th");
    printf("hidden: %d, context: %d, rms eps: %g\n", c.dim, c.ctx_train, c.eps);
    printf("attention: %d heads, %d kv heads, head dim %d, rope dims %d, rope base %g\n", c.n_head, c.n_kv_head, c.head_dim, c.rope_dims, c.rope_base);
    printf("deltanet: %d key heads, %d value heads, key dim %d, value dim %d, conv %d\n", c.ssm_nk, c.ssm_nv, c.ssm_dk, c.ssm_dv, c.conv_kernel);
    if (c.n_expert) printf("experts: %d, %d per token, ff %d, shared ff %d\n", c.n_expert, c.n_expert_used, c.expert_ff, c.shexp_ff);
    else printf("feed-forward: %d\n", c.ff);
    int64_t count[GGUF_TYPE_COUNT] = {0};
    uint64_t bytes[GGUF_TYPE_COUNT] = {0};
    for (int64_t i = 0; i < g.n_tensors; i++) {
        count[g.tensors[i].type]++;
        bytes[g.tensors[i].type] += g.tensors[i].bytes;
    }
    printf("tensors: %lld, %.1f MiB\n", (long long)g.n_tensors, g.tensor_bytes / 1048576.0);
    for (int t = 0; t < GGUF_TYPE_COUNT; t++)
        if (count[t]) printf("  %-7s %5lld tensors %10.1f MiB%s\n", gguf_types[t].name, (long long)count[t], bytes[t] / 1048576.0,
                             gguf_types[t].computes ? "" : "  (a format coli does not read yet)");
    cmd_info_groups(&g);
    for (int t = 0; t < GGUF_TYPE_COUNT; t++)
        if (count[t] && !gguf_types[t].computes) { printf("runs: no: %s\n", MODEL_FORMAT_ADVICE); break; }
    if (gguf_find_key(&g, "tokenizer.ggml.tokens") >= 0) {
        struct tok t;
        tok_load(&t, &g);
        printf("vocabulary: %d tokens; eos %d, pad %d;", t.n_vocab, t.eos_id, t.pad_id);
        printf(" end of generation:");
        for (int i = 0; i < t.n_eog; i++) printf(" %d", t.eog[i]);
        printf("\n");
        tok_free(&t);
    }
    gguf_close(&g);
}

/* coli info: the machine, and the model when -m or --synthetic is given. */
static int cmd_info(const struct cmd_options *o)
{
    cmd_info_machine();
    if (o->model) cmd_info_model(o->model, o->model);
    if (o->synthetic) {
        struct cmd_synthetic sy;
        char path[64];
        cmd_synthetic_parse(o->synthetic, &sy);
        int fd = cmd_synthetic_file(&sy, sy.n_layers, 0, path, sizeof path);
        cmd_info_model(path, o->synthetic);
        close(fd);
    }
    return 0;
}

/* What bench --synthetic ran: SY's model on LAYERS of its layers (the most whole blocks that
 * fit), BYTES of random weights of the ALL its whole model would take (TRUNK of them read every
 * token), and the output head's time. */
struct cmd_bench_synthetic {
    struct cmd_synthetic sy;
    int layers, fd, fits;
    uint64_t bytes, all, trunk;
    double head_s;
    char path[64];
};

/* Chooses the layers bench --synthetic runs: all of them, or the most whole blocks
 * (full_attention_interval layers, so the DeltaNet/attention mix stays the model's) whose
 * weights and trunk copy take at most RAM bytes (< 0: three quarters of the memory available),
 * and writes them into a memory file. */
static void cmd_bench_synthetic_open(struct cmd_bench_synthetic *b, const char *spec, int64_t ram)
{
    int64_t avail = plat_mem_available(), room = ram >= 0 ? ram : avail / 4 * 3;
    cmd_synthetic_parse(spec, &b->sy);
    int n = b->sy.n_layers, step = b->sy.g->interval;
    cmd_synthetic_bytes(&b->sy, n, &b->all, &b->trunk);
    b->fits = (int64_t)(b->all + b->trunk) < avail;
    b->layers = 0;
    for (int l = step < n ? step : n;; l = l + step < n ? l + step : n) {
        uint64_t all, trunk;
        cmd_synthetic_bytes(&b->sy, l, &all, &trunk);
        if ((int64_t)(all + trunk) > room) break;
        b->layers = l;
        b->bytes = all;
        if (l == n) break;
    }
    if (!b->layers)
        die("--synthetic %s: not even %d layers fit in the %.1f MiB the benchmark may take (--ram SIZE)", spec, step < n ? step : n,
            room / 1048576.0);
    b->fd = cmd_synthetic_file(&b->sy, b->layers, 1, b->path, sizeof b->path);
}

/* Seconds of prompt (or of a decoded token) measured on b->layers, scaled to the whole model:
 * the layers' share by all / measured layers, the output head once. */
static double cmd_bench_scaled(const struct cmd_bench_synthetic *b, double seconds)
{
    if (b->layers == b->sy.n_layers || seconds <= b->head_s) return seconds;
    return b->head_s + (seconds - b->head_s) * b->sy.n_layers / b->layers;
}

static void cmd_bench_say_synthetic(const struct cmd_bench_synthetic *b)
{
    printf("synthetic %s (%s): %d layers, %.2f GiB of weights; ", b->sy.spec, b->sy.g->about, b->sy.n_layers, b->all / 1073741824.0);
    if (b->layers == b->sy.n_layers) printf("all of them random in memory, measured\n");
    else
        printf("measured on %d layers (%.2f GiB random in memory), their time scaled by %d/%d, the output head (%.1f ms) once\n",
               b->layers, b->bytes / 1073741824.0, b->sy.n_layers, b->layers, b->head_s * 1e3);
    if (!b->fits)
        printf("synthetic: the whole model does not fit in this machine's memory: a run would read experts from the disk, slower "
               "than this (coli plan --synthetic %s gives the traffic)\n", b->sy.spec);
}

/* One line of bench's profile: the time per token of WHAT (prompt or decode: N tokens) and each
 * phase's share of it; with JSON the field WHAT_ms_per_token, ms a token per phase. */
static void cmd_bench_say_phases(const char *what, const double *ph, int n, int json)
{
    double total = 0;
    for (int p = 0; p < MODEL_PHASE_COUNT; p++) total += ph[p];
    if (json) {
        printf(",\"%s_ms_per_token\":{", what);
        for (int p = 0; p < MODEL_PHASE_COUNT; p++) printf("%s\"%s\":%.4f", p ? "," : "", model_phase_names[p], ph[p] / n * 1e3);
        printf("}");
        return;
    }
    printf("%s per token: %.2f ms:", what, total / n * 1e3);
    for (int p = 0; p < MODEL_PHASE_COUNT; p++)
        printf("%s %s %.1f%%", p ? "," : "", model_phase_names[p], 100 * plat_ratio(ph[p], total));
}

/* bench's decode profile: the share of each phase of the model's decode steps (N_FWD tokens,
 * measured on the layers that ran), and the roofline: the bytes a token reads against the
 * read bandwidth measured now, the decode rate that allows, and the rate measured (TG_M). With
 * a device open the host's bus is not the whole story: no roofline then. */
static void cmd_bench_say_profile(struct model *m, int n_fwd, double tg_m, int json)
{
    const double *ph = m->profile.seconds[1];
    double trunk, bytes = model_decode_bytes(m, &trunk), gbps = cuda.n_devices ? 0 : ops_bench_host_gbps();
    double roof = gbps * 1e9 / bytes;
    const struct model_profile *pf = &m->profile;
    cmd_bench_say_phases("decode", ph, n_fwd, json);
    if (json && cuda.n_devices)
        printf(",\"decode_driver_calls_per_token\":%.2f,\"decode_waits_per_token\":%.2f,\"decode_graph_launches_per_token\":%.2f",
               (double)pf->calls[1] / n_fwd, (double)pf->waits[1] / n_fwd, (double)pf->graphs[1] / n_fwd);
    else if (cuda.n_devices)
        printf("\n  device: %.1f driver calls, %.1f waits and %.1f graph launches a decode step (the mean of %d)",
               (double)pf->calls[1] / n_fwd, (double)pf->waits[1] / n_fwd, (double)pf->graphs[1] / n_fwd, n_fwd);
    if (json) {
        printf(",\"decode_bytes_per_token\":%.0f", bytes);
        if (!cuda.n_devices) printf(",\"read_gb_s\":%.3f,\"roofline_tok_s\":%.3f", gbps, roof);
        return;
    }
    printf("\n  products %.1f GB/s, experts %.1f GB/s of weights (their bytes over their time)\n",
           plat_ratio(trunk * n_fwd, ph[MODEL_PHASE_PRODUCTS] * 1e9), plat_ratio((bytes - trunk) * n_fwd, ph[MODEL_PHASE_EXPERTS] * 1e9));
    if (cuda.n_devices) return;
    printf("decode roofline: %.1f MiB a token at %.1f GB/s read bandwidth (measured now): %.2f tok/s; measured %.2f tok/s = %.0f%%\n",
           bytes / 1048576.0, gbps, roof, tg_m, 100 * tg_m / roof);
}

/* Before bench measures: the experts mapped (§6 expert_map_ahead), as in a run that has been up
 * a while, and how long that took, on stderr. */
static void cmd_bench_map_ahead(struct expert_store *s)
{
    if (!s || !s->mapper_on) return;
    expert_map_ahead_join(s, 0);
    plat_log("[experts] %.2f GiB of experts mapped ahead in %.2f s (before the measured run)",
             s->map_ahead_bytes / 1073741824.0, s->map_ahead_s);
}

/* coli bench: prompt and decode speed on N_BENCH_PROMPT random tokens then n_predict more
 * (greedy, end-of-generation ignored), or the kernel table with --kernels. With --synthetic,
 * on the random weights of a geometry (cmd_bench_synthetic_open), on the CPU. */
static int cmd_bench(const struct cmd_options *o)
{
    if (o->kernels) {
        ops_bench_kernels();
        for (int d = 0; d < cuda.n_devices && cuda.ready; d++)
            if (cuda.dev[d].usable) cuda_bench_kernels(d);
        return 0;
    }
    struct cmd_session s;
    struct cmd_options bo = *o;
    struct cmd_bench_synthetic sb = {.fd = -1};
    bo.ignore_eog = 1;
    bo.sample.temp = 0;
    bo.n_ctx = o->n_ctx ? o->n_ctx : o->n_bench_prompt + o->n_predict + 1;
    if (o->synthetic) {
        cmd_bench_synthetic_open(&sb, o->synthetic, o->ram_bytes);
        bo.model = sb.path;
        bo.heat_path = ""; /* random routing: nothing worth keeping */
        bo.ram_bytes = (int64_t)1 << 60; /* the experts stay in the memory file, as a model in the page cache */
    }
    cmd_open(&s, &bo, 1, 0, MODEL_COPY_BESIDE_FILE_PAGES);
    int *ids = plat_alloc((size_t)o->n_bench_prompt * sizeof *ids);
    uint64_t rng = o->seed_given ? o->sample.seed : 42;
    for (int i = 0; i < o->n_bench_prompt; i++) ids[i] = (int)(sample_next_u64(&rng) % (uint64_t)s.tok.n_vocab);
    struct engine_request req = cmd_request(&bo, ids, o->n_bench_prompt, o->n_predict, NULL);
    req.want_top = 0;
    struct engine_gen g;
    cmd_bench_map_ahead(s.model.experts);
    engine_generate(&s.engine, 0, &req, &g);
    if (g.stop == ENGINE_STOP_ERROR) die("%s", g.error);
    int n_fwd = g.n_tokens > 1 ? g.n_tokens - 1 : 0;
    int scaled = o->synthetic && sb.layers < sb.sy.n_layers;
    if (scaled) sb.head_s = model_head_seconds(&s.model);
    double pp_m = plat_ratio(g.n_prompt, g.prompt_s), tg_m = plat_ratio(n_fwd, g.decode_s);
    double pp = o->synthetic ? plat_ratio(g.n_prompt, cmd_bench_scaled(&sb, g.prompt_s)) : pp_m;
    double tg = o->synthetic && n_fwd ? 1 / cmd_bench_scaled(&sb, g.decode_s / n_fwd) : tg_m;
    if (o->json) {
        printf("{\"model\":");
        json_write_string(stdout, o->synthetic ? o->synthetic : o->model, strlen(o->synthetic ? o->synthetic : o->model));
        printf(",\"prompt_tokens\":%d,\"gen_tokens\":%d,\"threads\":%d,\"kernels\":\"%s\",\"prompt_tok_s\":%.3f,\"decode_tok_s\":%.3f",
               g.n_prompt, g.n_tokens, plat_threads(), quant_level_name(), pp, tg);
        if (o->synthetic)
            printf(",\"synthetic\":{\"layers\":%d,\"layers_measured\":%d,\"bytes\":%llu,\"bytes_measured\":%llu,\"head_s\":%.6f,"
                   "\"measured_prompt_tok_s\":%.3f,\"measured_decode_tok_s\":%.3f,\"fits_in_memory\":%s}", sb.sy.n_layers, sb.layers,
                   (unsigned long long)sb.all, (unsigned long long)sb.bytes, sb.head_s, pp_m, tg_m, sb.fits ? "true" : "false");
        if (g.n_prompt) cmd_bench_say_phases("prompt", s.model.profile.seconds[0], g.n_prompt, 1);
        if (n_fwd) cmd_bench_say_profile(&s.model, n_fwd, tg_m, 1);
        if (s.model.experts) {
            printf(",\"experts\":");
            cmd_json_experts(stdout, s.model.experts);
        }
        printf("}\n");
    } else {
        if (o->synthetic) cmd_bench_say_synthetic(&sb);
        printf("prompt: %d tokens, %.2f tok/s", g.n_prompt, pp);
        if (scaled) printf(" (measured %.2f on %d layers)", pp_m, sb.layers);
        printf("\ndecode: %d tokens, %.2f tok/s", g.n_tokens, tg);
        if (scaled) printf(" (measured %.2f on %d layers)", tg_m, sb.layers);
        printf("\n");
        if (g.n_prompt) {
            cmd_bench_say_phases("prompt", s.model.profile.seconds[0], g.n_prompt, 0);
            printf("\n");
        }
        if (n_fwd) cmd_bench_say_profile(&s.model, n_fwd, tg_m, 0);
        if (s.model.experts) cmd_print_expert_stats(s.model.experts);
    }
    engine_gen_free(&g);
    free(ids);
    cmd_close(&s);
    if (sb.fd >= 0) close(sb.fd);
    return 0;
}

/* The name /v1/models gives the model: its file's name without the directory and ".gguf". */
static char *cmd_model_id(const char *path)
{
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    char *id = plat_strdup(base);
    size_t n = strlen(id);
    if (n > 5 && !strcmp(id + n - 5, ".gguf")) id[n - 5] = 0;
    return id;
}

/* coli serve: the OpenAI-compatible server (§12) on O's model until SIGINT or SIGTERM; it
 * listens before the model loads (/health answers 503 until then). */
static int cmd_serve(const struct cmd_options *o)
{
    struct serve srv;
    struct cmd_session s;
    struct cmd_options so = *o;
    pthread_t acceptor;
    if (!o->model) die_usage("serve needs a model (-m MODEL.gguf)");
    if (!so.n_ctx) so.n_ctx = SERVE_DEFAULT_CTX;
    memset(&srv, 0, sizeof srv);
    char *id = cmd_model_id(o->model);
    srv.model_id = id;
    srv.api_key = o->api_key && *o->api_key ? o->api_key : NULL;
    srv.queue_max = o->queue;
    srv.default_max = o->n_predict;
    srv.sample = o->sample;
    srv.think = o->think;
    serve_start(&srv, o->host, o->port, &acceptor);
    cmd_open(&s, &so, o->parallel, o->cache_ram, MODEL_COPY_OVER_FILE_PAGES);
    plat_log("[serve] chat template: %s", s.tok.chat_template_about);
    plat_log("[serve] prompt cache (--cache-ram): %.2f GiB for checkpoints of the DeltaNet state (%.1f MiB each, %d per slot) "
             "and idle conversations parked in RAM", s.engine.cache_budget / 1073741824.0, s.engine.checkpoint_bytes / 1048576.0,
             ENGINE_MAX_CHECKPOINTS);
    pthread_mutex_lock(&srv.mu);
    srv.engine = &s.engine;
    srv.tok = &s.tok;
    srv.n_slots = s.engine.n_slots;
    srv.ready = 1;
    pthread_mutex_unlock(&srv.mu);
    plat_log("[serve] ready: %s, %d slot%s of %d tokens, queue %d%s", id, srv.n_slots, srv.n_slots == 1 ? "" : "s", s.model.n_ctx,
             srv.queue_max, srv.api_key ? ", API key required" : "");
    serve_run(&srv);
    serve_stop(&srv, acceptor);
    cmd_close(&s);
    plat_log("[serve] stopped%s", s.model.experts ? "; expert heat saved" : "");
    free(id);
    return 0;
}

/* coli plan's device lines: each device's budget and what the trunk (the first TRUNK[d] bytes
 * charged) and the experts take of it; or why there is no device. */
static void cmd_plan_devices(const int64_t *trunk)
{
    if (!cuda.ready) {
        printf("cuda: none: %s\n", cuda.why);
        return;
    }
    for (int i = 0; i < cuda.n_devices; i++) {
        const struct cuda_device *d = &cuda.dev[i];
        if (!d->usable) printf("cuda %d: %s: %s\n", i, d->name, d->selected ? "unusable" : "not selected (--gpu)");
        else printf("cuda %d: %s, budget %.2f GiB: trunk %.1f MiB, experts %.1f MiB, %.2f GiB left\n", i, d->name,
                    d->budget / 1073741824.0, trunk[i] / 1048576.0, (d->used - trunk[i]) / 1048576.0,
                    (d->budget - d->used) / 1073741824.0);
    }
}

/* coli plan's CPU lines: the trunk less the TRUNK_VRAM bytes placed, the embedding, the experts
 * less EXPERTS_VRAM, the KV cache, and the memory there is. */
static void cmd_plan_cpu(const struct model *m, const struct cmd_options *o, double trunk_vram, double experts_vram)
{
    const struct model_config *c = &m->cfg;
    uint64_t experts = model_expert_bytes(m), trunk = m->file.tensor_bytes - experts;
    int tied = m->lm_head.data == m->embed->data; /* then the embedding is lm_head, read every token */
    if (!tied) trunk -= m->embed->bytes;
    int ctx = model_choose_ctx(m, o->n_ctx);
    double cpu_experts = (double)experts - experts_vram, kv = (double)model_kv_bytes_per_token(m);
    printf("cpu: trunk (dense, read every token): %.1f MiB\n", ((double)trunk - trunk_vram) / 1048576.0);
    if (!tied) printf("cpu: token embedding (one row read per token): %.1f MiB, memory-mapped\n", m->embed->bytes / 1048576.0);
    if (c->n_expert)
        printf("cpu: routed experts: %.1f MiB, about %.1f MiB read per token\n", cpu_experts / 1048576.0,
               cpu_experts * c->n_expert_used / c->n_expert / 1048576.0);
    if (m->experts && m->experts->mapped) printf("cpu: expert store: every routed expert on the CPU stays in memory\n");
    else if (m->experts) {
        printf("cpu: expert RAM cache: %.2f GiB%s, %d of %d experts, the rest read from the file\n",
               (double)m->experts->n_slots * m->experts->slot_bytes / 1073741824.0, o->ram_bytes < 0 ? "" : " (--ram)",
               m->experts->n_slots, c->n_layers * c->n_expert);
    }
    printf("cpu: KV cache: %.1f KiB per token, %.1f MiB at context %d\n", kv / 1024.0, kv * ctx / 1048576.0, ctx);
    printf("memory available: %.1f MiB\n", plat_mem_available() / 1048576.0);
}

/* coli plan's expectation: the bytes each bus reads per token as placed (R) against the host's
 * read bandwidth measured here and each device's probed kernel speed, so a decode rate bounded
 * by memory traffic alone: the buses' times added (a layer's trunk products and its experts
 * wait on each other), reads from the file not timed. */
struct cmd_plan_expectation { double host_gbps, seconds, dev_seconds[CUDA_MAX_DEVICES]; int unprobed; };

static struct cmd_plan_expectation cmd_plan_expect(const struct place_result *r)
{
    struct cmd_plan_expectation x = {0};
    x.host_gbps = ops_bench_host_gbps();
    x.seconds = r->cpu_per_token / (x.host_gbps * 1e9);
    for (int d = 0; d < cuda.n_devices; d++) {
        if (r->dev_per_token[d] <= 0) continue;
        x.dev_seconds[d] = place_device_seconds(r, &r->speed, d);
        x.seconds += x.dev_seconds[d];
        x.unprobed += x.dev_seconds[d] == 0;
    }
    return x;
}

/* coli plan's expectation lines (X of R). */
static void cmd_plan_say_expect(const struct place_result *r, const struct cmd_plan_expectation *x)
{
    printf("expected per token: cpu %.1f MiB on the memory bus (%.1f GB/s measured: %.2f ms)", r->cpu_per_token / 1048576.0,
           x->host_gbps, r->cpu_per_token / (x->host_gbps * 1e9) * 1e3);
    for (int d = 0; d < cuda.n_devices; d++) {
        if (r->dev_per_token[d] <= 0) continue;
        if (x->dev_seconds[d] > 0)
            printf(", cuda %d %.1f MiB (%.1f GB/s probed: %.2f ms)", d, r->dev_per_token[d] / 1048576.0, r->speed.gbps[d], x->dev_seconds[d] * 1e3);
        else printf(", cuda %d %.1f MiB (not probed)", d, r->dev_per_token[d] / 1048576.0);
    }
    printf("; %.1f MiB of it from the file\n", r->file_per_token / 1048576.0);
    printf("expected decode: at most %.1f tok/s (memory traffic alone, the buses one after another%s)\n", 1 / x->seconds,
           x->unprobed ? "; the devices not probed not counted" : "");
}

/* coli plan --json: the same as one object on stdout: devices, components (bytes, values,
 * where they went), the CPU's side with the expert cache, and the expectation. */
static void cmd_plan_json(const struct model *m, const char *name, const struct place_result *r, const struct cmd_plan_expectation *x)
{
    const struct model_config *c = &m->cfg;
    uint64_t experts = model_expert_bytes(m), trunk = m->file.tensor_bytes - experts;
    const struct expert_store *s = m->experts;
    if (m->lm_head.data != m->embed->data) trunk -= m->embed->bytes;
    printf("{\"model\":");
    json_write_string(stdout, name, strlen(name));
    printf(",\"devices\":[");
    for (int i = 0, k = 0; i < cuda.n_devices && cuda.ready; i++) {
        const struct cuda_device *d = &cuda.dev[i];
        if (!d->usable) continue;
        printf("%s{\"index\":%d,\"name\":", k++ ? "," : "", i);
        json_write_string(stdout, d->name, strlen(d->name));
        printf(",\"budget_bytes\":%lld,\"trunk_bytes\":%lld,\"expert_bytes\":%lld,\"left_bytes\":%lld,\"probed_gb_s\":%.3f,"
               "\"bytes_per_token\":%.0f}", (long long)d->budget, (long long)r->trunk_vram[i], (long long)(d->used - r->trunk_vram[i]),
               (long long)(d->budget - d->used), r->speed.gbps[i], r->dev_per_token[i]);
    }
    printf("],\"components\":[");
    for (int k = 0, said = 0; k < PLACE_COUNT; k++) {
        const struct place_summary *q = &r->comp[k];
        if (!q->total) continue;
        printf("%s{\"name\":\"%s\",\"count\":%d,\"bytes\":%.0f,\"value_min\":%.4f,\"value_max\":%.4f,\"on_device\":[", said++ ? "," : "",
               place_names[k], q->total, q->bytes, q->lo, q->hi);
        for (int d = 0; d < cuda.n_devices; d++) printf("%s%d", d ? "," : "", q->on[d]);
        printf("],\"cpu\":%d}", q->total - q->placed);
    }
    printf("],\"cpu\":{\"trunk_bytes\":%.0f,\"expert_bytes\":%.0f,\"expert_cache\":", (double)trunk - r->trunk_cpu_bytes,
           (double)experts - r->expert_cpu_bytes);
    if (!s || s->mapped) printf("{\"mode\":\"mapped\"}");
    else printf("{\"mode\":\"cached\",\"slots\":%d,\"bytes\":%lld}", s->n_slots, (long long)s->n_slots * (long long)s->slot_bytes);
    printf(",\"kv_bytes_per_token\":%lld},\"expected\":{\"cpu_bytes_per_token\":%.0f,\"file_bytes_per_token\":%.0f,\"host_gb_s\":%.3f,"
           "\"seconds_per_token\":%.9f,\"tok_s\":%.3f,\"devices_not_probed\":%d},\"layers\":%d}\n",
           (long long)model_kv_bytes_per_token(m), r->cpu_per_token, r->file_per_token, x->host_gbps, x->seconds,
           x->seconds > 0 ? 1 / x->seconds : 0.0, x->unprobed, c->n_layers);
}

/* coli plan: where each part of the model would live, decided by the code a run uses (§7 as a
 * dry run: budgets charged, nothing allocated or copied, no weight read) and printed on stdout:
 * the [place] lines a run logs, a line per device, then what stays on the CPU. */
static int cmd_plan(const struct cmd_options *o)
{
    struct model m;
    struct cmd_synthetic sy;
    char path[64];
    int fd = -1;
    if (!o->model && !o->synthetic) die_usage("plan needs a model (-m MODEL.gguf, or --synthetic GEOMETRY)");
    if (o->synthetic) {
        cmd_synthetic_parse(o->synthetic, &sy);
        fd = cmd_synthetic_file(&sy, sy.n_layers, 0, path, sizeof path);
    }
    memset(&m, 0, sizeof m);
    gguf_open(&m.file, o->synthetic ? path : o->model);
    model_read_config(&m.cfg, &m.file);
    model_bind(&m);
    m.kv = o->kv;
    model_check_kv(&m);
    m.n_ctx = model_choose_ctx(&m, o->n_ctx);
    place_dry_run = 1;
    place_say_stdout = !o->json;
    struct model_budget b = model_expert_budget(&m, 1, 0, o->ram_bytes);
    struct place_result r;
    model_place(&m, 1, b.budget, o->ram_bytes < 0, MODEL_COPY_BESIDE_FILE_PAGES, o->synthetic && !o->heat_path ? "" : o->heat_path,
                o->expert_io, o->place, &r);
    if (m.experts && !m.experts->mapped) expert_size_slots(m.experts);
    struct cmd_plan_expectation x = cmd_plan_expect(&r);
    if (o->json) cmd_plan_json(&m, o->synthetic ? o->synthetic : o->model, &r, &x);
    else {
        cmd_plan_devices(r.trunk_vram);
        cmd_plan_cpu(&m, o, r.trunk_cpu_bytes, r.expert_cpu_bytes);
        cmd_plan_say_expect(&r, &x);
    }
    expert_close(m.experts);
    free(m.layers);
    gguf_close(&m.file);
    if (fd >= 0) close(fd);
    return 0;
}

/* ==== §14 main ==== */
/* Owns: the command line (design.md §3: stable, scripts rely on it) and start-up order:
 *   CPU features, kernel table, threads, then the command.
 * Promises: a bad flag or value is a one-line usage error with exit status 2. */

static const char arg_usage[] =
    "usage: coli COMMAND [options]\n"
    "\n"
    "commands:\n"
    "  run       -m MODEL.gguf -p TEXT [-n N] [--chat] [--json] [sampling] [resources]\n"
    "  chat      -m MODEL.gguf [--system TEXT] [--no-think] [--hide-think] [sampling] [resources]\n"
    "  serve     -m MODEL.gguf [--host 127.0.0.1] [--port 8080] [--parallel N] [--queue N] [--api-key KEY]\n"
    "            [--cache-ram SIZE]\n"
    "            [-n N] [sampling] [resources]   an OpenAI-compatible server (coli help serve)\n"
    "  plan      -m MODEL.gguf [--json] [resources]   where each part would live, without loading weights\n"
    "  bench     -m MODEL.gguf [-p 512] [-n 128] [--json] [resources]   |   bench --kernels\n"
    "  info      [-m MODEL.gguf]                  machine, CPU features, model\n"
    "            plan, bench and info take --synthetic GEOMETRY[:QUANT[:LAYERS]] instead of -m: a model\n"
    "            not downloaded yet (35b-a3b, 80b-a3b-next, tiny; q4_k_m or a format such as q4_0)\n"
    "  tokenize  -m MODEL.gguf -p TEXT            one token id per line\n"
    "  help COMMAND, COMMAND --help, --help, --version\n"
    "\n"
    "every command: -v/--verbose also says what is only news when something is wrong (no NVIDIA driver);\n"
    "           -q/--quiet: no progress line while a model loads (there is none when stderr is not a terminal)\n"
    "\n"
    "sampling:  --temp T (0 = greedy)  --top-k K  --top-p P  --min-p P  --repeat-penalty R\n"
    "           --repeat-last-n N  --seed S  --ignore-eog (do not stop at end-of-generation)\n"
    "resources: -t/--threads N  -c/--ctx N (default: the model's, capped by free memory)\n"
    "           --kv f32|f16|q8_0 (the KV cache's format; f16 takes half the memory and reads, q8_0 about\n"
    "           a quarter, default f32)\n"
    "           --ram SIZE (expert cache, e.g. 8G; default: what memory leaves after the trunk)\n"
    "           --heat FILE (expert heat: read at start, saved at exit; default in ~/.cache/coli;\n"
    "           '' or /dev/null: none kept)\n"
    "           --gpu LIST|off (devices in PCI bus order, e.g. 0,1)  --vram SIZE (per device)\n"
    "           --place auto|off|COMPONENT=DEVICE,... where DEVICE may split the layers, DEV:N+DEV:N...\n"
    "             (lmhead attnproj dnproj dnout shexp router ffn experts; e.g. lmhead=0,dnproj=0:20+1:20)\n"
    "           --no-probe (auto placement without timing a trunk product on each device and the CPU)\n"
    "environment: COLI_CPU=scalar|avx2|avx512|avx512vbmi forces a kernel level; COLI_CUDA=0 never\n"
    "           loads the driver; COLI_LIBCUDA=PATH names it; COLI_GPUS, CUDA_EXPERT_GB (GiB),\n"
    "           COLI_PLACE, HEAT_FILE as the flags; COLI_EXPERT_IO=direct|buffered (how missing experts\n"
    "           are read)\n";

static const char *const arg_command_help[][2] = {
    {"run", "coli run -m MODEL.gguf -p TEXT [-n N] [--chat] [--system TEXT] [--no-think] [--json]\n"
            "  Generates N tokens (default 128) after TEXT. TEXT is raw (special-token texts such as\n"
            "  <|im_start|> are parsed) unless --chat wraps it in the model's chat template.\n"
            "  --json prints one JSON object on stdout: prompt_tokens, tokens, text, top (the five best\n"
            "  [id, logit] pairs at every generated position), stop, timings, experts. Default: greedy.\n"},
    {"chat", "coli chat -m MODEL.gguf [--system TEXT] [--no-think] [--hide-think] [-n N]\n"
             "  An interactive conversation. Thinking is shown dimmed (--hide-think hides it, --no-think or\n"
             "  --reasoning off skips it). /reset starts over, /exit or Ctrl-D leaves, Ctrl-C stops an answer.\n"
             "  Default sampling: --temp 0.6 --top-k 20 --top-p 0.95.\n"},
    {"serve", "coli serve -m MODEL.gguf [--host 127.0.0.1] [--port 8080] [--parallel N] [--queue N] [--api-key KEY]\n"
              "           [--cache-ram SIZE] [--no-think | --reasoning off]\n"
              "  The OpenAI API over HTTP/1.1: POST /v1/chat/completions and /v1/completions (streaming or not),\n"
              "  POST /apply-template (the prompt a chat request renders to), GET /v1/models, /health (503 while\n"
              "  loading) and /metrics (Prometheus). --port 0 picks a free port\n"
              "  (said on stderr). --parallel N conversations decode together as one batch (default: what a quarter\n"
              "  of free memory holds at full context, 1-4, fewer where more would leave routed experts out of\n"
              "  memory), each with -c tokens (default 32768); --queue N requests\n"
              "  wait beyond them (default 16; more get 503). --api-key KEY (or COLI_API_KEY) requires\n"
              "  'Authorization: Bearer KEY' everywhere but /health. -n N: max_tokens when a request has none\n"
              "  (default: the rest of the context). Sampling flags set the defaults of a request's fields.\n"
              "  A request reuses what a slot, or a conversation parked in RAM, holds of its prompt: the KV cache\n"
              "  and checkpoints of the DeltaNet state where prompts open the answer; --cache-ram SIZE bounds\n"
              "  the checkpoints and parked conversations (default: an eighth of free memory, 8 GiB at most,\n"
              "  less where the routed experts would not fit in memory beside it; 0: a slot keeps only its last\n"
              "  state). A request's \"cache_prompt\": false computes it all. The experts are copied into\n"
              "  coli's memory where it holds them once (faster decode, a slower start).\n"
              "  SIGINT/SIGTERM: running generations are cancelled, the heat saved, exit 0.\n"},
    {"plan", "coli plan -m MODEL.gguf [-c N] [--ram SIZE] [--gpu LIST] [--vram SIZE] [--place SPEC] [--no-probe] [--json]\n"
             "  Where each part of the model would live, without loading weights: the [probe] and [place]\n"
             "  lines that coli run logs (same decisions), each device's budget and what the trunk and the\n"
             "  experts take of it, what stays on the CPU (trunk, embedding, experts, their RAM cache, KV\n"
             "  cache), the bytes each bus would read per token and the decode rate that traffic allows at\n"
             "  the bandwidth measured here. --json: the same as one object (the lines go to stderr).\n"
             "  --synthetic GEOMETRY[:QUANT[:LAYERS]] instead of -m: the same for a model you do not have\n"
             "  (35b-a3b, 80b-a3b-next or tiny; QUANT q4_k_m (default), or a format for the routed experts\n"
             "  with the rest Q8_0, e.g. q4_0; LAYERS: fewer layers than the geometry's).\n"},
    {"bench", "coli bench -m MODEL.gguf [-p 512] [-n 128] [--seed S] [--json]\n"
              "  Prompt and decode speed on random tokens (drawn from seed S, default 42; decode is greedy).\n"
              "  coli bench --kernels prints GEMV throughput per weight format against the machine's measured\n"
              "  memory bandwidth, then on each CUDA device in use against the card's.\n"
              "  coli bench --synthetic GEOMETRY[:QUANT[:LAYERS]] (as coli plan) runs the real kernels on random\n"
              "  weights of that geometry in memory, on the CPU (with --gpu LIST, placed on those devices too):\n"
              "  as many whole blocks of layers as --ram SIZE allows (default three quarters of free memory),\n"
              "  their time scaled to all the layers.\n"},
    {"info", "coli info [-m MODEL.gguf | --synthetic GEOMETRY[:QUANT[:LAYERS]]]\n"
             "  The machine (CPU, features, kernel level, cores, memory) and the model's hyper-parameters.\n"},
    {"tokenize", "coli tokenize -m MODEL.gguf -p TEXT\n  One token id per line (special-token texts parsed). A vocabulary-only GGUF is enough.\n"},
};

/* The value after flag ARGV[*I]; usage error if missing. */
static const char *arg_value(int argc, char **argv, int *i)
{
    if (*i + 1 >= argc) die_usage("%s needs a value", argv[*i]);
    return argv[++*i];
}

static long arg_int(int argc, char **argv, int *i, long lo, long hi)
{
    const char *flag = argv[*i], *v = arg_value(argc, argv, i);
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) die_usage("%s: '%s' is not a whole number in [%ld, %ld]", flag, v, lo, hi);
    return x;
}

/* 1 for "on", 0 for "off". */
static int arg_on_off(int argc, char **argv, int *i)
{
    const char *flag = argv[*i], *v = arg_value(argc, argv, i);
    if (strcmp(v, "on") && strcmp(v, "off")) die_usage("%s: '%s' is not on or off", flag, v);
    return !strcmp(v, "on");
}

static float arg_float(int argc, char **argv, int *i, double lo, double hi)
{
    const char *flag = argv[*i], *v = arg_value(argc, argv, i);
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end || !(x >= lo && x <= hi)) die_usage("%s: '%s' is not a number in [%g, %g]", flag, v, lo, hi);
    return (float)x;
}

/* A size such as 512M, 12G, 1.5G or a plain number of bytes. */
static int64_t arg_size(int argc, char **argv, int *i)
{
    const char *flag = argv[*i], *v = arg_value(argc, argv, i);
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    double unit = *end == 'K' || *end == 'k' ? 1024.0 : *end == 'M' || *end == 'm' ? 1048576.0
                : *end == 'G' || *end == 'g' ? 1073741824.0 : *end == 'T' || *end == 't' ? 1099511627776.0 : 1.0;
    if (unit > 1.0) end++;
    if (*end == 'i' && unit > 1.0) end++;
    if (*end == 'B' || *end == 'b') end++;
    if (errno || end == v || *end || !(x >= 0) || x * unit > 9.0e18) die_usage("%s: '%s' is not a size such as 512M or 12G", flag, v);
    return (int64_t)(x * unit);
}

/* --kv's value. */
static enum ops_kv arg_kv_format(const char *v)
{
    if (!strcmp(v, "f32")) return OPS_KV_F32;
    if (!strcmp(v, "f16")) return OPS_KV_F16;
    if (!strcmp(v, "q8_0")) return OPS_KV_Q8_0;
    die_usage("--kv: '%s' is not a KV cache format (f32, f16 or q8_0)", v);
}

static int arg_help(const char *cmd)
{
    for (size_t i = 0; cmd && i < sizeof arg_command_help / sizeof *arg_command_help; i++)
        if (!strcmp(cmd, arg_command_help[i][0])) {
            fputs(arg_command_help[i][1], stdout);
            return 0;
        }
    if (cmd) die_usage("no command '%s' (coli --help lists them)", cmd);
    fputs(arg_usage, stdout);
    return 0;
}

/* Parses the options after the command word into O. Defaults depend on the command. */
static void arg_parse(const char *cmd, int argc, char **argv, struct cmd_options *o)
{
    int chat = !strcmp(cmd, "chat"), bench = !strcmp(cmd, "bench"), serve = !strcmp(cmd, "serve");
    int synthetic = bench || !strcmp(cmd, "plan") || !strcmp(cmd, "info");
    memset(o, 0, sizeof *o);
    o->n_predict = serve ? -1 : chat ? 0 : 128;
    o->host = "127.0.0.1";
    o->port = 8080;
    o->queue = 16;
    o->n_bench_prompt = 512;
    o->think = 1;
    o->sample = (struct sample_params){chat ? 0.6f : 0.0f, chat ? 20 : 0, chat ? 0.95f : 1.0f, 0.0f, 1.0f, 64, 0, 0.0f, 0.0f};
    o->sample.seed = (uint64_t)time(NULL);
    o->ram_bytes = o->vram_bytes = o->cache_ram = -1;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) exit(arg_help(cmd));
        if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) o->verbose = 1;
        else if (!strcmp(a, "-q") || !strcmp(a, "--quiet")) plat_quiet = 1;
        else if (!strcmp(a, "-m") || !strcmp(a, "--model")) o->model = arg_value(argc, argv, &i);
        else if (!strcmp(a, "--synthetic") && synthetic) o->synthetic = arg_value(argc, argv, &i);
        else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) {
            if (bench) o->n_bench_prompt = (int)arg_int(argc, argv, &i, 1, 1 << 20);
            else o->prompt = arg_value(argc, argv, &i);
        } else if (!strcmp(a, "-n") || !strcmp(a, "--n-predict")) o->n_predict = (int)arg_int(argc, argv, &i, 0, 1 << 24);
        else if (!strcmp(a, "-t") || !strcmp(a, "--threads")) o->threads = (int)arg_int(argc, argv, &i, 1, 1024);
        else if (!strcmp(a, "-c") || !strcmp(a, "--ctx")) o->n_ctx = (int)arg_int(argc, argv, &i, 1, 1 << 24);
        else if (!strcmp(a, "--kv")) o->kv = arg_kv_format(arg_value(argc, argv, &i));
        else if (!strcmp(a, "--system")) o->system = arg_value(argc, argv, &i);
        else if (!strcmp(a, "--chat")) o->chat = 1;
        else if (!strcmp(a, "--json")) o->json = 1;
        else if (!strcmp(a, "--no-think")) o->think = 0;
        else if (!strcmp(a, "--reasoning")) o->think = arg_on_off(argc, argv, &i);
        else if (!strcmp(a, "--hide-think")) o->hide_think = 1;
        else if (!strcmp(a, "--ignore-eog")) o->ignore_eog = 1;
        else if (!strcmp(a, "--kernels") && bench) o->kernels = 1;
        else if (!strcmp(a, "--host") && serve) o->host = arg_value(argc, argv, &i);
        else if (!strcmp(a, "--port") && serve) o->port = (int)arg_int(argc, argv, &i, 0, 65535);
        else if (!strcmp(a, "--parallel") && serve) o->parallel = (int)arg_int(argc, argv, &i, 1, MODEL_MAX_RUNS);
        else if (!strcmp(a, "--queue") && serve) o->queue = (int)arg_int(argc, argv, &i, 0, 1 << 20);
        else if (!strcmp(a, "--cache-ram") && serve) o->cache_ram = arg_size(argc, argv, &i);
        else if (!strcmp(a, "--api-key") && serve) o->api_key = arg_value(argc, argv, &i);
        else if (!strcmp(a, "--ram")) o->ram_bytes = arg_size(argc, argv, &i);
        else if (!strcmp(a, "--heat")) o->heat_path = arg_value(argc, argv, &i);
        else if (!strcmp(a, "--gpu")) o->gpu_list = arg_value(argc, argv, &i);
        else if (!strcmp(a, "--vram")) o->vram_bytes = arg_size(argc, argv, &i);
        else if (!strcmp(a, "--place")) o->place = arg_value(argc, argv, &i);
        else if (!strcmp(a, "--no-probe")) place_no_probe = 1;
        else if (!strcmp(a, "--temp")) o->sample.temp = arg_float(argc, argv, &i, 0, 100);
        else if (!strcmp(a, "--top-k")) o->sample.top_k = (int)arg_int(argc, argv, &i, 0, INT_MAX);
        else if (!strcmp(a, "--top-p")) o->sample.top_p = arg_float(argc, argv, &i, 0, 1);
        else if (!strcmp(a, "--min-p")) o->sample.min_p = arg_float(argc, argv, &i, 0, 1);
        else if (!strcmp(a, "--repeat-penalty")) o->sample.repeat_penalty = arg_float(argc, argv, &i, 0.01, 100);
        else if (!strcmp(a, "--repeat-last-n")) o->sample.repeat_last_n = (int)arg_int(argc, argv, &i, 0, 1 << 24);
        else if (!strcmp(a, "--seed")) o->sample.seed = (uint64_t)arg_int(argc, argv, &i, 0, LONG_MAX), o->seed_given = 1;
        else die_usage("%s: unknown option '%s' (coli help %s)", cmd, a, cmd);
    }
    if (o->synthetic) {
        struct cmd_synthetic sy;
        if (o->model) die_usage("%s: -m and --synthetic name two models; give one", cmd);
        cmd_synthetic_parse(o->synthetic, &sy);
        /* its layers may be scaled, so what it measures is the CPU's unless --gpu names devices
         * (a card's decode benchmark: gpu_check.sh) */
        if (bench && !o->gpu_list) o->gpu_list = "off";
    }
    /* the environment's resource settings, where no flag gave them (flags win) */
    if (!o->gpu_list) o->gpu_list = getenv("COLI_GPUS");
    if (!o->place) o->place = getenv("COLI_PLACE");
    const char *gb = getenv("CUDA_EXPERT_GB");
    if (o->vram_bytes < 0 && gb && *gb) {
        char *end;
        double x = strtod(gb, &end);
        if (*end || !(x >= 0 && x < 1e9)) die_usage("CUDA_EXPERT_GB=%s: not a number of GiB", gb);
        o->vram_bytes = (int64_t)(x * 1073741824.0);
    }
    if (!o->heat_path) o->heat_path = getenv("HEAT_FILE");
    if (!o->api_key) o->api_key = getenv("COLI_API_KEY");
    const char *io = getenv("COLI_EXPERT_IO");
    if (io && strcmp(io, "direct") && strcmp(io, "buffered")) die_usage("COLI_EXPERT_IO='%s': use direct or buffered", io);
    o->expert_io = io && !strcmp(io, "buffered") ? EXPERT_IO_BUFFERED : EXPERT_IO_DIRECT;
}

#ifndef COLI_NO_MAIN
int main(int argc, char **argv)
{
    static const struct { const char *name; int (*fn)(const struct cmd_options *); } commands[] = {
        {"run", cmd_run}, {"chat", cmd_chat}, {"serve", cmd_serve}, {"plan", cmd_plan}, {"bench", cmd_bench},
        {"info", cmd_info}, {"tokenize", cmd_tokenize},
    };
    if (argc < 2) {
        fputs(arg_usage, stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h")) return arg_help(NULL);
    if (!strcmp(cmd, "help")) return arg_help(argc > 2 ? argv[2] : NULL);
    if (!strcmp(cmd, "--version")) {
        printf("coli %s\n", COLI_VERSION);
        return 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof *commands; i++) {
        if (strcmp(cmd, commands[i].name)) continue;
        struct cmd_options o;
        arg_parse(cmd, argc - 2, argv + 2, &o);
        plat_cpu_detect();
        quant_init();
        if (o.threads) omp_set_num_threads(o.threads);
        if (o.model) { /* a bad file is said before anything else, and before the driver's start and JIT */
            struct gguf_file g;
            gguf_open(&g, o.model);
            gguf_close(&g);
        }
        int uses_gpu = commands[i].fn != cmd_tokenize;
        if (uses_gpu) cuda_start(o.gpu_list, o.vram_bytes, o.verbose); /* before any thread exists */
        return commands[i].fn(&o);
    }
    die_usage("unknown command '%s' (coli --help lists them)", cmd);
}
#endif
#endif /* COLI_C */
