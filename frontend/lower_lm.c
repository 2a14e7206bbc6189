// Lowering of a language model (DESIGN §2.1): a model with `vocab V`.
//
// The step's input is the tokens of this DP rank's windows, i32 [S] (S = batch*seqlen, row
// s = b*seqlen + i), and its target the next tokens, i32 [S]. The functions, in order:
//   @embed.fwd(%tokens) -> %h          h = wte[t] (+ wpe[i] with learned positions)
//   @INST.fwd(%x) -> %out (, aux, z)   a = x + Attn(Norm_attn(x)); out = a + F(Norm_ffn(a)),
//                                      F the layer's moe (frontend/lower.c, without its
//                                      residual) or its mlp (one dense FFN)
//   @loss.fwd(%out, %target) -> %loss, %logits
//                                      logits = Norm_final(out)·wteᵀ (tied) or ·head.w;
//                                      loss = mean cross-entropy (its share over DP ranks)
// Parameters use the names of DESIGN §2.1 and GPT-2's initialisation: weights normal(0.02), the
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
  return y;
}

static IrValue *rope(FeLower *L, IrValue *x, int64_t heads, const char *name) {
  return fe_emit(L, IR_OP_ROPE, name, 1, (IrOperand[]){FE_V(x)}, 3,
                 (IrAttr[]){FE_I("heads", heads), FE_I("seq", L->p->model.seqlen), FE_F("theta", L->p->model.rope_theta)});
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

// Attn(x) of DESIGN §2.1: projections, rope, causal grouped-query attention, output projection.
// Heads are d = head_dim wide (embed/heads unless written): Wq [M, H·d], Wk and Wv [M, KV·d],
// Wo [H·d, M]; the attention and rope ops take d from their operands' widths over heads. The q,
// k and v biases come with `bias true` or `bias qkv`, the output projection's with `bias true`.
// `qk_norm` normalises q and k after their biases, before rope; `window W` (W < seqlen: a longer
// one is the causal mask itself, and the IR is the causal one) limits query i to keys
// i − W < j ≤ i.
static IrValue *attention(FeLower *L, IrValue *x, double out_std) {
  const FeLayer *l = L->layer;
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
  int64_t seq = L->p->model.seqlen;
  bool window = l->window > 0 && l->window < seq;
  IrValue *o = fe_emit(L, IR_OP_ATTN_CAUSAL, "o", 3, (IrOperand[]){FE_V(q), FE_V(k), FE_V(v)}, window ? 4 : 3,
                       (IrAttr[]){FE_I("heads", H), FE_I("kv_heads", KV), FE_I("seq", seq), FE_I("window", l->window)});
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
  h = fe_op1(L, strcmp(e->act, "relu") == 0 ? IR_OP_ACT_RELU : IR_OP_ACT_GELU, "act", FE_V(h));
  return linear(L, h, "mlp.w2", e->bias ? "mlp.b2" : NULL, H, M, out_std, MP_ROWS, "mlp");
}

static void lower_block(FeLower *L, double out_std) {
  L->f = ir_add_func(L->m, ir_strfmt(L->m, "%s.fwd", L->inst), IR_ROLE_LAYER_FWD);
  L->f->loc = L->layer->loc;
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
  L->f = ir_add_func(m, "embed.fwd", IR_ROLE_LAYER_FWD);
  IrValue *tokens = ir_add_arg(L->f, m, "tokens", ir_type1(IR_I32, L->S));
  IrParam *wte = dense_param(L, "wte", ir_type2(IR_F32, V, L->M), "normal", STD);
  IrValue *h = fe_op2(L, IR_OP_EMBED, "h", FE_V(tokens), FE_P(wte));
  if (strcmp(md->position, "learned") == 0) {
    IrParam *wpe = dense_param(L, "wpe", ir_type2(IR_F32, md->seqlen, L->M), "normal", STD);
    h = fe_emit(L, IR_OP_POS_ADD, "hp", 2, (IrOperand[]){FE_V(h), FE_P(wpe)}, 1, (IrAttr[]){FE_I("seq", md->seqlen)});
  }
  ir_add_ret(L->f, m, h);

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
      L->inst = ir_strfmt(m, "%s%lld", l->name, (long long)r);
      lower_block(L, out_std);
    }
  }

  L->layer = NULL;
  L->f = ir_add_func(m, "loss.fwd", IR_ROLE_LOSS_FWD);
  IrValue *out = ir_add_arg(L->f, m, "out", ir_type2(IR_F32, L->S, L->M));
  IrValue *target = ir_add_arg(L->f, m, "target", ir_type1(IR_I32, L->S));
  L->inst = "final_norm";
  IrValue *hn = norm(L, out, NULL, "hn");
  IrValue *logits;
  if (md->tie_embeddings) {
    logits = fe_emit(L, IR_OP_MATMUL, "logits", 2, (IrOperand[]){FE_V(hn), FE_P(wte)}, 1, (IrAttr[]){FE_I("tb", 1)});
  } else {
    L->inst = "head";
    IrParam *w = dense_param(L, "w", ir_type2(IR_F32, L->M, V), "normal", STD);
    logits = fe_op2(L, IR_OP_MATMUL, "logits", FE_V(hn), FE_P(w));
  }
  ir_add_ret(L->f, m, fe_op2(L, IR_OP_LOSS_XENT, "loss", FE_V(logits), FE_V(target)));
  ir_add_ret(L->f, m, logits);
}
