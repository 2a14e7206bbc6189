// Internals shared by the runtime's files: the error message of the last failed call, .npy and
// safetensors files, a language model's token data.
//
// Errors: a function that can fail on user input records one sentence with rt_fail() and
// returns -1; whoever gives up (rt_main) prints it once as "moert: error: SENTENCE". The
// sentence names the file and what is wrong with it, so nothing below has to print.
#ifndef RT_INTERNAL_H
#define RT_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "moert.h"   // RtGroup, RtStep, rt_fail

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "libmoert reads and writes little-endian files with memcpy; port npy.c and safetensors.c"
#endif

// ---- errors (error.c) ----
// rt_fail (moert.h) records the message and returns -1.
// The message of the last rt_fail, "" when none.
const char *rt_last_error(void);
void rt_clear_error(void);
// Out of memory: one policy for the whole runtime. The job ends with "moert: error: rank R on
// HOST: out of memory: WHAT needs N bytes" and exit status 1 (every rank, through rt_comm_abort).
// bytes 0: a library's allocation of a size not known here (cJSON's), said as "out of memory:
// WHAT".
_Noreturn void rt_out_of_memory(size_t bytes, const char *what);
// malloc / calloc / strdup that end the job so when they fail (0 bytes allocate 1).
void *rt_alloc(size_t bytes, const char *what);
void *rt_calloc(size_t n, size_t size, const char *what);
char *rt_strdup(const char *s, const char *what);
// A large block (parameters, gradients, optimizer state, the arena, a file read whole): zeroed,
// and from RT_BIG_PAGE bytes on its own mapping, 2 MiB aligned (a kernel whose transparent huge
// pages are "always" backs it with them; moec does not ask for them: the "madvise" mode's
// compaction stalled the first step), its pages zeroed by the kernel at their first touch.
// Freed with rt_big_free and the same size (NULL allowed).
enum { RT_BIG_PAGE = 2 << 20 };
void *rt_big_alloc(size_t bytes, const char *what);
void rt_big_free(void *p, size_t bytes);
// Faults in every whole page of the block p[0, bytes) of at least RT_BIG_PAGE bytes, its contents
// kept, 2 MiB chunks shared out over the threads: the first touch of what is about to be written
// (a checkpoint's parameters, every step's gradients), in parallel rather than by the first writer.
void rt_big_touch(void *p, size_t bytes);
// MOERT_PLAIN_MEMORY=1: none of this (calloc, files read into memory): bench/memory.sh's baseline.
bool rt_plain_memory(void);
int rt_make_dirs(const char *path);   // mkdir -p (runtime/files.c); -1 with rt_fail's sentence
// A JSON string literal of s (quoted and escaped by cJSON), malloc'ed; out of memory ends the job
// (what: for the message). runtime/checkpoint.c.
char *rt_json_quote(const char *s, const char *what);

// ---- fault injection, for tests only (fault.c) ----
// MOERT_TEST_KILL="RANK:STEP": world rank RANK dies by SIGKILL mid-step STEP (rank -1: never).
typedef struct RtFault {
  int rank;
  int64_t step;
} RtFault;
RtFault rt_fault_from_env(void);
// Where a step may die: the driver calls it once per step, between forward and backward.
void rt_fault_point(const RtFault *f, int rank, int64_t step);
// MOERT_TEST_SCALE="RANK:NAME:FACTOR": world rank RANK's shard of parameter NAME times FACTOR.
void rt_fault_scale(const RtModel *m, int rank, float *params);

// ---- --profile's communication figures (profile.c) ----
// CLOCK_MONOTONIC in ns.
int64_t rt_mono_ns(void);
// Starts (and clears) or stops recording. While on, comm.c records every collective and
// streams.c every wait of the compute thread; rt_prof_take gives, since the last take, the
// time any collective was in flight (comm) and the part of it the compute thread spent
// computing (hidden), in ms, and clears the record; per_kind (may be NULL) gets the summed time
// of each kind of collective (RT_PROF_KINDS, in RtProfKind's order), ms.
typedef enum RtProfKind { RT_PROF_ALLTOALL, RT_PROF_ALLGATHER, RT_PROF_REDUCESCATTER, RT_PROF_ALLREDUCE,
                          RT_PROF_OTHER, RT_PROF_KINDS } RtProfKind;
void rt_prof_enable(bool on);
bool rt_prof_on(void);
void rt_prof_set_worker(void);               // this thread runs an intra or inter stream
void rt_prof_comm(RtProfKind kind, int64_t t0_ns, int64_t t1_ns);
void rt_prof_idle(int64_t t0_ns, int64_t t1_ns);
void rt_prof_take(double *comm_ms, double *hidden_ms, double *per_kind);
// --profile's kernel times (kernels/ffn.c): whether rt_gemm_profile turned them on, and the
// attention kernels' (kernels/attn.c) share of them.
bool rt_gemm_profiling(void);
void rt_attn_ns_add(int64_t ns);

