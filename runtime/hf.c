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

// DIR/model.safetensors, config.json and generation_config.json from whole.
static int write_checkpoint(const RtModel *m, float *const *whole, const char *dir) {
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

// The family's table of model m (its config.json, its layers' instances): the entries' number, or
// -1 (rt_fail); a->inst and *t to free (rt_hf_arch_free, free).
static int table_of(const RtModel *m, RtHfArch *a, RtHfTensor **t) {
  *t = NULL;
  if (rt_hf_arch_of_config(m->hf_config, a) != 0) return -1;
  if (instances_of(m, a) != 0) return -1;
  return rt_hf_tensors(a, t);
}

// ---- LoRA adapters (PEFT) ----

static bool ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), k = strlen(suffix);
  return n >= k && strcmp(s + n - k, suffix) == 0;
}

// The parameter NAME.SUFFIX of m (NULL: none).
static const RtParam *param_of(const RtModel *m, const char *name, const char *suffix) {
  char full[RT_HF_NAME + 16];
  snprintf(full, sizeof full, "%s.%s", name, suffix);
  return param_named(m, full);
}

// W's A: W.lora_A, or the experts' w3's: w1's (transformers' gate_up_proj has one adapter).
static const RtParam *lora_a_of(const RtModel *m, const char *w) {
  const RtParam *a = param_of(m, w, "lora_A");
  if (a || !ends_with(w, ".experts.w3")) return a;
  char w1[RT_HF_NAME];
  snprintf(w1, sizeof w1, "%.*s1", (int)strlen(w) - 1, w);
  return param_of(m, w1, "lora_A");
}

static void adapter_entry(RtHfAdapter *e, const char *module, const char *ab, bool b, bool experts, int fused,
                          int64_t E, int64_t r, int64_t in, int64_t out, const char *moec0, const char *moec1) {
  memset(e, 0, sizeof *e);
  snprintf(e->peft, sizeof e->peft, "base_model.model.%s.%s.weight", module, ab);
  snprintf(e->moec[0], sizeof e->moec[0], "%s", moec0);
  if (moec1) snprintf(e->moec[1], sizeof e->moec[1], "%s", moec1);
  e->b = b, e->experts = experts, e->fused = fused;
  e->E = E, e->r = r, e->in = in, e->out = out;
  e->dims[0] = b ? (fused ? 2 : 1) * out : E * r;   // A [r·E, in], B [out, r·E] (E = 1: dense)
  e->dims[1] = b ? E * r : in;
}

// A dense weight's adapters: its table entry t (torch's [out, in]) names the module.
static int dense_adapters(const RtModel *m, const RtHfTensor *t, RtHfAdapter *out) {
  const RtParam *a = param_of(m, t->moec, "lora_A"), *b = param_of(m, t->moec, "lora_B");
  if (!a || a->rank != 2 || b->rank != 2 || t->expert >= 0 || t->rank != 2 || !t->transpose)
    return rt_fail("internal error: model '%s' has adapters of '%s' that are not a dense weight's", m->name, t->moec);
  char module[RT_HF_NAME], A[RT_HF_NAME + 16], B[RT_HF_NAME + 16];
  snprintf(module, sizeof module, "%.*s", (int)(strlen(t->hf) - strlen(".weight")), t->hf);
  snprintf(A, sizeof A, "%s.lora_A", t->moec);
  snprintf(B, sizeof B, "%s.lora_B", t->moec);
  int64_t in = a->global_dims[0], r = a->global_dims[1], o = b->global_dims[1];
  adapter_entry(&out[0], module, "lora_A", false, false, 0, 1, r, in, o, A, NULL);
  adapter_entry(&out[1], module, "lora_B", true, false, 0, 1, r, in, o, B, NULL);
  return 2;
}

