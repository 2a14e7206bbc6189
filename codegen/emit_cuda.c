// The CUDA target's kernel emitter: the CUDA C translation unit of a module's device kernels,
// compiled by NVRTC (codegen/nvrtc.c) for sm_80 / sm_90 at `moec build` time.
//
// The kernels are the rows of runtime/kernels.def, `mk_NAME`, with their sources in
// codegen/cuda/FAMILY.cu (embedded at build time by mk/embed_cuda.awk): each reproduces the CPU
// kernel rt_NAME of libmoert (runtime/kernels/FAMILY.c, its sibling) it stands for, with the same
// parameters: the same formulas, the same order of choices, reductions in double. A module gets
// the kernels its ops' lowerings use, each once, after a prelude of __device__ helpers (routing
// groups, block reductions, the counter-based RNG of runtime/rng.c, the 16-bit conversions of
// runtime/kernels/hook.c on the bits). The unit is self-contained: no #include (NVRTC has no system
// headers), extern "C" names, no host code.
//
// Fused groups (passes/fuse.c): each is one kernel generated from its members' scalar
// expressions (codegen/fused.c, `mk_fuse_N`), after the library's kernels; the unit defines
// MK_FUSED (extern "C" __global__) for them.
//
// Fused gate kernels: where a gate's softmax (or sigmoid), top-k and gather are consecutive ops
// of one function, one kernel (mk_gate_softmax_topk_gather / mk_gate_sigmoid_topk_gather) does
// the three per token, launched at the gather's position, and the three separate kernels are
// not needed for them.
//
// GEMMs (matmul, expert.matmul) go to cuBLAS and collectives (comm.*) to NCCL; the unit lists
// them in its header comment. With dtype bf16 (cg_bf16_gemms) the GEMMs take bf16 inputs: the
// unit also holds mk_compress_bf16, which the host program launches on each GEMM operand (a
// rounded copy, nearest even) before cuBLAS multiplies the copies with fp32 accumulation.
// Which kernels an op launches, with which grid and arguments, is data (cg_lower, lower.c;
// cg_internal.h): after the kernels, the unit prints it as a comment, the
// launch plan (every op in program order), and the CUDA target's host program
// (emit_cuda_host.c) issues exactly those launches.
//
// Launch conventions: kernels with grid-stride loops (MK_FOR) take any grid; those documented
// "one block of MK_BLOCK threads" or "per row/choice/token ... MK_BLOCK" reduce with
// mk_block_sum / mk_block_max and must be launched with exactly MK_BLOCK (256) threads per
// block (the lowering launches every kernel so); mk_aux_loss_grad takes e * sizeof(double)
// bytes of dynamic shared memory.
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cg_internal.h"


// "mk_NAME" of every kernel.
static const char *mk_name(int k) {
  static char names[CG_K_COUNT][64];
  if (!names[k][0]) snprintf(names[k], sizeof names[k], "mk_%s", cg_kernel_info[k].name);
  return names[k];
}

// The sources: codegen/cuda/prelude.cu and the family files, embedded by mk/embed_cuda.awk as
// cuda_prelude_src (every prelude section) and cuda_kernel_src (in file order, found here by name).
typedef struct CudaSource { const char *name, *src; } CudaSource;
#include "cuda_kernels.inc"
#define prelude_src cuda_prelude_src

// The source of kernel k (its row in kernels.def); every row has one (nvrtc_check checks).
static const char *kernel_text(int k) {
  static const char *by_id[CG_K_COUNT];
  if (!by_id[k]) {
    for (size_t i = 0; i < sizeof cuda_kernel_src / sizeof *cuda_kernel_src; i++)
      if (strcmp(cuda_kernel_src[i].name, mk_name(k)) == 0) by_id[k] = cuda_kernel_src[i].src;
    if (!by_id[k]) UNREACHABLE();
  }
  return by_id[k];
}


