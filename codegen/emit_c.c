// Layer 7 of codegen/ (an emitter: the CPU program); it may call layers 1-6 (facts.c, kernels.c,
// lower.c, fused.c, launch.c, spell.c, host.c), no other emitter.
//
// The CPU target's emitter: one C statement per IR op, in program order (a fused group of
// elementwise ops, passes/fuse.c, is one call of a function generated for it: codegen/fused.c);
// functions whose ops the schedule put on several streams become task tables run by
// rt_run_streams (see below).
//
// The emitted program has a parameter table (names, shapes, init, offsets into one flat
// buffer), three step functions — forward (layer forwards and the loss), backward (the loss
// gradient and layer backwards) and update (the optimizer) — and a main() that hands them to
// rt_main(). Every value is an address fixed at compile time: an offset into the activation
// arena from memplan, the step's input or target, or a parameter's gradient buffer. Shapes and
// attributes become integer and float literals, so the program has no interpretation left.
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cg_internal.h"

typedef struct Emit {
  FILE *out;
  IrDiag *d;
  const IrModule *m;
  const PassMemPlan *plan;
  int64_t *param_offset;   // floats, by param index
  CgSpelling sp;           // the names of the buffers (spelling)
  CgLaunches *ls;          // the launch list (cg_lower_module, CG_LOWER_CPU): every op and group lowered once
  bool **in_gemm;          // by function and launch: a fused group that runs in the pieces of the GEMM before it
} Emit;

// The CPU program's names of its buffers: the arena A, the step's buffers in st.
static CgSpelling spelling(const Emit *e) {
  return (CgSpelling){.plan = e->plan, .param_offset = e->param_offset, .typed = true, .arena = "A",
                      .input = "((const float *)st->input)", .target = "((const float *)st->target)",
                      .input_i32 = "((const int32_t *)st->input)", .target_i32 = "((const int32_t *)st->target)",
                      .params = "st->params", .grads = "st->grads", .opt_m = "st->opt_m", .opt_v = "st->opt_v"};
}


// One argument of a kernel call of the lowering (cg_lower) as a C expression of the CPU program.
static void call_arg(Emit *e, char *buf, size_t n, const IrFunc *f, int i, const CgArg *a) {
  const CgArgInfo *info = cg_arg_info(a->kind);
  if (cg_spell_pointer(&e->sp, f, i, a, buf, n)) return;
  if (info->step_field) snprintf(buf, n, "st->%s", info->step_field);
  else if (a->kind == CG_ARG_STATS) snprintf(buf, n, "st");     // the CPU kernels add their statistics to the step
  else if (a->kind == CG_ARG_SCRATCH) snprintf(buf, n, "NULL"); // CUDA only (the CPU lowering has none)
  else if (a->kind == CG_ARG_INT) snprintf(buf, n, "%" PRId64, a->i);
  else if (a->kind == CG_ARG_FLOAT) snprintf(buf, n, "(float)%.17g", a->f);
  else UNREACHABLE();
}

