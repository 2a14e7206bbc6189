// Layer 4 of codegen/ (fused-group lowering); it may call facts.c, kernels.c and lower.c (layers 1-3).
//
// The kernels of fused groups (passes/fuse.c), generated from the members' scalar expressions
// (ir/scalar.def).
//
// A group is the IR's (IrGroup, of the kinds elementwise, rows, store, colsums; the gate's chain
// and the updates are lowered by lower.c). Its kernel takes pointers only:
// first the distinct operands the members read from outside the group (values and parameters,
// in the order the members first read them), then the result of each member that leaves the
// kernel (members without `inner=1`), then with dtype bf16 the bf16 copies of the members with
// `bf16=1` (GEMM operands, rounded as mk_compress_bf16 rounds). One grid-stride loop over the elements (all members have
// results of the same number of elements) computes each member's element in program order into
// a register, `float vJ = EXPR;`, and stores the results that leave; shapes are literals. An
// operand another member made is that member's register; one from outside is loaded at the
// index its expression says (the element, its column, row, expert and column, or element 0).
// The elementwise functions are the prelude's mk_f_NAME, which the ops' own kernels call as
// well, so each element gets the float operations of the op-by-op program, in its order.
//
// Groups with the same kernel text (the same chain at the same shapes, as in every layer of a
// stack) share one kernel.
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cg_internal.h"

int cg_fused_members(const IrFunc *f, int i) {
  const IrGroup *g = ir_group_at(f, i);
  if (!g || g->first != i || g->kind == IR_GROUP_GATE || g->kind == IR_GROUP_UPDATE) return 0;
  return g->n;
}

// The member (offset from the group's first op) that makes value v, or -1.
static int member_making(const IrFunc *f, int i, int n, const IrValue *v) {
  if (!v || !v->def || v->func != f) return -1;
  int at = v->def->index - i;
  return at >= 0 && at < n ? at : -1;
}

static bool same_operand(const IrOperand *a, const IrOperand *b) { return a->value == b->value && a->param == b->param; }

// ---- the scalar expressions (ir/scalar.def), each parsed once into tokens ----
// How an operand xK[mode] is read: at the element, its column, row, expert and column, element 0,
// or a slice of a wider row.
typedef enum Mode { MODE_ELEMENT, MODE_COL, MODE_ROW, MODE_EC, MODE_ZERO, MODE_SLICE, MODE_COUNT } Mode;
static const char *const mode_names[MODE_COUNT] = {"", "c", "r", "ec", "0", "slice"};

// A token of an expression: an operand xK[mode], a name (call: a function, followed by '('), or
// a run of C arithmetic, kept as it is written.
typedef enum TokenKind { TOKEN_TEXT, TOKEN_OPERAND, TOKEN_NAME } TokenKind;
typedef struct Token {
  TokenKind kind;
  const char *s;   // TEXT, NAME: its text in the expression, len characters
  int len;
  int k;           // OPERAND
  Mode mode;
  bool call;       // NAME
} Token;

// An expression as tokens, and its function form when it has one: one call of plain operands,
// "name(xA, xB, ...)" (form: the name is tok[0]; arg: the operand numbers), which the CPU
// loops run as one rt_fv_NAME loop.
enum { MAX_TOKENS = 48, FORM_ARGS = 3 };
typedef struct Scalar {
  Token tok[MAX_TOKENS];
  int ntok;
  bool form;
  int arg[FORM_ARGS], nargs;
} Scalar;

// The token at e (an operand, a name or one character of arithmetic) into t; false (why says it)
// when it is none of them.
static bool next_token(const char *e, Token *t, char *why, size_t size) {
  *t = (Token){.kind = TOKEN_TEXT, .s = e, .len = 1};
  if (e[0] == 'x' && e[1] >= '0' && e[1] <= '9') {
    char *end;
    t->kind = TOKEN_OPERAND, t->k = (int)strtol(e + 1, &end, 10), t->len = (int)(end - e);
    if (*end != '[') return true;
    size_t len = strcspn(end + 1, "]");
    int m = 1;
    while (m < MODE_COUNT && !(strlen(mode_names[m]) == len && strncmp(mode_names[m], end + 1, len) == 0)) m++;
    if (m == MODE_COUNT || end[1 + len] != ']')
      return snprintf(why, size, "x%d[%.*s]: the index is c, r, ec, 0 or slice", t->k, (int)len, end + 1), false;
    t->mode = (Mode)m, t->len += (int)len + 2;
  } else if ((*e >= 'a' && *e <= 'z') || *e == '_') {
    t->kind = TOKEN_NAME, t->len = (int)strspn(e, "abcdefghijklmnopqrstuvwxyz_0123456789"), t->call = e[t->len] == '(';
    if (!t->call) return snprintf(why, size, "'%.*s': a name is an operand xK or a function call", t->len, e), false;
  } else if (!strchr(" +-*/()?:<>=!.,0123456789", *e)) {
    return snprintf(why, size, "'%c' is not C arithmetic", *e), false;
  }
  return true;
}

// Whether t is text of exactly the characters `what`, then any spaces (with spaces).
static bool text_is(const Token *t, const char *what, bool spaces) {
  size_t n = strlen(what);
  return t->kind == TOKEN_TEXT && (size_t)t->len >= n && strncmp(t->s, what, n) == 0 &&
         (spaces ? strspn(t->s + n, " ") >= (size_t)t->len - n : (size_t)t->len == n);
}

// The function form of s (Scalar.form, .arg), if it has one.
static void function_form(Scalar *s) {
  const Token *t = s->tok, *end = s->tok + s->ntok;
  if (s->ntok < 4 || t[0].kind != TOKEN_NAME || !text_is(&t[1], "(", false) || !text_is(end - 1, ")", false)) return;
  int n = 0;
  for (t += 2; t < end - 1; t++) {
    bool operand = (t - s->tok) % 2 == 0;   // operands at even tokens, ", " between them
    if (operand ? t->kind != TOKEN_OPERAND || t->mode != MODE_ELEMENT || n == FORM_ARGS : !text_is(t, ",", true)) return;
    if (operand) s->arg[n++] = t->k;
  }
  if ((end - 1 - s->tok) % 2 == 0) return;   // ends with ", "
  s->form = true, s->nargs = n;
}

