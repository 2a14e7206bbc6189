// The `schedule` pass (lang/manual.md §8 and §14): chunks, streams and events.
//
// Chunks. In every layer's forward function and its backward, the expert region — the ops
// between the region's entry value (the [E, C, M] tokens the order packed, or their gradient)
// and its exit value (the [E, C, M] expert outputs, or the gradient of the packed tokens):
// dispatch AlltoAll, layouts, ESP AllGather, the expert ops, ESP ReduceScatter, the output
// bias, combine AlltoAll — is split into r chunks along the capacity (slot) dimension, dim 1:
// chunk j takes slots [j*C/r, (j+1)*C/r) of the entry (`layout.chunk`) and runs the region's
// ops on them. Every op of the region works slot by slot, except the weight gradients of the
// backward (expert.bias.grad, expert.matmul with ta=1), which sum over slots: their chunk
// results are partial sums, added up with `add` after the chunks, and the ops that read them
// (the ESP AllReduce of b2's gradient, param.grad) run once, on the sums. After the EP/ESP
// layout ops an expert's slots are `blocks` runs of C slots, one per peer; chunk j holds slots
// [j*C/r, (j+1)*C/r) of each run, so slices of the forward's saved activations that the chunked
// backward reads (`layout.chunk` with blocks) and the assembled values (`layout.concat`) carry
// the block count. Chunk values that the rest of the step reads (the exit value, the saved
// activations) are assembled back into the original value, which keeps its name. A backward
// chunked at its forward's degree reads the forward's chunks of a saved activation in place
// instead of slicing the assembled value (the same slots of every block: the same bytes), and
// the assembly nothing reads any more is dropped (drop_dead_assembly): no copy either way.
// r is the module's r_fwd / r_bwd (from `schedule { pipeline { forward N; backward M; } }`);
// any r from 1 to C: the bounds use integer floor division, so when r does not divide C the
// chunks differ by at most one slot (C 5, r 3: 1, 2, 2 slots) and `layout.concat` assembles
// runs of different sizes. An r above C is cut to C, one slot per chunk (said with -v). Policy
// `sequential` runs r = 1.
//
// Streams. Per policy: fsmoe puts AlltoAlls and gradient AllReduces on `inter`, AllGather and
// ReduceScatter on `intra`; fsmoe-no-iio, tutel, tutel-improved and pipemoe-lina put every
// collective on `inter` (their one communication stream); sequential runs everything on
// `compute`. comm.split is a local copy (compute). Every op gets its phase (fwd, bwd, opt) and
// chunk (0 outside a chunked region; the add/concat assembling chunk j's result carry j).
//
// Events. Within a function, an op that reads a value made on another stream waits on its
// producer's event (events are numbered over the module). Function boundaries are full
// synchronisations.
//
// Issue order: every chunk's dispatch part (its slice, dispatch AlltoAll, layouts, ESP
// AllGather) comes before every chunk's experts and combine (issue_order below), so that each
// communication stream runs D1..Dr (G1..Gr) and then the combines, as the planner's model and
// simulator assume.
//
// Execution: codegen turns a function with ops on the intra or inter stream into a task table
// that runtime/streams.c runs with one thread per stream, honouring the events (memplan gives
// such functions no buffer reuse inside them); without threads the tasks run in program order,
// which is a valid order too: chunks are equal to r = 1 up to round-off (tests/mpi/chunks.sh).
#include <stdlib.h>
#include <string.h>

#include "pass.h"

// A forward value whose chunks the forward kept (its assembly may become dead): a backward
// chunked at the same degree reads chunk j itself instead of slicing the assembled value.
typedef struct Shared {
  IrValue *v;
  int64_t r, blocks;
  IrValue **chunk;   // [r], in the module's arena
} Shared;

typedef struct Sched {
  IrModule *m;
  PassCtx *ctx;
  FILE *log;
  Shared *shared;
  int nshared, capshared;
  int nreused;   // slices of saved values replaced by the forward's chunks
} Sched;



// By value id of f: the value is read outside the region [lo, hi] of f, by a later or earlier op
// of f, f's results or another function's op (a backward reading a saved activation). One pass
// over the module for the whole region (NULL when out of memory).
static bool *used_outside(const IrModule *m, const IrFunc *f, int lo, int hi) {
  bool *mark = calloc((size_t)f->nvalues + 1, sizeof *mark);
  if (!mark) return NULL;
  for (int r = 0; r < f->nrets; r++)
    if (f->rets[r]->func == f) mark[f->rets[r]->id] = true;
  for (int i = 0; i < m->nfuncs; i++) {
    const IrFunc *g = m->funcs[i];
    for (int j = 0; j < g->nops; j++) {
      if (g == f && j >= lo && j <= hi) continue;
      for (int a = 0; a < g->ops[j]->nargs; a++) {
        const IrValue *v = g->ops[j]->args[a].value;
        if (v && v->func == f) mark[v->id] = true;
      }
    }
  }
  return mark;
}

