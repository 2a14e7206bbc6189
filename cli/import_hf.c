// moec import-hf DIR -o PREFIX: a Hugging Face checkpoint (lang/manual.md §19) as a moec model.
//
// Reads DIR/config.json and the weights (model.safetensors or model.safetensors.index.json with
// its shards; F32, BF16, F16 or F64), and writes PREFIX.moe, the architecture in the language
// with the training fields the command line gives, and PREFIX.safetensors, the weights in moec's
// names (F32), which the built binary loads with --weights, and PREFIX.hf/, the checkpoint's
// config.json and generation_config.json as they are (the .moe's `hf_config` names it; the
// export writes every key the model does not determine from it: frontend/hf.c). Which tensor is
// which parameter is runtime/hf.c's table, the one a binary's --export-hf writes back with.
//
// Nothing is silently dropped: every key of config.json is either represented, checked to hold
// the value moec computes with (hidden_act silu, no dropout, no router jitter, ...), or known to
// describe something else (tokenizer ids, the dtype it was saved in); any other key or value is
// refused with a sentence naming it. Every tensor of the checkpoint must be one the table names.
#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli.h"
#include "cli/options.h"
#include "frontend/fe.h"
#include "runtime/rt_hf.h"
#include "runtime/rt_internal.h"

typedef struct Options {
  const char *dir, *prefix, *name, *optimizer;
  int64_t batch, seqlen;
  double lr;
  int64_t lora;                // --lora R: the model's lora block of rank R (0: none)
  double lora_alpha;           // --lora-alpha (default 8, PEFT's)
  const char *lora_targets;    // --lora-targets LIST (NULL: the default)
  bool alpha_given;
  char lora_line[160];         // the block as written into the .moe ("" without --lora)
} Options;

void cli_import_hf_usage(FILE *out) {
  fprintf(out,
          "usage: moec import-hf DIR -o PREFIX [--name NAME] [--batch B] [--seqlen L] [--optimizer sgd|adamw] [--lr X]\n"
          "                 [--lora R [--lora-alpha A] [--lora-targets LIST]]\n"
          "\n"
          "Reads the Hugging Face checkpoint in DIR (config.json; model.safetensors or model.safetensors.index.json\n"
          "with its shards; F32, BF16, F16 or F64 tensors) and writes PREFIX.moe (the architecture as a moec\n"
          "model), PREFIX.safetensors (the weights in moec's names, F32) and PREFIX.hf/ (the checkpoint's\n"
          "config.json and generation_config.json, which --export-hf keeps: the .moe names it). Then:\n"
          "  moec build PREFIX.moe -o BIN && BIN --weights PREFIX.safetensors [--data F] ... [--export-hf OUT]\n"
          "Families: mixtral, qwen2_moe, qwen3_moe, olmoe, glm4_moe, deepseek_v2, deepseek_v3, gpt_oss (model_type in config.json).\n"
          "A config value moec cannot represent is refused.\n"
          "  --name NAME       the model's name (default: DIR's last folder, as an identifier)\n"
          "  --batch B         samples per data-parallel rank (default 4)\n"
          "  --seqlen L        tokens per sample (default min(128, max_position_embeddings))\n"
          "  --optimizer O     sgd or adamw (default adamw)\n"
          "  --lr X            learning rate (default 1e-05)\n"
          "  --lora R          LoRA fine-tuning: the .moe gets 'lora { r R; alpha A; targets ...; }' (the\n"
          "                    weights frozen, adapters trained); --export-hf then writes a PEFT adapter\n"
          "  --lora-alpha A    the adapters' scale is A/r (default 8, PEFT's)\n"
          "  --lora-targets L  what gets adapters, words of q k v o experts shared mlp with commas or\n"
          "                    spaces (default: q,k,v,o,experts; with DeepSeek's latent attention k and v\n"
          "                    both or neither: they adapt kv_a_proj_with_mqa and kv_b_proj together)\n");
}

static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "moec import-hf: error: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  return 1;
}

// --batch, --seqlen: a whole number from 1 to 2^24 (a CliOpt check).
static bool opt_count(const CliArgs *a, const char *opt, const char *value, void *dest) {
  char *end = NULL;
  errno = 0;
  int64_t v = strtoll(value, &end, 10);
  if (*end || errno || v <= 0 || v > (1 << 24))
    return cli_args_error(a, "%s needs a whole number from 1 to %d, not '%s'", opt, 1 << 24, value);
  *(int64_t *)dest = v;
  return true;
}

// --lr: a positive number (a CliOpt check).
static bool opt_real(const CliArgs *a, const char *opt, const char *value, void *dest) {
  char *end = NULL;
  errno = 0;
  double v = strtod(value, &end);
  if (*end || errno || !(v > 0) || !isfinite(v))
    return cli_args_error(a, "%s needs a positive number, not '%s'", opt, value);
  *(double *)dest = v;
  return true;
}

static bool parse_options(int argc, char **argv, Options *o) {
  *o = (Options){.optimizer = "adamw", .batch = 4, .lr = 1e-5, .lora_alpha = -1};
  const CliOpt opts[] = {
      {"-o", NULL, false, &o->prefix},
      {"--name", NULL, false, &o->name},
      {"--optimizer", NULL, false, &o->optimizer},
      {"--batch", NULL, false, &o->batch, opt_count},
      {"--seqlen", NULL, false, &o->seqlen, opt_count},
      {"--lr", NULL, false, &o->lr, opt_real},
      {"--lora", NULL, false, &o->lora, opt_count},
      {"--lora-alpha", NULL, false, &o->lora_alpha, opt_real},
      {"--lora-targets", NULL, false, &o->lora_targets},
  };
  CliArgs args = {.prefix = "moec import-hf: error: ", .needs_value = "%s needs a value",
                  .positional = &o->dir, .second = "one checkpoint folder only", .opts = opts,
                  .nopts = sizeof opts / sizeof opts[0]};
  if (!cli_parse_args(&args, argc, argv)) return false;
  if (!o->dir || !o->prefix) {
    fprintf(stderr, "moec import-hf: error: %s\n", !o->dir ? "which checkpoint folder?" : "-o PREFIX is required");
    cli_import_hf_usage(stderr);
    return false;
  }
  if (strcmp(o->optimizer, "sgd") != 0 && strcmp(o->optimizer, "adamw") != 0) {
    fprintf(stderr, "moec import-hf: error: --optimizer takes sgd or adamw, not '%s'\n", o->optimizer);
    return false;
  }
  o->alpha_given = o->lora_alpha > 0;
  if (!o->lora && (o->alpha_given || o->lora_targets)) {
    fprintf(stderr, "moec import-hf: error: %s needs --lora R (the adapters' rank)\n",
            o->alpha_given ? "--lora-alpha" : "--lora-targets");
    return false;
  }
  if (!o->alpha_given) o->lora_alpha = 8;
  return true;
}

// ---- config.json ----

