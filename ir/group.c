// Fused groups in the IR (IrGroup, ir.h): added by the fuse pass and the parser, found by op,
// their kernels' reads and writes, and whether their members fit their kind. A group is a run of
// consecutive ops of one function; the function keeps its groups sorted by their first member.
#include <string.h>

#include "ir.h"

const char *const ir_group_kind_name[IR_GROUP_KINDS] = {"elementwise", "rows", "store", "colsums", "gate", "update"};

IrGroup *ir_add_group(IrFunc *f, IrModule *m, int id, IrGroupKind kind, int first, int n) {
  if (n < 1 || first < 0 || first + n > f->nops) return NULL;
  int at = 0;   // the new group's place: after every group that starts before it
  while (at < f->ngroups && f->groups[at].first < first) at++;
  if (at > 0 && f->groups[at - 1].first + f->groups[at - 1].n > first) return NULL;
  if (at < f->ngroups && f->groups[at].first < first + n) return NULL;
  if (f->ngroups == f->cap_groups) {
    int cap = f->cap_groups ? 2 * f->cap_groups : 16;
    IrGroup *g = ir_alloc(m, sizeof *g * (size_t)cap);
    if (f->ngroups) memcpy(g, f->groups, sizeof *g * (size_t)f->ngroups);
    f->groups = g;
    f->cap_groups = cap;
  }
  memmove(&f->groups[at + 1], &f->groups[at], sizeof *f->groups * (size_t)(f->ngroups - at));
  f->ngroups++;
  f->groups[at] = (IrGroup){.id = id, .kind = kind, .first = first, .n = n};
  return &f->groups[at];
}

const IrGroup *ir_group_at(const IrFunc *f, int i) {
  int lo = 0, hi = f->ngroups - 1;
  while (lo <= hi) {
    int mid = (lo + hi) / 2;
    const IrGroup *g = &f->groups[mid];
    if (i < g->first) hi = mid - 1;
    else if (i >= g->first + g->n) lo = mid + 1;
    else return g;
  }
  return NULL;
}

// Whether v is the result of a member of g.
static bool made_inside(const IrFunc *f, const IrGroup *g, const IrValue *v) {
  return v && v->def && v->func == f && v->def->index >= g->first && v->def->index < g->first + g->n;
}

bool ir_group_io(const IrFunc *f, const IrGroup *g, IrOperand *reads, int *nreads, const IrValue **writes, int *nwrites,
                 int cap) {
  *nreads = *nwrites = 0;
  for (int i = g->first; i < g->first + g->n; i++) {
    const IrOp *op = f->ops[i];
    for (int a = 0; a < op->nargs; a++) {
      const IrOperand *x = &op->args[a];
      if (made_inside(f, g, x->value)) continue;
      bool seen = false;
      for (int j = 0; j < *nreads && !seen; j++) seen = reads[j].value == x->value && reads[j].param == x->param;
      if (seen) continue;
      if (*nreads == cap) return false;
      reads[(*nreads)++] = *x;
    }
    if (op->result && !ir_op_int(op, "inner", 0)) {
      if (*nwrites == cap) return false;
      writes[(*nwrites)++] = op->result;
    }
  }
  return true;
}

static bool elementwise(IrOpKind k) {
  return ir_op_scalar(k) && !ir_op_row(k) && ir_op_colsum(k) < 0 && !ir_op_store(k);
}

static bool why_not(char *why, size_t size, const IrOp *op, const char *what) {
  snprintf(why, size, "'%s' %s", (unsigned)op->kind < IR_OP_COUNT ? ir_op_info[op->kind].name : "?", what);
  return false;
}

