// The CPU target's emitter: one C statement per IR op, in program order; functions whose ops
// the schedule put on several streams become task tables run by rt_run_streams (see below).
//
// The emitted program has a parameter table (names, shapes, init, offsets into one flat
// buffer), three step functions — forward (layer forwards and the loss), backward (the loss
// gradient and layer backwards) and update (the optimizer) — and a main() that hands them to
// rt_main(). Every value is an address fixed at compile time: an offset into the activation
// arena from memplan, the step's input or target, or a parameter's gradient buffer. Shapes and
// attributes become integer and float literals, so the program has no interpretation left.
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cg_internal.h"

typedef struct Emit {
  FILE *out;
  IrDiag *d;
  const IrModule *m;
  const PassMemPlan *plan;
  int64_t *param_offset;   // floats, by param index
} Emit;

// The C expression for value v (a pointer of the value's element type).
static void value_expr(Emit *e, char *buf, size_t n, const IrValue *v) {
  const PassMemSlot *s = &e->plan->slot[v->func->index][v->id];
  const char *ctype = v->type.dtype == IR_I32   ? "int32_t"
                      : v->type.dtype == IR_I8  ? "int8_t"
                      : v->type.dtype == IR_F16 || v->type.dtype == IR_BF16 ? "uint16_t"
                                                : "float";
  switch (s->kind) {
  case PASS_MEM_ARENA: snprintf(buf, n, "((%s *)(A + %" PRId64 "))", ctype, s->offset); return;
  case PASS_MEM_INPUT: snprintf(buf, n, "((const float *)st->input)"); return;
  case PASS_MEM_TARGET: snprintf(buf, n, "((const float *)st->target)"); return;
  case PASS_MEM_GRAD: snprintf(buf, n, "(st->grads + %" PRId64 ")", e->param_offset[s->offset]); return;
  case PASS_MEM_NONE: break;
  }
  UNREACHABLE();
}

static void operand_expr(Emit *e, char *buf, size_t n, const IrOperand *a) {
  if (a->param)
    snprintf(buf, n, "(st->params + %" PRId64 ")", e->param_offset[a->param->index]);
  else
    value_expr(e, buf, n, a->value);
}

static const IrType *arg_type(const IrOp *op, int i) {
  return op->args[i].param ? &op->args[i].param->type : &op->args[i].value->type;
}

// Routing shape shared by encode/decode: s m k e g cap.
static void route_dims(Emit *e, const IrOp *op, int64_t s, int64_t m, int64_t k) {
  fprintf(e->out, ", %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ");\n", s, m, k,
          ir_op_int(op, "experts", 0), ir_op_int(op, "groups", 1), ir_op_int(op, "capacity", 0));
}

static const char *const group_enums[] = {"RT_GROUP_WORLD", "RT_GROUP_DP", "RT_GROUP_MP", "RT_GROUP_EP",
                                          "RT_GROUP_ESP"};

int cg_group_index(const IrOp *op) {
  static const char *const names[] = {"world", "dp", "mp", "ep", "esp"};
  const char *g = ir_op_str(op, "group", "world");
  for (int i = 1; i < 5; i++)
    if (strcmp(g, names[i]) == 0) return i;
  return 0;
}

const char *cg_group_enum(const IrOp *op) { return group_enums[cg_group_index(op)]; }