typedef struct Config {
  const char *path;
  cJSON *json;
  RtHfArch arch;
  int64_t k, max_positions;
  double theta, eps;
  bool tie, renormalize;
  bool router_logits;  // output_router_logits: transformers' load-balancing loss in the objective
  double aux_coef;     // its router_aux_loss_coef
  int64_t window;   // Mixtral's sliding_window when shorter than the sequence (0: none)
  double partial;   // rope_parameters' partial_rotary_factor (GLM-4.5; default 1)
  // GLM-4.5's and DeepSeek's router: n_group, topk_group, routed_scaling_factor; DeepSeek-V2's
  // topk_method group_limited_greedy (the groups ranked by their best; greedy: no limit)
  int64_t n_group, topk_group;
  double scale;
  bool group_greedy;
  bool interleave;  // DeepSeek's rope on adjacent pairs (V2 always, V3 with rope_interleave)
  // rope_type "yarn" (DeepSeek): factor, original_max_position_embeddings, beta_fast, beta_slow,
  // mscale, mscale_all_dim (0: absent)
  bool yarn;
  double yarn_factor, yarn_beta_fast, yarn_beta_slow, yarn_mscale, yarn_mscale_all_dim;
  int64_t yarn_original;
  bool yarn_truncate;   // truncate: the ramp's ends rounded out to whole pairs (default true; gpt-oss false)
  bool *sliding;        // gpt-oss: per decoder layer, "sliding_attention" in layer_types (the window when shorter
                        // than the sequence), else "full_attention"
} Config;

static bool is_deepseek(RtHfFamily f) { return f == RT_HF_DEEPSEEK_V2 || f == RT_HF_DEEPSEEK_V3; }
// GLM-4.5 and the DeepSeek families: n_routed_experts, shared experts, dense layers first.
static bool is_glm_like(RtHfFamily f) { return f == RT_HF_GLM4_MOE || is_deepseek(f); }
// Mixtral and gpt-oss: num_local_experts and intermediate_size.
static bool is_mixtral_like(RtHfFamily f) { return f == RT_HF_MIXTRAL || f == RT_HF_GPT_OSS; }

// The value of key as text, for a sentence.
static void value_text(const cJSON *v, char *buf, size_t n) {
  char *t = cJSON_PrintUnformatted(v);
  snprintf(buf, n, "%s", t ? t : "?");
  if (strlen(buf) == n - 1 && n > 4) memcpy(buf + n - 4, "...", 4);
  free(t);
}

static int refuse(const Config *c, const cJSON *v, const char *why) {
  char text[200];
  value_text(v, text, sizeof text);
  return fail("%s: \"%s\": %s is not something moec can represent: %s", c->path, v->string, text, why);
}

static const cJSON *key(const Config *c, const char *k) { return cJSON_GetObjectItemCaseSensitive(c->json, k); }

static bool is_zero(const cJSON *v) { return cJSON_IsNumber(v) && v->valuedouble == 0; }
static bool is_family(const Config *c, RtHfFamily f) { return c->arch.family == f; }

// DeepSeek's and gpt-oss's rope_parameters with rope_type "yarn": theta, factor and the original
// positions, and beta_fast, beta_slow (32, 1), mscale, mscale_all_dim, truncate where given;
// nothing else (attention_factor given outright: refused).
static int read_yarn(Config *c, const cJSON *v) {
  static const char *const keys[] = {"rope_type", "rope_theta", "factor", "original_max_position_embeddings",
                                     "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"};
  double *at[] = {NULL, &c->theta, &c->yarn_factor, NULL, &c->yarn_beta_fast, &c->yarn_beta_slow, &c->yarn_mscale,
                  &c->yarn_mscale_all_dim};
  c->yarn_beta_fast = 32;
  c->yarn_beta_slow = 1;
  for (const cJSON *e = v->child; e; e = e->next) {
    size_t i = 0;
    while (i < sizeof keys / sizeof *keys && strcmp(e->string, keys[i]) != 0) i++;
    if (i == sizeof keys / sizeof *keys)
      return refuse(c, v, "moec's yarn takes rope_theta, factor, original_max_position_embeddings, beta_fast, "
                    "beta_slow, mscale, mscale_all_dim and truncate");
    if (i == 0 || (cJSON_IsNull(e) && i >= 4)) continue;
    if (i == 8) {
      if (!cJSON_IsBool(e)) return refuse(c, v, "its truncate must be true or false");
      c->yarn_truncate = cJSON_IsTrue(e);
      continue;
    }
    if (!cJSON_IsNumber(e) || !(e->valuedouble > 0 || (i >= 6 && e->valuedouble == 0)))
      return refuse(c, v, "its yarn numbers must be positive");
    if (i == 3) c->yarn_original = (int64_t)e->valuedouble;
    else *at[i] = e->valuedouble;
  }
  if (!(c->yarn_factor > 0) || c->yarn_original < 1)
    return refuse(c, v, "yarn needs its factor and original_max_position_embeddings");
  c->yarn = true;
  return 0;
}

// ---- config.json's keys: one table (KEYS below) ----
// Each key moec knows is a row: the families it applies to and what it takes. A row without a
// handler is harmless: it describes something other than the computation (tokenizer, saving,
// generation), or the architecture reads it (rt_hf_arch_of_config and read_arch check it). A
// handler returns 0 when the value is represented, 2 when read_arch checks it against the
// architecture, else refuse()'s 1 with the sentence. The first row that names the key for the
// checkpoint's family decides; a key no row names is refused.
#define FAM(f) (1u << (f))
enum {
  ALL = ~0u,
  MIXTRAL = FAM(RT_HF_MIXTRAL), QWEN2 = FAM(RT_HF_QWEN2_MOE), QWEN3 = FAM(RT_HF_QWEN3_MOE), OLMOE = FAM(RT_HF_OLMOE),
  GLM4 = FAM(RT_HF_GLM4_MOE), DS2 = FAM(RT_HF_DEEPSEEK_V2), DS3 = FAM(RT_HF_DEEPSEEK_V3), OSS = FAM(RT_HF_GPT_OSS),
  QWEN = QWEN2 | QWEN3, DEEPSEEK = DS2 | DS3, GLM_LIKE = GLM4 | DEEPSEEK,
};

typedef int (*KeyFn)(Config *c, const cJSON *v);
typedef struct Key {
  const char *name;
  unsigned families;
  KeyFn take;   // NULL: harmless
} Key;

static int bool_or_refuse(Config *c, const cJSON *v, bool *out) {
  if (out) *out = cJSON_IsTrue(v);
  return cJSON_IsBool(v) ? 0 : refuse(c, v, "it must be true or false");
}

static int take_hidden_act(Config *c, const cJSON *v) {
  return cJSON_IsString(v) && strcmp(v->valuestring, "silu") == 0 ? 0 : refuse(c, v, "moec's SwiGLU experts use silu");
}
static int take_attention_dropout(Config *c, const cJSON *v) {
  return is_zero(v) ? 0 : refuse(c, v, "moec trains without dropout");
}
static int take_jitter(Config *c, const cJSON *v) {
  return is_zero(v) ? 0 : refuse(c, v, "moec's gates have no multiplicative jitter (only 'noise', a different one)");
}
// true: the gates' `aux pooled` (read_arch)
static int take_router_logits(Config *c, const cJSON *v) { return bool_or_refuse(c, v, &c->router_logits); }
static int take_head_dim(Config *c, const cJSON *v) { return cJSON_IsNull(v) ? 0 : 2; }