// expr as tokens into s (runs of arithmetic joined); false (why says it) when it is not a scalar
// expression's text.
static bool scalar_parse(const char *expr, Scalar *s, char *why, size_t size) {
  memset(s, 0, sizeof *s);
  why[0] = '\0';
  for (const char *e = expr; *e;) {
    Token t;
    if (!next_token(e, &t, why, size)) return false;
    Token *last = s->ntok ? &s->tok[s->ntok - 1] : NULL;
    if (t.kind == TOKEN_TEXT && last && last->kind == TOKEN_TEXT) last->len++;
    else if (s->ntok == MAX_TOKENS) return snprintf(why, size, "more than %d tokens", MAX_TOKENS), false;
    else s->tok[s->ntok++] = t;
    e += t.len;
  }
  function_form(s);
  return true;
}

// The parsed expression of op kind (NULL: it has none), parsed the first time it is asked for.
static const Scalar *scalar_of(IrOpKind kind) {
  static Scalar parsed[IR_OP_COUNT];
  static bool done[IR_OP_COUNT];
  const char *expr = ir_op_scalar(kind);
  char why[128];
  if (!expr) return NULL;
  if (!done[kind] && !scalar_parse(expr, &parsed[kind], why, sizeof why)) UNREACHABLE();   // tests/unit checks every row
  done[kind] = true;
  return &parsed[kind];
}

// The load of external pointer p, operand k of member op, read as mode says. rows: in a loop over
// rows of the op's columns (a group over expert slots: `row` and the column `c` in scope), where
// the column, row and expert come without a division an element.
static void load(FILE *out, int p, Mode mode, const IrOp *op, int k, bool rows) {
  const IrType *rt = &op->result->type;
  int64_t cols = rt->rank ? rt->dim[rt->rank - 1] : 1, mid = rt->rank >= 2 ? rt->dim[rt->rank - 2] : 1;
  const IrType *t = cg_operand_type(&op->args[k]);
  if (rows) {
    switch (mode) {
    case MODE_COL: fprintf(out, "a%d[c]", p); return;
    case MODE_ROW: fprintf(out, "a%d[row]", p); return;
    case MODE_SLICE:
      fprintf(out, "a%d[row * %" PRId64 " + %" PRId64 " + c]", p, t->dim[t->rank - 1], ir_op_int(op, "offset", 0));
      return;
    case MODE_EC: fprintf(out, "a%d[row / %" PRId64 " * %" PRId64 " + c]", p, mid, cols); return;
    default: break;
    }
  }
  switch (mode) {
  case MODE_ELEMENT: fprintf(out, "a%d[i]", p); break;
  case MODE_COL: fprintf(out, "a%d[i %% %" PRId64 "]", p, cols); break;
  case MODE_ROW: fprintf(out, "a%d[i / %" PRId64 "]", p, cols); break;
  case MODE_ZERO: fprintf(out, "a%d[0]", p); break;
  case MODE_SLICE:
    fprintf(out, "a%d[i / %" PRId64 " * %" PRId64 " + %" PRId64 " + i %% %" PRId64 "]", p, cols, t->dim[t->rank - 1],
            ir_op_int(op, "offset", 0), cols);
    break;
  case MODE_EC: fprintf(out, "a%d[i / %" PRId64 " * %" PRId64 " + i %% %" PRId64 "]", p, mid * cols, cols, cols); break;
  default: UNREACHABLE();
  }
}

// A pointer a group's kernel takes from outside (aP): the operand, the member that reads it first
// (its offset in the group) and which of its operands it is there, and whether the kernel reads the
// value's bf16 copy (pass_reads_copy: a saved activation's).
typedef struct In {
  const IrOperand *operand;
  int op, arg;
  bool bf16;
} In;

// The outside pointer (its number P of aP) that is operand a; nin when none is.
static int pointer_of(const In *in, int nin, const IrOperand *a) {
  int p = 0;
  while (p < nin && !same_operand(in[p].operand, a)) p++;
  return p;
}

// What a group's kernel stores: the results that leave it (member numbers out[0 .. nout - 1],
// pointers oP) and the bf16 copies (dtype bf16: of GEMM operands, members copy[0 .. ncopy - 1],
// pointers hP).
typedef struct Stores {
  int out[CG_MAX_KERNEL_ARGS], nout;
  int copy[CG_MAX_KERNEL_ARGS], ncopy;
} Stores;

// Writes scalar expression s to out: each operand xK[mode] as operand(out, k, mode, ctx) writes
// it, a function name with prefix before it, the rest as it is.
typedef void OperandFn(FILE *out, int k, Mode mode, void *ctx);
static void write_expression(FILE *out, const Scalar *s, const char *prefix, OperandFn *operand, void *ctx) {
  for (const Token *t = s->tok; t < s->tok + s->ntok; t++) {
    if (t->kind == TOKEN_OPERAND) operand(out, t->k, t->mode, ctx);
    else fprintf(out, "%s%.*s", t->call ? prefix : "", t->len, t->s);
  }
}

// Where a member's operands come from: the group (ops i .. i + n - 1 of f), the member, the
// pointers from outside; for the CPU loops also the stores, the segment [m0, m1) and the row length.
typedef struct Operands {
  const IrFunc *f;
  int i, n;
  const IrOp *op;
  const In *in;
  int nin;
  const CgGuard *guard;   // CUDA: a group over expert slots (NULL: none)
  const Stores *st;
  int m0, m1;
  int64_t cols;
} Operands;

static int outside_pointer(const Operands *o, int k) { return pointer_of(o->in, o->nin, &o->op->args[k]); }

bool cg_guard_zero(const CgGuard *g, const IrValue *v) {
  for (int z = 0; g && v && z < g->nzero; z++)
    if (g->zero[z] == v) return true;
  return false;
}

