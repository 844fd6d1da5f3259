/* outbox-replay on bad input (every kind: a message, an exit code, nothing
 * changed) and while another connection holds the write lock. Real SQLite
 * files made with outbox_db_open() + outbox_schema_apply(), rows inserted by
 * SQL in every state; helpers in rp.h. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sqlite3.h>

#include "harness.h"
#include "rp.h"
#include "tap.h"

static void test_bad_input(void)
{
    char *db = rp_fresh_db("bad.db"), *txt = th_path(rp_dir, "text.db"), *plain = th_path(rp_dir, "plain.db"),
         *missing = th_path(rp_dir, "missing.db");
    uint64_t before = rp_table_sum(db), txt_sum, plain_sum;
    sqlite3 *h;
    FILE *f;
    rp_res r;
    struct stat sb;

    r = RUN("frobnicate", "--db", db);
    rp_expect(r, 2, "unknown subcommand 'frobnicate'", "unknown subcommand");
    rp_res_free(&r);
    r = RUN("list", "--db", db, "--bogus");
    rp_expect(r, 2, "unknown option '--bogus'", "unknown option");
    rp_res_free(&r);
    r = RUN("list", "--db", db, "-x");
    rp_expect(r, 2, "unknown option '-x'", "unknown short option");
    rp_res_free(&r);
    r = RUN("requeue", "--db", db, "--state", "zombie", "--reason", "r");
    rp_expect(r, 2, "unknown state 'zombie'", "unknown state");
    rp_res_free(&r);
    r = RUN("list", "--db", db, "--since", "yesterday");
    rp_expect(r, 2, "--since: 'yesterday'", "bad time format");
    rp_res_free(&r);
    r = RUN("list", "--db", db, "--until", "2026-02-30");
    rp_expect(r, 2, "no such date", "impossible date");
    rp_res_free(&r);
    r = RUN("list", "--db", db, "--since", "2026-11-29T10:00:00");
    rp_expect(r, 2, "no time zone", "date-time without a zone");
    rp_res_free(&r);
    r = RUN("requeue", "--db", db, "--since", "2026-11-29T12:00:00Z", "--until", "2026-11-29", "--reason", "r");
    rp_expect(r, 2, "is not before --until", "--since after --until");
    rp_res_free(&r);
    r = RUN("list", "--state", "dead");
    rp_expect(r, 2, "--db PATH is required", "missing --db");
    rp_res_free(&r);
    r = RUN("list", "--db");
    rp_expect(r, 2, "--db needs a value", "--db without a value");
    rp_res_free(&r);
    r = RUN("requeue", "--db", db, "--state", "dead");
    rp_expect(r, 2, "requeue needs --reason", "requeue without --reason");
    rp_res_free(&r);
    r = RUN("requeue", "--db", db, "--state", "dead", "--reason", "  ");
    rp_expect(r, 2, "--reason: empty", "blank --reason");
    rp_res_free(&r);
    r = RUN("list", "--db", db, "--limit", "ten");
    rp_expect(r, 2, "--limit: 'ten' is not a whole number", "bad --limit");
    rp_res_free(&r);
    r = RUN("requeue", "--db", db, "--reason", "r", "--batch", "0");
    rp_expect(r, 2, "--batch: 0 is out of range", "--batch 0");
    rp_res_free(&r);
    r = RUN("list", "--db", db, "--reason", "r");
    rp_expect(r, 2, "--reason does not apply to list", "option of another subcommand");
    rp_res_free(&r);
    r = RUN("list", "--db", db, "--topic", "a b");
    rp_expect(r, 2, "--topic:", "invalid topic");
    rp_res_free(&r);
    r = RUN("list", "--db", db, "--topic", "a", "--topic", "b");
    rp_expect(r, 2, "--topic given twice", "repeated --topic");
    rp_res_free(&r);
    r = RUN("requeue", "--db", db, "--topic", "nosuch", "--reason", "r");
    rp_expect(r, 1, "nothing matches", "requeue with an empty selection");
    rp_res_free(&r);
    r = RUN("requeue", "--db", db, "--id", "no-such-id", "--reason", "r");
    rp_expect(r, 1, "no message with id no-such-id", "requeue of an unknown id warns about it");
    ok(strstr(r.err, "nothing matches") != NULL, "and says nothing matches");
    rp_res_free(&r);
    r = RUN("purge", "--db", db, "--id-prefix", "zzz");
    rp_expect(r, 1, "nothing matches", "purge with an empty selection");
    rp_res_free(&r);
    ok(rp_table_sum(db) == before, "none of the bad inputs changed the table");

    /* A file that is not a database. */
    f = fopen(txt, "w");
    fputs("this is a text file, not a database; it is long enough to have a header\n", f);
    fclose(f);
    txt_sum = rp_file_sum(txt);
    r = RUN("list", "--db", txt);
    rp_expect(r, 2, "not a usable SQLite database", "list on a text file");
    rp_res_free(&r);
    r = RUN("requeue", "--db", txt, "--reason", "r");
    rp_expect(r, 2, "not a usable SQLite database", "requeue on a text file");
    rp_res_free(&r);
    ok(rp_file_sum(txt) == txt_sum, "text file unchanged");

    /* A database without the outbox schema. */
    sqlite3_open(plain, &h);
    sqlite3_exec(h, "CREATE TABLE orders(id INTEGER PRIMARY KEY, total INTEGER)", NULL, NULL, NULL);
    sqlite3_close(h);
    plain_sum = rp_file_sum(plain);
    r = RUN("stats", "--db", plain);
    rp_expect(r, 2, "outbox-relay init", "stats on a database without the schema");
    rp_res_free(&r);
    r = RUN("requeue", "--db", plain, "--reason", "r", "--state", "dead");
    rp_expect(r, 2, "outbox-relay init", "requeue on a database without the schema");
    rp_res_free(&r);
    r = RUN("purge", "--db", plain);
    rp_expect(r, 2, "outbox-relay init", "purge on a database without the schema");
    rp_res_free(&r);
    ok(rp_file_sum(plain) == plain_sum, "that database is unchanged (not even switched to WAL)");
    is_int(rp_q_int(plain, "SELECT count(*) FROM sqlite_master WHERE name = 'outbox'"), 0, "and has no outbox table");

    /* A file that does not exist is not created. */
    r = RUN("requeue", "--db", missing, "--reason", "r");
    rp_expect(r, 2, "No such file", "requeue on a missing file");
    rp_res_free(&r);
    ok(stat(missing, &sb) != 0 && errno == ENOENT, "the missing file was not created");

    free(db);
    free(txt);
    free(plain);
    free(missing);
}

