// What `moec plan` (cli/plan.c) and `moec sweep` (cli/sweep.c) share: planning every policy of a
// stack, a clock, and the --degree option; and the pipeline stages of cli/stages.c, which moec build
// and the layout search share.
#ifndef CLI_PLAN_H
#define CLI_PLAN_H

#include "cli/options.h"
#include "frontend/fe.h"
#include "ir/ir.h"
#include "sched/sched.h"

// Plans and simulates a stack under every policy; false if the planner failed.
bool cli_plan_all(const SchedStack *st, SchedPlan plans[IR_NPOLICIES]);
void cli_plans_free(SchedPlan plans[IR_NPOLICIES]);
// Monotonic seconds.
double cli_now_s(void);
// --degree RULE (best, slsqp, model, simulator) into a SchedChoose (a CliOpt check).
bool cli_opt_degree(const CliArgs *a, const char *opt, const char *value, void *dest);

// ---- pipeline stages (cli/stages.c, lang/manual.md §6) ----

// What each layer instance of a model costs a microbatch, from one lowering of the whole model (one
// stage, its layout and microbatches) priced with the cluster profile: its share of the planned
// and simulated stack (or its functions' priced ops), and its memory.
typedef struct CliInstances {
  int n;                         // layer instances, in file order
  double *t;                     // [n] ms per microbatch, forward and backward, reducing the gradients
  double *t_local;               // [n] the same without the reductions (a microbatch before the last)
  double *params;                // [n] its parameters' bytes (the update's share goes by them)
  double *bytes, *act;           // [n] parameters, gradients and optimizer state; its activations' share
  double t_first, t_last;        // the embedding's; the head's and the loss's
  double red_first, red_last;    // their gradients' reductions
  double params_first, params_last, bytes_first, bytes_last, act_first, act_last;
  double t_update;               // the whole model's update, once a step
  // What a stage's own plan needs (cli_stage_time): each instance's MoE layer in the planner's form
  // (stacked: it has one), the time of its other functions, and how the stack is planned.
  bool *stacked;                 // [n]
  SchedLayerCost *cost;          // [n]
  int *r_max;                    // [n]
  double *t_other, *t_red;       // [n] its other functions' time, of it their gradients' reductions
  const SchedCluster *sc;
  IrPolicy policy;
  int r_fix[2];
} CliInstances;
// Prices p's instances (p is changed while it runs and restored); quick: the stack planned without
// fsmoe's global optimiser (SchedStack.quick). False with why when the compiler refuses the program.
bool cli_price_instances(FeProgram *p, const FeCluster *fc, const SchedCluster *sc, IrPolicy policy, const int r_fix[2],
                         bool quick, CliInstances *out, char *why, size_t nwhy);
void cli_instances_free(CliInstances *x);
// Stage s of `stages` holding instances [first, first + count) planned alone (its stack through the
// policy's planner: its gradients reduced within it), its other functions and the embedding's (s =
// 0) or the head's (the last); ms per microbatch (*local: a microbatch before the last, which
// reduces no gradients), -1 when the planner fails.
double cli_stage_time(const CliInstances *x, int s, int stages, int first, int count, double *local);
// Whether op reduces parameters' gradients over their replicas (dp, world or esp; the runtime
// skips those in every microbatch but a step's last).
bool cli_reduces(const IrOp *op);
// When p has pp stages and no pp_layers: the split of its instances that makes the slowest stage
// fastest within fc's memory (sched_pipe_split over cli_price_instances), set as p's pp_layers;
// without a profile the equal split stays. note: what was chosen and why (may be NULL). False on
// an error (reported).
bool cli_stage_split(IrDiag *d, FeProgram *p, const FeCluster *fc, char *note, size_t nnote);

// The pipeline of p as the layout search prices it (before any stage is built; its stack planned
// quick): the split (p's pp_layers, else the cost model's), each stage's estimated time and peak,
// the planned step.
typedef struct CliPipeEstimate {
  int64_t counts[FE_MAX_STAGES];
  SchedPipePlan plan;
  double peak;      // the largest stage's estimated peak per rank
  double act;       // its activations (every microbatch in flight)
  bool within;      // the split was chosen within the memory
} CliPipeEstimate;
bool cli_pipe_estimate(FeProgram *p, const FeCluster *fc, const SchedCluster *sc, CliPipeEstimate *out, char *why,
                       size_t nwhy);
// "layers 0-16 (block0 .. block16) + the embedding": stage's instances of p.
void cli_stage_layers(const FeProgram *p, int stage, char *text, size_t n);

// One stage's build, as moec build -v reports the pipeline.
typedef struct CliStageBuilt {
  char layers[256];      // cli_stage_layers
  double t_iter;         // its program's planned microbatch with the update (ms; 0: not priced)
  double t_update;       // its update
  double t_local;        // a microbatch before the last, which reduces no gradients (ms)
  double t_fwd;          // its forward (ms; 0: not known)
  int64_t peak;          // its memory plan's peak with its microbatches in flight
  int slots;             // those microbatches
} CliStageBuilt;
// moec build's hook after each pass of a stage's program (PassCtx.after_pass; arg: the SchedCluster,
// NULL: nothing): after `cost`, its microbatch without the gradients' reductions (the runtime
// reduces them in a step's last microbatch only), its stack planned as the pipeline pass plans it,
// as module attribute t_local_pred (ms).
bool cli_local_hook(IrModule *m, const char *pass, void *arg);
// A module's planned step (t_iter_pred, or where the planner had no stack its priced ops one after
// another; 0 unpriced), its update's priced ops, its microbatch without the reductions and its
// planned forward (t_fwd_pred; 0 where none was planned).
void cli_module_times(const IrModule *m, double *t_iter, double *t_update, double *t_local, double *t_fwd);
// The stages, the bubble, the messages and the planned step (sc NULL: no times), as # lines.
void cli_pipe_report(FILE *log, const SchedCluster *sc, const CliStageBuilt *st, int stages, int micro, bool gpipe,
                     int ranks, double floats);

#endif
