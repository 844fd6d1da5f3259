/* outbox-replay: inspection (list, show, stats, JSON output), audited
 * requeue of dead and published messages, --dry-run, --threshold/--yes,
 * live-lease protection and --force fencing, purge of dead rows only, time
 * filters, and every bad input (message, exit code, nothing changed). Real
 * SQLite files made with outbox_db_open() + outbox_schema_apply(), rows
 * inserted by SQL in every state. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <msgpack.h>
#include <sqlite3.h>

#include "harness.h"
#include "outbox.h"
#include "tap.h"

/* Unix milliseconds now, as SQL (the schema's own default expression). */
#define NOW_SQL "CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"

static char *tool, *dir;

typedef struct res {
    int code;
    char *out, *err;
} res;

static res run(char *const *argv)
{
    res r;
    r.code = th_run(argv, NULL, &r.out, &r.err, 30000);
    if (!r.out)
        r.out = strdup("");
    if (!r.err)
        r.err = strdup("");
    return r;
}

static void res_free(res *r)
{
    free(r->out);
    free(r->err);
}

#define RUN(...)                                                                                   \
    ({                                                                                             \
        char *argv_[] = {tool, __VA_ARGS__, NULL};                                                 \
        run(argv_);                                                                                \
    })

/* ---- databases ----------------------------------------------------------- */

static char *make_db(const char *name)
{
    char *p = th_path(dir, name), err[512];
    sqlite3 *db;
    if (outbox_db_open(p, OUTBOX_OPEN_CREATE, &db, err, sizeof err) != 0 || outbox_schema_apply(db, err, sizeof err) != 0)
        bail("cannot create %s: %s", p, err);
    sqlite3_close_v2(db);
    return p;
}

static sqlite3 *open_plain(const char *path)
{
    sqlite3 *db;
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READWRITE, NULL) != SQLITE_OK)
        bail("cannot open %s", path);
    sqlite3_busy_timeout(db, 5000);
    return db;
}

static void exec_sql(const char *path, const char *sql)
{
    sqlite3 *db = open_plain(path);
    char *msg = NULL;
    if (sqlite3_exec(db, sql, NULL, NULL, &msg) != SQLITE_OK)
        bail("SQL failed on %s: %s\n%s", path, msg ? msg : "?", sql);
    sqlite3_close_v2(db);
}

/* First column of the first row as an integer (-999 for no row, -998 for
 * NULL). */
static long long q_int(const char *path, const char *sql)
{
    sqlite3 *db = open_plain(path);
    sqlite3_stmt *st;
    long long v = -999;
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK)
        bail("bad query %s: %s", sql, sqlite3_errmsg(db));
    if (sqlite3_step(st) == SQLITE_ROW)
        v = sqlite3_column_type(st, 0) == SQLITE_NULL ? -998 : sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    sqlite3_close_v2(db);
    return v;
}

/* First column of the first row as a malloc'd string, NULL for NULL. */
static char *q_str(const char *path, const char *sql)
{
    sqlite3 *db = open_plain(path);
    sqlite3_stmt *st;
    char *v = NULL;
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK)
        bail("bad query %s: %s", sql, sqlite3_errmsg(db));
    if (sqlite3_step(st) == SQLITE_ROW && sqlite3_column_type(st, 0) != SQLITE_NULL)
        v = strdup((const char *)sqlite3_column_text(st, 0));
    sqlite3_finalize(st);
    sqlite3_close_v2(db);
    return v;
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *s = p;
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 1099511628211ULL;
    }
    return h;
}

/* A checksum of every column of every row of the outbox table, with types. */
static uint64_t table_sum(const char *path)
{
    sqlite3 *db = open_plain(path);
    sqlite3_stmt *st;
    uint64_t h = 14695981039346656037ULL;
    if (sqlite3_prepare_v2(db, "SELECT * FROM outbox ORDER BY seq", -1, &st, NULL) != SQLITE_OK)
        bail("checksum: %s", sqlite3_errmsg(db));
    while (sqlite3_step(st) == SQLITE_ROW) {
        for (int i = 0; i < sqlite3_column_count(st); i++) {
            int t = sqlite3_column_type(st, i);
            const void *b = sqlite3_column_blob(st, i);
            int n = sqlite3_column_bytes(st, i);
            h = fnv(h, &t, sizeof t);
            h = fnv(h, &n, sizeof n);
            if (b)
                h = fnv(h, b, (size_t)n);
        }
        h = fnv(h, "|", 1);
    }
    sqlite3_finalize(st);
    sqlite3_close_v2(db);
    return h;
}

/* A checksum of a file's bytes (0 if it cannot be read). */
static uint64_t file_sum(const char *path)
{
    FILE *f = fopen(path, "rb");
    uint64_t h = 14695981039346656037ULL;
    char buf[4096];
    size_t n;
    if (!f)
        return 0;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        h = fnv(h, buf, n);
    fclose(f);
    return h;
}

/* The standard rows, one or more in every state:
 *   d1, d2 dead (orders), d3 dead (billing); p1 published (orders);
 *   q1 pending (orders); s-live sending with a live lease (w1, token 7);
 *   s-exp sending with an expired lease (w2, token 3). */
