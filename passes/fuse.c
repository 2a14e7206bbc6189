// The `fuse` pass: elementwise ops grouped into fused kernels, on both targets (moec build
// --no-fuse skips it). The CUDA target's groups are of every kind below; the CPU target's
// (ctx->fuse_cpu) of elementwise ops of one row length with at most one norm (one parallel region
// over rows in the CPU program) and of column sums (one parallel region for all of them).
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
//     the group runs where its last member is, so such an op would run before its input exists
//     (unless it is a member of a group whose last member comes later: that group runs later);
//   - a group holds at most one row-wise op, and then every member has its result's shape: the
//     members before it are its prologue (computed where it loads its operands, and again where
//     it stores its result when a prologue value leaves the kernel or the epilogue reads one),
//     the members after it its epilogue (computed where it stores its result);
//   - the kernel has at most 32 pointers (its inputs from outside the group and the members'
//     results), and the group spans at most 48 ops (so that it moves no op far: a moved op keeps
//     its inputs alive longer).
// An op with a storing function (the combine, order.decode, and its transpose order.encode.grad:
// ir/scalar.def's IR_STORE) starts a group whose other members take its result's shape and run
// where it stores each element (the residual add after the combine).
// Column sums (bias gradients, a norm scale's gradient: ir/scalar.def's IR_COLSUM) first move down
// the function (sink_colsums), then make groups of their own, of any shapes: one launch runs every
// member's tiles. A param.grad that copies a
// member's result into the gradient does not hold a group back: it moves to right after it.
// Ops join greedily in program order, the column sums after all others (so that a sum knows
// where the groups before it run: an op between that reads a member is fine when its own group
// runs after, a param.grad of another sum's group in the way): an op goes into the group that produced one of its operands if it can, else into
// the latest group it can join, else it starts one. Groups of one op are left as they were.
// The cost pass asks for the same grouping before this pass runs (pass_fuse_plan: nothing moves,
// the column sums are not sunk, streams not yet assigned; on CUDA the gate's chains too) to price
// each group as one launch.
//
// What the pass changes: the members of a group move to just before its last member, keeping
// their order (nothing between read them, so the program computes the same values), and become a
// group of the IR (ir.h's IrGroup, `fused G KIND reads (...) writes (...) { ... }` in the text; G
// numbers the module's groups from 0), which memplan and codegen read. A member whose
// result is read by no op outside its group (of any function: a backward reads saved forward
// values) and is not returned also gets `inner=1`: the value lives only in the fused kernel's
// registers, and memplan gives it no memory. With dtype bf16 a GEMM operand's maker also gets
// `bf16=1`, a saved activation's reader in the backward `bf16_reads`, and a value read only from
// its bf16 copy `inner=1` with `bf16=1` (bf16_copies below). codegen/fused.c generates each group's kernel
// from the members' scalar expressions, in their order, so every element gets the float
// operations of the ops' own kernels: fused and `moec build --no-fuse` (which skips this pass)
// compute the same bits.
//
// The groups of other kernels are decided here too (other_groups): on CUDA a gate's softmax or
// sigmoid, top-k and gather (kind gate) and each run of optimizer updates that share a launch
// (kind update); on the CPU which groups run in the pieces of the GEMM before them (in_gemm).
// No fusion is found again below the passes.
#include <stdlib.h>
#include <string.h>

#include "pass.h"

