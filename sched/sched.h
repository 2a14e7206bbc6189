// The scheduling model of FSMoE (lang/manual.md §8, paper §4-§5): per-chunk costs of a generalized
// layer (dense attention + MoE) on a cluster profile, the four cases under Q1-Q7, Algorithm 1
// (per-phase pipeline degree r), the gradient partition (eqs. (3)-(4) + a global optimiser),
// the stream programs of the six policies, a discrete-event simulator that judges them, and
// Chrome-trace / SVG writers. Internal to the compiler: `moec plan` and `moec sweep` (cli/plan.c, cli/sweep.c),
// the pipeline pass (passes/degrees.c, which hands its amounts to gradpart) and the tests use it.
//
// Units: times in ms, sizes in elements (communication: elements each rank sends/receives;
// GEMMs: multiply-accumulates), t(n) = alpha + beta * n as in the .cluster files.
#ifndef SCHED_H
#define SCHED_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "ir.h"

#define SCHED_R_MAX 32              // pipeline degrees searched: 1..SCHED_R_MAX
#define SCHED_LINA_CHUNK_BYTES (30.0 * 1024 * 1024)   // PipeMoE+Lina's fixed gradient chunk
#define SCHED_GRAD_BYTES 4.0        // bytes per gradient element (fp32 gradients)
#define SCHED_DROPLESS_CAPACITY 1.5 // capacity factor standing in for `capacity *` (busiest expert at 1.5x the mean load)

// ---- policies: IrPolicy, ir_policy_name and ir_policy_parse (ir/ir.h), one table for all ----

// ---- cluster and layers ----
typedef struct SchedCoef {
  double alpha, beta;
} SchedCoef;

// One GEMM [m, k] x [k, n] of a profile's grid and its time (`gemm_at`, moec tune).
enum { SCHED_MAX_GEMM_AT = 1024 };
typedef struct SchedGemmAt {
  double m, k, n, ms;
} SchedGemmAt;

typedef struct SchedCluster {
  const char *name;
  int nodes, gpus_per_node;
  SchedCoef gemm, alltoall, allgather, reducescatter, allreduce;
  SchedCoef elementwise;  // the ops without a GEMM or a collective, n = floats read and written
                          // (0, 0: not in the profile, those ops are free)
  SchedCoef attention;    // causal attention, n = multiply-accumulates (0, 0: priced as GEMMs)
  SchedCoef attention_grad;     // its backward (the statistics and the gradients), n = the
                                // forward's multiply-accumulates times 2 (0, 0: priced as attention)
  SchedCoef elementwise_math;   // the ops that evaluate exp, tanh or erf per element (activations,
                                // softmaxes, losses), n = elements (0, 0: priced as elementwise)
  SchedCoef update_adamw, update_sgd;   // the optimizer, n = parameters (0, 0: as elementwise)
  double handoff;         // ms a chunked collective pays for its two stream hand-offs (0: none)
  double expert_gemm_scale;   // the expert GEMMs over their filled rows take this times the GEMM
                              // fits' time for those rows (0: 1)
  double overlap_compute, overlap_comm;   // relative slowdowns of computation and communication
                                          // that run at once (0: none; a CPU rank's are not)
  SchedCoef alltoall_intra, allreduce_intra;   // inside one node (0, 0: not in the profile)
  SchedCoef p2p, p2p_intra;   // a point-to-point message across nodes / inside one, n = its floats
                              // (0, 0: not in the profile; sched_p2p_fit derives one)
  double memory;          // bytes a rank may use (0: not in the profile)
  SchedGemmAt gemm_at[SCHED_MAX_GEMM_AT];   // GEMM times by shape (none: `gemm` prices by size)
  int ngemm_at;
} SchedCluster;

// The factor of the expert GEMMs over their filled rows (the profile's expert_gemm_scale; 1 when absent).
static inline double sched_expert_scale(const SchedCluster *c) {
  return c->expert_gemm_scale > 0 ? c->expert_gemm_scale : 1.0;
}

