/*
 * test_group.c: one relay for a directory of databases (outbox_relay_group,
 * outbox-relay --db-dir). On the test's own loop: every database of the
 * directory is published, each entry naming its database (field and
 * envelope key "db"), per (database, key) order kept, the same message id
 * in two databases published for each; a corrupt file and a SQLite file
 * without an outbox table affect only themselves (failed, not an outbox);
 * a database that appears is found, one that is deleted leaves; an idle
 * database is closed and a commit to it still wakes the group; a file that
 * becomes an outbox is published; outbox_relay_group_add and _remove on a
 * running group. A drain with max_open_dbs 2 over seven databases, a
 * corrupt one among them: every healthy one drained, the corrupt one named.
 * The daemon: --db-dir --drain exits 1 naming the corrupt file, 0 without
 * it; --db with --db-dir is a usage error; killed with SIGKILL three times
 * over 40 databases, one of them overwritten meanwhile: a daemon that is
 * not draining takes over every lease they left, and nothing of the
 * others is lost, their order per key kept; two daemons on one directory:
 * every row once, in order per key. Idempotent mode: markers per
 * database, so the same id in two databases is appended for each.
 * Retention: published rows of closed databases, due long ago or coming
 * due later, are deleted though nothing is written to those databases.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "ops.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

static th_redis srv;

/* Paths the test makes, freed at its end. */
static char *kept[256];
static size_t nkept;
static char *keep(char *p)
{
    if (nkept < sizeof kept / sizeof kept[0])
        kept[nkept++] = p;
    return p;
}
static char *root;
static redisContext *c;
static uv_loop_t loop;

static void quiet_log(void *data, outbox_log_level level, const char *msg)
{
    (void)data;
    if (level >= OUTBOX_LOG_WARN || (getenv("GDEBUG") && (strstr(msg, "changed") || strstr(msg, "has work") || strstr(msg, "msg=st"))))
        fprintf(stderr, "# %s\n", msg);
}

/* Runs the loop until fn(arg) holds, or timeout_ms passed; 1 if it held. */
static int run_until(int timeout_ms, int (*fn)(void *), void *arg)
{
    return rt_run_until(&loop, timeout_ms, fn, arg);
}

static long long want_len;
static int stream_has(void *arg)
{
    (void)arg;
    return th_xlen(c, "outbox:orders") >= want_len;
}

static void wait_len(long long n, const char *what)
{
    want_len = n;
    ok(run_until(20000, stream_has, NULL), "%s: %lld entries (have %lld)", what, n, th_xlen(c, "outbox:orders"));
}

/* What the stream holds, per database: entries, those whose envelope's db
 * and field db disagree, and per-key order violations. */
typedef struct tally {
    long entries, bad_db, order_violations;
    long by_db[8];
} tally;

static const char *const names[8] = {"a", "b", "c", "plain", "extra", "same1", "same2", "other"};

static int db_index(const char *db)
{
    for (int i = 0; i < 8; i++)
        if (db && !strcmp(db, names[i]))
            return i;
    return 7;
}

static tally audit(void)
{
    tally t;
    rt_stream s = rt_stream_read(c, "outbox:orders");
    rt_map *last = rt_map_new();
    redisReply *rr = th_cmd(c, "XRANGE outbox:orders - +");
    memset(&t, 0, sizeof t);
    for (size_t i = 0; i < s.n; i++) {
        outbox_envelope *e = NULL;
        const char *field_db = NULL;
        char key[300];
        int64_t prev;
        if (rr && i < rr->elements && rr->element[i]->elements == 2) {
            redisReply *f = rr->element[i]->element[1];
            for (size_t k = 0; k + 1 < f->elements; k += 2)
                if (!strcmp(f->element[k]->str, "db"))
                    field_db = f->element[k + 1]->str;
        }
        t.entries++;
        if (outbox_envelope_decode(s.e[i].env, s.e[i].envlen, &e, NULL, 0) != 0) {
            t.bad_db++;
            continue;
        }
        if (!e->db || !field_db || strcmp(e->db, field_db) != 0)
            t.bad_db++;
        t.by_db[db_index(e->db)]++;
        if (e->key) {
            /* ids are <prefix>-<6 digits>: their order is their commit order */
            long n = strtol(strrchr(e->id, '-') + 1, NULL, 10);
            snprintf(key, sizeof key, "%s/%s", e->db ? e->db : "", e->key);
            if (rt_map_get(last, key, &prev) && prev > n)
                t.order_violations++;
            rt_map_set(last, key, n);
        }
        outbox_envelope_free(e);
    }
    freeReplyObject(rr);
    rt_map_free(last);
    rt_stream_free(&s);
    return t;
}

static outbox_relay_settings settings(const char *dir)
{
    outbox_relay_settings s;
    outbox_relay_defaults(&s);
    s.db_dir = dir;
    s.redis_url = srv.url;
    s.log = quiet_log;
    s.retention_ms = 0;
    s.log_level = getenv("GDEBUG") ? OUTBOX_LOG_DEBUG : OUTBOX_LOG_INFO;
    return s;
}

