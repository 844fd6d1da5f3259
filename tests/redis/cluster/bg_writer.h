/*
 * bg_writer.h: a writer that keeps committing outbox rows while a test
 * changes the cluster under the relay (its own SQLite connection, its own
 * thread): every 5 ms, 4 rows per topic.
 */
#ifndef OUTBOX_TESTS_CLUSTER_BG_WRITER_H
#define OUTBOX_TESTS_CLUSTER_BG_WRITER_H

#include <pthread.h>
#include <stdatomic.h>

typedef struct bg_writer {
    const char *dbpath;         /* borrowed */
    const char *const *topics;  /* borrowed, ntopics of them */
    int ntopics;
    int keyed;                  /* every second topic's rows keyed over 5 keys */
    const char *id_suffix;      /* row ids are <topic><suffix><n> */
    atomic_int stop;
    int rounds;
    pthread_t thread;
} bg_writer;

/* Starts the thread (bails out if it cannot). */
void bg_writer_start(bg_writer *w, const char *dbpath, const char *const *topics, int ntopics, int keyed,
                     const char *id_suffix);
/* Stops and joins it; returns how many rows it committed. */
int bg_writer_stop(bg_writer *w);

#endif
