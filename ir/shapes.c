// Shape inference: the result type of every op in ir/ops.def from its operands and attributes
// (semantics in lang/manual.md §11 and the DOC column of ops.def). An op with a SHAPE rule in ops.def
// is checked by that rule (shape_by_rule), then its attributes (rule_attrs); the ops whose result
// the rule language cannot say (sized by attributes, literal dims, parameters as operands) have
// their rules in C, one function per op family (infer_dense, infer_gate, ...). Each rule checks what it reads —
// ranks, dtypes, the dimensions that must agree, the attributes that size the result — and
// names the mismatched operands and dims in its diagnostic, so the verifier (which compares the
// declared result type against this) and the passes (which use it to build ops) share one set
// of rules.
//
// Shape letters as in ops.def: S tokens, M model dim, E experts, K choices per token,
// C = groups*capacity slots per expert.
#include <stdarg.h>
#include <string.h>

#include "ir.h"

typedef struct Infer {
  IrDiag *d;
  const IrOp *op;
  char names[IR_MAX_ARGS][240];  // "%x (f32[64, 32])" per operand, for messages
} Infer;

static const char *op_name(const IrOp *op) {
  return (unsigned)op->kind < IR_OP_COUNT ? ir_op_info[op->kind].name : "?";
}

static bool fail(Infer *I, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool fail(Infer *I, const char *fmt, ...) {
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  const IrOp *op = I->op;
  if (op->loc.src)
    return ir_error_at(I->d, op->loc, "%s: %s", op_name(op), msg);
  return ir_error(I->d, "in @%s: op %d (%s): %s", op->func && op->func->name ? op->func->name : "?",
                  op->index, op_name(op), msg);
}

static const IrType *ty(const Infer *I, int i) {
  const IrOperand *a = &I->op->args[i];
  return a->value ? &a->value->type : &a->param->type;
}

// The operand as a message names it: "%x (f32[64, 32])".
static const char *nm(const Infer *I, int i) { return I->names[i]; }

static int64_t dim(const Infer *I, int i, int d) { return ty(I, i)->dim[d]; }

static bool is_float(IrDtype t) { return t == IR_F32 || t == IR_BF16 || t == IR_F16; }

// Operand i is a float tensor of the given rank; `shape` says what it should look like.
static bool need_float(Infer *I, int i, int rank, const char *shape) {
  const IrType *t = ty(I, i);
  if (rank >= 0 && t->rank != rank) return fail(I, "%s must have rank %d (%s)", nm(I, i), rank, shape);
  if (!is_float(t->dtype)) return fail(I, "%s must be a float tensor (%s)", nm(I, i), shape);
  return true;
}

static bool need_i32(Infer *I, int i, int rank, const char *shape) {
  const IrType *t = ty(I, i);
  if (t->rank != rank) return fail(I, "%s must have rank %d (%s)", nm(I, i), rank, shape);
  if (t->dtype != IR_I32) return fail(I, "%s must be i32 (%s)", nm(I, i), shape);
  return true;
}

static bool same_dtype(Infer *I, int i, int j) {
  if (ty(I, i)->dtype == ty(I, j)->dtype) return true;
  return fail(I, "dtypes differ: %s and %s", nm(I, i), nm(I, j));
}

// Dimension di of operand i equals dimension dj of operand j; `what` names it ("S", "k", ...).
static bool same_dim(Infer *I, const char *what, int i, int di, int j, int dj) {
  if (dim(I, i, di) == dim(I, j, dj)) return true;
  return fail(I, "%s differs: %s has %s = %lld but %s has %s = %lld", what, nm(I, i), what,
              (long long)dim(I, i, di), nm(I, j), what, (long long)dim(I, j, dj));
}

static bool same_type(Infer *I, int i, int j) {
  if (ir_type_equal(ty(I, i), ty(I, j))) return true;
  return fail(I, "operand types differ: %s and %s", nm(I, i), nm(I, j));
}

static bool int_attr(Infer *I, const char *key, int64_t min, int64_t *out) {
  const IrAttr *a = ir_attrs_get(I->op->attrs, I->op->nattrs, key);
  if (!a) return fail(I, "missing attribute '%s'", key);
  if (a->kind != IR_ATTR_INT) return fail(I, "attribute '%s' must be an integer", key);
  if (a->i < min) return fail(I, "attribute '%s' must be at least %lld, got %lld", key, (long long)min, (long long)a->i);
  *out = a->i;
  return true;
}

// An optional 0/1 attribute (ta, tb) or a required one (renorm).
static bool flag_attr(Infer *I, const char *key, bool required, int *out) {
  const IrAttr *a = ir_attrs_get(I->op->attrs, I->op->nattrs, key);
  *out = 0;
  if (!a) return required ? fail(I, "missing attribute '%s'", key) : true;
  if (a->kind != IR_ATTR_INT || (a->i != 0 && a->i != 1))
    return fail(I, "attribute '%s' must be 0 or 1", key);
  *out = (int)a->i;
  return true;
}

static bool num_attr(Infer *I, const char *key, bool required) {
  const IrAttr *a = ir_attrs_get(I->op->attrs, I->op->nattrs, key);
  if (!a) return required ? fail(I, "missing attribute '%s'", key) : true;
  if (a->kind == IR_ATTR_STR) return fail(I, "attribute '%s' must be a number", key);
  return true;
}

// The groups attribute splits the S tokens into equal routing groups.
static bool groups_attr(Infer *I, int64_t S, int64_t *groups) {
  if (!int_attr(I, "groups", 1, groups)) return false;
  if (S % *groups != 0)
    return fail(I, "%lld tokens do not split into groups=%lld equal routing groups", (long long)S,
                (long long)*groups);
  return true;
}

// gate.topk's group limit (optional): the E experts in expert_groups equal groups, the k chosen
// among the topk_groups best of them (ranked by group_score 0: the sum of a group's two best
// scores, which needs two experts a group; 1: its best), which hold at least k experts.
static bool expert_groups_attrs(Infer *I, int64_t E, int64_t K) {
  const IrOp *op = I->op;
  int64_t groups = ir_op_int(op, "expert_groups", 1), best = ir_op_int(op, "topk_groups", 1),
          score = ir_op_int(op, "group_score", 0);
  if (groups < 1 || groups > 64 || E % groups != 0)
    return fail(I, "expert_groups=%lld does not split the %lld experts into at most 64 equal groups", (long long)groups,
                (long long)E);
  if (best < 1 || best > groups)
    return fail(I, "topk_groups=%lld must be between 1 and expert_groups=%lld", (long long)best, (long long)groups);
  if (groups > 1 && best * (E / groups) < K)
    return fail(I, "topk_groups=%lld groups of %lld experts hold fewer than k=%lld", (long long)best,
                (long long)(E / groups), (long long)K);
  if (score != 0 && score != 1) return fail(I, "group_score must be 0 (the sum of the two best) or 1 (the best)");
  if (groups > 1 && score == 0 && E / groups < 2)
    return fail(I, "group_score=0 sums each group's two best scores: groups of one expert have no second");
  return true;
}

// experts, groups, capacity of the order ops; *slots = groups * capacity.
static bool route_attrs(Infer *I, int64_t S, int64_t *experts, int64_t *slots) {
  int64_t groups, capacity;
  if (!int_attr(I, "experts", 1, experts) || !groups_attr(I, S, &groups) ||
      !int_attr(I, "capacity", 1, &capacity))
    return false;
  if (__builtin_mul_overflow(groups, capacity, slots))
    return fail(I, "groups*capacity overflows (groups=%lld, capacity=%lld)", (long long)groups,
                (long long)capacity);
  return true;
}

// idx and loc: i32 [S, K] with the same shape; S and K out.
static bool routing_pair(Infer *I, int idx, int loc, int64_t experts, int64_t *S, int64_t *K) {
  if (!need_i32(I, idx, 2, "[S, K]") || !need_i32(I, loc, 2, "[S, K]")) return false;
  if (!same_dim(I, "S", idx, 0, loc, 0) || !same_dim(I, "K", idx, 1, loc, 1)) return false;
  *S = dim(I, idx, 0);
  *K = dim(I, idx, 1);
  if (*K > experts)
    return fail(I, "%s has K = %lld choices per token but there are only experts=%lld",
                nm(I, idx), (long long)*K, (long long)experts);
  return true;
}

// A dispatched buffer [E, C, M] must have E = experts and C = groups*capacity.
static bool dispatched(Infer *I, int i, int64_t experts, int64_t slots) {
  if (!need_float(I, i, 3, "[E, C, M]")) return false;
  if (dim(I, i, 0) != experts)
    return fail(I, "%s has E = %lld but experts=%lld", nm(I, i), (long long)dim(I, i, 0), (long long)experts);
  if (dim(I, i, 1) != slots)
    return fail(I, "%s has C = %lld but groups*capacity = %lld", nm(I, i), (long long)dim(I, i, 1),
                (long long)slots);
  return true;
}

// E * C slots of a dense dispatch row.
static bool slots_of(Infer *I, int64_t experts, int64_t slots, int64_t *out) {
  if (__builtin_mul_overflow(experts, slots, out))
    return fail(I, "experts*groups*capacity overflows (%lld * %lld)", (long long)experts, (long long)slots);
  return true;
}

// Rows of x [..., n]: the product of every dim but the last.
static bool rows_of(Infer *I, int i, int64_t *rows) {
  const IrType *t = ty(I, i);
  if (t->rank < 1) return fail(I, "%s must have rank 1 or more ([..., n])", nm(I, i));
  *rows = 1;
  for (int d = 0; d + 1 < t->rank; d++)
    if (__builtin_mul_overflow(*rows, t->dim[d], rows)) return fail(I, "%s has too many rows", nm(I, i));
  return true;
}

static bool compress_format(const char *s, IrDtype *dt) {
  if (strcmp(s, "f16") == 0 || strcmp(s, "fp16") == 0) *dt = IR_F16;
  else if (strcmp(s, "bf16") == 0) *dt = IR_BF16;
  else return false;
  return true;
}

// reshape: attrs rank and d0..d{rank-1}; the element count stays the same.
// Collectives over a group of `size` ranks, along dimension 0.
static bool collective(Infer *I, IrType *out) {
  const IrOp *op = I->op;
  const IrAttr *g = ir_attrs_get(op->attrs, op->nattrs, "group");
  static const char *const groups[] = {"world", "dp", "mp", "ep", "esp"};
  bool known = false;
  for (int i = 0; g && g->kind == IR_ATTR_STR && i < 5; i++) known |= strcmp(g->s, groups[i]) == 0;
  if (!known) return fail(I, "attribute 'group' must be one of \"world\", \"dp\", \"mp\", \"ep\", \"esp\"");
  if (op->kind == IR_OP_COMM_ALLTOALL) {
    const IrAttr *a = ir_attrs_get(op->attrs, op->nattrs, "algo");
    if (!a || a->kind != IR_ATTR_STR || (strcmp(a->s, "nccl") && strcmp(a->s, "1dh") && strcmp(a->s, "2dh")))
      return fail(I, "attribute 'algo' must be \"nccl\", \"1dh\" or \"2dh\"");
  }
  int64_t n;
  if (!int_attr(I, "size", 1, &n) || !need_float(I, 0, -1, "a float tensor")) return false;
  const IrType *t = ty(I, 0);
  if (t->rank < 1) return fail(I, "%s must have at least one dimension", nm(I, 0));
  *out = *t;
  bool splits = op->kind == IR_OP_COMM_SPLIT || op->kind == IR_OP_COMM_REDUCESCATTER || op->kind == IR_OP_COMM_ALLTOALL;
  if (splits && t->dim[0] % n != 0)
    return fail(I, "dimension 0 of %s (%lld) is not a multiple of the group size %lld", nm(I, 0),
                (long long)t->dim[0], (long long)n);
  if (op->kind == IR_OP_COMM_SPLIT || op->kind == IR_OP_COMM_REDUCESCATTER) out->dim[0] = t->dim[0] / n;
  if (op->kind == IR_OP_COMM_ALLGATHER) out->dim[0] = t->dim[0] * n;
  return true;
}

static bool reshape(Infer *I, IrType *out) {
  int64_t rank;
  if (!int_attr(I, "rank", 0, &rank)) return false;
  if (rank > IR_MAX_RANK) return fail(I, "attribute 'rank' must be at most %d, got %lld", IR_MAX_RANK, (long long)rank);
  *out = (IrType){.dtype = ty(I, 0)->dtype, .rank = (int)rank};
  int64_t numel = 1;
  for (int d = 0; d < rank; d++) {
    char key[4] = {'d', (char)('0' + d), 0};
    if (!int_attr(I, key, 0, &out->dim[d])) return false;
    if (__builtin_mul_overflow(numel, out->dim[d], &numel)) return fail(I, "the new shape is too large");
  }
  if (numel != ir_type_numel(ty(I, 0))) {
    char want[128];
    ir_type_str(out, want, sizeof want);
    return fail(I, "cannot reshape %s to %s: %lld elements vs %lld", nm(I, 0), want,
                (long long)ir_type_numel(ty(I, 0)), (long long)numel);
  }
  return true;
}

static IrType t2(IrDtype dt, int64_t a, int64_t b) { return (IrType){.dtype = dt, .rank = 2, .dim = {a, b}}; }
static IrType t3(IrDtype dt, int64_t a, int64_t b, int64_t c) {
  return (IrType){.dtype = dt, .rank = 3, .dim = {a, b, c}};
}

// The result's byte count must fit in int64 (sizes made from attributes can be anything).
static bool fits(Infer *I, const IrType *t) {
  int64_t b = ir_dtype_size(t->dtype);
  for (int i = 0; i < t->rank; i++)
    if (__builtin_mul_overflow(b, t->dim[i], &b)) {
      char s[160];
      ir_type_str(t, s, sizeof s);
      return fail(I, "result %s is too large", s);
    }
  return true;
}

// [m,k]x[k,n] over the last two dims (dims `base`, `base+1`), ta/tb: the operand is stored
// transposed.
static bool matmul_dims(Infer *I, int base, int64_t *m, int64_t *n) {
  int ta, tb;
  if (!flag_attr(I, "ta", false, &ta) || !flag_attr(I, "tb", false, &tb)) return false;
  int64_t am = dim(I, 0, base + ta), ak = dim(I, 0, base + 1 - ta);
  int64_t bk = dim(I, 1, base + tb), bn = dim(I, 1, base + 1 - tb);
  if (ak != bk)
    return fail(I, "inner dimensions differ: %s has k = %lld%s but %s has k = %lld%s", nm(I, 0),
                (long long)ak, ta ? " (ta=1)" : "", nm(I, 1), (long long)bk, tb ? " (tb=1)" : "");
  *m = am;
  *n = bn;
  return true;
}

static bool valid_type(const IrType *t) {
  if ((unsigned)t->dtype >= IR_DTYPE_COUNT || t->rank < 0 || t->rank > IR_MAX_RANK) return false;
  for (int i = 0; i < t->rank; i++)
    if (t->dim[i] < 0) return false;
  return true;
}

// ---- the SHAPE column of ops.def ----
// "f[r,n], f[n] -> =0": see the column's description in ops.def. A term is one operand or the
// result; dims are words bound at their first use.

typedef struct ShapeTerm {
  int same_as;                      // =N: the type of operand N; else -1
  char dtype[4];                    // "f" (any float), "f32", "i32", "i8"
  bool any;                         // *: any shape
  int rank;
  char dims[IR_MAX_RANK][8];
  char text[48];                    // "[r, n]" for messages
} ShapeTerm;

typedef struct ShapeDim { char name[8]; int operand, dim; } ShapeDim;

static const char *skip_spaces(const char *s) {
  while (*s == ' ') s++;
  return s;
}

// Parses one term at s; NULL when it is malformed.
static const char *shape_term(const char *s, ShapeTerm *t) {
  *t = (ShapeTerm){.same_as = -1};
  s = skip_spaces(s);
  if (*s == '=') {
    if (s[1] < '0' || s[1] > '9') return NULL;
    t->same_as = s[1] - '0';
    return s + 2;
  }
  size_t n = strspn(s, "fi0123456789");
  if (n == 0 || n >= sizeof t->dtype) return NULL;
  memcpy(t->dtype, s, n);
  if (strcmp(t->dtype, "f") && strcmp(t->dtype, "f32") && strcmp(t->dtype, "i32") && strcmp(t->dtype, "i8")) return NULL;
  s += n;
  if (*s == '*') {
    t->any = true;
    snprintf(t->text, sizeof t->text, "a tensor");
    return s + 1;
  }
  if (*s++ != '[') return NULL;
  int o = snprintf(t->text, sizeof t->text, "[");
  for (s = skip_spaces(s); *s != ']';) {
    size_t w = strspn(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_");
    if (w == 0 || w >= sizeof t->dims[0] || t->rank == IR_MAX_RANK) return NULL;
    memcpy(t->dims[t->rank], s, w);
    o += snprintf(t->text + o, sizeof t->text - (size_t)o, "%s%s", t->rank ? ", " : "", t->dims[t->rank]);
    t->rank++;
    s = skip_spaces(s + w);
    if (*s == ',') s = skip_spaces(s + 1);
    else if (*s != ']') return NULL;
  }
  snprintf(t->text + o, sizeof t->text - (size_t)o, "]");
  return s + 1;
}

// The dim named name among the bound ones, or NULL.
static const ShapeDim *bound(const ShapeDim *dims, int n, const char *name) {
  for (int i = 0; i < n; i++)
    if (strcmp(dims[i].name, name) == 0) return &dims[i];
  return NULL;
}

// Checks operand i against term t, binding its dims.
static bool shape_operand(Infer *I, int i, const ShapeTerm *t, int *first_float, ShapeDim *dims, int *ndims) {
  if (t->same_as >= 0) return same_type(I, t->same_as, i);
  bool is_f = t->dtype[0] == 'f';
  if (is_f) {
    if (!need_float(I, i, t->any ? -1 : t->rank, t->any ? "a float tensor" : t->text)) return false;
    if (strcmp(t->dtype, "f32") == 0 && ty(I, i)->dtype != IR_F32) return fail(I, "%s must be f32", nm(I, i));
    if (*first_float >= 0 && !same_dtype(I, *first_float, i)) return false;
    if (*first_float < 0) *first_float = i;
  } else {
    IrDtype want = strcmp(t->dtype, "i8") == 0 ? IR_I8 : IR_I32;
    if (!t->any && ty(I, i)->rank != t->rank) return fail(I, "%s must have rank %d (%s)", nm(I, i), t->rank, t->text);
    if (ty(I, i)->dtype != want) return fail(I, "%s must be %s (%s)", nm(I, i), ir_dtype_name(want), t->text);
  }
  for (int d = 0; d < t->rank && !t->any; d++) {
    const ShapeDim *b = bound(dims, *ndims, t->dims[d]);
    if (b && !same_dim(I, t->dims[d], b->operand, b->dim, i, d)) return false;
    if (!b) {
      ShapeDim *nb = &dims[(*ndims)++];
      memcpy(nb->name, t->dims[d], sizeof nb->name);
      nb->operand = i;
      nb->dim = d;
    }
  }
  return true;
}

static bool shape_by_rule(Infer *I, const char *rule, IrType *out) {
  ShapeTerm t;
  ShapeDim dims[IR_MAX_ARGS * IR_MAX_RANK];
  int ndims = 0, first_float = -1;
  const char *s = rule;
  for (int i = 0; i < I->op->nargs; i++) {
    if (!(s = shape_term(s, &t))) goto bad;
    if (!shape_operand(I, i, &t, &first_float, dims, &ndims)) return false;
    s = skip_spaces(s);
    if (*s == ',') s++;
  }
  if (strncmp(skip_spaces(s), "->", 2) != 0 || !(s = shape_term(skip_spaces(s) + 2, &t)) || t.any) goto bad;
  if (t.same_as >= 0) {
    *out = *ty(I, t.same_as);
    return true;
  }
  out->dtype = strcmp(t.dtype, "i32") == 0 ? IR_I32 : strcmp(t.dtype, "i8") == 0 ? IR_I8
             : strcmp(t.dtype, "f") == 0 && first_float >= 0 ? ty(I, first_float)->dtype : IR_F32;
  out->rank = t.rank;
  for (int d = 0; d < t.rank; d++) {
    const ShapeDim *b = bound(dims, ndims, t.dims[d]);
    if (!b) goto bad;
    out->dim[d] = dim(I, b->operand, b->dim);
  }
  return fits(I, out);
bad:
  return fail(I, "the shape rule \"%s\" of ops.def is malformed", rule);
}

bool ir_shape_rule_check(const char *rule, int nargs, char *why, size_t size) {
  ShapeTerm t;
  const char *s = rule;
  char bound_names[IR_MAX_ARGS * IR_MAX_RANK][8];
  int nbound = 0;
  for (int i = 0; i < nargs; i++) {
    if (!(s = shape_term(s, &t))) return snprintf(why, size, "operand %d does not parse", i), false;
    if (t.same_as >= i) return snprintf(why, size, "operand %d refers to operand %d, not an earlier one", i, t.same_as), false;
    for (int d = 0; d < t.rank && !t.any; d++) memcpy(bound_names[nbound++], t.dims[d], 8);
    s = skip_spaces(s);
    if (i + 1 < nargs && *s++ != ',') return snprintf(why, size, "a ',' should follow operand %d", i), false;
  }
  s = skip_spaces(s);
  if (strncmp(s, "->", 2) != 0) return snprintf(why, size, "'->' should follow the %d operands", nargs), false;
  if (!(s = shape_term(s + 2, &t)) || t.any || *skip_spaces(s)) return snprintf(why, size, "the result does not parse"), false;
  if (t.same_as >= nargs) return snprintf(why, size, "the result refers to operand %d of %d", t.same_as, nargs), false;
  for (int d = 0; d < t.rank; d++) {
    bool found = false;
    for (int b = 0; b < nbound; b++) found |= strcmp(bound_names[b], t.dims[d]) == 0;
    if (!found) return snprintf(why, size, "the result's dim '%s' is not an operand's", t.dims[d]), false;
  }
  return true;
}

// The attributes of the ops whose operands a SHAPE rule of ops.def checks (the rule language
// does not read attributes): their types, ranges, and the dims they must divide.
static bool rule_attrs(Infer *I) {
  int64_t groups, layer;
  int renorm;
  switch (I->op->kind) {
  case IR_OP_GATE_NOISE:
    return num_attr(I, "sigma", true) && int_attr(I, "layer", 0, &layer);
  case IR_OP_GATE_SOFTMAX_TOKENS:
  case IR_OP_GATE_SOFTMAX_TOKENS_GRAD:
    return groups_attr(I, dim(I, 0, 0), &groups);
  case IR_OP_GATE_GATHER:
    return flag_attr(I, "renorm", true, &renorm) && num_attr(I, "scale", false);
  case IR_OP_GATE_AUX_LOSS:
  case IR_OP_GATE_AUX_LOSS_GRAD:
    return groups_attr(I, dim(I, 0, 0), &groups) && num_attr(I, "coef", true) && flag_attr(I, "sequence", false, &renorm);
  case IR_OP_GATE_Z_LOSS:
  case IR_OP_GATE_Z_LOSS_GRAD:
    return groups_attr(I, dim(I, 0, 0), &groups) && num_attr(I, "coef", true);
  case IR_OP_ATTN_SINK_GRAD:
    if (dim(I, 0, 1) != 2 * dim(I, 1, 0))
      return fail(I, "%s must be [S, %lld] (the statistics of attn.sink.stats for %lld heads)", nm(I, 0),
                  (long long)(2 * dim(I, 1, 0)), (long long)dim(I, 1, 0));
    return true;
  default:
    return true;
  }
}

// attn.causal (attn.sink) and its backward: q [S, H*d], k and v [S, KV*d] (stats: k only); attn.sink's
// and its stats' last operand the sinks [H].
static bool infer_attention(Infer *I, IrType *out) {
  int64_t h, kv, seq;
  IrOpKind kind = I->op->kind;
  bool sink = kind == IR_OP_ATTN_SINK || kind == IR_OP_ATTN_SINK_STATS;
  bool fwd = kind == IR_OP_ATTN_CAUSAL || kind == IR_OP_ATTN_SINK;
  bool stats = kind == IR_OP_ATTN_CAUSAL_STATS || kind == IR_OP_ATTN_SINK_STATS;
  int q = fwd ? 0 : 1, nkv = stats ? 1 : 2;
  if (!int_attr(I, "heads", 1, &h) || !int_attr(I, "kv_heads", 1, &kv) || !int_attr(I, "seq", 1, &seq)) return false;
  int64_t window;   // optional: keys i - window < j <= i
  if (ir_attrs_get(I->op->attrs, I->op->nattrs, "window") && !int_attr(I, "window", 1, &window)) return false;
  if (!num_attr(I, "scale", false)) return false;   // optional: the scores' factor, 1/sqrt(d) by default
  int nmat = I->op->nargs - (sink ? 1 : 0);
  for (int i = 0; i < nmat; i++)
    if (!need_float(I, i, 2, "[S, n]")) return false;
  if (sink && !need_float(I, nmat, 1, "[H]")) return false;
  if (sink && dim(I, nmat, 0) != h)
    return fail(I, "%s must be [%lld] (a sink logit per head)", nm(I, nmat), (long long)h);
  int64_t S = dim(I, q, 0), d = dim(I, q, 1) / h;
  if (h % kv != 0 || dim(I, q, 1) % h != 0 || S % seq != 0)
    return fail(I, "%s: %lld rows and %lld columns are not windows of seq=%lld with heads=%lld (a multiple of "
                "kv_heads=%lld)", nm(I, q), (long long)S, (long long)dim(I, q, 1), (long long)seq, (long long)h, (long long)kv);
  for (int i = q + 1; i < q + 1 + nkv; i++)
    if (dim(I, i, 0) != S || dim(I, i, 1) != kv * d)
      return fail(I, "%s must be [%lld, %lld] (kv_heads=%lld heads of %lld)", nm(I, i), (long long)S,
                  (long long)(kv * d), (long long)kv, (long long)d);
  if (stats && (!same_type(I, 0, 1) || !same_type(I, 0, 3))) return false;
  if (kind == IR_OP_ATTN_CAUSAL_GRAD && (!same_type(I, 0, 1) || dim(I, 4, 0) != S || dim(I, 4, 1) != 2 * h))
    return fail(I, "%s must be [%lld, %lld] (the statistics of attn.causal.stats)", nm(I, 4), (long long)S, (long long)(2 * h));
  *out = t2(IR_F32, S, fwd ? h * d : stats ? 2 * h : (h + 2 * kv) * d);
  return true;
}

// The cross-entropy over a vocabulary split over MP: each row's statistics, the loss from the
// parts' statistics gathered, its gradient of the rank's columns.
static bool infer_xent_vp(Infer *I, IrType *out) {
  const IrOp *op = I->op;
  switch (op->kind) {
  case IR_OP_LOSS_XENT_STATS:   // (logits [t, v], targets i32[t]) -> f32[t, 3]
    if (!need_float(I, 0, 2, "[t, v]") || !need_i32(I, 1, 1, "[t]") || !same_dim(I, "t", 0, 0, 1, 0)) return false;
    *out = t2(IR_F32, dim(I, 0, 0), 3);
    return true;
  case IR_OP_LOSS_XENT_VP:      // (stats [parts*t, 3]) -> f32[]
  case IR_OP_LOSS_XENT_VP_GRAD: {   // (logits [t, v], targets i32[t], stats [parts*t, 3]) -> [t, v]
    int64_t parts;
    int s = op->kind == IR_OP_LOSS_XENT_VP ? 0 : 2;
    if (!int_attr(I, "parts", 1, &parts) || !num_attr(I, "scale", false) || !need_float(I, s, 2, "[parts*t, 3]"))
      return false;
    if (dim(I, s, 1) != 3 || dim(I, s, 0) % parts != 0)
      return fail(I, "%s must be [parts*t, 3] (every part's loss.xent.stats), parts=%lld", nm(I, s), (long long)parts);
    if (op->kind == IR_OP_LOSS_XENT_VP) {
      *out = (IrType){.dtype = IR_F32, .rank = 0};
      return true;
    }
    if (!need_float(I, 0, 2, "[t, v]") || !need_i32(I, 1, 1, "[t]") || !same_dim(I, "t", 0, 0, 1, 0)) return false;
    if (dim(I, 2, 0) != parts * dim(I, 0, 0))
      return fail(I, "%s has %lld rows: parts=%lld times the %lld rows of %s", nm(I, 2), (long long)dim(I, 2, 0),
                  (long long)parts, (long long)dim(I, 0, 0), nm(I, 0));
    *out = *ty(I, 0);
    return true;
  }
  default:
    UNREACHABLE();
  }
}

// Dense algebra and the language model's row ops: matmuls, reshape, column slices, row scales,
// positions, rotary embeddings.
static bool infer_dense(Infer *I, IrType *out) {
  const IrOp *op = I->op;
  int64_t m, n;
  switch (op->kind) {
  case IR_OP_MATMUL:
    if (!need_float(I, 0, 2, "[m, k]") || !need_float(I, 1, 2, "[k, n]") || !same_dtype(I, 0, 1) ||
        !matmul_dims(I, 0, &m, &n))
      return false;
    *out = t2(ty(I, 0)->dtype, m, n);
    return true;
  case IR_OP_EXPERT_MATMUL:
    if (!need_float(I, 0, 3, "[E, m, k]") || !need_float(I, 1, 3, "[E, k, n]") || !same_dtype(I, 0, 1) ||
        !same_dim(I, "E", 0, 0, 1, 0) || !matmul_dims(I, 1, &m, &n))
      return false;
    *out = t3(ty(I, 0)->dtype, dim(I, 0, 0), m, n);
    return true;
  case IR_OP_RESHAPE:
    return reshape(I, out);
  case IR_OP_COLS_SLICE: {
    int64_t off, width;
    if (!need_float(I, 0, 2, "[r, n]") || !int_attr(I, "offset", 0, &off) || !int_attr(I, "width", 1, &width)) return false;
    if (off + width > dim(I, 0, 1))
      return fail(I, "%s has %lld columns; columns [%lld, %lld) do not exist", nm(I, 0), (long long)dim(I, 0, 1),
                  (long long)off, (long long)(off + width));
    *out = t2(IR_F32, dim(I, 0, 0), width);
    return true;
  }
  case IR_OP_HEADS_SLICE:   // x [r, heads*d] -> [r, heads*width]
  case IR_OP_HEADS_PLACE:   // x [r, heads*width] -> [r, heads*d]
  case IR_OP_HEADS_SUM: {   // x [r, heads*w] -> [r, w]
    int64_t heads, off = 0, width = 0, d = 0;
    if (!need_float(I, 0, 2, "[r, heads*n]") || !int_attr(I, "heads", 1, &heads)) return false;
    if (dim(I, 0, 1) % heads != 0)
      return fail(I, "%s has %lld columns, not heads=%lld heads of one width", nm(I, 0), (long long)dim(I, 0, 1),
                  (long long)heads);
    int64_t w = dim(I, 0, 1) / heads;
    if (op->kind == IR_OP_HEADS_SUM) {
      *out = t2(ty(I, 0)->dtype, dim(I, 0, 0), w);
      return true;
    }
    if (!int_attr(I, "offset", 0, &off) || !int_attr(I, "width", 1, &width)) return false;
    if (op->kind == IR_OP_HEADS_PLACE && !int_attr(I, "d", 1, &d)) return false;
    if (op->kind == IR_OP_HEADS_PLACE && width != w)
      return fail(I, "%s's heads are %lld wide, not width=%lld", nm(I, 0), (long long)w, (long long)width);
    int64_t head = op->kind == IR_OP_HEADS_SLICE ? w : d;
    if (off + width > head)
      return fail(I, "columns [%lld, %lld) are not inside a head of %lld", (long long)off, (long long)(off + width),
                  (long long)head);
    *out = t2(ty(I, 0)->dtype, dim(I, 0, 0), heads * (op->kind == IR_OP_HEADS_SLICE ? width : d));
    return true;
  }
  case IR_OP_HEADS_CAT: {   // (a [r, a_heads*wa], b [r, heads*wb]) -> [r, heads*(wa+wb)]
    int64_t heads, ah;
    if (!need_float(I, 0, 2, "[r, a_heads*wa]") || !need_float(I, 1, 2, "[r, heads*wb]") || !same_dtype(I, 0, 1) ||
        !same_dim(I, "r", 0, 0, 1, 0) || !int_attr(I, "heads", 1, &heads) || !int_attr(I, "a_heads", 1, &ah))
      return false;
    if (ah != 1 && ah != heads) return fail(I, "a_heads=%lld must be 1 or heads=%lld", (long long)ah, (long long)heads);
    if (dim(I, 0, 1) % ah != 0 || dim(I, 1, 1) % heads != 0)
      return fail(I, "%s or %s does not split into its heads", nm(I, 0), nm(I, 1));
    *out = t2(ty(I, 0)->dtype, dim(I, 0, 0), heads * (dim(I, 0, 1) / ah + dim(I, 1, 1) / heads));
    return true;
  }
  case IR_OP_SCALE_ROWS:           // (x [r, n], g [r, 1]) -> [r, n]
  case IR_OP_SCALE_ROWS_GRAD_G:    // (dy [r, n], x [r, n]) -> [r, 1]
    if (!need_float(I, 0, 2, "[r, n]")) return false;
    if (op->kind == IR_OP_SCALE_ROWS_GRAD_G) {
      if (!same_type(I, 0, 1)) return false;
      *out = t2(ty(I, 0)->dtype, dim(I, 0, 0), 1);
      return true;
    }
    if (!need_float(I, 1, 2, "[r, 1]") || !same_dtype(I, 0, 1) || !same_dim(I, "r", 0, 0, 1, 0)) return false;
    if (dim(I, 1, 1) != 1) return fail(I, "%s must be one column [r, 1]: a factor per row", nm(I, 1));
    *out = *ty(I, 0);
    return true;
  case IR_OP_POS_ADD_GRAD_W: {  // dy [r, n] -> [seq, n]
    int64_t seq;
    if (!need_float(I, 0, 2, "[r, n]") || !int_attr(I, "seq", 1, &seq)) return false;
    if (dim(I, 0, 0) % seq != 0)
      return fail(I, "%s: %lld rows are not whole windows of seq=%lld", nm(I, 0), (long long)dim(I, 0, 0), (long long)seq);
    *out = t2(IR_F32, seq, dim(I, 0, 1));
    return true;
  }
  case IR_OP_ROPE:
  case IR_OP_ROPE_GRAD: {  // x [r, heads*d], d even
    int64_t heads, seq;
    if (!need_float(I, 0, 2, "[r, heads*d]") || !int_attr(I, "heads", 1, &heads) || !int_attr(I, "seq", 1, &seq) ||
        !num_attr(I, "theta", true))
      return false;
    if (dim(I, 0, 1) % heads != 0 || (dim(I, 0, 1) / heads) % 2 != 0)
      return fail(I, "%s: %lld columns are not heads=%lld heads of an even size", nm(I, 0), (long long)dim(I, 0, 1),
                  (long long)heads);
    int64_t rotary = ir_op_int(I->op, "rotary", 0);
    if (rotary < 0 || rotary % 2 != 0 || rotary > dim(I, 0, 1) / heads)
      return fail(I, "rotary=%lld must be an even number of columns of a head of %lld (0: all)", (long long)rotary,
                  (long long)(dim(I, 0, 1) / heads));
    *out = *ty(I, 0);
    return true;
  }
  default:
    UNREACHABLE();
  }
}

// The gate ops whose result an attribute sizes or that read pooled statistics (the others are
// SHAPE rules of ops.def, their attributes checked by rule_attrs).
static bool infer_gate(Infer *I, IrType *out) {
  const IrOp *op = I->op;
  int64_t S, K, E, C;
  int flag;
  switch (op->kind) {
  case IR_OP_GATE_EXPERT_CHOICE:  // (scores [S,E]) -> loc i32[S,E]
    if (!need_float(I, 0, 2, "[S, E]") || !route_attrs(I, dim(I, 0, 0), &E, &C)) return false;
    if (dim(I, 0, 1) != E)
      return fail(I, "%s has E = %lld but experts=%lld", nm(I, 0), (long long)dim(I, 0, 1), (long long)E);
    *out = t2(IR_I32, dim(I, 0, 0), E);
    return true;
  case IR_OP_GATE_TOPK:
  case IR_OP_GATE_TOPK_BIAS:
    if (!need_float(I, 0, 2, "[S, E]") || !int_attr(I, "k", 1, &K)) return false;
    if (op->kind == IR_OP_GATE_TOPK_BIAS && (!need_float(I, 1, 1, "[E]") || !same_dtype(I, 0, 1) ||
                                             !same_dim(I, "E", 0, 1, 1, 0)))
      return false;
    if (K > dim(I, 0, 1))
      return fail(I, "k = %lld exceeds the E = %lld experts of %s", (long long)K, (long long)dim(I, 0, 1),
                  nm(I, 0));
    if (!expert_groups_attrs(I, dim(I, 0, 1), K)) return false;
    *out = t2(IR_I32, dim(I, 0, 0), K);
    return true;
  case IR_OP_GATE_BALANCE_LOAD:
    if (!need_i32(I, 0, 2, "[S, K]") || !int_attr(I, "experts", 1, &E)) return false;
    if (dim(I, 0, 1) > E)
      return fail(I, "%s has K = %lld choices per token but there are only experts=%lld", nm(I, 0),
                  (long long)dim(I, 0, 1), (long long)E);
    *out = (IrType){.dtype = IR_F32, .rank = 1, .dim = {E}};
    return true;
  case IR_OP_GATE_GATHER_GRAD:
    if (!need_float(I, 0, 2, "[S, K]") || !need_float(I, 1, 2, "[S, E]") || !need_i32(I, 2, 2, "[S, K]") ||
        !same_dtype(I, 0, 1) || !same_dim(I, "S", 0, 0, 1, 0) || !same_dim(I, "S", 0, 0, 2, 0) ||
        !same_dim(I, "K", 0, 1, 2, 1) || !flag_attr(I, "renorm", true, &flag) || !num_attr(I, "scale", false))
      return false;
    *out = *ty(I, 1);
    return true;
  case IR_OP_GATE_LOCATIONS:
    if (!need_i32(I, 0, 2, "[S, K]")) return false;
    S = dim(I, 0, 0);
    if (!route_attrs(I, S, &E, &C)) return false;
    if (dim(I, 0, 1) > E)
      return fail(I, "%s has K = %lld choices per token but there are only experts=%lld", nm(I, 0),
                  (long long)dim(I, 0, 1), (long long)E);
    *out = *ty(I, 0);
    return true;
  case IR_OP_GATE_AUX_POOLED:
    if (!need_float(I, 0, 2, "[S, E]") || !need_i32(I, 1, 2, "[S, K]") || !same_dim(I, "S", 0, 0, 1, 0) ||
        !num_attr(I, "coef", true))
      return false;
    *out = (IrType){.dtype = IR_F32, .rank = 2, .dim = {2, dim(I, 0, 1)}};
    return true;
  case IR_OP_GATE_AUX_POOLED_GRAD:
    if (!need_float(I, 0, 2, "[S, E]") || !need_float(I, 1, 2, "[2, E]") || !num_attr(I, "coef", true))
      return false;
    if (dim(I, 1, 0) != 2 || dim(I, 1, 1) != dim(I, 0, 1))
      return fail(I, "%s must be [2, %lld] (the pooled statistics of %s)", nm(I, 1), (long long)dim(I, 0, 1), nm(I, 0));
    *out = *ty(I, 0);
    return true;
  default:
    UNREACHABLE();
  }
}

// The order ops: tokens [S, M] to and from the dispatched [E, C, M] buffers, by the routing
// pair idx, loc [S, K].
static bool infer_order(Infer *I, IrType *out) {
  const IrOp *op = I->op;
  int64_t S, K, E, C, n;
  switch (op->kind) {
  case IR_OP_ORDER_ENCODE:  // (x [S,M], idx, loc) -> [E, C, M]
    if (!need_float(I, 0, 2, "[S, M]") || !route_attrs(I, dim(I, 0, 0), &E, &C) ||
        !routing_pair(I, 1, 2, E, &S, &K) || !same_dim(I, "S", 0, 0, 1, 0))
      return false;
    *out = t3(ty(I, 0)->dtype, E, C, dim(I, 0, 1));
    return fits(I, out);
  case IR_OP_ORDER_ENCODE_GRAD:  // (ddisp [E,C,M], idx, loc) -> [S, M]
    if (!need_i32(I, 1, 2, "[S, K]") || !route_attrs(I, dim(I, 1, 0), &E, &C) ||
        !routing_pair(I, 1, 2, E, &S, &K) || !dispatched(I, 0, E, C))
      return false;
    *out = t2(ty(I, 0)->dtype, S, dim(I, 0, 2));
    return true;
  case IR_OP_ORDER_DECODE:  // (y [E,C,M], idx, loc, gates [S,K]) -> [S, M]
    if (!need_i32(I, 1, 2, "[S, K]") || !route_attrs(I, dim(I, 1, 0), &E, &C) ||
        !routing_pair(I, 1, 2, E, &S, &K) || !dispatched(I, 0, E, C) || !need_float(I, 3, 2, "[S, K]") ||
        !same_dim(I, "S", 1, 0, 3, 0) || !same_dim(I, "K", 1, 1, 3, 1))
      return false;
    *out = t2(ty(I, 0)->dtype, S, dim(I, 0, 2));
    return true;
  case IR_OP_ORDER_DECODE_GRAD_Y:  // (dout [S,M], idx, loc, gates [S,K]) -> [E, C, M]
    if (!need_float(I, 0, 2, "[S, M]") || !route_attrs(I, dim(I, 0, 0), &E, &C) ||
        !routing_pair(I, 1, 2, E, &S, &K) || !same_dim(I, "S", 0, 0, 1, 0) ||
        !need_float(I, 3, 2, "[S, K]") || !same_dim(I, "S", 1, 0, 3, 0) || !same_dim(I, "K", 1, 1, 3, 1))
      return false;
    *out = t3(ty(I, 0)->dtype, E, C, dim(I, 0, 1));
    return fits(I, out);
  case IR_OP_ORDER_DECODE_GRAD_G:  // (dout [S,M], y [E,C,M], idx, loc) -> [S, K]
    if (!need_float(I, 0, 2, "[S, M]") || !route_attrs(I, dim(I, 0, 0), &E, &C) ||
        !routing_pair(I, 2, 3, E, &S, &K) || !same_dim(I, "S", 0, 0, 2, 0) || !dispatched(I, 1, E, C) ||
        !same_dim(I, "M", 0, 1, 1, 2))
      return false;
    *out = t2(ty(I, 0)->dtype, S, K);
    return true;
  case IR_OP_ORDER_DISPATCH_MASK:  // (idx, loc) -> f32[S, E*C]
  case IR_OP_ORDER_COMBINE_WEIGHTS:  // (idx, loc, gates [S,K]) -> [S, E*C]
    if (!need_i32(I, 0, 2, "[S, K]") || !route_attrs(I, dim(I, 0, 0), &E, &C) ||
        !routing_pair(I, 0, 1, E, &S, &K) || !slots_of(I, E, C, &n))
      return false;
    if (op->kind == IR_OP_ORDER_DISPATCH_MASK) {
      *out = t2(IR_F32, S, n);
      return fits(I, out);
    }
    if (!need_float(I, 2, 2, "[S, K]") || !same_dim(I, "S", 0, 0, 2, 0) || !same_dim(I, "K", 0, 1, 2, 1))
      return false;
    *out = t2(ty(I, 2)->dtype, S, n);
    return fits(I, out);
  case IR_OP_ORDER_COMBINE_WEIGHTS_GRAD:  // (dcw [S, E*C], idx, loc) -> [S, K]
    if (!need_i32(I, 1, 2, "[S, K]") || !route_attrs(I, dim(I, 1, 0), &E, &C) ||
        !routing_pair(I, 1, 2, E, &S, &K) || !slots_of(I, E, C, &n) || !need_float(I, 0, 2, "[S, E*C]") ||
        !same_dim(I, "S", 0, 0, 1, 0))
      return false;
    if (dim(I, 0, 1) != n)
      return fail(I, "%s has %lld columns but experts*groups*capacity = %lld", nm(I, 0),
                  (long long)dim(I, 0, 1), (long long)n);
    *out = t2(ty(I, 0)->dtype, S, K);
    return true;
  default:
    UNREACHABLE();
  }
}

// The hook ops: compression of the AlltoAll payload and the recording hook.
static bool infer_hook(Infer *I, IrType *out) {
  const IrOp *op = I->op;
  int64_t m;
  switch (op->kind) {
  case IR_OP_HOOK_COMPRESS: {
    if (ty(I, 0)->dtype != IR_F32) return fail(I, "%s must be f32", nm(I, 0));
    const IrAttr *a = ir_attrs_get(op->attrs, op->nattrs, "format");
    if (!a) return fail(I, "missing attribute 'format'");
    IrDtype dt;
    if (a->kind != IR_ATTR_STR || !compress_format(a->s, &dt))
      return fail(I, "attribute 'format' must be \"f16\" or \"bf16\"");
    *out = *ty(I, 0);
    out->dtype = dt;
    return true;
  }
  case IR_OP_HOOK_DECOMPRESS:
    if (ty(I, 0)->dtype != IR_F16 && ty(I, 0)->dtype != IR_BF16) return fail(I, "%s must be f16 or bf16", nm(I, 0));
    *out = *ty(I, 0);
    out->dtype = IR_F32;
    return true;
  case IR_OP_HOOK_SCALES:  // x [..., n] -> f32[rows]
    if (!need_float(I, 0, -1, "[..., n]") || !rows_of(I, 0, &m)) return false;
    *out = (IrType){.dtype = IR_F32, .rank = 1, .dim = {m}};
    return true;
  case IR_OP_HOOK_COMPRESS_INT8:  // (x, scales) -> i8 like x
  case IR_OP_HOOK_DECOMPRESS_INT8:  // (q, scales) -> f32 like q
    if (op->kind == IR_OP_HOOK_COMPRESS_INT8 && !need_float(I, 0, -1, "a float tensor")) return false;
    if (op->kind == IR_OP_HOOK_DECOMPRESS_INT8 && ty(I, 0)->dtype != IR_I8)
      return fail(I, "%s must be i8", nm(I, 0));
    if (!rows_of(I, 0, &m)) return false;
    if (ty(I, 1)->dtype != IR_F32 || ty(I, 1)->rank != 1 || dim(I, 1, 0) != m)
      return fail(I, "the scales %s must be f32[%lld], one per row of %s", nm(I, 1), (long long)m, nm(I, 0));
    *out = *ty(I, 0);
    out->dtype = op->kind == IR_OP_HOOK_COMPRESS_INT8 ? IR_I8 : IR_F32;
    return true;
  case IR_OP_HOOK_RECORD:
    if (!ir_attrs_get(op->attrs, op->nattrs, "point")) return fail(I, "missing attribute 'point'");
    if (!int_attr(I, "layer", 0, &m)) return false;
    *out = (IrType){0};
    return true;
  default:
    UNREACHABLE();
  }
}

// The layout ops: expert-major <-> rank-major and the chunks of passes/schedule.c.
static bool infer_layout(Infer *I, IrType *out) {
  const IrOp *op = I->op;
  switch (op->kind) {
  case IR_OP_LAYOUT_EXPERT_MAJOR:
  case IR_OP_LAYOUT_RANK_MAJOR: {
    int64_t R;
    if (!need_float(I, 0, 3, "[blocks*El, C, M] or [El, blocks*C, M]") || !int_attr(I, "blocks", 1, &R)) return false;
    *out = *ty(I, 0);
    bool to_expert = op->kind == IR_OP_LAYOUT_EXPERT_MAJOR;
    int64_t split = to_expert ? dim(I, 0, 0) : dim(I, 0, 1);
    if (split % R != 0)
      return fail(I, "dimension %d of %s (%lld) is not a multiple of blocks = %lld", to_expert ? 0 : 1, nm(I, 0),
                  (long long)split, (long long)R);
    out->dim[0] = to_expert ? dim(I, 0, 0) / R : dim(I, 0, 0) * R;
    out->dim[1] = to_expert ? dim(I, 0, 1) * R : dim(I, 0, 1) / R;
    return true;
  }
  case IR_OP_LAYOUT_CHUNK: {  // chunked execution (passes/schedule.c): slices of dim 1
    // x [A, blocks*rows, ...]: chunk `index` of `chunks` holds rows [index*rows/chunks,
    // (index+1)*rows/chunks) (floor division) of every block, so the chunks of one split differ
    // by at most one row and none is empty (chunks <= rows).
    int64_t chunks, index, blocks = 1;
    if (!int_attr(I, "chunks", 1, &chunks) || !int_attr(I, "index", 0, &index)) return false;
    if (ir_attrs_get(op->attrs, op->nattrs, "blocks") && !int_attr(I, "blocks", 1, &blocks)) return false;
    if (ty(I, 0)->rank < 2) return fail(I, "%s must have rank 2 or more", nm(I, 0));
    if (index >= chunks) return fail(I, "index %lld is not below chunks = %lld", (long long)index, (long long)chunks);
    if (dim(I, 0, 1) % blocks != 0)
      return fail(I, "dimension 1 of %s (%lld) is not a multiple of blocks = %lld", nm(I, 0), (long long)dim(I, 0, 1),
                  (long long)blocks);
    int64_t rows = dim(I, 0, 1) / blocks, span;
    if (chunks > rows)
      return fail(I, "chunks = %lld is above the %lld rows per block of %s", (long long)chunks, (long long)rows, nm(I, 0));
    if (__builtin_mul_overflow(chunks, rows, &span)) return fail(I, "chunks*rows overflows");
    *out = *ty(I, 0);
    out->dim[1] = blocks * ((index + 1) * rows / chunks - index * rows / chunks);
    return true;
  }
  case IR_OP_LAYOUT_CONCAT: {
    int64_t blocks = 1;
    if (ir_attrs_get(op->attrs, op->nattrs, "blocks") && !int_attr(I, "blocks", 1, &blocks)) return false;
    if (!same_dtype(I, 0, 1)) return false;
    const IrType *a = ty(I, 0), *b = ty(I, 1);
    if (a->rank < 2 || a->rank != b->rank) return fail(I, "%s and %s must have the same rank, 2 or more", nm(I, 0), nm(I, 1));
    for (int k = 0; k < a->rank; k++)
      if (k != 1 && a->dim[k] != b->dim[k])
        return fail(I, "%s and %s differ in dimension %d", nm(I, 0), nm(I, 1), k);
    if (a->dim[1] % blocks != 0 || b->dim[1] % blocks != 0)
      return fail(I, "dimension 1 of %s and %s must be multiples of blocks = %lld", nm(I, 0), nm(I, 1), (long long)blocks);
    *out = *a;
    out->dim[1] = a->dim[1] + b->dim[1];
    return true;
  }
  default:
    UNREACHABLE();
  }
}

// The ops of the update: a parameter's gradient, its AllReduce and the optimizers (no result).
static bool infer_update(Infer *I, IrType *out) {
  const IrOp *op = I->op;
  switch (op->kind) {
  case IR_OP_PARAM_GRAD:
    if (!op->args[0].param) return fail(I, "the first operand must be a parameter (@name), not %s", nm(I, 0));
    if (!op->args[1].value) return fail(I, "the second operand must be a value (%%name), not %s", nm(I, 1));
    if (!ir_type_equal(ty(I, 0), ty(I, 1)))
      return fail(I, "the gradient %s does not have the type of %s", nm(I, 1), nm(I, 0));
    *out = (IrType){0};
    return true;
  case IR_OP_COMM_ALLREDUCE_GRAD: {
    int64_t size, offset, count;
    if (!op->args[0].param) return fail(I, "the operand must be a parameter (@name), not %s", nm(I, 0));
    if (!int_attr(I, "size", 1, &size) || !int_attr(I, "offset", 0, &offset) || !int_attr(I, "count", 1, &count))
      return false;
    if (offset + count > ir_type_numel(ty(I, 0)))
      return fail(I, "elements [%lld, %lld) are not inside %s (%lld elements)", (long long)offset,
                  (long long)(offset + count), nm(I, 0), (long long)ir_type_numel(ty(I, 0)));
    *out = (IrType){0};
    return true;
  }
  case IR_OP_OPT_BALANCE:
    if (!op->args[0].param) return fail(I, "the operand must be a parameter (@name), not %s", nm(I, 0));
    if (!num_attr(I, "rate", true)) return false;
    *out = (IrType){0};
    return true;
  case IR_OP_OPT_SGD:
  case IR_OP_OPT_ADAMW:
    if (!op->args[0].param) return fail(I, "the operand must be a parameter (@name), not %s", nm(I, 0));
    if (!num_attr(I, "lr", true) || !num_attr(I, "weight_decay", op->kind == IR_OP_OPT_ADAMW))
      return false;
    if (op->kind == IR_OP_OPT_ADAMW &&
        (!num_attr(I, "beta1", true) || !num_attr(I, "beta2", true) || !num_attr(I, "eps", true)))
      return false;
    *out = (IrType){0};
    return true;
  default:
    UNREACHABLE();
  }
}

// An op with a SHAPE rule is checked by it (then its attributes); the others by their family.
static bool infer(Infer *I, IrType *out) {
  const char *rule = ir_op_info[I->op->kind].shape;
  if (rule[0]) return shape_by_rule(I, rule, out) && rule_attrs(I);
  switch (I->op->kind) {
  case IR_OP_ATTN_CAUSAL:
  case IR_OP_ATTN_CAUSAL_STATS:
  case IR_OP_ATTN_CAUSAL_GRAD:
  case IR_OP_ATTN_SINK:
  case IR_OP_ATTN_SINK_STATS:
    return infer_attention(I, out);
  case IR_OP_MATMUL:
  case IR_OP_EXPERT_MATMUL:
  case IR_OP_RESHAPE:
  case IR_OP_COLS_SLICE:
  case IR_OP_HEADS_SLICE:
  case IR_OP_HEADS_PLACE:
  case IR_OP_HEADS_CAT:
  case IR_OP_HEADS_SUM:
  case IR_OP_SCALE_ROWS:
  case IR_OP_SCALE_ROWS_GRAD_G:
  case IR_OP_POS_ADD_GRAD_W:
  case IR_OP_ROPE:
  case IR_OP_ROPE_GRAD:
    return infer_dense(I, out);
  case IR_OP_LOSS_XENT_STATS:
  case IR_OP_LOSS_XENT_VP:
  case IR_OP_LOSS_XENT_VP_GRAD:
    return infer_xent_vp(I, out);
  case IR_OP_GATE_EXPERT_CHOICE:
  case IR_OP_GATE_TOPK:
  case IR_OP_GATE_TOPK_BIAS:
  case IR_OP_GATE_BALANCE_LOAD:
  case IR_OP_GATE_GATHER_GRAD:
  case IR_OP_GATE_LOCATIONS:
  case IR_OP_GATE_AUX_POOLED:
  case IR_OP_GATE_AUX_POOLED_GRAD:
    return infer_gate(I, out);
  case IR_OP_ORDER_ENCODE:
  case IR_OP_ORDER_ENCODE_GRAD:
  case IR_OP_ORDER_DECODE:
  case IR_OP_ORDER_DECODE_GRAD_Y:
  case IR_OP_ORDER_DECODE_GRAD_G:
  case IR_OP_ORDER_DISPATCH_MASK:
  case IR_OP_ORDER_COMBINE_WEIGHTS:
  case IR_OP_ORDER_COMBINE_WEIGHTS_GRAD:
    return infer_order(I, out);
  case IR_OP_HOOK_COMPRESS:
  case IR_OP_HOOK_DECOMPRESS:
  case IR_OP_HOOK_SCALES:
  case IR_OP_HOOK_COMPRESS_INT8:
  case IR_OP_HOOK_DECOMPRESS_INT8:
  case IR_OP_HOOK_RECORD:
    return infer_hook(I, out);
  case IR_OP_LAYOUT_EXPERT_MAJOR:
  case IR_OP_LAYOUT_RANK_MAJOR:
  case IR_OP_LAYOUT_CHUNK:
  case IR_OP_LAYOUT_CONCAT:
    return infer_layout(I, out);
  case IR_OP_PARAM_GRAD:
  case IR_OP_COMM_ALLREDUCE_GRAD:
  case IR_OP_OPT_SGD:
  case IR_OP_OPT_ADAMW:
  case IR_OP_OPT_BALANCE:
    return infer_update(I, out);
  case IR_OP_COMM_SPLIT:
  case IR_OP_COMM_COPY:
  case IR_OP_COMM_ALLGATHER:
  case IR_OP_COMM_REDUCESCATTER:
  case IR_OP_COMM_ALLTOALL:
  case IR_OP_COMM_ALLREDUCE:
    return collective(I, out);
  default:
    return fail(I, "no shape rule for this op");
  }
}

// Ops without a result (param.grad, opt.*) check their operands and give f32[] in *out.
bool ir_infer_type(IrDiag *d, const IrOp *op, IrType *out) {
  Infer I = {.d = d, .op = op};
  *out = (IrType){0};
  if ((unsigned)op->kind >= IR_OP_COUNT) return fail(&I, "invalid op kind %d", (int)op->kind);
  const IrOpInfo *info = &ir_op_info[op->kind];
  if (op->nargs != info->nargs)
    return fail(&I, "takes %d operand%s, got %d", info->nargs, info->nargs == 1 ? "" : "s", op->nargs);
  for (int i = 0; i < op->nargs; i++) {
    const IrOperand *a = &op->args[i];
    if (!a->value == !a->param) return fail(&I, "operand %d is neither a value nor a parameter", i + 1);
    const IrType *t = a->value ? &a->value->type : &a->param->type;
    char ts[128];
    ir_type_str(t, ts, sizeof ts);
    const char *name = a->value ? a->value->name : a->param->name;
    snprintf(I.names[i], sizeof I.names[i], "%c%.100s (%s)", a->value ? '%' : '@', name ? name : "?", ts);
    if (!valid_type(t)) return fail(&I, "operand %s has an invalid type", I.names[i]);
  }
  return infer(&I, out);
}
