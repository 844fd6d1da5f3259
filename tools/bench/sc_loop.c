/*
 * loop: how long does the embedded relay hold the application's event loop
 * while it drains a backlog?
 *
 * The relay runs on the bench's own loop. Two measures:
 *  - iteration busy time: a uv_check handle notes uv_hrtime() after every
 *    poll; an iteration's busy time is the time between two checks minus
 *    the time the loop spent waiting in the kernel in between
 *    (uv_metrics_idle_time). This counts everything the loop ran: timers,
 *    I/O callbacks, the relay's SQLite transactions.
 *  - timer lateness: a 1 ms one-shot timer, re-armed each time, and how late
 *    it fires (includes libuv's 1 ms timer granularity).
 * Reference, same run: the same measures on the same loop for 1 s with no
 * relay.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uv.h>

#include "bench.h"
#include "util/array.h"

typedef struct series {
    double *v;
    size_t n, cap;
} series;

static void series_push(series *s, double x)
{
    /* Without memory the sample is dropped. */
    if (s->n == s->cap && OUTBOX__GROW(s->v, &s->cap, s->n, 1, 4096) != 0)
        return;
    s->v[s->n++] = x;
}

typedef struct loop_run {
    uv_loop_t loop;
    uv_check_t check;
    uv_timer_t tick, stop_timer;
    outbox_relay *relay;
    FILE *log;
    uint64_t last_check_ns, last_idle_ns, tick_due_ns;
    uint64_t t0_ns, t_drained_ns;
    series busy, late;
    int closing;
} loop_run;

static void on_check(uv_check_t *h)
{
    loop_run *x = h->data;
    uint64_t now = uv_hrtime(), idle = uv_metrics_idle_time(&x->loop);
    if (x->last_check_ns) {
        uint64_t span = now - x->last_check_ns, waited = idle - x->last_idle_ns;
        series_push(&x->busy, (double)(span > waited ? span - waited : 0) / 1e6);
    }
    x->last_check_ns = now;
    x->last_idle_ns = idle;
}

static void on_tick(uv_timer_t *t)
{
    loop_run *x = t->data;
    uint64_t now = uv_hrtime();
    series_push(&x->late, (double)(now > x->tick_due_ns ? now - x->tick_due_ns : 0) / 1e6);
    x->tick_due_ns = uv_hrtime() + 1000000u;
    uv_timer_start(&x->tick, on_tick, 1, 0);
}

static void close_probes(loop_run *x)
{
    if (x->closing)
        return;
    x->closing = 1;
    uv_close((uv_handle_t *)&x->check, NULL);
    uv_close((uv_handle_t *)&x->tick, NULL);
    uv_close((uv_handle_t *)&x->stop_timer, NULL);
}

static void on_stop_timer(uv_timer_t *t)
{
    close_probes(t->data);
}

static void on_relay_stopped(outbox_relay *r, void *data)
{
    (void)r;
    close_probes(data);
}

static void on_drained(outbox_relay *r, void *data)
{
    loop_run *x = data;
    x->t_drained_ns = uv_hrtime();
    outbox_relay_stop(r, on_relay_stopped, x);
}

static void file_log(void *data, outbox_log_level level, const char *msg)
{
    static const char *names[] = {"debug", "info", "warn", "error"};
    if (data)
        fprintf(data, "level=%s %s\n", names[level & 3], msg);
}

/* With db NULL: the reference run, 1 s with no relay. */
static int run_loop(bench *b, const char *db, loop_run *x, char *err, size_t errlen)
{
    char logpath[PATH_MAX + 32];
    memset(x, 0, sizeof *x);
    uv_loop_init(&x->loop);
    uv_loop_configure(&x->loop, UV_METRICS_IDLE_TIME);
    uv_check_init(&x->loop, &x->check);
    uv_timer_init(&x->loop, &x->tick);
    uv_timer_init(&x->loop, &x->stop_timer);
    x->check.data = x->tick.data = x->stop_timer.data = x;
    if (db) {
        outbox_relay_settings s;
        int e;
        bench_path(b, logpath, sizeof logpath, "relay-loop.log");
        x->log = fopen(logpath, "a");
        outbox_relay_defaults(&s);
        s.db_path = db;
        s.redis_url = b->redis_url;
        s.drain = 1;
        s.on_drained = on_drained;
        s.on_drained_data = x;
        s.log = file_log;
        s.log_data = x->log;
        s.log_level = OUTBOX_LOG_WARN;
        e = outbox_relay_create(&x->relay, &x->loop, &s, err, errlen);
        if (e != 0) {
            close_probes(x);
            uv_run(&x->loop, UV_RUN_DEFAULT);
            uv_loop_close(&x->loop);
            if (x->log)
                fclose(x->log);
            return -1;
        }
    } else {
        uv_timer_start(&x->stop_timer, on_stop_timer, 1000, 0);
    }
    uv_check_start(&x->check, on_check);
    x->tick_due_ns = uv_hrtime() + 1000000u;
    uv_timer_start(&x->tick, on_tick, 1, 0);
    x->t0_ns = uv_hrtime();
    if (x->relay)
        outbox_relay_start(x->relay);
    uv_run(&x->loop, UV_RUN_DEFAULT);
    if (x->relay) {
        outbox_relay_destroy(x->relay);
        uv_run(&x->loop, UV_RUN_DEFAULT);
    }
    if (x->log)
        fclose(x->log);
    if (uv_loop_close(&x->loop) != 0) {
        snprintf(err, errlen, "the event loop did not close cleanly");
        return -1;
    }
    return 0;
}

