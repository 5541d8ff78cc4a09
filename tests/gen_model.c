/* gen_model.c — writes a qwen35moe GGUF with random weights of any geometry, for benchmarks
 * and tests of coli (test-side code; coli never writes GGUF).
 *
 * Build: gcc -std=c11 -O2 -march=native -fopenmp -ffp-contract=off -I. tests/gen_model.c -o build/gen_model -lm
 * Use:   build/gen_model OUT.gguf [--preset 35b-a3b|tiny] [--layers N] [--experts-type Q4_0]
 *            [--type Q8_0] [--seed S] [--vocab N] [--check] ...      (build/gen_model --help)
 *        build/gen_model --selftest
 *
 * Geometry and names follow qwen35-arch.md §9.2/§9.3 and the golden q35moe files: every 4th
 * layer (full_attention_interval) is gated attention, the others Gated DeltaNet; every layer
 * is a routed MoE with a shared expert. Routed experts are written in --experts-type, every
 * other matrix in --type; norms, ssm_a, ssm_dt.bias, ssm_conv1d and the routers
 * (ffn_gate_inp, ffn_gate_inp_shexp) stay F32.
 *
 * Values are deterministic from --seed and independent of the thread count: each row of each
 * tensor has its own splitmix64 stream. Normal samples are the sum of four 16-bit uniforms
 * scaled to unit variance (Irwin-Hall, bounded at ±3.46σ): one 64-bit draw per value,
 * about 5x cheaper than Box-Muller, which matters at 35 G values. Matrices N(0, 0.02²),
 * routers N(0, 0.08²), ssm_conv1d N(0, 0.1²), norms 1 + N(0, 0.02²),
 * ssm_a = -exp(u), u ~ U(log 0.05, log 2); ssm_dt.bias = log(expm1(dt)), log dt ~ U(log 1e-3, log 1e-1).
 *
 * The file is streamed tensor by tensor, in chunks of rows quantised in parallel (OpenMP),
 * so memory stays bounded (~64 MiB of chunk plus the tokenizer) whatever the model size. */
#ifndef GEN_MODEL_NO_MAIN
#define COLI_NO_MAIN
#include "../coli.c"
#endif
#include "gguf_writer.h"
#include <sys/wait.h>

/* ---- random numbers ---- */

static uint64_t gen_mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The stream of row ROW of tensor TENSOR under SEED. */
static uint64_t gen_stream(uint64_t seed, uint64_t tensor, uint64_t row)
{
    return gen_mix(gen_mix(seed) ^ gen_mix((tensor << 40) ^ row ^ 0x5bd1e995ull));
}

/* Uniform in [0, 1). */
static double gen_uniform(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ull;
    return (double)(gen_mix(*s) >> 11) * 0x1p-53;
}

/* N values of MEAN + SD * (approximately) N(0, 1) from stream S. */
static void gen_normal_row(uint64_t s, float *x, int64_t n, float mean, float sd)
{
    const float k = sd * 1.7320508f / 65536.0f; /* unit variance: a 16-bit uniform has variance 2^32/12 */
    for (int64_t i = 0; i < n; i++) {
        s += 0x9e3779b97f4a7c15ull;
        uint64_t z = s;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        int32_t sum = (int32_t)(z & 0xffff) + (int32_t)((z >> 16) & 0xffff) + (int32_t)((z >> 32) & 0xffff) + (int32_t)(z >> 48);
        x[i] = mean + k * (float)(sum - 131070);
    }
}

/* ---- number formats ---- */

static uint16_t gen_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7fffffff;
    if (ax > 0x7f800000) return sign | 0x7e00;        /* NaN */
    if (ax >= 0x477ff000) return sign | 0x7c00;       /* rounds to infinity (>= 65520) */
    if (ax < 0x38800000) {                            /* below 2^-14: a subnormal half */
        float v;
        memcpy(&v, &ax, 4);
        return sign | (uint16_t)lrintf(v * 16777216.0f); /* units of 2^-24, nearest even */
    }
    ax += 0xc8000fffu + ((ax >> 13) & 1);             /* rebias 127 -> 15, round to nearest even */
    return sign | (uint16_t)(ax >> 13);
}

static float gen_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, x;
    if (e == 0) {
        float v = (float)m * 0x1p-24f;
        return (h & 0x8000) ? -v : v;
    }
    x = e == 31 ? sign | 0x7f800000 | (m << 13) : sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static uint16_t gen_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 64); /* quiet NaN */
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

static float gen_bf16_to_f32(uint16_t h)
{
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

/* Q8_0: 32 values as fp16 d then int8 q, x = d q (ggml's block_q8_0). */
static void gen_quant_q8_0(const float *x, uint8_t *out)
{
    float amax = 0;
    for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    float d = amax / 127.0f, id = d > 0 ? 1.0f / d : 0.0f;
    uint16_t h = gen_f16(d);
    memcpy(out, &h, 2);
    for (int i = 0; i < 32; i++) out[2 + i] = (uint8_t)(int8_t)lrintf(x[i] * id);
}

/* Q4_0: fp16 d then 16 bytes; value j in the low nibble of byte j, value j+16 in the high
 * nibble; x = d (q - 8), d = (the value of largest magnitude) / -8 (ggml's block_q4_0). */
static void gen_quant_q4_0(const float *x, uint8_t *out)
{
    float amax = 0, max = 0;
    for (int i = 0; i < 32; i++)
        if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }
    float d = max / -8.0f, id = d != 0 ? 1.0f / d : 0.0f;
    uint16_t h = gen_f16(d);
    memcpy(out, &h, 2);
    for (int j = 0; j < 16; j++) {
        int a = (int)(x[j] * id + 8.5f), b = (int)(x[j + 16] * id + 8.5f);
        a = a > 15 ? 15 : a < 0 ? 0 : a;
        b = b > 15 ? 15 : b < 0 ? 0 : b;
        out[2 + j] = (uint8_t)(a | b << 4);
    }
}

/* The K formats' min/max step per group: for each of N groups of SIZE values at X, the step
 * SC[g] = (max - min) / LEVELS and the offset MN[g] = -min (min taken with 0, so that zero is
 * a level); *MAX_SC and *MAX_MN their largest. */