static void fixture(const char *path)
{
    exec_sql(path,
             "INSERT INTO outbox(id, topic, key, payload, state, attempts, last_error) VALUES"
             " ('d1', 'orders', 'o-1', 'dead one', 3, 10, 'XADD: ERR no such stream'),"
             " ('d2', 'orders', 'o-2', 'dead two', 3, 10, 'XADD: ERR no such stream'),"
             " ('d3', 'billing', NULL, 'dead three', 3, 4, 'payload too large');"
             "INSERT INTO outbox(id, topic, payload, state, attempts, published_at, stream_id) VALUES"
             " ('p1', 'orders', 'published one', 2, 1, " NOW_SQL " - 60000, '1-0');"
             "INSERT INTO outbox(id, topic, payload) VALUES ('q1', 'orders', 'pending one');"
             "INSERT INTO outbox(id, topic, payload, state, attempts, lease_owner, lease_token, lease_until) VALUES"
             " ('s-live', 'orders', 'sending live', 1, 1, 'w1', 7, " NOW_SQL " + 600000),"
             " ('s-exp', 'orders', 'sending expired', 1, 2, 'w2', 3, " NOW_SQL " - 1000);");
}

static char *fresh_db(const char *name)
{
    char *p = make_db(name);
    fixture(p);
    return p;
}

/* Text made fit for one TAP line (newlines become " | "), truncated. */
static const char *oneline(const char *s)
{
    static char bufs[4][600];
    static int next;
    char *b = bufs[next++ % 4];
    size_t o = 0;
    for (; s && *s && o + 4 < sizeof bufs[0]; s++) {
        if (*s == '\n') {
            if (s[1])
                memcpy(b + o, " | ", 3), o += 3;
        } else {
            b[o++] = *s;
        }
    }
    b[o] = '\0';
    return b;
}

/* Writes text to a file in the test directory and checks it with a Python
 * script (argv[1] is the file): returns the script's exit status. */
static int py_check(const char *text, const char *script)
{
    char *path = th_path(dir, "check.json");
    FILE *f = fopen(path, "w");
    char *argv[] = {"python3", "-c", (char *)script, path, NULL};
    res r;
    if (!f)
        bail("cannot write %s", path);
    fputs(text, f);
    fclose(f);
    r = run(argv);
    if (r.code != 0)
        diag("python3: %s %s", oneline(r.out), oneline(r.err));
    free(path);
    res_free(&r);
    return r.code;
}

static int has_python(void)
{
    char *argv[] = {"python3", "-c", "import json", NULL};
    res r = run(argv);
    int ok_ = r.code == 0;
    res_free(&r);
    return ok_;
}

static void expect(res r, int code, const char *needle, const char *what)
{
    is_int(r.code, code, "%s: exit %d", what, code);
    if (needle)
        ok(strstr(r.err, needle) != NULL || strstr(r.out, needle) != NULL, "%s: says '%s' (%s)", what, needle,
           oneline(r.err[0] ? r.err : r.out));
}

/* ---- tests --------------------------------------------------------------- */

static void test_help(void)
{
    const char *must[] = {"list",       "show ID",  "stats",    "requeue",     "purge",    "--db",      "--state",
                          "pending",    "sending",  "published", "dead",       "--topic",  "--key",     "--id ",
                          "--id-prefix", "--since", "--until",   "--dry-run",  "--yes",    "--force",   "--reason",
                          "--json",     "--limit",  "--batch",   "--threshold", "default 100", "default 500",
                          "JSON array", "base64",   "Exit status", "outbox-relay init"};
    res r = RUN("--help");
    int all = 1;
    is_int(r.code, 0, "--help exits 0");
    for (size_t i = 0; i < sizeof must / sizeof must[0]; i++)
        if (!strstr(r.out, must[i])) {
            diag("--help lacks '%s'", must[i]);
            all = 0;
        }
    ok(all, "--help documents every subcommand, filter and option");
    res_free(&r);
    r = RUN("requeue", "--help");
    is_int(r.code, 0, "SUBCOMMAND --help exits 0");
    res_free(&r);
    r = RUN("--version");
    ok(r.code == 0 && strstr(r.out, OUTBOX_VERSION_STRING), "--version");
    res_free(&r);
    {
        char *argv[] = {tool, NULL};
        r = run(argv);
        ok(r.code == 2 && strstr(r.err, "Usage"), "no arguments: usage on stderr, exit 2");
        res_free(&r);
    }
}

static void test_requeue_dead(void)
{
    char *db = fresh_db("dead.db");
    long long t0 = q_int(db, "SELECT " NOW_SQL), t1;
    uint64_t d3_before = 0;
    res r;

    d3_before = (uint64_t)q_int(db, "SELECT replay_count + 10 * state FROM outbox WHERE id = 'd3'");
    r = RUN("requeue", "--db", db, "--state", "dead", "--topic", "orders", "--reason", "destination fixed");
    t1 = q_int(db, "SELECT " NOW_SQL);
    is_int(r.code, 0, "requeue dead of topic orders: exit 0 (%s)", oneline(r.err));
    ok(strstr(r.out, "requeued 2 messages") != NULL, "reports 2 requeued: %s", oneline(r.out));
    res_free(&r);
    is_int(q_int(db, "SELECT count(*) FROM outbox WHERE id IN ('d1','d2') AND state = 0 AND attempts = 0 AND "
                     "last_error IS NULL AND lease_owner IS NULL AND lease_until IS NULL AND replay_count = 1 AND "
                     "replay_reason = 'destination fixed'"),
           2, "d1, d2: pending, attempts 0, error and lease cleared, replay_count 1, reason recorded");
    ok(q_int(db, "SELECT min(replayed_at) FROM outbox WHERE id IN ('d1','d2')") >= t0 &&
           q_int(db, "SELECT max(replayed_at) FROM outbox WHERE id IN ('d1','d2')") <= t1,
       "replayed_at is the time of the run");
    ok(q_int(db, "SELECT min(available_at) FROM outbox WHERE id IN ('d1','d2')") >= t0 &&
           q_int(db, "SELECT max(available_at) FROM outbox WHERE id IN ('d1','d2')") <= t1,
       "available_at is now: due at once");
    is_int(q_int(db, "SELECT replay_count + 10 * state FROM outbox WHERE id = 'd3'"), (long long)d3_before,
           "d3 (other topic) untouched");
    is_int(q_int(db, "SELECT state FROM outbox WHERE id = 'p1'"), 2, "published p1 untouched");
    is_int(q_int(db, "SELECT lease_token FROM outbox WHERE id = 's-live'"), 7, "s-live untouched");

    /* The history shows in show. */
    r = RUN("show", "d1", "--db", db);
    is_int(r.code, 0, "show d1");
    ok(strstr(r.out, "replays:") && strstr(r.out, "destination fixed") && strstr(r.out, "pending"),
       "show has state, replay count and reason");
    res_free(&r);
    free(db);
}

