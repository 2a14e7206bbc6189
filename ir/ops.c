// The op table and the small type helpers. ir_op_info is generated from ir/ops.def with the
// same X-macro that makes the IrOpKind enum, so a row added there shows up in the enum, the
// printer, the parser and the verifier at once.
#include <ctype.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "ir.h"

const IrOpInfo ir_op_info[IR_OP_COUNT] = {
#define IR_OP(E, N, A, R, AT, C, D, SHAPE, GRAD, KERNEL) \
  [IR_OP_##E] = {.name = N, .nargs = A, .nres = R, .attrs = AT, .cls = IR_CLASS_##C, .doc = D, .shape = SHAPE, .grad = GRAD, .kernel = KERNEL},
#include "ops.def"
#undef IR_OP
};

// The scalar expressions of ir/scalar.def by op; NULL for the ops that have none.
static const char *const op_scalar[IR_OP_COUNT] = {
#define IR_SCALAR(E, EXPR) [IR_OP_##E] = EXPR,
#include "scalar.def"
#undef IR_SCALAR
};

const char *ir_op_scalar(IrOpKind k) { return k >= 0 && k < IR_OP_COUNT ? op_scalar[k] : NULL; }

bool ir_scalar_reads_element(IrOpKind k, int operand) {
  const char *e = ir_op_scalar(k);
  if (!e) return false;
  for (const char *p = e; *p; p++) {
    bool word = p > e && (isalnum((unsigned char)p[-1]) || p[-1] == '_');
    if (*p != 'x' || word || !isdigit((unsigned char)p[1])) continue;
    char *end;
    long k2 = strtol(p + 1, &end, 10);
    if (k2 == operand && *end == '[') return false;
  }
  return true;
}

// The row-wise ops of ir/scalar.def a fused kernel can hold: their one-row function.
static const IrRowInfo op_row[IR_OP_COUNT] = {
#define IR_SCALAR(E, EXPR)
#define IR_ROW(E, FUNCTION, THREADS, EPS) [IR_OP_##E] = {FUNCTION, THREADS, EPS},
#include "scalar.def"
#undef IR_ROW
#undef IR_SCALAR
};

const IrRowInfo *ir_op_row(IrOpKind k) { return k >= 0 && k < IR_OP_COUNT && op_row[k].function ? &op_row[k] : NULL; }

// The ops of ir/scalar.def a fused kernel can start with: their storing function.
static const char *const op_store[IR_OP_COUNT] = {
#define IR_SCALAR(E, EXPR)
#define IR_STORE(E, FUNCTION, SYNCS) [IR_OP_##E] = FUNCTION,
#include "scalar.def"
#undef IR_STORE
#undef IR_SCALAR
};
static const bool op_store_syncs[IR_OP_COUNT] = {
#define IR_SCALAR(E, EXPR)
#define IR_STORE(E, FUNCTION, SYNCS) [IR_OP_##E] = SYNCS,
#include "scalar.def"
#undef IR_STORE
#undef IR_SCALAR
};

const char *ir_op_store(IrOpKind k) { return k >= 0 && k < IR_OP_COUNT ? op_store[k] : NULL; }
bool ir_op_store_syncs(IrOpKind k) { return k >= 0 && k < IR_OP_COUNT && op_store_syncs[k]; }

// The column sums of ir/scalar.def: 1 + WITH_X, 0 for other ops.
static const int op_colsum[IR_OP_COUNT] = {
#define IR_SCALAR(E, EXPR)
#define IR_COLSUM(E, WITH_X) [IR_OP_##E] = 1 + (WITH_X),
#include "scalar.def"
#undef IR_COLSUM
#undef IR_SCALAR
};

int ir_op_colsum(IrOpKind k) { return k >= 0 && k < IR_OP_COUNT ? op_colsum[k] - 1 : -1; }

// The activations of ir/activations.def.
static const IrActInfo acts[] = {
#define IR_ACT(E, NAME, ACT, MATH, RECOMPUTE, DOC, FORWARD, GRADIENT, ARGS, PARAMS) \
  {#NAME, IR_OP_ACT_##E, IR_OP_ACT_##E##_GRAD, ACT_OFFERED_##ACT, MATH, RECOMPUTE},
#define ACT_OFFERED_yes true
#define ACT_OFFERED_no false
#include "activations.def"
#undef IR_ACT
};

// The words of the rows with ACT yes: a row whose ACT is no leaves nothing in the list.
const char *const ir_act_words[] = {
#define IR_ACT(E, NAME, ACT, MATH, RECOMPUTE, DOC, FORWARD, GRADIENT, ARGS, PARAMS) ACT_WORD_##ACT(#NAME)
#define ACT_WORD_yes(w) w,
#define ACT_WORD_no(w)
#include "activations.def"
#undef IR_ACT
    NULL};

const IrActInfo *ir_act_named(const char *name) {
  for (size_t i = 0; name && i < sizeof acts / sizeof *acts; i++)
    if (acts[i].act && strcmp(acts[i].name, name) == 0) return &acts[i];
  return NULL;
}

const IrActInfo *ir_act_of(IrOpKind k) {
  for (size_t i = 0; i < sizeof acts / sizeof *acts; i++)
    if (acts[i].op == k || acts[i].grad == k) return &acts[i];
  return NULL;
}

int64_t ir_capacity_slots(int64_t k, double f, int64_t tokens, int64_t experts) {
  int64_t t = (int64_t)ceil((double)k * f * (double)tokens / (double)experts - 1e-9);
  return t < 1 ? 1 : t;
}

IrOpKind ir_op_by_name(const char *name) {
  if (!name) return IR_OP_COUNT;
  for (int k = 0; k < IR_OP_COUNT; k++)
    if (strcmp(ir_op_info[k].name, name) == 0) return (IrOpKind)k;
  return IR_OP_COUNT;
}

static const char *const dtype_names[IR_DTYPE_COUNT] = {
    [IR_F32] = "f32", [IR_BF16] = "bf16", [IR_F16] = "f16", [IR_I32] = "i32", [IR_I8] = "i8",
};
static const int dtype_sizes[IR_DTYPE_COUNT] = {
    [IR_F32] = 4, [IR_BF16] = 2, [IR_F16] = 2, [IR_I32] = 4, [IR_I8] = 1,
};

// "?" for a value outside the enum, so a corrupt type still prints (and then fails to parse).
const char *ir_dtype_name(IrDtype t) {
  return (unsigned)t < IR_DTYPE_COUNT ? dtype_names[t] : "?";
}

bool ir_dtype_by_name(const char *name, IrDtype *out) {
  if (!name) return false;
  for (int t = 0; t < IR_DTYPE_COUNT; t++)
    if (strcmp(dtype_names[t], name) == 0) {
      if (out) *out = (IrDtype)t;
      return true;
    }
  return false;
}

int ir_dtype_size(IrDtype t) { return (unsigned)t < IR_DTYPE_COUNT ? dtype_sizes[t] : 0; }

// Saturates at INT64_MAX instead of overflowing; 0 for a rank outside [0, IR_MAX_RANK] or a
// negative dim (the verifier reports those).
int64_t ir_type_numel(const IrType *t) {
  if (t->rank < 0 || t->rank > IR_MAX_RANK) return 0;
  int64_t n = 1;
  for (int i = 0; i < t->rank; i++) {
    if (t->dim[i] < 0) return 0;
    if (__builtin_mul_overflow(n, t->dim[i], &n)) return INT64_MAX;
  }
  return n;
}

int64_t ir_type_bytes(const IrType *t) {
  int64_t n = ir_type_numel(t), b;
  if (__builtin_mul_overflow(n, (int64_t)ir_dtype_size(t->dtype), &b)) return INT64_MAX;
  return b;
}

// Dims beyond the rank do not take part.
bool ir_type_equal(const IrType *a, const IrType *b) {
  if (a->dtype != b->dtype || a->rank != b->rank) return false;
  if (a->rank < 0 || a->rank > IR_MAX_RANK) return false;
  for (int i = 0; i < a->rank; i++)
    if (a->dim[i] != b->dim[i]) return false;
  return true;
}

void ir_type_str(const IrType *t, char *buf, size_t cap) {
  int n = snprintf(buf, cap, "%s[", ir_dtype_name(t->dtype));
  int rank = t->rank < 0 ? 0 : t->rank > IR_MAX_RANK ? IR_MAX_RANK : t->rank;
  for (int i = 0; i < rank && n > 0 && (size_t)n < cap; i++)
    n += snprintf(buf + n, cap - (size_t)n, "%s%lld", i ? ", " : "", (long long)t->dim[i]);
  if (n > 0 && (size_t)n < cap) snprintf(buf + n, cap - (size_t)n, "]");
}

bool ir_func_concurrent(const IrFunc *f) {
  const char *env = getenv("MOEC_STREAMS");
  if (env && strcmp(env, "0") == 0) return false;
  for (int i = 0; i < f->nops; i++)
    if (f->ops[i]->stream == IR_STREAM_INTRA || f->ops[i]->stream == IR_STREAM_INTER) return true;
  return false;
}
