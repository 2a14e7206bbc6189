// The moec IR: a module of parameter declarations and functions of SSA tensor values.
//
// A module holds, in execution order: one forward function per layer (`@block0.fwd`), the loss
// (`@loss.fwd`, `@loss.bwd`), one backward function per layer in reverse order (`@block0.bwd`,
// whose ops may read the forward function's values: the saved activations), and
// `@optimizer`. Every value has a name unique within its function, a dtype and a concrete
// shape. Ops come from ir/ops.def; each has 0 or 1 result, operands that are values (`%x`) or
// parameters (`@name`), named attributes, a SrcLoc and, after scheduling, a phase, chunk,
// stream and event waits.
//
// Text form (printer and parser round-trip exactly, print(parse(print(m))) == print(m)):
//
//   module tiny {batch=2, embed=32, seed=42, seqlen=32}
//   param @block0.moe.gate.wg: f32[32, 4] {init="normal", std=0.17677669529663687}
//   func @block0.fwd(%x: f32[64, 32]) {
//     %logits: f32[64, 4] = matmul %x, @block0.moe.gate.wg
//     %idx: i32[64, 2] = gate.topk %scores {k=2}
//     param.grad @block0.moe.gate.wg, %dwg
//     return %out, %aux, %z
//   }
//   func @block0.bwd(%dout: f32[64, 32]) saves @block0.fwd {
//     ...
//   }
//
// Attributes print sorted by key: integers as digits, floats with %.17g (with ".0" added when
// that looks like an integer), strings in double quotes. Scheduling annotations print after
// the attributes as `!{stream=inter, chunk=1, phase=bwd, wait=[3, 4], event=5}` only when the
// op has a stream.
#ifndef IR_H
#define IR_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "ir_diag.h"

typedef enum IrOpKind {
#define IR_OP(E, N, A, R, AT, C, D, SHAPE, GRAD, KERNEL) IR_OP_##E,
#include "ops.def"
#undef IR_OP
  IR_OP_COUNT
} IrOpKind;

// The CLASS column of ops.def.
typedef enum IrOpClass {
  IR_CLASS_COMPUTE,     // a kernel
  IR_CLASS_GEMM,        // a matrix product (BLAS), priced per multiply-accumulate
  IR_CLASS_ROUTE,       // an integer routing decision or a constant made from one: no gradient
  IR_CLASS_COMM_INTER,  // a collective on the inter-node stream when scheduled
  IR_CLASS_COMM_INTRA,  // a collective that fsmoe puts on the intra-node stream
} IrOpClass;

typedef struct IrOpInfo {
  const char *name;
  int nargs;
  int nres;
  const char *attrs;  // required attribute keys, comma-separated
  IrOpClass cls;
  const char *doc;
  const char *shape;   // the SHAPE, GRAD and KERNEL rules of ops.def ("": written in C)
  const char *grad;
  const char *kernel;
} IrOpInfo;

extern const IrOpInfo ir_op_info[IR_OP_COUNT];
static inline IrOpClass ir_op_class(IrOpKind k) { return ir_op_info[k].cls; }
static inline bool ir_op_is_collective(IrOpKind k) {
  return ir_op_info[k].cls == IR_CLASS_COMM_INTER || ir_op_info[k].cls == IR_CLASS_COMM_INTRA;
}
// The capacity of a routing group (lang/manual.md §11): ceil(k*f*tokens/experts - 1e-9) in double, at
// least 1, so that a whole k*f*S/E stays whole (k 1, f 1.1, S 200, E 2 gives 110, not the 111
// that 110.00000000000001 would round up to). The front end, the planner and the references use it.
int64_t ir_capacity_slots(int64_t k, double f, int64_t tokens, int64_t experts);
// The element of op k's result as a scalar expression (ir/scalar.def: the elementwise ops the
// fuse pass groups and the CUDA target generates kernels for), or NULL.
const char *ir_op_scalar(IrOpKind k);
// Whether op k's scalar expression reads its operand `operand` only at the element (`xK`, never
// `xK[...]`); false when k has no scalar expression.
bool ir_scalar_reads_element(IrOpKind k, int operand);
// A row-wise op a fused kernel can hold (ir/scalar.def's IR_ROW): its one-row device function
// ("layernorm" for mk_layernorm_row), whether one thread does a row (else a block), whether the
// function takes the op's eps. NULL for other ops.
typedef struct IrRowInfo {
  const char *function;
  bool per_thread, eps;
} IrRowInfo;
const IrRowInfo *ir_op_row(IrOpKind k);
// The storing function of op k that a fused kernel can start with, elementwise ops after it
// (ir/scalar.def's IR_STORE: "order_decode" for mk_order_decode_store), or NULL.
const char *ir_op_store(IrOpKind k);
// Whether op k's storing function synchronises the block (__syncthreads).
bool ir_op_store_syncs(IrOpKind k);
// Whether op k is a column sum a fused kernel can run with others (ir/scalar.def's IR_COLSUM):
// 1 when it multiplies by its second operand, 0 when not, -1 when it is none.
int ir_op_colsum(IrOpKind k);
// IR_OP_COUNT when name is not an op.
IrOpKind ir_op_by_name(const char *name);

