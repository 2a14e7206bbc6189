// Layer 6 of codegen/ (the shared host parts: buffer names); it may call facts.c and kernels.c.
//
// How a target's host program names the program's buffers: the one place that turns a value
// (by its memory plan slot), an operand or a pointer argument of the lowering into a pointer
// expression. The CPU program and the CUDA host program differ only in the names they give
// the bases (CgSpelling).
#include <inttypes.h>
#include <string.h>

#include "cg_internal.h"

static const char *c_type(const IrType *t) {
  return t->dtype == IR_I32 ? "int32_t" : t->dtype == IR_I8 ? "int8_t"
       : t->dtype == IR_F16 || t->dtype == IR_BF16 ? "uint16_t" : "float";
}

void cg_spell_value(const CgSpelling *sp, const IrValue *v, char *buf, size_t n) {
  const PassMemSlot *s = &sp->plan->slot[v->func->index][v->id];
  switch (s->kind) {
  case PASS_MEM_ARENA:
    if (sp->typed) snprintf(buf, n, "((%s *)(%s + %" PRId64 "))", c_type(&v->type), sp->arena, s->offset);
    else snprintf(buf, n, "(%s + %" PRId64 ")", sp->arena, s->offset);
    return;
  case PASS_MEM_INPUT: snprintf(buf, n, "%s", v->type.dtype == IR_I32 && sp->input_i32 ? sp->input_i32 : sp->input); return;
  case PASS_MEM_TARGET: snprintf(buf, n, "%s", v->type.dtype == IR_I32 && sp->target_i32 ? sp->target_i32 : sp->target); return;
  case PASS_MEM_GRAD: snprintf(buf, n, "(%s + %" PRId64 ")", sp->grads, sp->param_offset[s->offset]); return;
  case PASS_MEM_NONE: break;
  }
  UNREACHABLE();
}

bool cg_spell_copy(const CgSpelling *sp, const IrValue *v, char *buf, size_t n) {
  const PassMemSlot *s = sp->plan->copy ? &sp->plan->copy[v->func->index][v->id] : NULL;
  if (!s || s->kind != PASS_MEM_ARENA) return false;
  if (sp->typed) snprintf(buf, n, "((uint16_t *)(%s + %" PRId64 "))", sp->arena, s->offset);
  else snprintf(buf, n, "(%s + %" PRId64 ")", sp->arena, s->offset);
  return true;
}

void cg_spell_operand(const CgSpelling *sp, const IrOperand *a, char *buf, size_t n) {
  if (a->param) snprintf(buf, n, "(%s + %" PRId64 ")", sp->params, sp->param_offset[a->param->index]);
  else cg_spell_value(sp, a->value, buf, n);
}

bool cg_spell_pointer(const CgSpelling *sp, const IrFunc *f, int i, const CgArg *a, char *buf, size_t n) {
  const IrOp *op = f->ops[i];
  const char *base = a->kind == CG_ARG_GRAD ? sp->grads : a->kind == CG_ARG_MOMENT_M ? sp->opt_m : sp->opt_v;
  switch (a->kind) {
  case CG_ARG_OPERAND: cg_spell_operand(sp, &f->ops[i + a->i]->args[a->index], buf, n); return true;
  case CG_ARG_RESULT: cg_spell_value(sp, f->ops[i + a->index]->result, buf, n); return true;
  case CG_ARG_OPERAND16:
    if (!cg_spell_copy(sp, f->ops[i + a->i]->args[a->index].value, buf, n)) UNREACHABLE();   // fuse marks values with one
    return true;
  case CG_ARG_COPY:
    if (!cg_spell_copy(sp, f->ops[i + a->index]->result, buf, n)) UNREACHABLE();   // memplan gives bf16=1 results one
    return true;
  case CG_ARG_GRAD:
  case CG_ARG_MOMENT_M:
  case CG_ARG_MOMENT_V:
    snprintf(buf, n, "(%s + %" PRId64 ")", base, sp->param_offset[op->args[0].param->index]);
    return true;
  case CG_ARG_PARAM16:
    if (!sp->params16) snprintf(buf, n, "NULL");
    else snprintf(buf, n, "(%s + %" PRId64 ")", sp->params16, sp->param_offset[op->args[0].param->index]);
    return true;
  default: return false;
  }
}

// ---- the kinds of kernel arguments ----

static const CgArgInfo arg_info[] = {
    [CG_ARG_OPERAND] = {"operand", .pointer = true},     [CG_ARG_OPERAND16] = {"operand16", .pointer = true},
    [CG_ARG_RESULT] = {"result", .pointer = true},       [CG_ARG_COPY] = {"copy", .pointer = true},
    [CG_ARG_GRAD] = {"grad", .pointer = true},           [CG_ARG_MOMENT_M] = {"m", .pointer = true},
    [CG_ARG_MOMENT_V] = {"v", .pointer = true},          [CG_ARG_PARAM16] = {"param16", .pointer = true},
    [CG_ARG_RANGES] = {"ranges", .pointer = true},       [CG_ARG_STATS] = {"stats", .pointer = true},
    [CG_ARG_SCRATCH] = {"scratch", .pointer = true},
    [CG_ARG_INT] = {"int", .literal = true, .type = CG_PARAM_INT},
    [CG_ARG_FLOAT] = {"float", .literal = true, .type = CG_PARAM_FLOAT},
    [CG_ARG_SEED] = {"seed", .step_field = "seed", .type = CG_PARAM_U64},
    [CG_ARG_STEP] = {"step", .step_field = "step", .type = CG_PARAM_I64},
    [CG_ARG_TOKEN0] = {"token0", .step_field = "token0", .type = CG_PARAM_I64},
    [CG_ARG_VOCAB0] = {"vocab0", .step_field = "vocab0", .type = CG_PARAM_I64},
    [CG_ARG_LR_SCALE] = {"lr_scale", .step_field = "lr_scale", .type = CG_PARAM_FLOAT},
    [CG_ARG_GRAD_SCALE] = {"grad_scale", .step_field = "grad_scale", .type = CG_PARAM_FLOAT},
};

const CgArgInfo *cg_arg_info(CgArgKind kind) {
  if ((size_t)kind >= sizeof arg_info / sizeof *arg_info || !arg_info[kind].name) UNREACHABLE();
  return &arg_info[kind];
}

bool cg_arg_fits(CgArgKind kind, CgParamType t) {
  const CgArgInfo *a = cg_arg_info(kind);
  if (a->pointer) return t == CG_PARAM_POINTER;
  if (kind == CG_ARG_INT) return t == CG_PARAM_INT || t == CG_PARAM_I64;
  return t == a->type;
}
