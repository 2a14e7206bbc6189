// libmoert: the runtime every binary that moec builds links against.
//
// The generated host program describes its model (parameters, sizes, optimizer) in an RtModel
// and implements three step functions that call the kernels below on buffers carved out of one
// arena by the memory plan. rt_main() does the rest: command line, synthetic or .npy data,
// parameter init or safetensors weights, the training loop and its per-step report,
// checkpoints (atomic), --dump and --check-grad.
//
// Kernels are plain C on row-major float32 (GEMMs through OpenBLAS). Integer tensors (expert
// indices, locations) are int32. Shapes use the IR's letters: S tokens, M model dim, E experts,
// K choices per token, G routing groups, T capacity per group per expert, C = G*T slots per
// expert, H expert hidden.
#ifndef MOERT_H
#define MOERT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct RtModel RtModel;
typedef struct RtStep RtStep;
typedef struct RtComm RtComm;
typedef struct RtStreams RtStreams;

// ---- deterministic randomness (runtime/rng.c) ----
// Counter-based: every number is a pure function of its key, so data, init and noise do not
// depend on the parallel layout or on the order of evaluation.
//   rt_mix(z): splitmix64's finaliser applied to z + 0x9e3779b97f4a7c15.
//   rt_key(a, b) = rt_mix(a ^ rt_mix(b)).
//   rt_uniform(h) = ((h >> 40) + 0.5) / 2^24, in (0, 1).
//   rt_normal(key, i): element i & 1 of pair i >> 1, the two N(0, 1) floats Box-Muller makes
//                       of 23 + 24 bits of rt_mix(key + (i >> 1) * 0x9e3779b97f4a7c15), in
//                       float arithmetic of +, -, *, /, sqrt (runtime/rng.c says how, step by step).
//   rt_normal_fill(key, first, n, out): out[k] = rt_normal(key, first + k), threaded, vectorised.
uint64_t rt_mix(uint64_t z);
uint64_t rt_key(uint64_t a, uint64_t b);
double rt_uniform(uint64_t h);
double rt_normal(uint64_t key, uint64_t i);
void rt_normal_fill(uint64_t key, uint64_t first, int64_t n, float *out);
// Stream keys: rt_key(rt_key(seed, RT_STREAM_*), extra...)
// RT_STREAM_DATA: a language model's token windows, rt_key(rt_key(rt_key(seed, DATA), step), g)
// for global sample g (runtime/data.c).
enum {
  RT_STREAM_INPUT = 1,
  RT_STREAM_TARGET = 2,
  RT_STREAM_INIT = 3,
  RT_STREAM_NOISE = 4,
  RT_STREAM_DATA = 5,
};
uint64_t rt_hash_name(const char *s);  // FNV-1a 64 of a parameter name

// ---- kernels (runtime/kernels/*.c) ----
// One range of parameters of an update launch (rt_adamw_ranges, rt_sgd_ranges; the CUDA target's
// update of a run of parameter tensors): elements [start, start + n) of the flat buffers (from the
// launch's p, g, m, v, p16), its blocks of `chunk` elements from block0 on, its lr and weight decay.
typedef struct RtUpdateRange {
  int64_t start, n, block0;
  float lr, weight_decay;
} RtUpdateRange;

