/*
 * /metrics while the daemon drains a backlog: valid Prometheus text,
 * counters that never decrease and end at the published count, database
 * figures that match the table, histograms that agree with the counters.
 * The first scrapes are taken mid-drain whatever the relay's speed: the
 * drain is held (Redis's writes paused, the test holding the write lock)
 * and let on in steps of at most --inflight rows (see held_step); then it
 * drains freely, scraped as it goes.
 * /healthz: 200, then 503 naming Redis once it has been down for
 * --health-redis-down-ms, then 200 again when it is back.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "ops.h"
#include "outbox.h"
#include "tap.h"

#define N_ROWS 60000

static th_redis redis;
static char *dir, *dbpath, *logpath;
static sqlite3 *db;
static int port;

static const char *const histograms[] = {"outbox_publish_latency_seconds", "outbox_claim_batch_size",
                                          "outbox_claim_duration_seconds", "outbox_loop_stall_seconds"};

/* Buckets cumulative (non-decreasing, le increasing, ending with +Inf) and
 * +Inf equal to _count. Returns NULL or what is wrong. */
static const char *check_histogram(const char *text, const char *name)
{
    static char why[200];
    char prefix[128];
    const char *p = text;
    double prev_le = -1, prev = -1, inf = -1, count = -1;
    int buckets = 0;
    snprintf(prefix, sizeof prefix, "%s_bucket{le=\"", name);
    while ((p = strstr(p, prefix)) != NULL) {
        const char *le = p + strlen(prefix), *sp = strchr(le, ' ');
        double v = sp ? strtod(sp + 1, NULL) : -1;
        buckets++;
        if (!strncmp(le, "+Inf\"}", 6)) {
            inf = v;
        } else {
            double l = strtod(le, NULL);
            if (l <= prev_le) {
                snprintf(why, sizeof why, "%s: le %g after %g", name, l, prev_le);
                return why;
            }
            prev_le = l;
        }
        if (v < prev) {
            snprintf(why, sizeof why, "%s: bucket counts decrease (%g after %g)", name, v, prev);
            return why;
        }
        prev = v;
        p = le;
    }
    snprintf(prefix, sizeof prefix, "%s_count", name);
    if (buckets < 2 || inf < 0 || !ot_prom_get(text, prefix, &count)) {
        snprintf(why, sizeof why, "%s: buckets, +Inf or _count missing", name);
        return why;
    }
    if (inf != count) {
        snprintf(why, sizeof why, "%s: +Inf bucket %g but _count %g", name, inf, count);
        return why;
    }
    return NULL;
}

/* GET through curl (a real client) when it is installed, else through the
 * raw client; returns the status, *body gets the body. */
static int scrape(const char *path, char **body)
{
    static int have_curl = -1;
    char url[128], max_time[16], *out = NULL, *nl;
    char *argv[] = {"/usr/bin/curl", "-sS", "--max-time", max_time, "-o", "-", "-w", "\n%{http_code}", url, NULL};
    int st, code;
    if (have_curl < 0) {
        have_curl = access(argv[0], X_OK) == 0;
        if (!have_curl)
            diag("no /usr/bin/curl: scraping over a plain socket");
    }
    if (!have_curl)
        return ot_http_get(port, path, body);
    snprintf(url, sizeof url, "http://127.0.0.1:%d%s", port, path);
    snprintf(max_time, sizeof max_time, "%d", 5 * th_slow());
    st = th_run(argv, NULL, &out, NULL, 10000 * th_slow());
    nl = out ? strrchr(out, '\n') : NULL;
    code = st == 0 && nl ? atoi(nl + 1) : -1;
    if (nl)
        *nl = '\0';
    if (body)
        *body = out;
    else
        free(out);
    return code;
}

static int published_rows(void)
{
    return (int)th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state = 2");
}

/* What the scrapes during the drain found. */
typedef struct drain_stats {
    int scrapes, mid_scrapes, bad_format, decreased, bad_hist, latency_behind;
    double last_sum;
} drain_stats;

