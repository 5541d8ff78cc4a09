/* kernels_sim: kernels.cu's own source, compiled for the host, run as a GPU would run it. The
 * fake driver built with -DFAKE_SIM (build/sim/libcuda.so.1) launches these instead of its C
 * twins, so that test_cuda compares the source that becomes kernels.ptx, not a rendering of
 * it, with the CPU bit for bit. No card is needed: what this cannot see is the compiler's
 * lowering (nvcc -fmad=false, the JIT), which tests/gpu_check.sh checks on a real card.
 *
 * How it runs a launch: block by block, and in a block warp by warp (the kernels share no
 * memory between warps and never wait at a barrier). A warp is 32 fibers, one per lane (a
 * stack each and a six-register switch: glibc's swapcontext makes two system calls a switch,
 * which made a golden model's run take seconds): each runs until it waits at a shuffle or returns; when all 32 wait at the same shuffle,
 * every lane's value is answered at once, as shfl.sync does, and they run on. A shuffle that
 * some lanes of a warp never reach, or reach at another line, or with a partial mask, is a bug
 * that a card would hang on or answer with garbage: the process stops with a one-line reason
 * naming the kernels.cu line.
 *
 * Floats are the host's IEEE single and double, each operation rounded to nearest, nothing
 * contracted (-ffp-contract=off): what the device's _rn intrinsics and -fmad=false compute. f16
 * conversions go through the compiler's _Float16, which rounds to nearest even as cvt.rn does.
 *
 * Build (build.sh): g++ -c -fPIC -O2 -ffp-contract=off -fno-exceptions -fno-rtti
 * -fvisibility=hidden tests/kernels_sim.cc, linked into the fake driver with -DFAKE_SIM.
 * x86-64 only, as coli is. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- CUDA C++ on the host: qualifiers, thread indices, intrinsics ---- */

#define __global__
#define __device__
#define __forceinline__ inline
#define __constant__ static

struct sim_dim { unsigned x, y, z; };
enum sim_state { SIM_RUNNING, SIM_WAITING, SIM_DONE };
enum sim_shuffle { SIM_DOWN, SIM_XOR, SIM_IDX, SIM_BALLOT };

/* One lane of the warp being run: its fiber's saved stack pointer and, while it waits, the
 * shuffle it waits at. */
struct sim_lane {
    void *sp;
    sim_dim thread;
    int state, shuffle, arg, line;
    uint64_t value, answer;
};

enum { SIM_STACK = 256 * 1024 };
static sim_lane sim_lanes[32];
static sim_lane *sim_current;
static void *sim_scheduler;
alignas(16) static char sim_stacks[32][SIM_STACK];

/* sim_switch(&save, to): pushes the callee-saved registers (System V x86-64), saves the stack
 * pointer in *save, loads TO and pops what was pushed there. */
extern "C" void sim_switch(void **save, void *to);
asm(".text\n"
    ".type sim_switch, @function\n"
    "sim_switch:\n"
    "    pushq %rbp\n    pushq %rbx\n    pushq %r12\n    pushq %r13\n    pushq %r14\n    pushq %r15\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    popq %r15\n    popq %r14\n    popq %r13\n    popq %r12\n    popq %rbx\n    popq %rbp\n"
    "    ret\n"
    ".size sim_switch, . - sim_switch\n");
static sim_dim blockIdx, blockDim, gridDim;
#define threadIdx (sim_current->thread)

static void sim_fail(int line, const char *why)
{
    fprintf(stderr, "kernels_sim: kernels.cu:%d: %s (block %u,%u)\n", line, why, blockIdx.x, blockIdx.y);
    abort();
}

/* Parks the current lane at a shuffle until the whole warp is there; returns its answer. */
template <class T> static T sim_shuffle(unsigned mask, T v, int shuffle, int arg, int line)
{
    static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffle moves at most 64 bits");
    if (mask != 0xffffffffu) sim_fail(line, "a shuffle with a partial mask");
    sim_lane *l = sim_current;
    l->value = 0;
    memcpy(&l->value, &v, sizeof v);
    l->shuffle = shuffle;
    l->arg = arg;
    l->line = line;
    l->state = SIM_WAITING;
    sim_switch(&l->sp, sim_scheduler);
    T r;
    memcpy(&r, &l->answer, sizeof r);
    return r;
}
#define __shfl_down_sync(mask, v, delta) sim_shuffle((mask), (v), SIM_DOWN, (delta), __LINE__)
#define __shfl_xor_sync(mask, v, lanes) sim_shuffle((mask), (v), SIM_XOR, (lanes), __LINE__)
#define __shfl_sync(mask, v, src) sim_shuffle((mask), (v), SIM_IDX, (src), __LINE__)
/* A vote: bit l of every lane's answer is whether lane l's predicate holds. */
#define __ballot_sync(mask, pred) sim_shuffle((mask), (unsigned)((pred) != 0), SIM_BALLOT, 0, __LINE__)
/* Lanes run one at a time, to their next shuffle: a read and a write are one step. */
static inline int atomicAdd(int *p, int v)
{
    const int old = *p;
    *p = old + v;
    return old;
}
/* A warp's barrier (and its memory fence): every lane at it before any goes on, as a shuffle. */
#define __syncwarp() ((void)sim_shuffle(0xffffffffu, 0, SIM_IDX, 0, __LINE__))