// The experts' adapters of one MoE layer: gate_up_proj (moec's w1 and w3, one A) and down_proj
// (w2), each a ParamWrapper of module model.layers.L.mlp.experts. PEFT nests the wrappers of one
// module in the order the module registers its parameters (gate_up_proj first): with both
// adapted, gate_up_proj's adapter is the inner one, `experts.base_layer.lora_A`.
static int expert_adapters(const RtModel *m, const RtHfArch *arch, const RtHfTensor *t, RtHfAdapter *out) {
  long long layer;
  char base[RT_HF_NAME], module[RT_HF_NAME], w[4][RT_HF_NAME + 16];
  size_t n = strlen(t->moec);
  if (sscanf(t->hf, "model.layers.%lld.", &layer) != 1 || n < 3)
    return rt_fail("internal error: the experts' tensor '%s' of no decoder layer", t->hf);
  snprintf(base, sizeof base, "%.*s", (int)n - 3, t->moec);   // "moe0.moe.experts"
  snprintf(module, sizeof module, "model.layers.%lld.mlp.experts", layer);
  bool gate_up = ends_with(t->moec, ".w1");
  const RtParam *b2 = param_of(m, base, "w2.lora_B");
  if (gate_up) {
    snprintf(w[0], sizeof w[0], "%s.w1.lora_A", base);
    snprintf(w[1], sizeof w[1], "%s.w1.lora_B", base);
    snprintf(w[2], sizeof w[2], "%s.w3.lora_B", base);
    snprintf(w[3], sizeof w[3], "%s.w3.lora_A", base);
    const RtParam *a = param_named(m, w[0]), *b1 = param_named(m, w[1]), *b3 = param_named(m, w[2]);
    if (param_named(m, w[3]))
      return rt_fail("model '%s' has adapters of its experts' w1 and w3 with an A each ('%s'); transformers keeps "
                     "gate and up in one tensor (gate_up_proj) whose PEFT adapter has one A: this model cannot be "
                     "written as a PEFT adapter", m->name, w[3]);
    if (!a || !b1 || !b3 || a->rank != 3 || b1->rank != 3 || b3->rank != 3)
      return rt_fail("internal error: model '%s' lacks the adapters of '%s.w1' and '.w3'", m->name, base);
    char mod[RT_HF_NAME + 16];
    snprintf(mod, sizeof mod, "%s%s", module, b2 ? ".base_layer" : "");
    int64_t E = a->global_dims[0], in = a->global_dims[1], r = a->global_dims[2], o = b1->global_dims[2];
    adapter_entry(&out[0], mod, "lora_A", false, true, 0, E, r, in, o, w[0], NULL);
    adapter_entry(&out[1], mod, "lora_B", true, true, arch->family == RT_HF_GPT_OSS ? 2 : 1, E, r, in, o, w[1], w[2]);
    return 2;
  }
  snprintf(w[0], sizeof w[0], "%s.w2.lora_A", base);
  snprintf(w[1], sizeof w[1], "%s.w2.lora_B", base);
  const RtParam *a = param_named(m, w[0]);
  if (!a || !b2 || a->rank != 3 || b2->rank != 3)
    return rt_fail("internal error: model '%s' lacks the adapters of '%s.w2'", m->name, base);
  int64_t E = a->global_dims[0], in = a->global_dims[1], r = a->global_dims[2], o = b2->global_dims[2];
  adapter_entry(&out[0], module, "lora_A", false, true, 0, E, r, in, o, w[0], NULL);
  adapter_entry(&out[1], module, "lora_B", true, true, 0, E, r, in, o, w[1], NULL);
  return 2;
}

int rt_hf_adapters(const RtModel *m, RtHfAdapter **out) {
  *out = NULL;
  if (!m->hf_config || !m->hf_adapter)
    return rt_fail("model '%s' has no LoRA adapters of a Hugging Face family: %s", m->name,
                   !m->hf_config ? (m->hf_refusal ? m->hf_refusal : "moec does not know its family") : "it has no lora block");
  RtHfArch a;
  RtHfTensor *t;
  int n = table_of(m, &a, &t), k = 0;
  RtHfAdapter *ad = n >= 0 ? rt_calloc((size_t)(2 * n + 1), sizeof *ad, "the adapters of a model") : NULL;
  for (int i = 0; i < n && k >= 0; i++) {
    if (!param_of(m, t[i].moec, "lora_B")) continue;
    bool experts = t[i].expert >= 0 || t[i].rank == 3 || t[i].pick;
    if (experts && (t[i].expert > 0 || ends_with(t[i].moec, ".w3"))) continue;   // once per tensor (w3's: w1's)
    int got = experts ? expert_adapters(m, &a, &t[i], ad + k) : dense_adapters(m, &t[i], ad + k);
    k = got < 0 ? -1 : k + got;
  }
  if (n < 0) k = -1;
  for (int i = 0; k >= 0 && i < m->nparams; i++) {   // an adapter the family's names do not reach
    const char *name = m->params[i].name;
    bool seen = !ends_with(name, ".lora_A") && !ends_with(name, ".lora_B");
    for (int j = 0; j < k && !seen; j++) seen = strcmp(ad[j].moec[0], name) == 0 || strcmp(ad[j].moec[1], name) == 0;
    if (!seen) k = rt_fail("internal error: model '%s' has an adapter '%s' that no %s tensor holds", m->name, name,
                           rt_hf_family_name(a.family));
  }
  free(t);
  rt_hf_arch_free(&a);
  if (k < 0) {
    free(ad);
    return -1;
  }
  *out = ad;
  return k;
}