/* One scrape during the drain, checked: valid text, a published sum that
 * never decreases, histograms cumulative, latency never behind. Returns the
 * sum of outbox_published_total, or -1 when the scrape failed. */
static double drain_scrape(drain_stats *s)
{
    char *body = NULL;
    const char *why = NULL;
    double sum = -1, lat = 0;
    size_t i;
    int bad;
    if (scrape("/metrics", &body) != 200) {
        free(body);
        return -1;
    }
    s->scrapes++;
    if ((bad = ot_prom_check(body, &why)) != 0 && s->bad_format++ == 0)
        diag("scrape %d: line %d: %s", s->scrapes, bad, why);
    sum = ot_prom_sum(body, "outbox_published_total", NULL);
    if (sum < s->last_sum && s->decreased++ == 0)
        diag("published sum went from %g to %g", s->last_sum, sum);
    if (sum < N_ROWS && sum > 0)
        s->mid_scrapes++;
    s->last_sum = sum;
    /* Latency is observed when Redis accepts, the counter when the mark
     * commits: the histogram may run ahead, never behind. */
    ot_prom_get(body, "outbox_publish_latency_seconds_count", &lat);
    if (lat < sum && s->latency_behind++ == 0)
        diag("latency count %g below published %g", lat, sum);
    for (i = 0; i < sizeof histograms / sizeof histograms[0]; i++) {
        const char *w = check_histogram(body, histograms[i]);
        if (w && s->bad_hist++ == 0)
            diag("scrape %d: %s", s->scrapes, w);
    }
    free(body);
    return sum;
}

/* A live figure of the relay's /metrics over a plain socket (-1 when the
 * scrape failed or lacks it). */
static double live_metric(const char *series)
{
    char *body = NULL;
    double v = -1;
    if (ot_http_get(port, "/metrics", &body) == 200)
        v = ot_prom_val(body, series);
    free(body);
    return v;
}

/* A pause of Redis's writes (ot_redis_pause) ends by itself after PAUSE_MS,
 * before the relay's --reply-timeout-ms (below) would drop the connection;
 * the steps release it long before that (they check). */
#define PAUSE_MS 20000
#define REPLY_TIMEOUT_MS "25000"
/* Steps of the drain with a scrape in each, whatever the relay's speed. */
#define HELD_STEPS 5

/*
 * The drain held. Between steps the test holds the database's write lock,
 * so the relay can neither mark nor claim, and Redis has answered the
 * XADDs of every row it claimed (at most its --inflight, 256 of the 60,000
 * rows). A step pauses Redis's writes and releases the lock: the relay
 * marks those rows, claims the next ones, and their XADDs wait in Redis.
 * Then the lock again, and Redis let go: the scrapes run while the
 * published count is frozen, provably short of the backlog; then the
 * replies come in. held_start brings the relay to the held state: the
 * backlog is committed while Redis is paused. Each returns 0, or -1 with a
 * diagnostic when a state was not reached in time (or a pause may have
 * ended by itself).
 */
static int lock_and_release(redisContext *c, int64_t paused_at, int64_t deadline)
{
    if (!ot_wait_gauges(port, 1, deadline))
        return -1;
    th_sql_exec(db, "BEGIN IMMEDIATE");
    ot_redis_pause(c, 0);
    if (th_now_ms() - paused_at >= PAUSE_MS) {
        diag("Redis was paused for %lld ms: the pause may have ended by itself", (long long)(th_now_ms() - paused_at));
        return -1;
    }
    return 0;
}