const char *cg_cuda_prelude(void) { return prelude_src; }

int cg_cuda_kernel_count(const CgLaunches *ls) { return CG_K_COUNT + (ls ? ls->ngen : 0); }

const char *cg_cuda_kernel_name(const CgLaunches *ls, int k) {
  if (k >= 0 && k < CG_K_COUNT) return mk_name(k);
  return ls && k >= CG_K_COUNT && k < CG_K_COUNT + ls->ngen ? ls->gen[k - CG_K_COUNT].name : "?";
}

int cg_cuda_kernel_params(const CgLaunches *ls, int k, CgParamType *types, int max) {
  int n = 0;
  if (k >= CG_K_COUNT) {   // a fused group's kernel: pointers
    if (!ls || k >= CG_K_COUNT + ls->ngen || ls->gen[k - CG_K_COUNT].nparams > max) return -1;
    for (; n < ls->gen[k - CG_K_COUNT].nparams; n++) types[n] = CG_PARAM_POINTER;
    return n;
  }
  for (const char *c = cg_kernel_info[k].sig; *c; c++) {
    if (n == max) return -1;
    types[n++] = *c == 'p' ? CG_PARAM_POINTER : *c == 'i' ? CG_PARAM_INT : *c == 'l' ? CG_PARAM_I64
               : *c == 'u' ? CG_PARAM_U64 : CG_PARAM_FLOAT;
  }
  return n;
}

// Each parameter type of runtime/kernels.def as codegen/cuda/*.cu spell it.
#define K_F32 "const float *"
#define K_F32_OUT "float *"
#define K_I32 "const int *"
#define K_I32_OUT "int *"
#define K_U16 "const u16 *"
#define K_U16_OUT "u16 *"
#define K_I8 "const i8 *"
#define K_I8_OUT "i8 *"
#define K_BYTES "const unsigned char *"
#define K_BYTES_OUT "unsigned char *"
#define K_PTR_OUT "*"   // a pointer of the kernel's own type (int stats, double sums)
#define K_INT "int"
#define K_I64 "i64"
#define K_U64 "u64"
#define K_FLOAT "float"
static const char *const cuda_params[CG_K_COUNT][CG_MAX_KERNEL_ARGS + 1] = {
#define RT_KERNEL(ID, NAME, WHERE, PARAMS) [CG_K_##ID] = {PARAMS_LIST PARAMS},
#define PARAMS_LIST(...) __VA_ARGS__
#include "../runtime/kernels.def"
#undef RT_KERNEL
#undef PARAMS_LIST
};

// The parameter types of the declaration "TYPE NAME, TYPE NAME)" at p, each with its name
// dropped and spaces normalised ("const float *x" -> "const float *"), joined by ", ".
static void declared_types(const char *p, char *out, size_t cap) {
  size_t o = 0;
  out[0] = '\0';
  while (*p && *p != ')') {
    const char *end = p + strcspn(p, ",)");
    while (*p == ' ' || *p == '\n') p++;
    const char *name = end;
    while (name > p && (name[-1] == ' ' || name[-1] == '\n')) name--;
    while (name > p && name[-1] != ' ' && name[-1] != '*') name--;   // the parameter's name
    const char *type_end = name;
    while (type_end > p && type_end[-1] == ' ') type_end--;
    bool ptr = type_end > p && type_end[-1] == '*';
    if (ptr) type_end--;
    while (type_end > p && type_end[-1] == ' ') type_end--;
    o += (size_t)snprintf(out + o, o < cap ? cap - o : 0, "%s%.*s%s", o ? ", " : "", (int)(type_end - p), p, ptr ? " *" : "");
    p = *end == ',' ? end + 1 : end;
  }
}

