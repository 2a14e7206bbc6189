// test_comm: the ranks, groups and collectives of runtime/comm.c, run under mpirun by
// tests/mpi/run.sh (or alone, as a world of one).
//
//   test_comm --dp D --mp M --ep E --esp S --gpus-per-node G [--nodes N] [--mode MODE]
//             [--print-groups]
//
// MODE check (default): on a NULL communicator every group is a world of one and the collectives
// copy; on one from rt_comm_create, every group's size, this rank's index and the members (gathered with
// rt_allgather, in group order) equal an independent enumeration of the layout rules of
// moert.h, and so does the node hierarchy; then on every group: rt_alltoall with flat, 1dh and
// 2dh delivers exactly the expected bytes (arbitrary bit patterns, NaNs included, so only a
// byte-exact move passes), rt_allgather, rt_reducescatter, rt_allreduce (float, double) and
// rt_bcast give exact results (integers and quarters, so no rounding), for counts 0, 1, odd and
// large, and again with the slicing limit lowered to 5 and 1 elements. rank 0 checks its
// rt_comm_print_groups table. Then a second communicator (all data parallel) lives beside the
// first: its groups and collectives check out, its slicing limit is its own, and the first
// still works after the second is destroyed. Every rank runs every collective whatever fails
// (so a failure never hangs the others), the failures are summed over the world, rank 0 prints
// one line, and every rank exits 1 when anything failed.
// MODE bad-layout: rt_comm_create must fail; each rank prints "rank R: rt_comm_create returned
// NULL" (or "a communicator") and exits 1 (0 if it succeeded, which run.sh reports).
// MODE abort: world rank 1 calls rt_comm_abort while the others wait in rt_allreduce.
// MODE kill: world rank 1 kills itself (SIGKILL) while the others wait in rt_alltoall.
// MODE mpi-error: the ranks disagree on a broadcast's size; the MPI error must end the job
// through rt_comm_abort.
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moert.h"
#include "rt_internal.h"

typedef struct Args {
  RtLayout layout;
  int nodes;
  const char *mode;
  bool print_groups;
} Args;

static int world_rank, world_size, failures, checks;

static void check(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void check(bool ok, const char *fmt, ...) {
  checks++;
  if (ok)
    return;
  if (++failures <= 20) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "rank %d: FAIL: ", world_rank);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
  }
}

static const char *group_name(RtGroup g) {
  static const char *const names[] = {"world", "dp", "mp", "ep", "esp"};
  return names[g];
}

static const char *algo_name(RtA2aAlgo a) {
  static const char *const names[] = {"flat", "1dh", "2dh"};
  return names[a];
}

// ---- the layout, enumerated independently of comm.c ----

// The coordinate a group's members share: the members of g are the world ranks q whose key
// equals this rank's key, in increasing order.
static int group_key(const RtLayout *l, RtGroup g, int q) {
  int dp_index = q / l->mp, mp_index = q % l->mp, ep_index = q / l->esp, esp_index = q % l->esp;
  switch (g) {
  case RT_GROUP_WORLD: return 0;
  case RT_GROUP_DP: return mp_index;    // DP: same mp index
  case RT_GROUP_MP: return dp_index;    // MP: same dp index (consecutive ranks)
  case RT_GROUP_EP: return esp_index;   // EP: same esp index
  case RT_GROUP_ESP: return ep_index;   // ESP: same ep index (consecutive ranks)
  default: return -1;
  }
}

static int expected_members(const RtLayout *l, RtGroup g, int r, int *out) {
  int n = 0;
  for (int q = 0; q < world_size; q++)
    if (group_key(l, g, q) == group_key(l, g, r))
      out[n++] = q;
  return n;
}

static int expected_index(const RtLayout *l, RtGroup g, int r) {
  switch (g) {
  case RT_GROUP_WORLD: return r;
  case RT_GROUP_DP: return r / l->mp;
  case RT_GROUP_MP: return r % l->mp;
  case RT_GROUP_EP: return r / l->esp;
  case RT_GROUP_ESP: return r % l->esp;
  default: return -1;
  }
}

// ---- data ----

static uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The bits of element e of the block src sends to dst; any 32-bit pattern, NaNs included.
static float pattern(int src, int dst, int64_t e, uint64_t salt) {
  uint64_t h = mix(mix(salt) ^ (uint64_t)src) ^ ((uint64_t)dst << 32) ^ (uint64_t)e;
  uint32_t bits = (uint32_t)mix(h);
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

enum { GUARD = 8 };
static const unsigned char guard_byte = 0xCD;

// count floats plus a guard after them, all filled with guard_byte.
static float *guarded(int64_t count) {
  size_t bytes = ((size_t)count + GUARD) * sizeof(float);
  float *p = malloc(bytes);
  if (!p) {
    fprintf(stderr, "rank %d: out of memory\n", world_rank);
    exit(2);
  }
  memset(p, guard_byte, bytes);
  return p;
}

static bool guard_intact(const float *p, int64_t count) {
  const unsigned char *g = (const unsigned char *)(p + count);
  for (size_t i = 0; i < GUARD * sizeof(float); i++)
    if (g[i] != guard_byte)
      return false;
  return true;
}

// ---- collectives on one group ----

static void test_alltoall(RtComm *c, RtGroup g, const int *members, int n, int64_t count, const char *tag) {
  float *send = guarded(n * count), *want = guarded(n * count);
  for (int i = 0; i < n; i++)
    for (int64_t e = 0; e < count; e++) {
      send[i * count + e] = pattern(world_rank, members[i], e, (uint64_t)count);
      want[i * count + e] = pattern(members[i], world_rank, e, (uint64_t)count);
    }
  for (int a = RT_A2A_FLAT; a <= RT_A2A_2DH; a++) {
    float *recv = guarded(n * count);
    rt_alltoall(c, g, (RtA2aAlgo)a, send, recv, count);
    int64_t bad = -1;
    for (int64_t i = 0; i < n * count && bad < 0; i++)
      if (memcmp(&recv[i], &want[i], sizeof(float)) != 0)
        bad = i;
    check(bad < 0, "alltoall %s on %s (%s), count %lld: first wrong element %lld (block %lld)",
          algo_name((RtA2aAlgo)a), group_name(g), tag, (long long)count, (long long)bad,
          count ? (long long)(bad / count) : 0LL);
    check(guard_intact(recv, n * count), "alltoall %s on %s (%s), count %lld: wrote past the end",
          algo_name((RtA2aAlgo)a), group_name(g), tag, (long long)count);
    free(recv);
  }
  free(send);
  free(want);
}

static void test_allgather(RtComm *c, RtGroup g, const int *members, int n, int64_t count, const char *tag) {
  float *send = guarded(count), *recv = guarded(n * count);
  for (int64_t e = 0; e < count; e++)
    send[e] = pattern(world_rank, -1, e, 7);
  rt_allgather(c, g, send, recv, count);
  bool ok = true;
  for (int i = 0; i < n; i++)
    for (int64_t e = 0; e < count; e++) {
      float want = pattern(members[i], -1, e, 7);
      ok = ok && memcmp(&recv[i * count + e], &want, sizeof want) == 0;
    }
  check(ok && guard_intact(recv, n * count), "allgather on %s (%s), count %lld", group_name(g), tag,
        (long long)count);
  free(send);
  free(recv);
}

// Small integers: every sum is exact whatever the order of reduction.
static float rs_value(int src, int dst_index, int64_t e) {
  return (float)((src + 1) * (dst_index + 3) + (int)(e % 11));
}

static void test_reducescatter(RtComm *c, RtGroup g, const int *members, int n, int me, int64_t count,
                               const char *tag) {
  float *send = guarded(n * count), *recv = guarded(count);
  for (int i = 0; i < n; i++)
    for (int64_t e = 0; e < count; e++)
      send[i * count + e] = rs_value(world_rank, i, e);
  rt_reducescatter(c, g, send, recv, count);
  bool ok = true;
  for (int64_t e = 0; e < count; e++) {
    float want = 0;
    for (int i = 0; i < n; i++)
      want += rs_value(members[i], me, e);
    ok = ok && recv[e] == want;
  }
  check(ok && guard_intact(recv, count), "reducescatter on %s (%s), count %lld", group_name(g), tag,
        (long long)count);
  free(send);
  free(recv);
}

static void test_allreduce(RtComm *c, RtGroup g, const int *members, int n, int64_t count, const char *tag) {
  float *buf = guarded(count);
  for (int64_t e = 0; e < count; e++)
    buf[e] = 0.5f * world_rank + (float)(e % 13);
  rt_allreduce(c, g, buf, count);
  bool ok = true;
  for (int64_t e = 0; e < count; e++) {
    float want = 0;
    for (int i = 0; i < n; i++)
      want += 0.5f * members[i] + (float)(e % 13);
    ok = ok && buf[e] == want;
  }
  check(ok && guard_intact(buf, count), "allreduce on %s (%s), count %lld", group_name(g), tag,
        (long long)count);
  free(buf);

  // 1e9 + a quarter needs more than float's 24 bits: only a double reduction gets it right.
  double *d = malloc(((size_t)count + 1) * sizeof *d);
  for (int64_t e = 0; e < count; e++)
    d[e] = 1e9 + 0.25 * world_rank + (double)(e % 17);
  rt_allreduce_f64(c, g, d, count);
  ok = true;
  for (int64_t e = 0; e < count; e++) {
    double want = 0;
    for (int i = 0; i < n; i++)
      want += 1e9 + 0.25 * members[i] + (double)(e % 17);
    ok = ok && d[e] == want;
  }
  check(ok, "allreduce_f64 on %s (%s), count %lld", group_name(g), tag, (long long)count);
  free(d);
}

static void test_bcast(RtComm *c, RtGroup g, const int *members, int n, int me, int64_t bytes,
                       const char *tag) {
  int roots[2] = {0, n - 1};
  for (int k = 0; k < 2; k++) {
    int root = roots[k];
    unsigned char *buf = malloc((size_t)bytes + 1), *want = malloc((size_t)bytes + 1);
    for (int64_t i = 0; i < bytes; i++)
      want[i] = (unsigned char)mix((uint64_t)members[root] * 131 + (uint64_t)i);
    if (me == root)
      memcpy(buf, want, (size_t)bytes);
    else
      memset(buf, 0xAB, (size_t)bytes);
    rt_bcast(c, g, buf, bytes, root);
    check(memcmp(buf, want, (size_t)bytes) == 0, "bcast on %s (%s) from member %d, %lld bytes",
          group_name(g), tag, root, (long long)bytes);
    free(buf);
    free(want);
  }
}

static void test_collectives(RtComm *comm, RtGroup g, const int *members, int n, int me, const int64_t *counts,
                             int ncounts, const char *tag) {
  for (int c = 0; c < ncounts; c++) {
    test_alltoall(comm, g, members, n, counts[c], tag);
    test_allgather(comm, g, members, n, counts[c], tag);
    test_reducescatter(comm, g, members, n, me, counts[c], tag);
    test_allreduce(comm, g, members, n, counts[c], tag);
    test_bcast(comm, g, members, n, me, counts[c] * 3 + 1, tag);
  }
}

// ---- the modes ----

// Before any communicator exists: the NULL one, a world of one.
static void test_world_of_one(void) {
  for (int g = 0; g < RT_GROUP_COUNT; g++) {
    check(rt_comm_size(NULL, (RtGroup)g) == 1 && rt_comm_rank(NULL, (RtGroup)g) == 0,
          "on NULL, %s is not a world of one", group_name((RtGroup)g));
    int member = world_rank;   // what a world of one gathers
    int nodes, per_node;
    check(!rt_comm_hierarchy(NULL, (RtGroup)g, &nodes, &per_node), "hierarchy of NULL");
    int64_t counts[] = {0, 1, 5};
    test_collectives(NULL, (RtGroup)g, &member, 1, 0, counts, 3, "world of one");
  }
}

static void test_groups(RtComm *c, const RtLayout *l, int *members) {
  int gpn = l->gpus_per_node > 0 ? l->gpus_per_node : world_size;
  for (int g = 0; g < RT_GROUP_COUNT; g++) {
    int n = expected_members(l, (RtGroup)g, world_rank, members);
    int me = expected_index(l, (RtGroup)g, world_rank);
    check(rt_comm_size(c, (RtGroup)g) == n, "%s group size %d, expected %d", group_name((RtGroup)g),
          rt_comm_size(c, (RtGroup)g), n);
    check(rt_comm_rank(c, (RtGroup)g) == me && members[me] == world_rank, "%s index %d, expected %d",
          group_name((RtGroup)g), rt_comm_rank(c, (RtGroup)g), me);
    // The members in group order, as the group itself reports them.
    float mine = (float)world_rank, *got = malloc(sizeof(float) * (n > 0 ? n : 1) * 2);
    if (rt_comm_size(c, (RtGroup)g) == n) {
      rt_allgather(c, (RtGroup)g, &mine, got, 1);
      for (int i = 0; i < n; i++)
        check(got[i] == (float)members[i], "%s group member %d is world rank %g, expected %d",
              group_name((RtGroup)g), i, got[i], members[i]);
    }
    free(got);

    // Members per node, counted directly.
    int nodes = 0, per_node = -1;
    bool regular = true;
    for (int node = 0; node * gpn < world_size; node++) {
      int here = 0;
      for (int i = 0; i < n; i++)
        here += members[i] / gpn == node;
      if (here == 0)
        continue;
      nodes++;
      if (per_node < 0)
        per_node = here;
      regular = regular && here == per_node;
    }
    int got_nodes, got_per_node;
    bool got_regular = rt_comm_hierarchy(c, (RtGroup)g, &got_nodes, &got_per_node);
    check(got_regular == regular && got_nodes == nodes && (!regular || got_per_node == per_node),
          "%s hierarchy: %s %d x %d, expected %s %d x %d", group_name((RtGroup)g),
          got_regular ? "regular" : "irregular", got_nodes, got_per_node,
          regular ? "regular" : "irregular", nodes, per_node);
  }
}

static void test_print_groups(const RtComm *c, const RtLayout *l, bool show) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  rt_comm_print_groups(c, f);
  fclose(f);
  if (world_rank != 0) {
    check(len == 0, "rank %d printed the group table", world_rank);
    free(text);
    return;
  }
  if (show)
    fputs(text, stdout);
  int gpn = l->gpus_per_node > 0 ? l->gpus_per_node : world_size;
  check(strncmp(text, "# parallel layout: ", 19) == 0, "group table starts with '%.40s'", text);
  const char *header = strstr(text, "\n rank  node");
  check(header != NULL, "group table has no header line");
  if (!header) {
    free(text);
    return;
  }
  const char *row = strchr(header + 1, '\n');
  int rows = 0;
  while (row && row[1]) {
    int r, node, dp, mp, ep, esp;
    if (sscanf(row + 1, "%d %d %d %d %d %d", &r, &node, &dp, &mp, &ep, &esp) != 6)
      break;
    check(r == rows && node == r / gpn && dp == r / l->mp && mp == r % l->mp && ep == r / l->esp &&
          esp == r % l->esp, "group table row %d: '%.60s'", rows, row + 1);
    rows++;
    row = strchr(row + 1, '\n');
  }
  check(rows == world_size, "group table has %d rows, expected %d", rows, world_size);

  // An EP group uneven over nodes must be named with its fallback; else the hierarchy is stated.
  bool uneven = false;
  for (int j = 0; j < l->esp; j++) {
    int first_count = -1;
    for (int node = 0; node * gpn < world_size; node++) {
      int here = 0;
      for (int q = j; q < world_size; q += l->esp)
        here += q / gpn == node;
      if (here == 0)
        continue;
      if (first_count < 0)
        first_count = here;
      uneven = uneven || here != first_count;
    }
  }
  if (uneven)
    check(strstr(text, "1dh and 2dh fall back to flat") != NULL,
          "group table lacks the fallback note");
  else
    check(strstr(text, "# EP AlltoAll hierarchy (1dh, 2dh): ") != NULL &&
          !strstr(text, "fall back"), "group table lacks the EP hierarchy line");
  free(text);
}

