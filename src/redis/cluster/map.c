/*
 * cluster_map.c: the cluster layer's slot map (see cluster.h): refreshes,
 * throttled after MOVED and backed off while no node answers, and the
 * parsing of CLUSTER SHARDS (Redis 7) and of CLUSTER SLOTS, its fallback
 * for servers that do not know CLUSTER SHARDS.
 *
 * A refresh asks the nodes in turn, those connected first (masters before
 * the others), then the rest of the known nodes and the URL's seeds, and
 * last those that lately answered CLUSTERDOWN; the first that gives a map
 * wins.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "redis/cluster/cluster_int.h"

static void try_next(outbox__cluster *c);

/* How long a node's CLUSTERDOWN puts it last among those asked for the map,
 * and the map is asked for every SAID_DOWN_REFRESH_MS meanwhile: a master
 * cut off from the majority says CLUSTERDOWN until its replica is promoted,
 * and the sooner the map names that replica the sooner publishing resumes
 * (a second of cadence was most of the wait). */
#define SAID_DOWN_MS 10000
#define SAID_DOWN_REFRESH_MS 200

/* n answered CLUSTERDOWN in the last SAID_DOWN_MS. */
static int said_down(const outbox__cluster_node *n, uint64_t now)
{
    return n->said_down && now - n->said_down < SAID_DOWN_MS;
}

static int said_down_lately(const outbox__cluster *c)
{
    uint64_t now = uv_now(c->loop);
    for (size_t i = 0; i < c->nnodes; i++)
        if (said_down(c->nodes[i], now))
            return 1;
    return 0;
}

static void refresh_failed(outbox__cluster *c)
{
    uint64_t d;
    c->refreshing = 0;
    c->refresh_failed++;
    c->refresh_failures++;
    if (!c->down_reported) {
        c->down_reported = 1;
        outbox__log(c->log, OUTBOX_LOG_WARN,
                    "msg=\"no cluster node gave a slot map, retrying with backoff\" conn=%s redis=%s detail=\"%s\"",
                    c->what, c->desc, c->errstr);
        /* Every node tried refused the credentials: they are wrong for
         * the whole cluster, not a node that is down. */
        if (c->hooks.on_down)
            c->hooks.on_down(c, c->refused && !c->failed_otherwise ? OUTBOX_EAUTH : OUTBOX_ECONNECT,
                             c->hooks.data);
        if (c->closing)
            return;
    }
    d = outbox__backoff_ms(OUTBOX__RECONNECT_MIN_MS, OUTBOX__RECONNECT_MAX_MS, c->refresh_failures);
    c->refresh_armed = 1;
    uv_timer_start(&c->refresh_timer, outbox__cluster_map_on_timer, d, 0);
}

static void refresh_done(outbox__cluster *c, const outbox__cluster_node *from, const uint16_t *slots)
{
    size_t masters = 0, covered = 0, moved = 0;
    for (size_t s = 0; s < OUTBOX__SLOTS; s++)
        moved += c->slots[s] != slots[s];
    memcpy(c->slots, slots, sizeof c->slots);
    for (size_t i = 0; i < c->nnodes; i++) {
        c->nodes[i]->was_master = c->nodes[i]->master;
        c->nodes[i]->master = 0;
    }
    for (size_t s = 0; s < OUTBOX__SLOTS; s++)
        if (slots[s]) {
            covered++;
            c->nodes[slots[s] - 1]->master = 1;
        }
    for (size_t i = 0; i < c->nnodes; i++)
        masters += c->nodes[i]->master;
    c->refreshing = 0;
    c->last_refresh = uv_now(c->loop);
    c->refreshes++;
    c->refresh_failures = 0;
    c->errstr[0] = '\0';
    outbox__log(c->log, OUTBOX_LOG_DEBUG, "msg=\"cluster slot map\" conn=%s from=%s masters=%zu slots=%zu changed=%zu",
                c->what, from->name, masters, covered, moved);
    /* A master that lost every slot: what waits on its connection is handed
     * back now (outbox__cluster_node_retire). Not at the first map: nothing
     * was routed yet. A node their callbacks add (a MOVED) was no master. */
    for (size_t i = 0; c->ready && i < c->nnodes; i++)
        if (c->nodes[i]->was_master && !c->nodes[i]->master)
            outbox__cluster_node_retire(c, c->nodes[i]);
    if (!c->ready || c->down_reported) {
        c->ready = 1;
        c->down_reported = 0;
        outbox__log(c->log, OUTBOX_LOG_INFO, "msg=\"cluster slot map loaded\" conn=%s redis=%s masters=%zu slots=%zu",
                    c->what, c->desc, masters, covered);
        if (c->hooks.on_ready)
            c->hooks.on_ready(c, c->hooks.data);
        if (c->closing)
            return;
    }
    if (c->refresh_again || said_down_lately(c)) {
        c->refresh_again = 0;
        outbox__cluster_map_refresh_soon(c);
    }
}

