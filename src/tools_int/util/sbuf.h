/*
 * For the tools: src/util/sbuf.h, the growable string buffer. The JSON
 * writer (tools/common), outbox-replay and outbox-consume build their output
 * in it, and outbox-bench its reports.
 */
#include "../../util/sbuf.h"
