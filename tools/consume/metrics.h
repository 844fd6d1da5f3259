/*
 * metrics.h: outbox-consume's /metrics and /healthz (--metrics-listen),
 * on the consumer's own loop, through the library's HTTP server with the
 * same limits, and TLS and basic authentication from a web configuration
 * file (--metrics-web-config), as outbox-relay serves them.
 *
 * /metrics: the consumer's counters (outbox_consumer_stats_get) and the
 * group's pending entries and lag (outbox_consumer_group_info_get, asked
 * once a second on the command connection), each with the labels stream
 * and group. /healthz: 200 "ok" while Redis answered within the last
 * down_ms, else 503 with the reason.
 */
#ifndef OUTBOX_TOOLS_CONSUME_METRICS_H
#define OUTBOX_TOOLS_CONSUME_METRICS_H

#include <uv.h>

#include "util/util.h"
#include "outbox.h"

typedef struct consume_metrics consume_metrics;

/* Reads the web configuration (web_path may be NULL) and checks listen;
 * binds nothing yet. 0, or OUTBOX_EINVAL / OUTBOX_ENOMEM with err naming
 * the option and the problem. stream and group are copied; log is
 * borrowed. */
int consume_metrics_create(consume_metrics **out, uv_loop_t *loop, const char *listen, const char *web_path,
                           const char *stream, const char *group, uint64_t down_ms, const outbox__logger *log,
                           char *err, size_t errlen);
/* Binds and serves c's figures; c must outlive the server. 0, or an error
 * with err (the port cannot be bound). */
int consume_metrics_start(consume_metrics *m, outbox_consumer *c, char *err, size_t errlen);
/* Closes every handle, then frees; cb (may be NULL) runs then. NULL is a
 * no-op (cb runs at once). */
void consume_metrics_close(consume_metrics *m, void (*cb)(void *data), void *data);

#endif
