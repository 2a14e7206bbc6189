// Lowering of a language model (lang/manual.md §7.2): a model with `vocab V`.
//
// The step's input is the tokens of this DP rank's windows, i32 [S] (S = batch*seqlen, row
// s = b*seqlen + i), and its target the next tokens, i32 [S]. The functions, in order:
//   @embed.fwd(%tokens) -> %h          h = wte[t] (+ wpe[i] with learned positions)
//   @INST.fwd(%x) -> %out (, aux, z)   a = x + Attn(Norm_attn(x)); out = a + F(Norm_ffn(a)),
//                                      F the layer's moe (frontend/lower_moe.c, without its
//                                      residual) or its mlp (one dense FFN)
//   @loss.fwd(%out, %target) -> %loss, %logits
//                                      logits = Norm_final(out)·wteᵀ (tied) or ·head.w;
//                                      loss = mean cross-entropy (its share over DP ranks)
// Parameters use the names of lang/manual.md §7.2 and GPT-2's initialisation: weights normal(0.02), the
// output projections (attn.wo, mlp.w2) scaled by 1/sqrt(2*layers), norms 1 and 0, biases 0. The
// MoE's own parameters keep the initialisation of the MoE stacks (manual §11.8).
#include <math.h>
#include <string.h>

#include "fe_lower.h"

#define STD 0.02

static bool layernorm(const FeLower *L) { return strcmp(L->p->model.norm, "layernorm") == 0; }

// A parameter outside the MoE: every MP rank computes with all of it on the same tokens, so its
// gradient is reduced over DP only (passes/parallelize.c reads `dense`).
static IrParam *dense_param(FeLower *L, const char *suffix, IrType t, const char *init, double value) {
  IrParam *p = fe_param(L, suffix, t, init, value);
  ir_attrs_set_int(p->attrs, &p->nattrs, "dense", 1);
  return p;
}

// Norm(x)·w (+ b): the model's norm with its learned scale (and shift for layernorm), as
// parameters PREFIX.weight and PREFIX.bias of the instance (weight and bias when PREFIX is NULL).
static IrValue *norm(FeLower *L, IrValue *x, const char *prefix, const char *name) {
  const char *wname = prefix ? ir_strfmt(L->m, "%s.weight", prefix) : "weight";
  const char *bname = prefix ? ir_strfmt(L->m, "%s.bias", prefix) : "bias";
  int64_t M = L->M;
  IrOpKind kind = layernorm(L) ? IR_OP_NORM_LAYER : IR_OP_NORM_RMS;
  IrValue *n = fe_emit(L, kind, ir_strfmt(L->m, "%s.n", name), 1, (IrOperand[]){FE_V(x)}, 1,
                       (IrAttr[]){FE_F("eps", L->p->model.norm_eps)});
  IrParam *w = dense_param(L, wname, ir_type1(IR_F32, M), "ones", 0);
  IrValue *y = fe_op2(L, IR_OP_SCALE, layernorm(L) ? ir_strfmt(L->m, "%s.w", name) : name, FE_V(n), FE_P(w));
  if (layernorm(L)) {
    IrParam *b = dense_param(L, bname, ir_type1(IR_F32, M), "zeros", 0);
    y = fe_op2(L, IR_OP_BIAS, name, FE_V(y), FE_P(b));
  }
  return y;
}

// How MP splits a projection (Megatron): by output columns (its bias too), so each rank computes
// its heads or hidden units from the whole input, or by input rows, each rank's product a partial
// sum that passes/parallelize.c reduces before the (unsplit) bias. The attr `mp_split` names the
// parameter's split dimension.
enum { MP_WHOLE, MP_COLUMNS, MP_ROWS };

