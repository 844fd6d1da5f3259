/*
 * outbox-replay stats (replay.h): rows by state, due and waiting pending
 * rows, live and expired leases and the oldest due pending row, and with
 * --by-topic the counts by topic x state, from one read transaction.
 * Without filters, or with --state only, the figures come from the batch
 * records, the cursor and the indexes (src/figures.h): their cost does not
 * grow with the table. --by-topic and the other filters count the rows
 * through outbox_messages (--id and --id-prefix only the matching rows,
 * through the id's index; the others every row).
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "store/figures.h"
#include "json.h"
#include "replay.h"

/* What both ways of counting give. */
typedef struct summary {
    int64_t by_state[OUTBOX_STATE_COUNT], all, due, live, expired;
    int has_oldest;
    char oldest_id[OUTBOX_ID_MAX + 1];
    int64_t oldest_created;
    size_t topic_w; /* the widest topic name (--by-topic) */
} summary;

/* A pending row is due when the relay would claim it now: a new row (its
 * available_at not after its created_at) whatever the clock says, another
 * once its available_at has come. */
#define DUE_SQL " AND state = 0 AND (available_at <= :now OR available_at <= created_at)"

static int wants(const replay_options *o, int state)
{
    return !o->states || (o->states & STATE_BIT(state));
}

/* Whether the rows must be counted: no index answers these filters. */
static int counts_rows(const replay_options *o)
{
    return o->by_topic || o->topic || o->key || o->id_prefix || o->has_since || o->has_until || o->nids;
}

/* The figures of the whole table, the states not asked for left out. */
static int from_figures(sqlite3 *db, const replay_options *o, int64_t now, summary *s)
{
    outbox__figures f;
    int e = outbox__figures_read(db, now, &f);
    if (e != 0)
        return -1;
    for (int st = 0; st < OUTBOX_STATE_COUNT; st++)
        if (wants(o, st)) {
            s->by_state[st] = f.by_state[st];
            s->all += f.by_state[st];
        }
    if (wants(o, OUTBOX_STATE_PENDING)) {
        s->due = f.due;
        e = outbox__figures_oldest(db, now, s->oldest_id, sizeof s->oldest_id, &s->oldest_created);
        if (e < 0)
            return -1;
        s->has_oldest = e;
    }
    if (wants(o, OUTBOX_STATE_SENDING)) {
        s->live = f.leases_live;
        s->expired = f.by_state[OUTBOX_STATE_SENDING] - f.leases_live;
    }
    return 0;
}

/* The same from the rows that match the filters; groups (prepared by the
 * caller: topic or NULL, state, count) is stepped once here. */
static int from_rows(sqlite3 *db, const replay_options *o, int64_t now, sqlite3_stmt *groups, summary *s)
{
    sqlite3_stmt *due = NULL, *oldest = NULL, *leases = NULL;
    int rc, ret = -1;
    if (replay_prepare_select(db, o, o->states, "count(*)", DUE_SQL, "", &due) != 0 ||
        replay_prepare_select(db, o, o->states, "id, created_at", DUE_SQL, " ORDER BY created_at, seq LIMIT 1",
                              &oldest) != 0 ||
        replay_prepare_select(db, o, o->states, "coalesce(sum(lease_until > :now), 0), count(*)", " AND state = 1", "",
                              &leases) != 0)
        goto done;
    replay_bind_named(due, ":now", now);
    replay_bind_named(oldest, ":now", now);
    replay_bind_named(leases, ":now", now);
    while ((rc = sqlite3_step(groups)) == SQLITE_ROW) {
        int64_t st = sqlite3_column_int64(groups, 1), n = sqlite3_column_int64(groups, 2);
        size_t tn;
        replay_col_text(groups, 0, &tn);
        if (st >= 0 && st < OUTBOX_STATE_COUNT)
            s->by_state[st] += n;
        s->all += n;
        if (tn > s->topic_w)
            s->topic_w = tn;
    }
    if (rc != SQLITE_DONE || sqlite3_step(due) != SQLITE_ROW)
        goto sql_fail;
    s->due = sqlite3_column_int64(due, 0);
    rc = sqlite3_step(oldest);
    if (rc == SQLITE_ROW) {
        size_t n;
        const unsigned char *id = replay_col_text(oldest, 0, &n);
        if (n >= sizeof s->oldest_id)
            n = sizeof s->oldest_id - 1;
        memcpy(s->oldest_id, id ? (const char *)id : "", n);
        s->oldest_id[n] = '\0';
        s->oldest_created = sqlite3_column_int64(oldest, 1);
        s->has_oldest = 1;
    } else if (rc != SQLITE_DONE) {
        goto sql_fail;
    }
    if (sqlite3_step(leases) != SQLITE_ROW)
        goto sql_fail;
    s->live = sqlite3_column_int64(leases, 0);
    s->expired = sqlite3_column_int64(leases, 1) - s->live;
    ret = 0;
    goto done;
sql_fail:
    replay_db_fail(db, "cannot read the outbox table");
done:
    sqlite3_finalize(due);
    sqlite3_finalize(oldest);
    sqlite3_finalize(leases);
    return ret;
}

