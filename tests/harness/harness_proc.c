/*
 * harness_proc.c: see harness.h. Paths and temporary directories, child
 * processes (started, waited for, their output captured) and the project's
 * binaries.
 *
 * Child processes are started with fork/exec. Before exec the child closes
 * every descriptor above stderr, so a test's sockets, pipes and SQLite files
 * never leak into redis-server or a tool under test (a leaked listening
 * socket or pipe end would keep ports busy or hide an EOF). A close-on-exec
 * pipe reports an exec failure back to the parent, so "could not be started"
 * is told apart from "exited with 127".
 *
 * The clean-up at exit (harness.h) is two small tables, of pids and of
 * directory paths, walked by one atexit handler; a directory that finds no
 * free slot is only not removed at exit, while a child that finds none
 * bails out, since it could outlive the test.
 */
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness_int.h"
#include "tap.h"

extern char **environ;

/* ---- clean-up at exit ---------------------------------------------------- */

#define MAX_KIDS 64
#define MAX_DIRS 64
static pid_t kids[MAX_KIDS];
static char *dirs[MAX_DIRS];
static int cleanup_installed;

static void cleanup_at_exit(void)
{
    int i;
    for (i = 0; i < MAX_KIDS; i++)
        if (kids[i] > 0) {
            kill(kids[i], SIGKILL);
            waitpid(kids[i], NULL, 0);
            kids[i] = 0;
        }
    for (i = 0; i < MAX_DIRS; i++) {
        char *d = dirs[i];
        dirs[i] = NULL; /* before th_rmtree, which would free it */
        th_rmtree(d);
        free(d);
    }
}

static void install_cleanup(void)
{
    if (!cleanup_installed) {
        atexit(cleanup_at_exit);
        cleanup_installed = 1;
    }
}

void th__track_pid(pid_t pid)
{
    int i;
    install_cleanup();
    for (i = 0; i < MAX_KIDS; i++)
        if (kids[i] == 0) {
            kids[i] = pid;
            return;
        }
    bail("too many child processes");
}

static void untrack_pid(pid_t pid)
{
    int i;
    for (i = 0; i < MAX_KIDS; i++)
        if (kids[i] == pid)
            kids[i] = 0;
}

static void track_dir(const char *dir)
{
    int i;
    install_cleanup();
    for (i = 0; i < MAX_DIRS && dirs[i]; i++)
        ;
    if (i < MAX_DIRS && !(dirs[i] = strdup(dir)))
        bail("out of memory");
}

static void untrack_dir(const char *dir)
{
    int i;
    for (i = 0; i < MAX_DIRS; i++)
        if (dirs[i] && strcmp(dirs[i], dir) == 0) {
            free(dirs[i]);
            dirs[i] = NULL;
            return; /* mkdtemp made each path once */
        }
}

/* ---- files --------------------------------------------------------------- */

