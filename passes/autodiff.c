// The `autodiff` pass: reverse mode over each forward function, written out as IR.
//
// For every `@L.fwd` it builds `@L.bwd(%dout) saves @L.fwd`: the ops of the forward function
// in reverse, each replaced by its backward rule (the manual backward of the paper §4.4): the
// GRAD column of ir/ops.def for most ops, interpreted by grad_by_rule; C below for the rest
// (matmul's transposes, reshape, the collectives' transposes, straight-through hooks, the
// auxiliary losses' seeds). The backward reads forward values directly — those are the saved
// activations, and memplan keeps them alive across the phase boundary. Contributions to one
// gradient are summed with `add` in the order they appear. The auxiliary losses have no incoming
// gradient: their coefficient (the `coef` attribute) is the seed. Parameter gradients end in
// `param.grad`. It also adds `@loss.bwd` and `@optimizer` (one `opt.*` per parameter) and puts
// the functions in execution order: forwards, loss, backwards in reverse, optimizer.
#include <string.h>

#include "pass.h"

typedef struct Grad {
  IrModule *m;
  IrDiag *d;
  IrFunc *fwd, *bwd;
  IrValue **grad;   // by forward value id
  bool *needs;      // by forward value id: depends differentiably on the input or a parameter
  bool *has_grad;   // by parameter index: an earlier backward function wrote its gradient
} Grad;

// Ops whose result carries no gradient: integer routing decisions and constants built from them
// (class ROUTE in ops.def).
static bool blocks_gradient(IrOpKind k) { return ir_op_class(k) == IR_CLASS_ROUTE; }

// A frozen parameter (ir_param_frozen) takes no gradient: the backward computes only what flows
// through it to the activations.
static bool operand_needs(const Grad *g, const IrOperand *a) {
  return a->param ? !ir_param_frozen(a->param) : g->needs[a->value->id];
}

static void mark_needs(Grad *g) {
  const IrFunc *f = g->fwd;
  for (int i = 0; i < f->nargs; i++) g->needs[f->args[i]->id] = true;
  for (int i = 0; i < f->nops; i++) {
    const IrOp *op = f->ops[i];
    if (!op->result || blocks_gradient(op->kind)) continue;
    bool any = false;
    for (int a = 0; a < op->nargs; a++) any |= operand_needs(g, &op->args[a]);
    // A compressed tensor is not f32 but its decompress passes the gradient straight through.
    bool carries = op->result->type.dtype == IR_F32 || op->kind == IR_OP_HOOK_COMPRESS ||
                   op->kind == IR_OP_HOOK_COMPRESS_INT8;
    g->needs[op->result->id] = any && carries;
  }
}

static const char *fresh_name(Grad *g, const char *base) {
  const char *name = base;
  for (int n = 1; ir_find_value(g->bwd, name); n++) name = ir_strfmt(g->m, "%s.%d", base, n);
  return name;
}

static IrOp *new_op(Grad *g, IrOpKind kind, const char *name) {
  return ir_add_op(g->bwd, g->m, kind, name ? fresh_name(g, name) : NULL, (IrType){0});
}

static void copy_attrs(IrOp *to, const IrOp *from) {
  memcpy(to->attrs, from->attrs, sizeof from->attrs);
  to->nattrs = from->nattrs;
  to->loc = from->loc;
}

static IrValue *typed(Grad *g, IrOp *op) {
  if (!ir_infer_type(g->d, op, &op->result->type)) UNREACHABLE();
  return op->result;
}

// op(args...) with value operands, result named `name`, attributes copied from `like`.
static IrValue *emit(Grad *g, IrOpKind kind, const char *name, const IrOp *like, int n,
                     IrOperand *args) {
  IrOp *op = new_op(g, kind, name);
  for (int i = 0; i < n; i++) op->args[op->nargs++] = args[i];
  if (like) copy_attrs(op, like);
  return typed(g, op);
}
#define V(v) ((IrOperand){.value = (v)})

static IrValue *matmul_t(Grad *g, IrOpKind kind, const char *name, IrOperand a, IrOperand b,
                         bool ta, bool tb, SrcLoc loc) {
  IrOp *op = new_op(g, kind, name);
  op->args[op->nargs++] = a;
  op->args[op->nargs++] = b;
  if (ta) ir_op_set_int(op, "ta", 1);
  if (tb) ir_op_set_int(op, "tb", 1);
  op->loc = loc;
  return typed(g, op);
}

// Adds a gradient contribution to forward value v.
static void accumulate(Grad *g, IrValue *v, IrValue *contribution) {
  if (!v || !g->needs[v->id]) return;
  IrValue *old = g->grad[v->id];
  if (!old) {
    g->grad[v->id] = contribution;
    return;
  }
  g->grad[v->id] = emit(g, IR_OP_ADD, ir_strfmt(g->m, "d%s", v->name), NULL, 2,
                        (IrOperand[]){V(old), V(contribution)});
}

