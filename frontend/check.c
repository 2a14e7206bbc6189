// The checker: a statement tree (from fe_parse) -> a typed FeProgram or FeCluster.
//
// The language's schema is data. A Block lists the statements (Fields) it accepts; a Field
// says how many values of which type follow its keyword, their ranges and defaults, where each
// goes in the C struct being filled (as offsets), whether the statement has a block and which
// Block that is, whether it is required or may repeat, and, for fields that only some variants
// have (`proj` only in `gate xmoe`), which variant. check_block() walks a block against its
// Block: unknown keywords (with "did you mean"), duplicates, wrong types, ranges, missing
// required fields. Statements whose shape does not fit the table (`layer NAME x N`, `hook`,
// `pipeline`, `grad_partition`) have a custom check function named in their Field.
//
// After the schema, check_semantics() applies the rules that tie fields together
// (dp*mp == ep*esp, experts % ep == 0, k <= experts, equal routing groups, ...). A rule runs
// only when the statements it reads checked cleanly, so one mistake gives one message.
//
// Every problem is reported and checking goes on, so one run lists all of a file's errors.
// Ownership: the FeProgram and everything in it live in the tree's arena; on success the
// program takes the tree (fe_program_free frees both), on failure the caller keeps the tree.
#include <ctype.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fe_internal.h"
#include "fe_lower.h"

// ---- the schema's types ----
typedef enum ValType {
  V_NONE,      // no value (end of a Field's value list)
  V_INT,       // integer literal
  V_NUM,       // integer or floating-point literal
  V_NUM_STAR,  // number or `*`
  V_WORD,      // one of Val.words
  V_BOOL,      // true | false
  V_IDENT,     // any identifier
  V_NAME,      // identifier usable inside parameter names: letters, digits, '_'
  V_STRING,    // "..."
} ValType;

typedef enum Range {
  R_ANY,
  R_POS,       // > 0 (integers: >= 1, and at most INT32_MAX)
  R_NONNEG,    // >= 0
  R_UNIT,      // in [0, 1)
} Range;

// Offsets into the struct being filled are stored plus one, so that 0 means "nowhere".
#define AT(T, f) (offsetof(T, f) + 1)
#define SAME 1  // a Field's block fills the same struct as the Block that holds the Field

typedef struct Val {
  ValType type;
  Range range;
  const char *what;            // V_WORD: what the word names, for messages ("gate")
  const char *const *words;    // V_WORD: the accepted words, NULL-terminated
  const char *def;             // default, written as in a source file; NULL: none
  size_t off;                  // AT(): where the value goes
  size_t loc_off;              // AT(): where its SrcLoc goes
  size_t star_off;             // AT(): V_NUM_STAR: the bool that `*` sets
} Val;

typedef struct Ctx Ctx;
typedef struct Field Field;
typedef struct Block Block;
// A statement that checks itself; dst is the struct of the block that holds it.
typedef void (*CheckFn)(Ctx *c, const FeNode *parent, const FeNode *n, char *dst);
// Runs after a block's statements are checked (variant-specific fix-ups).
typedef void (*FinishFn)(Ctx *c, const FeNode *n, const char *variant, char *dst);

enum {
  F_REQUIRED = 1 << 0,   // must appear
  F_MANY = 1 << 1,       // may appear more than once
  F_BLOCK = 1 << 2,      // must have a '{ ... }' block
  F_BLOCK_OPT = 1 << 3,  // may have a block
};

struct Field {
  const char *key;
  unsigned flags;
  const char *only;        // the one variant of the enclosing block that has it; NULL: all
  Val vals[3];             // the values after the keyword (V_NONE ends the list)
  const Block *block;      // the fields of its block
  size_t sub;              // AT()/SAME: the struct its block fills, within this block's
  size_t loc;              // AT(): the statement's SrcLoc
  size_t present;          // AT(): a bool set when the statement appears
  CheckFn custom;
  const char *missing;     // message when a required top-level statement is absent
};

struct Block {
  const char *name;        // for "'hidden' belongs in 'ffn'"
  const Field *fields;
  int nfields;
  FinishFn finish;
};

struct Ctx {
  IrDiag *d;
  FeArena *arena;
  FeProgram *prog;
  const Block *const *all_blocks;   // every block of this file kind, for "belongs in" notes
  SrcLoc root_loc;                  // where a missing top-level statement is reported
  bool model_ok, parallel_ok;
  const FeNode *parallel_node;
  const FeNode *lora_targets;       // the model's `lora { targets ...; }` statement, for its words' places
  const FeNode **layer_nodes;
  bool *layer_ok;
  int *layer_names;                 // hash set of layer indices + 1, by name (0: empty)
  unsigned layer_names_cap;         // a power of two
};

#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))
#define BLOCK(name, fields, finish) {name, fields, COUNT(fields), finish}

// ---- words ----
static const char *const dtypes[] = {"fp32", "bf16", NULL};
static const char *const recomputes[] = {"none", "activations", "norms", "layers", NULL};
static const char *const optimizers[] = {"sgd", "adamw", NULL};
// gates and ffn kinds come from the registry (frontend/registry.c)
#define gates ((const char *const *)fe_gate_words)
#define ffns ((const char *const *)fe_expert_words)
#define acts ir_act_words   // the activations of ir/activations.def that `act` offers
static const char *const orders[] = {"tutel", "gshard", NULL};
static const char *const algos[] = {"nccl", "1dh", "2dh", NULL};
static const char *const aux_forms[] = {"group", "pooled", "sequence", NULL};
static const char *const group_scores[] = {"top2", "max", NULL};
static const char *const balance_forms[] = {"bias", NULL};
#define policies ((const char *const *)ir_policy_name)
static const char *const hook_points[] = {"before_moe_start", "before_dispatch", "after_dispatch",
                                          "before_combine", "after_combine", "before_moe_end", NULL};
static const char *const hook_actions[] = {"compress", "record", NULL};
static const char *const compress_types[] = {"fp16", "bf16", "int8", NULL};
static const char *const partitions[] = {"auto", "none", "chunk", NULL};
static const char *const positions[] = {"learned", "rope", NULL};
static const char *const norms[] = {"layernorm", "rmsnorm", NULL};
static const char *const token_formats[] = {"u16", "bytes", "llmc", NULL};
static const char *const attn_biases[] = {"true", "false", "qkv", NULL};
static const char *const qk_norms[] = {"head", "whole", NULL};

static void check_layer(Ctx *c, const FeNode *parent, const FeNode *n, char *dst);
static void check_hook(Ctx *c, const FeNode *parent, const FeNode *n, char *dst);
static void check_shared_gate(Ctx *c, const FeNode *parent, const FeNode *n, char *dst);
static void check_pipeline(Ctx *c, const FeNode *parent, const FeNode *n, char *dst);
static void check_grad_partition(Ctx *c, const FeNode *parent, const FeNode *n, char *dst);
static void check_parallel(Ctx *c, const FeNode *parent, const FeNode *n, char *dst);
static void check_memory(Ctx *c, const FeNode *parent, const FeNode *n, char *dst);
static void check_gemm_at(Ctx *c, const FeNode *parent, const FeNode *n, char *dst);
static void check_lora_targets(Ctx *c, const FeNode *parent, const FeNode *n, char *dst);
static bool size_value(Ctx *c, const FeValue *v, const char *what, const char *example, int64_t *out);
static void finish_ffn(Ctx *c, const FeNode *n, const char *variant, char *dst);
static void finish_shared(Ctx *c, const FeNode *n, const char *variant, char *dst);
static void finish_gate(Ctx *c, const FeNode *n, const char *variant, char *dst);
static void finish_attention(Ctx *c, const FeNode *n, const char *variant, char *dst);
static void finish_lora(Ctx *c, const FeNode *n, const char *variant, char *dst);

// ---- the .moe schema ----
// optimizer = "optimizer" (sgd | adamw) "{" lr [beta1] [beta2] [eps] [weight_decay] [warmup]
//             [decay_steps] [min_lr] [clip] [shard] "}"
static const Field optimizer_fields[] = {
  {"lr", F_REQUIRED, .vals = {{V_NUM, R_POS, .off = AT(FeOptimizer, lr)}}},
  {"beta1", 0, "adamw", {{V_NUM, R_UNIT, .def = "0.9", .off = AT(FeOptimizer, beta1)}}},
  {"beta2", 0, "adamw", {{V_NUM, R_UNIT, .def = "0.999", .off = AT(FeOptimizer, beta2)}}},
  {"eps", 0, "adamw", {{V_NUM, R_POS, .def = "1e-8", .off = AT(FeOptimizer, eps)}}},
  {"weight_decay", 0, "adamw", {{V_NUM, R_NONNEG, .def = "0", .off = AT(FeOptimizer, weight_decay)}}},
  {"warmup", 0, .vals = {{V_INT, R_NONNEG, .def = "0", .off = AT(FeOptimizer, warmup)}}},
  {"decay_steps", 0, .vals = {{V_INT, R_NONNEG, .def = "0", .off = AT(FeOptimizer, decay_steps)}}},
  {"min_lr", 0, .vals = {{V_NUM, R_NONNEG, .def = "0", .off = AT(FeOptimizer, min_lr)}}},
  {"clip", 0, .vals = {{V_NUM, R_NONNEG, .def = "0", .off = AT(FeOptimizer, clip)}}},
  {"shard", 0, "adamw", {{V_BOOL, .def = "false", .off = AT(FeOptimizer, shard)}}},
};
static const Block optimizer_block = BLOCK("optimizer", optimizer_fields, NULL);

// yarn = "yarn" "{" factor original [beta_fast] [beta_slow] [mscale] [mscale_all_dim] [truncate] "}"
static const Field yarn_fields[] = {
  {"factor", F_REQUIRED, .vals = {{V_NUM, R_POS, .off = AT(FeModel, yarn_factor)}}},
  {"original", F_REQUIRED, .vals = {{V_INT, R_POS, .off = AT(FeModel, yarn_original)}}},
  {"beta_fast", 0, .vals = {{V_NUM, R_POS, .def = "32", .off = AT(FeModel, yarn_beta_fast)}}},
  {"beta_slow", 0, .vals = {{V_NUM, R_POS, .def = "1", .off = AT(FeModel, yarn_beta_slow)}}},
  {"mscale", 0, .vals = {{V_NUM, R_NONNEG, .def = "0", .off = AT(FeModel, yarn_mscale)}}},
  {"mscale_all_dim", 0, .vals = {{V_NUM, R_NONNEG, .def = "0", .off = AT(FeModel, yarn_mscale_all_dim)}}},
  {"truncate", 0, .vals = {{V_BOOL, .def = "true", .off = AT(FeModel, yarn_truncate)}}},
};
static const Block yarn_block = BLOCK("yarn", yarn_fields, NULL);

// position = "position" (learned | rope) [ "{" [theta] [partial] [interleave] [yarn] "}" ]
static const Field position_fields[] = {
  {"theta", 0, "rope", {{V_NUM, R_POS, .def = "10000", .off = AT(FeModel, rope_theta)}}},
  {"partial", 0, "rope", {{V_NUM, R_POS, .def = "1", .off = AT(FeModel, rope_partial)}},
   .loc = AT(FeModel, rope_partial_loc)},
  {"interleave", 0, "rope", {{V_BOOL, .def = "false", .off = AT(FeModel, rope_interleave)}}},
  {"yarn", F_BLOCK, "rope", .block = &yarn_block, .sub = SAME, .loc = AT(FeModel, yarn_loc), .present = AT(FeModel, has_yarn)},
};
static const Block position_block = BLOCK("position", position_fields, NULL);

// norm = "norm" (layernorm | rmsnorm) [ "{" [eps] "}" ]
static const Field norm_fields[] = {
  {"eps", 0, .vals = {{V_NUM, R_POS, .def = "1e-5", .off = AT(FeModel, norm_eps)}}},
};
static const Block norm_block = BLOCK("norm", norm_fields, NULL);

// data = "data" "{" [train STRING] [val STRING] [format (u16 | bytes | llmc)] "}"
static const Field data_fields[] = {
  {"train", 0, .vals = {{V_STRING, .off = AT(FeData, train)}}},
  {"val", 0, .vals = {{V_STRING, .off = AT(FeData, val)}}},
  {"format", 0, .vals = {{V_WORD, .what = "token format", .words = token_formats, .off = AT(FeData, format)}}},
};
static const Block data_block = BLOCK("data", data_fields, NULL);

// lora = "lora" "{" r [alpha] targets [dropout] "}"          (dropout: 0 only, finish_lora)
// targets = "targets" (q | k | v | o | experts | shared | mlp)+ ";"    (check_lora_targets)
static const char *const lora_target_words[] = {"q", "k", "v", "o", "experts", "shared", "mlp", NULL};
#define LORA_TARGETS "q, k, v, o, experts, shared and mlp"
static const Field lora_fields[] = {
  {"r", F_REQUIRED, .vals = {{V_INT, R_POS, .off = AT(FeLora, r)}}},
  {"alpha", 0, .vals = {{V_NUM, R_POS, .def = "8", .off = AT(FeLora, alpha)}}},
  {"targets", F_REQUIRED, .loc = AT(FeLora, targets_loc), .custom = check_lora_targets},
  {"dropout", 0, .vals = {{V_NUM, R_ANY, .def = "0", .off = AT(FeLora, dropout), .loc_off = AT(FeLora, dropout_loc)}}},
};
static const Block lora_block = BLOCK("lora", lora_fields, finish_lora);