// A second communicator beside c: all data parallel, one node. Its groups are its own and so
// is its slicing limit (it cuts into slices of 1 while c's collectives, interleaved with its
// own, stay whole), and destroying it leaves c working (MPI stays up while c lives).
static void test_second_comm(RtComm *c, int *members) {
  RtLayout all_dp = {world_size, 1, world_size, 1, 0};
  RtComm *second = rt_comm_create(NULL, 0);
  check(second != NULL, "a second communicator (all data parallel) could not be made");
  if (!second)
    return;
  test_groups(second, &all_dp, members);
  int *world = malloc(sizeof(int) * world_size);
  expected_members(&all_dp, RT_GROUP_WORLD, world_rank, world);
  static const int64_t counts[] = {1, 7};
  rt_comm_set_max_chunk(second, 1);
  for (int g = 0; g < RT_GROUP_COUNT; g++) {
    int n = expected_members(&all_dp, (RtGroup)g, world_rank, members);
    if (rt_comm_size(second, (RtGroup)g) != n)
      continue;   // already reported
    int me = expected_index(&all_dp, (RtGroup)g, world_rank);
    test_collectives(second, (RtGroup)g, members, n, me, counts, 2, "second communicator");
    test_collectives(c, RT_GROUP_WORLD, world, world_size, world_rank, counts, 2,
                     "first beside the second");
  }
  rt_comm_destroy(second);
  test_collectives(c, RT_GROUP_WORLD, world, world_size, world_rank, counts, 2,
                   "first after the second");
  free(world);
}

