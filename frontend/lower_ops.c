// The lowering's building blocks, below every file that lowers (lower.c, lower_moe.c, lower_lm.c,
// the gates' and experts' registry entries): ops with unique names and inferred types, the
// activations by word (ir/activations.def), parameters, a layer's forward function, the link of a
// pipeline stage, LoRA's adapters (lang/manual.md §7.3), and what every gate shares (capacity,
// router logits, noise, token choice). It calls nothing else of frontend/.
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

// The forward function of layer instance L->inst, and in its attributes which item of the source
// (`item`, the index of its `layer` in the file) and which of its repeats (`repeat`) it is.
void fe_layer_func(FeLower *L) {
  L->f = ir_add_func(L->m, ir_strfmt(L->m, "%s.fwd", L->inst), IR_ROLE_LAYER_FWD);
  L->f->loc = L->layer->loc;
  ir_attrs_set_int(L->f->attrs, &L->f->nattrs, "item", L->layer - L->p->layers);
  ir_attrs_set_int(L->f->attrs, &L->f->nattrs, "repeat", L->repeat);
}

void fe_lower_link(FeLower *L) {
  L->layer = NULL;
  L->inst = "loss";
  L->f = ir_add_func(L->m, "loss.fwd", IR_ROLE_LOSS_FWD);
  IrValue *out = ir_add_arg(L->f, L->m, "out", ir_type2(IR_F32, L->S, L->M));
  IrValue *dout = ir_add_arg(L->f, L->m, "dnext", ir_type2(IR_F32, L->S, L->M));
  ir_add_ret(L->f, L->m, fe_op2(L, IR_OP_LOSS_LINK, "loss", FE_V(out), FE_V(dout)));
}
