/*
 * test_databases.c: messages that name their database (a relay over a
 * directory of databases, one per tenant: proto/envelope.md), where message
 * ids are unique per database only. The consumer-group helper, with the
 * Redis dedup and with the SQLite inbox, applies the same id from two
 * databases as two messages, and a redelivery of either (the same entry
 * appended again, as after a relay's crash between XADD and its mark) is
 * not applied again; a message without a database keeps today's keys. The
 * delivery carries the database (dv->msg->db). An entry whose db field and
 * envelope's db differ, or that has only one of them, is malformed: it goes
 * to <stream>:dead, with its db field, without reaching the handler.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ct.h"
#include "harness.h"
#include "outbox.h"
#include "tap.h"

#define GROUP "svc"

static th_redis srv;
static redisContext *rc;
static char *dir;

/* What the handler saw: "<db or ->/<id>" per application. */
typedef struct seen {
    char lines[32][300];
    int n;
    int failed_once; /* tenant-b's first delivery failed already */
    int stopped;
} seen;

static void record(seen *s, const outbox_delivery *dv)
{
    if (s->n < 32)
        snprintf(s->lines[s->n++], sizeof s->lines[0], "%s/%s", dv->msg->db ? dv->msg->db : "-", dv->msg->id);
}

static int count_of(const seen *s, const char *line)
{
    int n = 0;
    for (int i = 0; i < s->n; i++)
        n += strcmp(s->lines[i], line) == 0;
    return n;
}

/* Redis dedup: tenant-b's message fails on its first delivery (abandoned,
 * then retried: its key is the per-database one too). */
static int redis_handler(outbox_consumer *c, const outbox_delivery *dv, void *data)
{
    seen *s = data;
    if (dv->msg->db && !strcmp(dv->msg->db, "tenant-b") && !s->failed_once) {
        s->failed_once = 1;
        outbox_consumer_done(c, dv, 1);
        return 0;
    }
    record(s, dv);
    outbox_consumer_done(c, dv, 0);
    return 0;
}

/* SQLite inbox: the effect is a row in the consumer's database. */
static int inbox_handler(outbox_consumer *c, const outbox_delivery *dv, void *data)
{
    sqlite3_stmt *st;
    int rc_;
    (void)c;
    if (!dv->db || sqlite3_prepare_v2(dv->db, "INSERT INTO effects(db, id) VALUES (?1, ?2)", -1, &st, NULL) != SQLITE_OK)
        return 1;
    sqlite3_bind_text(st, 1, dv->msg->db, -1, SQLITE_TRANSIENT);
    sqlite3_bind_text(st, 2, dv->msg->id, -1, SQLITE_TRANSIENT);
    rc_ = sqlite3_step(st);
    sqlite3_finalize(st);
    if (rc_ != SQLITE_DONE)
        return 1;
    record(data, dv);
    return 0;
}

static void on_stopped(outbox_consumer *c, void *data)
{
    (void)c;
    ((seen *)data)->stopped = 1;
}

static void on_drained(outbox_consumer *c, void *data)
{
    outbox_consumer_stop(c, on_stopped, data);
}

/* The same message id m-1 from two databases and from a relay that names
 * none, each appended twice; then the three malformed entries. */
static void add_entries(const char *stream)
{
    for (int round = 0; round < 2; round++) {
        ct_xadd_db_msg(rc, stream, "tenant-a", "tenant-a", "m-1", "orders", "{\"t\":\"a\"}", 9, NULL);
        ct_xadd_db_msg(rc, stream, "tenant-b", "tenant-b", "m-1", "orders", "{\"t\":\"b\"}", 9, NULL);
        ct_xadd_msg(rc, stream, "m-1", "orders", "{\"t\":\"-\"}", 9, NULL);
    }
    ct_xadd_db_msg(rc, stream, "tenant-a", "tenant-b", "m-2", "orders", "{}", 2, NULL);
    ct_xadd_db_msg(rc, stream, "tenant-a", NULL, "m-3", "orders", "{}", 2, NULL);
    ct_xadd_db_msg(rc, stream, NULL, "tenant-a", "m-4", "orders", "{}", 2, NULL);
}

