/*
 * sched.c: units of work. One unit is one SQLite transaction, run on a libuv
 * worker thread so that the loop keeps turning while it runs: it writes the
 * marks queued since the last unit, then claims the next batch if the window
 * has room; claimed rows are sent once it committed. Also the timers that
 * start units (kick, scan, busy retry, a parked batch's flush), and the
 * cross-thread state of a unit's transaction (r->lock) that attached
 * connections wait on. When a drain is over: drain.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "claim.h"
#include "relay_int.h"

/* Published messages of a batch wait for the rest of it at most this long
 * (ms) before they are marked on their own rows (outbox__win_flush_parked).
 * Longer in idempotent mode: a message published again after a crash is
 * not appended again (its marker), and its batch finishes later there (a
 * message behind one of its key from an earlier call waits for that call's
 * reply, see idem_publish.c). */
#define PARKED_MS 20
#define PARKED_IDEM_MS 250

static uint64_t parked_ms(const outbox_relay *r)
{
    return r->cfg.s.idempotent ? PARKED_IDEM_MS : PARKED_MS;
}

/* Marks handed to one unit at most (see do_work); the unit stops writing
 * them earlier when its budget runs out (TXN_BUDGET_NS). A published
 * batch's marks cost one write, so a queue shorter than this goes whole,
 * without a walk of the queue to cut it (a walk from message to message
 * cost about 50 us per unit of 512 rows between two units). */
#define MARKS_PER_TXN 2048

/* A unit's transaction holds the database's write lock: it stops writing
 * marks and sizes its claim to end after about this long (ns), so that an
 * application's writer never waits much longer for the lock. */
#define TXN_BUDGET_NS 4000000u

/* With no other writer in sight (no other connection committed in the last
 * CONTENDED_MS and none is attached), the lock gap comes once units held
 * the lock for LONE_BUDGET_NS, and lasts the least a timer gives (1 ms): a
 * writer that shows up meanwhile waits for it once, at most about that
 * long, and its commit brings the gaps of TXN_BUDGET_NS back. */
#define LONE_BUDGET_NS 50000000u
#define CONTENDED_MS 1000u

static void on_scan(uv_timer_t *t);
static void on_busy_retry(uv_timer_t *t);
static void do_work(outbox_relay *r);

void outbox__sched_arm_scan(outbox_relay *r, uint64_t delay)
{
    if (r->state != R_RUNNING)
        return;
    if (delay > r->cfg.s.scan_interval_ms)
        delay = r->cfg.s.scan_interval_ms;
    uv_timer_start(&r->sched.scan_timer, on_scan, delay, 0);
}

/* After a claim that found less than it wanted: sleep until the next row
 * becomes due or the next foreign lease expires, at most scan_interval.
 * p: the plan, when it says no row is leased or waiting (then the next
 * thing due is a batch lease's expiry, which it has). */
static void arm_next_due(outbox_relay *r, int64_t now, const claim_plan *p)
{
    int64_t due, lease, next;
    if (p) {
        due = INT64_MAX;
        lease = p->next_lease;
    } else {
        sqlite3_bind_int64(Q(r, q_next_due), 1, now);
        sqlite3_bind_int64(Q(r, q_next_lease), 1, now);
        /* INT64_MAX: none, or the query failed (then the scan interval). */
        if (outbox__relay_step_int(r, Q(r, q_next_due), INT64_MAX, &due) != 0)
            due = INT64_MAX;
        if (outbox__relay_step_int(r, Q(r, q_next_lease), INT64_MAX, &lease) != 0)
            lease = INT64_MAX;
    }
    next = due < lease ? due : lease;
    if (next == INT64_MAX || next - now > (int64_t)r->cfg.s.scan_interval_ms)
        outbox__sched_arm_scan(r, r->cfg.s.scan_interval_ms);
    else
        outbox__sched_arm_scan(r, next > now ? (uint64_t)(next - now) + 1 : 1);
}

/* How often a failure that goes on (a full disk) is logged again. */
#define FAIL_REMIND_MS 30000

/* A unit failed with rc (OUTBOX_E*; sqlite_rc the SQLite code behind it, or
 * 0, and sys the system's errno, or 0): nothing was written. Never sleep on
 * the loop thread: try again from a timer. A failure other than a lock is
 * logged when it begins or changes, then every FAIL_REMIND_MS (a group's
 * relay: not again), like an unreachable Redis: a full disk fails every
 * unit until space is freed. */