int replay_cmd_stats(const replay_options *o)
{
    sqlite3 *db;
    sqlite3_stmt *by_topic = NULL;
    int64_t now = outbox_now_ms(), *total;
    summary sm;
    outbox__sbuf out = {0};
    size_t topic_w;
    int rc = replay_open_db(o, 0, &db), pass;
    char buf[96], d[32];

    if (rc != GO_ON)
        return rc;
    memset(&sm, 0, sizeof sm);
    sm.topic_w = strlen("TOPIC");
    sqlite3_exec(db, "BEGIN", NULL, NULL, NULL);
    if (!counts_rows(o)) {
        if (from_figures(db, o, now, &sm) != 0) {
            rc = replay_db_fail(db, "cannot read the outbox figures");
            goto done;
        }
    } else if (replay_prepare_select(db, o, o->states, o->by_topic ? "topic, state, count(*)" : "NULL, state, count(*)",
                                     "",
                                     o->by_topic ? " GROUP BY topic, state ORDER BY topic, state"
                                                 : " GROUP BY state ORDER BY state",
                                     &by_topic) != 0 ||
               from_rows(db, o, now, by_topic, &sm) != 0) {
        rc = EXIT_FAIL;
        goto done;
    }
    total = sm.by_state;
    topic_w = sm.topic_w;

    if (o->json) {
        outbox__sbuf_printf(&out, "{\"now\":\"%s\",\"now_ms\":%" PRId64 ",\"total\":%" PRId64 ",\"by_state\":{",
                            replay_fmt_time(now, buf), now, sm.all);
        for (int s = 0; s < OUTBOX_STATE_COUNT; s++)
            outbox__sbuf_printf(&out, "%s\"%s\":%" PRId64, s ? "," : "", replay_state_names[s], total[s]);
        outbox__sbuf_printf(&out,
                            "},\"dead\":%" PRId64 ",\"pending_due\":%" PRId64 ",\"pending_waiting\":%" PRId64
                            ",\"leases_live\":%" PRId64 ",\"leases_expired\":%" PRId64 ",\"oldest_due_pending\":",
                            total[OUTBOX_STATE_DEAD], sm.due, total[OUTBOX_STATE_PENDING] - sm.due, sm.live, sm.expired);
        if (sm.has_oldest) {
            outbox__sbuf_puts(&out, "{\"id\":");
            tools_json_cstr(&out, sm.oldest_id);
            outbox__sbuf_printf(&out, ",\"created_at\":\"%s\",\"created_at_ms\":%" PRId64 ",\"age_ms\":%" PRId64 "}",
                                replay_fmt_time(sm.oldest_created, buf), sm.oldest_created, now - sm.oldest_created);
        } else {
            outbox__sbuf_puts(&out, "null");
        }
        outbox__sbuf_puts(&out, o->by_topic ? ",\"by_topic\":[" : "}\n");
        if (replay_emit(&out) != 0) {
            rc = EXIT_FAIL;
            goto done;
        }
    } else {
        printf("%-10s %12" PRId64 "\n", "total", sm.all);
        printf("%-10s %12" PRId64 "  (due %" PRId64 ", waiting for available_at/backoff %" PRId64 ")\n", "pending",
               total[OUTBOX_STATE_PENDING], sm.due, total[OUTBOX_STATE_PENDING] - sm.due);
        printf("%-10s %12" PRId64 "  (live leases %" PRId64 ", expired %" PRId64 ")\n", "sending",
               total[OUTBOX_STATE_SENDING], sm.live, sm.expired);
        printf("%-10s %12" PRId64 "\n", "published", total[OUTBOX_STATE_PUBLISHED]);
        printf("%-10s %12" PRId64 "\n", "dead", total[OUTBOX_STATE_DEAD]);
        if (sm.has_oldest) {
            printf("oldest due pending: %s ago, created %s, id ", replay_fmt_dur(now - sm.oldest_created, d),
                   replay_fmt_time(sm.oldest_created, buf));
            replay_print_clean(stdout, (const unsigned char *)sm.oldest_id, strlen(sm.oldest_id), 0);
            putchar('\n');
        } else {
            puts("oldest due pending: - (none due)");
        }
        if (o->by_topic && sm.all)
            printf("\n%-*s  %10s %10s %10s %10s %10s\n", (int)topic_w, "TOPIC", "PENDING", "SENDING", "PUBLISHED",
                   "DEAD", "TOTAL");
    }
    if (!o->by_topic) {
        rc = replay_finish_output();
        goto done;
    }

    /* Second pass over the groups (same read transaction), one line or
     * object per topic; rows arrive ordered by topic. */
    sqlite3_reset(by_topic);
    {
        int64_t cur[OUTBOX_STATE_COUNT] = {0};
        char *topic = NULL;
        int ntopics = 0;
        for (pass = 1;; pass++) {
            size_t tn = 0;
            const unsigned char *t = NULL;
            int64_t s = 0, n = 0;
            rc = sqlite3_step(by_topic);
            if (rc == SQLITE_ROW) {
                t = replay_col_text(by_topic, 0, &tn);
                s = sqlite3_column_int64(by_topic, 1);
                n = sqlite3_column_int64(by_topic, 2);
            } else if (rc != SQLITE_DONE) {
                free(topic);
                goto sql_fail;
            }
            if (topic && (rc == SQLITE_DONE || strlen(topic) != tn || memcmp(topic, t, tn) != 0)) {
                int64_t sum = cur[0] + cur[1] + cur[2] + cur[3];
                if (o->json) {
                    outbox__sbuf_puts(&out, ntopics ? ",{\"topic\":" : "{\"topic\":");
                    tools_json_cstr(&out, topic);
                    for (int k = 0; k < OUTBOX_STATE_COUNT; k++)
                        outbox__sbuf_printf(&out, ",\"%s\":%" PRId64, replay_state_names[k], cur[k]);
                    outbox__sbuf_printf(&out, ",\"total\":%" PRId64 "}", sum);
                    if (replay_emit(&out) != 0) {
                        free(topic);
                        rc = EXIT_FAIL;
                        goto done;
                    }
                } else {
                    cell c;
                    replay_cell_set(&c, (const unsigned char *)topic, strlen(topic), OUTBOX_TOPIC_MAX);
                    fputs(c.s, stdout);
                    printf("%*s  %10" PRId64 " %10" PRId64 " %10" PRId64 " %10" PRId64 " %10" PRId64 "\n",
                           (int)(topic_w - c.width), "", cur[0], cur[1], cur[2], cur[3], sum);
                }
                ntopics++;
                free(topic);
                topic = NULL;
                memset(cur, 0, sizeof cur);
            }
            if (rc == SQLITE_DONE)
                break;
            if (!topic) {
                topic = strndup(t ? (const char *)t : "", tn);
                if (!topic) {
                    replay_errorf("out of memory");
                    rc = EXIT_FAIL;
                    goto done;
                }
            }
            if (s >= 0 && s < OUTBOX_STATE_COUNT)
                cur[s] += n;
        }
    }
    if (o->json)
        fputs("]}\n", stdout);
    rc = replay_finish_output();
    goto done;
sql_fail:
    rc = replay_db_fail(db, "cannot read the outbox table");
done:
    outbox__sbuf_free(&out);
    sqlite3_finalize(by_topic);
    sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    sqlite3_close_v2(db);
    return rc;
}
