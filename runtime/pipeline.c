// A training step of microbatches and pipeline stages (lang/manual.md §6, `parallel { pp P;
// microbatches M; pp_schedule gpipe | 1f1b; }`).
//
// The generated program computes one microbatch: its forward reads st->input and st->target,
// its backward writes every parameter's gradient into st->grads. A step runs M of them and
// updates once with the mean of their gradients: the microbatches before the last sum their
// local gradients without reducing them, the last one's reductions (DP, and those over other
// groups) reduce the sum as they overlap its backward, and the mean is the sum divided by M. Each microbatch is routed on its own (its capacity, its aux loss); the step's loss is the
// mean of the microbatches'.
//
// With pp stages each rank runs its stage's program (codegen emits one per stage). Microbatch i
// on stage s: its forward reads the tokens (s = 0) or the activations stage s - 1 sent, and sends
// its output to stage s + 1 (s < P - 1); its backward reads the gradient stage s + 1 sent back as
// its target (loss.link passes it on) or the loss's (the last stage), and sends the gradient of
// its input (st->input_grad) to stage s - 1. Sends are nonblocking: a stage computes while its
// messages travel. A microbatch in flight (forward done, backward not yet) keeps its arena,
// input and target: a slot of its own.
//   gpipe: every forward, then every backward: M slots.
//   1f1b:  P - s - 1 forwards to fill the pipeline, then one forward and one backward in turn,
//          then the backwards left: at most P - s microbatches in flight on stage s (Narayanan
//          et al., PipeDream-Flush), so stage s needs min(P - s, M) slots.
// Both run the same microbatches through the same programs: their gradients are the same bits.
// A program of the CUDA target (RtModel.device) keeps the slots' arenas and the gradients' sums in
// device memory: its hooks (RtDevice.use_slot, .accumulate, .grads_part) do there what the lines
// beside them do on the host, in the same arithmetic; the messages go from and to host memory.
#include "rt_trainer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static void find_shared(RtTrainer *tr);

static int micro_count(const RtModel *m) { return m->microbatches > 1 ? m->microbatches : 1; }
static int stage_count(const RtModel *m) { return m->pp > 1 ? m->pp : 1; }

int rt_pipe_slots(const RtModel *m) {
  int M = micro_count(m), P = stage_count(m), s = m->pp > 1 ? m->stage : 0;
  if (m->pp_schedule == RT_PP_GPIPE) return P > 1 ? M : 1;
  return P - s < M ? P - s : M;
}

int rt_pipe_create(RtTrainer *tr) {
  const RtModel *m = tr->model;
  int n = rt_pipe_slots(m);
  if (stage_count(m) > 1 && 2 * (int64_t)micro_count(m) - 1 > rt_pp_tag_bound(tr->comm))
    rt_comm_abort("%d microbatches need MPI tags up to %lld for the pipeline's messages, above this MPI's bound %lld: "
                  "fewer microbatches", micro_count(m), 2 * (long long)micro_count(m) - 1,
                  (long long)rt_pp_tag_bound(tr->comm));
  tr->slots = n;
  tr->arenas = rt_calloc((size_t)n, sizeof *tr->arenas, "the pipeline's slots");
  tr->inputs = rt_calloc((size_t)n, sizeof *tr->inputs, "the pipeline's slots");
  tr->targets = rt_calloc((size_t)n, sizeof *tr->targets, "the pipeline's slots");
  tr->sends = rt_calloc((size_t)(2 * n), sizeof *tr->sends, "the pipeline's slots");
  tr->arenas[0] = tr->st.arena;
  tr->inputs[0] = tr->input;
  tr->targets[0] = tr->target;
  for (int i = 1; i < n; i++) {
    if (!m->device)   // a device's slots have their arenas in device memory (RtDevice.use_slot)
      tr->arenas[i] = rt_big_alloc(tr->arena_bytes, "a microbatch's activation arena");
    if (!(tr->inputs[i] = aligned_alloc(4096, tr->data_bytes)) || !(tr->targets[i] = aligned_alloc(4096, tr->data_bytes)))
      rt_out_of_memory(tr->data_bytes, "a microbatch's input and target");
    memset(tr->inputs[i], 0, tr->data_bytes);
    memset(tr->targets[i], 0, tr->data_bytes);
  }
  if (tr->st.layer_stats && (micro_count(m) > 1 || stage_count(m) > 1))
    tr->layer_acc = rt_calloc((size_t)tr->st.max_layer_stats, sizeof *tr->layer_acc, "the layers' statistics");
  if (micro_count(m) > 1 && !m->device) {   // a device sums them in device memory (RtDevice.accumulate)
    size_t bytes = (rt_grad_floats(m) ? rt_grad_floats(m) : 1) * sizeof(float);
    tr->grad_work = rt_big_alloc(bytes, "the microbatches' gradients");
  }
  if (tr->nstages > 1)
    find_shared(tr);
  return 0;
}

