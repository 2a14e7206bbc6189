// The `fuse` pass: elementwise ops grouped into fused kernels (the CUDA target's; the CPU program
// runs its ops one by one and the pass leaves its modules alone).
//
// An elementwise op is one with a scalar expression in ir/scalar.def (bias, add, mul, the
// activations and their gradients, a norm's scale, a per-row scale, reshape, the division by a
// scalar, expert biases, the sigmoid gate's elementwise parts, a slice of columns); a row-wise op
// one with a row function there (RMSNorm, LayerNorm and their gradients, the gate softmax's
// gradient). Within a function, ops of these
// kinds with results of the same number of elements join a group when
//   - one reads the result of another (a chain: bias then GELU, a scale then a bias, a residual
//     add after a bias), or they are independent (three biases of q, k and v: one kernel);
//   - every op from the group's first to its last runs on one stream, and none of them waits
//     for or records an event (a group never crosses one);
//   - no op outside the group between its first and its last member reads a member's result:
//     the group runs where its last member is, so such an op would run before its input exists;
//   - a group holds at most one row-wise op, and then every member has its result's shape; the
//     members before it (its prologue, computed where it loads its operands) are read by no op
//     outside the group, and the members after it (its epilogue, computed where it stores its
//     result) read no prologue value;
//   - the kernel has at most 16 pointers (its inputs from outside the group and the members'
//     results), and the group spans at most 48 ops (so that it moves no op far: a moved op keeps
//     its inputs alive longer).
// An op with a storing function (the combine, order.decode, and its transpose order.encode.grad:
// ir/scalar.def's IR_STORE) starts a group whose other members take its result's shape and run
// where it stores each element (the residual add after the combine).
// Column sums (bias gradients, a norm scale's gradient: ir/scalar.def's IR_COLSUM) make groups of
// their own, of any shapes: one launch runs every member's tiles. A param.grad that copies a
// member's result into the gradient does not hold a group back: it moves to right after it.
// Ops join greedily in program order: an op goes into the group that produced one of its
// operands if it can, else into the latest group of its size on its stream it can join, else it
// starts one. Groups of one op are left as they were.
//
// What the pass changes: the members of a group move to just before its last member, keeping
// their order (nothing between read them, so the program computes the same values), and each
// member gets the attribute `fuse=G` (G numbers the module's groups from 0). A member whose
// result is read by no op outside its group (of any function: a backward reads saved forward
// values) and is not returned also gets `inner=1`: the value lives only in the fused kernel's
// registers, and memplan gives it no memory. With dtype bf16 a GEMM operand's maker also gets
// `bf16=1` (bf16_copies below). codegen/fused.c generates each group's kernel
// from the members' scalar expressions, in their order, so every element gets the float
// operations of the ops' own kernels: fused and `moec build --no-fuse` (which skips this pass)
// compute the same bits.
#include <stdlib.h>
#include <string.h>

#include "pass.h"

enum { MAX_MEMBERS = 16, MAX_POINTERS = 16, MAX_SPAN = 48 };

typedef struct Group {
  int member[MAX_MEMBERS];   // op indices, in program order
  int n;
  int row;                   // the member that is a row-wise op (ir_op_row), -1 none
  bool store;                // its first member is an op with a storing function (ir_op_store)
  bool colsum;               // a group of column sums (ir_op_colsum), any shapes
  int64_t numel;
  IrStream stream;
} Group;

static IrStream stream_of(const IrOp *op) { return op->stream == IR_STREAM_NONE ? IR_STREAM_COMPUTE : op->stream; }

static bool is_f32(const IrType *t) { return t->dtype == IR_F32; }