static int run_check(const Args *a) {
  test_world_of_one();
  RtComm *c = rt_comm_create(&a->layout, a->nodes);
  if (!c) {
    fprintf(stderr, "rank %d: FAIL: rt_comm_create failed on a good layout\n", world_rank);
    return 1;
  }
  int *members = malloc(sizeof(int) * world_size);
  test_groups(c, &a->layout, members);
  test_print_groups(c, &a->layout, a->print_groups);

  // 16411 and 45001 floats are over the ring AllReduce's 64 KiB (and cut unevenly into blocks);
  // in slices of 20000, 45001 is two ring slices and a small one.
  static const int64_t counts[] = {0, 1, 3, 7, 64, 1001, 4099, 16411};
  static const int64_t sliced_counts[] = {1, 7, 13};
  static const int64_t ring_slices[] = {45001};
  for (int g = 0; g < RT_GROUP_COUNT; g++) {
    int n = expected_members(&a->layout, (RtGroup)g, world_rank, members);
    int me = expected_index(&a->layout, (RtGroup)g, world_rank);
    if (rt_comm_size(c, (RtGroup)g) != n)
      continue;   // already reported; running on would only hang
    test_collectives(c, (RtGroup)g, members, n, me, counts, sizeof counts / sizeof counts[0], "whole");
    rt_comm_set_max_chunk(c, 5);
    test_collectives(c, (RtGroup)g, members, n, me, sliced_counts, 3, "slices of 5");
    rt_comm_set_max_chunk(c, 1);
    test_collectives(c, (RtGroup)g, members, n, me, sliced_counts, 2, "slices of 1");
    rt_comm_set_max_chunk(c, 20000);
    test_collectives(c, (RtGroup)g, members, n, me, ring_slices, 1, "slices of 20000");
    rt_comm_set_max_chunk(c, INT64_MAX);
  }
  test_second_comm(c, members);
  free(members);

  double totals[2] = {failures, checks};
  rt_allreduce_f64(c, RT_GROUP_WORLD, totals, 2);
  if (world_rank == 0)
    printf("test_comm: %d ranks, dp %d mp %d ep %d esp %d, gpus_per_node %d: %.0f checks, "
           "%.0f failed\n", world_size, a->layout.dp, a->layout.mp, a->layout.ep, a->layout.esp,
           a->layout.gpus_per_node, totals[1], totals[0]);
  rt_comm_destroy(c);
  return totals[0] == 0 && failures == 0 ? 0 : 1;
}