static outbox_relay_group_stats stats(outbox_relay_group *g)
{
    outbox_relay_group_stats st;
    outbox_relay_group_stats_get(g, &st);
    return st;
}

static int a_marked(void *arg)
{
    return th_sql_int(arg, "SELECT count(*) FROM outbox_messages WHERE state <> 2") == 0;
}

static outbox_relay_group *cur;
static int none_open(void *arg)
{
    (void)arg;
    return stats(cur).open == 0;
}

static size_t want_dbs;
static int dbs_are(void *arg)
{
    (void)arg;
    return stats(cur).databases == want_dbs;
}

/* Set by a group's stop (rt_group_flag). */
static int stopped;

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f)
        bail("cannot write %s", path);
    fputs(text, f);
    fclose(f);
}

/* The running group: found, published, isolated, woken, added, removed. */
static void running_group(void)
{
    char *dir = keep(th_path(root, "tenants")), *pa, *pb, *pc, *pplain, *pbad, *other = keep(th_path(root, "elsewhere")), *pextra;
    sqlite3 *a, *b, *cdb, *plain, *extra;
    outbox_relay_group *g;
    outbox_relay_settings s;
    char err[512], why[300];
    tally t;
    int e;

    mkdir(dir, 0755);
    mkdir(other, 0755);
    pa = keep(rt_make_db(dir, "a.db"));
    pb = keep(rt_make_db(dir, "b.db"));
    a = rt_open(pa);
    b = rt_open(pb);
    rt_insert_rows(a, "a", 0, 300, "orders", 5);
    rt_insert_rows(b, "b", 0, 200, "orders", 5);
    pbad = keep(th_path(dir, "bad.db"));
    write_file(pbad, "this is not a database, not even a little\n");
    pplain = keep(th_path(dir, "plain.db"));
    if (sqlite3_open(pplain, &plain) != SQLITE_OK)
        bail("cannot create %s", pplain);
    th_sql_exec(plain, "CREATE TABLE notes(x)");
    write_file(keep(th_path(dir, "readme.txt")), "not matched by the glob\n");

    s = settings(keep(th_path(root, "nope")));
    e = outbox_relay_group_create(&g, &loop, &s, err, sizeof err);
    ok(e == OUTBOX_EINVAL && strstr(err, "db-dir"), "a missing db-dir is refused: %s", err);
    s = settings(dir);
    s.db_path = pa;
    e = outbox_relay_group_create(&g, &loop, &s, err, sizeof err);
    ok(e == OUTBOX_EINVAL && strstr(err, "db"), "db with a group is refused: %s", err);
    {
        outbox_relay *r;
        outbox_relay_settings rs = settings(dir);
        rs.db_path = pa;
        e = outbox_relay_create(&r, &loop, &rs, err, sizeof err);
        ok(e == OUTBOX_EINVAL && strstr(err, "db-dir"), "outbox_relay_create refuses db-dir: %s", err);
    }

    s = settings(dir);
    s.lease_ms = 5000;
    is_int(outbox_relay_group_create(&g, &loop, &s, err, sizeof err), 0, "group created: %s", err);
    cur = g;
    is_int(outbox_relay_group_start(g), 0, "group started");
    wait_len(500, "both databases published");
    t = audit();
    is_int(t.by_db[0], 300, "300 entries name a");
    is_int(t.by_db[1], 200, "200 entries name b");
    is_int(t.bad_db, 0, "every entry's field db and envelope db agree");
    is_int(t.order_violations, 0, "per (database, key) order kept");
    is_int(outbox_relay_group_db_state(g, "bad", why, sizeof why), OUTBOX_GROUP_DB_FAILED,
           "the corrupt file failed: %s", why);
    is_int(outbox_relay_group_db_state(g, "plain", why, sizeof why), OUTBOX_GROUP_DB_NOT_OUTBOX,
           "the SQLite file without an outbox is watched");
    is_int(outbox_relay_group_db_state(g, "readme", NULL, 0), OUTBOX_GROUP_DB_UNKNOWN,
           "a file the glob does not match is not in the group");
    is_int(stats(g).databases, 4, "four files in the group");
    ok(run_until(10000, a_marked, a), "a's rows all marked published");

    /* A new database appears. */
    pc = keep(rt_make_db(dir, "c.db"));
    cdb = rt_open(pc);
    rt_insert_rows(cdb, "c", 0, 50, "orders", 0);
    wait_len(550, "a new database's rows published");

    /* Idle databases are closed; a commit still wakes the group. */
    ok(run_until(30000, none_open, NULL), "idle databases closed");
    rt_insert_rows(a, "a", 300, 10, "orders", 5);
    wait_len(560, "a commit to a closed database published");

    /* The file without an outbox becomes one. */
    {
        char serr[256];
        is_int(outbox_schema_apply(plain, serr, sizeof serr), 0, "plain.db gets the outbox schema");
        rt_insert_rows(plain, "plain", 0, 20, "orders", 0);
    }
    wait_len(580, "a database that became an outbox published");

    /* Added and removed through the API. */
    pextra = keep(rt_make_db(other, "x.db"));
    extra = rt_open(pextra);
    rt_insert_rows(extra, "extra", 0, 30, "orders", 2);
    is_int(outbox_relay_group_add(g, "extra", pextra, err, sizeof err), 0, "a database added by name");
    is_int(outbox_relay_group_add(g, "a", pextra, err, sizeof err), OUTBOX_EDUPLICATE, "a name taken: %s", err);
    wait_len(610, "the added database published");
    is_int(outbox_relay_group_remove(g, "extra"), 0, "removed");
    is_int(outbox_relay_group_remove(g, "extra"), OUTBOX_ESTATE, "removed twice: ESTATE");

    /* A database deleted leaves the group. */
    sqlite3_close_v2(b);
    unlink(pb);
    want_dbs = 4; /* a, c, plain, bad */
    ok(run_until(10000, dbs_are, NULL), "the deleted database left the group");
    is_int(outbox_relay_group_db_state(g, "b", NULL, 0), OUTBOX_GROUP_DB_UNKNOWN, "b is gone");

    t = audit();
    is_int(t.by_db[0], 310, "a: 310 entries");
    is_int(t.by_db[2], 50, "c: 50 entries");
    is_int(t.by_db[3], 20, "plain: 20 entries");
    is_int(t.by_db[4], 30, "extra: 30 entries");
    is_int(t.order_violations, 0, "order kept");
    is_int(t.bad_db, 0, "db named in every entry");

    stopped = 0;
    is_int(outbox_relay_group_stop(g, rt_group_flag, &stopped), 0, "stop");
    ok(run_until(15000, rt_flag, &stopped), "stopped");
    outbox_relay_group_destroy(g);
    uv_run(&loop, UV_RUN_NOWAIT);
    sqlite3_close_v2(a);
    sqlite3_close_v2(cdb);
    sqlite3_close_v2(plain);
    sqlite3_close_v2(extra);
}