// PEFT's [r·E, in] (A) and [rows, r·E] (B) against moec's [E, in, r] and [E, r, out] (a dense
// weight's: E = 1, moec's [in, r] and [r, out] transposed); a fused B's row of part k (gate 0, up 1).
static void adapter_copy(const RtHfAdapter *t, float *const *moec, float *peft, bool to_moec) {
  int64_t E = t->E, r = t->r, in = t->in, out = t->out;
  if (!t->b) {
    for (int64_t e = 0; e < E; e++)
      for (int64_t j = 0; j < r; j++)
        for (int64_t i = 0; i < in; i++) {
          float *p = peft + (e * r + j) * in + i, *q = moec[0] + (e * in + i) * r + j;
          if (to_moec) *q = *p;
          else *p = *q;
        }
    return;
  }
  for (int k = 0; k < (t->fused ? 2 : 1); k++)
    for (int64_t o = 0; o < out; o++) {
      int64_t row = t->fused == 2 ? 2 * o + k : k * out + o;
      for (int64_t e = 0; e < E; e++)
        for (int64_t j = 0; j < r; j++) {
          float *p = peft + row * (r * E) + j * E + e, *q = moec[k] + (e * r + j) * out + o;
          if (to_moec) *q = *p;
          else *p = *q;
        }
    }
}

void rt_hf_adapter_from_moec(const RtHfAdapter *t, const float *const *moec, float *peft) {
  adapter_copy(t, (float *const *)moec, peft, false);
}

void rt_hf_adapter_to_moec(const RtHfAdapter *t, const float *peft, float *const *moec) {
  adapter_copy(t, moec, (float *)peft, true);
}

// The shortest text of v that reads back as v ("8", "0.5").
static const char *num_text(double v, char *buf, size_t n) {
  for (int digits = 6; digits <= 17; digits++) {
    snprintf(buf, n, "%.*g", digits, v);
    if (strtod(buf, NULL) == v) break;
  }
  return buf;
}

// r and lora_alpha of an adapter_config.json text; false when it has none.
static bool lora_sizes(const cJSON *c, int64_t *r, double *alpha) {
  const cJSON *jr = cJSON_GetObjectItemCaseSensitive(c, "r"), *ja = cJSON_GetObjectItemCaseSensitive(c, "lora_alpha");
  if (!cJSON_IsNumber(jr) || !cJSON_IsNumber(ja)) return false;
  *r = (int64_t)jr->valuedouble;
  *alpha = ja->valuedouble;
  return true;
}