static bool emit_op(Emit *e, const IrOp *op) {
  FILE *out = e->out;
  char a[6][96], r[96] = "";
  for (int i = 0; i < op->nargs; i++) operand_expr(e, a[i], sizeof a[i], &op->args[i]);
  if (op->result) value_expr(e, r, sizeof r, op->result);
  const IrType *t0 = op->nargs ? arg_type(op, 0) : NULL;
  const IrType *rt = op->result ? &op->result->type : NULL;
  int64_t n = rt ? ir_type_numel(rt) : 0;
  fprintf(out, "  ");
  switch (op->kind) {
  case IR_OP_MATMUL: {
    bool ta = ir_op_int(op, "ta", 0), tb = ir_op_int(op, "tb", 0);
    int64_t k = ta ? t0->dim[0] : t0->dim[1];
    fprintf(out, "rt_matmul(%s, %s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %d, %d, false);\n", a[0], a[1], r,
            rt->dim[0], rt->dim[1], k, ta, tb);
    return true;
  }
  case IR_OP_EXPERT_MATMUL: {
    bool ta = ir_op_int(op, "ta", 0), tb = ir_op_int(op, "tb", 0);
    int64_t k = ta ? t0->dim[1] : t0->dim[2];
    fprintf(out, "rt_expert_matmul(%s, %s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ", %d, %d);\n", a[0],
            a[1], r, rt->dim[0], rt->dim[1], rt->dim[2], k, ta, tb);
    return true;
  }
  case IR_OP_BIAS:
    fprintf(out, "rt_bias(%s, %s, %s, %" PRId64 ", %" PRId64 ");\n", a[0], a[1], r, rt->dim[0], rt->dim[1]);
    return true;
  case IR_OP_BIAS_GRAD:
    fprintf(out, "rt_bias_grad(%s, %s, %" PRId64 ", %" PRId64 ");\n", a[0], r, t0->dim[0], t0->dim[1]);
    return true;
  case IR_OP_EXPERT_BIAS:
    fprintf(out, "rt_expert_bias(%s, %s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ");\n", a[0], a[1], r, rt->dim[0],
            rt->dim[1], rt->dim[2]);
    return true;
  case IR_OP_EXPERT_BIAS_GRAD:
    fprintf(out, "rt_expert_bias_grad(%s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ");\n", a[0], r, t0->dim[0],
            t0->dim[1], t0->dim[2]);
    return true;
  case IR_OP_ADD:
    fprintf(out, "rt_add(%s, %s, %s, %" PRId64 ");\n", a[0], a[1], r, n);
    return true;
  case IR_OP_ACT_GELU:
  case IR_OP_ACT_RELU:
    fprintf(out, "rt_%s(%s, %s, %" PRId64 ");\n", op->kind == IR_OP_ACT_GELU ? "gelu" : "relu", a[0], r, n);
    return true;
  case IR_OP_ACT_GELU_GRAD:
  case IR_OP_ACT_RELU_GRAD:
    fprintf(out, "rt_%s_grad(%s, %s, %s, %" PRId64 ");\n", op->kind == IR_OP_ACT_GELU_GRAD ? "gelu" : "relu", a[0],
            a[1], r, n);
    return true;
  case IR_OP_GATE_NOISE:
    fprintf(out, "rt_gate_noise(st, %s, %s, %" PRId64 ", %" PRId64 ", (float)%.17g, %" PRId64 ");\n", a[0], r,
            rt->dim[0], rt->dim[1], ir_op_float(op, "sigma", 0), ir_op_int(op, "layer", 0));
    return true;
  case IR_OP_GATE_SOFTMAX:
    fprintf(out, "rt_softmax(%s, %s, %" PRId64 ", %" PRId64 ");\n", a[0], r, rt->dim[0], rt->dim[1]);
    return true;
  case IR_OP_GATE_SOFTMAX_GRAD:
    fprintf(out, "rt_softmax_grad(%s, %s, %s, %" PRId64 ", %" PRId64 ");\n", a[0], a[1], r, rt->dim[0], rt->dim[1]);
    return true;
  case IR_OP_GATE_TOPK:
    fprintf(out, "rt_topk(%s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ");\n", a[0], r, t0->dim[0], t0->dim[1],
            rt->dim[1]);
    return true;
  case IR_OP_GATE_GATHER:
    fprintf(out, "rt_gate_gather(%s, %s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %d);\n", a[0], a[1], r,
            t0->dim[0], t0->dim[1], rt->dim[1], (int)ir_op_int(op, "renorm", 0));
    return true;
  case IR_OP_GATE_GATHER_GRAD:
    fprintf(out, "rt_gate_gather_grad(%s, %s, %s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %d);\n", a[0], a[1],
            a[2], r, rt->dim[0], rt->dim[1], t0->dim[1], (int)ir_op_int(op, "renorm", 0));
    return true;
  case IR_OP_GATE_LOCATIONS:  // dropless: capacity 0 to the kernel, the buffers hold the worst case
    fprintf(out, "rt_gate_locations(st, %s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ");\n",
            a[0], r, t0->dim[0], t0->dim[1], ir_op_int(op, "experts", 0), ir_op_int(op, "groups", 1),
            ir_op_int(op, "dropless", 0) ? 0 : ir_op_int(op, "capacity", 0));
    return true;
  case IR_OP_GATE_EXPERT_CHOICE:
    fprintf(out, "rt_expert_choice(st, %s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ");\n", a[0], r,
            t0->dim[0], t0->dim[1], ir_op_int(op, "groups", 1), ir_op_int(op, "capacity", 0));
    return true;
  case IR_OP_GATE_IOTA:
    fprintf(out, "rt_iota(%s, %" PRId64 ", %" PRId64 ");\n", r, rt->dim[0], rt->dim[1]);
    return true;
  case IR_OP_GATE_SIGMOID:
    fprintf(out, "rt_sigmoid(%s, %s, %" PRId64 ");\n", a[0], r, n);
    return true;
  case IR_OP_GATE_SIGMOID_GRAD:
    fprintf(out, "rt_sigmoid_grad(%s, %s, %s, %" PRId64 ");\n", a[0], a[1], r, n);
    return true;
  case IR_OP_GATE_SOFTMAX_TOKENS:
    fprintf(out, "rt_softmax_tokens(%s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ");\n", a[0], r, rt->dim[0],
            rt->dim[1], ir_op_int(op, "groups", 1));
    return true;
  case IR_OP_GATE_SOFTMAX_TOKENS_GRAD:
    fprintf(out, "rt_softmax_tokens_grad(%s, %s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ");\n", a[0], a[1], r,
            rt->dim[0], rt->dim[1], ir_op_int(op, "groups", 1));
    return true;
  case IR_OP_ORDER_DISPATCH_MASK:
  case IR_OP_ORDER_COMBINE_WEIGHTS:
  case IR_OP_ORDER_COMBINE_WEIGHTS_GRAD: {
    const IrType *idx = arg_type(op, op->kind == IR_OP_ORDER_COMBINE_WEIGHTS_GRAD ? 1 : 0);
    const char *fn = op->kind == IR_OP_ORDER_DISPATCH_MASK     ? "rt_dispatch_mask"
                     : op->kind == IR_OP_ORDER_COMBINE_WEIGHTS ? "rt_combine_weights"
                                                               : "rt_combine_weights_grad";
    fprintf(out, "%s(", fn);
    for (int i = 0; i < op->nargs; i++) fprintf(out, "%s, ", a[i]);
    fprintf(out, "%s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ");\n", r, idx->dim[0],
            idx->dim[1], ir_op_int(op, "experts", 0), ir_op_int(op, "groups", 1), ir_op_int(op, "capacity", 0));
    return true;
  }
  case IR_OP_ACT_SILU:
    fprintf(out, "rt_silu(%s, %s, %" PRId64 ");\n", a[0], r, n);
    return true;
  case IR_OP_ACT_SILU_GRAD:
    fprintf(out, "rt_silu_grad(%s, %s, %s, %" PRId64 ");\n", a[0], a[1], r, n);
    return true;
  case IR_OP_MUL:
    fprintf(out, "rt_mul(%s, %s, %s, %" PRId64 ");\n", a[0], a[1], r, n);
    return true;
  case IR_OP_RESHAPE:
    fprintf(out, "rt_copy(%s, %s, %" PRId64 ");\n", a[0], r, n);
    return true;
  case IR_OP_L2NORM:
  case IR_OP_L2NORM_GRAD: {
    int64_t cols = rt->dim[rt->rank - 1];
    if (op->kind == IR_OP_L2NORM)
      fprintf(out, "rt_l2norm_rows(%s, %s, %" PRId64 ", %" PRId64 ");\n", a[0], r, n / cols, cols);
    else
      fprintf(out, "rt_l2norm_rows_grad(%s, %s, %s, %" PRId64 ", %" PRId64 ");\n", a[0], a[1], r, n / cols, cols);
    return true;
  }
  case IR_OP_DIV_SCALAR:
    fprintf(out, "rt_div_scalar(%s, %s, %s, %" PRId64 ");\n", a[0], a[1], r, n);
    return true;
  case IR_OP_DIV_SCALAR_GRAD_X:
    fprintf(out, "rt_div_scalar_grad_x(%s, %s, %s, %" PRId64 ");\n", a[0], a[1], r, n);
    return true;
  case IR_OP_DIV_SCALAR_GRAD_S:
    fprintf(out, "rt_div_scalar_grad_s(%s, %s, %s, %s, %" PRId64 ");\n", a[0], a[1], a[2], r, ir_type_numel(t0));
    return true;
  case IR_OP_HOOK_COMPRESS:
    fprintf(out, "rt_compress_%s(%s, %s, %" PRId64 ");\n", rt->dtype == IR_BF16 ? "bf16" : "f16", a[0], r, n);
    return true;
  case IR_OP_HOOK_DECOMPRESS:
    fprintf(out, "rt_decompress_%s(%s, %s, %" PRId64 ");\n", t0->dtype == IR_BF16 ? "bf16" : "f16", a[0], r, n);
    return true;
  case IR_OP_HOOK_SCALES:
  case IR_OP_HOOK_COMPRESS_INT8:
  case IR_OP_HOOK_DECOMPRESS_INT8: {
    int64_t cols = t0->dim[t0->rank - 1], rows = ir_type_numel(t0) / cols;
    const char *fn = op->kind == IR_OP_HOOK_SCALES ? "rt_int8_scales"
                     : op->kind == IR_OP_HOOK_COMPRESS_INT8 ? "rt_compress_int8" : "rt_decompress_int8";
    fprintf(out, "%s(", fn);
    for (int i = 0; i < op->nargs; i++) fprintf(out, "%s, ", a[i]);
    fprintf(out, "%s, %" PRId64 ", %" PRId64 ");\n", r, rows, cols);
    return true;
  }
  case IR_OP_HOOK_RECORD:
    fprintf(out, "rt_record(st, \"%s\", %" PRId64 ", %s, %" PRId64 ");\n", ir_op_str(op, "point", "?"),
            ir_op_int(op, "layer", 0), a[0], ir_type_numel(t0));
    return true;
  case IR_OP_GATE_AUX_LOSS:
    fprintf(out, "*%s = rt_aux_loss(%s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ") / %" PRId64 ".0f;\n", r,
            a[0], a[1], t0->dim[0], t0->dim[1], arg_type(op, 1)->dim[1], ir_op_int(op, "groups", 1),
            ir_op_int(op, "share", 1));
    return true;
  case IR_OP_GATE_AUX_LOSS_GRAD:
    fprintf(out, "rt_aux_loss_grad(%s, %s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ", (float)%.17g);\n",
            a[0], a[1], r, t0->dim[0], t0->dim[1], arg_type(op, 1)->dim[1], ir_op_int(op, "groups", 1),
            ir_op_float(op, "coef", 0) / (double)ir_op_int(op, "share", 1));
    return true;
  case IR_OP_GATE_Z_LOSS:
    fprintf(out, "*%s = rt_z_loss(%s, %" PRId64 ", %" PRId64 ", %" PRId64 ") / %" PRId64 ".0f;\n", r, a[0], t0->dim[0],
            t0->dim[1], ir_op_int(op, "groups", 1), ir_op_int(op, "share", 1));
    return true;
  case IR_OP_GATE_Z_LOSS_GRAD:
    fprintf(out, "rt_z_loss_grad(%s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", (float)%.17g);\n", a[0], r,
            t0->dim[0], t0->dim[1], ir_op_int(op, "groups", 1),
            ir_op_float(op, "coef", 0) / (double)ir_op_int(op, "share", 1));
    return true;
  case IR_OP_ORDER_ENCODE:
    fprintf(out, "rt_order_encode(%s, %s, %s, %s", a[0], a[1], a[2], r);
    route_dims(e, op, t0->dim[0], t0->dim[1], arg_type(op, 1)->dim[1]);
    return true;
  case IR_OP_ORDER_ENCODE_GRAD:
    fprintf(out, "rt_order_encode_grad(%s, %s, %s, %s", a[0], a[1], a[2], r);
    route_dims(e, op, rt->dim[0], rt->dim[1], arg_type(op, 1)->dim[1]);
    return true;
  case IR_OP_ORDER_DECODE:
    fprintf(out, "rt_order_decode(%s, %s, %s, %s, %s", a[0], a[1], a[2], a[3], r);
    route_dims(e, op, rt->dim[0], rt->dim[1], arg_type(op, 1)->dim[1]);
    return true;
  case IR_OP_ORDER_DECODE_GRAD_Y:
    fprintf(out, "rt_order_decode_grad_y(%s, %s, %s, %s, %s", a[0], a[1], a[2], a[3], r);
    route_dims(e, op, t0->dim[0], t0->dim[1], arg_type(op, 1)->dim[1]);
    return true;
  case IR_OP_ORDER_DECODE_GRAD_G:
    fprintf(out, "rt_order_decode_grad_gates(%s, %s, %s, %s, %s", a[0], a[1], a[2], a[3], r);
    route_dims(e, op, t0->dim[0], t0->dim[1], arg_type(op, 2)->dim[1]);
    return true;
  case IR_OP_LOSS_MSE:  // scale: this rank's share of the global mean (parallelize)
    fprintf(out, "*%s = (float)%.17g * rt_mse(%s, %s, %" PRId64 ");\n", r, ir_op_float(op, "scale", 1), a[0], a[1],
            ir_type_numel(t0));
    return true;
  case IR_OP_LOSS_MSE_GRAD:
    fprintf(out, "rt_mse_grad(%s, %s, %s, %" PRId64 ");\n", a[0], a[1], r, n);
    if (ir_op_float(op, "scale", 1) != 1)
      fprintf(out, "  rt_scale(%s, %" PRId64 ", (float)%.17g);\n", r, n, ir_op_float(op, "scale", 1));
    return true;
  case IR_OP_COMM_SPLIT:
    fprintf(out, "rt_copy(%s + (int64_t)rt_comm_rank(%s) * %" PRId64 ", %s, %" PRId64 ");\n", a[0], cg_group_enum(op), n,
            r, n);
    return true;
  case IR_OP_COMM_ALLGATHER:
    fprintf(out, "rt_allgather(%s, %s, %s, %" PRId64 ");\n", cg_group_enum(op), a[0], r, ir_type_numel(t0));
    return true;
  case IR_OP_COMM_REDUCESCATTER:
    fprintf(out, "rt_reducescatter(%s, %s, %s, %" PRId64 ");\n", cg_group_enum(op), a[0], r, n);
    return true;
  case IR_OP_COMM_ALLTOALL: {
    const char *algo = ir_op_str(op, "algo", "nccl");
    fprintf(out, "rt_alltoall(%s, %s, %s, %s, %" PRId64 ");\n", cg_group_enum(op),
            strcmp(algo, "1dh") == 0 ? "RT_A2A_1DH" : strcmp(algo, "2dh") == 0 ? "RT_A2A_2DH" : "RT_A2A_FLAT", a[0], r,
            n / ir_op_int(op, "size", 1));
    return true;
  }
  case IR_OP_COMM_ALLREDUCE:
    fprintf(out, "rt_copy(%s, %s, %" PRId64 ");\n  rt_allreduce(%s, %s, %" PRId64 ");\n", a[0], r, n, cg_group_enum(op), r, n);
    return true;
  case IR_OP_COMM_ALLREDUCE_GRAD:  // a slice of a parameter's gradient, in place (passes/gradpart.c)
    fprintf(out, "rt_allreduce(%s, st->grads + %" PRId64 ", %" PRId64 ");\n", cg_group_enum(op),
            e->param_offset[op->args[0].param->index] + ir_op_int(op, "offset", 0), ir_op_int(op, "count", 0));
    return true;
  case IR_OP_LAYOUT_EXPERT_MAJOR:
  case IR_OP_LAYOUT_RANK_MAJOR: {
    int64_t R = ir_op_int(op, "blocks", 1);
    bool em = op->kind == IR_OP_LAYOUT_EXPERT_MAJOR;
    fprintf(out, "rt_%s(%s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ");\n", em ? "expert_major" : "rank_major",
            a[0], r, R, em ? rt->dim[0] : t0->dim[0], em ? t0->dim[1] : rt->dim[1], rt->dim[2]);
    return true;
  }
  case IR_OP_LAYOUT_CHUNK:
  case IR_OP_LAYOUT_CONCAT: {  // [outer, blocks*rows, inner...]: slot slices (runtime/kernels_chunk.c)
    int64_t blocks = ir_op_int(op, "blocks", 1);
    int64_t inner = ir_type_bytes(rt) / (rt->dim[0] * rt->dim[1]);
    if (op->kind == IR_OP_LAYOUT_CHUNK)
      fprintf(out, "rt_layout_chunk(%s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ");\n",
              a[0], r, t0->dim[0], blocks, t0->dim[1] / blocks, inner, ir_op_int(op, "chunks", 1), ir_op_int(op, "index", 0));
    else
      fprintf(out, "rt_layout_concat(%s, %s, %s, %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ");\n", a[0],
              a[1], r, t0->dim[0], blocks, t0->dim[1] / blocks, arg_type(op, 1)->dim[1] / blocks, inner);
    return true;
  }
  case IR_OP_PARAM_GRAD: {
    const PassMemSlot *s = &e->plan->slot[op->args[1].value->func->index][op->args[1].value->id];
    if (s->kind == PASS_MEM_GRAD && s->offset == op->args[0].param->index)
      fprintf(out, "/* %s: computed in place */\n", op->args[0].param->name);
    else
      fprintf(out, "memcpy(st->grads + %" PRId64 ", %s, %" PRId64 ");\n", e->param_offset[op->args[0].param->index],
              a[1], ir_type_bytes(&op->args[0].param->type));
    return true;
  }
  case IR_OP_OPT_SGD: {
    int64_t off = e->param_offset[op->args[0].param->index];
    fprintf(out, "rt_sgd(st->params + %" PRId64 ", st->grads + %" PRId64 ", %" PRId64 ", (float)%.17g, (float)%.17g);\n",
            off, off, ir_type_numel(t0), ir_op_float(op, "lr", 0), ir_op_float(op, "weight_decay", 0));
    return true;
  }
  case IR_OP_OPT_ADAMW: {
    int64_t off = e->param_offset[op->args[0].param->index];
    fprintf(out,
            "rt_adamw(st->params + %" PRId64 ", st->grads + %" PRId64 ", st->opt_m + %" PRId64 ", st->opt_v + %" PRId64
            ", %" PRId64 ", (float)%.17g, (float)%.17g, (float)%.17g, (float)%.17g, (float)%.17g, st->step);\n",
            off, off, off, off, ir_type_numel(t0), ir_op_float(op, "lr", 0), ir_op_float(op, "beta1", 0.9),
            ir_op_float(op, "beta2", 0.999), ir_op_float(op, "eps", 1e-8), ir_op_float(op, "weight_decay", 0));
    return true;
  }
  default:
    break;
  }
  ir_error_at(e->d, op->loc, "the CPU target cannot emit op '%s'", op->kind < IR_OP_COUNT ? ir_op_info[op->kind].name : "?");
  return false;
}

