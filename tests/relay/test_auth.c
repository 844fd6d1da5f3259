/*
 * test_auth.c: Redis with requirepass and an ACL user, over TCP.
 *   redis://:pass@127.0.0.1:PORT/0        the default user's password;
 *   redis://alice:pw@127.0.0.1:PORT/2     an ACL user, database 2 (the
 *                                         stream must be in db 2, not 0);
 *   redis://:N0tTheOne@127.0.0.1:PORT/0   refused: the relay logs the AUTH
 *                                         error, keeps running, publishes
 *                                         nothing and claims nothing.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define N 500

static long long xlen_in(redisContext *c, int dbn, const char *stream)
{
    long long n;
    freeReplyObject(th_cmd(c, "SELECT %d", dbn));
    n = th_xlen(c, stream);
    freeReplyObject(th_cmd(c, "SELECT 0"));
    return n;
}

int main(void)
{
    th_redis srv;
    char *dir, *db_a, *db_b, *db_c, *log, *text, *err = NULL, url[256];
    redisContext *c;
    sqlite3 *db;
    pid_t pid;
    int rc;

    if (th_redis_start(&srv, 1, "requirepass pass\nuser alice on >pw ~* &* +@all\n") != 0)
        skip_all("redis-server not available");
    dir = th_tmpdir();
    db_a = rt_make_db(dir, "a.db");
    db_b = rt_make_db(dir, "b.db");
    db_c = rt_make_db(dir, "c.db");
    log = th_path(dir, "relay.log");
    db = rt_open(db_a);
    rt_insert_rows(db, "a", 0, N, "auth.a", 0);
    sqlite3_close_v2(db);
    db = rt_open(db_b);
    rt_insert_rows(db, "b", 0, N, "auth.b", 3);
    sqlite3_close_v2(db);
    db = rt_open(db_c);
    rt_insert_rows(db, "c", 0, N, "auth.c", 0);
    sqlite3_close_v2(db);
    c = th_redis_client(&srv);

    /* requirepass */
    snprintf(url, sizeof url, "redis://:pass@127.0.0.1:%d/0", srv.port);
    rc = rt_relay_run(30000 * th_slow(), &err, db_a, url, "--drain", NULL);
    is_int(rc, 0, "requirepass: --drain exits 0");
    if (rc != 0)
        th_diag_tail("relay", err, 10);
    ok(strstr(err, "pass@") == NULL && strstr(err, ":pass") == NULL, "requirepass: the password is not logged");
    free(err);
    is_int(xlen_in(c, 0, "outbox:auth.a"), N, "requirepass: %d entries in db 0", N);

    /* ACL user, db 2 */
    snprintf(url, sizeof url, "redis://alice:pw@127.0.0.1:%d/2", srv.port);
    rc = rt_relay_run(30000 * th_slow(), &err, db_b, url, "--drain", NULL);
    is_int(rc, 0, "acl user: --drain exits 0");
    if (rc != 0)
        th_diag_tail("relay", err, 10);
    ok(strstr(err, ":pw@") == NULL, "acl user: the password is not logged");
    free(err);
    is_int(xlen_in(c, 2, "outbox:auth.b"), N, "acl user: %d entries in db 2", N);
    is_int(xlen_in(c, 0, "outbox:auth.b"), 0, "acl user: nothing in db 0");
    db = rt_open(db_b);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2"), N, "acl user: every row published");
    sqlite3_close_v2(db);

    /* wrong password */
    snprintf(url, sizeof url, "redis://:N0tTheOne@127.0.0.1:%d/0", srv.port);
    pid = rt_relay_spawn(log, db_c, url, NULL);
    /* Until its first AUTH was refused (however long the start takes),
     * and a while after it. */
    for (int64_t t0 = th_now_ms(); th_now_ms() - t0 < 20000 * th_slow();) {
        text = th_slurp(log);
        if (strstr(text, "redis refused the credentials")) {
            free(text);
            break;
        }
        free(text);
        th_sleep_ms(20);
    }
    th_sleep_ms(500);
    is_int(th_wait(pid, 0), -2, "wrong password: the relay keeps running (and retrying)");
    is_int(th_stop(pid, SIGTERM, 15000), 0, "wrong password: SIGTERM exits 0");
    text = th_slurp(log);
    ok(strstr(text, "EAUTH") != NULL && strstr(text, "AUTH") != NULL, "wrong password: the AUTH error is logged");
    ok(strstr(text, "WRONGPASS") != NULL, "wrong password: with Redis' reason");
    ok(strstr(text, "redis refused the credentials") != NULL && strstr(text, "unreachable") == NULL,
       "wrong password: logged as refused credentials, not as an outage");
    ok(strstr(text, "N0tTheOne") == NULL, "wrong password: the password itself is not logged");
    th_diag_tail("relay", text, 4);
    free(text);
    for (int dbn = 0; dbn < 3; dbn++)
        is_int(xlen_in(c, dbn, "outbox:auth.c"), 0, "wrong password: nothing published in db %d", dbn);
    db = rt_open(db_c);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 0 AND attempts = 0"), N,
           "wrong password: nothing claimed");
    sqlite3_close_v2(db);

    redisFree(c);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(log);
    free(db_a);
    free(db_b);
    free(db_c);
    free(dir);
    return tap_done();
}