/* Runs a drained consumer over stream to its stop. */
static void consume(const char *stream, outbox_dedup_mode mode, const char *inbox, outbox_consumer_handler h,
                    seen *s, outbox_consumer_stats *st)
{
    uv_loop_t loop;
    outbox_consumer_settings cs;
    outbox_consumer *c;
    char err[300];

    if (uv_loop_init(&loop) != 0)
        bail("uv_loop_init");
    outbox_consumer_defaults(&cs);
    cs.redis_url = srv.url;
    cs.stream = stream;
    cs.group = GROUP;
    cs.dedup = mode;
    cs.inbox_db_path = inbox;
    cs.block_ms = 100;
    cs.retry_ms = 50;
    cs.max_inflight = 1; /* one at a time: a duplicate is seen after its original */
    cs.drain = 1;
    cs.on_drained = on_drained;
    cs.handler = h;
    cs.data = s;
    cs.log_level = OUTBOX_LOG_ERROR;
    if (outbox_consumer_create(&c, &loop, &cs, err, sizeof err) != 0)
        bail("outbox_consumer_create: %s", err);
    if (outbox_consumer_start(c) != 0)
        bail("outbox_consumer_start");
    ok(ct_run_until(&loop, &s->stopped, 20000 * th_slow()), "%s: the consumer drained the stream and stopped", stream);
    outbox_consumer_stats_get(c, st);
    outbox_consumer_destroy(c);
    is_int(ct_loop_finish(&loop, 5000), 0, "%s: uv_loop_close() == 0", stream);
}

/* The dead stream's entries: "<id>|<db field or ->|<reason>" lines. */
static char *dead_lines(const char *stream)
{
    char dead[300], *out = calloc(1, 4096);
    size_t used = 0;
    redisReply *r;
    snprintf(dead, sizeof dead, "%s:dead", stream);
    r = th_cmd(rc, "XRANGE %s - +", dead);
    if (!out)
        bail("out of memory");
    for (size_t i = 0; r->type == REDIS_REPLY_ARRAY && i < r->elements; i++) {
        const redisReply *f = r->element[i]->element[1];
        const char *id = "?", *db = "-", *reason = "?";
        for (size_t k = 0; k + 1 < f->elements; k += 2) {
            if (!strcmp(f->element[k]->str, "id"))
                id = f->element[k + 1]->str;
            else if (!strcmp(f->element[k]->str, "db"))
                db = f->element[k + 1]->str;
            else if (!strcmp(f->element[k]->str, "reason"))
                reason = f->element[k + 1]->str;
        }
        used += (size_t)snprintf(out + used, 4096 - used, "%s|%s|%s\n", id, db, reason);
        if (used >= 4096)
            bail("dead stream too long");
    }
    freeReplyObject(r);
    return out;
}

static void check_dead(const char *stream, long long dead_lettered)
{
    char *d = dead_lines(stream);
    is_int(dead_lettered, 3, "%s: three malformed entries dead-lettered", stream);
    is_int(ct_line_count(d, "m-2|tenant-a|malformed entry"), 1,
           "%s: db field tenant-a, envelope's db tenant-b: malformed, dead with its db field", stream);
    is_int(ct_line_count(d, "m-3|tenant-a|malformed entry"), 1, "%s: a db field without the envelope's db: malformed",
           stream);
    is_int(ct_line_count(d, "m-4|-|malformed entry"), 1, "%s: the envelope's db without a db field: malformed", stream);
    free(d);
    is_int(ct_pending(rc, stream, GROUP), 0, "%s: every entry acknowledged", stream);
}