// gpt-oss: 'ffn oss', the clamped SwiGLU of gpt-oss's constants, and its layer types
static int take_swiglu_alpha(Config *c, const cJSON *v) {
  return cJSON_IsNumber(v) && v->valuedouble == 1.702 ? 0 : refuse(c, v, "moec's 'ffn oss' has alpha 1.702");
}
static int take_swiglu_limit(Config *c, const cJSON *v) {
  return cJSON_IsNumber(v) && v->valuedouble == 7.0 ? 0 : refuse(c, v, "moec's 'ffn oss' clamps at 7");
}
static int take_oss_layer_types(Config *c, const cJSON *v) {
  for (const cJSON *e = cJSON_IsArray(v) ? v->child : NULL; e; e = e->next)
    if (!cJSON_IsString(e) || (strcmp(e->valuestring, "full_attention") != 0 &&
                               strcmp(e->valuestring, "sliding_attention") != 0))
      return refuse(c, v, "moec's layers are \"sliding_attention\" (a window) or \"full_attention\"");
  return cJSON_IsArray(v) ? 2 : refuse(c, v, "it must be a list of layer types");
}

// DeepSeek: transformers' derived values (the rotary heads' width, q's and k's heads) and its options
static int take_derived(Config *c, const cJSON *v) { return 2; }
static int take_pretraining_tp(Config *c, const cJSON *v) {
  return cJSON_IsNull(v) || (cJSON_IsNumber(v) && v->valuedouble == 1) ? 0
         : refuse(c, v, "transformers computes with one tensor-parallel slice (it only describes pretraining)");
}
static int take_mlp_bias(Config *c, const cJSON *v) {
  return cJSON_IsFalse(v) ? 0 : refuse(c, v, "moec's SwiGLU experts have no biases");
}
static int take_rope_interleave(Config *c, const cJSON *v) { return bool_or_refuse(c, v, &c->interleave); }
static int take_topk_method(Config *c, const cJSON *v) {
  bool greedy = cJSON_IsString(v) && strcmp(v->valuestring, "greedy") == 0;
  c->group_greedy = cJSON_IsString(v) && strcmp(v->valuestring, "group_limited_greedy") == 0;
  return greedy || c->group_greedy ? 0 : refuse(c, v, "moec's DeepSeek-V2 router is \"greedy\" or \"group_limited_greedy\"");
}

// GLM-4.5 and DeepSeek: the grouped router, its scale, and the multi-token-prediction layers after
// the last decoder layer (transformers does not build them, nor load their tensors; nor does moec)
static int take_groups(Config *c, const cJSON *v) {
  if (cJSON_IsNull(v)) return 0;   // DeepSeek-V2's greedy router has none
  if (!cJSON_IsNumber(v) || v->valuedouble < 1 || v->valuedouble > 64 || v->valuedouble != floor(v->valuedouble))
    return refuse(c, v, "moec's router takes a whole number of expert groups from 1 to 64");
  *(v->string[0] == 'n' ? &c->n_group : &c->topk_group) = (int64_t)v->valuedouble;
  return 0;
}
static int take_routed_scale(Config *c, const cJSON *v) {
  if (!cJSON_IsNumber(v) || !(v->valuedouble > 0)) return refuse(c, v, "it must be a positive number");
  c->scale = v->valuedouble;
  return 0;
}
static int take_nextn(Config *c, const cJSON *v) {
  return cJSON_IsNumber(v) && v->valuedouble >= 0 ? 0 : refuse(c, v, "it must be a number of layers");
}

// The Qwen families' windows and layer types
static int take_use_sliding_window(Config *c, const cJSON *v) {
  return cJSON_IsFalse(v) ? 0
         : refuse(c, v, "the Qwen families' windows apply from max_window_layers on, which moec does not represent");
}
static int take_qwen_layer_types(Config *c, const cJSON *v) {
  for (const cJSON *e = cJSON_IsArray(v) ? v->child : NULL; e; e = e->next)
    if (!cJSON_IsString(e) || strcmp(e->valuestring, "full_attention") != 0)
      return refuse(c, v, "moec's attention sees the whole sequence in every layer (\"full_attention\")");
  return cJSON_IsArray(v) ? 0 : refuse(c, v, "it must be a list of layer types");
}
static int take_sliding_window(Config *c, const cJSON *v) {
  bool qwen = is_family(c, RT_HF_QWEN2_MOE) || is_family(c, RT_HF_QWEN3_MOE);
  if (qwen && !cJSON_IsTrue(key(c, "use_sliding_window"))) return 0;   // unused
  if (cJSON_IsNull(v)) return 0;
  if (!is_mixtral_like(c->arch.family))
    return refuse(c, v, "only Mixtral's and gpt-oss's attention have a sliding window in moec");
  return cJSON_IsNumber(v) && v->valuedouble >= 1 && v->valuedouble == floor(v->valuedouble)
             ? 2 : refuse(c, v, "it must be null or a whole number of at least 1");
}
static int take_clip_qkv(Config *c, const cJSON *v) {
  return cJSON_IsNull(v) ? 0 : refuse(c, v, "moec does not clamp q, k and v");
}

static int take_rope_theta(Config *c, const cJSON *v) {
  if (!cJSON_IsNumber(v) || !(v->valuedouble > 0)) return refuse(c, v, "it must be a positive number");
  c->theta = v->valuedouble;
  return 0;
}
static int take_rope_scaling(Config *c, const cJSON *v) {
  return cJSON_IsNull(v) ? 0 : refuse(c, v, "moec's rotary positions are unscaled");
}
static int take_rope_parameters(Config *c, const cJSON *v) {
  const cJSON *type = cJSON_GetObjectItemCaseSensitive(v, "rope_type");
  const cJSON *theta = cJSON_GetObjectItemCaseSensitive(v, "rope_theta");
  const cJSON *partial = cJSON_GetObjectItemCaseSensitive(v, "partial_rotary_factor");
  bool yarn_family = is_deepseek(c->arch.family) || is_family(c, RT_HF_GPT_OSS);
  if (yarn_family && cJSON_IsString(type) && strcmp(type->valuestring, "yarn") == 0) return read_yarn(c, v);
  if (type && !(cJSON_IsString(type) && strcmp(type->valuestring, "default") == 0))
    return refuse(c, v, yarn_family ? "moec's rotary positions are the default ones or yarn"
                                    : "moec's rotary positions are the default ones (rope_type \"default\")");
  if (!cJSON_IsNumber(theta) || !(theta->valuedouble > 0)) return refuse(c, v, "it needs a positive rope_theta");
  if (partial && !(cJSON_IsNumber(partial) && partial->valuedouble > 0 && partial->valuedouble <= 1))
    return refuse(c, v, "its partial_rotary_factor must be a number in (0, 1]");
  for (const cJSON *e = v->child; e; e = e->next)
    if (strcmp(e->string, "rope_type") != 0 && strcmp(e->string, "rope_theta") != 0 &&
        strcmp(e->string, "partial_rotary_factor") != 0)
      return refuse(c, v, "moec's rotary positions have no parameters beyond rope_theta and partial_rotary_factor");
  c->theta = theta->valuedouble;
  if (partial) c->partial = partial->valuedouble;
  return 0;
}

