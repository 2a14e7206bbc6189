// Layer 5 of codegen/: the launch list of a module, each op lowered once. cg_lower_module walks
// every function in program order and lowers each op (lower.c) or fused group (fused.c) into one
// CgLaunch; the CUDA emitters (emit_cuda.c, emit_cuda_host.c) and the CPU emitter (emit_c.c) all
// read that one list. Also which kernels a list names (cg_cuda_kernels_used).
// It may call layers 1-4 (facts.c, kernels.c, lower.c, fused.c); no emitter.
#include <stdlib.h>
#include <string.h>

#include "cg_internal.h"

// c: kernel (mk_expert_rows_fill or _zero) over the launch's counts and its result, a block of rows
// rows of cwidth columns per group.
static void rows_kernel(CgKernelCall *c, CgKernel kernel, int64_t groups, int64_t rows, int64_t cwidth) {
  *c = (CgKernelCall){.kernel = kernel, .grid = cg_cuda_grid_blocks(groups * rows), .nargs = 5};   // a block a row
  c->args[0] = (CgArg){.kind = CG_ARG_SCRATCH};
  c->args[1] = (CgArg){.kind = CG_ARG_RESULT};
  c->args[2] = (CgArg){.kind = CG_ARG_INT, .i = groups};
  c->args[3] = (CgArg){.kind = CG_ARG_INT, .i = rows};
  c->args[4] = (CgArg){.kind = CG_ARG_INT, .i = cwidth};
}

// The launch (before launch k) that counted the rows of expert GEMM result h (ta 0, on stream
// s): h's own (its mk_expert_counts), or, for one that reads another's counts (SwiGLU's x W3 after
// x W1: rows_from, its rows past them zeroed), that one's; -1 when there is none.
static int counted_gemm(const CgFuncLaunches *fl, int k, const IrValue *h, int s) {
  if (h && h->def && h->def->kind == IR_OP_EXPERT_BIAS) h = h->def->args[0].value;
  if (!h || !h->def || h->def->kind != IR_OP_EXPERT_MATMUL || cg_op_stream(h->def) != s) return -1;
  for (int j = 0; j < k; j++) {
    const CgLaunch *l = &fl->launch[j];
    if (fl->at[j] != h->def->index) continue;
    if (cg_counts_rows(l)) return j;
    if (l->rows_zero && l->rows_from > 0 && cg_counts_rows(&fl->launch[l->rows_from - 1])) return l->rows_from - 1;
  }
  return -1;
}

// The launch (before launch k) whose mk_expert_counts counted the rows of the expert GEMMs
// behind operand x of op: x = act(h + b1) or act(h) (an activation of one operand, after
// expert.bias or not) with h the result of an expert GEMM (ta 0) whose rows a launch counted, on
// op's stream; or x = act.oss(h1 + b1, h3 + b3) (gpt-oss's experts) with both counted by the same
// launch. -1 when there is none. Its empty rows all hold the activation of the biases (the count
// kernel zeroed h's rows past the counts, mk_expert_rows_zero h3's).
static int counted_before_act(const CgFuncLaunches *fl, int k, const IrOp *op, const IrOperand *x) {
  const IrOp *a = x->value ? x->value->def : NULL;
  if (!a || strncmp(ir_op_info[a->kind].name, "act.", 4) != 0 || strstr(ir_op_info[a->kind].name, ".grad"))
    return -1;
  int s = cg_op_stream(op);
  if (a->nargs == 1) return counted_gemm(fl, k, a->args[0].value, s);
  if (strcmp(ir_op_info[a->kind].name, "act.oss") != 0 || a->nargs != 2) return -1;
  int j1 = counted_gemm(fl, k, a->args[0].value, s), j3 = counted_gemm(fl, k, a->args[1].value, s);
  return j1 >= 0 && j1 == j3 ? j1 : -1;
}

// The forward's second expert GEMM, over act(h + b1) (not zero in the empty slots), multiplies the
// rows the first one's count kernel counted plus one (the first empty row: act(b1)), and
// mk_expert_rows_fill copies that row's product into the other empty rows, which is what the CPU
// program's GEMM gives them (it copies a repeated row's product: runtime/kernels/ffn.c).
static void share_counts_act(const IrFunc *f, CgFuncLaunches *fl) {
  for (int k = 0; k < fl->n; k++) {
    CgLaunch *l = &fl->launch[k];
    const IrOp *op = f->ops[fl->at[k]];
    if (l->lib != CG_LIB_GEMM || l->ncalls || l->rows_from || op->kind != IR_OP_EXPERT_MATMUL || ir_op_int(op, "ta", 0) ||
        ir_op_int(op, "tb", 0) || op->args[0].param)
      continue;
    int j = counted_before_act(fl, k, op, &op->args[0]);
    if (j < 0) continue;
    const CgKernelCall *counts = &fl->launch[j].call[0];   // x, scratch, c, groups, rows, width, cwidth
    int64_t groups = counts->args[3].i, rows = counts->args[4].i;
    if (groups * rows != cg_gemm(op).e * cg_gemm(op).m) continue;
    rows_kernel(&l->call[0], CG_K_EXPERT_ROWS_FILL, groups, rows, cg_gemm(op).n);
    l->ncalls = 1;
    l->rows_from = j + 1;
    l->rows_plus = true;
    snprintf(l->note, sizeof l->note, "over the rows launch %d counted, plus one", j);
  }
}

