// rt_main: the training driver every generated binary runs.
//
// The generated program knows its model (an RtModel: parameters, sizes, step functions); this
// file knows everything around it: the command line, where parameters come from (seeded init,
// --weights, --resume), the data of each step (synthetic from the seed, or .npy files), the
// loop forward -> backward -> update with its one-line report, --dump, the record hook's file,
// checkpoints and the finite-difference gradient check. Everything is a function of (seed,
// step, global sample, global element), so a run resumed from a checkpoint repeats an
// uninterrupted one bit for bit, and a run on P ranks does the single-rank math.
//
// Several ranks (mpirun -np P): DP rank r holds samples [r*B, (r+1)*B) of the step's global batch
// of dp*B samples (every MP rank of it the same B samples; the program splits the tokens over
// MP itself), and every rank holds its shard of each parameter (shard.c). The report's figures
// are reduced over the ranks, and only rank 0 prints. Files are layout-free: --input/--target
// and --dump hold the global batch, --dump and --weights whole tensors, and a checkpoint resumes
// on any layout. rt_main owns the layout's communicators (RtComm) and the stream executor
// (RtStreams) and hands them to the step functions in RtStep (st->comm, st->streams).
//
// A model of the CUDA target (RtModel.device) runs its steps on a GPU: the trainer keeps the same
// host buffers and hands them over at the points where the device must see them or where they
// are read here (device_put / device_get): after the parameters are set, before --dump, a
// checkpoint and the gradient check's reads, after each perturbation of that check. The
// forward stages the step's data itself. Without a device none of these calls happen.
//
// Errors on user input never abort: the failing function records a sentence (rt_fail), the
// caller unwinds, and rt_main prints "moert: error: SENTENCE" once and returns non-zero. It
// never calls exit(), so tests can run it in-process. On several ranks every failure point is
// one that all ranks reach, where they agree on the outcome (rt_world_agree), so all of them
// return non-zero and rank 0 prints the first failing rank's sentence; nothing hangs.
#include "moert.h"

void openblas_set_num_threads(int num_threads);  // OpenBLAS (cblas.h pulls in more than this file needs)
#include "rt_internal.h"

#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

enum { EXIT_USAGE = 2 };

// ---- errors ----

// rt_fail, rt_last_error: runtime/error.c.
static int report_error(void) {
  const char *last_error = rt_last_error();
  fprintf(stderr, "moert: error: %s\n", last_error[0] ? last_error : "unknown failure");
  return 1;
}

// Before the collectives start (command line, model checks) every rank sees the same failure;
// only the one the launcher numbers 0 (or a process run without mpirun) reports it.
static bool launcher_rank_zero(void) {
  static const char *const vars[] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"};
  for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) {
    const char *v = getenv(vars[i]);
    if (v && *v)
      return strcmp(v, "0") == 0;
  }
  return true;
}

// ---- command line ----

typedef struct Options {
  int64_t steps;
  const char *weights, *save, *resume, *input, *target, *dump, *record;
  bool check_grad, quiet, help;
} Options;

static void usage(FILE *out, const RtModel *model, const char *prog) {
  fprintf(out,
          "usage: %s [--steps N] [--weights W.safetensors] [--save C.safetensors] [--resume C]\n"
          "       %*s [--input x.npy] [--target t.npy] [--dump DIR] [--record FILE]\n"
          "       %*s [--check-grad] [--quiet]\n"
          "Trains the MoE model '%s' (inputs [%lld, %lld, %lld] per data-parallel rank) and "
          "prints one line per step.\n"
          "  --steps N        train until step N, counting resumed steps (default 20); with "
          "--resume,\n"
          "                   0 trains nothing: --steps 0 --resume C --save D converts checkpoint "
          "C\n"
          "                   (written on any number of ranks) to this run's layout\n"
          "  --weights W      load the parameters from W: a safetensors file of whole tensors, "
          "or a checkpoint\n"
          "  --save C         after the last step, write a checkpoint: the index file C and one "
          "shard per\n"
          "                   rank, C.rank<R>-of-<P>.safetensors (each written atomically)\n"
          "  --resume C       continue from checkpoint C, written by any layout: parameters, "
          "optimizer\n"
          "                   state, step\n"
          "  --input X        use X.npy (float32 [dp*B, L, M], the global batch) as the input of "
          "every step\n"
          "  --target T       use T.npy (float32 [dp*B, L, M]) as the target (default: "
          "0.5 * the input shifted by one channel)\n"
          "  --dump DIR       write the first step's input, target, output (global batch), loss "
          "and whole\n"
          "                   gradients to DIR\n"
          "  --record FILE    where a model with a record hook writes its JSON lines (default "
          "%s.record.jsonl;\n"
          "                   rank R > 0 writes FILE.rank<R>; appended to on --resume)\n"
          "  --check-grad     compare the gradients at step 1 with finite differences, "
          "then exit\n"
          "  --quiet          do not print the per-step lines\n"
          "  --help           print this message\n",
          prog, (int)strlen(prog), "", (int)strlen(prog), "", model->name,
          (long long)model->batch, (long long)model->seqlen, (long long)model->embed, model->name);
}