template <class To, class From> static inline To sim_bits(From f)
{
    static_assert(sizeof(To) == sizeof(From), "same size");
    To t;
    memcpy(&t, &f, sizeof t);
    return t;
}
static inline float __uint_as_float(unsigned u) { return sim_bits<float>(u); }
static inline float __int_as_float(int i) { return sim_bits<float>(i); }
static inline unsigned __float_as_uint(float f) { return sim_bits<unsigned>(f); }
static inline int __float_as_int(float f) { return sim_bits<int>(f); }
static inline double __longlong_as_double(long long i) { return sim_bits<double>(i); }
static inline long long __double_as_longlong(double d) { return sim_bits<long long>(d); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline float __double2float_rn(double d) { return (float)d; }
static inline int __popc(unsigned u) { return __builtin_popcount(u); }
template <class T> static inline T __ldg(const T *p) { return *p; }
/* prmt.b32 (default mode): byte n of the result is byte S[4n..4n+2] of Y:X, or, where S's bit
 * 4n+3 is set, that byte's sign bit in all 8 bits */
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s)
{
    const uint64_t v = (uint64_t)y << 32 | x;
    unsigned r = 0;
    for (int n = 0; n < 4; n++) {
        unsigned sel = s >> (4 * n) & 15, b = (unsigned)(v >> (8 * (sel & 7))) & 0xFF;
        if (sel & 8) b = b & 0x80 ? 0xFF : 0;
        r |= b << (8 * n);
    }
    return r;
}

/* kernels.cu's helpers in PTX assembly or vector loads. A misaligned vector load, which a card
 * faults on, stops the run. */
struct bytes16;
struct bytes8;
static inline bytes16 load16_checked(const uint8_t *p, int line);
static inline bytes8 load8_checked(const uint8_t *p, int line);
static inline unsigned load4_checked(const uint8_t *p, int line);
#define load16(p) load16_checked((p), __LINE__)
#define load8(p) load8_checked((p), __LINE__)
#define load4(p) load4_checked((p), __LINE__)
/* shf.r.wrap: the low 32 bits of HI:LO shifted right by SHIFT % 32 */
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift)
{
    return (unsigned)((((uint64_t)hi << 32) | lo) >> (shift & 31));
}
static inline float f16(const uint8_t *p)
{
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}
static inline float round_f16(float x) { return (float)(_Float16)x; }
static inline unsigned short f16_bits(float x)
{
    _Float16 h = (_Float16)x;
    unsigned short u;
    memcpy(&u, &h, 2);
    return u;
}
static inline int imad(int a, int b, int acc) { return (int)((unsigned)acc + (unsigned)a * (unsigned)b); }
/* Lanes run one at a time, each write seen at once: nothing to order. */
static inline void fence_system() {}

#define KERNELS_ON_HOST
#include "../kernels.cu"