static int env_rank(void) {
  const char *s = getenv("OMPI_COMM_WORLD_RANK");
  return s ? atoi(s) : 0;
}

static int env_size(void) {
  const char *s = getenv("OMPI_COMM_WORLD_SIZE");
  return s ? atoi(s) : 1;
}

static int run_bad_layout(const Args *a) {
  RtComm *c = rt_comm_create(&a->layout, a->nodes);
  printf("rank %d: rt_comm_create returned %s\n", world_rank, c ? "a communicator" : "NULL");
  fflush(stdout);
  if (c) {
    rt_comm_destroy(c);
    return 0;
  }
  return 1;
}

static int run_abort(const Args *a) {
  RtComm *c = rt_comm_create(&a->layout, a->nodes);
  if (!c)
    return 2;
  float x = 1;
  rt_allreduce(c, RT_GROUP_WORLD, &x, 1);
  if (world_rank == 1 % world_size)
    rt_comm_abort("test: rank %d gives up in the middle of a run", world_rank);
  rt_allreduce(c, RT_GROUP_WORLD, &x, 1);   // never completes: rank 1 is not coming
  printf("rank %d: the collective returned after a peer aborted\n", world_rank);
  rt_comm_destroy(c);
  return 0;
}

static int run_kill(const Args *a) {
  RtComm *c = rt_comm_create(&a->layout, a->nodes);
  if (!c)
    return 2;
  int n = world_size;
  float *send = calloc(n, sizeof(float)), *recv = calloc(n, sizeof(float));
  rt_alltoall(c, RT_GROUP_WORLD, RT_A2A_FLAT, send, recv, 1);
  if (world_rank == 1 % world_size) {
    fflush(stdout);
    raise(SIGKILL);
  }
  rt_alltoall(c, RT_GROUP_WORLD, RT_A2A_2DH, send, recv, 1);   // never completes
  printf("rank %d: the collective returned after a peer died\n", world_rank);
  rt_comm_destroy(c);
  free(send);
  free(recv);
  return 0;
}

