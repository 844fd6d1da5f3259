/*
 * test_cluster_flow.c: one node down must not stop the others, and a plain
 * URL to a cluster node is a configuration error, not a flood of failures.
 *   1. A cluster of 3 masters with a replica each, started with
 *      cluster-require-full-coverage no (with the default yes, every node
 *      answers CLUSTERDOWN once the cluster state is fail, and nothing can
 *      flow anywhere). The relay publishes 6 unkeyed topics, 2 per master,
 *      from a writer that keeps committing. One master is SIGKILLed: until
 *      its replica is promoted, the topics of the two other masters keep
 *      being published (their count rises during the window), while the dead
 *      master's do not; afterwards everything drains, nothing lost.
 *   2. outbox-relay with a plain redis:// URL naming a cluster node: one
 *      error naming redis-cluster://, /healthz 503 with the reason, no row
 *      published and none failed (attempts stay 0), then SIGTERM.
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bg_writer.h"
#include "cluster_env.h"
#include "harness.h"
#include "ops.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define TOPICS 6

static ce_env env;
static sqlite3 *db;
static char *dir, *dbpath;
static char streams[TOPICS][80];
static const char *topics[TOPICS];
static int owner_of[TOPICS];

static bg_writer writer;

static int64_t published_on(int node, int on)
{
    int64_t n = 0;
    for (int i = 0; i < TOPICS; i++)
        if ((owner_of[i] == node) == on)
            n += th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = %Q AND state = 2", topics[i]);
    return n;
}

/* The CPU time (user + system, ms) a process used so far, -1 if unknown. */
static int64_t cpu_ms(pid_t pid)
{
    char path[64], buf[1024], *p;
    unsigned long long ut, st;
    FILE *f;
    size_t n;
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    if (!(f = fopen(path, "r")))
        return -1;
    n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    /* After the command name's closing parenthesis: state is field 3,
     * utime 14, stime 15. */
    if (!(p = strrchr(buf, ')')) || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return -1;
    return (int64_t)((ut + st) * 1000 / (unsigned long long)sysconf(_SC_CLK_TCK));
}

static int settled(void *arg)
{
    (void)arg;
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE state < 2") == 0;
}

/* Samples, from its own thread, the published counts while the main thread
 * kills a master and waits for its replica. */
typedef struct sampler {
    pthread_t thread;
    atomic_int stop;
    int victim;
    sqlite3 *db;
    int64_t others_first, others_max, victim_first, victim_max;
    int64_t committed_first, committed_max; /* rows of the other masters' topics, any state */
    int samples;
} sampler;

static int64_t count_on(sqlite3 *c, int node, int on)
{
    int64_t n = 0;
    for (int i = 0; i < TOPICS; i++)
        if ((owner_of[i] == node) == on)
            n += th_sql_int(c, "SELECT count(*) FROM outbox_messages WHERE topic = %Q AND state = 2", topics[i]);
    return n;
}

static int64_t committed_off(sqlite3 *c, int node)
{
    int64_t n = 0;
    for (int i = 0; i < TOPICS; i++)
        if (owner_of[i] != node)
            n += th_sql_int(c, "SELECT count(*) FROM outbox_messages WHERE topic = %Q", topics[i]);
    return n;
}

static void *sampler_main(void *arg)
{
    sampler *s = arg;
    s->others_first = s->others_max = count_on(s->db, s->victim, 0);
    s->victim_first = s->victim_max = count_on(s->db, s->victim, 1);
    s->committed_first = s->committed_max = committed_off(s->db, s->victim);
    while (!atomic_load(&s->stop)) {
        th_sleep_ms(100);
        s->committed_max = committed_off(s->db, s->victim);
        s->others_max = count_on(s->db, s->victim, 0);
        s->victim_max = count_on(s->db, s->victim, 1);
        s->samples++;
    }
    return NULL;
}

static void test_others_flow(void)
{
    char log[512];
    pid_t pid;
    int masters[CE_MAX_NODES], nm = ce_master_list(&env, masters), victim, promoted;
    sampler s;
    int64_t t0, t1, cpu0, cpu1, cpu_before;

    for (int i = 0; i < TOPICS; i++) {
        char prefix[32];
        snprintf(prefix, sizeof prefix, "outbox:f%d-", i);
        if (ce_name_in_slot(&env, ce_lowest_slot(&env, masters[i % nm]) + i / nm, prefix, streams[i],
                            sizeof streams[i]) != 0)
            bail("no stream name");
        topics[i] = streams[i] + 7;
        owner_of[i] = masters[i % nm];
    }
    victim = masters[0];
    snprintf(log, sizeof log, "%s/relay-flow.log", dir);
    pid = rt_relay_spawn(log, dbpath, env.url, "--max-attempts", "100000", "--backoff-min-ms", "50",
                         "--backoff-max-ms", "300", "--batch", "64", NULL);
    bg_writer_start(&writer, dbpath, topics, TOPICS, 0, "");
    {
        int64_t end = th_now_ms() + 10000 * th_slow();
        while ((published_on(victim, 1) == 0 || published_on(victim, 0) == 0) && th_now_ms() < end)
            th_sleep_ms(50);
    }
    cpu_before = cpu_ms(pid);
    th_sleep_ms(1000);
    cpu_before = cpu_ms(pid) - cpu_before;
    ok(published_on(victim, 1) > 0 && published_on(victim, 0) > 0, "flow: publishing to every master before");

    memset(&s, 0, sizeof s);
    s.victim = victim;
    s.db = rt_open(dbpath);
    if (pthread_create(&s.thread, NULL, sampler_main, &s) != 0)
        bail("pthread_create");
    t0 = th_now_ms();
    cpu0 = cpu_ms(pid);
    promoted = ce_kill_master(&env, victim);
    t1 = th_now_ms();
    cpu1 = cpu_ms(pid);
    atomic_store(&s.stop, 1);
    pthread_join(s.thread, NULL);
    sqlite3_close(s.db);
    ok(promoted >= 0, "flow: master %d killed, replica %d promoted after %lld ms", victim, promoted,
       (long long)(t1 - t0));
    diag("flow: during the %lld ms window: %lld published on the other masters, %lld on the dead one's streams",
         (long long)(t1 - t0), (long long)(s.others_max - s.others_first), (long long)(s.victim_max - s.victim_first));
    diag("flow: relay CPU %lld ms per second with every master up, %lld ms per second while one was down",
         (long long)cpu_before, (long long)((cpu1 - cpu0) * 1000 / (t1 - t0 ? t1 - t0 : 1)));
    /* The writer commits 4 rows per topic every ~5 ms, as fast as this
     * machine lets it: at least a quarter of what it committed for the
     * live masters' topics during the window must be published then (a
     * th_slow() times less in a slow run), whatever the machine's speed. */
    ok(s.others_max - s.others_first > 0 &&
           (s.others_max - s.others_first) * 4 * th_slow() >= s.committed_max - s.committed_first,
       "flow: the other masters' topics kept flowing while one was down (%lld rows published in %lld ms, "
       "%lld committed)",
       (long long)(s.others_max - s.others_first), (long long)(t1 - t0),
       (long long)(s.committed_max - s.committed_first));

    th_sleep_ms(500);
    bg_writer_stop(&writer);
    ok(th_wait_until(60000 * th_slow(), settled, NULL), "flow: every row settled after the promotion");
    is_int(th_stop(pid, SIGTERM, 20000), 0, "flow: the relay stops cleanly");
    {
        long missing = 0, dups = 0;
        for (int i = 0; i < TOPICS; i++) {
            int o = ce_owner(&env, streams[i]);
            redisContext *c = o >= 0 ? ce_client(&env, o) : NULL;
            rt_audit a;
            if (!c)
                bail("no owner for %s", streams[i]);
            a = rt_audit_topic(db, c, "outbox:", topics[i]);
            /* A dying master may lose what it acknowledged and had not
             * replicated (no --wait-replicas here): only its streams. */
            if (owner_of[i] != victim)
                missing += a.missing + a.dead;
            dups += a.dups;
            redisFree(c);
        }
        is_int(missing, 0, "flow: every row of the live masters' topics is in its stream");
        diag("flow: %ld duplicates", dups);
    }
    is_int(ce_restart(&env, victim), 0, "flow: the killed node is back");
}

static void test_plain_url(void)
{
    char log[512], listen[32], url[64], *body = NULL, *text;
    int mport = th_free_port(), st, masters[CE_MAX_NODES];
    pid_t pid;
    int64_t end;

    ce_master_list(&env, masters);
    rt_insert_rows(db, "plain", 0, 50, "plain", 0);
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", env.node[masters[0]].port);
    snprintf(listen, sizeof listen, "127.0.0.1:%d", mport);
    snprintf(log, sizeof log, "%s/relay-plain.log", dir);
    pid = rt_relay_spawn(log, dbpath, url, "--metrics-listen", listen, NULL);
    end = th_now_ms() + 10000 * th_slow();
    do {
        th_sleep_ms(100);
        free(body);
        body = NULL;
        st = ot_http_get(mport, "/healthz", &body);
    } while (st != 503 && th_now_ms() < end);
    is_int(st, 503, "plain URL: /healthz is unhealthy");
    ok(body && strstr(body, "names a Redis Cluster node") && strstr(body, "redis-cluster://127.0.0.1:"),
       "plain URL: /healthz names the cluster URL form (%s)", body ? body : "");
    free(body);
    th_sleep_ms(1500);
    is_int(th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE topic = 'plain' AND state = 2"), 0,
           "plain URL: nothing published");
    is_int(th_sql_int(db, "SELECT coalesce(max(attempts), 0) FROM outbox_messages WHERE topic = 'plain'"), 0,
           "plain URL: no message failed one by one (attempts 0)");
    is_int(th_stop(pid, SIGTERM, 20000), 0, "plain URL: the relay stops on SIGTERM");
    text = th_slurp(log);
    is_int(rt_count_substr(text ? text : "", "publishing held"), 1, "plain URL: one error line");
    ok(text && strstr(text, "use a cluster URL, redis-cluster://127.0.0.1:"), "plain URL: the log names redis-cluster://");
    if (text)
        th_diag_tail("relay log", text, 4);
    free(text);
    th_sql_exec(db, "DELETE FROM outbox WHERE topic = 'plain'");
}

/* The relay embedded on a libuv loop with a cluster URL: drained, and
 * outbox_relay_nodes_get names the masters it is connected to. */
typedef struct embedded {
    outbox_relay_node_stats nodes[16];
    size_t n;
    uint64_t refreshes;
    int drained, stopped, rc;
} embedded;

static void on_stopped(outbox_relay *r, void *data)
{
    (void)r;
    ((embedded *)data)->stopped = 1;
}

static void on_drained(outbox_relay *r, void *data)
{
    embedded *x = data;
    x->drained = 1;
    x->rc = outbox_relay_nodes_get(r, x->nodes, 16, &x->n, &x->refreshes);
    outbox_relay_stop(r, on_stopped, x);
}

static void test_embedded(void)
{
    uv_loop_t loop;
    outbox_relay *r = NULL;
    outbox_relay_settings s;
    embedded x;
    char err[256];
    int connected = 0, masters = 0;
    memset(&x, 0, sizeof x);
    for (int i = 0; i < 3; i++) {
        char topic[16];
        snprintf(topic, sizeof topic, "emb%d", i);
        rt_insert_rows(db, topic, 0, 20, topic, 0);
    }
    uv_loop_init(&loop);
    outbox_relay_defaults(&s);
    s.db_path = dbpath;
    s.redis_url = env.url;
    s.drain = 1;
    s.drain_timeout_ms = 20000;
    s.log_level = OUTBOX_LOG_WARN;
    s.on_drained = on_drained;
    s.on_drained_data = &x;
    is_int(outbox_relay_create(&r, &loop, &s, err, sizeof err), 0, "embedded: created with %s (%s)", env.url, err);
    is_int(outbox_relay_start(r), 0, "embedded: started");
    uv_run(&loop, UV_RUN_DEFAULT);
    is_int(x.drained && x.stopped, 1, "embedded: drained and stopped");
    is_int(outbox_relay_drain_result(r), 0, "embedded: the drain succeeded");
    is_int(x.rc, 0, "embedded: outbox_relay_nodes_get returns 0");
    for (size_t i = 0; i < x.n && i < 16; i++) {
        connected += x.nodes[i].connected && x.nodes[i].master;
        masters += x.nodes[i].master;
    }
    is_int(masters, 3, "embedded: three masters in the slot map (%zu nodes known)", x.n);
    ok(connected >= 1, "embedded: connected to the masters its streams are on (%d)", connected);
    ok(x.refreshes >= 1, "embedded: the slot map was loaded (%llu refreshes)", (unsigned long long)x.refreshes);
    outbox_relay_destroy(r);
    is_int(uv_loop_close(&loop), 0, "embedded: loop closed cleanly");
    th_sql_exec(db, "DELETE FROM outbox WHERE topic LIKE 'emb%%'");
}

int main(void)
{
    int64_t t0 = th_now_ms();
    signal(SIGPIPE, SIG_IGN);
    if (ce_start(&env, 3, 1, 0, "cluster-require-full-coverage no\n") != 0) {
        ok(0, "cluster starts");
        return tap_done();
    }
    dir = th_tmpdir();
    dbpath = rt_make_db(dir, "app.db");
    db = rt_open(dbpath);
    test_plain_url();
    test_embedded();
    test_others_flow();
    sqlite3_close(db);
    ce_stop(&env);
    th_rmtree(dir);
    free(dir);
    free(dbpath);
    diag("total %lld ms", (long long)(th_now_ms() - t0));
    return tap_done();
}
