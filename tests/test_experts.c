/* test_experts: the expert store (§6). Every golden model run with the experts behind a tiny
 * budget (4 slots: one layer's experts do not fit), a middling one and a warm heat file gives
 * the same tokens and logits, bit for bit, as the experts read in place from the mapping.
 * The heat file round-trips; a corrupt one, one of another version and one of another model
 * are each ignored with one line. A model file that fails (I/O error) or shrinks while
 * running ends the run with one `coli: FILE: ...` line and exit status 1.
 *
 * usage: test_experts [GOLDEN_DIR] [--quick]     (--quick: the first case of each model) */
#define COLI_NO_MAIN
#include "../coli.c"
#include "check.h"
#include "minijson.h"

#include <sys/wait.h>

#define GEN_TOKENS 16

/* T tokens of sequence Q through the model; the logits of the last. */
static float *forward_tokens(struct model *m, struct model_seq *q, const int *tokens, int T)
{
    struct model_run run = {q, tokens, T, NULL, 0, NULL, {0, 0, 0, 0, 0}, NULL};
    if (model_forward_runs(m, &run, 1)) die("%s", m->error);
    return run.logits;
}


/* Runs PROMPT (in batches) then GEN_TOKENS greedy tokens from position 0; returns a hash of every
 * logit row and token, so two runs agree bit for bit iff their hashes do. */
static uint64_t greedy_run_hash(struct model *m, const int *prompt, int n_prompt)
{
    int V = m->cfg.n_vocab;
    uint64_t h = 14695981039346656037ull;
    struct model_seq q;
    model_seq_init(m, &q);
    float *lg = NULL;
    for (int i = 0; i < n_prompt; i += MODEL_BATCH) lg = forward_tokens(m, &q, prompt + i, n_prompt - i < MODEL_BATCH ? n_prompt - i : MODEL_BATCH);
    for (int g = 0; g < GEN_TOKENS; g++) {
        int tok = sample_argmax(lg, V);
        h = (h ^ expert_fnv((const uint8_t *)lg, (size_t)V * sizeof(float))) * 1099511628211ull;
        h = (h ^ (uint64_t)tok) * 1099511628211ull;
        if (g + 1 < GEN_TOKENS) lg = forward_tokens(m, &q, &tok, 1);
    }
    model_seq_free(m, &q);
    return h;
}

static void store_with(struct model *m, int64_t budget, const char *heat_path)
{
    struct expert_config cfg = {budget, heat_path, model_fingerprint(m), EXPERT_IO_DIRECT, 0, 0};
    model_store_experts(m, &cfg);
    expert_start(m->experts);
}

/* The prompts of a golden case file: [n][len] in *LENS; returns n. */
static int load_prompts(const struct mj *root, int max, int **prompts, int *lens)
{
    const struct mj *cases = mj_get(root, "cases");
    int n = 0;
    for (size_t ci = 0; ci < mj_len(cases) && n < max; ci++, n++) {
        const struct mj *pt = mj_get(mj_at(cases, ci), "prompt_tokens");
        lens[n] = (int)mj_len(pt);
        prompts[n] = plat_alloc((size_t)lens[n] * sizeof(int));
        for (int i = 0; i < lens[n]; i++) prompts[n][i] = (int)mj_num(mj_at(pt, (size_t)i), -1);
    }
    return n;
}

/* Mapped mode with the store's own copy of the experts (expert_own: interleaved where the type
 * has that form, as no device takes part here): the same hashes WANT as the mapping. */
static void test_own_copy(struct model *m, const char *model_file, int **prompts, const int *lens, int n, const uint64_t *want)
{
    struct expert_config cfg = {-1, NULL, model_fingerprint(m), EXPERT_IO_DIRECT, 1, 0};
    model_store_experts(m, &cfg);
    expert_start(m->experts);
    int same = 1, interleaved = 0;
    for (int l = 0; l < m->experts->n_layers; l++)
        for (int j = 0; j < 3; j++) interleaved += m->experts->src[l][j].t.m.interleaved;
    for (int i = 0; i < n; i++) same &= greedy_run_hash(m, prompts[i], lens[i]) == want[i];
    char name[300];
    snprintf(name, sizeof name, "%s: experts copied into the store's memory (%d of %d tensors interleaved) bit-identical to the mapping",
             model_file, interleaved, 3 * m->experts->n_layers);
    check(same && m->experts->own, name, "logits or tokens differ (own copy %s)", m->experts->own ? "made" : "not made");
}

