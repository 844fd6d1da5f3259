/*
 * For the tools: src/util/array.h, the growable-array helper, which
 * outbox-bench uses for its samples and for whole files.
 */
#include "../../util/array.h"
