// Hugging Face checkpoints (lang/manual.md §19): which moec parameter each tensor of a family's
// checkpoint is, written once and used both ways: `moec import-hf` (cli/import_hf.c) fills
// moec's tensors from a checkpoint, a training binary's `--export-hf DIR` writes the family's
// tensors and config.json from moec's.
//
// A family tensor is a whole moec parameter or one expert's slice of it (moec stacks the experts
// of a layer in one [E, ...] tensor, the families keep one tensor per expert), either as it is
// or transposed (torch's Linear keeps [out, in], moec [in, out]).
#include "rt_hf.h"
#include "rt_internal.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>

// ---- the table ----

static void add(RtHfTensor *t, int *n, const char *moec, int64_t expert, bool transpose, int64_t rows,
                int64_t cols, const char *fmt, ...) __attribute__((format(printf, 8, 9)));
static void add(RtHfTensor *t, int *n, const char *moec, int64_t expert, bool transpose, int64_t rows,
                int64_t cols, const char *fmt, ...) {
  RtHfTensor *e = &t[(*n)++];
  memset(e, 0, sizeof *e);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->hf, sizeof e->hf, fmt, ap);
  va_end(ap);
  snprintf(e->moec, sizeof e->moec, "%s", moec);
  e->expert = expert;
  e->transpose = transpose;
  e->rank = cols > 0 ? 2 : 1;
  e->dims[0] = rows;
  e->dims[1] = cols > 0 ? cols : 0;
}

static const char *const family_names[] = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v2", "deepseek_v3",
                                           "gpt_oss"};

const char *rt_hf_family_name(RtHfFamily f) {
  return (unsigned)f < sizeof family_names / sizeof *family_names ? family_names[f] : "?";
}

bool rt_hf_family_of(const char *model_type, RtHfFamily *f) {
  for (unsigned i = 0; i < sizeof family_names / sizeof *family_names; i++)
    if (strcmp(model_type, family_names[i]) == 0) {
      *f = (RtHfFamily)i;
      return true;
    }
  return false;
}

// A layer's SwiGLU weights (gate, up, down: moec's w1, w3, w2) named HF_PREFIX.{gate,up,down}_proj
// (Mixtral's experts: w1, w3, w2), stacked per expert in moec when experts > 0.
static void swiglu(RtHfTensor *t, int *n, const RtHfArch *a, const char *moec_prefix, const char *hf_prefix,
                   int64_t experts, int64_t hidden) {
  static const char *const moec_w[3] = {"w1", "w3", "w2"};
  static const char *const hf_w[3] = {"gate_proj", "up_proj", "down_proj"}, *const mixtral_w[3] = {"w1", "w3", "w2"};
  bool mixtral = a->family == RT_HF_MIXTRAL && experts > 0;
  int64_t M = a->embed;
  char moec[RT_HF_NAME];
  for (int k = 0; k < 3; k++) {
    snprintf(moec, sizeof moec, "%s.%s", moec_prefix, moec_w[k]);
    int64_t rows = k == 2 ? M : hidden, cols = k == 2 ? hidden : M;   // torch's [out, in]
    const char *w = mixtral ? mixtral_w[k] : hf_w[k];
    if (experts == 0) add(t, n, moec, -1, true, rows, cols, "%s.%s.weight", hf_prefix, w);
    for (int64_t e = 0; e < experts; e++)   // the experts of one parameter are consecutive (import fills it slice by slice)
      add(t, n, moec, e, true, rows, cols, "%s.experts.%lld.%s.weight", hf_prefix, (long long)e, w);
  }
}