/* The rule by which model_place copies the experts out of the mapping (model_copies), at
 * budgets of 0.5, 1.5 and 2.5 times their bytes: below them a cache; at 1.5 times a copy for a
 * server (MODEL_COPY_OVER_FILE_PAGES) and the mapping for the rest; at 2.5 times a copy for both. */
static void test_copy_rule(struct model *m, const char *model_file)
{
    static const double times[] = {0.5, 1.5, 2.5};
    const int64_t experts = (int64_t)model_expert_bytes(m);
    int bad = 0;
    char name[300], why[200] = "";
    for (int t = 0; t < 3; t++)
        for (int c = MODEL_COPY_OVER_FILE_PAGES; c <= MODEL_COPY_BESIDE_FILE_PAGES; c++) {
            struct place_result r;
            model_place(m, 1, (int64_t)(times[t] * (double)experts), 1, (enum model_copies)c, "", EXPERT_IO_DIRECT, "auto", &r);
            expert_start(m->experts);
            const int mapped = t > 0, own = t == 2 || (t == 1 && c == MODEL_COPY_OVER_FILE_PAGES);
            const int once = t == 1 && c == MODEL_COPY_BESIDE_FILE_PAGES; /* in place, a copy would fit once: said */
            if ((m->experts->mapped != mapped || (m->experts->own != NULL) != own || m->experts->cfg.own_once != once) && !bad++)
                snprintf(why, sizeof why, "budget %.1fx, copies %d: %s, %s%s", times[t], c, m->experts->mapped ? "mapped" : "cached",
                         m->experts->own ? "copied" : "not copied", m->experts->cfg.own_once ? ", a copy said to fit once" : "");
        }
    snprintf(name, sizeof name, "%s: experts copied where the budget holds them once (server, --copy-experts) or twice (all); else in place, "
             "a copy that would fit once said",
             model_file);
    check(!bad, name, "%s", why);
}

/* One golden model: the plain run, then the same cases through the store with budgets of 4
 * slots, half the experts, and 4 slots again warm from the heat the previous runs saved. */
static void test_store_golden_model(const char *dir, const char *json_name, int quick)
{
    char path[1024], name[400], heat[] = "/tmp/coli_test_heat_XXXXXX";
    snprintf(path, sizeof path, "%s/%s", dir, json_name);
    struct mj *root = mj_load(path);
    if (!root) { check(0, json_name, "cannot read"); return; }
    size_t len = 0;
    const char *model_file = mj_str(mj_get(root, "model"), &len);
    if (!model_file) { check(0, json_name, "no model name"); mj_free(root); return; }
    snprintf(path, sizeof path, "%s/%s", dir, model_file);
    if (check_golden_unsupported(path, model_file)) {
        mj_free(root);
        return;
    }
    int *prompts[8], lens[8], n = load_prompts(root, quick ? 1 : 8, prompts, lens);
    struct model m;
    model_load(&m, path, 512, 0);
    if (m.cfg.n_expert == 0) {
        snprintf(name, sizeof name, "%s # SKIP a dense model: no routed experts", model_file);
        check(1, name, "");
        for (int i = 0; i < n; i++) free(prompts[i]);
        model_free(&m);
        mj_free(root);
        return;
    }
    close(mkstemp(heat));
    unlink(heat);
    uint64_t want[8];
    for (int i = 0; i < n; i++) want[i] = greedy_run_hash(&m, prompts[i], lens[i]);
    size_t slot = 0;
    struct { const char *what; int64_t budget; const char *heat; } runs[] = {
        {"4 slots", 0, heat}, {"half the experts", -2, NULL}, {"4 slots, warm from the heat file", 0, heat},
    };
    for (size_t r = 0; r < sizeof runs / sizeof *runs; r++) {
        int64_t budget = runs[r].budget == -2 ? (int64_t)(slot * (size_t)m.cfg.n_layers * (size_t)m.cfg.n_expert / 2) : runs[r].budget;
        store_with(&m, budget, runs[r].heat);
        slot = m.experts->slot_bytes;
        int same = 1, loaded = m.experts->heat_loaded;
        for (int i = 0; i < n; i++) same &= greedy_run_hash(&m, prompts[i], lens[i]) == want[i];
        struct expert_stats st = expert_stats_get(m.experts);
        snprintf(name, sizeof name, "%s: experts cached in %s (%d slots, %llu reads) bit-identical to the mapping", model_file,
                 runs[r].what, m.experts->n_slots, (unsigned long long)st.reads);
        check(same && st.reads > 0 && (r < 2 || loaded), name, "logits or tokens differ (heat loaded %d)", loaded);
        expert_heat_save(m.experts);
    }
    test_own_copy(&m, model_file, prompts, lens, n, want);
    test_copy_rule(&m, model_file);
    unlink(heat);
    for (int i = 0; i < n; i++) free(prompts[i]);
    model_free(&m);
    mj_free(root);
}