// The ops the lowering leaves to the target's libraries: GEMMs (OpenBLAS) and collectives (MPI).
static bool emit_library_op(Emit *e, const IrOp *op) {
  FILE *out = e->out;
  char a[2][96], r[96] = "";
  for (int i = 0; i < op->nargs && i < 2; i++) cg_spell_operand(&e->sp, &op->args[i], a[i], sizeof a[i]);
  if (op->result) cg_spell_value(&e->sp, op->result, r, sizeof r);
  const IrType *t0 = cg_operand_type(&op->args[0]);
  const IrType *rt = op->result ? &op->result->type : NULL;
  int64_t n = rt ? ir_type_numel(rt) : 0;
  fprintf(out, "  ");
  switch (op->kind) {
  case IR_OP_MATMUL: {
    CgGemm g = cg_gemm(op);
    fprintf(out, "rt_matmul(%s, %s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %d, %d, false);\n", a[0], a[1], r, g.m,
            g.n, g.k, g.ta, g.tb);
    return true;
  }
  case IR_OP_EXPERT_MATMUL: {
    CgGemm g = cg_gemm(op);
    fprintf(out, "rt_expert_matmul(%s, %s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ", %d, %d);\n", a[0],
            a[1], r, g.e, g.m, g.n, g.k, g.ta, g.tb);
    return true;
  }
  case IR_OP_COMM_SPLIT:
    fprintf(out, "rt_copy(%s + (int64_t)rt_comm_rank(st->comm, %s) * %" PRId64 ", %s, %" PRId64 ");\n", a[0], cg_group_enum(op), n,
            r, n);
    return true;
  case IR_OP_COMM_COPY:
    fprintf(out, "rt_copy(%s, %s, %" PRId64 ");\n", a[0], r, n);
    return true;
  case IR_OP_COMM_ALLGATHER:
    fprintf(out, "rt_allgather(st->comm, %s, %s, %s, %" PRId64 ");\n", cg_group_enum(op), a[0], r, ir_type_numel(t0));
    return true;
  case IR_OP_COMM_REDUCESCATTER:
    fprintf(out, "rt_reducescatter(st->comm, %s, %s, %s, %" PRId64 ");\n", cg_group_enum(op), a[0], r, n);
    return true;
  case IR_OP_COMM_ALLTOALL: {
    const char *algo = ir_op_str(op, "algo", "nccl");
    fprintf(out, "rt_alltoall(st->comm, %s, %s, %s, %s, %" PRId64 ");\n", cg_group_enum(op),
            strcmp(algo, "1dh") == 0 ? "RT_A2A_1DH" : strcmp(algo, "2dh") == 0 ? "RT_A2A_2DH" : "RT_A2A_FLAT", a[0], r,
            n / ir_op_int(op, "size", 1));
    return true;
  }
  case IR_OP_COMM_ALLREDUCE:
    fprintf(out, "rt_copy(%s, %s, %" PRId64 ");\n  ", a[0], r, n);
    if (ir_op_int(op, "shard", 0) > 0) {   // a sharded optimizer's gradient: each member's rows (autodiff)
      int64_t rows = ir_op_int(op, "shard", 1);
      fprintf(out, "rt_shard_reduce(st->comm, %s, %s, 0, %" PRId64 ", %" PRId64 ", %" PRId64 ");\n", cg_group_enum(op), r,
              n, rows, n / rows);
    } else {
      fprintf(out, "rt_allreduce(st->comm, %s, %s, %" PRId64 ");\n", cg_group_enum(op), r, n);
    }
    return true;
  case IR_OP_COMM_ALLREDUCE_GRAD: {  // a slice of a parameter's gradient, in place (passes/gradpart.c)
    const IrParam *p = op->args[0].param;
    int64_t at = e->param_offset[p->index], offset = ir_op_int(op, "offset", 0), count = ir_op_int(op, "count", 0);
    int64_t rows = ir_op_int(op, "shard", 0);
    if (rows > 0)
      fprintf(out, "rt_shard_reduce(st->comm, %s, st->grads + %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ");\n",
              cg_group_enum(op), at, offset, count, rows, ir_type_numel(&p->type) / rows);
    else
      fprintf(out, "rt_allreduce(st->comm, %s, st->grads + %" PRId64 ", %" PRId64 ");\n", cg_group_enum(op), at + offset, count);
    return true;
  }
  default:
    break;
  }
  ir_error_at(e->d, op->loc, "the CPU target cannot emit op '%s'", ir_op_info[op->kind].name);
  return false;
}

// Whether launch l is a fused group's (one call of its generated function).
static bool is_group(const CgLaunch *l) { return l->ncalls == 1 && l->call[0].kernel >= CG_K_COUNT; }

// The generated function of group launch l.
static const CgGenKernel *group_kernel(const Emit *e, const CgLaunch *l) { return &e->ls->gen[l->call[0].kernel - CG_K_COUNT]; }

// The call of the fused group of launch l at op i of f (fuse_N(args)), or with piece its table for
// the GEMM epilogue (fuse_N_piece, (const void *const[]){args}).
static void fused_call(Emit *e, const IrFunc *f, int i, const CgLaunch *l, bool piece) {
  const CgKernelCall *call = &l->call[0];
  char buf[96];
  fprintf(e->out, piece ? "%s_piece, (const void *const[]){" : "%s(", group_kernel(e, l)->name);
  for (int k = 0; k < call->nargs; k++) {
    call_arg(e, buf, sizeof buf, f, i, &call->args[k]);
    fprintf(e->out, "%s%s", k ? ", " : "", buf);
  }
  fprintf(e->out, piece ? "}" : ")");
}

