/*
 * publish.c: sending claimed messages with pipelined XADDs through the
 * relay's link (link.c: one node, or the node of each stream's slot in a
 * cluster), and WAIT groups (--wait-replicas): one per node that took
 * messages of a batch, its WAIT sent to that node behind them. Every reply
 * turns its message into a queued mark; a keyed message's successor is sent
 * once it is accepted. A message whose connection was lost before its reply
 * is parked and sent again once Redis is back (struct relay_park in
 * relay_int.h says why). Loop thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "relay_int.h"
#include "util/array.h"

static int send_wait(outbox_relay *r, outbox__redis *conn, wait_group *g);

/*
 * A WAIT that fell short, on a connection that is still up to a node that
 * is still a master: the entries are in that master's stream, and asking
 * the same connection again (its WAIT counts from the connection's last
 * write, which covers them) confirms them the moment a replica catches up,
 * without appending them again. Asked until half the lease has passed
 * since the first WAIT; a stop, a switch of master (the connection
 * closes: released at once, and sent again to the new master) or a
 * cluster node that lost its slots ends it.
 */
static int wait_again(outbox_relay *r, outbox__redis *conn, wait_group *g)
{
    size_t i, waiting = 0;
    for (i = 0; i < g->n; i++)
        if (g->msgs[i] && g->msgs[i]->state == MSG_WAITING)
            waiting++;
    return waiting && r->state == R_RUNNING && !outbox__link_problem(r) &&
           uv_now(r->loop) - g->since < r->cfg.s.lease_ms / 2 && send_wait(r, conn, g) == 0;
}

static void on_wait_reply(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    wait_group *g = data;
    outbox_relay *r = g->r;
    char why[160];
    long long acked = -1;
    int serves = 1;
    size_t i;

    if (status == 0 && reply && reply->type == REDIS_REPLY_INTEGER)
        acked = reply->integer;
    else if (status == 0 && r && outbox__link_lost(r, conn, reply))
        status = OUTBOX_ECLOSED; /* released below, like a lost connection */
    for (i = 0; i < g->n; i++) {
        msg *m = g->msgs[i];
        if (m && m->state == MSG_SENT) {
            /* Its XADD was redirected to another node and is not answered
             * yet: this WAIT does not cover it (on_xadd_reply sends one
             * for it where it lands). */
            m->group = NULL;
            g->msgs[i] = NULL;
        }
    }
    if (r && status == 0 && acked >= 0 && acked < (long long)r->cfg.s.wait_replicas) {
        serves = outbox__link_node_serves(r, g->node);
        if (serves && wait_again(r, conn, g))
            return;
    }
    if (r && acked < (long long)r->cfg.s.wait_replicas) {
        if (status != 0)
            snprintf(why, sizeof why, "WAIT: %s", outbox_strerror(status));
        else if (reply && reply->type == REDIS_REPLY_ERROR)
            snprintf(why, sizeof why, "WAIT: %.100s", reply->str);
        else
            snprintf(why, sizeof why, "WAIT: %lld of %u replicas acknowledged%s", acked, r->cfg.s.wait_replicas,
                     serves ? "" : " (the node no longer serves the slot)");
    }
    for (i = 0; i < g->n; i++) {
        msg *m = g->msgs[i];
        if (!m || m->state != MSG_WAITING)
            continue;
        r->win.awaiting--;
        if (acked >= (long long)r->cfg.s.wait_replicas)
            outbox__win_queue_mark(r, m, OUT_PUBLISHED, m->result, strlen(m->result));
        else if (status != 0 || !serves)
            outbox__win_queue_mark(r, m, OUT_RELEASE, why, strlen(why));
        else
            outbox__win_queue_mark(r, m, OUT_RETRY, why, strlen(why));
    }
    free(g->msgs);
    free(g);
    if (r)
        r->hooks.stop_check(r);
}

static void wait_argv(const outbox_relay *r, const char **argv, size_t *lens, char *n, size_t nlen, char *timeout,
                      size_t tlen)
{
    snprintf(n, nlen, "%u", r->cfg.s.wait_replicas);
    snprintf(timeout, tlen, "%llu", (unsigned long long)r->cfg.s.wait_timeout_ms);
    argv[0] = "WAIT";
    argv[1] = n;
    argv[2] = timeout;
    for (int i = 0; i < 3; i++)
        lens[i] = strlen(argv[i]);
}

/* The same WAIT again, on the connection that answered the last one. */
static int send_wait(outbox_relay *r, outbox__redis *conn, wait_group *g)
{
    char timeout[24], n[16];
    const char *argv[3];
    size_t lens[3];
    wait_argv(r, argv, lens, n, sizeof n, timeout, sizeof timeout);
    return outbox__redis_command_argv(conn, 3, argv, lens, r->cfg.s.wait_timeout_ms + r->cfg.s.reply_timeout_ms,
                                      on_wait_reply, g);
}

