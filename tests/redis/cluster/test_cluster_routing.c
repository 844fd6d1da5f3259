/*
 * test_cluster_routing.c: the cluster layer (src/redis/cluster/cluster.c) against scripted
 * fake nodes: the exact sequence of commands each redirection leads to,
 * the slot map's fallback to CLUSTER SLOTS, retries within the deadline,
 * malformed redirections, redirect loops, a node that disappears, and every
 * callback called exactly once. Also the key slots (CRC16 with hash tags)
 * and the cluster URLs.
 */
#include <signal.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uv.h>

#include "redis/cluster/cluster.h"
#include "fake_node.h"
#include "harness.h"
#include "relay/idem.h"
#include "redis/redis.h"
#include "redis/cluster/slot.h"
#include "tap.h"

typedef struct rec {
    int calls, status, type;
    char str[300];
} rec;

typedef struct world {
    uv_loop_t loop;
    uv_timer_t wd;
    outbox__cluster *c;
    int ready, downs, node_ups, closed;
} world;

static void on_wd(uv_timer_t *t)
{
    (void)t;
}

static void on_ready(outbox__cluster *c, void *data)
{
    (void)c;
    ((world *)data)->ready++;
}

static void on_down(outbox__cluster *c, int status, void *data)
{
    (void)c, (void)status;
    ((world *)data)->downs++;
}

static void on_node_up(outbox__cluster *c, outbox__cluster_node *n, outbox__redis *conn, void *data)
{
    (void)c, (void)n, (void)conn;
    ((world *)data)->node_ups++;
}

static void on_closed(void *data)
{
    ((world *)data)->closed++;
}

static void on_reply(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    rec *r = data;
    (void)conn;
    r->calls++;
    r->status = status;
    r->type = reply ? reply->type : -1;
    if (reply && reply->str)
        snprintf(r->str, sizeof r->str, "%.*s", (int)reply->len, reply->str);
}

static void run_until(world *w, const int *flag, int ms)
{
    int64_t end = th_now_ms() + ms;
    while (!*flag && th_now_ms() < end)
        uv_run(&w->loop, UV_RUN_ONCE);
}

static void world_open(world *w, const char *url, unsigned max_redirects)
{
    outbox__redis_url u;
    outbox__cluster_options o;
    outbox__cluster_hooks h = {on_ready, on_down, on_node_up, w};
    char err[256];
    memset(w, 0, sizeof *w);
    if (uv_loop_init(&w->loop) != 0)
        bail("uv_loop_init");
    uv_timer_init(&w->loop, &w->wd);
    uv_timer_start(&w->wd, on_wd, 20, 20);
    if (outbox__redis_url_parse(url, &u, err, sizeof err) != 0)
        bail("url %s: %s", url, err);
    outbox__cluster_options_defaults(&o);
    o.redis.connect_timeout_ms = 1000;
    o.redis.reply_timeout_ms = 2000;
    if (max_redirects)
        o.max_redirects = max_redirects;
    if (outbox__cluster_create(&w->c, &w->loop, &u, &o, NULL, "test", &h) != 0)
        bail("outbox__cluster_create");
    outbox__redis_url_free(&u);
    outbox__cluster_start(w->c);
    run_until(w, &w->ready, 3000);
}

static int world_close(world *w)
{
    outbox__cluster_close(w->c, on_closed, w);
    run_until(w, &w->closed, 3000);
    uv_close((uv_handle_t *)&w->wd, NULL);
    uv_run(&w->loop, UV_RUN_DEFAULT);
    return uv_loop_close(&w->loop);
}

static int get(world *w, const char *key, rec *r, uint64_t timeout_ms)
{
    const char *argv[2] = {"GET", key};
    size_t lens[2] = {3, strlen(key)};
    memset(r, 0, sizeof *r);
    return outbox__cluster_command_argv(w->c, key, strlen(key), 2, argv, lens, timeout_ms, on_reply, r, NULL);
}

static char *url_for(const fake_nodes *f, int node)
{
    static char buf[64];
    snprintf(buf, sizeof buf, "redis-cluster://127.0.0.1:%d", fake_nodes_port(f, node));
    return buf;
}

static int count_substr(const char *s, const char *needle)
{
    int n = 0;
    for (const char *p = s; (p = strstr(p, needle)) != NULL; p += strlen(needle))
        n++;
    return n;
}

