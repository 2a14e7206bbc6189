// Layer 8 of codegen/ (a target, the top): it may call the emitters, launch.c, link.c and nvrtc.c.
//
// The CUDA target: one GPU per rank. The model's kernels (codegen/emit_cuda.c) are compiled by
// NVRTC at build time for the requested architecture and embedded, as CUBIN and PTX, in the host
// program (codegen/emit_cuda_host.c), which launches them and runs cuBLAS GEMMs and NCCL
// collectives on the scheduled streams through libmoert_cuda.
//
// This file is linked into moec only (not libmoec): NVRTC is there where make found the CUDA
// toolkit (MOEC_NVRTC); elsewhere the target says it is unavailable. MOEC_CUDA_FAKE=1 in the
// environment is a test hook: programs link build/cuda/libfake_cuda.a instead of libmoert_cuda
// and the CUDA libraries (tests/cuda/fake_cuda.cpp: rt_cuda.h on host memory, the kernels
// emulated), so that `make test` runs CUDA programs on machines without a GPU.
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cg.h"
#include "cg_internal.h"

#ifdef MOEC_NVRTC
static bool cuda_available(char *why, size_t size) {
  (void)why, (void)size;
  return true;
}

// The model's kernels compiled by NVRTC: the CUBIN for arch and the PTX of its virtual
// architecture, malloc'd.
static bool use_fake(void);

// MOEC_WGMMA=0 at build time: no mk_expert_gemm_wg in the program (moec's grouped GEMM stays on mma.sync).
static bool wg_off(void) {
  const char *v = getenv("MOEC_WGMMA");
  return v && strcmp(v, "0") == 0;
}

static bool cuda_images(IrDiag *d, const IrModule *m, const CgLaunches *ls, const char *arch, CgCudaImages *img) {
  cg_nvrtc_fast(use_fake());   // the fake device never runs the images
  char *src = NULL;
  size_t n = 0;
  FILE *f = open_memstream(&src, &n);
  if (!f) return ir_oom(d);
  bool ok = cg_emit_cuda(d, f, m, ls);
  if (fclose(f) != 0) ok = ir_oom(d);
  void *cubin = NULL;
  char *ptx = NULL;
  const char *images = getenv("MOEC_CUDA_IMAGES");
  if (images && *images && strcmp(images, "ptx") != 0 && strcmp(images, "both") != 0)
    ok = ok && ir_error(d, "MOEC_CUDA_IMAGES is '%s': 'both' (the CUBIN and the PTX, the default) or 'ptx' (the PTX "
                           "alone, which the driver compiles when the program starts)", images);
  if (images && strcmp(images, "ptx") == 0)
    ok = ok && cg_nvrtc_ptx_cached(d, src, arch, &ptx, &img->ptx_size, &img->cached);
  else
    ok = ok && cg_nvrtc_images_cached(d, src, arch, &cubin, &img->cubin_size, &ptx, &img->ptx_size, &img->cached);
  free(src);
  img->arch = arch;
  img->cubin = cubin;
  img->ptx = ptx;
  // moec's grouped GEMM on wgmma beside them, where the program carries mk_expert_gemm_tc and its
  // kernels are for sm_90 (the kernel runs there only; a CUBIN for sm_90a even beside PTX alone):
  // the same unit for every program, so the build cache compiles it once.
  bool *used = calloc((size_t)cg_cuda_kernel_count(ls), sizeof *used);
  if (!used) return ir_oom(d);
  cg_cuda_kernels_used(m, ls, used);
  bool wg = ok && used[CG_K_EXPERT_GEMM_TC] && strcmp(arch, "sm_90") == 0 && !wg_off();
  free(used);
  if (wg) {
    void *wcubin = NULL;
    bool wcached = false;
    ok = cg_nvrtc_wg_cubin(d, true, &wcubin, &img->wg_cubin_size, &wcached);
    img->wg_cubin = wcubin;
  }
  return ok;
}
#else
static bool cuda_available(char *why, size_t size) {
  snprintf(why, size, "this moec was built without NVRTC (make links it into build/moec only where it finds the CUDA "
                      "toolkit, CUDA=/usr/local/cuda by default), so it cannot compile the kernels of --target cuda; "
                      "use a moec built by 'make' where the toolkit is, or build with --target cpu");
  return false;
}

