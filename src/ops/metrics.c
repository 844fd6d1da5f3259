/*
 * metrics.c: the building blocks of the Prometheus exposition (see
 * metrics.h): fixed-bucket histograms and their text, and the per-topic
 * counters, a small open-addressing table whose size is bounded (topics
 * beyond the limit share one entry) because topic names come from rows that
 * anyone may write.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops/metrics.h"

void outbox__prom_label_value(outbox__sbuf *b, const char *v)
{
    while (*v) {
        size_t n = strcspn(v, "\\\"\n");
        if (n)
            outbox__sbuf_printf(b, "%.*s", (int)n, v);
        v += n;
        if (*v) {
            outbox__sbuf_printf(b, "\\%c", *v == '\n' ? 'n' : *v);
            v++;
        }
    }
}

void outbox__hist_init(outbox__hist *h, const double *bounds, size_t n)
{
    memset(h, 0, sizeof *h);
    h->bounds = bounds;
    h->n = n > OUTBOX_HIST_MAX_BUCKETS ? OUTBOX_HIST_MAX_BUCKETS : n;
}

void outbox__hist_observe(outbox__hist *h, double v)
{
    size_t i = 0;
    while (i < h->n && v > h->bounds[i])
        i++;
    h->counts[i]++;
    h->count++;
    h->sum += v;
}

void outbox__prom_hist(outbox__sbuf *b, const char *name, const char *labels, const outbox__hist *h)
{
    uint64_t cum = 0;
    const char *sep = labels && *labels ? "," : "";
    for (size_t i = 0; i < h->n; i++) {
        cum += h->counts[i];
        outbox__sbuf_printf(b, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, labels ? labels : "", sep, h->bounds[i],
                            (unsigned long long)cum);
    }
    cum += h->counts[h->n];
    outbox__sbuf_printf(b, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, labels ? labels : "", sep,
                        (unsigned long long)cum);
    outbox__sbuf_printf(b, "%s_sum%s%s%s %.6f\n", name, labels && *labels ? "{" : "", labels ? labels : "",
                        labels && *labels ? "}" : "", h->sum);
    outbox__sbuf_printf(b, "%s_count%s%s%s %llu\n", name, labels && *labels ? "{" : "", labels ? labels : "",
                        labels && *labels ? "}" : "", (unsigned long long)h->count);
}

static uint64_t str_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    while (*s)
        h = (h ^ (unsigned char)*s++) * 1099511628211ull;
    return h;
}

void outbox__topics_init(outbox__topics *t, size_t max)
{
    memset(t, 0, sizeof *t);
    t->max = max;
    t->other.topic = "_other";
}

outbox__topic_stat *outbox__topics_get(outbox__topics *t, const char *topic)
{
    size_t i;
    if (t->cap == 0 || (t->len + 1) * 2 > t->cap) {
        if (t->len >= t->max)
            goto lookup_only;
        {
            size_t nc = t->cap ? t->cap * 2 : 16;
            outbox__topic_stat *ns = calloc(nc, sizeof *ns);
            if (!ns)
                goto lookup_only;
            for (size_t k = 0; k < t->cap; k++)
                if (t->slots[k].topic) {
                    i = (size_t)str_hash(t->slots[k].topic) & (nc - 1);
                    while (ns[i].topic)
                        i = (i + 1) & (nc - 1);
                    ns[i] = t->slots[k];
                }
            free(t->slots);
            t->slots = ns;
            t->cap = nc;
        }
    }
lookup_only:
    if (t->cap == 0)
        return &t->other;
    for (i = (size_t)str_hash(topic) & (t->cap - 1); t->slots[i].topic; i = (i + 1) & (t->cap - 1))
        if (strcmp(t->slots[i].topic, topic) == 0)
            return &t->slots[i];
    if (t->len >= t->max || (t->len + 1) * 2 > t->cap)
        return &t->other;
    t->slots[i].topic = strdup(topic);
    if (!t->slots[i].topic)
        return &t->other;
    t->len++;
    return &t->slots[i];
}

void outbox__topics_free(outbox__topics *t)
{
    for (size_t i = 0; i < t->cap; i++)
        free(t->slots[i].topic);
    free(t->slots);
    memset(t, 0, sizeof *t);
}
