/*
 * test_e2e.c: the whole path with the shipped binaries. outbox-demo writes
 * 300 orders (business row and outbox row in one transaction each),
 * outbox-relay --drain publishes them, outbox-consume --print --drain prints
 * each message exactly once: the ids printed are exactly the outbox table's.
 * A second group (another service) gets every message once as well.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sqlite3.h>

#include "ct.h"
#include "harness.h"
#include "outbox.h"
#include "tap.h"

#define ORDERS 300

static th_redis srv;
static redisContext *rc;
static char *dir;

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The "id" values of JSON lines, sorted; *n gets their count. */
static char **ids_of(const char *out, size_t *n)
{
    size_t cap = (size_t)th_count_lines(out) + 1, k = 0;
    char **ids = calloc(cap, sizeof *ids);
    const char *p = out;
    if (!ids)
        bail("out of memory");
    while ((p = strstr(p, "{\"id\":\"")) != NULL && k < cap) {
        const char *s = p + 7, *e = strchr(s, '"');
        if (!e)
            break;
        ids[k++] = strndup(s, (size_t)(e - s));
        p = e;
    }
    qsort(ids, k, sizeof *ids, cmp_str);
    *n = k;
    return ids;
}

static void free_ids(char **ids, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(ids[i]);
    free(ids);
}

int main(void)
{
    char *db = NULL, *demo, *relay, *out, *err;
    char **table_ids = NULL, **got;
    size_t ntable = 0, ngot;
    sqlite3 *h;
    sqlite3_stmt *st;
    int code, same, dups = 0;

    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    rc = th_redis_client(&srv);
    dir = th_tmpdir();
    db = th_path(dir, "shop.db");
    demo = th_bin("tools/demo/outbox-demo");
    relay = th_bin("tools/relay/outbox-relay");

    {
        char *argv[] = {demo, "--db", db, "--orders", "300", NULL};
        code = th_run(argv, NULL, NULL, &err, 60000 * th_slow());
        is_int(code, 0, "outbox-demo wrote %d orders", ORDERS);
        if (code != 0)
            th_diag_tail("demo", err, INT_MAX);
        free(err);
    }
    if (sqlite3_open_v2(db, &h, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK)
        bail("open %s", db);
    table_ids = calloc(ORDERS + 1, sizeof *table_ids);
    if (!table_ids || sqlite3_prepare_v2(h, "SELECT id FROM outbox_messages ORDER BY id", -1, &st, NULL) != SQLITE_OK)
        bail("select ids");
    while (sqlite3_step(st) == SQLITE_ROW && ntable < ORDERS + 1)
        table_ids[ntable++] = strdup((const char *)sqlite3_column_text(st, 0));
    sqlite3_finalize(st);
    sqlite3_close_v2(h);
    is_int(ntable, ORDERS, "the outbox table holds %d rows", ORDERS);
    qsort(table_ids, ntable, sizeof *table_ids, cmp_str);

    {
        char *argv[] = {relay, "--db", db, "--redis", srv.url, "--drain", NULL};
        code = th_run(argv, NULL, NULL, &err, 60000 * th_slow());
        is_int(code, 0, "outbox-relay --drain published and exited 0");
        if (code != 0)
            th_diag_tail("relay", err, INT_MAX);
        free(err);
    }
    ok(th_xlen(rc, "outbox:orders") >= ORDERS, "outbox:orders holds at least %d entries (%lld)", ORDERS,
       th_xlen(rc, "outbox:orders"));

    for (int g = 0; g < 2; g++) {
        const char *group = g == 0 ? "billing" : "shipping";
        const char *args[] = {"--redis", srv.url, "--stream", "outbox:orders", "--group", group, "--print", "--drain",
                              NULL};
        code = ct_consume_run(args, NULL, &out, &err, 60000 * th_slow());
        is_int(code, 0, "%s: outbox-consume --print --drain exited 0", group);
        is_int(th_count_lines(out), ORDERS, "%s: %d lines", group, ORDERS);
        got = ids_of(out, &ngot);
        dups = 0;
        for (size_t i = 1; i < ngot; i++)
            dups += strcmp(got[i - 1], got[i]) == 0;
        is_int(dups, 0, "%s: no id printed twice", group);
        same = ngot == ntable;
        for (size_t i = 0; same && i < ngot; i++)
            same = strcmp(got[i], table_ids[i]) == 0;
        ok(same, "%s: the printed ids are exactly the outbox table's ids", group);
        ok(strstr(out, "\"topic\":\"orders\"") && strstr(out, "order_id"), "%s: topic and payload as written",
           group);
        is_int(ct_pending(rc, "outbox:orders", group), 0, "%s: everything acknowledged", group);
        if (code != 0)
            th_diag_tail(group, err, INT_MAX);
        free_ids(got, ngot);
        free(out);
        free(err);
    }

    free_ids(table_ids, ntable);
    free(db);
    free(demo);
    free(relay);
    redisFree(rc);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
