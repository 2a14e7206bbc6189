// Fault injection, for the tests only.
//
// MOERT_TEST_KILL="RANK:STEP" (tests/mpi/failures.sh) in the environment makes rank RANK of the job
// die by SIGKILL in the middle of training step STEP (after its forward, before its backward), as
// a crashed process would, so that the tests can check that the other ranks end in bounded time
// and that the last checkpoint stays intact. The driver reads the variable once
// (rt_fault_from_env) and passes through rt_fault_point at that one place of every step; without
// the variable, or with one that does not parse, nothing ever happens there.
//
// MOERT_TEST_SCALE="RANK:NAME:FACTOR" (tests/mpi/twin.sh, tests/lm/vocab.sh) multiplies world rank
// RANK's shard of parameter NAME by FACTOR once its parameters are set (initialised, loaded or
// resumed): a planted error in one rank's part of a layout's math, as a wrong offset or a missing
// scale in a split would make, which the checks that compare layouts must catch.
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rt_internal.h"

RtFault rt_fault_from_env(void) {
  RtFault f = {.rank = -1, .step = -1};
  const char *spec = getenv("MOERT_TEST_KILL");
  long long step;
  if (spec && sscanf(spec, "%d:%lld", &f.rank, &step) == 2)
    f.step = step;
  else
    f.rank = -1;
  return f;
}

void rt_fault_point(const RtFault *f, int rank, int64_t step) {
  if (f->rank >= 0 && f->rank == rank && f->step == step)
    raise(SIGKILL);
}

void rt_fault_scale(const RtModel *m, int rank, float *params) {
  const char *spec = getenv("MOERT_TEST_SCALE");
  char name[256];
  int at;
  float factor;
  if (!spec || sscanf(spec, "%d:%255[^:]:%f", &at, name, &factor) != 3 || at != rank)
    return;
  for (int i = 0; i < m->nparams; i++) {
    if (strcmp(m->params[i].name, name) != 0) continue;
    float *p = params + m->params[i].offset;
    for (int64_t j = 0; j < m->params[i].numel; j++) p[j] *= factor;
    fprintf(stderr, "moert: MOERT_TEST_SCALE: rank %d's shard of %s (%lld elements) scaled by %.9g\n", rank, name,
            (long long)m->params[i].numel, factor);
    return;
  }
  fprintf(stderr, "moert: MOERT_TEST_SCALE: no parameter '%s'\n", name);
}