// options = ("--steps" N | "--weights" W | "--save" C | "--resume" C | "--input" X
//            | "--target" T | "--dump" DIR | "--record" FILE | "--check-grad" | "--quiet"
//            | "--help")*
// A value may also follow "=": --steps=5.
static int parse_options(int argc, char **argv, Options *o) {
  *o = (Options){.steps = 20};
  for (int i = 1; i < argc; i++) {
    const char *arg = argv[i];
    if (strcmp(arg, "--check-grad") == 0) {
      o->check_grad = true;
      continue;
    }
    if (strcmp(arg, "--quiet") == 0) {
      o->quiet = true;
      continue;
    }
    if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
      o->help = true;
      continue;
    }
    static const char *const valued[] = {"--steps", "--weights", "--save", "--resume",
                                         "--input", "--target",  "--dump", "--record"};
    const char **slots[] = {NULL,       &o->weights, &o->save, &o->resume,
                            &o->input, &o->target,  &o->dump, &o->record};
    enum { NVALUED = sizeof valued / sizeof *valued };
    int which = -1;
    const char *value = NULL;
    for (int k = 0; k < NVALUED && which < 0; k++) {
      size_t n = strlen(valued[k]);
      if (strncmp(arg, valued[k], n) == 0 && (arg[n] == '\0' || arg[n] == '=')) {
        which = k;
        value = arg[n] == '=' ? arg + n + 1 : NULL;
      }
    }
    if (which < 0)
      return rt_fail("unknown option '%s'", arg);
    if (!value) {
      if (i + 1 >= argc)
        return rt_fail("option '%s' needs a value", arg);
      value = argv[++i];
    }
    if (*value == '\0')
      return rt_fail("option '%s' needs a non-empty value", valued[which]);
    if (which == 0) {
      char *end;
      errno = 0;
      long long n = strtoll(value, &end, 10);
      if (errno || *end || end == value || n < 0 || n > INT32_MAX)
        return rt_fail("--steps needs a whole number between 0 and %d, not '%s'", INT32_MAX,
                       value);
      o->steps = n;
    } else {
      *slots[which] = value;
    }
  }
  if (o->weights && o->resume)
    return rt_fail("--weights and --resume cannot be combined (a checkpoint holds the weights)");
  if (o->target && !o->input)
    return rt_fail("--target needs --input (the synthetic input changes every step)");
  return 0;
}

// ---- the model description ----

static int check_model(const RtModel *m) {
  if (!m || !m->name || !m->forward || !m->backward || !m->update || m->nparams < 0 ||
      (m->nparams > 0 && !m->params))
    return rt_fail("internal error: the model description lacks its name or step functions");
  if (m->batch <= 0 || m->seqlen <= 0 || m->embed <= 0)
    return rt_fail("internal error: model '%s' has batch %lld, seqlen %lld, embed %lld", m->name,
                   (long long)m->batch, (long long)m->seqlen, (long long)m->embed);
  const RtLayout *l = &m->layout;
  if (l->dp < 1 || l->mp < 1 || l->ep < 1 || l->esp < 1 || l->gpus_per_node < 1 ||
      (m->batch * m->seqlen) % l->mp != 0)
    return rt_fail("internal error: model '%s' has the parallel layout dp %d, mp %d, ep %d, "
                   "esp %d, gpus_per_node %d for %lld tokens per rank", m->name, l->dp, l->mp,
                   l->ep, l->esp, l->gpus_per_node, (long long)(m->batch * m->seqlen));
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *p = &m->params[i];
    int64_t numel = 1;
    for (int d = 0; d < p->rank && d < 4; d++)
      numel *= p->dims[d];
    if (!p->name || p->rank < 0 || p->rank > 4 || numel != p->numel || p->numel < 0 ||
        p->offset + (size_t)p->numel > m->param_floats)
      return rt_fail("internal error: parameter %d ('%s') of model '%s' has an inconsistent "
                     "shape or offset", i, p->name ? p->name : "?", m->name);
    for (int j = 0; j < i; j++)
      if (strcmp(p->name, m->params[j].name) == 0)
        return rt_fail("internal error: model '%s' has two parameters called '%s'", m->name,
                       p->name);
    // The whole tensor is the shard times the group size along a split dimension.
    const RtLayout *l = &m->layout;
    bool ok = p->shard_ep >= -1 && p->shard_ep < p->rank && p->shard_esp >= -1 &&
              p->shard_esp < p->rank && (p->shard_ep < 0 || p->shard_ep != p->shard_esp);
    for (int d = 0; ok && d < p->rank; d++) {
      int64_t whole = p->dims[d] * (d == p->shard_ep ? l->ep : 1) *
                      (d == p->shard_esp ? l->esp : 1);
      ok = p->global_dims[d] == whole;
    }
    if (!ok) {
      char shard[160], whole[160];
      return rt_fail("internal error: parameter '%s' of model '%s': shard %s, whole tensor %s, "
                     "split dimensions %d (ep %d) and %d (esp %d) do not fit together",
                     p->name, m->name, rt_shape_str(shard, sizeof shard, p->rank, p->dims),
                     rt_shape_str(whole, sizeof whole, p->rank, p->global_dims), p->shard_ep,
                     l->ep, p->shard_esp, l->esp);
    }
  }
  return 0;
}

