# Every in-place gradient AllReduce of a parameter waits for the param.grad ops of that parameter
# before it in its function (when they are on another stream). Prints the offending lines.
/^func / { delete ev; delete stream }
/param\.grad @/ {
  p = $0; sub(/.*param\.grad @/, "", p); sub(/,.*/, "", p)
  s = $0; sub(/.*stream=/, "", s); sub(/,.*/, "", s); stream[p] = s
  e = $0; if (e ~ /event=/) { sub(/.*event=/, "", e); sub(/[^0-9].*/, "", e) } else e = ""
  ev[p] = (p in ev && ev[p] != "" ? ev[p] " " : "") e
}
/comm\.allreduce_grad @/ {
  p = $0; sub(/.*allreduce_grad @/, "", p); sub(/ .*/, "", p)
  s = $0; sub(/.*stream=/, "", s); sub(/,.*/, "", s)
  if (!(p in stream) || stream[p] == s) next
  w = $0; if (w ~ /wait=\[/) { sub(/.*wait=\[/, "", w); sub(/\].*/, "", w) } else w = ""
  n = split(ev[p], need, " ")
  if (n == 0) { print; next }
  for (i = 1; i <= n; i++) if (("," w ",") !~ ("[, ]" need[i] ",")) { print; break }
}