// ---- GEMMs by shape (sched/sched_gemm.c) ----
// The time in ms of one GEMM [m, k] x [k, n]: with the profile's `gemm_at` grid, its time per
// multiply-accumulate interpolated at the shape (geometrically, in log m, log k, log n, each axis
// clamped to the grid: a shape past the grid's largest runs at its speed) times m·k·n; without
// one, gemm's alpha + beta·m·k·n.
double sched_gemm_ms(const SchedCluster *c, double m, double k, double n);
// `count` GEMMs [m, k] x [k, n] (one per expert) as the scheduling model takes them, cut into r
// chunks of m/r rows: alpha + beta·x for a chunk of x multiply-accumulates (all of them), the
// line through r = 1 and r = 4 (of sched_gemm_ms), so that narrow chunks' lower speed shows.
SchedCoef sched_gemm_chunks(const SchedCluster *c, double count, double m, double k, double n);

// ---- collectives on the groups of a layout (sched/sched_layout.c, lang/manual.md §6) ----
// The profile's fits were measured on its own groups: `alltoall` and `allreduce` over the
// inter-node group (one rank per node, every node, all gpus_per_node such groups at once),
// `allgather`, `reducescatter` (and `alltoall_intra`, `allreduce_intra`) over one node's
// ranks. A layout's groups differ: an EP group may hold several ranks per node, a DP group
// too, an MP group may be smaller than a node. sched_group_fit prices a collective on a group
// of the given shape from those fits with a link model: the inter-node part of a collective
// scales with the elements that cross a node's link (every rank of a node communicates at
// once, as when the profile was measured), its fixed cost with the messages that cross it, and
// the part inside a node with the elements that stay there (manual §10).
typedef enum SchedColl { SCHED_ALLTOALL, SCHED_ALLGATHER, SCHED_REDUCESCATTER, SCHED_ALLREDUCE } SchedColl;
typedef enum SchedA2a { SCHED_A2A_FLAT, SCHED_A2A_1DH, SCHED_A2A_2DH } SchedA2a;   // nccl, 1dh, 2dh
extern const char *const sched_a2a_name[3];   // "nccl", "1dh", "2dh"
// A group: size members over `nodes` nodes, per_node of them on each (size = nodes * per_node).
typedef struct SchedGroup {
  int size, nodes, per_node;
} SchedGroup;
// The group of count members, stride apart, that rank 0 belongs to, with gpus_per_node
// consecutive ranks per node (the runtime's placement, runtime/comm.c).
SchedGroup sched_group_of(int count, int stride, int gpus_per_node);
// t(n) = alpha + beta * n of collective k on group g (algo: the AlltoAll's; the others ignore
// it), n as in the .cluster files. A group of one member costs nothing.
SchedCoef sched_group_fit(const SchedCluster *c, SchedColl k, SchedGroup g, SchedA2a algo);

// The expert's kind (`ffn gpt`, `ffn mixtral`, `ffn oss`): GEMMs per expert, sched_ffn_gemms.
typedef enum SchedFfn { SCHED_FFN_GPT, SCHED_FFN_MIXTRAL, SCHED_FFN_OSS } SchedFfn;
// The expert GEMMs per routed token: 2 for gpt (W1, W2), 3 for the SwiGLU kinds mixtral and oss
// (W1, W3, W2).
static inline int sched_ffn_gemms(SchedFfn ffn) { return ffn == SCHED_FFN_GPT ? 2 : 3; }
// The SchedFfn of an `ffn` kind ("gpt" when kind is NULL or unknown).
SchedFfn sched_ffn_of(const char *kind);