static void test_slots(void)
{
    is_int(outbox__crc16("123456789", 9), 0x31C3, "CRC16-XMODEM of 123456789 is 0x31C3");
    is_int(outbox__key_slot("foo", 3), 12182, "slot of foo is 12182");
    is_int(outbox__key_slot("{user1000}.following", 20), outbox__key_slot("{user1000}.followers", 20),
           "{user1000}.following and {user1000}.followers share a slot");
    is_int(outbox__key_slot("{user1000}.following", 20), outbox__key_slot("user1000", 8),
           "the hash tag alone decides");
    is_int(outbox__key_slot("foo{}{bar}", 10), outbox__crc16("foo{}{bar}", 10) & 16383,
           "foo{}{bar} hashes the whole key");
    is_int(outbox__key_slot("foo{{bar}}zap", 13), outbox__crc16("{bar", 4) & 16383, "foo{{bar}}zap hashes {bar");
    is_int(outbox__key_slot("foo{bar}{zap}", 13), outbox__key_slot("bar", 3), "foo{bar}{zap} hashes bar");
    is_int(outbox__key_slot("{", 1), outbox__crc16("{", 1) & 16383, "a lone { hashes the whole key");
    is_int(outbox__key_slot("", 0), 0, "the empty key is slot 0");
}

/* Idempotent publish markers share their stream's slot whatever braces
 * the prefix and the topic hold. */
static void test_markers(void)
{
    static const char *const cases[][2] = {
        {"outbox:", "orders"},     {"outbox:", "{eu}orders"}, {"outbox:", "a}b"},  {"outbox:", "a{}b"},
        {"app{x}:", "orders"},     {"{", "}"},                {"outbox:", "}{x}"}, {"", "{}{}"},
        {"outbox:", "orders{eu}"}, {"p:", "{{a}}"},
    };
    char *m = outbox__idem_marker("outbox:", "outbox:orders", "id1", 0);
    is_str(m, "outbox:idem:{outbox:orders}:id1", "marker: the documented layout for a plain topic");
    free(m);
    m = outbox__idem_marker("outbox:", "outbox:orders", "id1", 2);
    is_str(m, "outbox:idem:{outbox:orders}:id1:r2", "marker: with its replay count");
    free(m);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char stream[64];
        snprintf(stream, sizeof stream, "%s%s", cases[i][0], cases[i][1]);
        m = outbox__idem_marker(cases[i][0], stream, "0190f1e2-id", 0);
        ok(m && outbox__key_slot(m, strlen(m)) == outbox__key_slot(stream, strlen(stream)),
           "marker %s of stream %s is in the stream's slot %u", m ? m : "(null)", stream,
           outbox__key_slot(stream, strlen(stream)));
        free(m);
    }
}

