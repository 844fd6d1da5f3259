/*
 * settings.c: the relay's settings, their defaults and their checks.
 */
#include <string.h>

#include "relay_int.h"
#include "outbox/writer.h"

void outbox_relay_defaults(outbox_relay_settings *s)
{
    memset(s, 0, sizeof *s);
    s->stream_prefix = "outbox:";
    s->batch = 512;
    s->inflight = 8192;
    s->lease_ms = 30000;
    s->scan_interval_ms = 1000;
    s->max_attempts = 10;
    s->backoff_min_ms = 500;
    s->backoff_max_ms = 60000;
    s->maxlen = 0;
    s->max_payload = OUTBOX_PAYLOAD_DEFAULT_MAX;
    s->shutdown_timeout_ms = 10000;
    s->wait_replicas = 0;
    s->wait_timeout_ms = 1000;
    s->connect_timeout_ms = 5000;
    s->reply_timeout_ms = 10000;
    s->log = outbox_log_stderr;
    s->log_level = OUTBOX_LOG_INFO;
    s->idempotent = 0;
    s->idempotent_retention_ms = 3600000;
    s->health_redis_down_ms = 30000;
    s->retention_ms = 86400000;
    s->retention_batch = 1000;
}

int outbox__relay_check_settings(const outbox_relay_settings *s, char *err, size_t errlen)
{
    if (!s->db_path || !*s->db_path)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "db: no database path given");
    if (!s->redis_url || !*s->redis_url)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "redis: no Redis URL given");
    if (s->batch < 1 || s->batch > 100000)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "batch: %u is out of range 1..100000", s->batch);
    if (s->inflight < 1 || s->inflight > 1000000)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "inflight: %u is out of range 1..1000000", s->inflight);
    if (s->lease_ms < 1000 || s->lease_ms > 86400000ull)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "lease-ms: %llu is out of range 1000..86400000",
                            (unsigned long long)s->lease_ms);
    if (s->scan_interval_ms < 1 || s->scan_interval_ms > 3600000ull)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "scan-interval-ms: %llu is out of range 1..3600000",
                            (unsigned long long)s->scan_interval_ms);
    if (s->max_attempts < 1 || s->max_attempts > 1000000)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "max-attempts: %u is out of range 1..1000000", s->max_attempts);
    if (s->backoff_min_ms < 1 || s->backoff_min_ms > s->backoff_max_ms || s->backoff_max_ms > 86400000ull)
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "backoff-min-ms/backoff-max-ms: need 1 <= min (%llu) <= max (%llu) <= 86400000",
                            (unsigned long long)s->backoff_min_ms, (unsigned long long)s->backoff_max_ms);
    if (!s->stream_prefix || strlen(s->stream_prefix) > 128 || strpbrk(s->stream_prefix, "{} \t\r\n"))
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "stream-prefix: must be at most 128 bytes without braces or spaces");
    if (s->max_payload < 1 || s->max_payload > OUTBOX_PAYLOAD_HARD_MAX)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "max-payload: %zu is out of range 1..%d", s->max_payload,
                            OUTBOX_PAYLOAD_HARD_MAX);
    if (s->shutdown_timeout_ms > 3600000ull)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "shutdown-timeout-ms: %llu is out of range 0..3600000",
                            (unsigned long long)s->shutdown_timeout_ms);
    if (s->wait_replicas > 100)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "wait-replicas: %u is out of range 0..100", s->wait_replicas);
    if (s->wait_replicas && (s->wait_timeout_ms < 1 || s->wait_timeout_ms >= s->lease_ms / 2))
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "wait-timeout-ms: %llu must be at least 1 and below half of lease-ms",
                            (unsigned long long)s->wait_timeout_ms);
    /* WAIT is only sent with wait_replicas; without it its timeout does not
     * delay a reply. */
    if (s->reply_timeout_ms < 1 ||
        s->reply_timeout_ms + (s->wait_replicas ? s->wait_timeout_ms : 0) >= s->lease_ms)
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "reply timeout %llu ms (plus wait-timeout-ms) must be below lease-ms %llu, so that "
                            "a stuck connection is given up before its leases expire",
                            (unsigned long long)s->reply_timeout_ms, (unsigned long long)s->lease_ms);
    if (s->connect_timeout_ms < 1)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "connect timeout must be at least 1 ms");
    if (s->worker_id && (!*s->worker_id || strlen(s->worker_id) > 200))
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "worker-id: must be 1..200 bytes");
    if ((unsigned)s->log_level > OUTBOX_LOG_ERROR)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "log-level: unknown level %d", (int)s->log_level);
    if (s->idempotent && (s->idempotent_retention_ms < 1000 || s->idempotent_retention_ms > 30ull * 86400000))
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "idempotent-retention-ms: %llu is out of range 1000..2592000000",
                            (unsigned long long)s->idempotent_retention_ms);
    if (s->idempotent && s->wait_replicas)
        return outbox__errf(err, errlen, OUTBOX_EINVAL,
                            "idempotent and wait-replicas cannot be combined in this version");
    if (s->metrics_listen) {
        struct sockaddr_storage ss;
        char why[200];
        if (outbox__http_parse_listen(s->metrics_listen, &ss, why, sizeof why) != 0)
            return outbox__errf(err, errlen, OUTBOX_EINVAL, "metrics-listen: %s", why);
    }
    if (s->health_redis_down_ms < 1)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "health-redis-down-ms: must be at least 1");
    if (s->retention_ms && s->retention_ms < 1000)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "retention-ms: %llu is below 1000 (0 keeps published rows)",
                            (unsigned long long)s->retention_ms);
    if (s->retention_batch < 1 || s->retention_batch > 100000)
        return outbox__errf(err, errlen, OUTBOX_EINVAL, "retention-batch: %u is out of range 1..100000",
                            s->retention_batch);
    return 0;
}
