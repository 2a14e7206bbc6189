// rt_main: the training driver every generated binary runs.
//
// The generated program knows its model (an RtModel: parameters, sizes, step functions); this
// file knows everything around it: the command line, where parameters come from (seeded init,
// --weights, --resume), the data of each step (synthetic from the seed, or .npy files), the
// loop forward -> backward -> update with its one-line report, --dump, the record hook's file,
// checkpoints and the finite-difference gradient check. Everything is a function of (seed,
// step, sample), so a run resumed from a checkpoint repeats an uninterrupted one bit for bit.
//
// Errors on user input never abort: the failing function records a sentence (rt_fail), the
// caller unwinds, and rt_main prints "moert: error: SENTENCE" once and returns non-zero. It
// never calls exit(), so tests can run it in-process.
#include "moert.h"
#include "rt_internal.h"

#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

enum { EXIT_USAGE = 2 };

static const char checkpoint_format[] = "moec-checkpoint-1";

// ---- errors ----

static _Thread_local char last_error[1024];

int rt_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return -1;
}

const char *rt_last_error(void) {
  return last_error;
}

void rt_clear_error(void) {
  last_error[0] = '\0';
}

static int report_error(void) {
  fprintf(stderr, "moert: error: %s\n", last_error[0] ? last_error : "unknown failure");
  return 1;
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
          "Trains the MoE model '%s' (inputs [%lld, %lld, %lld]) and prints one line per step.\n"
          "  --steps N        train until step N, counting resumed steps (default 20)\n"
          "  --weights W      load the parameters from safetensors file W instead of "
          "initialising them\n"
          "  --save C         after the last step, write a checkpoint to C (atomically)\n"
          "  --resume C       continue from checkpoint C: parameters, optimizer state, step\n"
          "  --input X        use X.npy (float32 [B, L, M]) as the input of every step\n"
          "  --target T       use T.npy (float32 [B, L, M]) as the target (default: "
          "0.5 * the input shifted by one channel)\n"
          "  --dump DIR       write the first step's input, target, output, loss and "
          "gradients to DIR\n"
          "  --record FILE    where a model with a record hook writes its JSON lines (default "
          "%s.record.jsonl; appended to on --resume)\n"
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
  RtStep st;
  float *input, *target;
  int64_t elems;           // batch * seqlen * embed
  int64_t done_steps;      // the last step already applied to the parameters
  bool fixed_data;         // --input given: the same data every step
} Trainer;

static void trainer_destroy(Trainer *tr) {
  if (tr->st.record)
    fclose(tr->st.record);
  free(tr->st.params);
  free(tr->st.grads);
  free(tr->st.opt_m);
  free(tr->st.opt_v);
  free(tr->st.arena);
  free(tr->input);
  free(tr->target);
}

static int trainer_create(Trainer *tr, const RtModel *model, const Options *opt) {
  *tr = (Trainer){.model = model, .opt = *opt};
  tr->elems = model->batch * model->seqlen * model->embed;
  size_t floats = model->param_floats ? model->param_floats : 1;
  size_t arena = (model->arena_bytes + 63) / 64 * 64;
  RtStep *st = &tr->st;
  st->model = model;
  st->seed = model->seed;
  st->token0 = 0;
  st->params = calloc(floats, sizeof(float));
  st->grads = calloc(floats, sizeof(float));
  st->opt_m = calloc(floats, sizeof(float));
  st->opt_v = calloc(floats, sizeof(float));
  st->arena = aligned_alloc(64, arena ? arena : 64);
  tr->input = calloc((size_t)tr->elems, sizeof(float));
  tr->target = calloc((size_t)tr->elems, sizeof(float));
  if (!st->params || !st->grads || !st->opt_m || !st->opt_v || !st->arena || !tr->input ||
      !tr->target) {
    trainer_destroy(tr);
    return rt_fail("out of memory: model '%s' needs %zu bytes of parameters and state and %zu "
                   "bytes of activations", model->name, 4 * floats * sizeof(float), arena);
  }
  // Zeroed once so that a plan that reads a buffer before writing it is at least deterministic.
  memset(st->arena, 0, arena ? arena : 64);
  st->input = tr->input;
  st->target = tr->target;
  return 0;
}

// ---- where the parameters come from ----