static void gen_group_steps(const float *x, int n, int size, float levels, float *sc, float *mn, float *max_sc, float *max_mn)
{
    *max_sc = *max_mn = 0;
    for (int g = 0; g < n; g++) {
        float lo = 0, hi = x[size * g];
        for (int i = 0; i < size; i++) {
            float v = x[size * g + i];
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        sc[g] = hi > lo ? (hi - lo) / levels : 0.0f;
        mn[g] = -lo;
        *max_sc = sc[g] > *max_sc ? sc[g] : *max_sc;
        *max_mn = mn[g] > *max_mn ? mn[g] : *max_mn;
    }
}

/* The absmax step per group: SC[g] = max |x| / LEVELS for each of 16 groups of 16 values at X;
 * returns the largest. */
static float gen_group_absmax(const float *x, float levels, float *sc)
{
    float max_sc = 0;
    for (int g = 0; g < 16; g++) {
        float amax = 0;
        for (int i = 0; i < 16; i++) amax = fabsf(x[16 * g + i]) > amax ? fabsf(x[16 * g + i]) : amax;
        sc[g] = amax / levels;
        max_sc = sc[g] > max_sc ? sc[g] : max_sc;
    }
    return max_sc;
}

/* Q2_K: 256 values as 16 bytes of (scale, min) nibbles, 64 bytes of 2-bit quants, fp16 d, fp16
 * dmin; group g (16 values) is x = d sc_g q - dmin m_g, q in 0..3. Value 128h + 32k + l keeps
 * its quant in bits 2k of byte 32h + l, as ggml's dequantize_row_q2_K reads it. A plain min/max
 * quantiser per group. */
static void gen_quant_q2_k(const float *x, uint8_t *out)
{
    float sc[16], mn[16], max_sc, max_mn;
    gen_group_steps(x, 16, 16, 3.0f, sc, mn, &max_sc, &max_mn);
    uint16_t hd = gen_f16(max_sc / 15.0f), hm = gen_f16(max_mn / 15.0f);
    float d = gen_f16_to_f32(hd), dmin = gen_f16_to_f32(hm);
    memset(out + 16, 0, 64);
    for (int g = 0; g < 16; g++) {
        long a = d > 0 ? lrintf(sc[g] / d) : 0, b = dmin > 0 ? lrintf(mn[g] / dmin) : 0;
        const int ls = (int)(a > 15 ? 15 : a), lm = (int)(b > 15 ? 15 : b);
        out[g] = (uint8_t)(ls | lm << 4);
        const float step = d * (float)ls, off = dmin * (float)lm;
        for (int i = 0; i < 16; i++) {
            const int e = 16 * g + i, h = e / 128, k = e % 128 / 32, l = e % 32;
            long v = step > 0 ? lrintf((x[e] + off) / step) : 0;
            out[16 + 32 * h + l] |= (uint8_t)((v < 0 ? 0 : v > 3 ? 3 : v) << 2 * k);
        }
    }
    memcpy(out + 80, &hd, 2);
    memcpy(out + 82, &hm, 2);
}

/* Q3_K: 256 values as 32 bytes of high bits (hmask), 64 of low 2-bit pairs, 12 bytes of sixteen
 * 6-bit scales (stored plus 32), fp16 d; group g (16 values) is x = d (s_g - 32) q, q in -4..3.
 * Value 128h + 32k + l keeps q + 4 in bits 2k of byte 32 + 32h + l (low two) and bit 4h + k of
 * hmask byte l (the third), as ggml's dequantize_row_q3_K reads them; scale i keeps its low
 * nibble in byte i % 8 (the high nibble of it for i >= 8) and its top 2 bits at bits 2 (i / 4)
 * of byte 104 + i % 4. A plain absmax quantiser per group. */
static void gen_quant_q3_k(const float *x, uint8_t *out)
{
    float sc[16], max_sc = gen_group_absmax(x, 4.0f, sc);
    uint16_t hd = gen_f16(max_sc / 31.0f);
    float d = gen_f16_to_f32(hd);
    memset(out, 0, 108);
    for (int g = 0; g < 16; g++) {
        long a = d > 0 ? lrintf(sc[g] / d) : 0;
        const int ls = (int)(a > 31 ? 31 : a), s = ls + 32;
        out[96 + g % 8] |= (uint8_t)((s & 15) << (g >= 8 ? 4 : 0));
        out[104 + g % 4] |= (uint8_t)((s >> 4) << 2 * (g / 4));
        const float step = d * (float)ls;
        for (int i = 0; i < 16; i++) {
            const int e = 16 * g + i, h = e / 128, k = e % 128 / 32, l = e % 32;
            long v = step > 0 ? lrintf(x[e] / step) : 0;
            const int q = (int)(v < -4 ? -4 : v > 3 ? 3 : v) + 4;
            out[32 + 32 * h + l] |= (uint8_t)((q & 3) << 2 * k);
            out[l] |= (uint8_t)((q >> 2) << (4 * h + k));
        }
    }
    memcpy(out + 108, &hd, 2);
}

/* Q4_K: 256 values as fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128
 * bytes of nibbles; sub-block j (32 values) is x = d sc_j q - dmin m_j, q in 0..15. Scales
 * and mins are packed as ggml's get_scale_min_k4 unpacks them; nibbles of sub-blocks 2c and
 * 2c+1 share bytes 32c..32c+31 (low, high). A plain min/max quantiser per sub-block. */
static void gen_quant_q4_k(const float *x, uint8_t *out)
{
    float sc[8], mn[8], max_sc, max_mn;
    gen_group_steps(x, 8, 32, 15.0f, sc, mn, &max_sc, &max_mn);
    uint16_t hd = gen_f16(max_sc / 63.0f), hm = gen_f16(max_mn / 63.0f);
    float d = gen_f16_to_f32(hd), dmin = gen_f16_to_f32(hm);
    uint8_t ls[8], lm[8];
    for (int j = 0; j < 8; j++) {
        long a = d > 0 ? lrintf(sc[j] / d) : 0, b = dmin > 0 ? lrintf(mn[j] / dmin) : 0;
        ls[j] = (uint8_t)(a > 63 ? 63 : a);
        lm[j] = (uint8_t)(b > 63 ? 63 : b);
    }
    memcpy(out, &hd, 2);
    memcpy(out + 2, &hm, 2);
    uint8_t *s = out + 4, *q = out + 16;
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)((ls[j] & 63) | ((ls[j + 4] >> 4) << 6));
        s[j + 4] = (uint8_t)((lm[j] & 63) | ((lm[j + 4] >> 4) << 6));
        s[j + 8] = (uint8_t)((ls[j + 4] & 15) | ((lm[j + 4] & 15) << 4));
    }
    uint8_t L[256];
    for (int j = 0; j < 8; j++) {
        float step = d * ls[j], off = dmin * lm[j];
        for (int i = 0; i < 32; i++) {
            long v = step > 0 ? lrintf((x[32 * j + i] + off) / step) : 0;
            L[32 * j + i] = (uint8_t)(v < 0 ? 0 : v > 15 ? 15 : v);
        }
    }
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) q[32 * c + l] = (uint8_t)(L[64 * c + l] | L[64 * c + 32 + l] << 4);
}

/* Q6_K: 256 values as 128 bytes of low nibbles (ql), 64 of high 2-bit pairs (qh), 16 int8
 * scales, fp16 d; group g (16 values) is x = d sc_g (q - 32), q in 0..63. In each half h
 * (128 values), value 128h + 32k + l keeps its low nibble in ql byte 64h + 32 (k % 2) + l (the
 * high nibble for k >= 2) and its high 2 bits in bits 2k of qh byte 32h + l, as ggml's
 * dequantize_row_q6_K reads them. A plain absmax quantiser per group. */
