// Codegen internals, in layers: each file of codegen/ calls only the layers below its own (its
// first comment says which layer it is; tests/circles.py (suite layers) checks that no two files call
// each other, directly or around a circle):
//   1 facts.c       the module's facts: scheduled functions, events, parameter offsets, groups,
//                   streams, operand types, bf16 GEMMs, the CUDA lowering's flags, GEMM shapes
//   2 kernels.c     the kernel table (runtime/kernels.def), the embedded CUDA sources, grids
//   3 lower.c       single-op lowering (ops.def's KERNEL rules and the ops written in C)
//   4 fused.c       fused-group lowering (a generated kernel or C function per group)
//   5 launch.c      the launch list of a module: every op and group lowered once
//   6 spell.c, host.c  the shared host parts: buffer names, kernel arguments, parameter table, model
//   7 emit_c.c, emit_cuda.c, emit_cuda_host.c  the emitters, all reading the one launch list
//   8 target_cpu.c, target_cuda.c  the targets (emitters + link.c, nvrtc.c, cache.c)
// Both host programs describe the same model to rt_main and follow the same stream schedule; the
// kernel unit and the CUDA host program agree on which kernels each op launches with which
// arguments because both print the one launch list.
#ifndef CG_INTERNAL_H
#define CG_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "cg.h"

// ---- what both host programs share (emit_c.c) ----

// Each parameter's offset in floats into the flat parameter buffer (RtStep.params, grads,
// opt_m, opt_v), by parameter index; *total gets the floats of all of them. malloc'd; NULL
// when out of memory.
int64_t *cg_param_offsets(const IrModule *m, int64_t *total);
// The floats of the parameters a gradient trains (all but the frozen ones; they come first).
int64_t cg_grad_floats(const IrModule *m);
// The shape of GEMM op (matmul: [m, n] = [m, k] x [k, n], operands transposed by ta, tb;
// expert.matmul: e of them, [e, m, n]).
typedef struct CgGemm {
  bool expert, ta, tb;
  int64_t e, m, n, k;
} CgGemm;
CgGemm cg_gemm(const IrOp *op);
// An expert GEMM over its filled rows only (the CUDA target, CG_LOWER_ROWS): operand `operand`
// (A for ta 0, B or A for ta 1), seen as [groups, rows, width] (groups = experts x blocks of
// `rows` slots), is counted by mk_expert_counts, and rt_cuda_expert_gemm_rows multiplies what the
// counts say is filled. False for a GEMM whose operands are not likely zero-padded slot buffers.
// route: the order op (order.encode, order.decode.grad_y) whose result the operand is and whose
// idx and loc can give the counts (mk_expert_counts_route, CG_LOWER_ROUTE: no scan), or NULL.
typedef struct CgRows {
  int operand;
  int64_t groups, rows, width, blocks;
  const IrOp *route;
} CgRows;
bool cg_expert_rows(const IrOp *op, CgRows *r);
// Whether an op of kind (with attr set, unless attr is NULL) is in m.
bool cg_module_has(const IrModule *m, IrOpKind kind, const char *attr);
// `static const RtParam params[N] = {...};`: names, shapes, init, offsets, sharding.
void cg_emit_params(FILE *out, const IrModule *m, const int64_t *param_offset);
// `static const RtModel model = {...};` and main(); device: the name of the program's RtDevice,
// or NULL (the CPU target).
void cg_emit_model(FILE *out, const IrModule *m, const PassMemPlan *plan, int64_t param_floats,
                   const char *device, const CgEmitOptions *o);