// DeepSeek's multi-head latent attention of decoder layer PRE (moec instance IN): q through q_a /
// q_a_layernorm / q_b (or one q_proj), kv_a_proj_with_mqa to the latent and the shared rope key,
// kv_a_layernorm, kv_b_proj to every head's k_nope and v; biases (attention_bias) on the down
// projections and o.
static void mla(RtHfTensor *t, int *n, const RtHfArch *a, const char *in, const char *pre) {
  int64_t M = a->embed, H = a->heads, dq = a->nope + a->rope;
  char name[RT_HF_NAME];
#define MOEC(suffix) (snprintf(name, sizeof name, "%s.%s", in, suffix), name)
  if (a->q_lora > 0) {
    add(t, n, MOEC("attn.wq_a"), -1, true, a->q_lora, M, "%s.self_attn.q_a_proj.weight", pre);
    if (a->o_bias) add(t, n, MOEC("attn.bq_a"), -1, false, a->q_lora, 0, "%s.self_attn.q_a_proj.bias", pre);
    add(t, n, MOEC("attn.q_a_norm.weight"), -1, false, a->q_lora, 0, "%s.self_attn.q_a_layernorm.weight", pre);
    add(t, n, MOEC("attn.wq_b"), -1, true, H * dq, a->q_lora, "%s.self_attn.q_b_proj.weight", pre);
  } else {
    add(t, n, MOEC("attn.wq"), -1, true, H * dq, M, "%s.self_attn.q_proj.weight", pre);
  }
  add(t, n, MOEC("attn.wkv_a"), -1, true, a->kv_lora + a->rope, M, "%s.self_attn.kv_a_proj_with_mqa.weight", pre);
  if (a->o_bias) add(t, n, MOEC("attn.bkv_a"), -1, false, a->kv_lora + a->rope, 0, "%s.self_attn.kv_a_proj_with_mqa.bias", pre);
  add(t, n, MOEC("attn.kv_a_norm.weight"), -1, false, a->kv_lora, 0, "%s.self_attn.kv_a_layernorm.weight", pre);
  add(t, n, MOEC("attn.wkv_b"), -1, true, H * (a->nope + a->v), a->kv_lora, "%s.self_attn.kv_b_proj.weight", pre);
  add(t, n, MOEC("attn.wo"), -1, true, M, H * a->v, "%s.self_attn.o_proj.weight", pre);
  if (a->o_bias) add(t, n, MOEC("attn.bo"), -1, false, M, 0, "%s.self_attn.o_proj.bias", pre);
#undef MOEC
}

// A 3-dimensional (or picked) entry: the whole tensor of all experts, not transposed.
static void add3(RtHfTensor *t, int *n, const char *moec, int pick, int64_t d0, int64_t d1, int64_t d2, const char *hf) {
  RtHfTensor *e = &t[(*n)++];
  memset(e, 0, sizeof *e);
  snprintf(e->hf, sizeof e->hf, "%s", hf);
  snprintf(e->moec, sizeof e->moec, "%s", moec);
  e->expert = -1;
  e->pick = pick;
  e->rank = d2 > 0 ? 3 : 2;
  e->dims[0] = d0, e->dims[1] = d1, e->dims[2] = d2 > 0 ? d2 : 0;
}

// gpt-oss's MoE of decoder layer PRE (moec instance IN): the router's weight and bias, the experts'
// gate_up_proj [E, M, 2I] (gate and up interleaved: moec's w1 the even columns, w3 the odd ones)
// and its bias [E, 2I] (b1, b3), down_proj [E, I, M] (w2) and its bias [E, M] (b2), as they are.
static void oss_moe(RtHfTensor *t, int *n, const RtHfArch *a, const char *in, const char *pre) {
  int64_t M = a->embed, E = a->experts, I = a->hidden;
  char name[RT_HF_NAME], hf[RT_HF_NAME];
#define MOEC(suffix) (snprintf(name, sizeof name, "%s.%s", in, suffix), name)
#define HF(suffix) (snprintf(hf, sizeof hf, "%s.mlp.%s", pre, suffix), hf)
  add(t, n, MOEC("moe.gate.wg"), -1, true, E, M, "%s", HF("router.weight"));
  add(t, n, MOEC("moe.gate.bg"), -1, false, E, 0, "%s", HF("router.bias"));
  add3(t, n, MOEC("moe.experts.w1"), 1, E, M, 2 * I, HF("experts.gate_up_proj"));
  add3(t, n, MOEC("moe.experts.w3"), 2, E, M, 2 * I, HF("experts.gate_up_proj"));
  add3(t, n, MOEC("moe.experts.b1"), 1, E, 2 * I, 0, HF("experts.gate_up_proj_bias"));
  add3(t, n, MOEC("moe.experts.b3"), 2, E, 2 * I, 0, HF("experts.gate_up_proj_bias"));
  add3(t, n, MOEC("moe.experts.w2"), 0, E, I, M, HF("experts.down_proj"));
  add3(t, n, MOEC("moe.experts.b2"), 0, E, M, 0, HF("experts.down_proj_bias"));
#undef MOEC
#undef HF
}