static void test_urls(void)
{
    static const struct {
        const char *url, *err;
    } bad[] = {
        {"redis-cluster://", "empty seed node list: expected redis-cluster://host:port[,host:port...]"},
        {"redis-cluster:///0", "empty seed node list: expected redis-cluster://host:port[,host:port...]"},
        {"redis-cluster://h:1,,h:2", "empty host in the seed node list"},
        {"redis-cluster://h:1,h:99999", "port 99999 out of range 1..65535"},
        {"redis-cluster://h:1/1", "database 1 with redis-cluster://: a Redis Cluster has only database 0"},
        {"rediss-cluster://h:1/3", "database 3 with rediss-cluster://: a Redis Cluster has only database 0"},
        {"redis-cluster://h:1/x", "database 'x' is not a number"},
        {"redis-cluster://h:1#m", "unexpected '#m' in redis-cluster:// URL: expected redis-cluster://host:port[,host:port...]"},
        {"redis-cluster://h:1?db=1", "unexpected '?db=1' in redis-cluster:// URL: expected redis-cluster://host:port[,host:port...]"},
        {"redis-clusters://h:1", "bad scheme 'redis-clusters', expected redis://, rediss://, unix://, redis-sentinel://, rediss-sentinel://, redis-cluster:// or rediss-cluster://"},
    };
    outbox__redis_url u, c;
    char err[256], desc[300];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int e = outbox__redis_url_parse(bad[i].url, &u, err, sizeof err);
        is_int(e, OUTBOX_EURL, "%s is refused", bad[i].url);
        is_str(err, bad[i].err, "%s: the message says why", bad[i].url);
    }
    is_int(outbox__redis_url_parse("redis-cluster://al%40ce:p%3Ass@10.0.0.1:7000,[::1]:7001,node-c/0", &u, err,
                                   sizeof err),
           0, "a cluster URL with three seeds parses");
    ok(u.cluster && u.cluster->n == 3, "three seeds");
    if (u.cluster && u.cluster->n == 3) {
        is_str(u.cluster->hosts[0], "10.0.0.1", "seed 1 host");
        is_int(u.cluster->ports[0], 7000, "seed 1 port");
        is_str(u.cluster->hosts[1], "::1", "seed 2 is IPv6");
        is_int(u.cluster->ports[2], 6379, "seed 3 gets the default port");
    }
    is_str(u.user, "al@ce", "user percent-decoded");
    is_str(u.password, "p:ss", "password percent-decoded");
    ok(u.host == NULL && !u.tls && u.db == 0, "no host of its own, no TLS, db 0");
    is_int(outbox__redis_url_copy(&c, &u), 0, "copied");
    outbox__redis_url_describe(&c, desc, sizeof desc);
    is_str(desc, "redis-cluster://al@ce:***@10.0.0.1:7000,[::1]:7001,node-c:6379", "described without the password");
    outbox__redis_url_free(&c);
    outbox__redis_url_free(&u);
    is_int(outbox__redis_url_parse("rediss-cluster://h1:7000", &u, err, sizeof err), 0, "rediss-cluster:// parses");
    ok(u.tls == 1 && u.cluster && u.cluster->n == 1, "with TLS");
    outbox__redis_url_free(&u);
}

/* The slot map from CLUSTER SLOTS after CLUSTER SHARDS is refused; a key
 * goes to its node. */
static void test_slots_fallback(fake_nodes *f)
{
    world w;
    rec r;
    static const char *const bar[] = {"$3\r\nbar\r\n", NULL};
    fake_nodes_reset(f);
    fake_nodes_rule(f, 0, "GET", bar);
    world_open(&w, url_for(f, 0), 0);
    is_int(w.ready, 1, "fallback: ready once, from CLUSTER SLOTS");
    is_int(get(&w, "foo", &r, 0), 0, "fallback: GET accepted");
    run_until(&w, &r.calls, 3000);
    is_int(r.calls, 1, "fallback: one callback");
    is_str(r.str, "bar", "fallback: the reply");
    is_int(world_close(&w), 0, "fallback: loop closed cleanly");
}

/* MOVED to a node that answers MOVED back: bounded, with a clear error. */
static void test_moved_back(fake_nodes *f)
{
    world w;
    rec r;
    static const char *const m1[] = {"-MOVED 12182 127.0.0.1:%1\r\n", NULL};
    static const char *const m0[] = {"-MOVED 12182 127.0.0.1:%0\r\n", NULL};
    char want[128];
    char *log;
    fake_nodes_reset(f);
    fake_nodes_rule(f, 0, "GET", m1);
    fake_nodes_rule(f, 1, "GET", m0);
    world_open(&w, url_for(f, 0), 0);
    is_int(get(&w, "foo", &r, 0), 0, "moved back: accepted");
    run_until(&w, &r.calls, 3000);
    is_int(r.calls, 1, "moved back: one callback");
    is_int(r.type, REDIS_REPLY_ERROR, "moved back: an error reply");
    snprintf(want, sizeof want, "redirect loop: MOVED 12182 to 127.0.0.1:%d after 5 redirections", fake_nodes_port(f, 0));
    is_str(r.str, want, "moved back: the error names the loop");
    log = fake_nodes_log(f);
    is_str(log, "n0:GET foo|n1:GET foo|n0:GET foo|n1:GET foo|n0:GET foo|n1:GET foo", "moved back: 1 + 5 sends, alternating");
    free(log);
    ok(outbox__cluster_refreshes(w.c, NULL) <= 2, "moved back: 5 MOVED, the map refreshed at most once more (%llu)",
       (unsigned long long)outbox__cluster_refreshes(w.c, NULL));
    is_int(world_close(&w), 0, "moved back: loop closed cleanly");
}

/* ASK, then the ASK target answers MOVED: ASKING + command, then the
 * MOVED target; the map follows MOVED, not ASK. */
