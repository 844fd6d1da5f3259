/*
 * The database figures (rows by state, due rows, live leases) that
 * /metrics, /healthz, outbox_relay_stats_get and outbox-replay stats show
 * are what outbox_messages says, in every state a row can be in: new rows,
 * delayed and retried (waiting) rows, rows in a live and in an expired batch
 * lease, published batches, rows that left their batch (failed, handed
 * back, published on their own, dead), dead rows of a real relay, rows
 * requeued and purged by outbox-replay, rows made pending again by hand,
 * rows deleted by retention and by hand (in a batch, among the new rows, at
 * the end of the table, whose seqs new rows then take). And no statement of
 * the figures walks the outbox table or the batch records, so that their
 * cost does not grow with the table (checked through EXPLAIN QUERY PLAN,
 * not by timing).
 */
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/figures.h"
#include "harness.h"
#include "ops.h"
#include "outbox.h"
#include "relay/sql.h"
#include "tap.h"

#define HOUR_MS 3600000

static th_redis srv;
static redisContext *rc;
static char *dir, *dbpath, *logpath;
static sqlite3 *db;

static const char *const state_names[OUTBOX_STATE_COUNT] = {"pending", "sending", "published", "dead"};

/* What outbox_messages says at `now`: rows by state, due pending rows (the
 * ones the relay would claim now: new rows whatever their available_at),
 * sending rows with a live lease, the oldest due pending row's id. */
typedef struct view {
    int64_t by_state[OUTBOX_STATE_COUNT], all, due, live;
    char oldest[64];
} view;

static view view_at(int64_t now)
{
    view v;
    sqlite3_stmt *st;
    memset(&v, 0, sizeof v);
    for (int s = 0; s < OUTBOX_STATE_COUNT; s++) {
        v.by_state[s] = th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = %d", s);
        v.all += v.by_state[s];
    }
    v.due = th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 0 AND (available_at <= %lld "
                           "OR available_at <= created_at)",
                       (long long)now);
    v.live = th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 1 AND lease_until > %lld",
                        (long long)now);
    if (sqlite3_prepare_v2(db,
                           "SELECT id FROM outbox_messages WHERE state = 0 AND (available_at <= ?1 "
                           "OR available_at <= created_at) ORDER BY created_at, seq LIMIT 1",
                           -1, &st, NULL) != SQLITE_OK)
        bail("prepare: %s", sqlite3_errmsg(db));
    sqlite3_bind_int64(st, 1, now);
    if (sqlite3_step(st) == SQLITE_ROW)
        snprintf(v.oldest, sizeof v.oldest, "%s", (const char *)sqlite3_column_text(st, 0));
    sqlite3_finalize(st);
    return v;
}

/* The figures read in this process equal the view's counts. */
static void check(const char *what)
{
    int64_t now = rt_unix_ms();
    outbox__figures f;
    view v = view_at(now);
    char id[OUTBOX_ID_MAX + 1] = "";
    int64_t created = 0;
    int e = outbox__figures_read(db, now, &f), found;
    is_int(e, 0, "%s: the figures are read (%s)", what, e ? sqlite3_errmsg(db) : "ok");
    ok(memcmp(f.by_state, v.by_state, sizeof f.by_state) == 0,
       "%s: rows by state as the view counts them: %lld/%lld/%lld/%lld (view %lld/%lld/%lld/%lld)", what,
       (long long)f.by_state[0], (long long)f.by_state[1], (long long)f.by_state[2], (long long)f.by_state[3],
       (long long)v.by_state[0], (long long)v.by_state[1], (long long)v.by_state[2], (long long)v.by_state[3]);
    ok(f.due == v.due && f.leases_live == v.live, "%s: due %lld (view %lld), live leases %lld (view %lld)", what,
       (long long)f.due, (long long)v.due, (long long)f.leases_live, (long long)v.live);
    found = outbox__figures_oldest(db, now, id, sizeof id, &created);
    ok(found == (v.oldest[0] != '\0') && strcmp(id, v.oldest) == 0, "%s: the oldest due pending row '%s' (view '%s')",
       what, id, v.oldest);
}