// The families' tensors (transformers' *ForCausalLM; lang/manual.md §19 has the names).
static int family_table(const RtHfArch *a, RtHfTensor *t) {
  int n = 0;
  int64_t M = a->embed, Q = a->heads * a->head_dim, KV = a->kv_heads * a->head_dim;
  char name[RT_HF_NAME], pre[48];
  add(t, &n, "embed.wte", -1, false, a->vocab, M, "model.embed_tokens.weight");
  for (int64_t l = 0; l < a->layers; l++) {
    const char *in = a->inst[l];
#define MOEC(suffix) (snprintf(name, sizeof name, "%s.%s", in, suffix), name)
    snprintf(pre, sizeof pre, "model.layers.%lld", (long long)l);
    add(t, &n, MOEC("attn.norm.weight"), -1, false, M, 0, "%s.input_layernorm.weight", pre);
    if (a->mla) {
      mla(t, &n, a, in, pre);
    } else {
    add(t, &n, MOEC("attn.wq"), -1, true, Q, M, "%s.self_attn.q_proj.weight", pre);
    add(t, &n, MOEC("attn.wk"), -1, true, KV, M, "%s.self_attn.k_proj.weight", pre);
    add(t, &n, MOEC("attn.wv"), -1, true, KV, M, "%s.self_attn.v_proj.weight", pre);
    add(t, &n, MOEC("attn.wo"), -1, true, M, Q, "%s.self_attn.o_proj.weight", pre);
    if (a->qkv_bias) {
      add(t, &n, MOEC("attn.bq"), -1, false, Q, 0, "%s.self_attn.q_proj.bias", pre);
      add(t, &n, MOEC("attn.bk"), -1, false, KV, 0, "%s.self_attn.k_proj.bias", pre);
      add(t, &n, MOEC("attn.bv"), -1, false, KV, 0, "%s.self_attn.v_proj.bias", pre);
    }
    if (a->o_bias) add(t, &n, MOEC("attn.bo"), -1, false, M, 0, "%s.self_attn.o_proj.bias", pre);
    if (a->sinks) add(t, &n, MOEC("attn.sinks"), -1, false, a->heads, 0, "%s.self_attn.sinks", pre);
    if (a->qk_norm) {
      add(t, &n, MOEC("attn.q_norm.weight"), -1, false, a->qk_norm == 1 ? a->head_dim : Q, 0, "%s.self_attn.q_norm.weight", pre);
      add(t, &n, MOEC("attn.k_norm.weight"), -1, false, a->qk_norm == 1 ? a->head_dim : KV, 0, "%s.self_attn.k_norm.weight", pre);
    }
    }
    add(t, &n, MOEC("ffn.norm.weight"), -1, false, M, 0, "%s.post_attention_layernorm.weight", pre);
    char hf[96], moec[RT_HF_NAME];
    snprintf(moec, sizeof moec, "%s", MOEC("mlp"));
    snprintf(hf, sizeof hf, "%s.mlp", pre);
    if (a->dense && a->dense[l]) {
      swiglu(t, &n, a, moec, hf, 0, a->dense_hidden);
      continue;
    }
    if (a->family == RT_HF_GPT_OSS) {
      oss_moe(t, &n, a, in, pre);
      continue;
    }
    if (a->family == RT_HF_MIXTRAL) snprintf(hf, sizeof hf, "%s.block_sparse_moe", pre);
    add(t, &n, MOEC("moe.gate.wg"), -1, true, a->experts, M, "%s.gate.weight", hf);
    if (a->correction_bias) add(t, &n, MOEC("moe.gate.eb"), -1, false, a->experts, 0, "%s.gate.e_score_correction_bias", hf);
    snprintf(moec, sizeof moec, "%s", MOEC("moe.experts"));
    swiglu(t, &n, a, moec, hf, a->experts, a->hidden);
    if (a->shared_hidden > 0) {
      char shf[128];
      snprintf(moec, sizeof moec, "%s", MOEC("moe.shared"));
      snprintf(shf, sizeof shf, "%s.%s", hf, a->family == RT_HF_QWEN2_MOE ? "shared_expert" : "shared_experts");
      swiglu(t, &n, a, moec, shf, 0, a->shared_hidden);
      if (a->shared_gate) add(t, &n, MOEC("moe.shared.gate"), -1, true, 1, M, "%s.shared_expert_gate.weight", hf);
    }
#undef MOEC
  }
  add(t, &n, "final_norm.weight", -1, false, M, 0, "model.norm.weight");
  if (!a->tie) add(t, &n, "head.w", -1, true, a->vocab, M, "lm_head.weight");
  return n;
}

