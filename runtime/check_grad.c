// --check-grad: every parameter's analytic gradient at step 1 against central differences of
// the objective (mse or cross-entropy, + the aux and z losses), on any layout (each entry is
// perturbed on every rank that holds it, the forward runs on all), pipeline stages included (the
// forwards run through every stage, every sum and maximum is the job's, the first microbatch's
// gradients are checked). rt_trainer.h; manual §12.
//
// float32 cannot see one entry's share of a language model's loss: a step of 1e-2 of a 0.02
// weight moves a loss of 5 by about 1e-10, while the loss in float moves in steps of 5 * 2^-24.
// So the differences are taken of the loss before its rounding to float (rt_loss_exact: the
// kernels sum it in double), and besides single entries the whole tensor is moved along its
// gradient and along a random direction, which moves the loss by up to numel times more. The
// noise of each difference is measured (the same difference at a step 2^-7 longer differs by
// rounding alone) and a check counts only where that noise is well under its tolerance:
// elsewhere it says "noise", never OK.
#include "rt_trainer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Entries per parameter; an entry out of tolerance is measured again at eps / CHECK_RETRY^i,
// i = 1 .. CHECK_RETRIES (a kink within eps: it passes where one of them resolves it and passes).
enum { CHECK_ENTRIES = 12, CHECK_RETRY = 8, CHECK_RETRIES = 3 };
#define CHECK_RTOL 5e-2        // an entry's relative tolerance
#define CHECK_ATOL_GRAD 1e-3   // times the largest |gradient| of the parameter
#define CHECK_EPS 1e-2         // times max(unit, |p|): unit is 1, or for a language model the
                               // tensor's RMS, at least 0.01 (check_param)
// A difference quotient D(s) is measured again at s (1 + CHECK_JITTER): the smooth part moves by
// far less than the rounding does, so CHECK_NOISE_SAFETY times the change bounds D's noise.
#define CHECK_JITTER 0x1p-7
#define CHECK_NOISE_SAFETY 4.0
// Gradients below CHECK_ZERO times the model's largest are float32 rounding of cancelling terms
// (an attention key bias: softmax does not see it) when the difference is as small: "zero".
#define CHECK_ZERO 1e-6
// The directional checks: a step of CHECK_DIR_STEP times the entries' unit per entry (on
// average), halved up to CHECK_DIR_HALVINGS times while it changes a routing decision, grown
// (CHECK_DIR_GROWTHS) while it is in the noise; resolved
// where the noise is under CHECK_DIR_RESOLVE of the projection, passed within CHECK_DIR_RTOL.
#define CHECK_DIR_STEP 1e-2
#define CHECK_DIR_HALVINGS 10
#define CHECK_DIR_GROWTHS 3    // a step that no routing change limits grows up to 4^3 times while in the noise
#define CHECK_DIR_RESOLVE 1e-2
#define CHECK_DIR_RTOL 2e-2

// Sums and maxima over every rank of the job (the world's, then over the pipeline's stages).
static void sum_all(RtTrainer *tr, double *v, int n) {
  if (tr->ranks.world > 1)
    rt_allreduce_f64(tr->comm, RT_GROUP_WORLD, v, n);
  rt_pp_sum_f64(tr->comm, v, n);
}

static void max_all(RtTrainer *tr, double *v, int n) {
  rt_world_max(tr->comm, v, n);
  rt_pp_max_f64(tr->comm, v, n);
}

// The step's forward (through every stage).
static void forward(RtTrainer *tr) {
  if (tr->ranks.stages > 1)
    rt_pipe_forward(tr);
  else
    tr->model->forward(&tr->st);
}

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
    forward(tr);
    rep[s] = rt_report_reduce(tr, &tr->st, hash0);
  }
  if (j >= 0)
    w[j] = orig;
  *span = (double)side[0] - (double)side[1];
  *routed = rep[0].route_changed || rep[1].route_changed;
  *fd = (rep[0].loss_exact - rep[1].loss_exact) / *span;
  return true;
}

