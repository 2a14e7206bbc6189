// The front end: .moe and .cluster text -> a generic statement tree (lang/parser.y) -> a typed,
// checked program (frontend/check.c) -> IR (frontend/lower.c).
//
// Both file kinds share one grammar: a file is a list of statements, and a statement is a
// keyword, zero or more values, then either ';' or a '{ statement* }' block:
//
//   layer block x 12 { moe { gate gshard { k 2; capacity 1.2; } order tutel; } }
//
// The grammar stays small and every keyword, field, type and range is checked against the
// schema in check.c, which gives precise diagnostics ("unknown gate 'gshrad'; did you mean
// 'gshard'?", "missing field 'hidden' in 'ffn gpt'").
#ifndef FE_H
#define FE_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "../ir/ir.h"

// ---- the statement tree (built by the parser; frontend/ast.c) ----
typedef enum FeValKind { FE_VAL_IDENT, FE_VAL_INT, FE_VAL_FLOAT, FE_VAL_STRING, FE_VAL_STAR } FeValKind;

typedef struct FeValue {
  FeValKind kind;
  const char *text;   // identifier, string contents (unescaped) or the literal as written
  int64_t i;          // FE_VAL_INT
  double f;           // FE_VAL_FLOAT (and FE_VAL_INT converted)
  SrcLoc loc;
} FeValue;

typedef struct FeNode {
  const char *key;     // the keyword
  SrcLoc loc;          // of the keyword
  FeValue *vals;
  int nvals;
  struct FeNode **kids;
  int nkids;
  bool has_block;      // written with '{ ... }' rather than ';'
  SrcLoc end_loc;      // the closing '}' or ';'
} FeNode;

typedef struct FeArena FeArena;

typedef struct FeTree {
  FeNode *root;        // key "", kids = top-level statements
  FeArena *arena;
  const IrSource *src;
} FeTree;

// Parses src (a .moe or .cluster file). Syntax errors go through d; returns NULL if any.
FeTree *fe_parse(IrDiag *d, const IrSource *src);
void fe_tree_free(FeTree *t);

// ---- the checked program (frontend/check.c) ----
typedef struct FeOptimizer {
  SrcLoc loc;
  const char *name;     // "sgd" | "adamw"
  double lr, beta1, beta2, eps, weight_decay;
  int64_t warmup, decay_steps;   // language models' schedule (lang/manual.md §7.2); 0: none
  double min_lr, clip;           // clip 0: no gradient clipping
  bool shard;                    // adamw: the moments sharded over each parameter's replicas (ZeRO-1)
} FeOptimizer;

// `data { train "F"; val "F"; format u16|bytes|llmc; }` of a language model.
typedef struct FeData {
  SrcLoc loc;
  const char *train, *val;   // NULL when not given
  const char *format;        // "u16" | "bytes" | NULL (by extension)
} FeData;

// `lora { r R; alpha A; targets q k v o experts shared mlp; dropout 0; }` in the model block
// (lang/manual.md §7.3): the base weights frozen, low-rank adapters trained on the targets.
typedef struct FeLora {
  SrcLoc loc;
  int64_t r;                 // the adapters' rank
  double alpha;              // the update's scale is alpha / r (PEFT's lora_alpha; default 8, as PEFT's)
  double dropout;            // only 0 (PEFT refuses dropout on expert parameters too)
  SrcLoc dropout_loc, targets_loc;
  // targets: the attention's projections (q k v o), the routed experts' tensors, the shared
  // expert, the dense layers' MLPs
  bool q, k, v, o, experts, shared, mlp;
} FeLora;