/* Entries by the hundred, added, found, removed and added again: the
 * group's lookups by name and by path (a hash of each, grown as entries
 * come) find every entry and forget every removed one. */
static void many_entries(void)
{
    char *dir = keep(th_path(root, "many-entries")), name[32], path[600], err[512];
    outbox_relay_group *g;
    outbox_relay_settings s;
    int bad = 0;
    mkdir(dir, 0755);
    s = settings(dir);
    is_int(outbox_relay_group_create(&g, &loop, &s, err, sizeof err), 0, "group created: %s", err);
    for (int i = 0; i < 300; i++) {
        snprintf(name, sizeof name, "t%03d", i);
        snprintf(path, sizeof path, "%s/%s.db", dir, name);
        bad += outbox_relay_group_add(g, name, path, err, sizeof err) != 0;
    }
    is_int(bad, 0, "300 databases added");
    is_int(stats(g).databases, 300, "300 in the group");
    snprintf(path, sizeof path, "%s/fresh.db", dir);
    is_int(outbox_relay_group_add(g, "t299", path, err, sizeof err), OUTBOX_EDUPLICATE, "the last name is taken: %s",
           err);
    snprintf(path, sizeof path, "%s/t000.db", dir);
    is_int(outbox_relay_group_add(g, "other", path, err, sizeof err), OUTBOX_EDUPLICATE,
           "the first path is taken: %s", err);
    for (int i = bad = 0; i < 300; i += 2) {
        snprintf(name, sizeof name, "t%03d", i);
        bad += outbox_relay_group_remove(g, name) != 0;
    }
    is_int(bad, 0, "every other one removed");
    is_int(stats(g).databases, 150, "150 left");
    for (int i = bad = 0; i < 300; i++) {
        snprintf(name, sizeof name, "t%03d", i);
        bad += (outbox_relay_group_db_state(g, name, NULL, 0) == OUTBOX_GROUP_DB_UNKNOWN) != (i % 2 == 0);
    }
    is_int(bad, 0, "the removed ones unknown, the others found");
    for (int i = bad = 0; i < 300; i++) {
        snprintf(name, sizeof name, "t%03d", i);
        snprintf(path, sizeof path, "%s/%s.db", dir, name);
        bad += outbox_relay_group_add(g, name, path, err, sizeof err) != (i % 2 == 0 ? 0 : OUTBOX_EDUPLICATE);
    }
    is_int(bad, 0, "the removed ones added again, the others refused");
    is_int(stats(g).databases, 300, "300 in the group again");
    outbox_relay_group_destroy(g);
    uv_run(&loop, UV_RUN_NOWAIT);
}

static int drained;
static void on_drained(outbox_relay_group *g, void *data)
{
    (void)data;
    drained = 1;
    outbox_relay_group_stop(g, rt_group_flag, &stopped);
}

