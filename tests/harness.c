/*
 * harness.c: see harness.h.
 *
 * Child processes are started with fork/exec. Before exec the child closes
 * every descriptor above stderr, so a test's sockets, pipes and SQLite files
 * never leak into redis-server or a tool under test (a leaked listening
 * socket or pipe end would keep ports busy or hide an EOF). A close-on-exec
 * pipe reports an exec failure back to the parent, so "could not be started"
 * is told apart from "exited with 127".
 *
 * Every redis-server started here is also recorded in a small table that an
 * atexit handler walks, and gets PR_SET_PDEATHSIG: a test that bails out or
 * crashes does not leave servers or temporary directories behind.
 */
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tap.h"

extern char **environ;

/* ---- time ---------------------------------------------------------------- */

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

/* ---- files --------------------------------------------------------------- */

static char *xstrdup(const char *s)
{
    char *d = strdup(s);
    if (!d)
        bail("out of memory");
    return d;
}

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

/*
 * Forks and execs argv with stdin from /dev/null and stdout/stderr on the
 * given descriptors (-1: inherit). Returns the pid or -1 (exec failed; the
 * reason is printed as a TAP comment).
 */
static pid_t spawn_fds(char *const argv[], char *const env_add[], int out_fd, int err_fd, int die_with_parent)
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
        if (w == pid)
            return decode_status(st);
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
    pid = spawn_fds(argv, env_add, out_fd, err_fd, 0);
    if (out_fd >= 0)
        close(out_fd);
    if (err_fd >= 0 && err_fd != out_fd)
        close(err_fd);
    return pid;
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
    pid = spawn_fds(argv, env_add, op[1], ep[1], 0);
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
    /* Run by hand: the test binaries live in <build>/tests/. */
    n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        return th_path(".", rel);
    exe[n] = '\0';
    for (int i = 0; i < 2; i++) {
        slash = strrchr(exe, '/');
        if (slash)
            *slash = '\0';
    }
    p = th_path(exe[0] ? exe : "/", rel);
    return p;
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

/* ---- redis-server -------------------------------------------------------- */

/* Servers (pid and directory) to clean up if the test exits without
 * destroying them. */
#define MAX_SERVERS 32
static struct {
    th_redis *r;
    pid_t pid;
    char *dir;
} servers[MAX_SERVERS];
static int atexit_installed;

static void cleanup_at_exit(void)
{
    int i;
    for (i = 0; i < MAX_SERVERS; i++) {
        if (servers[i].pid > 0) {
            kill(servers[i].pid, SIGKILL);
            waitpid(servers[i].pid, NULL, 0);
        }
        if (servers[i].dir) {
            th_rmtree(servers[i].dir);
            free(servers[i].dir);
        }
        servers[i].dir = NULL;
        servers[i].pid = 0;
    }
}

static int server_slot(const th_redis *r)
{
    int i;
    for (i = 0; i < MAX_SERVERS; i++)
        if (servers[i].r == r && servers[i].dir && strcmp(servers[i].dir, r->dir) == 0)
            return i;
    return -1;
}

static void track(th_redis *r)
{
    int i = server_slot(r);
    if (i < 0) {
        for (i = 0; i < MAX_SERVERS && servers[i].dir; i++)
            ;
        if (i == MAX_SERVERS)
            return;
        servers[i].r = r;
        servers[i].dir = xstrdup(r->dir);
    }
    servers[i].pid = r->pid;
    if (!atexit_installed) {
        atexit(cleanup_at_exit);
        atexit_installed = 1;
    }
}

static void untrack(th_redis *r, int forget_dir)
{
    int i = server_slot(r);
    if (i < 0)
        return;
    servers[i].pid = 0;
    if (forget_dir) {
        free(servers[i].dir);
        servers[i].dir = NULL;
        servers[i].r = NULL;
    }
}

/* Another process could take the port before redis-server binds it;
 * th_redis_start retries in that case. */
int th_free_port(void)
{
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), port = -1;
    if (fd < 0)
        return -1;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

