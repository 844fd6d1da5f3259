/*
 * outbox-demo: a tiny order service. Each order is a row in the business
 * table `orders` and a message in the outbox, written in one transaction with
 * the writer API, so that both exist or neither does.
 *
 *   outbox-demo --db PATH [--orders N] [--fail-every K]
 *       writes N orders (default 10); with --fail-every K every K-th order
 *       fails after its business insert and is rolled back: neither row stays.
 *   outbox-demo --db PATH --orders N --embedded --redis URL
 *       the same, with the relay running inside this process on its libuv
 *       loop, woken by each commit; exits once every message is published.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uv.h>

#include "outbox.h"

static const char *prog = "outbox-demo";

typedef struct app {
    sqlite3 *db;
    outbox_writer *w;
    long orders, written, rolled_back, fail_every;
} app;

static int exec(sqlite3 *db, const char *sql)
{
    char *msg = NULL;
    if (sqlite3_exec(db, sql, NULL, NULL, &msg) != SQLITE_OK) {
        fprintf(stderr, "%s: %s: %s\n", prog, sql, msg ? msg : "error");
        sqlite3_free(msg);
        return -1;
    }
    return 0;
}

/* One order: the business row and its message, in one transaction. */
static int place_order(app *a, long n)
{
    char customer[32], payload[256], id[OUTBOX_ID_MAX + 1];
    sqlite3_stmt *st = NULL;
    int64_t order_id;
    outbox_message m;
    int e;

    snprintf(customer, sizeof customer, "customer-%ld", n % 7);
    if (exec(a->db, "BEGIN IMMEDIATE") != 0)
        return -1;
    if (sqlite3_prepare_v2(a->db, "INSERT INTO orders(customer, amount_cents) VALUES (?1, ?2)", -1, &st, NULL) !=
        SQLITE_OK)
        goto fail;
    sqlite3_bind_text(st, 1, customer, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 2, 1000 + n);
    if (sqlite3_step(st) != SQLITE_DONE)
        goto fail;
    sqlite3_finalize(st);
    st = NULL;
    order_id = sqlite3_last_insert_rowid(a->db);

    if (a->fail_every && n % a->fail_every == 0) {
        /* Something goes wrong after the business write: roll back, and the
         * message vanishes with the order. */
        exec(a->db, "ROLLBACK");
        a->rolled_back++;
        return 0;
    }

    snprintf(payload, sizeof payload, "{\"order_id\":%lld,\"customer\":\"%s\",\"amount_cents\":%ld}",
             (long long)order_id, customer, 1000 + n);
    memset(&m, 0, sizeof m);
    m.topic = "orders";
    m.key = customer; /* one customer's orders stay in commit order */
    m.payload = payload;
    m.payload_len = strlen(payload);
    e = outbox_enqueue(a->w, &m, id);
    if (e != 0) {
        fprintf(stderr, "%s: enqueue failed: %s (%s)\n", prog, outbox_writer_errmsg(a->w), outbox_err_name(e));
        goto fail;
    }
    if (exec(a->db, "COMMIT") != 0)
        goto fail;
    a->written++;
    return 0;
fail:
    sqlite3_finalize(st);
    exec(a->db, "ROLLBACK");
    return -1;
}

/* ---- embedded mode: the relay on this process's loop ---- */

typedef struct embedded {
    app *a;
    uv_loop_t loop;
    uv_idle_t writer;
    outbox_relay *relay;
    long next;
    int failed;
} embedded;

static void on_drained(outbox_relay *r, void *data)
{
    embedded *x = data;
    /* Drained only counts once every order was written. */
    if (x->next <= x->a->orders)
        return;
    outbox_relay_stop(r, NULL, NULL);
}

/* Writes one order per loop turn, so the relay publishes while we write. */
static void write_some(uv_idle_t *h)
{
    embedded *x = h->data;
    if (x->next > x->a->orders) {
        uv_close((uv_handle_t *)h, NULL);
        outbox_relay_wake(x->relay);
        return;
    }
    if (place_order(x->a, x->next++) != 0) {
        x->failed = 1;
        x->next = x->a->orders + 1;
    }
}

