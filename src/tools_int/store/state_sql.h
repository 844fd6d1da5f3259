/*
 * For the tools: src/store/state_sql.h, the fragments that derive a row's
 * state from the schema. relay/sql.h is written with them, so a tool that
 * runs the relay's SQL (outbox-bench's SQL floor) needs them too.
 */
#include "../../store/state_sql.h"
