/*
 * dedup.h: what the consumer-group helper needs of the dedup module beyond
 * consumer.h (internal).
 */
#ifndef OUTBOX_SRC_DEDUP_H
#define OUTBOX_SRC_DEDUP_H

#include "outbox/consumer.h"
#include "tls/tls.h"

/* outbox_dedup_create() with a TLS configuration the caller already built
 * (a reference is taken; s->tls is then not read). tls NULL: exactly
 * outbox_dedup_create(). */
int outbox__dedup_create_shared(outbox_dedup **out, uv_loop_t *loop, const outbox_dedup_settings *s,
                                outbox__tls_config *tls, char *err, size_t errlen);

#endif