static bool guard_zero(const CgGuard *g, const IrOperand *a) { return cg_guard_zero(g, a->value); }

// A CUDA operand: another member's register (its numel is the group's: every mode is the
// element), or the load of a pointer from outside.
static void cuda_operand(FILE *out, int k, Mode mode, void *ctx) {
  const Operands *o = ctx;
  int made = member_making(o->f, o->i, o->n, o->op->args[k].value);
  bool copy = pass_reads_copy(o->op, k);   // a saved activation's bf16 copy (passes/fuse.c)
  if (made >= 0) {
    fprintf(out, "v%d", made);
    return;
  }
  bool zero = guard_zero(o->guard, &o->op->args[k]);   // 0 in the rows past the counts (not loaded)
  fprintf(out, "%s%s", zero ? "(filled ? " : "", copy ? "mk_float_from_bf16(" : "");
  const IrType *rt = &o->op->result->type;   // a group over expert slots loops over rows of these columns
  bool rows = o->guard && rt->rank == 3 && rt->dim[0] * rt->dim[1] == o->guard->groups * o->guard->rows;
  load(out, outside_pointer(o, k), mode, o->op, k, rows);
  fprintf(out, "%s%s", copy ? ")" : "", zero ? " : 0.0f)" : "");
}

// The expression of member op in CUDA: operands become registers or loads, functions the
// prelude's mk_f_NAME.
static void expression(FILE *out, const IrFunc *f, int i, int n, const IrOp *op, const In *in, int nin,
                       const CgGuard *guard) {
  Operands o = {.f = f, .i = i, .n = n, .op = op, .in = in, .nin = nin, .guard = guard};
  write_expression(out, scalar_of(op->kind), "mk_f_", cuda_operand, &o);
}

bool cg_scalar_check(const char *expr, int nargs, char *why, size_t size) {
  Scalar s;
  if (!scalar_parse(expr, &s, why, size)) return false;
  for (const Token *t = s.tok; t < s.tok + s.ntok; t++) {
    char fn[64];
    snprintf(fn, sizeof fn, "mk_f_%.*s(", t->len, t->s);
    if (t->kind == TOKEN_OPERAND && t->k >= nargs) return snprintf(why, size, "x%d: the op has %d operands", t->k, nargs), false;
    if (t->kind == TOKEN_NAME && !strstr(cg_cuda_prelude(), fn))
      return snprintf(why, size, "%.*s(): the CUDA prelude has no mk_f_%.*s", t->len, t->s, t->len, t->s), false;
  }
  return true;
}

// The pointer of member j's result (o%d), -1 when it stays in the kernel.
static int out_of(const Stores *st, int j) {
  for (int p = 0; p < st->nout; p++)
    if (st->out[p] == j) return p;
  return -1;
}

// The stores of member j's register.
static void store(FILE *out, const Stores *st, int j, const char *indent) {
  for (int p = 0; p < st->nout; p++)
    if (st->out[p] == j) fprintf(out, "%so%d[i] = v%d;\n", indent, p, j);
  for (int p = 0; p < st->ncopy; p++)
    if (st->copy[p] == j) fprintf(out, "%sh%d[i] = mk_bf16_from_float(v%d);\n", indent, p, j);
}

// Members lo .. hi - 1 of the group at op i: each element into a register, then its stores (st,
// NULL: none); guard: a group over expert slots (NULL: none).
static void members(FILE *out, const IrFunc *f, int i, int n, int lo, int hi, const In *in, int nin,
                    const Stores *st, const char *indent, const CgGuard *guard) {
  for (int j = lo; j < hi; j++) {
    const IrOp *op = f->ops[i + j];
    fprintf(out, "%sconst float v%d = ", indent, j);
    expression(out, f, i, n, op, in, nin, guard);
    fprintf(out, ";   // %s\n", ir_op_info[op->kind].name);
    if (st) store(out, st, j, indent);
  }
}

// The launch a generated kernel is written for: items threads (one block per item where blocks),
// and whether it synchronises (then the fake device runs its threads as fibers).
typedef struct Grid {
  int64_t items;
  bool blocks, syncs;
} Grid;

// The body of a group of column sums: each member's tiles (mk_colsum_tile_of of codegen/cuda/ffn.cu,
// with its own shape's tile width, as its own kernel would) one after the other in one tile space
// that the blocks stride over.
// guard: the sums whose summed operand (or its factor) is zero past the counts add only the rows
// below them (a term of zero adds nothing to a sum that starts at +0: the same sums).
static Grid colsums(FILE *out, const IrFunc *f, int i, int n, const In *in, int nin, const CgGuard *guard) {
  int64_t total = 0, e[CG_MAX_KERNEL_ARGS], rows[CG_MAX_KERNEL_ARGS], cols[CG_MAX_KERNEL_ARGS], tiles[CG_MAX_KERNEL_ARGS];
  for (int j = 0; j < n; j++) {
    const IrType *t0 = cg_operand_type(&f->ops[i + j]->args[0]);
    cols[j] = t0->dim[t0->rank - 1], rows[j] = t0->dim[t0->rank - 2], e[j] = 1;
    for (int d = 0; d + 2 < t0->rank; d++) e[j] *= t0->dim[d];
    int64_t width = e[j] * ((cols[j] + 31) / 32) >= 1024 ? 32 : 8;
    tiles[j] = e[j] * ((cols[j] + width - 1) / width);
    total += tiles[j];
  }
  fprintf(out, "  for (i64 t = blockIdx.x; t < %" PRId64 "; t += gridDim.x) {\n", total);
  int64_t first = 0;
  for (int j = 0; j < n; j++) {
    const IrOp *op = f->ops[i + j];
    bool with_x = ir_op_colsum(op->kind) == 1;
    int p0 = pointer_of(in, nin, &op->args[0]), p1 = with_x ? pointer_of(in, nin, &op->args[1]) : 0;
    fprintf(out, "    %sif (t < %" PRId64 ") mk_colsum_tile_of([&](i64 i) { return a%d[i]; }, ", j ? "else " : "",
            first + tiles[j], p0);
    if (with_x) fprintf(out, "[&](i64 i) { return a%d[i]; }, ", p1);
    else fprintf(out, "[&](i64 i) { return 0.0f; }, ");
    if (guard && (guard_zero(guard, &op->args[0]) || (with_x && guard_zero(guard, &op->args[1]))))
      fprintf(out, "[&](i64 r) { return r %% %" PRId64 " < cnt[r / %" PRId64 "]; }, ", guard->rows, guard->rows);
    else
      fprintf(out, "[&](i64) { return true; }, ");
    fprintf(out, "%s", with_x ? "true" : "false");
    fprintf(out, ", o%d, %" PRId64 ", %" PRId64 ", %" PRId64 ", t - %" PRId64 ");   // %s\n", j, e[j], rows[j], cols[j],
            first, ir_op_info[op->kind].name);
    first += tiles[j];
  }
  fprintf(out, "  }\n");
  return (Grid){.items = total, .blocks = true, .syncs = true};
}

