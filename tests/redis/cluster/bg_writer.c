/* bg_writer.c: see bg_writer.h. */
#include "bg_writer.h"

#include <stdio.h>

#include "harness.h"
#include "rt.h"
#include "tap.h"

static void *writer_main(void *arg)
{
    bg_writer *bw = arg;
    sqlite3 *w = rt_open(bw->dbpath);
    for (bw->rounds = 0; !atomic_load(&bw->stop); bw->rounds++) {
        for (int i = 0; i < bw->ntopics; i++) {
            char prefix[128];
            snprintf(prefix, sizeof prefix, "%s%s", bw->topics[i], bw->id_suffix);
            rt_insert_rows(w, prefix, bw->rounds * 4, 4, bw->topics[i], bw->keyed && i % 2 == 0 ? 5 : 0);
        }
        th_sleep_ms(5);
    }
    sqlite3_close(w);
    return NULL;
}

void bg_writer_start(bg_writer *w, const char *dbpath, const char *const *topics, int ntopics, int keyed,
                     const char *id_suffix)
{
    w->dbpath = dbpath;
    w->topics = topics;
    w->ntopics = ntopics;
    w->keyed = keyed;
    w->id_suffix = id_suffix;
    w->rounds = 0;
    atomic_store(&w->stop, 0);
    if (pthread_create(&w->thread, NULL, writer_main, w) != 0)
        bail("pthread_create");
}

int bg_writer_stop(bg_writer *w)
{
    atomic_store(&w->stop, 1);
    pthread_join(w->thread, NULL);
    return w->rounds * 4 * w->ntopics;
}
