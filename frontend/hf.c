// Which Hugging Face family a checked program is (lang/manual.md §19), for a binary's --export-hf: the
// config.json the family's loader reads, or the sentence saying why the program is none.
//
// Every family is a language model with RMSNorm, rotary positions and, in every MoE layer, the
// same attention and the same MoE of SwiGLU experts (`ffn mixtral`) behind a softmax top-k gate
// (`gshard`). Then:
//   - Mixtral: no projection biases, no dense layers, no shared expert, the k chosen scores
//     renormalised (the default for k >= 2; `renormalize true` for k = 1);
//   - Qwen2-MoE: q/k/v biases and no o bias (`bias qkv`) or none, a shared SwiGLU expert gated by
//     a sigmoid in every MoE layer, dense SwiGLU layers (`mlp { ffn mixtral }`) anywhere
//     (mlp_only_layers), renormalised or not (norm_topk_prob);
//   - Qwen3-MoE: RMSNorm of q and k per head (`qk_norm head`), any head_dim, biases on all four
//     projections or none (attention_bias), dense layers allowed, renormalised or not;
//   - OLMoE: RMSNorm of q and k over the whole width (`qk_norm whole`), biases on all four or
//     none, no dense layers, renormalised or not.
//   - GLM-4.5 (glm4_moe): DeepSeek-V3's router instead (`gate sigmoid` with `balance bias`, the
//     group limit by the two best, `scale`, renormalised or not), an ungated shared expert of
//     n_shared_experts times the experts' hidden, the first layers dense (first_k_dense_replace),
//     q/k/v biases or none, RMSNorm of q and k per head or none, any head_dim, and rope turning a
//     part of each head (`position rope { partial F; }`, partial_rotary_factor).
//   - DeepSeek-V3 (deepseek_v3; also Kimi K2, Moonlight): multi-head latent attention (`mla`, the
//     same in every layer) with its rope on adjacent pairs (`interleave true`: rope_interleave) or
//     halves, YaRN's scaling (`yarn`) or none, GLM-4.5's router, shared expert and dense layers;
//   - DeepSeek-V2 (deepseek_v2): the same attention (interleaved), `gate gshard` not renormalised,
//     greedy or the group limit by the best (`group_score max`: group_limited_greedy), `scale`.
//   - gpt-oss (gpt_oss): attention sinks in every layer (`sinks true`), biases on all four
//     projections or none, any head_dim, layers with one sliding window W and layers over the
//     whole sequence in any order (layer_types), YaRN (truncated or not) or none; experts of the
//     clamped SwiGLU with biases (`ffn oss`), a router with a bias whose k chosen logits are
//     softmaxed (`gate gshard { bias true; renormalize true; }`), every layer MoE.
// Mixtral alone has one sliding window in every layer, gpt-oss a window in some layers, GLM-4.5
// alone a partial rotary factor, the DeepSeek families alone `mla` and `interleave`, they and
// gpt-oss `yarn`.
// Training-only settings (capacity, noise, aux and z losses, hooks, the layout, the schedule) do
// not change the weights' meaning and do not stop an export; the exported model computes
// dropless, as transformers does. `aux pooled` in every MoE layer is transformers' own
// load-balancing loss: output_router_logits true with its coefficient.
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fe_internal.h"

static bool refuse(char *why, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool refuse(char *why, size_t n, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, n, fmt, ap);
  va_end(ap);
  return false;
}

typedef enum Family { MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE, GLM4_MOE, DEEPSEEK_V2, DEEPSEEK_V3, GPT_OSS } Family;
static const char *const family_names[] = {"Mixtral", "Qwen2-MoE", "Qwen3-MoE", "OLMoE", "GLM-4.5", "DeepSeek-V2",
                                           "DeepSeek-V3", "gpt-oss"};
static const char *const family_types[] = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v2",
                                           "deepseek_v3", "gpt_oss"};
static const char *const family_classes[] = {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                                             "OlmoeForCausalLM", "Glm4MoeForCausalLM", "DeepseekV2ForCausalLM",
                                             "DeepseekV3ForCausalLM", "GptOssForCausalLM"};

static bool deepseek(Family f) { return f == DEEPSEEK_V2 || f == DEEPSEEK_V3; }

// The router of an MoE layer: GLM-4.5's is DeepSeek-V3's (sigmoid scores, a correction bias, the
// group limit by the two best, a scale); the others' a plain softmax top-k.
static bool router_of(const FeLayer *l, Family f, char *why, size_t n) {
  const FeGate *g = &l->moe.gate;
  const char *fam = family_names[f];
  if (f == DEEPSEEK_V2) {
    if (strcmp(g->name, "gshard") != 0)
      return refuse(why, n, "layer '%s' has gate '%s'; %s's router is a softmax top-k ('gshard')", l->name, g->name, fam);
    if (g->bias || g->balance)
      return refuse(why, n, "layer '%s' has a router %s; %s's router has none", l->name, g->bias ? "bias" : "correction bias", fam);
    if (g->renormalize)
      return refuse(why, n, "layer '%s' renormalises its gates; %s's keeps the softmax scores (times its scale)", l->name, fam);
    if (g->expert_groups > 1 && strcmp(g->group_score, "max") != 0)
      return refuse(why, n, "layer '%s' ranks its expert groups by their two best; %s's group_limited_greedy by their "
                    "best ('group_score max')", l->name, fam);
    return true;
  }
  if (f == GLM4_MOE || f == DEEPSEEK_V3) {
    if (strcmp(g->name, "sigmoid") != 0)
      return refuse(why, n, "layer '%s' has gate '%s'; %s's router is 'gate sigmoid' with a correction bias", l->name,
                    g->name, fam);
    if (g->bias) return refuse(why, n, "layer '%s' has a router bias ('bias true'); %s's router has none", l->name, fam);
    if (!g->balance)
      return refuse(why, n, "layer '%s' has no correction bias; %s's router has one ('balance bias RATE')", l->name, fam);
    if (g->expert_groups > 1 && strcmp(g->group_score, "top2") != 0)
      return refuse(why, n, "layer '%s' ranks its expert groups by their best ('group_score max'); %s's by the sum of "
                    "their two best", l->name, fam);
    return true;
  }
  if (strcmp(g->name, "gshard") != 0)
    return refuse(why, n, "layer '%s' has gate '%s'; %s's router is a softmax top-k ('gshard')", l->name, g->name, fam);
  if (f == GPT_OSS && (!g->bias || !g->renormalize))
    return refuse(why, n, "layer '%s' has %s; %s's router has a bias and softmaxes the k chosen logits ('bias true; "
                  "renormalize true;')", l->name, !g->bias ? "no router bias" : "'renormalize false'", fam);
  if (g->bias && f != GPT_OSS)
    return refuse(why, n, "layer '%s' has a router bias ('bias true'); %s's router has none", l->name, fam);
  if (g->expert_groups > 1 || g->scale != 1 || g->balance)
    return refuse(why, n, "layer '%s' has DeepSeek's choice (%s); %s's router is a plain top-k", l->name,
                  g->balance ? "'balance bias'" : g->scale != 1 ? "'scale'" : "'expert_groups'", fam);
  return true;
}