static int held_start(redisContext *c)
{
    int64_t deadline = th_now_ms() + 20000 * th_slow(), paused_at;
    double connected = -1;
    while (th_now_ms() < deadline && (connected = live_metric("outbox_redis_connected")) != 1)
        th_sleep_ms(5);
    if (connected != 1) {
        diag("the relay did not connect to Redis");
        return -1;
    }
    th_sql_exec(db, "BEGIN IMMEDIATE");
    rt_insert_rows_in_txn(db, "a", 0, N_ROWS / 2, "alpha", 0);
    rt_insert_rows_in_txn(db, "b", 0, N_ROWS / 2, "beta", 0);
    ot_redis_pause(c, PAUSE_MS);
    paused_at = th_now_ms();
    th_sql_exec(db, "COMMIT");
    if (lock_and_release(c, paused_at, deadline) != 0)
        return -1;
    return ot_wait_gauges(port, 0, deadline) ? 0 : -1;
}

static int held_step(redisContext *c, drain_stats *s, int step)
{
    int64_t paused_at, deadline = th_now_ms() + 10000 * th_slow();
    int before = published_rows(), published;
    double sum;

    ot_redis_pause(c, PAUSE_MS);
    paused_at = th_now_ms();
    th_sql_exec(db, "COMMIT");
    while (published_rows() <= before && th_now_ms() < deadline)
        th_sleep_ms(1);
    if (lock_and_release(c, paused_at, deadline) != 0)
        return -1;
    published = published_rows();
    /* The counters are bumped on the relay's loop right after the marks
     * commit: scrape until they show this step's marks. */
    do
        sum = drain_scrape(s);
    while (sum < published && th_now_ms() < deadline);
    diag("step %d: %d rows published before, %d after, the scrape says %g", step, before, published, sum);
    if (published <= before || published >= N_ROWS || sum < published || sum >= N_ROWS) {
        diag("step %d: no marks, or not held", step);
        return -1;
    }
    return ot_wait_gauges(port, 0, deadline) ? 0 : -1;
}

