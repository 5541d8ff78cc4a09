/* A fake libcuda.so.1 for coli's tests: a glibc shared library exporting the driver calls coli
 * makes, so that the GPU path runs without a GPU, through the same foreign dlopen as a real
 * driver. Device memory is host memory; a launch runs a C twin of the PTX kernel on the host.
 * The twins are an independent C rendering of what kernels.cu computes (one warp per row,
 * lane = unit % 32, the shfl.down butterfly emulated lane by lane; the experts' gate/up/down
 * and the activation quantisers likewise), not a call into coli, so comparing them with
 * coli's CPU path means something. The formats' tables (IQ4_NL, MXFP4, IQ3_XXS, IQ3_S) are
 * the kernels' own, read out of the PTX. A launch computes only what its grid covers, so a grid
 * too small in coli shows as wrong results.
 *
 * Settings (environment, read at cuInit; the fake's own knobs, never read by coli):
 *   FAKE_CUDA_DEVICES=N (default 1; 0: cuInit answers 100 as a real driver does)
 *   FAKE_CUDA_VRAM_MB, FAKE_CUDA_FREE_MB (default 8192, 7680), FAKE_CUDA_NAMES=a,b
 *   FAKE_CUDA_GBPS (default 1000): the simulated speed at which a launch reads its weights, and
 *   FAKE_CUDA_LAUNCH_US (default 1) a launch's own time, FAKE_CUDA_COPY_US (default 2) and
 *   FAKE_CUDA_PCIE_GBPS (default 25) a copy's: the device's clock, which its events read (the
 *   twins take real time, which the events do not see)
 *   These and the first two take a list, one value a device: FAKE_CUDA_VRAM_MB=8192,4096. Lists are
 *   in PCI bus order, as coli numbers the devices (the names are in the driver's order).
 *   FAKE_CUDA_FAIL=alloc:K | launch:K | query:K | graph:K (the K-th call and every later one
 *   fails; a query: an event's or the stream's work failed, error 700; a graph: its
 *   instantiation, error 2; a graph's kernels count as launches) | publish:K (the K-th
 *   publish_words and later ones lose their signal) | module:CODE
 *   (read at every call, so a test process may change it between calls)
 *   FAKE_CUDA_TOP_LIST=N: the output head's candidate list holds N (< 2048) entries in the twins,
 *   so that a row whose best cannot all be listed comes up without thousands of equal logits
 * Built with -DFAKE_STUB it is a stub whose cuInit answers 34, like the toolkit's. Built with
 * -DFAKE_SIM and linked with tests/kernels_sim.cc, a launch runs kernels.cu's own source on the
 * host (lanes as fibers, shuffles answered warp-wide) instead of the twin.
 * Build: gcc -shared -fPIC -O2 -ffp-contract=off -Wl,-soname,libcuda.so.1 fake_cuda.c */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
#define API __attribute__((visibility("default")))

#define MAX_DEV 8
static int n_dev = -1, fail_alloc, fail_launch, fail_module, fail_query, fail_graph, fail_publish, n_alloc, n_launch, n_query, n_graph,
    n_publish;
/* The current context is a thread's, as in the driver: a thread that set none (-1) gets
 * CUDA_ERROR_INVALID_CONTEXT from every call that needs one, so that coli calling from a thread
 * other than the one that made the context current fails here as it would on a card. */
static __thread int cur_dev = -1;
#define NEED_CONTEXT() do { if (cur_dev < 0) return 201; } while (0)
static size_t vram[MAX_DEV], avail[MAX_DEV];
static char names[MAX_DEV][64];
static double gbps[MAX_DEV], launch_ns[MAX_DEV], copy_ns[MAX_DEV], pcie_gbps[MAX_DEV], clock_ns[MAX_DEV]; /* the simulated clocks */

static int env_int(const char *k, int dflt)
{
    const char *v = getenv(k);
    return v && *v ? atoi(v) : dflt;
}

/* The I-th comma-separated number of K (the last one given, when the list is shorter). */
static double env_list(const char *k, int i, double dflt)
{
    const char *v = getenv(k);
    if (!v || !*v) return dflt;
    for (int n = 0; n < i && strchr(v, ','); n++) v = strchr(v, ',') + 1;
    return atof(v);
}

/* FAKE_CUDA_FAIL, read at every call so that a test process can change it as it goes. */
static void read_failures(void)
{
    const char *f = getenv("FAKE_CUDA_FAIL");
    fail_alloc = f && !strncmp(f, "alloc:", 6) ? atoi(f + 6) : 0;
    fail_launch = f && !strncmp(f, "launch:", 7) ? atoi(f + 7) : 0;
    fail_module = f && !strncmp(f, "module:", 7) ? atoi(f + 7) : 0;
    fail_query = f && !strncmp(f, "query:", 6) ? atoi(f + 6) : 0;
    fail_graph = f && !strncmp(f, "graph:", 6) ? atoi(f + 6) : 0;
    fail_publish = f && !strncmp(f, "publish:", 8) ? atoi(f + 8) : 0;
}

API CUresult cuInit(unsigned flags)
{
    (void)flags;
#ifdef FAKE_STUB
    return 34;
#endif
    n_dev = env_int("FAKE_CUDA_DEVICES", 1);
    if (n_dev > MAX_DEV) n_dev = MAX_DEV;
    const char *nm = getenv("FAKE_CUDA_NAMES");
    for (int i = 0; i < n_dev; i++) {
        int pci = n_dev - 1 - i; /* driver device i is coli's device n_dev - 1 - i */
        vram[i] = (size_t)env_list("FAKE_CUDA_VRAM_MB", pci, 8192) << 20;
        avail[i] = (size_t)env_list("FAKE_CUDA_FREE_MB", pci, 7680) << 20;
        gbps[i] = env_list("FAKE_CUDA_GBPS", pci, 1000);
        launch_ns[i] = env_list("FAKE_CUDA_LAUNCH_US", pci, 1) * 1e3;
        copy_ns[i] = env_list("FAKE_CUDA_COPY_US", pci, 2) * 1e3;
        pcie_gbps[i] = env_list("FAKE_CUDA_PCIE_GBPS", pci, 25);
        snprintf(names[i], sizeof names[i], "Fake GPU %c", 'A' + i);
        if (nm) { /* the i-th comma-separated name */
            const char *p = nm;
            for (int k = 0; k < i && p; k++) p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL;
            if (p) snprintf(names[i], sizeof names[i], "%.*s", (int)strcspn(p, ","), p);
        }
    }
    return n_dev == 0 ? 100 : 0;
}

API CUresult cuDriverGetVersion(int *v) { *v = 12040; return 0; }
API CUresult cuGetErrorString(CUresult r, const char **s)
{
    *s = r == 719 ? "unspecified launch failure" : r == 500 ? "named symbol not found" : r == 700 ? "an illegal memory access was encountered" : "fake error";
    return 0;
}
API CUresult cuDeviceGetCount(int *n) { *n = n_dev < 0 ? 0 : n_dev; return n_dev < 0 ? 3 : 0; }
API CUresult cuDeviceGet(int *d, int i) { if (i < 0 || i >= n_dev) return 101; *d = i; return 0; }
API CUresult cuDeviceGetName(char *s, int len, int d) { snprintf(s, (size_t)len, "%s", names[d]); return 0; }
API CUresult cuDeviceTotalMem_v2(size_t *b, int d) { *b = vram[d]; return 0; }

/* Devices come in the reverse of PCI bus order, as CUDA's default FASTEST_FIRST may give them:
 * coli must sort them. */
API CUresult cuDeviceGetAttribute(int *v, int attr, int d)
{
    switch (attr) {
    case 75: *v = 8; return 0;                 /* compute capability 8.6 */
    case 76: *v = 6; return 0;
    case 16: *v = 20 + 2 * d; return 0;        /* SMs */
    case 33: *v = 0x10 * (n_dev - d); return 0; /* PCI bus */
    case 34: case 50: *v = 0; return 0;
    default: *v = 0; return 1;
    }
}

struct ctx { int dev; };
static struct ctx ctxs[MAX_DEV];
API CUresult cuDevicePrimaryCtxRetain(void **c, int d) { ctxs[d].dev = d; *c = &ctxs[d]; return 0; }
API CUresult cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return 0; }
API CUresult cuCtxSetCurrent(void *c) { cur_dev = c ? ((struct ctx *)c)->dev : -1; return 0; }
API CUresult cuMemGetInfo_v2(size_t *f, size_t *t) { NEED_CONTEXT(); *f = avail[cur_dev]; *t = vram[cur_dev]; return 0; }

/* A block: its size in front, so that cuMemFree can give the bytes back. */
API CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n)
{
    NEED_CONTEXT();
    n_alloc++;
    read_failures();
    if ((fail_alloc && n_alloc >= fail_alloc) || n > avail[cur_dev]) return 2;
    size_t *b = malloc(n + 16);
    if (!b) return 2;
    b[0] = n;
    b[1] = (size_t)cur_dev;
    avail[cur_dev] -= n;
    *p = (CUdeviceptr)(uintptr_t)(b + 2);
    return 0;
}
API CUresult cuMemFree_v2(CUdeviceptr p)
{
    if (!p) return 1; /* CUDA_ERROR_INVALID_VALUE, as the driver answers */
    size_t *b = (size_t *)(uintptr_t)p - 2;
    avail[b[1]] += b[0];
    free(b);
    return 0;
}
/* A copy advances the current device's clock by its latency and its bytes at the bus's speed. */
static void copy_clock(size_t n) { clock_ns[cur_dev] += copy_ns[cur_dev] + (double)n / pcie_gbps[cur_dev]; }
API CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) { NEED_CONTEXT(); memcpy((void *)(uintptr_t)d, s, n); copy_clock(n); return 0; }
API CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) { NEED_CONTEXT(); memcpy(d, (const void *)(uintptr_t)s, n); copy_clock(n); return 0; }
/* A copy on the device reads and writes its bytes at the device's speed. */
API CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n)
{
    NEED_CONTEXT();
    memmove((void *)(uintptr_t)d, (const void *)(uintptr_t)s, n);
    clock_ns[cur_dev] += launch_ns[cur_dev] + 2.0 * (double)n / gbps[cur_dev];
    return 0;
}

/* ---- the kernels' C twins ---- */

