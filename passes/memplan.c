// The `memplan` pass: where every value of the step lives.
//
// The step runs the module's functions in order, and each function's first argument is the
// previous function's first result (the layer input is the previous layer's output, a backward
// function's %dout the gradient the previous backward returned); the first function reads the
// step's input and `@loss.fwd`'s second argument the target. So an argument is never a buffer
// of its own: it resolves to the value it aliases. Every other value gets a live range over
// global op positions — from its definition to its last use anywhere in the step, so a forward
// value read by a backward function (a saved activation) stays alive across the phase boundary —
// and an offset in one arena, packed first-fit by position so buffers whose ranges do not
// overlap share bytes. A value whose only use is `param.grad` is written straight into that
// parameter's gradient buffer. The final layer output stays alive to the end of the step (the
// binary's --dump reads it after the backward pass).
//
// Streams. A function whose ops the schedule put on the intra or inter stream runs them
// concurrently (codegen/emit_c.c, runtime/streams.c), so program order says nothing about when
// a buffer's last reader is done. In such a function buffers are not reused: every value live
// at some position inside it (defined, read or passed through there) stays alive to the end of
// the function, whose boundary is a full synchronisation; reuse across functions is unchanged.
// -v reports how many functions that applies to.
#include <stdlib.h>
#include <string.h>

#include "pass.h"

#define ALIGN 64

typedef struct Item {
  PassMemSlot *slot;
  int64_t order;   // tie-break: definition order
} Item;

static int by_first(const void *a, const void *b) {
  const Item *x = a, *y = b;
  if (x->slot->first != y->slot->first) return x->slot->first < y->slot->first ? -1 : 1;
  return x->order < y->order ? -1 : x->order > y->order;
}

// Ops on more than one stream (passes/schedule.c): the function runs them concurrently.
static bool streamed(const IrFunc *f) {
  for (int i = 0; i < f->nops; i++)
    if (f->ops[i]->stream == IR_STREAM_INTRA || f->ops[i]->stream == IR_STREAM_INTER) return true;
  return false;
}

// The live ranges of every value of the step (pass 1), which pack (pass 2) places in the arena.
// Arguments share their source's slot, so resolution goes through pointers: where[fi][v] is the
// slot of value v of function fi (one of storage[], or input or target).
typedef struct Ranges {
  PassMemSlot input, target;
  PassMemSlot *storage;   // the results' slots, [used]
  Item *items;            // the same in definition order, for packing
  int64_t used;
  PassMemSlot ***where;   // [nfuncs][nvalues]
  int nfuncs;
  int nstreamed;          // functions with concurrent streams (no reuse inside them)
} Ranges;

static void ranges_free(Ranges *R) {
  for (int fi = 0; R->where && fi < R->nfuncs; fi++) free(R->where[fi]);
  free(R->where);
  free(R->storage);
  free(R->items);
}

// f's arguments resolved to the slots they alias (see the file comment); false, reported, when
// one does not follow the calling convention.
static bool resolve_args(IrModule *m, PassCtx *ctx, Ranges *R, int fi) {
  IrFunc *f = m->funcs[fi];
  for (int ai = 0; ai < f->nargs; ai++) {
    PassMemSlot *src = NULL;
    if (f->role == IR_ROLE_LOSS_FWD && ai == 1) src = &R->target;
    else if (ai == 0 && fi == 0) src = &R->input;
    else if (ai == 0) {
      IrFunc *prev = m->funcs[fi - 1];
      if (prev->nrets >= 1 && ir_type_equal(&prev->rets[0]->type, &f->args[0]->type))
        src = R->where[fi - 1][prev->rets[0]->id];
    }
    if (!src)
      return ir_error_at(ctx->d, f->loc,
                         "memplan: argument %d of '@%s' does not follow the step's calling convention "
                         "(argument 0 is the previous function's first result)", ai, f->name);
    R->where[fi][f->args[ai]->id] = src;
  }
  return true;
}

// Functions with concurrent streams: no reuse inside them. Every value live at some position
// of such a function [fstart, fend] stays alive to its end.
static void extend_streamed(IrModule *m, Ranges *R, const int64_t *fstart, const int64_t *fend) {
  for (int fi = 0; fi < m->nfuncs; fi++) {
    if (!streamed(m->funcs[fi])) continue;
    R->nstreamed++;
    for (int64_t i = 0; i < R->used; i++) {
      PassMemSlot *s = R->items[i].slot;
      if (s->first <= fend[fi] && s->last >= fstart[fi] && s->last < fend[fi]) s->last = fend[fi];
    }
  }
}

