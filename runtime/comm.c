// Ranks, groups and collectives of the CPU backend, over MPI.
//
// The parallel layout (moert.h) fixes every group arithmetically: MP and ESP groups are runs of
// consecutive world ranks, DP groups stride by mp, EP groups by esp, and node n holds world
// ranks [n*gpus_per_node, (n+1)*gpus_per_node). So each rank can compute every group's members,
// and every layout check, on its own: rt_comm_create needs no collective to agree that a layout
// is bad (all ranks fail the same checks, none waits for another), and rank 0 prints the whole
// group table without asking anyone. Each group is one communicator from MPI_Comm_split of a
// duplicate of MPI_COMM_WORLD, keyed by world rank, so a rank's index in a group is its
// coordinate (dp index = rank / mp, ...).
//
// An RtComm is one such set of groups with everything its collectives need (workspaces, the
// slicing limit); nothing of it is shared, so several can live side by side (a test makes its
// own next to the driver's). A NULL RtComm is a world of one, and so is any group of one: there
// every collective is a local copy, so code for one rank calls them unconditionally. A layout of
// NULL is all data parallel (dp = ep = world); gpus_per_node <= 0 (no cluster profile) puts
// every rank on one node.
//
// MPI itself is one per process and cannot start again once finalized: the first rt_comm_create
// starts it when nothing else has, and then the last rt_comm_destroy finalizes it (mpi_use, the
// only state of this file outside an RtComm). Create and destroy communicators on one thread.
//
// AlltoAll on a group of P = N nodes x L members per node. Members are ordered by world rank,
// hence node-major: member m = node n * L + local index l.
//   flat  one MPI_Alltoall.
//   1dh   (HetuMoE) every member's whole send buffer is gathered on its node's leader (local
//         index 0); the leaders exchange one aggregated block per pair of nodes (the L*L blocks
//         from the sender's members to the receiver's members) with MPI_Alltoall; each leader
//         scatters to its members the blocks addressed to them.
//   2dh   (Tutel, DeepSpeed) blocks are regrouped by destination local index, an intra-node
//         MPI_Alltoall hands them to the member with that local index, a stride transform makes
//         the blocks for the same destination node contiguous, and an inter-node MPI_Alltoall
//         among the members with the same local index delivers them. Because members are
//         node-major, what arrives is already in source order: the final reorder is the
//         identity, except for unpacking a slice (below).
// Every group gets two more communicators for this: its members on this rank's node (intra)
// and its members with this rank's local index, one per node (inter). A group whose members
// are not spread evenly over nodes has no such hierarchy: there 1dh and 2dh run flat, and
// rt_comm_print_groups says so for the EP groups. One node (N = 1) or one member per node
// (L = 1) is still a regular hierarchy; the algorithms then run with groups of one on a side.
//
// Counts are int64, MPI takes int. A call whose counts do not fit is cut into slices: elements
// [o, o + len) of every block, each slice a complete collective of its own (flat AlltoAll and
// AllGather address the slices in place with a resized datatype; ReduceScatter reduces each
// member's slice to it with MPI_Reduce). rt_comm_set_max_chunk (rt_internal.h) lowers one
// communicator's limit so that tests exercise the slicing with small buffers.
//
// Errors: every communicator (MPI_COMM_WORLD too) returns errors (MPI_ERRORS_RETURN) and
// MPI_CHECK turns one into rt_comm_abort (fatal.c) with the MPI error string, the rank, host and
// file:line: a failed collective ends the whole job (MPI_Abort), never just one rank; one that
// does not complete within the deadline (finish below) too. A rank that dies outright is mpirun's
// business: Open MPI kills the job when a process exits abnormally.
//
// Building: the MPI headers (`mpicc --showme:compile`) and, for every program that links
// libmoert, -lmpi (`mpicc --showme:link`).
//
// Buffers: send and recv of one call must not overlap (MPI's rule); rt_allreduce is in place.
//
// Threads: MPI_THREAD_MULTIPLE is requested so that collectives on different groups may run on
// different threads (the intra and inter streams); two collectives on the same group must not
// run at the same time (MPI's rule, and the group's workspace relies on it).
#include <mpi.h>

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "moert.h"
#include "rt_internal.h"
#include "rt_mpi.h"

typedef struct Hierarchy {
  bool regular;          // every node that holds members holds the same number of them
  int nodes, per_node;   // N and L
  MPI_Comm intra, inter; // MPI_COMM_NULL unless regular
} Hierarchy;

typedef struct Group {
  RtGroup id;
  const char *what;      // the collective running on it now, for the timeout's message
  int64_t began;         //   and when it started (one at a time per group: MPI's rule)
  MPI_Comm comm;
  int rank, size;
  Hierarchy hier;
  float *work;           // scratch of the hierarchical AlltoAll and the ring AllReduce, grown on demand
  size_t work_floats;
} Group;

// Gradient accumulation over microbatches (rt_comm_grad_hook): the reductions of the gradient
// buffer's elements skipped (every microbatch but the last), or preceded by the addition of the
// earlier microbatches' sums (the last), each such range recorded.
typedef struct GradHook {
  int mode;                   // RT_GRAD_HOOK_*
  float *grads, *acc;
  int64_t n;
  pthread_mutex_t lock;       // the collectives of a backward run on several streams' threads
  int64_t (*done)[2];         // [ndone] offset, count of the ranges reduced in ADD mode
  int ndone, max_done;
} GradHook;

struct RtComm {
  GradHook hook;
  int thread_level;
  RtLayout layout;       // gpus_per_node already resolved (never <= 0)
  int world_rank, world_size;   // in this rank's pipeline stage (the whole job when pp is 1)
  // Pipeline stages (layout.pp > 1): this rank's stage, the communicator of the ranks with its
  // place in every stage (point-to-point between neighbouring stages, sums over stages) and the
  // whole job's.
  int stage, stages;
  MPI_Comm pp, all;
  int64_t max_chunk;     // the largest count of one MPI call
  Group group[RT_GROUP_COUNT];
};

// The process's MPI: started by rt_comm_create (then finalized with the last communicator) or
// by the program before it (then the program's to finalize).
static struct {
  bool started;          // rt_comm_create called MPI_Init_thread
  int live;              // communicators created and not yet destroyed
} mpi_use;

// (and the pipeline's point-to-point messages, between the ranks of one place in every stage)
enum { PP_GROUP = RT_GROUP_COUNT };
static const char *const group_names[RT_GROUP_COUNT + 1] = {"world", "dp", "mp", "ep", "esp", "pp"};

// ---- waiting ----
//
// Every collective is a nonblocking MPI call finished by finish() (rt_internal.h says the
// policy): Open MPI progresses its TCP transport and its nonblocking collectives only inside MPI
// calls, so the waiter tests; between tests it sleeps, so that on a rank whose streams share a
// core the communication threads do not take the compute thread's time. A rank whose peer or
// link is gone would wait forever in MPI (TCP retransmits for minutes): the deadline turns that
// into an error naming the collective.

enum { WAIT_SLEEP, WAIT_SPIN };

static struct {
  pthread_once_t once;
  int mode;
  int64_t poll_ns;          // the longest sleep between two tests
  _Atomic int64_t timeout_ns;   // <= 0: no deadline
} waiting = {.once = PTHREAD_ONCE_INIT};