static void flush_group(outbox_relay *r, wait_group *g)
{
    char timeout[24], n[16];
    const char *argv[3];
    size_t lens[3];
    size_t i;

    if (!g)
        return;
    wait_argv(r, argv, lens, n, sizeof n, timeout, sizeof timeout);
    g->since = uv_now(r->loop);
    if (outbox__link_node_argv(r, g->node, 3, argv, lens, r->cfg.s.wait_timeout_ms + r->cfg.s.reply_timeout_ms,
                               on_wait_reply, g) != 0) {
        /* The connection is gone: the XADD callbacks release their messages;
         * nobody waits for this group. */
        for (i = 0; i < g->n; i++)
            if (g->msgs[i])
                g->msgs[i]->group = NULL;
        free(g->msgs);
        free(g);
    }
}

void outbox__pub_flush_groups(outbox_relay *r, wait_set *ws)
{
    for (size_t i = 0; i < ws->n; i++)
        flush_group(r, ws->g[i]);
    free(ws->g);
    memset(ws, 0, sizeof *ws);
}

/* The group of node in ws, created on demand; NULL without memory. */
static wait_group *group_for(outbox_relay *r, wait_set *ws, void *node)
{
    wait_group *g;
    for (size_t i = 0; i < ws->n; i++)
        if (ws->g[i]->node == node)
            return ws->g[i];
    if (OUTBOX__GROW(ws->g, &ws->cap, ws->n, 1, 4) != 0)
        return NULL;
    if (!(g = calloc(1, sizeof *g)))
        return NULL;
    g->r = r;
    g->node = node;
    ws->g[ws->n++] = g;
    return g;
}

/* Adds m to g; 0, or -1 without memory (m then has no group). */
static int group_add(wait_group *g, msg *m)
{
    if (g->n == g->cap && OUTBOX__GROW(g->msgs, &g->cap, g->n, 1, 64) != 0)
        return -1;
    g->msgs[g->n++] = m;
    m->group = g;
    return 0;
}

/* A message whose outcome is decided without its group's WAIT leaves the
 * group: it may be marked and freed before the WAIT reply comes. */
static void leave_group(msg *m)
{
    wait_group *g = m->group;
    size_t i;
    if (!g)
        return;
    for (i = 0; i < g->n; i++)
        if (g->msgs[i] == m) {
            g->msgs[i] = NULL;
            break;
        }
    m->group = NULL;
}

/* ---- parked messages (struct relay_park) -------------------------------- */

/* How often a message is sent again after lost connections before its row
 * is handed back: a guard against a message that itself ends the connection
 * every time, high enough for 30 s of random resets (a loss every few
 * hundred ms). */
#define PARK_MAX_RESENDS 100

static void on_park_timer(uv_timer_t *t);

/* Up (a cluster whose other nodes answer): sent again after the other
 * callbacks of the loss. Down: they wait for the up event. */
static void park_arm(outbox_relay *r)
{
    if (outbox__link_up(r))
        uv_timer_start(&r->park.timer, on_park_timer, 0, 0);
}

int outbox__pub_park(outbox_relay *r, msg *m)
{
    /* With --wait-replicas a message whose XADD was accepted goes back to
     * its row when its WAIT fails (retried) or is lost, and its key's next
     * message was already sent behind it: parked and sent again at once, that
     * one would land before it on a promoted replica that never got it (3
     * order violations in a cluster minority). There every message lost
     * with a connection goes back to its row, in order, as before. */
    if (r->state != R_RUNNING || r->cfg.s.wait_replicas || m->resends >= PARK_MAX_RESENDS)
        return 0;
    m->resends++;
    m->state = MSG_HELD;
    m->park_next = NULL;
    if (r->park.tail)
        r->park.tail->park_next = m;
    else
        r->park.head = m;
    r->park.tail = m;
    r->park.n++;
    park_arm(r);
    return 1;
}

/* Takes the whole list. */
static msg *park_take(outbox_relay *r)
{
    msg *m = r->park.head;
    r->park.head = r->park.tail = NULL;
    r->park.n = 0;
    return m;
}

void outbox__pub_park_flush(outbox_relay *r)
{
    wait_set ws = {0};
    msg *m = park_take(r), *next;
    uv_timer_stop(&r->park.timer);
    for (; m; m = next) {
        next = m->park_next;
        m->park_next = NULL;
        if (r->state != R_RUNNING)
            outbox__win_hand_back(r, m, "held back: relay stopping", "held back: relay stopping");
        else
            outbox__pub_send(r, m, &ws); /* hands it back if it cannot go */
    }
    outbox__pub_flush_groups(r, &ws);
    r->hooks.schedule(r); /* the marks of those handed back */
    r->hooks.stop_check(r);
}