static int write_adapter(const RtModel *m, float *const *whole, const char *dir) {
  RtHfAdapter *ad;
  int n = rt_hf_adapters(m, &ad);
  if (n < 0) return -1;
  RtStTensor *out = rt_calloc((size_t)n + 1, sizeof *out, "the tensors of an adapter");
  float **bufs = rt_calloc((size_t)n + 1, sizeof *bufs, "the tensors of an adapter");
  int status = 0;
  for (int i = 0; i < n && status == 0; i++) {
    const float *src[2] = {NULL, NULL};
    for (int k = 0; k < 2 && ad[i].moec[k][0]; k++) {
      const RtParam *p = param_named(m, ad[i].moec[k]);
      src[k] = p ? whole[p - m->params] : NULL;
      if (!src[k]) status = rt_fail("internal error: model '%s' has no adapter '%s'", m->name, ad[i].moec[k]);
    }
    if (status != 0) break;
    bufs[i] = rt_alloc((size_t)(ad[i].dims[0] * ad[i].dims[1]) * sizeof(float), "a tensor of an adapter");
    rt_hf_adapter_from_moec(&ad[i], src, bufs[i]);
    out[i] = (RtStTensor){.name = ad[i].peft, .rank = 2, .dims = ad[i].dims, .data = bufs[i]};
  }
  char path[4096];
  if (status == 0) status = rt_make_dirs(dir);
  if (status == 0) {
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
    static const char *const meta[] = {"format", "pt"};
    status = rt_st_write(path, n, out, 1, meta);
  }
  if (status == 0) {
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    status = write_text(path, m->hf_adapter);
  }
  for (int i = 0; i < n; i++) free(bufs[i]);
  free(bufs);
  free(out);
  free(ad);
  return status;
}

// whole with every adapted weight W replaced by W + (alpha/r)·A·B (merged[i] malloc'ed, else NULL).
static int merge_adapters(const RtModel *m, float *const *whole, float **merged) {
  cJSON *c = cJSON_Parse(m->hf_adapter);
  int64_t r = 0;
  double alpha = 0;
  bool ok = c && lora_sizes(c, &r, &alpha) && r > 0;
  cJSON_Delete(c);
  if (!ok) return rt_fail("internal error: model '%s' has an adapter config without r and lora_alpha", m->name);
  double s = alpha / (double)r;
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *w = &m->params[i], *a = lora_a_of(m, w->name), *b = param_of(m, w->name, "lora_B");
    if (!b) continue;
    bool experts = w->rank == 3;
    int64_t E = experts ? w->global_dims[0] : 1, in = w->global_dims[experts], out = w->global_dims[experts + 1];
    if (!a || a->rank != w->rank || a->global_dims[experts + 1] != b->global_dims[experts] ||
        a->global_dims[experts] != in || b->global_dims[experts + 1] != out)
      return rt_fail("internal error: model '%s' has adapters of '%s' that do not fit it", m->name, w->name);
    int64_t rank = b->global_dims[experts];
    const float *W = whole[i], *A = whole[a - m->params], *B = whole[b - m->params];
    float *M = merged[i] = rt_alloc((size_t)(E * in * out) * sizeof(float), "a merged weight");
    for (int64_t e = 0; e < E; e++)
      for (int64_t x = 0; x < in; x++)
        for (int64_t y = 0; y < out; y++) {
          double sum = 0;
          for (int64_t j = 0; j < rank; j++) sum += (double)A[(e * in + x) * rank + j] * (double)B[(e * rank + j) * out + y];
          M[(e * in + x) * out + y] = (float)((double)W[(e * in + x) * out + y] + s * sum);
        }
  }
  return 0;
}

int rt_hf_export(const RtModel *m, float *const *whole, const char *dir, bool merge) {
  if (!m->hf_config)
    return rt_fail("--export-hf: model '%s' cannot be written as a Hugging Face checkpoint: %s", m->name,
                   m->hf_refusal ? m->hf_refusal : "moec does not know its family");
  if (m->hf_adapter && !merge) return write_adapter(m, whole, dir);
  float **merged = NULL;
  float *const *from = whole;
  if (m->hf_adapter) {   // --merge
    merged = rt_calloc((size_t)m->nparams + 1, sizeof *merged, "the merged weights");
    float **with = rt_calloc((size_t)m->nparams + 1, sizeof *with, "the merged weights");
    int st = merge_adapters(m, whole, merged);
    for (int i = 0; i < m->nparams; i++) with[i] = merged[i] ? merged[i] : whole[i];
    if (st != 0) {
      for (int i = 0; i < m->nparams; i++) free(merged[i]);
      free(merged);
      free(with);
      return -1;
    }
    from = with;
  }
  int status = write_checkpoint(m, from, dir);
  if (merged) {
    for (int i = 0; i < m->nparams; i++) free(merged[i]);
    free(merged);
    free((void *)from);
  }
  return status;
}

// ---- --adapter DIR ----