/* Runs FN(ARG) with stderr going to a temporary file; returns what it wrote (allocated). */
static char *capture_stderr(void (*fn)(void *), void *arg)
{
    char tmp[] = "/tmp/coli_test_err_XXXXXX", *buf = plat_zalloc(4096, 1);
    int fd = mkstemp(tmp), saved = dup(2);
    fflush(stderr);
    dup2(fd, 2);
    fn(arg);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    ssize_t k = pread(fd, buf, 4095, 0);
    buf[k > 0 ? k : 0] = 0;
    close(fd);
    unlink(tmp);
    return buf;
}

struct heat_probe {
    struct model *m;
    const char *path;
    int loaded;
};

static void open_with_heat(void *arg)
{
    struct heat_probe *p = arg;
    store_with(p->m, 0, p->path);
    p->loaded = p->m->experts->heat_loaded;
}

/* Overwrites N bytes at OFFSET of FILE with BYTES (or truncates to OFFSET when BYTES is NULL). */
static void patch_file(const char *file, long offset, const void *bytes, size_t n)
{
    int fd = open(file, O_RDWR);
    if (bytes) {
        if (pwrite(fd, bytes, n, offset) != (ssize_t)n) perror("pwrite");
    } else if (ftruncate(fd, offset) != 0) perror("ftruncate");
    close(fd);
}

/* Expects opening a store on heat file PATH to ignore it with one line containing WANT. */
static void expect_heat_ignored(struct model *m, const char *path, const char *label, const char *want)
{
    struct heat_probe p = {m, path, -1};
    char *err = capture_stderr(open_with_heat, &p);
    char *nl = strchr(err, '\n');
    int one_line = nl && nl[1] == 0 && strstr(err, path) && strstr(err, want);
    check(p.loaded == 0 && one_line, label, "loaded %d, stderr '%s'", p.loaded, err);
    free(err);
}

static void test_heat_file(const char *dir)
{
    char path[1024], other[1024], heat[] = "/tmp/coli_test_heat_XXXXXX";
    snprintf(path, sizeof path, "%s/q35moe-q8_0.gguf", dir);
    snprintf(other, sizeof other, "%s/q35moe-q4_0.gguf", dir);
    close(mkstemp(heat));
    unlink(heat);
    struct model m, o;
    model_load(&m, path, 64, 0);
    int prompt[3] = {1000, 879, 13};
    store_with(&m, 0, heat);
    greedy_run_hash(&m, prompt, 3);
    float *saved = plat_alloc((size_t)m.cfg.n_layers * m.cfg.n_expert * sizeof(float));
    memcpy(saved, m.experts->heat, (size_t)m.cfg.n_layers * m.cfg.n_expert * sizeof(float));
    expert_heat_save(m.experts);
    store_with(&m, 0, heat);
    int same = m.experts->heat_loaded && !memcmp(saved, m.experts->heat, (size_t)m.cfg.n_layers * m.cfg.n_expert * sizeof(float));
    check(same, "heat file: saved and read back unchanged", "loaded %d", m.experts->heat_loaded);

    model_load(&o, other, 64, 0);
    expect_heat_ignored(&o, heat, "heat file of another model ignored with one line", "written for another model");
    model_free(&o);
    uint32_t v2 = 2;
    patch_file(heat, 8, &v2, 4);
    expect_heat_ignored(&m, heat, "heat file of another version ignored with one line", "another version");
    v2 = EXPERT_HEAT_VERSION;
    patch_file(heat, 8, &v2, 4);
    patch_file(heat, EXPERT_HEAT_HEADER + 4, "\x7f", 1);
    expect_heat_ignored(&m, heat, "corrupt heat file ignored with one line", "corrupt (checksum mismatch)");
    patch_file(heat, 20, NULL, 0);
    expect_heat_ignored(&m, heat, "truncated heat file ignored with one line", "not a coli heat file");
    patch_file(heat, 0, "GGUF", 4);
    expect_heat_ignored(&m, heat, "a file of another kind ignored with one line", "not a coli heat file");
    unlink(heat);
    free(saved);
    model_free(&m);
}

