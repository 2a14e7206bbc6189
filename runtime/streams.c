// Stream executor for scheduled functions (passes/schedule.c; tasks emitted by codegen/emit_c.c).
//
// rt_run_streams(st, tasks, n, nevents) runs one thread per stream that has tasks: the compute
// stream on the calling thread, intra and inter on two worker threads that are created on first
// use and reused by every later call (parked on a condition variable in between). Each stream
// runs its own tasks in table (= program) order; before a task it waits until every event in
// its wait list has been recorded, after it records its event. Events are flags local to one
// call (cleared at the start), set with release stores under one mutex and broadcast on one
// condition variable; a waiter checks the flag with an acquire load first and sleeps only when
// it is not yet set. The call returns when every stream has finished (a full synchronisation,
// which is what the schedule assumes at function boundaries).
//
// MPI: the tasks of different streams issue collectives concurrently, on different groups
// (codegen orders collectives on one group across streams with extra waits). That needs
// MPI_THREAD_MULTIPLE: when MPI provides less, or MOERT_STREAMS=0 is set, the tasks run one
// after the other in table order on the calling thread (the program order, always correct).
// A task that fails exits through rt_comm_abort, as everywhere in the runtime.
#include <mpi.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "moert.h"

static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;            // events recorded, work handed out, work finished
  pthread_t worker[RT_STREAM_COUNT];
  bool started;
  unsigned gen[RT_STREAM_COUNT];  // bumped to hand stream s the current job
  int busy;                     // workers still running the current job
  RtStep *st;
  const RtTask *tasks;
  int ntasks;
  atomic_int *events;
  int cap;
} ex = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static int mode = -1;  // 1 threaded, 0 sequential

static void wait_event(int e) {
  if (atomic_load_explicit(&ex.events[e], memory_order_acquire)) return;
  pthread_mutex_lock(&ex.mu);
  while (!atomic_load_explicit(&ex.events[e], memory_order_acquire)) pthread_cond_wait(&ex.cv, &ex.mu);
  pthread_mutex_unlock(&ex.mu);
}

static void record_event(int e) {
  pthread_mutex_lock(&ex.mu);
  atomic_store_explicit(&ex.events[e], 1, memory_order_release);
  pthread_cond_broadcast(&ex.cv);
  pthread_mutex_unlock(&ex.mu);
}

static void run_stream(int s) {
  for (int i = 0; i < ex.ntasks; i++) {
    const RtTask *t = &ex.tasks[i];
    if (t->stream != s) continue;
    for (int w = 0; w < t->nwaits; w++) wait_event(t->waits[w]);
    t->fn(ex.st);
    if (t->event >= 0) record_event(t->event);
  }
}

static void *worker_main(void *arg) {
  int s = (int)(intptr_t)arg;
  unsigned seen = 0;
  for (;;) {
    pthread_mutex_lock(&ex.mu);
    while (ex.gen[s] == seen) pthread_cond_wait(&ex.cv, &ex.mu);
    seen = ex.gen[s];
    pthread_mutex_unlock(&ex.mu);
    run_stream(s);
    pthread_mutex_lock(&ex.mu);
    ex.busy--;
    pthread_cond_broadcast(&ex.cv);
    pthread_mutex_unlock(&ex.mu);
  }
  return NULL;
}

static int threaded(void) {
  if (mode >= 0) return mode;
  const char *env = getenv("MOERT_STREAMS");
  mode = !(env && strcmp(env, "0") == 0);
  int init = 0, fin = 0, level = MPI_THREAD_MULTIPLE;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) MPI_Query_thread(&level);
  if (level < MPI_THREAD_MULTIPLE) mode = 0;
  return mode;
}

void rt_run_streams(RtStep *st, const RtTask *tasks, int ntasks, int nevents) {
  if (!threaded()) {  // program order on this thread
    for (int i = 0; i < ntasks; i++) tasks[i].fn(st);
    return;
  }
  if (nevents > ex.cap) {
    atomic_int *ev = realloc(ex.events, (size_t)nevents * sizeof *ev);
    if (!ev) rt_comm_abort("moert: out of memory (stream events)");
    ex.events = ev;
    ex.cap = nevents;
  }
  for (int e = 0; e < nevents; e++) atomic_init(&ex.events[e], 0);
  bool has[RT_STREAM_COUNT] = {false};
  for (int i = 0; i < ntasks; i++) {
    if (tasks[i].stream < 0 || tasks[i].stream >= RT_STREAM_COUNT) rt_comm_abort("moert: task %d: bad stream %d", i, tasks[i].stream);
    for (int w = 0; w < tasks[i].nwaits; w++)
      if (tasks[i].waits[w] < 0 || tasks[i].waits[w] >= nevents) rt_comm_abort("moert: task %d: bad event", i);
    has[tasks[i].stream] = true;
  }
  pthread_mutex_lock(&ex.mu);
  if (!ex.started) {
    for (int s = RT_STREAM_COMPUTE + 1; s < RT_STREAM_COUNT; s++) {
      pthread_attr_t attr;
      pthread_attr_init(&attr);
      pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
      if (pthread_create(&ex.worker[s], &attr, worker_main, (void *)(intptr_t)s) != 0)
        rt_comm_abort("moert: cannot start the stream threads");
      pthread_attr_destroy(&attr);
    }
    ex.started = true;
  }
  ex.st = st;
  ex.tasks = tasks;
  ex.ntasks = ntasks;
  ex.busy = 0;
  for (int s = RT_STREAM_COMPUTE + 1; s < RT_STREAM_COUNT; s++)
    if (has[s]) {
      ex.gen[s]++;
      ex.busy++;
    }
  pthread_cond_broadcast(&ex.cv);
  pthread_mutex_unlock(&ex.mu);
  run_stream(RT_STREAM_COMPUTE);
  pthread_mutex_lock(&ex.mu);
  while (ex.busy > 0) pthread_cond_wait(&ex.cv, &ex.mu);
  pthread_mutex_unlock(&ex.mu);
}
