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
// parameter's gradient buffer. A result the fuse pass keeps inside its fused kernel (`inner=1`)
// gets no memory (PASS_MEM_NONE); a result whose maker has `bf16=1` (dtype bf16: a GEMM operand,
// a saved activation) gets a second slot, its bf16 copy (PassMemPlan.copy): the value's slot
// lives to its last fp32 read, the copy's to its last read of the copy (pass_reads_copy) and at
// least as long as the value's; with both attributes the value is stored in bf16 only (its one
// slot is the copy's). The final layer output stays alive to the end of the step (the binary's
// --dump reads it after the backward pass).
//
// Streams. A function whose ops the schedule put on the intra or inter stream runs them
// concurrently (codegen/emit_c.c, runtime/streams.c), so program order says nothing about when
// a buffer's last reader is done. In such a function a buffer's range runs on until every op
// that could still overlap one of its users: its bytes are reused only by an op that every
// user happens before, by stream order and events (streamed_ranges). The function's boundary
// is a full synchronisation; reuse across functions is unchanged. -v reports how many
// functions that applies to.
#include <stdint.h>
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

// The live ranges of every value of the step (pass 1), which pack (pass 2) places in the arena.
// Arguments share their source's slot, so resolution goes through pointers: where[fi][v] is the
// slot of value v of function fi (one of storage[], or input or target).
typedef struct Ranges {
  PassMemSlot input, target;
  PassMemSlot *storage;   // the results' slots, [used]
  Item *items;            // the same in definition order, for packing
  int64_t used;
  PassMemSlot ***where;   // [nfuncs][nvalues]
  PassMemSlot ***copy;    // [nfuncs][nvalues]: the bf16 copy of a value whose maker has bf16=1, else NULL
  int nfuncs;
  int nstreamed;          // functions with concurrent streams (no reuse inside them)
} Ranges;

