/*
 * test_two_relays.c: two relay processes share one database file and drain
 * a 20,000-message backlog together. Leases keep them apart: every message
 * is published, no row is left pending or sending, each row was marked by
 * exactly one of them (their published counts add up), per-key order holds,
 * and without crashes there are no duplicates.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define N 20000

/* "published=N" from the relay's stop line, -1 if absent. */
static long stopped_published(const char *text)
{
    const char *p = strstr(text, "msg=stopped published=");
    return p ? strtol(p + strlen("msg=stopped published="), NULL, 10) : -1;
}

int main(void)
{
    th_redis srv;
    char *dir, *dbpath, *log1, *log2, *t1, *t2;
    redisContext *c;
    sqlite3 *db;
    pid_t p1, p2;
    int rc1, rc2;
    long n1, n2;
    int64_t t0;
    rt_audit a, b;

    rt_world_start(&srv, &dir, &dbpath, &db, &c);
    log1 = th_path(dir, "relay1.log");
    log2 = th_path(dir, "relay2.log");
    rt_insert_rows(db, "u", 0, N / 2, "two.u", 0);
    rt_insert_rows(db, "k", 0, N / 2, "two.k", 50);

    t0 = th_now_ms();
    p1 = rt_relay_spawn(log1, dbpath, srv.url, "--drain", "--worker-id", "w1", "--batch", "256", "--inflight",
                        "2048", NULL);
    p2 = rt_relay_spawn(log2, dbpath, srv.url, "--drain", "--worker-id", "w2", "--batch", "256", "--inflight",
                        "2048", NULL);
    rc1 = th_wait(p1, 60000 * th_slow());
    rc2 = th_wait(p2, 60000 * th_slow());
    diag("both relays done in %lld ms", (long long)(th_now_ms() - t0));
    is_int(rc1, 0, "relay w1 drained and exited 0");
    is_int(rc2, 0, "relay w2 drained and exited 0");
    if (rc1 == -2)
        th_stop(p1, SIGKILL, 5000);
    if (rc2 == -2)
        th_stop(p2, SIGKILL, 5000);

    t1 = th_slurp(log1);
    t2 = th_slurp(log2);
    n1 = stopped_published(t1);
    n2 = stopped_published(t2);
    diag("w1 published %ld, w2 published %ld", n1, n2);
    is_int(n1 + n2, N, "their published counts add up to %d (each row marked by one of them)", N);
    is_int(rt_count_substr(t1, "mark refused") + rt_count_substr(t2, "mark refused"), 0, "no mark was fenced");
    if (rc1 != 0)
        th_diag_tail("w1", t1, 10);
    if (rc2 != 0)
        th_diag_tail("w2", t2, 10);
    free(t1);
    free(t2);

    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state IN (0, 1)"), 0, "no row left in state 0 or 1");
    a = rt_audit_topic(db, c, "outbox:", "two.u");
    b = rt_audit_topic(db, c, "outbox:", "two.k");
    is_int(a.missing + b.missing, 0, "every message is in its stream");
    is_int(a.unpublished + b.unpublished, 0, "every row is published");
    is_int(a.foreign + b.foreign, 0, "no entry without a row");
    is_int(b.order_violations, 0, "per key, first appearances follow commit order across both relays");
    diag("%ld duplicate entries", a.dups + b.dups);
    is_int(a.dups + b.dups, 0, "no duplicates without crashes");

    free(log1);
    free(log2);
    rt_world_end(&srv, dir, dbpath, db, c);
    return tap_done();
}
