/*
 * marks.c: writing a message's mark inside a unit's transaction (worker
 * thread) and accounting for it once the transaction committed (loop
 * thread). Every mark is fenced: it names the owner and the lease token it
 * claimed with, and changes nothing if either changed since. A message of a
 * batch lease (m->batch) is fenced by its batch record; its failure, hand
 * back or dead-letter is written to its row (which leaves the batch), its
 * publication only by the one write of its batch's published record (the
 * batch's lead message, see relay_batch).
 */
#include <string.h>

#include "relay_int.h"

/* The wait before a failed message's next attempt: never below
 * backoff-min-ms, as documented. */
static uint64_t retry_delay_ms(const outbox_relay *r, int64_t attempts)
{
    uint64_t d = outbox__backoff_ms(r->cfg.s.backoff_min_ms, r->cfg.s.backoff_max_ms, attempts);
    return d < r->cfg.s.backoff_min_ms ? r->cfg.s.backoff_min_ms : d;
}

static void bind_fence(sqlite3_stmt *st, int first, const outbox_relay *r, const msg *m)
{
    sqlite3_bind_int64(st, first, m->seq);
    sqlite3_bind_text(st, first + 1, r->cfg.worker_id, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, first + 2, m->token);
}

/* The batch's published record, written by its lead message's mark. */
static int batch_published(outbox_relay *r, relay_batch *b, int64_t now)
{
    sqlite3_stmt *st = Q(r, q_batch_published);
    int rc;
    sqlite3_bind_int64(st, 1, b->lo);
    sqlite3_bind_text(st, 2, r->cfg.worker_id, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 3, b->token);
    sqlite3_bind_int64(st, 4, now);
    rc = sqlite3_step(st);
    sqlite3_reset(st);
    if (rc != SQLITE_DONE)
        return outbox__relay_sqlerr(r, rc);
    b->applied = sqlite3_changes(r->db.conn) > 0;
    return 0;
}

/* Runs a message's bound mark statement; notes what it was and whether it
 * changed the row (a fenced mark changes nothing). */
static int step_mark(outbox_relay *r, sqlite3_stmt *st, msg *m, const char *what)
{
    int rc = sqlite3_step(st);
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    if (rc != SQLITE_DONE)
        return outbox__relay_sqlerr(r, rc);
    m->mark_what = what;
    m->mark_applied = sqlite3_changes(r->db.conn) > 0;
    return 0;
}

/* A batch message's own mark: its row leaves the batch. */
static int batch_row_mark(outbox_relay *r, msg *m, int64_t now)
{
    sqlite3_stmt *st;
    int64_t due = now, attempts = m->attempts;
    int state = OUTBOX_STATE_PENDING;
    const char *what, *text = NULL;

    switch (m->outcome) {
    case OUT_PUBLISHED:
        st = Q(r, q_batch_row_published);
        text = m->result;
        what = "published";
        break;
    case OUT_RETRY:
        st = Q(r, q_batch_failed);
        if (m->attempts >= (int64_t)r->cfg.s.max_attempts) {
            state = OUTBOX_STATE_DEAD;
            what = "dead";
        } else {
            what = "retry";
        }
        due = now + (int64_t)retry_delay_ms(r, m->attempts);
        text = m->result ? m->result : "unknown error";
        break;
    case OUT_DEAD:
        st = Q(r, q_batch_failed);
        state = OUTBOX_STATE_DEAD;
        text = m->result ? m->result : "invalid row";
        what = "dead";
        break;
    case OUT_RELEASE:
    default:
        st = Q(r, q_batch_release);
        attempts = m->attempts > 0 ? m->attempts - 1 : 0;
        what = "released";
        break;
    }
    bind_fence(st, 1, r, m);
    if (m->outcome == OUT_PUBLISHED) {
        sqlite3_bind_int64(st, 4, now);
        sqlite3_bind_text(st, 5, text, -1, SQLITE_STATIC);
    } else {
        sqlite3_bind_int(st, 4, state);
        sqlite3_bind_int64(st, 5, due);
        if (text)
            sqlite3_bind_text(st, 6, text, -1, SQLITE_STATIC);
    }
    sqlite3_bind_int64(st, 7, attempts);
    sqlite3_bind_int64(st, 8, m->batch->lo);
    return step_mark(r, st, m, what);
}