static void ranges_free(Ranges *R) {
  for (int fi = 0; R->where && fi < R->nfuncs; fi++) free(R->where[fi]);
  for (int fi = 0; R->copy && fi < R->nfuncs; fi++) free(R->copy[fi]);
  free(R->where);
  free(R->copy);
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

// Functions with concurrent streams (passes/schedule.c). Program order says nothing about when
// a buffer's last reader is done: a later op on another stream may run before it. What is known
// is "happens before": on one stream ops run in program order, and an op that waits for an
// event runs after the op that records it (and after everything that op follows); nothing
// else (conservative: the extra waits codegen adds between collectives of one group are not
// counted). A buffer whose users (its writer and its readers) in such a function all happen
// before op p is free at p: its live range is extended, from its last user, over every op
// that does not know that (on each stream up to the first op that does; hb is monotone along a
// stream). A value read after the function keeps its range to the function's end as before.
// Returns false when out of memory.
typedef struct Use {
  PassMemSlot *slot;
  int op;
} Use;

static int by_slot(const void *a, const void *b) {
  const Use *x = a, *y = b;
  if (x->slot != y->slot) return (uintptr_t)x->slot < (uintptr_t)y->slot ? -1 : 1;
  return x->op - y->op;
}

#define HB_HAS(row, j) (((row)[(j) / 64] >> ((j) % 64)) & 1u)

static bool streamed_ranges(IrModule *m, Ranges *R, int fi, int64_t fstart, int64_t fend) {
  IrFunc *f = m->funcs[fi];
  int n = f->nops;
  size_t words = ((size_t)n + 63) / 64;
  int maxev = -1, nuses = 0;
  for (int i = 0; i < n; i++) {
    if (f->ops[i]->event > maxev) maxev = f->ops[i]->event;
    nuses += 2 * (f->ops[i]->nargs + (f->ops[i]->result != NULL));   // a value and its bf16 copy
  }
  uint64_t *hb = calloc((size_t)n * words + 1, sizeof *hb);
  int *maker = malloc(sizeof *maker * (size_t)(maxev + 2));
  Use *use = malloc(sizeof *use * (size_t)(nuses + 1));
  if (!hb || !maker || !use) {
    free(hb), free(maker), free(use);
    return false;
  }
  for (int e = 0; e <= maxev; e++) maker[e] = -1;
  int last_on[IR_STREAM_INTER + 1], nstreams = 0;
  for (int s = 0; s <= IR_STREAM_INTER; s++) last_on[s] = -1;
  bool present[IR_STREAM_INTER + 1] = {false};
  for (int i = 0; i < n; i++) present[f->ops[i]->stream] = true;
  for (int s = 0; s <= IR_STREAM_INTER; s++) nstreams += present[s];
  int k = 0;
  for (int i = 0; i < n; i++) {
    const IrOp *op = f->ops[i];
    uint64_t *row = hb + (size_t)i * words;
    int before[1 + IR_MAX_WAITS], nb = 0;
    if (last_on[op->stream] >= 0) before[nb++] = last_on[op->stream];
    for (int w = 0; w < op->nwaits; w++)
      if (op->waits[w] >= 0 && op->waits[w] <= maxev && maker[op->waits[w]] >= 0) before[nb++] = maker[op->waits[w]];
    for (int b = 0; b < nb; b++) {
      const uint64_t *prev = hb + (size_t)before[b] * words;
      for (size_t x = 0; x < words; x++) row[x] |= prev[x];
      row[before[b] / 64] |= (uint64_t)1 << (before[b] % 64);
    }
    last_on[op->stream] = i;
    if (op->event >= 0 && op->event <= maxev) maker[op->event] = i;
    for (int a = 0; a < op->nargs; a++) {   // (a value and its bf16 copy: both used, whichever op reads)
      const IrValue *v = op->args[a].value;
      if (v) use[k++] = (Use){R->where[v->func->index][v->id], i};
      if (v && R->copy[v->func->index][v->id]) use[k++] = (Use){R->copy[v->func->index][v->id], i};
    }
    if (op->result) use[k++] = (Use){R->where[fi][op->result->id], i};
    if (op->result && R->copy[fi][op->result->id]) use[k++] = (Use){R->copy[fi][op->result->id], i};
  }
  qsort(use, (size_t)k, sizeof *use, by_slot);
  for (int g = 0; g < k;) {
    int h = g;
    while (h < k && use[h].slot == use[g].slot) h++;
    PassMemSlot *s = use[g].slot;
    int last = use[h - 1].op;   // the group is sorted by op
    if (s && s->last < fend) {
      int64_t until = fstart + last;
      bool covered[IR_STREAM_INTER + 1] = {false};
      int open = nstreams;
      for (int p = last + 1; p < n && open > 0; p++) {
        int st = f->ops[p]->stream;
        if (covered[st]) continue;
        const uint64_t *row = hb + (size_t)p * words;
        bool all = true;
        for (int u = g; u < h && all; u++) all = HB_HAS(row, use[u].op);
        if (all) covered[st] = true, open--;
        else until = fstart + p;
      }
      if (s->last < until) s->last = until;
    }
    g = h;
  }
  free(hb), free(maker), free(use);
  return true;
}

static bool extend_streamed(IrModule *m, PassCtx *ctx, Ranges *R, const int64_t *fstart, const int64_t *fend) {
  for (int fi = 0; fi < m->nfuncs; fi++) {
    if (!ir_func_concurrent(m->funcs[fi])) continue;
    R->nstreamed++;
    if (!streamed_ranges(m, R, fi, fstart[fi], fend[fi])) return ir_oom(ctx->d);
  }
  return true;
}

// Values read at the end of the step stay alive to it; values whose only use is param.grad go to
// the gradient buffer.
static void step_ends(IrModule *m, Ranges *R) {
  // The output of the last layer forward is read at the end of the step.
  for (int fi = 0; fi < m->nfuncs; fi++)
    if (m->funcs[fi]->role == IR_ROLE_LOSS_FWD && fi > 0 && m->funcs[fi - 1]->nrets)
      R->where[fi - 1][m->funcs[fi - 1]->rets[0]->id]->last = INT64_MAX;
  // A later pipeline stage sends the gradient of its input (the last backward's result) after the
  // backward.
  if (ir_mod_int(m, "stage", 0) > 0)
    for (int fi = m->nfuncs - 1; fi >= 0; fi--)
      if (m->funcs[fi]->role == IR_ROLE_LAYER_BWD) {
        if (m->funcs[fi]->nrets) R->where[fi][m->funcs[fi]->rets[0]->id]->last = INT64_MAX;
        break;
      }
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

// The members of a fused group (passes/fuse.c, the IR's IrGroup) run as one kernel, whose threads
// read every input and write every result over the whole group: op oi's span [*first, *last]
// (global positions, *first and *last its own position on entry) becomes its group's, so that no
// result shares bytes with an input of the same kernel. A group that runs in the pieces of the
// GEMM before it (in_gemm) spans the GEMM too, and so does the GEMM: other pieces still read its
// operands and product while a piece's rows go through the group.
static void fused_span(const IrFunc *f, int oi, int64_t *first, int64_t *last) {
  const IrGroup *g = ir_group_at(f, oi);
  if (!g && oi + 1 < f->nops && (g = ir_group_at(f, oi + 1)) && !(g->first == oi + 1 && g->in_gemm)) g = NULL;
  if (!g) return;
  int lo = g->first - (g->in_gemm ? 1 : 0), hi = g->first + g->n - 1;
  *first -= oi - lo;
  *last += hi - oi;
}

// Pass 1: resolve arguments, give results a slot with their definition position, extend each
// to its last use.
static bool live_ranges(IrModule *m, PassCtx *ctx, Ranges *R) {
  int64_t nvalues = 0;
  for (int i = 0; i < m->nfuncs; i++) nvalues += m->funcs[i]->nvalues;
  R->nfuncs = m->nfuncs;
  R->storage = calloc(2 * (size_t)nvalues + 1, sizeof *R->storage);   // a bf16 copy at most per value
  R->items = calloc(2 * (size_t)nvalues + 1, sizeof *R->items);
  R->where = calloc((size_t)m->nfuncs + 1, sizeof *R->where);
  R->copy = calloc((size_t)m->nfuncs + 1, sizeof *R->copy);
  int64_t *fstart = calloc((size_t)m->nfuncs + 1, sizeof *fstart), *fend = calloc((size_t)m->nfuncs + 1, sizeof *fend);
  bool ok = R->storage && R->items && R->where && R->copy && fstart && fend;
  for (int fi = 0; ok && fi < m->nfuncs; fi++)
    ok = (R->where[fi] = calloc((size_t)m->funcs[fi]->nvalues + 1, sizeof(PassMemSlot *))) != NULL &&
         (R->copy[fi] = calloc((size_t)m->funcs[fi]->nvalues + 1, sizeof(PassMemSlot *))) != NULL;
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
      int64_t first = pos, last = pos;   // a fused group's members: the whole group's span
      fused_span(f, oi, &first, &last);
      for (int a = 0; a < op->nargs; a++) {
        IrValue *v = op->args[a].value;
        if (!v) continue;
        PassMemSlot *s = R->where[v->func->index][v->id], *c = R->copy[v->func->index][v->id];
        if (c && pass_reads_copy(op, a)) s = c;   // read from its bf16 copy: the fp32 value may die before
        if (s && s->last < last) s->last = last;
      }
      bool inner = ir_op_int(op, "inner", 0), copy = ir_op_int(op, "bf16", 0);
      if (!op->result || (inner && !copy)) continue;   // inner: in a fused kernel's registers only
      if (!inner) {
        PassMemSlot *s = &R->storage[R->used];
        *s = (PassMemSlot){.kind = PASS_MEM_ARENA, .first = first, .last = pos, .bytes = ir_type_bytes(&op->result->type)};
        R->items[R->used] = (Item){s, R->used};
        R->used++;
        R->where[fi][op->result->id] = s;
      }
      if (copy) {   // its bf16 copy: at least as long as the value (set after pass 1)
        PassMemSlot *c = &R->storage[R->used];
        *c = (PassMemSlot){.kind = PASS_MEM_ARENA, .first = first, .last = pos, .bytes = ir_type_numel(&op->result->type) * 2};
        R->items[R->used] = (Item){c, R->used};
        R->used++;
        R->copy[fi][op->result->id] = c;
        if (inner) R->where[fi][op->result->id] = c;   // stored in bf16 only: its readers keep the copy alive
      }
    }
    for (int r = 0; r < f->nrets; r++) {
      PassMemSlot *s = R->where[fi][f->rets[r]->id];
      if (s->last < pos) s->last = pos;  // read after the function by the generated code
    }
    fend[fi] = pos;
  }
  if (ok) ok = extend_streamed(m, ctx, R, fstart, fend);
  free(fstart);
  free(fend);
  if (ok) step_ends(m, R);
  for (int fi = 0; ok && fi < m->nfuncs; fi++)   // a bf16 copy lives at least as long as its value
    for (int v = 0; v < m->funcs[fi]->nvalues; v++) {
      PassMemSlot *s = R->where[fi][v], *c = R->copy[fi][v];
      if (c && s && c->last < s->last) c->last = s->last;
    }
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

static void report(const IrModule *m, PassCtx *ctx, const PassMemPlan *plan, int nstreamed) {
  FILE *log = ctx->log ? ctx->log : stderr;
  int64_t peak = pass_mem_peak(plan);
  char a[32], u[32], p[32], g[32], o[32], k[32];
  fprintf(log, "# memplan: activations %s in the arena (%s without reuse, %.1fx less)\n",
          ir_bytes(a, sizeof a, (double)plan->arena_bytes), ir_bytes(u, sizeof u, (double)plan->unshared_bytes),
          plan->arena_bytes ? (double)plan->unshared_bytes / (double)plan->arena_bytes : 1.0);
  fprintf(log, "# memplan: parameters %s + gradients %s + optimizer state %s",
          ir_bytes(p, sizeof p, (double)plan->param_bytes), ir_bytes(g, sizeof g, (double)plan->grad_bytes),
          ir_bytes(o, sizeof o, (double)plan->optimizer_bytes));
  if (plan->param16_bytes) fprintf(log, " + the parameters' bf16 copy %s", ir_bytes(k, sizeof k, (double)plan->param16_bytes));
  if (plan->accum_bytes)
    fprintf(log, " + %s of %s", ir_bytes(k, sizeof k, (double)plan->accum_bytes),
            ir_mod_int(m, "microbatches", 1) > 1 ? "the microbatches' gradients" : "a tied parameter's other part");
  fputc('\n', log);
  fprintf(log, "# memplan: peak %s per rank (%lld bytes)\n", ir_bytes(k, sizeof k, (double)peak), (long long)peak);
  if (nstreamed)
    fprintf(log, "# memplan: %d functions run concurrent streams: a buffer is reused there only after "
                 "every user of it happens before (stream order, events)\n", nstreamed);
}

// Where the arena reaches its top (-v): the first slot to end at arena_bytes, the function and op
// it is made at, and the largest values live there (what a memory choice would have to free).
static void report_top(const IrModule *m, PassCtx *ctx, const Ranges *R, const PassMemPlan *plan) {
  const PassMemSlot *top = NULL;
  for (int64_t i = 0; i < R->used && !top; i++) {
    const PassMemSlot *s = R->items[i].slot;   // sorted by first position: the earliest top
    if (s->kind == PASS_MEM_ARENA && s->offset + (s->bytes + ALIGN - 1) / ALIGN * ALIGN == plan->arena_bytes) top = s;
  }
  if (!top) return;
  enum { SHOWN = 4 };
  const IrValue *big[SHOWN] = {0};
  int64_t bytes[SHOWN] = {0}, pos = 0, live = 0;
  const IrOp *at = NULL;
  for (int fi = 0; fi < m->nfuncs; fi++)
    for (int oi = 0; oi < m->funcs[fi]->nops; oi++, pos++) {
      const IrOp *op = m->funcs[fi]->ops[oi];
      if (pos == top->first) at = op;
      const PassMemSlot *s = op->result ? R->where[fi][op->result->id] : NULL;
      if (!s || s->kind != PASS_MEM_ARENA || s->first > top->first || s->last < top->first) continue;
      live += (s->bytes + ALIGN - 1) / ALIGN * ALIGN;
      int k = SHOWN;   // insertion into the largest SHOWN
      while (k > 0 && bytes[k - 1] < s->bytes) k--;
      if (k == SHOWN) continue;
      memmove(&big[k + 1], &big[k], sizeof *big * (SHOWN - 1 - k));
      memmove(&bytes[k + 1], &bytes[k], sizeof *bytes * (SHOWN - 1 - k));
      big[k] = op->result, bytes[k] = s->bytes;
    }
  if (!at) return;
  FILE *log = ctx->log ? ctx->log : stderr;
  char l[32];
  fprintf(log, "# memplan: the arena's top is reached at @%s %%%s, %s live there; the largest:", at->func->name,
          at->result ? at->result->name : ir_op_info[at->kind].name, ir_bytes(l, sizeof l, (double)live));
  for (int k = 0; k < SHOWN && big[k]; k++) {
    char b[32];
    fprintf(log, "%s @%s %%%s %s", k ? "," : "", big[k]->func->name, big[k]->name, ir_bytes(b, sizeof b, (double)bytes[k]));
  }
  fputc('\n', log);
}

int64_t pass_mem_peak(const PassMemPlan *p) {
  return p->arena_bytes + p->param_bytes + p->grad_bytes + p->optimizer_bytes + p->param16_bytes + p->accum_bytes;
}

bool pass_memplan(IrModule *m, PassCtx *ctx) {
  PassMemPlan *plan = calloc(1, sizeof *plan);
  if (!plan) return ir_oom(ctx->d);
  pass_ctx_free(ctx);
  ctx->memplan = plan;
  plan->slot = calloc((size_t)m->nfuncs + 1, sizeof *plan->slot);
  plan->copy = calloc((size_t)m->nfuncs + 1, sizeof *plan->copy);
  if (!plan->slot || !plan->copy) return ir_oom(ctx->d);
  plan->nfuncs = m->nfuncs;
  bool ok = true;
  for (int fi = 0; ok && fi < m->nfuncs; fi++)
    ok = (plan->slot[fi] = calloc((size_t)m->funcs[fi]->nvalues + 1, sizeof(PassMemSlot))) != NULL &&
         (plan->copy[fi] = calloc((size_t)m->funcs[fi]->nvalues + 1, sizeof(PassMemSlot))) != NULL;
  if (!ok) return ir_oom(ctx->d);
  Ranges R = {.input = {.kind = PASS_MEM_INPUT}, .target = {.kind = PASS_MEM_TARGET}};
  ok = live_ranges(m, ctx, &R) && pack(ctx, &R, plan);
  for (int fi = 0; ok && fi < m->nfuncs; fi++)
    for (int v = 0; v < m->funcs[fi]->nvalues; v++) {
      PassMemSlot *s = R.where[fi][v], *c = R.copy[fi][v];
      plan->slot[fi][v] = s && s != c ? *s : (PassMemSlot){.kind = PASS_MEM_NONE};
      plan->copy[fi][v] = c ? *c : (PassMemSlot){.kind = PASS_MEM_NONE};
    }
  if (ok && ctx->verbose) report_top(m, ctx, &R, plan);
  ranges_free(&R);
  if (!ok) return false;

  for (int i = 0; i < m->nparams; i++) {
    plan->param_bytes += ir_type_bytes(&m->params[i]->type);
    if (!ir_param_frozen(m->params[i]))
      plan->grad_bytes += ir_type_bytes(&m->params[i]->type);
  }
  if (ir_mod_int(m, "microbatches", 1) > 1)
    plan->accum_bytes = plan->grad_bytes;
  else
    for (int i = 0; i < m->nparams; i++)
      if (ir_attr_int(m->params[i]->attrs, m->params[i]->nattrs, "pp_tied", 0))
        plan->accum_bytes += ir_type_bytes(&m->params[i]->type);
  if (strcmp(ir_mod_str(m, "dtype", "fp32"), "bf16") == 0)   // the GEMMs read the weights from a bf16 copy
    for (int i = 0; i < m->nparams; i++) plan->param16_bytes += 2 * ir_type_numel(&m->params[i]->type);
  // AdamW's two moments of every parameter; under a sharded optimizer (opt.adamw with a group) the
  // largest member's rows of it: ceil(R / size) of its R rows.
  for (int i = 0; i < m->nfuncs; i++)
    for (int j = 0; m->funcs[i]->role == IR_ROLE_OPTIMIZER && j < m->funcs[i]->nops; j++) {
      const IrOp *op = m->funcs[i]->ops[j];
      if (op->kind != IR_OP_OPT_ADAMW) continue;
      const IrType *t = &op->args[0].param->type;
      int64_t bytes = ir_type_bytes(t), size = ir_op_int(op, "size", 1);
      if (ir_op_str(op, "group", NULL) && size > 1 && t->rank > 0 && t->dim[0] > 0)
        bytes = (t->dim[0] + size - 1) / size * (bytes / t->dim[0]);
      plan->optimizer_bytes += 2 * bytes;
    }
  ir_attrs_set_int(m->attrs, &m->nattrs, "arena_bytes", plan->arena_bytes);
  if (ctx->verbose) report(m, ctx, plan, R.nstreamed);
  return true;
}

// What the memory plan left in the context (the plan of every function), freed.
void pass_ctx_free(PassCtx *ctx) {
  PassMemPlan *plan = ctx->memplan;
  if (!plan) return;
  for (int i = 0; i < plan->nfuncs; i++) {
    free(plan->slot[i]);
    if (plan->copy) free(plan->copy[i]);
  }
  free(plan->slot);
  free(plan->copy);
  free(plan);
  ctx->memplan = NULL;
}
