/*
 * test_batch.c: batch leases (proto/schema.md, "Batch leases").
 *
 * - A half-marked batch: an expired batch lease of a relay that died, some
 *   of whose rows have a state of their own already (dead, published on its
 *   own, failed and due again). The relay takes the batch over (token + 1)
 *   with exactly its rows still as written, publishes them once, marks the
 *   batch published with one write, and leaves the other rows as they were
 *   (the due one is published on its own).
 * - An emptied batch: an expired batch lease none of whose rows is in it
 *   any more is dropped by a claim that takes nothing else, and a drain
 *   ends.
 * - A batch with a failed keyed head: the first rows of two keys fail
 *   (their stream refuses XADDs) while the rest of the batch is published;
 *   the failed rows leave the batch with their own state, their keys' later
 *   rows wait for them, and once the stream accepts writes every message is
 *   published once, each key in commit order.
 * - Retention across batch records: published batches older than the
 *   retention go with their rows, a few rows at a time (at least a batch per
 *   transaction), never a dead row inside a batch's range, never a recent
 *   batch.
 * - The database figures (/metrics, outbox_relay_stats_get) count rows by
 *   state through outbox_messages: the view agrees with the batch records
 *   counted directly.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/figures.h"
#include "harness.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

static th_redis srv;
static redisContext *c;
static char *dir;

static sqlite3 *fresh(const char *name, char **path)
{
    *path = rt_make_db(dir, name);
    return rt_open(*path);
}

/* Row counts by state as the relay's figures compute them (src/figures.h),
 * compared with a count that reads the batch records directly. */
static void counts_match_view(sqlite3 *db, const char *what)
{
    outbox__figures f;
    int64_t *fig = f.by_state, view[4] = {0};
    int s;
    if (outbox__figures_read(db, outbox_now_ms(), &f) != 0)
        bail("figures: %s", sqlite3_errmsg(db));
    /* Rows by their own state, those as written moved to their batch's. */
    for (s = 0; s < 4; s++)
        view[s] = th_sql_int(db, "SELECT count(*) FROM outbox WHERE state = %d", s);
    for (s = 1; s <= 2; s++) {
        int64_t n = th_sql_int(db, "SELECT count(*) FROM outbox_batch b JOIN outbox o ON o.seq >= b.lo AND "
                                   "o.seq <= b.hi WHERE b.state = %d AND o.state = 0 AND "
                                   "o.available_at <= o.created_at AND o.lease_token = 0",
                               s);
        view[s] += n;
        view[0] -= n;
    }
    ok(fig[0] == view[0] && fig[1] == view[1] && fig[2] == view[2] && fig[3] == view[3],
       "%s: the figures count by state as the batch records say (%lld/%lld/%lld/%lld)", what, (long long)view[0],
       (long long)view[1], (long long)view[2], (long long)view[3]);
}

static long entries_of(const char *stream, const char *id)
{
    rt_stream s = rt_stream_read(c, stream);
    long n = 0;
    size_t i;
    for (i = 0; i < s.n; i++)
        if (s.e[i].id && strcmp(s.e[i].id, id) == 0)
            n++;
    rt_stream_free(&s);
    return n;
}

/* n rows (prefix, topic, nkeys as rt_insert_rows) claimed in one batch,
 * seqs 1..n, with token by relay "gone", whose lease ran out a second
 * before now. */
static void dead_batch(sqlite3 *db, const char *prefix, int n, const char *topic, int nkeys, int token, int64_t now)
{
    rt_insert_rows(db, prefix, 0, n, topic, nkeys);
    th_sql_exec(db, "UPDATE outbox_cursor SET new_from = %d", n + 1);
    th_sql_exec(db,
                "INSERT INTO outbox_batch(lo, hi, state, owner, token, lease_until, attempts) "
                "VALUES (1, %d, 1, 'gone', %d, %lld, 1)",
                n, token, (long long)(now - 1000));
}

