// --check-grad: every parameter's analytic gradient at step 1 against central differences of
// the objective (mse or cross-entropy, + aux_total), on up to CHECK_ENTRIES entries per parameter, on any layout
// (each entry is perturbed on every rank that holds it, the forward runs on all). rt_trainer.h.
#include "rt_trainer.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { CHECK_ENTRIES = 12, CHECK_RETRY = 8 };   // entries per parameter; eps / CHECK_RETRY: the second try
#define CHECK_RTOL 5e-2
#define CHECK_ATOL_GRAD 1e-3   // times the largest |gradient| of the parameter
#define CHECK_EPS 1e-2         // times max(unit, |p|): unit is 1, or for a language model the
                               // tensor's RMS, at least 0.01 (check_param)
// The loss terms are fp32 values: each of loss(p+eps), loss(p-eps) is off by up to about an
// ulp, 2^-23 |loss|, so a difference quotient carries noise up to 2 * 2^-23 |loss| / (2 eps).
// Twice that is allowed on top of the relative tolerance.
#define CHECK_NOISE_ULPS 4.0

// Where global flat index g of p lies: *local is its index in rank r's shard, or -1 when r
// does not hold it; the result is the world rank that owns it (rt_shard_owner).
static int locate_entry(const RtParam *p, const RtRanks *r, int64_t g, int64_t *local) {
  int64_t off[4], coord[4] = {0};
  rt_shard_offsets(p, r, off);
  for (int d = p->rank - 1; d >= 0; d--) {
    coord[d] = g % p->global_dims[d];
    g /= p->global_dims[d];
  }
  int64_t j = 0;
  bool held = true;
  for (int d = 0; d < p->rank; d++) {
    held = held && coord[d] >= off[d] && coord[d] < off[d] + p->dims[d];
    j = j * p->dims[d] + (coord[d] - off[d]);
  }
  *local = held ? j : -1;
  int ep = p->shard_ep >= 0 ? (int)(coord[p->shard_ep] / p->dims[p->shard_ep]) : 0;
  int esp = p->shard_esp >= 0 ? (int)(coord[p->shard_esp] / p->dims[p->shard_esp]) : 0;
  if (p->shard_mp >= 0)   // the MP rank of DP replica 0
    return (int)(coord[p->shard_mp] / p->dims[p->shard_mp]);
  return ep * r->esp + esp;
}

// The central difference of the loss in entry j of the parameters w (-1: another rank holds it)
// at orig +- eps, over the step (orig+eps) - (orig-eps) as floats round it (*span); *routed: either
// side changed a routing decision. False when an upload to the device failed (all ranks agree).
static bool central_difference(RtTrainer *tr, float *w, int64_t j, float orig, double eps, const uint64_t *hash0,
                               double *fd, double *span, bool *routed) {
  const float side[2] = {(float)(orig + eps), (float)(orig - eps)};
  RtReport rep[2];
  for (int s = 0; s < 2; s++) {
    if (j >= 0)
      w[j] = side[s];
    if (rt_device_put(tr, RT_DEVICE_PARAMS) != 0) {
      if (j >= 0)
        w[j] = orig;
      return false;
    }
    tr->model->forward(&tr->st);
    rep[s] = rt_report_reduce(tr, &tr->st, hash0);
  }
  if (j >= 0)
    w[j] = orig;
  *span = (double)side[0] - (double)side[1];
  *routed = rep[0].route_changed || rep[1].route_changed;
  *fd = (rep[0].loss - rep[1].loss) / *span;
  return true;
}

// What the checks of the parameters share, and their totals.
typedef struct Check {
  const float *grad;      // the analytic gradients (the owner's entries count)
  uint64_t hash0;         // the unperturbed forward's routing
  double loss_scale;      // |mse| + |aux_total| there: what fp32 rounding scales with
  int width;              // of the parameter column
  int checked, skipped, failed, retried;
} Check;

