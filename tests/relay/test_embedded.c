/*
 * test_embedded.c: the relay embedded in an application. outbox-demo
 * --embedded writes its orders one per loop turn on its own connection while
 * the relay runs on the same libuv loop, woken by each commit
 * (outbox_relay_attach), and exits 0 once every message is published.
 * Run a few times: the relay may find nothing to do between two orders.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define ORDERS 500
#define RUNS 3

int main(void)
{
    th_redis srv;
    char *dir, *demo;
    redisContext *c;
    int run;

    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    dir = th_tmpdir();
    demo = th_bin("tools/demo/outbox-demo");
    c = th_redis_client(&srv);

    for (run = 1; run <= RUNS; run++) {
        char name[32], orders[16], *dbpath, *out = NULL, *err = NULL;
        sqlite3 *db;
        rt_audit a;
        int64_t t0 = th_now_ms();
        int rc;

        snprintf(name, sizeof name, "app%d.db", run);
        dbpath = th_path(dir, name);
        snprintf(orders, sizeof orders, "%d", ORDERS);
        {
            char *argv[] = {demo, "--db", dbpath, "--orders", orders, "--embedded", "--redis", srv.url, NULL};
            rc = th_run(argv, NULL, &out, &err, 30000 * th_slow());
        }
        is_int(rc, 0, "run %d: outbox-demo --embedded exits 0", run);
        diag("run %d: %lld ms", run, (long long)(th_now_ms() - t0));
        if (rc != 0) {
            th_diag_tail("demo stdout", out, 5);
            th_diag_tail("demo stderr", err, 15);
        }
        free(out);
        free(err);

        db = rt_open(dbpath);
        a = rt_audit_topic(db, c, "outbox:", "orders");
        is_int(a.rows, ORDERS, "run %d: %d messages in the database", run, ORDERS);
        is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2"), ORDERS, "run %d: all %d published",
               run, ORDERS);
        is_int(a.missing, 0, "run %d: each one is in the stream", run);
        is_int(a.foreign + a.dups, 0, "run %d: and nothing else", run);
        is_int(a.order_violations, 0, "run %d: per customer in commit order", run);
        sqlite3_close_v2(db);
        /* The stream is shared by the runs; the next database starts afresh. */
        freeReplyObject(th_cmd(c, "DEL outbox:orders"));
        free(dbpath);
    }

    redisFree(c);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(demo);
    free(dir);
    return tap_done();
}