static void db_busy_retry(outbox_relay *r, int rc, int sqlite_rc, int sys, const char *what)
{
    int locked = rc == OUTBOX_EBUSY;
    /* A lock is held for a transaction's length, usually a few ms: retry
     * every few ms, or a writer committing constantly would push the retries
     * far apart and delay every message by them. Other errors (I/O, disk
     * full) back off further. */
    uint64_t cap = locked ? 8 : 500, now = uv_now(r->loop);
    char why[sizeof r->sched.fail_why];
    r->sched.busy_delay_ms = r->sched.busy_delay_ms ? r->sched.busy_delay_ms * 2 : 1;
    if (r->sched.busy_delay_ms > cap)
        r->sched.busy_delay_ms = cap;
    uv_timer_start(&r->sched.busy_timer, on_busy_retry, r->sched.busy_delay_ms, 0);
    if (locked) {
        LOG(r, OUTBOX_LOG_DEBUG, "msg=\"database locked, retrying\" during=%s retry_ms=%llu", what,
            (unsigned long long)r->sched.busy_delay_ms);
        return;
    }
    /* errno says something only after a failed system call. */
    if (sys && ((sqlite_rc & 0xff) == SQLITE_IOERR || (sqlite_rc & 0xff) == SQLITE_FULL ||
                (sqlite_rc & 0xff) == SQLITE_CANTOPEN))
        snprintf(why, sizeof why, "%s (%s)", sqlite_rc ? sqlite3_errstr(sqlite_rc) : outbox_strerror(rc),
                 strerror(sys));
    else
        snprintf(why, sizeof why, "%s", sqlite_rc ? sqlite3_errstr(sqlite_rc) : outbox_strerror(rc));
    if (!r->sched.fail_since || strcmp(why, r->sched.fail_why) != 0) {
        if (!r->sched.fail_since)
            r->sched.fail_since = now ? now : 1;
        r->sched.fail_logged = now;
        outbox__strlcpy(r->sched.fail_why, why, sizeof r->sched.fail_why);
        LOG(r, OUTBOX_LOG_ERROR, "msg=\"database error, retrying\" db=%s during=%s error=\"%s\" retry_ms=%llu",
            r->cfg.db_path, what, why, (unsigned long long)r->sched.busy_delay_ms);
    } else if (!r->redis.shared && now - r->sched.fail_logged >= FAIL_REMIND_MS) {
        /* (A group's relay says it once: a directory of tenants would
         * repeat a line per failing database every 30 s; the group's
         * /healthz and /metrics name it while it lasts.) */
        r->sched.fail_logged = now;
        LOG(r, OUTBOX_LOG_ERROR, "msg=\"database error, still retrying\" db=%s during=%s error=\"%s\" for_ms=%llu",
            r->cfg.db_path, what, why, (unsigned long long)(now - r->sched.fail_since));
    } else {
        LOG(r, OUTBOX_LOG_DEBUG, "msg=\"database error, retrying\" during=%s error=\"%s\" retry_ms=%llu", what, why,
            (unsigned long long)r->sched.busy_delay_ms);
    }
}

static void txn_open(outbox_relay *r, int open)
{
    if (!r->lock.sync_ok)
        return;
    uv_mutex_lock(&r->lock.mutex);
    r->lock.txn_open = open;
    if (!open) {
        __atomic_store_n(&r->lock.yield, 0, __ATOMIC_RELAXED);
        uv_cond_broadcast(&r->lock.cond);
    }
    uv_mutex_unlock(&r->lock.mutex);
}

/*
 * The relay's connection when it meets a lock. Inside a unit (on a worker
 * thread) it waits in naps of 100 us, up to UNIT_BUSY_NS, so that the unit
 * starts right after another connection's commit instead of a timer's
 * retry later (docs/ARCHITECTURE.md, "Lock waits"). Anywhere else (the loop
 * thread never waits on a lock) it gives up at once.
 */
#define UNIT_BUSY_NS 20000000u

int outbox__sched_busy_handler(void *arg, int count)
{
    static __thread uint64_t start;
    outbox_relay *r = arg;
    struct timespec nap = {0, 100000};
    uint64_t now;
    if (!__atomic_load_n(&r->lock.in_unit, __ATOMIC_RELAXED))
        return 0;
    now = uv_hrtime();
    if (count == 0)
        start = now;
    if (now - start >= UNIT_BUSY_NS)
        return 0;
    nanosleep(&nap, NULL);
    return 1;
}

