// Code generation: the scheduled, memory-planned IR module -> a C host program for the
// training step, linked with libmoert into the model binary.
#ifndef CG_H
#define CG_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "../ir/ir.h"
#include "../passes/pass.h"

// Writes the C program of module m (plan from the memplan pass) to out. source_name goes into
// the header comment. False (with a diagnostic) on an op the CPU target cannot emit.
typedef struct CgEmitOptions CgEmitOptions;
bool cg_emit_c(IrDiag *d, FILE *out, const IrModule *m, const PassMemPlan *plan, const CgEmitOptions *o);
// A model of several pipeline stages is one C file per stage (cg_emit_c of each stage's module,
// which then exports `moec_stage_S` instead of a main) and this main, which runs a rank's stage.
void cg_emit_stages_main(FILE *out, const char *model_name, int stages);

// The CUDA target's lowering of module m (codegen/lower.c): every op's launches, the fused
// groups' generated kernels. One per build, read by each CUDA emitter below. NULL (reported on d)
// when an op cannot be emitted or memory runs out; cg_launches_free releases it.
typedef struct CgLaunches CgLaunches;
CgLaunches *cg_cuda_launches(IrDiag *d, const IrModule *m);
void cg_launches_free(CgLaunches *ls);
// How many kernels the lowering generated for fused groups (passes/fuse.c, codegen/fused.c).
int cg_cuda_generated_kernels(const CgLaunches *ls);
// Writes the CUDA C translation unit of module m's device kernels (codegen/emit_cuda.c): one
// extern "C" __global__ kernel `mk_<op>` per op kind the module uses other than GEMMs (cuBLAS)
// and collectives (NCCL), fused gate kernels for the fuse pass's gate groups, the fused groups'
// generated kernels, no host code and no #include, ready for NVRTC.
bool cg_emit_cuda(IrDiag *d, FILE *out, const IrModule *m, const CgLaunches *ls);
// The fused groups' kernels of m as host C++ for the fake device of the tests
// (tests/cuda/fused_host.h): the prelude, the kernels and their table.
bool cg_emit_cuda_fused_host(IrDiag *d, FILE *out, const IrModule *m, const CgLaunches *ls);
// The same prelude with every kernel the CUDA target has (the test of the whole library).
void cg_emit_cuda_library(FILE *out);
// The unit of the wgmma kernels alone (the prelude, mk_expert_gemm_wg and _wg256), the same for
// every program: compiled for sm_90a apart from a program's other kernels (wgmma has no portable
// form; cg_nvrtc_wg_cubin).
void cg_emit_cuda_wg(FILE *out);
// One line per kernel of the library, `MK_KERNEL(name, syncs)`: syncs is 1 when the kernel
// calls __syncthreads (directly or through a prelude function), for the host emulation of the
// fake device (tests/cuda/fake_cuda.cpp), which runs the threads of other kernels one by one.
void cg_emit_cuda_kernel_list(FILE *out);
// The grid of the column-sum kernels (mk_bias_grad, mk_expert_bias_grad, mk_scale_cols_grad_w):
// one block per tile of columns of each of `blocks` blocks of rows `cols` wide, the tiles 32
// columns wide when there are at least 1024 of them, else 8 (the kernels' mk_colsum_width).
int64_t cg_cuda_column_tiles(int64_t blocks, int64_t cols);
// mk_expert_counts' parts (its last argument): the rows of a block of slots `width` elements wide
// that one block of the grid reads, about 32768 elements (at least a row).
int64_t cg_rows_part(int64_t width);

// The kernels of cg_emit_cuda compiled by NVRTC, for the CUDA host program to embed.
typedef struct CgCudaImages {
  const char *arch;          // "sm_90": the CUBIN's architecture (the PTX is of compute_90)
  const void *cubin;
  size_t cubin_size;
  const char *ptx;           // NUL-terminated text
  size_t ptx_size;
  bool cached;               // both read from the build cache (codegen/cache.c), not compiled
  const void *wg_cubin;      // mk_expert_gemm_wg's unit (cg_emit_cuda_wg) for sm_90a; NULL: none
  size_t wg_cubin_size;
} CgCudaImages;

// Writes the CUDA target's host program of module m (codegen/emit_cuda_host.c): the training
// step as calls into runtime/cuda (kernel launches of cg_emit_cuda's unit, cuBLAS GEMMs, NCCL
// collectives on the scheduled streams) with the images embedded, linked with libmoert_cuda
// and libmoert into a binary that trains on one GPU per rank; ls is the lowering the images were
// compiled from. False (with a diagnostic) on an op it cannot emit.
bool cg_emit_cuda_host(IrDiag *d, FILE *out, const IrModule *m, const PassMemPlan *plan, const CgEmitOptions *o,
                       const CgCudaImages *images, const CgLaunches *ls);

