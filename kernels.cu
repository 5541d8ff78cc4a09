// coli's GPU kernels: the source of kernels.ptx (coli.c §5 embeds the PTX, not this file).
// build.sh regenerates kernels.ptx from here only when nvcc is present, then lowers its header
// to the lowest ISA the instructions allow (.version 6.0, .target sm_52: shfl.sync is PTX 6.0),
// so that drivers of recent years JIT it for every card from Maxwell on. Builds need no CUDA
// toolkit: the committed kernels.ptx is what is embedded.
//
// Bit-identical to the CPU (coli.c §3): every product follows the canonical order. Unit u of a
// row (an element for F32/F16/BF16, a 32-block for Q8_0..Q5_1, IQ4_NL and MXFP4, a
// 256-super-block for the K formats, IQ4_XS, IQ3_XXS and IQ3_S) is added into lane u % 32's
// partial, in increasing u; then the butterfly s = 16, 8, 4, 2, 1, p[i] = p[i] + p[i + s], is
// shfl.down.
// Integer parts are exact, and each unit's float combine is the CPU's expression, operation for
// operation. So a unit's integer products may be split over lanes: 4 lanes take a 32-block and
// 8 a super-block (block_row_partial), which keeps every lane busy on short rows (an expert's
// 512-column down product is 2 super-blocks) and has neighbouring lanes read neighbouring
// bytes; the unit's float then goes to the lane whose partial it belongs in. nvcc runs with -fmad=false so that no multiply-add is fused (the CPU is built with
// -ffp-contract=off); fp16 -> f32 is exact.
//
// Every GEMV kernel has one signature: matvec_<type>(w, row_bytes, act, act_stride, y, rows,
// cols, n): y[j*rows + r] = W[r] . act_j for j < n, with act_j at act + j*act_stride in the
// layout of quant_act_prepare (coli.c §3). One warp per row, 4 warps per block.

#include <stdint.h>

#define NPART 32

// The weight formats by their GGUF type ids (coli.c's enum gguf_type; the fake driver's twins
// are keyed by the same numbers).
enum wtype {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11,
    Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ3_XXS = 18, IQ4_NL = 20, IQ3_S = 21, IQ4_XS = 23, BF16 = 30,
    MXFP4 = 39
};

__device__ __forceinline__ bool float_format(int t) { return t == F32 || t == F16 || t == BF16; }

// The formats of 32-blocks, which take the Q8 activations; the rest take Q8_K.
__device__ __forceinline__ bool block32_format(int t) {
    return t == Q8_0 || t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == IQ4_NL || t == MXFP4;
}

// ---- the formats' tables: data of the formats, the same numbers as coli.c §3's ----