// One generalized layer (attention, then an MoE layer) as one rank sees it.
typedef struct SchedLayerSpec {
  double batch, seqlen, embed, hidden;  // B (samples per rank), L, M, H
  double f;                             // k * capacity factor
  int experts;                          // E (for expert-gradient replicas; 0: none)
  int heads;                            // 0: no dense attention (no dense time, no dense gradient)
  SchedFfn ffn;
  int dp, mp, ep, esp;                  // parallel groups (P = dp*mp = ep*esp)
  int r_max;                            // largest pipeline degree (tokens per expert chunk >= 1)
} SchedLayerSpec;

enum { SCHED_FWD, SCHED_BWD };

// Costs of one phase of one MoE layer: t_x,r = alpha_x + (n_x / r) * beta_x.
typedef struct SchedPhase {
  SchedCoef a2a, ag, rs, exp;
  double n_a2a, n_ag, n_rs, n_exp;
  double t_att;  // dense attention time of the phase (one GEMM-model term; backward 2x)
  // What cutting the region into r chunks adds on the compute stream after the chunks (priced
  // from the IR with the profile's elementwise fit; 0 in the paper's model): the partial sums
  // of the weight gradients, one add per chunk after the first, (r - 1) * t_sum; and the
  // chunks of the values read after the region assembled by a balanced tree of concats, which
  // copies them about log2 r times: log2(r) * t_level.
  double t_sum, t_level;
  // The part of a forward's t_level for values that only its backward's chunks read: when the
  // backward runs the same degree, it reads the forward's chunks in place (passes/schedule.c)
  // and that assembly is not made (sched_plan prices both; 0 in the paper's model).
  double t_level_shared;
  // How much slower the chunks' experts and collectives run because they overlap (relative, at
  // full overlap): set by sched_plan for the overlapping policies from the cluster's overlap
  // probe, scaled by how much of the one the other can cover; a chunk at degree r runs
  // (1 + slow * (1 - 1/r)) times its plain cost (r = 1 overlaps nothing).
  double slow_exp, slow_comm;
} SchedPhase;

typedef struct SchedLayerCost {
  SchedPhase phase[2];  // SCHED_FWD, SCHED_BWD (GEMM alpha and beta doubled)
  double n_grad;        // dense gradient elements all-reduced over the DP group
  SchedCoef ar;         // the AllReduce fit
} SchedLayerCost;

// Per-rank workloads and costs of lang/manual.md §8 for one layer on a cluster (the Table 4 space of
// `moec sweep`; a compiled model is priced from its IR, passes/cost.c).
void sched_layer_cost(const SchedLayerSpec *s, const SchedCluster *c, SchedLayerCost *out);
// The dense attention part of a generalized layer by lang/manual.md §8's formulas, from s's batch,
// seqlen, embed, heads, ffn, dp and mp: its forward time t_att (the backward's is 2 t_att) and
// its gradient elements all-reduced over the ranks (0 when dp = 1); both 0 when heads = 0.
void sched_attention(const SchedLayerSpec *s, const SchedCluster *c, double *t_att, double *n_grad);

// Per-chunk times at degree r.
typedef struct SchedChunk {
  double a2a, ag, rs, exp;
} SchedChunk;
SchedChunk sched_chunk(const SchedPhase *p, double r);
// The compute the chunking adds after the chunks at degree r: (r - 1) t_sum + log2(r) t_level.
double sched_assembly(const SchedPhase *p, double r);
// AllReduce time of n elements (0 for n <= 0) and its inverse (elements that fit in time t).
double sched_ar_time(const SchedCoef *ar, double n);
double sched_ar_elems(const SchedCoef *ar, double t);