static void gen_quant_q6_k(const float *x, uint8_t *out)
{
    float sc[16], max_sc = gen_group_absmax(x, 31.0f, sc);
    uint16_t hd = gen_f16(max_sc / 127.0f);
    float d = gen_f16_to_f32(hd);
    uint8_t q[256];
    for (int g = 0; g < 16; g++) {
        long ls = d > 0 ? lrintf(sc[g] / d) : 0;
        out[192 + g] = (uint8_t)(int8_t)(ls > 127 ? 127 : ls);
        float step = d * (float)(int8_t)out[192 + g];
        for (int i = 0; i < 16; i++) {
            long v = step > 0 ? lrintf(x[16 * g + i] / step) : 0;
            q[16 * g + i] = (uint8_t)((v < -32 ? -32 : v > 31 ? 31 : v) + 32);
        }
    }
    memset(out, 0, 192);
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < 32; l++) {
                int v = q[128 * h + 32 * k + l];
                out[64 * h + 32 * (k % 2) + l] |= (uint8_t)((v & 15) << (k >= 2 ? 4 : 0));
                out[128 + 32 * h + l] |= (uint8_t)((v >> 4) << 2 * k);
            }
    memcpy(out + 208, &hd, 2);
}

/* Writes row X of N values (N a multiple of the block) as TYPE into OUT. */
static void gen_quant_row(int type, const float *x, int64_t n, uint8_t *out)
{
    switch (type) {
    case GW_TYPE_F32: memcpy(out, x, (size_t)n * 4); break;
    case GW_TYPE_F16: for (int64_t i = 0; i < n; i++) { uint16_t h = gen_f16(x[i]); memcpy(out + 2 * i, &h, 2); } break;
    case GW_TYPE_BF16: for (int64_t i = 0; i < n; i++) { uint16_t h = gen_bf16(x[i]); memcpy(out + 2 * i, &h, 2); } break;
    case GW_TYPE_Q8_0: for (int64_t b = 0; b < n / 32; b++) gen_quant_q8_0(x + 32 * b, out + 34 * b); break;
    case GW_TYPE_Q4_0: for (int64_t b = 0; b < n / 32; b++) gen_quant_q4_0(x + 32 * b, out + 18 * b); break;
    case GW_TYPE_Q2_K: for (int64_t b = 0; b < n / 256; b++) gen_quant_q2_k(x + 256 * b, out + 84 * b); break;
    case GW_TYPE_Q3_K: for (int64_t b = 0; b < n / 256; b++) gen_quant_q3_k(x + 256 * b, out + 110 * b); break;
    case GW_TYPE_Q4_K: for (int64_t b = 0; b < n / 256; b++) gen_quant_q4_k(x + 256 * b, out + 144 * b); break;
    case GW_TYPE_Q6_K: for (int64_t b = 0; b < n / 256; b++) gen_quant_q6_k(x + 256 * b, out + 210 * b); break;
    default: fprintf(stderr, "gen_model: cannot quantise type %d\n", type); exit(1);
    }
}

/* The reference dequantiser for what gen_quant_row writes (ggml's formulas and order). */
static void gen_dequant_row(int type, const uint8_t *p, float *y, int64_t n)
{
    uint16_t h, h2;
    switch (type) {
    case GW_TYPE_F32: memcpy(y, p, (size_t)n * 4); break;
    case GW_TYPE_F16: for (int64_t i = 0; i < n; i++) { memcpy(&h, p + 2 * i, 2); y[i] = gen_f16_to_f32(h); } break;
    case GW_TYPE_BF16: for (int64_t i = 0; i < n; i++) { memcpy(&h, p + 2 * i, 2); y[i] = gen_bf16_to_f32(h); } break;
    case GW_TYPE_Q8_0:
        for (int64_t b = 0; b < n / 32; b++, p += 34) {
            memcpy(&h, p, 2);
            for (int i = 0; i < 32; i++) y[32 * b + i] = (float)(int8_t)p[2 + i] * gen_f16_to_f32(h);
        }
        break;
    case GW_TYPE_Q4_0:
        for (int64_t b = 0; b < n / 32; b++, p += 18) {
            memcpy(&h, p, 2);
            float d = gen_f16_to_f32(h);
            for (int j = 0; j < 16; j++) {
                y[32 * b + j] = (float)((p[2 + j] & 15) - 8) * d;
                y[32 * b + j + 16] = (float)((p[2 + j] >> 4) - 8) * d;
            }
        }
        break;
    case GW_TYPE_Q2_K:
        for (int64_t b = 0; b < n / 256; b++, p += 84) {
            memcpy(&h, p + 80, 2);
            memcpy(&h2, p + 82, 2);
            const float d = gen_f16_to_f32(h), dmin = gen_f16_to_f32(h2);
            for (int e = 0; e < 256; e++) {
                const int sc = p[e / 16], q = p[16 + 32 * (e / 128) + e % 32] >> 2 * (e % 128 / 32) & 3;
                y[256 * b + e] = d * (float)(sc & 15) * (float)q - dmin * (float)(sc >> 4);
            }
        }
        break;
    case GW_TYPE_Q3_K:
        for (int64_t b = 0; b < n / 256; b++, p += 110) {
            memcpy(&h, p + 108, 2);
            const float d = gen_f16_to_f32(h);
            for (int e = 0; e < 256; e++) {
                const int g = e / 16, hh = e / 128, k = e % 128 / 32, l = e % 32;
                const int s = (p[96 + g % 8] >> (g >= 8 ? 4 : 0) & 15) | (p[104 + g % 4] >> 2 * (g / 4) & 3) << 4;
                const int q = (p[32 + 32 * hh + l] >> 2 * k & 3) - (p[l] >> (4 * hh + k) & 1 ? 0 : 4);
                y[256 * b + e] = d * (float)(s - 32) * (float)q;
            }
        }
        break;
    case GW_TYPE_Q4_K:
        for (int64_t b = 0; b < n / 256; b++, p += 144) {
            memcpy(&h, p, 2);
            memcpy(&h2, p + 2, 2);
            float d = gen_f16_to_f32(h), dmin = gen_f16_to_f32(h2);
            const uint8_t *s = p + 4, *q = p + 16;
            float *o = y + 256 * b;
            for (int j = 0; j < 8; j++) {
                int sc, m;
                if (j < 4) { sc = s[j] & 63; m = s[j + 4] & 63; }
                else { sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4); m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
                float d1 = d * (float)sc, m1 = dmin * (float)m;
                const uint8_t *qq = q + 32 * (j / 2);
                for (int l = 0; l < 32; l++) o[32 * j + l] = d1 * (float)((j & 1) ? qq[l] >> 4 : qq[l] & 15) - m1;
            }
        }
        break;
    case GW_TYPE_Q6_K:
        for (int64_t b = 0; b < n / 256; b++, p += 210) {
            memcpy(&h, p + 208, 2);
            float d = gen_f16_to_f32(h);
            for (int half = 0; half < 2; half++)
                for (int l = 0; l < 32; l++) {
                    const uint8_t *ql = p + 64 * half, qh = p[128 + 32 * half + l];
                    const int q[4] = { (ql[l] & 15) | (qh & 3) << 4, (ql[l + 32] & 15) | (qh >> 2 & 3) << 4,
                                       (ql[l] >> 4) | (qh >> 4 & 3) << 4, (ql[l + 32] >> 4) | (qh >> 6 & 3) << 4 };
                    for (int k = 0; k < 4; k++) {
                        const int e = 128 * half + 32 * k + l;
                        y[256 * b + e] = d * (float)(int8_t)p[192 + e / 16] * (float)(q[k] - 32);
                    }
                }
        }
        break;
    default: fprintf(stderr, "gen_model: cannot dequantise type %d\n", type); exit(1);
    }
}

