/*
 * fake_node.h: scripted Redis Cluster nodes for the redirection tests.
 *
 * A set of up to 4 nodes, each a TCP listener on 127.0.0.1 (a free port),
 * served by one thread with blocking sockets and poll(). Each node answers
 * by its script: for a command name (or "NAME ARG", as "CLUSTER SLOTS"), a list of replies used in turn (the
 * last one again and again), written as RESP with "%0".."%3" standing for
 * the ports of nodes 0..3 ("-MOVED 12182 127.0.0.1:%1\r\n"). Without a rule:
 * PING -> +PONG, CLUSTER SHARDS -> an error (so that the client falls back
 * to CLUSTER SLOTS), CLUSTER SLOTS -> every slot on node 0, anything else
 * -> +OK. Every command received is logged as "n<node>:<NAME> <arg1>" in
 * one sequence for the whole set, in arrival order.
 */
#ifndef OUTBOX_TESTS_CLUSTER_FAKE_NODE_H
#define OUTBOX_TESTS_CLUSTER_FAKE_NODE_H

typedef struct fake_nodes fake_nodes;

/* Starts n nodes (1..4); bails out on failure. */
fake_nodes *fake_nodes_start(int n);
int fake_nodes_port(const fake_nodes *f, int node);
/* Adds a rule before any client connects (or between runs: the lock is
 * taken). replies: NULL-terminated. */
void fake_nodes_rule(fake_nodes *f, int node, const char *command, const char *const *replies);
/* Makes a node close every connection and refuse new ones (it stops
 * listening): a node that disappeared. */
void fake_nodes_kill(fake_nodes *f, int node);
/* The log so far, commands separated by "|" (CLIENT, PING and CLUSTER
 * are left out), malloc'd. */
char *fake_nodes_log(fake_nodes *f);
/* Clears the log and the rules' positions. */
void fake_nodes_reset(fake_nodes *f);
/* How many commands named command node received. */
int fake_nodes_count(fake_nodes *f, int node, const char *command);
void fake_nodes_stop(fake_nodes *f);

#endif