// What the checks of the parameters share, and their totals.
typedef struct Check {
  const float *grad;      // the analytic gradients (the owner's entries count)
  uint64_t hash0;         // the unperturbed forward's routing
  double zero_entry;      // CHECK_ZERO times the model's largest |gradient|
  double zero_dir;        // CHECK_ZERO times the largest gradient norm of a parameter
  float *saved;           // room for one parameter's values (the largest shard)
  double loss_noise;      // the rounding noise of a loss difference the directions measured (the largest)
  int width;              // of the parameter column
  // Pipeline stages: whether this rank's stage counts the parameter being checked (its first
  // holder); a stage that holds it too (a tied table) moves its copy alike, one that does not
  // holds an empty view of it (numel 0) and only takes part in the forwards and reductions.
  bool counts;
  int checked, skipped, unresolved, failed, retried;   // entries
  int params_failed, params_unresolved, params_zero, params_skipped;
} Check;

// An entry's difference at eps and at eps (1 + CHECK_JITTER): *fd the first, *noise the bound on
// its rounding noise, *routed whether any side changed a routing decision.
static bool entry_difference(RtTrainer *tr, Check *cx, float *w, int64_t j, float orig, double eps,
                             double *fd, double *noise, bool *routed) {
  double fd2, span, span2;
  bool routed2;
  if (!central_difference(tr, w, j, orig, eps, &cx->hash0, fd, &span, routed) ||
      !central_difference(tr, w, j, orig, eps * (1 + CHECK_JITTER), &cx->hash0, &fd2, &span2, &routed2))
    return false;
  *routed = *routed || routed2;
  *noise = fmax(CHECK_NOISE_SAFETY * fabs(*fd - fd2), cx->loss_noise / span);
  return true;
}

// One directional difference: every entry of p (on every rank that holds it) moved by +-t u_j,
// u a unit direction: *fd the difference quotient of the loss over 2t, *an the analytic
// gradient's projection on the steps the floats actually took (the sum of g_j (w+_j - w-_j) / 2t
// over the owners), *routed whether either side changed a routing decision. False when an
// upload to the device failed (all ranks agree).
static bool directional_difference(RtTrainer *tr, Check *cx, const RtParam *p, const float *u, double t,
                                   double *fd, double *an, bool *routed) {
  const float *g = cx->grad + p->offset;
  float *w = tr->st.params + p->offset;
  memcpy(cx->saved, w, (size_t)p->numel * sizeof(float));
  double proj = 0;
  if (cx->counts && rt_shard_owner(p, &tr->ranks))
    for (int64_t j = 0; j < p->numel; j++)
      proj += (double)g[j] * ((double)(float)(cx->saved[j] + t * u[j]) - (double)(float)(cx->saved[j] - t * u[j]));
  RtReport rep[2];
  for (int s = 0; s < 2; s++) {
    for (int64_t j = 0; j < p->numel; j++)
      w[j] = (float)(cx->saved[j] + (s == 0 ? t : -t) * u[j]);
    if (rt_device_put(tr, RT_DEVICE_PARAMS) != 0) {
      memcpy(w, cx->saved, (size_t)p->numel * sizeof(float));
      return false;
    }
    forward(tr);
    rep[s] = rt_report_reduce(tr, &tr->st, &cx->hash0);
  }
  memcpy(w, cx->saved, (size_t)p->numel * sizeof(float));
  sum_all(tr, &proj, 1);
  *an = proj / (2 * t);
  *fd = (rep[0].loss_exact - rep[1].loss_exact) / (2 * t);
  *routed = rep[0].route_changed || rep[1].route_changed;
  return true;
}

// What a directional check found: its relative error, or why it has none.
typedef enum { DIR_OK, DIR_FAILED, DIR_NOISE, DIR_ZERO, DIR_ROUTED, DIR_KINK } DirResult;
typedef struct Directional {
  DirResult result;
  double rel;   // |fd - an| / max(|fd|, |an|) (DIR_OK, DIR_FAILED)
} Directional;

// One measurement along u at step t: D(t) and D(t/2) make a Richardson estimate
// (4 D(t/2) - D(t)) / 3, free of the t^2 term. D(t)'s noise is measured at a step 2^-7 longer;
// in the loss it is about the same at t/2, so D(t/2)'s is twice D(t)'s. curv, how far D(t) and
// D(t/2) differ, shows a function that is not smooth over t (a ReLU or a capacity edge crossed
// by some entries).
typedef struct DirMeasure {
  bool routed;
  double est, proj, noise, scale, curv;
} DirMeasure;

