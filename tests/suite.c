/* suite: the six test programs that reach coli's kernels (test_quant, test_model, test_experts,
 * test_cuda, test_serve, test_sample) in one binary, so that ./build.sh test compiles coli.c once
 * per build kind instead of six times: the kernels' dispatch tables make most of coli.c
 * reachable from each, and that part is the compile (on a 2-core AMD EPYC host, ~110 s each
 * under ASan+UBSan and as shipped). Each program still builds alone (tests/gpu_check.sh builds test_cuda).
 *
 * usage: suite PROGRAM [ARGS...]     runs PROGRAM's main with ARGS (argv[0] = PROGRAM) */
#define main suite_test_quant_main
#include "test_quant.c"
#undef main
#define main suite_test_model_main
#include "test_model.c"
#undef main
#define main suite_test_experts_main
#include "test_experts.c"
#undef main
#define main suite_test_cuda_main
#include "test_cuda.c"
#undef main
#define main suite_test_serve_main
#include "test_serve.c"
#undef main
#define main suite_test_sample_main
#include "test_sample.c"
#undef main

int main(int argc, char **argv)
{
    static const struct { const char *name; int (*main)(int, char **); } programs[] = {
        {"test_quant", suite_test_quant_main}, {"test_model", suite_test_model_main},
        {"test_experts", suite_test_experts_main}, {"test_cuda", suite_test_cuda_main},
        {"test_serve", suite_test_serve_main}, {"test_sample", suite_test_sample_main},
    };
    for (size_t i = 0; argc > 1 && i < sizeof programs / sizeof programs[0]; i++)
        if (!strcmp(argv[1], programs[i].name)) return programs[i].main(argc - 1, argv + 1);
    fprintf(stderr, "usage: suite test_quant|test_model|test_experts|test_cuda|test_serve|test_sample [ARGS...]\n");
    return 2;
}
