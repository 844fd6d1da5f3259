/*
 * drain.c: drain mode (outbox_relay_settings.drain). Whether a drain is
 * over, checked after a unit that found no more rows to claim; its
 * timeout (drain_timeout_ms); a drain that cannot finish (Redis cannot be
 * used as configured); a drain armed again; its result. The drain timer
 * is one of the scheduling timers (r->sched, sched.c). Loop thread.
 */
#include "claim.h"
#include "relay_int.h"

/* What a drain has left by now (OUTBOX__SQL_DRAIN): left[0] rows due,
 * left[1] rows waiting for a retry, left[2] leased rows, each counted up to
 * limit rows (-1: all). Loop thread, while no unit runs. */
static int drain_left(outbox_relay *r, int64_t now, int64_t limit, int64_t left[3])
{
    sqlite3_stmt *st = Q(r, q_drain);
    int rc, i;
    sqlite3_bind_int64(st, 1, now);
    sqlite3_bind_int64(st, 2, limit);
    rc = sqlite3_step(st);
    for (i = 0; i < 3; i++)
        left[i] = rc == SQLITE_ROW ? sqlite3_column_int64(st, i) : -1;
    sqlite3_reset(st);
    return rc == SQLITE_ROW ? 0 : outbox__relay_sqlerr(r, rc);
}

/* Done once nothing is in flight and nothing is left, rows waiting for a
 * retry included (they are claimed again when due: the scan timer is armed
 * for the next due row). Rows delayed by the application do not count (see
 * OUTBOX__SQL_DRAIN). */
void outbox__drain_check(outbox_relay *r, int64_t now, const claim_plan *p)
{
    int64_t left[3];
    if (!r->cfg.s.drain || r->sched.drained || r->sched.drain_error || r->state != R_RUNNING || r->win.inflight ||
        r->win.marks_head)
        return;
    /* Nothing but new rows (the plan), and the cursor past the last one:
     * done. A row past the cursor is new unless written with a state of its
     * own, which the full count tells. */
    if (!(p && !p->batches_leased && !p->new_left) &&
        (drain_left(r, now, 1, left) != 0 || left[0] + left[1] + left[2] > 0))
        return;
    r->sched.drained = 1;
    LOG(r, LOG_LIFE(r), "msg=drained published=%llu dead=%llu", (unsigned long long)r->stats.published_total,
        (unsigned long long)r->stats.dead_total);
    r->cfg.s.on_drained(r, r->cfg.s.on_drained_data); /* lifecycle.c sets a stop if the user gave none */
}

/* A drain cut short (its timeout, or a failure): once no unit has the
 * connection, what is left goes into left (-1 each while the database is
 * not open yet) and the drain is over; 0 while a unit runs (t runs cb
 * again in a millisecond). */
static int drain_cut(outbox_relay *r, uv_timer_t *t, uv_timer_cb cb, int64_t left[3])
{
    left[0] = left[1] = left[2] = -1;
    if (r->sched.running) {
        /* The unit's worker has the connection: count once it is done. */
        uv_timer_start(t, cb, 1, 0);
        return 0;
    }
    if (r->state == R_RUNNING)
        drain_left(r, outbox_now_ms(), -1, left);
    r->sched.drained = 1;
    return 1;
}

/* drain_timeout_ms expired before the drain was done: the drain ends as
 * if done (on_drained, or the stop lifecycle.c set), with
 * outbox_relay_drain_result() saying so and the rows left in the log. */
static void on_drain_timeout(uv_timer_t *t)
{
    outbox_relay *r = t->data;
    int64_t left[3];
    if (r->sched.drained || (r->state != R_RUNNING && r->state != R_WAITING) ||
        !drain_cut(r, t, on_drain_timeout, left))
        return;
    if (r->state != R_RUNNING)
        LOG(r, OUTBOX_LOG_WARN, "msg=\"drain timeout while waiting for the database\" db=%s", r->cfg.db_path);
    r->sched.drain_timed_out = 1;
    LOG(r, OUTBOX_LOG_WARN,
        "msg=\"drain timeout: rows left\" timeout_ms=%llu due=%lld waiting_retry=%lld leased=%lld inflight=%llu "
        "published=%llu dead=%llu",
        (unsigned long long)r->cfg.s.drain_timeout_ms, (long long)left[0], (long long)left[1], (long long)left[2],
        (unsigned long long)r->win.inflight, (unsigned long long)r->stats.published_total,
        (unsigned long long)r->stats.dead_total);
    r->cfg.s.on_drained(r, r->cfg.s.on_drained_data);
}

/* The drain cannot finish (outbox__drain_fail): it ends as a drain
 * timeout does, the log saying why and what is left. The rows claimed so
 * far are handed back by the stop that on_drained starts. */
static void on_drain_failed(uv_timer_t *t)
{
    outbox_relay *r = t->data;
    const char *why = outbox__link_problem(r);
    int64_t left[3];
    if (r->sched.drained || r->state != R_RUNNING || !drain_cut(r, t, on_drain_failed, left))
        return;
    LOG(r, OUTBOX_LOG_ERROR,
        "msg=\"drain failed: %s\" err=%s due=%lld waiting_retry=%lld leased=%lld inflight=%llu published=%llu "
        "dead=%llu",
        why ? why : outbox_strerror(r->sched.drain_error), outbox_err_name(r->sched.drain_error), (long long)left[0],
        (long long)left[1], (long long)left[2], (unsigned long long)r->win.inflight,
        (unsigned long long)r->stats.published_total, (unsigned long long)r->stats.dead_total);
    r->cfg.s.on_drained(r, r->cfg.s.on_drained_data);
}

void outbox__drain_fail(outbox_relay *r, int code)
{
    if (!r->cfg.s.drain || r->sched.drained || r->sched.drain_error || r->state != R_RUNNING)
        return;
    r->sched.drain_error = code;
    /* Not from here: this runs inside reply and connection callbacks, and
     * on_drained may stop or destroy the relay. The drain timeout, if any,
     * has nothing left to do. */
    uv_timer_start(&r->sched.drain_timer, on_drain_failed, 0, 0);
}

void outbox__drain_rearm(outbox_relay *r)
{
    if (!r->cfg.s.drain || r->state != R_RUNNING)
        return;
    r->sched.drained = 0;
    r->sched.drain_error = 0;
    r->sched.drain_timed_out = 0;
    r->hooks.schedule(r); /* sched.c: drain.c is below it */
}

int outbox_relay_drain_result(const outbox_relay *r)
{
    if (!r)
        return OUTBOX_EINVAL;
    if (!r->sched.drained)
        return OUTBOX_ESTATE;
    if (r->sched.drain_error)
        return r->sched.drain_error;
    return r->sched.drain_timed_out ? OUTBOX_ETIMEDOUT : 0;
}

void outbox__drain_start(outbox_relay *r)
{
    if (r->cfg.s.drain && r->cfg.s.drain_timeout_ms)
        uv_timer_start(&r->sched.drain_timer, on_drain_timeout, r->cfg.s.drain_timeout_ms, 0);
}