/* The weight formats by their GGUF type ids (coli.c's enum gguf_type), which key the twins. */
enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
       Q6_K = 14, IQ3_XXS = 18, IQ4_NL = 20, IQ3_S = 21, IQ4_XS = 23, BF16 = 30, MXFP4 = 39 };

/* Bytes per block of the block formats (0: a float format). */
static const int block_bytes[40] = {[Q4_0] = 18, [Q4_1] = 20, [Q5_0] = 22, [Q5_1] = 24, [Q8_0] = 34, [IQ4_NL] = 18,
                                    [MXFP4] = 17, [Q2_K] = 84, [Q3_K] = 110, [Q4_K] = 144, [Q5_K] = 176, [Q6_K] = 210,
                                    [IQ4_XS] = 136, [IQ3_XXS] = 98, [IQ3_S] = 110};

/* The formats' tables (IQ4_NL's int8 grid, MXFP4's doubled E2M1 values, IQ3_XXS's lattice keys
 * and levels, IQ3_S's grid keys), read out of the module's PTX at load: they are data of the
 * formats, which kernels.cu holds as __constant__ arrays and coli's CPU as its own, so comparing
 * the products checks the numbers kernels.ptx carries, where a copy here would only check itself. */
static int8_t iq4nl_values[16], mxfp4_values[16];
static uint16_t iq3xxs_keys[256], iq3s_keys[512]; /* little-endian in the PTX's bytes, as on the host */
static uint8_t iq3_levels[8];

static float f16(const uint8_t *p) { _Float16 h; memcpy(&h, p, 2); return (float)h; }
static float bf16(const uint8_t *p) { uint32_t u = (uint32_t)(p[0] | p[1] << 8) << 16; float f; memcpy(&f, &u, 4); return f; }
static float ld_f32(const uint8_t *p) { float f; memcpy(&f, p, 4); return f; }

/* The warp's end: shfl.down by 16, 8, 4, 2, 1; every lane reads the others' old values. */
static float warp_reduce(float v[32])
{
    for (int s = 16; s > 0; s /= 2) {
        float old[32];
        memcpy(old, v, sizeof old);
        for (int lane = 0; lane < 32; lane++) v[lane] = old[lane] + (lane + s < 32 ? old[lane + s] : old[lane]);
    }
    return v[0];
}

/* Float weights; KIND 0 F32, 1 F16, 2 BF16. */
static float unit_float(int kind, const uint8_t *w, const float *x, int i)
{
    float wv = kind == 0 ? ld_f32(w + 4 * i) : kind == 1 ? f16(w + 2 * i) : bf16(w + 2 * i);
    return wv * x[i];
}

/* 32-block B of a row against act (qs | d | s | sd). IQ4_NL and MXFP4: element j is table
 * entry nibble j / 16 of byte j % 16; MXFP4's scale 2^(e-128) is its E8M0 byte halved, as its
 * table is doubled. */
static float unit_legacy(int type, const uint8_t *blk, const int8_t *qx, float dx, float sd)
{
    int has_min = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1, isum = 0;
    float dw = type == MXFP4 ? ldexpf(1.0f, blk[0] - 128) : f16(blk), mw = has_min ? f16(blk + 2) : 0.0f;
    if (type == Q8_0) {
        for (int j = 0; j < 32; j++) isum += (int8_t)blk[2 + j] * qx[j];
    } else if (type == IQ4_NL || type == MXFP4) {
        const int8_t *v = type == MXFP4 ? mxfp4_values : iq4nl_values;
        const uint8_t *qs = blk + (type == MXFP4 ? 1 : 2);
        for (int j = 0; j < 32; j++) isum += v[j < 16 ? qs[j] & 15 : qs[j - 16] >> 4] * qx[j];
    } else {
        uint32_t qh = 0;
        if (five) memcpy(&qh, blk + 2 + 2 * has_min, 4);
        const uint8_t *qs = blk + 2 + 2 * has_min + 4 * five;
        int off = has_min ? 0 : five ? 16 : 8;
        for (int j = 0; j < 16; j++) {
            int lo = (qs[j] & 15) | (five ? (int)((qh >> j) & 1) << 4 : 0);
            int hi = (qs[j] >> 4) | (five ? (int)((qh >> (j + 16)) & 1) << 4 : 0);
            isum += (lo - off) * qx[j] + (hi - off) * qx[j + 16];
        }
    }
    float r = (dw * dx) * (float)isum;
    return has_min ? r + mw * sd : r;
}

/* 6-bit scale and min J of a Q4_K/Q5_K super-block, from the 12 packed bytes Q. */
static void scale_min(int j, const uint8_t *q, int *sc, int *m)
{
    *sc = j < 4 ? q[j] & 63 : (q[j + 4] & 15) | (q[j - 4] >> 6) << 4;
    *m = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | (q[j] >> 6) << 4;
}

/* Q4_K (five 0) / Q5_K super-block against act (qs | d | bsums). Element e of the block is
 * nibble (e / 32) % 2 of byte 32 * (e / 64) + e % 32, its fifth bit bit e / 32 of qh[e % 32]. */
static float unit_q45k(int five, const uint8_t *b, const int8_t *qx, const int16_t *bs, float dx)
{
    const uint8_t *qh = b + 16, *ql = b + 16 + (five ? 32 : 0);
    int sumi = 0, summ = 0;
    for (int g = 0; g < 8; g++) {
        int sc, m, s = 0;
        scale_min(g, b + 4, &sc, &m);
        summ += m * (bs[2 * g] + bs[2 * g + 1]);
        for (int l = 0; l < 32; l++) {
            int byte = ql[32 * (g / 2) + l], q = g % 2 ? byte >> 4 : byte & 15;
            if (five) q += ((qh[l] >> g) & 1) * 16;
            s += q * qx[32 * g + l];
        }
        sumi += sc * s;
    }
    return (f16(b) * dx) * (float)sumi - (f16(b + 2) * dx) * (float)summ;
}

/* Q6_K: element e = 128h + 32k + l (k the quarter) is low nibble (k < 2) or high nibble of
 * ql[64h + 32(k % 2) + l], with bits 2k..2k+1 of qh[32h + l] on top, minus 32; scale e / 16. */
static float unit_q6k(const uint8_t *b, const int8_t *qx, float dx)
{
    int sumi = 0;
    for (int g = 0; g < 16; g++) {
        int s = 0;
        for (int t = 0; t < 16; t++) {
            int e = 16 * g + t, h = e / 128, k = e % 128 / 32, l = e % 32;
            int byte = b[64 * h + 32 * (k % 2) + l];
            int q = ((k < 2 ? byte & 15 : byte >> 4) | ((b[128 + 32 * h + l] >> (2 * k)) & 3) << 4) - 32;
            s += q * qx[e];
        }
        sumi += (int8_t)b[192 + g] * s;
    }
    return (f16(b + 208) * dx) * (float)sumi;
}

/* Q2_K (scales | qs | d | dmin) and Q3_K (hmask | qs | scales | d): element e = 128h + 32k + l
 * is bits 2k..2k+1 of qs[32h + l], for Q3_K 4 less where bit 4h + k of hmask[l] is clear. Per 16
 * elements g: Q2_K's scale and min are the nibbles of byte g; Q3_K's signed scale is 4 bits
 * (nibble g / 8 of byte g % 8) and 2 more (bits 2(g / 4) of byte 8 + g % 4) of its 12, less 32. */
static float unit_q23k(int type, const uint8_t *b, const int8_t *qx, const int16_t *bs, float dx)
{
    int three = type == Q3_K, sumi = 0, summ = 0;
    const uint8_t *qs = b + (three ? 32 : 16), *sc12 = b + 96;
    for (int g = 0; g < 16; g++) {
        int s = 0, sc;
        for (int t = 0; t < 16; t++) {
            int e = 16 * g + t, h = e / 128, k = e % 128 / 32, l = e % 32;
            int q = (qs[32 * h + l] >> (2 * k)) & 3;
            if (three && !((b[l] >> (4 * h + k)) & 1)) q -= 4;
            s += q * qx[e];
        }
        if (three) {
            sc = (((g < 8 ? sc12[g] : sc12[g - 8] >> 4) & 15) | ((sc12[8 + g % 4] >> (2 * (g / 4))) & 3) << 4) - 32;
        } else {
            sc = b[g] & 15;
            summ += (b[g] >> 4) * bs[g];
        }
        sumi += sc * s;
    }
    float r = (f16(b + (three ? 108 : 80)) * dx) * (float)sumi;
    return three ? r : r - (f16(b + 82) * dx) * (float)summ;
}

/* IQ4_XS (d | scales_h | scales_l[4] | qs[128]): element j of 32-block ib is the IQ4_NL entry
 * of nibble j / 16 of qs[16ib + j % 16]; its scale 4 bits of scales_l (nibble ib % 2 of byte
 * ib / 2) and 2 of scales_h, less 32. IQ3_XXS (d | qs[64] | 8 words): element j is coordinate
 * j % 4 of lattice point qs[8ib + j / 4] (a level index in 3 bits of its key), negative where
 * bit j % 8 of the 8-bit sign (7 from the word, bits 7(j / 8) on, and their parity) is set; the
 * scale is 2s + 1 (s: the word's top 4 bits), and the block's result is taken times 0.25.
 * IQ3_S (d | qs[64] | qh[8] | signs[32] | scales[4]): element j is 2c + 1, c coordinate j % 4
 * (3 bits of the key) of grid point qs[8ib + j / 4] + 256 * (bit j / 4 of qh[ib]), negative
 * where bit j % 8 of signs[4ib + j / 8] is set; the scale is 2s + 1, s the nibble ib % 2 of
 * scales[ib / 2]. */