// ---- waiting for collectives (comm.c) ----
// Collectives are nonblocking MPI calls completed by polling MPI_Test: `sleep` (the default)
// spins for a few microseconds, then sleeps between tests with a backoff up to poll_us, so that
// a rank's waiting threads leave its cores to the compute thread; `spin` tests without
// sleeping (MPI_Wait's behaviour). A collective that has not completed after timeout_s seconds
// (<= 0: never) ends the job with a sentence naming it, its group and the time waited.
// Defaults: sleep, 200 us, 20 s; MOERT_COMM_WAIT=spin|sleep, MOERT_COMM_POLL_US and
// MOERT_COMM_TIMEOUT override them, and rt_main's --comm-timeout overrides the timeout.
void rt_comm_set_timeout(double seconds);

// ---- routing statistics (runtime/kernels/gate.c) ----
// Adds the per-expert loads of one layer (load[e]: tokens or choices kept by each expert) to
// st's load_min / load_max / load_sum / load_count. st may be NULL.
typedef struct RtStep RtStep;
void rt_add_loads(RtStep *st, const int64_t *load, int e);
// The statistics of the layer being routed now (the next of st->layer_stats, zeroed), or NULL
// when they are not kept; rt_layer_loads folds one routing group's loads into them (l may be NULL).
RtLayerStats *rt_layer_next(RtStep *st);
void rt_layer_loads(RtLayerStats *l, const int64_t *load, int e);

// ---- .npy (version 1.0 written; 1.0, 2.0 and 3.0 read), little-endian, C order ----
typedef enum RtDtype { RT_DTYPE_F32, RT_DTYPE_F64, RT_DTYPE_I32, RT_DTYPE_I64, RT_DTYPE_U16 } RtDtype;

enum { RT_MAX_RANK = 8 };

typedef struct RtArray {
  RtDtype dtype;
  int rank;                     // 0 for a scalar
  int64_t dims[RT_MAX_RANK];
  int64_t numel;
  void *data;                   // numel elements, malloc'ed; rt_array_free releases it
} RtArray;

size_t rt_dtype_size(RtDtype dtype);
const char *rt_dtype_name(RtDtype dtype);    // "float32", "float64", "int32", "int64", "uint16"

// Writes data as PATH. rank 0 writes a 0-d array of one element.
int rt_npy_write(const char *path, RtDtype dtype, int rank, const int64_t *dims,
                 const void *data);
// Reads any supported .npy into *out (zeroed on failure).
int rt_npy_read(const char *path, RtArray *out);
// Reads a float32 array that must have exactly the given shape into dst (numel floats).
int rt_npy_read_f32(const char *path, int rank, const int64_t *dims, float *dst);
void rt_array_free(RtArray *a);

// Formats a shape as "[2, 3]" ("[]" for a scalar) into buf.
const char *rt_shape_str(char *buf, size_t len, int rank, const int64_t *dims);

// ---- token data (runtime/data.c) ----
// A language model's tokens: a token file loaded whole, training windows at hashed offsets,
// validation windows in order, synthetic windows when there is no file, and an --input .npy of
// windows. A window is seqlen+1 tokens (int32): position i's target is token i+1. data.c's
// header comment gives every formula exactly (tests/ref reproduces them).
typedef struct RtTokens {
  char *path;               // the file, for messages
  const char *format;       // "bytes", "u16" or "llmc"
  uint16_t *tokens;         // count tokens (a byte file's bytes widened)
  int64_t count;
} RtTokens;

// Loads PATH whole. format "bytes" (each byte a token), "u16" (little-endian uint16, the
// nanoGPT convention) or "llmc" (llm.c's: a header of 256 little-endian int32, magic 20240520,
// version 1, token count N, then N uint16 tokens); NULL: llmc when the file begins with llm.c's
// magic, else by extension, .txt or .text (any case) bytes, else u16. Every token must be below
// vocab, and the file must hold at least seqlen+1 tokens. *t is zeroed on failure.
int rt_tokens_load(RtTokens *t, const char *path, const char *format, int64_t vocab,
                   int64_t seqlen);
void rt_tokens_free(RtTokens *t);
// Training window of global sample g of step `step`: the seqlen+1 tokens at offset
// rt_key(rt_key(rt_key(seed, RT_STREAM_DATA), step), g) mod (count - seqlen), into dst.
void rt_tokens_train_window(const RtTokens *t, uint64_t seed, int64_t step, int64_t g,
                            int64_t seqlen, int32_t *dst);
