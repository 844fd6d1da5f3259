/*
 * sustained: a writer commits 20 rows per transaction, 1,000 transactions
 * per second (20k msg/s, synchronous=FULL), for 60 s (20 s with --quick)
 * while the outbox-relay daemon publishes and deletes (--retention-ms
 * 2000). Does the relay keep up without the backlog or the database file
 * growing?
 *
 * The writer is a thread with its own connection on a paced schedule:
 * transaction i starts at t0 + i ms, or at once when it is behind (the
 * achieved rate is measured). Each transaction's commit time (wall clock,
 * us) is noted after COMMIT returned. A reader thread waits in XREAD BLOCK
 * on the 8 streams and notes when it sees each message (the latency
 * scenario's method: commit-to-seen, cross-process). Every second the main
 * thread samples the backlog (messages committed and not yet seen in a
 * stream), the database file and its WAL, the rows left in the table
 * (min/max seq) and the relay's CPU.
 */
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>

#include "bench.h"

#define SUS_ID_PREFIX "bench-sustained-"
#define SUS_ROWS 20       /* rows per transaction */
#define SUS_TXN_RATE 1000 /* transactions per second */
#define SUS_RETENTION_MS 2000

typedef struct sus_sample {
    double t;              /* seconds since the writer started */
    long long backlog;     /* committed, not yet seen in a stream */
    long long rows;        /* rows in the table (max seq - min seq + 1) */
    long long min_seq;
    long long db_bytes, wal_bytes;
    long long db_pages, free_pages; /* the database's size with what the WAL holds, and its free pages */
} sus_sample;

typedef struct sus_run {
    bench *b;
    sqlite3 *db;
    outbox_writer *w;
    bench_shape sh;
    uint64_t ntxn, n; /* messages 1..n in ntxn transactions; 0 is the warm-up */
    int64_t *txn_commit_us;
    double *commit_ms;
    uint64_t t0_us, t_end_us;
    uint64_t committed; /* atomic */
    uint64_t late_txns; /* transactions started more than 5 ms behind schedule */
    int writer_done;    /* atomic */
    char writer_err[256];

    bench_reader rd;
} sus_run;

/* Commits messages [from, to] in one transaction; the commit's wall clock. */
static int sus_commit(sus_run *x, uint64_t from, uint64_t to, int64_t *at, double *took_ms)
{
    bench_msgbuf mb;
    uint64_t tc;
    if (bench_exec(x->db, "BEGIN IMMEDIATE", x->writer_err, sizeof x->writer_err) != 0)
        return -1;
    for (uint64_t s = from; s <= to; s++) {
        bench_shape_message(&x->sh, s, &mb);
        snprintf(mb.id, sizeof mb.id, SUS_ID_PREFIX "%022llu", (unsigned long long)s);
        mb.m.id = mb.id;
        if (outbox_enqueue(x->w, &mb.m, NULL) != 0) {
            snprintf(x->writer_err, sizeof x->writer_err, "enqueue: %s", outbox_writer_errmsg(x->w));
            sqlite3_exec(x->db, "ROLLBACK", NULL, NULL, NULL);
            return -1;
        }
    }
    tc = bench_mono_us();
    if (bench_exec(x->db, "COMMIT", x->writer_err, sizeof x->writer_err) != 0) {
        sqlite3_exec(x->db, "ROLLBACK", NULL, NULL, NULL);
        return -1;
    }
    *took_ms = (double)(bench_mono_us() - tc) / 1000.0;
    *at = bench_wall_us();
    return 0;
}

static void *sus_writer(void *arg)
{
    sus_run *x = arg;
    x->t0_us = bench_mono_us();
    for (uint64_t i = 0; i < x->ntxn; i++) {
        uint64_t due = x->t0_us + i * (1000000u / SUS_TXN_RATE), now = bench_mono_us();
        if (now < due) {
            struct timespec ts = {0, (long)(due - now) * 1000};
            while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
                ;
        } else if (now - due > 5000) {
            x->late_txns++;
        }
        if (sus_commit(x, i * SUS_ROWS + 1, (i + 1) * SUS_ROWS, &x->txn_commit_us[i], &x->commit_ms[i]) != 0)
            break;
        __atomic_add_fetch(&x->committed, SUS_ROWS, __ATOMIC_RELEASE);
    }
    x->t_end_us = bench_mono_us();
    __atomic_store_n(&x->writer_done, 1, __ATOMIC_RELEASE);
    return NULL;
}

static long long file_bytes(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (long long)st.st_size : 0;
}

