/*
 * cluster/target.h: the target of a Redis Cluster, and the factory that
 * picks the target for any URL (internal; the interface is redis/target.h).
 *
 * The factory is here, at the top of the Redis stack, because choosing
 * needs both implementations: redis/ (below) has the single node and
 * Sentinel one and must not know the cluster layer, which sits above it.
 * The relay and the consumer create their targets with
 * outbox__target_create() and then use redis/target.h only.
 */
#ifndef OUTBOX_SRC_CLUSTER_TARGET_H
#define OUTBOX_SRC_CLUSTER_TARGET_H

#include "redis/target.h"

/* A Cluster URL (url->cluster set): a target over the cluster layer
 * (cluster.h). url, opt and hooks copied. 0, OUTBOX_EINVAL, OUTBOX_ENOMEM.
 * Nothing connects before start. */
int outbox__target_cluster_create(outbox__target **out, uv_loop_t *loop, const outbox__redis_url *url,
                                  const outbox__target_options *opt, const outbox__target_hooks *hooks);

/* The target for url: a cluster's for a Cluster URL, else a single node's
 * or Sentinel's (outbox__target_node_create). Returns as those. */
int outbox__target_create(outbox__target **out, uv_loop_t *loop, const outbox__redis_url *url,
                          const outbox__target_options *opt, const outbox__target_hooks *hooks);

#endif