// The parallel groups in RtGroup order (0 world ... 4 esp): their names ("ep") and enums
// ("RT_GROUP_EP"); the group an op's group attribute names (world when it names none) and its enum.
extern const char *const cg_group_names[5], *const cg_group_enums[5];
int cg_group_index(const IrOp *op);
int cg_group_named(const char *group);   // "dp" -> the index of cg_group_names (0: world, or unknown)
const char *cg_group_enum(const IrOp *op);
// The stream op runs on (none is compute), and an operand's type (a parameter's or a value's):
// what both targets' host programs ask of an op.
IrStream cg_op_stream(const IrOp *op);
const IrType *cg_operand_type(const IrOperand *a);
const char *cg_stream_enum(IrStream s);   // "RT_STREAM_INTRA"; none and compute are compute
// The events of scheduled function f, renumbered 0, 1, ... in program order: rec[i] when op i
// records one (local[i] its number, else -1). Collectives on one group must not overlap and
// must be issued in the same order on every rank, so a collective also waits for the previous
// collective on its group when that one ran on another stream (dep[i]: that op's index, else
// -1; the earlier op then records an event too). Waits on events of other functions are
// dropped: function boundaries are full synchronisations.
typedef struct CgEvents {
  int *dep, *local;
  bool *rec;
  int count;
} CgEvents;
bool cg_events(IrDiag *d, const IrFunc *f, CgEvents *ev);   // false: out of memory (reported)
void cg_events_free(CgEvents *ev);
// The local events op i waits for (its own waits, then dep[i]), at most max; their number.
int cg_op_waits(const IrFunc *f, const CgEvents *ev, int i, int *waits, int max);

// ---- the kernels (runtime/kernels.def) and the op lowering (lower.c) ----

typedef enum CgKernel {
#define RT_KERNEL(ID, NAME, WHERE, PARAMS) CG_K_##ID,
#include "../runtime/kernels.def"
#undef RT_KERNEL
  CG_K_COUNT
} CgKernel;

enum { CG_MAX_KERNEL_ARGS = 32 };

// A kernel parameter's type (runtime/kernels.def: pointers, int, i64, u64, float).
typedef enum CgParamType { CG_PARAM_POINTER, CG_PARAM_INT, CG_PARAM_I64, CG_PARAM_U64, CG_PARAM_FLOAT } CgParamType;

// A row of runtime/kernels.def: the name ("gelu": the CPU target calls rt_NAME, the CUDA target
// mk_NAME), whether the CPU has it (WHERE = BOTH) and the parameters as letters: p a pointer, i
// int, l i64, u u64, f float.
typedef struct CgKernelInfo {
  const char *name;
  bool cpu;
  char sig[CG_MAX_KERNEL_ARGS + 1];
} CgKernelInfo;
extern const CgKernelInfo cg_kernel_info[CG_K_COUNT];
const char *cg_kernel_name(int k);
// The kernel named name, or -1.
int cg_kernel_by_name(const char *name);

#define CG_CUDA_BLOCK 256   // MK_BLOCK: every kernel is launched with this many threads per block

typedef enum CgArgKind {
  CG_ARG_OPERAND,   // operand `index` of op i + `i` (i 0 but in a fused group): a value or a parameter
  CG_ARG_OPERAND16, // that operand's bf16 copy (dtype bf16: a saved activation, passes/fuse.c's bf16_reads)
  CG_ARG_RESULT,    // the result of op i + index (index 0; a fused gate: 0 scores, 1 idx, 2 gates)
  CG_ARG_COPY,      // the bf16 copy of that result (dtype bf16: a GEMM operand's, PassMemPlan.copy)
  CG_ARG_GRAD,      // the gradient buffer of the parameter op->args[0]
  CG_ARG_MOMENT_M,  // adamw's moments of that parameter
  CG_ARG_MOMENT_V,
  CG_ARG_PARAM16,   // CUDA: the bf16 copy (P16) of the parameter op->args[0] (NULL without dtype bf16)
  CG_ARG_RANGES,    // CUDA: the table of RtUpdateRange of an update run (ops i .. i + nops - 1)
  CG_ARG_STATS,     // the op's statistics buffer (gate.locations: int[g, e, 2] or NULL; hook.record: double[3])
  CG_ARG_SCRATCH,   // CUDA: the launch's scratch, CgLaunch.scratch_bytes (a reduction's partial sums)
  CG_ARG_INT,       // the literal i
  CG_ARG_FLOAT,     // the literal f
  CG_ARG_SEED,      // RtStep.seed, .step, .token0 of the step being run
  CG_ARG_STEP,
  CG_ARG_TOKEN0,
  CG_ARG_VOCAB0,   // the first token of a vocabulary-parallel rank's rows (0 otherwise)
  CG_ARG_LR_SCALE,  // RtStep.lr_scale and .grad_scale (floats): the learning-rate schedule and clipping
  CG_ARG_GRAD_SCALE,
} CgArgKind;

