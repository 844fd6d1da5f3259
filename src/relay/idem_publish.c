/*
 * idem_publish.c: idempotent publishing (--idempotent): one script call per
 * stream per batch appends each message only if its publish marker does not
 * exist (src/relay/idem.c has the script and its reply format). A message behind
 * one of its key from an earlier call is sent once that one is appended.
 * The stream and its markers share a slot, so on a cluster each call goes
 * to one node; the script is loaded on each node as it connects. Loop
 * thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "relay/idem.h"
#include "relay_int.h"


typedef struct idem_call {
    outbox_relay *r;
    size_t n;
    msg **next;  /* room for n: the messages chained behind these (on_idem_reply) */
    msg *msgs[]; /* in seq order, then next */
} idem_call;

/* A message of the call is done with outcome o: the messages of its key
 * chained behind it (sent only once it is appended, see claim.c) go into
 * next when it was appended, and are handed back with it otherwise. */
static void settle(outbox_relay *r, msg *m, enum outcome o, const char *text, size_t len, msg **next, size_t *nnext)
{
    if (o == OUT_PUBLISHED && m->key_next) {
        next[(*nnext)++] = m->key_next; /* its own chain follows it */
        m->key_next = NULL;
    } else if (o != OUT_PUBLISHED) {
        outbox__win_release_chain(r, m, o == OUT_RELEASE ? "held back: an earlier message of its key was handed back"
                                                         : "held back: an earlier message of its key failed");
    }
    outbox__win_queue_mark(r, m, o, text, len);
}

static void on_idem_reply(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    idem_call *call = data;
    outbox_relay *r = call->r;
    size_t i, nnext = 0;
    msg **next = call->next;
    r->win.awaiting -= call->n;
    if (status != 0 || !reply || outbox__link_lost(r, conn, reply)) {
        const char *why = status ? outbox_strerror(status) : reply ? reply->str : "no reply";
        for (i = 0; i < call->n; i++)
            settle(r, call->msgs[i], OUT_RELEASE, why, strlen(why), next, &nnext);
    } else if (reply->type == REDIS_REPLY_ERROR) {
        /* The whole call failed before appending anything (a script error
         * aborts at once; OOM refuses the call). NOSCRIPT is not the
         * messages' fault: load the script again and release them. */
        int noscript = reply->len >= 8 && memcmp(reply->str, "NOSCRIPT", 8) == 0;
        if (noscript && outbox__link_routes(r)) {
            /* Per node: a promoted replica lacks the script its old master
             * had. Loaded there, ahead of the calls sent after this one. */
            void *node = outbox__link_node_of(r, conn);
            if (node)
                outbox__pub_idem_load(r, node);
        } else if (noscript && outbox__link_idem_sha(r)[0] && outbox__link_up(r)) {
            /* Only the first NOSCRIPT reloads: the calls sent before it
             * fail too, but their replies all come before the reload's,
             * while the sha is empty (calls sent meanwhile carry the whole
             * script). */
            outbox__pub_idem_load(r, NULL);
        } else if (noscript) {
            outbox__link_idem_sha(r)[0] = '\0';
        }
        for (i = 0; i < call->n; i++)
            settle(r, call->msgs[i], noscript ? OUT_RELEASE : OUT_RETRY, reply->str, reply->len, next, &nnext);
    } else if (reply->type != REDIS_REPLY_ARRAY || reply->elements != call->n) {
        static const char bad[] = "unexpected reply from the publish script";
        for (i = 0; i < call->n; i++)
            settle(r, call->msgs[i], OUT_RETRY, bad, sizeof bad - 1, next, &nnext);
    } else {
        for (i = 0; i < call->n; i++) {
            const char *text;
            size_t len;
            msg *m = call->msgs[i];
            switch (outbox__idem_element(reply->element[i], &text, &len)) {
            case OUTBOX_IDEM_DUPLICATE:
                r->stats.duplicates_total++;
                LOG(r, OUTBOX_LOG_INFO, "msg=\"duplicate publish suppressed\" id=%s entry=%.*s", m->id, (int)len,
                    text);
                /* It is in the stream. */
                settle(r, m, OUT_PUBLISHED, text, len, next, &nnext);
                break;
            case OUTBOX_IDEM_APPENDED:
                settle(r, m, OUT_PUBLISHED, text, len, next, &nnext);
                break;
            default:
                if (len >= 8 && memcmp(text, "HELDBACK", 8) == 0) {
                    r->stats.held_back_total++;
                    settle(r, m, OUT_RELEASE, text, len, next, &nnext);
                } else {
                    settle(r, m, OUT_RETRY, text, len, next, &nnext);
                }
                break;
            }
        }
    }
    /* The messages that waited for these: in calls of their own streams. */
    if (nnext && r->state == R_RUNNING && outbox__link_up(r)) {
        outbox__pub_idem_send(r, next, nnext);
    } else {
        for (i = 0; i < nnext; i++)
            outbox__win_hand_back(r, next[i], "held back: relay stopping", "held back: relay stopping");
    }
    free(call);
    r->hooks.stop_check(r);
}

