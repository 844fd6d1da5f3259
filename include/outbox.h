/*
 * outbox.h: everything of liboutbox. See the individual headers; each one
 * documents ownership, threads and the error codes of its functions.
 */
#ifndef OUTBOX_H
#define OUTBOX_H

#include "outbox/common.h"
#include "outbox/consumer.h"
#include "outbox/envelope.h"
#include "outbox/relay.h"
#include "outbox/schema.h"
#include "outbox/tls.h"
#include "outbox/writer.h"

#endif