// x·W (+ b) with W [in, out] named PREFIX.wSUFFIX and b PREFIX.bSUFFIX.
static IrValue *linear(FeLower *L, IrValue *x, const char *w, const char *b, int64_t in, int64_t out, double std,
                       int split, const char *name) {
  IrParam *pw = dense_param(L, w, ir_type2(IR_F32, in, out), "normal", std);
  if (split != MP_WHOLE && L->p->parallel.mp > 1) ir_attrs_set_int(pw->attrs, &pw->nattrs, "mp_split", split == MP_COLUMNS ? 1 : 0);
  IrValue *y = fe_op2(L, IR_OP_MATMUL, name, FE_V(x), FE_P(pw));
  if (b) {
    IrParam *pb = dense_param(L, b, ir_type1(IR_F32, out), "zeros", 0);
    if (split == MP_COLUMNS && L->p->parallel.mp > 1) ir_attrs_set_int(pb->attrs, &pb->nattrs, "mp_split", 0);
    y = fe_op2(L, IR_OP_BIAS, ir_strfmt(L->m, "%s.b", name), FE_V(y), FE_P(pb));
  }
  if (fe_lora_target(L, w)) {   // under MP: A split as W's rows, B as W's columns (passes/parallelize.c)
    bool mp = L->p->parallel.mp > 1;
    y = fe_lora(L, x, y, pw, name, mp && split == MP_ROWS ? 0 : -1, mp && split == MP_COLUMNS ? 1 : -1);
  }
  return y;
}

// YaRN's mscale of a factor (transformers' get_mscale): 1 up to a factor of 1.
static double yarn_mscale(double factor, double m) { return factor <= 1 ? 1.0 : 0.1 * m * log(factor) + 1.0; }

// With `partial F` the first int(d * F) columns of each head turn (transformers' rounding); with
// `interleave true` the adjacent pairs; with `yarn` YaRN's frequencies, cos and sin times its
// attention factor (mscale over mscale_all_dim when both are given, else the factor's own).
static IrValue *rope(FeLower *L, IrValue *x, int64_t heads, const char *name) {
  const FeModel *md = &L->p->model;
  int64_t d = x->type.dim[1] / heads, turned = (int64_t)((double)d * md->rope_partial);
  IrAttr a[12] = {FE_I("heads", heads), FE_I("seq", md->seqlen), FE_F("theta", md->rope_theta)};
  int n = 3;
  if (turned < d) a[n++] = FE_I("rotary", turned);
  if (md->rope_interleave) a[n++] = FE_I("interleave", 1);
  if (md->has_yarn) {
    double f = md->yarn_factor, m = md->yarn_mscale, all = md->yarn_mscale_all_dim;
    a[n++] = FE_F("yarn_factor", f);
    a[n++] = FE_I("yarn_original", md->yarn_original);
    if (!md->yarn_truncate) a[n++] = FE_I("yarn_truncate", 0);
    a[n++] = FE_F("beta_fast", md->yarn_beta_fast);
    a[n++] = FE_F("beta_slow", md->yarn_beta_slow);
    a[n++] = FE_F("rope_scale", m > 0 && all > 0 ? yarn_mscale(f, m) / yarn_mscale(f, all) : yarn_mscale(f, 1));
  }
  return fe_emit(L, IR_OP_ROPE, name, 1, (IrOperand[]){FE_V(x)}, n, a);
}

// The scores' factor of heads d wide: 1/sqrt(d), times YaRN's mscale(factor, mscale_all_dim)^2 when
// the model has `yarn { mscale_all_dim M; }` (DeepSeek's attention); 0 (the op's default) otherwise.
static double scores_scale(FeLower *L, int64_t d) {
  const FeModel *md = &L->p->model;
  if (!md->has_yarn || !(md->yarn_mscale_all_dim > 0)) return 0;
  double m = yarn_mscale(md->yarn_factor, md->yarn_mscale_all_dim);
  return m * m / sqrt((double)d);
}

// Columns [offset, offset + width) of each of the heads of x [S, heads·d] (MLA's parts of a head).
static IrValue *heads_slice(FeLower *L, IrValue *x, int64_t heads, int64_t offset, int64_t width, const char *name) {
  return fe_emit(L, IR_OP_HEADS_SLICE, name, 1, (IrOperand[]){FE_V(x)}, 3,
                 (IrAttr[]){FE_I("heads", heads), FE_I("offset", offset), FE_I("width", width)});
}

// RMSNorm of x's rows with the learned scale PREFIX.weight [width] (ones; eps: the model's).
static IrValue *rms(FeLower *L, IrValue *x, const char *prefix, const char *name) {
  IrValue *y = fe_emit(L, IR_OP_NORM_RMS, ir_strfmt(L->m, "%s.n", name), 1, (IrOperand[]){FE_V(x)}, 1,
                       (IrAttr[]){FE_F("eps", L->p->model.norm_eps)});
  IrParam *w = dense_param(L, ir_strfmt(L->m, "%s.weight", prefix), ir_type1(IR_F32, x->type.dim[1]), "ones", 0);
  return fe_op2(L, IR_OP_SCALE, name, FE_V(y), FE_P(w));
}