// Two MoE layers' routers are the one of a config.
static bool same_router(const FeGate *a, const FeGate *b) {
  return a->k == b->k && a->renormalize == b->renormalize && a->expert_groups == b->expert_groups &&
         a->topk_groups == b->topk_groups && a->scale == b->scale && (!a->balance) == (!b->balance);
}

// What every family shares; first_moe is the first MoE layer (all MoE layers must equal it).
static bool common(const FeProgram *p, Family f, const FeLayer **first_moe, char *why, size_t n) {
  const FeModel *md = &p->model;
  const char *fam = family_names[f];
  if (!md->has_vocab) return refuse(why, n, "it is an MoE stack, not a language model (no 'vocab')");
  if (strcmp(md->position, "rope") != 0)
    return refuse(why, n, "it has 'position %s'; %s has rotary positions ('position rope')", md->position, fam);
  if (strcmp(md->norm, "rmsnorm") != 0) return refuse(why, n, "it has 'norm %s'; %s has 'norm rmsnorm'", md->norm, fam);
  if (f != GLM4_MOE && md->rope_partial != 1)
    return refuse(why, n, "its rope turns a part of each head ('partial %g'); %s's turns whole heads", md->rope_partial, fam);
  if (!deepseek(f) && (md->rope_interleave || (md->has_yarn && f != GPT_OSS)))
    return refuse(why, n, "its rope has '%s'; %s's is the plain rotate-half one", md->has_yarn ? "yarn" : "interleave", fam);
  if (f == DEEPSEEK_V2 && !md->rope_interleave)
    return refuse(why, n, "its rope turns halves of the heads; %s's turns adjacent pairs ('interleave true')", fam);
  const FeLayer *m0 = NULL, *a0 = &p->layers[0];
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *l = &p->layers[i];
    bool same_norm = (!l->qk_norm && !a0->qk_norm) || (l->qk_norm && a0->qk_norm && strcmp(l->qk_norm, a0->qk_norm) == 0);
    if (l->has_mla != deepseek(f))
      return refuse(why, n, "layer '%s' %s; %s", l->name, l->has_mla ? "has latent attention ('mla')" : "has no 'mla'",
                    deepseek(f) ? "DeepSeek's attention is latent in every layer" : "only DeepSeek's attention is latent");
    if (l->has_mla && (l->mla_q_lora != a0->mla_q_lora || l->mla_kv_lora != a0->mla_kv_lora || l->mla_nope != a0->mla_nope ||
                       l->mla_rope != a0->mla_rope || l->mla_v != a0->mla_v))
      return refuse(why, n, "layers '%s' and '%s' have different attention; a %s config has one", a0->name, l->name, fam);
    if (l->sinks != (f == GPT_OSS))
      return refuse(why, n, "layer '%s' %s; %s", l->name, l->sinks ? "has attention sinks" : "has no attention sinks",
                    f == GPT_OSS ? "gpt-oss's attention has them in every layer ('sinks true')" : "only gpt-oss's has them");
    // gpt-oss: one window W for the sliding layers, the others over the whole sequence
    int64_t w = l->window > 0 && l->window < md->seqlen ? l->window : 0, w0 = a0->window > 0 && a0->window < md->seqlen ? a0->window : 0;
    bool same_window = f == GPT_OSS ? w == 0 || w0 == 0 || w == w0 : l->window == a0->window;
    if (l->heads != a0->heads || l->kv_heads != a0->kv_heads || l->head_dim != a0->head_dim ||
        l->attn_bias != a0->attn_bias || l->attn_bias_out != a0->attn_bias_out || !same_norm || !same_window)
      return refuse(why, n, "layers '%s' and '%s' have different attention; a %s config has one", a0->name, l->name, fam);
    if (f != QWEN3_MOE && f != GLM4_MOE && f != GPT_OSS && !deepseek(f) && l->head_dim > 0 && l->head_dim * l->heads != md->embed)
      return refuse(why, n, "layer '%s' has head_dim %lld, not embed/heads; %s's heads are hidden_size/heads wide",
                    l->name, (long long)l->head_dim, fam);
    if (f != MIXTRAL && f != GPT_OSS && l->window > 0 && l->window < md->seqlen)
      return refuse(why, n, "layer '%s' has 'window %lld'; %s's attention sees the whole sequence", l->name,
                    (long long)l->window, fam);
    const char *want_norm = f == QWEN3_MOE ? "head" : f == OLMOE ? "whole" : NULL;
    if (f == GLM4_MOE && l->qk_norm && strcmp(l->qk_norm, "head") != 0)
      return refuse(why, n, "layer '%s' has qk_norm %s; %s normalises q and k per head ('qk_norm head') or not at all",
                    l->name, l->qk_norm, fam);
    if (f != GLM4_MOE && ((want_norm == NULL) != (l->qk_norm == NULL) || (want_norm && strcmp(want_norm, l->qk_norm) != 0)))
      return refuse(why, n, "layer '%s' has %s%s; %s has %s", l->name, l->qk_norm ? "qk_norm " : "no qk_norm",
                    l->qk_norm ? l->qk_norm : "", fam, want_norm ? (f == QWEN3_MOE ? "'qk_norm head'" : "'qk_norm whole'") : "none");
    if (!l->has_moe) continue;
    const FeMoe *e = &l->moe;
    const char *kind = f == GPT_OSS ? "oss" : "mixtral";
    if (strcmp(e->experts.kind, kind) != 0)
      return refuse(why, n, "layer '%s' has 'ffn %s' experts; %s's are %s ('ffn %s')", l->name, e->experts.kind, fam,
                    f == GPT_OSS ? "the clamped SwiGLU with biases" : "SwiGLU", kind);
    if (!router_of(l, f, why, n)) return false;
    if (!m0) {
      m0 = l;
      continue;
    }
    const FeMoe *e0 = &m0->moe;
    if (e->experts.count != e0->experts.count || e->experts.hidden != e0->experts.hidden ||
        !same_router(&e->gate, &e0->gate) || e->has_shared != e0->has_shared ||
        (e->has_shared && (e->shared.hidden != e0->shared.hidden || e->shared_gated != e0->shared_gated)))
      return refuse(why, n, "MoE layers '%s' and '%s' differ; a %s config has one MoE", m0->name, l->name, fam);
  }
  if (!m0) return refuse(why, n, "it has no MoE layer");
  *first_moe = m0;
  return true;
}

