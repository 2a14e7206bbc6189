// What `moec plan` (cli/plan.c) and `moec sweep` (cli/sweep.c) share: planning every policy of a
// stack, a clock, and the --degree option.
#ifndef CLI_PLAN_H
#define CLI_PLAN_H

#include "cli/options.h"
#include "sched/sched.h"

// Plans and simulates a stack under every policy; false if the planner failed.
bool cli_plan_all(const SchedStack *st, SchedPlan plans[IR_NPOLICIES]);
void cli_plans_free(SchedPlan plans[IR_NPOLICIES]);
// Monotonic seconds.
double cli_now_s(void);
// --degree RULE (best, slsqp, model, simulator) into a SchedChoose (a CliOpt check).
bool cli_opt_degree(const CliArgs *a, const char *opt, const char *value, void *dest);

#endif
