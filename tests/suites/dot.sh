#!/usr/bin/env bash
# moec dump-ir --dot (ir/ir_dot.c): the graph of several models draws with Graphviz (`dot -Tsvg`
# exits 0 with an SVG); a fused group is one `subgraph cluster_fuse_G` (as many as the text dump's
# `fused G KIND ... {` regions); every collective a hexagon, every event wait a dashed edge; --func draws one
# function, --after the module after that pass, an .ir file as read; odd names (quotes,
# backslashes, angle brackets, a newline) draw; a wrong --func or option is a clear error.
. "$(dirname "$0")/../lib.sh"
work dot
if ! command -v dot >/dev/null; then
  bad "graphviz: no 'dot' on PATH (make installs the package graphviz: DEB_PACKAGES)"
  exit 1
fi

# draw NAME ARGS...: moec dump-ir ARGS --dot into $WORK/NAME.dot, dot -Tsvg into $WORK/NAME.svg;
# false (with a FAIL) when either fails or writes nothing.
draw() {
  local name=$1
  shift
  if ! "$MOEC" dump-ir "$@" --dot >"$WORK/$name.dot" 2>"$WORK/$name.err" || [ ! -s "$WORK/$name.dot" ]; then
    bad "dump-ir $* --dot" "$(cat "$WORK/$name.err")"
    return 1
  fi
  if ! dot -Tsvg "$WORK/$name.dot" >"$WORK/$name.svg" 2>"$WORK/$name.err" || ! grep -q '</svg>' "$WORK/$name.svg"; then
    bad "dot -Tsvg of dump-ir $* --dot" "$(cat "$WORK/$name.err")"
    return 1
  fi
}

count() { grep -c -- "$1" "$2"; }

# Every model: it draws; its fused groups, collectives and event waits are all in the graph.
for spec in "plain:tests/golden/small.moe" "lm:lang/models/llama_moe.moe" "fused:lang/models/tiny.moe" \
            "mp-ep:tests/golden/parallel.moe" "streams:tests/golden/sched.moe"; do
  name=${spec%%:*} model=${spec#*:}
  draw "$name" "$model" || continue
  "$MOEC" dump-ir "$model" >"$WORK/$name.ir"
  groups=$(grep -cE '^  fused [0-9]+ ' "$WORK/$name.ir")
  clusters=$(count 'subgraph cluster_fuse_' "$WORK/$name.dot")
  colls=$(grep -cE ' comm\.(allgather|reducescatter|alltoall|allreduce)' "$WORK/$name.ir")   # not split, copy: local
  hexagons=$(count 'shape=hexagon' "$WORK/$name.dot")
  waits=$(grep -o 'wait=\[[0-9, ]*\]' "$WORK/$name.ir" | tr -cd ',[' | wc -c)   # one per '[' and ','
  dashed=$(grep -E -- '-> f[0-9]+_o[0-9]+ \[style=dashed' "$WORK/$name.dot" | wc -l)
  if [ "$clusters" -eq "$groups" ] && [ "$hexagons" -eq $((colls + 1)) ] && [ "$dashed" -eq "$waits" ]; then
    ok "$model: draws ($(wc -c <"$WORK/$name.svg") bytes of SVG): fused groups $groups, collectives $colls, event waits $waits"
  else
    bad "$model: $clusters fuse clusters for $groups groups, $hexagons hexagons for $colls collectives (+1 legend), $dashed dashed edges for $waits waits"
  fi
done
for name in fused streams mp-ep; do   # what the models above must have, so that the counts test something
  case $name in fused) want='  fused ' ;; streams) want='wait=' ;; mp-ep) want='comm.alltoall' ;; esac
  grep -q "$want" "$WORK/$name.ir" 2>/dev/null || bad "the $name model has no '$want' any more: pick another"
done

# --func: one function's box, its ops and nothing of the others; with or without the '@'.
if draw func tests/golden/sched.moe --func b0.fwd && draw func-at tests/golden/sched.moe --func @b0.fwd; then
  ops=$(awk '/^func @b0.fwd\(/ {on = 1; next} on && /^}/ {exit} on && / = |^  param.grad / {n++} END {print n + 0}' "$WORK/streams.ir")
  nodes=$(grep -cE '^ +f[0-9]+_o[0-9]+ \[' "$WORK/func.dot")
  if [ "$(count 'subgraph cluster_func_' "$WORK/func.dot")" -eq 1 ] && grep -q 'label="@b0.fwd"' "$WORK/func.dot" &&
     [ "$nodes" -eq "$ops" ] && [ "$ops" -gt 0 ] && ! grep -q '@b0.bwd' "$WORK/func.dot" && cmp -s "$WORK/func.dot" "$WORK/func-at.dot"; then
    ok "--func b0.fwd: one function, its $ops ops; --func @b0.fwd the same"
  else
    bad "--func b0.fwd: $nodes op nodes for $ops ops" "$(head -n 20 "$WORK/func.dot")"
  fi