// NVRTC (codegen/nvrtc.c, built only where the CUDA toolkit is found). arch is "sm_80", "sm_90"
// (any "sm_NN"): the CUBIN for that architecture, and the PTX of compute_NN that newer GPUs
// JIT-compile. Results are malloc'd; false with a diagnostic holding NVRTC's program log.
bool cg_nvrtc_compile(IrDiag *d, const char *src, const char *arch, void **cubin, size_t *size);
bool cg_nvrtc_ptx(IrDiag *d, const char *src, const char *arch, char **ptx, size_t *size);
// The test hook's builds (MOEC_CUDA_FAKE=1: the fake device runs the kernels as host C++, never
// these images) compile with NVRTC's --Ofast-compile=max where NVRTC has it (12.8 and newer): the
// same checks of the source, a fraction of the time; the build cache keeps them apart.
void cg_nvrtc_fast(bool on);
// Both from one compilation (what moec build embeds): the CUBIN for arch and its PTX.
bool cg_nvrtc_images(IrDiag *d, const char *src, const char *arch, void **cubin, size_t *cubin_size, char **ptx,
                     size_t *ptx_size);
// cg_nvrtc_images through the build cache (cg_cache_get / put below), keyed by NVRTC's version
// and options, the architecture and the source; *cached: the images came from it.
bool cg_nvrtc_images_cached(IrDiag *d, const char *src, const char *arch, void **cubin, size_t *cubin_size, char **ptx,
                            size_t *ptx_size, bool *cached);
// The PTX alone through the build cache (MOEC_CUDA_IMAGES=ptx), from an entry of either.
bool cg_nvrtc_ptx_cached(IrDiag *d, const char *src, const char *arch, char **ptx, size_t *ptx_size, bool *cached);
// moec's grouped GEMM on wgmma (cg_emit_cuda_wg's unit) as a CUBIN for sm_90a (malloc'd): through
// the build cache where cache is set (*cached: from it), else compiled anew (the GPU checks, which
// test NVRTC itself). What a program embeds and moec tune --target cuda loads.
bool cg_nvrtc_wg_cubin(IrDiag *d, bool cache, void **cubin, size_t *size, bool *cached);

// ---- targets ----
// A target is a struct of what a build needs from it, chosen by --target NAME (moec's table in
// cli/build.c lists them; adding a target is its struct, its files and one line there). The
// manual's "Adding a target" walks through it.

// What a build hands the target's emitter.
struct CgEmitOptions {
  const char *source_name;   // the .moe file, for the program's header comment
  const char *arch;          // the device architecture to compile kernels for ("sm_90"), or NULL
  bool verbose;              // moec build -v: say what was compiled
  // The program's Hugging Face family (frontend/hf.c): the config.json its --export-hf writes,
  // or NULL and the sentence its --export-hf refuses with (RtModel.hf_config, .hf_refusal).
  const char *hf_config, *hf_refusal;
  // Its generation_config.json (NULL: none) and the imported config's values the model replaced
  // (RtModel.hf_generation, .hf_changes; NULL: none).
  const char *hf_generation, *hf_changes;
  const char *hf_adapter;   // a LoRA model's adapter_config.json (RtModel.hf_adapter; NULL: none)
  // How the layout was chosen (`parallel auto;`, --layout; RtModel.layout_note), NULL: written.
  const char *layout_note;
  // The path the program is written to (NULL: not a file of a build). The CUDA target's test hook
  // MOEC_CUDA_FAKE=1 writes the fused kernels as host C++ beside it (PATH.fused.cpp), which its
  // link step compiles into the program (tests/cuda/fake_cuda.cpp runs them).
  const char *program_path;
};

