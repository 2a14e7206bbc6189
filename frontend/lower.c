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

IrValue *fe_emit(FeLower *L, IrOpKind kind, const char *name, int nargs, const IrOperand *args,
                 int nattrs, const IrAttr *attrs) {
  // Names are unique within a function: a second `h` becomes `h.1`.
  for (int n = 1; name && ir_find_value(L->f, name); n++) {
    const char *dot = strrchr(name, '.');
    size_t base = dot && dot[1] >= '0' && dot[1] <= '9' ? (size_t)(dot - name) : strlen(name);
    name = ir_strfmt(L->m, "%.*s.%d", (int)base, name, n);
  }
  IrOp *op = ir_add_op(L->f, L->m, kind, name, (IrType){0});
  for (int i = 0; i < nargs; i++) op->args[op->nargs++] = args[i];
  for (int i = 0; i < nattrs; i++) {
    if (attrs[i].kind == IR_ATTR_INT) ir_op_set_int(op, attrs[i].key, attrs[i].i);
    else if (attrs[i].kind == IR_ATTR_FLOAT) ir_op_set_float(op, attrs[i].key, attrs[i].f);
    else ir_attrs_set_str(L->m, op->attrs, &op->nattrs, attrs[i].key, attrs[i].s);
  }
  op->loc = L->layer ? L->layer->loc : (SrcLoc){0};
  if (!name) return NULL;
  if (!ir_infer_type(L->d, op, &op->result->type)) UNREACHABLE();  // lowering builds well-typed ops
  return op->result;
}

IrValue *fe_op1(FeLower *L, IrOpKind kind, const char *name, IrOperand a) {
  return fe_emit(L, kind, name, 1, &a, 0, NULL);
}

IrValue *fe_op2(FeLower *L, IrOpKind kind, const char *name, IrOperand a, IrOperand b) {
  return fe_emit(L, kind, name, 2, (IrOperand[]){a, b}, 0, NULL);
}

IrValue *fe_act(FeLower *L, const char *word, const char *name, IrValue *x) {
  const IrActInfo *act = ir_act_named(word);
  // The checker takes `act`'s words from the same table, so a word without a row is a bug; it
  // stops here rather than becoming some other activation.
  if (!act) {
    ir_internal_at(L->d, L->layer ? L->layer->loc : (SrcLoc){0}, "activation '%s' has no row in ir/activations.def",
                   word ? word : "(none)");
    UNREACHABLE();
  }
  return fe_op1(L, act->op, name, FE_V(x));
}

IrParam *fe_expert_param(FeLower *L, const char *suffix, IrType t, const char *init, double value,
                         int hidden_dim) {
  IrParam *p = fe_param(L, suffix, t, init, value);
  ir_attrs_set_int(p->attrs, &p->nattrs, "shard_expert", 0);
  if (hidden_dim >= 0) ir_attrs_set_int(p->attrs, &p->nattrs, "shard_hidden", hidden_dim);
  return p;
}

IrParam *fe_param(FeLower *L, const char *suffix, IrType t, const char *init, double value) {
  IrParam *p = ir_add_param(L->m, ir_strfmt(L->m, "%s.%s", L->inst, suffix), t);
  ir_attrs_set_str(L->m, p->attrs, &p->nattrs, "init", init);
  if (strcmp(init, "normal") == 0) ir_attrs_set_float(p->attrs, &p->nattrs, "std", value);
  if (strcmp(init, "const") == 0) ir_attrs_set_float(p->attrs, &p->nattrs, "value", value);
  return p;
}

// ---- LoRA (lang/manual.md) ----
// PEFT's LoraLayer: result = base(x) + lora_B(lora_A(x)) * (alpha / r); moec's weights are [in,
// out] (x·W), so A [in, r] and B [r, out] are PEFT's lora_A.weight and lora_B.weight transposed.
// moec scales x·A (r columns) before B rather than the product's out columns: the same sum, a
// pass over r columns instead of out. A
// starts as PEFT's default (kaiming_uniform with a = sqrt(5): uniform within 1/sqrt(in)), B zeros.
static void lora_params(FeLower *L, const IrParam *w, IrType ta, IrType tb, int64_t in, IrParam **a, IrParam **b,
                        IrParam **s);