// Validation: min(max_windows, (count-1)/seqlen) windows (max_windows <= 0: no limit); window w
// is tokens [w*seqlen, w*seqlen + seqlen + 1).
int64_t rt_tokens_val_count(const RtTokens *t, int64_t seqlen, int64_t max_windows);
void rt_tokens_val_window(const RtTokens *t, int64_t w, int64_t seqlen, int32_t *dst);
// Synthetic window of global sample g (no data file): an arithmetic sequence mod vocab whose
// start and stride come from the same hash as a training window's (data.c). vocab >= 2.
void rt_tokens_synthetic(uint64_t seed, int64_t step, int64_t g, int64_t seqlen, int64_t vocab,
                         int32_t *dst);
// --input: a .npy of int32 (or int64 or uint16) tokens of shape [rows, cols] into dst (rows*cols
// int32), every token in [0, vocab). Write windows back with rt_npy_write(RT_DTYPE_I32).
int rt_tokens_read_npy(const char *path, int64_t rows, int64_t cols, int64_t vocab,
                       int32_t *dst);

// ---- sampling and the optimizer's schedule (also data.c) ----
// One token from logits[vocab]: temperature <= 0 is argmax (ties to the lower index); else the
// first token whose cumulative softmax(logits/temperature) probability exceeds rt_uniform(key).
int32_t rt_sample_token(const float *logits, int vocab, float temperature, uint64_t key);
// The learning rate of step `step` (from 1): linear warmup over `warmup` steps, then a cosine to
// min_lr at decay_steps when decay_steps > warmup (decay_steps <= 0: none), min_lr after.
double rt_lr_at(double lr, int64_t warmup, int64_t decay_steps, double min_lr, int64_t step);
// The factor that scales gradients of global L2 norm `norm` to at most clip: 1 when clip <= 0,
// norm <= clip or norm is not finite (the caller reports that), else clip / norm.
double rt_clip_scale(double norm, double clip);

// The turn per position of rope pair c of R rotary columns: theta^(-2c/R), or with factor > 0
// YaRN's blend of it and its 1/factor (runtime/kernels/embed.c; codegen/cuda/embed.cu's twin).
double rt_rope_freq(int c, int R, double theta, double factor, int original, int truncate, double beta_fast,
                    double beta_slow);

// ---- atomic files (safetensors.c) ----
// Finishes writing the temporary file tmp (f open on it; ok: every write so far succeeded):
// flush, fsync, close, rename to path, fsync the folder. On failure removes tmp and returns -1
// with the reason recorded (rt_fail).
int rt_commit_file(FILE *f, bool ok, const char *tmp, const char *path);

// ---- safetensors (safetensors.c) ----
// The reader takes F32, F64, BF16 and F16 tensors (rt_st_copy converts each to float32); the
// writer writes F32.
typedef struct RtStTensor {     // one tensor to write
  const char *name;
  int rank;
  const int64_t *dims;
  const float *data;
} RtStTensor;

// Writes PATH atomically: PATH.tmp, fsync, rename, fsync of the directory. meta holds nmeta
// key/value pairs (2*nmeta strings) for "__metadata__"; nmeta may be 0.
int rt_st_write(const char *path, int ntensors, const RtStTensor *tensors, int nmeta,
                const char *const *meta);

typedef enum RtStDtype { RT_ST_F32, RT_ST_F64, RT_ST_BF16, RT_ST_F16 } RtStDtype;
const char *rt_st_dtype_name(RtStDtype d);   // "F32", "F64", "BF16", "F16"

typedef struct RtStEntry {
  char *name;
  RtStDtype dtype;
  int rank;
  int64_t dims[RT_MAX_RANK];
  int64_t numel;
  const unsigned char *bytes;   // numel little-endian elements of dtype inside the file's buffer,
                                // unaligned
} RtStEntry;

typedef struct RtStFile {
  int ntensors;
  RtStEntry *tensors;           // in file order
  int nmeta;
  char **meta;                  // 2*nmeta strings: key, value, ...
  unsigned char *buffer;        // the whole file (read-only)
  size_t size;
  bool mapped;                  // buffer is the file mapped (a large file), else read into memory
} RtStFile;

// Reads and validates PATH (header, dtypes, shapes, offsets); *out is zeroed on failure.
int rt_st_read(const char *path, RtStFile *out);
const RtStEntry *rt_st_find(const RtStFile *f, const char *name);
const char *rt_st_meta(const RtStFile *f, const char *key);   // NULL when absent
// The tensor's numel elements as float32 into dst: F32 as is, BF16 and F16 exactly (F16
// subnormals, infinities and NaNs included), F64 rounded to the nearest float.
void rt_st_copy(const RtStEntry *t, float *dst);
void rt_st_free(RtStFile *f);

// A set of safetensors files read together: one file, or the shards of a Hugging Face index.
typedef struct RtStSet {
  int nfiles;
  RtStFile *files;
  char **paths;                 // nfiles paths, as opened
  int ntensors;                 // over every file
  const RtStEntry **by_name;    // every tensor sorted by name (rt_st_set_find)
} RtStSet;

