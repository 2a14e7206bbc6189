// The `recompute` pass (lang/manual.md §12, "Memory"): activations a backward function reads
// from its forward are computed again in the backward instead of kept from one to the other, so
// the memory plan frees them inside the forward. Module attribute `recompute`, the level:
//   1  activations: act.gelu / relu / silu / ... (each row's RECOMPUTE in ir/activations.def), act.oss,
//      mul (a SwiGLU's product): the largest saved values of an MoE layer ([E, C, H] per expert
//      GEMM), cheapest to make again;
//   2  and the norms' outputs: norm.layer, norm.rms, scale, bias, add (the input of the
//      attention's and the gate's GEMMs, their weights' gradients read them);
//   3  layers: every op of the forward but the collectives and the routing decisions (GEMMs,
//      attention, the gate's softmax, rotary positions, ...): a layer keeps its input, what its
//      collectives delivered (the dispatched tokens, the gathered shards) and its integer routing;
//      the backward makes the rest again from those, each GEMM a second time.
// A value of @F.fwd is recomputed in @F.bwd when its op is of the level, it is not a result of
// @F.fwd, no function but @F.fwd and @F.bwd reads it, and each of its value operands is either
// recomputed itself or, when it cannot be, read by @F.bwd anyway (so kept). The copy (attribute recompute=1) goes
// right before the first op that reads it; the forward's own op is untouched. Same op, same
// operands: the same bits as keeping the value (tests/lm/recompute.sh holds whole runs to it).
#include <stdlib.h>
#include <string.h>

#include "pass.h"

static int level_of(IrOpKind k) {
  IrOpClass cls = ir_op_class(k);
  if (ir_op_info[k].nres != 1 || (cls != IR_CLASS_COMPUTE && cls != IR_CLASS_GEMM)) return 0;
  const IrActInfo *act = ir_act_of(k);
  if (act && k == act->op) return act->recompute;   // (its gradient op is the backward's own)
  switch (k) {
  case IR_OP_ACT_OSS:
  case IR_OP_MUL: return 1;
  case IR_OP_NORM_LAYER:
  case IR_OP_NORM_RMS:
  case IR_OP_SCALE:
  case IR_OP_BIAS:
  case IR_OP_ADD: return 2;
  default: return 3;
  }
}

typedef struct Rc {
  IrModule *m;
  IrFunc *f, *b;         // the forward and the backward that saves it
  int level;
  bool *read;            // by value id of f: an op of b (before this pass) reads it
  bool *elsewhere;       // by value id of f: f's results, or a function other than f and b, read it
  signed char *state;    // by value id of f: 0 undecided, 1 recomputed, -1 kept
  IrValue **copy;        // by value id of f: its copy in b, once made
  int made;
} Rc;

// Whether v (a value of f) is recomputed in b; decided once, depth-first through its operands.
static bool recomputed(Rc *c, IrValue *v, int depth) {
  if (c->state[v->id]) return c->state[v->id] > 0;
  c->state[v->id] = -1;
  const IrOp *op = v->def;
  if (!op || depth > (c->level < 3 ? 6 : 256) || level_of(op->kind) == 0 || level_of(op->kind) > c->level || c->elsewhere[v->id]) return false;
  for (int a = 0; a < op->nargs; a++) {
    IrValue *u = op->args[a].value;
    if (u && !recomputed(c, u, depth + 1) && !c->read[u->id]) return false;   // made again, else kept anyway
  }
  c->state[v->id] = 1;
  return true;
}

// The copy of recomputed value v in b, made (with its operands' copies) before b's op `at`;
// returns it and advances *at past what it inserted.
static IrValue *copy_of(Rc *c, IrValue *v, int *at) {
  if (c->copy[v->id]) return c->copy[v->id];
  const IrOp *op = v->def;
  IrOp *n = ir_add_op(c->b, c->m, op->kind, ir_strfmt(c->m, "%s.re", v->name), v->type);
  for (int a = 0; a < op->nargs; a++) {
    const IrOperand *x = &op->args[a];
    if (x->param) ir_op_param(n, x->param);
    else ir_op_arg(n, c->state[x->value->id] > 0 ? copy_of(c, x->value, at) : x->value);
  }
  memcpy(n->attrs, op->attrs, sizeof op->attrs);
  n->nattrs = op->nattrs;
  ir_op_set_int(n, "recompute", 1);
  n->loc = op->loc;
  // ir_add_op appended it: move it to *at.
  IrFunc *b = c->b;
  memmove(&b->ops[*at + 1], &b->ops[*at], sizeof *b->ops * (size_t)(b->nops - 1 - *at));
  b->ops[*at] = n;
  for (int i = 0; i < b->nops; i++) b->ops[i]->index = i;
  (*at)++;
  c->made++;
  return c->copy[v->id] = n->result;
}