// The body of a group that starts with an op of a storing function: that function with the
// arguments of the op's own kernel (first: cg_lower_op's, lowered once by launch.c), a storer in place of the result that computes
// the other members per element, on the op's own grid.
// map: the op reads its launch's slot map (the kernel's parameter `map`, CgLaunches.slot_map);
// an order over slot rows without it passes none (its pass over every choice).
static Grid stored(FILE *out, const IrFunc *f, int i, int n, const In *in, int nin, const Stores *st,
                   const CgLaunch *first, bool routed, bool map) {
  const IrOp *op = f->ops[i];
  if (!first || first->ncalls != 1) UNREACHABLE();   // tests/unit checks the IR_STORE rows
  const CgKernelCall *c = &first->call[0];
  fprintf(out, "  mk_%s_store(%s", ir_op_store(op->kind), map ? "map, " : cg_slot_map_op(op) ? "nullptr, " : "");
  for (int a = 0; a < c->nargs; a++) {
    const CgArg *x = &c->args[a];
    fprintf(out, "%s", !a ? "" : x->kind == CG_ARG_RESULT ? "," : ", ");
    if (x->kind == CG_ARG_OPERAND) {
      fprintf(out, "a%d", pointer_of(in, nin, &op->args[x->index]));
    } else if (x->kind == CG_ARG_RESULT) {
      fprintf(out, "\n      [&](i64 i, float v) {\n        const float v0 = v;   // %s\n", ir_op_info[op->kind].name);
      store(out, st, 0, "        ");
      members(out, f, i, n, 1, n, in, nin, st, "        ", NULL);
      fprintf(out, "      }");
    } else if (x->kind == CG_ARG_INT) {
      fprintf(out, "%" PRId64, x->i);
    } else {
      UNREACHABLE();   // the IR_STORE ops' kernels take pointers and integers
    }
  }
  // routed: an order's result written only below the counts from the routing (codegen/cuda/order.cu)
  fprintf(out, "%s);\n", routed ? ", false" : "");
  return (Grid){.items = c->grid, .blocks = true, .syncs = ir_op_store_syncs(op->kind)};
}

// The body of an elementwise group (a thread an element), or of one with a row-wise op: a block
// (or a thread) a row, the prologue computed in each of the row function's loaders, the epilogue
// in its storer.
// guard (an elementwise group over expert slots, CgGuard): a block a row of the slots, each row's
// `filled` (below its block's count) read once; with skip the rows past the counts but row 0 are
// left (the host builds, MK_POISON, write NaN there: a read of them shows in the tests).
static Grid elements(FILE *out, const IrFunc *f, int i, int n, const In *in, int nin, const Stores *st,
                     const CgGuard *guard) {
  int row = -1;   // the member that is a row-wise op
  for (int j = 0; j < n; j++)
    if (ir_op_row(f->ops[i + j]->kind)) row = j;
  int64_t numel = ir_type_numel(&f->ops[i]->result->type);
  if (guard) {   // (cg_fused_guardable: no row-wise op)
    int64_t rows = guard->groups * guard->rows, cols = numel / rows, per = guard->rows;
    fprintf(out, "  MK_FOR_BLOCKS(row, %" PRId64 ") {   // a block a row of the expert slots\n", rows);
    fprintf(out, "    const bool filled = row %% %" PRId64 " < cnt[row / %" PRId64 "];\n", per, per);
    if (guard->skip && guard->plus) {   // the counts plus one: cnt[2 groups ..] (mk_expert_counts)
      fprintf(out, "    if (row %% %" PRId64 " >= cnt[%" PRId64 " + row / %" PRId64 "] && row %% %" PRId64
                   " != 0) {   // nothing reads it\n      if (MK_POISON)\n",
              per, 2 * guard->groups, per, per);
    } else if (guard->skip) {
      fprintf(out, "    if (!filled && row %% %" PRId64 " != 0) {   // nothing reads it\n      if (MK_POISON)\n", per);
    }
    if (guard->skip) {
      fprintf(out, "        for (i64 i = row * %" PRId64 " + threadIdx.x; i < (row + 1) * %" PRId64 "; i += blockDim.x) {\n",
              cols, cols);   // (a column and row of their own: none read)
      for (int p = 0; p < st->nout; p++) fprintf(out, "          o%d[i] = MK_NAN;\n", p);
      for (int p = 0; p < st->ncopy; p++) fprintf(out, "          h%d[i] = MK_NAN_BF16;\n", p);
      fprintf(out, "        }\n      continue;\n    }\n");
    }
    fprintf(out, "    for (i64 c = threadIdx.x; c < %" PRId64 "; c += blockDim.x) {\n      const i64 i = row * %" PRId64 " + c;\n",
            cols, cols);
    members(out, f, i, n, 0, n, in, nin, st, "      ", guard);
    fprintf(out, "    }\n  }\n");
    // At most 4096 blocks, striding over the rows (four waves of an H200's resident blocks): an
    // empty row costs a step of a block's loop, not a block of its own.
    return (Grid){.items = rows < 4096 ? rows : 4096, .blocks = true};
  }
  if (row < 0) {
    fprintf(out, "  MK_FOR(i, %" PRId64 ") {\n", numel);
    members(out, f, i, n, 0, n, in, nin, st, "    ", NULL);
    fprintf(out, "  }\n");
    return (Grid){.items = numel};
  }
  const IrOp *r = f->ops[i + row];
  const IrRowInfo *ri = ir_op_row(r->kind);
  const IrType *rt = &r->result->type;
  int64_t cols = rt->dim[rt->rank - 1], rows = numel / cols;
  fprintf(out, "  %s(row, %" PRId64 ") {\n    mk_%s_row(", ri->per_thread ? "MK_FOR" : "MK_FOR_BLOCKS", rows, ri->function);
  for (int a = 0; a < r->nargs; a++) {
    fprintf(out, "\n        [&](int c) {\n          const i64 i = row * %" PRId64 " + c;\n", cols);
    members(out, f, i, n, 0, row, in, nin, NULL, "          ", NULL);
    int made = member_making(f, i, n, r->args[a].value), p = pointer_of(in, nin, &r->args[a]);
    if (made >= 0) fprintf(out, "          return v%d;\n        },", made);
    else fprintf(out, "          return a%d[i];\n        },", p);
  }
  fprintf(out, "\n        [&](int c, float v) {\n          const i64 i = row * %" PRId64 " + c;\n", cols);
  // The prologue again where a value of it leaves the kernel or the epilogue reads one.
  bool again = false;
  for (int j = 0; j < row && !again; j++) {
    again = out_of(st, j) >= 0;
    for (int p = 0; p < st->ncopy; p++) again |= st->copy[p] == j;
    for (int e = row + 1; e < n && !again; e++)
      for (int a = 0; a < f->ops[i + e]->nargs; a++) again |= member_making(f, i, n, f->ops[i + e]->args[a].value) == j;
  }
  if (again) members(out, f, i, n, 0, row, in, nin, st, "          ", NULL);
  fprintf(out, "          const float v%d = v;   // %s\n", row, ir_op_info[r->kind].name);
  store(out, st, row, "          ");
  members(out, f, i, n, row + 1, n, in, nin, st, "          ", NULL);
  fprintf(out, "        },\n        %" PRId64, cols);
  if (ri->eps) fprintf(out, ", (float)%.17g", ir_op_float(r, "eps", 0));
  fprintf(out, ");\n  }\n");
  return (Grid){.items = rows, .blocks = !ri->per_thread, .syncs = !ri->per_thread};
}