// Whether op can be a member: it has a scalar expression, f32 operands and result, no event
// recorded or waited for, and it does not feed gate.topk (the gate's softmax or sigmoid, top-k
// and gather are one kernel of their own: codegen/lower.c).
static bool candidate(const IrFunc *f, const IrOp *op) {
  bool store = ir_op_store(op->kind) != NULL;
  if ((!ir_op_scalar(op->kind) && !ir_op_row(op->kind) && ir_op_colsum(op->kind) < 0 && !store) || !op->result ||
      !is_f32(&op->result->type))
    return false;
  if (op->nwaits > 0 || op->event >= 0) return false;
  for (int a = 0; a < op->nargs && !store; a++) {   // (a storing op reads its routing's integers too)
    const IrOperand *x = &op->args[a];
    if (!is_f32(x->param ? &x->param->type : &x->value->type)) return false;
  }
  for (int i = op->index + 1; i < f->nops; i++)
    if (f->ops[i]->kind == IR_OP_GATE_TOPK && f->ops[i]->args[0].value == op->result) return false;
  return true;
}

static bool member_of(const Group *g, int i) {
  for (int k = 0; k < g->n; k++)
    if (g->member[k] == i) return true;
  return false;
}

// Whether op, outside group g, can wait until after it: a param.grad of a member's result that
// copies it into the gradient (or nothing, when the member writes the gradient in place); it
// moves to right after the group.
static bool deferrable(const IrFunc *f, const Group *g, const IrOp *op);

// Whether operand x of a member reads the result of a member of g.
static bool reads_member(const IrFunc *f, const Group *g, const IrOperand *x) {
  return x->value && x->value->def && x->value->func == f && member_of(g, x->value->def->index);
}

static bool deferrable(const IrFunc *f, const Group *g, const IrOp *op) {
  return op->kind == IR_OP_PARAM_GRAD && !ir_op_int(op, "accumulate", 0) && reads_member(f, g, &op->args[1]);
}

// Whether value v of f is read outside group g (by an op of f that is no member, by another
// function) or returned.
static bool read_outside(const IrModule *m, const IrFunc *f, const Group *g, const IrValue *v) {
  for (int r = 0; r < f->nrets; r++)
    if (f->rets[r] == v) return true;
  for (int fi = 0; fi < m->nfuncs; fi++) {
    const IrFunc *h = m->funcs[fi];
    if (h != f && h->saves != f) continue;
    for (int i = 0; i < h->nops; i++)
      for (int a = 0; a < h->ops[i]->nargs; a++)
        if (h->ops[i]->args[a].value == v && (h != f || !member_of(g, i))) return true;
  }
  return false;
}