void outbox__pub_park_release(outbox_relay *r, const char *why)
{
    msg *m = park_take(r), *next;
    uv_timer_stop(&r->park.timer);
    for (; m; m = next) {
        next = m->park_next;
        m->park_next = NULL;
        outbox__win_hand_back(r, m, why, why);
    }
}

static void on_park_timer(uv_timer_t *t)
{
    outbox_relay *r = t->data;
    if (outbox__link_up(r))
        outbox__pub_park_flush(r);
}

int outbox__pub_park_init(outbox_relay *r)
{
    uv_timer_init(r->loop, &r->park.timer);
    r->park.timer.data = r;
    return 1;
}

void outbox__pub_park_close(outbox_relay *r, uv_close_cb cb)
{
    uv_close((uv_handle_t *)&r->park.timer, cb);
}

/* ---- replies ------------------------------------------------------------- */

static void on_xadd_reply(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    msg *m = data;
    outbox_relay *r = m->r;
    wait_set ws = {0};

    if (status != 0 || !reply || outbox__link_lost(r, conn, reply)) {
        const char *why = status ? outbox_strerror(status) : reply ? reply->str : "no reply";
        r->win.awaiting--;
        /* The outcome is unknown: it may be appended, it may not. Sending
         * it again risks a duplicate, never a loss. (A node that stopped
         * being the master is the connection's failure too, not the
         * message's.) */
        leave_group(m);
        /* Not when publishing is held (an ACL refusing XADD, a cluster node
         * behind a plain URL): sent again, it would meet the same answer. */
        if (outbox__link_problem(r) || !outbox__pub_park(r, m))
            outbox__win_hand_back(r, m, why, "held back: connection lost");
    } else if (reply->type == REDIS_REPLY_STRING || reply->type == REDIS_REPLY_STATUS) {
        void *node = outbox__link_node_of(r, conn);
        if (r->cfg.s.wait_replicas) {
            /* The entry id waits with it for the WAIT reply: in the message
             * itself when it fits (it always does for Redis's ids). */
            if (m->result != m->entry)
                free(m->result);
            m->result = reply->len < sizeof m->entry ? outbox__safe_text_into(m->entry, reply->str, reply->len)
                                                     : outbox__safe_text(reply->str, reply->len);
        }
        if (m->group && m->group->node != node)
            leave_group(m); /* redirected: appended on another node than its group's */
        if (r->cfg.s.wait_replicas && !m->group) {
            /* A WAIT of its own, on the node that took it. */
            wait_set own = {0};
            wait_group *g = group_for(r, &own, node);
            if (g && group_add(g, m) == 0)
                m->state = MSG_WAITING;
            outbox__pub_flush_groups(r, &own);
        }
        if (m->group) {
            m->state = MSG_WAITING; /* counted in awaiting until WAIT answers */
        } else if (r->cfg.s.wait_replicas) {
            /* Its WAIT group could not be made or sent (out of memory):
             * marking it published would skip the replicas' promise. */
            static const char why[] = "WAIT not sent: out of memory";
            r->win.awaiting--;
            outbox__win_queue_mark(r, m, OUT_RELEASE, why, sizeof why - 1);
        } else {
            r->win.awaiting--;
            outbox__win_queue_mark(r, m, OUT_PUBLISHED, reply->str, reply->len);
        }
        /* The next message of the key may go now: this one is appended. */
        if (m->key_next) {
            msg *n = m->key_next;
            m->key_next = NULL;
            if (r->state == R_RUNNING && outbox__link_up(r)) {
                outbox__pub_send(r, n, &ws);
                outbox__pub_flush_groups(r, &ws);
            } else {
                outbox__win_hand_back(r, n, "held back: relay stopping", "held back: relay stopping");
            }
        }
    } else {
        char buf[256];
        if (reply->type == REDIS_REPLY_ERROR)
            snprintf(buf, sizeof buf, "%.*s", (int)(reply->len < 200 ? reply->len : 200), reply->str);
        else
            snprintf(buf, sizeof buf, "unexpected XADD reply type %d", reply->type);
        r->win.awaiting--;
        leave_group(m);
        /* A later message of this key must not be appended before this one. */
        outbox__win_release_chain(r, m, "held back: an earlier message of its key failed");
        outbox__win_queue_mark(r, m, OUT_RETRY, buf, strlen(buf));
    }
    r->hooks.stop_check(r);
}

void outbox__pub_send(outbox_relay *r, msg *m, wait_set *ws)
{
    void *node = NULL;
    int e = outbox__link_send(r, m->topic, m->cmd, m->cmdlen, on_xadd_reply, m, &node);
    wait_group *g;
    if (e != 0) {
        outbox__win_hand_back(r, m, outbox_strerror(e), "held back: connection lost");
        return;
    }
    m->state = MSG_SENT;
    r->win.awaiting++;
    /* Without memory for a group, its reply releases it (on_xadd_reply). */
    if (r->cfg.s.wait_replicas && (g = group_for(r, ws, node)) != NULL)
        group_add(g, m);
}