// ---- the CPU program's loops ----
// On the CPU a group holds elementwise ops of one row length, or column sums (passes/fuse.c, the
// CPU target's groups; the column sums: c_colsums below). Its function runs the rows of a thread's share (rt_team_share, in a parallel region
// when the work is worth one) in chunks of RT_FUSED_CHUNK columns: each member's chunk is one
// vector loop into a chunk array vJ (a function call is the loop rt_fv_NAME of runtime/rt_fused.h,
// which the CPU kernels run too), then copied where it leaves the kernel. The body is compiled
// for each vector path (RT_VECTOR_PATHS) and named FUSED_NAME until the program numbers it.

bool cg_scalar_c_form(const char *expr) {
  Scalar s;
  char why[128];
  if (!scalar_parse(expr, &s, why, sizeof why)) return false;
  for (int t = 0; t < s.ntok && !s.form; t++)   // else no function anywhere
    if (s.tok[t].call) return false;
  return true;
}

// A value made by member `made` of the group, read in the segment [m0, m1): its chunk array there,
// else (another segment made it: it has memory) its output pointer at the element.
static void c_member(FILE *out, const Stores *st, int made, int m0, int m1, bool pointer) {
  if (made >= m0 && made < m1) fprintf(out, pointer ? "v%d" : "v%d[c]", made);
  else fprintf(out, pointer ? "o%d + i0" : "o%d[i0 + c]", out_of(st, made));
}

// Operand k of a CPU loop's member as a C expression at row r, column c0 + c (element i0 + c).
static void c_operand(FILE *out, int k, Mode mode, void *ctx) {
  const Operands *o = ctx;
  int made = member_making(o->f, o->i, o->n, o->op->args[k].value);
  if (made >= 0) {
    c_member(out, o->st, made, o->m0, o->m1, false);
    return;
  }
  int p = outside_pointer(o, k);
  const IrType *rt = &o->op->result->type;
  int64_t mid = rt->rank >= 2 ? rt->dim[rt->rank - 2] : 1, cols = o->cols;
  switch (mode) {
  case MODE_ELEMENT: fprintf(out, "a%d[i0 + c]", p); break;
  case MODE_COL: fprintf(out, "a%d[c0 + c]", p); break;
  case MODE_ROW: fprintf(out, "a%d[r]", p); break;
  case MODE_ZERO: fprintf(out, "a%d[0]", p); break;
  case MODE_EC: fprintf(out, "a%d[r / %" PRId64 " * %" PRId64 " + c0 + c]", p, mid, cols); break;
  case MODE_SLICE: {
    const IrType *t = cg_operand_type(&o->op->args[k]);
    fprintf(out, "a%d[r * %" PRId64 " + %" PRId64 " + c0 + c]", p, t->dim[t->rank - 1], ir_op_int(o->op, "offset", 0));
    break;
  }
  default: UNREACHABLE();
  }
}