static bool recompute_func(IrModule *m, IrFunc *b, int level, int *made) {
  IrFunc *f = b->saves;
  int n = f->nvalues + 1;
  Rc c = {.m = m, .f = f, .b = b, .level = level};
  c.read = calloc((size_t)n, sizeof *c.read);
  c.elsewhere = calloc((size_t)n, sizeof *c.elsewhere);
  c.state = calloc((size_t)n, sizeof *c.state);
  c.copy = calloc((size_t)n, sizeof *c.copy);
  bool ok = c.read && c.elsewhere && c.state && c.copy;
  for (int r = 0; ok && r < f->nrets; r++)
    if (f->rets[r]->func == f) c.elsewhere[f->rets[r]->id] = true;
  for (int g = 0; ok && g < m->nfuncs; g++)   // one scan of the module: who reads f's values
    for (int i = 0; i < m->funcs[g]->nops; i++)
      for (int a = 0; a < m->funcs[g]->ops[i]->nargs; a++) {
        IrValue *v = m->funcs[g]->ops[i]->args[a].value;
        if (!v || v->func != f || m->funcs[g] == f) continue;
        if (m->funcs[g] == b) c.read[v->id] = true;
        else c.elsewhere[v->id] = true;
      }
  for (int i = 0; ok && i < b->nops; i++) {
    IrOp *op = b->ops[i];
    if (ir_op_int(op, "recompute", 0)) continue;
    for (int a = 0; a < op->nargs; a++) {
      IrValue *v = op->args[a].value;
      if (!v || v->func != f || !recomputed(&c, v, 0)) continue;
      int at = i;
      op->args[a].value = copy_of(&c, v, &at);
      i = at;   // op moved down by the copies made before it
    }
  }
  *made += c.made;
  free(c.read), free(c.elsewhere), free(c.state), free(c.copy);
  return ok;
}

// With module attribute recompute_layers K > 0 (moec build's memory choice: the fewest layers
// that fit), level 3 applies to the backward functions of the first K layer functions in forward
// order — their saved values live longest — and level 2 to the others and the loss.
bool pass_recompute(IrModule *m, PassCtx *ctx) {
  int level = (int)ir_mod_int(m, "recompute", 0), made = 0;
  int64_t upto = level == 3 ? ir_mod_int(m, "recompute_layers", 0) : 0, layers = 0;
  if (level <= 0) return true;
  for (int i = 0; i < m->nfuncs; i++) {
    IrFunc *b = m->funcs[i];
    if ((b->role != IR_ROLE_LAYER_BWD && b->role != IR_ROLE_LOSS_BWD) || !b->saves) continue;
    int64_t k = 0;   // the position of b's forward among the layer functions that have a backward
    for (int j = 0; b->role == IR_ROLE_LAYER_BWD && j < m->nfuncs; j++)
      if (m->funcs[j]->saves && m->funcs[j]->role == IR_ROLE_LAYER_BWD && m->funcs[j]->saves->index < b->saves->index) k++;
    layers += b->role == IR_ROLE_LAYER_BWD;
    int lv = upto > 0 && (b->role == IR_ROLE_LOSS_BWD || k >= upto) ? 2 : level;
    if (!recompute_func(m, b, lv, &made)) return ir_oom(ctx->d);
  }
  if (ctx->verbose) {
    FILE *log = ctx->log ? ctx->log : stderr;
    fprintf(log, "# recompute: level %d (%s", level, level == 1 ? "activations" : level == 2 ? "activations and norms" : "layers");
    if (upto > 0 && upto < layers) fprintf(log, " of the first %lld of %lld layer functions, norms elsewhere", (long long)upto, (long long)layers);
    fprintf(log, "): %d ops computed again in the backward\n", made);
  }
  return true;
}
