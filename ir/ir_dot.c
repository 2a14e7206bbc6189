// The IR as a Graphviz digraph (`moec dump-ir --dot`), for `dot -Tsvg`. It reads the module only
// (no pass, no target): what the passes left in it is what is drawn.
//
//   - An op is a node labelled `%result = op` and the result's type (a result-less op: the op).
//     Its fill colour is its stream (IrStream, set by the schedule pass; white before it), so
//     where communication overlaps compute reads off the colours; the legend names them.
//   - A collective (ir_op_is_collective: all-to-all, all-reduce, all-gather, reduce-scatter, ...)
//     is a hexagon with a bold border, whatever its stream.
//   - A value is an edge from the node that makes it (an op, a function argument) to each op that
//     reads it. A backward function reads its forward's values (IrFunc.saves): an edge across the
//     two clusters when the forward is drawn, else from a dashed "saved" node.
//   - A parameter is a cylinder, one per function that reads it: one node for the whole module
//     would tie every function to the optimizer and knot the layout.
//   - An event (the schedule pass's record/wait between streams) is a dashed edge from the op
//     that records it to each op that waits for it.
//   - A fused group (passes/fuse.c, IrGroup: consecutive ops the target runs as one launch) is a
//     box `subgraph cluster_fuse_G` labelled with its kind, and each function a `subgraph cluster_func_N`; the
//     legend is `cluster_legend`. The prefixes differ so that a test can count the groups.
//
// Names go into quoted strings only, never into node ids (those are made up: f3_o12) and never
// into HTML or record labels, where `<`, `>`, `{` and `|` would mean something: quotes and
// backslashes are escaped, control characters and bytes that are not UTF-8 are written out as
// the text \xNN, so any name the IR text allows (ir/print.c quotes it) draws.
#include <stdlib.h>
#include <string.h>

#include "ir.h"

// What the drawing of one module needs besides the module: which functions are drawn, and for
// each event the op that records it.
typedef struct Dot {
  FILE *out;
  const IrModule *m;
  const IrFunc *only;      // the one function drawn, or NULL: every function
  const IrOp **recorder;   // recorder[e]: the op whose `event=e` it is, or NULL
  int nevents;
} Dot;

// The length of the UTF-8 sequence at p (2..4), or 0 when p does not start a valid one. Valid
// sequences pass through; Graphviz rejects a label with a stray byte.
static int utf8_len(const unsigned char *p) {
  int n = p[0] >= 0xf0 && p[0] <= 0xf4 ? 4 : p[0] >= 0xe0 ? 3 : p[0] >= 0xc2 && p[0] <= 0xdf ? 2 : 0;
  if (p[0] >= 0xf8) n = 0;
  for (int k = 1; k < n; k++)
    if ((p[k] & 0xc0) != 0x80) return 0;
  return n;
}

// s inside a quoted Graphviz string.
static void put_escaped(FILE *out, const char *s) {
  for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
    int n = *p >= 0x80 ? utf8_len(p) : 1;
    if (*p == '"' || *p == '\\')
      fprintf(out, "\\%c", *p);
    else if (*p < 0x20 || *p == 0x7f || n == 0)
      fprintf(out, "\\\\x%02x", *p);   // the text \xNN: a newline in a name must not break a line
    else {
      fwrite(p, 1, (size_t)n, out);
      p += n - 1;
    }
  }
}

static const char *stream_colour(IrStream s) {
  switch (s) {
    case IR_STREAM_COMPUTE: return "#cfe2f3";
    case IR_STREAM_INTRA: return "#d9ead3";
    case IR_STREAM_INTER: return "#fce5cd";
    default: return "white";
  }
}

static bool drawn(const Dot *g, const IrFunc *f) { return !g->only || g->only == f; }

// The id of the node an edge from value v starts at, read by an op of function f: the op that
// makes it, the function argument, or (v of a function not drawn) f's "saved" node of it.
static void value_node(const Dot *g, const IrFunc *f, const IrValue *v, char *buf, size_t cap) {
  if (!drawn(g, v->func))
    snprintf(buf, cap, "f%d_s%d", f->index, v->id);
  else if (v->def)
    snprintf(buf, cap, "f%d_o%d", v->func->index, v->def->index);
  else
    snprintf(buf, cap, "f%d_a%d", v->func->index, v->id);
}

