/* outbox-replay's changes: audited requeue of dead and published messages,
 * --dry-run, --threshold/--yes, live-lease protection and --force fencing,
 * and purge of dead rows only. Real SQLite files made with outbox_db_open()
 * + outbox_schema_apply(), rows inserted by SQL in every state; helpers in
 * rp.h. */
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "rp.h"
#include "tap.h"

static void test_requeue_dead(void)
{
    char *db = rp_fresh_db("dead.db");
    long long t0 = rp_q_int(db, "SELECT " NOW_SQL), t1;
    uint64_t d3_before = 0;
    rp_res r;

    d3_before = (uint64_t)rp_q_int(db, "SELECT replay_count + 10 * state FROM outbox_messages WHERE id = 'd3'");
    r = RUN("requeue", "--db", db, "--state", "dead", "--topic", "orders", "--reason", "destination fixed");
    t1 = rp_q_int(db, "SELECT " NOW_SQL);
    is_int(r.code, 0, "requeue dead of topic orders: exit 0 (%s)", rp_oneline(r.err));
    ok(strstr(r.out, "requeued 2 messages") != NULL, "reports 2 requeued: %s", rp_oneline(r.out));
    rp_res_free(&r);
    is_int(rp_q_int(db, "SELECT count(*) FROM outbox_messages WHERE id IN ('d1','d2') AND state = 0 AND attempts = 0 AND "
                     "last_error IS NULL AND lease_owner IS NULL AND lease_until IS NULL AND replay_count = 1 AND "
                     "replay_reason = 'destination fixed'"),
           2, "d1, d2: pending, attempts 0, error and lease cleared, replay_count 1, reason recorded");
    ok(rp_q_int(db, "SELECT min(replayed_at) FROM outbox_messages WHERE id IN ('d1','d2')") >= t0 &&
           rp_q_int(db, "SELECT max(replayed_at) FROM outbox_messages WHERE id IN ('d1','d2')") <= t1,
       "replayed_at is the time of the run");
    ok(rp_q_int(db, "SELECT min(available_at) FROM outbox_messages WHERE id IN ('d1','d2')") >= t0 &&
           rp_q_int(db, "SELECT max(available_at) FROM outbox_messages WHERE id IN ('d1','d2')") <= t1,
       "available_at is now: due at once");
    is_int(rp_q_int(db, "SELECT replay_count + 10 * state FROM outbox_messages WHERE id = 'd3'"), (long long)d3_before,
           "d3 (other topic) untouched");
    is_int(rp_q_int(db, "SELECT state FROM outbox_messages WHERE id = 'p1'"), 2, "published p1 untouched");
    is_int(rp_q_int(db, "SELECT lease_token FROM outbox_messages WHERE id = 's-live'"), 7, "s-live untouched");

    /* The history shows in show. */
    r = RUN("show", "d1", "--db", db);
    is_int(r.code, 0, "show d1");
    ok(strstr(r.out, "replays:") && strstr(r.out, "destination fixed") && strstr(r.out, "pending"),
       "show has state, replay count and reason");
    rp_res_free(&r);
    free(db);
}

static void test_requeue_published(void)
{
    char *db = rp_fresh_db("published.db");
    rp_res r;

    r = RUN("requeue", "--db", db, "--id", "p1", "--reason", "consumer lost data");
    is_int(r.code, 0, "requeue published p1 by id (%s)", rp_oneline(r.err));
    rp_res_free(&r);
    is_int(rp_q_int(db, "SELECT count(*) FROM outbox_messages WHERE id = 'p1' AND state = 0 AND attempts = 0 AND "
                     "replay_count = 1 AND replayed_at IS NOT NULL AND replay_reason = 'consumer lost data'"),
           1, "p1 pending, attempts 0, replay_count 1, replayed_at and reason set");

    /* Now pending: a requeue by id without --state pending finds nothing. */
    r = RUN("requeue", "--db", db, "--id", "p1", "--reason", "again");
    rp_expect(r, 1, "nothing matches", "requeue of a pending message without --state pending");
    rp_res_free(&r);

    /* Published again by the relay, lost again: replay_count counts. */
    rp_exec_sql(db, "UPDATE outbox SET state = 2, published_at = " NOW_SQL ", attempts = 1 WHERE id = 'p1'");
    r = RUN("requeue", "--db", db, "--id", "p1", "--state", "published", "--reason", "lost twice");
    is_int(r.code, 0, "second requeue of p1");
    rp_res_free(&r);
    is_int(rp_q_int(db, "SELECT replay_count FROM outbox_messages WHERE id = 'p1'"), 2, "replay_count 2");
    {
        char *reason = rp_q_str(db, "SELECT replay_reason FROM outbox_messages WHERE id = 'p1'");
        is_str(reason, "lost twice", "latest reason recorded");
        free(reason);
    }

    /* --state pending does take a pending message (due now, attempts 0). */
    rp_exec_sql(db, "UPDATE outbox SET attempts = 3, available_at = " NOW_SQL " + 3600000 WHERE id = 'q1'");
    r = RUN("requeue", "--db", db, "--id", "q1", "--state", "pending", "--reason", "retry now");
    is_int(r.code, 0, "requeue --state pending of a backing-off row");
    rp_res_free(&r);
    ok(rp_q_int(db, "SELECT attempts = 0 AND available_at <= " NOW_SQL " AND replay_count = 1 FROM outbox_messages WHERE id = "
                 "'q1'") == 1,
       "q1 due now, attempts 0, audited");
    free(db);
}