static const struct { const char *name; int type, ftype; } gen_type_names[] = {
    {"F32", GW_TYPE_F32, 0}, {"F16", GW_TYPE_F16, 1}, {"BF16", GW_TYPE_BF16, 32},
    {"Q8_0", GW_TYPE_Q8_0, 7}, {"Q4_0", GW_TYPE_Q4_0, 2}, {"Q2_K", GW_TYPE_Q2_K, 10}, {"Q3_K", GW_TYPE_Q3_K, 12},
    {"Q4_K", GW_TYPE_Q4_K, 15}, {"Q6_K", GW_TYPE_Q6_K, 18},
};

static int gen_type_parse(const char *s)
{
    for (size_t i = 0; i < sizeof gen_type_names / sizeof gen_type_names[0]; i++)
        if (!strcasecmp(s, gen_type_names[i].name)) return gen_type_names[i].type;
    return -1;
}

static const char *gen_type_name(int type)
{
    for (size_t i = 0; i < sizeof gen_type_names / sizeof gen_type_names[0]; i++)
        if (gen_type_names[i].type == type) return gen_type_names[i].name;
    return "?";
}

/* ---- geometry and tensor plan ---- */

struct gen_geom {
    int n_layers, dim, n_expert, n_expert_used, expert_ff, shexp_ff;
    int n_head, n_kv_head, head_dim, rope_dims, attn_interval;
    int ssm_nk, ssm_nv, ssm_d, conv_kernel;
    int n_vocab, ctx;
    float rope_base, eps;
    int type, experts_type;
    uint64_t seed;
};

static void gen_preset_tiny(struct gen_geom *g)
{
    *g = (struct gen_geom){.n_layers = 4, .dim = 64, .n_expert = 8, .n_expert_used = 2, .expert_ff = 32,
        .shexp_ff = 32, .n_head = 4, .n_kv_head = 2, .head_dim = 32, .rope_dims = 8, .attn_interval = 4,
        .ssm_nk = 2, .ssm_nv = 4, .ssm_d = 16, .conv_kernel = 4, .n_vocab = 2112, .ctx = 4096,
        .rope_base = 1e7f, .eps = 1e-6f, .type = GW_TYPE_Q8_0, .experts_type = GW_TYPE_Q4_0, .seed = 1};
}

/* Qwen3.6-35B-A3B (qwen35-arch.md §9.2). */
static void gen_preset_35b(struct gen_geom *g)
{
    *g = (struct gen_geom){.n_layers = 40, .dim = 2048, .n_expert = 256, .n_expert_used = 8, .expert_ff = 512,
        .shexp_ff = 512, .n_head = 16, .n_kv_head = 2, .head_dim = 256, .rope_dims = 64, .attn_interval = 4,
        .ssm_nk = 16, .ssm_nv = 32, .ssm_d = 128, .conv_kernel = 4, .n_vocab = 248320, .ctx = 262144,
        .rope_base = 1e7f, .eps = 1e-6f, .type = GW_TYPE_Q8_0, .experts_type = GW_TYPE_Q4_0, .seed = 1};
}

enum gen_init { GEN_NORMAL, GEN_NORM, GEN_SSM_A, GEN_DT_BIAS };

struct gen_tensor {
    char name[64];
    uint32_t rank;
    uint64_t ne[3]; /* innermost first, as GGUF */
    int type;
    enum gen_init init;
    float sd;
};

struct gen_plan {
    struct gen_tensor *t;
    size_t n, cap;
};

static void gen_add(struct gen_plan *p, const char *name, int layer, int type, enum gen_init init, float sd,
                    uint32_t rank, uint64_t ne0, uint64_t ne1, uint64_t ne2)
{
    if (p->n == p->cap) {
        p->cap = p->cap ? 2 * p->cap : 64;
        p->t = realloc(p->t, p->cap * sizeof *p->t);
        if (!p->t) abort();
    }
    struct gen_tensor *t = &p->t[p->n++];
    if (layer >= 0) snprintf(t->name, sizeof t->name, "blk.%d.%s", layer, name);
    else snprintf(t->name, sizeof t->name, "%s", name);
    t->rank = rank;
    t->ne[0] = ne0;
    t->ne[1] = ne1;
    t->ne[2] = ne2;
    t->type = type;
    t->init = init;
    t->sd = sd;
}