// Parameters replicated over ranks (parallelize marks them grad_reduce) sum their gradient
// over that group first.
static void param_grad(Grad *g, IrParam *p, IrValue *v) {
  const char *group = ir_attr_str(p->attrs, p->nattrs, "grad_reduce", NULL);
  if (group) {
    IrOp *r = new_op(g, IR_OP_COMM_ALLREDUCE, ir_strfmt(g->m, "%s.sum", v->name));
    r->args[r->nargs++] = V(v);
    ir_attrs_set_str(g->m, r->attrs, &r->nattrs, "group", group);
    int64_t size = strcmp(group, "esp") == 0 ? ir_mod_int(g->m, "esp", 1)
                 : strcmp(group, "dp") == 0  ? ir_mod_int(g->m, "dp", 1)
                                             : ir_mod_int(g->m, "dp", 1) * ir_mod_int(g->m, "mp", 1);
    ir_op_set_int(r, "size", size);
    v = typed(g, r);
  }
  IrOp *op = new_op(g, IR_OP_PARAM_GRAD, NULL);
  op->args[op->nargs++] = (IrOperand){.param = p};
  op->args[op->nargs++] = V(v);
  // A parameter used in two functions (tied embeddings: the embedding and the head) gets its
  // gradient from both, in execution order: the later one adds to the earlier one's.
  if (g->has_grad[p->index]) ir_op_set_int(op, "accumulate", 1);
  g->has_grad[p->index] = true;
}

static const char *dname(Grad *g, const IrOperand *a) {
  if (a->param) {
    const char *dot = strrchr(a->param->name, '.');
    return ir_strfmt(g->m, "d%s", dot ? dot + 1 : a->param->name);
  }
  return ir_strfmt(g->m, "d%s", a->value->name);
}

// Backward of a matmul-like op y = op(A)·op(B); dy is y's gradient.
static void matmul_rule(Grad *g, const IrOp *op, IrValue *dy, IrOpKind kind) {
  bool ta = ir_op_int(op, "ta", 0), tb = ir_op_int(op, "tb", 0);
  const IrOperand a = op->args[0], b = op->args[1];
  // dA = dY·op(B)^T (stored as A is: transposed back when ta), dB = op(A)^T·dY.
  if (operand_needs(g, &a)) {
    IrValue *da = ta ? matmul_t(g, kind, dname(g, &a), b, V(dy), tb, true, op->loc)
                     : matmul_t(g, kind, dname(g, &a), V(dy), b, false, !tb, op->loc);
    if (a.param) param_grad(g, a.param, da); else accumulate(g, a.value, da);
  }
  if (operand_needs(g, &b)) {
    IrValue *db = tb ? matmul_t(g, kind, dname(g, &b), V(dy), a, true, ta, op->loc)
                     : matmul_t(g, kind, dname(g, &b), a, V(dy), !ta, false, op->loc);
    if (b.param) param_grad(g, b.param, db); else accumulate(g, b.value, db);
  }
}

// ---- the GRAD column of ops.def ----
// Per operand, separated by ';': "-" (no gradient), "dy" (passes through) or "OP(arg, ...)"
// with the arguments dy, y (the forward result) and x0.. (the forward operands).

// The next ';'-separated term of *s, trimmed, into buf; false at the end.
static bool next_term(const char **s, char *buf, size_t size) {
  while (**s == ' ') (*s)++;
  size_t n = strcspn(*s, ";");
  if (n == 0 && !**s) return false;
  size_t len = n;
  while (len && (*s)[len - 1] == ' ') len--;
  snprintf(buf, size, "%.*s", (int)len, *s);
  *s += n + ((*s)[n] == ';');
  return true;
}

// Parses "OP(a, b)" into the op and its arguments as operand indices (-1 dy, -2 y, K for xK);
// false when malformed.
static bool grad_call(const char *term, IrOpKind *kind, int *args, int *nargs) {
  const char *open = strchr(term, '(');
  size_t len = strlen(term);
  if (!open || len < 2 || term[len - 1] != ')' || open - term >= 64) return false;
  char name[64];
  snprintf(name, sizeof name, "%.*s", (int)(open - term), term);
  *kind = ir_op_by_name(name);
  if (*kind == IR_OP_COUNT) return false;
  *nargs = 0;
  for (const char *p = open + 1; *p && *p != ')';) {
    while (*p == ' ') p++;
    if (*nargs == IR_MAX_ARGS) return false;
    if (strncmp(p, "dy", 2) == 0) args[(*nargs)++] = -1, p += 2;
    else if (*p == 'y') args[(*nargs)++] = -2, p += 1;
    else if (*p == 'x' && p[1] >= '0' && p[1] <= '9') args[(*nargs)++] = p[1] - '0', p += 2;
    else return false;
    while (*p == ' ') p++;
    if (*p == ',') p++;
    else if (*p != ')') return false;
  }
  return true;
}