static const Key KEYS[] = {
    // harmless in every family
    {"vocab_size", ALL}, {"hidden_size", ALL}, {"num_hidden_layers", ALL}, {"num_attention_heads", ALL},
    {"num_key_value_heads", ALL}, {"num_experts_per_tok", ALL}, {"max_position_embeddings", ALL},
    {"rms_norm_eps", ALL}, {"tie_word_embeddings", ALL}, {"model_type", ALL}, {"transformers_version", ALL},
    {"dtype", ALL}, {"torch_dtype", ALL}, {"bos_token_id", ALL}, {"eos_token_id", ALL}, {"pad_token_id", ALL},
    {"initializer_range", ALL}, {"use_cache", ALL}, {"architectures", ALL}, {"router_aux_loss_coef", ALL},
    {"return_dict", ALL}, {"output_hidden_states", ALL}, {"output_attentions", ALL},
    // harmless in some: the sizes and switches read_arch reads
    {"num_local_experts", MIXTRAL | QWEN3 | OSS}, {"num_experts", QWEN | OLMOE},
    {"n_routed_experts", GLM_LIKE}, {"n_shared_experts", GLM_LIKE}, {"first_k_dense_replace", GLM_LIKE},
    {"intermediate_size", ALL}, {"moe_intermediate_size", QWEN | GLM_LIKE},
    {"shared_expert_intermediate_size", QWEN2}, {"qkv_bias", QWEN2},
    {"decoder_sparse_step", QWEN}, {"mlp_only_layers", QWEN}, {"max_window_layers", QWEN},
    {"norm_topk_prob", QWEN | OLMOE | GLM_LIKE},   // read_arch: V2's router never renormalises
    {"head_dim", QWEN3 | GLM4 | OSS}, {"attention_bias", QWEN3 | OLMOE | GLM_LIKE | OSS}, {"use_qk_norm", GLM4},
    {"kv_lora_rank", DEEPSEEK}, {"q_lora_rank", DEEPSEEK}, {"qk_nope_head_dim", DEEPSEEK},
    {"qk_rope_head_dim", DEEPSEEK}, {"v_head_dim", DEEPSEEK},
    // what moec represents or refuses
    {"hidden_act", ALL, take_hidden_act}, {"attention_dropout", ALL, take_attention_dropout},
    {"router_jitter_noise", MIXTRAL, take_jitter}, {"output_router_logits", ALL, take_router_logits},
    {"head_dim", ALL, take_head_dim},
    {"swiglu_alpha", OSS, take_swiglu_alpha}, {"swiglu_limit", OSS, take_swiglu_limit},
    {"layer_types", OSS, take_oss_layer_types}, {"layer_types", QWEN, take_qwen_layer_types},
    {"qk_head_dim", DEEPSEEK, take_derived}, {"pretraining_tp", DEEPSEEK, take_pretraining_tp},
    {"mlp_bias", DS2, take_mlp_bias}, {"rope_interleave", DS3, take_rope_interleave},
    {"topk_method", DS2, take_topk_method},
    {"n_group", GLM_LIKE, take_groups}, {"topk_group", GLM_LIKE, take_groups},
    {"routed_scaling_factor", GLM_LIKE, take_routed_scale}, {"num_nextn_predict_layers", GLM_LIKE, take_nextn},
    {"use_sliding_window", QWEN, take_use_sliding_window}, {"sliding_window", ALL, take_sliding_window},
    {"clip_qkv", OLMOE, take_clip_qkv},
    {"rope_theta", ALL, take_rope_theta}, {"rope_scaling", ALL, take_rope_scaling},
    {"rope_parameters", ALL, take_rope_parameters},
};

// One key of config.json through KEYS: 0 when represented or harmless, 2 when read_arch checks it
// against the architecture, else 1 with the sentence.
static int check_key(Config *c, const cJSON *v) {
  for (size_t i = 0; i < sizeof KEYS / sizeof *KEYS; i++)
    if ((KEYS[i].families & FAM(c->arch.family)) && strcmp(KEYS[i].name, v->string) == 0)
      return KEYS[i].take ? KEYS[i].take(c, v) : 0;
  char text[200];
  value_text(v, text, sizeof text);
  return fail("%s: \"%s\": %s is a key moec does not know for %s; refusing rather than ignoring it", c->path, v->string,
              text, rt_hf_family_name(c->arch.family));
}

static int need_count(const Config *c, const char *k) {
  const cJSON *v = key(c, k);
  if (!v) return fail("%s: \"%s\" is missing; a %s config needs it", c->path, k, rt_hf_family_name(c->arch.family));
  if (!cJSON_IsNumber(v) || v->valuedouble < 1 || v->valuedouble > 1e9 || v->valuedouble != floor(v->valuedouble))
    return refuse(c, v, "it must be a whole number from 1 to 10^9");
  return 0;
}

// gpt-oss's layer_types (checked by check_key), or transformers' default: sliding and full in
// turn from a sliding first; the sliding ones need sliding_window.
static int read_layer_types(Config *c) {
  int64_t layers = c->arch.layers;
  if ((c->sliding = calloc((size_t)layers, sizeof *c->sliding)) == NULL) return fail("out of memory");
  const cJSON *types = key(c, "layer_types");
  if (types && cJSON_GetArraySize(types) != (int)layers)
    return refuse(c, types, "it must name the type of each of the num_hidden_layers layers");
  int64_t l = 0;
  for (const cJSON *e = types ? types->child : NULL; e; e = e->next)
    c->sliding[l++] = strcmp(e->valuestring, "sliding_attention") == 0;
  bool any = false;
  for (l = 0; l < layers; l++) {
    if (!types) c->sliding[l] = (l + 1) % 2 != 0;
    any |= c->sliding[l];
  }
  if (any && !cJSON_IsNumber(key(c, "sliding_window")))
    return fail("%s: layer_types has sliding layers but \"sliding_window\" is not a number", c->path);
  return 0;
}

