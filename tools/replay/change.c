/*
 * outbox-replay requeue and purge (replay.h): the changes, in short
 * BEGIN IMMEDIATE transactions of --batch rows walked in seq order, and
 * their dry runs.
 */
#include <inttypes.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "json.h"
#include "replay.h"

static volatile sig_atomic_t interrupted;

static void on_interrupt(int sig)
{
    (void)sig;
    interrupted = 1;
}

/* Warns (stderr) about --id values that name no message at all, so a typo
 * in a list of ids does not go unnoticed. */
static void warn_missing_ids(sqlite3 *db, const replay_options *o)
{
    sqlite3_stmt *st;
    size_t i, missing = 0;
    if (!o->nids || sqlite3_prepare_v2(db, "SELECT 1 FROM outbox_messages WHERE id = ?1", -1, &st, NULL) != SQLITE_OK)
        return;
    for (i = 0; i < o->nids; i++) {
        sqlite3_reset(st);
        sqlite3_bind_text(st, 1, o->ids[i], -1, SQLITE_STATIC);
        if (sqlite3_step(st) == SQLITE_DONE && ++missing <= 20)
            replay_errorf("warning: no message with id %s", o->ids[i]);
    }
    if (missing > 20)
        replay_errorf("warning: %zu more ids name no message", missing - 20);
    sqlite3_finalize(st);
}

/* The dry run: the rows, what would happen to each, and a summary, from one
 * read transaction (the caller's). */
static int dry_run(sqlite3 *db, const replay_options *o, unsigned states, int64_t max_seq, int64_t now)
{
    int purge = o->cmd == CMD_PURGE;
    rowsel rs = {states, max_seq, 0, o->cmd};
    rowcount c;
    int64_t touch;

    if (o->json)
        printf("{\"command\":\"%s\",\"dry_run\":true,\"rows\":", replay_command_names[o->cmd]);
    if (replay_print_rows(db, o, &rs, now, &c) != 0)
        return EXIT_FAIL;
    touch = c.by_action[ACT_REQUEUE] + c.by_action[ACT_TAKE] + c.by_action[ACT_DELETE];
    if (o->json) {
        outbox__sbuf out = {0};
        int e;
        if (purge)
            outbox__sbuf_printf(&out, ",\"would_delete\":%" PRId64, touch);
        else
            outbox__sbuf_printf(&out,
                                ",\"would_requeue\":%" PRId64 ",\"would_take_live_lease\":%" PRId64
                                ",\"would_skip_live_lease\":%" PRId64 ",\"reason\":",
                                touch, c.by_action[ACT_TAKE], c.by_action[ACT_SKIP]);
        if (!purge)
            tools_json_cstr(&out, o->reason);
        outbox__sbuf_printf(&out, ",\"threshold\":%" PRId64 ",\"needs_yes\":%s,\"changed\":0}\n", o->threshold,
                            touch > o->threshold ? "true" : "false");
        e = replay_emit(&out);
        outbox__sbuf_free(&out);
        return e == 0 ? replay_finish_output() : EXIT_FAIL;
    }
    if (purge) {
        printf("dry run: would delete %" PRId64 " dead %s; nothing was changed\n", touch,
               replay_plural(touch, "message", "messages"));
    } else {
        printf("dry run: would requeue %" PRId64 " %s (state pending, available_at now, attempts 0, last_error and "
               "lease cleared, replay_count + 1, replayed_at now, replay_reason \"",
               touch, replay_plural(touch, "message", "messages"));
        replay_print_clean(stdout, (const unsigned char *)o->reason, strlen(o->reason), 0);
        printf("\"); nothing was changed\n");
        if (c.by_action[ACT_TAKE])
            printf("dry run: %" PRId64 " of them %s sending under a live lease: --force would take %s and increment "
                   "lease_token\n",
                   c.by_action[ACT_TAKE], replay_plural(c.by_action[ACT_TAKE], "is", "are"),
                   replay_plural(c.by_action[ACT_TAKE], "it", "them"));
        if (c.by_action[ACT_SKIP])
            printf("dry run: would skip %" PRId64 " sending %s with a live lease (pass --force to take %s)\n",
                   c.by_action[ACT_SKIP], replay_plural(c.by_action[ACT_SKIP], "message", "messages"),
                   replay_plural(c.by_action[ACT_SKIP], "it", "them"));
    }
    if (touch > o->threshold)
        printf("dry run: that is more than --threshold %" PRId64 ": the real run needs --yes\n", o->threshold);
    return replay_finish_output();
}