/* An attached connection waits for the lock (attach.c): the unit ends
 * soon, but only after YIELD_AFTER_NS of marks and with a claim of
 * YIELD_CLAIM rows, so that a writer committing all the time cannot stop
 * the relay (docs/ARCHITECTURE.md, "Lock waits"). */
#define YIELD_AFTER_NS 1000000u
#define YIELD_CLAIM 128

static int should_yield(outbox_relay *r)
{
    return __atomic_load_n(&r->lock.yield, __ATOMIC_RELAXED) != 0;
}

/*
 * The unit's transaction, on a libuv worker thread: the marks handed to it,
 * then a claim if the window has room. One runs at a time. While it runs,
 * the loop thread does not touch the relay's connection, the in-flight seq
 * set or the key map (it changes them only in unit_done), and the messages
 * handed over are finished ones it no longer changes; the worker logs
 * nothing and counts nothing (unit_done does, from what outbox__mark_write
 * recorded). u->rc is 0 or an OUTBOX_E* code, u->sqlite_rc the SQLite code
 * behind it (0 if none).
 */
static void unit_txn(outbox_relay *r)
{
    struct relay_unit *u = &r->sched.unit;
    msg *m;
    size_t i;
    int rc;

    __atomic_store_n(&r->lock.in_unit, 1, __ATOMIC_RELAXED);
    r->db.last_rc = 0;
    rc = outbox__relay_step_done(r, Q(r, q_begin));
    u->t0 = uv_hrtime(); /* the budget counts from the lock */
    if (rc != 0) {
        u->rc = rc;
        u->sqlite_rc = r->db.last_rc;
        u->sys_errno = sqlite3_system_errno(r->db.conn);
        u->what = "begin";
        return;
    }
    txn_open(r, 1);
    for (m = u->marks, i = 0; i < u->nmarks; m = m->next, i++) {
        rc = outbox__mark_write(r, m, u->now);
        if (rc != 0) {
            u->what = "mark";
            goto rollback;
        }
        /* Half the budget for marks when a claim follows, so that XADDs
         * keep flowing while marks pile up; the rest go back to the queue
         * (unit_done). */
        if (i + 1 < u->nmarks && !u->stopping && (i & 15) == 15 && !outbox__win_group_next(m) &&
            uv_hrtime() - u->t0 > (should_yield(r) ? YIELD_AFTER_NS
                                                     : u->want_claim ? TXN_BUDGET_NS / 2 : TXN_BUDGET_NS)) {
            u->nwritten = i + 1;
            break;
        }
    }
    if (u->want_claim && u->nwritten) {
        /* The marks not written stay in the window. */
        uint64_t occupied = u->held + u->rest + (u->nmarks - u->nwritten);
        unsigned room = occupied < outbox__win_cap(r) ? (unsigned)(outbox__win_cap(r) - occupied) : 0;
        if (u->want > room)
            u->want = room;
        u->want_claim = u->want > 0;
    }
    if (u->want_claim) {
        /* This relay holds nothing but the messages whose marks this unit
         * wrote (all of them): the claim may take the simple way (claim.c). */
        r->cw.holds_nothing = u->held == 0 && u->rest == 0 && u->nwritten == 0;
        /* As many rows as the rest of the budget fits, from the cost of a
         * claimed row in recent claims; at least 32. */
        uint64_t spent = uv_hrtime() - u->t0;
        uint64_t fit = spent < TXN_BUDGET_NS ? (TXN_BUDGET_NS - spent) / (r->sched.claim_row_ns ? r->sched.claim_row_ns : 1) : 0;
        if (should_yield(r))
            fit = YIELD_CLAIM; /* an application's writer waits: a bounded claim, so the window keeps moving */
        else if (fit < 32)
            fit = 32;
        if (u->want > fit)
            u->want = (unsigned)fit;
        u->t_claim0 = uv_hrtime();
        rc = outbox__claim(r, u->want, u->now, &u->claimed, &u->nclaimed, &u->ndead, &u->settled, &u->ndeferred);
        if (rc != 0) {
            u->what = "claim";
            goto rollback;
        }
    }
    rc = outbox__relay_step_done(r, Q(r, q_commit));
    if (rc != 0) {
        u->what = u->nmarks ? "mark" : "claim";
        goto rollback;
    }
    txn_open(r, 0);
    u->rc = 0;
    u->t_end = uv_hrtime();
    if (u->nclaimed + u->ndead >= 32) {
        uint64_t per = (u->t_end - u->t_claim0) / (u->nclaimed + u->ndead);
        r->sched.claim_row_ns = r->sched.claim_row_ns ? (r->sched.claim_row_ns * 3 + per) / 4 : per;
    }
    return;

rollback:
    u->rc = rc;
    u->sqlite_rc = r->db.last_rc;
    u->sys_errno = sqlite3_system_errno(r->db.conn);
    sqlite3_exec(r->db.conn, "ROLLBACK", NULL, NULL, NULL);
    txn_open(r, 0);
    for (i = 0; i < u->nclaimed; i++)
        outbox__msg_free(u->claimed[i]);
    free(u->claimed);
    u->claimed = NULL;
    u->nclaimed = u->ndead = u->ndeferred = 0;
    while ((m = u->settled) != NULL) {
        u->settled = m->next;
        outbox__msg_free(m);
    }
}

