// The IR printer: the text form described at the top of ir.h, one canonical spelling for every
// module so that print(parse(print(m))) == print(m) byte for byte.
//
// Canonical choices: attributes sorted by key; floats in the shortest %g that reads back to the
// same double, with ".0" added when that reads as an integer, `inf`/`-inf`/`nan` for the
// non-finite ones; names that are not plain identifiers are quoted (`%"a b"`) so any builder-made name reads back; the
// params as one block, then every function, with a blank line between these items.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ir.h"

// Characters of an unquoted %value / @global name; keep in sync with parse.c.
static bool is_name_char(int c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.' || c == '-';
}

// An identifier (module name, attribute key): [A-Za-z_][A-Za-z0-9_.]*.
static bool is_ident(const char *s) {
  if (!s || !*s) return false;
  if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || *s == '_')) return false;
  for (const char *p = s + 1; *p; p++)
    if (!is_name_char((unsigned char)*p) || *p == '-') return false;
  return true;
}

static void print_quoted(FILE *out, const char *s) {
  fputc('"', out);
  for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
    if (*p == '"' || *p == '\\')
      fprintf(out, "\\%c", *p);
    else if (*p == '\n')
      fputs("\\n", out);
    else if (*p == '\t')
      fputs("\\t", out);
    else if (*p < 0x20 || *p == 0x7f)
      fprintf(out, "\\x%02x", *p);
    else
      fputc(*p, out);
  }
  fputc('"', out);
}

// `sigil` followed by the name, bare when every character allows it, else quoted.
static void print_name(FILE *out, char sigil, const char *name) {
  if (sigil) fputc(sigil, out);
  bool bare = name && *name;
  for (const char *p = name; bare && *p; p++) bare = is_name_char((unsigned char)*p);
  if (bare)
    fputs(name, out);
  else
    print_quoted(out, name);
}

static void print_ident(FILE *out, const char *s) {
  if (is_ident(s))
    fputs(s, out);
  else
    print_quoted(out, s);
}

static void print_float(FILE *out, double v) {
  if (isnan(v)) {
    fputs("nan", out);
    return;
  }
  if (isinf(v)) {
    fputs(v < 0 ? "-inf" : "inf", out);
    return;
  }
  // The shortest %.Ng that reads back to the same double (0.9, not 0.90000000000000002).
  char buf[64];
  for (int digits = 1; digits <= 17; digits++) {
    snprintf(buf, sizeof buf, "%.*g", digits, v);
    if (strtod(buf, NULL) == v) break;
  }
  fputs(buf, out);
  if (strspn(buf, "-0123456789") == strlen(buf)) fputs(".0", out);
}

static void print_type(FILE *out, const IrType *t) {
  fprintf(out, "%s[", ir_dtype_name(t->dtype));
  int rank = t->rank < 0 ? 0 : t->rank > IR_MAX_RANK ? IR_MAX_RANK : t->rank;
  for (int i = 0; i < rank; i++) fprintf(out, "%s%lld", i ? ", " : "", (long long)t->dim[i]);
  fputc(']', out);
}

static int cmp_attr_key(const void *a, const void *b) {
  const IrAttr *x = *(const IrAttr *const *)a, *y = *(const IrAttr *const *)b;
  return strcmp(x->key ? x->key : "", y->key ? y->key : "");
}

// ` {k=v, ...}` sorted by key; nothing when there are no attributes.
static void print_attrs(FILE *out, const IrAttr *attrs, int n) {
  if (n <= 0) return;
  const IrAttr *sorted[IR_MAX_ATTRS * 2];
  if (n > IR_MAX_ATTRS * 2) n = IR_MAX_ATTRS * 2;
  for (int i = 0; i < n; i++) sorted[i] = &attrs[i];
  qsort(sorted, (size_t)n, sizeof sorted[0], cmp_attr_key);
  fputs(" {", out);
  for (int i = 0; i < n; i++) {
    const IrAttr *a = sorted[i];
    if (i) fputs(", ", out);
    print_ident(out, a->key);
    fputc('=', out);
    switch (a->kind) {
    case IR_ATTR_INT: fprintf(out, "%lld", (long long)a->i); break;
    case IR_ATTR_FLOAT: print_float(out, a->f); break;
    case IR_ATTR_STR: print_quoted(out, a->s); break;
    default: fputs("?", out); break;
    }
  }
  fputc('}', out);
}

const char *ir_stream_name(IrStream s) {
  switch (s) {
  case IR_STREAM_COMPUTE: return "compute";
  case IR_STREAM_INTRA: return "intra";
  case IR_STREAM_INTER: return "inter";
  default: return "none";
  }
}

static const char *phase_name(IrPhase p) {
  switch (p) {
  case IR_PHASE_FWD: return "fwd";
  case IR_PHASE_BWD: return "bwd";
  case IR_PHASE_OPT: return "opt";
  default: return "?";
  }
}

// ` !{stream=S, chunk=N, phase=P, wait=[...], event=E}`; phase, wait and event only when set.
static void print_schedule(FILE *out, const IrOp *op) {
  if (op->stream == IR_STREAM_NONE) return;
  fprintf(out, " !{stream=%s, chunk=%d", ir_stream_name(op->stream), op->chunk);
  if (op->phase != IR_PHASE_NONE) fprintf(out, ", phase=%s", phase_name(op->phase));
  if (op->nwaits > 0) {
    int n = op->nwaits > IR_MAX_WAITS ? IR_MAX_WAITS : op->nwaits;
    fputs(", wait=[", out);
    for (int i = 0; i < n; i++) fprintf(out, "%s%d", i ? ", " : "", op->waits[i]);
    fputc(']', out);
  }
  if (op->event >= 0) fprintf(out, ", event=%d", op->event);
  fputc('}', out);
}