/* ---- parsing ------------------------------------------------------------- */

static int is_text(const redisReply *r)
{
    return r && (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS);
}

static int text_is(const redisReply *r, const char *s)
{
    return is_text(r) && r->len == strlen(s) && memcmp(r->str, s, r->len) == 0;
}

static int assign(uint16_t *slots, long long from, long long to, const outbox__cluster_node *n)
{
    if (from < 0 || to >= OUTBOX__SLOTS || from > to)
        return -1;
    for (long long s = from; s <= to; s++)
        slots[s] = (uint16_t)(n->index + 1);
    return 0;
}

/* An endpoint that is empty or "?" means the host of the node asked. */
static outbox__cluster_node *node_at(outbox__cluster *c, const outbox__cluster_node *asked, const redisReply *host,
                                     long long port)
{
    if (port < 1 || port > 65535)
        return NULL;
    if (!is_text(host) || host->len == 0 || (host->len == 1 && host->str[0] == '?'))
        return outbox__cluster_node_get(c, asked->host, strlen(asked->host), (int)port);
    return outbox__cluster_node_get(c, host->str, host->len, (int)port);
}

static int parse_shards(outbox__cluster *c, const outbox__cluster_node *asked, const redisReply *r, uint16_t *slots)
{
    if (r->type != REDIS_REPLY_ARRAY)
        return -1;
    for (size_t i = 0; i < r->elements; i++) {
        const redisReply *sh = r->element[i], *sl = outbox__reply_map_get(sh, "slots"),
                         *nodes = outbox__reply_map_get(sh, "nodes");
        const redisReply *master = NULL, *host, *port;
        outbox__cluster_node *n;
        if (!sl || sl->type != REDIS_REPLY_ARRAY || !nodes || nodes->type != REDIS_REPLY_ARRAY || sl->elements % 2)
            return -1;
        if (sl->elements == 0)
            continue; /* a shard without slots */
        for (size_t j = 0; j < nodes->elements && !master; j++)
            if (text_is(outbox__reply_map_get(nodes->element[j], "role"), "master"))
                master = nodes->element[j];
        if (!master)
            continue; /* its master failed and no replica took over yet */
        host = outbox__reply_map_get(master, "endpoint");
        if (!is_text(host) || host->len == 0 || text_is(host, "?"))
            host = outbox__reply_map_get(master, "ip");
        port = c->url.tls ? outbox__reply_map_get(master, "tls-port") : NULL;
        if (!port)
            port = outbox__reply_map_get(master, "port");
        if (!port || port->type != REDIS_REPLY_INTEGER || !(n = node_at(c, asked, host, port->integer)))
            return -1;
        for (size_t j = 0; j < sl->elements; j += 2) {
            if (sl->element[j]->type != REDIS_REPLY_INTEGER || sl->element[j + 1]->type != REDIS_REPLY_INTEGER ||
                assign(slots, sl->element[j]->integer, sl->element[j + 1]->integer, n) != 0)
                return -1;
        }
    }
    return 0;
}

static int parse_slots(outbox__cluster *c, const outbox__cluster_node *asked, const redisReply *r, uint16_t *slots)
{
    if (r->type != REDIS_REPLY_ARRAY)
        return -1;
    for (size_t i = 0; i < r->elements; i++) {
        const redisReply *e = r->element[i], *m;
        outbox__cluster_node *n;
        if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[0]->type != REDIS_REPLY_INTEGER ||
            e->element[1]->type != REDIS_REPLY_INTEGER || (m = e->element[2])->type != REDIS_REPLY_ARRAY ||
            m->elements < 2 || m->element[1]->type != REDIS_REPLY_INTEGER)
            return -1;
        if (!(n = node_at(c, asked, m->element[0], m->element[1]->integer)) ||
            assign(slots, e->element[0]->integer, e->element[1]->integer, n) != 0)
            return -1;
    }
    return 0;
}

/* ---- the refresh --------------------------------------------------------- */

static int send_query(outbox__cluster *c, outbox__cluster_node *n);