static inline bytes16 load16_checked(const uint8_t *p, int line)
{
    if ((uintptr_t)p % 16) sim_fail(line, "a 16-byte load from an address that is not 16-aligned");
    bytes16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline bytes8 load8_checked(const uint8_t *p, int line)
{
    if ((uintptr_t)p % 8) sim_fail(line, "an 8-byte load from an address that is not 8-aligned");
    bytes8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline unsigned load4_checked(const uint8_t *p, int line)
{
    if ((uintptr_t)p % 4) sim_fail(line, "a 4-byte load from an address that is not 4-aligned");
    unsigned v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* ---- running a launch ---- */

static void (*sim_kernel)(void **);
static void **sim_params;

/* Where a fiber starts (by sim_switch's ret); it never returns, it switches away for good. */
static void sim_lane_main(void)
{
    sim_kernel(sim_params);
    sim_current->state = SIM_DONE;
    sim_switch(&sim_current->sp, sim_scheduler);
}

/* A fresh fiber on STACK: six zero registers, then sim_lane_main as the return address, placed
 * so that it starts with the stack aligned as after a call. */
static void *sim_fiber(char *stack)
{
    void **sp = (void **)(stack + SIM_STACK) - 2;
    sp[0] = (void *)sim_lane_main;
    sp -= 6;
    memset(sp, 0, 6 * sizeof *sp);
    return sp;
}

/* Answers the shuffle all 32 lanes wait at. */
static void sim_answer(void)
{
    const sim_lane *l0 = &sim_lanes[0];
    for (int i = 0; i < 32; i++) {
        sim_lane *l = &sim_lanes[i];
        if (l->line != l0->line || l->shuffle != l0->shuffle) sim_fail(l->line, "lanes of a warp at different shuffles");
        int src = l->shuffle == SIM_DOWN ? (i + l->arg < 32 ? i + l->arg : i)
                  : l->shuffle == SIM_XOR ? (i ^ l->arg) & 31 : l->arg & 31;
        l->answer = l->shuffle == SIM_BALLOT ? 0 : sim_lanes[src].value;
        for (int j = 0; l->shuffle == SIM_BALLOT && j < 32; j++) l->answer |= sim_lanes[j].value << j;
    }
    for (int i = 0; i < 32; i++) sim_lanes[i].state = SIM_RUNNING;
}

/* Runs threads FIRST .. FIRST + 31 of the current block to their end. */
static void sim_warp(unsigned first)
{
    for (int i = 0; i < 32; i++) {
        sim_lane *l = &sim_lanes[i];
        l->sp = sim_fiber(sim_stacks[i]);
        l->thread = sim_dim{first + (unsigned)i, 0, 0};
        l->state = SIM_RUNNING;
    }
    for (;;) {
        int waiting = 0, line = 0;
        for (int i = 0; i < 32; i++) {
            sim_lane *l = &sim_lanes[i];
            if (l->state == SIM_RUNNING) {
                sim_current = l;
                sim_switch(&sim_scheduler, l->sp);
            }
            if (l->state == SIM_WAITING) waiting++, line = l->line;
        }
        if (!waiting) return;
        if (waiting < 32) sim_fail(line, "a shuffle that not every lane of the warp reaches");
        sim_answer();
    }
}

/* ---- the entry points, by name ---- */

#define ARG(i, T) (*(T *)p[i])
#define SIM_GEMV(name, K, BB) \
    {"matvec_" #name, [](void **p) { matvec_##name(ARG(0, const uint8_t *), ARG(1, uint64_t), ARG(2, const uint8_t *), \
                                                   ARG(3, uint64_t), ARG(4, float *), ARG(5, int), ARG(6, int), ARG(7, int)); }}, \
    {"moe_gate_up_" #name, [](void **p) { moe_gate_up_##name(ARG(0, const moe_job *), ARG(1, const uint8_t *), ARG(2, uint64_t), \
                                                             ARG(3, float *), ARG(4, uint64_t), ARG(5, int), ARG(6, int)); }}, \
    {"moe_down_" #name, [](void **p) { moe_down_##name(ARG(0, const moe_job *), ARG(1, const uint8_t *), ARG(2, uint64_t), \
                                                       ARG(3, float *), ARG(4, uint64_t), ARG(5, int), ARG(6, int)); }},
#define SIM_QUANT_ARGS ARG(0, const float *), ARG(1, uint8_t *), ARG(2, uint64_t), ARG(3, int)