static void unit_run(uv_work_t *w)
{
    outbox_relay *r = w->data;
    unit_txn(r);
    __atomic_store_n(&r->lock.in_unit, 0, __ATOMIC_RELAXED);
}

/* Where a message claimed behind one of an earlier batch stands now: the
 * worker chained it tentatively; that one may have been answered since. */
static void settle_chain(outbox_relay *r, msg *c)
{
    msg *a = c->chain_after;
    c->chain_after = NULL;
    if (a->state == MSG_HELD || a->state == MSG_SENT) {
        while (a->key_next)
            a = a->key_next;
        a->key_next = c; /* sent once that one is accepted */
        return;
    }
    c->behind = 0;
    if (a->state == MSG_WAITING || (a->state == MSG_DONE && a->outcome == OUT_PUBLISHED))
        return; /* appended already: it may go now */
    /* That one failed or was handed back: this one must not overtake it. */
    outbox__win_hand_back(r, c, "held back: an earlier message of its key failed",
                          "held back: an earlier message of its key failed");
}

static void unit_done(uv_work_t *w, int status)
{
    outbox_relay *r = w->data;
    struct relay_unit *u = &r->sched.unit;
    msg *m, **send;
    size_t i, nsend = 0;
    int pages, unsent = 0;
    wait_set ws = {0};

    (void)status;
    r->sched.running = 0;
    pages = r->ckpt.own_pages;
    r->ckpt.own_pages = 0;
    if (pages)
        outbox__wake_checkpoint(r, pages);
    if (u->rc != 0) {
        /* Nothing was written: the marks go back to the head of the queue. */
        outbox__win_requeue(r, u->marks);
        u->marks = NULL;
        if (r->state == R_STOPPING)
            r->sched.stop_failures++;
        db_busy_retry(r, u->rc, u->sqlite_rc, u->sys_errno, u->what);
        r->hooks.stop_check(r);
        return;
    }
    r->sched.busy_delay_ms = 0;
    r->sched.stop_failures = 0;
    if (r->sched.fail_since) {
        LOG(r, OUTBOX_LOG_INFO, "msg=\"database writable again\" db=%s failed_for_ms=%llu", r->cfg.db_path,
            (unsigned long long)(uv_now(r->loop) - r->sched.fail_since));
        r->sched.fail_since = 0;
        r->sched.fail_why[0] = '\0';
    }
    if (u->nwritten) {
        /* The budget ran out: the marks not written go back to the queue. */
        msg *last = u->marks;
        for (i = 1; i < u->nwritten; i++)
            last = last->next;
        outbox__win_requeue(r, last->next);
        last->next = NULL;
        u->nmarks = u->nwritten;
    }
    if (u->want_claim && u->nclaimed + u->ndead > 0) {
        /* Claim batch size and the whole transaction's time (marks included). */
        r->stats.claims_total++;
        outbox__hist_observe(&r->stats.h_claim_size, (double)(u->nclaimed + u->ndead));
        outbox__hist_observe(&r->stats.h_claim_secs, (double)(u->t_end - u->t_claim0) / 1e9);
    }
    /* Leave the write lock free for a while, so that application writers
     * and other relays get it: at least 1 ms, or a quarter of the time the
     * units held it since the last gap, once they held it for
     * TXN_BUDGET_NS; units back to back until then, so that short units
     * (a batch of a few hundred rows takes about 1 ms) do not spend more
     * time in gaps than in transactions. No gap after a short unit while an
     * application connection is attached: its busy handler wakes the moment
     * a unit ends (docs/ARCHITECTURE.md, "The lock gap"). */
    {
        uint64_t ns = u->t_end - u->t0, ms = 0, loop_now = uv_now(r->loop);
        int attached = __atomic_load_n(&r->lock.attached, __ATOMIC_RELAXED) != 0;
        int contended = attached || (r->wake.foreign_commit_ms && loop_now - r->wake.foreign_commit_ms < CONTENDED_MS);
        if (r->sched.last_end_ns && u->t0 - r->sched.last_end_ns >= 1000000)
            r->sched.held_ns = 0; /* the lock was free for 1 ms or more since the last unit */
        r->sched.held_ns += ns;
        r->sched.last_end_ns = u->t_end;
        if (ns < 1000000 && attached) {
            r->sched.held_ns = 0;
        } else if (r->sched.held_ns >= (contended ? TXN_BUDGET_NS : LONE_BUDGET_NS) || r->sched.unsent) {
            /* After every unit while claimed messages could not be sent (a
             * node down): their rows, handed back, would be claimed again
             * at once, unit after unit. */
            ms = contended ? r->sched.held_ns / 4000000 : 1;
            if (!ms)
                ms = 1;
            r->sched.held_ns = 0;
        }
        r->sched.lock_free_until = uv_now(r->loop) + ms;
    }

    /* The claimed messages join the window first: a chain may be settled
     * against a message whose mark was just written. */
    send = malloc((u->nclaimed ? u->nclaimed : 1) * sizeof *send);
    for (i = 0; i < u->nclaimed; i++) {
        msg *c = u->claimed[i];
        if (c->batch)
            outbox__batch_live(r, c->batch);
        else
            outbox__win_seq_add(r, c->seq); /* a lease of its own (see r->win.seqset) */
        r->win.inflight++;
        if (c->took_over)
            LOG(r, OUTBOX_LOG_INFO, "msg=\"took over an expired lease\" id=%s seq=%lld token=%lld", c->id,
                (long long)c->seq, (long long)c->token);
        if (c->chain_after)
            settle_chain(r, c);
        if (c->klen)
            outbox__win_key_put(r, c);
    }
    /* Committed: the marked messages leave the window. */
    while ((m = u->marks) != NULL) {
        u->marks = m->next;
        if (m->outcome == OUT_RELEASE) {
            unsent = 1; /* handed back: its row is due again now */
            r->win.releases--;
        }
        outbox__mark_account(r, m);
        r->win.inflight--;
        outbox__win_retire(r, m);
    }
    if (u->nmarks)
        LOG(r, OUTBOX_LOG_DEBUG, "msg=marked count=%zu", u->nmarks);
    /* Rows dead-lettered (or handed back) by the claim itself. */
    while ((m = u->settled) != NULL) {
        u->settled = m->next;
        outbox__mark_account(r, m);
        outbox__msg_free(m);
    }
    /* Send every claimed message that is not held behind an earlier one of
     * its key; those go when their predecessor is accepted. */
    for (i = 0; i < u->nclaimed; i++) {
        msg *c = u->claimed[i];
        if (c->state != MSG_HELD || c->behind)
            continue; /* handed back by settle_chain, or chained */
        if (!outbox__link_up(r)) {
            /* Lost while the claim ran: sent once Redis is back. */
            if (!outbox__pub_park(r, c)) {
                unsent = 1;
                outbox__win_hand_back(r, c, "connection lost", "held back: connection lost");
            }
        } else if (send) {
            send[nsend++] = c;
        } else {
            outbox__win_hand_back(r, c, "out of memory", "held back: out of memory");
        }
    }
    free(u->claimed);
    u->claimed = NULL;

    if (outbox__wake_resume(r) || r->wake.dv_pending) {
        /* Another connection may have written its commit while the watch
         * was off (see outbox__wake_look). Looked for again and again after a unit
         * that did something, or while other connections commit (one did
         * in the last 2 s): an idle relay keeps its one look per scan. */
        if (r->wake.dv_pending || u->nmarks || u->nclaimed || u->ndead ||
            uv_now(r->loop) - r->wake.foreign_commit_ms < 2000)
            outbox__wake_look(r);
        else
            outbox__wake_dv_changed(r);
        r->wake.dv_pending = 0;
    }
    /* Claim again at once after a full claim, or after one that moved held
     * rows out of the way (defer): the next walks reach rows behind them. */
    r->sched.last_claim_full = u->want_claim && ((u->nclaimed + u->ndead) >= u->want || u->ndeferred > 0);
    if (r->sched.last_claim_full || r->win.marks_head || r->sched.again) {
        /* No lock gap due: the next unit starts now, before this one's
         * messages are sent, so that its transaction runs while the loop
         * writes their XADDs (it reuses u: nothing below reads it). */
        if (r->sched.lock_free_until <= uv_now(r->loop) && !uv_is_active((uv_handle_t *)&r->sched.kick_timer)) {
            r->sched.again = 0;
            do_work(r);
        } else {
            outbox__sched_schedule(r);
        }
    } else if (r->state == R_RUNNING) {
        /* One look at the plan may answer both: with no row leased or
         * waiting, what comes due next, and whether a drain is over. */
        claim_plan plan;
        int rows_idle = outbox__claim_plan(r, u->now, &plan) == 0 && !plan.rows_busy;
        arm_next_due(r, u->now, rows_idle ? &plan : NULL);
        outbox__drain_check(r, u->now, rows_idle ? &plan : NULL);
    }
    r->sched.again = 0;
    if (r->cfg.s.idempotent)
        outbox__pub_idem_send(r, send, nsend);
    else
        for (i = 0; i < nsend; i++)
            outbox__pub_send(r, send[i], &ws);
    outbox__pub_flush_groups(r, &ws);
    /* Messages are freed only in a later unit_done: their states can be read. */
    for (i = 0; i < nsend; i++)
        if (send[i]->state == MSG_DONE)
            unsent = 1;
    r->sched.unsent = unsent;
    free(send);
    r->hooks.stop_check(r);
}

