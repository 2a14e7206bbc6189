// rt_main on several MPI ranks, driven with a model written here by hand.
//
// The model is a per-expert linear layer whose math does not depend on the parallel layout:
// token s of the global batch goes to expert e(s) = hash(s) % E (or is dropped when
// hash(s) % 7 == 0), y_s = scale * (x_s W[e] + b[e]) + c (y_s = c when dropped), and
//   loss = sum (y - t)^2 / (2N) + 0.01 z + 0.001 aux,
//   z = sum_s mean_m(y_s)^2 / T, aux = |W|^2 / (2 |W|)   (N elements, T tokens, global).
// Its parameters cover every kind of sharding: W [E, M, M] split over EP (dim 0) and ESP
// (dim 2), b [E, M] over EP only (replicated over ESP), c [M] and the scalar scale replicated
// everywhere. A rank holds its DP shard of the data and routes its MP part of those tokens; the
// forward gathers the whole W and b (allgather over ESP, then EP), the backward sums the whole
// gradients over the world and keeps its shard: plain, so that what is tested is rt_main: data
// slicing, init by global index, loss reductions, dump assembly and checkpoints across layouts.
//
//   test_rt_main DP,MP,EP,ESP sgd|adamw [rt_main options]   train (under mpirun -np DP*MP)
//   test_rt_main --expect-loads DP,MP,EP,ESP                 the load figures rt_main must print
//   test_rt_main --same-dump A B TOL                         two --dump folders agree
//   test_rt_main --same-checkpoint A B adamw|sgd TOL         two checkpoints hold the same tensors
#include "moert.h"
#include "rt_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { GLOBAL_BATCH = 8, L = 4, M = 8, E = 4 };
#define LR_SGD 0.5f

static RtLayout layout;
static int64_t batch;   // per DP rank

static RtParam params[4];
static RtModel model;

// Scratch buffers, sized once in main.
static float *w_whole, *b_whole, *w_gather, *y_part, *y_dp, *dy, *gw;

static int route(int64_t token) {   // expert, or -1: dropped
  uint64_t h = rt_mix(0x5eed ^ (uint64_t)token);
  return h % 7 == 0 ? -1 : (int)((h >> 8) % E);
}

static const RtParam *param(int i) {
  return &params[i];
}

// The whole W [E, M, M] and b [E, M] from the shards.
static void gather_whole(const RtStep *st) {
  const RtParam *pw = param(0), *pb = param(1);
  int64_t el = pw->dims[0], cols = pw->dims[2];
  float *shard_w = w_gather + layout.esp * pw->numel;   // [el, M, M] after the ESP gather
  rt_allgather(st->comm, RT_GROUP_ESP, st->params + pw->offset, w_gather, pw->numel);
  for (int k = 0; k < layout.esp; k++)
    for (int64_t e = 0; e < el; e++)
      for (int i = 0; i < M; i++)
        memcpy(shard_w + (e * M + i) * M + k * cols, w_gather + k * pw->numel + (e * M + i) * cols,
               (size_t)cols * sizeof(float));
  rt_allgather(st->comm, RT_GROUP_EP, shard_w, w_whole, el * M * M);
  rt_allgather(st->comm, RT_GROUP_EP, st->params + pb->offset, b_whole, pb->numel);
}

static int64_t part_tokens(void) {
  return batch * L / layout.mp;
}

static void forward(RtStep *st) {
  rt_step_begin_forward(st);
  gather_whole(st);
  const float *c = st->params + param(2)->offset, scale = st->params[param(3)->offset];
  int64_t n = part_tokens(), first = rt_comm_rank(st->comm, RT_GROUP_MP) * n;
  double n_global = (double)layout.dp * batch * L * M, t_global = (double)layout.dp * batch * L;
  double mse = 0, z = 0;
  int64_t load[E] = {0}, dropped = 0;
  for (int64_t s = 0; s < n; s++) {
    const float *x = st->input + (first + s) * M, *t = st->target + (first + s) * M;
    float *y = y_part + s * M;
    int e = route(st->token0 + s);
    double mean = 0;
    for (int j = 0; j < M; j++) {
      double u = 0;
      if (e >= 0) {
        for (int i = 0; i < M; i++)
          u += (double)x[i] * w_whole[(e * M + i) * M + j];
        u += b_whole[e * M + j];
      }
      y[j] = (float)(scale * u + c[j]);
      mse += ((double)y[j] - t[j]) * ((double)y[j] - t[j]);
      mean += y[j];
    }
    mean /= M;
    z += mean * mean;
    if (e >= 0)
      load[e]++;
    else
      dropped++;
  }
  double share[2] = {mse / (2 * n_global), z / t_global};
  rt_allreduce_f64(st->comm, RT_GROUP_MP, share, 1);   // MP ranks hold the same mse share
  const RtParam *pw = param(0);
  double w2 = 0;
  for (int64_t i = 0; i < pw->numel; i++)
    w2 += (double)st->params[pw->offset + i] * st->params[pw->offset + i];
  st->mse = share[0];
  st->z += share[1];
  st->aux += w2 / (2.0 * rt_param_global_numel(pw));
  st->aux_total = 0.01 * st->z + 0.001 * st->aux;
  st->routed += n;
  st->dropped += dropped;
  rt_add_loads(st, load, E);
  int64_t most = 0;
  for (int e = 0; e < E; e++)
    most = load[e] > most ? load[e] : most;
  st->capacity_max = most;
  rt_allgather(st->comm, RT_GROUP_MP, y_part, y_dp, n * M);
  st->output = y_dp;
}

