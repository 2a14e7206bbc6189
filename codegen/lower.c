// Layer 3 of codegen/ (single-op lowering); it may call facts.c and kernels.c (layers 1-2).
//
// The op lowering, written once for both targets: which kernels an op runs, in order, each with
// one typed argument per kernel parameter (the op's operands and result, a parameter's gradient
// and moments, literal shapes and attributes, the step's seed, step and token0, a statistics
// sink) and the grid the CUDA kernel's loops are written for; GEMMs and collectives are marked
// for the target's BLAS and collective library instead (CgLib). The CPU program prints each call
// as rt_NAME(...) (emit_c.c); the CUDA kernel unit's launch plan and the CUDA host program launch
// mk_NAME (emit_cuda.c, emit_cuda_host.c); kernels are the rows of runtime/kernels.def. Most
// ops' lowerings are the KERNEL column of ir/ops.def (lower_by_rule); lower_in_c has the rest.
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cg_internal.h"


// ---- which kernels an op launches, with every argument ----
// Every CUDA kernel runs CG_CUDA_BLOCK (= MK_BLOCK) threads per block; the grid is the one the
// kernel's loops are written for: per element (MK_FOR), per row, token, choice or group
// (MK_FOR_BLOCKS), or a single block for the whole-tensor reductions. The CPU ignores grids.



// Starts the next kernel call of l.
static CgKernelCall *call(CgLaunch *l, CgKernel k, int64_t grid) {
  CgKernelCall *c = &l->call[l->ncalls++];
  c->kernel = k;
  c->grid = grid;
  return c;
}

static void arg(CgKernelCall *c, CgArgKind kind, int index) {
  if (c->nargs < CG_MAX_KERNEL_ARGS) c->args[c->nargs++] = (CgArg){.kind = kind, .index = index};
}

static void ints(CgKernelCall *c, const int64_t *v, int n) {
  for (int i = 0; i < n && c->nargs < CG_MAX_KERNEL_ARGS; i++) c->args[c->nargs++] = (CgArg){.kind = CG_ARG_INT, .i = v[i]};
}
#define INTS(c, ...) ints(c, (const int64_t[]){__VA_ARGS__}, (int)(sizeof((const int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))

static void flt(CgKernelCall *c, double f) {
  if (c->nargs < CG_MAX_KERNEL_ARGS) c->args[c->nargs++] = (CgArg){.kind = CG_ARG_FLOAT, .f = f};
}

// The operands 0..n-1, then the result: the pointer parameters of most kernels.
static void operands(CgKernelCall *c, int n, bool result) {
  for (int i = 0; i < n; i++) arg(c, CG_ARG_OPERAND, i);
  if (result) arg(c, CG_ARG_RESULT, 0);
}

// A kernel over the op's operands and result with the given literal arguments after them.
static CgKernelCall *simple(CgLaunch *l, const IrOp *op, CgKernel k, int64_t grid) {
  CgKernelCall *c = call(l, k, grid);
  operands(c, op->nargs, op->result != NULL);
  return c;
}

// What most lowerings read: the first operand's type, the result's type and its elements.
typedef struct Shapes {
  const IrType *t0, *rt;
  int64_t n;
} Shapes;

// ---- the KERNEL column of ops.def ----
// "name(arg, ...) : grid; ..." (the column's description in ops.def). The parser walks the rule
// once per lowering; with op NULL it only checks the rule (cg_lower_rule_check).

typedef struct Rule {
  const char *s;          // the rest of the rule
  const IrOp *op;         // NULL: check only
  const Shapes *sh;
  int nargs;              // the op's operands
  bool has_result;        // the op has a result (y, n, rows, cols)
  char why[160];          // what is malformed
} Rule;

static bool rule_fail(Rule *r, const char *what) {
  if (!r->why[0]) snprintf(r->why, sizeof r->why, "%s at \"%.40s\"", what, r->s);
  return false;
}

static void rule_spaces(Rule *r) {
  while (*r->s == ' ') r->s++;
}

// A word ([a-z_] then [a-z0-9_]) into buf.
static bool rule_word(Rule *r, char *buf, size_t size) {
  rule_spaces(r);
  size_t n = strspn(r->s, "abcdefghijklmnopqrstuvwxyz_0123456789");
  if (n == 0 || n >= size || (r->s[0] >= '0' && r->s[0] <= '9')) return rule_fail(r, "a name is expected");
  snprintf(buf, size, "%.*s", (int)n, r->s);
  r->s += n;
  return true;
}

// "x3" -> 3, "y" -> -1 (the result); -2 when word is neither.
static int rule_tensor(const char *word) {
  if (strcmp(word, "y") == 0) return -1;
  if (word[0] == 'x' && word[1] >= '0' && word[1] <= '9' && !word[2]) return word[1] - '0';
  return -2;
}