static float unit_iq(int type, const uint8_t *b, const int8_t *qx, float dx)
{
    int sumi = 0;
    for (int ib = 0; ib < 8; ib++) {
        int s = 0, sc;
        uint32_t word = 0;
        if (type == IQ3_XXS) memcpy(&word, b + 66 + 4 * ib, 4);
        for (int j = 0; j < 32; j++) {
            int v;
            if (type == IQ4_XS) {
                int byte = b[8 + 16 * ib + j % 16];
                v = iq4nl_values[j < 16 ? byte & 15 : byte >> 4];
            } else if (type == IQ3_S) {
                int point = b[2 + 8 * ib + j / 4] + ((b[66 + ib] >> (j / 4)) & 1) * 256;
                v = 2 * ((iq3s_keys[point] >> (3 * (j % 4))) & 7) + 1;
                if ((b[74 + 4 * ib + j / 8] >> (j % 8)) & 1) v = -v;
            } else {
                unsigned bits = (word >> (7 * (j / 8))) & 127, sign = j % 8 == 7 ? __builtin_parity(bits) : (bits >> (j % 8)) & 1;
                v = iq3_levels[(iq3xxs_keys[b[2 + 8 * ib + j / 4]] >> (3 * (j % 4))) & 7];
                if (sign) v = -v;
            }
            s += v * qx[32 * ib + j];
        }
        if (type == IQ4_XS) {
            int low = (b[4 + ib / 2] >> (4 * (ib % 2))) & 15, high = ((b[2] | b[3] << 8) >> (2 * ib)) & 3;
            sc = (low | high << 4) - 32;
        } else if (type == IQ3_S) {
            sc = 2 * ((ib % 2 ? b[106 + ib / 2] >> 4 : b[106 + ib / 2]) & 15) + 1;
        } else {
            sc = 2 * (int)(word >> 28) + 1;
        }
        sumi += sc * s;
    }
    float r = (f16(b) * dx) * (float)sumi;
    return type == IQ3_XXS ? r * 0.25f : r;
}

/* One row of any format: each lane sums its units, then the warp reduces. */
static float twin_row(int type, const uint8_t *wr, const uint8_t *a, int cols)
{
    float lane[32] = {0};
    int bb = block_bytes[type];
    if (!bb) {
        for (int i = 0; i < cols; i++) lane[i % 32] = lane[i % 32] + unit_float(type == F32 ? 0 : type == F16 ? 1 : 2, wr, (const float *)a, i);
    } else if (type <= Q8_0 || type == IQ4_NL || type == MXFP4) {
        int nb = cols / 32;
        const float *d = (const float *)(a + cols), *sd = (const float *)(a + cols + 8 * nb);
        for (int u = 0; u < nb; u++)
            lane[u % 32] = lane[u % 32] + unit_legacy(type, wr + u * bb, (const int8_t *)a + 32 * u, d[u], sd[u]);
    } else {
        int nb = cols / 256;
        const float *d = (const float *)(a + cols);
        const int16_t *bs = (const int16_t *)(a + cols + 4 * nb);
        for (int u = 0; u < nb; u++) {
            const uint8_t *b = wr + u * bb;
            const int8_t *qx = (const int8_t *)a + 256 * u;
            float r = type == Q6_K ? unit_q6k(b, qx, d[u])
                    : type == Q4_K || type == Q5_K ? unit_q45k(type == Q5_K, b, qx, bs + 16 * u, d[u])
                    : type == Q2_K || type == Q3_K ? unit_q23k(type, b, qx, bs + 16 * u, d[u])
                    : unit_iq(type, b, qx, d[u]);
            lane[u % 32] = lane[u % 32] + r;
        }
    }
    return warp_reduce(lane);
}

/* ---- the experts' SwiGLU and the activation quantisers ---- */

/* fp16's nearest even, subnormals and overflow to inf included (a float -> _Float16 cast is
 * one correctly rounded conversion, as cvt.rn.f16.f32). */
static float round_f16(float x) { return (float)(_Float16)x; }

/* Adding 1.5 * 2^23 leaves round-half-even(v) in the low mantissa bits (|v| < 2^22). */
static int nearest_int(float v)
{
    float t = v + 12582912.0f;
    uint32_t u;
    memcpy(&u, &t, 4);
    return (int)(u & 0x7fffff) - 0x400000;
}

/* e^x: x = n ln2 + r, e^r as its Taylor polynomial to r^10 by Horner in double, times 2^n
 * (put straight into the exponent bits), rounded once to float. Plain double add and multiply
 * with -ffp-contract=off, so each step rounds as the GPU's __dadd_rn / __dmul_rn. */
static float exp_canonical(float x)
{
    static const double factorial[11] = {1, 1, 2, 6, 24, 120, 720, 5040, 40320, 362880, 3628800};
    if (x != x) return x;
    if (x > 88.8f) return INFINITY;
    if (x < -104.0f) return 0.0f;
    const double round_int = 6755399441055744.0; /* 1.5 * 2^52: adding it drops the fraction */
    double n = ((double)x * 1.4426950408889634 + round_int) - round_int;
    double r = (double)x - n * 0.6931471805599453, p = 1.0 / factorial[10];
    for (int k = 9; k >= 0; k--) p = p * r + 1.0 / factorial[k];
    uint64_t bits = (uint64_t)((int)n + 1023) << 52;
    double two_n;
    memcpy(&two_n, &bits, 8);
    return (float)(p * two_n);
}

static float silu(float x) { return x / (1.0f + exp_canonical(-x)); }

/* 32-block B of quantize_q8 into A (qs[n] | d[n/32] | s[n/32] int32 | sd[n/32]). The stored
 * scale is fp16(d), yet q is scaled by 1 / d itself, and sd = fp16(d * s). */
static void q8_block(const float *x, uint8_t *a, int n, long b)
{
    const float *xb = x + 32 * b;
    int nb = n / 32, sum = 0;
    float amax = 0.0f; /* the warp's fmaxf of |x|, which skips a NaN */
    for (int i = 0; i < 32; i++)
        if (fabsf(xb[i]) > amax) amax = fabsf(xb[i]);
    float d = amax / 127.0f, d16 = round_f16(d), id = d16 != 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < 32; i++) {
        int q = nearest_int(xb[i] * id);
        ((int8_t *)a)[32 * b + i] = (int8_t)q;
        sum += q;
    }
    ((float *)(a + n))[b] = d16;
    ((int32_t *)(a + n + 4 * nb))[b] = sum;
    ((float *)(a + n + 8 * nb))[b] = round_f16(d * (float)sum);
}

/* 256-block B of quantize_q8k into A (qs[n] | d[n/256] | bsums[n/16] int16). The scale maps
 * the first element of largest magnitude to -127; q is capped at 127 as in ggml's reference. */
static void q8k_block(const float *x, uint8_t *a, int n, long b)
{
    const float *xb = x + 256 * b;
    float amax = 0.0f, max = 0.0f;
    for (int i = 0; i < 256; i++)
        if (fabsf(xb[i]) > amax) amax = fabsf(xb[i]), max = xb[i];
    float iscale = amax != 0.0f ? -127.0f / max : 0.0f;
    if (isinf(iscale)) iscale = 0.0f; /* |max| so tiny that the scale overflows: all zero */
    for (int g = 0; g < 16; g++) {
        int sum = 0;
        for (int i = 16 * g; i < 16 * g + 16; i++) {
            int q = iscale != 0.0f ? nearest_int(iscale * xb[i]) : 0;
            q = q < 127 ? q : 127;
            ((int8_t *)a)[256 * b + i] = (int8_t)q;
            sum += q;
        }
        ((int16_t *)(a + n + 4 * (n / 256)))[16 * b + g] = (int16_t)sum;
    }
    ((float *)(a + n))[b] = iscale != 0.0f ? 1.0f / iscale : 0.0f;
}

/* quantize_float's element: MODE 0 as is, 1 through fp16, 2 through bf16 (nearest even on the
 * top 16 bits; a NaN is made quiet rather than rounded, which could carry it into inf). */
static float round_mode(float v, int mode)
{
    uint32_t u;
    if (mode == 1) return round_f16(v);
    if (mode != 2) return v;
    memcpy(&u, &v, 4);
    u = (u & 0x7fffffff) > 0x7f800000 ? u | 0x400000 : u + 0x7fff + ((u >> 16) & 1);
    u &= 0xffff0000;
    memcpy(&v, &u, 4);
    return v;
}

/* ---- launches: what the grid covers, by kernel ---- */

/* A launch's grid: along x, WARPS warps (the row / block kernels) or THREADS threads
 * (quantize_float); along y, Y blocks, one per job or activation row (blockIdx.y). */
struct grid { long warps, threads; unsigned y; };

/* cuLaunchKernel's P[I] points at argument I, of type T. */
#define ARG(i, T) (*(T *)p[i])

/* kernels.cu's struct moe_job: one (expert, token) pair, its matrices as device addresses. */
struct moe_job { uint64_t gate, up, down; uint32_t column, pad; };

static const uint8_t *dev_bytes(uint64_t a) { return (const uint8_t *)(uintptr_t)a; }

/* matvec_<t>(w, row_bytes, act, act_stride, y, rows, cols, n): it ignores blockIdx.y, so
 * further y-blocks repeat the same rows. */
static void run_matvec(int type, void **p, struct grid g)
{
    const uint8_t *w = ARG(0, const uint8_t *), *act = ARG(2, const uint8_t *);
    uint64_t rb = ARG(1, uint64_t), st = ARG(3, uint64_t);
    float *y = ARG(4, float *);
    int rows = ARG(5, int), cols = ARG(6, int), n = ARG(7, int);
    for (int j = 0; j < n; j++)
        for (long r = 0; r < rows && r < g.warps; r++) y[(size_t)j * rows + r] = twin_row(type, w + r * rb, act + j * st, cols);
}

/* moe_gate_up_<t>(jobs, act, act_stride, h, row_bytes, ff, cols): job j = blockIdx.y,
 * h[j*ff + r] = silu(gate_r . x) * (up_r . x) with x the job's column of act. */
static void run_gate_up(int type, void **p, struct grid g)
{
    const struct moe_job *jobs = ARG(0, const struct moe_job *);
    const uint8_t *act = ARG(1, const uint8_t *);
    uint64_t st = ARG(2, uint64_t), rb = ARG(4, uint64_t);
    float *h = ARG(3, float *);
    int ff = ARG(5, int), cols = ARG(6, int);
    for (unsigned j = 0; j < g.y; j++) {
        if (!jobs[j].gate) continue; /* the CPU's */
        const uint8_t *x = act + jobs[j].column * st;
        for (long r = 0; r < ff && r < g.warps; r++) {
            float gate = twin_row(type, dev_bytes(jobs[j].gate) + r * rb, x, cols);
            float up = twin_row(type, dev_bytes(jobs[j].up) + r * rb, x, cols);
            h[(size_t)j * ff + r] = silu(gate) * up;
        }
    }
}