static void test_requeue_published(void)
{
    char *db = fresh_db("published.db");
    res r;

    r = RUN("requeue", "--db", db, "--id", "p1", "--reason", "consumer lost data");
    is_int(r.code, 0, "requeue published p1 by id (%s)", oneline(r.err));
    res_free(&r);
    is_int(q_int(db, "SELECT count(*) FROM outbox WHERE id = 'p1' AND state = 0 AND attempts = 0 AND "
                     "replay_count = 1 AND replayed_at IS NOT NULL AND replay_reason = 'consumer lost data'"),
           1, "p1 pending, attempts 0, replay_count 1, replayed_at and reason set");

    /* Now pending: a requeue by id without --state pending finds nothing. */
    r = RUN("requeue", "--db", db, "--id", "p1", "--reason", "again");
    expect(r, 1, "nothing matches", "requeue of a pending message without --state pending");
    res_free(&r);

    /* Published again by the relay, lost again: replay_count counts. */
    exec_sql(db, "UPDATE outbox SET state = 2, published_at = " NOW_SQL ", attempts = 1 WHERE id = 'p1'");
    r = RUN("requeue", "--db", db, "--id", "p1", "--state", "published", "--reason", "lost twice");
    is_int(r.code, 0, "second requeue of p1");
    res_free(&r);
    is_int(q_int(db, "SELECT replay_count FROM outbox WHERE id = 'p1'"), 2, "replay_count 2");
    {
        char *reason = q_str(db, "SELECT replay_reason FROM outbox WHERE id = 'p1'");
        is_str(reason, "lost twice", "latest reason recorded");
        free(reason);
    }

    /* --state pending does take a pending message (due now, attempts 0). */
    exec_sql(db, "UPDATE outbox SET attempts = 3, available_at = " NOW_SQL " + 3600000 WHERE id = 'q1'");
    r = RUN("requeue", "--db", db, "--id", "q1", "--state", "pending", "--reason", "retry now");
    is_int(r.code, 0, "requeue --state pending of a backing-off row");
    res_free(&r);
    ok(q_int(db, "SELECT attempts = 0 AND available_at <= " NOW_SQL " AND replay_count = 1 FROM outbox WHERE id = "
                 "'q1'") == 1,
       "q1 due now, attempts 0, audited");
    free(db);
}

static void test_dry_run(void)
{
    char *db = fresh_db("dry.db");
    uint64_t before = table_sum(db);
    res r;

    r = RUN("requeue", "--db", db, "--reason", "check", "--dry-run");
    is_int(r.code, 0, "requeue --dry-run exits 0 (%s)", oneline(r.err));
    ok(strstr(r.out, "d1") && strstr(r.out, "d2") && strstr(r.out, "d3") && strstr(r.out, "p1") &&
           strstr(r.out, "s-exp") && strstr(r.out, "s-live") && !strstr(r.out, "q1"),
       "dry run lists exactly the selected rows");
    ok(strstr(r.out, "would requeue 5 messages") != NULL, "and what would change: %s", oneline(r.out));
    ok(strstr(r.out, "skip: live lease") != NULL && strstr(r.out, "would skip 1") != NULL,
       "and which row would be skipped for its live lease");
    res_free(&r);
    ok(table_sum(db) == before, "requeue --dry-run changed nothing (table checksum)");

    r = RUN("requeue", "--db", db, "--reason", "check", "--dry-run", "--force", "--threshold", "2");
    ok(r.code == 0 && strstr(r.out, "would requeue 6") && strstr(r.out, "needs --yes"),
       "dry run with --force counts the live lease; notes that --yes would be needed");
    res_free(&r);
    r = RUN("purge", "--db", db, "--dry-run");
    ok(r.code == 0 && strstr(r.out, "would delete 3 dead messages"), "purge --dry-run: %s", oneline(r.out));
    res_free(&r);
    ok(table_sum(db) == before, "purge --dry-run changed nothing");
    free(db);
}

