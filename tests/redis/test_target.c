/*
 * test_target.c: the target interface (src/redis/target.h) over its two
 * implementations: a single node (target_node.c) against the harness'
 * redis-server, and a Redis Cluster (redis/cluster/target.c) against
 * scripted fake nodes (cluster/fake_node.h). For each: the factory picks
 * it, start, node_up before up, commands by key (raw and from arguments)
 * and to a node, which node answered, the replies each kind calls lost,
 * misrouted or unavailable, down and up again (single node), close with its
 * callback once, and uv_loop_close() == 0 (every handle closed). Also the
 * URL and TLS set-up and a target closed without being started.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <hiredis/hiredis.h>
#include <uv.h>

#include "cluster/fake_node.h"
#include "harness.h"
#include "redis/cluster/target.h"
#include "redis/target.h"
#include "tap.h"

typedef struct world {
    uv_loop_t loop;
    uv_timer_t wd;
    outbox__target *t;
    int ups, downs, node_ups, closed, seq;
    int up_seq, node_up_seq;
    void *node_seen; /* the node node_up named last */
} world;

typedef struct rec {
    world *w;
    int calls, status, type;
    void *node; /* outbox__target_node_of(the answering connection) */
    char str[200];
} rec;

static void on_wd(uv_timer_t *t)
{
    (void)t;
}

static void on_up(outbox__target *t, void *data)
{
    world *w = data;
    (void)t;
    w->ups++;
    w->up_seq = ++w->seq;
}

static void on_down(outbox__target *t, int status, void *data)
{
    world *w = data;
    (void)t, (void)status;
    w->downs++;
}

static void on_node_up(outbox__target *t, void *node, void *data)
{
    world *w = data;
    (void)t;
    w->node_ups++;
    w->node_up_seq = ++w->seq;
    w->node_seen = node;
}

static void on_closed(void *data)
{
    ((world *)data)->closed++;
}

static void on_reply(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    rec *r = data;
    r->calls++;
    r->status = status;
    r->type = reply ? reply->type : -1;
    r->node = r->w->t ? outbox__target_node_of(r->w->t, conn) : NULL;
    if (reply && reply->str)
        snprintf(r->str, sizeof r->str, "%.*s", (int)reply->len, reply->str);
}

static void run_until(world *w, const int *flag, int want, int ms)
{
    int64_t end = th_now_ms() + ms;
    while (*flag < want && th_now_ms() < end)
        uv_run(&w->loop, UV_RUN_ONCE);
}

static void world_init(world *w)
{
    memset(w, 0, sizeof *w);
    if (uv_loop_init(&w->loop) != 0)
        bail("uv_loop_init");
    uv_timer_init(&w->loop, &w->wd);
    uv_timer_start(&w->wd, on_wd, 20, 20);
}

static int world_open(world *w, const char *url)
{
    outbox__redis_url u;
    outbox__target_options o;
    outbox__target_hooks h = {on_up, on_down, on_node_up, NULL, w};
    char err[256];
    int e;
    if (outbox__redis_url_parse(url, &u, err, sizeof err) != 0)
        bail("url %s: %s", url, err);
    outbox__target_options_defaults(&o);
    o.redis.connect_timeout_ms = 1000;
    o.redis.reply_timeout_ms = 2000;
    o.what = "test";
    e = outbox__target_create(&w->t, &w->loop, &u, &o, &h);
    outbox__redis_url_free(&u);
    return e;
}

/* Closes the target, then the watchdog: 0 when the loop closes cleanly. */
static int world_close(world *w)
{
    outbox__target_close(w->t, on_closed, w);
    run_until(w, &w->closed, 1, 3000);
    w->t = NULL;
    uv_close((uv_handle_t *)&w->wd, NULL);
    uv_run(&w->loop, UV_RUN_DEFAULT);
    return uv_loop_close(&w->loop);
}

/* An error reply of the given text, for the reply classifiers. */
static redisReply *error_reply(const char *text)
{
    static redisReply r;
    static char buf[200];
    snprintf(buf, sizeof buf, "%s", text);
    memset(&r, 0, sizeof r);
    r.type = REDIS_REPLY_ERROR;
    r.str = buf;
    r.len = strlen(buf);
    return &r;
}