// The op's node: its label (`%result = op`, the type, the flags the fuse and recompute passes
// set), its stream's colour, a hexagon for a collective.
static void op_node(const Dot *g, const IrFunc *f, const IrOp *op) {
  FILE *out = g->out;
  fprintf(out, "    f%d_o%d [label=\"", f->index, op->index);
  if (op->result) {
    fputc('%', out);
    put_escaped(out, op->result->name);
    fputs(" = ", out);
  }
  fputs(ir_op_info[op->kind].name, out);
  if (op->result) {
    char type[96];
    ir_type_str(&op->result->type, type, sizeof type);
    fprintf(out, "\\n%s", type);
  }
  const char *flags[] = {"inner", "bf16", "recompute"}, *sep = "\\n";
  for (int k = 0; k < 3; k++)
    if (ir_op_int(op, flags[k], 0)) fprintf(out, "%s%s", sep, flags[k]), sep = " ";
  fprintf(out, "\", fillcolor=\"%s\"", stream_colour(op->stream));
  if (ir_op_is_collective(op->kind)) fputs(", shape=hexagon, penwidth=2.5", out);
  fputs("];\n", out);
}

// The nodes of f that no op makes, declared before the ops so that none lands inside a fused
// group's cluster (a node belongs to the subgraph it first appears in): the arguments, the
// parameters f reads, the values of a function not drawn that f reads.
static void input_nodes(const Dot *g, const IrFunc *f) {
  FILE *out = g->out;
  int fi = f->index;
  for (int a = 0; a < f->nargs; a++) {
    fprintf(out, "    f%d_a%d [shape=invhouse, fillcolor=\"#eeeeee\", label=\"%%", fi, f->args[a]->id);
    put_escaped(out, f->args[a]->name);
    fputs("\"];\n", out);
  }
  bool *param_seen = calloc((size_t)g->m->nparams + 1, 1);
  bool *saved_seen = calloc(f->saves ? (size_t)f->saves->nvalues + 1 : 1, 1);
  for (int i = 0; i < f->nops && param_seen && saved_seen; i++) {
    for (int a = 0; a < f->ops[i]->nargs; a++) {
      const IrOperand *x = &f->ops[i]->args[a];
      if (x->param && !param_seen[x->param->index]) {
        param_seen[x->param->index] = true;
        fprintf(out, "    f%d_p%d [shape=cylinder, fillcolor=\"#fff2cc\", label=\"@", fi, x->param->index);
        put_escaped(out, x->param->name);
        fputs("\"];\n", out);
      } else if (x->value && x->value->func == f->saves && !drawn(g, f->saves) && !saved_seen[x->value->id]) {
        saved_seen[x->value->id] = true;
        fprintf(out, "    f%d_s%d [style=dashed, label=\"%%", fi, x->value->id);
        put_escaped(out, x->value->name);
        fputs(" (saved: @", out);
        put_escaped(out, f->saves->name);
        fputs(")\"];\n", out);
      }
    }
  }
  free(param_seen);
  free(saved_seen);
}

// f's ops, each fused group's inside a cluster of its own.
static void op_nodes(const Dot *g, const IrFunc *f) {
  FILE *out = g->out;
  for (int i = 0; i < f->nops; i++) {
    const IrGroup *group = ir_group_at(f, i);
    if (!group) {
      op_node(g, f, f->ops[i]);
      continue;
    }
    fprintf(out, "    subgraph cluster_fuse_%d {\n      label=\"fused %d: %s%s (%d ops)\"; style=\"rounded,dashed\"; "
            "color=\"#7f6000\"; fontcolor=\"#7f6000\";\n", group->id, group->id, ir_group_kind_name[group->kind],
            group->in_gemm ? ", in the GEMM's pieces" : "", group->n);
    for (int k = 0; k < group->n; k++) op_node(g, f, f->ops[i + k]);
    fputs("    }\n", out);
    i += group->n - 1;
  }
  if (f->nrets > 0) fprintf(out, "    f%d_r [shape=house, fillcolor=\"#eeeeee\", label=\"return\"];\n", f->index);
}

// The edges into f's ops and return node: values, parameters (grey: they are many and say
// little about the order), events (dashed, from the op that records).
static void edges(const Dot *g, const IrFunc *f) {
  FILE *out = g->out;
  int fi = f->index;
  char from[64];
  for (int i = 0; i < f->nops; i++) {
    const IrOp *op = f->ops[i];
    for (int a = 0; a < op->nargs; a++) {
      if (op->args[a].param) {
        fprintf(out, "  f%d_p%d -> f%d_o%d [color=\"#999999\"];\n", fi, op->args[a].param->index, fi, i);
        continue;
      }
      value_node(g, f, op->args[a].value, from, sizeof from);
      fprintf(out, "  %s -> f%d_o%d;\n", from, fi, i);
    }
    for (int w = 0; w < op->nwaits; w++) {
      int e = op->waits[w];
      const IrOp *rec = e >= 0 && e < g->nevents ? g->recorder[e] : NULL;
      if (!rec || !drawn(g, rec->func)) continue;   // recorded in a function not drawn: the colours still tell
      fprintf(out, "  f%d_o%d -> f%d_o%d [style=dashed, color=\"#a61c00\", fontcolor=\"#a61c00\", label=\"e%d\"];\n",
              rec->func->index, rec->index, fi, i, e);
    }
  }
  for (int r = 0; r < f->nrets; r++) {
    value_node(g, f, f->rets[r], from, sizeof from);
    fprintf(out, "  %s -> f%d_r;\n", from, fi);
  }
}

