/*
 * For the tools: src/relay/sql.h, the relay's SQL. outbox-bench's SQL floor
 * (tools/bench/sqlpath.c) runs the same statements, so that the floor
 * always measures what the relay executes.
 */
#include "../../relay/sql.h"