// Every kernel of the table runtime/kernels.def (WHERE = BOTH) is declared from its row: rt_NAME
// with the row's parameters, the CUDA kernel mk_NAME's parameters. The row's comment says what
// it computes.
#define K_F32 const float *
#define K_F32_OUT float *
#define K_I32 const int32_t *
#define K_I32_OUT int32_t *
#define K_U16 const uint16_t *
#define K_U16_OUT uint16_t *
#define K_I8 const int8_t *
#define K_I8_OUT int8_t *
#define K_BYTES const void *
#define K_BYTES_OUT void *
#define K_PTR_OUT void *
#define K_INT int
#define K_I64 int64_t
#define K_U64 uint64_t
#define K_FLOAT float
#define RT_KERNEL_BOTH(NAME, PARAMS) void rt_##NAME PARAMS;
#define RT_KERNEL_CUDA(NAME, PARAMS)
#define RT_KERNEL(ID, NAME, WHERE, PARAMS) RT_KERNEL_##WHERE(NAME, PARAMS)
#include "kernels.def"
#undef RT_KERNEL
#undef RT_KERNEL_BOTH
#undef RT_KERNEL_CUDA
#undef K_F32
#undef K_F32_OUT
#undef K_I32
#undef K_I32_OUT
#undef K_U16
#undef K_U16_OUT
#undef K_I8
#undef K_I8_OUT
#undef K_BYTES
#undef K_BYTES_OUT
#undef K_PTR_OUT
#undef K_INT
#undef K_I64
#undef K_U64
#undef K_FLOAT

// The kernels outside the table (the CPU target calls them itself, or tests and the driver do).
// C = op(A) * op(B) (+ C when accumulate). op(A) is [m,k], op(B) [k,n]; ta/tb: the operand is
// stored transposed.
void rt_matmul(const float *a, const float *b, float *c, int m, int n, int k, bool ta, bool tb,
               bool accumulate);
// rt_matmul (not accumulating), then rows(args, lo, hi) over each piece's rows of C as the piece's
// thread finishes it: a GEMM epilogue. False when the GEMM ran whole and rows did not run.
typedef void (*RtRowsFn)(const void *const *args, int64_t lo, int64_t hi);
bool rt_matmul_rows(const float *a, const float *b, float *c, int m, int n, int k, bool ta, bool tb, RtRowsFn rows,
                    const void *const *args);
// rt_expert_matmul (ta = 0), then rows(args, lo, hi) over rows of C ([e * m, n]) as they are made,
// each row once: a GEMM epilogue. False when it did not run rows (an empty product).
bool rt_expert_matmul_rows(const float *a, const float *b, float *c, int e, int m, int n, int k, bool tb, RtRowsFn rows,
                           const void *const *args);
// --profile: while on, rt_matmul and rt_expert_matmul add the time of their GEMMs to a counter
// that rt_gemm_ns_take returns and clears, and the attention kernels (rt_attn_*) theirs to
// rt_attn_ns_take's (nanoseconds, every thread of the process).
void rt_gemm_profile(bool on);
int64_t rt_gemm_ns_take(void);
int64_t rt_attn_ns_take(void);
// Batched over e: A [e, ...], B [e, ...], C [e, m, n].
void rt_expert_matmul(const float *a, const float *b, float *c, int e, int m, int n, int k,
                      bool ta, bool tb);
// rt_gate_noise: logits + sigma * N(0,1) / e; the normal for token s (global index token0 + s),
// expert j is rt_normal(rt_key(rt_key(rt_key(seed, RT_STREAM_NOISE), step), layer),
// (token0 + s) * e + j).
//
// Tokens split into g equal groups in order; within a group, all first choices in token order,
// then all second choices, ...; loc = running count of the expert in that group, or -1 when it
// reaches cap. cap <= 0 is dropless: nothing is dropped. Adds the drops, the routing and the
// per-expert loads (kept choices of each expert in each routing group) to st's statistics, and
// returns the largest per-group load of any expert (the capacity a dropless layer needs).
int rt_gate_locations(const int32_t *idx, int32_t *loc, RtStep *st, int s, int k, int e, int g,
                      int cap);
// The statistics rt_gate_locations adds to st, of a routing made elsewhere (the CUDA target
// places the choices on the GPU and reads idx and loc back): drops, routed choices, per-group
// loads, route_hash and, when cap <= 0, capacity_max. Nothing when st is NULL.
void rt_route_stats(RtStep *st, const int32_t *idx, const int32_t *loc, int s, int k, int e,
                    int g, int cap);
