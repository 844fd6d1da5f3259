/*
 * /metrics while the daemon drains a backlog: valid Prometheus text,
 * counters that never decrease and end at the published count, database
 * figures that match the table, histograms that agree with the counters.
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
    char url[128], *out = NULL, *nl;
    char *argv[] = {"/usr/bin/curl", "-sS", "--max-time", "5", "-o", "-", "-w", "\n%{http_code}", url, NULL};
    int st, code;
    if (have_curl < 0) {
        have_curl = access(argv[0], X_OK) == 0;
        if (!have_curl)
            diag("no /usr/bin/curl: scraping over a plain socket");
    }
    if (!have_curl)
        return ot_http_get(port, path, body);
    snprintf(url, sizeof url, "http://127.0.0.1:%d%s", port, path);
    st = th_run(argv, NULL, &out, NULL, 10000);
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

static pid_t metrics_while_draining(void)
{
    char listen[64], *text = NULL;
    pid_t pid;
    int scrapes = 0, mid_scrapes = 0, bad_format = 0, decreased = 0, bad_hist = 0, latency_behind = 0, st;
    double last_sum = 0, v;
    int64_t start;
    const char *why = NULL;
    size_t i;

    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    rt_insert_rows(db, "a", 0, N_ROWS / 2, "alpha", 0);
    rt_insert_rows(db, "b", 0, N_ROWS / 2, "beta", 0);
    pid = rt_relay_spawn(logpath, dbpath, redis.url, "--metrics-listen", listen, "--batch", "64", "--inflight",
                         "256", "--health-redis-down-ms", "500", NULL);
    start = th_now_ms();
    for (;;) {
        int done = published_rows() == N_ROWS;
        char *body = NULL;
        double sum, lat = 0;
        int n;
        st = scrape("/metrics", &body);
        if (st == 200) {
            int bad;
            scrapes++;
            if ((bad = ot_prom_check(body, &why)) != 0 && bad_format++ == 0)
                diag("scrape %d: line %d: %s", scrapes, bad, why);
            sum = ot_prom_sum(body, "outbox_published_total", &n);
            if (sum < last_sum && decreased++ == 0)
                diag("published sum went from %g to %g", last_sum, sum);
            if (sum < N_ROWS && sum > 0)
                mid_scrapes++;
            last_sum = sum;
            /* Latency is observed when Redis accepts, the counter when the
             * mark commits: the histogram may run ahead, never behind. */
            ot_prom_get(body, "outbox_publish_latency_seconds_count", &lat);
            if (lat < sum && latency_behind++ == 0)
                diag("latency count %g below published %g", lat, sum);
            for (i = 0; i < sizeof histograms / sizeof histograms[0]; i++) {
                const char *w = check_histogram(body, histograms[i]);
                if (w && bad_hist++ == 0)
                    diag("scrape %d: %s", scrapes, w);
            }
        }
        free(body);
        if (done || th_now_ms() - start > 30000 * th_slow())
            break;
        th_sleep_ms(5);
    }
    diag("%d scrapes, %d while the backlog drained (%lld ms)", scrapes, mid_scrapes,
         (long long)(th_now_ms() - start));
    is_int(published_rows(), N_ROWS, "the relay published all %d rows", N_ROWS);
    ok(mid_scrapes >= 3, "several scrapes while publishing (%d)", mid_scrapes);
    is_int(bad_format, 0, "every scrape is valid Prometheus text");
    is_int(decreased, 0, "the sum of outbox_published_total never decreases");
    is_int(bad_hist, 0, "every histogram is cumulative with +Inf == _count");
    is_int(latency_behind, 0, "the latency histogram never lags the published counter");

    /* The database figures are at most a second old: wait that out. */
    th_sleep_ms(1100);
    st = scrape("/metrics", &text);
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
        st = ot_http_raw(port, req, sizeof req - 1, &resp, 5000);
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
    while (th_now_ms() - start < 5000 && th_sql_int(db, "SELECT state FROM outbox_messages WHERE id = 'odd-1'") != 3)
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
    while (th_now_ms() - start < 10000 && published_rows() < N_ROWS + 1100)
        th_sleep_ms(10);
    is_int(published_rows(), N_ROWS + 1100, "1,100 messages on 1,100 topics are published");
    /* The counters are bumped right after the marks commit. */
    for (i = 0; i < 100; i++) {
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
    while (th_now_ms() - t0 < 5000) {
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
    while (th_now_ms() - t0 < 10000) {
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
    while (th_now_ms() - t0 < 10000 &&
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
    deadline = th_now_ms() + 5000;
    while (th_now_ms() < deadline) {
        const char req[] = "GET /healthz HTTP/1.1\r\n\r\n";
        free(resp);
        resp = NULL;
        if ((st = ot_http_raw(port, req, sizeof req - 1, &resp, 5000)) == 503)
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