/* A drain over more databases than may be open at once. */
static void drain_many(void)
{
    char *dir = keep(th_path(root, "many")), names7[7][16], err[512], failed[1024];
    outbox_relay_group *g;
    outbox_relay_settings s;
    long before = (long)th_xlen(c, "outbox:orders");
    mkdir(dir, 0755);
    for (int i = 0; i < 6; i++) {
        snprintf(names7[i], sizeof names7[i], "t%d.db", i);
        free(rt_make_db_rows(dir, names7[i], "many", i * 1000, 100, "orders", 3));
    }
    write_file(keep(th_path(dir, "broken.db")), "SQLite format 3\nbut nothing after it that SQLite could read at all\n");
    s = settings(dir);
    s.drain = 1;
    s.max_open_dbs = 2;
    is_int(outbox_relay_group_create(&g, &loop, &s, err, sizeof err), 0, "drain group created: %s", err);
    outbox_relay_group_on_drained(g, on_drained, NULL);
    drained = stopped = 0;
    is_int(outbox_relay_group_start(g), 0, "drain started");
    ok(run_until(60000, rt_flag, &stopped), "the drain ended and the group stopped");
    ok(drained, "on_drained called");
    is_int(outbox_relay_group_drain_result(g, failed, sizeof failed), OUTBOX_EIO, "drain result EIO: %s", failed);
    ok(strstr(failed, "broken") != NULL, "the corrupt database is named");
    is_int((long)th_xlen(c, "outbox:orders") - before, 600, "every healthy database drained with 2 open at most");
    outbox_relay_group_destroy(g);
    uv_run(&loop, UV_RUN_NOWAIT);
}

/* The same message id in two databases; idempotent markers per database. */
static void same_ids(int idempotent)
{
    char *dir = keep(th_path(root, idempotent ? "same_idem" : "same")), err[512];
    outbox_relay_group *g;
    outbox_relay_settings s;
    long before = (long)th_xlen(c, "outbox:orders");
    mkdir(dir, 0755);
    for (int i = 1; i <= 2; i++) {
        char file[16];
        snprintf(file, sizeof file, "same%d.db", i);
        free(rt_make_db_rows(dir, file, "dup", 0, 40, "orders", 2));
    }
    s = settings(dir);
    s.drain = 1;
    s.idempotent = idempotent;
    is_int(outbox_relay_group_create(&g, &loop, &s, err, sizeof err), 0, "group created: %s", err);
    outbox_relay_group_on_drained(g, on_drained, NULL);
    drained = stopped = 0;
    outbox_relay_group_start(g);
    ok(run_until(30000, rt_flag, &stopped), "%s: drained", idempotent ? "idempotent" : "plain");
    is_int(outbox_relay_group_drain_result(g, NULL, 0), 0, "drain result 0");
    is_int((long)th_xlen(c, "outbox:orders") - before, 80,
           "%s: the same 40 ids of two databases appended for each", idempotent ? "idempotent" : "plain");
    outbox_relay_group_destroy(g);
    uv_run(&loop, UV_RUN_NOWAIT);
}

/* A stream per tenant (stream_template); bad templates refused. */
static void per_tenant_streams(void)
{
    char *dir = keep(th_path(root, "tpl")), err[512];
    outbox_relay_group *g;
    outbox_relay_settings s;
    static const char *const bad[] = {"t:%topic", "t:%db", "%topic:%db", "{%db}:%topic", "t:%db:%db:%topic",
                                      "t:%x:%db:%topic", "t %db:%topic"};
    mkdir(dir, 0755);
    for (int i = 1; i <= 2; i++) {
        char file[16], prefix[16];
        snprintf(file, sizeof file, "ten%d.db", i);
        snprintf(prefix, sizeof prefix, "ten%d", i);
        free(rt_make_db_rows(dir, file, prefix, 0, 30 * i, "orders", 3));
    }
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        s = settings(dir);
        s.stream_template = bad[i];
        ok(outbox_relay_group_create(&g, &loop, &s, err, sizeof err) == OUTBOX_EINVAL && strstr(err, "stream-template"),
           "stream template '%s' refused: %s", bad[i], err);
    }
    s = settings(dir);
    s.drain = 1;
    s.stream_template = "tenant:%db:outbox:%topic";
    is_int(outbox_relay_group_create(&g, &loop, &s, err, sizeof err), 0, "a stream per tenant: created %s", err);
    outbox_relay_group_on_drained(g, on_drained, NULL);
    drained = stopped = 0;
    outbox_relay_group_start(g);
    ok(run_until(30000, rt_flag, &stopped), "drained");
    is_int(th_xlen(c, "tenant:ten1:outbox:orders"), 30, "ten1's 30 entries in its own stream");
    is_int(th_xlen(c, "tenant:ten2:outbox:orders"), 60, "ten2's 60 entries in its own stream");
    outbox_relay_group_destroy(g);
    uv_run(&loop, UV_RUN_NOWAIT);
}

/* Retention of closed databases: published rows that come due while
 * nothing else opens their database reopen it, and go. */
static sqlite3 *ret_dbs[2];
static int ret_gone(void *arg)
{
    (void)arg;
    for (int i = 0; i < 2; i++)
        if (th_sql_int(ret_dbs[i], "SELECT (SELECT count(*) FROM outbox) + (SELECT count(*) FROM outbox_batch)"))
            return 0;
    return 1;
}

