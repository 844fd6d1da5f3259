/*
 * settings_table.h: the consumer-group helper's settings
 * (outbox_consumer_settings in outbox/consumer.h), each written once, as one
 * row of a table, like the relay's (relay/settings_table.h; the row's
 * format is util/settings.h's).
 *
 * OUTBOX__CONSUMER_SETTINGS(X) calls
 *     X(name, type, field, flags, def, min, max, help)
 * once per setting:
 *   name   the setting as messages name it (outbox-consume's option without
 *          the dashes)
 *   type   STR, UINT, U64, FLAG or LEVEL (util/settings.h)
 *   field  the member of outbox_consumer_settings
 *   flags  0 or OUTBOX__OPT_REQUIRED (must be given)
 *   def    the default, as outbox_consumer_defaults() sets it
 *   min, max  a number's range; a string's length in bytes when given (both
 *          0: any length)
 *   help   what it is, one phrase
 *
 * From it come outbox_consumer_defaults() and the checks of
 * outbox_consumer_create() (consumer/settings.c); what depends on another
 * setting (the dedup mode and what it needs, the dedup namespace's default)
 * stays code there. The callbacks, the TLS settings and the sentinels'
 * credentials are no rows: their checks are the handler's presence and the
 * URL and TLS set-up (redis/target.h).
 */
#ifndef OUTBOX_SRC_CONSUMER_SETTINGS_TABLE_H
#define OUTBOX_SRC_CONSUMER_SETTINGS_TABLE_H

#include <stdint.h>

#include "outbox/consumer.h"
#include "util/settings.h"

#define OUTBOX__CONSUMER_DAY_MS (24ull * 3600 * 1000)

#define OUTBOX__CONSUMER_SETTINGS(X)                                                                                  \
    X("redis", STR, redis_url, OUTBOX__OPT_REQUIRED, NULL, 0, 0, "the Redis URL (any form consumer.h names)")       \
    X("stream", STR, stream, OUTBOX__OPT_REQUIRED, NULL, 1, 256, "the full stream name")                              \
    X("group", STR, group, OUTBOX__OPT_REQUIRED, NULL, 1, 200, "the consumer group")                                  \
    X("consumer", STR, consumer, 0, NULL, 1, 200, "this consumer's name in the group (default <hostname>:<pid>)")    \
    X("inbox", STR, inbox_db_path, 0, NULL, 0, 0, "the SQLite inbox database (SQLite dedup mode)")                   \
    X("namespace", STR, key_namespace, 0, NULL, 0, 0, "the Redis dedup keys' namespace (default dedup:<group>)")     \
    X("dedup-lease-ms", U64, dedup_lease_ms, 0, 30000, 1, UINT64_MAX / 2, "the Redis dedup processing lease")        \
    X("dedup-retention-ms", U64, dedup_retention_ms, 0, 7 * OUTBOX__CONSUMER_DAY_MS, 1, UINT64_MAX / 2,              \
      "how long a Redis DONE marker is kept")                                                                        \
    X("inbox-retention-ms", U64, inbox_retention_ms, 0, 7 * OUTBOX__CONSUMER_DAY_MS, 1, UINT64_MAX / 2,              \
      "how long an inbox row is kept")                                                                               \
    X("batch", UINT, batch, 0, 100, 1, 10000, "XREADGROUP COUNT")                                                    \
    X("max-inflight", UINT, max_inflight, 0, 100, 1, 100000, "handlers running at once, at most")                     \
    X("block-ms", U64, block_ms, 0, 2000, 1, UINT64_MAX / 4, "XREADGROUP BLOCK")                                     \
    X("min-idle-ms", U64, min_idle_ms, 0, 60000, 1, UINT64_MAX / 2, "XAUTOCLAIM's idle time")                        \
    X("claim-interval-ms", U64, claim_interval_ms, 0, 5000, 1, UINT64_MAX / 2, "how often to look for idle entries")   \
    X("max-deliveries", UINT, max_deliveries, 0, 5, 1, UINT32_MAX, "deliveries before <stream>:dead")                 \
    X("retry-ms", U64, retry_ms, 0, 1000, 1, UINT64_MAX / 2, "the delay before an entry is retried")                  \
    X("drain", FLAG, drain, 0, 0, 0, 0, "call on_drained once nothing new and nothing pending is left")              \
    X("log-level", LEVEL, log_level, 0, OUTBOX_LOG_INFO, OUTBOX_LOG_DEBUG, OUTBOX_LOG_ERROR, "the lowest level logged")

extern const outbox__option outbox__consumer_options[];
extern const size_t outbox__consumer_noptions;

/* The table's checks, then those between settings (the dedup mode and what
 * it needs, the dedup namespace, the handler): 0, or OUTBOX_EINVAL with err
 * naming the setting. */
int outbox__consumer_check_settings(const outbox_consumer_settings *s, char *err, size_t errlen);

#endif
