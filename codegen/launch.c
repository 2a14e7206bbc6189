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
      ok = cg_lower_fused(d, ls, f, i, cpu, has[i] ? &alone[i] : NULL, l);
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
  bool ok = true;
  for (int fi = 0; ok && fi < m->nfuncs; fi++) ok = lower_func(d, ls, m->funcs[fi], how, &ls->fn[fi]);
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