// The statistics of an expert-choice routing loc [s, e] (rt_route_stats' twin): routed += s,
// dropped += tokens that no expert took; loads as rt_gate_locations. Nothing when st is NULL.
void rt_expert_choice_stats(RtStep *st, const int32_t *loc, int s, int e, int g, int cap);
// The numbers rt_aux_loss, rt_z_loss and rt_mse write (before dividing by share / scaling).
float rt_aux_loss_value(const float *scores, const int32_t *idx, int s, int e, int k, int g);
float rt_z_loss_value(const float *logits, int s, int e, int g);
float rt_mse_value(const float *out, const float *target, int64_t n);   // sum (o-t)^2 / (2n)
// The last rt_mse's or rt_xent's loss in double when value is that loss rounded to float (within
// 4 ulps), else value: the step's loss before rounding, for --check-grad (kernels/loss.c).
double rt_loss_exact(double value);
// The CUDA program's loss from the partial sums of its split reduction (codegen/lower.c's
// cg_split_reduction), read back after the step: scale * (their sum in double) / div, what
// rt_loss_exact gives next.
void rt_loss_exact_parts(const double *part, int64_t n, int64_t div, double scale);
// The record hook: writes one JSON line {"step", "layer", "point", "numel", "mean", "max_abs",
// "dropped"} to st->record (nothing when NULL); dropped is the layer's dropped fraction so far.
void rt_record(RtStep *st, const char *point, int layer, const float *x, int64_t n);
// The same line from statistics of the n values computed elsewhere (the CUDA target's
// mk_record_stats): their sum, the largest |x| of the non-NaN ones and the number of NaNs.
void rt_record_stats(RtStep *st, const char *point, int layer, int64_t n, double sum,
                     double max_abs, int64_t nans);
void rt_scale(float *x, int64_t n, float s);

// ---- ranks, groups and collectives (runtime/comm.c; MPI on the CPU backend) ----
// The parallel layout: world = dp*mp = ep*esp ranks, gpus_per_node ranks per node. MP groups
// and ESP groups are consecutive ranks (inside a node); DP groups stride by mp, EP groups by
// esp (across nodes). A rank's coordinates: dp index = rank / mp, mp index = rank % mp,
// ep index = rank / esp, esp index = rank % esp.
typedef enum RtGroup { RT_GROUP_WORLD, RT_GROUP_DP, RT_GROUP_MP, RT_GROUP_EP, RT_GROUP_ESP, RT_GROUP_COUNT } RtGroup;
typedef enum RtA2aAlgo { RT_A2A_FLAT, RT_A2A_1DH, RT_A2A_2DH } RtA2aAlgo;  // nccl (flat), 1dh, 2dh
// pp: pipeline stages of dp*mp ranks each (0 or 1: one); world rank = stage * dp*mp + the rank's
// place in its stage, and every group above lies inside one stage (rt_comm_create).
typedef struct RtLayout { int dp, mp, ep, esp, gpus_per_node, pp; } RtLayout;

// First thing in a program's main (rt_main, moec tune): where OpenBLAS took this CPU for a
// Prescott (a model newer than it knows) and the CPU has AVX2 or AVX-512, sets
// OPENBLAS_CORETYPE and runs the program again, its whole command line as it started
// (runtime/threads.c); else returns.
void rt_blas_kernels(void);
// The threads of the kernels and GEMMs (runtime/threads.c), set once, before any work: the cores
// divided among the ranks on this node (OMP_NUM_THREADS when set). Returns the pool's size.
// rt_gemm_pieces: how many pieces rt_matmul splits a GEMM into (1 before rt_threads_setup).
int rt_threads_setup(long ranks_on_node);
int rt_gemm_pieces(void);

