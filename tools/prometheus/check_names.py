#!/usr/bin/env python3
"""Checks that the alert rules and the Grafana dashboard query what the relay
serves, and that the dashboard shows all of it.

    check_names.py --metrics SCRAPE RULES.yml DASHBOARD.json

SCRAPE is a /metrics scrape of a running relay (tests/ops/test_promtool.c
takes one). Every metric name of the form outbox_... in a rule or panel
expression must be a sample name of the scrape or a recording rule of
RULES; every family of the scrape must appear in some dashboard panel; the
dashboard must be valid JSON whose panels each have a title and a
description (what the panel answers, as README.md's table says). Prints
each problem and exits 1 if there is one. No YAML library needed: the rule
expressions are read line by line (the file's own layout: `expr:` with the
expression on that line or on the indented lines after it).
"""
import json
import re
import sys

NAME = re.compile(r"\b(outbox(?:_|:)[A-Za-z0-9_:]*)")


def scrape_names(path):
    samples, families = set(), set()
    with open(path) as f:
        for line in f:
            if line.startswith("# TYPE "):
                families.add(line.split()[2])
            elif line.strip() and not line.startswith("#"):
                samples.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return samples, families


def rule_exprs(path):
    records, exprs = set(), []
    lines = open(path).read().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(?:- )?(record|expr):\s*(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3).strip()
        if key == "record":
            records.add(rest)
            i += 1
            continue
        text = [] if rest in (">-", ">", "|", "|-") else [rest]
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent + 2):
            text.append(lines[i].strip())
            i += 1
        exprs.append(" ".join(text))
    return records, exprs


def dashboard_panels(path, problems):
    with open(path) as f:
        dash = json.load(f)
    out = []

    def walk(panels):
        for p in panels:
            if p.get("type") == "row":
                walk(p.get("panels", []))
                continue
            if not p.get("title"):
                problems.append("dashboard: a panel without a title (id %s)" % p.get("id"))
            if not p.get("description"):
                problems.append("dashboard: panel %r has no description" % p.get("title"))
            exprs = [t.get("expr", "") for t in p.get("targets", [])]
            if not exprs:
                problems.append("dashboard: panel %r has no query" % p.get("title"))
            out.append((p.get("title"), exprs))

    walk(dash.get("panels", []))
    return out


def main(argv):
    if len(argv) != 5 or argv[1] != "--metrics":
        sys.stderr.write(__doc__)
        return 2
    samples, families = scrape_names(argv[2])
    records, rexprs = rule_exprs(argv[3])
    problems = []
    panels = dashboard_panels(argv[4], problems)
    if not samples:
        problems.append("%s: no samples" % argv[2])
    if not rexprs:
        problems.append("%s: no rule expressions found" % argv[3])
    known = samples | records
    for e in rexprs:
        for n in NAME.findall(e):
            if n not in known:
                problems.append("rules: %s is neither served by the relay nor a recording rule (in: %s)" % (n, e))
    used = set()
    for title, exprs in panels:
        for e in exprs:
            for n in NAME.findall(e):
                used.add(n)
                if n not in known:
                    problems.append("dashboard: panel %r queries %s, which the relay does not serve" % (title, n))
    for fam in sorted(families):
        if not any(u == fam or (u.startswith(fam + "_") and u[len(fam) + 1:] in ("bucket", "sum", "count"))
                   for u in used):
            problems.append("dashboard: no panel shows %s" % fam)
    for p in problems:
        print(p)
    print("%d rule expressions, %d panels, %d families: %s" %
          (len(rexprs), len(panels), len(families), "ok" if not problems else "%d problems" % len(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
