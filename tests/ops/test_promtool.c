/*
 * /metrics checked by Prometheus' own tool: the daemon drains a backlog,
 * fails (a topic whose stream key is a string: WRONGTYPE) and dead-letters
 * (--max-attempts 1); a scrape taken while it drains and one taken at the end
 * go through `promtool check metrics` (its linter: HELP text, counter
 * suffixes, units in base units), skipped when promtool is not installed
 * (Debian's prometheus package; tools/monitoring.sh installs it); the drain
 * is held for the first one (Redis's writes paused, the write lock), so it
 * is mid-way whatever the relay's speed. Without
 * promtool too: every family has HELP and TYPE, no label but topic (and
 * state, le), and every metric name that the alert rules and the dashboard
 * use is in the scrape or is a recording rule (check_names.py).
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

#define N_ROWS 30000
#define N_BROKEN 20

static th_redis redis;
static char *dir, *dbpath, *logpath;
static sqlite3 *db;
static int port;

/* promtool from $PROMTOOL or the PATH, or NULL. */
static char *find_promtool(void)
{
    const char *env = getenv("PROMTOOL"), *path = getenv("PATH");
    char buf[4096];
    if (env && *env)
        return access(env, X_OK) == 0 ? strdup(env) : NULL;
    while (path && *path) {
        size_t n = strcspn(path, ":");
        snprintf(buf, sizeof buf, "%.*s/promtool", (int)n, path);
        if (n && access(buf, X_OK) == 0)
            return strdup(buf);
        path += n + (path[n] == ':');
    }
    return NULL;
}

/* The family a sample belongs to: histograms' _bucket, _sum and _count
 * samples belong to the histogram's family. */
static int family_of(const char *types, const char *sample, char *fam, size_t famlen)
{
    static const char *const suffixes[] = {"_bucket", "_sum", "_count"};
    char key[300];
    size_t i, n = strlen(sample);
    snprintf(fam, famlen, "%s", sample);
    snprintf(key, sizeof key, "# TYPE %s ", sample);
    if (strstr(types, key))
        return 1;
    for (i = 0; i < 3; i++) {
        size_t sl = strlen(suffixes[i]);
        if (n > sl && !strcmp(sample + n - sl, suffixes[i])) {
            snprintf(fam, famlen, "%.*s", (int)(n - sl), sample);
            snprintf(key, sizeof key, "# TYPE %s histogram", fam);
            if (strstr(types, key))
                return 1;
        }
    }
    return 0;
}

/* Every sample's family has HELP and TYPE lines, and its labels are among
 * topic, state and le. Returns NULL or what is wrong. */
static const char *check_families(const char *text)
{
    static char why[400];
    const char *p = text;
    while (*p) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        if (len && p[0] != '#') {
            char name[256], fam[256], help[300];
            size_t n = strcspn(p, "{ ");
            const char *l = p + n;
            snprintf(name, sizeof name, "%.*s", (int)(n < sizeof name ? n : sizeof name - 1), p);
            if (!family_of(text, name, fam, sizeof fam)) {
                snprintf(why, sizeof why, "%s has no TYPE line", name);
                return why;
            }
            snprintf(help, sizeof help, "# HELP %s ", fam);
            if (!strstr(text, help)) {
                snprintf(why, sizeof why, "%s has no HELP line", fam);
                return why;
            }
            if (*l == '{') {
                l++;
                while (*l && *l != '}') {
                    size_t ln = strcspn(l, "=");
                    if (!((ln == 5 && !strncmp(l, "topic", 5)) || (ln == 5 && !strncmp(l, "state", 5)) ||
                          (ln == 2 && !strncmp(l, "le", 2)))) {
                        snprintf(why, sizeof why, "%s has label %.*s", name, (int)ln, l);
                        return why;
                    }
                    l += ln + 2; /* =" */
                    while (*l && *l != '"')
                        l += *l == '\\' && l[1] ? 2 : 1;
                    if (*l)
                        l++;
                    if (*l == ',')
                        l++;
                }
            }
        }
        if (!nl)
            break;
        p = nl + 1;
    }
    return NULL;
}