// The communicators of one parallel layout: one per group, created together and passed to every
// collective (runtime/comm.c). rt_comm_create starts MPI when nothing has (MPI_THREAD_MULTIPLE
// where available; a process run without mpirun is a world of one), and the last
// rt_comm_destroy then finalizes it; a program that started MPI itself finalizes it itself.
// Checks the layout against the world: a mismatch (world != dp*mp or != ep*esp, more ranks than
// nodes*gpus_per_node when nodes > 0, ...) is reported once by rank 0 as "moert: error: ..." and
// every rank gets NULL. Several communicators may live at once. A NULL RtComm is a world of one:
// every group has one member and every collective is a local copy.
RtComm *rt_comm_create(const RtLayout *layout, int nodes);
void rt_comm_destroy(RtComm *c);                   // NULL: nothing
int rt_comm_rank(const RtComm *c, RtGroup g);       // this rank's index in group g (0 for NULL)
int rt_comm_size(const RtComm *c, RtGroup g);       // size of group g (1 for NULL)
// Whether collectives on different groups may run on different threads at once
// (MPI_THREAD_MULTIPLE; always for NULL).
bool rt_comm_thread_safe(const RtComm *c);
// Prints the group table (rank 0 only): for every rank its coordinates and group members.
void rt_comm_print_groups(const RtComm *c, FILE *out);
// AlltoAll on group g: block i of send (count floats) goes to member i; block i of recv comes
// from member i. The three algorithms deliver identical bytes: flat (one MPI_Alltoall), 1dh
// (HetuMoE: gather to a node leader, leaders exchange, scatter), 2dh (Tutel/DeepSpeed:
// intra-node AlltoAll, stride transform, inter-node AlltoAll). Nodes: gpus_per_node
// consecutive world ranks.
void rt_alltoall(RtComm *c, RtGroup g, RtA2aAlgo algo, const float *send, float *recv,
                 int64_t count);
void rt_allgather(RtComm *c, RtGroup g, const float *send, float *recv, int64_t count);    // count per member
void rt_reducescatter(RtComm *c, RtGroup g, const float *send, float *recv, int64_t count); // sum; count per member
void rt_allreduce(RtComm *c, RtGroup g, float *buf, int64_t n);                             // sum, in place
void rt_allreduce_f64(RtComm *c, RtGroup g, double *buf, int64_t n);
void rt_allreduce_max_f64(RtComm *c, RtGroup g, double *buf, int64_t n);   // element-wise max
void rt_bcast(RtComm *c, RtGroup g, void *buf, int64_t bytes, int root);
// A sharded optimizer (`optimizer adamw { shard true; }`, ZeRO-1): member i of group g owns rows
// [rows*i/p, rows*(i+1)/p) of a parameter of `rows` rows of `row` floats (p members), the
// elements [*lo, *lo + *n) of this rank's part.
void rt_shard_part(const RtComm *c, RtGroup g, int64_t rows, int64_t row, int64_t *lo, int64_t *n);
// Sums elements [offset, offset + count) of grad (a parameter's gradient) over g; each member
// receives the sums of its own rows, in place (a reduce-scatter; the other elements are left
// with this rank's addends or partial sums).
void rt_shard_reduce(RtComm *c, RtGroup g, float *grad, int64_t offset, int64_t count, int64_t rows,
                     int64_t row);