// The architecture (rt_hf_arch_of_config, shared with --export-hf), after every key is checked.
static int read_arch(Config *c, const char *text, int64_t seqlen) {
  RtHfArch *a = &c->arch;
  RtHfFamily family = a->family;
  c->theta = family == RT_HF_MIXTRAL ? 1e6 : family == RT_HF_GPT_OSS ? 1.5e5 : 1e4;   // the configs' defaults
  c->yarn_truncate = true;
  c->partial = c->scale = 1;
  c->n_group = c->topk_group = 1;
  c->interleave = is_deepseek(family);   // V2 always, V3's rope_interleave defaults to true
  int deferred = 0;
  for (const cJSON *v = c->json->child; v; v = v->next) {
    int r = check_key(c, v);
    if (r == 1) return 1;
    deferred |= r == 2;
  }
  bool mixtral = is_mixtral_like(family), glm = is_glm_like(family), deepseek = is_deepseek(family);
  bool oss = family == RT_HF_GPT_OSS;
  const char *required[] = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "num_experts_per_tok",
                            glm ? "n_routed_experts"
                            : mixtral || (family == RT_HF_QWEN3_MOE && !key(c, "num_experts")) ? "num_local_experts"
                                                                                               : "num_experts",
                            mixtral || family == RT_HF_OLMOE ? "intermediate_size" : "moe_intermediate_size"};
  for (size_t i = 0; i < sizeof required / sizeof *required; i++)
    if (need_count(c, required[i])) return 1;
  if (rt_hf_arch_of_config(text, a) != 0) return fail("%s: %s", c->path, rt_last_error());
  c->k = (int64_t)key(c, "num_experts_per_tok")->valuedouble;
  const cJSON *mp = key(c, "max_position_embeddings");
  c->max_positions = cJSON_IsNumber(mp) ? (int64_t)mp->valuedouble : 0;
  const cJSON *eps = key(c, "rms_norm_eps");
  c->eps = mixtral ? 1e-5 : 1e-6;   // Mixtral's and gpt-oss's default
  if (eps && (!cJSON_IsNumber(eps) || !(eps->valuedouble > 0))) return refuse(c, eps, "it must be a positive number");
  if (eps) c->eps = eps->valuedouble;
  const cJSON *tie = key(c, "tie_word_embeddings");
  if (tie && !cJSON_IsBool(tie)) return refuse(c, tie, "it must be true or false");
  c->tie = cJSON_IsTrue(tie);
  // transformers' load-balancing loss, when the objective has it: the configs' default
  // coefficients (OLMoE 0.01, the others 0.001) unless router_aux_loss_coef gives one.
  const cJSON *coef = key(c, "router_aux_loss_coef");
  c->aux_coef = family == RT_HF_OLMOE ? 0.01 : 0.001;
  if (coef && c->router_logits && !(cJSON_IsNumber(coef) && coef->valuedouble >= 0))
    return refuse(c, coef, "it must be a number of at least 0");
  if (coef && cJSON_IsNumber(coef)) c->aux_coef = coef->valuedouble;
  const cJSON *norm = key(c, "norm_topk_prob");
  if (norm && !cJSON_IsBool(norm)) return refuse(c, norm, "it must be true or false");
  // GLM-4.5's and DeepSeek-V3's default is true; DeepSeek-V2 never renormalises
  c->renormalize = family != RT_HF_DEEPSEEK_V2 && (mixtral || cJSON_IsTrue(norm) || (glm && !norm));   // gpt-oss: the
  // softmax of the k chosen logits, the renormalised softmax of all
  if (family == RT_HF_DEEPSEEK_V2 && !c->group_greedy) c->n_group = c->topk_group = 1;   // greedy: no groups
  if (family != RT_HF_QWEN3_MOE && !glm && !oss && a->embed % a->heads != 0)
    return fail("%s: hidden_size %lld is not a multiple of num_attention_heads %lld", c->path, (long long)a->embed,
                (long long)a->heads);
  if (a->heads % a->kv_heads != 0)
    return fail("%s: num_attention_heads %lld is not a multiple of num_key_value_heads %lld", c->path,
                (long long)a->heads, (long long)a->kv_heads);
  if ((deepseek ? a->rope : a->head_dim) % 2 != 0)
    return fail("%s: the head width %lld is odd; rotary positions need it even", c->path,
                (long long)(deepseek ? a->rope : a->head_dim));
  if (c->k > a->experts)
    return fail("%s: num_experts_per_tok %lld is more than the %lld experts", c->path, (long long)c->k,
                (long long)a->experts);
  if (glm) {
    bool dense = false;
    for (int64_t l = 0; l < a->layers; l++) dense |= a->dense[l];
    if (dense && need_count(c, "intermediate_size")) return 1;
    if (a->experts % c->n_group != 0 || c->topk_group > c->n_group || c->topk_group * (a->experts / c->n_group) < c->k ||
        (c->n_group > 1 && a->experts / c->n_group < 2))
      return fail("%s: n_group %lld and topk_group %lld do not fit %lld experts with num_experts_per_tok %lld (equal "
                  "groups of at least 2, the best topk_group of them holding k)", c->path, (long long)c->n_group,
                  (long long)c->topk_group, (long long)a->experts, (long long)c->k);
    int64_t turned = (int64_t)((double)(deepseek ? a->rope : a->head_dim) * c->partial);
    if (turned < 2 || turned % 2 != 0 || (deepseek && c->partial != 1))
      return fail("%s: partial_rotary_factor %g turns %lld of the %lld columns of a head; rope needs an even number%s",
                  c->path, c->partial, (long long)turned, (long long)a->head_dim, deepseek ? ", all of qk_rope_head_dim" : "");
  }
  if (deepseek) {
    if (a->kv_heads != a->heads)
      return fail("%s: num_key_value_heads %lld is not num_attention_heads %lld: DeepSeek's latent attention gives every "
                  "head its keys and values", c->path, (long long)a->kv_heads, (long long)a->heads);
    if (a->v > a->nope + a->rope)
      return fail("%s: v_head_dim %lld is wider than qk_nope_head_dim + qk_rope_head_dim = %lld, which moec's mla does "
                  "not take", c->path, (long long)a->v, (long long)(a->nope + a->rope));
    const cJSON *hd = key(c, "head_dim"), *qk = key(c, "qk_head_dim");
    if (hd && !cJSON_IsNull(hd) && !(cJSON_IsNumber(hd) && hd->valuedouble == (double)a->rope))
      return refuse(c, hd, "DeepSeek's rotary heads are qk_rope_head_dim wide");
    if (qk && !(cJSON_IsNumber(qk) && qk->valuedouble == (double)(a->nope + a->rope)))
      return refuse(c, qk, "it is qk_nope_head_dim + qk_rope_head_dim");
  }
  if (family == RT_HF_QWEN3_MOE) {
    bool dense = false;
    for (int64_t l = 0; l < a->layers; l++) dense |= a->dense[l];
    if (dense && need_count(c, "intermediate_size")) return 1;
  }
  if (family == RT_HF_QWEN2_MOE) {
    bool dense = false;
    for (int64_t l = 0; l < a->layers; l++) dense |= a->dense[l];
    if (a->shared_hidden <= 0 && need_count(c, "shared_expert_intermediate_size")) return 1;
    if (dense && need_count(c, "intermediate_size")) return 1;
    const cJSON *step = key(c, "decoder_sparse_step");
    if (step && !(cJSON_IsNumber(step) && step->valuedouble >= 1 && step->valuedouble == floor(step->valuedouble)))
      return refuse(c, step, "it must be a whole number of at least 1");
  }
  if (oss && read_layer_types(c) != 0) return 1;
  if (deferred) {
    const cJSON *hd = key(c, "head_dim");
    if (!glm && !oss && hd && !cJSON_IsNull(hd) && !(cJSON_IsNumber(hd) && hd->valuedouble * (double)a->heads == (double)a->embed))
      return refuse(c, hd, "moec's attention heads here are hidden_size / num_attention_heads wide");
    const cJSON *sw = key(c, "sliding_window");
    if (sw && cJSON_IsNumber(sw) && sw->valuedouble < (double)seqlen) c->window = (int64_t)sw->valuedouble;
  }
  return 0;
}

static char *read_text(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  char *text = NULL;
  size_t size = 0, cap = 0, n;
  char buf[65536];
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) {
    if (size + n + 1 > cap) {
      cap = 2 * (size + n + 1);
      char *t = realloc(text, cap);
      if (!t) {
        free(text);
        fclose(f);
        return NULL;
      }
      text = t;
    }
    memcpy(text + size, buf, n);
    size += n;
  }
  fclose(f);
  if (!text) text = calloc(1, 1);
  else text[size] = '\0';
  return text;
}

static int read_config(const Options *o, Config *c, int64_t *seqlen) {
  char path[4096];
  snprintf(path, sizeof path, "%s/config.json", o->dir);
  c->path = strdup(path);
  char *text = read_text(path);
  if (!text) return fail("cannot read '%s': %s", path, strerror(errno));
  c->json = cJSON_Parse(text);
  int status = 0;
  const cJSON *type = cJSON_IsObject(c->json) ? key(c, "model_type") : NULL;
  if (!cJSON_IsObject(c->json)) status = fail("'%s' is not a JSON object", path);
  else if (!cJSON_IsString(type)) status = fail("%s: \"model_type\" is missing; it names the family", path);
  else if (!rt_hf_family_of(type->valuestring, &c->arch.family))
    status = fail("%s: model_type \"%s\" is not a family moec reads (it reads mixtral, qwen2_moe, qwen3_moe, olmoe, "
                  "glm4_moe, deepseek_v2, deepseek_v3 and gpt_oss)",
                  path, type->valuestring);
  if (status == 0) {
    const cJSON *mp = key(c, "max_position_embeddings");
    int64_t most = cJSON_IsNumber(mp) && mp->valuedouble >= 1 ? (int64_t)mp->valuedouble : 128;
    if (*seqlen == 0) *seqlen = most < 128 ? most : 128;
    status = read_arch(c, text, *seqlen);
  }
  if (status == 0 && c->max_positions > 0 && *seqlen > c->max_positions)
    status = fail("--seqlen %lld is longer than the checkpoint's max_position_embeddings %lld", (long long)*seqlen,
                  (long long)c->max_positions);
  free(text);
  return status;
}

