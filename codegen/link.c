// The toolchain of codegen/ (beside layer 1): it calls nothing else in codegen/; the targets call it.
//
// Linking: the system C compiler turns the emitted host program and the runtime into the model
// binary. The runtime's headers and libraries are found under MOEC_ROOT (the source tree moec
// was built from, or $MOEC_ROOT when set); the flags of the libraries around them (MPI, and
// for the CUDA target the toolkit's headers, cuBLAS and NCCL) are the ones the Makefile found
// when it built moec, passed in as MOEC_* macros. The compiler runs without a shell, so paths
// with spaces or quotes are safe.
//
// A target adds what it needs (CgLinkExtra: codegen/target_cuda.c adds libmoert_cuda, the
// toolkit's headers, cuBLAS and NCCL).
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cg.h"

#ifndef MOEC_ROOT
#define MOEC_ROOT "."
#endif
#ifndef MOEC_BUILD
#define MOEC_BUILD MOEC_ROOT "/build"
#endif
#ifndef MOEC_MPI_LIBS
#define MOEC_MPI_LIBS "-lmpi"
#endif
#ifndef MOEC_MPI_CFLAGS
#define MOEC_MPI_CFLAGS ""
#endif
// The toolkit's headers (-I...) and the CUDA libraries' link flags; "" when make found no
// toolkit, cuBLAS or NCCL.
#ifndef MOEC_CUDA_CFLAGS
#define MOEC_CUDA_CFLAGS ""
#endif
#ifndef MOEC_CUDA_LIBS
#define MOEC_CUDA_LIBS ""
#endif
// OpenBLAS's link flags: its OpenMP build by path, with -fopenmp, where make found it.
#ifndef MOEC_BLAS_LIBS
#define MOEC_BLAS_LIBS "-lopenblas"
#endif

void cg_link_configuration(FILE *out) {
  fprintf(out, "root %s\nbuild %s\n", MOEC_ROOT, MOEC_BUILD);
  fprintf(out, "mpi_cflags %s\nmpi_libs %s\n", MOEC_MPI_CFLAGS, MOEC_MPI_LIBS);
  fprintf(out, "cuda_cflags %s\ncuda_libs %s\n", MOEC_CUDA_CFLAGS, MOEC_CUDA_LIBS);
  fprintf(out, "blas_libs %s\n", MOEC_BLAS_LIBS);
}

enum { MAX_ARGS = 96 };

typedef struct Command {
  const char *argv[MAX_ARGS + 1];
  int argc;
  char words[8192];   // the split flag strings
  size_t used;
  bool overflow;
} Command;

static void add(Command *c, const char *arg) {
  if (c->argc < MAX_ARGS) c->argv[c->argc++] = arg;
  else c->overflow = true;
}

// Adds the words of a flag string ("-L/x -lfoo").
static void add_words(Command *c, const char *flags) {
  size_t n = strlen(flags) + 1;
  if (c->used + n > sizeof c->words) {
    c->overflow = true;
    return;
  }
  char *copy = memcpy(c->words + c->used, flags, n);
  c->used += n;
  for (char *save = NULL, *w = strtok_r(copy, " ", &save); w; w = strtok_r(NULL, " ", &save)) add(c, w);
}