// An op on MLA's latent, which every head shares: MP does not split its heads (mp_shared).
static IrValue *shared(IrValue *v) {
  ir_op_set_int(v->def, "mp_shared", 1);
  return v;
}

// Causal attention of heads d wide: the layer's window when shorter than the sequence (a longer
// one is the causal mask itself), the scores' factor when it is not 1/sqrt(d). `sinks true`: a
// learned logit per head, attn.sinks [H] (zeros; split over MP with the heads), in each row's
// softmax (attn.sink).
static IrValue *causal(FeLower *L, IrValue *q, IrValue *k, IrValue *v, int64_t H, int64_t KV, int64_t d, const char *name) {
  int64_t seq = L->p->model.seqlen, window = L->layer->window;
  IrAttr a[5] = {FE_I("heads", H), FE_I("kv_heads", KV), FE_I("seq", seq)};
  int n = 3;
  if (window > 0 && window < seq) a[n++] = FE_I("window", window);
  double scale = scores_scale(L, d);
  if (scale > 0) a[n++] = FE_F("scale", scale);
  if (L->layer->sinks) {
    IrParam *s = dense_param(L, "attn.sinks", ir_type1(IR_F32, H), "zeros", 0);
    if (L->p->parallel.mp > 1) ir_attrs_set_int(s->attrs, &s->nattrs, "mp_split", 0);
    return fe_emit(L, IR_OP_ATTN_SINK, name, 4, (IrOperand[]){FE_V(q), FE_V(k), FE_V(v), FE_P(s)}, n, a);
  }
  return fe_emit(L, IR_OP_ATTN_CAUSAL, name, 3, (IrOperand[]){FE_V(q), FE_V(k), FE_V(v)}, n, a);
}

// Multi-head latent attention (`mla`, DeepSeek-V2/V3; manual §7.2), H heads, dn = nope, dr = rope:
//   q = x·Wq [M, H·(dn+dr)], or with q_lora r: rms(x·Wq_a [M, r]) · Wq_b [r, H·(dn+dr)];
//   [c | kr] = x·Wkv_a [M, kv_lora + dr]; kv = rms(c) · Wkv_b [kv_lora, H·(dn+dv)];
//   each head's q is [q_nope | q_rope] and its k [k_nope | kr] (kr one for all heads), its v dv wide;
//   rope turns q_rope and kr; scores q·k / sqrt(dn + dr), so any order of a head's columns that q
//   and k share gives them: moec's heads are [rope | nope] (heads.cat), v zero-padded to dn + dr
//   (heads.place) and the output's first dv columns of each head taken (heads.slice).
// Biases (`bias true`: attention_bias) on the down projections and the output one. Under MP each
// rank computes its heads/mp heads: Wq (Wq_b), Wkv_b split by columns, Wo by rows; the down
// projections, their norms and the rope key replicated (passes/parallelize.c).
static IrValue *mla_attention(FeLower *L, IrValue *x, double out_std) {
  const FeLayer *l = L->layer;
  int64_t M = L->M, H = l->heads, dn = l->mla_nope, dr = l->mla_rope, dv = l->mla_v, dq = dn + dr;
  bool bias = l->attn_bias;
  IrValue *q;
  if (l->mla_q_lora > 0) {
    q = linear(L, x, "attn.wq_a", bias ? "attn.bq_a" : NULL, M, l->mla_q_lora, STD, MP_WHOLE, "q.a");
    q = rms(L, q, "attn.q_a_norm", "q.an");
    q = linear(L, q, "attn.wq_b", NULL, l->mla_q_lora, H * dq, STD, MP_COLUMNS, "q");
  } else {
    q = linear(L, x, "attn.wq", NULL, M, H * dq, STD, MP_COLUMNS, "q");
  }
  IrValue *ckv = linear(L, x, "attn.wkv_a", bias ? "attn.bkv_a" : NULL, M, l->mla_kv_lora + dr, STD, MP_WHOLE, "ckv");
  IrValue *c = rms(L, shared(heads_slice(L, ckv, 1, 0, l->mla_kv_lora, "c")), "attn.kv_a_norm", "c.n");
  IrValue *kr = shared(rope(L, shared(heads_slice(L, ckv, 1, l->mla_kv_lora, dr, "kr")), 1, "kr.rope"));
  IrValue *kv = linear(L, c, "attn.wkv_b", NULL, l->mla_kv_lora, H * (dn + dv), STD, MP_COLUMNS, "kv");
  IrValue *qr = rope(L, heads_slice(L, q, H, dn, dr, "q.r"), H, "q.rope");
  IrValue *qh = fe_emit(L, IR_OP_HEADS_CAT, "q.heads", 2, (IrOperand[]){FE_V(qr), FE_V(heads_slice(L, q, H, 0, dn, "q.nope"))},
                        2, (IrAttr[]){FE_I("heads", H), FE_I("a_heads", H)});
  IrValue *kh = fe_emit(L, IR_OP_HEADS_CAT, "k.heads", 2, (IrOperand[]){FE_V(kr), FE_V(heads_slice(L, kv, H, 0, dn, "k.nope"))},
                        2, (IrAttr[]){FE_I("heads", H), FE_I("a_heads", 1)});
  IrValue *v = heads_slice(L, kv, H, dn, dv, "v");
  if (dv < dq)
    v = fe_emit(L, IR_OP_HEADS_PLACE, "v.pad", 1, (IrOperand[]){FE_V(v)}, 4,
                (IrAttr[]){FE_I("heads", H), FE_I("offset", 0), FE_I("width", dv), FE_I("d", dq)});
  IrValue *o = causal(L, qh, kh, v, H, H, dq, "o.heads");
  if (dv < dq) o = heads_slice(L, o, H, 0, dv, "o");
  return linear(L, o, "attn.wo", bias ? "attn.bo" : NULL, H * dv, M, out_std, MP_ROWS, "attn");
}

