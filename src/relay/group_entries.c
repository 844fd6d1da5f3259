/*
 * group_entries.c: a group's entries (struct gdb, group_int.h), one per
 * database: added, found by name and by path through a hash of each (a
 * directory's event names a file, and every write of an open database is
 * one), dropped, freed. Loop thread.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "group_int.h"

/* FNV-1a, masked to the buckets. */
static size_t bucket(const outbox_relay_group *g, const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return (size_t)h & (g->nbuckets - 1);
}

gdb *outbox__group_find_path(const outbox_relay_group *g, const char *path)
{
    gdb *d = g->nbuckets ? g->by_path[bucket(g, path)] : NULL;
    while (d && strcmp(d->path, path) != 0)
        d = d->path_next;
    return d;
}

gdb *outbox__group_find_name(const outbox_relay_group *g, const char *name)
{
    gdb *d = g->nbuckets ? g->by_name[bucket(g, name)] : NULL;
    while (d && strcmp(d->name, name) != 0)
        d = d->name_next;
    return d;
}

static void hash_insert(outbox_relay_group *g, gdb *d)
{
    size_t p = bucket(g, d->path), n = bucket(g, d->name);
    d->path_next = g->by_path[p];
    g->by_path[p] = d;
    d->name_next = g->by_name[n];
    g->by_name[n] = d;
}

static void hash_remove(outbox_relay_group *g, gdb *d)
{
    gdb **pp = &g->by_path[bucket(g, d->path)], **np = &g->by_name[bucket(g, d->name)];
    while (*pp && *pp != d)
        pp = &(*pp)->path_next;
    if (*pp)
        *pp = d->path_next;
    while (*np && *np != d)
        np = &(*np)->name_next;
    if (*np)
        *np = d->name_next;
}

/* Room for n entries in the hash: rebuilt at twice the size when full. */
static int hash_reserve(outbox_relay_group *g, size_t n)
{
    size_t cap = g->nbuckets ? g->nbuckets : 64;
    gdb **bp, **bn;
    if (n <= g->nbuckets)
        return 0;
    while (cap < n)
        cap *= 2;
    bp = calloc(cap, sizeof *bp);
    bn = calloc(cap, sizeof *bn);
    if (!bp || !bn) {
        free(bp);
        free(bn);
        return OUTBOX_ENOMEM;
    }
    free(g->by_path);
    free(g->by_name);
    g->by_path = bp;
    g->by_name = bn;
    g->nbuckets = cap;
    for (size_t i = 0; i < g->ndbs; i++)
        hash_insert(g, g->dbs[i]);
    return 0;
}

static void free_gdb(gdb *d)
{
    free(d->name);
    free(d->path);
    free(d);
}

/* Drops an entry that has nothing running (not open, probing or queued). */
void outbox__group_drop(gdb *d)
{
    outbox_relay_group *g = d->g;
    for (size_t i = 0; i < g->ndbs; i++)
        if (g->dbs[i] == d) {
            g->dbs[i] = g->dbs[--g->ndbs];
            hash_remove(g, d);
            break;
        }
    GLOG(g, OUTBOX_LOG_INFO, "msg=\"database dropped\" database=%s", d->name);
    free_gdb(d);
}

/* The database leaves the group (its file went away, or remove): its relay
 * stops first; one queued, probing or closing is dropped once that ends. */
void outbox__group_leave(gdb *d)
{
    d->gone = 1;
    if (d->state == G_OPEN)
        outbox__group_close_db(d);
    else if (d->state == G_IDLE || d->state == G_FAILED || d->state == G_NOSCHEMA)
        outbox__group_drop(d);
}

gdb *outbox__group_add_entry(outbox_relay_group *g, const char *name, const char *path, int *e)
{
    gdb *d;
    const char *slash;
    if (outbox__group_find_name(g, name)) {
        *e = OUTBOX_EDUPLICATE;
        return NULL;
    }
    if (g->ndbs == g->capdbs) {
        size_t cap = g->capdbs ? g->capdbs * 2 : 64;
        gdb **n = realloc(g->dbs, cap * sizeof *n);
        if (!n) {
            *e = OUTBOX_ENOMEM;
            return NULL;
        }
        g->dbs = n;
        g->capdbs = cap;
    }
    if (hash_reserve(g, g->ndbs + 1) != 0) {
        *e = OUTBOX_ENOMEM;
        return NULL;
    }
    d = calloc(1, sizeof *d);
    if (!d || !(d->name = strdup(name)) || !(d->path = strdup(path))) {
        if (d)
            free_gdb(d);
        *e = OUTBOX_ENOMEM;
        return NULL;
    }
    d->g = g;
    slash = strrchr(path, '/');
    d->dirlen = slash ? (size_t)(slash - path) : 0;
    d->state = G_IDLE;
    d->work.data = d;
    g->dbs[g->ndbs++] = d;
    hash_insert(g, d);
    *e = 0;
    return d;
}

void outbox__group_entries_free(outbox_relay_group *g)
{
    for (size_t i = 0; i < g->ndbs; i++)
        free_gdb(g->dbs[i]);
    free(g->dbs);
    free(g->by_path);
    free(g->by_name);
    g->dbs = NULL;
    g->by_path = g->by_name = NULL;
    g->ndbs = g->capdbs = g->nbuckets = 0;
}