static void do_work(outbox_relay *r)
{
    struct relay_unit *u = &r->sched.unit;
    msg *m, *last = NULL;
    uint64_t held;
    unsigned want = 0;
    int want_claim;

    if (r->sched.running) {
        r->sched.again = 1;
        return;
    }
    /* Nothing before the database opened (R_WAITING, or a stop since). */
    if (uv_is_active((uv_handle_t *)&r->sched.busy_timer) || r->state == R_STOPPED || !r->stop.began)
        return;
    if (outbox__win_flush_parked(r, parked_ms(r))) {
        /* Parked later than the timer's batch: looked at again in time. */
        uv_timer_stop(&r->sched.parked_timer);
        outbox__sched_parked(r);
    }
    /* The marks written below leave the window in this same transaction,
     * so their room can be claimed now; otherwise a window emptied by one
     * batch of marks would wait for the scan timer. */
    held = r->win.inflight - r->win.marks_len;
    outbox__link_check(r);
    want_claim = r->state == R_RUNNING && outbox__link_up(r) && held < outbox__win_cap(r);
    if (want_claim) {
        want = outbox__win_cap(r) - (unsigned)held;
        if (want > r->cfg.s.batch)
            want = r->cfg.s.batch;
    }
    if (!r->win.marks_head && !want_claim) {
        /* Held by a problem, nothing else would run a unit: the scan
         * timer comes back for the check (a timer tick a second). */
        if (outbox__link_problem(r))
            outbox__sched_arm_scan(r, r->cfg.s.scan_interval_ms);
        r->hooks.stop_check(r);
        return;
    }
    memset(u, 0, sizeof *u);
    u->now = outbox_now_ms();
    /* At most MARKS_PER_TXN marks per transaction, so one unit of work stays
     * short (while stopping the worker writes every mark it is given); the
     * rest go in the next one. They are detached: replies keep queueing
     * marks while the unit runs. */
    u->marks = r->win.marks_head;
    if (r->win.marks_len <= MARKS_PER_TXN) {
        /* All of them: no walk of the queue. */
        last = r->win.marks_tail;
        u->nmarks = r->win.marks_len;
    } else {
        /* A batch's published group is never split (its lead writes the
         * batch's record for all of them). */
        for (m = r->win.marks_head; m && (u->nmarks < MARKS_PER_TXN || (last && outbox__win_group_next(last)));
             m = m->next) {
            last = m;
            u->nmarks++;
        }
    }
    if (last) {
        r->win.marks_head = last->next;
        last->next = NULL;
        r->win.marks_len -= u->nmarks;
        if (!r->win.marks_head)
            r->win.marks_tail = NULL;
    } else {
        u->marks = NULL;
    }
    /* Marks left in the queue stay in the window: claim only the room left
     * with them (the worker lowers it again if it writes fewer marks). */
    u->rest = r->win.marks_len;
    u->held = held;
    /* Hand-backs first: a claim before their rows are written would skip
     * those rows (still leased) and take their keys' later rows, which must
     * then be handed back too, and so on through the backlog (a window of
     * thousands handed back at once by a Sentinel switch did that for
     * seconds). Written, their rows are the first a claim finds. */
    if (!u->marks)
        r->win.releases = 0; /* none can be queued: keeps a miscount from holding claims */
    if (r->win.releases)
        want_claim = 0;
    if (want_claim) {
        uint64_t occupied = held + u->rest;
        want = occupied < outbox__win_cap(r) ? (unsigned)(outbox__win_cap(r) - occupied) : 0;
        if (want > r->cfg.s.batch)
            want = r->cfg.s.batch;
        want_claim = want > 0;
    }
    if (want_claim && outbox__win_seq_reserve(r, want) != 0) {
        LOG(r, OUTBOX_LOG_WARN, "msg=\"out of memory: no claim this time\" want=%u", want);
        want_claim = 0;
        want = 0;
        if (!u->nmarks) {
            db_busy_retry(r, OUTBOX_ENOMEM, 0, 0, "claim");
            return;
        }
    }
    u->want_claim = want_claim;
    u->want = want;
    u->stopping = r->state != R_RUNNING;
    r->sched.work.data = r;
    outbox__wake_pause(r);
    if (uv_queue_work(r->loop, &r->sched.work, unit_run, unit_done) != 0) {
        /* Cannot happen with a valid loop; put the marks back and retry. */
        outbox__win_requeue(r, u->marks);
        u->marks = NULL;
        db_busy_retry(r, OUTBOX_EINVAL, 0, 0, "queue");
        return;
    }
    r->sched.running = 1;
}