// Each member's rows of buf (a parameter after its owners' updates) to every member, in place.
void rt_shard_gather(RtComm *c, RtGroup g, float *buf, int64_t rows, int64_t row);
// Every rank exits through here on a fatal runtime error: message on stderr, MPI_Abort when
// several ranks run (so no peer hangs), exit status 1.
_Noreturn void rt_comm_abort(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

// ---- errors ----
// Records why a call failed (printf format) and returns -1; rt_main prints the sentence once as
// "moert: error: SENTENCE". The device hooks below report through it.
int rt_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

// ---- a device that runs the steps (the CUDA target) ----
// The CUDA target's program runs its step functions on a GPU: parameters, gradients, optimizer
// moments, activations and the step's data live in device memory there. rt_main keeps the host
// copies it always has (initial values, --weights, checkpoints, --dump, --check-grad, the data
// of each step) and moves them with these hooks, at the points where host and device must
// agree. The CPU target leaves RtModel.device NULL and nothing of this runs.
typedef enum RtDeviceData {
  RT_DEVICE_PARAMS = 1,     // st->params
  RT_DEVICE_MOMENTS = 2,    // st->opt_m and st->opt_v
  RT_DEVICE_GRADS = 4,      // st->grads
  RT_DEVICE_OUTPUT = 8,     // the buffer st->output points to (the forward sets it to host memory)
} RtDeviceData;

typedef struct RtDevice {
  // After the host buffers exist (st->params ... allocated, not yet filled): claims the device
  // and its memory. 0, or -1 with the reason recorded by rt_fail (no GPU is such a reason).
  int (*create)(RtStep *st);
  // Collective, after every rank's create succeeded: what the ranks set up together (the
  // communicators of the parallel groups). 0 or -1 (rt_fail).
  int (*connect)(RtStep *st);
  const char *(*describe)(void);                // the device, for the report's header
  int (*upload)(RtStep *st, unsigned what);     // host -> device; what: RtDeviceData bits
  int (*download)(RtStep *st, unsigned what);   // device -> host
  void (*destroy)(RtStep *st);                  // after a successful create
  // Microbatches and pipeline stages (runtime/pipeline.c); set by a program that has either, NULL
  // otherwise. Like the step functions they end the job on a failure (rt_comm_abort).
  // use_slot: the step functions that follow run microbatch slot `slot` (0 .. rt_pipe_slots - 1):
  // its activations, input and target in device memory of its own, filled from st->input and
  // st->target (host memory, the slot's) as in a step of one microbatch.
  void (*use_slot)(RtStep *st, int slot);
  // accumulate: the gradients of `micros` microbatches summed on the device, as pipeline.c sums
  // them on the host: called before (after = false) and after the backward of microbatch `micro`
  // (0 .. micros - 1), and with micro = micros after the step's last backward (and after
  // grads_part's exchange of the parameters two stages hold) for the division by micros.
  void (*accumulate)(RtStep *st, int micro, int micros, bool after);
  // grads_part: st->grads[offset, offset + n) from the device (to_device false) or to it.
  void (*grads_part)(RtStep *st, size_t offset, int64_t n, bool to_device);
} RtDevice;
// The forward reads st->input and st->target (host memory) itself, and leaves the step's
// statistics (mse, aux, z, aux_total, dropped, routed, loads, route_hash) in st as the CPU
// target's does. A pipeline stage's messages go through host memory there too: the forward of a
// stage before the last leaves st->output (its activations) in host memory of the slot's, the
// backward of a stage after the first st->input_grad, and the backward of a stage before the last
// reads its target (the gradient the next stage sent) from st->target again. A failure inside a
// step function ends the job (rt_comm_abort).

// ---- the model description the generated program fills in ----
typedef enum RtInit { RT_INIT_ZEROS, RT_INIT_ONES, RT_INIT_NORMAL, RT_INIT_CONST, RT_INIT_UNIFORM } RtInit;
typedef enum RtOptKind { RT_OPT_SGD, RT_OPT_ADAMW } RtOptKind;
typedef enum RtPpSchedule { RT_PP_1F1B, RT_PP_GPIPE } RtPpSchedule;

typedef struct RtParam {
  const char *name;        // e.g. "block0.moe.experts.w1"
  int rank;
  int64_t dims[4];
  RtInit init;
  float std;               // RT_INIT_CONST: every element equals std. RT_INIT_UNIFORM: element i is
                           // std * (2 rt_uniform(rt_key(k, i)) - 1), k as below. RT_INIT_NORMAL: N(0, std^2), element i of param p is
                           // std * rt_normal(rt_key(rt_key(seed, RT_STREAM_INIT), rt_hash_name(p)), i)
  size_t offset;           // in floats, into RtStep.params / grads / opt_m / opt_v
  int64_t numel;           // of this rank's shard (dims)
  // Sharding over ranks. dims is this rank's shard of a tensor of shape global_dims; dimension
  // shard_ep (or -1) is split over the EP group (expert e of the shard is global expert
  // ep_index*dims[shard_ep] + e) and dimension shard_esp (or -1) over the ESP group (offset
  // esp_index*dims[shard_esp]); a language model's head- or column-split projection splits
  // dimension shard_mp (or -1) over the MP group (offset mp_index*dims[shard_mp]). Initial
  // values, checkpoints, --weights and --dump always use global element indices and whole
  // tensors, so they do not depend on the layout.
  int64_t global_dims[4];
  int shard_ep, shard_esp, shard_mp;
  int balance;             // 1: a correction bias (`balance bias`), moved by opt.balance, not trained by a gradient
  int shard;               // 1 + the RtGroup over which its optimizer moments are sharded by rows
                           // of dims[0] (rt_shard_part); 0: every replica holds them whole
  int frozen;              // 1: no gradient, no optimizer state (a LoRA model's base weights); the
                           // frozen parameters' offsets follow every trained one's (RtModel.grad_floats)
} RtParam;

// The elements [*lo, *lo + *n) of parameter p whose moments this rank keeps and updates: its rows
// when p->shard, all of them otherwise (runtime/shard.c).
void rt_param_part(const RtComm *c, const RtParam *p, int64_t *lo, int64_t *n);

struct RtModel {
  const char *name;
  int64_t batch, seqlen, embed;   // input and output are [batch, seqlen, embed]
  uint64_t seed;
  int nparams;
  const RtParam *params;
  size_t param_floats;            // total floats of all parameters
  size_t grad_floats;             // the trained ones' (the first; gradients and moments); 0: all
  size_t arena_bytes;             // activation arena from the memory plan
  size_t param16_bytes;           // dtype bf16 (CUDA): the parameters' bf16 copy the plan counts (else 0)
  RtOptKind opt;
  int nlayers;                    // MoE layers, for statistics
  bool records;                   // a `record` hook exists: rt_main opens the record file
  bool dropless;                  // a layer has `capacity *`: the report shows the capacity used
  bool aux_in_loss, z_in_loss;    // a gate's aux (z) loss has a coefficient: the step lines show it
  double step_flops;              // 2 x the multiply-accumulates of a step's GEMMs and attention on a rank
  RtLayout layout;                // the parallel layout it was compiled for ({1,1,1,1,...} = one rank)
  int nodes;                      // nodes of the cluster profile (0 = not given)
  // Loss reduction over ranks: st->mse is this rank's share (already divided by dp); the
  // report's mse is its sum over the DP group; aux, z, aux_total are per-rank shares summed
  // over the world; dropped/routed/loads reduce over the world.
  // Step functions. forward: reads st->input/st->target, sets st->output (into the arena),
  // st->mse and st->aux_total (sum of coef*aux + coef*z over layers) and adds to st->aux/st->z.
  // backward: fills st->grads (every parameter's gradient, overwritten). update: optimizer.
  void (*forward)(RtStep *st);
  void (*backward)(RtStep *st);
  void (*update)(RtStep *st);
  const RtDevice *device;         // NULL: the steps run on the host (the CPU target)
  // The optimizer's schedule (lang/manual.md §7.2; 0 fields: none): lr is the kernels' learning rate;
  // warmup, cosine decay to min_lr at decay_steps and global-norm clipping reach the update
  // kernels as RtStep.lr_scale and .grad_scale.
  double lr, min_lr, clip;
  int64_t warmup, decay_steps;
  // A language model (lang/manual.md §7.2) when vocab > 0: input and target are int32 tokens
  // [batch*seqlen] (a window's first L tokens and the L after them), the forward sets output to
  // the logits [batch*seqlen, vocab] and mse to the cross-entropy's share; the model's `data`
  // block names its token files (NULL: none; --data and --val override).
  int64_t vocab;
  // Pipeline stages and microbatches (lang/manual.md §6): the program runs one microbatch of
  // batch samples; a step is `microbatches` of them (0 or 1: one) with their gradients summed and
  // divided by microbatches before one update (runtime/pipeline.c). With pp > 1 the program is
  // stage `stage` of pp: stage 0 reads the tokens (input), a later stage the activations [batch *
  // seqlen, embed] the previous stage sent (input), and a stage before the last ends in loss.link:
  // its target is the gradient of its output that the next stage sent back, and its backward sets
  // st->input_grad, the gradient of its input, to send to the stage before (stage > 0).
  int microbatches, pp, stage;
  RtPpSchedule pp_schedule;
  // `vocab_parallel true;` on mp ranks: each holds the table's (the head's) rows of vocab/mp
  // tokens from RtStep.vocab0, and output is the logits of those [batch*seqlen, vocab/mp]
  // (rt_lm_logits gathers the whole).
  bool vocab_parallel;
  const char *data_train, *data_val, *data_format;
  // The Hugging Face family the model is (lang/manual.md §19): the config.json that --export-hf writes,
  // or NULL with hf_refusal, the sentence saying why it is none (moec build decides).
  const char *hf_config, *hf_refusal;
  // Its generation_config.json (NULL: none), and the values of the imported config.json the
  // model replaced ("key: old -> new; ...", NULL: none), which --export-hf reports.
  const char *hf_generation, *hf_changes;
  // A LoRA model's adapter_config.json in PEFT's form (r, lora_alpha, target_modules,
  // target_parameters; NULL: no lora block): --export-hf writes the adapters, --adapter reads them.
  const char *hf_adapter;
  // How moec build chose the layout (`parallel auto;`, --layout), printed at start; NULL: written.
  const char *layout_note;
};
// The floats of the gradients and of each optimizer moment: the trained parameters' (offsets
// [0, grad_floats)); every parameter's when none is frozen.
static inline size_t rt_grad_floats(const RtModel *m) { return m->grad_floats ? m->grad_floats : m->param_floats; }

#define RT_POOL_MAX_LAYERS 256   // layers with `aux pooled` in one model

// One routed MoE layer's share of a step's statistics (--log): its loads and drops.
typedef struct RtLayerStats {
  int64_t load_min, load_max, load_count, dropped, routed;
  double load_sum;
} RtLayerStats;

struct RtStep {
  const RtModel *model;
  float *params, *grads, *opt_m, *opt_v;
  unsigned char *arena;           // arena_bytes, 64-byte aligned
  const float *input, *target;    // [batch*seqlen*embed] each
  const float *output;            // set by forward
  const float *input_grad;        // set by backward of a pipeline stage after the first (RtModel.stage)
  int64_t step;                   // 1-based number of the step being run
  uint64_t seed;
  int64_t token0;                 // global index of this rank's first token (0 on one rank)
  int64_t vocab0;                 // a vocabulary-parallel rank's first row of the vocabulary (else 0)
  // filled by forward
  double mse, aux_total;          // loss = mse + aux_total
  double aux, z;                  // unweighted sums over layers (for the report)
  int64_t dropped, routed;        // choices dropped / routed this step
  uint64_t route_hash;            // hash of every routing decision (for --check-grad)
  int64_t load_min, load_max;     // tokens per expert and routing group, over every expert,
                                  // group and layer
  double load_sum;                //   (sum and count give the mean)
  int64_t load_count;
  int64_t capacity_max;           // largest capacity a dropless layer used this step
  // Per routed layer, in the order the forward routes them (NULL: not kept): the same loads and
  // drops, layer_stats[0 .. nlayer_stats) of at most max_layer_stats (set by rt_main).
  RtLayerStats *layer_stats;
  int nlayer_stats, max_layer_stats;
  // The pooled aux loss this forward (rt_pool_layer): the sums so far ([2*E+1]: scores and
  // choices per expert, then tokens; NULL before the first pooled layer), the statistics buffers
  // in the arena that the backward reads (coefficient not 0), the experts and the coefficient.
  double *pool_sum;
  float *pool[RT_POOL_MAX_LAYERS];
  int npool, pool_experts;
  double pool_coef;
  void *record;                   // FILE * for the record hook, or NULL (set by rt_main)
  // The driver's, for the step functions' collectives and task tables (set by rt_main).
  RtComm *comm;                   // NULL: a world of one
  RtStreams *streams;             // NULL: tasks run in program order on the calling thread
  // Set by rt_main before update: the learning rate is the kernels' lr times lr_scale (the
  // schedule), every gradient is scaled by grad_scale (clipping); 1 and 1 without either.
  float lr_scale, grad_scale;
};

// Resets the per-forward statistics; the generated forward calls it first.
void rt_step_begin_forward(RtStep *st);
// fn(st) on every thread of the pool at once (runtime/threads.c): the generated update's
// optimizer calls, each thread updating its share of every tensor, with one wait at the end
// instead of one per tensor (rt_sgd and rt_adamw split their loops over a team they run in).
void rt_team(void (*fn)(RtStep *), RtStep *st);
// The pooled aux loss (manual §11.3 `aux pooled`): after each pooled layer the generated forward
// adds its statistics [2, e] (rt_aux_pooled's, of tokens tokens) to the step's with
// rt_pool_layer; at its end rt_pool_finish (collective over the world) sums them over the ranks,
// adds the loss (E * sum_i F_i P_i) and coef times it to st->aux and st->aux_total (on world
// rank 0, the report's share) and, when coef is not 0, writes P_i and F_i / N back into every
// layer's buffer, which the backward's gate.aux_pooled.grad reads.
void rt_pool_layer(RtStep *st, float *stats, int e, int64_t tokens, double coef);
void rt_pool_finish(RtStep *st);

// The generated main(): `return rt_main(&model, argc, argv);`
int rt_main(const RtModel *model, int argc, char **argv);
// The main of a model of several pipeline stages (codegen's cg_emit_stages_main): stages[s] is
// stage s's program; each rank runs its stage's (world rank / (dp*mp)).
int rt_main_stages(const RtModel *const *stages, int nstages, int argc, char **argv);

// Stream execution of a scheduled function (passes/schedule.c, runtime/streams.c). The
// generated code turns a function whose ops carry streams and events into a table of tasks in
// program order: a task runs on its stream after the events it waits on are recorded, and
// records its event (-1 none, else an index below nevents) when done. Events are local to one
// call; rt_run_streams returns when every task has run (a full synchronisation). An RtStreams
// runs the intra and inter streams on worker threads of its own, started on first use and
// stopped by rt_streams_destroy; it runs every task in program order on the calling thread
// instead when MOERT_STREAMS=0 is set or when comm's collectives cannot run on several threads
// at once (rt_comm_thread_safe).
typedef enum RtStream { RT_STREAM_COMPUTE, RT_STREAM_INTRA, RT_STREAM_INTER, RT_STREAM_COUNT } RtStream;
#define RT_TASK_MAX_WAITS 16
typedef struct RtTask {
  int stream;                     // RtStream
  void (*fn)(RtStep *st);
  int nwaits;
  int waits[RT_TASK_MAX_WAITS];
  int event;
} RtTask;
RtStreams *rt_streams_create(const RtComm *comm);
void rt_streams_destroy(RtStreams *s);            // NULL: nothing
// s NULL: the tasks run in program order on the calling thread.
void rt_run_streams(RtStreams *s, RtStep *st, const RtTask *tasks, int ntasks, int nevents);

#endif
