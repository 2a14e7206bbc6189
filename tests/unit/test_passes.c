// Unit tests of the passes on lowered models: autodiff gives every parameter exactly one
// gradient and the functions their execution order; memplan never lets two buffers that are
// alive at the same time share a byte, keeps saved activations alive into the backward pass,
// and reuses memory; the pipeline stops and dumps where asked; the planner's stack (pass_stack),
// priced from the IR, equals lang/manual.md §8's workloads (sched_layer_cost) in the paper's setting;
// the cost pass prices fused kernels and CUDA's update run one launch each; the fuse pass's groups
// of other kernels (the gate's chain, the updates, the groups in a GEMM's pieces).
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "frontend/fe.h"
#include "passes/pass.h"
#include "sched/sched.h"

static const char *model_text(int k, double capacity, int layers, int groups) {
  static char buf[2048];
  snprintf(buf, sizeof buf,
           "model t { dtype fp32; batch 2; seqlen 8; embed 16; seed 1; optimizer adamw { lr 0.01; } }\n"
           "layer a x %d { moe { experts 4 { ffn gpt { hidden 24; act gelu; bias true; } }\n"
           "  gate gshard { k %d; capacity %g; noise 1.0; aux_loss 0.01; z_loss 0.001; groups %d; } order tutel; } }\n",
           layers, k, capacity, groups);
  return buf;
}

typedef struct Built {
  IrDiag d;
  IrSource *src;
  IrModule *m;
  PassCtx ctx;
} Built;

static void build_target(Built *b, const char *text, bool fuse, bool cpu) {
  ir_diag_init(&b->d, stderr);
  b->src = ir_source_from_buffer("test.moe", text, strlen(text));
  FeProgram *p = fe_load(&b->d, b->src);
  assert_non_null(p);
  b->m = fe_lower(&b->d, p, NULL);
  fe_program_free(p);
  assert_non_null(b->m);
  b->ctx = (PassCtx){.d = &b->d, .fuse = fuse, .fuse_cpu = cpu};
  assert_true(pass_run_pipeline(b->m, &b->ctx));
  assert_int_equal(b->d.errors, 0);
}

static void build_fused(Built *b, const char *text, bool fuse) { build_target(b, text, fuse, false); }

static void build(Built *b, const char *text) { build_fused(b, text, false); }

static void release(Built *b) {
  pass_ctx_free(&b->ctx);
  ir_module_free(b->m);
  ir_source_free(b->src);
}

// The number of op's fused group when it is a generated kernel's (elementwise, rows, store,
// colsums), else -1 (none, or the gate's chain or a run of updates).
static int64_t gid(const IrOp *op) {
  const IrGroup *g = ir_group_of(op);
  return g && g->kind != IR_GROUP_GATE && g->kind != IR_GROUP_UPDATE ? g->id : -1;
}

static void test_autodiff_one_grad_per_param(void **state) {
  Built b;
  build(&b, model_text(2, 1.0, 3, 2));
  int *grads = calloc((size_t)b.m->nparams, sizeof *grads);
  int *updates = calloc((size_t)b.m->nparams, sizeof *updates);
  for (int i = 0; i < b.m->nfuncs; i++)
    for (int j = 0; j < b.m->funcs[i]->nops; j++) {
      IrOp *op = b.m->funcs[i]->ops[j];
      if (op->kind == IR_OP_PARAM_GRAD) grads[op->args[0].param->index]++;
      if (op->kind == IR_OP_OPT_ADAMW) updates[op->args[0].param->index]++;
    }
  assert_int_equal(b.m->nparams, 3 * 5);
  for (int i = 0; i < b.m->nparams; i++) {
    assert_int_equal(grads[i], 1);
    assert_int_equal(updates[i], 1);
  }
  free(grads);
  free(updates);
  // Execution order: forwards, loss, backwards in reverse, optimizer.
  const char *want[] = {"a0.fwd", "a1.fwd", "a2.fwd", "loss.fwd", "loss.bwd", "a2.bwd", "a1.bwd", "a0.bwd", "optimizer"};
  assert_int_equal(b.m->nfuncs, 9);
  for (int i = 0; i < 9; i++) assert_string_equal(b.m->funcs[i]->name, want[i]);
  assert_ptr_equal(b.m->funcs[5]->saves, b.m->funcs[2]);
  release(&b);
}

