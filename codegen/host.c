// Layer 6 of codegen/ (the shared host parts): what both host programs print alike, the
// parameter table (cg_emit_params), the model and main (cg_emit_model) and the stages' main.
// It may call the layers below (facts.c, kernels.c, spell.c); no emitter.
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cg_internal.h"

static const char *init_name(const IrParam *p) {
  const char *init = ir_attr_str(p->attrs, p->nattrs, "init", "zeros");
  if (strcmp(init, "normal") == 0) return "RT_INIT_NORMAL";
  if (strcmp(init, "ones") == 0) return "RT_INIT_ONES";
  if (strcmp(init, "const") == 0) return "RT_INIT_CONST";
  if (strcmp(init, "uniform") == 0) return "RT_INIT_UNIFORM";
  return "RT_INIT_ZEROS";
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
    int shard_mp = (int)ir_attr_int(p->attrs, p->nattrs, "shard_mp", -1);
    for (int k = 0; k < p->type.rank; k++) {
      int64_t g = p->type.dim[k];
      if (k == shard_ep) g *= ir_mod_int(m, "ep", 1);
      if (k == shard_esp) g *= ir_mod_int(m, "esp", 1);
      if (k == shard_mp) g *= ir_mod_int(m, "mp", 1);
      fprintf(out, "%s%" PRId64, k ? ", " : "", g);
    }
    // A sharded optimizer's group (autodiff): 1 + its RtGroup.
    const char *shard = ir_attr_str(p->attrs, p->nattrs, "shard", NULL);
    fprintf(out, "}, %d, %d, %d, %d", shard_ep, shard_esp, shard_mp, ir_attrs_get(p->attrs, p->nattrs, "balance") != NULL);
    fprintf(out, ", %s", shard ? cg_group_enums[cg_group_named(shard)] : "0");
    if (shard) fprintf(out, " + 1");
    if (ir_param_frozen(p)) fprintf(out, ", .frozen = 1");
    fprintf(out, "},\n");
  }
  fprintf(out, "};\n\n");
}

// A C string literal of s.
static void emit_string(FILE *out, const char *s) {
  fputc('"', out);
  for (const char *c = s; *c; c++) fprintf(out, *c == '"' || *c == '\\' ? "\\%c" : (unsigned char)*c < 32 ? "\\%03o" : "%c", *c);
  fputc('"', out);
}