/* Runs a statement of the relay's (relay/sql.h) with its parameters: one
 * character of types per parameter, in order: 'i' an int64_t, 's' a string,
 * '-' none (left NULL). Returns the rows it changed; bails on error. */
static int run(const char *sql, const char *types, ...)
{
    sqlite3_stmt *st;
    va_list ap;
    int n;
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK)
        bail("prepare %s: %s", sql, sqlite3_errmsg(db));
    va_start(ap, types);
    for (int i = 0; types[i]; i++) {
        if (types[i] == 'i')
            sqlite3_bind_int64(st, i + 1, va_arg(ap, int64_t));
        else if (types[i] == 's')
            sqlite3_bind_text(st, i + 1, va_arg(ap, const char *), -1, SQLITE_TRANSIENT);
    }
    va_end(ap);
    if (sqlite3_step(st) != SQLITE_DONE)
        bail("%s: %s", sql, sqlite3_errmsg(db));
    sqlite3_finalize(st);
    n = sqlite3_changes(db);
    return n;
}

static int64_t seq_of(const char *id)
{
    int64_t s = th_sql_int(db, "SELECT seq FROM outbox WHERE id = %Q", id);
    if (s <= 0)
        bail("no row %s", id);
    return s;
}

/* A batch lease of another relay over every row of prefix (all new),
 * expiring at until; the cursor moves past it. Returns its lo. */
static int64_t lease_batch(const char *prefix, const char *owner, int64_t until)
{
    int64_t lo = th_sql_int(db, "SELECT min(seq) FROM outbox WHERE id LIKE '%q-%%'", prefix),
            hi = th_sql_int(db, "SELECT max(seq) FROM outbox WHERE id LIKE '%q-%%'", prefix);
    run(OUTBOX__SQL_BATCH_NEW, "iisi", lo, hi, owner, until);
    run(OUTBOX__SQL_CURSOR_SET, "i", hi + 1);
    return lo;
}

/* Row id of the batch at lo (owner, token 1) leaves it: failed (state 0,
 * due at due, or dead), as marks.c writes it. */
static void batch_row_failed(int64_t lo, const char *owner, const char *id, int state, int64_t due)
{
    is_int(run(OUTBOX__SQL_BATCH_FAILED, "isiiisii", seq_of(id), owner, (int64_t)1, (int64_t)state, due,
               "ERR test", (int64_t)1, lo),
           1, "%s leaves its batch %s", id, state == 3 ? "dead" : "to be retried");
}

/* The steps of a relay's mark as the views know them, by the relay's SQL. */
static void build_leases(int64_t now)
{
    int64_t c, e;

    /* Another relay's live batch lease, with every kind of row that leaves
     * a batch, and a row of it deleted by hand. */
    rt_insert_rows(db, "c", 0, 40, "fig.c", 4);
    c = lease_batch("c", "other", now + HOUR_MS);
    batch_row_failed(c, "other", "c-000003", 0, now + HOUR_MS);
    is_int(run(OUTBOX__SQL_BATCH_RELEASE, "isi-i-ii", seq_of("c-000004"), "other", (int64_t)1, now - 1000, (int64_t)0,
               c),
           1, "c-000004 is handed back");
    is_int(run(OUTBOX__SQL_BATCH_ROW_PUBLISHED, "isiis-ii", seq_of("c-000005"), "other", (int64_t)1, now - 500,
               "5-0", (int64_t)1, c),
           1, "c-000005 is published on its own");
    batch_row_failed(c, "other", "c-000006", 3, now);
    batch_row_failed(c, "other", "c-000008", 3, now);
    th_sql_exec(db, "DELETE FROM outbox WHERE id = 'c-000007'");
    check("a live batch lease, rows that left it, one deleted");

    /* A batch lease that expired. */
    rt_insert_rows(db, "d", 0, 20, "fig.d", 0);
    lease_batch("d", "gone", now - 60000);
    check("an expired batch lease");

    /* A batch published two hours ago (retention deletes it below): a dead
     * row of it stays, a row of it published on its own goes. */
    rt_insert_rows(db, "e", 0, 20, "fig.e", 0);
    e = lease_batch("e", "w", now + HOUR_MS);
    batch_row_failed(e, "w", "e-000002", 3, now);
    run(OUTBOX__SQL_BATCH_ROW_PUBLISHED, "isiis-ii", seq_of("e-000003"), "w", (int64_t)1, now - 2 * HOUR_MS - 100,
        "3-0", (int64_t)1, e);
    is_int(run(OUTBOX__SQL_BATCH_PUBLISHED, "isii", e, "w", (int64_t)1, now - 2 * HOUR_MS), 1,
           "batch e is published");
    check("an old published batch");
}

