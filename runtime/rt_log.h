// Watching a run (runtime/log.c): --log F.jsonl, a JSON line per step and per evaluation, and the
// progress line a terminal gets instead of a line per step.
#ifndef RT_LOG_H
#define RT_LOG_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "rt_internal.h"

typedef struct RtLog RtLog;

typedef struct RtLogLayer {
  double load_min, load_mean, load_max, dropped;   // dropped: the share of the layer's choices
} RtLogLayer;

typedef struct RtLogStep {
  int64_t step;
  bool lm;                    // a language model: ce, lr, grad_norm, tokens_per_s
  double loss, ce, aux, z, lr, grad_norm, tokens_per_s, time_ms, dropped;
  int nlayers;
  const RtLogLayer *layers;
} RtLogStep;

// Opens path for a run of model (resume: the checkpoint it resumes, appended to the file; NULL: a
// new file) and writes the run's header line; NULL (rt_fail) when it cannot be written.
RtLog *rt_log_open(const char *path, const char *model, const char *resume);
// Each writes one line and flushes; 0, or -1 (rt_fail) when the file cannot be written. l may be NULL.
int rt_log_step(RtLog *l, const RtLogStep *s);
int rt_log_eval(RtLog *l, int64_t step, double val_ce, int64_t windows);
void rt_log_close(RtLog *l);   // NULL allowed
// "\rstep T/LAST  loss L  tok/s N  left M:SS" (a newline after the last step).
void rt_progress(FILE *out, int64_t step, int64_t first, int64_t last, double loss, double tokens_per_s,
                 double elapsed_ms);

#endif