static bool cuda_images(IrDiag *d, const IrModule *m, const CgLaunches *ls, const char *arch, CgCudaImages *img) {
  (void)m, (void)ls, (void)arch, (void)img;
  char why[512];
  cuda_available(why, sizeof why);
  return ir_error(d, "%s", why);
}
#endif

static bool use_fake(void) {
  const char *fake = getenv("MOEC_CUDA_FAKE");
  return fake && strcmp(fake, "1") == 0;
}

// PATH.fused.cpp (and .o) beside the program at path.
static void fused_path(char *buf, size_t size, const char *path, const char *ext) { snprintf(buf, size, "%s.fused.%s", path, ext); }

// The fake device runs the library's kernels from its own build; a program's fused kernels are
// generated per program, so under MOEC_CUDA_FAKE=1 they are also written as host C++ beside the
// program (when there are any), for cuda_link to compile into it.
static bool fake_fused(IrDiag *d, const IrModule *m, const CgLaunches *ls, const CgEmitOptions *o) {
  if (!use_fake() || !o->program_path || cg_cuda_generated_kernels(ls) == 0) return true;
  char path[4096];
  fused_path(path, sizeof path, o->program_path, "cpp");
  FILE *f = fopen(path, "w");
  if (!f) return ir_error(d, "cannot write '%s'", path);
  bool ok = cg_emit_cuda_fused_host(d, f, m, ls);
  if (fclose(f) != 0) ok = ir_error(d, "cannot write '%s'", path);
  return ok;
}

// A pipeline stage's fused kernels get the stage in their names (mk_fuse_3 of stage 1: mk_s1_fuse_3):
// a GPU looks them up in the stage's own module, but the fake device finds a program's fused
// kernels by name among every table linked in, and the stages of a model are one program.
static bool stage_names(IrDiag *d, const IrModule *m, CgLaunches *ls) {
  if (ir_mod_int(m, "pp", 1) <= 1) return true;
  for (int g = 0; g < ls->ngen; g++) {
    char *name = ls->gen[g].name, renamed[64];
    snprintf(renamed, sizeof renamed, "mk_s%d_%s", (int)ir_mod_int(m, "stage", 0), strncmp(name, "mk_", 3) == 0 ? name + 3 : name);
    if (strlen(renamed) >= sizeof ls->gen[g].name) return ir_internal(d, "the fused kernel name '%s' is too long", renamed);
    memcpy(name, renamed, strlen(renamed) + 1);
  }
  return true;
}

static bool cuda_emit(IrDiag *d, FILE *out, const IrModule *m, const PassMemPlan *plan, const CgEmitOptions *o) {
  CgCudaImages img = {0};
  CgLaunches *ls = cg_cuda_launches(d, m);   // each op lowered once, for every emitter
  bool ok = ls && stage_names(d, m, ls) && fake_fused(d, m, ls, o) && cuda_images(d, m, ls, o->arch ? o->arch : "sm_90", &img);
  if (ok && o->verbose) {
    const char *from = img.cached ? " (from the build cache)" : "";
    if (img.cubin_size)
      fprintf(stderr, "# nvrtc: CUBIN for %s %zu bytes, PTX %zu bytes%s, embedded in the program\n", img.arch,
              img.cubin_size, img.ptx_size, from);
    else
      fprintf(stderr, "# nvrtc: PTX of %s %zu bytes%s, embedded in the program (no CUBIN: MOEC_CUDA_IMAGES=ptx)\n",
              img.arch, img.ptx_size, from);
    if (img.wg_cubin_size)
      fprintf(stderr, "# nvrtc: moec's grouped GEMM on wgmma (mk_expert_gemm_wg) for sm_90a %zu bytes, embedded beside it\n",
              img.wg_cubin_size);
  }
  ok = ok && cg_emit_cuda_host(d, out, m, plan, o, &img, ls);
  cg_launches_free(ls);
  free((void *)img.cubin);
  free((void *)img.ptx);
  free((void *)img.wg_cubin);
  return ok;
}

