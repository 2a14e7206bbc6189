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

#include "rt_hf.h"
#include "rt_internal.h"
#include "rt_log.h"

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
  const char *export_hf;        // --export-hf DIR: the model as a Hugging Face checkpoint
  const char *log;              // --log F.jsonl: a JSON line per step and per evaluation
  bool steps_given;             // --steps was on the command line
  bool watched;                 // a person watches stdout: one progress line (rt_main, before MPI starts)
  bool check_grad, quiet, help, profile;
  // language models (runtime/lm.c)
  const char *data, *val, *prompt;
  int64_t eval_every, val_windows, sample;
  double temperature;
  double comm_timeout;          // seconds; < 0: not given
} Options;

static void usage(FILE *out, const RtModel *model, const char *prog) {
  fprintf(out,
          "usage: %s [--steps N] [--weights W.safetensors] [--save C.safetensors] [--resume C]\n"
          "       %*s [--input x.npy] [--target t.npy] [--dump DIR] [--record FILE]\n"
          "       %*s [--check-grad] [--quiet] [--profile] [--comm-timeout S] [--log F.jsonl]\n"
          "       %*s [--export-hf DIR]\n"
          "Trains the MoE model '%s' (inputs [%lld, %lld, %lld] per data-parallel rank) and "
          "prints one line per step\n(on a terminal, one progress line that rewrites itself).\n"
          "  --steps N        train until step N, counting resumed steps (default 20); with "
          "--resume,\n"
          "                   0 trains nothing: --steps 0 --resume C --save D converts checkpoint "
          "C\n"
          "                   (written on any number of ranks) to this run's layout\n"
          "  --weights W      load the parameters from W: a safetensors file of whole tensors "
          "(F32, BF16,\n"
          "                   F16 or F64), a Hugging Face index or folder of them, or a "
          "checkpoint\n"
          "  --save C         after the last step, write a checkpoint: the index file C and one "
          "shard per\n"
          "                   rank, C.rank<R>-of-<P>.safetensors (each written atomically)\n"
          "  --export-hf DIR  after the last step, write the parameters as a Hugging Face "
          "checkpoint:\n"
          "                   DIR/config.json and DIR/model.safetensors (F32, the family's names; "
          "--steps 0\n"
          "                   --weights W converts W)\n"
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
          "A language model (one with a vocabulary) also takes:\n"
          "  --data F         train on the token file F (llm.c's .bin by its header, .txt: "
          "bytes, else\n"
          "                   little-endian uint16); --input X instead gives the windows: "
          "int32 [dp*B, L+1]\n"
          "  --val F          validation tokens: consecutive windows from the start of F\n"
          "  --eval-every K   print the validation loss every K steps and after the last "
          "(default: the last)\n"
          "  --val-windows N  use at most N validation windows (default: all, in whole global "
          "batches)\n"
          "  --sample N       after training, generate N tokens (a byte model prints text); with "
          "--resume C\n"
          "                   and no --steps it samples from C without training\n"
          "  --prompt TEXT    the text the sample continues (default: a newline)\n"
          "  --temperature T  sampling temperature (default 1; 0 takes the likeliest token)\n"
          "  --quiet          do not print the per-step lines\n"
          "  --log F.jsonl    write one JSON line per step (loss, ce or mse, aux, z, lr, grad "
          "norm,\n"
          "                   tokens/s, time, drops, per routed layer its loads and drops) and "
          "per evaluation\n"
          "  --profile        after training, the median whole step (data, forward, backward,\n"
          "                   update) of steps 2..N, its share in GEMMs, and the time collectives\n"
          "                   were in flight per step with the share of it hidden behind\n"
          "                   computation (rank 0's)\n"
          "  --comm-timeout S end the job when a collective has not completed after S seconds\n"
          "                   (a cut link, a dead rank; default 20, 0 waits forever)\n"
          "  --help           print this message\n",
          prog, (int)strlen(prog), "", (int)strlen(prog), "", (int)strlen(prog), "", model->name,
          (long long)model->batch, (long long)model->seqlen, (long long)model->embed, model->name);
}

