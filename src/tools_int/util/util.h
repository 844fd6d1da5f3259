/*
 * For the tools: src/util/util.h, for the library's logger. outbox-relay,
 * outbox-consume and outbox-replay write their own lines with outbox__log()
 * (values quoted by outbox__logfmt_quote()) into the sink the library logs
 * to, so that their lines and the library's have one format.
 */
#include "../../util/util.h"