/* A one-integer PRAGMA on the sampler's read connection, or -1. */
static long long pragma_ll(sqlite3 *rd, const char *sql)
{
    sqlite3_stmt *st = NULL;
    long long v = -1;
    if (sqlite3_prepare_v2(rd, sql, -1, &st, NULL) == SQLITE_OK && sqlite3_step(st) == SQLITE_ROW)
        v = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    return v;
}

/* min and max seq of the table on the sampler's own read connection. */
static void table_span(sqlite3 *rd, long long *min_seq, long long *rows)
{
    sqlite3_stmt *st = NULL;
    *min_seq = *rows = -1;
    if (sqlite3_prepare_v2(rd, "SELECT min(seq), max(seq) FROM outbox", -1, &st, NULL) != SQLITE_OK)
        return;
    if (sqlite3_step(st) == SQLITE_ROW && sqlite3_column_type(st, 0) != SQLITE_NULL) {
        *min_seq = sqlite3_column_int64(st, 0);
        *rows = sqlite3_column_int64(st, 1) - *min_seq + 1;
    } else if (sqlite3_column_type(st, 0) == SQLITE_NULL) {
        *rows = 0;
    }
    sqlite3_finalize(st);
}

/* One figure of every sample as a JSON array (the field at off, a long long). */
static void json_per_s(bench_report *r, const char *name, const sus_sample *samp, int nsamp, size_t off)
{
    outbox__sbuf b = {0};
    outbox__sbuf_printf(&b, "[");
    for (int i = 0; i < nsamp; i++)
        outbox__sbuf_printf(&b, "%s%lld", i ? "," : "", *(const long long *)(const void *)((const char *)&samp[i] + off));
    outbox__sbuf_printf(&b, "]");
    bench_json_raw(r, name, &b);
    outbox__sbuf_free(&b);
}

static double window_mean(const sus_sample *s, int from, int to)
{
    double sum = 0;
    int k = 0;
    for (int i = from; i < to; i++, k++)
        sum += (double)s[i].backlog;
    return k ? sum / k : 0;
}