// x [S, heads·d] seen as [S·heads, d] (one row per head) and back: under MP each rank holds whole
// heads, so passes/parallelize.c divides dimension `mp_split` (attr) of the reshape by mp.
static IrValue *heads_reshape(FeLower *L, IrValue *x, int64_t rows, int64_t cols, int split, const char *name) {
  int n = L->p->parallel.mp > 1 ? 4 : 3;
  IrAttr a[4] = {FE_I("rank", 2), FE_I("d0", rows), FE_I("d1", cols), FE_I("mp_split", split)};
  return fe_emit(L, IR_OP_RESHAPE, name, 1, (IrOperand[]){FE_V(x)}, n, a);
}

// `qk_norm`: RMSNorm of q (or k), heads·d columns, with the learned scale PREFIX.weight, ones
// (eps: the model's). `head` (Qwen3-MoE) normalises each head's d columns by themselves, one
// weight [d] for all heads: rows [S·heads, d] through norm.rms and scale. The weight's gradient
// on an MP rank sums that rank's heads only (attr mp_partial: parallelize reduces it over the
// world). `whole` (OLMoE) normalises all heads·d columns together, weight [heads·d].
static IrValue *qk_norm(FeLower *L, IrValue *x, int64_t heads, const char *prefix, const char *name) {
  int64_t d = L->layer->head_dim, S = L->S;
  bool per_head = strcmp(L->layer->qk_norm, "head") == 0;
  IrValue *y = per_head ? heads_reshape(L, x, S * heads, d, 0, ir_strfmt(L->m, "%s.h", name)) : x;
  y = fe_emit(L, IR_OP_NORM_RMS, ir_strfmt(L->m, "%s.n", name), 1, (IrOperand[]){FE_V(y)}, 1,
              (IrAttr[]){FE_F("eps", L->p->model.norm_eps)});
  IrParam *w = dense_param(L, ir_strfmt(L->m, "%s.weight", prefix), ir_type1(IR_F32, per_head ? d : heads * d), "ones", 0);
  if (per_head && L->p->parallel.mp > 1) ir_attrs_set_int(w->attrs, &w->nattrs, "mp_partial", 1);
  y = fe_op2(L, IR_OP_SCALE, per_head ? ir_strfmt(L->m, "%s.w", name) : name, FE_V(y), FE_P(w));
  return per_head ? heads_reshape(L, y, S, heads * d, 1, name) : y;
}