static void check_plan(const Built *b) {
  const PassMemPlan *plan = b->ctx.memplan;
  assert_non_null(plan);
  int64_t n = 0;
  for (int i = 0; i < b->m->nfuncs; i++) n += b->m->funcs[i]->nvalues;
  const PassMemSlot **all = calloc(2 * (size_t)n, sizeof *all);
  int64_t k = 0;
  for (int i = 0; i < b->m->nfuncs; i++)
    for (int v = 0; v < b->m->funcs[i]->nvalues; v++)
      for (int c = 0; c < 2; c++) {   // the value's slot, then its bf16 copy's (dtype bf16)
        const PassMemSlot *s = c ? &plan->copy[i][v] : &plan->slot[i][v];
        if (s->kind == PASS_MEM_ARENA && b->m->funcs[i]->values[v]->def) {
          assert_true(s->offset % 64 == 0);
          assert_true(s->offset + s->bytes <= plan->arena_bytes);
          all[k++] = s;
        }
      }
  for (int64_t i = 0; i < k; i++)
    for (int64_t j = i + 1; j < k; j++) {
      const PassMemSlot *x = all[i], *y = all[j];
      bool live_overlap = x->first <= y->last && y->first <= x->last;
      bool byte_overlap = x->offset < y->offset + y->bytes && y->offset < x->offset + x->bytes;
      if (live_overlap && byte_overlap)
        fail_msg("buffers [%lld,%lld) and [%lld,%lld) alive at once share bytes", (long long)x->offset,
                 (long long)(x->offset + x->bytes), (long long)y->offset, (long long)(y->offset + y->bytes));
    }
  free((void *)all);
  assert_true(plan->arena_bytes < plan->unshared_bytes);  // reuse happened
  // Every read finds its buffer alive: the fp32 value, or its bf16 copy where the reader takes
  // that (pass_reads_copy); a value with no memory is read only inside its fused kernel.
  int64_t pos = 0;
  for (int i = 0; i < b->m->nfuncs; i++)
    for (int o = 0; o < b->m->funcs[i]->nops; o++, pos++) {
      const IrOp *op = b->m->funcs[i]->ops[o];
      for (int a = 0; a < op->nargs; a++) {
        const IrValue *v = op->args[a].value;
        if (!v || !v->def) continue;
        bool copy = pass_reads_copy(op, a);
        const PassMemSlot *s = copy ? &plan->copy[v->func->index][v->id] : &plan->slot[v->func->index][v->id];
        if (s->kind == PASS_MEM_NONE) {
          assert_false(copy);
          assert_true(v->func == b->m->funcs[i] && gid(op) >= 0 &&
                      gid(op) == gid(v->def));
        } else if (s->kind == PASS_MEM_ARENA) {
          assert_true(s->first <= pos && pos <= s->last);
        }
      }
    }
}

// Whether values a and b of the memory plan share bytes of the arena.
static bool share_bytes(const PassMemPlan *plan, const IrValue *a, const IrValue *b) {
  const PassMemSlot *x = &plan->slot[a->func->index][a->id], *y = &plan->slot[b->func->index][b->id];
  return x->kind == PASS_MEM_ARENA && y->kind == PASS_MEM_ARENA && x->offset < y->offset + y->bytes &&
         y->offset < x->offset + x->bytes;
}

// The fuse pass decides the other kernels' groups too. CUDA: each forward's gate softmax, top-k
// and gather are one `gate` group whose four tensors (the logits, scores, idx, gates) memplan keeps
// apart, and the optimizer's updates one `update` group (AdamW, one setting). The CPU: no such
// groups, but groups that run in the pieces of the GEMM before them (in_gemm), whose results
// share no bytes with the GEMM's operands or product. Without the pass, no group at all.
static void test_fuse_groups_of_other_kernels(void **state) {
  (void)state;
  Built b;
  build_fused(&b, model_text(2, 1.0, 2, 1), true);
  int gates = 0, updates = 0;
  for (int fi = 0; fi < b.m->nfuncs; fi++) {
    const IrFunc *f = b.m->funcs[fi];
    for (int k = 0; k < f->ngroups; k++) {
      const IrGroup *g = &f->groups[k];
      assert_false(g->in_gemm);
      if (g->kind == IR_GROUP_GATE) {
        gates++;
        assert_int_equal(g->n, 3);
        const IrValue *v[4] = {f->ops[g->first]->args[0].value, f->ops[g->first]->result, f->ops[g->first + 1]->result,
                               f->ops[g->first + 2]->result};
        for (int p = 0; p < 4; p++)
          for (int q = p + 1; q < 4; q++) assert_false(share_bytes(b.ctx.memplan, v[p], v[q]));
      } else if (g->kind == IR_GROUP_UPDATE) {
        updates++;
        assert_int_equal(f->role, IR_ROLE_OPTIMIZER);
        assert_int_equal(g->first, 0);
        int opts = 0;
        for (int i = 0; i < f->nops; i++) opts += f->ops[i]->kind == IR_OP_OPT_ADAMW;
        assert_int_equal(g->n, opts);
      }
    }
  }
  assert_int_equal(gates, 2);   // a layer each
  assert_int_equal(updates, 1);
  release(&b);

  build_target(&b, model_text(2, 1.0, 2, 1), true, true);
  int in_gemm = 0;
  for (int fi = 0; fi < b.m->nfuncs; fi++) {
    const IrFunc *f = b.m->funcs[fi];
    for (int k = 0; k < f->ngroups; k++) {
      const IrGroup *g = &f->groups[k];
      assert_true(g->kind != IR_GROUP_GATE && g->kind != IR_GROUP_UPDATE);
      if (!g->in_gemm) continue;
      in_gemm++;
      const IrOp *gemm = f->ops[g->first - 1];
      assert_true(gemm->kind == IR_OP_MATMUL || gemm->kind == IR_OP_EXPERT_MATMUL);
      for (int i = g->first; i < g->first + g->n; i++) {
        const IrValue *r = f->ops[i]->result;
        if (ir_op_int(f->ops[i], "inner", 0)) continue;
        assert_false(share_bytes(b.ctx.memplan, r, gemm->result));
        for (int a = 0; a < 2; a++)
          if (gemm->args[a].value) assert_false(share_bytes(b.ctx.memplan, r, gemm->args[a].value));
      }
    }
  }
  assert_true(in_gemm >= 2);   // each layer's expert bias and GELU, in the first expert GEMM's pieces
  printf("# fuse cpu: %d groups in the GEMMs' pieces\n", in_gemm);
  // A module that holds groups already (IR read back) is left as it is by the pass.
  char *before = ir_print_to_string(b.m);
  assert_true(pass_fuse(b.m, &b.ctx));
  char *after = ir_print_to_string(b.m);
  assert_string_equal(before, after);
  free(before), free(after);
  release(&b);

  build_fused(&b, model_text(2, 1.0, 2, 1), false);
  for (int fi = 0; fi < b.m->nfuncs; fi++) assert_int_equal(b.m->funcs[fi]->ngroups, 0);
  release(&b);
}