typedef struct FeModel {
  SrcLoc loc;
  const char *name;
  const char *dtype;    // "fp32" | "bf16"
  const char *recompute;   // "none" | "activations" | "norms" | "layers": saved values made again in the backward
  SrcLoc dtype_loc;
  int64_t batch, seqlen, embed, seed;
  FeOptimizer optimizer;
  // A language model (lang/manual.md §7.2) when has_vocab; the fields below it are its options and are
  // refused without `vocab` (their present flags say whether they were written).
  bool has_vocab;
  SrcLoc vocab_loc;
  int64_t vocab;
  const char *position;      // "learned" | "rope"
  SrcLoc position_loc;
  bool has_position;
  double rope_theta;         // default 10000
  double rope_partial;       // the part of each head rope turns (GLM's partial_rotary_factor); default 1
  SrcLoc rope_partial_loc;
  bool rope_interleave;      // rope turns adjacent pairs (2c, 2c+1) (DeepSeek's); default false: halves
  // `yarn { ... }`: YaRN's rope scaling (transformers' rope_type "yarn"): the frequencies blended
  // between theta's and theta's / factor over the pairs of original positions' correction range
  // (beta_fast, beta_slow), cos and sin times attention_factor from mscale, mscale_all_dim
  bool has_yarn;
  SrcLoc yarn_loc;
  double yarn_factor, yarn_beta_fast, yarn_beta_slow, yarn_mscale, yarn_mscale_all_dim;
  int64_t yarn_original;
  bool yarn_truncate;   // `truncate false`: the ramp's ends not rounded to whole pairs (gpt-oss)
  const char *norm;          // "layernorm" | "rmsnorm"
  SrcLoc norm_loc;
  bool has_norm;
  double norm_eps;           // default 1e-5
  bool tie_embeddings;       // default true
  SrcLoc tie_loc;
  bool has_tie;
  bool vocab_parallel;       // `vocab_parallel true;`: the embedding, head and loss split over MP
  SrcLoc vocab_parallel_loc;
  bool has_vocab_parallel;
  FeData data;
  bool has_data;
  FeLora lora;
  bool has_lora;
} FeModel;

#define FE_MAX_STAGES 64
typedef struct FeParallel {
  SrcLoc loc;           // no source when the block is absent (all 1)
  int64_t dp, mp, ep, esp;
  // Pipeline stages (lang/manual.md §6): the layers split over pp stages of dp*mp ranks each, a
  // step's batch in `microbatches` microbatches (default 1; also without pp: gradient
  // accumulation), scheduled gpipe or 1f1b (default). pp_layers: the layer instances of each
  // stage (npp_layers == pp when written; 0: the compiler's balance).
  int64_t pp, microbatches;
  const char *pp_schedule;
  int npp_layers;
  int64_t pp_layers[FE_MAX_STAGES];
  SrcLoc pp_layers_loc;
  // `parallel auto;`: the layout is chosen for the cluster by `moec build` (cli/layout.c,
  // lang/manual.md §6); the degrees above stay 1 until then.
  bool is_auto;
} FeParallel;

typedef struct FeGate {
  SrcLoc loc;           // of the gate's name
  const char *name;     // gshard | sigmoid | xmoe | expert_choice | softmoe
  int64_t k;            // default 1
  double capacity;      // default 1.0
  bool dropless;        // `capacity *`
  double noise, aux_loss, z_loss;   // defaults 0
  int64_t groups;       // default 1
  int64_t proj;         // xmoe, default 16
  int64_t slots;        // softmoe, default 1
  bool renormalize;     // gshard, xmoe, sigmoid: the k gates scaled to sum 1; default k > 1 (sigmoid: false)
  const char *aux_form; // gshard, sigmoid: "group" (default, manual §11.3) | "pooled" (transformers' form, gshard) |
                        // "sequence" (DeepSeek-V3's sequence-wise loss)
  bool bias;            // gshard, sigmoid: a learned router bias, logits = x·Wg + bg (gpt-oss's router)
  // gshard, sigmoid: the group limit of the choice (DeepSeek's n_group, topk_group): the experts in
  // expert_groups equal groups (default 1: no limit), the k chosen among the topk_groups best groups
  // (default expert_groups), ranked by group_score "top2" (the sum of a group's two best; default) or "max"
  int64_t expert_groups, topk_groups;
  const char *group_score;
  double scale;         // gshard, sigmoid: the gates times scale after renormalize (routed_scaling_factor); default 1
  // gshard, sigmoid: `balance bias RATE`: a correction bias added to the scores for the choice only,
  // moved by RATE against the sign of each expert's load imbalance after every step (aux-loss-free)
  const char *balance;  // "bias" when written, NULL otherwise
  double balance_rate;
  SrcLoc field_loc[24]; // where fields were written (index: FE_GATE_F_*), for later diagnostics
} FeGate;
enum { FE_GATE_F_K, FE_GATE_F_CAPACITY, FE_GATE_F_NOISE, FE_GATE_F_AUX, FE_GATE_F_Z, FE_GATE_F_GROUPS, FE_GATE_F_PROJ, FE_GATE_F_SLOTS,
       FE_GATE_F_RENORM, FE_GATE_F_AUX_FORM, FE_GATE_F_BIAS, FE_GATE_F_EXPERT_GROUPS, FE_GATE_F_TOPK_GROUPS,
       FE_GATE_F_GROUP_SCORE, FE_GATE_F_SCALE, FE_GATE_F_BALANCE };