static const struct { const char *name; void (*run)(void **); } sim_entries[] = {
    KERNEL_FORMATS(SIM_GEMV)
    {"quantize_q8", [](void **p) { quantize_q8(SIM_QUANT_ARGS); }},
    {"quantize_q8k", [](void **p) { quantize_q8k(SIM_QUANT_ARGS); }},
    {"quantize_float", [](void **p) { quantize_float(SIM_QUANT_ARGS, ARG(4, int)); }},
    {"moe_route", [](void **p) { moe_route(ARG(0, const float *), ARG(1, int), ARG(2, int), ARG(3, const moe_expert *), ARG(4, moe_job *),
                                           ARG(5, float *), ARG(6, int *)); }},
    {"moe_combine", [](void **p) { moe_combine(ARG(0, const float *), ARG(1, const float *), ARG(2, const float *), ARG(3, const float *),
                                               ARG(4, float *), ARG(5, int), ARG(6, int), ARG(7, const float *), ARG(8, const moe_job *),
                                               ARG(9, const float *)); }},
    {"residual_norm", [](void **p) { residual_norm(ARG(0, float *), ARG(1, const float *), ARG(2, const float *), ARG(3, float *),
                                                   ARG(4, int), ARG(5, float)); }},
    {"deltanet_conv", [](void **p) { deltanet_conv(ARG(0, float *), ARG(1, const float *), ARG(2, const uint64_t *), ARG(3, uint64_t),
                                                   ARG(4, int), ARG(5, int), ARG(6, int), ARG(7, int), ARG(8, float), ARG(9, float),
                                                   ARG(10, int)); }},
    {"deltanet_rule", [](void **p) { deltanet_rule(ARG(0, const float *), ARG(1, const float *), ARG(2, const float *), ARG(3, int),
                                                   ARG(4, const float *), ARG(5, const float *), ARG(6, const uint64_t *), ARG(7, uint64_t),
                                                   ARG(8, int), ARG(9, int), ARG(10, int), ARG(11, int), ARG(12, int), ARG(13, int),
                                                   ARG(14, int), ARG(15, float *)); }},
    {"attn_prep", [](void **p) { attn_prep(ARG(0, float *), ARG(1, float *), ARG(2, const float *), ARG(3, const float *),
                                           ARG(4, const float *), ARG(5, const float *), ARG(6, const uint64_t *), ARG(7, uint64_t),
                                           ARG(8, const int *), ARG(9, int), ARG(10, int), ARG(11, int), ARG(12, int), ARG(13, uint64_t),
                                           ARG(14, int), ARG(15, float)); }},
    {"attn_split", [](void **p) { attn_split(ARG(0, const float *), ARG(1, const uint64_t *), ARG(2, uint64_t), ARG(3, const int *),
                                             ARG(4, int), ARG(5, int), ARG(6, int), ARG(7, int), ARG(8, uint64_t), ARG(9, int),
                                             ARG(10, float), ARG(11, int), ARG(12, float *)); }},
    {"attn_merge", [](void **p) { attn_merge(ARG(0, const float *), ARG(1, const int *), ARG(2, int), ARG(3, int), ARG(4, int),
                                             ARG(5, int), ARG(6, const float *), ARG(7, float *)); }},
    {"copy_words", [](void **p) { copy_words(ARG(0, const unsigned *), ARG(1, unsigned *), ARG(2, int)); }},
    {"publish_words", [](void **p) { publish_words(ARG(0, const unsigned *), ARG(1, unsigned *), ARG(2, int), ARG(3, unsigned *)); }},
    {"logits_top_max", [](void **p) { logits_top_max(ARG(0, const float *), ARG(1, int), ARG(2, top_scratch *)); }},
    {"logits_top_bound", [](void **p) { logits_top_bound(ARG(0, top_scratch *)); }},
    {"logits_top_collect", [](void **p) { logits_top_collect(ARG(0, const float *), ARG(1, int), ARG(2, top_scratch *)); }},
    {"logits_top_rank", [](void **p) { logits_top_rank(ARG(0, const top_scratch *), ARG(1, top_entry *)); }},
    {"logits_draw_sums", [](void **p) { logits_draw_sums(ARG(0, const float *), ARG(1, int), ARG(2, const top_draw *), ARG(3, top_scratch *)); }},
    {"logits_penalise", [](void **p) { logits_penalise(ARG(0, float *), ARG(1, int), ARG(2, const top_penalty *), ARG(3, top_scratch *)); }},
    {"logits_unpenalise", [](void **p) { logits_unpenalise(ARG(0, float *), ARG(1, int), ARG(2, const top_penalty *),
                                                           ARG(3, const top_scratch *)); }},
    {"logits_draw_walk", [](void **p) { logits_draw_walk(ARG(0, const float *), ARG(1, int), ARG(2, const top_draw *), ARG(3, top_scratch *),
                                                         ARG(4, top_entry *)); }},
    {"deltanet_gate", [](void **p) { deltanet_gate(ARG(0, float *), ARG(1, const float *), ARG(2, const float *), ARG(3, int),
                                                   ARG(4, int), ARG(5, float)); }},
};

/* Runs kernel NAME over a grid of GX x GY blocks of BX threads, with cuLaunchKernel's
 * argument pointers. Returns 0, or -1 where kernels.cu has no such kernel. */
extern "C" int kernels_sim_launch(const char *name, unsigned gx, unsigned gy, unsigned bx, void **params)
{
    int k = 0, n = (int)(sizeof sim_entries / sizeof sim_entries[0]);
    while (k < n && strcmp(sim_entries[k].name, name)) k++;
    if (k == n) return -1;
    if (bx == 0 || bx % 32) sim_fail(0, "a block that is not whole warps");
    sim_kernel = sim_entries[k].run;
    sim_params = params;
    blockDim = sim_dim{bx, 1, 1};
    gridDim = sim_dim{gx, gy, 1};
    for (unsigned y = 0; y < gy; y++)
        for (unsigned x = 0; x < gx; x++) {
            blockIdx = sim_dim{x, y, 0};
            for (unsigned w = 0; w < bx / 32; w++) sim_warp(32 * w);
        }
    sim_current = NULL;
    return 0;
}