/* Every tensor in file order (as the golden files: embedding, layers, output). */
static void gen_make_plan(const struct gen_geom *g, struct gen_plan *p)
{
    const int F32 = GW_TYPE_F32, W = g->type, X = g->experts_type;
    uint64_t d = (uint64_t)g->dim, hd = (uint64_t)g->head_dim, vdim = (uint64_t)g->ssm_nv * g->ssm_d;
    uint64_t conv_dim = 2 * (uint64_t)g->ssm_nk * g->ssm_d + vdim, nv = (uint64_t)g->ssm_nv;
    uint64_t E = (uint64_t)g->n_expert, eff = (uint64_t)g->expert_ff, sff = (uint64_t)g->shexp_ff;
    memset(p, 0, sizeof *p);
    gen_add(p, "token_embd.weight", -1, W, GEN_NORMAL, 0.02f, 2, d, (uint64_t)g->n_vocab, 0);
    for (int i = 0; i < g->n_layers; i++) {
        gen_add(p, "attn_norm.weight", i, F32, GEN_NORM, 0.02f, 1, d, 0, 0);
        gen_add(p, "post_attention_norm.weight", i, F32, GEN_NORM, 0.02f, 1, d, 0, 0);
        if ((i + 1) % g->attn_interval == 0) {
            gen_add(p, "attn_q.weight", i, W, GEN_NORMAL, 0.02f, 2, d, 2 * (uint64_t)g->n_head * hd, 0);
            gen_add(p, "attn_k.weight", i, W, GEN_NORMAL, 0.02f, 2, d, (uint64_t)g->n_kv_head * hd, 0);
            gen_add(p, "attn_v.weight", i, W, GEN_NORMAL, 0.02f, 2, d, (uint64_t)g->n_kv_head * hd, 0);
            gen_add(p, "attn_output.weight", i, W, GEN_NORMAL, 0.02f, 2, (uint64_t)g->n_head * hd, d, 0);
            gen_add(p, "attn_q_norm.weight", i, F32, GEN_NORM, 0.02f, 1, hd, 0, 0);
            gen_add(p, "attn_k_norm.weight", i, F32, GEN_NORM, 0.02f, 1, hd, 0, 0);
        } else {
            gen_add(p, "attn_qkv.weight", i, W, GEN_NORMAL, 0.02f, 2, d, conv_dim, 0);
            gen_add(p, "attn_gate.weight", i, W, GEN_NORMAL, 0.02f, 2, d, vdim, 0);
            gen_add(p, "ssm_conv1d.weight", i, F32, GEN_NORMAL, 0.1f, 2, (uint64_t)g->conv_kernel, conv_dim, 0);
            gen_add(p, "ssm_dt.bias", i, F32, GEN_DT_BIAS, 0, 1, nv, 0, 0);
            gen_add(p, "ssm_a", i, F32, GEN_SSM_A, 0, 1, nv, 0, 0);
            gen_add(p, "ssm_beta.weight", i, W, GEN_NORMAL, 0.02f, 2, d, nv, 0);
            gen_add(p, "ssm_alpha.weight", i, W, GEN_NORMAL, 0.02f, 2, d, nv, 0);
            gen_add(p, "ssm_norm.weight", i, F32, GEN_NORM, 0.02f, 1, (uint64_t)g->ssm_d, 0, 0);
            gen_add(p, "ssm_out.weight", i, W, GEN_NORMAL, 0.02f, 2, vdim, d, 0);
        }
        gen_add(p, "ffn_gate_inp.weight", i, F32, GEN_NORMAL, 0.08f, 2, d, E, 0);
        gen_add(p, "ffn_gate_exps.weight", i, X, GEN_NORMAL, 0.02f, 3, d, eff, E);
        gen_add(p, "ffn_up_exps.weight", i, X, GEN_NORMAL, 0.02f, 3, d, eff, E);
        gen_add(p, "ffn_down_exps.weight", i, X, GEN_NORMAL, 0.02f, 3, eff, d, E);
        gen_add(p, "ffn_gate_inp_shexp.weight", i, F32, GEN_NORMAL, 0.08f, 2, d, 1, 0);
        gen_add(p, "ffn_gate_shexp.weight", i, W, GEN_NORMAL, 0.02f, 2, d, sff, 0);
        gen_add(p, "ffn_up_shexp.weight", i, W, GEN_NORMAL, 0.02f, 2, d, sff, 0);
        gen_add(p, "ffn_down_shexp.weight", i, W, GEN_NORMAL, 0.02f, 2, sff, d, 0);
    }
    gen_add(p, "output_norm.weight", -1, F32, GEN_NORM, 0.02f, 1, d, 0, 0);
    gen_add(p, "output.weight", -1, W, GEN_NORMAL, 0.02f, 2, d, (uint64_t)g->n_vocab, 0);
}

static uint64_t gen_rows(const struct gen_tensor *t)
{
    uint64_t r = 1;
    for (uint32_t k = 1; k < t->rank; k++) r *= t->ne[k];
    return r;
}

/* Row R of tensor T (index TI in the plan) as floats. */
static void gen_row_values(const struct gen_tensor *t, uint64_t seed, uint64_t ti, uint64_t r, float *x)
{
    int64_t n = (int64_t)t->ne[0];
    uint64_t s = gen_stream(seed, ti, r);
    switch (t->init) {
    case GEN_NORMAL: gen_normal_row(s, x, n, 0.0f, t->sd); break;
    case GEN_NORM: gen_normal_row(s, x, n, 1.0f, t->sd); break;
    case GEN_SSM_A:
        for (int64_t i = 0; i < n; i++) x[i] = (float)-exp(log(0.05) + gen_uniform(&s) * (log(2.0) - log(0.05)));
        break;
    case GEN_DT_BIAS:
        for (int64_t i = 0; i < n; i++) x[i] = (float)log(expm1(exp(log(1e-3) + gen_uniform(&s) * (log(1e-1) - log(1e-3)))));
        break;
    }
}

/* A non-zero message when the geometry cannot be written (a bad size or block mismatch). */
static const char *gen_geom_problem(const struct gen_geom *g, const struct gen_plan *p)
{
    static char msg[160];
    if (g->n_layers < 1 || g->dim < 1 || g->n_expert < 1 || g->n_expert_used < 1 || g->n_expert_used > g->n_expert ||
        g->expert_ff < 1 || g->shexp_ff < 1 || g->n_head < 1 || g->n_kv_head < 1 || g->n_head % g->n_kv_head ||
        g->head_dim < 2 || g->rope_dims < 2 || g->rope_dims > g->head_dim || g->rope_dims % 2 || g->attn_interval < 1 ||
        g->ssm_nk < 1 || g->ssm_nv < 1 || g->ssm_nv % g->ssm_nk || g->ssm_d < 1 || g->conv_kernel < 1 || g->ctx < 1)
        return "inconsistent geometry (sizes must be >= 1, heads must divide, rope dims even and <= head dim)";
    for (size_t i = 0; i < p->n; i++) {
        int e, b;
        gw_type_block(p->t[i].type, &e, &b);
        if (p->t[i].ne[0] % (uint64_t)e) {
            snprintf(msg, sizeof msg, "tensor %s has rows of %llu, not a multiple of the %s block (%d)", p->t[i].name,
                     (unsigned long long)p->t[i].ne[0], gen_type_name(p->t[i].type), e);
            return msg;
        }
    }
    return NULL;
}

/* ---- tokenizer ---- */

struct gen_vocab {
    char **tokens;
    int32_t *types;
    char **merges;
    int n_tokens, n_merges, eos, pad;
};

static int gen_utf8(char *o, unsigned cp)
{
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xc0 | cp >> 6); o[1] = (char)(0x80 | (cp & 63)); return 2; }
    o[0] = (char)(0xe0 | cp >> 12); o[1] = (char)(0x80 | ((cp >> 6) & 63)); o[2] = (char)(0x80 | (cp & 63));
    return 3;
}

static char *gen_strdup(const char *s)
{
    char *d = strdup(s);
    if (!d) abort();
    return d;
}

/* The 256 byte symbols in GPT-2 order (printable bytes as themselves, the others as
 * U+0100.. in byte order), "Ġ"+letter and letter+letter merges while they fit, the special
 * tokens, then unused [PADn] fillers up to N_VOCAB (as the golden vocabularies). */