// Multi-head latent attention's projections (lower_lm.c mla_attention) are PEFT's modules of
// DeepSeek's attention: q's bottleneck wq_a and wq_b (q_a_proj, q_b_proj) are target q's; wkv_a
// (kv_a_proj_with_mqa) and wkv_b (kv_b_proj) make the keys and the values alike, so they are
// targets k's and v's, which frontend/check.c has come together on an mla layer.
bool fe_lora_target(const FeLower *L, const char *suffix) {
  const FeLora *lo = &L->p->model.lora;
  if (!L->p->model.has_lora) return false;
  if (strncmp(suffix, "attn.w", 6) == 0 && strlen(suffix) == 7)   // attn.wq, .wk, .wv, .wo
    return (suffix[6] == 'q' && lo->q) || (suffix[6] == 'k' && lo->k) || (suffix[6] == 'v' && lo->v) ||
           (suffix[6] == 'o' && lo->o);
  if (strcmp(suffix, "attn.wq_a") == 0 || strcmp(suffix, "attn.wq_b") == 0) return lo->q;
  if (strcmp(suffix, "attn.wkv_a") == 0 || strcmp(suffix, "attn.wkv_b") == 0) return lo->k || lo->v;
  return lo->mlp && strncmp(suffix, "mlp.w", 5) == 0;
}

IrValue *fe_lora(FeLower *L, IrValue *x, IrValue *y, const IrParam *w, const char *name, int split_a, int split_b) {
  int64_t in = w->type.dim[0], out = w->type.dim[1], r = L->p->model.lora.r;
  IrParam *a, *b, *s;
  lora_params(L, w, ir_type2(IR_F32, in, r), ir_type2(IR_F32, r, out), in, &a, &b, &s);
  if (split_a >= 0) ir_attrs_set_int(a->attrs, &a->nattrs, "mp_split", split_a);
  if (split_b >= 0) ir_attrs_set_int(b->attrs, &b->nattrs, "mp_split", split_b);
  IrValue *t = fe_op2(L, IR_OP_MATMUL, ir_strfmt(L->m, "%s.lora_a", name), FE_V(x), FE_P(a));
  t = fe_op2(L, IR_OP_SCALE, ir_strfmt(L->m, "%s.lora_s", name), FE_V(t), FE_P(s));
  IrValue *u = fe_op2(L, IR_OP_MATMUL, ir_strfmt(L->m, "%s.lora", name), FE_V(t), FE_P(b));
  return fe_op2(L, IR_OP_ADD, ir_strfmt(L->m, "%s.lora_y", name), FE_V(y), FE_V(u));
}

// The adapters' parameters of weight w: A (uniform), B (zeros), the frozen scale [r] (alpha / r).
static void lora_params(FeLower *L, const IrParam *w, IrType ta, IrType tb, int64_t in, IrParam **a, IrParam **b,
                        IrParam **s) {
  const FeLora *lo = &L->p->model.lora;
  *a = ir_add_param(L->m, ir_strfmt(L->m, "%s.lora_A", w->name), ta);
  *b = ir_add_param(L->m, ir_strfmt(L->m, "%s.lora_B", w->name), tb);
  *s = ir_add_param(L->m, ir_strfmt(L->m, "%s.lora_scale", w->name), ir_type1(IR_F32, lo->r));
  ir_attrs_set_str(L->m, (*a)->attrs, &(*a)->nattrs, "init", "uniform");
  ir_attrs_set_float((*a)->attrs, &(*a)->nattrs, "std", 1.0 / sqrt((double)in));
  ir_attrs_set_str(L->m, (*b)->attrs, &(*b)->nattrs, "init", "zeros");
  ir_attrs_set_str(L->m, (*s)->attrs, &(*s)->nattrs, "init", "const");
  ir_attrs_set_float((*s)->attrs, &(*s)->nattrs, "value", lo->alpha / (double)lo->r);
  IrParam *all[3] = {*a, *b, *s};
  for (int k = 0; k < 3; k++) {
    ir_attrs_set_int(all[k]->attrs, &all[k]->nattrs, "lora", 1);
    if (ir_attrs_get(w->attrs, w->nattrs, "dense")) ir_attrs_set_int(all[k]->attrs, &all[k]->nattrs, "dense", 1);
    if (k < 2 && ir_attrs_get(w->attrs, w->nattrs, "shard_expert"))
      ir_attrs_set_int(all[k]->attrs, &all[k]->nattrs, "shard_expert", 0);
  }
  // ESP splits an expert's hidden units: W's output columns (w1, w3) split B's, its input rows
  // (w2) split A's; the other adapter is whole on every ESP rank, its gradient summed over ESP.
  int64_t hidden = ir_attr_int(w->attrs, w->nattrs, "shard_hidden", -1);
  if (hidden == 2) ir_attrs_set_int((*b)->attrs, &(*b)->nattrs, "shard_hidden", 2);
  if (hidden == 1) ir_attrs_set_int((*a)->attrs, &(*a)->nattrs, "shard_hidden", 1);
}

