# Turns codegen/cuda/kernels.cu into C: `static const char cuda_prelude_src[]` (from the first
# "// ---- " line up to the first kernel) and `static const CudaSource cuda_kernel_src[]`, one
# {name, source} per block that starts with a line "// ---- mk_NAME ----", in file order. The
# marker lines are not part of the sources; one blank line ending a block is dropped (the
# emitter prints a blank line after each). Used by the Makefile:
#   awk -f mk/embed_cuda.awk codegen/cuda/kernels.cu > build/gen/cuda_kernels.inc
function flush() {
  if (n > 0 && lines[n] == "") n--
  if (name == "") printf "static const char cuda_prelude_src[] =\n"
  else printf "  {\"%s\",\n", name
  for (i = 1; i <= n; i++) {
    s = lines[i]
    gsub(/\\/, "\\\\", s)
    gsub(/"/, "\\\"", s)
    printf "    \"%s\\n\"%s\n", s, (i == n ? (name == "" ? ";" : "},") : "")
  }
  if (n == 0) printf "    \"\"%s\n", (name == "" ? ";" : "},")
  if (name == "") printf "\nstatic const CudaSource cuda_kernel_src[] = {\n"
  n = 0
}
BEGIN { started = 0; n = 0; name = "" }
!started && /^\/\/ ---- / { started = 1 }
!started { next }
/^\/\/ ---- mk_[a-z0-9_]+ ----$/ {
  flush()
  name = $3
  next
}
{ lines[++n] = $0 }
END { flush(); printf "};\n" }