// A weight gradient over the filled rows of a value that an earlier GEMM of f counted on the same
// stream (the backward's dY W^T and X^T dY both count dY) reads that count instead of its own (a
// GEMM with ta 0 counts itself: its count kernel zeroes its result's rows past the counts).
// A GEMM with ta 0 over a value an earlier one counted (SwiGLU's x W3 after x W1) reads that count
// too, and mk_expert_rows_zero zeroes its result's rows past it (what its own count kernel did).
static void share_counts(const IrFunc *f, CgFuncLaunches *fl) {
  for (int k = 0; k < fl->n; k++) {
    CgLaunch *l = &fl->launch[k];
    if (!cg_counts_rows(l)) continue;
    const IrOp *op = f->ops[fl->at[k]];
    bool ta = ir_op_int(op, "ta", 0);
    const IrOperand *x = &op->args[l->rows_operand];
    for (int j = 0; j < k; j++) {
      const CgLaunch *p = &fl->launch[j];
      if (!cg_counts_rows(p)) continue;
      const IrOp *q = f->ops[fl->at[j]];
      const IrOperand *y = &q->args[p->rows_operand];
      bool same = y->value == x->value && cg_op_stream(q) == cg_op_stream(op);
      for (int a = 3; same && a < 6; a++) same = p->call[0].args[a].i == l->call[0].args[a].i;   // groups rows width
      if (!same) continue;
      int64_t groups = l->call[0].args[3].i, rows = l->call[0].args[4].i, cwidth = l->call[0].args[6].i;
      l->ncalls = 0;
      l->scratch_bytes = 0;
      l->rows_from = j + 1;
      snprintf(l->note, sizeof l->note, "over the filled rows of %%%s that launch %d counted", x->value->name, j);
      if (!ta) {   // its rows past the counts zeroed after the GEMM
        rows_kernel(&l->call[0], CG_K_EXPERT_ROWS_ZERO, groups, rows, cwidth);
        l->ncalls = 1;
        l->rows_zero = true;
      }
      break;
    }
  }
}

// ---- the kernels over expert slots: the rows past the counts (CG_LOWER_ROWS) ----
// The counts a GEMM's count kernel writes bound more than its operand: its result (ta 0) is zero
// at and past them, and so is an elementwise op that keeps zero rows zero of such a value (a
// product with it, an activation's gradient of it, an activation that is 0 at 0 of it, a sum of
// two). Counts from the routing (mk_expert_counts_route) bound every slot row an order reads: the
// rows past them are empty slots, whatever they hold. filled_rows finds, per function in program
// order, the values zero past launch j's counts (zp[v] = j) and the values over the slots of
// routing counts j (over[v] = j: a GEMM's result over them, an elementwise op of such values), and:
//   - a GEMM that would count a zero-past value again reads launch j's counts instead (no second scan);
//   - a fused group reading such values takes the counts (CgGuard: rows_guard) and reads the zero
//     ones as 0.0f past the counts, without loading them (a group over routing counts' values
//     alone takes a guard only to skip: CgGuard.route);
//   - a value whose every reader reads only the rows below the same counts is not written past
//     them (the module's fixed point below): its count kernel does not zero the GEMM's rows
//     (cwidth < 0), mk_expert_rows_zero zeroes none, mk_expert_rows_fill is not run (the forward's
//     second GEMM still multiplies the counts plus one: the CPU program's GEMM multiplies the row
//     act(b1), so the fake device's equals it), a group all of whose results are such values skips
//     those rows (rows_skip; past the counts plus one where such a GEMM reads them: CgGuard.plus). The readers that read only below the counts: such groups (a zero operand, or any
//     operand of a group that skips), a GEMM over the counted rows (A of ta 0; a weight gradient
//     when row 0 of every block holds the padded program's value: an empty block's K is 1), the
//     order ops over the same routing (they read the routed rows). A GEMM result left past the
//     counts has row 0 of an empty block zeroed all the same (by its count kernel, or
//     mk_expert_rows_zero of a block of threads a block of slots). Counts are the same across
//     functions (the backward's of the forward's values) only when both come from the same routing.

// The launch whose counts bound GEMM launch k's rows (its own count kernel, or the one it reads),
// -1 when it runs over every slot.
static int count_source(const CgFuncLaunches *fl, int k) {
  const CgLaunch *l = &fl->launch[k];
  if (l->lib != CG_LIB_GEMM) return -1;
  if (l->rows_from > 0) return l->rows_from - 1;
  return cg_counts_rows(l) ? k : -1;
}

typedef struct Filled {
  const IrModule *m;
  const IrFunc *f;
  CgFuncLaunches *fl;
  int *zp;          // by value id of f: the launch whose counts it is zero at and past, -1 none
  int *over;        // by value id of f: the routing counts' launch whose slots it is over, -1 none
  bool *clean;      // by value id of f: row 0 of each block holds the padded program's value
  int *launch_of;   // by op index of f: the launch that runs it
  CgGuard *guard;   // by launch: the guard its fused group takes (nzero 0 and !route: none)
  int *from;        // by launch: the count launch of its guard
  bool *lazy;       // by launch: a GEMM's result or a guarded group's results not written past the counts
  bool alone;       // an op alone may take a guard too (CG_LOWER_FUSE: a generated kernel of one op)
  struct Filled *all;   // every function's, by function index
} Filled;

static int64_t count_groups(const Filled *F, int j) { return F->fl->launch[j].call[0].args[3].i; }
static int64_t count_rows(const Filled *F, int j) { return F->fl->launch[j].call[0].args[4].i; }
static IrStream launch_stream(const Filled *F, int k) { return cg_op_stream(F->f->ops[F->fl->at[k]]); }
static bool guarded(const CgGuard *g) { return g->nzero > 0 || g->route; }