static void init_params(Trainer *tr) {
  const RtModel *m = tr->model;
  uint64_t init_key = rt_key(m->seed, RT_STREAM_INIT);
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *p = &m->params[i];
    float *w = tr->st.params + p->offset;
    uint64_t key = rt_key(init_key, rt_hash_name(p->name));
    for (int64_t j = 0; j < p->numel; j++) {
      switch (p->init) {
      case RT_INIT_ZEROS: w[j] = 0.0f; break;
      case RT_INIT_ONES: w[j] = 1.0f; break;
      case RT_INIT_CONST: w[j] = p->std; break;
      case RT_INIT_NORMAL: w[j] = (float)(p->std * rt_normal(key, (uint64_t)j)); break;
      }
    }
  }
}

// Copies tensor NAME of f, which must have the parameter's shape, into dst.
static int load_tensor(const RtStFile *f, const char *path, const char *name, const RtParam *p,
                       float *dst) {
  const RtStEntry *t = rt_st_find(f, name);
  if (!t)
    return rt_fail("'%s' has no tensor '%s'", path, name);
  bool same = t->rank == p->rank;
  for (int d = 0; same && d < p->rank; d++)
    same = t->dims[d] == p->dims[d];
  if (!same) {
    char have[160], want[160];
    return rt_fail("'%s': tensor '%s' has shape %s, the model needs %s", path, name,
                   rt_shape_str(have, sizeof have, t->rank, t->dims),
                   rt_shape_str(want, sizeof want, p->rank, p->dims));
  }
  rt_st_copy(t, dst);
  return 0;
}

// --weights: parameters only; other tensors in the file (optimizer moments) are ignored.
static int load_weights(Trainer *tr, const char *path) {
  RtStFile f;
  if (rt_st_read(path, &f) != 0)
    return -1;
  const RtModel *m = tr->model;
  int status = 0;
  for (int i = 0; i < m->nparams && status == 0; i++)
    status = load_tensor(&f, path, m->params[i].name, &m->params[i],
                         tr->st.params + m->params[i].offset);
  rt_st_free(&f);
  return status;
}

static int load_checkpoint(Trainer *tr, const char *path) {
  RtStFile f;
  if (rt_st_read(path, &f) != 0)
    return -1;
  const RtModel *m = tr->model;
  const char *format = rt_st_meta(&f, "format");
  const char *model = rt_st_meta(&f, "model");
  const char *optimizer = rt_st_meta(&f, "optimizer");
  const char *step = rt_st_meta(&f, "step");
  int status = -1;
  char *end = NULL;
  long long done = step ? strtoll(step, &end, 10) : -1;
  if (!format || strcmp(format, checkpoint_format) != 0) {
    rt_fail("'%s' is not a moec checkpoint (its __metadata__ lacks \"format\": \"%s\"); "
            "to start from its weights use --weights", path, checkpoint_format);
  } else if (!model || strcmp(model, m->name) != 0) {
    rt_fail("checkpoint '%s' is of model '%s', but this binary trains '%s'", path,
            model ? model : "(none)", m->name);
  } else if (!optimizer || strcmp(optimizer, optimizer_name(m->opt)) != 0) {
    rt_fail("checkpoint '%s' was trained with optimizer %s, but this binary uses %s", path,
            optimizer ? optimizer : "(none)", optimizer_name(m->opt));
  } else if (!step || *end || done < 0 || done > INT32_MAX) {
    rt_fail("checkpoint '%s' has no valid \"step\" in its __metadata__", path);
  } else {
    status = 0;
  }
  char name[512];
  for (int i = 0; i < m->nparams && status == 0; i++) {
    const RtParam *p = &m->params[i];
    status = load_tensor(&f, path, p->name, p, tr->st.params + p->offset);
    if (status == 0 && m->opt == RT_OPT_ADAMW) {
      snprintf(name, sizeof name, "opt.m.%s", p->name);
      status = load_tensor(&f, path, name, p, tr->st.opt_m + p->offset);
      snprintf(name, sizeof name, "opt.v.%s", p->name);
      if (status == 0)
        status = load_tensor(&f, path, name, p, tr->st.opt_v + p->offset);
    }
  }
  if (status == 0)
    tr->done_steps = done;
  rt_st_free(&f);
  return status;
}

