// The toolchain of codegen/ (beside layer 1): it calls only cache.c; the CUDA target calls it.
//
// NVRTC driver of the CUDA target: CUDA C (codegen/emit_cuda.c) -> CUBIN for one architecture,
// and PTX of the matching virtual architecture for GPUs newer than the ones compiled for.
// Built only where the CUDA toolkit is found (the Makefile leaves it out otherwise); links
// libnvrtc. Options: exact IEEE float (no fast math), so that the kernels match the CPU ones.
#include <nvrtc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cg.h"

// NVRTC_CHECK: an NVRTC call that fails reports where, what and the program log (when there
// is a program), and makes the enclosing function fail.
#define NVRTC_CHECK(d, prog, call)                                                                   \
  do {                                                                                               \
    nvrtcResult rc_ = (call);                                                                        \
    if (rc_ != NVRTC_SUCCESS) {                                                                      \
      nvrtc_fail((d), (prog), rc_, #call, __FILE__, __LINE__);                                       \
      goto fail;                                                                                     \
    }                                                                                                \
  } while (0)

static void nvrtc_fail(IrDiag *d, nvrtcProgram prog, nvrtcResult rc, const char *call, const char *file, int line) {
  char *log = NULL;
  size_t n = 0;
  if (prog && nvrtcGetProgramLogSize(prog, &n) == NVRTC_SUCCESS && n > 1 && (log = malloc(n)) &&
      nvrtcGetProgramLog(prog, log) != NVRTC_SUCCESS) {
    free(log);
    log = NULL;
  }
  ir_error(d, "NVRTC: %s failed (%s) at %s:%d%s%s", call, nvrtcGetErrorString(rc), file, line,
           log ? "; program log:\n" : "", log ? log : "");
  free(log);
}

// "sm_80" -> 80; 0 when arch is not sm_NN or sm_NNa (the architecture-specific target of sm_NN:
// its own instructions, wgmma on sm_90a; *specific set then).
static int arch_number(const char *arch, bool *specific) {
  *specific = false;
  if (!arch || strncmp(arch, "sm_", 3) != 0 || !arch[3]) return 0;
  char *end;
  long v = strtol(arch + 3, &end, 10);
  if (*end == 'a' && !end[1]) *specific = true, end++;
  return *end || v < 10 || v > 999 ? 0 : (int)v;
}

// The options besides -arch.
static const char *const options[] = {"-std=c++17", "-default-device", "--fmad=false", "--ftz=false", "--prec-div=true",
                                      "--prec-sqrt=true"};

// cg_nvrtc_fast: NVRTC's --Ofast-compile=max (NVRTC 12.8 and newer) after them.
static bool fast_compile;
static const char *const fast_option = "--Ofast-compile=max";

void cg_nvrtc_fast(bool on) {
  int major = 0, minor = 0;
  nvrtcVersion(&major, &minor);
  fast_compile = on && (major > 12 || (major == 12 && minor >= 8));
}

static void signature(char *buf, size_t size) {
  int major = 0, minor = 0;
  nvrtcVersion(&major, &minor);
  size_t u = (size_t)snprintf(buf, size, "nvrtc %d.%d", major, minor);
  for (size_t i = 0; i < sizeof options / sizeof options[0] && u < size; i++)
    u += (size_t)snprintf(buf + u, size - u, " %s", options[i]);
  if (fast_compile && u < size) snprintf(buf + u, size - u, " %s", fast_option);
}

// Compiles src for -arch=<virtual ? compute_NN : sm_NN>; returns the program (NULL on error).
static nvrtcProgram compile(IrDiag *d, const char *src, const char *arch, bool virtual_arch) {
  bool specific;
  int num = arch_number(arch, &specific);
  if (!num) {
    ir_error(d, "unknown GPU architecture '%s' (expected sm_80, sm_90, ...)", arch ? arch : "(null)");
    return NULL;
  }
  char opt_arch[32];
  snprintf(opt_arch, sizeof opt_arch, "-arch=%s_%d%s", virtual_arch ? "compute" : "sm", num, specific ? "a" : "");
  const char *opts[2 + sizeof options / sizeof options[0]] = {opt_arch};
  memcpy(opts + 1, options, sizeof options);
  int nopts = 1 + (int)(sizeof options / sizeof options[0]);
  if (fast_compile) opts[nopts++] = fast_option;
  nvrtcProgram prog = NULL;
  NVRTC_CHECK(d, NULL, nvrtcCreateProgram(&prog, src, "moec_kernels.cu", 0, NULL, NULL));
  NVRTC_CHECK(d, prog, nvrtcCompileProgram(prog, nopts, opts));
  return prog;
fail:
  if (prog) nvrtcDestroyProgram(&prog);
  return NULL;
}

// Compiles src and copies out the image: CUBIN for sm_NN (virtual_arch false) or PTX for
// compute_NN (true). The buffer is malloc'd.
static bool compile_image(IrDiag *d, const char *src, const char *arch, bool virtual_arch, char **out,
                          size_t *size) {
  *out = NULL;
  *size = 0;
  nvrtcProgram prog = compile(d, src, arch, virtual_arch);
  if (!prog) return false;
  size_t n = 0;
  char *buf = NULL;
  NVRTC_CHECK(d, prog, virtual_arch ? nvrtcGetPTXSize(prog, &n) : nvrtcGetCUBINSize(prog, &n));
  if (!(buf = malloc(n ? n : 1))) {
    ir_error(d, "out of memory for %zu bytes of %s", n, virtual_arch ? "PTX" : "CUBIN");
    goto fail;
  }
  NVRTC_CHECK(d, prog, virtual_arch ? nvrtcGetPTX(prog, buf) : nvrtcGetCUBIN(prog, buf));
  nvrtcDestroyProgram(&prog);
  *out = buf;
  *size = n;
  return true;
fail:
  free(buf);
  nvrtcDestroyProgram(&prog);
  return false;
}

bool cg_nvrtc_compile(IrDiag *d, const char *src, const char *arch, void **cubin, size_t *size) {
  char *buf = NULL;
  bool ok = compile_image(d, src, arch, false, &buf, size);
  *cubin = buf;
  return ok;
}

bool cg_nvrtc_ptx(IrDiag *d, const char *src, const char *arch, char **ptx, size_t *size) {
  return compile_image(d, src, arch, true, ptx, size);
}

// Both images from one compilation for sm_NN: NVRTC keeps the PTX it generated on the way to the
// CUBIN, the same text a compilation for compute_NN gives (compared on every model's unit), so the
// source goes through NVRTC once instead of twice.
bool cg_nvrtc_images(IrDiag *d, const char *src, const char *arch, void **cubin, size_t *cubin_size, char **ptx,
                     size_t *ptx_size) {
  *cubin = NULL, *ptx = NULL;
  *cubin_size = *ptx_size = 0;
  nvrtcProgram prog = compile(d, src, arch, false);
  if (!prog) return false;
  char *c = NULL, *p = NULL;
  size_t nc = 0, np = 0;
  NVRTC_CHECK(d, prog, nvrtcGetCUBINSize(prog, &nc));
  NVRTC_CHECK(d, prog, nvrtcGetPTXSize(prog, &np));
  if (!(c = malloc(nc ? nc : 1)) || !(p = malloc(np ? np : 1))) {
    ir_error(d, "out of memory for %zu bytes of CUBIN and %zu of PTX", nc, np);
    goto fail;
  }
  NVRTC_CHECK(d, prog, nvrtcGetCUBIN(prog, c));
  NVRTC_CHECK(d, prog, nvrtcGetPTX(prog, p));
  nvrtcDestroyProgram(&prog);
  *cubin = c, *ptx = p;
  *cubin_size = nc, *ptx_size = np;
  return true;
fail:
  free(c);
  free(p);
  nvrtcDestroyProgram(&prog);
  return false;
}

// The build cache's key of src's images for arch, of one kind (tag), with NVRTC's version and options.
static CgCacheKey images_key(const char *tag, const char *arch, const char *src) {
  char sig[512];
  signature(sig, sizeof sig);
  const char *parts[] = {tag, sig, arch, src};
  size_t sizes[] = {strlen(tag), strlen(sig), strlen(arch), strlen(src)};
  return cg_cache_key(4, parts, sizes);
}

// The PTX of key from the cache: NUL-terminated text, else none (false).
static bool cached_ptx(const CgCacheKey *key, char **ptx, size_t *size) {
  void *p = NULL;
  size_t n = 0;
  if (cg_cache_get(key, "ptx", &p, &n) && n > 0 && ((const char *)p)[n - 1] == '\0') {
    *ptx = p, *size = n;
    return true;
  }
  free(p);
  return false;
}

bool cg_nvrtc_images_cached(IrDiag *d, const char *src, const char *arch, void **cubin, size_t *cubin_size, char **ptx,
                            size_t *ptx_size, bool *cached) {
  CgCacheKey key = images_key("moec nvrtc images 1", arch, src);
  void *c = NULL;
  size_t nc = 0;
  *cached = cg_cache_get(&key, "cubin", &c, &nc) && cached_ptx(&key, ptx, ptx_size);
  if (*cached) {
    *cubin = c, *cubin_size = nc;
    return true;
  }
  free(c);
  if (!cg_nvrtc_images(d, src, arch, cubin, cubin_size, ptx, ptx_size)) return false;
  cg_cache_put(&key, "cubin", *cubin, *cubin_size);
  cg_cache_put(&key, "ptx", *ptx, *ptx_size);
  return true;
}

bool cg_nvrtc_ptx_cached(IrDiag *d, const char *src, const char *arch, char **ptx, size_t *ptx_size, bool *cached) {
  // The PTX of a compilation for both images is the one compute_NN gives (cg_nvrtc_images): either
  // entry serves.
  CgCacheKey both = images_key("moec nvrtc images 1", arch, src), alone = images_key("moec nvrtc ptx 1", arch, src);
  *cached = cached_ptx(&both, ptx, ptx_size) || cached_ptx(&alone, ptx, ptx_size);
  if (*cached) return true;
  if (!cg_nvrtc_ptx(d, src, arch, ptx, ptx_size)) return false;
  cg_cache_put(&alone, "ptx", *ptx, *ptx_size);
  return true;
}

bool cg_nvrtc_wg_cubin(IrDiag *d, bool cache, void **cubin, size_t *size, bool *cached) {
  char *src = NULL, *ptx = NULL;
  size_t n = 0, ptx_size = 0;
  FILE *f = open_memstream(&src, &n);
  if (!f) return ir_oom(d);
  cg_emit_cuda_wg(f);
  if (fclose(f) != 0) {
    free(src);
    return ir_oom(d);
  }
  *cached = false;
  bool ok = cache ? cg_nvrtc_images_cached(d, src, "sm_90a", cubin, size, &ptx, &ptx_size, cached)
                  : cg_nvrtc_compile(d, src, "sm_90a", cubin, size);
  free(src);
  free(ptx);   // compute_90a's PTX, which no GPU but an sm_90 runs: the CUBIN serves it
  return ok;
}