// GEMM op i of f, whose product the fused group after it takes row by row as the GEMM's pieces
// finish (in_gemm): rt_matmul_rows, and the group over the whole product when the GEMM ran in one
// piece.
static void emit_gemm_rows(Emit *e, const IrFunc *f, int i, const CgLaunch *g) {
  const IrOp *op = f->ops[i];
  char a[2][96], r[96];
  for (int k = 0; k < 2; k++) cg_spell_operand(&e->sp, &op->args[k], a[k], sizeof a[k]);
  cg_spell_value(&e->sp, op->result, r, sizeof r);
  CgGemm s = cg_gemm(op);
  if (s.expert)   // ta = 0 (in_gemm)
    fprintf(e->out, "  if (!rt_expert_matmul_rows(%s, %s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ", %d, ",
            a[0], a[1], r, s.e, s.m, s.n, s.k, s.tb);
  else
    fprintf(e->out, "  if (!rt_matmul_rows(%s, %s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %d, %d, ", a[0], a[1], r,
            s.m, s.n, s.k, s.ta, s.tb);
  fused_call(e, f, i + 1, g, true);
  fprintf(e->out, "))\n    ");
  fused_call(e, f, i + 1, g, false);
  fprintf(e->out, ";   /* %s, in the GEMM's pieces */\n", group_kernel(e, g)->ops);
}

// What a sharded update does to an argument of its call, named by the op's own operand 0 (its
// KERNEL rule's x0, grad, m, v, n0): the parameter's buffers (the parameter, its gradient, its
// moments) start at the rank's first row, the parameter's element count becomes the rank's.
typedef enum PartRole { PART_KEEP, PART_SHIFT, PART_COUNT } PartRole;
static PartRole part_role(const IrOp *op, const CgArg *a) {
  if ((a->kind == CG_ARG_OPERAND && a->index == 0 && a->i == 0) || a->kind == CG_ARG_GRAD || a->kind == CG_ARG_MOMENT_M ||
      a->kind == CG_ARG_MOMENT_V)
    return PART_SHIFT;
  if (a->kind == CG_ARG_INT && a->i == ir_type_numel(cg_operand_type(&op->args[0]))) return PART_COUNT;
  return PART_KEEP;
}

// Whether the lowering of sharded update op is one call with each of the parameter's four buffers
// and its count once: what rt_param_part's rows can stand in for.
static bool part_call(const IrOp *op, const CgLaunch *lp) {
  if (lp->ncalls != 1 || !op->args[0].param) return false;
  int roles[3] = {0};
  for (int k = 0; k < lp->call[0].nargs; k++) roles[part_role(op, &lp->call[0].args[k])]++;
  return roles[PART_SHIFT] == 4 && roles[PART_COUNT] == 1;
}