// The gate's chain: a softmax or sigmoid, top-k of its scores, the gather of the scores at them.
static bool gate_fits(const IrFunc *f, const IrGroup *g, char *why, size_t size) {
  if (g->n != 3) return snprintf(why, size, "a gate group is 3 ops (softmax or sigmoid, topk, gather), not %d", g->n), false;
  const IrOp *a = f->ops[g->first], *b = f->ops[g->first + 1], *c = f->ops[g->first + 2];
  if (a->kind != IR_OP_GATE_SOFTMAX && a->kind != IR_OP_GATE_SIGMOID) return why_not(why, size, a, "does not start a gate group");
  if (b->kind != IR_OP_GATE_TOPK || b->args[0].value != a->result) return why_not(why, size, b, "is not gate.topk of the scores");
  if (c->kind != IR_OP_GATE_GATHER || c->args[0].value != a->result || c->args[1].value != b->result)
    return why_not(why, size, c, "is not gate.gather of the scores at the top-k");
  return true;
}

bool ir_update_joins(const IrOp *a, const IrOp *b) {
  static const char *const settings[] = {"beta1", "beta2", "eps"};
  if ((a->kind != IR_OP_OPT_SGD && a->kind != IR_OP_OPT_ADAMW) || b->kind != a->kind) return false;
  if (!a->nargs || !a->args[0].param || !b->nargs || !b->args[0].param) return false;
  for (int k = 0; a->kind == IR_OP_OPT_ADAMW && k < 3; k++)
    if (ir_op_float(b, settings[k], 0) != ir_op_float(a, settings[k], 0)) return false;
  return true;
}

// Optimizer updates that each join the first (ir_update_joins).
static bool update_fits(const IrFunc *f, const IrGroup *g, char *why, size_t size) {
  const IrOp *a = f->ops[g->first];
  for (int i = g->first; i < g->first + g->n; i++) {
    const IrOp *b = f->ops[i];
    if (ir_update_joins(a, b)) continue;
    if (b->kind == a->kind && (a->kind == IR_OP_OPT_SGD || a->kind == IR_OP_OPT_ADAMW) && b->nargs && b->args[0].param)
      return snprintf(why, size, "the updates differ in beta1, beta2 or eps"), false;
    return why_not(why, size, b, "is not an update of a parameter of the group's kind");
  }
  return true;
}

bool ir_group_fits(const IrFunc *f, const IrGroup *g, char *why, size_t size) {
  *why = '\0';
  if (g->in_gemm) {
    const IrOp *p = g->first > 0 ? f->ops[g->first - 1] : NULL;
    if (!p || (p->kind != IR_OP_MATMUL && p->kind != IR_OP_EXPERT_MATMUL))
      return snprintf(why, size, "an in_gemm group follows a matmul or expert_matmul"), false;
    if (g->kind != IR_GROUP_ELEMENTWISE && g->kind != IR_GROUP_ROWS)
      return snprintf(why, size, "only an elementwise or rows group runs in a GEMM's pieces"), false;
  }
  if (g->kind == IR_GROUP_GATE) return gate_fits(f, g, why, size);
  if (g->kind == IR_GROUP_UPDATE) return update_fits(f, g, why, size);
  int rows = 0;
  for (int i = g->first; i < g->first + g->n; i++) {
    const IrOp *op = f->ops[i];
    bool first = i == g->first;
    switch (g->kind) {
    case IR_GROUP_COLSUMS:
      if (ir_op_colsum(op->kind) < 0) return why_not(why, size, op, "is no column sum (a colsums group)");
      break;
    case IR_GROUP_STORE:
      if (first ? !ir_op_store(op->kind) : !elementwise(op->kind))
        return why_not(why, size, op, first ? "has no storing function (a store group starts with one)" : "is not elementwise");
      break;
    case IR_GROUP_ROWS:
      rows += ir_op_row(op->kind) != NULL;
      if (!ir_op_row(op->kind) && !elementwise(op->kind)) return why_not(why, size, op, "is neither row-wise nor elementwise");
      break;
    default:
      if (!elementwise(op->kind)) return why_not(why, size, op, "is not elementwise (ir/scalar.def)");
      break;
    }
  }
  if (g->kind == IR_GROUP_ROWS && rows != 1)
    return snprintf(why, size, "a rows group holds one row-wise op, not %d", rows), false;
  return true;
}
