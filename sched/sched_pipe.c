// Pipeline stages in the scheduling model (sched.h, lang/manual.md §6 and §10): the messages
// between neighbouring stages, the planned step of a pipeline from its stages' times, the times of
// a planned stack's layers, and the split of a model's layer instances over stages.
//
// Messages. Microbatch i's activations go from stage s to stage s + 1 after its forward, their
// gradient back after its backward (runtime/pipeline.c): one message of batch·seqlen·embed floats
// each way, every rank of a stage sending to the rank of its place in the next stage at once.
// A profile's `p2p` was measured that way across nodes (every rank of a node sending to the rank
// of its local index on the next node, cli/tune.c), `p2p_intra` inside a node. A profile without
// them gets them from the AlltoAll of the same reach, measured with every rank of a node sending
// too: an AlltoAll of n elements on N members sends (N-1)/N of them to N-1 peers, so one peer's
// message of n elements costs beta·N/(N-1) per element and alpha/(N-1).
//
// The step (the planned step of `moec build -v`): the runtime's order on every stage simulated
// (GPipe: every forward, then the backwards; 1F1B: P - s - 1 forwards, then a forward and a
// backward in turn; the backwards in the microbatches' order), each forward or backward starting
// when its stage is free and its input is there: the previous stage's activations or the next
// stage's gradient, a message's time after that stage sent it (sends are nonblocking, so a stage
// computes while its messages travel). A stage's microbatch is its forward and backward as its
// program runs them; the runtime reduces the gradients once a step, in the last microbatch (the
// others sum theirs locally), so that backward carries the reductions' extra time, before its
// gradient goes back. Then each stage updates; the step ends with the last update. Equal stages
// take (M + P - 1) microbatches (Huang et al., Narayanan et al.: fill and drain), GPipe and 1F1B
// alike; a faster stage adds only its own part of the fill and the drain. A stage's wait is its
// idle time before a forward or backward whose input had not arrived, as runtime/pipeline.c
// counts it for --profile.
//
// Layer times. A stack's simulated program runs its layers one after another on the compute
// stream; layer i's forward ends where its last forward op ends, its backward where its last
// backward op ends (backward in reverse order), so the differences of those ends divide the
// simulated step among the layers exactly, and what is all-reduced after the backward is shared
// by the layers in proportion to their gradients.
//
// The split. The slowest stage decides the step, so the split minimises it: dynamic programming
// over contiguous splits (best[s][j], the least slowest stage of stages 0..s holding the first j
// instances; O(P n^2) sums of a prefix array), the embedding's time on the first stage and the
// head's and loss's on the last; with a memory limit, only stages whose estimated peak (their
// bytes and their activations times the microbatches in flight) is within it.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sched.h"

static bool given(SchedCoef f) { return f.alpha > 0 || f.beta > 0; }

// One peer's message from a collective of `members` that sends (members-1)/members of its
// elements to members-1 peers.
static SchedCoef one_peer(SchedCoef f, int members) {
  if (members <= 1) return f;
  return (SchedCoef){f.alpha / (members - 1), f.beta * members / (members - 1)};
}

SchedCoef sched_p2p_fit(const SchedCluster *c, bool across, const char **how) {
  int N = c->nodes > 1 ? c->nodes : 1, G = c->gpus_per_node > 1 ? c->gpus_per_node : 1;
  if (across && N > 1) {
    if (given(c->p2p)) return *how = "p2p", c->p2p;
    *how = "derived from the alltoall fit (across nodes)";
    return one_peer(c->alltoall, N);
  }
  if (given(c->p2p_intra)) return *how = "p2p_intra", c->p2p_intra;
  if (G <= 1 || N <= 1) {   // no neighbour inside a node, or one node: the profile's only p2p fit
    if (given(c->p2p)) return *how = "p2p", c->p2p;
    *how = N > 1 ? "derived from the alltoall fit (across nodes)" : "derived from the alltoall fit (one node)";
    return one_peer(c->alltoall, N > 1 ? N : G);
  }
  if (given(c->alltoall_intra)) return *how = "derived from the alltoall_intra fit", one_peer(c->alltoall_intra, G);
  *how = "derived from the allgather fit (inside a node)";
  return one_peer(c->allgather, G);
}