static void backward(RtStep *st) {
  const RtParam *pw = param(0), *pb = param(1), *pc = param(2), *ps = param(3);
  const float *scale = st->params + ps->offset;
  int64_t n = part_tokens(), first = rt_comm_rank(st->comm, RT_GROUP_MP) * n;
  double n_global = (double)layout.dp * batch * L * M, t_global = (double)layout.dp * batch * L;
  int64_t whole = E * M * M + E * M + M + 1;   // dW, db, dc, dscale in one buffer
  memset(gw, 0, (size_t)whole * sizeof(float));
  float *gdb = gw + E * M * M, *gdc = gdb + E * M, *gds = gdc + M;
  for (int64_t s = 0; s < n; s++) {
    const float *x = st->input + (first + s) * M, *t = st->target + (first + s) * M;
    const float *y = y_part + s * M;
    int e = route(st->token0 + s);
    double mean = 0;
    for (int j = 0; j < M; j++)
      mean += y[j];
    mean /= M;
    for (int j = 0; j < M; j++) {
      dy[j] = (float)(((double)y[j] - t[j]) / n_global + 0.01 * 2 * mean / (M * t_global));
      gdc[j] += dy[j];
    }
    if (e < 0)
      continue;
    for (int j = 0; j < M; j++) {
      double u = b_whole[e * M + j];
      for (int i = 0; i < M; i++) {
        u += (double)x[i] * w_whole[(e * M + i) * M + j];
        gw[(e * M + i) * M + j] += scale[0] * x[i] * dy[j];
      }
      gdb[e * M + j] += scale[0] * dy[j];
      gds[0] += (float)(u * dy[j]);
    }
  }
  rt_allreduce(st->comm, RT_GROUP_WORLD, gw, whole);
  // This rank's boxes of the whole gradients.
  int64_t el = pw->dims[0], cols = pw->dims[2];
  int64_t e0 = rt_comm_rank(st->comm, RT_GROUP_EP) * el;
  int64_t j0 = rt_comm_rank(st->comm, RT_GROUP_ESP) * cols;
  float *g = st->grads + pw->offset;
  const float *w = st->params + pw->offset;
  double aux_coef = 0.001 / rt_param_global_numel(pw);
  for (int64_t e = 0; e < el; e++)
    for (int i = 0; i < M; i++)
      for (int64_t j = 0; j < cols; j++) {
        int64_t k = (e * M + i) * cols + j;
        g[k] = (float)(gw[((e0 + e) * M + i) * M + j0 + j] + aux_coef * w[k]);
      }
  memcpy(st->grads + pb->offset, gdb + e0 * M, (size_t)pb->numel * sizeof(float));
  memcpy(st->grads + pc->offset, gdc, M * sizeof(float));
  st->grads[ps->offset] = gds[0];
}

static void update_sgd(RtStep *st) {
  rt_sgd(st->params, st->grads, (int64_t)model.param_floats, LR_SGD, 0.0f, 1.0f, 1.0f);
}

static void update_adamw(RtStep *st) {
  rt_adamw(st->params, st->grads, st->opt_m, st->opt_v, (int64_t)model.param_floats, 0.02f, 0.9f,
           0.999f, 1e-8f, 0.01f, st->step, 1.0f, 1.0f);
}