static int write_config(th_redis *r)
{
    char *conf = th_path(r->dir, "redis.conf");
    FILE *f = fopen(conf, "w");
    if (!f) {
        diag("cannot write %s: %s", conf, strerror(errno));
        free(conf);
        return -1;
    }
    fprintf(f, "port %d\n", r->port);
    /* "-::1": also IPv6 loopback when the host has it (optional bind). */
    if (r->port)
        fprintf(f, "bind 127.0.0.1 -::1\n");
    fprintf(f,
            "unixsocket %s\n"
            "unixsocketperm 700\n"
            "dir %s\n"
            "logfile %s/redis.log\n"
            "daemonize no\n"
            "save \"\"\n"
            "appendonly no\n"
            "databases 16\n",
            r->sock, r->dir, r->dir);
    fputs(r->extra, f);
    if (r->extra[0] && r->extra[strlen(r->extra) - 1] != '\n')
        fputc('\n', f);
    fclose(f);
    free(conf);
    return 0;
}

static void print_log_tail(const th_redis *r)
{
    char *log = th_path(r->dir, "redis.log"), line[512];
    FILE *f = fopen(log, "r");
    free(log);
    if (!f)
        return;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        diag("redis.log: %s", line);
    }
    fclose(f);
}

/* The password from a "requirepass" line of the extra config, if any. */
static int config_password(const th_redis *r, char *pw, size_t len)
{
    const char *p = r->extra;
    while (p && *p) {
        const char *nl = strchr(p, '\n');
        size_t n = nl ? (size_t)(nl - p) : strlen(p);
        if (n > 12 && strncmp(p, "requirepass ", 12) == 0 && n - 12 < len) {
            memcpy(pw, p + 12, n - 12);
            pw[n - 12] = '\0';
            return 1;
        }
        p = nl ? nl + 1 : NULL;
    }
    return 0;
}

/* Waits until the server answers on its socket (PING, or an authentication
 * error, which also proves it is up). */
static int wait_ready(th_redis *r, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    while (th_now_ms() < deadline) {
        struct timeval tv = {1, 0};
        redisContext *c;
        int st;
        if (waitpid(r->pid, &st, WNOHANG) == r->pid) {
            diag("redis-server exited during start-up (status %d)", decode_status(st));
            r->pid = 0;
            return -1;
        }
        c = redisConnectUnixWithTimeout(r->sock, tv);
        if (c && !c->err) {
            redisReply *rep = redisCommand(c, "PING");
            int up = rep && (rep->type == REDIS_REPLY_STATUS ||
                             (rep->type == REDIS_REPLY_ERROR && strncmp(rep->str, "NOAUTH", 6) == 0));
            if (rep)
                freeReplyObject(rep);
            redisFree(c);
            if (up)
                return 0;
        } else if (c) {
            redisFree(c);
        }
        th_sleep_ms(10);
    }
    diag("redis-server did not answer PING within %d ms", timeout_ms);
    return -1;
}

