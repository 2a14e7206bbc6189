// Layer 7 of codegen/ (an emitter: the CUDA host program); it may call layers 1-6 (facts.c,
// kernels.c, launch.c, spell.c, host.c), no other emitter.
//
// The CUDA target's host program: the scheduled, memory-planned module as a C program that
// trains on one GPU per rank through runtime/cuda (rt_cuda.h), driven by rt_main.
//
// It describes the model to rt_main as the CPU program does (cg_emit_params, cg_emit_model),
// plus a device (RtDevice, moert.h): rt_main keeps its host copies and calls the device's hooks
// to move parameters, moments, gradients and the output across. The hooks are thin: the program
// describes itself (RtCudaProgram, rt_cuda.h) and the GPU runtime's session (runtime/cuda/
// session.c) claims the GPU, loads the kernels, connects the ranks and moves the copies.
// Device memory is one block carved at fixed offsets: parameters, gradients and moments (the CPU
// program's float offsets), the step's input and target, the activation arena of the memory plan
// (the CPU program's byte offsets), the record hooks' statistics and, with dtype bf16, the
// scratch of the GEMMs' bf16 operands. Every op becomes, in program order:
//   - the kernel launches emit_cuda.c's unit lists in its launch plan (cg_lower, lower.c: the same
//     kernels, grids and arguments; fused gates included), from the CUBIN NVRTC compiled for
//     --gpu-arch or, on a newer GPU, the PTX the driver compiles;
//   - matmul and expert.matmul: rt_cuda_gemm and rt_cuda_expert_gemm (cuBLAS, fp32 accumulation
//     and output; fp32 inputs, or with dtype bf16 bf16 inputs: each operand rounded to bf16 by
//     mk_compress_bf16 into the scratch B of the op's stream first, cg_bf16_gemms);
//   - comm.*: NCCL on the op's group (a communicator per group of more than one rank, made over
//     MPI when the ranks connect) or a device copy on a group of one; comm.split: a device copy
//     of this rank's slice; comm.allreduce_grad: in place on the parameter's gradient slice.
// Ops go on their streams (compute, intra or inter, as the schedule pass assigned; compute in
// functions that are not scheduled), wait for their events and record their own, numbered as
// the CPU program numbers them (cg_events: a collective also waits for the previous one on its
// group). A scheduled function starts after everything before it on the compute stream (fork)
// and the compute stream waits for the other two at its end (join): function boundaries are
// full synchronisations, as in rt_run_streams.
//
// The statistics the CPU program gathers during the forward (routing counts, loads,
// route_hash, the aux and z losses, mse, record lines) come back to the host: right after the
// op that makes one, a device copy into the staging area S on the op's stream (its arena slot
// may be reused later in the step; the record hooks' kernel writes there directly); at the end
// of the step function the host waits for the streams, copies S to its twin H in one transfer
// and replays the statistics in program order with the CPU runtime's own functions
// (rt_route_stats, rt_expert_choice_stats, rt_record_stats), so the report means what the
// CPU's means. A CUDA call that fails inside a step ends the job, naming the op (rt_comm_abort).
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "cg_internal.h"

enum { EV_FORK, EV_JOIN_INTRA, EV_JOIN_INTER, EV_BASE };   // events of every scheduled function, then its own

// The step functions, in the order rt_main calls them (Host.count's index).
enum { STEP_FORWARD, STEP_BACKWARD, STEP_UPDATE, STEP_COUNT };
static const char *const step_names[STEP_COUNT] = {"forward", "backward", "update"};

// What a step function launches (Host.count).
typedef struct Counts {
  int64_t kernels, casts, gemms, comms;
  int64_t row_counts;      // the kernels that count expert GEMMs' filled rows (mk_expert_counts) or fill past them
  int64_t row_routed;      // the expert GEMMs over counts from the routing (mk_expert_counts_route)
  int64_t row_orders;      // the orders' kernels writing below those counts only
  int64_t slot_maps;       // the orders' slot maps (mk_slot_map: CG_LOWER_MAP), and the orders over slot rows
  int64_t slot_orders;
  double map_bytes;        // about what those orders and their maps read and write to find their choices
  double scan_bytes;       // what a pass over every choice for each 16 slot rows reads instead (without maps)
  int64_t expert_gemms, row_gemms;   // expert GEMMs, and those over their filled rows
  int64_t attn_ops, attn_tc;          // attention ops (forward, statistics, backward), and those on tensor cores
  int64_t row_guards, row_skips;      // fused groups that read expert GEMMs' counts, and those that skip the rows past them
  int64_t row_lazy;                   // expert GEMMs whose results' rows past the counts are left unwritten
  double kernel_bytes, gemm_bytes;
  double rows_bytes;                  // of kernel_bytes, what the row_guards move only below the counts
  double unfused_bytes;   // what the fused groups' ops would move op by op, less what their kernels move
} Counts;

// A range of an update run's table, as the program prints it (runtime/moert.h's RtUpdateRange).
typedef struct CgUpdateRange {
  int64_t start, n, block0;
  double lr, weight_decay;
} CgUpdateRange;
enum { RANGE_BYTES = 32 };   // sizeof(RtUpdateRange) in the program: three int64_t, two floats

typedef struct Host {
  FILE *out;                 // the functions (a memory stream: the tables they use are printed first)
  FILE *epi;                 // the current step function's host epilogue (a memory stream)
  IrDiag *d;
  const IrModule *m;
  const PassMemPlan *plan;
  const CgLaunches *ls;      // every op lowered once (cg_cuda_launches), by function
  int64_t *param_offset;     // floats, by parameter index
  CgSpelling sp;             // the names of the device buffers (spelling)
  int64_t param_floats;
  int64_t grad_floats;       // the trained parameters' (the first; a LoRA model's frozen ones follow)
  bool adamw;
  int *kernel_slot;          // the program's kernel table index, by library kernel id (-1 unused)
  char **where;              // what each error site was doing, for op_failed
  int nwhere, cap_where;
  int64_t stage_bytes;       // the staging area S on the device, H on the host
  int max_events;
  int64_t group_size[5];     // RtGroup order: world, dp, mp, ep, esp
  bool group_nccl[5];        // a collective on a group of more than one rank
  int64_t *staged;           // host offset of a value of the current function, by id (-1 none)
  int64_t *rows_at;          // the staging offset of each launch's filled-row counts in the current function
  const IrOp *loss_op;       // the loss op whose launch sums partial sums (cg_split_reduction), or NULL
  int64_t loss_parts;        // and where they are in the staging area
  char output[96];           // the device address of the model's output ("" none)
  // `aux pooled` (rt_pool_finish): each pooled layer's statistics [2, E], their device address
  // and staging offset, written back to the device after the forward's epilogue pools them
  char (*pooled_addr)[96];
  int64_t *pooled_off, *pooled_bytes;
  int npooled;
  bool bf16;                 // dtype bf16: the GEMMs take bf16 copies of their operands (cg_bf16_gemms)
  int64_t bf16_slot[4];      // bytes of each of the two bf16 operand slots of a stream (IrStream index)
  const IrValue *in_slot[4][2];   // the value whose bf16 copy each slot holds now (NULL: none), per stream
  const IrValue **copied;         // the values rounded into their bf16 copy so far (value_copy)
  int ncopied, cap_copied;
  int64_t operand_casts;          // the GEMM operands' casts a step (mk_compress_bf16 launches)
  int64_t row_spared;             // the expert GEMMs' row kernels the fused launches spare (unfused_extra)
  double operand_cast_bytes;      // and the bytes they move
  // The tables of the update runs (CG_ARG_RANGES): every run's ranges, one after the other, copied
  // to the device (U) when it is created; ranges_at: the current launch's first range
  CgUpdateRange *ranges;
  int nranges, cap_ranges, ranges_at, w_ranges;
  // What each step function launches (moec build -v, and the program's header): by phase
  // (forward, backward, update), the kernel launches (bf16 casts among them), cuBLAS GEMMs and
  // collectives or device copies, and the bytes they move (operands read once, results written once)
  int phase;                 // the step function being emitted (STEP_*)
  Counts count[STEP_COUNT];
  // Microbatches and pipeline stages (runtime/pipeline.c, RtDevice.use_slot and .accumulate):
  // pipe when the program has either; micro microbatches a step, slots of them in flight (each its
  // input X, target T and arena A); link: a stage before the last (its forward's output and its
  // backward's target cross to the host); input_grad: a later stage's gradient of its input (the
  // device address, "" on the first stage), which crosses to the host after the backward.
  bool pipe, link;
  int64_t micro, slots;
  char input_grad[96];
  // The reductions of the gradient buffer in the backward that the microbatches before the last
  // skip and the last one adds the sum of the earlier ones to first (pipeline.c's gradient hook):
  // their ranges of G, in floats, for the sum's addition to the elements none of them reduces.
  int64_t (*hooked)[2];
  int nhooked, cap_hooked;
  int w_slot, w_acc, w_part;   // the hooks' error sites (pipe_sites)
  bool ok;
} Host;

// ---- small helpers ----