static const char *optimizer_name(RtOptKind k) {
  return k == RT_OPT_ADAMW ? "adamw" : "sgd";
}

// ---- the trainer: every buffer a run needs ----

typedef struct Trainer {
  const RtModel *model;
  Options opt;
  RtRanks ranks;           // this rank's place in the layout
  RtComm *comm;            // the layout's communicators (rt_main's; NULL: a world of one)
  RtStep st;
  float *input, *target;   // this rank's DP shard of the step's data
  int64_t elems;           // batch * seqlen * embed
  int64_t done_steps;      // the last step already applied to the parameters
  bool fixed_data;         // --input given: the same data every step
  bool device_up;          // model->device created: destroy it at the end
  RtFault fault;           // tests only: where this rank dies (MOERT_TEST_KILL, fault.c)
} Trainer;

static bool is_root(const Trainer *tr) {
  return tr->ranks.rank == 0;
}

static void trainer_destroy(Trainer *tr) {
  if (tr->device_up)
    tr->model->device->destroy(&tr->st);
  if (tr->st.record)
    fclose(tr->st.record);
  rt_streams_destroy(tr->st.streams);
  free(tr->st.params);
  free(tr->st.grads);
  free(tr->st.opt_m);
  free(tr->st.opt_v);
  free(tr->st.arena);
  free(tr->input);
  free(tr->target);
}

static int trainer_create(Trainer *tr, const RtModel *model, const Options *opt,
                          const RtRanks *ranks, RtComm *comm) {
  *tr = (Trainer){.model = model, .opt = *opt, .ranks = *ranks, .comm = comm,
                  .fault = rt_fault_from_env()};
  tr->elems = model->batch * model->seqlen * model->embed;
  size_t floats = model->param_floats ? model->param_floats : 1;
  size_t arena = (model->arena_bytes + 63) / 64 * 64;
  RtStep *st = &tr->st;
  st->model = model;
  st->seed = model->seed;
  st->comm = comm;
  st->streams = rt_streams_create(comm);
  // The global index of the first token this rank routes: its DP shard's first token, plus
  // the MP part of that shard the program gives this rank.
  int64_t tokens = model->batch * model->seqlen;
  st->token0 = ranks->dp_index * tokens + ranks->mp_index * (tokens / ranks->mp);
  st->params = rt_calloc(floats, sizeof(float), "the parameters");
  st->grads = rt_calloc(floats, sizeof(float), "the gradients");
  st->opt_m = rt_calloc(floats, sizeof(float), "the optimizer's first moments");
  st->opt_v = rt_calloc(floats, sizeof(float), "the optimizer's second moments");
  // The activations of a device model live on the device.
  if (!model->device && !(st->arena = aligned_alloc(64, arena ? arena : 64)))
    rt_out_of_memory(arena, "the activation arena");
  tr->input = rt_calloc((size_t)tr->elems, sizeof(float), "the step's input");
  tr->target = rt_calloc((size_t)tr->elems, sizeof(float), "the step's target");
  // Zeroed once so that a plan that reads a buffer before writing it is at least deterministic.
  if (st->arena)
    memset(st->arena, 0, arena ? arena : 64);
  st->input = tr->input;
  st->target = tr->target;
  if (model->device) {
    if (model->device->create(st) != 0)
      return -1;
    tr->device_up = true;
  }
  return 0;
}

// ---- the device's copies (a model of the CUDA target) ----