// Reads PATH: one safetensors file; a Hugging Face index, JSON {"metadata": {..},
// "weight_map": {"NAME": "SHARD FILE", ..}} with the shards relative to the index's folder; or a
// folder that holds model.safetensors or model.safetensors.index.json (not both). Every shard
// the index names is read once, and the index must say exactly where each tensor is: a tensor
// the index maps to a shard that lacks it, a tensor in two shards, or a shard's tensor the index
// does not list is an error naming the tensor and the files. *out zeroed on failure; 0 or -1
// with the reason recorded (rt_fail).
int rt_st_open(const char *path, RtStSet *out);
const RtStEntry *rt_st_set_find(const RtStSet *s, const char *name);   // NULL when absent
void rt_st_set_free(RtStSet *s);

// ---- collectives (comm.c): hooks for tests and benchmarks ----

// The largest count c hands to one MPI call (INT_MAX, clamped to [1, INT_MAX]); larger counts
// are cut into slices. Tests lower it to exercise the slicing with small buffers.
void rt_comm_set_max_chunk(RtComm *c, int64_t elements);
// The node hierarchy 1dh and 2dh use on group g: *nodes nodes of *per_node members each.
// False when the members are not spread evenly over nodes (1dh, 2dh then run flat) or when c is
// NULL.
bool rt_comm_hierarchy(const RtComm *c, RtGroup g, int *nodes, int *per_node);

// ---- this rank's place in the parallel layout (shard.c) ----
typedef struct RtLayout RtLayout;
typedef struct RtParam RtParam;
typedef struct RtModel RtModel;

typedef struct RtRanks {
  int rank, world;                              // in this rank's pipeline stage
  int stage, stages;                            // the pipeline stage (0 and 1 without stages)
  int dp, mp, ep, esp;                          // group sizes of the layout
  int dp_index, mp_index, ep_index, esp_index;  // rank / mp, rank % mp, rank / esp, rank % esp
} RtRanks;

// The coordinates of world rank `rank` of `world` in layout l.
RtRanks rt_ranks_of(const RtLayout *l, int rank, int world);

// ---- sharded parameters (shard.c) ----
// A parameter's shard is a box of its whole tensor (global_dims): dims[d] elements from offset
// off[d] along every dimension d, where the offset is ep_index * dims[shard_ep] along shard_ep,
// esp_index * dims[shard_esp] along shard_esp and 0 elsewhere.
void rt_shard_offsets(const RtParam *p, const RtRanks *r, int64_t off[4]);
// Whether rank r writes its shard of p to checkpoints and dumps: of the ranks that hold the same
// box (replicas over EP when p is not split over EP, over ESP likewise), the one with index 0 in
// that group. The owners' boxes tile the whole tensor exactly once.
bool rt_shard_owner(const RtParam *p, const RtRanks *r);
int64_t rt_param_global_numel(const RtParam *p);
// The global flat index (row-major over global_dims) of element j of the box at offsets off.
int64_t rt_shard_global_index(const RtParam *p, const int64_t off[4], int64_t j);
// The initial values of rank r's shard: the element with global flat index g gets what element g
// gets on one rank (RT_INIT_NORMAL: std * rt_normal(rt_key(rt_key(seed, INIT), hash(name)), g)).
void rt_shard_init(const RtParam *p, const RtRanks *r, uint64_t seed, float *w);
// Copies the intersection of a source box (offsets src_off, dims src_dims; src holds its
// little-endian floats, possibly unaligned) and a destination box of the same tensor of `rank`
// dimensions into dst (a large one by every thread). Returns the number of elements copied.
int64_t rt_box_copy(int rank, const int64_t *src_off, const int64_t *src_dims, const void *src,
                    const int64_t *dst_off, const int64_t *dst_dims, float *dst);
// This rank's box of parameter p: its shard (off, dims), or for a moment of a sharded optimizer
// (moment true, p->shard) the rows of the shard it keeps; *lo: the box's first element in the
// shard, *numel its elements.
void rt_box_of(const RtComm *c, const RtParam *p, const RtRanks *r, bool moment, int64_t off[4], int64_t dims[4],
               int64_t *lo, int64_t *numel);
// Element j of the box of dims at off in p's whole tensor, as a global index.
int64_t rt_box_global_index(const RtParam *p, const int64_t off[4], const int64_t dims[4], int64_t j);
// Row-major strides of a box.
void rt_box_strides(int rank, const int64_t *dims, int64_t *stride);
// The intersection of two boxes of a tensor of `rank` dimensions, [lo, hi) in each; false when
// it is empty.
bool rt_box_meet(int rank, const int64_t *a_off, const int64_t *a_dims, const int64_t *b_off, const int64_t *b_dims,
                 int64_t *lo, int64_t *hi);

