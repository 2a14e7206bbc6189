// The device of a CUDA target program (codegen/emit_cuda_host.c): what every generated program
// needs from its GPU, written once here instead of printed into each program.
//
// A program describes itself in an RtCudaProgram (its kernels' CUBIN and PTX, the kernels it
// launches, how much device memory it carves and where its parameters, gradients and moments
// lie in it) and its RtDevice hooks (moert.h) forward to the functions below: create claims the
// GPU, loads the kernels and clears the memory, connect makes the NCCL communicators of the
// groups whose collectives cross ranks, upload and download move the trainer's host copies.
// The program then carves the rest of the block itself (its activations, input, staging) at the
// offsets it was compiled with.
//
// Only rt_cuda.h's functions are called, so this file runs over the real GPU runtime and over
// the tests' fake device (tests/cuda/fake_cuda.cpp) alike. Errors are the driver's way: a
// sentence recorded with rt_fail and -1 (NULL), the CUDA error itself already on stderr.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rt_cuda.h"
#include "rt_internal.h"

bool rt_cuda_graphs_wanted(void) {
  const char *v = getenv("MOERT_CUDA_GRAPH");
  return !v || strcmp(v, "0") != 0;
}

// The module to load on device d: the CUBIN on its own architecture (same major version, at
// least its minor), the PTX on a newer one (or on its own, in a program without a CUBIN:
// MOEC_CUDA_IMAGES=ptx), none on an older one.
static const void *choose_image(const RtCudaProgram *p, const RtCudaDevice *d) {
  if (p->cubin && d->arch / 10 == p->cubin_arch / 10 && d->arch >= p->cubin_arch)
    return p->cubin;
  if (d->arch > p->cubin_arch || (!p->cubin && d->arch == p->cubin_arch))
    return p->ptx;
  return NULL;
}

// ---- moec's grouped GEMM on wgmma: checked against mk_expert_gemm_tc at the start ----
// mk_expert_gemm_wg reads shared memory through the tensor cores' descriptors and swizzled
// layouts, which the host builds emulate from the PTX ISA's description; a GPU is the first to
// run the real ones. So before a program hands its expert GEMMs to it, both kernels multiply the
// same operands in the three forms the programs use (blocks 1 over two row tiles and four k steps
// of 64; blocks 2 with tb, an empty block and n 24; a weight gradient over three k steps, an
// expert of none), and it is used only where every element agrees with mk_expert_gemm_tc's to
// 1e-3 of the largest (the sums' order differs; a wrong layout is off by the elements' size).
static bool wg_agrees(RtCuda *cu, size_t keep, CUfunction tc, CUfunction wg, int wn, char *why, size_t why_size) {
  static const int shape[3][6] = {{136, 72, 200, 1, 136, 3}, {48, 24, 136, 2, 0, 24}, {24, 40, 200, 1, 150, 0}};
  static const int more[2] = {17, 5};   // form 1's last two blocks
  uint32_t seed = 12345u;
  for (int form = 0; form < 3; form++) {
    const int *sh = shape[form];
    int e = 2, m = sh[0], n = sh[1], k = sh[2], blocks = sh[3], ta = form == 2, tb = form == 1;
    int groups = ta ? e : e * blocks, counts[4] = {sh[4], sh[5], more[0], more[1]};
    size_t na = (size_t)e * m * k, nb = (size_t)e * k * n, nc = (size_t)e * m * n;
    size_t bytes = (na + nb) * 2 + 2 * nc * sizeof(float) + 2 * (size_t)groups * sizeof(int) + 6 * 256;   // + alignment
    uint16_t *h = malloc((na + nb) * 2);
    float *ct = malloc(nc * sizeof(float)), *cw = malloc(nc * sizeof(float));
    if (!h || !ct || !cw || bytes > RT_CUDA_WG_CHECK_BYTES) {
      free(h), free(ct), free(cw);
      snprintf(why, why_size, "its check at the start could not be set up");
      return false;
    }
    for (size_t i = 0; i < na + nb; i++) {   // bf16 of uniform values in [-1, 1): sign, exponent 126, 7 bits
      seed = seed * 1664525u + 1013904223u;
      h[i] = (uint16_t)(((seed >> 31) << 15) | (126u << 7) | ((seed >> 8) & 0x7fu));
    }
    int cnt[8];
    for (int x = 0; x < groups; x++) cnt[x] = counts[x], cnt[groups + x] = counts[x] > 0 ? counts[x] : 1;
    rt_cuda_arena_reset(cu);
    (void)rt_cuda_alloc(cu, keep);   // the program's block stays where it was
    unsigned char *da = rt_cuda_alloc(cu, na * 2), *db = rt_cuda_alloc(cu, nb * 2);
    float *dt = rt_cuda_alloc(cu, nc * sizeof(float)), *dw = rt_cuda_alloc(cu, nc * sizeof(float));
    int *dr = rt_cuda_alloc(cu, 2 * (size_t)groups * sizeof(int));
    RtStream c = RT_STREAM_COMPUTE;
    bool ok = da && db && dt && dw && dr && rt_cuda_to_device(cu, c, da, h, na * 2) &&
              rt_cuda_to_device(cu, c, db, h + na, nb * 2) &&
              rt_cuda_to_device(cu, c, dr, cnt, 2 * (size_t)groups * sizeof(int)) &&
              rt_cuda_zero(cu, c, dt, nc * sizeof(float)) && rt_cuda_zero(cu, c, dw, nc * sizeof(float)) &&
              rt_cuda_launch_grouped(cu, c, tc, 0, da, db, dt, dr, e, m, n, k, ta, tb, blocks) &&
              rt_cuda_launch_grouped(cu, c, wg, wn, da, db, dw, dr, e, m, n, k, ta, tb, blocks) &&
              rt_cuda_to_host(cu, c, ct, dt, nc * sizeof(float)) && rt_cuda_to_host(cu, c, cw, dw, nc * sizeof(float)) &&
              rt_cuda_sync(cu, c);
    rt_cuda_arena_reset(cu);
    (void)rt_cuda_alloc(cu, keep);
    double big = 0.0;
    size_t bad = nc;
    for (size_t i = 0; ok && i < nc; i++) big = fabs(ct[i]) > big ? fabs(ct[i]) : big;
    for (size_t i = 0; ok && i < nc && bad == nc; i++)
      if (!(fabs((double)cw[i] - ct[i]) <= 1e-3 * big)) bad = i;
    if (!ok)
      snprintf(why, why_size, "its check at the start failed to run (the CUDA error is above)");
    else if (bad < nc)
      snprintf(why, why_size, "it differed from mk_expert_gemm_tc at the start: form %d, element %zu is %.6g, not %.6g",
               form, bad, cw[bad], ct[bad]);
    free(h), free(ct), free(cw);
    if (!ok || bad < nc)
      return false;
  }
  return true;
}