static bool measure_direction(RtTrainer *tr, Check *cx, const RtParam *p, const float *u, double t, DirMeasure *m) {
  static const double steps[3] = {1, 1 + CHECK_JITTER, 0.5};
  double fd[3], an[3];
  m->routed = false;
  for (int s = 0; s < 3 && !m->routed; s++)
    if (!directional_difference(tr, cx, p, u, t * steps[s], &fd[s], &an[s], &m->routed))
      return false;
  if (m->routed)
    return true;
  double noise_t = CHECK_NOISE_SAFETY * fabs(fd[0] - fd[1]);
  m->noise = (4 * 2 * noise_t + noise_t) / 3;
  cx->loss_noise = fmax(cx->loss_noise, noise_t * 2 * t);
  m->est = (4 * fd[2] - fd[0]) / 3;
  m->proj = (4 * an[2] - an[0]) / 3;
  m->scale = fmax(fabs(m->est), fabs(m->proj));
  m->curv = fabs(fd[0] - fd[2]);
  return true;
}

static DirResult classify_direction(const Check *cx, const DirMeasure *m) {
  if (m->routed)
    return DIR_ROUTED;
  if (m->scale < cx->zero_dir)
    return DIR_ZERO;
  if (!(m->noise <= CHECK_DIR_RESOLVE * m->scale))
    return DIR_NOISE;
  if (m->curv > m->noise + CHECK_DIR_RTOL * m->scale)
    return DIR_KINK;
  return fabs(m->est - m->proj) <= m->noise + CHECK_DIR_RTOL * m->scale ? DIR_OK : DIR_FAILED;
}

// The whole tensor along the unit direction u, from step t. The estimate and the analytic
// projection must agree to CHECK_DIR_RTOL of the larger once the noise is under
// CHECK_DIR_RESOLVE of it. The step halves while it changes a routing decision or is not smooth,
// grows (only if it never halved) while in the noise, and a miss is measured again at half the
// step: it fails where two steps in a row agree with each other and both miss; "kink" where the
// smaller step cannot confirm it, "noise" where float32 cannot tell, "zero" under cx->zero_dir.
static bool check_direction(RtTrainer *tr, Check *cx, const RtParam *p, const float *u, double t,
                            Directional *out) {
  DirMeasure m = {0}, miss = {0};
  bool missed = false;
  int halvings = 0, growths = 0;
  out->result = DIR_ROUTED;
  out->rel = 0;
  while (halvings <= CHECK_DIR_HALVINGS) {
    if (!measure_direction(tr, cx, p, u, t, &m))
      return false;
    DirResult r = classify_direction(cx, &m);
    // The noise is about constant in the loss: a longer step divides its share, while D(t) and
    // D(t/2) agree (else the jitter measured curvature, not rounding, and a longer step leaves
    // the neighbourhood: a function that flattens out, as gpt-oss's clamps do, then looks smooth
    // and wrong far away; the result stays "noise").
    if (r == DIR_NOISE && !missed && halvings == 0 && growths < CHECK_DIR_GROWTHS &&
        m.curv <= m.noise + CHECK_DIR_RTOL * m.scale) {
      out->result = DIR_NOISE;
      growths++;
      t *= 4;
      continue;
    }
    if ((r == DIR_ROUTED || r == DIR_KINK) && growths > 0 && !missed)
      return true;   // the last step that was smooth and kept the routing said "noise"
    // A miss is confirmed by a smooth second step that agrees with it and misses too, even with
    // its noise over CHECK_DIR_RESOLVE (half the step: twice the noise).
    bool misses = (r == DIR_FAILED || r == DIR_NOISE) && fabs(m.est - m.proj) > m.noise + CHECK_DIR_RTOL * m.scale;
    if (missed && misses &&
        fabs(m.est - miss.est) <= m.noise + miss.noise + CHECK_DIR_RTOL * fmax(m.scale, miss.scale)) {
      out->result = DIR_FAILED;
      out->rel = fabs(m.est - m.proj) / m.scale;
      return true;
    }
    if (r == DIR_OK || ((r == DIR_NOISE || r == DIR_ZERO) && !missed)) {
      out->result = r;
      out->rel = r == DIR_OK ? fabs(m.est - m.proj) / m.scale : 0;
      return true;
    }
    if (r == DIR_FAILED) {
      missed = true;
      miss = m;
    }
    out->result = missed ? DIR_KINK : r;   // an unconfirmed miss is a kink
    if (missed && (r == DIR_NOISE || r == DIR_ZERO))
      return true;
    halvings++;
    t /= 2;
  }
  return true;
}