SchedCoef sched_p2p_boundary(const SchedCluster *c, int ranks, int s, bool *across, const char **how) {
  int G = c->gpus_per_node > 0 ? c->gpus_per_node : ranks;
  // The most ranks of one node that send across its link: the profile's fit had all G of them
  // sending at once, each at 1/G of the link (the ranks of a node are consecutive).
  int most = 0, node = -1, crossing = 0;
  for (int r = 0; r < ranks; r++) {
    int from = s * ranks + r;
    if (from / G != node) node = from / G, crossing = 0;
    crossing += (from + ranks) / G != node;
    if (crossing > most) most = crossing;
  }
  *across = most > 0;
  SchedCoef f = sched_p2p_fit(c, *across, how);
  if (*across && c->nodes > 1 && most < G) f.beta *= (double)most / G;
  return f;
}

// One stage's next forward or backward in the runtime's order: `warm` forwards (every one with
// GPipe, P - s - 1 with 1F1B), then a forward (while any is left) and a backward in turn; the
// backwards in the microbatches' order.
typedef struct PipeCursor {
  int warm, fwd, bwd;   // forwards before the first backward; the next forward and backward
} PipeCursor;

static bool next_is_forward(const PipeCursor *c, int M) {
  if (c->fwd < c->warm) return true;
  if (c->bwd >= M) return false;
  // after the fill: forward k + warm goes right before backward k
  return c->fwd < M && c->fwd - c->warm <= c->bwd;
}

void sched_pipe_step(const SchedPipe *p, SchedPipePlan *out) {
  *out = (SchedPipePlan){.slowest = 0};
  int P = p->stages > 1 ? p->stages : 1, M = p->micro > 1 ? p->micro : 1;
  if (P > SCHED_MAX_STAGES) P = SCHED_MAX_STAGES;
  double fwd[SCHED_MAX_STAGES], bwd[SCHED_MAX_STAGES], extra[SCHED_MAX_STAGES], update[SCHED_MAX_STAGES];
  for (int s = 0; s < P; s++) {
    if (p->t_micro[s] > p->t_micro[out->slowest]) out->slowest = s;
    update[s] = p->t_update ? p->t_update[s] : 0;
    extra[s] = p->t_last && p->t_last[s] > p->t_micro[s] ? p->t_last[s] - p->t_micro[s] : 0;
    if (update[s] > out->t_update) out->t_update = update[s];
    if (extra[s] > out->t_reduce) out->t_reduce = extra[s];
    fwd[s] = p->t_fwd && p->t_fwd[s] >= 0 && p->t_fwd[s] <= p->t_micro[s] ? p->t_fwd[s] : p->t_micro[s] / 3;
    bwd[s] = p->t_micro[s] - fwd[s];
  }
  for (int b = 0; b + 1 < P; b++) out->t_msgs += 2 * p->t_msg[b];
  out->t_fill = (M + P - 1) * p->t_micro[out->slowest] + out->t_reduce;
  out->bubble_equal = (double)(P - 1) / (M + P - 1);

  // The simulation: end_f[s * M + i], end_b[...]: when microbatch i's forward / backward ends on
  // stage s (negative: not yet run). Each round runs every stage's next step whose input has
  // arrived; the runtime's orders never deadlock, so every round runs at least one.
  double *end_f = malloc((size_t)P * M * sizeof *end_f), *end_b = malloc((size_t)P * M * sizeof *end_b);
  if (!end_f || !end_b) {   // out of memory: the balanced formula
    free(end_f), free(end_b);
    out->t_pipe = out->t_fill + out->t_msgs, out->bubble = out->bubble_equal;
    out->t_step = out->t_pipe + out->t_update;
    return;
  }
  for (int k = 0; k < P * M; k++) end_f[k] = end_b[k] = -1;
  PipeCursor cur[SCHED_MAX_STAGES];
  double free_at[SCHED_MAX_STAGES], gap[SCHED_MAX_STAGES];
  for (int s = 0; s < P; s++) {
    int warm = P == 1 ? 0 : p->gpipe ? M : (P - s - 1 < M ? P - s - 1 : M);
    cur[s] = (PipeCursor){warm, 0, 0}, free_at[s] = 0, gap[s] = 0;
  }
  for (int left = 2 * P * M; left > 0;) {
    int ran = 0;
    for (int s = 0; s < P; s++) {
      PipeCursor *c = &cur[s];
      if (c->bwd >= M) continue;
      double ready, t;
      if (next_is_forward(c, M)) {
        int i = c->fwd;
        if (s > 0 && end_f[(s - 1) * M + i] < 0) continue;
        ready = s > 0 ? end_f[(s - 1) * M + i] + p->t_msg[s - 1] : 0;
        t = fwd[s];
        gap[s] += fmax(ready - free_at[s], 0);
        end_f[s * M + i] = fmax(free_at[s], ready) + t;
        free_at[s] = end_f[s * M + i], c->fwd++;
      } else {
        int i = c->bwd;
        if (s + 1 < P && end_b[(s + 1) * M + i] < 0) continue;
        ready = s + 1 < P ? end_b[(s + 1) * M + i] + p->t_msg[s] : end_f[s * M + i];
        t = bwd[s] + (i == M - 1 ? extra[s] : 0);
        gap[s] += fmax(ready - free_at[s], 0);
        end_b[s * M + i] = fmax(free_at[s], ready) + t;
        free_at[s] = end_b[s * M + i], c->bwd++;
      }
      ran++, left--;
    }
    if (!ran) break;   // not reached: the orders above always progress
  }
  for (int s = 0; s < P; s++) {
    double end = free_at[s] + update[s];
    if (end > out->t_step) out->t_step = end;
    if (free_at[s] > out->t_pipe) out->t_pipe = free_at[s];
  }
  for (int s = 0; s < P; s++) {   // as runtime/pipeline.c counts a stage's wait: for a message it needs
    out->wait[s] = gap[s];
    out->bubble += out->t_step > 0 ? gap[s] / out->t_step / P : 0;
  }
  free(end_f);
  free(end_b);
}

