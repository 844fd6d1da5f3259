/*
 * For the tools: src/tls/tls.h, needed by src/ops/web_config.h (the web
 * configuration's TLS server configuration), which outbox-consume reads.
 */
#include "../../tls/tls.h"