void rt_pipe_destroy(RtTrainer *tr) {
  for (int i = 1; i < tr->slots; i++) {
    rt_big_free(tr->arenas[i], tr->arena_bytes);
    free(tr->inputs[i]);
    free(tr->targets[i]);
  }
  free(tr->arenas), free(tr->inputs), free(tr->targets), free(tr->sends);
  free(tr->layer_acc);
  free(tr->pp_peer);
  free(tr->pp_tag);
  free(tr->pp_skip);
  if (tr->share_buf)
    rt_big_free(tr->share_buf, (size_t)tr->share_floats * sizeof(float));
  if (tr->grad_work)
    rt_big_free(tr->grad_work, (rt_grad_floats(tr->model) ? rt_grad_floats(tr->model) : 1) * sizeof(float));
}

// Microbatch i's data of step t into the slot's input and target: the rank's samples
// dp_index*M*b + i*b .. + b - 1 (b = the program's batch), and the first token the rank routes.
static void fill_micro(RtTrainer *tr, int64_t t, int i, float *input, float *target) {
  const RtModel *m = tr->model;
  int M = micro_count(m);
  int64_t first = (int64_t)tr->ranks.dp_index * M * m->batch + (int64_t)i * m->batch;
  int64_t tokens = m->batch * m->seqlen;
  tr->st.step = t;
  tr->st.token0 = first * m->seqlen + tr->ranks.mp_index * (tokens / tr->ranks.mp);
  rt_fill_data(tr, t, first, i, input, target);
}

// The statistics of microbatch forwards, summed (loads: min, max) into acc.
static void add_stats(RtStep *acc, const RtStep *st, bool first) {
  if (first) {
    acc->mse = acc->aux_total = acc->aux = acc->z = 0;
    acc->dropped = acc->routed = 0;
    acc->route_hash = 0;
    acc->load_min = INT64_MAX, acc->load_max = 0, acc->load_sum = 0, acc->load_count = 0;
    acc->capacity_max = 0;
  }
  acc->mse += st->mse, acc->aux_total += st->aux_total, acc->aux += st->aux, acc->z += st->z;
  acc->dropped += st->dropped, acc->routed += st->routed;
  acc->route_hash = rt_mix(acc->route_hash ^ st->route_hash);
  if (st->load_min < acc->load_min) acc->load_min = st->load_min;
  if (st->load_max > acc->load_max) acc->load_max = st->load_max;
  acc->load_sum += st->load_sum, acc->load_count += st->load_count;
  if (st->capacity_max > acc->capacity_max) acc->capacity_max = st->capacity_max;
  for (int l = 0; l < st->nlayer_stats && l < acc->max_layer_stats && acc->layer_stats; l++) {
    RtLayerStats *a = &acc->layer_stats[l];
    const RtLayerStats *b = &st->layer_stats[l];
    if (first) *a = (RtLayerStats){.load_min = INT64_MAX};
    if (b->load_min < a->load_min) a->load_min = b->load_min;
    if (b->load_max > a->load_max) a->load_max = b->load_max;
    a->load_count += b->load_count, a->dropped += b->dropped, a->routed += b->routed, a->load_sum += b->load_sum;
  }
}

