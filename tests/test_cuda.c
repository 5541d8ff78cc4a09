/* test_cuda: coli §5 through the fake driver (build/fake/libcuda.so.1, tests/fake_cuda.c):
 * devices in PCI order, every GEMV kernel's C twin against the CPU's products bit for bit
 * (one and several columns, ragged row counts, rows longer than a warp's 32 units), and the
 * failures that must leave results unchanged: allocation, a launch mid-run.
 * Usage: test_cuda [golden_dir] [--quick]. Run from the repository root (build.sh does). */
#define COLI_NO_MAIN
#include "../coli.c"
#include "check.h"


static uint64_t rng = 0x243f6a8885a308d3ULL;
static uint64_t rng_u64(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

static const enum gguf_type types[] = {GGUF_TYPE_F32, GGUF_TYPE_F16, GGUF_TYPE_BF16, GGUF_TYPE_Q8_0, GGUF_TYPE_Q4_0,
                                       GGUF_TYPE_Q4_1, GGUF_TYPE_Q5_0, GGUF_TYPE_Q5_1, GGUF_TYPE_Q4_K, GGUF_TYPE_Q5_K, GGUF_TYPE_Q6_K};

/* A random ROWS x COLS matrix of TYPE with finite modest scales (the benchmark's sanitiser). */
static struct ops_matrix random_matrix(enum gguf_type type, int64_t rows, int64_t cols)
{
    struct ops_matrix m = {type, NULL, rows, cols, gguf_row_bytes(type, cols)};
    uint8_t *w = plat_alloc_aligned(m.row_bytes * (size_t)rows);
    for (size_t i = 0; i < m.row_bytes * (size_t)rows; i++) w[i] = (uint8_t)rng_u64();
    ops_bench_sanitize(type, w, rows, m.row_bytes);
    m.data = w;
    return m;
}

static float *random_x(int64_t n, int cols)
{
    float *x = plat_alloc((size_t)n * (size_t)cols * sizeof *x);
    for (int64_t i = 0; i < n * cols; i++) x[i] = (float)((int64_t)(rng_u64() % 20001) - 10000) * (i % 7 ? 1e-4f : 3e-3f);
    return x;
}

/* W·x for N columns on the CPU and on device DEV: the same bits. */
static void check_kernel(enum gguf_type type, int64_t rows, int64_t cols, int n, int dev)
{
    char name[160];
    struct ops_matrix w = random_matrix(type, rows, cols);
    float *x = random_x(n, (int)cols), *cpu = plat_alloc((size_t)n * rows * 4), *gpu = plat_alloc((size_t)n * rows * 4);
    ops_matmat(&w, x, cpu, n);
    int placed = cuda_make_resident(&w, dev) == 0;
    long calls = cuda.calls;
    memset(gpu, 0xff, (size_t)n * rows * 4);
    ops_matmat(&w, x, gpu, n);
    snprintf(name, sizeof name, "matvec_%s %lldx%lld, %d column%s, device %d: bit-identical to the CPU", gguf_types[type].name,
             (long long)rows, (long long)cols, n, n > 1 ? "s" : "", dev);
    int64_t bad = 0;
    while (bad < n * rows && !memcmp(&cpu[bad], &gpu[bad], 4)) bad++;
    check(placed && cuda.calls == calls + 3 && bad == n * rows, name, "placed %d, calls %ld, y[%lld] cpu %a gpu %a", placed,
          cuda.calls - calls, (long long)bad, cpu[bad < n * rows ? bad : 0], gpu[bad < n * rows ? bad : 0]);
    cuda_release_all();
    free((void *)w.data);
    free(x);
    free(cpu);
    free(gpu);
}

static void test_kernels(int quick, int real)
{
    for (size_t t = 0; t < sizeof types / sizeof *types; t++) {
        int be = gguf_types[types[t]].block_elems == 1 ? 1 : gguf_types[types[t]].block_elems;
        int64_t short_cols = be == 1 ? 70 : 3 * be, long_cols = be == 1 ? 1500 : (be == 32 ? 45 : 40) * be;
        check_kernel(types[t], 37, short_cols, 1, 0);
        check_kernel(types[t], 64, long_cols, 1, real ? 0 : 1);
        if (real) check_kernel(types[t], 4099, long_cols, 2, 0); /* a grid of many blocks */
        if (!quick) check_kernel(types[t], 13, long_cols, 3, 0);
    }
}

/* FAKE_CUDA_FAIL is read by the fake at every call. */
static void test_failures(void)
{
    struct ops_matrix w = random_matrix(GGUF_TYPE_Q8_0, 40, 256);
    float *x = random_x(1, 256), cpu[40], gpu[40];
    ops_matmat(&w, x, cpu, 1);
    setenv("FAKE_CUDA_FAIL", "alloc:1", 1);
    check(cuda_make_resident(&w, 0) != 0 && cuda.ready, "allocation failure: the matrix stays on the CPU", "placed anyway");
    setenv("FAKE_CUDA_FAIL", "", 1);
    check(cuda_make_resident(&w, 0) == 0, "after it, the matrix is placed", "not placed");
    setenv("FAKE_CUDA_FAIL", "launch:1", 1);
    ops_matmat(&w, x, gpu, 1);
    check(!memcmp(cpu, gpu, sizeof cpu) && !cuda.ready && !ops_offload, "launch failure: recomputed on the CPU, GPU path ended",
          "ready %d, offload %d, same %d", cuda.ready, ops_offload != NULL, !memcmp(cpu, gpu, sizeof cpu));
    setenv("FAKE_CUDA_FAIL", "", 1);
    cuda_release_all();
    free((void *)w.data);
    free(x);
}

/* COLI_TEST_REAL=1 (tests/gpu_check.sh): the system's driver and its first device instead of
 * the fake, kernels only. */
int main(int argc, char **argv)
{
    int quick = argc > 2 && !strcmp(argv[2], "--quick"), real = getenv("COLI_TEST_REAL") != NULL;
    plat_quiet = 1;
    plat_cpu_detect();
    quant_init();
    if (!real) {
        setenv("COLI_LIBCUDA", "build/fake/libcuda.so.1", 1);
        setenv("FAKE_CUDA_DEVICES", "2", 1);
    }
    cuda_start(real ? "0" : NULL, -1);
    check(cuda.ready && cuda.n_devices >= (real ? 1 : 2), real ? "system driver: a device ready" : "fake driver: 2 devices ready",
          "%s", cuda.why);
    if (!cuda.ready) return check_done(); /* the check above failed: nothing else can run */
    if (real) printf("# device 0: %s, compute %d.%d\n", cuda.dev[0].name, cuda.dev[0].cc_major, cuda.dev[0].cc_minor);
    else check(cuda.dev[0].pci_bus < cuda.dev[1].pci_bus && !strcmp(cuda.dev[0].name, "Fake GPU B"),
               "devices in PCI bus order, not the driver's", "%s first", cuda.dev[0].name);
    double us = cuda_measure_call();
    printf("ok - one wrapped driver call: %.3f us (glibc build: lock and signal mask, no thread-pointer switch)\n", us);
    n_pass++;
    test_kernels(quick, real);
    if (!real) test_failures();
    cuda_stop();
    return check_done();
}