static bool run(IrDiag *d, Command *c, const char *c_path, bool verbose) {
  if (c->overflow) return ir_internal(d, "the link command line is too long");
  c->argv[c->argc] = NULL;
  if (verbose) {
    fprintf(stderr, "# link:");
    for (int i = 0; c->argv[i]; i++) fprintf(stderr, " %s", c->argv[i]);
    fputc('\n', stderr);
  }
  fflush(NULL);
  const char *cc = c->argv[0];
  pid_t pid = fork();
  if (pid < 0) return ir_error(d, "cannot start the C compiler: %s", strerror(errno));
  if (pid == 0) {
    execvp(cc, (char *const *)c->argv);
    fprintf(stderr, "moec: error: cannot run the C compiler '%s': %s\n", cc, strerror(errno));
    _exit(127);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return ir_error(d, "waiting for the C compiler failed: %s", strerror(errno));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    return ir_error(d, "the C compiler '%s' failed on the generated program '%s'", cc, c_path);
  return true;
}

static bool readable(IrDiag *d, const char *path, const char *how) {
  if (access(path, R_OK) == 0) return true;
  return ir_error(d, "cannot find the library '%s' (%s)", path, how);
}

const char *const cg_cuda_cflags = MOEC_CUDA_CFLAGS, *const cg_cuda_libs = MOEC_CUDA_LIBS,
                 *const cg_mpi_cflags = MOEC_MPI_CFLAGS;

void cg_source_file(const char *name, char *path, size_t size) {
  const char *root = getenv("MOEC_ROOT");
  snprintf(path, size, "%s/%s", root && *root ? root : MOEC_ROOT, name);
}

void cg_build_file(const char *name, char *path, size_t size) {
  const char *root = getenv("MOEC_ROOT");
  if (root && *root) snprintf(path, size, "%s/build/%s", root, name);
  else snprintf(path, size, "%s/%s", MOEC_BUILD, name);
}

// ---- the build cache's programs (and objects) ----
// A linked program (or a compiled object: cg_compile_cxx) depends on the command that makes it
// and on the files the command reads: the C program, the other sources and objects and the
// libraries named by path (their bytes), and the headers of the -I folders of moec's own tree
// (runtime/, runtime/cuda, tests/cuda). The system's headers and compiler and the shared
// libraries (-l) stay out; a program built after they change is relinked only when moec or
// libmoert changed too.
enum { PROGRAMS_MB = 2048 };   // the cache keeps programs up to this size (MOEC_CACHE_PROGRAMS_MB)

static bool hash_file(CgCacheHash *h, const char *path) {
  int fd = open(path, O_RDONLY);
  if (fd < 0) return false;
  char buf[65536];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) cg_cache_hash_add(h, buf, (size_t)n);
  close(fd);
  return n == 0;
}

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

// The *.h files of folder dir, in name order; false when they cannot all be read (or there are
// more than 256: no key then, rather than one that misses a header).
static bool hash_headers(CgCacheHash *h, const char *dir) {
  DIR *dp = opendir(dir);
  if (!dp) return false;
  char *names[256];
  int n = 0;
  bool ok = true;
  for (struct dirent *de; ok && (de = readdir(dp));) {
    size_t len = strlen(de->d_name);
    if (len <= 2 || strcmp(de->d_name + len - 2, ".h") != 0) continue;
    if (n == 256 || !(names[n] = strdup(de->d_name))) ok = false;
    else n++;
  }
  closedir(dp);
  qsort(names, (size_t)n, sizeof *names, by_name);
  for (int i = 0; i < n; i++) {
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", dir, names[i]);
    cg_cache_hash_add(h, names[i], strlen(names[i]));
    ok = hash_file(h, path) && ok;
    free(names[i]);
  }
  return ok;
}

// The key of the program c links: its words but -o and the program's path, with each file it
// reads by its bytes; false when an input cannot be read (no caching then).
static bool program_key(const Command *c, CgCacheKey *key) {
  const char *root = getenv("MOEC_ROOT");
  if (!root || !*root) root = MOEC_ROOT;
  size_t rlen = strlen(root);
  CgCacheHash h = cg_cache_hash_begin();
  cg_cache_hash_add(&h, "moec program 1", 14);
  for (int i = 0; i < c->argc; i++) {
    const char *a = c->argv[i];
    if (strcmp(a, "-o") == 0) {
      i++;
      continue;
    }
    size_t len = strlen(a);
    bool file = a[0] != '-' && len > 2 && (strcmp(a + len - 2, ".c") == 0 || strcmp(a + len - 2, ".o") == 0 ||
                                           strcmp(a + len - 2, ".a") == 0 || (len > 4 && strcmp(a + len - 4, ".cpp") == 0));
    if (!file) cg_cache_hash_add(&h, a, len);
    else if (!hash_file(&h, a)) return false;   // its bytes, not its name (the C program's is temporary)
    if (strncmp(a, "-I", 2) == 0 && strncmp(a + 2, root, rlen) == 0 && !hash_headers(&h, a + 2)) return false;
  }
  *key = cg_cache_hash_end(&h);
  return true;
}

