/*
 * Clocks, JSON numbers, percentiles, child processes, whole files and /proc
 * readers for outbox-bench.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "util/array.h"

extern char **environ;

/* ------------------------------------------------------------------ */
/* clocks */

uint64_t bench_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t bench_mono_us(void)
{
    return bench_mono_ns() / 1000u;
}

int64_t bench_wall_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

double bench_loadavg(void)
{
    double v = -1;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &v) != 1)
            v = -1;
        fclose(f);
    }
    return v;
}

void bench_sleep_ms(unsigned ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* ------------------------------------------------------------------ */
/* text */

void bench_sbuf_num(outbox__sbuf *s, double v, int decimals)
{
    if (!isfinite(v))
        outbox__sbuf_puts(s, "null");
    else
        outbox__sbuf_printf(s, "%.*f", decimals, v);
}

const char *bench_thousands(char *buf, size_t len, double v)
{
    char tmp[64], out[96];
    size_t n, i, o = 0;
    int neg = v < 0;
    snprintf(tmp, sizeof tmp, "%.0f", neg ? -v : v);
    n = strlen(tmp);
    if (neg)
        out[o++] = '-';
    for (i = 0; i < n && o + 2 < sizeof out; i++) {
        if (i && (n - i) % 3 == 0)
            out[o++] = ',';
        out[o++] = tmp[i];
    }
    out[o] = '\0';
    snprintf(buf, len, "%s", out);
    return buf;
}

/* ------------------------------------------------------------------ */
/* statistics */

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

void bench_sort(double *v, size_t n)
{
    qsort(v, n, sizeof *v, cmp_double);
}

double bench_quantile_sorted(const double *v, size_t n, double q)
{
    size_t k;
    if (n == 0)
        return 0;
    /* nearest rank: the smallest value with at least q of the values at or
     * below it */
    k = (size_t)ceil(q * (double)n);
    if (k < 1)
        k = 1;
    if (k > n)
        k = n;
    return v[k - 1];
}

double bench_median(double *v, size_t n)
{
    bench_sort(v, n);
    if (n == 0)
        return NAN;
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* ------------------------------------------------------------------ */
/* child processes */

#define MAX_CHILDREN 64
static pid_t children[MAX_CHILDREN];

static void child_register(pid_t pid)
{
    for (int i = 0; i < MAX_CHILDREN; i++)
        if (children[i] == 0) {
            children[i] = pid;
            return;
        }
}

static void child_forget(pid_t pid)
{
    for (int i = 0; i < MAX_CHILDREN; i++)
        if (children[i] == pid)
            children[i] = 0;
}

void bench_kill_children(void)
{
    for (int i = 0; i < MAX_CHILDREN; i++)
        if (children[i] > 0) {
            kill(children[i], SIGKILL);
            children[i] = 0;
        }
}

static int add_redirect(posix_spawn_file_actions_t *fa, int fd, const char *path)
{
    if (path && strcmp(path, "-") == 0)
        return 0;
    return posix_spawn_file_actions_addopen(fa, fd, path ? path : "/dev/null",
                                            fd == 0 ? O_RDONLY : O_WRONLY | O_CREAT | O_APPEND, 0644);
}

int bench_spawn(const char *const argv[], const char *out_path, const char *err_path, pid_t *pid)
{
    posix_spawn_file_actions_t fa;
    int e;
    posix_spawn_file_actions_init(&fa);
    if (add_redirect(&fa, 0, NULL) != 0 || add_redirect(&fa, 1, out_path) != 0 ||
        add_redirect(&fa, 2, err_path) != 0) {
        posix_spawn_file_actions_destroy(&fa);
        return -1;
    }
    e = posix_spawnp(pid, argv[0], &fa, NULL, (char *const *)argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (e != 0) {
        errno = e;
        return -1;
    }
    child_register(*pid);
    return 0;
}

static void sample_rss(pid_t pid, bench_rss *peak)
{
    char path[64], line[256];
    long long v;
    struct stat st;
    FILE *f;
    if (peak->watch_file && stat(peak->watch_file, &st) == 0 && (long long)st.st_size > peak->file_bytes)
        peak->file_bytes = (long long)st.st_size;
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    f = fopen(path, "r");
    if (!f)
        return;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "VmHWM: %lld", &v) == 1 && v > peak->hwm_kb)
            peak->hwm_kb = v;
        else if (sscanf(line, "VmRSS: %lld", &v) == 1 && v > peak->rss_kb)
            peak->rss_kb = v;
        else if (sscanf(line, "RssAnon: %lld", &v) == 1 && v > peak->anon_kb)
            peak->anon_kb = v;
        else if (sscanf(line, "RssFile: %lld", &v) == 1 && v > peak->file_kb)
            peak->file_kb = v;
        else if (sscanf(line, "RssShmem: %lld", &v) == 1 && v > peak->shmem_kb)
            peak->shmem_kb = v;
    }
    fclose(f);
}

int bench_wait(pid_t pid, int *status, struct rusage *ru, unsigned timeout_ms)
{
    return bench_wait_sampled(pid, status, ru, timeout_ms, NULL);
}