// Whether value v is [E, S, ...] with E S the blocks of slots launch j counts.
static bool fits(const Filled *F, const IrValue *v, int j) {
  const IrType *t = &v->type;
  return t->rank == 3 && t->dim[0] * t->dim[1] == count_groups(F, j) * count_rows(F, j);
}

// The routing (idx and loc values) of count launch j when its counts come from it.
static bool route_values(const Filled *F, int j, const IrValue **idx, const IrValue **loc) {
  const CgLaunch *l = &F->fl->launch[j];
  if (!cg_counts_rows(l) || l->call[0].kernel != CG_K_EXPERT_COUNTS_ROUTE) return false;
  const CgArg *a = &l->call[0].args[0], *b = &l->call[0].args[8];
  *idx = F->f->ops[F->fl->at[j] + a->i]->args[a->index].value;
  *loc = F->f->ops[F->fl->at[j] + b->i]->args[b->index].value;
  return true;
}
static bool routed(const Filled *F, int j) {
  const IrValue *idx, *loc;
  return j >= 0 && route_values(F, j, &idx, &loc);
}

// Whether count launch j of F and j2 of G give the same counts: the same launch, or both from the
// same routing over blocks of the same slots.
static bool same_counts(const Filled *F, int j, const Filled *G, int j2) {
  if (j < 0 || j2 < 0) return false;
  if (F == G && j == j2) return true;
  const IrValue *i1, *l1, *i2, *l2;
  return route_values(F, j, &i1, &l1) && route_values(G, j2, &i2, &l2) && i1 == i2 && l1 == l2 &&
         count_groups(F, j) == count_groups(G, j2) && count_rows(F, j) == count_rows(G, j2);
}

static int zp_of(const Filled *F, const IrOperand *a) {
  return a->value && a->value->func == F->f ? F->zp[a->value->id] : -1;
}
static int over_of(const Filled *F, const IrOperand *a) {
  return a->value && a->value->func == F->f ? F->over[a->value->id] : -1;
}
static bool clean_of(const Filled *F, const IrOperand *a) {
  if (!a->value) return true;
  const Filled *V = &F->all[a->value->func->index];
  return V->clean[a->value->id];
}

// The launch whose counts op's result is zero past (its operands' and the op's math), -1 none.
static int op_zero_rows(const Filled *F, const IrOp *op) {
  if (!op->result || op->nargs < 1) return -1;
  const char *name = ir_op_info[op->kind].name;
  int j = -1;
  if (op->kind == IR_OP_MUL && op->nargs == 2) {
    j = zp_of(F, &op->args[0]);
    if (j < 0) j = zp_of(F, &op->args[1]);
  } else if (op->kind == IR_OP_ADD && op->nargs == 2) {
    j = zp_of(F, &op->args[0]) == zp_of(F, &op->args[1]) ? zp_of(F, &op->args[0]) : -1;
  } else if (strncmp(name, "act.", 4) == 0 && strstr(name, ".grad")) {   // (dy, ...): 0 where dy is
    j = zp_of(F, &op->args[0]);
  } else if (op->kind == IR_OP_ACT_GELU || op->kind == IR_OP_ACT_RELU || op->kind == IR_OP_ACT_SILU ||
             op->kind == IR_OP_ACT_RELU2 || op->kind == IR_OP_ACT_OSS) {   // 0 at 0 (act.oss: of its gate)
    j = zp_of(F, &op->args[0]);
  }
  if (j < 0 || !fits(F, op->result, j) || cg_op_stream(op) != launch_stream(F, j)) return -1;
  for (int a = 0; a < op->nargs; a++)   // elementwise, no broadcast
    if (zp_of(F, &op->args[a]) == j && ir_type_numel(cg_operand_type(&op->args[a])) != ir_type_numel(&op->result->type))
      return -1;
  return j;
}

// The routing counts' launch whose slots elementwise op's result is over (an operand over them or
// zero past them, each such operand the result's size), -1 none.
static int op_over(const Filled *F, const IrOp *op) {
  if (!op->result || !ir_op_scalar(op->kind) || ir_op_row(op->kind) || ir_op_store(op->kind)) return -1;
  int j = -1;
  for (int a = 0; a < op->nargs && j < 0; a++) {
    int z = over_of(F, &op->args[a]);
    if (z < 0 && routed(F, zp_of(F, &op->args[a]))) z = zp_of(F, &op->args[a]);
    j = z;
  }
  if (j < 0 || !fits(F, op->result, j) || cg_op_stream(op) != launch_stream(F, j)) return -1;
  for (int a = 0; a < op->nargs; a++)
    if ((over_of(F, &op->args[a]) == j || zp_of(F, &op->args[a]) == j) &&
        ir_type_numel(cg_operand_type(&op->args[a])) != ir_type_numel(&op->result->type))
      return -1;
  return j;
}

