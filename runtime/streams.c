// Stream executor for scheduled functions (passes/schedule.c; tasks emitted by codegen/emit_c.c).
//
// An RtStreams runs one thread per stream that has tasks: the compute stream on the calling
// thread, intra and inter on two worker threads of its own that are created on first use and
// reused by every later rt_run_streams call (parked on a condition variable in between), until
// rt_streams_destroy stops and joins them. Each stream runs its own tasks in table (= program)
// order; before a task it waits until every event in its wait list has been recorded, after it
// records its event. Events are flags local to one call (cleared at the start), set with
// release stores under the executor's mutex and broadcast on its condition variable; a waiter
// checks the flag with an acquire load first and sleeps only when it is not yet set. The call
// returns when every stream has finished (a full synchronisation, which is what the schedule
// assumes at function boundaries). Nothing is shared between two RtStreams.
//
// MPI: the tasks of different streams issue collectives concurrently, on different groups
// (codegen orders collectives on one group across streams with extra waits). That needs
// MPI_THREAD_MULTIPLE: when the communicator cannot take it (rt_comm_thread_safe), or
// MOERT_STREAMS=0 is set, the tasks run one after the other in table order on the calling thread
// (the program order, always correct). A task that fails exits through rt_comm_abort, as
// everywhere in the runtime.
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "moert.h"
#include "rt_internal.h"

typedef struct Worker {
  RtStreams *ex;
  int stream;
} Worker;

struct RtStreams {
  bool threaded;                // false: program order on the calling thread
  pthread_mutex_t mu;
  pthread_cond_t cv;            // events recorded, work handed out, work finished, stop
  pthread_t thread[RT_STREAM_COUNT];
  Worker worker[RT_STREAM_COUNT];
  bool started, stopping;
  unsigned gen[RT_STREAM_COUNT];  // bumped to hand stream s the current job
  int busy;                     // workers still running the current job
  RtStep *st;
  const RtTask *tasks;
  int ntasks;
  atomic_int *events;
  int cap;
};

RtStreams *rt_streams_create(const RtComm *comm) {
  RtStreams *ex = rt_calloc(1, sizeof *ex, "the stream executor");
  const char *env = getenv("MOERT_STREAMS");
  ex->threaded = !(env && strcmp(env, "0") == 0) && rt_comm_thread_safe(comm);
  pthread_mutex_init(&ex->mu, NULL);
  pthread_cond_init(&ex->cv, NULL);
  return ex;
}

void rt_streams_destroy(RtStreams *ex) {
  if (!ex)
    return;
  if (ex->started) {
    pthread_mutex_lock(&ex->mu);
    ex->stopping = true;
    pthread_cond_broadcast(&ex->cv);
    pthread_mutex_unlock(&ex->mu);
    for (int s = RT_STREAM_COMPUTE + 1; s < RT_STREAM_COUNT; s++)
      pthread_join(ex->thread[s], NULL);
  }
  pthread_cond_destroy(&ex->cv);
  pthread_mutex_destroy(&ex->mu);
  free(ex->events);
  free(ex);
}

// A wait of the compute stream's thread is idle time for --profile (profile.c; the workers'
// waits are not counted there).
static void wait_event(RtStreams *ex, int e) {
  if (atomic_load_explicit(&ex->events[e], memory_order_acquire)) return;
  int64_t t0 = rt_prof_on() ? rt_mono_ns() : 0;
  pthread_mutex_lock(&ex->mu);
  while (!atomic_load_explicit(&ex->events[e], memory_order_acquire)) pthread_cond_wait(&ex->cv, &ex->mu);
  pthread_mutex_unlock(&ex->mu);
  if (t0) rt_prof_idle(t0, rt_mono_ns());
}

static void record_event(RtStreams *ex, int e) {
  pthread_mutex_lock(&ex->mu);
  atomic_store_explicit(&ex->events[e], 1, memory_order_release);
  pthread_cond_broadcast(&ex->cv);
  pthread_mutex_unlock(&ex->mu);
}