bool pass_grad_rule_check(const char *rule, int nargs, bool has_result, char *why, size_t size) {
  char term[128];
  int i = 0;
  for (const char *s = rule; next_term(&s, term, sizeof term); i++) {
    IrOpKind kind;
    int args[IR_MAX_ARGS], n;
    if (strcmp(term, "-") == 0 || strcmp(term, "dy") == 0) continue;
    if (!grad_call(term, &kind, args, &n)) return snprintf(why, size, "'%s' is not OP(dy|y|xN, ...) of an op of the table", term), false;
    if (n != ir_op_info[kind].nargs)
      return snprintf(why, size, "'%s': %s takes %d operands", term, ir_op_info[kind].name, ir_op_info[kind].nargs), false;
    for (int a = 0; a < n; a++)
      if (args[a] >= nargs || (args[a] == -2 && !has_result)) return snprintf(why, size, "'%s' names an operand the op does not have", term), false;
  }
  if (i != nargs) return snprintf(why, size, "%d rules for %d operands", i, nargs), false;
  return true;
}

static void grad_by_rule(Grad *g, const IrOp *op, IrValue *dy, const char *rule) {
  char term[128];
  const char *s = rule;
  for (int i = 0; i < op->nargs && next_term(&s, term, sizeof term); i++) {
    const IrOperand *a = &op->args[i];
    if (strcmp(term, "-") == 0 || !operand_needs(g, a)) continue;
    IrValue *d = dy;
    if (strcmp(term, "dy") != 0) {
      IrOpKind kind;
      int args[IR_MAX_ARGS], n;
      if (!grad_call(term, &kind, args, &n)) UNREACHABLE();   // tests/unit checks every rule
      IrOperand ops[IR_MAX_ARGS];
      for (int k = 0; k < n; k++) ops[k] = args[k] == -1 ? V(dy) : args[k] == -2 ? V(op->result) : op->args[args[k]];
      d = emit(g, kind, dname(g, a), op, n, ops);
    }
    if (a->param) param_grad(g, a->param, d);
    else accumulate(g, a->value, d);
  }
}

// reshape: dy reshaped back to the operand's shape.
static void reshape_rule(Grad *g, const IrOp *op, IrValue *dy) {
  const IrOperand *a = op->args;
  const IrType *t = a[0].param ? &a[0].param->type : &a[0].value->type;
  IrOp *r = new_op(g, IR_OP_RESHAPE, dname(g, &a[0]));
  r->args[r->nargs++] = V(dy);
  ir_op_set_int(r, "rank", t->rank);
  static const char *const keys[] = {"d0", "d1", "d2", "d3"};
  for (int i = 0; i < t->rank; i++) ir_op_set_int(r, keys[i], t->dim[i]);
  r->loc = op->loc;
  accumulate(g, a[0].value, typed(g, r));
}

// The transposes: split <-> allgather (an allgather whose consumers are replicated,
// bwd_split, gives back this rank's slice), reducescatter <-> allgather, alltoall <->
// alltoall, expert-major <-> rank-major.
static void transpose_rule(Grad *g, const IrOp *op, IrValue *dy) {
  const IrOperand *a = op->args;
  IrOpKind back = op->kind == IR_OP_COMM_SPLIT            ? IR_OP_COMM_ALLGATHER
                  : op->kind == IR_OP_COMM_REDUCESCATTER  ? IR_OP_COMM_ALLGATHER
                  : op->kind == IR_OP_COMM_ALLTOALL       ? IR_OP_COMM_ALLTOALL
                  : op->kind == IR_OP_LAYOUT_EXPERT_MAJOR ? IR_OP_LAYOUT_RANK_MAJOR
                  : op->kind == IR_OP_LAYOUT_RANK_MAJOR   ? IR_OP_LAYOUT_EXPERT_MAJOR
                  : ir_op_int(op, "bwd_split", 0)         ? IR_OP_COMM_SPLIT
                                                          : IR_OP_COMM_REDUCESCATTER;
  IrOp *b = new_op(g, back, dname(g, &a[0]));
  b->args[b->nargs++] = V(dy);
  copy_attrs(b, op);
  int keep = 0;  // bwd_split describes the forward allgather only
  for (int i = 0; i < b->nattrs; i++)
    if (strcmp(b->attrs[i].key, "bwd_split") != 0) b->attrs[keep++] = b->attrs[i];
  b->nattrs = keep;
  accumulate(g, a[0].value, typed(g, b));
}

