/*
 * group_relay.c: the relays of a group (group_int.h): one opened for a
 * database with work (outbox__relay_create_on the group's link, drain mode,
 * its lines naming the database), closed once its drain ended and it stayed
 * idle, freed outside its stop callback, and what the entry does next.
 * Loop thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "group_int.h"

/* ---- the relays --------------------------------------------------------- */

/* The relays' lines name their database. */
static void relay_log(void *data, outbox_log_level level, const char *line)
{
    gdb *d = data;
    outbox_relay_group *g = d->g;
    char buf[4096], q[300];
    outbox__logfmt_quote(q, sizeof q, d->name);
    snprintf(buf, sizeof buf, "%s database=%s", line, q);
    g->tmpl.log(g->tmpl.log_data, level, buf);
}


static void on_relay_drained(outbox_relay *r, void *data)
{
    gdb *d = data;
    outbox_relay_group *g = d->g;
    int e = outbox_relay_drain_result(r);
    if (d->state != G_OPEN)
        return;
    if (e == OUTBOX_ECONFIG) {
        /* Redis cannot be used as configured: the link said why. */
        if (g->tmpl.drain) {
            if (!g->drain_error)
                g->drain_error = OUTBOX_ECONFIG;
            d->drain_failed = 1;
            outbox__strlcpy(d->why, outbox_strerror(e), sizeof d->why);
        } else {
            d->wake_at = outbox_now_ms() + HELD_RETRY_MS;
        }
        outbox__group_close_db(d);
        return;
    }
    d->retry_ms = 0; /* it opened: failures begin again from the start */
    d->busy_since = 0;
    d->logged[0] = '\0';
    d->idle_since = uv_now(g->loop);
    /* Nothing due, leased, in flight or waiting for a retry. */
    d->fig_known = 1;
    d->fig_backlog = d->fig_oldest_ms = 0;
    d->idle_mark = r->stats.published_total + r->stats.failed_total + r->stats.dead_total;
    if (g->tmpl.drain) {
        d->drained = 1;
        outbox__group_close_db(d);
        return;
    }
    outbox__group_arm(g, LINGER_MS);
    outbox__group_pump(g);
}

static void on_settle(uv_timer_t *t);

/* A relay stopped: it is freed on the next loop turn, outside its stop
 * callback, so that its connections are closed (the last one checkpoints
 * and removes the -wal) before the group looks at the files. */
static void on_relay_stopped(outbox_relay *r, void *data)
{
    gdb *d = data;
    outbox_relay_group *g = d->g;
    (void)r;
    d->settle = 1;
    uv_timer_start(&g->settle_timer, on_settle, 0, 0);
}

static void settled(gdb *d)
{
    outbox_relay_group *g = d->g;
    outbox_relay *r = d->r;
    d->settle = 0;
    g->published_total += r->stats.published_total;
    g->failed_total += r->stats.failed_total;
    g->dead_total += r->stats.dead_total;
    outbox_relay_destroy(r);
    d->r = NULL;
    g->nopen--;
    outbox__group_set_share(g);
    d->state = G_IDLE;
    if (d->open_failed && !d->gone && g->state == R_RUNNING) {
        d->open_failed = 0;
        outbox__group_failed(d, d->open_e, d->open_why);
        return;
    }
    if (d->gone || g->state == R_STOPPING) {
        if (d->gone)
            outbox__group_drop(d);
    } else if (d->requeue) {
        d->requeue = 0;
        outbox__group_want(d);
    } else if (!g->tmpl.drain || !d->drained) {
        /* A commit while it closed would wake nobody: look again. */
        outbox__group_probe(d);
    } else {
        outbox__group_remember(d);
    }
}

static void on_settle(uv_timer_t *t)
{
    outbox_relay_group *g = t->data;
    size_t i = 0;
    while (i < g->ndbs) {
        gdb *d = g->dbs[i];
        if (d->settle) {
            settled(d); /* may drop d: the array changes at i */
            continue;
        }
        i++;
    }
    outbox__group_pump(g);
    outbox__group_drain_check(g);
    outbox__group_stop_check(g);
}

void outbox__group_close_db(gdb *d)
{
    if (d->state != G_OPEN)
        return;
    d->state = G_CLOSING;
    d->idle_since = 0;
    if (outbox_relay_stop(d->r, on_relay_stopped, d) != 0)
        on_relay_stopped(d->r, d);
}

/* The relay could not open its database (on its worker thread): it stops,
 * and the entry fails once it is freed (settled). */
static void on_open_failed(outbox_relay *r, int e, const char *why, void *data)
{
    gdb *d = data;
    (void)r;
    d->open_failed = 1;
    d->open_e = e;
    outbox__strlcpy(d->open_why, why, sizeof d->open_why);
    outbox__group_close_db(d);
}

void outbox__group_open_db(gdb *d)
{
    outbox_relay_group *g = d->g;
    outbox_relay_settings s = g->tmpl;
    char err[512], prefix[400];
    int e;
    s.db_path = d->path;
    s.db_name = d->name;
    s.db_dir = NULL;
    s.drain = 1;
    s.drain_timeout_ms = 0;
    s.on_drained = on_relay_drained;
    s.on_drained_data = d;
    s.log = relay_log;
    s.log_data = d;
    s.wait_for_db = 0;
    s.metrics_listen = NULL; /* the group's endpoint speaks for all */
    s.stream_template = NULL;
    if (g->tmpl.stream_template) {
        /* "...%db...%topic": the relay's prefix is the part before %topic,
         * with the database's name in it (the template was checked). */
        const char *t = g->tmpl.stream_template, *at = strstr(t, "%db");
        snprintf(prefix, sizeof prefix, "%.*s%s%.*s", (int)(at - t), t, d->name,
                 (int)(strlen(t) - 6 - (size_t)(at + 3 - t)), at + 3);
        s.stream_prefix = prefix;
    }
    e = outbox__relay_create_on(&d->r, g->loop, &s, &g->link, err, sizeof err);
    if (e == 0) {
        d->r->share = &g->share;
        d->r->open_failed = on_open_failed;
        d->r->open_failed_data = d;
        g->nopen++;
        outbox__group_set_share(g);
        if ((e = outbox_relay_start(d->r)) != 0) {
            outbox_relay_destroy(d->r);
            d->r = NULL;
            g->nopen--;
            outbox__group_set_share(g);
            snprintf(err, sizeof err, "cannot start: %s", outbox_strerror(e));
        }
    }
    if (e != 0) {
        d->r = NULL;
        outbox__group_failed(d, e, err);
        outbox__group_drain_check(g);
        return;
    }
    d->state = G_OPEN;
    d->e = 0;
    d->wake_at = 0;
    d->opened_at = d->last_used = uv_now(g->loop);
}