static void use_slot(RtTrainer *tr, int slot) {
  tr->st.arena = tr->arenas[slot];
  tr->st.input = tr->inputs[slot];
  tr->st.target = tr->targets[slot];
  if (tr->model->device)
    tr->model->device->use_slot(&tr->st, slot);
}

static int64_t boundary_floats(const RtModel *m) { return m->batch * m->seqlen * m->embed; }

// The messages between stages, the time this stage waits for them counted (--profile).
static void recv_from(RtTrainer *tr, int stage, float *buf, int tag) {
  int64_t t0 = rt_mono_ns();
  rt_pp_recv(tr->comm, stage, buf, boundary_floats(tr->model), tag);
  tr->pp_wait_ns += rt_mono_ns() - t0;
}

static void wait_sent(RtTrainer *tr, RtPpSend *req) {
  int64_t t0 = rt_mono_ns();
  rt_pp_wait(req);
  tr->pp_wait_ns += rt_mono_ns() - t0;
}

static void forward(RtTrainer *tr, int64_t t, int i, RtStep *acc) {
  const RtModel *m = tr->model;
  RtStep *st = &tr->st;
  int P = stage_count(m), s = m->pp > 1 ? m->stage : 0, slot = i % tr->slots;
  wait_sent(tr, &tr->sends[2 * slot]);   // the slot's last microbatch is gone: its buffers are free
  wait_sent(tr, &tr->sends[2 * slot + 1]);
  use_slot(tr, slot);
  fill_micro(tr, t, i, tr->inputs[slot], tr->targets[slot]);
  if (s > 0)
    recv_from(tr, s - 1, tr->inputs[slot], 2 * i);
  m->forward(st);
  rt_fault_point(&tr->fault, rt_all_rank(tr->comm), t);
  add_stats(acc, st, i == 0);
  if (s < P - 1)
    rt_pp_send(tr->comm, s + 1, st->output, boundary_floats(m), 2 * i, &tr->sends[2 * slot]);
}

static void backward(RtTrainer *tr, int i, int *done) {
  const RtModel *m = tr->model;
  RtStep *st = &tr->st;
  int P = stage_count(m), s = m->pp > 1 ? m->stage : 0, slot = i % tr->slots;
  use_slot(tr, slot);
  if (s < P - 1)
    recv_from(tr, s + 1, tr->targets[slot], 2 * i + 1);
  // Microbatches: the gradients reduced once, in the last microbatch's backward (as its schedule
  // overlaps them). The earlier ones skip their reductions of st->grads and sum their local
  // gradients in grad_work; the last one's reductions add that sum to their elements first, and
  // the elements no reduction saw get it after (comm.c, the gradient hook).
  // A device does the same with its own buffers (RtDevice.accumulate).
  int M = micro_count(m);
  int64_t n = (int64_t)rt_grad_floats(m);
  if (M > 1 && m->device)
    m->device->accumulate(st, *done, M, false);
  else if (M > 1)
    rt_comm_grad_hook(tr->comm, *done == M - 1 ? RT_GRAD_HOOK_ADD : RT_GRAD_HOOK_SKIP, st->grads, tr->grad_work, n);
  m->backward(st);
  if (M > 1 && m->device) {
    m->device->accumulate(st, *done, M, true);
  } else if (M > 1 && *done == 0) {   // the first microbatch's gradients become the sum
    float *sum = st->grads;
    st->grads = tr->grad_work;
    tr->grad_work = sum;
  } else if (M > 1 && *done < M - 1) {
    rt_add(tr->grad_work, st->grads, tr->grad_work, n);
  } else if (M > 1) {
    rt_comm_grad_hook_finish(tr->comm);
  }
  (*done)++;
  if (s > 0)
    rt_pp_send(tr->comm, s - 1, st->input_grad, boundary_floats(m), 2 * i + 1, &tr->sends[2 * slot + 1]);
}