/* Inspection never needs the write lock, and a requeue waits for it (busy
 * wait 5 s) instead of failing at once; past that it fails, changing
 * nothing. */
static void test_locking(void)
{
    char *db = rp_fresh_db("lock.db"), *out = th_path(rp_dir, "lock.out"), *err = th_path(rp_dir, "lock.err");
    uint64_t before = rp_table_sum(db);
    sqlite3 *h = rp_open_plain(db);
    int64_t slowest = 0;
    pid_t pid;
    rp_res r;

    ok(sqlite3_exec(h, "BEGIN IMMEDIATE", NULL, NULL, NULL) == SQLITE_OK, "test holds the write lock");
    /* Each run is timed on its own: waiting for the lock takes the whole
     * 5 s busy wait, while a run takes far less than 4 s, even with the
     * tool under valgrind. */
#define TIMED_RUN(...)                                                                             \
    ({                                                                                             \
        int64_t t0_ = th_now_ms();                                                                 \
        rp_res r_ = RUN(__VA_ARGS__);                                                              \
        if (th_now_ms() - t0_ > slowest)                                                           \
            slowest = th_now_ms() - t0_;                                                           \
        r_;                                                                                        \
    })
    r = TIMED_RUN("list", "--db", db);
    ok(r.code == 0 && strstr(r.out, "d1"), "list works while another connection holds the write lock");
    rp_res_free(&r);
    r = TIMED_RUN("stats", "--db", db);
    is_int(r.code, 0, "stats too");
    rp_res_free(&r);
    r = TIMED_RUN("show", "d1", "--db", db);
    is_int(r.code, 0, "show too");
    rp_res_free(&r);
    r = TIMED_RUN("requeue", "--db", db, "--state", "dead", "--reason", "r", "--dry-run");
    is_int(r.code, 0, "requeue --dry-run too");
    rp_res_free(&r);
#undef TIMED_RUN
    ok(slowest < 4000, "none of them waited for the lock (slowest %lld ms)", (long long)slowest);

    {
        char *argv[] = {rp_tool, "requeue", "--db", db, "--state", "dead", "--reason", "after the lock", NULL};
        pid = th_spawn(argv, NULL, out, err);
    }
    th_sleep_ms(400);
    is_int(th_wait(pid, 0), -2, "requeue waits for the write lock");
    sqlite3_exec(h, "COMMIT", NULL, NULL, NULL);
    is_int(th_wait(pid, 10000), 0, "and completes once it is released");
    is_int(rp_q_int(db, "SELECT count(*) FROM outbox_messages WHERE replay_reason = 'after the lock'"), 3,
           "3 dead rows requeued");

    before = rp_table_sum(db);
    sqlite3_exec(h, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    r = RUN("requeue", "--db", db, "--state", "published", "--reason", "r");
    rp_expect(r, 1, "locked", "requeue while the lock is held for more than 5 s");
    rp_res_free(&r);
    sqlite3_exec(h, "COMMIT", NULL, NULL, NULL);
    sqlite3_close_v2(h);
    ok(rp_table_sum(db) == before, "the failed requeue changed nothing");
    free(db);
    free(out);
    free(err);
}

int main(void)
{
    rp_setup();
    test_bad_input();
    test_locking();
    rp_teardown();
    return tap_done();
}