static void waiting_from_env(void) {
  const char *mode = getenv("MOERT_COMM_WAIT"), *poll = getenv("MOERT_COMM_POLL_US"),
             *timeout = getenv("MOERT_COMM_TIMEOUT");
  waiting.mode = mode && strcmp(mode, "spin") == 0 ? WAIT_SPIN : WAIT_SLEEP;
  double us = poll ? atof(poll) : 0;
  waiting.poll_ns = us >= 1 ? (int64_t)(us * 1e3) : 200000;   // default 200 us
  double s = timeout ? atof(timeout) : 20.0;
  atomic_store(&waiting.timeout_ns, s > 0 ? (int64_t)(s * 1e9) : 0);
}

static void waiting_init(void) { pthread_once(&waiting.once, waiting_from_env); }

void rt_comm_set_timeout(double seconds) {
  waiting_init();
  atomic_store(&waiting.timeout_ns, seconds > 0 ? (int64_t)(seconds * 1e9) : 0);
}

// Completes req, a step of the collective `what` on group g that began at `began` (ns); call and
// line name the MPI call that started it, for an error that MPI_Test reports.
static void finish(MPI_Request *req, const char *what, int g, int64_t began, const char *call, int line) {
  int done = 0;
#define TEST_CHECK(err) rt_mpi_check((err), call, __FILE__, line)
  TEST_CHECK(MPI_Test(req, &done, MPI_STATUS_IGNORE));
  if (done)
    return;
  int64_t timeout = atomic_load_explicit(&waiting.timeout_ns, memory_order_relaxed);
  int64_t nap = 2000;   // ns; doubles up to poll_ns
  for (long tries = 1;; tries++) {
    TEST_CHECK(MPI_Test(req, &done, MPI_STATUS_IGNORE));
    if (done)
      return;
    if ((tries & 63) == 0 || waiting.mode == WAIT_SLEEP) {
      int64_t waited = rt_mono_ns() - began;
      if (timeout > 0 && waited > timeout)
        rt_comm_abort("the %s on the %s group has not completed after %.0f s: a link or a rank of "
                      "the job is down, or the network is far slower than the job allows "
                      "(--comm-timeout SECONDS sets the limit, 0 waits forever)", what,
                      group_names[g], (double)waited * 1e-9);
    }
    if (waiting.mode == WAIT_SPIN || tries < 16)
      continue;
    struct timespec ts = {0, (long)nap};
    nanosleep(&ts, NULL);
    if (nap < waiting.poll_ns)
      nap = nap * 2 < waiting.poll_ns ? nap * 2 : waiting.poll_ns;
  }
#undef TEST_CHECK
}