static int64_t table_size(const RtHfArch *a) {
  return 3 + a->layers * (16 + 3 * a->experts + 4);
}

int rt_hf_tensors(const RtHfArch *a, RtHfTensor **out) {
  *out = NULL;
  if (a->layers <= 0 || a->experts <= 0 || a->layers > (1 << 16) || a->experts > (1 << 16))
    return rt_fail("internal error: a %s checkpoint of %lld layers and %lld experts", rt_hf_family_name(a->family),
                   (long long)a->layers, (long long)a->experts);
  RtHfTensor *t = rt_calloc((size_t)table_size(a), sizeof *t, "the table of a checkpoint's tensors");
  int n = family_table(a, t);
  *out = t;
  return n;
}

// The moec parameter's shape of a table entry: the family's [rows, cols] (transposed when the
// entry says so), with the experts' dimension first for an expert's slice.
int rt_hf_moec_dims(const RtHfArch *a, const RtHfTensor *t, int64_t *dims) {
  int rank = 0;
  if (t->rank == 3 || t->pick) {   // as it is, the last dimension halved when picked
    for (int d = 0; d < t->rank; d++) dims[d] = t->dims[d] / (t->pick && d == t->rank - 1 ? 2 : 1);
    return t->rank;
  }
  if (t->expert >= 0) dims[rank++] = a->experts;
  if (t->rank == 1) {
    dims[rank++] = t->dims[0];
  } else {
    dims[rank++] = t->transpose ? t->dims[1] : t->dims[0];
    dims[rank++] = t->transpose ? t->dims[0] : t->dims[1];
  }
  return rank;
}

// The elements of the entry's tensor, and moec[i] <-> hf at pick's columns: the last dimension's
// even (pick 1) or odd (pick 2) ones, moec holding half as many per row.
int64_t rt_hf_numel(const RtHfTensor *t) {
  int64_t n = 1;
  for (int d = 0; d < t->rank; d++) n *= t->dims[d];
  return n;
}

static void picked(const RtHfTensor *t, float *moec, float *hf, bool to_moec) {
  int64_t last = t->dims[t->rank - 1], half = last / 2, rows = rt_hf_numel(t) / last;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < half; j++) {
      float *m = moec + r * half + j, *h = hf + r * last + 2 * j + (t->pick - 1);
      if (to_moec) *m = *h;
      else *h = *m;
    }
}