static const char *unique_name(IrModule *m, IrFunc *f, const char *base) {
  const char *name = base;
  for (int n = 1; ir_find_value(f, name); n++) name = ir_strfmt(m, "%s.%d", base, n);
  return name;
}

// Appends a new op (its result named `name`) to the list `out`; its type is inferred after the
// operands are set, by the caller.
typedef struct OpList {
  IrOp **ops;
  int n, cap;
  bool oom;   // a push failed for want of memory (checked once, when the list is used)
} OpList;

static void push(OpList *l, IrOp *op) {
  if (l->n == l->cap) {
    int cap = l->cap ? 2 * l->cap : 64;
    IrOp **ops = realloc(l->ops, sizeof *l->ops * (size_t)cap);
    if (!ops) {
      l->oom = true;
      return;
    }
    l->ops = ops;
    l->cap = cap;
  }
  l->ops[l->n++] = op;
}

// A new op of f, not yet in f's op list (ir_add_op appends it; the caller rebuilds the list).
static IrOp *new_op(Sched *S, IrFunc *f, IrOpKind kind, const char *name) {
  IrOp *op = ir_add_op(f, S->m, kind, name ? unique_name(S->m, f, name) : NULL, (IrType){0});
  f->nops--;  // taken out again: the caller places it
  return op;
}

static bool finish(Sched *S, IrOp *op) {
  if (op->result && !ir_infer_type(S->ctx->d, op, &op->result->type)) return false;
  return true;
}

// Per value of f: its chunk versions, or its partial sums, and its block count.
typedef struct VInfo {
  int kind;              // 0 other, 1 chunked, 2 partial sums (chunk holds them), 3 made from
                         // partial sums (computed once, after the chunks: not chunked)
  int64_t blocks;
  IrValue **chunk;       // [r], kinds 1 and 2
} VInfo;

// Rebuilds f->values (arguments, then op results in op order) and the indices.
static void renumber(IrFunc *f) {
  int n = 0;
  for (int i = 0; i < f->nargs; i++) f->values[n++] = f->args[i];
  for (int i = 0; i < f->nops; i++) {
    f->ops[i]->index = i;
    f->ops[i]->func = f;
    if (f->ops[i]->result) f->values[n++] = f->ops[i]->result;
  }
  f->nvalues = n;
  for (int i = 0; i < n; i++) f->values[i]->id = i;
}

// The chunk count for capacity c when r are asked for: every chunk holds at least one slot.
static int64_t chunk_count(int64_t c, int64_t r) {
  return r < c ? r : c;
}

// A layout op or a collective: what a chunk runs before its experts.
static bool dispatch_side(const IrOp *op) {
  return ir_op_is_collective(op->kind) || op->kind == IR_OP_LAYOUT_CHUNK ||
         op->kind == IR_OP_LAYOUT_EXPERT_MAJOR || op->kind == IR_OP_LAYOUT_RANK_MAJOR;
}

// The issue order of the chunks, which each stream keeps (runtime/streams.c runs a stream's
// tasks in program order, as a CUDA stream does): chunk j's ops out[starts[j] .. starts[j+1])
// are its dispatch part (its ops up to the last collective before its first expert op: the
// slice, the dispatch AlltoAll, the layouts, the ESP AllGather) and the rest. Every chunk's
// dispatch part goes first, then every chunk's rest: the communication streams then run D1..Dr
// (G1..Gr) before the combines, as the planner's model and simulator assume (sched/sched_sim.c).
// In the order of the chunks one after the other, the combine of chunk 1 would sit on the inter
// stream in front of the dispatch of chunk 2 and hold it until chunk 1's experts are done: no
// overlap at all. A chunk reads only its own values and values made before the region, so the
// new order is still a valid program order. False when out of memory.
static bool issue_order(OpList *out, const int *starts, int r) {
  int n = starts[r] - starts[0];
  IrOp **ops = malloc(sizeof *ops * (size_t)(n > 0 ? n : 1));
  int *split = malloc(sizeof *split * (size_t)r);
  if (!ops || !split) {
    free(ops);
    free(split);
    return false;
  }
  for (int j = 0; j < r; j++) {
    split[j] = starts[j];
    for (int i = starts[j]; i < starts[j + 1] && dispatch_side(out->ops[i]); i++)
      if (ir_op_is_collective(out->ops[i]->kind)) split[j] = i + 1;
  }
  int k = 0;
  for (int j = 0; j < r; j++)
    for (int i = starts[j]; i < split[j]; i++) ops[k++] = out->ops[i];
  for (int j = 0; j < r; j++)
    for (int i = split[j]; i < starts[j + 1]; i++) ops[k++] = out->ops[i];
  memcpy(out->ops + starts[0], ops, sizeof *ops * (size_t)n);
  free(ops);
  free(split);
  return true;
}