// Parameters two stages hold (a tied embedding: the first stage's table, the last's head): each
// stage's gradient is its own part; both add the first stage's part and the last's, in that order,
// so the two copies get the same sum and stay equal. Tags above the microbatches' (find_shared).
static void share_grads(RtTrainer *tr) {
  const RtModel *m = tr->model;
  int s = m->stage;
  for (int i = 0; i < m->nparams; i++) {
    int peer = tr->pp_peer[i];
    if (peer < 0 || m->params[i].frozen) continue;   // (a frozen table has no gradient)
    const RtParam *p = &m->params[i];
    float *g = tr->st.grads + p->offset, *other = (tr->grad_work ? tr->grad_work + p->offset : tr->share_buf);
    int tag = tr->pp_tag[i];
    if (m->device)   // the device's gradient on the host for the exchange, and the sum back
      m->device->grads_part(&tr->st, p->offset, p->numel, false);
    RtPpSend send;
    rt_pp_send(tr->comm, peer, g, p->numel, tag, &send);
    rt_pp_recv(tr->comm, peer, other, p->numel, tag);
    rt_pp_wait(&send);
    if (s < peer) rt_add(g, other, g, p->numel);
    else rt_add(other, g, g, p->numel);
    if (m->device)
      m->device->grads_part(&tr->st, p->offset, p->numel, true);
  }
}

// Which parameters another stage holds too (same name), and the tag of each one's exchange:
// 2 M + 2 + its index in the earlier stage's program (both stages know it; the microbatches' tags
// are 2 i and 2 i + 1), within MPI's tag bound: rt_pipe_create.
static void find_shared(RtTrainer *tr) {
  const RtModel *m = tr->model;
  bool any = false;
  int64_t base = 2 * (int64_t)micro_count(m) + 2, bound = rt_pp_tag_bound(tr->comm);
  tr->pp_peer = rt_calloc((size_t)(m->nparams ? m->nparams : 1), sizeof *tr->pp_peer, "the pipeline's parameters");
  tr->pp_tag = rt_calloc((size_t)(m->nparams ? m->nparams : 1), sizeof *tr->pp_tag, "the pipeline's parameters");
  tr->pp_skip = rt_calloc((size_t)(m->nparams ? m->nparams : 1), sizeof *tr->pp_skip, "the pipeline's parameters");
  for (int i = 0; i < m->nparams; i++) {
    tr->pp_peer[i] = -1;
    for (int s = 0; s < tr->nstages; s++) {
      if (s == m->stage) continue;
      const RtModel *o = tr->stages[s];
      for (int j = 0; j < o->nparams; j++)
        if (strcmp(o->params[j].name, m->params[i].name) == 0) {
          tr->pp_peer[i] = s;
          tr->pp_skip[i] = s < m->stage;
          int64_t tag = base + (s < m->stage ? j : i);
          if (tag > bound)
            rt_comm_abort("the pipeline's messages need MPI tags up to %lld (%d microbatches, parameter '%s'), above "
                          "this MPI's bound %lld: fewer microbatches", (long long)tag, micro_count(m),
                          m->params[i].name, (long long)bound);
          tr->pp_tag[i] = (int)tag;
          any |= !m->params[i].frozen;
        }
    }
  }
  int64_t largest = 0;   // without grad_work, room for the largest one's other part
  for (int i = 0; i < m->nparams; i++)
    if (tr->pp_peer[i] >= 0 && !m->params[i].frozen && m->params[i].numel > largest) largest = m->params[i].numel;
  if (any && !tr->grad_work) {
    tr->share_floats = largest;
    tr->share_buf = rt_big_alloc((size_t)largest * sizeof(float), "the shared parameters' gradients");
  }
}