/* moe_down_<t>(jobs, act, act_stride, y, row_bytes, rows, cols): job j reads activation j (its
 * own prepared h), not its column. */
static void run_down(int type, void **p, struct grid g)
{
    const struct moe_job *jobs = ARG(0, const struct moe_job *);
    const uint8_t *act = ARG(1, const uint8_t *);
    uint64_t st = ARG(2, uint64_t), rb = ARG(4, uint64_t);
    float *y = ARG(3, float *);
    int rows = ARG(5, int), cols = ARG(6, int);
    for (unsigned j = 0; j < g.y; j++)
        for (long r = 0; r < rows && r < g.warps && jobs[j].down; r++)
            y[(size_t)j * rows + r] = twin_row(type, dev_bytes(jobs[j].down) + r * rb, act + j * st, cols);
}

enum { QUANT_FLOAT, QUANT_Q8, QUANT_Q8K };

/* quantize_<kind>(x, act, stride, n[, mode]): row j = blockIdx.y of x (n floats apart) into
 * act + j*stride; a warp per Q8 / Q8_K block, a thread per float element. */
static void run_quantize(int kind, void **p, struct grid g)
{
    const float *x = ARG(0, const float *);
    uint8_t *act = ARG(1, uint8_t *);
    uint64_t st = ARG(2, uint64_t);
    int n = ARG(3, int), mode = kind == QUANT_FLOAT ? ARG(4, int) : 0; /* only it has a 5th argument */
    for (unsigned j = 0; j < g.y; j++) {
        const float *xr = x + (size_t)j * n;
        uint8_t *a = act + j * st;
        if (kind == QUANT_Q8)
            for (long b = 0; b < n / 32 && b < g.warps; b++) q8_block(xr, a, n, b);
        else if (kind == QUANT_Q8K)
            for (long b = 0; b < n / 256 && b < g.warps; b++) q8k_block(xr, a, n, b);
        else
            for (long i = 0; i < n && i < g.threads; i++) ((float *)a)[i] = round_mode(xr[i], mode);
    }
}

/* moe_route(logits, n_expert, used, table, jobs, weights, ids): token t = blockIdx.x, written
 * as a plain loop: the softmax (the maximum, e^(x - max), the 16 partials in double, element i
 * into partial i % 16, met pairwise 8, 4, 2, 1, one scale), then USED times the first expert of
 * the highest probability not taken, the chosen renormalised by their sum in double. */
struct moe_expert { uint64_t gate, up, down; };
static void run_route(int unused, void **p, struct grid g)
{
    (void)unused;
    const float *logits = ARG(0, const float *);
    int n = ARG(1, int), used = ARG(2, int);
    const struct moe_expert *table = ARG(3, const struct moe_expert *);
    struct moe_job *jobs = ARG(4, struct moe_job *);
    float *weights = ARG(5, float *), prob[512];
    int *ids = ARG(6, int *);
    for (long t = 0; t < g.warps; t++) {
        float max = logits[t * n];
        double part[16] = {0}, sum = 0;
        for (int i = 0; i < n; i++) max = logits[t * n + i] > max ? logits[t * n + i] : max;
        for (int i = 0; i < n; i++) part[i % 16] += prob[i] = exp_canonical(logits[t * n + i] - max);
        for (int s = 8; s > 0; s /= 2)
            for (int j = 0; j < s; j++) part[j] += part[j + s];
        float inv = (float)(1.0 / part[0]);
        for (int i = 0; i < n; i++) prob[i] *= inv;
        for (int k = 0; k < used; k++) {
            int best = -1;
            for (int i = 0; i < n; i++) {
                int taken = 0;
                for (int j = 0; j < k; j++) taken |= ids[t * used + j] == i;
                if (!taken && (best < 0 || prob[i] > prob[best])) best = i;
            }
            ids[t * used + k] = best;
            sum += prob[best];
        }
        for (int k = 0; k < used; k++) {
            long a = t * used + k;
            const struct moe_expert e = table[ids[a]];
            jobs[a] = (struct moe_job){e.gate, e.up, e.down, (uint32_t)t, 0};
            weights[a] = prob[ids[a]] / (float)sum;
        }
    }
}

/* moe_combine(y, weights, gate_logit, residual, out, used, dim, shared_y, jobs, cpu_y): token
 * t = blockIdx.y, element i a thread: the weighted outputs in choice order (a job without
 * matrices: its output from cpu_y), then the shared expert's (row t of shared_y, where given)
 * times sigmoid of its gate logit, then added to the residual row where one is given. */
static void run_combine(int unused, void **p, struct grid g)
{
    (void)unused;
    const float *y = ARG(0, const float *), *w = ARG(1, const float *), *gate = ARG(2, const float *), *res = ARG(3, const float *);
    float *out = ARG(4, float *);
    int used = ARG(5, int), dim = ARG(6, int);
    const float *shared_y = ARG(7, const float *);
    const struct moe_job *jobs = ARG(8, const struct moe_job *);
    const float *cpu_y = ARG(9, const float *);
    for (unsigned t = 0; t < g.y; t++)
        for (long i = 0; i < dim && i < g.threads; i++) {
            float o = 0;
            for (int k = 0; k < used; k++) {
                const float *src = jobs[t * used + k].gate ? y : cpu_y;
                float v = src[(t * used + k) * (size_t)dim + i] * w[t * used + k];
                o = k ? o + v : v;
            }
            if (shared_y) o += shared_y[(size_t)t * dim + i] * (1.0f / (1.0f + exp_canonical(-gate[t])));
            out[(size_t)t * dim + i] = res ? res[(size_t)t * dim + i] + o : o;
        }
}

/* residual_norm(x, y, w, xn, dim, eps): token t = blockIdx.x: x[t] += y[t] (Y not NULL), then xn[t] = x[t]
 * times 1 / sqrt(mean of squares + eps) times w, the squares summed in double into 16 partials
 * (element i into partial i % 16), met pairwise 8, 4, 2, 1. */
static void run_residual_norm(int unused, void **p, struct grid g)
{
    (void)unused;
    float *x = ARG(0, float *), *xn = ARG(3, float *);
    const float *y = ARG(1, const float *), *w = ARG(2, const float *);
    int dim = ARG(4, int);
    float eps = ARG(5, float);
    for (long t = 0; t < g.warps; t++) {
        float *xr = x + t * dim;
        double part[16] = {0};
        for (int i = 0; i < dim; i++) {
            if (y) xr[i] += y[t * dim + i];
            part[i % 16] += (double)xr[i] * xr[i];
        }
        for (int s = 8; s > 0; s /= 2)
            for (int j = 0; j < s; j++) part[j] += part[j + s];
        float scale = 1.0f / sqrtf((float)(part[0] / dim) + eps);
        for (int i = 0; i < dim; i++) xn[t * dim + i] = xr[i] * scale * w[i];
    }
}

/* ln z for a positive normal z as coli.c's ops_ln: z = m 2^k with m in [sqrt(1/2), sqrt(2)),
 * ln m = 2 atanh((m - 1) / (m + 1)) by its odd series to s^21, ln 2 in two parts. */
static double ln_canonical(double z)
{
    uint64_t bits;
    memcpy(&bits, &z, 8);
    int k = (int)(bits >> 52) - 1023;
    bits = (bits & 0x000fffffffffffffull) | 0x3ff0000000000000ull;
    double m;
    memcpy(&m, &bits, 8);
    if (m > 1.4142135623730951) m *= 0.5, k++;
    const double s = (m - 1.0) / (m + 1.0), s2 = s * s;
    double t = 1.0 / 21;
    for (int j = 19; j >= 1; j -= 2) t = t * s2 + 1.0 / j;
    return k * 6.93147180369123816490e-01 + (2.0 * s * t + k * 1.90821492927058770002e-10);
}

/* log(1 + e^x) (x above 20: x), e^x rounded to float, ln(1 + y) by its series below 2^-10. */
static float softplus(float x)
{
    if (x > 20.0f) return x;
    const double y = exp_canonical(x);
    if (!(y >= 0.0)) return (float)y;
    if (y < 0.0009765625) return (float)(y * (1.0 - y * (0.5 - y * (1.0 / 3 - y * (0.25 - y * (0.2 - y / 6))))));
    return (float)ln_canonical(1.0 + y);
}

/* The squares of N floats in double, element i into partial i % 16, met pairwise 8, 4, 2, 1. */
static double squares(const float *x, int n)
{
    double part[16] = {0};
    for (int i = 0; i < n; i++) part[i % 16] += (double)x[i] * x[i];
    for (int s = 8; s > 0; s /= 2)
        for (int j = 0; j < s; j++) part[j] += part[j + s];
    return part[0];
}

/* deltanet_conv(mixed, taps, states, layer_off, conv_dim, K, dk, q_end, eps, qscale, T): for
 * each token in order, every channel's causal conv over its state (the taps oldest first from
 * 0, then the input; the state shifted), SiLU, then each q and k head (channels below 2 q_end,
 * dk apiece) divided by max(its L2 norm, eps), q's channels times qscale. */
static void run_deltanet_conv(int unused, void **p, struct grid g)
{
    (void)unused; (void)g;
    float *mixed = ARG(0, float *);
    const float *taps = ARG(1, const float *);
    const uint64_t *states = ARG(2, const uint64_t *);
    uint64_t off = ARG(3, uint64_t);
    int n = ARG(4, int), K = ARG(5, int), dk = ARG(6, int), q_end = ARG(7, int), T = ARG(10, int);
    float eps = ARG(8, float), qscale = ARG(9, float);
    for (int t = 0; t < T; t++) {
        float *x = mixed + (size_t)t * n, *st = (float *)(uintptr_t)states[t] + off;
        for (int ch = 0; ch < n; ch++) {
            float sum = 0.0f, in = x[ch];
            for (int j = 0; j < K - 1; j++) sum += taps[(size_t)j * n + ch] * st[(size_t)j * n + ch];
            sum += taps[(size_t)(K - 1) * n + ch] * in;
            for (int j = 0; j + 1 < K - 1; j++) st[(size_t)j * n + ch] = st[(size_t)(j + 1) * n + ch];
            if (K > 1) st[(size_t)(K - 2) * n + ch] = in;
            x[ch] = silu(sum);
        }
        for (int h = 0; h < 2 * q_end; h += dk) {
            float norm = sqrtf((float)squares(x + h, dk)), scale = 1.0f / (norm > eps ? norm : eps);
            for (int i = h; i < h + dk; i++) x[i] = i < q_end ? x[i] * scale * qscale : x[i] * scale;
        }
    }
}