char *th_path(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (!p)
        bail("out of memory");
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

char *th_tmpdir(void)
{
    const char *base = getenv("TMPDIR");
    char *tmpl;
    if (!base || !*base)
        base = "/tmp";
    tmpl = th_path(base, "outbox-test-XXXXXX");
    if (!mkdtemp(tmpl))
        bail("mkdtemp %s: %s", tmpl, strerror(errno));
    track_dir(tmpl);
    return tmpl;
}

static int rm_entry(const char *path, const struct stat *st, int type, struct FTW *ftw)
{
    (void)st;
    (void)ftw;
    if (type == FTW_DP)
        rmdir(path);
    else
        unlink(path);
    return 0;
}

void th_rmtree(const char *path)
{
    if (!path)
        return;
    nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    untrack_dir(path);
}

/* ---- processes ----------------------------------------------------------- */

/* Builds environ plus env_add ("K=V" entries replace existing K). The
 * strings are borrowed; only the array is allocated. */
static char **make_env(char *const env_add[])
{
    size_t n = 0, m = 0, i, j, k = 0;
    char **env;
    while (environ[n])
        n++;
    while (env_add && env_add[m])
        m++;
    env = calloc(n + m + 1, sizeof *env);
    if (!env)
        bail("out of memory");
    for (i = 0; i < n; i++) {
        const char *eq = strchr(environ[i], '=');
        size_t klen = eq ? (size_t)(eq - environ[i]) + 1 : strlen(environ[i]);
        int replaced = 0;
        for (j = 0; j < m; j++)
            if (strncmp(env_add[j], environ[i], klen) == 0)
                replaced = 1;
        if (!replaced)
            env[k++] = environ[i];
    }
    for (j = 0; j < m; j++)
        env[k++] = env_add[j];
    env[k] = NULL;
    return env;
}

static void close_fds_from(int lowfd)
{
#ifdef SYS_close_range
    if (syscall(SYS_close_range, (unsigned)lowfd, ~0U, 0) == 0)
        return;
#endif
    {
        long max = sysconf(_SC_OPEN_MAX);
        int fd;
        if (max < 0 || max > 65536)
            max = 65536;
        for (fd = lowfd; fd < max; fd++)
            close(fd);
    }
}

pid_t th__spawn_fds(char *const argv[], char *const env_add[], int out_fd, int err_fd, int die_with_parent)
{
    char **env = make_env(env_add);
    int ep[2], null_fd, child_errno = 0;
    pid_t pid;
    ssize_t n;

    if (pipe2(ep, O_CLOEXEC) < 0) {
        free(env);
        return -1;
    }
    null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    fflush(stdout);
    fflush(stderr);
    pid = fork();
    if (pid < 0) {
        free(env);
        close(ep[0]);
        close(ep[1]);
        if (null_fd >= 0)
            close(null_fd);
        return -1;
    }
    if (pid == 0) {
        /* Only async-signal-safe calls from here on. */
        if (die_with_parent)
            prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (null_fd >= 0)
            dup2(null_fd, 0);
        if (out_fd >= 0)
            dup2(out_fd, 1);
        if (err_fd >= 0)
            dup2(err_fd, 2);
        /* Keep only 0-2 and the exec-status pipe (closed by exec). */
        if (ep[1] != 3) {
            dup3(ep[1], 3, O_CLOEXEC);
            ep[1] = 3;
        }
        close_fds_from(4);
        signal(SIGPIPE, SIG_DFL);
        execvpe(argv[0], argv, env);
        child_errno = errno;
        if (write(ep[1], &child_errno, sizeof child_errno) < 0) {
            /* nothing more to do */
        }
        _exit(127);
    }
    free(env);
    close(ep[1]);
    if (null_fd >= 0)
        close(null_fd);
    do
        n = read(ep[0], &child_errno, sizeof child_errno);
    while (n < 0 && errno == EINTR);
    close(ep[0]);
    if (n == (ssize_t)sizeof child_errno) {
        diag("cannot run %s: %s", argv[0], strerror(child_errno));
        while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
            ;
        return -1;
    }
    return pid;
}

static int decode_status(int st)
{
    if (WIFEXITED(st))
        return WEXITSTATUS(st);
    if (WIFSIGNALED(st))
        return 128 + WTERMSIG(st);
    return -1;
}

int th_wait(pid_t pid, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    int st, delay = 1;
    for (;;) {
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid) {
            untrack_pid(pid);
            return decode_status(st);
        }
        if (w < 0 && errno != EINTR)
            return -1;
        if (timeout_ms >= 0 && th_now_ms() >= deadline)
            return -2;
        th_sleep_ms(delay);
        if (delay < 20)
            delay *= 2;
    }
}

pid_t th_spawn(char *const argv[], char *const env_add[], const char *out_path, const char *err_path)
{
    int out_fd = -1, err_fd = -1;
    pid_t pid;
    const int flags = O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC;
    if (out_path && (out_fd = open(out_path, flags, 0644)) < 0) {
        diag("open %s: %s", out_path, strerror(errno));
        return -1;
    }
    if (err_path) {
        if (out_path && strcmp(out_path, err_path) == 0)
            err_fd = out_fd;
        else if ((err_fd = open(err_path, flags, 0644)) < 0) {
            diag("open %s: %s", err_path, strerror(errno));
            if (out_fd >= 0)
                close(out_fd);
            return -1;
        }
    }
    pid = th__spawn_fds(argv, env_add, out_fd, err_fd, 0);
    if (out_fd >= 0)
        close(out_fd);
    if (err_fd >= 0 && err_fd != out_fd)
        close(err_fd);
    if (pid > 0)
        th__track_pid(pid);
    return pid;
}

int th_stop(pid_t pid, int sig, int timeout_ms)
{
    int rc;
    if (pid <= 0)
        return -1; /* kill() would signal a whole process group */
    kill(pid, sig);
    rc = th_wait(pid, timeout_ms);
    if (rc == -2) {
        diag("pid %ld did not stop within %d ms after signal %d: SIGKILL", (long)pid, timeout_ms, sig);
        kill(pid, SIGKILL);
        th_wait(pid, -1);
    }
    return rc;
}

/* A growing capture buffer. */
typedef struct capture {
    char *buf;
    size_t len, cap;
} capture;

static void capture_add(capture *c, const char *data, size_t n)
{
    if (c->len + n + 1 > c->cap) {
        size_t cap = c->cap ? c->cap : 4096;
        while (c->len + n + 1 > cap)
            cap *= 2;
        c->buf = realloc(c->buf, cap);
        if (!c->buf)
            bail("out of memory");
        c->cap = cap;
    }
    memcpy(c->buf + c->len, data, n);
    c->len += n;
    c->buf[c->len] = '\0';
}

static char *capture_take(capture *c)
{
    if (!c->buf)
        capture_add(c, "", 0);
    return c->buf;
}

