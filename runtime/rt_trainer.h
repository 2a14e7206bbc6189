// The training driver's internals (rt_main, moert.h), shared by its files:
//   main.c        rt_main: the trainer's buffers, where parameters and data come from, the
//                 training loop with its report and --log, the record hook's file
//   options.c     the command line (--help's text, parsing) and the checks of the model
//                 description and of the options against it
//   dump.c        --dump (the first step's tensors, whole) and --export-hf
//   check_grad.c  --check-grad: the gradients against central differences
//   sample.c      --sample: generating tokens after a prompt
// main.c's opening comment says how the driver works; everything here is declared for those
// files only, never for the generated programs.
#ifndef RT_TRAINER_H
#define RT_TRAINER_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "moert.h"
#include "rt_internal.h"
#include "rt_log.h"

// ---- the command line (options.c) ----

typedef struct RtOptions {
  int64_t steps;
  const char *weights, *save, *resume, *input, *target, *dump, *record;
  const char *export_hf;        // --export-hf DIR: the model as a Hugging Face checkpoint
  bool merge;                   // --merge: a LoRA model's --export-hf writes its weights with the adapters merged
  const char *adapter;          // --adapter DIR: a PEFT LoRA adapter into the model's adapters
  const char *log;              // --log F.jsonl: a JSON line per step and per evaluation
  bool steps_given;             // --steps was on the command line
  bool watched;                 // a person watches stdout: one progress line (rt_main, before MPI starts)
  bool check_grad, quiet, help, profile;
  const char *check_grad_only;   // --check-grad=P,Q: only parameters whose names begin so (NULL: all)
  // language models (runtime/lm.c)
  const char *data, *val, *prompt;
  int64_t eval_every, val_windows, sample;
  double temperature;
  double comm_timeout;          // seconds; < 0: not given
} RtOptions;

// --help's text, for the program prog of model.
void rt_options_usage(FILE *out, const RtModel *model, const char *prog);
// argv into *o (defaults for what is not given). 0, or -1 with the reason recorded (rt_fail).
int rt_options_parse(int argc, char **argv, RtOptions *o);
// The model description the generated program hands to rt_main is consistent (its names, sizes,
// layout, and every parameter's shape and split); -1 (rt_fail) otherwise.
int rt_model_check(const RtModel *m);
// The options that apply to language models only, --target (not to one) and --export-hf (a
// model of a known family) fit model m; -1 (rt_fail) otherwise.
int rt_options_check(const RtModel *m, const RtOptions *o);

// ---- the trainer: every buffer a run needs (main.c) ----

typedef struct RtTrainer {
  const RtModel *model;
  RtOptions opt;
  RtRanks ranks;           // this rank's place in the layout
  RtComm *comm;            // the layout's communicators (rt_main's; NULL: a world of one)
  RtStep st;
  float *input, *target;   // this rank's DP shard of the step's data
  int64_t elems;           // batch * seqlen * embed
  size_t arena_bytes;      // st.arena's size (rt_big_alloc)
  int64_t done_steps;      // the last step already applied to the parameters
  bool fixed_data;         // --input given: the same data every step
  bool device_up;          // model->device created: destroy it at the end
  RtFault fault;           // tests only: where this rank dies (MOERT_TEST_KILL, fault.c)
  RtLm lm;                 // a language model's data (model->vocab > 0)
  bool lm_open;
  RtLog *log;              // --log (rank 0; NULL elsewhere and without it)
  RtLogLayer *log_layers;  // per routed layer, the step's reduced statistics (--log)
  float *logits_whole;     // a vocabulary-parallel model's logits gathered over MP (rt_lm_logits),
  float *logits_parts;     // and the parts as the AllGather delivers them
  size_t data_bytes;       // the size of input and target (whole pages)
  // Microbatches and pipeline stages (pipeline.c): the microbatches in flight at once on this
  // stage, each with its arena, input and target (slot 0: st.arena, input, target) and its two
  // pending sends (activations, gradients); where a later microbatch's backward writes its
  // gradients; the per-layer statistics summed over the microbatches (--log).
  int slots;
  unsigned char **arenas;
  float **inputs, **targets;
  RtPpSend *sends;
  float *grad_work;
  RtLayerStats *layer_acc;
  // --input with microbatches: every microbatch of the rank's samples (fixed_data)
  float *fixed_in, *fixed_target;
  // pipeline stages: every stage's program (stages[s]; NULL with one), for the parameters that
  // two stages hold (a tied embedding: the first stage's table and the last's head)
  const RtModel *const *stages;
  int nstages;
  // Per parameter of this stage: the stage before or after that holds it too (-1: none; a tied
  // embedding), and whether an earlier stage counts it in the gradient norm (pp_skip).
  int *pp_peer;
  int *pp_tag;   // the tag of its exchange: above the microbatches', by its index in the earlier stage
  bool *pp_skip;
  float *share_buf;   // the peer's part of those gradients (without grad_work), share_floats large
  int64_t share_floats;
  int64_t pp_wait_ns;  // time this stage waited for messages of other stages (--profile)
} RtTrainer;