// Host -> device (device_put) and device -> host (device_get) of what (RtDeviceData bits), on
// every rank, agreed over the world. 0 without a device: the host buffers are the only ones.
static int device_put(Trainer *tr, unsigned what) {
  const RtDevice *dev = tr->model->device;
  return dev ? rt_world_agree(tr->comm, dev->upload(&tr->st, what)) : 0;
}

static int device_get(Trainer *tr, unsigned what) {
  const RtDevice *dev = tr->model->device;
  return dev ? rt_world_agree(tr->comm, dev->download(&tr->st, what)) : 0;
}

// ---- where the parameters come from ----

static void init_params(Trainer *tr) {
  const RtModel *m = tr->model;
  for (int i = 0; i < m->nparams; i++)
    rt_shard_init(&m->params[i], &tr->ranks, m->seed, tr->st.params + m->params[i].offset);
}

static int load_checkpoint(Trainer *tr, const char *path) {
  int64_t done = 0;
  if (rt_checkpoint_load(path, tr->model, &tr->ranks, tr->st.params, tr->st.opt_m,
                         tr->st.opt_v, &done) != 0)
    return -1;
  tr->done_steps = done;
  return 0;
}

// ---- the report: a step's figures, reduced over the ranks ----

typedef struct Report {
  double loss, mse, aux, z, aux_total;
  double dropped, routed, load_sum, load_count;
  double load_min, load_max, capacity_max;
  bool route_changed;         // some rank's route_hash differs from the one given
} Report;

