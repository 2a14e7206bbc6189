// Lowering: the checked program -> the forward IR module.
//
// Each MoE layer instance (`layer block x 2` gives block0, block1) becomes one forward
// function that takes the layer input %x [S, M] (S = batch*seqlen tokens) and returns %out and
// the gate's auxiliary losses. Its body follows the paper's Fig. 2 on one rank: the gate (a
// registry entry, frontend/gate_*.c) routes the tokens; the order packs them per expert —
// `tutel` by index (encode/decode), `gshard` with one-hot dispatch and combine matrices and
// GEMMs, as GShard's einsums; soft MoE's weights are dense by definition and both orders run
// them as GEMMs — the experts (frontend/expert_*.c) run batched over experts, the order unpacks
// and weights their outputs, a shared expert (when written) adds its output, and the residual is
// added. Hooks sit at their six points. The loss function compares the last output with the
// target; backward functions and the optimizer come from the autodiff pass.
//
// Constructs that parse and check but have no backend yet (on the target being built for) are
// refused here, one diagnostic each, naming the construct and where it was written — never
// silently ignored.
#include <math.h>
#include <string.h>

#include "fe_lower.h"

// ---- refusals ----
static void refuse_unsupported(IrDiag *d, const FeProgram *p, const FeTargetCaps *target) {
  // bf16 is mixed precision on the GPU (bf16 GEMM inputs, fp32 master weights and accumulation,
  // codegen/emit_cuda_host.c); the CPU backend computes in fp32 only.
  if (target && !target->bf16 && strcmp(p->model.dtype, "fp32") != 0)
    ir_error_at(d, p->model.dtype_loc,
                "dtype '%s' runs on the CUDA target only (bf16 GEMM inputs, fp32 master weights): the CPU "
                "backend trains in fp32; build with --target cuda, or write 'dtype fp32;'",
                p->model.dtype);
  if (p->model.has_lora && target && !target->lora)
    ir_error_at(d, p->model.lora.loc, "'lora' does not run on the %s target", target->name);
  if (p->model.has_lora && !p->model.has_vocab)
    ir_error_at(d, p->model.lora.loc, "lora needs a language model (vocab): an MoE stack has no dense projections");
  if (target && !target->shard_optimizer && p->model.optimizer.shard)
    ir_error_at(d, p->model.optimizer.loc,
                "'shard true' (the optimizer's moments sharded over each parameter's replicas) runs on the CPU "
                "target only: the %s target keeps every moment on every replica; leave 'shard' out to build for it",
                target->name);
  // `aux pooled` is one loss over every layer that has it: one coefficient, one number of experts.
  const FeLayer *pooled = NULL;
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *l = &p->layers[i];
    if (!l->has_moe || !fe_aux_pooled(&l->moe.gate)) continue;
    const SrcLoc at = l->moe.gate.field_loc[FE_GATE_F_AUX_FORM];
    if (!pooled) {
      pooled = l;
      continue;
    }
    if (l->moe.gate.aux_loss != pooled->moe.gate.aux_loss)
      ir_error_at(d, at, "'aux pooled' is one loss for the whole model: layer '%s' has aux_loss %g, layer '%s' %g; "
                         "give every pooled layer the same coefficient", l->name, l->moe.gate.aux_loss, pooled->name,
                  pooled->moe.gate.aux_loss);
    if (l->moe.experts.count != pooled->moe.experts.count)
      ir_error_at(d, at, "'aux pooled' is one loss for the whole model: layer '%s' has %lld experts, layer '%s' %lld; "
                         "it pools per-expert statistics over layers with the same number of experts",
                  l->name, (long long)l->moe.experts.count, pooled->name, (long long)pooled->moe.experts.count);
  }
  const FeParallel *par = &p->parallel;
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *l = &p->layers[i];
    if (par->dp * par->mp > 1 && l->has_moe && strcmp(l->moe.gate.name, "softmoe") == 0)
      ir_error_at(d, l->moe.gate.loc,
                  "gate 'softmoe' over several ranks is not supported yet: its slots would mix the "
                  "tokens of different ranks; train it on one rank");
  }
  const FeSchedule *s = &p->schedule;
  // The gradient partition is planned together with the degrees (paper §5): `auto` needs them.
  // Gradients are all-reduced in whole fp32 elements.
  if (strcmp(s->grad_partition, "chunk") == 0 && s->grad_chunk_bytes < 4)
    ir_error_at(d, s->grad_partition_loc,
                "'grad_partition chunk' needs at least 4 bytes (one fp32 gradient element), got %lld",
                (long long)s->grad_chunk_bytes);
  if (strcmp(s->grad_partition, "auto") == 0 && !s->pipeline_auto)
    ir_error_at(d, s->grad_partition_loc,
                "'grad_partition auto' is planned together with the pipeline degrees: write 'pipeline auto;' "
                "too, or 'grad_partition chunk SIZE;' for fixed chunks");
}