static int run_embedded(app *a, const char *db_path, const char *redis_url)
{
    embedded x;
    outbox_relay_settings s;
    char err[512];
    int e;

    memset(&x, 0, sizeof x);
    x.a = a;
    x.next = 1;
    uv_loop_init(&x.loop);
    outbox_relay_defaults(&s);
    s.db_path = db_path;
    s.redis_url = redis_url;
    s.drain = 1;
    s.on_drained = on_drained;
    s.on_drained_data = &x;
    e = outbox_relay_create(&x.relay, &x.loop, &s, err, sizeof err);
    if (e != 0) {
        fprintf(stderr, "%s: %s\n", prog, err);
        uv_loop_close(&x.loop);
        return 2;
    }
    /* Every commit on the application's connection wakes the relay. */
    outbox_relay_attach(x.relay, a->db);
    outbox_relay_start(x.relay);
    uv_idle_init(&x.loop, &x.writer);
    x.writer.data = &x;
    uv_idle_start(&x.writer, write_some);
    uv_run(&x.loop, UV_RUN_DEFAULT);
    outbox_relay_detach(a->db);
    outbox_relay_destroy(x.relay);
    uv_run(&x.loop, UV_RUN_DEFAULT);
    e = uv_loop_close(&x.loop);
    if (e != 0)
        fprintf(stderr, "%s: loop closed with open handles\n", prog);
    return x.failed || e ? 1 : 0;
}

int main(int argc, char **argv)
{
    const char *db_path = NULL, *redis_url = NULL;
    int embedded_mode = 0, i, e, rc = 0;
    char err[512];
    app a;

    memset(&a, 0, sizeof a);
    a.orders = 10;
    for (i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--db") && v)
            db_path = argv[++i];
        else if (!strcmp(argv[i], "--orders") && v)
            a.orders = atol(argv[++i]);
        else if (!strcmp(argv[i], "--fail-every") && v)
            a.fail_every = atol(argv[++i]);
        else if (!strcmp(argv[i], "--redis") && v)
            redis_url = argv[++i];
        else if (!strcmp(argv[i], "--embedded"))
            embedded_mode = 1;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("Usage: %s --db PATH [--orders N] [--fail-every K] [--embedded --redis URL]\n", prog);
            return 0;
        } else {
            fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", prog, argv[i]);
            return 2;
        }
    }
    if (!db_path || a.orders < 0 || a.fail_every < 0 || (embedded_mode && !redis_url)) {
        fprintf(stderr, "%s: need --db PATH, a non-negative --orders, and --redis with --embedded\n", prog);
        return 2;
    }
    e = outbox_db_open(db_path, OUTBOX_OPEN_CREATE, &a.db, err, sizeof err);
    if (e == 0)
        e = outbox_schema_apply(a.db, err, sizeof err);
    if (e != 0) {
        fprintf(stderr, "%s: %s\n", prog, err);
        sqlite3_close_v2(a.db);
        return 2;
    }
    if (exec(a.db, "CREATE TABLE IF NOT EXISTS orders(id INTEGER PRIMARY KEY, customer TEXT NOT NULL, "
                   "amount_cents INTEGER NOT NULL)") != 0 ||
        (e = outbox_writer_create(&a.w, a.db, NULL)) != 0) {
        fprintf(stderr, "%s: cannot prepare the writer (%s)\n", prog, outbox_strerror(e));
        sqlite3_close_v2(a.db);
        return 1;
    }
    if (embedded_mode) {
        rc = run_embedded(&a, db_path, redis_url);
    } else {
        for (long n = 1; n <= a.orders; n++)
            if (place_order(&a, n) != 0) {
                rc = 1;
                break;
            }
    }
    printf("%s: %ld orders committed with their messages, %ld rolled back\n", prog, a.written, a.rolled_back);
    outbox_writer_destroy(a.w);
    sqlite3_close_v2(a.db);
    return rc;
}
