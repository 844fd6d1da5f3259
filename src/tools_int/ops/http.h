/*
 * For the tools: src/ops/http.h, the metrics endpoint's server.
 * outbox-consume serves /metrics and /healthz with it (tools/consume/
 * metrics.c), with the same accept policy, TLS and authentication as the
 * relay's endpoint.
 */
#include "../../ops/http.h"
