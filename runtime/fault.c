// Fault injection, for the failure tests only (tests/mpi/failures.sh): MOERT_TEST_KILL="RANK:STEP"
// in the environment makes world rank RANK die by SIGKILL in the middle of training step STEP
// (after its forward, before its backward), as a crashed process would, so that the tests can
// check that the other ranks end in bounded time and that the last checkpoint stays intact.
//
// The driver reads the variable once (rt_fault_from_env) and passes through rt_fault_point at
// that one place of every step; without the variable, or with one that does not parse, nothing
// ever happens there.
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>

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
