// rt_main: the training driver every generated binary runs.
//
// The generated program knows its model (an RtModel: parameters, sizes, step functions); the
// driver (this file and the rooms below) knows everything around it: the command line, where
// parameters come from (seeded init, --weights, --resume), the data of each step (synthetic
// from the seed, or .npy files), the loop forward -> backward -> update with its one-line
// report, --dump, the record hook's file, checkpoints and the finite-difference gradient check. Everything is a function of (seed,
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
// are read here (rt_device_put / rt_device_get): after the parameters are set, before --dump, a
// checkpoint and the gradient check's reads, after each perturbation of that check. The
// forward stages the step's data itself. Without a device none of these calls happen.
//
// Errors on user input never abort: the failing function records a sentence (rt_fail), the
// caller unwinds, and rt_main prints "moert: error: SENTENCE" once and returns non-zero. It
// never calls exit(), so tests can run it in-process. On several ranks every failure point is
// one that all ranks reach, where they agree on the outcome (rt_world_agree), so all of them
// return non-zero and rank 0 prints the first failing rank's sentence; nothing hangs.
//
// The driver's rooms are files of their own, sharing rt_trainer.h: the command line and the
// model's checks (options.c), --dump and --export-hf (dump.c), --check-grad (check_grad.c) and
// --sample (sample.c); below them all, each step's data, the device's copies and the report
// (step_data.c). This file keeps rt_main, the trainer and the training loop.
#include "moert.h"

#include "rt_hf.h"
#include "rt_trainer.h"

#include <errno.h>
#include <inttypes.h>
#include <malloc.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>
#include <sys/resource.h>
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

// ---- the trainer ----

static void trainer_destroy(RtTrainer *tr) {
  if (tr->device_up)
    tr->model->device->destroy(&tr->st);
  if (tr->st.record)
    fclose(tr->st.record);
  rt_streams_destroy(tr->st.streams);
  size_t bytes = (tr->model->param_floats ? tr->model->param_floats : 1) * sizeof(float);
  size_t gbytes = (rt_grad_floats(tr->model) ? rt_grad_floats(tr->model) : 1) * sizeof(float);
  rt_big_free(tr->st.params, bytes);
  rt_big_free(tr->st.grads, gbytes);
  rt_big_free(tr->st.opt_m, gbytes);
  rt_big_free(tr->st.opt_v, gbytes);
  if (tr->arenas)
    rt_pipe_destroy(tr);
  rt_big_free(tr->st.arena, tr->arena_bytes);
  free(tr->input);
  free(tr->target);
  free(tr->fixed_in);
  free(tr->fixed_target);
  free(tr->logits_whole);
  free(tr->logits_parts);
  if (tr->lm_open)
    rt_lm_close(&tr->lm);
  rt_log_close(tr->log);
  free(tr->log_layers);
  free(tr->st.layer_stats);
}

static int trainer_create(RtTrainer *tr, const RtModel *model, const RtOptions *opt,
                          const RtRanks *ranks, RtComm *comm, const RtModel *const *stages, int nstages) {
  *tr = (RtTrainer){.model = model, .opt = *opt, .ranks = *ranks, .comm = comm,
                  .fault = rt_fault_from_env(), .stages = stages, .nstages = nstages};
  tr->elems = model->batch * model->seqlen * model->embed;
  size_t floats = model->param_floats ? model->param_floats : 1;
  size_t gfloats = rt_grad_floats(model) ? rt_grad_floats(model) : 1;   // the trained parameters'
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
  st->vocab0 = model->vocab_parallel ? ranks->mp_index * (model->vocab / ranks->mp) : 0;
  // Zeroed blocks of their own mappings (rt_big_alloc): the kernel zeroes them as they are first touched.
  st->params = rt_big_alloc(floats * sizeof(float), "the parameters");
  st->grads = rt_big_alloc(gfloats * sizeof(float), "the gradients");
  st->opt_m = rt_big_alloc(gfloats * sizeof(float), "the optimizer's first moments");
  st->opt_v = rt_big_alloc(gfloats * sizeof(float), "the optimizer's second moments");
  // The activations of a device model live on the device.
  tr->arena_bytes = arena ? arena : 64;
  if (!model->device)
    st->arena = rt_big_alloc(tr->arena_bytes, "the activation arena");
  // A language model's input and target are int32 tokens, one per position, at the start of
  // buffers of the float size (a device copies the whole buffers).
  // Whole pages of their own: a device page-locks them (rt_cuda_pin), which works on pages.
  size_t data_bytes = ((size_t)tr->elems * sizeof(float) + 4095) & ~(size_t)4095;
  if (data_bytes == 0)
    data_bytes = 4096;
  tr->data_bytes = data_bytes;
  if (!(tr->input = aligned_alloc(4096, data_bytes)) || !(tr->target = aligned_alloc(4096, data_bytes)))
    rt_out_of_memory(data_bytes, "the step's input and target");
  memset(tr->input, 0, data_bytes);
  memset(tr->target, 0, data_bytes);
  st->lr_scale = 1.0f;
  st->grad_scale = 1.0f;
  // The arena is zeroed (rt_big_alloc) so that a plan that reads a buffer before writing it is at
  // least deterministic; every step writes it, so every thread touches it first before the first
  // step (a run that trains none, a conversion or --sample, faults in what it uses).
  st->input = tr->input;
  st->target = tr->target;
  int all_layers = nstages > 1 ? 0 : model->nlayers;   // with stages, every stage's (the log holds them all)
  for (int s = 0; nstages > 1 && s < nstages; s++) all_layers += stages[s]->nlayers;
  if (tr->opt.log && model->nlayers > 0) {   // every rank keeps them: --log reduces them over the world
    st->max_layer_stats = model->nlayers;
    st->layer_stats = rt_calloc((size_t)model->nlayers, sizeof *st->layer_stats, "the layers' statistics");
  }
  if (tr->opt.log && all_layers > 0)
    tr->log_layers = rt_calloc((size_t)all_layers, sizeof *tr->log_layers, "the layers' statistics");
  if (tr->opt.log && tr->ranks.rank == 0 && tr->ranks.stage == 0 && !(tr->log = rt_log_open(tr->opt.log, model->name, tr->opt.resume)))
    return -1;
  if (model->device) {
    if (model->device->create(st) != 0)
      return -1;
    tr->device_up = true;
  }
  return rt_pipe_create(tr);
}