/* In a child: loads a copy of the golden model behind 4 slots, runs a few tokens, breaks
 * the file (HOW: 0 an I/O error on every read, 1 truncated to half), runs on. Expects exit
 * status 1 and one stderr line `coli: COPY: ...` containing WANT. */
static void expect_read_failure(const char *dir, int how, const char *label, const char *want)
{
    char src[1024], copy[] = "/tmp/coli_test_model_XXXXXX", buf[2048] = "";
    snprintf(src, sizeof src, "%s/q35moe-q8_0.gguf", dir);
    int fd = mkstemp(copy);
    struct plat_map map;
    if (plat_map_file(src, &map) != 0 || write(fd, map.data, map.size) != (ssize_t)map.size) { check(0, label, "copy"); return; }
    close(fd);
    int fds[2];
    if (pipe(fds) != 0) { check(0, label, "pipe"); return; }
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        struct model m;
        int prompt[3] = {1000, 879, 13};
        model_load(&m, copy, 64, 0);
        store_with(&m, 0, NULL);
        greedy_run_hash(&m, prompt, 3);
        if (how == 0) { /* every later read of the store fails with EISDIR */
            int d = open("/tmp", O_RDONLY | O_DIRECTORY);
            dup2(d, m.experts->fds[0]);
        } else patch_file(copy, (long)(map.size / 2), NULL, 0);
        greedy_run_hash(&m, prompt, 3);
        _exit(0);
    }
    close(fds[1]);
    size_t n = 0;
    ssize_t k;
    while (n < sizeof buf - 1 && (k = read(fds[0], buf + n, sizeof buf - 1 - n)) > 0) n += (size_t)k;
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    char *nl = strchr(buf, '\n'), head[1100];
    snprintf(head, sizeof head, "coli: %s: ", copy);
    int one_line = nl && nl[1] == 0 && !strncmp(buf, head, strlen(head)) && strstr(buf, want);
    check(WIFEXITED(status) && WEXITSTATUS(status) == 1 && one_line, label, "status %d, stderr '%s'", status, buf);
    plat_unmap_file(&map);
    unlink(copy);
}

/* A failed read ends only the forward pass that needed it: with every read failing, a forward
 * returns -1 and the read's message; with the file readable again the store serves the same
 * tokens and logits, bit for bit, as before (the serve engine relies on it). */
static void test_read_recovers(const char *dir)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/q35moe-q8_0.gguf", dir);
    struct model m;
    int prompt[3] = {1000, 879, 13};
    model_load(&m, path, 64, 0);
    store_with(&m, 0, NULL);
    uint64_t before = greedy_run_hash(&m, prompt, 3);
    int saved = dup(m.experts->fds[0]), d = open("/tmp", O_RDONLY | O_DIRECTORY);
    dup2(d, m.experts->fds[0]); /* every read now fails with EISDIR */
    struct model_seq q;
    model_seq_init(&m, &q);
    int failed = 0;
    for (int i = 0; i < 8 && !failed; i++) { /* the cache holds 4 experts: some read must come */
        struct model_run run = {&q, prompt, 3, NULL, 0, NULL, {0, 0, 0, 0, 0}, NULL};
        failed = model_forward_runs(&m, &run, 1) != 0;
        model_seq_reset(&m, &q);
    }
    check(failed && strstr(m.error, "Is a directory"), "a failed expert read fails the forward pass with its reason", "failed %d, '%s'", failed, m.error);
    /* The reads issued through the broken descriptor end before it is mended: one still in
     * flight could be waited on by the next pass, which would then fail, as it should (the
     * flake "reading expert 1 of layer 0 failed: Is a directory", 2 runs in 20). */
    pthread_mutex_lock(&m.experts->mu);
    while (m.experts->in_flight || m.experts->q_len) pthread_cond_wait(&m.experts->done, &m.experts->mu);
    pthread_mutex_unlock(&m.experts->mu);
    dup2(saved, m.experts->fds[0]);
    close(saved);
    close(d);
    check(greedy_run_hash(&m, prompt, 3) == before, "after a failed read the store serves the same bits again", "hash differs");
    model_seq_free(&m, &q);
    model_free(&m);
}

