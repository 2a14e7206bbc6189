// --profile's communication figures: how long collectives were in flight in a step, and how
// much of that time the compute thread spent computing rather than waiting.
//
// Two kinds of intervals are recorded while profiling is on (rt_prof_enable), from any thread:
//   comm  a collective from its call to its return (comm.c, every rt_alltoall ... rt_bcast),
//         also summed per kind (AlltoAll, AllGather, ReduceScatter, AllReduce, the others);
//   idle  the compute thread not computing: inside a collective of its own (sequential
//         schedules run every collective there), or asleep in the stream executor until an
//         event of another stream is recorded or until the other streams finish (streams.c).
// rt_prof_take sweeps the step's intervals: `comm` is the measure of the union of comm
// intervals, `hidden` the part of it during which the compute thread was not idle, so a
// schedule with no overlap reports 0 hidden and a perfect one reports all of it.
//
// The compute thread is the one that calls rt_run_streams; the executor's worker threads mark
// themselves with rt_prof_set_worker so that a collective on them is not counted as idle.
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "rt_internal.h"

typedef struct Interval {
  int64_t t0, t1;
  bool idle;            // else comm
} Interval;

static struct {
  atomic_bool on;
  pthread_mutex_t mu;
  Interval *iv;
  size_t n, cap;
  int64_t kind_ns[RT_PROF_KINDS];   // summed per kind of collective (overlaps counted twice)
} prof = {.mu = PTHREAD_MUTEX_INITIALIZER};

static _Thread_local bool on_worker;

int64_t rt_mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

void rt_prof_enable(bool on) {
  pthread_mutex_lock(&prof.mu);
  prof.n = 0;
  for (int k = 0; k < RT_PROF_KINDS; k++) prof.kind_ns[k] = 0;
  atomic_store(&prof.on, on);
  pthread_mutex_unlock(&prof.mu);
}

bool rt_prof_on(void) { return atomic_load_explicit(&prof.on, memory_order_relaxed); }

void rt_prof_set_worker(void) { on_worker = true; }

// Under prof.mu.
static void add_locked(int64_t t0, int64_t t1, bool idle) {
  if (prof.n == prof.cap) {
    size_t cap = prof.cap ? 2 * prof.cap : 256;
    Interval *iv = realloc(prof.iv, cap * sizeof *iv);
    if (!iv) rt_out_of_memory(cap * sizeof *iv, "the communication profile");
    prof.iv = iv;
    prof.cap = cap;
  }
  prof.iv[prof.n++] = (Interval){t0, t1, idle};
}

void rt_prof_comm(RtProfKind kind, int64_t t0, int64_t t1) {
  if (!rt_prof_on() || t1 <= t0) return;
  pthread_mutex_lock(&prof.mu);
  prof.kind_ns[kind] += t1 - t0;
  add_locked(t0, t1, false);
  if (!on_worker) add_locked(t0, t1, true);
  pthread_mutex_unlock(&prof.mu);
}

void rt_prof_idle(int64_t t0, int64_t t1) {
  if (!rt_prof_on() || t1 <= t0 || on_worker) return;
  pthread_mutex_lock(&prof.mu);
  add_locked(t0, t1, true);
  pthread_mutex_unlock(&prof.mu);
}

typedef struct Edge {
  int64_t t;
  int d_comm, d_idle;
} Edge;

static int by_time(const void *a, const void *b) {
  int64_t x = ((const Edge *)a)->t, y = ((const Edge *)b)->t;
  return (x > y) - (x < y);
}

void rt_prof_take(double *comm_ms, double *hidden_ms, double *per_kind) {
  pthread_mutex_lock(&prof.mu);
  for (int k = 0; k < RT_PROF_KINDS; k++) {
    if (per_kind) per_kind[k] = (double)prof.kind_ns[k] * 1e-6;
    prof.kind_ns[k] = 0;
  }
  size_t n = prof.n;
  Edge *e = n ? malloc(2 * n * sizeof *e) : NULL;
  if (n && !e) rt_out_of_memory(2 * n * sizeof *e, "the communication profile");
  for (size_t i = 0; i < n; i++) {
    const Interval *v = &prof.iv[i];
    e[2 * i] = (Edge){v->t0, v->idle ? 0 : 1, v->idle ? 1 : 0};
    e[2 * i + 1] = (Edge){v->t1, v->idle ? 0 : -1, v->idle ? -1 : 0};
  }
  prof.n = 0;
  pthread_mutex_unlock(&prof.mu);
  if (n) qsort(e, 2 * n, sizeof *e, by_time);
  int64_t comm = 0, hidden = 0;
  int in_comm = 0, in_idle = 0;
  for (size_t i = 0; i < 2 * n; i++) {
    if (i > 0 && in_comm > 0) {
      int64_t dt = e[i].t - e[i - 1].t;
      comm += dt;
      if (in_idle == 0) hidden += dt;
    }
    in_comm += e[i].d_comm;
    in_idle += e[i].d_idle;
  }
  free(e);
  *comm_ms = (double)comm * 1e-6;
  *hidden_ms = (double)hidden * 1e-6;
}