static void run_stream(RtStreams *ex, int s) {
  for (int i = 0; i < ex->ntasks; i++) {
    const RtTask *t = &ex->tasks[i];
    if (t->stream != s) continue;
    for (int w = 0; w < t->nwaits; w++) wait_event(ex, t->waits[w]);
    t->fn(ex->st);
    if (t->event >= 0) record_event(ex, t->event);
  }
}

static void *worker_main(void *arg) {
  Worker *me = arg;
  RtStreams *ex = me->ex;
  int s = me->stream;
  unsigned seen = 0;
  rt_prof_set_worker();
  for (;;) {
    pthread_mutex_lock(&ex->mu);
    while (ex->gen[s] == seen && !ex->stopping) pthread_cond_wait(&ex->cv, &ex->mu);
    bool stop = ex->stopping;
    seen = ex->gen[s];
    pthread_mutex_unlock(&ex->mu);
    if (stop) return NULL;
    run_stream(ex, s);
    pthread_mutex_lock(&ex->mu);
    ex->busy--;
    pthread_cond_broadcast(&ex->cv);
    pthread_mutex_unlock(&ex->mu);
  }
}

void rt_run_streams(RtStreams *ex, RtStep *st, const RtTask *tasks, int ntasks, int nevents) {
  if (!ex || !ex->threaded) {  // program order on this thread
    for (int i = 0; i < ntasks; i++) tasks[i].fn(st);
    return;
  }
  if (nevents > ex->cap) {
    atomic_int *ev = realloc(ex->events, (size_t)nevents * sizeof *ev);
    if (!ev) rt_out_of_memory((size_t)nevents * sizeof *ev, "the stream events");
    ex->events = ev;
    ex->cap = nevents;
  }
  for (int e = 0; e < nevents; e++) atomic_init(&ex->events[e], 0);
  bool has[RT_STREAM_COUNT] = {false};
  for (int i = 0; i < ntasks; i++) {
    if (tasks[i].stream < 0 || tasks[i].stream >= RT_STREAM_COUNT)
      rt_comm_abort("internal error: task %d is on stream %d, which does not exist", i, tasks[i].stream);
    for (int w = 0; w < tasks[i].nwaits; w++)
      if (tasks[i].waits[w] < 0 || tasks[i].waits[w] >= nevents)
        rt_comm_abort("internal error: task %d waits for event %d of %d", i, tasks[i].waits[w], nevents);
    has[tasks[i].stream] = true;
  }
  pthread_mutex_lock(&ex->mu);
  if (!ex->started) {
    for (int s = RT_STREAM_COMPUTE + 1; s < RT_STREAM_COUNT; s++) {
      ex->worker[s] = (Worker){ex, s};
      if (pthread_create(&ex->thread[s], NULL, worker_main, &ex->worker[s]) != 0)
        rt_comm_abort("cannot start the threads of the intra and inter streams");
    }
    ex->started = true;
  }
  ex->st = st;
  ex->tasks = tasks;
  ex->ntasks = ntasks;
  ex->busy = 0;
  for (int s = RT_STREAM_COMPUTE + 1; s < RT_STREAM_COUNT; s++)
    if (has[s]) {
      ex->gen[s]++;
      ex->busy++;
    }
  pthread_cond_broadcast(&ex->cv);
  pthread_mutex_unlock(&ex->mu);
  run_stream(ex, RT_STREAM_COMPUTE);
  int64_t t0 = rt_prof_on() ? rt_mono_ns() : 0;
  pthread_mutex_lock(&ex->mu);
  while (ex->busy > 0) pthread_cond_wait(&ex->cv, &ex->mu);
  pthread_mutex_unlock(&ex->mu);
  if (t0) rt_prof_idle(t0, rt_mono_ns());
}