static int parse_layout(const char *text) {
  if (sscanf(text, "%d,%d,%d,%d", &layout.dp, &layout.mp, &layout.ep, &layout.esp) != 4 ||
      layout.dp < 1 || layout.mp < 1 || layout.ep < 1 || layout.esp < 1 ||
      GLOBAL_BATCH % layout.dp || E % layout.ep || M % layout.esp ||
      (GLOBAL_BATCH / layout.dp * L) % layout.mp) {
    fprintf(stderr, "test_rt_main: bad layout '%s'\n", text);
    return -1;
  }
  layout.gpus_per_node = layout.dp * layout.mp;
  batch = GLOBAL_BATCH / layout.dp;
  return 0;
}

static void describe(RtOptKind opt) {
  int64_t el = E / layout.ep, cols = M / layout.esp;
  params[0] = (RtParam){.name = "moe.experts.w", .rank = 3, .dims = {el, M, cols},
                        .init = RT_INIT_NORMAL, .std = 0.3f, .global_dims = {E, M, M},
                        .shard_ep = 0, .shard_esp = 2, .shard_mp = -1};
  params[1] = (RtParam){.name = "moe.experts.b", .rank = 2, .dims = {el, M},
                        .init = RT_INIT_NORMAL, .std = 0.1f, .global_dims = {E, M},
                        .shard_ep = 0, .shard_esp = -1, .shard_mp = -1};
  params[2] = (RtParam){.name = "moe.c", .rank = 1, .dims = {M}, .init = RT_INIT_NORMAL,
                        .std = 0.1f, .global_dims = {M}, .shard_ep = -1, .shard_esp = -1, .shard_mp = -1};
  params[3] = (RtParam){.name = "moe.scale", .rank = 0, .init = RT_INIT_CONST, .std = 1.0f,
                        .shard_ep = -1, .shard_esp = -1, .shard_mp = -1};
  size_t offset = 0;
  for (int i = 0; i < 4; i++) {
    int64_t numel = 1;
    for (int d = 0; d < params[i].rank; d++)
      numel *= params[i].dims[d];
    params[i].numel = numel;
    params[i].offset = offset;
    offset += (size_t)numel;
  }
  model = (RtModel){.name = "expert_linear", .batch = batch, .seqlen = L, .embed = M,
                    .seed = 7, .nparams = 4, .params = params, .param_floats = offset,
                    .arena_bytes = 64, .opt = opt, .nlayers = 1, .dropless = true,
                    .layout = layout, .nodes = 0, .forward = forward, .backward = backward,
                    .update = opt == RT_OPT_ADAMW ? update_adamw : update_sgd};
}

// The load figures of every step (routing depends on the token index only): rank r routes the
// tokens [r * T/P, (r+1) * T/P) of the global batch (DP shard, then its MP part).
static int expect_loads(void) {
  int world = layout.dp * layout.mp;
  int64_t per_rank = GLOBAL_BATCH * L / world, lo = INT64_MAX, hi = 0, sum = 0;
  for (int r = 0; r < world; r++) {
    int64_t load[E] = {0};
    for (int64_t s = r * per_rank; s < (r + 1) * per_rank; s++)
      if (route(s) >= 0)
        load[route(s)]++;
    for (int e = 0; e < E; e++) {
      lo = load[e] < lo ? load[e] : lo;
      hi = load[e] > hi ? load[e] : hi;
      sum += load[e];
    }
  }
  printf("load min/mean/max %lld/%.1f/%lld  capacity %lld\n", (long long)lo, (double)sum / (world * E),
         (long long)hi, (long long)hi);
  return 0;
}

static bool close_enough(double a, double b, double tol) {
  return fabs(a - b) <= tol * fmax(1.0, fmax(fabs(a), fabs(b)));
}

static int same_array(const char *a, const char *b, double tol) {
  RtArray x, y;
  if (rt_npy_read(a, &x) != 0 || rt_npy_read(b, &y) != 0) {
    fprintf(stderr, "%s\n", rt_last_error());
    return 1;
  }
  int bad = x.dtype != y.dtype || x.rank != y.rank || x.numel != y.numel;
  for (int d = 0; !bad && d < x.rank; d++)
    bad = x.dims[d] != y.dims[d];
  if (bad)
    fprintf(stderr, "%s and %s differ in dtype or shape\n", a, b);
  for (int64_t i = 0; !bad && i < x.numel; i++) {
    double u = x.dtype == RT_DTYPE_F64 ? ((double *)x.data)[i] : ((float *)x.data)[i];
    double v = y.dtype == RT_DTYPE_F64 ? ((double *)y.data)[i] : ((float *)y.data)[i];
    if (!close_enough(u, v, tol)) {
      fprintf(stderr, "%s and %s differ at element %lld: %.9g vs %.9g\n", a, b, (long long)i, u,
              v);
      bad = 1;
    }
  }
  rt_array_free(&x);
  rt_array_free(&y);
  return bad;
}

