// coli's GPU kernels: the source of kernels.ptx (coli.c §5 embeds the PTX, not this file).
// build.sh regenerates kernels.ptx from here only when nvcc is present, then lowers its header
// to the lowest ISA the instructions allow (.version 6.0, .target sm_52: shfl.sync is PTX 6.0),
// so that drivers of recent years JIT it for every card from Maxwell on. Builds need no CUDA
// toolkit: the committed kernels.ptx is what is embedded.
//
// Bit-identical to the CPU (coli.c §3): every product follows the canonical order. Unit u of a
// row (an element for F32/F16/BF16, a 32-block for Q8_0..Q5_1, a 256-super-block for K formats)
// is added into lane u % 32's partial, in increasing u; then the butterfly s = 16, 8, 4, 2, 1,
// p[i] = p[i] + p[i + s], is shfl.down. Integer parts are exact, and each unit's float combine
// is the CPU's expression, operation for operation. nvcc runs with -fmad=false so that no
// multiply-add is fused (the CPU is built with -ffp-contract=off); fp16 -> f32 is exact.
//
// Every GEMV kernel has one signature: matvec_<type>(w, row_bytes, act, act_stride, y, rows,
// cols, n): y[j*rows + r] = W[r] . act_j for j < n, with act_j at act + j*act_stride in the
// layout of quant_act_prepare (coli.c §3). One warp per row, 4 warps per block.

#include <stdint.h>

#define NPART 32

