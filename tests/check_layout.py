#!/usr/bin/env python3
"""The library's layout: each folder of src/ includes only the folders below
it, and no files of two folders call each other. Reads the sources' include
lines and, given an object directory, the objects' symbols. Prints what is
wrong and exits 1; prints the circles of files that call each other (inside
one folder) either way."""
import collections, glob, os, re, subprocess, sys

# Each folder and the folders it may include or call: the order of the tree.
BELOW = {
    'util': set(),
    'tls': {'util'},
    'store': {'util'},
    'redis': {'util', 'tls'},
    'redis/cluster': {'util', 'tls', 'redis'},
    'ops': {'util', 'tls'},
    'consumer': {'util', 'tls', 'store', 'redis', 'redis/cluster', 'ops'},
    'relay': {'util', 'tls', 'store', 'redis', 'redis/cluster', 'ops'},
}
# Circles of files that call each other on purpose (docs/ARCHITECTURE.md).
INTENDED = [
    {'redis/redis.c', 'redis/conn.c', 'redis/io.c'},
    {'redis/cluster/cluster.c', 'redis/cluster/map.c'},
    {'ops/http.c', 'ops/http_conn.c', 'ops/http_auth.c'},
    {'relay/group.c', 'relay/group_entries.c', 'relay/group_relay.c', 'relay/group_watch.c', 'relay/group_ops.c'},
]

src = sys.argv[1]
objdir = sys.argv[2] if len(sys.argv) > 2 else None
bad = []

def folder(path):
    d = os.path.dirname(path)
    return d if d in BELOW else None

files = sorted(os.path.relpath(p, src) for p in glob.glob(os.path.join(src, '**', '*.[ch]'), recursive=True))
for f in files:
    if f.startswith('tools_int/'):
        continue
    here = folder(f)
    if here is None:
        bad.append('%s: not in a subsystem folder (%s)' % (f, ', '.join(sorted(BELOW))))
        continue
    for n, line in enumerate(open(os.path.join(src, f)), 1):
        m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
        if not m or m.group(1).startswith('outbox'):
            continue
        inc = m.group(1)
        target = inc if '/' in inc else os.path.join(here, inc)
        there = folder(os.path.normpath(target))
        if there is None:
            if os.path.exists(os.path.join(src, here, inc)) or inc.endswith('_sql.c'):
                continue
            bad.append('%s:%d: includes "%s", which is in no subsystem folder' % (f, n, inc))
        elif there != here and there not in BELOW[here]:
            bad.append('%s:%d: includes "%s": %s is not below %s' % (f, n, inc, there, here))

circles = []
if objdir:
    defs, uses = {}, collections.defaultdict(set)
    def name(o):
        base = os.path.basename(o)[:-len('.o')]
        for f in files:
            if f.endswith('.c') and f.replace('/', '_') == base:
                return f
        return base
    for o in glob.glob(os.path.join(objdir, '*.o')):
        n = name(o)
        for line in subprocess.run(['nm', o], capture_output=True, text=True, check=True).stdout.splitlines():
            p = line.split()
            if len(p) == 3 and p[1] in 'TDBR':
                defs[p[2]] = n
            elif len(p) == 2 and p[0] == 'U':
                uses[n].add(p[1])
    graph = collections.defaultdict(set)
    for f, us in uses.items():
        for u in us:
            if u in defs and defs[u] != f:
                graph[f].add(defs[u])
    for f, ts in sorted(graph.items()):
        for t in sorted(ts):
            a, b = folder(f), folder(t)
            if a and b and a != b and b not in BELOW[a]:
                bad.append('%s calls %s: %s is not below %s' % (f, t, b, a))
    index, low, stack, on, counter = {}, {}, [], set(), [0]
    sys.setrecursionlimit(10000)
    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(comp)
    for v in sorted(set(graph) | {t for ts in graph.values() for t in ts}):
        if v not in index:
            visit(v)
    for c in circles:
        print('circle: %s%s' % (' '.join(sorted(c)), '' if c in INTENDED else '  (not intended)'))
        if c not in INTENDED:
            bad.append('files that call each other: ' + ' '.join(sorted(c)))
for b in bad:
    print(b)
print('%d files, %d circles (%d intended), %d problems' % (len(files), len(circles), sum(c in INTENDED for c in circles), len(bad)))
sys.exit(1 if bad else 0)
