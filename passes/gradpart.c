// The `gradpart` pass (lang/manual.md §8 and §14, paper §5): where the dense gradients are
// all-reduced.
//
// autodiff all-reduces a replicated parameter's gradient (the gate's, over the world) right
// where it is computed, inside the layer's backward, which the layer then waits for. With
// `schedule { grad_partition auto; }` (or `chunk SIZE`) this pass takes those AllReduces out
// and puts slices of the gradients into the overlap slots of the layers whose backward runs
// later, as in-place `comm.allreduce_grad @param {offset, count}` ops:
//   slot="moe"    inside layer i's backward expert region; the schedule pass moves it behind
//                 the last dispatch AlltoAll, on the inter-node stream, while the experts compute;
//   slot="dense"  right after layer i's expert region, beside its dense backward (the order and
//                 gate backward on the compute stream);
//   slot="tail"   after the last backward layer, what no slot could hide.
// Gradient is consumed first-in first-out in the order it becomes ready (the last layer's
// first), so a slot only holds gradient that already exists (paper eq. (5)).
//   auto       the amounts the pipeline pass planned (grad_moe, grad_dense on each backward
//              function; the rest is the tail); policy pipemoe-lina: 30 MB chunks, as below;
//   chunk N    every layer's gradient in pieces of N bytes, all in the MoE slot of the next
//              backward layer (PipeMoE+Lina's fixed chunks); the first layer's at the tail.
// `none` (the default) leaves autodiff's AllReduces where they are. The sums are the same
// whichever slot does them, so the gradients do not change (tests/mpi/gradpart.sh checks it).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pass.h"

typedef struct Piece {
  IrParam *param;
  int64_t offset, count;   // elements of the gradient not yet placed
  const char *group;
  int64_t size;
} Piece;

typedef struct Queue {
  Piece *p;
  int head, n, cap;
} Queue;

static bool enqueue(Queue *q, Piece p) {
  if (q->n == q->cap) {
    q->cap = q->cap ? 2 * q->cap : 16;
    Piece *np = realloc(q->p, sizeof *np * (size_t)q->cap);
    if (!np) return false;
    q->p = np;
  }
  q->p[q->n++] = p;
  return true;
}

static int64_t pending(const Queue *q) {
  int64_t n = 0;
  for (int i = q->head; i < q->n; i++) n += q->p[i].count;
  return n;
}

// Takes autodiff's AllReduces over a replica group (the world; a language model's dense
// parameters: DP) out of bwd: param.grad reads the unreduced value.
// Their parameters join the queue in the order the gradients were computed.
static bool take_allreduces(IrFunc *bwd, Queue *q) {
  for (int i = 0; i < bwd->nops; i++) {
    IrOp *ar = bwd->ops[i];
    const char *group = ir_op_str(ar, "group", "");
    if (ar->kind != IR_OP_COMM_ALLREDUCE || (strcmp(group, "world") != 0 && strcmp(group, "dp") != 0)) continue;
    IrOp *pg = NULL;
    int users = 0;
    for (int j = 0; j < bwd->nops; j++)
      for (int a = 0; a < bwd->ops[j]->nargs; a++)
        if (bwd->ops[j]->args[a].value == ar->result) {
          users++;
          if (bwd->ops[j]->kind == IR_OP_PARAM_GRAD) pg = bwd->ops[j];
        }
    if (users != 1 || !pg) continue;   // not a parameter's gradient: leave it
    pg->args[1].value = ar->args[0].value;
    IrParam *p = pg->args[0].param;
    Piece piece = {p, 0, ir_type_numel(&p->type), ir_op_str(ar, "group", "world"), ir_op_int(ar, "size", 1)};
    if (!enqueue(q, piece)) return false;
    ir_remove_op(bwd, ar);
    i--;
  }
  return true;
}

// Puts up to `amount` elements from the queue's front at f's op index `at`, as slot `slot`, in
// pieces of at most `piece_max` elements (0: whole parameters). Returns the next free index.
static int place(IrModule *m, IrFunc *f, int at, const char *slot, Queue *q, int64_t amount, int64_t piece_max) {
  while (amount > 0 && q->head < q->n) {
    Piece *p = &q->p[q->head];
    int64_t take = p->count < amount ? p->count : amount;
    if (piece_max > 0 && take > piece_max) take = piece_max;
    IrOp *op = ir_add_op(f, m, IR_OP_COMM_ALLREDUCE_GRAD, NULL, (IrType){0});
    ir_op_param(op, p->param);
    ir_attrs_set_str(m, op->attrs, &op->nattrs, "group", p->group);
    ir_op_set_int(op, "size", p->size);
    ir_op_set_int(op, "offset", p->offset);
    ir_op_set_int(op, "count", take);
    ir_attrs_set_str(m, op->attrs, &op->nattrs, "slot", slot);
    if (ir_attrs_get(p->param->attrs, p->param->nattrs, "shard"))   // a sharded optimizer's (autodiff)
      ir_op_set_int(op, "shard", p->param->type.dim[0]);
    op->loc = p->param->loc;
    memmove(&f->ops[at + 1], &f->ops[at], sizeof *f->ops * (size_t)(f->nops - 1 - at));
    f->ops[at] = op;
    for (int i = 0; i < f->nops; i++) f->ops[i]->index = i;
    at++;
    p->offset += take;
    p->count -= take;
    amount -= take;
    if (p->count == 0) q->head++;
  }
  return at;
}