// model = "model" NAME "{" [dtype] batch seqlen embed [seed] optimizer
//                          [vocab [position] [norm] [tie_embeddings] [vocab_parallel] [data]]
//                          [recompute] [lora] "}"
static const Field model_fields[] = {
  {"dtype", 0, .vals = {{V_WORD, .what = "dtype", .words = dtypes, .def = "fp32",
                         .off = AT(FeModel, dtype), .loc_off = AT(FeModel, dtype_loc)}}},
  {"batch", F_REQUIRED, .vals = {{V_INT, R_POS, .off = AT(FeModel, batch)}}},
  {"seqlen", F_REQUIRED, .vals = {{V_INT, R_POS, .off = AT(FeModel, seqlen)}}},
  {"embed", F_REQUIRED, .vals = {{V_INT, R_POS, .off = AT(FeModel, embed)}}},
  {"seed", 0, .vals = {{V_INT, R_NONNEG, .def = "0", .off = AT(FeModel, seed)}}},
  {"optimizer", F_REQUIRED | F_BLOCK,
   .vals = {{V_WORD, .what = "optimizer", .words = optimizers, .off = AT(FeModel, optimizer.name)}},
   .block = &optimizer_block, .sub = AT(FeModel, optimizer), .loc = AT(FeModel, optimizer.loc)},
  {"vocab", 0, .vals = {{V_INT, R_POS, .off = AT(FeModel, vocab)}}, .loc = AT(FeModel, vocab_loc),
   .present = AT(FeModel, has_vocab)},
  {"position", F_BLOCK_OPT, .vals = {{V_WORD, .what = "position kind", .words = positions, .def = "learned",
                                      .off = AT(FeModel, position)}},
   .block = &position_block, .sub = SAME, .loc = AT(FeModel, position_loc), .present = AT(FeModel, has_position)},
  {"norm", F_BLOCK_OPT, .vals = {{V_WORD, .what = "norm", .words = norms, .def = "layernorm", .off = AT(FeModel, norm)}},
   .block = &norm_block, .sub = SAME, .loc = AT(FeModel, norm_loc), .present = AT(FeModel, has_norm)},
  {"tie_embeddings", 0, .vals = {{V_BOOL, .def = "true", .off = AT(FeModel, tie_embeddings)}},
   .loc = AT(FeModel, tie_loc), .present = AT(FeModel, has_tie)},
  {"vocab_parallel", 0, .vals = {{V_BOOL, .def = "false", .off = AT(FeModel, vocab_parallel)}},
   .loc = AT(FeModel, vocab_parallel_loc), .present = AT(FeModel, has_vocab_parallel)},
  {"data", F_BLOCK, .block = &data_block, .sub = AT(FeModel, data), .loc = AT(FeModel, data.loc),
   .present = AT(FeModel, has_data)},
  {"recompute", 0, .vals = {{V_WORD, .what = "recomputation", .words = recomputes, .def = "none",
                             .off = AT(FeModel, recompute)}}},
  {"lora", F_BLOCK, .block = &lora_block, .sub = AT(FeModel, lora), .loc = AT(FeModel, lora.loc),
   .present = AT(FeModel, has_lora)},
};
static const Block model_block = BLOCK("model", model_fields, NULL);

// parallel = "parallel" ( "auto" ";" | "{" [pp] [microbatches] [pp_schedule] [pp_layers] [dp] [mp] [ep] [esp] "}" )
//                                                            (check_parallel)
static const char *const pp_schedules[] = {"1f1b", "gpipe", NULL};
static void check_pp_layers(Ctx *c, const FeNode *parent, const FeNode *n, char *dst);
static const Field parallel_fields[] = {
  {"pp", 0, .vals = {{V_INT, R_POS, .def = "1", .off = AT(FeParallel, pp)}}},
  {"microbatches", 0, .vals = {{V_INT, R_POS, .def = "1", .off = AT(FeParallel, microbatches)}}},
  {"pp_schedule", 0, .vals = {{V_WORD, .what = "pipeline schedule", .words = pp_schedules, .def = "1f1b",
                               .off = AT(FeParallel, pp_schedule)}}},
  {"pp_layers", 0, .custom = check_pp_layers},
  {"dp", 0, .vals = {{V_INT, R_POS, .def = "1", .off = AT(FeParallel, dp)}}},
  {"mp", 0, .vals = {{V_INT, R_POS, .def = "1", .off = AT(FeParallel, mp)}}},
  {"ep", 0, .vals = {{V_INT, R_POS, .def = "1", .off = AT(FeParallel, ep)}}},
  {"esp", 0, .vals = {{V_INT, R_POS, .def = "1", .off = AT(FeParallel, esp)}}},
};
static const Block parallel_block = BLOCK("parallel", parallel_fields, NULL);

// ffn = "ffn" (gpt | mixtral | oss) "{" hidden [act] [bias] "}"       (act, bias: gpt only)
static const Field ffn_fields[] = {
  {"hidden", F_REQUIRED, .vals = {{V_INT, R_POS, .off = AT(FeExperts, hidden)}}},
  {"act", 0, "gpt", {{V_WORD, .what = "activation", .words = acts, .def = "gelu",
                      .off = AT(FeExperts, act), .loc_off = AT(FeExperts, act_loc)}}},
  {"bias", 0, "gpt", {{V_BOOL, .def = "true", .off = AT(FeExperts, bias)}}},
};
static const Block ffn_block = BLOCK("ffn", ffn_fields, finish_ffn);

// experts = "experts" N "{" ffn "}"
static const Field experts_fields[] = {
  {"ffn", F_REQUIRED | F_BLOCK,
   .vals = {{V_WORD, .what = "ffn", .words = ffns, .off = AT(FeExperts, kind),
             .loc_off = AT(FeExperts, kind_loc)}},
   .block = &ffn_block, .sub = SAME},
};
static const Block experts_block = BLOCK("experts", experts_fields, NULL);

// gate = "gate" NAME [ "{" [k] [capacity] [noise] [aux_loss] [z_loss] [groups] [proj] [slots]
//                         [renormalize] [aux (group | pooled)] [bias] [expert_groups] [topk_groups]
//                         [group_score (top2 | max)] [scale] [balance bias RATE] "}" ]
static const Field gate_fields[] = {
  {"k", 0, .vals = {{V_INT, R_POS, .def = "1", .off = AT(FeGate, k)}},
   .loc = AT(FeGate, field_loc[FE_GATE_F_K])},
  {"capacity", 0, .vals = {{V_NUM_STAR, R_POS, .def = "1.0", .off = AT(FeGate, capacity),
                            .star_off = AT(FeGate, dropless)}},
   .loc = AT(FeGate, field_loc[FE_GATE_F_CAPACITY])},
  {"noise", 0, .vals = {{V_NUM, R_NONNEG, .def = "0", .off = AT(FeGate, noise)}},
   .loc = AT(FeGate, field_loc[FE_GATE_F_NOISE])},
  {"aux_loss", 0, .vals = {{V_NUM, R_NONNEG, .def = "0", .off = AT(FeGate, aux_loss)}},
   .loc = AT(FeGate, field_loc[FE_GATE_F_AUX])},
  {"z_loss", 0, .vals = {{V_NUM, R_NONNEG, .def = "0", .off = AT(FeGate, z_loss)}},
   .loc = AT(FeGate, field_loc[FE_GATE_F_Z])},
  {"groups", 0, .vals = {{V_INT, R_POS, .def = "1", .off = AT(FeGate, groups)}},
   .loc = AT(FeGate, field_loc[FE_GATE_F_GROUPS])},
  {"proj", 0, "xmoe", {{V_INT, R_POS, .def = "16", .off = AT(FeGate, proj)}},
   .loc = AT(FeGate, field_loc[FE_GATE_F_PROJ])},
  {"slots", 0, "softmoe", {{V_INT, R_POS, .def = "1", .off = AT(FeGate, slots)}},
   .loc = AT(FeGate, field_loc[FE_GATE_F_SLOTS])},
  {"renormalize", 0, .vals = {{V_BOOL, .off = AT(FeGate, renormalize)}},
   .loc = AT(FeGate, field_loc[FE_GATE_F_RENORM])},   // default k > 1: finish_gate
  {"aux", 0, .vals = {{V_WORD, .what = "aux form", .words = aux_forms, .def = "group", .off = AT(FeGate, aux_form)}},
   .loc = AT(FeGate, field_loc[FE_GATE_F_AUX_FORM])},
  {"bias", 0, .vals = {{V_BOOL, .def = "false", .off = AT(FeGate, bias)}},
   .loc = AT(FeGate, field_loc[FE_GATE_F_BIAS])},
  {"expert_groups", 0, .vals = {{V_INT, R_POS, .def = "1", .off = AT(FeGate, expert_groups)}},
   .loc = AT(FeGate, field_loc[FE_GATE_F_EXPERT_GROUPS])},
  {"topk_groups", 0, .vals = {{V_INT, R_POS, .off = AT(FeGate, topk_groups)}},
   .loc = AT(FeGate, field_loc[FE_GATE_F_TOPK_GROUPS])},   // default expert_groups: finish_gate
  {"group_score", 0, .vals = {{V_WORD, .what = "group score", .words = group_scores, .def = "top2", .off = AT(FeGate, group_score)}},
   .loc = AT(FeGate, field_loc[FE_GATE_F_GROUP_SCORE])},
  {"scale", 0, .vals = {{V_NUM, R_POS, .def = "1", .off = AT(FeGate, scale)}},
   .loc = AT(FeGate, field_loc[FE_GATE_F_SCALE])},
  {"balance", 0, .vals = {{V_WORD, .what = "balance form", .words = balance_forms, .off = AT(FeGate, balance)},
                          {V_NUM, R_NONNEG, .off = AT(FeGate, balance_rate)}},
   .loc = AT(FeGate, field_loc[FE_GATE_F_BALANCE])},
};
static const Block gate_block = BLOCK("gate", gate_fields, finish_gate);

// dispatch = "dispatch" "{" [algo] "}"
static const Field dispatch_fields[] = {
  {"algo", 0, .vals = {{V_WORD, .what = "dispatch algorithm", .words = algos, .def = "nccl",
                        .off = AT(FeMoe, algo), .loc_off = AT(FeMoe, algo_loc)}}},
};
static const Block dispatch_block = BLOCK("dispatch", dispatch_fields, NULL);

// shared = "shared" "{" ffn [gate sigmoid ";"] "}"      (ffn mixtral: a SwiGLU expert)
static const Field shared_fields[] = {
  {"ffn", F_REQUIRED | F_BLOCK,
   .vals = {{V_WORD, .what = "ffn", .words = ffns, .off = AT(FeMoe, shared.kind),
             .loc_off = AT(FeMoe, shared.kind_loc)}},
   .block = &ffn_block, .sub = AT(FeMoe, shared)},
  {"gate", 0, .loc = AT(FeMoe, shared_gate_loc), .present = AT(FeMoe, shared_gated), .custom = check_shared_gate},
};
static const Block shared_block = BLOCK("shared", shared_fields, finish_shared);

// moe = "moe" "{" experts gate [order] [dispatch] [shared] hook* "}"
static const Field moe_fields[] = {
  {"experts", F_REQUIRED | F_BLOCK, .vals = {{V_INT, R_POS, .off = AT(FeMoe, experts.count)}},
   .block = &experts_block, .sub = AT(FeMoe, experts), .loc = AT(FeMoe, experts.loc)},
  {"gate", F_REQUIRED | F_BLOCK_OPT,
   .vals = {{V_WORD, .what = "gate", .words = gates, .off = AT(FeMoe, gate.name),
             .loc_off = AT(FeMoe, gate.loc)}},
   .block = &gate_block, .sub = AT(FeMoe, gate)},
  {"order", 0, .vals = {{V_WORD, .what = "order", .words = orders, .def = "tutel",
                         .off = AT(FeMoe, order), .loc_off = AT(FeMoe, order_loc)}}},
  {"dispatch", F_BLOCK, .block = &dispatch_block, .sub = SAME},
  {"shared", F_BLOCK, .block = &shared_block, .sub = SAME, .loc = AT(FeMoe, shared.loc),
   .present = AT(FeMoe, has_shared)},
  {"hook", F_MANY, .custom = check_hook},
};
static const Block moe_block = BLOCK("moe", moe_fields, NULL);

// attention = "attention" "{" heads [kv_heads] [head_dim] [bias (true | false | qkv)]
//                              [qk_norm (head | whole)] [window N] [sinks (true | false)] [mla] "}"
// mla = "mla" "{" [q_lora] kv_lora nope rope v "}"
static const Field mla_fields[] = {
  {"q_lora", 0, .vals = {{V_INT, R_NONNEG, .def = "0", .off = AT(FeLayer, mla_q_lora)}}},
  {"kv_lora", F_REQUIRED, .vals = {{V_INT, R_POS, .off = AT(FeLayer, mla_kv_lora)}}},
  {"nope", F_REQUIRED, .vals = {{V_INT, R_POS, .off = AT(FeLayer, mla_nope)}}},
  {"rope", F_REQUIRED, .vals = {{V_INT, R_POS, .off = AT(FeLayer, mla_rope)}}},
  {"v", F_REQUIRED, .vals = {{V_INT, R_POS, .off = AT(FeLayer, mla_v)}}},
};
static const Block mla_block = BLOCK("mla", mla_fields, NULL);

