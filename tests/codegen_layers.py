#!/usr/bin/env python3
"""Checks that codegen/ has no circle: no two of its files call each other, directly or around a loop.

    tests/codegen_layers.py [--obj DIR] [--print]

Reads each object of codegen/*.c (DIR/codegen/*.o, and DIR/cuda/nvrtc.o for codegen/nvrtc.c where
the CUDA toolkit built it; DIR defaults to build/obj) with `nm`: a file calls another when a symbol
it leaves undefined is one the other defines. Prints each circle (FILE -> FILE -> ... with the
symbols of each step) and exits 1 when there is one; else exits 0, and with --print lists the
files bottom-up, each with the files it calls (the layers of codegen/cg_internal.h).
"""
import argparse
import glob
import os
import subprocess
import sys


def symbols(obj):
    """(defined, undefined) global symbols of obj."""
    out = subprocess.run(["nm", "-g", obj], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
        elif len(parts) == 3 and parts[1] not in ("U", "w", "v"):
            defined.add(parts[2])
    return defined, undefined


def circles(calls):
    """The strongly connected components of more than one file (Tarjan), each sorted."""
    index, low, on, stack, out, n = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(calls[v]):
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

    for v in sorted(calls):
        if v not in index:
            visit(v)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--obj", default="build/obj", help="the objects' folder (build/obj)")
    ap.add_argument("--print", action="store_true", help="list the files bottom-up with what each calls")
    args = ap.parse_args()
    objs = {os.path.basename(o)[:-2] + ".c": o for o in sorted(glob.glob(os.path.join(args.obj, "codegen", "*.o")))}
    nvrtc = os.path.join(args.obj, "cuda", "nvrtc.o")
    if os.path.exists(nvrtc):
        objs["nvrtc.c"] = nvrtc
    if not objs:
        print(f"codegen_layers: no objects under {args.obj}/codegen (build first)", file=sys.stderr)
        return 2
    defs, undefs = {}, {}
    for name, obj in objs.items():
        defs[name], undefs[name] = symbols(obj)
    owner = {}
    for name, ds in defs.items():
        for s in ds:
            owner.setdefault(s, name)
    calls = {name: {} for name in objs}   # file -> {callee file: [symbols]}
    for name, us in undefs.items():
        for s in sorted(us):
            o = owner.get(s)
            if o and o != name:
                calls[name].setdefault(o, []).append(s)
    bad = circles({k: set(v) for k, v in calls.items()})
    for comp in bad:
        print("circle in codegen/: " + ", ".join(comp))
        for a in comp:
            for b in comp:
                if b in calls[a]:
                    print(f"  {a} -> {b}: {' '.join(calls[a][b][:6])}{' ...' if len(calls[a][b]) > 6 else ''}")
    if bad:
        return 1
    if args.print:
        done, order = set(), []
        while len(order) < len(calls):
            ready = sorted(f for f in calls if f not in done and set(calls[f]) <= done)
            order += ready
            done |= set(ready)
        for f in order:
            print(f"{f}: {' '.join(sorted(calls[f])) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