int cg_cuda_check_signatures(FILE *err) {
  int bad = 0;
  for (int k = 0; k < CG_K_COUNT; k++) {
    char decl[128], got[512], want[512];
    size_t o = 0;
    want[0] = '\0';
    for (int i = 0; cuda_params[k][i]; i++) o += (size_t)snprintf(want + o, sizeof want - o, "%s%s", i ? ", " : "", cuda_params[k][i]);
    snprintf(decl, sizeof decl, "void mk_%.64s(", cg_kernel_info[k].name);
    const char *p = strstr(kernel_text(k), decl);
    if (p) declared_types(p + strlen(decl), got, sizeof got);
    // parameter by parameter; K_PTR_OUT ("*") matches any pointer
    bool same = p != NULL;
    for (const char *w = want, *g = got; same && (*w || *g);) {
      size_t wl = strcspn(w, ","), gl = strcspn(g, ",");
      same = (wl == gl && strncmp(w, g, wl) == 0) || (wl == 1 && *w == '*' && gl > 1 && g[gl - 1] == '*');
      w += wl + (w[wl] ? 2 : 0);
      g += gl + (g[gl] ? 2 : 0);
    }
    if (!same) {
      fprintf(err, "kernel %s: runtime/kernels.def says (%s), codegen/cuda/*.cu declares (%s)\n", mk_name(k), want,
              p ? got : "no declaration");
      bad++;
    }
  }
  return bad;
}

bool cg_bf16_gemms(const IrModule *m) { return strcmp(ir_mod_str(m, "dtype", "fp32"), "bf16") == 0; }

unsigned cg_cuda_lowering(const IrModule *m) {
  return (ir_mod_int(m, "no_fuse", 0) ? 0 : CG_LOWER_FUSE) | (cg_bf16_gemms(m) ? CG_LOWER_BF16 : 0);
}

int cg_cuda_bf16_cast_kernel(void) { return CG_K_COMPRESS_BF16; }


void cg_cuda_kernels_used(const IrModule *m, const CgLaunches *ls, bool *used) {
  memset(used, 0, (size_t)cg_cuda_kernel_count(ls) * sizeof *used);
  bool bf16 = cg_bf16_gemms(m);
  for (int fi = 0; fi < ls->nfuncs; fi++)
    for (int k = 0; k < ls->fn[fi].n; k++) {
      const CgLaunch *l = &ls->fn[fi].launch[k];
      for (int c = 0; c < l->ncalls; c++) used[l->call[c].kernel] = true;
      if (bf16 && l->lib == CG_LIB_GEMM) used[CG_K_COMPRESS_BF16] = true;   // the operands' cast
    }
  // Microbatches: their gradients summed and divided by their number on the GPU (emit_cuda_host.c,
  // RtDevice.accumulate).
  if (ir_mod_int(m, "microbatches", 1) > 1) used[CG_K_ADD] = used[CG_K_SCALE_ROWS] = true;
}

// The library the CUDA target uses for what the lowering leaves to one (the unit's plan comment).
static const char *lib_name(CgLib lib) {
  return lib == CG_LIB_GEMM ? "cuBLAS" : lib == CG_LIB_COLLECTIVE ? "NCCL" : lib == CG_LIB_SPLIT ? "copy" : "-";
}

// ---- the translation units ----

void cg_emit_cuda_library(FILE *out) {
  fprintf(out, "// Generated by moec: every CUDA kernel of the CUDA target (%d), for NVRTC (sm_80, sm_90).\n\n%s\n",
          (int)CG_K_COUNT, prelude_src);
  for (int k = 0; k < CG_K_COUNT; k++) fprintf(out, "// ---- %s ----\n%s\n", mk_name(k), kernel_text(k));
}

// Whether text calls __syncthreads, directly or through a prelude function that does (the
// prelude's functions come before their callers, so one pass in order finds them all).
static bool calls_syncthreads(const char *text, const char *const *syncing, int nsyncing) {
  if (strstr(text, "__syncthreads")) return true;
  for (int i = 0; i < nsyncing; i++) {
    char callee[80];
    snprintf(callee, sizeof callee, "%s(", syncing[i]);
    if (strstr(text, callee)) return true;
  }
  return false;
}

