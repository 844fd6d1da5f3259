/*
 * For the tools: src/util/str.h, the UTF-8 checks. The JSON writer
 * (tools/common) and outbox-replay (its filters and output) decide what is
 * text by the rules the writer applies to keys; util/util.h includes it.
 */
#include "../../util/str.h"