// MOERT_CUDA_WG_N: the wgmma kernel's tile width, 128 (mk_expert_gemm_wg, unset) or 256
// (mk_expert_gemm_wg256); anything else is said on stderr (once: rt_cuda_wg_start reads it once
// per session) and 128 runs.
static int wg_width(void) {
  const char *v = getenv("MOERT_CUDA_WG_N");
  if (!v || !*v || strcmp(v, "128") == 0)
    return 128;
  if (strcmp(v, "256") == 0)
    return 256;
  fprintf(stderr, "moert: MOERT_CUDA_WG_N=%s is neither 128 nor 256: 128 runs\n", v);
  return 128;
}

bool rt_cuda_wg_start(RtCuda *cu, const void *image, CUfunction tc, size_t keep, int *wn, char *why, size_t why_size) {
  const char *env = getenv("MOERT_CUDA_WGMMA");
  int arch = rt_cuda_device(cu)->arch;
  CUfunction wg = NULL;
  *wn = 0;
  if (!image || !tc)
    snprintf(why, why_size, "no wgmma kernel or no mk_expert_gemm_tc to check it against");
  else if (arch != 90)
    snprintf(why, why_size, "wgmma runs on sm_90, not sm_%d", arch);
  else if (env && strcmp(env, "0") == 0)
    snprintf(why, why_size, "MOERT_CUDA_WGMMA=0");
  else if (!(wg = rt_cuda_load_wg(cu, image, *wn = wg_width())))
    snprintf(why, why_size, "its module did not load (the CUDA error is above)");
  else if (!wg_agrees(cu, keep, tc, wg, *wn, why, why_size))
    wg = NULL;
  rt_cuda_use_wg(cu, wg, wg ? *wn : 0);
  return wg != NULL;
}

