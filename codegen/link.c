// Linking: the system C compiler turns the emitted host program and libmoert into the model
// binary. The runtime's header and library are found under MOEC_ROOT (the source tree moec was
// built from, or $MOEC_ROOT when set). The compiler runs without a shell, so paths with spaces
// or quotes are safe.
#include <errno.h>
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

bool cg_link(IrDiag *d, const char *c_path, const char *out_path, bool verbose) {
  const char *root = getenv("MOEC_ROOT");
  char include[4096], lib[4096];
  if (root && *root) {
    snprintf(include, sizeof include, "-I%s/runtime", root);
    snprintf(lib, sizeof lib, "%s/build/libmoert.a", root);
  } else {
    snprintf(include, sizeof include, "-I%s/runtime", MOEC_ROOT);
    snprintf(lib, sizeof lib, "%s/libmoert.a", MOEC_BUILD);
  }
  if (access(lib, R_OK) != 0)
    return ir_error(d, "cannot find the runtime library '%s' (build it with 'make', or set MOEC_ROOT)", lib);
  const char *cc = getenv("CC");
  if (!cc || !*cc) cc = "cc";
  // The MPI link flags moec was built with (mpicc --showme:link), split into words.
  char mpi[1024];
  snprintf(mpi, sizeof mpi, "%s", MOEC_MPI_LIBS);
  const char *argv[32] = {cc, "-std=c11", "-O2", "-w", include, c_path, lib, "-lopenblas", "-lcjson"};
  int argc = 9;
  for (char *save = NULL, *w = strtok_r(mpi, " ", &save); w && argc < 26; w = strtok_r(NULL, " ", &save))
    argv[argc++] = w;
  argv[argc++] = "-lm";
  argv[argc++] = "-o";
  argv[argc++] = out_path;
  argv[argc] = NULL;
  if (verbose) {
    fprintf(stderr, "# link:");
    for (int i = 0; argv[i]; i++) fprintf(stderr, " %s", argv[i]);
    fputc('\n', stderr);
  }
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) return ir_error(d, "cannot start the C compiler: %s", strerror(errno));
  if (pid == 0) {
    execvp(cc, (char *const *)argv);
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
