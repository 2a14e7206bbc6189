#!/usr/bin/env bash
# Probes this machine for the flags moec builds with and links generated programs with, and
# writes them as make variables: MPI (from mpicc), cJSON, OpenBLAS, the CUDA toolkit (NVRTC,
# cuBLAS) and NCCL. The Makefile includes the result (build/config.mk); every object depends on
# it, and it is rewritten only when what is found changes, so a changed machine rebuilds what
# uses the configuration and an unchanged one rebuilds nothing.
#
#   mk/configure.sh OUT     write OUT (when different), e.g. build/config.mk
#   mk/configure.sh -       print to stdout (tests/cli.sh compares this with `moec --version -v`)
#
# Environment: CUDA (toolkit folder, default /usr/local/cuda), NCCL_HOME (folder with
# include/nccl.h and lib/libnccl.so.2; default the toolkit's, else a Python venv's nvidia/nccl).
set -euo pipefail
out=${1:?usage: mk/configure.sh OUT|-}
CUDA=${CUDA:-/usr/local/cuda}

fail() { echo "mk/configure.sh: error: $*" >&2; exit 1; }

# MPI: mpicc's own flags. Without mpicc nothing can be configured (make deps installs it).
command -v mpicc >/dev/null || fail "mpicc not found (Open MPI: 'make deps' installs libopenmpi-dev and openmpi-bin)"
mpi_cflags=$(mpicc --showme:compile) || fail "'mpicc --showme:compile' failed"
mpi_libs=$(mpicc --showme:link) || fail "'mpicc --showme:link' failed"

cjson_libs=$(pkg-config --libs libcjson 2>/dev/null || echo -lcjson)
cjson_cflags=$(pkg-config --cflags libcjson 2>/dev/null || true)
# OpenBLAS's cblas.h: the pthread build's header folder on Debian, else pkg-config's.
blas_cflags=""
for d in /usr/include/x86_64-linux-gnu/openblas-pthread /usr/include/aarch64-linux-gnu/openblas-pthread; do
  [ -f "$d/cblas.h" ] && { blas_cflags="-I$d"; break; }
done
[ -n "$blas_cflags" ] || blas_cflags=$(pkg-config --cflags openblas 2>/dev/null || true)
# OpenBLAS's OpenMP build (Debian's libopenblas-openmp-dev), when it is there: libmoert's kernels
# are then built with OpenMP and share its threads (runtime/threads.c). Programs link it by path
# with an rpath, since the system's libopenblas.so.0 is the pthread build (the alternatives'
# default). Without it: the default OpenBLAS and one-thread kernels.
omp_cflags="" blas_libs="-lopenblas"
for d in /usr/lib/x86_64-linux-gnu/openblas-openmp /usr/lib/aarch64-linux-gnu/openblas-openmp; do
  if [ -e "$d/libopenblas.so" ] && echo 'int main(void) { return 0; }' | cc -fopenmp -x c - -o /dev/null 2>/dev/null; then
    omp_cflags="-fopenmp" blas_libs="-L$d -Wl,-rpath,$d -lopenblas -fopenmp"
    break
  fi
done

# CUDA: NVRTC makes moec a CUDA compiler; cuBLAS and NCCL make the GPU runtime.
have_nvrtc=no have_gpu_runtime=no cuda_libdir="" nccl_home="" nccl_libdir=""
cuda_program_cflags="" cuda_program_libs=""
if [ -f "$CUDA/include/nvrtc.h" ]; then
  have_nvrtc=yes
  for d in "$CUDA/lib64" "$CUDA/lib"; do [ -d "$d" ] && { cuda_libdir=$d; break; }; done
  cuda_program_cflags="-I$CUDA/include"
  nccl_home=${NCCL_HOME:-}
  if [ -z "$nccl_home" ]; then
    if [ -f "$CUDA/include/nccl.h" ]; then nccl_home=$CUDA
    else nccl_home=$(python3 -c 'import nvidia.nccl; print(nvidia.nccl.__path__[0])' 2>/dev/null || true); fi
  fi
  if [ -n "$nccl_home" ]; then
    for d in "$nccl_home/lib64" "$nccl_home/lib" "$nccl_home/lib/x86_64-linux-gnu"; do
      [ -e "$d/libnccl.so.2" ] && { nccl_libdir=$d; break; }
    done
  fi
  if [ -n "$nccl_libdir" ] && [ -f "$nccl_home/include/nccl.h" ] && [ -f "$CUDA/include/cublas_v2.h" ]; then
    have_gpu_runtime=yes
    cuda_program_libs="-L$cuda_libdir -L$nccl_libdir -Wl,-rpath,$cuda_libdir -Wl,-rpath,$nccl_libdir -lcublas -lcublasLt -l:libnccl.so.2 -ldl"
  fi
fi

config=$(cat <<CONF
# Written by mk/configure.sh (make rewrites it when what it finds changes); do not edit.
CUDA := $CUDA
MPI_CFLAGS := $mpi_cflags
MPI_LIBS := $mpi_libs
CJSON_CFLAGS := $cjson_cflags
CJSON_LIBS := $cjson_libs
BLAS_CFLAGS := $blas_cflags
OMP_CFLAGS := $omp_cflags
BLAS_LIBS := $blas_libs
HAVE_NVRTC := $have_nvrtc
HAVE_GPU_RUNTIME := $have_gpu_runtime
CUDA_LIBDIR := $cuda_libdir
NCCL_HOME := $nccl_home
NCCL_LIBDIR := $nccl_libdir
CUDA_PROGRAM_CFLAGS := $cuda_program_cflags
CUDA_PROGRAM_LIBS := $cuda_program_libs
CONF
)
if [ "$out" = - ]; then
  printf '%s\n' "$config"
elif [ ! -f "$out" ] || [ "$(cat "$out")" != "$config" ]; then
  mkdir -p "$(dirname "$out")"
  printf '%s\n' "$config" >"$out.tmp" && mv "$out.tmp" "$out"
  echo "# configuration written to $out (MPI, OpenBLAS$([ -n "$omp_cflags" ] && echo " with OpenMP"), cJSON$([ $have_nvrtc = yes ] && echo ", NVRTC")$([ $have_gpu_runtime = yes ] && echo ", cuBLAS, NCCL"))"
fi
