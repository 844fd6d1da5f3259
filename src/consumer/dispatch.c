/*
 * dispatch.c: handing entries to the handler for the consumer-group helper
 * (consumer_int.h): dispatch (dead-lettering what cannot be applied),
 * the Redis dedup module's begin/complete/abandon callbacks, the SQLite
 * inbox (the inbox row and the handler in one transaction),
 * outbox_consumer_done, and the inbox clean-up timer. Loop thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "consumer/consumer_int.h"
#include "store/sqlite_util.h"

/* ------------------------------------------------------------------ */
/* dedup: Redis */

static void run_handler(entry *e)
{
    outbox_consumer *c = e->c;
    e->handler_running = 1;
    c->s.handler(c, &e->dv, c->s.data);
}

/* A complete that got no answer (the connection broke or went silent)
 * may not have reached Redis: the processing key would then expire after
 * the lease and a redelivery apply the effect again. */
static int unanswered(int status)
{
    return status == OUTBOX_ECLOSED || status == OUTBOX_ETIMEDOUT || status == OUTBOX_ECONNECT ||
           status == OUTBOX_EPROTO;
}

static void on_completed(outbox_dedup *d, int status, outbox_dedup_result r, void *data)
{
    entry *e = data;
    outbox_consumer *c = e->c;
    (void)d;
    (void)r;
    if (unanswered(status) && c->state == CS_RUNNING && uv_now(c->loop) < e->complete_by) {
        /* Sent again, on the retry timer, until it is answered or the
         * processing key would have expired. */
        if (!e->completing)
            LOG(c, OUTBOX_LOG_INFO, "msg=\"dedup complete unanswered, sent again until answered\" id=%s err=%s",
                e->msg_id, outbox_err_name(status));
        e->completing = 1;
        outbox__consumer_schedule_retry(e, "dedup complete unanswered");
        return;
    }
    if (status == OUTBOX_ELEASE && e->completing)
        LOG(c, OUTBOX_LOG_WARN,
            "msg=\"dedup complete sent again found the processing key gone: the unanswered one was applied, or "
            "the lease expired (then a redelivery may apply the effect twice)\" id=%s",
            e->msg_id);
    else if (status == OUTBOX_ELEASE)
        LOG(c, OUTBOX_LOG_WARN,
            "msg=\"dedup lease expired before complete: the effect may be applied twice; raise the dedup lease\" "
            "id=%s",
            e->msg_id);
    else if (status != 0)
        LOG(c, OUTBOX_LOG_WARN,
            "msg=\"dedup complete failed: a redelivery will apply the effect again after the lease\" id=%s err=%s",
            e->msg_id, outbox_err_name(status));
    e->completing = 0;
    outbox__consumer_ack(e);
}

void outbox__consumer_complete(entry *e)
{
    outbox_consumer *c = e->c;
    int rc = outbox_dedup_complete(c->dedup, c->stream, outbox__consumer_dedup_id(e), on_completed, e);
    if (rc != 0)
        on_completed(c->dedup, rc, 0, e);
}

static void on_abandoned(outbox_dedup *d, int status, outbox_dedup_result r, void *data)
{
    entry *e = data;
    (void)d;
    (void)r;
    (void)status; /* if this fails the processing key expires after its lease */
    outbox__consumer_schedule_retry(e, "handler failed");
}

static void on_begun(outbox_dedup *d, int status, outbox_dedup_result r, void *data)
{
    entry *e = data;
    outbox_consumer *c = e->c;
    (void)d;
    if (status != 0) {
        LOG(c, OUTBOX_LOG_WARN, "msg=\"dedup begin failed; not processing\" id=%s err=%s detail=\"%s\"", e->msg_id,
            outbox_err_name(status), outbox_dedup_errstr(c->dedup));
        /* An error answer about this message's key (WRONGTYPE), or a key
         * too long to make (an id or a database's name longer than any
         * relay writes), is the message's problem and counts towards
         * max_deliveries; Redis being unreachable is not. */
        if (status == OUTBOX_EREDIS || status == OUTBOX_EINVAL)
            outbox__consumer_schedule_retry(e, "dedup error");
        else
            outbox__consumer_schedule_recheck(e, "dedup unavailable");
        return;
    }
    switch (r) {
    case OUTBOX_DEDUP_FIRST:
        run_handler(e);
        break;
    case OUTBOX_DEDUP_DONE:
        c->st.duplicates++;
        LOG(c, OUTBOX_LOG_DEBUG, "msg=\"duplicate skipped\" id=%s entry=%s", e->msg_id, e->entry_id);
        outbox__consumer_ack(e);
        break;
    default:
        c->st.busy++;
        outbox__consumer_schedule_recheck(e, "another consumer is applying it");
        break;
    }
}

/* ------------------------------------------------------------------ */
/* dedup: SQLite inbox */

