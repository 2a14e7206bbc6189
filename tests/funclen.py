#!/usr/bin/env python3
"""Lists the C functions longer than a limit (default 120 lines) in moec's source folders.

    tests/funclen.py [--max N] [FILE...]

A function is a definition at column 0 (its signature on one line or several, the opening
brace ending the last of them) up to the first line that starts with '}'; its length is counted
from the line of the opening brace to the closing one. Prints one line per function over the
limit, longest first: LINES FILE:LINE SIGNATURE. Exit status 1 when any is over, else 0.
"""
import argparse
import glob
import re
import sys

FOLDERS = ["frontend/*.c", "ir/*.c", "passes/*.c", "sched/*.c", "codegen/*.c", "runtime/*.c",
           "runtime/cuda/*.c", "cli/*.c", "moec.c", "codegen/cuda/*.cu", "lang/*.y", "lang/*.l"]
HEAD = re.compile(r"^[A-Za-z_][^=;#]*\(")            # a name and '(' at column 0, no '=' before
SKIP = ("typedef", "struct", "enum", "union", "extern", "return", "else", "if", "for", "while")


def functions(path):
    """(length, first line, signature) of every function definition in PATH."""
    lines = open(path, errors="replace").read().split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if HEAD.match(line) and not line.startswith(SKIP):
            # The signature: this line and up to 8 more, until one ends with '{' (a definition)
            # or holds a ';' (a declaration or a statement).
            j = i
            while j < len(lines) and j < i + 8:
                text = lines[j].split("//")[0].rstrip()
                if text.endswith("{"):
                    break
                if ";" in text:
                    j = -1
                    break
                j += 1
            if 0 <= j < len(lines) and j < i + 8 and lines[j].split("//")[0].rstrip().endswith("{"):
                k = j + 1
                while k < len(lines) and not lines[k].startswith("}"):
                    k += 1
                if k < len(lines):
                    yield k - j + 1, i + 1, " ".join(l.strip() for l in lines[i:j + 1])[:70]
                    i = k + 1
                    continue
        i += 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max", type=int, default=120, help="longest allowed function, in lines")
    ap.add_argument("files", nargs="*", help="files to read (default: the source folders)")
    args = ap.parse_args()
    files = args.files or sorted(f for pat in FOLDERS for f in glob.glob(pat))
    over = sorted(((n, f, s, sig) for f in files for n, s, sig in functions(f) if n > args.max),
                  key=lambda t: (-t[0], t[1], t[2]))
    for n, f, s, sig in over:
        print(f"{n} {f}:{s} {sig}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
