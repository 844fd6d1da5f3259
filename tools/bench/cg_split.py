#!/usr/bin/env python3
"""Splits a callgrind profile of the relay daemon into instructions inside
SQLite and outside it, and counts allocations made outside SQLite, per
message (docs/BENCHMARKS.md, "The relay's work per message").

    OUTBOX_BENCH_WRAP="valgrind --tool=callgrind --callgrind-out-file=relay.cg --" \\
        build/tools/bench/outbox-bench drain --messages 20000
    tools/bench/cg_split.py 20000 relay.cg [more.cg ...]

Inside SQLite is the inclusive cost of every call from code outside
libsqlite3 into it (so SQLite's own malloc, memcpy and memset count as
SQLite's); outside is the rest of the program's total, start-up included.
"""
import collections
import re
import sys

ALLOC = ("malloc", "calloc", "realloc")


def split(path):
    names = {"ob": {}, "fn": {}, "fl": {}}

    def name(kind, v):
        m = re.match(r"\((\d+)\)(?: (.*))?", v)
        if not m:
            return v
        if m.group(2) is not None:
            names[kind][m.group(1)] = m.group(2)
        return names[kind].get(m.group(1), "?")

    total = inside = 0
    ob = fn = cob = cfn = None
    in_call = False
    allocs = collections.Counter()
    for line in open(path):
        line = line.rstrip("\n")
        key, _, val = line.partition("=")
        if key == "ob":
            ob = name("ob", val)
        elif key == "fn":
            fn, cob = name("fn", val), None
        elif key == "cob":
            cob = name("ob", val)
        elif key == "cfn":
            cfn = name("fn", val)
        elif key in ("fl", "fi", "fe", "cfi", "cfl"):
            name("fl", val)
        elif key == "calls":
            in_call = True
            if cfn in ALLOC and fn not in ALLOC and "libsqlite3" not in (ob or ""):
                allocs[fn] += int(val.split()[0])
        elif line.startswith(("summary:", "totals:")):
            total = int(line.split()[1])
        elif line[:1].isdigit() or line[:1] in "+-*":
            parts = line.split()
            if in_call and len(parts) > 1:
                callee = cob if cob is not None else ob
                if "libsqlite3" in (callee or "") and "libsqlite3" not in (ob or ""):
                    inside += int(parts[1])
                in_call, cob = False, None
    return total, inside, allocs


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: cg_split.py MESSAGES FILE.cg...")
    n = int(sys.argv[1])
    for path in sys.argv[2:]:
        total, inside, allocs = split(path)
        top = ", ".join("%s %.2f" % (k, v / n) for k, v in allocs.most_common(4))
        print("%s: %.0f Ir/msg, inside SQLite %.0f, outside %.0f; %.2f allocations/msg outside SQLite (%s)"
              % (path, total / n, inside / n, (total - inside) / n, sum(allocs.values()) / n, top))


if __name__ == "__main__":
    main()