// ---- the case model (paper §4.2) ----
// Q1..Q7 at degree r with t_gar (index 1..7; q[0] unused).
void sched_q(const SchedPhase *p, double r, double t_gar, bool q[8]);
// The case (1..4) that holds at r: the four cases partition the truth table of Q1..Q7.
int sched_case(const SchedPhase *p, double r, double t_gar);
// t_moe of case c (1..4) at r.
double sched_case_time(const SchedPhase *p, int c, double r, double t_gar);
// The modelled time of the MoE layer at r: the closed form of the case that holds.
double sched_model_time(const SchedPhase *p, double r, double t_gar);
// Inter-node idle time while the MoE layer runs with t_gar = 0 (t_olp,moe of Case 2/3/4; 0 in Case 1).
double sched_olp_moe(const SchedPhase *p, double r);
// PipeMoE's model (tutel): dispatch A2A / experts / combine A2A on one stream, AG/RS ignored.
double sched_tutel_model(const SchedPhase *p, double r);
// FSMoE without inter/intra overlap: A2A, AG, RS (and the AllReduce) share one stream.
double sched_noiio_model(const SchedPhase *p, double r, double t_gar);
double sched_noiio_olp(const SchedPhase *p, double r);
// Sequential (DS-MoE) iteration time of a stack, lang/manual.md §8 closed form.
double sched_sequential_time(const SchedLayerCost *c, int n);

// ---- the paper's Table 4 space ----
#define SCHED_TABLE4_CASES 1458   // B x heads x L x M x hscale x f x ffn = 3^6 x 2

typedef struct SchedTable4Case {
  int id;
  double batch, seqlen, embed, hscale, f;
  int heads;
  SchedFfn ffn;
  bool dropless;   // f = * (modelled as top-2 at dropless_capacity)
} SchedTable4Case;

// Table 4's sequence lengths for a cluster: {256, 512, 1024} for profiles named testbed_b*
// (the paper's Testbed B), {512, 1024, 2048} otherwise.
void sched_table4_seqlens(const SchedCluster *c, double out[3]);
// Case id (0..1457; ffn varies fastest, then f, hscale, M, L, heads, B) as one rank of the cluster
// sees it: mp = esp = gpus per node, ep = dp = nodes, experts = nodes (the paper's setting).
void sched_table4_case(int id, const SchedCluster *c, const double seqlens[3], double dropless_capacity,
                       SchedTable4Case *tc, SchedLayerSpec *spec);

// ---- Algorithm 1 (sched/sched_solve.c) ----
typedef enum SchedMethod {
  SCHED_METHOD_SLSQP,       // the paper: each case's sub-problems with NLopt SLSQP, integer neighbours
  SCHED_METHOD_EXHAUSTIVE,  // closed form at every integer r in 1..r_max (exact for the model)
} SchedMethod;

typedef struct SchedDegree {
  int r;          // chosen integer degree
  int kase;       // case that holds at r
  double t;       // modelled time at r
  double r_real;  // SLSQP: the real optimum the integer came from (exhaustive: r)
} SchedDegree;

SchedDegree sched_find_degree(const SchedPhase *p, double t_gar, int r_max, SchedMethod m);
// The degree minimising `model` over 1..r_max (tutel, no-iio).
int sched_argmin_degree(double (*model)(const SchedPhase *, double, double), const SchedPhase *p,
                        double t_gar, int r_max);

// ---- plans ----
typedef struct SchedLayerPlan {
  int r[2];              // chosen degree per phase
  int r_slsqp[2];        // fsmoe: Algorithm 1 with SLSQP (the paper's method)
  int r_exhaustive[2];   // fsmoe: Algorithm 1's model scanned at every integer r
  int r_sim[2];          // fsmoe: the simulator's own best r (every r simulated)
  int kase[2];           // fsmoe: the case that holds at the chosen r
  const char *chosen_by[2];   // fsmoe: "slsqp", "model" or "simulator"
  double t_model[2];     // the policy's model time of the MoE layer at r
  double t_sim_slsqp[2], t_sim_exhaustive[2], t_sim_sim[2];   // fsmoe: simulated MoE time of each choice
  double t_gar;          // backward: the AllReduce time put inside the MoE layer
  double grad_moe;       // gradient elements all-reduced inside this layer's backward MoE
  double grad_dense;     // ... while this layer's dense backward runs
} SchedLayerPlan;