static void print_value_ref(FILE *out, const IrValue *v) { print_name(out, '%', v ? v->name : NULL); }

static void print_operand(FILE *out, const IrOperand *x) {
  if (x->param)
    print_name(out, '@', x->param->name);
  else
    print_value_ref(out, x->value);
}

static void print_op(FILE *out, const IrOp *op, bool in_group) {
  fputs(in_group ? "    " : "  ", out);
  if (op->result) {
    print_value_ref(out, op->result);
    fputs(": ", out);
    print_type(out, &op->result->type);
    fputs(" = ", out);
  }
  fputs((unsigned)op->kind < IR_OP_COUNT ? ir_op_info[op->kind].name : "?", out);
  int n = op->nargs < 0 ? 0 : op->nargs > IR_MAX_ARGS ? IR_MAX_ARGS : op->nargs;
  for (int i = 0; i < n; i++) {
    fputs(i ? ", " : " ", out);
    print_operand(out, &op->args[i]);
  }
  print_attrs(out, op->attrs, op->nattrs);
  print_schedule(out, op);
  fputc('\n', out);
}

// group = "fused" ID KIND "in_gemm"? "reads" "(" (operand ("," operand)*)? ")" "writes" "(" (%value ("," ...)*)? ")"
//         "{" op+ "}": its reads and writes (ir_group_io), its members indented two more.
static void print_group_open(FILE *out, const IrFunc *f, const IrGroup *g) {
  int cap = g->n * IR_MAX_ARGS, nreads = 0, nwrites = 0;
  IrOperand *reads = malloc(sizeof *reads * (size_t)cap);
  const IrValue **writes = malloc(sizeof *writes * (size_t)cap);
  if (!reads || !writes) ir_oom_exit();
  ir_group_io(f, g, reads, &nreads, writes, &nwrites, cap);   // (room for every operand and result)
  fprintf(out, "  fused %d %s%s reads (", g->id, (unsigned)g->kind < IR_GROUP_KINDS ? ir_group_kind_name[g->kind] : "?",
          g->in_gemm ? " in_gemm" : "");
  for (int j = 0; j < nreads; j++) {
    if (j) fputs(", ", out);
    print_operand(out, &reads[j]);
  }
  fputs(") writes (", out);
  for (int j = 0; j < nwrites; j++) {
    if (j) fputs(", ", out);
    print_value_ref(out, writes[j]);
  }
  fputs(") {\n", out);
  free(reads);
  free(writes);
}

// func = "func" @name "(" (%arg ":" type ("," ...)*)? ")" ("saves" @name)? ("attributes" attrs)?
//        "{" (op | group)* return "}"
static void print_func(FILE *out, const IrFunc *f) {
  fputs("func ", out);
  print_name(out, '@', f->name);
  fputc('(', out);
  for (int i = 0; i < f->nargs; i++) {
    if (i) fputs(", ", out);
    print_value_ref(out, f->args[i]);
    fputs(": ", out);
    print_type(out, &f->args[i]->type);
  }
  fputc(')', out);
  if (f->saves) {
    fputs(" saves ", out);
    print_name(out, '@', f->saves->name);
  }
  if (f->nattrs > 0) {
    fputs(" attributes", out);
    print_attrs(out, f->attrs, f->nattrs);
  }
  fputs(" {\n", out);
  int k = 0;   // the next group
  for (int i = 0; i < f->nops; i++) {
    const IrGroup *g = k < f->ngroups && f->groups[k].first == i ? &f->groups[k] : NULL;
    if (g) print_group_open(out, f, g);
    bool in_group = k < f->ngroups && i >= f->groups[k].first;
    print_op(out, f->ops[i], in_group);
    if (in_group && i == f->groups[k].first + f->groups[k].n - 1) {
      fputs("  }\n", out);
      k++;
    }
  }
  fputs("  return", out);
  for (int i = 0; i < f->nrets; i++) {
    fputs(i ? ", " : " ", out);
    print_value_ref(out, f->rets[i]);
  }
  fputs("\n}\n", out);
}

void ir_print(FILE *out, const IrModule *m) {
  fputs("module ", out);
  print_ident(out, m->name);
  print_attrs(out, m->attrs, m->nattrs);
  fputc('\n', out);
  if (m->nparams > 0) fputc('\n', out);
  for (int i = 0; i < m->nparams; i++) {
    const IrParam *p = m->params[i];
    fputs("param ", out);
    print_name(out, '@', p->name);
    fputs(": ", out);
    print_type(out, &p->type);
    print_attrs(out, p->attrs, p->nattrs);
    fputc('\n', out);
  }
  for (int i = 0; i < m->nfuncs; i++) {
    fputc('\n', out);
    print_func(out, m->funcs[i]);
  }
}

char *ir_print_to_string(const IrModule *m) {
  char *buf = NULL;
  size_t len = 0;
  FILE *out = open_memstream(&buf, &len);
  if (!out) return NULL;
  ir_print(out, m);
  if (fclose(out) != 0) {
    free(buf);
    return NULL;
  }
  return buf;
}
