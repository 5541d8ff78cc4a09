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