// GEMM launch k counted an operand that launch j's counts already bound: it reads those instead
// (a GEMM with ta 0 then zeroes its result's rows past them with mk_expert_rows_zero, as its count
// kernel did), and so do the launches that read k's.
static void share_zero_counts(Filled *F, int k, int j) {
  CgLaunch *l = &F->fl->launch[k];
  const IrOp *op = F->f->ops[F->fl->at[k]];
  int64_t groups = l->call[0].args[3].i, rows = l->call[0].args[4].i, cwidth = l->call[0].args[6].i;
  l->ncalls = 0;
  l->scratch_bytes = 0;
  l->rows_from = j + 1;
  if (!ir_op_int(op, "ta", 0)) {
    rows_kernel(&l->call[0], CG_K_EXPERT_ROWS_ZERO, groups, rows, cwidth);
    l->ncalls = 1;
    l->rows_zero = true;
  }
  snprintf(l->note, sizeof l->note, "over the rows launch %d counted (its operand is zero past them)", j);
  for (int m = k + 1; m < F->fl->n; m++) {
    CgLaunch *r = &F->fl->launch[m];
    if (r->rows_from != k + 1) continue;
    r->rows_from = j + 1;
    snprintf(r->note, sizeof r->note, "over the rows launch %d counted%s", j, r->rows_plus ? ", plus one" : "");
  }
}

// The values zero past counts (F->zp) and over routing counts' slots (F->over), in program order,
// and the GEMMs that count them again reading those counts instead.
static void zero_rows(Filled *F) {
  const IrFunc *f = F->f;
  for (int k = 0; k < F->fl->n; k++) {
    CgLaunch *l = &F->fl->launch[k];
    const IrOp *op = f->ops[F->fl->at[k]];
    if (l->lib == CG_LIB_GEMM && op->kind == IR_OP_EXPERT_MATMUL) {
      int j = count_source(F->fl, k);
      if (j == k) {   // its own count kernel, over operand x
        const IrOperand *x = &op->args[l->rows_operand];
        int z = zp_of(F, x);
        if (z >= 0 && z != k && count_groups(F, z) == count_groups(F, k) && count_rows(F, z) == count_rows(F, k) &&
            launch_stream(F, z) == launch_stream(F, k)) {
          share_zero_counts(F, k, z);
          j = z;
        } else if (z < 0 && x->value && x->value->func == f && fits(F, x->value, k)) {
          F->zp[x->value->id] = k;   // the value it counts (from here on)
        }
      }
      if (j >= 0 && op->result && !ir_op_int(op, "ta", 0) && fits(F, op->result, j)) {
        if (!l->rows_plus) F->zp[op->result->id] = j;
        if (routed(F, j)) F->over[op->result->id] = j;
      }
      continue;
    }
    for (int i = F->fl->at[k]; i < F->fl->at[k] + l->nops; i++)
      if (f->ops[i]->result) {
        F->zp[f->ops[i]->result->id] = op_zero_rows(F, f->ops[i]);
        F->over[f->ops[i]->result->id] = op_over(F, f->ops[i]);
      }
  }
}

// The guard each fused group can take: the counts of the first operand from outside that is zero
// past counts an earlier launch made, and every such operand of the same counts; else, to skip,
// the routing counts of the first operand from outside over their slots.
static void guards(Filled *F) {
  const IrFunc *f = F->f;
  for (int k = 0; k < F->fl->n; k++) {
    const CgLaunch *l = &F->fl->launch[k];
    int i = F->fl->at[k], n = cg_fused_members(f, i);
    if (n == 0 && F->alone && l->lib == CG_LIB_NONE && l->nops == 1 && l->ncalls == 1) n = 1;   // (cg_fused_guardable says)
    CgGuard *g = &F->guard[k];
    int j = -1, route = -1;
    for (int m = i; m < i + n; m++)
      for (int a = 0; a < f->ops[m]->nargs; a++) {
        const IrOperand *x = &f->ops[m]->args[a];
        if (!x->value || (x->value->def && x->value->def->index >= i)) continue;   // from inside
        int o = over_of(F, x), z = zp_of(F, x);
        if (route < 0 && o >= 0 && o < k) route = o;
        if (z < 0 || z >= k || (j >= 0 && z != j)) continue;
        if (cg_guard_zero(g, x->value) || g->nzero == (int)(sizeof g->zero / sizeof g->zero[0])) continue;
        j = z;
        g->zero[g->nzero++] = x->value;
      }
    if (j < 0 && route >= 0) j = route, g->route = true;
    if (j < 0 || launch_stream(F, j) != cg_op_stream(f->ops[i])) {
      *g = (CgGuard){0};
      continue;
    }
    g->groups = count_groups(F, j), g->rows = count_rows(F, j);
    if (!cg_fused_guardable(f, i, g)) *g = (CgGuard){0};
    else F->from[k] = j;
  }
}

// Whether every reader of value v (of F's function, over launch j's slots) reads only the rows
// below j's counts, with the lazy flags as they stand.
static bool unread_past(const Filled *F, const IrValue *v, int j) {
  if (!fits(F, v, j)) return false;
  for (int r = 0; r < F->f->nrets; r++)
    if (F->f->rets[r] == v) return false;
  int made = v->def ? F->launch_of[v->def->index] : -1;
  const IrValue *idx = NULL, *loc = NULL;
  route_values(F, j, &idx, &loc);
  for (int fi = 0; fi < F->m->nfuncs; fi++) {
    const Filled *G = &F->all[fi];
    const IrFunc *g = G->f;
    for (int i = 0; i < g->nops; i++) {
      const IrOp *op = g->ops[i];
      for (int a = 0; a < op->nargs; a++) {
        if (op->args[a].value != v) continue;
        int k = G->launch_of[i];
        const CgLaunch *l = &G->fl->launch[k];
        if (G == F && k == made) continue;   // inside the group that makes it: at the rows it computes
        // The orders over the same routing read the routed rows (their slot operand: y, dy, ddisp).
        bool order = (op->kind == IR_OP_ORDER_DECODE && a == 0) || (op->kind == IR_OP_ORDER_ENCODE_GRAD && a == 0);
        if (idx && order && op->args[1].value == idx && op->args[2].value == loc) continue;
        if (idx && op->kind == IR_OP_ORDER_DECODE_GRAD_G && a == 1 && op->args[2].value == idx &&
            op->args[3].value == loc)
          continue;
        // a guarded group: v read as zeros past the counts, or a group that skips (reads the rows it
        // computes: not past the counts, unless they are plus one)
        if (guarded(&G->guard[k]) && same_counts(F, j, G, G->from[k]) &&
            (cg_guard_zero(&G->guard[k], v) || (G->lazy[k] && !G->guard[k].plus)))
          continue;
        int src = count_source(G->fl, k);
        if (l->lib != CG_LIB_GEMM || op->kind != IR_OP_EXPERT_MATMUL || !same_counts(F, j, G, src) ||
            (G == F && src == k && !routed(F, j)))
          return false;
        // over the counts plus one (act(h + b1)): of a group that computes those rows
        if (l->rows_plus && !(G == F && made >= 0 && guarded(&F->guard[made]) && F->guard[made].plus)) return false;
        if (!ir_op_int(op, "ta", 0) && a != 0) return false;   // B of a GEMM: read whole
        // A weight gradient of an empty block sums one row, row 0.
        if (ir_op_int(op, "ta", 0) && !clean_of(G, &op->args[a])) return false;
      }
    }
  }
  return true;
}

