/*
 * test_disk_full.c: outbox-relay on a database whose filesystem is full.
 *
 * The test runs as root in a mount namespace of its own (unshare(2) with
 * CLONE_NEWNS and every mount made private: what `unshare -m --propagation
 * private` does), where it mounts a small tmpfs, creates the database on it
 * with rows while there is space, closes every connection (so that the -wal
 * and -shm files go) and fills the filesystem with a filler file. Only the
 * mounts differ from the rest of the machine: redis-server's Unix socket and
 * the daemon's log live in temporary directories outside the tmpfs.
 *
 * 1. The daemon started on the full disk stays up: /healthz 503 naming the
 *    database and the reason, /metrics without the database figures, the
 *    open tried again with backoff, the warning logged once. Once the filler
 *    is deleted every row is published and /healthz answers 200.
 * 2. SIGTERM while it waits: exit 0.
 * 3. --drain on the full disk: exit 1 at once, with the reason; init: exit 2.
 * 4. The disk fills while the daemon runs, with messages in flight (Redis
 *    holds the XADDs with CLIENT PAUSE until the filler is written): their
 *    marks fail with SQLITE_FULL, the relay logs it once, stays up and
 *    answers 503; once space is freed it marks them and publishes the rest.
 *    Nothing is lost and PRAGMA integrity_check says ok.
 *
 * Without root, or where the namespace or the tmpfs cannot be made, the test
 * is skipped with the reason. The mount is detached at exit, before the
 * harness kills the children and removes the directories, also on a bail.
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"
#include "ops/ops.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define TMPFS_SIZE "size=8m"
#define N_FIRST 300
#define N_SECOND 200

static char *mnt;     /* the tmpfs's mount point */
static int mounted;
static th_redis srv;
static char *dbpath, *walpath, *shmpath, *fillpath, *logpath;
static int port;

static void detach_mount(void)
{
    /* Lazily: a child still running (on a bail) keeps files open there. */
    if (mounted && umount2(mnt, MNT_DETACH) == 0)
        mounted = 0;
}

/* A private mount namespace with a tmpfs at mnt; a reason to skip, or NULL. */
static const char *make_tmpfs(void)
{
    static char why[256];
    if (geteuid() != 0)
        return "needs root: mounts a tmpfs in a private mount namespace";
    if (unshare(CLONE_NEWNS) != 0) {
        snprintf(why, sizeof why, "cannot make a mount namespace (unshare CLONE_NEWNS): %s", strerror(errno));
        return why;
    }
    /* Nothing mounted here may propagate to the machine's namespace. */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) {
        snprintf(why, sizeof why, "cannot make the mounts private: %s", strerror(errno));
        return why;
    }
    mnt = th_tmpdir(); /* also installs the harness's clean-up, which must run after detach_mount */
    if (mount("tmpfs", mnt, "tmpfs", MS_NOSUID | MS_NODEV, TMPFS_SIZE) != 0) {
        snprintf(why, sizeof why, "cannot mount a tmpfs: %s", strerror(errno));
        return why;
    }
    mounted = 1;
    atexit(detach_mount);
    return NULL;
}