// Op i of f: the kernel calls of its lowering (cg_lower, never fused on the CPU), each as
// rt_KERNEL(args) of libmoert, whose CPU kernels take the CUDA kernels' parameters in their
// order (runtime/kernels.def); GEMMs and collectives go to emit_library_op. The statistics a
// kernel cannot gather itself (a record hook's line, an expert choice's loads) follow it.
static bool emit_op(Emit *e, const IrFunc *f, int i) {
  const IrOp *op = f->ops[i];
  const CgFuncLaunches *fl = &e->ls->fn[f->index];
  int at = cg_launch_at(fl, i);
  if (at < 0) return true;   // a fused group's op after its first: the group's call stands for it
  const CgLaunch *lp = &fl->launch[at];
  if (is_group(lp)) {   // a group's first op calls its function (unless it ran in the GEMM's pieces)
    if (!e->in_gemm[f->index][at]) {
      fprintf(e->out, "  ");
      fused_call(e, f, i, lp, false);
      fprintf(e->out, ";   /* %s */\n", group_kernel(e, lp)->ops);
    }
    return true;
  }
  if (at + 1 < fl->n && fl->at[at + 1] == i + 1 && e->in_gemm[f->index][at + 1]) {
    emit_gemm_rows(e, f, i, &fl->launch[at + 1]);
    return true;
  }
  if (lp->lib) return emit_library_op(e, op);
  char buf[CG_MAX_KERNEL_ARGS][96];
  if (op->kind == IR_OP_HOOK_RECORD) {   // computes and writes the record line at once
    cg_spell_operand(&e->sp, &op->args[0], buf[0], sizeof buf[0]);
    fprintf(e->out, "  rt_record(st, \"%s\", %" PRId64 ", %s, %" PRId64 ");\n", ir_op_str(op, "point", "?"),
            ir_op_int(op, "layer", 0), buf[0], ir_type_numel(cg_operand_type(&op->args[0])));
    return true;
  }
  if (op->kind == IR_OP_PARAM_GRAD) {
    const PassMemSlot *s = &e->plan->slot[op->args[1].value->func->index][op->args[1].value->id];
    if (s->kind == PASS_MEM_GRAD && s->offset == op->args[0].param->index) {
      fprintf(e->out, "  /* %s: computed in place */\n", op->args[0].param->name);
      return true;
    }
  }
  // A sharded optimizer's update (autodiff: group) takes the rows the rank owns: the parameter's
  // buffers moved by lo, its count n (part_role).
  bool part = op->kind == IR_OP_OPT_ADAMW && ir_op_str(op, "group", NULL);
  if (part && !part_call(op, lp))
    return ir_internal(e->d, "a sharded opt.adamw lowers to one call with the parameter's four buffers and its count");
  if (part)
    fprintf(e->out, "  {\n    int64_t lo, n;\n    rt_param_part(st->comm, &params[%d], &lo, &n);\n  ", op->args[0].param->index);
  for (int c = 0; c < lp->ncalls; c++) {
    const CgKernelCall *call = &lp->call[c];
    fprintf(e->out, "  rt_%s(", cg_kernel_name(call->kernel));
    for (int k = 0; k < call->nargs; k++) {
      PartRole role = part ? part_role(op, &call->args[k]) : PART_KEEP;
      call_arg(e, buf[k], sizeof buf[k], f, i, &call->args[k]);
      if (role == PART_SHIFT) strncat(buf[k], " + lo", sizeof buf[k] - strlen(buf[k]) - 1);
      fprintf(e->out, "%s%s", k ? ", " : "", role == PART_COUNT ? "n" : buf[k]);
    }
    fprintf(e->out, ");\n");
  }
  if (part) fprintf(e->out, "  }\n");
  if (op->kind == IR_OP_GATE_EXPERT_CHOICE) {   // the loads of the choice (what its rule passes the kernel)
    const IrType *t = cg_operand_type(&op->args[0]);
    cg_spell_value(&e->sp, op->result, buf[0], sizeof buf[0]);
    fprintf(e->out, "  rt_expert_choice_stats(st, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ");\n", buf[0],
            t->dim[0], t->dim[1], ir_op_int(op, "groups", 0), ir_op_int(op, "capacity", 0));
  }
  return true;
}

// ---- scheduled functions: a task table for rt_run_streams (runtime/streams.c) ----
// A function with ops on the intra or inter stream (ir_func_concurrent) is emitted as tasks: runs of
// consecutive ops on one stream, cut before an op that waits and after an op that records an event,
// one static function each, and a table {stream, fn, waits, event} in program order; the step
// calls rt_run_streams on it. Events are cg_events' (renumbered per function, a collective
// waiting for the previous one on its group).
#define TASK_WAITS 16  // RT_TASK_MAX_WAITS

// The task functions and table of scheduled function f (index fi): `tasks_<fi>`, with the task
// and event counts in *ntasks and *nevents.
static bool emit_tasks(Emit *e, const IrFunc *f, int fi, int *ntasks_out, int *nevents_out) {
  int n = f->nops;
  CgEvents ev;
  if (!cg_events(e->d, f, &ev)) return false;
  int *task_of = malloc(((size_t)n + 1) * sizeof *task_of);
  bool ok = task_of != NULL;
  if (!ok) {
    ir_oom(e->d);
    goto out;
  }
  // Tasks: cut before an op with waits, after an op with an event, where the stream changes.
  int ntasks = 0;
  for (int i = 0; i < n; i++) {
    const IrOp *op = f->ops[i];
    bool cut = i == 0 || op->nwaits > 0 || ev.dep[i] >= 0 || ev.rec[i - 1] || cg_op_stream(op) != cg_op_stream(f->ops[i - 1]);
    if (cut) {
      if (i > 0) fprintf(e->out, "}\n\n");
      fprintf(e->out, "static void task_%d_%d(RtStep *st) {\n  unsigned char *A = st->arena;\n  (void)A;\n", fi, ntasks);
      ntasks++;
    }
    task_of[i] = ntasks - 1;
    if (!emit_op(e, f, i)) {
      ok = false;
      goto out;
    }
  }
  if (n > 0) fprintf(e->out, "}\n\n");
  fprintf(e->out, "static const RtTask tasks_%d[%d] = {\n", fi, ntasks > 0 ? ntasks : 1);
  for (int i = 0; i < n; i++) {
    if (i > 0 && task_of[i] == task_of[i - 1]) continue;
    int last = i;
    while (last + 1 < n && task_of[last + 1] == task_of[i]) last++;
    int waits[TASK_WAITS];
    int nw = cg_op_waits(f, &ev, i, waits, TASK_WAITS);
    fprintf(e->out, "  {%s, task_%d_%d, %d, {", cg_stream_enum(f->ops[i]->stream), fi, task_of[i], nw);
    for (int k = 0; k < nw; k++) fprintf(e->out, "%s%d", k ? ", " : "", waits[k]);
    if (nw == 0) fprintf(e->out, "0");
    fprintf(e->out, "}, %d},\n", ev.local[last]);
  }
  fprintf(e->out, "};\n\n");
  *ntasks_out = ntasks;
  *nevents_out = ev.count;
out:
  cg_events_free(&ev);
  free(task_of);
  return ok;
}