static pid_t metrics_while_draining(void)
{
    char listen[64], *text = NULL;
    pid_t pid;
    int st, held = 0, step;
    drain_stats s = {0};
    double v;
    int64_t start;
    const char *why = NULL;
    size_t i;
    redisContext *c = th_redis_client(&redis);

    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    pid = rt_relay_spawn(logpath, dbpath, redis.url, "--metrics-listen", listen, "--batch", "64", "--inflight",
                         "256", "--health-redis-down-ms", "500", "--reply-timeout-ms", REPLY_TIMEOUT_MS, NULL);
    start = th_now_ms();
    if (held_start(c) == 0)
        for (step = 1; step <= HELD_STEPS && held_step(c, &s, step) == 0; step++)
            held++;
    if (sqlite3_get_autocommit(db) == 0)
        th_sql_exec(db, "COMMIT");
    ot_redis_pause(c, 0);
    redisFree(c);
    diag("held steps done after %lld ms", (long long)(th_now_ms() - start));
    /* Then the rest drains freely, scraped as it goes. */
    for (;;) {
        int done = published_rows() == N_ROWS;
        drain_scrape(&s);
        if (done || th_now_ms() - start > 30000 * th_slow())
            break;
        th_sleep_ms(5);
    }
    diag("%d scrapes, %d while the backlog drained, %d of %d held steps (%lld ms)", s.scrapes, s.mid_scrapes, held,
         HELD_STEPS, (long long)(th_now_ms() - start));
    is_int(published_rows(), N_ROWS, "the relay published all %d rows", N_ROWS);
    ok(held == HELD_STEPS && s.mid_scrapes >= 3, "several scrapes while publishing (%d, in %d of %d held steps)",
       s.mid_scrapes, held, HELD_STEPS);
    is_int(s.bad_format, 0, "every scrape is valid Prometheus text");
    is_int(s.decreased, 0, "the sum of outbox_published_total never decreases");
    is_int(s.bad_hist, 0, "every histogram is cumulative with +Inf == _count");
    is_int(s.latency_behind, 0, "the latency histogram never lags the published counter");

    /* The database figures are at most a second old (refreshed in the
     * background): scrape until they show the drained table. */
    start = th_now_ms();
    do {
        free(text);
        text = NULL;
        if ((st = scrape("/metrics", &text)) == 200 &&
            ot_prom_val(text, "outbox_messages{state=\"published\"}") == N_ROWS &&
            ot_prom_val(text, "outbox_messages{state=\"pending\"}") == 0)
            break;
        th_sleep_ms(20);
    } while (th_now_ms() - start < 1100 * th_slow() + 1000);
    is_int(st, 200, "GET /metrics answers 200");
    ok(ot_prom_check(text, &why) == 0, "the final scrape is valid Prometheus text");
    is_int((long long)ot_prom_sum(text, "outbox_published_total", NULL), N_ROWS,
           "outbox_published_total sums to the published count");
    is_int((long long)ot_prom_val(text, "outbox_published_total{topic=\"alpha\"}"), N_ROWS / 2,
           "outbox_published_total{topic=\"alpha\"}");
    is_int((long long)ot_prom_val(text, "outbox_published_total{topic=\"beta\"}"), N_ROWS / 2,
           "outbox_published_total{topic=\"beta\"}");
    is_int((long long)ot_prom_val(text, "outbox_messages{state=\"published\"}"), published_rows(),
           "outbox_messages{state=\"published\"} equals the table's count");
    is_int((long long)ot_prom_val(text, "outbox_messages{state=\"pending\"}"), 0, "outbox_messages{state=\"pending\"}");
    is_int((long long)ot_prom_val(text, "outbox_messages{state=\"sending\"}"), 0, "outbox_messages{state=\"sending\"}");
    is_int((long long)ot_prom_val(text, "outbox_messages{state=\"dead\"}"), 0, "outbox_messages{state=\"dead\"}");
    is_int((long long)ot_prom_val(text, "outbox_publish_latency_seconds_count"), N_ROWS,
           "outbox_publish_latency_seconds_count equals the published total");
    is_int((long long)ot_prom_val(text, "outbox_claim_batch_size_sum"), N_ROWS,
           "outbox_claim_batch_size_sum equals the rows claimed");
    v = ot_prom_val(text, "outbox_claim_batch_size_count");
    is_int((long long)v, (long long)ot_prom_val(text, "outbox_claims_total"),
           "outbox_claim_batch_size_count equals outbox_claims_total (%g)", v);
    is_int((long long)ot_prom_val(text, "outbox_inflight"), 0, "outbox_inflight at the end");
    is_int((long long)ot_prom_val(text, "outbox_awaiting_replies"), 0, "outbox_awaiting_replies at the end");
    is_int((long long)ot_prom_val(text, "outbox_redis_connected"), 1, "outbox_redis_connected");
    is_int((long long)ot_prom_val(text, "outbox_oldest_pending_seconds"), 0, "outbox_oldest_pending_seconds");
    is_int((long long)ot_prom_val(text, "outbox_duplicates_suppressed_total"), 0,
           "outbox_duplicates_suppressed_total (not idempotent)");
    for (i = 0; i < sizeof histograms / sizeof histograms[0]; i++) {
        const char *w = check_histogram(text, histograms[i]);
        ok(!w, "%s is consistent%s%s", histograms[i], w ? ": " : "", w ? w : "");
    }
    free(text);

    /* HEAD: the same head, no body. */
    {
        const char req[] = "HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
        char *resp = NULL, *cl;
        st = ot_http_raw(port, req, sizeof req - 1, &resp, 5000 * th_slow());
        is_int(st, 200, "HEAD /metrics answers 200");
        cl = resp ? ot_http_header(resp, "Content-Length") : NULL;
        ok(cl && atol(cl) > 1000, "HEAD announces the body's Content-Length (%s)", cl ? cl : "none");
        ok(resp && ot_http_body(resp) && *ot_http_body(resp) == '\0', "HEAD sends no body");
        free(cl);
        free(resp);
    }
    return pid;
}

/* A row with an invalid topic (past the schema's checks) is dead-lettered
 * under that topic: its label must be escaped. Then more topics than the
 * relay tracks one by one (1000): the rest share topic="_other", and the
 * family still sums to the total. */