// Qwen3-MoE and OLMoE: biases on all four projections or none; no shared expert; OLMoE no dense
// layers either.
static bool is_qwen3_or_olmoe(const FeProgram *p, Family f, const FeLayer **m0, char *why, size_t n) {
  if (!common(p, f, m0, why, n)) return false;
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *l = &p->layers[i];
    if (l->attn_bias != l->attn_bias_out)
      return refuse(why, n, "layer '%s' has 'bias qkv'; %s has biases on all four projections or none", l->name,
                    family_names[f]);
    if (l->has_mlp && (f == OLMOE || strcmp(l->mlp.kind, "mixtral") != 0))
      return refuse(why, n, "layer '%s' is a dense '%s' layer; %s", l->name, l->mlp.kind,
                    f == OLMOE ? "OLMoE's layers are all MoE" : "Qwen3-MoE's dense layers are SwiGLU ('ffn mixtral')");
  }
  if ((*m0)->moe.has_shared) return refuse(why, n, "it has a shared expert; %s has none", family_names[f]);
  return true;
}

// gpt-oss: every layer MoE, biases on all four projections or none, no shared expert.
static bool is_gpt_oss(const FeProgram *p, const FeLayer **m0, char *why, size_t n) {
  if (!common(p, GPT_OSS, m0, why, n)) return false;
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *l = &p->layers[i];
    if (!l->has_moe) return refuse(why, n, "layer '%s' is dense ('mlp'); gpt-oss's layers are all MoE", l->name);
    if (l->attn_bias != l->attn_bias_out)
      return refuse(why, n, "layer '%s' has 'bias qkv'; gpt-oss has biases on all four projections or none", l->name);
  }
  if ((*m0)->moe.has_shared) return refuse(why, n, "it has a shared expert; gpt-oss has none");
  return true;
}

static bool is_mixtral(const FeProgram *p, const FeLayer **m0, char *why, size_t n) {
  if (!common(p, MIXTRAL, m0, why, n)) return false;
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *l = &p->layers[i];
    if (!l->has_moe) return refuse(why, n, "layer '%s' is dense ('mlp'); Mixtral's layers are all MoE", l->name);
    if (l->attn_bias || l->attn_bias_out)
      return refuse(why, n, "layer '%s' has attention biases; Mixtral has none ('bias false')", l->name);
  }
  const FeMoe *e = &(*m0)->moe;
  if (e->has_shared) return refuse(why, n, "it has a shared expert; Mixtral has none");
  if (!e->gate.renormalize)
    return refuse(why, n, "its gate keeps the softmax scores ('renormalize false' or k 1); Mixtral renormalises the k "
                  "chosen ones ('renormalize true')");
  return true;
}

// GLM-4.5 and DeepSeek: the first_k_dense_replace first layers dense SwiGLU ones (of one hidden),
// the others MoE; an ungated shared expert n_shared_experts experts wide. GLM-4.5 has no output
// projection bias.
static bool is_glm4_moe(const FeProgram *p, Family f, const FeLayer **m0, char *why, size_t n) {
  if (!common(p, f, m0, why, n)) return false;
  const char *fam = family_names[f];
  bool moe_seen = false;
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *l = &p->layers[i];
    if (f == GLM4_MOE && l->attn_bias_out)
      return refuse(why, n, "layer '%s' has an output projection bias ('bias true'); GLM-4.5 has q, k and v biases "
                    "only ('bias qkv') or none", l->name);
    if (deepseek(f) && l->window > 0 && l->window < p->model.seqlen)
      return refuse(why, n, "layer '%s' has 'window %lld'; %s's attention sees the whole sequence", l->name,
                    (long long)l->window, fam);
    if (l->has_mlp && (moe_seen || strcmp(l->mlp.kind, "mixtral") != 0))
      return refuse(why, n, "layer '%s' is dense %s; %s's dense layers are SwiGLU ('ffn mixtral') and come first "
                    "(first_k_dense_replace)", l->name, moe_seen ? "after an MoE layer" : "but not SwiGLU", fam);
    moe_seen |= l->has_moe;
    for (int j = 0; j < i; j++)
      if (l->has_mlp && p->layers[j].has_mlp && l->mlp.hidden != p->layers[j].mlp.hidden)
        return refuse(why, n, "dense layers '%s' and '%s' differ in hidden; a %s config has one", p->layers[j].name,
                      l->name, fam);
  }
  const FeMoe *e = &(*m0)->moe;
  if (!e->has_shared || e->shared_gated || e->shared.hidden % e->experts.hidden != 0)
    return refuse(why, n, "%s; %s's MoE layers have an ungated shared expert of n_shared_experts times the "
                  "experts' hidden (%lld)", !e->has_shared ? "it has no shared expert" : e->shared_gated
                  ? "its shared expert is gated" : "its shared expert's hidden is not a multiple of the experts'",
                  fam, (long long)e->experts.hidden);
  return true;
}

