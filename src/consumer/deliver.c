/*
 * deliver.c: the entries of the consumer-group helper (consumer_int.h):
 * building one from a stream entry, the list of live entries, the retry
 * list and its timer (XCLAIM, or XCLAIM JUSTID for a recheck),
 * acknowledgement (XACK) and dead letters (<stream>:dead). The lowest of
 * the helper's files: what it asks of the others (dispatch a retried
 * entry; an entry gone: read more, a stop may finish) goes through
 * c->hooks. Loop thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "consumer/consumer_int.h"

static void on_retry_timer(uv_timer_t *t);

/* ------------------------------------------------------------------ */
/* entries */

/* Whether an entry's db field and its envelope's db name the same
 * database, or both none. */
static int same_db(const char *field, const char *env)
{
    if (!field || !env)
        return field == env;
    return strcmp(field, env) == 0;
}

/* Builds an entry from [id, [field, value, ...]]; NULL if the reply has
 * another shape. */
entry *outbox__consumer_entry_from_reply(outbox_consumer *c, const redisReply *r, uint64_t deliveries)
{
    entry *e;
    const redisReply *fields;
    char err[160];
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 || r->element[0]->type != REDIS_REPLY_STRING)
        return NULL;
    e = calloc(1, sizeof *e);
    if (!e)
        return NULL;
    e->c = c;
    e->entry_id = strndup(r->element[0]->str, r->element[0]->len);
    e->dv.stream = c->stream;
    e->dv.entry_id = e->entry_id;
    e->dv.deliveries = deliveries;
    fields = r->element[1];
    if (fields->type == REDIS_REPLY_ARRAY) {
        for (size_t i = 0; i + 1 < fields->elements; i += 2) {
            const redisReply *k = fields->element[i], *v = fields->element[i + 1];
            if (k->type != REDIS_REPLY_STRING || v->type != REDIS_REPLY_STRING)
                continue;
            if (k->len == 2 && memcmp(k->str, "id", 2) == 0 && !e->msg_id)
                e->msg_id = strndup(v->str, v->len);
            else if (k->len == 2 && memcmp(k->str, "db", 2) == 0 && !e->db_field)
                e->db_field = strndup(v->str, v->len);
            else if (k->len == 8 && memcmp(k->str, "envelope", 8) == 0 && !e->raw_env) {
                e->raw_env = malloc(v->len ? v->len : 1);
                if (e->raw_env) {
                    memcpy(e->raw_env, v->str, v->len);
                    e->raw_len = v->len;
                }
            }
        }
    }
    if (e->raw_env && e->msg_id) {
        int rc = outbox_envelope_decode(e->raw_env, e->raw_len, &e->env, err, sizeof err);
        if (rc != 0)
            LOG(c, OUTBOX_LOG_WARN, "msg=\"undecodable envelope\" entry=%s err=%s detail=\"%s\"", e->entry_id,
                outbox_err_name(rc), err);
        else if (strcmp(e->env->id, e->msg_id) != 0) {
            LOG(c, OUTBOX_LOG_WARN, "msg=\"entry id field differs from the envelope's id\" entry=%s", e->entry_id);
            outbox_envelope_free(e->env);
            e->env = NULL;
        } else if (!same_db(e->db_field, e->env->db)) {
            /* The relay writes both or neither: a field without its key (or
             * the other way round) is as wrong as two names. */
            LOG(c, OUTBOX_LOG_WARN, "msg=\"entry db field differs from the envelope's db\" entry=%s", e->entry_id);
            outbox_envelope_free(e->env);
            e->env = NULL;
        } else if (e->env->db && *e->env->db && asprintf(&e->db_id, "%s:%s", e->env->db, e->msg_id) < 0) {
            e->db_id = NULL;
            outbox_envelope_free(e->env);
            e->env = NULL;
        }
    }
    e->dv.msg = e->env;
    /* Link it as live. */
    e->next = c->live;
    if (c->live)
        c->live->prev = e;
    c->live = e;
    c->inflight++;
    return e;
}

void outbox__consumer_entry_free(entry *e)
{
    outbox_consumer *c = e->c;
    if (e->prev)
        e->prev->next = e->next;
    else
        c->live = e->next;
    if (e->next)
        e->next->prev = e->prev;
    c->inflight--;
    outbox_envelope_free(e->env);
    free(e->entry_id);
    free(e->msg_id);
    free(e->db_field);
    free(e->db_id);
    free(e->raw_env);
    free(e);
    c->hooks.entry_gone(c);
}