// IQ4_NL and IQ4_XS: the reference's int8 grid (coli.c quant_iq4nl_values).
__constant__ int8_t iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// MXFP4: the E2M1 values doubled, code = sign | exponent(2) | mantissa(1), as quant_tables_init
// computes them; the block's E8M0 scale is halved to match (e8m0_half).
__constant__ int8_t mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// IQ3_XXS: the 256 lattice points as coli.c lists them (quant_iq3xxs_keys: the level index of
// coordinate j in bits 3j..3j+2) and the 8 levels. A weight's coordinate is decoded from its key
// here rather than read from the 256-word grid that quant_tables_init builds from the same keys:
// the list is then the very one coli.c spells out (comparable line for line; the fake driver
// reads it back out of kernels.ptx), not a second, generated copy, for a shift, a mask and an
// 8-entry lookup per weight. The keys live in global memory, read through the read-only cache
// (__ldg): a warp's different keys are a few cache lines there, where constant memory serves
// one address at a time.
__device__ uint16_t iq3xxs_keys[256] = {
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
__constant__ uint8_t iq3_levels[8] = {4, 12, 20, 28, 36, 44, 52, 62};

// IQ3_S: the 512 grid points as coli.c lists them (quant_iq3s_keys: (v-1)/2 of coordinate j in
// bits 3j..3j+2, v in {1,3,..,15}), decoded per weight as IQ3_XXS's keys are, for the same
// reason: the list reads against coli.c's line for line, and the fake driver reads it back. In
// global memory as IQ3_XXS's.
__device__ uint16_t iq3s_keys[512] = {
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

// ---- scalars of the blocks ----

// 16 bytes in four registers, as one vector load brings them; 8 in two.
struct bytes16 { unsigned w[4]; };
struct bytes8 { unsigned w[2]; };

// The helpers in PTX assembly or vector loads; tests/kernels_sim.cc, which compiles this file
// for the host (KERNELS_ON_HOST), brings its own.
#ifndef KERNELS_ON_HOST
// One 16-byte load (ld.global.v4.u32): P must be 16-aligned.
__device__ __forceinline__ bytes16 load16(const uint8_t *p) {
    const uint4 v = *(const uint4 *)p;
    return bytes16{{v.x, v.y, v.z, v.w}};
}

// One 8-byte load (ld.global.v2.u32): P must be 8-aligned.
__device__ __forceinline__ bytes8 load8(const uint8_t *p) {
    const uint2 v = *(const uint2 *)p;
    return bytes8{{v.x, v.y}};
}

// One 4-byte load of read-only global memory (ld.global.nc: the address, rounded through an
// integer, no longer tells nvcc where it points): P must be 4-aligned.
__device__ __forceinline__ unsigned load4(const uint8_t *p) { return __ldg((const unsigned *)p); }

__device__ __forceinline__ float f16(const uint8_t *p) {
    unsigned short h = (unsigned short)(p[0] | (p[1] << 8));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// f32 -> f16 -> f32, rounding to nearest even.
__device__ __forceinline__ float round_f16(float x) {
    unsigned short h;
    float f;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// f32 -> the bits of f16, rounding to nearest even (coli.c's quant_f32_to_f16).
__device__ __forceinline__ unsigned short f16_bits(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// acc + a*b as an opaque mad.lo.s32: NVVM would otherwise fuse byte products into dp4a/dp2a,
// which need sm_61, and the point of this file is to stay JIT-able on sm_52.
__device__ __forceinline__ int imad(int a, int b, int acc) {
    asm("mad.lo.s32 %0, %1, %2, %0;" : "+r"(acc) : "r"(a), "r"(b));
    return acc;
}

// The thread's writes before it seen before those after it, by every observer, the host too:
// membar.sys, which every ISA has (nvcc's __threadfence_system for sm_70+ is fence.sc.sys, which
// the sm_52 target this file is lowered to lacks).
__device__ __forceinline__ void fence_system() { asm volatile("membar.sys;" ::: "memory"); }
#endif

__device__ __forceinline__ float bf16(const uint8_t *p) {
    return __uint_as_float((unsigned)(p[0] | (p[1] << 8)) << 16);
}

// 2^(e-128), an E8M0 scale times one half, as coli.c's quant_e8m0_half (e = 0, 1: subnormal).
__device__ __forceinline__ float e8m0_half(uint8_t e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (unsigned)(e - 1) << 23);
}

// A little-endian 16-bit word at a byte address (IQ4_XS's high scale bits).
__device__ __forceinline__ unsigned le16(const uint8_t *p) { return p[0] | p[1] << 8; }

// Byte I of V, unsigned and signed (I a constant once the loops are unrolled).
__device__ __forceinline__ int byte_at(bytes16 v, int i) { return (v.w[i / 4] >> (8 * (i % 4))) & 0xFF; }
__device__ __forceinline__ int sbyte_at(bytes16 v, int i) { return (int)(int8_t)byte_at(v, i); }
__device__ __forceinline__ int byte_at(bytes8 v, int i) { return (v.w[i / 4] >> (8 * (i % 4))) & 0xFF; }
__device__ __forceinline__ int sbyte_at(bytes8 v, int i) { return (int)(int8_t)byte_at(v, i); }

// The 4 or 8 bytes at P, at any alignment (blocks of 17, 18, 22, 34, 98, 110 and 210 bytes): the
// aligned words that cover them, joined by funnel shifts, instead of a load a byte. No word past
// the one that holds the last byte is read.
__device__ __forceinline__ unsigned load4_unaligned(const uint8_t *p) {
    const uint8_t *w = (const uint8_t *)((uintptr_t)p & ~(uintptr_t)3);
    const unsigned shift = 8u * (unsigned)((uintptr_t)p & 3);
    return __funnelshift_r(load4(w), shift ? load4(w + 4) : 0u, shift);
}

__device__ __forceinline__ bytes8 load8_unaligned(const uint8_t *p) {
    const uint8_t *w = (const uint8_t *)((uintptr_t)p & ~(uintptr_t)3);
    const unsigned shift = 8u * (unsigned)((uintptr_t)p & 3), a = load4(w), b = load4(w + 4), c = shift ? load4(w + 8) : 0u;
    return bytes8{{__funnelshift_r(a, b, shift), __funnelshift_r(b, c, shift)}};
}

// Byte I of the word V, signed.
__device__ __forceinline__ int sbyte_of(unsigned v, int i) { return (int)(int8_t)(v >> (8 * i)); }

// Word K of a table of bytes (4 uniform constant loads: the same address in every lane).
__device__ __forceinline__ unsigned table_word(const int8_t *tab, int k) {
    return (uint8_t)tab[4 * k] | (uint8_t)tab[4 * k + 1] << 8 | (uint8_t)tab[4 * k + 2] << 16 | (unsigned)(uint8_t)tab[4 * k + 3] << 24;
}

// The entries of the 16-byte table (words TAB) for the 4 codes in the low nibbles of C's bytes,
// as the bytes of the result: a byte permute (prmt) takes 4 of 8 bytes at once, codes 0-7 from
// words 0-1 and 8-15 from words 2-3, and each code's bit 3 picks between the two. In registers:
// a constant-memory load serialises over the warp's different addresses.
__device__ __forceinline__ unsigned table16_lookup(const unsigned tab[4], unsigned c) {
    const unsigned low3 = c & 0x07070707u, pairs = low3 | low3 >> 4;
    const unsigned sel = (pairs & 0xFFu) | ((pairs >> 8) & 0xFF00u), high = ((c >> 3) & 0x01010101u) * 0xFFu;
    return (__byte_perm(tab[0], tab[1], sel) & ~high) | (__byte_perm(tab[2], tab[3], sel) & high);
}

__device__ __forceinline__ float reduce32(float p) {
    for (int s = NPART / 2; s > 0; s /= 2) p = __fadd_rn(p, __shfl_down_sync(0xffffffffu, p, s));
    return p;
}

// ---- float weights: unit = element, x already rounded as the weights (quant_act_prepare) ----
template <int T>
__device__ __forceinline__ float fweight(const uint8_t *w, int64_t i) {
    if (T == F32) return __uint_as_float(*(const unsigned *)(w + 4 * i));
    if (T == F16) return f16(w + 2 * i);
    return bf16(w + 2 * i);
}

// ---- 32-blocks: act = qs[n] int8 | d[n/32] f32 | s[n/32] i32 | sd[n/32] f32 ----
// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 as ggml defines their quants; IQ4_NL (d fp16) and MXFP4 (E8M0
// byte) hold 16 bytes of 4-bit codes into their tables, low nibbles first.
// Share t of a block (4 lanes to a block): Q8_0's weights 8t .. 8t + 7; the nibble formats'
// bytes 4t .. 4t + 3 of their 16, weights 4t.. (low nibbles) and 16 + 4t.. (high). The block's
// bytes by words (load4_unaligned: the blocks leave them at any alignment), the act's by aligned
// words.
template <int T>
__device__ __forceinline__ int legacy_share(const uint8_t *blk, const int8_t *qx, int t) {
    const int has_min = T == Q4_1 || T == Q5_1, five = T == Q5_0 || T == Q5_1;
    const uint8_t *x = (const uint8_t *)qx;
    int isum = 0;
    if (T == Q8_0) {
        const bytes8 q = load8_unaligned(blk + 2 + 8 * t), xs = load8(x + 8 * t);
#pragma unroll
        for (int j = 0; j < 8; j++) isum = imad(sbyte_at(q, j), sbyte_at(xs, j), isum);
        return isum;
    }
    const unsigned x0 = load4(x + 4 * t), x1 = load4(x + 16 + 4 * t);
    if (T == IQ4_NL || T == MXFP4) {
        const int8_t *v = T == MXFP4 ? mxfp4_values : iq4nl_values;
        const unsigned tab[4] = {table_word(v, 0), table_word(v, 1), table_word(v, 2), table_word(v, 3)};
        const unsigned qs = load4_unaligned(blk + (T == MXFP4 ? 1 : 2) + 4 * t);
        const unsigned w0 = table16_lookup(tab, qs), w1 = table16_lookup(tab, qs >> 4);
#pragma unroll
        for (int j = 0; j < 4; j++) isum = imad(sbyte_of(w1, j), sbyte_of(x1, j), imad(sbyte_of(w0, j), sbyte_of(x0, j), isum));
        return isum;
    }
    const unsigned qh = five ? load4_unaligned(blk + 2 + 2 * has_min) : 0;
    const unsigned qs = load4_unaligned(blk + 2 + 2 * has_min + 4 * five + 4 * t);
    const int off = has_min ? 0 : (five ? 16 : 8);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int j = 4 * t + i;
        int q0 = (qs >> (8 * i)) & 0x0f, q1 = (qs >> (8 * i + 4)) & 0x0f;
        if (five) {
            q0 |= (int)(((qh >> j) << 4) & 0x10);
            q1 |= (int)((qh >> (j + 12)) & 0x10);
        }
        isum = imad(q1 - off, sbyte_of(x1, i), imad(q0 - off, sbyte_of(x0, i), isum));
    }
    return isum;
}

// The block's float from its whole integer sum: (d*dx)*(float)isum, plus m*sd where it has a min.
template <int T>
__device__ __forceinline__ float legacy_combine(const uint8_t *blk, int isum, float dx, float sd) {
    const float dw = T == MXFP4 ? e8m0_half(blk[0]) : f16(blk);
    const float r = __fmul_rn(__fmul_rn(dw, dx), (float)isum);
    return T == Q4_1 || T == Q5_1 ? __fadd_rn(r, __fmul_rn(f16(blk + 2), sd)) : r;
}

// ---- 256-super-blocks: act = qs[n] int8 | d[n/256] f32 | bsums[n/16] i16 ----
__device__ __forceinline__ void k4_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// A super-block is taken by 8 lanes (an octet): lane t of it sums the integer products of its
// share, 32 of the 256 weights, into the unit's integer sums. The octet adds the shares exactly
// and then computes the unit's float from the whole sums as the CPU does (k_combine).
struct ksums { int sumi, summ; };

// Q4_K / Q5_K (d | dmin | scales[12] | qh[32] (Q5_K) | ql[128]): weights 64j + l and 64j + 32 + l
// are the low and high nibbles of ql[32j + l] (Q5_K: bit 2j, 2j + 1 of qh[l] on top), with
// scale/min 2j and 2j + 1. Share t: j = t / 2, l = 16(t % 2) .. + 15, the 16 bytes at ql + 16t
// (16-aligned: the blocks are 144 and 176 bytes).
template <int T>
__device__ __forceinline__ ksums q45k_share(const uint8_t *b, const int8_t *qx, const int16_t *bs, int t) {
    const int five = T == Q5_K, j = t / 2, h = t % 2;
    const bytes16 ql = load16(b + 16 + (five ? 32 : 0) + 16 * t), qh = five ? load16(b + 16 + 16 * h) : bytes16{};
    const bytes16 x0 = load16((const uint8_t *)qx + 64 * j + 16 * h), x1 = load16((const uint8_t *)qx + 64 * j + 32 + 16 * h);
    int sc0, m0, sc1, m1, s0 = 0, s1 = 0;
    k4_scale_min(2 * j, b + 4, &sc0, &m0);
    k4_scale_min(2 * j + 1, b + 4, &sc1, &m1);
#pragma unroll
    for (int l = 0; l < 16; l++) {
        int q0 = byte_at(ql, l) & 0xF, q1 = byte_at(ql, l) >> 4;
        if (five) {
            q0 |= ((byte_at(qh, l) >> (2 * j)) & 1) << 4;
            q1 |= ((byte_at(qh, l) >> (2 * j + 1)) & 1) << 4;
        }
        s0 = imad(q0, sbyte_at(x0, l), s0);
        s1 = imad(q1, sbyte_at(x1, l), s1);
    }
    const int summ = h == 0 ? m0 * (bs[4 * j] + bs[4 * j + 1]) : m1 * (bs[4 * j + 2] + bs[4 * j + 3]);
    return ksums{sc0 * s0 + sc1 * s1, summ};
}

// Q6_K (ql[128] | qh[64] | scales[16] int8 | d): in half n, weight 32q + l (quarter q) is the low
// (q < 2) or high nibble of ql[64n + l + 32(q & 1)] with bits 2q, 2q + 1 of qh[32n + l] on top,
// less 32, scale 8n + 2q + l / 16. Share t: n = t / 4, l = 8(t % 4) .. + 7 of every quarter: 8
// bytes of ql twice and of qh, neighbouring lanes' neighbouring bytes.
__device__ __forceinline__ ksums q6k_share(const uint8_t *b, const int8_t *qx, int t) {
    const int n = t / 4, l0 = 8 * (t % 4);
    const bytes8 ql[2] = {load8_unaligned(b + 64 * n + l0), load8_unaligned(b + 64 * n + 32 + l0)};
    const bytes8 qh = load8_unaligned(b + 128 + 32 * n + l0);
    const int8_t *sc = (const int8_t *)(b + 192) + 8 * n + l0 / 16;
    int sumi = 0;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const bytes8 x = load8((const uint8_t *)qx + 128 * n + 32 * q + l0);
        int s = 0;
#pragma unroll
        for (int l = 0; l < 8; l++) {
            const int lo = byte_at(ql[q & 1], l);
            s = imad(((q < 2 ? lo & 0xF : lo >> 4) | (((byte_at(qh, l) >> (2 * q)) & 3) << 4)) - 32, sbyte_at(x, l), s);
        }
        sumi += sc[2 * q] * s;
    }
    return ksums{sumi, 0};
}

// Q3_K's signed 6-bit scale g of 16, from its 12 packed bytes P: the low 4 bits are nibble g / 8
// of byte g % 8, the top 2 bits 2(g / 4).. of byte 8 + g % 4; less 32 (coli.c quant_q3k_scales).
__device__ __forceinline__ int q3k_scale(const uint8_t *p, int g) {
    return (((p[g % 8] >> (4 * (g / 8))) & 0xF) | (((p[8 + g % 4] >> (2 * (g / 4))) & 3) << 4)) - 32;
}

// Q2_K (scales[16] | qs[64] | d | dmin: per 16 weights a 4-bit scale, low nibble, and min) and
// Q3_K (hmask[32] | qs[64] | scales[12] | d). Weight e = 128n + 32k + l is bits 2k, 2k+1 of
// qs[32n + l]; Q3_K's third bit is bit 4n + k of hmask[l], and where it is clear the weight is
// 4 less. Share t: weights 32t .. 32t + 31 (n = t / 4, k = t % 4), the 16-groups 2t and 2t + 1;
// the quants and hmask by words (the 110-byte Q3_K blocks are only 2-aligned, the 84-byte Q2_K
// ones 4-aligned).
template <int T>
__device__ __forceinline__ ksums q23k_share(const uint8_t *b, const int8_t *qx, const int16_t *bs, int t) {
    const int three = T == Q3_K, n = t / 4, k = t % 4;
    const uint8_t *qs = b + (three ? 32 : 16) + 32 * n;
    int sumi = 0, summ = 0;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int g = 2 * t + half;
        const bytes16 x = load16((const uint8_t *)qx + 32 * t + 16 * half);
        const bytes8 q8[2] = {load8_unaligned(qs + 16 * half), load8_unaligned(qs + 16 * half + 8)};
        const bytes8 h8[2] = {three ? load8_unaligned(b + 16 * half) : bytes8{}, three ? load8_unaligned(b + 16 * half + 8) : bytes8{}};
        int s = 0;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            int q = (byte_at(q8[i / 8], i % 8) >> (2 * k)) & 3;
            if (three && !((byte_at(h8[i / 8], i % 8) >> (4 * n + k)) & 1)) q -= 4;
            s = imad(q, sbyte_at(x, i), s);
        }
        sumi += (three ? q3k_scale(b + 96, g) : b[g] & 0xF) * s;
        if (!three) summ = imad(b[g] >> 4, bs[g], summ);
    }
    return ksums{sumi, summ};
}

// IQ4_XS (d | scales_h u16 | scales_l[4] | qs[128]): 32-block ib is 16 bytes of IQ4_NL codes
// with a 6-bit scale less 32. IQ3_XXS (d | qs[64] | 8 words): 32-block ib's 8 bytes of qs pick a
// lattice point each for 4 weights; its word holds 4 x 7 sign bits (weights 8l..8l+7 take bits
// 7l..7l+6, the eighth sign makes the count of minus signs even) and on top the 4-bit s of
// d*(0.5+s)*0.5 = (d/4)*(2s+1). IQ3_S (d | qs[64] | qh[8] | signs[32] | scales[4]): group k of
// 32-block ib is grid point qs[8ib + k] | bit k of qh[ib] as bit 8; weight j's sign is bit j % 8
// of signs[4ib + j / 8]; the scale is d*(2s+1), s nibble ib % 2 of scales[ib / 2].
// Share t: 32-block ib = t.
template <int T>
__device__ __forceinline__ ksums iq_share(const uint8_t *b, const int8_t *qx, int ib) {
    const int8_t *x = qx + 32 * ib;
    int s = 0, scale;
    if (T == IQ4_XS) { // 136-byte blocks: the codes are 8-aligned, the act 32-aligned
        const bytes8 qs[2] = {load8(b + 8 + 16 * ib), load8(b + 16 + 16 * ib)};
        const bytes16 x0 = load16((const uint8_t *)x), x1 = load16((const uint8_t *)x + 16);
        const unsigned tab[4] = {table_word(iq4nl_values, 0), table_word(iq4nl_values, 1), table_word(iq4nl_values, 2),
                                 table_word(iq4nl_values, 3)};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const unsigned codes = qs[k / 2].w[k % 2], w0 = table16_lookup(tab, codes), w1 = table16_lookup(tab, codes >> 4);
#pragma unroll
            for (int i = 0; i < 4; i++) s = imad(sbyte_of(w1, i), sbyte_at(x1, 4 * k + i), imad(sbyte_of(w0, i), sbyte_at(x0, 4 * k + i), s));
        }
        scale = (((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((le16(b + 2) >> (2 * ib)) & 3) << 4)) - 32;
    } else if (T == IQ3_S) { // 110-byte blocks: the point indices and signs by load*_unaligned
        const bytes8 qs = load8_unaligned(b + 2 + 8 * ib);
        const unsigned qh = b[66 + ib], signs = load4_unaligned(b + 74 + 4 * ib);
        const bytes16 xs[2] = {load16((const uint8_t *)x), load16((const uint8_t *)x + 16)};
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const unsigned key = __ldg(&iq3s_keys[byte_at(qs, k) | ((qh >> k) & 1) << 8]);
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int j = 4 * k + c, level = 2 * (int)((key >> (3 * c)) & 7) + 1;
                s = imad((signs >> j) & 1 ? -level : level, sbyte_at(xs[j / 16], j % 16), s);
            }
        }
        scale = 2 * (int)((b[106 + ib / 2] >> (4 * (ib % 2))) & 0xF) + 1;
    } else { // IQ3_XXS, 98-byte blocks: likewise
        const bytes8 qs = load8_unaligned(b + 2 + 8 * ib);
        const unsigned aux = load4_unaligned(b + 66 + 4 * ib);
        const bytes16 xs[2] = {load16((const uint8_t *)x), load16((const uint8_t *)x + 16)};
        const unsigned levels[2] = {table_word((const int8_t *)iq3_levels, 0), table_word((const int8_t *)iq3_levels, 1)};
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const unsigned key = __ldg(&iq3xxs_keys[byte_at(qs, k)]);
            const unsigned bits7 = (aux >> (7 * (k / 2))) & 127, signs = bits7 | (__popc(bits7) & 1) << 7;
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int j = 4 * k + c, level = (int)(__byte_perm(levels[0], levels[1], (key >> (3 * c)) & 7) & 0xFF);
                s = imad((signs >> (j % 8)) & 1 ? -level : level, sbyte_at(xs[j / 16], j % 16), s);
            }
        }
        scale = 2 * (int)(aux >> 28) + 1;
    }
    return ksums{scale * s, 0};
}

