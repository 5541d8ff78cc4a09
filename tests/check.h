/* check.h: the tests' one way to report. `ok - NAME` or `FAIL - NAME: why` per check, and
 * check_done() prints the closing `N passed, N failed` that build.sh adds up. */
#ifndef COLI_TEST_CHECK_H
#define COLI_TEST_CHECK_H
#include <stdarg.h>
#include <stdio.h>

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
#endif