static void topic_labels(void)
{
    char *text = NULL;
    const char *why = NULL;
    int64_t start;
    int i, n = 0, bad;
    double sum;
    sqlite3_stmt *st;

    th_sql_exec(db, "PRAGMA ignore_check_constraints = ON");
    th_sql_exec(db, "INSERT INTO outbox(id, topic, payload) VALUES ('odd-1', 'x\"y\\z' || char(10) || 'w', x'00')");
    th_sql_exec(db, "PRAGMA ignore_check_constraints = OFF");
    start = th_now_ms();
    while (th_now_ms() - start < 5000 * th_slow() &&
           th_sql_int(db, "SELECT state FROM outbox_messages WHERE id = 'odd-1'") != 3)
        th_sleep_ms(5);
    is_int(th_sql_int(db, "SELECT state FROM outbox_messages WHERE id = 'odd-1'"), 3, "a row with an invalid topic is dead");

    th_sql_exec(db, "BEGIN");
    if (sqlite3_prepare_v2(db, "INSERT INTO outbox(id, topic, payload) VALUES (?1, ?1, x'00')", -1, &st, NULL) !=
        SQLITE_OK)
        bail("prepare: %s", sqlite3_errmsg(db));
    for (i = 0; i < 1100; i++) {
        char t[32];
        snprintf(t, sizeof t, "t%04d", i);
        sqlite3_bind_text(st, 1, t, -1, SQLITE_TRANSIENT);
        if (sqlite3_step(st) != SQLITE_DONE)
            bail("insert: %s", sqlite3_errmsg(db));
        sqlite3_reset(st);
    }
    sqlite3_finalize(st);
    th_sql_exec(db, "COMMIT");
    start = th_now_ms();
    while (th_now_ms() - start < 10000 * th_slow() && published_rows() < N_ROWS + 1100)
        th_sleep_ms(10);
    is_int(published_rows(), N_ROWS + 1100, "1,100 messages on 1,100 topics are published");
    /* The counters are bumped right after the marks commit. */
    for (i = 0; i < 100 * th_slow(); i++) {
        free(text);
        text = NULL;
        if (scrape("/metrics", &text) == 200 && ot_prom_sum(text, "outbox_published_total", NULL) >= N_ROWS + 1100)
            break;
        th_sleep_ms(10);
    }
    bad = ot_prom_check(text ? text : "", &why);
    ok(text && bad == 0, "the scrape is valid Prometheus text (line %d: %s)", bad, why ? why : "-");
    sum = ot_prom_sum(text ? text : "", "outbox_published_total", &n);
    is_int((long long)sum, N_ROWS + 1100, "outbox_published_total still sums to every published message (%d series)",
           n);
    ok((long long)ot_prom_val(text, "outbox_published_total{topic=\"_other\"}") > 0,
       "topics beyond the limit are counted under topic=\"_other\"");
    is_int((long long)ot_prom_val(text, "outbox_dead_lettered_total{topic=\"x\\\"y\\\\z\\nw\"}"), 1,
           "the invalid topic's label is escaped (quote, backslash, newline)");
    free(text);
}

static int healthz(char **body)
{
    return scrape("/healthz", body);
}