static void build_new_rows(int64_t now)
{
    /* New rows after the cursor: one delayed (written with a later
     * available_at), one deleted by hand. A published row made pending
     * again by hand (outbox_stray), and a row of a real published batch
     * deleted by hand. */
    rt_insert_rows(db, "n", 0, 30, "fig.n", 3);
    th_sql_exec(db, "INSERT INTO outbox(id, topic, payload, available_at) VALUES ('late-1', 'fig.n', x'00', %lld)",
                (long long)(now + HOUR_MS));
    rt_insert_rows(db, "n", 30, 5, "fig.n", 0);
    th_sql_exec(db, "DELETE FROM outbox WHERE id = 'n-000010'");
    th_sql_exec(db, "UPDATE outbox SET state = 0 WHERE id = 'c-000005'");
    ok(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE id = 'a-000010' AND batch IS NOT NULL") == 1,
       "a-000010 is in a published batch of the relay's");
    th_sql_exec(db, "DELETE FROM outbox WHERE id = 'a-000010'");
    check("new rows, a delayed one, deletes by hand, a row made pending again by hand");
}

/* outbox-replay's changes: a published row of a batch and the relay's dead
 * rows requeued, a dead row of the live batch purged. */
static void replay_changes(void)
{
    char *tool = th_bin("tools/replay/outbox-replay"), *out = NULL, *err = NULL;
    char *requeue_one[] = {tool, "requeue", "--db", dbpath, "--id", "a-000020", "--reason", "test", NULL};
    char *requeue_dead[] = {tool, "requeue", "--db", dbpath, "--state", "dead", "--topic", "fig.bad", "--reason",
                            "test", NULL};
    char *purge[] = {tool, "purge", "--db", dbpath, "--id", "c-000006", NULL};
    is_int(th_run(requeue_one, NULL, &out, &err, 30000 * th_slow()), 0, "requeue a published row (%s)", err);
    free(out);
    free(err);
    is_int(th_run(requeue_dead, NULL, &out, &err, 30000 * th_slow()), 0, "requeue the dead rows (%s)", err);
    free(out);
    free(err);
    is_int(th_run(purge, NULL, &out, &err, 30000 * th_slow()), 0, "purge a dead row (%s)", err);
    free(out);
    free(err);
    free(tool);
    check("after outbox-replay requeue and purge");
}

/* The rows at the end deleted by hand: the cursor goes back, new rows take
 * their seqs. */
static void tail_deletes(void)
{
    int64_t last = th_sql_int(db, "SELECT max(seq) FROM outbox");
    th_sql_exec(db, "DELETE FROM outbox WHERE seq > %lld", (long long)(last - 2));
    check("the last rows deleted by hand");
    rt_insert_rows(db, "t", 0, 5, "fig.t", 0);
    ok(th_sql_int(db, "SELECT min(seq) FROM outbox WHERE id LIKE 't-%%'") == last - 1,
       "new rows take the seqs of the deleted ones");
    check("new rows in the seqs of deleted ones");
}