// Whether g with op b added (b after every member) satisfies the rules of the file comment.
static bool can_join(const IrModule *m, const IrFunc *f, const Group *g, int b) {
  const IrOp *ob = f->ops[b];
  bool row = ir_op_row(ob->kind) != NULL;
  if ((ir_op_colsum(ob->kind) >= 0) != g->colsum) return false;
  if (ir_op_store(ob->kind)) return false;   // a storing op starts its group
  if (g->store && (row || !ir_type_equal(&ob->result->type, &f->ops[g->member[0]]->result->type))) return false;
  if (row && g->row >= 0) return false;   // one row-wise op a kernel
  if (row || g->row >= 0) {   // a norm's kernel: every member of its shape, the prologue its own
    const IrType *rt = &f->ops[row ? b : g->member[g->row]]->result->type;
    if (!ir_type_equal(&ob->result->type, rt) || rt->rank < 1) return false;
    for (int k = 0; k < g->n; k++) {
      const IrOp *op = f->ops[g->member[k]];
      if (!ir_type_equal(&op->result->type, rt)) return false;
      if (row) {   // the members so far become its prologue: read by the group alone
        Group t = *g;
        t.member[t.n++] = b;
        if (read_outside(m, f, &t, op->result)) return false;
      } else if (k < g->row) {   // an epilogue op reads no prologue value (it lives in a loader)
        for (int a = 0; a < ob->nargs; a++)
          if (ob->args[a].value == op->result) return false;
      }
    }
  }
  if (g->n >= MAX_MEMBERS || b - g->member[0] > MAX_SPAN || stream_of(ob) != g->stream ||
      (!g->colsum && ir_type_numel(&ob->result->type) != g->numel))
    return false;
  Group t = *g;
  t.member[t.n++] = b;
  for (int p = t.member[0]; p <= b; p++) {
    const IrOp *op = f->ops[p];
    if (stream_of(op) != t.stream || op->nwaits > 0 || op->event >= 0) return false;
    if (member_of(&t, p) || deferrable(f, &t, op)) continue;
    for (int a = 0; a < op->nargs; a++)
      if (reads_member(f, &t, &op->args[a])) return false;
  }
  // The kernel's pointers: the members' results and their distinct operands from outside.
  const IrOperand *outside[MAX_MEMBERS * IR_MAX_ARGS];
  int nout = 0;
  for (int k = 0; k < t.n; k++) {
    const IrOp *op = f->ops[t.member[k]];
    for (int a = 0; a < op->nargs; a++) {
      const IrOperand *x = &op->args[a];
      if (reads_member(f, &t, x)) continue;
      bool seen = false;
      for (int j = 0; j < nout && !seen; j++) seen = outside[j]->value == x->value && outside[j]->param == x->param;
      if (!seen) outside[nout++] = x;
    }
  }
  int per = strcmp(ir_mod_str(m, "dtype", "fp32"), "bf16") == 0 ? 2 : 1;   // dtype bf16: room for the copies
  return t.n * per + nout <= MAX_POINTERS;
}

// Groups the candidates of f; the groups of two or more ops get attributes (starting at *next_id)
// and their members move before their last. Returns false when out of memory.
static bool fuse_func(IrModule *m, IrFunc *f, PassCtx *ctx, int *next_id, int *nfused, int *ninner) {
  if (f->nops < 2) return true;
  Group *groups = calloc((size_t)f->nops, sizeof *groups);
  int *group_of = malloc((size_t)f->nops * sizeof *group_of);
  IrOp **order = malloc((size_t)f->nops * sizeof *order);
  if (!groups || !group_of || !order) {
    free(groups), free(group_of), free(order);
    return ir_oom(ctx->d);
  }
  int ngroups = 0;
  for (int b = 0; b < f->nops; b++) {
    group_of[b] = -1;
    IrOp *op = f->ops[b];
    if (!candidate(f, op)) continue;
    int join = -1;
    for (int a = 0; a < op->nargs && join < 0; a++) {   // the group of an operand's producer
      const IrValue *v = op->args[a].value;
      if (v && v->def && v->func == f && group_of[v->def->index] >= 0 && can_join(m, f, &groups[group_of[v->def->index]], b))
        join = group_of[v->def->index];
    }
    for (int g = ngroups - 1; g >= 0 && join < 0; g--)   // else the latest it can join
      if (can_join(m, f, &groups[g], b)) join = g;
    if (join < 0) {
      join = ngroups++;
      groups[join] = (Group){.row = -1, .colsum = ir_op_colsum(op->kind) >= 0, .store = ir_op_store(op->kind) != NULL,
                             .numel = ir_type_numel(&op->result->type), .stream = stream_of(op)};
    }
    if (ir_op_row(op->kind)) groups[join].row = groups[join].n;
    groups[join].member[groups[join].n++] = b;
    group_of[b] = join;
  }
  // Attributes, then the new order: a member of a group of two or more waits for its last.
  for (int g = 0; g < ngroups; g++) {
    Group *gr = &groups[g];
    if (gr->n < 2) continue;
    int id = (*next_id)++;
    (*nfused) += gr->n;
    for (int k = 0; k < gr->n; k++) {
      IrOp *op = f->ops[gr->member[k]];
      ir_op_set_int(op, "fuse", id);
      if (!read_outside(m, f, gr, op->result)) {
        ir_op_set_int(op, "inner", 1);
        (*ninner)++;
      }
    }
  }
  // The param.grad ops a group waits for (deferrable) go right after it, in their order.
  int *after = malloc((size_t)f->nops * sizeof *after);
  if (!after) {
    free(groups), free(group_of), free(order);
    return ir_oom(ctx->d);
  }
  for (int i = 0; i < f->nops; i++) {
    after[i] = -1;
    const IrOp *op = f->ops[i];
    const IrValue *v = op->kind == IR_OP_PARAM_GRAD ? op->args[1].value : NULL;
    int g = v && v->def && v->func == f ? group_of[v->def->index] : -1;
    if (g >= 0 && groups[g].n >= 2 && groups[g].member[groups[g].n - 1] > i) after[i] = g;
  }
  int n = 0;
  for (int i = 0; i < f->nops; i++) {
    int g = group_of[i];
    if (after[i] >= 0) continue;
    if (g < 0 || groups[g].n < 2) {
      order[n++] = f->ops[i];
    } else if (groups[g].member[groups[g].n - 1] == i) {
      for (int k = 0; k < groups[g].n; k++) order[n++] = f->ops[groups[g].member[k]];
      for (int j = 0; j < f->nops; j++)
        if (after[j] == g) order[n++] = f->ops[j];
    }
  }
  free(after);
  for (int i = 0; i < n; i++) {
    f->ops[i] = order[i];
    f->ops[i]->index = i;
  }
  free(groups), free(group_of), free(order);
  return true;
}