static int64_t align(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

// s as the body of a C string literal (no quotes).
static void put_escaped(FILE *out, const char *s) {
  for (; *s; s++) {
    if (*s == '"' || *s == '\\') fprintf(out, "\\%c", *s);
    else if ((unsigned char)*s < 0x20 || (unsigned char)*s >= 0x7f) fprintf(out, "\\%03o", (unsigned char)*s);
    else fputc(*s, out);
  }
}

// bytes as a C string literal, a line of source per ~100 characters. Printable characters stay
// (the PTX reads as text); '?' is escaped (no trigraphs), everything else is three-digit octal.
static void put_bytes(FILE *out, const unsigned char *bytes, size_t n) {
  fputs("\n  \"", out);
  int col = 0;
  for (size_t i = 0; i < n; i++) {
    unsigned char c = bytes[i];
    if (c == '"' || c == '\\' || c == '?') col += fprintf(out, "\\%c", c);
    else if (c == '\n') col += fprintf(out, "\\n");
    else if (c >= 0x20 && c < 0x7f) col += fprintf(out, "%c", c);
    else col += fprintf(out, "\\%03o", c);
    if ((col >= 100 || c == '\n') && i + 1 < n) {
      fputs("\"\n  \"", out);
      col = 0;
    }
  }
  fputc('"', out);
}

// Adds an error site: "what (FILE:LINE:COL) in @FUNC"; its index in the program's table.
static int where(Host *h, const IrFunc *f, const IrOp *op, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int where(Host *h, const IrFunc *f, const IrOp *op, const char *fmt, ...) {
  char what[256], place[512] = "", text[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  if (op && op->loc.src) snprintf(place, sizeof place, " (%s:%d:%d)", op->loc.src->path, op->loc.line, op->loc.col);
  snprintf(text, sizeof text, "%s%s%s%s", what, place, f ? " in @" : "", f ? f->name : "");
  if (h->nwhere == h->cap_where) {
    int cap = h->cap_where ? 2 * h->cap_where : 64;
    char **w = realloc(h->where, (size_t)cap * sizeof *w);
    if (!w) {
      h->ok = ir_oom(h->d);
      return 0;
    }
    h->where = w;
    h->cap_where = cap;
  }
  if (!(h->where[h->nwhere] = strdup(text))) h->ok = ir_oom(h->d);
  return h->nwhere++;
}

// The host program's names of the device buffers (A the arena, X and T the step's input and
// target, P, G, M, V the parameters, gradients and moments).
static CgSpelling spelling(const Host *h) {
  return (CgSpelling){.plan = h->plan, .param_offset = h->param_offset, .typed = false, .arena = "A",
                      .input = "X", .target = "T", .params = "P", .grads = "G", .opt_m = "M", .opt_v = "V",
                      .params16 = h->bf16 ? "P16" : NULL};
}

// ---- staging: values the host reads after the step function ----

// A new place of bytes in the staging area; its offset.
static int64_t stage_place(Host *h, int64_t bytes) {
  int64_t off = h->stage_bytes;
  h->stage_bytes = align(off + bytes, 8);
  return off;
}

// Copies value v of f (just made on stream s) to a new place of the staging area; its offset.
static int64_t stage(Host *h, const IrFunc *f, const IrOp *op, const IrValue *v, IrStream s) {
  char addr[96];
  cg_spell_value(&h->sp, v, addr, sizeof addr);
  int64_t bytes = ir_type_bytes(&v->type), off = stage_place(h, bytes);
  int site = op ? where(h, f, op, "staging %%%s of %s", v->name, ir_op_info[op->kind].name)
               : where(h, f, NULL, "staging %%%s", v->name);
  fprintf(h->out, "  CK(rt_cuda_copy(cu, %s, S + %" PRId64 ", %s, %" PRId64 "), %d);\n", cg_stream_enum(s), off, addr,
          bytes, site);
  return off;
}

// The statistics op (of f, just issued on stream s) leaves for the host: copies into the
// staging area after it, and what the host does with them in the epilogue, in program order.
static void stage_op(Host *h, const IrFunc *f, const IrOp *op, IrStream s) {
  switch (op->kind) {
  case IR_OP_GATE_LOCATIONS: {
    const IrType *t = &op->args[0].value->type;
    int64_t idx = stage(h, f, op, op->args[0].value, s), loc = stage(h, f, op, op->result, s);
    fprintf(h->epi, "  rt_route_stats(st, (const int32_t *)(H + %" PRId64 "), (const int32_t *)(H + %" PRId64 "), %" PRId64
                    ", %" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 ");\n",
            idx, loc, t->dim[0], t->dim[1], ir_op_int(op, "experts", 0), ir_op_int(op, "groups", 1),
            ir_op_int(op, "dropless", 0) ? 0 : ir_op_int(op, "capacity", 0));
    break;
  }
  case IR_OP_GATE_EXPERT_CHOICE: {
    const IrType *t = &op->args[0].value->type;
    int64_t loc = stage(h, f, op, op->result, s);
    fprintf(h->epi, "  rt_expert_choice_stats(st, (const int32_t *)(H + %" PRId64 "), %" PRId64 ", %" PRId64 ", %" PRId64
                    ", %" PRId64 ");\n",
            loc, t->dim[0], t->dim[1], ir_op_int(op, "groups", 1), ir_op_int(op, "capacity", 0));
    break;
  }
  default:
    break;
  }
  // Results the functions return for the step's statistics (aux, z, the loss).
  if (op->result && h->staged[op->result->id] == -2) h->staged[op->result->id] = stage(h, f, op, op->result, s);
}

// ---- ops ----

// One kernel argument for parameter type t, as the value macro of the program (PTR, I32, ...)
// in buf; false when the argument does not fit the parameter (an internal error).
static bool kernel_arg(Host *h, const IrFunc *f, int i, const CgArg *a, CgParamType t, int64_t stats,
                       int64_t scratch, char *buf, size_t n) {
  const IrOp *op = f->ops[i];
  const CgArgInfo *info = cg_arg_info(a->kind);
  char addr[96];
  if (!cg_arg_fits(a->kind, t)) return false;
  if (info->step_field) {   // the step's value: U64(st->seed), I64(st->step), F32(st->lr_scale), ...
    snprintf(buf, n, "%s(st->%s)", t == CG_PARAM_U64 ? "U64" : t == CG_PARAM_I64 ? "I64" : "F32", info->step_field);
    return true;
  }
  if (!cg_spell_pointer(&h->sp, f, i, a, addr, sizeof addr)) {
    switch (a->kind) {
    case CG_ARG_STATS:   // gate.locations: NULL (the host counts from idx and loc); hook.record: its doubles
      if (stats >= 0) snprintf(addr, sizeof addr, "(S + %" PRId64 ")", stats);
      else snprintf(addr, sizeof addr, "NULL");
      break;
    case CG_ARG_SCRATCH:   // the launch's partial sums, in the staging area (never read by the host)
      if (scratch < 0) return false;
      snprintf(addr, sizeof addr, "(S + %" PRId64 ")", scratch);
      break;
    case CG_ARG_RANGES:    // the update run's table, in U
      snprintf(addr, sizeof addr, "(U + %d * sizeof(RtUpdateRange))", h->ranges_at);
      break;
    case CG_ARG_INT:
      if (t == CG_PARAM_INT && (a->i < INT32_MIN || a->i > INT32_MAX))
        return ir_error_at(h->d, op->loc, "the CUDA target passes %" PRId64 " as a 32-bit kernel argument; it does not fit", a->i);
      snprintf(buf, n, "%s(%" PRId64 ")", t == CG_PARAM_INT ? "I32" : t == CG_PARAM_I64 ? "I64" : "U64", a->i);
      return true;
    case CG_ARG_FLOAT: snprintf(buf, n, "F32((float)%.17g)", a->f); return true;
    default: return false;
    }
  }
  snprintf(buf, n, "PTR(%s)", addr);
  return true;
}

static bool emit_kernel(Host *h, const IrFunc *f, int i, const CgKernelCall *c, IrStream s, int64_t stats,
                        int64_t scratch) {
  const IrOp *op = f->ops[i];
  CgParamType types[CG_MAX_KERNEL_ARGS];
  int nparams = cg_cuda_kernel_params(h->ls, c->kernel, types, CG_MAX_KERNEL_ARGS);
  const char *name = cg_cuda_kernel_name(h->ls, c->kernel);
  if (nparams != c->nargs)
    return ir_internal_at(h->d, op->loc, "kernel %s takes %d arguments, the launch of '%s' has %d", name,
                       nparams, ir_op_info[op->kind].name, c->nargs);
  int site = where(h, f, op, "kernel %s of %s", name, ir_op_info[op->kind].name);
  h->count[h->phase].kernels++;
  bool per_step = false;   // an argument that changes from step to step: its graph node is set before each replay
  for (int a = 0; a < c->nargs; a++) per_step |= cg_arg_info(c->args[a].kind)->step_field != NULL;
  fprintf(h->out, "  %s(%d, %s, %s, %" PRId64 ", %u, (void *[]){", per_step ? "launch_step" : "launch", site,
          cg_stream_enum(s), name, c->grid, c->shared_bytes);
  for (int a = 0; a < c->nargs; a++) {
    char buf[128];
    if (!kernel_arg(h, f, i, &c->args[a], types[a], stats, scratch, buf, sizeof buf))
      return ir_internal_at(h->d, op->loc, "argument %d of kernel %s does not fit its parameter", a, name);
    fprintf(h->out, "%s%s", a ? ", " : "", buf);
  }
  fprintf(h->out, "});\n");
  return true;
}

// Whether the collective's data are whole 4-byte words per block: rt_cuda's collectives move
// fp32 words, so other types go as their bytes in words (reductions need fp32).
static bool words(Host *h, const IrOp *op, const IrType *t, int64_t blocks, bool reduce, int64_t *count) {
  int64_t bytes = ir_type_bytes(t);
  if (reduce && t->dtype != IR_F32)
    return ir_error_at(h->d, op->loc, "the CUDA target reduces fp32 only; '%s' has %s data", ir_op_info[op->kind].name,
                       ir_dtype_name(t->dtype));
  if (bytes % (4 * blocks) != 0)
    return ir_error_at(h->d, op->loc, "the CUDA target moves whole 4-byte words per rank; '%s' has %" PRId64
                       " bytes for %" PRId64 " ranks", ir_op_info[op->kind].name, bytes, blocks);
  *count = bytes / (4 * blocks);
  return true;
}

// Microbatches: whether op, a reduction in the backward, reduces elements [*off, *off + *n) of the
// gradient buffer G (pipeline.c's gradient hook, runtime/comm.c: the reductions of the gradient
// buffer, rt_allreduce's, are skipped by the microbatches before the last, and the last one's add
// the earlier ones' sum first); the range is recorded for acc_finish.
static bool hooked_range(Host *h, const IrOp *op, int64_t *off, int64_t *n) {
  if (h->micro <= 1 || h->phase != STEP_BACKWARD || ir_op_int(op, "shard", 0) > 0) return false;
  if (op->kind == IR_OP_COMM_ALLREDUCE_GRAD) {
    *off = h->param_offset[op->args[0].param->index] + ir_op_int(op, "offset", 0);
    *n = ir_op_int(op, "count", 0);
  } else if (op->kind == IR_OP_COMM_ALLREDUCE) {
    const PassMemSlot *slot = &h->plan->slot[op->result->func->index][op->result->id];
    if (slot->kind != PASS_MEM_GRAD) return false;
    *off = h->param_offset[slot->offset];
    *n = ir_type_numel(&op->result->type);
  } else {
    return false;
  }
  if (h->nhooked == h->cap_hooked) {
    int cap = 2 * h->cap_hooked + 16;
    void *more = realloc(h->hooked, (size_t)cap * sizeof *h->hooked);
    if (!more) return h->ok = ir_oom(h->d);
    h->hooked = more, h->cap_hooked = cap;
  }
  h->hooked[h->nhooked][0] = *off, h->hooked[h->nhooked][1] = *n;
  h->nhooked++;
  return true;
}

// A reduction of G (hooked_range, elements [off, off + n)) as the microbatches run it (acc_phase,
// RtDevice.accumulate): opens the branch of the first and middle ones, which skip the reduction;
// emit_comm writes what they do instead (nothing, or the copy of the operand), then hook_last's
// branch: the last one adds the earlier ones' sum W to the values (from src) first; the
// reduction itself follows for the last microbatch and for a step of one alike.
static void hook_skip(Host *h) {
  fprintf(h->out, "  /* microbatches: reduced once, in the last one's backward, with the earlier ones' sum (pipeline.c) */\n"
                  "  if (acc_phase == ACC_FIRST || acc_phase == ACC_MIDDLE) {\n");
}

static void hook_last(Host *h, const IrFunc *f, const IrOp *op, IrStream s, int64_t off, int64_t n, const char *src) {
  int w = where(h, f, op, "kernel mk_add (the earlier microbatches' gradients) before %s", ir_op_info[op->kind].name);
  fprintf(h->out, "  } else {\n    if (acc_phase == ACC_LAST)\n      launch(%d, %s, %s, %" PRId64 ", 0, (void *[]){PTR(%s), PTR(W + %"
                  PRId64 "), PTR(G + %" PRId64 "), I64(%" PRId64 ")});\n",
          w, cg_stream_enum(s), cg_cuda_kernel_name(h->ls, CG_K_ADD), cg_cuda_grid_elems(n), src, off, off, n);
}

// A collective (NCCL) or a slice copy (CG_LIB_COLLECTIVE, CG_LIB_SPLIT).
static bool emit_comm(Host *h, const IrFunc *f, const IrOp *op, IrStream s) {
  char a[96] = "", r[96] = "";
  if (op->nargs && !op->args[0].param) cg_spell_value(&h->sp, op->args[0].value, a, sizeof a);
  if (op->result) cg_spell_value(&h->sp, op->result, r, sizeof r);
  int g = cg_group_index(op);
  int64_t size = h->group_size[g], count = 0;
  h->count[h->phase].comms++;
  const char *se = cg_stream_enum(s);
  int w = where(h, f, op, "%s on the %s group", ir_op_info[op->kind].name, cg_group_names[g]);
  const IrType *t0 = op->nargs ? cg_operand_type(&op->args[0]) : NULL, *rt = op->result ? &op->result->type : NULL;
  if (op->kind == IR_OP_COMM_SPLIT) {
    fprintf(h->out, "  CK(rt_cuda_copy(cu, %s, %s, (const unsigned char *)%s + (size_t)rt_comm_rank(st->comm, %s) * %" PRId64 ", %" PRId64
                    "), %d);\n", se, r, a, cg_group_enums[g], ir_type_bytes(rt), ir_type_bytes(rt), w);
    return true;
  }
  if (op->kind == IR_OP_COMM_COPY) {
    fprintf(h->out, "  CK(rt_cuda_copy(cu, %s, %s, %s, %" PRId64 "), %d);\n", se, r, a, ir_type_bytes(rt), w);
    return true;
  }
  int64_t hook_off = 0, hook_n = 0;
  bool hooked = hooked_range(h, op, &hook_off, &hook_n);
  if (!h->ok) return false;
  if (op->kind == IR_OP_COMM_ALLREDUCE_GRAD) {
    int64_t off = h->param_offset[op->args[0].param->index] + ir_op_int(op, "offset", 0);
    char src[64];
    snprintf(src, sizeof src, "G + %" PRId64, off);
    if (hooked) {
      hook_skip(h);
      fprintf(h->out, "    /* this microbatch's gradient stays in G, unreduced */\n");
      hook_last(h, f, op, s, off, hook_n, src);
    }
    const char *ind = hooked ? "    " : "  ";   // (inside the hook's branch)
    if (size == 1) {
      fprintf(h->out, "%s/* comm.allreduce_grad of @%s on a group of one: nothing to do */\n", ind, op->args[0].param->name);
    } else {
      h->group_nccl[g] = true;
      fprintf(h->out, "%sCK(rt_cuda_allreduce(cu, nccl[%s], %s, G + %" PRId64 ", G + %" PRId64 ", %" PRId64 "), %d);\n",
              ind, cg_group_enums[g], se, off, off, ir_op_int(op, "count", 0), w);
    }
    if (hooked) fprintf(h->out, "  }\n");
    return true;
  }
  const char *fn = op->kind == IR_OP_COMM_ALLGATHER       ? "rt_cuda_allgather"
                   : op->kind == IR_OP_COMM_REDUCESCATTER ? "rt_cuda_reducescatter"
                   : op->kind == IR_OP_COMM_ALLTOALL      ? "rt_cuda_alltoall"
                                                          : "rt_cuda_allreduce";
  bool reduce = op->kind == IR_OP_COMM_REDUCESCATTER || op->kind == IR_OP_COMM_ALLREDUCE;
  // Counts as rt_cuda takes them: AllGather and ReduceScatter per member, AlltoAll per block.
  bool ok = op->kind == IR_OP_COMM_ALLGATHER      ? words(h, op, t0, 1, false, &count)
            : op->kind == IR_OP_COMM_REDUCESCATTER ? words(h, op, rt, 1, true, &count)
            : op->kind == IR_OP_COMM_ALLTOALL      ? words(h, op, rt, size, false, &count)
                                                   : words(h, op, rt, 1, reduce, &count);
  if (!ok) return false;
  char src[160];   // what the collective reads: with microbatches the last one's sum, already in place
  snprintf(src, sizeof src, hooked ? "acc_phase == ACC_LAST ? %s : %s" : "%s%.0s", hooked ? r : a, a);
  if (hooked) {    // (comm.allreduce into the gradient buffer)
    hook_skip(h);
    fprintf(h->out, "    CK(rt_cuda_copy(cu, %s, %s, %s, %" PRId64 "), %d);   /* unreduced */\n", se, r, a, ir_type_bytes(rt), w);
    hook_last(h, f, op, s, hook_off, hook_n, a);
  }
  const char *ind = hooked ? "    " : "  ";
  if (size == 1) {   // every collective on a group of one is a copy
    fprintf(h->out, "%s%sCK(rt_cuda_copy(cu, %s, %s, %s, %" PRId64 "), %d);  /* %s on a group of one */\n", ind,
            hooked ? "if (acc_phase != ACC_LAST) " : "", se, r, a, ir_type_bytes(rt), w, ir_op_info[op->kind].name);
  } else {
    h->group_nccl[g] = true;
    fprintf(h->out, "%sCK(%s(cu, nccl[%s], %s, (const float *)(%s), (float *)%s, %" PRId64 "), %d);\n", ind, fn,
            cg_group_enums[g], se, src, r, count, w);
  }
  if (hooked) fprintf(h->out, "  }\n");
  return true;
}

// The bytes of the bf16 copy of a GEMM operand of type t in the scratch B (256-byte aligned).
static int64_t bf16_bytes(const IrType *t) { return align(ir_type_numel(t) * 2, 256); }

// dtype bf16: operand k of op (at device address src, type t) rounded to bf16 into dst on s.
static bool emit_bf16_cast(Host *h, const IrFunc *f, const IrOp *op, int k, const char *src, const char *dst,
                           const IrType *t, IrStream s) {
  int kernel = cg_cuda_bf16_cast_kernel();
  CgParamType types[CG_MAX_KERNEL_ARGS];
  if (cg_cuda_kernel_params(h->ls, kernel, types, CG_MAX_KERNEL_ARGS) != 3 || types[0] != CG_PARAM_POINTER ||
      types[1] != CG_PARAM_POINTER || types[2] != CG_PARAM_I64)
    return ir_internal_at(h->d, op->loc, "%s is not (const float *, u16 *, i64)", cg_cuda_kernel_name(h->ls, kernel));
  int64_t n = ir_type_numel(t);
  int site = where(h, f, op, "kernel %s (operand %d to bf16) of %s", cg_cuda_kernel_name(h->ls, kernel), k, ir_op_info[op->kind].name);
  h->count[h->phase].kernels++, h->count[h->phase].casts++;
  h->count[h->phase].kernel_bytes += 6.0 * (double)n;
  h->operand_casts++;
  h->operand_cast_bytes += 6.0 * (double)n;
  fprintf(h->out, "  launch(%d, %s, %s, %" PRId64 ", 0, (void *[]){PTR(%s), PTR(%s), I64(%" PRId64 ")});\n", site,
          cg_stream_enum(s), cg_cuda_kernel_name(h->ls, kernel), cg_cuda_grid_elems(n), src, dst, n);
  return true;
}

// Whether GEMM operand x is a value stored in bf16 only (passes/fuse.c: no fp32 memory; its maker
// writes the copy, which bf16_operands reads).
static bool bf16_only(const Host *h, const IrOperand *x) {
  return !x->param && h->sp.plan->slot[x->value->func->index][x->value->id].kind == PASS_MEM_NONE;
}

// dtype bf16: operand k of GEMM op from its bf16 copy of the memory plan (passes/fuse.c gives GEMM
// operands one), its address into dst: written by the value's maker where that is a fused kernel;
// else rounded into it before the first GEMM that reads it (once a step: the backward's GEMMs read
// the copies of saved activations the forward made), except in functions on several streams,
// where the stream's scratch slots serve as before. 1: done; 0: the value has no copy to use; -1:
// failed (reported).
static int value_copy(Host *h, const IrFunc *f, const IrOp *op, int k, const char *src, char *dst, size_t n, IrStream s) {
  const IrValue *v = op->args[k].value;
  if (!v || !v->def || !cg_spell_copy(&h->sp, v, dst, n)) return 0;
  const IrOp *maker = v->def;
  if (pass_writes_copy(maker)) return 1;   // its fused kernel writes it (else rounded here, once)
  if (ir_func_concurrent(f) || ir_func_concurrent(v->func)) return 0;
  for (int j = 0; j < h->ncopied; j++)
    if (h->copied[j] == v) return 1;
  if (h->ncopied == h->cap_copied) {
    int cap = 2 * h->cap_copied + 16;
    const IrValue **c = realloc(h->copied, (size_t)cap * sizeof *c);
    if (!c) return ir_oom(h->d), -1;
    h->copied = c, h->cap_copied = cap;
  }
  h->copied[h->ncopied++] = v;
  return emit_bf16_cast(h, f, op, k, src, dst, &v->type, s) ? 1 : -1;
}

// The scratch slots of GEMM op's value operands on one stream (in_slot: the values its two slots
// hold, updated): slot[k] of operand k and fresh[k] when it must be rounded into it now. An operand
// already in a slot is read from there (a stream's GEMMs run one after the other); a fresh one
// takes the slot the other does not use, one slot when both are one value. A parameter and an
// operand with skip[k] (read from a bf16 copy of its own) take none.
static void gemm_slots(const IrValue **in_slot, const IrOp *op, const bool *skip, int *slot, bool *fresh) {
  for (int k = 0; k < 2; k++) {
    const IrValue *v = op->args[k].param ? NULL : op->args[k].value;
    slot[k] = -1, fresh[k] = false;
    for (int j = 0; v && j < 2; j++)
      if (in_slot[j] == v) slot[k] = j;
  }
  for (int k = 0; k < 2; k++) {
    if (op->args[k].param || skip[k] || slot[k] >= 0) continue;
    if (k == 1 && !op->args[0].param && op->args[0].value == op->args[1].value) {
      slot[1] = slot[0];
      continue;
    }
    slot[k] = slot[1 - k] == 0 ? 1 : 0;
    fresh[k] = true;
    in_slot[slot[k]] = op->args[k].value;
  }
}

// dtype bf16: the bf16 operands of a GEMM on stream s, their addresses into qa and qb. A
// parameter is read from P16, the bf16 copy of the parameters the forward refreshes after each
// update or upload (one cast per step, not one per GEMM); a value with a bf16 copy of its own from
// there (value_copy); any other value from a slot of the stream's scratch (gemm_slots: the
// backward's dY @ W^T then X^T @ dY round dY once). The slots are forgotten at each function's
// start.
static bool bf16_operands(Host *h, const IrFunc *f, const IrOp *op, IrStream s, const char *a, const char *b,
                          char *qa, char *qb, size_t n) {
  const char *base = s == IR_STREAM_INTRA ? "B_INTRA" : s == IR_STREAM_INTER ? "B_INTER" : "B_COMPUTE";
  const char *src[2] = {a, b};
  char *dst[2] = {qa, qb};
  bool copy[2] = {false, false}, fresh[2];
  int slot[2];
  for (int k = 0; k < 2; k++) {
    int c = op->args[k].param ? 0 : value_copy(h, f, op, k, src[k], dst[k], n, s);
    if (c < 0) return false;
    copy[k] = c > 0;
  }
  gemm_slots(h->in_slot[s], op, copy, slot, fresh);
  for (int k = 0; k < 2; k++) {
    const IrOperand *arg = &op->args[k];
    if (arg->param) {
      snprintf(dst[k], n, "(P16 + %" PRId64 ")", h->param_offset[arg->param->index]);
      continue;
    }
    if (copy[k]) continue;
    if (bf16_only(h, arg))
      return ir_internal_at(h->d, op->loc, "operand %d of %s is stored in bf16 only and has no copy to read", k,
                            ir_op_info[op->kind].name);
    snprintf(dst[k], n, "(B + %s + %d * SLOT_%s)", base, slot[k], base + 2);
    int64_t bytes = bf16_bytes(cg_operand_type(arg));
    if (bytes > h->bf16_slot[s]) h->bf16_slot[s] = bytes;
    if (fresh[k] && !emit_bf16_cast(h, f, op, k, src[k], dst[k], cg_operand_type(arg), s)) return false;
  }
  return true;
}

// GEMM operand x's fp32 address into buf ("NULL" for one stored in bf16 only).
static void gemm_operand(const Host *h, const IrOperand *x, char *buf, size_t n) {
  if (bf16_only(h, x)) snprintf(buf, n, "NULL");
  else cg_spell_operand(&h->sp, x, buf, n);
}

// rows: the staging offset of the filled rows mk_expert_counts counted (-1: none, every slot), in
// blocks blocks an expert.
static bool emit_gemm(Host *h, const IrFunc *f, const IrOp *op, IrStream s, int64_t rows, int64_t blocks) {
  char a[96], b[96], r[96];
  gemm_operand(h, &op->args[0], a, sizeof a);
  gemm_operand(h, &op->args[1], b, sizeof b);
  cg_spell_value(&h->sp, op->result, r, sizeof r);
  const IrType *t0 = cg_operand_type(&op->args[0]), *t1 = cg_operand_type(&op->args[1]), *rt = &op->result->type;
  CgGemm g = cg_gemm(op);
  if (t0->dtype != IR_F32 || t1->dtype != IR_F32)
    return ir_error_at(h->d, op->loc, "the CUDA target multiplies fp32 only");
  const char *in = "RT_CUDA_F32";
  if (h->bf16) {   // both operands as bf16 copies; the GEMM reads the copies
    char qa[96], qb[96];
    if (!bf16_operands(h, f, op, s, a, b, qa, qb, sizeof qa)) return false;
    snprintf(a, sizeof a, "%s", qa);
    snprintf(b, sizeof b, "%s", qb);
    in = "RT_CUDA_BF16";
  }
  int w = where(h, f, op, "%s (cuBLAS)", ir_op_info[op->kind].name);
  h->count[h->phase].gemms++;
  h->count[h->phase].gemm_bytes += (double)(h->bf16 ? 2 : 4) * (double)(ir_type_numel(t0) + ir_type_numel(t1)) +
                                    (double)ir_type_bytes(rt);
  h->count[h->phase].expert_gemms += op->kind == IR_OP_EXPERT_MATMUL;
  h->count[h->phase].row_gemms += op->kind == IR_OP_EXPERT_MATMUL && rows >= 0;
  if (op->kind == IR_OP_MATMUL)
    fprintf(h->out, "  CK(rt_cuda_gemm(cu, %s, %s, %s, %s, (float *)%s, %" PRId64 ", %" PRId64 ", %" PRId64
                    ", %d, %d, false), %d);\n",
            cg_stream_enum(s), in, a, b, r, g.m, g.n, g.k, g.ta, g.tb, w);
  else if (rows < 0)
    fprintf(h->out, "  CK(rt_cuda_expert_gemm(cu, %s, %s, %s, %s, (float *)%s, %" PRId64 ", %" PRId64 ", %" PRId64
                    ", %" PRId64 ", %d, %d), %d);\n",
            cg_stream_enum(s), in, a, b, r, g.e, g.m, g.n, g.k, g.ta, g.tb, w);
  else   // a dtype bf16 program hands over moec's grouped GEMM (rt_cuda_rows_gemm says when it runs)
    fprintf(h->out, "  CK(rt_cuda_expert_gemm_rows(cu, %s, %s, %s, %s, (float *)%s, %" PRId64 ", %" PRId64 ", %" PRId64
                    ", %" PRId64 ", %d, %d, (const int *)(S + %" PRId64 "), %" PRId64 ", %s), %d);\n",
            cg_stream_enum(s), in, a, b, r, g.e, g.m, g.n, g.k, g.ta, g.tb, rows, blocks,
            h->kernel_slot[CG_K_EXPERT_GEMM_TC] >= 0 ? "kernels[mk_expert_gemm_tc]" : "NULL", w);
  return true;
}

// The bytes ops i .. i + nops - 1 of f move as kernels: each operand read once and each result
// written once (an update also reads the gradient and rewrites the parameter and its moments).
static double op_bytes(const IrFunc *f, int i, int nops, bool bf16) {
  double bytes = 0.0;
  for (int j = i; j < i + nops && j < f->nops; j++) {
    const IrOp *op = f->ops[j];
    if (op->kind == IR_OP_OPT_ADAMW || op->kind == IR_OP_OPT_SGD) {
      double p = (double)ir_type_bytes(cg_operand_type(&op->args[0]));
      bytes += p * (op->kind == IR_OP_OPT_ADAMW ? 7.0 : 3.0);   // p, g, m, v read; p, m, v written
      if (bf16) bytes += p / 2;                                // and the bf16 copy written
      continue;
    }
    for (int a = 0; a < op->nargs; a++)
      if (op->args[a].param || op->args[a].value) bytes += (double)ir_type_bytes(cg_operand_type(&op->args[a]));
    if (op->result) bytes += (double)ir_type_bytes(&op->result->type);
  }
  return bytes;
}

// The bytes a fused group's kernel moves: each pointer argument once (its inputs read, the
// results that leave written).
static double fused_bytes(const IrFunc *f, int i, const CgKernelCall *c) {
  double bytes = 0.0;
  for (int a = 0; a < c->nargs; a++) {
    const CgArg *x = &c->args[a];
    if (x->kind == CG_ARG_OPERAND) bytes += (double)ir_type_bytes(cg_operand_type(&f->ops[i + x->i]->args[x->index]));
    else if (x->kind == CG_ARG_RESULT) bytes += (double)ir_type_bytes(&f->ops[i + x->index]->result->type);
    else if (x->kind == CG_ARG_COPY) bytes += 2.0 * (double)ir_type_numel(&f->ops[i + x->index]->result->type);
    else if (x->kind == CG_ARG_OPERAND16) bytes += 2.0 * (double)ir_type_numel(cg_operand_type(&f->ops[i + x->i]->args[x->index]));
  }
  return bytes;
}

static bool has_arg(const CgKernelCall *c, CgArgKind kind) {
  for (int a = 0; a < c->nargs; a++)
    if (c->args[a].kind == kind) return true;
  return false;
}

// The table of the update run of ops i .. i + nops - 1 of f (lower.c's lower_update_run): each
// parameter's range from the first one's offset, its blocks of CG_UPDATE_CHUNK elements, its lr
// and weight decay; h->ranges_at says where it starts.
static bool update_ranges(Host *h, const IrFunc *f, int i, int nops) {
  if (h->nranges + nops > h->cap_ranges) {
    int cap = 2 * h->cap_ranges + nops;
    CgUpdateRange *r = realloc(h->ranges, (size_t)cap * sizeof *r);
    if (!r) return ir_oom(h->d);
    h->ranges = r, h->cap_ranges = cap;
  }
  h->ranges_at = h->nranges;
  int64_t base = h->param_offset[f->ops[i]->args[0].param->index], block0 = 0;
  for (int j = i; j < i + nops; j++) {
    const IrOp *op = f->ops[j];
    int64_t n = ir_type_numel(&op->args[0].param->type);
    h->ranges[h->nranges++] = (CgUpdateRange){.start = h->param_offset[op->args[0].param->index] - base, .n = n,
                                              .block0 = block0, .lr = ir_op_float(op, "lr", 0),
                                              .weight_decay = ir_op_float(op, "weight_decay", 0)};
    block0 += (n + CG_UPDATE_CHUNK - 1) / CG_UPDATE_CHUNK;
  }
  return true;
}

// Op i of f (and the ops a fused launch takes with it, *nops in all) on stream s.
static bool emit_op(Host *h, const IrFunc *f, int i, const CgLaunch *lp, IrStream s) {
  const IrOp *op = f->ops[i];
  CgLaunch l = *lp;
  if (op->kind == IR_OP_PARAM_GRAD) {
    const PassMemSlot *slot = &h->plan->slot[op->args[1].value->func->index][op->args[1].value->id];
    if (slot->kind == PASS_MEM_GRAD && slot->offset == op->args[0].param->index) {
      fprintf(h->out, "  /* @%s: computed in place */\n", op->args[0].param->name);
      return true;
    }
  }
  if (l.lib == CG_LIB_GEMM) {   // an expert GEMM over its filled rows counts them first (CG_LOWER_ROWS)
    const CgFuncLaunches *fl = &h->ls->fn[f->index];
    int k = (int)(lp - fl->launch);
    const CgLaunch *by = l.rows_from > 0 ? &fl->launch[l.rows_from - 1] : &l;   // the launch that counts
    h->rows_at[k] = -1;
    if (!cg_counts_rows(by)) return emit_gemm(h, f, op, s, -1, 1);
    h->count[h->phase].row_lazy += l.rows_lazy;
    h->count[h->phase].row_routed += by->call[0].kernel == CG_K_EXPERT_COUNTS_ROUTE;
    int64_t blocks = by->call[0].args[3].i / cg_gemm(op).e;   // its groups over the experts
    if (l.rows_plus || l.rows_zero) {   // then the rows past the counts: filled (act(h + b1)'s, plus one), zeroed
      int64_t at = h->rows_at[l.rows_from - 1] + (l.rows_plus ? 2 * by->call[0].args[3].i * (int64_t)sizeof(int32_t) : 0);
      if (!emit_gemm(h, f, op, s, at, blocks) || (l.ncalls > 0 && !emit_kernel(h, f, i, &l.call[0], s, -1, at))) return false;
      h->count[h->phase].row_counts += l.ncalls;
      return true;
    }
    if (l.rows_from > 0) return emit_gemm(h, f, op, s, h->rows_at[l.rows_from - 1], blocks);   // that launch's counts
    const CgArg *x = &l.call[0].args[0];
    if (x->kind == CG_ARG_OPERAND && l.call[0].kernel != CG_K_EXPERT_COUNTS_ROUTE && bf16_only(h, &op->args[x->index]))
      return ir_internal_at(h->d, op->loc, "the rows of a GEMM operand stored in bf16 only are counted in fp32");
    h->rows_at[k] = stage_place(h, l.scratch_bytes);
    if (!emit_kernel(h, f, i, &l.call[0], s, -1, h->rows_at[k])) return false;
    h->count[h->phase].row_counts++;
    return emit_gemm(h, f, op, s, h->rows_at[k], blocks);
  }
  if (l.lib) return emit_comm(h, f, op, s);
  if (op->kind == IR_OP_ATTN_CAUSAL || op->kind == IR_OP_ATTN_SINK || op->kind == IR_OP_ATTN_CAUSAL_STATS ||
      op->kind == IR_OP_ATTN_SINK_STATS || op->kind == IR_OP_ATTN_CAUSAL_GRAD) {
    h->count[h->phase].attn_ops++;
    h->count[h->phase].attn_tc += cg_attn_tc(&l);
  }
  // The record hook's kernel writes its statistics into the staging area.
  int64_t stats = op->kind == IR_OP_HOOK_RECORD ? stage_place(h, 3 * (int64_t)sizeof(double)) : -1;
  // A split reduction's partial sums: a place of their own (ops on other streams may run beside).
  int64_t scratch = l.scratch_bytes > 0 ? stage_place(h, l.scratch_bytes) : -1;
  if (cg_slot_map_op(op) && l.ncalls > 0) {   // an order over slot rows: its choices from a map or a pass over all
    const IrType *rt = &op->result->type;
    double rows = (double)rt->dim[0] * (double)rt->dim[1], choices = (double)ir_type_numel(&op->args[1].value->type);
    bool map = l.call[0].kernel == CG_K_SLOT_MAP;
    Counts *c = &h->count[h->phase];
    c->slot_maps += map, c->slot_orders++;
    c->scan_bytes += ceil(rows / 16) * choices * 8;   // idx and loc, each block
    // the map: idx and loc read, two entries a kept choice written; each row's entry and its
    // choice's idx and loc read, each chunk's witness and its choice's (the routed kernels)
    if (map) c->map_bytes += choices * 16 + rows * 12 + ceil(rows / 16) * 12;
  }
  if (l.rows_order) {   // an order's kernel writing below the counts from the routing only
    h->count[h->phase].row_orders++;
    h->count[h->phase].rows_bytes += l.rows_bytes;
  }
  for (int j = i; j < i + l.nops && l.ncalls > 0; j++) {   // the orders' gathers read routed (filled) rows only
    const IrOp *g = f->ops[j];
    int a = g->kind == IR_OP_ORDER_DECODE || g->kind == IR_OP_ORDER_ENCODE_GRAD ? 0 : g->kind == IR_OP_ORDER_DECODE_GRAD_G ? 1 : -1;
    if (a >= 0 && g->args[a].value)
      h->count[h->phase].rows_bytes += (pass_reads_copy(g, a) ? 0.5 : 1.0) * (double)ir_type_bytes(&g->args[a].value->type);
  }
  if (l.rows_guard) {   // a fused group over expert slots: the counts of launch rows_from - 1
    scratch = h->rows_at[l.rows_from - 1];
    if (scratch < 0) return ir_internal_at(h->d, op->loc, "a fused group reads the counts of a launch that has none");
    h->count[h->phase].row_guards++;
    h->count[h->phase].row_skips += l.rows_skip;
    h->count[h->phase].rows_bytes += l.rows_bytes;
  }
  int last = l.ncalls - 1;   // a fused group's kernel (after its slot map where it has one: cg_slot_map)
  if (last >= 0 && l.call[last].kernel >= CG_K_COUNT && (last == 0 || l.call[0].kernel == CG_K_SLOT_MAP)) {
    double fused = fused_bytes(f, i, &l.call[last]);
    h->count[h->phase].kernel_bytes += fused;
    h->count[h->phase].unfused_bytes += op_bytes(f, i, l.nops, h->bf16) - fused;
  } else if (l.ncalls > 0) {
    h->count[h->phase].kernel_bytes += op_bytes(f, i, l.nops, h->bf16);
  }
  if (l.ncalls > 0 && has_arg(&l.call[0], CG_ARG_RANGES) && !update_ranges(h, f, i, l.nops)) return false;
  for (int k = 0; k < l.ncalls; k++)
    if (!emit_kernel(h, f, i, &l.call[k], s, stats, scratch)) return false;
  if (scratch >= 0 && l.ncalls == 2 && l.call[1].kernel == CG_K_SUM_PARTS) h->loss_op = op, h->loss_parts = scratch;
  if (op->kind == IR_OP_HOOK_RECORD) {
    int64_t off = stats;
    fprintf(h->epi, "  rt_record_stats(st, \"");
    put_escaped(h->epi, ir_op_str(op, "point", "?"));
    fprintf(h->epi, "\", %" PRId64 ", %" PRId64 ", ((const double *)(H + %" PRId64 "))[0], ((const double *)(H + %" PRId64
                    "))[1], (int64_t)((const double *)(H + %" PRId64 "))[2]);\n",
            ir_op_int(op, "layer", 0), ir_type_numel(cg_operand_type(&op->args[0])), off, off, off);
  }
  return true;
}

// ---- functions ----

// Which values of f the step's statistics read (-2: to be staged after the op that makes it).
static void mark_staged(Host *h, const IrFunc *f) {
  for (int v = 0; v < f->nvalues; v++) h->staged[v] = -1;
  bool layer = f->role == IR_ROLE_LAYER_FWD;
  for (int r = 0; r < f->nrets; r++) {
    const IrValue *v = f->rets[r];
    bool aux = layer && r >= 1 && v->def &&
               (v->def->kind == IR_OP_GATE_AUX_LOSS || v->def->kind == IR_OP_GATE_Z_LOSS || v->def->kind == IR_OP_GATE_AUX_POOLED);
    bool loss = f->role == IR_ROLE_LOSS_FWD && r == 0;
    if ((aux || loss) && v->func == f) h->staged[v->id] = -2;
  }
}

// What the step does with f's staged values after the function (emit_c's emit_layer_stats and
// the loss), in the CPU program's order.
static void function_epilogue(Host *h, const IrFunc *f) {
  bool layer = f->role == IR_ROLE_LAYER_FWD;
  for (int r = 0; r < f->nrets; r++) {
    const IrValue *v = f->rets[r];
    if (v->func != f || h->staged[v->id] < 0) continue;
    int64_t off = h->staged[v->id];
    if (f->role == IR_ROLE_LOSS_FWD && r == 0) {
      fprintf(h->epi, "  st->mse = *(const float *)(H + %" PRId64 ");\n", off);
      int64_t parts, div;
      double scale;
      // --check-grad differences the loss before its rounding to float: the partial sums the
      // step read back, added in double (rt_loss_exact, runtime/kernels/loss.c)
      if (v->def == h->loss_op && cg_split_reduction(v->def, &parts, &div, &scale))
        fprintf(h->epi, "  rt_loss_exact_parts((const double *)(H + %" PRId64 "), %" PRId64 ", %" PRId64 ", %.17g);\n",
                h->loss_parts, parts, div, scale);
    } else if (layer && v->def->kind == IR_OP_GATE_AUX_POOLED) {  // pooled on the host, then back (emit_step)
      const IrType *scores = &v->def->args[0].value->type;
      fprintf(h->epi, "  rt_pool_layer(st, (float *)(H + %" PRId64 "), %" PRId64 ", %" PRId64 ", %.17g);\n", off,
              scores->dim[1], scores->dim[0], ir_op_float(v->def, "coef", 0));
      void *a = realloc(h->pooled_addr, (size_t)(h->npooled + 1) * sizeof *h->pooled_addr);
      void *o = a ? realloc(h->pooled_off, (size_t)(h->npooled + 1) * sizeof *h->pooled_off) : NULL;
      if (a) h->pooled_addr = a;
      if (o) h->pooled_off = o;
      void *b = o ? realloc(h->pooled_bytes, (size_t)(h->npooled + 1) * sizeof *h->pooled_bytes) : NULL;
      if (!b) {
        h->ok = ir_oom(h->d);
        continue;
      }
      h->pooled_bytes = b;
      cg_spell_value(&h->sp, v, h->pooled_addr[h->npooled], sizeof h->pooled_addr[0]);
      h->pooled_off[h->npooled] = off;
      h->pooled_bytes[h->npooled++] = ir_type_bytes(&v->type);
    } else if (layer) {
      fprintf(h->epi, "  st->%s += *(const float *)(H + %" PRId64 ");\n  st->aux_total += (double)(float)%.17g * *(const float *)(H + %" PRId64 ");\n",
              v->def->kind == IR_OP_GATE_AUX_LOSS ? "aux" : "z", off, ir_op_float(v->def, "coef", 0), off);
    }
  }
}

static bool emit_function(Host *h, const IrFunc *f) {
  bool scheduled = ir_func_concurrent(f);
  CgEvents ev = {0};
  if (scheduled && !cg_events(h->d, f, &ev)) return false;
  if (scheduled && EV_BASE + ev.count > h->max_events) h->max_events = EV_BASE + ev.count;
  mark_staged(h, f);
  memset(h->in_slot, 0, sizeof h->in_slot);   // bf16 copies are reused within a function only
  fprintf(h->out, "/* @%s%s */\nstatic void f%d(RtStep *st) {\n  (void)st;\n", f->name,
          scheduled ? ": compute, intra and inter streams" : "", f->index);
  if (scheduled) {
    int w = where(h, f, NULL, "the start of the function");
    fprintf(h->out, "  CK(rt_cuda_record(cu, RT_STREAM_COMPUTE, %d), %d);\n", EV_FORK, w);
    fprintf(h->out, "  CK(rt_cuda_wait(cu, RT_STREAM_INTRA, %d), %d);\n  CK(rt_cuda_wait(cu, RT_STREAM_INTER, %d), %d);\n",
            EV_FORK, w, EV_FORK, w);
  }
  bool ok = true;
  const CgFuncLaunches *fl = &h->ls->fn[f->index];
  for (int k = 0; ok && k < fl->n; k++) {
    int i = fl->at[k];
    const IrOp *op = f->ops[i];
    IrStream s = scheduled ? cg_op_stream(op) : IR_STREAM_COMPUTE;
    if (scheduled) {
      int waits[IR_MAX_WAITS + 1];
      int nw = cg_op_waits(f, &ev, i, waits, IR_MAX_WAITS + 1);
      for (int k = 0; k < nw; k++)
        fprintf(h->out, "  CK(rt_cuda_wait(cu, %s, %d), %d);\n", cg_stream_enum(s), EV_BASE + waits[k],
                where(h, f, op, "waiting for an event before %s", ir_op_info[op->kind].name));
    }
    int nops = fl->launch[k].nops;
    ok = emit_op(h, f, i, &fl->launch[k], s);
    for (int j = i; ok && j < i + nops; j++) stage_op(h, f, f->ops[j], s);
    int last = i + nops - 1;
    if (ok && scheduled && ev.rec[last])
      fprintf(h->out, "  CK(rt_cuda_record(cu, %s, %d), %d);\n", cg_stream_enum(s), EV_BASE + ev.local[last],
              where(h, f, f->ops[last], "recording the event of %s", ir_op_info[f->ops[last]->kind].name));
  }
  if (scheduled) {
    int w = where(h, f, NULL, "the end of the function");
    fprintf(h->out, "  CK(rt_cuda_record(cu, RT_STREAM_INTRA, %d), %d);\n  CK(rt_cuda_record(cu, RT_STREAM_INTER, %d), %d);\n",
            EV_JOIN_INTRA, w, EV_JOIN_INTER, w);
    fprintf(h->out, "  CK(rt_cuda_wait(cu, RT_STREAM_COMPUTE, %d), %d);\n  CK(rt_cuda_wait(cu, RT_STREAM_COMPUTE, %d), %d);\n",
            EV_JOIN_INTRA, w, EV_JOIN_INTER, w);
  }
  // Staged values that no op of f made (arguments): read back at the end, on compute.
  for (int r = 0; ok && r < f->nrets; r++) {
    const IrValue *v = f->rets[r];
    if (v->func == f && h->staged[v->id] == -2)
      h->staged[v->id] = stage(h, f, NULL, v, IR_STREAM_COMPUTE);
  }
  fprintf(h->out, "}\n\n");
  cg_events_free(&ev);
  if (ok) function_epilogue(h, f);
  return ok;
}

// A step function: its IR functions in order, then a wait for every stream and the epilogue.
static bool emit_step(Host *h, int step, const char *prologue, const char *after, bool (*member)(const IrFunc *)) {
  const char *name = step_names[step];
  char *epilogue = NULL;
  size_t size = 0;
  int64_t first_stage = h->stage_bytes;   // this step's part of the staging area starts here
  h->phase = step;
  if (!(h->epi = open_memstream(&epilogue, &size))) return ir_oom(h->d);
  bool ok = true;
  for (int i = 0; ok && i < h->m->nfuncs; i++)
    if (member(h->m->funcs[i])) ok = emit_function(h, h->m->funcs[i]);
  if (fclose(h->epi) != 0) ok = ir_oom(h->d);
  h->epi = NULL;
  if (!ok) {
    free(epilogue);
    return false;
  }
  fprintf(h->out, "/* The %s's launches. */\nstatic void run_%s(RtStep *st) {\n", name, name);
  for (int i = 0; i < h->m->nfuncs; i++)
    if (member(h->m->funcs[i])) fprintf(h->out, "  f%d(st);  /* @%s */\n", i, h->m->funcs[i]->name);
  fprintf(h->out, "}\n\nstatic void step_%s(RtStep *st) {\n%s", name, prologue);
  fprintf(h->out, "  graph_run(%d, run_%s, st, %d);\n", step, name,
          where(h, NULL, NULL, "the %s as a CUDA graph (captured at its second call, then replayed; "
                "MOERT_CUDA_GRAPH=0 runs it op by op)", name));
  int w = where(h, NULL, NULL, "the end of the %s", name);
  fprintf(h->out, "  for (int s = 0; s < RT_STREAM_COUNT; s++)\n    CK(rt_cuda_sync(cu, (RtStream)s), %d);\n", w);
  if (h->stage_bytes > first_stage)
    fprintf(h->out, "  CK(rt_cuda_to_host(cu, RT_STREAM_COMPUTE, H + %" PRId64 ", S + %" PRId64 ", %" PRId64
                    ") && rt_cuda_sync(cu, RT_STREAM_COMPUTE), %d);\n",
            first_stage, first_stage, h->stage_bytes - first_stage,
            where(h, NULL, NULL, "reading back the statistics of the %s", name));
  fwrite(epilogue, 1, size, h->out);
  if (h->npooled > 0 && step == STEP_FORWARD) {  // the pooled P and F/N, for the backward
    int wp = where(h, NULL, NULL, "writing back the pooled aux loss's statistics");
    fprintf(h->out, "  rt_pool_finish(st);\n");
    for (int i = 0; i < h->npooled; i++)
      fprintf(h->out, "  CK(rt_cuda_to_device(cu, RT_STREAM_COMPUTE, %s, H + %" PRId64 ", %" PRId64 "), %d);\n",
              h->pooled_addr[i], h->pooled_off[i], h->pooled_bytes[i], wp);
    fprintf(h->out, "  CK(rt_cuda_sync(cu, RT_STREAM_COMPUTE), %d);\n", wp);
  }
  fprintf(h->out, "%s}\n\n", after);
  free(epilogue);
  return true;
}

static bool is_forward(const IrFunc *f) { return ir_role_phase(f->role) == IR_PHASE_FWD; }
static bool is_backward(const IrFunc *f) { return ir_role_phase(f->role) == IR_PHASE_BWD; }
static bool is_update(const IrFunc *f) { return f->role == IR_ROLE_OPTIMIZER; }

// ---- the program ----

// dtype bf16: the GEMM operands' casts of the op-by-op program (--no-fuse: every value operand
// from a scratch slot, gemm_slots), their number and, in *bytes, what they move.
static int64_t slot_casts(const Host *h, double *bytes) {
  int64_t casts = 0;
  *bytes = 0.0;
  const bool none[2] = {false, false};
  for (int fi = 0; fi < h->m->nfuncs; fi++) {
    const IrFunc *f = h->m->funcs[fi];
    const IrValue *in_slot[IR_STREAM_INTER + 1][2] = {{NULL}};   // forgotten at each function's start
    bool scheduled = ir_func_concurrent(f);
    for (int i = 0; i < f->nops; i++) {
      const IrOp *op = f->ops[i];
      if (op->kind != IR_OP_MATMUL && op->kind != IR_OP_EXPERT_MATMUL) continue;
      int slot[2];
      bool fresh[2];
      gemm_slots(in_slot[scheduled ? cg_op_stream(op) : IR_STREAM_COMPUTE], op, none, slot, fresh);
      for (int k = 0; k < 2; k++)
        if (fresh[k]) casts++, *bytes += 6.0 * (double)ir_type_numel(&op->args[k].value->type);
    }
  }
  return casts;
}

// The kernels a step's fused launches stand for when each op is lowered alone (moec build
// --no-fuse), less theirs: the gate chain, the split reductions, the update runs, the fused
// groups, the expert GEMMs' row kernels (mk_expert_rows_fill, which the groups over the slots
// can spare: the --no-fuse lowering's, launch.c), and with dtype bf16 the casts of GEMM operands
// their bf16 copies save.
// The expert GEMMs' row kernels that the step's launches spare against the --no-fuse lowering's
// (launch.c: the groups over the slots let mk_expert_rows_fill go); once per build (Host.row_spared).
static int64_t row_kernels_spared(const Host *h) {
  unsigned how = cg_cuda_lowering(h->m);
  CgLaunches *alone = (how & CG_LOWER_FUSE) ? cg_lower_module(h->d, h->m, how & ~(unsigned)CG_LOWER_FUSE) : NULL;
  int64_t spared = 0;
  for (int fi = 0; alone && fi < h->m->nfuncs; fi++) {
    const IrFunc *f = h->m->funcs[fi];
    if (!is_forward(f) && !is_backward(f) && !is_update(f)) continue;
    for (int k = 0; k < h->ls->fn[fi].n; k++) {
      const CgLaunch *l = &h->ls->fn[fi].launch[k];
      int a = l->lib == CG_LIB_GEMM ? cg_launch_at(&alone->fn[fi], h->ls->fn[fi].at[k]) : -1;
      if (a >= 0) spared += alone->fn[fi].launch[a].ncalls - l->ncalls;
    }
  }
  cg_launches_free(alone);
  return spared;
}

static int64_t unfused_extra(const Host *h, int64_t op_by_op_casts) {
  unsigned how = cg_cuda_lowering(h->m);
  int64_t extra = h->row_spared;
  for (int fi = 0; fi < h->m->nfuncs && (how & CG_LOWER_FUSE); fi++) {
    const IrFunc *f = h->m->funcs[fi];
    if (!is_forward(f) && !is_backward(f) && !is_update(f)) continue;
    for (int k = 0; k < h->ls->fn[fi].n; k++) {
      const CgLaunch *l = &h->ls->fn[fi].launch[k];
      if (l->lib != CG_LIB_NONE || (l->nops == 1 && l->ncalls == 1)) continue;   // as it would be alone
      extra += l->alone_calls - l->ncalls;   // its ops lowered alone (once, by launch.c)
    }
  }
  if (h->bf16 && (how & CG_LOWER_FUSE)) extra += op_by_op_casts - h->operand_casts;
  return extra;
}

// What a step launches and moves (moec build -v; the program's header): one line per step
// function, then the whole step and the op-by-op count, each between `pre` and `post`.
static void print_counts(const Host *h, FILE *out, const char *pre, const char *post) {
  int64_t kernels = 0, gemms = 0, comms = 0, row_counts = 0, expert_gemms = 0, row_gemms = 0, attn_ops = 0, attn_tc = 0;
  int64_t row_routed = 0, row_orders = 0, slot_maps = 0, slot_orders = 0;
  int64_t row_guards = 0, row_skips = 0, row_lazy = 0;
  double rows_bytes = 0.0, map_bytes = 0.0, scan_bytes = 0.0;
  double bytes = 0.0, gemm_bytes = 0.0, unfused_bytes = 0.0;
  for (int p = 0; p < STEP_COUNT; p++) {
    const Counts *c = &h->count[p];
    fprintf(out, "%slaunches: %-8s %4" PRId64 " kernels (%" PRId64 " bf16 casts), %3" PRId64 " GEMMs, %3" PRId64
                 " collectives or copies; kernels move %.1f MB, GEMM operands and results %.1f MB%s",
            pre, step_names[p], c->kernels, c->casts, c->gemms, c->comms, c->kernel_bytes / 1e6, c->gemm_bytes / 1e6, post);
    kernels += c->kernels, gemms += c->gemms, comms += c->comms, bytes += c->kernel_bytes, gemm_bytes += c->gemm_bytes;
    unfused_bytes += c->unfused_bytes;
    row_counts += c->row_counts, expert_gemms += c->expert_gemms, row_gemms += c->row_gemms, row_routed += c->row_routed, row_orders += c->row_orders;
    attn_ops += c->attn_ops, attn_tc += c->attn_tc;
    row_guards += c->row_guards, row_skips += c->row_skips, row_lazy += c->row_lazy, rows_bytes += c->rows_bytes;
    slot_maps += c->slot_maps, slot_orders += c->slot_orders, map_bytes += c->map_bytes, scan_bytes += c->scan_bytes;
  }
  double slot_bytes = 0.0;   // dtype bf16: the op-by-op program's casts instead of the copies' casts
  int64_t op_by_op_casts = 0;
  if (h->bf16 && (cg_cuda_lowering(h->m) & CG_LOWER_FUSE)) {
    op_by_op_casts = slot_casts(h, &slot_bytes);
    unfused_bytes += slot_bytes - h->operand_cast_bytes;
  }
  fprintf(out, "%slaunches: a step   %4" PRId64 " kernels, %3" PRId64 " GEMMs, %3" PRId64 " collectives or copies; "
               "kernels move %.1f MB, GEMMs %.1f MB (each operand read once, each result written once)%s",
          pre, kernels, gemms, comms, bytes / 1e6, gemm_bytes / 1e6, post);
  if (cg_cuda_lowering(h->m) & CG_LOWER_FUSE)
    fprintf(out, "%slaunches: %" PRId64 " kernels, %" PRId64 " GEMMs per step (unfused: %" PRId64 " kernels)%s"
                 "%skernel traffic: %.1f MB per step (unfused: %.1f MB)%s",
            pre, kernels, gemms, kernels + unfused_extra(h, op_by_op_casts), post, pre, bytes / 1e6,
            (bytes + unfused_bytes) / 1e6, post);
  else
    fprintf(out, "%slaunches: %" PRId64 " kernels, %" PRId64 " GEMMs per step (--no-fuse: each op alone)%s", pre, kernels, gemms,
            post);
  if (expert_gemms > 0)
    fprintf(out, "%sexpert GEMMs: %" PRId64 " of %" PRId64 " a step over their filled rows only (%" PRId64
                 " of them over counts from the routing), which %" PRId64
                 " of the kernels count (or set the rows past the counts)%s%s",
            pre, row_gemms, expert_gemms, row_routed, row_counts,
            cg_cuda_lowering(h->m) & CG_LOWER_ROWS ? "" : " (MOEC_EXPERT_ROWS=all: every slot)", post);
  if (row_guards + row_lazy + row_orders > 0)
    fprintf(out, "%sexpert slots: %" PRId64 " fused kernels a step read the counts (%" PRId64 " of them skip the rows past "
                 "them), %" PRId64 " expert GEMMs' results are not zeroed past them (nothing reads those rows), %" PRId64
                 " of the orders' kernels write none past the counts from the routing; "
                 "%.1f MB of the kernel traffic is over the slots' filled rows only%s",
            pre, row_guards, row_skips, row_lazy, row_orders, rows_bytes / 1e6, post);
  if (slot_maps > 0)
    fprintf(out, "%sslot maps: %" PRId64 " kernels a step (mk_slot_map) let %" PRId64 " orders over slot rows find their "
                 "choices in about %.3g MB of reads and writes, not the %.3g MB of a pass over every choice for each 16 "
                 "rows%s", pre, slot_maps, slot_orders, map_bytes / 1e6, scan_bytes / 1e6, post);
  else if (slot_orders > 0)
    fprintf(out, "%sslot maps: none (%s): %" PRId64 " orders over slot rows read %.3g MB of the routing, a pass over every "
                 "choice for each 16 rows%s", pre, cg_cuda_lowering(h->m) & CG_LOWER_MAP ? "none built" : "MOEC_SLOT_MAP=0",
            slot_orders, scan_bytes / 1e6, post);
  if (attn_ops > 0)
    fprintf(out, "%sattention: %" PRId64 " of %" PRId64 " ops a step on tensor cores (bf16 operands, fp32 sums)%s%s", pre,
            attn_tc, attn_ops,
            !h->bf16                                         ? "; dtype fp32 keeps the CUDA cores"
            : !(cg_cuda_lowering(h->m) & CG_LOWER_ATTN_TC)   ? " (MOEC_ATTN_TC=0)"
            : attn_tc < attn_ops                             ? "; the others' heads are not a multiple of 16 up to 128"
                                                             : "",
            post);
}

// The program's launchers: the error check, the kernel arguments' spelling, launch, launch_step and
// graph_run, which runs a step function op by op, captures it or replays its graph.
static void emit_launchers(FILE *out) {
  fprintf(out,
          "/* CUDA graphs (rt_cuda.h): each step function runs op by op at its first call, is captured into a\n"
          "   graph at its second and replayed from then on, one launch a step; MOERT_CUDA_GRAPH=0 keeps it op by\n"
          "   op. Before a replay the step's launches are issued again in GRAPH_SET mode: every call is skipped but\n"
          "   those of launch_step, whose arguments change from step to step (the step, the learning rate), which\n"
          "   set their node's arguments instead. With microbatches a step function has a graph per VARIANT (the\n"
          "   slot, where the backward writes its gradients): its addresses are the graph's. */\n"
          "enum { GRAPH_RUN, GRAPH_SET };\n"
          "static bool use_graphs;\n"
          "static int graph_mode, graph_next;\n"
          "static RtCudaGraph *graph_now, *graphs[%d * VARIANTS];\n"
          "static long long graph_calls[%d * VARIANTS];\n\n"
          "#define CK(call, site) do { if (graph_mode != GRAPH_SET && !(call)) op_failed(site); } while (0)\n\n"
          "/* Kernel arguments: the address of each parameter's value, with the kernel's parameter type. */\n"
          "#define PTR(x) &(void *){(void *)(x)}\n#define I32(x) &(int){x}\n#define I64(x) &(long long){x}\n"
          "#define U64(x) &(unsigned long long){x}\n#define F32(x) &(float){x}\n\n"
          "static void launch(int site, RtStream s, int kernel, int grid, unsigned shared_bytes, void **args) {\n"
          "  CK(rt_cuda_launch(cu, s, kernels[kernel], grid, %d, shared_bytes, args), site);\n"
          "}\n\n"
          "/* A launch with the step's arguments. */\n"
          "static void launch_step(int site, RtStream s, int kernel, int grid, unsigned shared_bytes, void **args) {\n"
          "  if (graph_mode == GRAPH_SET) {\n"
          "    if (!rt_cuda_graph_set(cu, graph_now, graph_next++, kernels[kernel], grid, %d, shared_bytes, args))\n"
          "      op_failed(site);\n"
          "  } else {\n"
          "    CK(rt_cuda_launch_step(cu, s, kernels[kernel], grid, %d, shared_bytes, args), site);\n"
          "  }\n"
          "}\n\n"
          "/* Step function step's launches (run): op by op, into a graph, or by replaying it. */\n"
          "static void graph_run(int step, void (*run)(RtStep *), RtStep *st, int site) {\n"
          "  int g = step * VARIANTS + VARIANT;\n"
          "  if (!use_graphs || graph_calls[g]++ == 0) {   /* the first call warms cuBLAS and NCCL up */\n"
          "    run(st);\n"
          "    return;\n"
          "  }\n"
          "  if (!graphs[g]) {\n"
          "    CK(rt_cuda_capture_begin(cu), site);\n"
          "    run(st);\n"
          "    CK((graphs[g] = rt_cuda_capture_end(cu)) != NULL, site);\n"
          "  } else {\n"
          "    graph_mode = GRAPH_SET, graph_now = graphs[g], graph_next = 0;\n"
          "    run(st);\n"
          "    graph_mode = GRAPH_RUN;\n"
          "    if (graph_next != rt_cuda_graph_step_nodes(graphs[g]))   /* every node with step arguments set */\n"
          "      op_failed(site);\n"
          "  }\n"
          "  CK(rt_cuda_graph_launch(cu, graphs[g], RT_STREAM_COMPUTE), site);\n"
          "}\n\n",
          STEP_COUNT, STEP_COUNT, CG_CUDA_BLOCK, CG_CUDA_BLOCK, CG_CUDA_BLOCK);
}

// ---- microbatches and pipeline stages ----

// The device layout (device_layout computes it, emit_header prints it): the byte offsets of one
// block of device memory: parameters, gradients and moments, the step's input and target, the
// activation arena, the staging area, with dtype bf16 the GEMM operands' scratch B and P16, the
// update runs' tables U, then with microbatches or stages the other slots, W and K.
typedef struct DeviceLayout {
  int64_t elems;                               // floats of the step's input (batch x seqlen x embed)
  int64_t off_g, off_m, off_v, off_x, off_t, off_a, off_s, off_b, off_p16, off_u;
  int64_t stage_bytes;                         // the staging area (at least 8)
  int64_t b_intra, b_inter;                    // the intra and inter streams' parts of B
  int64_t pipe_at, slot_bytes, data, off_w, off_k;   // microbatches and stages: the slots from pipe_at, W, K
  int64_t total;                               // the block's bytes
  int64_t output_floats;                       // the model's output (a split vocabulary: the rank's logits)
} DeviceLayout;

static DeviceLayout device_layout(const Host *h) {
  const IrModule *m = h->m;
  DeviceLayout l = {.elems = ir_mod_int(m, "batch", 1) * ir_mod_int(m, "seqlen", 1) * ir_mod_int(m, "embed", 1)};
  int64_t pbytes = align(h->param_floats * 4, 256);
  int64_t gbytes = align((h->grad_floats > 0 ? h->grad_floats : 1) * 4, 256);   // gradients, each moment
  l.off_g = pbytes, l.off_m = l.off_g + gbytes, l.off_v = l.off_m + (h->adamw ? gbytes : 0);
  l.off_x = l.off_v + (h->adamw ? gbytes : 0), l.off_t = l.off_x + align(l.elems * 4, 256);
  l.off_a = l.off_t + align(l.elems * 4, 256);
  l.stage_bytes = h->stage_bytes > 0 ? h->stage_bytes : 8;
  l.off_s = l.off_a + align(h->plan->arena_bytes > 0 ? h->plan->arena_bytes : 1, 256);
  l.off_b = l.off_s + align(l.stage_bytes, 256);   // dtype bf16: the GEMM operands' scratch B
  const int64_t *slot = h->bf16_slot;   // two slots per stream
  l.b_intra = 2 * slot[IR_STREAM_COMPUTE], l.b_inter = l.b_intra + 2 * slot[IR_STREAM_INTRA];
  int64_t b_bytes = l.b_inter + 2 * slot[IR_STREAM_INTER];
  l.off_p16 = l.off_b + (h->bf16 ? align(b_bytes > 0 ? b_bytes : 1, 256) : 0);   // dtype bf16: P16
  l.off_u = l.off_p16 + (h->bf16 ? align(h->param_floats * 2, 256) : 0);       // the update runs' tables
  l.pipe_at = l.total = l.off_u + align(h->nranges > 0 ? h->nranges * RANGE_BYTES : 1, 256);
  if (h->pipe) {   // the slots beyond the first (each an input, a target and an arena), W and K
    l.data = align(l.elems * 4, 256);
    l.slot_bytes = 2 * l.data + align(h->plan->arena_bytes > 0 ? h->plan->arena_bytes : 1, 256);
    l.off_w = l.pipe_at + (h->slots - 1) * l.slot_bytes;
    l.off_k = l.off_w + (h->micro > 1 ? align(h->grad_floats * 4, 256) : 0);
    l.total = l.off_k + 256;
  }
  int64_t vocab = ir_mod_int(m, "vocab", 0) / (ir_mod_int(m, "vocab_parallel", 0) ? ir_mod_int(m, "mp", 1) : 1);
  l.output_floats = vocab > 0 && !h->link ? ir_mod_int(m, "batch", 1) * ir_mod_int(m, "seqlen", 1) * vocab : l.elems;
  return l;
}

// The device memory of microbatches and stages (device_layout's, after the rest of the block): the
// slots beyond the first (each an input, a target and an arena, which X, T and A point to while it
// runs), W, where the first microbatch's gradients become the sum of the ones before the last, and
// K, the constant 1/M; the state the hooks keep.
static void emit_pipe_layout(const Host *h, FILE *out, const DeviceLayout *l) {
  if (!h->pipe) {
    fprintf(out, "#define VARIANTS 1   /* a graph of each step function */\n#define VARIANT 0\n");
    return;
  }
  fprintf(out, "/* Microbatches and pipeline stages (runtime/pipeline.c, RtDevice.use_slot and .accumulate): %" PRId64
               " microbatch%s a step,\n"
               "   %" PRId64 " in flight at once, each in a slot of its own: slot 0 is X, T and A; slot i > 0 is the same three\n"
               "   at OFF_SLOTS + (i - 1) * SLOT_BYTES, which X, T and A point to while it runs. W: the sum of the\n"
               "   microbatches' gradients before the last (the first one's backward writes it), K: 1/MICRO. */\n"
               "#define MICRO %" PRId64 "\n#define SLOTS %" PRId64 "\n#define OFF_SLOTS ((size_t)%" PRId64
               ")\n#define SLOT_BYTES ((size_t)%" PRId64 ")\n#define SLOT_T ((size_t)%" PRId64 ")\n#define SLOT_A ((size_t)%" PRId64
               ")\n#define OFF_W ((size_t)%" PRId64 ")\n#define OFF_K ((size_t)%" PRId64 ")\n",
          h->micro, h->micro == 1 ? "" : "es", h->slots, h->micro, h->slots, l->pipe_at, l->slot_bytes, l->data, 2 * l->data,
          l->off_w, l->off_k);
  fprintf(out, "/* The slot running (use_slot) and the microbatch's part in the sum of the gradients (accumulate):\n"
               "   ACC_FIRST writes W, ACC_MIDDLE adds its gradients to W, ACC_LAST adds W to its own as it reduces\n"
               "   them; ACC_NONE outside a backward of several microbatches. A graph per slot and part. */\n"
               "enum { ACC_NONE, ACC_FIRST, ACC_MIDDLE, ACC_LAST };\n"
               "static int slot_now, acc_phase;\n"
               "#define VARIANTS (SLOTS * 4)\n#define VARIANT (slot_now * 4 + acc_phase)\n"
               "static float *slot_x[SLOTS], *slot_t[SLOTS];\nstatic unsigned char *slot_a[SLOTS];\n"
               "static float *G0, *W, *K;        /* the gradients' sum (the block's G), W and 1/MICRO */\n"
               "/* The stage's messages in host memory, a slot's each (runtime/pipeline.c sends them as they are):\n"
               "   the forward's output (a stage before the last), the gradient of the input (a later stage). */\n"
               "static float *out_host[SLOTS], *grad_host[SLOTS];\n\n");
}

// The error sites of the hooks (before the table of sites is printed).
static void pipe_sites(Host *h) {
  if (!h->pipe) return;
  h->w_slot = where(h, NULL, NULL, "microbatches: a slot or a count of microbatches the program was not built for (an "
                                   "internal error)");
  h->w_acc = where(h, NULL, NULL, "microbatches: the sum of their gradients on the GPU");
  h->w_part = where(h, NULL, NULL, "pipeline stages: copying a gradient that two stages hold between the GPU and the host");
}

static int by_start(const void *a, const void *b) {
  int64_t x = ((const int64_t *)a)[0], y = ((const int64_t *)b)[0];
  return x < y ? -1 : x > y;
}

// acc_finish: after the last microbatch's backward, W added to the elements of the sum that none of
// its reductions saw (the ranges between the hooked ones, as rt_comm_grad_hook_finish adds them).
static void emit_acc_finish(Host *h, FILE *out) {
  qsort(h->hooked, (size_t)h->nhooked, sizeof *h->hooked, by_start);
  fprintf(out, "/* After the last microbatch's backward: W added to the elements of the sum that none of its\n"
               "   reductions saw (%d reductions of the gradients, which added it as they ran). */\n"
               "static void acc_finish(void) {\n", h->nhooked);
  int64_t at = 0;
  for (int i = 0; i <= h->nhooked; i++) {
    int64_t lo = i < h->nhooked ? h->hooked[i][0] : h->grad_floats;
    if (lo > at)
      fprintf(out, "  launch(%d, RT_STREAM_COMPUTE, %s, %" PRId64 ", 0, (void *[]){PTR(G0 + %" PRId64 "), PTR(W + %" PRId64
                   "), PTR(G0 + %" PRId64 "), I64(%" PRId64 ")});\n",
              h->w_acc, cg_cuda_kernel_name(h->ls, CG_K_ADD), cg_cuda_grid_elems(lo - at), at, at, at, lo - at);
    if (i < h->nhooked && h->hooked[i][0] + h->hooked[i][1] > at) at = h->hooked[i][0] + h->hooked[i][1];
  }
  fprintf(out, "}\n\n");
}

// RtDevice.accumulate: before a microbatch's backward its part (acc_phase) and where it writes its
// gradients (G: W for the first, the block's G0 for the others); after it, what pipeline.c does on
// the host: the first one's gradients are the sum W, a middle one's are added to W (rt_add's
// order), the last one's reductions added W as they ran and acc_finish adds it to the rest. With
// micro = MICRO: the sum times 1/MICRO (rt_scale; mk_scale_rows by K, pieces of at most 2^30).
static void emit_accumulate(Host *h, FILE *out) {
  emit_acc_finish(h, out);
  fprintf(out, "static void device_accumulate(RtStep *st, int micro, int micros, bool after) {\n"
               "  (void)st;\n"
               "  if (micros != MICRO || micro < 0 || micro > micros)\n    op_failed(%d);\n"
               "  if (micro == micros) {   /* the mean */\n", h->w_slot);
  enum { PIECE = 1 << 30 };
  for (int64_t at = 0; at < h->grad_floats; at += PIECE) {
    int64_t n = h->grad_floats - at < PIECE ? h->grad_floats - at : PIECE;
    fprintf(out, "    launch(%d, RT_STREAM_COMPUTE, %s, %" PRId64 ", 0, (void *[]){PTR(G0 + %" PRId64 "), PTR(K), PTR(G0 + %" PRId64
                 "), I32(1), I32(%" PRId64 ")});\n",
            h->w_acc, cg_cuda_kernel_name(h->ls, CG_K_SCALE_ROWS), cg_cuda_grid_elems(n), at, at, n);
  }
  fprintf(out, "    return;\n  }\n"
               "  if (!after) {\n"
               "    acc_phase = micro == 0 ? ACC_FIRST : micro == micros - 1 ? ACC_LAST : ACC_MIDDLE;\n"
               "    G = micro == 0 ? W : G0;\n"
               "    return;\n  }\n"
               "  if (acc_phase == ACC_FIRST)\n    G = G0;\n"
               "  else if (acc_phase == ACC_MIDDLE)\n"
               "    launch(%d, RT_STREAM_COMPUTE, %s, %" PRId64 ", 0, (void *[]){PTR(W), PTR(G0), PTR(W), I64(GRAD_FLOATS)});\n"
               "  else\n    acc_finish();\n"
               "  acc_phase = ACC_NONE;\n}\n\n",
          h->w_acc, cg_cuda_kernel_name(h->ls, CG_K_ADD), cg_cuda_grid_elems(h->grad_floats));
}

// The hooks of microbatches and stages (RtDevice.use_slot, .accumulate, .grads_part).
static void emit_pipe_hooks(Host *h, FILE *out) {
  fprintf(out, "/* ---- microbatches and pipeline stages (runtime/pipeline.c) ---- */\n\n"
               "static void device_use_slot(RtStep *st, int slot) {\n"
               "  if (slot < 0 || slot >= SLOTS)\n    op_failed(%d);\n"
               "  slot_now = slot;\n"
               "  X = slot_x[slot], T = slot_t[slot], A = slot_a[slot];\n"
               "  rt_cuda_session_pin_data(session, st);   /* the slot's input and target, copied at every forward */\n"
               "}\n\n"
               "static void device_grads_part(RtStep *st, size_t offset, int64_t n, bool to_device) {\n"
               "  if (rt_cuda_session_grads_part(session, st, offset, n, to_device) != 0)\n    op_failed(%d);\n"
               "}\n\n",
          h->w_slot, h->w_part);
  if (h->micro > 1) emit_accumulate(h, out);
}

// device_create's part: the slots' addresses, W and K, the messages' host buffers.
static void emit_pipe_create(const Host *h, FILE *out) {
  fprintf(out, "  G0 = G;\n  K = (float *)(base + OFF_K);\n  W = MICRO > 1 ? (float *)(base + OFF_W) : NULL;\n");
  if (h->micro > 1)
    fprintf(out, "  static const float inv_micro = 1.0f / (float)MICRO;   /* pipeline.c's factor of the mean */\n"
                 "  CK(rt_cuda_to_device(cu, RT_STREAM_COMPUTE, K, &inv_micro, sizeof inv_micro), %d);\n", h->w_acc);
  fprintf(out, "  slot_now = 0, acc_phase = ACC_NONE;\n"
               "  for (int i = 0; i < SLOTS; i++) {\n"
               "    unsigned char *at = i > 0 ? base + OFF_SLOTS + (size_t)(i - 1) * SLOT_BYTES : NULL;\n"
               "    slot_x[i] = at ? (float *)at : X;\n"
               "    slot_t[i] = at ? (float *)(at + SLOT_T) : T;\n"
               "    slot_a[i] = at ? at + SLOT_A : A;\n"
               "    out_host[i] = %s;\n"
               "    grad_host[i] = %s;\n"
               "  }\n",
          h->link ? "rt_cuda_session_host_buffer(session, ELEMS * sizeof(float))" : "NULL",
          h->input_grad[0] ? "rt_cuda_session_host_buffer(session, ELEMS * sizeof(float))" : "NULL");
}

static void emit_header(Host *h, FILE *out, const char *source_name, const CgCudaImages *img) {
  const IrModule *m = h->m;
  fprintf(out, "/* Generated by moec from %s: the training step of model '%s' for the CUDA target\n"
               "   (%s). Do not edit; change the .moe file and rebuild. */\n",
          source_name, m->name, img->arch);
  fprintf(out, "/* What a step launches (the device's work, in program order):\n");
  print_counts(h, out, "     ", "\n");
  fprintf(out, "*/\n");
  fprintf(out, "#include <stdbool.h>\n#include <stdint.h>\n#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\n\n"
               "#include \"moert.h\"\n#include \"rt_cuda.h\"\n\n");
  int arch = atoi(img->arch + 3);
  fprintf(out, "/* The kernels (codegen/emit_cuda.c), compiled by NVRTC when moec built this program: the CUBIN\n"
               "   for %s, and the PTX of compute_%d that the driver compiles for newer GPUs. */\n"
               "#define CUBIN_ARCH %d\n", img->arch, arch, arch);
  if (img->cubin_size > 0) {
    fprintf(out, "static _Alignas(64) const unsigned char cubin[] =");
    put_bytes(out, img->cubin, img->cubin_size);
    fprintf(out, ";\n#define CUBIN cubin\n");
  } else {   // MOEC_CUDA_IMAGES=ptx
    fprintf(out, "/* No CUBIN (MOEC_CUDA_IMAGES=ptx): the driver compiles the PTX on sm_%d and newer. */\n"
                 "#define CUBIN NULL\n", arch);
  }
  fprintf(out, "static const char ptx[] =");
  put_bytes(out, (const unsigned char *)img->ptx, strnlen(img->ptx, img->ptx_size));   // the size may count the NUL
  fprintf(out, ";\n");
  if (img->wg_cubin_size > 0) {
    fprintf(out, "/* moec's grouped GEMM on wgmma (mk_expert_gemm_wg) for sm_90a, which the program runs in\n"
                 "   mk_expert_gemm_tc's place on an sm_90 GPU once the two agreed (runtime/cuda/session.c). */\n"
                 "static _Alignas(64) const unsigned char wg_cubin[] =");
    put_bytes(out, img->wg_cubin, img->wg_cubin_size);
    fprintf(out, ";\n#define WG_CUBIN wg_cubin\n");
  } else {
    fprintf(out, "#define WG_CUBIN NULL\n");
  }
  fprintf(out, "\n");
  cg_emit_params(out, m, h->param_offset);

  int nk = cg_cuda_kernel_count(h->ls), used = 0;
  fprintf(out, "/* The kernels the steps launch, looked up by name in the loaded module. */\nenum {");
  for (int k = 0; k < nk; k++)
    if (h->kernel_slot[k] >= 0) fprintf(out, "%s %s", used++ ? "," : "", cg_cuda_kernel_name(h->ls, k));
  fprintf(out, "%sKERNEL_COUNT };\nstatic const char *const kernel_names[KERNEL_COUNT + 1] = {", used ? ", " : " ");
  for (int k = 0; k < nk; k++)
    if (h->kernel_slot[k] >= 0) fprintf(out, "\"%s\", ", cg_cuda_kernel_name(h->ls, k));
  fprintf(out, "NULL};\n\n");

  DeviceLayout dl = device_layout(h);
  emit_pipe_layout(h, out, &dl);
  fprintf(out, "/* Device memory, one block: parameters P, gradients G%s (floats, as the CPU\n"
               "   program's), the step's input X and target T, the activation arena A of the memory plan, and\n"
               "   the staging area S of the statistics the host reads after a step function (into H). */\n",
          h->adamw ? ", AdamW moments M and V" : "");
  const char *names[] = {"PARAM_FLOATS", "GRAD_FLOATS", "ELEMS", "OFF_G", "OFF_M", "OFF_V", "OFF_X", "OFF_T", "OFF_A", "OFF_S",
                         "DEVICE_BYTES", "STAGE_BYTES", "OUTPUT_FLOATS"};
  int64_t values[] = {h->param_floats, h->grad_floats, dl.elems, dl.off_g, dl.off_m, dl.off_v, dl.off_x, dl.off_t, dl.off_a,
                      dl.off_s, dl.total, dl.stage_bytes, dl.output_floats};
  for (size_t i = 0; i < sizeof values / sizeof *values; i++)
    fprintf(out, "#define %s ((size_t)%" PRId64 ")\n", names[i], values[i]);
  const int64_t *slot = h->bf16_slot;   // two slots per stream
  int64_t off_b = dl.off_b, b_intra = dl.b_intra, b_inter = dl.b_inter, off_p16 = dl.off_p16, off_u = dl.off_u;
  if (h->bf16)
    fprintf(out, "/* dtype bf16: every GEMM takes bf16 copies of its two fp32 operands, rounded to nearest even by\n"
                 "   mk_compress_bf16. A parameter's copy is P16's, the whole parameter vector rounded once after\n"
                 "   each update or upload (at the next forward). A value's copy goes to one of the two slots of\n"
                 "   its stream's scratch B (at B_COMPUTE, B_INTRA or B_INTER, SLOT_* bytes each: a stream's GEMMs\n"
                 "   run one after the other, so a copy the previous GEMM made is read again, not made again).\n"
                 "   cuBLAS multiplies the copies with fp32 accumulation into the fp32 result. Parameters,\n"
                 "   gradients, moments and activations stay fp32. */\n"
                 "#define OFF_B ((size_t)%" PRId64 ")\n#define B_COMPUTE ((size_t)0)\n#define B_INTRA ((size_t)%" PRId64
                 ")\n#define B_INTER ((size_t)%" PRId64 ")\n#define SLOT_COMPUTE ((size_t)%" PRId64
                 ")\n#define SLOT_INTRA ((size_t)%" PRId64 ")\n#define SLOT_INTER ((size_t)%" PRId64
                 ")\n#define OFF_P16 ((size_t)%" PRId64 ")\n",
            off_b, b_intra, b_inter, slot[IR_STREAM_COMPUTE], slot[IR_STREAM_INTRA], slot[IR_STREAM_INTER], off_p16);
  if (h->nranges > 0) {   // the update runs' tables: copied to U when the device is created
    fprintf(out, "/* The update in one launch per run of optimizer ops (mk_adamw_ranges, mk_sgd_ranges): each\n"
                 "   parameter's range from the run's first one, its first block of %d elements, its lr and\n"
                 "   weight decay. */\n#define OFF_U ((size_t)%" PRId64 ")\n"
                 "static const RtUpdateRange update_ranges[%d] = {\n",
            CG_UPDATE_CHUNK, off_u, h->nranges);
    for (int i = 0; i < h->nranges; i++) {
      const CgUpdateRange *r = &h->ranges[i];
      fprintf(out, "  {%" PRId64 ", %" PRId64 ", %" PRId64 ", (float)%.17g, (float)%.17g},\n", r->start, r->n, r->block0,
              r->lr, r->weight_decay);
    }
    fprintf(out, "};\n");
  }
  fprintf(out, "#define EVENTS %d\n#define MOMENTS %d   /* AdamW keeps two moments per parameter */\n\n",
          h->max_events > EV_BASE ? h->max_events : EV_BASE, h->adamw);

  fprintf(out, "/* What each error site was doing, for the message of a failed call. */\n"
               "static const char *const where[%d] = {\n", h->nwhere > 0 ? h->nwhere : 1);
  for (int i = 0; i < h->nwhere; i++) {
    fprintf(out, "  \"");
    put_escaped(out, h->where[i]);
    fprintf(out, "\",\n");
  }
  fprintf(out, "};\n\n");
  fprintf(out,
          "/* The GPU session (runtime/cuda/session.c) and what the steps take from it. */\n"
          "static RtCudaSession *session;\n"
          "static RtCuda *cu;\n"
          "static CUfunction *kernels;\n"
          "static RtNccl **nccl;           /* by RtGroup; made when the ranks connect */\n"
          "static float *P, *G, *M, *V, *X, *T;\n"
          "static unsigned char *A, *S%s;\n"
          "static unsigned char *H;       /* the host's copy of the staging area S */\n"
          "static float *output;          /* host copy of the model's output (--dump) */\n\n"
          "static _Noreturn void op_failed(int site) {\n"
          "  rt_comm_abort(\"the GPU failed at %%s (the CUDA error is above)\", where[site]);\n"
          "}\n"
          "\n",
          h->nranges > 0 ? ", *U" : "");
  emit_launchers(out);
  if (h->bf16)
    fprintf(out, "static unsigned char *B;         /* the bf16 copies of the GEMM operands */\n"
                 "static uint16_t *P16;            /* the bf16 copy of the parameters */\n"
                 "static bool p16_fresh;           /* P16 is P rounded (false after an upload, or an update that does not round it) */\n\n");
}

// The RtDevice hooks: a description of the program for the GPU runtime (RtCudaProgram,
// rt_cuda.h) and thin hooks over runtime/cuda/session.c, which claims the GPU, loads the kernels,
// makes the communicators and moves the host copies; the program only carves its block.
static void emit_hooks(Host *h, FILE *out) {
  fprintf(out, "/* ---- the device's hooks (RtDevice, moert.h): runtime/cuda/session.c does the work ---- */\n\n"
               "static const RtCudaProgram program = {\n"
               "  .cubin = CUBIN, .cubin_arch = CUBIN_ARCH, .ptx = ptx, .wg_cubin = WG_CUBIN, .kernel_names = kernel_names,\n"
               "  .nkernels = KERNEL_COUNT,\n"
               "  .device_bytes = DEVICE_BYTES, .events = EVENTS, .param_floats = PARAM_FLOATS, .grad_floats = GRAD_FLOATS,\n"
               "  .off_grads = OFF_G, .off_m = OFF_M, .off_v = OFF_V, .moments = MOMENTS,\n"
               "  .stage_bytes = STAGE_BYTES, .output_floats = OUTPUT_FLOATS, .input_bytes = ELEMS * sizeof(float),\n  .nccl = {");
  int any = 0;
  for (int g = 0; g < 5; g++)
    if (h->group_nccl[g]) fprintf(out, "%s[%s] = true", any++ ? ", " : "", cg_group_enums[g]);
  fprintf(out, "%s},%s\n", any ? "" : "false", any ? "" : "  /* every collective is on a group of one */");
  if (h->bf16) fprintf(out, "  .note = \"; bf16 GEMM inputs, fp32 accumulation and master weights\",\n");
  int64_t rows = 0;
  for (int p = 0; p < STEP_COUNT; p++) rows += h->count[p].row_gemms;
  if (rows) fprintf(out, "  .row_gemms = %" PRId64 ",\n", rows);
  fprintf(out, "};\n\n"
               "/* Claims the GPU, loads the kernels and clears the device memory (the session), then carves the block. */\n"
               "static int device_create(RtStep *st) {\n"
               "  (void)st;\n"
               "  if (!(session = rt_cuda_session_create(&program)))\n"
               "    return -1;\n"
               "  cu = session->cu;\n  kernels = session->kernels;\n  nccl = session->nccl;\n"
               "  H = session->stage;\n  output = session->output;\n"
               "  unsigned char *base = session->device;\n"
               "  P = (float *)base;\n  G = (float *)(base + OFF_G);\n  M = (float *)(base + OFF_M);\n  V = (float *)(base + OFF_V);\n"
               "  X = (float *)(base + OFF_X);\n  T = (float *)(base + OFF_T);\n  A = base + OFF_A;\n  S = base + OFF_S;\n");
  if (h->bf16) fprintf(out, "  B = base + OFF_B;\n  P16 = (uint16_t *)(base + OFF_P16);\n  p16_fresh = false;\n");
  if (h->nranges > 0)
    fprintf(out, "  U = base + OFF_U;\n  CK(rt_cuda_to_device(cu, RT_STREAM_COMPUTE, U, update_ranges, sizeof update_ranges), %d);\n",
            h->w_ranges);
  if (h->output[0]) fprintf(out, "  session->device_output = %s;\n", h->output);
  if (h->pipe) emit_pipe_create(h, out);
  fprintf(out, "  if ((use_graphs = rt_cuda_graphs_wanted())) {\n"
               "    size_t len = strlen(session->description);\n"
               "    snprintf(session->description + len, sizeof session->description - len, \"; steps as CUDA graphs\");\n"
               "  }\n");
  fprintf(out, "  return 0;\n}\n\n"
               "static void device_destroy(RtStep *st) {\n"
               "  (void)st;\n"
               "  for (int g = 0; g < %d * VARIANTS; g++) {\n"
               "    rt_cuda_graph_destroy(graphs[g]);\n"
               "    graphs[g] = NULL, graph_calls[g] = 0;\n"
               "  }\n"
               "  rt_cuda_session_destroy(session);\n"
               "  session = NULL;\n"
               "}\n\n"
               "static int device_connect(RtStep *st) { return rt_cuda_session_connect(session, st->comm); }\n"
               "static const char *device_describe(void) { return session->description; }\n"
               "static int device_upload(RtStep *st, unsigned what) {\n"
               "%s"
               "  return rt_cuda_session_upload(session, st, what);\n"
               "}\n"
               "static int device_download(RtStep *st, unsigned what) { return rt_cuda_session_download(session, st, what); }\n\n",
          STEP_COUNT,
          h->bf16 ? "  if (what & RT_DEVICE_PARAMS) p16_fresh = false;   /* P16 is rounded again at the next forward */\n" : "");
  if (h->pipe) emit_pipe_hooks(h, out);
  fprintf(out, "static const RtDevice device = {\n"
               "  .create = device_create, .connect = device_connect, .describe = device_describe,\n"
               "  .upload = device_upload, .download = device_download, .destroy = device_destroy,\n%s%s"
               "};\n\n",
          h->pipe ? "  .use_slot = device_use_slot, .grads_part = device_grads_part,\n" : "",
          h->micro > 1 ? "  .accumulate = device_accumulate,\n" : "");
}

// What the step functions of a pipeline stage add (pipe_setup): the backward's copy of its target
// before it runs (a stage before the last), and the copies of the stage's messages to the host
// after the forward and after the backward.
typedef struct PipeSteps {
  char bwd_pre[256], fwd_post[512], bwd_post[512];
} PipeSteps;

// Microbatches and stages: the program's slots (runtime/pipeline.c's rt_pipe_slots), its place
// among the stages, the gradient of its input (a later stage's), and what its steps add (*ps).
// A stage's messages to and from its neighbours go through host memory: the forward's output and
// the backward's gradient of the input are copied to the host after the step, and the gradient
// the next stage sends is copied to T before the backward (the forward's target, a stage before
// the last has no use for). NCCL point-to-point between the GPUs would spare the copies; it is
// not built: the fake device of the tests runs one stream after the other, so it could not show
// that a stage's sends and receives on a stream of their own neither deadlock nor race.
static void pipe_setup(Host *h, PipeSteps *ps) {
  const IrModule *m = h->m;
  int64_t pp = ir_mod_int(m, "pp", 1), stage = pp > 1 ? ir_mod_int(m, "stage", 0) : 0;
  h->micro = ir_mod_int(m, "microbatches", 1);
  h->pipe = h->micro > 1 || pp > 1;
  h->link = stage < pp - 1;
  bool gpipe = strcmp(ir_mod_str(m, "pp_schedule", "1f1b"), "gpipe") == 0;
  h->slots = gpipe ? (pp > 1 ? h->micro : 1) : (pp - stage < h->micro ? pp - stage : h->micro);
  const IrFunc *last_bwd = NULL;
  for (int i = 0; i < m->nfuncs; i++)
    if (m->funcs[i]->role == IR_ROLE_LAYER_BWD) last_bwd = m->funcs[i];
  if (stage > 0 && last_bwd && last_bwd->nrets) cg_spell_value(&h->sp, last_bwd->rets[0], h->input_grad, sizeof h->input_grad);
  ps->bwd_pre[0] = ps->fwd_post[0] = ps->bwd_post[0] = '\0';
  if (h->link)
    snprintf(ps->bwd_pre, sizeof ps->bwd_pre,
             "  /* the gradient of the output the next stage sent (runtime/pipeline.c) */\n"
             "  CK(rt_cuda_to_device(cu, RT_STREAM_COMPUTE, T, st->target, ELEMS * sizeof(float)), %d);\n",
             where(h, NULL, NULL, "the copy of the gradient the next pipeline stage sent to the GPU"));
  if (h->link && h->output[0])
    snprintf(ps->fwd_post, sizeof ps->fwd_post,
             "  /* the output, which runtime/pipeline.c sends to the next stage */\n"
             "  CK(rt_cuda_to_host(cu, RT_STREAM_COMPUTE, out_host[slot_now], %s, ELEMS * sizeof(float)) &&\n"
             "     rt_cuda_sync(cu, RT_STREAM_COMPUTE), %d);\n"
             "  st->output = out_host[slot_now];\n",
             h->output, where(h, NULL, NULL, "the copy of the pipeline stage's output to the host"));
  if (h->input_grad[0])
    snprintf(ps->bwd_post, sizeof ps->bwd_post,
             "  /* the gradient of the input, which runtime/pipeline.c sends to the stage before */\n"
             "  CK(rt_cuda_to_host(cu, RT_STREAM_COMPUTE, grad_host[slot_now], %s, ELEMS * sizeof(float)) &&\n"
             "     rt_cuda_sync(cu, RT_STREAM_COMPUTE), %d);\n"
             "  st->input_grad = grad_host[slot_now];\n",
             h->input_grad, where(h, NULL, NULL, "the copy of the gradient of the stage's input to the host"));
}

// The forward's start: the input (and, but on a stage before the last, the target) to the GPU;
// where the output is (the slot's, with microbatches).
static void forward_prologue(Host *h, char *buf, size_t n) {
  int w = where(h, NULL, NULL, "the copy of the step's input and target to the GPU");
  int len = snprintf(buf, n, "  rt_step_begin_forward(st);\n"
                             "  CK(rt_cuda_to_device(cu, RT_STREAM_COMPUTE, X, st->input, ELEMS * sizeof(float)), %d);\n", w);
  if (!h->link)
    len += snprintf(buf + len, n - (size_t)len, "  CK(rt_cuda_to_device(cu, RT_STREAM_COMPUTE, T, st->target, ELEMS * sizeof(float)), %d);\n", w);
  if (h->pipe && h->output[0])
    len += snprintf(buf + len, n - (size_t)len, "  session->device_output = %s;   /* the slot's */\n", h->output);
  if (!h->link && h->output[0]) snprintf(buf + len, n - (size_t)len, "  st->output = output;\n");
}

bool cg_emit_cuda_host(IrDiag *d, FILE *out, const IrModule *m, const PassMemPlan *plan, const CgEmitOptions *o,
                       const CgCudaImages *images, const CgLaunches *ls) {
  if (!images || !images->arch || strncmp(images->arch, "sm_", 3) != 0 || atoi(images->arch + 3) < 10)
    return ir_internal(d, "the CUDA host program needs the kernels' images and their sm_NN architecture");
  Host h = {.d = d, .m = m, .plan = plan, .ok = true, .bf16 = cg_bf16_gemms(m)};
  h.param_offset = cg_param_offsets(m, &h.param_floats);
  h.grad_floats = cg_grad_floats(m);
  h.sp = spelling(&h);
  h.adamw = strcmp(ir_mod_str(m, "optimizer", "sgd"), "adamw") == 0;
  int64_t dp = ir_mod_int(m, "dp", 1), mp = ir_mod_int(m, "mp", 1);
  int64_t sizes[5] = {dp * mp, dp, mp, ir_mod_int(m, "ep", 1), ir_mod_int(m, "esp", 1)};
  memcpy(h.group_size, sizes, sizeof sizes);
  h.max_events = EV_BASE;
  int max_values = 1;
  h.ls = ls;
  int nk = cg_cuda_kernel_count(ls);
  bool *used = calloc((size_t)nk, sizeof *used);
  h.kernel_slot = malloc((size_t)nk * sizeof *h.kernel_slot);
  for (int i = 0; i < m->nfuncs; i++)
    if (m->funcs[i]->nvalues > max_values) max_values = m->funcs[i]->nvalues;
  h.staged = malloc((size_t)max_values * sizeof *h.staged);
  int max_launches = 1;
  for (int i = 0; i < ls->nfuncs; i++)
    if (ls->fn[i].n > max_launches) max_launches = ls->fn[i].n;
  h.rows_at = malloc((size_t)max_launches * sizeof *h.rows_at);
  char *body = NULL;
  size_t body_size = 0;
  h.out = open_memstream(&body, &body_size);
  bool ok = h.param_offset && used && h.kernel_slot && h.staged && h.rows_at && h.out;
  if (!ok) {
    ok = ir_oom(d);
    goto done;
  }
  cg_cuda_kernels_used(m, h.ls, used);
  for (int k = 0, slot = 0; k < nk; k++) h.kernel_slot[k] = used[k] ? slot++ : -1;

  // The model's output: a language model's logits (the loss function's second result), else the
  // first result of the last layer's forward (emit_c's st->output).
  const IrFunc *last_fwd = NULL, *loss = NULL;
  for (int i = 0; i < m->nfuncs; i++) {
    if (m->funcs[i]->role == IR_ROLE_LAYER_FWD) last_fwd = m->funcs[i];
    if (m->funcs[i]->role == IR_ROLE_LOSS_FWD) loss = m->funcs[i];
  }
  if (loss && loss->nrets > 1) cg_spell_value(&h.sp, loss->rets[1], h.output, sizeof h.output);
  else if (last_fwd && last_fwd->nrets > 0) cg_spell_value(&h.sp, last_fwd->rets[0], h.output, sizeof h.output);

  char prologue[1024];
  PipeSteps ps;
  pipe_setup(&h, &ps);
  forward_prologue(&h, prologue, sizeof prologue);
  const char *update_prologue = "";
  // When every launch of the update writes P16 as it updates P (a CG_ARG_PARAM16 argument:
  // mk_adamw_ranges, mk_adamw_bf16, ...), P16 stays fresh, and the forward rounds it only after
  // an upload (init, --weights, --resume, --check-grad).
  bool update_keeps_p16 = true;
  for (int fi = 0; fi < m->nfuncs; fi++)
    for (int k = 0; is_update(m->funcs[fi]) && k < h.ls->fn[fi].n; k++) {
      const CgLaunch *l = &h.ls->fn[fi].launch[k];
      update_keeps_p16 &= l->ncalls == 1 && has_arg(&l->call[0], CG_ARG_PARAM16);
    }
  if (h.bf16 && h.kernel_slot[cg_cuda_bf16_cast_kernel()] >= 0) {   // P16: the parameters rounded once
    int kernel = cg_cuda_bf16_cast_kernel();
    size_t len = strlen(prologue);
    snprintf(prologue + len, sizeof prologue - len,
             "  if (!p16_fresh) {   /* the parameters changed: their bf16 copy for the GEMMs */\n"
             "    launch(%d, RT_STREAM_COMPUTE, %s, %" PRId64 ", 0, (void *[]){PTR(P), PTR(P16), I64(PARAM_FLOATS)});\n"
             "    p16_fresh = true;\n  }\n",
             where(&h, NULL, NULL, "kernel %s (the parameters to bf16)", cg_cuda_kernel_name(h.ls, kernel)),
             cg_cuda_kernel_name(h.ls, kernel), cg_cuda_grid_elems(h.param_floats));
    if (!update_keeps_p16) {   // counted in the forward: it runs at every step
      update_prologue = "  p16_fresh = false;   /* rounded again at the next forward */\n";
      h.count[STEP_FORWARD].kernels++, h.count[STEP_FORWARD].casts++;
      h.count[STEP_FORWARD].kernel_bytes += 6.0 * (double)h.param_floats;
    }
  }
  ok = emit_step(&h, STEP_FORWARD, prologue, ps.fwd_post, is_forward) &&
       emit_step(&h, STEP_BACKWARD, ps.bwd_pre, ps.bwd_post, is_backward) &&
       emit_step(&h, STEP_UPDATE, update_prologue, "", is_update) && h.ok;
  if (h.nranges > 0) h.w_ranges = where(&h, NULL, NULL, "the copy of the update's table of ranges to the GPU");
  pipe_sites(&h);
  if (fclose(h.out) != 0) ok = ir_oom(d);
  h.out = NULL;
  if (!ok) goto done;
  h.row_spared = row_kernels_spared(&h);
  if (o->verbose) print_counts(&h, stderr, "# ", "\n");
  emit_header(&h, out, o->source_name, images);
  fwrite(body, 1, body_size, out);
  emit_hooks(&h, out);
  cg_emit_model(out, m, plan, h.param_floats, "device", o);
done:
  if (h.out) fclose(h.out);
  free(body);
  for (int i = 0; i < h.nwhere; i++) free(h.where[i]);
  free(h.where);
  free(h.staged);
  free(h.rows_at);
  free(h.ranges);
  free(h.pooled_addr);
  free(h.pooled_off);
  free(h.pooled_bytes);
  free(h.kernel_slot);
  free(h.copied);
  free(h.hooked);
  free(used);
  free(h.param_offset);
  return ok;
}