entry *outbox__consumer_entry_find(outbox_consumer *c, const char *entry_id)
{
    for (entry *e = c->live; e; e = e->next)
        if (strcmp(e->entry_id, entry_id) == 0)
            return e;
    return NULL;
}

void outbox__consumer_schedule_retry(entry *e, const char *why)
{
    outbox_consumer *c = e->c;
    entry **pp;
    if (c->state != CS_RUNNING) {
        /* Stopping: leave it pending in the group; it is delivered again
         * (to us after a restart, or to another consumer via XAUTOCLAIM). */
        outbox__consumer_entry_free(e);
        return;
    }
    LOG(c, OUTBOX_LOG_DEBUG, "msg=\"will retry\" id=%s entry=%s reason=\"%s\"", e->msg_id ? e->msg_id : "-",
        e->entry_id, why);
    e->retry_at = uv_now(c->loop) + c->s.retry_ms;
    e->in_retry = 1;
    /* Appending keeps the list ordered by retry_at (one fixed delay). */
    for (pp = &c->retry_head; *pp; pp = &(*pp)->rnext)
        ;
    e->rnext = NULL;
    *pp = e;
    if (!uv_is_active((uv_handle_t *)&c->retry_timer))
        uv_timer_start(&c->retry_timer, on_retry_timer, c->s.retry_ms, 0);
}

/* Retries an entry whose handler did not run (someone else holds the dedup
 * key, Redis or the database was unavailable): the retry re-checks that the
 * entry is still pending with XCLAIM JUSTID, which does not count a
 * delivery. Counting these would dead-letter an entry while another
 * consumer is still applying it, or while its dead owner's lease runs out. */
void outbox__consumer_schedule_recheck(entry *e, const char *why)
{
    e->recheck = 1;
    outbox__consumer_schedule_retry(e, why);
}

/* ------------------------------------------------------------------ */
/* acknowledgement and dead letters */

static void on_ack(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    entry *e = data;
    if (status == 0 && reply && e->c->cmd && outbox__target_lost(e->c->cmd, conn, reply))
        status = OUTBOX_ECLOSED; /* the old master: it stays pending and comes again */
    if (status == 0 && reply->type == REDIS_REPLY_INTEGER)
        e->c->st.acked++;
    else
        LOG(e->c, OUTBOX_LOG_WARN, "msg=\"XACK failed; the entry stays pending and is recognised as done when "
                                   "delivered again\" id=%s entry=%s",
            e->msg_id ? e->msg_id : "-", e->entry_id);
    outbox__consumer_entry_free(e);
}

void outbox__consumer_ack(entry *e)
{
    outbox_consumer *c = e->c;
    const char *argv[4] = {"XACK", c->stream, c->group, e->entry_id};
    size_t lens[4] = {4, strlen(c->stream), strlen(c->group), strlen(e->entry_id)};
    if (outbox__consumer_command(c, c->stream, 4, argv, lens, on_ack, e) != 0)
        on_ack(NULL, OUTBOX_ECONNECT, NULL, e);
}

static void on_dead_added(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    entry *e = data;
    if (status == 0 && e->c->cmd && outbox__target_lost(e->c->cmd, conn, reply))
        status = OUTBOX_ECLOSED;
    if (status == 0 && reply->type == REDIS_REPLY_STRING) {
        e->c->st.dead_lettered++;
        outbox__consumer_ack(e);
    } else {
        LOG(e->c, OUTBOX_LOG_ERROR, "msg=\"cannot write to the dead stream; entry left pending\" entry=%s stream=%s",
            e->entry_id, e->c->dead_stream);
        outbox__consumer_schedule_recheck(e, "dead stream write failed");
    }
}

/* Copies the entry to <stream>:dead with the reason, then acknowledges it,
 * so one poison message cannot block the group. */