// hf = the entry's part of moec (whole or slice, transposed or not); moec is the whole parameter.
// A picked entry writes its columns of hf only.
void rt_hf_from_moec(const RtHfTensor *t, const float *moec, float *hf) {
  if (t->pick) {
    picked(t, (float *)moec, hf, false);
    return;
  }
  if (t->rank == 3) {
    memcpy(hf, moec, (size_t)rt_hf_numel(t) * sizeof(float));
    return;
  }
  int64_t r = t->dims[0], c = t->rank == 2 ? t->dims[1] : 1, n = r * c;
  const float *src = moec + (t->expert >= 0 ? t->expert * n : 0);
  if (t->rank == 2 && t->transpose) {
    for (int64_t i = 0; i < r; i++)   // hf[i, j] = src[j, i], src [c, r]
      for (int64_t j = 0; j < c; j++) hf[i * c + j] = src[j * r + i];
  } else {
    memcpy(hf, src, (size_t)n * sizeof(float));
  }
}

// The inverse: the entry's part of moec from hf.
void rt_hf_to_moec(const RtHfTensor *t, const float *hf, float *moec) {
  if (t->pick) {
    picked(t, moec, (float *)hf, true);
    return;
  }
  if (t->rank == 3) {
    memcpy(moec, hf, (size_t)rt_hf_numel(t) * sizeof(float));
    return;
  }
  int64_t r = t->dims[0], c = t->rank == 2 ? t->dims[1] : 1, n = r * c;
  float *dst = moec + (t->expert >= 0 ? t->expert * n : 0);
  if (t->rank == 2 && t->transpose) {
    for (int64_t i = 0; i < r; i++)
      for (int64_t j = 0; j < c; j++) dst[j * r + i] = hf[i * c + j];
  } else {
    memcpy(dst, hf, (size_t)n * sizeof(float));
  }
}

// ---- the architecture of a config.json ----

static bool count(const cJSON *cfg, const char *key, int64_t *v) {
  const cJSON *j = cJSON_GetObjectItemCaseSensitive(cfg, key);
  if (!cJSON_IsNumber(j) || j->valuedouble < 0 || j->valuedouble > 1e15 || j->valuedouble != (double)(int64_t)j->valuedouble)
    return false;
  *v = (int64_t)j->valuedouble;
  return true;
}

// Which layers are dense: Qwen's mlp_only_layers, and with decoder_sparse_step S every layer l
// with (l + 1) % S != 0.
static void dense_layers(const cJSON *cfg, RtHfArch *a) {
  int64_t step = 1;
  count(cfg, "decoder_sparse_step", &step);
  const cJSON *only = cJSON_GetObjectItemCaseSensitive(cfg, "mlp_only_layers");
  for (int64_t l = 0; l < a->layers; l++) {
    bool dense = step > 1 ? (l + 1) % step != 0 : step == 0;
    for (const cJSON *e = cJSON_IsArray(only) ? only->child : NULL; e; e = e->next)
      dense |= cJSON_IsNumber(e) && e->valuedouble == (double)l;
    a->dense[l] = dense;
  }
}