/* deltanet_rule(mixed, beta, alpha, ba, dt_bias, ssm_a, states, ssm_off, nk, nv, dk, dv, tiled,
 * conv_dim, T, core): for each token in order and each v-head h, its state S ([dk][dv], element
 * (row j, i) at i dv + j) decayed by e^(softplus(alpha + dt_bias) a), row j's prediction k . S_j,
 * S_j += k beta (v_j - prediction), core_j = q . S_j, each dot a serial sum over i. */
static void run_deltanet_rule(int unused, void **p, struct grid g)
{
    (void)unused; (void)g;
    const float *mixed = ARG(0, const float *), *bin = ARG(1, const float *), *ain = ARG(2, const float *);
    const float *dt_bias = ARG(4, const float *), *ssm_a = ARG(5, const float *);
    const uint64_t *states = ARG(6, const uint64_t *);
    uint64_t off = ARG(7, uint64_t);
    int ba = ARG(3, int), nk = ARG(8, int), nv = ARG(9, int), dk = ARG(10, int), dv = ARG(11, int), tiled = ARG(12, int);
    int n = ARG(13, int), T = ARG(14, int), r = nv / nk;
    float *core = ARG(15, float *);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < nv; h++) {
            const int grp = tiled ? h % nk : h / r;
            const float *x = mixed + (size_t)t * n, *q = x + (size_t)grp * dk, *k = x + (size_t)(nk + grp) * dk, *v = x + (size_t)2 * nk * dk + (size_t)h * dv;
            float b = ba ? bin[(size_t)t * 2 * nv + (h / r) * 2 * r + h % r] : bin[(size_t)t * nv + h];
            float a = ba ? bin[(size_t)t * 2 * nv + (h / r) * 2 * r + r + h % r] : ain[(size_t)t * nv + h];
            float beta = 1.0f / (1.0f + exp_canonical(-b)), decay = exp_canonical(softplus(a + dt_bias[h]) * ssm_a[h]);
            float *S = (float *)(uintptr_t)states[t] + off + (size_t)h * dv * dk;
            for (int j = 0; j < dv; j++) {
                float pred = 0.0f, o = 0.0f;
                for (int i = 0; i < dk; i++) {
                    S[(size_t)i * dv + j] *= decay;
                    pred += S[(size_t)i * dv + j] * k[i];
                }
                float delta = beta * (v[j] - pred);
                for (int i = 0; i < dk; i++) {
                    S[(size_t)i * dv + j] += k[i] * delta;
                    o += S[(size_t)i * dv + j] * q[i];
                }
                core[(size_t)t * nv * dv + (size_t)h * dv + j] = o;
            }
        }
}

/* deltanet_gate(core, z, w, per_head, dv, eps): each row of dv (head gx of token gy) becomes
 * rmsnorm(row) * w * silu(z's row), w the head's own where per_head. */
static void run_deltanet_gate(int unused, void **p, struct grid g)
{
    (void)unused;
    float *core = ARG(0, float *);
    const float *z = ARG(1, const float *), *w = ARG(2, const float *);
    int per_head = ARG(3, int), dv = ARG(4, int), heads = (int)(g.warps);
    float eps = ARG(5, float);
    for (unsigned t = 0; t < g.y; t++)
        for (int h = 0; h < heads; h++) {
            float *o = core + ((size_t)t * heads + h) * dv;
            const float *wh = w + (per_head ? (size_t)h * dv : 0), *zr = z + ((size_t)t * heads + h) * dv;
            float scale = 1.0f / sqrtf((float)(squares(o, dv) / dv) + eps);
            for (int i = 0; i < dv; i++) o[i] = o[i] * scale * wh[i] * silu(zr[i]);
        }
}

/* The KV cache's formats (KVF: coli.c's enum ops_kv): f32, f16, or Q8_0 rows (32-blocks of an
 * fp16 d and 32 int8, quantised as an activation), its keys in groups of 16 positions: dword m
 * of each position's quants (+128) side by side, then each block's 16 d. A row's bytes; a value
 * row's element I; the store of row P of HD floats X into a KV head's rows at HEAD. */
#define KV_GROUP 16
static size_t kv_row_bytes(int hd, int kvf) { return kvf == 2 ? (size_t)hd / 32 * 34 : (size_t)hd * (kvf ? 2 : 4); }
static float kv_get(const uint8_t *row, int i, int kvf)
{
    if (kvf == 2) return f16(row + i / 32 * 34) * (float)((const int8_t *)row)[i / 32 * 34 + 2 + i % 32];
    return kvf ? f16(row + 2 * i) : ld_f32(row + 4 * i);
}
static void kv_store(uint8_t *head, size_t p, const float *x, int hd, int kvf, int keys)
{
    uint8_t *row = head + p * kv_row_bytes(hd, kvf), *group = head + p / KV_GROUP * KV_GROUP * kv_row_bytes(hd, kvf), a[512 + 16 * 12];
    const int r = (int)(p % KV_GROUP);
    for (int i = 0; i < hd && kvf < 2; i++) {
        _Float16 h = (_Float16)x[i];
        if (kvf) memcpy(row + 2 * i, &h, 2);
        else memcpy(row + 4 * i, &x[i], 4);
    }
    for (int b = 0; b < hd / 32 && kvf == 2; b++) {
        q8_block(x, a, hd, b);
        _Float16 d = (_Float16)((float *)(a + hd))[b];
        for (int i = 32 * b; i < 32 * b + 32; i++)
            if (keys) group[i / 4 * 4 * KV_GROUP + 4 * r + i % 4] = (uint8_t)(a[i] + 128);
            else row[b * 34 + 2 + i % 32] = a[i];
        memcpy(keys ? group + KV_GROUP * hd + 2 * (b * KV_GROUP + r) : row + b * 34, &d, 2);
    }
}

/* attn_prep(qg, k, v, q_norm, k_norm, rope, kv, layer_off, pos, n_head, n_kv, hd, rot, rows, kvf,
 * eps): every q head (in qg's rows of 2 hd, q then gate) and k head of each token through its
 * RMSNorm (times q_norm / k_norm) and the NeoX rotation of its first rot dims (rope's row: rot/2
 * cosines, then sines); each k head's row and its v row into the token's cache at its position
 * (keys [n_kv][rows][hd], then values). */
static void run_attn_prep(int unused, void **p, struct grid g)
{
    (void)unused;
    float *qg = ARG(0, float *), *k = ARG(1, float *);
    const float *v = ARG(2, const float *), *qn = ARG(3, const float *), *kn = ARG(4, const float *), *rope = ARG(5, const float *);
    const uint64_t *kv = ARG(6, const uint64_t *);
    uint64_t off = ARG(7, uint64_t), rows = ARG(13, uint64_t);
    const int *pos = ARG(8, const int *);
    int nh = ARG(9, int), nkv = ARG(10, int), hd = ARG(11, int), rot = ARG(12, int), kvf = ARG(14, int), half = rot / 2;
    float eps = ARG(15, float);
    size_t rb = kv_row_bytes(hd, kvf);
    for (unsigned t = 0; t < g.y; t++)
        for (int h = 0; h < nh + nkv; h++) {
            float *x = h < nh ? qg + ((size_t)t * nh + h) * 2 * hd : k + ((size_t)t * nkv + h - nh) * hd;
            const float *w = h < nh ? qn : kn, *cs = rope + (size_t)t * rot;
            float scale = 1.0f / sqrtf((float)(squares(x, hd) / hd) + eps);
            for (int i = 0; i < hd; i++) x[i] = x[i] * scale * w[i];
            for (int j = 0; j < half; j++) {
                float a = x[j], b = x[j + half];
                x[j] = a * cs[j] - b * cs[half + j];
                x[j + half] = b * cs[j] + a * cs[half + j];
            }
            if (h < nh) continue;
            uint8_t *kh = (uint8_t *)(uintptr_t)kv[t] + off + (size_t)(h - nh) * rows * rb;
            kv_store(kh, (size_t)pos[t], x, hd, kvf, 1);
            kv_store(kh + (size_t)nkv * rows * rb, (size_t)pos[t], v + ((size_t)t * nkv + h - nh) * hd, hd, kvf, 0);
        }
}

/* attn_split(qg, kv, layer_off, pos, t0, n_head, n_kv, hd, rows, kvf, scale, splits, parts): for
 * token t0 + y, q head h and split c (x = h splits + c), rows 256c.. of the first pos + 1 of its
 * KV head's cache: scores q . k_p (float keys: 16 partials by element, met pairwise 8, 4, 2, 1;
 * Q8_0 keys: q quantised as an activation, a block's integer sum times d_k d_q added in block
 * order) times scale;
 * their softmax (the largest from the split's first row, NaN only there; e^(s - max); the sum in
 * double over 16 partials by row; one scale); o = sum of w_p v_p as fused multiply-adds in
 * increasing p. Record [y][h][c] of hd + 4 floats: the largest, the sum (double, at float 2), o. */