void cg_emit_model(FILE *out, const IrModule *m, const PassMemPlan *plan, int64_t param_floats, const char *device,
                   const CgEmitOptions *o) {
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
          nlayers, cg_module_has(m, IR_OP_HOOK_RECORD, NULL), cg_module_has(m, IR_OP_GATE_LOCATIONS, "dropless"),
          ir_mod_int(m, "dp", 1), ir_mod_int(m, "mp", 1), ir_mod_int(m, "ep", 1), ir_mod_int(m, "esp", 1),
          ir_mod_int(m, "gpus_per_node", 1), ir_mod_int(m, "nodes", 0));
  if (device) fprintf(out, "  .device = &%s,\n", device);
  if (plan->param16_bytes) fprintf(out, "  .param16_bytes = %" PRId64 ",\n", plan->param16_bytes);
  if (cg_grad_floats(m) < param_floats) fprintf(out, "  .grad_floats = %" PRId64 ",\n", cg_grad_floats(m));
  // Which auxiliary losses are in the objective (a coefficient above 0), for the step lines.
  bool aux = false, z = false;
  for (int i = 0; i < m->nfuncs; i++)
    for (int j = 0; j < m->funcs[i]->nops; j++) {
      const IrOp *op = m->funcs[i]->ops[j];
      bool in = ir_op_float(op, "coef", 0) > 0;
      aux |= in && (op->kind == IR_OP_GATE_AUX_LOSS || op->kind == IR_OP_GATE_AUX_POOLED);
      z |= in && op->kind == IR_OP_GATE_Z_LOSS;
    }
  fprintf(out, "  .aux_in_loss = %d, .z_in_loss = %d,\n", aux, z);
  // The step's floating-point operations on a rank: 2 per multiply-accumulate of its GEMMs (the
  // experts' over every capacity slot) and attention, forward and backward.
  double flops = 0;
  for (int i = 0; i < m->nfuncs; i++)
    for (int j = 0; j < m->funcs[i]->nops; j++) flops += 2 * pass_op_macs(m->funcs[i]->ops[j]);
  fprintf(out, "  .step_flops = %.17g,\n", flops);
  fprintf(out, "  .lr = %.17g, .min_lr = %.17g, .clip = %.17g, .warmup = %" PRId64 ", .decay_steps = %" PRId64 ",\n",
          ir_mod_float(m, "lr", 0), ir_mod_float(m, "min_lr", 0), ir_mod_float(m, "clip", 0), ir_mod_int(m, "warmup", 0),
          ir_mod_int(m, "decay_steps", 0));
  if (ir_mod_int(m, "vocab", 0) > 0) {
    fprintf(out, "  .vocab = %" PRId64 ", .vocab_parallel = %s,\n", ir_mod_int(m, "vocab", 0),
            ir_mod_int(m, "vocab_parallel", 0) ? "true" : "false");
    static const char *const data[] = {"data_train", "data_val", "data_format"};
    for (int i = 0; i < 3; i++) {
      const char *v = ir_mod_str(m, data[i], NULL);
      if (!v) continue;
      fprintf(out, "  .%s = ", data[i]);
      emit_string(out, v);
      fprintf(out, ",\n");
    }
  }
  if (o && (o->hf_config || o->hf_refusal)) {
    fprintf(out, o->hf_config ? "  .hf_config = " : "  .hf_refusal = ");
    emit_string(out, o->hf_config ? o->hf_config : o->hf_refusal);
    fprintf(out, ",\n");
  }
  const char *const hf_more[3][2] = {{"hf_generation", o ? o->hf_generation : NULL}, {"hf_changes", o ? o->hf_changes : NULL},
                                     {"hf_adapter", o ? o->hf_adapter : NULL}};
  for (int i = 0; i < 3; i++)
    if (hf_more[i][1]) {
      fprintf(out, "  .%s = ", hf_more[i][0]);
      emit_string(out, hf_more[i][1]);
      fprintf(out, ",\n");
    }
  if (o && o->layout_note) {
    fprintf(out, "  .layout_note = ");
    emit_string(out, o->layout_note);
    fprintf(out, ",\n");
  }
  int64_t pp = ir_mod_int(m, "pp", 1), micro = ir_mod_int(m, "microbatches", 1);
  if (micro > 1) fprintf(out, "  .microbatches = %" PRId64 ",\n", micro);
  if (pp > 1) {
    fprintf(out, "  .pp = %" PRId64 ", .stage = %" PRId64 ", .pp_schedule = %s,\n", pp, ir_mod_int(m, "stage", 0),
            strcmp(ir_mod_str(m, "pp_schedule", "1f1b"), "gpipe") == 0 ? "RT_PP_GPIPE" : "RT_PP_1F1B");
    // One stage of several: the program's main is the stages' (cg_emit_stages_main).
    fprintf(out, "};\n\nconst RtModel *const moec_stage_%" PRId64 " = &model;\n", ir_mod_int(m, "stage", 0));
    return;
  }
  fprintf(out, "};\n\nint main(int argc, char **argv) { return rt_main(&model, argc, argv); }\n");
}

void cg_emit_stages_main(FILE *out, const char *model_name, int stages) {
  fprintf(out, "/* Generated by moec: the main of model '%s', whose %d pipeline stages are programs of their own\n"
               "   (each its own C file); rt_main_stages runs a rank's. Do not edit. */\n#include \"moert.h\"\n\n",
          model_name, stages);
  for (int s = 0; s < stages; s++) fprintf(out, "extern const RtModel *const moec_stage_%d;\n", s);
  fprintf(out, "\nint main(int argc, char **argv) {\n  const RtModel *stages[%d];\n", stages);
  for (int s = 0; s < stages; s++) fprintf(out, "  stages[%d] = moec_stage_%d;\n", s, s);
  fprintf(out, "  return rt_main_stages(stages, %d, argc, argv);\n}\n", stages);
}