static char *save(const char *name, const char *text)
{
    char *path = th_path(dir, name);
    FILE *f = fopen(path, "w");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0)
        bail("cannot write %s", path);
    return path;
}

/* Runs argv; returns the status, stdout and stderr together in *out. */
static int run(char *const argv[], char **out)
{
    char *o = NULL, *e = NULL;
    int st = th_run(argv, NULL, &o, &e, 60000);
    size_t n = (o ? strlen(o) : 0) + (e ? strlen(e) : 0) + 1;
    *out = malloc(n);
    if (!*out)
        bail("out of memory");
    snprintf(*out, n, "%s%s", o ? o : "", e ? e : "");
    free(o);
    free(e);
    return st;
}

static void promtool_check(const char *promtool, const char *what, const char *text)
{
    char *path = save(what, text), *out = NULL, cmd[4096];
    char *argv[] = {"/bin/sh", "-c", cmd, NULL};
    int st;
    if (!promtool) {
        printf("ok %d - # SKIP promtool check metrics (%s): promtool is not installed\n", ++tap_count_, what);
        free(path);
        return;
    }
    snprintf(cmd, sizeof cmd, "'%s' check metrics < '%s'", promtool, path);
    st = run(argv, &out);
    if (!ok(st == 0, "promtool check metrics: the %s scrape is clean (exit %d)", what, st))
        th_diag_tail("promtool: ", out, 40);
    free(out);
    free(path);
}