static int setup(RtCudaSession *s) {
  const RtCudaProgram *p = s->program;
  char why[512];
  if (!rt_cuda_probe(why, sizeof why))
    return rt_fail("no GPU: %s. This binary was built by 'moec build --target cuda'; build the "
                   "model with --target cpu to train on the CPU", why);
  if (!(s->cu = rt_cuda_create(p->device_bytes + (p->wg_cubin ? RT_CUDA_WG_CHECK_BYTES : 0), p->events)))
    return rt_fail("the GPU could not be set up with %zu bytes of device memory (the CUDA error "
                   "is above)", p->device_bytes);
  const RtCudaDevice *d = rt_cuda_device(s->cu);
  const void *image = choose_image(p, d);
  if (!image)
    return rt_fail("the kernels were compiled for sm_%d and need a GPU of that architecture or "
                   "newer; %s is sm_%d (build with --gpu-arch sm_%d)", p->cubin_arch, d->name,
                   d->arch, d->arch);
  snprintf(s->description, sizeof s->description, "%s (sm_%d), kernels from the %s, %.1f MiB of device memory in one "
           "block%s", d->name, d->arch, image == p->cubin ? "CUBIN" : "PTX, compiled by the driver",
           (double)p->device_bytes / (1 << 20), p->note ? p->note : "");
  if (!rt_cuda_load_module(s->cu, image))
    return rt_fail("the kernels could not be loaded on %s (the CUDA error is above)", d->name);
  for (int k = 0; k < p->nkernels; k++)
    if (!(s->kernels[k] = rt_cuda_kernel(s->cu, p->kernel_names[k])))
      return rt_fail("the kernel module has no kernel '%s' (reported above)", p->kernel_names[k]);
  if (!(s->device = rt_cuda_alloc(s->cu, p->device_bytes)))
    return rt_fail("the device memory could not be carved (reported above)");
  if (p->row_gemms > 0) {   // which GEMM multiplies the expert GEMMs' filled rows
    char why[256], wg_why[256] = "";
    size_t len = strlen(s->description);
    CUfunction tc = NULL;   // a dtype bf16 program hands rt_cuda_expert_gemm_rows moec's grouped GEMM
    for (int k = 0; k < p->nkernels; k++)
      if (strcmp(p->kernel_names[k], "mk_expert_gemm_tc") == 0) tc = s->kernels[k];
    RtRowsGemm path = rt_cuda_rows_gemm(s->cu, tc != NULL, why, sizeof why);
    int wn = 0;
    bool wg = false;
    if (path == RT_ROWS_MOEC && !p->wg_cubin)
      snprintf(wg_why, sizeof wg_why, "the program has no wgmma kernel (built for sm_%d)", p->cubin_arch);
    else if (path == RT_ROWS_MOEC)
      wg = rt_cuda_wg_start(s->cu, p->wg_cubin, tc, p->device_bytes, &wn, wg_why, sizeof wg_why);
    if (path == RT_ROWS_CUBLASLT)
      snprintf(s->description + len, sizeof s->description - len, "; %d expert GEMMs a step over their filled rows (%s)",
               p->row_gemms, why[0] ? why : "cuBLASLt's grouped GEMM");
    else if (path == RT_ROWS_MOEC)
      snprintf(s->description + len, sizeof s->description - len, "; %d expert GEMMs a step over their filled rows "
               "(moec's grouped GEMM on tensor cores, %s%s%s; not cuBLASLt's: %s)", p->row_gemms,
               !wg ? "mma.sync" : wn == 256 ? "wgmma on 128 x 256 tiles" : "wgmma", wg ? "" : ", not wgmma: ", wg_why, why);
    else
      snprintf(s->description + len, sizeof s->description - len, "; %d expert GEMMs a step over their filled rows "
               "padded (%s)", p->row_gemms, why);
  }
  // Gradients and activations start at zero, as the CPU program's do.
  if (!rt_cuda_zero(s->cu, RT_STREAM_COMPUTE, s->device, p->device_bytes) ||
      !rt_cuda_sync(s->cu, RT_STREAM_COMPUTE))
    return rt_fail("the device memory could not be cleared (the CUDA error is above)");
  return 0;
}

RtCudaSession *rt_cuda_session_create(const RtCudaProgram *p) {
  RtCudaSession *s = rt_calloc(1, sizeof *s, "the GPU session");
  s->program = p;
  s->kernels = rt_calloc((size_t)p->nkernels + 1, sizeof *s->kernels, "the kernel table");
  s->stage = rt_alloc(p->stage_bytes, "the host copy of the statistics staging area");
  s->output = rt_alloc(p->output_floats * sizeof(float), "the host copy of the model's output");
  if (setup(s) == 0)
    return s;
  rt_cuda_session_destroy(s);
  return NULL;
}

void rt_cuda_session_destroy(RtCudaSession *s) {
  if (!s)
    return;
  for (int g = 0; g < RT_GROUP_COUNT; g++)
    rt_cuda_nccl_destroy(s->nccl[g]);
  for (int i = 0; i < s->npinned; i++)
    rt_cuda_unpin(s->cu, s->pinned[i]);
  if (s->cu)
    rt_cuda_destroy(s->cu);
  for (int i = 0; i < s->nowned; i++)
    free(s->owned[i]);
  free(s->kernels);
  free(s->stage);
  free(s->output);
  free(s);
}

int rt_cuda_session_connect(RtCudaSession *s, RtComm *comm) {
  static const char *const group_names[RT_GROUP_COUNT] = {"world", "dp", "mp", "ep", "esp"};
  for (int g = 0; g < RT_GROUP_COUNT; g++)
    if (s->program->nccl[g] && !(s->nccl[g] = rt_cuda_nccl_group(comm, (RtGroup)g)))
      return rt_fail("the NCCL communicator of the %s group could not be set up (the error is "
                     "above)", group_names[g]);
  return 0;
}

