// Passes over the IR module and the pipeline that runs them in order (passes/pipeline.c).
// Each pass is `bool pass_NAME(IrModule *, PassCtx *)`, changes the module in place and
// reports problems through ctx->d.
#ifndef PASS_H
#define PASS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "../ir/ir.h"
#include "../sched/sched.h"

// Where a value lives at run time, decided by memplan.
typedef enum PassMemKind {
  PASS_MEM_ARENA,    // bytes [offset, offset + size) of the activation arena
  PASS_MEM_INPUT,    // the step's input tensor
  PASS_MEM_TARGET,   // the step's target tensor
  PASS_MEM_GRAD,     // the gradient buffer of parameter `offset` (its only use is param.grad)
  PASS_MEM_NONE,     // never read (e.g. the input gradient of the first layer is still computed)
} PassMemKind;

typedef struct PassMemSlot {
  PassMemKind kind;
  int64_t offset;
  int64_t bytes;
  int64_t first, last;   // live range in global op positions
} PassMemSlot;

typedef struct PassMemPlan {
  int nfuncs;
  PassMemSlot **slot;        // slot[func index][value id] (function args resolve to their source)
  PassMemSlot **copy;        // copy[func index][value id]: the value's bf16 copy (`bf16=1` on its maker), else NONE
  int64_t arena_bytes;       // peak of the activation arena
  int64_t unshared_bytes;    // what the activations would take without reuse
  int64_t param_bytes;       // parameters
  int64_t grad_bytes;        // gradients: of the parameters not frozen (all but a LoRA model's base)
  int64_t optimizer_bytes;   // optimizer state
  int64_t param16_bytes;     // dtype bf16 (the CUDA target): the parameters' bf16 copy (P16)
  // Microbatches: a second gradient buffer (the later microbatches' local gradients); pipeline
  // stages without them: the other stage's part of a parameter two stages hold (runtime/pipeline.c).
  int64_t accum_bytes;
} PassMemPlan;

typedef struct PassCtx {
  IrDiag *d;
  bool verbose;              // `moec build -v`: passes report what they decided
  FILE *log;                 // where verbose reports go (stderr by default)
  const char *dump_after;    // print the module after this pass (NULL: none)
  bool dump_all;             // print after every pass
  FILE *dump_out;            // where dumps go
  const char *stop_after;    // stop the pipeline after this pass (NULL: run all)
  PassMemPlan *memplan;      // set by memplan; freed by pass_ctx_free
  const SchedCluster *cluster;   // the cluster profile the planner prices with (NULL: none)
  bool fuse;                 // group ops into fused kernels (without --no-fuse)
  bool fuse_cpu;             // ... the CPU target's groups: elementwise ops of one row length only
  bool plan_step;            // explicit degrees: simulate the step too (t_iter_pred, which moec build's
                             // memory choices compare); -v does it to report it
  // Called after each pass has run and the module verified (NULL: nothing): what a caller takes
  // from the module between passes (the layout search: the priced stack after `cost`). False stops
  // the pipeline as a failure.
  bool (*after_pass)(IrModule *m, const char *pass, void *arg);
  void *after_arg;
} PassCtx;

typedef bool (*PassFn)(IrModule *m, PassCtx *ctx);
typedef struct PassInfo {
  const char *name;
  PassFn run;
  const char *doc;
} PassInfo;

extern const PassInfo pass_list[];
extern const int pass_count;
// "lower" names the module as it comes from the front end (before any pass).
bool pass_known(const char *name);

bool pass_verify(IrModule *m, PassCtx *ctx);
bool pass_shapes(IrModule *m, PassCtx *ctx);
bool pass_parallelize(IrModule *m, PassCtx *ctx);
bool pass_autodiff(IrModule *m, PassCtx *ctx);
// Whether rule is a well-formed GRAD rule of ops.def for an op of nargs operands (has_result:
// the op has a result that `y` may name); why says what is wrong otherwise.
bool pass_grad_rule_check(const char *rule, int nargs, bool has_result, char *why, size_t size);
bool pass_recompute(IrModule *m, PassCtx *ctx);
bool pass_cost(IrModule *m, PassCtx *ctx);
// The multiply-accumulates of a GEMM (matmul, expert.matmul over every slot) or of causal
// attention (its forward, or its gradient: twice that) as cost.c prices them; 0 for other ops.
double pass_op_macs(const IrOp *op);
bool pass_pipeline(IrModule *m, PassCtx *ctx);
bool pass_gradpart(IrModule *m, PassCtx *ctx);
bool pass_schedule(IrModule *m, PassCtx *ctx);
bool pass_fuse(IrModule *m, PassCtx *ctx);
bool pass_memplan(IrModule *m, PassCtx *ctx);
// dtype bf16 (passes/fuse.c): whether op's fused kernel writes the bf16 copy of its result
// (`bf16=1`, a member of a group, not a column sum); whether op reads its operand a from that
// copy: a GEMM's operand whose maker writes one, or an operand fuse marked (`bf16_reads`, a
// bit an operand). memplan keeps the fp32 value alive for its other reads only.
bool pass_writes_copy(const IrOp *op);
bool pass_reads_copy(const IrOp *op, int a);
// The plan's peak per rank: the activation arena, the parameters and gradients, the optimizer state
// and (dtype bf16) the parameters' bf16 copy.
int64_t pass_mem_peak(const PassMemPlan *p);