typedef struct CgArg {
  CgArgKind kind;
  int index;        // CG_ARG_OPERAND
  int64_t i;
  double f;
} CgArg;

typedef struct CgKernelCall {
  int kernel;              // cg_cuda_kernel_name(kernel)
  int64_t grid;            // blocks of CG_CUDA_BLOCK threads
  unsigned shared_bytes;   // dynamic shared memory
  CgArg args[CG_MAX_KERNEL_ARGS];   // one per kernel parameter, in order
  int nargs;
} CgKernelCall;

// What the lowering leaves to a target's libraries instead of kernels.
typedef enum CgLib {
  CG_LIB_NONE,         // kernels (CgLaunch.call)
  CG_LIB_GEMM,         // matmul, expert.matmul: OpenBLAS / cuBLAS
  CG_LIB_COLLECTIVE,   // comm.*: MPI / NCCL
  CG_LIB_SPLIT,        // comm.split: a copy of this rank's slice
} CgLib;

typedef struct CgLaunch {
  CgLib lib;               // not a kernel (ncalls 0): the target's GEMM, collective or slice copy
  CgKernelCall call[2];    // kernels in launch order
  int ncalls;
  int nops;                // ops of the function the launch stands for: a group's members, else 1
  int64_t scratch_bytes;   // CUDA: device bytes its CG_ARG_SCRATCH arguments point to (0 none)
  int alone_calls;         // the kernels its ops launch each lowered alone (cg_lower_module; --no-fuse's count)
  char note[96];           // for the launch plan comment ("" none)
  int rows_from;           // an expert GEMM over its filled rows: 1 + the launch of its function whose
                           // mk_expert_counts counted them (the same value on the same stream); 0: its own
  bool rows_plus;          // with rows_from: over act(h + b1) of that launch's GEMM h, the counts plus
                           // one, then call[0] (mk_expert_rows_fill) copies the last row into the rest
  bool rows_zero;          // with rows_from, ta 0: over the same operand as that launch's GEMM (SwiGLU's
                           // x W3 after x W1), then call[0] (mk_expert_rows_zero) zeroes the rows past
  // The kernels over expert slots (launch.c's filled_rows, CG_LOWER_ROWS):
  bool rows_guard;         // a fused group over the slots of the counts of launch rows_from - 1 (its kernel's
                           // last argument): its operands zero past them are read as zeros there
  bool rows_skip;          // with rows_guard: nothing reads its results' rows past the counts, so it skips
                           // them (all but each block's row 0, which a weight gradient of an empty block reads)
  double rows_bytes;       // with rows_guard: the bytes of its traffic (each pointer argument once) over
                           // rows it reads or writes only below the counts (an empty slot's: none)
  bool rows_lazy;          // an expert GEMM (ta 0) over its filled rows whose result's rows past the counts
                           // nothing reads: its count kernel does not zero them (mk_expert_rows_zero not run)
  int rows_operand;        // with a count kernel (cg_counts_rows): the GEMM's operand it counts the rows of
  bool rows_order;         // an order's kernel writing no row past the counts from the routing (rows_bytes: its
                           // result's bytes over the slots)
} CgLaunch;