// The experts' w3 (the up projection) shares w1's A and scale: transformers keeps the experts' gate
// and up projections in one tensor (gate_up_proj) and PEFT's adapter of it has one A; w3 gets
// its own B (W.lora_B, zeros). NULL: w is no w3 beside an adapted w1.
static IrParam *shared_gate_a(FeLower *L, const IrParam *w, int64_t r, int64_t out, IrParam **b, IrParam **s) {
  size_t len = strlen(w->name);
  if (len < 3 || strcmp(w->name + len - 3, ".w3") != 0) return NULL;
  IrParam *a = ir_find_param(L->m, ir_strfmt(L->m, "%.*s1.lora_A", (int)len - 1, w->name));
  *s = ir_find_param(L->m, ir_strfmt(L->m, "%.*s1.lora_scale", (int)len - 1, w->name));
  if (!a || !*s) return NULL;
  *b = ir_add_param(L->m, ir_strfmt(L->m, "%s.lora_B", w->name), ir_type3(IR_F32, w->type.dim[0], r, out));
  ir_attrs_set_str(L->m, (*b)->attrs, &(*b)->nattrs, "init", "zeros");
  ir_attrs_set_int((*b)->attrs, &(*b)->nattrs, "lora", 1);
  if (ir_attrs_get(w->attrs, w->nattrs, "shard_expert")) ir_attrs_set_int((*b)->attrs, &(*b)->nattrs, "shard_expert", 0);
  if (ir_attr_int(w->attrs, w->nattrs, "shard_hidden", -1) == 2)   // ESP: as lora_params does w1's
    ir_attrs_set_int((*b)->attrs, &(*b)->nattrs, "shard_hidden", 2);
  return a;
}

IrValue *fe_expert_linear(FeLower *L, const char *name, IrValue *x, IrParam *w) {
  IrValue *y = fe_op2(L, IR_OP_EXPERT_MATMUL, name, FE_V(x), FE_P(w));
  if (!L->p->model.has_lora || !L->p->model.lora.experts) return y;
  int64_t E = w->type.dim[0], in = w->type.dim[1], out = w->type.dim[2], r = L->p->model.lora.r;
  IrParam *a, *b, *s;
  if (!(a = shared_gate_a(L, w, r, out, &b, &s)))
    lora_params(L, w, ir_type3(IR_F32, E, in, r), ir_type3(IR_F32, E, r, out), in, &a, &b, &s);
  IrValue *t = L->lora_a == a && L->lora_x == x ? L->lora_t : NULL;
  if (!t) {
    t = fe_op2(L, IR_OP_EXPERT_MATMUL, ir_strfmt(L->m, "%s.lora_a", name), FE_V(x), FE_P(a));
    t = fe_emit(L, IR_OP_EXPERT_SCALE, ir_strfmt(L->m, "%s.lora_s", name), 2, (IrOperand[]){FE_V(t), FE_P(s)}, 1,
                (IrAttr[]){FE_I("expert_lora", 1)});
    L->lora_x = x, L->lora_t = t, L->lora_a = a;
  }
  IrValue *u = fe_op2(L, IR_OP_EXPERT_MATMUL, ir_strfmt(L->m, "%s.lora", name), FE_V(t), FE_P(b));
  // expert_lora: of the expert region (passes/parallelize.c, schedule.c), whose last op it can be
  return fe_emit(L, IR_OP_ADD, ir_strfmt(L->m, "%s.lora_y", name), 2, (IrOperand[]){FE_V(y), FE_V(u)}, 1,
                 (IrAttr[]){FE_I("expert_lora", 1)});
}