static int gen_make_vocab(struct gen_vocab *v, int n_vocab)
{
    static const struct { const char *text; int type; } specials[] = {
        {"<|endoftext|>", 3}, {"<|im_start|>", 3}, {"<|im_end|>", 3}, {"<tool_call>", 4}, {"</tool_call>", 4},
        {"<tool_response>", 4}, {"</tool_response>", 4}, {"<think>", 4}, {"</think>", 4},
    };
    const int n_special = (int)(sizeof specials / sizeof specials[0]);
    if (n_vocab < 256 + n_special) return -1;
    memset(v, 0, sizeof *v);
    v->tokens = calloc((size_t)n_vocab, sizeof *v->tokens);
    v->types = calloc((size_t)n_vocab, sizeof *v->types);
    v->merges = calloc(26 * 27, sizeof *v->merges);
    if (!v->tokens || !v->types || !v->merges) abort();
    char sym[256][4];
    int n = 0, extra = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int b = 0; b < 256; b++) {
            int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
            if (pass == 0 && printable) sym[b][gen_utf8(sym[b], (unsigned)b)] = 0;
            else if (pass == 1 && !printable) sym[b][gen_utf8(sym[b], 256u + (unsigned)extra++)] = 0;
            else continue;
            v->tokens[n] = gen_strdup(sym[b]);
            v->types[n++] = 1;
        }
    int room = n_vocab - 256 - n_special;
    char buf[32];
    for (int a = -1; a < 26 && v->n_merges < room; a++)
        for (int b = 0; b < 26 && v->n_merges < room; b++) {
            const char *left = a < 0 ? sym[' '] : sym['a' + a];
            snprintf(buf, sizeof buf, "%s %s", left, sym['a' + b]);
            v->merges[v->n_merges++] = gen_strdup(buf);
            snprintf(buf, sizeof buf, "%s%s", left, sym['a' + b]);
            v->tokens[n] = gen_strdup(buf);
            v->types[n++] = 1;
            if (a < 0 && b == 25) break; /* one row of "Ġ"+letter, then letter pairs */
        }
    for (int i = 0; i < n_special; i++) {
        if (i == 0) v->pad = n;
        if (i == 2) v->eos = n;
        v->tokens[n] = gen_strdup(specials[i].text);
        v->types[n++] = specials[i].type;
    }
    while (n < n_vocab) {
        snprintf(buf, sizeof buf, "[PAD%d]", n);
        v->tokens[n] = gen_strdup(buf);
        v->types[n++] = 5;
    }
    v->n_tokens = n;
    return 0;
}

static void gen_free_vocab(struct gen_vocab *v)
{
    for (int i = 0; i < v->n_tokens; i++) free(v->tokens[i]);
    for (int i = 0; i < v->n_merges; i++) free(v->merges[i]);
    free(v->tokens);
    free(v->types);
    free(v->merges);
}

/* ---- writing ---- */

static int gen_ftype(int type)
{
    for (size_t i = 0; i < sizeof gen_type_names / sizeof gen_type_names[0]; i++)
        if (gen_type_names[i].type == type) return gen_type_names[i].ftype;
    return 0;
}

/* Metadata as qwen35-arch.md §9.2 and the golden files write it (integers as u32). */
static void gen_metadata(struct gw_file *f, const struct gen_geom *g, const struct gen_vocab *v)
{
    char name[96];
    int half = g->rope_dims / 2, s01 = (half * 11 + 16) / 32;
    int32_t sections[4] = {s01, s01, half - 2 * s01, 0}; /* [11,11,10,0] at 64 rope dims */
    snprintf(name, sizeof name, "random-qwen35moe-L%d-H%d-E%d", g->n_layers, g->dim, g->n_expert);
    gw_kv_str(f, "general.architecture", "qwen35moe");
    gw_kv_str(f, "general.type", "model");
    gw_kv_str(f, "general.name", name);
    gw_kv_u32(f, "qwen35moe.block_count", (uint32_t)g->n_layers);
    gw_kv_u32(f, "qwen35moe.context_length", (uint32_t)g->ctx);
    gw_kv_u32(f, "qwen35moe.embedding_length", (uint32_t)g->dim);
    gw_kv_u32(f, "qwen35moe.attention.head_count", (uint32_t)g->n_head);
    gw_kv_u32(f, "qwen35moe.attention.head_count_kv", (uint32_t)g->n_kv_head);
    gw_kv_f32(f, "qwen35moe.rope.freq_base", g->rope_base);
    gw_kv_f32(f, "qwen35moe.attention.layer_norm_rms_epsilon", g->eps);
    gw_kv_u32(f, "qwen35moe.expert_count", (uint32_t)g->n_expert);
    gw_kv_u32(f, "qwen35moe.expert_used_count", (uint32_t)g->n_expert_used);
    gw_kv_u32(f, "qwen35moe.attention.key_length", (uint32_t)g->head_dim);
    gw_kv_u32(f, "qwen35moe.attention.value_length", (uint32_t)g->head_dim);
    gw_kv_u32(f, "general.file_type", (uint32_t)gen_ftype(g->experts_type));
    gw_kv_u32(f, "qwen35moe.expert_feed_forward_length", (uint32_t)g->expert_ff);
    gw_kv_u32(f, "qwen35moe.expert_shared_feed_forward_length", (uint32_t)g->shexp_ff);
    gw_kv_u32(f, "qwen35moe.ssm.conv_kernel", (uint32_t)g->conv_kernel);
    gw_kv_u32(f, "qwen35moe.ssm.state_size", (uint32_t)g->ssm_d);
    gw_kv_u32(f, "qwen35moe.ssm.group_count", (uint32_t)g->ssm_nk);
    gw_kv_u32(f, "qwen35moe.ssm.time_step_rank", (uint32_t)g->ssm_nv);
    gw_kv_u32(f, "qwen35moe.ssm.inner_size", (uint32_t)(g->ssm_nv * g->ssm_d));
    gw_kv_u32(f, "qwen35moe.full_attention_interval", (uint32_t)g->attn_interval);
    gw_kv_u32(f, "qwen35moe.rope.dimension_count", (uint32_t)g->rope_dims);
    gw_kv_array(f, "qwen35moe.rope.dimension_sections", GW_I32, 4, sections);
    gw_kv_u32(f, "general.quantization_version", 2);
    gw_kv_str(f, "tokenizer.ggml.model", "gpt2");
    gw_kv_str(f, "tokenizer.ggml.pre", "qwen35");
    gw_kv_strings(f, "tokenizer.ggml.tokens", (uint64_t)v->n_tokens, (const char *const *)v->tokens);
    gw_kv_array(f, "tokenizer.ggml.token_type", GW_I32, (uint64_t)v->n_tokens, v->types);
    gw_kv_strings(f, "tokenizer.ggml.merges", (uint64_t)v->n_merges, (const char *const *)v->merges);
    gw_kv_u32(f, "tokenizer.ggml.eos_token_id", (uint32_t)v->eos);
    gw_kv_u32(f, "tokenizer.ggml.padding_token_id", (uint32_t)v->pad);
    gw_kv_bool(f, "tokenizer.ggml.add_bos_token", 0);
    gw_kv_str(f, "tokenizer.chat_template",
              "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
              "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
              "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
              "{%- endif %}{%- endif %}");
}

static int gen_pad(FILE *fp, uint64_t n)
{
    static const uint8_t zero[4096];
    while (n) {
        size_t k = n < sizeof zero ? (size_t)n : sizeof zero;
        if (fwrite(zero, 1, k, fp) != k) return -1;
        n -= k;
    }
    return 0;
}

#define GEN_CHUNK_BYTES (64u << 20)