// An activation (a row of ir/activations.def): its name (the word of `act NAME`), its forward op
// and the op of its gradient (dy, x), whether `act` offers it, whether it evaluates exp or tanh
// per element, and the recompute level of its forward op.
typedef struct IrActInfo {
  const char *name;
  IrOpKind op, grad;
  bool act, math;
  int recompute;
} IrActInfo;
// The activation of `act name`, or NULL when `act` offers none of that name.
const IrActInfo *ir_act_named(const char *name);
// The activation whose forward or gradient op k is, or NULL.
const IrActInfo *ir_act_of(IrOpKind k);
// The names `act` offers, in the table's order, NULL-terminated (the checker's words).
extern const char *const ir_act_words[];

typedef enum IrDtype { IR_F32, IR_BF16, IR_F16, IR_I32, IR_I8, IR_DTYPE_COUNT } IrDtype;
const char *ir_dtype_name(IrDtype t);       // "f32", "bf16", "f16", "i32", "i8"
bool ir_dtype_by_name(const char *name, IrDtype *out);
int ir_dtype_size(IrDtype t);               // bytes per element

#define IR_MAX_RANK 4
typedef struct IrType {
  IrDtype dtype;
  int rank;                    // 0 is a scalar
  int64_t dim[IR_MAX_RANK];
} IrType;
int64_t ir_type_numel(const IrType *t);
int64_t ir_type_bytes(const IrType *t);
bool ir_type_equal(const IrType *a, const IrType *b);
// "f32[64, 32]" into buf (truncated to cap), for messages.
void ir_type_str(const IrType *t, char *buf, size_t cap);

typedef enum IrAttrKind { IR_ATTR_INT, IR_ATTR_FLOAT, IR_ATTR_STR } IrAttrKind;
typedef struct IrAttr {
  const char *key;
  IrAttrKind kind;
  int64_t i;
  double f;
  const char *s;
} IrAttr;

#define IR_MAX_ATTRS 32
#define IR_MAX_ARGS 6
#define IR_MAX_WAITS 8

typedef struct IrFunc IrFunc;
typedef struct IrOp IrOp;

typedef struct IrParam {
  const char *name;     // without '@'; first (ir/builder.c finds and adds params by it)
  IrType type;
  IrAttr attrs[IR_MAX_ATTRS];  // init="normal"|"zeros"|"ones", std=...
  int nattrs;
  SrcLoc loc;
  int index;            // position in module->params
} IrParam;

typedef struct IrValue {
  const char *name;     // without '%'
  IrType type;
  IrFunc *func;         // the function it belongs to
  IrOp *def;            // NULL for a function argument
  int id;               // index in func->values
} IrValue;

// An operand is a value or a parameter.
typedef struct IrOperand {
  IrValue *value;
  IrParam *param;
} IrOperand;

typedef enum IrStream { IR_STREAM_NONE, IR_STREAM_COMPUTE, IR_STREAM_INTRA, IR_STREAM_INTER } IrStream;
// The stream's word in the IR text (ir/print.c): compute, intra, inter; none for IR_STREAM_NONE.
const char *ir_stream_name(IrStream s);
typedef enum IrPhase { IR_PHASE_NONE, IR_PHASE_FWD, IR_PHASE_BWD, IR_PHASE_OPT } IrPhase;