static void test_ask_then_moved(fake_nodes *f)
{
    world w;
    rec r;
    static const char *const a1[] = {"-ASK 12182 127.0.0.1:%1\r\n", NULL};
    static const char *const m2[] = {"-MOVED 12182 127.0.0.1:%2\r\n", NULL};
    static const char *const okr[] = {"+done\r\n", NULL};
    char *log;
    fake_nodes_reset(f);
    fake_nodes_rule(f, 0, "GET", a1);
    fake_nodes_rule(f, 1, "GET", m2);
    fake_nodes_rule(f, 2, "GET", okr);
    world_open(&w, url_for(f, 0), 0);
    is_int(get(&w, "foo", &r, 0), 0, "ask/moved: accepted");
    run_until(&w, &r.calls, 3000);
    is_int(r.calls, 1, "ask/moved: one callback");
    is_str(r.str, "done", "ask/moved: the final node's reply");
    log = fake_nodes_log(f);
    is_str(log, "n0:GET foo|n1:ASKING|n1:GET foo|n2:GET foo", "ask/moved: GET, ASKING + GET, GET");
    free(log);
    is_int(get(&w, "foo", &r, 0), 0, "ask/moved: second GET accepted");
    run_until(&w, &r.calls, 3000);
    is_str(r.str, "done", "ask/moved: the second GET goes straight to the MOVED target");
    is_int(fake_nodes_count(f, 2, "GET"), 2, "ask/moved: node 2 got both");
    is_int(fake_nodes_count(f, 0, "GET"), 1, "ask/moved: node 0 only the first");
    is_int(world_close(&w), 0, "ask/moved: loop closed cleanly");
}

/* ASK does not change the map: the next command goes to the old node. */
static void test_ask_keeps_map(fake_nodes *f)
{
    world w;
    rec r;
    static const char *const a1[] = {"-ASK 12182 127.0.0.1:%1\r\n", "+mine\r\n", NULL};
    static const char *const okr[] = {"+imported\r\n", NULL};
    char *log;
    fake_nodes_reset(f);
    fake_nodes_rule(f, 0, "GET", a1);
    fake_nodes_rule(f, 1, "GET", okr);
    world_open(&w, url_for(f, 0), 0);
    get(&w, "foo", &r, 0);
    run_until(&w, &r.calls, 3000);
    is_str(r.str, "imported", "ask: served by the target with ASKING");
    get(&w, "foo", &r, 0);
    run_until(&w, &r.calls, 3000);
    is_str(r.str, "mine", "ask: the next command goes to the slot's owner again");
    log = fake_nodes_log(f);
    is_str(log, "n0:GET foo|n1:ASKING|n1:GET foo|n0:GET foo", "ask: the sequence");
    free(log);
    is_int(world_close(&w), 0, "ask: loop closed cleanly");
}

/* TRYAGAIN five times, then the command succeeds; and TRYAGAIN for ever
 * gives the caller TRYAGAIN at the deadline. */
static void test_tryagain(fake_nodes *f)
{
    world w;
    rec r;
    static const char *const t5[] = {"-TRYAGAIN Multiple keys request during rehashing of slot\r\n",
                                     "-TRYAGAIN Multiple keys request during rehashing of slot\r\n",
                                     "-TRYAGAIN Multiple keys request during rehashing of slot\r\n",
                                     "-TRYAGAIN Multiple keys request during rehashing of slot\r\n",
                                     "-TRYAGAIN Multiple keys request during rehashing of slot\r\n",
                                     "+at last\r\n", NULL};
    static const char *const tx[] = {"-TRYAGAIN Multiple keys request during rehashing of slot\r\n", NULL};
    int64_t t0;
    fake_nodes_reset(f);
    fake_nodes_rule(f, 0, "GET", t5);
    fake_nodes_rule(f, 0, "SET", tx);
    world_open(&w, url_for(f, 0), 0);
    t0 = th_now_ms();
    get(&w, "foo", &r, 0);
    run_until(&w, &r.calls, 5000);
    is_int(r.calls, 1, "tryagain: one callback");
    is_str(r.str, "at last", "tryagain: the sixth send succeeds");
    is_int(fake_nodes_count(f, 0, "GET"), 6, "tryagain: six GETs");
    ok(th_now_ms() - t0 >= 40, "tryagain: with a backoff between them (%lld ms)", (long long)(th_now_ms() - t0));
    {
        const char *argv[3] = {"SET", "foo", "1"};
        size_t lens[3] = {3, 3, 1};
        memset(&r, 0, sizeof r);
        t0 = th_now_ms();
        is_int(outbox__cluster_command_argv(w.c, "foo", 3, 3, argv, lens, 300, on_reply, &r, NULL), 0,
               "tryagain: SET accepted");
        run_until(&w, &r.calls, 5000);
        is_int(r.calls, 1, "tryagain for ever: one callback");
        ok(strncmp(r.str, "TRYAGAIN", 8) == 0, "tryagain for ever: the caller gets TRYAGAIN (%s)", r.str);
        ok(th_now_ms() - t0 >= 150 && th_now_ms() - t0 < 1500, "tryagain for ever: at about its deadline (%lld ms)",
           (long long)(th_now_ms() - t0));
    }
    is_int(world_close(&w), 0, "tryagain: loop closed cleanly");
}