// attn.causal: the rows' softmax statistics, then one backward computes the packed
// MLA's parts of heads (manual §7.2 `mla`): a slice's gradient is placed back into zeros, a
// placement's is the slice; heads.cat's operands take their columns of every head, a shared head
// (a_heads 1) the sum of its copies over the heads.
static IrValue *heads_op(Grad *g, IrOpKind kind, const char *name, IrValue *x, int64_t heads, int64_t offset,
                         int64_t width, int64_t d, SrcLoc loc) {
  IrOp *o = new_op(g, kind, name);
  o->args[o->nargs++] = V(x);
  ir_op_set_int(o, "heads", heads);
  if (kind != IR_OP_HEADS_SUM) {
    ir_op_set_int(o, "offset", offset);
    ir_op_set_int(o, "width", width);
  }
  if (kind == IR_OP_HEADS_PLACE) ir_op_set_int(o, "d", d);
  o->loc = loc;
  return typed(g, o);
}

static void heads_rule(Grad *g, const IrOp *op, IrValue *dy) {
  const IrOperand *a = op->args;
  int64_t heads = ir_op_int(op, "heads", 1);
  if (op->kind == IR_OP_HEADS_SLICE) {
    accumulate(g, a[0].value, heads_op(g, IR_OP_HEADS_PLACE, dname(g, &a[0]), dy, heads, ir_op_int(op, "offset", 0),
                                       ir_op_int(op, "width", 1), a[0].value->type.dim[1] / heads, op->loc));
    return;
  }
  if (op->kind == IR_OP_HEADS_PLACE) {
    accumulate(g, a[0].value, heads_op(g, IR_OP_HEADS_SLICE, dname(g, &a[0]), dy, heads, ir_op_int(op, "offset", 0),
                                       ir_op_int(op, "width", 1), 0, op->loc));
    return;
  }
  int64_t ah = ir_op_int(op, "a_heads", 1), wa = a[0].value->type.dim[1] / ah, wb = a[1].value->type.dim[1] / heads;
  if (operand_needs(g, &a[0])) {
    IrValue *da = heads_op(g, IR_OP_HEADS_SLICE, dname(g, &a[0]), dy, heads, 0, wa, 0, op->loc);
    if (ah == 1 && heads > 1) da = heads_op(g, IR_OP_HEADS_SUM, ir_strfmt(g->m, "%s.sum", da->name), da, heads, 0, 0, 0, op->loc);
    accumulate(g, a[0].value, da);
  }
  if (operand_needs(g, &a[1]))
    accumulate(g, a[1].value, heads_op(g, IR_OP_HEADS_SLICE, dname(g, &a[1]), dy, heads, wa, wb, 0, op->loc));
}

// [dq | dk | dv]; each operand takes its columns. attn.sink's statistics hold the sinks in each
// logsumexp, so the same backward gives its dq, dk, dv; the sinks' gradient comes from them too.
static void attn_rule(Grad *g, const IrOp *op, IrValue *dy) {
  const IrOperand *a = op->args;
  bool sink = op->kind == IR_OP_ATTN_SINK;
  IrValue *stats = sink ? emit(g, IR_OP_ATTN_SINK_STATS, ir_strfmt(g->m, "%s.stats", op->result->name), op, 5,
                               (IrOperand[]){V(dy), a[0], a[1], V(op->result), a[3]})
                        : emit(g, IR_OP_ATTN_CAUSAL_STATS, ir_strfmt(g->m, "%s.stats", op->result->name), op, 4,
                               (IrOperand[]){V(dy), a[0], a[1], V(op->result)});
  if (sink && operand_needs(g, &a[3])) {
    IrOp *sg = new_op(g, IR_OP_ATTN_SINK_GRAD, dname(g, &a[3]));
    sg->args[sg->nargs++] = V(stats);
    sg->args[sg->nargs++] = a[3];
    sg->loc = op->loc;
    IrValue *d = typed(g, sg);
    if (a[3].param) param_grad(g, a[3].param, d);
    else accumulate(g, a[3].value, d);
  }
  IrValue *dqkv = emit(g, IR_OP_ATTN_CAUSAL_GRAD, ir_strfmt(g->m, "d%s.qkv", op->result->name), op, 5,
                       (IrOperand[]){V(dy), a[0], a[1], a[2], V(stats)});
  int64_t offset = 0;
  for (int i = 0; i < 3; i++) {
    int64_t width = a[i].value->type.dim[1];
    if (operand_needs(g, &a[i])) {
      IrOp *sl = new_op(g, IR_OP_COLS_SLICE, dname(g, &a[i]));
      sl->args[sl->nargs++] = V(dqkv);
      ir_op_set_int(sl, "offset", offset);
      ir_op_set_int(sl, "width", width);
      sl->loc = op->loc;
      accumulate(g, a[i].value, typed(g, sl));
    }
    offset += width;
  }
}