// Writes the cached program of key to path; false when there is none.
static bool program_from_cache(const CgCacheKey *key, const char *path) {
  void *data = NULL;
  size_t size = 0;
  if (!cg_cache_get(key, "bin", &data, &size)) return false;
  unlink(path);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0755);
  bool ok = fd >= 0 && write(fd, data, size) == (ssize_t)size;
  if (fd >= 0 && close(fd) != 0) ok = false;
  free(data);
  if (!ok) unlink(path);
  return ok;
}

static void program_to_cache(const CgCacheKey *key, const char *path) {
  int fd = open(path, O_RDONLY);
  struct stat st;
  if (fd < 0) return;
  char *data = fstat(fd, &st) == 0 && st.st_size > 0 ? malloc((size_t)st.st_size) : NULL;
  if (data && read(fd, data, (size_t)st.st_size) == st.st_size) cg_cache_put(key, "bin", data, (size_t)st.st_size);
  free(data);
  close(fd);
  const char *env = getenv("MOEC_CACHE_PROGRAMS_MB");
  long mb = env && *env ? strtol(env, NULL, 10) : PROGRAMS_MB;
  cg_cache_prune("bin", (size_t)(mb > 0 ? mb : 0) << 20);
}

// Runs c, or takes its output (the program, or cg_compile_cxx's object) from the build cache: the
// same command on the same inputs made it before. -v prints the command either way, and says
// where the output came from.
static bool run_cached(IrDiag *d, Command *c, const char *c_path, const char *out_path, bool verbose) {
  CgCacheKey key;
  bool keyed = !c->overflow && program_key(c, &key);
  if (keyed && program_from_cache(&key, out_path)) {
    if (verbose) {
      fprintf(stderr, "# link:");
      for (int i = 0; i < c->argc; i++) fprintf(stderr, " %s", c->argv[i]);
      fprintf(stderr, "\n# build cache: what this command made before, on the same inputs\n");
    }
    return true;
  }
  if (!run(d, c, c_path, verbose)) return false;
  if (keyed) program_to_cache(&key, out_path);
  return true;
}

bool cg_link_program(IrDiag *d, const char *c_path, const char *out_path, const CgLinkExtra *extra, bool verbose) {
  const char *root = getenv("MOEC_ROOT");
  char include[4096], lib[4096];
  snprintf(include, sizeof include, "-I%s/runtime", root && *root ? root : MOEC_ROOT);
  cg_build_file("libmoert.a", lib, sizeof lib);
  if (!readable(d, lib, "build it with 'make', or set MOEC_ROOT")) return false;
  if (extra && extra->library[0] && !readable(d, extra->library, extra->how)) return false;
  const char *cc = getenv("CC"), *opt = getenv("MOEC_OPT");
  if (opt && *opt && strcmp(opt, "-O0") != 0 && strcmp(opt, "-O1") != 0 && strcmp(opt, "-O2") != 0 &&
      strcmp(opt, "-O3") != 0)
    return ir_error(d, "MOEC_OPT is '%s'; it takes -O0, -O1, -O2 or -O3 (the C compiler's optimisation of the "
                       "program, -O2 when unset)", opt);
  Command c = {.argc = 0};
  add(&c, cc && *cc ? cc : "cc");
  // the runtime's math flags (the Makefile's RT_CFLAGS): the fused loops' clamps and divisions
  // vectorise as the kernels' do (no errno, no trap to keep), with the same bits (no contraction
  // into FMAs under -std=c11, no reassociation: every -O level gives the same bits)
  add_words(&c, "-std=c11 -w -fno-math-errno -fno-trapping-math");
  add(&c, opt && *opt ? opt : "-O2");
  add(&c, include);
  if (extra) add_words(&c, extra->cflags);
  add(&c, c_path);
  for (int i = 0; extra && extra->sources && extra->sources[i]; i++) add(&c, extra->sources[i]);
  if (extra && extra->object[0]) add(&c, extra->object);
  if (extra && extra->library[0]) add(&c, extra->library);
  add(&c, lib);
  add_words(&c, MOEC_BLAS_LIBS);   // OpenBLAS (its OpenMP build and -fopenmp where configured)
  add_words(&c, "-lcjson");
  // The MPI link flags moec was built with (mpicc --showme:link).
  add_words(&c, MOEC_MPI_LIBS);
  if (extra) add_words(&c, extra->libs);
  add_words(&c, "-lm -o");
  add(&c, out_path);
  return run_cached(d, &c, c_path, out_path, verbose);
}