// ---- world-wide helpers (world.c) ----
// Over the world group of c; plain local operations on a world of one (c NULL included).
// Called by every rank at the same point: 0 when every rank's status is 0; otherwise -1 on every
// rank, and the last error on every rank becomes the lowest failing rank's message (prefixed
// "rank R: " when R is not 0), so that rank 0 alone can report it.
int rt_world_agree(RtComm *c, int status);
// ---- gradient accumulation (comm.c) ----
// Microbatches (runtime/pipeline.c) reduce their summed gradients once: while the hook is SKIP, a
// reduction (rt_allreduce, rt_shard_reduce) of elements of grads [0, n) does nothing (the
// microbatches before the last add their local gradients into acc); in ADD mode each such
// reduction first adds acc to its elements, and rt_comm_grad_hook_finish adds acc to the
// elements no reduction saw (those each rank holds alone) and turns the hook off.
enum { RT_GRAD_HOOK_OFF, RT_GRAD_HOOK_SKIP, RT_GRAD_HOOK_ADD };
void rt_comm_grad_hook(RtComm *c, int mode, float *grads, float *acc, int64_t n);
void rt_comm_grad_hook_finish(RtComm *c);
// ---- pipeline stages (comm.c; RtLayout.pp > 1) ----
// This rank's stage and the number of stages (0 and 1 without stages, or for NULL).
int rt_comm_stage(const RtComm *c);
int rt_comm_stages(const RtComm *c);
// Rank and size of the whole job (every stage; the world when pp is 1).
int rt_all_rank(const RtComm *c);
int rt_all_size(const RtComm *c);
// Point-to-point with the rank of the same place in stage `stage`: a nonblocking send that
// rt_pp_wait finishes (before buf changes), a receive that returns with the data (with the
// collectives' deadline: a peer that is gone ends the job with a sentence).
enum { RT_PP_PIECES = 8 };
typedef struct RtPpSend {
  long long req[RT_PP_PIECES];   // MPI_Request (an int or a pointer: stored in 64 bits)
  int n, to;
  int64_t began;
} RtPpSend;
void rt_pp_send(RtComm *c, int stage, const float *buf, int64_t n, int tag, RtPpSend *req);
void rt_pp_wait(RtPpSend *req);
void rt_pp_recv(RtComm *c, int stage, float *buf, int64_t n, int tag);
int64_t rt_pp_tag_bound(const RtComm *c);   // the largest tag these messages may carry (MPI_TAG_UB)
// Blocking floats to or from rank `peer` of group g (tag 0), with the collectives' deadline.
void rt_send_floats(RtComm *c, RtGroup g, int to, const float *buf, int64_t n);
void rt_recv_floats(RtComm *c, RtGroup g, int from, float *buf, int64_t n);
// Sum and maximum over the stages (the ranks of this rank's place in each), in place.
void rt_pp_sum_f64(RtComm *c, double *buf, int n);
void rt_pp_max_f64(RtComm *c, double *buf, int n);
// Maximum and broadcast over the whole job (the world's when pp is 1).
void rt_all_max_f64(RtComm *c, double *buf, int n);
void rt_all_bcast(RtComm *c, void *buf, int64_t bytes, int root);
void rt_world_max(RtComm *c, double *v, int n);   // element-wise maximum over the world, in place
// Rank 0 assembles the whole tensor of p (global_dims, row-major) in whole from the owners'
// shards; other ranks pass their shard and whole = NULL.
void rt_gather_param(RtComm *c, const RtParam *p, const RtRanks *r, const float *shard,
                     float *whole);
// Rank 0 assembles the DP shards of n floats each (MP index 0's copy) in DP order in whole
// (dp * n floats); other ranks pass whole = NULL.
void rt_gather_dp(RtComm *c, const RtRanks *r, const float *mine, int64_t n, float *whole);

// ---- checkpoints (checkpoint.c) ----
// A checkpoint C is an index file (JSON: format "moec-checkpoint-2", model, optimizer, step,
// world, layout, shards) and one safetensors file per rank, C.rank<R>-of-<P>.safetensors, that
// holds the boxes this rank owns of every parameter and optimizer moment, each with its global
// shape and offsets in the metadata ("shard.NAME": "global=[4,8,8] offset=[2,0,0]").
// Saving is collective over the world of c: every rank writes its shard (atomically), and after
// all are durable rank 0 writes the index (atomically). opt_m / opt_v are written for adamw.
// With pipeline stages every rank of every stage writes its shard (R and P count the whole job)
// of its stage's parameters, but those skip[i] marks (another stage writes them; NULL: none).
int rt_checkpoint_save(RtComm *c, const char *path, const RtModel *m, const RtRanks *r,
                       int64_t step, const float *params, const float *opt_m,
                       const float *opt_v, const bool *skip);