fi
# A backward drawn alone reads its forward's values from dashed "saved" nodes.
if draw bwd tests/golden/sched.moe --func b0.bwd; then
  if grep -q '(saved: @b0.fwd)' "$WORK/bwd.dot"; then ok "--func b0.bwd: the forward's values it reads as saved nodes"
  else bad "--func b0.bwd: no saved node" "$(head -n 20 "$WORK/bwd.dot")"; fi
fi

# --after: before scheduling nothing has a stream or a fused group; after schedule the streams, not yet the groups.
if draw lower tests/golden/sched.moe --after=lower && draw schedule tests/golden/sched.moe --after=schedule; then
  if ! grep -qE 'fillcolor="#(cfe2f3|d9ead3|fce5cd)"' <(grep -v legend_ "$WORK/lower.dot") &&
     [ "$(count 'subgraph cluster_fuse_' "$WORK/lower.dot")" -eq 0 ] && grep -q 'after lower' "$WORK/lower.dot" &&
     grep -v legend_ "$WORK/schedule.dot" | grep -q 'fillcolor="#fce5cd"' &&
     [ "$(count 'subgraph cluster_fuse_' "$WORK/schedule.dot")" -eq 0 ] && [ "$(count 'subgraph cluster_fuse_' "$WORK/streams.dot")" -gt 0 ]; then
    ok "--after=lower: no streams, no groups; --after=schedule: streams, no groups yet; after fuse: groups"
  else
    bad "--after: the graphs after lower, schedule and fuse are not what those passes leave"
  fi
fi

# An .ir file draws as read: the graph of the text dump is the model's, the title aside.
if draw readback "$WORK/fused.ir"; then
  if diff <(grep -v 'label="module ' "$WORK/fused.dot") <(grep -v 'label="module ' "$WORK/readback.dot") >"$WORK/diff"; then
    ok "dump-ir F.ir --dot: the same graph as the model's"
  else
    bad "dump-ir F.ir --dot differs from the model's" "$(head -n 20 "$WORK/diff")"
  fi
fi

# Odd names: quotes, backslashes, angle brackets, braces, a bar, a newline, a control character.
cat >"$WORK/odd.ir" <<'EOF'
module "odd \"<m>\" \\N{x}|y"

param @"w<1>\"|{}": f32[4, 4] {init="normal", std=0.1}

func @"f\"x<>"(%"a<b>\\": f32[2, 4]) {
  %"y\"\\<>{}|\n\x01": f32[2, 4] = matmul %"a<b>\\", @"w<1>\"|{}"
  return %"y\"\\<>{}|\n\x01"
}
EOF
if draw odd "$WORK/odd.ir"; then
  if grep -qF '%a&lt;b&gt;\</text>' "$WORK/odd.svg" && grep -qF '%y&quot;\&lt;&gt;{}|\x0a\x01 = matmul' "$WORK/odd.svg" &&
     grep -qF '@w&lt;1&gt;&quot;|{}' "$WORK/odd.svg" && grep -qF 'module odd &quot;&lt;m&gt;&quot; \N{x}|y' "$WORK/odd.svg"; then
    ok "odd names (\" \\ < > { } | newline) draw, spelled as written"
  else
    bad "odd names: the SVG's labels are not the names" "$(grep '<text' "$WORK/odd.svg")"
  fi
fi

# Errors: a function the module lacks (the message lists those it has), --func without --dot, --dot --all.
out=$("$MOEC" dump-ir tests/golden/sched.moe --dot --func nosuch 2>&1 >/dev/null); st=$?
if [ $st -eq 1 ] && grep -q "^moec: error: --func 'nosuch': module 's' has no such function; it has @b0.fwd, @loss.fwd" <<<"$out"; then
  ok "--func nosuch: exit 1, the functions named"
else
  bad "--func nosuch: exit $st: $out"
fi
for args in "--func b0.fwd" "--dot --all"; do
  out=$("$MOEC" dump-ir tests/golden/sched.moe $args 2>&1 >/dev/null); st=$?
  if [ $st -eq 2 ] && grep -q '^moec: error: ' <<<"$out"; then ok "dump-ir $args: usage error ($out)"
  else bad "dump-ir $args: exit $st: $out"; fi
done
exit $failed