// Assembles the r chunk values of v (exact copies) as a balanced tree of pairwise concats, so
// that every element is copied ceil(log2 r) times; a chain (((c0 c1) c2) c3) copies the first
// chunks r - 1 times, O(r^2) in all, which made large degrees slow for no reason. The last
// concat defines v.
static bool assemble(Sched *S, IrFunc *f, const IrOp *op, IrValue *v, IrValue **chunk, int64_t r, int64_t blocks,
                     OpList *out) {
  IrValue **level = malloc(sizeof *level * (size_t)r);
  int *last = malloc(sizeof *last * (size_t)r);   // the last chunk index each value holds
  if (!level || !last) {
    free(level);
    free(last);
    return ir_oom(S->ctx->d);
  }
  for (int64_t j = 0; j < r; j++) level[j] = chunk[j], last[j] = (int)j;
  int64_t n = r;
  bool ok = true;
  for (int step = 0; ok && n > 1; step++) {
    int64_t k = 0;
    for (int64_t j = 0; ok && j < n; j += 2) {
      if (j + 1 == n) {   // an odd one out goes up a level as it is
        level[k] = level[j], last[k++] = last[j];
        continue;
      }
      IrOp *c = new_op(S, f, IR_OP_LAYOUT_CONCAT, ir_strfmt(S->m, "%s.cat%d.%lld", v->name, step, (long long)(j / 2)));
      ir_op_arg(c, level[j]);
      ir_op_arg(c, level[j + 1]);
      if (blocks > 1) ir_op_set_int(c, "blocks", blocks);
      c->loc = op->loc;
      c->chunk = last[j + 1];
      if (!(ok = finish(S, c))) break;
      if (n == 2) {  // the root: becomes the original value's definition
        c->result = v;
        v->def = c;
      }
      push(out, c);
      level[k] = c->result, last[k++] = last[j + 1];
    }
    n = k;
  }
  free(level);
  free(last);
  return ok;
}

// The expert region [lo, hi] of f that chunk_func cuts into r chunks, and what it knows of it.
typedef struct Region {
  IrFunc *f;
  IrValue *entry, *exit;
  int lo, hi;
  int64_t r;
  int n0;        // f's values before chunking: ir_add_op appends the new ones after [0, n0)
  VInfo *vi;     // [n0]
  int *cls;      // [f->nops]: 0 independent, 1 chunked, 2 partial-making, 3 post (reads sums)
} Region;

// The blocks of the forward's chunks of v kept at degree r (share_chunks), or 0 when none are.
static int64_t shared_blocks(const Sched *S, const IrValue *v, int64_t r) {
  for (int i = 0; i < S->nshared; i++)
    if (S->shared[i].v == v && S->shared[i].r == r) return S->shared[i].blocks;
  return 0;
}

// A recomputed op of the backward's region (recompute=1: `recompute layers` makes the expert
// GEMMs again) that reads only the forward's chunks kept at this degree (the dispatched tokens)
// and parameters: it is chunked too, each chunk reading the forward's chunk in place, so that it
// runs on the slots the forward's op ran on, call for call. Whole, its GEMM would multiply every
// slot at once, which rounds as the forward's chunks do only where OpenBLAS's kernels happen to
// (not on the Haswell kernels): recomputing would change the bits. *blocks: the chunks' blocks.
static bool remade_in_chunks(const Sched *S, const Region *R, const IrOp *op, int64_t *blocks) {
  if (!op->result || !ir_op_int(op, "recompute", 0) || pass_sums_slots(op) || R->f->role != IR_ROLE_LAYER_BWD)
    return false;
  *blocks = 0;
  for (int a = 0; a < op->nargs; a++) {
    const IrValue *v = op->args[a].value;
    if (!v) continue;
    int64_t b = v->func == R->f ? 0 : shared_blocks(S, v, R->r);
    if (b == 0 || (*blocks && b != *blocks)) return false;
    *blocks = b;
  }
  return *blocks > 0;
}