static void closed_retention(void)
{
    char *dir = keep(th_path(root, "ret")), err[512];
    static const char *const files[2] = {"old.db", "soon.db"};
    outbox_relay_group *g;
    outbox_relay_settings s;
    long before = (long)th_xlen(c, "outbox:kept");
    int64_t now;
    mkdir(dir, 0755);
    for (int i = 0; i < 2; i++) {
        char *p = rt_make_db(dir, files[i]);
        ret_dbs[i] = rt_open(p);
        rt_insert_rows(ret_dbs[i], files[i], 0, 20, "kept", 3);
        free(p);
    }
    /* Published by a drain without retention... */
    s = settings(dir);
    s.drain = 1;
    is_int(outbox_relay_group_create(&g, &loop, &s, err, sizeof err), 0, "retention: drain created %s", err);
    outbox_relay_group_on_drained(g, on_drained, NULL);
    drained = stopped = 0;
    outbox_relay_group_start(g);
    ok(run_until(30000, rt_flag, &stopped), "retention: drained");
    outbox_relay_group_destroy(g);
    uv_run(&loop, UV_RUN_NOWAIT);
    is_int((long)th_xlen(c, "outbox:kept") - before, 40, "retention: 40 entries");
    /* ... then as if long ago (old.db: a minute, due at once) and a moment
     * ago (soon.db: due once its time, plus the group's slack, passes). */
    now = th_now_ms();
    for (int i = 0; i < 2; i++) {
        int64_t at = i == 0 ? now - 60000 : now - 500;
        th_sql_exec(ret_dbs[i], "UPDATE outbox_batch SET published_at = %lld WHERE state = 2", (long long)at);
        th_sql_exec(ret_dbs[i], "UPDATE outbox SET published_at = %lld WHERE state = 2", (long long)at);
        is_int((long)th_sql_int(ret_dbs[i], "SELECT count(*) FROM outbox_messages WHERE state = 2"), 20,
               "retention: %s holds its 20 published rows", files[i]);
    }
    /* A group that runs (not a drain) with retention: nothing is written to
     * either database, yet both lose their published rows. */
    s = settings(dir);
    s.retention_ms = 1000;
    is_int(outbox_relay_group_create(&g, &loop, &s, err, sizeof err), 0, "retention: group created %s", err);
    stopped = 0;
    outbox_relay_group_start(g);
    {
        int gone = run_until(20000, ret_gone, NULL);
        ok(gone, "retention: both closed databases emptied (old.db %lld, soon.db %lld rows left)",
           (long long)th_sql_int(ret_dbs[0], "SELECT count(*) FROM outbox"),
           (long long)th_sql_int(ret_dbs[1], "SELECT count(*) FROM outbox"));
    }
    is_int((long)th_xlen(c, "outbox:kept") - before, 40, "retention: nothing published again");
    outbox_relay_group_stop(g, rt_group_flag, &stopped);
    ok(run_until(20000, rt_flag, &stopped), "retention: stopped");
    outbox_relay_group_destroy(g);
    uv_run(&loop, UV_RUN_NOWAIT);
    for (int i = 0; i < 2; i++)
        sqlite3_close_v2(ret_dbs[i]);
}