void cg_emit_cuda_kernel_list(FILE *out) {
  // The prelude's __device__ functions that synchronise: their names, found in source order.
  const char *syncing[32];
  char names[32][64];
  int nsyncing = 0;
  const char *mark = "__device__ ";
  for (const char *p = strstr(prelude_src, mark); p; p = strstr(p + 1, mark)) {
    const char *open = strchr(p, '('), *body = open ? strchr(open, '{') : NULL, *end = body;
    if (!body) UNREACHABLE();
    for (int depth = 0; *end; end++) {   // the body: to the brace that closes the first one
      depth += (*end == '{') - (*end == '}');
      if (depth == 0) break;
    }
    const char *name = open;
    while (name > p && name[-1] != ' ' && name[-1] != '*') name--;
    char *text = strndup(body, (size_t)(end - body));
    if (!text) UNREACHABLE();
    if (nsyncing < 32 && calls_syncthreads(text, syncing, nsyncing)) {
      snprintf(names[nsyncing], sizeof names[nsyncing], "%.*s", (int)(open - name), name);
      syncing[nsyncing] = names[nsyncing];
      nsyncing++;
    }
    free(text);
  }
  for (int k = 0; k < CG_K_COUNT; k++)
    fprintf(out, "MK_KERNEL(%s, %d)\n", mk_name(k), calls_syncthreads(kernel_text(k), syncing, nsyncing));
}

// "%x", "@p": an operand of op as the launch plan names it.
static void operand_name(char *buf, size_t n, const IrOperand *a) {
  if (a->param) snprintf(buf, n, "@%s", a->param->name);
  else snprintf(buf, n, "%%%s", a->value->name);
}

// One argument of a kernel call of op (the first of the launch's ops) as the plan prints it.
static void plan_arg(char *buf, size_t n, const IrFunc *f, int i, const CgArg *a) {
  const IrOp *op = f->ops[i];
  switch (a->kind) {
  case CG_ARG_OPERAND: operand_name(buf, n, &f->ops[i + a->i]->args[a->index]); return;
  case CG_ARG_RESULT: snprintf(buf, n, "%%%s", f->ops[i + a->index]->result->name); return;
  case CG_ARG_COPY: snprintf(buf, n, "bf16(%%%s)", f->ops[i + a->index]->result->name); return;
  case CG_ARG_OPERAND16: snprintf(buf, n, "bf16(%%%s)", f->ops[i + a->i]->args[a->index].value->name); return;
  case CG_ARG_GRAD: snprintf(buf, n, "grad(@%s)", op->args[0].param->name); return;
  case CG_ARG_MOMENT_M: snprintf(buf, n, "m(@%s)", op->args[0].param->name); return;
  case CG_ARG_MOMENT_V: snprintf(buf, n, "v(@%s)", op->args[0].param->name); return;
  case CG_ARG_PARAM16: snprintf(buf, n, "bf16(@%s)", op->args[0].param->name); return;
  case CG_ARG_RANGES: snprintf(buf, n, "ranges"); return;
  case CG_ARG_STATS: snprintf(buf, n, "stats"); return;
  case CG_ARG_SCRATCH: snprintf(buf, n, "scratch"); return;
  case CG_ARG_INT: snprintf(buf, n, "%" PRId64, a->i); return;
  case CG_ARG_FLOAT: snprintf(buf, n, "%.9g", a->f); return;
  case CG_ARG_SEED: snprintf(buf, n, "seed"); return;
  case CG_ARG_STEP: snprintf(buf, n, "step"); return;
  case CG_ARG_TOKEN0: snprintf(buf, n, "token0"); return;
  case CG_ARG_VOCAB0: snprintf(buf, n, "vocab0"); return;
  case CG_ARG_LR_SCALE: snprintf(buf, n, "lr_scale"); return;
  case CG_ARG_GRAD_SCALE: snprintf(buf, n, "grad_scale"); return;
  }
  UNREACHABLE();
}