// Classifies the region's ops and values (R->cls, R->vi) and gives the chunked values and the
// partial sums their r chunk slots.
static bool classify(Sched *S, Region *R) {
  IrFunc *f = R->f;
  VInfo *vi = R->vi;
  int64_t b;
  vi[R->entry->id].kind = 1;
  vi[R->entry->id].blocks = 1;
  for (int i = R->lo; i <= R->hi; i++) {
    IrOp *op = f->ops[i];
    int chunked = -1, partial = 0;
    for (int a = 0; a < op->nargs; a++) {
      IrValue *v = op->args[a].value;
      if (!v || v->func != f) continue;
      if (vi[v->id].kind == 1 && chunked < 0) chunked = a;
      if (vi[v->id].kind == 2 || vi[v->id].kind == 3) partial = 1;  // a sum, or made from one
    }
    if (chunked >= 0 && partial)
      return ir_error_at(S->ctx->d, op->loc, "schedule: '@%s': an op reads both chunked values and partial sums", f->name);
    if (chunked >= 0) {
      R->cls[i] = pass_sums_slots(op) ? 2 : 1;
      if (op->result) {
        int64_t b = vi[op->args[chunked].value->id].blocks;
        if (op->kind == IR_OP_LAYOUT_EXPERT_MAJOR) b *= ir_op_int(op, "blocks", 1);
        if (op->kind == IR_OP_LAYOUT_RANK_MAJOR) b /= ir_op_int(op, "blocks", 1);
        vi[op->result->id].kind = R->cls[i] == 2 ? 2 : 1;
        vi[op->result->id].blocks = b;
      }
    } else if (partial) {
      R->cls[i] = 3;
      if (op->result) vi[op->result->id].kind = 3;  // a value made from sums: not chunked
    } else if (remade_in_chunks(S, R, op, &b)) {
      R->cls[i] = 1;
      vi[op->result->id].kind = 1;
      vi[op->result->id].blocks = b;
    }
  }
  for (int i = 0; i < R->n0; i++)
    if ((vi[i].kind == 1 || vi[i].kind == 2) && !(vi[i].chunk = calloc((size_t)R->r, sizeof *vi[i].chunk)))
      return ir_oom(S->ctx->d);
  return true;
}

// Chunk j's slice of v (`layout.chunk`), v made outside the region (a saved activation). When
// v is a forward value chunked at this degree with the same blocks, the forward's chunk j is
// that slice already (the same slots of every block, the same bytes): it is read in place, and
// the forward's assembly of v dies if nothing else reads it (drop_dead_assembly).
static IrValue *slice_of(Sched *S, Region *R, const IrOp *op, IrValue *v, int64_t j, int64_t blocks, OpList *out) {
  IrOp *s = new_op(S, R->f, IR_OP_LAYOUT_CHUNK, ir_strfmt(S->m, "%s.c%lld", v->name, (long long)j));
  ir_op_arg(s, v);
  ir_op_set_int(s, "chunks", R->r);
  ir_op_set_int(s, "index", j);
  if (blocks > 1) ir_op_set_int(s, "blocks", blocks);
  s->chunk = (int)j;
  if (!finish(S, s)) return NULL;
  for (int i = 0; v->func != R->f && i < S->nshared; i++) {
    const Shared *sh = &S->shared[i];
    if (sh->v == v && sh->r == R->r && sh->blocks == blocks && ir_type_equal(&sh->chunk[j]->type, &s->result->type)) {
      S->nreused++;
      return sh->chunk[j];   // s is not placed: renumber drops its result
    }
  }
  push(out, s);
  return s->result;
}

// The forward f keeps the chunks of v, which its backward may read in place (slice_of).
static bool share_chunks(Sched *S, IrValue *v, IrValue **chunk, int64_t r, int64_t blocks) {
  if (S->nshared == S->capshared) {
    int cap = S->capshared ? 2 * S->capshared : 16;
    Shared *n = realloc(S->shared, sizeof *n * (size_t)cap);
    if (!n) return ir_oom(S->ctx->d);
    S->shared = n;
    S->capshared = cap;
  }
  IrValue **keep = ir_alloc(S->m, sizeof *keep * (size_t)r);
  memcpy(keep, chunk, sizeof *keep * (size_t)r);
  S->shared[S->nshared++] = (Shared){v, r, blocks, keep};
  return true;
}