static const Field attention_fields[] = {
  {"heads", F_REQUIRED, .vals = {{V_INT, R_POS, .off = AT(FeLayer, heads)}}},
  {"kv_heads", 0, .vals = {{V_INT, R_POS, .def = "0", .off = AT(FeLayer, kv_heads)}}},
  {"head_dim", 0, .vals = {{V_INT, R_POS, .def = "0", .off = AT(FeLayer, head_dim)}}},
  {"bias", 0, .vals = {{V_WORD, .what = "attention bias", .words = attn_biases, .def = "true",
                        .off = AT(FeLayer, attn_bias_kind)}}},
  {"qk_norm", 0, .vals = {{V_WORD, .what = "qk_norm kind", .words = qk_norms, .off = AT(FeLayer, qk_norm)}},
   .loc = AT(FeLayer, qk_norm_loc)},
  {"window", 0, .vals = {{V_INT, R_POS, .def = "0", .off = AT(FeLayer, window)}}, .loc = AT(FeLayer, window_loc)},
  {"sinks", 0, .vals = {{V_BOOL, .def = "false", .off = AT(FeLayer, sinks)}}},
  {"mla", F_BLOCK, .block = &mla_block, .sub = SAME, .loc = AT(FeLayer, mla_loc), .present = AT(FeLayer, has_mla)},
};
static const Block attention_block = BLOCK("attention", attention_fields, finish_attention);

// layer = "layer" NAME ["x" N] "{" [attention] (moe | mlp) "}"      (mlp: language models)
static const Field layer_fields[] = {
  {"attention", F_BLOCK, .block = &attention_block, .sub = SAME,
   .loc = AT(FeLayer, attention_loc), .present = AT(FeLayer, has_attention)},
  {"moe", F_BLOCK, .block = &moe_block, .sub = AT(FeLayer, moe), .loc = AT(FeLayer, moe.loc),
   .present = AT(FeLayer, has_moe)},
  {"mlp", F_BLOCK, .block = &experts_block, .sub = AT(FeLayer, mlp), .loc = AT(FeLayer, mlp.loc),
   .present = AT(FeLayer, has_mlp)},
};
static const Block layer_block = BLOCK("layer", layer_fields, NULL);

// pipeline = "pipeline" ( "auto" ";" | "{" [forward N] [backward N] "}" )
static const Field pipeline_fields[] = {
  {"forward", 0, .vals = {{V_INT, R_POS, .def = "1", .off = AT(FeSchedule, pipeline_fwd)}}},
  {"backward", 0, .vals = {{V_INT, R_POS, .def = "1", .off = AT(FeSchedule, pipeline_bwd)}}},
};
static const Block pipeline_block = BLOCK("pipeline", pipeline_fields, NULL);

// schedule = "schedule" "{" [policy] [pipeline] [grad_partition (auto | none | chunk SIZE)] "}"
static const Field schedule_fields[] = {
  {"policy", 0, .vals = {{V_WORD, .what = "schedule policy", .words = policies, .def = "sequential",
                          .off = AT(FeSchedule, policy), .loc_off = AT(FeSchedule, policy_loc)}}},
  {"pipeline", F_BLOCK_OPT, .block = &pipeline_block, .sub = SAME, .loc = AT(FeSchedule, pipeline_loc),
   .custom = check_pipeline},
  {"grad_partition", 0, .vals = {{V_WORD, .words = partitions, .def = "none", .off = AT(FeSchedule, grad_partition)}},
   .loc = AT(FeSchedule, grad_partition_loc), .custom = check_grad_partition},
};
static const Block schedule_block = BLOCK("schedule", schedule_fields, NULL);

// file = model [parallel] [cluster STRING ";"] [hf_config STRING ";"] layer+ [schedule]
static const Field moe_file_fields[] = {
  {"model", F_REQUIRED | F_BLOCK, .vals = {{V_NAME, .off = AT(FeProgram, model.name)}},
   .block = &model_block, .sub = AT(FeProgram, model), .loc = AT(FeProgram, model.loc),
   .missing = "missing 'model' block"},
  {"parallel", F_BLOCK_OPT, .block = &parallel_block, .sub = AT(FeProgram, parallel), .loc = AT(FeProgram, parallel.loc),
   .custom = check_parallel},
  {"cluster", 0, .vals = {{V_STRING, .off = AT(FeProgram, cluster_path), .loc_off = AT(FeProgram, cluster_loc)}}},
  {"hf_config", 0, .vals = {{V_STRING, .off = AT(FeProgram, hf_config_path), .loc_off = AT(FeProgram, hf_config_loc)}}},
  {"layer", F_REQUIRED | F_MANY | F_BLOCK, .custom = check_layer,
   .missing = "missing 'layer' block: a model needs at least one layer"},
  {"schedule", F_BLOCK, .block = &schedule_block, .sub = AT(FeProgram, schedule),
   .loc = AT(FeProgram, schedule.loc)},
};
static const Block moe_file_block = BLOCK("the top level", moe_file_fields, NULL);

static const Block *const moe_blocks[] = {
  &moe_file_block, &model_block, &optimizer_block, &position_block, &norm_block, &data_block,
  &parallel_block, &layer_block, &attention_block,
  &moe_block, &experts_block, &ffn_block, &gate_block, &dispatch_block, &schedule_block,
  &pipeline_block, &shared_block, &mla_block, &yarn_block, &lora_block, NULL,
};

// ---- the .cluster schema ----
// coefficients = NAME "{" alpha beta "}"       t(n) = alpha + beta * n, t in ms
static const Field coef_fields[] = {
  {"alpha", F_REQUIRED, .vals = {{V_NUM, R_NONNEG, .off = AT(FeCollective, alpha)}}},
  {"beta", F_REQUIRED, .vals = {{V_NUM, R_NONNEG, .off = AT(FeCollective, beta)}}},
};
static const Block coef_block = BLOCK("gemm", coef_fields, NULL);

// cluster = "cluster" NAME "{" nodes gpus_per_node gemm alltoall allgather reducescatter allreduce
//           [elementwise] [attention] [attention_grad] [elementwise_math] [update_adamw] [update_sgd]
//           [handoff] [expert_gemm_scale] [overlap] [alltoall_intra] [allreduce_intra] [p2p] [p2p_intra]
//           [memory SIZE] "}"
// overlap = "overlap" "{" compute comm "}"    relative slowdowns when both run at once
static const Field overlap_fields[] = {
  {"compute", F_REQUIRED, .vals = {{V_NUM, R_NONNEG, .off = AT(FeCluster, overlap_compute)}}},
  {"comm", F_REQUIRED, .vals = {{V_NUM, R_NONNEG, .off = AT(FeCluster, overlap_comm)}}},
};
static const Block overlap_block = BLOCK("overlap", overlap_fields, NULL);
static const Field cluster_fields[] = {
  {"nodes", F_REQUIRED, .vals = {{V_INT, R_POS, .off = AT(FeCluster, nodes)}}},
  {"gpus_per_node", F_REQUIRED, .vals = {{V_INT, R_POS, .off = AT(FeCluster, gpus_per_node)}}},
  {"gemm", F_REQUIRED | F_BLOCK, .block = &coef_block, .sub = AT(FeCluster, gemm)},
  {"alltoall", F_REQUIRED | F_BLOCK, .block = &coef_block, .sub = AT(FeCluster, alltoall)},
  {"allgather", F_REQUIRED | F_BLOCK, .block = &coef_block, .sub = AT(FeCluster, allgather)},
  {"reducescatter", F_REQUIRED | F_BLOCK, .block = &coef_block, .sub = AT(FeCluster, reducescatter)},
  {"allreduce", F_REQUIRED | F_BLOCK, .block = &coef_block, .sub = AT(FeCluster, allreduce)},
  {"elementwise", F_BLOCK, .block = &coef_block, .sub = AT(FeCluster, elementwise)},
  {"attention", F_BLOCK, .block = &coef_block, .sub = AT(FeCluster, attention)},
  {"attention_grad", F_BLOCK, .block = &coef_block, .sub = AT(FeCluster, attention_grad)},
  {"elementwise_math", F_BLOCK, .block = &coef_block, .sub = AT(FeCluster, elementwise_math)},
  {"update_adamw", F_BLOCK, .block = &coef_block, .sub = AT(FeCluster, update_adamw)},
  {"update_sgd", F_BLOCK, .block = &coef_block, .sub = AT(FeCluster, update_sgd)},
  {"handoff", 0, .vals = {{V_NUM, R_NONNEG, .def = "0", .off = AT(FeCluster, handoff)}}},
  {"expert_gemm_scale", 0, .vals = {{V_NUM, R_POS, .def = "1", .off = AT(FeCluster, expert_gemm_scale)}}},
  {"overlap", F_BLOCK, .block = &overlap_block, .sub = SAME},
  {"alltoall_intra", F_BLOCK, .block = &coef_block, .sub = AT(FeCluster, alltoall_intra)},
  {"allreduce_intra", F_BLOCK, .block = &coef_block, .sub = AT(FeCluster, allreduce_intra)},
  {"p2p", F_BLOCK, .block = &coef_block, .sub = AT(FeCluster, p2p)},
  {"p2p_intra", F_BLOCK, .block = &coef_block, .sub = AT(FeCluster, p2p_intra)},
  {"memory", 0, .loc = AT(FeCluster, memory_loc), .custom = check_memory},
  {"gemm_at", F_MANY, .custom = check_gemm_at},
};
static const Block cluster_block = BLOCK("cluster", cluster_fields, NULL);

// file = cluster
static const Field cluster_file_fields[] = {
  {"cluster", F_REQUIRED | F_BLOCK, .vals = {{V_IDENT, .off = AT(FeCluster, name)}},
   .block = &cluster_block, .sub = SAME, .loc = AT(FeCluster, loc),
   .missing = "missing 'cluster' block"},
};
static const Block cluster_file_block = BLOCK("the top level", cluster_file_fields, NULL);

static const Block *const cluster_blocks[] = {&cluster_file_block, &cluster_block, &coef_block, &overlap_block, NULL};

// ---- small helpers ----
#define PUT(dst, off, T) (*(T *)((dst) + (off) - 1))

static int nvals_of(const Field *f) {
  int n = 0;
  while (n < COUNT(f->vals) && f->vals[n].type != V_NONE)
    n++;
  return n;
}

static int nwords(const char *const *words) {
  int n = 0;
  while (words[n])
    n++;
  return n;
}

static bool is_root(const FeNode *n) { return n->key[0] == '\0'; }

// A statement's location: its keyword through its last value when they share a line.
static SrcLoc stmt_loc(const FeNode *n) {
  SrcLoc loc = n->loc;
  if (n->nvals > 0) {
    SrcLoc last = n->vals[n->nvals - 1].loc;
    if (last.line == loc.line && last.col + last.len > loc.col)
      loc.len = last.col + last.len - loc.col;
  }
  return loc;
}

static const FeNode *find_kid(const FeNode *n, const char *key) {
  for (int i = 0; n && i < n->nkids; i++)
    if (strcmp(n->kids[i]->key, key) == 0)
      return n->kids[i];
  return NULL;
}

// Where the statement `key` of block n is, or fallback when it is not there.
static SrcLoc kid_loc(const FeNode *n, const char *key, SrcLoc fallback) {
  const FeNode *k = find_kid(n, key);
  return k ? stmt_loc(k) : fallback;
}

static int count_kids(const FeNode *n, const char *key) {
  int count = 0;
  for (int i = 0; i < n->nkids; i++)
    count += strcmp(n->kids[i]->key, key) == 0;
  return count;
}

// 'word' for identifiers and numbers, "text" for strings: a value as the user wrote it.
static const char *shown(const FeValue *v, char *buf, size_t size) {
  if (v->kind == FE_VAL_STRING)
    snprintf(buf, size, "\"%s\"", v->text);
  else
    snprintf(buf, size, "'%s'", v->text);
  return buf;
}

// "fp32 or bf16", "one of gshard, sigmoid, xmoe, expert_choice, softmoe".
static const char *word_list(const char *const *words, char *buf, size_t size) {
  int n = nwords(words);
  size_t len = 0;
  buf[0] = '\0';
  if (n > 2)
    len += snprintf(buf, size, "one of ");
  for (int i = 0; i < n && len < size; i++) {
    const char *sep = i == 0 ? "" : n == 2 ? " or " : ", ";
    len += snprintf(buf + len, size - len, "%s%s", sep, words[i]);
  }
  return buf;
}

static const char *describe(const Val *v, char *buf, size_t size) {
  switch (v->type) {
  case V_INT: return "an integer";
  case V_NUM: return "a number";
  case V_NUM_STAR: return "a number or '*'";
  case V_WORD: return word_list(v->words, buf, size);
  case V_BOOL: return "true or false";
  case V_IDENT:
  case V_NAME: return "a name";
  case V_STRING: return "a string in double quotes";
  case V_NONE: break;
  }
  return "nothing";
}

static void apply_defaults(const Block *b, char *dst) {
  for (int i = 0; i < b->nfields; i++) {
    const Field *f = &b->fields[i];
    if (f->flags & F_MANY)
      continue;
    for (int j = 0; j < nvals_of(f); j++) {
      const Val *v = &f->vals[j];
      if (!v->def || !v->off)
        continue;
      switch (v->type) {
      case V_INT: PUT(dst, v->off, int64_t) = strtoll(v->def, NULL, 10); break;
      case V_NUM:
      case V_NUM_STAR: PUT(dst, v->off, double) = strtod(v->def, NULL); break;
      case V_BOOL: PUT(dst, v->off, bool) = strcmp(v->def, "true") == 0; break;
      default: PUT(dst, v->off, const char *) = v->def; break;
      }
    }
    if (f->block)
      apply_defaults(f->block, dst + f->sub - 1);
  }
}