static int old_batch_gone(void *arg)
{
    (void)arg;
    return th_sql_int(db, "SELECT count(*) FROM outbox_batch WHERE published_at < %lld",
                      (long long)(rt_unix_ms() - HOUR_MS)) == 0 &&
           th_sql_int(db, "SELECT count(*) FROM outbox WHERE id = 'e-000003'") == 0;
}

/* The published batch and row of two hours ago deleted by the relay's
 * retention (the dead row of that batch stays). */
static pid_t start_relay(int port)
{
    char listen[64], url[600];
    pid_t pid;
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    /* Nobody listens there: the relay claims nothing while it is up. */
    snprintf(url, sizeof url, "unix://%s/nobody.sock", dir);
    pid = rt_relay_spawn(logpath, dbpath, url, "--metrics-listen", listen, "--retention-ms", "3600000",
                         "--health-redis-down-ms", "86400000", NULL);
    ok(th_wait_until(20000 * th_slow(), old_batch_gone, NULL), "retention deleted the old published batch");
    ok(th_sql_int(db, "SELECT state FROM outbox_messages WHERE id = 'e-000002'") == 3,
       "its dead row stays");
    check("after retention");
    return pid;
}

struct scrape {
    int port;
    view v;
    char *text;
};

/* The last scrape shows the view's counts (a refresh is at most a second
 * old: the table does not change any more, so they agree within one). */
static int metrics_agree(void *arg)
{
    struct scrape *s = arg;
    char series[64];
    free(s->text);
    s->text = NULL;
    if (ot_http_get(s->port, "/metrics", &s->text) != 200)
        return 0;
    for (int st = 0; st < OUTBOX_STATE_COUNT; st++) {
        snprintf(series, sizeof series, "outbox_messages{state=\"%s\"}", state_names[st]);
        if (ot_prom_val(s->text, series) != (double)s->v.by_state[st])
            return 0;
    }
    return 1;
}

static void check_http(int port)
{
    struct scrape s = {.port = port, .v = view_at(rt_unix_ms())};
    char *body = NULL;
    ok(th_wait_until(10000 * th_slow(), metrics_agree, &s), "/metrics: outbox_messages{state} equal the view's counts");
    for (int st = 0; st < OUTBOX_STATE_COUNT; st++) {
        char series[64];
        snprintf(series, sizeof series, "outbox_messages{state=\"%s\"}", state_names[st]);
        is_int((long long)ot_prom_val(s.text, series), s.v.by_state[st], "/metrics: %s", series);
    }
    ok(ot_prom_val(s.text, "outbox_oldest_pending_seconds") > 0, "/metrics: outbox_oldest_pending_seconds %g",
       ot_prom_val(s.text, "outbox_oldest_pending_seconds"));
    free(s.text);
    is_int(ot_http_get(port, "/healthz", &body), 200, "/healthz: 200 (the figures were read)");
    ok(body && strcmp(body, "ok\n") == 0, "/healthz: ok");
    free(body);
}

/* The integer after "key": in JSON text (the first one), or -1. */
static long long json_int(const char *text, const char *key)
{
    char k[64];
    const char *p;
    snprintf(k, sizeof k, "\"%s\":", key);
    p = text ? strstr(text, k) : NULL;
    return p ? strtoll(p + strlen(k), NULL, 10) : -1;
}

/* A figure of the text output: the number after `label` at a line's start. */
static long long text_int(const char *text, const char *label, const char *after)
{
    const char *p = text;
    size_t n = strlen(label);
    while (p && *p) {
        if (!strncmp(p, label, n) && p[n] == ' ') {
            const char *q = after ? strstr(p, after) : p + n;
            const char *eol = strchr(p, '\n');
            if (!q || (eol && q > eol))
                return -1;
            return strtoll(q + (after ? strlen(after) : 0), NULL, 10);
        }
        p = strchr(p, '\n');
        if (p)
            p++;
    }
    return -1;
}