// The lowering of op i of f (or, with CG_LOWER_FUSE, of the group the fuse pass made at op i when
// it is a gate's chain, softmax or sigmoid, top-k and gather: nops 3, or a run of updates: one
// launch over a table of ranges; CG_LOWER_FUSE also splits the whole-tensor losses into a grid
// of partial sums; CG_LOWER_BF16, its dtype bf16, has the update round the parameters into P16 too). False when the op has no lowering (every op of ops.def has one).
// CG_LOWER_ROWS: an expert GEMM whose operand is a zero-padded slot buffer (cg_expert_rows) first
// counts its filled rows (mk_expert_counts into the launch's scratch) and multiplies only those
// (the CUDA target unless MOEC_EXPERT_ROWS=all).
// CG_LOWER_CPU (cg_lower_module only): the CPU program's lowering, each op alone and each fused
// group a C function (cg_lower_fused with cpu).
// CG_LOWER_ATTN_TC: attention on tensor cores (mk_attn_tc_*) where the heads are a multiple of 16
// and at most 128 wide (the CUDA target with dtype bf16, unless MOEC_ATTN_TC=0).
// CG_LOWER_SLOTS (with CG_LOWER_ROWS): the kernels over expert slots read the counts too
// (launch.c's filled rows; unless MOEC_EXPERT_ROWS=gemm or all).
// CG_LOWER_ROUTE (with CG_LOWER_ROWS): the counts of an order's result come from its routing
// (mk_expert_counts_route) instead of a scan of the data (MOEC_EXPERT_ROWS=scan: from the data).
// CG_LOWER_MAP: the orders over slot rows (order.encode, order.decode.grad_y, alone or starting a
// group) read the slot map of their routing, which their launch's first kernel writes
// (mk_slot_map: cg_slot_map), instead of a pass over every choice for each 16 rows (the CUDA
// target unless MOEC_SLOT_MAP=0). An order writes no row past the counts from the routing
// (CG_LOWER_ROUTE's) only with the map.
enum {
  CG_LOWER_FUSE = 1,
  CG_LOWER_BF16 = 2,
  CG_LOWER_CPU = 4,
  CG_LOWER_ROWS = 8,
  CG_LOWER_ATTN_TC = 16,
  CG_LOWER_SLOTS = 32,
  CG_LOWER_ROUTE = 64,
  CG_LOWER_MAP = 128
};
// Whether op is an order over slot rows (CG_LOWER_MAP's).
bool cg_slot_map_op(const IrOp *op);
// Launch l of such an op, its one call the op's kernel alone (`alone`: cg_lower_op's) or a
// generated kernel of the group the op starts, whose last argument is the map: mk_slot_map into
// the launch's scratch first (the map of the slot rows, then a witness a chunk of 16 rows), then
// that call (the library's kernel becomes its _map twin: the map before the result, past 1 last).
void cg_slot_map(CgLaunch *l, const CgKernelCall *alone);
// Whether launch l runs attention on tensor cores (CG_LOWER_ATTN_TC).
bool cg_attn_tc(const CgLaunch *l);
bool cg_lower(const IrFunc *f, int i, unsigned how, CgLaunch *l);
// Whether launch l is an expert GEMM that counts its filled rows first (CG_LOWER_ROWS).
bool cg_counts_rows(const CgLaunch *l);
// The same from op i's lowering alone (cg_lower_op's, NULL: it has none), which it does not lower
// again: what cg_lower_module calls with each op lowered once.
bool cg_lower_from(const IrFunc *f, int i, unsigned how, const CgLaunch *alone, CgLaunch *l);
// CUDA's whole-tensor loss op (loss.mse, loss.xent) as a grid of partial sums (CG_LOWER_FUSE):
// their number, the divisor of their sum and the scale of mk_sum_parts; false for other ops.
bool cg_split_reduction(const IrOp *op, int64_t *parts, int64_t *div, double *scale);
// The elements of a block of an update run's launch (each parameter's range starts a block).
enum { CG_UPDATE_CHUNK = 4096 };
// How the CUDA target lowers the ops of m (CG_LOWER_FUSE, and CG_LOWER_BF16 with dtype bf16).
unsigned cg_cuda_lowering(const IrModule *m);
// The launches of every function of m in program order, each op lowered once (cg_lower with
// how): what the CUDA emitters read. fn[fi].launch[k] stands for ops at[k] .. at[k] + nops - 1 of
// m->funcs[fi].
typedef struct CgFuncLaunches {
  CgLaunch *launch;
  int *at;
  int n;
} CgFuncLaunches;
// A kernel generated for a fused group (fused.c): kernel id CG_K_COUNT + its index in
// CgLaunches.gen; its parameters are pointers only.
typedef struct CgGenKernel {
  char name[24];      // mk_fuse_N
  char ops[96];       // "bias + act.gelu": its members' ops, for comments
  char *source;       // "(params) {body}": the kernel after `extern "C" __global__ void NAME`
  int nparams;
  bool syncs;         // it calls __syncthreads (a group with a row-wise op: one block a row)
} CgGenKernel;
struct CgLaunches {   // (cg.h: CgLaunches)
  CgFuncLaunches *fn;
  int nfuncs;
  CgGenKernel *gen;   // the fused groups' kernels, each once
  int ngen;
  bool slot_map;      // CUDA with CG_LOWER_MAP: a group an order over slot rows starts reads the map
};
// NULL (reported on d) when an op has no lowering or memory runs out. With CG_LOWER_FUSE a fused
// group (passes/fuse.c) is one launch of a generated kernel (cg_lower_fused).
CgLaunches *cg_lower_module(IrDiag *d, const IrModule *m, unsigned how);
// The index of the launch of fl that starts at op i, or -1 (op i is inside a launch, not its first).
int cg_launch_at(const CgFuncLaunches *fl, int i);
// The lowering of one op alone (never fused).
bool cg_lower_op(const IrOp *op, CgLaunch *l);
// Whether rule is a well-formed KERNEL rule of ops.def for an op of nargs operands (has_result:
// it has a result): kernels of runtime/kernels.def that both targets have, one argument of the
// right kind per parameter, naming only operands the op has; why says what is wrong.
bool cg_lower_rule_check(const char *rule, int nargs, bool has_result, char *why, size_t size);
// ---- fused groups (fused.c) ----
// The number of ops of the fused group (passes/fuse.c, ir.h's IrGroup) of a generated kernel
// (elementwise, rows, store, colsums) that starts at op i of f, or 0 when op i starts none.
int cg_fused_members(const IrFunc *f, int i);
// The launch of the group at op i: one call of its generated kernel, added to ls->gen unless an
// identical one is there. False (reported) when out of memory. cpu: the CPU program's function
// (the group's elementwise ops over rows; its source is a C function named FUSED_NAME, to be
// renamed by the program as gen's name, fuse_N) instead of a CUDA kernel.
// first: the lowering of op i alone (cg_lower_op's; NULL: none), which a group that starts with an
// op of a storing function (IR_STORE) calls with a storer.
// A fused group's kernel over the rows of expert slots, [groups * rows, width] (an expert's blocks
// of slots, as mk_expert_counts counts them into counts[groups]): the operands zero[] are zero at
// and past each block's count, so the kernel reads them as 0.0f there (it does not load them);
// with skip it does not compute those rows at all (nothing reads the results there) but for each
// block's row 0. A group of column sums adds only the rows below the counts of the sums whose
// summed operand (or its factor) is zero past them.
typedef struct CgGuard {
  int64_t groups, rows;
  const IrValue *zero[8];
  int nzero;
  bool skip;
  bool route;   // none of zero[]: routing counts' (launch.c), a guard only to skip
  bool plus;    // with skip: computes the rows below the counts plus one (a GEMM over them reads them)
} CgGuard;
// Whether the group at op i of f (or op i alone, as a group of one: an elementwise op with a scalar
// expression, or a column sum) can take guard g: an elementwise group (no row-wise op) whose
// results are [E, S, W] with E S = groups rows, or column sums over such operands, that reads each
// operand of zero[] at the element (a group of column sums: as a summed operand).
bool cg_fused_guardable(const IrFunc *f, int i, const CgGuard *g);
// Whether value v is one of g's zero[] (NULL g or v: false).
bool cg_guard_zero(const CgGuard *g, const IrValue *v);
// guard (NULL: none; the CUDA kernel only): the group over expert slots (cg_fused_guardable), which
// may be an op alone.
bool cg_lower_fused(IrDiag *d, CgLaunches *ls, const IrFunc *f, int i, bool cpu, const CgLaunch *first,
                    const CgGuard *guard, CgLaunch *l);