// Attn(x) of lang/manual.md §7.2: projections, rope, causal grouped-query attention, output projection.
// Heads are d = head_dim wide (embed/heads unless written): Wq [M, H·d], Wk and Wv [M, KV·d],
// Wo [H·d, M]; the attention and rope ops take d from their operands' widths over heads. The q,
// k and v biases come with `bias true` or `bias qkv`, the output projection's with `bias true`.
// `qk_norm` normalises q and k after their biases, before rope; `window W` (W < seqlen: a longer
// one is the causal mask itself, and the IR is the causal one) limits query i to keys
// i − W < j ≤ i.
static IrValue *attention(FeLower *L, IrValue *x, double out_std) {
  const FeLayer *l = L->layer;
  if (l->has_mla) return mla_attention(L, x, out_std);
  int64_t M = L->M, H = l->heads, KV = l->kv_heads, d = l->head_dim;   // d: embed/heads or head_dim
  bool bias = l->attn_bias, rotary = strcmp(L->p->model.position, "rope") == 0;
  IrValue *q = linear(L, x, "attn.wq", bias ? "attn.bq" : NULL, M, H * d, STD, MP_COLUMNS, "q");
  IrValue *k = linear(L, x, "attn.wk", bias ? "attn.bk" : NULL, M, KV * d, STD, MP_COLUMNS, "k");
  IrValue *v = linear(L, x, "attn.wv", bias ? "attn.bv" : NULL, M, KV * d, STD, MP_COLUMNS, "v");
  if (l->qk_norm) {
    q = qk_norm(L, q, H, "attn.q_norm", "q.norm");
    k = qk_norm(L, k, KV, "attn.k_norm", "k.norm");
  }
  if (rotary) {
    q = rope(L, q, H, "q.rope");
    k = rope(L, k, KV, "k.rope");
  }
  IrValue *o = causal(L, q, k, v, H, KV, d, "o");
  return linear(L, o, "attn.wo", l->attn_bias_out ? "attn.bo" : NULL, H * d, M, out_std, MP_ROWS, "attn");
}

// The dense FFN of an `mlp` layer: the `ffn` kinds' formulas with one expert and no gate.
static IrValue *mlp(FeLower *L, IrValue *x, double out_std) {
  const FeExperts *e = &L->layer->mlp;
  int64_t M = L->M, H = e->hidden;
  if (strcmp(e->kind, "mixtral") == 0) {
    IrValue *a = linear(L, x, "mlp.w1", NULL, M, H, STD, MP_COLUMNS, "h1");
    IrValue *b = linear(L, x, "mlp.w3", NULL, M, H, STD, MP_COLUMNS, "h3");
    IrValue *h = fe_op2(L, IR_OP_MUL, "h", FE_V(fe_op1(L, IR_OP_ACT_SILU, "act", FE_V(a))), FE_V(b));
    return linear(L, h, "mlp.w2", NULL, H, M, out_std, MP_ROWS, "mlp");
  }
  IrValue *h = linear(L, x, "mlp.w1", e->bias ? "mlp.b1" : NULL, M, H, STD, MP_COLUMNS, "h");
  h = fe_act(L, e->act, "act", h);
  return linear(L, h, "mlp.w2", e->bias ? "mlp.b2" : NULL, H, M, out_std, MP_ROWS, "mlp");
}

static void lower_block(FeLower *L, double out_std) {
  fe_layer_func(L);
  IrValue *x = ir_add_arg(L->f, L->m, "x", ir_type2(IR_F32, L->S, L->M));
  IrValue *a = fe_op2(L, IR_OP_ADD, "a", FE_V(x), FE_V(attention(L, norm(L, x, "attn.norm", "xn"), out_std)));
  IrValue *an = norm(L, a, "ffn.norm", "an");
  IrValue *aux = NULL, *z = NULL, *f;
  if (L->layer->has_moe) {
    // parallelize splits the MoE's tokens over MP from here (passes/parallelize.c)
    ir_op_set_int(an->def, "moe_input", 1);
    f = fe_lower_moe(L, an, &aux, &z);
  } else {
    f = mlp(L, an, out_std);
  }
  ir_add_ret(L->f, L->m, fe_op2(L, IR_OP_ADD, "out", FE_V(a), FE_V(f)));
  if (aux) ir_add_ret(L->f, L->m, aux);
  if (z) ir_add_ret(L->f, L->m, z);
}