static void daemon_cli(void)
{
    char *dir = keep(th_path(root, "cli")), *p, *relay = keep(th_bin("tools/relay/outbox-relay")), *out = NULL, *errs = NULL;
    int st;
    long before = (long)th_xlen(c, "outbox:orders");
    mkdir(dir, 0755);
    p = keep(rt_make_db_rows(dir, "one.db", "cli", 0, 25, "orders", 0));
    write_file(keep(th_path(dir, "zz.db")), "garbage\n");
    {
        char *argv[] = {relay, "run", "--db-dir", dir, "--redis", srv.url, "--drain", NULL};
        st = th_run(argv, NULL, &out, &errs, 30000 * th_slow());
        is_int(st, 1, "--db-dir --drain with a corrupt database exits 1");
        ok(errs && strstr(errs, "drain incomplete") && strstr(errs, "zz"), "the corrupt database is named");
        if (!errs || !strstr(errs, "zz"))
            th_diag_tail("stderr", errs, 10);
        is_int((long)th_xlen(c, "outbox:orders") - before, 25, "the healthy database drained");
        free(out);
        free(errs);
    }
    {
        /* The endpoint: counts by state, the failing database named, 200. */
        char listen[32], *log = keep(th_path(root, "cli-metrics.log")), *body = NULL;
        int hp = th_free_port(), code = -1;
        pid_t pid;
        snprintf(listen, sizeof listen, "127.0.0.1:%d", hp);
        {
            char *argv[] = {relay, "run", "--db-dir", dir, "--redis", srv.url, "--metrics-listen", listen, NULL};
            pid = th_spawn(argv, NULL, log, log);
        }
        for (int i = 0; i < 200 * th_slow(); i++) {
            free(body);
            body = NULL;
            code = ot_http_get(hp, "/healthz", &body);
            if (code == 200 && body && strstr(body, "failed 1"))
                break;
            th_sleep_ms(25);
        }
        is_int(code, 200, "/healthz of the group: 200 with a failing database");
        ok(body && strstr(body, "failing: zz:"), "/healthz names it");
        ok(body && strstr(body, " open ") && strstr(body, " closed ") && strstr(body, " failed 1 not_outbox 0\n"),
           "/healthz counts the databases by state (databases N open N closed N failed N not_outbox N)");
        free(body);
        body = NULL;
        code = ot_http_get(hp, "/metrics", &body);
        is_int(code, 200, "/metrics of the group");
        ok(body && strstr(body, "outbox_databases{state=\"failed\"} 1") &&
               strstr(body, "outbox_database_failing{db=\"zz\"} 1") && strstr(body, "outbox_published_total"),
           "/metrics: databases by state, the failing one, the counters");
        if (body && !strstr(body, "outbox_database_failing"))
            th_diag_tail("metrics", body, 20);
        free(body);
        is_int(th_stop(pid, SIGTERM, 20000), 0, "stops cleanly");
    }
    unlink(keep(th_path(dir, "zz.db")));
    {
        char *argv[] = {relay, "run", "--db-dir", dir, "--redis", srv.url, "--drain", "--db-glob", "*.sqlite",
                        "--db-glob", "one.*", NULL};
        st = th_run(argv, NULL, &out, &errs, 30000 * th_slow());
        is_int(st, 0, "--db-dir --drain exits 0 once every database drained (two --db-glob)");
        ok(errs && strstr(errs, "msg=\"databases found\" count=1"), "one.db found by the second glob");
        free(out);
        free(errs);
    }
    {
        char *argv[] = {relay, "run", "--db-dir", dir, "--db", p, "--redis", srv.url, NULL};
        st = th_run(argv, NULL, &out, &errs, 30000 * th_slow());
        is_int(st, 2, "--db with --db-dir: usage error");
        ok(errs && strstr(errs, "cannot be combined"), "and says so");
        free(out);
        free(errs);
    }
}

/* Order per (database, key) over the stream: the first appearance of each
 * id in commit order; ids are "<db>-<6 digits>". Counts every id seen. */
static long first_order_violations(const char *stream, rt_map *seen)
{
    rt_stream s = rt_stream_read(c, stream);
    rt_map *last = rt_map_new();
    long v = 0;
    for (size_t i = 0; i < s.n; i++) {
        outbox_envelope *e = NULL;
        char key[300], idk[300];
        int64_t prev;
        if (outbox_envelope_decode(s.e[i].env, s.e[i].envlen, &e, NULL, 0) != 0)
            continue;
        snprintf(idk, sizeof idk, "%s/%s", e->db ? e->db : "", e->id);
        if (rt_map_add(seen, idk, 0) == 1 && e->key) {
            long n = strtol(strrchr(e->id, '-') + 1, NULL, 10);
            snprintf(key, sizeof key, "%s/%s", e->db ? e->db : "", e->key);
            if (rt_map_get(last, key, &prev) && prev > n)
                v++;
            rt_map_set(last, key, n);
        }
        outbox_envelope_free(e);
    }
    rt_map_free(last);
    rt_stream_free(&s);
    return v;
}

static long long kills_want;
static int kills_len(void *arg)
{
    (void)arg;
    return th_xlen(c, "outbox:kills") >= kills_want;
}

/* Every healthy database of daemon_kills published (k07 is broken). */
static char **kills_paths;
static int kills_ndb, kills_from;
static int kills_all_marked(void *arg)
{
    (void)arg;
    /* From the first database found unfinished last time: the ones before
     * it were done (over 1,000 databases, every look reads them all). */
    for (; kills_from < kills_ndb; kills_from++) {
        sqlite3 *db;
        int64_t left;
        if (kills_from == 7)
            continue;
        db = rt_open(kills_paths[kills_from]);
        left = th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state <> 2");
        sqlite3_close_v2(db);
        if (left)
            return 0;
    }
    return 1;
}

/* The daemon over 40 databases (OUTBOX_KILLS_DBS, e.g. 1000 for the long
 * form) killed with SIGKILL three times mid-drain, one database
 * overwritten with garbage meanwhile: every row of every other database
 * published, in order per key; the drain names the broken one. */