static int same_dump(const char *a, const char *b, double tol) {
  const char *files[] = {"input.npy", "target.npy", "output.npy", "loss.npy",
                         "grad/moe.experts.w.npy", "grad/moe.experts.b.npy", "grad/moe.c.npy",
                         "grad/moe.scale.npy"};
  int bad = 0;
  for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
    char pa[1024], pb[1024];
    snprintf(pa, sizeof pa, "%s/%s", a, files[i]);
    snprintf(pb, sizeof pb, "%s/%s", b, files[i]);
    bad |= same_array(pa, pb, strncmp(files[i], "in", 2) == 0 ? 0 : tol);
  }
  return bad;
}

// Loads both checkpoints whole (as one rank would) and compares every tensor and the step.
static int same_checkpoint(const char *a, const char *b, RtOptKind opt, double tol) {
  layout = (RtLayout){1, 1, 1, 1, 1};
  batch = GLOBAL_BATCH;
  describe(opt);
  RtRanks one = rt_ranks_of(&layout, 0, 1);
  size_t n = model.param_floats;
  float *buf[2][3];
  int64_t step[2];
  const char *path[2] = {a, b};
  for (int k = 0; k < 2; k++) {
    for (int j = 0; j < 3; j++)
      buf[k][j] = calloc(n, sizeof(float));
    if (rt_checkpoint_load(NULL, path[k], &model, &one, buf[k][0], buf[k][1], buf[k][2], &step[k])) {
      fprintf(stderr, "%s\n", rt_last_error());
      return 1;
    }
  }
  int bad = step[0] != step[1];
  if (bad)
    fprintf(stderr, "steps differ: %lld vs %lld\n", (long long)step[0], (long long)step[1]);
  for (int j = 0; j < (opt == RT_OPT_ADAMW ? 3 : 1); j++)
    for (size_t i = 0; i < n && !bad; i++)
      if (!close_enough(buf[0][j][i], buf[1][j][i], tol)) {
        fprintf(stderr, "tensor set %d differs at float %zu: %.9g vs %.9g\n", j, i,
                buf[0][j][i], buf[1][j][i]);
        bad = 1;
      }
  for (int k = 0; k < 2; k++)
    for (int j = 0; j < 3; j++)
      free(buf[k][j]);
  return bad;
}

int main(int argc, char **argv) {
  if (argc >= 3 && strcmp(argv[1], "--expect-loads") == 0)
    return parse_layout(argv[2]) != 0 || expect_loads() != 0;
  if (argc == 5 && strcmp(argv[1], "--same-dump") == 0)
    return same_dump(argv[2], argv[3], atof(argv[4]));
  if (argc == 6 && strcmp(argv[1], "--same-checkpoint") == 0)
    return same_checkpoint(argv[2], argv[3],
                           strcmp(argv[4], "adamw") == 0 ? RT_OPT_ADAMW : RT_OPT_SGD,
                           atof(argv[5]));
  if (argc < 3 || parse_layout(argv[1]) != 0) {
    fprintf(stderr, "usage: %s DP,MP,EP,ESP sgd|adamw [rt_main options]\n", argv[0]);
    return 2;
  }
  describe(strcmp(argv[2], "adamw") == 0 ? RT_OPT_ADAMW : RT_OPT_SGD);
  int64_t tokens = batch * L, whole = E * M * M + E * M + M + 1;
  w_whole = malloc(E * M * M * sizeof(float));
  b_whole = malloc(E * M * sizeof(float));
  w_gather = malloc(2 * E * M * M * sizeof(float));
  y_part = malloc((size_t)(tokens * M) * sizeof(float));
  y_dp = malloc((size_t)(tokens * M) * sizeof(float));
  dy = malloc(M * sizeof(float));
  gw = malloc((size_t)whole * sizeof(float));
  // rt_main sees argv[0] followed by the rt_main options.
  argv[2] = argv[0];
  int status = rt_main(&model, argc - 2, argv + 2);
  free(w_whole);
  free(b_whole);
  free(w_gather);
  free(y_part);
  free(y_dp);
  free(dy);
  free(gw);
  return status;
}