// What the colours, shapes and dashed lines mean: a row of sample nodes, left to right.
static void legend(const Dot *g) {
  FILE *out = g->out;
  fputs("  subgraph cluster_legend {\n    label=\"legend\"; style=rounded; color=\"#999999\";\n", out);
  const IrStream streams[] = {IR_STREAM_NONE, IR_STREAM_COMPUTE, IR_STREAM_INTRA, IR_STREAM_INTER};
  for (int s = 0; s < 4; s++)
    fprintf(out, "    legend_%s [label=\"stream: %s\", fillcolor=\"%s\"];\n", ir_stream_name(streams[s]),
            s == 0 ? "none (unscheduled)" : ir_stream_name(streams[s]), stream_colour(streams[s]));
  fputs("    legend_collective [label=\"collective\", shape=hexagon, penwidth=2.5];\n"
        "    legend_param [label=\"@parameter\", shape=cylinder, fillcolor=\"#fff2cc\"];\n"
        "    legend_arg [label=\"%argument\", shape=invhouse, fillcolor=\"#eeeeee\"];\n"
        "    legend_record [label=\"records event\"];\n    legend_wait [label=\"waits for it\"];\n"
        "    legend_record -> legend_wait [style=dashed, color=\"#a61c00\", fontcolor=\"#a61c00\", label=\"eN\"];\n"
        "    legend_none -> legend_compute -> legend_intra -> legend_inter -> legend_collective -> legend_param -> "
        "legend_arg -> legend_record [style=invis];\n  }\n", out);
}

// For each event, the op that records it (events are numbered across the module: a wait may
// name an event of another function).
static bool find_recorders(Dot *g) {
  for (int fi = 0; fi < g->m->nfuncs; fi++)
    for (int i = 0; i < g->m->funcs[fi]->nops; i++)
      if (g->m->funcs[fi]->ops[i]->event >= g->nevents) g->nevents = g->m->funcs[fi]->ops[i]->event + 1;
  g->recorder = calloc((size_t)g->nevents + 1, sizeof *g->recorder);
  if (!g->recorder) return false;
  for (int fi = 0; fi < g->m->nfuncs; fi++)
    for (int i = 0; i < g->m->funcs[fi]->nops; i++) {
      const IrOp *op = g->m->funcs[fi]->ops[i];
      if (op->event >= 0) g->recorder[op->event] = op;
    }
  return true;
}

bool ir_print_dot(FILE *out, const IrModule *m, const IrFunc *only, const char *note) {
  Dot g = {.out = out, .m = m, .only = only};
  if (!find_recorders(&g)) return false;
  fputs("digraph moec {\n  graph [fontname=\"Helvetica\", labelloc=t, label=\"module ", out);
  put_escaped(out, m->name);
  if (note && *note) {
    fputs(" (", out);
    put_escaped(out, note);
    fputc(')', out);
  }
  fputs("\"];\n  node [fontname=\"Helvetica\", fontsize=10, shape=box, style=\"rounded,filled\", fillcolor=white];\n"
        "  edge [fontname=\"Helvetica\", fontsize=9, arrowsize=0.6];\n", out);
  legend(&g);
  for (int fi = 0; fi < m->nfuncs; fi++) {
    const IrFunc *f = m->funcs[fi];
    if (!drawn(&g, f)) continue;
    fprintf(out, "  subgraph cluster_func_%d {\n    label=\"@", fi);
    put_escaped(out, f->name);
    fputs("\"; style=rounded; color=\"#444444\";\n", out);
    input_nodes(&g, f);
    op_nodes(&g, f);
    fputs("  }\n", out);
  }
  for (int fi = 0; fi < m->nfuncs; fi++)
    if (drawn(&g, m->funcs[fi])) edges(&g, m->funcs[fi]);
  fputs("}\n", out);
  free(g.recorder);
  return !ferror(out);
}