// Whether scalar expression expr is a form the CPU loops take: one function call of plain
// operands (rt_fv_NAME of runtime/rt_fused.h), or arithmetic without functions.
bool cg_scalar_c_form(const char *expr);

// Whether expr is a well-formed scalar expression (ir/scalar.def) of an op with nargs operands:
// operands x0 .. x(nargs-1), indices c, r, ec, 0, functions the CUDA prelude defines as mk_f_NAME,
// C arithmetic; why says what is wrong.
bool cg_scalar_check(const char *expr, int nargs, char *why, size_t size);
// The CUDA kernels' prelude (codegen/cuda/prelude.cu and every family's prelude sections).
const char *cg_cuda_prelude(void);
// The source of library kernel k (codegen/cuda/FAMILY.cu), `extern "C" __global__ void mk_NAME...`.
const char *cg_cuda_kernel_source(int k);

// The kernels a module's launches can name: the library's (runtime/kernels.def), then ls's
// generated ones.
int cg_cuda_kernel_count(const CgLaunches *ls);
const char *cg_cuda_kernel_name(const CgLaunches *ls, int k);

// Kernel k's parameter types, from its row of runtime/kernels.def (int, i64, u64, float,
// pointers); their number, or -1 when there are more than max.
int cg_cuda_kernel_params(const CgLaunches *ls, int k, CgParamType *types, int max);
// Compares every kernel's parameter list in runtime/kernels.def with its declaration in
// codegen/cuda/*.cu; prints each difference to err and returns their number.
int cg_cuda_check_signatures(FILE *err);
// Which kernels the launches of module m use (used[k] for k < cg_cuda_kernel_count(ls)), the
// bf16 cast of the GEMM operands included.
void cg_cuda_kernels_used(const IrModule *m, const CgLaunches *ls, bool *used);

