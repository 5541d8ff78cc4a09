/* coli — one static binary that runs mixture-of-experts language models (first family:
 * Qwen3.5 / Qwen3.6 / Qwen3-Next, GGUF files) on the machines people already own.
 *
 * Build: ./build.sh        (musl-gcc -static -O2 -fopenmp; see build.sh)
 * Test:  ./build.sh test
 * Use:   ./coli run -m MODEL.gguf -p "Hello"      (./coli --help for the rest)
 *
 * TABLE OF CONTENTS (bottom-up: a section uses only the sections above it)
 *   §1  platform   plat_    logging, die, allocation, files, time, memory, CPU features, OpenMP shim
 *   §2  gguf       gguf_    GGUF v2/v3 reader (split files too), strictly validated, memory-mapped
 *   §3  quant      quant_   block formats, dequantisation, activation quantisation, dot products
 *   §4  ops        ops_     matrix-vector / matrix-matrix products, norms, RoPE, softmax, activations
 *   §5  cuda       cuda_    (not yet: the CUDA driver path of issue 5; coli runs on the CPU)
 *   §6  experts    expert_  (not yet: the expert store of issue 4; experts are read from the mapping)
 *   §7  place      place_   (not yet: placement; everything runs on the CPU)
 *   §8  model      model_   hyper-parameters, weight binding, forward pass (qwen35moe, qwen35, qwen3next)
 *   §9  tokenizer  tok_     byte-level BPE from GGUF metadata, special tokens, chat template
 *   §10 sample     sample_  greedy, temperature, top-k, top-p, min-p, repetition penalty, seed
 *   §11 frontends  cmd_     run, chat, serve, plan, bench, info, tokenize
 *   §12 main       arg_     argument parsing and dispatch
 *
 * Conventions: everything is static; every function carries its section prefix; shapes are
 * written outermost first, `[rows][cols]`, in elements. Errors go through die(): one line
 * `coli: <what>: <why>` and exit status 1 (2 for usage errors).
 */
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
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
#include <immintrin.h>
#include <omp.h>

#include "vendor/unicode_tables.h"

#define COLI_VERSION "0.1.0"

/* ==== §1 platform ==== */
/* Owns: the process's error path (die), allocation that cannot fail silently, whole-file
 *   mapping, monotonic time, the memory figures (cgroup-aware), the CPU's features, and the
 *   glue that lets Debian's glibc-built libgomp.a link into a static musl binary.
 * Promises: die() never returns and prints exactly one line. plat_alloc* never return NULL.
 *   plat_cpu is filled by plat_cpu_detect() before anything reads it.
 * May call: libc only.
 * Workload: start-up and error paths; nothing here is on the per-token path. */