// ---- the weights ----

// Older checkpoints carry rotary tables as buffers; they are computed, not learned.
static bool derived(const char *name) {
  size_t n = strlen(name);
  return n > 24 && strcmp(name + n - 24, ".rotary_emb.inv_freq") == 0;
}

// GLM-4.5's and DeepSeek-V3's multi-token-prediction layers: decoder layers from num_hidden_layers on,
// which transformers neither builds nor loads (its _keys_to_ignore_on_load_unexpected).
static bool prediction_layer(const Config *c, const char *name) {
  long long l;
  int at = 0;
  return is_glm_like(c->arch.family) && sscanf(name, "model.layers.%lld.%n", &l, &at) == 1 && at > 0 &&
         l >= c->arch.layers;
}

// Every moec parameter of the table, whole, filled from the checkpoint (F32).
static int convert(const Config *c, const RtStSet *set, const char *dir, const char *out_path) {
  RtHfTensor *t = NULL;
  int n = rt_hf_tensors(&c->arch, &t);
  if (n < 0) return fail("%s", rt_last_error());
  bool *used = calloc((size_t)set->ntensors, sizeof *used);
  RtStTensor *out = calloc((size_t)n, sizeof *out);
  float **data = calloc((size_t)n, sizeof *data);
  int64_t(*dims)[3] = calloc((size_t)n, sizeof *dims);
  float *tmp = NULL;
  int nout = 0, status = used && out && data && dims ? 0 : fail("out of memory");
  for (int i = 0; status == 0 && i < n; i++) {
    const RtStEntry *e = rt_st_set_find(set, t[i].hf);
    if (!e) {
      status = fail("%s: the checkpoint has no tensor '%s' (a %s with this config.json has one)", dir, t[i].hf,
                    rt_hf_family_name(c->arch.family));
      break;
    }
    for (int k = 0; k < set->ntensors; k++)
      if (set->by_name[k] == e) used[k] = true;
    int64_t numel = rt_hf_numel(&t[i]);
    bool same = e->rank == t[i].rank;
    for (int d = 0; same && d < t[i].rank; d++) same = e->dims[d] == t[i].dims[d];
    if (!same) {
      char want[64], got[64];
      status = fail("%s: tensor '%s' is %s; config.json makes it %s", dir, t[i].hf, rt_shape_str(got, sizeof got, e->rank, e->dims),
                    rt_shape_str(want, sizeof want, t[i].rank, t[i].dims));
      break;
    }
    // The moec parameter of this entry: a new one, or the one of the previous entry (experts).
    int j = nout - 1;
    if (j < 0 || strcmp(out[j].name, t[i].moec) != 0) {
      j = nout++;
      int rank = rt_hf_moec_dims(&c->arch, &t[i], dims[j]);
      int64_t total = 1;
      for (int d = 0; d < rank; d++) total *= dims[j][d];
      data[j] = malloc((size_t)total * sizeof(float));
      if (!data[j]) {
        status = fail("out of memory for '%s'", t[i].moec);
        break;
      }
      out[j] = (RtStTensor){.name = t[i].moec, .rank = rank, .dims = dims[j], .data = data[j]};
    }
    free(tmp);
    tmp = malloc((size_t)numel * sizeof(float));
    if (!tmp) {
      status = fail("out of memory for '%s'", t[i].hf);
      break;
    }
    rt_st_copy(e, tmp);
    rt_hf_to_moec(&t[i], tmp, data[j]);
  }
  int skipped = 0;
  for (int k = 0; status == 0 && k < set->ntensors; k++)
    skipped += !used[k] && prediction_layer(c, set->by_name[k]->name);
  if (skipped > 0)
    printf("# moec import-hf: %d tensors of the multi-token-prediction layers (model.layers.%lld and on) not read: "
           "transformers does not load them either\n", skipped, (long long)c->arch.layers);
  for (int k = 0; status == 0 && k < set->ntensors; k++)
    if (!used[k] && !derived(set->by_name[k]->name) && !prediction_layer(c, set->by_name[k]->name))
      status = fail("%s: tensor '%s' is not part of a %s with this config.json; refusing rather than ignoring it", dir,
                    set->by_name[k]->name, rt_hf_family_name(c->arch.family));
  if (status == 0) {
    static const char *const meta[] = {"format", "moec-weights", "source", "moec import-hf"};
    if (rt_st_write(out_path, nout, out, 2, meta) != 0) status = fail("%s", rt_last_error());
  }
  for (int j = 0; data && j < nout; j++) free(data[j]);
  free(tmp);
  free(data);
  free(dims);
  free(out);
  free(used);
  free(t);
  return status;
}

// ---- the .moe file ----

static void default_name(const char *dir, char *out, size_t n) {
  char buf[512];
  snprintf(buf, sizeof buf, "%s", dir);
  size_t len = strlen(buf);
  while (len > 1 && buf[len - 1] == '/') buf[--len] = '\0';
  const char *base = strrchr(buf, '/');
  base = base ? base + 1 : buf;
  size_t k = 0;
  for (const char *s = base; *s && k + 1 < n; s++) out[k++] = isalnum((unsigned char)*s) ? *s : '_';
  out[k] = '\0';
  if (k == 0 || isdigit((unsigned char)out[0])) snprintf(out, n, "imported");
}

// The layers as runs of one kind (MoE, dense, or gpt-oss's MoE with a sliding window), each a
// `layer NAME x N` group: "moe", "dense", "slide", then "moeb", "denseb", ... (a name ending in a
// letter, so that NAME + index is unique); the instance of decoder layer l is its group's name and
// its index in the group.
typedef struct Run {
  bool dense, sliding;
  int64_t first, count;
  char name[16];
} Run;

static int runs_of(const Config *c, Run *runs) {
  const RtHfArch *a = &c->arch;
  int n = 0, seen[3] = {0, 0, 0};
  for (int64_t l = 0; l < a->layers; l++) {
    bool dense = a->dense && a->dense[l], sliding = c->sliding && c->sliding[l];
    if (n > 0 && runs[n - 1].dense == dense && runs[n - 1].sliding == sliding) {
      runs[n - 1].count++;
      continue;
    }
    Run *r = &runs[n++];
    *r = (Run){.dense = dense, .sliding = sliding, .first = l, .count = 1};
    int kind = sliding ? 2 : dense, k = seen[kind]++;
    char suffix[8] = "";
    if (k > 0) {   // b, c, ..., z, ba, bb, ...
      char tmp[8];
      int len = 0;
      for (int v = k; v > 0 && len < 6; v /= 26) tmp[len++] = (char)('a' + v % 26);
      for (int i = 0; i < len; i++) suffix[i] = tmp[len - 1 - i];
      suffix[len] = '\0';
    }
    snprintf(r->name, sizeof r->name, "%s%s", sliding ? "slide" : dense ? "dense" : "moe", suffix);
  }
  return n;
}