// ---- scheduled functions: a task table for rt_run_streams (runtime/streams.c) ----
// A function with ops on the intra or inter stream is emitted as tasks: runs of consecutive
// ops on one stream, cut before an op that waits and after an op that records an event, one
// static function each, and a table {stream, fn, waits, event} in program order; the step
// calls rt_run_streams on it. Events are cg_events' (renumbered per function, a collective
// waiting for the previous one on its group). MOEC_STREAMS=0 in the environment emits
// scheduled functions straight-line as before.
bool cg_func_scheduled(const IrFunc *f) {
  const char *env = getenv("MOEC_STREAMS");
  if (env && strcmp(env, "0") == 0) return false;
  for (int i = 0; i < f->nops; i++)
    if (f->ops[i]->stream == IR_STREAM_INTRA || f->ops[i]->stream == IR_STREAM_INTER) return true;
  return false;
}


const char *cg_stream_enum(IrStream s) {
  return s == IR_STREAM_INTRA ? "RT_STREAM_INTRA" : s == IR_STREAM_INTER ? "RT_STREAM_INTER" : "RT_STREAM_COMPUTE";
}

static IrStream stream_of(const IrOp *op) { return op->stream == IR_STREAM_NONE ? IR_STREAM_COMPUTE : op->stream; }