static const IrType *rule_type(const Rule *r, int t) { return t == -1 ? r->sh->rt : cg_operand_type(&r->op->args[t]); }

// One factor of an integer argument or grid: a number, n / rows / cols (with an operand number),
// y.D / xK.D, @attr[=default].
static bool rule_factor(Rule *r, int64_t *v) {
  rule_spaces(r);
  char word[48];
  if ((*r->s >= '0' && *r->s <= '9') || (*r->s == '-' && r->s[1] >= '0' && r->s[1] <= '9')) {
    *v = strtoll(r->s, (char **)&r->s, 10);
    return true;
  }
  if (*r->s == '@') {
    r->s++;
    if (!rule_word(r, word, sizeof word)) return false;
    int64_t def = 0;
    if (*r->s == '=') def = strtoll(r->s + 1, (char **)&r->s, 10);
    *v = r->op ? ir_op_int(r->op, word, def) : 0;
    return true;
  }
  if (!rule_word(r, word, sizeof word)) return false;
  int t = rule_tensor(word);
  if (t != -2) {
    if (*r->s != '.' || r->s[1] < '0' || r->s[1] >= '0' + IR_MAX_RANK) return rule_fail(r, "a dimension (y.D, xK.D) is expected");
    int d = r->s[1] - '0';
    r->s += 2;
    if (t >= r->nargs || (t == -1 && !r->has_result)) return rule_fail(r, "no such operand");
    *v = r->op ? rule_type(r, t)->dim[d] : 0;
    return true;
  }
  size_t base = strcspn(word, "0123456789");
  int of = word[base] ? atoi(word + base) : -1;   // "rows0": of operand 0; "rows": of the result
  if (of >= r->nargs || (of == -1 && !r->has_result)) return rule_fail(r, "no such operand");
  word[base] = '\0';
  bool n = strcmp(word, "n") == 0, rows = strcmp(word, "rows") == 0, cols = strcmp(word, "cols") == 0;
  if (!n && !rows && !cols) return rule_fail(r, "an integer (n, rows, cols, y.D, xK.D, @attr, a number) is expected");
  if (!r->op) return *v = 0, true;
  const IrType *ty = rule_type(r, of);
  int64_t numel = ir_type_numel(ty), last = ty->rank ? ty->dim[ty->rank - 1] : 1;
  *v = n ? numel : cols ? last : last ? numel / last : 0;
  return true;
}

// Factors multiplied (`a*b`) and divided rounding up (`a/b`: the blocks of b items each that
// hold a items), left to right.
static bool rule_int(Rule *r, int64_t *v) {
  if (!rule_factor(r, v)) return false;
  for (rule_spaces(r); *r->s == '*' || *r->s == '/'; rule_spaces(r)) {
    int64_t f;
    char o = *r->s++;
    if (!rule_factor(r, &f)) return false;
    if (o == '/' && f <= 0) return rule_fail(r, "a divisor is positive");
    *v = o == '*' ? *v * f : (*v + f - 1) / f;
  }
  return true;
}

// A float argument: @attr[=default] or a number.
static bool rule_float(Rule *r, double *v) {
  rule_spaces(r);
  char word[48];
  if (*r->s != '@') {
    char *end;
    *v = strtod(r->s, &end);
    if (end == r->s) return rule_fail(r, "a float (@attr or a number) is expected");
    r->s = end;
    return true;
  }
  r->s++;
  if (!rule_word(r, word, sizeof word)) return false;
  double def = 0;
  if (*r->s == '=') def = strtod(r->s + 1, (char **)&r->s);
  *v = r->op ? ir_op_float(r->op, word, def) : 0;
  return true;
}

// A pointer argument: an operand, the result, a parameter's gradient or moments.
static bool rule_pointer(Rule *r, CgKernelCall *c) {
  char word[48];
  if (!rule_word(r, word, sizeof word)) return false;
  int t = rule_tensor(word);
  if (t >= r->nargs || (t == -1 && !r->has_result)) return rule_fail(r, "no such operand");
  if (t >= 0) arg(c, CG_ARG_OPERAND, t);
  else if (t == -1) arg(c, CG_ARG_RESULT, 0);
  else if (strcmp(word, "grad") == 0) arg(c, CG_ARG_GRAD, 0);
  else if (strcmp(word, "m") == 0) arg(c, CG_ARG_MOMENT_M, 0);
  else if (strcmp(word, "v") == 0) arg(c, CG_ARG_MOMENT_V, 0);
  else return rule_fail(r, "a pointer (xK, y, grad, m, v) is expected");
  return true;
}