typedef struct SchedPlan {
  IrPolicy policy;
  int nlayers;
  SchedLayerPlan *layer;
  double grad_tail;              // elements all-reduced after the backward pass
  const char *partition;         // where the gradients went (fsmoe: the winning variant, "step1+2", ...)
  double t_fwd, t_bwd, t_iter;   // simulated
} SchedPlan;

// Which of fsmoe's three answers for r is used.
typedef enum SchedChoose {
  SCHED_CHOOSE_BEST,        // the fastest in simulation (a model answer on a tie); the default
  SCHED_CHOOSE_SLSQP,       // Algorithm 1 with SLSQP, as the paper
  SCHED_CHOOSE_MODEL,       // the case model's integer optimum (exhaustive scan)
  SCHED_CHOOSE_SIMULATOR,   // the simulator's own best r
  SCHED_NCHOOSE
} SchedChoose;
extern const char *const sched_choose_name[SCHED_NCHOOSE];   // "best", "slsqp", "model", "simulator"

typedef struct SchedStack {
  int n;                        // generalized layers, in forward order
  const SchedLayerCost *cost;   // [n]
  const int *r_max;             // [n]
  SchedChoose choose;           // fsmoe's degree rule
  double t_fwd_other, t_bwd_other;   // time outside the layers, added to t_fwd / t_bwd (ms)
  double slow_compute, slow_comm;   // the cluster's overlap slowdowns: the policies that overlap
                                    // plan with their GEMMs and collectives that much slower
  int r_fix[2];                 // > 0: every layer runs this degree in that phase (a model's
                                // explicit `pipeline { forward N; backward M; }`), only priced
  bool quick;                   // fsmoe's gradient partition without step 2's global optimiser (the
                                // layout search's estimates of pipeline stages: hundreds of stacks)
} SchedStack;

// fsmoe's degree for one layer and phase with grad_elems of AllReduce inside the MoE (lang/manual.md §8):
// Algorithm 1 by SLSQP, the case model scanned at every integer r, and the simulator's own
// judgement of every r; `choose` says which is used (by default the fastest of the three in
// simulation, a model answer on a tie); all are reported. Fills lp->r, r_slsqp, r_exhaustive,
// r_sim, kase, chosen_by, t_model and t_sim_* for that phase.
void sched_fsmoe_degree(const SchedLayerCost *c, int r_max, int phase, double grad_elems, SchedChoose choose,
                        SchedLayerPlan *lp);

// Plans a stack for a policy (r per layer and phase, gradient placement) and simulates it.
// out->layer is allocated; free with sched_plan_free.
bool sched_plan(const SchedStack *st, IrPolicy pol, SchedPlan *out);
void sched_plan_free(SchedPlan *p);

// ---- gradient partition (sched/sched_gradpart.c) ----
// f_moe(t_gar): the MoE layer's modelled time when t_gar of AllReduce rides inside it.
typedef double (*SchedMoeFn)(const SchedLayerCost *c, int r_max, double t_gar);

typedef struct SchedGradPart {
  double *moe;     // [n] elements in layer i's backward MoE slot
  double *dense;   // [n] elements in layer i's dense backward slot
  double tail;     // elements left for after the backward pass
  double t_model;  // modelled backward time of the partition
} SchedGradPart;

typedef enum SchedGradMode {
  SCHED_GRAD_STEP1,       // eqs. (3)-(4) only
  SCHED_GRAD_STEP12,      // step 1, then step 2 with a global optimiser (NLopt GN_ISRES)
  SCHED_GRAD_DENSE_FIRST, // fill dense slots first, then MoE slots (step 1 order swapped)
  SCHED_GRAD_NONE,        // everything after the backward pass
} SchedGradMode;

// olp[i]: the inter-node idle time of layer i's backward MoE at t_gar = 0.
bool sched_gradpart(const SchedStack *st, SchedMoeFn f_moe, const double *olp, SchedGradMode mode,
                    SchedGradPart *out);
void sched_gradpart_free(SchedGradPart *g);
// The modelled backward time of a partition (the objective of step 2).
double sched_gradpart_time(const SchedStack *st, SchedMoeFn f_moe, const double *moe, const double *dense,
                           double tail);