// What a function is in the training step. Set where the function is made (lowering, autodiff);
// the IR parser derives it from the name, the text form's convention (`@X.fwd`, `@X.bwd`,
// `@loss.fwd`, `@loss.bwd`, `@optimizer`), in ir_func_role_of_name alone.
typedef enum IrFuncRole {
  IR_ROLE_OTHER,       // none of the below (IR text that is not a training step)
  IR_ROLE_LAYER_FWD,   // a layer's forward: @X.fwd
  IR_ROLE_LAYER_BWD,   // its backward: @X.bwd (may read @X.fwd's values)
  IR_ROLE_LOSS_FWD,    // @loss.fwd(%out, %target)
  IR_ROLE_LOSS_BWD,    // @loss.bwd
  IR_ROLE_OPTIMIZER,   // @optimizer: one opt.* per parameter
} IrFuncRole;
IrFuncRole ir_func_role_of_name(const char *name);
// The phase a function's ops run in: forward (layer and loss forwards), backward, optimizer.
IrPhase ir_role_phase(IrFuncRole role);

// The schedule policies (lang/manual.md §8, paper §6): one table for the language's words, the planner
// and the schedule pass.
typedef enum IrPolicy {
  IR_POLICY_FSMOE,           // per-phase r (Algorithm 1), gradient partition, intra/inter/compute streams
  IR_POLICY_FSMOE_NO_IIO,    // per-phase r and gradient partition, intra+inter collectives on one stream
  IR_POLICY_TUTEL,           // PipeMoE r for the forward, reused backward; one comm stream; AllReduce after
  IR_POLICY_TUTEL_IMPROVED,  // tutel + each layer's AllReduce overlapped with the next dense backward
  IR_POLICY_PIPEMOE_LINA,    // tutel + gradients in 30 MB chunks at low priority on the inter-node link
  IR_POLICY_SEQUENTIAL,      // DS-MoE: r = 1, nothing overlaps
  IR_NPOLICIES
} IrPolicy;
// The policies' names by IrPolicy, NULL-terminated (the front end's word list).
extern const char *const ir_policy_name[IR_NPOLICIES + 1];
// Parses a policy name; false if unknown.
bool ir_policy_parse(const char *name, IrPolicy *out);

// A fused group (passes/fuse.c): a run of consecutive ops of one function that the target runs
// as one launch. The IR text prints it as a region around its members (ir/print.c), with what
// its kernel reads and writes:
//   fused 3 rows (%x, @block0.norm.w) -> (%y) {
//     %h: f32[64, 32] = add %x, %a {inner=1}
//     %y: f32[64, 32] = rmsnorm %h, @block0.norm.w
//   }
// The reads are the distinct operands its members take from outside the group, in the order the
// members first read them; the writes the members' results that leave it (those without
// inner=1; a member with bf16=1 writes its bf16 copy as well). The parser checks both lists
// against the members (ir_group_io) and the verifier checks the kind against them.
typedef enum IrGroupKind {
  IR_GROUP_ELEMENTWISE,   // ops of ir/scalar.def (IR_SCALAR): one element a thread
  IR_GROUP_ROWS,          // with one row-wise op (IR_ROW, a norm) and elementwise ops before and after it
  IR_GROUP_STORE,         // a storing op (IR_STORE: the combine, order.decode) first, elementwise ops where it stores
  IR_GROUP_COLSUMS,       // column sums (IR_COLSUM) of any shapes: one launch of all their tiles
  IR_GROUP_GATE,          // gate.softmax or gate.sigmoid, gate.topk, gate.gather: one thread a token (CUDA)
  IR_GROUP_UPDATE,        // optimizer updates of one kind and settings: one launch over a table of ranges (CUDA)
  IR_GROUP_KINDS
} IrGroupKind;
// The kinds' words in the IR text, by IrGroupKind.
extern const char *const ir_group_kind_name[IR_GROUP_KINDS];

typedef struct IrGroup {
  int id;                 // numbers the module's groups (unique in the module)
  IrGroupKind kind;
  int first, n;           // its members: f->ops[first .. first + n)
  bool in_gemm;           // the CPU: it runs row by row in the pieces of the GEMM at first - 1
                          // (printed `fused G KIND in_gemm ...`)
} IrGroup;

struct IrOp {
  IrOpKind kind;
  IrValue *result;      // NULL when the op has none
  IrOperand args[IR_MAX_ARGS];
  int nargs;
  IrAttr attrs[IR_MAX_ATTRS];
  int nattrs;
  SrcLoc loc;
  // scheduling annotations (printed only when stream != NONE)
  IrStream stream;
  IrPhase phase;
  int chunk;
  int event;            // event recorded when the op completes, -1 none
  int waits[IR_MAX_WAITS];
  int nwaits;
  IrFunc *func;
  int index;            // position in func->ops
};