// The step's seed, step, token0, vocab0, lr_scale and grad_scale, where the kernel takes them.
static bool rule_step_value(Rule *r, CgKernelCall *c) {
  const char *names[] = {"seed", "step", "token0", "vocab0", "lr_scale", "grad_scale"};
  CgArgKind kinds[] = {CG_ARG_SEED, CG_ARG_STEP, CG_ARG_TOKEN0, CG_ARG_VOCAB0, CG_ARG_LR_SCALE, CG_ARG_GRAD_SCALE};
  rule_spaces(r);
  for (int i = 0; i < 6; i++) {
    size_t n = strlen(names[i]);
    if (strncmp(r->s, names[i], n) == 0 && !strchr("abcdefghijklmnopqrstuvwxyz_0123456789", r->s[n])) {
      r->s += n;
      arg(c, kinds[i], 0);
      return true;
    }
  }
  return false;
}

// "name(args) : grid" into the next call of l.
static bool rule_call(Rule *r, CgLaunch *l) {
  char name[48];
  if (!rule_word(r, name, sizeof name)) return false;
  int k = cg_kernel_by_name(name);
  if (k < 0) return rule_fail(r, "no such kernel in runtime/kernels.def");
  // a rule runs on every target: the CPU must have the kernel (its CUDA-only ones are lowered in C)
  if (!cg_kernel_info[k].cpu) return rule_fail(r, "a CUDA-only kernel (WHERE CUDA in runtime/kernels.def)");
  if (l->ncalls == (int)(sizeof l->call / sizeof l->call[0])) return rule_fail(r, "too many kernels");
  CgKernelCall *c = call(l, (CgKernel)k, 1);
  rule_spaces(r);
  if (*r->s++ != '(') return rule_fail(r, "'(' is expected");
  for (const char *p = cg_kernel_info[k].sig; *p; p++) {
    if (p != cg_kernel_info[k].sig) {
      rule_spaces(r);
      if (*r->s++ != ',') return rule_fail(r, "',' is expected: fewer arguments than the kernel's parameters");
    }
    int64_t v = 0;
    double f = 0;
    if (*p == 'p') {
      if (!rule_pointer(r, c)) return false;
    } else if (*p == 'f') {
      if (rule_step_value(r, c)) continue;   // lr_scale, grad_scale
      if (!rule_float(r, &f)) return false;
      flt(c, f);
    } else if (!rule_step_value(r, c)) {
      if (!rule_int(r, &v)) return false;
      INTS(c, v);
    }
  }
  rule_spaces(r);
  if (*r->s++ != ')') return rule_fail(r, "')' is expected: more arguments than the kernel's parameters");
  rule_spaces(r);
  if (*r->s++ != ':') return rule_fail(r, "': grid' is expected");
  char grid[16];
  if (!rule_word(r, grid, sizeof grid)) return false;
  if (strcmp(grid, "one") == 0) return true;
  int64_t items, cols;
  if (strcmp(grid, "columns") == 0) {   // columns BLOCKS COLS: the column sums' tiles
    if (!rule_int(r, &items) || !rule_int(r, &cols)) return false;
    c->grid = cg_cuda_column_tiles(items, cols);
    return true;
  }
  if (strcmp(grid, "threads") && strcmp(grid, "blocks")) return rule_fail(r, "threads, blocks, columns or one is expected");
  if (!rule_int(r, &items)) return false;
  c->grid = grid[0] == 't' ? cg_cuda_grid_elems(items) : cg_cuda_grid_blocks(items);
  return true;
}

static bool lower_by_rule(Rule *r, CgLaunch *l) {
  rule_spaces(r);
  if (strncmp(r->s, "lib ", 4) == 0) {
    const char *lib = r->s + 4;
    l->lib = strcmp(lib, "gemm") == 0 ? CG_LIB_GEMM : strcmp(lib, "collective") == 0 ? CG_LIB_COLLECTIVE
           : strcmp(lib, "split") == 0 ? CG_LIB_SPLIT : CG_LIB_NONE;
    return l->lib != CG_LIB_NONE || rule_fail(r, "lib gemm, lib collective or lib split is expected");
  }
  for (;;) {
    if (!rule_call(r, l)) return false;
    rule_spaces(r);
    if (!*r->s) return true;
    if (*r->s++ != ';') return rule_fail(r, "';' or the end is expected");
  }
}

bool cg_lower_rule_check(const char *rule, int nargs, bool has_result, char *why, size_t size) {
  CgLaunch l = {0};
  Rule r = {.s = rule, .nargs = nargs, .has_result = has_result};
  bool ok = lower_by_rule(&r, &l);
  snprintf(why, size, "%s", r.why);
  return ok;
}