// v is read by a layer backward that saves f.
static bool read_by_backward(const IrModule *m, const IrFunc *f, const IrValue *v) {
  for (int i = 0; i < m->nfuncs; i++) {
    const IrFunc *g = m->funcs[i];
    if (g->saves != f || g == f) continue;
    for (int j = 0; j < g->nops; j++)
      for (int a = 0; a < g->ops[j]->nargs; a++)
        if (g->ops[j]->args[a].value == v) return true;
  }
  return false;
}

// Chunk j's clone of the region's op: chunked operands by their chunk j, values from outside
// the region by their slice (made once per chunk, in slices[], keyed by value).
static bool clone_op(Sched *S, Region *R, const IrOp *op, int64_t j, IrValue **slices, OpList *out) {
  IrFunc *f = R->f;
  int64_t blocks = 0;
  for (int a = 0; a < op->nargs; a++)
    if (op->args[a].value && op->args[a].value->func == f && R->vi[op->args[a].value->id].kind == 1) {
      blocks = R->vi[op->args[a].value->id].blocks;
      break;
    }
  if (blocks == 0)   // a recomputed op reading the forward's chunks only (remade_in_chunks): theirs
    blocks = op->result ? R->vi[op->result->id].blocks : 1;
  IrOp *c = new_op(S, f, op->kind, op->result ? ir_strfmt(S->m, "%s.c%lld", op->result->name, (long long)j) : NULL);
  memcpy(c->attrs, op->attrs, sizeof op->attrs);
  c->nattrs = op->nattrs;
  c->loc = op->loc;
  c->chunk = (int)j;
  for (int a = 0; a < op->nargs; a++) {
    IrOperand arg = op->args[a];
    IrValue *v = arg.value;
    if (v && v->func == f && R->vi[v->id].kind == 1) {
      arg.value = R->vi[v->id].chunk[j];
    } else if (v) {
      int key = v->func == f ? v->id : R->n0 + v->id;
      if (!slices[key] && !(slices[key] = slice_of(S, R, op, v, j, blocks, out))) return false;
      arg.value = slices[key];
    }
    c->args[c->nargs++] = arg;
  }
  if (!finish(S, c)) return false;
  push(out, c);
  if (op->result) R->vi[op->result->id].chunk[j] = c->result;
  return true;
}

// The chunks, one after the other (issue_order then puts every chunk's dispatch first): chunk j
// cuts its slice of the entry and runs its clones of the chunked and partial-making ops.
static bool emit_chunks(Sched *S, Region *R, OpList *out) {
  IrFunc *f = R->f;
  int64_t r = R->r;
  int *starts = calloc((size_t)r + 1, sizeof *starts);
  if (!starts) return ir_oom(S->ctx->d);
  bool ok = true;
  for (int64_t j = 0; ok && j < r; j++) {
    starts[j] = out->n;
    IrValue **slices = calloc((size_t)R->n0 + (size_t)(f->saves ? f->saves->nvalues : 0), sizeof *slices);
    if (!slices) {
      ok = ir_oom(S->ctx->d);
      break;
    }
    IrOp *cut = new_op(S, f, IR_OP_LAYOUT_CHUNK, ir_strfmt(S->m, "%s.c%lld", R->entry->name, (long long)j));
    ir_op_arg(cut, R->entry);
    ir_op_set_int(cut, "chunks", r);
    ir_op_set_int(cut, "index", j);
    cut->chunk = (int)j;
    ok = finish(S, cut);
    push(out, cut);
    R->vi[R->entry->id].chunk[j] = cut->result;
    for (int i = R->lo; ok && i <= R->hi; i++)
      if (R->cls[i] == 1 || R->cls[i] == 2) ok = clone_op(S, R, f->ops[i], j, slices, out);
    free(slices);
  }
  starts[r] = out->n;
  if (ok && !out->oom && !issue_order(out, starts, (int)r)) ok = ir_oom(S->ctx->d);
  free(starts);
  return ok;
}

// v's r partial sums added up in chunk order, the float order of r = 1's sum; the last add
// defines v.
static bool add_partials(Sched *S, IrFunc *f, const IrOp *op, IrValue *v, IrValue **partial, int64_t r, OpList *out) {
  IrValue *acc = partial[0];
  for (int64_t j = 1; j < r; j++) {
    IrOp *c = new_op(S, f, IR_OP_ADD, ir_strfmt(S->m, "%s.sum%lld", v->name, (long long)j));
    ir_op_arg(c, acc);
    ir_op_arg(c, partial[j]);
    c->loc = op->loc;
    c->chunk = (int)j;
    if (!finish(S, c)) return false;
    if (j == r - 1) {  // becomes the original value's definition
      c->result = v;
      v->def = c;
    }
    push(out, c);
    acc = c->result;
  }
  return true;
}