static int by_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

// A number in [0, max] (all of text), into *out; -1 otherwise.
static int parse_nonneg(const char *text, double max, double *out) {
  char *end;
  errno = 0;
  double v = strtod(text, &end);
  if (errno || *end || end == text || !(v >= 0) || v > max)
    return -1;
  *out = v;
  return 0;
}

// options = ("--steps" N | "--weights" W | "--save" C | "--resume" C | "--input" X
//            | "--target" T | "--dump" DIR | "--record" FILE | "--check-grad" | "--quiet"
//            | "--help")*
// A value may also follow "=": --steps=5.
static int parse_options(int argc, char **argv, Options *o) {
  *o = (Options){.steps = 20, .temperature = 1.0, .comm_timeout = -1};
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
    if (strcmp(arg, "--profile") == 0) {
      o->profile = true;
      continue;
    }
    if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
      o->help = true;
      continue;
    }
    static const char *const valued[] = {"--steps", "--weights", "--save", "--resume",
                                         "--input", "--target",  "--dump", "--record",
                                         "--data", "--val", "--prompt", "--eval-every",
                                         "--val-windows", "--sample", "--temperature",
                                         "--comm-timeout", "--export-hf", "--log"};
    const char **slots[] = {NULL,       &o->weights, &o->save, &o->resume,
                            &o->input, &o->target,  &o->dump, &o->record,
                            &o->data,  &o->val,     &o->prompt, NULL,
                            NULL,      NULL,        NULL,
                            NULL,      &o->export_hf, &o->log};
    int64_t *counts[] = {&o->steps, &o->eval_every, &o->val_windows, &o->sample};
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
    if (which == 0 || (which >= 11 && which <= 13)) {
      char *end;
      errno = 0;
      long long n = strtoll(value, &end, 10);
      if (errno || *end || end == value || n < 0 || n > INT32_MAX)
        return rt_fail("%s needs a whole number between 0 and %d, not '%s'", valued[which],
                       INT32_MAX, value);
      *counts[which == 0 ? 0 : which - 10] = n;
      o->steps_given |= which == 0;
    } else if (which == 14) {
      if (parse_nonneg(value, 1e6, &o->temperature) != 0)
        return rt_fail("--temperature needs a number of at least 0, not '%s'", value);
    } else if (which == 15) {
      if (parse_nonneg(value, 1e7, &o->comm_timeout) != 0)
        return rt_fail("--comm-timeout needs a number of seconds of at least 0, not '%s'", value);
    } else {
      *slots[which] = value;
    }
  }
  if (o->weights && o->resume)
    return rt_fail("--weights and --resume cannot be combined (a checkpoint holds the weights)");
  if (o->target && !o->input)
    return rt_fail("--target needs --input (the synthetic input changes every step)");
  if (o->export_hf && o->log && strcmp(o->export_hf, o->log) == 0)
    return rt_fail("--log and --export-hf name the same path '%s'", o->log);
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
              p->shard_esp < p->rank && (p->shard_ep < 0 || p->shard_ep != p->shard_esp) &&
              p->shard_mp >= -1 && p->shard_mp < p->rank &&
              (p->shard_mp < 0 || (p->shard_ep < 0 && p->shard_esp < 0));
    for (int d = 0; ok && d < p->rank; d++) {
      int64_t whole = p->dims[d] * (d == p->shard_ep ? l->ep : 1) *
                      (d == p->shard_esp ? l->esp : 1) * (d == p->shard_mp ? l->mp : 1);
      ok = p->global_dims[d] == whole;
    }
    if (!ok) {
      char shard[160], whole[160];
      return rt_fail("internal error: parameter '%s' of model '%s': shard %s, whole tensor %s, "
                     "split dimensions %d (ep %d), %d (esp %d) and %d (mp %d) do not fit together",
                     p->name, m->name, rt_shape_str(shard, sizeof shard, p->rank, p->dims),
                     rt_shape_str(whole, sizeof whole, p->rank, p->global_dims), p->shard_ep,
                     l->ep, p->shard_esp, l->esp, p->shard_mp, l->mp);
    }
  }
  return 0;
}