struct IrFunc {
  const char *name;     // without '@'; first (ir/builder.c finds and adds functions by it)
  IrValue **args;
  int nargs;
  IrValue **values;     // args first, then op results, in order
  int nvalues, cap_values;
  IrOp **ops;
  int nops, cap_ops;
  IrValue **rets;
  int nrets;
  IrFunc *saves;        // forward function whose values this one may read, or NULL
  IrFuncRole role;
  IrAttr attrs[IR_MAX_ATTRS];  // the planner's decisions: r, case, t_model, grad_moe, ... (passes/degrees.c)
  int nattrs;
  IrGroup *groups;      // the fused groups, by first member (passes/fuse.c; none before it)
  int ngroups, cap_groups;
  SrcLoc loc;
  int index;
};

typedef struct IrArena IrArena;

typedef struct IrModule {
  const char *name;
  IrAttr attrs[IR_MAX_ATTRS * 2];  // model-level: batch, seqlen, embed, seed, dtype, ...
  int nattrs;
  IrParam **params;
  int nparams, cap_params;
  IrFunc **funcs;
  int nfuncs, cap_funcs;
  IrArena *arena;       // everything above is allocated here; freed by ir_module_free
} IrModule;

// ---- arena and builder (ir/builder.c) ----
IrModule *ir_module_new(const char *name);
void ir_module_free(IrModule *m);
void *ir_alloc(IrModule *m, size_t bytes);          // zeroed, lives as long as m
const char *ir_strdup(IrModule *m, const char *s);
const char *ir_strfmt(IrModule *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

IrParam *ir_add_param(IrModule *m, const char *name, IrType type);
IrParam *ir_find_param(const IrModule *m, const char *name);
IrFunc *ir_add_func(IrModule *m, const char *name, IrFuncRole role);
IrFunc *ir_find_func(const IrModule *m, const char *name);
IrValue *ir_add_arg(IrFunc *f, IrModule *m, const char *name, IrType type);
// Appends an op; when the op has a result, it is named `name` with type `type` (pass NULL name
// for result-less ops). Operands are added with ir_op_arg/ir_op_param afterwards.
IrOp *ir_add_op(IrFunc *f, IrModule *m, IrOpKind kind, const char *name, IrType type);
void ir_op_arg(IrOp *op, IrValue *v);
void ir_op_param(IrOp *op, IrParam *p);
// Removes op from f (its result, if any, must be unused) and renumbers the ops and values.
void ir_remove_op(IrFunc *f, IrOp *op);
// ---- fused groups (ir/group.c) ----
// Adds a group of ops first .. first + n - 1 of f (none of them in a group yet); NULL when they
// are not ops of f or one already is in a group.
IrGroup *ir_add_group(IrFunc *f, IrModule *m, int id, IrGroupKind kind, int first, int n);
// The group that holds op i of f, or NULL.
const IrGroup *ir_group_at(const IrFunc *f, int i);
static inline const IrGroup *ir_group_of(const IrOp *op) { return op->func ? ir_group_at(op->func, op->index) : NULL; }
// The kernel's reads and writes of g (the comment at IrGroup): up to cap of each; returns false
// when there are more.
bool ir_group_io(const IrFunc *f, const IrGroup *g, IrOperand *reads, int *nreads, const IrValue **writes, int *nwrites,
                 int cap);
// Whether g's members fit its kind (the comment at IrGroupKind); why says how they do not.
bool ir_group_fits(const IrFunc *f, const IrGroup *g, char *why, size_t size);
// Whether optimizer update b can share the launch of update a (an update group, IR_GROUP_UPDATE):
// both updates of a parameter, of one kind, AdamW's with the same beta1, beta2 and eps.
bool ir_update_joins(const IrOp *a, const IrOp *b);
// Whether f's ops run on several streams: some op on the intra or inter stream (passes/schedule.c),
// unless MOEC_STREAMS=0 in the environment, which runs every function straight-line on one
// stream (lang/manual.md). Codegen emits such a function as streams and events, memplan reuses
// no memory inside it, the fuse pass joins no updates in it.
bool ir_func_concurrent(const IrFunc *f);
// Finds a value by name in f, then in f->saves.
IrValue *ir_find_value(const IrFunc *f, const char *name);
void ir_add_ret(IrFunc *f, IrModule *m, IrValue *v);

// Attributes on ops, params and the module (set replaces an existing key).
void ir_attrs_set_int(IrAttr *attrs, int *n, const char *key, int64_t v);
void ir_attrs_set_float(IrAttr *attrs, int *n, const char *key, double v);
void ir_attrs_set_str(IrModule *m, IrAttr *attrs, int *n, const char *key, const char *v);
const IrAttr *ir_attrs_get(const IrAttr *attrs, int n, const char *key);
int64_t ir_attr_int(const IrAttr *attrs, int n, const char *key, int64_t dflt);
double ir_attr_float(const IrAttr *attrs, int n, const char *key, double dflt);  // ints convert
const char *ir_attr_str(const IrAttr *attrs, int n, const char *key, const char *dflt);
#define ir_op_set_int(op, k, v) ir_attrs_set_int((op)->attrs, &(op)->nattrs, k, v)
#define ir_op_set_float(op, k, v) ir_attrs_set_float((op)->attrs, &(op)->nattrs, k, v)
#define ir_op_int(op, k, d) ir_attr_int((op)->attrs, (op)->nattrs, k, d)
#define ir_op_float(op, k, d) ir_attr_float((op)->attrs, (op)->nattrs, k, d)
#define ir_op_str(op, k, d) ir_attr_str((op)->attrs, (op)->nattrs, k, d)
#define ir_func_int(f, k, d) ir_attr_int((f)->attrs, (f)->nattrs, k, d)
#define ir_func_float(f, k, d) ir_attr_float((f)->attrs, (f)->nattrs, k, d)
#define ir_mod_int(m, k, d) ir_attr_int((m)->attrs, (m)->nattrs, k, d)
#define ir_mod_float(m, k, d) ir_attr_float((m)->attrs, (m)->nattrs, k, d)
#define ir_mod_str(m, k, d) ir_attr_str((m)->attrs, (m)->nattrs, k, d)
// A frozen parameter (attribute frozen: a LoRA model's base weights, lang/manual.md §7.3) takes no
// gradient, no optimizer state and no update.
#define ir_param_frozen(p) (ir_attr_int((p)->attrs, (p)->nattrs, "frozen", 0) != 0)

static inline IrType ir_type0(IrDtype dt) { return (IrType){.dtype = dt, .rank = 0}; }
static inline IrType ir_type1(IrDtype dt, int64_t a) { return (IrType){.dtype = dt, .rank = 1, .dim = {a}}; }
static inline IrType ir_type2(IrDtype dt, int64_t a, int64_t b) { return (IrType){.dtype = dt, .rank = 2, .dim = {a, b}}; }
static inline IrType ir_type3(IrDtype dt, int64_t a, int64_t b, int64_t c) { return (IrType){.dtype = dt, .rank = 3, .dim = {a, b, c}}; }

// ---- printer and parser (ir/print.c, ir/parse.c) ----
void ir_print(FILE *out, const IrModule *m);
char *ir_print_to_string(const IrModule *m);   // malloc'd
// Parses IR text; on error reports through d (file:line:col + caret) and returns NULL.
IrModule *ir_parse(IrDiag *d, const IrSource *src);

// ---- Graphviz (ir/ir_dot.c) ----
// m as a Graphviz digraph (`moec dump-ir --dot`, for `dot -Tsvg`): ops as nodes coloured by
// stream, values as edges, events dashed, fused groups as `cluster_fuse_G` boxes, each function
// a `cluster_func_N`; only the function `only` when non-NULL. note (e.g. "after fuse") joins the
// graph's title. False when out failed.
bool ir_print_dot(FILE *out, const IrModule *m, const IrFunc *only, const char *note);

// ---- verifier and shape inference (ir/verify.c, ir/shapes.c) ----
// Checks structure: arity, required attributes, operand resolution, names unique, dtypes,
// and that every op's result type equals the inferred one. Reports each problem through d.
bool ir_verify(IrDiag *d, const IrModule *m);
// The result type of op from its operands and attributes; false (with a diagnostic) when the
// operands do not fit the op.
bool ir_infer_type(IrDiag *d, const IrOp *op, IrType *out);
// Whether rule is a well-formed SHAPE rule of ops.def for an op of nargs operands; why says
// what is wrong otherwise.
bool ir_shape_rule_check(const char *rule, int nargs, char *why, size_t size);

#endif