bool sched_layer_times(const SchedStack *st, const SchedPlan *plan, double *t_layer) {
  int n = st->n;
  for (int i = 0; i < n; i++) t_layer[i] = 0;
  if (n == 0) return true;
  SchedProgram g = {0};
  double *end_f = calloc((size_t)n + 1, sizeof *end_f), *end_b = calloc((size_t)n + 1, sizeof *end_b);
  bool ok = end_f && end_b && sched_build_program(st, plan, &g) && sched_simulate(&g);
  for (int k = 0; ok && k < g.nops; k++) {   // end_f[i + 1]: layer i's forward; end_b[i]: its backward
    const SchedOp *o = &g.op[k];
    if (o->kind == SCHED_OP_ALLREDUCE) continue;
    double *e = o->phase == SCHED_FWD ? &end_f[o->layer + 1] : &end_b[o->layer];
    if (o->end > *e) *e = o->end;
  }
  if (ok) {
    end_b[n] = end_f[n];
    double grads = 0, tail = g.makespan - end_b[0];
    for (int i = 0; i < n; i++) grads += st->cost[i].n_grad;
    for (int i = 0; i < n; i++) {
      t_layer[i] = (end_f[i + 1] - end_f[i]) + (end_b[i] - end_b[i + 1]);
      t_layer[i] += grads > 0 ? tail * st->cost[i].n_grad / grads : tail / n;
    }
  }
  sched_program_free(&g);
  free(end_f);
  free(end_b);
  return ok;
}

// The microbatches in flight on stage s (runtime/pipeline.c): every one with GPipe; with 1F1B
// the pipeline's depth from s on.
int sched_pipe_slots(int stages, int s, int micro, bool gpipe) {
  if (micro < 1) micro = 1;
  if (gpipe || stages <= 1) return stages > 1 ? micro : 1;
  return stages - s < micro ? stages - s : micro;
}

// Stage s holding instances [i, j): its time and whether its estimated peak fits.
static double stage_time(const SchedSplit *sp, const double *pre_t, int s, int i, int j) {
  return pre_t[j] - pre_t[i] + (s == 0 ? sp->t_first : 0) + (s == sp->stages - 1 ? sp->t_last : 0);
}