// After the chunks: partial sums added up, chunk values the rest of the step reads assembled;
// the last op of each chain defines the original value.
static bool join_chunks(Sched *S, Region *R, OpList *out) {
  bool *outside = used_outside(S->m, R->f, R->lo, R->hi);
  bool ok = outside != NULL;
  for (int i = R->lo; ok && i <= R->hi; i++) {
    IrOp *op = R->f->ops[i];
    if ((R->cls[i] != 1 && R->cls[i] != 2) || !op->result) continue;
    IrValue *v = op->result;
    VInfo *vi = &R->vi[v->id];
    if (R->cls[i] == 2) ok = add_partials(S, R->f, op, v, vi->chunk, R->r, out);
    else if (outside[v->id]) {
      if (R->f->role == IR_ROLE_LAYER_FWD && read_by_backward(S->m, R->f, v))
        ok = share_chunks(S, v, vi->chunk, R->r, vi->blocks);
      ok = ok && assemble(S, R->f, op, v, vi->chunk, R->r, vi->blocks, out);
    }
  }
  free(outside);
  return ok;
}

// Splits f's expert region into r chunks. True when done or when f has nothing to chunk.
static bool chunk_func(Sched *S, IrFunc *f, int64_t r_want) {
  IrModule *m = S->m;
  bool experts = false;
  for (int i = 0; i < f->nops; i++) experts |= pass_op_of_experts(f->ops[i]);
  if (!experts || r_want <= 1) return true;
  Region R = {.f = f, .n0 = f->nvalues};
  if (!pass_expert_region(f, &R.entry, &R.exit)) {
    if (S->ctx->verbose) fprintf(S->log, "# schedule: @%s: no [E, C, M] expert region, not chunked\n", f->name);
    return true;
  }
  int64_t C = R.entry->type.dim[1];
  R.r = chunk_count(C, r_want);
  if (R.r != r_want && S->ctx->verbose)
    fprintf(S->log, "# schedule: @%s: %lld chunks are more than capacity %lld; using %lld\n", f->name,
            (long long)r_want, (long long)C, (long long)R.r);
  if (R.r <= 1) return true;
  R.lo = R.entry->def ? R.entry->def->index + 1 : 0;
  R.hi = R.exit->def->index;

  R.vi = calloc((size_t)R.n0, sizeof *R.vi);
  R.cls = calloc((size_t)f->nops, sizeof *R.cls);
  OpList out = {0}, pre = {0}, post = {0};
  bool ok = R.vi && R.cls ? classify(S, &R) : ir_oom(S->ctx->d);
  if (!ok) goto done;
  for (int i = 0; i < R.lo; i++) push(&out, f->ops[i]);
  for (int i = R.lo; i <= R.hi; i++) {  // chunked and partial-making ops are replaced by their clones
    if (R.cls[i] == 0) push(&pre, f->ops[i]);
    if (R.cls[i] == 3) push(&post, f->ops[i]);
  }
  for (int i = 0; i < pre.n; i++) push(&out, pre.ops[i]);
  ok = emit_chunks(S, &R, &out) && join_chunks(S, &R, &out);
  for (int i = 0; i < post.n; i++) push(&out, post.ops[i]);
  for (int i = R.hi + 1; i < f->nops; i++) push(&out, f->ops[i]);
  if (ok && (out.oom || pre.oom || post.oom)) ok = ir_oom(S->ctx->d);
  if (ok) {
    // The op list and the values: every value made above is already in f->values (ir_add_op);
    // renumber drops the temporaries whose op now defines an original value.
    if (out.n > f->cap_ops) {
      f->ops = ir_alloc(m, sizeof *f->ops * (size_t)out.n);
      f->cap_ops = out.n;
    }
    memcpy(f->ops, out.ops, sizeof *f->ops * (size_t)out.n);
    f->nops = out.n;
    renumber(f);
    if (S->ctx->verbose)
      fprintf(S->log, "# schedule: @%s: expert region %%%s -> %%%s in %lld chunks of %lld%s slots\n", f->name,
              R.entry->name, R.exit->name, (long long)R.r, (long long)(C / R.r),
              C % R.r ? ir_strfmt(m, " or %lld", (long long)(C / R.r + 1)) : "");
  }
done:
  for (int i = 0; R.vi && i < R.n0; i++) free(R.vi[i].chunk);
  free(R.vi);
  free(R.cls);
  free(out.ops);
  free(pre.ops);
  free(post.ops);
  return ok;
}