// Where the slots of a backward function are: before its first AlltoAll (else at the start of
// its expert region) for the MoE slot, right after the region for the dense slot; -1: none.
static void slots_of(const IrFunc *f, int *moe, int *dense) {
  IrValue *entry, *exit;
  *moe = *dense = -1;
  if (!pass_expert_region(f, &entry, &exit)) return;
  *moe = entry->def ? entry->def->index + 1 : 0;
  for (int i = *moe; i < f->nops; i++)
    if (f->ops[i]->kind == IR_OP_COMM_ALLTOALL) {
      *moe = i;
      break;
    }
  *dense = exit->def->index + 1;
}

static bool is_layer_bwd(const PassLayer *l, int n, const IrFunc *f) {
  for (int i = 0; i < n; i++)
    if (l[i].bwd == f) return true;
  return false;
}

bool pass_gradpart(IrModule *m, PassCtx *ctx) {
  const char *mode = ir_mod_str(m, "grad_partition", "none");
  if (strcmp(mode, "none") == 0) return true;
  bool chunked = strcmp(mode, "chunk") == 0;
  int64_t chunk_bytes = ir_mod_int(m, "grad_chunk", 0);
  if (strcmp(mode, "auto") == 0 && strcmp(ir_mod_str(m, "policy", ""), "pipemoe-lina") == 0) {
    chunked = true;
    chunk_bytes = (int64_t)SCHED_LINA_CHUNK_BYTES;
  }
  if (!chunked && strcmp(mode, "auto") != 0) return ir_error(ctx->d, "gradpart: unknown grad_partition '%s'", mode);
  if (chunked && chunk_bytes < 4) return ir_error(ctx->d, "gradpart: grad_partition chunk needs at least 4 bytes");
  int64_t piece = chunked ? chunk_bytes / 4 : 0;
  // Already placed (IR read back after this pass): leave it. (autodiff's own in-place sum of a
  // gradient with two contributions, a tied embedding's, has no slot.)
  for (int i = 0; i < m->nfuncs; i++)
    for (int j = 0; j < m->funcs[i]->nops; j++) {
      const IrOp *op = m->funcs[i]->ops[j];
      if (op->kind == IR_OP_COMM_ALLREDUCE_GRAD && ir_attrs_get(op->attrs, op->nattrs, "slot")) return true;
    }

  PassLayer *l;
  int n = pass_find_layers(m, &l);
  if (n < 0) return ir_oom(ctx->d);
  Queue q = {0};
  IrFunc *last = NULL;
  int placed_slots = 0;
  int64_t outside = 0;   // gradient elements of the functions outside the layers (embedding, head)
  bool ok = true;
  // The backward visits the layers in module order of their backward functions; one without an
  // expert region (a language model's head, an mlp layer, the embedding) has no slots: its
  // gradients join the queue.
  for (int i = 0; ok && i < m->nfuncs; i++) {
    IrFunc *f = m->funcs[i];
    if (f->role != IR_ROLE_LAYER_BWD && f->role != IR_ROLE_LOSS_BWD) continue;
    if (!is_layer_bwd(l, n, f)) {
      int64_t before = pending(&q);
      ok = take_allreduces(f, &q);
      outside += pending(&q) - before;
      last = f;
      continue;
    }
    int moe, dense;
    slots_of(f, &moe, &dense);
    int64_t want_moe = chunked ? pending(&q) : ir_func_int(f, "grad_moe", 0);
    int64_t want_dense = chunked ? 0 : ir_func_int(f, "grad_dense", 0);
    int64_t before = pending(&q);
    if (moe >= 0 && want_moe > 0) {
      int end = place(m, f, moe, "moe", &q, want_moe, piece);
      if (dense >= moe) dense += end - moe;
    }
    if (dense >= 0 && want_dense > 0) place(m, f, dense, "dense", &q, want_dense, piece);
    if (pending(&q) < before) placed_slots++;
    ok = take_allreduces(f, &q);
    last = f;
  }
  int64_t tail = pending(&q);
  if (ok && last && tail > 0) place(m, last, last->nops, "tail", &q, tail, piece);
  if (!ok) ir_oom(ctx->d);
  else if (ctx->verbose)
    fprintf(ctx->log ? ctx->log : stderr,
            "# gradpart: %s: gradients in the overlap slots of %d backward layers, %lld elements after the backward "
            "pass (%lld of them from the functions outside the layers: embedding, head, final norm)\n",
            chunked ? "fixed chunks" : "planned partition", placed_slots, (long long)tail, (long long)outside);
  free(q.p);
  free(l);
  return ok;
}
