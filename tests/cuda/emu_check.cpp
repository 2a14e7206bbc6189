// emu_check: the CUDA kernels of the CUDA target (nvrtc_check --print-library), compiled as host
// C++ with a small emulation of the CUDA execution model (one std::thread per CUDA thread, a
// barrier for __syncthreads, blocks one at a time so __shared__ can be static), run on random
// inputs and compared with libmoert's CPU kernels: integers (top-k, locations, expert choice,
// 16-bit and int8 codes) exactly, floats to 1e-5 relative. It checks the kernels' semantics
// (indexing, groups, reductions, the fused gate) without a GPU; it says nothing about GPU
// arithmetic (exp/log/tanh differ in the last ulps there) or performance.
//
// Built by tests/cuda/run.sh: g++ -std=c++20 -include LIB.cu-wrapper ... (see there).
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#define _Noreturn [[noreturn]]
extern "C" {
#include "moert.h"
}
#undef _Noreturn

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
static std::barrier<> *emu_barrier;
static double emu_dyn_shared[1 << 16];
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define MK_DYN_SHARED(T, name) T *name = (T *)emu_dyn_shared
static inline void __syncthreads() { emu_barrier->arrive_and_wait(); }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }

#include MK_LIBRARY

static void launch(int grid, int block, const std::function<void()> &kernel) {
  gridDim.x = grid;
  blockDim.x = block;
  for (int b = 0; b < grid; b++) {
    std::barrier<> bar(block);
    emu_barrier = &bar;
    std::vector<std::thread> threads;
    for (int t = 0; t < block; t++)
      threads.emplace_back([&, b, t] {
        blockIdx.x = b;
        threadIdx.x = t;
        kernel();
      });
    for (auto &th : threads) th.join();
  }
}
#define LAUNCH(grid, block, call) launch(grid, block, [&] { call; })
#define B MK_BLOCK

static int failures = 0, checks = 0;
template <class T> static void same(const char *name, const std::vector<T> &want, const std::vector<T> &got) {
  checks++;
  for (size_t i = 0; i < want.size(); i++) {
    double a = (double)want[i], b = (double)got[i];
    bool ok = std::is_floating_point<T>::value ? (a == b || (a != a && b != b) || fabs(a - b) <= 1e-5 * fabs(a) + 1e-6)
                                               : a == b;
    if (!ok) {
      printf("FAIL  cuda emu %s: element %zu: cpu %.9g, kernel %.9g\n", name, i, a, b);
      failures++;
      return;
    }
  }
  printf("ok    cuda emu %s (%zu elements)\n", name, want.size());
}

static std::mt19937 rng(7);
static std::vector<float> randn(size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto &x : v) x = d(rng);
  return v;
}
template <class T> static std::vector<T> zeros(size_t n) { return std::vector<T>(n, (T)0); }