static int launch(th_redis *r)
{
    char *conf = th_path(r->dir, "redis.conf");
    char *out = th_path(r->dir, "redis.stdout");
    char *argv[] = {"redis-server", conf, NULL};
    int out_fd = open(out, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    r->pid = spawn_fds(argv, NULL, out_fd, out_fd, 1);
    if (out_fd >= 0)
        close(out_fd);
    free(conf);
    free(out);
    if (r->pid < 0) {
        r->pid = 0;
        return -1;
    }
    track(r);
    if (wait_ready(r, 5000) < 0) {
        print_log_tail(r);
        if (r->pid > 0) {
            kill(r->pid, SIGKILL);
            th_wait(r->pid, 5000);
            r->pid = 0;
        }
        untrack(r, 0);
        return -1;
    }
    return 0;
}

int th_redis_start(th_redis *r, int with_tcp, const char *extra_conf)
{
    struct sockaddr_un sa;
    int attempt;

    memset(r, 0, sizeof *r);
    if (extra_conf && strlen(extra_conf) >= sizeof r->extra) {
        diag("th_redis_start: extra config too long");
        return -1;
    }
    snprintf(r->extra, sizeof r->extra, "%s", extra_conf ? extra_conf : "");
    r->dir = th_tmpdir();
    if ((size_t)snprintf(r->sock, sizeof r->sock, "%s/redis.sock", r->dir) >= sizeof sa.sun_path) {
        /* A long $TMPDIR would make the socket path unusable. */
        th_rmtree(r->dir);
        free(r->dir);
        setenv("TMPDIR", "/tmp", 1);
        r->dir = th_tmpdir();
        snprintf(r->sock, sizeof r->sock, "%s/redis.sock", r->dir);
    }
    snprintf(r->url, sizeof r->url, "unix://%s", r->sock);

    for (attempt = 0; attempt < 3; attempt++) {
        if (with_tcp) {
            r->port = th_free_port();
            if (r->port <= 0) {
                diag("no free loopback port");
                break;
            }
            snprintf(r->tcp_url, sizeof r->tcp_url, "redis://127.0.0.1:%d", r->port);
        }
        if (write_config(r) < 0)
            break;
        if (launch(r) == 0)
            return 0;
        if (!with_tcp)
            break; /* retrying only helps when the port was taken */
    }
    diag("could not start redis-server (is it installed?)");
    th_redis_destroy(r);
    return -1;
}

void th_redis_stop(th_redis *r)
{
    if (!r || r->pid <= 0)
        return;
    kill(r->pid, SIGTERM);
    if (th_wait(r->pid, 5000) == -2) {
        kill(r->pid, SIGKILL);
        th_wait(r->pid, -1);
    }
    r->pid = 0;
    untrack(r, 0);
}

void th_redis_kill(th_redis *r)
{
    if (!r || r->pid <= 0)
        return;
    kill(r->pid, SIGKILL);
    th_wait(r->pid, -1);
    r->pid = 0;
    untrack(r, 0);
}

int th_redis_restart(th_redis *r)
{
    if (!r || !r->dir)
        return -1;
    if (r->pid > 0)
        th_redis_stop(r);
    return launch(r);
}

void th_redis_destroy(th_redis *r)
{
    if (!r)
        return;
    th_redis_stop(r);
    if (r->dir) {
        untrack(r, 1);
        th_rmtree(r->dir);
        free(r->dir);
        r->dir = NULL;
    }
}

/* ---- client -------------------------------------------------------------- */

redisContext *th_redis_client(const th_redis *r)
{
    struct timeval tv = {5, 0};
    redisContext *c = redisConnectUnixWithTimeout(r->sock, tv);
    char pw[256];
    if (!c)
        bail("redis client: out of memory");
    if (c->err)
        bail("redis client %s: %s", r->sock, c->errstr);
    if (config_password(r, pw, sizeof pw)) {
        redisReply *rep = th_cmd(c, "AUTH %s", pw);
        if (rep->type == REDIS_REPLY_ERROR)
            bail("redis client AUTH: %s", rep->str);
        freeReplyObject(rep);
    }
    return c;
}

redisReply *th_cmd(redisContext *c, const char *fmt, ...)
{
    va_list ap;
    redisReply *rep;
    va_start(ap, fmt);
    rep = redisvCommand(c, fmt, ap);
    va_end(ap);
    if (!rep)
        bail("redis command failed: %s", c->errstr);
    return rep;
}

long long th_xlen(redisContext *c, const char *stream)
{
    redisReply *rep = redisCommand(c, "XLEN %s", stream);
    long long n = -1;
    if (!rep)
        return -1;
    if (rep->type == REDIS_REPLY_INTEGER)
        n = rep->integer;
    freeReplyObject(rep);
    return n;
}

/* ---- SQL and files ------------------------------------------------------ */

void th_sql_exec(sqlite3 *db, const char *fmt, ...)
{
    va_list ap;
    char *sql, *msg = NULL;
    va_start(ap, fmt);
    sql = sqlite3_vmprintf(fmt, ap);
    va_end(ap);
    if (!sql)
        bail("out of memory");
    if (sqlite3_exec(db, sql, NULL, NULL, &msg) != SQLITE_OK)
        bail("SQL failed: %s: %s", sql, msg ? msg : "?");
    sqlite3_free(sql);
}

int64_t th_sql_int(sqlite3 *db, const char *fmt, ...)
{
    va_list ap;
    char *sql;
    sqlite3_stmt *st = NULL;
    int64_t v = 0;
    int rc;
    va_start(ap, fmt);
    sql = sqlite3_vmprintf(fmt, ap);
    va_end(ap);
    if (!sql)
        bail("out of memory");
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK)
        bail("SQL failed: %s: %s", sql, sqlite3_errmsg(db));
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW)
        v = sqlite3_column_int64(st, 0);
    else if (rc != SQLITE_DONE)
        bail("SQL failed: %s: %s", sql, sqlite3_errmsg(db));
    sqlite3_finalize(st);
    sqlite3_free(sql);
    return v;
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