template <int T>
__device__ __forceinline__ ksums k_share(const uint8_t *b, const int8_t *qx, const int16_t *bs, int t) {
    if (T == Q6_K) return q6k_share(b, qx, t);
    if (T == Q4_K || T == Q5_K) return q45k_share<T>(b, qx, bs, t);
    if (T == Q2_K || T == Q3_K) return q23k_share<T>(b, qx, bs, t);
    return iq_share<T>(b, qx, t);
}

// The formats whose unit subtracts mins (summ).
__device__ __forceinline__ bool has_mins(int t) { return t == Q2_K || t == Q4_K || t == Q5_K; }

// The unit's float from its whole integer sums: the CPU's expression, operation for operation.
// Q4_K/Q5_K and Q2_K: (d*dx)*(float)sumi - (dmin*dx)*(float)summ; the rest (d*dx)*(float)sumi,
// IQ3_XXS then times 0.25.
template <int T>
__device__ __forceinline__ float k_combine(const uint8_t *b, ksums s, float dx) {
    const int d_at = T == Q6_K ? 208 : T == Q2_K ? 80 : T == Q3_K ? 108 : 0;
    const float r = __fmul_rn(__fmul_rn(f16(b + d_at), dx), (float)s.sumi);
    if (T == Q4_K || T == Q5_K) return __fsub_rn(r, __fmul_rn(__fmul_rn(f16(b + 2), dx), (float)s.summ));
    if (T == Q2_K) return __fsub_rn(r, __fmul_rn(__fmul_rn(f16(b + 82), dx), (float)s.summ));
    return T == IQ3_XXS ? __fmul_rn(r, 0.25f) : r;
}

// ---- a row of blocks: every lane busy, the canonical order kept ----

// One unit's activations (quant_act_prepare's layout): its int8 values and scale, and the
// 32-block's fp16(d*s) or the super-block's 16-sums.
struct act_unit { const int8_t *qx; const int16_t *bs; float dx, sd; };

template <int K>
__device__ __forceinline__ act_unit act_at(const uint8_t *a, int cols, int b) {
    const float *d = (const float *)(a + cols);
    if (block32_format(K)) return act_unit{(const int8_t *)a + 32 * b, nullptr, d[b], ((const float *)(a + cols + 8 * (cols / 32)))[b]};
    return act_unit{(const int8_t *)a + 256 * b, (const int16_t *)(a + cols + 4 * (cols / 256)) + 16 * b, d[b], 0.0f};
}

template <int K>
__device__ __forceinline__ ksums unit_share(const uint8_t *w, const act_unit &x, int t) {
    if (block32_format(K)) return ksums{legacy_share<K>(w, x.qx, t), 0};
    return k_share<K>(w, x.qx, x.bs, t);
}

template <int K>
__device__ __forceinline__ float unit_combine(const uint8_t *w, ksums s, const act_unit &x) {
    if (block32_format(K)) return legacy_combine<K>(w, s.sumi, x.dx, x.sd);
    return k_combine<K>(w, s, x.dx);
}

// Lane LANE's partial of the row at WR: G lanes take a unit (4 a 32-block, 8 a super-block), the
// warp U = 32 / G units a pass, group o = lane / G unit Uk + o in pass k. The group adds its
// shares' integers exactly, then has the unit's float. Unit u belongs in lane u % 32's partial
// (the canonical order): lane L's unit of pass k is Uk + L % U, if L / U == k % G, and group
// L % U has it, so one shuffle a pass hands it over.
template <int K, int BB>
__device__ __forceinline__ float block_row_partial(const uint8_t *wr, const uint8_t *a, int cols, int lane) {
    const int G = block32_format(K) ? 4 : 8, U = 32 / G, nb = cols / (block32_format(K) ? 32 : 256);
    float p = 0.0f;
    for (int k = 0; U * k < nb; k++) {
        const int b = U * k + lane / G;
        const uint8_t *w = wr + (uint64_t)b * BB;
        act_unit x = {};
        ksums s = {0, 0};
        if (b < nb) {
            x = act_at<K>(a, cols, b);
            s = unit_share<K>(w, x, lane % G);
        }
        for (int m = 1; m < G; m *= 2) {
            s.sumi += __shfl_xor_sync(0xffffffffu, s.sumi, m);
            if (has_mins(K)) s.summ += __shfl_xor_sync(0xffffffffu, s.summ, m);
        }
        const float unit = b < nb ? unit_combine<K>(w, s, x) : 0.0f;
        const float mine = __shfl_sync(0xffffffffu, unit, G * (lane % U));
        if (lane / U == k % G && U * k + lane % U < nb) p = __fadd_rn(p, mine);
    }
    return p;
}

// ---- one row against one prepared activation column: the warp's whole product ----
// K: the weight format (enum wtype), BB: bytes of its block (unit). Every lane returns the sum.
template <int K, int BB>
__device__ __forceinline__ float row_dot(const uint8_t *wr, const uint8_t *a, int cols, int lane) {
    float p = 0.0f;
    if (float_format(K)) {
        const float *x = (const float *)a;
        for (int i = lane; i < cols; i += 32) p = __fadd_rn(p, __fmul_rn(fweight<K>(wr, i), x[i]));
    } else {
        p = block_row_partial<K, BB>(wr, a, cols, lane);
    }
    return reduce32(p);
}

#define MATVEC_PARAMS const uint8_t *__restrict__ w, uint64_t row_bytes, const uint8_t *__restrict__ act, \
                      uint64_t act_stride, float *__restrict__ y, int rows, int cols, int n

template <int K, int BB>
__device__ __forceinline__ void matvec(MATVEC_PARAMS) {
    const int lane = threadIdx.x & 31, r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const uint8_t *wr = w + (uint64_t)r * row_bytes;
    for (int j = 0; j < n; j++) {
        float p = row_dot<K, BB>(wr, act + (uint64_t)j * act_stride, cols, lane);
        if (lane == 0) y[(uint64_t)j * rows + r] = p;
    }
}

// ---- the routed experts' SwiGLU: gate, up, silu(g) * u, quantise, down ----
// A job is one (expert, token) pair: its three matrices' device addresses and the column of the
// prepared activations it reads. The CPU sums the jobs' outputs with the routing weights, in its
// own order, so nothing here depends on how the jobs are spread over the grid.
struct moe_job { uint64_t gate, up, down; uint32_t column, pad; };

// e^x, the same bits as coli.c's ops_exp: x = n ln2 + r with |r| <= ln2/2, e^r by its Taylor
// series to r^10 in double (relative error < 1e-12), scaled by 2^n, rounded once to float.
// Only IEEE double add/multiply (no FMA, -fmad=false), so CPU and GPU agree bit for bit.
__device__ __forceinline__ float exp_canonical(float x) {
    if (x != x) return x;
    if (x > 88.8f) return __int_as_float(0x7f800000);
    if (x < -104.0f) return 0.0f;
    const double shift = 6755399441055744.0; // 1.5 * 2^52: adding it rounds to an integer
    double n = __dsub_rn(__dadd_rn(__dmul_rn((double)x, 1.4426950408889634), shift), shift);
    double r = __dsub_rn((double)x, __dmul_rn(n, 0.6931471805599453));
    double p = 1.0 / 3628800.0;
    const double inv[10] = {1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0,
                            1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};
    for (int i = 0; i < 10; i++) p = __dadd_rn(__dmul_rn(p, r), inv[i]);
    double scale = __longlong_as_double((long long)((int)n + 1023) << 52);
    return __double2float_rn(__dmul_rn(p, scale));
}

__device__ __forceinline__ float silu_canonical(float x) {
    return __fdiv_rn(x, __fadd_rn(1.0f, exp_canonical(-x)));
}

#define MOE_GATE_UP_PARAMS const moe_job *__restrict__ jobs, const uint8_t *__restrict__ act, uint64_t act_stride, \
                           float *__restrict__ h, uint64_t row_bytes, int ff, int cols

// h[job][r] = silu(gate_r . x) * (up_r . x), x = the job's column of ACT; grid (ceil(ff / 4), jobs).
template <int K, int BB>
__device__ __forceinline__ void moe_gate_up(MOE_GATE_UP_PARAMS) {
    const int lane = threadIdx.x & 31, r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= ff) return;
    const moe_job jb = jobs[blockIdx.y];
    if (!jb.gate) return; // an expert the CPU computes (moe_combine reads its output from there)
    const uint8_t *x = act + (uint64_t)jb.column * act_stride;
    float g = row_dot<K, BB>((const uint8_t *)jb.gate + (uint64_t)r * row_bytes, x, cols, lane);
    float u = row_dot<K, BB>((const uint8_t *)jb.up + (uint64_t)r * row_bytes, x, cols, lane);
    if (lane == 0) h[(uint64_t)blockIdx.y * ff + r] = __fmul_rn(silu_canonical(g), u);
}

#define MOE_DOWN_PARAMS const moe_job *__restrict__ jobs, const uint8_t *__restrict__ act, uint64_t act_stride, \
                        float *__restrict__ y, uint64_t row_bytes, int rows, int cols

// y[job][r] = down_r . (the job's quantised h); grid (ceil(rows / 4), jobs).
template <int K, int BB>
__device__ __forceinline__ void moe_down(MOE_DOWN_PARAMS) {
    const int lane = threadIdx.x & 31, r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows || !jobs[blockIdx.y].down) return;
    const uint8_t *wr = (const uint8_t *)jobs[blockIdx.y].down + (uint64_t)r * row_bytes;
    float p = row_dot<K, BB>(wr, act + (uint64_t)blockIdx.y * act_stride, cols, lane);
    if (lane == 0) y[(uint64_t)blockIdx.y * rows + r] = p;
}

// ---- activation quantisation on the device: coli.c's quant_act_prepare, bit for bit ----