// dtype bf16: every GEMM operand made by an op of the step (not an argument) gets a bf16 copy
// beside it (`bf16=1` on its maker; memplan gives the copy its bytes for the value's whole life),
// so that a value is rounded once however many GEMMs read it (a saved activation is read again
// by the backward). A fused kernel writes the copy where it writes the value; an elementwise or
// row-wise op that is in no group becomes a group of its own (a kernel generated to write both);
// the copy of any other op's value is made by the program before its first GEMM.
static int bf16_copies(IrModule *m, int *next_id) {
  int n = 0;
  for (int fi = 0; fi < m->nfuncs; fi++) {
    IrFunc *f = m->funcs[fi];
    for (int i = 0; i < f->nops; i++) {
      const IrOp *op = f->ops[i];
      if (op->kind != IR_OP_MATMUL && op->kind != IR_OP_EXPERT_MATMUL) continue;
      for (int a = 0; a < 2; a++) {
        IrValue *v = op->args[a].value;
        if (!v || !v->def || v->type.dtype != IR_F32 || ir_op_int(v->def, "bf16", 0)) continue;
        IrOp *maker = v->def;
        ir_op_set_int(maker, "bf16", 1);
        n++;
        if (ir_op_int(maker, "fuse", -1) < 0 && ir_op_colsum(maker->kind) < 0 && candidate(v->func, maker))
          ir_op_set_int(maker, "fuse", (*next_id)++);
      }
    }
  }
  return n;
}

bool pass_fuse(IrModule *m, PassCtx *ctx) {
  if (!ctx->fuse) return true;
  int next_id = 0, nfused = 0, ninner = 0;
  for (int fi = 0; fi < m->nfuncs; fi++)
    if (!fuse_func(m, m->funcs[fi], ctx, &next_id, &nfused, &ninner)) return false;
  int copies = strcmp(ir_mod_str(m, "dtype", "fp32"), "bf16") == 0 ? bf16_copies(m, &next_id) : 0;
  if (ctx->verbose && copies)
    fprintf(ctx->log ? ctx->log : stderr, "# fuse: dtype bf16: %d GEMM operands with a bf16 copy beside them\n", copies);
  if (ctx->verbose)
    fprintf(ctx->log ? ctx->log : stderr,
            "# fuse: %d ops in %d fused kernels; %d of their results never leave the kernel\n", nfused,
            next_id, ninner);
  return true;
}