// ---- stream programs and the simulator (sched/sched_sim.c) ----
typedef enum SchedOpKind {
  SCHED_OP_ATTENTION, SCHED_OP_DISPATCH, SCHED_OP_ALLGATHER, SCHED_OP_EXPERT,
  SCHED_OP_REDUCESCATTER, SCHED_OP_COMBINE, SCHED_OP_ALLREDUCE, SCHED_NOPKINDS
} SchedOpKind;
extern const char *const sched_op_name[SCHED_NOPKINDS];

typedef enum SchedResource { SCHED_RES_COMPUTE, SCHED_RES_INTRA, SCHED_RES_INTER, SCHED_NRES } SchedResource;
extern const char *const sched_resource_name[SCHED_NRES];

#define SCHED_MAX_DEPS 3
#define SCHED_MAX_STREAMS 4

typedef struct SchedOp {
  SchedOpKind kind;
  int layer, phase, chunk;   // chunk: 0-based; AllReduce: 0 inside the MoE (or the layer's only
                             // one), 1 during the dense backward, 2 after the backward; Lina: k-th 30 MB
  int stream;                // in-order issue queue
  SchedResource res;         // what it occupies while it runs (one op at a time per resource)
  int prio;                  // lower goes first when several streams want one resource
  double dur, elems;
  int deps[SCHED_MAX_DEPS];
  int ndeps;
  double start, end;         // set by the simulator
} SchedOp;

typedef struct SchedProgram {
  SchedOp *op;
  int nops, cap;
  int nstreams;
  const char *stream_name[SCHED_MAX_STREAMS];
  double t_fwd;        // end of the forward pass (simulated)
  double makespan;     // end of the iteration (simulated)
} SchedProgram;

void sched_program_free(SchedProgram *g);
// The stream program of a planned stack.
bool sched_build_program(const SchedStack *st, const SchedPlan *plan, SchedProgram *out);
// Runs the discrete-event simulation; fills start/end, t_fwd, makespan. False on a deadlock
// (an internal error).
bool sched_simulate(SchedProgram *g);
// Simulated time of one MoE layer alone (one phase at degree r, with grad_elems of AllReduce
// after the last dispatch for fsmoe / no-iio), under a policy's streams.
double sched_sim_moe(IrPolicy pol, const SchedLayerCost *c, int phase, int r, double grad_elems);

// Resource lower bound of any schedule of the stack: the busiest resource's total work at
// r = 1 with all gradients in one AllReduce. busiest: index of that resource.
double sched_lower_bound(const SchedStack *st, SchedResource *busiest, double total[SCHED_NRES]);

// ---- pipeline stages (sched/sched_pipe.c, lang/manual.md §6) ----
// The fit of one point-to-point message of n floats between neighbouring stages, every rank of a
// node sending at once: across nodes (the profile's `p2p`) or inside one (`p2p_intra`); where the
// profile has none, derived from its AlltoAll of the same reach (one peer's share of it). *how
// says which ("p2p", "p2p_intra" or "derived from ...").
SchedCoef sched_p2p_fit(const SchedCluster *c, bool across, const char **how);
// The messages from stage s to stage s + 1 of a pipeline of `ranks` ranks a stage (world rank =
// stage * ranks + its place; gpus_per_node consecutive ranks a node): the fit, *across when some
// cross a node's link (their beta scaled by the share of the node's ranks that send across it).
SchedCoef sched_p2p_boundary(const SchedCluster *c, int ranks, int s, bool *across, const char **how);
// The microbatches in flight on stage s of `stages` (runtime/pipeline.c): micro with GPipe,
// min(stages - s, micro) with 1F1B; 1 without stages.
int sched_pipe_slots(int stages, int s, int micro, bool gpipe);

#define SCHED_MAX_STAGES 64   // frontend/fe.h FE_MAX_STAGES