// st->mse is this rank's share of the mean over the global batch (MP ranks hold the same
// value), so it sums over DP; aux, z and aux_total are shares that sum over the world, as do
// the routing counts. Collective on several ranks.
static Report reduce_report(const Trainer *tr, const RtStep *st, const uint64_t *hash0) {
  Report r = {.mse = st->mse};
  double sums[7] = {st->aux, st->z, st->aux_total, (double)st->dropped, (double)st->routed,
                    st->load_sum, (double)st->load_count};
  double maxes[4] = {st->load_count > 0 ? -(double)st->load_min : -INFINITY,
                     (double)st->load_max, (double)st->capacity_max,
                     hash0 && st->route_hash != *hash0};
  if (tr->ranks.world > 1) {
    rt_allreduce_f64(tr->comm, RT_GROUP_DP, &r.mse, 1);
    rt_allreduce_f64(tr->comm, RT_GROUP_WORLD, sums, 7);
    rt_world_max(tr->comm, maxes, 4);
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
  return r;
}

// ---- data ----

// target[s, m] = 0.5 * x[s, (m + 1) % M]: a linear teacher every model can learn.
static void derive_target(const float *x, float *target, int64_t tokens, int64_t embed) {
  for (int64_t s = 0; s < tokens; s++)
    for (int64_t m = 0; m < embed; m++)
      target[s * embed + m] = 0.5f * x[s * embed + (m + 1) % embed];
}

// The samples first .. first + batch - 1 of the step's global batch.
static void synthetic_input(const RtModel *m, int64_t step, int64_t first, float *x) {
  uint64_t step_key = rt_key(rt_key(m->seed, RT_STREAM_INPUT), (uint64_t)step);
  int64_t per_sample = m->seqlen * m->embed;
  for (int64_t i = 0; i < m->batch; i++) {
    uint64_t key = rt_key(step_key, (uint64_t)(first + i));
    for (int64_t j = 0; j < per_sample; j++)
      x[i * per_sample + j] = (float)rt_normal(key, (uint64_t)j);
  }
}

// The files hold the global batch [dp*B, L, M]; this rank keeps its DP shard.
static int read_global_batch(Trainer *tr, const char *path, float *dst) {
  const RtModel *m = tr->model;
  const RtRanks *r = &tr->ranks;
  if (r->dp == 1) {
    int64_t dims[3] = {m->batch, m->seqlen, m->embed};
    return rt_npy_read_f32(path, 3, dims, dst);
  }
  int64_t dims[3] = {r->dp * m->batch, m->seqlen, m->embed};
  float *all = rt_alloc((size_t)(r->dp * tr->elems) * sizeof(float), "the global batch");
  int status = rt_npy_read_f32(path, 3, dims, all);
  if (status == 0)
    memcpy(dst, all + r->dp_index * tr->elems, (size_t)tr->elems * sizeof(float));
  free(all);
  return status;
}

static int load_data(Trainer *tr) {
  const RtModel *m = tr->model;
  if (read_global_batch(tr, tr->opt.input, tr->input) != 0)
    return -1;
  if (tr->opt.target)
    return read_global_batch(tr, tr->opt.target, tr->target);
  derive_target(tr->input, tr->target, m->batch * m->seqlen, m->embed);
  return 0;
}

static void fill_step_data(Trainer *tr, int64_t step) {
  tr->st.step = step;
  if (tr->fixed_data)
    return;
  const RtModel *m = tr->model;
  synthetic_input(m, step, tr->ranks.dp_index * m->batch, tr->input);
  derive_target(tr->input, tr->target, m->batch * m->seqlen, m->embed);
}

// ---- --dump ----

static int make_dirs(const char *path) {
  char *p = rt_strdup(path, "the name of the --dump folder");
  int status = 0;
  for (char *s = p + 1;; s++) {
    if (*s != '/' && *s != '\0')
      continue;
    char saved = *s;
    *s = '\0';
    struct stat sb;
    if (mkdir(p, 0777) != 0 && errno != EEXIST) {
      status = rt_fail("cannot create directory '%s': %s", p, strerror(errno));
      break;
    }
    if (stat(p, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
      status = rt_fail("cannot create directory '%s': a file of that name is in the way", p);
      break;
    }
    *s = saved;
    if (saved == '\0')
      break;
  }
  free(p);
  return status;
}


// Rank 0 writes whole tensors: the global batch's input, target and output (gathered over DP)
// and every parameter's gradient assembled from the ranks' shards. Collective on several ranks:
// every rank takes part in every gather even after rank 0 failed to write, then all agree.
static int dump_step(Trainer *tr, const Report *rep) {
  const RtModel *m = tr->model;
  const RtRanks *r = &tr->ranks;
  const char *dir = tr->opt.dump;
  bool root = is_root(tr);
  if (device_get(tr, RT_DEVICE_GRADS | RT_DEVICE_OUTPUT) != 0)
    return -1;
  int status = tr->st.output ? 0
                             : rt_fail("internal error: the forward of model '%s' did not set "
                                       "its output", m->name);
  if (rt_world_agree(tr->comm, status) != 0)
    return -1;
  size_t len = strlen(dir) + 512;
  char *path = NULL;
  size_t whole_floats = (size_t)(r->dp * tr->elems);
  for (int i = 0; i < m->nparams; i++) {
    size_t n = (size_t)rt_param_global_numel(&m->params[i]);
    whole_floats = n > whole_floats ? n : whole_floats;
  }
  float *whole = NULL;
  if (root) {
    path = rt_alloc(len, "the names of the --dump files");
    whole = rt_alloc(whole_floats * sizeof(float), "a whole tensor of the --dump");
    snprintf(path, len, "%s/grad", dir);
    status = make_dirs(path);
  }
  if (rt_world_agree(tr->comm, status) != 0) {
    free(path);
    free(whole);
    return -1;
  }
  int64_t dims[3] = {r->dp * m->batch, m->seqlen, m->embed};
  const char *names[3] = {"input", "target", "output"};
  const float *data[3] = {tr->st.input, tr->st.target, tr->st.output};
  for (int k = 0; k < 3; k++) {
    rt_gather_dp(tr->comm, r, data[k], tr->elems, whole);
    if (root && status == 0) {
      snprintf(path, len, "%s/%s.npy", dir, names[k]);
      status = rt_npy_write(path, RT_DTYPE_F32, 3, dims, whole);
    }
  }
  if (root && status == 0) {
    snprintf(path, len, "%s/loss.npy", dir);
    status = rt_npy_write(path, RT_DTYPE_F64, 0, NULL, &rep->loss);
  }
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *p = &m->params[i];
    rt_gather_param(tr->comm, p, r, tr->st.grads + p->offset, whole);
    if (root && status == 0) {
      snprintf(path, len, "%s/grad/%s.npy", dir, p->name);
      status = rt_npy_write(path, RT_DTYPE_F32, p->rank, p->global_dims, whole);
    }
  }
  free(path);
  free(whole);
  return rt_world_agree(tr->comm, status);
}

// ---- training ----

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static void print_header(const Trainer *tr, int64_t first, int64_t last) {
  const RtModel *m = tr->model;
  const RtRanks *r = &tr->ranks;
  printf("# %s: %d parameter tensors, %zu floats; batch %lld, seqlen %lld, embed %lld; "
         "optimizer %s; seed %" PRIu64 "\n", m->name, m->nparams, m->param_floats,
         (long long)m->batch, (long long)m->seqlen, (long long)m->embed,
         optimizer_name(m->opt), m->seed);
  if (m->device)
    printf("# device: %s\n", m->device->describe());
  if (r->world > 1)
    printf("# %d ranks: dp %d, mp %d, ep %d, esp %d; global batch %lld samples; figures "
           "reduced over the ranks, time of the slowest\n", r->world, r->dp, r->mp, r->ep,
           r->esp, (long long)(r->dp * m->batch));
  if (first <= last)
    printf("# steps %lld..%lld, data: %s\n", (long long)first, (long long)last,
           tr->fixed_data ? "from .npy files" : "synthetic");
}

static int train(Trainer *tr) {
  const RtModel *m = tr->model;
  RtStep *st = &tr->st;
  bool root = is_root(tr);
  int64_t first = tr->done_steps + 1, last = tr->opt.steps;
  bool convert = tr->opt.resume && tr->opt.steps == 0;
  if (convert)
    last = tr->done_steps;
  if (!tr->opt.quiet && root)
    print_header(tr, first, last);
  double loss = NAN;
  for (int64_t t = first; t <= last; t++) {
    fill_step_data(tr, t);
    double t0 = now_ms();
    m->forward(st);
    rt_fault_point(&tr->fault, tr->ranks.rank, t);
    RtStep forward_state = *st;   // the statistics the forward left, in case backward adds any
    m->backward(st);
    double t1 = now_ms();
    Report rep = reduce_report(tr, &forward_state, NULL);
    if (tr->opt.dump && t == first && dump_step(tr, &rep) != 0)
      return -1;
    double t2 = now_ms();
    m->update(st);
    double t3 = now_ms();
    tr->done_steps = t;
    double ms = (t1 - t0) + (t3 - t2);
    rt_world_max(tr->comm, &ms, 1);
    loss = rep.loss;
    double dropped = rep.routed > 0 ? rep.dropped / rep.routed : 0.0;
    if (st->record)
      fflush(st->record);
    if (!tr->opt.quiet && root) {
      // Tokens per expert, min/mean/max over every expert of every layer (0/0.0/0 without MoE).
      bool loads = rep.load_count > 0;
      printf("step %lld  loss %.6f  mse %.6f  aux %.6f  z %.6f  dropped %.4f  load %lld/%.1f/%lld",
             (long long)t, loss, rep.mse, rep.aux, rep.z, dropped,
             loads ? (long long)rep.load_min : 0LL, loads ? rep.load_sum / rep.load_count : 0.0,
             loads ? (long long)rep.load_max : 0LL);
      if (m->dropless)
        printf("  capacity %lld", (long long)rep.capacity_max);
      printf("  time %.3f ms\n", ms);
      fflush(stdout);
    }
    if (!isfinite(loss))
      return rt_fail("the loss is %f at step %lld; training diverged (try a smaller learning "
                     "rate)", loss, (long long)t);
  }
  if (!root)
    return 0;
  if (first <= last)
    printf("# trained %lld step%s; final loss %.6f\n", (long long)(last - first + 1),
           last > first ? "s" : "", loss);
  else if (convert && !tr->opt.quiet)
    printf("# --steps 0: nothing trained; the parameters stay at step %lld\n",
           (long long)tr->done_steps);
  else if (!tr->opt.quiet)
    printf("# nothing to train: the parameters are at step %lld and --steps is %lld\n",
           (long long)tr->done_steps, (long long)last);
  return 0;
}

// ---- the record hook's file ----

// A model with a record hook writes to --record FILE, by default MODEL.record.jsonl in the
// current directory (rank R > 0 of several: FILE.rank<R>); a fresh run starts the file anew, a
// resumed one appends to it.
static int open_record(Trainer *tr) {
  const RtModel *m = tr->model;
  if (!m->records) {
    if (tr->opt.record && !tr->opt.quiet && is_root(tr))
      printf("# --record %s: model '%s' has no record hook, nothing is recorded\n",
             tr->opt.record, m->name);
    return 0;
  }
  char path[1024];
  if (tr->opt.record)
    snprintf(path, sizeof path, "%s", tr->opt.record);
  else
    snprintf(path, sizeof path, "%s.record.jsonl", m->name);
  if (tr->ranks.rank > 0) {
    size_t n = strlen(path);
    snprintf(path + n, sizeof path - n, ".rank%d", tr->ranks.rank);
  }
  FILE *f = fopen(path, tr->opt.resume ? "a" : "w");
  if (!f)
    return rt_fail("cannot open the record file '%s': %s", path, strerror(errno));
  tr->st.record = f;
  return 0;
}

// ---- --check-grad ----

enum { CHECK_ENTRIES = 12 };
#define CHECK_RTOL 5e-2
#define CHECK_ATOL_GRAD 1e-3   // times the largest |gradient| of the parameter
#define CHECK_EPS 1e-2         // times max(1, |p|)
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
  return ep * r->esp + esp;
}