// ---- where the parameters come from ----

static void init_params(RtTrainer *tr) {
  const RtModel *m = tr->model;
  for (int i = 0; i < m->nparams; i++)
    rt_shard_init(&m->params[i], &tr->ranks, m->seed, tr->st.params + m->params[i].offset);
}

static int load_checkpoint(RtTrainer *tr, const char *path) {
  int64_t done = 0;
  if (rt_checkpoint_load(tr->comm, path, tr->model, &tr->ranks, tr->st.params, tr->st.opt_m,
                         tr->st.opt_v, &done) != 0)
    return -1;
  tr->done_steps = done;
  return 0;
}

// --log: the step's line, its per-layer statistics reduced over the world (collective).
static int log_step(RtTrainer *tr, const RtStep *fwd, const RtReport *rep, int64_t t, double gnorm, double ms,
                    double tokens_per_s) {
  if (!tr->opt.log)
    return 0;
  int mine = fwd->layer_stats ? fwd->nlayer_stats : 0, n = mine, first = 0;
  if (tr->ranks.stages > 1) {   // every stage's routed layers, in order: this stage's from `first`
    int P = tr->ranks.stages;
    double *count = rt_calloc((size_t)P, sizeof *count, "the layers' statistics");
    count[tr->ranks.stage] = mine;
    rt_pp_sum_f64(tr->comm, count, P);
    n = 0;
    for (int s = 0; s < P; s++) first += s < tr->ranks.stage ? (int)count[s] : 0, n += (int)count[s];
    free(count);
  }
  double *sums = rt_calloc((size_t)(6 * n + 1), sizeof *sums, "the layers' statistics"), *maxes = sums + 4 * n;
  for (int i = 0; i < 2 * n; i++) maxes[i] = -INFINITY;
  for (int i = first; i < first + mine; i++) {
    const RtLayerStats *l = &fwd->layer_stats[i - first];
    sums[4 * i] = l->load_sum;
    sums[4 * i + 1] = (double)l->load_count;
    sums[4 * i + 2] = (double)l->dropped;
    sums[4 * i + 3] = (double)l->routed;
    maxes[2 * i] = l->load_count > 0 ? -(double)l->load_min : -INFINITY;
    maxes[2 * i + 1] = (double)l->load_max;
  }
  if (tr->ranks.world > 1 && n > 0) {
    rt_allreduce_f64(tr->comm, RT_GROUP_WORLD, sums, 4 * n);
    rt_world_max(tr->comm, maxes, 2 * n);
  }
  if (tr->ranks.stages > 1 && n > 0) {
    rt_pp_sum_f64(tr->comm, sums, 4 * n);
    rt_pp_max_f64(tr->comm, maxes, 2 * n);
  }
  for (int i = 0; i < n; i++)
    tr->log_layers[i] = (RtLogLayer){.load_min = sums[4 * i + 1] > 0 ? -maxes[2 * i] : 0,
                                     .load_mean = sums[4 * i + 1] > 0 ? sums[4 * i] / sums[4 * i + 1] : 0,
                                     .load_max = maxes[2 * i + 1],
                                     .dropped = sums[4 * i + 3] > 0 ? sums[4 * i + 2] / sums[4 * i + 3] : 0};
  free(sums);
  if (!rt_is_root(tr))
    return rt_world_agree(tr->comm, 0);
  const RtModel *m = tr->model;
  RtLogStep s = {.step = t, .lm = m->vocab > 0, .loss = rep->loss, .ce = rep->mse, .aux = rep->aux, .z = rep->z,
                 .lr = m->lr * tr->st.lr_scale, .grad_norm = gnorm, .tokens_per_s = tokens_per_s, .time_ms = ms,
                 .dropped = rep->routed > 0 ? rep->dropped / rep->routed : 0.0, .nlayers = n,
                 .layers = tr->log_layers};
  return rt_world_agree(tr->comm, rt_log_step(tr->log, &s));
}

// ---- training ----

