/*
 * test_sentinel_invalid.c: bad Sentinel input, refused before anything
 * connects (docs/BAD_INPUT.md): outbox-relay and outbox-consume exit 2
 * naming the problem of a redis-sentinel:// URL; the C API refuses the
 * sentinels' credentials without a Sentinel URL.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

typedef struct bad_url {
    const char *url, *message;
} bad_url;

static const bad_url bad[] = {
    {"redis-sentinels://h#m", "bad scheme 'redis-sentinels'"},
    {"redis-sentinel://127.0.0.1:26379", "missing master name"},
    {"redis-sentinel://127.0.0.1:26379#", "missing master name"},
    {"redis-sentinel://#mymaster", "empty sentinel list"},
    {"redis-sentinel://a,,b#mymaster", "empty host in the sentinel list"},
    {"redis-sentinel://127.0.0.1:99999#mymaster", "port 99999 out of range 1..65535"},
    {"redis-sentinel://127.0.0.1:x#mymaster", "port 'x' is not a number"},
    {"redis-sentinel://h/x#mymaster", "database 'x' is not a number"},
};

static int handler(outbox_consumer *c, const outbox_delivery *dv, void *data)
{
    (void)data;
    outbox_consumer_done(c, dv, 0);
    return 0;
}

static void test_cli(const char *dbpath)
{
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *err = NULL, *consume = th_bin("tools/consume/outbox-consume");
        char *cargv[] = {consume, "--redis", (char *)bad[i].url, "--stream", "s", "--group", "g", "--print", NULL};
        int rc = rt_relay_run(20000, &err, dbpath, bad[i].url, "--drain", NULL);
        is_int(rc, 2, "outbox-relay --redis '%s': exit 2", bad[i].url);
        ok(err && strstr(err, bad[i].message), "  names it: %s", bad[i].message);
        if (err && !strstr(err, bad[i].message))
            th_diag_tail("stderr", err, 5);
        free(err);
        err = NULL;
        rc = th_run(cargv, NULL, NULL, &err, 20000);
        is_int(rc, 2, "outbox-consume --redis '%s': exit 2", bad[i].url);
        ok(err && strstr(err, bad[i].message), "  names it");
        free(err);
        free(consume);
    }
}

static void test_api(const char *dbpath)
{
    uv_loop_t loop;
    outbox_relay_settings rs;
    outbox_consumer_settings cs;
    outbox_dedup_settings ds;
    outbox_relay *r = NULL;
    outbox_consumer *c = NULL;
    outbox_dedup *d = NULL;
    char err[300];

    uv_loop_init(&loop);
    outbox_relay_defaults(&rs);
    rs.db_path = dbpath;
    rs.redis_url = "redis://127.0.0.1:6379";
    rs.sentinel_password = "pw";
    is_int(outbox_relay_create(&r, &loop, &rs, err, sizeof err), OUTBOX_EINVAL,
           "relay: sentinel_password with a redis:// URL");
    ok(strstr(err, "sentinel_password needs a redis-sentinel:// URL") != NULL, "  err: %s", err);
    rs.sentinel_password = NULL;
    rs.sentinel_user = "sam";
    rs.redis_url = "unix:///tmp/x.sock";
    is_int(outbox_relay_create(&r, &loop, &rs, err, sizeof err), OUTBOX_EINVAL, "relay: sentinel_user with unix://");
    ok(strstr(err, "sentinel_user needs a redis-sentinel:// URL") != NULL, "  err: %s", err);
    rs.redis_url = "redis-sentinel://127.0.0.1:1#mymaster";
    rs.sentinel_password = "pw";
    is_int(outbox_relay_create(&r, &loop, &rs, err, sizeof err), 0, "relay: both with a Sentinel URL");
    outbox_relay_destroy(r);

    outbox_consumer_defaults(&cs);
    cs.redis_url = "redis://127.0.0.1:6379";
    cs.stream = "s";
    cs.group = "g";
    cs.handler = handler;
    cs.sentinel_password = "pw";
    is_int(outbox_consumer_create(&c, &loop, &cs, err, sizeof err), OUTBOX_EINVAL,
           "consumer: sentinel_password with a redis:// URL");
    ok(strstr(err, "sentinel_password needs a redis-sentinel:// URL") != NULL, "  err: %s", err);
    cs.redis_url = "redis-sentinel://127.0.0.1:1#mymaster";
    is_int(outbox_consumer_create(&c, &loop, &cs, err, sizeof err), 0, "consumer: with a Sentinel URL");
    outbox_consumer_destroy(c);

    outbox_dedup_defaults(&ds);
    ds.redis_url = "redis://127.0.0.1:6379";
    ds.sentinel_user = "sam";
    is_int(outbox_dedup_create(&d, &loop, &ds, err, sizeof err), OUTBOX_EINVAL,
           "dedup: sentinel_user with a redis:// URL");
    ok(strstr(err, "sentinel_user needs a redis-sentinel:// URL") != NULL, "  err: %s", err);
    is_int(uv_run(&loop, UV_RUN_DEFAULT), 0, "nothing left on the loop");
    is_int(uv_loop_close(&loop), 0, "the loop closes");
}

int main(void)
{
    char *dir = th_tmpdir(), *dbpath = rt_make_db(dir, "app.db");
    test_cli(dbpath);
    test_api(dbpath);
    free(dbpath);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