// Runs one nonblocking MPI call and waits for it: NB(MPI_Ialltoall(..., &req)).
#define NB(gr, call)                                                                               \
  do {                                                                                             \
    MPI_Request req;                                                                               \
    MPI_CHECK(call);                                                                               \
    finish(&req, (gr)->what, (gr)->id, (gr)->began, #call, __LINE__);                             \
  } while (0)

static void *workspace(Group *gr, size_t floats) {
  if (floats > gr->work_floats) {
    free(gr->work);
    gr->work = rt_alloc(floats * sizeof(float), "the AlltoAll workspace");
    gr->work_floats = floats;
  }
  return gr->work;
}

// ---- the layout ----

// The world ranks of the members of group g that world rank r belongs to, in group order.
// Returns how many.
static int group_members(const RtLayout *l, int world, RtGroup g, int r, int *out) {
  switch (g) {
  case RT_GROUP_WORLD:
    for (int i = 0; i < world; i++) out[i] = i;
    return world;
  case RT_GROUP_DP:
    for (int i = 0; i < l->dp; i++) out[i] = r % l->mp + i * l->mp;
    return l->dp;
  case RT_GROUP_MP:
    for (int i = 0; i < l->mp; i++) out[i] = r / l->mp * l->mp + i;
    return l->mp;
  case RT_GROUP_EP:
    for (int i = 0; i < l->ep; i++) out[i] = r % l->esp + i * l->esp;
    return l->ep;
  case RT_GROUP_ESP:
    for (int i = 0; i < l->esp; i++) out[i] = r / l->esp * l->esp + i;
    return l->esp;
  case RT_GROUP_COUNT:
    break;
  }
  rt_comm_abort("internal error: unknown group %d", (int)g);
}

// The MPI_Comm_split color of rank r in group g: equal colors, same group.
static int group_color(const RtLayout *l, RtGroup g, int r) {
  switch (g) {
  case RT_GROUP_WORLD: return 0;
  case RT_GROUP_DP: return r % l->mp;
  case RT_GROUP_MP: return r / l->mp;
  case RT_GROUP_EP: return r % l->esp;
  case RT_GROUP_ESP: return r / l->esp;
  case RT_GROUP_COUNT: break;
  }
  rt_comm_abort("internal error: unknown group %d", (int)g);
}

// Nodes and members per node of a group. Members ascend, so each node's members are one run.
// counts, when given, receives the members of each node (at most n entries). Regular when all
// runs are equal; *per_node is then their length, else 0.
static bool hierarchy_of(const int *members, int n, int gpus_per_node, int *nodes, int *per_node,
                         int *counts) {
  int runs = 0, first = 0, first_run = 0;
  bool regular = true;
  for (int i = 1; i <= n; i++) {
    if (i < n && members[i] / gpus_per_node == members[first] / gpus_per_node)
      continue;
    int run = i - first;
    if (counts)
      counts[runs] = run;
    if (runs == 0)
      first_run = run;
    else if (run != first_run)
      regular = false;
    runs++;
    first = i;
  }
  *nodes = runs;
  *per_node = regular ? first_run : 0;
  return regular;
}

static int layout_error(int rank, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int layout_error(int rank, const char *fmt, ...) {
  if (rank == 0) {
    va_list ap;
    va_start(ap, fmt);
    fputs("moert: error: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    fflush(stderr);
  }
  return 1;
}

// The checks every rank makes on its own; rank 0 prints each failure. Returns how many failed.
static int check_layout(const RtLayout *l, int world, int nodes, int rank) {
  if (l->dp < 1 || l->mp < 1 || l->ep < 1 || l->esp < 1)
    return layout_error(rank, "the parallel sizes must be at least 1, not dp %d, mp %d, ep %d, "
                        "esp %d", l->dp, l->mp, l->ep, l->esp);
  int errors = 0;
  int64_t dp_mp = (int64_t)l->dp * l->mp, ep_esp = (int64_t)l->ep * l->esp;
  int gpn = l->gpus_per_node;
  if (dp_mp == ep_esp && dp_mp != world)  // one message for the usual mistake: the wrong -np
    errors += layout_error(rank, "the layout needs %lld rank%s (dp %d x mp %d = ep %d x esp %d) but %d %s "
                           "running; start it with mpirun -np %lld", (long long)dp_mp, dp_mp == 1 ? "" : "s", l->dp, l->mp, l->ep,
                           l->esp, world, world == 1 ? "is" : "are", (long long)dp_mp);
  else if (dp_mp != world)
    errors += layout_error(rank, "the layout needs dp %d x mp %d = %lld ranks but %d %s running",
                           l->dp, l->mp, (long long)dp_mp, world, world == 1 ? "is" : "are");
  if (dp_mp != ep_esp && ep_esp != world)
    errors += layout_error(rank, "the layout needs ep %d x esp %d = %lld ranks but %d %s running",
                           l->ep, l->esp, (long long)ep_esp, world, world == 1 ? "is" : "are");
  // A run of size s starting at multiples of s crosses the boundary at gpn exactly when s does
  // not divide gpn, and that boundary exists when the world is larger than one node.
  if (world > gpn && gpn % l->mp != 0)
    errors += layout_error(rank, "mp %d does not divide gpus_per_node %d: the MP groups would "
                           "span nodes", l->mp, gpn);
  if (world > gpn && gpn % l->esp != 0)
    errors += layout_error(rank, "esp %d does not divide gpus_per_node %d: the ESP groups would "
                           "span nodes", l->esp, gpn);
  if (nodes > 0 && dp_mp > (int64_t)nodes * gpn)
    errors += layout_error(rank, "the layout needs %lld ranks but the cluster has %lld (%d node%s "
                           "x %d gpus_per_node)", (long long)dp_mp, (long long)nodes * gpn, nodes,
                           nodes == 1 ? "" : "s", gpn);
  return errors;
}

// ---- init and finalize ----

static MPI_Comm split(MPI_Comm parent, int color, int key) {
  MPI_Comm c;
  MPI_CHECK(MPI_Comm_split(parent, color, key, &c));
  MPI_CHECK(MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN));
  return c;
}

static void build_group(RtComm *c, RtGroup g, MPI_Comm world, int *members) {
  Group *gr = &c->group[g];
  const RtLayout *l = &c->layout;
  int r = c->world_rank;
  gr->id = g;
  gr->comm = split(world, group_color(l, g, r), r);
  MPI_CHECK(MPI_Comm_rank(gr->comm, &gr->rank));
  MPI_CHECK(MPI_Comm_size(gr->comm, &gr->size));
  int n = group_members(l, c->world_size, g, r, members);
  if (n != gr->size || members[gr->rank] != r)
    rt_comm_abort("internal error: the %s group of rank %d has %d members where MPI made %d",
                  group_names[g], r, n, gr->size);

  Hierarchy *h = &gr->hier;
  h->intra = h->inter = MPI_COMM_NULL;
  h->regular = hierarchy_of(members, n, l->gpus_per_node, &h->nodes, &h->per_node, NULL);
  if (h->regular) {
    // Every member computed the same members, so all agree on `regular` and the splits match.
    h->intra = split(gr->comm, r / l->gpus_per_node, gr->rank);
    h->inter = split(gr->comm, gr->rank % h->per_node, gr->rank);
  }
}

// Finalizes MPI when rt_comm_create started it and no communicator is left.
static void release_mpi(void) {
  if (mpi_use.started && mpi_use.live == 0) {
    MPI_Finalize();
    mpi_use.started = false;
  }
}

RtComm *rt_comm_create(const RtLayout *layout, int nodes) {
  waiting_init();
  int initialized = 0, finalized = 0, thread_level = MPI_THREAD_SINGLE;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) {
    fprintf(stderr, "moert: error: internal error: rt_comm_create called after MPI was finalized\n");
    return NULL;
  }
  if (initialized) {
    MPI_Query_thread(&thread_level);
  } else {
    MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &thread_level);
    mpi_use.started = true;
  }
  int world_rank, world_size;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);

  RtLayout l = layout ? *layout : (RtLayout){world_size, 1, world_size, 1, 0, 1};
  if (l.pp < 1)
    l.pp = 1;
  int64_t stage_size = (int64_t)l.dp * l.mp;
  if (l.pp > 1 && stage_size * l.pp != world_size) {
    layout_error(world_rank, "the layout needs pp %d x dp %d x mp %d = %lld ranks but %d %s running; start it "
                 "with mpirun -np %lld", l.pp, l.dp, l.mp, (long long)(stage_size * l.pp), world_size,
                 world_size == 1 ? "is" : "are", (long long)(stage_size * l.pp));
    release_mpi();
    return NULL;
  }
  int all_rank = world_rank;
  if (l.pp > 1) {   // the rest of the communicator is the stage's
    world_rank = all_rank % (int)stage_size;
    world_size = (int)stage_size;
  }
  if (l.gpus_per_node <= 0)
    l.gpus_per_node = world_size;   // unknown cluster: one node holds every rank
  if (check_layout(&l, world_size, l.pp > 1 ? 0 : nodes, world_rank) != 0) {
    release_mpi();
    return NULL;
  }

  RtComm *c = rt_calloc(1, sizeof *c, "a communicator");
  c->thread_level = thread_level;
  c->layout = l;
  c->world_rank = world_rank;
  c->world_size = world_size;
  c->max_chunk = INT_MAX;
  c->stages = l.pp;
  c->stage = all_rank / world_size;
  c->pp = c->all = MPI_COMM_NULL;
  MPI_Comm world;
  if (l.pp > 1) {
    world = split(MPI_COMM_WORLD, c->stage, all_rank);
    c->pp = split(MPI_COMM_WORLD, world_rank, all_rank);
    MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &c->all));
    MPI_CHECK(MPI_Comm_set_errhandler(c->all, MPI_ERRORS_RETURN));
  } else {
    MPI_Comm_dup(MPI_COMM_WORLD, &world);
  }
  MPI_CHECK(MPI_Comm_set_errhandler(world, MPI_ERRORS_RETURN));
  // Open MPI raises the error of a failed nonblocking collective in MPI_Test on MPI_COMM_WORLD's
  // handler, not on the request's communicator: returned, it reaches rt_mpi_check (with the
  // name of the call that started the collective) like any other error.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int *members = rt_alloc(world_size * sizeof *members, "the group members");
  for (int g = 0; g < RT_GROUP_COUNT; g++)
    build_group(c, (RtGroup)g, world, members);
  free(members);
  MPI_CHECK(MPI_Comm_free(&world));
  mpi_use.live++;
  return c;
}

static void free_comm(MPI_Comm *c) {
  if (*c != MPI_COMM_NULL)
    MPI_CHECK(MPI_Comm_free(c));
  *c = MPI_COMM_NULL;
}

void rt_comm_destroy(RtComm *c) {
  if (!c)
    return;
  for (int g = 0; g < RT_GROUP_COUNT; g++) {
    Group *gr = &c->group[g];
    free_comm(&gr->hier.intra);
    free_comm(&gr->hier.inter);
    free_comm(&gr->comm);
    free(gr->work);
  }
  free_comm(&c->pp);
  free_comm(&c->all);
  if (c->hook.done) {
    pthread_mutex_destroy(&c->hook.lock);
    free(c->hook.done);
  }
  free(c);
  mpi_use.live--;
  release_mpi();
}

static void check_group(RtGroup g, const char *who) {
  if ((int)g < 0 || g >= RT_GROUP_COUNT)
    rt_comm_abort("internal error: %s on unknown group %d", who, (int)g);
}

int rt_comm_rank(const RtComm *c, RtGroup g) {
  check_group(g, "rt_comm_rank");
  return c ? c->group[g].rank : 0;
}

int rt_comm_size(const RtComm *c, RtGroup g) {
  check_group(g, "rt_comm_size");
  return c ? c->group[g].size : 1;
}

bool rt_comm_thread_safe(const RtComm *c) {
  return !c || c->thread_level >= MPI_THREAD_MULTIPLE;
}

MPI_Comm rt_comm_mpi(const RtComm *c, RtGroup g) {
  check_group(g, "rt_comm_mpi");
  return c ? c->group[g].comm : MPI_COMM_NULL;
}

void rt_comm_set_max_chunk(RtComm *c, int64_t elements) {
  c->max_chunk = elements < 1 ? 1 : elements > INT_MAX ? INT_MAX : elements;
}