// Copies the trainer's host buffers of what (RtDeviceData bits: parameters, gradients, moments)
// to their places in the device block (to_device) or back, queued on the compute stream.
static bool move(RtCudaSession *s, const RtStep *st, unsigned what, bool to_device) {
  const RtCudaProgram *p = s->program;
  float *host[4];
  unsigned char *device[4];
  int n = 0;
  if (what & RT_DEVICE_PARAMS) {
    host[n] = st->params;
    device[n++] = s->device;
  }
  if (what & RT_DEVICE_GRADS) {
    host[n] = st->grads;
    device[n++] = s->device + p->off_grads;
  }
  if ((what & RT_DEVICE_MOMENTS) && p->moments) {
    host[n] = st->opt_m;
    device[n++] = s->device + p->off_m;
    host[n] = st->opt_v;
    device[n++] = s->device + p->off_v;
  }
  bool ok = true;
  for (int i = 0; ok && i < n; i++) {
    size_t bytes = (host[i] == st->params ? p->param_floats : p->grad_floats) * sizeof(float);
    ok = to_device ? rt_cuda_to_device(s->cu, RT_STREAM_COMPUTE, device[i], host[i], bytes)
                   : rt_cuda_to_host(s->cu, RT_STREAM_COMPUTE, host[i], device[i], bytes);
  }
  return ok;
}

// Page-locks host (of bytes) unless it is already, while there is room in the list.
static void pin(RtCudaSession *s, void *host, size_t bytes) {
  if (!host || s->npinned == RT_CUDA_PINNED_MAX)
    return;
  for (int i = 0; i < s->npinned; i++)
    if (s->pinned[i] == host)
      return;
  if (rt_cuda_pin(s->cu, host, bytes))
    s->pinned[s->npinned++] = host;
}

// The input and target go to the GPU every step (128 MB at bench/gpu_predict.sh's largest shape):
// page-locked, they copy at the bus's speed instead of through the driver's staging.
void rt_cuda_session_pin_data(RtCudaSession *s, const RtStep *st) {
  pin(s, (void *)st->input, s->program->input_bytes);
  pin(s, (void *)st->target, s->program->input_bytes);
}

float *rt_cuda_session_host_buffer(RtCudaSession *s, size_t bytes) {
  size_t whole = (bytes + 4095) & ~(size_t)4095;   // whole pages of its own (rt_cuda_pin)
  if (s->nowned == RT_CUDA_PINNED_MAX)
    rt_comm_abort("internal error: more than %d host buffers of the GPU session", RT_CUDA_PINNED_MAX);
  void *p = aligned_alloc(4096, whole ? whole : 4096);
  if (!p)
    rt_out_of_memory(whole, "a pipeline stage's messages");
  memset(p, 0, whole);
  s->owned[s->nowned++] = p;
  pin(s, p, whole);
  return p;
}

int rt_cuda_session_grads_part(RtCudaSession *s, RtStep *st, size_t offset, int64_t n, bool to_device) {
  float *host = st->grads + offset;
  void *device = s->device + s->program->off_grads + offset * sizeof(float);
  size_t bytes = (size_t)n * sizeof(float);
  bool ok = (to_device ? rt_cuda_to_device(s->cu, RT_STREAM_COMPUTE, device, host, bytes)
                       : rt_cuda_to_host(s->cu, RT_STREAM_COMPUTE, host, device, bytes)) &&
            rt_cuda_sync(s->cu, RT_STREAM_COMPUTE);
  return ok ? 0 : rt_fail("copying a part of the gradients %s the GPU failed (the CUDA error is above)",
                          to_device ? "to" : "from");
}

int rt_cuda_session_upload(RtCudaSession *s, const RtStep *st, unsigned what) {
  rt_cuda_session_pin_data(s, st);
  bool ok = move(s, st, what, true) && rt_cuda_sync(s->cu, RT_STREAM_COMPUTE);
  return ok ? 0 : rt_fail("copying the parameters or optimizer state to the GPU failed (the CUDA "
                          "error is above)");
}

int rt_cuda_session_download(RtCudaSession *s, RtStep *st, unsigned what) {
  bool ok = move(s, st, what, false);
  if ((what & RT_DEVICE_OUTPUT) && s->device_output)
    ok = ok && rt_cuda_to_host(s->cu, RT_STREAM_COMPUTE, s->output, s->device_output,
                               s->program->output_floats * sizeof(float));
  ok = ok && rt_cuda_sync(s->cu, RT_STREAM_COMPUTE);
  return ok ? 0 : rt_fail("copying results from the GPU failed (the CUDA error is above)");
}
