/*
 * rp.c: see rp.h.
 */
#include "rp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "outbox.h"

char *rp_tool, *rp_dir;

void rp_setup(void)
{
    rp_dir = th_tmpdir();
    rp_tool = th_bin("tools/replay/outbox-replay");
    if (access(rp_tool, X_OK) != 0)
        bail("%s not built", rp_tool);
}

void rp_teardown(void)
{
    th_rmtree(rp_dir);
    free(rp_dir);
    free(rp_tool);
}

rp_res rp_run(char *const *argv)
{
    rp_res r;
    r.code = th_run(argv, NULL, &r.out, &r.err, 30000);
    if (!r.out)
        r.out = strdup("");
    if (!r.err)
        r.err = strdup("");
    return r;
}

void rp_res_free(rp_res *r)
{
    free(r->out);
    free(r->err);
}

/* ---- databases ----------------------------------------------------------- */

char *rp_make_db(const char *name)
{
    char *p = th_path(rp_dir, name), err[512];
    sqlite3 *db;
    if (outbox_db_open(p, OUTBOX_OPEN_CREATE, &db, err, sizeof err) != 0 || outbox_schema_apply(db, err, sizeof err) != 0)
        bail("cannot create %s: %s", p, err);
    sqlite3_close_v2(db);
    return p;
}

sqlite3 *rp_open_plain(const char *path)
{
    sqlite3 *db;
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READWRITE, NULL) != SQLITE_OK)
        bail("cannot open %s", path);
    sqlite3_busy_timeout(db, 5000);
    return db;
}

void rp_exec_sql(const char *path, const char *sql)
{
    sqlite3 *db = rp_open_plain(path);
    char *msg = NULL;
    if (sqlite3_exec(db, sql, NULL, NULL, &msg) != SQLITE_OK)
        bail("SQL failed on %s: %s\n%s", path, msg ? msg : "?", sql);
    sqlite3_close_v2(db);
}

long long rp_q_int(const char *path, const char *sql)
{
    sqlite3 *db = rp_open_plain(path);
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

char *rp_q_str(const char *path, const char *sql)
{
    sqlite3 *db = rp_open_plain(path);
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

uint64_t rp_table_sum(const char *path)
{
    sqlite3 *db = rp_open_plain(path);
    sqlite3_stmt *st;
    uint64_t h = 14695981039346656037ULL;
    if (sqlite3_prepare_v2(db, "SELECT * FROM outbox_messages ORDER BY seq", -1, &st, NULL) != SQLITE_OK)
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

uint64_t rp_file_sum(const char *path)
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

void rp_fixture(const char *path)
{
    rp_exec_sql(path,
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

char *rp_fresh_db(const char *name)
{
    char *p = rp_make_db(name);
    rp_fixture(p);
    return p;
}

const char *rp_oneline(const char *s)
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

int rp_py_check(const char *text, const char *script)
{
    char *path = th_path(rp_dir, "check.json");
    FILE *f = fopen(path, "w");
    char *argv[] = {"python3", "-c", (char *)script, path, NULL};
    rp_res r;
    if (!f)
        bail("cannot write %s", path);
    fputs(text, f);
    fclose(f);
    r = rp_run(argv);
    if (r.code != 0)
        diag("python3: %s %s", rp_oneline(r.out), rp_oneline(r.err));
    free(path);
    rp_res_free(&r);
    return r.code;
}

int rp_has_python(void)
{
    char *argv[] = {"python3", "-c", "import json", NULL};
    rp_res r = rp_run(argv);
    int ok_ = r.code == 0;
    rp_res_free(&r);
    return ok_;
}