int th_run(char *const argv[], char *const env_add[], char **out, char **err, int timeout_ms)
{
    int op[2], ep[2], status = -1, reaped = 0, killed = 0;
    capture co = {0}, ce = {0};
    struct pollfd fds[2];
    int64_t deadline = th_now_ms() + timeout_ms, drain_deadline = 0;
    pid_t pid;

    if (out)
        *out = NULL;
    if (err)
        *err = NULL;
    if (pipe2(op, O_CLOEXEC) < 0)
        return -1;
    if (pipe2(ep, O_CLOEXEC) < 0) {
        close(op[0]);
        close(op[1]);
        return -1;
    }
    pid = th__spawn_fds(argv, env_add, op[1], ep[1], 0);
    close(op[1]);
    close(ep[1]);
    if (pid < 0) {
        close(op[0]);
        close(ep[0]);
        return -1;
    }
    fds[0].fd = op[0];
    fds[1].fd = ep[0];
    fds[0].events = fds[1].events = POLLIN;

    /* Read both pipes as data comes, so a child writing a lot to one of them
     * never blocks on a full pipe while we wait on the other. */
    while (fds[0].fd >= 0 || fds[1].fd >= 0) {
        int64_t now = th_now_ms();
        int wait_ms = 50, i, st;
        if (!reaped && waitpid(pid, &st, WNOHANG) == pid) {
            reaped = 1;
            status = decode_status(st);
            /* A grandchild may hold the pipes open: read what is there,
             * but do not wait for it for long. */
            drain_deadline = now + 500;
        }
        if (!reaped && !killed && now >= deadline) {
            kill(pid, SIGKILL);
            killed = 1;
        }
        if (reaped && now >= drain_deadline)
            break;
        if (poll(fds, 2, wait_ms) < 0 && errno != EINTR)
            break;
        for (i = 0; i < 2; i++) {
            char buf[65536];
            ssize_t n;
            if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            n = read(fds[i].fd, buf, sizeof buf);
            if (n > 0) {
                capture_add(i == 0 ? &co : &ce, buf, (size_t)n);
            } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
                close(fds[i].fd);
                fds[i].fd = -1;
            }
        }
    }
    if (fds[0].fd >= 0)
        close(fds[0].fd);
    if (fds[1].fd >= 0)
        close(fds[1].fd);
    if (!reaped) {
        if (!killed && th_now_ms() >= deadline) {
            kill(pid, SIGKILL);
            killed = 1;
        }
        status = th_wait(pid, killed ? 5000 : (int)(deadline - th_now_ms()));
        if (status == -2) {
            kill(pid, SIGKILL);
            status = th_wait(pid, 5000);
        }
    }
    if (out)
        *out = capture_take(&co);
    else
        free(co.buf);
    if (err)
        *err = capture_take(&ce);
    else
        free(ce.buf);
    return status;
}

char *th_bin(const char *rel)
{
    const char *dir = getenv("OUTBOX_BUILD_DIR");
    char exe[PATH_MAX], *slash, *p;
    ssize_t n;
    if (dir && *dir)
        return th_path(dir, rel);
    /* Run by hand: a test binary lives in a folder under <build>/tests/,
     * at whatever depth; the build directory is the first one above it that
     * meson set up (it has build.ninja). */
    n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        return th_path(".", rel);
    exe[n] = '\0';
    while ((slash = strrchr(exe, '/')) != NULL) {
        int found;
        *slash = '\0';
        p = th_path(exe[0] ? exe : "/", "build.ninja");
        found = access(p, F_OK) == 0;
        free(p);
        if (found)
            return th_path(exe[0] ? exe : "/", rel);
    }
    return th_path(".", rel);
}

char **th_relay_argv(const char *db, const char *url, va_list ap)
{
    size_t n = 0, cap = 16;
    char **argv = malloc(cap * sizeof *argv);
    const char *a;
    if (!argv)
        bail("out of memory");
    argv[n++] = th_bin("tools/relay/outbox-relay");
    argv[n++] = strdup("--db");
    argv[n++] = strdup(db);
    argv[n++] = strdup("--redis");
    argv[n++] = strdup(url);
    while ((a = va_arg(ap, const char *)) != NULL) {
        if (n + 2 > cap) {
            cap *= 2;
            argv = realloc(argv, cap * sizeof *argv);
            if (!argv)
                bail("out of memory");
        }
        argv[n++] = strdup(a);
    }
    argv[n] = NULL;
    return argv;
}

void th_argv_free(char **argv)
{
    for (size_t i = 0; argv[i]; i++)
        free(argv[i]);
    free(argv);
}

int th_relay_runv(int timeout_ms, char **err, const char *db, const char *url, va_list ap)
{
    char **argv = th_relay_argv(db, url, ap), *out = NULL;
    int rc = th_run(argv, NULL, &out, err, timeout_ms);
    th_argv_free(argv);
    free(out);
    return rc;
}