static void lower_layer(FeLower *L) {
  fe_layer_func(L);
  IrValue *x = ir_add_arg(L->f, L->m, "x", ir_type2(IR_F32, L->S, L->M));
  IrValue *aux = NULL, *z = NULL;
  IrValue *combined = fe_lower_moe(L, x, &aux, &z);
  IrValue *out = fe_op2(L, IR_OP_ADD, "out", FE_V(x), FE_V(combined));
  ir_add_ret(L->f, L->m, out);
  if (aux) ir_add_ret(L->f, L->m, aux);
  if (z) ir_add_ret(L->f, L->m, z);
}

void fe_stage_layers(const FeProgram *p, int stage, int64_t *first, int64_t *count) {
  int64_t instances = 0, pp = p->parallel.pp > 1 ? p->parallel.pp : 1;
  for (int i = 0; i < p->nlayers; i++) instances += p->layers[i].repeat;
  *first = 0;
  if (p->parallel.npp_layers == pp) {
    for (int s = 0; s < stage; s++) *first += p->parallel.pp_layers[s];
    *count = p->parallel.pp_layers[stage];
    return;
  }
  int64_t base = instances / pp, extra = instances % pp;
  for (int s = 0; s < stage; s++) *first += base + (s < extra);
  *count = base + (stage < extra);
}