#define ATTN_SPLIT 256
static void run_attn_split(int unused, void **p, struct grid g)
{
    (void)unused;
    const float *qg = ARG(0, const float *);
    const uint64_t *kv = ARG(1, const uint64_t *);
    uint64_t off = ARG(2, uint64_t), rows = ARG(8, uint64_t);
    const int *pos = ARG(3, const int *);
    int t0 = ARG(4, int), nh = ARG(5, int), nkv = ARG(6, int), hd = ARG(7, int), kvf = ARG(9, int), splits = ARG(11, int);
    float scale = ARG(10, float), *parts = ARG(12, float *);
    size_t row = kv_row_bytes(hd, kvf);
    for (unsigned y = 0; y < g.y; y++)
        for (long x = 0; x < g.warps; x++) {
            const int t = t0 + (int)y, h = (int)x / splits, c = (int)x % splits, p0 = c * ATTN_SPLIT;
            const int n = pos[t] + 1 - p0 < ATTN_SPLIT ? pos[t] + 1 - p0 : ATTN_SPLIT;
            if (n <= 0) continue;
            const float *q = qg + ((size_t)t * nh + h) * 2 * hd;
            const uint8_t *keys = (const uint8_t *)(uintptr_t)kv[t] + off + (size_t)(h / (nh / nkv)) * rows * row + (size_t)p0 * row;
            const uint8_t *vals = keys + (size_t)nkv * rows * row;
            float w[ATTN_SPLIT], *rec = parts + (((size_t)y * nh + h) * splits + c) * (hd + 4);
            uint8_t qa[512 + 16 * 12];
            for (int b = 0; b < hd / 32 && kvf == 2; b++) q8_block(q, qa, hd, b);
            for (int r = 0; r < n; r++) {
                float part[16] = {0}, acc = 0.0f;
                const uint8_t *g = keys + (size_t)r / KV_GROUP * KV_GROUP * row;
                for (int b = 0; b < hd / 32 && kvf == 2; b++) {
                    int isum = 0;
                    for (int i = 32 * b; i < 32 * b + 32; i++) isum += ((int)g[i / 4 * 4 * KV_GROUP + 4 * (r % KV_GROUP) + i % 4] - 128) * (int8_t)qa[i];
                    acc = acc + (f16(g + KV_GROUP * hd + 2 * (b * KV_GROUP + r % KV_GROUP)) * ((float *)(qa + hd))[b]) * (float)isum;
                }
                for (int i = 0; i < hd && kvf < 2; i++) part[i % 16] += q[i] * kv_get(keys + r * row, i, kvf);
                for (int s = 8; s > 0; s /= 2)
                    for (int j = 0; j < s; j++) part[j] += part[j + s];
                w[r] = (kvf == 2 ? acc : part[0]) * scale;
            }
            float max = w[0];
            for (int r = 1; r < n; r++) max = w[r] > max ? w[r] : max;
            double sum[16] = {0};
            for (int r = 0; r < n; r++) sum[r % 16] += w[r] = exp_canonical(w[r] - max);
            for (int s = 8; s > 0; s /= 2)
                for (int j = 0; j < s; j++) sum[j] += sum[j + s];
            float inv = (float)(1.0 / sum[0]);
            rec[0] = max;
            memcpy(rec + 2, &sum[0], 8);
            for (int i = 0; i < hd; i++) {
                float acc = 0.0f;
                for (int r = 0; r < n; r++) acc = fmaf(w[r] * inv, kv_get(vals + r * row, i, kvf), acc);
                rec[4 + i] = acc;
            }
        }
}

/* attn_merge(qg, pos, t0, n_head, hd, splits, parts, out): for token t0 + y and q head x, its
 * splits' records in order: the new maximum; each side's share of the new sum (its sum times
 * e^(its max - the new max), in double) as a float weight; o = fma(w_split, its o, w_before o);
 * then times sigmoid of the gate. */
static void run_attn_merge(int unused, void **p, struct grid g)
{
    (void)unused;
    const float *qg = ARG(0, const float *), *parts = ARG(6, const float *);
    const int *pos = ARG(1, const int *);
    int t0 = ARG(2, int), nh = ARG(3, int), hd = ARG(4, int), splits = ARG(5, int);
    float *out = ARG(7, float *);
    for (unsigned y = 0; y < g.y; y++)
        for (long h = 0; h < g.warps; h++) {
            const int t = t0 + (int)y, n = (pos[t] + ATTN_SPLIT) / ATTN_SPLIT;
            const float *rec = parts + ((size_t)y * nh + h) * splits * (hd + 4), *gate = qg + ((size_t)t * nh + h) * 2 * hd + hd;
            float *o = out + ((size_t)t * nh + h) * hd, max = rec[0];
            double sum;
            memcpy(&sum, rec + 2, 8);
            memcpy(o, rec + 4, (size_t)hd * 4);
            for (int c = 1; c < n; c++) {
                const float *rc = rec + (size_t)c * (hd + 4), top = rc[0] > max ? rc[0] : max;
                double sum_c;
                memcpy(&sum_c, rc + 2, 8);
                const double a = (double)exp_canonical(max - top) * sum, b = (double)exp_canonical(rc[0] - top) * sum_c;
                const float w_before = (float)(a / (a + b)), w_split = (float)(b / (a + b));
                for (int i = 0; i < hd; i++) o[i] = fmaf(w_split, rc[4 + i], w_before * o[i]);
                max = top, sum = a + b;
            }
            for (int i = 0; i < hd; i++) o[i] *= 1.0f / (1.0f + exp_canonical(-gate[i]));
        }
}

/* copy_words(src, dst, n): the words the grid's threads cover. */
static void run_copy_words(int unused, void **p, struct grid g)
{
    (void)unused;
    const uint32_t *src = ARG(0, const uint32_t *);
    uint32_t *dst = ARG(1, uint32_t *);
    for (long i = 0; i < ARG(2, int) && i < g.threads; i++) dst[i] = src[i];
}

/* publish_words(src, dst, n, count): n words into host memory, then *count one more; from the
 * FAKE_CUDA_FAIL=publish:K-th launch on, the words without the count (a signal lost: coli must
 * not wait for it forever). */
static void run_publish_words(int unused, void **p, struct grid g)
{
    (void)unused, (void)g;
    const uint32_t *src = ARG(0, const uint32_t *);
    uint32_t *dst = ARG(1, uint32_t *), *count = ARG(3, uint32_t *);
    memcpy(dst, src, (size_t)ARG(2, int) * 4);
    if (!fail_publish || ++n_publish < fail_publish) ++*count;
}

/* The output head's best candidates (logits_top_max, _bound, _collect, _rank): a row's state
 * between the four launches, laid out as kernels.cu's struct top_scratch. */
enum { TOP_K = 64, TOP_SLICES = 256, TOP_LIST = 2048, TOP_ROW = TOP_K + 2 };
struct top_entry { int id; float logit; };
enum { PENALTY_MAX = 256 };
struct top_scratch {
    double sums[TOP_SLICES];
    float maxima[TOP_SLICES], bound;
    int count, finite, unused;
    float kept[PENALTY_MAX];
    struct top_entry list[TOP_LIST];
};

/* Slice S of a row of N: [*FROM, *END), each but the last a whole number of 32s. */
static void top_slice(int n, int s, int *from, int *end)
{
    const int span = (n + 32 * TOP_SLICES - 1) / (32 * TOP_SLICES) * 32;
    *from = s * span;
    *end = n < *from + span ? n : *from + span;
}

/* logits_top_max(logits, n, scratch): row y's slices' largest logits (a NaN never; -inf where
 * none), its bound -inf, its count 0, its finite 1. */
static void run_top_max(int unused, void **p, struct grid g)
{
    (void)unused;
    const float *logits = ARG(0, const float *);
    int n = ARG(1, int), from, end;
    struct top_scratch *z = ARG(2, struct top_scratch *);
    for (unsigned t = 0; t < g.y; t++) {
        for (int s = 0; s < TOP_SLICES && s < g.warps; s++) {
            float max = -INFINITY;
            top_slice(n, s, &from, &end);
            for (int i = from; i < end; i++) max = logits[(size_t)t * n + i] > max ? logits[(size_t)t * n + i] : max;
            z[t].maxima[s] = max;
        }
        z[t].bound = -INFINITY, z[t].count = 0, z[t].finite = 1;
    }
}

static int top_float_desc(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return x > y ? -1 : x < y;
}

/* logits_top_bound(scratch): row y's bound the TOP_K-th of its maxima sorted from the largest,
 * where that is above -inf. */
static void run_top_bound(int unused, void **p, struct grid g)
{
    (void)unused;
    struct top_scratch *z = ARG(0, struct top_scratch *);
    for (unsigned t = 0; t < g.y; t++) {
        float m[TOP_SLICES];
        memcpy(m, z[t].maxima, sizeof m);
        qsort(m, TOP_SLICES, sizeof *m, top_float_desc);
        if (m[TOP_K - 1] > -INFINITY) z[t].bound = m[TOP_K - 1];
    }
}

/* The entries the list holds: TOP_LIST, or fewer where FAKE_CUDA_TOP_LIST says (to see a
 * row whose best cannot all be listed, which takes thousands of equal logits). */
static int top_list(void)
{
    const int n = env_int("FAKE_CUDA_TOP_LIST", TOP_LIST);
    return n < TOP_LIST ? n : TOP_LIST;
}

/* logits_top_collect(logits, n, scratch): row y's logits that reach its bound listed in id
 * order (the first top_list()), all of them counted; a logit not finite clears finite. */
static void run_top_collect(int unused, void **p, struct grid g)
{
    (void)unused;
    const float *logits = ARG(0, const float *);
    int n = ARG(1, int), room = top_list();
    struct top_scratch *z = ARG(2, struct top_scratch *);
    for (unsigned t = 0; t < g.y; t++)
        for (int i = 0; i < n; i++) {
            const float v = logits[(size_t)t * n + i];
            if (!isfinite(v)) z[t].finite = 0;
            if (v >= z[t].bound && z[t].count++ < room) z[t].list[z[t].count - 1] = (struct top_entry){i, v};
        }
}

static int top_entry_first(const void *a, const void *b)
{
    const struct top_entry *x = a, *y = b;
    return x->logit > y->logit ? -1 : x->logit < y->logit ? 1 : (x->id > y->id) - (x->id < y->id);
}

/* logits_top_rank(scratch, out): row y's list sorted (the larger logit first, the lower id on a
 * tie), its TOP_K first into out[y] (id -1 past the list's end), then the entry {1 where finite
 * + 2 where the list held every logit counted, 0}. */
static void run_top_rank(int unused, void **p, struct grid g)
{
    (void)unused;
    const struct top_scratch *z = ARG(0, const struct top_scratch *);
    struct top_entry *out = ARG(1, struct top_entry *), list[TOP_LIST];
    for (unsigned t = 0; t < g.y; t++) {
        const int room = top_list(), count = z[t].count < room ? z[t].count : room;
        struct top_entry *o = out + (size_t)t * TOP_ROW;
        memcpy(list, z[t].list, (size_t)count * sizeof *list);
        qsort(list, (size_t)count, sizeof *list, top_entry_first);
        for (int r = 0; r < TOP_K; r++) o[r] = r < count ? list[r] : (struct top_entry){-1, 0.0f};
        o[TOP_K] = (struct top_entry){z[t].finite + (z[t].count <= room ? 2 : 0), 0.0f};
    }
}