int main() {
  const int s = 48, e = 8, k = 2, g = 2, m = 40, cap = 7, rows = 6;
  // ---- gate chain ----
  auto logits = randn((size_t)s * e);
  logits[3] = logits[5];  // a tie for top-k
  RtStep st;
  memset(&st, 0, sizeof st);
  st.seed = 42, st.step = 3, st.token0 = 96;
  auto noisy_c = zeros<float>(s * e), noisy_k = zeros<float>(s * e);
  rt_gate_noise(&st, logits.data(), noisy_c.data(), s, e, 0.5f, 1);
  LAUNCH(4, 64, mk_gate_noise(logits.data(), noisy_k.data(), s, e, 0.5f, 1, 42, 3, 96));
  same("gate.noise", noisy_c, noisy_k);
  auto sc_c = zeros<float>(s * e), sc_k = zeros<float>(s * e);
  rt_softmax(noisy_c.data(), sc_c.data(), s, e);
  LAUNCH(2, 32, mk_softmax(noisy_c.data(), sc_k.data(), s, e));
  same("gate.softmax", sc_c, sc_k);
  auto idx_c = zeros<int32_t>(s * k), idx_k = zeros<int32_t>(s * k);
  rt_topk(sc_c.data(), idx_c.data(), s, e, k);
  LAUNCH(2, 32, mk_topk(sc_c.data(), idx_k.data(), s, e, k));
  same("gate.topk", idx_c, idx_k);
  auto gates_c = zeros<float>(s * k), gates_k = zeros<float>(s * k);
  rt_gate_gather(sc_c.data(), idx_c.data(), gates_c.data(), s, e, k, true);
  LAUNCH(2, 32, mk_gate_gather(sc_c.data(), idx_c.data(), gates_k.data(), s, e, k, 1));
  same("gate.gather renorm", gates_c, gates_k);
  {
    auto fs = zeros<float>(s * e), fg = zeros<float>(s * k);
    auto fi = zeros<int32_t>(s * k);
    LAUNCH(3, 16, mk_gate_softmax_topk_gather(noisy_c.data(), fs.data(), fi.data(), fg.data(), s, e, k, 1));
    same("fused softmax+topk+gather: scores", sc_c, fs);
    same("fused softmax+topk+gather: idx", idx_c, fi);
    same("fused softmax+topk+gather: gates", gates_c, fg);
    auto sg = zeros<float>(s * e), sgg = zeros<float>(s * k);
    auto sgi = zeros<int32_t>(s * k);
    rt_sigmoid(noisy_c.data(), sg.data(), s * e);
    rt_topk(sg.data(), sgi.data(), s, e, k);
    rt_gate_gather(sg.data(), sgi.data(), sgg.data(), s, e, k, false);
    LAUNCH(3, 16, mk_gate_sigmoid_topk_gather(noisy_c.data(), fs.data(), fi.data(), fg.data(), s, e, k, 0));
    same("fused sigmoid+topk+gather: scores", sg, fs);
    same("fused sigmoid+topk+gather: idx", sgi, fi);
    same("fused sigmoid+topk+gather: gates", sgg, fg);
  }
  auto dg = randn(s * k), dsc_c = zeros<float>(s * e), dsc_k = zeros<float>(s * e);
  rt_gate_gather_grad(dg.data(), sc_c.data(), idx_c.data(), dsc_c.data(), s, e, k, true);
  LAUNCH(2, 32, mk_gate_gather_grad(dg.data(), sc_c.data(), idx_c.data(), dsc_k.data(), s, e, k, 1));
  same("gate.gather.grad renorm", dsc_c, dsc_k);
  auto dl_c = zeros<float>(s * e), dl_k = zeros<float>(s * e);
  rt_softmax_grad(dsc_c.data(), sc_c.data(), dl_c.data(), s, e);
  LAUNCH(2, 32, mk_softmax_grad(dsc_c.data(), sc_c.data(), dl_k.data(), s, e));
  same("gate.softmax.grad", dl_c, dl_k);
  for (int c : {cap, 0}) {  // with drops, and dropless
    auto loc_c = zeros<int32_t>(s * k), loc_k = zeros<int32_t>(s * k);
    std::vector<int> stats(g * e * 2);
    rt_gate_locations(NULL, idx_c.data(), loc_c.data(), s, k, e, g, c);
    LAUNCH(g, 4, mk_gate_locations(idx_c.data(), loc_k.data(), stats.data(), s, k, e, g, c));
    same(c ? "gate.locations (drops)" : "gate.locations (dropless)", loc_c, loc_k);
  }
  auto loc = zeros<int32_t>(s * k);
  rt_gate_locations(NULL, idx_c.data(), loc.data(), s, k, e, g, cap);
  {
    std::vector<float> a_c = {rt_aux_loss(sc_c.data(), idx_c.data(), s, e, k, g) / 2.0f}, a_k = {0};
    LAUNCH(1, B, mk_aux_loss(sc_c.data(), idx_c.data(), a_k.data(), s, e, k, g, 2.0f));
    same("gate.aux_loss", a_c, a_k);
    auto d_c = zeros<float>(s * e), d_k = zeros<float>(s * e);
    rt_aux_loss_grad(sc_c.data(), idx_c.data(), d_c.data(), s, e, k, g, 0.01f);
    LAUNCH(g, 64, mk_aux_loss_grad(sc_c.data(), idx_c.data(), d_k.data(), s, e, k, g, 0.01f));
    same("gate.aux_loss.grad", d_c, d_k);
    std::vector<float> z_c = {rt_z_loss(noisy_c.data(), s, e, g)}, z_k = {0};
    LAUNCH(1, B, mk_z_loss(noisy_c.data(), z_k.data(), s, e, g, 1.0f));
    same("gate.z_loss", z_c, z_k);
    rt_z_loss_grad(noisy_c.data(), d_c.data(), s, e, g, 0.001f);
    LAUNCH(2, 32, mk_z_loss_grad(noisy_c.data(), d_k.data(), s, e, g, 0.001f));
    same("gate.z_loss.grad", d_c, d_k);
    rt_softmax_tokens(noisy_c.data(), d_c.data(), s, e, g);
    LAUNCH(2, 8, mk_softmax_tokens(noisy_c.data(), d_k.data(), s, e, g));
    same("gate.softmax_tokens", d_c, d_k);
    auto dd_c = zeros<float>(s * e), dd_k = zeros<float>(s * e);
    rt_softmax_tokens_grad(dl_c.data(), d_c.data(), dd_c.data(), s, e, g);
    LAUNCH(2, 8, mk_softmax_tokens_grad(dl_c.data(), d_c.data(), dd_k.data(), s, e, g));
    same("gate.softmax_tokens.grad", dd_c, dd_k);
    auto ec_c = zeros<int32_t>(s * e), ec_k = zeros<int32_t>(s * e);
    auto tied = sc_c;
    tied[2 * e + 1] = tied[5 * e + 1];
    rt_expert_choice(NULL, tied.data(), ec_c.data(), s, e, g, 5);
    LAUNCH(3, 32, mk_expert_choice(tied.data(), ec_k.data(), s, e, g, 5));
    same("gate.expert_choice", ec_c, ec_k);
  }
  // ---- order ----
  size_t slots = (size_t)e * g * cap;
  auto x = randn((size_t)s * m);
  {
    auto d_c = zeros<float>(slots * m), d_k = zeros<float>(slots * m);
    rt_order_encode(x.data(), idx_c.data(), loc.data(), d_c.data(), s, m, k, e, g, cap);
    LAUNCH(4, 64, mk_zero(d_k.data(), (i64)d_k.size()));
    LAUNCH(5, 16, mk_order_encode(x.data(), idx_c.data(), loc.data(), d_k.data(), s, m, k, e, g, cap));
    same("order.encode", d_c, d_k);
    auto y = randn(slots * m), o_c = zeros<float>(s * m), o_k = zeros<float>(s * m);
    rt_order_encode_grad(y.data(), idx_c.data(), loc.data(), o_c.data(), s, m, k, e, g, cap);
    LAUNCH(5, 16, mk_order_encode_grad(y.data(), idx_c.data(), loc.data(), o_k.data(), s, m, k, e, g, cap));
    same("order.encode.grad", o_c, o_k);
    rt_order_decode(y.data(), idx_c.data(), loc.data(), gates_c.data(), o_c.data(), s, m, k, e, g, cap);
    LAUNCH(5, 16, mk_order_decode(y.data(), idx_c.data(), loc.data(), gates_c.data(), o_k.data(), s, m, k, e, g, cap));
    same("order.decode", o_c, o_k);
    rt_order_decode_grad_y(x.data(), idx_c.data(), loc.data(), gates_c.data(), d_c.data(), s, m, k, e, g, cap);
    LAUNCH(4, 64, mk_zero(d_k.data(), (i64)d_k.size()));
    LAUNCH(5, 16, mk_order_decode_grad_y(x.data(), idx_c.data(), loc.data(), gates_c.data(), d_k.data(), s, m, k, e, g, cap));
    same("order.decode.grad_y", d_c, d_k);
    auto gg_c = zeros<float>(s * k), gg_k = zeros<float>(s * k);
    rt_order_decode_grad_gates(x.data(), y.data(), idx_c.data(), loc.data(), gg_c.data(), s, m, k, e, g, cap);
    LAUNCH(7, B, mk_order_decode_grad_gates(x.data(), y.data(), idx_c.data(), loc.data(), gg_k.data(), s, m, k, e, g, cap));
    same("order.decode.grad_gates", gg_c, gg_k);
    auto w_c = zeros<float>(s * slots), w_k = zeros<float>(s * slots);
    rt_dispatch_mask(idx_c.data(), loc.data(), w_c.data(), s, k, e, g, cap);
    LAUNCH(5, 32, mk_dispatch_mask(idx_c.data(), loc.data(), w_k.data(), s, k, e, g, cap));
    same("order.dispatch_mask", w_c, w_k);
    rt_combine_weights(idx_c.data(), loc.data(), gates_c.data(), w_c.data(), s, k, e, g, cap);
    LAUNCH(5, 32, mk_combine_weights(idx_c.data(), loc.data(), gates_c.data(), w_k.data(), s, k, e, g, cap));
    same("order.combine_weights", w_c, w_k);
    auto dcw = randn(s * slots);
    rt_combine_weights_grad(dcw.data(), idx_c.data(), loc.data(), gg_c.data(), s, k, e, g, cap);
    LAUNCH(2, 32, mk_combine_weights_grad(dcw.data(), idx_c.data(), loc.data(), gg_k.data(), s, k, e, g, cap));
    same("order.combine_weights.grad", gg_c, gg_k);
  }
  // ---- dense, elementwise, losses, optimizers ----
  {
    size_t n = (size_t)s * m;
    auto a = randn(n), b = randn(n), y_c = zeros<float>(n), y_k = zeros<float>(n);
    rt_gelu(a.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_gelu(a.data(), y_k.data(), n));
    same("act.gelu", y_c, y_k);
    rt_gelu_grad(b.data(), a.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_gelu_grad(b.data(), a.data(), y_k.data(), n));
    same("act.gelu.grad", y_c, y_k);
    rt_silu_grad(b.data(), a.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_silu_grad(b.data(), a.data(), y_k.data(), n));
    same("act.silu.grad", y_c, y_k);
    auto db_c = zeros<float>(m), db_k = zeros<float>(m);
    rt_bias_grad(a.data(), db_c.data(), s, m);
    LAUNCH(1, 32, mk_bias_grad(a.data(), db_k.data(), s, m));
    same("bias.grad", db_c, db_k);
    auto eb_c = zeros<float>(4 * m), eb_k = zeros<float>(4 * m);
    rt_expert_bias_grad(a.data(), eb_c.data(), 4, s / 4, m);
    LAUNCH(2, 32, mk_expert_bias_grad(a.data(), eb_k.data(), 4, s / 4, m));
    same("expert.bias.grad", eb_c, eb_k);
    rt_l2norm_rows(a.data(), y_c.data(), s, m);
    LAUNCH(5, B, mk_l2norm(a.data(), y_k.data(), s, m));
    same("l2norm", y_c, y_k);
    rt_l2norm_rows_grad(b.data(), a.data(), y_c.data(), s, m);
    LAUNCH(5, B, mk_l2norm_grad(b.data(), a.data(), y_k.data(), s, m));
    same("l2norm.grad", y_c, y_k);
    float sc = 1.7f;
    std::vector<float> ds_c(1), ds_k(1);
    rt_div_scalar_grad_s(a.data(), b.data(), &sc, ds_c.data(), n);
    LAUNCH(1, B, mk_div_scalar_grad_s(a.data(), b.data(), &sc, ds_k.data(), n));
    same("div_scalar.grad_s", ds_c, ds_k);
    std::vector<float> l_c = {0.5f * rt_mse(a.data(), b.data(), n)}, l_k = {0};
    LAUNCH(1, B, mk_mse(a.data(), b.data(), l_k.data(), n, 0.5f));
    same("loss.mse", l_c, l_k);
    rt_mse_grad(a.data(), b.data(), y_c.data(), n);
    rt_scale(y_c.data(), n, 0.5f);
    LAUNCH(3, 64, mk_mse_grad(a.data(), b.data(), y_k.data(), n, 0.5f));
    same("loss.mse.grad", y_c, y_k);
    auto p_c = a, p_k = a, m_c = zeros<float>(n), m_k = zeros<float>(n), v_c = zeros<float>(n), v_k = zeros<float>(n);
    for (int step = 1; step <= 3; step++) {
      rt_adamw(p_c.data(), b.data(), m_c.data(), v_c.data(), n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step);
      LAUNCH(3, 64, mk_adamw(p_k.data(), b.data(), m_k.data(), v_k.data(), n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step));
    }
    same("opt.adamw (3 steps)", p_c, p_k);
    // hooks
    auto h = randn(n, 1000.0f);
    h[0] = 1e-7f, h[1] = 70000.0f, h[2] = -0.0f, h[3] = NAN, h[4] = 65519.0f, h[5] = 3e-8f;
    auto q_c = zeros<uint16_t>(n), q_k = zeros<uint16_t>(n);
    rt_compress_f16(h.data(), q_c.data(), n);
    LAUNCH(3, 64, mk_compress_f16(h.data(), q_k.data(), n));
    same("hook.compress f16", q_c, q_k);
    rt_decompress_f16(q_c.data(), y_c.data(), n);
    LAUNCH(3, 64, mk_decompress_f16(q_c.data(), y_k.data(), n));
    same("hook.decompress f16", y_c, y_k);
    rt_compress_bf16(h.data(), q_c.data(), n);
    LAUNCH(3, 64, mk_compress_bf16(h.data(), q_k.data(), n));
    same("hook.compress bf16", q_c, q_k);
    auto s_c = zeros<float>(s), s_k = zeros<float>(s);
    rt_int8_scales(h.data(), s_c.data(), s, m);
    LAUNCH(5, B, mk_int8_scales(h.data(), s_k.data(), s, m));
    same("hook.scales", s_c, s_k);
    auto i_c = zeros<int8_t>(n), i_k = zeros<int8_t>(n);
    rt_compress_int8(h.data(), s_c.data(), i_c.data(), s, m);
    LAUNCH(3, 64, mk_compress_int8(h.data(), s_c.data(), i_k.data(), s, m));
    same("hook.compress_int8", i_c, i_k);
    // layouts: [blocks*experts, rows, m'] with blocks 3, experts 2, rows 4
    int R = 3, El = 2, rr = 4, mm = (int)(n / (R * El * rr));
    rt_expert_major(a.data(), y_c.data(), R, El, rr, mm);
    LAUNCH(3, 64, mk_expert_major(a.data(), y_k.data(), R, El, rr, mm));
    same("layout.expert_major", y_c, y_k);
    rt_rank_major(a.data(), y_c.data(), R, El, rr, mm);
    LAUNCH(3, 64, mk_rank_major(a.data(), y_k.data(), R, El, rr, mm));
    same("layout.rank_major", y_c, y_k);
    auto c_c = zeros<float>(n / 2), c_k = zeros<float>(n / 2);
    rt_layout_chunk(a.data(), c_c.data(), 2, 3, 4, (int64_t)(n / 24) * 4, 2, 1);
    LAUNCH(3, 64, mk_layout_chunk((const unsigned char *)a.data(), (unsigned char *)c_k.data(), 2, 3, 4, (i64)(n / 24) * 4, 2, 1));
    same("layout.chunk", c_c, c_k);
    rt_layout_concat(c_c.data(), c_c.data(), y_c.data(), 2, 3, 2, 2, (int64_t)(n / 24) * 4);
    LAUNCH(3, 64, mk_layout_concat((const unsigned char *)c_c.data(), (const unsigned char *)c_c.data(), (unsigned char *)y_k.data(), 2, 3, 2, 2, (i64)(n / 24) * 4));
    same("layout.concat", y_c, y_k);
  }
  (void)rows;
  printf("%d checks, %d failed\n", checks, failures);
  return failures ? 1 : 0;
}