bool rt_comm_hierarchy(const RtComm *c, RtGroup g, int *nodes, int *per_node) {
  check_group(g, "rt_comm_hierarchy");
  if (!c) {
    *nodes = *per_node = 1;
    return false;
  }
  const Hierarchy *h = &c->group[g].hier;
  *nodes = h->nodes;
  *per_node = h->per_node;
  return h->regular;
}

// ---- the group table ----

// "0,2,4,6"; a long list keeps its ends, "0,2,...,62" (every group is an arithmetic run).
static void format_members(char *buf, size_t size, const int *members, int n) {
  size_t used = 0;
  buf[0] = '\0';
  for (int i = 0; i < n && used < size; i++) {
    if (n > 8 && i == 2) {
      used += snprintf(buf + used, size - used, ",...");
      i = n - 2;   // the loop goes on with the last member
      continue;
    }
    used += snprintf(buf + used, size - used, "%s%d", i ? "," : "", members[i]);
  }
}

static const char *thread_level_name(int level) {
  switch (level) {
  case MPI_THREAD_SINGLE: return "single";
  case MPI_THREAD_FUNNELED: return "funneled";
  case MPI_THREAD_SERIALIZED: return "serialized";
  case MPI_THREAD_MULTIPLE: return "multiple";
  }
  return "unknown";
}

// Says how 1dh and 2dh run on the EP groups: one line when every EP group has the same
// hierarchy, else one line per group; an irregular group falls back to flat.
static void print_ep_hierarchy(const RtComm *c, FILE *out, int *members, int *counts) {
  const RtLayout *l = &c->layout;
  // EP group j (j < esp) is the one of world rank j.
  int nodes0 = 0, per_node0 = 0;
  bool regular0 = false, same = true;
  for (int first = 0; first < l->esp; first++) {
    int nodes, per_node;
    int n = group_members(l, c->world_size, RT_GROUP_EP, first, members);
    bool regular = hierarchy_of(members, n, l->gpus_per_node, &nodes, &per_node, NULL);
    if (first == 0) {
      regular0 = regular;
      nodes0 = nodes;
      per_node0 = per_node;
    }
    same = same && regular == regular0 && nodes == nodes0 && per_node == per_node0;
  }
  if (same && regular0) {
    fprintf(out, "# EP AlltoAll hierarchy (1dh, 2dh): %d node%s x %d member%s per node\n", nodes0,
            nodes0 == 1 ? "" : "s", per_node0, per_node0 == 1 ? "" : "s");
    return;
  }
  for (int first = 0; first < l->esp; first++) {
    int nodes, per_node;
    int n = group_members(l, c->world_size, RT_GROUP_EP, first, members);
    bool regular = hierarchy_of(members, n, l->gpus_per_node, &nodes, &per_node, counts);
    char list[128];
    format_members(list, sizeof list, members, n);
    if (regular) {
      fprintf(out, "# EP group {%s} AlltoAll hierarchy (1dh, 2dh): %d nodes x %d members per "
              "node\n", list, nodes, per_node);
      continue;
    }
    fprintf(out, "# note: EP group {%s} has ", list);
    for (int i = 0; i < nodes; i++)
      fprintf(out, "%s%d", i ? ", " : "", counts[i]);
    fprintf(out, " members on its %d nodes: 1dh and 2dh fall back to flat there\n", nodes);
  }
}

void rt_comm_print_groups(const RtComm *c, FILE *out) {
  if (!c || c->world_rank != 0)
    return;
  const RtLayout *l = &c->layout;
  int world = c->world_size, gpn = l->gpus_per_node;
  int nodes = (world + gpn - 1) / gpn;
  int *members = rt_alloc(2 * world * sizeof *members, "the layout report");
  int *counts = members + world;
  fprintf(out, "# parallel layout: %d rank%s = dp %d x mp %d = ep %d x esp %d; %d node%s "
          "(gpus_per_node %d); MPI thread level %s\n", world, world == 1 ? "" : "s", l->dp, l->mp,
          l->ep, l->esp, nodes, nodes == 1 ? "" : "s", gpn, thread_level_name(c->thread_level));
  print_ep_hierarchy(c, out, members, counts);

  static const RtGroup listed[] = {RT_GROUP_DP, RT_GROUP_MP, RT_GROUP_EP, RT_GROUP_ESP};
  enum { NLISTED = sizeof listed / sizeof listed[0] };
  int width[NLISTED];
  char list[128];
  for (int c = 0; c < NLISTED; c++) {
    width[c] = (int)strlen(group_names[listed[c]]) + 6;   // "dp group"
    for (int r = 0; r < world; r++) {
      format_members(list, sizeof list, members, group_members(l, world, listed[c], r, members));
      if ((int)strlen(list) > width[c])
        width[c] = (int)strlen(list);
    }
  }
  fprintf(out, "%5s %5s %4s %4s %4s %4s", "rank", "node", "dp", "mp", "ep", "esp");
  for (int c = 0; c < NLISTED; c++) {
    char head[16];
    snprintf(head, sizeof head, "%s group", group_names[listed[c]]);
    fprintf(out, "  %-*s", width[c], head);
  }
  fputc('\n', out);
  for (int r = 0; r < world; r++) {
    fprintf(out, "%5d %5d %4d %4d %4d %4d", r, r / gpn, r / l->mp, r % l->mp, r / l->esp,
            r % l->esp);
    for (int c = 0; c < NLISTED; c++) {
      format_members(list, sizeof list, members, group_members(l, world, listed[c], r, members));
      fprintf(out, "  %-*s", c + 1 < NLISTED ? width[c] : 0, list);
    }
    fputc('\n', out);
  }
  fflush(out);
  free(members);
}

// ---- collectives ----

static Group *active_group(RtComm *c, RtGroup g, const char *who, int64_t count) {
  check_group(g, who);
  if (count < 0)
    rt_comm_abort("internal error: %s with a negative count (%lld)", who, (long long)count);
  return c ? &c->group[g] : NULL;   // NULL: a world of one
}

static void copy_floats(float *dst, const float *src, int64_t n) {
  if (n > 0 && dst != src)
    memmove(dst, src, (size_t)n * sizeof(float));
}

// The slice [o, o + len) of each block of `stride` floats, as one datatype element.
static MPI_Datatype block_slice(int len, int64_t stride) {
  MPI_Datatype contiguous, slice;
  MPI_CHECK(MPI_Type_contiguous(len, MPI_FLOAT, &contiguous));
  MPI_Aint extent = (MPI_Aint)(stride * (int64_t)sizeof(float));
  MPI_CHECK(MPI_Type_create_resized(contiguous, 0, extent, &slice));
  MPI_CHECK(MPI_Type_commit(&slice));
  MPI_CHECK(MPI_Type_free(&contiguous));
  return slice;
}

static int slice_len(int64_t o, int64_t count, int64_t limit) {
  return (int)(count - o < limit ? count - o : limit);
}

static void alltoall_flat(Group *gr, const float *send, float *recv, int64_t count, int64_t max_chunk) {
  if (count <= max_chunk) {
    NB(gr, MPI_Ialltoall(send, (int)count, MPI_FLOAT, recv, (int)count, MPI_FLOAT, gr->comm, &req));
    return;
  }
  for (int64_t o = 0; o < count; o += max_chunk) {
    MPI_Datatype slice = block_slice(slice_len(o, count, max_chunk), count);
    NB(gr, MPI_Ialltoall(send + o, 1, slice, recv + o, 1, slice, gr->comm, &req));
    MPI_CHECK(MPI_Type_free(&slice));
  }
}

