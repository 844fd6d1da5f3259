#!/usr/bin/env python3
"""Builds a man page from its template and a program's --help.

    mkman.py TEMPLATE OUTPUT VERSION PROGRAM

The template is roff with the hand-written sections (NAME, SYNOPSIS,
DESCRIPTION, EXIT STATUS, ...). @VERSION@ becomes VERSION, and a line

    @LIST Heading@             the items of --help's block "Heading" as .TP
    @KEYS Heading -opt ...@    the same items as INI keys (NAME = VALUE, with
                               the environment variable OUTBOX_<NAME>),
                               leaving out the options named after '-'

becomes the entries of that block of `PROGRAM --help`. The option lists are
thereby written once, in the program (for outbox-relay in its settings
table), and the page cannot drift from --help; tests/man_pages.sh renders the
pages and compares them with --help all the same.

A block of --help is a line at column 0 whose first word is its heading, then
lines indented by two spaces up to the next blank line: an item is a term
(an option and its value in capitals, or a subcommand followed by two
spaces) and its text, continued on lines indented further. Any other
two-space line is a paragraph of the block, not an item.
"""
import re
import subprocess
import sys


def parse_help(text):
    """{heading: [(term, text), ...]} of the blocks of a --help text."""
    blocks = {}
    items = None
    item = None
    for line in text.split('\n'):
        if not line.strip():
            items = None
            item = None
            continue
        if not line.startswith(' '):
            # A heading, unless it continues one (no item yet).
            if items is None or items:
                items = blocks.setdefault(re.split(r'[\s(:]', line, 1)[0], [])
            item = None
            continue
        if items is None:
            continue
        # An option's term is its flags and a value in capitals; a gap of
        # one space can end it when it fills its column.
        m = (re.match(r'^  (-[^\s,]+(?:, -[^\s,]+)*(?: [A-Z][A-Z0-9_:]*)?)(?:\s+(\S.*))?$', line) or
             re.match(r'^  ([^\s-].*?)\s{2,}(\S.*)$', line))
        if m:
            item = [m.group(1), m.group(2) or '']
            items.append(item)
        elif item is not None and re.match(r'^ {3,}\S', line):
            item[1] = (item[1] + ' ' + line.strip()).strip()
        else:
            item = None  # a paragraph of the block
    return {h: [tuple(i) for i in v] for h, v in blocks.items() if v}


def roff(s):
    """Text escaped for roff: backslashes, minus signs, leading dots."""
    s = s.replace('\\', '\\e').replace('-', '\\-')
    return re.sub(r'^([.\'])', r'\\&\1', s)


def term_roff(term):
    """--name VALUE as bold option, italic value: \\fB\\-\\-name\\fR \\fIVALUE\\fR."""
    out = []
    for word in term.split(' '):
        lead = word.rstrip(',')
        tail = word[len(lead):]
        font = 'B' if lead.startswith('-') or not lead.isupper() else 'I'
        out.append('\\f%s%s\\fR%s' % (font, roff(lead), tail))
    return ' '.join(out)


def list_entries(items):
    lines = []
    for term, text in items:
        lines += ['.TP', term_roff(term)]
        if text:
            lines.append(roff(text))
    return lines


def key_entries(items, leave_out):
    lines = []
    for term, text in items:
        m = re.match(r'^--([a-z0-9-]+)(?: (\S+))?$', term)
        if not m or m.group(1) in leave_out:
            continue
        name, value = m.group(1), m.group(2) or 'BOOLEAN'
        env = 'OUTBOX_' + name.upper().replace('-', '_')
        lines += ['.TP', '\\fB%s\\fR = \\fI%s\\fR' % (roff(name), roff(value)), roff(text),
                  '.br',
                  'Option \\fB\\-\\-%s\\fR, environment variable \\fB%s\\fR.' % (roff(name), roff(env))]
    return lines


def build(template, help_text, version):
    blocks = parse_help(help_text)
    out = []
    for line in template.split('\n'):
        m = re.match(r'^@(LIST|KEYS) (\S+)((?: -\S+)*)@$', line)
        if not m:
            out.append(line.replace('@VERSION@', version))
            continue
        if m.group(2) not in blocks:
            raise SystemExit('mkman: --help has no block %s (it has %s)' % (m.group(2), ', '.join(blocks)))
        items = blocks[m.group(2)]
        if m.group(1) == 'LIST':
            out += list_entries(items)
        else:
            out += key_entries(items, {w[1:] for w in m.group(3).split()})
    return '\n'.join(out)


def main():
    template, output, version, program = sys.argv[1:5]
    help_text = subprocess.run([program, '--help'], check=True, stdout=subprocess.PIPE,
                               universal_newlines=True).stdout
    with open(template) as f:
        page = build(f.read(), help_text, version)
    with open(output, 'w') as f:
        f.write(page)


if __name__ == '__main__':
    main()