static bool backward_op(Grad *g, const IrOp *op) {
  IrValue *dy = op->result ? g->grad[op->result->id] : NULL;
  const IrOperand *a = op->args;
  switch (op->kind) {
  case IR_OP_GATE_AUX_LOSS:
    if (ir_op_float(op, "coef", 0) != 0)
      accumulate(g, a[0].value, emit(g, IR_OP_GATE_AUX_LOSS_GRAD, "daux", op, 2, (IrOperand[]){a[0], a[1]}));
    return true;
  case IR_OP_GATE_AUX_POOLED:  // reads the statistics the runtime pooled after the forward
    if (ir_op_float(op, "coef", 0) != 0)
      accumulate(g, a[0].value, emit(g, IR_OP_GATE_AUX_POOLED_GRAD, "daux", op, 2,
                                     (IrOperand[]){a[0], V(op->result)}));
    return true;
  case IR_OP_GATE_Z_LOSS:
    if (ir_op_float(op, "coef", 0) != 0)
      accumulate(g, a[0].value, emit(g, IR_OP_GATE_Z_LOSS_GRAD, "dz", op, 1, (IrOperand[]){a[0]}));
    return true;
  case IR_OP_HOOK_RECORD:
    return true;  // observes only
  case IR_OP_GATE_TOPK_BIAS: {  // the correction bias's "gradient" is the load imbalance (opt.balance)
    if (a[1].param && ir_param_frozen(a[1].param)) return true;
    IrOp *load = new_op(g, IR_OP_GATE_BALANCE_LOAD, dname(g, &a[1]));
    load->args[load->nargs++] = V(op->result);
    ir_op_set_int(load, "experts", a[1].param ? a[1].param->type.dim[0] : 1);
    load->loc = op->loc;
    IrValue *v = typed(g, load);
    if (a[1].param) param_grad(g, a[1].param, v);
    return true;
  }
  case IR_OP_LOSS_XENT:  // the loss itself: its gradient is the seed (scale * (softmax - onehot) / t)
    accumulate(g, a[0].value, emit(g, IR_OP_LOSS_XENT_GRAD, "dlogits", op, 2, (IrOperand[]){a[0], a[1]}));
    return true;
  case IR_OP_LOSS_XENT_VP: {  // over a vocabulary split over MP: the seed of the rank's logits
    // (passes/parallelize.c vocab_split: loss.xent.stats(logits, targets) -> comm.allgather -> here)
    const IrOp *all = a[0].value->def, *st = all ? all->args[0].value->def : NULL;
    if (!st || st->kind != IR_OP_LOSS_XENT_STATS)
      return ir_error_at(g->d, op->loc, "autodiff: loss.xent.vp does not read the gathered loss.xent.stats");
    accumulate(g, st->args[0].value,
               emit(g, IR_OP_LOSS_XENT_VP_GRAD, "dlogits", op, 3, (IrOperand[]){st->args[0], st->args[1], a[0]}));
    return true;
  }
  default:
    if (blocks_gradient(op->kind)) return true;  // routing decisions: no gradient
    break;
  }
  if (!dy) return true;  // nothing downstream depends on this value
  if (ir_op_info[op->kind].grad[0]) {
    grad_by_rule(g, op, dy, ir_op_info[op->kind].grad);
    return true;
  }
  switch (op->kind) {
  case IR_OP_MATMUL: matmul_rule(g, op, dy, IR_OP_MATMUL); return true;
  case IR_OP_EXPERT_MATMUL: matmul_rule(g, op, dy, IR_OP_EXPERT_MATMUL); return true;
  case IR_OP_RESHAPE: reshape_rule(g, op, dy); return true;
  case IR_OP_COMM_COPY:
  case IR_OP_COMM_ALLREDUCE: {
    // Megatron's pair around a head- or column-split block: the copy's gradient is the sum of
    // the members' partial gradients (an AllReduce); the AllReduce's consumers are replicated,
    // so its operand's gradient is the output's, unchanged.
    if (op->kind == IR_OP_COMM_ALLREDUCE) {
      accumulate(g, a[0].value, dy);
      return true;
    }
    IrOp *b = new_op(g, IR_OP_COMM_ALLREDUCE, dname(g, &a[0]));
    b->args[b->nargs++] = V(dy);
    copy_attrs(b, op);
    accumulate(g, a[0].value, typed(g, b));
    return true;
  }
  case IR_OP_COMM_SPLIT:
  case IR_OP_COMM_ALLGATHER:
  case IR_OP_COMM_REDUCESCATTER:
  case IR_OP_COMM_ALLTOALL:
  case IR_OP_LAYOUT_EXPERT_MAJOR:
  case IR_OP_LAYOUT_RANK_MAJOR:
    transpose_rule(g, op, dy);
    return true;
  case IR_OP_ATTN_CAUSAL:
  case IR_OP_ATTN_SINK: attn_rule(g, op, dy); return true;
  case IR_OP_HEADS_SLICE:
  case IR_OP_HEADS_PLACE:
  case IR_OP_HEADS_CAT: heads_rule(g, op, dy); return true;
  case IR_OP_HOOK_COMPRESS:
  case IR_OP_HOOK_COMPRESS_INT8:
    return true;  // the gradient reaches the input through the matching decompress
  case IR_OP_HOOK_DECOMPRESS:
  case IR_OP_HOOK_DECOMPRESS_INT8: {
    // Straight through: the round trip compress -> decompress passes the gradient unchanged.
    const IrOp *c = a[0].value->def;
    if (!c || (c->kind != IR_OP_HOOK_COMPRESS && c->kind != IR_OP_HOOK_COMPRESS_INT8)) break;
    accumulate(g, c->args[0].value, dy);
    return true;
  }
  default:
    break;
  }
  ir_error_at(g->d, op->loc, "autodiff: no backward rule for '%s'", ir_op_info[op->kind].name);
  return false;
}

