/* check.h: the tests' one way to report. `ok - NAME` or `FAIL - NAME: why` per check, and
 * check_done() prints the closing `N passed, N failed` that build.sh adds up. */
#ifndef COLI_TEST_CHECK_H
#define COLI_TEST_CHECK_H
#include <dirent.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* The golden case files of DIR (every .json but the tokenizer and calibration files), sorted,
 * malloc'd names in NAMES; returns how many, or -1 when DIR is absent. */
static int check_golden_cases(const char *dir, char **names, int cap)
{
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < cap) {
        size_t len = strlen(e->d_name);
        if (len > 5 && !strcmp(e->d_name + len - 5, ".json") && strncmp(e->d_name, "tokenizer", 9) && strcmp(e->d_name, "calibration.json"))
            names[n++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, check_by_name);
    return n;
}
#endif