// Loads rank r's shard of every parameter (and of both moments for adamw) from the checkpoint
// at path, whatever layout wrote it, and its step. Also reads the single-file format
// "moec-checkpoint-1". Each rank reads on its own (not collective).
int rt_checkpoint_load(RtComm *c, const char *path, const RtModel *m, const RtRanks *r, float *params,
                       float *opt_m, float *opt_v, int64_t *step);
// The first touch (rt_big_touch) of the moments this rank keeps (rt_param_part): all of them, or
// under a sharded optimizer its rows of each parameter, the other pages never backed.
void rt_touch_moments(const RtComm *c, const RtModel *m, float *opt_m, float *opt_v);
// The floats of one AdamW moment the plan counts per rank: every parameter's, or under a sharded
// optimizer the largest member's rows (the memory plan's count, passes/memplan.c).
int64_t rt_moment_floats(const RtComm *c, const RtModel *m);
// Under a sharded optimizer a rank holds the sums of its rows of each gradient only: each member's
// rows of grads to every member (--dump and --check-grad read whole gradients).
void rt_shard_gather_grads(RtComm *c, const RtModel *m, float *grads);
// --weights: rank r's shard of every parameter from a safetensors file of whole tensors (F32,
// F64, BF16 or F16, converted to float32), a Hugging Face index of such files or a folder that
// holds one (rt_st_open; told from a moec index by its "weight_map"), or a checkpoint (index
// file) of any layout.
int rt_weights_load(const char *path, const RtModel *m, const RtRanks *r, float *params);

// ---- a language model's side of the trainer (lm.c) ----
enum { RT_STREAM_SAMPLE = 6 };   // rt_key(rt_key(seed, RT_STREAM_SAMPLE), i): the i-th sampled token
typedef struct RtLmOptions {
  const char *data, *val, *input;   // --data, --val, --input (NULL: the model's data block or none)
  int64_t val_windows;              // --val-windows (0: all)
} RtLmOptions;
typedef struct RtLm {
  const RtModel *model;
  RtTokens train, val;
  bool has_train, has_val;
  int32_t *fixed;                   // the --input windows [dp*B, L+1], or NULL
  int32_t *window;                  // one window of seqlen+1 tokens
  int64_t val_count, val_max;       // validation windows used / --val-windows
  const char *source, *val_source;  // for the header: the train and validation files
} RtLm;
// Opens the step's token source: --input windows, else the train file, else synthetic tokens;
// and the validation file when there is one. 0 or -1 (rt_fail).
int rt_lm_open(RtLm *lm, const RtModel *m, const RtRanks *r, const RtLmOptions *o);
void rt_lm_close(RtLm *lm);
// This rank's batch of step `step`: windows first .. first+batch-1 of the global batch into
// input (each window's first seqlen tokens) and target (the seqlen after them).
void rt_lm_fill(RtLm *lm, int64_t step, int64_t first, int32_t *input, int32_t *target);
// Whole global batches of validation windows, and this rank's part of batch `batch`.
int64_t rt_lm_val_batches(const RtLm *lm, int dp);
void rt_lm_fill_val(RtLm *lm, int64_t batch, int64_t first, int dp, int32_t *input, int32_t *target);
// The global L2 norm of the gradients: every shard counted once over the layout. Collective.
double rt_grad_norm(const RtModel *m, const RtRanks *r, RtComm *c, const float *grads, const bool *skip);
// lr_t / lr of the model's schedule at step t (1 without one).
double rt_lr_scale(const RtModel *m, int64_t step);
// tokens as text (a byte model, control bytes escaped) or ids, and a newline.
void rt_print_tokens(FILE *out, const RtModel *m, const int32_t *tokens, int64_t n);