// The ops whose lowering is written in C (their KERNEL rule is ""): capacity 0 for a dropless
// layer, coef/share factors and shared memory, the kernel chosen by dtype, byte layouts,
// statistics sinks, notes. False when op is none of these.
static bool lower_in_c(const IrOp *op, const Shapes *sh, CgLaunch *l) {
  const IrType *t0 = sh->t0, *rt = sh->rt;
  int64_t n = sh->n;
  CgKernelCall *c;
  switch (op->kind) {
  case IR_OP_GATE_LOCATIONS:  // dropless: capacity 0 to the kernel, as on the CPU
    c = call(l, CG_K_GATE_LOCATIONS, cg_cuda_grid_blocks(ir_op_int(op, "groups", 1) * ir_op_int(op, "experts", 1)));
    operands(c, 1, true);
    arg(c, CG_ARG_STATS, 0);
    INTS(c, t0->dim[0], t0->dim[1], ir_op_int(op, "experts", 0), ir_op_int(op, "groups", 1),
         ir_op_int(op, "dropless", 0) ? 0 : ir_op_int(op, "capacity", 0));
    return true;
  case IR_OP_GATE_AUX_LOSS:
  case IR_OP_GATE_AUX_LOSS_GRAD: {   // `aux sequence` (attr sequence): DeepSeek-V3's form, its own kernels
    bool grad = op->kind == IR_OP_GATE_AUX_LOSS_GRAD, seq = ir_op_int(op, "sequence", 0);
    c = simple(l, op, seq ? (grad ? CG_K_AUX_SEQ_GRAD : CG_K_AUX_SEQ) : grad ? CG_K_AUX_LOSS_GRAD : CG_K_AUX_LOSS,
               grad ? cg_cuda_grid_blocks(ir_op_int(op, "groups", 1)) : 1);
    if (grad || seq) c->shared_bytes = (unsigned)(t0->dim[1] * (int64_t)sizeof(double) * (grad ? 1 : 2));
    INTS(c, t0->dim[0], t0->dim[1], cg_operand_type(&op->args[1])->dim[1], ir_op_int(op, "groups", 1));
    flt(c, grad ? ir_op_float(op, "coef", 0) / (double)ir_op_int(op, "share", 1) : (double)ir_op_int(op, "share", 1));
    return true;
  }
  case IR_OP_GATE_Z_LOSS:
  case IR_OP_GATE_Z_LOSS_GRAD: {
    bool grad = op->kind == IR_OP_GATE_Z_LOSS_GRAD;
    c = simple(l, op, grad ? CG_K_Z_LOSS_GRAD : CG_K_Z_LOSS, grad ? cg_cuda_grid_elems(t0->dim[0]) : 1);
    INTS(c, t0->dim[0], t0->dim[1], ir_op_int(op, "groups", 1));
    flt(c, grad ? ir_op_float(op, "coef", 0) / (double)ir_op_int(op, "share", 1) : (double)ir_op_int(op, "share", 1));
    return true;
  }
  case IR_OP_HOOK_COMPRESS:
    INTS(simple(l, op, rt->dtype == IR_BF16 ? CG_K_COMPRESS_BF16 : CG_K_COMPRESS_F16, cg_cuda_grid_elems(n)), n);
    return true;
  case IR_OP_HOOK_DECOMPRESS:
    INTS(simple(l, op, t0->dtype == IR_BF16 ? CG_K_DECOMPRESS_BF16 : CG_K_DECOMPRESS_F16, cg_cuda_grid_elems(n)), n);
    return true;
  case IR_OP_HOOK_RECORD:  // statistics on the device; the host writes the record line
    c = call(l, CG_K_RECORD_STATS, 1);
    operands(c, 1, false);
    arg(c, CG_ARG_STATS, 0);
    INTS(c, ir_type_numel(t0));
    snprintf(l->note, sizeof l->note, "point %s, layer %" PRId64, ir_op_str(op, "point", "?"), ir_op_int(op, "layer", 0));
    return true;
  case IR_OP_LAYOUT_CHUNK:
  case IR_OP_LAYOUT_CONCAT: {  // bytes
    int64_t blocks = ir_op_int(op, "blocks", 1);
    int64_t inner = ir_type_bytes(rt) / (rt->dim[0] * rt->dim[1]);
    if (op->kind == IR_OP_LAYOUT_CHUNK) {
      c = simple(l, op, CG_K_LAYOUT_CHUNK, cg_cuda_grid_elems(ir_type_bytes(rt)));
      INTS(c, t0->dim[0], blocks, t0->dim[1] / blocks, inner, ir_op_int(op, "chunks", 1), ir_op_int(op, "index", 0));
    } else {
      c = simple(l, op, CG_K_LAYOUT_CONCAT, cg_cuda_grid_elems(ir_type_bytes(rt)));
      INTS(c, t0->dim[0], blocks, t0->dim[1] / blocks, cg_operand_type(&op->args[1])->dim[1] / blocks, inner);
    }
    return true;
  }
  case IR_OP_PARAM_GRAD: {  // value -> the parameter's gradient; the host skips it when computed in place
    int64_t count = ir_type_numel(&op->args[0].param->type);
    if (ir_op_int(op, "accumulate", 0)) {  // grad += value (a parameter used by two functions)
      c = call(l, CG_K_ADD, cg_cuda_grid_elems(count));
      arg(c, CG_ARG_GRAD, 0);
      arg(c, CG_ARG_OPERAND, 1);
      arg(c, CG_ARG_GRAD, 0);
      INTS(c, count);
      return true;
    }
    c = call(l, CG_K_COPY, cg_cuda_grid_elems(count));
    arg(c, CG_ARG_OPERAND, 1);
    arg(c, CG_ARG_GRAD, 0);
    INTS(c, count);
    snprintf(l->note, sizeof l->note, "nothing when computed in place");
    return true;
  }
  default:
    return false;
  }
}