// Whether a person watches standard output: it is a terminal, and under mpirun (which hands
// the ranks a pseudo-terminal of its own whatever its output is) the launcher's is one too.
// Asked before MPI starts (a singleton's MPI_Init sets the launcher's variables).
static bool stdout_watched(void) {
  if (!isatty(STDOUT_FILENO))
    return false;
  if (!getenv("OMPI_COMM_WORLD_SIZE") && !getenv("PMIX_RANK"))
    return true;
  for (pid_t pid = getppid(); pid > 1;) {   // the launcher: the first ancestor whose stdout is no pty of Open MPI's
    char link[64], target[256];
    snprintf(link, sizeof link, "/proc/%ld/fd/1", (long)pid);
    ssize_t len = readlink(link, target, sizeof target - 1);
    if (len <= 0)
      return false;
    target[len] = '\0';
    bool tty = strncmp(target, "/dev/pts/", 9) == 0 || strncmp(target, "/dev/tty", 8) == 0;
    char stat[64];
    snprintf(stat, sizeof stat, "/proc/%ld/comm", (long)pid);
    FILE *f = fopen(stat, "r");
    char comm[64] = "";
    if (f) {
      if (!fgets(comm, sizeof comm, f))
        comm[0] = '\0';
      fclose(f);
    }
    if (strncmp(comm, "mpirun", 6) == 0 || strncmp(comm, "mpiexec", 7) == 0 || strncmp(comm, "orterun", 7) == 0 ||
        strncmp(comm, "prterun", 7) == 0)
      return tty;   // the launcher's own output decides
    // a daemon between (orted, prted): its parent
    snprintf(stat, sizeof stat, "/proc/%ld/stat", (long)pid);
    f = fopen(stat, "r");
    long ppid = 0;
    if (!f || fscanf(f, "%*d %*s %*c %ld", &ppid) != 1)
      ppid = 0;
    if (f)
      fclose(f);
    pid = (pid_t)ppid;
  }
  return false;
}

