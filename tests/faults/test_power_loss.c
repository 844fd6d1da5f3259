/*
 * test_power_loss.c: a power cut under a writer and the relay.
 *
 * A shim VFS records, for every xWrite and xTruncate, what the file held
 * before (offset, the old bytes, the old size). An xSync of a file forgets
 * its records: those writes are on disk. A "power cut" undoes every write not
 * yet synced, newest first (old bytes written back, extended files truncated,
 * truncated tails restored), through plain POSIX calls on the files' paths,
 * then the process ends at once with _exit(): no connection is closed, no
 * checkpoint runs, the locks die with the process. That is what the disk
 * holds after a power cut when the OS cache kept every unsynced write.
 *
 * The scenario runs in a child process: a writer (outbox_db_open, i.e.
 * synchronous=FULL) commits messages from a 1 ms timer while the relay,
 * embedded on the same loop and attached to the writer's connection,
 * publishes them with its own synchronous=NORMAL connection; the cut comes
 * at a random moment. The parent then opens the database with the real VFS
 * and checks: every commit the writer saw succeed is there, a fresh relay
 * publishes every row, and no stream entry exists for a row the database
 * lost (guarantee 2). The same with the writer at synchronous=NORMAL only
 * reports (diag) whether such orphan entries appeared: the docs say they can.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "shim_vfs.h"
#include "tap.h"

/* ---- the power-loss VFS ------------------------------------------------ */

typedef struct undo {
    char *path;   /* owned */
    int64_t off;  /* where the write (or truncation) happened */
    int64_t old_size;
    unsigned char *old; /* the bytes that were there (owned) */
    size_t oldlen;
    size_t len;   /* bytes written */
    int trunc; /* 1: a truncation to off; old holds the cut tail */
} undo;

typedef struct pl_file {
    shim_file sh; /* the real file follows this struct */
    char *path;   /* owned; NULL for temp files */
} pl_file;

static sqlite3_vfs *real_vfs;
static sqlite3_vfs pl_vfs;
static sqlite3_io_methods pl_io;
static pthread_mutex_t pl_mu = PTHREAD_MUTEX_INITIALIZER;
static undo *undos;
static size_t nundo, capundo;
static int pl_dead;
static long pl_writes, pl_syncs, pl_wal_syncs, pl_db_syncs;

#define REAL(f) (((pl_file *)(f))->sh.real)
#define PATH(f) (((pl_file *)(f))->path)

static void push_undo(sqlite3_file *real, const char *path, int64_t off, size_t len, int64_t old_size, int trunc)
{
    undo *u;
    if (nundo == capundo) {
        capundo = capundo ? capundo * 2 : 1024;
        undos = realloc(undos, capundo * sizeof *undos);
        if (!undos)
            abort();
    }
    u = &undos[nundo++];
    memset(u, 0, sizeof *u);
    u->path = strdup(path);
    u->off = off;
    u->old_size = old_size;
    u->trunc = trunc;
    u->len = len;
    if (old_size > off) {
        size_t have = (size_t)(old_size - off);
        u->oldlen = trunc ? have : (have < len ? have : len);
        u->old = malloc(u->oldlen ? u->oldlen : 1);
        /* Through the open file: opening and closing another descriptor
         * would drop the process's POSIX locks on it. */
        if (!u->old || real->pMethods->xRead(real, u->old, (int)u->oldlen, off) != SQLITE_OK)
            abort();
    }
}

static void forget_path(const char *path)
{
    size_t i, j = 0;
    for (i = 0; i < nundo; i++) {
        if (strcmp(undos[i].path, path) == 0) {
            free(undos[i].path);
            free(undos[i].old);
        } else {
            undos[j++] = undos[i];
        }
    }
    nundo = j;
}

/* Undoes every unsynced write, newest first; returns how many. Called with
 * pl_mu held; the process ends right after. */