IrModule *fe_lower(IrDiag *d, const FeProgram *p, const FeTargetCaps *caps) {
  int before = d->errors;
  refuse_unsupported(d, p, caps);
  if (d->errors > before) return NULL;

  IrModule *m = ir_module_new(p->model.name);
  FeLower L = {.d = d, .m = m, .p = p};
  ir_attrs_set_int(m->attrs, &m->nattrs, "batch", p->model.batch);
  ir_attrs_set_int(m->attrs, &m->nattrs, "seqlen", p->model.seqlen);
  ir_attrs_set_int(m->attrs, &m->nattrs, "embed", p->model.embed);
  ir_attrs_set_int(m->attrs, &m->nattrs, "seed", p->model.seed);
  ir_attrs_set_str(m, m->attrs, &m->nattrs, "dtype", p->model.dtype);
  const FeOptimizer *o = &p->model.optimizer;
  ir_attrs_set_str(m, m->attrs, &m->nattrs, "optimizer", o->name);
  ir_attrs_set_float(m->attrs, &m->nattrs, "lr", o->lr);
  if (strcmp(o->name, "adamw") == 0) {
    ir_attrs_set_float(m->attrs, &m->nattrs, "beta1", o->beta1);
    ir_attrs_set_float(m->attrs, &m->nattrs, "beta2", o->beta2);
    ir_attrs_set_float(m->attrs, &m->nattrs, "eps", o->eps);
  }
  ir_attrs_set_float(m->attrs, &m->nattrs, "weight_decay", o->weight_decay);
  if (o->warmup > 0) ir_attrs_set_int(m->attrs, &m->nattrs, "warmup", o->warmup);
  if (o->decay_steps > 0) ir_attrs_set_int(m->attrs, &m->nattrs, "decay_steps", o->decay_steps);
  if (o->min_lr > 0) ir_attrs_set_float(m->attrs, &m->nattrs, "min_lr", o->min_lr);
  if (o->clip > 0) ir_attrs_set_float(m->attrs, &m->nattrs, "clip", o->clip);
  if (o->shard) ir_attrs_set_int(m->attrs, &m->nattrs, "shard_optimizer", 1);
  if (p->model.vocab_parallel && p->model.vocab > 0 && p->parallel.mp > 1)
    ir_attrs_set_int(m->attrs, &m->nattrs, "vocab_parallel", 1);
  if (p->model.recompute && strcmp(p->model.recompute, "none") != 0)
    ir_attrs_set_int(m->attrs, &m->nattrs, "recompute",
                     strcmp(p->model.recompute, "layers") == 0  ? 3
                     : strcmp(p->model.recompute, "norms") == 0 ? 2
                                                                : 1);
  if (p->model.has_data) {
    const FeData *dt = &p->model.data;
    if (dt->train) ir_attrs_set_str(m, m->attrs, &m->nattrs, "data_train", dt->train);
    if (dt->val) ir_attrs_set_str(m, m->attrs, &m->nattrs, "data_val", dt->val);
    if (dt->format) ir_attrs_set_str(m, m->attrs, &m->nattrs, "data_format", dt->format);
  }
  // The schedule (passes/schedule.c), only where it is not the default (sequential, degree 1).
  const FeSchedule *sched = &p->schedule;
  if (strcmp(sched->policy, "sequential") != 0) ir_attrs_set_str(m, m->attrs, &m->nattrs, "policy", sched->policy);
  if (sched->pipeline_fwd != 1) ir_attrs_set_int(m->attrs, &m->nattrs, "r_fwd", sched->pipeline_fwd);
  if (sched->pipeline_bwd != 1) ir_attrs_set_int(m->attrs, &m->nattrs, "r_bwd", sched->pipeline_bwd);
  if (sched->pipeline_auto) ir_attrs_set_str(m, m->attrs, &m->nattrs, "pipeline", "auto");
  if (strcmp(sched->grad_partition, "none") != 0)
    ir_attrs_set_str(m, m->attrs, &m->nattrs, "grad_partition", sched->grad_partition);
  if (strcmp(sched->grad_partition, "chunk") == 0)
    ir_attrs_set_int(m->attrs, &m->nattrs, "grad_chunk", sched->grad_chunk_bytes);
  const FeParallel *par = &p->parallel;
  if (par->dp * par->mp > 1) {
    ir_attrs_set_int(m->attrs, &m->nattrs, "dp", par->dp);
    ir_attrs_set_int(m->attrs, &m->nattrs, "mp", par->mp);
    ir_attrs_set_int(m->attrs, &m->nattrs, "ep", par->ep);
    ir_attrs_set_int(m->attrs, &m->nattrs, "esp", par->esp);
  }

  // Pipeline stages and microbatches (lang/manual.md §6): the program is one stage's, for one
  // microbatch of batch/microbatches samples.
  int64_t micro = p->parallel.microbatches > 1 ? p->parallel.microbatches : 1;
  if (micro > 1) {
    ir_attrs_set_int(m->attrs, &m->nattrs, "batch", p->model.batch / micro);
    ir_attrs_set_int(m->attrs, &m->nattrs, "microbatches", micro);
  }
  int64_t count = 0;
  fe_stage_layers(p, p->stage, &L.stage_first, &count);
  L.stage_end = L.stage_first + count;
  if (p->parallel.pp > 1) {
    ir_attrs_set_int(m->attrs, &m->nattrs, "pp", p->parallel.pp);
    ir_attrs_set_int(m->attrs, &m->nattrs, "stage", p->stage);
    ir_attrs_set_str(m, m->attrs, &m->nattrs, "pp_schedule", p->parallel.pp_schedule);
  }
  L.S = p->model.batch / micro * p->model.seqlen;
  L.M = p->model.embed;
  if (p->model.has_vocab) {
    fe_lower_lm(&L);
    fe_lora_freeze(&L);
    return m;
  }
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *l = &p->layers[i];
    L.layer = l;
    L.E = l->moe.experts.count;
    L.H = l->moe.experts.hidden;
    L.G = l->moe.gate.groups * p->parallel.mp;  // routing groups of one DP rank's tokens
    for (int64_t r = 0; r < l->repeat; r++, L.layer_index++) {
      if (L.layer_index < L.stage_first || L.layer_index >= L.stage_end) continue;
      L.inst = ir_strfmt(m, "%s%lld", l->name, (long long)r);
      L.repeat = r;
      lower_layer(&L);
    }
  }

  if (!fe_last_stage(&L)) {
    fe_lower_link(&L);
    return m;
  }
  L.layer = NULL;
  L.f = ir_add_func(m, "loss.fwd", IR_ROLE_LOSS_FWD);
  IrValue *out = ir_add_arg(L.f, m, "out", ir_type2(IR_F32, L.S, L.M));
  IrValue *target = ir_add_arg(L.f, m, "target", ir_type2(IR_F32, L.S, L.M));
  ir_add_ret(L.f, m, fe_op2(&L, IR_OP_LOSS_MSE, "loss", FE_V(out), FE_V(target)));
  return m;
}