enum { MAX_MEMBERS = 24, MAX_POINTERS = 32, MAX_SPAN = 48 };

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
static bool candidate(const IrFunc *f, const IrOp *op, bool cpu) {
  bool store = ir_op_store(op->kind) != NULL;
  const IrRowInfo *ri = ir_op_row(op->kind);   // the CPU's: elementwise, norms (a block a row), column sums
  if (cpu && !ir_op_scalar(op->kind) && ir_op_colsum(op->kind) < 0 && (!ri || ri->per_thread)) return false;
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

// The distinct operands of g's members that no member makes (values or parameters), into outside;
// returns how many.
static int outside_operands(const IrFunc *f, const Group *g, const IrOperand **outside) {
  int nout = 0;
  for (int k = 0; k < g->n; k++) {
    const IrOp *op = f->ops[g->member[k]];
    for (int a = 0; a < op->nargs; a++) {
      const IrOperand *x = &op->args[a];
      if (reads_member(f, g, x)) continue;
      bool seen = false;
      for (int j = 0; j < nout && !seen; j++) seen = outside[j]->value == x->value && outside[j]->param == x->param;
      if (!seen) outside[nout++] = x;
    }
  }
  return nout;
}

// Whether g with op b added (b after every member) satisfies the rules of the file comment.
static bool can_join(const IrModule *m, const IrFunc *f, const Group *groups, const int *group_of, const Group *g, int b,
                     bool cpu) {
  const IrOp *ob = f->ops[b];
  bool row = ir_op_row(ob->kind) != NULL, colsum = ir_op_colsum(ob->kind) >= 0;
  if (b <= g->member[g->n - 1]) return false;   // (column sums come after the rest: a later group)
  if (colsum != g->colsum) return false;   // column sums among themselves
  if (ir_op_store(ob->kind)) return false;   // a storing op starts its group
  if (g->store && (row || !ir_type_equal(&ob->result->type, &f->ops[g->member[0]]->result->type))) return false;
  if (row && g->row >= 0) return false;   // one row-wise op a kernel
  if (row || g->row >= 0) {   // a norm's kernel: every member of its shape
    const IrType *rt = &f->ops[row ? b : g->member[g->row]]->result->type;
    if (!ir_type_equal(&ob->result->type, rt) || rt->rank < 1) return false;
    for (int k = 0; k < g->n; k++)
      if (!ir_type_equal(&f->ops[g->member[k]]->result->type, rt)) return false;
  }
  if (cpu && !colsum) {   // the CPU loop runs over rows and columns: one row length
    const IrType *t0 = &f->ops[g->member[0]]->result->type, *tb = &ob->result->type;
    if (t0->rank < 1 || tb->rank < 1 || t0->dim[t0->rank - 1] != tb->dim[tb->rank - 1]) return false;
  }
  if (g->n >= MAX_MEMBERS || b - g->member[0] > MAX_SPAN || stream_of(ob) != g->stream ||
      (!colsum && ir_type_numel(&ob->result->type) != g->numel))
    return false;
  Group t = *g;
  t.member[t.n++] = b;
  for (int p = t.member[0]; p <= b; p++) {
    const IrOp *op = f->ops[p];
    if (stream_of(op) != t.stream || op->nwaits > 0 || op->event >= 0) return false;
    if (member_of(&t, p) || deferrable(f, &t, op)) continue;
    const Group *other = group_of[p] >= 0 ? &groups[group_of[p]] : NULL;   // it runs after b (at its last)
    if (other && other->n >= 2 && other->member[other->n - 1] > b) continue;
    for (int a = 0; a < op->nargs; a++)
      if (reads_member(f, &t, &op->args[a])) return false;
  }
  // The kernel's pointers: the members' results and their distinct operands from outside.
  const IrOperand *outside[MAX_MEMBERS * IR_MAX_ARGS];
  int nout = outside_operands(f, &t, outside);
  int per = strcmp(ir_mod_str(m, "dtype", "fp32"), "bf16") == 0 ? 2 : 1;   // dtype bf16: room for the copies
  return t.n * per + nout <= MAX_POINTERS;
}

// On the CPU a group with a norm runs the ops before it, the norm's rows and the ops after it one
// after the other (codegen/fused.c): whether member k's result goes from one of those parts to
// another (the norm's own result, or a value the norm or a later part reads), and needs memory.
static bool crosses_norm(const IrFunc *f, const Group *g, int k) {
  if (g->row < 0) return false;
  if (k == g->row) return true;
  int part = k < g->row ? 0 : 2;
  for (int j = 0; j < g->n; j++) {
    const IrOp *op = f->ops[g->member[j]];
    int pj = j < g->row ? 0 : j == g->row ? 1 : 2;
    for (int a = 0; a < op->nargs && pj != part; a++)
      if (op->args[a].value == f->ops[g->member[k]]->result) return true;
  }
  return false;
}

// Groups the candidates of f; the groups of two or more ops get attributes (starting at *next_id)
// and their members move before their last. Returns false when out of memory.
// Column sums move down, with the param.grad ops that copy their results into gradients, to just
// before the first later op that reads their result otherwise, waits for or records an event, or
// writes one of those gradients (or to the end): their results only feed parameter gradients, so
// the elementwise ops whose results they sum group without them in the way, and the sums meet in
// one launch at the end. (Later reads, nothing else: the same values.)
static void sink_colsums(IrFunc *f) {
  for (int i = f->nops - 2; i >= 0; i--) {
    IrOp *op = f->ops[i];
    if (ir_op_colsum(op->kind) < 0 || !candidate(f, op, false)) continue;   // (the same on both targets)
    IrOp *moved[1 + IR_MAX_ARGS * 4];
    int nmoved = 0, j = i + 1;
    moved[nmoved++] = op;
    for (; j < f->nops; j++) {
      IrOp *o = f->ops[j];
      bool reads = false, same_grad = false;
      for (int a = 0; a < o->nargs; a++) reads |= o->args[a].value == op->result;
      for (int k = 1; k < nmoved && o->kind == IR_OP_PARAM_GRAD; k++) same_grad |= o->args[0].param == moved[k]->args[0].param;
      if (reads && o->kind == IR_OP_PARAM_GRAD && !ir_op_int(o, "accumulate", 0) && o->args[1].value == op->result &&
          nmoved < (int)(sizeof moved / sizeof *moved)) {
        moved[nmoved++] = o;
        continue;
      }
      if (reads || same_grad || o->nwaits > 0 || o->event >= 0) break;
    }
    if (j == i + nmoved) continue;   // nothing to move over
    int w = i;
    for (int k = i; k < j; k++) {   // the others keep their order, then the moved ops
      bool is_moved = false;
      for (int q = 0; q < nmoved; q++) is_moved |= f->ops[k] == moved[q];
      if (!is_moved) f->ops[w++] = f->ops[k];
    }
    for (int q = 0; q < nmoved; q++) f->ops[w++] = moved[q];
    for (int k = i; k < j; k++) f->ops[k]->index = k;
  }
}

// The grouping of f's candidates as the file comment says (groups[0 .. the result), group_of[op]
// the op's group or -1); it changes nothing, so the cost pass can price the kernels before the
// pass runs (pass_fuse_plan).
static int plan_groups(const IrModule *m, const IrFunc *f, bool cpu, Group *groups, int *group_of) {
  int ngroups = 0;
  for (int b = 0; b < f->nops; b++) group_of[b] = -1;
  // Elementwise, row-wise and storing ops first, then the column sums (they join the groups made
  // by then, knowing where each of those runs).
  for (int phase = 0; phase < 2; phase++)
  for (int b = 0; b < f->nops; b++) {
    IrOp *op = f->ops[b];
    if (!candidate(f, op, cpu) || (ir_op_colsum(op->kind) >= 0) != (phase == 1)) continue;
    int join = -1;
    for (int a = 0; a < op->nargs && join < 0; a++) {   // the group of an operand's producer
      const IrValue *v = op->args[a].value;
      if (v && v->def && v->func == f && group_of[v->def->index] >= 0 && can_join(m, f, groups, group_of, &groups[group_of[v->def->index]], b, cpu))
        join = group_of[v->def->index];
    }
    for (int g = ngroups - 1; g >= 0 && join < 0; g--)   // else the latest it can join
      if (can_join(m, f, groups, group_of, &groups[g], b, cpu)) join = g;
    if (join < 0) {
      join = ngroups++;
      groups[join] = (Group){.row = -1, .colsum = ir_op_colsum(op->kind) >= 0, .store = ir_op_store(op->kind) != NULL,
                             .numel = ir_type_numel(&op->result->type), .stream = stream_of(op)};
    }
    if (ir_op_row(op->kind)) groups[join].row = groups[join].n;
    if (ir_op_colsum(op->kind) >= 0) groups[join].colsum = true;
    groups[join].member[groups[join].n++] = b;
    group_of[b] = join;
  }
  return ngroups;
}

// The floats a group's kernel moves: its distinct operands from outside the group and the
// members' results read outside it (the values that stay in registers cost nothing).
static double kernel_floats(const IrModule *m, const IrFunc *f, const Group *g) {
  const IrOperand *outside[MAX_MEMBERS * IR_MAX_ARGS];
  int nout = outside_operands(f, g, outside);
  double n = 0;
  for (int j = 0; j < nout; j++)
    n += (double)ir_type_numel(outside[j]->param ? &outside[j]->param->type : &outside[j]->value->type);
  for (int k = 0; k < g->n; k++) {
    const IrOp *op = f->ops[g->member[k]];
    if (read_outside(m, f, g, op->result)) n += (double)ir_type_numel(&op->result->type);
  }
  return n;
}

static bool gate_chain_at(const IrFunc *f, int i);

int pass_fuse_plan(const IrModule *m, const IrFunc *f, bool cpu, int *group_of, double *floats) {
  Group *groups = calloc((size_t)(f->nops > 0 ? f->nops : 1), sizeof *groups);
  if (!groups) return -1;
  int ngroups = f->nops < 2 ? 0 : plan_groups(m, f, cpu, groups, group_of), nplan = 0;
  if (f->nops < 2)
    for (int b = 0; b < f->nops; b++) group_of[b] = -1;
  for (int i = 0; !cpu && i + 2 < f->nops; i++)   // CUDA: the gate's chains, one kernel each
    if (gate_chain_at(f, i) && group_of[i] < 0 && group_of[i + 1] < 0 && group_of[i + 2] < 0) {
      groups[ngroups] = (Group){.member = {i, i + 1, i + 2}, .n = 3, .row = -1};
      for (int k = 0; k < 3; k++) group_of[i + k] = ngroups;
      ngroups++;
      i += 2;
    }
  for (int g = 0; g < ngroups; g++) {   // the groups of two or more, numbered from 0
    if (groups[g].n < 2) {
      for (int k = 0; k < groups[g].n; k++) group_of[groups[g].member[k]] = -1;
      continue;
    }
    for (int k = 0; k < groups[g].n; k++) group_of[groups[g].member[k]] = nplan;
    floats[nplan++] = kernel_floats(m, f, &groups[g]);
  }
  free(groups);
  return nplan;
}

// The kind (IrGroupKind) of a group with a column sum, a storing op or a row-wise op among its
// members (the fuse pass makes no group of two of them).
static IrGroupKind kind_with(bool colsum, bool store, bool row) {
  return colsum ? IR_GROUP_COLSUMS : store ? IR_GROUP_STORE : row ? IR_GROUP_ROWS : IR_GROUP_ELEMENTWISE;
}

static IrGroupKind kind_of(const Group *g) { return kind_with(g->colsum, g->store, g->row >= 0); }

// A group of op alone (dtype bf16: a kernel generated to write its value and its copy).
static void group_alone(IrModule *m, IrOp *op, int *next_id) {
  IrGroupKind kind = kind_with(ir_op_colsum(op->kind) >= 0, ir_op_store(op->kind) != NULL, ir_op_row(op->kind) != NULL);
  if (!ir_add_group(op->func, m, (*next_id)++, kind, op->index, 1)) UNREACHABLE();
}

static bool fuse_func(IrModule *m, IrFunc *f, PassCtx *ctx, int *next_id, int *nfused, int *ninner) {
  if (f->nops < 2) return true;
  bool cpu = ctx->fuse_cpu;
  sink_colsums(f);
  Group *groups = calloc((size_t)f->nops, sizeof *groups);
  int *group_of = malloc((size_t)f->nops * sizeof *group_of);
  IrOp **order = malloc((size_t)f->nops * sizeof *order);
  if (!groups || !group_of || !order) {
    free(groups), free(group_of), free(order);
    return ir_oom(ctx->d);
  }
  int ngroups = plan_groups(m, f, cpu, groups, group_of);
  // Numbers and inner=1, then the new order: a member of a group of two or more waits for its
  // last; then the groups into the IR, where their members now are.
  int *ids = malloc((size_t)f->nops * sizeof *ids);
  IrOp **firsts = malloc((size_t)f->nops * sizeof *firsts);
  if (!ids || !firsts) {
    free(groups), free(group_of), free(order), free(ids), free(firsts);
    return ir_oom(ctx->d);
  }
  for (int g = 0; g < ngroups; g++) {
    Group *gr = &groups[g];
    if (gr->n < 2) continue;
    ids[g] = (*next_id)++;
    firsts[g] = f->ops[gr->member[0]];
    (*nfused) += gr->n;
    for (int k = 0; k < gr->n; k++) {
      IrOp *op = f->ops[gr->member[k]];
      if (!read_outside(m, f, gr, op->result) && !(ctx->fuse_cpu && crosses_norm(f, gr, k))) {
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
  for (int g = 0; g < ngroups; g++)
    if (groups[g].n >= 2 && !ir_add_group(f, m, ids[g], kind_of(&groups[g]), firsts[g]->index, groups[g].n))
      UNREACHABLE();   // (the members are consecutive and in no other group)
  free(groups), free(group_of), free(order), free(ids), free(firsts);
  return true;
}

// dtype bf16: every GEMM operand made by an op of the step (not an argument) gets a bf16 copy
// beside it (`bf16=1` on its maker; memplan gives the copy its bytes for the value's whole life),
// so that a value is rounded once however many GEMMs read it (a saved activation is read again
// by the backward). A fused kernel writes the copy where it writes the value; an elementwise or
// row-wise op that is in no group becomes a group of its own (a kernel generated to write both);
// the copy of any other op's value is made by the program before its first GEMM.
//
// Saved activations: an elementwise member of a backward's group that reads a forward value
// (gelu_grad's pre-activation, a residual's input) reads it from a bf16 copy the forward's kernel
// writes (`bf16_reads`, a bit an operand, on the reader; `bf16=1` on the maker), so the fp32
// value dies with the forward's last reader of it. Row-wise ops (a norm's gradient), column sums
// and storing ops read fp32; so does a group in which any of them reads the value.
// MOEC_BF16_SAVED=0 in the environment leaves every saved activation in fp32 (then the program
// computes the bits of its --no-fuse build; tests/cuda/host.sh compares them).
static bool reads_element(const IrOp *op) {
  return ir_op_scalar(op->kind) && !ir_op_row(op->kind) && ir_op_colsum(op->kind) < 0 && !ir_op_store(op->kind);
}

static int saved_copies(IrModule *m, int *next_id) {
  const char *env = getenv("MOEC_BF16_SAVED");
  if (env && strcmp(env, "0") == 0) return 0;
  int n = 0;
  for (int fi = 0; fi < m->nfuncs; fi++) {
    IrFunc *h = m->funcs[fi];
    for (int i = 0; h->saves && i < h->nops; i++) {
      IrOp *op = h->ops[i];
      const IrGroup *group = ir_group_at(h, i);
      if (!group || !reads_element(op)) continue;
      for (int a = 0; a < op->nargs; a++) {
        IrValue *v = op->args[a].value;
        if (!v || v->func != h->saves || !v->def || v->type.dtype != IR_F32 || ir_op_colsum(v->def->kind) >= 0) continue;
        if (!ir_group_of(v->def) && !candidate(v->func, v->def, false)) continue;
        bool all = true;   // every member of op's group that reads v reads elements
        for (int j = group->first; j < group->first + group->n && all; j++)
          for (int b = 0; b < h->ops[j]->nargs && all; b++)
            if (h->ops[j]->args[b].value == v) all = reads_element(h->ops[j]);
        if (!all) continue;
        ir_op_set_int(op, "bf16_reads", ir_op_int(op, "bf16_reads", 0) | (1 << a));
        if (!ir_op_int(v->def, "bf16", 0)) n++;
        ir_op_set_int(v->def, "bf16", 1);
        if (!ir_group_of(v->def)) group_alone(m, v->def, next_id);   // (in h->saves: h's groups stay put)
      }
    }
  }
  return n;
}

// A fused kernel's result that is read outside its group (and that is not returned) from its
// bf16 copy only (by GEMMs, by the backward's marked readers) is stored in bf16 only: its maker
// gets `inner=1` too, so the kernel writes the copy and not the fp32 value, and memplan gives the
// value its copy's 2 bytes an element (a saved activation: 2 bytes instead of 6). Those readers
// read the copy either way, so this changes no bit.
static bool only_copies_read(const IrModule *m, const IrValue *v) {
  const IrFunc *f = v->func;
  const IrGroup *group = ir_group_of(v->def);
  for (int r = 0; r < f->nrets; r++)
    if (f->rets[r] == v) return false;
  for (int fi = 0; fi < m->nfuncs; fi++) {
    const IrFunc *h = m->funcs[fi];
    if (h != f && h->saves != f) continue;
    for (int i = 0; i < h->nops; i++) {
      const IrOp *op = h->ops[i];
      for (int a = 0; a < op->nargs; a++)
        if (op->args[a].value == v && !pass_reads_copy(op, a) && !(h == f && ir_group_at(h, i) == group))
          return false;
    }
  }
  return true;
}

bool pass_writes_copy(const IrOp *op) {
  return ir_op_int(op, "bf16", 0) && ir_group_of(op) && ir_op_colsum(op->kind) < 0;
}

bool pass_reads_copy(const IrOp *op, int a) {
  const IrValue *v = a < op->nargs ? op->args[a].value : NULL;
  if (!v || !v->def) return false;
  if ((op->kind == IR_OP_MATMUL || op->kind == IR_OP_EXPERT_MATMUL) && a < 2) return pass_writes_copy(v->def);
  return (ir_op_int(op, "bf16_reads", 0) >> a) & 1;
}

static int bf16_copies(IrModule *m, int *next_id, int *saved, int *only) {
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
        if (!ir_group_of(maker) && ir_op_colsum(maker->kind) < 0 && candidate(v->func, maker, false))
          group_alone(m, maker, next_id);
      }
    }
  }
  *saved = saved_copies(m, next_id);
  for (int fi = 0; fi < m->nfuncs; fi++)
    for (int i = 0; i < m->funcs[fi]->nops; i++) {
      IrOp *op = m->funcs[fi]->ops[i];
      if (pass_writes_copy(op) && !ir_op_int(op, "inner", 0) && only_copies_read(m, op->result)) {
        ir_op_set_int(op, "inner", 1);
        (*only)++;
      }
    }
  return n;
}

// ---- the groups of other kernels ----

// CUDA: ops i, i+1, i+2 of f are `scores = gate.softmax|gate.sigmoid x`, `idx = gate.topk scores`,
// `gates = gate.gather scores, idx` (one expert group, scale 1; f32 scores of rank 2) on one stream
// with no event recorded or waited for between them: one kernel does the three, a thread a token
// (codegen/lower.c). A thread writes its token's scores, idx and gates while others read the
// logits: memplan keeps the four tensors apart, as it does the inputs and results of any group.
static bool gate_chain_at(const IrFunc *f, int i) {
  if (i + 2 >= f->nops || ir_group_at(f, i) || ir_group_at(f, i + 1) || ir_group_at(f, i + 2)) return false;
  const IrOp *a = f->ops[i], *b = f->ops[i + 1], *c = f->ops[i + 2];
  if ((a->kind != IR_OP_GATE_SOFTMAX && a->kind != IR_OP_GATE_SIGMOID) || b->kind != IR_OP_GATE_TOPK ||
      c->kind != IR_OP_GATE_GATHER)
    return false;
  if (!a->args[0].value || b->args[0].value != a->result || c->args[0].value != a->result || c->args[1].value != b->result)
    return false;
  if (a->result->type.rank != 2 || a->result->type.dtype != IR_F32) return false;
  if (ir_op_int(b, "expert_groups", 1) > 1 || ir_op_float(c, "scale", 1) != 1) return false;   // the plain chain only
  return b->stream == a->stream && c->stream == a->stream && a->event < 0 && b->event < 0 && b->nwaits == 0 &&
         c->nwaits == 0;
}

// The CPU: whether group g of f runs row by row in the pieces of the GEMM just before it, as each
// piece's thread finishes its rows (rt_matmul_rows, rt_expert_matmul_rows): a group of elementwise
// ops and norms over rows as long as the product's that reads the product only row by row (a
// norm's rows, an elementwise op's element; its other operands are complete before the GEMM
// starts), with no event or stream between the two. An expert GEMM's only with ta = 0 (its rows
// are the slots). memplan keeps the group's results apart from the GEMM's operands and product,
// which other pieces still read. MOEC_GEMM_ROWS=0 in the environment runs every group after its
// GEMM instead (for comparison).
static bool runs_in_gemm(const IrFunc *f, const IrGroup *g) {
  const char *env = getenv("MOEC_GEMM_ROWS");
  if ((env && strcmp(env, "0") == 0) || g->first == 0 || (g->kind != IR_GROUP_ELEMENTWISE && g->kind != IR_GROUP_ROWS))
    return false;
  const IrOp *gemm = f->ops[g->first - 1], *first = f->ops[g->first];
  bool expert = gemm->kind == IR_OP_EXPERT_MATMUL;
  if ((gemm->kind != IR_OP_MATMUL && !(expert && !ir_op_int(gemm, "ta", 0))) || ir_group_at(f, g->first - 1) ||
      gemm->event >= 0 || first->nwaits > 0 || gemm->stream != first->stream)
    return false;
  const IrValue *product = gemm->result;
  const IrType *pt = &product->type, *rt = &first->result->type;
  if (pt->rank != (expert ? 3 : 2) || rt->rank < 1 || rt->dim[rt->rank - 1] != pt->dim[pt->rank - 1] ||
      ir_type_numel(rt) != ir_type_numel(pt))
    return false;
  bool reads = false;
  for (int i = g->first; i < g->first + g->n; i++) {
    const IrOp *op = f->ops[i];
    for (int k = 0; k < op->nargs; k++) {
      if (op->args[k].param || op->args[k].value != product) continue;
      reads = true;
      if (ir_op_row(op->kind)) continue;   // a norm reads its operand's rows
      if (!ir_scalar_reads_element(op->kind, k) || ir_type_numel(&op->result->type) != ir_type_numel(pt)) return false;
    }
  }
  return reads;
}

// The groups of f that are not the element-by-element kernels above: on CUDA the gate's chain and
// each run of updates that can share a launch (a function on one stream: the run's table of
// ranges, codegen/lower.c), on the CPU which groups run in a GEMM's pieces.
static void other_groups(IrModule *m, IrFunc *f, bool cpu, int *next_id, int *ngate, int *nupdate, int *ngemm) {
  if (cpu) {
    for (int k = 0; k < f->ngroups; k++)
      if ((f->groups[k].in_gemm = runs_in_gemm(f, &f->groups[k]))) (*ngemm)++;
    return;
  }
  bool updates = !ir_func_concurrent(f);
  for (int i = 0; i < f->nops; i++) {
    const IrOp *a = f->ops[i];
    if (gate_chain_at(f, i)) {
      ir_add_group(f, m, (*next_id)++, IR_GROUP_GATE, i, 3);
      (*ngate)++;
      i += 2;
    } else if (updates && (a->kind == IR_OP_OPT_SGD || a->kind == IR_OP_OPT_ADAMW) && !ir_group_at(f, i)) {
      int n = 1;
      while (i + n < f->nops && !ir_group_at(f, i + n) && ir_update_joins(a, f->ops[i + n])) n++;
      ir_add_group(f, m, (*next_id)++, IR_GROUP_UPDATE, i, n);
      (*nupdate)++;
      i += n - 1;
    }
  }
}

bool pass_fuse(IrModule *m, PassCtx *ctx) {
  if (!ctx->fuse) return true;
  for (int fi = 0; fi < m->nfuncs; fi++)   // IR read back with its groups: fused already, as it says
    if (m->funcs[fi]->ngroups > 0) {
      if (ctx->verbose) fprintf(ctx->log ? ctx->log : stderr, "# fuse: the module holds fused groups already; left as it is\n");
      return true;
    }
  int next_id = 0, nfused = 0, ninner = 0, ngate = 0, nupdate = 0, ngemm = 0;
  for (int fi = 0; fi < m->nfuncs; fi++)
    if (!fuse_func(m, m->funcs[fi], ctx, &next_id, &nfused, &ninner)) return false;
  int only = 0, saved = 0;
  int copies = !ctx->fuse_cpu && strcmp(ir_mod_str(m, "dtype", "fp32"), "bf16") == 0 ? bf16_copies(m, &next_id, &saved, &only) : 0;
  if (ctx->verbose && copies)
    fprintf(ctx->log ? ctx->log : stderr,
            "# fuse: dtype bf16: %d GEMM operands and %d more saved activations with a bf16 copy beside them, %d "
            "values stored in bf16 only (only their copies are read)\n", copies, saved, only);
  int nelement = next_id;
  for (int fi = 0; fi < m->nfuncs; fi++) other_groups(m, m->funcs[fi], ctx->fuse_cpu, &next_id, &ngate, &nupdate, &ngemm);
  FILE *log = ctx->log ? ctx->log : stderr;
  if (ctx->verbose)
    fprintf(log, "# fuse: %d ops in %d fused kernels; %d of their results never leave the kernel\n", nfused, nelement,
            ninner);
  if (ctx->verbose && ctx->fuse_cpu)
    fprintf(log, "# fuse: %d of those run in the pieces of the GEMM before them\n", ngemm);
  else if (ctx->verbose)
    fprintf(log, "# fuse: %d gate chains (softmax or sigmoid, top-k, gather) and %d runs of updates, one launch each\n",
            ngate, nupdate);
  return true;
}