static void health_flips(pid_t pid)
{
    char *body = NULL;
    int st = 0;
    int64_t t0, t503 = -1, t200 = -1;

    st = healthz(&body);
    is_int(st, 200, "/healthz is 200 while Redis is up");
    is_str(body, "ok\n", "/healthz says ok");
    free(body);

    t0 = th_now_ms();
    th_redis_stop(&redis);
    while (th_now_ms() - t0 < 5000 * th_slow()) {
        body = NULL;
        st = healthz(&body);
        if (st == 503)
            break;
        free(body);
        th_sleep_ms(20);
    }
    if (st == 503)
        t503 = th_now_ms() - t0;
    is_int(st, 503, "/healthz turns 503 after Redis stopped (%lld ms)", (long long)t503);
    ok(t503 >= 450, "not before --health-redis-down-ms 500 (%lld ms)", (long long)t503);
    ok(st == 503 && body && strstr(body, "redis"), "the 503 body names redis: %.*s",
       body ? (int)strcspn(body, "\n") : 0, body ? body : "");
    if (st == 503)
        free(body);
    /* Messages committed while Redis is away wait for it. */
    rt_insert_rows(db, "c", 0, 100, "gamma", 0);

    if (th_redis_restart(&redis) != 0)
        bail("cannot restart redis-server");
    t0 = th_now_ms();
    while (th_now_ms() - t0 < 10000 * th_slow()) {
        body = NULL;
        st = healthz(&body);
        free(body);
        if (st == 200)
            break;
        th_sleep_ms(20);
    }
    if (st == 200)
        t200 = th_now_ms() - t0;
    is_int(st, 200, "/healthz is 200 again once Redis is back (%lld ms)", (long long)t200);
    t0 = th_now_ms();
    while (th_now_ms() - t0 < 10000 * th_slow() &&
           th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'gamma' AND state = 2") < 100)
        th_sleep_ms(10);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'gamma' AND state = 2"), 100,
           "the rows committed while Redis was down are published after it returned");
    {
        char *text = NULL;
        double v = -1;
        scrape("/metrics", &text);
        v = ot_prom_val(text, "outbox_redis_reconnects_total");
        ok(v >= 1, "outbox_redis_reconnects_total counts the lost connection (%g)", v);
        free(text);
    }
    is_int(th_stop(pid, SIGTERM, 10000), 0, "the relay stops cleanly on SIGTERM");
}

/* /healthz names the Redis URL: a long one must not overrun the answer. */
static void long_url(void)
{
    char url[512], listen[64], user[301], *resp = NULL, *cl, *log = th_path(dir, "long.log");
    const char *body;
    int st = 0;
    int64_t deadline;
    pid_t pid;
    memset(user, 'u', 300);
    user[300] = '\0';
    snprintf(url, sizeof url, "redis://%s:pw@127.0.0.1:1/3", user);
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    pid = rt_relay_spawn(log, dbpath, url, "--metrics-listen", listen, "--health-redis-down-ms", "1", NULL);
    deadline = th_now_ms() + 5000 * th_slow(); /* the relay starts listening (slowly under valgrind) */
    while (th_now_ms() < deadline) {
        const char req[] = "GET /healthz HTTP/1.1\r\n\r\n";
        free(resp);
        resp = NULL;
        if ((st = ot_http_raw(port, req, sizeof req - 1, &resp, 5000 * th_slow())) == 503)
            break;
        th_sleep_ms(20);
    }
    is_int(st, 503, "/healthz with a 300-byte Redis user name: 503");
    cl = resp ? ot_http_header(resp, "Content-Length") : NULL;
    body = resp ? ot_http_body(resp) : NULL;
    ok(cl && body && (size_t)atol(cl) == strlen(body), "Content-Length %s matches the body, no bytes beyond it",
       cl ? cl : "none");
    ok(body && strlen(body) > 2 && !strcmp(body + strlen(body) - 2, ")\n"), "the body is the whole message");
    free(cl);
    free(resp);
    is_int(th_stop(pid, SIGTERM, 10000), 0, "that relay stops cleanly");
    free(log);
}

int main(void)
{
    pid_t pid;
    char *log;
    if (th_redis_start(&redis, 0, NULL) != 0)
        bail("cannot start redis-server");
    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "metrics.db");
    logpath = th_path(dir, "relay.log");
    db = rt_open(dbpath);
    port = th_free_port();

    pid = metrics_while_draining();
    topic_labels();
    health_flips(pid);
    long_url();

    log = th_slurp(logpath);
    is_int(rt_count_substr(log, "level=error"), rt_count_substr(log, "level=error msg=\"dead-lettered\" id=odd-1 "),
           "no errors in the relay's log but the invalid row's dead letter");
    free(log);

    sqlite3_close_v2(db);
    th_redis_destroy(&redis);
    free(dbpath);
    free(logpath);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
