/*
 * For the tools: src/ops/web_config.h, the metrics endpoint's web
 * configuration file (TLS and Basic authentication). outbox-consume reads
 * --metrics-web-config with it, as outbox-relay does.
 */
#include "../../ops/web_config.h"
