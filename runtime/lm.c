// The language model's side of the trainer (lang/manual.md §7.2): where a step's tokens come from, the
// validation loss, the gradient norm and its clipping, the learning-rate schedule, sampling.
//
// A step's global batch is dp*batch windows of seqlen+1 tokens; DP rank r holds windows
// [r*batch, (r+1)*batch). Window g of step t comes from the --data file (rt_tokens_train_window:
// an offset hashed from (seed, t, g)), from --input (the same windows every step), or is
// synthetic (rt_tokens_synthetic); so every layout sees the same global batch. The step's input
// is each window's first seqlen tokens and its target the seqlen after them, int32 in the
// buffers rt_main hands the step functions.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moert.h"
#include "rt_internal.h"
#include "rt_trainer.h"

int rt_lm_open(RtLm *lm, const RtModel *m, const RtRanks *r, const RtLmOptions *o) {
  *lm = (RtLm){.model = m, .val_max = o->val_windows};
  int64_t L = m->seqlen, rows = r->dp * m->batch;
  lm->window = rt_alloc((size_t)(L + 1) * sizeof(int32_t), "a token window");
  const char *train = o->data ? o->data : m->data_train;
  const char *val = o->val ? o->val : m->data_val;
  const char *format = o->data ? NULL : m->data_format;
  if (o->input) {
    lm->fixed = rt_alloc((size_t)(rows * (L + 1)) * sizeof(int32_t), "the --input windows");
    if (rt_tokens_read_npy(o->input, rows, L + 1, m->vocab, lm->fixed) != 0)
      return -1;
    lm->source = o->input;
  } else if (train) {
    if (rt_tokens_load(&lm->train, train, format, m->vocab, L) != 0)
      return -1;
    lm->has_train = true;
    lm->source = train;
  }
  if (val) {
    if (rt_tokens_load(&lm->val, val, o->val ? NULL : m->data_format, m->vocab, L) != 0)
      return -1;
    lm->has_val = true;
    lm->val_source = val;
    lm->val_count = rt_tokens_val_count(&lm->val, L, lm->val_max);
  }
  return 0;
}

void rt_lm_close(RtLm *lm) {
  if (lm->has_train)
    rt_tokens_free(&lm->train);
  if (lm->has_val)
    rt_tokens_free(&lm->val);
  free(lm->fixed);
  free(lm->window);
  *lm = (RtLm){0};
}

static void split_window(const int32_t *w, int64_t L, int32_t *input, int32_t *target) {
  memcpy(input, w, (size_t)L * sizeof *w);
  memcpy(target, w + 1, (size_t)L * sizeof *w);
}

void rt_lm_fill(RtLm *lm, int64_t step, int64_t first, int32_t *input, int32_t *target) {
  const RtModel *m = lm->model;
  int64_t L = m->seqlen;
  for (int64_t b = 0; b < m->batch; b++) {
    int64_t g = first + b;
    const int32_t *w = lm->window;
    if (lm->fixed)
      w = lm->fixed + g * (L + 1);
    else if (lm->has_train)
      rt_tokens_train_window(&lm->train, m->seed, step, g, L, lm->window);
    else
      rt_tokens_synthetic(m->seed, step, g, L, m->vocab, lm->window);
    split_window(w, L, input + b * L, target + b * L);
  }
}

int64_t rt_lm_val_batches(const RtLm *lm, int dp) {
  return lm->has_val ? lm->val_count / (lm->model->batch * dp) : 0;
}

void rt_lm_fill_val(RtLm *lm, int64_t batch, int64_t first, int dp, int32_t *input, int32_t *target) {
  const RtModel *m = lm->model;
  int64_t L = m->seqlen;
  for (int64_t b = 0; b < m->batch; b++) {
    rt_tokens_val_window(&lm->val, batch * m->batch * dp + first + b, L, lm->window);
    split_window(lm->window, L, input + b * L, target + b * L);
  }
}

// *sum = the sum of g[j]^2 in double (rt_lanes_dot), on each vector path.
RT_VECTOR_BODY void sum_squares_body(const float *g, int64_t n, double *sum) { *sum = rt_lanes_dot(g, g, n); }
RT_VECTOR_PATHS(sum_squares, (const float *g, int64_t n, double *sum), (g, n, sum))