static void test_memplan_no_overlap(void **state) {
  for (int layers = 1; layers <= 3; layers++)
    for (int k = 1; k <= 2; k++) {
      Built b;
      build(&b, model_text(k, k == 1 ? 0.5 : 1.5, layers, layers == 2 ? 2 : 1));
      check_plan(&b);
      release(&b);
    }
}

// A forward value read by the backward function stays alive until that read.
static void test_memplan_saved_activation(void **state) {
  Built b;
  build(&b, model_text(2, 1.0, 1, 1));
  IrFunc *fwd = ir_find_func(b.m, "a0.fwd"), *bwd = ir_find_func(b.m, "a0.bwd");
  IrValue *scores = ir_find_value(fwd, "scores");
  assert_non_null(scores);
  const PassMemSlot *s = &b.ctx.memplan->slot[fwd->index][scores->id];
  int64_t pos = 0, last_read = -1;
  for (int i = 0; i < b.m->nfuncs; i++)
    for (int j = 0; j < b.m->funcs[i]->nops; j++, pos++)
      for (int a = 0; a < b.m->funcs[i]->ops[j]->nargs; a++)
        if (b.m->funcs[i]->ops[j]->args[a].value == scores) last_read = pos;
  assert_true(last_read > 0);
  assert_int_equal(s->last, last_read);
  bool read_in_bwd = false;
  for (int j = 0; j < bwd->nops; j++)
    for (int a = 0; a < bwd->ops[j]->nargs; a++) read_in_bwd |= bwd->ops[j]->args[a].value == scores;
  assert_true(read_in_bwd);
  release(&b);
}

