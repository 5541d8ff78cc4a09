/* check.h: the tests' one way to report. `ok - NAME` or `FAIL - NAME: why` per check, and
 * check_done() prints the closing `N passed, N failed` that build.sh adds up. */
#ifndef COLI_TEST_CHECK_H
#define COLI_TEST_CHECK_H
#include <dirent.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static int n_pass, n_fail;

static void check(int ok, const char *name, const char *fmt, ...)
{
    if (ok) {
        printf("ok - %s\n", name);
        n_pass++;
        return;
    }
    va_list ap;
    printf("FAIL - %s: ", name);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
    n_fail++;
}

/* The closing line; returns the exit status. */
static int check_done(void)
{
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail != 0;
}
/* The golden test programs' arguments: [GOLDEN_DIR] [--quick]. */
static void check_args(int argc, char **argv, const char **dir, int *quick)
{
    *dir = "../shared/golden";
    *quick = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) *quick = 1;
        else *dir = argv[i];
    }
}

static int check_by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The golden case files of DIR (every .json but the tokenizer, template and calibration files), sorted,
 * malloc'd names in NAMES; returns how many, or -1 when DIR is absent. */
static int check_golden_cases(const char *dir, char **names, int cap)
{
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < cap) {
        size_t len = strlen(e->d_name);
        if (len > 5 && !strcmp(e->d_name + len - 5, ".json") && strncmp(e->d_name, "tokenizer", 9) && strncmp(e->d_name, "template-", 9) &&
            strcmp(e->d_name, "calibration.json"))
            names[n++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, check_by_name);
    return n;
}

#ifdef COLI_VERSION /* the tests that include coli.c */
/* Runs OPEN(PATH) in a child and returns its wait status; what it wrote to stderr, NUL-
 * terminated and cut to CAP, is in OUT. For the paths where coli dies: its one-line errors. */
static int check_child_stderr(void (*open)(const char *path), const char *path, char *out, size_t cap)
{
    int fds[2], status = 0;
    out[0] = 0;
    if (pipe(fds) != 0) return -1;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        open(path);
        _exit(0);
    }
    close(fds[1]);
    size_t got = 0;
    ssize_t k;
    while (got < cap - 1 && (k = read(fds[0], out + got, cap - 1 - got)) > 0) got += (size_t)k;
    out[got] = 0;
    close(fds[0]);
    waitpid(pid, &status, 0);
    return status;
}

static void check_open_gguf(const char *path)
{
    struct gguf_file g;
    gguf_open(&g, path);
    for (int64_t i = 0; i < g.n_tensors; i++) model_check_format(&g, &g.tensors[i]);
}

/* Whether coli refuses the golden model PATH for a weight type it does not read yet (the
 * golden set has more formats than coli so far): a child opens it and checks every tensor's
 * format as the model loader does, and a refusal is reported as a skip of NAME with its reason. Any other outcome is 0, so that the test itself
 * meets a file that is bad for another reason. Needs coli.c included first. */
static int check_golden_unsupported(const char *path, const char *name)
{
    char why[600], label[900];
    int status = check_child_stderr(check_open_gguf, path, why, sizeof why);
    char *nl = strchr(why, '\n');
    if (nl) *nl = 0;
    int refused = WIFEXITED(status) && WEXITSTATUS(status) == 1 && strstr(why, "a format coli does not read yet");
    if (refused) {
        snprintf(label, sizeof label, "%s # SKIP a weight type coli does not read yet: %.300s", name, why);
        check(1, label, "");
    }
    return refused;
}
#endif
#endif