// ---- values ----
static bool check_range(Ctx *c, const FeNode *n, const FeValue *v, Range r, bool integer) {
  double x = v->kind == FE_VAL_INT ? (double)v->i : v->f;
  switch (r) {
  case R_ANY:
    return true;
  case R_POS:
    if (integer && v->i < 1)
      return ir_error_at(c->d, v->loc, "'%s' must be at least 1, got %s", n->key, v->text);
    if (integer && v->i > INT32_MAX)
      return ir_error_at(c->d, v->loc, "'%s' is too large: at most %d, got %s", n->key,
                         INT32_MAX, v->text);
    if (!integer && !(x > 0))
      return ir_error_at(c->d, v->loc, "'%s' must be greater than 0, got %s", n->key, v->text);
    return true;
  case R_NONNEG:
    if (x < 0)
      return ir_error_at(c->d, v->loc, "'%s' must not be negative, got %s", n->key, v->text);
    return true;
  case R_UNIT:
    if (!(x >= 0 && x < 1))
      return ir_error_at(c->d, v->loc, "'%s' must be in [0, 1), got %s", n->key, v->text);
    return true;
  }
  return true;
}

// "unknown gate 'gshrad'" with "did you mean 'gshard'?" or the list of choices.
static bool unknown_word(Ctx *c, const FeValue *v, const char *what, const char *const *words) {
  char buf[160];
  ir_error_at(c->d, v->loc, "unknown %s '%s'", what, v->text);
  const char *best = ir_closest(v->text, words, nwords(words));
  if (best)
    ir_note_at(c->d, v->loc, "did you mean '%s'?", best);
  else
    ir_note_at(c->d, v->loc, "expected %s", word_list(words, buf, sizeof buf));
  return false;
}

static int word_index(const char *const *words, const char *text) {
  for (int i = 0; words[i]; i++)
    if (strcmp(words[i], text) == 0)
      return i;
  return -1;
}

// Checks one value against its Val and stores it in dst. False after a diagnostic.
static bool check_val(Ctx *c, const FeNode *n, const FeValue *v, const Val *spec, char *dst) {
  char buf[160], shown_buf[96];
  const char *got = shown(v, shown_buf, sizeof shown_buf);
  switch (spec->type) {
  case V_NUM_STAR:
    if (v->kind == FE_VAL_STAR) {
      if (spec->star_off)
        PUT(dst, spec->star_off, bool) = true;
      break;
    }
    // fall through
  case V_NUM:
    if (v->kind != FE_VAL_INT && v->kind != FE_VAL_FLOAT)
      return ir_error_at(c->d, v->loc, "expected %s for '%s', got %s", describe(spec, buf, sizeof buf),
                         n->key, got);
    if (!check_range(c, n, v, spec->range, false))
      return false;
    if (spec->off)
      PUT(dst, spec->off, double) = v->kind == FE_VAL_INT ? (double)v->i : v->f;
    break;
  case V_INT:
    if (v->kind != FE_VAL_INT)
      return ir_error_at(c->d, v->loc, "expected an integer for '%s', got %s", n->key, got);
    if (!check_range(c, n, v, spec->range, true))
      return false;
    if (spec->off)
      PUT(dst, spec->off, int64_t) = v->i;
    break;
  case V_WORD: {
    if (v->kind != FE_VAL_IDENT) {
      ir_error_at(c->d, v->loc, "expected %s for '%s', got %s", describe(spec, buf, sizeof buf),
                  n->key, got);
      if (v->kind == FE_VAL_STRING && word_index(spec->words, v->text) >= 0)
        ir_note_at(c->d, v->loc, "write %s without quotes", v->text);
      return false;
    }
    int i = word_index(spec->words, v->text);
    if (i < 0)
      return unknown_word(c, v, spec->what ? spec->what : n->key, spec->words);
    if (spec->off)
      PUT(dst, spec->off, const char *) = spec->words[i];
    break;
  }
  case V_BOOL: {
    static const char *const bools[] = {"true", "false", NULL};
    if (v->kind != FE_VAL_IDENT || word_index(bools, v->text) < 0) {
      ir_error_at(c->d, v->loc, "expected true or false for '%s', got %s", n->key, got);
      const char *best = v->kind == FE_VAL_IDENT ? ir_closest(v->text, bools, 2) : NULL;
      if (best)
        ir_note_at(c->d, v->loc, "did you mean '%s'?", best);
      return false;
    }
    if (spec->off)
      PUT(dst, spec->off, bool) = strcmp(v->text, "true") == 0;
    break;
  }
  case V_NAME:
    if (v->kind == FE_VAL_IDENT) {
      for (const char *s = v->text; *s; s++)
        if (!isalnum((unsigned char)*s) && *s != '_')
          return ir_error_at(c->d, v->loc,
                             "invalid name %s for '%s': use only letters, digits and '_'", got, n->key);
      if (isdigit((unsigned char)v->text[0]))
        return ir_error_at(c->d, v->loc, "invalid name %s for '%s': a name starts with a letter or '_'",
                           got, n->key);
    }
    // fall through
  case V_IDENT:
    if (v->kind != FE_VAL_IDENT)
      return ir_error_at(c->d, v->loc, "expected a name for '%s', got %s", n->key, got);
    if (spec->off)
      PUT(dst, spec->off, const char *) = v->text;
    break;
  case V_STRING:
    if (v->kind != FE_VAL_STRING)
      return ir_error_at(c->d, v->loc, "expected a string in double quotes for '%s', got %s", n->key, got);
    if (v->text[0] == '\0')
      return ir_error_at(c->d, v->loc, "empty string for '%s'", n->key);
    if (spec->off)
      PUT(dst, spec->off, const char *) = v->text;
    break;
  case V_NONE:
    UNREACHABLE();
  }
  if (spec->loc_off)
    PUT(dst, spec->loc_off, SrcLoc) = v->loc;
  return true;
}

// Reports values past the first max. A surplus value on a new line most likely follows a
// forgotten ';', so that is what the message says.
static bool check_surplus(Ctx *c, const FeNode *n, int max) {
  if (n->nvals <= max)
    return true;
  const FeValue *extra = &n->vals[max];
  SrcLoc prev = max > 0 ? n->vals[max - 1].loc : n->loc;
  if (extra->loc.line > prev.line) {
    char head[64];
    FeNode shorter = *n;
    shorter.nvals = max;
    return ir_error_at(c->d, fe_stmt_end(&shorter), "expected ';' after '%s'",
                       fe_stmt_text(&shorter, head, sizeof head, 40));
  }
  if (max == 0)
    return ir_error_at(c->d, extra->loc, "'%s' takes no values, but %d %s given", n->key, n->nvals,
                       n->nvals == 1 ? "was" : "were");
  return ir_error_at(c->d, extra->loc, "'%s' takes %d value%s, but %d were given", n->key, max,
                     max == 1 ? "" : "s", n->nvals);
}

// The block part of a statement: present when needed, absent when not allowed.
static bool check_block_form(Ctx *c, const FeNode *n, const Field *f) {
  char head[64];
  if ((f->flags & F_BLOCK) && !n->has_block)
    return ir_error_at(c->d, stmt_loc(n), "'%s' needs a '{ ... }' block",
                       fe_stmt_text(n, head, sizeof head, 40));
  if (!(f->flags & (F_BLOCK | F_BLOCK_OPT)) && n->has_block)
    return ir_error_at(c->d, stmt_loc(n), "'%s' takes no '{ ... }' block; end it with ';'",
                       fe_stmt_text(n, head, sizeof head, 40));
  return true;
}

// ---- blocks ----
static void check_block(Ctx *c, const FeNode *n, const Block *b, const char *variant, char *dst);

// stmt = KEY value* ( ";" | "{" ... "}" ), checked against its Field.
static void check_stmt(Ctx *c, const FeNode *parent, const FeNode *n, const Field *f, char *dst) {
  if (f->present)
    PUT(dst, f->present, bool) = true;
  if (f->loc)
    PUT(dst, f->loc, SrcLoc) = stmt_loc(n);
  if (f->custom) {
    f->custom(c, parent, n, dst);
    return;
  }
  if (!check_block_form(c, n, f))
    return;
  int nv = nvals_of(f);
  bool ok = true;
  if (n->nvals < nv) {
    char what[160], head[64];
    ir_error_at(c->d, stmt_loc(n), "expected %s after '%s'", describe(&f->vals[n->nvals], what, sizeof what),
                fe_stmt_text(n, head, sizeof head, 40));
    ok = false;
  }
  ok &= check_surplus(c, n, nv);
  for (int i = 0; i < nv && i < n->nvals; i++)
    ok &= check_val(c, n, &n->vals[i], &f->vals[i], dst);
  if (ok && f->block && n->has_block) {
    const char *variant = nv > 0 && f->vals[0].type == V_WORD ? n->vals[0].text : NULL;
    check_block(c, n, f->block, variant, dst + f->sub - 1);
  }
}

static int find_field(const Block *b, const char *key) {
  for (int i = 0; i < b->nfields; i++)
    if (strcmp(b->fields[i].key, key) == 0)
      return i;
  return -1;
}

// An unknown keyword in block n: a close field name, or the block it belongs in.
static void unknown_stmt(Ctx *c, const FeNode *n, const Block *b, const char *variant, const FeNode *k) {
  char head[64];
  const char *cands[32];
  int ncands = 0;
  for (int i = 0; i < b->nfields && ncands < COUNT(cands); i++)
    if (!b->fields[i].only || (variant && strcmp(b->fields[i].only, variant) == 0))
      cands[ncands++] = b->fields[i].key;
  if (is_root(n))
    ir_error_at(c->d, k->loc, "unknown statement '%s'", k->key);
  else
    ir_error_at(c->d, k->loc, "unknown field '%s' in '%s'", k->key, fe_stmt_text(n, head, sizeof head, 40));
  const char *best = ir_closest(k->key, cands, ncands);
  if (best) {
    ir_note_at(c->d, k->loc, "did you mean '%s'?", best);
    return;
  }
  for (int i = 0; c->all_blocks[i]; i++) {
    const Block *other = c->all_blocks[i];
    if (other != b && find_field(other, k->key) >= 0) {
      if (i == 0)
        ir_note_at(c->d, k->loc, "'%s' is a top-level statement", k->key);
      else
        ir_note_at(c->d, k->loc, "'%s' belongs in '%s'", k->key, other->name);
      return;
    }
  }
  if (ncands > 0 && ncands <= 12) {
    char list[256];
    size_t len = 0;
    list[0] = '\0';
    for (int i = 0; i < ncands && len < sizeof list; i++)
      len += snprintf(list + len, sizeof list - len, "%s%s", i ? ", " : "", cands[i]);
    ir_note_at(c->d, k->loc, "expected one of: %s", list);
  }
}

// block = "{" stmt* "}": every statement known, none twice unless it may repeat, the required
// ones present. variant is the block's first value (`gate xmoe` -> "xmoe") for `only` fields.
static void check_block(Ctx *c, const FeNode *n, const Block *b, const char *variant, char *dst) {
  const FeNode *seen[32] = {0};
  char head[64];
  for (int i = 0; i < n->nkids; i++) {
    const FeNode *k = n->kids[i];
    int fi = find_field(b, k->key);
    if (fi < 0) {
      unknown_stmt(c, n, b, variant, k);
      continue;
    }
    const Field *f = &b->fields[fi];
    if (f->only && (!variant || strcmp(f->only, variant) != 0)) {
      ir_error_at(c->d, k->loc, "'%s' is not a field of '%s'", k->key, fe_stmt_text(n, head, sizeof head, 40));
      ir_note_at(c->d, k->loc, "only '%s %s' has it", n->key, f->only);
      continue;
    }
    if (seen[fi] && !(f->flags & F_MANY)) {
      ir_error_at(c->d, k->loc, "'%s' given twice", k->key);
      ir_note_at(c->d, seen[fi]->loc, "first given here");
      continue;
    }
    if (!seen[fi])
      seen[fi] = k;
    int errors = c->d->errors;
    check_stmt(c, n, k, f, dst);
    if (is_root(n) && strcmp(k->key, "model") == 0) {
      c->model_ok = c->d->errors == errors;
      c->root_loc = stmt_loc(k);
    }
    if (is_root(n) && strcmp(k->key, "parallel") == 0) {
      c->parallel_ok = c->d->errors == errors;
      c->parallel_node = k;
    }
  }
  for (int i = 0; i < b->nfields; i++) {
    const Field *f = &b->fields[i];
    if (!(f->flags & F_REQUIRED) || seen[i] || (f->only && (!variant || strcmp(f->only, variant) != 0)))
      continue;
    if (is_root(n))
      ir_error_at(c->d, c->root_loc, "%s", f->missing ? f->missing : "missing statement");
    else
      ir_error_at(c->d, stmt_loc(n), "missing '%s' in '%s'", f->key, fe_stmt_text(n, head, sizeof head, 40));
  }
  if (b->finish)
    b->finish(c, n, variant, dst);
}

// ---- irregular statements ----
// The layer named like layer i among layers 0..i-1, or -1; then remembers layer i. A hash set,
// so that a file with very many layers is not checked in quadratic time.
static int earlier_layer(Ctx *c, const FeProgram *p, int i) {
  unsigned h = 2166136261u;
  for (const char *s = p->layers[i].name; *s; s++)
    h = (h ^ (unsigned char)*s) * 16777619u;
  for (unsigned j = h & (c->layer_names_cap - 1);; j = (j + 1) & (c->layer_names_cap - 1)) {
    int other = c->layer_names[j] - 1;
    if (other < 0) {
      c->layer_names[j] = i + 1;
      return -1;
    }
    if (strcmp(p->layers[other].name, p->layers[i].name) == 0)
      return other;
  }
}