// The gate's aux loss is the pooled form (`aux pooled`, manual §11.3), or DeepSeek-V3's per sequence.
static inline bool fe_aux_pooled(const FeGate *g) { return g->aux_form && strcmp(g->aux_form, "pooled") == 0; }
static inline bool fe_aux_sequence(const FeGate *g) { return g->aux_form && strcmp(g->aux_form, "sequence") == 0; }

typedef struct FeExperts {
  SrcLoc loc;
  int64_t count;
  const char *kind;     // "gpt" | "mixtral" | "oss" (written `ffn gpt { ... }`)
  SrcLoc kind_loc;
  int64_t hidden;
  const char *act;      // an activation `act` offers (ir/activations.def; gpt; default gelu)
  SrcLoc act_loc;
  bool bias;            // gpt; default true (oss: always, mixtral: never)
} FeExperts;

typedef struct FeHook {
  SrcLoc loc;
  const char *point;    // before_moe_start | before_dispatch | after_dispatch | before_combine | after_combine | before_moe_end
  const char *action;   // compress | record
  const char *arg;      // fp16 | bf16 | int8 for compress, NULL otherwise
} FeHook;

typedef struct FeMoe {
  SrcLoc loc;
  FeExperts experts;
  FeGate gate;
  const char *order;    // tutel | gshard (default tutel)
  SrcLoc order_loc;
  const char *algo;     // nccl | 1dh | 2dh (default nccl)
  SrcLoc algo_loc;
  FeHook *hooks;
  int nhooks;
  // `shared { ffn mixtral { hidden Hs; } gate sigmoid; }`: one dense SwiGLU expert every token
  // goes through besides the routed ones (Qwen2-MoE, DeepSeek), its output optionally scaled by
  // sigmoid(x·w) per token; added to the routed output (lang/manual.md §11.5).
  bool has_shared;
  FeExperts shared;     // kind "mixtral", hidden Hs; loc: the `shared` statement
  bool shared_gated;    // `gate sigmoid;` written
  SrcLoc shared_gate_loc;
} FeMoe;