// The rows function NAME (compiled for each vector path) of the elementwise members [m0, m1):
// each row of [lo, hi) in chunks, a loop per member. Whether one calls a function.
static bool c_segment(FILE *out, const char *name, const IrFunc *f, int i, int n, int m0, int m1, const In *in,
                      int nin, const Stores *st, const char *params, const char *args, int64_t cols) {
  fprintf(out, "RT_VECTOR_BODY void %s_body(%s, int64_t lo, int64_t hi) {\n", name, params);
  fprintf(out, "  float ");
  for (int j = m0; j < m1; j++) fprintf(out, "%sv%d[RT_FUSED_CHUNK]", j > m0 ? ", " : "", j);
  fprintf(out, ";\n  for (int64_t r = lo; r < hi; r++)\n");
  fprintf(out, "    for (int64_t c0 = 0; c0 < %" PRId64 "; c0 += RT_FUSED_CHUNK) {\n", cols);
  fprintf(out, "      const int64_t m = %" PRId64 " - c0 < RT_FUSED_CHUNK ? %" PRId64 " - c0 : RT_FUSED_CHUNK, i0 = r * %" PRId64
               " + c0;\n      (void)i0;\n", cols, cols, cols);
  bool calls = false;
  for (int j = m0; j < m1; j++) {
    const IrOp *op = f->ops[i + j];
    const Scalar *e = scalar_of(op->kind);
    if (e->form) {
      calls = true;
      fprintf(out, "      rt_fv_%.*s(m, v%d", e->tok[0].len, e->tok[0].s, j);
      for (int a = 0; a < e->nargs; a++) {
        int made = member_making(f, i, n, op->args[e->arg[a]].value), p = pointer_of(in, nin, &op->args[e->arg[a]]);
        fprintf(out, ", ");
        if (made >= 0) c_member(out, st, made, m0, m1, true);
        else fprintf(out, "a%d + i0", p);
      }
      fprintf(out, ");   // %s\n", ir_op_info[op->kind].name);
    } else {
      Operands o = {.f = f, .i = i, .n = n, .op = op, .in = in, .nin = nin, .st = st, .m0 = m0, .m1 = m1, .cols = cols};
      fprintf(out, "RT_SIMD\n      for (int64_t c = 0; c < m; c++) v%d[c] = ", j);
      write_expression(out, e, "", c_operand, &o);   // (no function: cg_scalar_c_form)
      fprintf(out, ";   // %s\n", ir_op_info[op->kind].name);
    }
    int p = out_of(st, j);
    if (p >= 0) fprintf(out, "      memcpy(o%d + i0, v%d, (size_t)m * sizeof(float));\n", p, j);
  }
  fprintf(out, "    }\n}\n");
  fprintf(out, "RT_VECTOR_PATHS(%s, (%s, int64_t lo, int64_t hi), (%s, lo, hi))\n", name, params, args);
  return calls;
}

// The C function of a group (FUSED_NAME for its name) into out: the elementwise members as rows
// functions, and a norm's rows (rt_NAME_rows of runtime/rt_fused.h, the kernel's own rows) between
// its prologue's and its epilogue's, each thread over its share of the rows: a thread reads only
// rows it wrote, so no barrier is needed between them (the CPU's fuse pass gives memory to every
// value that crosses from one to the next).
static void c_function(FILE *out, const IrFunc *f, int i, int n, const In *in, int nin, const Stores *st) {
  const IrType *rt = &f->ops[i]->result->type;
  int64_t cols = rt->rank ? rt->dim[rt->rank - 1] : 1, rows = ir_type_numel(rt) / (cols ? cols : 1);
  char params[2048] = "", args[1024] = "";
  size_t pn = 0, an = 0;
  for (int p = 0; p < nin; p++) {
    pn += (size_t)snprintf(params + pn, sizeof params - pn, "%sconst %s *restrict a%d", p ? ", " : "",
                           cg_operand_type(in[p].operand)->dtype == IR_I32 ? "int32_t" : "float", p);
    an += (size_t)snprintf(args + an, sizeof args - an, "%sa%d", p ? ", " : "", p);
  }
  for (int p = 0; p < st->nout; p++) {   // (not restrict: a segment reads what another wrote)
    pn += (size_t)snprintf(params + pn, sizeof params - pn, "%sfloat *o%d", nin + p ? ", " : "", p);
    an += (size_t)snprintf(args + an, sizeof args - an, "%so%d", nin + p ? ", " : "", p);
  }
  int row = -1;
  for (int j = 0; j < n; j++)
    if (ir_op_row(f->ops[i + j]->kind)) row = j;
  bool calls = row >= 0;
  if (row != 0) calls |= c_segment(out, "FUSED_NAME_pro", f, i, n, 0, row < 0 ? n : row, in, nin, st, params, args, cols);
  if (row >= 0 && row + 1 < n) calls |= c_segment(out, "FUSED_NAME_epi", f, i, n, row + 1, n, in, nin, st, params, args, cols);
  // FUSED_NAME_rows: the group over rows [lo, hi); FUSED_NAME_piece the same on a pointer table (the
  // GEMM epilogue's call, rt_matmul_rows); FUSED_NAME over every row, on the team.
  fprintf(out, "static void FUSED_NAME_rows(%s, int64_t lo, int64_t hi) {\n", params);
  if (row != 0) fprintf(out, "  FUSED_NAME_pro(%s, lo, hi);\n", args);
  if (row >= 0) {
    const IrOp *r = f->ops[i + row];
    const IrRowInfo *ri = ir_op_row(r->kind);
    fprintf(out, "  rt_%s_rows(", ri->function);
    for (int a = 0; a < r->nargs; a++) {
      int made = member_making(f, i, n, r->args[a].value), p = pointer_of(in, nin, &r->args[a]);
      if (made >= 0) fprintf(out, "o%d, ", out_of(st, made));
      else fprintf(out, "a%d, ", p);
    }
    fprintf(out, "o%d, lo, hi, %" PRId64, out_of(st, row), cols);
    if (ri->eps) fprintf(out, ", (float)%.17g", ir_op_float(r, "eps", 0));
    fprintf(out, ");   // %s\n", ir_op_info[r->kind].name);
    if (row + 1 < n) fprintf(out, "  FUSED_NAME_epi(%s, lo, hi);\n", args);
  }
  fprintf(out, "}\n");
  fprintf(out, "static __attribute__((unused)) void FUSED_NAME_piece(const void *const *x, int64_t lo, int64_t hi) {\n"
               "  FUSED_NAME_rows(");
  for (int p = 0; p < nin; p++)
    fprintf(out, "(const %s *)x[%d], ", cg_operand_type(in[p].operand)->dtype == IR_I32 ? "int32_t" : "float", p);
  for (int p = 0; p < st->nout; p++) fprintf(out, "(float *)x[%d], ", nin + p);
  fprintf(out, "lo, hi);\n}\n");
  fprintf(out, "static void FUSED_NAME(%s) {\n", params);
  fprintf(out, "  RT_PARALLEL(%s%" PRId64 " >= RT_PAR_MIN%s)\n", rows > 1 ? "" : "0 && ", ir_type_numel(rt), calls ? " / 8" : "");
  fprintf(out, "  {\n    int64_t lo, hi;\n    rt_team_share(%" PRId64 ", &lo, &hi);\n", rows);
  fprintf(out, "    FUSED_NAME_rows(%s, lo, hi);\n  }\n}\n", args);
}