// Fills l for the single op; false when the op has no lowering.
bool cg_lower_op(const IrOp *op, CgLaunch *l) {
  memset(l, 0, sizeof *l);
  l->nops = 1;
  Shapes sh = {.t0 = op->nargs ? cg_operand_type(&op->args[0]) : NULL, .rt = op->result ? &op->result->type : NULL};
  sh.n = sh.rt ? ir_type_numel(sh.rt) : 0;
  if (ir_op_info[op->kind].kernel[0]) {
    Rule r = {.s = ir_op_info[op->kind].kernel, .op = op, .sh = &sh, .nargs = op->nargs, .has_result = op->result != NULL};
    if (!lower_by_rule(&r, l)) UNREACHABLE();   // tests/unit checks every rule
    return true;
  }
  return lower_in_c(op, &sh, l);
}

// ---- whole-tensor reductions on CUDA ----
// loss.mse and loss.xent reduce a whole tensor into one float; their kernel is one block (the
// CPU's order of the sums, row by row), which on a GPU reads at the speed of one multiprocessor.
// The CUDA target launches them as a grid writing one double per block into the launch's
// scratch, then mk_sum_parts adding those in order: the grid is a function of the shape, so the
// result is the same on every device and every run.
#define CG_MAX_PARTS 512

static int64_t parts_for(int64_t items) { return items < 1 ? 1 : items > CG_MAX_PARTS ? CG_MAX_PARTS : items; }

bool cg_split_reduction(const IrOp *op, int64_t *parts, int64_t *div, double *scale) {
  if (op->kind != IR_OP_LOSS_MSE && op->kind != IR_OP_LOSS_XENT) return false;
  const IrType *x = cg_operand_type(&op->args[0]);
  bool mse = op->kind == IR_OP_LOSS_MSE;
  int64_t rows = x->dim[0], n = ir_type_numel(x);
  *div = mse ? 2 * n : rows;
  // mse: >= 8 elements a thread; xent: a block a row
  *parts = parts_for(mse ? (n + 8 * CG_CUDA_BLOCK - 1) / (8 * CG_CUDA_BLOCK) : rows);
  *scale = ir_op_float(op, "scale", 1);
  return true;
}

// The one-block launch in l of op (loss.mse or loss.xent) as a grid of partial sums and
// mk_sum_parts, built from the op as its KERNEL rule is (ops.def: mse(x0, x1, y, n0, @scale=1),
// xent(x0, x1, y, x0.0, x0.1, @scale=1)): the same shapes, result and scale, named, not taken from
// the one-block call's argument positions.
static void split_reduction(const IrOp *op, CgLaunch *l) {
  int64_t parts, div;
  double scale;
  if (l->lib || l->ncalls != 1 || !cg_split_reduction(op, &parts, &div, &scale)) return;
  const IrType *x = cg_operand_type(&op->args[0]);
  bool mse = op->kind == IR_OP_LOSS_MSE;
  int64_t rows = x->dim[0], cols = x->rank > 1 ? x->dim[1] : 1, n = ir_type_numel(x);
  memset(l->call, 0, sizeof l->call);   // two fresh calls (call() sets only kernel and grid)
  l->ncalls = 0;
  CgKernelCall *c = call(l, mse ? CG_K_MSE_PART : CG_K_XENT_PART, parts);
  operands(c, 2, false);
  arg(c, CG_ARG_SCRATCH, 0);
  if (mse) INTS(c, n);
  else INTS(c, rows, cols);
  c = call(l, CG_K_SUM_PARTS, 1);
  arg(c, CG_ARG_SCRATCH, 0);
  arg(c, CG_ARG_RESULT, 0);
  INTS(c, parts, div);
  flt(c, scale);
  l->scratch_bytes = parts * (int64_t)sizeof(double);
}