typedef struct FeLayer {
  SrcLoc loc;
  const char *name;
  int64_t repeat;       // `x N`, default 1
  bool has_attention;
  SrcLoc attention_loc;
  int64_t heads;
  int64_t kv_heads;     // default 0: heads
  int64_t head_dim;     // d, the width of a head; default 0: embed/heads (the checker fills it in)
  const char *attn_bias_kind;   // `bias true | false | qkv` as written (default "true")
  bool attn_bias;       // biases on q, k and v (bias true or qkv)
  bool attn_bias_out;   // a bias on the output projection (bias true)
  const char *qk_norm;  // `qk_norm head | whole`: RMSNorm of q and k before rope; NULL: none
  SrcLoc qk_norm_loc;
  int64_t window;       // `window W`: query i sees keys j with i - W < j <= i; 0: all keys j <= i
  SrcLoc window_loc;
  bool sinks;           // `sinks true`: a learned logit per head in each row's softmax (gpt-oss)
  // `mla { ... }`: multi-head latent attention (DeepSeek-V2/V3): q through a rank q_lora bottleneck
  // with its RMSNorm (0: one projection), keys and values from a rank kv_lora latent with its RMSNorm,
  // every head nope + rope wide for q and k (the rope part of k one for all heads), v wide for v
  bool has_mla;
  SrcLoc mla_loc;
  int64_t mla_q_lora, mla_kv_lora, mla_nope, mla_rope, mla_v;
  bool has_moe;
  FeMoe moe;
  bool has_mlp;         // a dense FFN layer of a language model (`mlp { ffn ... }`)
  FeExperts mlp;
} FeLayer;

typedef struct FeSchedule {
  SrcLoc loc;           // no source when absent
  const char *policy;   // default "sequential"
  SrcLoc policy_loc;
  bool pipeline_auto;   // default false: forward = backward = 1
  int64_t pipeline_fwd, pipeline_bwd;
  SrcLoc pipeline_loc;
  const char *grad_partition;   // "none" (default) | "auto" | "chunk"
  int64_t grad_chunk_bytes;
  SrcLoc grad_partition_loc;
} FeSchedule;

typedef struct FeCollective { double alpha, beta; } FeCollective;

enum { FE_MAX_GEMM_AT = 1024 };   // the most `gemm_at` statements a profile may hold
typedef struct FeCluster {
  SrcLoc loc;
  const char *name;
  int64_t nodes, gpus_per_node;
  FeCollective gemm, alltoall, allgather, reducescatter, allreduce;
  FeCollective elementwise;   // optional (0, 0 when absent)
  FeCollective attention;     // optional (0, 0 when absent: attention is priced as GEMMs)
  // Optional (0, 0 when absent): attention's backward, the element-wise ops that evaluate exp, tanh
  // or erf per element, and the optimizers' update per parameter (sched.h says how each prices).
  FeCollective attention_grad, elementwise_math, update_adamw, update_sgd;
  double handoff;             // optional (0 when absent)
  // Optional `expert_gemm_scale X;`: the expert GEMMs over their filled rows take X times what the
  // GEMM fits give for those rows (moec tune measures the GEMM the programs run; 0 when absent: 1).
  double expert_gemm_scale;
  double overlap_compute, overlap_comm;   // optional `overlap { compute X; comm Y; }` (0 when absent)
  // Optional fits of the collectives inside one node (0, 0 when absent: the layout search
  // then prices them from allgather and reducescatter, sched/sched_layout.c).
  FeCollective alltoall_intra, allreduce_intra;
  // Optional fits of a point-to-point message between pipeline stages, across nodes and inside one
  // (0, 0 when absent: sched_p2p_fit derives them from the AlltoAll fits).
  FeCollective p2p, p2p_intra;
  int64_t memory;             // optional `memory SIZE;`: bytes a rank may use (0: no limit known)
  SrcLoc memory_loc;
  // Optional `gemm_at M K N MS;` statements: one GEMM [M, K] x [K, N] measured at MS ms (moec
  // tune's grid of shapes; the GEMMs of a model are priced from them, `gemm` is then unused).
  double gemm_at[FE_MAX_GEMM_AT][4];
  int ngemm_at;
} FeCluster;

typedef struct FeProgram {
  FeModel model;
  FeParallel parallel;
  const char *cluster_path;   // the `cluster "F";` statement, or NULL
  SrcLoc cluster_loc;
  const char *hf_config_path; // the `hf_config "DIR";` statement (config.json and maybe
  SrcLoc hf_config_loc;       // generation_config.json for --export-hf), or NULL
  FeLayer *layers;
  int nlayers;
  FeSchedule schedule;
  FeTree *tree;               // owns every string above
  // The pipeline stage being lowered (0 .. parallel.pp - 1; set by the caller before fe_lower).
  int stage;
} FeProgram;

