#!/usr/bin/env python3
"""Finds circles among the C files of a folder: file A calls into file B and B, directly or
through others of the folder, back into A (issue 64: each folder's files in layers, each calling
only downward, so a reader can tell which file is below which).

    tests/circles.py [--obj build/obj] FOLDER...

A file's calls are its object's undefined symbols (`nm`) that another object of the same folder
defines. Prints one line per circle (the files, in a cycle order) and exits 1 when there is any;
a folder without objects is an error (exit 2), so a check cannot pass by finding nothing.
"""
import argparse
import glob
import os
import subprocess
import sys


def symbols(obj):
    """(defined, undefined) global symbols of one object file."""
    out = subprocess.run(["nm", obj], check=True, capture_output=True, text=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
        elif len(parts) == 3 and parts[1] in "TDBR":
            defined.add(parts[2])
    return defined, undefined


def graph(objs):
    """Edges file -> files of the same folder it calls."""
    syms = {o: symbols(o) for o in objs}
    owner = {s: o for o, (d, _) in syms.items() for s in d}
    return {o: sorted({owner[s] for s in u if s in owner and owner[s] != o}) for o, (_, u) in syms.items()}


def circles(edges):
    """The strongly connected components of more than one file (Tarjan's algorithm)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--obj", default="build/obj")
    ap.add_argument("folders", nargs="+")
    args = ap.parse_args()
    sys.setrecursionlimit(10000)
    found = 0
    for folder in args.folders:
        objs = sorted(glob.glob(os.path.join(args.obj, folder, "*.o")))
        if not objs:
            print(f"tests/circles.py: no objects in {os.path.join(args.obj, folder)} (build first)", file=sys.stderr)
            return 2
        edges = graph(objs)
        for comp in circles(edges):
            names = [os.path.relpath(c, args.obj)[:-2] + ".c" for c in comp]
            calls = "; ".join(f"{os.path.relpath(a, args.obj)[:-2]}.c -> " +
                              ", ".join(os.path.relpath(b, args.obj)[:-2] + ".c" for b in edges[a] if b in comp)
                              for a in comp)
            print(f"{folder}: circle of {len(comp)} files: {' '.join(names)} ({calls})")
            found += 1
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