// layer = "layer" NAME ["x" N] "{" ... "}"
static void check_layer(Ctx *c, const FeNode *parent, const FeNode *n, char *dst) {
  FeProgram *p = (FeProgram *)dst;
  char buf[96];
  if (!p->layers) {
    int count = count_kids(parent, "layer");
    p->layers = fe_arena_alloc(c->arena, sizeof(FeLayer) * count);
    c->layer_nodes = fe_arena_alloc(c->arena, sizeof(FeNode *) * count);
    c->layer_ok = fe_arena_alloc(c->arena, sizeof(bool) * count);
    c->layer_names_cap = 4;
    while (c->layer_names_cap < 2u * (unsigned)count)
      c->layer_names_cap *= 2;
    c->layer_names = fe_arena_alloc(c->arena, sizeof(int) * c->layer_names_cap);
    if (!p->layers || !c->layer_nodes || !c->layer_ok || !c->layer_names) {
      ir_oom(c->d);
      return;
    }
  }
  int errors = c->d->errors;
  FeLayer *l = &p->layers[p->nlayers];
  c->layer_nodes[p->nlayers] = n;
  p->nlayers++;
  apply_defaults(&layer_block, (char *)l);
  l->loc = stmt_loc(n);
  l->repeat = 1;
  static const Val name = {V_NAME, .off = AT(FeLayer, name)};
  static const Val repeat = {V_INT, R_POS, .off = AT(FeLayer, repeat)};
  if (n->nvals == 0) {
    ir_error_at(c->d, n->loc, "expected a layer name after 'layer'");
  } else if (check_val(c, n, &n->vals[0], &name, (char *)l)) {
    int first = earlier_layer(c, p, p->nlayers - 1);
    if (first >= 0) {
      ir_error_at(c->d, n->vals[0].loc, "layer '%s' defined twice", l->name);
      ir_note_at(c->d, p->layers[first].loc, "first defined here");
    }
  }
  if (n->nvals >= 2) {
    const FeValue *x = &n->vals[1];
    if (x->kind != FE_VAL_IDENT || strcmp(x->text, "x") != 0) {
      ir_error_at(c->d, x->loc, "expected 'x N' after the layer name, got %s", shown(x, buf, sizeof buf));
      if (x->kind == FE_VAL_IDENT && x->text[0] == 'x' && isdigit((unsigned char)x->text[1]))
        ir_note_at(c->d, x->loc, "write 'x %s' with a space", x->text + 1);
    } else if (n->nvals == 2) {
      ir_error_at(c->d, x->loc, "expected a repeat count after 'x'");
    } else if (n->vals[2].kind != FE_VAL_INT) {
      ir_error_at(c->d, n->vals[2].loc, "expected a repeat count after 'x', got %s",
                  shown(&n->vals[2], buf, sizeof buf));
    } else if (n->vals[2].i < 1) {
      ir_error_at(c->d, n->vals[2].loc, "the repeat count after 'x' must be at least 1, got %s",
                  n->vals[2].text);
    } else {
      check_val(c, n, &n->vals[2], &repeat, (char *)l);
    }
  }
  check_surplus(c, n, 3);
  static const Field form = {"layer", F_BLOCK};
  if (check_block_form(c, n, &form))
    check_block(c, n, &layer_block, NULL, (char *)l);
  c->layer_ok[p->nlayers - 1] = c->d->errors == errors;
}

// hook = "hook" POINT ( "compress" (fp16 | bf16 | int8) | "record" ) ";"
static void check_hook(Ctx *c, const FeNode *parent, const FeNode *n, char *dst) {
  FeMoe *m = (FeMoe *)dst;
  static const Field form = {"hook", 0};
  static const Val point = {V_WORD, .what = "hook point", .words = hook_points, .off = AT(FeHook, point)};
  static const Val action = {V_WORD, .what = "hook action", .words = hook_actions, .off = AT(FeHook, action)};
  static const Val arg = {V_WORD, .what = "compression type", .words = compress_types, .off = AT(FeHook, arg)};
  if (!m->hooks) {
    m->hooks = fe_arena_alloc(c->arena, sizeof(FeHook) * count_kids(parent, "hook"));
    if (!m->hooks) {
      ir_oom(c->d);
      return;
    }
  }
  if (!check_block_form(c, n, &form))
    return;
  FeHook h = {.loc = stmt_loc(n)};
  if (n->nvals < 2) {
    ir_error_at(c->d, stmt_loc(n), "expected a hook point and an action after 'hook', "
                                   "e.g. 'hook before_dispatch compress bf16;'");
    return;
  }
  bool ok = check_val(c, n, &n->vals[0], &point, (char *)&h);
  ok &= check_val(c, n, &n->vals[1], &action, (char *)&h);
  if (!ok)
    return;
  if (strcmp(h.action, "compress") == 0) {
    if (n->nvals < 3) {
      ir_error_at(c->d, stmt_loc(n), "expected fp16, bf16 or int8 after 'compress'");
      return;
    }
    if (!check_val(c, n, &n->vals[2], &arg, (char *)&h) || !check_surplus(c, n, 3))
      return;
    if (strcmp(h.point, "before_dispatch") != 0 && strcmp(h.point, "before_combine") != 0) {
      ir_error_at(c->d, n->vals[0].loc, "'compress' cannot be hooked at '%s'", h.point);
      ir_note_at(c->d, n->vals[0].loc, "hook compress at before_dispatch or before_combine; the data "
                                       "is decompressed at the matching after_dispatch or after_combine");
      return;
    }
  } else if (!check_surplus(c, n, 2)) {
    return;
  }
  for (int i = 0; i < m->nhooks; i++) {
    if (strcmp(m->hooks[i].point, h.point) == 0 && strcmp(m->hooks[i].action, h.action) == 0) {
      ir_error_at(c->d, h.loc, "hook '%s %s' given twice", h.point, h.action);
      ir_note_at(c->d, m->hooks[i].loc, "first given here");
      return;
    }
  }
  m->hooks[m->nhooks++] = h;
}

// The shared expert's gate: sigmoid(x·w) per token, the one kind there is (Qwen2-MoE's
// shared_expert_gate). A routing gate written here most likely belongs in the moe block.
// shared_gate = "gate" "sigmoid" ";"
static void check_shared_gate(Ctx *c, const FeNode *parent, const FeNode *n, char *dst) {
  static const Field form = {"gate", 0};
  static const char *const kinds[] = {"sigmoid", NULL};
  static const Val kind = {V_WORD, .what = "shared expert gate", .words = kinds};
  if (!check_block_form(c, n, &form))
    return;
  if (n->nvals == 0) {
    ir_error_at(c->d, stmt_loc(n), "expected 'sigmoid' after 'gate' in 'shared'");
    return;
  }
  const FeValue *v = &n->vals[0];
  if (v->kind == FE_VAL_IDENT && strcmp(v->text, "sigmoid") != 0 && word_index(gates, v->text) >= 0) {
    ir_error_at(c->d, v->loc, "the shared expert's gate is 'sigmoid' (its output times sigmoid(x.w), per token), "
                "not '%s'", v->text);
    ir_note_at(c->d, v->loc, "'gate %s' routes tokens to the experts: it belongs in the 'moe' block", v->text);
    return;
  }
  if (check_val(c, n, v, &kind, dst))
    check_surplus(c, n, 1);
}

// The two forms of `pipeline` and `parallel`: KW "auto" ";" or KW "{" ... "}"; `fields` is the
// block's contents as messages show them. A block is left to the caller to check.
typedef enum AutoOrBlock { CHOSE_NEITHER, CHOSE_AUTO, CHOSE_BLOCK } AutoOrBlock;

static AutoOrBlock auto_or_block(Ctx *c, const FeNode *n, const char *kw, const char *fields) {
  char buf[96];
  if (n->has_block) {
    if (n->nvals > 0) {
      ir_error_at(c->d, n->vals[0].loc, "'%s' takes either 'auto' or a '{ ... }' block, not both", kw);
      return CHOSE_NEITHER;
    }
    return CHOSE_BLOCK;
  }
  if (n->nvals == 0) {
    ir_error_at(c->d, stmt_loc(n), "expected 'auto' or '{ %s }' after '%s'", fields, kw);
    return CHOSE_NEITHER;
  }
  const FeValue *v = &n->vals[0];
  if (v->kind != FE_VAL_IDENT || strcmp(v->text, "auto") != 0) {
    if (v->kind == FE_VAL_IDENT)
      ir_error_at(c->d, v->loc, "unknown %s setting '%s'", kw, v->text);
    else
      ir_error_at(c->d, v->loc, "expected 'auto' after '%s', got %s", kw, shown(v, buf, sizeof buf));
    ir_note_at(c->d, v->loc, "write '%s auto;' or '%s { %s }'", kw, kw, fields);
    return CHOSE_NEITHER;
  }
  return check_surplus(c, n, 1) ? CHOSE_AUTO : CHOSE_NEITHER;
}

// pipeline = "pipeline" ( "auto" ";" | "{" [forward N] [backward N] "}" )
static void check_pipeline(Ctx *c, const FeNode *parent, const FeNode *n, char *dst) {
  FeSchedule *s = (FeSchedule *)dst;
  switch (auto_or_block(c, n, "pipeline", "forward N; backward N;")) {
  case CHOSE_BLOCK:
    s->pipeline_auto = false;
    check_block(c, n, &pipeline_block, NULL, dst);
    break;
  case CHOSE_AUTO:
    s->pipeline_auto = true;
    break;
  case CHOSE_NEITHER:
    break;
  }
}

// grad_partition = "grad_partition" ( "auto" | "none" | "chunk" SIZE ) ";"
// SIZE = INT (bytes) | INT followed by B, KB, MB, GB (or KiB, MiB, GiB; all powers of 1024).
static void check_grad_partition(Ctx *c, const FeNode *parent, const FeNode *n, char *dst) {
  FeSchedule *s = (FeSchedule *)dst;
  static const Field form = {"grad_partition", 0};
  static const Val how = {V_WORD, .what = "grad_partition mode", .words = partitions,
                          .off = AT(FeSchedule, grad_partition)};
  if (!check_block_form(c, n, &form))
    return;
  if (n->nvals == 0) {
    ir_error_at(c->d, stmt_loc(n), "expected auto, none or chunk after 'grad_partition'");
    return;
  }
  if (!check_val(c, n, &n->vals[0], &how, dst))
    return;
  if (strcmp(s->grad_partition, "chunk") != 0) {
    check_surplus(c, n, 1);
    return;
  }
  if (n->nvals < 2) {
    ir_error_at(c->d, stmt_loc(n), "expected a size after 'chunk', e.g. 'grad_partition chunk 30MB;'");
    return;
  }
  if (!check_surplus(c, n, 2))
    return;
  size_value(c, &n->vals[1], "'chunk'", "30MB", &s->grad_chunk_bytes);
}

// SIZE = INT (bytes) | INT followed by B, KB, MB, GB, TB (or KiB, MiB, GiB, TiB; all powers of
// 1024): *out on success, else an error naming what (e.g. "the chunk size") with an example.
static bool size_value(Ctx *c, const FeValue *v, const char *what, const char *example, int64_t *out) {
  static const struct { const char *suffix; int64_t scale; } units[] = {
    {"", 1}, {"B", 1}, {"KB", 1 << 10}, {"KiB", 1 << 10}, {"MB", 1 << 20}, {"MiB", 1 << 20},
    {"GB", 1 << 30}, {"GiB", 1 << 30}, {"TB", INT64_C(1) << 40}, {"TiB", INT64_C(1) << 40},
  };
  char *end = NULL;
  long long count = (v->kind == FE_VAL_INT || v->kind == FE_VAL_IDENT) && isdigit((unsigned char)v->text[0])
                        ? strtoll(v->text, &end, 10) : -1;
  int unit = -1;
  for (int i = 0; end && i < COUNT(units); i++)
    if (strcmp(end, units[i].suffix) == 0)
      unit = i;
  if (unit < 0) {
    char buf[96];
    ir_error_at(c->d, v->loc, "expected a size such as %s for %s, got %s", example, what, shown(v, buf, sizeof buf));
    return false;
  }
  if (count < 1)
    return ir_error_at(c->d, v->loc, "%s must be greater than 0, got %s", what, v->text);
  if (count > (INT64_C(1) << 50) / units[unit].scale)
    return ir_error_at(c->d, v->loc, "%s %s is too large", what, v->text);
  *out = count * units[unit].scale;
  return true;
}

// memory = "memory" SIZE ";"   (a cluster profile: bytes a rank may use)
static void check_memory(Ctx *c, const FeNode *parent, const FeNode *n, char *dst) {
  static const Field form = {"memory", 0};
  if (!check_block_form(c, n, &form))
    return;
  if (n->nvals == 0) {
    ir_error_at(c->d, stmt_loc(n), "expected a size after 'memory', e.g. 'memory 80GiB;'");
    return;
  }
  if (check_surplus(c, n, 1))
    size_value(c, &n->vals[0], "'memory'", "80GiB", &((FeCluster *)dst)->memory);
}

