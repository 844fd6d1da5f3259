/*
 * metrics.h: Prometheus text exposition helpers (internal): label values,
 * histograms with fixed buckets and per-topic counters, written into an
 * outbox__sbuf.
 */
#ifndef OUTBOX_SRC_METRICS_H
#define OUTBOX_SRC_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "util/sbuf.h"

#define OUTBOX_HIST_MAX_BUCKETS 24

/* A label value in the exposition format, appended to b: backslash, double
 * quote and newline escaped (any byte can come from a row, a topic written
 * past the schema's checks, a database's file name). */
void outbox__prom_label_value(outbox__sbuf *b, const char *v);

typedef struct outbox__hist {
    const double *bounds; /* upper bounds, increasing; +Inf implied */
    size_t n;
    uint64_t counts[OUTBOX_HIST_MAX_BUCKETS + 1];
    uint64_t count;
    double sum;
} outbox__hist;

void outbox__hist_init(outbox__hist *h, const double *bounds, size_t n);
void outbox__hist_observe(outbox__hist *h, double v);
/* name{labels,le="..."} lines plus _sum and _count; labels may be "". */
void outbox__prom_hist(outbox__sbuf *b, const char *name, const char *labels, const outbox__hist *h);

/* Counters per topic: a small open-addressing table. Topics beyond `max`
 * share the entry "_other" so a flood of topics cannot grow memory. */
typedef struct outbox__topic_stat {
    char *topic;
    uint64_t published, failed, dead, retried;
} outbox__topic_stat;

typedef struct outbox__topics {
    outbox__topic_stat *slots;
    size_t cap, len, max;
    outbox__topic_stat other;
} outbox__topics;

void outbox__topics_init(outbox__topics *t, size_t max);
outbox__topic_stat *outbox__topics_get(outbox__topics *t, const char *topic);
void outbox__topics_free(outbox__topics *t);

#endif
