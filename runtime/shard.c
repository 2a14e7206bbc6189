// Sharded parameters: where a rank's slice of each tensor lies (ranks, boxes, the moments' parts),
// seeded init by global index, and the copy between boxes that checkpoints (checkpoint.c) and the
// gathers of whole tensors for --dump (world.c) both use. Everything here is local: no collective.
//
// The idea: a parameter is one whole tensor (global_dims) and a rank holds a box of it. Nothing
// that leaves the process depends on the layout: initial values are a function of the global
// element index, dumps are whole tensors, and a checkpoint is a set of boxes, each labelled with
// its global shape and offsets (checkpoint.c).
#include "moert.h"
#include "rt_internal.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

// ---- ranks and boxes ----

RtRanks rt_ranks_of(const RtLayout *l, int rank, int world) {
  RtRanks r = {.rank = rank, .world = world, .dp = l->dp, .mp = l->mp, .ep = l->ep,
               .esp = l->esp, .stages = 1};
  r.dp_index = rank / l->mp;
  r.mp_index = rank % l->mp;
  r.ep_index = rank / l->esp;
  r.esp_index = rank % l->esp;
  return r;
}

void rt_shard_offsets(const RtParam *p, const RtRanks *r, int64_t off[4]) {
  for (int d = 0; d < 4; d++)
    off[d] = 0;
  if (p->shard_ep >= 0)
    off[p->shard_ep] = r->ep_index * p->dims[p->shard_ep];
  if (p->shard_esp >= 0)
    off[p->shard_esp] = r->esp_index * p->dims[p->shard_esp];
  if (p->shard_mp >= 0)
    off[p->shard_mp] = r->mp_index * p->dims[p->shard_mp];
}

// The lowest rank that holds a box: an MP shard lives on every DP replica of its MP rank.
bool rt_shard_owner(const RtParam *p, const RtRanks *r) {
  if (p->shard_mp >= 0)
    return r->dp_index == 0;
  return (p->shard_ep >= 0 || r->ep_index == 0) && (p->shard_esp >= 0 || r->esp_index == 0);
}

// p's moments are kept by rows of dims[0] over its group (p->shard), and it has rows to split.
static bool row_sharded(const RtParam *p) { return p->shard && p->rank > 0 && p->dims[0] > 0; }

void rt_param_part(const RtComm *c, const RtParam *p, int64_t *lo, int64_t *n) {
  *lo = 0;
  *n = p->numel;
  if (row_sharded(p))
    rt_shard_part(c, (RtGroup)(p->shard - 1), p->dims[0], p->numel / p->dims[0], lo, n);
}

int64_t rt_moment_floats(const RtComm *c, const RtModel *m) {
  int64_t floats = 0;
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *p = &m->params[i];
    int64_t kept = p->frozen ? 0 : p->numel;
    if (kept && row_sharded(p)) {
      int64_t g = rt_comm_size(c, (RtGroup)(p->shard - 1));
      kept = (p->dims[0] + g - 1) / g * (p->numel / p->dims[0]);
    }
    floats += kept;
  }
  return floats;
}

// This rank's box of parameter p: its shard (off, dims), or for a moment of a sharded optimizer
// (moment true, p->shard) the rows of the shard it keeps; *lo: the box's first element in the
// shard, *numel its elements.
void rt_box_of(const RtComm *c, const RtParam *p, const RtRanks *r, bool moment, int64_t off[4],
                   int64_t dims[4], int64_t *lo, int64_t *numel) {
  rt_shard_offsets(p, r, off);
  memcpy(dims, p->dims, 4 * sizeof *dims);
  *lo = 0;
  *numel = p->numel;
  if (!moment || !p->shard)
    return;
  rt_param_part(c, p, lo, numel);
  int64_t row = p->dims[0] > 0 ? p->numel / p->dims[0] : 1;
  off[0] += *lo / row;
  dims[0] = *numel / row;
}

void rt_touch_moments(const RtComm *c, const RtModel *m, float *opt_m, float *opt_v) {
  bool sharded = false;
  for (int i = 0; i < m->nparams; i++)
    sharded |= m->params[i].shard != 0;
  if (!sharded) {
    size_t bytes = (rt_grad_floats(m) ? rt_grad_floats(m) : 1) * sizeof(float);
    rt_big_touch(opt_m, bytes);
    rt_big_touch(opt_v, bytes);
    return;
  }
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *p = &m->params[i];
    int64_t lo, n;
    if (p->frozen) continue;
    rt_param_part(c, p, &lo, &n);
    rt_big_touch(opt_m + p->offset + lo, (size_t)n * sizeof(float));
    rt_big_touch(opt_v + p->offset + lo, (size_t)n * sizeof(float));
  }
}

void rt_shard_gather_grads(RtComm *c, const RtModel *m, float *grads) {
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *p = &m->params[i];
    if (row_sharded(p) && !p->frozen)
      rt_shard_gather(c, (RtGroup)(p->shard - 1), grads + p->offset, p->dims[0], p->numel / p->dims[0]);
  }
}

int64_t rt_param_global_numel(const RtParam *p) {
  int64_t n = 1;
  for (int d = 0; d < p->rank; d++)
    n *= p->global_dims[d];
  return n;
}

// Element j of the box of dims at off in p's whole tensor, as a global index.
int64_t rt_box_global_index(const RtParam *p, const int64_t off[4], const int64_t dims[4], int64_t j) {
  int64_t g = 0, stride = 1;
  for (int d = p->rank - 1; d >= 0; d--) {
    int64_t c = j % dims[d];
    j /= dims[d];
    g += (c + off[d]) * stride;
    stride *= p->global_dims[d];
  }
  return g;
}

