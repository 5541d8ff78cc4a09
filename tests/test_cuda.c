/* test_cuda: coli §5 through the fake driver (build/fake/libcuda.so.1, tests/fake_cuda.c):
 * devices in PCI order, every GEMV kernel's C twin against the CPU's products bit for bit
 * (one and several columns, ragged row counts, rows longer than a warp's 32 units), and the
 * failures that must leave results unchanged: allocation, a launch mid-run.
 * Usage: test_cuda [golden_dir] [--quick]. Run from the repository root (build.sh does). */
#define COLI_NO_MAIN
#include "../coli.c"
#include "check.h"


static uint64_t rng = 0x243f6a8885a308d3ULL;
static uint64_t rng_next(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }

static const enum gguf_type types[] = {GGUF_TYPE_F32, GGUF_TYPE_F16, GGUF_TYPE_BF16, GGUF_TYPE_Q8_0, GGUF_TYPE_Q4_0,
                                       GGUF_TYPE_Q4_1, GGUF_TYPE_Q5_0, GGUF_TYPE_Q5_1, GGUF_TYPE_IQ4_NL, GGUF_TYPE_MXFP4,
                                       GGUF_TYPE_Q2_K, GGUF_TYPE_Q3_K, GGUF_TYPE_Q4_K, GGUF_TYPE_Q5_K, GGUF_TYPE_Q6_K,
                                       GGUF_TYPE_IQ4_XS, GGUF_TYPE_IQ3_XXS, GGUF_TYPE_IQ3_S};

/* A random ROWS x COLS matrix of TYPE with finite modest scales (quant_sanitize_random). */
static struct ops_matrix random_matrix(enum gguf_type type, int64_t rows, int64_t cols)
{
    struct ops_matrix m = {type, NULL, rows, cols, gguf_row_bytes(type, cols), 0};
    uint8_t *w = plat_alloc_aligned(m.row_bytes * (size_t)rows);
    for (size_t i = 0; i < m.row_bytes * (size_t)rows; i++) w[i] = (uint8_t)rng_next();
    quant_sanitize_random(type, w, m.row_bytes * (size_t)rows, -1);
    m.data = w;
    return m;
}

