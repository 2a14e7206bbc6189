// Lowering internals: the gate and expert registries and the helpers their lowerings share.
//
// A gate lowers x [S, M] into a routing (FeRouting): token-choice indices, slots and gate
// weights for the orders to encode and decode, or, for soft MoE, dense dispatch and combine
// weights. An expert lowers the dispatched tokens [E, C, M] into expert outputs [E, C, M].
// Adding a gate or an expert is one new file (frontend/gate_NAME.c, frontend/expert_NAME.c)
// with its lowering, plus one row in the table in frontend/registry.c; the checker takes the
// names and each gate's accepted fields from that table.
#ifndef FE_LOWER_H
#define FE_LOWER_H

#include "fe.h"

typedef struct FeLower {
  IrDiag *d;
  IrModule *m;
  IrFunc *f;
  const FeProgram *p;
  const FeLayer *layer;
  const char *inst;        // layer instance name: block0
  int64_t layer_index;     // global index of the MoE layer instance
  int64_t repeat;          // which repeat of its layer item the instance is (`layer x N`: 0..N-1)
  int64_t S, M, E, H, G;   // tokens, model dim, experts, expert hidden, routing groups
  int64_t stage_first, stage_end;   // the layer instances of the stage lowered: [first, end)
  // The last expert adapter's scaled x·A, its x and A: w3 shares w1's A, so its x·A is w1's
  IrValue *lora_x, *lora_t;
  const IrParam *lora_a;
} FeLower;

// Whether the stage lowered holds the embedding (the first) / the loss (the last).
static inline bool fe_first_stage(const FeLower *L) { return L->p->stage == 0; }
static inline bool fe_last_stage(const FeLower *L) { return L->p->stage == L->p->parallel.pp - 1; }
// A stage before the last: @loss.fwd(%out, %dout) = loss.link (the gradient of out comes from the
// next stage).
void fe_lower_link(FeLower *L);

// Adds the forward function of layer instance L->inst (attributes `item`, `repeat`) as L->f.
void fe_layer_func(FeLower *L);

typedef struct FeRouting {
  bool soft;               // soft MoE: dispatch/combine weights, no indices
  // token choice (soft == false): every token's K choices
  IrValue *idx;            // i32 [S, K] expert of each choice
  IrValue *loc;            // i32 [S, K] slot within the group's expert buffer, -1 dropped
  IrValue *gates;          // f32 [S, K] weight of each choice in the combine
  int64_t capacity;        // T: slots per group per expert (C = G*T)
  // soft MoE (soft == true): [S, E*N] weights; N slots per expert
  IrValue *dispatch, *combine;
  int64_t slots;
  // auxiliary losses (NULL when the gate has none), returned by the layer for the report
  IrValue *aux, *z;
} FeRouting;

typedef struct FeGateDef {
  const char *name;
  unsigned fields;         // bit (1 << FE_GATE_F_*) for every gate field the gate accepts
  const char *doc;         // one line for messages
  bool (*lower)(FeLower *L, IrValue *x, FeRouting *out);
} FeGateDef;

typedef struct FeExpertDef {
  const char *name;
  // disp [E, C, M] -> expert outputs [E, C, M]; creates the expert parameters.
  IrValue *(*lower)(FeLower *L, IrValue *disp);
} FeExpertDef;

extern const FeGateDef fe_gates[];
extern const int fe_gate_count;
extern const FeExpertDef fe_experts[];
extern const int fe_expert_count;
const FeGateDef *fe_gate_find(const char *name);
const FeExpertDef *fe_expert_find(const char *name);
// NULL-terminated name lists for the checker's schema, filled by fe_registry_init().
#define FE_MAX_REGISTERED 32
extern const char *fe_gate_words[FE_MAX_REGISTERED + 1];
extern const char *fe_expert_words[FE_MAX_REGISTERED + 1];
void fe_registry_init(void);

// ---- helpers (lower_ops.c) ----
#define FE_GATE_FIELD(f) (1u << (f))
// Appends op `kind` with operands (values or parameters) and attributes; the result (named
// `name`, NULL for none) gets the type shape inference gives it.
#define FE_V(v) ((IrOperand){.value = (v)})
#define FE_P(p) ((IrOperand){.param = (p)})
IrValue *fe_emit(FeLower *L, IrOpKind kind, const char *name, int nargs, const IrOperand *args,
                 int nattrs, const IrAttr *attrs);