static bool is_qwen2_moe(const FeProgram *p, const FeLayer **m0, char *why, size_t n) {
  if (!common(p, QWEN2_MOE, m0, why, n)) return false;
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *l = &p->layers[i];
    if (l->attn_bias_out)
      return refuse(why, n, "layer '%s' has an output projection bias ('bias true'); Qwen2-MoE has q, k and v biases "
                    "only ('bias qkv')", l->name);
    if (l->has_mlp && strcmp(l->mlp.kind, "mixtral") != 0)
      return refuse(why, n, "dense layer '%s' has 'ffn %s'; Qwen2-MoE's dense layers are SwiGLU ('ffn mixtral')", l->name,
                    l->mlp.kind);
    for (int j = 0; j < i; j++)
      if (l->has_mlp && p->layers[j].has_mlp && l->mlp.hidden != p->layers[j].mlp.hidden)
        return refuse(why, n, "dense layers '%s' and '%s' differ in hidden; a Qwen2-MoE config has one", p->layers[j].name,
                      l->name);
  }
  const FeMoe *e = &(*m0)->moe;
  if (!e->has_shared || !e->shared_gated)
    return refuse(why, n, "%s; Qwen2-MoE's MoE layers have a shared expert gated by a sigmoid",
                  e->has_shared ? "its shared expert is not gated" : "it has no shared expert");
  return true;
}

static void add_int(cJSON *o, const char *key, int64_t v) { cJSON_AddNumberToObject(o, key, (double)v); }

const char *fe_float_text(double v, char *buf, size_t n) {
  for (int digits = 6; digits <= 17; digits++) {
    snprintf(buf, n, "%.*g", digits, v);
    if (strtod(buf, NULL) == v) break;
  }
  return buf;
}

// A float field as a JSON number that reads back as a float (transformers' configs check types:
// 0 is an int there, 0.0 a float), in the shortest text that reads back as v.
static void add_float(cJSON *o, const char *key, double v) {
  char buf[48];
  fe_float_text(v, buf, sizeof buf);
  if (!strpbrk(buf, ".en")) strcat(buf, ".0");
  cJSON_AddRawToObject(o, key, buf);
}

// The Qwen families' mlp_only_layers: the decoder layers (instances, in order) that are dense.
static void add_dense_layers(cJSON *c, const FeProgram *p) {
  cJSON *only = cJSON_AddArrayToObject(c, "mlp_only_layers");
  int64_t l = 0;
  for (int i = 0; i < p->nlayers; i++)
    for (int64_t r = 0; r < p->layers[i].repeat; r++, l++)
      if (p->layers[i].has_mlp) cJSON_AddItemToArray(only, cJSON_CreateNumber((double)l));
}

// GLM-4.5's and the DeepSeek families' keys: their MoE (routed, shared, dense first), router and,
// for DeepSeek, the latent attention (transformers' head_dim is its rotary heads' width).
static void glm_like_keys(cJSON *c, cJSON *soft, const FeProgram *p, Family f, const FeMoe *e, const FeLayer *a0,
                          int64_t dense_hidden) {
  const FeModel *md = &p->model;
  int64_t first_dense = 0;
  for (int i = 0; i < p->nlayers && p->layers[i].has_mlp; i++) first_dense += p->layers[i].repeat;
  add_int(c, "n_routed_experts", e->experts.count);
  add_int(c, "moe_intermediate_size", e->experts.hidden);
  add_int(c, "n_shared_experts", e->shared.hidden / e->experts.hidden);
  add_int(dense_hidden > 0 ? c : soft, "intermediate_size", dense_hidden > 0 ? dense_hidden : e->experts.hidden);
  add_int(c, "first_k_dense_replace", first_dense);
  bool groups = e->gate.expert_groups > 1;
  if (f == DEEPSEEK_V2) {   // greedy, or group_limited_greedy with its groups
    cJSON_AddStringToObject(c, "topk_method", groups ? "group_limited_greedy" : "greedy");
    add_int(groups ? c : soft, "n_group", e->gate.expert_groups);   // greedy: the config's own, if any
    add_int(groups ? c : soft, "topk_group", e->gate.topk_groups);
    cJSON_AddBoolToObject(soft, "norm_topk_prob", false);
    cJSON_AddBoolToObject(soft, "mlp_bias", false);
  } else {
    add_int(c, "n_group", e->gate.expert_groups);
    add_int(c, "topk_group", e->gate.topk_groups);
    cJSON_AddBoolToObject(c, "norm_topk_prob", e->gate.renormalize);
  }
  add_float(c, "routed_scaling_factor", e->gate.scale);
  if (f == GLM4_MOE) {
    add_int(c, "head_dim", a0->head_dim);
    cJSON_AddBoolToObject(c, "use_qk_norm", a0->qk_norm != NULL);
  } else {   // the latent attention; transformers' head_dim is the rotary heads' width
    if (a0->mla_q_lora > 0) add_int(c, "q_lora_rank", a0->mla_q_lora);
    else cJSON_AddNullToObject(c, "q_lora_rank");
    add_int(c, "kv_lora_rank", a0->mla_kv_lora);
    add_int(c, "qk_nope_head_dim", a0->mla_nope);
    add_int(c, "qk_rope_head_dim", a0->mla_rope);
    add_int(c, "v_head_dim", a0->mla_v);
    add_int(c, "qk_head_dim", a0->mla_nope + a0->mla_rope);
    add_int(c, "head_dim", a0->mla_rope);
    if (f == DEEPSEEK_V3) cJSON_AddBoolToObject(c, "rope_interleave", md->rope_interleave);
    add_int(soft, "pretraining_tp", 1);
  }
  cJSON_AddBoolToObject(c, "attention_bias", a0->attn_bias);
  if (f != DEEPSEEK_V2) add_int(soft, "num_nextn_predict_layers", 0);
}