/* The golden files of the formats added after the first ones: the store only moves an expert's
 * bytes, so two of them (84- and 17-byte blocks) cover the rest, within the suite's time. */
static int store_covered_elsewhere(const char *json_name)
{
    static const char *const skip[] = {"q35moe-q3_k.json", "q35moe-q3_k_m.json", "q35moe-iq4_xs.json",
                                       "q35moe-iq4_nl.json", "q35moe-iq3_xxs.json", "q35moe-iq3_s.json"};
    for (size_t i = 0; i < sizeof skip / sizeof *skip; i++)
        if (!strcmp(json_name, skip[i])) return 1;
    return 0;
}

/* Mapped in place, the store maps every expert's pages ahead (expert_map_ahead): all their
 * bytes once joined; a store closed at once stops it without waiting for the rest. */
static void test_map_ahead(const char *dir)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/q35moe-q8_0.gguf", dir);
    struct model m;
    model_load(&m, path, 64, 0);
    store_with(&m, -1, NULL);
    struct expert_store *s = m.experts;
    size_t want = 0, bytes = 0;
    for (int r = 0; r < s->n_map_ranges; r++) want += s->map_ranges[r].hi - s->map_ranges[r].lo;
    for (int l = 0; l < s->n_layers; l++)
        for (int j = 0; j < 3; j++) bytes += s->src[l][j].t.stride * (size_t)s->n_expert;
    int started = s->mapper_on;
    expert_map_ahead_join(s, 0);
    check(started && s->mapped && !s->own && s->map_ahead_bytes == want && want >= bytes, "mapped in place: every expert's pages mapped ahead",
          "started %d, %zu of %zu bytes (experts %zu)", started, s->map_ahead_bytes, want, bytes);
    store_with(&m, -1, NULL);
    expert_map_ahead_join(m.experts, 1);
    check(m.experts->map_ahead_bytes <= want && !m.experts->mapper_on, "mapping ahead told to stop: ends, within what it had to map", "%zu bytes", m.experts->map_ahead_bytes);
    model_free(&m);
}

int main(int argc, char **argv)
{
    const char *dir;
    int quick;
    char *names[64];
    check_args(argc, argv, &dir, &quick);
    plat_cpu_detect();
    quant_init();
    /* One thread: test_model covers thread counts, and a second OpenMP thread spinning while
     * the main thread waits for a read makes this test 30x slower on a busy machine. */
    omp_set_num_threads(1);
    int n = check_golden_cases(dir, names, 64);
    if (n < 0) {
        check(1, "golden models # SKIP golden data absent", "");
        return check_done();
    }
    expect_read_failure(dir, 0, "an I/O error while running: one line, exit 1", "failed: Is a directory");
    expect_read_failure(dir, 1, "the model file truncated while running: one line, exit 1", "while running");
    test_read_recovers(dir);
    test_heat_file(dir);
    test_map_ahead(dir);
    for (int i = 0; i < n; i++) {
        if (store_covered_elsewhere(names[i])) {
            printf("ok - %s # SKIP the store moves bytes, whatever the format (its own copy interleaves as test_quant checks): "
                   "q35moe-q2_k and -mxfp4 stand for the formats added with them\n", names[i]);
            n_pass++;
        } else {
            test_store_golden_model(dir, names[i], quick);
        }
        free(names[i]);
    }
    return check_done();
}