bool cg_events(IrDiag *d, const IrFunc *f, CgEvents *ev) {
  int n = f->nops;
  ev->dep = malloc(((size_t)n + 1) * sizeof *ev->dep);
  ev->local = malloc(((size_t)n + 1) * sizeof *ev->local);
  ev->rec = calloc((size_t)n + 1, sizeof *ev->rec);
  ev->count = 0;
  if (!ev->dep || !ev->local || !ev->rec) {
    cg_events_free(ev);
    return ir_error(d, "out of memory");
  }
  for (int i = 0; i < n; i++) {
    const IrOp *op = f->ops[i];
    ev->dep[i] = -1;
    ev->local[i] = -1;
    if (op->event >= 0) ev->rec[i] = true;
    if (!ir_op_is_collective(op->kind)) continue;
    for (int j = i - 1; j >= 0; j--) {
      const IrOp *p = f->ops[j];
      if (!ir_op_is_collective(p->kind) || cg_group_index(p) != cg_group_index(op)) continue;
      if (p->stream != op->stream) {
        ev->dep[i] = j;
        ev->rec[j] = true;
      }
      break;
    }
  }
  for (int i = 0; i < n; i++)
    if (ev->rec[i]) ev->local[i] = ev->count++;
  return true;
}

void cg_events_free(CgEvents *ev) {
  free(ev->dep);
  free(ev->local);
  free(ev->rec);
  ev->dep = ev->local = NULL;
  ev->rec = NULL;
}

