// The registries of gates and experts: one row each. A new gate is a file with its lowering
// (gate_NAME.c, see fe_lower.h) plus a row here naming the gate fields it accepts; the
// checker's word lists, "did you mean" hints and per-gate field checks all come from this table.
#include <string.h>

#include "fe_lower.h"

#define F(x) FE_GATE_FIELD(FE_GATE_F_##x)
#define TOKEN_CHOICE (F(K) | F(CAPACITY) | F(NOISE) | F(AUX) | F(Z) | F(GROUPS))
#define SOFTMAX_TOP_K (TOKEN_CHOICE | F(RENORM))   // token choice over a softmax: `renormalize`
#define LIMITED (F(EXPERT_GROUPS) | F(TOPK_GROUPS) | F(GROUP_SCORE) | F(SCALE) | F(BALANCE))   // DeepSeek's choice

const FeGateDef fe_gates[] = {
    {"gshard", SOFTMAX_TOP_K | F(AUX_FORM) | F(BIAS) | LIMITED, "noisy top-k softmax (k 1 is Switch)", fe_gate_gshard},
    {"sigmoid", TOKEN_CHOICE | F(RENORM) | F(AUX_FORM) | F(BIAS) | LIMITED, "top-k of sigmoid scores, outputs scaled by the score (BASE/StableMoE)", fe_gate_sigmoid},
    {"xmoe", SOFTMAX_TOP_K | F(PROJ), "cosine routing in a low-rank space with a learned temperature", fe_gate_xmoe},
    {"expert_choice", F(K) | F(CAPACITY) | F(NOISE) | F(Z) | F(GROUPS), "each expert takes its top-T tokens", fe_gate_expert_choice},
    {"softmoe", F(SLOTS), "soft dispatch and combine weights over expert slots", fe_gate_softmoe},
};
const int fe_gate_count = sizeof fe_gates / sizeof fe_gates[0];

const FeExpertDef fe_experts[] = {
    {"gpt", fe_expert_gpt},
    {"mixtral", fe_expert_mixtral},
    {"oss", fe_expert_oss},
};
const int fe_expert_count = sizeof fe_experts / sizeof fe_experts[0];

const FeGateDef *fe_gate_find(const char *name) {
  for (int i = 0; i < fe_gate_count; i++)
    if (strcmp(fe_gates[i].name, name) == 0) return &fe_gates[i];
  return NULL;
}

const FeExpertDef *fe_expert_find(const char *name) {
  for (int i = 0; i < fe_expert_count; i++)
    if (strcmp(fe_experts[i].name, name) == 0) return &fe_experts[i];
  return NULL;
}

const char *fe_gate_words[FE_MAX_REGISTERED + 1];
const char *fe_expert_words[FE_MAX_REGISTERED + 1];

void fe_registry_init(void) {
  for (int i = 0; i < fe_gate_count && i < FE_MAX_REGISTERED; i++) fe_gate_words[i] = fe_gates[i].name;
  for (int i = 0; i < fe_expert_count && i < FE_MAX_REGISTERED; i++) fe_expert_words[i] = fe_experts[i].name;
}