// Values read at the end of the step stay alive to it; values whose only use is param.grad go to
// the gradient buffer.
static void step_ends(IrModule *m, Ranges *R) {
  // The output of the last layer forward is read at the end of the step.
  for (int fi = 0; fi < m->nfuncs; fi++)
    if (m->funcs[fi]->role == IR_ROLE_LOSS_FWD && fi > 0 && m->funcs[fi - 1]->nrets)
      R->where[fi - 1][m->funcs[fi - 1]->rets[0]->id]->last = INT64_MAX;
  // So are a language model's logits (the loss function's second result).
  for (int fi = 0; fi < m->nfuncs; fi++)
    if (m->funcs[fi]->role == IR_ROLE_LOSS_FWD && m->funcs[fi]->nrets > 1)
      R->where[fi][m->funcs[fi]->rets[1]->id]->last = INT64_MAX;
  for (int fi = 0; fi < m->nfuncs; fi++) {
    IrFunc *f = m->funcs[fi];
    for (int oi = 0; oi < f->nops; oi++) {
      IrOp *op = f->ops[oi];
      if (op->kind != IR_OP_PARAM_GRAD || !op->args[1].value || op->args[1].value->func != f) continue;
      if (ir_op_int(op, "accumulate", 0)) continue;   // adds to what an earlier function wrote
      IrValue *v = op->args[1].value;
      int uses = 0;
      for (int k = 0; k < f->nops; k++)
        for (int a = 0; a < f->ops[k]->nargs; a++) uses += f->ops[k]->args[a].value == v;
      for (int r = 0; r < f->nrets; r++) uses += f->rets[r] == v;
      if (uses == 1 && v->def) {
        PassMemSlot *s = R->where[fi][v->id];
        s->kind = PASS_MEM_GRAD;
        s->offset = op->args[0].param->index;
      }
    }
  }
}

// Pass 1: resolve arguments, give results a slot with their definition position, extend each
// to its last use.
static bool live_ranges(IrModule *m, PassCtx *ctx, Ranges *R) {
  int64_t nvalues = 0;
  for (int i = 0; i < m->nfuncs; i++) nvalues += m->funcs[i]->nvalues;
  R->nfuncs = m->nfuncs;
  R->storage = calloc((size_t)nvalues + 1, sizeof *R->storage);
  R->items = calloc((size_t)nvalues + 1, sizeof *R->items);
  R->where = calloc((size_t)m->nfuncs + 1, sizeof *R->where);
  int64_t *fstart = calloc((size_t)m->nfuncs + 1, sizeof *fstart), *fend = calloc((size_t)m->nfuncs + 1, sizeof *fend);
  bool ok = R->storage && R->items && R->where && fstart && fend;
  for (int fi = 0; ok && fi < m->nfuncs; fi++)
    ok = (R->where[fi] = calloc((size_t)m->funcs[fi]->nvalues + 1, sizeof(PassMemSlot *))) != NULL;
  if (!ok) {
    free(fstart);
    free(fend);
    return ir_oom(ctx->d);
  }
  int64_t pos = 0;
  for (int fi = 0; ok && fi < m->nfuncs; fi++) {
    IrFunc *f = m->funcs[fi];
    if (!(ok = resolve_args(m, ctx, R, fi))) break;
    fstart[fi] = pos;
    for (int oi = 0; oi < f->nops; oi++, pos++) {
      IrOp *op = f->ops[oi];
      for (int a = 0; a < op->nargs; a++) {
        IrValue *v = op->args[a].value;
        if (!v) continue;
        PassMemSlot *s = R->where[v->func->index][v->id];
        if (s && s->last < pos) s->last = pos;
      }
      if (!op->result) continue;
      PassMemSlot *s = &R->storage[R->used];
      s->kind = PASS_MEM_ARENA;
      s->first = s->last = pos;
      s->bytes = ir_type_bytes(&op->result->type);
      R->items[R->used] = (Item){s, R->used};
      R->used++;
      R->where[fi][op->result->id] = s;
    }
    for (int r = 0; r < f->nrets; r++) {
      PassMemSlot *s = R->where[fi][f->rets[r]->id];
      if (s->last < pos) s->last = pos;  // read after the function by the generated code
    }
    fend[fi] = pos;
  }
  if (ok) extend_streamed(m, R, fstart, fend);
  free(fstart);
  free(fend);
  if (ok) step_ends(m, R);
  return ok;
}

