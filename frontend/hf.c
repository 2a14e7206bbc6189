// Which Hugging Face family a checked program is (DESIGN §2.2), for a binary's --export-hf: the
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
// Mixtral alone has a sliding window (`window W`, the same in every layer).
// Training-only settings (capacity, noise, aux and z losses, hooks, the layout, the schedule) do
// not change the weights' meaning and do not stop an export; the exported model computes
// dropless, as transformers does. `aux pooled` in every MoE layer is transformers' own
// load-balancing loss: output_router_logits true with its coefficient.
#include <cjson/cJSON.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fe.h"

static bool refuse(char *why, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool refuse(char *why, size_t n, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, n, fmt, ap);
  va_end(ap);
  return false;
}

typedef enum Family { MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE } Family;
static const char *const family_names[] = {"Mixtral", "Qwen2-MoE", "Qwen3-MoE", "OLMoE"};
static const char *const family_types[] = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe"};
static const char *const family_classes[] = {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                                             "OlmoeForCausalLM"};

// What every family shares; first_moe is the first MoE layer (all MoE layers must equal it).
static bool common(const FeProgram *p, Family f, const FeLayer **first_moe, char *why, size_t n) {
  const FeModel *md = &p->model;
  const char *fam = family_names[f];
  if (!md->has_vocab) return refuse(why, n, "it is an MoE stack, not a language model (no 'vocab')");
  if (strcmp(md->position, "rope") != 0)
    return refuse(why, n, "it has 'position %s'; %s has rotary positions ('position rope')", md->position, fam);
  if (strcmp(md->norm, "rmsnorm") != 0) return refuse(why, n, "it has 'norm %s'; %s has 'norm rmsnorm'", md->norm, fam);
  const FeLayer *m0 = NULL, *a0 = &p->layers[0];
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *l = &p->layers[i];
    bool same_norm = (!l->qk_norm && !a0->qk_norm) || (l->qk_norm && a0->qk_norm && strcmp(l->qk_norm, a0->qk_norm) == 0);
    if (l->heads != a0->heads || l->kv_heads != a0->kv_heads || l->head_dim != a0->head_dim ||
        l->attn_bias != a0->attn_bias || l->attn_bias_out != a0->attn_bias_out || !same_norm || l->window != a0->window)
      return refuse(why, n, "layers '%s' and '%s' have different attention; a %s config has one", a0->name, l->name, fam);
    if (f != QWEN3_MOE && l->head_dim > 0 && l->head_dim * l->heads != md->embed)
      return refuse(why, n, "layer '%s' has head_dim %lld, not embed/heads; %s's heads are hidden_size/heads wide",
                    l->name, (long long)l->head_dim, fam);
    if (f != MIXTRAL && l->window > 0 && l->window < md->seqlen)
      return refuse(why, n, "layer '%s' has 'window %lld'; %s's attention sees the whole sequence", l->name,
                    (long long)l->window, fam);
    const char *want_norm = f == QWEN3_MOE ? "head" : f == OLMOE ? "whole" : NULL;
    if ((want_norm == NULL) != (l->qk_norm == NULL) || (want_norm && strcmp(want_norm, l->qk_norm) != 0))
      return refuse(why, n, "layer '%s' has %s%s; %s has %s", l->name, l->qk_norm ? "qk_norm " : "no qk_norm",
                    l->qk_norm ? l->qk_norm : "", fam, want_norm ? (f == QWEN3_MOE ? "'qk_norm head'" : "'qk_norm whole'") : "none");
    if (!l->has_moe) continue;
    const FeMoe *e = &l->moe;
    if (strcmp(e->experts.kind, "mixtral") != 0)
      return refuse(why, n, "layer '%s' has 'ffn %s' experts; %s's are SwiGLU ('ffn mixtral')", l->name, e->experts.kind, fam);
    if (strcmp(e->gate.name, "gshard") != 0)
      return refuse(why, n, "layer '%s' has gate '%s'; %s's router is a softmax top-k ('gshard')", l->name, e->gate.name, fam);
    if (!m0) {
      m0 = l;
      continue;
    }
    const FeMoe *e0 = &m0->moe;
    if (e->experts.count != e0->experts.count || e->experts.hidden != e0->experts.hidden || e->gate.k != e0->gate.k ||
        e->gate.renormalize != e0->gate.renormalize || e->has_shared != e0->has_shared ||
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

char *fe_hf_config(const FeProgram *p, char *why, size_t n) {
  const FeLayer *m0 = NULL;
  // What only one family has decides which family's reason to give.
  const char *qk = p->nlayers > 0 ? p->layers[0].qk_norm : NULL;
  bool looks_qwen2 = false;
  for (int i = 0; i < p->nlayers; i++)
    looks_qwen2 |= (p->layers[i].has_moe && p->layers[i].moe.has_shared) ||
                   (p->layers[i].attn_bias && !p->layers[i].attn_bias_out) || (!qk && p->layers[i].has_mlp);
  Family f = qk && strcmp(qk, "head") == 0 ? QWEN3_MOE : qk ? OLMOE : looks_qwen2 ? QWEN2_MOE : MIXTRAL;
  bool ok = f == MIXTRAL     ? is_mixtral(p, &m0, why, n)
            : f == QWEN2_MOE ? is_qwen2_moe(p, &m0, why, n)
                             : is_qwen3_or_olmoe(p, f, &m0, why, n);
  if (!ok) return NULL;
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
  if (!c) return NULL;
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
      add_int(c, "intermediate_size", dense_hidden > 0 ? dense_hidden : e->experts.hidden);
      add_int(c, "head_dim", a0->head_dim);
      add_int(c, "decoder_sparse_step", 1);
      add_dense_layers(c, p);
      cJSON_AddBoolToObject(c, "use_sliding_window", false);
    } else {
      cJSON_AddNullToObject(c, "clip_qkv");
    }
    cJSON_AddBoolToObject(c, "norm_topk_prob", e->gate.renormalize);
    cJSON_AddBoolToObject(c, "attention_bias", a0->attn_bias);
  } else if (qwen) {
    add_int(c, "num_experts", e->experts.count);
    add_int(c, "moe_intermediate_size", e->experts.hidden);
    add_int(c, "shared_expert_intermediate_size", e->shared.hidden);
    add_int(c, "intermediate_size", dense_hidden > 0 ? dense_hidden : e->shared.hidden);
    cJSON_AddBoolToObject(c, "norm_topk_prob", e->gate.renormalize);
    cJSON_AddBoolToObject(c, "qkv_bias", a0->attn_bias);
    add_int(c, "decoder_sparse_step", 1);
    add_dense_layers(c, p);
    cJSON_AddBoolToObject(c, "use_sliding_window", false);
  } else {
    add_int(c, "num_local_experts", e->experts.count);
    add_int(c, "intermediate_size", e->experts.hidden);
    add_int(c, "head_dim", md->embed / a0->heads);
    if (a0->window > 0 && a0->window < md->seqlen) add_int(c, "sliding_window", a0->window);
    else cJSON_AddNullToObject(c, "sliding_window");
    add_float(c, "router_jitter_noise", 0);
  }
  add_float(c, "rms_norm_eps", md->norm_eps);
  cJSON *rope = cJSON_AddObjectToObject(c, "rope_parameters");   // transformers 5
  add_float(rope, "rope_theta", md->rope_theta);
  cJSON_AddStringToObject(rope, "rope_type", "default");
  cJSON_AddStringToObject(c, "hidden_act", "silu");
  cJSON_AddBoolToObject(c, "tie_word_embeddings", md->tie_embeddings);
  // transformers' objective has its load-balancing loss when every MoE layer has `aux pooled`
  // (the checker gave them one coefficient); any other aux form stays moec's.
  bool pooled = true;
  for (int i = 0; i < p->nlayers; i++)
    pooled &= !p->layers[i].has_moe || fe_aux_pooled(&p->layers[i].moe.gate);
  add_float(c, "router_aux_loss_coef", e->gate.aux_loss);
  cJSON_AddBoolToObject(c, "output_router_logits", pooled);
  add_float(c, "attention_dropout", 0);
  cJSON_AddStringToObject(c, "dtype", "float32");
  char *text = cJSON_Print(c);
  cJSON_Delete(c);
  return text;
}