// The bytes of guarded kernel call c (of the group at op i) over rows it moves only below the
// counts: the operands it reads as zeros past them, and with skip every argument over the slots.
static double guarded_bytes(const IrFunc *f, int i, const CgKernelCall *c, const CgGuard *g) {
  double bytes = 0.0;
  for (int a = 0; a < c->nargs; a++) {
    const CgArg *x = &c->args[a];
    const IrValue *v = NULL;
    double scale = 1.0;   // a bf16 copy's: half
    if (x->kind == CG_ARG_OPERAND || x->kind == CG_ARG_OPERAND16) v = f->ops[i + x->i]->args[x->index].value;
    else if (x->kind == CG_ARG_RESULT || x->kind == CG_ARG_COPY) v = f->ops[i + x->index]->result;
    if (!v) continue;
    if (x->kind == CG_ARG_OPERAND16 || x->kind == CG_ARG_COPY) scale = 0.5;
    bool zero = cg_guard_zero(g, v), slots = v->type.rank == 3 && v->type.dim[0] * v->type.dim[1] == g->groups * g->rows;
    if (zero || (g->skip && slots)) bytes += scale * (double)ir_type_bytes(&v->type);
  }
  return bytes;
}

// MOEC_ROWS_UNREAD=all, a test hook: every candidate value taken as unread past the counts (wrong
// where a reader reads them; the fake device's NaN there shows it: tests/cuda/host.sh).
static bool lazy(const Filled *F, const IrValue *v, int j) {
  const char *hook = getenv("MOEC_ROWS_UNREAD");
  return v && ((hook && strcmp(hook, "all") == 0 && fits(F, v, j)) || unread_past(F, v, j));
}

// The GEMM launches whose result may be left past the counts: an expert GEMM (ta 0) over counted
// rows (the forward's second one, over act(h + b1) and its counts plus one, only over routing
// counts: it still multiplies the row past them, act(b1)'s, as the CPU program's GEMM does, and
// mk_expert_rows_fill is not run).
static bool lazy_gemm(const Filled *F, int k) {
  const CgLaunch *l = &F->fl->launch[k];
  const IrOp *op = F->f->ops[F->fl->at[k]];
  int j = count_source(F->fl, k);
  return j >= 0 && op->kind == IR_OP_EXPERT_MATMUL && op->result && !ir_op_int(op, "ta", 0) &&
         (!l->rows_plus || routed(F, j));
}

// The routing counts' launch (*j) of launch k when it is an order's (order.encode or
// order.decode.grad_y alone, or as a group of one writing its bf16 copy) after its slot map
// (CG_LOWER_MAP: only the map tells a block whether its rows are past the counts) whose result
// (*v) a GEMM counts from the same routing: a launch that may write no row past those counts.
static bool order_rows(const Filled *F, int k, const IrValue **v, int *j) {
  const CgLaunch *l = &F->fl->launch[k];
  const IrOp *op = F->f->ops[F->fl->at[k]];
  if (!cg_slot_map_op(op) || l->lib != CG_LIB_NONE || l->nops != 1 || l->ncalls != 2 ||
      l->call[0].kernel != CG_K_SLOT_MAP || !op->result)
    return false;
  bool library = l->call[1].kernel == CG_K_ORDER_ENCODE_MAP || l->call[1].kernel == CG_K_ORDER_DECODE_GRAD_Y_MAP;
  if (!library && !(l->call[1].kernel >= CG_K_COUNT && F->alone)) return false;
  const IrValue *idx, *loc;
  int z = F->zp[op->result->id];
  if (z < 0 || !route_values(F, z, &idx, &loc) || idx != op->args[1].value || loc != op->args[2].value) return false;
  *v = op->result, *j = z;
  return true;
}

// The results of group launch k that skipping it would leave past the counts.
static bool group_result(const IrOp *op) {
  return op->result && ir_op_colsum(op->kind) < 0 && (!ir_op_int(op, "inner", 0) || pass_writes_copy(op));
}

