#!/usr/bin/env python3
"""Turns a text file into a C source defining one NUL-terminated string."""
import sys

src, dst, name = sys.argv[1], sys.argv[2], sys.argv[3]
with open(src, 'rb') as f:
    data = f.read()
with open(dst, 'w') as f:
    f.write('/* Generated from %s; do not edit. */\n' % src.split('/')[-1])
    f.write('extern const char %s[];\n' % name)
    f.write('const char %s[] = {\n' % name)
    for i in range(0, len(data), 16):
        f.write('    ' + ', '.join('0x%02x' % b for b in data[i:i + 16]) + ',\n')
    f.write('    0x00\n};\n')