static void half_marked_takeover(void)
{
    char *path, *err = NULL, id[32];
    sqlite3 *db = fresh("half.db", &path);
    int64_t now = rt_unix_ms();
    int st, i, sent = 1;

    /* Rows 1..10 claimed in one batch by relay "gone", whose lease ran out.
     * Before it died, row 3 was dead-lettered, row 4 published on its own
     * and row 6 failed (due again now): they left the batch. */
    dead_batch(db, "h", 10, "half", 0, 3, now);
    th_sql_exec(db, "UPDATE outbox SET state = 3, lease_token = 3, attempts = 1, last_error = 'invalid' WHERE seq = 3");
    th_sql_exec(db, "UPDATE outbox SET state = 2, lease_token = 3, attempts = 1, published_at = %lld, "
                    "stream_id = '1-1' WHERE seq = 4",
                (long long)now);
    th_sql_exec(db, "UPDATE outbox SET lease_token = 3, attempts = 1, last_error = 'refused', "
                    "available_at = created_at + 1 WHERE seq = 6");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 1 AND lease_owner = 'gone' "
                          "AND lease_token = 3 AND batch = 1"),
           7, "half: the view shows the 7 rows still in the batch as leased by it");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE batch IS NULL AND "
                          "((seq = 3 AND state = 3) OR (seq = 4 AND state = 2) OR (seq = 6 AND state = 0))"),
           3, "half: the rows that left it show their own state");
    counts_match_view(db, "half, before");

    st = rt_relay_run(30000 * th_slow(), &err, path, srv.url, "--drain", "--worker-id", "taker", NULL);
    is_int(st, 0, "half: --drain exits 0");
    ok(err && strstr(err, "took over an expired lease"), "half: the takeover is logged");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_batch WHERE lo = 1 AND hi = 10 AND state = 2 AND "
                          "owner = 'taker' AND token = 4 AND attempts = 2 AND published_at IS NOT NULL"),
           1, "half: the batch record was taken over (token 4) and marked published");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox WHERE seq IN (1, 2, 5, 7, 8, 9, 10) AND state = 0 "
                          "AND lease_token = 0 AND available_at <= created_at"),
           7, "half: no row of the batch was written one by one");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE batch = 1 AND state = 2 AND attempts = 2 "
                          "AND lease_token = 4 AND stream_id IS NULL"),
           7, "half: its 7 rows are published with it (2 attempts: the dead relay's and this one)");
    for (i = 0; i < 10; i++) {
        long want = i == 2 || i == 3 ? 0 : 1;
        snprintf(id, sizeof id, "h-%06d", i);
        if (entries_of("outbox:half", id) != want) {
            diag("%s: %ld entries, want %ld", id, entries_of("outbox:half", id), want);
            sent = 0;
        }
    }
    ok(sent, "half: every row still to send was sent once, the dead and the published ones not again");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE seq = 6 AND state = 2 AND batch IS NULL "
                          "AND stream_id IS NOT NULL AND attempts = 2"),
           1, "half: the failed row was published on its own, its entry id kept");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE (seq = 3 AND state = 3) OR "
                          "(seq = 4 AND state = 2 AND stream_id = '1-1')"),
           2, "half: the dead row and the one published on its own are untouched");
    counts_match_view(db, "half, after");
    free(err);
    sqlite3_close_v2(db);
    free(path);
}

/* An expired batch lease none of whose rows is in it any more (each was
 * published on its own, or made to wait by a takeover that claimed nothing
 * else, then published on its own): a claim drops the record, and a drain
 * ends. It counted as leased for ever, and a drain never ended. */
static void emptied_batch(void)
{
    char *path, *err = NULL;
    sqlite3 *db = fresh("emptied.db", &path);
    int64_t now = rt_unix_ms();
    int st;

    dead_batch(db, "e", 8, "emptied", 2, 1, now);
    th_sql_exec(db, "UPDATE outbox SET state = 2, lease_token = 2, attempts = 2, published_at = %lld, "
                    "stream_id = '1-' || seq",
                (long long)now);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2 AND batch IS NULL"), 8,
           "emptied: every row of the batch's range has a state of its own");
    st = rt_relay_run(30000 * th_slow(), &err, path, srv.url, "--drain", "--drain-timeout-ms", "10000", "--worker-id",
                      "taker", NULL);
    is_int(st, 0, "emptied: --drain exits 0, not at its timeout");
    if (st != 0 && err)
        th_diag_tail("relay", err, 10);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_batch"), 0, "emptied: the record is gone");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2 AND stream_id = '1-' || seq"), 8,
           "emptied: its rows are as they were");
    is_int(th_xlen(c, "outbox:emptied"), 0, "emptied: nothing sent again");
    free(err);
    sqlite3_close_v2(db);
    free(path);
}

typedef struct khead {
    sqlite3 *db;
} khead;

static int head_failed(void *arg)
{
    khead *k = arg;
    return th_sql_int(k->db, "SELECT count(*) FROM outbox_messages WHERE topic = 'kh' AND attempts >= 1 "
                             "AND last_error IS NOT NULL AND state = 0") >= 2;
}

