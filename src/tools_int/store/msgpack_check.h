/*
 * For the tools: src/store/msgpack_check.h. outbox-replay show checks a
 * row's headers with it before decoding them, as the library does: the
 * bytes were written by anyone with plain SQL.
 */
#include "../../store/msgpack_check.h"