int bench_wait_sampled(pid_t pid, int *status, struct rusage *ru, unsigned timeout_ms, bench_rss *peak)
{
    uint64_t last_sample = 0;
    uint64_t deadline = bench_mono_us() + (uint64_t)timeout_ms * 1000u;
    struct rusage dummy;
    int st = 0;
    for (;;) {
        pid_t w = wait4(pid, &st, WNOHANG, ru ? ru : &dummy);
        if (w == pid) {
            child_forget(pid);
            if (status)
                *status = st;
            return 0;
        }
        if (w < 0 && errno != EINTR) {
            child_forget(pid);
            return -1;
        }
        if (peak && bench_mono_us() - last_sample >= 10000) {
            sample_rss(pid, peak);
            last_sample = bench_mono_us();
        }
        if (bench_mono_us() > deadline) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            child_forget(pid);
            if (status)
                *status = st;
            errno = ETIMEDOUT;
            return -1;
        }
        bench_sleep_ms(1);
    }
}

int bench_stop(pid_t pid, int *status, struct rusage *ru, unsigned timeout_ms)
{
    kill(pid, SIGTERM);
    return bench_wait(pid, status, ru, timeout_ms);
}

const char *bench_status_text(int status, char *buf, size_t len)
{
    if (WIFEXITED(status))
        snprintf(buf, len, "exit %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(buf, len, "signal %d", WTERMSIG(status));
    else
        snprintf(buf, len, "status %d", status);
    return buf;
}

/* ------------------------------------------------------------------ */
/* /proc */

int64_t bench_proc_cpu_ns(pid_t pid)
{
    char path[64], buf[1024];
    FILE *f;
    unsigned long long run_ns, ut, st;
    snprintf(path, sizeof path, "/proc/%d/schedstat", (int)pid);
    f = fopen(path, "r");
    if (f) {
        int ok = fscanf(f, "%llu", &run_ns) == 1;
        fclose(f);
        if (ok)
            return (int64_t)run_ns;
    }
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    f = fopen(path, "r");
    if (!f)
        return -1;
    if (!fgets(buf, sizeof buf, f)) {
        fclose(f);
        return -1;
    }
    fclose(f);
    /* fields after the parenthesised command name; utime and stime are
     * fields 14 and 15 */
    char *p = strrchr(buf, ')');
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return -1;
    return (int64_t)((ut + st) * (1000000000.0 / (double)sysconf(_SC_CLK_TCK)));
}

long long bench_proc_ctxsw(pid_t pid)
{
    char path[64], line[256];
    long long total = 0, v;
    int found = 0;
    FILE *f;
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    f = fopen(path, "r");
    if (!f)
        return -1;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "voluntary_ctxt_switches: %lld", &v) == 1 ||
            sscanf(line, "nonvoluntary_ctxt_switches: %lld", &v) == 1) {
            total += v;
            found++;
        }
    }
    fclose(f);
    return found ? total : -1;
}

char *bench_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "r");
    char *all = NULL;
    size_t n = 0, cap = 0;
    if (!f)
        return NULL;
    /* Room for a read of 4 KiB at least, and for the NUL. */
    while (OUTBOX__GROW(all, &cap, n, 4097, 65536) == 0) {
        size_t got = fread(all + n, 1, cap - n - 1, f);
        if (got == 0)
            break;
        n += got;
    }
    fclose(f);
    if (all)
        all[n] = '\0';
    if (len)
        *len = n;
    return all;
}

void bench_tail_file(const char *path, char *buf, size_t len, int lines)
{
    size_t n, i;
    char *all = bench_read_file(path, &n);
    int seen = 0;
    buf[0] = '\0';
    if (!all)
        return;
    while (n && all[n - 1] == '\n')
        all[--n] = '\0';
    for (i = n; i > 0; i--)
        if (all[i - 1] == '\n' && ++seen == lines)
            break;
    snprintf(buf, len, "%s", all + i);
    for (char *p = buf; *p; p++)
        if (*p == '\n')
            *p = '|';
    free(all);
}

int bench_wrap_argv(const char **argv, char *buf, size_t len)
{
    const char *wrap = getenv("OUTBOX_BENCH_WRAP");
    char *save = NULL, *tok;
    int a = 0;
    if (!wrap || !*wrap)
        return 0;
    snprintf(buf, len, "%s", wrap);
    for (tok = strtok_r(buf, " ", &save); tok && a < 24; tok = strtok_r(NULL, " ", &save))
        argv[a++] = tok;
    return a;
}

int bench_file_exists_x(const char *path)
{
    return access(path, X_OK) == 0;
}

void bench_unlink_db(const char *path)
{
    char p[PATH_MAX + 8];
    unlink(path);
    snprintf(p, sizeof p, "%s-wal", path);
    unlink(p);
    snprintf(p, sizeof p, "%s-shm", path);
    unlink(p);
    snprintf(p, sizeof p, "%s-journal", path);
    unlink(p);
}

double bench_ru_cpu_s(const struct rusage *ru)
{
    return (double)ru->ru_utime.tv_sec + (double)ru->ru_utime.tv_usec / 1e6 + (double)ru->ru_stime.tv_sec +
           (double)ru->ru_stime.tv_usec / 1e6;
}
