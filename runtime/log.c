// What a training run tells whoever watches it: --log F.jsonl, one JSON object per line for every
// step and every evaluation (for plots and scripts), and on a terminal one progress line that
// rewrites itself instead of a line per step.
//
// A step's line: {"step": T, "loss": .., "ce": .. (a language model; "mse" for an MoE stack),
// "aux": .., "z": .., "lr": .., "grad_norm": .., "tokens_per_s": .., "time_ms": .., "dropped": ..,
// "layers": [{"load_min": .., "load_mean": .., "load_max": .., "dropped": ..}, ..]}, the layers
// being the routed MoE layers in order (tokens kept per expert and routing group; the share of
// choices dropped). An evaluation's: {"eval": T, "val_ce": .., "windows": N}. Each run starts
// with {"run": {"model": NAME, "resumed_from": C or null}}; a run with --resume appends to the
// file, so the steps before the checkpoint stay. The file is flushed after every line, so a
// crashed run keeps what it logged.
#include "rt_log.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct RtLog {
  FILE *f;
  char *path;
};

RtLog *rt_log_open(const char *path, const char *model, const char *resume) {
  FILE *f = fopen(path, resume ? "a" : "w");
  if (!f) {
    rt_fail("--log '%s': cannot write it: %s", path, strerror(errno));
    return NULL;
  }
  RtLog *l = rt_calloc(1, sizeof *l, "the --log file");
  l->f = f;
  l->path = rt_strdup(path, "the --log file's name");
  // The run's header: a resumed run adds its lines after the last run's.
  char *name = rt_json_quote(model, "the --log header"), *from = resume ? rt_json_quote(resume, "the --log header") : NULL;
  fprintf(f, "{\"run\": {\"model\": %s, \"resumed_from\": %s}}\n", name, from ? from : "null");
  free(name);
  free(from);
  if (fflush(f) != 0 || ferror(f)) {
    rt_fail("--log '%s': cannot write it: %s", path, strerror(errno));
    rt_log_close(l);
    return NULL;
  }
  return l;
}

// A JSON number (JSON has no NaN or infinity: those are null).
static void num(FILE *f, const char *key, double v, bool comma) {
  if (isfinite(v)) fprintf(f, "\"%s\": %.9g%s", key, v, comma ? ", " : "");
  else fprintf(f, "\"%s\": null%s", key, comma ? ", " : "");
}

int rt_log_step(RtLog *l, const RtLogStep *s) {
  if (!l) return 0;
  FILE *f = l->f;
  fprintf(f, "{\"step\": %lld, ", (long long)s->step);
  num(f, "loss", s->loss, true);
  num(f, s->lm ? "ce" : "mse", s->ce, true);
  num(f, "aux", s->aux, true);
  num(f, "z", s->z, true);
  if (s->lm) {
    num(f, "lr", s->lr, true);
    num(f, "grad_norm", s->grad_norm, true);
    num(f, "tokens_per_s", s->tokens_per_s, true);
  }
  num(f, "time_ms", s->time_ms, true);
  num(f, "dropped", s->dropped, true);
  fprintf(f, "\"layers\": [");
  for (int i = 0; i < s->nlayers; i++) {
    const RtLogLayer *y = &s->layers[i];
    fprintf(f, "%s{", i ? ", " : "");
    num(f, "load_min", y->load_min, true);
    num(f, "load_mean", y->load_mean, true);
    num(f, "load_max", y->load_max, true);
    num(f, "dropped", y->dropped, false);
    fprintf(f, "}");
  }
  fprintf(f, "]}\n");
  if (fflush(f) != 0 || ferror(f)) return rt_fail("--log '%s': cannot write it: %s", l->path, strerror(errno));
  return 0;
}

int rt_log_eval(RtLog *l, int64_t step, double val_ce, int64_t windows) {
  if (!l) return 0;
  fprintf(l->f, "{\"eval\": %lld, ", (long long)step);
  num(l->f, "val_ce", val_ce, true);
  fprintf(l->f, "\"windows\": %lld}\n", (long long)windows);
  if (fflush(l->f) != 0 || ferror(l->f)) return rt_fail("--log '%s': cannot write it: %s", l->path, strerror(errno));
  return 0;
}

void rt_log_close(RtLog *l) {
  if (!l) return;
  fclose(l->f);
  free(l->path);
  free(l);
}

void rt_progress(FILE *out, int64_t step, int64_t first, int64_t last, double loss, double tokens_per_s,
                 double elapsed_ms) {
  double done = (double)(step - first + 1), left = (double)(last - step);
  double eta = done > 0 ? elapsed_ms / done * left / 1e3 : 0;
  int width = (int)snprintf(NULL, 0, "%lld", (long long)last);
  fprintf(out, "\rstep %*lld/%lld  loss %.6f", width, (long long)step, (long long)last, loss);
  if (tokens_per_s > 0) fprintf(out, "  tok/s %.0f", tokens_per_s);
  fprintf(out, "  left %d:%02d   ", (int)(eta / 60), (int)fmod(eta, 60));
  if (step == last) fputc('\n', out);
  fflush(out);
}