static int64_t update_blocks(const IrFunc *f, int i, int nops) {
  int64_t blocks = 0;
  for (int j = i; j < i + nops; j++)
    blocks += (ir_type_numel(&f->ops[j]->args[0].param->type) + CG_UPDATE_CHUNK - 1) / CG_UPDATE_CHUNK;
  return blocks;
}

// The launch of ops i .. i + run of f (an update group of the fuse pass): mk_adamw_ranges or mk_sgd_ranges from op i's
// parameter on, over the table of ranges CG_ARG_RANGES (the host program writes it), with the bf16
// copy P16 where the program has one (CG_ARG_PARAM16 is NULL otherwise).
static void lower_update_run(const IrFunc *f, int i, int run, CgLaunch *l) {
  const IrOp *a = f->ops[i];
  bool adamw = a->kind == IR_OP_OPT_ADAMW;
  memset(l, 0, sizeof *l);
  int64_t blocks = update_blocks(f, i, run + 1);
  CgKernelCall *c = call(l, adamw ? CG_K_ADAMW_RANGES : CG_K_SGD_RANGES, cg_cuda_grid_blocks(blocks));
  arg(c, CG_ARG_OPERAND, 0);
  arg(c, CG_ARG_GRAD, 0);
  if (adamw) arg(c, CG_ARG_MOMENT_M, 0), arg(c, CG_ARG_MOMENT_V, 0);
  arg(c, CG_ARG_RANGES, 0);
  INTS(c, run + 1, blocks, CG_UPDATE_CHUNK);
  if (adamw) {
    flt(c, ir_op_float(a, "beta1", 0.9));
    flt(c, ir_op_float(a, "beta2", 0.999));
    flt(c, ir_op_float(a, "eps", 1e-8));
    arg(c, CG_ARG_STEP, 0);
  }
  arg(c, CG_ARG_LR_SCALE, 0);
  arg(c, CG_ARG_GRAD_SCALE, 0);
  arg(c, CG_ARG_PARAM16, 0);
  l->nops = 1 + run;
  if (run > 0) snprintf(l->note, sizeof l->note, "the update of %d parameters in one launch", 1 + run);
}

// An update op by op (--no-fuse, or a scheduled function) with dtype bf16: the kernel that also
// rounds the parameters into their bf16 copy, its last argument that copy.
static void update_bf16(CgLaunch *l) {
  CgKernelCall *c = &l->call[0];
  if (l->ncalls != 1 || (c->kernel != CG_K_ADAMW && c->kernel != CG_K_SGD)) return;
  c->kernel = c->kernel == CG_K_ADAMW ? CG_K_ADAMW_BF16 : CG_K_SGD_BF16;
  arg(c, CG_ARG_PARAM16, 0);
}

// The gate group at op i of f: one kernel, a thread a token; the logits (op i's operand), then
// the scores, idx and gates (the results of ops i, i+1, i+2).
static void lower_gate(const IrFunc *f, int i, CgLaunch *l) {
  memset(l, 0, sizeof *l);
  const IrOp *a = f->ops[i], *g = f->ops[i + 2];
  const IrType *st = &a->result->type;
  CgKernelCall *c = call(l, a->kind == IR_OP_GATE_SOFTMAX ? CG_K_GATE_SOFTMAX_TOPK_GATHER : CG_K_GATE_SIGMOID_TOPK_GATHER,
                         cg_cuda_grid_elems(st->dim[0]));
  arg(c, CG_ARG_OPERAND, 0);
  for (int r = 0; r < 3; r++) arg(c, CG_ARG_RESULT, r);
  INTS(c, st->dim[0], st->dim[1], g->result->type.dim[1], ir_op_int(g, "renorm", 0));
  l->nops = 3;
}