int outbox__mark_write(outbox_relay *r, msg *m, int64_t now)
{
    sqlite3_stmt *st;
    int rc;
    const char *what;

    if (m->batch) {
        if (m->outcome == OUT_PUBLISHED && !m->own_published) {
            if (m->batch_lead) {
                rc = batch_published(r, m->batch, now);
                if (rc != 0)
                    return rc;
            }
            m->mark_what = "published";
            m->mark_applied = m->batch->applied;
            return 0;
        }
        rc = batch_row_mark(r, m, now);
        if (rc == 0 && m->batch_lead)
            rc = batch_published(r, m->batch, now);
        return rc;
    }
    switch (m->outcome) {
    case OUT_PUBLISHED:
        st = Q(r, q_published);
        bind_fence(st, 1, r, m);
        sqlite3_bind_int64(st, 4, now);
        sqlite3_bind_text(st, 5, m->result, -1, SQLITE_STATIC);
        what = "published";
        break;
    case OUT_RETRY:
        st = Q(r, q_failed);
        bind_fence(st, 1, r, m);
        if (m->attempts >= (int64_t)r->cfg.s.max_attempts) {
            sqlite3_bind_int(st, 4, OUTBOX_STATE_DEAD);
            what = "dead";
        } else {
            sqlite3_bind_int(st, 4, OUTBOX_STATE_PENDING);
            what = "retry";
        }
        /* Its key's later rows wait as long: claims that meet them move
         * them behind it (defer). */
        sqlite3_bind_int64(st, 5, now + (int64_t)retry_delay_ms(r, m->attempts));
        sqlite3_bind_text(st, 6, m->result ? m->result : "unknown error", -1, SQLITE_STATIC);
        break;
    case OUT_DEAD:
        st = Q(r, q_failed);
        bind_fence(st, 1, r, m);
        sqlite3_bind_int(st, 4, OUTBOX_STATE_DEAD);
        sqlite3_bind_int64(st, 5, now);
        sqlite3_bind_text(st, 6, m->result ? m->result : "invalid row", -1, SQLITE_STATIC);
        what = "dead";
        break;
    case OUT_RELEASE:
    default:
        st = Q(r, q_release);
        bind_fence(st, 1, r, m);
        sqlite3_bind_int64(st, 4, now);
        what = "released";
        break;
    }
    return step_mark(r, st, m, what);
}

void outbox__mark_account(outbox_relay *r, msg *m)
{
    const char *what = m->mark_what ? m->mark_what : "released";
    if (!m->mark_applied) {
        r->stats.fenced_total++;
        LOG(r, OUTBOX_LOG_WARN,
            "msg=\"mark refused: lease taken over by another relay\" id=%s seq=%lld token=%lld mark=%s", m->id,
            (long long)m->seq, (long long)m->token, what);
        return;
    }
    {
        outbox__topic_stat *ts = outbox__topics_get(&r->stats.topics, m->topic ? m->topic : "_unknown");
        if (m->outcome == OUT_PUBLISHED)
            ts->published++;
        else if (m->outcome == OUT_DEAD || (m->outcome == OUT_RETRY && strcmp(what, "dead") == 0))
            ts->dead++;
        else if (m->outcome == OUT_RETRY)
            ts->retried++;
        if (m->outcome == OUT_RETRY)
            ts->failed++;
        if (m->outcome == OUT_RETRY && strcmp(what, "retry") == 0)
            r->stats.retries_total++;
    }
    if (m->outcome == OUT_PUBLISHED) {
        r->stats.published_total++;
        LOG(r, OUTBOX_LOG_DEBUG, "msg=published id=%s seq=%lld entry=%s", m->id, (long long)m->seq, m->result);
    } else if (m->outcome == OUT_RELEASE) {
        char q[256];
        outbox__logfmt_quote(q, sizeof q, m->result ? m->result : "");
        LOG(r, OUTBOX_LOG_DEBUG, "msg=\"handed back\" id=%s seq=%lld why=%s", m->id, (long long)m->seq, q);
    } else if (m->outcome == OUT_RETRY || m->outcome == OUT_DEAD) {
        char q[256];
        outbox__logfmt_quote(q, sizeof q, m->result ? m->result : "");
        r->stats.failed_total++;
        if (strcmp(what, "dead") == 0) {
            r->stats.dead_total++;
            LOG(r, OUTBOX_LOG_ERROR, "msg=\"dead-lettered\" id=%s seq=%lld attempts=%lld error=%s", m->id,
                (long long)m->seq, (long long)m->attempts, q);
        } else {
            LOG(r, OUTBOX_LOG_WARN, "msg=\"publish failed, will retry\" id=%s seq=%lld attempts=%lld error=%s",
                m->id, (long long)m->seq, (long long)m->attempts, q);
        }
    }
}