// A JSON array of strings as "a, b and c" (a string as it is; none: "none").
static void list_text(const cJSON *v, char *buf, size_t n) {
  buf[0] = '\0';
  if (cJSON_IsString(v)) {
    snprintf(buf, n, "'%s'", v->valuestring);
    return;
  }
  int count = cJSON_IsArray(v) ? cJSON_GetArraySize(v) : 0, i = 0;
  size_t len = 0;
  for (const cJSON *e = count ? v->child : NULL; e && len + 1 < n; e = e->next, i++) {
    const char *sep = i == 0 ? "" : i == count - 1 ? " and " : ", ";
    len += (size_t)snprintf(buf + len, n - len, "%s%s", sep, cJSON_IsString(e) ? e->valuestring : "?");
  }
  if (!count) snprintf(buf, n, "none");
}

// What a config adapts: "target_modules q_proj and v_proj, target_parameters none".
static void targets_text(const cJSON *c, char *buf, size_t n) {
  char mods[512], params[256];
  list_text(cJSON_GetObjectItemCaseSensitive(c, "target_modules"), mods, sizeof mods);
  list_text(cJSON_GetObjectItemCaseSensitive(c, "target_parameters"), params, sizeof params);
  snprintf(buf, n, "target_modules %s, target_parameters %s", mods, params);
}

// The moec words of the model's lora block, from its adapter config's targets (DeepSeek's latent
// attention: q_a_proj and q_b_proj are q's, kv_a_proj_with_mqa and kv_b_proj k's and v's).
static void block_words(const cJSON *c, char *buf, size_t n) {
  static const char *const words[] = {"q", "k", "v", "o", "experts", "shared", "mlp"};
  static const struct { const char *module, *words; } proj[] = {
      {"q_proj", "q"}, {"k_proj", "k"}, {"v_proj", "v"}, {"o_proj", "o"}, {"q_a_proj", "q"}, {"q_b_proj", "q"},
      {"kv_a_proj_with_mqa", "kv"}, {"kv_b_proj", "kv"}};
  bool have[7] = {false};
  const cJSON *mods = cJSON_GetObjectItemCaseSensitive(c, "target_modules");
  for (const cJSON *e = cJSON_IsArray(mods) ? mods->child : NULL; e; e = e->next) {
    const char *s = cJSON_IsString(e) ? e->valuestring : "";
    for (size_t j = 0; j < sizeof proj / sizeof proj[0]; j++)
      if (strcmp(s, proj[j].module) == 0)
        for (int k = 0; k < 4; k++) have[k] |= strchr(proj[j].words, "qkvo"[k]) != NULL;
  }
  const cJSON *params = cJSON_GetObjectItemCaseSensitive(c, "target_parameters");
  for (const cJSON *e = cJSON_IsArray(params) ? params->child : NULL; e; e = e->next) {
    const char *s = cJSON_IsString(e) ? e->valuestring : "";
    have[4] |= strncmp(s, "experts.", 8) == 0;
    have[5] |= strncmp(s, "shared_expert", 13) == 0;
    have[6] |= strncmp(s, "mlp.", 4) == 0;
  }
  size_t len = 0;
  buf[0] = '\0';
  for (int k = 0; k < 7; k++)
    if (have[k] && len + 1 < n) len += (size_t)snprintf(buf + len, n - len, "%s%s", len ? " " : "", words[k]);
}

static char *read_file_text(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 4096, len = 0;
  char *text = rt_alloc(cap, "a JSON file");
  for (size_t got; (got = fread(text + len, 1, cap - len - 1, f)) > 0;) {
    len += got;
    if (len + 1 == cap) {
      char *more = realloc(text, cap *= 2);
      if (!more) {
        free(text);
        fclose(f);
        errno = ENOMEM;
        return NULL;
      }
      text = more;
    }
  }
  text[len] = '\0';
  fclose(f);
  return text;
}