static IrStream stream_of(const IrOp *op, const char *policy) {
  if (strcmp(policy, "sequential") == 0) return IR_STREAM_COMPUTE;
  switch (ir_op_class(op->kind)) {
  case IR_CLASS_COMM_INTER: return IR_STREAM_INTER;
  case IR_CLASS_COMM_INTRA: return strcmp(policy, "fsmoe") == 0 ? IR_STREAM_INTRA : IR_STREAM_INTER;
  default: return IR_STREAM_COMPUTE;
  }
}

// The gradient AllReduces that gradpart put in a layer's backward MoE slot (slot="moe") ride on
// the inter-node link while the experts compute: after chunking they go right after the first
// AlltoAll of the last chunk (the last dispatch), as the model and the simulator place them
// (sched/sched_sim.c). Those of the dense slot (slot="dense") stay after the expert region.
// False when out of memory.
static bool place_grad_allreduces(IrFunc *f) {
  bool any = false;
  for (int i = 0; i < f->nops; i++) any |= f->ops[i]->kind == IR_OP_COMM_ALLTOALL;
  if (!any) return true;   // no AlltoAll (ep 1): they stay where gradpart put them
  IrOp **moved = malloc(sizeof *moved * (size_t)(f->nops > 0 ? f->nops : 1));
  if (!moved) return false;
  int nmoved = 0, k = 0;
  for (int i = 0; i < f->nops; i++) {
    IrOp *op = f->ops[i];
    if (op->kind == IR_OP_COMM_ALLREDUCE_GRAD && strcmp(ir_op_str(op, "slot", ""), "moe") == 0) moved[nmoved++] = op;
    else f->ops[k++] = op;
  }
  int at = -1, last_chunk = -1;   // the first AlltoAll of the last chunk, among the others
  for (int i = 0; i < k; i++)
    if (f->ops[i]->kind == IR_OP_COMM_ALLTOALL && f->ops[i]->chunk > last_chunk) {
      last_chunk = f->ops[i]->chunk;
      at = i;
    }
  // ... and the rest of that chunk's dispatch part (layouts, its ESP AllGather): "Dr Gr [AR]".
  while (at + 1 < k && f->ops[at + 1]->chunk == last_chunk && dispatch_side(f->ops[at + 1]) &&
         f->ops[at + 1]->kind != IR_OP_COMM_ALLTOALL)
    at++;
  memmove(&f->ops[at + 1 + nmoved], &f->ops[at + 1], sizeof *f->ops * (size_t)(k - at - 1));
  memcpy(&f->ops[at + 1], moved, sizeof *moved * (size_t)nmoved);
  for (int i = 0; i < f->nops; i++) f->ops[i]->index = i;
  free(moved);
  return true;
}

// op waits for p's event (p made on another stream); false when op already waits for
// IR_MAX_WAITS events.
static bool add_wait(IrOp *op, IrOp *p, int *next_event) {
  if (p->stream == op->stream) return true;
  if (p->event < 0) p->event = (*next_event)++;
  for (int w = 0; w < op->nwaits; w++)
    if (op->waits[w] == p->event) return true;
  if (op->nwaits == IR_MAX_WAITS) return false;
  op->waits[op->nwaits++] = p->event;
  return true;
}

static bool annotate(IrDiag *d, IrFunc *f, const char *policy, int *next_event) {
  IrPhase phase = f->role == IR_ROLE_OPTIMIZER ? IR_PHASE_OPT : f->role == IR_ROLE_LAYER_BWD || f->role == IR_ROLE_LOSS_BWD ? IR_PHASE_BWD : IR_PHASE_FWD;
  for (int i = 0; i < f->nops; i++) {
    IrOp *op = f->ops[i];
    op->stream = stream_of(op, policy);
    op->phase = phase;
    op->event = -1;
    op->nwaits = 0;
  }
  for (int i = 0; i < f->nops; i++) {
    IrOp *op = f->ops[i];
    for (int a = 0; a < op->nargs; a++) {
      IrValue *v = op->args[a].value;
      if (v && v->func == f && v->def && !add_wait(op, v->def, next_event)) goto full;
    }
    // An in-place gradient AllReduce reads and writes the buffer that the param.grad ops of its
    // parameter fill (a copy, or grad += value when the gradient is accumulated): it waits for
    // every one of them before it in this function, not only for the values they store (the
    // copy runs after its value is made, on its own stream).
    if (op->kind == IR_OP_COMM_ALLREDUCE_GRAD)
      for (int j = 0; j < i; j++)
        if (f->ops[j]->kind == IR_OP_PARAM_GRAD && f->ops[j]->args[0].param == op->args[0].param)
          if (!add_wait(op, f->ops[j], next_event)) goto full;
    continue;
  full:
    return ir_error(d, "schedule: @%s: op %d (%s) waits for more than %d events", f->name, i, ir_op_info[op->kind].name, IR_MAX_WAITS);
  }
  return true;
}