static void test_threshold_and_batches(void)
{
    char *db = make_db("threshold.db");
    uint64_t before;
    res r;

    exec_sql(db, "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 101) "
                 "INSERT INTO outbox(id, topic, payload, state, attempts, last_error) "
                 "SELECT 'bulk-' || i, 'orders', 'x', 3, 10, 'boom' FROM n");
    before = table_sum(db);
    r = RUN("requeue", "--db", db, "--state", "dead", "--reason", "bulk");
    expect(r, 2, "--yes", "101 rows over the default threshold 100");
    ok(strstr(r.err, "101") != NULL, "says how many (%s)", oneline(r.err));
    res_free(&r);
    r = RUN("requeue", "--db", db, "--state", "dead", "--reason", "bulk", "--threshold", "5");
    expect(r, 2, "more than --threshold 5", "--threshold 5");
    res_free(&r);
    r = RUN("purge", "--db", db, "--threshold", "100");
    expect(r, 2, "--yes", "purge over the threshold");
    res_free(&r);
    ok(table_sum(db) == before, "refused over the threshold: nothing changed");

    r = RUN("requeue", "--db", db, "--state", "dead", "--reason", "bulk", "--yes", "--batch", "7");
    is_int(r.code, 0, "with --yes: done (%s)", oneline(r.err));
    ok(strstr(r.out, "requeued 101 messages") && strstr(r.out, "in 15 transactions"),
       "101 rows in 15 transactions of at most 7: %s", oneline(r.out));
    res_free(&r);
    is_int(q_int(db, "SELECT count(*) FROM outbox WHERE state = 0 AND replay_count = 1 AND attempts = 0"), 101,
           "every row requeued once");

    exec_sql(db, "UPDATE outbox SET state = 3");
    r = RUN("purge", "--db", db, "--yes", "--batch", "50", "--json");
    is_int(r.code, 0, "purge --yes --batch 50");
    ok(strstr(r.out, "\"deleted\":101") && strstr(r.out, "\"transactions\":3"), "purged 101 in 3: %s", oneline(r.out));
    res_free(&r);
    is_int(q_int(db, "SELECT count(*) FROM outbox"), 0, "table empty");
    free(db);
}

static void test_live_lease(void)
{
    char *db = fresh_db("lease.db");
    uint64_t before = table_sum(db);
    sqlite3 *h;
    res r;

    r = RUN("requeue", "--db", db, "--id", "s-live", "--reason", "stuck?");
    expect(r, 1, "live lease", "requeue of a row with a live lease, without --force");
    res_free(&r);
    ok(table_sum(db) == before, "live lease: nothing changed");

    r = RUN("requeue", "--db", db, "--state", "sending", "--reason", "stuck");
    is_int(r.code, 0, "requeue --state sending (%s)", oneline(r.err));
    ok(strstr(r.out, "requeued 1 message") && strstr(r.out, "skipped 1"),
       "expired one requeued, live one skipped and counted: %s", oneline(r.out));
    res_free(&r);
    is_int(q_int(db, "SELECT state * 1000 + lease_token FROM outbox WHERE id = 's-live'"), 1007,
           "s-live still sending with token 7");
    is_int(q_int(db, "SELECT count(*) FROM outbox WHERE id = 's-exp' AND state = 0 AND lease_token = 4 AND "
                     "lease_owner IS NULL AND lease_until IS NULL AND replay_count = 1"),
           1, "s-exp (expired lease) taken without --force, token 3 -> 4");

    r = RUN("requeue", "--db", db, "--id", "s-live", "--reason", "worker hung", "--force", "--json");
    is_int(r.code, 0, "--force takes the live lease (%s)", oneline(r.err));
    ok(strstr(r.out, "\"took_live_lease\":1") != NULL, "and says so: %s", oneline(r.out));
    res_free(&r);
    is_int(q_int(db, "SELECT count(*) FROM outbox WHERE id = 's-live' AND state = 0 AND lease_token = 8 AND "
                     "lease_owner IS NULL AND lease_until IS NULL AND attempts = 0 AND replay_count = 1"),
           1, "s-live: pending, lease cleared, lease_token 7 -> 8");

    /* The old holder wakes up and marks with its claim (w1, token 7): the
     * relay's fenced mark changes nothing. */
    h = open_plain(db);
    sqlite3_exec(h,
                 "UPDATE outbox SET state = 2, published_at = 1, stream_id = '9-9', lease_owner = NULL, "
                 "lease_until = NULL WHERE id = 's-live' AND state = 1 AND lease_owner = 'w1' AND lease_token = 7",
                 NULL, NULL, NULL);
    is_int(sqlite3_changes(h), 0, "old holder's late mark (owner w1, token 7) is refused");
    sqlite3_close_v2(h);
    is_int(q_int(db, "SELECT state FROM outbox WHERE id = 's-live'"), 0, "row stays pending");
    free(db);
}

static void test_purge(void)
{
    char *db = fresh_db("purge.db");
    uint64_t before = table_sum(db);
    res r;

    r = RUN("purge", "--db", db, "--state", "published");
    expect(r, 2, "only dead", "purge --state published");
    res_free(&r);
    r = RUN("purge", "--db", db, "--state", "dead", "--state", "pending");
    expect(r, 2, "--state pending is not allowed", "purge --state dead --state pending");
    res_free(&r);
    r = RUN("purge", "--db", db, "--id", "p1");
    expect(r, 1, "nothing matches", "purge of a published message by id");
    res_free(&r);
    r = RUN("purge", "--db", db, "--topic", "nosuch");
    expect(r, 1, "nothing matches", "purge with no matching dead row");
    res_free(&r);
    ok(table_sum(db) == before, "refused purges changed nothing");

    r = RUN("purge", "--db", db, "--topic", "billing");
    is_int(r.code, 0, "purge dead of topic billing (%s)", oneline(r.err));
    ok(strstr(r.out, "purged 1 dead message") != NULL, "%s", oneline(r.out));
    res_free(&r);
    is_int(q_int(db, "SELECT count(*) FROM outbox WHERE id = 'd3'"), 0, "d3 deleted");
    is_int(q_int(db, "SELECT count(*) FROM outbox"), 6, "every other row kept");

    r = RUN("purge", "--db", db, "--id-prefix", "d", "--state", "dead");
    is_int(r.code, 0, "purge --id-prefix d");
    res_free(&r);
    is_int(q_int(db, "SELECT count(*) FROM outbox WHERE state = 3"), 0, "d1, d2 deleted");
    is_int(q_int(db, "SELECT count(*) FROM outbox"), 4, "published, pending and sending rows all kept");
    free(db);
}