void outbox__consumer_dead_letter(entry *e, const char *reason)
{
    outbox_consumer *c = e->c;
    char deliveries[24];
    const char *argv[18];
    size_t lens[18];
    int n = 0;

    LOG(c, OUTBOX_LOG_ERROR, "msg=\"dead-lettered\" id=%s entry=%s deliveries=%llu reason=\"%s\"",
        e->msg_id ? e->msg_id : "-", e->entry_id, (unsigned long long)e->dv.deliveries, reason);
    snprintf(deliveries, sizeof deliveries, "%llu", (unsigned long long)e->dv.deliveries);
#define ARG(s, l) (argv[n] = (s), lens[n++] = (l))
    ARG("XADD", 4);
    ARG(c->dead_stream, strlen(c->dead_stream));
    ARG("*", 1);
    ARG("id", 2);
    ARG(e->msg_id ? e->msg_id : "", e->msg_id ? strlen(e->msg_id) : 0);
    if (e->db_field) {
        ARG("db", 2);
        ARG(e->db_field, strlen(e->db_field));
    }
    ARG("envelope", 8);
    ARG(e->raw_env ? e->raw_env : "", e->raw_len);
    ARG("source_entry", 12);
    ARG(e->entry_id, strlen(e->entry_id));
    ARG("group", 5);
    ARG(c->group, strlen(c->group));
    ARG("deliveries", 10);
    ARG(deliveries, strlen(deliveries));
    ARG("reason", 6);
    ARG(reason, strlen(reason));
#undef ARG
    /* The dead stream has a slot of its own on a cluster: sent by its
     * name. */
    if (outbox__consumer_command(c, c->dead_stream, n, argv, lens, on_dead_added, e) != 0)
        outbox__consumer_schedule_recheck(e, "not connected");
}


/* ------------------------------------------------------------------ */
/* retries */

static void on_xclaim(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    entry *old = data;
    outbox_consumer *c = old->c;
    entry *e;
    uint64_t deliveries = old->dv.deliveries + 1;
    (void)conn;
    if (status != 0) {
        outbox__consumer_schedule_retry(old, "not connected");
        return;
    }
    if (c->state != CS_RUNNING || reply->type != REDIS_REPLY_ARRAY || reply->elements == 0 ||
        reply->element[0]->type != REDIS_REPLY_ARRAY) {
        /* Not pending for the group any more (acknowledged by someone), or
         * stopping (it stays pending): it is not ours to process now. */
        outbox__consumer_entry_free(old);
        return;
    }
    outbox__consumer_entry_free(old);
    e = outbox__consumer_entry_from_reply(c, reply->element[0], deliveries);
    if (e)
        c->hooks.dispatch(e);
}

static void on_recheck(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    entry *e = data;
    (void)conn;
    if (status != 0) {
        outbox__consumer_schedule_retry(e, "not connected");
        return;
    }
    if (e->c->state != CS_RUNNING || reply->type != REDIS_REPLY_ARRAY || reply->elements == 0) {
        outbox__consumer_entry_free(e);
        return;
    }
    e->recheck = 0;
    e->c->hooks.dispatch(e);
}

static void on_retry_timer(uv_timer_t *t)
{
    outbox_consumer *c = t->data;
    uint64_t now = uv_now(c->loop);
    while (c->retry_head && c->retry_head->retry_at <= now) {
        entry *e = c->retry_head;
        c->retry_head = e->rnext;
        e->in_retry = 0;
        if (!outbox__consumer_cmd_ready(c) || c->state != CS_RUNNING) {
            if (c->state != CS_RUNNING) {
                outbox__consumer_entry_free(e);
                continue;
            }
            outbox__consumer_schedule_retry(e, "not connected");
            continue;
        }
        if (e->completing) {
            c->hooks.complete(e); /* its effect is applied: only the complete is left */
            continue;
        }
        {
            /* XCLAIM to ourselves with no idle condition: counts a delivery
             * and returns the entry if it is still pending; with JUSTID it
             * only says whether it is, without counting. */
            const char *argv[7] = {"XCLAIM", c->stream, c->group, c->consumer, "0", e->entry_id, "JUSTID"};
            int argc = e->recheck ? 7 : 6;
            size_t lens[7];
            for (int i = 0; i < argc; i++)
                lens[i] = strlen(argv[i]);
            if (outbox__consumer_command(c, c->stream, argc, argv, lens, e->recheck ? on_recheck : on_xclaim, e) != 0)
                outbox__consumer_schedule_retry(e, "not connected");
        }
    }
    if (c->retry_head)
        uv_timer_start(&c->retry_timer, on_retry_timer, c->retry_head->retry_at - now, 0);
}