// Ranks disagree on the size of a broadcast: MPI reports the truncation as an error, which must
// come back as rt_comm_abort's line naming the MPI call, not as a crash or a hang.
static int run_mpi_error(const Args *a) {
  RtComm *c = rt_comm_create(&a->layout, a->nodes);
  if (!c)
    return 2;
  char buf[64] = {0};
  rt_bcast(c, RT_GROUP_WORLD, buf, world_rank == 0 ? 64 : 4, 0);
  float x = 1;
  rt_allreduce(c, RT_GROUP_WORLD, &x, 1);   // the root gets here; the others must have aborted
  printf("rank %d: the collective returned after a size mismatch\n", world_rank);
  rt_comm_destroy(c);
  return 0;
}

static int parse_int(const char *flag, const char *value) {
  char *end;
  long v = value ? strtol(value, &end, 10) : 0;
  if (!value || *end || end == value) {
    fprintf(stderr, "test_comm: %s needs an integer\n", flag);
    exit(2);
  }
  return (int)v;
}

int main(int argc, char **argv) {
  Args a = {{1, 1, 1, 1, 0}, 0, "check", false};
  for (int i = 1; i < argc; i++) {
    const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(f, "--dp")) a.layout.dp = parse_int(f, v), i++;
    else if (!strcmp(f, "--mp")) a.layout.mp = parse_int(f, v), i++;
    else if (!strcmp(f, "--ep")) a.layout.ep = parse_int(f, v), i++;
    else if (!strcmp(f, "--esp")) a.layout.esp = parse_int(f, v), i++;
    else if (!strcmp(f, "--gpus-per-node")) a.layout.gpus_per_node = parse_int(f, v), i++;
    else if (!strcmp(f, "--nodes")) a.nodes = parse_int(f, v), i++;
    else if (!strcmp(f, "--mode") && v) a.mode = v, i++;
    else if (!strcmp(f, "--print-groups")) a.print_groups = true;
    else {
      fprintf(stderr, "test_comm: unknown argument '%s'\n", f);
      return 2;
    }
  }
  // Known before MPI starts (the launcher's environment), so that the world-of-one tests and a
  // failed init still know who they are.
  world_rank = env_rank();
  world_size = env_size();
  if (!strcmp(a.mode, "check")) return run_check(&a);
  if (!strcmp(a.mode, "bad-layout")) return run_bad_layout(&a);
  if (!strcmp(a.mode, "abort")) return run_abort(&a);
  if (!strcmp(a.mode, "kill")) return run_kill(&a);
  if (!strcmp(a.mode, "mpi-error")) return run_mpi_error(&a);
  fprintf(stderr, "test_comm: unknown mode '%s'\n", a.mode);
  return 2;
}