int rt_hf_arch_of_config(const char *json, RtHfArch *a) {
  memset(a, 0, sizeof *a);
  cJSON *cfg = cJSON_Parse(json);
  if (!cfg) return rt_fail("a Hugging Face config that is not JSON");
  const cJSON *type = cJSON_GetObjectItemCaseSensitive(cfg, "model_type");
  bool ok = cJSON_IsString(type) && rt_hf_family_of(type->valuestring, &a->family);
  bool mixtral = a->family == RT_HF_MIXTRAL || a->family == RT_HF_GPT_OSS;   // num_local_experts, intermediate_size
  bool glm = a->family == RT_HF_GLM4_MOE || a->family == RT_HF_DEEPSEEK_V2 || a->family == RT_HF_DEEPSEEK_V3;   // alike
  bool qwen = a->family == RT_HF_QWEN2_MOE || a->family == RT_HF_QWEN3_MOE || glm;   // moe_intermediate_size
  ok = ok && count(cfg, "num_hidden_layers", &a->layers) && count(cfg, "vocab_size", &a->vocab) &&
       count(cfg, "hidden_size", &a->embed) && count(cfg, "num_attention_heads", &a->heads) && a->heads > 0 &&
       (count(cfg, mixtral ? "num_local_experts" : glm ? "n_routed_experts" : "num_experts", &a->experts) ||
        (a->family == RT_HF_QWEN3_MOE && count(cfg, "num_local_experts", &a->experts))) &&   // transformers 5's name
       count(cfg, qwen ? "moe_intermediate_size" : "intermediate_size", &a->hidden);
  if (ok && !count(cfg, "num_key_value_heads", &a->kv_heads)) a->kv_heads = a->heads;
  if (ok && !count(cfg, "head_dim", &a->head_dim)) a->head_dim = a->embed / a->heads;
  if (ok && qwen) count(cfg, "intermediate_size", &a->dense_hidden);
  if (ok && a->family == RT_HF_QWEN2_MOE) {
    count(cfg, "shared_expert_intermediate_size", &a->shared_hidden);
    a->shared_gate = a->shared_hidden > 0;
    a->qkv_bias = !cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(cfg, "qkv_bias"));
  }
  a->qk_norm = a->family == RT_HF_QWEN3_MOE ? 1 : a->family == RT_HF_OLMOE ? 2 : 0;
  if (a->qk_norm) a->qkv_bias = a->o_bias = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(cfg, "attention_bias"));
  int64_t shared = 1, first_dense = 1;   // GLM-4.5: n_shared_experts SwiGLU experts as one, dense layers first
  if (glm) {   // GLM-4.5 and DeepSeek-V2/V3
    count(cfg, "n_shared_experts", &shared);
    count(cfg, "first_k_dense_replace", &first_dense);
    a->shared_hidden = shared * a->hidden;
    a->correction_bias = a->family != RT_HF_DEEPSEEK_V2;
  }
  if (a->family == RT_HF_GLM4_MOE) {
    a->qk_norm = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(cfg, "use_qk_norm")) ? 1 : 0;
    a->qkv_bias = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(cfg, "attention_bias"));   // o_proj has none
  } else if (glm) {   // DeepSeek's latent attention
    a->mla = true;
    a->o_bias = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(cfg, "attention_bias"));
    if (!count(cfg, "q_lora_rank", &a->q_lora)) a->q_lora = 0;   // null: one q projection
    ok = ok && count(cfg, "kv_lora_rank", &a->kv_lora) && count(cfg, "qk_nope_head_dim", &a->nope) &&
         count(cfg, "qk_rope_head_dim", &a->rope) && count(cfg, "v_head_dim", &a->v);
    a->head_dim = a->nope + a->rope;
  }
  if (a->family == RT_HF_GPT_OSS) {   // attention_bias defaults to true there
    a->sinks = true;
    a->qkv_bias = a->o_bias = !cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(cfg, "attention_bias"));
  }
  a->tie = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(cfg, "tie_word_embeddings"));
  if (ok && a->layers > 0 && a->layers <= (1 << 16)) {
    a->dense = rt_calloc((size_t)a->layers, sizeof *a->dense, "the layers of a checkpoint");
    if (qwen && !glm) dense_layers(cfg, a);
    for (int64_t l = 0; glm && l < a->layers; l++) a->dense[l] = l < first_dense;
  }
  cJSON_Delete(cfg);
  if (!ok) return rt_fail("a Hugging Face config without the fields of its family");
  return 0;
}

void rt_hf_arch_free(RtHfArch *a) {
  if (a->inst)
    for (int64_t l = 0; l < a->layers; l++) free(a->inst[l]);
  free(a->inst);
  free(a->dense);
  a->inst = NULL;
  a->dense = NULL;
}

// ---- export (a training binary's --export-hf DIR) ----

static int write_text(const char *path, const char *text) {
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "wb");
  if (!f) return rt_fail("cannot write '%s': %s", tmp, strerror(errno));
  bool ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF;
  return rt_commit_file(f, ok, tmp, path);
}