// ggml's nearest_int: round half to even for |v| < 2^22.
__device__ __forceinline__ int nearest_int(float v) {
    return (__float_as_int(__fadd_rn(v, 12582912.0f)) & 0x007fffff) - 0x00400000;
}

// Rows of N elements at X (row j at x + j*n) into prepared columns at ACT (stride bytes apart).
#define QUANT_PARAMS const float *__restrict__ x, uint8_t *__restrict__ act, uint64_t stride, int n

// Q8 (for the 32-block formats): one warp per 32-block; grid (ceil(blocks / 4), rows). Layout
// qs[n] | d[n/32] | s[n/32] | sd[n/32] = fp16(d * s).
// The 32-block whose element l lane l holds (V), as coli.c's quant_act_q8: its largest
// magnitude over 127 into *D (an all-NaN block's amax is 0, as on the CPU); returns the lane's
// quant, nearest_int(v 127 / amax) (0 where d rounds to 0 in fp16).
__device__ __forceinline__ int q8_quantize(float v, float *d) {
    float amax = fmaxf(0.0f, fabsf(v));
    for (int s = 16; s > 0; s /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, s));
    *d = __fdiv_rn(amax, 127.0f);
    return nearest_int(__fmul_rn(v, round_f16(*d) != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f));
}

extern "C" __global__ void quantize_q8(QUANT_PARAMS) {
    const int lane = threadIdx.x & 31, b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), nb = n / 32;
    if (b >= nb) return;
    const float v = x[(uint64_t)blockIdx.y * n + 32 * b + lane];
    uint8_t *a = act + (uint64_t)blockIdx.y * stride;
    float d;
    const int q = q8_quantize(v, &d);
    const float d16 = round_f16(d);
    int sum = q;
    for (int s = 16; s > 0; s /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, s);
    ((int8_t *)a)[32 * b + lane] = (int8_t)q;
    if (lane == 0) {
        ((float *)(a + n))[b] = d16;
        ((int *)(a + n + 4 * nb))[b] = sum;
        ((float *)(a + n + 8 * nb))[b] = round_f16(__fmul_rn(d, (float)sum));
    }
}

// Q8_K (for the 256-super-block formats): one warp per 256-block, lane l holding elements 8l..8l+7;
// grid (ceil(blocks / 4), rows). The scale comes from the first element of largest magnitude.
// Layout qs[n] | d[n/256] | bsums[n/16] (int16).
extern "C" __global__ void quantize_q8k(QUANT_PARAMS) {
    const int lane = threadIdx.x & 31, b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), nb = n / 256;
    if (b >= nb) return;
    const float *xb = x + (uint64_t)blockIdx.y * n + 256 * b + 8 * lane;
    uint8_t *a = act + (uint64_t)blockIdx.y * stride;
    float amax = 0.0f, max = 0.0f;
    int at = 256;
    for (int j = 0; j < 8; j++)
        if (fabsf(xb[j]) > amax) { amax = fabsf(xb[j]); max = xb[j]; at = 8 * lane + j; }
    for (int s = 16; s > 0; s /= 2) {
        float oa = __shfl_xor_sync(0xffffffffu, amax, s), om = __shfl_xor_sync(0xffffffffu, max, s);
        int oat = __shfl_xor_sync(0xffffffffu, at, s);
        if (oa > amax || (oa == amax && oat < at)) { amax = oa; max = om; at = oat; }
    }
    float iscale = amax != 0.0f ? __fdiv_rn(-127.0f, max) : 0.0f;
    if (isinf(iscale)) iscale = 0.0f;
    int sum = 0;
    for (int j = 0; j < 8; j++) {
        int v = iscale != 0.0f ? nearest_int(__fmul_rn(iscale, xb[j])) : 0;
        v = v < 127 ? v : 127;
        ((int8_t *)a)[256 * b + 8 * lane + j] = (int8_t)v;
        sum += v;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1); // a 16-group is lanes 2g and 2g + 1
    if ((lane & 1) == 0) ((int16_t *)(a + n + 4 * nb))[16 * b + lane / 2] = (int16_t)sum;
    if (lane == 0) ((float *)(a + n))[b] = iscale != 0.0f ? __fdiv_rn(1.0f, iscale) : 0.0f;
}

// Float weights: x rounded as the weights are (MODE 0 F32: as is, 1 F16, 2 BF16, nearest even);
// one thread per element, grid (ceil(n / 128), rows).
extern "C" __global__ void quantize_float(QUANT_PARAMS, int mode) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[(uint64_t)blockIdx.y * n + i];
    if (mode == 1) v = round_f16(v);
    if (mode == 2) {
        unsigned u = __float_as_uint(v);
        u = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) & 0xffff0000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        v = __uint_as_float(u);
    }
    ((float *)(act + (uint64_t)blockIdx.y * stride))[i] = v;
}

// ---- the rest of a layer after its mixer: residual and norm, routing, the experts' sum ----
// Where one device holds a layer's output projection, router, shared expert and routed experts
// (those it has: the CPU computes the others), everything from the mixer's output to the next
// layer's projections stays there (coli.c cuda_moe_layer_start), and only the new hidden state
// and the chosen ids (for the CPU's heat) come back: one wait a layer.

// A resident expert's three matrices (coli.c's struct cuda_expert), an entry of a layer's table.
struct moe_expert { uint64_t gate, up, down; };

// The routed experts a layer can have (Qwen3-Next: 512); 16 a lane.
#define ROUTE_MAX_EXPERTS 512
#define ROUTE_PER_LANE (ROUTE_MAX_EXPERTS / 32)

// Whether (value A, id IA) is chosen over (B, IB) as coli.c's scan would: the larger value, or
// where neither is larger (equal, or NaN: then every value is NaN) the lower id; id -1 never.
__device__ __forceinline__ bool route_better(float a, int ia, float b, int ib) {
    if (ia < 0 || ib < 0) return ib < 0 && ia >= 0;
    if (a > b || b > a) return a > b;
    return ia < ib;
}

// coli.c's model_select_experts for token t = blockIdx.x, bit for bit, one warp a token: the
// softmax of LOGITS[t] (ops_softmax: the maximum, e^(x - max) by exp_canonical, the sum in
// double over 16 partials, partial j taking elements j, j + 16, ... in order, the partials met
// by the butterfly 8, 4, 2, 1, one scale), then USED times the best expert not yet taken, their
// probabilities renormalised by their sum in double. Lane l holds elements l + 32m in
// registers; partial j's chain alternates lanes j and j + 16. Writes job t*used + k as TABLE's
// entry for the k-th choice reading column t, its weight and its id.
extern "C" __global__ void moe_route(const float *__restrict__ logits, int n_expert, int used, const moe_expert *__restrict__ table,
                                     moe_job *__restrict__ jobs, float *__restrict__ weights, int *__restrict__ ids) {
    const int lane = threadIdx.x & 31, t = blockIdx.x;
    const float *x = logits + (uint64_t)t * n_expert;
    float p[ROUTE_PER_LANE];
    float max = x[0];
    for (int m = 0; m < ROUTE_PER_LANE; m++) {
        const int i = lane + 32 * m;
        p[m] = i < n_expert ? x[i] : 0.0f;
        if (i < n_expert) max = p[m] > max ? p[m] : max;
    }
    for (int s = 16; s > 0; s /= 2) {
        const float o = __shfl_xor_sync(0xffffffffu, max, s);
        max = o > max ? o : max;
    }
    double part = 0.0;
    for (int m = 0; m < ROUTE_PER_LANE; m++) {
        const int i = lane + 32 * m;
        if (i < n_expert) p[m] = exp_canonical(__fsub_rn(p[m], max));
        const float upper = __shfl_down_sync(0xffffffffu, p[m], 16);
        if (lane < 16 && i < n_expert) part = __dadd_rn(part, (double)p[m]);
        if (lane < 16 && i + 16 < n_expert) part = __dadd_rn(part, (double)upper);
    }
    for (int s = 8; s > 0; s /= 2) part = __dadd_rn(part, __shfl_down_sync(0xffffffffu, part, s));
    const float inv = __double2float_rn(__ddiv_rn(1.0, __shfl_sync(0xffffffffu, part, 0)));
    for (int m = 0; m < ROUTE_PER_LANE; m++) p[m] = __fmul_rn(p[m], inv);
    unsigned taken = 0; // bit m: element lane + 32m chosen
    double sum = 0.0;
    float w[32];
    int id[32];
    for (int k = 0; k < used; k++) {
        float bv = 0.0f;
        int bi = -1;
        for (int m = 0; m < ROUTE_PER_LANE; m++) {
            const int i = lane + 32 * m;
            if (i < n_expert && !(taken >> m & 1) && route_better(p[m], i, bv, bi)) { bv = p[m]; bi = i; }
        }
        for (int s = 16; s > 0; s /= 2) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, s);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, s);
            if (route_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        if (bi >= 0 && (bi & 31) == lane) taken |= 1u << (bi >> 5);
        w[k] = bv;
        id[k] = bi;
        sum = __dadd_rn(sum, (double)bv);
    }
    const float total = __double2float_rn(sum);
    for (int k = lane; k < used; k += 32) {
        const uint64_t a = (uint64_t)t * used + k;
        const moe_expert e = table[id[k]];
        jobs[a] = moe_job{e.gate, e.up, e.down, (uint32_t)t, 0};
        weights[a] = __fdiv_rn(w[k], total);
        ids[a] = id[k];
    }
}

// sigmoid(x) = 1 / (1 + e^-x), coli.c's ops_sigmoid.
__device__ __forceinline__ float sigmoid_canonical(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_canonical(-x)));
}

// The layer's output, coli.c's model_ffn sum: out[t][i] = sum_k weights[t][k] y[t*used + k][i]
// in the order of the choices (a product, then an add each), plus, with SHARED_Y (else NULL),
// the shared expert's output shared_y[t] times sigmoid(gate_logit[t]); with RESIDUAL (else NULL),
// residual[t][i] + that, as coli.c adds a layer's output to the hidden state. A job the CPU
// computed (its expert is not here: no matrices in JOBS) has its output in CPU_Y, same rows.
// Grid (ceil(dim / 128), T).
extern "C" __global__ void moe_combine(const float *__restrict__ y, const float *__restrict__ weights,
                                       const float *__restrict__ gate_logit, const float *residual, float *out, int used,
                                       int dim, const float *__restrict__ shared_y, const moe_job *__restrict__ jobs,
                                       const float *__restrict__ cpu_y) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (i >= dim) return;
    float o = 0.0f;
    for (int k = 0; k < used; k++) {
        const uint64_t a = (uint64_t)t * used + k;
        const float *ya = jobs[a].gate ? y : cpu_y;
        const float v = __fmul_rn(ya[a * dim + i], weights[a]);
        o = k ? __fadd_rn(o, v) : v;
    }
    if (shared_y) o = __fadd_rn(o, __fmul_rn(shared_y[(uint64_t)t * dim + i], sigmoid_canonical(gate_logit[t])));
    if (residual) o = __fadd_rn(residual[(uint64_t)t * dim + i], o);
    out[(uint64_t)t * dim + i] = o;
}

// A sum in double of a warp's run of values in coli.c's ops_parts_sum order: value e (lane e % 32
// of pass e / 32) into partial e % 16 in increasing e, the partials met by the butterfly 8, 4, 2,
// 1 (parts_total). Call once a pass with the lane's value V (VALID 0: none; UPPER_VALID: lane +
// 16's is one); PART is lane 0..15's partial.
__device__ __forceinline__ double parts_add(double part, double v, bool valid, bool upper_valid) {
    const int lane = threadIdx.x & 31;
    const double upper = __shfl_down_sync(0xffffffffu, v, 16);
    if (lane < 16 && valid) part = __dadd_rn(part, v);
    if (lane < 16 && upper_valid) part = __dadd_rn(part, upper);
    return part;
}

