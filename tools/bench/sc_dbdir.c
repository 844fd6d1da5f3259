/*
 * Scenarios of one relay daemon over a directory of databases
 * (outbox-relay --db-dir): the drain of many small backlogs against one
 * database holding them all (dbdir), ten thousand idle databases
 * (dbdir_idle: memory, descriptors, CPU, and the latency of a commit to
 * any of them), and a big backlog beside small tenants that keep writing
 * (dbdir_fair: the small ones' commit -> XADD latency while the big one
 * drains).
 *
 * Latencies are the stream entry id's milliseconds (Redis's clock when it
 * appended the entry) less the row's created_at (the writer's clock when it
 * inserted it): one machine, one clock, millisecond resolution.
 */
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "relay/sql.h"

/* ------------------------------------------------------------------ */
/* shared */

static int make_dir(const char *path, char *err, size_t errlen)
{
    if (mkdir(path, 0755) != 0 && errno != EEXIST) {
        snprintf(err, errlen, "mkdir %.300s: %s", path, strerror(errno));
        return -1;
    }
    return 0;
}

static void remove_dir(const char *path)
{
    DIR *d = opendir(path);
    struct dirent *e;
    char p[PATH_MAX + 300];
    if (!d)
        return;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        snprintf(p, sizeof p, "%.4000s/%.255s", path, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(path);
}

/* count copies of src as dir/t%05d.db */
static int copies(const char *src, const char *dir, long count, char *err, size_t errlen)
{
    char p[PATH_MAX + 64];
    if (make_dir(dir, err, errlen) != 0)
        return -1;
    for (long i = 0; i < count; i++) {
        snprintf(p, sizeof p, "%s/t%05ld.db", dir, i);
        if (bench_copy_db(src, p, err, errlen) != 0)
            return -1;
    }
    return 0;
}

/* The relay daemon over dir with --drain; wall seconds and CPU. */
static int drain_dir(bench *b, const char *dir, const char *tag, double *secs, double *cpu, char *err,
                     size_t errlen)
{
    const char *args[] = {"run", "--db-dir", dir, "--redis", b->redis_url, "--drain", "--log-level", "warn", NULL};
    struct rusage ru;
    if (bench_relay_run(b, args, tag, secs, &ru, NULL, err, errlen) != 0)
        return -1;
    *cpu = bench_ru_cpu_s(&ru);
    return 0;
}

/* Latencies (ms) of the entries of stream: entry ms - created_at; only
 * ids starting with prefix (NULL: all). */
static size_t entry_latencies(bench *b, const char *stream, const char *prefix, double *out, size_t cap)
{
    char start[64] = "-";
    size_t n = 0;
    for (;;) {
        redisReply *rr = bench_redis(b, "XRANGE %s %s + COUNT 1000", stream, start);
        size_t i;
        if (!rr || rr->type != REDIS_REPLY_ARRAY || rr->elements == 0) {
            freeReplyObject(rr);
            return n;
        }
        for (i = 0; i < rr->elements; i++) {
            redisReply *e = rr->element[i], *f = e->element[1];
            const char *env = NULL, *id = NULL;
            size_t envlen = 0;
            outbox_envelope *m = NULL;
            for (size_t k = 0; k + 1 < f->elements; k += 2) {
                if (!strcmp(f->element[k]->str, "envelope")) {
                    env = f->element[k + 1]->str;
                    envlen = f->element[k + 1]->len;
                } else if (!strcmp(f->element[k]->str, "id")) {
                    id = f->element[k + 1]->str;
                }
            }
            if (env && id && (!prefix || !strncmp(id, prefix, strlen(prefix))) && n < cap &&
                outbox_envelope_decode(env, envlen, &m, NULL, 0) == 0) {
                out[n++] = (double)(strtoll(e->element[0]->str, NULL, 10) - m->created_at);
                outbox_envelope_free(m);
            }
        }
        snprintf(start, sizeof start, "(%s", rr->element[rr->elements - 1]->element[0]->str);
        freeReplyObject(rr);
    }
}

/* ------------------------------------------------------------------ */
/* dbdir: many small backlogs vs one database holding them all */

int sc_dbdir(bench *b, bench_report *r)
{
    long ndb = b->quick ? 200 : 1000, rows = 100, total = ndb * rows;
    bench_shape sh = {BENCH_PAYLOAD, b->keys};
    char tmpl[PATH_MAX + 32], big[PATH_MAX + 32], bigcopy[PATH_MAX + 64], dir[PATH_MAX + 32], onedir[PATH_MAX + 32],
        err[512], tag[32];
    char dirs[2][2][PATH_MAX + 40], suffix[8], floordir[2][PATH_MAX + 40];
    double floor_cpu = 0, par_cpu = 0, par_wall = 0, floor_bound, floor_msgs_bound;
    long floor_rows = 0, par_rows = 0;
    int ncpu = (int)sysconf(_SC_NPROCESSORS_ONLN);
    double best_many = 0, best_one = 0, cpu_many = 0, cpu_one = 0, ratio;
    double redis_many = -1, redis_one = -1, floor_all_bound = -1, busy_many, floor_one_cpu = 0, msgs_cpu;
    long floor_one_rows = 0;
    char floorone[PATH_MAX + 48];
    int round, rc = -1;

    memset(dirs, 0, sizeof dirs);
    memset(floordir, 0, sizeof floordir);
    floorone[0] = '\0';
    snprintf(r->title, sizeof r->title,
             "--db-dir --drain of %ld databases x %ld rows vs of one database of %ld rows (--db-dir with one "
             "file), same run, best of 2 alternating",
             ndb, rows, total);
    bench_path(b, tmpl, sizeof tmpl, "dbdir-tmpl.db");
    bench_path(b, big, sizeof big, "dbdir-big.db");
    bench_path(b, dir, sizeof dir, "dbdir-many");
    bench_path(b, onedir, sizeof onedir, "dbdir-one");
    bench_progress(b, "dbdir: building %ld rows and one database of %ld", rows, total);
    if (bench_dataset_build(tmpl, (uint64_t)rows, &sh, 0, err, sizeof err) != 0 ||
        bench_dataset_build_fast(big, (uint64_t)total, &sh, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    /* Every round's copies first, removed at the end: on a file system
     * without a journal, ext4 passes over the inodes freed in the last
     * minutes when it creates a file (recently_deleted), and the
     * databases' -wal and -shm files created by the drain paid for the
     * previous round's removals (BENCHMARKS.md, "Many databases"). */
    for (int k = 0; k < 2; k++) {
        snprintf(floordir[k], sizeof floordir[k], "%s-floor%d", dir, k);
        if (copies(tmpl, floordir[k], ndb, err, sizeof err) != 0) {
            bench_fail(r, "%s", err);
            goto done;
        }
    }
    for (round = 0; round < 2; round++) {
        snprintf(suffix, sizeof suffix, "-%d", round & 1);
        snprintf(dirs[round][0], sizeof dirs[round][0], "%s%s", dir, suffix);
        snprintf(dirs[round][1], sizeof dirs[round][1], "%s%s", onedir, suffix);
        snprintf(bigcopy, sizeof bigcopy, "%s/one.db", dirs[round][1]);
        bench_progress(b, "dbdir: copies for round %d", round + 1);
        if (copies(tmpl, dirs[round][0], ndb, err, sizeof err) != 0 || make_dir(dirs[round][1], err, sizeof err) != 0 ||
            bench_copy_db(big, bigcopy, err, sizeof err) != 0) {
            bench_fail(r, "%s", err);
            goto done;
        }
    }
    for (round = 0; round < 2; round++) {
        for (int side = 0; side < 2; side++) {
            int many = (side + round) % 2 == 0;
            double secs = 0, cpu = 0, rcpu;
            int64_t r0 = bench_proc_cpu_ns(b->redis_pid);
            long long seen;
            bench_progress(b, "dbdir: round %d, %s", round + 1, many ? "many databases" : "one database");
            snprintf(tag, sizeof tag, "dbdir-%s-%d", many ? "many" : "one", round);
            if (drain_dir(b, dirs[round][many ? 0 : 1], tag, &secs, &cpu, err, sizeof err) != 0) {
                bench_fail(r, "%s", err);
                goto done;
            }
            /* Redis's CPU for the drain's XADDs (s; -1: unreadable). */
            rcpu = bench_redis_us_per(b, r0, 1);
            rcpu = rcpu < 0 ? -1 : rcpu / 1e6;
            seen = bench_streams_len(b->rc);
            bench_redis_flush(b);
            if (seen != total) {
                bench_fail(r, "%s: the streams hold %lld entries, not %ld", many ? "many" : "one", seen, total);
                goto done;
            }
            if (many && (double)total / secs > best_many) {
                best_many = (double)total / secs;
                cpu_many = cpu;
                redis_many = rcpu;
            }
            if (!many && (double)total / secs > best_one) {
                best_one = (double)total / secs;
                cpu_one = cpu;
                redis_one = rcpu;
            }
        }
    }
    bench_progress(b, "dbdir: SQL floor");
    if (bench_sql_floor_dir(floordir[0], ndb, 1, &floor_cpu, NULL, &floor_rows, err, sizeof err) != 0 ||
        floor_rows != total ||
        bench_sql_floor_dir(floordir[1], ndb, ncpu, &par_cpu, &par_wall, &par_rows, err, sizeof err) != 0 ||
        par_rows != total) {
        if ((floor_rows != total || par_rows != total) && !err[0])
            snprintf(err, sizeof err, "SQL floor: walked %ld and %ld rows, not %ld", floor_rows, par_rows, total);
        bench_fail(r, "%s", err);
        goto done;
    }
    /* The one database's own floor (the same walk of all its rows, one
     * lease, one mark): what its drain spent besides is the messages'. */
    snprintf(floorone, sizeof floorone, "%s-floorone.db", dir);
    if (bench_copy_db(big, floorone, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        goto done;
    }
    if (bench_sql_floor_db(floorone, &floor_one_cpu, &floor_one_rows, err, sizeof err) != 0 ||
        floor_one_rows != total) {
        if (floor_one_rows != total && !err[0])
            snprintf(err, sizeof err, "SQL floor: walked %ld rows of one database, not %ld", floor_one_rows, total);
        bench_fail(r, "%s", err);
        goto done;
    }
    msgs_cpu = cpu_one > floor_one_cpu ? cpu_one - floor_one_cpu : 0;
    ratio = best_many / best_one;
    /* The floor on a thread per CPU (Redis and the relay's messages need
     * some of those CPUs too): the most the many databases allow. */
    floor_bound = (double)total / par_wall / best_one;
    /* ... and with the relay's work per message as the one database's drain
     * spent it besides its own floor, on the same CPUs. */
    floor_msgs_bound = (double)total / ((par_cpu + msgs_cpu) / (double)ncpu) / best_one;
    /* ... and with Redis's CPU for the XADDs, as the one database's drain
     * made it spend (Redis runs on the same CPUs). */
    if (redis_one >= 0)
        floor_all_bound = (double)total / ((par_cpu + msgs_cpu + redis_one) / (double)ncpu) / best_one;
    /* How many CPUs the many databases' drain kept busy (relay and Redis):
     * near ncpu, the drain is bound by CPU, not by waiting. */
    busy_many = redis_many >= 0 ? (cpu_many + redis_many) * best_many / (double)total : -1;
    bench_row_add(r, "many databases", NULL, V_NONE, "%.0f msg/s, relay CPU %.1f us/msg, %.2f ms per database",
                  best_many, cpu_many * 1e6 / (double)total, cpu_many * 1e3 / (double)ndb);
    bench_row_add(r, "one database", NULL, V_NONE, "%.0f msg/s, relay CPU %.1f us/msg", best_one,
                  cpu_one * 1e6 / (double)total);
    bench_row_add(r, "many / one", ">= 0.5", ratio >= 0.5 ? V_PASS : V_FAIL, "%.3f", ratio);
    bench_row_add(r, "SQL floor per database", NULL, V_NONE,
                  "%.2f ms CPU on one thread, %.2f ms on %d at once (%.2f s for all; the one database: %.3f s)",
                  floor_cpu * 1e3 / (double)ndb, par_cpu * 1e3 / (double)ndb, ncpu, par_wall, floor_one_cpu);
    bench_row_add(r, "the messages", NULL, V_NONE, "%.1f us CPU each (the one database's relay CPU less its floor)",
                  msgs_cpu * 1e6 / (double)total);
    bench_row_add(r, "  many / one at most", NULL, V_NONE,
                  "%.2f (the floor on %d threads), %.2f (and the messages), %.2f (and Redis)", floor_bound, ncpu,
                  floor_msgs_bound, floor_all_bound);
    bench_row_add(r, "Redis CPU", NULL, V_NONE, "%.3f s (many), %.3f s (one)", redis_many, redis_one);
    bench_row_add(r, "CPUs busy, many databases", NULL, V_NONE, "%.2f of %d (relay and Redis)", busy_many, ncpu);
    bench_note(r, "SQL floor: the databases of a copy walked one after the other the least way the relay can "
                  "(sqlite3_open_v2, the schema read by the first statement, OUTBOX__SQL_PLAN, the walk of new rows "
                  "reading every column it sends, one batch lease and the cursor in one transaction, the batch "
                  "published in another, no checkpoint at close; no Redis, no encoding), on one thread, then on a "
                  "thread per CPU over another copy: the many databases cannot drain faster than the latter, "
                  "whatever the relay does. And the messages: the floor's CPU plus what the relay's CPU of the one "
                  "database's drain was besides that database's own floor (the same walk of all its rows, one "
                  "lease, one mark). And Redis: plus Redis's CPU (/proc/PID/schedstat) during the one database's "
                  "drain. CPUs busy: the relay's and Redis's CPU during the many databases' drain over its wall "
                  "time.");
    bench_json_int(r, "databases", ndb);
    bench_json_int(r, "rows_per_db", rows);
    bench_json_num(r, "many_per_s", best_many, 0);
    bench_json_num(r, "one_per_s", best_one, 0);
    bench_json_num(r, "many_cpu_s", cpu_many, 3);
    bench_json_num(r, "one_cpu_s", cpu_one, 3);
    bench_json_num(r, "ratio", ratio, 3);
    bench_json_num(r, "target_ratio", 0.5, 1);
    bench_json_num(r, "sql_floor_ms_per_db", floor_cpu * 1e3 / (double)ndb, 3);
    bench_json_num(r, "sql_floor_threads_ms_per_db", par_cpu * 1e3 / (double)ndb, 3);
    bench_json_num(r, "sql_floor_threads_wall_s", par_wall, 3);
    bench_json_num(r, "sql_floor_ratio_bound", floor_bound, 3);
    bench_json_num(r, "sql_floor_one_cpu_s", floor_one_cpu, 3);
    bench_json_num(r, "msgs_cpu_us_each", msgs_cpu * 1e6 / (double)total, 3);
    bench_json_num(r, "sql_floor_msgs_ratio_bound", floor_msgs_bound, 3);
    bench_json_num(r, "sql_floor_msgs_redis_ratio_bound", floor_all_bound, 3);
    bench_json_num(r, "redis_cpu_s_many", redis_many, 3);
    bench_json_num(r, "redis_cpu_s_one", redis_one, 3);
    bench_json_num(r, "cpus_busy_many", busy_many, 2);
    rc = 0;
done:
    for (round = 0; round < 2; round++) {
        remove_dir(dirs[round][0]);
        remove_dir(dirs[round][1]);
    }
    for (int k = 0; k < 2; k++)
        if (floordir[k][0])
            remove_dir(floordir[k]);
    if (floorone[0])
        bench_unlink_db(floorone);
    bench_unlink_db(tmpl);
    bench_unlink_db(big);
    return rc;
}

/* ------------------------------------------------------------------ */
/* dbdir_idle: ten thousand idle databases */

static long proc_status_kb(pid_t pid, const char *field)
{
    char path[64], line[256];
    long v = -1;
    size_t fl = strlen(field);
    FILE *f;
    snprintf(path, sizeof path, "/proc/%ld/status", (long)pid);
    if (!(f = fopen(path, "r")))
        return -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, field, fl) && line[fl] == ':')
            v = strtol(line + fl + 1, NULL, 10);
    fclose(f);
    return v;
}

static long proc_fds(pid_t pid)
{
    char path[64];
    DIR *d;
    struct dirent *e;
    long n = 0;
    snprintf(path, sizeof path, "/proc/%ld/fd", (long)pid);
    if (!(d = opendir(path)))
        return -1;
    while ((e = readdir(d)) != NULL)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/* Inserts one row (id, topic) into the database at path. */
static int insert_row(const char *path, const char *id, const char *topic, char *err, size_t errlen)
{
    sqlite3 *db = NULL;
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_open_v2(path, &db, SQLITE_OPEN_READWRITE, NULL);
    if (rc == SQLITE_OK) {
        sqlite3_busy_timeout(db, 5000);
        sqlite3_exec(db, "PRAGMA synchronous=NORMAL", NULL, NULL, NULL);
        rc = sqlite3_prepare_v2(db, "INSERT INTO outbox(id, topic, payload) VALUES (?1, ?2, x'00')", -1, &st, NULL);
    }
    if (rc == SQLITE_OK) {
        sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
        sqlite3_bind_text(st, 2, topic, -1, SQLITE_STATIC);
        rc = sqlite3_step(st) == SQLITE_DONE ? SQLITE_OK : SQLITE_ERROR;
    }
    if (rc != SQLITE_OK)
        snprintf(err, errlen, "insert into %.300s: %.150s", path, sqlite3_errmsg(db));
    sqlite3_finalize(st);
    sqlite3_close_v2(db);
    return rc == SQLITE_OK ? 0 : -1;
}

int sc_dbdir_idle(bench *b, bench_report *r)
{
    long ndb = b->quick ? 1000 : 10000, fds, rss_kb, hwm_kb;
    unsigned window_ms = b->quick ? 2000 : 5000, max_open = 1024;
    char tmpl[PATH_MAX + 32], dir[PATH_MAX + 32], logpath[PATH_MAX + 32], err[512], st[32], tail[400], mo[16];
    const char *argv[16];
    double lat[100], p50, p99, mx, cpu_pct;
    int64_t c0, c1, prev = -1;
    sqlite3 *h = NULL;
    int a = 0, status = 0, n = 0;
    pid_t pid;
    unsigned seed = 12345;

    snprintf(r->title, sizeof r->title,
             "outbox-relay --db-dir over %ld idle databases: memory, descriptors and CPU once settled (%.0f s "
             "window), then 100 rows committed one by one to random databases",
             ndb, window_ms / 1000.0);
    bench_path(b, tmpl, sizeof tmpl, "idle-tmpl.db");
    bench_path(b, dir, sizeof dir, "dbdir-idle");
    bench_path(b, logpath, sizeof logpath, "relay-dbdir-idle.log");
    bench_progress(b, "dbdir_idle: %ld empty databases", ndb);
    if (bench_db_fresh(tmpl, 0, &h, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    sqlite3_exec(h, "PRAGMA wal_checkpoint(TRUNCATE)", NULL, NULL, NULL);
    sqlite3_close_v2(h);
    if (copies(tmpl, dir, ndb, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    snprintf(mo, sizeof mo, "%u", max_open);
    argv[a++] = b->relay_bin;
    argv[a++] = "run";
    argv[a++] = "--db-dir";
    argv[a++] = dir;
    argv[a++] = "--redis";
    argv[a++] = b->redis_url;
    argv[a++] = "--max-open-dbs";
    argv[a++] = mo;
    argv[a++] = "--log-level";
    argv[a++] = "warn";
    argv[a] = NULL;
    if (bench_spawn(argv, NULL, logpath, &pid) != 0) {
        bench_fail(r, "cannot start the relay: %s", strerror(errno));
        return -1;
    }
    /* Settled: no CPU used for a whole second (every database looked at). */
    for (int i = 0; i < 600; i++) {
        int64_t now;
        bench_sleep_ms(1000);
        now = bench_proc_cpu_ns(pid);
        if (now < 0)
            break;
        if (prev >= 0 && now - prev < 20 * 1000000LL)
            break;
        prev = now;
    }
    c0 = bench_proc_cpu_ns(pid);
    bench_sleep_ms(window_ms);
    c1 = bench_proc_cpu_ns(pid);
    fds = proc_fds(pid);
    rss_kb = proc_status_kb(pid, "VmRSS");
    for (n = 0; n < 100; n++) {
        char id[32], path[PATH_MAX + 64];
        long k = (long)(rand_r(&seed) % (unsigned)ndb);
        long long before = bench_streams_len(b->rc), now;
        uint64_t t0;
        snprintf(id, sizeof id, "idle-%03d", n);
        snprintf(path, sizeof path, "%s/t%05ld.db", dir, k);
        if (insert_row(path, id, "bench.t0", err, sizeof err) != 0)
            break;
        t0 = bench_mono_us();
        while ((now = bench_streams_len(b->rc)) <= before && bench_mono_us() - t0 < 10000000)
            bench_sleep_ms(1);
        if (now <= before) {
            snprintf(err, sizeof err, "row %s in t%05ld.db not published within 10 s", id, k);
            break;
        }
    }
    hwm_kb = proc_status_kb(pid, "VmHWM");
    if (bench_stop(pid, &status, NULL, 30000) != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0 || n < 100 ||
        c0 < 0 || c1 < 0) {
        bench_tail_file(logpath, tail, sizeof tail, 3);
        bench_fail(r, "relay %s, %d of 100 rows: %s %s", bench_status_text(status, st, sizeof st), n,
                   n < 100 ? err : "", tail);
        remove_dir(dir);
        return -1;
    }
    n = (int)entry_latencies(b, "outbox:bench.t0", "idle-", lat, 100);
    bench_redis_flush(b);
    bench_sort(lat, (size_t)n);
    p50 = bench_quantile_sorted(lat, (size_t)n, 0.5);
    p99 = bench_quantile_sorted(lat, (size_t)n, 0.99);
    mx = n ? lat[n - 1] : -1;
    cpu_pct = 100.0 * (double)(c1 - c0) / ((double)window_ms * 1e6);
    bench_row_add(r, "RSS, settled", "<= 256 MiB", rss_kb >= 0 && rss_kb <= 256 * 1024 ? V_PASS : V_FAIL,
                  "%.1f MiB (peak %.1f MiB)", rss_kb / 1024.0, hwm_kb / 1024.0);
    bench_row_add(r, "open descriptors", "<= max-open-dbs + 64", fds >= 0 && fds <= (long)max_open + 64 ? V_PASS : V_FAIL,
                  "%ld", fds);
    bench_row_add(r, "CPU, settled", "<= 1% core", cpu_pct <= 1.0 ? V_PASS : V_FAIL, "%.3f%%", cpu_pct);
    bench_row_add(r, "commit -> XADD, 100 random databases", "p99 <= 100 ms", p99 <= 100 ? V_PASS : V_FAIL,
                  "p50 %.0f ms, p99 %.0f ms, max %.0f ms", p50, p99, mx);
    bench_row_add(r, "the slowest of them", "<= 1000 ms", mx <= 1000 ? V_PASS : V_FAIL, "%.0f ms", mx);
    bench_json_int(r, "databases", ndb);
    bench_json_num(r, "rss_mib", rss_kb / 1024.0, 1);
    bench_json_num(r, "hwm_mib", hwm_kb / 1024.0, 1);
    bench_json_int(r, "fds", fds);
    bench_json_num(r, "cpu_pct", cpu_pct, 4);
    bench_json_num(r, "latency_p50_ms", p50, 0);
    bench_json_num(r, "latency_p99_ms", p99, 0);
    bench_json_num(r, "latency_max_ms", mx, 0);
    remove_dir(dir);
    bench_unlink_db(tmpl);
    return 0;
}

/* ------------------------------------------------------------------ */
/* dbdir_fair: one big backlog, small tenants writing beside it */

typedef struct small_writers {
    char dir[PATH_MAX + 32];
    int ndb, rate; /* rows per second per database */
    volatile int stop;
    long written;
    char err[256];
} small_writers;

static void *small_main(void *arg)
{
    small_writers *w = arg;
    sqlite3 *db[64] = {0};
    sqlite3_stmt *st[64] = {0};
    uint64_t period = 1000000u / (unsigned)w->rate, next = bench_mono_us();
    long seq = 0;
    for (int i = 0; i < w->ndb; i++) {
        char p[PATH_MAX + 64];
        snprintf(p, sizeof p, "%s/s%02d.db", w->dir, i);
        if (sqlite3_open_v2(p, &db[i], SQLITE_OPEN_READWRITE, NULL) != SQLITE_OK ||
            sqlite3_prepare_v2(db[i], "INSERT INTO outbox(id, topic, payload) VALUES (?1, 'small', x'00')", -1,
                               &st[i], NULL) != SQLITE_OK) {
            snprintf(w->err, sizeof w->err, "open %.150s: %.80s", p, sqlite3_errmsg(db[i]));
            w->stop = 1;
            break;
        }
        sqlite3_busy_timeout(db[i], 5000);
        sqlite3_exec(db[i], "PRAGMA synchronous=NORMAL", NULL, NULL, NULL);
    }
    while (!w->stop) {
        /* one row to each database per period, spread over it */
        for (int i = 0; i < w->ndb && !w->stop; i++) {
            char id[48];
            uint64_t at = next + period * (uint64_t)i / (uint64_t)w->ndb, now = bench_mono_us();
            if (at > now)
                bench_sleep_ms((unsigned)((at - now) / 1000));
            snprintf(id, sizeof id, "small-%08ld", seq++);
            sqlite3_bind_text(st[i], 1, id, -1, SQLITE_TRANSIENT);
            if (sqlite3_step(st[i]) != SQLITE_DONE && !w->err[0])
                snprintf(w->err, sizeof w->err, "insert: %s", sqlite3_errmsg(db[i]));
            sqlite3_reset(st[i]);
            w->written++;
        }
        next += period;
    }
    for (int i = 0; i < w->ndb; i++) {
        sqlite3_finalize(st[i]);
        sqlite3_close_v2(db[i]);
    }
    return NULL;
}

int sc_dbdir_fair(bench *b, bench_report *r)
{
    long big_rows = b->quick ? 100000 : 400000;
    bench_shape sh = {BENCH_PAYLOAD, b->keys};
    small_writers w;
    char bigsrc[PATH_MAX + 32], p[PATH_MAX + 64], logpath[PATH_MAX + 32], err[512], st[32], tail[400];
    const char *argv[16];
    pthread_t th;
    double *lat, p50, p99, mx, secs;
    size_t n;
    int a = 0, status = 0;
    pid_t pid;
    uint64_t t0;
    long long seen_big = 0;

    memset(&w, 0, sizeof w);
    w.ndb = 40;
    w.rate = 25;
    snprintf(r->title, sizeof r->title,
             "outbox-relay --db-dir: one database with a %ld-row backlog and %d small ones written at %d rows/s "
             "each; the small ones' commit -> XADD while the big one drains",
             big_rows, w.ndb, w.rate);
    bench_path(b, bigsrc, sizeof bigsrc, "fair-big.db");
    bench_path(b, w.dir, sizeof w.dir, "dbdir-fair");
    bench_path(b, logpath, sizeof logpath, "relay-dbdir-fair.log");
    bench_progress(b, "dbdir_fair: building %ld rows", big_rows);
    if (bench_dataset_build_fast(bigsrc, (uint64_t)big_rows, &sh, err, sizeof err) != 0 ||
        make_dir(w.dir, err, sizeof err) != 0) {
        bench_fail(r, "%s", err);
        return -1;
    }
    for (int i = 0; i < w.ndb; i++) {
        sqlite3 *h = NULL;
        snprintf(p, sizeof p, "%s/s%02d.db", w.dir, i);
        if (bench_db_fresh(p, 0, &h, err, sizeof err) != 0) {
            bench_fail(r, "%s", err);
            return -1;
        }
        sqlite3_close_v2(h);
    }
    argv[a++] = b->relay_bin;
    argv[a++] = "run";
    argv[a++] = "--db-dir";
    argv[a++] = w.dir;
    argv[a++] = "--redis";
    argv[a++] = b->redis_url;
    argv[a++] = "--log-level";
    argv[a++] = "warn";
    argv[a] = NULL;
    if (bench_spawn(argv, NULL, logpath, &pid) != 0) {
        bench_fail(r, "cannot start the relay: %s", strerror(errno));
        return -1;
    }
    bench_sleep_ms(500);
    pthread_create(&th, NULL, small_main, &w);
    bench_sleep_ms(1000); /* the small ones open and settle */
    snprintf(p, sizeof p, "%s/big.db", w.dir);
    bench_progress(b, "dbdir_fair: the big backlog appears");
    t0 = bench_mono_us();
    if (bench_copy_db(bigsrc, p, err, sizeof err) != 0) {
        w.stop = 1;
        pthread_join(th, NULL);
        bench_stop(pid, &status, NULL, 30000);
        bench_fail(r, "%s", err);
        return -1;
    }
    while (bench_mono_us() - t0 < 600000000ull) {
        seen_big = bench_streams_len(b->rc);
        if (seen_big >= big_rows)
            break;
        bench_sleep_ms(20);
    }
    secs = (double)(bench_mono_us() - t0) / 1e6;
    bench_sleep_ms(1000);
    w.stop = 1;
    pthread_join(th, NULL);
    bench_sleep_ms(500);
    if (bench_stop(pid, &status, NULL, 30000) != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0 || w.err[0] ||
        seen_big < big_rows) {
        bench_tail_file(logpath, tail, sizeof tail, 3);
        bench_fail(r, "relay %s, big %lld of %ld: %s %s", bench_status_text(status, st, sizeof st), seen_big,
                   big_rows, w.err, tail);
        remove_dir(w.dir);
        return -1;
    }
    lat = malloc(sizeof *lat * ((size_t)w.written + 1));
    n = lat ? entry_latencies(b, "outbox:small", "small-", lat, (size_t)w.written) : 0;
    bench_redis_flush(b);
    bench_sort(lat, n);
    p50 = bench_quantile_sorted(lat, n, 0.5);
    p99 = bench_quantile_sorted(lat, n, 0.99);
    mx = n ? lat[n - 1] : -1;
    free(lat);
    bench_row_add(r, "big backlog drained", NULL, V_NONE, "%ld rows in %.2f s (%.0f msg/s) beside the small ones",
                  big_rows, secs, (double)big_rows / secs);
    bench_row_add(r, "small rows published", NULL, V_NONE, "%zu of %ld written", n, w.written);
    bench_row_add(r, "small commit -> XADD", "p99 <= 50 ms", p99 <= 50 && (long)n == w.written ? V_PASS : V_FAIL,
                  "p50 %.0f ms, p99 %.0f ms, max %.0f ms", p50, p99, mx);
    bench_json_int(r, "big_rows", big_rows);
    bench_json_num(r, "big_seconds", secs, 3);
    bench_json_int(r, "small_written", w.written);
    bench_json_int(r, "small_published", (long long)n);
    bench_json_num(r, "small_p50_ms", p50, 0);
    bench_json_num(r, "small_p99_ms", p99, 0);
    bench_json_num(r, "small_max_ms", mx, 0);
    bench_json_num(r, "target_p99_ms", 50, 0);
    remove_dir(w.dir);
    bench_unlink_db(bigsrc);
    return 0;
}