static void test_dry_run(void)
{
    char *db = rp_fresh_db("dry.db");
    uint64_t before = rp_table_sum(db);
    rp_res r;

    r = RUN("requeue", "--db", db, "--reason", "check", "--dry-run");
    is_int(r.code, 0, "requeue --dry-run exits 0 (%s)", rp_oneline(r.err));
    ok(strstr(r.out, "d1") && strstr(r.out, "d2") && strstr(r.out, "d3") && strstr(r.out, "p1") &&
           strstr(r.out, "s-exp") && strstr(r.out, "s-live") && !strstr(r.out, "q1"),
       "dry run lists exactly the selected rows");
    ok(strstr(r.out, "would requeue 5 messages") != NULL, "and what would change: %s", rp_oneline(r.out));
    ok(strstr(r.out, "skip: live lease") != NULL && strstr(r.out, "would skip 1") != NULL,
       "and which row would be skipped for its live lease");
    rp_res_free(&r);
    ok(rp_table_sum(db) == before, "requeue --dry-run changed nothing (table checksum)");

    r = RUN("requeue", "--db", db, "--reason", "check", "--dry-run", "--force", "--threshold", "2");
    ok(r.code == 0 && strstr(r.out, "would requeue 6") && strstr(r.out, "needs --yes"),
       "dry run with --force counts the live lease; notes that --yes would be needed");
    rp_res_free(&r);
    r = RUN("purge", "--db", db, "--dry-run");
    ok(r.code == 0 && strstr(r.out, "would delete 3 dead messages"), "purge --dry-run: %s", rp_oneline(r.out));
    rp_res_free(&r);
    ok(rp_table_sum(db) == before, "purge --dry-run changed nothing");
    free(db);
}

static void test_threshold_and_batches(void)
{
    char *db = rp_make_db("threshold.db");
    uint64_t before;
    rp_res r;

    rp_exec_sql(db, "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 101) "
                 "INSERT INTO outbox(id, topic, payload, state, attempts, last_error) "
                 "SELECT 'bulk-' || i, 'orders', 'x', 3, 10, 'boom' FROM n");
    before = rp_table_sum(db);
    r = RUN("requeue", "--db", db, "--state", "dead", "--reason", "bulk");
    rp_expect(r, 2, "--yes", "101 rows over the default threshold 100");
    ok(strstr(r.err, "101") != NULL, "says how many (%s)", rp_oneline(r.err));
    rp_res_free(&r);
    r = RUN("requeue", "--db", db, "--state", "dead", "--reason", "bulk", "--threshold", "5");
    rp_expect(r, 2, "more than --threshold 5", "--threshold 5");
    rp_res_free(&r);
    r = RUN("purge", "--db", db, "--threshold", "100");
    rp_expect(r, 2, "--yes", "purge over the threshold");
    rp_res_free(&r);
    ok(rp_table_sum(db) == before, "refused over the threshold: nothing changed");

    r = RUN("requeue", "--db", db, "--state", "dead", "--reason", "bulk", "--yes", "--batch", "7");
    is_int(r.code, 0, "with --yes: done (%s)", rp_oneline(r.err));
    ok(strstr(r.out, "requeued 101 messages") && strstr(r.out, "in 15 transactions"),
       "101 rows in 15 transactions of at most 7: %s", rp_oneline(r.out));
    rp_res_free(&r);
    is_int(rp_q_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 0 AND replay_count = 1 AND attempts = 0"), 101,
           "every row requeued once");

    rp_exec_sql(db, "UPDATE outbox SET state = 3");
    r = RUN("purge", "--db", db, "--yes", "--batch", "50", "--json");
    is_int(r.code, 0, "purge --yes --batch 50");
    ok(strstr(r.out, "\"deleted\":101") && strstr(r.out, "\"transactions\":3"), "purged 101 in 3: %s",
       rp_oneline(r.out));
    rp_res_free(&r);
    is_int(rp_q_int(db, "SELECT count(*) FROM outbox_messages"), 0, "table empty");
    free(db);
}

