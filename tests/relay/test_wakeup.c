/*
 * test_wakeup.c: a commit from another process (here: another connection
 * of this test) wakes the relay without waiting for its fallback scan (left
 * at the default 1000 ms): the WAL file watch plus PRAGMA data_version. A
 * sanity check with a generous bound (300 ms), not a benchmark: a few rows
 * committed at different moments of the scan period, each must be in the
 * stream within the bound.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define SAMPLES 5
#define BOUND_MS 300

int main(void)
{
    th_redis srv;
    char *dir, *dbpath, *log, *text;
    redisContext *c;
    sqlite3 *db;
    pid_t pid;
    int64_t worst = 0;
    int i, rc, late = 0;

    rt_world_start(&srv, &dir, &dbpath, &db, &c);
    log = th_path(dir, "relay.log");

    pid = rt_relay_spawn(log, dbpath, srv.url, NULL);
    /* Connected and publishing (a row of another topic in its stream,
     * however long the start takes), then a while to settle into its idle
     * scan rhythm. */
    th_sql_exec(db, "INSERT INTO outbox(id, topic, payload) VALUES ('warm', 'warm', 'x')");
    for (int64_t t0 = th_now_ms(); th_xlen(c, "outbox:warm") < 1 && th_now_ms() - t0 < 20000 * th_slow();)
        th_sleep_ms(5);
    th_sleep_ms(1200);
    for (i = 0; i < SAMPLES; i++) {
        int64_t t0, dt;
        long long want = i + 1;
        th_sql_exec(db, "INSERT INTO outbox(id, topic, payload) VALUES ('wake-%d', 'wake', 'x')", i);
        t0 = th_now_ms();
        while (th_xlen(c, "outbox:wake") < want && th_now_ms() - t0 < 3000 * th_slow())
            th_sleep_ms(1);
        dt = th_now_ms() - t0;
        diag("row %d published after %lld ms", i, (long long)dt);
        if (dt > worst)
            worst = dt;
        late += dt > BOUND_MS * th_slow();
        /* Commit next at another point of the 1000 ms scan period. */
        th_sleep_ms(170 + 230 * i);
    }
    is_int(late, 0, "each row is published within %d ms of its commit (worst %lld ms)", BOUND_MS,
           (long long)worst);
    is_int(th_xlen(c, "outbox:wake"), SAMPLES, "all %d in the stream", SAMPLES);

    rc = th_stop(pid, SIGTERM, 15000);
    is_int(rc, 0, "SIGTERM: the relay exits 0");
    text = th_slurp(log);
    if (rc != 0 || late)
        th_diag_tail("relay", text, 10);
    free(text);

    free(log);
    rt_world_end(&srv, dir, dbpath, db, c);
    return tap_done();
}