// gpt-oss's keys: its experts, heads, the SwiGLU's constants, the layers' types and the sliding
// layers' window (a layer with none, or one at least the sequence, sees the whole sequence).
static void oss_keys(cJSON *c, cJSON *soft, const FeProgram *p, const FeMoe *e, const FeLayer *a0) {
  add_int(c, "num_local_experts", e->experts.count);
  add_int(c, "intermediate_size", e->experts.hidden);
  add_int(c, "head_dim", a0->head_dim);
  cJSON_AddBoolToObject(c, "attention_bias", a0->attn_bias);
  add_float(c, "swiglu_alpha", 1.702);
  add_float(c, "swiglu_limit", 7.0);
  int64_t window = 0, seq = p->model.seqlen;
  cJSON *types = cJSON_AddArrayToObject(c, "layer_types");
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *l = &p->layers[i];
    bool sliding = l->window > 0 && l->window < seq;
    if (sliding) window = l->window;
    for (int64_t r = 0; r < l->repeat; r++)
      cJSON_AddItemToArray(types, cJSON_CreateString(sliding ? "sliding_attention" : "full_attention"));
  }
  add_int(window > 0 ? c : soft, "sliding_window", window > 0 ? window : seq);
}

// The keys the model determines (*soft: those whose value is the model's only where the imported
// config has none: a size of layers the model does not have, a training-only setting).
static cJSON *model_config(const FeProgram *p, cJSON **soft, char *why, size_t n) {
  const FeLayer *m0 = NULL;
  // What only one family has decides which family's reason to give.
  const char *qk = p->nlayers > 0 ? p->layers[0].qk_norm : NULL;
  bool looks_qwen2 = false;
  for (int i = 0; i < p->nlayers; i++)
    looks_qwen2 |= (p->layers[i].has_moe && p->layers[i].moe.has_shared) ||
                   (p->layers[i].attn_bias && !p->layers[i].attn_bias_out) || (!qk && p->layers[i].has_mlp);
  bool sigmoid = false, mla = false, oss = false;
  for (int i = 0; i < p->nlayers; i++) {
    sigmoid |= p->layers[i].has_moe && strcmp(p->layers[i].moe.gate.name, "sigmoid") == 0;
    mla |= p->layers[i].has_mla;
    oss |= p->layers[i].sinks || (p->layers[i].has_moe && strcmp(p->layers[i].moe.experts.kind, "oss") == 0);
  }
  Family f = oss ? GPT_OSS : mla ? (sigmoid ? DEEPSEEK_V3 : DEEPSEEK_V2) : sigmoid ? GLM4_MOE
           : qk && strcmp(qk, "head") == 0 ? QWEN3_MOE : qk ? OLMOE : looks_qwen2 ? QWEN2_MOE : MIXTRAL;
  bool ok = f == GPT_OSS                       ? is_gpt_oss(p, &m0, why, n)
            : f == MIXTRAL                     ? is_mixtral(p, &m0, why, n)
            : f == QWEN2_MOE                   ? is_qwen2_moe(p, &m0, why, n)
            : f == GLM4_MOE || deepseek(f)     ? is_glm4_moe(p, f, &m0, why, n)
                                               : is_qwen3_or_olmoe(p, f, &m0, why, n);
  if (!ok) return NULL;
  *soft = cJSON_CreateObject();
  bool qwen = f == QWEN2_MOE;
  const FeModel *md = &p->model;
  const FeLayer *a0 = &p->layers[0];
  const FeMoe *e = &m0->moe;
  int64_t layers = 0, dense_hidden = 0;
  for (int i = 0; i < p->nlayers; i++) {
    layers += p->layers[i].repeat;
    if (p->layers[i].has_mlp) dense_hidden = p->layers[i].mlp.hidden;
  }
  cJSON *c = cJSON_CreateObject();
  if (!c || !*soft) {
    cJSON_Delete(c);
    cJSON_Delete(*soft);
    *soft = NULL;
    return NULL;
  }
  cJSON *arch = cJSON_AddArrayToObject(c, "architectures");
  cJSON_AddItemToArray(arch, cJSON_CreateString(family_classes[f]));
  cJSON_AddStringToObject(c, "model_type", family_types[f]);
  add_int(c, "vocab_size", md->vocab);
  add_int(c, "hidden_size", md->embed);
  add_int(c, "num_hidden_layers", layers);
  add_int(c, "num_attention_heads", a0->heads);
  add_int(c, "num_key_value_heads", a0->kv_heads > 0 ? a0->kv_heads : a0->heads);
  add_int(c, "num_experts_per_tok", e->gate.k);
  add_int(c, "max_position_embeddings", md->seqlen);
  if (f == QWEN3_MOE || f == OLMOE) {
    add_int(c, "num_experts", e->experts.count);
    add_int(c, f == OLMOE ? "intermediate_size" : "moe_intermediate_size", e->experts.hidden);
    if (f == QWEN3_MOE) {
      add_int(dense_hidden > 0 ? c : *soft, "intermediate_size", dense_hidden > 0 ? dense_hidden : e->experts.hidden);
      add_int(c, "head_dim", a0->head_dim);
      add_int(c, "decoder_sparse_step", 1);
      add_dense_layers(c, p);
      cJSON_AddBoolToObject(c, "use_sliding_window", false);
    } else {
      cJSON_AddNullToObject(c, "clip_qkv");
    }
    cJSON_AddBoolToObject(c, "norm_topk_prob", e->gate.renormalize);
    cJSON_AddBoolToObject(c, "attention_bias", a0->attn_bias);
  } else if (f == GLM4_MOE || deepseek(f)) {
    glm_like_keys(c, *soft, p, f, e, a0, dense_hidden);
  } else if (qwen) {
    add_int(c, "num_experts", e->experts.count);
    add_int(c, "moe_intermediate_size", e->experts.hidden);
    add_int(c, "shared_expert_intermediate_size", e->shared.hidden);
    add_int(dense_hidden > 0 ? c : *soft, "intermediate_size", dense_hidden > 0 ? dense_hidden : e->shared.hidden);
    cJSON_AddBoolToObject(c, "norm_topk_prob", e->gate.renormalize);
    cJSON_AddBoolToObject(c, "qkv_bias", a0->attn_bias);
    add_int(c, "decoder_sparse_step", 1);
    add_dense_layers(c, p);
    cJSON_AddBoolToObject(c, "use_sliding_window", false);
  } else if (f == GPT_OSS) {
    oss_keys(c, *soft, p, e, a0);
  } else {
    add_int(c, "num_local_experts", e->experts.count);
    add_int(c, "intermediate_size", e->experts.hidden);
    add_int(*soft, "head_dim", md->embed / a0->heads);   // null in a config means this
    // No window shorter than the sequence: any longer one (or none) trains the same.
    if (a0->window > 0 && a0->window < md->seqlen) add_int(c, "sliding_window", a0->window);
    else cJSON_AddNullToObject(*soft, "sliding_window");
    add_float(*soft, "router_jitter_noise", 0);
  }
  add_float(c, "rms_norm_eps", md->norm_eps);
  cJSON *rope = cJSON_AddObjectToObject(c, "rope_parameters");   // transformers 5
  add_float(rope, "rope_theta", md->rope_theta);
  cJSON_AddStringToObject(rope, "rope_type", md->has_yarn ? "yarn" : "default");
  if (f == GLM4_MOE) add_float(rope, "partial_rotary_factor", md->rope_partial);
  if (md->has_yarn) {
    add_float(rope, "factor", md->yarn_factor);
    add_int(rope, "original_max_position_embeddings", md->yarn_original);
    add_float(rope, "beta_fast", md->yarn_beta_fast);
    add_float(rope, "beta_slow", md->yarn_beta_slow);
    if (md->yarn_mscale > 0) add_float(rope, "mscale", md->yarn_mscale);
    if (md->yarn_mscale_all_dim > 0) add_float(rope, "mscale_all_dim", md->yarn_mscale_all_dim);
    if (!md->yarn_truncate) cJSON_AddBoolToObject(rope, "truncate", false);
  }
  cJSON_AddStringToObject(c, "hidden_act", "silu");
  cJSON_AddBoolToObject(c, "tie_word_embeddings", md->tie_embeddings);
  // transformers' objective has its load-balancing loss when every MoE layer has `aux pooled`
  // (the checker gave them one coefficient); any other aux form stays moec's.
  bool pooled = true;
  for (int i = 0; i < p->nlayers; i++)
    pooled &= !p->layers[i].has_moe || fe_aux_pooled(&p->layers[i].moe.gate);
  if (f == GLM4_MOE || deepseek(f)) {   // their objective has no load-balancing loss; output_router_logits only returns them
    cJSON_AddBoolToObject(*soft, "output_router_logits", false);
  } else {
    add_float(pooled ? c : *soft, "router_aux_loss_coef", e->gate.aux_loss);
    cJSON_AddBoolToObject(c, "output_router_logits", pooled);
  }
  add_float(*soft, "attention_dropout", 0);
  cJSON_AddStringToObject(c, "dtype", "float32");   // the tensors --export-hf writes
  return c;
}