__device__ __forceinline__ float f16(const uint8_t *p) {
    unsigned short h = (unsigned short)(p[0] | (p[1] << 8));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float bf16(const uint8_t *p) {
    return __uint_as_float((unsigned)(p[0] | (p[1] << 8)) << 16);
}

// acc + a*b as an opaque mad.lo.s32: NVVM would otherwise fuse byte products into dp4a/dp2a,
// which need sm_61, and the point of this file is to stay JIT-able on sm_52.
__device__ __forceinline__ int imad(int a, int b, int acc) {
    asm("mad.lo.s32 %0, %1, %2, %0;" : "+r"(acc) : "r"(a), "r"(b));
    return acc;
}

__device__ __forceinline__ float reduce32(float p) {
    for (int s = NPART / 2; s > 0; s /= 2) p = __fadd_rn(p, __shfl_down_sync(0xffffffffu, p, s));
    return p;
}

// ---- float weights: unit = element, x already rounded as the weights (quant_act_prepare) ----
template <int T>
__device__ __forceinline__ float fweight(const uint8_t *w, int64_t i) {
    if (T == 0) return __uint_as_float(*(const unsigned *)(w + 4 * i));
    if (T == 1) return f16(w + 2 * i);
    return bf16(w + 2 * i);
}

// ---- legacy 32-blocks: act = qs[n] int8 | d[n/32] f32 | s[n/32] i32 | sd[n/32] f32 ----
// T: 8 Q8_0, 40 Q4_0, 41 Q4_1, 50 Q5_0, 51 Q5_1
template <int T>
__device__ __forceinline__ float legacy_unit(const uint8_t *blk, const int8_t *qx, float dx, float sd) {
    const int has_min = T == 41 || T == 51, five = T == 50 || T == 51;
    float dw = f16(blk), mw = has_min ? f16(blk + 2) : 0.0f;
    int isum = 0;
    if (T == 8) {
        for (int j = 0; j < 32; j++) isum = imad((int8_t)blk[2 + j], qx[j], isum);
    } else {
        unsigned qh = 0;
        const uint8_t *qh_p = blk + 2 + 2 * has_min;
        if (five) qh = qh_p[0] | (qh_p[1] << 8) | (qh_p[2] << 16) | ((unsigned)qh_p[3] << 24);
        const uint8_t *qs = blk + 2 + 2 * has_min + 4 * five;
        const int off = has_min ? 0 : (five ? 16 : 8);
        for (int j = 0; j < 16; j++) {
            int x0 = qs[j] & 0x0f, x1 = qs[j] >> 4;
            if (five) {
                x0 |= (int)(((qh >> j) << 4) & 0x10);
                x1 |= (int)((qh >> (j + 12)) & 0x10);
            }
            isum = imad(x1 - off, qx[j + 16], imad(x0 - off, qx[j], isum));
        }
    }
    float r = __fmul_rn(__fmul_rn(dw, dx), (float)isum);
    return has_min ? __fadd_rn(r, __fmul_rn(mw, sd)) : r;
}

// ---- K super-blocks: act = qs[n] int8 | d[n/256] f32 | bsums[n/16] i16 ----
__device__ __forceinline__ void k4_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// T: 4 Q4_K, 5 Q5_K
template <int T>
__device__ __forceinline__ float q45k_unit(const uint8_t *b, const int8_t *qx, const int16_t *bs, float dx) {
    const int five = T == 5;
    const uint8_t *qh = b + 16, *ql = b + 16 + (five ? 32 : 0);
    int summ = 0, sumi = 0;
    for (int j = 0; j < 4; j++) {
        int sc0, m0, sc1, m1, s0 = 0, s1 = 0;
        k4_scale_min(2 * j, b + 4, &sc0, &m0);
        k4_scale_min(2 * j + 1, b + 4, &sc1, &m1);
        summ += m0 * (bs[4 * j] + bs[4 * j + 1]) + m1 * (bs[4 * j + 2] + bs[4 * j + 3]);
        for (int l = 0; l < 32; l++) {
            int q0 = ql[32 * j + l] & 0xF, q1 = ql[32 * j + l] >> 4;
            if (five) {
                q0 |= ((qh[l] >> (2 * j)) & 1) << 4;
                q1 |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
            }
            s0 = imad(q0, qx[64 * j + l], s0);
            s1 = imad(q1, qx[64 * j + 32 + l], s1);
        }
        sumi += sc0 * s0 + sc1 * s1;
    }
    float d = f16(b), dmin = f16(b + 2);
    return __fsub_rn(__fmul_rn(__fmul_rn(d, dx), (float)sumi), __fmul_rn(__fmul_rn(dmin, dx), (float)summ));
}

__device__ __forceinline__ float q6k_unit(const uint8_t *b, const int8_t *qx, float dx) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    int sumi = 0;
    for (int n = 0; n < 2; n++) {
        for (int g = 0; g < 8; g++) {       // 16-element groups of this 128-half: sc[8n + g]
            int s = 0;
            for (int k = 0; k < 16; k++) {
                int l = (g & 1) * 16 + k, quarter = g >> 1; // element 32*quarter + l of the half
                int lo = quarter & 1 ? ql[64 * n + l + 32] : ql[64 * n + l];
                int q = ((quarter < 2 ? lo & 0xF : lo >> 4) | (((qh[32 * n + l] >> (2 * quarter)) & 3) << 4)) - 32;
                s = imad(q, qx[128 * n + 32 * quarter + l], s);
            }
            sumi += sc[8 * n + 2 * (g >> 1) + (g & 1)] * s;
        }
    }
    return __fmul_rn(__fmul_rn(f16(b + 208), dx), (float)sumi);
}

#define MATVEC_PARAMS const uint8_t *__restrict__ w, uint64_t row_bytes, const uint8_t *__restrict__ act, \
                      uint64_t act_stride, float *__restrict__ y, int rows, int cols, int n

#define ROW_SETUP \
    const int lane = threadIdx.x & 31, r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); \
    if (r >= rows) return; \
    const uint8_t *wr = w + (uint64_t)r * row_bytes;