/* CLUSTERDOWN, LOADING and READONLY are retried too (and refresh the map). */
static void test_clusterdown(fake_nodes *f)
{
    world w;
    rec r;
    static const char *const cd[] = {"-CLUSTERDOWN The cluster is down\r\n", "-LOADING Redis is loading\r\n",
                                     "-READONLY You can't write against a read only replica.\r\n", "+up\r\n", NULL};
    fake_nodes_reset(f);
    fake_nodes_rule(f, 0, "GET", cd);
    world_open(&w, url_for(f, 0), 0);
    get(&w, "foo", &r, 0);
    run_until(&w, &r.calls, 5000);
    is_int(r.calls, 1, "clusterdown: one callback");
    is_str(r.str, "up", "clusterdown/loading/readonly: retried until served");
    is_int(world_close(&w), 0, "clusterdown: loop closed cleanly");
}

static void test_malformed(fake_nodes *f)
{
    static const struct {
        const char *reply, *want;
    } cases[] = {
        {"-MOVED abc\r\n", "malformed MOVED reply 'MOVED abc'"},
        {"-MOVED 99999 127.0.0.1:7000\r\n", "malformed MOVED reply 'MOVED 99999 127.0.0.1:7000'"},
        {"-MOVED 12182 127.0.0.1\r\n", "malformed MOVED reply 'MOVED 12182 127.0.0.1'"},
        {"-MOVED 12182 127.0.0.1:0\r\n", "malformed MOVED reply 'MOVED 12182 127.0.0.1:0'"},
        {"-ASK 12182 127.0.0.1:70000\r\n", "malformed ASK reply 'ASK 12182 127.0.0.1:70000'"},
        {"-MOVED\r\n", "malformed MOVED reply 'MOVED'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        world w;
        rec r;
        const char *rs[] = {cases[i].reply, NULL};
        fake_nodes_reset(f);
        fake_nodes_rule(f, 0, "GET", rs);
        world_open(&w, url_for(f, 0), 0);
        get(&w, "foo", &r, 0);
        run_until(&w, &r.calls, 3000);
        is_int(r.calls, 1, "malformed %zu: one callback", i);
        is_str(r.str, cases[i].want, "malformed %zu: a clear error", i);
        is_int(world_close(&w), 0, "malformed %zu: loop closed cleanly", i);
    }
}

/* A node that MOVEs the slot to itself: the same bound. */
static void test_self_loop(fake_nodes *f)
{
    world w;
    rec r;
    static const char *const m0[] = {"-MOVED 12182 127.0.0.1:%0\r\n", NULL};
    fake_nodes_reset(f);
    fake_nodes_rule(f, 0, "GET", m0);
    world_open(&w, url_for(f, 0), 3);
    get(&w, "foo", &r, 0);
    run_until(&w, &r.calls, 3000);
    ok(strncmp(r.str, "redirect loop: MOVED 12182 to 127.0.0.1:", 40) == 0 && strstr(r.str, "after 3 redirections"),
       "self loop: bounded by max_redirects (%s)", r.str);
    is_int(fake_nodes_count(f, 0, "GET"), 4, "self loop: 1 + 3 sends");
    is_int(world_close(&w), 0, "self loop: loop closed cleanly");
}

/* A MOVED to a node nobody listens on: the command fails (not executed),
 * and the node is then down for a while: the next command for it fails at
 * once, while another node's commands go on. */
static void test_node_down(fake_nodes *f)
{
    world w;
    rec r, r2;
    static const char *const m3[] = {"-MOVED 12182 127.0.0.1:%3\r\n", NULL};
    static const char *const two[] = {"*2\r\n*3\r\n:0\r\n:8191\r\n*2\r\n$9\r\n127.0.0.1\r\n:%0\r\n"
                                      "*3\r\n:8192\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%3\r\n",
                                      NULL};
    static const char *const okr[] = {"+fine\r\n", NULL};
    fake_nodes_reset(f);
    fake_nodes_kill(f, 3);
    fake_nodes_rule(f, 0, "GET", m3);
    world_open(&w, url_for(f, 0), 0);
    get(&w, "foo", &r, 0);
    run_until(&w, &r.calls, 3000);
    is_int(r.calls, 1, "node down: one callback");
    is_int(r.status, OUTBOX_ECONNECT, "node down: OUTBOX_ECONNECT (never sent)");
    is_int(get(&w, "foo", &r2, 0), OUTBOX_ECONNECT, "node down: the next command for it fails at once");
    is_int(r2.calls, 0, "node down: and no callback follows");
    is_int(world_close(&w), 0, "node down: loop closed cleanly");

    /* Half the slots on the dead node: the other half keeps going. */
    fake_nodes_reset(f);
    {
        const char *cs[] = {two[0], NULL};
        fake_nodes_rule(f, 0, "CLUSTER SLOTS", cs);
    }
    fake_nodes_rule(f, 0, "GET", okr);
    world_open(&w, url_for(f, 0), 0);
    is_int(get(&w, "foo", &r, 0), 0, "half down: a key of the dead node is accepted (its connect is tried)");
    is_int(get(&w, "bar", &r2, 0), 0, "half down: bar (slot 5061) is accepted");
    run_until(&w, &r.calls, 3000);
    run_until(&w, &r2.calls, 3000);
    is_int(r.status, OUTBOX_ECONNECT, "half down: foo fails: its node is unreachable");
    is_str(r2.str, "fine", "half down: bar is served by the live node");
    is_int(world_close(&w), 0, "half down: loop closed cleanly");
}

/* A node that disappears with a command in flight: unknown outcome
 * (OUTBOX_ECLOSED & co, not OUTBOX_ECONNECT), the callback once. */
static void test_node_vanishes(fake_nodes *f)
{
    world w;
    rec r;
    static const char *const silent[] = {"", NULL};
    fake_nodes_reset(f);
    fake_nodes_rule(f, 2, "GET", silent);
    {
        static const char *const map[] = {"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%2\r\n", NULL};
        fake_nodes_rule(f, 0, "CLUSTER SLOTS", map);
    }
    world_open(&w, url_for(f, 0), 0);
    is_int(get(&w, "foo", &r, 0), 0, "vanishes: GET to node 2 accepted");
    for (int i = 0; i < 50 && fake_nodes_count(f, 2, "GET") == 0; i++)
        uv_run(&w.loop, UV_RUN_ONCE);
    is_int(fake_nodes_count(f, 2, "GET"), 1, "vanishes: node 2 got it");
    fake_nodes_kill(f, 2);
    run_until(&w, &r.calls, 3000);
    is_int(r.calls, 1, "vanishes: one callback");
    ok(r.status < 0 && r.status != OUTBOX_ECONNECT, "vanishes: an unknown outcome (%s)", outbox_err_name(r.status));
    is_int(world_close(&w), 0, "vanishes: loop closed cleanly");
}

/* Every node gone after the map was loaded: on_down, not reachable any
 * more (the map is kept). Kills node 0: the last test with fake nodes. */
static void test_all_down(fake_nodes *f)
{
    world w;
    fake_nodes_reset(f);
    world_open(&w, url_for(f, 0), 0);
    is_int(outbox__cluster_reachable(w.c), 1, "all down: reachable with its map");
    {
        rec r;
        get(&w, "foo", &r, 0);
        run_until(&w, &r.calls, 3000);
    }
    fake_nodes_kill(f, 0);
    run_until(&w, &w.downs, 5000);
    is_int(w.downs, 1, "all down: on_down once");
    is_int(outbox__cluster_reachable(w.c), 0, "all down: not reachable");
    is_int(outbox__cluster_ready(w.c), 1, "all down: still ready (the last map is kept)");
    is_int(world_close(&w), 0, "all down: loop closed cleanly");
}

/* Close with commands in flight, waiting for a connect and waiting for a
 * retry: each callback once, with OUTBOX_ECLOSED. */
static void test_close_pending(fake_nodes *f)
{
    world w;
    rec r[3];
    static const char *const slow[] = {"-TRYAGAIN later\r\n", NULL};
    static const char *const m1[] = {"-MOVED 5061 127.0.0.1:%1\r\n", NULL};
    fake_nodes_reset(f);
    fake_nodes_rule(f, 0, "GET", slow);
    fake_nodes_rule(f, 0, "SET", m1);
    world_open(&w, url_for(f, 0), 0);
    get(&w, "foo", &r[0], 0);
    {
        const char *argv[3] = {"SET", "bar", "1"};
        size_t lens[3] = {3, 3, 1};
        memset(&r[1], 0, sizeof r[1]);
        outbox__cluster_command_argv(w.c, "bar", 3, 3, argv, lens, 0, on_reply, &r[1], NULL);
    }
    /* Let the TRYAGAIN and the MOVED arrive, not the retry. */
    for (int i = 0; i < 5; i++)
        uv_run(&w.loop, UV_RUN_NOWAIT);
    get(&w, "baz", &r[2], 0);
    outbox__cluster_close(w.c, on_closed, &w);
    run_until(&w, &w.closed, 3000);
    for (int i = 0; i < 3; i++)
        is_int(r[i].calls, 1, "close: command %d called back once", i);
    is_int(w.closed, 1, "close: close callback once");
    uv_close((uv_handle_t *)&w.wd, NULL);
    uv_run(&w.loop, UV_RUN_DEFAULT);
    is_int(uv_loop_close(&w.loop), 0, "close: loop closed cleanly");
}

/* A seed that is not a cluster node: on_down with the node's own words. */
static void test_not_cluster(fake_nodes *f)
{
    world w;
    static const char *const off[] = {"-ERR This instance has cluster support disabled\r\n", NULL};
    fake_nodes_reset(f);
    fake_nodes_rule(f, 1, "CLUSTER", off);
    world_open(&w, url_for(f, 1), 0);
    run_until(&w, &w.downs, 3000);
    is_int(w.ready, 0, "not a cluster node: not ready");
    is_int(w.downs, 1, "not a cluster node: on_down once");
    ok(strstr(outbox__cluster_errstr(w.c), "CLUSTER SHARDS: ERR This instance has cluster support disabled") != NULL,
       "not a cluster node: errstr says so (%s)", outbox__cluster_errstr(w.c));
    is_int(world_close(&w), 0, "not a cluster node: loop closed cleanly");
}

/* No node answers: on_down once, not ready, commands refused. */
static void test_unreachable(void)
{
    world w;
    rec r;
    int fd, port = th_refused_port(&fd);
    char url[64];
    if (port < 0)
        bail("cannot bind a loopback port");
    snprintf(url, sizeof url, "redis-cluster://127.0.0.1:%d", port);
    memset(&w, 0, sizeof w);
    world_open(&w, url, 0);
    run_until(&w, &w.downs, 3000);
    is_int(w.ready, 0, "unreachable: not ready");
    is_int(outbox__cluster_reachable(w.c), 0, "unreachable: not reachable");
    is_int(w.downs, 1, "unreachable: on_down once");
    ok(strstr(outbox__cluster_errstr(w.c), "connection refused") != NULL, "unreachable: errstr says why (%s)",
       outbox__cluster_errstr(w.c));
    is_int(get(&w, "foo", &r, 0), OUTBOX_ESTATE, "unreachable: commands refused before a map");
    is_int(world_close(&w), 0, "unreachable: loop closed cleanly");
    close(fd);
}

/* The daemon refuses a bad cluster URL at start, exit 2, naming the
 * problem. */
static void test_cli(void)
{
    static const struct {
        const char *url, *err;
    } cases[] = {
        {"redis-cluster://127.0.0.1:7000/1", "database 1 with redis-cluster://: a Redis Cluster has only database 0"},
        {"redis-cluster://", "empty seed node list"},
        {"rediss-cluster://h:1,,h:2", "empty host in the seed node list"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *bin = th_bin("tools/relay/outbox-relay"), *out = NULL, *err = NULL;
        char *argv[] = {bin, "--db", "/nonexistent/app.db", "--redis", (char *)cases[i].url, NULL};
        int rc = th_run(argv, NULL, &out, &err, 10000);
        is_int(rc, 2, "outbox-relay --redis %s exits 2", cases[i].url);
        ok(err && strstr(err, cases[i].err), "outbox-relay --redis %s: %s (%s)", cases[i].url, cases[i].err,
           err ? err : "");
        free(bin);
        free(out);
        free(err);
    }
}

/* A plain redis:// URL answered with MOVED (a node whose INFO does not say
 * cluster_enabled:1, e.g. one that refuses INFO): publishing is held with
 * one error naming redis-cluster://, the messages are released, not
 * failed. */
static void test_plain_moved(fake_nodes *f)
{
    static const char *const moved[] = {"-MOVED 1234 127.0.0.1:%1\r\n", NULL};
    static const char *const noperm[] = {"-NOPERM this user has no permissions to run the 'info' command\r\n", NULL};
    char *dir = th_tmpdir(), *db = th_path(dir, "app.db"), *log = th_path(dir, "relay.log"), url[64], want[96];
    char *bin = th_bin("tools/relay/outbox-relay"), *text = NULL;
    char *init[] = {bin, "init", "--db", db, NULL};
    sqlite3 *c;
    pid_t pid;
    int64_t end;

    fake_nodes_reset(f);
    fake_nodes_rule(f, 0, "XADD", moved);
    fake_nodes_rule(f, 0, "INFO", noperm);
    is_int(th_run(init, NULL, NULL, NULL, 10000), 0, "plain MOVED: outbox-relay init");
    if (sqlite3_open(db, &c) != SQLITE_OK)
        bail("sqlite3_open");
    th_sql_exec(c, "INSERT INTO outbox(id, topic, payload) VALUES ('m1', 'orders', x'01'), ('m2', 'orders', x'02')");
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", fake_nodes_port(f, 0));
    {
        char *argv[] = {bin, "--db", db, "--redis", url, NULL};
        pid = th_spawn(argv, NULL, log, log);
    }
    end = th_now_ms() + 10000 * th_slow();
    do {
        th_sleep_ms(100);
        free(text);
        text = th_slurp(log);
    } while ((!text || !strstr(text, "publishing held")) && th_now_ms() < end);
    th_sleep_ms(1000);
    free(text);
    text = th_slurp(log);
    snprintf(want, sizeof want, "(a MOVED reply): use a cluster URL, redis-cluster://127.0.0.1:%d",
             fake_nodes_port(f, 0));
    ok(text && strstr(text, want), "plain MOVED: the error names the cluster URL form");
    is_int(text ? count_substr(text, "publishing held") : 0, 1, "plain MOVED: one error line");
    is_int(th_sql_int(c, "SELECT max(attempts) FROM outbox_messages"), 0, "plain MOVED: no attempt counted");
    is_int(th_sql_int(c, "SELECT count(*) FROM outbox_messages WHERE state = 0"), 2, "plain MOVED: both rows pending again");
    ok(fake_nodes_count(f, 0, "XADD") <= 2, "plain MOVED: the XADDs were not retried one by one (%d)",
       fake_nodes_count(f, 0, "XADD"));
    is_int(th_stop(pid, SIGTERM, 10000), 0, "plain MOVED: the relay stops on SIGTERM");
    if (text)
        th_diag_tail("relay log", text, 5);
    sqlite3_close(c);
    free(text);
    free(bin);
    free(db);
    free(log);
    th_rmtree(dir);
    free(dir);
}

int main(void)
{
    fake_nodes *f;
    signal(SIGPIPE, SIG_IGN);
    test_slots();
    test_urls();
    test_markers();
    test_cli();
    f = fake_nodes_start(4);
    test_slots_fallback(f);
    test_moved_back(f);
    test_ask_then_moved(f);
    test_ask_keeps_map(f);
    test_tryagain(f);
    test_clusterdown(f);
    test_malformed(f);
    test_self_loop(f);
    test_node_down(f);
    test_close_pending(f);
    test_not_cluster(f);
    test_node_vanishes(f);
    test_plain_moved(f);
    test_all_down(f);
    test_unreachable();
    fake_nodes_stop(f);
    return tap_done();
}