/* Streams tensor TI's data: chunks of rows made and quantised in parallel, then written. */
static int gen_write_tensor(FILE *fp, const struct gen_tensor *t, uint64_t seed, uint64_t ti, uint8_t *chunk)
{
    uint64_t rows = gen_rows(t), cols = t->ne[0], row_bytes = gw_type_size(t->type, cols);
    uint64_t per = GEN_CHUNK_BYTES / row_bytes ? GEN_CHUNK_BYTES / row_bytes : 1;
    for (uint64_t r0 = 0; r0 < rows; r0 += per) {
        uint64_t nr = rows - r0 < per ? rows - r0 : per;
        #pragma omp parallel
        {
            float *x = malloc((size_t)cols * sizeof *x);
            if (!x) abort();
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < (int64_t)nr; r++) {
                gen_row_values(t, seed, ti, r0 + (uint64_t)r, x);
                gen_quant_row(t->type, x, (int64_t)cols, chunk + (size_t)r * row_bytes);
            }
            free(x);
        }
        if (fwrite(chunk, 1, (size_t)(nr * row_bytes), fp) != nr * row_bytes) return -1;
    }
    return 0;
}

/* Writes the model of geometry G to PATH; 0, or -1 with a message on stderr. */
static int gen_write(const char *path, const struct gen_geom *g, int verbose)
{
    struct gen_plan p;
    gen_make_plan(g, &p);
    const char *problem = gen_geom_problem(g, &p);
    struct gen_vocab v;
    if (!problem && gen_make_vocab(&v, g->n_vocab) != 0) problem = "vocabulary too small (at least 265 tokens)";
    if (problem) {
        fprintf(stderr, "gen_model: %s\n", problem);
        free(p.t);
        return -1;
    }
    struct gw_file f;
    gw_init(&f);
    gen_metadata(&f, g, &v);
    gen_free_vocab(&v);
    uint64_t total = 0;
    for (size_t i = 0; i < p.n; i++) {
        uint64_t n = p.t[i].ne[0] * gen_rows(&p.t[i]), bytes = gw_type_size(p.t[i].type, n);
        gw_tensor(&f, p.t[i].name, p.t[i].rank, p.t[i].ne, (uint32_t)p.t[i].type, bytes);
        total += bytes;
    }
    struct gw_buf head = {0};
    gw_header(&f, &head);
    FILE *fp = fopen(path, "wb");
    uint8_t *chunk = malloc(GEN_CHUNK_BYTES);
    int rc = fp && chunk ? 0 : -1;
    if (rc == 0 && fwrite(head.p, 1, head.n, fp) != head.n) rc = -1;
    uint64_t at = 0; /* position in the data section */
    double t0 = plat_now(), last = t0;
    for (size_t i = 0; rc == 0 && i < p.n; i++) {
        if (gen_pad(fp, f.t[i].offset - at) != 0 || gen_write_tensor(fp, &p.t[i], g->seed, i, chunk) != 0) rc = -1;
        at = f.t[i].offset + f.t[i].bytes;
        if (verbose && plat_now() - last > 10) {
            last = plat_now();
            fprintf(stderr, "gen_model: %.1f of %.1f GiB, %.0f s\n", (double)at / (1 << 30), (double)total / (1 << 30), last - t0);
        }
    }
    if (fp && fclose(fp) != 0) rc = -1;
    if (rc != 0) fprintf(stderr, "gen_model: cannot write %s: %s\n", path, strerror(errno));
    else if (verbose)
        fprintf(stderr, "gen_model: wrote %s: %zu tensors, %.3f GiB of weights, %.1f s\n", path, p.n,
                (double)total / (1 << 30), plat_now() - t0);
    free(chunk);
    gw_buf_free(&head);
    gw_free(&f);
    free(p.t);
    return rc;
}

/* Opens PATH with coli's reader (dies there on a bad file) and checks that it holds exactly
 * the planned tensors, shapes converted outermost first, and the key hyper-parameters.
 * Returns the number of mismatches (each printed). */
static int gen_verify(const char *path, const struct gen_geom *g)
{
    struct gen_plan p;
    gen_make_plan(g, &p);
    struct gguf_file gf;
    gguf_open(&gf, path);
    int bad = 0;
    if (gf.n_tensors != (int64_t)p.n) {
        fprintf(stderr, "gen_model: %s: %lld tensors, planned %zu\n", path, (long long)gf.n_tensors, p.n);
        bad++;
    }
    for (size_t i = 0; i < p.n; i++) {
        const struct gguf_tensor *t = gguf_tensor_find(&gf, p.t[i].name);
        int same = t && t->type == p.t[i].type && t->n_dims == (int)p.t[i].rank;
        for (uint32_t k = 0; same && k < p.t[i].rank; k++) same = t->shape[p.t[i].rank - 1 - k] == (int64_t)p.t[i].ne[k];
        if (!same) {
            fprintf(stderr, "gen_model: %s: tensor %s missing or of another type or shape\n", path, p.t[i].name);
            bad++;
        }
    }
    size_t len = 0;
    const char *arch = gguf_get_string(&gf, "general.architecture", &len);
    if (!arch || len != 9 || memcmp(arch, "qwen35moe", 9) != 0) { fprintf(stderr, "gen_model: architecture\n"); bad++; }
    if (gguf_get_int(&gf, "qwen35moe.block_count", -1) != g->n_layers ||
        gguf_get_int(&gf, "qwen35moe.expert_count", -1) != g->n_expert ||
        gguf_get_int(&gf, "qwen35moe.ssm.inner_size", -1) != (int64_t)g->ssm_nv * g->ssm_d ||
        gguf_get_float(&gf, "qwen35moe.rope.freq_base", -1) != (double)g->rope_base) {
        fprintf(stderr, "gen_model: %s: hyper-parameters read back wrong\n", path);
        bad++;
    }
    const void *tok;
    if (gguf_get_array(&gf, "tokenizer.ggml.tokens", GGUF_VALUE_STRING, &tok) != (size_t)g->n_vocab) {
        fprintf(stderr, "gen_model: %s: token count\n", path);
        bad++;
    }
    gguf_close(&gf);
    free(p.t);
    return bad;
}

/* ---- self-test of the quantisers ---- */

/* Runs coli's quant_dequant_row on Q in a child (the §3 stub dies for formats it lacks: that
 * is a skip) and compares with REF. Returns 1 agree, 0 disagree, -1 skipped. */
static int gen_compare_coli(int type, const uint8_t *q, const float *ref, int64_t n)
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        int devnull = open("/dev/null", O_WRONLY);
        if (devnull >= 0) dup2(devnull, 2);
        float *y = malloc((size_t)n * sizeof *y);
        quant_dequant_row((enum gguf_type)type, q, y, n);
        for (int64_t i = 0; i < n; i++)
            if (!(fabsf(y[i] - ref[i]) <= 1e-6f * fabsf(ref[i]) + 1e-12f)) _exit(3);
        _exit(0);
    }
    int st = 0;
    if (pid < 0 || waitpid(pid, &st, 0) != pid) return 0;
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return 1;
    if (WIFEXITED(st) && WEXITSTATUS(st) == 1) return -1;
    return 0;
}