// Row 0 of each block of f's values, with the lazy flags as they stand (program order).
static void clean_rows(Filled *F) {
  const IrFunc *f = F->f;
  for (int v = 0; v < f->nvalues; v++) F->clean[v] = true;
  for (int k = 0; k < F->fl->n; k++) {
    const CgLaunch *l = &F->fl->launch[k];
    int i = F->fl->at[k];
    const IrOp *op = f->ops[i];
    if (l->lib == CG_LIB_GEMM) {   // zeroed or filled past the counts, unless left; filled: act(b1)'s product
      // (a result left past the counts still has an empty block's row 0 zeroed)
      if (op->result && lazy_gemm(F, k) && l->rows_plus) F->clean[op->result->id] = clean_of(F, &op->args[0]);
      continue;
    }
    if (l->lib) continue;
    bool c = true;   // each row of an elementwise kernel's results from the same rows of its operands
    for (int m = i; m < i + l->nops; m++)
      for (int a = 0; a < f->ops[m]->nargs; a++) {
        const IrOperand *x = &f->ops[m]->args[a];
        if (!x->value || (x->value->func == f && x->value->def && x->value->def->index >= i)) continue;
        if (!(guarded(&F->guard[k]) && cg_guard_zero(&F->guard[k], x->value))) c = c && clean_of(F, x);
      }
    bool rowwise = true;
    for (int m = i; m < i + l->nops; m++) rowwise = rowwise && ir_op_scalar(f->ops[m]->kind) && !ir_op_row(f->ops[m]->kind);
    for (int m = i; m < i + l->nops; m++)
      if (f->ops[m]->result) F->clean[f->ops[m]->result->id] = rowwise ? c : true;
  }
}

// The lazy flags of every function: the greatest set in which each flagged value's readers read
// only below its counts (every flag set, then cleared where a reader reads past, until none is).
static void fixed_point(Filled *all, int nfuncs) {
  for (int fi = 0; fi < nfuncs; fi++) {
    Filled *F = &all[fi];
    for (int k = 0; k < F->fl->n; k++) {
      const IrValue *v;
      int j;
      F->lazy[k] = lazy_gemm(F, k) || guarded(&F->guard[k]);
      if (order_rows(F, k, &v, &j)) F->lazy[k] = true, F->from[k] = j;
      const IrOp *op = F->f->ops[F->fl->at[k]];   // a group a GEMM over the counts plus one reads: plus
      const IrValue *x = op->nargs > 0 ? op->args[0].value : NULL;
      if (F->fl->launch[k].rows_plus && x && x->func == F->f && x->def && guarded(&F->guard[F->launch_of[x->def->index]]))
        F->guard[F->launch_of[x->def->index]].plus = true;
    }
  }
  for (bool again = true; again;) {
    again = false;
    for (int fi = 0; fi < nfuncs; fi++) clean_rows(&all[fi]);
    for (int fi = 0; fi < nfuncs; fi++) {
      Filled *F = &all[fi];
      for (int k = 0; k < F->fl->n; k++) {
        if (!F->lazy[k]) continue;
        const IrOp *op = F->f->ops[F->fl->at[k]];
        bool ok = true;
        const IrValue *v;
        int j;
        if (F->fl->launch[k].lib == CG_LIB_GEMM) ok = lazy(F, op->result, count_source(F->fl, k));
        else if (order_rows(F, k, &v, &j)) ok = lazy(F, v, j);
        else
          for (int m = F->fl->at[k]; ok && m < F->fl->at[k] + F->fl->launch[k].nops; m++)
            if (group_result(F->f->ops[m])) ok = lazy(F, F->f->ops[m]->result, F->from[k]);
        if (!ok) F->lazy[k] = false, again = true;
      }
    }
  }
}

// The GEMMs and groups of F as the fixed point left them.
static bool apply_rows(IrDiag *d, CgLaunches *ls, Filled *F, bool *changed) {
  const IrFunc *f = F->f;
  CgFuncLaunches *fl = F->fl;
  for (int k = 0; k < fl->n; k++) {
    CgLaunch *l = &fl->launch[k];
    if (!lazy_gemm(F, k) || !F->lazy[k]) continue;
    int j = count_source(fl, k);
    if (j == k) {   // the count kernel: cwidth < 0
      l->call[0].args[6].i = -l->call[0].args[6].i;
    } else if (l->rows_zero) {   // mk_expert_rows_zero: an empty block's row 0 only
      l->call[0].args[4].i = -l->call[0].args[4].i;
      l->call[0].grid = cg_cuda_grid_blocks(l->call[0].args[2].i);
    } else {   // no mk_expert_rows_fill
      l->ncalls = 0;
    }
    l->rows_lazy = true;
    size_t used = strlen(l->note);
    snprintf(l->note + used, sizeof l->note - used, "; rows past them unread");
  }
  for (int k = 0; k < fl->n; k++) {   // the orders' results written below the counts only
    const IrValue *v;
    int j;
    CgLaunch *l = &fl->launch[k];
    if (!order_rows(F, k, &v, &j) || !F->lazy[k]) continue;
    if (l->call[1].kernel < CG_K_COUNT) {   // the library's kernel: past 0
      l->call[1].args[l->call[1].nargs - 1].i = 0;
    } else {   // the group of one again, its store told so (a guard only to skip)
      CgLaunch alone, again;
      CgGuard g = {.groups = count_groups(F, j), .rows = count_rows(F, j), .route = true, .skip = true};
      if (!cg_lower_op(v->def, &alone) || !cg_lower_fused(d, ls, f, fl->at[k], false, &alone, &g, &again))
        return ir_internal_at(d, v->def->loc, "the order's kernel over the routed rows could not be made");
      again.alone_calls = l->alone_calls;
      *l = again;
      *changed = true;
    }
    l->rows_order = true, l->rows_bytes = 0;   // what it writes of its result: fp32, its bf16 copy or both
    const CgKernelCall *row = &l->call[l->ncalls - 1];
    for (int a = 0; a < row->nargs; a++)
      if (row->args[a].kind == CG_ARG_RESULT || row->args[a].kind == CG_ARG_COPY)
        l->rows_bytes += (row->args[a].kind == CG_ARG_COPY ? 0.5 : 1.0) * (double)ir_type_bytes(&v->type);
    size_t used = strlen(l->note);
    snprintf(l->note + used, sizeof l->note - used, "%sno row past the counts launch %d takes from the routing",
             used ? "; " : "", j);
  }
  for (int k = 0; k < fl->n; k++) {
    CgGuard *g = &F->guard[k];
    if (!guarded(g) || (g->nzero == 0 && !F->lazy[k])) continue;   // a routing guard only skips
    int i = fl->at[k], j = F->from[k];
    g->skip = F->lazy[k];
    CgLaunch again;
    if (!cg_lower_fused(d, ls, f, i, false, NULL, g, &again)) return false;
    again.alone_calls = fl->launch[k].alone_calls;
    again.rows_from = j + 1;
    again.rows_bytes = guarded_bytes(f, i, &again.call[0], g);
    fl->launch[k] = again;
    *changed = true;
  }
  return true;
}