static void run_inbox(entry *e)
{
    outbox_consumer *c = e->c;
    int rc, status;

    rc = sqlite3_exec(c->db, "BEGIN IMMEDIATE", NULL, NULL, NULL);
    if (rc != SQLITE_OK) {
        outbox__consumer_schedule_recheck(e, sqlite3_errmsg(c->db));
        return;
    }
    /* Keyed as the Redis markers are: "<db>:<id>" for a message that names
     * its database, so the same id from two databases is two messages. */
    sqlite3_bind_text(c->q_insert, 1, outbox__consumer_dedup_id(e), -1, SQLITE_STATIC);
    sqlite3_bind_text(c->q_insert, 2, c->stream, -1, SQLITE_STATIC);
    sqlite3_bind_text(c->q_insert, 3, e->entry_id, -1, SQLITE_STATIC);
    sqlite3_bind_int64(c->q_insert, 4, outbox_now_ms());
    rc = sqlite3_step(c->q_insert);
    sqlite3_reset(c->q_insert);
    if (rc != SQLITE_DONE) {
        int dup = (sqlite3_extended_errcode(c->db) & 0xff) == SQLITE_CONSTRAINT;
        sqlite3_exec(c->db, "ROLLBACK", NULL, NULL, NULL);
        if (dup) {
            c->st.duplicates++;
            outbox__consumer_ack(e);
        } else {
            outbox__consumer_schedule_recheck(e, sqlite3_errmsg(c->db));
        }
        return;
    }
    e->dv.db = c->db;
    status = c->s.handler(c, &e->dv, c->s.data);
    e->dv.db = NULL;
    if (status == 0 && sqlite3_exec(c->db, "COMMIT", NULL, NULL, NULL) == SQLITE_OK) {
        c->st.applied++;
        outbox__consumer_ack(e);
        return;
    }
    if (!sqlite3_get_autocommit(c->db))
        sqlite3_exec(c->db, "ROLLBACK", NULL, NULL, NULL);
    c->st.failed++;
    outbox__consumer_schedule_retry(e, status ? "handler failed" : "commit failed");
}

/* ------------------------------------------------------------------ */
/* dispatch and outbox_consumer_done */

void outbox__consumer_dispatch(entry *e)
{
    outbox_consumer *c = e->c;
    int rc;
    char why[96];

    if (!e->env) {
        outbox__consumer_dead_letter(e, "malformed entry");
        return;
    }
    if (e->dv.deliveries > c->s.max_deliveries) {
        snprintf(why, sizeof why, "delivered %llu times, more than max_deliveries %u",
                 (unsigned long long)e->dv.deliveries, c->s.max_deliveries);
        outbox__consumer_dead_letter(e, why);
        return;
    }
    c->st.delivered++;
    switch (c->s.dedup) {
    case OUTBOX_DEDUP_REDIS:
        rc = outbox_dedup_begin(c->dedup, c->stream, outbox__consumer_dedup_id(e), on_begun, e);
        if (rc != 0)
            on_begun(c->dedup, rc, 0, e);
        break;
    case OUTBOX_DEDUP_SQLITE:
        run_inbox(e);
        break;
    default:
        run_handler(e);
        break;
    }
}

void outbox_consumer_done(outbox_consumer *c, const outbox_delivery *dv, int status)
{
    entry *e = (entry *)dv;
    int rc;
    if (!c || !dv || !e->handler_running || c->s.dedup == OUTBOX_DEDUP_SQLITE)
        return;
    e->handler_running = 0;
    if (status == 0) {
        c->st.applied++;
        if (c->s.dedup == OUTBOX_DEDUP_REDIS) {
            /* A margin under the lease: a complete sent later could find
             * another consumer's processing key. */
            e->complete_by = uv_now(c->loop) + c->s.dedup_lease_ms - c->s.dedup_lease_ms / 10;
            outbox__consumer_complete(e);
        } else {
            outbox__consumer_ack(e);
        }
    } else {
        c->st.failed++;
        LOG(c, OUTBOX_LOG_WARN, "msg=\"handler failed; entry left pending for retry\" id=%s entry=%s status=%d",
            e->msg_id, e->entry_id, status);
        if (c->s.dedup == OUTBOX_DEDUP_REDIS) {
            rc = outbox_dedup_abandon(c->dedup, c->stream, outbox__consumer_dedup_id(e), on_abandoned, e);
            if (rc != 0)
                on_abandoned(c->dedup, rc, 0, e);
        } else {
            outbox__consumer_schedule_retry(e, "handler failed");
        }
    }
}
void outbox__consumer_on_gc_timer(uv_timer_t *t)
{
    outbox_consumer *c = t->data;
    int rc;
    if (!c->db)
        return;
    /* Small batches, so the consumer's own writers are not held up. */
    sqlite3_bind_int64(c->q_gc, 1, outbox_now_ms() - (int64_t)c->s.inbox_retention_ms);
    rc = sqlite3_step(c->q_gc);
    sqlite3_reset(c->q_gc);
    /* A full batch: the next one soon, keeping the periodic repeat (a
     * repeat of 0 here would end the clean-up for good). */
    if (rc == SQLITE_DONE && sqlite3_changes(c->db) == 1000)
        uv_timer_start(&c->gc_timer, outbox__consumer_on_gc_timer, 10, uv_timer_get_repeat(&c->gc_timer));
}

