// The op lowering, written once for both targets: which kernels an op runs, in order, each with
// one typed argument per kernel parameter (the op's operands and result, a parameter's gradient
// and moments, literal shapes and attributes, the step's seed, step and token0, a statistics
// sink) and the grid the CUDA kernel's loops are written for; GEMMs and collectives are marked
// for the target's BLAS and collective library instead (CgLib). The CPU program prints each call
// as rt_NAME(...) (emit_c.c); the CUDA kernel unit's launch plan and the CUDA host program launch
// mk_NAME (emit_cuda.c, emit_cuda_host.c); kernels are the rows of codegen/kernels.def.
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cg_internal.h"

static const char *const kernel_names[CG_K_COUNT] = {
#define CG_KERNEL(ID, NAME, SIG) [CG_K_##ID] = NAME,
#include "kernels.def"
#undef CG_KERNEL
};

const char *cg_kernel_name(int k) { return k >= 0 && k < CG_K_COUNT ? kernel_names[k] : "?"; }

// ---- which kernels an op launches, with every argument ----
// Every CUDA kernel runs CG_CUDA_BLOCK (= MK_BLOCK) threads per block; the grid is the one the
// kernel's loops are written for: per element (MK_FOR), per row, token, choice or group
// (MK_FOR_BLOCKS), or a single block for the whole-tensor reductions. The CPU ignores grids.

static const IrType *arg_type(const IrOp *op, int i) {
  return op->args[i].param ? &op->args[i].param->type : &op->args[i].value->type;
}

static int64_t clamp_grid(int64_t g) { return g < 1 ? 1 : g > 65535 ? 65535 : g; }
static int64_t grid_elems(int64_t n) { return clamp_grid((n + CG_CUDA_BLOCK - 1) / CG_CUDA_BLOCK); }
static int64_t grid_blocks(int64_t n) { return clamp_grid(n); }

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

