/*
 * For the tools: src/util/settings.h, the rows of a settings table. The
 * relay's table (relay/settings_table.h) is written in them, and
 * outbox-relay reads its options, types and ranges from that table.
 */
#include "../../util/settings.h"