// Pass 2: first-fit packing by position.
static bool pack(PassCtx *ctx, Ranges *R, PassMemPlan *plan) {
  PassMemSlot **active = calloc((size_t)R->used + 1, sizeof *active);
  if (!active) return ir_oom(ctx->d);
  qsort(R->items, (size_t)R->used, sizeof *R->items, by_first);
  int nactive = 0;
  for (int64_t i = 0; i < R->used; i++) {
    PassMemSlot *s = R->items[i].slot;
    if (s->kind != PASS_MEM_ARENA) continue;
    int keep = 0;
    for (int j = 0; j < nactive; j++)
      if (active[j]->last >= s->first) active[keep++] = active[j];
    nactive = keep;   // still sorted by offset: filtering keeps the order, s goes in at its place below
    int64_t size = (s->bytes + ALIGN - 1) / ALIGN * ALIGN, at = 0;
    for (int j = 0; j < nactive; j++) {
      if (active[j]->offset - at >= size) break;
      int64_t end = active[j]->offset + (active[j]->bytes + ALIGN - 1) / ALIGN * ALIGN;
      if (end > at) at = end;
    }
    s->offset = at;
    int lo = 0, hi = nactive;   // the first active slot above at (binary search)
    while (lo < hi) {
      int mid = (lo + hi) / 2;
      if (active[mid]->offset <= at) lo = mid + 1;
      else hi = mid;
    }
    memmove(&active[lo + 1], &active[lo], (size_t)(nactive - lo) * sizeof *active);
    active[lo] = s;
    nactive++;
    if (at + size > plan->arena_bytes) plan->arena_bytes = at + size;
    plan->unshared_bytes += size;
  }
  free(active);
  return true;
}

static void report(PassCtx *ctx, const PassMemPlan *plan, int nstreamed) {
  FILE *log = ctx->log ? ctx->log : stderr;
  int64_t peak = plan->arena_bytes + 2 * plan->param_bytes + plan->optimizer_bytes;
  fprintf(log, "# memplan: activations %lld bytes in the arena (%lld without reuse, %.1fx less)\n",
          (long long)plan->arena_bytes, (long long)plan->unshared_bytes,
          plan->arena_bytes ? (double)plan->unshared_bytes / (double)plan->arena_bytes : 1.0);
  fprintf(log, "# memplan: parameters %lld + gradients %lld + optimizer state %lld bytes\n",
          (long long)plan->param_bytes, (long long)plan->param_bytes, (long long)plan->optimizer_bytes);
  fprintf(log, "# memplan: peak %lld bytes per rank\n", (long long)peak);
  if (nstreamed)
    fprintf(log, "# memplan: %d functions run concurrent streams: no buffer reuse inside them "
                 "(live ranges extend to the function's end)\n", nstreamed);
}

bool pass_memplan(IrModule *m, PassCtx *ctx) {
  PassMemPlan *plan = calloc(1, sizeof *plan);
  if (!plan) return ir_oom(ctx->d);
  pass_ctx_free(ctx);
  ctx->memplan = plan;
  plan->slot = calloc((size_t)m->nfuncs + 1, sizeof *plan->slot);
  if (!plan->slot) return ir_oom(ctx->d);
  plan->nfuncs = m->nfuncs;
  bool ok = true;
  for (int fi = 0; ok && fi < m->nfuncs; fi++)
    ok = (plan->slot[fi] = calloc((size_t)m->funcs[fi]->nvalues + 1, sizeof(PassMemSlot))) != NULL;
  if (!ok) return ir_oom(ctx->d);
  Ranges R = {.input = {.kind = PASS_MEM_INPUT}, .target = {.kind = PASS_MEM_TARGET}};
  ok = live_ranges(m, ctx, &R) && pack(ctx, &R, plan);
  for (int fi = 0; ok && fi < m->nfuncs; fi++)
    for (int v = 0; v < m->funcs[fi]->nvalues; v++) {
      PassMemSlot *s = R.where[fi][v];
      plan->slot[fi][v] = s ? *s : (PassMemSlot){.kind = PASS_MEM_NONE};
    }
  ranges_free(&R);
  if (!ok) return false;

  for (int i = 0; i < m->nparams; i++) plan->param_bytes += ir_type_bytes(&m->params[i]->type);
  bool adamw = strcmp(ir_mod_str(m, "optimizer", "sgd"), "adamw") == 0;
  plan->optimizer_bytes = adamw ? 2 * plan->param_bytes : 0;
  ir_attrs_set_int(m->attrs, &m->nattrs, "arena_bytes", plan->arena_bytes);
  if (ctx->verbose) report(ctx, plan, R.nstreamed);
  return true;
}