// Sets cost_n and cost_t on every op the scheduling model prices (passes/cost.c); the number
// priced. The schedule pass re-prices its chunks with it. With ctx->fuse the groups the fuse pass
// will make are priced as one kernel each (ctx NULL: every op on its own).
int pass_price(IrModule *m, const SchedCluster *c, const PassCtx *ctx);

// The groups the fuse pass would make in f for the CPU target (cpu) or CUDA, changing nothing:
// group_of[op] the op's group (numbered from 0) or -1 when it stays alone, floats[g] the floats
// group g's kernel reads and writes (its operands from outside, its results read outside). Both
// arrays hold f->nops entries. Returns the number of groups, -1 when out of memory.
int pass_fuse_plan(const IrModule *m, const IrFunc *f, bool cpu, int *group_of, double *floats);

// One MoE layer as the planner sees it (passes/cost.c): its functions, in forward order.
typedef struct PassLayer {
  const char *name;      // the forward function's name
  IrFunc *fwd, *bwd;     // bwd: NULL before autodiff
  int64_t capacity;      // slots per expert of the expert region's entry (chunks split these)
} PassLayer;

// The MoE layers of m in forward order (*out malloc'd, free it); -1 when out of memory.
int pass_find_layers(IrModule *m, PassLayer **out);
// Whether op is of the experts: it reads an expert parameter (shard_expert) or is an op of an
// expert's LoRA adapter (expert_lora); a param.grad is not (it only copies a gradient out).
bool pass_op_of_experts(const IrOp *op);
// The expert region of f (lang/manual.md §8: dispatch AlltoAll ... experts ... combine AlltoAll): its entry
// value ([E, C, M] tokens the order packed, or their gradient) and its exit value; false if none.
bool pass_expert_region(const IrFunc *f, IrValue **entry, IrValue **exit);
// Slots per expert at the entry of f's expert region ([E, C, M]), 0 when f has none.
int64_t pass_region_capacity(const IrFunc *f);
// Ops whose result sums over the slots of a chunked operand (expert.bias.grad, expert.matmul
// with ta): chunked, their results are partial sums, added up after the chunks (passes/cost.c).
bool pass_sums_slots(const IrOp *op);

// The stack the planner plans (passes/cost.c): every MoE layer of m in forward order, its costs
// in the model's form from the attributes pass_cost set, and its largest degree
// r_max = min(C, SCHED_R_MAX), C the slots per expert of its expert regions. The one way a
// compiled model is priced: the pipeline pass (`moec build`) and `moec plan` both use it.
typedef struct PassStack {
  int n;
  PassLayer *layer;       // [n]
  SchedLayerCost *cost;   // [n]
  int *r_max;             // [n]
  // The priced time of everything outside the stack's layers (ms): a language model's
  // embedding, head and layers without experts, the loss, the optimizer; forward and backward
  // (the optimizer counts with the backward).
  double t_fwd_other, t_bwd_other;
} PassStack;
// False when out of memory. Free with pass_stack_free.
bool pass_stack(IrModule *m, const SchedCluster *c, PassStack *out);
void pass_stack_free(PassStack *s);
// Layer i of a dropless gate (`capacity *`, compiled for the worst case: every token at one
// expert) as if its gate had capacity factor `capacity`: the costs with the expert region's
// sizes scaled to those slots per expert (lang/manual.md §11: ceil(k * capacity * S / E) per routing
// group, at most the compiled ones) and its r_max. False when the layer's gate drops tokens.
bool pass_dropless_at(const PassStack *s, int i, double capacity, SchedLayerCost *cost, int *r_max);

// The priced time of each class of a step's work (ms, every op once, as the sequential schedule
// runs them; passes/cost.c, after pass_price): the classes a binary's --profile measures
// (runtime/main.c), so that a prediction's miss can be located. Expert GEMMs at their layer's
// filled share of slots, as the planner prices them; the update is every op of the optimizer
// function; the rest is the other priced ops (element-wise and row-wise kernels, copies).
typedef enum PassClass {
  PASS_CLASS_GEMM, PASS_CLASS_ATTN, PASS_CLASS_UPDATE, PASS_CLASS_ALLTOALL, PASS_CLASS_ALLGATHER,
  PASS_CLASS_REDUCESCATTER, PASS_CLASS_ALLREDUCE, PASS_CLASS_REST, PASS_CLASSES
} PassClass;
extern const char *const pass_class_names[PASS_CLASSES];
void pass_class_times(const IrModule *m, const SchedCluster *c, double t[PASS_CLASSES]);

// Runs every pass in order, the verifier after each (in every build: a module that does not
// verify is an internal error), dumping as ctx asks. False when a pass failed.
bool pass_run_pipeline(IrModule *m, PassCtx *ctx);
void pass_ctx_free(PassCtx *ctx);

#endif
