/*
 * test_crash_loop.c: the relay is killed with SIGKILL at random moments,
 * at least 20 times, while a writer keeps committing orders (outbox-demo,
 * with some transactions rolled back), and restarted after each kill with a
 * short lease so that takeovers happen. A final --drain run finishes.
 * Then:
 *   - every committed message (from the database) is in its stream at least
 *     once, and every order has its message (and only those);
 *   - no stream entry lacks a committed row (nothing from a rollback);
 *   - no row is left pending or sending;
 *   - per key (customer), first appearances follow commit order;
 *   - the duplicate count is reported.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define KILLS 24
#define BUDGET_MS 30000

/* A 1 s lease, so that rows left by a killed relay are taken over soon (the
 * reply timeout must stay below the lease). */
static pid_t start_relay(const char *log, const char *dbpath, const char *url)
{
    return rt_relay_spawn(log, dbpath, url, "--lease-ms", "1000", "--reply-timeout-ms", "500", "--scan-interval-ms",
                          "100", "--backoff-min-ms", "50", "--backoff-max-ms", "200", "--batch", "64", NULL);
}

static pid_t start_writer(const char *dbpath, const char *log)
{
    char *demo = th_bin("tools/demo/outbox-demo");
    char *argv[] = {demo, "--db", (char *)dbpath, "--orders", "150", "--fail-every", "9", NULL};
    pid_t pid = th_spawn(argv, NULL, log, log);
    if (pid < 0)
        bail("cannot start %s", demo);
    free(demo);
    return pid;
}

int main(void)
{
    th_redis srv;
    char *dir, *dbpath, *rlog, *wlog, *text, *err = NULL;
    redisContext *c;
    sqlite3 *db;
    pid_t relay, writer;
    int kills = 0, writer_runs = 0, writer_failures = 0, early_exits = 0, rc;
    int64_t t0, deadline;
    rt_audit a;
    unsigned seed = (unsigned)time(NULL);

    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    srand(seed);
    diag("random seed %u", seed);
    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "app.db");
    rlog = th_path(dir, "relay.log");
    wlog = th_path(dir, "writer.log");

    t0 = th_now_ms();
    deadline = t0 + BUDGET_MS * th_slow();
    writer = start_writer(dbpath, wlog);
    relay = start_relay(rlog, dbpath, srv.url);
    while (kills < KILLS && th_now_ms() < deadline) {
        int wait_ms = 30 + rand() % 400;
        int64_t until = th_now_ms() + wait_ms;
        /* Keep the writer going while the relay lives. */
        while (th_now_ms() < until) {
            rc = th_wait(writer, 0);
            if (rc != -2) {
                writer_runs++;
                writer_failures += rc != 0;
                writer = start_writer(dbpath, wlog);
            }
            th_sleep_ms(5);
        }
        kill(relay, SIGKILL);
        rc = th_wait(relay, 5000);
        if (rc == 128 + SIGKILL)
            kills++;
        else {
            early_exits++;
            diag("relay ended with %d before the kill", rc);
            text = th_slurp(rlog);
            th_diag_tail("relay", text, 2);
            free(text);
        }
        relay = start_relay(rlog, dbpath, srv.url);
    }
    /* The last relay runs until the writer's current run is done. */
    rc = th_wait(writer, 30000 * th_slow());
    writer_runs++;
    writer_failures += rc != 0;
    is_int(th_stop(relay, SIGKILL, 5000), 128 + SIGKILL, "the last relay is killed too");
    kills++;
    ok(kills >= 20, "the relay was killed %d times", kills);
    is_int(early_exits, 0, "no relay exited by itself (e.g. on a database locked at start-up)");
    is_int(writer_failures, 0, "the writer committed %d runs without an error", writer_runs);

    db = rt_open(dbpath);
    diag("before the final drain: %lld rows, %lld pending, %lld sending, %lld published",
         (long long)th_sql_int(db, "SELECT count(*) FROM outbox_messages"),
         (long long)th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 0"),
         (long long)th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 1"),
         (long long)th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2"));
    rc = rt_relay_run(30000 * th_slow(), &err, dbpath, srv.url, "--drain", "--lease-ms", "1000",
                      "--reply-timeout-ms", "500", NULL);
    is_int(rc, 0, "the final --drain run exits 0");
    if (rc != 0)
        th_diag_tail("relay", err, 20);
    free(err);
    diag("%d kills and %d writer runs in %lld ms", kills, writer_runs, (long long)(th_now_ms() - t0));

    c = th_redis_client(&srv);
    a = rt_audit_topic(db, c, "outbox:", "orders");
    diag("%ld committed messages, %ld stream entries", a.rows, a.entries);
    ok(a.rows > 0, "messages were committed");
    is_int(a.missing, 0, "every committed message is in the stream at least once");
    is_int(a.foreign, 0, "no stream entry lacks a committed row");
    is_int(a.unpublished, 0, "every row ends published");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state IN (0, 1)"), 0, "no row stuck pending or sending");
    is_int(a.order_violations, 0, "per customer, first appearances follow commit order");
    is_int(th_sql_int(db, "SELECT count(*) FROM orders"), a.rows, "each committed order has its message");
    diag("%ld duplicate entries", a.dups);
    text = th_slurp(rlog);
    diag("%d takeovers of expired leases logged", rt_count_substr(text, "took over an expired lease"));
    free(text);

    redisFree(c);
    sqlite3_close_v2(db);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(rlog);
    free(wlog);
    free(dbpath);
    free(dir);
    return tap_done();
}