static void check_stats(void)
{
    char *tool = th_bin("tools/replay/outbox-replay"), *out = NULL, *err = NULL;
    char *json[] = {tool, "stats", "--db", dbpath, "--json", NULL};
    char *text[] = {tool, "stats", "--db", dbpath, NULL};
    char *by_topic[] = {tool, "stats", "--db", dbpath, "--json", "--by-topic", NULL};
    char *sending[] = {tool, "stats", "--db", dbpath, "--json", "--state", "sending", NULL};
    view v = view_at(rt_unix_ms());
    int64_t topics;

    for (int form = 0; form < 2; form++) {
        is_int(th_run(form ? by_topic : json, NULL, &out, &err, 30000 * th_slow()), 0, "stats --json%s (%s)",
               form ? " --by-topic" : "", err);
        for (int st = 0; st < OUTBOX_STATE_COUNT; st++)
            is_int(json_int(out, state_names[st]), v.by_state[st], "stats --json%s: %s", form ? " --by-topic" : "",
                   state_names[st]);
        ok(json_int(out, "total") == v.all && json_int(out, "pending_due") == v.due &&
               json_int(out, "pending_waiting") == v.by_state[0] - v.due && json_int(out, "leases_live") == v.live &&
               json_int(out, "leases_expired") == v.by_state[1] - v.live,
           "stats --json%s: total %lld, due %lld, waiting %lld, live %lld, expired %lld", form ? " --by-topic" : "",
           json_int(out, "total"), json_int(out, "pending_due"), json_int(out, "pending_waiting"),
           json_int(out, "leases_live"), json_int(out, "leases_expired"));
        {
            char want[96];
            snprintf(want, sizeof want, "\"oldest_due_pending\":{\"id\":\"%s\"", v.oldest);
            ok(out && strstr(out, want), "stats --json%s: the oldest due pending row is %s", form ? " --by-topic" : "",
               v.oldest);
        }
        ok((strstr(out, "\"by_topic\"") != NULL) == form, "stats --json%s: by_topic %s", form ? " --by-topic" : "",
           form ? "present" : "absent");
        if (form) {
            topics = th_sql_int(db, "SELECT count(DISTINCT topic) FROM outbox_messages");
            is_int(rt_count_substr(out, "{\"topic\":"), topics, "stats --by-topic: one object per topic");
            {
                char want[160];
                snprintf(want, sizeof want, "{\"topic\":\"fig.c\",\"pending\":%lld,\"sending\":%lld",
                         (long long)th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'fig.c' "
                                                   "AND state = 0"),
                         (long long)th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'fig.c' "
                                                   "AND state = 1"));
                ok(strstr(out, want) != NULL, "stats --by-topic: %s", want);
            }
        }
        free(out);
        free(err);
    }

    is_int(th_run(text, NULL, &out, &err, 30000 * th_slow()), 0, "stats (%s)", err);
    ok(text_int(out, "total", NULL) == v.all && text_int(out, "pending", NULL) == v.by_state[0] &&
           text_int(out, "sending", NULL) == v.by_state[1] && text_int(out, "published", NULL) == v.by_state[2] &&
           text_int(out, "dead", NULL) == v.by_state[3],
       "stats: total and rows by state as the view counts them");
    ok(text_int(out, "pending", "(due ") == v.due && text_int(out, "sending", "(live leases ") == v.live &&
           text_int(out, "sending", "expired ") == v.by_state[1] - v.live,
       "stats: due rows and live and expired leases");
    ok(strstr(out, v.oldest) && !strstr(out, "TOPIC"), "stats: the oldest due pending row, no table by topic");
    free(out);
    free(err);

    is_int(th_run(sending, NULL, &out, &err, 30000 * th_slow()), 0, "stats --json --state sending (%s)", err);
    ok(json_int(out, "total") == v.by_state[1] && json_int(out, "pending") == 0 && json_int(out, "sending") ==
           v.by_state[1] && json_int(out, "leases_live") == v.live && strstr(out, "\"oldest_due_pending\":null"),
       "stats --state sending: the sending rows only");
    free(out);
    free(err);
    free(tool);
}