typedef struct progress {
    int on;
    int64_t done, total;
} progress;

static void progress_show(const progress *p, const char *verb)
{
    if (p->on)
        fprintf(stderr, "\r%s: %s %" PRId64 "/%" PRId64 " (%d%%)", REPLAY_PROG, verb, p->done, p->total,
                p->total ? (int)(p->done * 100 / p->total) : 100);
}

int replay_cmd_change(const replay_options *o)
{
    const int purge = o->cmd == CMD_PURGE;
    const char *verb = purge ? "purge" : "requeue";
    unsigned states = purge ? STATE_BIT(OUTBOX_STATE_DEAD)
                            : (o->states ? o->states
                                         : STATE_BIT(OUTBOX_STATE_SENDING) | STATE_BIT(OUTBOX_STATE_PUBLISHED) | STATE_BIT(OUTBOX_STATE_DEAD));
    sqlite3 *db;
    sqlite3_stmt *count = NULL, *sel = NULL, *change = NULL;
    int64_t now, matched, live, max_seq, touch, last = 0, done = 0, skipped = 0, taken = 0, ntx = 0;
    int64_t by_state[OUTBOX_STATE_COUNT] = {0};
    int64_t *seqs = NULL, *prev = NULL;
    int *lives = NULL;
    progress pg = {0, 0, 0};
    int lost_output = 0;
    struct sigaction sa, old_int, old_term;
    int rc = replay_open_db(o, !o->dry_run, &db);

    if (rc != GO_ON)
        return rc;

    /* What matches, in one read transaction; max_seq bounds the run so that
     * rows committed while it runs (new dead letters) are not swept up
     * beyond what was counted against --threshold. */
    sqlite3_exec(db, "BEGIN", NULL, NULL, NULL);
    now = outbox_now_ms();
    if (replay_prepare_select(db, o, states,
                              "count(*), coalesce(sum(state = 1 AND lease_until > :now), 0), "
                              "coalesce(max(seq), 0)",
                              "", "", &count) != 0) {
        rc = EXIT_FAIL;
        goto done;
    }
    replay_bind_named(count, ":now", now);
    if (sqlite3_step(count) != SQLITE_ROW) {
        rc = replay_db_fail(db, "cannot read the outbox table");
        goto done;
    }
    matched = sqlite3_column_int64(count, 0);
    live = purge ? 0 : sqlite3_column_int64(count, 1);
    max_seq = sqlite3_column_int64(count, 2);
    warn_missing_ids(db, o);
    if (matched == 0) {
        if (purge)
            replay_errorf("nothing matches: no dead message matches the filters; nothing was changed");
        else if (!o->states)
            replay_errorf("nothing matches: no dead, published or sending message matches the filters (pending "
                          "ones only with --state pending); nothing was changed");
        else
            replay_errorf("nothing matches the filters; nothing was changed");
        rc = EXIT_FAIL;
        goto done;
    }
    if (o->dry_run) {
        rc = dry_run(db, o, states, max_seq, now);
        goto done;
    }
    /* End the read transaction for good: a statement left open would keep
     * it, and SQLite runs the busy handler only for a connection without an
     * open transaction, so BEGIN IMMEDIATE would fail at once instead of
     * waiting out the busy wait for the relay or the application. */
    sqlite3_finalize(count);
    count = NULL;
    sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    touch = o->force ? matched : matched - live;
    if (touch == 0) {
        replay_errorf("nothing to requeue: the %" PRId64 " matching %s %s being sent under a live lease (pass "
                      "--force to take %s: the holder's late marks will be refused); nothing was changed",
                      matched, replay_plural(matched, "message", "messages"), replay_plural(matched, "is", "are"),
                      replay_plural(matched, "it", "them"));
        rc = EXIT_FAIL;
        goto done;
    }
    if (touch > o->threshold && !o->yes) {
        replay_errorf("%s would touch %" PRId64 " messages, more than --threshold %" PRId64
                      ": pass --yes to confirm (see them with --dry-run); nothing was changed",
                      verb, touch, o->threshold);
        rc = EXIT_USAGE;
        goto done;
    }

    if (replay_prepare_select(db, o, states, "seq, state, (state = 1 AND lease_until > :now)",
                              " AND seq > :last AND seq <= :max", " ORDER BY seq LIMIT :lim", &sel) != 0) {
        rc = EXIT_FAIL;
        goto done;
    }
    rc = sqlite3_prepare_v2(db,
                            purge ? "DELETE FROM outbox WHERE seq = :seq AND state = 3"
                                  /* available_at after created_at: a waiting row, as every row
                                   * that was claimed before (proto/schema.sql, outbox_due); a
                                   * row of a batch leaves it (a state of its own) with at least
                                   * its batch's token. The state compared is the derived one. */
                                  : "UPDATE outbox SET state = 0, available_at = max(:now, created_at + 1), attempts = 0, "
                                    "last_error = NULL, lease_owner = NULL, lease_until = NULL, "
                                    "lease_token = max(lease_token, coalesce((SELECT lease_token FROM outbox_messages "
                                    "WHERE seq = :seq), 0)) + (:state = 1), replay_count = replay_count + 1, "
                                    "replayed_at = :now, replay_reason = :reason WHERE seq = :seq "
                                    "AND (SELECT state FROM outbox_messages WHERE seq = :seq) = :state",
                            -1, &change, NULL);
    if (rc != SQLITE_OK) {
        rc = replay_db_fail(db, "cannot prepare the change");
        goto done;
    }
    if (!purge)
        sqlite3_bind_text(change, sqlite3_bind_parameter_index(change, ":reason"), o->reason, -1, SQLITE_STATIC);
    replay_bind_named(sel, ":max", max_seq);
    replay_bind_named(sel, ":lim", o->batch);
    seqs = malloc(sizeof *seqs * (size_t)o->batch);
    prev = malloc(sizeof *prev * (size_t)o->batch);
    lives = malloc(sizeof *lives * (size_t)o->batch);
    if (!seqs || !prev || !lives) {
        replay_errorf("out of memory");
        rc = EXIT_FAIL;
        goto done;
    }

    /* Stop between batches on SIGINT/SIGTERM: what is committed stays. */
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_interrupt;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);

    /* On a terminal only, and not among log lines. */
    pg.on = isatty(STDERR_FILENO) && touch > o->batch && !o->log;
    pg.total = touch;
    rc = EXIT_OK;
    while (!interrupted) {
        int64_t n = 0, i, b_done = 0, b_skipped = 0, b_taken = 0, b_by_state[OUTBOX_STATE_COUNT] = {0};
        const char *failed = NULL;
        int step = SQLITE_DONE;
        if (sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK) {
            rc = replay_db_fail(db, "cannot take the write lock");
            break;
        }
        now = outbox_now_ms();
        replay_bind_named(sel, ":now", now);
        replay_bind_named(sel, ":last", last);
        replay_bind_named(change, ":now", now);
        /* Read the batch first, then change it: changing rows under a
         * running scan of the same table is not well defined. */
        sqlite3_reset(sel);
        while (n < o->batch && (step = sqlite3_step(sel)) == SQLITE_ROW) {
            seqs[n] = sqlite3_column_int64(sel, 0);
            prev[n] = sqlite3_column_int64(sel, 1);
            lives[n] = sqlite3_column_int(sel, 2);
            n++;
        }
        if (n < o->batch && step != SQLITE_DONE)
            failed = "cannot read the batch";
        sqlite3_reset(sel);
        for (i = 0; i < n && !failed; i++) {
            if (!purge && lives[i] && !o->force) {
                b_skipped++;
                continue;
            }
            sqlite3_reset(change);
            replay_bind_named(change, ":seq", seqs[i]);
            replay_bind_named(change, ":state", prev[i]);
            if (sqlite3_step(change) != SQLITE_DONE) {
                failed = purge ? "cannot delete" : "cannot requeue";
                break;
            }
            if (sqlite3_changes(db) == 1) {
                b_done++;
                if (prev[i] >= 0 && prev[i] < OUTBOX_STATE_COUNT)
                    b_by_state[prev[i]]++;
                b_taken += !purge && lives[i];
            }
        }
        sqlite3_reset(change);
        if (!failed && sqlite3_exec(db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK)
            failed = "cannot commit";
        if (failed) {
            /* This batch is rolled back; the totals hold what is committed. */
            rc = replay_db_fail(db, failed);
            sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
            break;
        }
        if (n == 0)
            break;
        ntx++;
        done += b_done;
        skipped += b_skipped;
        taken += b_taken;
        for (i = 0; i < OUTBOX_STATE_COUNT; i++)
            by_state[i] += b_by_state[i];
        last = seqs[n - 1];
        pg.done = done;
        progress_show(&pg, verb);
        if (n < o->batch)
            break;
        /* Let waiting writers (the application, the relay) have the lock
         * before the next batch. */
        usleep(1000);
    }
    if (pg.on)
        fputc('\n', stderr);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);

    if (rc != EXIT_OK && ntx == 0) {
        /* Nothing was committed: the error said it all. */
    } else if (o->json) {
        outbox__sbuf out = {0};
        outbox__sbuf_printf(&out, "{\"command\":\"%s\",\"dry_run\":false,\"%s\":%" PRId64, verb,
                            purge ? "deleted" : "requeued", done);
        if (!purge) {
            outbox__sbuf_puts(&out, ",\"by_state\":{");
            for (int s = 0; s < OUTBOX_STATE_COUNT; s++)
                outbox__sbuf_printf(&out, "%s\"%s\":%" PRId64, s ? "," : "", replay_state_names[s], by_state[s]);
            outbox__sbuf_printf(&out, "},\"took_live_lease\":%" PRId64 ",\"skipped_live_lease\":%" PRId64,
                                taken, skipped);
            outbox__sbuf_puts(&out, ",\"reason\":");
            tools_json_cstr(&out, o->reason);
        }
        outbox__sbuf_printf(&out, ",\"transactions\":%" PRId64 ",\"interrupted\":%s,\"complete\":%s}\n", ntx,
                            interrupted ? "true" : "false", rc == EXIT_OK && !interrupted ? "true" : "false");
        lost_output = replay_emit(&out) != 0;
        outbox__sbuf_free(&out);
    } else if (purge) {
        printf("purged %" PRId64 " dead %s in %" PRId64 " %s\n", done, replay_plural(done, "message", "messages"), ntx,
               replay_plural(ntx, "transaction", "transactions"));
    } else {
        const char *sep = " (";
        printf("requeued %" PRId64 " %s", done, replay_plural(done, "message", "messages"));
        for (int s = OUTBOX_STATE_COUNT - 1; s >= 0; s--)
            if (by_state[s]) {
                printf("%s%s %" PRId64, sep, replay_state_names[s], by_state[s]);
                sep = ", ";
            }
        printf("%s in %" PRId64 " %s, reason \"", done ? ")" : "", ntx,
               replay_plural(ntx, "transaction", "transactions"));
        replay_print_clean(stdout, (const unsigned char *)o->reason, strlen(o->reason), 0);
        puts("\"");
        if (taken)
            printf("took %" PRId64 " live %s (--force): lease_token incremented, the old holder's marks will be "
                   "refused\n",
                   taken, replay_plural(taken, "lease", "leases"));
        printf("skipped %" PRId64 " sending %s with a live lease%s\n", skipped,
               replay_plural(skipped, "message", "messages"), skipped ? " (pass --force to take them)" : "");
    }
    if (interrupted) {
        replay_errorf("interrupted: %" PRId64 " of %" PRId64 " done and committed; run again to continue", done, touch);
        rc = EXIT_FAIL;
    } else if (rc != EXIT_OK) {
        replay_errorf("stopped: %" PRId64 " of %" PRId64 " done and committed before the error; run again to continue",
                      done, touch);
    }
    if (replay_finish_output() != EXIT_OK || lost_output)
        rc = EXIT_FAIL;
done:
    free(seqs);
    free(prev);
    free(lives);
    sqlite3_finalize(count);
    sqlite3_finalize(sel);
    sqlite3_finalize(change);
    if (!sqlite3_get_autocommit(db))
        sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
    sqlite3_close_v2(db);
    return rc;
}