int sc_loop(bench *b, bench_report *r)
{
    bench_shape sh = {BENCH_PAYLOAD, b->keys};
    char db[PATH_MAX + 32], err[512], n1[32];
    loop_run ref, run;
    double rate, bp999, bmax, b99, lp999, lmax, rbp999, rbmax, rlp999, rlmax;
    long n = b->messages;
    long long left;

    snprintf(r->title, sizeof r->title,
             "outbox_relay embedded in the bench's loop draining %ld messages (drain shape), default options", n);
    bench_path(b, db, sizeof db, "loop.db");
    bench_progress(b, "building a %ld-message backlog", n);
    if (bench_dataset_build(db, (uint64_t)n, &sh, 1000, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    bench_progress(b, "reference: idle loop, 1 s");
    if (run_loop(b, NULL, &ref, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    bench_progress(b, "embedded relay draining");
    if (run_loop(b, db, &run, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        free(ref.busy.v);
        free(ref.late.v);
        return -1;
    }
    left = bench_count_state(db, 0) + bench_count_state(db, 1);
    if (left != 0 || !run.t_drained_ns) {
        bench_fail(r, "the embedded relay stopped with %lld rows pending or sending", left);
        free(ref.busy.v);
        free(ref.late.v);
        free(run.busy.v);
        free(run.late.v);
        return -1;
    }
    rate = (double)n / ((double)(run.t_drained_ns - run.t0_ns) / 1e9);
    bench_sort(run.busy.v, run.busy.n);
    bench_sort(run.late.v, run.late.n);
    bench_sort(ref.busy.v, ref.busy.n);
    bench_sort(ref.late.v, ref.late.n);
    b99 = bench_quantile_sorted(run.busy.v, run.busy.n, 0.99);
    bp999 = bench_quantile_sorted(run.busy.v, run.busy.n, 0.999);
    bmax = run.busy.n ? run.busy.v[run.busy.n - 1] : 0;
    lp999 = bench_quantile_sorted(run.late.v, run.late.n, 0.999);
    lmax = run.late.n ? run.late.v[run.late.n - 1] : 0;
    rbp999 = bench_quantile_sorted(ref.busy.v, ref.busy.n, 0.999);
    rbmax = ref.busy.n ? ref.busy.v[ref.busy.n - 1] : 0;
    rlp999 = bench_quantile_sorted(ref.late.v, ref.late.n, 0.999);
    rlmax = ref.late.n ? ref.late.v[ref.late.n - 1] : 0;

    bench_row_add(r, "embedded drain", NULL, V_NONE, "%s msg/s, %zu loop iterations",
                  bench_thousands(n1, sizeof n1, rate), run.busy.n);
    bench_row_add(r, "iteration busy p99.9", "<= 5 ms", bp999 <= 5.0 ? V_PASS : V_FAIL, "%.2f ms", bp999);
    bench_row_add(r, "iteration busy p99 / max", NULL, V_NONE, "%.2f / %.2f ms", b99, bmax);
    bench_row_add(r, "1 ms timer late p99.9 / max", NULL, V_NONE, "%.2f / %.2f ms", lp999, lmax);
    bench_row_add(r, "reference idle loop: busy", NULL, V_NONE, "p99.9 %.3f / max %.3f ms", rbp999, rbmax);
    bench_row_add(r, "reference idle loop: late", NULL, V_NONE, "p99.9 %.2f / max %.2f ms", rlp999, rlmax);
    bench_json_int(r, "messages", n);
    bench_json_num(r, "msgs_per_s", rate, 0);
    bench_json_int(r, "iterations", (long long)run.busy.n);
    bench_json_num(r, "busy_p99_ms", b99, 3);
    bench_json_num(r, "busy_p999_ms", bp999, 3);
    bench_json_num(r, "busy_max_ms", bmax, 3);
    bench_json_num(r, "timer_late_p999_ms", lp999, 3);
    bench_json_num(r, "timer_late_max_ms", lmax, 3);
    bench_json_num(r, "ref_busy_p999_ms", rbp999, 3);
    bench_json_num(r, "ref_timer_late_p999_ms", rlp999, 3);
    bench_json_num(r, "ref_timer_late_max_ms", rlmax, 3);
    bench_json_num(r, "target_ms", 5.0, 1);
    free(ref.busy.v);
    free(ref.late.v);
    free(run.busy.v);
    free(run.late.v);
    bench_unlink_db(db);
    return 0;
}
