// The cases of the CUDA kernel library, shared by tests/cuda/emu_check.cpp (the kernels as host
// C++ under an emulation of CUDA threads and blocks) and tests/cuda/gpu_check.cpp (the kernels
// on the GPU): every kernel mk_* runs on random inputs and is compared with the libmoert CPU
// kernel it stands for, integers (top-k, locations, expert choice, 16-bit and int8 codes)
// exactly, floats to 1e-5 relative (+1e-6 absolute). check_coverage then says whether every
// kernel of the library had a case.
//
// A case launches a kernel through the includer's launcher L (grid and block as written; the
// kernels that reduce with mk_block_sum / mk_block_max get MK_BLOCK threads):
//   LAUNCH(grid, block, kernel, args...)
//   LAUNCH_SHARED(grid, block, shared_bytes, kernel, args...)    with dynamic shared memory
// both L.launch(name, &kernel, grid, block, shared_bytes, args...). An argument is a
// std::vector<T> for each pointer parameter (the kernel gets the vector's elements, and what it
// writes ends up in the vector) or a scalar, converted to the parameter's type. The launchers
// turn arguments into parameters with kernel_pointer and kernel_scalar, whose static_asserts
// keep a case honest: a vector's element type must be the parameter's (an unsigned char
// parameter takes any vector: the layout kernels move bytes), and scalars go to scalars.
#ifndef KERNEL_CASES_H
#define KERNEL_CASES_H

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#define _Noreturn [[noreturn]]
extern "C" {
#include "moert.h"
}
#undef _Noreturn

#define LAUNCH(grid, block, kernel, ...) L.launch(#kernel, &kernel, grid, block, 0u, __VA_ARGS__)
#define LAUNCH_SHARED(grid, block, shared, kernel, ...) \
  L.launch(#kernel, &kernel, grid, block, (unsigned)(shared), __VA_ARGS__)

// ---- arguments ----
template <class T> struct is_vector : std::false_type {};
template <class T> struct is_vector<std::vector<T>> : std::true_type {};

// The value of pointer parameter type P for a vector of T whose elements are at data.
template <class P, class T> P kernel_pointer(T *data) {
  using Elem = std::remove_cv_t<std::remove_pointer_t<P>>;
  static_assert(std::is_pointer_v<P>, "a vector is passed where the kernel takes a scalar");
  static_assert(std::is_same_v<Elem, std::remove_cv_t<T>> || std::is_same_v<Elem, unsigned char>,
                "the vector's element type is not the kernel parameter's");
  return reinterpret_cast<P>(data);
}

// The value of scalar parameter type P for argument a (nullptr: a NULL pointer parameter).
template <class P, class A> P kernel_scalar(const A &a) {
  if constexpr (std::is_same_v<std::remove_cv_t<A>, std::nullptr_t>) {
    static_assert(std::is_pointer_v<P>, "nullptr is passed where the kernel takes a number");
    return nullptr;
  } else {
    static_assert(!std::is_pointer_v<P>, "a kernel pointer parameter needs a std::vector argument");
    static_assert(std::is_arithmetic_v<A>, "a kernel scalar parameter needs a number");
    return static_cast<P>(a);
  }
}

// ---- results ----
struct Checks {
  const char *prefix;   // "cuda emu", "gpu kernel": the start of every line after ok / FAIL
  int checks = 0, failures = 0;

  void ok(const char *fmt, ...) __attribute__((format(printf, 2, 3))) {
    va_list ap;
    va_start(ap, fmt);
    line("ok    ", fmt, ap);
    va_end(ap);
  }
  void fail(const char *fmt, ...) __attribute__((format(printf, 2, 3))) {
    va_list ap;
    va_start(ap, fmt);
    line("FAIL  ", fmt, ap);
    va_end(ap);
    failures++;
  }
  void line(const char *status, const char *fmt, va_list ap) {
    checks++;
    printf("%s%s ", status, prefix);
    vprintf(fmt, ap);
    putchar('\n');
    fflush(stdout);
  }

  template <class T> void same(const char *name, const std::vector<T> &want, const std::vector<T> &got) {
    for (size_t i = 0; i < want.size(); i++) {
      double a = (double)want[i], b = (double)got[i];
      bool equal = std::is_floating_point<T>::value
                       ? (a == b || (a != a && b != b) || fabs(a - b) <= 1e-5 * fabs(a) + 1e-6)
                       : a == b;
      if (!equal) {
        fail("%s: element %zu: cpu %.9g, kernel %.9g", name, i, a, b);
        return;
      }
    }
    ok("%s (%zu elements)", name, want.size());
  }

  // Within tol of the largest |want| (every element; NaN nowhere): the kernels that compute to a
  // narrower precision than the CPU's (attention on tensor cores, bf16 operands). Returns the worst
  // error over that largest, so a case can also say how far it was.
  double near(const char *name, const std::vector<float> &want, const std::vector<float> &got, double tol) {
    double big = 0.0, worst = 0.0;
    for (float w : want) big = fmax(big, fabs((double)w));
    for (size_t i = 0; i < want.size(); i++) {
      double e = fabs((double)want[i] - (double)got[i]) / (big > 0 ? big : 1.0);
      if (!(e <= tol)) {   // NaN fails too
        fail("%s: element %zu: reference %.9g, kernel %.9g (%.2e of the largest %.3g, over %.0e)", name, i, want[i],
             got[i], e, big, tol);
        return e;
      }
      worst = fmax(worst, e);
    }
    ok("%s (%zu elements, worst %.1e of the largest)", name, want.size(), worst);
    return worst;
  }

  // Bit for bit (the kernels whose float operations are the CPU kernel's, in its order, with mk_exp
  // for rt_exp: the fake device's fused kernels must give the CPU program's bits).
  void bits(const char *name, const std::vector<float> &want, const std::vector<float> &got) {
    for (size_t i = 0; i < want.size(); i++)
      if (memcmp(&want[i], &got[i], sizeof want[i]) != 0) {
        fail("%s: element %zu: cpu %.9g, kernel %.9g (not the same bits)", name, i, want[i], got[i]);
        return;
      }
    ok("%s (%zu elements, bit for bit)", name, want.size());
  }
};

// The kernels of a library source: the names after "__global__ void ".
static std::set<std::string> library_kernels(const std::string &src) {
  std::set<std::string> names;
  const std::string mark = "__global__ void ";
  for (size_t at = src.find(mark); at != std::string::npos; at = src.find(mark, at + 1)) {
    size_t begin = at + mark.size(), end = src.find('(', begin);
    names.insert(src.substr(begin, end - begin));
  }
  return names;
}

static void check_coverage(Checks &c, const std::string &library_src, const std::set<std::string> &launched) {
  std::string missing;
  std::set<std::string> all = library_kernels(library_src);
  for (const std::string &name : all)
    if (!launched.count(name)) missing += " " + name;
  if (all.empty())
    c.fail("every kernel has a case: no kernel found in the library source");
  else if (!missing.empty())
    c.fail("every kernel has a case: none for%s", missing.c_str());
  else
    c.ok("every kernel has a case (%zu kernels)", all.size());
}

// ---- inputs ----
static std::mt19937 rng(7);
static std::vector<float> randn(size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto &x : v) x = d(rng);
  return v;
}
template <class T> static std::vector<T> zeros(size_t n) { return std::vector<T>(n, (T)0); }

// {sum, max |x|, NaNs} of x from rt_record's JSON line (mean and max_abs): the CPU side of
// mk_record_stats. x must hold no NaN (rt_record writes null then).
static std::vector<double> record_stats(const std::vector<float> &x) {
  char *text = NULL;
  size_t size = 0;
  FILE *f = open_memstream(&text, &size);
  RtStep st;
  memset(&st, 0, sizeof st);
  st.record = f;
  rt_record(&st, "x", 0, x.data(), (int64_t)x.size());
  fclose(f);
  const char *mean = strstr(text, "\"mean\": "), *max_abs = strstr(text, "\"max_abs\": ");
  std::vector<double> stats = {mean ? strtod(mean + 8, NULL) * (double)x.size() : NAN,
                               max_abs ? strtod(max_abs + 11, NULL) : NAN, 0.0};
  free(text);
  return stats;
}