static void test_json(int py)
{
    char *db = fresh_db("json.db");
    res r;

    /* Quotes, backslashes, control characters, an escape sequence, invalid
     * UTF-8 and non-ASCII text in text columns. */
    exec_sql(db, "INSERT INTO outbox(id, topic, key, payload, state, last_error, lease_owner) VALUES"
                 " ('j1', 'odd', 'ключ', 'x', 3, CAST(X'71226222205c6e0a01091b5b33316dff41c3a9' AS TEXT), 'a\"b');");
    r = RUN("list", "--db", db, "--json", "--limit", "0");
    is_int(r.code, 0, "list --json");
    if (py) {
        is_int(py_check(r.out, "import json,sys\n"
                               "d = json.load(open(sys.argv[1], encoding='utf-8'))\n"
                               "assert isinstance(d, list) and len(d) == 8, len(d)\n"
                               "r = {x['id']: x for x in d}\n"
                               "j = r['j1']\n"
                               "assert j['last_error'] == 'q\"b\" \\\\n\\n\\x01\\t\\x1b[31m\\ufffdA\\u00e9', "
                               "repr(j['last_error'])\n"
                               "assert j['key'] == '\\u043a\\u043b\\u044e\\u0447', repr(j['key'])\n"
                               "assert j['lease_owner'] == 'a\"b'\n"
                               "assert j['state'] == 'dead' and j['state_code'] == 3\n"
                               "assert r['s-live']['lease_live'] is True and r['s-live']['lease_expires_in_ms'] > 0\n"
                               "assert r['s-exp']['lease_live'] is False\n"
                               "assert r['p1']['published_at'].endswith('Z') and r['p1']['stream_id'] == '1-0'\n"
                               "assert r['q1']['key'] is None and r['q1']['replay_count'] == 0\n"),
               0, "list --json parses; escapes (quotes, \\, controls, invalid UTF-8 -> U+FFFD) are right");
    }
    res_free(&r);

    r = RUN("list", "--db", db, "--json", "--topic", "nosuch");
    ok(r.code == 0 && strstr(r.out, "[]"), "list --json with nothing matching: [] and exit 0");
    res_free(&r);

    r = RUN("list", "--db", db);
    ok(r.code == 0 && !strchr(r.out, '\x1b'), "human table never prints an escape character");
    ok(strstr(r.out, "ID") && strstr(r.out, "STATE") && strstr(r.out, "LAST ERROR") && strstr(r.out, "REPLAYS"),
       "human table has headers");
    res_free(&r);

    r = RUN("stats", "--db", db, "--json");
    is_int(r.code, 0, "stats --json");
    if (py)
        is_int(py_check(r.out, "import json,sys\n"
                               "d = json.load(open(sys.argv[1]))\n"
                               "assert d['total'] == 8, d\n"
                               "assert d['by_state'] == {'pending': 1, 'sending': 2, 'published': 1, 'dead': 4}, d\n"
                               "assert d['dead'] == 4 and d['pending_due'] == 1 and d['pending_waiting'] == 0\n"
                               "assert d['leases_live'] == 1 and d['leases_expired'] == 1\n"
                               "assert d['oldest_due_pending']['id'] == 'q1' and "
                               "d['oldest_due_pending']['age_ms'] >= 0\n"
                               "t = {x['topic']: x for x in d['by_topic']}\n"
                               "assert t['orders']['dead'] == 2 and t['orders']['sending'] == 2, t\n"
                               "assert t['billing']['dead'] == 1 and t['billing']['total'] == 1\n"),
               0, "stats --json: counts by state, by topic x state, due, leases, oldest due pending");
    res_free(&r);
    r = RUN("stats", "--db", db);
    ok(r.code == 0 && strstr(r.out, "dead") && strstr(r.out, "oldest due pending") && strstr(r.out, "billing"),
       "stats human output");
    res_free(&r);

    r = RUN("requeue", "--db", db, "--state", "dead", "--reason", "json \"quoted\"\\", "--dry-run", "--json");
    is_int(r.code, 0, "requeue --dry-run --json");
    if (py)
        is_int(py_check(r.out, "import json,sys\n"
                               "d = json.load(open(sys.argv[1]))\n"
                               "assert d['dry_run'] is True and d['would_requeue'] == 4, d\n"
                               "assert sorted(x['id'] for x in d['rows']) == ['d1', 'd2', 'd3', 'j1']\n"
                               "assert all(x['action'] == 'requeue' for x in d['rows'])\n"
                               "assert d['reason'] == 'json \"quoted\"\\\\'\n"),
               0, "dry-run JSON parses and lists the rows with their action");
    res_free(&r);
    r = RUN("requeue", "--db", db, "--state", "dead", "--topic", "odd", "--reason", "r", "--json");
    is_int(r.code, 0, "requeue --json");
    if (py)
        is_int(py_check(r.out, "import json,sys\n"
                               "d = json.load(open(sys.argv[1]))\n"
                               "assert d['requeued'] == 1 and d['by_state']['dead'] == 1 and d['complete'], d\n"),
               0, "requeue JSON summary parses");
    res_free(&r);
    free(db);
}