static void attention_line(FILE *f, const Config *c, const Run *r) {
  const RtHfArch *a = &c->arch;
  if (a->mla) {
    fprintf(f, "  attention { heads %lld; bias %s; mla { ", (long long)a->heads, a->o_bias ? "true" : "false");
    if (a->q_lora > 0) fprintf(f, "q_lora %lld; ", (long long)a->q_lora);
    fprintf(f, "kv_lora %lld; nope %lld; rope %lld; v %lld; }", (long long)a->kv_lora, (long long)a->nope,
            (long long)a->rope, (long long)a->v);
    if (c->window > 0) fprintf(f, " window %lld;", (long long)c->window);
    fprintf(f, " }\n");
    return;
  }
  fprintf(f, "  attention { heads %lld; kv_heads %lld; bias %s;", (long long)a->heads, (long long)a->kv_heads,
          a->o_bias ? "true" : a->qkv_bias ? "qkv" : "false");
  if (a->head_dim * a->heads != a->embed) fprintf(f, " head_dim %lld;", (long long)a->head_dim);
  if (a->qk_norm) fprintf(f, " qk_norm %s;", a->qk_norm == 1 ? "head" : "whole");
  if (c->window > 0 && (!c->sliding || r->sliding)) fprintf(f, " window %lld;", (long long)c->window);
  if (a->sinks) fprintf(f, " sinks true;");
  fprintf(f, " }\n");
}

static int write_moe(const Options *o, const Config *c, int64_t seqlen, const char *moe_path, const char *weights_path,
                     int nfiles, const Run *runs, int nruns) {
  char name[128];
  if (o->name) snprintf(name, sizeof name, "%s", o->name);
  else default_name(o->dir, name, sizeof name);
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp", moe_path);
  FILE *f = fopen(tmp, "w");
  if (!f) return fail("cannot write '%s': %s", tmp, strerror(errno));
  const RtHfArch *a = &c->arch;
  fprintf(f,
          "# Imported by `moec import-hf` from %s (%s: config.json and %d safetensors file%s).\n"
          "# Its weights, in moec's names: %s; train from them with `BIN --weights %s`.\n"
          "# As transformers computes it: dropless routing (capacity *), the k chosen %s scores%s,\n"
          "# %s, no router noise.\n",
          o->dir, rt_hf_family_name(a->family), nfiles, nfiles == 1 ? "" : "s", weights_path, weights_path,
          a->correction_bias ? "sigmoid" : "softmax", c->renormalize ? " renormalised" : " as they are (not renormalised)",
          c->router_logits ? "its load-balancing loss pooled over the layers (output_router_logits is true: aux pooled)"
                           : "no aux loss in the objective (output_router_logits is false)");
  fprintf(f, "model %s {\n  dtype fp32; batch %lld; seqlen %lld; embed %lld; seed 1;\n  vocab %lld;\n", name,
          (long long)o->batch, (long long)seqlen, (long long)a->embed, (long long)a->vocab);
  char b1[40], b2[40];
  fprintf(f, "  position rope { theta %s;", fe_float_text(c->theta, b1, sizeof b1));
  if (c->partial != 1) fprintf(f, " partial %s;", fe_float_text(c->partial, b1, sizeof b1));
  if (c->interleave) fprintf(f, " interleave true;");
  if (c->yarn) {
    fprintf(f, "\n    yarn { factor %s; original %lld;", fe_float_text(c->yarn_factor, b1, sizeof b1),
            (long long)c->yarn_original);
    fprintf(f, " beta_fast %s; beta_slow %s;", fe_float_text(c->yarn_beta_fast, b1, sizeof b1),
            fe_float_text(c->yarn_beta_slow, b2, sizeof b2));
    if (c->yarn_mscale > 0) fprintf(f, " mscale %s;", fe_float_text(c->yarn_mscale, b1, sizeof b1));
    if (c->yarn_mscale_all_dim > 0) fprintf(f, " mscale_all_dim %s;", fe_float_text(c->yarn_mscale_all_dim, b1, sizeof b1));
    if (!c->yarn_truncate) fprintf(f, " truncate false;");
    fprintf(f, " }\n ");
  }
  fprintf(f, " }\n  norm rmsnorm { eps %s; }\n  tie_embeddings %s;\n", fe_float_text(c->eps, b2, sizeof b2),
          c->tie ? "true" : "false");
  fprintf(f, "  optimizer %s { lr %s; }\n", o->optimizer, fe_float_text(o->lr, b1, sizeof b1));
  if (o->lora_line[0])
    fprintf(f, "  # LoRA: the weights frozen, adapters trained; --export-hf writes them as a PEFT adapter\n  %s\n", o->lora_line);
  fprintf(f, "}\n");
  const char *base = strrchr(o->prefix, '/');
  fprintf(f, "# The checkpoint's config.json (and generation_config.json): --export-hf keeps every key the\n"
             "# model does not set.\nhf_config \"%s.hf\";\n", base ? base + 1 : o->prefix);
  for (int i = 0; i < nruns; i++) {
    const Run *r = &runs[i];
    fprintf(f, "\n# decoder layers %lld..%lld\nlayer %s x %lld {\n", (long long)r->first, (long long)(r->first + r->count - 1),
            r->name, (long long)r->count);
    attention_line(f, c, r);
    if (r->dense) {
      fprintf(f, "  mlp { ffn mixtral { hidden %lld; } }\n}\n", (long long)a->dense_hidden);
      continue;
    }
    fprintf(f, "  moe {\n    experts %lld { ffn %s { hidden %lld; } }\n", (long long)a->experts, a->sinks ? "oss" : "mixtral",
            (long long)a->hidden);
    if (a->correction_bias) {   // DeepSeek-V3's router: the correction bias stays as imported (rate 0)
      fprintf(f, "    # the checkpoint's e_score_correction_bias steers the choice; 'balance bias 0' keeps it fixed\n"
                 "    # as transformers does (DeepSeek-V3 pretrained with 'balance bias 0.001')\n");
      fprintf(f, "    gate sigmoid { k %lld; capacity *; renormalize %s;", (long long)c->k, c->renormalize ? "true" : "false");
      if (c->n_group > 1) fprintf(f, " expert_groups %lld; topk_groups %lld;", (long long)c->n_group, (long long)c->topk_group);
      if (c->scale != 1) fprintf(f, " scale %s;", fe_float_text(c->scale, b1, sizeof b1));
      fprintf(f, " balance bias 0; }\n");
    } else {
      fprintf(f, "    gate gshard { k %lld; capacity *; renormalize %s;%s", (long long)c->k, c->renormalize ? "true" : "false",
              a->sinks ? " bias true;" : "");   // gpt-oss's router has a bias
      if (c->n_group > 1)   // DeepSeek-V2's group_limited_greedy
        fprintf(f, " expert_groups %lld; topk_groups %lld; group_score max;", (long long)c->n_group, (long long)c->topk_group);
      if (c->scale != 1) fprintf(f, " scale %s;", fe_float_text(c->scale, b1, sizeof b1));
      if (c->router_logits) fprintf(f, " aux_loss %s; aux pooled;", fe_float_text(c->aux_coef, b1, sizeof b1));
      fprintf(f, " }\n");
    }
    if (a->shared_hidden > 0)
      fprintf(f, "    shared { ffn mixtral { hidden %lld; }%s }\n", (long long)a->shared_hidden, a->shared_gate ? " gate sigmoid;" : "");
    fprintf(f, "  }\n}\n");
  }
  return rt_commit_file(f, !ferror(f), tmp, moe_path) == 0 ? 0 : fail("%s", rt_last_error());
}