// Copies the slices [o, o + len) of n blocks of `stride` floats into n packed blocks of len,
// or back.
static void pack_slices(float *dst, const float *src, int n, int64_t stride, int64_t o, int len) {
  for (int i = 0; i < n; i++)
    memcpy(dst + (size_t)i * len, src + i * stride + o, (size_t)len * sizeof(float));
}

static void unpack_slices(float *dst, const float *src, int n, int64_t stride, int64_t o, int len) {
  for (int i = 0; i < n; i++)
    memcpy(dst + i * stride + o, src + (size_t)i * len, (size_t)len * sizeof(float));
}

// 1dh on the slice [o, o + len) of every block. Member m = n*L + l of P = N*L.
static void alltoall_1dh(Group *gr, const float *send, float *recv, int64_t count, int64_t o,
                         int len) {
  const Hierarchy *h = &gr->hier;
  int P = gr->size, N = h->nodes, L = h->per_node;
  int local = gr->rank % L;
  bool sliced = len != count;
  size_t block = (size_t)len, all = (size_t)P * len;
  // Leaders hold two buffers of L*P blocks; every member one of P blocks when slicing.
  size_t leader_floats = local == 0 ? 2 * (size_t)L * all : 0;
  float *work = workspace(gr, leader_floats + (sliced ? all : 0));
  float *gathered = NULL, *staged = NULL, *mine = NULL;   // NULL: not used on this rank
  if (local == 0) {
    gathered = work;
    staged = work + (size_t)L * all;
  }
  if (sliced)
    mine = work + leader_floats;

  const float *src = send;
  if (sliced) {
    pack_slices(mine, send, P, count, o, len);
    src = mine;
  }
  // gathered[l][dst]: the whole send buffer of local member l.
  NB(gr, MPI_Igather(src, (int)all, MPI_FLOAT, gathered, (int)all, MPI_FLOAT, 0, h->intra, &req));
  if (local == 0) {
    // staged[n'][l][l'] = gathered[l][n'*L + l']: per destination node, from each local source
    // to each of its members.
    for (int node = 0; node < N; node++)
      for (int l = 0; l < L; l++)
        memcpy(staged + ((size_t)node * L + l) * L * block,
               gathered + ((size_t)l * P + (size_t)node * L) * block, L * block * sizeof(float));
    // gathered[n][l][l'] afterwards: from source member n*L + l to local member l'.
    int exchanged = L * L * len;
    NB(gr, MPI_Ialltoall(staged, exchanged, MPI_FLOAT, gathered, exchanged, MPI_FLOAT, h->inter, &req));
    // staged[l'][n*L + l]: what local member l' receives, in source order.
    for (int to = 0; to < L; to++)
      for (int from = 0; from < P; from++)
        memcpy(staged + ((size_t)to * P + from) * block, gathered + ((size_t)from * L + to) * block,
               block * sizeof(float));
  }
  float *dst = sliced ? mine : recv;
  NB(gr, MPI_Iscatter(staged, (int)all, MPI_FLOAT, dst, (int)all, MPI_FLOAT, 0, h->intra, &req));
  if (sliced)
    unpack_slices(recv, mine, P, count, o, len);
}

// 2dh on the slice [o, o + len) of every block.
static void alltoall_2dh(Group *gr, const float *send, float *recv, int64_t count, int64_t o,
                         int len) {
  const Hierarchy *h = &gr->hier;
  int P = gr->size, N = h->nodes, L = h->per_node;
  bool sliced = len != count;
  size_t block = (size_t)len, all = (size_t)P * len;
  float *a = workspace(gr, 2 * all), *b = a + all;

  // a[l'][n'] = send[n'*L + l']: blocks grouped by destination local index.
  for (int to_local = 0; to_local < L; to_local++)
    for (int node = 0; node < N; node++)
      memcpy(a + ((size_t)to_local * N + node) * block,
             send + ((int64_t)node * L + to_local) * count + o, block * sizeof(float));
  // b[l][n'] afterwards: from local member l to member n'*L + (my local index).
  NB(gr, MPI_Ialltoall(a, N * len, MPI_FLOAT, b, N * len, MPI_FLOAT, h->intra, &req));
  // The stride transform: a[n'][l] = b[l][n'], blocks for the same destination node together.
  for (int node = 0; node < N; node++)
    for (int from_local = 0; from_local < L; from_local++)
      memcpy(a + ((size_t)node * L + from_local) * block,
             b + ((size_t)from_local * N + node) * block, block * sizeof(float));
  // [n][l] afterwards: from member n*L + l, which is source order.
  float *dst = sliced ? b : recv;
  NB(gr, MPI_Ialltoall(a, L * len, MPI_FLOAT, dst, L * len, MPI_FLOAT, h->inter, &req));
  if (sliced)
    unpack_slices(recv, b, P, count, o, len);
}

static void alltoall_on(Group *gr, RtComm *c, RtGroup g, RtA2aAlgo algo, const float *send, float *recv,
                 int64_t count) {
  if (algo != RT_A2A_FLAT && algo != RT_A2A_1DH && algo != RT_A2A_2DH)
    rt_comm_abort("internal error: rt_alltoall with unknown algorithm %d", (int)algo);
  if (!gr || gr->size == 1) {
    copy_floats(recv, send, count);
    return;
  }
  if (algo == RT_A2A_FLAT || !gr->hier.regular) {
    alltoall_flat(gr, send, recv, count, c->max_chunk);
    return;
  }
  // The largest count one MPI call sees: 1dh gathers P blocks and exchanges L*L; 2dh moves
  // N or L blocks per peer.
  int64_t square = (int64_t)gr->hier.per_node * gr->hier.per_node;
  int64_t widest = algo == RT_A2A_1DH && square > gr->size ? square : gr->size;
  int64_t limit = c->max_chunk / widest;
  if (limit < 1)
    limit = 1;
  if (count == 0)
    return;
  for (int64_t o = 0; o < count; o += limit) {
    int len = slice_len(o, count, limit);
    if (algo == RT_A2A_1DH)
      alltoall_1dh(gr, send, recv, count, o, len);
    else
      alltoall_2dh(gr, send, recv, count, o, len);
  }
}

static void allgather_on(Group *gr, RtComm *c, RtGroup g, const float *send, float *recv, int64_t count) {
  if (!gr || gr->size == 1) {
    copy_floats(recv, send, count);
    return;
  }
  int64_t max_chunk = c->max_chunk;
  if (count <= max_chunk) {
    NB(gr, MPI_Iallgather(send, (int)count, MPI_FLOAT, recv, (int)count, MPI_FLOAT, gr->comm, &req));
    return;
  }
  for (int64_t o = 0; o < count; o += max_chunk) {
    int len = slice_len(o, count, max_chunk);
    MPI_Datatype slice = block_slice(len, count);
    NB(gr, MPI_Iallgather(send + o, len, MPI_FLOAT, recv + o, 1, slice, gr->comm, &req));
    MPI_CHECK(MPI_Type_free(&slice));
  }
}

static void reducescatter_on(Group *gr, RtComm *c, RtGroup g, const float *send, float *recv, int64_t count) {
  if (!gr || gr->size == 1) {
    copy_floats(recv, send, count);
    return;
  }
  int64_t max_chunk = c->max_chunk;
  if (count <= max_chunk) {
    NB(gr, MPI_Ireduce_scatter_block(send, recv, (int)count, MPI_FLOAT, MPI_SUM, gr->comm, &req));
    return;
  }
  for (int64_t o = 0; o < count; o += max_chunk) {
    int len = slice_len(o, count, max_chunk);
    for (int to = 0; to < gr->size; to++)
      NB(gr, MPI_Ireduce(send + to * count + o, to == gr->rank ? recv + o : NULL, len, MPI_FLOAT,
                         MPI_SUM, to, gr->comm, &req));
  }
}