double sched_split_peak(const SchedSplit *sp, int s, int first, int count) {
  if (!sp->bytes || !sp->act) return 0;
  double bytes = s == 0 ? sp->bytes_first : 0, act = s == 0 ? sp->act_first : 0;
  if (s == sp->stages - 1) bytes += sp->bytes_last, act += sp->act_last;
  for (int k = first; k < first + count; k++) bytes += sp->bytes[k], act += sp->act[k];
  return bytes + act * sched_pipe_slots(sp->stages, s, sp->micro, sp->gpipe);
}

static bool fits(const SchedSplit *sp, int s, int i, int j, bool limit) {
  return !limit || sp->memory <= 0 || sched_split_peak(sp, s, i, j - i) <= sp->memory;
}

// The DP of the split (best[s * (n + 1) + j], from[...]: where stage s starts); false when no
// split has every stage within the memory (limit) or none exists.
static bool split_dp(const SchedSplit *sp, const double *pre_t, bool limit, double *best, int *from) {
  int n = sp->n, P = sp->stages;
  for (int k = 0; k < P * (n + 1); k++) best[k] = INFINITY, from[k] = -1;
  for (int j = 1; j <= n - (P - 1); j++)
    if (fits(sp, 0, 0, j, limit)) best[j] = stage_time(sp, pre_t, 0, 0, j);
  for (int s = 1; s < P; s++)
    for (int j = s + 1; j <= n - (P - 1 - s); j++)
      for (int i = s; i < j; i++) {
        double before = best[(s - 1) * (n + 1) + i];
        if (!isfinite(before) || !fits(sp, s, i, j, limit)) continue;
        double t = fmax(before, stage_time(sp, pre_t, s, i, j));
        if (t < best[s * (n + 1) + j]) best[s * (n + 1) + j] = t, from[s * (n + 1) + j] = i;
      }
  return isfinite(best[(P - 1) * (n + 1) + n]);
}

double sched_split_slowest(const SchedSplit *sp, const int64_t *counts) {
  double worst = 0;
  int at = 0;
  for (int s = 0; s < sp->stages; s++) {
    double t = (s == 0 ? sp->t_first : 0) + (s == sp->stages - 1 ? sp->t_last : 0);
    for (int k = at; k < at + counts[s]; k++) t += sp->t[k];
    at += (int)counts[s];
    if (t > worst) worst = t;
  }
  return worst;
}

bool sched_pipe_split(const SchedSplit *sp, const int64_t *equal, int64_t *counts, bool *within) {
  int n = sp->n, P = sp->stages;
  if (P < 1 || n < P) return false;
  double *pre_t = malloc(((size_t)n + 1) * sizeof *pre_t), *best = malloc((size_t)P * (n + 1) * sizeof *best);
  int *from = malloc((size_t)P * (n + 1) * sizeof *from);
  bool ok = pre_t && best && from;
  if (ok) {
    pre_t[0] = 0;
    for (int k = 0; k < n; k++) pre_t[k + 1] = pre_t[k] + sp->t[k];
    *within = split_dp(sp, pre_t, true, best, from);
    ok = *within || split_dp(sp, pre_t, false, best, from);
  }
  if (ok) {
    for (int s = P - 1, j = n; s >= 0; s--) {
      int i = s > 0 ? from[s * (n + 1) + j] : 0;
      counts[s] = j - i;
      j = i;
    }
    // The equal split where it is as fast (and fits as well): the split a reader expects.
    double t = best[(P - 1) * (n + 1) + n];
    bool equal_fits = true;
    for (int s = 0, at = 0; equal && s < P; at += (int)equal[s], s++)
      equal_fits &= !*within || fits(sp, s, at, at + (int)equal[s], true);
    if (equal && equal_fits && sched_split_slowest(sp, equal) <= t * (1 + 1e-12))
      memcpy(counts, equal, (size_t)P * sizeof *counts);
  }
  free(pre_t);
  free(best);
  free(from);
  return ok;
}