// ... of the squares of floats, as ops_sum_squares (each square exact in double).
__device__ __forceinline__ double squares_add(double part, float v, bool valid, bool upper_valid) {
    return parts_add(part, __dmul_rn((double)v, (double)v), valid, upper_valid);
}

// The partials of parts_add met, in every lane.
__device__ __forceinline__ double parts_total(double part) {
    for (int s = 8; s > 0; s /= 2) part = __dadd_rn(part, __shfl_down_sync(0xffffffffu, part, s));
    return __shfl_sync(0xffffffffu, part, 0);
}

// Token t = blockIdx.x of coli.c's model_residual_norm, one warp a token: x[t] += y[t] (where
// Y is not NULL), then xn[t] = rmsnorm(x[t]) * w (ops_rmsnorm: the squares in double, element
// i into partial i % 16 in order, the partials met by the butterfly 8, 4, 2, 1; the mean and
// the scale in float). Lane l takes elements l + 32m, so partial j's chain alternates lanes j
// and j + 16.
extern "C" __global__ void residual_norm(float *x, const float *__restrict__ y, const float *__restrict__ w, float *__restrict__ xn,
                                         int dim, float eps) {
    const int lane = threadIdx.x & 31;
    float *xr = x + (uint64_t)blockIdx.x * dim, *nr = xn + (uint64_t)blockIdx.x * dim;
    const float *yr = y ? y + (uint64_t)blockIdx.x * dim : NULL;
    double part = 0.0;
    for (int i0 = 0; i0 < dim; i0 += 32) {
        const int i = i0 + lane;
        float v = 0.0f;
        if (i < dim) v = xr[i];
        if (i < dim && y) xr[i] = v = __fadd_rn(v, yr[i]);
        part = squares_add(part, v, i < dim, i + 16 < dim);
    }
    const float mean = __double2float_rn(__ddiv_rn(parts_total(part), (double)dim));
    const float scale = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
    for (int i = lane; i < dim; i += 32) nr[i] = __fmul_rn(__fmul_rn(xr[i], scale), w[i]);
}

// One set of entry points per weight format: matvec_<t>, moe_gate_up_<t>, moe_down_<t>.
#define KERNELS(name, K, BB) \
    extern "C" __global__ void matvec_##name(MATVEC_PARAMS) { matvec<K, BB>(w, row_bytes, act, act_stride, y, rows, cols, n); } \
    extern "C" __global__ void moe_gate_up_##name(MOE_GATE_UP_PARAMS) { moe_gate_up<K, BB>(jobs, act, act_stride, h, row_bytes, ff, cols); } \
    extern "C" __global__ void moe_down_##name(MOE_DOWN_PARAMS) { moe_down<K, BB>(jobs, act, act_stride, y, row_bytes, rows, cols); }

// The formats with kernels: X(name, type, block bytes). tests/kernels_sim.cc lists the entry
// points by the same list.
#define KERNEL_FORMATS(X) \
    X(f32, F32, 4) \
    X(f16, F16, 2) \
    X(bf16, BF16, 2) \
    X(q8_0, Q8_0, 34) \
    X(q4_0, Q4_0, 18) \
    X(q4_1, Q4_1, 20) \
    X(q5_0, Q5_0, 22) \
    X(q5_1, Q5_1, 24) \
    X(iq4_nl, IQ4_NL, 18) \
    X(mxfp4, MXFP4, 17) \
    X(q2_k, Q2_K, 84) \
    X(q3_k, Q3_K, 110) \
    X(q4_k, Q4_K, 144) \
    X(q5_k, Q5_K, 176) \
    X(q6_k, Q6_K, 210) \
    X(iq4_xs, IQ4_XS, 136) \
    X(iq3_xxs, IQ3_XXS, 98) \
    X(iq3_s, IQ3_S, 110)

KERNEL_FORMATS(KERNELS)

// ---- Gated DeltaNet on the device: coli.c's model_gated_deltanet, bit for bit ----
// Where a DeltaNet layer's projections were made on the device by the layer before it, its
// mixer runs there too (coli.c cuda_deltanet_launch), over the sequences' recurrent states kept
// in device memory: STATES[t] is the address of token t's sequence's state, a run of floats laid
// out as coli.c's checkpoints (per DeltaNet layer its conv state [K-1][conv_dim], then its ssm
// state [nv][dk][dv]); LAYER_OFF is this layer's place in it, in floats. A batch's tokens go
// through their states in order, as on the CPU.

// coli.c's ops_ln for a positive normal z: z = m 2^k, m in [sqrt(1/2), sqrt(2)), ln m =
// 2 atanh(s), s = (m - 1) / (m + 1), by its series to s^21.
__device__ __forceinline__ double ln_canonical(double z) {
    long long bits = __double_as_longlong(z);
    int k = (int)(bits >> 52) - 1023;
    double m = __longlong_as_double((bits & 0x000fffffffffffffLL) | 0x3ff0000000000000LL);
    if (m > 1.4142135623730951) { m = __dmul_rn(m, 0.5); k++; }
    const double s = __ddiv_rn(__dsub_rn(m, 1.0), __dadd_rn(m, 1.0)), s2 = __dmul_rn(s, s);
    double t = 1.0 / 21;
    for (int j = 19; j >= 1; j -= 2) t = __dadd_rn(__dmul_rn(t, s2), __ddiv_rn(1.0, (double)j));
    const double ln2_hi = 6.93147180369123816490e-01, ln2_lo = 1.90821492927058770002e-10;
    return __dadd_rn(__dmul_rn((double)k, ln2_hi), __dadd_rn(__dmul_rn(__dmul_rn(2.0, s), t), __dmul_rn((double)k, ln2_lo)));
}

// coli.c's ops_softplus: log(1 + e^x), x above 20 as is; e^x rounded to float first; ln(1 + y)
// by its own series below 2^-10.
__device__ __forceinline__ float softplus_canonical(float x) {
    if (x > 20.0f) return x;
    const double y = (double)exp_canonical(x);
    if (!(y >= 0.0)) return (float)y;
    if (y < 0.0009765625)
        return __double2float_rn(__dmul_rn(y, __dsub_rn(1.0, __dmul_rn(y, __dsub_rn(0.5, __dmul_rn(y, __dsub_rn(1.0 / 3,
               __dmul_rn(y, __dsub_rn(0.25, __dmul_rn(y, __dsub_rn(0.2, __ddiv_rn(y, 6.0))))))))))));
    return __double2float_rn(ln_canonical(__dadd_rn(1.0, y)));
}

// The causal conv of DeltaNet channels, coli.c's model_conv_task: block b (one warp) takes
// channels [b*dk, (b+1)*dk), lane l those l + 32m, and for each token in order: the sum over the
// taps, oldest first, from 0; the state shifted by one input; SiLU; then for a q or k head (the
// channels below 2*Q_END) the L2 norm (ops_l2norm: the squares in ops_sum_squares' order, the
// norm's root in float, the division by max(norm, eps)) and for q (below Q_END) the scale QSCALE.
// MIXED [T][conv_dim] in place; TAPS [K][conv_dim]. Grid ceil(conv_dim / dk).
extern "C" __global__ void deltanet_conv(float *mixed, const float *__restrict__ taps, const uint64_t *__restrict__ states,
                                         uint64_t layer_off, int conv_dim, int K, int dk, int q_end, float eps, float qscale, int T) {
    const int lane = threadIdx.x & 31, c0 = blockIdx.x * dk, c1 = c0 + dk < conv_dim ? c0 + dk : conv_dim;
    for (int t = 0; t < T; t++) {
        float *x = mixed + (uint64_t)t * conv_dim, *state = (float *)states[t] + layer_off;
        double part = 0.0;
        for (int i0 = c0; i0 < c1; i0 += 32) {
            const int ch = i0 + lane;
            float v = 0.0f;
            if (ch < c1) {
                float sum = 0.0f;
                for (int j = 0; j < K - 1; j++) sum = __fadd_rn(sum, __fmul_rn(taps[(uint64_t)j * conv_dim + ch], state[(uint64_t)j * conv_dim + ch]));
                const float in = x[ch];
                sum = __fadd_rn(sum, __fmul_rn(taps[(uint64_t)(K - 1) * conv_dim + ch], in));
                for (int j = 0; j + 1 < K - 1; j++) state[(uint64_t)j * conv_dim + ch] = state[(uint64_t)(j + 1) * conv_dim + ch];
                if (K > 1) state[(uint64_t)(K - 2) * conv_dim + ch] = in;
                x[ch] = v = silu_canonical(sum);
            }
            part = squares_add(part, v, ch < c1, ch + 16 < c1);
        }
        if (c0 >= 2 * q_end) continue; // a v channel: no norm
        const float norm = __fsqrt_rn(__double2float_rn(parts_total(part)));
        const float scale = __fdiv_rn(1.0f, norm > eps ? norm : eps);
        for (int ch = c0 + lane; ch < c1; ch += 32) {
            const float v = __fmul_rn(x[ch], scale);
            x[ch] = c0 < q_end ? __fmul_rn(v, qscale) : v;
        }
    }
}

// The gated delta rule, coli.c's ops_delta_rows_scalar: v-head h = blockIdx.y, row j of its
// state a lane (blockIdx.x * 32 + lane), every token in order. Its gates from the projections:
// beta = sigmoid(BETA), decay = e^(softplus(ALPHA + dt_bias) * a); with BA (Qwen3-Next) both come
// from BETA's fused rows [T][2 nv], per k-head group [b x r | a x r]. Its q and k are k-head g's
// (TILED: h mod nk, else h / (nv / nk)) in MIXED (after deltanet_conv); v its own. Writes
// CORE[t][h*dv + j]. Grid (ceil(dv / 32), nv).
extern "C" __global__ void deltanet_rule(const float *__restrict__ mixed, const float *__restrict__ beta_in, const float *__restrict__ alpha_in,
                                         int ba, const float *__restrict__ dt_bias, const float *__restrict__ ssm_a,
                                         const uint64_t *__restrict__ states, uint64_t ssm_off, int nk, int nv, int dk, int dv, int tiled,
                                         int conv_dim, int T, float *__restrict__ core) {
    const int lane = threadIdx.x & 31, h = blockIdx.y, j = blockIdx.x * 32 + lane, r = nv / nk, g = tiled ? h % nk : h / r;
    if (j >= dv) return;
    for (int t = 0; t < T; t++) {
        const float *x = mixed + (uint64_t)t * conv_dim, *q = x + (uint64_t)g * dk, *k = x + (uint64_t)(nk + g) * dk;
        const float *v = x + 2 * (uint64_t)nk * dk + (uint64_t)h * dv;
        const float b = ba ? beta_in[(uint64_t)t * 2 * nv + (h / r) * 2 * r + h % r] : beta_in[(uint64_t)t * nv + h];
        const float a = ba ? beta_in[(uint64_t)t * 2 * nv + (h / r) * 2 * r + r + h % r] : alpha_in[(uint64_t)t * nv + h];
        const float beta = sigmoid_canonical(b), decay = exp_canonical(__fmul_rn(softplus_canonical(__fadd_rn(a, dt_bias[h])), ssm_a[h]));
        float *S = (float *)states[t] + ssm_off + (uint64_t)h * dv * dk + j;
        float pred = 0.0f, o = 0.0f;
        for (int i = 0; i < dk; i++) {
            const float s = __fmul_rn(S[(uint64_t)i * dv], decay);
            S[(uint64_t)i * dv] = s;
            pred = __fadd_rn(pred, __fmul_rn(s, k[i]));
        }
        const float delta = __fmul_rn(beta, __fsub_rn(v[j], pred));
        for (int i = 0; i < dk; i++) {
            const float s = __fadd_rn(S[(uint64_t)i * dv], __fmul_rn(k[i], delta));
            S[(uint64_t)i * dv] = s;
            o = __fadd_rn(o, __fmul_rn(s, q[i]));
        }
        core[(uint64_t)t * nv * dv + (uint64_t)h * dv + j] = o;
    }
}