static int set_raw(world *w, const char *key, const char *value, rec *r, void **node)
{
    char *cmd = NULL;
    int len = redisFormatCommand(&cmd, "SET %s %s", key, value), e;
    if (len < 0)
        bail("redisFormatCommand");
    memset(r, 0, sizeof *r);
    r->w = w;
    e = outbox__target_command_key(w->t, key, strlen(key), cmd, (size_t)len, 0, on_reply, r, node);
    redisFreeCommand(cmd);
    return e;
}

static int get_argv(world *w, const char *key, rec *r)
{
    const char *argv[2] = {"GET", key};
    size_t lens[2] = {3, strlen(key)};
    memset(r, 0, sizeof *r);
    r->w = w;
    return outbox__target_command_key_argv(w->t, key, 2, argv, lens, 0, on_reply, r);
}

static int ping_node(world *w, void *node, rec *r)
{
    const char *argv[1] = {"PING"};
    size_t lens[1] = {4};
    memset(r, 0, sizeof *r);
    r->w = w;
    return outbox__target_command_node(w->t, node, 1, argv, lens, 0, on_reply, r);
}

/* ECHO to a node (the fake nodes log it and answer +OK). */
static int echo_node(world *w, void *node, rec *r)
{
    const char *argv[2] = {"ECHO", "hi"};
    size_t lens[2] = {4, 2};
    memset(r, 0, sizeof *r);
    r->w = w;
    return outbox__target_command_node(w->t, node, 2, argv, lens, 0, on_reply, r);
}

static void test_url_setup(void)
{
    outbox__redis_url u;
    outbox__tls_config *cfg = NULL;
    outbox_tls_settings tls;
    char err[300];
    outbox_tls_defaults(&tls);
    is_int(outbox__target_url_setup("redis://127.0.0.1:6390/2", NULL, NULL, &tls, &u, &cfg, err, sizeof err), 0,
           "url setup: a plain URL");
    ok(cfg == NULL && u.host && strcmp(u.host, "127.0.0.1") == 0 && u.port == 6390 && u.db == 2,
       "  parsed, no TLS configuration");
    outbox__redis_url_free(&u);
    is_int(outbox__target_url_setup("http://x", NULL, NULL, &tls, &u, &cfg, err, sizeof err), OUTBOX_EURL,
           "url setup: a bad scheme is OUTBOX_EURL");
    ok(strncmp(err, "redis: ", 7) == 0, "  err names the URL: %s", err);
    is_int(outbox__target_url_setup("redis://h", NULL, "pw", &tls, &u, &cfg, err, sizeof err), OUTBOX_EINVAL,
           "url setup: sentinel credentials without a Sentinel URL");
    tls.insecure = 1;
    is_int(outbox__target_url_setup("redis://h", NULL, NULL, &tls, &u, &cfg, err, sizeof err), OUTBOX_EINVAL,
           "url setup: TLS settings with a plain URL");
    ok(strncmp(err, "tls: ", 5) == 0 && cfg == NULL, "  err names TLS: %s", err);
    is_int(outbox__target_url_setup("rediss://h", NULL, NULL, &tls, &u, &cfg, err, sizeof err), 0,
           "url setup: rediss:// builds the TLS configuration");
    ok(cfg != NULL && u.tls == 1, "  one configuration");
    outbox__tls_config_unref(cfg);
    outbox__redis_url_free(&u);
    is_int(outbox__target_url_setup("rediss://h", NULL, NULL, NULL, &u, &cfg, err, sizeof err), 0,
           "url setup: without TLS settings (the caller has a configuration)");
    ok(cfg == NULL, "  none built");
    outbox__redis_url_free(&u);
}

static void test_factory(void)
{
    world w;
    world_init(&w);
    is_int(world_open(&w, "redis://127.0.0.1:1"), 0, "factory: a plain URL");
    is_str(w.t->ops->kind, "node", "  a single node's target");
    is_int(outbox__target_routes(w.t), 0, "  does not route");
    outbox__target_close(w.t, on_closed, &w);
    is_int(w.closed, 1, "  never started: closed at once");
    is_int(world_open(&w, "redis-cluster://127.0.0.1:1,127.0.0.1:2"), 0, "factory: a Cluster URL");
    is_str(w.t->ops->kind, "cluster", "  a cluster's target");
    is_int(outbox__target_routes(w.t), 1, "  routes");
    outbox__target_close(w.t, on_closed, &w);
    is_int(w.closed, 2, "  never started: closed at once");
    w.t = NULL;
    uv_close((uv_handle_t *)&w.wd, NULL);
    uv_run(&w.loop, UV_RUN_DEFAULT);
    is_int(uv_loop_close(&w.loop), 0, "factory: uv_loop_close");
}