static void on_kick(uv_timer_t *t)
{
    do_work(t->data);
}

static void on_parked(uv_timer_t *t)
{
    outbox__sched_schedule(t->data);
}

void outbox__sched_parked(outbox_relay *r)
{
    if (r->state == R_STOPPED || uv_is_active((uv_handle_t *)&r->sched.parked_timer))
        return;
    /* One more millisecond: the flush takes batches parked PARKED_MS or
     * longer, by the loop's clock. */
    uv_timer_start(&r->sched.parked_timer, on_parked, parked_ms(r) + 1, 0);
}

void outbox__sched_schedule(outbox_relay *r)
{
    if (r->state == R_STOPPED || !r->stop.began)
        return;
    if (!uv_is_active((uv_handle_t *)&r->sched.kick_timer) && !uv_is_active((uv_handle_t *)&r->sched.busy_timer)) {
        uint64_t now = uv_now(r->loop);
        uv_timer_start(&r->sched.kick_timer, on_kick, r->sched.lock_free_until > now ? r->sched.lock_free_until - now : 0, 0);
    }
}

static void on_scan(uv_timer_t *t)
{
    outbox__sched_schedule(t->data);
}

static void on_busy_retry(uv_timer_t *t)
{
    do_work(t->data);
}

int outbox__sched_init(outbox_relay *r)
{
    uv_timer_init(r->loop, &r->sched.kick_timer);
    uv_timer_init(r->loop, &r->sched.scan_timer);
    uv_timer_init(r->loop, &r->sched.busy_timer);
    uv_timer_init(r->loop, &r->sched.drain_timer);
    uv_timer_init(r->loop, &r->sched.parked_timer);
    r->sched.kick_timer.data = r->sched.scan_timer.data = r->sched.busy_timer.data = r->sched.drain_timer.data =
        r->sched.parked_timer.data = r;
    outbox__drain_start(r);
    return 5;
}

void outbox__sched_close(outbox_relay *r, uv_close_cb cb)
{
    uv_close((uv_handle_t *)&r->sched.kick_timer, cb);
    uv_close((uv_handle_t *)&r->sched.scan_timer, cb);
    uv_close((uv_handle_t *)&r->sched.busy_timer, cb);
    uv_close((uv_handle_t *)&r->sched.drain_timer, cb);
    uv_close((uv_handle_t *)&r->sched.parked_timer, cb);
}
