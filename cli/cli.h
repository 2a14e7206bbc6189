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
int cli_sweep(int argc, char **argv);   // cli/plan.c: every policy over the paper's Table 4
int cli_tune(int argc, char **argv);    // cli/tune.c: profile a cluster under mpirun
void cli_plan_usage(FILE *out);
void cli_sweep_usage(FILE *out);
void cli_tune_usage(FILE *out);
int cli_import_hf(int argc, char **argv);   // cli/import_hf.c: a Hugging Face checkpoint as a model
void cli_import_hf_usage(FILE *out);
// The cluster profile of the front end (a .cluster file) in the scheduling model's form.
void cli_cluster_from_fe(const FeCluster *f, SchedCluster *c);

#endif
