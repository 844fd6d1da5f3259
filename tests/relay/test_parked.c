/*
 * test_parked.c: a batch lease's published messages wait for the rest of
 * their batch (src/relay/window.c). Without Redis or a database: a relay
 * made by hand with hooks that count their calls, messages joined to one
 * batch, their replies queued as marks.
 *   - A reply that parks a message in its batch asks for no unit (there is
 *     nothing to write yet); the first one of the batch asks for the parked
 *     flush once (hooks.parked), the later ones do not.
 *   - Before PARKED_MS the flush leaves them parked and says some wait;
 *     after it they are queued as marks of their own rows (own_published),
 *     leaving the batch.
 *   - The batch's last reply queues its published messages with one lead
 *     and asks for a unit; a failure queues its own mark at once.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "outbox.h"
#include "relay/relay_int.h"
#include "tap.h"

static int nschedule, nparked;

static void on_schedule(outbox_relay *r)
{
    (void)r;
    nschedule++;
}

static void on_parked(outbox_relay *r)
{
    (void)r;
    nparked++;
}

static msg *new_msg(outbox_relay *r, relay_batch *b, int64_t seq)
{
    msg *m = calloc(1, sizeof *m + 32);
    if (!m)
        bail("out of memory");
    m->r = r;
    m->seq = seq;
    m->id = (char *)(m + 1);
    snprintf(m->id, 16, "m-%lld", (long long)seq);
    m->topic = m->id + 16;
    strcpy(m->topic, "t");
    m->key = m->topic + 2;
    m->state = MSG_SENT;
    m->created_at = outbox_now_ms();
    outbox__batch_join(b, m);
    return m;
}

/* Takes every queued mark off the relay's queue, freeing the messages. */
static size_t drain_queue(outbox_relay *r, int *own, int *leads)
{
    size_t n = 0;
    msg *m;
    *own = *leads = 0;
    while ((m = r->win.marks_head) != NULL) {
        r->win.marks_head = m->next;
        *own += m->own_published;
        *leads += m->batch_lead;
        outbox__win_retire(r, m);
        n++;
    }
    r->win.marks_tail = NULL;
    r->win.marks_len = 0;
    return n;
}

int main(void)
{
    uv_loop_t loop;
    outbox_relay *r = calloc(1, sizeof *r);
    relay_batch *b;
    msg *m[4];
    int own, leads, i;

    if (!r || uv_loop_init(&loop) != 0)
        bail("setup");
    r->loop = &loop;
    r->hooks.schedule = on_schedule;
    r->hooks.parked = on_parked;

    /* Four messages in one batch; three replies come, the fourth is late. */
    b = outbox__batch_new(1, 4, 1, 1);
    for (i = 0; i < 4; i++)
        m[i] = new_msg(r, b, i + 1);
    outbox__batch_live(r, b);
    uv_update_time(&loop);
    for (i = 0; i < 3; i++)
        outbox__win_queue_mark(r, m[i], OUT_PUBLISHED, "1-0", 3);
    is_int(nschedule, 0, "parked replies ask for no unit");
    is_int(nparked, 1, "the first one asks for the parked flush, once");
    is_int((int)r->win.marks_len, 0, "nothing queued yet");
    is_int(outbox__win_flush_parked(r, 20), 1, "before 20 ms: the flush leaves them, and says some wait");
    is_int((int)r->win.marks_len, 0, "still nothing queued");

    usleep(25000);
    uv_update_time(&loop);
    is_int(outbox__win_flush_parked(r, 20), 0, "after 20 ms: nothing waits any more");
    is_int((int)drain_queue(r, &own, &leads), 3, "the three parked messages queued");
    is_int(own, 3, "each marked on its own row (own_published)");
    is_int((int)b->n, 1, "they left the batch: one message is in it");

    /* The late reply: the batch is done, its lead writes its record. */
    outbox__win_queue_mark(r, m[3], OUT_PUBLISHED, "1-1", 3);
    is_int(nschedule, 1, "the batch's last reply asks for a unit");
    is_int((int)drain_queue(r, &own, &leads), 1, "its message queued");
    is_int(leads, 1, "as the batch's lead");

    /* A second batch: a failure is queued at once and asks for a unit; the
     * published ones wait and are queued with the last reply. */
    nschedule = nparked = 0;
    b = outbox__batch_new(5, 7, 1, 1);
    for (i = 0; i < 3; i++)
        m[i] = new_msg(r, b, i + 5);
    outbox__batch_live(r, b);
    outbox__win_queue_mark(r, m[0], OUT_PUBLISHED, "2-0", 3);
    outbox__win_queue_mark(r, m[1], OUT_RETRY, "ERR no", 6);
    is_int(nschedule, 1, "a failure asks for a unit at once");
    is_int((int)r->win.marks_len, 1, "the failure queued, the published one parked");
    outbox__win_queue_mark(r, m[2], OUT_PUBLISHED, "2-1", 3);
    is_int(nschedule, 2, "the last reply asks for a unit");
    is_int(nparked, 1, "the flush asked for once");
    is_int((int)drain_queue(r, &own, &leads), 3, "all three queued");
    is_int(own + 10 * leads, 10, "one lead, none on its own row");

    free(r->win.seqset);
    free(r->win.keymap);
    free(r);
    uv_run(&loop, UV_RUN_NOWAIT);
    is_int(uv_loop_close(&loop), 0, "the loop closes");
    return tap_done();
}