static void failed_keyed_head(void)
{
    char *path, *logpath = th_path(dir, "khead.log");
    sqlite3 *db = fresh("khead.db", &path);
    khead k = {db};
    rt_audit a;
    pid_t pid;
    int got;

    /* One batch: 40 rows of two keys on a refused stream, 40 unkeyed rows on
     * another, interleaved. */
    for (int i = 0; i < 40; i++) {
        rt_insert_rows(db, "kh", i, 1, "kh", 2);
        rt_insert_rows(db, "ok", i, 1, "okh", 0);
    }
    freeReplyObject(th_cmd(c, "SET outbox:kh x"));
    pid = rt_relay_spawn(logpath, path, srv.url, "--drain", "--backoff-min-ms", "400", "--backoff-max-ms", "400",
                         "--max-attempts", "100", NULL);
    got = th_wait_until(20000 * th_slow(), head_failed, &k);
    ok(got, "khead: the first row of each key failed and waits for its retry");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'kh' AND state = 2"), 0,
           "khead: no row of the failing keys was published behind them");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'kh' AND state = 0 "
                          "AND batch IS NOT NULL"),
           0, "khead: every row of the failing keys left the batch (a state of its own)");
    freeReplyObject(th_cmd(c, "DEL outbox:kh"));
    is_int(th_wait(pid, 30000 * th_slow()), 0, "khead: --drain exits 0 once the stream accepts writes");
    a = rt_audit_topic(db, c, "outbox:", "kh");
    ok(a.rows == 40 && a.missing == 0 && a.dups == 0 && a.unpublished == 0 && a.order_violations == 0,
       "khead: every keyed row published once, each key in commit order (rows %ld missing %ld dups %ld "
       "unpublished %ld misordered %ld)",
       a.rows, a.missing, a.dups, a.unpublished, a.order_violations);
    a = rt_audit_topic(db, c, "outbox:", "okh");
    ok(a.rows == 40 && a.missing == 0 && a.dups == 0 && a.unpublished == 0,
       "khead: the rest of the batch published once (rows %ld missing %ld dups %ld)", a.rows, a.missing, a.dups);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'okh' AND batch IS NOT NULL"), 40,
           "khead: the unkeyed rows were published with their batch");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'kh' AND batch IS NULL "
                          "AND stream_id IS NOT NULL"),
           40, "khead: the keyed rows, once they left the batch, were published on their own");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_batch WHERE state = 1"), 0, "khead: no batch lease is left");
    counts_match_view(db, "khead");
    sqlite3_close_v2(db);
    free(path);
    free(logpath);
}

static int old_batches_gone(void *arg)
{
    sqlite3 *db = arg;
    return th_sql_int(db, "SELECT count(*) FROM outbox_batch WHERE lo <= 16") == 0;
}

static void retention_across_batches(void)
{
    char *path, *err = NULL, *logpath = th_path(dir, "ret.log");
    sqlite3 *db = fresh("ret.db", &path);
    int64_t old = rt_unix_ms() - 120000;
    pid_t pid;
    int st;

    rt_insert_rows(db, "r", 0, 32, "ret", 0);
    st = rt_relay_run(30000 * th_slow(), &err, path, srv.url, "--drain", "--batch", "8", NULL);
    is_int(st, 0, "retention: the rows were published (--drain exits 0)");
    free(err);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_batch WHERE state = 2"), 4, "retention: in 4 batches of 8");
    /* The first two batches are old; a row of the first is dead (by hand,
     * as a replayed row that failed again would be). */
    th_sql_exec(db, "UPDATE outbox_batch SET published_at = %lld WHERE lo <= 16", (long long)old);
    th_sql_exec(db, "UPDATE outbox SET state = 3, lease_token = 1, last_error = 'by hand' WHERE seq = 2");
    counts_match_view(db, "retention, before");
    pid = rt_relay_spawn(logpath, path, srv.url, "--retention-ms", "60000", "--retention-batch", "3", "--log-level",
                         "debug", NULL);
    ok(th_wait_until(15000 * th_slow(), old_batches_gone, db), "retention: the old batch records went");
    is_int(th_stop(pid, SIGTERM, 10000), 0, "retention: the relay stops on SIGTERM");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox WHERE seq <= 16"), 1,
           "retention: their rows went with them, all but the dead one");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE seq = 2 AND state = 3"), 1,
           "retention: the dead row in a deleted batch's range stays dead");
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE seq > 16 AND state = 2 AND batch IS NOT NULL"),
           16, "retention: the recent batches and their rows stay");
    {
        char *log = th_slurp(logpath);
        ok(log && rt_count_substr(log, "retention deleted published rows") >= 2,
           "retention: in more than one transaction (a batch at least each)");
        free(log);
    }
    counts_match_view(db, "retention, after");
    sqlite3_close_v2(db);
    free(path);
    free(logpath);
}

int main(void)
{
    if (th_redis_start(&srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    dir = th_tmpdir();
    c = th_redis_client(&srv);
    half_marked_takeover();
    emptied_batch();
    failed_keyed_head();
    retention_across_batches();
    redisFree(c);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