// @F.bwd(%dout) saves @F.fwd: gradient of the first result seeded by %dout; returns the
// gradient of the first argument (the layer input), or nothing when that is integer (the tokens
// of a language model's @embed.fwd). A loss function (@loss.fwd of a language model) has no
// %dout: its loss op seeds the gradient itself.
// A replicated parameter whose gradient comes from several places (a tied embedding: the head in
// @loss.bwd, then the embedding) is summed over its group once, after the last contribution:
// the contributions' AllReduces go, the param.grad ops add the local parts, and one in-place
// comm.allreduce_grad of the whole gradient follows the last of them.
static void reduce_once(IrModule *m) {
  for (int p = 0; p < m->nparams; p++) {
    IrFunc *last_f = NULL;
    IrOp *last = NULL, *ar = NULL;
    int contributions = 0;
    for (int i = 0; i < m->nfuncs; i++)
      for (int j = 0; j < m->funcs[i]->nops; j++) {
        IrOp *op = m->funcs[i]->ops[j];
        if (op->kind != IR_OP_PARAM_GRAD || op->args[0].param != m->params[p]) continue;
        contributions++;
        last_f = m->funcs[i];
        last = op;
      }
    if (contributions < 2) continue;
    for (int i = 0; i < m->nfuncs; i++)
      for (int j = 0; j < m->funcs[i]->nops; j++) {
        IrOp *op = m->funcs[i]->ops[j];
        IrOp *def = op->kind == IR_OP_PARAM_GRAD && op->args[0].param == m->params[p] ? op->args[1].value->def : NULL;
        if (!def || def->kind != IR_OP_COMM_ALLREDUCE) continue;
        op->args[1].value = def->args[0].value;   // the sum's only reader is this param.grad
        ar = def;
        ir_remove_op(m->funcs[i], def);
        j = op->index;
      }
    if (!ar) continue;
    IrOp *r = ir_add_op(last_f, m, IR_OP_COMM_ALLREDUCE_GRAD, NULL, (IrType){0});
    ir_op_param(r, m->params[p]);
    copy_attrs(r, ar);
    ir_op_set_int(r, "offset", 0);
    ir_op_set_int(r, "count", ir_type_numel(&m->params[p]->type));
    r->loc = m->params[p]->loc;
    int at = last->index + 1;
    memmove(&last_f->ops[at + 1], &last_f->ops[at], sizeof *last_f->ops * (size_t)(last_f->nops - 1 - at));
    last_f->ops[at] = r;
    for (int i = 0; i < last_f->nops; i++) last_f->ops[i]->index = i;
  }
}

// The reductions of parameter p's gradient: its comm.allreduce_grad ops, and the comm.allreduce
// whose sum a param.grad of p takes (and nothing else reads). False when a contribution reaches the
// gradient unsummed (no comm.allreduce_grad follows) or the reductions are not over one group.
static bool reductions_of(IrModule *m, const IrParam *p, IrOp **out, int *n) {
  bool unsummed = false, inplace = false;
  *n = 0;
  for (int i = 0; i < m->nfuncs; i++)
    for (int j = 0; j < m->funcs[i]->nops; j++) {
      IrOp *op = m->funcs[i]->ops[j];
      if (op->kind == IR_OP_COMM_ALLREDUCE_GRAD && op->args[0].param == p) {
        out[(*n)++] = op;
        inplace = true;
      }
      if (op->kind != IR_OP_PARAM_GRAD || op->args[0].param != p) continue;
      IrOp *def = op->args[1].value->def;
      int users = 0;
      for (int k = 0; def && k < m->funcs[i]->nops; k++)
        for (int a = 0; a < m->funcs[i]->ops[k]->nargs; a++) users += m->funcs[i]->ops[k]->args[a].value == def->result;
      if (def && def->kind == IR_OP_COMM_ALLREDUCE && users == 1)
        out[(*n)++] = def;
      else
        unsummed = true;
      if (*n >= 8) return false;
    }
  if ((unsummed && !inplace) || *n == 0) return false;
  for (int k = 0; k < *n; k++)
    if (strcmp(ir_op_str(out[k], "group", ""), ir_op_str(out[0], "group", "")) != 0 ||
        ir_op_int(out[k], "size", 1) != ir_op_int(out[0], "size", 1))
      return false;
  return ir_op_int(out[0], "size", 1) > 1;
}