void fe_lora_freeze(FeLower *L) {
  if (!L->p->model.has_lora) return;
  for (int i = 0; i < L->m->nparams; i++) {
    IrParam *p = L->m->params[i];
    const char *n = p->name;
    size_t len = strlen(n);
    bool adapter = (len > 7 && (strcmp(n + len - 7, ".lora_A") == 0 || strcmp(n + len - 7, ".lora_B") == 0));
    if (!adapter) ir_attrs_set_int(p->attrs, &p->nattrs, "frozen", 1);
  }
}

int64_t fe_capacity(const FeLower *L, int64_t k) {
  const FeGate *g = &L->layer->moe.gate;
  int64_t tokens = L->S / L->G;
  if (g->dropless) return tokens;  // the most one expert can get: every token's choices are distinct
  return ir_capacity_slots(k, g->capacity, tokens, L->E);
}

IrValue *fe_router_logits(FeLower *L, IrValue *x) {
  IrParam *wg = fe_param(L, "moe.gate.wg", ir_type2(IR_F32, L->M, L->E), "normal", 1.0 / sqrt((double)L->M));
  IrValue *logits = fe_op2(L, IR_OP_MATMUL, "logits", FE_V(x), FE_P(wg));
  if (!L->layer->moe.gate.bias) return logits;
  IrParam *bg = fe_param(L, "moe.gate.bg", ir_type1(IR_F32, L->E), "zeros", 0);
  return fe_op2(L, IR_OP_BIAS, "logits_b", FE_V(logits), FE_P(bg));
}

IrValue *fe_noise(FeLower *L, IrValue *logits) {
  double sigma = L->layer->moe.gate.noise;
  if (sigma <= 0) return logits;
  return fe_emit(L, IR_OP_GATE_NOISE, "noisy", 1, (IrOperand[]){FE_V(logits)}, 2,
                 (IrAttr[]){FE_F("sigma", sigma), FE_I("layer", L->layer_index)});
}

void fe_token_choice(FeLower *L, IrValue *logits, IrValue *scores, bool renorm, FeRouting *out) {
  const FeGate *g = &L->layer->moe.gate;
  out->capacity = fe_capacity(L, g->k);
  IrAttr route[4] = {FE_I("experts", L->E), FE_I("groups", L->G), FE_I("capacity", out->capacity),
                     FE_I("dropless", 1)};
  // The choice: top k of the scores (plus the correction bias with `balance bias`), among the best
  // expert groups with a group limit; the gates are the chosen scores, without the bias.
  IrAttr choice[4] = {FE_I("k", g->k)};
  int nchoice = 1;
  if (g->expert_groups > 1 && g->topk_groups < g->expert_groups) {
    choice[nchoice++] = FE_I("expert_groups", g->expert_groups);
    choice[nchoice++] = FE_I("topk_groups", g->topk_groups);
    if (strcmp(g->group_score, "max") == 0) choice[nchoice++] = FE_I("group_score", 1);
  }
  if (g->balance) {
    IrParam *eb = fe_param(L, "moe.gate.eb", ir_type1(IR_F32, L->E), "zeros", 0);
    ir_attrs_set_float(eb->attrs, &eb->nattrs, "balance", g->balance_rate);
    out->idx = fe_emit(L, IR_OP_GATE_TOPK_BIAS, "idx", 2, (IrOperand[]){FE_V(scores), FE_P(eb)}, nchoice, choice);
  } else {
    out->idx = fe_emit(L, IR_OP_GATE_TOPK, "idx", 1, (IrOperand[]){FE_V(scores)}, nchoice, choice);
  }
  IrAttr gather[2] = {FE_I("renorm", renorm), FE_F("scale", g->scale)};
  out->gates = fe_emit(L, IR_OP_GATE_GATHER, "gates", 2, (IrOperand[]){FE_V(scores), FE_V(out->idx)},
                       g->scale != 1 ? 2 : 1, gather);
  out->loc = fe_emit(L, IR_OP_GATE_LOCATIONS, "loc", 1, (IrOperand[]){FE_V(out->idx)}, g->dropless ? 4 : 3, route);
  if (fe_aux_pooled(g))  // the model's one pooled loss: this layer's sums, pooled by the runtime
    out->aux = fe_emit(L, IR_OP_GATE_AUX_POOLED, "aux", 2, (IrOperand[]){FE_V(scores), FE_V(out->idx)}, 1,
                       (IrAttr[]){FE_F("coef", g->aux_loss)});
  else if (fe_aux_sequence(g))   // DeepSeek-V3's: one group per sequence of the rank's tokens
    out->aux = fe_emit(L, IR_OP_GATE_AUX_LOSS, "aux", 2, (IrOperand[]){FE_V(scores), FE_V(out->idx)}, 3,
                       (IrAttr[]){FE_I("groups", L->S / L->p->model.seqlen), FE_F("coef", g->aux_loss),
                                  FE_I("sequence", 1)});
  else
    out->aux = fe_emit(L, IR_OP_GATE_AUX_LOSS, "aux", 2, (IrOperand[]){FE_V(scores), FE_V(out->idx)}, 2,
                       (IrAttr[]){FE_I("groups", L->G), FE_F("coef", g->aux_loss)});
  out->z = fe_emit(L, IR_OP_GATE_Z_LOSS, "z", 1, (IrOperand[]){FE_V(logits)}, 2,
                   (IrAttr[]){FE_I("groups", L->G), FE_F("coef", g->z_loss)});
}

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