// Common shapes of fe_emit.
IrValue *fe_op1(FeLower *L, IrOpKind kind, const char *name, IrOperand a);
IrValue *fe_op2(FeLower *L, IrOpKind kind, const char *name, IrOperand a, IrOperand b);
// The activation `act word` of x (the op of word's row in ir/activations.def), named name.
IrValue *fe_act(FeLower *L, const char *word, const char *name, IrValue *x);
// Integer and float attributes for fe_emit.
#define FE_I(k, v) ((IrAttr){.key = (k), .kind = IR_ATTR_INT, .i = (v)})
#define FE_F(k, v) ((IrAttr){.key = (k), .kind = IR_ATTR_FLOAT, .f = (v)})
IrParam *fe_param(FeLower *L, const char *suffix, IrType t, const char *init, double value);
// LoRA (`lora { ... }` in the model block): whether the weight of suffix (attn.wq, mlp.w1, ...) is
// one of the block's targets, and y + (alpha / r)·(x·A)·B with its adapters A [in, r] and B [r, out]
// (parameters W.lora_A, W.lora_B; the scale a frozen parameter W.lora_scale [r] of alpha / r,
// applied to x·A).
bool fe_lora_target(const FeLower *L, const char *suffix);
// Under MP (split_a, split_b: the mp_split of A and B, -1 none): W split by rows gives A its rows
// (x·A a partial sum that parallelize reduces before B), W split by columns gives B its columns
// (B's input, x·A, read through comm.copy); every rank then adds its part of W's output.
IrValue *fe_lora(FeLower *L, IrValue *x, IrValue *y, const IrParam *w, const char *name, int split_a, int split_b);
// x·W of the experts (expert.matmul) plus, with target `experts`, its per-expert adapters:
// A [E, in, r], B [E, r, out] (W.lora_A, W.lora_B, split over EP as W is), (x·A)·B scaled by
// alpha / r (expert.scale of x·A).
IrValue *fe_expert_linear(FeLower *L, const char *name, IrValue *x, IrParam *w);
// Every parameter not an adapter frozen (after the whole model is lowered).
void fe_lora_freeze(FeLower *L);
// An expert parameter: dimension 0 indexes experts (split over EP ranks), hidden_dim (or -1)
// the expert's hidden units (split over ESP ranks).
IrParam *fe_expert_param(FeLower *L, const char *suffix, IrType t, const char *init, double value,
                         int hidden_dim);
// The gshard-style tail shared by token-choice gates: top-k over scores, gate weights
// (renormalised when renorm), capacity locations, aux loss over scores, z loss over logits.
void fe_token_choice(FeLower *L, IrValue *logits, IrValue *scores, bool renorm, FeRouting *out);
// logits + training noise when the gate has `noise`.
IrValue *fe_noise(FeLower *L, IrValue *logits);
// The router's logits x·Wg [S, E] (parameter moe.gate.wg [M, E]), plus the learned bias
// moe.gate.bg [E] (initialised to zero) with `bias true`.
IrValue *fe_router_logits(FeLower *L, IrValue *x);
// Per-group capacity T of token choice with k choices per token.
int64_t fe_capacity(const FeLower *L, int64_t k);

// (lower_moe.c) The MoE of the current layer on x [S, M] without its residual: the combined expert outputs
// [S, M]; *aux and *z get the gate's auxiliary losses (NULL when it has none).
IrValue *fe_lower_moe(FeLower *L, IrValue *x, IrValue **aux, IrValue **z);
// A language model (lang/manual.md §7.2; frontend/lower_lm.c): @embed.fwd, one forward per layer
// instance, @loss.fwd with the final norm, the head and the cross-entropy.
void fe_lower_lm(FeLower *L);

bool fe_gate_gshard(FeLower *L, IrValue *x, FeRouting *out);
bool fe_gate_sigmoid(FeLower *L, IrValue *x, FeRouting *out);
bool fe_gate_xmoe(FeLower *L, IrValue *x, FeRouting *out);
bool fe_gate_expert_choice(FeLower *L, IrValue *x, FeRouting *out);
bool fe_gate_softmoe(FeLower *L, IrValue *x, FeRouting *out);
IrValue *fe_expert_gpt(FeLower *L, IrValue *disp);
IrValue *fe_expert_mixtral(FeLower *L, IrValue *disp);
IrValue *fe_expert_oss(FeLower *L, IrValue *disp);

#endif