static bool keep_number_text(cJSON *node, const char **at);

// A JSON file of the hf_config folder: its tree, NULL when it does not exist and may not
// (*failed stays false), or NULL with an error reported (*failed).
static cJSON *read_json(IrDiag *d, const FeProgram *p, const char *dir, const char *file, bool required, bool *failed) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, file);
  size_t len = 0;
  errno = 0;
  char *text = fe_read_file(path, &len);
  if (!text) {
    if (!required && errno == ENOENT) return NULL;
    *failed = true;
    ir_error_at(d, p->hf_config_loc, "cannot read '%s': %s (hf_config names a folder holding the config.json of "
                "a Hugging Face checkpoint; moec import-hf writes one beside the .moe)", path, strerror(errno ? errno : EIO));
    return NULL;
  }
  const char *end = NULL, *at = text;
  cJSON *j = cJSON_ParseWithLengthOpts(text, len, &end, false);
  if (j && !keep_number_text(j->child, &at)) {
    cJSON_Delete(j);
    j = NULL;
  }
  if (!j) {   // where the parser stopped, as line and column of the file
    int line = 1, col = 1;
    for (const char *c = text; end && c < end && *c; c++) {
      line += *c == '\n';
      col = *c == '\n' ? 1 : col + 1;
    }
    *failed = true;
    ir_error_at(d, p->hf_config_loc, "'%s' is not JSON: it stops at line %d, column %d", path, line, col);
  } else if (!cJSON_IsObject(j)) {
    *failed = true;
    ir_error_at(d, p->hf_config_loc, "'%s' is not a JSON object", path);
  }
  free(text);
  if (*failed) {
    cJSON_Delete(j);
    return NULL;
  }
  return j;
}

// Numbers as their text in the file: cJSON prints 0.0 as 0, and transformers' configs check types.
// text's number tokens (outside strings) come in the order a depth-first walk of the tree meets
// its numbers; each such node becomes raw text. False when they do not pair up.
static bool keep_number_text(cJSON *node, const char **at) {
  for (; node; node = node->next) {
    if (cJSON_IsNumber(node)) {
      const char *p = *at;
      for (bool in_string = false; *p; p++) {   // the next number token
        if (in_string) {
          if (*p == '\\' && p[1]) p++;
          else if (*p == '"') in_string = false;
        } else if (*p == '"') {
          in_string = true;
        } else if (*p == '-' || (*p >= '0' && *p <= '9')) {
          break;
        }
      }
      size_t n = strspn(p, "+-0123456789.eE");
      char *raw = n ? strndup(p, n) : NULL;
      if (!raw) return false;
      node->type = cJSON_Raw;
      node->valuestring = raw;
      *at = p + n;
    }
    if (node->child && !keep_number_text(node->child, at)) return false;
  }
  return true;
}