static void die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
static void die(const char *fmt, ...)
{
    va_list ap;
    fflush(stdout);
    fputs("coli: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
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

/* Maps PATH read-only; returns 0, or -1 with errno set (the caller words the error). */
static int plat_map_file(const char *path, struct plat_map *m)
{
    struct stat st;
    m->data = NULL;
    m->size = 0;
    m->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (m->fd < 0) return -1;
    if (fstat(m->fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        if (!errno || S_ISDIR(st.st_mode)) errno = EISDIR;
        close(m->fd);
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

/* Bytes this process may still use: MemAvailable, lowered by a cgroup (v2 or v1) limit
 * minus that cgroup's current usage. Containers report the host's MemAvailable, so the
 * cgroup figure is the one that decides whether we get killed. */
static int64_t plat_mem_available(void)
{
    int64_t avail = plat_read_number("/proc/meminfo", "MemAvailable");
    avail = avail < 0 ? -1 : avail * 1024;
    int64_t limit = plat_read_number("/sys/fs/cgroup/memory.max", NULL);
    int64_t used = plat_read_number("/sys/fs/cgroup/memory.current", NULL);
    if (limit < 0) {
        limit = plat_read_number("/sys/fs/cgroup/memory/memory.limit_in_bytes", NULL);
        used = plat_read_number("/sys/fs/cgroup/memory/memory.usage_in_bytes", NULL);
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
    int avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512vnni;
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
#include <pthread.h>
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
    GGUF_TYPE_Q6_K = 14, GGUF_TYPE_Q8_K = 15, GGUF_TYPE_BF16 = 30, GGUF_TYPE_COUNT = 40
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
};

/* The formats coli computes with; other GGUF type ids are refused by name or number. */
static const struct gguf_type_info gguf_types[GGUF_TYPE_COUNT] = {
    [GGUF_TYPE_F32] = {"F32", 1, 4},      [GGUF_TYPE_F16] = {"F16", 1, 2},
    [GGUF_TYPE_BF16] = {"BF16", 1, 2},    [GGUF_TYPE_Q8_0] = {"Q8_0", 32, 34},
    [GGUF_TYPE_Q4_0] = {"Q4_0", 32, 18},  [GGUF_TYPE_Q4_1] = {"Q4_1", 32, 20},
    [GGUF_TYPE_Q5_0] = {"Q5_0", 32, 22},  [GGUF_TYPE_Q5_1] = {"Q5_1", 32, 24},
    [GGUF_TYPE_Q4_K] = {"Q4_K", 256, 144}, [GGUF_TYPE_Q5_K] = {"Q5_K", 256, 176},
    [GGUF_TYPE_Q6_K] = {"Q6_K", 256, 210},
};

/* NULL for a type id coli does not compute with. */
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

/* Reads N key-value pairs. Only the first part's metadata describes the model; the other
 * parts' pairs are validated and dropped (keep = 0). Keys are sorted for lookup. */
static void gguf_read_kvs(struct gguf_file *g, struct gguf_reader *r, uint64_t n, int keep)
{
    /* a key-value pair takes at least 8 (key length) + 4 (type) + 1 bytes */
    if (n > (r->size - r->pos) / 13) gguf_fail(r, "metadata count is larger than the file allows", "header");
    struct gguf_kv *kvs = plat_zalloc((size_t)n, sizeof *kvs);
    for (uint64_t i = 0; i < n; i++) {
        kvs[i].key = gguf_string(r, &kvs[i].key_len, "metadata key");
        kvs[i].type = gguf_u32(r, "metadata value type");
        gguf_read_value(r, &kvs[i]);
    }
    qsort(kvs, (size_t)n, sizeof *kvs, gguf_kv_compare);
    for (uint64_t i = 1; i < n; i++)
        if (gguf_kv_compare(&kvs[i - 1], &kvs[i]) == 0)
            die("%s: duplicate metadata key '%.*s'", r->path, (int)kvs[i].key_len, kvs[i].key);
    if (!keep) {
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
    if (!ti) die("%s: tensor '%s' has unsupported type id %d", r->path, t->name, t->type);
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
    gguf_read_kvs(g, &r, n_kvs, part == 0);
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
    if (plat_map_file(path, &g->parts[part]) != 0) die("%s: cannot open: %s", path, strerror(errno));
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

/* ==== §3 quant ==== */
struct ops_matrix { enum gguf_type type; const uint8_t *data; int64_t rows, cols; size_t row_bytes; };
static void quant_dequant_row(enum gguf_type type, const void *src, float *dst, int64_t n)
{ if (type != GGUF_TYPE_F32) die("stub"); memcpy(dst, src, n*4); }
static void ops_matmat(const struct ops_matrix *w, const float *x, float *y, int n)
{
  if (w->type != GGUF_TYPE_F32) die("stub type");
  #pragma omp parallel for
  for (int64_t r=0;r<w->rows;r++) { const float *wr=(const float*)(w->data + r*w->row_bytes);
    for (int t=0;t<n;t++){ float p[32]={0}; const float *xt=x+t*w->cols; for(int64_t i=0;i<w->cols;i++) p[i%32]+=wr[i]*xt[i];
      for(int s=16;s>=1;s/=2) for(int i=0;i<s;i++) p[i]+=p[i+s]; y[(size_t)t*w->rows+r]=p[0]; } }
}


/* ==== §4 ops ==== */
/* OPS_MATRIX_PLACEHOLDER */

/* ops: elementwise. Plain loops in a fixed order; the compiler vectorises what it can
 * without changing results (-ffp-contract=off, no -ffast-math). */

/* y = x / sqrt(mean(x^2) + eps) * w, over N values (w may be NULL: no weight). In place is fine. */
static void ops_rmsnorm(float *y, const float *x, const float *w, int n, float eps)
{
    double ss = 0.0; /* as ggml: squares summed in double, the scale formed in float */
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float mean = (float)(ss / n);
    float scale = 1.0f / sqrtf(mean + eps);
    for (int i = 0; i < n; i++) y[i] = w ? x[i] * scale * w[i] : x[i] * scale;
}

/* x /= max(||x||, eps): the L2 normalisation of DeltaNet queries and keys (ggml's rule). */
static void ops_l2norm(float *x, int n, float eps)
{
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float norm = sqrtf((float)ss);
    float scale = 1.0f / (norm > eps ? norm : eps);
    for (int i = 0; i < n; i++) x[i] *= scale;
}

static float ops_silu(float x) { return x / (1.0f + expf(-x)); }
static float ops_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* log(1 + e^x), switching to x above 20 as the reference does. */
static float ops_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* In-place softmax over N values. */
static void ops_softmax(float *x, int n)
{
    float max = x[0];
    for (int i = 1; i < n; i++) max = x[i] > max ? x[i] : max;
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - max);
        sum += x[i];
    }
    float inv = (float)(1.0 / sum);
    for (int i = 0; i < n; i++) x[i] *= inv;
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
/* Not yet: loading the system's CUDA driver and the embedded PTX is issue 5. coli runs
 * every product on the CPU. */

/* ==== §6 experts ==== */
/* Not yet: the expert store with a RAM budget and heat is issue 4. Routed experts are read
 * in place from the memory-mapped file. */

/* ==== §7 place ==== */
/* Not yet: placement across devices follows the CUDA path. */

/* ==== §8 model ==== */
/* Owns: the hyper-parameters (from GGUF metadata only), the binding of weights into the
 *   mapping, the run state (KV cache, DeltaNet conv and recurrent state), the forward pass.
 * Promises: model_load refuses an unknown architecture, a missing tensor or a wrong shape
 *   with one line naming it. model_forward computes the same bits for a token whether it
 *   arrives alone or in a batch, on any number of threads and any kernel level: every
 *   product goes through ops_matmat (bit-identical per column to ops_matvec), sums run in a
 *   fixed order, and parallel loops split independent rows or heads only.
 * May call: §1–§4.
 * Workload: per decoded token the whole dense trunk is read once plus n_expert_used experts
 *   per layer; prompts run in batches of MODEL_BATCH tokens, each routed expert's weights
 *   read once per batch. The architecture is qwen35-arch.md; section numbers cite it. */

enum model_arch { MODEL_ARCH_QWEN35MOE, MODEL_ARCH_QWEN35, MODEL_ARCH_QWEN3NEXT };
static const char *const model_arch_names[] = {"qwen35moe", "qwen35", "qwen3next"};

enum model_layer_kind { MODEL_LAYER_DELTANET, MODEL_LAYER_ATTENTION };

#define MODEL_BATCH 64    /* prompt tokens per forward call: 64 keeps the scratch small */
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

/* Routed experts of one layer: expert e is `m` with its data moved by e * stride bytes. */
struct model_experts {
    struct ops_matrix m;
    size_t stride;
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
    const float *dt_bias, *ssm_a; /* [nv]; ssm_a = -exp(A_log) */
    const float *ssm_norm;     /* [dv] shared by all heads, or [nv*dv] */
    int ssm_norm_per_head;
    struct ops_matrix wout;    /* [dim][nv*dv] */
    /* feed-forward */
    struct ops_matrix router;  /* [n_expert][dim] */
    struct model_experts gate_exps, up_exps; /* expert: [expert_ff][dim] */
    struct model_experts down_exps;          /* expert: [dim][expert_ff] */
    struct ops_matrix shexp_gate_inp;        /* [1][dim] */
    struct ops_matrix shexp_gate, shexp_up;  /* [shexp_ff][dim] */
    struct ops_matrix shexp_down;            /* [dim][shexp_ff] */
    struct ops_matrix ffn_gate, ffn_up, ffn_down; /* dense qwen35: [ff][dim], [dim][ff] */
};

struct model_layer_state {
    float *k_cache, *v_cache; /* [n_ctx][n_kv_head * head_dim], K after norm and RoPE */
    float *conv_state;        /* [conv_dim][conv_kernel - 1] raw inputs, oldest first */
    float *ssm_state;         /* [nv][dv][dk]: S transposed so that each row is contiguous in k */
};

/* Scratch for one batch of up to MODEL_BATCH tokens; shapes use B = MODEL_BATCH. */
struct model_scratch {
    float *x, *xn, *out;     /* [B][dim] residual stream, normed input, block output */
    float *qg;               /* [B][n_head * 2 * head_dim] */
    float *k, *v;            /* [B][n_kv_head * head_dim] */
    float *attn;             /* [B][n_head * head_dim] gated attention output */
    float *scores;           /* [n_head][n_ctx] */
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
    float *ex_in;            /* [B][dim] tokens gathered for one expert */
    float *ex_g, *ex_u;      /* [B][max(expert_ff, shexp_ff, ff)] */
    float *ex_out;           /* [B * n_expert_used][dim] each assignment's expert output */
    float *sh_out;           /* [B][dim] */
    float *sh_gate;          /* [B] */
    float *logits;           /* [n_vocab] for the last token of a batch */
};

struct model {
    struct gguf_file file;
    struct model_config cfg;
    struct model_layer *layers;       /* [n_layers] */
    const struct gguf_tensor *embed;  /* [n_vocab][dim] */
    const float *out_norm;            /* [dim] */
    struct ops_matrix lm_head;        /* [n_vocab][dim] */
    int n_ctx;
    struct model_layer_state *state;  /* [n_layers] */
    struct model_scratch s;
    int pos;                          /* tokens already in the state */
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

/* The tensor NAME, which must have exactly the given shape (outermost first); dies otherwise. */
static const struct gguf_tensor *model_tensor_get(const struct gguf_file *g, const char *name, int n_dims, const int64_t *shape)
{
    const struct gguf_tensor *t = gguf_tensor_find(g, name);
    if (!t) die("%s: missing tensor '%s'", g->path, name);
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
    struct ops_matrix m = {(enum gguf_type)t->type, t->data, rows, cols, gguf_row_bytes(t->type, cols)};
    return m;
}

/* A small F32 tensor of N values (norms, biases, conv taps). */
static const float *model_vector(const struct gguf_file *g, const char *name, int n_dims, const int64_t *shape)
{
    const struct gguf_tensor *t = model_tensor_get(g, name, n_dims, shape);
    if (t->type != GGUF_TYPE_F32) die("%s: tensor '%s' is %s; coli needs F32 here", g->path, name, gguf_types[t->type].name);
    return (const float *)t->data;
}

static struct model_experts model_experts_get(const struct gguf_file *g, const char *name, int64_t n, int64_t rows, int64_t cols)
{
    int64_t shape[3] = {n, rows, cols};
    const struct gguf_tensor *t = model_tensor_get(g, name, 3, shape);
    struct model_experts e;
    e.m = (struct ops_matrix){(enum gguf_type)t->type, t->data, rows, cols, gguf_row_bytes(t->type, cols)};
    e.stride = e.m.row_bytes * (size_t)rows;
    return e;
}

static struct ops_matrix model_expert(const struct model_experts *e, int expert)
{
    struct ops_matrix m = e->m;
    m.data += (size_t)expert * e->stride;
    return m;
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

/* Bytes of KV cache one token of context takes (F32, every attention layer). */
static int64_t model_kv_bytes_per_token(const struct model *m)
{
    int64_t n = 0;
    for (int i = 0; i < m->cfg.n_layers; i++)
        if (m->layers[i].kind == MODEL_LAYER_ATTENTION) n += 2 * (int64_t)m->cfg.n_kv_head * m->cfg.head_dim * 4;
    return n;
}

/* The context to use: the request, else the model's length capped so that the KV cache
 * takes at most half of the memory still available. */
static int model_choose_ctx(const struct model *m, int request)
{
    if (request > 0) return request < m->cfg.ctx_train ? request : m->cfg.ctx_train;
    int64_t per = model_kv_bytes_per_token(m), avail = plat_mem_available();
    int64_t ctx = m->cfg.ctx_train;
    if (per > 0 && avail > 0 && ctx > avail / 2 / per) ctx = avail / 2 / per;
    return ctx < 256 ? 256 : (int)ctx;
}

static float *model_buf(int64_t a, int64_t b)
{
    return plat_alloc_aligned(plat_mul_size(plat_mul_size((size_t)a, (size_t)b, "scratch"), sizeof(float), "scratch"));
}

static void model_alloc_scratch(struct model *m)
{
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->s;
    int64_t B = MODEL_BATCH, nvdv = (int64_t)c->ssm_nv * c->ssm_dv, used = c->n_expert_used;
    int64_t ffmax = c->expert_ff > c->shexp_ff ? c->expert_ff : c->shexp_ff;
    if (c->ff > ffmax) ffmax = c->ff;
    s->x = model_buf(B, c->dim);
    s->xn = model_buf(B, c->dim);
    s->out = model_buf(B, c->dim);
    s->qg = model_buf(B, (int64_t)c->n_head * 2 * c->head_dim);
    s->k = model_buf(B, (int64_t)c->n_kv_head * c->head_dim);
    s->v = model_buf(B, (int64_t)c->n_kv_head * c->head_dim);
    s->attn = model_buf(B, (int64_t)c->n_head * c->head_dim);
    s->scores = model_buf(c->n_head, m->n_ctx);
    s->rope = model_buf(B, c->rope_dims);
    s->mixed = model_buf(B, model_conv_dim(c));
    s->z = model_buf(B, nvdv);
    s->beta = model_buf(B, c->ssm_nv);
    s->alpha = model_buf(B, c->ssm_nv);
    s->ba = model_buf(B, 2 * (int64_t)c->ssm_nv);
    s->core = model_buf(B, nvdv);
    s->router = model_buf(B, c->n_expert > 0 ? c->n_expert : 1);
    s->top = plat_zalloc((size_t)(B * (used ? used : 1)), sizeof(int));
    s->top_w = model_buf(B, used ? used : 1);
    s->slot_of = plat_zalloc((size_t)(B * (used ? used : 1)), sizeof(int));
    s->ex_in = model_buf(B, c->dim);
    s->ex_g = model_buf(B, ffmax ? ffmax : 1);
    s->ex_u = model_buf(B, ffmax ? ffmax : 1);
    s->ex_out = model_buf(B * (used ? used : 1), c->dim);
    s->sh_out = model_buf(B, c->dim);
    s->sh_gate = model_buf(B, 1);
    s->logits = model_buf(1, c->n_vocab);
}

static void model_alloc_state(struct model *m)
{
    const struct model_config *c = &m->cfg;
    m->state = plat_zalloc((size_t)c->n_layers, sizeof *m->state);
    for (int i = 0; i < c->n_layers; i++) {
        struct model_layer_state *st = &m->state[i];
        if (m->layers[i].kind == MODEL_LAYER_ATTENTION) {
            /* calloc: pages of context never reached are never touched */
            size_t n = plat_mul_size((size_t)m->n_ctx, (size_t)c->n_kv_head * (size_t)c->head_dim, "KV cache");
            st->k_cache = plat_zalloc(n, sizeof(float));
            st->v_cache = plat_zalloc(n, sizeof(float));
        } else {
            st->conv_state = plat_zalloc((size_t)model_conv_dim(c) * (size_t)(c->conv_kernel - 1) + 1, sizeof(float));
            st->ssm_state = plat_zalloc((size_t)c->ssm_nv * (size_t)c->ssm_dv * (size_t)c->ssm_dk, sizeof(float));
        }
    }
}

/* Forget the conversation: position 0, zero state. */
static void model_reset(struct model *m)
{
    const struct model_config *c = &m->cfg;
    for (int i = 0; i < c->n_layers; i++) {
        struct model_layer_state *st = &m->state[i];
        if (st->conv_state) {
            memset(st->conv_state, 0, (size_t)model_conv_dim(c) * (size_t)(c->conv_kernel - 1) * sizeof(float));
            memset(st->ssm_state, 0, (size_t)c->ssm_nv * (size_t)c->ssm_dv * (size_t)c->ssm_dk * sizeof(float));
        }
    }
    m->pos = 0;
}

/* Opens PATH, reads the configuration, binds the weights, allocates state for N_CTX tokens
 * (0: choose). */
static void model_load(struct model *m, const char *path, int n_ctx)
{
    memset(m, 0, sizeof *m);
    gguf_open(&m->file, path);
    model_read_config(&m->cfg, &m->file);
    model_bind(m);
    m->n_ctx = model_choose_ctx(m, n_ctx);
    model_alloc_state(m);
    model_alloc_scratch(m);
}

static void model_free(struct model *m)
{
    struct model_scratch *s = &m->s;
    float *bufs[] = {s->x, s->xn, s->out, s->qg, s->k, s->v, s->attn, s->scores, s->rope, s->mixed, s->z,
                     s->beta, s->alpha, s->ba, s->core, s->router, s->top_w, s->ex_in, s->ex_g, s->ex_u,
                     s->ex_out, s->sh_out, s->sh_gate, s->logits};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    free(s->top);
    free(s->slot_of);
    for (int i = 0; m->state && i < m->cfg.n_layers; i++) {
        free(m->state[i].k_cache);
        free(m->state[i].v_cache);
        free(m->state[i].conv_state);
        free(m->state[i].ssm_state);
    }
    free(m->state);
    free(m->layers);
    gguf_close(&m->file);
}

/* cos then sin of pos * base^(-2j/rot) for j < rot/2 (§4.3; mRoPE reduces to this for text, §4.4). */
static void model_rope_table(const struct model_config *c, int pos, float *cos_sin)
{
    int half = c->rope_dims / 2;
    for (int j = 0; j < half; j++) {
        double theta = pos * pow((double)c->rope_base, -2.0 * j / c->rope_dims);
        cos_sin[j] = (float)cos(theta);
        cos_sin[half + j] = (float)sin(theta);
    }
}

/* Gated attention (§4) for T tokens at positions pos..pos+T-1: xn -> out. */
static void model_attention(struct model *m, int il, int T)
{
    const struct model_config *c = &m->cfg;
    const struct model_layer *l = &m->layers[il];
    struct model_layer_state *st = &m->state[il];
    struct model_scratch *s = &m->s;
    int hd = c->head_dim, nh = c->n_head, kvw = c->n_kv_head * hd, group = nh / c->n_kv_head;
    float scale = 1.0f / sqrtf((float)hd);

    ops_matmat(&l->wq, s->xn, s->qg, T);
    ops_matmat(&l->wk, s->xn, s->k, T);
    ops_matmat(&l->wv, s->xn, s->v, T);

    /* per-head q/k RMSNorm, then partial RoPE; K and V go to the cache */
    for (int t = 0; t < T; t++) {
        float *cs = s->rope + (size_t)t * c->rope_dims;
        model_rope_table(c, m->pos + t, cs);
        for (int h = 0; h < nh; h++) {
            float *q = s->qg + ((size_t)t * nh + h) * 2 * hd;
            ops_rmsnorm(q, q, l->q_norm, hd, c->eps);
            ops_rope_neox(q, c->rope_dims, cs);
        }
        for (int h = 0; h < c->n_kv_head; h++) {
            float *k = s->k + (size_t)t * kvw + (size_t)h * hd;
            ops_rmsnorm(k, k, l->k_norm, hd, c->eps);
            ops_rope_neox(k, c->rope_dims, cs);
        }
        memcpy(st->k_cache + (size_t)(m->pos + t) * kvw, s->k + (size_t)t * kvw, (size_t)kvw * sizeof(float));
        memcpy(st->v_cache + (size_t)(m->pos + t) * kvw, s->v + (size_t)t * kvw, (size_t)kvw * sizeof(float));
    }

    /* causal softmax attention per head (GQA: head h reads KV head h / group), then the
     * sigmoid output gate */
    #pragma omp parallel for schedule(static)
    for (int h = 0; h < nh; h++) {
        float *sc = s->scores + (size_t)h * m->n_ctx;
        const float *kc = st->k_cache + (size_t)(h / group) * hd, *vc = st->v_cache + (size_t)(h / group) * hd;
        for (int t = 0; t < T; t++) {
            const float *q = s->qg + ((size_t)t * nh + h) * 2 * hd, *gate = q + hd;
            float *o = s->attn + ((size_t)t * nh + h) * hd;
            int n = m->pos + t + 1;
            for (int p = 0; p < n; p++) {
                const float *k = kc + (size_t)p * kvw;
                float dot = 0.0f;
                for (int i = 0; i < hd; i++) dot += q[i] * k[i];
                sc[p] = dot * scale;
            }
            ops_softmax(sc, n);
            memset(o, 0, (size_t)hd * sizeof(float));
            for (int p = 0; p < n; p++) {
                const float *v = vc + (size_t)p * kvw;
                for (int i = 0; i < hd; i++) o[i] += sc[p] * v[i];
            }
            for (int i = 0; i < hd; i++) o[i] *= ops_sigmoid(gate[i]);
        }
    }
    ops_matmat(&l->wo, s->attn, s->out, T);
}

/* Depthwise causal conv over one token's channels, then SiLU, in place (§5.3). The state
 * keeps the last conv_kernel-1 raw inputs, oldest first. */
static void model_conv_step(const struct model_config *c, const float *w, float *state, float *x)
{
    int K = c->conv_kernel;
    int64_t n = model_conv_dim(c);
    for (int64_t ch = 0; ch < n; ch++) {
        float *sv = state + ch * (K - 1);
        const float *wc = w + ch * K;
        float sum = 0.0f;
        for (int j = 0; j < K - 1; j++) sum += wc[j] * sv[j];
        sum += wc[K - 1] * x[ch];
        for (int j = 0; j + 1 < K - 1; j++) sv[j] = sv[j + 1];
        if (K > 1) sv[K - 2] = x[ch];
        x[ch] = ops_silu(sum);
    }
}

/* One token of the gated delta rule for v-head h (§5.3): decay the state, predict v from
 * k, write the scaled error back, read with q. S is [dv][dk], so each step is one pass
 * over contiguous rows. */
static void model_delta_head(float *S, int dk, int dv, const float *q, const float *k, const float *v,
                             float beta, float decay, float *out)
{
    for (int j = 0; j < dv; j++) {
        float *row = S + (size_t)j * dk;
        float pred = 0.0f;
        for (int i = 0; i < dk; i++) {
            row[i] *= decay;
            pred += row[i] * k[i];
        }
        float delta = beta * (v[j] - pred);
        float o = 0.0f;
        for (int i = 0; i < dk; i++) {
            row[i] += k[i] * delta;
            o += row[i] * q[i];
        }
        out[j] = o;
    }
}

/* beta and alpha logits per v-head in natural order. qwen3next stores them fused per
 * k-head group as [b x r | a x r] (§5.2); qwen35* has two projections. */
static void model_deltanet_gates(struct model *m, const struct model_layer *l, int T)
{
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->s;
    int nv = c->ssm_nv, r = nv / c->ssm_nk;
    if (c->arch != MODEL_ARCH_QWEN3NEXT) {
        ops_matmat(&l->wbeta, s->xn, s->beta, T);
        ops_matmat(&l->walpha, s->xn, s->alpha, T);
        return;
    }
    ops_matmat(&l->wba, s->xn, s->ba, T);
    for (int t = 0; t < T; t++)
        for (int g = 0; g < c->ssm_nk; g++)
            for (int j = 0; j < r; j++) {
                s->beta[(size_t)t * nv + g * r + j] = s->ba[(size_t)t * 2 * nv + g * 2 * r + j];
                s->alpha[(size_t)t * nv + g * r + j] = s->ba[(size_t)t * 2 * nv + g * 2 * r + r + j];
            }
}

/* Gated DeltaNet (§5) for T tokens, one after another through the recurrent state: xn -> out. */
static void model_gated_deltanet(struct model *m, int il, int T)
{
    const struct model_config *c = &m->cfg;
    const struct model_layer *l = &m->layers[il];
    struct model_layer_state *st = &m->state[il];
    struct model_scratch *s = &m->s;
    int nk = c->ssm_nk, nv = c->ssm_nv, dk = c->ssm_dk, dv = c->ssm_dv, r = nv / nk;
    int64_t conv_dim = model_conv_dim(c), vdim = (int64_t)nv * dv;
    float qscale = 1.0f / sqrtf((float)dk);

    ops_matmat(&l->wqkv, s->xn, s->mixed, T);
    ops_matmat(&l->wz, s->xn, s->z, T);
    model_deltanet_gates(m, l, T);

    for (int t = 0; t < T; t++) {
        float *x = s->mixed + (size_t)t * conv_dim;
        model_conv_step(c, l->conv, st->conv_state, x);
        float *q = x, *k = x + (size_t)nk * dk, *v = x + 2 * (size_t)nk * dk;
        for (int g = 0; g < nk; g++) {
            ops_l2norm(q + (size_t)g * dk, dk, c->eps);
            ops_l2norm(k + (size_t)g * dk, dk, c->eps);
            for (int i = 0; i < dk; i++) q[(size_t)g * dk + i] *= qscale;
        }
        #pragma omp parallel for schedule(static)
        for (int h = 0; h < nv; h++) {
            int g = c->vhead_tiled ? h % nk : h / r;
            float beta = ops_sigmoid(s->beta[(size_t)t * nv + h]);
            float decay = expf(ops_softplus(s->alpha[(size_t)t * nv + h] + l->dt_bias[h]) * l->ssm_a[h]);
            model_delta_head(st->ssm_state + (size_t)h * dv * dk, dk, dv, q + (size_t)g * dk, k + (size_t)g * dk,
                             v + (size_t)h * dv, beta, decay, s->core + (size_t)t * vdim + (size_t)h * dv);
        }
    }

    /* gated RMSNorm per head: norm(o) * w * silu(z) */
    for (int t = 0; t < T; t++)
        for (int h = 0; h < nv; h++) {
            float *o = s->core + (size_t)t * vdim + (size_t)h * dv;
            const float *z = s->z + (size_t)t * vdim + (size_t)h * dv;
            ops_rmsnorm(o, o, l->ssm_norm + (l->ssm_norm_per_head ? (size_t)h * dv : 0), dv, c->eps);
            for (int i = 0; i < dv; i++) o[i] *= ops_silu(z[i]);
        }
    ops_matmat(&l->wout, s->core, s->out, T);
}

/* SwiGLU feed-forward over N rows: down(silu(gate x) * up x). in [n][cols of gate],
 * out [n][rows of down]; uses ex_g and ex_u. */
static void model_swiglu(struct model *m, const struct ops_matrix *gate, const struct ops_matrix *up,
                         const struct ops_matrix *down, const float *in, float *out, int n)
{
    struct model_scratch *s = &m->s;
    ops_matmat(gate, in, s->ex_g, n);
    ops_matmat(up, in, s->ex_u, n);
    size_t total = (size_t)n * (size_t)gate->rows;
    for (size_t i = 0; i < total; i++) s->ex_g[i] = ops_silu(s->ex_g[i]) * s->ex_u[i];
    ops_matmat(down, s->ex_g, out, n);
}

/* Router (§6): softmax over all experts, the n_expert_used best (ties: lower id first),
 * weights renormalised over the chosen ones. */
static void model_route(struct model *m, const struct model_layer *l, int T)
{
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->s;
    int used = c->n_expert_used;
    ops_matmat(&l->router, s->xn, s->router, T);
    for (int t = 0; t < T; t++) {
        float *p = s->router + (size_t)t * c->n_expert;
        int *top = s->top + (size_t)t * used;
        float *w = s->top_w + (size_t)t * used, sum = 0.0f;
        ops_softmax(p, c->n_expert);
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
        for (int k = 0; k < used; k++) w[k] /= sum;
    }
}

/* Routed experts for T tokens: each chosen expert runs once over the tokens that chose it,
 * its output landing in ex_out[t * used + k]. */
static void model_routed_experts(struct model *m, const struct model_layer *l, int T)
{
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->s;
    int used = c->n_expert_used, n_assign = T * used;
    for (int e = 0; e < c->n_expert; e++) {
        int n = 0;
        for (int a = 0; a < n_assign; a++)
            if (s->top[a] == e) {
                s->slot_of[n] = a;
                memcpy(s->ex_in + (size_t)n * c->dim, s->xn + (size_t)(a / used) * c->dim, (size_t)c->dim * sizeof(float));
                n++;
            }
        if (n == 0) continue;
        struct ops_matrix gate = model_expert(&l->gate_exps, e), up = model_expert(&l->up_exps, e);
        struct ops_matrix down = model_expert(&l->down_exps, e);
        model_swiglu(m, &gate, &up, &down, s->ex_in, s->ex_in, n);
        for (int i = 0; i < n; i++)
            memcpy(s->ex_out + (size_t)s->slot_of[i] * c->dim, s->ex_in + (size_t)i * c->dim, (size_t)c->dim * sizeof(float));
    }
}

/* Mixture of experts (§6): out = sum_k w_k E_k(xn) + sigmoid(g . xn) S(xn), summed in the
 * order of the chosen experts, best first. A dense SwiGLU for qwen35. */
static void model_ffn(struct model *m, int il, int T)
{
    const struct model_config *c = &m->cfg;
    const struct model_layer *l = &m->layers[il];
    struct model_scratch *s = &m->s;
    if (c->n_expert == 0) {
        model_swiglu(m, &l->ffn_gate, &l->ffn_up, &l->ffn_down, s->xn, s->out, T);
        return;
    }
    model_route(m, l, T);
    model_routed_experts(m, l, T);
    if (c->shexp_ff) {
        ops_matmat(&l->shexp_gate_inp, s->xn, s->sh_gate, T);
        model_swiglu(m, &l->shexp_gate, &l->shexp_up, &l->shexp_down, s->xn, s->sh_out, T);
    }
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

/* Runs T (<= MODEL_BATCH) tokens at positions pos..pos+T-1 and returns the logits of the
 * last one ([n_vocab], valid until the next call). The caller keeps pos + T <= n_ctx. */
static float *model_forward(struct model *m, const int *tokens, int T)
{
    const struct model_config *c = &m->cfg;
    struct model_scratch *s = &m->s;
    size_t dim = (size_t)c->dim, row_bytes = gguf_row_bytes(m->embed->type, c->dim);
    if (T < 1 || T > MODEL_BATCH || m->pos + T > m->n_ctx) die("internal: forward of %d tokens at %d of %d", T, m->pos, m->n_ctx);
    for (int t = 0; t < T; t++) {
        if (tokens[t] < 0 || tokens[t] >= c->n_vocab) die("token id %d is outside the vocabulary (%d)", tokens[t], c->n_vocab);
        quant_dequant_row((enum gguf_type)m->embed->type, m->embed->data + (size_t)tokens[t] * row_bytes, s->x + t * dim, c->dim);
    }
    for (int il = 0; il < c->n_layers; il++) {
        for (int t = 0; t < T; t++) ops_rmsnorm(s->xn + t * dim, s->x + t * dim, m->layers[il].attn_norm, c->dim, c->eps);
        if (m->layers[il].kind == MODEL_LAYER_ATTENTION) model_attention(m, il, T);
        else model_gated_deltanet(m, il, T);
        for (size_t i = 0; i < T * dim; i++) s->x[i] += s->out[i];
        for (int t = 0; t < T; t++) ops_rmsnorm(s->xn + t * dim, s->x + t * dim, m->layers[il].post_norm, c->dim, c->eps);
        model_ffn(m, il, T);
        for (size_t i = 0; i < T * dim; i++) s->x[i] += s->out[i];
    }
    m->pos += T;
    ops_rmsnorm(s->xn, s->x + (T - 1) * dim, m->out_norm, c->dim, c->eps);
    ops_matmat(&m->lm_head, s->xn, s->logits, 1);
    return s->logits;
}

/* Feeds N tokens in batches; returns the logits after the last. */
static float *model_prefill(struct model *m, const int *tokens, int n)
{
    float *logits = NULL;
    for (int i = 0; i < n; i += MODEL_BATCH) logits = model_forward(m, tokens + i, n - i < MODEL_BATCH ? n - i : MODEL_BATCH);
    return logits;
}