// How a float AllReduce runs (each measured on the emulated cluster of docs/cluster.md, 150 Mbit/s
// links, n = 2^20 floats; Open MPI 4.1's libnbc underneath):
//   below 64 KiB        MPI_Iallreduce in place: latency-bound, where libnbc's binomial tree
//                       (2 log2 p steps) beats a ring's 2 (p - 1);
//   2 or 3 ranks        the ring below. libnbc runs a binomial tree for fewer than 4 ranks: a
//                       reduction to the root and a broadcast back, the whole buffer over one
//                       link after the other: 470 ms on 2 x 1 where the ring takes 243;
//   4 ranks or more     MPI_Iallreduce out of place (into the group's workspace, then copied
//                       back): libnbc's recursive halving (or ring), whose first and last steps
//                       pair neighbours, so on node-major groups the cross-node steps carry the
//                       smallest pieces. In place, libnbc runs the binomial tree again: 707 ms on
//                       the world group of 2 x 2 against 261 out of place (the ring: 362).
// Every rank ends with the same bits (each block is summed once, then copied to all).
#define ALLREDUCE_BIG_BYTES 65536
#define ALLREDUCE_SLICE ((int64_t)1 << 22)   // floats of one out-of-place call (the workspace)

// Block b of n elements cut into p: [n b / p, n (b + 1) / p).
static int64_t ring_cut(int64_t n, int p, int b) { return n * b / p; }

// Sends nsend floats to the right neighbour while nrecv arrive from the left one into dst.
static void ring_exchange(Group *gr, const float *send, int nsend, float *dst, int nrecv) {
  int p = gr->size, right = (gr->rank + 1) % p, left = (gr->rank + p - 1) % p;
  MPI_Request recv;
  MPI_CHECK(MPI_Irecv(dst, nrecv, MPI_FLOAT, left, 0, gr->comm, &recv));
  NB(gr, MPI_Isend(send, nsend, MPI_FLOAT, right, 0, gr->comm, &req));
  finish(&recv, gr->what, gr->id, gr->began, "MPI_Irecv", __LINE__);
}

// Sends block `out` of buf to the right neighbour while block `in` arrives from the left one
// into dst (the workspace, or buf itself in the gather half).
static void ring_step(Group *gr, const float *buf, int64_t n, int out, int in, float *dst) {
  int p = gr->size;
  int64_t o0 = ring_cut(n, p, out), in0 = ring_cut(n, p, in);
  ring_exchange(gr, buf + o0, (int)(ring_cut(n, p, out + 1) - o0), dst, (int)(ring_cut(n, p, in + 1) - in0));
}

// The ring AllReduce: every rank sends 2 n (p - 1) / p elements, to its right neighbour only,
// both directions of a link busy at once. p - 1 steps reduce-scatter (after them this rank holds
// the sum of block rank + 1), p - 1 steps gather the sums.
static void allreduce_ring(Group *gr, float *buf, int64_t n) {
  int p = gr->size, r = gr->rank;
  float *in = workspace(gr, (size_t)(n / p + 1));
  for (int s = 0; s < p - 1; s++) {
    int out = (r - s + p) % p, blk = (r - s - 1 + 2 * p) % p;
    ring_step(gr, buf, n, out, blk, in);
    float *acc = buf + ring_cut(n, p, blk);
    int64_t len = ring_cut(n, p, blk + 1) - ring_cut(n, p, blk);
    for (int64_t i = 0; i < len; i++) acc[i] += in[i];
  }
  for (int s = 0; s < p - 1; s++) {
    int out = (r + 1 - s + p) % p, blk = (r - s + p) % p;
    ring_step(gr, buf, n, out, blk, buf + ring_cut(n, p, blk));
  }
}

static void allreduce_on(Group *gr, RtComm *c, RtGroup g, float *buf, int64_t n) {
  if (!gr || gr->size == 1)
    return;
  int64_t max_chunk = c->max_chunk;
  for (int64_t o = 0; o < n; o += max_chunk) {
    int len = slice_len(o, n, max_chunk);
    bool big = (int64_t)len * (int64_t)sizeof(float) >= ALLREDUCE_BIG_BYTES && len >= gr->size;
    if (!big) {
      NB(gr, MPI_Iallreduce(MPI_IN_PLACE, buf + o, len, MPI_FLOAT, MPI_SUM, gr->comm, &req));
    } else if (gr->size < 4) {
      allreduce_ring(gr, buf + o, len);
    } else {
      for (int64_t s = 0; s < len; s += ALLREDUCE_SLICE) {
        int part = slice_len(s, len, ALLREDUCE_SLICE);
        float *out = workspace(gr, (size_t)part);
        NB(gr, MPI_Iallreduce(buf + o + s, out, part, MPI_FLOAT, MPI_SUM, gr->comm, &req));
        copy_floats(buf + o + s, out, part);
      }
    }
  }
}

// op: MPI_SUM or MPI_MAX over doubles.
static void allreduce_f64_on(Group *gr, RtComm *c, double *buf, int64_t n, MPI_Op op) {
  if (!gr || gr->size == 1)
    return;
  int64_t max_chunk = c->max_chunk;
  for (int64_t o = 0; o < n; o += max_chunk)
    NB(gr, MPI_Iallreduce(MPI_IN_PLACE, buf + o, slice_len(o, n, max_chunk), MPI_DOUBLE, op,
                          gr->comm, &req));
}

static void bcast_on(Group *gr, RtComm *c, RtGroup g, void *buf, int64_t bytes, int root) {
  int size = gr ? gr->size : 1;
  if (root < 0 || root >= size)
    rt_comm_abort("internal error: rt_bcast from root %d in a %s group of %d", root,
                  group_names[g], size);
  if (size == 1)
    return;
  int64_t max_chunk = c->max_chunk;
  for (int64_t o = 0; o < bytes; o += max_chunk)
    NB(gr, MPI_Ibcast((char *)buf + o, slice_len(o, bytes, max_chunk), MPI_BYTE, root, gr->comm, &req));
}

// The entry points: the group, the deadline's clock and --profile's record around each.

static Group *begin(RtComm *c, RtGroup g, const char *who, const char *what, int64_t count) {
  Group *gr = active_group(c, g, who, count);
  if (gr) {
    gr->what = what;
    gr->began = rt_mono_ns();
  }
  return gr;
}

static void end(const Group *gr) {
  if (!gr || gr->size <= 1 || !rt_prof_on())
    return;
  RtProfKind kind = RT_PROF_OTHER;
  if (strcmp(gr->what, "AlltoAll") == 0) kind = RT_PROF_ALLTOALL;
  else if (strcmp(gr->what, "AllGather") == 0) kind = RT_PROF_ALLGATHER;
  else if (strcmp(gr->what, "ReduceScatter") == 0) kind = RT_PROF_REDUCESCATTER;
  else if (strcmp(gr->what, "AllReduce") == 0) kind = RT_PROF_ALLREDUCE;
  rt_prof_comm(kind, gr->began, rt_mono_ns());
}

void rt_alltoall(RtComm *c, RtGroup g, RtA2aAlgo algo, const float *send, float *recv,
                 int64_t count) {
  Group *gr = begin(c, g, "rt_alltoall", "AlltoAll", count);
  alltoall_on(gr, c, g, algo, send, recv, count);
  end(gr);
}