// The fuse pass (the CUDA target's): in each layer's forward the expert bias and the GELU after it
// are one group, next to each other, and in its backward the experts' two bias gradients (column
// sums) another; the bias's result is saved for the backward (GELU's
// gradient reads it), so it leaves the kernel, and a member result nothing outside reads gets no
// memory. Without ctx.fuse (the CPU target, --no-fuse) nothing is marked. The memory plan of
// the fused module still never lets live buffers share bytes (a group's inputs stay alive over
// the whole group, its results from its start).
static void test_fuse_groups_elementwise_chains(void **state) {
  (void)state;
  Built b;
  build_fused(&b, model_text(2, 1.0, 2, 1), true);
  check_plan(&b);
  int groups = 0, inner = 0, colsums = 0;
  for (int fi = 0; fi < b.m->nfuncs; fi++) {
    const IrFunc *f = b.m->funcs[fi];
    for (int i = 0; i < f->nops; i++) {
      const IrOp *op = f->ops[i];
      int64_t id = gid(op);
      if (id < 0) continue;
      assert_true(ir_op_scalar(op->kind) || ir_op_row(op->kind) || ir_op_colsum(op->kind) >= 0 || ir_op_store(op->kind));
      if (ir_op_colsum(op->kind) >= 0) colsums++;
      if (i == 0 || gid(f->ops[i - 1]) != id) {   // a group's first op
        groups++;
        assert_true(i + 1 < f->nops && gid(f->ops[i + 1]) == id);   // two ops at least
        for (int j = i + 2; j < f->nops; j++)   // members are consecutive: the id does not come back
          if (gid(f->ops[j - 1]) != id) assert_int_not_equal(gid(f->ops[j]), id);
      }
      if (ir_op_int(op, "inner", 0)) {
        inner++;
        assert_int_equal(b.ctx.memplan->slot[fi][op->result->id].kind, PASS_MEM_NONE);
      }
    }
  }
  IrFunc *fwd = ir_find_func(b.m, "a0.fwd");
  IrValue *hb = NULL, *act = NULL;
  for (int i = 0; i < fwd->nops; i++) {
    if (fwd->ops[i]->kind == IR_OP_EXPERT_BIAS && !hb) hb = fwd->ops[i]->result;
    if (fwd->ops[i]->kind == IR_OP_ACT_GELU) act = fwd->ops[i]->result;
  }
  assert_non_null(hb);
  assert_non_null(act);
  assert_int_equal(act->def->index, hb->def->index + 1);
  assert_int_not_equal(gid(hb->def), -1);
  assert_int_equal(gid(hb->def), gid(act->def));
  assert_int_equal(ir_op_int(hb->def, "inner", 0), 0);   // the backward reads it
  assert_int_equal(b.ctx.memplan->slot[fwd->index][hb->id].kind, PASS_MEM_ARENA);
  assert_true(groups >= 2);
  assert_true(colsums >= 2);   // the experts' bias gradients: one launch
  printf("# fuse: %d groups, %d results in registers only, %d column sums\n", groups, inner, colsums);
  release(&b);

  build_fused(&b, model_text(2, 1.0, 2, 1), false);
  for (int fi = 0; fi < b.m->nfuncs; fi++)
    for (int i = 0; i < b.m->funcs[fi]->nops; i++) assert_int_equal(gid(b.m->funcs[fi]->ops[i]), -1);
  release(&b);

  // dtype bf16: every GEMM operand the step makes has a bf16 copy (2 bytes an element) that lives
  // at least as long as it, without sharing bytes with anything alive beside it; one that only
  // GEMMs read is stored in bf16 only (inner=1, no fp32 memory). The backward's GELU gradient
  // reads the pre-activation from its copy (bf16_reads), so the fp32 value dies before the copy.
  char text[2048];
  snprintf(text, sizeof text, "%s", model_text(2, 1.0, 2, 1));
  char *dt = strstr(text, "dtype fp32");
  assert_non_null(dt);
  memcpy(dt, "dtype bf16", 10);
  build_fused(&b, text, true);
  check_plan(&b);
  int copies = 0, only = 0, saved = 0;
  for (int fi = 0; fi < b.m->nfuncs; fi++) {
    const IrFunc *f = b.m->funcs[fi];
    for (int i = 0; i < f->nops; i++) {
      const IrOp *op = f->ops[i];
      if (op->kind != IR_OP_MATMUL && op->kind != IR_OP_EXPERT_MATMUL) continue;
      for (int a = 0; a < 2; a++) {
        const IrValue *v = op->args[a].value;
        if (!v || !v->def) continue;
        const PassMemSlot *c = &b.ctx.memplan->copy[v->func->index][v->id], *s = &b.ctx.memplan->slot[v->func->index][v->id];
        assert_int_equal(ir_op_int(v->def, "bf16", 0), 1);
        assert_int_equal(c->kind, PASS_MEM_ARENA);
        assert_int_equal(c->bytes, ir_type_numel(&v->type) * 2);
        if (s->kind == PASS_MEM_NONE) only += ir_op_int(v->def, "inner", 0) == 1;
        else assert_true(c->last >= s->last);
        copies++;
      }
    }
  }
  for (int fi = 0; fi < b.m->nfuncs; fi++)
    for (int i = 0; i < b.m->funcs[fi]->nops; i++) {
      const IrOp *op = b.m->funcs[fi]->ops[i];
      for (int a = 0; a < op->nargs; a++) {
        if (!((ir_op_int(op, "bf16_reads", 0) >> a) & 1)) continue;
        const IrValue *v = op->args[a].value;
        const PassMemSlot *c = &b.ctx.memplan->copy[v->func->index][v->id], *s = &b.ctx.memplan->slot[v->func->index][v->id];
        assert_true(op->kind == IR_OP_ACT_GELU_GRAD && v->func == b.m->funcs[fi]->saves && pass_reads_copy(op, a));
        assert_int_equal(c->kind, PASS_MEM_ARENA);
        assert_true(s->kind == PASS_MEM_NONE || s->last < c->last);
        saved++;
      }
    }
  assert_true(copies >= 4);
  assert_true(only >= 1);
  assert_true(saved >= 1);
  printf("# bf16: %d GEMM operands with a copy, %d in bf16 only, %d saved activations read from copies\n", copies, only,
         saved);
  release(&b);
}