// The samples of a step over the whole job: dp x microbatches x the program's batch.
static inline int64_t rt_step_samples(const RtTrainer *tr) {
  return (int64_t)tr->ranks.dp * (tr->model->microbatches > 1 ? tr->model->microbatches : 1) * tr->model->batch;
}

// The rank that prints: rank 0 of the first stage.
static inline bool rt_is_root(const RtTrainer *tr) {
  return tr->ranks.rank == 0 && tr->ranks.stage == 0;
}

// A language model's logits [batch*seqlen, vocab] of the last forward, on the host (after
// rt_device_get of the output): st.output, or, when the vocabulary is split over MP, the ranks'
// columns gathered over the MP group. Collective over MP; NULL when out of memory (reported).
const float *rt_lm_logits(RtTrainer *tr);

// ---- the step's data, the device's copies, the report (step_data.c) ----

// Host -> device (rt_device_put) and device -> host (rt_device_get) of what (RtDeviceData bits),
// on every rank, agreed over the world. 0 without a device: the host buffers are the only ones.
int rt_device_put(RtTrainer *tr, unsigned what);
int rt_device_get(RtTrainer *tr, unsigned what);

// The data of step `step` into tr->input and tr->target (a language model's windows, the
// synthetic input and its target, or nothing new with --input); sets tr->st.step.
void rt_fill_step_data(RtTrainer *tr, int64_t step);
// The data of samples first .. first + batch - 1 of step `step` (microbatch `micro` of the
// rank's) into input and target.
void rt_fill_data(RtTrainer *tr, int64_t step, int64_t first, int micro, float *input, float *target);
// --input (and --target): with microbatches every one of them in fixed_in and fixed_target, else
// the step's input and target themselves; -1 with rt_fail's sentence.
int rt_load_data(RtTrainer *tr);

// ---- microbatches and pipeline stages (pipeline.c) ----
// How many microbatches are in flight at once on this stage (its slots).
int rt_pipe_slots(const RtModel *m);
// The slots' buffers beyond the first and the gradients' second buffer; rt_pipe_destroy frees them.
int rt_pipe_create(RtTrainer *tr);
void rt_pipe_destroy(RtTrainer *tr);
// Step t's forwards and backwards of every microbatch in the stage's schedule: st.grads holds the
// mean of their gradients (reduced as each backward reduces them) and *fwd the forward's figures
// (losses averaged over the microbatches, counts summed). Collective over the stages.
int rt_pipe_step(RtTrainer *tr, int64_t t, RtStep *fwd);
// One forward through the stages of the data in slot 0 (validation).
void rt_pipe_forward(RtTrainer *tr);
// One microbatch (the data in slot 0) forward and backward through the stages (--check-grad): its
// gradients in st.grads, the forward's figures in *fwd.
void rt_pipe_step1(RtTrainer *tr, RtStep *fwd);

// ---- the report: a step's figures, reduced over the ranks (step_data.c) ----

typedef struct RtReport {
  double loss, mse, aux, z, aux_total;
  double loss_exact;          // the loss before its rounding to float (rt_loss_exact's mse + aux_total)
  double dropped, routed, load_sum, load_count;
  double load_min, load_max, capacity_max;
  bool route_changed;         // some rank's route_hash differs from the one given
} RtReport;

// The figures st left, reduced over the ranks; route_changed compares st->route_hash with *hash0
// (hash0 NULL: false). Collective on several ranks.
RtReport rt_report_reduce(const RtTrainer *tr, const RtStep *st, const uint64_t *hash0);

// ---- the rooms of the command line ----

// --dump DIR: rank 0 writes the step's input, target, output, loss and whole gradients
// (dump.c). Collective; 0 or -1 on every rank.
int rt_dump_step(RtTrainer *tr, const RtReport *rep);
// --export-hf DIR: the parameters, gathered whole, as a Hugging Face checkpoint (dump.c).
// Collective.
int rt_dump_hf(RtTrainer *tr, const char *dir);
// --check-grad at step 1 (check_grad.c): 0 when every checked entry is within tolerance, 1 when
// some is not or nothing could be checked, -1 on a failure (recorded). Collective.
int rt_check_grad(RtTrainer *tr);
// --sample: tr->opt.sample tokens after the prompt, printed by rank 0 (sample.c). Collective.
int rt_sample(RtTrainer *tr);
// --prompt against the model's vocabulary (and given with --sample), before the first step.
int rt_prompt_check(const RtModel *m, const RtOptions *o);

#endif