// ---- hooks ----
static const FeHook *find_hook(const FeLower *L, const char *point, const char *action) {
  const FeMoe *moe = &L->layer->moe;
  for (int i = 0; i < moe->nhooks; i++)
    if (strcmp(moe->hooks[i].point, point) == 0 && strcmp(moe->hooks[i].action, action) == 0)
      return &moe->hooks[i];
  return NULL;
}

static void record(FeLower *L, const char *point, IrValue *v) {
  if (!find_hook(L, point, "record")) return;
  fe_emit(L, IR_OP_HOOK_RECORD, NULL, 1, (IrOperand[]){FE_V(v)}, 2,
          (IrAttr[]){{.key = "point", .kind = IR_ATTR_STR, .s = point}, FE_I("layer", L->layer_index)});
}

// A tensor about to cross the network at `before` (before_dispatch, before_combine): record
// it, compress it when asked; the matching after-point decompresses and may record again.
static IrValue *hook_pair(FeLower *L, const char *before, const char *after, IrValue *v, const char *name) {
  record(L, before, v);
  const FeHook *c = find_hook(L, before, "compress");
  if (c) {
    if (strcmp(c->arg, "int8") == 0) {
      IrValue *scales = fe_op1(L, IR_OP_HOOK_SCALES, ir_strfmt(L->m, "%s.scales", name), FE_V(v));
      IrValue *q = fe_op2(L, IR_OP_HOOK_COMPRESS_INT8, ir_strfmt(L->m, "%s.q", name), FE_V(v), FE_V(scales));
      v = fe_op2(L, IR_OP_HOOK_DECOMPRESS_INT8, ir_strfmt(L->m, "%s.dq", name), FE_V(q), FE_V(scales));
    } else {
      IrValue *q = fe_emit(L, IR_OP_HOOK_COMPRESS, ir_strfmt(L->m, "%s.q", name), 1, (IrOperand[]){FE_V(v)}, 1,
                           (IrAttr[]){{.key = "format", .kind = IR_ATTR_STR, .s = c->arg}});
      v = fe_op1(L, IR_OP_HOOK_DECOMPRESS, ir_strfmt(L->m, "%s.dq", name), FE_V(q));
    }
  }
  record(L, after, v);
  return v;
}