// A copy of v with raw numbers read as numbers (for comparing values, not their texts).
static cJSON *cooked(const cJSON *v) {
  if (v->type == cJSON_Raw) return cJSON_Parse(v->valuestring);
  cJSON *copy = cJSON_Duplicate(v, false);
  for (const cJSON *k = v->child; copy && k; k = k->next) {
    cJSON *item = cooked(k);
    if (!item) continue;
    if (cJSON_IsObject(copy)) cJSON_AddItemToObject(copy, k->string, item);
    else cJSON_AddItemToArray(copy, item);
  }
  return copy;
}

// "key: old -> new" for a value of the folder's config.json the model replaces.
static void note_change(char **changes, const char *key, const cJSON *old, const cJSON *now) {
  char *a = cJSON_PrintUnformatted(old), *b = cJSON_PrintUnformatted(now);
  size_t have = *changes ? strlen(*changes) : 0, more = strlen(key) + (a ? strlen(a) : 1) + (b ? strlen(b) : 1) + 12;
  char *grown = realloc(*changes, have + more);
  if (grown) {
    snprintf(grown + have, more, "%s%s: %s -> %s", have ? "; " : "", key, a ? a : "?", b ? b : "?");
    *changes = grown;
  }
  free(a);
  free(b);
}

// generation_config.json from a config's token ids, as transformers derives it; NULL without any.
static char *generation_of(const cJSON *config) {
  static const char *const ids[] = {"bos_token_id", "eos_token_id", "pad_token_id"};
  cJSON *g = cJSON_CreateObject();
  bool any = false;
  cJSON_AddBoolToObject(g, "_from_model_config", true);
  for (int i = 0; i < 3; i++) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(config, ids[i]);
    if (v && !cJSON_IsNull(v)) {
      cJSON_AddItemToObject(g, ids[i], cJSON_Duplicate(v, true));
      any = true;
    }
  }
  const cJSON *version = cJSON_GetObjectItemCaseSensitive(config, "transformers_version");
  if (version) cJSON_AddItemToObject(g, "transformers_version", cJSON_Duplicate(version, true));
  char *text = any ? cJSON_Print(g) : NULL;
  cJSON_Delete(g);
  return text;
}

// ---- a LoRA model's adapter (PEFT's adapter_config.json) ----

// The keys of adapter_config.json the model determines (as PEFT's LoraConfig writes them):
// r, lora_alpha and the targets from the `lora` block; no dropout, no bias, plain scaling
// alpha/r. The attention's projections are target_modules (nn.Linear modules, matched by their
// names' ends; DeepSeek's: q_a_proj and q_b_proj, or q_proj, for q, kv_a_proj_with_mqa and
// kv_b_proj for k and v, which come together there); every other target is a target_parameters entry. The experts' stacked tensors
// can only be those (gate and up in one, gate_up_proj, whose one A moec's w1 and w3 share); the
// dense layers' and the shared expert's gate_proj, up_proj and down_proj could be modules, but
// PEFT (0.21, with transformers 5) reads those names in target_modules as transformers 4's names
// of the experts and turns them into the experts' tensors, so they are their weights
// ("mlp.gate_proj.weight": a dense layer's, not the shared expert's), which PEFT adapts alike
// (lora_A [r, in], lora_B [out, r], the same tensor names).
static cJSON *adapter_keys(const FeProgram *p, Family f) {
  const FeLora *lo = &p->model.lora;
  cJSON *a = cJSON_CreateObject();
  cJSON_AddItemToObject(a, "alpha_pattern", cJSON_CreateObject());
  cJSON_AddStringToObject(a, "bias", "none");
  cJSON_AddNullToObject(a, "exclude_modules");
  cJSON_AddBoolToObject(a, "fan_in_fan_out", false);
  cJSON_AddNullToObject(a, "layers_pattern");
  cJSON_AddNullToObject(a, "layers_to_transform");
  char buf[48];
  fe_float_text(lo->alpha, buf, sizeof buf);   // 8 stays 8, as PEFT writes an int alpha
  cJSON_AddRawToObject(a, "lora_alpha", buf);
  cJSON_AddBoolToObject(a, "lora_bias", false);
  add_float(a, "lora_dropout", 0);
  cJSON_AddNullToObject(a, "modules_to_save");
  cJSON_AddStringToObject(a, "peft_type", "LORA");
  add_int(a, "r", lo->r);
  cJSON_AddItemToObject(a, "rank_pattern", cJSON_CreateObject());
  cJSON *mods = cJSON_AddArrayToObject(a, "target_modules");
  static const char *const proj[4] = {"q_proj", "k_proj", "v_proj", "o_proj"};
  static const char *const latent[4] = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"};
  const bool attn[4] = {lo->q, lo->k, lo->v, lo->o};
  if (deepseek(f)) {   // every layer's attention is the same latent one (is_glm4_moe)
    bool q_lora = p->nlayers > 0 && p->layers[0].mla_q_lora > 0;
    const bool use[4] = {lo->q && q_lora, lo->q && q_lora, lo->k || lo->v, lo->k || lo->v};
    if (lo->q && !q_lora) cJSON_AddItemToArray(mods, cJSON_CreateString("q_proj"));
    for (int k = 0; k < 4; k++)
      if (use[k]) cJSON_AddItemToArray(mods, cJSON_CreateString(latent[k]));
    if (lo->o) cJSON_AddItemToArray(mods, cJSON_CreateString("o_proj"));
  } else {
    for (int k = 0; k < 4; k++)
      if (attn[k]) cJSON_AddItemToArray(mods, cJSON_CreateString(proj[k]));
  }
  cJSON *params = cJSON_CreateArray();
  if (lo->experts) {
    cJSON_AddItemToArray(params, cJSON_CreateString("experts.gate_up_proj"));
    cJSON_AddItemToArray(params, cJSON_CreateString("experts.down_proj"));
  }
  static const char *const mlp[3] = {"gate_proj", "up_proj", "down_proj"};
  char name[64];
  for (int k = 0; lo->mlp && k < 3; k++) {
    snprintf(name, sizeof name, "mlp.%s.weight", mlp[k]);
    cJSON_AddItemToArray(params, cJSON_CreateString(name));
  }
  for (int k = 0; lo->shared && k < 3; k++) {
    snprintf(name, sizeof name, "%s.%s.weight", f == QWEN2_MOE ? "shared_expert" : "shared_experts", mlp[k]);
    cJSON_AddItemToArray(params, cJSON_CreateString(name));
  }
  if (cJSON_GetArraySize(params) > 0) {
    cJSON_AddItemToObject(a, "target_parameters", params);
  } else {
    cJSON_Delete(params);
    cJSON_AddNullToObject(a, "target_parameters");
  }
  cJSON_AddStringToObject(a, "task_type", "CAUSAL_LM");
  cJSON_AddBoolToObject(a, "use_dora", false);
  cJSON_AddBoolToObject(a, "use_rslora", false);
  return a;
}