void rt_allgather(RtComm *c, RtGroup g, const float *send, float *recv, int64_t count) {
  Group *gr = begin(c, g, "rt_allgather", "AllGather", count);
  allgather_on(gr, c, g, send, recv, count);
  end(gr);
}

void rt_reducescatter(RtComm *c, RtGroup g, const float *send, float *recv, int64_t count) {
  Group *gr = begin(c, g, "rt_reducescatter", "ReduceScatter", count);
  reducescatter_on(gr, c, g, send, recv, count);
  end(gr);
}

// ---- gradient accumulation ----

void rt_comm_grad_hook(RtComm *c, int mode, float *grads, float *acc, int64_t n) {
  if (!c) return;
  GradHook *h = &c->hook;
  if (!h->done) pthread_mutex_init(&h->lock, NULL);
  h->mode = mode, h->grads = grads, h->acc = acc, h->n = n;
  h->ndone = 0;
  if (!h->done) {
    h->max_done = 64;
    h->done = rt_alloc((size_t)h->max_done * sizeof *h->done, "the reduced gradient ranges");
  }
}

// Whether the reduction of [buf, buf + n) goes ahead: false in SKIP mode for the gradient buffer;
// in ADD mode the earlier microbatches' sums are added to it first (and the range recorded).
static bool grad_hook(RtComm *c, float *buf, int64_t n) {
  GradHook *h = c ? &c->hook : NULL;
  if (!h || h->mode == RT_GRAD_HOOK_OFF || buf < h->grads || buf >= h->grads + h->n)
    return true;
  if (h->mode == RT_GRAD_HOOK_SKIP)
    return false;
  int64_t off = buf - h->grads;
  rt_add(buf, h->acc + off, buf, n);
  pthread_mutex_lock(&h->lock);
  if (h->ndone == h->max_done) {
    h->max_done *= 2;
    void *more = realloc(h->done, (size_t)h->max_done * sizeof *h->done);
    if (!more) rt_out_of_memory((size_t)h->max_done * sizeof *h->done, "the reduced gradient ranges");
    h->done = more;
  }
  h->done[h->ndone][0] = off, h->done[h->ndone][1] = n;
  h->ndone++;
  pthread_mutex_unlock(&h->lock);
  return true;
}

static int by_offset(const void *a, const void *b) {
  int64_t x = ((const int64_t *)a)[0], y = ((const int64_t *)b)[0];
  return x < y ? -1 : x > y;
}

void rt_comm_grad_hook_finish(RtComm *c) {
  if (!c || c->hook.mode != RT_GRAD_HOOK_ADD) {
    if (c) c->hook.mode = RT_GRAD_HOOK_OFF;
    return;
  }
  GradHook *h = &c->hook;
  qsort(h->done, (size_t)h->ndone, sizeof *h->done, by_offset);
  int64_t at = 0;
  for (int i = 0; i <= h->ndone; i++) {   // the elements no reduction saw: their sums here
    int64_t lo = i < h->ndone ? h->done[i][0] : h->n;
    if (lo > at) rt_add(h->grads + at, h->acc + at, h->grads + at, lo - at);
    if (i < h->ndone && h->done[i][0] + h->done[i][1] > at) at = h->done[i][0] + h->done[i][1];
  }
  h->mode = RT_GRAD_HOOK_OFF;
}

void rt_allreduce(RtComm *c, RtGroup g, float *buf, int64_t n) {
  if (!grad_hook(c, buf, n)) return;
  Group *gr = begin(c, g, "rt_allreduce", "AllReduce", n);
  allreduce_on(gr, c, g, buf, n);
  end(gr);
}

void rt_allreduce_f64(RtComm *c, RtGroup g, double *buf, int64_t n) {
  Group *gr = begin(c, g, "rt_allreduce_f64", "AllReduce", n);
  allreduce_f64_on(gr, c, buf, n, MPI_SUM);
  end(gr);
}

void rt_allreduce_max_f64(RtComm *c, RtGroup g, double *buf, int64_t n) {
  Group *gr = begin(c, g, "rt_allreduce_max_f64", "AllReduce", n);
  allreduce_f64_on(gr, c, buf, n, MPI_MAX);
  end(gr);
}

void rt_bcast(RtComm *c, RtGroup g, void *buf, int64_t bytes, int root) {
  Group *gr = begin(c, g, "rt_bcast", "Bcast", bytes);
  bcast_on(gr, c, g, buf, bytes, root);
  end(gr);
}

// ---- a sharded optimizer's rows (ZeRO-1) ----
// Sums of groups of 2 are the same bits in any order (a + b == b + a), so on such groups the
// reduce-scatter equals rt_allreduce on the rows a member owns; on larger groups MPI orders the
// sums its own way, as rt_allreduce's algorithms do.

static void part_of(int64_t rows, int64_t row, int p, int i, int64_t *lo, int64_t *n) {
  int64_t r0 = rows * i / p, r1 = rows * (i + 1) / p;
  *lo = r0 * row;
  *n = (r1 - r0) * row;
}

void rt_shard_part(const RtComm *c, RtGroup g, int64_t rows, int64_t row, int64_t *lo, int64_t *n) {
  part_of(rows, row, rt_comm_size(c, g), rt_comm_rank(c, g), lo, n);
}

// counts[j] / displs[j]: member j's elements of the window [o, o + len), displs from o.
static void window_parts(int64_t rows, int64_t row, int p, int64_t o, int64_t len, int *counts, int *displs) {
  for (int j = 0; j < p; j++) {
    int64_t lo, n;
    part_of(rows, row, p, j, &lo, &n);
    int64_t a = lo > o ? lo : o, b = lo + n < o + len ? lo + n : o + len;
    counts[j] = b > a ? (int)(b - a) : 0;
    displs[j] = b > a ? (int)(a - o) : 0;
  }
}

// The ring reduce-scatter of buf's parts (counts, displs): p - 1 steps; part j starts at member
// j + 1 and ends at j, each member adding its own addends in place as the running sum passes, so
// no buffer but one part's (MPI_Reduce_scatter's libnbc takes temporaries of the whole message).
static void reduce_scatter_ring(Group *gr, float *buf, const int *counts, const int *displs) {
  int p = gr->size, r = gr->rank, largest = 0;
  for (int j = 0; j < p; j++) largest = counts[j] > largest ? counts[j] : largest;
  float *in = workspace(gr, (size_t)largest + 1);
  for (int s = 0; s < p - 1; s++) {
    int out = ((r - 1 - s) % p + p) % p, blk = ((r - 2 - s) % p + p) % p;
    ring_exchange(gr, buf + displs[out], counts[out], in, counts[blk]);
    float *acc = buf + displs[blk];
    for (int i = 0; i < counts[blk]; i++) acc[i] += in[i];
  }
}

void rt_shard_reduce(RtComm *c, RtGroup g, float *grad, int64_t offset, int64_t count, int64_t rows,
                     int64_t row) {
  if (!grad_hook(c, grad + offset, count)) return;
  Group *gr = begin(c, g, "rt_shard_reduce", "ReduceScatter", count);
  if (gr && gr->size > 1) {
    int p = gr->size, *counts = rt_alloc(2 * (size_t)p * sizeof(int), "a sharded reduction");
    for (int64_t o = offset; o < offset + count; o += c->max_chunk) {
      int len = slice_len(o - offset, count, c->max_chunk);
      window_parts(rows, row, p, o, len, counts, counts + p);
      if ((int64_t)len * (int64_t)sizeof(float) >= ALLREDUCE_BIG_BYTES) {   // as rt_allreduce: the ring
        reduce_scatter_ring(gr, grad + o, counts, counts + p);
        continue;
      }
      float *out = workspace(gr, (size_t)counts[gr->rank] + 1);
      NB(gr, MPI_Ireduce_scatter(grad + o, out, counts, MPI_FLOAT, MPI_SUM, gr->comm, &req));
      copy_floats(grad + o + counts[p + gr->rank], out, counts[gr->rank]);
    }
    free(counts);
  }
  end(gr);
}

