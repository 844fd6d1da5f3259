/*
 * harness.c: see harness.h. Time, waiting and text: the clocks, polling a
 * condition, reading a file whole and printing output as diagnostics. The
 * other parts of the harness are harness_proc.c (temporary directories and
 * child processes), harness_redis.c (redis-server and a client) and
 * harness_sql.c (SQL).
 */
#include "harness.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tap.h"

int th_slow(void)
{
    const char *v = getenv("OUTBOX_UNDER_VALGRIND");
    return v && *v && strcmp(v, "0") != 0 ? 10 : 1;
}

int64_t th_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void th_sleep_ms(int ms)
{
    struct timespec ts;
    if (ms <= 0)
        return;
    ts.tv_sec = ms / 1000;
    ts.tv_nsec = (long)(ms % 1000) * 1000000L;
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
        ;
}

char *th_slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    char *buf = NULL;
    size_t len = 0, cap = 0, n;
    if (f) {
        char chunk[65536];
        while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) {
            if (len + n + 1 > cap) {
                cap = (len + n + 1) * 2;
                buf = realloc(buf, cap);
                if (!buf)
                    bail("out of memory");
            }
            memcpy(buf + len, chunk, n);
            len += n;
        }
        fclose(f);
    }
    if (!buf && !(buf = malloc(1)))
        bail("out of memory");
    buf[len] = '\0';
    return buf;
}

int th_wait_until(int timeout_ms, int (*fn)(void *arg), void *arg)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    int v;
    while (!(v = fn(arg)) && th_now_ms() < deadline)
        th_sleep_ms(5);
    return v;
}

int th_count_lines(const char *text)
{
    int n = 0;
    for (; *text; text++)
        n += *text == '\n';
    return n;
}

void th_diag_tail(const char *what, const char *text, int max_lines)
{
    const char *p;
    int lines = 0;
    if (!text)
        return;
    p = text + strlen(text);
    while (p > text && lines <= max_lines) {
        p--;
        if (*p == '\n' && p[1])
            lines++;
    }
    if (lines > max_lines)
        p++;
    while (*p) {
        const char *nl = strchr(p, '\n');
        int n = nl ? (int)(nl - p) : (int)strlen(p);
        diag("%s: %.*s", what, n, p);
        p += n + (nl ? 1 : 0);
    }
}