static void test_show(int py)
{
    char *db = make_db("show.db");
    msgpack_sbuffer sb;
    msgpack_packer pk;
    sqlite3 *h;
    sqlite3_stmt *st;
    res r;

    /* Headers {"trace": "abc", "n": 5, "bin": <bin 01 02>}. */
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 3);
    msgpack_pack_str(&pk, 5);
    msgpack_pack_str_body(&pk, "trace", 5);
    msgpack_pack_str(&pk, 3);
    msgpack_pack_str_body(&pk, "abc", 3);
    msgpack_pack_str(&pk, 1);
    msgpack_pack_str_body(&pk, "n", 1);
    msgpack_pack_int(&pk, 5);
    msgpack_pack_str(&pk, 3);
    msgpack_pack_str_body(&pk, "bin", 3);
    msgpack_pack_bin(&pk, 2);
    msgpack_pack_bin_body(&pk, "\x01\x02", 2);
    h = open_plain(db);
    sqlite3_prepare_v2(h, "INSERT INTO outbox(id, topic, payload, headers) VALUES ('text-1', 'orders', ?1, ?2)", -1,
                       &st, NULL);
    sqlite3_bind_blob(st, 1, "h\xc3\xa9llo \"world\"\n", 15, SQLITE_STATIC);
    sqlite3_bind_blob(st, 2, sb.data, (int)sb.size, SQLITE_STATIC);
    ok(sqlite3_step(st) == SQLITE_DONE, "inserted a message with msgpack headers");
    sqlite3_finalize(st);
    sqlite3_close_v2(h);
    msgpack_sbuffer_destroy(&sb);
    exec_sql(db, "INSERT INTO outbox(id, topic, payload, headers, state) VALUES "
                 "('bin-1', 'orders', X'00ff80', X'81a1', 3)");

    r = RUN("show", "bin-1", "--db", db, "--json");
    is_int(r.code, 0, "show --json of a binary payload");
    ok(strstr(r.out, "\"payload_encoding\":\"base64\"") && strstr(r.out, "\"payload\":\"AP+A\""),
       "binary payload shown as base64 with its encoding: %s", oneline(r.out));
    if (py)
        is_int(py_check(r.out, "import json,sys,base64\n"
                               "d = json.load(open(sys.argv[1]))\n"
                               "assert base64.b64decode(d['payload']) == b'\\x00\\xff\\x80'\n"
                               "assert d['headers'] is None and d['headers_error'] == 'truncated msgpack', d\n"
                               "assert base64.b64decode(d['headers_base64']) == b'\\x81\\xa1'\n"
                               "assert d['payload_size'] == 3 and d['state'] == 'dead'\n"),
               0, "show JSON parses; undecodable headers reported with their bytes");
    res_free(&r);
    r = RUN("show", "bin-1", "--db", db);
    ok(r.code == 0 && strstr(r.out, "base64") && strstr(r.out, "AP+A") && strstr(r.out, "undecodable"),
       "human show of a binary payload: base64");
    res_free(&r);

    r = RUN("show", "text-1", "--db", db, "--json");
    is_int(r.code, 0, "show --json of a text payload");
    if (py)
        is_int(py_check(r.out, "import json,sys\n"
                               "d = json.load(open(sys.argv[1], encoding='utf-8'))\n"
                               "assert d['payload_encoding'] == 'utf8'\n"
                               "assert d['payload'] == 'h\\u00e9llo \"world\"\\n', repr(d['payload'])\n"
                               "assert d['headers'] == {'trace': 'abc', 'n': 5, 'bin': {'base64': 'AQI='}}, "
                               "d['headers']\n"),
               0, "text payload as utf8 text; headers decoded from msgpack to JSON");
    res_free(&r);
    r = RUN("show", "text-1", "--db", db);
    ok(r.code == 0 && strstr(r.out, "utf8") && strstr(r.out, "\"trace\":\"abc\""), "human show: text and headers");
    res_free(&r);

    r = RUN("show", "nope", "--db", db);
    expect(r, 1, "no message with id nope", "show of a missing id");
    res_free(&r);
    r = RUN("show", "--db", db);
    expect(r, 2, "show needs a message id", "show without an id");
    res_free(&r);
    free(db);
}

/* Does the list output name exactly the wanted ids among t-early, t-mid,
 * t-late? */
static int selects(res r, int early, int mid, int late)
{
    return r.code == 0 && !!strstr(r.out, "t-early") == early && !!strstr(r.out, "t-mid") == mid &&
           !!strstr(r.out, "t-late") == late;
}