static void test_live_lease(void)
{
    char *db = rp_fresh_db("lease.db");
    uint64_t before = rp_table_sum(db);
    sqlite3 *h;
    rp_res r;

    r = RUN("requeue", "--db", db, "--id", "s-live", "--reason", "stuck?");
    rp_expect(r, 1, "live lease", "requeue of a row with a live lease, without --force");
    rp_res_free(&r);
    ok(rp_table_sum(db) == before, "live lease: nothing changed");

    r = RUN("requeue", "--db", db, "--state", "sending", "--reason", "stuck");
    is_int(r.code, 0, "requeue --state sending (%s)", rp_oneline(r.err));
    ok(strstr(r.out, "requeued 1 message") && strstr(r.out, "skipped 1"),
       "expired one requeued, live one skipped and counted: %s", rp_oneline(r.out));
    rp_res_free(&r);
    is_int(rp_q_int(db, "SELECT state * 1000 + lease_token FROM outbox_messages WHERE id = 's-live'"), 1007,
           "s-live still sending with token 7");
    is_int(rp_q_int(db, "SELECT count(*) FROM outbox_messages WHERE id = 's-exp' AND state = 0 AND lease_token = 4 AND "
                     "lease_owner IS NULL AND lease_until IS NULL AND replay_count = 1"),
           1, "s-exp (expired lease) taken without --force, token 3 -> 4");

    r = RUN("requeue", "--db", db, "--id", "s-live", "--reason", "worker hung", "--force", "--json");
    is_int(r.code, 0, "--force takes the live lease (%s)", rp_oneline(r.err));
    ok(strstr(r.out, "\"took_live_lease\":1") != NULL, "and says so: %s", rp_oneline(r.out));
    rp_res_free(&r);
    is_int(rp_q_int(db, "SELECT count(*) FROM outbox_messages WHERE id = 's-live' AND state = 0 AND lease_token = 8 AND "
                     "lease_owner IS NULL AND lease_until IS NULL AND attempts = 0 AND replay_count = 1"),
           1, "s-live: pending, lease cleared, lease_token 7 -> 8");

    /* The old holder wakes up and marks with its claim (w1, token 7): the
     * relay's fenced mark changes nothing. */
    h = rp_open_plain(db);
    sqlite3_exec(h,
                 "UPDATE outbox SET state = 2, published_at = 1, stream_id = '9-9', lease_owner = NULL, "
                 "lease_until = NULL WHERE id = 's-live' AND state = 1 AND lease_owner = 'w1' AND lease_token = 7",
                 NULL, NULL, NULL);
    is_int(sqlite3_changes(h), 0, "old holder's late mark (owner w1, token 7) is refused");
    sqlite3_close_v2(h);
    is_int(rp_q_int(db, "SELECT state FROM outbox_messages WHERE id = 's-live'"), 0, "row stays pending");
    free(db);
}

static void test_purge(void)
{
    char *db = rp_fresh_db("purge.db");
    uint64_t before = rp_table_sum(db);
    rp_res r;

    r = RUN("purge", "--db", db, "--state", "published");
    rp_expect(r, 2, "only dead", "purge --state published");
    rp_res_free(&r);
    r = RUN("purge", "--db", db, "--state", "dead", "--state", "pending");
    rp_expect(r, 2, "--state pending is not allowed", "purge --state dead --state pending");
    rp_res_free(&r);
    r = RUN("purge", "--db", db, "--id", "p1");
    rp_expect(r, 1, "nothing matches", "purge of a published message by id");
    rp_res_free(&r);
    r = RUN("purge", "--db", db, "--topic", "nosuch");
    rp_expect(r, 1, "nothing matches", "purge with no matching dead row");
    rp_res_free(&r);
    ok(rp_table_sum(db) == before, "refused purges changed nothing");

    r = RUN("purge", "--db", db, "--topic", "billing");
    is_int(r.code, 0, "purge dead of topic billing (%s)", rp_oneline(r.err));
    ok(strstr(r.out, "purged 1 dead message") != NULL, "%s", rp_oneline(r.out));
    rp_res_free(&r);
    is_int(rp_q_int(db, "SELECT count(*) FROM outbox_messages WHERE id = 'd3'"), 0, "d3 deleted");
    is_int(rp_q_int(db, "SELECT count(*) FROM outbox_messages"), 6, "every other row kept");

    r = RUN("purge", "--db", db, "--id-prefix", "d", "--state", "dead");
    is_int(r.code, 0, "purge --id-prefix d");
    rp_res_free(&r);
    is_int(rp_q_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 3"), 0, "d1, d2 deleted");
    is_int(rp_q_int(db, "SELECT count(*) FROM outbox_messages"), 4, "published, pending and sending rows all kept");
    free(db);
}

int main(void)
{
    rp_setup();
    test_requeue_dead();
    test_requeue_published();
    test_dry_run();
    test_threshold_and_batches();
    test_live_lease();
    test_purge();
    rp_teardown();
    return tap_done();
}