// The gated RMSNorm after the rule: core = rmsnorm(core) * w * silu(z) (ops_rmsnorm's order, as
// residual_norm), head h = blockIdx.x of token t = blockIdx.y a warp; W is per head where
// PER_HEAD, else one [dv] for all. Grid (nv, T).
extern "C" __global__ void deltanet_gate(float *core, const float *__restrict__ z, const float *__restrict__ w, int per_head, int dv,
                                         float eps) {
    const int lane = threadIdx.x & 31;
    const uint64_t row = ((uint64_t)blockIdx.y * gridDim.x + blockIdx.x) * dv;
    float *o = core + row;
    const float *wh = w + (per_head ? (uint64_t)blockIdx.x * dv : 0);
    double part = 0.0;
    for (int i0 = 0; i0 < dv; i0 += 32) part = squares_add(part, i0 + lane < dv ? o[i0 + lane] : 0.0f, i0 + lane < dv, i0 + lane + 16 < dv);
    const float mean = __double2float_rn(__ddiv_rn(parts_total(part), (double)dv));
    const float scale = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
    for (int i = lane; i < dv; i += 32) o[i] = __fmul_rn(__fmul_rn(__fmul_rn(o[i], scale), wh[i]), silu_canonical(z[row + i]));
}

// ---- gated attention on the device: coli.c's model_attention, bit for bit ----
// Where an attention layer's projections were made on the device by the layer before it, its
// mixer runs there too (coli.c cuda_attention_launch), over the sequences' KV caches kept in
// device memory in the CPU's layout and format KVF (coli.c's enum ops_kv: 0 f32, 1 f16, 2
// Q8_0): token t's at KV[t] + LAYER_OFF bytes, the keys [n_kv][rows] rows, then the values
// alike; POS[t] its position there. A Q8_0 row is GGUF's Q8_0 (32-blocks of an fp16 d and 32
// int8), quantised as coli.c's quant_act_q8; Q8_0 keys go in groups of 16 positions
// (ops_kv_store): dword m of every position's quants side by side (64 bytes), then each
// block's 16 scales.
#define KV_GROUP 16

__device__ __forceinline__ uint64_t kv_row_bytes(int hd, int kvf) { return kvf == 2 ? (uint64_t)hd / 32 * 34 : (uint64_t)hd * (kvf ? 2 : 4); }

// Element I of a cached row (a value row, for Q8_0) in its format; d q is exact in a float.
__device__ __forceinline__ float kv_get(const uint8_t *row, int i, int kvf) {
    if (kvf == 2) return __fmul_rn(f16(row + i / 32 * 34), (float)(int)((const int8_t *)row)[i / 32 * 34 + 2 + i % 32]);
    return kvf ? f16(row + 2 * i) : ((const float *)row)[i];
}
__device__ __forceinline__ void kv_put(uint8_t *row, int i, float v, int kvf) {
    if (kvf) ((unsigned short *)row)[i] = f16_bits(v);
    else ((float *)row)[i] = v;
}

// Row P of a Q8_0 cache's KV head at HEAD (KEYS: in the key groups) = the HD floats at X, a
// block a pass, lane l taking element l of each.
__device__ __forceinline__ void kv_put_q8(uint8_t *head, uint64_t p, const float *x, int hd, int keys) {
    const int lane = threadIdx.x & 31;
    const uint64_t rb = kv_row_bytes(hd, 2);
    uint8_t *group = head + p / KV_GROUP * KV_GROUP * rb, *row = head + p * rb;
    const int r = (int)(p % KV_GROUP);
    for (int b = 0; b < hd / 32; b++) {
        float d32;
        const int q = q8_quantize(x[32 * b + lane], &d32), i = 32 * b + lane;
        const unsigned short d = f16_bits(round_f16(d32));
        if (keys) group[i / 4 * 4 * KV_GROUP + 4 * r + i % 4] = (uint8_t)(q + 128);
        else row[b * 34 + 2 + lane] = (uint8_t)(int8_t)q;
        if (lane == 0 && keys) *(unsigned short *)(group + KV_GROUP * hd + 2 * (b * KV_GROUP + r)) = d;
        if (lane == 0 && !keys) *(unsigned short *)(row + b * 34) = d;
    }
}