/* The whole-vocabulary draw (logits_draw_sums, _walk): a row's as coli.c uploads it (on 1: drawn
 * here, 2: its total and its nucleus's cut only). */
struct top_draw { double u; float temp, top_p, min_p; int on; };

/* Row T's weights e^((logit - max) / temp) into W (the row's max from its scratch's maxima). */
static void draw_weights(const float *logits, int n, const struct top_scratch *z, const struct top_draw *d, float *w)
{
    float max = -INFINITY;
    for (int s = 0; s < TOP_SLICES; s++) max = z->maxima[s] > max ? z->maxima[s] : max;
    for (int i = 0; i < n; i++) w[i] = exp_canonical((logits[i] - max) / d->temp);
}

/* logits_draw_sums(logits, n, draw, scratch): each drawn row's slices' weights summed in id order. */
static void run_draw_sums(int unused, void **p, struct grid g)
{
    (void)unused;
    const float *logits = ARG(0, const float *);
    const int n = ARG(1, int);
    const struct top_draw *draw = ARG(2, const struct top_draw *);
    struct top_scratch *z = ARG(3, struct top_scratch *);
    float *w = malloc((size_t)n * sizeof *w);
    for (unsigned t = 0; w && t < g.y; t++) {
        if (!draw[t].on) continue;
        draw_weights(logits + (size_t)t * n, n, &z[t], &draw[t], w);
        for (int s = 0, from, end; s < TOP_SLICES; s++) {
            double sum = 0.0;
            top_slice(n, s, &from, &end);
            for (int i = from; i < end; i++) sum += w[i];
            z[t].sums[s] = sum;
        }
    }
    free(w);
}

/* Whether the nucleus (top-p, min-p) of a row of N weights W with TOTAL is cut among its TOP_K
 * best, BEST (by the rank's order), before the last one's weight (coli.c orders by weight, and
 * tokens outside may share that): a plain rendering of coli.c's sample_nucleus_cut. */
static int draw_nucleus_within(const struct top_entry *best, const float *w, int n, double total, const struct top_draw *d)
{
    double mass = 0.0;
    int keep = TOP_K;
    if (n <= TOP_K) return 1;
    for (int k = 0; k < TOP_K && keep == TOP_K; k++) {
        if (w[best[k].id] < d->min_p * w[best[0].id]) keep = k;
        else if ((mass += w[best[k].id]) >= d->top_p * total) keep = k + 1;
    }
    return keep > 0 && keep < TOP_K && w[best[keep - 1].id] > w[best[TOP_K - 1].id];
}

/* logits_draw_walk(logits, n, draw, scratch, out): each drawn row's total, and its token by
 * kernels.cu's walk: r = u * total, past whole slices while r reaches their sums, then token by
 * token; the last of weight above 0 where r passes them all. A nucleus row (on 2): whether its
 * cut falls among its best, as status bit 4. */
static void run_draw_walk(int unused, void **p, struct grid g)
{
    (void)unused;
    const float *logits = ARG(0, const float *);
    const int n = ARG(1, int);
    const struct top_draw *draw = ARG(2, const struct top_draw *);
    const struct top_scratch *z = ARG(3, const struct top_scratch *);
    struct top_entry *out = ARG(4, struct top_entry *);
    float *w = malloc((size_t)n * sizeof *w);
    for (unsigned t = 0; w && t < g.y; t++) {
        if (!draw[t].on) continue;
        draw_weights(logits + (size_t)t * n, n, &z[t], &draw[t], w);
        double total = 0.0;
        for (int s = 0; s < TOP_SLICES; s++) total += z[t].sums[s];
        struct top_entry *o = out + (size_t)t * TOP_ROW;
        memcpy(&o[TOP_K + 1], &total, sizeof total);
        if (draw[t].on == 2) {
            o[TOP_K].id |= draw_nucleus_within(o, w, n, total, &draw[t]) ? 4 : 0;
            continue;
        }
        double r = draw[t].u * total;
        int s = 0, last = 0, from, end, id = -1;
        for (; s < TOP_SLICES && r >= z[t].sums[s]; s++) {
            if (z[t].sums[s] > 0.0) last = s;
            r -= z[t].sums[s];
        }
        if (s == TOP_SLICES) s = last, r = INFINITY;
        top_slice(n, s, &from, &end);
        for (int i = from; i < end && id < 0; i++) {
            if (r < w[i]) id = i;
            r -= w[i];
        }
        for (int i = end - 1; id < 0 && i >= from; i--)
            if (w[i] > 0.0f) id = i;
        memcpy(&o[TOP_K].logit, &id, sizeof id);
    }
    free(w);
}

/* The penalties (logits_penalise, _unpenalise): a row's as coli.c uploads it. */
struct top_penalty { float repeat, presence, frequency; int n; struct { int id, count; } seen[PENALTY_MAX]; };

/* logits_penalise(logits, n, pen, scratch): each row's listed logits kept, then penalised: the
 * CTRL rule, then presence + frequency x count taken off. */
static void run_penalise(int unused, void **p, struct grid g)
{
    (void)unused;
    float *logits = ARG(0, float *);
    const int n = ARG(1, int);
    const struct top_penalty *pen = ARG(2, const struct top_penalty *);
    struct top_scratch *z = ARG(3, struct top_scratch *);
    for (unsigned t = 0; t < g.y; t++)
        for (int k = 0; k < pen[t].n && k < PENALTY_MAX; k++) {
            const int id = pen[t].seen[k].id;
            if (id < 0 || id >= n) continue;
            float *l = &logits[(size_t)t * n + id];
            z[t].kept[k] = *l;
            *l = *l > 0 ? *l / pen[t].repeat : *l * pen[t].repeat;
            *l -= pen[t].presence + pen[t].frequency * (float)pen[t].seen[k].count;
        }
}

/* logits_unpenalise(logits, n, pen, scratch): each row's listed logits back as kept. */
static void run_unpenalise(int unused, void **p, struct grid g)
{
    (void)unused;
    float *logits = ARG(0, float *);
    const int n = ARG(1, int);
    const struct top_penalty *pen = ARG(2, const struct top_penalty *);
    const struct top_scratch *z = ARG(3, const struct top_scratch *);
    for (unsigned t = 0; t < g.y; t++)
        for (int k = 0; k < pen[t].n && k < PENALTY_MAX; k++)
            if (pen[t].seen[k].id >= 0 && pen[t].seen[k].id < n) logits[(size_t)t * n + pen[t].seen[k].id] = z[t].kept[k];
}

/* ---- modules ---- */

/* Every kernel of kernels.ptx; ARG is the GGUF type of the weights, or the quantiser's kind. */
typedef void (*launch_fn)(int arg, void **p, struct grid g);
#define FORMAT(t, type) {"matvec_" t, type, run_matvec}, {"moe_gate_up_" t, type, run_gate_up}, {"moe_down_" t, type, run_down}
static const struct { const char *name; int arg; launch_fn run; } kernels[] = {
    FORMAT("f32", F32), FORMAT("f16", F16), FORMAT("bf16", BF16), FORMAT("q8_0", Q8_0), FORMAT("q4_0", Q4_0),
    FORMAT("q4_1", Q4_1), FORMAT("q5_0", Q5_0), FORMAT("q5_1", Q5_1), FORMAT("iq4_nl", IQ4_NL), FORMAT("mxfp4", MXFP4),
    FORMAT("q2_k", Q2_K), FORMAT("q3_k", Q3_K), FORMAT("q4_k", Q4_K), FORMAT("q5_k", Q5_K), FORMAT("q6_k", Q6_K),
    FORMAT("iq4_xs", IQ4_XS), FORMAT("iq3_xxs", IQ3_XXS), FORMAT("iq3_s", IQ3_S),
    {"quantize_float", QUANT_FLOAT, run_quantize}, {"quantize_q8", QUANT_Q8, run_quantize},
    {"quantize_q8k", QUANT_Q8K, run_quantize}, {"moe_route", 0, run_route}, {"moe_combine", 0, run_combine},
    {"residual_norm", 0, run_residual_norm}, {"deltanet_conv", 0, run_deltanet_conv}, {"deltanet_rule", 0, run_deltanet_rule},
    {"deltanet_gate", 0, run_deltanet_gate}, {"attn_prep", 0, run_attn_prep}, {"attn_split", 0, run_attn_split},
    {"attn_merge", 0, run_attn_merge}, {"logits_top_max", 0, run_top_max}, {"logits_top_bound", 0, run_top_bound},
    {"logits_top_collect", 0, run_top_collect}, {"logits_top_rank", 0, run_top_rank}, {"copy_words", 0, run_copy_words},
    {"publish_words", 0, run_publish_words},
    {"logits_draw_sums", 0, run_draw_sums}, {"logits_draw_walk", 0, run_draw_walk},
    {"logits_penalise", 0, run_penalise}, {"logits_unpenalise", 0, run_unpenalise},
};
#define N_KERNELS (int)(sizeof kernels / sizeof kernels[0])
struct module { int has[N_KERNELS]; };
struct func { int k, n_params, wide[16]; }; /* the kernel's parameters: how many, which are 8 bytes */
static struct func funcs[N_KERNELS];

/* F's parameters, read from its `.entry NAME(` in PTX: `.param .u64 ...` 8 bytes, `.u32` and
 * `.f32` 4. Returns 0, or -1 where the entry has another kind or too many. */
static int ptx_params(const char *ptx, const char *name, struct func *f)
{
    char pat[80];
    snprintf(pat, sizeof pat, ".entry %s(", name);
    const char *p = strstr(ptx, pat), *end = p ? strchr(p, ')') : NULL;
    f->n_params = 0;
    for (p = p ? strstr(p, ".param ") : NULL; p && p < end; p = strstr(p + 1, ".param ")) {
        if (f->n_params == 16 || (strncmp(p, ".param .u64", 11) && strncmp(p, ".param .u32", 11) && strncmp(p, ".param .f32", 11))) return -1;
        f->wide[f->n_params++] = !strncmp(p, ".param .u64", 11);
    }
    return 0;
}

/* Copies the N bytes of the PTX line `.const .align A .b8 NAME[N] = {b0, b1, ...};` to OUT.
 * Returns 0, or -1 where PTX has no such table. */
