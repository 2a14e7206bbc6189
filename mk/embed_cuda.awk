# Turns the CUDA kernel sources (codegen/cuda/prelude.cu, then one file per kernel family) into C:
# `static const char cuda_prelude_src[]` and `static const CudaSource cuda_kernel_src[]`, one
# {name, source} per block that starts with a line "// ---- mk_NAME ----", in file order. In each
# file, the lines before its first "// ---- " line (its header comment) are skipped; any other
# "// ---- TITLE ----" line opens a section of the prelude, which collects every such section of
# every file in order (the title lines included). The kernel marker lines are not part of the
# sources; one blank line ending a kernel, and one ending the prelude, is dropped (the emitter
# prints a blank line after each). Used by the Makefile:
#   awk -f mk/embed_cuda.awk codegen/cuda/prelude.cu codegen/cuda/FAMILY.cu... > build/gen/cuda_kernels.inc
# A line as the inside of a C string literal. A backslash becomes two: "\\\\\\\\" is the replacement text
# \\\\, which gsub turns into two backslashes in gawk and mawk alike ("\\\\" would give one).
function quote(s) {
  gsub(/\\/, "\\\\\\\\", s)
  gsub(/"/, "\\\"", s)
  return s
}
# The kernel being read, if any, into kernels[] (the prelude's lines stay in pre[]).
function flush(   i, text) {
  if (name == "") return
  if (n > 0 && lines[n] == "") n--
  text = sprintf("  {\"%s\",\n", name)
  for (i = 1; i <= n; i++) text = text sprintf("    \"%s\\n\"%s\n", quote(lines[i]), (i == n ? "}," : ""))
  if (n == 0) text = text "    \"\"},\n"
  kernels[++nk] = text
  n = 0
  name = ""
}
BEGIN { n = 0; np = 0; nk = 0; name = "" }
FNR == 1 { flush(); started = 0 }
!started && /^\/\/ ---- / { started = 1 }
!started { next }
/^\/\/ ---- mk_[a-z0-9_]+ ----$/ {
  flush()
  name = $3
  next
}
/^\/\/ ---- / { flush() }
name != "" { lines[++n] = $0; next }
{ pre[++np] = $0 }
END {
  flush()
  if (np > 0 && pre[np] == "") np--
  printf "static const char cuda_prelude_src[] =\n"
  for (i = 1; i <= np; i++) printf "    \"%s\\n\"%s\n", quote(pre[i]), (i == np ? ";" : "")
  if (np == 0) printf "    \"\";\n"
  printf "\nstatic const CudaSource cuda_kernel_src[] = {\n"
  for (i = 1; i <= nk; i++) printf "%s", kernels[i]
  printf "};\n"
}