// gemm_at = "gemm_at" M K N MS ";"   a GEMM [M, K] x [K, N] takes MS ms (M, K, N >= 1, MS > 0)
static void check_gemm_at(Ctx *c, const FeNode *parent, const FeNode *n, char *dst) {
  FeCluster *cl = (FeCluster *)dst;
  static const Field form = {"gemm_at", 0};
  if (!check_block_form(c, n, &form))
    return;
  if (n->nvals < 4) {
    ir_error_at(c->d, stmt_loc(n), "expected M K N and the milliseconds after 'gemm_at', e.g. "
                                   "'gemm_at 256 1024 4096 1.5e-1;'");
    return;
  }
  if (!check_surplus(c, n, 4))
    return;
  double v[4];
  for (int i = 0; i < 4; i++) {
    const FeValue *x = &n->vals[i];
    bool number = x->kind == FE_VAL_INT || x->kind == FE_VAL_FLOAT;
    if (!number || (i < 3 && (x->kind != FE_VAL_INT || x->i < 1 || x->i > INT32_MAX)) || !(x->f > 0)) {
      ir_error_at(c->d, x->loc, i < 3 ? "'gemm_at' wants %s as a whole number of at least 1"
                                      : "'gemm_at' wants %s as a number of milliseconds above 0",
                  i == 0 ? "M" : i == 1 ? "K" : i == 2 ? "N" : "the time");
      return;
    }
    v[i] = x->f;
  }
  if (cl->ngemm_at == FE_MAX_GEMM_AT) {
    ir_error_at(c->d, stmt_loc(n), "more than %d 'gemm_at' statements", FE_MAX_GEMM_AT);
    return;
  }
  memcpy(cl->gemm_at[cl->ngemm_at++], v, sizeof v);
}

// pp_layers = "pp_layers" N1 N2 ... ";"   the layer instances of each stage, in order (each >= 1)
static void check_pp_layers(Ctx *c, const FeNode *parent, const FeNode *n, char *dst) {
  (void)parent;
  FeParallel *par = (FeParallel *)dst;
  static const Field form = {"pp_layers", 0};
  if (!check_block_form(c, n, &form))
    return;
  if (n->nvals == 0) {
    ir_error_at(c->d, stmt_loc(n), "expected the layers of each stage after 'pp_layers', e.g. 'pp_layers 3 2;'");
    return;
  }
  if (n->nvals > FE_MAX_STAGES) {
    ir_error_at(c->d, n->vals[FE_MAX_STAGES].loc, "more than %d stages in 'pp_layers'", FE_MAX_STAGES);
    return;
  }
  for (int i = 0; i < n->nvals; i++) {
    const FeValue *x = &n->vals[i];
    if (x->kind != FE_VAL_INT || x->i < 1 || x->i > INT32_MAX) {
      ir_error_at(c->d, x->loc, "'pp_layers' wants each stage's number of layers as a whole number of at least 1");
      return;
    }
    par->pp_layers[i] = x->i;
  }
  par->npp_layers = n->nvals;
  par->pp_layers_loc = n->loc;
}

// targets = "targets" (q | k | v | o | experts | shared | mlp)+ ";"   the weights lora adapts, each once
static void check_lora_targets(Ctx *c, const FeNode *parent, const FeNode *n, char *dst) {
  (void)parent;
  FeLora *lo = (FeLora *)dst;
  bool *flags[] = {&lo->q, &lo->k, &lo->v, &lo->o, &lo->experts, &lo->shared, &lo->mlp};
  static const Field form = {"targets", 0};
  char buf[96];
  if (!check_block_form(c, n, &form))
    return;
  c->lora_targets = n;
  if (n->nvals == 0) {
    ir_error_at(c->d, stmt_loc(n), "expected the weights to adapt after 'targets', e.g. 'targets q v;': the targets "
                "are " LORA_TARGETS);
    return;
  }
  for (int i = 0; i < n->nvals; i++) {
    const FeValue *x = &n->vals[i];
    int w = x->kind == FE_VAL_IDENT ? word_index(lora_target_words, x->text) : -1;
    if (w < 0) {
      if (x->kind == FE_VAL_IDENT)
        ir_error_at(c->d, x->loc, "unknown lora target '%s': the targets are " LORA_TARGETS, x->text);
      else
        ir_error_at(c->d, x->loc, "expected a lora target for 'targets', got %s: the targets are " LORA_TARGETS,
                    shown(x, buf, sizeof buf));
      const char *best = x->kind == FE_VAL_IDENT && strlen(x->text) > 1
                             ? ir_closest(x->text, lora_target_words, nwords(lora_target_words)) : NULL;
      if (best)
        ir_note_at(c->d, x->loc, "did you mean '%s'?", best);
      continue;
    }
    if (*flags[w]) {
      ir_error_at(c->d, x->loc, "lora target '%s' given twice", x->text);
      for (int j = 0; j < i; j++)
        if (strcmp(n->vals[j].text, x->text) == 0) {
          ir_note_at(c->d, n->vals[j].loc, "first given here");
          break;
        }
      continue;
    }
    *flags[w] = true;
  }
}

// The adapters have no dropout: `dropout 0` is the one value (PEFT refuses dropout on expert
// parameters too).
static void finish_lora(Ctx *c, const FeNode *n, const char *variant, char *dst) {
  const FeLora *lo = (const FeLora *)dst;
  if (lo->dropout != 0)
    ir_error_at(c->d, lo->dropout_loc, "lora dropout %g: only dropout 0 is supported (moec's adapters have no "
                "dropout; PEFT refuses dropout on expert parameters too)", lo->dropout);
}

// parallel = "parallel" ( "auto" ";" | "{" [pp] ... [dp] [mp] [ep] [esp] "}" )
static void check_parallel(Ctx *c, const FeNode *parent, const FeNode *n, char *dst) {
  FeParallel *par = &((FeProgram *)dst)->parallel;
  switch (auto_or_block(c, n, "parallel", "dp N; mp N; ep N; esp N;")) {
  case CHOSE_BLOCK:
    check_block(c, n, &parallel_block, NULL, (char *)par);
    break;
  case CHOSE_AUTO:
    par->is_auto = true;
    break;
  case CHOSE_NEITHER:
    break;
  }
}

// ffn mixtral has no activation choice and no bias; ffn oss no activation choice and always its
// biases.
static void finish_ffn(Ctx *c, const FeNode *n, const char *variant, char *dst) {
  FeExperts *e = (FeExperts *)dst;
  if (variant && (strcmp(variant, "mixtral") == 0 || strcmp(variant, "oss") == 0)) {
    e->act = NULL;
    e->bias = strcmp(variant, "oss") == 0;
  }
}

// The shared expert is SwiGLU (ffn mixtral), as in Qwen2-MoE and DeepSeek.
static void finish_shared(Ctx *c, const FeNode *n, const char *variant, char *dst) {
  FeMoe *m = (FeMoe *)dst;
  if (m->shared.kind && strcmp(m->shared.kind, "mixtral") != 0) {
    ir_error_at(c->d, m->shared.kind_loc, "the shared expert is a SwiGLU FFN: write 'ffn mixtral { hidden N; }', "
                "not 'ffn %s'", m->shared.kind);
  }
  m->shared.count = 1;
}

// Which gates take `renormalize`, from the registry: "only 'gate gshard', 'gate sigmoid' and 'gate
// xmoe' have it".
static void renormalize_note(Ctx *c, SrcLoc at) {
  char list[256];
  size_t len = 0;
  int count = 0;
  list[0] = '\0';
  for (int i = 0; i < fe_gate_count; i++) {
    if (!(fe_gates[i].fields & FE_GATE_FIELD(FE_GATE_F_RENORM)))
      continue;
    bool last = true;
    for (int j = i + 1; j < fe_gate_count; j++)
      last &= !(fe_gates[j].fields & FE_GATE_FIELD(FE_GATE_F_RENORM));
    const char *sep = count == 0 ? "" : last ? " and " : ", ";
    if (len < sizeof list)
      len += snprintf(list + len, sizeof list - len, "%s'gate %s'", sep, fe_gates[i].name);
    count++;
  }
  ir_note_at(c->d, at, "only %s %s it: %s the k chosen scores to sum 1", list, count == 1 ? "has" : "have",
             count == 1 ? "it scales" : "they scale");
}

// Every field written must be one the gate accepts (its row in the registry); `capacity *` is
// dropless, which only token-choice gates have. `renormalize` defaults to k > 1 where it applies,
// except with sigmoid scores (each expert's own score scales its output unless asked).
static void finish_gate(Ctx *c, const FeNode *n, const char *variant, char *dst) {
  FeGate *g = (FeGate *)dst;
  const FeGateDef *def = variant ? fe_gate_find(variant) : NULL;
  static const char *const names[] = {"k", "capacity", "noise", "aux_loss", "z_loss", "groups", "proj", "slots",
                                      "renormalize", "aux", "bias", "expert_groups", "topk_groups", "group_score",
                                      "scale", "balance"};
  for (int f = 0; def && f < COUNT(names); f++) {
    if (!g->field_loc[f].src || (def->fields & FE_GATE_FIELD(f)) || f == FE_GATE_F_PROJ || f == FE_GATE_F_SLOTS)
      continue;
    ir_error_at(c->d, g->field_loc[f], "'%s' does not apply to gate '%s' (%s)", names[f], def->name, def->doc);
    if (f == FE_GATE_F_RENORM)
      renormalize_note(c, g->field_loc[f]);
    if (f == FE_GATE_F_AUX_FORM)
      ir_note_at(c->d, g->field_loc[f], "only 'gate gshard' and 'gate sigmoid' have it: 'aux pooled' is transformers' "
                                        "load-balancing loss over the softmax of the logits (gshard), 'aux sequence' "
                                        "DeepSeek-V3's per sequence");
    if (f == FE_GATE_F_BIAS)
      ir_note_at(c->d, g->field_loc[f], "only 'gate gshard' and 'gate sigmoid' have it: a learned bias added to the "
                                        "router's logits");
    if (f >= FE_GATE_F_EXPERT_GROUPS && f <= FE_GATE_F_BALANCE)
      ir_note_at(c->d, g->field_loc[f], "only 'gate gshard' and 'gate sigmoid' have it: it shapes the top-k choice of "
                                        "each token");
  }
  if (!g->field_loc[FE_GATE_F_TOPK_GROUPS].src)
    g->topk_groups = g->expert_groups;
  if (g->field_loc[FE_GATE_F_TOPK_GROUPS].src && g->topk_groups > g->expert_groups)
    ir_error_at(c->d, g->field_loc[FE_GATE_F_TOPK_GROUPS], "topk_groups %lld is more than the %lld expert groups",
                (long long)g->topk_groups, (long long)g->expert_groups);
  if (g->dropless && def && strcmp(def->name, "expert_choice") == 0)
    ir_error_at(c->d, g->field_loc[FE_GATE_F_CAPACITY],
                "'capacity *' (dropless) does not apply to gate 'expert_choice': each expert takes a fixed number of tokens");
  if (g->dropless)
    g->capacity = 0;
  if (def && (def->fields & FE_GATE_FIELD(FE_GATE_F_AUX_FORM)) && g->aux_form && strcmp(g->aux_form, "pooled") == 0 &&
      strcmp(def->name, "gshard") != 0)
    ir_error_at(c->d, g->field_loc[FE_GATE_F_AUX_FORM], "'aux pooled' is transformers' loss over the softmax of the "
                "logits: 'gate gshard' only ('aux group' or 'aux sequence' for 'gate %s')", def->name);
  if (!g->field_loc[FE_GATE_F_RENORM].src)
    g->renormalize = def && (def->fields & FE_GATE_FIELD(FE_GATE_F_RENORM)) && g->k > 1 && strcmp(def->name, "sigmoid") != 0;
}

// The group limit (`expert_groups`, `topk_groups`, `group_score`): equal groups of experts (at most
// 64), the best topk_groups of them hold at least k experts, and "top2" needs two experts a group.
static void check_expert_groups(Ctx *c, const FeGate *g, int64_t experts) {
  SrcLoc at = g->field_loc[FE_GATE_F_EXPERT_GROUPS];
  int64_t n = g->expert_groups;
  if (n <= 1)
    return;
  if (n > 64 || experts % n != 0) {
    ir_error_at(c->d, at, "expert_groups %lld does not split the %lld experts into equal groups%s", (long long)n,
                (long long)experts, n > 64 ? " (at most 64 groups)" : "");
    return;
  }
  int64_t per = experts / n;
  if (g->topk_groups * per < g->k)
    ir_error_at(c->d, g->field_loc[FE_GATE_F_TOPK_GROUPS].src ? g->field_loc[FE_GATE_F_TOPK_GROUPS] : at,
                "the %lld best groups of %lld experts hold fewer than the k %lld chosen experts",
                (long long)g->topk_groups, (long long)per, (long long)g->k);
  if (per < 2 && strcmp(g->group_score, "top2") == 0)
    ir_error_at(c->d, at, "groups of one expert have no second best to sum (group_score top2); write 'group_score max;'");
}

// `bias true` gives q, k, v and the output projection biases, `qkv` the first three only.
static void finish_attention(Ctx *c, const FeNode *n, const char *variant, char *dst) {
  FeLayer *l = (FeLayer *)dst;
  l->attn_bias = strcmp(l->attn_bias_kind, "false") != 0;
  l->attn_bias_out = strcmp(l->attn_bias_kind, "true") == 0;
}

// ---- semantic rules ----