// The per-head RMSNorm and partial NeoX RoPE of coli.c's model_attention, block x = a head of
// token t = blockIdx.y a warp: heads below N_HEAD are q's (in QG [T][n_head][2 hd], q then its
// gate), the rest k's ([T][n_kv][hd]), whose row goes to the cache at the token's position with
// V's. ROPE [T][rot]: rot/2 cosines then sines. rmsnorm(x) * w as ops_rmsnorm, then dims j and
// j + rot/2 rotated as ops_rope_neox; each lane writes only the elements it read (a Q8_0
// cache's rows are quantised after, a block at a time). Grid (n_head + n_kv, T).
extern "C" __global__ void attn_prep(float *qg, float *k, const float *__restrict__ v, const float *__restrict__ q_norm,
                                     const float *__restrict__ k_norm, const float *__restrict__ rope, const uint64_t *__restrict__ kv,
                                     uint64_t layer_off, const int *__restrict__ pos, int n_head, int n_kv, int hd, int rot, uint64_t rows,
                                     int kvf, float eps) {
    const int lane = threadIdx.x & 31, t = blockIdx.y, h = blockIdx.x, is_q = h < n_head, kh = h - n_head, half = rot / 2;
    float *x = is_q ? qg + ((uint64_t)t * n_head + h) * 2 * hd : k + ((uint64_t)t * n_kv + kh) * hd;
    const float *w = is_q ? q_norm : k_norm, *cs = rope + (uint64_t)t * rot, *vx = v + ((uint64_t)t * n_kv + kh) * hd;
    double part = 0.0;
    for (int i0 = 0; i0 < hd; i0 += 32) part = squares_add(part, i0 + lane < hd ? x[i0 + lane] : 0.0f, i0 + lane < hd, i0 + lane + 16 < hd);
    const float mean = __double2float_rn(__ddiv_rn(parts_total(part), (double)hd));
    const float scale = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
    const uint64_t rb = kv_row_bytes(hd, kvf);
    uint8_t *kh_rows = is_q ? NULL : (uint8_t *)kv[t] + layer_off + (uint64_t)kh * rows * rb;
    uint8_t *vh_rows = is_q ? NULL : kh_rows + (uint64_t)n_kv * rows * rb;
    uint8_t *kr = is_q || kvf == 2 ? NULL : kh_rows + (uint64_t)pos[t] * rb, *vr = kr ? vh_rows + (uint64_t)pos[t] * rb : NULL;
    for (int j = lane; j < half; j += 32) {
        const float a = __fmul_rn(__fmul_rn(x[j], scale), w[j]), b = __fmul_rn(__fmul_rn(x[j + half], scale), w[j + half]);
        const float c = cs[j], s = cs[half + j];
        x[j] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        x[j + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
        if (kr) kv_put(kr, j, x[j], kvf), kv_put(kr, j + half, x[j + half], kvf);
    }
    for (int i = rot + lane; i < hd; i += 32) {
        x[i] = __fmul_rn(__fmul_rn(x[i], scale), w[i]);
        if (kr) kv_put(kr, i, x[i], kvf);
    }
    for (int i = lane; vr && i < hd; i += 32) kv_put(vr, i, vx[i], kvf);
    if (is_q || kvf != 2) return;
    __syncwarp(); // the row's elements, written by other lanes
    kv_put_q8(kh_rows, (uint64_t)pos[t], x, hd, 1);
    kv_put_q8(vh_rows, (uint64_t)pos[t], vx, hd, 0);
}

// Score of query Q (hd floats, a multiple of 16) against key row K, coli.c's ops_scores order:
// element i into partial i % 16, the partials met by the butterfly 8, 4, 2, 1, times SCALE. One
// lane alone; the partials in registers.
__device__ __forceinline__ float attn_score(const float *q, const uint8_t *kr, int hd, int kvf, float scale) {
    float p[16];
    for (int j = 0; j < 16; j++) p[j] = 0.0f;
    for (int i0 = 0; i0 < hd; i0 += 16)
        for (int j = 0; j < 16; j++) p[j] = __fadd_rn(p[j], __fmul_rn(q[i0 + j], kv_get(kr, i0 + j, kvf)));
    for (int s = 8; s > 0; s /= 2)
        for (int j = 0; j < s; j++) p[j] = __fadd_rn(p[j], p[j + s]);
    return __fmul_rn(p[0], scale);
}

// Scores of rows l + 32r (r < ATTN_LANE_ROWS, those below N) of a split whose Q8_0 keys start
// at the group at KEYS, in lane l's S[r], coli.c's ops_score_q8_0 order: Q quantised as an
// activation (lane l holding dword l + 32k of its quants, QW[k], and block l's d, QD), each
// block's integer sum exact, acc = acc + (d_k d_q) isum in block order, times SCALE. A dword
// step is one shuffle for all 32 rows.
#define ATTN_SPLIT 256
#define ATTN_LANE_ROWS (ATTN_SPLIT / 32)
__device__ __forceinline__ void attn_scores_q8(const float *q, const uint8_t *keys, int hd, int n, float scale, float *s) {
    const int lane = threadIdx.x & 31, words = hd / 4;
    int qw[4] = {0, 0, 0, 0};
    float qd = 0.0f;
    for (int b = 0; b < hd / 32; b++) { // dword 8b + m of the quants, from lanes 4m .. 4m + 3, to lane 8 (b % 4) + m
        float d;
        const int qi = q8_quantize(q[32 * b + lane], &d);
        if (lane == b) qd = round_f16(d);
        int word = 0;
        for (int e = 0; e < 4; e++) word |= __shfl_sync(0xffffffffu, qi & 0xff, 4 * (lane & 7) + e) << 8 * e;
        for (int k = 0; k < 4; k++)
            if (k == b / 4 && lane / 8 == b % 4) qw[k] = word;
    }
    const uint64_t rb = kv_row_bytes(hd, 2);
    for (int r = 0; r < ATTN_LANE_ROWS; r++) {
        const int p = lane + 32 * r;
        const uint8_t *g = keys + (uint64_t)(p / KV_GROUP) * KV_GROUP * rb;
        float acc = 0.0f;
        int isum = 0;
        for (int k = 0; k < 4; k++)
            for (int m = 0; m < 32 && 32 * k + m < words; m++) {
                const int w = 32 * k + m, qd4 = __shfl_sync(0xffffffffu, qw[k], m);
                const unsigned kd = p < n ? *(const unsigned *)(g + (uint64_t)w * 4 * KV_GROUP + 4 * (p % KV_GROUP)) : 0x80808080u;
                for (int e = 0; e < 4; e++) isum += ((int)(kd >> 8 * e & 0xff) - 128) * (int)(signed char)(qd4 >> 8 * e);
                if (w % 8 == 7) {
                    const int b = w / 8;
                    const float dk = p < n ? f16(g + KV_GROUP * hd + 2 * (b * KV_GROUP + p % KV_GROUP)) : 0.0f;
                    acc = __fadd_rn(acc, __fmul_rn(__fmul_rn(dk, __shfl_sync(0xffffffffu, qd, b)), (float)isum));
                    isum = 0;
                }
            }
        s[r] = __fmul_rn(acc, scale);
    }
}

// coli.c's ops_attention on the device: a head's rows in splits of ATTN_SPLIT (OPS_ATTN_SPLIT),
// a warp each (attn_split), so that a long context keeps the card busy; then a warp a head
// merges its splits in order (attn_merge). A split's record in PARTS, HD + 4 floats: its
// largest score, its sum in double at float 2, its output from float 4; records [token of the
// launch][head][split], SPLITS a head.

// Split c of head h of token t = t0 + blockIdx.y, blockIdx.x = h splits + c, a warp: rows
// c ATTN_SPLIT on of the first pos[t] + 1 of its KV head's cache (h / (n_head / n_kv)). The
// scores (lane l takes rows l + 32r and keeps them), their softmax (ops_softmax: the maximum
// from the split's first row on, a NaN counting only there; e^(s - max) by exp_canonical; the
// sum in double over 16 partials, row p into partial p % 16 in order; one scale), the values
// (o[i] = fma(w_p, v_p[i], o[i]) from zero in increasing p, lane l taking elements l + 32m).
// A split past the token's rows writes nothing.
extern "C" __global__ void attn_split(const float *__restrict__ qg, const uint64_t *__restrict__ kv, uint64_t layer_off,
                                      const int *__restrict__ pos, int t0, int n_head, int n_kv, int hd, uint64_t rows, int kvf,
                                      float scale, int splits, float *__restrict__ parts) {
    const int lane = threadIdx.x & 31, t = t0 + blockIdx.y, h = blockIdx.x / splits, c = blockIdx.x % splits;
    const int rest = pos[t] + 1 - c * ATTN_SPLIT, n = rest < ATTN_SPLIT ? rest : ATTN_SPLIT;
    if (n <= 0) return;
    const float *q = qg + ((uint64_t)t * n_head + h) * 2 * hd;
    const uint64_t row = kv_row_bytes(hd, kvf);
    const uint8_t *keys = (const uint8_t *)kv[t] + layer_off + (uint64_t)(h / (n_head / n_kv)) * rows * row + (uint64_t)c * ATTN_SPLIT * row;
    const uint8_t *vals = keys + (uint64_t)n_kv * rows * row;
    float s[ATTN_LANE_ROWS];
    if (kvf == 2) attn_scores_q8(q, keys, hd, n, scale, s);
    else
        for (int r = 0; r < ATTN_LANE_ROWS; r++) s[r] = lane + 32 * r < n ? attn_score(q, keys + (lane + 32 * r) * row, hd, kvf, scale) : 0.0f;
    float max = __shfl_sync(0xffffffffu, s[0], 0);
    for (int r = 0; r < ATTN_LANE_ROWS; r++) max = lane + 32 * r < n && s[r] > max ? s[r] : max;
    for (int d = 16; d > 0; d /= 2) {
        const float o = __shfl_xor_sync(0xffffffffu, max, d);
        max = o > max ? o : max;
    }
    double part = 0.0;
    for (int r = 0; r < ATTN_LANE_ROWS; r++) {
        const int p = lane + 32 * r;
        s[r] = p < n ? exp_canonical(__fsub_rn(s[r], max)) : 0.0f;
        part = parts_add(part, (double)s[r], p < n, p + 16 < n);
    }
    const double sum = parts_total(part);
    const float inv = __double2float_rn(__ddiv_rn(1.0, sum));
    float o[16];
    for (int m = 0; m < 16; m++) o[m] = 0.0f;
    for (int r = 0; r < ATTN_LANE_ROWS && 32 * r < n; r++) {
        const float w = __fmul_rn(s[r], inv);
        for (int k = 0; k < 32 && 32 * r + k < n; k++) {
            const float wk = __shfl_sync(0xffffffffu, w, k);
            const uint8_t *vr = vals + (uint64_t)(32 * r + k) * row;
            for (int m = 0; m < 16 && lane + 32 * m < hd; m++) o[m] = __fmaf_rn(wk, kv_get(vr, lane + 32 * m, kvf), o[m]);
        }
    }
    float *rec = parts + (((uint64_t)blockIdx.y * n_head + h) * splits + c) * (hd + 4);
    if (lane == 0) rec[0] = max, *(double *)(rec + 2) = sum;
    for (int m = 0; m < 16 && lane + 32 * m < hd; m++) rec[4 + lane + 32 * m] = o[m];
}

// Head h = blockIdx.x of token t = t0 + blockIdx.y a warp: its splits' records merged in order
// (ops_attn_merge: each side's share of the new sum, its sum times e^(its max - the new max) in
// double, as a float weight; o = fma(wc, oc, wo o), lane l taking elements l + 32m; the first
// split as it is), then the sigmoid gate. OUT [T][n_head][hd].
extern "C" __global__ void attn_merge(const float *__restrict__ qg, const int *__restrict__ pos, int t0, int n_head, int hd, int splits,
                                      const float *__restrict__ parts, float *__restrict__ out) {
    const int lane = threadIdx.x & 31, t = t0 + blockIdx.y, h = blockIdx.x, n = (pos[t] + ATTN_SPLIT) / ATTN_SPLIT;
    const float *rec = parts + ((uint64_t)blockIdx.y * n_head + h) * splits * (hd + 4), *gate = qg + ((uint64_t)t * n_head + h) * 2 * hd + hd;
    float o[16], max = rec[0];
    double sum = *(const double *)(rec + 2);
    for (int m = 0; m < 16 && lane + 32 * m < hd; m++) o[m] = rec[4 + lane + 32 * m];
    for (int c = 1; c < n; c++) {
        const float *rc = rec + (uint64_t)c * (hd + 4), max_c = rc[0], top = max_c > max ? max_c : max;
        const double a = __dmul_rn((double)exp_canonical(__fsub_rn(max, top)), sum);
        const double b = __dmul_rn((double)exp_canonical(__fsub_rn(max_c, top)), *(const double *)(rc + 2)), total = __dadd_rn(a, b);
        const float wo = __double2float_rn(__ddiv_rn(a, total)), wc = __double2float_rn(__ddiv_rn(b, total));
        for (int m = 0; m < 16 && lane + 32 * m < hd; m++) o[m] = __fmaf_rn(wc, rc[4 + lane + 32 * m], __fmul_rn(wo, o[m]));
        max = top, sum = total;
    }
    float *y = out + ((uint64_t)t * n_head + h) * hd;
    for (int m = 0; m < 16 && lane + 32 * m < hd; m++) y[lane + 32 * m] = __fmul_rn(sigmoid_canonical(gate[lane + 32 * m]), o[m]);
}

// N words from SRC to DST, a thread each; grid ceil(n / 128) of 128: a chain's chosen ids into
// its last layer's download, so that a decode step comes back in one copy (coli.c cuda_moe_layer).
extern "C" __global__ void copy_words(const unsigned *__restrict__ src, unsigned *__restrict__ dst, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}

// A split layer's routing to the CPU (coli.c cuda_moe_layer_start) without a copy call: N words
// from SRC into DST, in host memory mapped for the device, then *COUNT there one more. The CPU
// polls COUNT; a value seen there means the words are there too (each lane's fence, the warp's
// barrier, lane 0's fence: the classic signal). One warp.
extern "C" __global__ void publish_words(const unsigned *__restrict__ src, unsigned *dst, int n, volatile unsigned *count) {
    for (int i = threadIdx.x; i < n; i += 32) dst[i] = src[i];
    fence_system();
    __syncwarp();
    if (threadIdx.x == 0) {
        fence_system();
        *count = *count + 1;
    }
}

// ---- the output head's best candidates: what coli.c's sampler reads, instead of the logits ----
// Greedy decoding and top-k sampling up to TOP_K (coli.c's sample_next) read only the TOP_K
// best logits of a row, by coli.c's sample_before: the larger logit first, the lower id on a tie.
// So a decode step's logits (248k a token: 1 MiB) stay here and only their TOP_K best come down,
// with whether the whole row is finite. Four launches, each a few reads of the row at most:
// logits_top_max: each of TOP_SLICES slices' largest logit;
// logits_top_bound: the TOP_K-th largest of those, a bound that at least TOP_K logits reach;
// logits_top_collect: the logits that reach it (a few more than TOP_K on a real row) into a list;
// logits_top_rank: each listed one's rank by counting those before it: the TOP_K first in order.
// A row whose list would pass TOP_LIST entries (thousands of equal logits) says so, and coli.c
// reads that row's logits instead.
#define TOP_K 64
#define TOP_SLICES 256
#define TOP_LIST 2048
#define TOP_ROW (TOP_K + 2) // entries a row of OUT: the best, {status, the id drawn}, the total's 8 bytes

// An entry as coli.c's struct sample_candidate lays it out.
struct top_entry { int id; float logit; };

#define PENALTY_MAX 256

// A row's state between the launches: its slices' sums of weights (logits_draw_sums), the slices'
// maxima, the bound, how many logits reach it, whether every logit is finite, the logits that
// logits_penalise changed as they were, and the list. coli.c's CUDA_TOP_SCRATCH is its size.
struct top_scratch {
    double sums[TOP_SLICES];
    float maxima[TOP_SLICES], bound;
    int count, finite, unused;
    float kept[PENALTY_MAX];
    top_entry list[TOP_LIST];
};

// Slice S of a row of N: its elements [*FROM, *END) (a whole number of warp loads each, but the
// last; coli.c's sample_slice_span).
__device__ __forceinline__ void slice_bounds(int n, int s, int *from, int *end) {
    const int span = (n + 32 * TOP_SLICES - 1) / (32 * TOP_SLICES) * 32;
    *from = s * span;
    *end = n < *from + span ? n : *from + span;
}

// Slice s = blockIdx.x of row t = blockIdx.y of LOGITS (N a row): its bounds (slice_bounds) in the
// row it returns, the row's state *Z.
__device__ __forceinline__ const float *top_slice(const float *logits, int n, top_scratch *scratch, top_scratch **z, int *from, int *end) {
    slice_bounds(n, blockIdx.x, from, end);
    *z = scratch + blockIdx.y;
    return logits + (uint64_t)blockIdx.y * n;
}

// Slice s = blockIdx.x of row t = blockIdx.y of LOGITS (N a row), a warp: its largest logit (-inf
// where it has none; a NaN never wins) into SCRATCH[t]. Slice 0 also starts the row's state.
extern "C" __global__ void logits_top_max(const float *__restrict__ logits, int n, top_scratch *__restrict__ scratch) {
    const int lane = threadIdx.x & 31;
    int from, end;
    top_scratch *z;
    const float *x = top_slice(logits, n, scratch, &z, &from, &end);
    float max = -INFINITY;
    for (int i = from + lane; i < end; i += 32) max = x[i] > max ? x[i] : max;
    for (int s = 16; s > 0; s /= 2) {
        const float o = __shfl_xor_sync(0xffffffffu, max, s);
        max = o > max ? o : max;
    }
    if (lane == 0) z->maxima[blockIdx.x] = max;
    if (lane == 0 && blockIdx.x == 0) z->bound = -INFINITY, z->count = 0, z->finite = 1;
}

// Row t = blockIdx.y: the maximum that TOP_K - 1 maxima at most exceed and TOP_K at least reach,
// the TOP_K-th largest, into its bound (-inf, as logits_top_max left it, where fewer than TOP_K
// slices have one). A thread a maximum, each counting against all: grid (TOP_SLICES / 32, T).
extern "C" __global__ void logits_top_bound(top_scratch *__restrict__ scratch) {
    top_scratch *z = scratch + blockIdx.y;
    const float m = z->maxima[blockIdx.x * 32 + (threadIdx.x & 31)];
    int above = 0, reach = 0;
    for (int j = 0; j < TOP_SLICES; j++) above += z->maxima[j] > m, reach += z->maxima[j] >= m;
    if (above < TOP_K && reach >= TOP_K && m > -INFINITY) z->bound = m;
}

// Slice s = blockIdx.x of row t = blockIdx.y, a warp: its logits that reach the row's bound
// appended to its list (in no set order: logits_top_rank orders them), every one counted; a
// logit that is not finite clears the row's FINITE.
extern "C" __global__ void logits_top_collect(const float *__restrict__ logits, int n, top_scratch *__restrict__ scratch) {
    const int lane = threadIdx.x & 31;
    int from, end;
    top_scratch *z;
    const float *x = top_slice(logits, n, scratch, &z, &from, &end);
    const float bound = z->bound;
    for (int i0 = from; i0 < end; i0 += 32) {
        const int i = i0 + lane;
        const float v = i < end ? x[i] : 0.0f;
        if (i < end && !isfinite(v)) z->finite = 0;
        const unsigned take = __ballot_sync(0xffffffffu, i < end && v >= bound);
        if (!take) continue;
        int at = 0;
        if (lane == 0) at = atomicAdd(&z->count, __popc(take));
        at = __shfl_sync(0xffffffffu, at, 0) + __popc(take & ((1u << lane) - 1u));
        if (take >> lane & 1 && at < TOP_LIST) z->list[at] = top_entry{i, v};
    }
}

// Row t = blockIdx.y, list entries 32 blockIdx.x + lane: each one's rank (how many listed come
// before it), the TOP_K first into OUT[t][rank] (TOP_ROW entries a row); then OUT[t][TOP_K].id
// = 1 where the row is finite, + 2 where its list held every logit that reached the bound. Block
// 0 fills the ranks past the list's end with id -1. Grid (TOP_LIST / 32, T).
extern "C" __global__ void logits_top_rank(const top_scratch *__restrict__ scratch, top_entry *__restrict__ out) {
    const int lane = threadIdx.x & 31, i = blockIdx.x * 32 + lane;
    const top_scratch *z = scratch + blockIdx.y;
    const int count = z->count < TOP_LIST ? z->count : TOP_LIST;
    top_entry *o = out + (uint64_t)blockIdx.y * TOP_ROW;
    if (blockIdx.x == 0) {
        for (int r = count + lane; r < TOP_K; r += 32) o[r] = top_entry{-1, 0.0f};
        if (lane == 0) o[TOP_K] = top_entry{z->finite + (z->count <= TOP_LIST ? 2 : 0), 0.0f};
    }
    if (i >= count) return;
    const top_entry e = z->list[i];
    int rank = 0;
    for (int j = 0; j < count && rank < TOP_K; j++) rank += route_better(z->list[j].logit, z->list[j].id, e.logit, e.id);
    if (rank < TOP_K) o[rank] = e;
}

// ---- a draw over the whole vocabulary: a temperature without top-k ----
// coli.c's sample_next draws such a token from every logit's weight e^((logit - max) / temp) in
// its canonical order, which these two launches follow bit for bit (after logits_top_max, whose
// maxima give the max): logits_draw_sums: each slice's weights summed in id order, in double;
// logits_draw_walk: the slices' sums in order are the total, r = u * total, whole slices are
// passed while r reaches their sum (r less it), then the weights of the slice it stops in one by
// one: the first that r falls short of is the token (where rounding lets r pass them all, the
// last token of weight above 0). The id goes in OUT[t][TOP_K].logit's bits, the total in
// OUT[t][TOP_K + 1]. A row cut by top-p or min-p (a nucleus: ON 2) is drawn by coli.c from its
// best, their weights and the total; whether its cut falls among them (so that the row need not
// come down) is bit 4 of OUT[t][TOP_K].id, found as coli.c's sample_nucleus_cut finds it. coli.c
// orders a nucleus by weight (the lower id first among equal ones), and distinct logits can round
// to one weight: a cut that reaches the weight of the last of the best (others outside may share
// it) does not count as among them.

// A row's draw as coli.c uploads it: U in [0, 1), TEMP > 0, TOP_P, MIN_P; ON 0: nothing here, 1:
// drawn here, 2: the total and the nucleus's cut only.
struct top_draw { double u; float temp, top_p, min_p; int on; };

// Row Z's largest logit (a NaN never: the row is then not finite, and coli.c draws nothing).
__device__ __forceinline__ float top_row_max(const top_scratch *z) {
    float max = -INFINITY;
    for (int s = 0; s < TOP_SLICES; s++) max = z->maxima[s] > max ? z->maxima[s] : max;
    return max;
}

__device__ __forceinline__ float draw_weight(float logit, float max, float temp) {
    return exp_canonical(__fdiv_rn(__fsub_rn(logit, max), temp));
}

// Whether top-p and min-p cut a row's nucleus among its best BEST (as logits_top_rank left them),
// as coli.c's sample_nucleus_cut counts them over their weights against the row's TOTAL, before
// the weight of the last of them.
__device__ __forceinline__ int nucleus_within(const top_entry *best, top_draw d, double total) {
    const float max = best[0].logit, first = draw_weight(max, max, d.temp), last = draw_weight(best[TOP_K - 1].logit, max, d.temp);
    double mass = 0.0;
    for (int k = 0; k < TOP_K; k++) {
        const float w = draw_weight(best[k].logit, max, d.temp);
        if (w < __fmul_rn(d.min_p, first)) return k > 0 && draw_weight(best[k - 1].logit, max, d.temp) > last;
        mass = __dadd_rn(mass, (double)w);
        if (mass >= __dmul_rn((double)d.top_p, total)) return k + 1 < TOP_K && w > last;
    }
    return 0;
}

// Slice s = blockIdx.x of row t = blockIdx.y, a warp: its weights' sum into SCRATCH[t].sums[s],
// the lanes' weights added by every lane in id order (so each holds the sum).
extern "C" __global__ void logits_draw_sums(const float *__restrict__ logits, int n, const top_draw *__restrict__ draw,
                                            top_scratch *__restrict__ scratch) {
    const int lane = threadIdx.x & 31;
    int from, end;
    top_scratch *z;
    const float *x = top_slice(logits, n, scratch, &z, &from, &end);
    const top_draw d = draw[blockIdx.y];
    if (!d.on) return;
    const float max = top_row_max(z);
    double sum = 0.0;
    for (int i0 = from; i0 < end; i0 += 32) {
        const float w = i0 + lane < end ? draw_weight(x[i0 + lane], max, d.temp) : 0.0f;
        for (int j = 0; j < 32 && i0 + j < end; j++) sum = __dadd_rn(sum, (double)__shfl_sync(0xffffffffu, w, j));
    }
    if (lane == 0) z->sums[blockIdx.x] = sum;
}

// Row t = blockIdx.y, a warp: the drawn id into OUT[t][TOP_K].logit (grid (1, T)).
extern "C" __global__ void logits_draw_walk(const float *__restrict__ logits, int n, const top_draw *__restrict__ draw,
                                            top_scratch *__restrict__ scratch, top_entry *__restrict__ out) {
    const int lane = threadIdx.x & 31;
    int from, end;
    top_scratch *z;
    const float *x = top_slice(logits, n, scratch, &z, &from, &end);
    const top_draw d = draw[blockIdx.y];
    top_entry *o = out + (uint64_t)blockIdx.y * TOP_ROW;
    if (!d.on) return;
    double total = 0.0, r;
    for (int s = 0; s < TOP_SLICES; s++) total = __dadd_rn(total, z->sums[s]);
    if (lane == 0) *(double *)(void *)(o + TOP_K + 1) = total;
    if (d.on == 2) {
        if (lane == 0 && (n <= TOP_K || nucleus_within(o, d, total))) o[TOP_K].id |= 4;
        return;
    }
    r = __dmul_rn(d.u, total);
    int s = 0, last = 0;
    for (; s < TOP_SLICES && !(r < z->sums[s]); s++) {
        last = z->sums[s] > 0.0 ? s : last;
        r = __dsub_rn(r, z->sums[s]);
    }
    if (s == TOP_SLICES) s = last, r = INFINITY;
    slice_bounds(n, s, &from, &end);
    const float max = top_row_max(z);
    int id = -1, positive = -1;
    for (int i0 = from; i0 < end && id < 0; i0 += 32) {
        const float w = i0 + lane < end ? draw_weight(x[i0 + lane], max, d.temp) : 0.0f;
        for (int j = 0; j < 32 && i0 + j < end && id < 0; j++) {
            const double wj = (double)__shfl_sync(0xffffffffu, w, j);
            positive = wj > 0.0 ? i0 + j : positive;
            if (r < wj) id = i0 + j;
            else r = __dsub_rn(r, wj);
        }
    }
    if (lane == 0) o[TOP_K].logit = __int_as_float(id >= 0 ? id : positive);
}

// ---- penalties: the recent tokens' logits changed before the rest, and changed back after ----
// coli.c's sample_penalty on each distinct recent token of a row (at most PENALTY_MAX, listed by
// coli.c with how often each came): a positive logit divided by the repetition penalty, another
// multiplied, then the presence penalty and the frequency penalty times the count taken off. The
// best, draws and nuclei then see the row as coli.c's sampler does; logits_unpenalise restores
// it, so that a row that comes down after all is the model's, as coli.c expects.
struct top_penalty { float repeat, presence, frequency; int n; struct { int id, count; } seen[PENALTY_MAX]; };

// Row t = blockIdx.y of LOGITS (N a row), a warp: its listed logits penalised, each as it was
// into SCRATCH[t].kept. Grid (1, T).
extern "C" __global__ void logits_penalise(float *__restrict__ logits, int n, const top_penalty *__restrict__ pen,
                                           top_scratch *__restrict__ scratch) {
    const top_penalty *q = pen + blockIdx.y;
    float *x = logits + (uint64_t)blockIdx.y * n;
    for (int k = threadIdx.x & 31; k < q->n && k < PENALTY_MAX; k += 32) {
        const int id = q->seen[k].id;
        if (id < 0 || id >= n) continue;
        float l = x[id];
        scratch[blockIdx.y].kept[k] = l;
        l = l > 0.0f ? __fdiv_rn(l, q->repeat) : __fmul_rn(l, q->repeat);
        x[id] = __fsub_rn(l, __fadd_rn(q->presence, __fmul_rn(q->frequency, (float)q->seen[k].count)));
    }
}

// Row t = blockIdx.y, a warp: its listed logits back as logits_penalise found them. Grid (1, T).
extern "C" __global__ void logits_unpenalise(float *__restrict__ logits, int n, const top_penalty *__restrict__ pen,
                                             const top_scratch *__restrict__ scratch) {
    const top_penalty *q = pen + blockIdx.y;
    float *x = logits + (uint64_t)blockIdx.y * n;
    for (int k = threadIdx.x & 31; k < q->n && k < PENALTY_MAX; k += 32) {
        const int id = q->seen[k].id;
        if (id >= 0 && id < n) x[id] = scratch[blockIdx.y].kept[k];
    }
}