// The concats of a forward's assembly that nothing reads any more (every reader of the value
// was a backward that now reads the chunks in place), in every function: removed, leaves first
// up to the root. Returns how many.
static int drop_dead_assembly(IrModule *m) {
  int dropped = 0;
  for (bool changed = true; changed;) {
    changed = false;
    for (int i = 0; i < m->nfuncs; i++) {
      IrFunc *f = m->funcs[i];
      int k = 0;
      for (int j = 0; j < f->nops; j++) {
        IrOp *op = f->ops[j];
        bool dead = op->kind == IR_OP_LAYOUT_CONCAT && op->result;
        for (int r = 0; dead && r < f->nrets; r++) dead = f->rets[r] != op->result;
        for (int g = 0; dead && g < m->nfuncs; g++) {
          const IrFunc *u = m->funcs[g];
          if (u != f && u->saves != f) continue;
          for (int x = 0; dead && x < u->nops; x++)
            for (int a = 0; dead && a < u->ops[x]->nargs; a++) dead = u->ops[x]->args[a].value != op->result;
        }
        if (dead) {
          dropped++;
          changed = true;
          continue;
        }
        f->ops[k++] = op;
      }
      if (k != f->nops) {
        f->nops = k;
        renumber(f);
      }
    }
  }
  return dropped;
}

bool pass_schedule(IrModule *m, PassCtx *ctx) {
  Sched S = {.m = m, .ctx = ctx, .log = ctx->log ? ctx->log : stderr};
  const char *policy = ir_mod_str(m, "policy", "sequential");
  IrPolicy known;
  if (!ir_policy_parse(policy, &known)) return ir_error(ctx->d, "schedule: unknown policy '%s'", policy);
  // Degrees: per function from the pipeline pass (attribute r), else the module's.
  int64_t r_fwd = ir_mod_int(m, "r_fwd", 1), r_bwd = ir_mod_int(m, "r_bwd", 1);
  bool sequential = strcmp(policy, "sequential") == 0;
  // Already scheduled (IR read back after this pass): leave it.
  for (int i = 0; i < m->nfuncs; i++)
    for (int j = 0; j < m->funcs[i]->nops; j++)
      if (m->funcs[i]->ops[j]->stream != IR_STREAM_NONE) return true;
  for (int i = 0; i < m->nfuncs; i++) {
    IrFunc *f = m->funcs[i];
    bool fwd = f->role == IR_ROLE_LAYER_FWD, bwd = f->role == IR_ROLE_LAYER_BWD;
    if (!fwd && !bwd) continue;
    int64_t r = ir_func_int(f, "r", fwd ? r_fwd : r_bwd);
    if (r < 1) return ir_error(ctx->d, "schedule: @%s: pipeline degree %lld is not at least 1", f->name, (long long)r);
    if (sequential && r > 1) {
      if (ctx->verbose) fprintf(S.log, "# schedule: @%s: policy sequential runs unchunked (r = %lld ignored)\n", f->name, (long long)r);
      r = 1;
    }
    if (!chunk_func(&S, f, r)) {
      free(S.shared);
      return false;
    }
    if (bwd && !place_grad_allreduces(f)) {
      free(S.shared);
      return ir_oom(ctx->d);
    }
  }
  free(S.shared);
  if (S.nreused > 0) {
    int dropped = drop_dead_assembly(m);
    if (ctx->verbose)
      fprintf(S.log, "# schedule: %d slices of saved activations read the forward's chunks in place; %d concats "
                     "of their assembly dropped\n", S.nreused, dropped);
  }
  if (ctx->cluster) pass_price(m, ctx->cluster, ctx);   // the chunks' own sizes
  int next_event = 0;
  for (int i = 0; i < m->nfuncs; i++) {
    IrFunc *f = m->funcs[i];
    if (!annotate(ctx->d, f, policy, &next_event)) return false;
  }
  return true;
}