// A layer holds one of `moe` or `mlp`; `mlp` and `attention` need a language model, whose
// layers all have attention (lang/manual.md §7.2). False when the layer's parts do not fit.
static bool check_layer_parts(Ctx *c, const FeProgram *p, FeLayer *l, const FeNode *ln) {
  char head[64];
  bool lm = c->model_ok && p->model.has_vocab;
  if (!l->has_moe && !l->has_mlp) {
    if (lm)
      ir_error_at(c->d, stmt_loc(ln), "missing 'moe' or 'mlp' in '%s': a layer of a language model holds one of them",
                  fe_stmt_text(ln, head, sizeof head, 40));
    else
      ir_error_at(c->d, stmt_loc(ln), "missing 'moe' in '%s'", fe_stmt_text(ln, head, sizeof head, 40));
    return false;
  }
  if (l->has_moe && l->has_mlp) {
    ir_error_at(c->d, l->mlp.loc, "a layer holds one of 'moe' or 'mlp', not both");
    ir_note_at(c->d, l->moe.loc, "'moe' written here");
    return false;
  }
  bool ok = true;
  if (c->model_ok && !p->model.has_vocab) {
    if (l->has_mlp)
      ok = ir_error_at(c->d, l->mlp.loc, "'mlp' (a dense FFN layer) belongs to a language model: add 'vocab N;' "
                       "to the model");
    if (l->has_attention)
      ok = ir_error_at(c->d, l->attention_loc, "'attention' needs a language model: add 'vocab N;' to the model "
                       "(without it a model is a stack of MoE layers on float inputs)");
  }
  if (lm && !l->has_attention)
    ok = ir_error_at(c->d, stmt_loc(ln), "a layer of a language model needs 'attention { heads N; }' in '%s'",
                     fe_stmt_text(ln, head, sizeof head, 40));
  if (l->has_mlp && l->mlp.kind && strcmp(l->mlp.kind, "oss") == 0)   // gpt-oss's layers are all MoE
    ok = ir_error_at(c->d, l->mlp.kind_loc, "'ffn oss' is an expert (gpt-oss's layers are all MoE): a dense 'mlp' "
                     "is 'ffn gpt' or 'ffn mixtral'");
  if (l->has_mlp)
    l->mlp.count = 1;
  return ok;
}

// heads, kv_heads and head_dim against the model and the layout; fills in head_dim when not
// written (embed/heads).
// Multi-head latent attention (`mla { ... }`): its own head widths (no head_dim, kv_heads or
// qk_norm), rope positions of an even width turning whole (no `partial`), v at most nope + rope
// wide (the attention pads v to the heads' width), biases on all of its projections or none, and
// heads that MP splits evenly.
static void check_mla(Ctx *c, const FeProgram *p, FeLayer *l, const FeNode *an) {
  const FeModel *m = &p->model;
  const FeNode *mn = find_kid(an, "mla");
  SrcLoc at = l->mla_loc;
  if (l->kv_heads != l->heads)
    ir_error_at(c->d, kid_loc(an, "kv_heads", at), "kv_heads %lld with mla: every head has its own keys and values from "
                "the latent (kv_heads is heads)", (long long)l->kv_heads);
  if (kid_loc(an, "head_dim", (SrcLoc){0}).src)
    ir_error_at(c->d, kid_loc(an, "head_dim", at), "head_dim with mla: the heads are nope + rope wide (q, k) and v wide");
  if (l->qk_norm)
    ir_error_at(c->d, l->qk_norm_loc, "qk_norm with mla: its latents have their own RMSNorms");
  if (strcmp(l->attn_bias_kind, "qkv") == 0)
    ir_error_at(c->d, kid_loc(an, "bias", at), "'bias qkv' with mla: 'bias true' gives its down projections and the "
                "output projection biases (attention_bias), 'bias false' none");
  if (!m->has_vocab || strcmp(m->position, "rope") != 0)
    ir_error_at(c->d, at, "mla turns the rope part of q and k: the model needs 'position rope;'");
  else if (m->rope_partial != 1)
    ir_error_at(c->d, m->rope_partial_loc, "'partial' with mla: its rope part turns whole ('rope %lld')",
                (long long)l->mla_rope);
  if (l->mla_rope % 2 != 0)
    ir_error_at(c->d, kid_loc(mn, "rope", at), "rope %lld is odd: rotary positions turn pairs of columns",
                (long long)l->mla_rope);
  if (l->mla_v > l->mla_nope + l->mla_rope)
    ir_error_at(c->d, kid_loc(mn, "v", at), "v %lld is wider than nope + rope = %lld: moec's mla pads v to the heads' "
                "width, not q and k to v's", (long long)l->mla_v, (long long)(l->mla_nope + l->mla_rope));
  if (c->parallel_ok && l->heads % p->parallel.mp != 0) {
    ir_error_at(c->d, kid_loc(an, "heads", at), "heads %lld cannot be split evenly over mp %lld ranks",
                (long long)l->heads, (long long)p->parallel.mp);
    ir_note_at(c->d, kid_loc(c->parallel_node, "mp", p->parallel.loc), "each mp rank computes heads/mp of the heads");
  }
  l->head_dim = l->mla_nope + l->mla_rope;
}

static void check_attention(Ctx *c, const FeProgram *p, FeLayer *l, const FeNode *ln) {
  const FeModel *m = &p->model;
  const FeParallel *par = &p->parallel;
  const FeNode *an = find_kid(ln, "attention");
  SrcLoc at = kid_loc(an, "heads", l->attention_loc);
  SrcLoc kv_at = kid_loc(an, "kv_heads", at);
  bool own_dim = l->head_dim > 0;   // `head_dim N`: the heads' width need not be embed/heads
  if (l->kv_heads == 0)
    l->kv_heads = l->heads;
  if (!c->model_ok)
    return;
  if (l->has_mla) {
    check_mla(c, p, l, an);
    return;
  }
  if (!own_dim && m->embed % l->heads != 0) {
    ir_error_at(c->d, at, "heads %lld does not divide embed %lld: each head gets embed/heads features",
                (long long)l->heads, (long long)m->embed);
    return;
  }
  if (!own_dim)
    l->head_dim = m->embed / l->heads;
  if (l->kv_heads > l->heads || l->heads % l->kv_heads != 0)
    ir_error_at(c->d, kv_at, "kv_heads %lld must divide heads %lld: each key/value head serves heads/kv_heads query heads",
                (long long)l->kv_heads, (long long)l->heads);
  if (m->has_vocab && strcmp(m->position, "rope") == 0 && l->head_dim % 2 != 0) {
    if (own_dim)
      ir_error_at(c->d, kid_loc(an, "head_dim", at), "rope needs an even head size, but head_dim is %lld: it rotates "
                  "pairs of a head's columns", (long long)l->head_dim);
    else
      ir_error_at(c->d, at, "rope needs an even head size, but embed/heads = %lld/%lld = %lld",
                  (long long)m->embed, (long long)l->heads, (long long)(m->embed / l->heads));
  }
  if (m->has_vocab && strcmp(m->position, "rope") == 0 && l->head_dim % 2 == 0 && m->rope_partial != 1) {
    // transformers: int(head_dim * partial_rotary_factor) columns turn
    int64_t turned = (int64_t)((double)l->head_dim * m->rope_partial);
    if (m->rope_partial > 1 || turned < 2 || turned % 2 != 0)
      ir_error_at(c->d, m->rope_partial_loc, "partial %g turns %lld of the %lld columns of a head; rope needs an even "
                  "number from 2 to all of them", m->rope_partial, (long long)turned, (long long)l->head_dim);
  }
  if (c->parallel_ok && (l->heads % par->mp != 0 || l->kv_heads % par->mp != 0)) {
    ir_error_at(c->d, l->heads % par->mp != 0 ? at : kv_at, "%s %lld cannot be split evenly over mp %lld ranks",
                l->heads % par->mp != 0 ? "heads" : "kv_heads",
                (long long)(l->heads % par->mp != 0 ? l->heads : l->kv_heads), (long long)par->mp);
    ir_note_at(c->d, kid_loc(c->parallel_node, "mp", par->loc), "each mp rank computes heads/mp of the heads");
  }
  // The whole-width norm's mean of squares runs over every head, which MP spreads over its ranks:
  // not computed across ranks (yet).
  if (c->parallel_ok && par->mp > 1 && l->qk_norm && strcmp(l->qk_norm, "whole") == 0) {
    ir_error_at(c->d, l->qk_norm_loc, "'qk_norm whole' normalises q and k across all their heads, but mp %lld "
                "splits the heads over its ranks and moec does not reduce a norm across them: use mp 1 or "
                "'qk_norm head'", (long long)par->mp);
    ir_note_at(c->d, kid_loc(c->parallel_node, "mp", par->loc), "each mp rank computes heads/mp of the heads");
  }
}

// The model-level rules of a language model, and the refusal of its options without `vocab`.
static void check_language_model(Ctx *c, const FeProgram *p) {
  const FeModel *m = &p->model;
  const FeOptimizer *o = &m->optimizer;
  if (o->decay_steps > 0 && o->decay_steps <= o->warmup)
    ir_error_at(c->d, o->loc, "decay_steps %lld must be larger than warmup %lld: the cosine decay runs from the end "
                "of the warmup to decay_steps", (long long)o->decay_steps, (long long)o->warmup);
  if (o->min_lr > o->lr)
    ir_error_at(c->d, o->loc, "min_lr %g is larger than lr %g", o->min_lr, o->lr);
  if (!m->has_vocab) {
    static const struct { const char *key; size_t present; size_t loc; } opts[] = {
      {"position", offsetof(FeModel, has_position), offsetof(FeModel, position_loc)},
      {"norm", offsetof(FeModel, has_norm), offsetof(FeModel, norm_loc)},
      {"tie_embeddings", offsetof(FeModel, has_tie), offsetof(FeModel, tie_loc)},
      {"vocab_parallel", offsetof(FeModel, has_vocab_parallel), offsetof(FeModel, vocab_parallel_loc)},
      {"data", offsetof(FeModel, has_data), offsetof(FeModel, data.loc)},
    };
    for (int i = 0; i < COUNT(opts); i++)
      if (*(const bool *)((const char *)m + opts[i].present))
        ir_error_at(c->d, *(const SrcLoc *)((const char *)m + opts[i].loc),
                    "'%s' belongs to a language model: add 'vocab N;' to the model", opts[i].key);
    return;
  }
  if (m->vocab < 2)
    ir_error_at(c->d, m->vocab_loc, "vocab must be at least 2, got %lld", (long long)m->vocab);
  if (m->has_data && m->data.format && strcmp(m->data.format, "bytes") == 0 && m->vocab < 256)
    ir_error_at(c->d, m->data.loc, "format bytes reads every byte as a token, which needs vocab >= 256 (got %lld)",
                (long long)m->vocab);
}

// The pipeline's fields: microbatches divides the batch, pp at most the layer instances, pp_layers
// one count per stage adding up to them; `aux pooled` (one loss over every layer's routing)
// stays on one stage.
static void check_stages(Ctx *c, const FeProgram *p) {
  const FeParallel *par = &p->parallel;
  const FeNode *pn = c->parallel_node;
  if (!c->parallel_ok)
    return;
  if (c->model_ok && p->model.batch % par->microbatches != 0)
    ir_error_at(c->d, kid_loc(pn, "microbatches", par->loc),
                "microbatches %lld does not divide batch %lld: each microbatch holds batch/microbatches samples",
                (long long)par->microbatches, (long long)p->model.batch);
  int64_t instances = 0;
  for (int i = 0; i < p->nlayers; i++) instances += p->layers[i].repeat;
  if (par->pp > FE_MAX_STAGES)
    ir_error_at(c->d, kid_loc(pn, "pp", par->loc), "pp %lld: at most %d stages", (long long)par->pp, FE_MAX_STAGES);
  else if (par->pp > instances && instances > 0)   // (no layer at all: reported as such)
    ir_error_at(c->d, kid_loc(pn, "pp", par->loc),
                "pp %lld is larger than the %lld layer%s of the model: every stage holds at least one layer",
                (long long)par->pp, (long long)instances, instances == 1 ? "" : "s");
  if (par->npp_layers > 0) {
    int64_t sum = 0;
    for (int i = 0; i < par->npp_layers; i++) sum += par->pp_layers[i];
    if (par->npp_layers != par->pp)
      ir_error_at(c->d, par->pp_layers_loc, "pp_layers names %d stage%s, but pp is %lld", par->npp_layers,
                  par->npp_layers == 1 ? "" : "s", (long long)par->pp);
    else if (sum != instances)
      ir_error_at(c->d, par->pp_layers_loc, "pp_layers adds up to %lld layers, but the model has %lld", (long long)sum,
                  (long long)instances);
  }
  if (par->pp > 1)
    for (int i = 0; i < p->nlayers; i++)
      if (c->layer_ok[i] && p->layers[i].has_moe && p->layers[i].moe.gate.aux_form &&
          strcmp(p->layers[i].moe.gate.aux_form, "pooled") == 0) {
        ir_error_at(c->d, p->layers[i].moe.gate.field_loc[FE_GATE_F_AUX_FORM],
                    "'aux pooled' with pp %lld: the pooled loss sums the routing of every layer at once, and the "
                    "stages hold different layers; use 'aux group' or pp 1", (long long)par->pp);
        break;
      }
}

// Where the lora target `word` is written in `targets` (the statement when it is not there).
static SrcLoc lora_target_at(const Ctx *c, const FeLora *lo, const char *word) {
  const FeNode *n = c->lora_targets;
  for (int i = 0; n && i < n->nvals; i++)
    if (n->vals[i].kind == FE_VAL_IDENT && strcmp(n->vals[i].text, word) == 0)
      return n->vals[i].loc;
  return lo->targets_loc;
}