// The C function of a group of column sums: each member's share of its kernel's work items
// (rt_column_sums_share, rt_scale_cols_grad_w_share of runtime/rt_fused.h), all in one parallel
// region, each with its own kernel's order of additions.
static void c_colsums(FILE *out, const IrFunc *f, int i, int n, const In *in, int nin) {
  fprintf(out, "static void FUSED_NAME(");
  for (int p = 0; p < nin; p++) fprintf(out, "%sconst float *a%d", p ? ", " : "", p);
  for (int j = 0; j < n; j++) fprintf(out, ", float *o%d", j);
  int64_t total = 0;
  for (int j = 0; j < n; j++) total += ir_type_numel(cg_operand_type(&f->ops[i + j]->args[0]));
  fprintf(out, ") {\n  RT_PARALLEL(%" PRId64 " >= RT_PAR_MIN)\n  {\n", total);
  for (int j = 0; j < n; j++) {
    const IrOp *op = f->ops[i + j];
    const IrType *t0 = cg_operand_type(&op->args[0]);
    int64_t cols = t0->dim[t0->rank - 1], rows = t0->dim[t0->rank - 2], e = 1;
    for (int d = 0; d + 2 < t0->rank; d++) e *= t0->dim[d];
    int p0 = pointer_of(in, nin, &op->args[0]);
    if (ir_op_colsum(op->kind) == 1) {
      int p1 = pointer_of(in, nin, &op->args[1]);
      fprintf(out, "    rt_scale_cols_grad_w_share(a%d, a%d, o%d, %" PRId64 ", %" PRId64 ");   // %s\n", p0, p1, j,
              e * rows, cols, ir_op_info[op->kind].name);
    } else {
      fprintf(out, "    rt_column_sums_share(a%d, o%d, %" PRId64 ", %" PRId64 ", %" PRId64 ");   // %s\n", p0, j, e, rows,
              cols, ir_op_info[op->kind].name);
    }
  }
  fprintf(out, "  }\n}\n");
}

// The ops of the group at op i, or 1 for an op alone that a kernel can take as a group of one: an
// elementwise op with a scalar expression, or a column sum (the guarded kernels of an op the fuse
// pass left alone).
static int members_or_alone(const IrFunc *f, int i) {
  int n = cg_fused_members(f, i);
  if (n > 0 || ir_group_at(f, i)) return n;
  const IrOp *op = f->ops[i];
  bool alone = op->result && (ir_op_colsum(op->kind) >= 0 ||
                              (ir_op_scalar(op->kind) && !ir_op_row(op->kind) && !ir_op_store(op->kind)));
  return alone ? 1 : 0;
}

bool cg_fused_guardable(const IrFunc *f, int i, const CgGuard *g) {
  int n = members_or_alone(f, i);
  if (n <= 0 || g->groups < 1 || g->rows < 1 || (g->nzero < 1 && !g->route)) return false;
  int64_t slots = g->groups * g->rows;
  bool colsum = ir_op_colsum(f->ops[i]->kind) >= 0, any = false;
  if (!colsum && ir_op_store(f->ops[i]->kind)) return false;
  if (colsum && g->nzero < 1) return false;   // a routing guard skips rows: of elementwise groups only
  const IrType *rt = &f->ops[i]->result->type;
  if (!colsum && (rt->rank != 3 || rt->dim[0] * rt->dim[1] != slots)) return false;
  for (int j = 0; j < n; j++) {
    const IrOp *op = f->ops[i + j];
    if (!colsum && ir_op_row(op->kind)) return false;
    for (int a = 0; a < op->nargs; a++) {
      const IrType *t = cg_operand_type(&op->args[a]);
      // a routing guard's group skips rows: each operand over the slots read at the element (its row)
      bool row = g->nzero < 1 && !colsum && t->rank == 3 && t->dim[0] * t->dim[1] == slots;
      if (!guard_zero(g, &op->args[a]) && !row) continue;
      if (t->rank != 3 || t->dim[0] * t->dim[1] != slots) return false;
      if (colsum && a > (ir_op_colsum(op->kind) == 1 ? 1 : 0)) return false;
      if (!colsum) {   // read at the element only, a value the size of the results
        const Scalar *e = scalar_of(op->kind);
        if (!e || ir_type_numel(t) != ir_type_numel(rt)) return false;
        for (int k = 0; k < e->ntok; k++)
          if (e->tok[k].kind == TOKEN_OPERAND && e->tok[k].k == a && e->tok[k].mode != MODE_ELEMENT) return false;
      }
      any = true;
    }
  }
  return any;
}

