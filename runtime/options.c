// The training binary's command line: --help's text, parsing the options, and the checks that
// the model description the generated program hands to rt_main is whole and that the options
// fit the model (rt_trainer.h). Nothing here talks to other ranks: every rank parses the same
// command line and fails the same checks.
#include "rt_trainer.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

// ---- command line ----

void rt_options_usage(FILE *out, const RtModel *model, const char *prog) {
  fprintf(out,
          "usage: %s [--steps N] [--weights W.safetensors] [--save C] [--resume C]\n"
          "       %*s [--input x.npy] [--target t.npy] [--dump DIR] [--record FILE]\n"
          "       %*s [--check-grad] [--quiet] [--profile] [--comm-timeout S] [--log F.jsonl]\n"
          "       %*s [--export-hf DIR [--merge]] [--adapter DIR]\n"
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
          "                   --weights W converts W); a LoRA model writes its adapters in PEFT's form:\n"
          "                   DIR/adapter_config.json and DIR/adapter_model.safetensors\n"
          "  --merge          with --export-hf, a LoRA model's weights with the adapters merged in\n"
          "                   (W + alpha/r A B), as a Hugging Face checkpoint for transformers\n"
          "  --adapter DIR    a LoRA model: load the PEFT adapter in DIR (adapter_config.json and\n"
          "                   adapter_model.safetensors; r, lora_alpha and the targets the model's)\n"
          "                   into the adapters, after the weights of --weights\n"
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
          "then exit;\n"
          "                   --check-grad=P,Q,... only the parameters whose names begin with P, Q, ...\n"
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
          "                   computation (rank 0's); on a GPU the median forward and\n"
          "                   backward and the median update\n"
          "  --comm-timeout S end the job when a collective has not completed after S seconds\n"
          "                   (a cut link, a dead rank; default 20, 0 waits forever)\n"
          "  --help           print this message\n",
          prog, (int)strlen(prog), "", (int)strlen(prog), "", (int)strlen(prog), "", model->name,
          (long long)model->batch, (long long)model->seqlen, (long long)model->embed, model->name);
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
//            | "--target" T | "--dump" DIR | "--record" FILE | "--check-grad" ["=" P,...] | "--quiet"
//            | "--help")*
// A value may also follow "=": --steps=5.
int rt_options_parse(int argc, char **argv, RtOptions *o) {
  *o = (RtOptions){.steps = 20, .temperature = 1.0, .comm_timeout = -1};
  for (int i = 1; i < argc; i++) {
    const char *arg = argv[i];
    if (strcmp(arg, "--check-grad") == 0 || strncmp(arg, "--check-grad=", 13) == 0) {
      o->check_grad = true;
      o->check_grad_only = arg[12] == '=' ? arg + 13 : NULL;
      continue;
    }
    if (strcmp(arg, "--quiet") == 0) {
      o->quiet = true;
      continue;
    }
    if (strcmp(arg, "--merge") == 0) {
      o->merge = true;
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
                                         "--comm-timeout", "--export-hf", "--log", "--adapter"};
    const char **slots[] = {NULL,       &o->weights, &o->save, &o->resume,
                            &o->input, &o->target,  &o->dump, &o->record,
                            &o->data,  &o->val,     &o->prompt, NULL,
                            NULL,      NULL,        NULL,
                            NULL,      &o->export_hf, &o->log, &o->adapter};
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
  if (o->merge && !o->export_hf)
    return rt_fail("--merge needs --export-hf DIR (it says what a LoRA model's export writes)");
  if (o->adapter && o->resume)
    return rt_fail("--adapter and --resume cannot be combined (a checkpoint holds the adapters)");
  return 0;
}

// ---- the model description ----

int rt_model_check(const RtModel *m) {
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

// A path the run writes after training, checked before it starts: a file's folder exists and is
// writable and the file, when there, is no folder; a folder (is_dir) is one and writable, or the
// nearest folder above it that exists is writable (the missing ones are made then).
static int check_writable(const char *opt, const char *path, bool is_dir) {
  struct stat sb;
  if (stat(path, &sb) == 0) {
    if (is_dir && !S_ISDIR(sb.st_mode)) return rt_fail("%s '%s': it exists and is not a folder", opt, path);
    if (!is_dir && S_ISDIR(sb.st_mode)) return rt_fail("%s '%s' is a folder, not a file", opt, path);
    if (access(path, W_OK) != 0) return rt_fail("%s '%s' is not writable: %s", opt, path, strerror(errno));
    if (is_dir) return 0;
  }
  char *dir = rt_strdup(path, "a path");
  int status = 0;
  for (;;) {   // up one folder at a time (a file: once)
    char *slash = strrchr(dir, '/');
    while (slash && slash > dir && slash[1] == '\0') {   // a trailing slash
      *slash = '\0';
      slash = strrchr(dir, '/');
    }
    const char *parent = !slash ? "." : slash == dir ? "/" : (*slash = '\0', dir);
    if (stat(parent, &sb) == 0) {
      if (!S_ISDIR(sb.st_mode))
        status = rt_fail("%s '%s': '%s' is not a folder", opt, path, parent);
      else if (access(parent, W_OK) != 0)
        status = rt_fail("%s '%s': the folder '%s' is not writable: %s", opt, path, parent, strerror(errno));
      break;
    }
    if (!is_dir || !slash || slash == dir) {
      status = rt_fail("%s '%s': the folder '%s' does not exist", opt, path, parent);
      break;
    }
  }
  free(dir);
  return status;
}

// The options of language models need one, and --target does not apply to one. What the run
// writes after training (--save, --export-hf, --log, --dump, --record) and the sample's prompt
// are checked here, before the first step, so that a run does not fail after its training.
int rt_options_check(const RtModel *m, const RtOptions *o) {
  const struct { const char *opt, *path; bool dir; } out[] = {
      {"--save", o->save, false}, {"--export-hf", o->export_hf, true}, {"--log", o->log, false},
      {"--dump", o->dump, true},  {"--record", o->record, false}};
  for (size_t i = 0; i < sizeof out / sizeof out[0]; i++)
    if (out[i].path && check_writable(out[i].opt, out[i].path, out[i].dir) != 0) return -1;
  if (o->export_hf && !m->hf_config)
    return rt_fail("--export-hf: model '%s' cannot be written as a Hugging Face checkpoint: %s", m->name,
                   m->hf_refusal ? m->hf_refusal : "it was built by a moec that does not know the families");
  if ((o->adapter || o->merge) && !m->hf_adapter)
    return rt_fail("%s: model '%s' %s", o->adapter ? "--adapter" : "--merge", m->name,
                   !m->hf_config ? "is no Hugging Face family whose adapters PEFT names"
                                 : "has no lora block: it has no adapters (its export is the whole checkpoint)");
  if (m->vocab > 0 && o->target)
    return rt_fail("--target does not apply to language model '%s': the targets are the next tokens "
                   "of the --input windows", m->name);
  if (m->vocab > 0)
    return rt_prompt_check(m, o);
  const char *lm_only = o->data ? "--data" : o->val ? "--val" : o->prompt ? "--prompt" : o->sample ? "--sample"
                        : o->eval_every ? "--eval-every" : o->val_windows ? "--val-windows" : NULL;
  if (lm_only)
    return rt_fail("%s applies to language models; model '%s' has no vocabulary (it trains on float "
                   "inputs)", lm_only, m->name);
  return 0;
}