static int ptx_table(const char *ptx, const char *name, void *out, int n)
{
    char pat[64];
    snprintf(pat, sizeof pat, ".b8 %s[%d] = {", name, n);
    const char *p = strstr(ptx, pat);
    if (!p) return -1;
    p += strlen(pat);
    for (int i = 0; i < n; i++) {
        char *end;
        ((uint8_t *)out)[i] = (uint8_t)strtoul(p, &end, 10);
        if (end == p) return -1;
        p = end + strspn(end, ", ");
    }
    return 0;
}

/* Accepts PTX text naming at least one of coli's kernels in a `.entry NAME(` line and holding
 * the formats' tables the twins read. */
API CUresult cuModuleLoadDataEx(void **mod, const void *image, unsigned n, int *opts, void **vals)
{
    NEED_CONTEXT();
    const char *ptx = image;
    struct module *m = calloc(1, sizeof *m);
    int found = 0;
    read_failures();
    for (int k = 0; k < N_KERNELS; k++) {
        char pat[80];
        snprintf(pat, sizeof pat, ".entry %s(", kernels[k].name);
        found += m->has[k] = strstr(ptx, pat) != NULL;
        if (m->has[k] && ptx_params(ptx, kernels[k].name, &funcs[k])) found = 0;
    }
    for (unsigned i = 0; i < n; i++) /* option 5: the error log buffer, 6 its size */
        if (opts[i] == 5 && fail_module) snprintf(vals[i], 64, "ptxas fatal : fake JIT refuses (error %d)", fail_module);
    if (ptx_table(ptx, "iq4nl_values", iq4nl_values, 16) || ptx_table(ptx, "mxfp4_values", mxfp4_values, 16) ||
        ptx_table(ptx, "iq3xxs_keys", iq3xxs_keys, 512) || ptx_table(ptx, "iq3_levels", iq3_levels, 8) ||
        ptx_table(ptx, "iq3s_keys", iq3s_keys, 1024))
        found = 0;
    if (fail_module || !found) {
        free(m);
        return fail_module ? fail_module : 218;
    }
    *mod = m;
    return 0;
}
API CUresult cuModuleUnload(void *mod) { free(mod); return 0; }
API CUresult cuModuleGetFunction(void **f, void *mod, const char *name)
{
    struct module *m = mod;
    for (int k = 0; k < N_KERNELS; k++)
        if (m->has[k] && !strcmp(name, kernels[k].name)) {
            funcs[k].k = k;
            *f = &funcs[k];
            return 0;
        }
    return 500;
}

/* The weight bytes launch P of kernel K reads: a matvec's matrix, a batch's experts. */
static double launch_bytes(int k, void **p, unsigned gy)
{
    if (kernels[k].run == run_matvec) return (double)ARG(5, int) * (double)ARG(1, uint64_t);
    if (kernels[k].run == run_gate_up) return 2.0 * gy * ARG(5, int) * (double)ARG(4, uint64_t);
    if (kernels[k].run == run_down) return (double)gy * ARG(5, int) * (double)ARG(4, uint64_t);
    return 0;
}

/* Events read the current device's simulated clock. An event recorded on a stream (an upload
 * in the background) answers "not ready" (600) to its first FAKE_CUDA_BUSY queries (default 2),
 * so that coli's switch-over when a copy has arrived is exercised. */
struct event { double ns; int queries; };
API CUresult cuEventCreate(void **e, unsigned flags) { NEED_CONTEXT(); (void)flags; *e = calloc(1, sizeof(struct event)); return *e ? 0 : 2; }
API CUresult cuEventRecord(void *e, void *stream)
{
    NEED_CONTEXT();
    struct event *ev = e;
    ev->ns = clock_ns[cur_dev];
    ev->queries = stream ? env_int("FAKE_CUDA_BUSY", 2) : 0;
    return 0;
}
/* Busy (600) for FAKE_CUDA_BUSY queries; query:N makes the Nth and later report the work
 * behind the event failed (700, an illegal address), as a device that fails mid-copy. */
API CUresult cuEventQuery(void *e)
{
    struct event *ev = e;
    read_failures();
    if (fail_query && ++n_query >= fail_query) return 700;
    return ev->queries-- > 0 ? 600 : 0;
}
API CUresult cuStreamCreate(void **st, unsigned flags) { NEED_CONTEXT(); static int stream; (void)flags; *st = &stream; return 0; }
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, void *st) { (void)st; return cuMemcpyHtoD_v2(d, s, n); }
API CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) { NEED_CONTEXT(); (void)flags; *p = malloc(n); return *p ? 0 : 2; }
API CUresult cuMemFreeHost(void *p) { free(p); return 0; }
/* Mapped host memory: the device's address of it is the host's, as with unified addressing. */
API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *dp, void *p, unsigned flags) { NEED_CONTEXT(); (void)flags; *dp = (CUdeviceptr)(uintptr_t)p; return 0; }
/* Launches have run when they return: the stream is idle (0), or its work failed (700) as an
 * event's query says (FAKE_CUDA_FAIL=query:K). */
API CUresult cuStreamQuery(void *st)
{
    (void)st;
    NEED_CONTEXT();
    read_failures();
    return fail_query && ++n_query >= fail_query ? 700 : 0;
}
API CUresult cuEventSynchronize(void *e) { (void)e; return 0; }
API CUresult cuEventElapsedTime(float *ms, void *a, void *b)
{
    *ms = (float)((((struct event *)b)->ns - ((struct event *)a)->ns) / 1e6);
    return 0;
}
API CUresult cuEventDestroy_v2(void *e) { free(e); return 0; }

#ifdef FAKE_SIM
int kernels_sim_launch(const char *name, unsigned gx, unsigned gy, unsigned bx, void **params);
#endif

/* Runs the kernel's twin (or with FAKE_SIM, kernels.cu's source) over what the grid covers: gx blocks of bx threads (bx / 32 warps)
 * along x, gy along y; the device's clock advances by its launch time and its weight bytes at
 * its speed. */
static CUresult run_kernel(int k, unsigned gx, unsigned gy, unsigned bx, void **p)
{
    n_launch++;
    read_failures();
    if (fail_launch && n_launch >= fail_launch) return 719;
#ifdef FAKE_SIM
    if (kernels_sim_launch(kernels[k].name, gx, gy, bx, p)) return 500;
#else
    kernels[k].run(kernels[k].arg, p, (struct grid){(long)gx * (bx / 32), (long)gx * bx, gy});
#endif
    clock_ns[cur_dev] += launch_ns[cur_dev] + launch_bytes(k, p, gy) / gbps[cur_dev];
    return 0;
}

API CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                            unsigned shared, void *stream, void **p, void **extra)
{
    (void)stream;
    NEED_CONTEXT();
    if (gz != 1 || by != 1 || bz != 1 || shared || extra) return 1; /* coli launches none such */
    return run_kernel(((struct func *)f)->k, gx, gy, bx, p);
}

/* ---- graphs: kernel nodes, each after the one before (the only shape coli builds) ----
 * A node keeps its parameters' values, copied when it is added as the driver does, so a graph
 * launched later runs what was added whatever the caller's variables hold by then. */
struct kernel_node_params { /* CUDA_KERNEL_NODE_PARAMS_v1 */
    void *func;
    unsigned gx, gy, gz, bx, by, bz, shared;
    void **params, **extra;
};
struct node { int k; unsigned gx, gy, bx; uint64_t v[16]; };
struct graph { struct node *nodes; int n, dev; };

API CUresult cuGraphCreate(void **g, unsigned flags)
{
    NEED_CONTEXT();
    *g = flags ? NULL : calloc(1, sizeof(struct graph));
    return *g ? 0 : 1;
}

/* A node's handle is its number from 1; a node must come after the graph's last one. */
API CUresult cuGraphAddKernelNode(void **node, void *graph, void *const *deps, size_t n_deps, const struct kernel_node_params *kp)
{
    struct graph *g = graph;
    NEED_CONTEXT();
    if (n_deps != (g->n > 0) || (n_deps && deps[0] != (void *)(uintptr_t)g->n)) return 1;
    if (kp->gz != 1 || kp->by != 1 || kp->bz != 1 || kp->shared || kp->extra) return 1;
    struct node *grown = realloc(g->nodes, (size_t)(g->n + 1) * sizeof *g->nodes);
    if (!grown) return 2;
    g->nodes = grown;
    const struct func *f = kp->func;
    struct node *nd = &g->nodes[g->n++];
    *nd = (struct node){f->k, kp->gx, kp->gy, kp->bx, {0}};
    for (int i = 0; i < f->n_params; i++) memcpy(&nd->v[i], kp->params[i], f->wide[i] ? 8 : 4);
    *node = (void *)(uintptr_t)g->n;
    return 0;
}

API CUresult cuGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long flags)
{
    const struct graph *g = graph;
    NEED_CONTEXT();
    read_failures();
    if (fail_graph && ++n_graph >= fail_graph) return 2;
    struct graph *e = calloc(1, sizeof *e);
    if (flags || !e || !(e->nodes = malloc((size_t)(g->n ? g->n : 1) * sizeof *g->nodes))) {
        free(e);
        return flags ? 1 : 2;
    }
    memcpy(e->nodes, g->nodes, (size_t)g->n * sizeof *g->nodes);
    e->n = g->n;
    e->dev = cur_dev;
    *exec = e;
    return 0;
}

/* Runs the nodes in order, each as cuLaunchKernel would; in the context it was built in only. */
API CUresult cuGraphLaunch(void *exec, void *stream)
{
    const struct graph *e = exec;
    (void)stream;
    NEED_CONTEXT();
    if (e->dev != cur_dev) return 400;
    for (int i = 0; i < e->n; i++) {
        struct node *nd = &e->nodes[i];
        void *p[16];
        for (int j = 0; j < 16; j++) p[j] = &nd->v[j];
        CUresult r = run_kernel(nd->k, nd->gx, nd->gy, nd->bx, p);
        if (r) return r;
    }
    return 0;
}

static void graph_free(void *graph)
{
    struct graph *g = graph;
    free(g->nodes);
    free(g);
}
API CUresult cuGraphDestroy(void *g) { graph_free(g); return 0; }
API CUresult cuGraphExecDestroy(void *e) { graph_free(e); return 0; }