// --lora R [--lora-alpha A] [--lora-targets LIST]: the model's `lora` block (lang/manual.md §7.3)
// into o->lora_line. LIST: words of q k v o experts shared mlp, each once, between commas or
// spaces; the default q k v o experts. A target the checkpoint has no weights for is refused, and
// so is k or v alone with DeepSeek's latent attention, whose kv_a_proj_with_mqa and kv_b_proj
// make both (frontend/check.c refuses the block so).
static int lora_line(Options *o, const Config *c) {
  static const char *const words[] = {"q", "k", "v", "o", "experts", "shared", "mlp"};
  const RtHfArch *a = &c->arch;
  if (!o->lora) return 0;
  const char *list = o->lora_targets ? o->lora_targets : "q k v o experts";
  bool seen[7] = {false}, dense = false;
  for (int64_t l = 0; a->dense && l < a->layers; l++) dense |= a->dense[l];
  char word[64], targets[96] = "";
  for (const char *s = list; *s;) {
    size_t n = strcspn(s, ", ");
    if (n == 0) {
      s++;
      continue;
    }
    snprintf(word, sizeof word, "%.*s", (int)(n < 63 ? n : 63), s);
    s += n;
    int k = 0;
    while (k < 7 && strcmp(words[k], word) != 0) k++;
    if (k == 7)
      return fail("--lora-targets: unknown target '%s': the targets are q, k, v, o, experts, shared and mlp", word);
    if (seen[k]) return fail("--lora-targets: target '%s' given twice", word);
    if (k == 5 && a->shared_hidden == 0)
      return fail("--lora-targets shared: %s (%s) has no shared expert", o->dir, rt_hf_family_name(a->family));
    if (k == 6 && !dense)
      return fail("--lora-targets mlp: %s (%s) has no dense layers", o->dir, rt_hf_family_name(a->family));
    seen[k] = true;
  }
  if (a->mla && seen[1] != seen[2])
    return fail("--lora-targets %s without %s: %s (%s) has latent attention, whose kv_a_proj_with_mqa and kv_b_proj "
                "make the keys and the values alike; k and v adapt them together: give both, or neither",
                seen[1] ? "k" : "v", seen[1] ? "v" : "k", o->dir, rt_hf_family_name(a->family));
  for (int k = 0; k < 7; k++)
    if (seen[k]) snprintf(targets + strlen(targets), sizeof targets - strlen(targets), " %s", words[k]);
  if (!targets[0]) return fail("--lora-targets '%s' names no target: the targets are q, k, v, o, experts, shared and mlp", list);
  char b1[40];
  snprintf(o->lora_line, sizeof o->lora_line, "lora { r %lld; alpha %s; targets%s; }", (long long)o->lora,
           fe_float_text(o->lora_alpha, b1, sizeof b1), targets);
  return 0;
}

// PREFIX.hf/: the checkpoint's config.json and generation_config.json (where it has one) as they
// are, which the .moe's `hf_config` names: --export-hf writes every key the model does not
// determine from them; and adapter_config.json naming the checkpoint (base_model_name_or_path,
// DIR as given), which a LoRA model's --export-hf writes with its adapter's keys.
static int keep_configs(const Options *o, const char *dir) {
  if (rt_make_dirs(dir) != 0) return fail("%s", rt_last_error());
  static const char *const files[] = {"config.json", "generation_config.json"};
  for (int i = 0; i < 2; i++) {
    char from[4200], to[4200], tmp[4300];
    snprintf(from, sizeof from, "%s/%s", o->dir, files[i]);
    snprintf(to, sizeof to, "%s/%s", dir, files[i]);
    snprintf(tmp, sizeof tmp, "%s.tmp", to);
    errno = 0;
    char *text = read_text(from);
    if (!text && i == 1 && errno == ENOENT) {
      remove(to);   // an earlier import's
      continue;
    }
    if (!text) return fail("cannot read '%s': %s", from, strerror(errno ? errno : EIO));
    FILE *f = fopen(tmp, "w");
    if (!f) {
      free(text);
      return fail("cannot write '%s': %s", tmp, strerror(errno));
    }
    bool ok = fputs(text, f) >= 0;
    free(text);
    if (rt_commit_file(f, ok, tmp, to) != 0) return fail("%s", rt_last_error());
  }
  char to[4200], tmp[4300];
  snprintf(to, sizeof to, "%s/adapter_config.json", dir);
  snprintf(tmp, sizeof tmp, "%s.tmp", to);
  cJSON *adapter = cJSON_CreateObject();
  cJSON_AddStringToObject(adapter, "base_model_name_or_path", o->dir);
  char *text = cJSON_Print(adapter);
  cJSON_Delete(adapter);
  FILE *f = text ? fopen(tmp, "w") : NULL;
  if (!f) {
    free(text);
    return fail("cannot write '%s': %s", tmp, strerror(errno ? errno : ENOMEM));
  }
  bool ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF;
  free(text);
  if (rt_commit_file(f, ok, tmp, to) != 0) return fail("%s", rt_last_error());
  return 0;
}

int cli_import_hf(int argc, char **argv) {
  for (int i = 2; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      cli_import_hf_usage(stdout);
      return 0;
    }
  Options o;
  if (!parse_options(argc, argv, &o)) return 2;
  Config c = {0};
  int64_t seqlen = o.seqlen;
  int status = read_config(&o, &c, &seqlen);
  if (status == 0) status = lora_line(&o, &c);
  RtStSet set = {0};
  if (status == 0 && rt_st_open(o.dir, &set) != 0) status = fail("%s", rt_last_error());
  char moe_path[4096], weights_path[4096];
  snprintf(moe_path, sizeof moe_path, "%s.moe", o.prefix);
  snprintf(weights_path, sizeof weights_path, "%s.safetensors", o.prefix);
  Run *runs = status == 0 ? calloc((size_t)c.arch.layers, sizeof *runs) : NULL;
  int nruns = 0;
  if (status == 0) {
    c.arch.inst = calloc((size_t)c.arch.layers, sizeof *c.arch.inst);
    if (!runs || !c.arch.inst) status = fail("out of memory");
  }
  if (status == 0) {
    nruns = runs_of(&c, runs);
    for (int i = 0; i < nruns; i++)
      for (int64_t j = 0; j < runs[i].count; j++) {
        char buf[48];
        snprintf(buf, sizeof buf, "%s%lld", runs[i].name, (long long)j);
        c.arch.inst[runs[i].first + j] = strdup(buf);
      }
    status = convert(&c, &set, o.dir, weights_path);
  }
  char hf_dir[4096];
  snprintf(hf_dir, sizeof hf_dir, "%s.hf", o.prefix);
  if (status == 0) status = keep_configs(&o, hf_dir);
  if (status == 0) status = write_moe(&o, &c, seqlen, moe_path, weights_path, set.nfiles, runs, nruns);
  free(runs);
  if (status == 0)
    printf("# moec import-hf: %s (%s, %lld layers, %lld experts, vocab %lld) -> %s, %s, %s/\n", o.dir,
           rt_hf_family_name(c.arch.family), (long long)c.arch.layers, (long long)c.arch.experts,
           (long long)c.arch.vocab, moe_path, weights_path, hf_dir);
  rt_st_set_free(&set);
  rt_hf_arch_free(&c.arch);
  free(c.sliding);
  cJSON_Delete(c.json);
  free((char *)c.path);
  return status;
}