// Central differences on up to CHECK_ENTRIES entries of every parameter, spread evenly over the
// whole tensor with an offset from the name's hash, against the analytic gradient of the same
// total loss. On several ranks every rank that holds an entry (replicas included) perturbs it,
// all run the forward, and the reduced losses are compared with the owner's gradient.
static int check_grad(Trainer *tr) {
  const RtModel *m = tr->model;
  const RtRanks *r = &tr->ranks;
  RtStep *st = &tr->st;
  bool root = is_root(tr);
  fill_step_data(tr, 1);
  m->forward(st);
  Report rep0 = reduce_report(tr, st, NULL);
  double loss0 = rep0.loss;
  double loss_scale = fabs(rep0.mse) + fabs(rep0.aux_total);   // what fp32 rounding scales with
  uint64_t hash0 = st->route_hash;
  m->backward(st);
  float *grad = rt_alloc(m->param_floats * sizeof(float), "the gradients of --check-grad");
  if (device_get(tr, RT_DEVICE_GRADS) != 0) {
    free(grad);
    return -1;
  }
  memcpy(grad, st->grads, m->param_floats * sizeof(float));

  int width = 9;
  for (int i = 0; i < m->nparams; i++)
    if ((int)strlen(m->params[i].name) > width)
      width = (int)strlen(m->params[i].name);
  if (root) {
    printf("# gradient check of %s at step 1: loss %.6f (mse + aux_total), %d parameters\n",
           m->name, loss0, m->nparams);
    printf("# central differences on up to %d entries per parameter, eps = %.0e * max(1, |p|)\n",
           CHECK_ENTRIES, CHECK_EPS);
    printf("# pass: |fd - g| <= atol + rtol * |g|, rtol = %.0e, atol = %.0e * max|g| of the "
           "parameter + %.0f * 2^-23 * |loss| / (2 eps)\n", CHECK_RTOL, CHECK_ATOL_GRAD,
           CHECK_NOISE_ULPS);
    printf("# entries where +-eps changes a routing decision are skipped (not differentiable)\n");
    printf("# %-*s %8s %8s %12s %12s  %s\n", width - 2, "parameter", "checked", "skipped",
           "max abs err", "max rel err", "result");
  }
  int total_checked = 0, total_skipped = 0, total_failed = 0;
  bool device_failed = false;   // an upload of the perturbed parameters failed (all ranks agree)
  for (int i = 0; i < m->nparams && !device_failed; i++) {
    const RtParam *p = &m->params[i];
    const float *g = grad + p->offset;
    float *w = st->params + p->offset;
    double max_g = 0;
    for (int64_t j = 0; j < p->numel; j++)
      max_g = fmax(max_g, fabs(g[j]));
    rt_world_max(tr->comm, &max_g, 1);
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
      double eps = CHECK_EPS * fmax(1.0, fabs(orig));
      float plus = (float)(orig + eps), minus = (float)(orig - eps);
      double up = (double)plus - orig, down = orig - (double)minus;
      if (j >= 0)
        w[j] = plus;
      if ((device_failed = device_put(tr, RT_DEVICE_PARAMS) != 0))
        break;
      m->forward(st);
      Report rep_up = reduce_report(tr, st, &hash0);
      if (j >= 0)
        w[j] = minus;
      if ((device_failed = device_put(tr, RT_DEVICE_PARAMS) != 0))
        break;
      m->forward(st);
      Report rep_down = reduce_report(tr, st, &hash0);
      if (j >= 0)
        w[j] = orig;
      if (rep_up.route_changed || rep_down.route_changed) {
        skipped++;
        continue;
      }
      double fd = (rep_up.loss - rep_down.loss) / (up + down);
      double err = fabs(fd - grad_j);
      double scale = fmax(fabs(fd), fabs(grad_j));
      double rel = scale > 0 ? err / scale : 0;
      checked++;
      double noise = CHECK_NOISE_ULPS * FLT_EPSILON * loss_scale / (up + down);
      failed += !(err <= atol_grad + noise + CHECK_RTOL * fabs(grad_j));
      max_abs = fmax(max_abs, err);
      max_rel = fmax(max_rel, rel);
    }
    if (device_failed)
      break;
    const char *result = failed ? "FAILED" : checked ? "OK" : "SKIPPED";
    if (root) {
      printf("%-*s %8d %8d %12.3e %12.3e  %s\n", width, p->name, checked, skipped, max_abs,
             max_rel, result);
      fflush(stdout);
    }
    total_checked += checked;
    total_skipped += skipped;
    total_failed += failed;
  }
  free(grad);
  // Leave the step's state as the unperturbed forward left it.
  if (device_failed || device_put(tr, RT_DEVICE_PARAMS) != 0)
    return -1;
  m->forward(st);
  bool ok = total_failed == 0 && total_checked > 0;
  if (root) {
    printf("# %d entries checked, %d skipped, %d out of tolerance%s\n", total_checked,
           total_skipped, total_failed, total_checked ? "" : " (nothing could be checked)");
    printf("%s\n", ok ? "OK" : "FAILED");
  }
  return ok ? 0 : 1;
}