// Central differences on up to CHECK_ENTRIES entries of p, spread evenly over the whole tensor
// with an offset from the name's hash, against the analytic gradient of the same total loss;
// rank 0 prints p's line. On several ranks every rank that holds an entry (replicas included)
// perturbs it, all run the forward, and the reduced losses are compared with the owner's
// gradient. False when an upload to the device failed (all ranks agree).
static bool check_param(RtTrainer *tr, Check *cx, const RtParam *p) {
  const RtRanks *r = &tr->ranks;
  const float *g = cx->grad + p->offset;
  float *w = tr->st.params + p->offset;
  double max_g = 0, sq = 0;
  for (int64_t j = 0; j < p->numel; j++) {
    max_g = fmax(max_g, fabs(g[j]));
    sq += (double)w[j] * w[j];
  }
  rt_world_max(tr->comm, &max_g, 1);
  // A language model's weights start at 0.02 and its norms amplify small inputs: the step
  // follows the tensor's scale there (its root mean square), not 1.
  double unit = p->numel > 0 ? sqrt(sq / (double)p->numel) : 0;
  rt_world_max(tr->comm, &unit, 1);
  unit = tr->model->vocab > 0 ? fmax(unit, 1e-2) : 1.0;
  double atol_grad = CHECK_ATOL_GRAD * max_g;
  int64_t numel = rt_param_global_numel(p);
  int64_t count = numel < CHECK_ENTRIES ? numel : CHECK_ENTRIES;
  int64_t stride = numel / CHECK_ENTRIES;
  int64_t offset = stride > 0 ? (int64_t)(rt_hash_name(p->name) % (uint64_t)stride) : 0;
  int checked = 0, skipped = 0, failed = 0;
  double max_abs = 0, max_rel = 0;
  for (int64_t k = 0; k < count; k++) {
    int64_t gi = stride > 0 ? k * numel / CHECK_ENTRIES + offset : k, j;
    int owner = locate_entry(p, r, gi, &j);
    // The owner's value and gradient, known to every rank.
    double entry[2] = {0, 0};
    if (r->rank == owner) {
      entry[0] = w[j];
      entry[1] = g[j];
    }
    if (r->world > 1)
      rt_allreduce_f64(tr->comm, RT_GROUP_WORLD, entry, 2);
    float orig = (float)entry[0];
    double grad_j = entry[1];
    double eps = CHECK_EPS * fmax(unit, fabs(orig)), fd, span;
    bool routed;
    if (!central_difference(tr, w, j, orig, eps, &cx->hash0, &fd, &span, &routed))
      return false;
    if (routed) {
      skipped++;
      continue;
    }
    double err = fabs(fd - grad_j);
    double noise = CHECK_NOISE_ULPS * FLT_EPSILON * cx->loss_scale / span;
    if (!(err <= atol_grad + noise + CHECK_RTOL * fabs(grad_j))) {
      // A kink within eps of the point (a ReLU changing sides, a token at a capacity edge)
      // spoils the difference; a wrong gradient fails closer to the point as well.
      cx->retried++;
      if (!central_difference(tr, w, j, orig, eps / CHECK_RETRY, &cx->hash0, &fd, &span, &routed))
        return false;
      if (routed) {
        skipped++;
        continue;
      }
      err = fabs(fd - grad_j);
      noise = CHECK_NOISE_ULPS * FLT_EPSILON * cx->loss_scale / span;
    }
    double scale = fmax(fabs(fd), fabs(grad_j));
    double rel = scale > 0 ? err / scale : 0;
    checked++;
    failed += !(err <= atol_grad + noise + CHECK_RTOL * fabs(grad_j));
    max_abs = fmax(max_abs, err);
    max_rel = fmax(max_rel, rel);
  }
  const char *result = failed ? "FAILED" : checked ? "OK" : "SKIPPED";
  if (rt_is_root(tr)) {
    printf("%-*s %8d %8d %12.3e %12.3e  %s\n", cx->width, p->name, checked, skipped, max_abs,
           max_rel, result);
    fflush(stdout);
  }
  cx->checked += checked;
  cx->skipped += skipped;
  cx->failed += failed;
  return true;
}