// The pointer arguments of a library op (cuBLAS, NCCL, copy): operands, then the result.
static void pointer_list(char *buf, size_t n, const IrOp *op) {
  size_t used = 0;
  buf[0] = 0;
  for (int i = 0; i < op->nargs && used < n; i++) {
    char name[128];
    operand_name(name, sizeof name, &op->args[i]);
    used += (size_t)snprintf(buf + used, n - used, "%s%s", i ? ", " : "", name);
  }
  if (op->result && used < n) snprintf(buf + used, n - used, "%s%%%s", op->nargs ? ", " : "", op->result->name);
}

CgLaunches *cg_cuda_launches(IrDiag *d, const IrModule *m, const PassMemPlan *plan) {
  return cg_lower_module(d, m, plan, cg_cuda_lowering(m));
}

int cg_cuda_generated_kernels(const CgLaunches *ls) { return ls->ngen; }

bool cg_emit_cuda(IrDiag *d, FILE *out, const IrModule *m, const CgLaunches *ls) {
  // Which kernels, and what goes to cuBLAS / NCCL (the lowering's).
  bool *used = calloc((size_t)cg_cuda_kernel_count(ls), sizeof *used);
  if (!used) return ir_oom(d);
  cg_cuda_kernels_used(m, ls, used);
  int nkernels = 0;
  for (int k = 0; k < cg_cuda_kernel_count(ls); k++) nkernels += used[k];

  bool bf16 = cg_bf16_gemms(m);
  fprintf(out, "// Generated by moec: the CUDA kernels of model '%s' (%d kernels), for NVRTC\n"
               "// (sm_80, sm_90). Do not edit; change the .moe file and rebuild.\n//\n",
          m->name, nkernels);
  if (bf16)
    fprintf(out, "// dtype bf16: every GEMM below takes bf16 inputs, each fp32 operand rounded to bf16 (nearest\n"
                 "// even) by mk_compress_bf16 into a scratch copy first, and accumulates in fp32 into its fp32\n"
                 "// result; every other tensor and kernel is fp32.\n//\n");
  fprintf(out, "// Not in this unit (the host runtime issues them):\n");
  for (int fi = 0; fi < m->nfuncs; fi++) {
    const IrFunc *f = m->funcs[fi];
    for (int i = 0; i < f->nops; i++) {
      const IrOp *op = f->ops[i];
      CgLaunch l;
      memset(&l, 0, sizeof l);
      if (!cg_lower_op(op, &l) || !l.lib) continue;
      char ptrs[512];
      pointer_list(ptrs, sizeof ptrs, op);
      fprintf(out, "//   %-8s @%s: %s %s", lib_name(l.lib), f->name, ir_op_info[op->kind].name, ptrs);
      if (op->kind == IR_OP_MATMUL || op->kind == IR_OP_EXPERT_MATMUL) {
        fprintf(out, " [");
        for (int k = 0; k < op->result->type.rank; k++) fprintf(out, "%s%" PRId64, k ? ", " : "", op->result->type.dim[k]);
        fprintf(out, "]%s%s%s", ir_op_int(op, "ta", 0) ? " ta" : "", ir_op_int(op, "tb", 0) ? " tb" : "",
                bf16 ? " bf16 inputs" : "");
      } else {
        fprintf(out, " (group %s, size %" PRId64 ")", ir_op_str(op, "group", "world"), ir_op_int(op, "size", 1));
      }
      fprintf(out, "\n");
    }
  }
  fprintf(out, "\n%s\n", prelude_src);
  for (int k = 0; k < CG_K_COUNT; k++)
    if (used[k]) fprintf(out, "// ---- %s ----\n%s\n", mk_name(k), kernel_text(k));
  if (ls->ngen) fprintf(out, "// The fused groups' kernels (generated: codegen/fused.c).\n#define MK_FUSED extern \"C\" __global__\n\n");
  for (int g = 0; g < ls->ngen; g++)
    fprintf(out, "// ---- %s: %s ----\nMK_FUSED void %s%s\n", ls->gen[g].name, ls->gen[g].ops, ls->gen[g].name, ls->gen[g].source);

  // The launch plan, in program order.
  fprintf(out, "// Launch plan (program order): op -> kernel<<<grid>>>(arguments...); every block has %d threads.\n",
          CG_CUDA_BLOCK);
  for (int fi = 0; fi < m->nfuncs; fi++) {
    const IrFunc *f = m->funcs[fi];
    fprintf(out, "// @%s\n", f->name);
    for (int k = 0; k < ls->fn[fi].n; k++) {
      const CgLaunch *l = &ls->fn[fi].launch[k];
      int i = ls->fn[fi].at[k];
      const IrOp *op = f->ops[i];
      fprintf(out, "//   %s", ir_op_info[op->kind].name);
      for (int j = 1; j < l->nops; j++) fprintf(out, " + %s", ir_op_info[f->ops[i + j]->kind].name);
      if (l->lib) {
        char ptrs[512];
        pointer_list(ptrs, sizeof ptrs, op);
        bool cast = bf16 && l->lib == CG_LIB_GEMM;
        fprintf(out, " %s -> %s%s\n", ptrs, cast ? "mk_compress_bf16 of each operand, " : "", lib_name(l->lib));
        continue;
      }
      fprintf(out, " ->");
      for (int c = 0; c < l->ncalls; c++) {
        const CgKernelCall *call = &l->call[c];
        fprintf(out, "%s %s<<<%" PRId64 ">>>(", c ? "," : "", cg_cuda_kernel_name(ls, call->kernel), call->grid);
        for (int a = 0; a < call->nargs; a++) {
          char buf[160];
          plan_arg(buf, sizeof buf, f, i, &call->args[a]);
          fprintf(out, "%s%s", a ? ", " : "", buf);
        }
        fprintf(out, ")");
      }
      fprintf(out, "%s%s\n", l->note[0] ? "  -- " : "", l->note);
    }
  }
  free(used);
  return true;
}