/* Whether a line of EXPLAIN QUERY PLAN walks the outbox table or the batch
 * records (by name or by the aliases outbox_messages gives them) rather
 * than reading through an index or a range of the primary key. */
static int walks(const char *detail)
{
    char table[64] = "";
    return sscanf(detail, "SCAN %63s", table) == 1 &&
           (!strcmp(table, "outbox") || !strcmp(table, "outbox_batch") || !strcmp(table, "o") ||
            !strcmp(table, "b")) &&
           !strstr(detail, "INDEX");
}

/* The lines of sql's plan that walk a table; *lines gets how many lines. */
static int plan_walks(const char *sql, int *lines)
{
    sqlite3_stmt *st;
    char *q = sqlite3_mprintf("EXPLAIN QUERY PLAN %s", sql);
    int bad = 0;
    *lines = 0;
    if (sqlite3_prepare_v2(db, q, -1, &st, NULL) != SQLITE_OK)
        bail("prepare: %s", sqlite3_errmsg(db));
    while (sqlite3_step(st) == SQLITE_ROW) {
        const char *d = (const char *)sqlite3_column_text(st, 3);
        (*lines)++;
        if (walks(d)) {
            diag("%s", d);
            bad++;
        }
    }
    sqlite3_finalize(st);
    sqlite3_free(q);
    return bad;
}

/* No figure's statement walks the outbox table or the batch records: every
 * row it reads comes through an index (the partial indexes of the rows with
 * a state of their own among them) or a range of a primary key. */
static void check_plans(void)
{
    int lines;
    for (size_t i = 0; i < outbox__figures_nsql; i++)
        ok(plan_walks(outbox__figures_sql[i], &lines) == 0 && lines > 0,
           "statement %zu of the figures walks neither table (%d plan lines)", i, lines);
    /* The check sees a walk where there is one: the count it replaced. */
    ok(plan_walks("SELECT state, count(*) FROM outbox_messages GROUP BY state", &lines) > 0,
       "a count over outbox_messages is seen walking the table");
    ok(plan_walks("SELECT sum(hi - lo + 1) FROM outbox_batch", &lines) > 0,
       "a sum over the batch records is seen walking them");
}

int main(void)
{
    int64_t now;
    pid_t pid;
    int port, st;
    char *err = NULL;

    rt_world_start(&srv, &dir, &dbpath, &db, &rc);
    logpath = th_path(dir, "relay.log");

    /* A real relay publishes three topics in batches; one topic's stream
     * key is a string (WRONGTYPE), so its rows become dead at their first
     * attempt and leave their batches. */
    rt_insert_rows(db, "a", 0, 300, "fig.a", 7);
    rt_insert_rows(db, "b", 0, 100, "fig.b", 0);
    rt_insert_rows(db, "x", 0, 10, "fig.bad", 0);
    freeReplyObject(th_cmd(rc, "SET outbox:fig.bad not-a-stream"));
    st = rt_relay_run(60000 * th_slow(), &err, dbpath, srv.url, "--drain", "--max-attempts", "1", "--batch", "64",
                      NULL);
    is_int(st, 0, "the relay drains the rows");
    if (st != 0)
        th_diag_tail("relay", err, 20);
    free(err);
    ok(th_sql_int(db, "SELECT count(*) FROM outbox_batch WHERE state = 2") > 1 &&
           th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 3") == 10,
       "published batches, and 10 dead rows");
    check("after the relay's drain");

    now = rt_unix_ms();
    build_leases(now);
    build_new_rows(now);
    replay_changes();
    tail_deletes();

    port = th_free_port();
    pid = start_relay(port);
    check_http(port);
    check_stats();
    check_plans();
    is_int(th_stop(pid, SIGTERM, 10000 * th_slow()), 0, "the relay stops cleanly");

    free(logpath);
    rt_world_end(&srv, dir, dbpath, db, rc);
    return tap_done();
}