// adapter_config.json of a LoRA model: the hf_config folder's adapter_config.json (moec import-hf
// writes one naming the checkpoint: base_model_name_or_path), every key as it is, with the keys
// the model determines replaced (in the folder's order; new ones at the end); without a folder
// file base_model_name_or_path is null. NULL: not a LoRA model.
static char *adapter_of(const FeProgram *p, Family f, cJSON *kept) {
  if (!p->model.has_lora) return NULL;
  cJSON *a = adapter_keys(p, f), *out = cJSON_CreateObject();
  if (!cJSON_GetObjectItemCaseSensitive(kept, "base_model_name_or_path"))   // first, as in PEFT's sorted keys
    cJSON_AddNullToObject(out, "base_model_name_or_path");
  for (const cJSON *k = kept ? kept->child : NULL; k; k = k->next)
    cJSON_AddItemToObject(out, k->string, cJSON_Duplicate(k, true));
  for (const cJSON *k = a->child; k; k = k->next) {
    if (cJSON_GetObjectItemCaseSensitive(out, k->string))
      cJSON_ReplaceItemInObjectCaseSensitive(out, k->string, cJSON_Duplicate(k, true));
    else
      cJSON_AddItemToObject(out, k->string, cJSON_Duplicate(k, true));
  }
  char *text = cJSON_Print(out);
  cJSON_Delete(a);
  cJSON_Delete(out);
  return text;
}

static Family family_of_type(const cJSON *config) {
  const cJSON *t = cJSON_GetObjectItemCaseSensitive(config, "model_type");
  for (int i = 0; cJSON_IsString(t) && i < (int)(sizeof family_types / sizeof *family_types); i++)
    if (strcmp(t->valuestring, family_types[i]) == 0) return (Family)i;
  return MIXTRAL;
}

bool fe_hf_export(IrDiag *d, const FeProgram *p, FeHfExport *out, char *why, size_t n) {
  memset(out, 0, sizeof *out);
  cJSON *soft = NULL, *c = model_config(p, &soft, why, n);
  if (!c) {
    if (p->hf_config_path) {   // an export was asked for
      ir_error_at(d, p->hf_config_loc, "hf_config: model '%s' is no Hugging Face family to export: %s", p->model.name, why);
      why[0] = 0;
    }
    return false;
  }
  cJSON *config = NULL, *generation = NULL, *adapter = NULL;
  bool failed = false;
  if (p->hf_config_path) {
    char *beside = fe_path_beside(p->hf_config_path, p->hf_config_loc);
    const char *dir = beside ? beside : p->hf_config_path;
    config = read_json(d, p, dir, "config.json", true, &failed);
    if (!failed) generation = read_json(d, p, dir, "generation_config.json", false, &failed);
    if (!failed && p->model.has_lora) adapter = read_json(d, p, dir, "adapter_config.json", false, &failed);
    free(beside);
  }
  if (failed) {
    cJSON_Delete(c);
    cJSON_Delete(soft);
    cJSON_Delete(config);
    cJSON_Delete(generation);
    why[0] = 0;
    return false;
  }
  if (!config) config = cJSON_CreateObject();
  // The model's keys over the folder's, in the folder's order (new keys at the end); a soft key
  // only where the folder has none; max_position_embeddings at least the model's seqlen.
  for (const cJSON *k = c->child; k; k = k->next) {
    const cJSON *old = cJSON_GetObjectItemCaseSensitive(config, k->string);
    if (old && strcmp(k->string, "max_position_embeddings") == 0 && old->type == cJSON_Raw &&
        strtod(old->valuestring, NULL) >= k->valuedouble)
      continue;
    // Floats are raw text (add_float, keep_number_text): compared as the numbers they read as.
    cJSON *a = old ? cooked(old) : NULL, *b = old ? cooked(k) : NULL;
    bool same = a && b && cJSON_Compare(a, b, true);
    if (old && !same) note_change(&out->changes, k->string, old, k);
    cJSON_Delete(a);
    cJSON_Delete(b);
    if (same) continue;   // the folder's text of it stays
    if (old) cJSON_ReplaceItemInObjectCaseSensitive(config, k->string, cJSON_Duplicate(k, true));
    else cJSON_AddItemToObject(config, k->string, cJSON_Duplicate(k, true));
  }
  for (const cJSON *k = soft->child; k; k = k->next)
    if (!cJSON_GetObjectItemCaseSensitive(config, k->string))
      cJSON_AddItemToObject(config, k->string, cJSON_Duplicate(k, true));
  out->config = cJSON_Print(config);
  out->generation = generation ? cJSON_Print(generation) : generation_of(config);
  out->adapter = adapter_of(p, family_of_type(c), adapter);
  cJSON_Delete(adapter);
  cJSON_Delete(c);
  cJSON_Delete(soft);
  cJSON_Delete(config);
  cJSON_Delete(generation);
  return out->config != NULL;
}

void fe_hf_export_free(FeHfExport *e) {
  free(e->config);
  free(e->generation);
  free(e->changes);
  free(e->adapter);
  memset(e, 0, sizeof *e);
}