int64_t rt_shard_global_index(const RtParam *p, const int64_t off[4], int64_t j) {
  return rt_box_global_index(p, off, p->dims, j);
}

void rt_shard_init(const RtParam *p, const RtRanks *r, uint64_t seed, float *w) {
  uint64_t key = rt_key(rt_key(seed, RT_STREAM_INIT), rt_hash_name(p->name));
  int64_t off[4];
  rt_shard_offsets(p, r, off);
  if (p->init == RT_INIT_NORMAL) {
    // Each row of the shard (its last dimension) is a run of consecutive global indices.
    int64_t last = p->rank > 0 ? p->dims[p->rank - 1] : 1, rows = last > 0 ? p->numel / last : 0;
    RT_PARALLEL_FOR(rows > 1 && p->numel >= RT_PAR_MIN / 8)
    for (int64_t row = 0; row < rows; row++)
      rt_normal_fill(key, (uint64_t)rt_shard_global_index(p, off, row * last), last, w + row * last);
    RT_PARALLEL_FOR_SIMD(p->numel >= RT_PAR_MIN)
    for (int64_t j = 0; j < p->numel; j++)
      w[j] = (float)(p->std * (double)w[j]);   // std * rt_normal(key, global index), rounded once
    return;
  }
  if (p->init == RT_INIT_UNIFORM) {   // within +-std (a LoRA adapter's A: PEFT's kaiming_uniform)
    RT_PARALLEL_FOR(p->numel >= RT_PAR_MIN / 8)
    for (int64_t j = 0; j < p->numel; j++) {
      double u = rt_uniform(rt_key(key, (uint64_t)rt_shard_global_index(p, off, j)));
      w[j] = (float)((double)p->std * (2 * u - 1));
    }
    return;
  }
  RT_PARALLEL_FOR(p->numel >= RT_PAR_MIN / 8)
  for (int64_t j = 0; j < p->numel; j++)
    w[j] = p->init == RT_INIT_ZEROS ? 0.0f : p->init == RT_INIT_ONES ? 1.0f : p->std;
}

// Row-major strides of a box.
void rt_box_strides(int rank, const int64_t *dims, int64_t *stride) {
  int64_t s = 1;
  for (int d = rank - 1; d >= 0; d--) {
    stride[d] = s;
    s *= dims[d];
  }
}

// The intersection of two boxes of a tensor of `rank` dimensions, [lo, hi) in each; false when
// it is empty.
bool rt_box_meet(int rank, const int64_t *a_off, const int64_t *a_dims, const int64_t *b_off,
                     const int64_t *b_dims, int64_t *lo, int64_t *hi) {
  for (int d = 0; d < rank; d++) {
    lo[d] = a_off[d] > b_off[d] ? a_off[d] : b_off[d];
    int64_t ae = a_off[d] + a_dims[d], be = b_off[d] + b_dims[d];
    hi[d] = ae < be ? ae : be;
    if (lo[d] >= hi[d])
      return false;
  }
  return true;
}

// rt_box_copy of the source rows [lo0, hi0) of the first dimension, the others from lo to hi.
static void box_copy_rows(int rank, const int64_t *src_off, const int64_t *src_dims, const void *src,
                          const int64_t *dst_off, const int64_t *dst_dims, float *dst,
                          const int64_t *lo, const int64_t *hi, int64_t lo0, int64_t hi0) {
  int64_t c[RT_MAX_RANK], sstride[RT_MAX_RANK], dstride[RT_MAX_RANK];
  rt_box_strides(rank, src_dims, sstride);
  rt_box_strides(rank, dst_dims, dstride);
  memcpy(c, lo, (size_t)rank * sizeof *c);
  c[0] = lo0;
  int last = rank - 1;
  int64_t run = hi[last] - lo[last];
  if (last == 0)
    run = hi0 - lo0;
  for (;;) {
    int64_t si = 0, di = 0;
    for (int d = 0; d < rank; d++) {
      si += (c[d] - src_off[d]) * sstride[d];
      di += (c[d] - dst_off[d]) * dstride[d];
    }
    memcpy(dst + di, (const unsigned char *)src + si * (int64_t)sizeof(float),
           (size_t)run * sizeof(float));
    int d = last - 1;
    while (d >= 0 && ++c[d] == (d == 0 ? hi0 : hi[d])) {
      c[d] = d == 0 ? lo0 : lo[d];
      d--;
    }
    if (d < 0)
      return;
  }
}

int64_t rt_box_copy(int rank, const int64_t *src_off, const int64_t *src_dims, const void *src,
                    const int64_t *dst_off, const int64_t *dst_dims, float *dst) {
  int64_t lo[RT_MAX_RANK], hi[RT_MAX_RANK];
  if (!rt_box_meet(rank, src_off, src_dims, dst_off, dst_dims, lo, hi))
    return 0;
  if (rank == 0) {
    memcpy(dst, src, sizeof(float));
    return 1;
  }
  int64_t total = 1;
  for (int d = 0; d < rank; d++)
    total *= hi[d] - lo[d];
  // Slabs of the first dimension's rows shared out over the threads: a large tensor's copy is
  // the first write of its pages' lines, one core's memory bandwidth would bound it.
  int64_t rows = hi[0] - lo[0], slabs = total >= (1 << 20) && rows > 1 ? (rows < 64 ? rows : 64) : 1;
  RT_PARALLEL_FOR(slabs > 1)
  for (int64_t k = 0; k < slabs; k++)
    box_copy_rows(rank, src_off, src_dims, src, dst_off, dst_dims, dst, lo, hi,
                  lo[0] + rows * k / slabs, lo[0] + rows * (k + 1) / slabs);
  return total;
}