// The options of language models need one, and --target does not apply to one.
static int check_options(const RtModel *m, const Options *o) {
  if (o->export_hf && !m->hf_config)
    return rt_fail("--export-hf: model '%s' cannot be written as a Hugging Face checkpoint: %s", m->name,
                   m->hf_refusal ? m->hf_refusal : "it was built by a moec that does not know the families");
  if (m->vocab > 0 && o->target)
    return rt_fail("--target does not apply to language model '%s': the targets are the next tokens "
                   "of the --input windows", m->name);
  if (m->vocab > 0)
    return 0;
  const char *lm_only = o->data ? "--data" : o->val ? "--val" : o->prompt ? "--prompt" : o->sample ? "--sample"
                        : o->eval_every ? "--eval-every" : o->val_windows ? "--val-windows" : NULL;
  if (lm_only)
    return rt_fail("%s applies to language models; model '%s' has no vocabulary (it trains on float "
                   "inputs)", lm_only, m->name);
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
  RtLm lm;                 // a language model's data (model->vocab > 0)
  bool lm_open;
  RtLog *log;              // --log (rank 0; NULL elsewhere and without it)
  RtLogLayer *log_layers;  // per routed layer, the step's reduced statistics (--log)
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
  if (tr->lm_open)
    rt_lm_close(&tr->lm);
  rt_log_close(tr->log);
  free(tr->log_layers);
  free(tr->st.layer_stats);
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
  // A language model's input and target are int32 tokens, one per position, at the start of
  // buffers of the float size (a device copies the whole buffers).
  tr->input = rt_calloc((size_t)tr->elems, sizeof(float), "the step's input");
  tr->target = rt_calloc((size_t)tr->elems, sizeof(float), "the step's target");
  st->lr_scale = 1.0f;
  st->grad_scale = 1.0f;
  // Zeroed once so that a plan that reads a buffer before writing it is at least deterministic.
  if (st->arena)
    memset(st->arena, 0, arena ? arena : 64);
  st->input = tr->input;
  st->target = tr->target;
  if (tr->opt.log && model->nlayers > 0) {   // every rank keeps them: --log reduces them over the world
    st->max_layer_stats = model->nlayers;
    st->layer_stats = rt_calloc((size_t)model->nlayers, sizeof *st->layer_stats, "the layers' statistics");
    tr->log_layers = rt_calloc((size_t)model->nlayers, sizeof *tr->log_layers, "the layers' statistics");
  }
  if (tr->opt.log && tr->ranks.rank == 0 && !(tr->log = rt_log_open(tr->opt.log)))
    return -1;
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
  const RtModel *m = tr->model;
  if (m->vocab > 0) {
    rt_lm_fill(&tr->lm, step, tr->ranks.dp_index * m->batch, (int32_t *)tr->input, (int32_t *)tr->target);
    return;
  }
  if (tr->fixed_data)
    return;
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


// A language model's part of the dump (DESIGN §2.1): tokens.npy (int32 [dp*B, L+1], each window),
// logits.npy [dp*B, L, V] and ce.npy. Collective; whole holds dp*B*L*V floats.
static int dump_lm(Trainer *tr, const Report *rep, float *whole, char *path, size_t len, int status) {
  const RtModel *m = tr->model;
  const RtRanks *r = &tr->ranks;
  bool root = is_root(tr);
  int64_t L = m->seqlen, tokens = m->batch * L, rows = r->dp * m->batch;
  int32_t *windows = root ? rt_alloc((size_t)(rows * (L + 1)) * sizeof(int32_t), "the --dump tokens") : NULL;
  rt_gather_dp(tr->comm, r, tr->input, tokens, whole);
  for (int64_t b = 0; root && b < rows; b++)
    memcpy(windows + b * (L + 1), (const int32_t *)whole + b * L, (size_t)L * sizeof(int32_t));
  rt_gather_dp(tr->comm, r, tr->target, tokens, whole);
  for (int64_t b = 0; root && b < rows; b++)
    windows[b * (L + 1) + L] = ((const int32_t *)whole)[b * L + L - 1];
  if (root && status == 0) {
    snprintf(path, len, "%s/tokens.npy", tr->opt.dump);
    status = rt_npy_write(path, RT_DTYPE_I32, 2, (int64_t[]){rows, L + 1}, windows);
  }
  free(windows);
  rt_gather_dp(tr->comm, r, tr->st.output, tokens * m->vocab, whole);
  if (root && status == 0) {
    snprintf(path, len, "%s/logits.npy", tr->opt.dump);
    status = rt_npy_write(path, RT_DTYPE_F32, 3, (int64_t[]){rows, L, m->vocab}, whole);
  }
  if (root && status == 0) {
    snprintf(path, len, "%s/ce.npy", tr->opt.dump);
    status = rt_npy_write(path, RT_DTYPE_F64, 0, NULL, &rep->mse);
  }
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
  int64_t tokens = m->batch * m->seqlen, logits = tokens * m->vocab;
  size_t whole_floats = (size_t)(r->dp * (tr->elems > logits ? tr->elems : logits));
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
  if (m->vocab > 0) {
    status = dump_lm(tr, rep, whole, path, len, status);
  } else {
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

// --export-hf DIR: every parameter gathered whole on rank 0, which writes the checkpoint.
// Collective.
static int export_hf(Trainer *tr, const char *dir) {
  const RtModel *m = tr->model;
  const RtRanks *r = &tr->ranks;
  bool root = r->rank == 0;
  float **whole = root ? rt_calloc((size_t)m->nparams, sizeof *whole, "the parameters of a checkpoint") : NULL;
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *p = &m->params[i];
    if (root) whole[i] = rt_alloc((size_t)rt_param_global_numel(p) * sizeof(float), "a parameter of a checkpoint");
    rt_gather_param(tr->comm, p, r, tr->st.params + p->offset, root ? whole[i] : NULL);
  }
  int status = root ? rt_hf_export(m, whole, dir) : 0;
  if (root && status == 0 && !tr->opt.quiet)
    printf("# wrote %s/config.json and %s/model.safetensors (Hugging Face)\n", dir, dir);
  for (int i = 0; root && i < m->nparams; i++) free(whole[i]);
  free(whole);
  return rt_world_agree(tr->comm, status);
}

// --log: the step's line, its per-layer statistics reduced over the world (collective).
static int log_step(Trainer *tr, const RtStep *fwd, const Report *rep, int64_t t, double gnorm, double ms,
                    double tokens_per_s) {
  if (!tr->opt.log)
    return 0;
  int n = fwd->layer_stats ? fwd->nlayer_stats : 0;
  double *sums = rt_calloc((size_t)(6 * n + 1), sizeof *sums, "the layers' statistics"), *maxes = sums + 4 * n;
  for (int i = 0; i < n; i++) {
    const RtLayerStats *l = &fwd->layer_stats[i];
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
  for (int i = 0; i < n; i++)
    tr->log_layers[i] = (RtLogLayer){.load_min = sums[4 * i + 1] > 0 ? -maxes[2 * i] : 0,
                                     .load_mean = sums[4 * i + 1] > 0 ? sums[4 * i] / sums[4 * i + 1] : 0,
                                     .load_max = maxes[2 * i + 1],
                                     .dropped = sums[4 * i + 3] > 0 ? sums[4 * i + 2] / sums[4 * i + 3] : 0};
  free(sums);
  if (tr->ranks.rank != 0)
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
static int schedule_step(Trainer *tr, int64_t t, double *gnorm) {
  const RtModel *m = tr->model;
  RtStep *st = &tr->st;
  st->lr_scale = (float)rt_lr_scale(m, t);
  st->grad_scale = 1.0f;
  *gnorm = NAN;
  if (m->vocab <= 0 && m->clip <= 0)
    return 0;
  if (device_get(tr, RT_DEVICE_GRADS) != 0)
    return -1;
  *gnorm = rt_grad_norm(m, &tr->ranks, tr->comm, st->grads);
  st->grad_scale = (float)rt_clip_scale(*gnorm, m->clip);
  return 0;
}

// The mean cross-entropy over the validation windows, in whole global batches. Collective.
static double evaluate(Trainer *tr) {
  const RtModel *m = tr->model;
  int64_t batches = rt_lm_val_batches(&tr->lm, tr->ranks.dp);
  double sum = 0;
  for (int64_t b = 0; b < batches; b++) {
    rt_lm_fill_val(&tr->lm, b, tr->ranks.dp_index * m->batch, tr->ranks.dp, (int32_t *)tr->input,
                   (int32_t *)tr->target);
    m->forward(&tr->st);
    sum += reduce_report(tr, &tr->st, NULL).mse;
  }
  return sum / (double)batches;
}

static bool eval_due(const Trainer *tr, int64_t t, int64_t last) {
  if (!tr->lm_open || !tr->lm.has_val)
    return false;
  return t == last || (tr->opt.eval_every > 0 && t % tr->opt.eval_every == 0);
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
  // --profile: whole steps (from the data to the update) after the first, and their GEMM time.
  int64_t nprof = 0;
  double *prof = tr->opt.profile ? calloc((size_t)(last - first + 1 > 0 ? last - first + 1 : 1), sizeof *prof) : NULL;
  double prof_gemm = 0, prof_total = 0, prof_comm = 0, prof_hidden = 0;
  rt_gemm_profile(prof != NULL);
  rt_prof_enable(prof != NULL);
  // On a terminal one progress line rewrites itself instead of a line per step.
  bool progress = !tr->opt.quiet && root && tr->opt.watched;
  double started = now_ms();
  for (int64_t t = first; t <= last; t++) {
    double t_start = now_ms();
    rt_gemm_ns_take();
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
    double gnorm;
    if (schedule_step(tr, t, &gnorm) != 0)
      return -1;
    double t2 = now_ms();
    m->update(st);
    double t3 = now_ms();
    if (prof && t > first) {
      prof[nprof++] = t3 - t_start;
      prof_total += t3 - t_start;
      prof_gemm += (double)rt_gemm_ns_take() * 1e-6;
      double comm_ms, hidden_ms;
      rt_prof_take(&comm_ms, &hidden_ms);
      prof_comm += comm_ms;
      prof_hidden += hidden_ms;
    } else if (prof) {
      double ignored[2];
      rt_prof_take(&ignored[0], &ignored[1]);
    }
    tr->done_steps = t;
    double ms = (t1 - t0) + (t3 - t2);
    rt_world_max(tr->comm, &ms, 1);
    loss = rep.loss;
    double dropped = rep.routed > 0 ? rep.dropped / rep.routed : 0.0;
    if (st->record)
      fflush(st->record);
    double tokens_per_s = ms > 0 ? (double)(tr->ranks.dp * m->batch * m->seqlen) / (ms * 1e-3) : 0.0;
    if (log_step(tr, &forward_state, &rep, t, gnorm, ms, m->vocab > 0 ? tokens_per_s : 0) != 0)
      return -1;
    if (progress) {
      rt_progress(stdout, t, first, last, loss, m->vocab > 0 ? tokens_per_s : 0, now_ms() - started);
    } else if (!tr->opt.quiet && root && m->vocab > 0) {
      double tokens = (double)(tr->ranks.dp * m->batch * m->seqlen);
      // The timings last (tests compare the lines up to "  time").
      printf("step %lld  loss %.6f  ce %.6f  aux %.6f  z %.6f  lr %.3e  gnorm %.4f  dropped %.4f  "
             "time %.3f ms  tok/s %.0f\n", (long long)t, loss, rep.mse, rep.aux, rep.z,
             m->lr * st->lr_scale, gnorm, dropped, ms, ms > 0 ? tokens / (ms * 1e-3) : 0.0);
      fflush(stdout);
    } else if (!tr->opt.quiet && root) {
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
    if (eval_due(tr, t, last)) {
      double val = evaluate(tr);
      int64_t windows = rt_lm_val_batches(&tr->lm, tr->ranks.dp) * tr->ranks.dp * m->batch;
      if (root)
        printf("%sval %lld  ce %.6f  (%lld windows)\n", progress && t < last ? "\n" : "", (long long)t, val,
               (long long)windows);
      if (tr->opt.log && rt_world_agree(tr->comm, root ? rt_log_eval(tr->log, t, val, windows) : 0) != 0)
        return -1;
    }
  }
  rt_gemm_profile(false);
  rt_prof_enable(false);
  if (prof && root && nprof > 0) {
    qsort(prof, (size_t)nprof, sizeof *prof, by_double);
    printf("# profile: steps %lld..%lld, median whole step %.3f ms (data, forward, backward, update), "
           "GEMM %.1f %% of the steps' time (%.3f ms per step)\n", (long long)first + 1, (long long)last,
           prof[nprof / 2], 100.0 * prof_gemm / prof_total, prof_gemm / (double)nprof);
    if (tr->ranks.world > 1)
      printf("# profile: communication %.3f ms per step (%.1f %% of the steps' time), %.1f %% of it "
             "hidden behind computation\n", prof_comm / (double)nprof, 100.0 * prof_comm / prof_total,
             prof_comm > 0 ? 100.0 * prof_hidden / prof_comm : 0.0);
  } else if (prof && root) {
    printf("# profile: train at least 2 steps (the first is not counted)\n");
  }
  free(prof);
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

// ---- --sample ----

// The prompt as tokens: its bytes for a byte model (vocab <= 256), otherwise token ids
// separated by spaces. Fails on a token the vocabulary lacks.
static int prompt_tokens(const RtModel *m, const char *prompt, int32_t *out, int64_t *n) {
  *n = 0;
  if (m->vocab <= 256) {
    for (const unsigned char *c = (const unsigned char *)prompt; *c; c++) {
      if (*c >= m->vocab)
        return rt_fail("--prompt: byte %d at offset %lld is not below vocab %lld", *c, (long long)*n,
                       (long long)m->vocab);
      out[(*n)++] = *c;
    }
    return 0;
  }
  for (const char *c = prompt; *c;) {
    char *end;
    long long t = strtoll(c, &end, 10);
    if (end == c)
      return rt_fail("--prompt of a model with vocab %lld is token ids separated by spaces, not '%s'",
                     (long long)m->vocab, prompt);
    if (t < 0 || t >= m->vocab)
      return rt_fail("--prompt: token %lld is not below vocab %lld", t, (long long)m->vocab);
    out[(*n)++] = (int32_t)t;
    for (c = end; *c == ' '; c++) {}
  }
  return 0;
}

// Generates opt.sample tokens after the prompt: each forward sees the last seqlen tokens in
// every window of the batch, and the next token is drawn from the logits of global window 0 at
// the last position (rt_sample_token; key rt_key(rt_key(seed, RT_STREAM_SAMPLE), i) for the
// i-th token), then shared by rank 0. Collective.
static int sample(Trainer *tr) {
  const RtModel *m = tr->model;
  RtStep *st = &tr->st;
  int64_t L = m->seqlen, n = tr->opt.sample, plen = 0;
  const char *prompt = tr->opt.prompt ? tr->opt.prompt : "\n";
  int32_t *seq = rt_alloc((strlen(prompt) + 1 + (size_t)n) * sizeof(int32_t), "the sample");
  int status = prompt_tokens(m, prompt, seq, &plen);
  if (status == 0 && plen == 0)
    status = rt_fail("--prompt is empty: the sample needs at least one token to continue");
  if (rt_world_agree(tr->comm, status) != 0) {
    free(seq);
    return -1;
  }
  uint64_t key = rt_key(m->seed, RT_STREAM_SAMPLE);
  int32_t *in = (int32_t *)tr->input, *tgt = (int32_t *)tr->target;
  for (int64_t k = 0; k < n; k++) {
    int64_t len = plen + k, start = len > L ? len - L : 0, ctx = len - start;
    for (int64_t b = 0; b < m->batch; b++)
      for (int64_t i = 0; i < L; i++) {
        in[b * L + i] = i < ctx ? seq[start + i] : 0;
        tgt[b * L + i] = 0;
      }
    st->step = tr->done_steps + 1;
    m->forward(st);
    if (device_get(tr, RT_DEVICE_OUTPUT) != 0) {
      free(seq);
      return -1;
    }
    int32_t next = 0;
    if (is_root(tr))
      next = rt_sample_token(st->output + (ctx - 1) * m->vocab, (int)m->vocab, (float)tr->opt.temperature,
                             rt_key(key, (uint64_t)k));
    if (tr->ranks.world > 1)
      rt_bcast(tr->comm, RT_GROUP_WORLD, &next, sizeof next, 0);
    seq[len] = next;
  }
  if (is_root(tr)) {
    printf("# sample: %lld tokens after a %lld-token prompt, temperature %g\n", (long long)n, (long long)plen,
           tr->opt.temperature);
    rt_print_tokens(stdout, m, seq, plen + n);
    fflush(stdout);
  }
  free(seq);
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

enum { CHECK_ENTRIES = 12, CHECK_RETRY = 8 };   // entries per parameter; eps / CHECK_RETRY: the second try
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
  if (p->shard_mp >= 0)   // the MP rank of DP replica 0
    return (int)(coord[p->shard_mp] / p->dims[p->shard_mp]);
  return ep * r->esp + esp;
}

// Central differences on up to CHECK_ENTRIES entries of every parameter, spread evenly over the
// whole tensor with an offset from the name's hash, against the analytic gradient of the same
// total loss. On several ranks every rank that holds an entry (replicas included) perturbs it,
// all run the forward, and the reduced losses are compared with the owner's gradient.
// The central difference of the loss in entry j of the parameters w (-1: another rank holds it)
// at orig +- eps, over the step (orig+eps) - (orig-eps) as floats round it (*span); *routed: either
// side changed a routing decision. False when an upload to the device failed (all ranks agree).
static bool central_difference(Trainer *tr, float *w, int64_t j, float orig, double eps, const uint64_t *hash0,
                               double *fd, double *span, bool *routed) {
  const float side[2] = {(float)(orig + eps), (float)(orig - eps)};
  Report rep[2];
  for (int s = 0; s < 2; s++) {
    if (j >= 0)
      w[j] = side[s];
    if (device_put(tr, RT_DEVICE_PARAMS) != 0) {
      if (j >= 0)
        w[j] = orig;
      return false;
    }
    tr->model->forward(&tr->st);
    rep[s] = reduce_report(tr, &tr->st, hash0);
  }
  if (j >= 0)
    w[j] = orig;
  *span = (double)side[0] - (double)side[1];
  *routed = rep[0].route_changed || rep[1].route_changed;
  *fd = (rep[0].loss - rep[1].loss) / *span;
  return true;
}

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
  // MOERT_CHECK_GRAD_PLANT=1 (tests only): the last parameter's gradient made 20 % too large, a
  // planted bug the check must report (tests/run.sh), retry or not.
  const char *plant = getenv("MOERT_CHECK_GRAD_PLANT");
  if (plant && strcmp(plant, "1") == 0 && m->nparams > 0)
    for (int64_t j = 0; j < m->params[m->nparams - 1].numel; j++)
      grad[m->params[m->nparams - 1].offset + j] *= 1.2f;

  int width = 9;
  for (int i = 0; i < m->nparams; i++)
    if ((int)strlen(m->params[i].name) > width)
      width = (int)strlen(m->params[i].name);
  if (root) {
    printf("# gradient check of %s at step 1: loss %.6f (mse + aux_total), %d parameters\n",
           m->name, loss0, m->nparams);
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
  int total_checked = 0, total_skipped = 0, total_failed = 0, retried = 0;
  bool device_failed = false;   // an upload of the perturbed parameters failed (all ranks agree)
  for (int i = 0; i < m->nparams && !device_failed; i++) {
    const RtParam *p = &m->params[i];
    const float *g = grad + p->offset;
    float *w = st->params + p->offset;
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
    unit = m->vocab > 0 ? fmax(unit, 1e-2) : 1.0;
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
      if ((device_failed = !central_difference(tr, w, j, orig, eps, &hash0, &fd, &span, &routed)))
        break;
      if (routed) {
        skipped++;
        continue;
      }
      double err = fabs(fd - grad_j);
      double noise = CHECK_NOISE_ULPS * FLT_EPSILON * loss_scale / span;
      if (!(err <= atol_grad + noise + CHECK_RTOL * fabs(grad_j))) {
        // A kink within eps of the point (a ReLU changing sides, a token at a capacity edge)
        // spoils the difference; a wrong gradient fails closer to the point as well.
        retried++;
        if ((device_failed = !central_difference(tr, w, j, orig, eps / CHECK_RETRY, &hash0, &fd, &span, &routed)))
          break;
        if (routed) {
          skipped++;
          continue;
        }
        err = fabs(fd - grad_j);
        noise = CHECK_NOISE_ULPS * FLT_EPSILON * loss_scale / span;
      }
      double scale = fmax(fabs(fd), fabs(grad_j));
      double rel = scale > 0 ? err / scale : 0;
      checked++;
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
    printf("# %d entries checked, %d skipped, %d measured again at eps/%d, %d out of tolerance%s\n",
           total_checked, total_skipped, retried, CHECK_RETRY, total_failed,
           total_checked ? "" : " (nothing could be checked)");
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
  if (status == 0 && model->vocab > 0) {
    RtLmOptions lo = {.data = opt->data, .val = opt->val, .input = opt->input, .val_windows = opt->val_windows};
    status = rt_world_agree(comm, rt_lm_open(&tr.lm, model, ranks, &lo));
    tr.lm_open = true;
    tr.fixed_data = opt->input != NULL;
    if (status == 0 && tr.lm.has_val && rt_lm_val_batches(&tr.lm, ranks->dp) == 0)
      status = rt_fail("the validation file '%s' holds %lld windows of %lld tokens; one global batch needs %lld",
                       tr.lm.val_source, (long long)tr.lm.val_count, (long long)(model->seqlen + 1),
                       (long long)(ranks->dp * model->batch));
  } else if (status == 0 && opt->input) {
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
  if (status == 0 && opt->sample > 0)
    status = sample(&tr);
  if (status == 0 && (opt->save || opt->export_hf))
    status = device_get(&tr, RT_DEVICE_PARAMS | RT_DEVICE_MOMENTS);
  if (status == 0 && opt->export_hf)
    status = export_hf(&tr, opt->export_hf);
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
  if (check_model(model) != 0 || check_options(model, &opt) != 0)
    return speaker ? report_error() : 1;
  if (opt.comm_timeout >= 0)
    rt_comm_set_timeout(opt.comm_timeout);
  opt.watched = stdout_watched();
  // rt_comm_create reports a layout that does not fit the world itself, once.
  RtComm *comm = rt_comm_create(&model->layout, model->nodes);
  if (!comm)
    return 1;
  RtRanks ranks = rt_ranks_of(&model->layout, rt_comm_rank(comm, RT_GROUP_WORLD),
                              rt_comm_size(comm, RT_GROUP_WORLD));
  // Ranks sharing a machine share its cores: each rank's threads (kernels and GEMMs) get its
  // share, or the threads of all ranks oversubscribe the cores many times over.
  const char *local = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  rt_threads_setup(ranks.world > 1 && local ? atol(local) : 1);
  if (ranks.world > 1 && ranks.rank == 0 && !opt.quiet) {
    rt_comm_print_groups(comm, stdout);
    fflush(stdout);
  }
  int status = run(model, &opt, &ranks, comm);
  rt_comm_destroy(comm);
  return status;
}