// Checks a parsed .moe tree against the language's schema and the semantic rules of the
// manual (dp*mp == ep*esp, experts % ep == 0, k <= experts, sizes > 0, required fields, ...).
// Reports every problem found through d; returns NULL if there was any.
FeProgram *fe_check(IrDiag *d, FeTree *tree);
// Whether the layout par breaks a rule of the model that reads the layout (dp*mp == ep*esp, mp
// divides the tokens, heads, kv_heads and mlp hidden; ep the experts, esp the expert hidden,
// routing groups the tokens of an mp rank): true with the first broken rule in why.
bool fe_layout_refusal(const FeProgram *p, const FeParallel *par, char *why, size_t n);
// Checks a parsed .cluster tree.
bool fe_check_cluster(IrDiag *d, FeTree *tree, FeCluster *out);
void fe_program_free(FeProgram *p);

// Reads, parses and checks a .moe file (or a buffer, for fuzzers). NULL on error.
FeProgram *fe_load(IrDiag *d, const IrSource *src);
// Reads, parses and checks a .cluster file; at is where it was named (for "cannot read").
bool fe_load_cluster(IrDiag *d, const char *path, SrcLoc at, FeCluster *out);

// ---- lowering (frontend/lower.c) ----
// What the target a module is lowered for can run: some refusals depend on it (`dtype bf16`
// runs where bf16 does). NULL (moec dump-ir, moec plan, tests) makes none of those: the IR itself
// does not depend on the target.
typedef struct FeTargetCaps {
  const char *name;   // the target's name
  bool bf16;          // trains dtype bf16 (bf16 GEMM inputs, fp32 master weights)
  bool shard_optimizer;   // `optimizer adamw { shard true; }`
  bool lora;              // `lora { ... }`: frozen base weights, trained adapters
} FeTargetCaps;
// Refuses, with a diagnostic naming it, every construct that parses and checks but does not
// run yet (on target); otherwise builds the forward IR module (params, @*.fwd, @loss.fwd).
IrModule *fe_lower(IrDiag *d, const FeProgram *p, const FeTargetCaps *target);
// The layer instances of pipeline stage `stage` (0 .. pp - 1): [*first, *first + *count) in file
// order. `pp_layers` when written, else the instances in equal parts, the earlier stages taking
// one more where they do not divide (the last stage also holds the head and the loss).
void fe_stage_layers(const FeProgram *p, int stage, int64_t *first, int64_t *count);

// ---- Hugging Face families (frontend/hf.c, lang/manual.md §19) ----
// What a binary's --export-hf writes (malloc'ed JSON texts): config.json; generation_config.json
// (NULL: none); and changes, the values of the `hf_config` folder's config.json that the model
// replaced ("key: old -> new", "; " between them; NULL: none); a LoRA model's adapter_config.json
// in PEFT's form (NULL: no lora block).
typedef struct FeHfExport {
  char *config, *generation, *changes, *adapter;
} FeHfExport;
// p's export: its family's config.json — the keys the model determines from the model, every
// other key of the `hf_config` folder's config.json as it is — and generation_config.json (the
// folder's, else the token ids of the config). False with why (n bytes) saying why p is no
// family, or with why[0] == 0 after reporting through d a folder that cannot be read.
bool fe_hf_export(IrDiag *d, const FeProgram *p, FeHfExport *out, char *why, size_t n);
void fe_hf_export_free(FeHfExport *e);
// path relative to the folder of the .moe file at names (malloc'd), or NULL: path is absolute, no
// file names it, or the file is in the current folder (load.c).
char *fe_path_beside(const char *path, SrcLoc at);
// The shortest text of v ("%.*g", 6 to 17 digits) that reads back as v; buf (n bytes) returned.
// config.json's floats and moec import-hf's .moe numbers.
const char *fe_float_text(double v, char *buf, size_t n);

#endif