static int save_checkpoint(Trainer *tr, const char *path) {
  const RtModel *m = tr->model;
  int per = m->opt == RT_OPT_ADAMW ? 3 : 1;
  int n = m->nparams * per;
  RtStTensor *tensors = calloc((size_t)n + 1, sizeof(RtStTensor));
  char **names = calloc((size_t)n + 1, sizeof(char *));
  int status = -1;
  if (!tensors || !names) {
    rt_fail("out of memory writing '%s'", path);
    goto done;
  }
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *p = &m->params[i];
    const float *src[3] = {tr->st.params, tr->st.opt_m, tr->st.opt_v};
    const char *prefix[3] = {"", "opt.m.", "opt.v."};
    for (int k = 0; k < per; k++) {
      size_t len = strlen(prefix[k]) + strlen(p->name) + 1;
      char *name = names[i * per + k] = malloc(len);
      if (!name) {
        rt_fail("out of memory writing '%s'", path);
        goto done;
      }
      snprintf(name, len, "%s%s", prefix[k], p->name);
      tensors[i * per + k] = (RtStTensor){name, p->rank, p->dims, src[k] + p->offset};
    }
  }
  char step[32];
  snprintf(step, sizeof step, "%lld", (long long)tr->done_steps);
  const char *meta[] = {"format", checkpoint_format, "step", step, "model", m->name,
                        "optimizer", optimizer_name(m->opt)};
  status = rt_st_write(path, n, tensors, 4, meta);
done:
  for (int i = 0; names && i < n; i++)
    free(names[i]);
  free(names);
  free(tensors);
  return status;
}

// ---- data ----

// target[s, m] = 0.5 * x[s, (m + 1) % M]: a linear teacher every model can learn.
static void derive_target(const float *x, float *target, int64_t tokens, int64_t embed) {
  for (int64_t s = 0; s < tokens; s++)
    for (int64_t m = 0; m < embed; m++)
      target[s * embed + m] = 0.5f * x[s * embed + (m + 1) % embed];
}

static void synthetic_input(const RtModel *m, int64_t step, float *x) {
  uint64_t step_key = rt_key(rt_key(m->seed, RT_STREAM_INPUT), (uint64_t)step);
  int64_t per_sample = m->seqlen * m->embed;
  for (int64_t i = 0; i < m->batch; i++) {
    uint64_t key = rt_key(step_key, (uint64_t)i);
    for (int64_t j = 0; j < per_sample; j++)
      x[i * per_sample + j] = (float)rt_normal(key, (uint64_t)j);
  }
}

static int load_data(Trainer *tr) {
  const RtModel *m = tr->model;
  int64_t dims[3] = {m->batch, m->seqlen, m->embed};
  if (rt_npy_read_f32(tr->opt.input, 3, dims, tr->input) != 0)
    return -1;
  if (tr->opt.target)
    return rt_npy_read_f32(tr->opt.target, 3, dims, tr->target);
  derive_target(tr->input, tr->target, m->batch * m->seqlen, m->embed);
  return 0;
}

static void fill_step_data(Trainer *tr, int64_t step) {
  tr->st.step = step;
  if (tr->fixed_data)
    return;
  const RtModel *m = tr->model;
  synthetic_input(m, step, tr->input);
  derive_target(tr->input, tr->target, m->batch * m->seqlen, m->embed);
}

// ---- --dump ----