static void test_node(void)
{
    th_redis srv;
    world w;
    rec set, get, ping;
    void *node = (void *)&w;
    const outbox__redis_url *nu;
    uint64_t refr, failed;
    if (th_redis_start(&srv, 0, NULL) != 0)
        bail("redis-server");
    world_init(&w);
    is_int(world_open(&w, srv.url), 0, "node: created for %s", srv.url);
    is_int(outbox__target_ready(w.t), 0, "node: not ready before start");
    is_int(set_raw(&w, "k", "v", &set, NULL), OUTBOX_ECONNECT, "node: a command before start: OUTBOX_ECONNECT");
    outbox__target_start(w.t);
    run_until(&w, &w.ups, 1, 5000);
    is_int(w.ups, 1, "node: up once");
    is_int(w.node_ups, 1, "node: node_up once");
    ok(w.node_up_seq < w.up_seq && w.node_seen == NULL, "  node_up (the single node, NULL) before up");
    ok(outbox__target_ready(w.t) && outbox__target_reachable(w.t), "  ready and reachable");

    is_int(set_raw(&w, "k", "v", &set, &node), 0, "node: command by key (raw)");
    ok(node == NULL, "  the single node took it");
    is_int(get_argv(&w, "k", &get), 0, "node: command by key (argv)");
    is_int(ping_node(&w, NULL, &ping), 0, "node: command to the node");
    run_until(&w, &ping.calls, 1, 3000);
    ok(set.calls == 1 && set.status == 0 && strcmp(set.str, "OK") == 0, "  SET answered OK (%d %d %s)", set.calls,
       set.status, set.str);
    ok(get.calls == 1 && get.status == 0 && strcmp(get.str, "v") == 0, "  GET answered v");
    ok(ping.calls == 1 && ping.status == 0 && strcmp(ping.str, "PONG") == 0, "  PING answered PONG");
    ok(set.node == NULL && ping.node == NULL, "  node_of: the single node");

    is_int(outbox__target_misrouted(w.t, error_reply("MOVED 3999 127.0.0.1:7001")), 1,
           "node: MOVED is misrouted (the URL names a cluster node)");
    is_int(outbox__target_misrouted(w.t, error_reply("CLUSTERDOWN The cluster is down")), 1, "  CLUSTERDOWN too");
    is_int(outbox__target_misrouted(w.t, error_reply("ERR wrong")), 0, "  an error of its own is not");
    is_int(outbox__target_unavailable(w.t, error_reply("TRYAGAIN x")), 0, "node: nothing is unavailable");
    is_int(outbox__target_lost(w.t, NULL, error_reply("READONLY You can't write")), 0,
           "node: READONLY without Sentinel is the node's answer, not lost");
    nu = outbox__target_node_url(w.t);
    ok(nu && nu->path && strcmp(nu->path, srv.sock) == 0, "node: node_url is the URL's");
    is_int((int)outbox__target_nodes(w.t, NULL, 0, &refr, &failed), 0, "node: no per node figures");

    /* Lost and back: down, then node_up and up again. */
    th_redis_kill(&srv);
    run_until(&w, &w.downs, 1, 5000);
    is_int(w.downs, 1, "node: down once when the server dies");
    is_int(outbox__target_ready(w.t), 0, "  not ready");
    is_int(ping_node(&w, NULL, &ping), OUTBOX_ECLOSED, "  a node command: OUTBOX_ECLOSED");
    if (th_redis_restart(&srv) != 0)
        bail("redis-server restart");
    run_until(&w, &w.ups, 2, 10000);
    ok(w.ups == 2 && w.node_ups == 2, "node: node_up and up again after the restart (%d, %d)", w.node_ups, w.ups);

    /* Close with a command in flight: its callback comes, then close's. */
    is_int(get_argv(&w, "k", &get), 0, "node: a command before close");
    is_int(world_close(&w), 0, "node: closed, uv_loop_close() == 0");
    ok(get.calls == 1 && get.status != 0, "  the pending command failed once (%s)", outbox_err_name(get.status));
    is_int(w.closed, 1, "  close callback once");
    th_redis_destroy(&srv);
}