static size_t power_cut(void)
{
    size_t i, n = nundo;
    pl_dead = 1;
    for (i = nundo; i-- > 0;) {
        undo *u = &undos[i];
        int fd = open(u->path, O_WRONLY);
        if (fd < 0)
            continue; /* the file was deleted since: nothing to restore */
        if (u->oldlen && pwrite(fd, u->old, u->oldlen, u->off) != (ssize_t)u->oldlen)
            abort();
        if (!u->trunc && u->off + (int64_t)u->len > u->old_size && ftruncate(fd, u->old_size) != 0)
            abort(); /* the write extended the file: cut it back */
        close(fd);
    }
    return n;
}

static int p_close(sqlite3_file *f)
{
    sqlite3_file *r = REAL(f);
    int rc = r->pMethods ? r->pMethods->xClose(r) : SQLITE_OK;
    free(PATH(f));
    PATH(f) = NULL;
    return rc;
}
static int p_read(sqlite3_file *f, void *b, int n, sqlite3_int64 off)
{
    if (pl_dead)
        return SQLITE_IOERR_READ;
    return REAL(f)->pMethods->xRead(REAL(f), b, n, off);
}
static int p_write(sqlite3_file *f, const void *b, int n, sqlite3_int64 off)
{
    int rc;
    sqlite3_int64 size = 0;
    pthread_mutex_lock(&pl_mu);
    if (pl_dead) {
        pthread_mutex_unlock(&pl_mu);
        return SQLITE_IOERR_WRITE;
    }
    pl_writes++;
    if (PATH(f)) {
        if (REAL(f)->pMethods->xFileSize(REAL(f), &size) != SQLITE_OK)
            abort();
        push_undo(REAL(f), PATH(f), off, (size_t)n, size, 0);
    }
    rc = REAL(f)->pMethods->xWrite(REAL(f), b, n, off);
    pthread_mutex_unlock(&pl_mu);
    return rc;
}
static int p_truncate(sqlite3_file *f, sqlite3_int64 to)
{
    int rc;
    sqlite3_int64 size = 0;
    pthread_mutex_lock(&pl_mu);
    if (pl_dead) {
        pthread_mutex_unlock(&pl_mu);
        return SQLITE_IOERR_TRUNCATE;
    }
    if (PATH(f)) {
        if (REAL(f)->pMethods->xFileSize(REAL(f), &size) != SQLITE_OK)
            abort();
        if (size > to)
            push_undo(REAL(f), PATH(f), to, 0, size, 1);
    }
    rc = REAL(f)->pMethods->xTruncate(REAL(f), to);
    pthread_mutex_unlock(&pl_mu);
    return rc;
}
static int p_sync(sqlite3_file *f, int flags)
{
    int rc;
    pthread_mutex_lock(&pl_mu);
    if (pl_dead) {
        pthread_mutex_unlock(&pl_mu);
        return SQLITE_IOERR_FSYNC;
    }
    rc = REAL(f)->pMethods->xSync(REAL(f), flags);
    pl_syncs++;
    if (rc == SQLITE_OK && PATH(f)) {
        size_t l = strlen(PATH(f));
        if (l > 4 && strcmp(PATH(f) + l - 4, "-wal") == 0)
            pl_wal_syncs++;
        else
            pl_db_syncs++;
        forget_path(PATH(f));
    }
    pthread_mutex_unlock(&pl_mu);
    return rc;
}
static int p_devchar(sqlite3_file *f)
{
    /* Neither atomic nor safe-append: the worst case for the recovery. */
    return REAL(f)->pMethods->xDeviceCharacteristics(REAL(f)) &
           ~(SQLITE_IOCAP_SAFE_APPEND | SQLITE_IOCAP_SEQUENTIAL | SQLITE_IOCAP_BATCH_ATOMIC);
}
static int p_fetch(sqlite3_file *f, sqlite3_int64 off, int n, void **pp)
{
    /* No memory-mapped reads: every byte goes through xRead. */
    (void)f;
    (void)off;
    (void)n;
    *pp = NULL;
    return SQLITE_OK;
}
static int p_unfetch(sqlite3_file *f, sqlite3_int64 off, void *p)
{
    (void)f;
    (void)off;
    (void)p;
    return SQLITE_OK;
}

