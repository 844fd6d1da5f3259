/*
 * test_lock_gap.c: an application writer keeps committing while the relay
 * drains a large backlog. The writer is another connection with SQLite's own
 * busy timeout (it sleeps 1, 2, 5 ... 100 ms between tries and gives up
 * after it): the relay leaves the write lock free often enough that none of
 * its commits fails, also before the relay has seen any commit of another
 * connection (its gaps are then rare: sched.c, LONE_BUDGET_NS), and every
 * row, the backlog's and the writer's, is published once, in order.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define BACKLOG 200000

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* One commit of the writer: a row of its own. SQLite's return code. */
static int write_row(sqlite3 *w, long i)
{
    char sql[160];
    snprintf(sql, sizeof sql, "INSERT INTO outbox(id, topic, key, payload) VALUES ('w-%ld', 'app', 'k', x'00')", i);
    return sqlite3_exec(w, sql, NULL, NULL, NULL);
}

int main(void)
{
    th_redis srv;
    char *dir, *dbpath, errpath[4200];
    sqlite3 *db, *w;
    redisContext *c;
    rt_audit a, aw;
    pid_t pid;
    int status = -2, exited, busy = 0, rc;
    long during = 0, after = 0, i = 0;
    int64_t t0, worst = 0, first_wait = -1;

    rt_world_start(&srv, &dir, &dbpath, &db, &c);
    rt_insert_rows(db, "m", 0, BACKLOG, "bulk", 100);

    /* The writer: SQLite's own busy handler, as a program in any language
     * has it, not outbox_db_open's short naps. */
    if (sqlite3_open_v2(dbpath, &w, SQLITE_OPEN_READWRITE, NULL) != SQLITE_OK)
        bail("cannot open the writer's connection");
    sqlite3_busy_timeout(w, 5000);
    sqlite3_exec(w, "PRAGMA journal_mode=WAL", NULL, NULL, NULL);

    snprintf(errpath, sizeof errpath, "%s/relay.err", dir);
    pid = rt_relay_spawn(errpath, dbpath, srv.url, "--drain", NULL);
    /* Starts once the relay publishes: its units hold the lock from then. */
    t0 = mono_ms();
    while (th_xlen(c, "outbox:bulk") == 0 && mono_ms() - t0 < 30000 * th_slow())
        usleep(1000);
    ok(th_xlen(c, "outbox:bulk") > 0, "the relay publishes the backlog");

    /* One row a transaction, about every millisecond, until the relay has
     * drained and exited (and a few after). */
    for (exited = 0; !exited || after < 20; i++) {
        int64_t s = mono_ms(), took;
        if (!exited && (status = th_wait(pid, 0)) != -2)
            exited = 1;
        rc = write_row(w, i);
        took = mono_ms() - s;
        if (rc != SQLITE_OK) {
            busy++;
            diag("writer: commit %ld failed after %lld ms: %s", i, (long long)took, sqlite3_errmsg(w));
            continue;
        }
        if (first_wait < 0)
            first_wait = took;
        if (took > worst)
            worst = took;
        if (exited)
            after++;
        else
            during++;
        usleep(1000);
    }
    diag("writer: %ld commits while the relay drained, the first waited %lld ms, the longest %lld ms", during,
         (long long)first_wait, (long long)worst);
    is_int(status, 0, "the drain ends with status 0");
    is_int(busy, 0, "no commit of the writer failed for the lock (busy timeout 5000 ms)");
    ok(during > 0, "the writer committed while the relay was draining");

    /* The writer's rows committed after the drain are published by a
     * second drain. */
    status = rt_relay_run(60000 * th_slow(), NULL, dbpath, srv.url, "--drain", NULL);
    is_int(status, 0, "a second drain publishes the writer's last rows");
    a = rt_audit_topic(db, c, "outbox:", "bulk");
    aw = rt_audit_topic(db, c, "outbox:", "app");
    ok(a.rows == BACKLOG && a.missing == 0 && a.dups == 0, "the backlog: %ld rows, %ld missing, %ld duplicates",
       a.rows, a.missing, a.dups);
    ok(aw.rows == during + after && aw.missing == 0 && aw.dups == 0,
       "the writer's rows: %ld of %ld, %ld missing, %ld duplicates", aw.rows, during + after, aw.missing, aw.dups);
    is_int(a.order_violations + aw.order_violations, 0, "per-key order held");

    sqlite3_close(w);
    rt_world_end(&srv, dir, dbpath, db, c);
    return tap_done();
}