// `optimizer adamw { shard true; }` (ZeRO-1): a parameter whose gradient is summed over a group of
// replicas keeps the moments of its rows of dim 0 only (member i of p: rows [R i / p, R (i+1) / p)).
// The parameter gets attribute shard = the group; its reductions shard = R (a reduce-scatter: each
// member gets the sums of its rows); its opt.adamw the group and size (it updates the rows the rank
// owns, then every member's rows are gathered, codegen/emit_c.c). A correction bias and a scalar
// stay whole.
static void mark_shards(IrModule *m) {
  if (!ir_mod_int(m, "shard_optimizer", 0)) return;
  IrFunc *opt = NULL;
  for (int i = 0; i < m->nfuncs; i++)
    if (m->funcs[i]->role == IR_ROLE_OPTIMIZER) opt = m->funcs[i];
  for (int i = 0; opt && i < opt->nops; i++) {
    IrOp *u = opt->ops[i];
    IrParam *p = u->args[0].param;
    IrOp *red[8];
    int n;
    if (u->kind != IR_OP_OPT_ADAMW || p->type.rank == 0 || p->type.dim[0] < 2 || !reductions_of(m, p, red, &n)) continue;
    const char *group = ir_op_str(red[0], "group", "");
    ir_attrs_set_str(m, p->attrs, &p->nattrs, "shard", group);
    for (int k = 0; k < n; k++) ir_op_set_int(red[k], "shard", p->type.dim[0]);
    ir_attrs_set_str(m, u->attrs, &u->nattrs, "group", group);
    ir_op_set_int(u, "size", ir_op_int(red[0], "size", 1));
  }
}

static IrFunc *backward_func(IrModule *m, IrDiag *d, IrFunc *fwd, const char *name, IrFuncRole role, bool *has_grad) {
  Grad g = {.m = m, .d = d, .fwd = fwd, .has_grad = has_grad};
  g.bwd = ir_add_func(m, name, role);
  g.bwd->saves = fwd;
  g.bwd->loc = fwd->loc;
  g.grad = ir_alloc(m, sizeof(IrValue *) * (size_t)(fwd->nvalues + 1));
  g.needs = ir_alloc(m, sizeof(bool) * (size_t)(fwd->nvalues + 1));
  mark_needs(&g);
  IrValue *out = fwd->rets[0];
  if (role != IR_ROLE_LOSS_BWD)
    g.grad[out->id] = ir_add_arg(g.bwd, m, fresh_name(&g, ir_strfmt(m, "d%s", out->name)), out->type);
  for (int i = fwd->nops - 1; i >= 0; i--)
    if (!backward_op(&g, fwd->ops[i])) return NULL;
  IrValue *x = fwd->args[0];
  if (x->type.dtype != IR_F32) return g.bwd;
  IrValue *dx = g.grad[x->id];
  if (!dx) UNREACHABLE();  // the residual always reaches the input
  ir_add_ret(g.bwd, m, dx);
  return g.bwd;
}

static bool is_layer_fwd(const IrFunc *f) { return f->role == IR_ROLE_LAYER_FWD; }