// The adapter config's settings moec's adapters compute as: r, lora_alpha, no rank or alpha
// patterns, plain scaling, no DoRA, no trained biases, torch's [out, in] weights.
static int check_adapter_config(const char *dir, const RtModel *m, const cJSON *a, const cJSON *mine) {
  const cJSON *type = cJSON_GetObjectItemCaseSensitive(a, "peft_type");
  if (!cJSON_IsString(type) || strcmp(type->valuestring, "LORA") != 0)
    return rt_fail("--adapter '%s': adapter_config.json has peft_type %s; moec reads LoRA adapters (\"LORA\")", dir,
                   cJSON_IsString(type) ? type->valuestring : "none");
  int64_t r, want_r;
  double alpha, want_alpha;
  if (!lora_sizes(a, &r, &alpha)) return rt_fail("--adapter '%s': adapter_config.json has no r and lora_alpha", dir);
  lora_sizes(mine, &want_r, &want_alpha);
  char b1[40], b2[40];
  if (r != want_r || alpha != want_alpha)
    return rt_fail("--adapter '%s' has r %lld and lora_alpha %s; model '%s' has r %lld and alpha %s (its lora block)", dir,
                   (long long)r, num_text(alpha, b1, sizeof b1), m->name, (long long)want_r,
                   num_text(want_alpha, b2, sizeof b2));
  static const char *const patterns[] = {"rank_pattern", "alpha_pattern"};
  for (int k = 0; k < 2; k++) {
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(a, patterns[k]);
    if (p && !cJSON_IsNull(p) && cJSON_GetArraySize(p) > 0)
      return rt_fail("--adapter '%s' has a %s (other %s for some modules); model '%s' has one r %lld and alpha %s", dir,
                     patterns[k], k ? "alphas" : "ranks", m->name, (long long)want_r, num_text(want_alpha, b2, sizeof b2));
  }
  static const char *const flags[][2] = {
      {"use_rslora", "scales by lora_alpha/sqrt(r) (use_rslora); moec's adapters by alpha/r"},
      {"use_dora", "is a DoRA adapter (use_dora); moec's are plain LoRA"},
      {"lora_bias", "has biases on lora_B (lora_bias); moec's adapters have none"},
      {"fan_in_fan_out", "stores its weights [in, out] (fan_in_fan_out); moec reads torch's Linear layout"}};
  for (int k = 0; k < 4; k++)
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(a, flags[k][0])))
      return rt_fail("--adapter '%s' %s", dir, flags[k][1]);
  const cJSON *bias = cJSON_GetObjectItemCaseSensitive(a, "bias");
  if (cJSON_IsString(bias) && strcmp(bias->valuestring, "none") != 0)
    return rt_fail("--adapter '%s' trains the model's biases too (bias \"%s\"); moec's lora trains the adapters only "
                   "(bias \"none\")", dir, bias->valuestring);
  return 0;
}

// Every tensor the model's adapters need is in f, with their shapes, and f has no other.
static int check_adapter_tensors(const char *dir, const RtModel *m, const cJSON *a, const cJSON *mine,
                                 const RtStFile *f, const RtHfAdapter *ad, int n) {
  const char *missing = NULL, *extra = NULL;
  for (int i = 0; i < n && !missing; i++)
    if (!rt_st_find(f, ad[i].peft)) missing = ad[i].peft;
  for (int i = 0; i < f->ntensors && !missing && !extra; i++) {
    bool known = false;
    for (int j = 0; j < n && !known; j++) known = strcmp(ad[j].peft, f->tensors[i].name) == 0;
    if (!known) extra = f->tensors[i].name;
  }
  if (missing || extra) {
    char theirs[900], ours[900], words[64];
    targets_text(a, theirs, sizeof theirs);
    targets_text(mine, ours, sizeof ours);
    block_words(mine, words, sizeof words);
    return rt_fail("--adapter '%s' adapts other weights than model '%s': the adapter's %s; the model's %s (lora "
                   "targets %s): %s '%s'", dir, m->name, theirs, ours, words,
                   missing ? "the adapter has no tensor" : "the model has no adapter for the adapter's tensor",
                   missing ? missing : extra);
  }
  for (int i = 0; i < n; i++) {
    const RtStEntry *t = rt_st_find(f, ad[i].peft);
    if (t->rank != 2 || t->dims[0] != ad[i].dims[0] || t->dims[1] != ad[i].dims[1]) {
      char have[160], want[160];
      return rt_fail("--adapter '%s': tensor '%s' is %s; model '%s' makes it %s", dir, ad[i].peft,
                     rt_shape_str(have, sizeof have, t->rank, t->dims), m->name, rt_shape_str(want, sizeof want, 2, ad[i].dims));
    }
  }
  return 0;
}