int sc_sustained(bench *b, bench_report *r)
{
    sus_run x;
    double duration = b->quick ? 20.0 : 60.0; /* quick: room for the first retention pass */
    char db[PATH_MAX + 32], wal[PATH_MAX + 40], logpath[PATH_MAX + 64], err[512], ret[32];
    outbox_writer_settings ws;
    sqlite3 *rd = NULL;
    pthread_t reader, writer;
    int reader_started = 0, writer_started = 0, rc = -1, nsamp = 0, status = 0;
    sus_sample *samp = NULL;
    double *lat = NULL;
    size_t nl = 0;
    pid_t pid = 0;
    struct rusage ru;
    int64_t cpu0 = -1, cpu1 = -1;
    uint64_t missing = 0;

    memset(&x, 0, sizeof x);
    x.b = b;
    x.sh.payload_len = BENCH_PAYLOAD;
    x.sh.keys = b->keys;
    x.ntxn = (uint64_t)(duration * SUS_TXN_RATE);
    x.n = x.ntxn * SUS_ROWS;
    snprintf(r->title, sizeof r->title,
             "a writer thread committing %d transactions/s of %d rows (synchronous=FULL), %.0f s, the relay daemon "
             "publishing with --retention-ms %d",
             SUS_TXN_RATE, SUS_ROWS, duration, SUS_RETENTION_MS);
    x.txn_commit_us = calloc(x.ntxn, sizeof *x.txn_commit_us);
    x.commit_ms = calloc(x.ntxn, sizeof *x.commit_ms);
    x.rd.seen_us = calloc(x.n + 1, sizeof *x.rd.seen_us);
    lat = calloc(x.n, sizeof *lat);
    samp = calloc((size_t)duration + 64, sizeof *samp);
    if (!x.txn_commit_us || !x.commit_ms || !x.rd.seen_us || !lat || !samp) {
        bench_fail(r, "out of memory");
        goto out;
    }
    bench_redis_flush(b);
    bench_path(b, db, sizeof db, "sustained.db");
    snprintf(wal, sizeof wal, "%s-wal", db);
    bench_path(b, logpath, sizeof logpath, "relay-sustained.log");
    if (bench_db_fresh(db, 0, &x.db, err, sizeof err) != 0 ||
        bench_exec(x.db, "PRAGMA synchronous=FULL", err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        goto out;
    }
    outbox_writer_defaults(&ws);
    ws.log = NULL;
    ws.warn_not_durable = 0;
    if (outbox_writer_create(&x.w, x.db, &ws) != 0) {
        bench_fail(r, "cannot create the writer");
        goto out;
    }
    if (sqlite3_open_v2(db, &rd, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK) {
        bench_fail(r, "cannot open the database for sampling: %s", sqlite3_errmsg(rd));
        goto out;
    }
    sqlite3_busy_timeout(rd, 1000);
    snprintf(ret, sizeof ret, "%d", SUS_RETENTION_MS);
    {
        const char *argv[] = {b->relay_bin, "--db", db, "--redis", b->redis_url, "--log-level", "warn",
                              "--retention-ms", ret, NULL};
        if (bench_spawn(argv, NULL, logpath, &pid) != 0) {
            bench_fail(r, "cannot start the relay: %s", strerror(errno));
            goto out;
        }
    }
    x.rd.b = b;
    x.rd.id_prefix = SUS_ID_PREFIX;
    x.rd.n = x.n;
    x.rd.count = 2000;
    if (pthread_create(&reader, NULL, bench_reader_main, &x.rd) != 0) {
        bench_fail(r, "cannot start the reader thread");
        goto out;
    }
    reader_started = 1;
    {
        /* The warm-up message: once it is seen, the relay is connected and
         * the streams exist. */
        int64_t at;
        double took;
        uint64_t t = bench_mono_us();
        if (sus_commit(&x, 0, 0, &at, &took) != 0) {
            bench_fail(r, "writer: %s", x.writer_err);
            goto out;
        }
        while (__atomic_load_n(&x.rd.seen, __ATOMIC_ACQUIRE) == 0 && !x.rd.err[0] && bench_mono_us() - t < 15000000u)
            bench_sleep_ms(5);
        if (__atomic_load_n(&x.rd.seen, __ATOMIC_ACQUIRE) == 0) {
            bench_fail(r, "the warm-up message was not published within 15 s%s%s", x.rd.err[0] ? ": " : "",
                       x.rd.err);
            goto out;
        }
    }
    cpu0 = bench_proc_cpu_ns(pid);
    if (pthread_create(&writer, NULL, sus_writer, &x) != 0) {
        bench_fail(r, "cannot start the writer thread");
        goto out;
    }
    writer_started = 1;
    bench_progress(b, "writing %.0f s at %d msg/s", duration, SUS_TXN_RATE * SUS_ROWS);
    {
        uint64_t start = bench_mono_us(), next = start + 1000000u;
        /* One sample a second while writing, then until the backlog is
         * gone (30 s at most). */
        for (;;) {
            uint64_t now = bench_mono_us();
            int done = __atomic_load_n(&x.writer_done, __ATOMIC_ACQUIRE);
            sus_sample *s;
            if (now < next) {
                bench_sleep_ms((unsigned)((next - now) / 1000) + 1);
                continue;
            }
            next += 1000000u;
            if (done && cpu1 < 0)
                cpu1 = bench_proc_cpu_ns(pid);
            if (nsamp >= (int)duration + 63)
                break;
            s = &samp[nsamp++];
            s->t = (double)(now - start) / 1e6;
            s->backlog = (long long)__atomic_load_n(&x.committed, __ATOMIC_ACQUIRE) -
                         (long long)__atomic_load_n(&x.rd.seen, __ATOMIC_ACQUIRE) + 1;
            s->db_bytes = file_bytes(db);
            s->wal_bytes = file_bytes(wal);
            table_span(rd, &s->min_seq, &s->rows);
            s->db_pages = pragma_ll(rd, "PRAGMA page_count");
            s->free_pages = pragma_ll(rd, "PRAGMA freelist_count");
            if (x.rd.err[0])
                break;
            if (done && (s->backlog == 0 || s->t > duration + 30))
                break;
        }
    }
    pthread_join(writer, NULL);
    writer_started = 0;
    if (cpu1 < 0)
        cpu1 = bench_proc_cpu_ns(pid);
    if (x.writer_err[0]) {
        bench_fail(r, "writer: %s", x.writer_err);
        goto out;
    }
    if (x.rd.err[0]) {
        bench_fail(r, "%s", x.rd.err);
        goto out;
    }
    for (uint64_t s = 1; s <= x.n; s++) {
        if (!x.rd.seen_us[s]) {
            missing++;
            continue;
        }
        lat[nl++] = (double)(x.rd.seen_us[s] - x.txn_commit_us[(s - 1) / SUS_ROWS]) / 1000.0;
    }
    bench_sort(lat, nl);
    bench_sort(x.commit_ms, x.ntxn);
    {
        double secs = (double)(x.t_end_us - x.t0_us) / 1e6, achieved = (double)x.n / secs;
        double p50 = bench_quantile_sorted(lat, nl, 0.5), p99 = bench_quantile_sorted(lat, nl, 0.99);
        double lmax = nl ? lat[nl - 1] : 0, relay_cpu_s = cpu1 >= 0 && cpu0 >= 0 ? (double)(cpu1 - cpu0) / 1e9 : -1;
        int wsamp = 0, warm = (int)(duration / 12), win = (int)(duration / 6) < 10 ? (int)(duration / 6) : 10;
        double first_mean, last_mean;
        long long bmax = 0, db_first = -1, wal_first = -1, db_max_after = 0, wal_max = 0;
        int first_pass = -1, deleting = 0;
        int flat, nogrow, latok, keepup = achieved >= 0.95 * SUS_TXN_RATE * SUS_ROWS;
        char t1[32], t2[32], t3[32];
        for (int i = 0; i < nsamp; i++)
            if (samp[i].t <= secs + 0.5)
                wsamp = i + 1;
        if (win < 1)
            win = 1;
        first_mean = window_mean(samp, warm, warm + win < wsamp ? warm + win : wsamp);
        last_mean = window_mean(samp, wsamp > win ? wsamp - win : 0, wsamp);
        for (int i = 0; i < wsamp; i++) {
            if (samp[i].backlog > bmax)
                bmax = samp[i].backlog;
            if (samp[i].wal_bytes > wal_max)
                wal_max = samp[i].wal_bytes;
            /* The first retention pass has run once rows were deleted (the
             * smallest seq moved) and either a second went by without more
             * or the table is down to the retention's rows and 2 s more. */
            if (first_pass < 0 && deleting &&
                (samp[i].min_seq == samp[i - 1].min_seq ||
                 samp[i].rows <= (SUS_RETENTION_MS / 1000 + 2) * SUS_TXN_RATE * SUS_ROWS))
                first_pass = i;
            else if (first_pass < 0 && i > 0 && samp[i].min_seq > samp[i - 1].min_seq && samp[i - 1].min_seq >= 0)
                deleting = 1;
            if (first_pass >= 0 && samp[i].db_bytes > db_max_after)
                db_max_after = samp[i].db_bytes;
        }
        if (first_pass >= 0) {
            db_first = samp[first_pass].db_bytes;
            wal_first = samp[first_pass].wal_bytes;
        }
        /* Flat: the last window's mean within 25 % of the first's (after
         * the warm-up) plus 50 ms of writing, which a sampling phase can
         * shift. */
        flat = last_mean <= 1.25 * first_mean + 0.05 * SUS_TXN_RATE * SUS_ROWS;
        nogrow = first_pass >= 0 && samp[wsamp - 1].db_bytes <= db_first;
        latok = p99 <= 20.0 && missing == 0;

        bench_row_add(r, "writer achieved", ">= 95% of 20,000/s", keepup ? V_PASS : V_FAIL, "%s msg/s (%llu txns "
                      "> 5 ms late)", bench_thousands(t1, sizeof t1, achieved), (unsigned long long)x.late_txns);
        bench_row_add(r, "  reference: writer COMMIT", NULL, V_NONE, "p50 %.2f p99 %.2f max %.2f ms",
                      bench_quantile_sorted(x.commit_ms, x.ntxn, 0.5), bench_quantile_sorted(x.commit_ms, x.ntxn, 0.99),
                      x.ntxn ? x.commit_ms[x.ntxn - 1] : 0);
        bench_row_add(r, "backlog (committed, unseen)", "flat", flat ? V_PASS : V_FAIL,
                      "first %ds mean %.0f, last %ds mean %.0f, max %lld", win, first_mean, win, last_mean, bmax);
        bench_row_add(r, "commit-to-XADD, cross-process", "p99 <= 20 ms", latok ? V_PASS : V_FAIL,
                      "p50 %.2f p99 %.2f max %.2f ms", p50, p99, lmax);
        if (first_pass >= 0)
            bench_row_add(r, "database file", "no growth after pass 1", nogrow ? V_PASS : V_FAIL,
                          "%s after the first retention pass (%.0f s), %s at the end (max %s)",
                          bench_thousands(t1, sizeof t1, (double)db_first), samp[first_pass].t,
                          bench_thousands(t2, sizeof t2, (double)samp[wsamp - 1].db_bytes),
                          bench_thousands(t3, sizeof t3, (double)db_max_after));
        else
            bench_row_add(r, "database file", "no growth after pass 1", V_FAIL,
                          "no retention pass completed during the run (%s bytes at the end)",
                          bench_thousands(t1, sizeof t1, (double)samp[wsamp - 1].db_bytes));
        bench_row_add(r, "  WAL", NULL, V_NONE, "%s after pass 1, %s at the end, max %s",
                      bench_thousands(t1, sizeof t1, (double)wal_first),
                      bench_thousands(t2, sizeof t2, (double)samp[wsamp - 1].wal_bytes),
                      bench_thousands(t3, sizeof t3, (double)wal_max));
        bench_row_add(r, "  rows in the table at the end", NULL, V_NONE, "%lld", samp[wsamp - 1].rows);
        bench_row_add(r, "relay CPU", NULL, V_NONE, "%.0f %% of a core, %.2f us/msg", 100.0 * relay_cpu_s / secs,
                      relay_cpu_s * 1e6 / (double)x.n);
        if (!keepup)
            bench_note(r, "The writer could not keep up: %.0f msg/s of %d.", achieved, SUS_TXN_RATE * SUS_ROWS);
        if (missing)
            bench_note(r, "%llu messages not seen within 30 s of the end.", (unsigned long long)missing);
        bench_note(r, "Backlog: messages committed and not yet seen in a stream by the reader, sampled every "
                      "second; first window after %d s of warm-up. Flat: last mean <= 1.25 x first mean + 1,000.",
                   warm);
        bench_json_num(r, "seconds", duration, 0);
        bench_json_num(r, "target_msgs_per_s", SUS_TXN_RATE * SUS_ROWS, 0);
        bench_json_num(r, "achieved_msgs_per_s", achieved, 0);
        bench_json_int(r, "late_txns", (long long)x.late_txns);
        bench_json_num(r, "commit_p99_ms", bench_quantile_sorted(x.commit_ms, x.ntxn, 0.99), 3);
        bench_json_num(r, "backlog_first_mean", first_mean, 0);
        bench_json_num(r, "backlog_last_mean", last_mean, 0);
        bench_json_int(r, "backlog_max", bmax);
        bench_json_bool(r, "backlog_flat", flat);
        bench_json_num(r, "p50_ms", p50, 3);
        bench_json_num(r, "p99_ms", p99, 3);
        bench_json_num(r, "max_ms", lmax, 3);
        bench_json_int(r, "missing", (long long)missing);
        bench_json_int(r, "db_bytes_first_pass", db_first);
        bench_json_int(r, "db_bytes_end", samp[wsamp - 1].db_bytes);
        bench_json_int(r, "db_pages_first_pass", first_pass >= 0 ? samp[first_pass].db_pages : -1);
        bench_json_int(r, "db_pages_end", samp[wsamp - 1].db_pages);
        bench_json_int(r, "free_pages_first_pass", first_pass >= 0 ? samp[first_pass].free_pages : -1);
        bench_json_int(r, "free_pages_end", samp[wsamp - 1].free_pages);
        bench_json_int(r, "wal_bytes_first_pass", wal_first);
        bench_json_int(r, "wal_bytes_end", samp[wsamp - 1].wal_bytes);
        bench_json_bool(r, "db_no_growth", nogrow);
        bench_json_num(r, "relay_cpu_pct", 100.0 * relay_cpu_s / secs, 1);
        bench_json_num(r, "relay_cpu_us_per_msg", relay_cpu_s * 1e6 / (double)x.n, 2);
        json_per_s(r, "backlog_per_s", samp, nsamp, offsetof(sus_sample, backlog));
        json_per_s(r, "db_pages_per_s", samp, nsamp, offsetof(sus_sample, db_pages));
    }
    rc = 0;
out:
    if (writer_started)
        pthread_join(writer, NULL);
    if (pid > 0) {
        bench_stop(pid, &status, &ru, 20000);
        if (rc == 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
            char st[64], tail[512];
            bench_tail_file(logpath, tail, sizeof tail, 3);
            bench_note(r, "the relay ended with %s: %s", bench_status_text(status, st, sizeof st), tail);
        }
    }
    if (reader_started) {
        __atomic_store_n(&x.rd.stop, 1, __ATOMIC_RELEASE);
        pthread_join(reader, NULL);
    }
    sqlite3_close_v2(rd);
    outbox_writer_destroy(x.w);
    sqlite3_close_v2(x.db);
    bench_unlink_db(db);
    free(x.txn_commit_us);
    free(x.commit_ms);
    free(x.rd.seen_us);
    free(lat);
    free(samp);
    return rc;
}