int cg_op_waits(const IrFunc *f, const CgEvents *ev, int i, int *waits, int max) {
  const IrOp *op = f->ops[i];
  int nw = 0;
  for (int w = 0; w < op->nwaits; w++) {
    int e = -1;
    for (int j = 0; j < i; j++)
      if (f->ops[j]->event == op->waits[w]) e = ev->local[j];
    bool seen = false;
    for (int k = 0; k < nw; k++) seen |= waits[k] == e;
    if (e >= 0 && !seen && nw < max) waits[nw++] = e;
  }
  if (ev->dep[i] >= 0 && nw < max) waits[nw++] = ev->local[ev->dep[i]];
  return nw;
}

#define TASK_WAITS 16  // RT_TASK_MAX_WAITS

// The task functions and table of scheduled function f (index fi): `tasks_<fi>`, with the task
// and event counts in *ntasks and *nevents.
static bool emit_tasks(Emit *e, const IrFunc *f, int fi, int *ntasks_out, int *nevents_out) {
  int n = f->nops;
  CgEvents ev;
  if (!cg_events(e->d, f, &ev)) return false;
  int *task_of = malloc(((size_t)n + 1) * sizeof *task_of);
  bool ok = task_of != NULL;
  if (!ok) {
    ir_error(e->d, "out of memory");
    goto out;
  }
  // Tasks: cut before an op with waits, after an op with an event, where the stream changes.
  int ntasks = 0;
  for (int i = 0; i < n; i++) {
    const IrOp *op = f->ops[i];
    bool cut = i == 0 || op->nwaits > 0 || ev.dep[i] >= 0 || ev.rec[i - 1] || stream_of(op) != stream_of(f->ops[i - 1]);
    if (cut) {
      if (i > 0) fprintf(e->out, "}\n\n");
      fprintf(e->out, "static void task_%d_%d(RtStep *st) {\n  unsigned char *A = st->arena;\n  (void)A;\n", fi, ntasks);
      ntasks++;
    }
    task_of[i] = ntasks - 1;
    if (!emit_op(e, op)) {
      ok = false;
      goto out;
    }
  }
  if (n > 0) fprintf(e->out, "}\n\n");
  fprintf(e->out, "static const RtTask tasks_%d[%d] = {\n", fi, ntasks > 0 ? ntasks : 1);
  for (int i = 0; i < n; i++) {
    if (i > 0 && task_of[i] == task_of[i - 1]) continue;
    int last = i;
    while (last + 1 < n && task_of[last + 1] == task_of[i]) last++;
    int waits[TASK_WAITS];
    int nw = cg_op_waits(f, &ev, i, waits, TASK_WAITS);
    fprintf(e->out, "  {%s, task_%d_%d, %d, {", cg_stream_enum(f->ops[i]->stream), fi, task_of[i], nw);
    for (int k = 0; k < nw; k++) fprintf(e->out, "%s%d", k ? ", " : "", waits[k]);
    if (nw == 0) fprintf(e->out, "0");
    fprintf(e->out, "}, %d},\n", ev.local[last]);
  }
  fprintf(e->out, "};\n\n");
  *ntasks_out = ntasks;
  *nevents_out = ev.count;
out:
  cg_events_free(&ev);
  free(task_of);
  return ok;
}