// The fuse pass on a pre-norm GPT-MoE block (attention with biases, LayerNorm, an MoE with
// biased GELU experts): the program order stays valid (every operand made before its reader);
// the residual add before the second norm is that norm's prologue and still leaves the kernel
// (the combine's residual reads it), computed again where the norm stores; column sums move
// down to the end of the backward and make one group there; with dtype bf16 the dispatch
// (order.encode, a GEMM operand) is a group of one that writes its bf16 copy.
static void test_fuse_prologues_and_column_sums(void **state) {
  (void)state;
  const char *text =
      "model g {\n  dtype %s; batch 2; seqlen 8; embed 16; seed 1; vocab 32; position learned; norm layernorm;\n"
      "  tie_embeddings true; optimizer sgd { lr 0.1; }\n}\n"
      "layer block x 2 {\n  attention { heads 2; }\n  moe {\n    experts 2 { ffn gpt { hidden 32; act gelu; } }\n"
      "    gate gshard { k 2; capacity 1.25; aux_loss 0.01; }\n  }\n}\n";
  char model[1024];
  for (int bf16 = 0; bf16 < 2; bf16++) {
    snprintf(model, sizeof model, text, bf16 ? "bf16" : "fp32");
    Built b;
    build_fused(&b, model, true);
    check_plan(&b);
    int stored_prologue = 0, sums = 0, encode_copy = 0;
    for (int fi = 0; fi < b.m->nfuncs; fi++) {
      const IrFunc *f = b.m->funcs[fi];
      for (int i = 0; i < f->nops; i++) {
        const IrOp *op = f->ops[i];
        for (int a = 0; a < op->nargs; a++) {
          const IrValue *v = op->args[a].value;
          if (v && v->def && v->func == f) assert_true(v->def->index < i);
        }
        int64_t id = gid(op);
        if (op->kind == IR_OP_ORDER_ENCODE && bf16) {
          assert_true(id >= 0 && ir_op_int(op, "bf16", 0) == 1);
          encode_copy++;
        }
        if (id < 0 || (i > 0 && gid(f->ops[i - 1]) == id)) continue;
        int n = 1;   // a group's first op: its members
        while (i + n < f->nops && gid(f->ops[i + n]) == id) n++;
        for (int j = 0; j < n; j++) {
          const IrOp *mj = f->ops[i + j];
          if (ir_op_row(mj->kind))   // a prologue member before it that leaves the kernel
            for (int p = 0; p < j; p++) stored_prologue += !ir_op_int(f->ops[i + p], "inner", 0);
          if (ir_op_colsum(mj->kind) >= 0) {   // sums among themselves, at the backward's end
            assert_true(ir_op_colsum(f->ops[i]->kind) >= 0);
            for (int p = i + n; p < f->nops; p++) assert_true(f->ops[p]->kind == IR_OP_PARAM_GRAD);
            sums++;
          }
        }
      }
    }
    assert_true(stored_prologue >= 2);   // a block's second norm, in each of the two blocks
    assert_true(sums >= 8);   // a block's biases of q, k, v, o, two norm weights and biases
    if (bf16) assert_int_equal(encode_copy, 2);
    printf("# fuse %s: %d stored prologue values, %d column sums in groups\n", bf16 ? "bf16" : "fp32",
           stored_prologue, sums);
    release(&b);
  }
  // The CPU target's groups: elementwise ops of one row length with at most one norm (one parallel
  // region over rows; the norm's result and every value crossing it have memory), and column sums
  // (one parallel region); no storing op, no bf16 copy.
  snprintf(model, sizeof model, text, "fp32");
  Built b;
  build_target(&b, model, true, true);
  check_plan(&b);
  int loops = 0, sums = 0, norms = 0;
  for (int fi = 0; fi < b.m->nfuncs; fi++) {
    const IrFunc *f = b.m->funcs[fi];
    for (int i = 0; i < f->nops; i++) {
      const IrOp *op = f->ops[i];
      int64_t id = gid(op);
      if (id < 0) continue;
      assert_true(ir_op_scalar(op->kind) || ir_op_colsum(op->kind) >= 0 || ir_op_row(op->kind));
      assert_int_equal(ir_op_int(op, "bf16", 0), 0);
      if (ir_op_row(op->kind)) {
        norms++;
        assert_int_equal(ir_op_int(op, "inner", 0), 0);
        assert_int_equal(b.ctx.memplan->slot[fi][op->result->id].kind, PASS_MEM_ARENA);
        for (int a = 0; a < op->nargs; a++)   // what it reads from a member has memory too
          if (op->args[a].value && op->args[a].value->def && gid(op->args[a].value->def) == id)
            assert_int_equal(ir_op_int(op->args[a].value->def, "inner", 0), 0);
      }
      const IrOp *first = op;
      for (int j = i; j >= 0 && gid(f->ops[j]) == id; j--) first = f->ops[j];
      assert_int_equal(ir_op_colsum(op->kind) >= 0, ir_op_colsum(first->kind) >= 0);
      if (ir_op_colsum(op->kind) >= 0) {
        sums++;
      } else if (!ir_op_row(op->kind)) {
        loops++;
        const IrType *a = &op->result->type, *t = &first->result->type;
        assert_int_equal(a->dim[a->rank - 1], t->dim[t->rank - 1]);
      }
    }
  }
  assert_true(loops >= 4 && sums >= 8 && norms >= 4);
  printf("# fuse cpu: %d elementwise ops in loops, %d norms among them, %d column sums in groups\n", loops, norms, sums);
  release(&b);
}