// ---- entry point ----

// Everything after the collectives started: every rank runs it, and every failure is agreed
// on, so all ranks return the same status. Rank 0 prints.
static int run(const RtModel *model, const Options *opt, const RtRanks *ranks, RtComm *comm) {
  Trainer tr;
  int status = rt_world_agree(comm, trainer_create(&tr, model, opt, ranks, comm));
  // The device's collective part (its communicators) once every rank has its device.
  if (status == 0 && model->device)
    status = rt_world_agree(comm, model->device->connect(&tr.st));
  if (status == 0) {
    if (opt->resume)
      status = load_checkpoint(&tr, opt->resume);
    else if (opt->weights)
      status = rt_weights_load(opt->weights, model, ranks, tr.st.params);
    else
      init_params(&tr);
    status = rt_world_agree(comm, status);
    if (status == 0)
      status = device_put(&tr, RT_DEVICE_PARAMS | RT_DEVICE_MOMENTS);
  }
  if (status == 0 && opt->input) {
    tr.fixed_data = true;
    status = rt_world_agree(comm, load_data(&tr));
  }
  if (status == 0 && opt->check_grad) {
    status = check_grad(&tr);
    if (status < 0 && ranks->rank == 0)
      report_error();
    fflush(stdout);
    trainer_destroy(&tr);
    return status != 0;
  }
  if (status == 0 && tr.done_steps > opt->steps && opt->steps > 0)
    status = rt_fail("checkpoint '%s' is at step %lld, past --steps %lld", opt->resume,
                     (long long)tr.done_steps, (long long)opt->steps);
  if (status == 0)
    status = rt_world_agree(comm, open_record(&tr));
  if (status == 0)
    status = train(&tr);
  if (status == 0 && opt->save)
    status = device_get(&tr, RT_DEVICE_PARAMS | RT_DEVICE_MOMENTS);
  if (status == 0 && opt->save)
    status = rt_checkpoint_save(comm, opt->save, model, ranks, tr.done_steps, tr.st.params,
                                tr.st.opt_m, tr.st.opt_v);
  fflush(stdout);
  trainer_destroy(&tr);
  if (status == 0)
    return 0;
  return ranks->rank == 0 ? report_error() : 1;
}