bool cg_lower_fused(IrDiag *d, CgLaunches *ls, const IrFunc *f, int i, bool cpu, const CgLaunch *first,
                    const CgGuard *guard, CgLaunch *l) {
  if (cpu) guard = NULL;
  int n = guard ? members_or_alone(f, i) : cg_fused_members(f, i);
  memset(l, 0, sizeof *l);
  l->nops = n;
  // The pointers: outside operands in first-read order, then the results that leave.
  In in[CG_MAX_KERNEL_ARGS];
  int nin = 0;
  Stores st = {.nout = 0};
  bool colsum = ir_op_colsum(f->ops[i]->kind) >= 0;
  for (int j = 0; j < n; j++) {
    const IrOp *op = f->ops[i + j];
    for (int a = 0; a < op->nargs; a++) {
      if (member_making(f, i, n, op->args[a].value) >= 0) continue;
      int seen = pointer_of(in, nin, &op->args[a]);
      if (seen < nin && pass_reads_copy(op, a) != in[seen].bf16)
        return ir_internal_at(d, op->loc, "a fused group reads a value both from its bf16 copy and in fp32");
      if (seen < nin) continue;
      if (nin + st.nout >= CG_MAX_KERNEL_ARGS) return ir_internal_at(d, op->loc, "a fused group has more than %d pointers", CG_MAX_KERNEL_ARGS);
      in[nin++] = (In){.operand = &op->args[a], .op = j, .arg = a, .bf16 = pass_reads_copy(op, a)};
    }
    if (!ir_op_int(op, "inner", 0)) st.out[st.nout++] = j;
    if (pass_writes_copy(op) && st.ncopy < CG_MAX_KERNEL_ARGS) st.copy[st.ncopy++] = j;
  }
  if (nin + st.nout + st.ncopy > CG_MAX_KERNEL_ARGS) return ir_internal_at(d, f->ops[i]->loc, "a fused group has more than %d pointers", CG_MAX_KERNEL_ARGS);
  struct {
    char *s;
    size_t n;
    FILE *f;
  } t = {0};   // the kernel's text after its name
  if (!(t.f = open_memstream(&t.s, &t.n))) return ir_oom(d);
  Grid grid = {.items = 1};
  if (cpu && colsum) c_colsums(t.f, f, i, n, in, nin);
  else if (cpu) c_function(t.f, f, i, n, in, nin, &st);
  else fprintf(t.f, "(");
  for (int p = 0; p < nin && !cpu; p++)
    fprintf(t.f, "%sconst %s *a%d", p ? ", " : "",
            in[p].bf16 ? "u16" : cg_operand_type(in[p].operand)->dtype == IR_I32 ? "int" : "float", p);
  for (int p = 0; p < st.nout && !cpu; p++) fprintf(t.f, "%sfloat *o%d", nin + p ? ", " : "", p);
  for (int p = 0; p < st.ncopy && !cpu; p++) fprintf(t.f, ", u16 *h%d", p);
  // a group that starts with an order's store takes a guard only to skip (CgGuard.route): no counts
  bool store = ir_op_store(f->ops[i]->kind), counted = guard && !store;
  bool map = !cpu && store && ls->slot_map && cg_slot_map_op(f->ops[i]);
  if (counted) fprintf(t.f, ", const int *cnt");   // the counts (mk_expert_counts) of the blocks of slots
  if (map) fprintf(t.f, ", const int *map");       // the launch's slot map (mk_slot_map)
  if (!cpu) {
    fprintf(t.f, ") {\n");
    if (colsum) grid = colsums(t.f, f, i, n, in, nin, guard);
    else if (store) grid = stored(t.f, f, i, n, in, nin, &st, first, guard && guard->skip, map);
    else grid = elements(t.f, f, i, n, in, nin, &st, guard);
    fprintf(t.f, "}\n");
  }
  if (fclose(t.f) != 0) {
    free(t.s);
    return ir_oom(d);
  }
  int g = 0;
  while (g < ls->ngen && strcmp(ls->gen[g].source, t.s) != 0) g++;
  if (g < ls->ngen) {
    free(t.s);
  } else {
    CgGenKernel *gen = realloc(ls->gen, (size_t)(ls->ngen + 1) * sizeof *gen);
    if (!gen) {
      free(t.s);
      return ir_oom(d);
    }
    ls->gen = gen;
    CgGenKernel *k = &ls->gen[ls->ngen++];
    memset(k, 0, sizeof *k);
    snprintf(k->name, sizeof k->name, cpu ? "fuse_%d" : "mk_fuse_%d", g);
    k->source = t.s;
    k->nparams = nin + st.nout + st.ncopy + (counted ? 1 : 0) + (map ? 1 : 0);
    k->syncs = grid.syncs;
    size_t used = 0;
    for (int j = 0; j < n && used < sizeof k->ops; j++)
      used += (size_t)snprintf(k->ops + used, sizeof k->ops - used, "%s%s", j ? " + " : "", ir_op_info[f->ops[i + j]->kind].name);
  }
  CgKernelCall *c = &l->call[l->ncalls++];
  c->kernel = CG_K_COUNT + g;
  c->grid = grid.blocks ? cg_cuda_grid_blocks(grid.items) : cg_cuda_grid_elems(grid.items);
  for (int p = 0; p < nin; p++)
    c->args[c->nargs++] = (CgArg){.kind = in[p].bf16 ? CG_ARG_OPERAND16 : CG_ARG_OPERAND, .index = in[p].arg, .i = in[p].op};
  for (int p = 0; p < st.nout; p++) c->args[c->nargs++] = (CgArg){.kind = CG_ARG_RESULT, .index = st.out[p]};
  for (int p = 0; p < st.ncopy; p++) c->args[c->nargs++] = (CgArg){.kind = CG_ARG_COPY, .index = st.copy[p]};
  if (counted) c->args[c->nargs++] = (CgArg){.kind = CG_ARG_SCRATCH};   // the counts' launch: CgLaunch.rows_from
  if (map) c->args[c->nargs++] = (CgArg){.kind = CG_ARG_SCRATCH};   // the map, written first (cg_slot_map)
  l->rows_guard = counted, l->rows_skip = guard && guard->skip;
  snprintf(l->note, sizeof l->note, "%d ops fused%s", n,
           !guard ? "" : guard->skip ? ", over the filled rows only" : ", the rows past the counts from zeros");
  if (map) cg_slot_map(l, &first->call[0]);
  return true;
}
