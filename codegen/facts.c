// Layer 1 of codegen/ (the bottom): facts about a scheduled, memory-planned module that every
// layer above reads: the events of functions on several streams
// (cg_events, cg_op_waits), each parameter's float offset (cg_param_offsets, cg_grad_floats),
// the parallel groups and streams of ops, operand types, whether the GEMMs read bf16
// (cg_bf16_gemms) and how the CUDA target lowers (cg_cuda_lowering), a GEMM's shape (cg_gemm).
// It calls nothing in codegen/ (only ir/ and passes/).
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cg_internal.h"

// ---- scheduled functions and their events ----
// A function whose ops run on several streams (ir_func_concurrent) is emitted as task tables for
// rt_run_streams (the CPU program) or on CUDA streams (the CUDA host program). Events are
// renumbered per function, a collective waiting for the previous one on its group.
const char *cg_stream_enum(IrStream s) {
  return s == IR_STREAM_INTRA ? "RT_STREAM_INTRA" : s == IR_STREAM_INTER ? "RT_STREAM_INTER" : "RT_STREAM_COMPUTE";
}


bool cg_events(IrDiag *d, const IrFunc *f, CgEvents *ev) {
  int n = f->nops;
  ev->dep = malloc(((size_t)n + 1) * sizeof *ev->dep);
  ev->local = malloc(((size_t)n + 1) * sizeof *ev->local);
  ev->rec = calloc((size_t)n + 1, sizeof *ev->rec);
  ev->count = 0;
  if (!ev->dep || !ev->local || !ev->rec) {
    cg_events_free(ev);
    return ir_oom(d);
  }
  for (int i = 0; i < n; i++) {
    const IrOp *op = f->ops[i];
    ev->dep[i] = -1;
    ev->local[i] = -1;
    if (op->event >= 0) ev->rec[i] = true;
    if (!ir_op_is_collective(op->kind)) continue;
    for (int j = i - 1; j >= 0; j--) {
      const IrOp *p = f->ops[j];
      if (!ir_op_is_collective(p->kind) || cg_group_index(p) != cg_group_index(op)) continue;
      if (p->stream != op->stream) {
        ev->dep[i] = j;
        ev->rec[j] = true;
      }
      break;
    }
  }
  for (int i = 0; i < n; i++)
    if (ev->rec[i]) ev->local[i] = ev->count++;
  return true;
}

void cg_events_free(CgEvents *ev) {
  free(ev->dep);
  free(ev->local);
  free(ev->rec);
  ev->dep = ev->local = NULL;
  ev->rec = NULL;
}

int cg_op_waits(const IrFunc *f, const CgEvents *ev, int i, int *waits, int max) {
  const IrOp *op = f->ops[i];
  int nw = 0;
  for (int w = 0; w < op->nwaits; w++) {
    int e = -1;
    for (int j = 0; j < i; j++)
      if (f->ops[j]->event == op->waits[w]) e = ev->local[j];
    bool seen = false;
    for (int k = 0; k < nw; k++) seen |= waits[k] == e;
    if (e >= 0 && !seen && nw < max) waits[nw++] = e;
  }
  if (ev->dep[i] >= 0 && nw < max) waits[nw++] = ev->local[ev->dep[i]];
  return nw;
}

// ---- parameters ----


// The trained parameters first, then the frozen ones (a LoRA model's base weights): the gradients
// and the optimizer's moments are the first cg_grad_floats floats only.
int64_t *cg_param_offsets(const IrModule *m, int64_t *total) {
  int64_t *offset = calloc((size_t)m->nparams + 1, sizeof *offset);
  *total = 0;
  if (!offset) return NULL;
  for (int pass = 0; pass < 2; pass++)
    for (int i = 0; i < m->nparams; i++) {
      if (ir_param_frozen(m->params[i]) != (pass == 1)) continue;
      offset[i] = *total;
      *total += ir_type_numel(&m->params[i]->type);
    }
  return offset;
}

int64_t cg_grad_floats(const IrModule *m) {
  int64_t n = 0;
  for (int i = 0; i < m->nparams; i++)
    if (!ir_param_frozen(m->params[i])) n += ir_type_numel(&m->params[i]->type);
  return n;
}