static bool emit_func(Emit *e, const IrFunc *f) {
  fprintf(e->out, "  /* @%s */\n", f->name);
  if (cg_func_scheduled(f)) {
    fprintf(e->out, "  rt_run_streams(st, tasks_%d, (int)(sizeof tasks_%d / sizeof tasks_%d[0]), tasks_%d_events);\n",
            f->index, f->index, f->index, f->index);
    return true;
  }
  for (int i = 0; i < f->nops; i++)
    if (!emit_op(e, f->ops[i])) return false;
  return true;
}


// After a layer forward: fold its auxiliary losses (the results after the first, made by
// gate.aux_loss or gate.z_loss) into the step's statistics.
static void emit_layer_stats(Emit *e, const IrFunc *f) {
  char buf[96];
  for (int r = 1; r < f->nrets; r++) {
    const IrValue *v = f->rets[r];
    if (!v->def || (v->def->kind != IR_OP_GATE_AUX_LOSS && v->def->kind != IR_OP_GATE_Z_LOSS)) continue;
    double coef = ir_op_float(v->def, "coef", 0);
    value_expr(e, buf, sizeof buf, v);
    fprintf(e->out, "  st->%s += *%s;\n  st->aux_total += (double)(float)%.17g * *%s;\n",
            v->def->kind == IR_OP_GATE_AUX_LOSS ? "aux" : "z", buf, coef, buf);
  }
}