static int p_open(sqlite3_vfs *vfs, const char *name, sqlite3_file *f, int flags, int *out_flags)
{
    pl_file *pf = (pl_file *)f;
    int rc;
    (void)vfs;
    pf->sh.real = (sqlite3_file *)(pf + 1);
    pf->sh.base.pMethods = NULL;
    pf->path = NULL;
    rc = real_vfs->xOpen(real_vfs, name, pf->sh.real, flags, out_flags);
    if (pf->sh.real->pMethods) {
        pf->path = name ? strdup(name) : NULL;
        pl_io.iVersion = pf->sh.real->pMethods->iVersion < 3 ? pf->sh.real->pMethods->iVersion : 3;
        pf->sh.base.pMethods = &pl_io;
    }
    return rc;
}

static void pl_register(void)
{
    real_vfs = sqlite3_vfs_find(NULL);
    if (!real_vfs)
        bail("no default VFS");
    pl_vfs = *real_vfs;
    pl_vfs.zName = "powerloss";
    pl_vfs.pNext = NULL;
    pl_vfs.szOsFile = (int)sizeof(pl_file) + real_vfs->szOsFile;
    pl_vfs.xOpen = p_open;
    shim_io_forward(&pl_io);
    pl_io.xClose = p_close;
    pl_io.xRead = p_read;
    pl_io.xWrite = p_write;
    pl_io.xTruncate = p_truncate;
    pl_io.xSync = p_sync;
    pl_io.xDeviceCharacteristics = p_devchar;
    pl_io.xFetch = p_fetch;
    pl_io.xUnfetch = p_unfetch;
    if (sqlite3_vfs_register(&pl_vfs, 1) != SQLITE_OK)
        bail("sqlite3_vfs_register failed");
}

/* ---- the child: writer + relay until the power cut --------------------- */

typedef struct child {
    uv_loop_t loop;
    outbox_relay *r;
    sqlite3 *db;
    outbox_writer *w;
    uv_timer_t write_t, cut_t;
    long committed, seq;
    int report_fd, attached;
} child;

static void quiet_log(void *data, outbox_log_level level, const char *msg)
{
    (void)data;
    (void)level;
    (void)msg;
}

