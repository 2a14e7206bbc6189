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
    const IrOperand *x = &op->args[l->call[0].args[0].index];
    for (int j = 0; j < k; j++) {
      const CgLaunch *p = &fl->launch[j];
      if (!cg_counts_rows(p)) continue;
      const IrOp *q = f->ops[fl->at[j]];
      const IrOperand *y = &q->args[p->call[0].args[0].index];
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
// The counts a GEMM's mk_expert_counts writes bound more than its operand: its result (ta 0) is
// zero at and past them, and so is an elementwise op that keeps zero rows zero of such a value (a
// product with it, an activation's gradient of it, an activation that is 0 at 0 of it, a sum of
// two). filled_rows finds those values (zero past launch j's counts: zp[v] = j) in program order,
// and then:
//   - a GEMM that would count such a value again reads launch j's counts instead (no second scan);
//   - a fused group reading such values takes the counts (CgGuard: rows_guard) and reads them as
//     0.0f past the counts, without loading them;
//   - a value whose every reader takes the same counts (those groups, the GEMMs over the counted
//     rows, a weight gradient only of a group's result: it reads row 0 of an empty block) is never
//     read past them, so it is not written there: its count kernel does not zero the GEMM's rows
//     (rows_lazy), a group all of whose results are such values skips those rows (rows_skip).
// Values read by another function (the backward's of the forward's), returned, or read by any
// other op (a hook, a collective, the order's gathers at the routed rows) keep every row.

// The launch whose counts bound GEMM launch k's rows (its own mk_expert_counts, or the one it
// reads), -1 when it runs over every slot.
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
  int *launch_of;   // by op index of f: the launch that runs it
  CgGuard *guard;   // by launch: the guard its fused group takes (nzero 0: none)
  bool alone;       // an op alone may take a guard too (CG_LOWER_FUSE: a generated kernel of one op)
} Filled;

static int64_t count_groups(const Filled *F, int j) { return F->fl->launch[j].call[0].args[3].i; }
static int64_t count_rows(const Filled *F, int j) { return F->fl->launch[j].call[0].args[4].i; }
static IrStream launch_stream(const Filled *F, int k) { return cg_op_stream(F->f->ops[F->fl->at[k]]); }

// Whether value v is [E, S, ...] with E S the blocks of slots launch j counts.
static bool fits(const Filled *F, const IrValue *v, int j) {
  const IrType *t = &v->type;
  return t->rank == 3 && t->dim[0] * t->dim[1] == count_groups(F, j) * count_rows(F, j);
}