// The filled-rows facts of every function's launches (above); false when out of memory (reported).
static bool filled_rows(IrDiag *d, CgLaunches *ls, const IrModule *m, unsigned how, bool *changed) {
  Filled *all = calloc((size_t)(m->nfuncs > 0 ? m->nfuncs : 1), sizeof *all);
  bool ok = all ? true : ir_oom(d);
  for (int fi = 0; ok && fi < m->nfuncs; fi++) {
    const IrFunc *f = m->funcs[fi];
    CgFuncLaunches *fl = &ls->fn[fi];
    Filled *F = &all[fi];
    size_t nv = (size_t)(f->nvalues > 0 ? f->nvalues : 1), no = (size_t)(f->nops > 0 ? f->nops : 1),
           nl = (size_t)(fl->n > 0 ? fl->n : 1);
    *F = (Filled){.m = m, .f = f, .fl = fl, .alone = how & CG_LOWER_FUSE, .all = all};
    F->zp = malloc(nv * sizeof *F->zp), F->over = malloc(nv * sizeof *F->over), F->clean = malloc(nv * sizeof *F->clean);
    F->launch_of = malloc(no * sizeof *F->launch_of);
    F->guard = calloc(nl, sizeof *F->guard), F->from = malloc(nl * sizeof *F->from), F->lazy = calloc(nl, sizeof *F->lazy);
    ok = F->zp && F->over && F->clean && F->launch_of && F->guard && F->from && F->lazy ? true : ir_oom(d);
    for (int v = 0; ok && v < f->nvalues; v++) F->zp[v] = F->over[v] = -1, F->clean[v] = true;
    for (int k = 0; ok && k < fl->n; k++) {
      F->from[k] = -1;
      for (int i = fl->at[k]; i < fl->at[k] + fl->launch[k].nops; i++) F->launch_of[i] = k;
    }
    if (ok) zero_rows(F), guards(F);
  }
  if (ok) fixed_point(all, m->nfuncs);
  for (int fi = 0; ok && fi < m->nfuncs; fi++) ok = apply_rows(d, ls, &all[fi], changed);
  for (int fi = 0; all && fi < m->nfuncs; fi++) {
    Filled *F = &all[fi];
    free(F->zp), free(F->over), free(F->clean), free(F->launch_of), free(F->guard), free(F->from), free(F->lazy);
  }
  free(all);
  return ok;
}

// The generated kernels the launches name, numbered again in order (filled_rows leaves the
// groups' kernels of before their guards).
static void drop_unused_kernels(CgLaunches *ls) {
  int *to = malloc((size_t)(ls->ngen > 0 ? ls->ngen : 1) * sizeof *to), n = 0;
  if (!to) return;   // (they stay: unused, not wrong)
  for (int g = 0; g < ls->ngen; g++) to[g] = -1;
  for (int fi = 0; fi < ls->nfuncs; fi++)
    for (int k = 0; k < ls->fn[fi].n; k++)
      for (int c = 0; c < ls->fn[fi].launch[k].ncalls; c++)
        if (ls->fn[fi].launch[k].call[c].kernel >= CG_K_COUNT) to[ls->fn[fi].launch[k].call[c].kernel - CG_K_COUNT] = 0;
  for (int g = 0; g < ls->ngen; g++) {
    if (to[g] < 0) {
      free(ls->gen[g].source);
      continue;
    }
    to[g] = n;
    ls->gen[n] = ls->gen[g];
    snprintf(ls->gen[n].name, sizeof ls->gen[n].name, "mk_fuse_%d", n);
    n++;
  }
  ls->ngen = n;
  for (int fi = 0; fi < ls->nfuncs; fi++)
    for (int k = 0; k < ls->fn[fi].n; k++)
      for (int c = 0; c < ls->fn[fi].launch[k].ncalls; c++) {
        CgKernelCall *call = &ls->fn[fi].launch[k].call[c];
        if (call->kernel >= CG_K_COUNT) call->kernel = CG_K_COUNT + to[call->kernel - CG_K_COUNT];
      }
  free(to);
}

