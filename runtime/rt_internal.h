// Internals shared by the runtime's files: the error message of the last failed call, .npy and
// safetensors files.
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

// ---- fault injection, for tests only (fault.c) ----
// MOERT_TEST_KILL="RANK:STEP": world rank RANK dies by SIGKILL mid-step STEP (rank -1: never).
typedef struct RtFault {
  int rank;
  int64_t step;
} RtFault;
RtFault rt_fault_from_env(void);
// Where a step may die: the driver calls it once per step, between forward and backward.
void rt_fault_point(const RtFault *f, int rank, int64_t step);

// ---- routing statistics (kernels.c) ----
// Adds the per-expert loads of one layer (load[e]: tokens or choices kept by each expert) to
// st's load_min / load_max / load_sum / load_count. st may be NULL.
typedef struct RtStep RtStep;
void rt_add_loads(RtStep *st, const int64_t *load, int e);

// ---- .npy (version 1.0 written; 1.0, 2.0 and 3.0 read), little-endian, C order ----
typedef enum RtDtype { RT_DTYPE_F32, RT_DTYPE_F64, RT_DTYPE_I32 } RtDtype;

enum { RT_MAX_RANK = 8 };

typedef struct RtArray {
  RtDtype dtype;
  int rank;                     // 0 for a scalar
  int64_t dims[RT_MAX_RANK];
  int64_t numel;
  void *data;                   // numel elements, malloc'ed; rt_array_free releases it
} RtArray;

size_t rt_dtype_size(RtDtype dtype);
const char *rt_dtype_name(RtDtype dtype);    // "float32", "float64", "int32"

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

// ---- atomic files (safetensors.c) ----
// Finishes writing the temporary file tmp (f open on it; ok: every write so far succeeded):
// flush, fsync, close, rename to path, fsync the folder. On failure removes tmp and returns -1
// with the reason recorded (rt_fail).
int rt_commit_file(FILE *f, bool ok, const char *tmp, const char *path);

// ---- safetensors (F32 tensors only) ----
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

typedef struct RtStEntry {
  char *name;
  int rank;
  int64_t dims[RT_MAX_RANK];
  int64_t numel;
  const unsigned char *bytes;   // numel little-endian floats inside the file's buffer, unaligned
} RtStEntry;

typedef struct RtStFile {
  int ntensors;
  RtStEntry *tensors;           // in file order
  int nmeta;
  char **meta;                  // 2*nmeta strings: key, value, ...
  unsigned char *buffer;        // the whole file
  size_t size;
} RtStFile;

// Reads and validates PATH (header, dtypes, shapes, offsets); *out is zeroed on failure.
int rt_st_read(const char *path, RtStFile *out);
const RtStEntry *rt_st_find(const RtStFile *f, const char *name);
const char *rt_st_meta(const RtStFile *f, const char *key);   // NULL when absent
void rt_st_copy(const RtStEntry *t, float *dst);                // numel floats
void rt_st_free(RtStFile *f);

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
  int rank, world;
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
// dimensions into dst, and sets covered[i] (destination flat index) for every element copied
// when covered is not NULL. Returns the number of elements copied.
int64_t rt_box_copy(int rank, const int64_t *src_off, const int64_t *src_dims, const void *src,
                    const int64_t *dst_off, const int64_t *dst_dims, float *dst,
                    unsigned char *covered);

// ---- world-wide helpers (shard.c) ----
// Over the world group of c; plain local operations on a world of one (c NULL included).
// Called by every rank at the same point: 0 when every rank's status is 0; otherwise -1 on every
// rank, and the last error on every rank becomes the lowest failing rank's message (prefixed
// "rank R: " when R is not 0), so that rank 0 alone can report it.
int rt_world_agree(RtComm *c, int status);
void rt_world_max(RtComm *c, double *v, int n);   // element-wise maximum over the world, in place
// Rank 0 assembles the whole tensor of p (global_dims, row-major) in whole from the owners'
// shards; other ranks pass their shard and whole = NULL.
void rt_gather_param(RtComm *c, const RtParam *p, const RtRanks *r, const float *shard,
                     float *whole);
// Rank 0 assembles the DP shards of n floats each (MP index 0's copy) in DP order in whole
// (dp * n floats); other ranks pass whole = NULL.
void rt_gather_dp(RtComm *c, const RtRanks *r, const float *mine, int64_t n, float *whole);

// ---- checkpoints (shard.c) ----
// A checkpoint C is an index file (JSON: format "moec-checkpoint-2", model, optimizer, step,
// world, layout, shards) and one safetensors file per rank, C.rank<R>-of-<P>.safetensors, that
// holds the boxes this rank owns of every parameter and optimizer moment, each with its global
// shape and offsets in the metadata ("shard.NAME": "global=[4,8,8] offset=[2,0,0]").
// Saving is collective over the world of c: every rank writes its shard (atomically), and after
// all are durable rank 0 writes the index (atomically). opt_m / opt_v are written for adamw.
int rt_checkpoint_save(RtComm *c, const char *path, const RtModel *m, const RtRanks *r,
                       int64_t step, const float *params, const float *opt_m,
                       const float *opt_v);
// Loads rank r's shard of every parameter (and of both moments for adamw) from the checkpoint
// at path, whatever layout wrote it, and its step. Also reads the single-file format
// "moec-checkpoint-1". Each rank reads on its own (not collective).
int rt_checkpoint_load(const char *path, const RtModel *m, const RtRanks *r, float *params,
                       float *opt_m, float *opt_v, int64_t *step);
// --weights: rank r's shard of every parameter from a safetensors file of whole tensors, or from
// a checkpoint (index file) of any layout.
int rt_weights_load(const char *path, const RtModel *m, const RtRanks *r, float *params);

#endif
