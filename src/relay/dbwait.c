/*
 * dbwait.c: waiting for the database. With wait_for_db, a database that
 * create could not open for a reason that passes by itself (a full disk, a
 * lock: outbox__relay_db_heals) does not fail create; start waits for it
 * instead, the way the Redis connection waits for an unreachable server.
 * The problem is logged once, then a reminder every 30 s (a new reason is
 * logged at once), and the open is tried again after 100 ms, doubling to
 * 5 s, with jitter. Each try runs on a worker thread, because an open reads
 * the disk and may meet a lock, neither of which the loop waits for. The
 * try that opens the database hands over to the lifecycle
 * (hooks.db_opened). Loop thread, except try_run.
 */
#include <stdio.h>
#include <string.h>

#include "relay_int.h"

#define WAIT_MIN_MS 100
#define WAIT_MAX_MS 5000
#define REMIND_MS 30000

static void arm(outbox_relay *r);

static uint64_t mono_ms(void)
{
    return uv_hrtime() / 1000000u;
}

/* Logs the last failure: a new reason at once (a warning while it may heal,
 * an error for what someone must fix), the same one again every REMIND_MS,
 * and otherwise only at debug level. */
static void report(outbox_relay *r, int e, const outbox__sqlfail *f, uint64_t retry_ms)
{
    struct relay_dbwait *w = &r->dbwait;
    int heals = outbox__relay_db_heals(e, f);
    outbox_log_level level = heals ? OUTBOX_LOG_WARN : OUTBOX_LOG_ERROR;
    uint64_t now = mono_ms();
    char q[sizeof w->why + 64];

    outbox__logfmt_quote(q, sizeof q, w->why);
    if (strcmp(w->why, w->logged) != 0) {
        LOG(r, level, "msg=\"%s\" db=%s err=%s error=%s attempts=%u retry_ms=%llu",
            heals ? "database unavailable, waiting for it" : "database unusable, waiting for it to be fixed",
            r->cfg.db_path, outbox_err_name(e), q, w->failures, (unsigned long long)retry_ms);
        outbox__strlcpy(w->logged, w->why, sizeof w->logged);
        w->logged_ms = now;
    } else if (now - w->logged_ms >= REMIND_MS) {
        LOG(r, level, "msg=\"database still unavailable, retrying\" db=%s for_ms=%llu err=%s error=%s attempts=%u",
            r->cfg.db_path, (unsigned long long)(now - w->since_ms), outbox_err_name(e), q, w->failures);
        w->logged_ms = now;
    } else {
        LOG(r, OUTBOX_LOG_DEBUG, "msg=\"database open failed, retrying\" db=%s err=%s attempts=%u retry_ms=%llu",
            r->cfg.db_path, outbox_err_name(e), w->failures, (unsigned long long)retry_ms);
    }
}

void outbox__dbwait_begin(outbox_relay *r, int e, const outbox__sqlfail *f, const char *why)
{
    struct relay_dbwait *w = &r->dbwait;
    w->waiting = 1;
    w->failures = 1;
    w->since_ms = mono_ms();
    w->try_e = e;
    w->try_f = *f;
    outbox__strlcpy(w->why, why, sizeof w->why);
}

void outbox__dbwait_defer(outbox_relay *r)
{
    struct relay_dbwait *w = &r->dbwait;
    w->waiting = 1;
    w->deferred = 1;
    w->since_ms = mono_ms();
    outbox__strlcpy(w->why, "opening", sizeof w->why);
}

/* On a worker thread: nothing else touches r->db while the relay waits. */
static void try_run(uv_work_t *wk)
{
    outbox_relay *r = wk->data;
    struct relay_dbwait *w = &r->dbwait;
    w->try_why[0] = '\0';
    /* One try: the backoff is the wait for a lock here. */
    w->try_e = outbox__relay_db_open(r, 0, &w->try_f, w->try_why, sizeof w->try_why);
    if (w->try_e != 0)
        outbox__relay_db_close(r);
}

static void try_done(uv_work_t *wk, int status)
{
    outbox_relay *r = wk->data;
    struct relay_dbwait *w = &r->dbwait;
    (void)status;
    w->running = 0;
    if (w->try_e == 0) {
        w->waiting = 0;
        if (r->state == R_WAITING && w->deferred) {
            w->deferred = 0;
            r->hooks.db_opened(r);
        } else if (r->state == R_WAITING) {
            LOG(r, OUTBOX_LOG_INFO, "msg=\"database available\" db=%s waited_ms=%llu attempts=%u", r->cfg.db_path,
                (unsigned long long)(mono_ms() - w->since_ms), w->failures + 1);
            r->hooks.db_opened(r);
        }
        /* Opened while stopping: the connection goes with the relay. */
        r->hooks.stop_check(r);
        return;
    }
    w->failures++;
    outbox__strlcpy(w->why, w->try_why[0] ? w->try_why : outbox_strerror(w->try_e), sizeof w->why);
    if (r->state == R_WAITING && r->open_failed) {
        /* A group's relay: the group says it and tries again itself. */
        r->open_failed(r, w->try_e, w->why, r->open_failed_data);
        r->hooks.stop_check(r);
        return;
    }
    if (r->state == R_WAITING)
        arm(r);
    r->hooks.stop_check(r);
}

static void on_try(uv_timer_t *t)
{
    outbox_relay *r = t->data;
    struct relay_dbwait *w = &r->dbwait;
    if (r->state != R_WAITING || w->running)
        return;
    w->work.data = r;
    if (uv_queue_work(r->loop, &w->work, try_run, try_done) == 0)
        w->running = 1;
    else
        uv_timer_start(&w->timer, on_try, WAIT_MAX_MS, 0); /* cannot happen with a valid loop */
}

/* Logs the last failure and arms the next try; failures counts it. */
static void arm(outbox_relay *r)
{
    struct relay_dbwait *w = &r->dbwait;
    uint64_t d = outbox__backoff_ms(WAIT_MIN_MS, WAIT_MAX_MS, w->failures);
    report(r, w->try_e, &w->try_f, d);
    uv_timer_start(&w->timer, on_try, d, 0);
}

int outbox__dbwait_start(outbox_relay *r)
{
    uv_timer_init(r->loop, &r->dbwait.timer);
    r->dbwait.timer.data = r;
    if (r->dbwait.waiting && r->dbwait.deferred)
        uv_timer_start(&r->dbwait.timer, on_try, 0, 0);
    else if (r->dbwait.waiting)
        arm(r);
    return 1;
}

void outbox__dbwait_stop(outbox_relay *r)
{
    uv_timer_stop(&r->dbwait.timer);
}

void outbox__dbwait_close(outbox_relay *r, uv_close_cb cb)
{
    uv_close((uv_handle_t *)&r->dbwait.timer, cb);
}

int outbox_relay_db_waiting(const outbox_relay *r, char *why, size_t len)
{
    if (!r)
        return OUTBOX_EINVAL;
    if (why && len)
        outbox__strlcpy(why, r->dbwait.waiting ? r->dbwait.why : "", len);
    return r->dbwait.waiting;
}
