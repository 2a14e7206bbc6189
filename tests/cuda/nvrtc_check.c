// nvrtc_check F.cu|--library [ARCH...]: compiles a CUDA unit written by `moec build --emit cuda` with
// NVRTC for each architecture (default sm_80 sm_90), CUBIN and PTX, and prints one line per
// architecture: "ARCH: N kernels, CUBIN B bytes, PTX P bytes". N counts the kernel entry points
// of the PTX (`.entry`), so it is what NVRTC compiled, not what the source says. --library
// compiles every kernel the emitter has (cg_emit_cuda_library) instead of a file;
// --print-library prints that source, --print-kernel-list its kernels (cg_emit_cuda_kernel_list);
// --check-signatures compares runtime/kernels.def's parameter types with the declarations in
// codegen/cuda/*.cu (the host program packs launch arguments by the former).
// Exit status 1 on any failure, with NVRTC's log on stderr.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codegen/cg.h"
#include "codegen/cg_internal.h"

static char *read_all(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap);
  size_t got;
  while (buf && (got = fread(buf + n, 1, cap - n - 1, f)) > 0) {
    n += got;
    if (n + 1 == cap) {
      char *b = realloc(buf, cap *= 2);
      if (!b) free(buf);
      buf = b;
    }
  }
  fclose(f);
  if (buf) buf[n] = 0;
  return buf;
}

static int count_entries(const char *ptx) {
  int n = 0;
  for (const char *p = ptx; (p = strstr(p, ".entry ")); p += 7) n++;
  return n;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: nvrtc_check F.cu|--library|--wg [sm_80 sm_90 sm_90a ...]\n");
    return 2;
  }
  if (strcmp(argv[1], "--print-library") == 0) {  // the source, for tests/cuda/emu_check.cpp
    cg_emit_cuda_library(stdout);
    return 0;
  }
  if (strcmp(argv[1], "--check-signatures") == 0) {
    int bad = cg_cuda_check_signatures(stderr);
    printf("%d kernels, %d signatures differ\n", cg_cuda_kernel_count(NULL), bad);
    return bad != 0;
  }
  if (strcmp(argv[1], "--print-kernel-list") == 0) {  // MK_KERNEL(name, syncs), for tests/cuda/fake_cuda.cpp
    cg_emit_cuda_kernel_list(stdout);
    return 0;
  }
  char *src = NULL;
  if (strcmp(argv[1], "--print-wg") == 0) {   // mk_expert_gemm_wg's unit (ptxas's report: tests/cuda/run.sh)
    cg_emit_cuda_wg(stdout);
    return 0;
  }
  if (strcmp(argv[1], "--library") == 0 || strcmp(argv[1], "--wg") == 0) {
    size_t n = 0;
    FILE *mem = open_memstream(&src, &n);
    if (mem) {
      if (strcmp(argv[1], "--wg") == 0) cg_emit_cuda_wg(mem);
      else cg_emit_cuda_library(mem);
      fclose(mem);
    }
  } else {
    src = read_all(argv[1]);
  }
  if (!src) {
    fprintf(stderr, "nvrtc_check: error: cannot read '%s'\n", argv[1]);
    return 1;
  }
  static const char *const dflt[] = {"sm_80", "sm_90"};
  const char *const *archs = argc > 2 ? (const char *const *)argv + 2 : dflt;
  int narch = argc > 2 ? argc - 2 : 2, status = 0;
  IrDiag d;
  ir_diag_init(&d, stderr);
  for (int i = 0; i < narch; i++) {
    void *cubin = NULL;
    char *ptx = NULL;
    size_t cubin_size = 0, ptx_size = 0;
    bool cached = false;
    if (cg_nvrtc_images_cached(&d, src, archs[i], &cubin, &cubin_size, &ptx, &ptx_size, &cached) &&
        cubin_size > 0) {
      printf("%s: %d kernels, CUBIN %zu bytes, PTX %zu bytes%s\n", archs[i], count_entries(ptx), cubin_size, ptx_size,
             cached ? " (from the build cache)" : "");
    } else {
      fprintf(stderr, "nvrtc_check: %s: %s failed\n", argv[1], archs[i]);
      status = 1;
    }
    free(cubin);
    free(ptx);
  }
  free(src);
  return status;
}
