/*
 * For the tools: src/ops/metrics.h, the Prometheus exposition helpers.
 * outbox-consume escapes its label values (stream, group) with
 * outbox__prom_label_value (tools/consume/metrics.c), as the relay does.
 */
#include "../../ops/metrics.h"