static void test_redis_dedup(void)
{
    const char *stream = "outbox:tenants";
    seen s = {0};
    outbox_consumer_stats st;
    char *v;

    add_entries(stream);
    consume(stream, OUTBOX_DEDUP_REDIS, NULL, redis_handler, &s, &st);
    is_int(s.n, 3, "redis: three applications");
    is_int(count_of(&s, "tenant-a/m-1"), 1, "redis: tenant-a's m-1 applied once, dv->msg->db is tenant-a");
    is_int(count_of(&s, "tenant-b/m-1"), 1, "redis: tenant-b's m-1 applied once (after a failed first delivery)");
    is_int(count_of(&s, "-/m-1"), 1, "redis: m-1 without a database applied once, dv->msg->db NULL");
    ok(s.failed_once, "redis: tenant-b's first delivery failed and was abandoned");
    is_int(st.duplicates, 3, "redis: the three redeliveries skipped as duplicates");
    v = ct_get(rc, "dedup:" GROUP ":{outbox:tenants}:tenant-a:m-1");
    is_str(v, "D", "redis: the key of tenant-a's m-1 is <ns>:{<stream>}:tenant-a:m-1, done");
    free(v);
    v = ct_get(rc, "dedup:" GROUP ":{outbox:tenants}:tenant-b:m-1");
    is_str(v, "D", "redis: the key of tenant-b's m-1 is <ns>:{<stream>}:tenant-b:m-1, done");
    free(v);
    v = ct_get(rc, "dedup:" GROUP ":{outbox:tenants}:m-1");
    is_str(v, "D", "redis: a message without a database keeps today's key <ns>:{<stream>}:m-1");
    free(v);
    is_int(ct_int(rc, "EXISTS dedup:" GROUP ":{outbox:tenants}:m-2"), 0, "redis: a malformed entry wrote no key");
    check_dead(stream, (long long)st.dead_lettered);
}

static void test_inbox(void)
{
    const char *stream = "outbox:tenants-inbox";
    char *path = th_path(dir, "consumer.db");
    seen s = {0};
    outbox_consumer_stats st;
    sqlite3 *db;

    /* An inbox made before databases were named, holding m-0 of a relay
     * that names none: it keeps working, and only that m-0 is a duplicate. */
    if (sqlite3_open(path, &db) != SQLITE_OK ||
        sqlite3_exec(db,
                     "CREATE TABLE outbox_inbox (message_id TEXT NOT NULL, stream TEXT NOT NULL, entry_id TEXT NOT "
                     "NULL, received_at INTEGER NOT NULL, UNIQUE (message_id, stream));"
                     "INSERT INTO outbox_inbox VALUES ('m-0', 'outbox:tenants-inbox', '1-0', 1);"
                     "CREATE TABLE effects(db TEXT, id TEXT NOT NULL);",
                     NULL, NULL, NULL) != SQLITE_OK)
        bail("inbox setup: %s", sqlite3_errmsg(db));
    sqlite3_close_v2(db);
    ct_xadd_msg(rc, stream, "m-0", "orders", "{}", 2, NULL);
    ct_xadd_db_msg(rc, stream, "tenant-a", "tenant-a", "m-0", "orders", "{}", 2, NULL);
    add_entries(stream);
    consume(stream, OUTBOX_DEDUP_SQLITE, path, inbox_handler, &s, &st);
    is_int(s.n, 4, "inbox: four applications");
    is_int(count_of(&s, "tenant-a/m-1") + count_of(&s, "tenant-b/m-1") + count_of(&s, "-/m-1"), 3,
           "inbox: m-1 of tenant-a, of tenant-b and without a database, each once");
    is_int(count_of(&s, "tenant-a/m-0"), 1, "inbox: tenant-a's m-0 applied: the old inbox row is another message's");
    is_int(count_of(&s, "-/m-0"), 0, "inbox: m-0 without a database skipped: the old inbox row still counts");
    is_int(st.duplicates, 4, "inbox: the three redeliveries and the old m-0 skipped as duplicates");
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK)
        bail("open %s", path);
    is_int(th_sql_int(db, "SELECT count(*) FROM effects"), 4, "inbox: four effect rows");
    is_int(th_sql_int(db, "SELECT count(*) FROM effects WHERE db IS NULL AND id = 'm-1'"), 1,
           "inbox: the effect without a database has a NULL db");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_inbox WHERE stream = 'outbox:tenants-inbox' AND message_id IN "
                          "('tenant-a:m-1', 'tenant-b:m-1', 'm-1', 'tenant-a:m-0', 'm-0')"),
           5, "inbox: rows keyed '<db>:<id>' for a message that names its database, '<id>' for one that does not");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_inbox"), 5, "inbox: no other row");
    sqlite3_close_v2(db);
    check_dead(stream, (long long)st.dead_lettered);
    free(path);
}

int main(void)
{
    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    rc = th_redis_client(&srv);
    dir = th_tmpdir();

    test_redis_dedup();
    test_inbox();

    redisFree(rc);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