bool pass_autodiff(IrModule *m, PassCtx *ctx) {
  IrFunc *loss = NULL;
  bool have_bwd = false;
  for (int i = 0; i < m->nfuncs; i++) {
    if (m->funcs[i]->role == IR_ROLE_LOSS_FWD) loss = m->funcs[i];
    have_bwd |= ir_role_phase(m->funcs[i]->role) == IR_PHASE_BWD;
  }
  if (!loss || loss->nargs != 2 || loss->nrets < 1 || have_bwd)
    return ir_error(ctx->d, "autodiff: the module needs one '@loss.fwd(%%out, %%target)' and no backward yet");
  bool *has_grad = ir_alloc(m, sizeof(bool) * (size_t)(m->nparams + 1));

  int nfwd = 0;
  IrFunc **fwds = ir_alloc(m, sizeof(IrFunc *) * (size_t)m->nfuncs);
  for (int i = 0; i < m->nfuncs; i++)
    if (is_layer_fwd(m->funcs[i])) fwds[nfwd++] = m->funcs[i];

  // @loss.bwd: d loss / d out. The mse of MoE stacks is written here; a language model's
  // head and cross-entropy are differentiated like a layer.
  // A pipeline stage before the last ends in loss.link: its loss.bwd passes on the gradient of
  // out that the next stage sent (the loss function's second argument).
  bool mse = false, link = false;
  for (int i = 0; i < loss->nops; i++) {
    mse |= loss->ops[i]->kind == IR_OP_LOSS_MSE;
    link |= loss->ops[i]->kind == IR_OP_LOSS_LINK;
  }
  if (mse || link) {
    IrFunc *lb = ir_add_func(m, "loss.bwd", IR_ROLE_LOSS_BWD);
    lb->saves = loss;
    IrOp *op = ir_add_op(lb, m, link ? IR_OP_LOSS_LINK_GRAD : IR_OP_LOSS_MSE_GRAD, "dout", (IrType){0});
    ir_op_arg(op, loss->args[0]);
    ir_op_arg(op, loss->args[1]);
    for (int i = 0; i < loss->nops; i++)  // the loss's share of the global mean (parallelize)
      if (loss->ops[i]->kind == IR_OP_LOSS_MSE) copy_attrs(op, loss->ops[i]);
    if (!ir_infer_type(ctx->d, op, &op->result->type)) UNREACHABLE();
    ir_add_ret(lb, m, op->result);
  } else if (!backward_func(m, ctx->d, loss, "loss.bwd", IR_ROLE_LOSS_BWD, has_grad)) {
    return false;
  }

  for (int i = nfwd - 1; i >= 0; i--) {
    size_t n = strlen(fwds[i]->name);
    const char *name = ir_strfmt(m, "%.*s.bwd", (int)(n - 4), fwds[i]->name);
    if (!backward_func(m, ctx->d, fwds[i], name, IR_ROLE_LAYER_BWD, has_grad)) return false;
  }
  reduce_once(m);

  IrFunc *opt = ir_add_func(m, "optimizer", IR_ROLE_OPTIMIZER);
  const char *kind = ir_mod_str(m, "optimizer", "sgd");
  bool adamw = strcmp(kind, "adamw") == 0;
  for (int i = 0; i < m->nparams; i++) {
    if (ir_attrs_get(m->params[i]->attrs, m->params[i]->nattrs, "balance") || ir_param_frozen(m->params[i])) continue;
    IrOp *u = ir_add_op(opt, m, adamw ? IR_OP_OPT_ADAMW : IR_OP_OPT_SGD, NULL, (IrType){0});
    ir_op_param(u, m->params[i]);
    ir_op_set_float(u, "lr", ir_mod_float(m, "lr", 0.01));
    // A language model decays only tensors of rank >= 2 (not norms, biases); lang/manual.md §7.2.
    bool decays = ir_mod_int(m, "vocab", 0) == 0 || m->params[i]->type.rank >= 2;
    ir_op_set_float(u, "weight_decay", decays ? ir_mod_float(m, "weight_decay", 0) : 0);
    if (adamw) {
      ir_op_set_float(u, "beta1", ir_mod_float(m, "beta1", 0.9));
      ir_op_set_float(u, "beta2", ir_mod_float(m, "beta2", 0.999));
      ir_op_set_float(u, "eps", ir_mod_float(m, "eps", 1e-8));
    }
  }

  // A correction bias (attribute balance = its rate) is moved by the sign of its summed load, after
  // the other updates (their launches stay one run on CUDA).
  for (int i = 0; i < m->nparams; i++) {
    const IrAttr *rate = ir_attrs_get(m->params[i]->attrs, m->params[i]->nattrs, "balance");
    if (!rate || ir_param_frozen(m->params[i])) continue;
    IrOp *u = ir_add_op(opt, m, IR_OP_OPT_BALANCE, NULL, (IrType){0});
    ir_op_param(u, m->params[i]);
    ir_op_set_float(u, "rate", rate->kind == IR_ATTR_INT ? (double)rate->i : rate->f);
  }

  mark_shards(m);

  // Execution order: layer forwards (already first), loss.fwd, loss.bwd, backwards, optimizer.
  int n = 0;
  IrFunc **order = ir_alloc(m, sizeof(IrFunc *) * (size_t)m->nfuncs);
  for (int i = 0; i < nfwd; i++) order[n++] = fwds[i];
  order[n++] = loss;
  for (int i = 0; i < m->nfuncs; i++)
    if (!is_layer_fwd(m->funcs[i]) && m->funcs[i] != loss) order[n++] = m->funcs[i];
  for (int i = 0; i < n; i++) {
    m->funcs[i] = order[i];
    order[i]->index = i;
  }
  if (ctx->verbose) {
    int ops = 0;
    for (int i = 0; i < m->nfuncs; i++) ops += m->funcs[i]->nops;
    fprintf(ctx->log ? ctx->log : stderr, "# autodiff: %d backward functions, %d ops in the step\n", nfwd, ops);
  }
  return true;
}