// The unit direction of p's analytic gradient (random = false) or of a Gaussian vector keyed by
// p's name over global indices (the same on every rank that holds an entry), into u; false
// when the direction is zero.
static bool unit_direction(RtTrainer *tr, const Check *cx, const RtParam *p, bool random, float *u) {
  const RtRanks *r = &tr->ranks;
  int64_t off[4];
  rt_shard_offsets(p, r, off);
  uint64_t key = rt_key(rt_hash_name(p->name), RT_STREAM_NOISE);
  bool owner = rt_shard_owner(p, r) && cx->counts;
  double sq = 0;
  for (int64_t j = 0; j < p->numel; j++) {
    double d = random ? rt_normal(key, (uint64_t)rt_shard_global_index(p, off, j)) : cx->grad[p->offset + j];
    u[j] = (float)d;
    sq += owner ? d * d : 0;
  }
  sum_all(tr, &sq, 1);
  for (int64_t j = 0; j < p->numel && sq > 0; j++)
    u[j] = (float)(u[j] / sqrt(sq));
  return sq > 0;
}

static void print_direction(const Directional *d) {
  static const char *const why[] = {[DIR_NOISE] = "noise", [DIR_ZERO] = "zero", [DIR_ROUTED] = "routed",
                                    [DIR_KINK] = "kink"};
  if (d->result == DIR_OK || d->result == DIR_FAILED)
    printf(" %10.2e", d->rel);
  else
    printf(" %10s", why[d->result]);
}

// Entries of p: central differences on up to CHECK_ENTRIES of them, spread evenly over the
// whole tensor with an offset from the name's hash, against the owner's analytic gradient. An
// entry counts where its noise is under half its tolerance and it is not zero (both the
// difference and the gradient under cx->zero_entry); the noise is its own (measured at a step
// 2^-7 longer) or what the directions measured, the larger. *max_rel: the largest relative error of the entries counted.
static bool check_entries(RtTrainer *tr, Check *cx, const RtParam *p, double unit, int counts[4], double *max_rel) {
  const RtRanks *r = &tr->ranks;
  const float *g = cx->grad + p->offset;
  float *w = tr->st.params + p->offset;
  double max_g = 0;
  for (int64_t j = 0; j < p->numel; j++)
    max_g = fmax(max_g, fabs(g[j]));
  max_all(tr, &max_g, 1);
  double atol_grad = CHECK_ATOL_GRAD * max_g;
  int64_t numel = rt_param_global_numel(p);
  int64_t count = numel < CHECK_ENTRIES ? numel : CHECK_ENTRIES;
  int64_t stride = numel / CHECK_ENTRIES;
  int64_t offset = stride > 0 ? (int64_t)(rt_hash_name(p->name) % (uint64_t)stride) : 0;
  enum { CHECKED, SKIPPED, UNRESOLVED, FAILED };
  for (int64_t k = 0; k < count; k++) {
    int64_t gi = stride > 0 ? k * numel / CHECK_ENTRIES + offset : k, j;
    int owner = locate_entry(p, r, gi, &j);
    // The owner's value and gradient, known to every rank.
    double entry[2] = {0, 0};
    if (r->rank == owner && j >= 0 && cx->counts) {
      entry[0] = w[j];
      entry[1] = g[j];
    }
    sum_all(tr, entry, 2);
    float orig = (float)entry[0];
    double grad_j = entry[1], tol = atol_grad + CHECK_RTOL * fabs(grad_j);
    double eps = CHECK_EPS * fmax(unit, fabs(orig)), fd, noise;
    bool routed;
    if (!(cx->loss_noise / (2 * eps) <= 0.5 * tol)) {   // the directions' noise alone is too much
      counts[UNRESOLVED]++;
      continue;
    }
    if (!entry_difference(tr, cx, w, j, orig, eps, &fd, &noise, &routed))
      return false;
    if (routed) {
      counts[SKIPPED]++;
      continue;
    }
    if (fmax(fabs(fd), fabs(grad_j)) < cx->zero_entry || !(noise <= 0.5 * tol)) {
      counts[UNRESOLVED]++;
      continue;
    }
    // Out of tolerance: a wrong gradient, or a kink within eps. Smaller steps tell: it passes
    // where one resolves it and passes, fails where two steps in a row agree with each other
    // (within their noise) and both miss the gradient, and is "noise" otherwise.
    double err = fabs(fd - grad_j);
    bool pass = err <= tol + noise, fail = false;
    cx->retried += !pass;
    for (int retry = 1; !pass && !fail && retry <= CHECK_RETRIES; retry++) {
      double fd2, noise2;
      if (!entry_difference(tr, cx, w, j, orig, eps / pow(CHECK_RETRY, retry), &fd2, &noise2, &routed))
        return false;
      if (routed)
        break;
      double err2 = fabs(fd2 - grad_j);
      pass = noise2 <= 0.5 * tol && err2 <= tol + noise2;
      fail = !pass && noise2 <= 0.5 * tol && err2 > tol + noise2 && fabs(fd2 - fd) <= noise + noise2 + CHECK_RTOL * fabs(grad_j);
      if (noise2 <= 0.5 * tol) {
        fd = fd2;
        noise = noise2;
        err = err2;
      }
    }
    if (!pass && !fail) {
      counts[UNRESOLVED]++;
      continue;
    }
    counts[CHECKED]++;
    counts[FAILED] += fail;
    *max_rel = fmax(*max_rel, err / fmax(fabs(fd), fabs(grad_j)));
  }
  return true;
}