void rt_shard_gather(RtComm *c, RtGroup g, float *buf, int64_t rows, int64_t row) {
  int64_t count = rows * row;
  Group *gr = begin(c, g, "rt_shard_gather", "AllGather", count);
  if (gr && gr->size > 1) {
    int p = gr->size, *counts = rt_alloc(2 * (size_t)p * sizeof(int), "a sharded gather");
    for (int64_t o = 0; o < count; o += c->max_chunk) {
      int len = slice_len(o, count, c->max_chunk);
      window_parts(rows, row, p, o, len, counts, counts + p);
      NB(gr, MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf + o, counts, counts + p, MPI_FLOAT,
                             gr->comm, &req));
    }
    free(counts);
  }
  end(gr);
}

// ---- pipeline stages ----

_Static_assert(sizeof(MPI_Request) <= sizeof(long long), "RtPpSend stores MPI_Request in a long long");

int rt_comm_stage(const RtComm *c) { return c ? c->stage : 0; }
int rt_comm_stages(const RtComm *c) { return c ? c->stages : 1; }

// Point-to-point floats in pieces that fit MPI's int counts (at most `most` of them): each piece
// started as a nonblocking send or receive of tag on comm; the number of pieces.
enum { PIECE = 1 << 28 };

static int start_pieces(MPI_Comm comm, int peer, float *buf, int64_t n, int tag, bool send, MPI_Request *req,
                        int most) {
  int k = 0;
  for (int64_t at = 0; at < n; at += PIECE, k++) {
    if (k == most) rt_comm_abort("internal error: a message of %lld floats is too large", (long long)n);
    int count = (int)(n - at < PIECE ? n - at : PIECE);
    if (send) MPI_CHECK(MPI_Isend(buf + at, count, MPI_FLOAT, peer, tag, comm, &req[k]));
    else MPI_CHECK(MPI_Irecv(buf + at, count, MPI_FLOAT, peer, tag, comm, &req[k]));
  }
  return k;
}

// A whole message to or from one peer, with the collectives' deadline: what, e.g. "receive from
// pipeline stage 1", names it in the sentence that ends a job whose peer is gone.
static void transfer(MPI_Comm comm, int g, int peer, float *buf, int64_t n, int tag, bool send, const char *what) {
  MPI_Request req[RT_PP_PIECES];
  int64_t began = rt_mono_ns(), most = (int64_t)PIECE * RT_PP_PIECES;
  for (int64_t at = 0; at < n; at += most) {   // any size: RT_PP_PIECES pieces at a time
    int k = start_pieces(comm, peer, buf + at, n - at < most ? n - at : most, tag, send, req, RT_PP_PIECES);
    for (int i = 0; i < k; i++) finish(&req[i], what, g, began, send ? "MPI_Isend" : "MPI_Irecv", __LINE__);
  }
}

void rt_send_floats(RtComm *c, RtGroup g, int to, const float *buf, int64_t n) {
  char what[64];
  snprintf(what, sizeof what, "send to rank %d", to);
  transfer(rt_comm_mpi(c, g), g, to, (float *)buf, n, 0, true, what);
}

void rt_recv_floats(RtComm *c, RtGroup g, int from, float *buf, int64_t n) {
  char what[64];
  snprintf(what, sizeof what, "receive from rank %d", from);
  transfer(rt_comm_mpi(c, g), g, from, buf, n, 0, false, what);
}

// The pipeline's messages go to or come from the same place in stage `stage`; tag tells the
// messages of a step apart. Sends are nonblocking (rt_pp_wait finishes them), so that a stage
// computes while it sends.
void rt_pp_send(RtComm *c, int stage, const float *buf, int64_t n, int tag, RtPpSend *req) {
  req->to = stage;
  req->began = rt_mono_ns();
  req->n = start_pieces(c->pp, stage, (float *)buf, n, tag, true, (MPI_Request *)req->req, RT_PP_PIECES);
}

void rt_pp_wait(RtPpSend *req) {
  char what[64];
  snprintf(what, sizeof what, "send to pipeline stage %d", req->to);
  for (int i = 0; i < req->n; i++)
    finish((MPI_Request *)&req->req[i], what, PP_GROUP, req->began, "MPI_Isend", __LINE__);
  req->n = 0;
}

int64_t rt_pp_tag_bound(const RtComm *c) {
  int *ub = NULL, flag = 0;
  if (!c || c->stages <= 1) return INT32_MAX;
  MPI_CHECK(MPI_Comm_get_attr(c->pp, MPI_TAG_UB, &ub, &flag));
  return flag && ub ? *ub : 32767;   // the standard's least bound
}

void rt_pp_recv(RtComm *c, int stage, float *buf, int64_t n, int tag) {
  char what[64];
  snprintf(what, sizeof what, "receive from pipeline stage %d", stage);
  transfer(c->pp, PP_GROUP, stage, buf, n, tag, false, what);
}

void rt_pp_sum_f64(RtComm *c, double *buf, int n) {
  if (!c || c->stages <= 1) return;
  MPI_Request req;
  MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf, n, MPI_DOUBLE, MPI_SUM, c->pp, &req));
  finish(&req, "sum over the stages", PP_GROUP, rt_mono_ns(), "MPI_Iallreduce", __LINE__);
}

void rt_pp_max_f64(RtComm *c, double *buf, int n) {
  if (!c || c->stages <= 1) return;
  MPI_Request req;
  MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf, n, MPI_DOUBLE, MPI_MAX, c->pp, &req));
  finish(&req, "maximum over the stages", PP_GROUP, rt_mono_ns(), "MPI_Iallreduce", __LINE__);
}

void rt_all_max_f64(RtComm *c, double *buf, int n) {
  if (c && c->stages > 1) {
    MPI_Request req;
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf, n, MPI_DOUBLE, MPI_MAX, c->all, &req));
    finish(&req, "maximum over the job", RT_GROUP_WORLD, rt_mono_ns(), "MPI_Iallreduce", __LINE__);
  } else if (rt_comm_size(c, RT_GROUP_WORLD) > 1) {
    rt_allreduce_max_f64(c, RT_GROUP_WORLD, buf, n);
  }
}

void rt_all_bcast(RtComm *c, void *buf, int64_t bytes, int root) {
  if (c && c->stages > 1) {
    MPI_Request req;
    MPI_CHECK(MPI_Ibcast(buf, (int)bytes, MPI_BYTE, root, c->all, &req));
    finish(&req, "broadcast over the job", RT_GROUP_WORLD, rt_mono_ns(), "MPI_Ibcast", __LINE__);
  } else if (rt_comm_size(c, RT_GROUP_WORLD) > 1) {
    rt_bcast(c, RT_GROUP_WORLD, buf, bytes, root);
  }
}

int rt_all_rank(const RtComm *c) { return c ? c->stage * c->world_size + c->world_rank : 0; }
int rt_all_size(const RtComm *c) { return c ? c->stages * c->world_size : 1; }