// ---- threads (runtime/threads.c) ----
// libmoert's kernels and OpenBLAS share one pool of threads: OpenMP, with OpenBLAS's OpenMP
// build (mk/configure.sh picks both when Debian's libopenblas-openmp-dev is there; without it
// the kernels run on one thread and OpenBLAS keeps its own). RT_PARALLEL_FOR(cond) before a
// `for` splits its iterations into equal static ranges over the pool when cond holds (work big
// enough to pay for a parallel region). Every kernel that uses it computes each element exactly
// as the one-thread loop does (per element, or per column of a reduction, never a reduction
// split across threads), so results do not depend on the number of threads.
// RT_PARALLEL_FOR_SIMD also vectorises the loop: only for loops of +, -, *, /, sqrt and
// comparisons, which SIMD instructions round exactly as scalar ones (no libm calls: their
// vector versions round differently; no reductions across iterations; C11 mode contracts no
// FMAs), so the results stay those of the scalar loop.
#ifdef _OPENMP
#define RT_PRAGMA(x) _Pragma(#x)
#define RT_PARALLEL_FOR(cond) RT_PRAGMA(omp parallel for schedule(static) if (cond))
#define RT_PARALLEL_FOR_SIMD(cond) RT_PRAGMA(omp parallel for simd schedule(static) if (cond))
#define RT_SIMD RT_PRAGMA(omp simd)   // the next loop vectorises (same rules as _SIMD above)
// In a parallel region: the next loop's iterations shared out as RT_PARALLEL_FOR would (static),
// or the next statement on one thread, without a barrier after (the region's end has one);
// outside one, the caller runs all of it. (The column sums' _share functions: runtime/rt_fused.h.)
#define RT_FOR_SHARE RT_PRAGMA(omp for schedule(static) nowait)
#define RT_SINGLE_SHARE RT_PRAGMA(omp single nowait)
// A loop whose iterations are handed out one at a time as threads free (sizes that differ) and
// the next statement on one thread, each with a barrier after; a barrier.
#define RT_FOR_TEAM_DYNAMIC RT_PRAGMA(omp for schedule(dynamic, 1))
#define RT_SINGLE_TEAM RT_PRAGMA(omp single)
#define RT_BARRIER RT_PRAGMA(omp barrier)
// Iterations of very different sizes (one per tensor): handed out one at a time as threads free.
#define RT_PRAGMA_PARALLEL_DYNAMIC(cond) RT_PRAGMA(omp parallel for schedule(dynamic, 1) if (cond))
#define RT_PARALLEL(cond) RT_PRAGMA(omp parallel if (cond))   // the next statement on every thread
int omp_get_thread_num(void), omp_get_num_threads(void), omp_in_parallel(void);   // omp.h
static inline int rt_thread_id(void) { return omp_get_thread_num(); }    // in a parallel region
static inline int rt_team_size(void) { return omp_get_num_threads(); }   // its threads
static inline bool rt_in_team(void) { return omp_in_parallel(); }        // inside one (rt_team)
#else
#define RT_PARALLEL(cond)
static inline int rt_thread_id(void) { return 0; }
static inline int rt_team_size(void) { return 1; }
static inline bool rt_in_team(void) { return false; }
#define RT_PRAGMA_PARALLEL_DYNAMIC(cond)
#define RT_PARALLEL_FOR(cond)
#define RT_PARALLEL_FOR_SIMD(cond)
#define RT_SIMD
#define RT_FOR_SHARE
#define RT_SINGLE_SHARE
#define RT_FOR_TEAM_DYNAMIC
#define RT_SINGLE_TEAM
#define RT_BARRIER
#endif
// The vectorised kernels run on one of three paths, the same C compiled for AVX-512, for AVX2
// and for the x86-64 baseline (SSE2): 4x or 2x the lanes where the CPU has them. No FMA, and C11
// contracts nothing, so every path computes the same bits (tests/threads.sh runs each path the
// CPU can execute). rt_vector_path (runtime/vector.c) is the path they take: the widest the CPU
// has, or the one MOERT_VECTOR names (avx512, avx2, baseline: so that a machine checks the
// narrower paths too; rt_vector_check refuses a name the CPU cannot run).
// After RT_VECTOR_BODY void NAME_body(PARAMS) { ... }, RT_VECTOR_PATHS(NAME, (PARAMS), (ARGS))
// defines `static void NAME(PARAMS)`, which runs the body compiled for that path (ARGS: the
// parameters' names, as a call passes them); the helpers a body calls are inlined into each
// path's copy (always_inline).
typedef enum { RT_VECTOR_BASELINE, RT_VECTOR_AVX2, RT_VECTOR_AVX512 } RtVectorPath;
RtVectorPath rt_vector_path(void);
const char *rt_vector_name(RtVectorPath path);
// 0, or -1 with a sentence in why: MOERT_VECTOR names no path, or one this CPU cannot run.
int rt_vector_check(char *why, size_t size);
#define RT_VECTOR_BODY static inline __attribute__((always_inline))
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define RT_VECTOR_BUILT 1   // the three paths are compiled (else the baseline alone)
#define RT_VECTOR_PATHS(name, params, args)                                                     \
  __attribute__((target("avx512f"))) static void name##_avx512 params { name##_body args; } \
  __attribute__((target("avx2"))) static void name##_avx2 params { name##_body args; }      \
  static void name##_baseline params { name##_body args; }                                  \
  static void name params {                                                                 \
    RtVectorPath path = rt_vector_path();                                                   \
    if (path == RT_VECTOR_AVX512) name##_avx512 args;                                       \
    else if (path == RT_VECTOR_AVX2) name##_avx2 args;                                      \
    else name##_baseline args;                                                              \
  }