/* Quantise random rows, dequantise with the reference above (and with coli where it can),
 * check the error. Prints one line per format; returns the number of failures. */
static int gen_selftest(void)
{
    static const struct { int type; double rel_rms, max_step; } c[] = {
        /* max_step: the worst error allowed, in units of the block's largest magnitude */
        {GW_TYPE_F32, 0, 0}, {GW_TYPE_F16, 1e-3, 1e-3}, {GW_TYPE_BF16, 8e-3, 8e-3},
        {GW_TYPE_Q8_0, 0.01, 1.0 / 127 * 0.51 + 1e-3}, {GW_TYPE_Q4_0, 0.12, 1.0 / 8 + 1e-3}, {GW_TYPE_Q4_K, 0.15, 0.25},
        {GW_TYPE_Q6_K, 0.04, 0.06}, {GW_TYPE_Q2_K, 0.4, 0.4}, {GW_TYPE_Q3_K, 0.25, 0.35},
    };
    enum { N = 4096 };
    static float x[N], y[N];
    static uint8_t q[N * 4];
    int failed = 0;
    for (size_t k = 0; k < sizeof c / sizeof c[0]; k++) {
        double se = 0, sx = 0, worst = 0;
        int coli_agrees = 1, coli_skipped = 0;
        for (int trial = 0; trial < 4; trial++) {
            float sd = trial == 0 ? 0.02f : trial == 1 ? 1.0f : trial == 2 ? 0.004f : 30.0f; /* fp16 scales stay normal */
            gen_normal_row(gen_stream(7, (uint64_t)k, (uint64_t)trial), x, N, trial == 3 ? 5.0f : 0.0f, sd);
            if (trial == 1) for (int i = 0; i < 256; i++) x[i] = 0; /* an all-zero block */
            gen_quant_row(c[k].type, x, N, q);
            gen_dequant_row(c[k].type, q, y, N);
            int blk = c[k].type == GW_TYPE_Q8_0 || c[k].type == GW_TYPE_Q4_0 ? 32 : 256;
            for (int b = 0; b < N; b += blk) {
                float amax = 0;
                for (int i = b; i < b + blk; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
                for (int i = b; i < b + blk; i++) {
                    double e = fabs((double)y[i] - x[i]);
                    se += e * e;
                    sx += (double)x[i] * x[i];
                    if (amax > 0 && e / amax > worst) worst = e / amax;
                    if (amax == 0 && e > 0) worst = 1e9;
                }
            }
            int r = gen_compare_coli(c[k].type, q, y, N);
            if (r == 0) coli_agrees = 0;
            if (r < 0) coli_skipped = 1;
        }
        double rel = sqrt(se / sx);
        int ok = rel <= c[k].rel_rms && worst <= c[k].max_step && coli_agrees;
        printf("%s - quantiser %s: rms error %.2g of rms, worst %.3g of block max%s\n", ok ? "ok" : "FAIL",
               gen_type_name(c[k].type), rel, worst,
               !coli_agrees ? "; coli's quant_dequant_row disagrees" : coli_skipped ? "; coli dequant # SKIP (not supported yet)" : "; coli's dequant agrees");
        failed += !ok;
    }
    return failed;
}

#ifndef GEN_MODEL_NO_MAIN
static void gen_usage(void)
{
    fputs("usage: gen_model OUT.gguf [options]    |    gen_model --selftest\n"
          "  --preset tiny|35b-a3b   geometry to start from (default tiny)\n"
          "  --layers N --hidden N --experts N --top-k N --expert-ff N --shared-ff N\n"
          "  --heads N --kv-heads N --head-dim N --rope-dims N --rope-base F --attn-interval N\n"
          "  --ssm-k-heads N --ssm-v-heads N --ssm-head-dim N --conv N --vocab N --ctx N --eps F\n"
          "  --type T (every matrix but the experts; default Q8_0) --experts-type T (default Q4_0)\n"
          "     T: F32 F16 BF16 Q8_0 Q4_0 Q2_K Q3_K Q4_K Q6_K\n"
          "  --seed S   --check (reopen the file with coli's reader and verify it)\n", stderr);
    exit(2);
}

int main(int argc, char **argv)
{
    struct gen_geom g;
    gen_preset_tiny(&g);
    const char *out = NULL;
    int check = 0;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--preset") && i + 1 < argc) {
            const char *p = argv[i + 1];
            if (!strcmp(p, "tiny")) gen_preset_tiny(&g);
            else if (!strcmp(p, "35b-a3b")) gen_preset_35b(&g);
            else gen_usage();
        }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        struct { const char *flag; int *field; } ints[] = {
            {"--layers", &g.n_layers}, {"--hidden", &g.dim}, {"--experts", &g.n_expert}, {"--top-k", &g.n_expert_used},
            {"--expert-ff", &g.expert_ff}, {"--shared-ff", &g.shexp_ff}, {"--heads", &g.n_head}, {"--kv-heads", &g.n_kv_head},
            {"--head-dim", &g.head_dim}, {"--rope-dims", &g.rope_dims}, {"--attn-interval", &g.attn_interval},
            {"--ssm-k-heads", &g.ssm_nk}, {"--ssm-v-heads", &g.ssm_nv}, {"--ssm-head-dim", &g.ssm_d},
            {"--conv", &g.conv_kernel}, {"--vocab", &g.n_vocab}, {"--ctx", &g.ctx},
        };
        int used = 0;
        for (size_t k = 0; k < sizeof ints / sizeof ints[0]; k++)
            if (!strcmp(a, ints[k].flag)) {
                if (!v) gen_usage();
                *ints[k].field = atoi(v);
                used = 1;
            }
        if (used || !strcmp(a, "--preset")) { i++; continue; }
        if (!strcmp(a, "--selftest")) return gen_selftest() ? 1 : 0;
        if (!strcmp(a, "--check")) { check = 1; continue; }
        if (!v && a[0] == '-') gen_usage();
        if (!strcmp(a, "--rope-base")) g.rope_base = (float)atof(v);
        else if (!strcmp(a, "--eps")) g.eps = (float)atof(v);
        else if (!strcmp(a, "--seed")) g.seed = strtoull(v, NULL, 0);
        else if (!strcmp(a, "--type")) { if ((g.type = gen_type_parse(v)) < 0) gen_usage(); }
        else if (!strcmp(a, "--experts-type")) { if ((g.experts_type = gen_type_parse(v)) < 0) gen_usage(); }
        else if (a[0] == '-' || out) gen_usage();
        else { out = a; continue; }
        i++;
    }
    if (!out) gen_usage();
    if (gen_write(out, &g, 1) != 0) return 1;
    if (check) {
        int bad = gen_verify(out, &g);
        fprintf(stderr, "gen_model: check %s\n", bad ? "FAILED" : "ok");
        return bad ? 1 : 0;
    }
    return 0;
}
#endif