static void print_check_header(const RtTrainer *tr, double loss0, int width) {
  const RtModel *m = tr->model;
  printf("# gradient check of %s at step 1: loss %.6f (the objective: %s + the aux and z losses times their "
         "coefficients), %d parameters\n", m->name, loss0, m->vocab > 0 ? "cross-entropy" : "mse", m->nparams);
  printf("# central differences on up to %d entries per parameter, eps = %.0e * max(%s, |p|)\n",
         CHECK_ENTRIES, CHECK_EPS, m->vocab > 0 ? "rms of the tensor (at least 0.01)" : "1");
  printf("# pass: |fd - g| <= atol + rtol * |g|, rtol = %.0e, atol = %.0e * max|g| of the "
         "parameter + %.0f * 2^-23 * |loss| / (2 eps)\n", CHECK_RTOL, CHECK_ATOL_GRAD,
         CHECK_NOISE_ULPS);
  printf("# entries where +-eps changes a routing decision are skipped (not differentiable); an entry out\n"
         "# of tolerance is measured again at eps/%d (a kink within eps: a ReLU, a capacity edge)\n", CHECK_RETRY);
  printf("# %-*s %8s %8s %12s %12s  %s\n", width - 2, "parameter", "checked", "skipped",
         "max abs err", "max rel err", "result");
}

int rt_check_grad(RtTrainer *tr) {
  const RtModel *m = tr->model;
  RtStep *st = &tr->st;
  bool root = rt_is_root(tr);
  rt_fill_step_data(tr, 1);
  m->forward(st);
  RtReport rep0 = rt_report_reduce(tr, st, NULL);
  Check cx = {.hash0 = st->route_hash, .loss_scale = fabs(rep0.mse) + fabs(rep0.aux_total), .width = 9};
  m->backward(st);
  float *grad = rt_alloc(m->param_floats * sizeof(float), "the gradients of --check-grad");
  if (rt_device_get(tr, RT_DEVICE_GRADS) != 0) {
    free(grad);
    return -1;
  }
  memcpy(grad, st->grads, m->param_floats * sizeof(float));
  cx.grad = grad;
  // MOERT_CHECK_GRAD_PLANT=1 (tests only): the last parameter's gradient made 20 % too large, a
  // planted bug the check must report (tests/run.sh), retry or not.
  const char *plant = getenv("MOERT_CHECK_GRAD_PLANT");
  if (plant && strcmp(plant, "1") == 0 && m->nparams > 0)
    for (int64_t j = 0; j < m->params[m->nparams - 1].numel; j++)
      grad[m->params[m->nparams - 1].offset + j] *= 1.2f;

  for (int i = 0; i < m->nparams; i++)
    if ((int)strlen(m->params[i].name) > cx.width)
      cx.width = (int)strlen(m->params[i].name);
  if (root)
    print_check_header(tr, rep0.loss, cx.width);
  bool device_failed = false;   // an upload of the perturbed parameters failed (all ranks agree)
  for (int i = 0; i < m->nparams && !device_failed; i++)
    device_failed = !check_param(tr, &cx, &m->params[i]);
  free(grad);
  // Leave the step's state as the unperturbed forward left it.
  if (device_failed || rt_device_put(tr, RT_DEVICE_PARAMS) != 0)
    return -1;
  m->forward(st);
  bool ok = cx.failed == 0 && cx.checked > 0;
  if (root) {
    printf("# %d entries checked, %d skipped, %d measured again at eps/%d, %d out of tolerance%s\n",
           cx.checked, cx.skipped, cx.retried, CHECK_RETRY, cx.failed,
           cx.checked ? "" : " (nothing could be checked)");
    printf("%s\n", ok ? "OK" : "FAILED");
  }
  return ok ? 0 : 1;
}