static bool emit_func(Emit *e, const IrFunc *f) {
  fprintf(e->out, "  /* @%s */\n", f->name);
  if (ir_func_concurrent(f)) {
    fprintf(e->out, "  rt_run_streams(st->streams, st, tasks_%d, (int)(sizeof tasks_%d / sizeof tasks_%d[0]), tasks_%d_events);\n",
            f->index, f->index, f->index, f->index);
    return true;
  }
  for (int i = 0; i < f->nops; i++)
    if (!emit_op(e, f, i)) return false;
  return true;
}


// The update: the optimizer functions' calls. When they are all rt_sgd / rt_adamw calls in
// program order, they run in one rt_team: every thread of the pool takes its share of each
// tensor and none waits until the last one (55 tensors of a small model: 55 parallel regions,
// the small tensors on one thread, otherwise).
static bool team_update(const IrModule *m) {
  for (int i = 0; i < m->nfuncs; i++) {
    const IrFunc *f = m->funcs[i];
    if (f->role != IR_ROLE_OPTIMIZER) continue;
    if (ir_func_concurrent(f)) return false;
    for (int j = 0; j < f->nops; j++)
      if (f->ops[j]->kind != IR_OP_OPT_SGD && f->ops[j]->kind != IR_OP_OPT_ADAMW) return false;
  }
  return true;
}

// After the updates of a sharded optimizer: each parameter's rows from the members that own them.
static void emit_shard_gathers(Emit *e, const IrModule *m) {
  for (int i = 0; i < m->nfuncs; i++) {
    const IrFunc *f = m->funcs[i];
    for (int j = 0; f->role == IR_ROLE_OPTIMIZER && j < f->nops; j++) {
      const IrOp *op = f->ops[j];
      if (op->kind != IR_OP_OPT_ADAMW || !ir_op_str(op, "group", NULL)) continue;
      const IrParam *p = op->args[0].param;
      int64_t rows = p->type.dim[0];
      fprintf(e->out, "  rt_shard_gather(st->comm, %s, st->params + %" PRId64 ", %" PRId64 ", %" PRId64 ");\n",
              cg_group_enum(op), e->param_offset[p->index], rows, ir_type_numel(&p->type) / rows);
    }
  }
}

static bool emit_update(Emit *e, const IrModule *m) {
  bool team = team_update(m), ok = true;
  fprintf(e->out, "static void %s(RtStep *st) {\n", team ? "update_team" : "step_update");
  for (int i = 0; ok && i < m->nfuncs; i++)
    if (m->funcs[i]->role == IR_ROLE_OPTIMIZER) ok = emit_func(e, m->funcs[i]);
  if (!team) emit_shard_gathers(e, m);
  fprintf(e->out, "}\n\n");
  if (team) {
    fprintf(e->out, "static void step_update(RtStep *st) {\n  rt_team(update_team, st);\n");
    emit_shard_gathers(e, m);
    fprintf(e->out, "}\n\n");
  }
  return ok;
}