static void on_map_reply(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    outbox__cluster_node *n = data;
    outbox__cluster *c = n->c;
    const char *what = c->use_slots ? "CLUSTER SLOTS" : "CLUSTER SHARDS";
    uint16_t *slots;
    (void)conn;
    if (c->closing || !c->refreshing)
        return;
    c->failed_otherwise = 1; /* unless it gives a map, which ends the refresh */
    if (status != 0 || !reply) {
        snprintf(c->errstr, sizeof c->errstr, "%s: %s: %s", n->name, what, outbox_strerror(status));
        try_next(c);
        return;
    }
    if (reply->type == REDIS_REPLY_ERROR) {
        if (!c->use_slots && (strncasecmp(reply->str, "ERR unknown subcommand", 22) == 0 ||
                              strncasecmp(reply->str, "ERR unknown command", 19) == 0)) {
            c->use_slots = 1; /* before Redis 7 */
            if (send_query(c, n) == 0)
                return;
        }
        snprintf(c->errstr, sizeof c->errstr, "%s: %s: %.150s", n->name, what, reply->str);
        try_next(c);
        return;
    }
    if (!(slots = calloc(OUTBOX__SLOTS, sizeof *slots))) {
        snprintf(c->errstr, sizeof c->errstr, "out of memory");
        try_next(c);
        return;
    }
    if ((c->use_slots ? parse_slots(c, n, reply, slots) : parse_shards(c, n, reply, slots)) != 0) {
        snprintf(c->errstr, sizeof c->errstr, "%s: %s: reply not understood", n->name, what);
        free(slots);
        try_next(c);
        return;
    }
    refresh_done(c, n, slots);
    free(slots);
}

static int send_query(outbox__cluster *c, outbox__cluster_node *n)
{
    const char *argv[2] = {"CLUSTER", c->use_slots ? "SLOTS" : "SHARDS"};
    size_t lens[2] = {7, strlen(argv[1])};
    return outbox__redis_command_argv(n->conn, 2, argv, lens, 0, on_map_reply, n);
}

static void try_next(outbox__cluster *c)
{
    uint64_t now = uv_now(c->loop);
    while (c->probe < c->nprobe) {
        outbox__cluster_node *n = c->nodes[c->probe_order[c->probe++]];
        if (n->state == NS_UP) {
            if (send_query(c, n) == 0)
                return;
            c->failed_otherwise = 1;
        } else if (n->state == NS_CONNECTING) {
            n->probe_wait = 1;
            return;
        } else if (now >= n->down_until && outbox__cluster_node_connect(n) == 0) {
            n->probe_wait = 1;
            return;
        } else {
            c->failed_otherwise = 1; /* not tried: it may not refuse */
        }
    }
    refresh_failed(c);
}

static void start_refresh(outbox__cluster *c)
{
    size_t k = 0;
    size_t *order = realloc(c->probe_order, (c->nnodes ? c->nnodes : 1) * sizeof *order);
    if (!order) {
        snprintf(c->errstr, sizeof c->errstr, "out of memory");
        c->refreshing = 1;
        refresh_failed(c);
        return;
    }
    c->probe_order = order;
    /* Connected masters, connected others, the rest, then the nodes that
     * answered CLUSTERDOWN in the last SAID_DOWN_MS: a master cut off from
     * the majority says so and still names itself for its slots, while the
     * others already name the replica promoted in its place (asked first,
     * its map left publishing there until the heal, 5 s after the
     * promotion). */
    for (int pass = 0; pass < 4; pass++)
        for (size_t i = 0; i < c->nnodes; i++) {
            const outbox__cluster_node *n = c->nodes[i];
            int up = n->state == NS_UP;
            int said = said_down(n, uv_now(c->loop));
            if ((pass == 0 && up && !said && n->master) || (pass == 1 && up && !said && !n->master) ||
                (pass == 2 && !up) || (pass == 3 && up && said))
                order[k++] = i;
        }
    c->nprobe = k;
    c->probe = 0;
    c->refreshing = 1;
    c->refresh_again = 0;
    c->refused = 0;
    c->failed_otherwise = 0;
    try_next(c);
}

void outbox__cluster_map_refresh_soon(outbox__cluster *c)
{
    uint64_t now, since, every;
    if (c->closing || !c->started)
        return;
    if (c->refreshing) {
        c->refresh_again = 1;
        return;
    }
    if (c->refresh_armed)
        return; /* the timer will */
    now = uv_now(c->loop);
    since = now - c->last_refresh;
    every = c->opt.refresh_min_ms;
    if (every > SAID_DOWN_REFRESH_MS && said_down_lately(c))
        every = SAID_DOWN_REFRESH_MS;
    if (c->last_refresh == 0 || since >= every) {
        start_refresh(c);
    } else {
        c->refresh_armed = 1;
        uv_timer_start(&c->refresh_timer, outbox__cluster_map_on_timer, every - since, 0);
    }
}

void outbox__cluster_map_on_timer(uv_timer_t *t)
{
    outbox__cluster *c = t->data;
    c->refresh_armed = 0;
    if (!c->refreshing && !c->closing)
        start_refresh(c);
}

void outbox__cluster_map_node_event(outbox__cluster *c, outbox__cluster_node *n, int status)
{
    if (!n->probe_wait)
        return;
    n->probe_wait = 0;
    if (!c->refreshing || c->closing)
        return;
    if (status == 0 && send_query(c, n) == 0)
        return;
    if (status == OUTBOX_EAUTH)
        c->refused++;
    else
        c->failed_otherwise = 1;
    try_next(c);
}