// p's check: its entries, then the whole tensor along its gradient (a scale error shows fully)
// and along a random direction (an error orthogonal to the gradient shows too), from steps of
// CHECK_DIR_STEP times the entries' unit each; rank 0 prints p's line. On several ranks every
// rank that holds an entry (replicas included) perturbs it, all run the forward, and the reduced
// losses are compared with the owner's gradient. False when an upload to the device failed (all
// ranks agree).
static bool check_param(RtTrainer *tr, Check *cx, const RtParam *p) {
  // The entries' unit: 1, or for a language model (whose weights start at 0.02 and whose norms
  // amplify small inputs) the tensor's root mean square, at least 0.01.
  double sq = 0;
  for (int64_t j = 0; j < p->numel; j++)
    sq += (double)tr->st.params[p->offset + j] * tr->st.params[p->offset + j];
  double unit = p->numel > 0 ? sqrt(sq / (double)p->numel) : 0;
  max_all(tr, &unit, 1);
  unit = tr->model->vocab > 0 ? fmax(unit, 1e-2) : 1.0;
  double t = CHECK_DIR_STEP * unit * sqrt((double)rt_param_global_numel(p));
  Directional dir[2] = {{DIR_ZERO, 0}, {DIR_ZERO, 0}};
  cx->loss_noise = 0;   // measured by the directions, a floor for the entries' noise
  float *u = rt_alloc((size_t)(p->numel > 0 ? p->numel : 1) * sizeof(float), "a --check-grad direction");
  bool ok = true;
  for (int d = 0; d < 2 && ok; d++)
    if (unit_direction(tr, cx, p, d == 1, u))
      ok = check_direction(tr, cx, p, u, t, &dir[d]);
  free(u);
  int counts[4] = {0, 0, 0, 0};   // entries checked, skipped, unresolved, failed
  double max_rel = 0;
  if (!ok || !check_entries(tr, cx, p, unit, counts, &max_rel))
    return false;
  bool failed = counts[3] > 0 || dir[0].result == DIR_FAILED || dir[1].result == DIR_FAILED;
  bool resolved = counts[0] > counts[3] || dir[0].result == DIR_OK || dir[1].result == DIR_OK;
  bool routed = counts[0] + counts[2] == 0 && dir[0].result == DIR_ROUTED && dir[1].result == DIR_ROUTED;
  bool zero = counts[0] == 0 && dir[0].result == DIR_ZERO && dir[1].result == DIR_ZERO;
  const char *result = failed ? "FAILED" : resolved ? "OK" : routed ? "SKIPPED" : zero ? "ZERO" : "UNRESOLVED";
  if (rt_is_root(tr)) {
    printf("%-*s %8d %8d %8d", cx->width, p->name, counts[0], counts[1], counts[2]);
    if (counts[0])
      printf(" %10.2e", max_rel);
    else
      printf(" %10s", "-");
    print_direction(&dir[0]);
    print_direction(&dir[1]);
    printf("  %s\n", result);
    fflush(stdout);
  }
  cx->checked += counts[0];
  cx->skipped += counts[1];
  cx->unresolved += counts[2];
  cx->failed += counts[3];
  cx->params_failed += failed;
  cx->params_unresolved += !failed && !resolved && !routed && !zero;
  cx->params_zero += !failed && !resolved && !routed && zero;
  cx->params_skipped += !failed && !resolved && routed;
  return true;
}