// The layer instances of the model in order: the prefixes of its `*.attn.norm.weight` parameters.
static int instances_of(const RtModel *m, RtHfArch *a) {
  a->inst = rt_calloc((size_t)a->layers, sizeof *a->inst, "the layer names of a checkpoint");
  int64_t l = 0;
  const char *suffix = ".attn.norm.weight";
  size_t ns = strlen(suffix);
  for (int i = 0; i < m->nparams; i++) {
    const char *name = m->params[i].name;
    size_t n = strlen(name);
    if (n <= ns || strcmp(name + n - ns, suffix) != 0) continue;
    if (l == a->layers) return rt_fail("internal error: model '%s' has more layers than its Hugging Face config", m->name);
    a->inst[l] = rt_alloc(n - ns + 1, "a layer's name");
    memcpy(a->inst[l], name, n - ns);
    a->inst[l++][n - ns] = '\0';
  }
  if (l != a->layers) return rt_fail("internal error: model '%s' has %lld layers, its Hugging Face config %lld", m->name,
                                     (long long)l, (long long)a->layers);
  return 0;
}

static const RtParam *param_named(const RtModel *m, const char *name) {
  for (int i = 0; i < m->nparams; i++)
    if (strcmp(m->params[i].name, name) == 0) return &m->params[i];
  return NULL;
}

int rt_hf_export(const RtModel *m, float *const *whole, const char *dir) {
  if (!m->hf_config)
    return rt_fail("--export-hf: model '%s' cannot be written as a Hugging Face checkpoint: %s", m->name,
                   m->hf_refusal ? m->hf_refusal : "moec does not know its family");
  RtHfArch a;
  if (rt_hf_arch_of_config(m->hf_config, &a) != 0) return -1;
  RtHfTensor *t = NULL;
  int n = -1, nout = 0, status = instances_of(m, &a);
  if (status == 0) status = (n = rt_hf_tensors(&a, &t)) < 0 ? -1 : 0;
  RtStTensor *out = status == 0 ? rt_calloc((size_t)n, sizeof *out, "the tensors of a checkpoint") : NULL;
  float **bufs = status == 0 ? rt_calloc((size_t)n, sizeof *bufs, "the tensors of a checkpoint") : NULL;
  for (int i = 0; status == 0 && i < n; i++) {
    const RtParam *p = param_named(m, t[i].moec);
    int64_t dims[4];
    int rank = rt_hf_moec_dims(&a, &t[i], dims);
    if (!p || p->rank != rank || memcmp(p->global_dims, dims, (size_t)rank * sizeof *dims) != 0) {
      status = rt_fail("internal error: model '%s' has no parameter '%s' of the shape its %s tensor '%s' needs", m->name,
                       t[i].moec, rt_hf_family_name(a.family), t[i].hf);
      break;
    }
    if (nout > 0 && t[i].pick == 2) {   // the odd columns of the previous entry's tensor
      rt_hf_from_moec(&t[i], whole[p - m->params], bufs[nout - 1]);
      continue;
    }
    bufs[nout] = rt_alloc((size_t)rt_hf_numel(&t[i]) * sizeof(float), "a tensor of a checkpoint");
    rt_hf_from_moec(&t[i], whole[p - m->params], bufs[nout]);
    out[nout] = (RtStTensor){.name = t[i].hf, .rank = t[i].rank, .dims = t[i].dims, .data = bufs[nout]};
    nout++;
  }
  char path[4096];
  if (status == 0) status = rt_make_dirs(dir);
  if (status == 0) {
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    static const char *const meta[] = {"format", "pt"};
    status = rt_st_write(path, nout, out, 1, meta);
  }
  if (status == 0) {
    snprintf(path, sizeof path, "%s/config.json", dir);
    status = write_text(path, m->hf_config);
  }
  if (status == 0 && m->hf_generation) {
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    status = write_text(path, m->hf_generation);
  }
  for (int i = 0; bufs && i < nout; i++) free(bufs[i]);
  free(bufs);
  free(out);
  free(t);
  rt_hf_arch_free(&a);
  return status;
}
