/*
 * sentinel.h: finding the master of a Redis Sentinel deployment (internal).
 *
 * Discovery as the maintained clients do it: ask the sentinels of the URL in
 * turn `SENTINEL get-master-addr-by-name <master>`, starting with the one
 * that answered last; the first answer wins. The connection that answered
 * stays open and is subscribed to `+switch-master` (pipelined right behind
 * the question, so no switch between the answer and the subscription goes
 * unseen), and every switch of this master is reported at once. When that
 * connection is lost, or a ping on it is not answered, the sentinels are
 * asked again (and the answer reported again) with a backoff.
 *
 * One outbox__sentinel belongs to one rconn (rconn.c): the rconn asks with
 * outbox__sentinel_locate() before each connection attempt, connects to the
 * answer, checks ROLE, and follows the switches it is told about.
 *
 * Loop thread only. The object owns a timer and at most one connection;
 * outbox__sentinel_close() frees it once they are closed.
 */
#ifndef OUTBOX_SRC_SENTINEL_H
#define OUTBOX_SRC_SENTINEL_H

#include "util/util.h"
#include "redis/redis.h"

typedef struct outbox__sentinel outbox__sentinel;

/*
 * status 0: the master of the URL is at host:port (valid during the call),
 * either as the answer to a locate or because a sentinel announced a switch
 * (`switched` 1). Otherwise no sentinel answered (OUTBOX_ECONNECT,
 * OUTBOX_EAUTH, OUTBOX_EREDIS: none of them knows the master, ...) and
 * outbox__sentinel_errstr() says what each one did; host is NULL then.
 */
typedef void (*outbox__sentinel_cb)(outbox__sentinel *s, int status, const char *host, int port, int switched,
                                    void *data);

/* url must be a Sentinel URL (url->sentinel set); it is copied. opt gives the
 * connect timeout and, for rediss-sentinel://, the TLS configuration (a
 * reference is taken); replies from a sentinel wait at most 3 s. log
 * is borrowed. Creates a timer, no connection yet: close it with
 * outbox__sentinel_close(). Returns 0, OUTBOX_EINVAL or OUTBOX_ENOMEM. */
int outbox__sentinel_create(outbox__sentinel **out, uv_loop_t *loop, const outbox__redis_url *url,
                            const outbox__redis_options *opt, const outbox__logger *log, const char *what,
                            outbox__sentinel_cb cb, void *data);
/* Asks the sentinels again (dropping the current sentinel connection, if
 * any); cb follows once with the answer or the failure. A locate already
 * under way is not started again. */
void outbox__sentinel_locate(outbox__sentinel *s);
/* What the last round of questions met, "" if nothing failed; without
 * double quotes or newlines, fit for a log line's quoted field. */
const char *outbox__sentinel_errstr(const outbox__sentinel *s);
/* 1 when the last round failed and every sentinel of the URL answered it
 * with a refusal: the credentials refused, the master's name unknown, or an
 * error reply (a server that is not a sentinel). Asking again gets the same
 * answers until the sentinels or the URL are changed, unlike a round that
 * found a sentinel unreachable (0). */
int outbox__sentinel_refused(const outbox__sentinel *s);
/* Closes the connection and the timer; cb (may be NULL) runs once they are
 * closed and the object is freed. No sentinel callback follows. NULL is a
 * no-op. */
void outbox__sentinel_close(outbox__sentinel *s, void (*cb)(void *data), void *data);

/*
 * The smallest WAIT count that covers a failover of a master whose n
 * replicas have these replica-priority values (0: never promoted): an
 * entry that many replicas acknowledged is on the one Sentinel promotes.
 * Sentinel promotes among the replicas of the lowest non-zero priority the
 * one with the largest replication offset, so one acknowledgement from
 * that group is enough, and only a count of n - group + 1 is sure to
 * include one. *best_out (may be NULL) gets the group's size. 0 when no
 * replica can be promoted (no failover then).
 */
unsigned outbox__sentinel_wait_needed(const int *priority, size_t n, size_t *best_out);

/* A copy of url without its sentinel list, naming the node at host:port
 * with url's credentials and db. 0 or OUTBOX_ENOMEM. */
int outbox__sentinel_node_url(outbox__redis_url *out, const outbox__redis_url *url, const char *host, int port);

/*
 * outbox__redis_url_parse(), then the sentinels' own credentials (may be
 * NULL): they need a Sentinel URL ("sentinel_password needs a
 * redis-sentinel:// URL"). The relay, the consumer and the dedup module
 * parse their URLs with this. Returns as outbox__redis_url_parse, or
 * OUTBOX_EINVAL for credentials without a Sentinel URL.
 */
int outbox__sentinel_url_parse(const char *url, const char *sentinel_user, const char *sentinel_password,
                               outbox__redis_url *out, char *err, size_t errlen);

#endif