static int by_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static const char *optimizer_name(RtOptKind k) {
  return k == RT_OPT_ADAMW ? "adamw" : "sgd";
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static void print_header(const RtTrainer *tr, int64_t first, int64_t last) {
  const RtModel *m = tr->model;
  const RtRanks *r = &tr->ranks;
  printf("# %s: %d parameter tensors, %zu floats; batch %lld, seqlen %lld, embed %lld; "
         "optimizer %s; seed %" PRIu64 "\n", m->name, m->nparams, m->param_floats,
         (long long)m->batch, (long long)m->seqlen, (long long)m->embed,
         optimizer_name(m->opt), m->seed);
  if (rt_grad_floats(m) < m->param_floats)
    printf("# trained: %zu floats (%.2f %%), the rest frozen (no gradient, no optimizer state)\n", rt_grad_floats(m),
           100.0 * (double)rt_grad_floats(m) / (double)m->param_floats);
  if (m->device)
    printf("# device: %s\n", m->device->describe());
  else
    printf("# threads: %d per rank, each GEMM in %d piece%s; vector path %s\n", rt_threads(), rt_gemm_pieces(),
           rt_gemm_pieces() == 1 ? "" : "s", rt_vector_name(rt_vector_path()));
  if (r->world > 1)
    printf("# %d ranks: dp %d, mp %d, ep %d, esp %d; global batch %lld samples; figures "
           "reduced over the ranks, time of the slowest\n", r->world, r->dp, r->mp, r->ep,
           r->esp, (long long)(r->dp * m->batch));
  if (m->layout_note)
    printf("# layout: %s\n", m->layout_note);
  if (first <= last && m->vocab > 0)
    printf("# steps %lld..%lld, vocab %lld, tokens: %s%s%s\n", (long long)first, (long long)last,
           (long long)m->vocab, tr->lm.source ? tr->lm.source : "synthetic (arithmetic sequences, runtime/data.c)",
           tr->lm.has_val ? "; validation: " : "", tr->lm.has_val ? tr->lm.val_source : "");
  else if (first <= last)
    printf("# steps %lld..%lld, data: %s\n", (long long)first, (long long)last,
           tr->fixed_data ? "from .npy files" : "synthetic");
}

// The learning-rate schedule and the clipping of step t: st->lr_scale and st->grad_scale. The
// global gradient norm (after the reductions, so the same on every layout) is computed when the
// report (a language model's) or clipping needs it; NAN otherwise.
static int schedule_step(RtTrainer *tr, int64_t t, double *gnorm) {
  const RtModel *m = tr->model;
  RtStep *st = &tr->st;
  st->lr_scale = (float)rt_lr_scale(m, t);
  st->grad_scale = 1.0f;
  *gnorm = NAN;
  if (m->vocab <= 0 && m->clip <= 0)
    return 0;
  if (rt_device_get(tr, RT_DEVICE_GRADS) != 0)
    return -1;
  *gnorm = rt_grad_norm(m, &tr->ranks, tr->comm, st->grads, tr->pp_skip);
  st->grad_scale = (float)rt_clip_scale(*gnorm, m->clip);
  return 0;
}

// The mean cross-entropy over the validation windows, in whole global batches. Collective.
static double evaluate(RtTrainer *tr) {
  const RtModel *m = tr->model;
  int64_t batches = rt_lm_val_batches(&tr->lm, tr->ranks.dp);
  double sum = 0;
  for (int64_t b = 0; b < batches; b++) {
    rt_lm_fill_val(&tr->lm, b, tr->ranks.dp_index * m->batch, tr->ranks.dp, (int32_t *)tr->input,
                   (int32_t *)tr->target);
    if (tr->ranks.stages > 1)
      rt_pipe_forward(tr);
    else
      m->forward(&tr->st);
    sum += rt_report_reduce(tr, &tr->st, NULL).mse;
  }
  return sum / (double)batches;
}

static bool eval_due(const RtTrainer *tr, int64_t t, int64_t last) {
  if (!tr->lm_open || !tr->lm.has_val)
    return false;
  return t == last || (tr->opt.eval_every > 0 && t % tr->opt.eval_every == 0);
}

// The steps a run trains, first..last, and how its lines are shown.
typedef struct Steps {
  int64_t first, last;
  bool progress;     // on a terminal one progress line rewrites itself instead of a line per step
  double started;    // ms (now_ms) when the first step began
} Steps;

// After step t: the validation loss when it is due, printed by rank 0 and logged. Collective.
static int evaluate_step(RtTrainer *tr, int64_t t, const Steps *run) {
  if (!eval_due(tr, t, run->last))
    return 0;
  const RtModel *m = tr->model;
  bool root = rt_is_root(tr);
  double val = evaluate(tr);
  int64_t windows = rt_lm_val_batches(&tr->lm, tr->ranks.dp) * tr->ranks.dp * m->batch;
  if (root)
    printf("%sval %lld  ce %.6f  (%lld window%s)\n", run->progress && t < run->last ? "\n" : "", (long long)t, val,
           (long long)windows, windows == 1 ? "" : "s");
  if (tr->opt.log && rt_world_agree(tr->comm, root ? rt_log_eval(tr->log, t, val, windows) : 0) != 0)
    return -1;
  return 0;
}

// The auxiliary losses the objective has (a coefficient above 0), unweighted, summed over layers.
static void print_aux_parts(const RtModel *m, const RtReport *rep) {
  if (m->aux_in_loss) printf("  aux %.6f", rep->aux);
  if (m->z_in_loss) printf("  z %.6f", rep->z);
}

// Step t's line on rank 0 (none with --quiet): the progress line on a terminal, else a language
// model's figures or the others' with the experts' loads. ms: the step's compute time, the
// slowest rank's.
static void print_step(const RtTrainer *tr, int64_t t, const RtReport *rep, double gnorm, double ms,
                       const Steps *run) {
  const RtModel *m = tr->model;
  const RtStep *st = &tr->st;
  bool root = rt_is_root(tr);
  double loss = rep->loss;
  double dropped = rep->routed > 0 ? rep->dropped / rep->routed : 0.0;
  double tokens_per_s = ms > 0 ? (double)(rt_step_samples(tr) * m->seqlen) / (ms * 1e-3) : 0.0;
  if (run->progress) {
    rt_progress(stdout, t, run->first, run->last, loss, m->vocab > 0 ? tokens_per_s : 0, now_ms() - run->started);
  } else if (!tr->opt.quiet && root && m->vocab > 0) {
    double tokens = (double)(rt_step_samples(tr) * m->seqlen);
    // The objective's parts, then the timings last (tests compare the lines up to "  time").
    printf("step %lld  loss %.6f  ce %.6f", (long long)t, loss, rep->mse);
    print_aux_parts(m, rep);
    printf("  lr %.3e  gnorm %.4f  dropped %.4f  time %.3f ms  tok/s %.0f\n", m->lr * st->lr_scale, gnorm, dropped,
           ms, ms > 0 ? tokens / (ms * 1e-3) : 0.0);
    fflush(stdout);
  } else if (!tr->opt.quiet && root) {
    // Tokens per expert, min/mean/max over every expert of every layer (0/0.0/0 without MoE).
    bool loads = rep->load_count > 0;
    printf("step %lld  loss %.6f  mse %.6f", (long long)t, loss, rep->mse);
    print_aux_parts(m, rep);
    printf("  dropped %.4f  load min/mean/max %lld/%.1f/%lld", dropped,
           loads ? (long long)rep->load_min : 0LL, loads ? rep->load_sum / rep->load_count : 0.0,
           loads ? (long long)rep->load_max : 0LL);
    if (m->dropless)
      printf("  capacity %lld", (long long)rep->capacity_max);
    printf("  time %.3f ms\n", ms);
    fflush(stdout);
  }
}

// --profile: whole steps (from the data to the update) after the first, and the time of each
// class of work in them: GEMMs, attention, the update, each kind of collective.
typedef struct Profile {
  double *steps;                      // the counted steps' times, ms; NULL without --profile
  double *fwd_bwd, *updates;          // their forward and backward, and their update, ms
  int64_t n;                          // steps counted
  double gemm, total, comm, hidden;   // ms over the counted steps
  double attn, update;
  double kind[RT_PROF_KINDS];
  double pp_wait;                     // pipeline stages: ms this stage waited for the others
} Profile;

// A step begins: the collectives between steps (the step time's maximum over ranks, evaluations)
// are not its communication, so that a step's time in flight never exceeds the step.
static void profile_begin(Profile *p) {
  double ignored[2];
  if (p->steps) rt_prof_take(&ignored[0], &ignored[1], NULL);
}

// A step of ms ms ended: counted (every step after the first) or not, the collectives' record
// taken either way.
static void profile_step(Profile *p, bool counted, double ms, double fwd_bwd_ms, double update_ms) {
  if (!p->steps)
    return;
  if (!counted) {
    double ignored[2];
    rt_prof_take(&ignored[0], &ignored[1], NULL);
    return;
  }
  p->fwd_bwd[p->n] = fwd_bwd_ms, p->updates[p->n] = update_ms;
  p->steps[p->n++] = ms;
  p->total += ms;
  p->gemm += (double)rt_gemm_ns_take() * 1e-6;
  p->attn += (double)rt_attn_ns_take() * 1e-6;
  p->update += update_ms;
  double comm_ms, hidden_ms, kind[RT_PROF_KINDS];
  rt_prof_take(&comm_ms, &hidden_ms, kind);
  p->comm += comm_ms;
  p->hidden += hidden_ms;
  for (int k = 0; k < RT_PROF_KINDS; k++) p->kind[k] += kind[k];
}

// The classes of a step's work, ms per counted step: what moec plan -v predicts per class
// (passes/cost.c) beside it. Kernel and collective times are sums over the threads and streams
// (work that overlaps counts twice); the rest is the mean step less the GEMMs, attention, the
// update and the communication not hidden.
static void profile_classes(const Profile *p) {
  double n = (double)p->n, gemm = p->gemm / n, attn = p->attn / n, update = p->update / n;
  double exposed = (p->comm - p->hidden) / n, rest = p->total / n - gemm - attn - update - exposed;
  printf("# profile: per class, ms a step: GEMM %.3f, attention %.3f, update %.3f, AlltoAll %.3f, AllGather %.3f, "
         "ReduceScatter %.3f, AllReduce %.3f, other collectives %.3f, the rest %.3f (element-wise and row-wise kernels, "
         "copies, waits: the mean step %.3f less the GEMMs, attention, update and communication not hidden)\n",
         gemm, attn, update, p->kind[RT_PROF_ALLTOALL] / n, p->kind[RT_PROF_ALLGATHER] / n,
         p->kind[RT_PROF_REDUCESCATTER] / n, p->kind[RT_PROF_ALLREDUCE] / n, p->kind[RT_PROF_OTHER] / n,
         rest > 0 ? rest : 0.0, p->total / n);
}

// Pipeline stages: each stage's mean step and the part of it spent waiting for the messages of
// other stages (the bubble and the transfers), printed by the root. Collective over the stages.
static void profile_stages(const RtTrainer *tr, const Profile *p) {
  int P = tr->ranks.stages, s = tr->ranks.stage;
  double *v = calloc((size_t)(2 * P), sizeof *v);
  if (!v) return;
  if (p->n > 0) v[2 * s] = p->total / (double)p->n, v[2 * s + 1] = p->pp_wait / (double)p->n;
  rt_pp_sum_f64(tr->comm, v, 2 * P);
  for (int k = 0; rt_is_root(tr) && p->n > 0 && k < P; k++)
    printf("# profile: stage %d: %.3f ms a step, of which %.3f ms (%.1f %%) waiting for the other stages\n", k,
           v[2 * k], v[2 * k + 1], v[2 * k] > 0 ? 100.0 * v[2 * k + 1] / v[2 * k] : 0.0);
  free(v);
}

static void profile_print(const RtTrainer *tr, Profile *p, int64_t first, int64_t last) {
  if (p->steps && tr->ranks.stages > 1)
    profile_stages(tr, p);
  if (!p->steps || !rt_is_root(tr))
    return;
  if (p->n == 0) {
    printf("# profile: train at least 2 steps (the first is not counted)\n");
    return;
  }
  qsort(p->steps, (size_t)p->n, sizeof *p->steps, by_double);
  printf("# profile: steps %lld..%lld, median whole step %.3f ms (data, forward, backward, update), ",
         (long long)first + 1, (long long)last, p->steps[p->n / 2]);
  if (tr->model->device) {   // the GEMMs are cuBLAS's on the GPU's streams: no host clock sees them
    printf("GEMM share not measured on a GPU\n");
    // Each step function ends waiting for the GPU's streams, so the host's clock times what the
    // GPU did in it (and the launch of its graph).
    qsort(p->fwd_bwd, (size_t)p->n, sizeof *p->fwd_bwd, by_double);
    qsort(p->updates, (size_t)p->n, sizeof *p->updates, by_double);
    printf("# profile: median forward and backward %.3f ms, median update %.3f ms (each step function ends "
           "waiting for the GPU)\n", p->fwd_bwd[p->n / 2], p->updates[p->n / 2]);
  } else
    printf("GEMM %.1f %% of the steps' time (%.3f ms per step)\n", 100.0 * p->gemm / p->total, p->gemm / (double)p->n);
  // Communication as a mean per step beside the mean step (the median step above can be shorter
  // than the mean communication: a few slow steps raise the mean alone).
  if (tr->ranks.world > 1)
    printf("# profile: communication %.3f ms per step (%.1f %% of the mean step, %.3f ms), %.1f %% of it "
           "hidden behind computation\n", p->comm / (double)p->n, 100.0 * p->comm / p->total,
           p->total / (double)p->n, p->comm > 0 ? 100.0 * p->hidden / p->comm : 0.0);
  if (!tr->model->device)
    profile_classes(p);
}

// bytes as a person reads them: B, KiB, MiB, ... (moec's ir_bytes, for the runtime's lines).
static char *bytes_text(char *buf, size_t n, double bytes) {
  static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, u++;
  snprintf(buf, n, u ? "%.2f %s" : "%.0f %s", bytes, unit[u]);
  return buf;
}

// The run's last line on rank 0: what was trained, or why nothing was. After training: the
// tokens per second of the whole job over the wall time of its steps (evaluations included), and
// rank 0's peak resident memory (the process: libraries and OpenBLAS's buffers too) beside the
// memory plan's (parameters, gradients, optimizer moments, the activation arena and with dtype
// bf16 the parameters' bf16 copy; on a GPU those live in device memory).
// The memory plan of this rank: parameters, gradients, optimizer moments, an activation arena per
// microbatch in flight, the microbatches' second gradient buffer, the bf16 copy (bytes).
static double planned_bytes(const RtTrainer *tr) {
  const RtModel *m = tr->model;
  double param = (double)m->param_floats * sizeof(float), grad = (double)rt_grad_floats(m) * sizeof(float);
  double plan = (double)m->arena_bytes * (tr->slots > 1 ? tr->slots : 1) + param + grad + (double)m->param16_bytes;
  if (tr->grad_work)
    plan += grad;
  plan += (double)tr->share_floats * sizeof(float);
  if (m->opt == RT_OPT_ADAMW)
    plan += 2.0 * sizeof(float) * (double)rt_moment_floats(tr->comm, m);
  return plan;
}

// Pipeline stages: each stage's rank 0's peak resident memory beside its plan, printed by the
// root. Collective over the stages.
static void print_stage_memory(const RtTrainer *tr) {
  int P = tr->ranks.stages;
  double *v = calloc((size_t)(2 * P), sizeof *v);
  struct rusage ru;
  if (!v) return;
  if (getrusage(RUSAGE_SELF, &ru) == 0) v[2 * tr->ranks.stage] = (double)ru.ru_maxrss * 1024.0;
  v[2 * tr->ranks.stage + 1] = planned_bytes(tr);
  rt_pp_sum_f64(tr->comm, v, 2 * P);
  for (int s = 0; rt_is_root(tr) && s < P; s++) {
    char a[32], b[32];
    printf("# stage %d: peak memory %s (the memory plan: %s per rank; %d microbatch%s in flight at most)\n", s,
           bytes_text(a, sizeof a, v[2 * s]), bytes_text(b, sizeof b, v[2 * s + 1]), rt_pipe_slots(tr->stages[s]),
           rt_pipe_slots(tr->stages[s]) == 1 ? "" : "es");
  }
  free(v);
}

static void print_summary(const RtTrainer *tr, const Steps *run, bool convert, double loss) {
  if (tr->ranks.stages > 1 && run->first <= run->last)
    print_stage_memory(tr);
  if (!rt_is_root(tr))
    return;
  const RtModel *m = tr->model;
  double micro = m->microbatches > 1 ? m->microbatches : 1;
  if (run->first <= run->last) {
    int64_t steps = run->last - run->first + 1;
    double secs = (now_ms() - run->started) * 1e-3, tokens = (double)steps * rt_step_samples(tr) * m->seqlen;
    double plan = planned_bytes(tr);
    struct rusage ru;
    char peak[32] = "unknown", planned[32];
    if (getrusage(RUSAGE_SELF, &ru) == 0) bytes_text(peak, sizeof peak, (double)ru.ru_maxrss * 1024.0);
    printf("# trained %lld step%s; final loss %.6f; %.0f tokens/s over %.3g s; %.3g GFLOP/s per rank (%.3g GFLOP a "
           "step: its GEMMs and attention, forward and backward, the experts' over every slot); peak memory %s%s (the "
           "memory plan: %s per rank)\n", (long long)steps, steps > 1 ? "s" : "", loss, secs > 0 ? tokens / secs : 0.0,
           secs, secs > 0 ? m->step_flops * micro * (double)steps / secs * 1e-9 : 0.0, m->step_flops * micro * 1e-9, peak,
           m->device ? " on the host" : "", bytes_text(planned, sizeof planned, plan));
  }
  else if (convert && !tr->opt.quiet)
    printf("# --steps 0: nothing trained; the parameters stay at step %lld\n",
           (long long)tr->done_steps);
  else if (!tr->opt.quiet)
    printf("# nothing to train: the parameters are at step %lld and --steps is %lld\n",
           (long long)tr->done_steps, (long long)run->last);
}

static int train(RtTrainer *tr) {
  const RtModel *m = tr->model;
  RtStep *st = &tr->st;
  bool root = rt_is_root(tr);
  Steps run = {.first = tr->done_steps + 1, .last = tr->opt.steps};
  bool convert = tr->opt.resume && tr->opt.steps == 0;
  if (convert)
    run.last = tr->done_steps;
  int64_t first = run.first, last = run.last;
  if (!tr->opt.quiet && root)
    print_header(tr, first, last);
  double loss = NAN;
  Profile prof = {0};
  if (tr->opt.profile) {
    size_t n = (size_t)(last - first + 1 > 0 ? last - first + 1 : 1);
    prof.steps = calloc(n, sizeof *prof.steps), prof.fwd_bwd = calloc(n, sizeof *prof.fwd_bwd);
    prof.updates = calloc(n, sizeof *prof.updates);
    if (!prof.steps || !prof.fwd_bwd || !prof.updates) {
      free(prof.steps), free(prof.fwd_bwd), free(prof.updates);
      return rt_fail("out of memory for --profile's step times");
    }
  }
  rt_gemm_profile(prof.steps != NULL);
  rt_prof_enable(prof.steps != NULL);
  run.progress = !tr->opt.quiet && root && tr->opt.watched;
  if (first <= last && !m->device) {   // what every step writes, first touched by every thread
    size_t bytes = (rt_grad_floats(m) ? rt_grad_floats(m) : 1) * sizeof(float);
    rt_big_touch(st->grads, bytes);
    if (st->arena)
      rt_big_touch(st->arena, tr->arena_bytes);
    if (m->opt == RT_OPT_ADAMW && !tr->opt.resume)   // (a resume's load touched them)
      rt_touch_moments(tr->comm, m, st->opt_m, st->opt_v);
  }
  run.started = now_ms();
  for (int64_t t = first; t <= last; t++) {
    profile_begin(&prof);
    double t_start = now_ms();
    rt_gemm_ns_take();
    rt_attn_ns_take();
    double t0 = now_ms();
    RtStep forward_state;   // the statistics the forwards left, in case backward adds any
    if (rt_pipe_step(tr, t, &forward_state) != 0)
      return -1;
    double t1 = now_ms();
    RtReport rep = rt_report_reduce(tr, &forward_state, NULL);
    if (tr->opt.dump && t == first && rt_dump_step(tr, &rep) != 0)
      return -1;
    double gnorm;
    if (schedule_step(tr, t, &gnorm) != 0)
      return -1;
    double t2 = now_ms();
    m->update(st);
    double t3 = now_ms();
    if (prof.steps && t > first)
      prof.pp_wait += (double)tr->pp_wait_ns * 1e-6;
    tr->pp_wait_ns = 0;
    profile_step(&prof, t > first, t3 - t_start, t1 - t0, t3 - t2);
    tr->done_steps = t;
    double ms = (t1 - t0) + (t3 - t2);
    rt_world_max(tr->comm, &ms, 1);
    loss = rep.loss;
    if (st->record)
      fflush(st->record);
    double tokens_per_s = ms > 0 ? (double)(rt_step_samples(tr) * m->seqlen) / (ms * 1e-3) : 0.0;
    if (log_step(tr, &forward_state, &rep, t, gnorm, ms, m->vocab > 0 ? tokens_per_s : 0) != 0)
      return -1;
    print_step(tr, t, &rep, gnorm, ms, &run);
    if (!isfinite(loss))
      return rt_fail("the loss is %f at step %lld; training diverged (try a smaller learning "
                     "rate)", loss, (long long)t);
    if (evaluate_step(tr, t, &run) != 0)
      return -1;
  }
  rt_gemm_profile(false);
  rt_prof_enable(false);
  profile_print(tr, &prof, first, last);
  free(prof.steps), free(prof.fwd_bwd), free(prof.updates);
  print_summary(tr, &run, convert, loss);
  return 0;
}

// ---- the record hook's file ----

// A model with a record hook writes to --record FILE, by default MODEL.record.jsonl in the
// current directory (rank R > 0 of several: FILE.rank<R>); a fresh run starts the file anew, a
// resumed one appends to it.
static int open_record(RtTrainer *tr) {
  const RtModel *m = tr->model;
  if (!m->records) {
    if (tr->opt.record && !tr->opt.quiet && rt_is_root(tr))
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

// ---- entry point ----

// Everything after the collectives started: every rank runs it, and every failure is agreed
// on, so all ranks return the same status. Rank 0 prints.
static int run(const RtModel *model, const RtOptions *opt, const RtRanks *ranks, RtComm *comm,
               const RtModel *const *stages, int nstages) {
  RtTrainer tr;
  int status = rt_world_agree(comm, trainer_create(&tr, model, opt, ranks, comm, stages, nstages));
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
    if (status == 0 && opt->adapter)   // a PEFT adapter over the weights' adapters (runtime/hf.c)
      status = rt_hf_adapter_load(opt->adapter, model, stages, nstages, ranks, tr.st.params);
    if (status == 0)
      rt_fault_scale(model, rt_all_rank(comm), tr.st.params);
    status = rt_world_agree(comm, status);
    if (status == 0)
      status = rt_device_put(&tr, RT_DEVICE_PARAMS | RT_DEVICE_MOMENTS);
  }
  if (status == 0 && model->vocab > 0) {
    RtLmOptions lo = {.data = opt->data, .val = opt->val, .input = opt->input, .val_windows = opt->val_windows};
    status = rt_world_agree(comm, rt_lm_open(&tr.lm, model, ranks, &lo));
    tr.lm_open = true;
    tr.fixed_data = opt->input != NULL;
    if (status == 0 && tr.lm.has_val && rt_lm_val_batches(&tr.lm, ranks->dp) == 0)
      status = rt_fail("the validation file '%s' holds %lld window%s of %lld tokens; one global batch needs %lld",
                       tr.lm.val_source, (long long)tr.lm.val_count, tr.lm.val_count == 1 ? "" : "s",
                       (long long)(model->seqlen + 1),
                       (long long)(ranks->dp * model->batch));
  } else if (status == 0 && opt->input) {
    tr.fixed_data = true;
    status = rt_world_agree(comm, rt_load_data(&tr));
  }
  if (status == 0 && opt->check_grad) {
    status = rt_check_grad(&tr);
    if (status < 0 && ranks->rank == 0 && ranks->stage == 0)
      report_error();
    fflush(stdout);
    trainer_destroy(&tr);
    return status != 0;
  }
  // --resume C --sample N without --steps: sample from C as it is.
  if (status == 0 && opt->resume && opt->sample > 0 && !opt->steps_given)
    tr.opt.steps = tr.done_steps;
  if (status == 0 && tr.done_steps > tr.opt.steps && tr.opt.steps > 0)
    status = rt_fail("checkpoint '%s' is at step %lld, past --steps %lld", opt->resume,
                     (long long)tr.done_steps, (long long)tr.opt.steps);
  if (status == 0)
    status = rt_world_agree(comm, open_record(&tr));
  if (status == 0)
    status = train(&tr);
  // What the run was asked to write, then the sample (so that nothing trained is lost to it).
  if (status == 0 && (opt->save || opt->export_hf))
    status = rt_device_get(&tr, RT_DEVICE_PARAMS | RT_DEVICE_MOMENTS);
  if (status == 0 && opt->save)
    status = rt_checkpoint_save(comm, opt->save, model, ranks, tr.done_steps, tr.st.params,
                                tr.st.opt_m, tr.st.opt_v, tr.pp_skip);
  if (status == 0 && opt->export_hf)
    status = rt_dump_hf(&tr, opt->export_hf);
  if (status == 0 && opt->sample > 0)
    status = rt_sample(&tr);
  fflush(stdout);
  trainer_destroy(&tr);
  if (status == 0)
    return 0;
  return ranks->rank == 0 && ranks->stage == 0 ? report_error() : 1;
}

// The step's kernels allocate their scratch per call (attention's transposes, a few MB each):
// glibc serves blocks that large with a fresh mmap and gives them back on free, so every call
// paid its page faults again (3 % of the mid-size language model's step in clear_page). Up to
// the largest threshold glibc takes (32 MiB) they come from the heap, which is not trimmed:
// the pages are faulted once and reused every step.
static void keep_heap_pages(void) {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

// rt_main and rt_main_stages: stages[s] is the program of stage s of nstages (model itself when 1).
static int main_of(const RtModel *model, const RtModel *const *stages, int nstages, int argc, char **argv) {
  rt_blas_kernels();
  keep_heap_pages();
  const char *prog = argc > 0 && argv[0] ? argv[0] : "model";
  bool speaker = launcher_rank_zero();
  rt_clear_error();
  RtOptions opt;
  if (rt_options_parse(argc, argv, &opt) != 0) {
    if (speaker) {
      fprintf(stderr, "moert: error: %s\n", rt_last_error());
      rt_options_usage(stderr, model, prog);
    }
    return EXIT_USAGE;
  }
  if (opt.help) {
    if (speaker)
      rt_options_usage(stdout, model, prog);
    return 0;
  }
  if (rt_model_check(model) != 0 || rt_options_check(model, &opt) != 0)
    return speaker ? report_error() : 1;
  char why[200];
  if (rt_vector_check(why, sizeof why) != 0) {
    if (speaker)
      fprintf(stderr, "moert: error: %s\n", why);
    return 1;
  }
  if (opt.comm_timeout >= 0)
    rt_comm_set_timeout(opt.comm_timeout);
  opt.watched = stdout_watched();
  // rt_comm_create reports a layout that does not fit the world itself, once.
  RtLayout layout = model->layout;
  layout.pp = nstages;
  RtComm *comm = rt_comm_create(&layout, model->nodes);
  if (!comm)
    return 1;
  if (nstages > 1) {   // this rank's stage's program
    model = stages[rt_comm_stage(comm)];
    if (rt_world_agree(comm, rt_model_check(model)) != 0) {
      rt_comm_destroy(comm);
      return speaker ? report_error() : 1;
    }
  }
  RtRanks ranks = rt_ranks_of(&model->layout, rt_comm_rank(comm, RT_GROUP_WORLD),
                              rt_comm_size(comm, RT_GROUP_WORLD));
  ranks.stage = rt_comm_stage(comm);
  ranks.stages = rt_comm_stages(comm);
  // Ranks sharing a machine share its cores: each rank's threads (kernels and GEMMs) get its
  // share, or the threads of all ranks oversubscribe the cores many times over.
  const char *local = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  rt_threads_setup(ranks.world > 1 && local ? atol(local) : 1);
  if (ranks.world > 1 && ranks.rank == 0 && ranks.stage == 0 && !opt.quiet) {
    rt_comm_print_groups(comm, stdout);
    fflush(stdout);
  }
  int status = run(model, &opt, &ranks, comm, nstages > 1 ? stages : NULL, nstages);
  rt_comm_destroy(comm);
  return status;
}

int rt_main(const RtModel *model, int argc, char **argv) { return main_of(model, &model, 1, argc, argv); }

int rt_main_stages(const RtModel *const *stages, int nstages, int argc, char **argv) {
  return main_of(stages[0], stages, nstages, argc, argv);
}