template <int T>
__device__ __forceinline__ void matvec_float(MATVEC_PARAMS) {
    ROW_SETUP
    for (int j = 0; j < n; j++) {
        const float *x = (const float *)(act + (uint64_t)j * act_stride);
        float p = 0.0f;
        for (int i = lane; i < cols; i += 32) p = __fadd_rn(p, __fmul_rn(fweight<T>(wr, i), x[i]));
        p = reduce32(p);
        if (lane == 0) y[(uint64_t)j * rows + r] = p;
    }
}

template <int T, int BB>
__device__ __forceinline__ void matvec_legacy(MATVEC_PARAMS) {
    ROW_SETUP
    const int nb = cols / 32;
    for (int j = 0; j < n; j++) {
        const uint8_t *a = act + (uint64_t)j * act_stride;
        const int8_t *qs = (const int8_t *)a;
        const float *d = (const float *)(a + cols), *sd = (const float *)(a + cols + 8 * nb);
        float p = 0.0f;
        for (int b = lane; b < nb; b += 32) p = __fadd_rn(p, legacy_unit<T>(wr + b * BB, qs + 32 * b, d[b], sd[b]));
        p = reduce32(p);
        if (lane == 0) y[(uint64_t)j * rows + r] = p;
    }
}

template <int T, int BB>
__device__ __forceinline__ void matvec_k(MATVEC_PARAMS) {
    ROW_SETUP
    const int nb = cols / 256;
    for (int j = 0; j < n; j++) {
        const uint8_t *a = act + (uint64_t)j * act_stride;
        const int8_t *qs = (const int8_t *)a;
        const float *d = (const float *)(a + cols);
        const int16_t *bs = (const int16_t *)(a + cols + 4 * nb);
        float p = 0.0f;
        for (int b = lane; b < nb; b += 32) {
            float u = T == 6 ? q6k_unit(wr + b * BB, qs + 256 * b, d[b])
                             : q45k_unit<T>(wr + b * BB, qs + 256 * b, bs + 16 * b, d[b]);
            p = __fadd_rn(p, u);
        }
        p = reduce32(p);
        if (lane == 0) y[(uint64_t)j * rows + r] = p;
    }
}

extern "C" __global__ void matvec_f32(MATVEC_PARAMS) { matvec_float<0>(w, row_bytes, act, act_stride, y, rows, cols, n); }
extern "C" __global__ void matvec_f16(MATVEC_PARAMS) { matvec_float<1>(w, row_bytes, act, act_stride, y, rows, cols, n); }
extern "C" __global__ void matvec_bf16(MATVEC_PARAMS) { matvec_float<2>(w, row_bytes, act, act_stride, y, rows, cols, n); }
extern "C" __global__ void matvec_q8_0(MATVEC_PARAMS) { matvec_legacy<8, 34>(w, row_bytes, act, act_stride, y, rows, cols, n); }
extern "C" __global__ void matvec_q4_0(MATVEC_PARAMS) { matvec_legacy<40, 18>(w, row_bytes, act, act_stride, y, rows, cols, n); }
extern "C" __global__ void matvec_q4_1(MATVEC_PARAMS) { matvec_legacy<41, 20>(w, row_bytes, act, act_stride, y, rows, cols, n); }
extern "C" __global__ void matvec_q5_0(MATVEC_PARAMS) { matvec_legacy<50, 22>(w, row_bytes, act, act_stride, y, rows, cols, n); }
extern "C" __global__ void matvec_q5_1(MATVEC_PARAMS) { matvec_legacy<51, 24>(w, row_bytes, act, act_stride, y, rows, cols, n); }
extern "C" __global__ void matvec_q4_k(MATVEC_PARAMS) { matvec_k<4, 144>(w, row_bytes, act, act_stride, y, rows, cols, n); }
extern "C" __global__ void matvec_q5_k(MATVEC_PARAMS) { matvec_k<5, 176>(w, row_bytes, act, act_stride, y, rows, cols, n); }
extern "C" __global__ void matvec_q6_k(MATVEC_PARAMS) { matvec_k<6, 210>(w, row_bytes, act, act_stride, y, rows, cols, n); }