static void test_time_filters(void)
{
    char *db = make_db("time.db");
    res r;

    /* 2026-11-29T09:00:00Z, 2026-11-29T10:30:00Z, 2026-11-30T00:00:00.500Z */
    exec_sql(db, "INSERT INTO outbox(id, topic, payload, created_at, state) VALUES"
                 " ('t-early', 'orders', 'x', 1795942800000, 3),"
                 " ('t-mid', 'orders', 'x', 1795948200000, 3),"
                 " ('t-late', 'orders', 'x', 1795996800500, 3)");
    r = RUN("list", "--db", db, "--since", "2026-11-29T10:00:00Z");
    ok(selects(r, 0, 1, 1), "--since ISO Z");
    res_free(&r);
    r = RUN("list", "--db", db, "--since", "2026-11-29T11:00:00+01:00");
    ok(selects(r, 0, 1, 1), "--since ISO with an offset");
    res_free(&r);
    r = RUN("list", "--db", db, "--until", "2026-11-29T12:00:00.000+02:00");
    ok(selects(r, 1, 0, 0), "--until ISO with milliseconds and an offset");
    res_free(&r);
    r = RUN("list", "--db", db, "--since", "2026-11-29", "--until", "2026-11-30");
    ok(selects(r, 1, 1, 0), "--since/--until dates (until exclusive)");
    res_free(&r);
    r = RUN("list", "--db", db, "--since", "2026-11-30T00:00:00.5Z");
    ok(selects(r, 0, 0, 1), "fractional seconds");
    res_free(&r);
    r = RUN("list", "--db", db, "--since", "1795946400000");
    ok(selects(r, 0, 1, 1), "--since unix ms");
    res_free(&r);
    r = RUN("list", "--db", db, "--until", "1795996800500");
    ok(selects(r, 1, 1, 0), "--until unix ms (exclusive)");
    res_free(&r);
    r = RUN("requeue", "--db", db, "--since", "2026-11-29T10:00:00Z", "--until", "1795996800000", "--reason", "t");
    is_int(r.code, 0, "requeue by a time window, ISO and unix ms mixed (%s)", oneline(r.err));
    {
        char *ids = q_str(db, "SELECT group_concat(id) FROM outbox WHERE state = 0");
        is_str(ids, "t-mid", "only the row inside the window was requeued");
        free(ids);
    }
    res_free(&r);
    free(db);
}

static void test_bad_input(void)
{
    char *db = fresh_db("bad.db"), *txt = th_path(dir, "text.db"), *plain = th_path(dir, "plain.db"),
         *missing = th_path(dir, "missing.db");
    uint64_t before = table_sum(db), txt_sum, plain_sum;
    sqlite3 *h;
    FILE *f;
    res r;
    struct stat sb;

    r = RUN("frobnicate", "--db", db);
    expect(r, 2, "unknown subcommand 'frobnicate'", "unknown subcommand");
    res_free(&r);
    r = RUN("list", "--db", db, "--bogus");
    expect(r, 2, "unknown option '--bogus'", "unknown option");
    res_free(&r);
    r = RUN("list", "--db", db, "-x");
    expect(r, 2, "unknown option '-x'", "unknown short option");
    res_free(&r);
    r = RUN("requeue", "--db", db, "--state", "zombie", "--reason", "r");
    expect(r, 2, "unknown state 'zombie'", "unknown state");
    res_free(&r);
    r = RUN("list", "--db", db, "--since", "yesterday");
    expect(r, 2, "--since: 'yesterday'", "bad time format");
    res_free(&r);
    r = RUN("list", "--db", db, "--until", "2026-02-30");
    expect(r, 2, "no such date", "impossible date");
    res_free(&r);
    r = RUN("list", "--db", db, "--since", "2026-11-29T10:00:00");
    expect(r, 2, "no time zone", "date-time without a zone");
    res_free(&r);
    r = RUN("requeue", "--db", db, "--since", "2026-11-29T12:00:00Z", "--until", "2026-11-29", "--reason", "r");
    expect(r, 2, "is not before --until", "--since after --until");
    res_free(&r);
    r = RUN("list", "--state", "dead");
    expect(r, 2, "--db PATH is required", "missing --db");
    res_free(&r);
    r = RUN("list", "--db");
    expect(r, 2, "--db needs a value", "--db without a value");
    res_free(&r);
    r = RUN("requeue", "--db", db, "--state", "dead");
    expect(r, 2, "requeue needs --reason", "requeue without --reason");
    res_free(&r);
    r = RUN("requeue", "--db", db, "--state", "dead", "--reason", "  ");
    expect(r, 2, "--reason: empty", "blank --reason");
    res_free(&r);
    r = RUN("list", "--db", db, "--limit", "ten");
    expect(r, 2, "--limit: 'ten' is not a whole number", "bad --limit");
    res_free(&r);
    r = RUN("requeue", "--db", db, "--reason", "r", "--batch", "0");
    expect(r, 2, "--batch: 0 is out of range", "--batch 0");
    res_free(&r);
    r = RUN("list", "--db", db, "--reason", "r");
    expect(r, 2, "--reason does not apply to list", "option of another subcommand");
    res_free(&r);
    r = RUN("list", "--db", db, "--topic", "a b");
    expect(r, 2, "--topic:", "invalid topic");
    res_free(&r);
    r = RUN("list", "--db", db, "--topic", "a", "--topic", "b");
    expect(r, 2, "--topic given twice", "repeated --topic");
    res_free(&r);
    r = RUN("requeue", "--db", db, "--topic", "nosuch", "--reason", "r");
    expect(r, 1, "nothing matches", "requeue with an empty selection");
    res_free(&r);
    r = RUN("requeue", "--db", db, "--id", "no-such-id", "--reason", "r");
    expect(r, 1, "no message with id no-such-id", "requeue of an unknown id warns about it");
    ok(strstr(r.err, "nothing matches") != NULL, "and says nothing matches");
    res_free(&r);
    r = RUN("purge", "--db", db, "--id-prefix", "zzz");
    expect(r, 1, "nothing matches", "purge with an empty selection");
    res_free(&r);
    ok(table_sum(db) == before, "none of the bad inputs changed the table");

    /* A file that is not a database. */
    f = fopen(txt, "w");
    fputs("this is a text file, not a database; it is long enough to have a header\n", f);
    fclose(f);
    txt_sum = file_sum(txt);
    r = RUN("list", "--db", txt);
    expect(r, 2, "not a usable SQLite database", "list on a text file");
    res_free(&r);
    r = RUN("requeue", "--db", txt, "--reason", "r");
    expect(r, 2, "not a usable SQLite database", "requeue on a text file");
    res_free(&r);
    ok(file_sum(txt) == txt_sum, "text file unchanged");

    /* A database without the outbox schema. */
    sqlite3_open(plain, &h);
    sqlite3_exec(h, "CREATE TABLE orders(id INTEGER PRIMARY KEY, total INTEGER)", NULL, NULL, NULL);
    sqlite3_close(h);
    plain_sum = file_sum(plain);
    r = RUN("stats", "--db", plain);
    expect(r, 2, "outbox-relay init", "stats on a database without the schema");
    res_free(&r);
    r = RUN("requeue", "--db", plain, "--reason", "r", "--state", "dead");
    expect(r, 2, "outbox-relay init", "requeue on a database without the schema");
    res_free(&r);
    r = RUN("purge", "--db", plain);
    expect(r, 2, "outbox-relay init", "purge on a database without the schema");
    res_free(&r);
    ok(file_sum(plain) == plain_sum, "that database is unchanged (not even switched to WAL)");
    is_int(q_int(plain, "SELECT count(*) FROM sqlite_master WHERE name = 'outbox'"), 0, "and has no outbox table");

    /* A file that does not exist is not created. */
    r = RUN("requeue", "--db", missing, "--reason", "r");
    expect(r, 2, "No such file", "requeue on a missing file");
    res_free(&r);
    ok(stat(missing, &sb) != 0 && errno == ENOENT, "the missing file was not created");

    free(db);
    free(txt);
    free(plain);
    free(missing);
}