bool cg_emit_cuda_fused_host(IrDiag *d, FILE *out, const IrModule *m, const CgLaunches *ls) {
  (void)d;
  fprintf(out, "// Generated by moec: the fused kernels of model '%s' (%d) as host C++ for the fake device of\n"
               "// the tests (tests/cuda/fused_host.h). Do not edit.\n#include \"fused_host.h\"\n\nnamespace {\n%s\n",
          m->name, ls->ngen, prelude_src);
  for (int g = 0; g < ls->ngen; g++)
    fprintf(out, "// ---- %s: %s ----\nMK_FUSED void %s%s\n", ls->gen[g].name, ls->gen[g].ops, ls->gen[g].name, ls->gen[g].source);
  fprintf(out, "\n// The table, registered with the fake device before main (every stage of a pipeline registers its\n"
               "// own: the kernels' names tell them apart).\nconst MkFusedKernel fused_kernels[] = {\n");
  for (int g = 0; g < ls->ngen; g++) {
    const CgGenKernel *k = &ls->gen[g];
    fprintf(out, "    {\"%s\", %d, %s, [](void **a) { %s(", k->name, k->nparams, k->syncs ? "true" : "false", k->name);
    for (int p = 0; p < k->nparams; p++) fprintf(out, "%smk_ptr(a[%d])", p ? ", " : "", p);
    fprintf(out, "); }},\n");
  }
  fprintf(out, "    {nullptr, 0, false, nullptr}};\nconst bool registered = (mk_fused_register(fused_kernels, %d), true);\n"
               "}  // namespace\n", ls->ngen);
  return true;
}
