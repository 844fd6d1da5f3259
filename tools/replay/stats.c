/*
 * outbox-replay stats (replay.h): counts by state and by topic x state,
 * due and waiting rows, leases, from one read transaction.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"
#include "replay.h"

int replay_cmd_stats(const replay_options *o)
{
    sqlite3 *db;
    sqlite3_stmt *by_topic = NULL, *due = NULL, *oldest = NULL, *leases = NULL;
    int64_t now = outbox_now_ms(), total[OUTBOX_STATE_COUNT] = {0}, all = 0, due_n = 0, live = 0, expired = 0;
    int64_t oldest_created = 0;
    char *oldest_id = NULL;
    outbox__sbuf out = {0};
    size_t topic_w = strlen("TOPIC");
    int rc = replay_open_db(o, 0, &db), pass;
    char buf[96], d[32];

    if (rc != GO_ON)
        return rc;
    sqlite3_exec(db, "BEGIN", NULL, NULL, NULL);
    if (replay_prepare_select(db, o, o->states, "topic, state, count(*)", "",
                              " GROUP BY topic, state ORDER BY topic, state", &by_topic) != 0 ||
        replay_prepare_select(db, o, o->states, "count(*)", " AND state = 0 AND available_at <= :now", "", &due) != 0 ||
        replay_prepare_select(db, o, o->states, "id, created_at", " AND state = 0 AND available_at <= :now",
                              " ORDER BY created_at, seq LIMIT 1", &oldest) != 0 ||
        replay_prepare_select(db, o, o->states, "coalesce(sum(lease_until > :now), 0), count(*)", " AND state = 1", "",
                              &leases) != 0) {
        rc = EXIT_FAIL;
        goto done;
    }
    replay_bind_named(due, ":now", now);
    replay_bind_named(oldest, ":now", now);
    replay_bind_named(leases, ":now", now);

    while ((rc = sqlite3_step(by_topic)) == SQLITE_ROW) {
        int64_t s = sqlite3_column_int64(by_topic, 1), n = sqlite3_column_int64(by_topic, 2);
        size_t tn;
        replay_col_text(by_topic, 0, &tn);
        if (s >= 0 && s < OUTBOX_STATE_COUNT)
            total[s] += n;
        all += n;
        if (tn > topic_w)
            topic_w = tn;
    }
    if (rc != SQLITE_DONE)
        goto sql_fail;
    if ((rc = sqlite3_step(due)) != SQLITE_ROW)
        goto sql_fail;
    due_n = sqlite3_column_int64(due, 0);
    rc = sqlite3_step(oldest);
    if (rc == SQLITE_ROW) {
        size_t n;
        const unsigned char *id = replay_col_text(oldest, 0, &n);
        oldest_id = strndup(id ? (const char *)id : "", n);
        oldest_created = sqlite3_column_int64(oldest, 1);
    } else if (rc != SQLITE_DONE) {
        goto sql_fail;
    }
    if ((rc = sqlite3_step(leases)) != SQLITE_ROW)
        goto sql_fail;
    live = sqlite3_column_int64(leases, 0);
    expired = sqlite3_column_int64(leases, 1) - live;

    if (o->json) {
        outbox__sbuf_printf(&out, "{\"now\":\"%s\",\"now_ms\":%" PRId64 ",\"total\":%" PRId64 ",\"by_state\":{",
                            replay_fmt_time(now, buf), now, all);
        for (int s = 0; s < OUTBOX_STATE_COUNT; s++)
            outbox__sbuf_printf(&out, "%s\"%s\":%" PRId64, s ? "," : "", replay_state_names[s], total[s]);
        outbox__sbuf_printf(&out,
                            "},\"dead\":%" PRId64 ",\"pending_due\":%" PRId64 ",\"pending_waiting\":%" PRId64
                            ",\"leases_live\":%" PRId64 ",\"leases_expired\":%" PRId64 ",\"oldest_due_pending\":",
                            total[OUTBOX_STATE_DEAD], due_n, total[OUTBOX_STATE_PENDING] - due_n, live, expired);
        if (oldest_id) {
            outbox__sbuf_puts(&out, "{\"id\":");
            tools_json_cstr(&out, oldest_id);
            outbox__sbuf_printf(&out, ",\"created_at\":\"%s\",\"created_at_ms\":%" PRId64 ",\"age_ms\":%" PRId64 "}",
                                replay_fmt_time(oldest_created, buf), oldest_created, now - oldest_created);
        } else {
            outbox__sbuf_puts(&out, "null");
        }
        outbox__sbuf_puts(&out, ",\"by_topic\":[");
        if (replay_emit(&out) != 0) {
            rc = EXIT_FAIL;
            goto done;
        }
    } else {
        printf("%-10s %12" PRId64 "\n", "total", all);
        printf("%-10s %12" PRId64 "  (due %" PRId64 ", waiting for available_at/backoff %" PRId64 ")\n", "pending",
               total[OUTBOX_STATE_PENDING], due_n, total[OUTBOX_STATE_PENDING] - due_n);
        printf("%-10s %12" PRId64 "  (live leases %" PRId64 ", expired %" PRId64 ")\n", "sending", total[OUTBOX_STATE_SENDING],
               live, expired);
        printf("%-10s %12" PRId64 "\n", "published", total[OUTBOX_STATE_PUBLISHED]);
        printf("%-10s %12" PRId64 "\n", "dead", total[OUTBOX_STATE_DEAD]);
        if (oldest_id) {
            printf("oldest due pending: %s ago, created %s, id ", replay_fmt_dur(now - oldest_created, d),
                   replay_fmt_time(oldest_created, buf));
            replay_print_clean(stdout, (const unsigned char *)oldest_id, strlen(oldest_id), 0);
            putchar('\n');
        } else {
            puts("oldest due pending: - (none due)");
        }
        if (all)
            printf("\n%-*s  %10s %10s %10s %10s %10s\n", (int)topic_w, "TOPIC", "PENDING", "SENDING", "PUBLISHED",
                   "DEAD", "TOTAL");
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
    free(oldest_id);
    sqlite3_finalize(by_topic);
    sqlite3_finalize(due);
    sqlite3_finalize(oldest);
    sqlite3_finalize(leases);
    sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    sqlite3_close_v2(db);
    return rc;
}