void fe_lower_lm(FeLower *L) {
  const FeProgram *p = L->p;
  const FeModel *md = &p->model;
  IrModule *m = L->m;
  int64_t V = md->vocab;
  ir_attrs_set_int(m->attrs, &m->nattrs, "vocab", V);

  L->inst = "embed";
  L->layer = NULL;
  IrParam *wte = NULL;
  if (fe_first_stage(L)) {   // a later pipeline stage starts from the previous stage's activations
    L->f = ir_add_func(m, "embed.fwd", IR_ROLE_LAYER_FWD);
    IrValue *tokens = ir_add_arg(L->f, m, "tokens", ir_type1(IR_I32, L->S));
    wte = dense_param(L, "wte", ir_type2(IR_F32, V, L->M), "normal", STD);
    if (md->tie_embeddings && L->p->parallel.pp > 1)   // the last stage holds it too
      ir_attrs_set_int(wte->attrs, &wte->nattrs, "pp_tied", 1);
    IrValue *h = fe_op2(L, IR_OP_EMBED, "h", FE_V(tokens), FE_P(wte));
    if (strcmp(md->position, "learned") == 0) {
      IrParam *wpe = dense_param(L, "wpe", ir_type2(IR_F32, md->seqlen, L->M), "normal", STD);
      h = fe_emit(L, IR_OP_POS_ADD, "hp", 2, (IrOperand[]){FE_V(h), FE_P(wpe)}, 1, (IrAttr[]){FE_I("seq", md->seqlen)});
    }
    ir_add_ret(L->f, m, h);
  }

  int64_t layers = 0;
  for (int i = 0; i < p->nlayers; i++) layers += p->layers[i].repeat;
  double out_std = STD / sqrt(2.0 * (double)layers);
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *l = &p->layers[i];
    L->layer = l;
    if (l->has_moe) {
      L->E = l->moe.experts.count;
      L->H = l->moe.experts.hidden;
      L->G = l->moe.gate.groups * p->parallel.mp;  // routing groups of one DP rank's tokens
    }
    for (int64_t r = 0; r < l->repeat; r++, L->layer_index++) {
      if (L->layer_index < L->stage_first || L->layer_index >= L->stage_end) continue;
      L->inst = ir_strfmt(m, "%s%lld", l->name, (long long)r);
      L->repeat = r;
      lower_block(L, out_std);
    }
  }

  if (!fe_last_stage(L)) {
    fe_lower_link(L);
    return;
  }
  L->layer = NULL;
  L->f = ir_add_func(m, "loss.fwd", IR_ROLE_LOSS_FWD);
  IrValue *out = ir_add_arg(L->f, m, "out", ir_type2(IR_F32, L->S, L->M));
  IrValue *target = ir_add_arg(L->f, m, "target", ir_type1(IR_I32, L->S));
  L->inst = "final_norm";
  IrValue *hn = norm(L, out, NULL, "hn");
  IrValue *logits;
  if (md->tie_embeddings) {
    if (!wte) {   // the last of several pipeline stages holds the tied table too
      L->inst = "embed";
      wte = dense_param(L, "wte", ir_type2(IR_F32, V, L->M), "normal", STD);
      ir_attrs_set_int(wte->attrs, &wte->nattrs, "pp_tied", 1);
    }
    logits = fe_emit(L, IR_OP_MATMUL, "logits", 2, (IrOperand[]){FE_V(hn), FE_P(wte)}, 1, (IrAttr[]){FE_I("tb", 1)});
  } else {
    L->inst = "head";
    IrParam *w = dense_param(L, "w", ir_type2(IR_F32, L->M, V), "normal", STD);
    logits = fe_op2(L, IR_OP_MATMUL, "logits", FE_V(hn), FE_P(w));
  }
  ir_add_ret(L->f, m, fe_op2(L, IR_OP_LOSS_XENT, "loss", FE_V(logits), FE_V(target)));
  ir_add_ret(L->f, m, logits);
}