// The index of the parameter named name in m, or -1.
static int param_index(const RtModel *m, const char *name) {
  for (int i = 0; i < m->nparams; i++)
    if (strcmp(m->params[i].name, name) == 0) return i;
  return -1;
}

static void print_check_header(const RtTrainer *tr, double loss0, int width) {
  const RtModel *m = tr->model;
  int nparams = m->nparams;
  for (int s = 0; tr->ranks.stages > 1 && s < tr->ranks.stages; s++) {   // every stage's, a tied one once
    nparams = s == 0 ? 0 : nparams;
    for (int i = 0; i < tr->stages[s]->nparams; i++) {
      bool earlier = false;
      for (int e = 0; e < s && !earlier; e++) earlier = param_index(tr->stages[e], tr->stages[s]->params[i].name) >= 0;
      nparams += !earlier;
    }
  }
  printf("# gradient check of %s at step 1: loss %.6f (the objective: %s + the aux and z losses times their "
         "coefficients), %d parameters%s\n", m->name, loss0, m->vocab > 0 ? "cross-entropy" : "mse", nparams,
         tr->ranks.stages > 1 ? " (of every pipeline stage; a tied one once)" : "");
  printf("# differences of the loss before its rounding to float; each measured again at a step 2^-7 longer,\n"
         "#   %.0f times the change bounds its rounding noise\n", CHECK_NOISE_SAFETY);
  printf("# checked: central differences on up to %d entries per parameter, eps = %.0e * max(%s, |p|); pass:\n"
         "#   |fd - g| <= atol + rtol * |g| + noise, rtol = %.0e, atol = %.0e * max|g| of the parameter; an entry\n"
         "#   counts only where its noise is under half its tolerance (else it is one of \"noise\"); one out of\n"
         "#   tolerance is measured again at eps/%d, /%d^2, /%d^3 (a kink within eps: a ReLU, a capacity edge)\n",
         CHECK_ENTRIES, CHECK_EPS, m->vocab > 0 ? "rms of the tensor (at least 0.01)" : "1", CHECK_RTOL,
         CHECK_ATOL_GRAD, CHECK_RETRY, CHECK_RETRY, CHECK_RETRY);
  printf("# along g, random: the whole tensor moved along its gradient and along a random direction (steps of\n"
         "#   %.0e * the unit per entry, Richardson over t and t/2): the relative error of the difference against\n"
         "#   the gradient's projection, pass within %.0e; \"noise\" where the noise is over %.0e of it\n",
         CHECK_DIR_STEP, CHECK_DIR_RTOL, CHECK_DIR_RESOLVE);
  printf("# a step that changes a routing decision is skipped (an entry) or halved (a direction: \"routed\" at the\n"
         "#   end); ZERO: gradient and differences under %.0e of the model's largest (rounding of cancelling\n"
         "#   terms); UNRESOLVED: nothing float32 can resolve\n", CHECK_ZERO);
  printf("# %-*s %8s %8s %8s %10s %10s %10s  %s\n", width - 2, "parameter", "checked", "skipped",
         "noise", "entry err", "along g", "random", "result");
}

