// The subcommands of moec (cli/), called by moec.c's main with its argc/argv (argv[1] is the
// command). Each returns the exit status: 0 success, 1 the input has errors, 2 bad command line.
// The *_usage functions print `moec COMMAND --help`.
#ifndef CLI_H
#define CLI_H

#include <stdio.h>

#include "frontend/fe.h"
#include "sched/sched.h"

int cli_check(int argc, char **argv);     // cli/build.c: parse and check a model
int cli_dump_ir(int argc, char **argv);   // cli/build.c: print the IR after the passes, or read IR text
int cli_build(int argc, char **argv);     // cli/build.c: compile a model for a target
void cli_check_usage(FILE *out);
void cli_dump_ir_usage(FILE *out);
void cli_build_usage(FILE *out);
int cli_plan(int argc, char **argv);    // cli/plan.c: the FSMoE schedule model of a model
int cli_sweep(int argc, char **argv);   // cli/sweep.c: every policy over the paper's Table 4
int cli_tune(int argc, char **argv);    // cli/tune_cpu.c: profile a cluster under mpirun (cli/tune.h)
void cli_plan_usage(FILE *out);
void cli_sweep_usage(FILE *out);
void cli_tune_usage(FILE *out);
int cli_import_hf(int argc, char **argv);   // cli/import_hf.c: a Hugging Face checkpoint as a model
void cli_import_hf_usage(FILE *out);
// The cluster profile of the front end (a .cluster file) in the scheduling model's form (cli/cluster.c).
void cli_cluster_from_fe(const FeCluster *f, SchedCluster *c);

// ---- the layout search of `parallel auto;` (cli/layout.c, lang/manual.md §6) ----
typedef struct CliLayout {
  int dp, mp, ep, esp;
  int pp, microbatches;  // pipeline stages of dp*mp ranks each, microbatches a step (0: as the model writes)
  char split[96];        // pp > 1: the layers of each stage the cost model chose ("19 14")
  const char *algo;      // the EP AlltoAll: "nccl" | "1dh" | "2dh"; NULL: as each layer names it
  bool legal;            // the compiler builds it (else why says what refuses it)
  bool fits;             // legal and its peak within the cluster's memory
  bool shard;            // priced with the sharded optimizer, which moec build chooses to fit the memory
  const char *recompute; // priced with `recompute norms` or `recompute layers` (the same); NULL: as written
  bool vocab_parallel;   // priced with the vocabulary split over MP (the same, when nothing exact fits)
  double step_ms;        // the model's policy's planned (simulated) step; -1: not priced
  int64_t peak_bytes;    // the memory plan's peak per rank; -1: not priced
  int64_t act_bytes;     // its activations (the rest: parameters, gradients, optimizer state)
  char why[240];         // why it is refused or does not fit; "" when it fits
  int order;             // position in the enumeration
} CliLayout;

typedef struct CliLayouts {
  CliLayout *all;        // ranked: fitting by step, then priced, then refused
  int n;
  int chosen;            // index of the chosen layout (the first), -1 when none fits
  const char *policy;
  int64_t memory;        // the cluster's memory per rank (0: not given)
  int64_t global_batch;  // samples per step, the same in every layout (cli_global_batch)
  double seconds;        // how long the search took
} CliLayouts;

// Every layout of the cluster's ranks for p, priced and ranked (p's layout is restored after).
// False on an error (reported); that nothing fits is not one (chosen -1).
bool cli_layout_search(IrDiag *d, FeProgram *p, const FeCluster *fc, CliLayouts *out);
void cli_layouts_free(CliLayouts *ls);
// The samples of a step every layout keeps: `batch` under `parallel auto;`, else batch * dp.
int64_t cli_global_batch(const FeProgram *p);
// Sets l's degrees on p (pp and microbatches where l names them), its batch per DP rank (global /
// dp), and its algorithm on every MoE layer that does not name its own.
void cli_layout_apply(FeProgram *p, const CliLayout *l, int64_t global);
// The ranked table (moec plan --layouts, moec build -v).
void cli_layouts_print(FILE *out, const CliLayouts *ls, const char *cluster);
// {"layouts": [{dp, mp, ep, esp, pp, microbatches, algo, policy, step_ms, peak_bytes, fits, shard, recompute (a level or null), vocab_parallel, why}...], "chosen": {...}}
bool cli_layouts_json(const char *path, const CliLayouts *ls);
// Reports, at p's `parallel auto;`, that no layout fits (the smallest peak and what would help). False.
bool cli_layout_nothing_fits(IrDiag *d, const FeProgram *p, const CliLayouts *ls);
// The layout p is built with: --layout DP,MP,EP,ESP[,ALGO][,pp=P][,microbatches=M] (forced, checked against the model's
// rules), else for `parallel auto;` the search's choice for cluster fc (-v: the table on stderr;
// one line says what was chosen and why, also into note; the choice as --layout takes it into spec,
// "" otherwise). note and spec may be NULL. False on an error (reported).
bool cli_resolve_layout(IrDiag *d, FeProgram *p, const FeCluster *fc, const char *forced, bool verbose, char *note,
                        size_t nnote, char *spec, size_t nspec);
// "dp 2, mp 1, ep 2, esp 1, alltoall nccl" (and ", pp 2, microbatches 4" with stages or microbatches)
const char *cli_layout_name(char *buf, size_t n, const CliLayout *l);
// bytes as "1.50 GiB"
char *cli_bytes(char *buf, size_t n, double bytes);

#endif