// LoRA (lang/manual.md §7.3): every target names weights the model has (q k v o: a language
// model's attention; experts: a moe layer; shared: a shared expert; mlp: a dense layer). Every
// layout runs the adapters (MP, EP and ESP split them as their base weights, lower_ops.c).
static void check_lora(Ctx *c, const FeProgram *p) {
  const FeModel *m = &p->model;
  const FeLora *lo = &m->lora;
  bool layers_ok = true, moe = false, shared = false, mlp = false;
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *l = &p->layers[i];
    layers_ok &= c->layer_ok[i];
    moe |= l->has_moe;
    shared |= l->has_moe && l->moe.has_shared;
    mlp |= l->has_mlp;
  }
  if (!m->has_vocab && (lo->q || lo->k || lo->v || lo->o)) {
    // at the first attention target written
    const FeNode *tn = c->lora_targets;
    SrcLoc at = lo->targets_loc;
    const char *word = lo->q ? "q" : lo->k ? "k" : lo->v ? "v" : "o";
    for (int i = 0; tn && i < tn->nvals; i++)
      if (tn->vals[i].kind == FE_VAL_IDENT && strlen(tn->vals[i].text) == 1 && strchr("qkvo", tn->vals[i].text[0])) {
        at = tn->vals[i].loc;
        word = tn->vals[i].text;
        break;
      }
    ir_error_at(c->d, at, "lora target '%s' adapts the attention's projections, which only a language model has: "
                "add 'vocab N;' to the model (without it a model is a stack of MoE layers)", word);
  }
  if (layers_ok && lo->experts && !moe)
    ir_error_at(c->d, lora_target_at(c, lo, "experts"), "lora target 'experts' adapts the routed experts, but no "
                "layer has a 'moe' block");
  if (layers_ok && lo->shared && !shared)
    ir_error_at(c->d, lora_target_at(c, lo, "shared"), "lora target 'shared' adapts the shared expert, but no layer's "
                "'moe' has a 'shared' block");
  if (layers_ok && lo->mlp && !mlp)
    ir_error_at(c->d, lora_target_at(c, lo, "mlp"), "lora target 'mlp' adapts the dense layers' 'mlp', but no layer "
                "has one");
  // DeepSeek's latent attention makes keys and values with the same projections (kv_a_proj_with_mqa,
  // kv_b_proj): their adapters are k's and v's at once (frontend/lower_ops.c fe_lora_target), as a
  // PEFT adapter of them is; one of the two alone would mean both, so it is refused.
  for (int i = 0; m->has_vocab && lo->k != lo->v && i < p->nlayers; i++)
    if (c->layer_ok[i] && p->layers[i].has_mla) {
      const char *word = lo->k ? "k" : "v", *other = lo->k ? "v" : "k";
      ir_error_at(c->d, lora_target_at(c, lo, word), "lora target '%s' without '%s': layer '%s' has 'mla' attention, "
                  "whose keys and values come from the same projections (attn.wkv_a and attn.wkv_b, DeepSeek's "
                  "kv_a_proj_with_mqa and kv_b_proj), which k and v adapt together; write both k and v, or neither",
                  word, other, p->layers[i].name);
      break;
    }
}

// Each rule reads only statements that checked cleanly (model_ok, parallel_ok, layer_ok).
static void check_semantics(Ctx *c, FeProgram *p) {
  const FeModel *m = &p->model;
  const FeParallel *par = &p->parallel;
  const FeNode *pn = c->parallel_node;
  SrcLoc ploc = par->loc;
  bool par_ok = c->parallel_ok;
  // mp/esp groups are consecutive ranks: both factorisations must cover the same world.
  if (par_ok && par->dp * par->mp != par->ep * par->esp)
    ir_error_at(c->d, ploc,
                "dp*mp must equal ep*esp (both are the number of ranks), but dp*mp = %lld*%lld = %lld "
                "and ep*esp = %lld*%lld = %lld",
                (long long)par->dp, (long long)par->mp, (long long)(par->dp * par->mp),
                (long long)par->ep, (long long)par->esp, (long long)(par->ep * par->esp));
  check_stages(c, p);
  // A program runs one microbatch at a time: its tokens are the microbatch's.
  bool micro_ok = c->model_ok && par_ok && m->batch % par->microbatches == 0;
  int64_t batch = micro_ok ? m->batch / par->microbatches : m->batch;
  int64_t tokens = batch * m->seqlen;  // both <= INT32_MAX: no overflow
  bool tokens_ok = micro_ok && tokens % par->mp == 0;
  if (micro_ok && !tokens_ok)
    ir_error_at(c->d, kid_loc(pn, "mp", ploc),
                "mp %lld does not divide the %lld tokens of a %s (batch*seqlen = %lld*%lld): "
                "tokens are split evenly over the mp ranks",
                (long long)par->mp, (long long)tokens, par->microbatches > 1 ? "microbatch" : "step",
                (long long)batch, (long long)m->seqlen);
  if (c->model_ok)
    check_language_model(c, p);
  if (c->model_ok && par_ok && m->vocab_parallel && m->has_vocab && m->vocab % par->mp != 0)
    ir_error_at(c->d, m->vocab_parallel_loc,
                "vocab_parallel splits the vocabulary's rows over the mp %lld ranks, but mp does not divide vocab %lld",
                (long long)par->mp, (long long)m->vocab);
  for (int i = 0; i < p->nlayers; i++) {
    if (!c->layer_ok[i])
      continue;
    FeLayer *l = &p->layers[i];
    const FeNode *ln = c->layer_nodes[i];
    if (!check_layer_parts(c, p, l, ln))
      continue;
    if (l->has_attention)
      check_attention(c, p, l, ln);
    if (l->has_mlp && par_ok && l->mlp.hidden % par->mp != 0) {
      const FeNode *ffn = find_kid(find_kid(ln, "mlp"), "ffn");
      ir_error_at(c->d, kid_loc(ffn, "hidden", l->mlp.kind_loc), "hidden %lld cannot be split evenly over mp %lld ranks",
                  (long long)l->mlp.hidden, (long long)par->mp);
      ir_note_at(c->d, kid_loc(pn, "mp", ploc), "each mp rank holds hidden/mp columns of the mlp");
    }
    if (!l->has_moe)
      continue;
    const FeMoe *moe = &l->moe;
    if (par_ok && moe->experts.count % par->ep != 0) {
      ir_error_at(c->d, moe->experts.loc, "%lld experts cannot be split evenly over ep %lld ranks",
                  (long long)moe->experts.count, (long long)par->ep);
      ir_note_at(c->d, kid_loc(pn, "ep", ploc), "the number of experts must be a multiple of ep");
    }
    if (moe->gate.k > moe->experts.count)
      ir_error_at(c->d, moe->gate.field_loc[FE_GATE_F_K], "k %lld is larger than the number of experts (%lld)",
                  (long long)moe->gate.k, (long long)moe->experts.count);
    else
      check_expert_groups(c, &moe->gate, moe->experts.count);
    if (par_ok && par->mp > 1 && fe_aux_sequence(&moe->gate))
      ir_error_at(c->d, moe->gate.field_loc[FE_GATE_F_AUX_FORM], "'aux sequence' with mp %lld: MP splits a sequence's "
                  "tokens over its ranks, and moec takes the loss per sequence on one rank; use dp, ep and esp",
                  (long long)par->mp);
    if (par_ok && moe->experts.hidden % par->esp != 0) {
      const FeNode *ffn = find_kid(find_kid(find_kid(ln, "moe"), "experts"), "ffn");
      ir_error_at(c->d, kid_loc(ffn, "hidden", moe->experts.kind_loc),
                  "hidden %lld cannot be split evenly over esp %lld ranks",
                  (long long)moe->experts.hidden, (long long)par->esp);
      ir_note_at(c->d, kid_loc(pn, "esp", ploc), "each esp rank holds hidden/esp columns of every expert");
    }
    if (tokens_ok && (tokens / par->mp) % moe->gate.groups != 0) {
      SrcLoc at = moe->gate.field_loc[FE_GATE_F_GROUPS];
      if (par->mp == 1)
        ir_error_at(c->d, at, "groups %lld does not divide the %lld tokens of a rank (batch*seqlen = "
                    "%lld*%lld): routing groups must be equal",
                    (long long)moe->gate.groups, (long long)tokens, (long long)batch, (long long)m->seqlen);
      else
        ir_error_at(c->d, at, "groups %lld does not divide the %lld tokens of a rank (batch*seqlen/mp = "
                    "%lld*%lld/%lld): routing groups must be equal",
                    (long long)moe->gate.groups, (long long)(tokens / par->mp), (long long)batch,
                    (long long)m->seqlen, (long long)par->mp);
    }
  }
  if (c->model_ok && m->has_lora)
    check_lora(c, p);
}

// The rules of check_semantics that read the layout, as one sentence for the first that a
// layout breaks (the layout search of `parallel auto;`, cli/layout.c).
bool fe_layout_refusal(const FeProgram *p, const FeParallel *par, char *why, size_t n) {
  const FeModel *m = &p->model;
  long long tokens = (long long)(m->batch * m->seqlen);
  if (par->dp * par->mp != par->ep * par->esp) {
    snprintf(why, n, "dp*mp = %lld is not ep*esp = %lld", (long long)(par->dp * par->mp), (long long)(par->ep * par->esp));
    return true;
  }
  if (tokens % par->mp != 0) {
    snprintf(why, n, "mp %lld does not divide the %lld tokens of a step", (long long)par->mp, tokens);
    return true;
  }
  if (m->vocab_parallel && m->vocab % par->mp != 0) {
    snprintf(why, n, "vocab_parallel: mp %lld does not divide the vocabulary of %lld tokens", (long long)par->mp,
             (long long)m->vocab);
    return true;
  }
  for (int i = 0; i < p->nlayers; i++) {
    const FeLayer *l = &p->layers[i];
    if (l->has_attention && (l->heads % par->mp != 0 || l->kv_heads % par->mp != 0)) {
      bool h = l->heads % par->mp != 0;
      snprintf(why, n, "layer %s: %s %lld cannot be split over mp %lld", l->name, h ? "heads" : "kv_heads",
               (long long)(h ? l->heads : l->kv_heads), (long long)par->mp);
      return true;
    }
    if (l->has_attention && par->mp > 1 && l->qk_norm && strcmp(l->qk_norm, "whole") == 0) {
      snprintf(why, n, "layer %s: 'qk_norm whole' needs mp 1", l->name);
      return true;
    }
    if (l->has_mlp && l->mlp.hidden % par->mp != 0) {
      snprintf(why, n, "layer %s: mlp hidden %lld cannot be split over mp %lld", l->name, (long long)l->mlp.hidden,
               (long long)par->mp);
      return true;
    }
    if (!l->has_moe)
      continue;
    const FeMoe *moe = &l->moe;
    if (moe->experts.count % par->ep != 0) {
      snprintf(why, n, "layer %s: %lld experts cannot be split over ep %lld", l->name, (long long)moe->experts.count,
               (long long)par->ep);
      return true;
    }
    if (moe->experts.hidden % par->esp != 0) {
      snprintf(why, n, "layer %s: expert hidden %lld cannot be split over esp %lld", l->name,
               (long long)moe->experts.hidden, (long long)par->esp);
      return true;
    }
    if ((tokens / par->mp) % moe->gate.groups != 0) {
      snprintf(why, n, "layer %s: groups %lld does not divide the %lld tokens of an mp rank", l->name,
               (long long)moe->gate.groups, tokens / (long long)par->mp);
      return true;
    }
  }
  return false;
}

// ---- entry points ----
FeProgram *fe_check(IrDiag *d, FeTree *tree) {
  fe_registry_init();
  int errors = d->errors;
  const FeNode *root = tree->root;
  SrcLoc start = {.src = tree->src, .line = 1, .col = 1, .len = 1};
  if (root->nkids == 0) {
    ir_error_at(d, start, "empty file: expected a 'model' block");
    return NULL;
  }
  FeProgram *p = fe_arena_alloc(tree->arena, sizeof *p);
  if (!p) {
    ir_oom(d);
    return NULL;
  }
  Ctx c = {.d = d, .arena = tree->arena, .prog = p, .all_blocks = moe_blocks, .root_loc = start,
           .parallel_ok = true};
  // A missing top-level statement is reported at the model when there is one.
  const FeNode *model = find_kid(root, "model");
  if (model)
    c.root_loc = stmt_loc(model);
  apply_defaults(&moe_file_block, (char *)p);
  check_block(&c, root, &moe_file_block, NULL, (char *)p);
  check_semantics(&c, p);
  if (d->errors != errors)
    return NULL;
  p->tree = tree;
  return p;
}

bool fe_check_cluster(IrDiag *d, FeTree *tree, FeCluster *out) {
  int errors = d->errors;
  SrcLoc start = {.src = tree->src, .line = 1, .col = 1, .len = 1};
  memset(out, 0, sizeof *out);
  if (tree->root->nkids == 0)
    return ir_error_at(d, start, "empty file: expected a 'cluster' block");
  Ctx c = {.d = d, .arena = tree->arena, .all_blocks = cluster_blocks, .root_loc = start};
  apply_defaults(&cluster_file_block, (char *)out);
  check_block(&c, tree->root, &cluster_file_block, NULL, (char *)out);
  return d->errors == errors;
}

void fe_program_free(FeProgram *p) {
  if (p)
    fe_tree_free(p->tree);  // p itself lives in the tree's arena
}