static float *random_x(int64_t n, int cols)
{
    float *x = plat_alloc((size_t)n * (size_t)cols * sizeof *x);
    for (int64_t i = 0; i < n * cols; i++) x[i] = (float)((int64_t)(rng_next() % 20001) - 10000) * (i % 7 ? 1e-4f : 3e-3f);
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
    ops_matmat(&w, x, gpu, n); /* once before: the scratch and staging it needs are there after */
    long calls = cuda_calls;
    memset(gpu, 0xff, (size_t)n * rows * 4);
    ops_matmat(&w, x, gpu, n);
    snprintf(name, sizeof name, "matvec_%s %lldx%lld, %d column%s, device %d: bit-identical to the CPU", gguf_types[type].name,
             (long long)rows, (long long)cols, n, n > 1 ? "s" : "", dev);
    int64_t bad = 0;
    while (bad < n * rows && !memcmp(&cpu[bad], &gpu[bad], 4)) bad++;
    check(placed && cuda_calls == calls + 3 && bad == n * rows, name, "placed %d, calls %ld, y[%lld] cpu %a gpu %a", placed,
          cuda_calls - calls, (long long)bad, cpu[bad < n * rows ? bad : 0], gpu[bad < n * rows ? bad : 0]);
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

/* A batch of products over one input (as a DeltaNet layer's projections): 3 matrices resident
 * on device 0, one on device 1 (unless REAL), one on the CPU. Each output bit-identical to the
 * CPU's; device 0's three cost one upload, three launches and one download. */
static void check_jobs(int real, int T)
{
    const enum gguf_type jt[5] = {GGUF_TYPE_Q8_0, GGUF_TYPE_Q8_0, GGUF_TYPE_Q4_K, GGUF_TYPE_Q6_K, GGUF_TYPE_F16};
    const int rows[5] = {300, 70, 33, 129, 40};
    struct ops_job jobs[5];
    float *x = random_x(T, 512), *cpu[5], *gpu[5];
    int placed = 1, same = 1;
    for (int j = 0; j < 5; j++) {
        jobs[j] = (struct ops_job){random_matrix(jt[j], rows[j], 512), x, NULL, T};
        cpu[j] = plat_alloc((size_t)T * rows[j] * 4);
        gpu[j] = plat_alloc((size_t)T * rows[j] * 4);
        ops_matmat(&jobs[j].w, x, cpu[j], T);
        if (j < 4) placed &= cuda_make_resident(&jobs[j].w, j < 3 || real ? 0 : 1) == 0;
        jobs[j].y = gpu[j];
    }
    ops_matmat_jobs(jobs, 5); /* once before: the scratch and staging it needs are there after */
    long calls = cuda_calls, products = cuda.products;
    ops_matmat_jobs(jobs, 5);
    for (int j = 0; j < 5; j++) same &= !memcmp(cpu[j], gpu[j], (size_t)T * rows[j] * 4);
    char name[160];
    snprintf(name, sizeof name, "a batch of 5 products over %d column%s, 4 on devices: the CPU's bits, %s driver calls, pinned staging", T,
             T > 1 ? "s" : "", real ? "6" : "5 + 3 + 2 context switches");
    check(placed && same && cuda.products - products == 4 && cuda_calls - calls == (real ? 6 : 10) && cuda.stage_pinned, name,
          "placed %d, same %d, products %ld, calls %ld, pinned %d", placed, same, cuda.products - products, cuda_calls - calls,
          cuda.stage_pinned);
    cuda_release_all();
    for (int j = 0; j < 5; j++) {
        free((void *)jobs[j].w.data);
        free(cpu[j]);
        free(gpu[j]);
    }
    free(x);
}

/* N_ROWS rows of N values, quantised by the device's quantize kernel for weights of TYPE, equal
 * quant_act_prepare's bytes. The rows include zeros, ties of largest magnitude with both signs,
 * halfway cases and tiny values, beside random ones. */
static void check_quantize(enum gguf_type type, int n)
{
    const int n_rows = 6;
    enum quant_act_kind kind = quant_act_kind(type);
    size_t stride = (quant_act_bytes(type, n) + 63) & ~(size_t)63, bytes = quant_act_bytes(type, n);
    float *x = random_x(n_rows, n);
    for (int i = 0; i < n; i++) {
        x[i] = 0.0f;                                         /* row 0: zeros */
        x[n + i] = i % 5 == 0 ? (i % 2 ? -2.5f : 2.5f) : 0.5f * (float)(i % 7 - 3); /* ties, both signs */
        x[2 * n + i] = (float)(i % 255 - 127) * 0.5f;      /* halfway cases after scaling */
        x[3 * n + i] = (float)(i % 9 - 4) * 1e-39f;        /* subnormal */
    }
    uint8_t *cpu = plat_zalloc((size_t)n_rows, stride), *gpu = plat_zalloc((size_t)n_rows, stride);
    for (int r = 0; r < n_rows; r++) quant_act_prepare(type, x + (size_t)r * n, n, cpu + (size_t)r * stride);
    struct cuda_device *d = &cuda.dev[0];
    cuda_ptr px = 0, pa = 0;
    uint64_t st = stride;
    int mode = type == GGUF_TYPE_F16 ? 1 : type == GGUF_TYPE_BF16 ? 2 : 0;
    void *params[] = {&px, &pa, &st, &n, &mode};
    unsigned per_block = (kind == QUANT_ACT_Q8K ? 256 : 32) * CUDA_WARPS;
    int ok = !cuda_use(0) && !cuda_mem_alloc(&px, (size_t)n_rows * n * 4) && !cuda_mem_alloc(&pa, (size_t)n_rows * stride) &&
             !cuda_htod(px, x, (size_t)n_rows * n * 4) &&
             !cuda_launch(d->quantize[kind], (unsigned)(n + per_block - 1) / per_block, n_rows, 32 * CUDA_WARPS, params) &&
             !cuda_dtoh(gpu, pa, (size_t)n_rows * stride);
    int bad = -1;
    char name[160];
    for (int r = 0; r < n_rows && bad < 0; r++)
        if (memcmp(cpu + (size_t)r * stride, gpu + (size_t)r * stride, bytes)) bad = r;
    snprintf(name, sizeof name, "quantize kernel for %s weights, %d elements: quant_act_prepare's bytes", gguf_types[type].name, n);
    check(ok && bad < 0, name, "launched %d, row %d differs", ok, bad);
    if (px) cuda_mem_free(px);
    if (pa) cuda_mem_free(pa);
    free(x);
    free(cpu);
    free(gpu);
}

/* Uploads expert W to device DEV as re-tiering does, in the background, into *E; waits for it.
 * Returns whether it arrived: after the fake's 2 "not ready" answers, or (REAL) at all. */
static int upload_background(int dev, const struct ops_matrix w[3], struct cuda_expert *e, int real)
{
    long polls = 0;
    int r;
    if (cuda_expert_upload_start(dev, w, e)) return 0;
    while ((r = cuda_expert_upload_ready(dev)) == 0 && polls < 100000000) polls++;
    return r == 1 && (real || polls == 2);
}

/* N_JOBS routed-expert jobs (expert j % N_EXPERTS over column j % N_COLS) as one device batch,
 * against the CPU's gate, up, silu(g) * u and down: the same bits. BACKGROUND: uploaded as
 * re-tiering does, then one freed again. */
static void check_experts(enum gguf_type up_type, enum gguf_type down_type, int dim, int ff, int n_jobs, int dev, int background)
{
    enum { N_EXPERTS = 3, N_COLS = 2 };
    struct ops_matrix w[N_EXPERTS][3];
    struct cuda_moe_job jobs[16];
    struct cuda_moe_shape sh = {up_type, down_type, gguf_row_bytes(up_type, dim), gguf_row_bytes(down_type, ff), dim, ff};
    int placed = cuda_moe_supported(dev, &sh);
    for (int e = 0; e < N_EXPERTS; e++) {
        w[e][0] = random_matrix(up_type, ff, dim);
        w[e][1] = random_matrix(up_type, ff, dim);
        w[e][2] = random_matrix(down_type, dim, ff);
    }
    for (int j = 0; j < n_jobs; j++) {
        struct cuda_expert ex = {0, 0, 0};
        if (background) placed &= upload_background(dev, w[j % N_EXPERTS], &ex, getenv("COLI_TEST_REAL") != NULL);
        else placed &= cuda_expert_upload(dev, w[j % N_EXPERTS], &ex) == 0; /* an upload per job: a copy is as good */
        jobs[j] = (struct cuda_moe_job){ex, (uint32_t)(j % N_COLS), 0};
    }
    float *x = random_x(N_COLS, dim), *g = plat_alloc((size_t)ff * 4), *u = plat_alloc((size_t)ff * 4);
    float *cpu = plat_alloc((size_t)n_jobs * dim * 4), *gpu = plat_alloc((size_t)n_jobs * dim * 4);
    for (int j = 0; j < n_jobs; j++) {
        const struct ops_matrix *we = w[j % N_EXPERTS];
        ops_matvec(&we[0], x + (size_t)(j % N_COLS) * dim, g);
        ops_matvec(&we[1], x + (size_t)(j % N_COLS) * dim, u);
        for (int i = 0; i < ff; i++) g[i] = ops_silu(g[i]) * u[i];
        ops_matvec(&we[2], g, cpu + (size_t)j * dim);
    }
    size_t stride = ops_act_stride(&w[0][0]);
    uint8_t *acts = plat_alloc_aligned(stride * N_COLS);
    for (int c = 0; c < N_COLS; c++) quant_act_prepare(up_type, x + (size_t)c * dim, dim, acts + (size_t)c * stride);
    int ran = placed && cuda_moe_start(dev, &sh, jobs, n_jobs, acts, stride, N_COLS) == 0 && cuda_moe_finish(dev, gpu) == 0; /* the scratch */
    long calls = cuda_calls;
    memset(gpu, 0xff, (size_t)n_jobs * dim * 4);
    ran = ran && cuda_moe_start(dev, &sh, jobs, n_jobs, acts, stride, N_COLS) == 0 && cuda_moe_finish(dev, gpu) == 0;
    int bad = 0;
    char name[160];
    while (bad < n_jobs * dim && !memcmp(&cpu[bad], &gpu[bad], 4)) bad++;
    snprintf(name, sizeof name, "experts %s/%s, dim %d, ff %d, %d jobs, device %d%s: bit-identical to the CPU in 5 driver calls",
             gguf_types[up_type].name, gguf_types[down_type].name, dim, ff, n_jobs, dev, background ? ", uploaded in the background" : "");
    check(ran && bad == n_jobs * dim && cuda_calls - calls == 5, name, "ran %d, calls %ld, y[%d] cpu %a gpu %a", ran, cuda_calls - calls,
          bad, cpu[bad < n_jobs * dim ? bad : 0], gpu[bad < n_jobs * dim ? bad : 0]);
    if (background) {
        int64_t used = cuda.dev[dev].used, n = cuda.n_experts;
        size_t span = cuda.experts[0].bytes;
        cuda_expert_free(dev, &jobs[0].e);
        check(cuda.dev[dev].used == used - (int64_t)span && cuda.n_experts == n - 1, "an expert freed (re-tiering evicts it): its VRAM off the budget",
              "used %lld -> %lld, %lld -> %d listed", (long long)used, (long long)cuda.dev[dev].used, (long long)n, cuda.n_experts);
    }
    cuda_release_all();
    for (int e = 0; e < N_EXPERTS; e++)
        for (int k = 0; k < 3; k++) free((void *)w[e][k].data);
    free(x);
    free(g);
    free(u);
    free(cpu);
    free(gpu);
    free(acts);
}

static void test_experts(int quick, int real)
{
    for (size_t t = 0; t < sizeof types / sizeof *types; t++) {
        int be = gguf_types[types[t]].block_elems;
        check_quantize(types[t], be == 256 ? 768 : 224);
        check_experts(types[t], types[t], be == 256 ? 512 : 160, be == 256 ? 256 : 96, quick ? 2 : 5, real ? 0 : (int)t % 2, 0);
    }
    check_experts(GGUF_TYPE_Q4_K, GGUF_TYPE_Q6_K, 512, 512, 8, 0, 0);   /* the usual Q4_K_M mix */
    check_experts(GGUF_TYPE_Q4_0, GGUF_TYPE_Q8_0, 256, 128, 4, !real, 0);
    check_experts(GGUF_TYPE_F16, GGUF_TYPE_BF16, 64, 96, 3, 0, 0);
    check_experts(GGUF_TYPE_IQ4_XS, GGUF_TYPE_IQ4_NL, 512, 96, 4, !real, 0); /* down rows not of 256: the reference's fallback, Q8 act on the device */
    check_experts(GGUF_TYPE_Q4_K, GGUF_TYPE_Q6_K, 512, 512, 4, !real, 1);
    if (real) check_experts(GGUF_TYPE_Q4_K, GGUF_TYPE_Q6_K, 2048, 512, 16, 0, 0); /* the 35B-A3B's shapes */
}

/* The rest of a layer on device DEV (cuda_moe_layer_start) against the CPU's steps: the output
 * projection (Q8_0, MIXC columns) by ops_matvec, the residual and ops_rmsnorm, the routing by
 * model_select_experts, each expert's SwiGLU by ops_matvec, model_ffn's sum, the residual.
 * N_EXPERT not a multiple of 16 exercises the softmax partials' tail; TIES gives experts 1..3
 * the router row of expert 0 (equal probabilities: the lower id first); NAN_ROW puts a NaN in
 * one router row (every probability NaN: the first USED ids, as the CPU's scan takes them).
 * SPLIT leaves every third expert off the device: the layer hands back its routing, the CPU's
 * outputs for those go up (cuda_moe_layer_resume; both through mapped memory up to
 * CUDA_MAPPED_TOKENS tokens, else by copies), and the sum is the same. SHARED 2: the
 * shared expert in Q8_0 with half the hidden size, a batch of its own. GRAPH: the layer three
 * times, the last one's launches as the CUDA graph the second built (the same bits). The calls
 * are counted with the room the layer needs already there. */
static void check_moe_layer(enum gguf_type up_type, enum gguf_type down_type, int dim, int ff, int n_expert, int used, int T, int shared,
                            int ties, int nan_row, int split, int dev, int graph)
{
    const int mixc = 160;
    struct model mm;
    memset(&mm, 0, sizeof mm);
    mm.cfg.n_expert = n_expert;
    mm.cfg.n_expert_used = used;
    struct ops_matrix wo = random_matrix(GGUF_TYPE_Q8_0, dim, mixc);
    struct ops_matrix router = random_matrix(GGUF_TYPE_F32, n_expert, dim), gate_inp = random_matrix(GGUF_TYPE_F32, 1, dim);
    for (int64_t i = 0; i < router.rows * dim; i++) /* logits of a few units: probabilities that neither vanish nor saturate */
        ((float *)router.data)[i] = (float)((int64_t)(rng_next() % 2001) - 1000) * 5e-5f;
    for (int e = 1; ties && e < 4; e++) memcpy((uint8_t *)router.data + e * router.row_bytes, router.data, router.row_bytes);
    if (nan_row) ((float *)router.data)[(size_t)(n_expert / 2) * dim + 3] = NAN;
    struct ops_matrix (*w)[3] = plat_alloc((size_t)(n_expert + 1) * sizeof *w); /* the last one: the shared expert */
    struct cuda_expert *table = plat_alloc((size_t)(n_expert + 1) * sizeof *table);
    struct cuda_moe_shape sh = {up_type, down_type, gguf_row_bytes(up_type, dim), gguf_row_bytes(down_type, ff), dim, ff};
    int placed = cuda_make_resident(&wo, dev) == 0 && cuda_make_resident(&router, dev) == 0 && cuda_make_resident(&gate_inp, dev) == 0;
    for (int e = 0; e <= n_expert; e++) {
        const int apart = e == n_expert && shared == 2, f = apart ? ff / 2 : ff;
        w[e][0] = random_matrix(apart ? GGUF_TYPE_Q8_0 : up_type, f, dim);
        w[e][1] = random_matrix(apart ? GGUF_TYPE_Q8_0 : up_type, f, dim);
        w[e][2] = random_matrix(apart ? GGUF_TYPE_Q8_0 : down_type, dim, f);
        placed &= cuda_expert_upload(dev, w[e], &table[e]) == 0;
    }
    const struct ops_matrix *ws = w[n_expert];
    struct cuda_moe_shape shs = {ws[0].type, ws[2].type, ws[0].row_bytes, ws[2].row_bytes, dim, (int)ws[0].rows};
    float *x = random_x(T, dim), *mix = random_x(T, mixc), *norm = random_x(1, dim), *xn = plat_alloc((size_t)T * dim * 4);
    float *logits = plat_alloc((size_t)T * n_expert * 4), *top_w = plat_alloc((size_t)T * used * 4);
    float *g = plat_alloc((size_t)ff * 4), *u = plat_alloc((size_t)ff * 4), *y = plat_alloc((size_t)dim * 4), *o = plat_alloc((size_t)dim * 4);
    float *cpu = plat_alloc((size_t)T * dim * 4), *gpu = plat_alloc((size_t)T * (dim + used) * 4);
    float *cpu_y = plat_zalloc((size_t)T * used * dim, 4), *routing = plat_alloc((size_t)T * (dim + used) * 4);
    int *top = plat_alloc((size_t)T * used * sizeof *top);
    mm.s.router = logits;
    mm.s.top = top;
    mm.s.top_w = top_w;
    for (int t = 0; t < T; t++) {
        float *xt = cpu + (size_t)t * dim;
        ops_matvec(&wo, mix + (size_t)t * mixc, y);
        for (int i = 0; i < dim; i++) xt[i] = x[(size_t)t * dim + i] + y[i];
        ops_rmsnorm(xn + (size_t)t * dim, xt, norm, dim, 1e-6f);
        ops_matvec(&router, xn + (size_t)t * dim, logits + (size_t)t * n_expert);
    }
    model_select_experts(&mm, T);
    for (int t = 0; t < T; t++) {
        float gl;
        for (int k = 0; k <= used; k++) {
            if (k == used && !shared) break;
            const struct ops_matrix *we = w[k < used ? top[t * used + k] : n_expert];
            ops_matvec(&we[0], xn + (size_t)t * dim, g);
            ops_matvec(&we[1], xn + (size_t)t * dim, u);
            for (int64_t i = 0; i < we[0].rows; i++) g[i] = ops_silu(g[i]) * u[i];
            ops_matvec(&we[2], g, y);
            if (k < used && split && top[t * used + k] % 3 == 1) memcpy(cpu_y + ((size_t)t * used + k) * dim, y, (size_t)dim * 4);
            if (k == used) ops_matvec(&gate_inp, xn + (size_t)t * dim, &gl);
            for (int i = 0; i < dim; i++) o[i] = k == used ? o[i] + y[i] * ops_sigmoid(gl) : k ? o[i] + y[i] * top_w[t * used + k] : y[i] * top_w[t * used + k];
        }
        for (int i = 0; i < dim; i++) cpu[(size_t)t * dim + i] += o[i];
    }
    struct cuda_expert shexp = table[n_expert];
    for (int e = 1; split && e < n_expert; e += 3) table[e] = (struct cuda_expert){0, 0, 0};
    struct cuda_moe_layer L = {.sh = sh, .shexp_sh = shs, .wo = &wo, .router = &router, .gate_inp = shared ? &gate_inp : NULL, .norm = norm,
                               .eps = 1e-6f, .table = table, .shexp = shexp, .n_expert = n_expert, .used = used, .split = split};
    if (placed) {
        L.wo_ptr = cuda_resident_of(wo.data)->ptr;
        L.router_ptr = cuda_resident_of(router.data)->ptr;
        L.gate_inp_ptr = cuda_resident_of(gate_inp.data)->ptr;
    }
    size_t stride = ops_act_stride(&wo);
    uint8_t *act = plat_alloc_aligned(stride * (size_t)T);
    for (int t = 0; t < T; t++) quant_act_prepare(wo.type, mix + (size_t)t * mixc, mixc, act + (size_t)t * stride);
    const struct cuda_moe_layout lo = cuda_moe_layout_of(&L, stride, T);
    int ran = placed && cuda_use(dev) == 0 && cuda_scratch(&cuda.dev[dev].moe, &cuda.dev[dev].moe_cap, lo.end) == 0 && cuda_stage(lo.y);
    if (ran && split && T <= CUDA_MAPPED_TOKENS) cuda_mapped_grow(&cuda.dev[dev], cuda_moe_mapped_bytes(&L, lo, T));
    const int mapped = cuda_moe_mapped(&cuda.dev[dev], &L, lo, T);
    long calls = 0, graph_runs = cuda.graph_runs;
    for (int run = 0; run < (graph ? 3 : 1); run++) { /* a graph: built the second time, run the third */
        calls = cuda_calls;
        memset(gpu, 0xff, (size_t)T * (dim + used) * 4);
        ran = ran && cuda_moe_layer_supported(dev, &L, T) && cuda_moe_layer_start(dev, &L, x, act, stride, T, routing) == 0 &&
              (!split || cuda_moe_layer_resume(dev, &L, stride, cpu_y, 0, T) == 0) && cuda_moe_finish(dev, gpu) == 0;
    }
    calls = cuda_calls - calls;
    int bad = 0, bad_id = 0, bad_xn = 0;
    while (bad < T * dim && !memcmp(&cpu[bad], &gpu[T * used + bad], 4)) bad++;
    while (bad_id < T * used && top[bad_id] == ((int *)gpu)[bad_id]) bad_id++;
    while (split && bad_xn < T * dim && !memcmp(&xn[bad_xn], &routing[bad_xn], 4)) bad_xn++;
    if (split && bad_xn == T * dim && memcmp(top, routing + (size_t)T * dim, (size_t)T * used * 4)) bad_xn = 0; /* the routing's ids */
    char name[260];
    /* a split layer: the routing down and the CPU's outputs up, by copies, or by publish_words's launch through mapped memory (a
     * graph: the layer's end its own window); a shared expert apart: its activations and 3 kernels */
    const int want_calls = graph ? 3 + split : 12 + (shared > 0) + (mapped ? 1 : 2 * split) + 4 * (shared == 2); /* a graph: the upload, the graph, the download */
    snprintf(name, sizeof name, "the rest of a layer on device %d, %s/%s, %d of %d experts, %d tokens%s%s%s%s%s%s: the CPU's ids and bits in %d driver calls",
             dev, gguf_types[up_type].name, gguf_types[down_type].name, used, n_expert, T,
             shared == 2 ? ", a Q8_0 shared expert apart" : shared ? ", shared expert" : "",
             ties ? ", tied probabilities" : "", nan_row ? ", NaN logits" : "", split ? ", every third expert the CPU's" : "",
             mapped ? " through mapped memory" : "", graph ? ", its third time as one CUDA graph" : "", want_calls);
    /* with NaN logits the outputs are NaN: the ids say what was chosen */
    check(ran && bad_id == T * used && (nan_row || bad == T * dim) && (!split || bad_xn == T * dim) && calls == want_calls && mapped == (split && T <= CUDA_MAPPED_TOKENS) &&
              cuda.graph_runs - graph_runs == graph, name, "ran %d, calls %ld, graph launches %ld, id %d: cpu %d gpu %d, out[%d] cpu %a gpu %a, routing %d",
          ran, calls, cuda.graph_runs - graph_runs, bad_id,
          top[bad_id < T * used ? bad_id : 0], ((int *)gpu)[bad_id < T * used ? bad_id : 0], bad, cpu[bad < T * dim ? bad : 0],
          gpu[T * used + (bad < T * dim ? bad : 0)], bad_xn);
    cuda_release_all();
    for (int e = 0; e <= n_expert; e++)
        for (int k = 0; k < 3; k++) free((void *)w[e][k].data);
    void *bufs[] = {(void *)wo.data, (void *)router.data, (void *)gate_inp.data, w, table, x, mix, norm, xn, logits, top_w, g, u, y, o, cpu, gpu, top, act, cpu_y, routing};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
}

static void test_moe_layer(int real)
{
    check_moe_layer(GGUF_TYPE_Q4_K, GGUF_TYPE_Q6_K, 256, 256, 40, 8, 1, 1, 0, 0, 0, 0, 0);
    check_moe_layer(GGUF_TYPE_Q8_0, GGUF_TYPE_Q8_0, 128, 64, 9, 4, 3, 0, 0, 0, 0, !real, 0);
    check_moe_layer(GGUF_TYPE_Q4_0, GGUF_TYPE_Q8_0, 128, 96, 33, 5, 2, 1, 1, 0, 0, 0, 0);
    check_moe_layer(GGUF_TYPE_Q4_0, GGUF_TYPE_Q4_0, 64, 64, 16, 4, 2, 1, 0, 1, 0, 0, 0);
    check_moe_layer(GGUF_TYPE_Q4_K, GGUF_TYPE_Q6_K, 256, 256, 256, 8, 2, 1, 0, 0, 0, !real, 0); /* the 35B-A3B's routing */
    check_moe_layer(GGUF_TYPE_Q4_K, GGUF_TYPE_Q6_K, 256, 256, 40, 8, 3, 1, 0, 0, 1, 0, 0);
    check_moe_layer(GGUF_TYPE_Q8_0, GGUF_TYPE_Q8_0, 128, 64, 9, 4, 2, 0, 0, 0, 1, !real, 0);
    check_moe_layer(GGUF_TYPE_Q4_K, GGUF_TYPE_Q6_K, 256, 256, 40, 8, 2, 2, 0, 0, 0, 0, 0);
    check_moe_layer(GGUF_TYPE_Q4_0, GGUF_TYPE_Q4_0, 128, 128, 16, 4, 2, 2, 0, 0, 1, !real, 0);
    check_moe_layer(GGUF_TYPE_Q4_K, GGUF_TYPE_Q6_K, 256, 256, 40, 8, 2, 1, 0, 0, 0, !real, 1);
    check_moe_layer(GGUF_TYPE_Q8_0, GGUF_TYPE_Q8_0, 128, 64, 9, 4, 3, 2, 0, 0, 0, 0, 1);
    check_moe_layer(GGUF_TYPE_Q4_K, GGUF_TYPE_Q6_K, 256, 256, 40, 8, 2, 1, 0, 0, 1, !real, 1);
    check_moe_layer(GGUF_TYPE_Q8_0, GGUF_TYPE_Q8_0, 64, 64, 9, 4, CUDA_MAPPED_TOKENS + 1, 1, 0, 0, 1, 0, 0); /* split by copies */
    if (real) check_moe_layer(GGUF_TYPE_Q4_K, GGUF_TYPE_Q6_K, 2048, 512, 256, 8, 4, 1, 0, 0, 1, 0, 0); /* the 35B-A3B's shapes, split */
}

/* A device buffer holding N bytes of HOST (NULL: room only). */
static cuda_ptr device_copy(int dev, const void *host, size_t n)
{
    cuda_ptr p = 0;
    if (cuda_use(dev) || cuda_mem_alloc(&p, n) || (host && cuda_htod(p, host, n))) return 0;
    return p;
}

/* Whether the N floats at device address P have the bits of WANT; *AT the first that differs. */
static int device_same(cuda_ptr p, const float *want, size_t n, size_t *at)
{
    float *got = plat_alloc(n * sizeof *got);
    int same = cuda_dtoh(got, p, n * sizeof *got) == 0;
    for (*at = 0; same && *at < n && !memcmp(&got[*at], &want[*at], 4); ++*at) {}
    same = same && *at == n;
    free(got);
    return same;
}

/* A Gated DeltaNet layer on device DEV (cuda_deltanet_launch: conv, rule, gated norm, the rows
 * prepared for the output projection) against coli's own model_gated_deltanet on the CPU: T
 * tokens of N_SEQ sequences (in runs, as a batch lays them) through their states, the layer
 * the second of a sequence's two (its state at an offset), nk key and nv value heads of dk and
 * dv, a conv of K taps; BA: Qwen3-Next's fused beta and alpha (its head order too); PER_HEAD:
 * the gated norm's weights per head. The states after, the conv's output and the rows compared
 * bit for bit, and the driver calls counted. */
static void check_deltanet(int dev, int nk, int nv, int dk, int dv, int K, int T, int n_seq, int ba, int per_head)
{
    struct model mm;
    memset(&mm, 0, sizeof mm);
    struct model_config *c = &mm.cfg;
    c->ssm_nk = nk, c->ssm_nv = nv, c->ssm_dk = dk, c->ssm_dv = dv, c->conv_kernel = K, c->eps = 1e-6f, c->n_layers = 2;
    c->arch = ba ? MODEL_ARCH_QWEN3NEXT : MODEL_ARCH_QWEN35MOE;
    c->vhead_tiled = !ba;
    const int64_t conv_dim = model_conv_dim(c), vdim = (int64_t)nv * dv;
    const size_t per = model_recurrent_floats(c), conv = (size_t)conv_dim * (size_t)(K - 1);
    struct model_layer layers[2];
    memset(layers, 0, sizeof layers);
    struct model_layer *l = &layers[1];
    l->kind = MODEL_LAYER_DELTANET;
    l->conv_taps = random_x(K, (int)conv_dim);
    float *dt_bias = random_x(1, nv), *ssm_a = random_x(1, nv), *norm = random_x(1, per_head ? (int)vdim : dv);
    for (int h = 0; h < nv; h++) ssm_a[h] = -0.25f - (float)h * 0.4f; /* -exp(A_log): decays from 0.8 down */
    l->dt_bias = dt_bias, l->ssm_a = ssm_a, l->ssm_norm = norm, l->ssm_norm_per_head = per_head;
    mm.layers = layers;
    struct model_scratch *s = &mm.s;
    s->mixed = random_x(T, (int)conv_dim);
    s->z = random_x(T, (int)vdim);
    s->ba = random_x(T, 2 * nv);
    s->beta = random_x(T, nv);
    s->alpha = random_x(T, nv);
    s->core = plat_alloc((size_t)T * (size_t)vdim * 4);
    s->tok_seq = plat_alloc((size_t)T * sizeof *s->tok_seq);
    struct model_seq *seqs = plat_zalloc((size_t)n_seq, sizeof *seqs);
    float *states = random_x((int64_t)n_seq, (int)(2 * per)); /* per sequence: two layers' states, this one second */
    uint64_t *addr = plat_alloc((size_t)T * 8);
    const struct ops_matrix wo = random_matrix(GGUF_TYPE_Q8_0, 64, vdim);
    const size_t stride = ops_act_stride(&wo);
    struct cuda_device *d = &cuda.dev[dev];
    cuda_ptr dev_state[8] = {0};
    for (int q = 0; q < n_seq; q++) {
        seqs[q].state = plat_zalloc(2, sizeof *seqs[q].state);
        seqs[q].state[1].conv_state = plat_alloc(conv * 4 + 4);
        seqs[q].state[1].ssm_state = plat_alloc((per - conv) * 4);
        memcpy(seqs[q].state[1].conv_state, states + (2 * q + 1) * per, conv * 4);
        memcpy(seqs[q].state[1].ssm_state, states + (2 * q + 1) * per + conv, (per - conv) * 4);
        dev_state[q] = device_copy(dev, states + 2 * q * per, 2 * per * 4);
    }
    for (int t = 0; t < T; t++) {
        const int q = t * n_seq / T;
        s->tok_seq[t] = &seqs[q];
        addr[t] = dev_state[q];
    }
    /* the device's inputs first: the CPU's pass works in place */
    cuda_ptr mixed = device_copy(dev, s->mixed, (size_t)T * conv_dim * 4), z = device_copy(dev, s->z, (size_t)T * vdim * 4);
    cuda_ptr beta = device_copy(dev, ba ? s->ba : s->beta, (size_t)T * (ba ? 2 : 1) * nv * 4), alpha = device_copy(dev, s->alpha, (size_t)T * nv * 4);
    cuda_ptr consts = device_copy(dev, NULL, (size_t)(K * conv_dim + 2 * nv + (per_head ? vdim : dv)) * 4), table = device_copy(dev, addr, (size_t)T * 8);
    cuda_ptr scratch = device_copy(dev, NULL, cuda_align((size_t)T * vdim * 4) + stride * (size_t)T);
    const float *parts[] = {l->conv_taps, dt_bias, ssm_a, norm};
    const size_t part_n[] = {(size_t)K * conv_dim, (size_t)nv, (size_t)nv, (size_t)(per_head ? vdim : dv)};
    for (size_t i = 0, at = 0; i < 4; at += part_n[i++] * 4) cuda_htod(consts + at, parts[i], part_n[i] * 4);
    struct cuda_deltanet dn = {consts, consts + part_n[0] * 4, consts + (part_n[0] + part_n[1]) * 4, consts + (part_n[0] + 2 * part_n[1]) * 4,
                               (int)conv_dim, K, nk, nv, dk, dv, !ba, ba, per_head, 1e-6f, 1.0f / sqrtf((float)dk), per, conv};
    struct cuda_moe_layer L = {.wo = &wo, .dn = &dn};
    struct cuda_moe_layout o;
    memset(&o, 0, sizeof o);
    o.mix = cuda_align((size_t)T * vdim * 4);
    d->kept_next[0] = mixed, d->kept_next[1] = z, d->kept_next[2] = beta, d->kept_next[3] = alpha;
    d->chain = table, d->moe = scratch;
    long calls = cuda_calls;
    int ran = table && scratch && cuda_deltanet_launch(d, &L, o, stride, T) == CUDA_SUCCESS;
    calls = cuda_calls - calls;
    d->chain = d->moe = 0;
    model_gated_deltanet(&mm, 1, T);
    uint8_t *act = plat_zalloc(stride * (size_t)T, 1);
    for (int t = 0; t < T; t++) quant_act_prepare(wo.type, s->core + (size_t)t * vdim, vdim, act + (size_t)t * stride);
    size_t at = 0, bad_state = 0;
    int same = ran && device_same(mixed, s->mixed, (size_t)T * conv_dim, &at) && device_same(scratch, s->core, (size_t)T * vdim, &at);
    uint8_t *got = plat_alloc(stride * (size_t)T);
    same = same && cuda_dtoh(got, scratch + o.mix, stride * (size_t)T) == 0;
    for (int t = 0; t < T && same; t++) same = !memcmp(got + (size_t)t * stride, act + (size_t)t * stride, quant_act_bytes(wo.type, vdim));
    for (int q = 0; q < n_seq && same; q++) {
        memcpy(states + (2 * q + 1) * per, seqs[q].state[1].conv_state, conv * 4);
        memcpy(states + (2 * q + 1) * per + conv, seqs[q].state[1].ssm_state, (per - conv) * 4);
        same = device_same(dev_state[q], states + 2 * q * per, 2 * per, &bad_state);
    }
    char name[200];
    snprintf(name, sizeof name, "DeltaNet on device %d, %d/%d heads of %d/%d, conv %d, %d tokens of %d sequences%s%s: the CPU's states, rows and bits in 4 calls",
             dev, nk, nv, dk, dv, K, T, n_seq, ba ? ", fused beta/alpha" : "", per_head ? ", a norm per head" : "");
    check(same && calls == 4, name, "ran %d, calls %ld, first difference at %zu, state %zu", ran, calls, at, bad_state);
    cuda_ptr bufs_d[] = {mixed, z, beta, alpha, consts, table, scratch};
    for (size_t i = 0; i < sizeof bufs_d / sizeof *bufs_d; i++) cuda_mem_free(bufs_d[i]);
    for (int q = 0; q < n_seq; q++) {
        cuda_mem_free(dev_state[q]);
        free(seqs[q].state[1].conv_state);
        free(seqs[q].state[1].ssm_state);
        free(seqs[q].state);
    }
    void *bufs[] = {l->conv_taps, dt_bias, ssm_a, norm, s->mixed, s->z, s->ba, s->beta, s->alpha, s->core, s->tok_seq, seqs, states, addr,
                    (void *)wo.data, act, got};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
}

/* A gated attention layer on device DEV (cuda_attention_launch: q/k norms and RoPE, the new
 * K and V rows into each sequence's cache, each split's scores, softmax and values, their
 * merge and the gate, the rows prepared for the output projection) against coli's own
 * model_attention on the CPU: T tokens of N_SEQ sequences, each already FILLED positions into
 * its cache (the rows the device was given), the layer the second attention layer of two (its
 * caches at an offset), KV format KV; GROUP: tokens a pair of split launches takes (0: all).
 * The queries, keys, outputs, rows and whole caches after compared bit for bit, the driver
 * calls counted (2, and 2 a group). */
static void check_attention(int dev, int n_head, int n_kv, int hd, int rot, int T, int n_seq, int filled, enum ops_kv kv, int group)
{
    struct model mm;
    memset(&mm, 0, sizeof mm);
    struct model_config *c = &mm.cfg;
    c->n_head = n_head, c->n_kv_head = n_kv, c->head_dim = hd, c->rope_dims = rot, c->rope_base = 1e7f, c->eps = 1e-6f, c->n_layers = 2;
    mm.n_ctx = filled + T + 40, mm.kv = kv;
    struct model_layer layers[2];
    memset(layers, 0, sizeof layers);
    layers[0].kind = layers[1].kind = MODEL_LAYER_ATTENTION;
    struct model_layer *l = &layers[1];
    float *q_norm = random_x(1, hd), *k_norm = random_x(1, hd);
    for (int i = 0; i < hd; i++) q_norm[i] += 1.0f, k_norm[i] += 1.0f;
    l->q_norm = q_norm, l->k_norm = k_norm;
    mm.layers = layers;
    struct model_scratch *s = &mm.s;
    const int qw = n_head * 2 * hd, kvw = n_kv * hd;
    s->qg = random_x(T, qw), s->k = random_x(T, kvw), s->v = random_x(T, kvw);
    s->attn = plat_alloc((size_t)T * n_head * hd * 4);
    s->scores = plat_alloc((size_t)n_head * model_scores_floats(&mm) * 4);
    s->rope = plat_alloc((size_t)T * rot * 4);
    s->tok_seq = plat_alloc((size_t)T * sizeof *s->tok_seq);
    s->tok_pos = plat_alloc((size_t)T * sizeof *s->tok_pos);
    struct model_seq *seqs = plat_zalloc((size_t)n_seq, sizeof *seqs);
    const size_t bytes = model_kv_dev_bytes(&mm), head = (size_t)model_kv_rows(&mm) * model_kv_row_bytes(&mm), layer = 2 * (size_t)n_kv * head;
    uint8_t *host = plat_alloc(bytes);
    uint64_t *addr = plat_alloc((size_t)T * 8);
    int *pos = plat_alloc((size_t)T * sizeof *pos);
    float *rope = plat_alloc((size_t)T * rot * 4), *row = random_x(1, hd);
    cuda_ptr dev_kv[8] = {0};
    for (int q = 0; q < n_seq; q++) { /* FILLED rows of every head of both layers, random */
        seqs[q].state = plat_zalloc(2, sizeof *seqs[q].state);
        for (int li = 0; li < 2; li++) {
            seqs[q].state[li].k_cache = plat_zalloc((size_t)n_kv, head);
            seqs[q].state[li].v_cache = plat_zalloc((size_t)n_kv, head);
            for (int h = 0; h < n_kv; h++)
                for (int r = 0; r < filled; r++)
                    for (int keys = 0; keys < 2; keys++) {
                        for (int i = 0; i < hd; i++) row[i] = (float)((int64_t)(rng_next() % 2001) - 1000) * 1e-3f;
                        model_kv_store(&mm, keys ? seqs[q].state[li].k_cache : seqs[q].state[li].v_cache, h, r, row, keys);
                    }
            memcpy(host + li * layer, seqs[q].state[li].k_cache, (size_t)n_kv * head);
            memcpy(host + li * layer + (size_t)n_kv * head, seqs[q].state[li].v_cache, (size_t)n_kv * head);
        }
        dev_kv[q] = device_copy(dev, host, bytes);
    }
    for (int t = 0; t < T; t++) {
        const int q = t * n_seq / T; /* runs of tokens, each sequence's in order */
        int before = 0;
        for (int u = 0; u < t; u++) before += u * n_seq / T == q;
        s->tok_seq[t] = &seqs[q];
        s->tok_pos[t] = pos[t] = filled + before;
        addr[t] = dev_kv[q];
        model_rope_table(c, pos[t], rope + (size_t)t * rot);
    }
    const struct ops_matrix wo = random_matrix(GGUF_TYPE_Q8_0, 64, n_head * hd);
    const size_t stride = ops_act_stride(&wo), out_bytes = cuda_align((size_t)T * n_head * hd * 4);
    struct cuda_device *d = &cuda.dev[dev];
    cuda_ptr qg = device_copy(dev, s->qg, (size_t)T * qw * 4), k = device_copy(dev, s->k, (size_t)T * kvw * 4), v = device_copy(dev, s->v, (size_t)T * kvw * 4);
    cuda_ptr qn = device_copy(dev, q_norm, (size_t)hd * 4), kn = device_copy(dev, k_norm, (size_t)hd * 4), dr = device_copy(dev, rope, (size_t)T * rot * 4);
    cuda_ptr da = device_copy(dev, addr, (size_t)T * 8), dp = device_copy(dev, pos, (size_t)T * 4);
    int longest = 0;
    for (int t = 0; t < T; t++) longest = pos[t] + 1 > longest ? pos[t] + 1 : longest;
    const int splits = (longest + OPS_ATTN_SPLIT - 1) / OPS_ATTN_SPLIT;
    struct cuda_attention a = {qn, kn, da, dp, dr, n_head, n_kv, hd, rot, (int)kv, splits, 1e-6f, 1.0f / sqrtf((float)hd), layer,
                               (uint64_t)model_kv_rows(&mm)};
    const size_t parts_cap = cuda_attention_parts;
    if (group) cuda_attention_parts = (size_t)group * cuda_attention_token_parts(&a);
    const int groups = (T + cuda_attention_group(&a, T) - 1) / cuda_attention_group(&a, T);
    struct cuda_moe_layer L = {.wo = &wo, .attn = &a};
    struct cuda_moe_layout o;
    memset(&o, 0, sizeof o);
    o.mix = out_bytes;
    o.parts = cuda_align(out_bytes + stride * T);
    cuda_ptr scratch = device_copy(dev, NULL, o.parts + cuda_attention_group(&a, T) * cuda_attention_token_parts(&a));
    d->kept_next[0] = qg, d->kept_next[1] = k, d->kept_next[2] = v, d->moe = scratch;
    long calls = cuda_calls;
    int ran = scratch && cuda_attention_launch(d, &L, o, stride, T) == CUDA_SUCCESS;
    calls = cuda_calls - calls;
    cuda_attention_parts = parts_cap;
    d->moe = 0;
    model_attention(&mm, 1, T);
    uint8_t *act = plat_zalloc(stride * (size_t)T, 1), *got = plat_alloc(stride * (size_t)T);
    for (int t = 0; t < T; t++) quant_act_prepare(wo.type, s->attn + (size_t)t * n_head * hd, n_head * hd, act + (size_t)t * stride);
    size_t at = 0;
    int same = ran && device_same(qg, s->qg, (size_t)T * qw, &at) && device_same(k, s->k, (size_t)T * kvw, &at) &&
               device_same(scratch, s->attn, (size_t)T * n_head * hd, &at) && cuda_dtoh(got, scratch + o.mix, stride * (size_t)T) == 0;
    for (int t = 0; t < T && same; t++) same = !memcmp(got + (size_t)t * stride, act + (size_t)t * stride, quant_act_bytes(wo.type, n_head * hd));
    uint8_t *back = plat_alloc(bytes);
    for (int q = 0; q < n_seq && same; q++) {
        memcpy(host + layer, seqs[q].state[1].k_cache, (size_t)n_kv * head);
        memcpy(host + layer + (size_t)n_kv * head, seqs[q].state[1].v_cache, (size_t)n_kv * head);
        same = cuda_dtoh(back, dev_kv[q] + layer, layer) == 0 && !memcmp(back, host + layer, layer);
    }
    char name[200];
    snprintf(name, sizeof name, "attention on device %d, %d heads on %d of %d (RoPE %d), %s cache, %d tokens of %d sequences after %d "
             "(%d splits, %d groups): the CPU's queries, keys, caches, rows and bits in %d calls", dev, n_head, n_kv, hd, rot,
             kv == OPS_KV_F16 ? "f16" : kv == OPS_KV_Q8_0 ? "q8_0" : "f32", T, n_seq, filled, splits, groups, 2 + 2 * groups);
    check(same && calls == 2 + 2 * groups, name, "ran %d, calls %ld, first difference at %zu", ran, calls, at);
    cuda_ptr bufs_d[] = {qg, k, v, qn, kn, dr, da, dp, scratch};
    for (size_t i = 0; i < sizeof bufs_d / sizeof *bufs_d; i++) cuda_mem_free(bufs_d[i]);
    for (int q = 0; q < n_seq; q++) {
        cuda_mem_free(dev_kv[q]);
        for (int li = 0; li < 2; li++) free(seqs[q].state[li].k_cache), free(seqs[q].state[li].v_cache);
        free(seqs[q].state);
    }
    void *bufs[] = {q_norm, k_norm, s->qg, s->k, s->v, s->attn, s->scores, s->rope, s->tok_seq, s->tok_pos, seqs, host, addr, pos, rope, row,
                    (void *)wo.data, act, got, back};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
}

static void test_attention_device(int real)
{
    check_attention(0, 4, 2, 32, 8, 1, 1, 5, OPS_KV_F32, 0);            /* the golden models' heads */
    check_attention(!real, 16, 2, 256, 64, 3, 2, 37, OPS_KV_F32, 0);    /* the 35B-A3B's heads, rows past a warp's 32 */
    check_attention(0, 8, 4, 64, 32, 4, 1, 70, OPS_KV_F16, 0);          /* a prompt's tokens after 70 rows, f16 */
    check_attention(!real, 6, 3, 128, 128, 2, 2, 0, OPS_KV_F16, 0);     /* RoPE over the whole head, an empty cache */
    check_attention(0, 4, 2, 64, 32, 5, 2, 254, OPS_KV_F32, 0);         /* tokens on both sides of a split's end */
    check_attention(!real, 8, 2, 128, 64, 7, 3, 766, OPS_KV_F16, 3);    /* 3 and 4 splits, in groups of 3 tokens */
    check_attention(0, 4, 2, 32, 8, 3, 1, 5, OPS_KV_Q8_0, 0);           /* Q8_0: one key group, part full */
    check_attention(!real, 16, 2, 256, 64, 5, 2, 300, OPS_KV_Q8_0, 2);  /* Q8_0: the 35B-A3B's heads over 2 splits, in groups */
    if (real) check_attention(0, 16, 2, 256, 64, 4, 2, 1000, OPS_KV_F32, 0); /* the 35B-A3B at 1k of context */
    if (real) check_attention(0, 16, 2, 256, 64, 1, 1, 8191, OPS_KV_F16, 0); /* and a decode step at 8k */
    if (real) check_attention(0, 16, 2, 256, 64, 1, 1, 8191, OPS_KV_Q8_0, 0);
}

static void test_deltanet_device(int real)
{
    check_deltanet(0, 2, 4, 16, 16, 4, 1, 1, 0, 0);       /* the golden models' heads */
    check_deltanet(!real, 2, 4, 128, 128, 4, 3, 2, 0, 0); /* the 35B-A3B's head sizes, two sequences */
    check_deltanet(0, 2, 6, 64, 96, 4, 5, 3, 1, 1);       /* Qwen3-Next's order, dv not a multiple of 64 */
    check_deltanet(!real, 4, 8, 48, 40, 3, 2, 1, 0, 1);   /* heads that are not whole warps */
    if (real) check_deltanet(0, 16, 32, 128, 128, 4, 4, 2, 0, 0); /* the 35B-A3B's layer */
}

/* Row kinds for check_top: many equal logits; distinct ones with the best 200 side by side in
 * one slice; all equal (more than the list holds); one NaN and one infinity. */
enum top_kind { TOP_TIES, TOP_CLUSTER, TOP_EQUAL, TOP_NOT_FINITE };

static float top_logit(enum top_kind kind, int i)
{
    if (kind == TOP_TIES) return (float)((int)(rng_next() % 2001) - 1000) / 16.0f * (i & 1 ? -1.0f : 1.0f); /* -0.0 among them */
    if (kind == TOP_EQUAL) return 1.0f;
    if (kind == TOP_CLUSTER && i >= 100000 && i < 100200) return 30.0f + (float)(i % 7) * 1e-3f;
    return (float)((int)(rng_next() % 4000001) - 2000000) * 1e-5f;
}

/* cuda_top_launch over T rows of N logits of KIND on device DEV: each row's CUDA_TOP_K best in
 * sample_top's order (id -1 past N) and its finite flag as the CPU finds them; where the
 * logits reaching the bound outnumber the list (WHOLE 0), the row says so. */
static void check_top(int dev, int n, int T, enum top_kind kind, int whole)
{
    char name[200];
    const int k = n < CUDA_TOP_K ? n : CUDA_TOP_K;
    float *x = plat_alloc((size_t)n * T * sizeof *x);
    struct sample_candidate *want = plat_alloc((size_t)n * sizeof *want), got[CUDA_TOP_ROW];
    for (int i = 0; i < n * T; i++) x[i] = top_logit(kind, i % n);
    if (kind == TOP_NOT_FINITE) x[n / 3] = NAN, x[n - 1] = INFINITY;
    cuda_ptr logits = device_copy(dev, x, (size_t)n * T * 4), scratch = device_copy(dev, NULL, (size_t)T * CUDA_TOP_SCRATCH);
    cuda_ptr out = device_copy(dev, NULL, (size_t)T * sizeof got);
    long calls = cuda_calls;
    int ran = logits && scratch && out && cuda_top_launch(&cuda.dev[dev], logits, n, scratch, out, 0, 0, T) == CUDA_SUCCESS, same = ran;
    calls = cuda_calls - calls;
    for (int t = 0; same && t < T; t++) {
        const float *row = x + (size_t)t * n;
        same = cuda_dtoh(got, out + (size_t)t * sizeof got, sizeof got) == 0 && got[CUDA_TOP_K].id == sample_all_finite(row, n) + 2 * whole;
        if (kind == TOP_NOT_FINITE || !whole) continue;
        sample_top(row, n, k, want);
        for (int r = 0; same && r < CUDA_TOP_K; r++)
            same = r < k ? got[r].id == want[r].id && !memcmp(&got[r].logit, &want[r].logit, 4) : got[r].id == -1;
    }
    snprintf(name, sizeof name, "the output head's best on device %d: %d row%s of %d %s logits, as sample_top and sample_all_finite find them, "
             "in 4 launches", dev, T, T > 1 ? "s" : "", n,
             kind == TOP_TIES ? "often equal" : kind == TOP_CLUSTER ? "clustered" : kind == TOP_EQUAL ? "all equal (too many for the list)"
                                                                                 : "some not finite");
    check(same && calls == 4, name, "ran %d, calls %ld", ran, calls);
    cuda_mem_free(logits), cuda_mem_free(scratch), cuda_mem_free(out);
    free(x), free(want);
}

/* cuda_top_launch's draws over the whole vocabulary, T rows of N logits of KIND on device DEV,
 * SEEDS seeded draws a row at temperatures 0.6 and 1.3 in turn, a row's mode changing with the
 * seed (row 1 of more not drawn there): drawn there, each the token sample_next draws from the
 * same row with the same state, that draw used up alike; a nucleus (top-p 0.5 or 0.9, min-p 0 or
 * 0.05), where the device says its cut falls among the best, the token sample_next_best draws
 * from those and the total. Draws near 0 and near 1 (the walk's ends) come from the seeds' own
 * spread. */
static void check_draw(int dev, int n, int T, enum top_kind kind, int seeds)
{
    char name[240];
    float *x = plat_alloc((size_t)n * T * sizeof *x), *row = plat_alloc((size_t)n * sizeof *row);
    struct sample_candidate *cand = plat_alloc((size_t)n * sizeof *cand), got[CUDA_TOP_ROW];
    struct cuda_top_draw draw[4];
    for (int i = 0; i < n * T; i++) x[i] = top_logit(kind, i % n) * (float)(1 + i / n);
    cuda_ptr logits = device_copy(dev, x, (size_t)n * T * 4), scratch = device_copy(dev, NULL, (size_t)T * CUDA_TOP_SCRATCH);
    cuda_ptr out = device_copy(dev, NULL, (size_t)T * sizeof got), draws = device_copy(dev, NULL, sizeof draw);
    int ran = logits && scratch && out && draws, same = ran, drawn = 0, within = 0, outside = 0;
    for (int seed = 0; same && seed < seeds; seed++) {
        struct sample_params p[4];
        uint64_t rng[4];
        for (int t = 0; t < T; t++) {
            const int mode = t == 1 && T > 2 ? CUDA_DRAW_OFF : (seed + t) % 3 == 2 ? CUDA_DRAW_NUCLEUS : CUDA_DRAW_TOKEN;
            p[t] = (struct sample_params){seed % 2 ? 1.3f : 0.6f, 0, mode == CUDA_DRAW_NUCLEUS ? (seed % 4 < 2 ? 0.5f : 0.9f) : 1.0f,
                                          mode == CUDA_DRAW_NUCLEUS && seed % 2 ? 0.05f : 0.0f, 1.0f, 64, 0, 0.0f, 0.0f};
            rng[t] = 1000 * (uint64_t)seed + (uint64_t)t;
            uint64_t peek = rng[t];
            draw[t] = (struct cuda_top_draw){sample_unit(sample_next_u64(&peek)), p[t].temp, p[t].top_p, p[t].min_p, mode};
        }
        same = !cuda_htod(draws, draw, sizeof draw) && cuda_top_launch(&cuda.dev[dev], logits, n, scratch, out, draws, 0, T) == CUDA_SUCCESS;
        for (int t = 0; same && t < T; t++) {
            same = cuda_dtoh(got, out + (size_t)t * sizeof got, sizeof got) == 0;
            if (!draw[t].on || !same) continue;
            int id = -1;
            double total;
            uint64_t cpu = rng[t];
            memcpy(&total, &got[CUDA_TOP_K + 1], sizeof total);
            if (draw[t].on == CUDA_DRAW_TOKEN) memcpy(&id, &got[CUDA_TOP_K].logit, 4);
            else if (!(got[CUDA_TOP_K].id & 4)) {
                outside++;
                continue;
            }
            memcpy(row, x + (size_t)t * n, (size_t)n * sizeof *row);
            same = (id >= 0 || draw[t].on == CUDA_DRAW_NUCLEUS) &&
                   sample_next(&p[t], row, n, NULL, 0, &cpu, cand) == sample_next_best(&p[t], got, n, id, total, &rng[t]) && cpu == rng[t];
            drawn += draw[t].on == CUDA_DRAW_TOKEN;
            within += draw[t].on == CUDA_DRAW_NUCLEUS;
        }
    }
    snprintf(name, sizeof name, "whole-vocabulary draws on device %d: %d row%s of %d %s logits, %d seeded draws each: %d drawn there and "
             "%d nuclei from the best as sample_next draws them (%d nuclei need the row)", dev, T, T > 1 ? "s" : "", n,
             kind == TOP_TIES ? "often equal" : "clustered", seeds, drawn, within, outside);
    check(same && drawn + within + outside == seeds * (T > 2 ? T - 1 : T) && drawn > 0 && (within > 0 || n > 100000), name, "ran %d", ran);
    cuda_mem_free(logits), cuda_mem_free(scratch), cuda_mem_free(out), cuda_mem_free(draws);
    free(x), free(row), free(cand);
}

/* A nucleus whose best share one weight with tokens beyond them: on a row of 2112, the best logit
 * 100, 50 more near 99.5, then 20 whose logits differ by an ulp of 1.0 (the larger the id, the
 * larger), all one weight once 100 is taken off, the rest -1000; temperature 50. A cut at top-p
 * 0.5 falls before them: among the best, and drawn from them as sample_next draws (8 seeds). A cut
 * at 0.96 falls among the 13 of them that make the best, which sample_next orders by id with the
 * 7 others first: the row must come down. */
static void check_nucleus_tie(int dev)
{
    enum { N = 2112 };
    static float x[N], row[N];
    static struct sample_candidate cand[N], got[CUDA_TOP_ROW];
    float v = 1.0f;
    for (int i = 0; i < N; i++) x[i] = -1000.0f;
    x[7] = 100.0f;
    for (int i = 0; i < 50; i++) x[100 + i] = 99.5f - 0.01f * (float)i;
    for (int i = 0; i < 20; i++, v = nextafterf(v, 2.0f)) x[200 + i] = v;
    cuda_ptr logits = device_copy(dev, x, sizeof x), scratch = device_copy(dev, NULL, CUDA_TOP_SCRATCH);
    cuda_ptr out = device_copy(dev, NULL, sizeof got), draws = device_copy(dev, NULL, sizeof(struct cuda_top_draw));
    int same = logits && scratch && out && draws, within[2] = {0, 0};
    for (int c = 0; same && c < 16; c++) {
        const float top_p = c < 8 ? 0.5f : 0.96f;
        const struct sample_params p = {50.0f, 0, top_p, 0.0f, 1.0f, 64, 0, 0.0f, 0.0f};
        uint64_t rng = (uint64_t)c, cpu = rng, peek = rng;
        const struct cuda_top_draw d = {sample_unit(sample_next_u64(&peek)), p.temp, p.top_p, p.min_p, CUDA_DRAW_NUCLEUS};
        double total;
        same = !cuda_htod(draws, &d, sizeof d) && cuda_top_launch(&cuda.dev[dev], logits, N, scratch, out, draws, 0, 1) == CUDA_SUCCESS &&
               !cuda_dtoh(got, out, sizeof got);
        memcpy(&total, &got[CUDA_TOP_K + 1], sizeof total);
        memcpy(row, x, sizeof x);
        if (same && got[CUDA_TOP_K].id & 4)
            same = sample_next(&p, row, N, NULL, 0, &cpu, cand) == sample_next_best(&p, got, N, -1, total, &rng) && cpu == rng;
        within[c >= 8] += same && got[CUDA_TOP_K].id & 4;
    }
    check(same && within[0] == 8 && within[1] == 0, "a nucleus whose best share one weight with tokens beyond them: drawn from the best "
          "where cut before them, the row needed where cut among them", "%d and %d of 8 within", within[0], within[1]);
    /* why: a seed whose draw (top-p 0.96) lands among the tied tokens; drawn from the best
     * (the last launch's), it would have given another token */
    const struct sample_params p = {50.0f, 0, 0.96f, 0.0f, 1.0f, 64, 0, 0.0f, 0.0f};
    int seed = 0, cpu_id = -1, best_id = -1;
    for (; same && seed < 4000 && !(cpu_id >= 200 && cpu_id < 220); seed++) {
        uint64_t rng = (uint64_t)seed;
        memcpy(row, x, sizeof x);
        cpu_id = sample_next(&p, row, N, NULL, 0, &rng, cand);
    }
    if (cpu_id >= 200 && cpu_id < 220) {
        uint64_t rng = (uint64_t)(seed - 1);
        double total;
        memcpy(&total, &got[CUDA_TOP_K + 1], sizeof total);
        best_id = sample_next_best(&p, got, N, -1, total, &rng);
    }
    check(same && best_id >= 0 && best_id != cpu_id, "... and there the best alone would draw another token than the row (a tie of weights "
          "among them is ordered by id with the tokens beyond them)", "seed %d: row %d, best %d", seed - 1, cpu_id, best_id);
    cuda_mem_free(logits), cuda_mem_free(scratch), cuda_mem_free(out), cuda_mem_free(draws);
}

/* Penalties on the device: 3 rows of 2112 logits, each with its own history of 300 recent tokens
 * (repeats among them; the last 64 to 256 count; row 1's among its 150 best) and penalties (the
 * CTRL rule at 1.3, presence and frequency, none), and
 * each sampled greedily, by top-k 20, drawn at a temperature and by a nucleus in turn (8 rounds):
 * the token sample_next gives with that history, and the logits as they were after. */
static void check_penalty(int dev)
{
    enum { N = 2112, T = 3, H = 300 };
    static float x[N * T], row[N], back[N * T];
    static struct sample_candidate cand[N], got[CUDA_TOP_ROW];
    static struct cuda_top_penalty pen[T];
    static int history[T][H];
    struct cuda_top_draw draw[T];
    for (int i = 0; i < N * T; i++) x[i] = top_logit(TOP_TIES, i % N);
    sample_top(x + N, N, 150, cand); /* row 1's history: among its best */
    for (int t = 0; t < T; t++)
        for (int i = 0; i < H; i++) history[t][i] = t == 1 ? cand[rng_next() % 150].id : (int)(rng_next() % N);
    cuda_ptr logits = device_copy(dev, x, sizeof x), scratch = device_copy(dev, NULL, (size_t)T * CUDA_TOP_SCRATCH);
    cuda_ptr out = device_copy(dev, NULL, (size_t)T * sizeof got), draws = device_copy(dev, NULL, sizeof draw), pens = device_copy(dev, NULL, sizeof pen);
    int same = logits && scratch && out && draws && pens, checked = 0, listed = 1;
    for (int round = 0; same && round < 8; round++) {
        struct sample_params p[T];
        uint64_t rng[T];
        for (int t = 0; t < T; t++) {
            const int way = (round + t) % 4; /* greedy, top-k, drawn, nucleus */
            p[t] = (struct sample_params){way ? 0.8f : 0.0f, way == 1 ? 20 : 0, way == 3 ? 0.3f : 1.0f, 0.0f, t == 0 ? 1.3f : 1.0f,
                                          64 * (round % 4 + 1), 0, t == 1 ? 0.5f : 0.0f, t == 1 ? 0.3f : 0.0f};
            listed &= sample_penalties(&p[t], history[t], H, &pen[t]);
            if (!sample_penalised(&p[t])) pen[t].n = 0; /* as the engine sends a row without */
            rng[t] = (uint64_t)(100 * round + t);
            uint64_t peek = rng[t];
            draw[t] = (struct cuda_top_draw){sample_unit(sample_next_u64(&peek)), p[t].temp, p[t].top_p, p[t].min_p, sample_vocab_mode(&p[t], N)};
        }
        same = listed && !cuda_htod(draws, draw, sizeof draw) && !cuda_htod(pens, pen, sizeof pen) &&
               cuda_top_launch(&cuda.dev[dev], logits, N, scratch, out, draws, pens, T) == CUDA_SUCCESS && !cuda_dtoh(back, logits, sizeof back) &&
               !memcmp(back, x, sizeof x);
        for (int t = 0; same && t < T; t++) {
            int id;
            double total;
            uint64_t cpu = rng[t];
            same = !cuda_dtoh(got, out + (size_t)t * sizeof got, sizeof got);
            memcpy(&id, &got[CUDA_TOP_K].logit, 4);
            memcpy(&total, &got[CUDA_TOP_K + 1], sizeof total);
            if (draw[t].on != CUDA_DRAW_TOKEN) id = -1;
            if (!same || (draw[t].on == CUDA_DRAW_NUCLEUS && !(got[CUDA_TOP_K].id & 4))) continue;
            memcpy(row, x + (size_t)t * N, sizeof row);
            same = sample_next(&p[t], row, N, history[t], H, &cpu, cand) == sample_next_best(&p[t], got, N, id, total, &rng[t]) && cpu == rng[t];
            checked++;
        }
    }
    check(same && checked >= 20, "penalties on the device: greedy, top-k, drawn and nucleus tokens as sample_next gives them after the same "
          "history's penalties, and the logits as they were after", "%d checked, %s", checked, listed ? "listed" : "a list too long");
    cuda_mem_free(logits), cuda_mem_free(scratch), cuda_mem_free(out), cuda_mem_free(draws), cuda_mem_free(pens);
}

static void test_top_device(int real)
{
    check_penalty(0);
    check_nucleus_tie(0);
    check_draw(0, 248320, 2, TOP_CLUSTER, 3);
    check_draw(0, 2112, 3, TOP_TIES, 12);
    check_draw(0, 50, 1, TOP_TIES, 8);
    check_top(0, 248320, 2, TOP_TIES, 1);    /* the 35B-A3B's vocabulary: its best are one value */
    check_top(!real, 248320, 1, TOP_CLUSTER, 1);
    check_top(0, 2112, 3, TOP_CLUSTER, 1);   /* the golden models' vocabulary (66 slices of 32), no cluster */
    check_top(0, 50, 2, TOP_TIES, 1);        /* fewer logits than CUDA_TOP_K */
    check_top(0, 5000, 1, TOP_EQUAL, 0);
    check_top(!real, 2112, 2, TOP_NOT_FINITE, 1);
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

/* ---- §7's decisions, as functions of numbers (no device) ---- */

#define MiB ((size_t)1 << 20)

/* Offers in O: N_TRUNK lm_head-like matrices of TRUNK bytes, then N_EXPERTS experts of EXPERT
 * bytes (VRAM and CPU alike), of one layer, read with P[i] (hottest first; NULL: all P0), that
 * DEVICES can run. Returns the count. */
static int make_offers(struct place_offer *o, int n_trunk, size_t trunk, int n_experts, size_t expert, const double *p, double p0,
                       uint32_t devices)
{
    for (int i = 0; i < n_trunk; i++) o[i] = (struct place_offer){PLACE_LMHEAD, i, trunk, trunk, 1.0, devices, PLACE_CPU, 0, 0, i};
    for (int i = 0; i < n_experts; i++)
        o[n_trunk + i] = (struct place_offer){PLACE_EXPERTS, 0, expert, expert, p ? p[i] : p0, devices, PLACE_CPU, 0, 0, i};
    return n_trunk + n_experts;
}

/* The offers among O[FROM..TO) that went to device DEV (PLACE_CPU: stayed). */
static int count_home(const struct place_offer *o, int from, int to, int dev)
{
    int n = 0;
    for (int i = from; i < to; i++) n += o[i].home == dev;
    return n;
}

static void decide(struct place_offer *o, int n_trunk, int n, const char *spec, const struct place_host *h, struct place_rooms *rooms)
{
    struct place_rule rule[PLACE_COUNT];
    place_parse(spec, rule);
    place_decide(o, n_trunk, n, rule, h, rooms);
}

/* Without heat every expert is read with top_k / n_expert (8 / 256), so a trunk matrix that fits
 * goes first and the experts get exactly what it leaves; one too big stays on the CPU. */
static void test_place_fits(void)
{
    struct place_offer o[1 + 64];
    struct place_host mem = {-1, 0, 1, 1.0};
    struct place_rooms rooms = {1, {100 * MiB}};
    int n = make_offers(o, 1, 30 * MiB, 64, 2 * MiB, NULL, 8.0 / 256, 1);
    decide(o, 1, n, NULL, &mem, &rooms);
    check(o[0].home == 0 && o[0].value == 1.0 && count_home(o, 1, n, 0) == 35 && rooms.room[0] == 0, "place: a trunk matrix that fits goes first; the experts fill exactly what it leaves",
          "trunk %d (value %.3f), experts %d, room %lld", o[0].home, o[0].value, count_home(o, 1, n, 0), (long long)rooms.room[0]);
    rooms = (struct place_rooms){1, {100 * MiB}};
    n = make_offers(o, 1, 101 * MiB, 64, 2 * MiB, NULL, 8.0 / 256, 1);
    decide(o, 1, n, NULL, &mem, &rooms);
    check(o[0].home == PLACE_CPU && o[0].why == PLACE_NO_ROOM && count_home(o, 1, n, 0) == 50, "place: a trunk matrix too big for the device stays on the CPU, the experts take the room",
          "trunk %d (why %d), experts %d", o[0].home, o[0].why, count_home(o, 1, n, 0));
    rooms = (struct place_rooms){1, {2 * MiB}};
    n = make_offers(o, 1, 2 * MiB, 1, 2 * MiB, NULL, 1.0, 1);
    decide(o, 1, n, NULL, &mem, &rooms);
    check(o[0].home == 0 && o[1].home == PLACE_CPU && o[0].value == o[1].value, "place: a tie between a trunk matrix and an expert read on every token goes to the trunk",
          "trunk %d, expert %d", o[0].home, o[1].home);
}

/* A trunk matrix placed leaves its RAM to the cache (the budget is what memory leaves): with
 * no cache before it, the hottest expert is then a hit, priced p + the next miss's extra read
 * (0.4 + 0.3), not a miss's 2 x 0.4. */
static void test_place_freed(void)
{
    const double p[3] = {0.4, 0.3, 0.2};
    struct place_offer o[1 + 3];
    struct place_host grows = {0, MiB, 1, 1.0};
    struct place_rooms rooms = {1, {2 * MiB}};
    int n = make_offers(o, 1, MiB, 3, MiB, p, 0, 1);
    decide(o, 1, n, NULL, &grows, &rooms);
    check(o[0].home == 0 && fabs(o[0].value - 1.4) < 1e-12 && o[1].home == 0 && fabs(o[1].value - 0.7) < 1e-12,
          "place: a trunk matrix in VRAM leaves its RAM to the expert cache, and the experts are priced with it",
          "trunk %d value %.3f, expert %d value %.3f", o[0].home, o[0].value, o[1].home, o[1].value);
}

/* The heat's verdicts. A device with room for 10 experts; one trunk matrix of an expert's size;
 * the experts read from the file beyond a RAM cache of 4 (--ram: fixed). The 10th (marginal)
 * expert at p 0.67 is worth 2 x 0.67 = 1.33 per byte against the trunk's 1: it keeps its place;
 * at p 0.17 (0.34) it loses it to the trunk. With the budget of what memory leaves, the trunk's
 * RAM turns a miss into a hit as well (1 + 0.67): then the trunk wins even against p 0.67; with
 * every expert in memory (no misses) the trunk wins too. */
static void test_place_heat(void)
{
    double p[40];
    struct place_offer o[1 + 40];
    struct place_host fixed = {4 * (int64_t)MiB, MiB, 0, 1.0}, grows = {4 * (int64_t)MiB, MiB, 1, 1.0}, mem = {-1, 0, 1, 1.0};
    const struct { double hot; const struct place_host *h; int trunk; const char *name; } cases[] = {
        {0.67, &fixed, 0, "place: heat, fixed RAM cache: the marginal expert at p 0.67 keeps its place against a trunk matrix"},
        {0.17, &fixed, 1, "place: heat, fixed RAM cache: the marginal expert at p 0.17 loses its place to a trunk matrix"},
        {0.67, &grows, 1, "place: heat, the cache is what memory leaves: the trunk's RAM tips it, the trunk goes in"},
        {0.67, &mem, 1, "place: heat, every expert in memory: the trunk goes in"}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        for (int i = 0; i < 40; i++) p[i] = i < 14 ? cases[c].hot : 0.01;
        struct place_rooms rooms = {1, {10 * MiB}};
        int n = make_offers(o, 1, MiB, 40, MiB, p, 0, 1);
        decide(o, 1, n, NULL, cases[c].h, &rooms);
        int experts = count_home(o, 1, n, 0);
        check((o[0].home == 0) == cases[c].trunk && experts == 10 - cases[c].trunk && rooms.room[0] == 0, cases[c].name,
              "trunk %d (value %.3f), experts %d, the last placed's value %.3f", o[0].home, o[0].value, experts, o[experts].value);
    }
    struct place_rooms rooms = {1, {10 * MiB}};
    int n = make_offers(o, 1, MiB, 40, MiB, NULL, 8.0 / 256, 1);
    decide(o, 1, n, NULL, &fixed, &rooms);
    check(o[0].home == 0 && count_home(o, 1, n, 0) == 9, "place: no heat file, fixed RAM cache: the trunk goes in (2 x 8/256 per byte against 1)",
          "trunk %d, experts %d", o[0].home, count_home(o, 1, n, 0));
}

/* Room the hot experts leave (less than an expert) goes to a trunk matrix that fits it, though
 * the experts were worth more. */
static void test_place_leftover(void)
{
    double p[20];
    struct place_offer o[1 + 20];
    struct place_host fixed = {2 * (int64_t)MiB, MiB, 0, 1.0};
    for (int i = 0; i < 20; i++) p[i] = 0.9;
    struct place_rooms rooms = {1, {10 * MiB + MiB / 2}};
    int n = make_offers(o, 1, MiB / 4, 20, MiB, p, 0, 1);
    decide(o, 1, n, NULL, &fixed, &rooms);
    check(o[0].home == 0 && o[0].value < o[1].value && count_home(o, 1, n, 0) == 10 && rooms.room[0] == (int64_t)(MiB / 4),
          "place: room the experts leave goes to the trunk", "trunk %d, experts %d, room %lld", o[0].home, count_home(o, 1, n, 0),
          (long long)rooms.room[0]);
}

/* --place lists: obeyed as written and charged to the device named; off keeps the trunk; cpu
 * is a device name; two devices each within their own budget. */
static void test_place_rules(void)
{
    struct place_offer o[2 + 16];
    struct place_host mem = {-1, 0, 1, 1.0};
    struct place_rooms rooms = {2, {40 * MiB, 10 * MiB}};
    int n = make_offers(o, 2, 4 * MiB, 16, MiB, NULL, 0.1, 3);
    decide(o, 2, n, "lmhead=1", &mem, &rooms);
    check(o[0].home == 1 && o[1].home == 1 && count_home(o, 2, n, PLACE_CPU) == 16 && o[2].why == PLACE_BY_RULE && rooms.room[1] == 2 * MiB &&
              rooms.room[0] == 40 * (int64_t)MiB,
          "place: --place lmhead=1 is obeyed (device 1, not the roomier 0) and charged there; the experts it leaves out stay",
          "homes %d %d, experts on the CPU %d, room %lld %lld", o[0].home, o[1].home, count_home(o, 2, n, PLACE_CPU),
          (long long)rooms.room[0], (long long)rooms.room[1]);
    rooms = (struct place_rooms){2, {40 * MiB, 10 * MiB}};
    n = make_offers(o, 2, 4 * MiB, 16, MiB, NULL, 0.1, 3);
    decide(o, 2, n, "off", &mem, &rooms);
    check(count_home(o, 0, 2, PLACE_CPU) == 2 && o[0].why == PLACE_BY_RULE && count_home(o, 2, n, PLACE_CPU) == 0,
          "place: --place off: the trunk stays, every expert placed", "trunk on the CPU %d, experts on the CPU %d",
          count_home(o, 0, 2, PLACE_CPU), count_home(o, 2, n, PLACE_CPU));
    rooms = (struct place_rooms){2, {12 * MiB, 7 * MiB}};
    n = make_offers(o, 2, 4 * MiB, 16, MiB, NULL, 0.1, 3);
    decide(o, 2, n, "lmhead=0:1+cpu:1,experts=1", &mem, &rooms);
    check(o[0].home == 0 && o[1].home == PLACE_CPU && o[1].why == PLACE_BY_RULE && count_home(o, 2, n, 1) == 7 &&
              count_home(o, 2, n, PLACE_CPU) == 9 && o[2 + 7].why == PLACE_NO_ROOM,
          "place: lmhead=0:1+cpu:1,experts=1: the first to 0, the second to the CPU, device 1's 7 MiB to 7 experts",
          "homes %d %d, experts on 1 %d", o[0].home, o[1].home, count_home(o, 2, n, 1));
    rooms = (struct place_rooms){2, {9 * MiB, 5 * MiB}};
    n = make_offers(o, 0, 0, 16, MiB, NULL, 0.1, 3);
    decide(o, 0, n, NULL, &mem, &rooms);
    check(count_home(o, 0, n, 0) == 9 && count_home(o, 0, n, 1) == 5 && rooms.room[0] == 0 && rooms.room[1] == 0,
          "place: two devices: each takes what its own budget holds", "device 0 %d, device 1 %d", count_home(o, 0, n, 0), count_home(o, 0, n, 1));
    rooms = (struct place_rooms){2, {4 * MiB, 8 * MiB}};
    n = make_offers(o, 0, 0, 6, MiB, NULL, 0.1, 3);
    decide(o, 0, n, NULL, &mem, &rooms);
    check(count_home(o, 0, n, 0) == 1 && count_home(o, 0, n, 1) == 5 && rooms.room[0] == rooms.room[1],
          "place: two devices: each offer goes to the one with the most room", "device 0 %d, device 1 %d", count_home(o, 0, n, 0), count_home(o, 0, n, 1));
}

/* No VRAM, or no kernel: nothing changes. */
static void test_place_nothing(void)
{
    struct place_offer o[1 + 4];
    struct place_host mem = {-1, 0, 1, 1.0};
    struct place_rooms none = {1, {0}}, rooms = {1, {64 * MiB}};
    int n = make_offers(o, 1, MiB, 4, MiB, NULL, 0.5, 1);
    decide(o, 1, n, NULL, &mem, &none);
    check(count_home(o, 0, n, PLACE_CPU) == n && o[0].why == PLACE_NO_ROOM && none.room[0] == 0,
          "place: no VRAM offered (--vram 0): everything stays on the CPU", "%d of %d on the CPU", count_home(o, 0, n, PLACE_CPU), n);
    n = make_offers(o, 1, MiB, 4, MiB, NULL, 0.5, 0);
    decide(o, 1, n, NULL, &mem, &rooms);
    check(count_home(o, 0, n, PLACE_CPU) == n && o[1].why == PLACE_NO_KERNEL && rooms.room[0] == 64 * (int64_t)MiB,
          "place: no kernel for the type: everything stays, nothing charged", "%d of %d on the CPU", count_home(o, 0, n, PLACE_CPU), n);
}

/* The probe's verdict counts the round trip; a device it withdraws gets no trunk, and its room
 * goes to the experts. */
static void test_place_probe(void)
{
    const struct place_probe fast = {1e-4, 2e-5, 1e-3}, slow = {2e-3, 2e-5, 1e-3}, round_trip = {9e-4, 2e-4, 1e-3};
    check(!place_probe_slower(&fast) && place_probe_slower(&slow) && place_probe_slower(&round_trip),
          "place: the probe's verdict: slower than the CPU, the round trip counted", "fast %d, slow %d, round trip %d",
          place_probe_slower(&fast), place_probe_slower(&slow), place_probe_slower(&round_trip));
    struct place_offer o[2 + 16];
    struct place_host mem = {-1, 0, 1, 1.0};
    struct place_rooms rooms = {2, {10 * MiB, 10 * MiB}};
    int n = make_offers(o, 2, 4 * MiB, 16, MiB, NULL, 0.1, 3);
    place_withdraw_trunk(o, 2, 1);
    decide(o, 2, n, NULL, &mem, &rooms);
    check(o[0].home == 0 && o[1].home == 0 && count_home(o, 2, n, 1) == 10 && count_home(o, 2, n, 0) == 2 && rooms.room[1] == 0,
          "place: a device the probe withdrew: the trunk on the other, its room to the experts", "trunk %d %d, experts on 0 %d, on 1 %d",
          o[0].home, o[1].home, count_home(o, 2, n, 0), count_home(o, 2, n, 1));
}

/* The expected time per token, by hand: a 1 MiB trunk matrix on device 0 (1 GB/s, round trip
 * 10 us), two 1 MiB experts routed half the time on the CPU (0.5 GB/s), all in memory. */
static void test_place_expected(void)
{
    struct place_offer o[3];
    struct place_host mem = {-1, 0, 1, 1.0};
    struct place_speed sp = {0.5, {1.0}, {1e-5}};
    int n = make_offers(o, 1, MiB, 2, MiB, NULL, 0.5, 1);
    o[0].home = 0;
    double want = MiB / 1e9 + 1e-5 + 2 * 0.5 * MiB / 0.5e9, got = place_expected_seconds(o, 1, n, &mem, &sp);
    check(fabs(got - want) < 1e-12, "place: the expected seconds per token: each bus's bytes over its speed, a round trip per call",
          "%.9f s, by hand %.9f", got, want);
}

/* Two unequal devices: 0 fast (1000 GB/s) with room for the trunk and one expert, 1 slow (50
 * GB/s) with room for all. The choice puts the trunk on 0 and the experts on 1, and is no slower
 * than any of the hand-written lists beside it. */
static void test_place_two_devices(void)
{
    static const char *const lists[] = {"lmhead=0,experts=1", "lmhead=1,experts=0", "lmhead=0,experts=0", "lmhead=1,experts=1",
                                        "lmhead=0:2+1:2,experts=1", "lmhead=1:2+0:2,experts=0", "lmhead=0,experts=0:1"};
    struct place_offer o[4 + 32], l[4 + 32];
    struct place_host mem = {-1, 0, 1, 1.0};
    struct place_speed sp = {10, {1000, 50}, {2e-6, 2e-6}};
    const struct place_rooms rooms = {2, {9 * MiB, 64 * MiB}};
    struct place_rule rule[PLACE_COUNT];
    int n = make_offers(o, 4, 2 * MiB, 32, MiB, NULL, 0.25, 3);
    place_parse(NULL, rule);
    place_choose_split(o, 4, n, rule, &mem, &rooms, &sp);
    struct place_rooms left = rooms;
    place_decide(o, 4, n, rule, &mem, &left);
    double chosen = place_expected_seconds(o, 4, n, &mem, &sp), best_list = INFINITY;
    for (size_t k = 0; k < sizeof lists / sizeof *lists; k++) {
        make_offers(l, 4, 2 * MiB, 32, MiB, NULL, 0.25, 3);
        left = rooms;
        decide(l, 4, n, lists[k], &mem, &left);
        best_list = fmin(best_list, place_expected_seconds(l, 4, n, &mem, &sp));
    }
    check(count_home(o, 0, 4, 0) == 4 && count_home(o, 4, n, 1) == 32 && chosen <= best_list,
          "place: two unequal devices: trunk on the fast one, experts on the roomy one, no slower than a hand-written list",
          "trunk on 0: %d, experts on 1: %d; %.6f ms against the best list's %.6f ms", count_home(o, 0, 4, 0), count_home(o, 4, n, 1),
          chosen * 1e3, best_list * 1e3);
}

static void test_place(void)
{
    test_place_expected();
    test_place_two_devices();
    test_place_probe();
    test_place_fits();
    test_place_freed();
    test_place_heat();
    test_place_leftover();
    test_place_rules();
    test_place_nothing();
}

/* bench --kernels' device figures. On the fake, its clock: a launch takes 1 us plus its weight
 * bytes at 1000 GB/s, a device copy 1 us plus twice its bytes at that speed, so the figures
 * are known ahead. On a real card (gpu_check.sh): printed, for the decode's main formats. */
/* On a card: the output head's best of a 35B-A3B row (cuda_top_launch's 4 launches, then its
 * 520 bytes down) against bringing the row down (1 MiB), each the mean of 200 by the clock. */
static void bench_top(int dev)
{
    const int n = 248320, reps = 200;
    float *x = random_x(1, n);
    struct sample_candidate got[CUDA_TOP_ROW];
    const struct cuda_top_draw draw = {0.5, 0.8f, 1.0f, 0.0f, CUDA_DRAW_TOKEN};
    cuda_ptr logits = device_copy(dev, x, (size_t)n * 4), scratch = device_copy(dev, NULL, CUDA_TOP_SCRATCH), out = device_copy(dev, NULL, sizeof got);
    cuda_ptr draws = device_copy(dev, &draw, sizeof draw);
    int fine = logits && scratch && out && draws;
    double t[4] = {plat_now()};
    for (int i = 0; i < reps && fine; i++) fine = !cuda_top_launch(&cuda.dev[dev], logits, n, scratch, out, 0, 0, 1) && !cuda_dtoh(got, out, sizeof got);
    t[1] = plat_now();
    for (int i = 0; i < reps && fine; i++) fine = !cuda_top_launch(&cuda.dev[dev], logits, n, scratch, out, draws, 0, 1) && !cuda_dtoh(got, out, sizeof got);
    t[2] = plat_now();
    for (int i = 0; i < reps && fine; i++) fine = !cuda_dtoh(x, logits, (size_t)n * 4);
    t[3] = plat_now();
    if (fine) printf("# device %d: the best %d of %d logits %.1f us a row (4 launches, %zu bytes down), with a draw over them all %.1f us (6); "
                     "the row down %.1f us\n", dev, CUDA_TOP_K, n, (t[1] - t[0]) / reps * 1e6, sizeof got, (t[2] - t[1]) / reps * 1e6,
                     (t[3] - t[2]) / reps * 1e6);
    else printf("# device %d: the output head's best not timed: a driver call failed\n", dev);
    cuda_mem_free(logits), cuda_mem_free(scratch), cuda_mem_free(out), cuda_mem_free(draws);
    free(x);
}

static void test_bench(int real)
{
    const enum gguf_type bt[3] = {GGUF_TYPE_Q4_K, GGUF_TYPE_Q6_K, GGUF_TYPE_Q8_0};
    double bw = cuda_bench_bandwidth(0), want_bw = 2.0 * (256 << 20) / (1e3 + 2.0 * (256 << 20) / 1000.0);
    if (real) printf("# device 0: copy bandwidth %.1f GB/s (read + write)\n", bw);
    else check(fabs(bw - want_bw) < 0.01 * want_bw, "bench: the device's copy bandwidth by its events", "%.2f GB/s, want %.2f", bw, want_bw);
    for (int i = 0; i < 3; i++) {
        int64_t rows = real ? 16384 : 512, cols = real ? 4096 : 2048;
        double g = cuda_bench_gemv(0, bt[i], rows, cols), bytes = (double)gguf_row_bytes(bt[i], cols) * (double)rows;
        double want = bytes / (1e3 + bytes / 1000.0);
        if (real) printf("# device 0: matvec_%s %lldx%lld: %.1f GB/s, %.0f%% of the copy bandwidth\n", gguf_types[bt[i]].name,
                         (long long)rows, (long long)cols, g, 100 * plat_ratio(g, bw));
        else check(fabs(g - want) < 0.01 * want, "bench: a GEMV's GB/s by the probe's timing", "%s: %.2f GB/s, want %.2f",
                   gguf_types[bt[i]].name, g, want);
    }
    if (real) bench_top(0);
}

/* Windows of CUDA_GRAPH_MIN launches of residual_norm (T rows of X normed by NORM into an
 * output) on device DEV: the first made one by one, the second too and then built into a graph,
 * the third run as that graph; a fourth of the same kernels and grids into another output must
 * not run as it (a graph is followed only while every value is the same). Each output the
 * bits of ops_rmsnorm. */
static void check_graph_windows(int dev)
{
    const int dim = 96, T = 3;
    const size_t bytes = (size_t)T * dim * 4;
    float *x = random_x(T, dim), *norm = random_x(1, dim), *cpu = plat_alloc(bytes), *got = plat_alloc(bytes), *zeros = plat_zalloc(bytes, 1);
    for (int t = 0; t < T; t++) ops_rmsnorm(cpu + (size_t)t * dim, x + (size_t)t * dim, norm, dim, 1e-6f);
    cuda_ptr px = device_copy(dev, x, bytes), pn = device_copy(dev, norm, (size_t)dim * 4);
    cuda_ptr outs[2] = {device_copy(dev, NULL, bytes), device_copy(dev, NULL, bytes)};
    long runs[4];
    int same = px && pn && outs[0] && outs[1];
    for (int w = 0; w < 4 && same; w++) {
        cuda_ptr none = 0, out = outs[w == 3];
        int n = dim;
        float eps = 1e-6f;
        void *params[] = {&px, &none, &pn, &out, &n, &eps};
        const long before = cuda.graph_runs;
        same = cuda_htod(out, zeros, bytes) == 0;
        for (int i = 0; i < CUDA_GRAPH_MIN && same; i++) same = cuda_launch(cuda.dev[dev].residual_norm, (unsigned)T, 1, 32, params) == 0;
        same = same && cuda_dtoh(got, out, bytes) == 0 && !memcmp(got, cpu, bytes);
        runs[w] = cuda.graph_runs - before;
    }
    check(same && !runs[0] && !runs[1] && runs[2] == 1 && !runs[3], "windows of launches: the third as one CUDA graph, one with other values not",
          "same %d, graph launches %ld %ld %ld %ld", same, runs[0], runs[1], runs[2], runs[3]);
    cuda_ptr bufs_d[] = {px, pn, outs[0], outs[1]};
    for (size_t i = 0; i < sizeof bufs_d / sizeof *bufs_d; i++) cuda_mem_free(bufs_d[i]);
    cuda_release_all();
    void *bufs[] = {x, norm, cpu, got, zeros};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
}

/* COLI_TEST_REAL=1 (tests/gpu_check.sh): the system's driver and its first device instead of
 * the fake, kernels only. COLI_TEST_SIM=1: the fake that runs kernels.cu's source on the host
 * (build/sim, tests/kernels_sim.cc) instead of its twins, kernels only. */
int main(int argc, char **argv)
{
    int quick = argc > 2 && !strcmp(argv[2], "--quick"), real = getenv("COLI_TEST_REAL") != NULL;
    int sim = !real && getenv("COLI_TEST_SIM") != NULL, kernels_only = real || sim;
    plat_quiet = 1;
    plat_cpu_detect();
    quant_init();
    if (!kernels_only) test_place();
    if (!real) {
        setenv("COLI_LIBCUDA", sim ? "build/sim/libcuda.so.1" : "build/fake/libcuda.so.1", 1);
        setenv("FAKE_CUDA_DEVICES", "2", 1);
    }
    cuda_start(real ? "0" : NULL, -1, 1);
    check(cuda.ready && cuda.n_devices >= (real ? 1 : 2), real ? "system driver: a device ready" : "fake driver: 2 devices ready",
          "%s", cuda.why);
    if (!cuda.ready) return check_done(); /* the check above failed: nothing else can run */
    if (real) printf("# device 0: %s, compute %d.%d\n", cuda.dev[0].name, cuda.dev[0].cc_major, cuda.dev[0].cc_minor);
    else check(cuda.dev[0].pci_bus < cuda.dev[1].pci_bus && !strcmp(cuda.dev[0].name, "Fake GPU B"),
               "devices in PCI bus order, not the driver's", "%s first", cuda.dev[0].name);
    double us = cuda_measure_call();
    printf("ok - one wrapped driver call: %.3f us (glibc build: lock and signal mask, no thread-pointer switch)\n", us);
    n_pass++;
    const int graphs = cuda.graphs;
    cuda.graphs = 0; /* the calls counted below are launches one by one, their windows short and repeated */
    test_kernels(quick, real);
    check_jobs(real, 1);
    check_jobs(real, 3);
    test_experts(quick, real);
    cuda.graphs = graphs;
    test_moe_layer(real);
    check_graph_windows(real ? 0 : 1);
    test_deltanet_device(real);
    test_attention_device(real);
    test_top_device(real);
    if (!sim) test_bench(real);
    if (!kernels_only) test_failures();
    cuda_stop();
    return check_done();
}