typedef struct SchedPipe {
  int stages, micro;
  bool gpipe;               // every forward, then every backward; else 1F1B (runtime/pipeline.c)
  // [stages] one microbatch's forward and backward on each stage (ms): a microbatch before the last
  // sums its gradients locally (t_micro), the last one reduces the step's (t_last; NULL: t_micro)
  // (runtime/pipeline.c, comm.c's gradient hook).
  const double *t_micro, *t_last;
  const double *t_fwd;      // [stages] the forward's part of t_micro (ms); NULL: a third of it
  const double *t_update;   // [stages] each stage's update, once a step (ms); NULL: none
  const double *t_msg;      // [stages - 1] one message from stage b to b + 1 (ms)
} SchedPipe;
typedef struct SchedPipePlan {
  double t_step;     // the simulated step: the stages' last backwards and their updates
  double t_pipe;     // where the last stage's work ends, the update before it (the simulated makespan)
  double t_fill;     // (micro + stages - 1) x the slowest stage's microbatch + t_reduce (balanced stages)
  double t_reduce;   // what the last microbatch adds on a stage for reducing the gradients (the most)
  double t_msgs;     // the messages of the fill and the drain: 2 per boundary
  double t_update;   // the longest update
  double bubble;     // the stages' mean wait for a message they need, a share of the step (simulated)
  double bubble_equal;   // (stages - 1) / (micro + stages - 1): the bubble of equal stages
  double wait[SCHED_MAX_STAGES];   // each stage's wait for the others' messages (ms a step; not the
                                   // time after its last backward until the step ends)
  int slowest;       // the stage whose microbatch is the slowest
} SchedPipePlan;
// The planned step of a pipeline of stages: the runtime's order of forwards and backwards on
// every stage (GPipe or 1F1B) simulated with the stages' times and the messages between them
// (a stage computes while its messages travel), then each stage's update.
void sched_pipe_step(const SchedPipe *p, SchedPipePlan *out);
// Each layer's share of a planned stack's simulated step (t_layer[n], ms): its forward's and
// backward's spans on the compute stream, and of what is all-reduced after the backward its
// gradients' share. They add up to the simulated step. False on an internal error.
bool sched_layer_times(const SchedStack *st, const SchedPlan *plan, double *t_layer);

// A model's n layer instances, in order, to be split over stages.
typedef struct SchedSplit {
  int n, stages, micro;
  bool gpipe;               // the in-flight microbatches of each stage (sched_pipe_slots)
  const double *t;          // [n] each instance's time per microbatch (ms)
  double t_first, t_last;   // the embedding's (the first stage), the head's and loss's (the last)
  // The memory: bytes a stage holds once (parameters, gradients, optimizer state) and bytes of
  // activations per microbatch in flight; NULL: no limit is checked.
  const double *bytes, *act;
  double bytes_first, act_first, bytes_last, act_last;
  double memory;            // bytes a rank may use (0: no limit)
} SchedSplit;
// The estimated peak of stage s holding instances [first, first + count).
double sched_split_peak(const SchedSplit *sp, int s, int first, int count);
// The slowest stage's time of the split counts[stages].
double sched_split_slowest(const SchedSplit *sp, const int64_t *counts);
// The split (counts[stages], each >= 1, adding up to n) whose slowest stage is the fastest among
// those whose stages' estimated peaks fit the memory (*within; when none does, among all); the
// split `equal` (may be NULL) where it is as fast. False when n < stages.
bool sched_pipe_split(const SchedSplit *sp, const int64_t *equal, int64_t *counts, bool *within);

// ---- output (sched/sched_trace.c) ----
// Chrome trace JSON (chrome://tracing, Perfetto): one thread per stream, times in us.
bool sched_write_trace(FILE *out, const SchedProgram *g, const char *title);
// SVG timeline, one row per stream (as the paper's Fig. 3).
bool sched_write_svg(FILE *out, const SchedProgram *g, const char *title);

#endif