CgGemm cg_gemm(const IrOp *op) {
  const IrType *t0 = cg_operand_type(&op->args[0]), *rt = &op->result->type;
  CgGemm g = {.expert = op->kind == IR_OP_EXPERT_MATMUL, .ta = ir_op_int(op, "ta", 0), .tb = ir_op_int(op, "tb", 0), .e = 1};
  int lead = g.expert ? 1 : 0;   // an expert GEMM's dims after the expert's
  if (g.expert) g.e = rt->dim[0];
  g.m = rt->dim[lead], g.n = rt->dim[lead + 1], g.k = g.ta ? t0->dim[lead] : t0->dim[lead + 1];
  return g;
}

bool cg_module_has(const IrModule *m, IrOpKind kind, const char *attr) {
  for (int i = 0; i < m->nfuncs; i++)
    for (int j = 0; j < m->funcs[i]->nops; j++) {
      const IrOp *op = m->funcs[i]->ops[j];
      if (op->kind == kind && (!attr || ir_op_int(op, attr, 0))) return true;
    }
  return false;
}

// ---- ops: groups, streams, operands ----

const char *const cg_group_names[5] = {"world", "dp", "mp", "ep", "esp"};
const char *const cg_group_enums[5] = {"RT_GROUP_WORLD", "RT_GROUP_DP", "RT_GROUP_MP", "RT_GROUP_EP", "RT_GROUP_ESP"};

int cg_group_named(const char *g) {
  for (int i = 1; i < 5; i++)
    if (strcmp(g, cg_group_names[i]) == 0) return i;
  return 0;
}

int cg_group_index(const IrOp *op) { return cg_group_named(ir_op_str(op, "group", "world")); }

const char *cg_group_enum(const IrOp *op) { return cg_group_enums[cg_group_index(op)]; }

IrStream cg_op_stream(const IrOp *op) { return op->stream == IR_STREAM_NONE ? IR_STREAM_COMPUTE : op->stream; }

const IrType *cg_operand_type(const IrOperand *a) { return a->param ? &a->param->type : &a->value->type; }

// ---- the CUDA target's lowering ----

bool cg_bf16_gemms(const IrModule *m) { return strcmp(ir_mod_str(m, "dtype", "fp32"), "bf16") == 0; }

unsigned cg_cuda_lowering(const IrModule *m) {
  const char *rows = getenv("MOEC_EXPERT_ROWS");   // "all": every expert GEMM over all its slots;
  const char *tc = getenv("MOEC_ATTN_TC");          // "0": dtype bf16's attention on the CUDA cores
  const char *map = getenv("MOEC_SLOT_MAP");        // "0": the orders pass over every choice (no CG_LOWER_MAP)
  bool bf16 = cg_bf16_gemms(m);
  // "gemm": the expert GEMMs over their filled rows, the other kernels over every slot (no CG_LOWER_SLOTS)
  // "scan": every count from the data (no CG_LOWER_ROUTE)
  return (ir_mod_int(m, "no_fuse", 0) ? 0 : CG_LOWER_FUSE) | (bf16 ? CG_LOWER_BF16 : 0) |
         (rows && strcmp(rows, "all") == 0 ? 0 : CG_LOWER_ROWS) |
         (rows && (strcmp(rows, "all") == 0 || strcmp(rows, "scan") == 0) ? 0 : CG_LOWER_ROUTE) |
         (rows && (strcmp(rows, "all") == 0 || strcmp(rows, "gemm") == 0) ? 0 : CG_LOWER_SLOTS) |
         (bf16 && !(tc && strcmp(tc, "0") == 0) ? CG_LOWER_ATTN_TC : 0) | (map && strcmp(map, "0") == 0 ? 0 : CG_LOWER_MAP);
}

// ---- the expert GEMMs over their filled rows (CG_LOWER_ROWS) ----

