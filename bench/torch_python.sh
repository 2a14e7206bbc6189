# Sourced by the GPU benchmarks (bench/gpu.sh, bench/gpu_lm.sh): torch_python prints the first of
# $TORCH_PYTHON, python3, /usr/bin/python3 that imports torch, or nothing.
torch_python() {
  local candidate
  for candidate in ${TORCH_PYTHON:-} python3 /usr/bin/python3; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import torch' >/dev/null 2>&1; then
      echo "$candidate"
      return
    fi
  done
}