// MOERT_CHECK_GRAD_PLANT (tests only): "1" makes the last parameter's gradient 20 % too large,
// NAME makes that parameter's 10 % too large: a planted bug the check must report.
static void plant_error(const RtModel *m, float *grad, bool stages) {
  const char *plant = getenv("MOERT_CHECK_GRAD_PLANT");
  if (!plant || !*plant || m->nparams == 0)
    return;
  const RtParam *p = &m->params[m->nparams - 1];
  for (int i = m->nparams - 1; i > 0 && p->frozen; i--) p = &m->params[i - 1];   // the last one trained
  float factor = 1.2f;
  if (strcmp(plant, "1") != 0) {
    p = NULL;
    factor = 1.1f;
    for (int i = 0; i < m->nparams && !p; i++)
      if (strcmp(m->params[i].name, plant) == 0)
        p = &m->params[i];
    if (!p && !stages)   // (with stages: another stage's parameter)
      rt_fail("MOERT_CHECK_GRAD_PLANT: the model has no parameter '%s'", plant);
    if (!p)
      return;
  }
  for (int64_t j = 0; j < p->numel; j++)
    grad[p->offset + j] *= factor;
}

// Whether --check-grad=P,Q,... names p (its name begins with one of the prefixes; no list: all).
static bool selected(const char *only, const char *name) {
  if (!only)
    return true;
  for (const char *s = only; *s;) {
    size_t n = strcspn(s, ",");
    if (n > 0 && strncmp(name, s, n) == 0)
      return true;
    s += n + (s[n] == ',');
  }
  return false;
}


// Pipeline stages: what this rank checks of q (stage s's parameter): its own copy when its stage
// holds it, else an empty view (no element here; its entries' owners are on stage s).
static const RtParam *view_of(const RtTrainer *tr, const RtParam *q, RtParam *view) {
  int i = param_index(tr->model, q->name);
  if (i >= 0) return &tr->model->params[i];
  *view = *q;
  for (int d = 0; d < 4; d++) view->dims[d] = 0;
  view->numel = 0, view->offset = 0;
  view->shard_ep = view->shard_esp = view->shard_mp = -1;
  return view;
}

// The gradients and figures of the step's first microbatch: st->grads, *rep0, the routing's hash.
static void first_step(RtTrainer *tr, RtReport *rep0, uint64_t *hash0) {
  RtStep *st = &tr->st;
  rt_fill_step_data(tr, 1);
  if (tr->ranks.stages > 1) {
    RtStep fwd;
    rt_pipe_step1(tr, &fwd);
    *rep0 = rt_report_reduce(tr, &fwd, NULL);
    *hash0 = fwd.route_hash;
    return;
  }
  tr->model->forward(st);
  *rep0 = rt_report_reduce(tr, st, NULL);
  *hash0 = st->route_hash;
  tr->model->backward(st);
}

// Every parameter of every stage in order (a tied table once, at its first stage), each checked
// collectively: nchecked, nbalance. False when an upload failed.
static bool check_all(RtTrainer *tr, Check *cx, int *nchecked, int *nbalance, int *nfrozen) {
  int stages = tr->ranks.stages > 1 ? tr->ranks.stages : 1;
  bool root = rt_is_root(tr);
  for (int s = 0; s < stages; s++) {
    const RtModel *sm = stages > 1 ? tr->stages[s] : tr->model;
    for (int i = 0; i < sm->nparams; i++) {
      const RtParam *q = &sm->params[i];
      bool earlier = false;
      for (int e = 0; e < s && !earlier; e++) earlier = param_index(tr->stages[e], q->name) >= 0;
      if (earlier) continue;
      RtParam view;
      const RtParam *p = stages > 1 ? view_of(tr, q, &view) : q;
      cx->counts = stages == 1 || s == tr->ranks.stage;
      if (q->frozen && selected(tr->opt.check_grad_only, q->name)) {
        if (root)
          printf("%-*s  frozen (a base weight of the LoRA model: no gradient): not checked\n", cx->width, q->name);
        (*nfrozen)++;
      } else if (q->balance && selected(tr->opt.check_grad_only, q->name)) {
        // its "gradient" is the load imbalance (opt.balance), not a derivative of the loss
        if (root)
          printf("%-*s  not trained by its gradient (balance bias): not checked\n", cx->width, q->name);
        (*nbalance)++;
      } else if (selected(tr->opt.check_grad_only, q->name)) {
        if (!check_param(tr, cx, p)) return false;
        (*nchecked)++;
      }
    }
  }
  return true;
}