static int zp_of(const Filled *F, const IrOperand *a) {
  return a->value && a->value->func == F->f ? F->zp[a->value->id] : -1;
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

// The values zero past counts (F->zp), in program order, and the GEMMs that count them again
// reading those counts instead.
static void zero_rows(Filled *F) {
  const IrFunc *f = F->f;
  for (int k = 0; k < F->fl->n; k++) {
    CgLaunch *l = &F->fl->launch[k];
    const IrOp *op = f->ops[F->fl->at[k]];
    if (l->lib == CG_LIB_GEMM && op->kind == IR_OP_EXPERT_MATMUL) {
      int j = count_source(F->fl, k);
      if (j == k) {   // its own count kernel, over operand x
        const IrOperand *x = &op->args[l->call[0].args[0].index];
        int z = zp_of(F, x);
        if (z >= 0 && z != k && count_groups(F, z) == count_groups(F, k) && count_rows(F, z) == count_rows(F, k) &&
            launch_stream(F, z) == launch_stream(F, k)) {
          share_zero_counts(F, k, z);
          j = z;
        } else if (z < 0 && x->value && x->value->func == f && fits(F, x->value, k)) {
          F->zp[x->value->id] = k;   // the value it counts (from here on)
        }
      }
      if (j >= 0 && op->result && !ir_op_int(op, "ta", 0) && !l->rows_plus && fits(F, op->result, j))
        F->zp[op->result->id] = j;
      continue;
    }
    for (int i = F->fl->at[k]; i < F->fl->at[k] + l->nops; i++)
      if (f->ops[i]->result) F->zp[f->ops[i]->result->id] = op_zero_rows(F, f->ops[i]);
  }
}

// The guard each fused group can take: the counts of the first operand from outside that is zero
// past counts an earlier launch made, and every such operand of the same counts.
static void guards(Filled *F) {
  const IrFunc *f = F->f;
  for (int k = 0; k < F->fl->n; k++) {
    const CgLaunch *l = &F->fl->launch[k];
    int i = F->fl->at[k], n = cg_fused_members(f, i);
    if (n == 0 && F->alone && l->lib == CG_LIB_NONE && l->nops == 1 && l->ncalls == 1) n = 1;   // (cg_fused_guardable says)
    CgGuard *g = &F->guard[k];
    int j = -1;
    for (int m = i; m < i + n; m++)
      for (int a = 0; a < f->ops[m]->nargs; a++) {
        const IrOperand *x = &f->ops[m]->args[a];
        int z = zp_of(F, x);
        if (z < 0 || z >= k || (x->value->def && x->value->def->index >= i) || (j >= 0 && z != j)) continue;
        if (cg_guard_zero(g, x->value) || g->nzero == (int)(sizeof g->zero / sizeof g->zero[0])) continue;
        j = z;
        g->zero[g->nzero++] = x->value;
      }
    if (j < 0 || launch_stream(F, j) != cg_op_stream(f->ops[i])) {
      g->nzero = 0;
      continue;
    }
    g->groups = count_groups(F, j), g->rows = count_rows(F, j);
    if (!cg_fused_guardable(f, i, g)) g->nzero = 0;
    else F->fl->launch[k].rows_from = j + 1;   // (kept only with the guard: filled_rows)
  }
}

// Whether every reader of value v (zero past launch j's counts) reads only the rows below them.
static bool unread_past(const Filled *F, const IrValue *v, int j) {
  for (int r = 0; r < F->f->nrets; r++)
    if (F->f->rets[r] == v) return false;
  for (int fi = 0; fi < F->m->nfuncs; fi++) {
    const IrFunc *g = F->m->funcs[fi];
    for (int i = 0; i < g->nops; i++) {
      const IrOp *op = g->ops[i];
      for (int a = 0; a < op->nargs; a++) {
        if (op->args[a].value != v) continue;
        if (g != F->f) return false;
        int k = F->launch_of[i];
        const CgLaunch *l = &F->fl->launch[k];
        if (F->guard[k].nzero > 0 && F->fl->launch[k].rows_from == j + 1 && cg_guard_zero(&F->guard[k], v)) continue;
        if (l->lib != CG_LIB_GEMM || op->kind != IR_OP_EXPERT_MATMUL || count_source(F->fl, k) != j || j == k ||
            l->rows_plus)
          return false;
        if (!ir_op_int(op, "ta", 0) && a != 0) return false;   // B of a GEMM: read whole
        // A weight gradient of an empty block sums one row, row 0: a group's result keeps it.
        if (ir_op_int(op, "ta", 0) && !(v->def && F->guard[F->launch_of[v->def->index]].nzero > 0)) return false;
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

// MOEC_ROWS_UNREAD=all, a test hook: every value zero past counts taken as unread past them (wrong
// where a reader reads them; the fake device's NaN there shows it: tests/cuda/host.sh).
static bool lazy(const Filled *F, const IrValue *v, int j) {
  const char *hook = getenv("MOEC_ROWS_UNREAD");
  return v && F->zp[v->id] == j && ((hook && strcmp(hook, "all") == 0) || unread_past(F, v, j));
}

// The filled-rows facts of f's launches (above); false when out of memory (reported).
static bool filled_rows(IrDiag *d, CgLaunches *ls, const IrModule *m, const IrFunc *f, CgFuncLaunches *fl, unsigned how,
                        bool *changed) {
  Filled F = {.m = m, .f = f, .fl = fl, .alone = how & CG_LOWER_FUSE};
  F.zp = malloc((size_t)(f->nvalues > 0 ? f->nvalues : 1) * sizeof *F.zp);
  F.launch_of = malloc((size_t)(f->nops > 0 ? f->nops : 1) * sizeof *F.launch_of);
  F.guard = calloc((size_t)(fl->n > 0 ? fl->n : 1), sizeof *F.guard);
  bool ok = F.zp && F.launch_of && F.guard ? true : ir_oom(d);
  for (int v = 0; ok && v < f->nvalues; v++) F.zp[v] = -1;
  for (int k = 0; ok && k < fl->n; k++)
    for (int i = fl->at[k]; i < fl->at[k] + fl->launch[k].nops; i++) F.launch_of[i] = k;
  if (ok) zero_rows(&F), guards(&F);
  // The GEMM results nothing reads past the counts: not zeroed there.
  for (int k = 0; ok && k < fl->n; k++) {
    CgLaunch *l = &fl->launch[k];
    const IrOp *op = f->ops[fl->at[k]];
    int j = count_source(fl, k);
    if (j < 0 || l->rows_plus || op->kind != IR_OP_EXPERT_MATMUL || ir_op_int(op, "ta", 0) || !lazy(&F, op->result, j))
      continue;
    if (j == k) l->call[0].args[6].i = -l->call[0].args[6].i;   // mk_expert_counts: cwidth < 0
    else l->ncalls = 0, l->rows_zero = false;                     // no mk_expert_rows_zero
    l->rows_lazy = true;
    size_t used = strlen(l->note);
    snprintf(l->note + used, sizeof l->note - used, "; rows past them unread");
  }
  // The groups over the slots, again with their guards.
  for (int k = 0; ok && k < fl->n; k++) {
    CgGuard *g = &F.guard[k];
    if (g->nzero == 0) continue;
    int i = fl->at[k], n = fl->launch[k].nops, j = fl->launch[k].rows_from - 1;
    g->skip = true;
    for (int e = i; e < i + n && g->skip; e++) {
      const IrOp *op = f->ops[e];
      if (op->result && ir_op_colsum(op->kind) < 0 && (!ir_op_int(op, "inner", 0) || pass_writes_copy(op)))
        g->skip = lazy(&F, op->result, j);
    }
    CgLaunch again;
    ok = cg_lower_fused(d, ls, f, i, false, NULL, g, &again);
    if (ok) {
      again.alone_calls = fl->launch[k].alone_calls;
      again.rows_from = j + 1;
      again.rows_bytes = guarded_bytes(f, i, &again.call[0], g);
      fl->launch[k] = again;
      *changed = true;
    }
  }
  free(F.zp);
  free(F.launch_of);
  free(F.guard);
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
static bool lower_func(IrDiag *d, CgLaunches *ls, const IrModule *m, const IrFunc *f, unsigned how, CgFuncLaunches *fl,
                       bool *changed) {
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
    for (int j = i; ok && j < i + l->nops; j++) l->alone_calls += has[j] ? alone[j].ncalls : 0;
  }
  free(alone);
  free(has);
  if (ok && !cpu) share_counts(f, fl), share_counts_act(f, fl);
  if (ok && !cpu && (how & CG_LOWER_ROWS) && (how & CG_LOWER_SLOTS)) ok = filled_rows(d, ls, m, f, fl, how, changed);
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
  bool ok = true, changed = false;
  for (int fi = 0; ok && fi < m->nfuncs; fi++) ok = lower_func(d, ls, m, m->funcs[fi], how, &ls->fn[fi], &changed);
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
  if (bf16 && (used[CG_K_EXPERT_COUNTS_BF16] || used[CG_K_EXPERT_COUNTS])) used[CG_K_EXPERT_GEMM_TC] = true;
  // Microbatches: their gradients summed and divided by their number on the GPU (emit_cuda_host.c,
  // RtDevice.accumulate).
  if (ir_mod_int(m, "microbatches", 1) > 1) used[CG_K_ADD] = used[CG_K_SCALE_ROWS] = true;
}