int main(void)
{
    char listen[64], *text = NULL, *mid = NULL, *promtool = find_promtool(), *src = getenv("OUTBOX_SOURCE_DIR");
    const char *why;
    redisContext *c;
    redisReply *rep;
    int64_t start;
    pid_t pid;
    int scrapes = 0, bad = 0;

    if (!src)
        bail("OUTBOX_SOURCE_DIR is not set (run through meson test)");
    if (th_redis_start(&redis, 0, NULL) != 0)
        skip_all("cannot start redis-server");
    if (!promtool)
        diag("promtool not found: its checks are skipped (install Debian's prometheus: bash tools/monitoring.sh)");
    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "promtool.db");
    logpath = th_path(dir, "relay.log");
    db = rt_open(dbpath);
    port = th_free_port();
    c = th_redis_client(&redis);
    rep = th_cmd(c, "SET outbox:broken not-a-stream");
    freeReplyObject(rep);

    rt_insert_rows(db, "a", 0, N_ROWS, "orders", 16);
    rt_insert_rows(db, "b", 0, N_BROKEN, "broken", 0);
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    /* A scrape mid-way, whatever the relay's speed: it starts with Redis's
     * writes paused; once its XADDs wait there, the test holds the write
     * lock (no mark, no claim) and lets Redis answer them, then pauses
     * Redis again and releases the lock: the relay marks at most its
     * --inflight (256) rows and its next XADDs wait. That scrape is the
     * mid-way one. */
    ot_redis_pause(c, 20000);
    pid = rt_relay_spawn(logpath, dbpath, redis.url, "--metrics-listen", listen, "--batch", "64", "--inflight",
                         "256", "--max-attempts", "1", "--reply-timeout-ms", "25000", NULL);
    start = th_now_ms();
    if (ot_wait_gauges(port, 1, start + 20000 * th_slow())) {
        int64_t deadline = th_now_ms() + 10000 * th_slow();
        th_sql_exec(db, "BEGIN IMMEDIATE");
        ot_redis_pause(c, 0);
        if (ot_wait_gauges(port, 0, deadline)) {
            ot_redis_pause(c, 20000);
            th_sql_exec(db, "COMMIT");
            while (!mid && th_now_ms() < deadline) {
                char *body = NULL;
                if (ot_http_get(port, "/metrics", &body) == 200 &&
                    ot_prom_sum(body, "outbox_published_total", NULL) > 0) {
                    double published = ot_prom_sum(body, "outbox_published_total", NULL);
                    if (published < N_ROWS)
                        mid = strdup(body);
                    diag("held: %g of %d published", published, N_ROWS);
                    free(body);
                    break;
                }
                free(body);
                th_sleep_ms(1);
            }
        }
        if (sqlite3_get_autocommit(db) == 0)
            th_sql_exec(db, "COMMIT");
    }
    ot_redis_pause(c, 0);

    /* Scrape while it drains to the end. */
    while (th_now_ms() - start < 60000 * th_slow()) {
        char *body = NULL;
        if (ot_http_get(port, "/metrics", &body) == 200) {
            double published = ot_prom_sum(body, "outbox_published_total", NULL);
            double dead = ot_prom_sum(body, "outbox_dead_lettered_total", NULL);
            scrapes++;
            if ((why = check_families(body)) != NULL && bad++ == 0)
                diag("scrape %d: %s", scrapes, why);
            if (!mid && published > 0 && published < N_ROWS)
                mid = strdup(body);
            /* The database figures lag the counters by up to a second. */
            if (published >= N_ROWS && dead >= N_BROKEN &&
                ot_prom_val(body, "outbox_messages{state=\"dead\"}") >= N_BROKEN) {
                text = body;
                break;
            }
        }
        free(body);
        th_sleep_ms(5);
    }
    ok(text != NULL, "the relay published %d rows and dead-lettered %d (%d scrapes)", N_ROWS, N_BROKEN, scrapes);
    if (!text)
        bail("no final scrape");
    ok(bad == 0, "every scrape: every family has HELP and TYPE, labels only topic, state, le (%d bad)", bad);
    why = check_families(text);
    ok(!why, "the final scrape's families and labels%s%s", why ? ": " : "", why ? why : "");
    is_int((long long)ot_prom_val(text, "outbox_failed_total{topic=\"broken\"}"), N_BROKEN,
           "outbox_failed_total counts the WRONGTYPE failures");
    is_int((long long)ot_prom_val(text, "outbox_dead_lettered_total{topic=\"broken\"}"), N_BROKEN,
           "outbox_dead_lettered_total counts the dead letters");
    is_int((long long)ot_prom_val(text, "outbox_messages{state=\"dead\"}"), N_BROKEN,
           "outbox_messages{state=\"dead\"}");

    if (mid)
        promtool_check(promtool, "draining", mid);
    else
        ok(0, "a scrape taken while the drain was held, for promtool check metrics");
    promtool_check(promtool, "final", text);

    /* The names the rules and the dashboard query exist. */
    {
        char *mpath = save("final.prom", text), *out = NULL, script[1024], rules[1024], dash[1024];
        char *argv[] = {"/usr/bin/python3", script, "--metrics", mpath, rules, dash, NULL};
        int st;
        snprintf(script, sizeof script, "%s/tools/prometheus/check_names.py", src);
        snprintf(rules, sizeof rules, "%s/tools/prometheus/outbox.rules.yml", src);
        snprintf(dash, sizeof dash, "%s/tools/prometheus/outbox-dashboard.json", src);
        st = run(argv, &out);
        if (!ok(st == 0, "every metric the rules and the dashboard use is in /metrics or is a recording rule"))
            th_diag_tail("check_names: ", out, 40);
        free(out);
        free(mpath);
    }

    is_int(th_stop(pid, SIGTERM, 10000), 0, "the relay stops cleanly on SIGTERM");
    free(text);
    free(mid);
    free(promtool);
    redisFree(c);
    sqlite3_close_v2(db);
    th_redis_destroy(&redis);
    free(dbpath);
    free(logpath);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