static void daemon_kills(void)
{
    enum { ROWS = 250 };
    const char *env = getenv("OUTBOX_KILLS_DBS");
    int NDB = env && atoi(env) >= 8 && atoi(env) <= 10000 ? atoi(env) : 40;
    char *dir = keep(th_path(root, "kills")), *relay = keep(th_bin("tools/relay/outbox-relay")), *log = keep(th_path(root, "kills.log")),
         *errs = NULL, *out = NULL;
    char **paths = calloc((size_t)NDB, sizeof *paths);
    if (!paths)
        bail("out of memory");
    rt_map *seen = rt_map_new();
    long missing = 0, unpublished = 0;
    int st, kills = 0;
    mkdir(dir, 0755);
    for (int i = 0; i < NDB; i++) {
        char file[32], prefix[32];
        snprintf(file, sizeof file, "k%02d.db", i);
        snprintf(prefix, sizeof prefix, "k%02d", i);
        paths[i] = rt_make_db_rows(dir, file, prefix, 0, ROWS, "kills", 7);
    }
    for (int round = 1; round <= 3; round++) {
        char *argv[] = {relay, "run", "--db-dir", dir, "--redis", srv.url, "--lease-ms", "1000", "--batch", "64", NULL};
        pid_t pid = th_spawn(argv, NULL, log, log);
        kills_want = (long long)NDB * ROWS * round / 4;
        run_until(20000, kills_len, NULL);
        if (th_stop(pid, SIGKILL, 5000) != -1)
            kills++;
        if (round == 2) {
            /* k07 becomes unreadable mid-run (as root, a chmod would not
             * stop us): its header overwritten, its WAL (which may hold page
             * 1) and index gone. */
            char side[4200];
            FILE *f = fopen(paths[7], "r+");
            if (f) {
                fputs("this is no longer a SQLite database header, nor anything else", f);
                fclose(f);
            }
            snprintf(side, sizeof side, "%s-wal", paths[7]);
            unlink(side);
            snprintf(side, sizeof side, "%s-shm", paths[7]);
            unlink(side);
        }
    }
    diag("%d databases of %d rows", NDB, ROWS);
    is_int(kills, 3, "the daemon was killed three times mid-drain");
    {
        /* Not a drain: the daemon itself takes over what the killed ones
         * left leased, their leases expired or not yet, though nothing is
         * written to those databases any more. */
        char *argv[] = {relay, "run", "--db-dir", dir, "--redis", srv.url, NULL};
        pid_t pid = th_spawn(argv, NULL, log, log);
        kills_paths = paths;
        kills_ndb = NDB;
        kills_from = 0;
        ok(run_until(30000, kills_all_marked, NULL), "the daemon, not draining, publishes every row the kills left");
        is_int(th_stop(pid, SIGTERM, 20000), 0, "and stops cleanly");
    }
    {
        char *argv[] = {relay, "run", "--db-dir", dir, "--redis", srv.url, "--drain", NULL};
        st = th_run(argv, NULL, &out, &errs, 60000 * th_slow());
    }
    is_int(st, 1, "the last drain exits 1: one database could not be drained");
    ok(errs && strstr(errs, "not_drained=") && strstr(errs, "k07"), "and names it");
    if (st != 1)
        th_diag_tail("the last drain's log", errs, 30);
    for (int i = 0; i < NDB; i++) {
        sqlite3 *db;
        if (i == 7)
            continue;
        db = rt_open(paths[i]);
        unpublished += th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state <> 2");
        sqlite3_close_v2(db);
    }
    is_int(unpublished, 0, "every row of the other databases is marked published");
    is_int(first_order_violations("outbox:kills", seen), 0, "per (database, key) order held across the kills");
    for (int i = 0; i < NDB; i++) {
        if (i == 7)
            continue;
        for (int k = 0; k < ROWS; k++) {
            char idk[64];
            snprintf(idk, sizeof idk, "k%02d/k%02d-%06d", i, i, k);
            missing += rt_map_get(seen, idk, NULL) == 0;
        }
    }
    is_int(missing, 0, "no committed row of the other databases is missing from the stream");
    rt_map_free(seen);
    free(out);
    free(errs);
    for (int i = 0; i < NDB; i++)
        free(paths[i]);
    free(paths);
}

static char *two_paths[20];
static int two_published(void *arg)
{
    (void)arg;
    for (int i = 0; i < 20; i++) {
        sqlite3 *db = rt_open(two_paths[i]);
        int64_t left = th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state <> 2");
        sqlite3_close_v2(db);
        if (left)
            return 0;
    }
    return 1;
}

/* Two daemons on one directory share it through the leases: every row
 * published once, in order per key, both of them working. */