void outbox__pub_idem_send(outbox_relay *r, msg **ms, size_t n)
{
    unsigned char *done = calloc(n ? n : 1, 1);
    outbox__idem_msg *im = malloc((n ? n : 1) * sizeof *im);
    size_t i, j;

    for (i = 0; i < n; i++) {
        idem_call *call;
        size_t cnt = 0;
        char stream[400], *cmd = NULL;
        long len;
        int e;
        if (done && done[i])
            continue;
        call = malloc(sizeof *call + 2 * (n - i) * sizeof(msg *));
        if (!call || !done || !im) {
            free(call);
            for (j = i; j < n; j++)
                if (!done || !done[j])
                    outbox__win_queue_mark(r, ms[j], OUT_RELEASE, "out of memory", 13);
            break;
        }
        for (j = i; j < n; j++)
            if (!done[j] && strcmp(ms[j]->topic, ms[i]->topic) == 0) {
                done[j] = 1;
                call->msgs[cnt] = ms[j];
                im[cnt].id = ms[j]->id;
                im[cnt].replay_count = ms[j]->replay_count;
                im[cnt].env = ms[j]->env;
                im[cnt].envlen = ms[j]->envlen;
                cnt++;
            }
        call->r = r;
        call->n = cnt;
        call->next = call->msgs + cnt;
        snprintf(stream, sizeof stream, "%s%s", r->cfg.stream_prefix, ms[i]->topic);
        len = outbox__idem_format(&cmd, outbox__link_idem_sha(r)[0] ? outbox__link_idem_sha(r) : NULL, r->cfg.stream_prefix, stream,
                                  r->cfg.s.db_name, r->cfg.s.idempotent_retention_ms, r->cfg.s.maxlen, im, cnt);
        e = len < 0 ? OUTBOX_ENOMEM : outbox__link_send(r, ms[i]->topic, cmd, (size_t)len, on_idem_reply, call, NULL);
        free(cmd);
        if (e != 0) {
            for (j = 0; j < cnt; j++)
                outbox__win_queue_mark(r, call->msgs[j], OUT_RELEASE, outbox_strerror(e), strlen(outbox_strerror(e)));
            free(call);
            continue;
        }
        for (j = 0; j < cnt; j++) {
            call->msgs[j]->state = MSG_SENT;
            free(call->msgs[j]->env);
            call->msgs[j]->env = NULL;
        }
        r->win.awaiting += cnt;
    }
    free(done);
    free(im);
}

/* data is the link, not the relay: the relays of a group share the sha,
 * and the one that asked may be gone when the reply comes. */
static void on_idem_loaded(outbox__redis *conn, int status, redisReply *reply, void *data)
{
    struct relay_link *l = data;
    (void)conn;
    if (status == 0 && reply && reply->type == REDIS_REPLY_STRING && reply->len == 40)
        memcpy(l->idem_sha, reply->str, 41);
}

void outbox__pub_idem_load(outbox_relay *r, void *node)
{
    const char *argv[3] = {"SCRIPT", "LOAD", outbox__idem_lua};
    size_t lens[3] = {6, 4, strlen(outbox__idem_lua)};
    if (!outbox__link_routes(r))
        outbox__link_idem_sha(r)[0] = '\0'; /* until it is loaded, calls carry the script */
    outbox__link_node_argv(r, node, 3, argv, lens, 0, on_idem_loaded, r->redis.l);
}