static bool module_has(const IrModule *m, IrOpKind kind, const char *attr) {
  for (int i = 0; i < m->nfuncs; i++)
    for (int j = 0; j < m->funcs[i]->nops; j++) {
      const IrOp *op = m->funcs[i]->ops[j];
      if (op->kind == kind && (!attr || ir_op_int(op, attr, 0))) return true;
    }
  return false;
}

static const char *init_name(const IrParam *p) {
  const char *init = ir_attr_str(p->attrs, p->nattrs, "init", "zeros");
  if (strcmp(init, "normal") == 0) return "RT_INIT_NORMAL";
  if (strcmp(init, "ones") == 0) return "RT_INIT_ONES";
  if (strcmp(init, "const") == 0) return "RT_INIT_CONST";
  return "RT_INIT_ZEROS";
}

int64_t *cg_param_offsets(const IrModule *m, int64_t *total) {
  int64_t *offset = calloc((size_t)m->nparams + 1, sizeof *offset);
  *total = 0;
  if (!offset) return NULL;
  for (int i = 0; i < m->nparams; i++) {
    offset[i] = *total;
    *total += ir_type_numel(&m->params[i]->type);
  }
  return offset;
}

void cg_emit_params(FILE *out, const IrModule *m, const int64_t *param_offset) {
  fprintf(out, "static const RtParam params[%d] = {\n", m->nparams > 0 ? m->nparams : 1);
  for (int i = 0; i < m->nparams; i++) {
    const IrParam *p = m->params[i];
    fprintf(out, "  {\"%s\", %d, {", p->name, p->type.rank);
    for (int k = 0; k < p->type.rank; k++) fprintf(out, "%s%" PRId64, k ? ", " : "", p->type.dim[k]);
    fprintf(out, "}, %s, (float)%.17g, %" PRId64 ", %" PRId64 ", {", init_name(p),
            ir_attr_float(p->attrs, p->nattrs, strcmp(init_name(p), "RT_INIT_CONST") == 0 ? "value" : "std", 0),
            param_offset[i], ir_type_numel(&p->type));
    // Sharded dimensions (parallelize): the whole tensor is the shard times the group size.
    int shard_ep = (int)ir_attr_int(p->attrs, p->nattrs, "shard_ep", -1);
    int shard_esp = (int)ir_attr_int(p->attrs, p->nattrs, "shard_esp", -1);
    for (int k = 0; k < p->type.rank; k++) {
      int64_t g = p->type.dim[k];
      if (k == shard_ep) g *= ir_mod_int(m, "ep", 1);
      if (k == shard_esp) g *= ir_mod_int(m, "esp", 1);
      fprintf(out, "%s%" PRId64, k ? ", " : "", g);
    }
    fprintf(out, "}, %d, %d},\n", shard_ep, shard_esp);
  }
  fprintf(out, "};\n\n");
}