// ---- attention on tensor cores (CG_LOWER_ATTN_TC) ----
// The tensor-core twin of each attention kernel (codegen/cuda/attn.cu, "attention on tensor
// cores"): a block of CG_CUDA_BLOCK threads takes CG_CUDA_BLOCK / 2 rows (16 a warp) of one
// sample and head (kv head for dk, dv); heads of a multiple of 16 columns, at most 128.
static const struct {
  CgKernel from, to;
} attn_tc_kernels[] = {
    {CG_K_ATTN_FWD, CG_K_ATTN_TC_FWD},         {CG_K_ATTN_SINK_FWD, CG_K_ATTN_TC_SINK_FWD},
    {CG_K_ATTN_STATS, CG_K_ATTN_TC_STATS},     {CG_K_ATTN_SINK_STATS, CG_K_ATTN_TC_SINK_STATS},
    {CG_K_ATTN_GRAD_Q, CG_K_ATTN_TC_GRAD_Q},   {CG_K_ATTN_GRAD_KV, CG_K_ATTN_TC_GRAD_KV},
};

static void attn_tc(CgLaunch *l) {
  for (int c = 0; c < l->ncalls; c++) {
    CgKernelCall *k = &l->call[c];
    int to = -1, p = 0;
    for (size_t t = 0; t < sizeof attn_tc_kernels / sizeof attn_tc_kernels[0]; t++)
      if (k->kernel == (int)attn_tc_kernels[t].from) to = attn_tc_kernels[t].to;
    if (to < 0) continue;
    while (p < k->nargs && k->args[p].kind != CG_ARG_INT) p++;   // rows, seq, heads, kv, qcols
    if (p + 4 >= k->nargs) UNREACHABLE();
    int64_t rows = k->args[p].i, seq = k->args[p + 1].i, heads = k->args[p + 2].i, kv = k->args[p + 3].i,
            d = k->args[p + 4].i / heads, per = CG_CUDA_BLOCK / 2;
    if (d % 16 != 0 || d > 128) return;   // every call of the op or none
    k->kernel = to;
    k->grid = cg_cuda_grid_blocks(rows / seq * (to == CG_K_ATTN_TC_GRAD_KV ? kv : heads) * ((seq + per - 1) / per));
  }
}

bool cg_attn_tc(const CgLaunch *l) {
  for (int c = 0; c < l->ncalls; c++)
    for (size_t t = 0; t < sizeof attn_tc_kernels / sizeof attn_tc_kernels[0]; t++)
      if (l->call[c].kernel == (int)attn_tc_kernels[t].to) return true;
  return false;
}

bool cg_lower_from(const IrFunc *f, int i, unsigned how, const CgLaunch *alone, CgLaunch *l) {
  bool fuse = how & CG_LOWER_FUSE;
  const IrGroup *g = fuse ? ir_group_at(f, i) : NULL;
  if (g && g->first == i && g->kind == IR_GROUP_UPDATE) {
    lower_update_run(f, i, g->n - 1, l);
    return true;
  }
  if (g && g->first == i && g->kind == IR_GROUP_GATE) {
    lower_gate(f, i, l);
    return true;
  }
  if (!alone) return false;
  *l = *alone;
  CgRows r;
  if ((how & CG_LOWER_ROWS) && l->lib == CG_LIB_GEMM && cg_expert_rows(f->ops[i], &r)) {
    // dtype bf16: from the copy the GEMM reads when its maker wrote one (the value may be stored so only)
    bool copy = (how & CG_LOWER_BF16) && pass_reads_copy(f->ops[i], r.operand);
    int64_t cwidth = ir_op_int(f->ops[i], "ta", 0) ? 0 : f->ops[i]->result->type.dim[2];   // its rows past the counts zeroed
    l->rows_operand = r.operand;
    if (r.route && (how & CG_LOWER_ROUTE)) {   // from the routing: idx and loc of the order op
      const IrOp *o = r.route;
      // about 16 parts a block of slots (each reads its routing group's choices), at most a row's
      int64_t part = (r.rows + 15) / 16, parts;
      if (part < cg_rows_part(cwidth > 0 ? cwidth : r.width)) part = cg_rows_part(cwidth > 0 ? cwidth : r.width);
      if (cwidth == 0 || part > r.rows) part = r.rows;
      parts = (r.rows + part - 1) / part;
      CgKernelCall *c = call(l, CG_K_EXPERT_COUNTS_ROUTE, cg_cuda_grid_blocks(r.groups * parts));
      c->args[c->nargs++] = (CgArg){.kind = CG_ARG_OPERAND, .i = o->index - i, .index = 1};   // idx
      arg(c, CG_ARG_SCRATCH, 0);
      arg(c, CG_ARG_RESULT, 0);
      INTS(c, r.groups, r.rows, o->args[1].value->type.dim[0], cwidth, part);
      c->args[c->nargs++] = (CgArg){.kind = CG_ARG_OPERAND, .i = o->index - i, .index = 2};   // loc
      INTS(c, o->args[1].value->type.dim[1], ir_op_int(o, "groups", 1));
      l->scratch_bytes = 4 * r.groups * (int64_t)sizeof(int32_t);   // the counts, clamped, plus one (twice)
      snprintf(l->note, sizeof l->note, "over the routed rows of operand %d (%" PRId64 " blocks an expert; %%%s's routing)",
               r.operand, r.blocks, o->args[2].value->name);
    } else {
      int64_t part = cg_rows_part(r.width), parts = (r.rows + part - 1) / part;
      CgKernelCall *c = call(l, copy ? CG_K_EXPERT_COUNTS_BF16 : CG_K_EXPERT_COUNTS, cg_cuda_grid_blocks(r.groups * parts));
      arg(c, copy ? CG_ARG_OPERAND16 : CG_ARG_OPERAND, r.operand);
      arg(c, CG_ARG_SCRATCH, 0);
      arg(c, CG_ARG_RESULT, 0);   // (ta: none, cwidth 0)
      INTS(c, r.groups, r.rows, r.width, cwidth, part);
      // the counts, clamped, plus one (twice), then the kernel's maxima and arrivals (zeros between launches)
      l->scratch_bytes = 6 * r.groups * (int64_t)sizeof(int32_t);
      snprintf(l->note, sizeof l->note, "over the filled rows of operand %d (%" PRId64 " blocks an expert)", r.operand,
               r.blocks);
    }
  }
  if ((how & CG_LOWER_MAP) && !(how & CG_LOWER_CPU) && cg_slot_map_op(f->ops[i]) && l->ncalls == 1 &&
      (l->call[0].kernel == CG_K_ORDER_ENCODE || l->call[0].kernel == CG_K_ORDER_DECODE_GRAD_Y))
    cg_slot_map(l, &alone->call[0]);
  if (fuse) split_reduction(f->ops[i], l);
  if (how & CG_LOWER_BF16) update_bf16(l);
  if ((how & CG_LOWER_ATTN_TC) && !(how & CG_LOWER_CPU)) attn_tc(l);
  return true;
}