static void test_cluster(fake_nodes *f)
{
    static const char *const slots[] = {
        "*2\r\n*3\r\n:0\r\n:8191\r\n*2\r\n$9\r\n127.0.0.1\r\n:%0\r\n"
        "*3\r\n:8192\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%1\r\n",
        NULL};
    world w;
    rec set, get, ping, ping2, late;
    void *n0 = NULL, *n1 = NULL;
    char url[96];
    outbox__target_node_stats st[4];
    uint64_t refr = 0, failed = 0;
    size_t nn;
    fake_nodes_reset(f);
    fake_nodes_rule(f, 0, "CLUSTER SLOTS", slots);
    fake_nodes_rule(f, 1, "CLUSTER SLOTS", slots);
    snprintf(url, sizeof url, "redis-cluster://127.0.0.1:%d", fake_nodes_port(f, 0));
    world_init(&w);
    is_int(world_open(&w, url), 0, "cluster: created for %s", url);
    outbox__target_start(w.t);
    run_until(&w, &w.ups, 1, 5000);
    is_int(w.ups, 1, "cluster: up once (slot map loaded)");
    ok(outbox__target_ready(w.t) && outbox__target_reachable(w.t), "  ready and reachable");

    /* "a" is in slot 15495 (node 1), "b" in 3300 (node 0). */
    is_int(set_raw(&w, "a", "1", &set, &n1), 0, "cluster: command by key (raw) for slot 15495");
    is_int(get_argv(&w, "b", &get), 0, "cluster: command by key (argv) for slot 3300");
    run_until(&w, &get.calls, 1, 3000);
    run_until(&w, &set.calls, 1, 3000);
    ok(set.calls == 1 && set.status == 0 && get.calls == 1 && get.status == 0, "  both answered once");
    ok(n1 != NULL && set.node == n1, "  command_key named the node, node_of the same");
    n0 = get.node;
    ok(n0 != NULL && n0 != n1, "  the other key on the other node");
    ok(w.node_ups >= 2 && w.node_seen != NULL, "cluster: node_up for each node as it connected (%d)", w.node_ups);

    is_int(echo_node(&w, n0, &ping), 0, "cluster: command to node 0");
    is_int(echo_node(&w, n1, &ping2), 0, "cluster: command to node 1");
    run_until(&w, &ping2.calls, 1, 3000);
    run_until(&w, &ping.calls, 1, 3000);
    ok(ping.calls == 1 && ping.status == 0 && ping.node == n0, "  node 0 answered");
    ok(ping2.calls == 1 && ping2.status == 0 && ping2.node == n1, "  node 1 answered");
    ok(fake_nodes_count(f, 0, "ECHO") == 1 && fake_nodes_count(f, 1, "ECHO") == 1, "  each node got its own (%d, %d)",
       fake_nodes_count(f, 0, "ECHO"), fake_nodes_count(f, 1, "ECHO"));
    is_int(echo_node(&w, NULL, &late), OUTBOX_EINVAL, "cluster: a node command needs a node");

    is_int(outbox__target_misrouted(w.t, error_reply("MOVED 3999 127.0.0.1:7001")), 0,
           "cluster: MOVED is never misrouted (the layer follows it)");
    is_int(outbox__target_unavailable(w.t, error_reply("CLUSTERDOWN The cluster is down")), 1,
           "cluster: CLUSTERDOWN after the retries is unavailable");
    is_int(outbox__target_unavailable(w.t, error_reply("redirect loop: MOVED 1 to x 5 times")), 1,
           "  a redirect loop too");
    is_int(outbox__target_unavailable(w.t, error_reply("WRONGTYPE Operation")), 0, "  WRONGTYPE is not");
    is_int(outbox__target_lost(w.t, NULL, error_reply("READONLY x")), 0, "cluster: nothing is lost");
    ok(outbox__target_node_url(w.t) == NULL, "cluster: no one node URL");
    nn = outbox__target_nodes(w.t, st, 4, &refr, &failed);
    ok(nn == 2 && refr >= 1, "cluster: per node figures: %zu nodes, %llu refreshes", nn, (unsigned long long)refr);

    is_int(get_argv(&w, "a", &late), 0, "cluster: a command before close");
    is_int(world_close(&w), 0, "cluster: closed, uv_loop_close() == 0");
    ok(late.calls == 1, "  the pending command's callback once (status %s)", outbox_err_name(late.status));
    is_int(w.closed, 1, "  close callback once");
}

int main(void)
{
    fake_nodes *f;
    signal(SIGPIPE, SIG_IGN);
    test_url_setup();
    test_factory();
    test_node();
    f = fake_nodes_start(2);
    test_cluster(f);
    fake_nodes_stop(f);
    return tap_done();
}