double rt_grad_norm(const RtModel *m, const RtRanks *r, RtComm *c, const float *grads, const bool *skip) {
  // Every rank holds its shard of each gradient after the reductions; a shard held by several
  // ranks (replicas) counts once: its squares are divided by the number of replicas. Under a
  // sharded optimizer a rank holds the sums of its rows only (rt_param_part): the rows of the
  // members of its group make the shard, so the replicas are fewer by the group's size.
  // Each tensor's sum on one thread (sum_squares: running sums that vectorise), the tensors handed to the threads
  // one at a time, then summed in tensor order: the same bits on any number of threads.
  double *part = rt_alloc((size_t)(m->nparams > 0 ? m->nparams : 1) * sizeof *part, "the gradient norm");
  RT_PRAGMA_PARALLEL_DYNAMIC(m->nparams > 1)
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *p = &m->params[i];
    int64_t lo, n;
    rt_param_part(c, p, &lo, &n);
    part[i] = 0;
    if (!p->balance && !p->frozen && !(skip && skip[i]))   // a correction bias's "gradient" is its load imbalance
      sum_squares(grads + p->offset + lo, n, &part[i]);
  }
  double sum = 0;
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *p = &m->params[i];
    int shards = (p->shard_ep >= 0 ? r->ep : 1) * (p->shard_esp >= 0 ? r->esp : 1) *
                 (p->shard_mp >= 0 ? r->mp : 1) * (p->shard ? rt_comm_size(c, (RtGroup)(p->shard - 1)) : 1);
    sum += part[i] * shards / r->world;
  }
  free(part);
  if (r->world > 1)
    rt_allreduce_f64(c, RT_GROUP_WORLD, &sum, 1);
  if (r->stages > 1)   // every stage's parameters
    rt_pp_sum_f64(c, &sum, 1);
  return sqrt(sum);
}

double rt_lr_scale(const RtModel *m, int64_t step) {
  if (m->lr <= 0)
    return 1.0;
  return rt_lr_at(m->lr, m->warmup, m->decay_steps, m->min_lr, step) / m->lr;
}

void rt_print_tokens(FILE *out, const RtModel *m, const int32_t *tokens, int64_t n) {
  if (m->vocab > 256) {
    for (int64_t i = 0; i < n; i++)
      fprintf(out, "%s%d", i ? " " : "", tokens[i]);
    fputc('\n', out);
    return;
  }
  for (int64_t i = 0; i < n; i++) {   // a byte model: the text, control bytes escaped
    int t = tokens[i];
    if (t == '\n' || t == '\t' || (t >= 32 && t < 127) || t >= 128)
      fputc(t, out);
    else
      fprintf(out, "\\x%02x", t);
  }
  fputc('\n', out);
}

const float *rt_lm_logits(RtTrainer *tr) {
  const RtModel *m = tr->model;
  const RtRanks *r = &tr->ranks;
  if (!m->vocab_parallel || r->mp == 1)
    return tr->st.output;
  int64_t t = m->batch * m->seqlen, part = m->vocab / r->mp;
  // Both buffers made once (--sample gathers after every token's forward).
  if (!tr->logits_whole) {
    tr->logits_whole = malloc((size_t)(t * m->vocab) * sizeof *tr->logits_whole);
    tr->logits_parts = malloc((size_t)(t * m->vocab) * sizeof *tr->logits_parts);
  }
  if (!tr->logits_whole || !tr->logits_parts) {
    rt_fail("out of memory gathering the logits of the vocabulary's %d parts", r->mp);
    return NULL;
  }
  float *parts = tr->logits_parts;
  rt_allgather(tr->comm, RT_GROUP_MP, tr->st.output, parts, t * part);   // [mp][t][part]
  for (int64_t p = 0; p < r->mp; p++)
    for (int64_t i = 0; i < t; i++)
      memcpy(tr->logits_whole + i * m->vocab + p * part, parts + (p * t + i) * part, (size_t)part * sizeof *parts);
  return tr->logits_whole;
}