bool cg_compile_cxx(IrDiag *d, const char *src, const char *obj, const char *flags, bool verbose) {
  const char *cxx = getenv("CXX");
  Command c = {.argc = 0};
  add(&c, cxx && *cxx ? cxx : "c++");
  add_words(&c, flags);
  add(&c, "-c");
  add(&c, src);
  add(&c, "-o");
  add(&c, obj);
  return run_cached(d, &c, src, obj, verbose);
}

// The driver's two calls, by their unversioned names, typed without cuda.h (moec is built
// without the toolkit's headers): CUresult is an int-sized enum, 0 for success.
typedef int (*CuInit)(unsigned flags);
typedef int (*CuDeviceGetCount)(int *count);
typedef int (*CuDeviceGet)(int *device, int ordinal);
typedef int (*CuDeviceGetAttribute)(int *value, int attribute, int device);
enum { CU_ATTR_CC_MAJOR = 75, CU_ATTR_CC_MINOR = 76 };   // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_*

static const char *cuda_error_name(int rc) {
  switch (rc) {
  case 3: return " (CUDA_ERROR_NOT_INITIALIZED)";
  case 34: return " (CUDA_ERROR_STUB_LIBRARY: the toolkit's stub, not the NVIDIA driver)";
  case 35: return " (CUDA_ERROR_INSUFFICIENT_DRIVER)";
  case 100: return " (CUDA_ERROR_NO_DEVICE)";
  default: return "";
  }
}

bool cg_gpu_probe(char *why, size_t size, char *arch, size_t arch_size) {
  if (arch_size > 0) arch[0] = '\0';
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(why, size, "no NVIDIA driver: %s", dlerror());
    return false;
  }
  CuInit init = (CuInit)dlsym(lib, "cuInit");
  CuDeviceGetCount count_devices = (CuDeviceGetCount)dlsym(lib, "cuDeviceGetCount");
  CuDeviceGet get_device = (CuDeviceGet)dlsym(lib, "cuDeviceGet");
  CuDeviceGetAttribute attribute = (CuDeviceGetAttribute)dlsym(lib, "cuDeviceGetAttribute");
  int rc = -1, count = 0, dev = 0, major = 0, minor = 0;
  if (!init || !count_devices) snprintf(why, size, "libcuda.so.1 has no cuInit or cuDeviceGetCount");
  else if ((rc = init(0)) != 0) snprintf(why, size, "cuInit failed with CUDA error %d%s", rc, cuda_error_name(rc));
  else if ((rc = count_devices(&count)) != 0)
    snprintf(why, size, "cuDeviceGetCount failed with CUDA error %d%s", rc, cuda_error_name(rc));
  else if (count < 1) snprintf(why, size, "the driver sees no CUDA device");
  else snprintf(why, size, "%d CUDA device%s", count, count > 1 ? "s" : "");
  // The first device's architecture, for the kernels of `--target auto`.
  if (rc == 0 && count > 0 && get_device && attribute && get_device(&dev, 0) == 0 &&
      attribute(&major, CU_ATTR_CC_MAJOR, dev) == 0 && attribute(&minor, CU_ATTR_CC_MINOR, dev) == 0 &&
      arch_size > 0)
    snprintf(arch, arch_size, "sm_%d%d", major, minor);
  dlclose(lib);
  return rc == 0 && count > 0;
}