// The launches of f into fl (ls: where fused groups' kernels go), each op lowered alone once
// (cg_lower_op) and every launch made from those: a fused group's (cg_lower_fused, which takes its
// first op's), or op i's with the target's fusions (cg_lower_from). alone_calls: what the ops of a
// launch launch alone.
static bool lower_func(IrDiag *d, CgLaunches *ls, const IrFunc *f, unsigned how, CgFuncLaunches *fl) {
  size_t n = (size_t)(f->nops > 0 ? f->nops : 1);
  bool cpu = how & CG_LOWER_CPU, groups = cpu || (how & CG_LOWER_FUSE);
  CgLaunch *alone = malloc(n * sizeof *alone);
  bool *has = malloc(n * sizeof *has);
  fl->launch = malloc(n * sizeof *fl->launch);
  fl->at = malloc(n * sizeof *fl->at);
  bool ok = alone && has && fl->launch && fl->at ? true : ir_oom(d);
  for (int i = 0; ok && i < f->nops; i++) has[i] = cg_lower_op(f->ops[i], &alone[i]);
  for (int i = 0; ok && i < f->nops; i += fl->launch[fl->n++].nops) {
    CgLaunch *l = &fl->launch[fl->n];
    fl->at[fl->n] = i;
    if (groups && cg_fused_members(f, i) > 0) {
      ok = cg_lower_fused(d, ls, f, i, cpu, has[i] ? &alone[i] : NULL, NULL, l);
    } else if (!cg_lower_from(f, i, cpu ? 0 : how, has[i] ? &alone[i] : NULL, l) || l->nops < 1) {
      const IrOp *op = f->ops[i];
      ok = ir_error_at(d, op->loc, "the %s target cannot emit op '%s'", cpu ? "CPU" : "CUDA",
                       op->kind < IR_OP_COUNT ? ir_op_info[op->kind].name : "?");
    }
    for (int j = i; ok && j < i + l->nops; j++)   // (an order's alone: after its slot map)
      l->alone_calls += has[j] ? alone[j].ncalls + (ls->slot_map && cg_slot_map_op(f->ops[j]) && alone[j].ncalls == 1) : 0;
  }
  free(alone);
  free(has);
  if (ok && !cpu) share_counts(f, fl), share_counts_act(f, fl);
  return ok;
}

CgLaunches *cg_lower_module(IrDiag *d, const IrModule *m, unsigned how) {
  CgLaunches *ls = calloc(1, sizeof *ls);
  if (!ls || !(ls->fn = calloc((size_t)(m->nfuncs > 0 ? m->nfuncs : 1), sizeof *ls->fn))) {
    free(ls);
    ir_oom(d);
    return NULL;
  }
  ls->nfuncs = m->nfuncs;
  ls->slot_map = !(how & CG_LOWER_CPU) && (how & CG_LOWER_MAP);
  bool ok = true, changed = false;
  for (int fi = 0; ok && fi < m->nfuncs; fi++) ok = lower_func(d, ls, m->funcs[fi], how, &ls->fn[fi]);
  if (ok && !(how & CG_LOWER_CPU) && (how & CG_LOWER_ROWS) && (how & CG_LOWER_SLOTS)) ok = filled_rows(d, ls, m, how, &changed);
  if (ok && changed) drop_unused_kernels(ls);
  if (!ok) {
    cg_launches_free(ls);
    return NULL;
  }
  return ls;
}

int cg_launch_at(const CgFuncLaunches *fl, int i) {
  int lo = 0, hi = fl->n - 1;
  while (lo <= hi) {
    int mid = (lo + hi) / 2;
    if (fl->at[mid] == i) return mid;
    if (fl->at[mid] < i) lo = mid + 1;
    else hi = mid - 1;
  }
  return -1;
}

void cg_launches_free(CgLaunches *ls) {
  if (!ls) return;
  for (int fi = 0; fi < ls->nfuncs; fi++) {
    free(ls->fn[fi].launch);
    free(ls->fn[fi].at);
  }
  free(ls->fn);
  for (int g = 0; g < ls->ngen; g++) free(ls->gen[g].source);
  free(ls->gen);
  free(ls);
}

CgLaunches *cg_cuda_launches(IrDiag *d, const IrModule *m) {
  return cg_lower_module(d, m, cg_cuda_lowering(m));
}

int cg_cuda_generated_kernels(const CgLaunches *ls) { return ls->ngen; }

void cg_cuda_kernels_used(const IrModule *m, const CgLaunches *ls, bool *used) {
  memset(used, 0, (size_t)cg_cuda_kernel_count(ls) * sizeof *used);
  bool bf16 = cg_bf16_gemms(m);
  for (int fi = 0; fi < ls->nfuncs; fi++)
    for (int k = 0; k < ls->fn[fi].n; k++) {
      const CgLaunch *l = &ls->fn[fi].launch[k];
      for (int c = 0; c < l->ncalls; c++) used[l->call[c].kernel] = true;
      if (bf16 && l->lib == CG_LIB_GEMM) used[CG_K_COMPRESS_BF16] = true;   // the operands' cast
    }
  // An expert GEMM over its filled rows in bf16 may run moec's grouped GEMM (rt_cuda_expert_gemm_rows).
  if (bf16 && (used[CG_K_EXPERT_COUNTS_BF16] || used[CG_K_EXPERT_COUNTS] || used[CG_K_EXPERT_COUNTS_ROUTE]))
    used[CG_K_EXPERT_GEMM_TC] = true;
  // Microbatches: their gradients summed and divided by their number on the GPU (emit_cuda_host.c,
  // RtDevice.accumulate).
  if (ir_mod_int(m, "microbatches", 1) > 1) used[CG_K_ADD] = used[CG_K_SCALE_ROWS] = true;
}