// ---- how a host program names its buffers (spell.c) ----
typedef struct CgSpelling {
  const PassMemPlan *plan;
  const int64_t *param_offset;   // floats, by parameter index
  bool typed;                    // arena pointers cast to the value's C type (the CPU program)
  const char *arena;             // the base of the activation arena (bytes)
  const char *input, *target;    // the step's input and target
  const char *input_i32, *target_i32;   // the same of integer type (token ids); NULL: as above
  const char *params, *grads, *opt_m, *opt_v;   // the flat parameter, gradient and moment buffers
  const char *params16;                         // CUDA dtype bf16: the parameters' bf16 copy (NULL: none)
} CgSpelling;
// The pointer expression of value v (by its memory plan slot), of operand a, and of a pointer
// argument (operand, result, gradient, moment) of a kernel call of op i of f; cg_spell_pointer
// is false for the other kinds of argument.
void cg_spell_value(const CgSpelling *sp, const IrValue *v, char *buf, size_t n);
void cg_spell_operand(const CgSpelling *sp, const IrOperand *a, char *buf, size_t n);
// The bf16 copy of value v (PassMemPlan.copy); false when it has none.
bool cg_spell_copy(const CgSpelling *sp, const IrValue *v, char *buf, size_t n);
bool cg_spell_pointer(const CgSpelling *sp, const IrFunc *f, int i, const CgArg *a, char *buf, size_t n);
// What an argument kind is, the one table the three emitters read (each spells it its own way):
// a pointer (cg_spell_pointer's, or the statistics, scratch or ranges a host program places), a
// literal (int, float), or a field of the step being run (RtStep.NAME: seed, step, ...) of type
// `type`; name: how the launch plan prints it.
typedef struct CgArgInfo {
  const char *name;
  bool pointer, literal;
  const char *step_field;   // RtStep's field (NULL: none)
  CgParamType type;         // a step field's, a literal's (CG_PARAM_INT: any integer), a pointer's
} CgArgInfo;
const CgArgInfo *cg_arg_info(CgArgKind kind);
// Whether an argument of kind fits a kernel parameter of type t.
bool cg_arg_fits(CgArgKind kind, CgParamType t);

// ---- bf16 GEMM inputs (model dtype bf16, the CUDA target) ----
// Whether m's GEMMs take bf16 inputs: the module's dtype attribute is "bf16". Then every
// matmul and expert.matmul (forward and backward) takes bf16 copies of its two fp32 operands
// (round to nearest even, the cast kernel below: a parameter's from the program's copy of the
// parameters, a value's made in a scratch slot of its stream unless the previous GEMM made it),
// and cuBLAS multiplies the copies with fp32 accumulation into the fp32 result. Everything else
// (parameters, gradients, optimizer state, activations, the other kernels, collectives) stays
// fp32.
bool cg_bf16_gemms(const IrModule *m);
// The cast kernel (mk_compress_bf16: const float *x, u16 *q, i64 n) and its grid for n elements.
int cg_cuda_bf16_cast_kernel(void);
int64_t cg_cuda_grid_elems(int64_t n);
int64_t cg_cuda_grid_blocks(int64_t n);   // one block per item

#endif