static int make_dirs(const char *path) {
  char *p = strdup(path);
  if (!p)
    return rt_fail("out of memory");
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

static int dump_step(Trainer *tr) {
  const RtModel *m = tr->model;
  const char *dir = tr->opt.dump;
  if (!tr->st.output)
    return rt_fail("internal error: the forward of model '%s' did not set its output", m->name);
  size_t len = strlen(dir) + 512;
  char *path = malloc(len);
  if (!path)
    return rt_fail("out of memory");
  int64_t dims[3] = {m->batch, m->seqlen, m->embed};
  double loss = tr->st.mse + tr->st.aux_total;
  snprintf(path, len, "%s/grad", dir);
  int status = make_dirs(path);
  if (status == 0) {
    snprintf(path, len, "%s/input.npy", dir);
    status = rt_npy_write(path, RT_DTYPE_F32, 3, dims, tr->st.input);
  }
  if (status == 0) {
    snprintf(path, len, "%s/target.npy", dir);
    status = rt_npy_write(path, RT_DTYPE_F32, 3, dims, tr->st.target);
  }
  if (status == 0) {
    snprintf(path, len, "%s/output.npy", dir);
    status = rt_npy_write(path, RT_DTYPE_F32, 3, dims, tr->st.output);
  }
  if (status == 0) {
    snprintf(path, len, "%s/loss.npy", dir);
    status = rt_npy_write(path, RT_DTYPE_F64, 0, NULL, &loss);
  }
  for (int i = 0; i < m->nparams && status == 0; i++) {
    const RtParam *p = &m->params[i];
    snprintf(path, len, "%s/grad/%s.npy", dir, p->name);
    status = rt_npy_write(path, RT_DTYPE_F32, p->rank, p->dims, tr->st.grads + p->offset);
  }
  free(path);
  return status;
}

// ---- training ----

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int train(Trainer *tr) {
  const RtModel *m = tr->model;
  RtStep *st = &tr->st;
  int64_t first = tr->done_steps + 1, last = tr->opt.steps;
  if (!tr->opt.quiet) {
    printf("# %s: %d parameter tensors, %zu floats; batch %lld, seqlen %lld, embed %lld; "
           "optimizer %s; seed %" PRIu64 "\n", m->name, m->nparams, m->param_floats,
           (long long)m->batch, (long long)m->seqlen, (long long)m->embed,
           optimizer_name(m->opt), m->seed);
    if (first <= last)
      printf("# steps %lld..%lld, data: %s\n", (long long)first, (long long)last,
             tr->fixed_data ? "from .npy files" : "synthetic");
  }
  double loss = NAN;
  for (int64_t t = first; t <= last; t++) {
    fill_step_data(tr, t);
    double t0 = now_ms();
    m->forward(st);
    m->backward(st);
    double t1 = now_ms();
    if (tr->opt.dump && t == first && dump_step(tr) != 0)
      return -1;
    double t2 = now_ms();
    m->update(st);
    double t3 = now_ms();
    tr->done_steps = t;
    loss = st->mse + st->aux_total;
    double dropped = st->routed > 0 ? (double)st->dropped / (double)st->routed : 0.0;
    if (st->record)
      fflush(st->record);
    if (!tr->opt.quiet) {
      // Tokens per expert, min/mean/max over every expert of every layer (0/0.0/0 without MoE).
      bool loads = st->load_count > 0;
      printf("step %lld  loss %.6f  mse %.6f  aux %.6f  z %.6f  dropped %.4f  load %lld/%.1f/%lld",
             (long long)t, loss, st->mse, st->aux, st->z, dropped,
             loads ? (long long)st->load_min : 0LL, loads ? st->load_sum / st->load_count : 0.0,
             loads ? (long long)st->load_max : 0LL);
      if (m->dropless)
        printf("  capacity %lld", (long long)st->capacity_max);
      printf("  time %.3f ms\n", (t1 - t0) + (t3 - t2));
      fflush(stdout);
    }
    if (!isfinite(loss))
      return rt_fail("the loss is %f at step %lld; training diverged (try a smaller learning "
                     "rate)", loss, (long long)t);
  }
  if (first <= last)
    printf("# trained %lld step%s; final loss %.6f\n", (long long)(last - first + 1),
           last > first ? "s" : "", loss);
  else if (!tr->opt.quiet)
    printf("# nothing to train: the parameters are at step %lld and --steps is %lld\n",
           (long long)tr->done_steps, (long long)last);
  return 0;
}

// ---- the record hook's file ----

// A model with a record hook writes to --record FILE, by default MODEL.record.jsonl in the
// current directory; a fresh run starts the file anew, a resumed one appends to it.
static int open_record(Trainer *tr) {
  const RtModel *m = tr->model;
  if (!m->records) {
    if (tr->opt.record && !tr->opt.quiet)
      printf("# --record %s: model '%s' has no record hook, nothing is recorded\n",
             tr->opt.record, m->name);
    return 0;
  }
  char fallback[512];
  const char *path = tr->opt.record;
  if (!path) {
    snprintf(fallback, sizeof fallback, "%s.record.jsonl", m->name);
    path = fallback;
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

static double total_loss(const RtStep *st) {
  return st->mse + st->aux_total;
}

// Central differences on up to CHECK_ENTRIES entries of every parameter, spread evenly with an
// offset from the name's hash, against the analytic gradient of the same total loss.
static int check_grad(Trainer *tr) {
  const RtModel *m = tr->model;
  RtStep *st = &tr->st;
  fill_step_data(tr, 1);
  m->forward(st);
  double loss0 = total_loss(st);
  double loss_scale = fabs(st->mse) + fabs(st->aux_total);   // what fp32 rounding scales with
  uint64_t hash0 = st->route_hash;
  m->backward(st);
  float *grad = malloc((m->param_floats ? m->param_floats : 1) * sizeof(float));
  if (!grad)
    return rt_fail("out of memory");
  memcpy(grad, st->grads, m->param_floats * sizeof(float));

  int width = 9;
  for (int i = 0; i < m->nparams; i++)
    if ((int)strlen(m->params[i].name) > width)
      width = (int)strlen(m->params[i].name);
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
  int total_checked = 0, total_skipped = 0, total_failed = 0;
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *p = &m->params[i];
    const float *g = grad + p->offset;
    float *w = st->params + p->offset;
    double max_g = 0;
    for (int64_t j = 0; j < p->numel; j++)
      max_g = fmax(max_g, fabs(g[j]));
    double atol_grad = CHECK_ATOL_GRAD * max_g;
    int64_t count = p->numel < CHECK_ENTRIES ? p->numel : CHECK_ENTRIES;
    int64_t stride = p->numel / CHECK_ENTRIES;
    int64_t offset = stride > 0 ? (int64_t)(rt_hash_name(p->name) % (uint64_t)stride) : 0;
    int checked = 0, skipped = 0, failed = 0;
    double max_abs = 0, max_rel = 0;
    for (int64_t k = 0; k < count; k++) {
      int64_t j = stride > 0 ? k * p->numel / CHECK_ENTRIES + offset : k;
      float orig = w[j];
      double eps = CHECK_EPS * fmax(1.0, fabs(orig));
      w[j] = (float)(orig + eps);
      double up = (double)w[j] - orig;
      m->forward(st);
      double loss_up = total_loss(st);
      bool same = st->route_hash == hash0;
      w[j] = (float)(orig - eps);
      double down = orig - (double)w[j];
      m->forward(st);
      double loss_down = total_loss(st);
      same = same && st->route_hash == hash0;
      w[j] = orig;
      if (!same) {
        skipped++;
        continue;
      }
      double fd = (loss_up - loss_down) / (up + down);
      double err = fabs(fd - g[j]);
      double scale = fmax(fabs(fd), fabs(g[j]));
      double rel = scale > 0 ? err / scale : 0;
      checked++;
      double noise = CHECK_NOISE_ULPS * FLT_EPSILON * loss_scale / (up + down);
      failed += !(err <= atol_grad + noise + CHECK_RTOL * fabs(g[j]));
      max_abs = fmax(max_abs, err);
      max_rel = fmax(max_rel, rel);
    }
    const char *result = failed ? "FAILED" : checked ? "OK" : "SKIPPED";
    printf("%-*s %8d %8d %12.3e %12.3e  %s\n", width, p->name, checked, skipped, max_abs,
           max_rel, result);
    fflush(stdout);
    total_checked += checked;
    total_skipped += skipped;
    total_failed += failed;
  }
  free(grad);
  // Leave the step's state as the unperturbed forward left it.
  m->forward(st);
  bool ok = total_failed == 0 && total_checked > 0;
  printf("# %d entries checked, %d skipped, %d out of tolerance%s\n", total_checked,
         total_skipped, total_failed, total_checked ? "" : " (nothing could be checked)");
  printf("%s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}

// ---- entry point ----

int rt_main(const RtModel *model, int argc, char **argv) {
  const char *prog = argc > 0 && argv[0] ? argv[0] : "model";
  rt_clear_error();
  Options opt;
  if (parse_options(argc, argv, &opt) != 0) {
    fprintf(stderr, "moert: error: %s\n", rt_last_error());
    usage(stderr, model, prog);
    return EXIT_USAGE;
  }
  if (opt.help) {
    usage(stdout, model, prog);
    return 0;
  }
  if (check_model(model) != 0)
    return report_error();
  Trainer tr;
  if (trainer_create(&tr, model, &opt) != 0)
    return report_error();
  int status = 0;
  if (opt.resume)
    status = load_checkpoint(&tr, opt.resume);
  else if (opt.weights)
    status = load_weights(&tr, opt.weights);
  else
    init_params(&tr);
  if (status == 0 && opt.input) {
    tr.fixed_data = true;
    status = load_data(&tr);
  }
  if (status == 0 && opt.check_grad) {
    status = check_grad(&tr);
    if (status < 0)
      report_error();
    trainer_destroy(&tr);
    fflush(stdout);
    return status != 0;
  }
  if (status == 0 && tr.done_steps > opt.steps)
    status = rt_fail("checkpoint '%s' is at step %lld, past --steps %lld", opt.resume,
                     (long long)tr.done_steps, (long long)opt.steps);
  if (status == 0)
    status = open_record(&tr);
  if (status == 0)
    status = train(&tr);
  if (status == 0 && opt.save)
    status = save_checkpoint(&tr, opt.save);
  fflush(stdout);
  trainer_destroy(&tr);
  return status == 0 ? 0 : report_error();
}