typedef struct CgTarget {
  const char *name;          // --target NAME
  bool bf16;                 // trains `dtype bf16` (else the front end refuses it)
  bool shard_optimizer;      // `optimizer adamw { shard true; }` (else the front end refuses it)
  bool lora;                 // `lora { ... }`: frozen parameters (else the front end refuses it)
  bool takes_arch;           // compiles kernels for a device architecture (--gpu-arch)
  // For --target auto: whether the target's device is visible here, with a description (or why
  // not) and its architecture ("" when unknown). NULL: the target has no device to look for.
  bool (*probe)(char *why, size_t size, char *arch, size_t arch_size);
  // Whether this moec can build programs for the target (false: it was built without what the
  // target needs, said in why).
  bool (*available)(char *why, size_t size);
  // Writes the program of module m (memory plan from the memplan pass) to out.
  bool (*emit)(IrDiag *d, FILE *out, const IrModule *m, const PassMemPlan *plan, const CgEmitOptions *o);
  // Compiles and links the program at c_path into the executable out_path.
  bool (*link)(IrDiag *d, const char *c_path, const char *out_path, bool verbose);
  // A model of several pipeline stages: the main at c_path (cg_emit_stages_main) and the stages'
  // programs that emit wrote (sources, NULL-terminated) linked into out_path. NULL: nothing
  // beyond libmoert (cg_link_program with the sources).
  bool (*link_stages)(IrDiag *d, const char *c_path, const char *const *sources, const char *out_path, bool verbose);
} CgTarget;

// The CPU target (codegen/target_cpu.c): C kernels of libmoert, OpenBLAS, MPI.
extern const CgTarget cg_target_cpu;
// The CUDA target (codegen/target_cuda.c, linked into moec only: it compiles the kernels with
// NVRTC where moec was built with it): one GPU per rank, cuBLAS, NCCL.
extern const CgTarget cg_target_cuda;

// The flags programs are compiled and linked with (the configuration make built moec with),
// one `key value` line each: root, build, mpi_cflags, mpi_libs, cuda_cflags, cuda_libs.
void cg_link_configuration(FILE *out);

// What a target links beyond libmoert, OpenBLAS, cJSON and MPI: compiler flags, a library file
// before libmoert (checked to exist; how says how to get it) and link flags after the others.
typedef struct CgLinkExtra {
  const char *cflags;
  char library[4096];
  const char *how;
  const char *libs;
  char object[4096];   // an object file linked before the library ("" none)
  const char *const *sources;   // more C files compiled into the program (NULL-terminated; NULL none)
} CgLinkExtra;
// Compiles and links the C file at c_path into the executable out_path with the system C
// compiler ($CC, default cc) and libmoert (from MOEC_ROOT's build/ when set, else the build this
// moec came from), plus extra (NULL: nothing). The compiler's output goes to stderr; false with a
// diagnostic when it fails or a library is missing.
bool cg_link_program(IrDiag *d, const char *c_path, const char *out_path, const CgLinkExtra *extra, bool verbose);
// Compiles the C++ file src into the object obj with the system C++ compiler ($CXX, default c++)
// and flags; false with a diagnostic when it fails.
bool cg_compile_cxx(IrDiag *d, const char *src, const char *obj, const char *flags, bool verbose);
// The path of a file of the build moec came from (or of MOEC_ROOT's build/): "libmoert.a"; and
// of the source tree ("runtime/cuda").
void cg_build_file(const char *name, char *path, size_t size);
// The build cache (codegen/cache.c): files named by a hash of the parts a result depends on,
// under MOEC_CACHE ("off" or "0": none), else $XDG_CACHE_HOME/moec, else $HOME/.cache/moec.
// cg_cache_get gives a malloc'd copy (false when absent or unreadable); cg_cache_put writes one
// whole or not at all, and ignores a cache it cannot write.
typedef struct CgCacheKey {
  char hex[33];
} CgCacheKey;
CgCacheKey cg_cache_key(int n, const char *const *parts, const size_t *sizes);
// The same key made piece by piece (a part's length and bytes a call).
typedef struct CgCacheHash {
  uint64_t h[2];
} CgCacheHash;
CgCacheHash cg_cache_hash_begin(void);
void cg_cache_hash_add(CgCacheHash *h, const void *data, size_t size);
CgCacheKey cg_cache_hash_end(const CgCacheHash *h);
bool cg_cache_get(const CgCacheKey *k, const char *ext, void **data, size_t *size);
void cg_cache_put(const CgCacheKey *k, const char *ext, const void *data, size_t size);
// Removes the least recently used entries of kind ext (read or written last longest ago) while
// they take more than three quarters of most bytes, once they take more than most.
void cg_cache_prune(const char *ext, size_t most);
void cg_source_file(const char *name, char *path, size_t size);
// The flags make found (empty where it found no CUDA toolkit, or no cuBLAS or NCCL).
extern const char *const cg_cuda_cflags, *const cg_cuda_libs, *const cg_mpi_cflags;
// Whether a GPU can be used here: the NVIDIA driver (libcuda.so.1, opened with dlopen) loads,
// cuInit succeeds and it sees a device. False with the reason in why. arch gets the first
// device's architecture ("sm_90"; empty when unknown).
bool cg_gpu_probe(char *why, size_t size, char *arch, size_t arch_size);

#endif