void cg_emit_model(FILE *out, const IrModule *m, const PassMemPlan *plan, int64_t param_floats, const char *device) {
  int nlayers = 0;
  for (int i = 0; i < m->nfuncs; i++)
    nlayers += m->funcs[i]->role == IR_ROLE_LAYER_FWD;
  bool adamw = strcmp(ir_mod_str(m, "optimizer", "sgd"), "adamw") == 0;
  fprintf(out,
          "static const RtModel model = {\n"
          "  .name = \"%s\",\n  .batch = %" PRId64 ", .seqlen = %" PRId64 ", .embed = %" PRId64 ",\n"
          "  .seed = %" PRId64 "u,\n  .nparams = %d, .params = params, .param_floats = %" PRId64 ",\n"
          "  .arena_bytes = %" PRId64 ",\n  .opt = %s,\n  .nlayers = %d,\n  .records = %d, .dropless = %d,\n"
          "  .layout = {%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "}, .nodes = %" PRId64 ",\n"
          "  .forward = step_forward, .backward = step_backward, .update = step_update,\n",
          m->name, ir_mod_int(m, "batch", 1), ir_mod_int(m, "seqlen", 1), ir_mod_int(m, "embed", 1),
          ir_mod_int(m, "seed", 0), m->nparams, param_floats, plan->arena_bytes, adamw ? "RT_OPT_ADAMW" : "RT_OPT_SGD",
          nlayers, module_has(m, IR_OP_HOOK_RECORD, NULL), module_has(m, IR_OP_GATE_LOCATIONS, "dropless"),
          ir_mod_int(m, "dp", 1), ir_mod_int(m, "mp", 1), ir_mod_int(m, "ep", 1), ir_mod_int(m, "esp", 1),
          ir_mod_int(m, "gpus_per_node", 1), ir_mod_int(m, "nodes", 0));
  if (device) fprintf(out, "  .device = &%s,\n", device);
  fprintf(out, "};\n\nint main(int argc, char **argv) { return rt_main(&model, argc, argv); }\n");
}

bool cg_emit_c(IrDiag *d, FILE *out, const IrModule *m, const PassMemPlan *plan, const char *source_name) {
  if (cg_bf16_gemms(m))   // the front end refuses it for the CPU target (frontend/lower.c)
    return ir_error(d, "internal error: the CPU target computes in fp32 only; dtype bf16 is the CUDA target's");
  Emit e = {.out = out, .d = d, .m = m, .plan = plan};
  int64_t total = 0;
  e.param_offset = cg_param_offsets(m, &total);
  if (!e.param_offset) return ir_error(d, "out of memory");
  fprintf(out, "/* Generated by moec from %s: the training step of model '%s' for the CPU target.\n"
               "   Do not edit; change the .moe file and rebuild. */\n",
          source_name, m->name);
  fprintf(out, "#include <stdbool.h>\n#include <stdint.h>\n#include <string.h>\n\n#include \"moert.h\"\n\n");
  cg_emit_params(out, m, e.param_offset);

  bool ok = true;
  for (int i = 0; ok && i < m->nfuncs; i++) {
    int nt = 0, nev = 0;
    if (!cg_func_scheduled(m->funcs[i])) continue;
    fprintf(out, "/* @%s: tasks for rt_run_streams */\n", m->funcs[i]->name);
    ok = emit_tasks(&e, m->funcs[i], i, &nt, &nev);
    fprintf(out, "enum { tasks_%d_events = %d };\n\n", i, nev);
  }
  const IrFunc *last_fwd = NULL;
  fprintf(out, "static void step_forward(RtStep *st) {\n  unsigned char *A = st->arena;\n  (void)A;\n"
               "  rt_step_begin_forward(st);\n");
  for (int i = 0; ok && i < m->nfuncs; i++) {
    const IrFunc *f = m->funcs[i];
    if (f->role == IR_ROLE_LOSS_FWD) {
      char buf[96];
      ok = emit_func(&e, f);
      if (last_fwd) {
        value_expr(&e, buf, sizeof buf, last_fwd->rets[0]);
        fprintf(out, "  st->output = %s;\n", buf);
      }
      value_expr(&e, buf, sizeof buf, f->rets[0]);
      fprintf(out, "  st->mse = *%s;\n", buf);
    } else if (f->role == IR_ROLE_LAYER_FWD) {
      ok = emit_func(&e, f);
      emit_layer_stats(&e, f);
      last_fwd = f;
    }
  }
  fprintf(out, "}\n\nstatic void step_backward(RtStep *st) {\n  unsigned char *A = st->arena;\n  (void)A;\n");
  for (int i = 0; ok && i < m->nfuncs; i++)
    if (ir_role_phase(m->funcs[i]->role) == IR_PHASE_BWD) ok = emit_func(&e, m->funcs[i]);
  fprintf(out, "}\n\nstatic void step_update(RtStep *st) {\n");
  for (int i = 0; ok && i < m->nfuncs; i++)
    if (m->funcs[i]->role == IR_ROLE_OPTIMIZER) ok = emit_func(&e, m->funcs[i]);
  fprintf(out, "}\n\n");
  cg_emit_model(out, m, plan, total, NULL);
  free(e.param_offset);
  return ok;
}