// ---- the cases ----
template <class Launcher> void run_kernel_cases(Launcher &L, Checks &c) {
  const int s = 48, e = 8, k = 2, g = 2, m = 40, cap = 7;
  // ---- gate chain ----
  auto logits = randn((size_t)s * e);
  logits[3] = logits[5];  // a tie for top-k
  RtStep st;
  memset(&st, 0, sizeof st);
  st.seed = 42, st.step = 3, st.token0 = 96;
  auto noisy_c = zeros<float>(s * e), noisy_k = zeros<float>(s * e);
  rt_gate_noise(logits.data(), noisy_c.data(), s, e, 0.5f, 1, st.seed, st.step, st.token0);
  LAUNCH(4, 64, mk_gate_noise, logits, noisy_k, s, e, 0.5f, 1, 42, 3, 96);
  c.same("gate.noise", noisy_c, noisy_k);
  auto sc_c = zeros<float>(s * e), sc_k = zeros<float>(s * e);
  rt_softmax(noisy_c.data(), sc_c.data(), s, e);
  LAUNCH(2, 32, mk_softmax, noisy_c, sc_k, s, e);
  c.same("gate.softmax", sc_c, sc_k);
  auto idx_c = zeros<int32_t>(s * k), idx_k = zeros<int32_t>(s * k);
  rt_topk(sc_c.data(), idx_c.data(), s, e, k, 1, 1, 0);
  LAUNCH(2, 32, mk_topk, sc_c, idx_k, s, e, k, 1, 1, 0);
  c.same("gate.topk", idx_c, idx_k);
  auto gates_c = zeros<float>(s * k), gates_k = zeros<float>(s * k);
  rt_gate_gather(sc_c.data(), idx_c.data(), gates_c.data(), s, e, k, true, 1.0f);
  LAUNCH(2, 32, mk_gate_gather, sc_c, idx_c, gates_k, s, e, k, 1, 1.0f);
  c.same("gate.gather renorm", gates_c, gates_k);
  {
    auto fs = zeros<float>(s * e), fg = zeros<float>(s * k);
    auto fi = zeros<int32_t>(s * k);
    LAUNCH(3, 16, mk_gate_softmax_topk_gather, noisy_c, fs, fi, fg, s, e, k, 1);
    c.same("fused softmax+topk+gather: scores", sc_c, fs);
    c.same("fused softmax+topk+gather: idx", idx_c, fi);
    c.same("fused softmax+topk+gather: gates", gates_c, fg);
    auto sg = zeros<float>(s * e), sgg = zeros<float>(s * k);
    auto sgi = zeros<int32_t>(s * k);
    rt_sigmoid(noisy_c.data(), sg.data(), s * e);
    rt_topk(sg.data(), sgi.data(), s, e, k, 1, 1, 0);
    rt_gate_gather(sg.data(), sgi.data(), sgg.data(), s, e, k, false, 1.0f);
    LAUNCH(3, 16, mk_gate_sigmoid_topk_gather, noisy_c, fs, fi, fg, s, e, k, 0);
    c.same("fused sigmoid+topk+gather: scores", sg, fs);
    c.same("fused sigmoid+topk+gather: idx", sgi, fi);
    c.same("fused sigmoid+topk+gather: gates", sgg, fg);
  }
  auto dg = randn(s * k), dsc_c = zeros<float>(s * e), dsc_k = zeros<float>(s * e);
  rt_gate_gather_grad(dg.data(), sc_c.data(), idx_c.data(), dsc_c.data(), s, e, k, true, 1.0f);
  LAUNCH(2, 32, mk_gate_gather_grad, dg, sc_c, idx_c, dsc_k, s, e, k, 1, 1.0f);
  c.same("gate.gather.grad renorm", dsc_c, dsc_k);
  {  // DeepSeek's choice: a correction bias, a group limit (both group scores), scaled gates, the bias's update
    auto bias = randn(e);
    for (int kind : {0, 1}) {
      int groups = e % 4 == 0 ? 4 : e % 2 == 0 ? 2 : 1;
      auto li_c = zeros<int32_t>(s * k), li_k = zeros<int32_t>(s * k);
      rt_topk_bias(sc_c.data(), bias.data(), li_c.data(), s, e, k, groups, groups > 1 ? groups / 2 + (kind == 1) : 1,
                   kind);
      LAUNCH(2, 32, mk_topk_bias, sc_c, bias, li_k, s, e, k, groups, groups > 1 ? groups / 2 + (kind == 1) : 1, kind);
      c.same(kind ? "gate.topk_bias, groups by their best" : "gate.topk_bias, groups by their two best", li_c, li_k);
      rt_topk(noisy_c.data(), li_c.data(), s, e, k, groups, 1, kind);
      LAUNCH(2, 32, mk_topk, noisy_c, li_k, s, e, k, groups, 1, kind);
      c.same("gate.topk, one group", li_c, li_k);
    }
    auto sg_c = zeros<float>(s * k), sg_k = zeros<float>(s * k);
    rt_gate_gather(sc_c.data(), idx_c.data(), sg_c.data(), s, e, k, true, 2.5f);
    LAUNCH(2, 32, mk_gate_gather, sc_c, idx_c, sg_k, s, e, k, 1, 2.5f);
    c.same("gate.gather renorm scale 2.5", sg_c, sg_k);
    for (int rn : {0, 1}) {
      auto d_c = zeros<float>(s * e), d_k = zeros<float>(s * e);
      rt_gate_gather_grad(dg.data(), sc_c.data(), idx_c.data(), d_c.data(), s, e, k, rn, 2.5f);
      LAUNCH(2, 32, mk_gate_gather_grad, dg, sc_c, idx_c, d_k, s, e, k, rn, 2.5f);
      c.same(rn ? "gate.gather.grad renorm scale 2.5" : "gate.gather.grad scale 2.5", d_c, d_k);
    }
    auto ld_c = zeros<float>(e), ld_k = zeros<float>(e);
    rt_balance_load(idx_c.data(), ld_c.data(), s, k, e);
    LAUNCH(1, 1, mk_balance_load, idx_c, ld_k, s, k, e);
    c.same("gate.balance_load", ld_c, ld_k);
    auto eb_c = bias, eb_k = bias;
    rt_balance_update(eb_c.data(), ld_c.data(), e, 0.125f);
    LAUNCH(1, 32, mk_balance_update, eb_k, ld_c, (int64_t)e, 0.125f);
    c.same("opt.balance", eb_c, eb_k);
  }
  auto dl_c = zeros<float>(s * e), dl_k = zeros<float>(s * e);
  rt_softmax_grad(dsc_c.data(), sc_c.data(), dl_c.data(), s, e);
  LAUNCH(2, 32, mk_softmax_grad, dsc_c, sc_c, dl_k, s, e);
  c.same("gate.softmax.grad", dl_c, dl_k);
  for (int cp : {cap, 0}) {  // with drops, and dropless
    auto loc_c = zeros<int32_t>(s * k);
    rt_gate_locations(idx_c.data(), loc_c.data(), NULL, s, k, e, g, cp);
    // The statistics the kernel must give: kept and wanted choices per (group, expert).
    std::vector<int> want(g * e * 2, 0);
    for (int t = 0; t < s; t++)
      for (int j = 0; j < k; j++) {
        int gi = (int)((long long)t * g / s), ex = idx_c[t * k + j];
        while (gi + 1 < g && (long long)s * (gi + 1) / g <= t) gi++;
        want[(gi * e + ex) * 2] += loc_c[t * k + j] >= 0;
        want[(gi * e + ex) * 2 + 1] += 1;
      }
    // Any grid and block: a block per group with 4 threads (grid-stride over the experts), a
    // block per (group, expert) with 32, and with 256 (more threads than choices).
    const char *name = cp ? "gate.locations (drops)" : "gate.locations (dropless)";
    for (int shape = 0; shape < 3; shape++) {
      auto loc_k = zeros<int32_t>(s * k);
      std::vector<int> stats(g * e * 2, -7);
      if (shape == 0) LAUNCH(g, 4, mk_gate_locations, idx_c, loc_k, stats, s, k, e, g, cp);
      if (shape == 1) LAUNCH(g * e, 32, mk_gate_locations, idx_c, loc_k, stats, s, k, e, g, cp);
      if (shape == 2) LAUNCH(g * e, 256, mk_gate_locations, idx_c, loc_k, stats, s, k, e, g, cp);
      std::string label = std::string(name) + (shape == 0 ? "" : shape == 1 ? " [g*e x 32]" : " [g*e x 256]");
      c.same(label.c_str(), loc_c, loc_k);
      c.same((label + " stats").c_str(), want, stats);
    }
  }
  auto loc = zeros<int32_t>(s * k);
  rt_gate_locations(idx_c.data(), loc.data(), NULL, s, k, e, g, cap);
  {
    std::vector<float> a_c = {rt_aux_loss_value(sc_c.data(), idx_c.data(), s, e, k, g) / 2.0f}, a_k = {0};
    LAUNCH(1, MK_BLOCK, mk_aux_loss, sc_c, idx_c, a_k, s, e, k, g, 2.0f);
    c.same("gate.aux_loss", a_c, a_k);
    auto d_c = zeros<float>(s * e), d_k = zeros<float>(s * e);
    rt_aux_loss_grad(sc_c.data(), idx_c.data(), d_c.data(), s, e, k, g, 0.01f);
    LAUNCH_SHARED(g, 64, e * sizeof(double), mk_aux_loss_grad, sc_c, idx_c, d_k, s, e, k, g, 0.01f);
    c.same("gate.aux_loss.grad", d_c, d_k);
    {  // DeepSeek-V3's sequence-wise form, g sequences
      std::vector<float> q_c = {0}, q_k = {0};
      rt_aux_seq(sc_c.data(), idx_c.data(), q_c.data(), s, e, k, g, 2.0f);
      LAUNCH_SHARED(1, 64, 2 * e * sizeof(double), mk_aux_seq, sc_c, idx_c, q_k, s, e, k, g, 2.0f);
      c.same("gate.aux_loss sequence", q_c, q_k);
      auto dq_c = zeros<float>(s * e), dq_k = zeros<float>(s * e);
      rt_aux_seq_grad(sc_c.data(), idx_c.data(), dq_c.data(), s, e, k, g, 0.01f);
      LAUNCH_SHARED(g, 64, e * sizeof(double), mk_aux_seq_grad, sc_c, idx_c, dq_k, s, e, k, g, 0.01f);
      c.same("gate.aux_loss.grad sequence", dq_c, dq_k);
    }
    auto p_c = zeros<float>(2 * e), p_k = zeros<float>(2 * e);   // the pooled form: sums, then its gradient
    rt_aux_pooled(sc_c.data(), idx_c.data(), p_c.data(), s, e, k);
    LAUNCH(1, 4, mk_aux_pooled, sc_c, idx_c, p_k, s, e, k);
    c.same("gate.aux_pooled", p_c, p_k);
    rt_aux_pooled_grad(p_c.data(), d_c.data(), s, e, 0.01f);
    LAUNCH(3, 32, mk_aux_pooled_grad, p_c, d_k, s, e, 0.01f);
    c.same("gate.aux_pooled.grad", d_c, d_k);
    std::vector<float> z_c = {rt_z_loss_value(noisy_c.data(), s, e, g)}, z_k = {0};
    LAUNCH(1, MK_BLOCK, mk_z_loss, noisy_c, z_k, s, e, g, 1.0f);
    c.same("gate.z_loss", z_c, z_k);
    rt_z_loss_grad(noisy_c.data(), d_c.data(), s, e, g, 0.001f);
    LAUNCH(2, 32, mk_z_loss_grad, noisy_c, d_k, s, e, g, 0.001f);
    c.same("gate.z_loss.grad", d_c, d_k);
    rt_softmax_tokens(noisy_c.data(), d_c.data(), s, e, g);
    LAUNCH(2, 8, mk_softmax_tokens, noisy_c, d_k, s, e, g);
    c.same("gate.softmax_tokens", d_c, d_k);
    auto dd_c = zeros<float>(s * e), dd_k = zeros<float>(s * e);
    rt_softmax_tokens_grad(dl_c.data(), d_c.data(), dd_c.data(), s, e, g);
    LAUNCH(2, 8, mk_softmax_tokens_grad, dl_c, d_c, dd_k, s, e, g);
    c.same("gate.softmax_tokens.grad", dd_c, dd_k);
    auto ec_c = zeros<int32_t>(s * e), ec_k = zeros<int32_t>(s * e);
    auto tied = sc_c;
    tied[2 * e + 1] = tied[5 * e + 1];
    rt_expert_choice(tied.data(), ec_c.data(), s, e, g, 5);
    LAUNCH(3, 32, mk_expert_choice, tied, ec_k, s, e, g, 5);
    c.same("gate.expert_choice", ec_c, ec_k);
    auto io_c = zeros<int32_t>(s * e), io_k = zeros<int32_t>(s * e);
    rt_iota(io_c.data(), s, e);
    LAUNCH(2, 64, mk_iota, io_k, s, e);
    c.same("gate.iota", io_c, io_k);
  }
  // ---- order ----
  size_t slots = (size_t)e * g * cap;
  auto x = randn((size_t)s * m);
  {
    auto d_c = zeros<float>(slots * m), d_k = randn(slots * m);
    LAUNCH(4, 64, mk_zero, d_k, (int64_t)d_k.size());
    c.same("zero", d_c, d_k);
    // encode and decode_grad_y write every slot: both start from different garbage
    d_c = randn(slots * m), d_k = randn(slots * m);
    rt_order_encode(x.data(), idx_c.data(), loc.data(), d_c.data(), s, m, k, e, g, cap);
    LAUNCH(5, 16, mk_order_encode, x, idx_c, loc, d_k, s, m, k, e, g, cap);
    c.same("order.encode", d_c, d_k);
    auto y = randn(slots * m), o_c = zeros<float>(s * m), o_k = zeros<float>(s * m);
    rt_order_encode_grad(y.data(), idx_c.data(), loc.data(), o_c.data(), s, m, k, e, g, cap);
    LAUNCH(5, 16, mk_order_encode_grad, y, idx_c, loc, o_k, s, m, k, e, g, cap);
    c.same("order.encode.grad", o_c, o_k);
    rt_order_decode(y.data(), idx_c.data(), loc.data(), gates_c.data(), o_c.data(), s, m, k, e, g, cap);
    LAUNCH(5, 16, mk_order_decode, y, idx_c, loc, gates_c, o_k, s, m, k, e, g, cap);
    c.same("order.decode", o_c, o_k);
    d_c = randn(slots * m), d_k = randn(slots * m);
    rt_order_decode_grad_y(x.data(), idx_c.data(), loc.data(), gates_c.data(), d_c.data(), s, m, k, e, g, cap);
    LAUNCH(5, 16, mk_order_decode_grad_y, x, idx_c, loc, gates_c, d_k, s, m, k, e, g, cap);
    c.same("order.decode.grad_y", d_c, d_k);
    // The same from the slot map (mk_slot_map, then the _map kernels with past 1), the map's memory
    // first filled with choices and numbers past them at random (the map is never cleared: an
    // entry counts only where the choice it names fills that slot or chunk), then reused by the
    // routed cases below (stale entries of other capacities).
    std::vector<int32_t> map((size_t)e * g * 100 * 2);
    for (size_t i = 0; i < map.size(); i++) map[i] = (int32_t)((i * 2654435761u) % (size_t)(s * k + 4)) - 2;
    d_k = randn(slots * m);
    LAUNCH(3, 64, mk_slot_map, idx_c, loc, map, s, k, e, g, cap);
    LAUNCH(5, 16, mk_order_encode_map, x, idx_c, loc, map, d_k, s, m, k, e, g, cap, 1);
    rt_order_encode(x.data(), idx_c.data(), loc.data(), d_c.data(), s, m, k, e, g, cap);
    c.same("order.encode from the slot map (mk_slot_map over a map of garbage)", d_c, d_k);
    d_k = randn(slots * m);
    LAUNCH(5, 16, mk_order_decode_grad_y_map, x, idx_c, loc, gates_c, map, d_k, s, m, k, e, g, cap, 1);
    rt_order_decode_grad_y(x.data(), idx_c.data(), loc.data(), gates_c.data(), d_c.data(), s, m, k, e, g, cap);
    c.same("order.decode.grad_y from the slot map", d_c, d_k);
    {   // written only below the counts from the routing, each block of slots' row 0 too; the rest
        // left (NaN on the host builds: MK_POISON), with cap below and above the kernel's 16 rows;
        // the map of the launch before left in place; cap 100 with the locations 9 apart, so that a
        // block's rows are past the count or not by the map's witnesses of the chunks after them
      for (auto [rcap, spread] : {std::pair{cap, 1}, {3, 1}, {20, 1}, {100, 9}}) {
        std::vector<int32_t> rloc(loc.size());
        std::vector<int> count((size_t)e * g, 0), next((size_t)e * g, 0);
        for (int t = 0; t < s; t++)
          for (int j = 0; j < k; j++) {   // numbered in token order per block of slots, dropped past rcap
            int gi = (int)((int64_t)t * g / s), G = idx_c[(size_t)t * k + j] * g + gi;
            while (gi + 1 < g && (int64_t)s * (gi + 1) / g <= t) gi++, G++;
            int l = next[(size_t)G]++ * spread;   // the second location dropped: a hole below the count
            rloc[(size_t)t * k + j] = l < rcap && l != spread ? l : -1;
            if (rloc[(size_t)t * k + j] >= 0) count[(size_t)G] = std::max(count[(size_t)G], l + 1);
          }
        size_t rslots = (size_t)e * g * rcap;
        auto want = randn(rslots * m), got = randn(rslots * m), in = got;
        rt_order_encode(x.data(), idx_c.data(), rloc.data(), want.data(), s, m, k, e, g, rcap);
        LAUNCH(4, 32, mk_slot_map, idx_c, rloc, map, s, k, e, g, rcap);
        LAUNCH(5, 16, mk_order_encode_map, x, idx_c, rloc, map, got, s, m, k, e, g, rcap, 0);
        auto want_y = randn(rslots * m), got_y = randn(rslots * m), in_y = got_y;
        rt_order_decode_grad_y(x.data(), idx_c.data(), rloc.data(), gates_c.data(), want_y.data(), s, m, k, e, g, rcap);
        LAUNCH(5, 64, mk_order_decode_grad_y_map, x, idx_c, rloc, gates_c, map, got_y, s, m, k, e, g, rcap, 0);
        size_t bad = rslots * m, left = 0, over = 0;   // over: rows past a count written (cap 16 on: none)
        for (size_t i = 0; i < rslots * m && bad == rslots * m; i++) {
          size_t row = i / m, G = row / rcap, l = row % rcap;
          bool written = l == 0 || (int)l < count[G];
          for (auto [w, gt, was] : {std::tuple{&want, &got, &in}, std::tuple{&want_y, &got_y, &in_y}}) {
            float v = (*gt)[i];
            bool same = memcmp(&v, &(*w)[i], sizeof v) == 0;   // (a row past the count of a block of slots
            // between a kernel block's first and last ones, cap below 16, is written all the same)
            bool kept = v != v || memcmp(&v, &(*was)[i], sizeof v) == 0;
            if (written ? !same : !(same || kept)) bad = i;
            left += !written && !same;
            over += !written && same;
          }
        }
        if (bad == rslots * m && rcap >= 16 && (left == 0 || over > 0)) {
          c.fail("order.encode / .decode.grad_y over the routed rows (cap %d): %zu elements past the counts written, %zu not",
                 rcap, over, left);
        } else if (bad == rslots * m)
          c.ok("order.encode and .decode.grad_y over the routed rows (cap %d): the rows below the counts and each block's row 0 as written whole", rcap);
        else
          c.fail("order.encode / .decode.grad_y over the routed rows (cap %d): element %zu is %.9g / %.9g, want %.9g / %.9g",
                 rcap, bad, got[bad], got_y[bad], want[bad], want_y[bad]);
      }
    }
    auto gg_c = zeros<float>(s * k), gg_k = zeros<float>(s * k);
    rt_order_decode_grad_gates(x.data(), y.data(), idx_c.data(), loc.data(), gg_c.data(), s, m, k, e, g, cap);
    LAUNCH(7, MK_BLOCK, mk_order_decode_grad_gates, x, y, idx_c, loc, gg_k, s, m, k, e, g, cap);
    c.same("order.decode.grad_gates", gg_c, gg_k);
    auto w_c = zeros<float>(s * slots), w_k = zeros<float>(s * slots);
    rt_dispatch_mask(idx_c.data(), loc.data(), w_c.data(), s, k, e, g, cap);
    LAUNCH(5, 32, mk_dispatch_mask, idx_c, loc, w_k, s, k, e, g, cap);
    c.same("order.dispatch_mask", w_c, w_k);
    rt_combine_weights(idx_c.data(), loc.data(), gates_c.data(), w_c.data(), s, k, e, g, cap);
    LAUNCH(5, 32, mk_combine_weights, idx_c, loc, gates_c, w_k, s, k, e, g, cap);
    c.same("order.combine_weights", w_c, w_k);
    auto dcw = randn(s * slots);
    rt_combine_weights_grad(dcw.data(), idx_c.data(), loc.data(), gg_c.data(), s, k, e, g, cap);
    LAUNCH(2, 32, mk_combine_weights_grad, dcw, idx_c, loc, gg_k, s, k, e, g, cap);
    c.same("order.combine_weights.grad", gg_c, gg_k);
  }
  // ---- dense, elementwise, losses, optimizers ----
  {
    size_t n = (size_t)s * m;
    auto a = randn(n), b = randn(n), y_c = zeros<float>(n), y_k = zeros<float>(n);
    rt_copy(a.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_copy, a, y_k, n);
    c.same("copy", y_c, y_k);
    rt_add(a.data(), b.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_add, a, b, y_k, n);
    c.same("add", y_c, y_k);
    rt_mul(a.data(), b.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_mul, a, b, y_k, n);
    c.same("mul", y_c, y_k);
    auto bias = randn(m), ebias = randn(4 * m);
    rt_bias(a.data(), bias.data(), y_c.data(), s, m);
    LAUNCH(3, 64, mk_bias, a, bias, y_k, s, m);
    c.same("bias", y_c, y_k);
    rt_expert_bias(a.data(), ebias.data(), y_c.data(), 4, s / 4, m);
    LAUNCH(3, 64, mk_expert_bias, a, ebias, y_k, 4, s / 4, m);
    c.same("expert.bias", y_c, y_k);
    rt_expert_scale(a.data(), bias.data(), y_c.data(), 4, s / 4, m);
    LAUNCH(3, 64, mk_expert_scale, a, bias, y_k, 4, s / 4, m);
    c.bits("expert.scale", y_c, y_k);
    {  // the filled rows of 6 blocks of 37 slots: empty, full, one row, a zero row inside, NaN, -0
      const int groups = 6, slots = 37, width = 301, part = 8;   // parts of 8 rows: 5 a block, the last 5 rows
      auto x = zeros<float>((size_t)groups * slots * width);
      const int filled[groups] = {0, slots, 1, 20, 9, 5};
      std::vector<int> want(4 * groups), got(6 * groups, 0);
      got[0] = -7;
      for (int g = 0; g < groups; g++) {
        for (int r = 0; r < filled[g]; r++)
          for (int j = 0; j < width; j++) x[((size_t)g * slots + r) * width + j] = (float)((r + j) % 5) - 2.0f;
        want[g] = filled[g];
      }
      for (int j = 0; j < width; j++) x[((size_t)3 * slots + 10) * width + j] = 0.0f;   // a zero row below the last
      for (int r = 8; r < 16; r++)   // and a part of zero rows below it
        for (int j = 0; j < width; j++) x[((size_t)1 * slots + r) * width + j] = 0.0f;
      for (int j = 0; j < width; j++) x[((size_t)3 * slots + 15) * width + j] = 0.0f;   // a part's last row
      x[((size_t)4 * slots + 30) * width + 300] = NAN;   // NaN counts
      want[4] = 31;
      x[((size_t)5 * slots + 36) * width + 7] = -0.0f;   // -0 is zero
      for (int g = 0; g < groups; g++) {
        want[groups + g] = std::max(want[g], 1);
        want[2 * groups + g] = want[3 * groups + g] = std::min(want[g] + 1, slots);   // plus one (a full block: all)
      }
      // The GEMM's result: its rows past each part's last row that is not zero zeroed (every row past
      // the count, and the zero rows of x that end a part below it: the GEMM writes those), the others left.
      const int cwidth = 13;
      auto out = randn((size_t)groups * slots * cwidth), out_want = out;
      for (int g = 0; g < groups; g++)
        for (int lo = 0; lo < slots; lo += part) {
          int hi = std::min(lo + part, slots), last = lo - 1;
          for (int r = lo; r < hi; r++)
            for (int j = 0; j < width; j++)
              if (!(x[((size_t)g * slots + r) * width + j] == 0.0f)) last = r;
          std::fill(out_want.begin() + ((size_t)g * slots + last + 1) * cwidth, out_want.begin() + ((size_t)g * slots + hi) * cwidth, 0.0f);
        }
      // The grid smaller than the 30 parts (a block takes several), then again on the same counts:
      // the kernel's maxima and arrivals are zeros after a launch.
      LAUNCH(4, MK_BLOCK, mk_expert_counts, x, got, out, groups, slots, width, cwidth, part);
      std::vector<int> head(got.begin(), got.begin() + 4 * groups), tail(got.begin() + 4 * groups, got.end());
      c.same("expert GEMM filled rows (mk_expert_counts: parts of 8 rows)", want, head);
      c.same("expert GEMM filled rows: the kernel's maxima and arrivals back to zero", std::vector<int>(2 * groups, 0), tail);
      c.bits("expert GEMM filled rows: the result's rows past them zeroed", out_want, out);
      {   // cwidth < 0: nothing reads the result's rows past them (codegen/launch.c): left as they are
          // on a GPU, NaN on the host builds (MK_POISON), never zeroed but an empty block's row 0
          // (a weight gradient sums it); the other rows left.
        auto lazy = randn((size_t)groups * slots * cwidth), lazy_in = lazy;
        std::vector<int> counts(6 * groups, 0);
        LAUNCH(4, MK_BLOCK, mk_expert_counts, x, counts, lazy, groups, slots, width, -cwidth, part);
        counts.resize(4 * groups);
        c.same("expert GEMM filled rows, its result's rows past them unread (cwidth < 0)", want, counts);
        size_t bad = lazy.size();
        for (size_t i = 0; i < lazy.size() && bad == lazy.size(); i++) {
          bool past = out_want[i] == 0.0f && out[i] == 0.0f && lazy_in[i] != 0.0f;   // a row the first launch zeroed
          bool kept = memcmp(&lazy[i], &lazy_in[i], sizeof lazy[i]) == 0;
          bool row0 = want[i / cwidth / slots] == 0 && (i / cwidth) % slots == 0;   // an empty block's row 0
          if (row0 ? lazy[i] != 0.0f : past ? !(kept || lazy[i] != lazy[i]) : !kept) bad = i;
        }
        if (bad == lazy.size()) c.ok("expert GEMM filled rows (cwidth < 0): the rows past them not zeroed (NaN where MK_POISON) but an empty block's row 0, the others left");
        else c.fail("expert GEMM filled rows (cwidth < 0): element %zu is %.9g, was %.9g", bad, lazy[bad], lazy_in[bad]);
      }
      for (int j = 0; j < width; j++) x[((size_t)2 * slots + 33) * width + j] = 1.0f;   // another count the next step
      want[2] = 34, want[groups + 2] = 34, want[2 * groups + 2] = want[3 * groups + 2] = 35;
      std::fill(got.begin(), got.begin() + 4 * groups, -7);
      LAUNCH(64, MK_BLOCK, mk_expert_counts, x, got, out, groups, slots, width, 0, 1);   // a part a row, no result
      head.assign(got.begin(), got.begin() + 4 * groups);
      c.same("expert GEMM filled rows, launched again (parts of a row, more blocks than parts of a group)", want, head);
      std::vector<uint16_t> x16(x.size());   // the bf16 copy (-0 stays -0, NaN stays NaN)
      rt_compress_bf16(x.data(), x16.data(), (int64_t)x.size());
      auto got16 = std::vector<int>(6 * groups, 0);
      auto out16 = randn((size_t)groups * slots * cwidth);
      LAUNCH(4, MK_BLOCK, mk_expert_counts_bf16, x16, got16, out16, groups, slots, width, 0, 37);
      got16.resize(4 * groups);
      c.same("expert GEMM filled rows of a bf16 copy (mk_expert_counts_bf16)", want, got16);
      // After the GEMM over the counts plus one: each block's rows past them copy its last one.
      auto past = randn((size_t)groups * slots * cwidth), fill_want = past;
      std::vector<int> plus(want.begin() + 2 * groups, want.begin() + 3 * groups);
      for (int g = 0; g < groups; g++)
        for (int r = plus[g]; r < slots; r++)
          std::copy_n(fill_want.begin() + ((size_t)g * slots + plus[g] - 1) * cwidth, cwidth,
                      fill_want.begin() + ((size_t)g * slots + r) * cwidth);
      LAUNCH(3, 64, mk_expert_rows_fill, plus, past, groups, slots, cwidth);
      c.bits("expert GEMM over act(h + b1): the rows past the counts plus one copy the last (mk_expert_rows_fill)", fill_want, past);
      // SwiGLU's x W3 over x W1's counts: its rows past them zeroed, the others left.
      auto zeroed = randn((size_t)groups * slots * cwidth), zero_want = zeroed;
      for (int g = 0; g < groups; g++)
        std::fill(zero_want.begin() + ((size_t)g * slots + want[g]) * cwidth, zero_want.begin() + (size_t)(g + 1) * slots * cwidth, 0.0f);
      LAUNCH(3, 64, mk_expert_rows_zero, want, zeroed, groups, slots, cwidth);
      c.bits("expert GEMM over another's counts: the rows past them zeroed (mk_expert_rows_zero)", zero_want, zeroed);
      // cwidth < 0 (nothing reads the rows past them): only an empty block's row 0 zeroed.
      auto row0 = randn((size_t)groups * slots * cwidth), row0_want = row0;
      for (int g = 0; g < groups; g++)
        if (want[g] == 0) std::fill_n(row0_want.begin() + (size_t)g * slots * cwidth, cwidth, 0.0f);
      LAUNCH(2, 64, mk_expert_rows_zero, want, row0, groups, slots, -cwidth);
      c.bits("expert GEMM over another's counts, rows past them unread (cwidth < 0): an empty block's row 0 zeroed, the rest left", row0_want, row0);
    }
    {  // The counts from the routing (mk_expert_counts_route): 3 experts, 2 routing groups of 25 and 26
       // tokens, 2 choices a token, 11 slots an expert a group: an expert with no choice in group 1,
       // dropped choices (-1), a full block, a hole (a location nobody holds below the last).
      const int s = 51, k = 2, e = 3, g = 2, rows = 11, groups = e * g, cwidth = 7;
      std::vector<int> idx((size_t)s * k), loc((size_t)s * k, -1), want(4 * groups, 0);
      for (int t = 0; t < s; t++)
        for (int j = 0; j < k; j++) idx[(size_t)t * k + j] = t >= 25 ? (j == 1 && t % 5 == 0 ? 0 : 1) : (t * 7 + j * 5) % 3;   // group 1: experts 0, 1
      for (int gi = 0; gi < g; gi++)
        for (int x = 0; x < e; x++) {   // numbered in token order, dropped past the capacity
          int next = 0, t0 = gi == 0 ? 0 : 25, t1 = gi == 0 ? 25 : s;
          for (int t = t0; t < t1; t++)
            for (int j = 0; j < k; j++)
              if (idx[(size_t)t * k + j] == x) {
                loc[(size_t)t * k + j] = next < rows ? next : -1;
                next++;
              }
          want[x * g + gi] = std::min(next, rows);
        }
      for (int c0 = 0; c0 < s * k; c0++)   // a hole: expert 0's location 3 of group 0 dropped
        if (idx[c0] == 0 && loc[c0] == 3 && c0 < 25 * k) loc[c0] = -1;
      for (int G = 0; G < groups; G++) {
        want[groups + G] = std::max(want[G], 1);
        want[2 * groups + G] = want[3 * groups + G] = std::min(want[G] + 1, rows);
      }
      if (want[2 * g + 1] != 0 || want[0] != rows || want[1] == rows) c.fail("mk_expert_counts_route's case lacks an empty, a full or a partial block");
      auto out = randn((size_t)groups * rows * cwidth), out_want = out, out_in = out;
      for (int G = 0; G < groups; G++)
        std::fill(out_want.begin() + ((size_t)G * rows + want[G]) * cwidth, out_want.begin() + (size_t)(G + 1) * rows * cwidth, 0.0f);
      std::vector<int> got(4 * groups, -7);
      LAUNCH(5, MK_BLOCK, mk_expert_counts_route, idx, got, out, groups, rows, s, cwidth, 3, loc, k, g);   // parts of 3 rows
      c.same("expert GEMM routed rows (mk_expert_counts_route: 2 routing groups, parts of 3 rows)", want, got);
      c.bits("expert GEMM routed rows: the result's rows past them zeroed, the others left", out_want, out);
      std::fill(got.begin(), got.end(), -7);
      auto lazy = out_in;
      LAUNCH(64, MK_BLOCK, mk_expert_counts_route, idx, got, lazy, groups, rows, s, -cwidth, 1, loc, k, g);   // a part a row
      c.same("expert GEMM routed rows, a part a row (cwidth < 0)", want, got);
      size_t bad = lazy.size();
      for (size_t i = 0; i < lazy.size() && bad == lazy.size(); i++) {
        bool past = (int64_t)(i / cwidth) % rows >= want[i / cwidth / rows];
        bool kept = memcmp(&lazy[i], &out_in[i], sizeof lazy[i]) == 0;
        bool row0 = want[i / cwidth / rows] == 0 && (i / cwidth) % rows == 0;   // an empty block's row 0
        if (row0 ? lazy[i] != 0.0f : past ? !(kept || lazy[i] != lazy[i]) : !kept) bad = i;
      }
      if (bad == lazy.size()) c.ok("expert GEMM routed rows (cwidth < 0): the rows past them not zeroed (NaN where MK_POISON) but an empty block's row 0, the others left");
      else c.fail("expert GEMM routed rows (cwidth < 0): element %zu is %.9g, was %.9g", bad, lazy[bad], out_in[bad]);
      std::fill(got.begin(), got.end(), -7);
      LAUNCH(2, MK_BLOCK, mk_expert_counts_route, idx, got, out_in, groups, rows, s, 0, rows, loc, k, g);   // ta: no result
      c.same("expert GEMM routed rows of a weight gradient (cwidth 0, a part a block)", want, got);
    }
    // moec's grouped GEMM on tensor cores (mk_expert_gemm_tc: bf16 operands, fp32 sums) over the
    // counted rows, against sums in double of the same bf16 values: within 1e-3 of the largest
    // element (the sums' order differs). Forms: blocks 1 with 2 row tiles and 2 column tiles, a
    // partial k step and a full expert; blocks 2 with tb, an odd n and an empty block; a weight
    // gradient (ta) over 3 k steps, one expert with no rows. c starts at 7: the rows past a
    // count must stay (!ta); the slots past a count hold NaN in both operands of the weight
    // gradient (summing one shows). The grid (3 blocks) is smaller than the tiles.
    // The same forms on Hopper's warpgroup MMA (mk_expert_gemm_wg, then _wg256: 256 threads, their
    // dynamic shared memory) where the launcher has them (L.wg: the emulation always, a GPU of
    // compute capability 9.0), with k over several of their steps of 64 (4, 3 and 3: the copies two
    // steps ahead, a partial last step).
    for (int form = 0; form < (L.wg ? 9 : 3); form++) {
      const bool wg = form >= 3, wide = form >= 6;
      const int f = form % 3;
      const bool ta = f == 2, tb = f == 1;
      const int e = 2, blocks = f == 1 ? 2 : 1;
      const int m = f == 0 ? 136 : f == 1 ? 48 : 24, n = f == 0 ? 136 : f == 1 ? 21 : 40,
                k = f == 0 ? (wg ? 200 : 40) : f == 1 ? (wg ? 136 : 24) : (wg ? 200 : 72);
      const std::vector<int> counts = f == 0 ? std::vector<int>{136, 3} : f == 1 ? std::vector<int>{0, 24, 17, 5}
                                                                              : std::vector<int>{wg ? 150 : 70, 0};
      const int per = ta ? k : m / blocks;   // slots a group
      auto af = randn((size_t)e * m * k), bf = randn((size_t)e * k * n);
      if (ta)   // NaN in the slots past the counts: a [e, k, m] and b [e, k, n]
        for (int x = 0; x < e; x++)
          for (int r = counts[(size_t)x]; r < per; r++) {
            std::fill_n(af.begin() + ((size_t)x * k + r) * m, m, NAN);
            std::fill_n(bf.begin() + ((size_t)x * k + r) * n, n, NAN);
          }
      std::vector<uint16_t> a16(af.size()), b16(bf.size());
      rt_compress_bf16(af.data(), a16.data(), (int64_t)af.size());
      rt_compress_bf16(bf.data(), b16.data(), (int64_t)bf.size());
      rt_decompress_bf16(a16.data(), af.data(), (int64_t)af.size());
      rt_decompress_bf16(b16.data(), bf.data(), (int64_t)bf.size());
      std::vector<float> want((size_t)e * m * n, 7.0f), got(want.size(), 7.0f);
      for (int x = 0; x < e; x++)
        for (int r = 0; r < m; r++) {
          int grp = ta ? x : x * blocks + r / per, count = counts[(size_t)grp];
          if (!ta && r % per >= count) continue;
          for (int j = 0; j < n; j++) {
            double sum = 0.0;
            for (int q = 0; q < (ta ? count : k); q++)
              sum += (double)(ta ? af[((size_t)x * k + q) * m + r] : af[((size_t)x * m + r) * k + q]) *
                     (double)(tb ? bf[((size_t)x * n + j) * k + q] : bf[((size_t)x * k + q) * n + j]);
            want[((size_t)x * m + r) * n + j] = (float)sum;
          }
        }
      if (wg) {
        if (wide)
          LAUNCH_SHARED(3, 256, MK_WG_SHARED(256), mk_expert_gemm_wg256, a16, b16, got, counts, e, m, n, k, (int)ta, (int)tb, blocks);
        else
          LAUNCH_SHARED(3, 256, MK_WG_SHARED(128), mk_expert_gemm_wg, a16, b16, got, counts, e, m, n, k, (int)ta, (int)tb, blocks);
        std::string name = std::string("expert GEMM on wgmma") + (wide ? " (128 x 256 tiles)" : "") +
                           (f == 0   ? " over the counted rows (2 row tiles, 4 k steps)"
                            : f == 1 ? ", tb, blocks 2 (an empty one), n 21, 3 k steps"
                                     : ", a weight gradient (ta) over the counted slots (3 k steps), an expert of none");
        c.near(name.c_str(), want, got, 1e-3);
        continue;
      }
      LAUNCH(3, 128, mk_expert_gemm_tc, a16, b16, got, counts, e, m, n, k, (int)ta, (int)tb, blocks);
      c.near(f == 0   ? "expert GEMM on tensor cores over the counted rows (mk_expert_gemm_tc: 2 x 2 tiles, 2 k steps)"
             : f == 1 ? "expert GEMM on tensor cores, tb, blocks 2 (an empty one), n 21"
                      : "expert GEMM on tensor cores, a weight gradient (ta) over the counted slots, an expert of none",
             want, got, 1e-3);
    }
    rt_gelu(a.data(), y_c.data(), n, m);
    LAUNCH(3, 64, mk_gelu, a, y_k, n, (int64_t)m);
    c.same("act.gelu", y_c, y_k);
    {  // repeated rows (an expert's empty slots after bias): rt_gelu copies them, mk_gelu computes
      auto rep = a;
      for (int r = 2; r < s; r += 3) std::copy(rep.begin() + (size_t)(r - 1) * m, rep.begin() + (size_t)r * m, rep.begin() + (size_t)r * m);
      rt_gelu(rep.data(), y_c.data(), n, m);
      LAUNCH(3, 64, mk_gelu, rep, y_k, n, (int64_t)m);
      c.same("act.gelu (repeated rows)", y_c, y_k);
    }
    rt_gelu_grad(b.data(), a.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_gelu_grad, b, a, y_k, n);
    c.same("act.gelu.grad", y_c, y_k);
    rt_relu(a.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_relu, a, y_k, n);
    c.same("act.relu", y_c, y_k);
    rt_relu_grad(b.data(), a.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_relu_grad, b, a, y_k, n);
    c.same("act.relu.grad", y_c, y_k);
    rt_silu(a.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_silu, a, y_k, n);
    c.same("act.silu", y_c, y_k);
    rt_silu_grad(b.data(), a.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_silu_grad, b, a, y_k, n);
    c.same("act.silu.grad", y_c, y_k);
    rt_relu2(a.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_relu2, a, y_k, n);
    c.bits("act.relu2", y_c, y_k);
    rt_relu2_grad(b.data(), a.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_relu2_grad, b, a, y_k, n);
    c.bits("act.relu2.grad", y_c, y_k);
    {  // gpt-oss's clamped SwiGLU on gate and up values past both sides of the clamps (|x| up to
       // about 20 where 7 clamps), with gradients of zero (+0 and -0: an expert's empty slots)
      auto g = randn(n, 5.0f), u = randn(n, 5.0f), dy = randn(n);
      for (size_t i = 0; i < n; i += 7) dy[i] = i % 2 ? -0.0f : 0.0f;
      rt_oss(g.data(), u.data(), y_c.data(), n);
      LAUNCH(3, 64, mk_oss, g, u, y_k, n);
      c.bits("act.oss", y_c, y_k);
      rt_oss_grad_gate(dy.data(), g.data(), u.data(), y_c.data(), n);
      LAUNCH(3, 64, mk_oss_grad_gate, dy, g, u, y_k, n);
      c.bits("act.oss.grad_gate", y_c, y_k);
      rt_oss_grad_up(dy.data(), g.data(), u.data(), y_c.data(), n);
      LAUNCH(3, 64, mk_oss_grad_up, dy, g, u, y_k, n);
      c.bits("act.oss.grad_up", y_c, y_k);
    }
    rt_sigmoid(a.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_sigmoid, a, y_k, n);
    c.same("gate.sigmoid", y_c, y_k);
    auto sg_c = zeros<float>(n), sg_k = zeros<float>(n);
    rt_sigmoid_grad(b.data(), y_c.data(), sg_c.data(), n);
    LAUNCH(3, 64, mk_sigmoid_grad, b, y_c, sg_k, n);
    c.same("gate.sigmoid.grad", sg_c, sg_k);
    auto db_c = zeros<float>(m), db_k = zeros<float>(m);
    rt_bias_grad(a.data(), db_c.data(), s, m);
    LAUNCH(1, 32, mk_bias_grad, a, db_k, s, m);
    c.same("bias.grad", db_c, db_k);
    auto eb_c = zeros<float>(4 * m), eb_k = zeros<float>(4 * m);
    rt_expert_bias_grad(a.data(), eb_c.data(), 4, s / 4, m);
    LAUNCH(2, 32, mk_expert_bias_grad, a, eb_k, 4, s / 4, m);
    c.same("expert.bias.grad", eb_c, eb_k);
    rt_l2norm(a.data(), y_c.data(), s, m);
    LAUNCH(5, MK_BLOCK, mk_l2norm, a, y_k, s, m);
    c.same("l2norm", y_c, y_k);
    rt_l2norm_grad(b.data(), a.data(), y_c.data(), s, m);
    LAUNCH(5, MK_BLOCK, mk_l2norm_grad, b, a, y_k, s, m);
    c.same("l2norm.grad", y_c, y_k);
    rt_rmsnorm(a.data(), y_c.data(), s, m, 1e-5f);
    LAUNCH(5, MK_BLOCK, mk_rmsnorm, a, y_k, s, m, 1e-5f);
    c.same("norm.rms", y_c, y_k);
    rt_rmsnorm_grad(b.data(), a.data(), y_c.data(), s, m, 1e-5f);
    LAUNCH(5, MK_BLOCK, mk_rmsnorm_grad, b, a, y_k, s, m, 1e-5f);
    c.same("norm.rms.grad", y_c, y_k);
    rt_layernorm(a.data(), y_c.data(), s, m, 1e-5f);
    LAUNCH(5, MK_BLOCK, mk_layernorm, a, y_k, s, m, 1e-5f);
    c.same("norm.layer", y_c, y_k);
    rt_layernorm_grad(b.data(), a.data(), y_c.data(), s, m, 1e-5f);
    LAUNCH(5, MK_BLOCK, mk_layernorm_grad, b, a, y_k, s, m, 1e-5f);
    c.same("norm.layer.grad", y_c, y_k);
    std::vector<float> wcol(b.begin(), b.begin() + m), dw_c = zeros<float>(m), dw_k = zeros<float>(m);
    rt_scale_cols(a.data(), wcol.data(), y_c.data(), s, m);
    LAUNCH(3, 64, mk_scale_cols, a, wcol, y_k, s, m);
    c.same("scale", y_c, y_k);
    rt_scale_cols_grad_w(b.data(), a.data(), dw_c.data(), s, m);
    LAUNCH(1, 32, mk_scale_cols_grad_w, b, a, dw_k, s, m);
    c.same("scale.grad_w", dw_c, dw_k);
    std::vector<float> grow(b.begin(), b.begin() + s), dg_c = zeros<float>(s), dg_k = zeros<float>(s);
    rt_scale_rows(a.data(), grow.data(), y_c.data(), s, m);
    LAUNCH(3, 64, mk_scale_rows, a, grow, y_k, s, m);
    c.same("scale_rows", y_c, y_k);
    rt_scale_rows_grad_g(b.data(), a.data(), dg_c.data(), s, m);
    LAUNCH(1, 32, mk_scale_rows_grad_g, b, a, dg_k, s, m);
    c.same("scale_rows.grad_g", dg_c, dg_k);
    {  // embed: 11 rows, tokens of the s positions (one out of range: a zero row)
      const int v = 11;
      std::vector<int32_t> tok(s);
      for (int i = 0; i < s; i++) tok[i] = (i * 7 + 3) % v;
      tok[5] = v;
      std::vector<float> table(a.begin(), a.begin() + v * m), dt_c = zeros<float>(v * m), dt_k = zeros<float>(v * m);
      rt_embed(tok.data(), table.data(), y_c.data(), s, m, v, 0);
      LAUNCH(3, 64, mk_embed, tok, table, y_k, s, m, v, (i64)0);
      c.same("embed", y_c, y_k);
      rt_embed_grad(b.data(), tok.data(), dt_c.data(), s, m, v, 0);
      LAUNCH(1, 32, mk_embed_grad, b, tok, dt_k, s, m, v, (i64)0);
      c.same("embed.grad", dt_c, dt_k);
      // a vocabulary-parallel rank's rows: tokens [4, 4 + 7) of the table's first 7 rows
      rt_embed(tok.data(), table.data(), y_c.data(), s, m, 7, 4);
      LAUNCH(3, 64, mk_embed, tok, table, y_k, s, m, 7, (i64)4);
      c.same("embed, rows from token 4", y_c, y_k);
      rt_embed_grad(b.data(), tok.data(), dt_c.data(), s, m, 7, 4);
      LAUNCH(1, 32, mk_embed_grad, b, tok, dt_k, s, m, 7, (i64)4);
      c.same("embed.grad, rows from token 4", dt_c, dt_k);
    }
    {  // causal grouped-query attention: 2 samples of 13 positions, 4 heads over 2 kv heads, d 6;
       // learned positions; the slice of the packed gradient
      const int seq = 13, rows = 2 * seq, H = 4, KV = 2, d = 6, qc = H * d, kc = KV * d, w = qc + 2 * kc;
      auto q = randn((size_t)rows * qc), kk = randn((size_t)rows * kc), vv = randn((size_t)rows * kc);
      auto dy = randn((size_t)rows * qc);
      auto o_c = zeros<float>(rows * qc), o_k = zeros<float>(rows * qc);
      rt_attn_fwd(q.data(), kk.data(), vv.data(), o_c.data(), rows, seq, H, KV, qc, 0, 0.0f);
      LAUNCH(2, 32, mk_attn_fwd, q, kk, vv, o_k, rows, seq, H, KV, qc, 0, 0.0f);
      c.same("attn.causal", o_c, o_k);
      auto st_c = zeros<float>(rows * 2 * H), st_k = zeros<float>(rows * 2 * H);
      rt_attn_stats(dy.data(), q.data(), kk.data(), o_c.data(), st_c.data(), rows, seq, H, KV, qc, 0, 0.0f);
      LAUNCH(2, 32, mk_attn_stats, dy, q, kk, o_c, st_k, rows, seq, H, KV, qc, 0, 0.0f);
      c.same("attn.causal.stats", st_c, st_k);
      auto g_c = zeros<float>(rows * w), g_k = zeros<float>(rows * w);
      rt_attn_grad_q(dy.data(), q.data(), kk.data(), vv.data(), st_c.data(), g_c.data(), rows, seq, H, KV, qc, 0, 0.0f);
      rt_attn_grad_kv(dy.data(), q.data(), kk.data(), vv.data(), st_c.data(), g_c.data(), rows, seq, H, KV, qc, 0, 0.0f);
      LAUNCH(2, 32, mk_attn_grad_q, dy, q, kk, vv, st_c, g_k, rows, seq, H, KV, qc, 0, 0.0f);
      LAUNCH(2, 16, mk_attn_grad_kv, dy, q, kk, vv, st_c, g_k, rows, seq, H, KV, qc, 0, 0.0f);
      c.same("attn.causal.grad", g_c, g_k);
      auto sl_c = zeros<float>(rows * kc), sl_k = zeros<float>(rows * kc);
      rt_cols_slice(g_c.data(), sl_c.data(), rows, w, qc, kc);
      LAUNCH(2, 64, mk_cols_slice, g_c, sl_k, rows, w, qc, kc);
      c.same("cols.slice", sl_c, sl_k);
      auto tab = randn((size_t)seq * qc), pa_c = zeros<float>(rows * qc), pa_k = zeros<float>(rows * qc);
      rt_pos_add(q.data(), tab.data(), pa_c.data(), rows, qc, seq);
      LAUNCH(3, 64, mk_pos_add, q, tab, pa_k, rows, qc, seq);
      c.same("pos.add", pa_c, pa_k);
      auto pg_c = zeros<float>(seq * qc), pg_k = zeros<float>(seq * qc);
      rt_pos_add_grad(dy.data(), pg_c.data(), rows, qc, seq);
      LAUNCH(2, 64, mk_pos_add_grad, dy, pg_k, rows, qc, seq);
      c.same("pos.add.grad_w", pg_c, pg_k);
    }
    // The tiled attention kernels on more shapes: query tiles of a block's threads / 8 rows (seq 37
    // over blocks of 16 and 8: several tiles per sample, a partial last one), steps of 32 keys
    // (seq 37 and 40: two, the last partial), chunks of 32 columns (d 6: one partial; d 70: three)
    // and passes of MK_ATTN_D output columns (tests/cuda/run.sh builds this emulation with 32, so
    // d 70 takes three), MQA.
    for (auto [seq, H, KV, d, block] : {std::array<int, 5>{37, 2, 1, 6, 16}, std::array<int, 5>{37, 4, 2, 6, 8},
                                        std::array<int, 5>{9, 2, 2, 32, 8}, std::array<int, 5>{40, 2, 1, 70, 16}}) {
      const int rows = 2 * seq, qc = H * d, kc = KV * d, w = qc + 2 * kc;
      auto q = randn((size_t)rows * qc), kk = randn((size_t)rows * kc), vv = randn((size_t)rows * kc);
      auto dy = randn((size_t)rows * qc);
      auto o_c = zeros<float>(rows * qc), o_k = zeros<float>(rows * qc);
      auto st_c = zeros<float>(rows * 2 * H), st_k = zeros<float>(rows * 2 * H);
      auto g_c = zeros<float>(rows * w), g_k = zeros<float>(rows * w);
      rt_attn_fwd(q.data(), kk.data(), vv.data(), o_c.data(), rows, seq, H, KV, qc, 0, 0.0f);
      rt_attn_stats(dy.data(), q.data(), kk.data(), o_c.data(), st_c.data(), rows, seq, H, KV, qc, 0, 0.0f);
      rt_attn_grad_q(dy.data(), q.data(), kk.data(), vv.data(), st_c.data(), g_c.data(), rows, seq, H, KV, qc, 0, 0.0f);
      rt_attn_grad_kv(dy.data(), q.data(), kk.data(), vv.data(), st_c.data(), g_c.data(), rows, seq, H, KV, qc, 0, 0.0f);
      LAUNCH(3, block, mk_attn_fwd, q, kk, vv, o_k, rows, seq, H, KV, qc, 0, 0.0f);
      LAUNCH(2, block, mk_attn_stats, dy, q, kk, o_c, st_k, rows, seq, H, KV, qc, 0, 0.0f);
      LAUNCH(3, block, mk_attn_grad_q, dy, q, kk, vv, st_c, g_k, rows, seq, H, KV, qc, 0, 0.0f);
      LAUNCH(2, block, mk_attn_grad_kv, dy, q, kk, vv, st_c, g_k, rows, seq, H, KV, qc, 0, 0.0f);
      std::string shape = " (seq " + std::to_string(seq) + ", d " + std::to_string(d) + ", block " + std::to_string(block) + ")";
      c.same(("attn.causal" + shape).c_str(), o_c, o_k);
      c.same(("attn.causal.stats" + shape).c_str(), st_c, st_k);
      c.same(("attn.causal.grad" + shape).c_str(), g_c, g_k);
    }
    // Sliding windows (keys i - W < j <= i): a window inside one step of keys (3), one spanning
    // several query tiles (11) and one several steps of keys (40 over seq 70), a window of 1 (each
    // query sees itself), one as long as the sequence (the causal mask: the same bits as no
    // window), and d 32.
    for (auto [seq, H, KV, d, block, window] :
         {std::array<int, 6>{37, 2, 1, 6, 16, 3}, std::array<int, 6>{37, 4, 2, 6, 8, 11}, std::array<int, 6>{37, 2, 2, 6, 8, 1}, std::array<int, 6>{70, 2, 1, 6, 16, 40},
          std::array<int, 6>{13, 2, 1, 6, 8, 13}, std::array<int, 6>{9, 2, 2, 32, 8, 4}}) {
      const int rows = 2 * seq, qc = H * d, kc = KV * d, w = qc + 2 * kc;
      auto q = randn((size_t)rows * qc), kk = randn((size_t)rows * kc), vv = randn((size_t)rows * kc);
      auto dy = randn((size_t)rows * qc);
      auto o_c = zeros<float>(rows * qc), o_k = zeros<float>(rows * qc), o_0 = zeros<float>(rows * qc);
      auto st_c = zeros<float>(rows * 2 * H), st_k = zeros<float>(rows * 2 * H);
      auto g_c = zeros<float>(rows * w), g_k = zeros<float>(rows * w);
      float sc = d == 32 ? 0.37f : 0.0f;   // a scale of the scores other than 1/sqrt(d) (yarn's mscale), once
      rt_attn_fwd(q.data(), kk.data(), vv.data(), o_c.data(), rows, seq, H, KV, qc, window, sc);
      rt_attn_stats(dy.data(), q.data(), kk.data(), o_c.data(), st_c.data(), rows, seq, H, KV, qc, window, sc);
      rt_attn_grad_q(dy.data(), q.data(), kk.data(), vv.data(), st_c.data(), g_c.data(), rows, seq, H, KV, qc, window, sc);
      rt_attn_grad_kv(dy.data(), q.data(), kk.data(), vv.data(), st_c.data(), g_c.data(), rows, seq, H, KV, qc, window, sc);
      LAUNCH(3, block, mk_attn_fwd, q, kk, vv, o_k, rows, seq, H, KV, qc, window, sc);
      LAUNCH(2, block, mk_attn_stats, dy, q, kk, o_c, st_k, rows, seq, H, KV, qc, window, sc);
      LAUNCH(3, block, mk_attn_grad_q, dy, q, kk, vv, st_c, g_k, rows, seq, H, KV, qc, window, sc);
      LAUNCH(2, block, mk_attn_grad_kv, dy, q, kk, vv, st_c, g_k, rows, seq, H, KV, qc, window, sc);
      std::string shape = " (seq " + std::to_string(seq) + ", d " + std::to_string(d) + ", block " + std::to_string(block) +
                          ", window " + std::to_string(window) + (sc > 0 ? ", scale 0.37" : "") + ")";
      c.same(("attn.causal" + shape).c_str(), o_c, o_k);
      c.same(("attn.causal.stats" + shape).c_str(), st_c, st_k);
      c.same(("attn.causal.grad" + shape).c_str(), g_c, g_k);
      if (window >= seq) {   // the causal mask itself
        rt_attn_fwd(q.data(), kk.data(), vv.data(), o_0.data(), rows, seq, H, KV, qc, 0, 0.0f);
        c.same(("attn.causal without a window" + shape).c_str(), o_0, o_c);
      }
      // gpt-oss's sinks (a logit per head, one above every score of its rows' softmax, once):
      // the forward, the statistics (their logsumexp holds the sink), the backward through them
      // and the sinks' gradient.
      auto sinks = randn((size_t)H);
      if (window == 11) sinks[1] = 30.0f;
      auto ds_c = zeros<float>(H), ds_k = zeros<float>(H);
      rt_attn_sink_fwd(q.data(), kk.data(), vv.data(), sinks.data(), o_c.data(), rows, seq, H, KV, qc, window, sc);
      rt_attn_sink_stats(dy.data(), q.data(), kk.data(), o_c.data(), sinks.data(), st_c.data(), rows, seq, H, KV, qc, window, sc);
      rt_attn_grad_q(dy.data(), q.data(), kk.data(), vv.data(), st_c.data(), g_c.data(), rows, seq, H, KV, qc, window, sc);
      rt_attn_grad_kv(dy.data(), q.data(), kk.data(), vv.data(), st_c.data(), g_c.data(), rows, seq, H, KV, qc, window, sc);
      rt_attn_sink_grad(st_c.data(), sinks.data(), ds_c.data(), rows, H);
      LAUNCH(3, block, mk_attn_sink_fwd, q, kk, vv, sinks, o_k, rows, seq, H, KV, qc, window, sc);
      LAUNCH(2, block, mk_attn_sink_stats, dy, q, kk, o_c, sinks, st_k, rows, seq, H, KV, qc, window, sc);
      LAUNCH(1, 32, mk_attn_sink_grad, st_c, sinks, ds_k, rows, H);
      c.same(("attn.sink" + shape).c_str(), o_c, o_k);
      c.same(("attn.sink.stats" + shape).c_str(), st_c, st_k);
      c.same(("attn.sink.grad" + shape).c_str(), ds_c, ds_k);
      if (window == 11) {   // a sink far above the scores takes the weight: head 1's outputs vanish
        float big0 = 0.0f, big1 = 0.0f;
        for (int r = 0; r < rows; r++)
          for (int e = 0; e < d; e++)
            big0 = fmaxf(big0, fabsf(o_c[(size_t)r * qc + e])), big1 = fmaxf(big1, fabsf(o_c[(size_t)r * qc + d + e]));
        if (big1 < 1e-6f && big0 > 1e-2f) c.ok("attn.sink: a sink of 30 leaves its head's outputs at most %.2g", big1);
        else c.fail("attn.sink: a sink of 30 leaves its head's outputs at %.3g (head 0: %.3g)", big1, big0);
      }
    }
    // Attention on tensor cores (dtype bf16: bf16 operands, fp32 sums, the softmax online), against
    // the CPU kernels on the inputs rounded to bf16 as the kernels round them: within 2e-2 of each
    // result's largest element (the weights p and dS are rounded to bf16 too: about 4e-3 is seen; a
    // fragment in the wrong lane or a wrong mask is off by the size of the values). Shapes: blocks
    // of 2 warps (32 rows) and of 8 (128), a sample in several row tiles with a partial last one,
    // several steps of keys (32) and queries (16), heads of 16, 32 and 64 columns, GQA and MQA,
    // windows within a step and across several, the scale of yarn, sinks (one far above the
    // scores). The grad kernels take the CPU's statistics, so each kernel is checked alone.
    for (auto [seq, H, KV, d, block, window, sinked] :
         {std::array<int, 7>{37, 4, 2, 16, 64, 0, 0}, std::array<int, 7>{70, 2, 1, 32, 64, 11, 1},
          std::array<int, 7>{70, 2, 2, 16, 256, 40, 0}, std::array<int, 7>{19, 2, 1, 64, 64, 0, 1},
          std::array<int, 7>{150, 1, 1, 16, 256, 0, 0}}) {
      const int rows = 2 * seq, qc = H * d, kc = KV * d, w = qc + 2 * kc;
      auto q = randn((size_t)rows * qc), kk = randn((size_t)rows * kc), vv = randn((size_t)rows * kc);
      auto dy = randn((size_t)rows * qc), sinks = randn((size_t)H);
      if (sinked && H > 1) sinks[1] = 30.0f;
      auto round = [](std::vector<float> x) {   // to bf16 and back, as the kernels stage their operands
        std::vector<uint16_t> h(x.size());
        rt_compress_bf16(x.data(), h.data(), (int64_t)x.size());
        rt_decompress_bf16(h.data(), x.data(), (int64_t)x.size());
        return x;
      };
      auto qr = round(q), kr = round(kk), vr = round(vv), yr = round(dy);
      auto o_c = zeros<float>(rows * qc), o_k = zeros<float>(rows * qc);
      auto st_c = zeros<float>(rows * 2 * H), st_k = zeros<float>(rows * 2 * H);
      auto g_c = zeros<float>(rows * w), g_k = zeros<float>(rows * w);
      float sc = d == 32 ? 0.37f : 0.0f;
      if (sinked) {
        rt_attn_sink_fwd(qr.data(), kr.data(), vr.data(), sinks.data(), o_c.data(), rows, seq, H, KV, qc, window, sc);
        rt_attn_sink_stats(dy.data(), qr.data(), kr.data(), o_c.data(), sinks.data(), st_c.data(), rows, seq, H, KV, qc, window, sc);
        LAUNCH(3, block, mk_attn_tc_sink_fwd, q, kk, vv, sinks, o_k, rows, seq, H, KV, qc, window, sc);
        LAUNCH(2, block, mk_attn_tc_sink_stats, dy, q, kk, o_c, sinks, st_k, rows, seq, H, KV, qc, window, sc);
      } else {
        rt_attn_fwd(qr.data(), kr.data(), vr.data(), o_c.data(), rows, seq, H, KV, qc, window, sc);
        rt_attn_stats(dy.data(), qr.data(), kr.data(), o_c.data(), st_c.data(), rows, seq, H, KV, qc, window, sc);
        LAUNCH(3, block, mk_attn_tc_fwd, q, kk, vv, o_k, rows, seq, H, KV, qc, window, sc);
        LAUNCH(2, block, mk_attn_tc_stats, dy, q, kk, o_c, st_k, rows, seq, H, KV, qc, window, sc);
      }
      rt_attn_grad_q(yr.data(), qr.data(), kr.data(), vr.data(), st_c.data(), g_c.data(), rows, seq, H, KV, qc, window, sc);
      rt_attn_grad_kv(yr.data(), qr.data(), kr.data(), vr.data(), st_c.data(), g_c.data(), rows, seq, H, KV, qc, window, sc);
      LAUNCH(3, block, mk_attn_tc_grad_q, dy, q, kk, vv, st_c, g_k, rows, seq, H, KV, qc, window, sc);
      LAUNCH(2, block, mk_attn_tc_grad_kv, dy, q, kk, vv, st_c, g_k, rows, seq, H, KV, qc, window, sc);
      std::string shape = " (seq " + std::to_string(seq) + ", " + std::to_string(H) + " heads over " + std::to_string(KV) +
                          ", d " + std::to_string(d) + ", block " + std::to_string(block) + ", window " +
                          std::to_string(window) + (sc > 0 ? ", scale 0.37" : "") + (sinked ? ", sinks" : "") + ")";
      c.near(("attn on tensor cores" + shape).c_str(), o_c, o_k, 2e-2);
      std::vector<float> lse_c, lse_k, dd_c, dd_k;   // the logsumexps, and D (dy . o, from the same o: fp32 alike)
      for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2 * H; h++)
          (h < H ? lse_c : dd_c).push_back(st_c[(size_t)r * 2 * H + h]), (h < H ? lse_k : dd_k).push_back(st_k[(size_t)r * 2 * H + h]);
      c.near(("attn on tensor cores, statistics' logsumexp" + shape).c_str(), lse_c, lse_k, 1e-2);
      c.same(("attn on tensor cores, statistics' dy . o" + shape).c_str(), dd_c, dd_k);
      for (int part = 0; part < 3; part++) {   // dq, dk, dv: each within 2e-2 of its own largest
        int off = part == 0 ? 0 : part == 1 ? qc : qc + kc, width = part == 0 ? qc : kc;
        std::vector<float> a, b;
        for (int r = 0; r < rows; r++)
          for (int e = 0; e < width; e++) a.push_back(g_c[(size_t)r * w + off + e]), b.push_back(g_k[(size_t)r * w + off + e]);
        c.near(("attn on tensor cores, " + std::string(part == 0 ? "dq" : part == 1 ? "dk" : "dv") + shape).c_str(), a, b, 2e-2);
      }
    }
    {  // YaRN's frequencies and scaled cos and sin (the theta must make the ramp fall inside the pairs)
      rt_rope(a.data(), y_c.data(), s, m, 4, 12, 10000.0f, 1, 0, 1, 4.0f, 8, 1, 32.0f, 1.0f, 1.25f);
      LAUNCH(3, 64, mk_rope, a, y_k, s, m, 4, 12, 10000.0f, 1, 0, 1, 4.0f, 8, 1, 32.0f, 1.0f, 1.25f);
      c.same("rope, yarn", y_c, y_k);
      rt_rope(a.data(), y_c.data(), s, m, 4, 12, 10000.0f, 1, 0, 1, 4.0f, 8, 0, 32.0f, 1.0f, 1.25f);
      LAUNCH(3, 64, mk_rope, a, y_k, s, m, 4, 12, 10000.0f, 1, 0, 1, 4.0f, 8, 0, 32.0f, 1.0f, 1.25f);
      c.same("rope, yarn without truncation (gpt-oss)", y_c, y_k);
    }
    for (int k = 0; k < 4; k++) {   // whole heads, then a quarter of each (a partial rotary factor); halves, then adjacent pairs
      int rotary = k % 2 ? 2 * (m / 4 / 4) : 0, il = k / 2;
      std::string what = std::string(rotary ? ", partial" : "") + (il ? ", interleaved" : "");
      rt_rope(a.data(), y_c.data(), s, m, 4, 12, 10000.0f, 1, rotary, il, 0.0f, 0, 1, 32.0f, 1.0f, 1.0f);
      LAUNCH(3, 64, mk_rope, a, y_k, s, m, 4, 12, 10000.0f, 1, rotary, il, 0.0f, 0, 1, 32.0f, 1.0f, 1.0f);
      c.same(("rope" + what).c_str(), y_c, y_k);
      rt_rope(a.data(), y_c.data(), s, m, 4, 12, 10000.0f, -1, rotary, il, 0.0f, 0, 1, 32.0f, 1.0f, 1.0f);
      LAUNCH(3, 64, mk_rope, a, y_k, s, m, 4, 12, 10000.0f, -1, rotary, il, 0.0f, 0, 1, 32.0f, 1.0f, 1.0f);
      c.same(("rope.grad" + what).c_str(), y_c, y_k);
    }
    {  // MLA's parts of heads: 4 heads of m/4 columns
      int d = m / 4, off = 1, w = d / 2;
      auto hs_c = zeros<float>(s * 4 * w), hs_k = zeros<float>(s * 4 * w);
      rt_heads_slice(a.data(), hs_c.data(), s, m, 4, off, w);
      LAUNCH(3, 64, mk_heads_slice, a, hs_k, s, m, 4, off, w);
      c.same("heads.slice", hs_c, hs_k);
      auto hp_c = zeros<float>(s * m), hp_k = zeros<float>(s * m);
      rt_heads_place(hs_c.data(), hp_c.data(), s, 4, off, w, d);
      LAUNCH(3, 64, mk_heads_place, hs_c, hp_k, s, 4, off, w, d);
      c.same("heads.place", hp_c, hp_k);
      auto hc_c = zeros<float>(s * 4 * (w + d)), hc_k = zeros<float>(s * 4 * (w + d));
      for (int ah : {1, 4}) {
        std::vector<float> part(hs_c.begin(), hs_c.begin() + s * ah * w);   // [s, ah*w]
        rt_heads_cat(part.data(), a.data(), hc_c.data(), s, ah * w, m, 4, ah);
        LAUNCH(3, 64, mk_heads_cat, part, a, hc_k, s, ah * w, m, 4, ah);
        c.same(ah == 1 ? "heads.cat, a shared head" : "heads.cat", hc_c, hc_k);
      }
      auto hsum_c = zeros<float>(s * d), hsum_k = zeros<float>(s * d);
      rt_heads_sum(a.data(), hsum_c.data(), s, m, 4);
      LAUNCH(3, 64, mk_heads_sum, a, hsum_k, s, m, 4);
      c.same("heads.sum", hsum_c, hsum_k);
    }
    {  // cross-entropy of the s rows of a as logits over m classes
      std::vector<int32_t> tgt(s);
      for (int i = 0; i < s; i++) tgt[i] = (i * 13 + 1) % m;
      std::vector<float> xl_c = {0}, xl_k = {0};
      rt_xent(a.data(), tgt.data(), xl_c.data(), s, m, 0.5f);
      LAUNCH(1, MK_BLOCK, mk_xent, a, tgt, xl_k, s, m, 0.5f);
      c.same("loss.xent", xl_c, xl_k);
      std::vector<double> xp = zeros<double>(4);   // the CUDA target's split: 4 blocks of rows, then the sum
      xl_k = {0};
      LAUNCH(4, MK_BLOCK, mk_xent_part, a, tgt, xp, s, m);
      LAUNCH(1, MK_BLOCK, mk_sum_parts, xp, xl_k, 4, (i64)s, 0.5f);
      c.same("loss.xent as xent_part + sum_parts", xl_c, xl_k);
      rt_xent_grad(a.data(), tgt.data(), y_c.data(), s, m, 0.5f);
      LAUNCH(5, MK_BLOCK, mk_xent_grad, a, tgt, y_k, s, m, 0.5f);
      c.same("loss.xent.grad", y_c, y_k);
      // the vocabulary in two parts (columns [0, h) and [h, m) as two ranks' logits)
      const int h = m / 2;
      std::vector<float> lo(s * h), hi(s * (m - h)), st_c = zeros<float>(6 * s), st_k = zeros<float>(6 * s);
      for (int i = 0; i < s; i++)
        for (int j = 0; j < m; j++) (j < h ? lo[i * h + j] : hi[i * (m - h) + j - h]) = a[i * m + j];
      std::vector<float> st_hi_k = zeros<float>(3 * s), g_c = zeros<float>(s * h), g_k = zeros<float>(s * h);
      rt_xent_stats(lo.data(), tgt.data(), st_c.data(), s, h, 0);
      rt_xent_stats(hi.data(), tgt.data(), st_c.data() + 3 * s, s, m - h, h);
      LAUNCH(3, MK_BLOCK, mk_xent_stats, lo, tgt, st_k, s, h, (i64)0);
      LAUNCH(3, MK_BLOCK, mk_xent_stats, hi, tgt, st_hi_k, s, m - h, (i64)h);
      std::copy(st_hi_k.begin(), st_hi_k.end(), st_k.begin() + 3 * s);
      c.same("loss.xent.stats", st_c, st_k);
      rt_xent_vp(st_c.data(), xl_c.data(), 2 * s, 2, 0.5f);
      LAUNCH(1, MK_BLOCK, mk_xent_vp, st_c, xl_k, 2 * s, 2, 0.5f);
      c.same("loss.xent.vp", xl_c, xl_k);
      rt_xent_vp_grad(lo.data(), tgt.data(), st_c.data(), g_c.data(), s, h, 2, 0, 0.5f);
      LAUNCH(5, MK_BLOCK, mk_xent_vp_grad, lo, tgt, st_c, g_k, s, h, 2, (i64)0, 0.5f);
      c.same("loss.xent.vp.grad", g_c, g_k);
    }
    std::vector<float> sc = {1.7f};
    rt_div_scalar(a.data(), sc.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_div_scalar, a, sc, y_k, n);
    c.same("div_scalar", y_c, y_k);
    rt_div_scalar_grad_x(b.data(), sc.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_div_scalar_grad_x, b, sc, y_k, n);
    c.same("div_scalar.grad_x", y_c, y_k);
    std::vector<float> ds_c(1), ds_k(1);
    rt_div_scalar_grad_s(a.data(), b.data(), sc.data(), ds_c.data(), n);
    LAUNCH(1, MK_BLOCK, mk_div_scalar_grad_s, a, b, sc, ds_k, n);
    c.same("div_scalar.grad_s", ds_c, ds_k);
    std::vector<float> l_c = {0.5f * rt_mse_value(a.data(), b.data(), n)}, l_k = {0};
    LAUNCH(1, MK_BLOCK, mk_mse, a, b, l_k, n, 0.5f);
    c.same("loss.mse", l_c, l_k);
    std::vector<double> mp = zeros<double>(3);   // the CUDA target's split: 3 blocks, then the sum
    l_k = {0};
    LAUNCH(3, MK_BLOCK, mk_mse_part, a, b, mp, n);
    LAUNCH(1, MK_BLOCK, mk_sum_parts, mp, l_k, 3, 2 * n, 0.5f);
    c.same("loss.mse as mse_part + sum_parts", l_c, l_k);
    rt_mse_grad(a.data(), b.data(), y_c.data(), n, 1.0f);
    rt_scale(y_c.data(), n, 0.5f);
    LAUNCH(3, 64, mk_mse_grad, a, b, y_k, n, 0.5f);
    c.same("loss.mse.grad", y_c, y_k);
    auto p_c = a, p_k = a, m_c = zeros<float>(n), m_k = zeros<float>(n), v_c = zeros<float>(n), v_k = zeros<float>(n);
    for (int step = 1; step <= 3; step++) {
      rt_adamw(p_c.data(), b.data(), m_c.data(), v_c.data(), n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step, 0.5f, 0.75f);
      LAUNCH(3, 64, mk_adamw, p_k, b, m_k, v_k, n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step, 0.5f, 0.75f);
    }
    c.same("opt.adamw (3 steps)", p_c, p_k);
    p_c = a, p_k = a;
    for (int step = 1; step <= 3; step++) {
      rt_sgd(p_c.data(), b.data(), n, 0.1f, 0.01f, 0.5f, 0.75f);
      LAUNCH(3, 64, mk_sgd, p_k, b, n, 0.1f, 0.01f, 0.5f, 0.75f);
    }
    c.same("opt.sgd (3 steps)", p_c, p_k);
    {  // the dtype bf16 update: the optimizer, then the parameters' bf16 copy
      auto q_c = zeros<uint16_t>(n), q_k = zeros<uint16_t>(n);
      p_c = a, p_k = a, m_c = zeros<float>(n), m_k = zeros<float>(n), v_c = zeros<float>(n), v_k = zeros<float>(n);
      for (int step = 1; step <= 3; step++) {
        rt_adamw_bf16(p_c.data(), b.data(), m_c.data(), v_c.data(), n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step, 0.5f,
                      0.75f, q_c.data());
        LAUNCH(3, 64, mk_adamw_bf16, p_k, b, m_k, v_k, n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step, 0.5f, 0.75f, q_k);
      }
      c.same("opt.adamw_bf16 (3 steps)", p_c, p_k);
      c.same("opt.adamw_bf16's bf16 copy", q_c, q_k);
      p_c = a, p_k = a;
      for (int step = 1; step <= 3; step++) {
        rt_sgd_bf16(p_c.data(), b.data(), n, 0.1f, 0.01f, 0.5f, 0.75f, q_c.data());
        LAUNCH(3, 64, mk_sgd_bf16, p_k, b, n, 0.1f, 0.01f, 0.5f, 0.75f, q_k);
      }
      c.same("opt.sgd_bf16 (3 steps)", p_c, p_k);
      c.same("opt.sgd_bf16's bf16 copy", q_c, q_k);
    }
    {  // the update of a run of tensors in one launch: three ranges with a gap between the last two
       // (a parameter outside the run), their own lr and weight decay, blocks of 16 elements
      const int64_t chunk = 16;
      std::vector<RtUpdateRange> r = {{0, 40, 0, 1e-3f, 0.01f}, {40, 25, 3, 2e-3f, 0.0f}, {70, (int64_t)n - 70, 5, 1e-3f, 0.1f}};
      int64_t blocks = 5 + ((int64_t)n - 70 + chunk - 1) / chunk;
      for (int with16 = 0; with16 < 2; with16++) {
        auto q_c = zeros<uint16_t>(n), q_k = zeros<uint16_t>(n);
        p_c = a, p_k = a, m_c = zeros<float>(n), m_k = zeros<float>(n), v_c = zeros<float>(n), v_k = zeros<float>(n);
        for (int step = 1; step <= 3; step++) {
          rt_adamw_ranges(p_c.data(), b.data(), m_c.data(), v_c.data(), r.data(), 3, blocks, chunk, 0.9f, 0.999f, 1e-8f,
                          step, 0.5f, 0.75f, with16 ? q_c.data() : nullptr);
          if (with16)
            LAUNCH(2, 32, mk_adamw_ranges, p_k, b, m_k, v_k, r, 3, blocks, chunk, 0.9f, 0.999f, 1e-8f, step, 0.5f, 0.75f, q_k);
          else
            LAUNCH(2, 32, mk_adamw_ranges, p_k, b, m_k, v_k, r, 3, blocks, chunk, 0.9f, 0.999f, 1e-8f, step, 0.5f, 0.75f,
                   nullptr);
        }
        c.same(with16 ? "opt.adamw_ranges with the bf16 copy (3 steps)" : "opt.adamw_ranges (3 steps)", p_c, p_k);
        c.same(with16 ? "opt.adamw_ranges's moments m" : "opt.adamw_ranges's moments m (no bf16 copy)", m_c, m_k);
        if (with16) c.same("opt.adamw_ranges's bf16 copy", q_c, q_k);
        p_c = a, p_k = a;
        for (int step = 1; step <= 3; step++) {
          rt_sgd_ranges(p_c.data(), b.data(), r.data(), 3, blocks, chunk, 0.5f, 0.75f, with16 ? q_c.data() : nullptr);
          if (with16) LAUNCH(3, 64, mk_sgd_ranges, p_k, b, r, 3, blocks, chunk, 0.5f, 0.75f, q_k);
          else LAUNCH(3, 64, mk_sgd_ranges, p_k, b, r, 3, blocks, chunk, 0.5f, 0.75f, nullptr);
        }
        c.same(with16 ? "opt.sgd_ranges with the bf16 copy (3 steps)" : "opt.sgd_ranges (3 steps)", p_c, p_k);
        if (with16) c.same("opt.sgd_ranges's bf16 copy", q_c, q_k);
      }
    }
    // hooks
    auto h = randn(n, 1000.0f);
    h[0] = 1e-7f, h[1] = 70000.0f, h[2] = -0.0f, h[3] = NAN, h[4] = 65519.0f, h[5] = 3e-8f;
    auto q_c = zeros<uint16_t>(n), q_k = zeros<uint16_t>(n);
    rt_compress_f16(h.data(), q_c.data(), n);
    LAUNCH(3, 64, mk_compress_f16, h, q_k, n);
    c.same("hook.compress f16", q_c, q_k);
    rt_decompress_f16(q_c.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_decompress_f16, q_c, y_k, n);
    c.same("hook.decompress f16", y_c, y_k);
    rt_compress_bf16(h.data(), q_c.data(), n);
    LAUNCH(3, 64, mk_compress_bf16, h, q_k, n);
    c.same("hook.compress bf16", q_c, q_k);
    rt_decompress_bf16(q_c.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_decompress_bf16, q_c, y_k, n);
    c.same("hook.decompress bf16", y_c, y_k);
    auto s_c = zeros<float>(s), s_k = zeros<float>(s);
    rt_int8_scales(h.data(), s_c.data(), s, m);
    LAUNCH(5, MK_BLOCK, mk_int8_scales, h, s_k, s, m);
    c.same("hook.scales", s_c, s_k);
    auto i_c = zeros<int8_t>(n), i_k = zeros<int8_t>(n);
    rt_compress_int8(h.data(), s_c.data(), i_c.data(), s, m);
    LAUNCH(3, 64, mk_compress_int8, h, s_c, i_k, s, m);
    c.same("hook.compress_int8", i_c, i_k);
    rt_decompress_int8(i_c.data(), s_c.data(), y_c.data(), s, m);
    LAUNCH(3, 64, mk_decompress_int8, i_c, s_c, y_k, s, m);
    c.same("hook.decompress_int8", y_c, y_k);
    std::vector<double> rs_k(3);
    LAUNCH(1, MK_BLOCK, mk_record_stats, a, rs_k, n);
    c.same("hook.record stats", record_stats(a), rs_k);
    // layouts: [blocks*experts, rows, m'] with blocks 3, experts 2, rows 4
    int R = 3, El = 2, rr = 4, mm = (int)(n / (R * El * rr));
    rt_expert_major(a.data(), y_c.data(), R, El, rr, mm);
    LAUNCH(3, 64, mk_expert_major, a, y_k, R, El, rr, mm);
    c.same("layout.expert_major", y_c, y_k);
    rt_rank_major(a.data(), y_c.data(), R, El, rr, mm);
    LAUNCH(3, 64, mk_rank_major, a, y_k, R, El, rr, mm);
    c.same("layout.rank_major", y_c, y_k);
    auto c_c = zeros<float>(n / 2), c_k = zeros<float>(n / 2);
    rt_layout_chunk(a.data(), c_c.data(), 2, 3, 4, (int64_t)(n / 24) * 4, 2, 1);
    LAUNCH(3, 64, mk_layout_chunk, a, c_k, 2, 3, 4, (int64_t)(n / 24) * 4, 2, 1);
    c.same("layout.chunk", c_c, c_k);
    rt_layout_concat(c_c.data(), c_c.data(), y_c.data(), 2, 3, 2, 2, (int64_t)(n / 24) * 4);
    LAUNCH(3, 64, mk_layout_concat, c_c, c_c, y_k, 2, 3, 2, 2, (int64_t)(n / 24) * 4);
    c.same("layout.concat", y_c, y_k);
  }
}

#endif