bool cg_slot_map_op(const IrOp *op) { return op->kind == IR_OP_ORDER_ENCODE || op->kind == IR_OP_ORDER_DECODE_GRAD_Y; }

void cg_slot_map(CgLaunch *l, const CgKernelCall *alone) {
  CgKernelCall row = l->call[0];
  int n = alone->nargs;   // ..., s m k e g cap
  int64_t s = alone->args[n - 6].i, k = alone->args[n - 4].i, e = alone->args[n - 3].i, g = alone->args[n - 2].i,
          cap = alone->args[n - 1].i, rows = e * (g > 1 ? g : 1) * cap;
  if (row.kernel == CG_K_ORDER_ENCODE || row.kernel == CG_K_ORDER_DECODE_GRAD_Y) {
    CgKernelCall twin = {.kernel = row.kernel == CG_K_ORDER_ENCODE ? CG_K_ORDER_ENCODE_MAP : CG_K_ORDER_DECODE_GRAD_Y_MAP,
                         .grid = row.grid};
    for (int a = 0; a < row.nargs; a++) {
      if (row.args[a].kind == CG_ARG_RESULT) arg(&twin, CG_ARG_SCRATCH, 0);
      twin.args[twin.nargs++] = row.args[a];
    }
    INTS(&twin, 1);   // past: every row
    row = twin;
  }
  memset(l->call, 0, sizeof l->call);
  l->ncalls = 0;
  CgKernelCall *c = call(l, CG_K_SLOT_MAP, cg_cuda_grid_elems(s * k));
  arg(c, CG_ARG_OPERAND, 1);   // idx, loc (of the op itself, a group's first member)
  arg(c, CG_ARG_OPERAND, 2);
  arg(c, CG_ARG_SCRATCH, 0);
  INTS(c, s, k, e, g, cap);
  l->call[l->ncalls++] = row;
  l->scratch_bytes = (rows + (rows + 15) / 16) * (int64_t)sizeof(int32_t);
}

int64_t cg_rows_part(int64_t width) { return width >= 32768 ? 1 : 32768 / (width > 0 ? width : 1); }

bool cg_counts_rows(const CgLaunch *l) {
  return l->lib == CG_LIB_GEMM && l->ncalls == 1 &&
         (l->call[0].kernel == CG_K_EXPERT_COUNTS || l->call[0].kernel == CG_K_EXPERT_COUNTS_BF16 ||
          l->call[0].kernel == CG_K_EXPERT_COUNTS_ROUTE);
}

bool cg_lower(const IrFunc *f, int i, unsigned how, CgLaunch *l) {
  CgLaunch alone;
  bool ok = cg_lower_op(f->ops[i], &alone);
  return cg_lower_from(f, i, how, ok ? &alone : NULL, l);
}


#undef INTS