int rt_pipe_step(RtTrainer *tr, int64_t t, RtStep *fwd) {
  const RtModel *m = tr->model;
  RtStep *st = &tr->st;
  int M = micro_count(m), P = stage_count(m), s = m->pp > 1 ? m->stage : 0;
  if (M == 1 && P == 1) {   // one program, one microbatch: the step as it always ran
    rt_fill_step_data(tr, t);
    m->forward(st);
    rt_fault_point(&tr->fault, rt_all_rank(tr->comm), t);
    *fwd = *st;   // the statistics the forward left, in case backward adds any
    m->backward(st);
    return 0;
  }
  RtStep acc = {.layer_stats = tr->layer_acc, .max_layer_stats = tr->layer_acc ? st->max_layer_stats : 0};
  // forwards before the first backward: none on one stage (forward, backward, ...), every one with
  // gpipe, the pipeline's fill with 1f1b
  int warm = P == 1 ? 0 : m->pp_schedule == RT_PP_GPIPE ? M : (P - s - 1 < M ? P - s - 1 : M);
  int done = 0, next_fwd = 0, next_bwd = 0;
  for (; next_fwd < warm; next_fwd++) forward(tr, t, next_fwd, &acc);
  while (next_bwd < M) {
    if (next_fwd < M) forward(tr, t, next_fwd++, &acc);
    backward(tr, next_bwd++, &done);
  }
  for (int k = 0; k < 2 * tr->slots; k++) wait_sent(tr, &tr->sends[k]);
  use_slot(tr, 0);
  if (P > 1)
    share_grads(tr);
  // The step's figures: the losses the mean over its microbatches, the counts their sums.
  *fwd = acc;
  fwd->nlayer_stats = st->nlayer_stats;
  fwd->mse /= M, fwd->aux_total /= M, fwd->aux /= M, fwd->z /= M;
  if (M > 1 && m->device)
    m->device->accumulate(st, M, M, true);
  else if (M > 1)
    rt_scale(st->grads, (int64_t)rt_grad_floats(m), 1.0f / (float)M);
  return 0;
}

// The forward of a validation batch through the stages (evaluate): the loss lands in st->mse on
// the last stage (0 elsewhere; the report sums the stages).
void rt_pipe_forward(RtTrainer *tr) {
  const RtModel *m = tr->model;
  RtStep *st = &tr->st;
  int P = stage_count(m), s = m->pp > 1 ? m->stage : 0;
  use_slot(tr, 0);
  if (s > 0)
    rt_pp_recv(tr->comm, s - 1, tr->inputs[0], boundary_floats(m), 0);
  m->forward(st);
  if (s < P - 1) {
    rt_pp_send(tr->comm, s + 1, st->output, boundary_floats(m), 0, &tr->sends[0]);
    rt_pp_wait(&tr->sends[0]);
  }
}

// The first microbatch of the data in slot 0 through every stage, forward and backward (--check-grad):
// st->grads its gradients (a tied table's parts added), *fwd the forward's figures.
void rt_pipe_step1(RtTrainer *tr, RtStep *fwd) {
  const RtModel *m = tr->model;
  RtStep *st = &tr->st;
  int P = stage_count(m), s = m->pp > 1 ? m->stage : 0;
  use_slot(tr, 0);
  rt_pipe_forward(tr);
  *fwd = *st;
  if (s < P - 1)
    rt_pp_recv(tr->comm, s + 1, tr->targets[0], boundary_floats(m), 1);
  m->backward(st);
  if (s > 0) {
    rt_pp_send(tr->comm, s - 1, st->input_grad, boundary_floats(m), 1, &tr->sends[1]);
    rt_pp_wait(&tr->sends[1]);
  }
  if (P > 1)
    share_grads(tr);
}