// RT_VECTOR_PATHS_P: the same, with the path passed to the body as its first parameter (a
// constant in each copy), for a kernel whose register blocking depends on the path's width.
#define RT_VECTOR_PATHS_P(name, params, args)                                                                 \
  __attribute__((target("avx512f"))) static void name##_avx512 params { name##_body(RT_VECTOR_AVX512, RT_ARGS args); } \
  __attribute__((target("avx2"))) static void name##_avx2 params { name##_body(RT_VECTOR_AVX2, RT_ARGS args); }      \
  static void name##_baseline params { name##_body(RT_VECTOR_BASELINE, RT_ARGS args); }                             \
  static void name params {                                                                                       \
    RtVectorPath path = rt_vector_path();                                                                         \
    if (path == RT_VECTOR_AVX512) name##_avx512 args;                                                             \
    else if (path == RT_VECTOR_AVX2) name##_avx2 args;                                                            \
    else name##_baseline args;                                                                                    \
  }
#else
#define RT_VECTOR_PATHS(name, params, args) \
  static void name params { name##_body args; }
#define RT_VECTOR_PATHS_P(name, params, args) \
  static void name params { name##_body(RT_VECTOR_BASELINE, RT_ARGS args); }
#endif
#define RT_ARGS(...) __VA_ARGS__   // (a, b) -> a, b

// exp(x) for the kernels' activations, from +, -, * and the exponent's bits, so that loops of it
// vectorise: x = n ln2 + r (n rounded by the 1.5 * 2^23 trick, ln2 in two parts), e^r by its
// Taylor polynomial of degree 7 (|r| <= 0.35), times 2^n built from its bits. Within 1.3 ulp of
// exp over [-87, 88]; x below -87 gives exp(-87), above 88 exp(88) (never inf, never a
// subnormal scale); NaN stays NaN. mk_exp in codegen/cuda/prelude.cu is the same sequence of
// float operations: the CUDA kernels (NVRTC with --fmad=false) compute the same bits.
static inline float rt_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  float t = x * 1.44269504f + 12582912.0f;
  float n = t - 12582912.0f;
  float r = (x - n * 0.693145751953125f) - n * 1.42860682e-6f;
  float p = 1.98412698e-4f;               // 1/7!
  p = p * r + 1.38888889e-3f;             // 1/6!
  p = p * r + 8.33333333e-3f;             // 1/5!
  p = p * r + 4.16666667e-2f;             // 1/4!
  p = p * r + 1.66666667e-1f;             // 1/3!
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  uint32_t bits;
  memcpy(&bits, &t, sizeof bits);
  bits = (bits - 0x4B400000u + 127u) << 23;   // 2^n
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Long sums in double as RT_LANES running sums: element j into sum j % RT_LANES, then the sums
// added pairwise (rt_lanes_total). The order is fixed by the length alone, so every path and
// thread count gives the same bits, and the loops vectorise instead of waiting on one chain of
// additions (the cross-entropy, the norms, the gradient norm).
enum { RT_LANES = 16 };
static inline double rt_lanes_total(double s[RT_LANES]) {
  for (int w = RT_LANES / 2; w > 0; w /= 2)
    for (int u = 0; u < w; u++) s[u] += s[u + w];
  return s[0];
}
// The sum of a[j] b[j] in double in RT_LANES running sums (inlined into each caller's vector
// path): a norm's row sums, the gradient norm's sums of squares (a = b).
static inline __attribute__((always_inline)) double rt_lanes_dot(const float *a, const float *b, int64_t n) {
  double s[RT_LANES] = {0};
  int64_t j = 0;
  for (; j + RT_LANES <= n; j += RT_LANES)
    for (int u = 0; u < RT_LANES; u++) s[u] += (double)a[j + u] * b[j + u];
  for (; j < n; j++) s[j % RT_LANES] += (double)a[j] * b[j];
  return rt_lanes_total(s);
}

enum { RT_PAR_MIN = 16384 };   // elements of cheap elementwise work worth a parallel region

// This thread's share [*lo, *hi) of n elements in the team it runs in (all of them outside one):
// contiguous ranges in thread order, their bounds at multiples of 16 (whole vectors).
static inline void rt_team_share(int64_t n, int64_t *lo, int64_t *hi) {
  int64_t units = (n + 15) / 16, t = rt_thread_id(), nt = rt_team_size();
  *lo = t * units / nt * 16;
  *hi = t + 1 == nt ? n : (t + 1) * units / nt * 16;
  if (*lo > n) *lo = n;
  if (*hi > n) *hi = n;
}
// The pool's size (1 without OpenMP). rt_threads_setup and rt_gemm_pieces are in moert.h;
// rt_gemm_pieces is OPENBLAS_NUM_THREADS when set, else the pool's size (1 without OpenMP, where
// OpenBLAS keeps its own threads).
int rt_threads(void);

#endif
