/*
 * For the tools: src/relay/settings_table.h, the relay's settings as a
 * table. outbox-relay (tools/relay/config.c) makes its options, environment
 * variables, INI keys and --help from it, so that an option is written once.
 */
#include "../../relay/settings_table.h"