// ---- orders ----
static IrValue *reshape(FeLower *L, const char *name, IrValue *v, int rank, int64_t d0, int64_t d1, int64_t d2) {
  IrAttr a[4] = {FE_I("rank", rank), FE_I("d0", d0), FE_I("d1", d1), FE_I("d2", d2)};
  return fe_emit(L, IR_OP_RESHAPE, name, 1, (IrOperand[]){FE_V(v)}, rank + 1, a);
}

// ---- the shared expert ----
// `shared { ffn mixtral { hidden Hs; } gate sigmoid; }`: every token also goes through one SwiGLU
// expert, s = (silu(x·W1) ⊙ (x·W3))·W2, scaled by sigmoid(x·wg) per token when gated (Qwen2-MoE's
// shared_expert and shared_expert_gate), and s is added to the routed output. Its parameters are
// dense, not expert parameters: parallelize replicates them on every rank, which computes the
// shared expert of its own tokens (after the MP split), and reduces their gradients over the
// world, as the gate's.
static IrValue *shared_expert(FeLower *L, IrValue *x) {
  const FeMoe *moe = &L->layer->moe;
  int64_t M = L->M, Hs = moe->shared.hidden;
  double in_std = 1.0 / sqrt((double)M);
  IrParam *w1 = fe_param(L, "moe.shared.w1", ir_type2(IR_F32, M, Hs), "normal", in_std);
  IrParam *w3 = fe_param(L, "moe.shared.w3", ir_type2(IR_F32, M, Hs), "normal", in_std);
  IrParam *w2 = fe_param(L, "moe.shared.w2", ir_type2(IR_F32, Hs, M), "normal", 1.0 / sqrt((double)Hs));
  bool lora = L->p->model.has_lora && L->p->model.lora.shared;
  IrValue *h1 = fe_op2(L, IR_OP_MATMUL, "shared.h1", FE_V(x), FE_P(w1));
  if (lora) h1 = fe_lora(L, x, h1, w1, "shared.h1", -1, -1);
  IrValue *h3 = fe_op2(L, IR_OP_MATMUL, "shared.h3", FE_V(x), FE_P(w3));
  if (lora) h3 = fe_lora(L, x, h3, w3, "shared.h3", -1, -1);
  IrValue *a = fe_op1(L, IR_OP_ACT_SILU, "shared.act", FE_V(h1));
  IrValue *glu = fe_op2(L, IR_OP_MUL, "shared.glu", FE_V(a), FE_V(h3));
  const char *yname = moe->shared_gated ? "shared.y" : "shared";
  IrValue *y = fe_op2(L, IR_OP_MATMUL, lora ? "shared.y0" : yname, FE_V(glu), FE_P(w2));
  if (lora) y = fe_lora(L, glu, y, w2, yname, -1, -1);
  if (!moe->shared_gated) return y;
  IrParam *wg = fe_param(L, "moe.shared.gate", ir_type2(IR_F32, M, 1), "normal", in_std);
  IrValue *logit = fe_op2(L, IR_OP_MATMUL, "shared.logit", FE_V(x), FE_P(wg));
  IrValue *g = fe_op1(L, IR_OP_GATE_SIGMOID, "shared.g", FE_V(logit));
  return fe_op2(L, IR_OP_SCALE_ROWS, "shared", FE_V(y), FE_V(g));
}