// After a layer forward: fold its auxiliary losses (the results after the first, made by
// gate.aux_loss or gate.z_loss) into the step's statistics.
static void emit_layer_stats(Emit *e, const IrFunc *f) {
  char buf[96];
  for (int r = 1; r < f->nrets; r++) {
    const IrValue *v = f->rets[r];
    if (v->def && v->def->kind == IR_OP_GATE_AUX_POOLED) {  // pooled after the last layer (rt_pool_finish)
      const IrType *scores = &v->def->args[0].value->type;
      cg_spell_value(&e->sp, v, buf, sizeof buf);
      fprintf(e->out, "  rt_pool_layer(st, %s, %" PRId64 ", %" PRId64 ", %.17g);\n", buf, scores->dim[1], scores->dim[0],
              ir_op_float(v->def, "coef", 0));
      continue;
    }
    if (!v->def || (v->def->kind != IR_OP_GATE_AUX_LOSS && v->def->kind != IR_OP_GATE_Z_LOSS)) continue;
    double coef = ir_op_float(v->def, "coef", 0);
    cg_spell_value(&e->sp, v, buf, sizeof buf);
    fprintf(e->out, "  st->%s += *%s;\n  st->aux_total += (double)(float)%.17g * *%s;\n",
            v->def->kind == IR_OP_GATE_AUX_LOSS ? "aux" : "z", buf, coef, buf);
  }
}

// Whether slots s and t share bytes.
static bool slots_overlap(const PassMemSlot *s, const PassMemSlot *t) {
  if (s->kind != t->kind) return false;
  if (s->kind != PASS_MEM_ARENA) return s->kind == PASS_MEM_GRAD && s->offset == t->offset;
  return s->offset < t->offset + t->bytes && t->offset < s->offset + s->bytes;
}

// Whether the results of group launch g (at op i of f), which the fuse pass runs in the pieces of
// the GEMM before it (IrGroup.in_gemm), share no bytes with the GEMM's operands or product, which
// other pieces still read: memplan keeps them apart (its fused_span); checked here, as the
// program would compute garbage otherwise.
static bool apart_from_gemm(const Emit *e, const IrFunc *f, int i, const CgLaunch *g) {
  const IrOp *gemm = f->ops[i - 1];
  const PassMemSlot *made = &e->plan->slot[f->index][gemm->result->id];
  for (int k = 0; k < g->call[0].nargs; k++) {
    const CgArg *a = &g->call[0].args[k];
    if (a->kind != CG_ARG_RESULT) continue;
    const IrValue *v = f->ops[i + a->index]->result;
    const PassMemSlot *s = &e->plan->slot[f->index][v->id];
    for (int o = 0; o < 2; o++) {
      const IrValue *in = gemm->args[o].value;
      if (!gemm->args[o].param && slots_overlap(s, &e->plan->slot[in->func->index][in->id])) return false;
    }
    if (slots_overlap(s, made)) return false;
  }
  return true;
}

// The launch list (each op and group lowered once, cg_lower_module), which groups run in the
// pieces of the GEMM before them (the fuse pass's in_gemm), and the functions of the fused groups (each distinct
// one once, fuse_N).
static bool emit_fused(Emit *e) {
  if (!(e->ls = cg_lower_module(e->d, e->m, CG_LOWER_CPU))) return false;
  if (!(e->in_gemm = calloc((size_t)(e->m->nfuncs > 0 ? e->m->nfuncs : 1), sizeof *e->in_gemm))) return ir_oom(e->d);
  for (int fi = 0; fi < e->m->nfuncs; fi++) {
    const CgFuncLaunches *fl = &e->ls->fn[fi];
    if (!(e->in_gemm[fi] = calloc((size_t)(fl->n > 0 ? fl->n : 1), sizeof **e->in_gemm))) return ir_oom(e->d);
    const IrFunc *f = e->m->funcs[fi];
    for (int k = 0; k < fl->n; k++) {
      const IrGroup *g = ir_group_at(f, fl->at[k]);
      e->in_gemm[fi][k] = is_group(&fl->launch[k]) && g && g->in_gemm;
      if (e->in_gemm[fi][k] && !apart_from_gemm(e, f, fl->at[k], &fl->launch[k]))
        return ir_internal(e->d, "fused group %d of @%s runs in the GEMM's pieces but shares bytes with its operands", g->id,
                           f->name);
    }
  }
  for (int k = 0; k < e->ls->ngen; k++) {   // the source with its name
    const CgGenKernel *g = &e->ls->gen[k];
    fprintf(e->out, "/* %s: %s */\n", g->name, g->ops);
    for (const char *s = g->source; *s;) {
      const char *at = strstr(s, "FUSED_NAME");
      if (!at) {
        fputs(s, e->out);
        break;
      }
      fprintf(e->out, "%.*s%s", (int)(at - s), s, g->name);
      s = at + strlen("FUSED_NAME");
    }
    fputc('\n', e->out);
  }
  return true;
}