// The model of every stage's parameters (a tensor two stages hold once), *all malloc'ed; m itself
// without stages.
static RtModel all_stages(const RtModel *m, const RtModel *const *stages, int nstages, RtParam **all) {
  *all = NULL;
  if (!stages || nstages <= 1) return *m;
  int total = 0, n = 0;
  for (int s = 0; s < nstages; s++) total += stages[s]->nparams;
  *all = rt_calloc((size_t)total + 1, sizeof **all, "the parameters of every stage");
  for (int s = 0; s < nstages; s++)
    for (int i = 0; i < stages[s]->nparams; i++)
      if (!param_named(&(RtModel){.params = *all, .nparams = n}, stages[s]->params[i].name)) (*all)[n++] = stages[s]->params[i];
  RtModel u = *m;
  u.params = *all, u.nparams = n;
  return u;
}

int rt_hf_adapter_load(const char *dir, const RtModel *stage, const RtModel *const *stages, int nstages,
                       const struct RtRanks *ranks, float *params) {
  RtParam *all;
  RtModel whole_model = all_stages(stage, stages, nstages, &all);
  const RtModel *m = &whole_model;
  if (!m->hf_adapter) {
    free(all);
    return rt_fail("--adapter: model '%s' has no lora block to load an adapter into", m->name);
  }
  char path[4096];
  snprintf(path, sizeof path, "%s/adapter_config.json", dir);
  errno = 0;
  char *text = read_file_text(path);
  if (!text) {
    free(all);
    return rt_fail("--adapter: cannot read '%s': %s (a PEFT adapter folder holds adapter_config.json and "
                   "adapter_model.safetensors)", path, strerror(errno ? errno : EIO));
  }
  cJSON *a = cJSON_Parse(text), *mine = cJSON_Parse(m->hf_adapter);
  free(text);
  int status = !a || !cJSON_IsObject(a) ? rt_fail("--adapter: '%s' is not a JSON object", path) : 0;
  if (status == 0 && !mine) status = rt_fail("internal error: model '%s' has an adapter config that is not JSON", m->name);
  if (status == 0) status = check_adapter_config(dir, m, a, mine);
  RtHfAdapter *ad = NULL;
  int n = status == 0 ? rt_hf_adapters(m, &ad) : -1;
  if (n < 0) status = -1;
  RtStFile f = {0};
  if (status == 0) {
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
    status = rt_st_read(path, &f);
  }
  if (status == 0) status = check_adapter_tensors(dir, m, a, mine, &f, ad, n);
  // The whole moec adapters, then this rank's shard of each.
  float **whole = status == 0 ? rt_calloc((size_t)m->nparams + 1, sizeof *whole, "the adapters") : NULL;
  for (int i = 0; status == 0 && i < n; i++) {
    float *dst[2] = {NULL, NULL};
    for (int k = 0; k < 2 && ad[i].moec[k][0]; k++) {
      const RtParam *p = param_named(m, ad[i].moec[k]);
      float **w = &whole[p - m->params];
      if (!*w) *w = rt_calloc((size_t)rt_param_global_numel(p), sizeof(float), "an adapter");
      dst[k] = *w;
    }
    const RtStEntry *t = rt_st_find(&f, ad[i].peft);
    float *src = rt_alloc((size_t)t->numel * sizeof(float), "a tensor of an adapter");
    rt_st_copy(t, src);
    rt_hf_adapter_to_moec(&ad[i], src, dst);
    free(src);
  }
  int64_t zero[RT_MAX_RANK] = {0};
  for (int i = 0; status == 0 && i < stage->nparams; i++) {   // this rank's program's shards
    const RtParam *p = &stage->params[i], *q = param_named(m, p->name);
    float *w = q ? whole[q - m->params] : NULL;
    if (!w) continue;
    int64_t off[4];
    rt_shard_offsets(p, (const RtRanks *)ranks, off);
    rt_box_copy(p->rank, zero, p->global_dims, w, off, p->dims, params + p->offset);
  }
  for (int i = 0; whole && i < m->nparams; i++) free(whole[i]);
  free(whole);
  rt_st_free(&f);
  free(ad);
  cJSON_Delete(a);
  cJSON_Delete(mine);
  free(all);
  return status;
}