int rt_check_grad(RtTrainer *tr) {
  const RtModel *m = tr->model;
  RtStep *st = &tr->st;
  bool root = rt_is_root(tr);
  RtReport rep0;
  Check cx = {.width = 9};
  first_step(tr, &rep0, &cx.hash0);
  size_t gfloats = rt_grad_floats(m) ? rt_grad_floats(m) : 1;
  float *grad = rt_alloc(gfloats * sizeof(float), "the gradients of --check-grad");
  if (rt_device_get(tr, RT_DEVICE_GRADS) != 0) {
    free(grad);
    return -1;
  }
  memcpy(grad, st->grads, rt_grad_floats(m) * sizeof(float));
  rt_shard_gather_grads(tr->comm, m, grad);
  plant_error(m, grad, tr->ranks.stages > 1);
  cx.grad = grad;
  // The scale "zero" is measured against: the largest gradient entry, the largest norm (of every
  // stage's parameters).
  int64_t largest = 1;
  double *norms = rt_alloc((size_t)(m->nparams + 1) * sizeof(double), "the gradient norms of --check-grad");
  double max_g = 0;
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *p = &m->params[i];
    bool owner = rt_shard_owner(p, &tr->ranks);
    norms[i] = 0;
    for (int64_t j = 0; j < p->numel && !p->balance && !p->frozen; j++) {
      double g = grad[p->offset + j];
      max_g = fmax(max_g, fabs(g));
      norms[i] += owner ? g * g : 0;
    }
    largest = p->numel > largest ? p->numel : largest;
  }
  for (int s = 0; s < (tr->ranks.stages > 1 ? tr->ranks.stages : 1); s++) {
    const RtModel *sm = tr->ranks.stages > 1 ? tr->stages[s] : m;
    for (int i = 0; i < sm->nparams; i++)
      if ((int)strlen(sm->params[i].name) > cx.width) cx.width = (int)strlen(sm->params[i].name);
  }
  if (tr->ranks.world > 1)
    rt_allreduce_f64(tr->comm, RT_GROUP_WORLD, norms, m->nparams);
  max_all(tr, &max_g, 1);
  double max_norm = 0;
  for (int i = 0; i < m->nparams; i++)
    max_norm = fmax(max_norm, sqrt(norms[i]));
  max_all(tr, &max_norm, 1);
  free(norms);
  cx.zero_entry = CHECK_ZERO * max_g;
  cx.zero_dir = CHECK_ZERO * max_norm;
  cx.saved = rt_alloc((size_t)largest * sizeof(float), "the saved parameter of --check-grad");
  if (root)
    print_check_header(tr, rep0.loss, cx.width);
  int nchecked = 0, nbalance = 0, nfrozen = 0;
  // an upload of the perturbed parameters failed (all ranks agree)
  bool device_failed = !check_all(tr, &cx, &nchecked, &nbalance, &nfrozen);
  free(grad);
  free(cx.saved);
  // Leave the step's state as the unperturbed forward left it.
  if (device_failed || rt_device_put(tr, RT_DEVICE_PARAMS) != 0)
    return -1;
  forward(tr);
  int resolved = nchecked - cx.params_failed - cx.params_unresolved - cx.params_zero - cx.params_skipped;
  bool ok = cx.params_failed == 0 && resolved > 0;
  if (root) {
    if (nchecked + nbalance + nfrozen == 0)
      printf("# --check-grad=%s names no parameter of %s\n", tr->opt.check_grad_only, m->name);
    if (nfrozen > 0)
      printf("# %d frozen parameter%s not checked (the base weights of a LoRA model take no gradient)\n", nfrozen,
             nfrozen == 1 ? "" : "s");
    if (nbalance > 0)
      printf("# %d correction bias%s of aux-loss-free balancing not checked (moved by the sign of the load, not by a "
             "gradient)\n", nbalance, nbalance == 1 ? "" : "es");
    printf("# %d entries checked, %d skipped, %d below noise or zero, %d measured again at eps/%d, %d out of "
           "tolerance\n", cx.checked, cx.skipped, cx.unresolved, cx.retried, CHECK_RETRY, cx.failed);
    printf("# %d parameter%s: %d checked, %d failed, %d zero, %d unresolved (float32 cannot resolve them), "
           "%d skipped (routing)\n", nchecked, nchecked == 1 ? "" : "s", resolved, cx.params_failed,
           cx.params_zero, cx.params_unresolved, cx.params_skipped);
    printf("%s\n", ok ? "OK" : "FAILED");
  }
  return ok ? 0 : 1;
}