// Whether value v's slot rows are likely zero past each block's filled ones, and the blocks of
// its slot dimension (*blocks): order.encode's dispatched tokens and order.decode.grad_y's
// gradient (zeroed before their routed rows are written; a block per routing group), an
// all-to-all or expert_major layout of such a value (a block per source rank too), and what keeps
// zero rows zero: an expert GEMM over it (ta 0), a product with it, an activation's gradient of
// it. Only a guess that saves work: the counts are the data's (mk_expert_counts), right whatever
// the guess.
static bool slot_padded(const IrValue *v, int64_t *blocks, int depth) {
  const IrOp *op = v ? v->def : NULL;
  if (!op || depth > 8) return false;
  const char *name = ir_op_info[op->kind].name;
  const IrValue *x = op->nargs > 0 ? op->args[0].value : NULL;
  switch (op->kind) {
  case IR_OP_ORDER_ENCODE:
  case IR_OP_ORDER_DECODE_GRAD_Y:
    *blocks = ir_op_int(op, "groups", 1);
    return ir_op_int(op, "capacity", 0) > 0;
  case IR_OP_COMM_ALLTOALL: return slot_padded(x, blocks, depth + 1);
  case IR_OP_LAYOUT_EXPERT_MAJOR:
    if (!slot_padded(x, blocks, depth + 1)) return false;
    *blocks *= ir_op_int(op, "blocks", 1);
    return true;
  case IR_OP_EXPERT_MATMUL: return !ir_op_int(op, "ta", 0) && slot_padded(x, blocks, depth + 1);
  case IR_OP_MUL:
    return slot_padded(x, blocks, depth + 1) || (op->args[1].value && slot_padded(op->args[1].value, blocks, depth + 1));
  default: return strncmp(name, "act.", 4) == 0 && strstr(name, ".grad") && slot_padded(x, blocks, depth + 1);
  }
}

// Whether an op of f at index i or later reads v (so v is alive at op i).
static bool read_from(const IrFunc *f, int i, const IrValue *v) {
  for (; i < f->nops; i++)
    for (int a = 0; a < f->ops[i]->nargs; a++)
      if (f->ops[i]->args[a].value == v) return true;
  return false;
}

// The order op (of op's function, before it) whose idx and loc give the counts of GEMM op's
// operand x from the routing (mk_expert_counts_route): x is its result, a block per routing group,
// and idx and loc stay alive to op. NULL: the data's counts.
static const IrOp *route_of(const IrOp *op, const IrOperand *x, int64_t blocks) {
  const IrOp *o = x->value ? x->value->def : NULL;
  const IrFunc *f = op->result->func;
  if (!o || (o->kind != IR_OP_ORDER_ENCODE && o->kind != IR_OP_ORDER_DECODE_GRAD_Y) || x->value->func != f ||
      o->index >= op->index || blocks != ir_op_int(o, "groups", 1) || !o->args[1].value || !o->args[2].value)
    return NULL;
  const IrType *idx = &o->args[1].value->type;
  if (idx->rank != 2 || o->args[2].value->type.rank != 2) return NULL;
  return read_from(f, op->index, o->args[1].value) && read_from(f, op->index, o->args[2].value) ? o : NULL;
}

bool cg_expert_rows(const IrOp *op, CgRows *r) {
  if (op->kind != IR_OP_EXPERT_MATMUL || !op->result) return false;
  bool ta = ir_op_int(op, "ta", 0), tb = ir_op_int(op, "tb", 0);
  if (ta && tb) return false;
  // ta 0: the rows of A (and of C); ta 1: the slots the weight gradient sums over, B's rows first
  int order[2] = {ta ? 1 : 0, ta ? 0 : -1};
  for (int j = 0; j < 2 && order[j] >= 0; j++) {
    const IrOperand *x = &op->args[order[j]];
    int64_t blocks = 1;
    if (x->param || !slot_padded(x->value, &blocks, 0)) continue;
    const IrType *t = &x->value->type;
    if (t->rank != 3) continue;
    if (t->dim[1] <= 0 || blocks < 1 || t->dim[1] % blocks) blocks = 1;
    *r = (CgRows){.operand = order[j], .groups = t->dim[0] * blocks, .rows = t->dim[1] / blocks, .width = t->dim[2],
                  .blocks = blocks, .route = route_of(op, x, blocks)};
    return true;
  }
  return false;
}