static void child_write(uv_timer_t *t)
{
    child *c = t->data;
    int n = 1 + (int)(c->seq % 3), i, rc = 0;
    if (sqlite3_exec(c->db, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK)
        return;
    for (i = 0; i < n && rc == 0; i++) {
        char id[64], key[16], payload[1500];
        outbox_message m;
        memset(&m, 0, sizeof m);
        snprintf(id, sizeof id, "pl-%08ld", c->seq + i);
        snprintf(key, sizeof key, "k%ld", (c->seq + i) % 5);
        memset(payload, 'x', sizeof payload);
        m.id = id;
        m.topic = "power";
        m.key = key;
        m.payload = payload;
        m.payload_len = sizeof payload;
        rc = outbox_enqueue(c->w, &m, NULL);
    }
    if (rc != 0 || sqlite3_exec(c->db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) {
        sqlite3_exec(c->db, "ROLLBACK", NULL, NULL, NULL);
        return;
    }
    c->seq += n;
    c->committed += n;
    if (!c->attached)
        outbox_relay_wake(c->r);
}

static void child_cut(uv_timer_t *t)
{
    child *c = t->data;
    size_t undone;
    char buf[160];
    int len;
    pthread_mutex_lock(&pl_mu); /* held until the end: no I/O after this */
    undone = power_cut();
    len = snprintf(buf, sizeof buf, "%ld %zu %ld %ld %ld %ld\n", c->committed, undone, pl_writes, pl_syncs,
                   pl_wal_syncs, pl_db_syncs);
    if (write(c->report_fd, buf, (size_t)len) != len)
        _exit(3);
    _exit(0);
}

static void run_child(const char *db, const char *url, int full, int attach, int cut_ms, int report_fd)
{
    child c;
    outbox_relay_settings s;
    outbox_writer_settings ws;
    char err[512];
    memset(&c, 0, sizeof c);
    c.report_fd = report_fd;
    pl_register();
    if (outbox_db_open(db, 0, &c.db, err, sizeof err) != 0)
        _exit(10);
    if (!full && sqlite3_exec(c.db, "PRAGMA synchronous=NORMAL", NULL, NULL, NULL) != SQLITE_OK)
        _exit(11);
    outbox_writer_defaults(&ws);
    ws.warn_not_durable = 0;
    ws.log = NULL;
    if (outbox_writer_create(&c.w, c.db, &ws) != 0)
        _exit(12);
    uv_loop_init(&c.loop);
    outbox_relay_defaults(&s);
    s.db_path = db;
    s.redis_url = url;
    s.worker_id = "powerloss";
    s.batch = 64;
    s.lease_ms = 1500; /* the final drain takes over the dead relay's leases */
    s.reply_timeout_ms = 1000;
    s.scan_interval_ms = 20;
    s.retention_ms = 0;
    s.log = quiet_log;
    if (outbox_relay_create(&c.r, &c.loop, &s, err, sizeof err) != 0)
        _exit(13);
    c.attached = attach;
    if ((attach && outbox_relay_attach(c.r, c.db) != 0) || outbox_relay_start(c.r) != 0)
        _exit(14);
    uv_timer_init(&c.loop, &c.write_t);
    uv_timer_init(&c.loop, &c.cut_t);
    c.write_t.data = c.cut_t.data = &c;
    uv_timer_start(&c.write_t, child_write, 1, 1);
    uv_timer_start(&c.cut_t, child_cut, (uint64_t)cut_ms, 0);
    uv_run(&c.loop, UV_RUN_DEFAULT);
    _exit(15); /* not reached: child_cut exits */
}

/* ---- the parent: cut, recover, check ----------------------------------- */

static void drain(const char *db, const char *url)
{
    uv_loop_t loop;
    outbox_relay_settings s;
    outbox_relay *r = NULL;
    char err[512];
    uv_loop_init(&loop);
    outbox_relay_defaults(&s);
    s.db_path = db;
    s.redis_url = url;
    s.worker_id = "after-the-cut";
    s.drain = 1;
    s.retention_ms = 0;
    s.log = quiet_log;
    if (outbox_relay_create(&r, &loop, &s, err, sizeof err) != 0)
        bail("drain relay: %s", err);
    outbox_relay_start(r);
    uv_run(&loop, UV_RUN_DEFAULT);
    outbox_relay_destroy(r);
    uv_run(&loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&loop) != 0)
        bail("drain loop did not close");
}

static void scenario(th_redis *srv, redisContext *rc, const char *dir, int full, int attach, int run)
{
    char name[64], *db, buf[200] = "";
    int fds[2], status, cut_ms = 300 + rand() % 1200;
    long committed = -1, writes = 0, syncs = 0, wal_syncs = 0, db_syncs = 0;
    size_t undone = 0;
    pid_t pid;
    ssize_t got;
    sqlite3 *chk;
    rt_audit before, after;
    const char *mode = full ? "FULL" : "NORMAL";
    int64_t t0 = th_now_ms();

    snprintf(name, sizeof name, "power-%s-%d.db", mode, run);
    db = rt_make_db(dir, name);
    freeReplyObject(th_cmd(rc, "DEL outbox:power"));
    if (pipe(fds) != 0)
        bail("pipe: %s", strerror(errno));
    fflush(stdout);
    pid = fork();
    if (pid < 0)
        bail("fork: %s", strerror(errno));
    if (pid == 0) {
        close(fds[0]);
        run_child(db, srv->url, full, attach, cut_ms, fds[1]);
    }
    close(fds[1]);
    got = read(fds[0], buf, sizeof buf - 1);
    close(fds[0]);
    if (got > 0)
        buf[got] = 0;
    status = th_wait(pid, 20000 * th_slow());
    if (status == -2) {
        kill(pid, SIGKILL);
        th_wait(pid, 5000);
    }
    is_int(status, 0, "%s run %d: the child ran until the power cut at %d ms", mode, run, cut_ms);
    if (sscanf(buf, "%ld %zu %ld %ld %ld %ld", &committed, &undone, &writes, &syncs, &wal_syncs, &db_syncs) != 6)
        bail("no report from the child: '%s'", buf);
    diag("%s run %d (writer %s): %ld messages committed, %zu unsynced writes undone (of %ld writes, %ld syncs: %ld WAL, %ld db)",
         mode, run, attach ? "attached to the relay" : "with its own auto-checkpoints", committed, undone, writes, syncs, wal_syncs, db_syncs);

    chk = rt_open(db); /* real VFS: recovery from what the "disk" kept */
    {
        sqlite3_stmt *q = NULL;
        const char *res = "";
        if (sqlite3_prepare_v2(chk, "PRAGMA integrity_check", -1, &q, NULL) == SQLITE_OK &&
            sqlite3_step(q) == SQLITE_ROW)
            res = (const char *)sqlite3_column_text(q, 0);
        is_str(res, "ok", "%s run %d: the database is intact after the cut", mode, run);
        sqlite3_finalize(q);
    }
    before = rt_audit_topic(chk, rc, "outbox:", "power");
    diag("%s run %d: after the cut %ld rows of %ld committed, %ld entries, %ld orphan entries, %ld unpublished",
         mode, run, before.rows, committed, before.entries, before.foreign, before.unpublished);
    if (full)
        is_int(before.rows, committed, "FULL run %d: every commit the writer saw succeed survived", run);
    drain(db, srv->url);
    after = rt_audit_topic(chk, rc, "outbox:", "power");
    is_int(after.missing, 0, "%s run %d: after a final drain every surviving row is in the stream", mode, run);
    is_int(after.unpublished, 0, "%s run %d: and marked published", mode, run);
    is_int(after.order_violations, 0, "%s run %d: per key in commit order", mode, run);
    if (full)
        is_int(after.foreign, 0, "FULL run %d: no stream entry for a row the database lost", run);
    else
        diag("NORMAL run %d: %ld orphan stream entries (entries whose row the power cut undid)%s", run,
             after.foreign, after.foreign ? ": the documented risk of synchronous=NORMAL writers" : "");
    diag("%s run %d: %ld entries, %ld duplicates, %lld ms", mode, run, after.entries, after.dups,
         (long long)(th_now_ms() - t0));
    sqlite3_close_v2(chk);
    free(db);
}

int main(void)
{
    th_redis srv;
    redisContext *c;
    char *dir;
    int run;
    unsigned seed = (unsigned)getpid() ^ (unsigned)th_now_ms();
    const char *env = getenv("OUTBOX_TEST_SEED");

    if (env)
        seed = (unsigned)strtoul(env, NULL, 10);
    srand(seed);
    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    diag("seed %u (OUTBOX_TEST_SEED to repeat)", seed);
    dir = th_tmpdir();
    c = th_redis_client(&srv);
    /* Attached, the writer's commits wake the relay and its checkpoints are
     * the relay's; not attached, the writer checkpoints itself (SQLite's
     * auto-checkpoint at 1000 pages), so cuts also land around checkpoints. */
    for (run = 1; run <= 4; run++)
        scenario(&srv, c, dir, 1, run <= 2, run);
    for (run = 1; run <= 3; run++)
        scenario(&srv, c, dir, 0, run != 2, run);
    redisFree(c);
    th_redis_destroy(&srv);
    free(dir);
    return tap_done();
}
