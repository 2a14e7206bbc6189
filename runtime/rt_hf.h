// Hugging Face checkpoints (runtime/hf.c, lang/manual.md §19): the table of which moec parameter each
// tensor of a family's checkpoint is, used by `moec import-hf` and a binary's --export-hf.
#ifndef RT_HF_H
#define RT_HF_H

#include <stdbool.h>
#include <stdint.h>

#include "moert.h"

typedef enum RtHfFamily {
  RT_HF_MIXTRAL, RT_HF_QWEN2_MOE, RT_HF_QWEN3_MOE, RT_HF_OLMOE, RT_HF_GLM4_MOE, RT_HF_DEEPSEEK_V2, RT_HF_DEEPSEEK_V3,
  RT_HF_GPT_OSS
} RtHfFamily;

// What a checkpoint's tensors depend on. Per decoder layer l: inst[l], its moec layer instance
// ("block3"), and dense[l], a dense SwiGLU mlp of dense_hidden instead of the MoE (NULL: none).
typedef struct RtHfArch {
  RtHfFamily family;
  int64_t layers, vocab, embed, heads, kv_heads, head_dim, experts, hidden;
  int64_t dense_hidden;    // the dense layers' intermediate size
  int64_t shared_hidden;   // a shared expert's (0: none)
  bool shared_gate;        // the shared expert's output scaled by sigmoid(x·w)
  bool correction_bias;    // the router's e_score_correction_bias (moec's `balance bias`: moe.gate.eb)
  bool qkv_bias;           // biases on q, k and v
  bool o_bias;             // and on o (Qwen3-MoE's and OLMoE's attention_bias)
  int qk_norm;             // RMSNorm of q and k: 0 none, 1 per head (over head_dim), 2 over the whole width
  bool tie;                // no lm_head: the head is the embedding
  bool sinks;              // gpt-oss: attention sinks (self_attn.sinks), experts with biases and the gate and up
                           // projections in one tensor, a router with a bias
  // DeepSeek's multi-head latent attention (moec's `mla`): q_lora 0 for one q projection; its
  // biases (attention_bias) on the down projections and o (o_bias)
  bool mla;
  int64_t q_lora, kv_lora, nope, rope, v;
  char **inst;
  bool *dense;
} RtHfArch;

enum { RT_HF_NAME = 192 };

// One tensor of the family's checkpoint: the moec parameter it is, or expert `expert`'s slice
// along the parameter's first dimension (-1: the whole parameter), transposed or not (rank 2);
// its shape in the checkpoint is dims[0..rank). pick 1 (2): the parameter is the even (odd)
// columns of the tensor's last dimension (gpt-oss's gate_up_proj holds gate and up interleaved);
// two consecutive entries then name one tensor.
typedef struct RtHfTensor {
  char hf[RT_HF_NAME];
  char moec[RT_HF_NAME];
  int64_t expert;
  bool transpose;
  int pick;
  int rank;
  int64_t dims[3];
} RtHfTensor;

const char *rt_hf_family_name(RtHfFamily f);
// The family's tensors, in the order the checkpoint lists them (*out malloc'ed): their number,
// or -1 (rt_fail).
int rt_hf_tensors(const RtHfArch *a, RtHfTensor **out);
// The moec parameter's whole shape for entry t (its rank; dims holds up to 3).
int rt_hf_moec_dims(const RtHfArch *a, const RtHfTensor *t, int64_t *dims);
// The elements of entry t's tensor in the checkpoint.
int64_t rt_hf_numel(const RtHfTensor *t);
// Entry t of the checkpoint from the whole moec parameter, and back.
void rt_hf_from_moec(const RtHfTensor *t, const float *moec, float *hf);
void rt_hf_to_moec(const RtHfTensor *t, const float *hf, float *moec);
// The architecture of a config.json moec wrote (RtModel.hf_config); inst is left NULL.
int rt_hf_arch_of_config(const char *json, RtHfArch *a);
void rt_hf_arch_free(RtHfArch *a);   // frees inst[] and dense (NULL allowed)
// The family of a config.json's model_type ("mixtral", ...); false when none.
bool rt_hf_family_of(const char *model_type, RtHfFamily *f);
// Writes DIR/config.json (m->hf_config), DIR/generation_config.json (m->hf_generation, where there
// is one) and DIR/model.safetensors (F32, the family's names) from
// whole[i], the whole tensor of parameter i of m. A LoRA model (m->hf_adapter) writes its
// adapters in PEFT's form instead (DIR/adapter_config.json and DIR/adapter_model.safetensors),
// or with merge the full checkpoint of its weights with the adapters merged in (W + (alpha/r)·A·B).
// 0, or -1 (rt_fail) with a sentence.
int rt_hf_export(const RtModel *m, float *const *whole, const char *dir, bool merge);

// ---- LoRA adapters in PEFT's form (lang/manual.md §19) ----
// One tensor of a PEFT adapter_model.safetensors: lora_A or lora_B of a dense weight (a module of
// target_modules: lora_A.weight [r, in] and lora_B.weight [out, r] are moec's W.lora_A [in, r] and
// W.lora_B [r, out] transposed) or of the experts' stacked tensor (target_parameters, PEFT's
// ParamWrapper: lora_A [r·E, in] read as [E, r, in], lora_B [out, r·E] read as [out, r, E], the
// expert index the fast one; moec's [E, in, r] and [E, r, out]). transformers keeps the experts'
// gate and up projections in one tensor (gate_up_proj: the gate's rows first, or gpt-oss's
// interleaved), whose one lora_A is moec's w1.lora_A (w3 shares it) and whose lora_B holds
// w1.lora_B's and w3.lora_B's rows (moec[0] and moec[1]).
typedef struct RtHfAdapter {
  char peft[RT_HF_NAME + 64];   // base_model.model.<module>.lora_A.weight
  char moec[2][RT_HF_NAME + 16];   // the moec parameter(s) (moec[1] empty but for a fused lora_B)
  bool b;                       // lora_B (else lora_A)
  bool experts;                 // of the experts' stacked tensor
  int fused;                    // lora_B of gate_up_proj: 1 the rows by halves (gate, up), 2 interleaved
  int64_t E, r, in, out;        // out: one moec B's columns (a fused lora_B has 2·out rows)
  int64_t dims[2];              // its shape in the adapter
} RtHfAdapter;

// The adapters of LoRA model m (*out malloc'ed), in the family's order: their number, or -1 (rt_fail).
int rt_hf_adapters(const RtModel *m, RtHfAdapter **out);
// Entry t from the whole moec parameters moec[0] (and moec[1]), and back.
void rt_hf_adapter_from_moec(const RtHfAdapter *t, const float *const *moec, float *peft);
void rt_hf_adapter_to_moec(const RtHfAdapter *t, const float *peft, float *const *moec);
// --adapter DIR: DIR/adapter_config.json (a LoRA adapter whose r, lora_alpha and targets are the
// model's) and DIR/adapter_model.safetensors into this rank's shards of the adapters in params (of
// m, this rank's program; with pipeline stages, stages[0 .. nstages) are the whole model's, else
// NULL). 0, or -1 (rt_fail) with a sentence naming what differs.
struct RtRanks;
int rt_hf_adapter_load(const char *dir, const RtModel *m, const RtModel *const *stages, int nstages,
                       const struct RtRanks *r, float *params);

#endif