/* Inspection never needs the write lock, and a requeue waits for it (busy
 * timeout 5 s) instead of failing at once; past that it fails, changing
 * nothing. */
static void test_locking(void)
{
    char *db = fresh_db("lock.db"), *out = th_path(dir, "lock.out"), *err = th_path(dir, "lock.err");
    uint64_t before = table_sum(db);
    sqlite3 *h = open_plain(db);
    int64_t slowest = 0;
    pid_t pid;
    res r;

    ok(sqlite3_exec(h, "BEGIN IMMEDIATE", NULL, NULL, NULL) == SQLITE_OK, "test holds the write lock");
    /* Each run is timed on its own: waiting for the lock takes the whole
     * 5 s busy timeout, while a run takes far less than 4 s, even with the
     * tool under valgrind. */
#define TIMED_RUN(...)                                                                             \
    ({                                                                                             \
        int64_t t0_ = th_now_ms();                                                                 \
        res r_ = RUN(__VA_ARGS__);                                                                 \
        if (th_now_ms() - t0_ > slowest)                                                           \
            slowest = th_now_ms() - t0_;                                                           \
        r_;                                                                                        \
    })
    r = TIMED_RUN("list", "--db", db);
    ok(r.code == 0 && strstr(r.out, "d1"), "list works while another connection holds the write lock");
    res_free(&r);
    r = TIMED_RUN("stats", "--db", db);
    is_int(r.code, 0, "stats too");
    res_free(&r);
    r = TIMED_RUN("show", "d1", "--db", db);
    is_int(r.code, 0, "show too");
    res_free(&r);
    r = TIMED_RUN("requeue", "--db", db, "--state", "dead", "--reason", "r", "--dry-run");
    is_int(r.code, 0, "requeue --dry-run too");
    res_free(&r);
#undef TIMED_RUN
    ok(slowest < 4000, "none of them waited for the lock (slowest %lld ms)", (long long)slowest);

    {
        char *argv[] = {tool, "requeue", "--db", db, "--state", "dead", "--reason", "after the lock", NULL};
        pid = th_spawn(argv, NULL, out, err);
    }
    th_sleep_ms(400);
    is_int(th_wait(pid, 0), -2, "requeue waits for the write lock");
    sqlite3_exec(h, "COMMIT", NULL, NULL, NULL);
    is_int(th_wait(pid, 10000), 0, "and completes once it is released");
    is_int(q_int(db, "SELECT count(*) FROM outbox WHERE replay_reason = 'after the lock'"), 3, "3 dead rows requeued");

    before = table_sum(db);
    sqlite3_exec(h, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    r = RUN("requeue", "--db", db, "--state", "published", "--reason", "r");
    expect(r, 1, "locked", "requeue while the lock is held for more than 5 s");
    res_free(&r);
    sqlite3_exec(h, "COMMIT", NULL, NULL, NULL);
    sqlite3_close_v2(h);
    ok(table_sum(db) == before, "the failed requeue changed nothing");
    free(db);
    free(out);
    free(err);
}

int main(void)
{
    int py;
    dir = th_tmpdir();
    tool = th_bin("tools/replay/outbox-replay");
    if (access(tool, X_OK) != 0)
        bail("%s not built", tool);
    py = has_python();
    if (!py)
        diag("python3 not found: JSON is checked by substring only");

    test_help();
    test_requeue_dead();
    test_requeue_published();
    test_dry_run();
    test_threshold_and_batches();
    test_live_lease();
    test_purge();
    test_json(py);
    test_show(py);
    test_time_filters();
    test_bad_input();
    test_locking();

    th_rmtree(dir);
    free(dir);
    free(tool);
    return tap_done();
}
