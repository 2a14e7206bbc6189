// Layer 2 of codegen/: the kernel table and the embedded CUDA sources. The rows of
// runtime/kernels.def (cg_kernel_info: name, whether the CPU has it, parameters as letters), the
// CUDA kernels' sources from codegen/cuda/*.cu (embedded at build time by mk/embed_cuda.awk: the
// prelude, each kernel's text, by name), their parameter types and the check of those against the
// .cu declarations, the kernels a module's launches can name (the library's, then the generated
// ones of CgLaunches.gen), and the grids every CUDA kernel is launched with.
// It may call facts.c (layer 1) only.
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cg_internal.h"

// ---- runtime/kernels.def ----

// The kernel table, its parameter types spelled as letters.
#define K_F32 'p'
#define K_F32_OUT 'p'
#define K_I32 'p'
#define K_I32_OUT 'p'
#define K_U16 'p'
#define K_U16_OUT 'p'
#define K_I8 'p'
#define K_I8_OUT 'p'
#define K_BYTES 'p'
#define K_BYTES_OUT 'p'
#define K_PTR_OUT 'p'
#define K_INT 'i'
#define K_I64 'l'
#define K_U64 'u'
#define K_FLOAT 'f'
#define SIG(...) {__VA_ARGS__, 0}
#define ON_CPU_BOTH true
#define ON_CPU_CUDA false
const CgKernelInfo cg_kernel_info[CG_K_COUNT] = {
#define RT_KERNEL(ID, NAME, WHERE, PARAMS) [CG_K_##ID] = {#NAME, ON_CPU_##WHERE, SIG PARAMS},
#include "../runtime/kernels.def"
#undef RT_KERNEL
};

const char *cg_kernel_name(int k) { return k >= 0 && k < CG_K_COUNT ? cg_kernel_info[k].name : "?"; }

int cg_kernel_by_name(const char *name) {
  for (int k = 0; k < CG_K_COUNT; k++)
    if (strcmp(cg_kernel_info[k].name, name) == 0) return k;
  return -1;
}

#undef K_F32
#undef K_F32_OUT
#undef K_I32
#undef K_I32_OUT
#undef K_U16
#undef K_U16_OUT
#undef K_I8
#undef K_I8_OUT
#undef K_BYTES
#undef K_BYTES_OUT
#undef K_PTR_OUT
#undef K_INT
#undef K_I64
#undef K_U64
#undef K_FLOAT
#undef SIG
#undef ON_CPU_BOTH
#undef ON_CPU_CUDA

// ---- the CUDA kernels' sources (codegen/cuda/*.cu) ----

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
const char *cg_cuda_kernel_source(int k) {
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
    const char *p = strstr(cg_cuda_kernel_source(k), decl);
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

int cg_cuda_bf16_cast_kernel(void) { return CG_K_COMPRESS_BF16; }

// ---- grids ----
// Every CUDA kernel runs CG_CUDA_BLOCK (= MK_BLOCK) threads per block; the grid is the one the
// kernel's loops are written for: per element (MK_FOR), per row, token, choice or group
// (MK_FOR_BLOCKS), or a single block for the whole-tensor reductions. The CPU ignores grids.

static int64_t clamp_grid(int64_t g) { return g < 1 ? 1 : g > 65535 ? 65535 : g; }
static int64_t grid_elems(int64_t n) { return clamp_grid((n + CG_CUDA_BLOCK - 1) / CG_CUDA_BLOCK); }
static int64_t grid_blocks(int64_t n) { return clamp_grid(n); }

int64_t cg_cuda_grid_elems(int64_t n) { return grid_elems(n); }
int64_t cg_cuda_grid_blocks(int64_t n) { return grid_blocks(n); }

int64_t cg_cuda_column_tiles(int64_t blocks, int64_t cols) {
  int64_t wide = blocks * ((cols + 31) / 32);
  return grid_blocks(wide >= 1024 ? wide : blocks * ((cols + 7) / 8));
}