static void free_fused(Emit *e) {
  for (int fi = 0; e->in_gemm && fi < e->m->nfuncs; fi++) free(e->in_gemm[fi]);
  free(e->in_gemm);
  cg_launches_free(e->ls);
}

bool cg_emit_c(IrDiag *d, FILE *out, const IrModule *m, const PassMemPlan *plan, const CgEmitOptions *o) {
  if (cg_bf16_gemms(m))   // the front end refuses it for the CPU target (frontend/lower.c)
    return ir_internal(d, "the CPU target computes in fp32 only; dtype bf16 is the CUDA target's");
  Emit e = {.out = out, .d = d, .m = m, .plan = plan};
  int64_t total = 0;
  e.param_offset = cg_param_offsets(m, &total);
  e.sp = spelling(&e);
  if (!e.param_offset) return ir_oom(d);
  fprintf(out, "/* Generated by moec from %s: the training step of model '%s' for the CPU target.\n"
               "   Do not edit; change the .moe file and rebuild. */\n",
          o->source_name, m->name);
  fprintf(out, "#include <stdbool.h>\n#include <stdint.h>\n#include <string.h>\n\n#include \"moert.h\"\n#include \"rt_fused.h\"\n\n");
  cg_emit_params(out, m, e.param_offset);
  if (!emit_fused(&e)) {
    free(e.param_offset);
    free_fused(&e);
    return false;
  }

  bool ok = true;
  for (int i = 0; ok && i < m->nfuncs; i++) {
    int nt = 0, nev = 0;
    if (!ir_func_concurrent(m->funcs[i])) continue;
    fprintf(out, "/* @%s: tasks for rt_run_streams */\n", m->funcs[i]->name);
    ok = emit_tasks(&e, m->funcs[i], i, &nt, &nev);
    fprintf(out, "enum { tasks_%d_events = %d };\n\n", i, nev);
  }
  const IrFunc *last_fwd = NULL;
  fprintf(out, "static void step_forward(RtStep *st) {\n  unsigned char *A = st->arena;\n  (void)A;\n"
               "  rt_step_begin_forward(st);\n");
  for (int i = 0; ok && i < m->nfuncs; i++) {
    const IrFunc *f = m->funcs[i];
    if (f->role == IR_ROLE_LOSS_FWD) {
      char buf[96];
      ok = emit_func(&e, f);
      if (f->nrets > 1 || last_fwd) {   // a language model's logits, or the last layer's output
        cg_spell_value(&e.sp, f->nrets > 1 ? f->rets[1] : last_fwd->rets[0], buf, sizeof buf);
        fprintf(out, "  st->output = %s;\n", buf);
      }
      cg_spell_value(&e.sp, f->rets[0], buf, sizeof buf);
      fprintf(out, "  st->mse = *%s;\n", buf);
    } else if (f->role == IR_ROLE_LAYER_FWD) {
      ok = emit_func(&e, f);
      emit_layer_stats(&e, f);
      last_fwd = f;
    }
  }
  if (cg_module_has(m, IR_OP_GATE_AUX_POOLED, NULL)) fprintf(out, "  rt_pool_finish(st);\n");
  fprintf(out, "}\n\nstatic void step_backward(RtStep *st) {\n  unsigned char *A = st->arena;\n  (void)A;\n");
  const IrFunc *last_bwd = NULL;
  for (int i = 0; ok && i < m->nfuncs; i++)
    if (ir_role_phase(m->funcs[i]->role) == IR_PHASE_BWD) {
      ok = emit_func(&e, m->funcs[i]);
      if (m->funcs[i]->role == IR_ROLE_LAYER_BWD) last_bwd = m->funcs[i];
    }
  if (ok && ir_mod_int(m, "stage", 0) > 0 && last_bwd && last_bwd->nrets) {   // what a later stage sends back
    char buf[96];
    cg_spell_value(&e.sp, last_bwd->rets[0], buf, sizeof buf);
    fprintf(out, "  st->input_grad = %s;\n", buf);
  }
  fprintf(out, "}\n\n");
  ok = ok && emit_update(&e, m);
  cg_emit_model(out, m, plan, total, NULL, o);
  free(e.param_offset);
  free_fused(&e);
  return ok;
}