static void test_pipeline_stop_after(void **state) {
  IrDiag d;
  ir_diag_init(&d, stderr);
  const char *text = model_text(1, 1.0, 1, 1);
  IrSource *src = ir_source_from_buffer("t.moe", text, strlen(text));
  FeProgram *p = fe_load(&d, src);
  IrModule *m = fe_lower(&d, p, NULL);
  fe_program_free(p);
  char *dump = NULL;
  size_t len = 0;
  FILE *out = open_memstream(&dump, &len);
  PassCtx ctx = {.d = &d, .dump_after = "shapes", .stop_after = "shapes", .dump_out = out};
  assert_true(pass_run_pipeline(m, &ctx));
  fclose(out);
  assert_null(ir_find_func(m, "loss.bwd"));  // autodiff did not run
  assert_non_null(strstr(dump, "func @a0.fwd("));
  assert_null(strstr(dump, ".bwd"));
  free(dump);
  pass_ctx_free(&ctx);
  ir_module_free(m);
  ir_source_free(src);
}

// lang/manual.md §11's rounding of the capacity: a whole k*f*S/E stays whole. k 1, f 1.1, S 200, E 2 is
// 110.00000000000001 in double, which ceil alone makes 111.
static void test_capacity_whole_stays_whole(void **state) {
  (void)state;
  assert_int_equal(ir_capacity_slots(1, 1.1, 200, 2), 110);
  assert_int_equal(ir_capacity_slots(1, 1.1, 201, 2), 111);   // 110.55: up
  assert_int_equal(ir_capacity_slots(2, 1.2, 40, 8), 12);     // 12.000000000000002
  assert_int_equal(ir_capacity_slots(1, 0.01, 8, 4), 1);      // at least 1
  const char *text =
      "model t {\n  batch 2; seqlen 100; embed 8; optimizer sgd { lr 0.1; }\n}\n"
      "layer a { moe { experts 2 { ffn gpt { hidden 8; } } gate gshard { k 1; capacity 1.1; } } }\n";
  IrDiag d;
  ir_diag_init(&d, stderr);
  IrSource *src = ir_source_from_buffer("t.moe", text, strlen(text));
  FeProgram *p = fe_load(&d, src);
  assert_non_null(p);
  IrModule *m = fe_lower(&d, p, NULL);
  assert_non_null(m);
  int found = 0;
  for (int f = 0; f < m->nfuncs; f++)
    for (int i = 0; i < m->funcs[f]->nops; i++)
      if (m->funcs[f]->ops[i]->kind == IR_OP_GATE_LOCATIONS) {
        assert_int_equal(ir_op_int(m->funcs[f]->ops[i], "capacity", 0), 110);
        found++;
      }
  assert_int_equal(found, 1);
  ir_module_free(m);
  fe_program_free(p);
  ir_source_free(src);
}