// libmoert_cuda (needs cuBLAS, NCCL and libdl; the driver itself is opened at run time,
// runtime/cuda/rt_cuda.c), or the fake device of the tests with each program's fused kernels as
// host C++ (fake_fused): the program at c_path and those of a model's other pipeline stages
// (stages, NULL-terminated; NULL: none).
static bool link_programs(IrDiag *d, const char *c_path, const char *const *stages, const char *out_path, bool verbose) {
  bool fake = use_fake();
  if (!*cg_cuda_cflags)
    return ir_error(d, "this moec was built where make found no CUDA toolkit, so it cannot link a CUDA program "
                       "(rebuild moec with 'make' where the toolkit is, CUDA=/path)");
  if (!fake && !*cg_cuda_libs)
    return ir_error(d, "this moec was built where make found no cuBLAS or NCCL, so it cannot link a CUDA program "
                       "(see the '#' lines of 'make'; NCCL_HOME=/path)");
  char cflags[8192], include[4096];
  cg_source_file("runtime/cuda", include, sizeof include);
  snprintf(cflags, sizeof cflags, "-I%s %s %s", include, cg_cuda_cflags, cg_mpi_cflags);
  CgLinkExtra extra = {
      .cflags = cflags,
      .how = fake ? "the fake device of the tests: 'make' builds it where the CUDA toolkit is"
                  : "the GPU runtime: 'make' builds it where the CUDA toolkit, cuBLAS and NCCL are",
      .libs = fake ? "-lstdc++" : cg_cuda_libs,
  };
  cg_build_file(fake ? "cuda/libfake_cuda.a" : "libmoert_cuda.a", extra.library, sizeof extra.library);
  int n = 0;
  while (stages && stages[n]) n++;
  // The other programs' C files, then the fused kernels' objects, all before the library.
  const char **files = calloc((size_t)(2 * n + 2), sizeof *files);
  char (*objects)[4096] = calloc((size_t)n + 1, sizeof *objects);
  if (!files || !objects) {
    free(files), free(objects);
    return ir_oom(d);
  }
  int nfiles = 0, nobjects = 0;
  for (int i = 0; i < n; i++) files[nfiles++] = stages[i];
  char tests[4096], flags[8192];
  cg_source_file("tests/cuda", tests, sizeof tests);
  snprintf(flags, sizeof flags, "-std=c++20 -O1 -w -I%s", tests);
  bool ok = true;
  for (int i = -1; ok && i < n; i++) {
    char src[4096];
    const char *program = i < 0 ? c_path : stages[i];
    fused_path(src, sizeof src, program, "cpp");
    if (!fake || access(src, R_OK) != 0) continue;
    fused_path(objects[nobjects], sizeof objects[nobjects], program, "o");
    ok = cg_compile_cxx(d, src, objects[nobjects], flags, verbose);
    files[nfiles++] = objects[nobjects++];
    unlink(src);
  }
  extra.sources = files;
  ok = ok && cg_link_program(d, c_path, out_path, &extra, verbose);
  for (int i = 0; i < nobjects; i++) unlink(objects[i]);
  free(files);
  free(objects);
  return ok;
}

static bool cuda_link(IrDiag *d, const char *c_path, const char *out_path, bool verbose) {
  return link_programs(d, c_path, NULL, out_path, verbose);
}

static bool cuda_link_stages(IrDiag *d, const char *c_path, const char *const *sources, const char *out_path,
                             bool verbose) {
  return link_programs(d, c_path, sources, out_path, verbose);
}

const CgTarget cg_target_cuda = {
    .name = "cuda",
    .bf16 = true,
    .shard_optimizer = false,
    .lora = true,
    .takes_arch = true,
    .probe = cg_gpu_probe,
    .available = cuda_available,
    .emit = cuda_emit,
    .link = cuda_link,
    .link_stages = cuda_link_stages,
};