IrValue *fe_lower_moe(FeLower *L, IrValue *x, IrValue **aux, IrValue **z) {
  const FeMoe *moe = &L->layer->moe;
  const FeGateDef *gate = fe_gate_find(moe->gate.name);
  const FeExpertDef *expert = fe_expert_find(moe->experts.kind);
  if (!gate || !expert) UNREACHABLE();  // the checker accepts registered names only
  record(L, "before_moe_start", x);

  FeRouting r = {0};
  gate->lower(L, x, &r);
  bool dense = r.soft || strcmp(moe->order, "gshard") == 0;
  int64_t C = r.soft ? r.slots : L->G * r.capacity;
  IrAttr route[3] = {FE_I("experts", L->E), FE_I("groups", L->G), FE_I("capacity", r.capacity)};
  IrValue *disp, *mask = NULL;
  if (r.soft) {
    disp = fe_emit(L, IR_OP_MATMUL, "disp2", 2, (IrOperand[]){FE_V(r.dispatch), FE_V(x)}, 1, (IrAttr[]){FE_I("ta", 1)});
    disp = reshape(L, "disp", disp, 3, L->E, C, L->M);
  } else if (dense) {
    mask = fe_emit(L, IR_OP_ORDER_DISPATCH_MASK, "mask", 2, (IrOperand[]){FE_V(r.idx), FE_V(r.loc)}, 3, route);
    disp = fe_emit(L, IR_OP_MATMUL, "disp2", 2, (IrOperand[]){FE_V(mask), FE_V(x)}, 1, (IrAttr[]){FE_I("ta", 1)});
    disp = reshape(L, "disp", disp, 3, L->E, C, L->M);
    // MP splits the tokens (passes/parallelize.c): the capacity slots of dimension 1 shrink with them
    if (L->p->parallel.mp > 1) ir_op_set_int(disp->def, "mp_tokens", 1);
  } else {
    disp = fe_emit(L, IR_OP_ORDER_ENCODE, "disp", 3, (IrOperand[]){FE_V(x), FE_V(r.idx), FE_V(r.loc)}, 3, route);
  }
  disp = hook_pair(L, "before_dispatch", "after_dispatch", disp, "disp");
  int before = L->m->nparams;
  IrValue *y = expert->lower(L, disp);
  for (int i = before; L->p->parallel.dp * L->p->parallel.mp > 1 && i < L->m->nparams; i++) {
    // the layer's dispatch algorithm, for parallelize
    IrParam *p = L->m->params[i];
    ir_attrs_set_str(L->m, p->attrs, &p->nattrs, "dispatch", moe->algo);
  }
  y = hook_pair(L, "before_combine", "after_combine", y, "y");
  IrValue *combined;
  if (dense) {
    IrValue *y2 = reshape(L, "y2", y, 2, L->E * C, L->M, 0);
    if (!r.soft && L->p->parallel.mp > 1) ir_op_set_int(y2->def, "mp_tokens", 0);
    IrValue *cw = r.soft ? r.combine
                         : fe_emit(L, IR_OP_ORDER_COMBINE_WEIGHTS, "cw", 3,
                                   (IrOperand[]){FE_V(r.idx), FE_V(r.loc), FE_V(r.gates)}, 3, route);
    combined = fe_op2(L, IR_OP_MATMUL, "moe", FE_V(cw), FE_V(y2));
  } else {
    combined = fe_emit(L, IR_OP_ORDER_DECODE, "moe", 4,
                       (IrOperand[]){FE_V(y), FE_V(r.idx), FE_V(r.loc), FE_V(r.gates)}, 3, route);
  }
  if (moe->has_shared)
    combined = fe_op2(L, IR_OP_ADD, "moe.total", FE_V(combined), FE_V(shared_expert(L, x)));
  record(L, "before_moe_end", combined);
  *aux = r.aux;
  *z = r.z;
  return combined;
}

// The forward function of layer instance L->inst, and in its attributes which item of the source
// (`item`, the index of its `layer` in the file) and which of its repeats (`repeat`) it is.
void fe_layer_func(FeLower *L) {
  L->f = ir_add_func(L->m, ir_strfmt(L->m, "%s.fwd", L->inst), IR_ROLE_LAYER_FWD);
  L->f->loc = L->layer->loc;
  ir_attrs_set_int(L->f->attrs, &L->f->nattrs, "item", L->layer - L->p->layers);
  ir_attrs_set_int(L->f->attrs, &L->f->nattrs, "repeat", L->repeat);
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

void fe_lower_link(FeLower *L) {
  L->layer = NULL;
  L->inst = "loss";
  L->f = ir_add_func(L->m, "loss.fwd", IR_ROLE_LOSS_FWD);
  IrValue *out = ir_add_arg(L->f, L->m, "out", ir_type2(IR_F32, L->S, L->M));
  IrValue *dout = ir_add_arg(L->f, L->m, "dnext", ir_type2(IR_F32, L->S, L->M));
  ir_add_ret(L->f, L->m, fe_op2(L, IR_OP_LOSS_LINK, "loss", FE_V(out), FE_V(dout)));
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