// dtype bf16 is the CUDA target's: lowering for the CPU refuses it at the dtype, for the CUDA
// target (and with no target, as dump-ir lowers) it gives the module with dtype="bf16".
static void test_lower_bf16_by_target(void **state) {
  const char *text =
      "model t {\n  dtype bf16; batch 2; seqlen 8; embed 16; optimizer sgd { lr 0.1; }\n}\n"
      "layer a { moe { experts 4 { ffn gpt { hidden 8; } } gate gshard { k 1; } } }\n";
  const FeTargetCaps cpu = {.name = "cpu", .bf16 = false}, cuda = {.name = "cuda", .bf16 = true};
  const FeTargetCaps *targets[] = {&cpu, &cuda, NULL};
  for (int t = 0; t < 3; t++) {
    char *err = NULL;
    size_t len = 0;
    FILE *errf = open_memstream(&err, &len);
    IrDiag d;
    ir_diag_init(&d, errf);
    IrSource *src = ir_source_from_buffer("t.moe", text, strlen(text));
    FeProgram *p = fe_load(&d, src);
    assert_non_null(p);
    IrModule *m = fe_lower(&d, p, targets[t]);
    fclose(errf);
    if (targets[t] == &cpu) {
      assert_null(m);
      assert_int_equal(d.errors, 1);
      assert_non_null(strstr(err, "t.moe:2:9: error: dtype 'bf16' runs on the CUDA target only"));
      assert_non_null(strstr(err, "--target cuda"));
    } else {
      assert_non_null(m);
      assert_int_equal(d.errors, 0);
      assert_string_equal(ir_mod_str(m, "dtype", "?"), "bf16");
    }
    free(err);
    ir_module_free(m);
    fe_program_free(p);
    ir_source_free(src);
  }
  (void)state;
}

// The paper's setting (mp = esp, k * capacity * S / E whole): the stack the pipeline pass and
// `moec plan` plan, priced from the IR, has lang/manual.md §8's per-chunk times of the MoE part at every
// r (sched_layer_cost, from the formulas), so the MP AllGather after the layer is not counted as
// the ESP one; its dense part is the gate's GEMMs and its dense gradient the gate's. A dropless
// gate priced at a capacity factor is the gate compiled with it.
static void test_stack_prices_design_workloads(void **state) {
  static const char *text =
      "model t { dtype fp32; batch 2; seqlen 8; embed 16; seed 1; optimizer sgd { lr 0.1; } }\n"
      "parallel { dp 2; mp 2; ep 2; esp 2; }\n"
      "layer a { moe { experts 4 { ffn gpt { hidden 24; } } gate gshard { k 2; capacity %s; } order tutel; } }\n";
  const SchedCluster c = {.name = "t", .nodes = 2, .gpus_per_node = 2, .gemm = {2e-3, 3e-6}, .alltoall = {1e-2, 2e-4},
                          .allgather = {3e-3, 5e-5}, .reducescatter = {4e-3, 6e-5}, .allreduce = {5e-3, 7e-4}};
  PassStack st[2];
  IrModule *m[2];
  IrSource *src[2];
  IrDiag d;
  ir_diag_init(&d, stderr);
  for (int v = 0; v < 2; v++) {   // capacity 1.0, then dropless
    char buf[1024];
    snprintf(buf, sizeof buf, text, v ? "*" : "1.0");
    src[v] = ir_source_from_buffer("t.moe", buf, strlen(buf));
    FeProgram *p = fe_load(&d, src[v]);
    assert_non_null(p);
    m[v] = fe_lower(&d, p, NULL);
    fe_program_free(p);
    assert_non_null(m[v]);
    PassCtx ctx = {.d = &d, .stop_after = "cost", .cluster = &c};
    assert_true(pass_run_pipeline(m[v], &ctx));
    pass_ctx_free(&ctx);
    assert_true(pass_stack(m[v], &c, &st[v]));
    assert_int_equal(st[v].n, 1);
  }
  SchedLayerSpec spec = {.batch = 2, .seqlen = 8, .embed = 16, .hidden = 24, .f = 2.0, .experts = 4,
                         .ffn = SCHED_FFN_GPT, .dp = 2, .mp = 2, .ep = 2, .esp = 2};
  SchedLayerCost want, at;
  sched_layer_cost(&spec, &c, &want);
  // lang/manual.md §8 prices one GEMM launch per expert GEMM of a chunk (a batched GEMM); the runtime
  // makes one call per expert of the rank (experts / ep = 2 here), and the IR is priced so.
  for (int ph = 0; ph < 2; ph++) want.phase[ph].exp.alpha *= 2;
  int r_max;
  assert_false(pass_dropless_at(&st[0], 0, 1.0, &at, &r_max));   // its gate drops tokens
  assert_true(pass_dropless_at(&st[1], 0, 1.0, &at, &r_max));
  assert_int_equal(st[0].r_max[0], 4);   // C = ceil(2 * 1.0 * 8 / 4) on each of the mp ranks' 8 tokens
  assert_int_equal(r_max, 4);
  assert_int_equal(st[1].r_max[0], 8);   // dropless: every token at one expert
  const SchedLayerCost *got[2] = {&st[0].cost[0], &at};
  for (int k = 0; k < 2; k++)
    for (int ph = 0; ph < 2; ph++)
      for (int r = 1; r <= 4; r++) {
        SchedChunk g = sched_chunk(&got[k]->phase[ph], r), w = sched_chunk(&want.phase[ph], r);
        assert_float_equal(g.a2a, w.a2a, 1e-12);
        assert_float_equal(g.ag, w.ag, 1e-12);
        assert_float_equal(g.rs, w.rs, 1e-12);
        assert_float_equal(g.exp, w.exp, 1e-12);
      }
  // The gate: [8, 16] x [16, 4] per rank forward, two such GEMMs backward; its gradient 16 x 4.
  assert_float_equal(st[0].cost[0].phase[SCHED_FWD].t_att, c.gemm.alpha + c.gemm.beta * 8 * 16 * 4, 1e-12);
  assert_float_equal(st[0].cost[0].phase[SCHED_BWD].t_att, 2 * (c.gemm.alpha + c.gemm.beta * 8 * 16 * 4), 1e-12);
  assert_float_equal(st[0].cost[0].n_grad, 16 * 4, 0);
  for (int v = 0; v < 2; v++) {
    pass_stack_free(&st[v]);
    ir_module_free(m[v]);
    ir_source_free(src[v]);
  }
  (void)state;
}