/* Writes the filler until the filesystem has no room left; its size. */
static long long fill_disk(void)
{
    static const size_t sizes[] = {1 << 20, 4096, 1};
    static char buf[1 << 20];
    long long total = 0;
    size_t i;
    int fd = open(fillpath, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        bail("cannot create %s: %s", fillpath, strerror(errno));
    memset(buf, 'x', sizeof buf);
    for (i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        for (;;) {
            ssize_t n = write(fd, buf, sizes[i]);
            if (n > 0) {
                total += n;
                continue;
            }
            if (n < 0 && errno == EINTR)
                continue;
            if (n < 0 && errno != ENOSPC)
                bail("filler: %s", strerror(errno));
            break;
        }
    }
    close(fd);
    return total;
}

static void free_disk(void)
{
    if (unlink(fillpath) != 0)
        bail("cannot delete the filler: %s", strerror(errno));
}

static int exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

static int healthz(char **body)
{
    return ot_http_get(port, "/healthz", body);
}

/* ---- conditions to wait for -------------------------------------------- */

/* /healthz answers status, its body holding want (may be NULL). */
typedef struct health_want {
    int status;
    const char *want;
    char *body; /* the last body seen */
} health_want;

static int health_is(void *arg)
{
    health_want *h = arg;
    int st;
    free(h->body);
    h->body = NULL;
    st = healthz(&h->body);
    return st == h->status && (!h->want || (h->body && strstr(h->body, h->want)));
}

/* The daemon's log holds at least n occurrences of text. */
typedef struct log_want {
    const char *text;
    int n;
} log_want;

static int log_count(const char *text)
{
    char *log = th_slurp(logpath);
    int n = rt_count_substr(log, text);
    free(log);
    return n;
}

static int log_has(void *arg)
{
    log_want *l = arg;
    return log_count(l->text) >= l->n;
}

/* The stream holds at least n entries. */
typedef struct xlen_want {
    redisContext *c;
    long long n;
} xlen_want;

static int xlen_is(void *arg)
{
    xlen_want *x = arg;
    return th_xlen(x->c, "outbox:disk") >= x->n;
}

/* At least n rows are marked published, through conn. */
typedef struct published_want {
    sqlite3 *conn;
    int n;
} published_want;

static int published_at_least(void *arg)
{
    published_want *p = arg;
    return th_sql_int(p->conn, "SELECT count(*) FROM outbox_messages WHERE state = 2") >= p->n;
}

/* /metrics says at least n messages await their reply. */
static int awaiting_at_least(void *arg)
{
    char *body = NULL;
    double v = -1;
    if (ot_http_get(port, "/metrics", &body) == 200)
        v = ot_prom_val(body, "outbox_awaiting_replies");
    free(body);
    return v >= *(int *)arg;
}

static pid_t spawn_relay(void)
{
    char listen[64];
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    return rt_relay_spawn(logpath, dbpath, srv.url, "--metrics-listen", listen, "--log-level", "debug",
                          "--worker-id", "disk", "--retention-ms", "0", NULL);
}

static void integrity_ok(const char *when)
{
    sqlite3 *db = rt_open(dbpath);
    sqlite3_stmt *st = NULL;
    const char *v = NULL;
    if (sqlite3_prepare_v2(db, "PRAGMA integrity_check", -1, &st, NULL) == SQLITE_OK && sqlite3_step(st) == SQLITE_ROW)
        v = (const char *)sqlite3_column_text(st, 0);
    is_str(v, "ok", "PRAGMA integrity_check %s", when);
    sqlite3_finalize(st);
    sqlite3_close_v2(db);
}

/* ---- 1. started on a full disk ------------------------------------------ */

static void start_on_full_disk(redisContext *c)
{
    health_want h = {503, NULL, NULL};
    log_want retries = {"msg=\"database open failed, retrying\"", 3};
    xlen_want all = {c, N_FIRST};
    char *body = NULL;
    const char *why = NULL;
    int n = -1, st, got;
    pid_t pid;
    sqlite3 *w;

    w = rt_open(dbpath);
    rt_insert_rows(w, "a", 0, N_FIRST, "disk", 8);
    sqlite3_close_v2(w);
    ok(!exists(walpath) && !exists(shmpath), "no -wal or -shm file once every connection closed");
    diag("filler: %lld bytes", fill_disk());

    pid = spawn_relay();
    h.want = dbpath;
    got = th_wait_until(10000 * th_slow(), health_is, &h);
    ok(got, "/healthz answers 503 naming the database: %s", h.body ? h.body : "(no answer)");
    ok(h.body && strstr(h.body, "No space left on device"), "... and the reason (No space left on device)");
    got = th_wait_until(10000 * th_slow(), log_has, &retries);
    ok(got, "the open is tried again (%d tries logged)", log_count(retries.text));
    is_int(th_wait(pid, 0), -2, "the daemon is still running");
    is_int(log_count("msg=\"database unavailable, waiting for it\""), 1, "the wait is logged once (a warning)");

    st = ot_http_get(port, "/metrics", &body);
    is_int(st, 200, "/metrics answers while the relay waits");
    is_int(ot_prom_check(body ? body : "", &why), 0, "... valid Prometheus text%s%s", why ? ": " : "",
           why ? why : "");
    ot_prom_sum(body, "outbox_messages", &n);
    is_int(n, 0, "... without the database figures (no outbox_messages sample)");
    ok(ot_prom_val(body, "outbox_oldest_pending_seconds") < 0, "... nor outbox_oldest_pending_seconds");
    free(body);
    is_int(th_xlen(c, "outbox:disk"), 0, "nothing published while waiting");

    free_disk();
    got = th_wait_until(20000 * th_slow(), xlen_is, &all);
    ok(got, "once space is freed, every row is published (%lld of %d)", th_xlen(c, "outbox:disk"), N_FIRST);
    h.status = 200;
    h.want = "ok";
    got = th_wait_until(10000 * th_slow(), health_is, &h);
    ok(got, "/healthz answers 200 again: %s", h.body ? h.body : "(no answer)");
    ok(log_count("msg=\"database available\"") == 1 && log_count("msg=started") == 1,
       "the daemon logged that the database is available, then started");
    is_int(th_stop(pid, SIGTERM, 10000 * th_slow()), 0, "SIGTERM: exit 0");
    free(h.body);
}

/* ---- 2. SIGTERM while waiting ------------------------------------------- */

static void sigterm_while_waiting(void)
{
    health_want h = {503, NULL, NULL};
    int64_t t0;
    pid_t pid;
    int rc, got;

    ok(!exists(walpath) && !exists(shmpath), "no -wal or -shm file after the daemon stopped");
    fill_disk();
    h.want = dbpath;
    pid = spawn_relay();
    got = th_wait_until(10000 * th_slow(), health_is, &h);
    ok(got, "waiting again on the full disk: %s", h.body ? h.body : "(no answer)");
    t0 = th_now_ms();
    rc = th_stop(pid, SIGTERM, 10000 * th_slow());
    is_int(rc, 0, "SIGTERM while waiting: exit 0 (%lld ms)", (long long)(th_now_ms() - t0));
    ok(log_count("msg=stopped") >= 2, "the daemon logged its stop");
    free(h.body);
}

/* ---- 3. --drain on a full disk ------------------------------------------ */

static void drain_fails_fast(void)
{
    char *err = NULL;
    int64_t t0 = th_now_ms();
    int rc = rt_relay_run(20000 * th_slow(), &err, dbpath, srv.url, "--drain", NULL);
    int64_t took = th_now_ms() - t0;
    is_int(rc, 1, "--drain on the full disk: exit 1 (a runtime failure)");
    ok(err && strstr(err, "--drain does not wait") && strstr(err, "No space left on device") && strstr(err, dbpath),
       "... naming the database and the reason");
    ok(took < 10000 * th_slow(), "... at once (%lld ms)", (long long)took);
    if (rc != 1)
        th_diag_tail("drain", err, 5);
    free(err);

    {
        char *bin = th_bin("tools/relay/outbox-relay");
        char *argv[] = {bin, "init", "--db", dbpath, NULL};
        err = NULL;
        rc = th_run(argv, NULL, NULL, &err, 20000 * th_slow());
        is_int(rc, 2, "init on the full disk: exit 2, as before");
        ok(err && strstr(err, "No space left on device"), "... with the reason: %s", err ? err : "");
        free(err);
        free(bin);
    }
}

/* ---- 4. the disk fills while running ------------------------------------ */

static void fills_while_running(redisContext *c)
{
    health_want h = {503, "failing for", NULL};
    log_want failed = {"level=error msg=\"database error, retrying\"", 1};
    log_want retried = {"level=debug msg=\"database error, retrying\"", 3};
    published_want marked = {NULL, N_FIRST + N_SECOND};
    int want = N_SECOND, got;
    redisReply *rep;
    sqlite3 *w;
    pid_t pid;
    char *log;

    free_disk();
    w = rt_open(dbpath);
    rt_insert_rows(w, "b", 0, N_SECOND, "disk", 0); /* unkeyed: all sent at once */
    sqlite3_close_v2(w);
    /* Redis holds the XADDs: the rows are claimed, their marks wait. */
    rep = th_cmd(c, "CLIENT PAUSE 60000 WRITE");
    freeReplyObject(rep);
    pid = spawn_relay();
    got = th_wait_until(10000 * th_slow(), awaiting_at_least, &want);
    ok(got, "%d messages claimed and sent, awaiting replies", N_SECOND);
    diag("filler: %lld bytes", fill_disk());
    rep = th_cmd(c, "CLIENT UNPAUSE");
    freeReplyObject(rep);

    got = th_wait_until(10000 * th_slow(), log_has, &failed);
    ok(got, "their marks fail: the relay logs a database error");
    log = th_slurp(logpath);
    {
        const char *l = strstr(log, failed.text), *e = l ? strchr(l, '\n') : NULL;
        ok(l && e && memmem(l, (size_t)(e - l), "during=mark", 11) &&
               (memmem(l, (size_t)(e - l), "database or disk is full", 24) ||
                memmem(l, (size_t)(e - l), "disk I/O error", 14)),
           "... during a mark, the disk full: %.*s", l && e ? (int)(e - l) : 0, l ? l : "");
    }
    free(log);
    got = th_wait_until(10000 * th_slow(), health_is, &h);
    ok(got, "/healthz answers 503 while marks fail: %s", h.body ? h.body : "(no answer)");
    got = th_wait_until(10000 * th_slow(), log_has, &retried);
    ok(got, "the unit is retried (%d retries logged)", log_count(retried.text));
    is_int(log_count(failed.text), 1, "the failure is logged once at error level");
    is_int(th_wait(pid, 0), -2, "the daemon is still running");

    free_disk();
    /* Redis took the XADDs already: what waited is the marks. */
    marked.conn = rt_open(dbpath);
    got = th_wait_until(20000 * th_slow(), published_at_least, &marked);
    ok(got,
       "once space is freed every row is marked published (%lld of %d)",
       (long long)th_sql_int(marked.conn, "SELECT count(*) FROM outbox_messages WHERE state = 2"), marked.n);
    sqlite3_close_v2(marked.conn);
    ok(th_xlen(c, "outbox:disk") >= N_FIRST + N_SECOND, "every row is in the stream");
    h.status = 200;
    h.want = "ok";
    got = th_wait_until(10000 * th_slow(), health_is, &h);
    ok(got, "/healthz answers 200 again: %s", h.body ? h.body : "(no answer)");
    ok(log_count("msg=\"database writable again\"") >= 1, "the relay logged that the database is writable again");
    is_int(th_stop(pid, SIGTERM, 10000 * th_slow()), 0, "SIGTERM: exit 0");
    free(h.body);
}

int main(void)
{
    const char *skip = make_tmpfs();
    char *logdir;
    redisContext *c;
    sqlite3 *db;
    rt_audit a;

    if (skip)
        skip_all("%s", skip);
    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("no redis-server");
    port = th_free_port();
    if (port < 0)
        bail("no free port");
    logdir = th_tmpdir();
    logpath = th_path(logdir, "relay.log");
    dbpath = rt_make_db(mnt, "app.db");
    walpath = th_path(mnt, "app.db-wal");
    shmpath = th_path(mnt, "app.db-shm");
    fillpath = th_path(mnt, "filler");
    c = th_redis_client(&srv);

    start_on_full_disk(c);
    sigterm_while_waiting();
    drain_fails_fast();
    fills_while_running(c);

    db = rt_open(dbpath);
    a = rt_audit_topic(db, c, "outbox:", "disk");
    is_int(a.rows, N_FIRST + N_SECOND, "every committed row is in the database");
    is_int(a.missing, 0, "every row has an entry in the stream: nothing lost");
    is_int(a.unpublished, 0, "every row is marked published");
    is_int(a.foreign, 0, "no entry without a row");
    diag("duplicates: %ld (a mark that failed is written later, not published again)", a.dups);
    sqlite3_close_v2(db);
    integrity_ok("after the disk was full twice");

    redisFree(c);
    th_redis_destroy(&srv);
    detach_mount();
    ok(!mounted, "the tmpfs is unmounted");
    th_rmtree(mnt);
    free(mnt);
    th_rmtree(logdir);
    free(logdir);
    free(logpath);
    free(dbpath);
    free(walpath);
    free(shmpath);
    free(fillpath);
    return tap_done();
}