// Routing shape shared by encode/decode: s m k e g cap, as emit_c's route_dims.
static void route(CgKernelCall *c, const IrOp *op, int64_t s, int64_t m, int64_t k) {
  INTS(c, s, m, k, ir_op_int(op, "experts", 0), ir_op_int(op, "groups", 1), ir_op_int(op, "capacity", 0));
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

// GEMMs and collectives (left to the target's libraries), dense algebra, activations; false when op is none of these.
static bool lower_dense(const IrOp *op, const Shapes *sh, CgLaunch *l) {
  const IrType *t0 = sh->t0, *rt = sh->rt;
  int64_t n = sh->n;
  CgKernelCall *c;
  switch (op->kind) {
  case IR_OP_MATMUL:
  case IR_OP_EXPERT_MATMUL:
    l->lib = CG_LIB_GEMM;
    return true;
  case IR_OP_COMM_ALLGATHER:
  case IR_OP_COMM_REDUCESCATTER:
  case IR_OP_COMM_ALLTOALL:
  case IR_OP_COMM_ALLREDUCE:
  case IR_OP_COMM_ALLREDUCE_GRAD:
    l->lib = CG_LIB_COLLECTIVE;
    return true;
  case IR_OP_COMM_SPLIT:  // this rank's slice: a device-to-device copy at the rank's offset
    l->lib = CG_LIB_SPLIT;
    return true;
  case IR_OP_BIAS: INTS(simple(l, op, CG_K_BIAS, grid_elems(n)), rt->dim[0], rt->dim[1]); return true;
  case IR_OP_BIAS_GRAD: INTS(simple(l, op, CG_K_BIAS_GRAD, grid_elems(n)), t0->dim[0], t0->dim[1]); return true;
  case IR_OP_EXPERT_BIAS:
    INTS(simple(l, op, CG_K_EXPERT_BIAS, grid_elems(n)), rt->dim[0], rt->dim[1], rt->dim[2]);
    return true;
  case IR_OP_EXPERT_BIAS_GRAD:
    INTS(simple(l, op, CG_K_EXPERT_BIAS_GRAD, grid_elems(n)), t0->dim[0], t0->dim[1], t0->dim[2]);
    return true;
  case IR_OP_ADD: INTS(simple(l, op, CG_K_ADD, grid_elems(n)), n); return true;
  case IR_OP_MUL: INTS(simple(l, op, CG_K_MUL, grid_elems(n)), n); return true;
  case IR_OP_ACT_GELU: INTS(simple(l, op, CG_K_GELU, grid_elems(n)), n); return true;
  case IR_OP_ACT_GELU_GRAD: INTS(simple(l, op, CG_K_GELU_GRAD, grid_elems(n)), n); return true;
  case IR_OP_ACT_RELU: INTS(simple(l, op, CG_K_RELU, grid_elems(n)), n); return true;
  case IR_OP_ACT_RELU_GRAD: INTS(simple(l, op, CG_K_RELU_GRAD, grid_elems(n)), n); return true;
  case IR_OP_ACT_SILU: INTS(simple(l, op, CG_K_SILU, grid_elems(n)), n); return true;
  case IR_OP_ACT_SILU_GRAD: INTS(simple(l, op, CG_K_SILU_GRAD, grid_elems(n)), n); return true;
  case IR_OP_RESHAPE: INTS(simple(l, op, CG_K_COPY, grid_elems(n)), n); return true;
  case IR_OP_L2NORM:
  case IR_OP_L2NORM_GRAD: {
    int64_t cols = rt->dim[rt->rank - 1];
    c = simple(l, op, op->kind == IR_OP_L2NORM ? CG_K_L2NORM : CG_K_L2NORM_GRAD, grid_blocks(n / cols));
    INTS(c, n / cols, cols);
    return true;
  }
  case IR_OP_DIV_SCALAR: INTS(simple(l, op, CG_K_DIV_SCALAR, grid_elems(n)), n); return true;
  case IR_OP_DIV_SCALAR_GRAD_X: INTS(simple(l, op, CG_K_DIV_SCALAR_GRAD_X, grid_elems(n)), n); return true;
  case IR_OP_DIV_SCALAR_GRAD_S: INTS(simple(l, op, CG_K_DIV_SCALAR_GRAD_S, 1), ir_type_numel(t0)); return true;
  default:
    return false;
  }
}

// The gate chain: noise, scores, top-k, routing decisions, auxiliary losses; false when op is none of these.
static bool lower_gate(const IrOp *op, const Shapes *sh, CgLaunch *l) {
  const IrType *t0 = sh->t0, *rt = sh->rt;
  int64_t n = sh->n;
  CgKernelCall *c;
  switch (op->kind) {
  case IR_OP_GATE_NOISE:
    c = simple(l, op, CG_K_GATE_NOISE, grid_elems(n));
    INTS(c, rt->dim[0], rt->dim[1]);
    flt(c, ir_op_float(op, "sigma", 0));
    INTS(c, ir_op_int(op, "layer", 0));
    arg(c, CG_ARG_SEED, 0);
    arg(c, CG_ARG_STEP, 0);
    arg(c, CG_ARG_TOKEN0, 0);
    return true;
  case IR_OP_GATE_SOFTMAX: INTS(simple(l, op, CG_K_SOFTMAX, grid_elems(rt->dim[0])), rt->dim[0], rt->dim[1]); return true;
  case IR_OP_GATE_SOFTMAX_GRAD:
    INTS(simple(l, op, CG_K_SOFTMAX_GRAD, grid_elems(rt->dim[0])), rt->dim[0], rt->dim[1]);
    return true;
  case IR_OP_GATE_SIGMOID: INTS(simple(l, op, CG_K_SIGMOID, grid_elems(n)), n); return true;
  case IR_OP_GATE_SIGMOID_GRAD: INTS(simple(l, op, CG_K_SIGMOID_GRAD, grid_elems(n)), n); return true;
  case IR_OP_GATE_SOFTMAX_TOKENS:
  case IR_OP_GATE_SOFTMAX_TOKENS_GRAD: {
    int64_t g = ir_op_int(op, "groups", 1);
    c = simple(l, op, op->kind == IR_OP_GATE_SOFTMAX_TOKENS ? CG_K_SOFTMAX_TOKENS : CG_K_SOFTMAX_TOKENS_GRAD,
               grid_elems(g * rt->dim[1]));
    INTS(c, rt->dim[0], rt->dim[1], g);
    return true;
  }
  case IR_OP_GATE_TOPK: INTS(simple(l, op, CG_K_TOPK, grid_elems(t0->dim[0])), t0->dim[0], t0->dim[1], rt->dim[1]); return true;
  case IR_OP_GATE_GATHER:
    INTS(simple(l, op, CG_K_GATE_GATHER, grid_elems(t0->dim[0])), t0->dim[0], t0->dim[1], rt->dim[1],
         ir_op_int(op, "renorm", 0));
    return true;
  case IR_OP_GATE_GATHER_GRAD:
    INTS(simple(l, op, CG_K_GATE_GATHER_GRAD, grid_elems(rt->dim[0])), rt->dim[0], rt->dim[1], t0->dim[1],
         ir_op_int(op, "renorm", 0));
    return true;
  case IR_OP_GATE_LOCATIONS:  // dropless: capacity 0 to the kernel, as on the CPU
    c = call(l, CG_K_GATE_LOCATIONS, grid_blocks(ir_op_int(op, "groups", 1) * ir_op_int(op, "experts", 1)));
    operands(c, 1, true);
    arg(c, CG_ARG_STATS, 0);
    INTS(c, t0->dim[0], t0->dim[1], ir_op_int(op, "experts", 0), ir_op_int(op, "groups", 1),
         ir_op_int(op, "dropless", 0) ? 0 : ir_op_int(op, "capacity", 0));
    return true;
  case IR_OP_GATE_EXPERT_CHOICE:
    c = simple(l, op, CG_K_EXPERT_CHOICE, grid_blocks(ir_op_int(op, "groups", 1) * t0->dim[1]));
    INTS(c, t0->dim[0], t0->dim[1], ir_op_int(op, "groups", 1), ir_op_int(op, "capacity", 0));
    return true;
  case IR_OP_GATE_IOTA:  // the scores operand only gives the shape
    c = call(l, CG_K_IOTA, grid_elems(n));
    arg(c, CG_ARG_RESULT, 0);
    INTS(c, rt->dim[0], rt->dim[1]);
    return true;
  case IR_OP_GATE_AUX_LOSS:
    c = simple(l, op, CG_K_AUX_LOSS, 1);
    INTS(c, t0->dim[0], t0->dim[1], arg_type(op, 1)->dim[1], ir_op_int(op, "groups", 1));
    flt(c, (double)ir_op_int(op, "share", 1));
    return true;
  case IR_OP_GATE_AUX_LOSS_GRAD:
    c = simple(l, op, CG_K_AUX_LOSS_GRAD, grid_blocks(ir_op_int(op, "groups", 1)));
    c->shared_bytes = (unsigned)(t0->dim[1] * (int64_t)sizeof(double));
    INTS(c, t0->dim[0], t0->dim[1], arg_type(op, 1)->dim[1], ir_op_int(op, "groups", 1));
    flt(c, ir_op_float(op, "coef", 0) / (double)ir_op_int(op, "share", 1));
    return true;
  case IR_OP_GATE_Z_LOSS:
    c = simple(l, op, CG_K_Z_LOSS, 1);
    INTS(c, t0->dim[0], t0->dim[1], ir_op_int(op, "groups", 1));
    flt(c, (double)ir_op_int(op, "share", 1));
    return true;
  case IR_OP_GATE_Z_LOSS_GRAD:
    c = simple(l, op, CG_K_Z_LOSS_GRAD, grid_elems(t0->dim[0]));
    INTS(c, t0->dim[0], t0->dim[1], ir_op_int(op, "groups", 1));
    flt(c, ir_op_float(op, "coef", 0) / (double)ir_op_int(op, "share", 1));
    return true;
  default:
    return false;
  }
}

// Dispatch and combine (the orders), hooks, layouts; false when op is none of these.
static bool lower_route(const IrOp *op, const Shapes *sh, CgLaunch *l) {
  const IrType *t0 = sh->t0, *rt = sh->rt;
  int64_t n = sh->n;
  CgKernelCall *c;
  switch (op->kind) {
  case IR_OP_ORDER_ENCODE:  // empty slots are zero: the dispatch buffer is cleared first
    c = call(l, CG_K_ZERO, grid_elems(n));
    arg(c, CG_ARG_RESULT, 0);
    INTS(c, n);
    route(simple(l, op, CG_K_ORDER_ENCODE, grid_blocks(t0->dim[0] * arg_type(op, 1)->dim[1])), op, t0->dim[0],
          t0->dim[1], arg_type(op, 1)->dim[1]);
    return true;
  case IR_OP_ORDER_ENCODE_GRAD:
    route(simple(l, op, CG_K_ORDER_ENCODE_GRAD, grid_blocks(rt->dim[0])), op, rt->dim[0], rt->dim[1],
          arg_type(op, 1)->dim[1]);
    return true;
  case IR_OP_ORDER_DECODE:
    route(simple(l, op, CG_K_ORDER_DECODE, grid_blocks(rt->dim[0])), op, rt->dim[0], rt->dim[1], arg_type(op, 1)->dim[1]);
    return true;
  case IR_OP_ORDER_DECODE_GRAD_Y:
    c = call(l, CG_K_ZERO, grid_elems(n));
    arg(c, CG_ARG_RESULT, 0);
    INTS(c, n);
    route(simple(l, op, CG_K_ORDER_DECODE_GRAD_Y, grid_blocks(t0->dim[0] * arg_type(op, 1)->dim[1])), op, t0->dim[0],
          t0->dim[1], arg_type(op, 1)->dim[1]);
    return true;
  case IR_OP_ORDER_DECODE_GRAD_G:
    route(simple(l, op, CG_K_ORDER_DECODE_GRAD_GATES, grid_blocks(t0->dim[0] * arg_type(op, 2)->dim[1])), op,
          t0->dim[0], t0->dim[1], arg_type(op, 2)->dim[1]);
    return true;
  case IR_OP_ORDER_DISPATCH_MASK:
  case IR_OP_ORDER_COMBINE_WEIGHTS:
  case IR_OP_ORDER_COMBINE_WEIGHTS_GRAD: {
    const IrType *idx = arg_type(op, op->kind == IR_OP_ORDER_COMBINE_WEIGHTS_GRAD ? 1 : 0);
    if (op->kind == IR_OP_ORDER_COMBINE_WEIGHTS_GRAD)
      c = simple(l, op, CG_K_COMBINE_WEIGHTS_GRAD, grid_elems(idx->dim[0] * idx->dim[1]));
    else
      c = simple(l, op, op->kind == IR_OP_ORDER_DISPATCH_MASK ? CG_K_DISPATCH_MASK : CG_K_COMBINE_WEIGHTS,
                 grid_blocks(idx->dim[0]));
    INTS(c, idx->dim[0], idx->dim[1], ir_op_int(op, "experts", 0), ir_op_int(op, "groups", 1),
         ir_op_int(op, "capacity", 0));
    return true;
  }
  case IR_OP_HOOK_COMPRESS:
    INTS(simple(l, op, rt->dtype == IR_BF16 ? CG_K_COMPRESS_BF16 : CG_K_COMPRESS_F16, grid_elems(n)), n);
    return true;
  case IR_OP_HOOK_DECOMPRESS:
    INTS(simple(l, op, t0->dtype == IR_BF16 ? CG_K_DECOMPRESS_BF16 : CG_K_DECOMPRESS_F16, grid_elems(n)), n);
    return true;
  case IR_OP_HOOK_SCALES:
  case IR_OP_HOOK_COMPRESS_INT8:
  case IR_OP_HOOK_DECOMPRESS_INT8: {
    int64_t cols = t0->dim[t0->rank - 1], rows = ir_type_numel(t0) / cols;
    if (op->kind == IR_OP_HOOK_SCALES) c = simple(l, op, CG_K_INT8_SCALES, grid_blocks(rows));
    else c = simple(l, op, op->kind == IR_OP_HOOK_COMPRESS_INT8 ? CG_K_COMPRESS_INT8 : CG_K_DECOMPRESS_INT8, grid_elems(rows * cols));
    INTS(c, rows, cols);
    return true;
  }
  case IR_OP_HOOK_RECORD:  // statistics on the device; the host writes the record line
    c = call(l, CG_K_RECORD_STATS, 1);
    operands(c, 1, false);
    arg(c, CG_ARG_STATS, 0);
    INTS(c, ir_type_numel(t0));
    snprintf(l->note, sizeof l->note, "point %s, layer %" PRId64, ir_op_str(op, "point", "?"), ir_op_int(op, "layer", 0));
    return true;
  case IR_OP_LAYOUT_EXPERT_MAJOR:
  case IR_OP_LAYOUT_RANK_MAJOR: {
    bool em = op->kind == IR_OP_LAYOUT_EXPERT_MAJOR;
    c = simple(l, op, em ? CG_K_EXPERT_MAJOR : CG_K_RANK_MAJOR, grid_elems(n));
    INTS(c, ir_op_int(op, "blocks", 1), em ? rt->dim[0] : t0->dim[0], em ? t0->dim[1] : rt->dim[1], rt->dim[2]);
    return true;
  }
  case IR_OP_LAYOUT_CHUNK:
  case IR_OP_LAYOUT_CONCAT: {  // bytes
    int64_t blocks = ir_op_int(op, "blocks", 1);
    int64_t inner = ir_type_bytes(rt) / (rt->dim[0] * rt->dim[1]);
    if (op->kind == IR_OP_LAYOUT_CHUNK) {
      c = simple(l, op, CG_K_LAYOUT_CHUNK, grid_elems(ir_type_bytes(rt)));
      INTS(c, t0->dim[0], blocks, t0->dim[1] / blocks, inner, ir_op_int(op, "chunks", 1), ir_op_int(op, "index", 0));
    } else {
      c = simple(l, op, CG_K_LAYOUT_CONCAT, grid_elems(ir_type_bytes(rt)));
      INTS(c, t0->dim[0], blocks, t0->dim[1] / blocks, arg_type(op, 1)->dim[1] / blocks, inner);
    }
    return true;
  }
  default:
    return false;
  }
}

// The loss, gradients into parameters, optimizers; false when op is none of these.
static bool lower_step(const IrOp *op, const Shapes *sh, CgLaunch *l) {
  const IrType *t0 = sh->t0;
  int64_t n = sh->n;
  CgKernelCall *c;
  switch (op->kind) {
  case IR_OP_LOSS_MSE:
    c = simple(l, op, CG_K_MSE, 1);
    INTS(c, ir_type_numel(t0));
    flt(c, ir_op_float(op, "scale", 1));
    return true;
  case IR_OP_LOSS_MSE_GRAD:
    c = simple(l, op, CG_K_MSE_GRAD, grid_elems(n));
    INTS(c, n);
    flt(c, ir_op_float(op, "scale", 1));
    return true;
  case IR_OP_PARAM_GRAD: {  // value -> the parameter's gradient; the host skips it when computed in place
    int64_t count = ir_type_numel(&op->args[0].param->type);
    c = call(l, CG_K_COPY, grid_elems(count));
    arg(c, CG_ARG_OPERAND, 1);
    arg(c, CG_ARG_GRAD, 0);
    INTS(c, count);
    snprintf(l->note, sizeof l->note, "nothing when computed in place");
    return true;
  }
  case IR_OP_OPT_SGD: {
    int64_t count = ir_type_numel(t0);
    c = call(l, CG_K_SGD, grid_elems(count));
    arg(c, CG_ARG_OPERAND, 0);
    arg(c, CG_ARG_GRAD, 0);
    INTS(c, count);
    flt(c, ir_op_float(op, "lr", 0));
    flt(c, ir_op_float(op, "weight_decay", 0));
    return true;
  }
  case IR_OP_OPT_ADAMW: {
    int64_t count = ir_type_numel(t0);
    c = call(l, CG_K_ADAMW, grid_elems(count));
    arg(c, CG_ARG_OPERAND, 0);
    arg(c, CG_ARG_GRAD, 0);
    arg(c, CG_ARG_MOMENT_M, 0);
    arg(c, CG_ARG_MOMENT_V, 0);
    INTS(c, count);
    flt(c, ir_op_float(op, "lr", 0));
    flt(c, ir_op_float(op, "beta1", 0.9));
    flt(c, ir_op_float(op, "beta2", 0.999));
    flt(c, ir_op_float(op, "eps", 1e-8));
    flt(c, ir_op_float(op, "weight_decay", 0));
    arg(c, CG_ARG_STEP, 0);
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
  Shapes sh = {.t0 = op->nargs ? arg_type(op, 0) : NULL, .rt = op->result ? &op->result->type : NULL};
  sh.n = sh.rt ? ir_type_numel(sh.rt) : 0;
  return lower_dense(op, &sh, l) || lower_gate(op, &sh, l) || lower_route(op, &sh, l) || lower_step(op, &sh, l);
}

// ---- fused gates ----

// Arena byte range of value v, or false when it is not in the arena.
static bool arena_range(const PassMemPlan *plan, const IrValue *v, int64_t *lo, int64_t *hi) {
  const PassMemSlot *s = &plan->slot[v->func->index][v->id];
  if (s->kind != PASS_MEM_ARENA) return false;
  *lo = s->offset;
  *hi = s->offset + ir_type_bytes(&v->type);
  return true;
}

static bool overlap(const PassMemPlan *plan, const IrValue *a, const IrValue *b) {
  int64_t a0, a1, b0, b1;
  if (!arena_range(plan, a, &a0, &a1) || !arena_range(plan, b, &b0, &b1)) return false;
  return a0 < b1 && b0 < a1;
}

// Ops i, i+1, i+2 of f are `scores = gate.softmax|gate.sigmoid x`, `idx = gate.topk scores`,
// `gates = gate.gather scores, idx` with no buffer of the four shared (one thread writes a
// token's scores, idx and gates while others read logits), on one stream with no event
// recorded or waited for between them: one fused kernel does them.
static bool fused_gate_at(const PassMemPlan *plan, const IrFunc *f, int i) {
  if (i + 2 >= f->nops) return false;
  const IrOp *a = f->ops[i], *b = f->ops[i + 1], *c = f->ops[i + 2];
  if ((a->kind != IR_OP_GATE_SOFTMAX && a->kind != IR_OP_GATE_SIGMOID) || b->kind != IR_OP_GATE_TOPK ||
      c->kind != IR_OP_GATE_GATHER)
    return false;
  if (!a->args[0].value || b->args[0].value != a->result || c->args[0].value != a->result ||
      c->args[1].value != b->result)
    return false;
  if (a->result->type.rank != 2 || a->result->type.dtype != IR_F32) return false;
  if (b->stream != a->stream || c->stream != a->stream || a->event >= 0 || b->event >= 0 || b->nwaits > 0 ||
      c->nwaits > 0)
    return false;
  const IrValue *v[4] = {a->args[0].value, a->result, b->result, c->result};
  for (int p = 0; p < 4; p++)
    for (int q = p + 1; q < 4; q++)
      if (overlap(plan, v[p], v[q])) return false;
  return true;
}

bool cg_lower(const PassMemPlan *plan, const IrFunc *f, int i, bool fuse, CgLaunch *l) {
  if (!fuse || !fused_gate_at(plan, f, i)) return cg_lower_op(f->ops[i], l);
  memset(l, 0, sizeof *l);
  // logits (op i's operand), then scores, idx and gates (the results of ops i, i+1, i+2).
  const IrOp *a = f->ops[i], *g = f->ops[i + 2];
  const IrType *st = &a->result->type;
  CgKernelCall *c = call(l, a->kind == IR_OP_GATE_SOFTMAX ? CG_K_GATE_SOFTMAX_TOPK_GATHER : CG_K_GATE_SIGMOID_TOPK_GATHER,
                         grid_elems(st->dim[0]));
  arg(c, CG_ARG_OPERAND, 0);
  for (int r = 0; r < 3; r++) arg(c, CG_ARG_RESULT, r);
  INTS(c, st->dim[0], st->dim[1], g->result->type.dim[1], ir_op_int(g, "renorm", 0));
  l->nops = 3;
  return true;
}

#undef INTS

int64_t cg_cuda_grid_elems(int64_t n) { return grid_elems(n); }