// The cost pass prices the program that runs (passes/cost.c): each group the fuse pass makes is
// one launch over the floats its kernel moves, on its last member (the others 0), and on CUDA the
// optimizer's one run of AdamW ops is one launch and a gate's softmax, top-k and gather one kernel;
// --no-fuse prices every op on its own, dearer.
static double priced_total(const char *text, const SchedCluster *c, bool fuse, int *groups, int *alphas) {
  IrDiag d;
  ir_diag_init(&d, stderr);
  IrSource *src = ir_source_from_buffer("test.moe", text, strlen(text));
  FeProgram *p = fe_load(&d, src);
  assert_non_null(p);
  IrModule *m = fe_lower(&d, p, NULL);
  fe_program_free(p);
  assert_non_null(m);
  PassCtx ctx = {.d = &d, .cluster = c, .fuse = fuse, .fuse_cpu = false};
  assert_true(pass_run_pipeline(m, &ctx));
  double total = 0;
  *groups = 0, *alphas = 0;
  for (int i = 0; i < m->nfuncs; i++)
    for (int j = 0; j < m->funcs[i]->nops; j++) {
      const IrOp *op = m->funcs[i]->ops[j];
      double t = ir_op_float(op, "cost_t", 0), n = ir_op_float(op, "cost_n", 0);
      total += t;
      int64_t g = ir_op_int(op, "cost_fused", -1);
      if (g >= 0 && t > 0) {   // a group's last member: one launch over the kernel's floats
        assert_float_equal(t, c->elementwise.alpha + c->elementwise.beta * n, 1e-12);
        (*groups)++;
      }
      if (op->kind == IR_OP_OPT_ADAMW && t >= c->update_adamw.alpha) (*alphas)++;
      if (op->kind == IR_OP_GATE_TOPK) assert_true(fuse ? t == 0 && g >= 0 : t > 0);   // inside the gate's kernel
      if (op->kind == IR_OP_GATE_GATHER && fuse) assert_true(g >= 0 && t > 0);       // which it carries
    }
  pass_ctx_free(&ctx);
  ir_module_free(m);
  ir_source_free(src);
  return total;
}

static void test_cost_prices_fused_kernels(void **state) {
  const SchedCluster c = {.name = "t", .nodes = 1, .gpus_per_node = 1, .gemm = {2e-3, 3e-6}, .alltoall = {1e-2, 2e-4},
                          .allgather = {3e-3, 5e-5}, .reducescatter = {4e-3, 6e-5}, .allreduce = {5e-3, 7e-4},
                          .elementwise = {1e-2, 1e-6}, .update_adamw = {3e-2, 2e-6}};
  const char *text = model_text(2, 1.0, 2, 1);
  int groups, alphas, none, op_alphas;
  double fused = priced_total(text, &c, true, &groups, &alphas);
  double alone = priced_total(text, &c, false, &none, &op_alphas);
  assert_true(groups > 0);
  assert_int_equal(none, 0);
  assert_int_equal(alphas, 1);           // the update: one run, one launch
  assert_int_equal(op_alphas, 2 * 5);    // op by op: every parameter's
  assert_true(fused < alone);
  (void)state;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_autodiff_one_grad_per_param),
      cmocka_unit_test(test_memplan_no_overlap),
      cmocka_unit_test(test_memplan_saved_activation),
      cmocka_unit_test(test_pipeline_stop_after),
      cmocka_unit_test(test_fuse_groups_elementwise_chains),
      cmocka_unit_test(test_fuse_prologues_and_column_sums),
      cmocka_unit_test(test_fuse_groups_of_other_kernels),
      cmocka_unit_test(test_lower_bf16_by_target),
      cmocka_unit_test(test_capacity_whole_stays_whole),
      cmocka_unit_test(test_stack_prices_design_workloads),
      cmocka_unit_test(test_cost_prices_fused_kernels),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