static void two_daemons(void)
{
    char *dir = keep(th_path(root, "two")), *relay = keep(th_bin("tools/relay/outbox-relay")), *log1 = keep(th_path(root, "two1.log")),
         *log2 = keep(th_path(root, "two2.log"));
    rt_map *seen = rt_map_new();
    rt_stream s;
    long dups = 0, v;
    pid_t p1, p2;
    char *l1, *l2;
    mkdir(dir, 0755);
    for (int i = 0; i < 20; i++) {
        char file[32], prefix[32];
        snprintf(file, sizeof file, "w%02d.db", i);
        snprintf(prefix, sizeof prefix, "w%02d", i);
        two_paths[i] = rt_make_db_rows(dir, file, prefix, 0, 300, "two", 5);
    }
    {
        char *a1[] = {relay, "run", "--db-dir", dir, "--redis", srv.url, "--worker-id", "one", "--batch", "32", NULL};
        char *a2[] = {relay, "run", "--db-dir", dir, "--redis", srv.url, "--worker-id", "two", "--batch", "32", NULL};
        p1 = th_spawn(a1, NULL, log1, log1);
        p2 = th_spawn(a2, NULL, log2, log2);
    }
    ok(run_until(60000, two_published, NULL), "two daemons on one directory published every row");
    is_int(th_stop(p1, SIGTERM, 20000), 0, "the first stops cleanly");
    is_int(th_stop(p2, SIGTERM, 20000), 0, "the second stops cleanly");
    s = rt_stream_read(c, "outbox:two");
    for (size_t i = 0; i < s.n; i++) {
        outbox_envelope *e = NULL;
        char idk[300];
        if (outbox_envelope_decode(s.e[i].env, s.e[i].envlen, &e, NULL, 0) != 0)
            continue;
        snprintf(idk, sizeof idk, "%s/%s", e->db ? e->db : "", e->id);
        dups += rt_map_add(seen, idk, 0) > 1;
        outbox_envelope_free(e);
    }
    is_int((long)rt_map_size(seen), 6000, "6000 distinct messages in the stream");
    is_int(dups, 0, "none twice: the leases kept the two apart");
    rt_stream_free(&s);
    rt_map_free(seen);
    seen = rt_map_new();
    v = first_order_violations("outbox:two", seen);
    is_int(v, 0, "order per (database, key) kept across the two");
    l1 = th_slurp(log1);
    l2 = th_slurp(log2);
    ok(l1 && l2 && strstr(l1, "msg=stopped") && strstr(l2, "msg=stopped"), "both ran to a clean stop");
    if (l1 && l2)
        diag("one: %.80s; two: %.80s", strstr(l1, "msg=stopped") ? strstr(l1, "msg=stopped") : "?",
             strstr(l2, "msg=stopped") ? strstr(l2, "msg=stopped") : "?");
    free(l1);
    free(l2);
    rt_map_free(seen);
    for (int i = 0; i < 20; i++)
        free(two_paths[i]);
}

/* /metrics names the backlog of the --metrics-db-limit databases with the
 * largest one and sums the rest as db="other". Redis is unreachable, so the
 * backlogs stay as committed while the relays hold them. */
static void metrics_backlog(void)
{
    char *dir = keep(th_path(root, "backlogs")), *relay = keep(th_bin("tools/relay/outbox-relay"));
    char listen[32], url[64], *log = keep(th_path(root, "backlogs.log")), *body = NULL;
    const char *dbs[3] = {"big", "small", "tiny"};
    const int rows[3] = {300, 3, 1};
    int hp = th_free_port(), code = -1, seen = 0;
    pid_t pid;
    mkdir(dir, 0755);
    for (int i = 0; i < 3; i++) {
        char file[32];
        snprintf(file, sizeof file, "%s.db", dbs[i]);
        keep(rt_make_db_rows(dir, file, dbs[i], 0, rows[i], "orders", 0));
    }
    snprintf(listen, sizeof listen, "127.0.0.1:%d", hp);
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", th_free_port());
    {
        char *argv[] = {relay, "run", "--db-dir", dir, "--redis", url, "--metrics-listen", listen,
                        "--metrics-db-limit", "1", NULL};
        pid = th_spawn(argv, NULL, log, log);
    }
    for (int i = 0; i < 400 * th_slow() && !seen; i++) {
        free(body);
        body = NULL;
        code = ot_http_get(hp, "/metrics", &body);
        seen = code == 200 && body && strstr(body, "outbox_database_backlog{db=\"big\"} 300\n") &&
               strstr(body, "outbox_database_backlog{db=\"other\"} 4\n");
        if (!seen)
            th_sleep_ms(25);
    }
    ok(seen, "/metrics: the largest backlog by name (big 300), the other two summed (other 4)");
    if (!seen)
        th_diag_tail("metrics", body, 30);
    ok(body && !strstr(body, "db=\"small\"") && !strstr(body, "db=\"tiny\""),
       "no series of its own for a database beyond --metrics-db-limit 1");
    ok(body && strstr(body, "outbox_database_oldest_pending_seconds{db=\"big\"} ") &&
           strstr(body, "outbox_database_oldest_pending_seconds{db=\"other\"} "),
       "the oldest pending age of big and of the others");
    free(body);
    is_int(th_stop(pid, SIGTERM, 20000), 0, "stops cleanly");
}

int main(void)
{
    if (th_redis_start(&srv, 0, NULL) != 0) {
        skip("no redis-server");
        return tap_done();
    }
    root = th_tmpdir();
    c = th_redis_client(&srv);
    uv_loop_init(&loop);
    running_group();
    many_entries();
    drain_many();
    same_ids(0);
    same_ids(1);
    per_tenant_streams();
    closed_retention();
    daemon_cli();
    metrics_backlog();
    daemon_kills();
    two_daemons();
    uv_loop_close(&loop);
    redisFree(c);
    th_redis_destroy(&srv);
    th_rmtree(root);
    free(root);
    for (size_t i = 0; i < nkept; i++)
        free(kept[i]);
    return tap_done();
}
