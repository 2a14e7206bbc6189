// What the training loop hands the step and reads back, below the driver (main.c) and its rooms
// (check_grad.c, dump.c, sample.c, pipeline.c), which all call it: each step's data (synthetic
// from the seed, --input/--target's files, a language model's windows), the device's copies of a
// model of the CUDA target (rt_device_put / rt_device_get), and the step's report reduced over
// the ranks. It calls nothing above it.
#include "moert.h"

#include "rt_trainer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ---- the device's copies (a model of the CUDA target) ----

int rt_device_put(RtTrainer *tr, unsigned what) {
  const RtDevice *dev = tr->model->device;
  return dev ? rt_world_agree(tr->comm, dev->upload(&tr->st, what)) : 0;
}

int rt_device_get(RtTrainer *tr, unsigned what) {
  const RtDevice *dev = tr->model->device;
  return dev ? rt_world_agree(tr->comm, dev->download(&tr->st, what)) : 0;
}

// ---- the report: a step's figures, reduced over the ranks ----

// st->mse is this rank's share of the mean over the global batch (MP ranks hold the same
// value), so it sums over DP; aux, z and aux_total are shares that sum over the world, as do
// the routing counts. Collective on several ranks.
RtReport rt_report_reduce(const RtTrainer *tr, const RtStep *st, const uint64_t *hash0) {
  // The loss before its rounding to float, where the last loss kernel on this host computed it
  // (else mse itself: the CUDA program's, a hand-written forward's).
  RtReport r = {.mse = st->mse, .loss_exact = rt_loss_exact(st->mse)};
  double sums[7] = {st->aux, st->z, st->aux_total, (double)st->dropped, (double)st->routed,
                    st->load_sum, (double)st->load_count};
  double maxes[4] = {st->load_count > 0 ? -(double)st->load_min : -INFINITY,
                     (double)st->load_max, (double)st->capacity_max,
                     hash0 && st->route_hash != *hash0};
  if (tr->ranks.world > 1) {
    double mse[2] = {r.mse, r.loss_exact};
    rt_allreduce_f64(tr->comm, RT_GROUP_DP, mse, 2);
    r.mse = mse[0];
    r.loss_exact = mse[1];
    rt_allreduce_f64(tr->comm, RT_GROUP_WORLD, sums, 7);
    rt_world_max(tr->comm, maxes, 4);
  }
  if (tr->ranks.stages > 1) {   // the loss is the last stage's; the layers' figures every stage's
    double mse[2] = {r.mse, r.loss_exact};
    rt_pp_sum_f64(tr->comm, mse, 2);
    r.mse = mse[0];
    r.loss_exact = mse[1];
    rt_pp_sum_f64(tr->comm, sums, 7);
    rt_pp_max_f64(tr->comm, maxes, 4);
  }
  r.aux = sums[0];
  r.z = sums[1];
  r.aux_total = sums[2];
  r.dropped = sums[3];
  r.routed = sums[4];
  r.load_sum = sums[5];
  r.load_count = sums[6];
  r.load_min = -maxes[0];
  r.load_max = maxes[1];
  r.capacity_max = maxes[2];
  r.route_changed = maxes[3] != 0;
  r.loss = r.mse + r.aux_total;
  r.loss_exact += r.aux_total;
  return r;
}

// ---- data ----

// target[s, m] = 0.5 * x[s, (m + 1) % M]: a linear teacher every model can learn.
static void derive_target(const float *x, float *target, int64_t tokens, int64_t embed) {
  if (embed < 1) return;
  RT_PARALLEL_FOR(tokens * embed >= RT_PAR_MIN)
  for (int64_t s = 0; s < tokens; s++) {
    const float *xs = x + s * embed;
    float *ts = target + s * embed;
    RT_SIMD
    for (int64_t m = 0; m < embed - 1; m++)
      ts[m] = 0.5f * xs[m + 1];
    ts[embed - 1] = 0.5f * xs[0];   // (m + 1) mod embed
  }
}

// The samples first .. first + batch - 1 of the step's global batch.
static void synthetic_input(const RtModel *m, int64_t step, int64_t first, float *x) {
  uint64_t step_key = rt_key(rt_key(m->seed, RT_STREAM_INPUT), (uint64_t)step);
  int64_t per_sample = m->seqlen * m->embed;
  for (int64_t s = 0; s < m->batch; s++)   // element j of sample (first + s)
    rt_normal_fill(rt_key(step_key, (uint64_t)(first + s)), 0, per_sample, x + s * per_sample);
}

// The files hold the global batch [dp*B, L, M] (B = microbatches x the program's batch); this
// rank keeps its DP shard, its microbatches one after the other.
static int read_global_batch(RtTrainer *tr, const char *path, float *dst) {
  const RtModel *m = tr->model;
  const RtRanks *r = &tr->ranks;
  int64_t micro = m->microbatches > 1 ? m->microbatches : 1, mine = micro * tr->elems;
  if (r->dp == 1) {
    int64_t dims[3] = {micro * m->batch, m->seqlen, m->embed};
    return rt_npy_read_f32(path, 3, dims, dst);
  }
  int64_t dims[3] = {r->dp * micro * m->batch, m->seqlen, m->embed};
  float *all = rt_alloc((size_t)(r->dp * mine) * sizeof(float), "the global batch");
  int status = rt_npy_read_f32(path, 3, dims, all);
  if (status == 0)
    memcpy(dst, all + r->dp_index * mine, (size_t)mine * sizeof(float));
  free(all);
  return status;
}

// --input (and --target): with microbatches every one of them in fixed_in and fixed_target, else
// the step's input and target themselves.
int rt_load_data(RtTrainer *tr) {
  const RtModel *m = tr->model;
  float *in = tr->input, *target = tr->target;
  if (m->microbatches > 1) {
    size_t bytes = (size_t)(m->microbatches * tr->elems) * sizeof(float);
    in = tr->fixed_in = rt_alloc(bytes, "the microbatches' input");
    target = tr->fixed_target = rt_alloc(bytes, "the microbatches' target");
  }
  int64_t micro = m->microbatches > 1 ? m->microbatches : 1;
  if (read_global_batch(tr, tr->opt.input, in) != 0)
    return -1;
  if (tr->opt.target)
    return read_global_batch(tr, tr->opt.target, target);
  derive_target(in, target, micro * m->batch * m->seqlen, m->embed);
  return 0;
}

void rt_fill_data(RtTrainer *tr, int64_t step, int64_t first, int micro, float *input, float *target) {
  tr->st.step = step;
  const RtModel *m = tr->model;
  if (m->vocab > 0) {
    rt_lm_fill(&tr->lm, step, first, (int32_t *)input, (int32_t *)target);
    return;
  }
  if (tr->fixed_data) {
    if (tr->fixed_in) {
      memcpy(input, tr->fixed_in + micro * tr->elems, (size_t)tr->elems * sizeof(float));
      memcpy(target, tr->fixed_target + micro * tr->elems, (size_t)tr->elems * sizeof(float));
    }
    return;
  }
  synthetic_input(m, step, first, input);
  derive_target(input, target, m->batch * m->seqlen, m->embed);
}

void rt_fill_step_data(RtTrainer *tr, int64_t step) {
  rt_fill_data(tr, step, tr->ranks.dp_index * tr->model->batch, 0, tr->input, tr->target);
}