int rt_main(const RtModel *model, int argc, char **argv) {
  const char *prog = argc > 0 && argv[0] ? argv[0] : "model";
  bool speaker = launcher_rank_zero();
  rt_clear_error();
  Options opt;
  if (parse_options(argc, argv, &opt) != 0) {
    if (speaker) {
      fprintf(stderr, "moert: error: %s\n", rt_last_error());
      usage(stderr, model, prog);
    }
    return EXIT_USAGE;
  }
  if (opt.help) {
    if (speaker)
      usage(stdout, model, prog);
    return 0;
  }
  if (check_model(model) != 0)
    return speaker ? report_error() : 1;
  // rt_comm_create reports a layout that does not fit the world itself, once.
  RtComm *comm = rt_comm_create(&model->layout, model->nodes);
  if (!comm)
    return 1;
  RtRanks ranks = rt_ranks_of(&model->layout, rt_comm_rank(comm, RT_GROUP_WORLD),
                              rt_comm_size(comm, RT_GROUP_WORLD));
  // Ranks sharing a machine share its cores: give each rank's OpenBLAS its share, or the
  // GEMM threads of all ranks oversubscribe the cores many times over.
  const char *local = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  long cores = sysconf(_SC_NPROCESSORS_ONLN), on_node = local ? atol(local) : 1;
  if (ranks.world > 1 && on_node > 1 && cores > 0)
    openblas_set_num_threads(cores / on_node > 1 ? (int)(cores / on_node) : 1);
  if (ranks.world > 1 && ranks.rank == 0 && !opt.quiet) {
    rt_comm_print_groups(comm, stdout);
    fflush(stdout);
  }
  int status = run(model, &opt, &ranks, comm);
  rt_comm_destroy(comm);
  return status;
}
