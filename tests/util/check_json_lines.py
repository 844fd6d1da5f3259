#!/usr/bin/env python3
"""Checks log lines in JSON (--log-format json).

    check_json_lines.py FILE [PATTERN...]

Every line of FILE must be one JSON object whose ts, level and msg are
strings (ts as 2026-12-01T10:00:00.123Z, level one of debug, info, warn,
error), and every other value a string too. Each PATTERN is a JSON object
that at least one line must match: each of its keys with the same value, or,
for a value that starts with '~', a value that contains the rest. Prints what
is wrong and exits 1; prints the number of lines checked otherwise.
"""
import json
import re
import sys


def matches(line, pattern):
    for k, v in pattern.items():
        if k not in line:
            return False
        if v.startswith('~') and v[1:] in line[k]:
            continue
        if line[k] != v:
            return False
    return True


def main():
    lines = []
    bad = 0
    with open(sys.argv[1], encoding='utf-8', errors='strict') as f:
        text = f.read()
    for i, raw in enumerate(text.split('\n')[:-1] if text.endswith('\n') else text.split('\n'), 1):
        try:
            o = json.loads(raw)
        except ValueError as e:
            print('line %d is not JSON (%s): %r' % (i, e, raw))
            bad += 1
            continue
        if not isinstance(o, dict):
            print('line %d is not an object: %r' % (i, raw))
            bad += 1
            continue
        problems = [k for k in ('ts', 'level', 'msg') if not isinstance(o.get(k), str)]
        problems += [k for k, v in o.items() if not isinstance(v, str)]
        if not re.match(r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$', o.get('ts') or ''):
            problems.append('ts')
        if o.get('level') not in ('debug', 'info', 'warn', 'error'):
            problems.append('level')
        if problems:
            print('line %d: bad %s: %r' % (i, ', '.join(problems), raw))
            bad += 1
        lines.append(o)
    for p in sys.argv[2:]:
        pattern = json.loads(p)
        if not any(matches(o, pattern) for o in lines):
            print('no line matches %s' % p)
            bad += 1
    if not lines:
        print('no lines')
        bad += 1
    print('%d lines checked' % len(lines))
    sys.exit(1 if bad else 0)


if __name__ == '__main__':
    main()
