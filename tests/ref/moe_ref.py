#!/usr/bin/python3
"""Independent numpy reference of the MoE layer stacks moec compiles: every gate (gshard any k,
sigmoid, xmoe, expert_choice, softmoe), both orders (tutel, gshard: the same math), every expert
(ffn gpt gelu/relu/relu2 with or without bias, ffn mixtral, ffn oss), capacity factors and dropless, hooks
(record; compress fp16 | bf16 | int8 at before_dispatch / before_combine).

Written from lang/manual.md §11 ("Exact semantics"), runtime/moert.h's kernel comments and the gate /
expert lowering files (frontend/gate_*.c, expert_*.c: which op sequence each gate is), not from
the runtime's kernels, so that tests/ref/test_ref.py can hold the compiled binary against it.
Everything is float64 except the compression round trips, which are the runtime's float32
conversions bit for bit. The backward pass is written by hand and `--selftest` checks it against
central finite differences of the reference's own forward (and the compression round trips
against runtime/kernels/hook.c compiled with a driver).

Model (S = B*L tokens, x [S, M], E experts, G routing groups of S_g = S/G tokens in order);
per MoE layer instance, in order:
  token-choice gates:
    gshard:  logits = x.Wg;  scores = softmax(noisy)
    sigmoid: logits = x.Wg;  scores = sigmoid(noisy) (independent per expert, no renormalisation)
    xmoe:    logits = l2n(x.Wp) . l2n(Emb)^T / tau (l2n(v) = v / sqrt(|v|^2 + 1e-12));
             scores = softmax(noisy)
    noisy = logits + sigma*N(0,1)/E (training); idx = top-k of scores (ties: lower index);
    gates = scores[idx] (/ their sum with `renormalize`, gshard and xmoe only: by default when
    k > 1; `renormalize true` with k 1 makes every gate 1, `renormalize false` keeps the softmax
    scores for any k); T = ceil(k*f*S_g/E - 1e-9) (>= 1),
    dropless (`capacity *`): T = S_g; locations: first choices in token order, then second
    choices ...; loc >= T is dropped (contributes zero)
    aux = mean_g E*sum_e me_ge*ce_ge (me: mean score, ce: fraction of first choices; ce constant)
  expert_choice: scores = softmax of noisy over the tokens of each group, per expert;
    T = min(ceil(k*f*S_g/E - 1e-9), S_g); expert j takes its T best tokens of every group (ties: lower
    token); gate of (t, j) = scores[t, j]; no aux loss
  z = mean_s logsumexp(noisy_s)^2 (all but softmoe)
      lang/manual.md §11 adds the noise "to the logits" and then uses "logits" for both softmax and z, so
      z sees the noisy logits (what the softmax sees); z_noisy=False gives the x.Wg reading.
  softmoe (slots N): logits = x.Wg [S, E*N] (no noise, no groups, no losses); dispatch
    D = softmax over all tokens per column, combine Cw = softmax over each token's row;
    slot inputs D^T x, output Cw . (expert outputs)
  Every gate is written as D, Cw [S, E*C] (C = G*T slots per expert; one-hot / gate weights at
  column idx*C + g*T + loc for hard routing): disp = D^T x [E, C, M], moe = Cw y. That is the
  gshard order's einsum, and the tutel order's encode/decode computes the same numbers.
  disp -> hook(before_dispatch) -> experts -> hook(before_combine) -> combine; a compress hook
  is the float32 round trip of runtime/kernels/hook.c forward and the identity backward
  experts: gpt y = act(disp.W1 + b1).W2 + b2 (act: ACTS);  mixtral y = (silu(disp.W1) * (disp.W3)).W2;
    oss (gpt-oss) y = ((clip(u, -7, 7) + 1) * g' * sigmoid(1.702 g')).W2 + b2 with g = disp.W1 + b1,
    g' = min(g, 7), u = disp.W3 + b3; the clamps' gradients pass where -7 <= u <= 7 and g <= 7
    (torch.clamp's, bounds included)
  shared expert (`shared { ffn mixtral { hidden Hs; } [gate sigmoid;] }`): every token's
    s = (silu(x.Ws1) * (x.Ws3)).Ws2, times sigmoid(x.wsg) [S, 1] per token when gated;
    moe = combined routed output + s (before_moe_end records the sum)
  out = x + moe
loss = mean((out - target)^2)/2 + sum_layers (aux_coef*aux + z_coef*z).
"""
import json
import math
import struct
import sys

import numpy as np

MASK64 = (1 << 64) - 1
RT_STREAM_INPUT, RT_STREAM_TARGET, RT_STREAM_INIT, RT_STREAM_NOISE = 1, 2, 3, 4


# ---------------------------------------------------------------- RNG (moert.h, bit for bit)
def rt_mix(z):
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def rt_key(a, b):
    return rt_mix((a & MASK64) ^ rt_mix(b & MASK64))


def rt_uniform(h):
    return ((h >> 40) + 0.5) / 16777216.0


def rt_normal(key, i):
    return float(rt_normal_np(key, np.array([i]))[0])


def rt_hash_name(s):
    h = 0xCBF29CE484222325
    for c in s.encode():
        h = ((h ^ c) * 0x100000001B3) & MASK64
    return h


def _mix_np(z):
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


_F = np.float32


def rt_normal_np(key, idx):
    """rt_normal(key, i) for every i of the int array idx (runtime/rng.c's normal_pair, float32
    step by step: numpy's float32 +, -, *, /, sqrt round as C's), as float64 values."""
    i = np.asarray(idx, dtype=np.uint64)
    k = np.uint64(key & MASK64)
    with np.errstate(over="ignore"):
        h = _mix_np(k + (i >> np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15))
    x = (h >> np.uint64(41)).astype(np.int32).astype(_F) + _F(0.5)
    xb = x.view(np.uint32)
    e = (xb >> np.uint32(23)).astype(np.int32) - 127
    f = ((xb & np.uint32(0x007FFFFF)) | np.uint32(0x3F800000)).view(_F)
    big = f > _F(1.41421356)
    f = np.where(big, _F(0.5) * f, f)
    e = np.where(big, e + 1, e)
    s = (f - _F(1.0)) / (f + _F(1.0))
    s2 = s * s
    lf = _F(2.0) * s * (_F(1.0) + s2 * (_F(0.333333343) + s2 * (_F(0.2) + s2 * (_F(0.142857149) + s2 * _F(0.111111112)))))
    ln_u1 = (e - 23).astype(_F) * _F(0.693147182) + lf
    r = np.sqrt(_F(-2.0) * ln_u1)
    b = (h >> np.uint64(17)).astype(np.uint32) & np.uint32(0xFFFFFF)
    q = b >> np.uint32(22)
    psi = (((b & np.uint32(0x3FFFFF)).astype(_F) + _F(0.5)) * _F(2.38418579e-7) - _F(0.5)) * _F(1.57079633)
    p2 = psi * psi
    c = _F(1.0) + p2 * (_F(-0.5) + p2 * (_F(4.16666679e-2) + p2 * (_F(-1.38888892e-3) + p2 * _F(2.48015876e-5))))
    sn = psi * (_F(1.0) + p2 * (_F(-0.166666672) + p2 * (_F(8.33333377e-3) + p2 * (_F(-1.98412701e-4) + p2 * _F(2.75573188e-6)))))
    cq = np.select([q == 0, q == 1, q == 2], [c, -sn, -c], sn)
    sq = np.select([q == 0, q == 1, q == 2], [sn, c, -sn], -c)
    odd = (i & np.uint64(1)) == np.uint64(1)
    return np.where(odd, r * sq, r * cq).astype(np.float64)


def gate_noise_normals(seed, step, layer, token0, s, e):
    """The N(0,1) draws of rt_gate_noise: [s, e], token t = token0 + row, element t*e + j."""
    key = rt_key(rt_key(rt_key(seed, RT_STREAM_NOISE), step), layer)
    idx = (token0 + np.arange(s, dtype=np.int64))[:, None] * e + np.arange(e, dtype=np.int64)[None, :]
    return rt_normal_np(key, idx)


def synthetic_batch(seed, step, batch, seqlen, embed, sample0=0):
    """The binary's synthetic data (lang/manual.md §12): x [B, L, M] and target (float32, as the binary stores them)."""
    x = np.empty((batch, seqlen * embed), dtype=np.float64)
    for b in range(batch):
        key = rt_key(rt_key(rt_key(seed, RT_STREAM_INPUT), step), sample0 + b)
        x[b] = rt_normal_np(key, np.arange(seqlen * embed))
    x = x.astype(np.float32).reshape(batch, seqlen, embed)
    t = 0.5 * np.roll(x, -1, axis=2)    # target[s, m] = 0.5 * x[s, (m+1) % M]
    return x, t.astype(np.float32)


def init_normal(seed, name, shape, std):
    key = rt_key(rt_key(seed, RT_STREAM_INIT), rt_hash_name(name))
    n = int(np.prod(shape))
    return (std * rt_normal_np(key, np.arange(n))).reshape(shape)


# ---------------------------------------------------------------- model description
GATES = ("gshard", "sigmoid", "xmoe", "expert_choice", "softmoe")
TOKEN_CHOICE = ("gshard", "sigmoid", "xmoe")
HOOK_POINTS = ("before_moe_start", "before_dispatch", "after_dispatch", "before_combine",
               "after_combine", "before_moe_end")
COMPRESS = ("fp16", "bf16", "int8")


class Layer:
    """One MoE layer instance (`layer NAME x N` gives N of these: NAME0, NAME1, ...).

    gate: gshard | sigmoid | xmoe | expert_choice | softmoe; order: tutel | gshard (the same
    math here; it only matters for the .moe text); ffn: gpt | mixtral | oss; capacity: a factor or
    "*" (dropless); renormalize (gshard, xmoe): True | False | None (the default: k > 1);
    hooks: [(point, action)] with action record | fp16 | bf16 | int8 (compress
    at before_dispatch / before_combine, decompressed at the matching after-point).
    offsets: {point: array} replaces the compression round trip by `v + offset` (a constant);
    the self-test uses it to build the differentiable twin that the straight-through
    gradients must match."""

    def __init__(self, name, embed, experts, hidden, k=1, capacity=1.0, groups=1, noise=0.0,
                 aux_loss=0.0, z_loss=0.0, act="gelu", bias=True, gate="gshard", order="tutel",
                 ffn="gpt", proj=16, slots=1, hooks=(), renormalize=None, shared_hidden=None,
                 shared_gate=False, aux="group", expert_groups=1, topk_groups=None, group_score="top2",
                 scale=1.0, balance=None):
        assert gate in GATES and order in ("tutel", "gshard") and ffn in ("gpt", "mixtral", "oss")
        assert renormalize is None or gate in ("gshard", "xmoe", "sigmoid"), "renormalize: gshard, sigmoid, xmoe"
        self.renormalize = renormalize
        # DeepSeek's choice (gshard, sigmoid): the experts in expert_groups equal groups, the k
        # chosen among the topk_groups best groups (by the sum of their two best scores, "top2", or
        # their best, "max"; the other experts count as 0), gates times scale; balance (a rate):
        # a correction bias gate.eb [E] added to the scores for the choice only, whose dumped
        # "gradient" is the load imbalance E * count_e - S * k
        assert (expert_groups == 1 and scale == 1.0 and balance is None) or gate in ("gshard", "sigmoid")
        self.expert_groups = expert_groups
        self.topk_groups = expert_groups if topk_groups is None else topk_groups
        self.group_score, self.scale, self.balance = group_score, scale, balance
        self.name, self.M, self.E, self.H = name, embed, experts, hidden
        self.k, self.capacity, self.groups, self.noise = k, capacity, groups, noise
        self.aux_coef, self.z_coef = aux_loss, z_loss
        # aux "pooled": transformers' load-balancing loss, one over every pooled layer of a
        # language model (tests/ref/lm_ref.py computes it and sets the caches' "pooled_fn")
        # aux "sequence": DeepSeek-V3's sequence-wise loss, one group per sequence (seqlen tokens;
        # layer_forward is told the sequence length through the caches' "seqlen")
        assert aux in ("group", "pooled", "sequence") and (aux != "pooled" or gate == "gshard")
        assert aux != "sequence" or gate in ("gshard", "sigmoid")
        self.aux_form = aux
        self.seqlen = None   # set from the batch by forward_backward and route_margin
        self.gate, self.order, self.ffn, self.proj, self.slots = gate, order, ffn, proj, slots
        self.act = act if ffn == "gpt" else None
        self.bias = bias if ffn == "gpt" else ffn == "oss"   # oss: always its biases
        # the shared expert: hidden Hs (None: none), gated by sigmoid(x.wsg) or not
        assert shared_hidden is None or shared_hidden >= 1
        self.shared_hidden, self.shared_gate = shared_hidden, bool(shared_gate and shared_hidden)
        self.hooks = list(hooks)
        for point, action in self.hooks:
            assert point in HOOK_POINTS and action in ("record",) + COMPRESS
            assert action == "record" or point in ("before_dispatch", "before_combine")
        self.offsets = None
        if gate == "softmoe":
            self.groups, self.k, self.noise, self.aux_coef, self.z_coef = 1, 1, 0.0, 0.0, 0.0

    @property
    def renorm(self):
        """Whether the k chosen scores are scaled to sum 1 (sigmoid: only when asked)."""
        if self.gate not in ("gshard", "xmoe", "sigmoid"):
            return False
        if self.renormalize is None:
            return self.k > 1 and self.gate != "sigmoid"
        return bool(self.renormalize)

    @property
    def dropless(self):
        return self.capacity == "*"

    def compress_at(self, point):
        for p, a in self.hooks:
            if p == point and a in COMPRESS:
                return a
        return None

    def records(self):
        """The record hooks in the order the forward meets them."""
        return [p for p in HOOK_POINTS if (p, "record") in self.hooks]

    def param_shapes(self):
        p = self.name + ".moe."
        M, E, H = self.M, self.E, self.H
        shared = {}
        if self.shared_hidden:
            Hs = self.shared_hidden
            shared = {p + "shared.w1": (M, Hs), p + "shared.w3": (M, Hs), p + "shared.w2": (Hs, M)}
            if self.shared_gate:
                shared[p + "shared.gate"] = (M, 1)
        if self.gate == "xmoe":
            shapes = {p + "gate.proj": (M, self.proj), p + "gate.expert_emb": (E, self.proj),
                      p + "gate.temperature": ()}
        elif self.gate == "softmoe":
            shapes = {p + "gate.wg": (M, E * self.slots)}
        else:
            shapes = {p + "gate.wg": (M, E)}
            if self.balance is not None:
                shapes[p + "gate.eb"] = (E,)
        shapes.update(shared)
        if self.ffn == "mixtral":
            shapes.update({p + "experts.w1": (E, M, H), p + "experts.w3": (E, M, H),
                           p + "experts.w2": (E, H, M)})
            return shapes
        if self.ffn == "oss":
            shapes.update({p + "experts.w1": (E, M, H), p + "experts.b1": (E, H),
                           p + "experts.w3": (E, M, H), p + "experts.b3": (E, H),
                           p + "experts.w2": (E, H, M), p + "experts.b2": (E, M)})
            return shapes
        shapes[p + "experts.w1"] = (E, M, H)
        if self.bias:
            shapes[p + "experts.b1"] = (E, H)
        shapes[p + "experts.w2"] = (E, H, M)
        if self.bias:
            shapes[p + "experts.b2"] = (E, M)
        return shapes

    def capacity_per_group(self, s):
        """T: slots per expert per routing group (softmoe: its slots)."""
        if self.gate == "softmoe":
            return self.slots
        sg = s // self.groups
        if self.dropless:
            return sg          # the most one expert can get (the choices of a token are distinct)
        t = max(1, int(math.ceil(self.k * self.capacity * sg / self.E - 1e-9)))   # a whole k*f*S/E stays whole
        return min(t, sg) if self.gate == "expert_choice" else t


def expand_layers(items):
    """items: [(item_name, repeat, kwargs)] -> [Layer] named item_name + instance index."""
    out = []
    for name, repeat, kw in items:
        for i in range(repeat):
            out.append(Layer(f"{name}{i}", **kw))
    return out


def param_shapes(layers):
    shapes = {}
    for ly in layers:
        shapes.update(ly.param_shapes())
    return shapes


# ---------------------------------------------------------------- activations
_C = math.sqrt(2.0 / math.pi)


def gelu(x):
    return 0.5 * x * (1.0 + np.tanh(_C * (x + 0.044715 * x ** 3)))


def gelu_grad(x):
    t = np.tanh(_C * (x + 0.044715 * x ** 3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * x * x)


# `act NAME` of ffn gpt (ir/activations.def's rows that `act` offers): the function and its derivative.
ACTS = {
    "gelu": (gelu, gelu_grad),
    "relu": (lambda x: np.maximum(x, 0.0), lambda x: (x > 0).astype(x.dtype)),
    # Primer's squared ReLU: max(x, 0)^2, derivative 2 max(x, 0)
    "relu2": (lambda x: np.maximum(x, 0.0) ** 2, lambda x: 2.0 * np.maximum(x, 0.0)),
}


def act_fwd(name, h):
    return ACTS[name][0](h)


def act_grad(name, h):
    return ACTS[name][1](h)


def sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def silu(x):
    return x * sigmoid(x)


def silu_grad(x):
    s = sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


OSS_ALPHA, OSS_LIMIT = 1.702, 7.0


def oss_act(g, u):
    """gpt-oss's clamped SwiGLU (transformers' GptOssExperts): (clip(u, -7, 7) + 1) * g' *
    sigmoid(1.702 g'), g' = min(g, 7)."""
    gc = np.minimum(g, OSS_LIMIT)
    return (np.clip(u, -OSS_LIMIT, OSS_LIMIT) + 1.0) * gc * sigmoid(OSS_ALPHA * gc)


def oss_act_grads(g, u):
    """d oss_act / d g and / d u, zero where the clamp holds the value (torch.clamp passes the
    gradient where min <= x <= max)."""
    gc = np.minimum(g, OSS_LIMIT)
    s = sigmoid(OSS_ALPHA * gc)
    uc = np.clip(u, -OSS_LIMIT, OSS_LIMIT)
    dg = np.where(g <= OSS_LIMIT, (uc + 1.0) * s * (1.0 + OSS_ALPHA * gc * (1.0 - s)), 0.0)
    du = np.where((u >= -OSS_LIMIT) & (u <= OSS_LIMIT), gc * s, 0.0)
    return dg, du


# ---------------------------------------------------------------- compression (runtime/kernels/hook.c)
# Forward: the exact round trip of the float32 tensor the runtime compresses; backward:
# straight through. Inputs and outputs are float64 arrays holding float32 values.
def round_fp16(v):
    """IEEE binary16, round to nearest even, overflow to inf (numpy's float32 -> float16)."""
    with np.errstate(over="ignore"):
        return np.asarray(v, dtype=np.float32).astype(np.float16).astype(np.float64)


def round_bf16(v):
    """The top 16 bits of binary32, round to nearest even (a carry may reach inf); NaN stays NaN."""
    u = np.asarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64)
    q = ((u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)) \
        & np.uint64(0xFFFF)
    nan = (u & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000)
    q = np.where(nan, (u >> np.uint64(16)) | np.uint64(0x40), q)
    return (q << np.uint64(16)).astype(np.uint32).view(np.float32).astype(np.float64)


def int8_parts(v):
    """(q int8 values as float64, scale float32 per row) of the last dim, as runtime/kernels/hook.c:
    scale = max|x| / 127 in float32 (NaN ignored; 1 for a row without a non-zero),
    q = round-half-away(x / scale) (float32 division), NaN -> 0, clamped to [-127, 127]."""
    x = np.asarray(v, dtype=np.float32)
    rows = x.reshape(-1, x.shape[-1]) if x.size else x.reshape(0, 1)
    # NaNs (quiet and signalling) out first, then a plain max: exact on any path. np.fmax is not:
    # its SIMD reduction skips a signalling NaN while its scalar loop (libm fmaxf) returns NaN,
    # and which one runs depends on the CPU's SIMD dispatch and the row's length.
    a = np.abs(rows)
    mx = np.where(np.isnan(a), np.float32(0.0), a).max(axis=1, initial=np.float32(0.0)).astype(np.float32)
    scale = np.where(mx > 0, mx / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        u = (rows / scale[:, None]).astype(np.float32).astype(np.float64)   # exact float32 quotient
        q = np.sign(u) * np.floor(np.abs(u) + 0.5)                          # roundf: half away from 0
    q = np.where(np.isnan(q), 0.0, np.clip(q, -127.0, 127.0)) + 0.0     # an int8 has no -0
    return q.reshape(x.shape), scale


def round_int8(v):
    q, scale = int8_parts(v)
    x = np.asarray(v, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):       # 0 * inf scale is NaN, as in C
        rows = (q.reshape(-1, x.shape[-1]).astype(np.float32) * scale[:, None]).astype(np.float32)
    return rows.reshape(x.shape).astype(np.float64)


ROUND_TRIP = {"fp16": round_fp16, "bf16": round_bf16, "int8": round_int8}


def hook(ly, before, v):
    """What the model computes on after the hooks at `before` and its after-point."""
    if ly.offsets is not None and before in ly.offsets:
        return v + ly.offsets[before]
    fmt = ly.compress_at(before)
    return ROUND_TRIP[fmt](v) if fmt else v


# ---------------------------------------------------------------- gate pieces
def softmax_rows(z):
    m = z.max(axis=1, keepdims=True)
    e = np.exp(z - m)
    return e / e.sum(axis=1, keepdims=True)


def softmax_rows_grad(dy, y):
    return y * (dy - (dy * y).sum(axis=1, keepdims=True))


def softmax_tokens(z, groups):
    """Every column softmaxed over the rows (tokens) of its routing group."""
    s = z.shape[0]
    sg = s // groups
    out = np.empty_like(z)
    for g in range(groups):
        blk = z[g * sg:(g + 1) * sg]
        e = np.exp(blk - blk.max(axis=0, keepdims=True))
        out[g * sg:(g + 1) * sg] = e / e.sum(axis=0, keepdims=True)
    return out


def softmax_tokens_grad(dy, y, groups):
    s = y.shape[0]
    sg = s // groups
    out = np.empty_like(y)
    for g in range(groups):
        sl = slice(g * sg, (g + 1) * sg)
        out[sl] = y[sl] * (dy[sl] - (dy[sl] * y[sl]).sum(axis=0, keepdims=True))
    return out


def l2norm_rows(x):
    return x / np.sqrt((x * x).sum(axis=1, keepdims=True) + 1e-12)


def l2norm_rows_grad(dy, x):
    r = np.sqrt((x * x).sum(axis=1, keepdims=True) + 1e-12)
    return dy / r - x * (dy * x).sum(axis=1, keepdims=True) / r ** 3


def logsumexp_rows(z):
    m = z.max(axis=1)
    return m + np.log(np.exp(z - m[:, None]).sum(axis=1))


def topk_rows(scores, k):
    # stable sort of -scores: equal scores keep index order, so ties go to the lower index
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def limited_choice(choice, groups, best, how):
    """DeepSeek's group limit: each row's experts in `groups` equal runs, ranked by the sum of
    their two best (how "top2") or their best ("max"), ties to the lower group; the experts
    outside the `best` best groups count as -inf (transformers 5's masked_fill)."""
    if groups <= 1 or best >= groups:
        return choice
    s, e = choice.shape
    grouped = np.sort(choice.reshape(s, groups, e // groups), axis=2)
    gscore = grouped[:, :, -1] + grouped[:, :, -2] if how == "top2" else grouped[:, :, -1]
    keep = np.zeros((s, groups), dtype=bool)
    np.put_along_axis(keep, np.argsort(-gscore, axis=1, kind="stable")[:, :best], True, axis=1)
    return np.where(np.repeat(keep, e // groups, axis=1), choice, -np.inf)


def locations(idx, e, groups, cap):
    """loc[s, j]: slot of choice j of token s in its group's buffer of expert idx[s, j], or -1;
    cap None: dropless. Also the largest per-group count of one expert (kept or not)."""
    s, k = idx.shape
    sg = s // groups
    loc = np.full((s, k), -1, dtype=np.int64)
    most = 0
    for g in range(groups):
        count = np.zeros(e, dtype=np.int64)
        for j in range(k):
            for t in range(g * sg, (g + 1) * sg):
                ex = idx[t, j]
                if cap is None or count[ex] < cap:
                    loc[t, j] = count[ex]
                count[ex] += 1
        most = max(most, int(count.max()))
    return loc, most


def expert_choice_locations(scores, groups, cap):
    """loc[t, j]: rank of token t in expert j's list of its group (score descending, ties to
    the lower token), or -1 past cap."""
    s, e = scores.shape
    sg = s // groups
    loc = np.full((s, e), -1, dtype=np.int64)
    for g in range(groups):
        for j in range(e):
            col = scores[g * sg:(g + 1) * sg, j]
            order = np.lexsort((np.arange(sg), -col))[:cap]
            loc[g * sg + order, j] = np.arange(len(order))
    return loc


# ---------------------------------------------------------------- one layer
def gate_forward(ly, p, x, normals, z_noisy=True):
    """Routing of x [S, M] as dense matrices: D [S, E*C] (dispatch: disp = D^T x) and
    Cw [S, E*C] (combine: moe = Cw y), C slots per expert; plus the cache for the backward."""
    s = x.shape[0]
    E, G = ly.E, ly.groups
    assert s % G == 0, "tokens must split into equal groups"
    sg = s // G
    cap = ly.capacity_per_group(s)
    c = dict(x=x, sg=sg, cap=cap)
    if ly.gate == "softmoe":
        logits = x @ p["gate.wg"]                        # [S, E*N]
        c.update(logits=logits, D=softmax_tokens(logits, 1), Cw=softmax_rows(logits), C=cap,
                 routing=(), aux=0.0, z=0.0, dropped=0, routed=0, loads=None, most=0)
        return c
    C = G * cap
    if ly.gate == "xmoe":
        h = x @ p["gate.proj"]
        hn, en = l2norm_rows(h), l2norm_rows(p["gate.expert_emb"])
        cos = hn @ en.T
        logits = cos / p["gate.temperature"]
        c.update(h=h, hn=hn, en=en, cos=cos)
    else:
        logits = x @ p["gate.wg"]
    noisy = logits + ly.noise * normals / E if (ly.noise and normals is not None) else logits
    rows = np.arange(s)[:, None]
    if ly.gate == "expert_choice":
        scores = softmax_tokens(noisy, G)
        loc = expert_choice_locations(scores, G, cap)
        idx = np.broadcast_to(np.arange(E), (s, E)).copy()
        gates = scores.copy()
        kept = loc >= 0
        dropped, routed = int((~kept.any(axis=1)).sum()), s
        # loads: kept tokens of each expert in each routing group
        loads = np.concatenate([kept[g * sg:(g + 1) * sg].sum(axis=0) for g in range(G)])
        aux, most = 0.0, 0
    else:
        scores = sigmoid(noisy) if ly.gate == "sigmoid" else softmax_rows(noisy)
        choice = scores + p["gate.eb"][None, :] if ly.balance is not None else scores
        limited = limited_choice(choice, ly.expert_groups, ly.topk_groups, ly.group_score)
        idx = topk_rows(limited, ly.k)
        c.update(choice=choice, limited=limited)
        picked = scores[rows, idx]
        renorm = ly.renorm
        zsum = picked.sum(axis=1, keepdims=True)
        gates0 = picked / zsum if renorm else picked.copy()
        gates = gates0 * ly.scale
        c.update(gates0=gates0)
        loc, most = locations(idx, E, G, None if ly.dropless else cap)
        kept = loc >= 0
        dropped, routed = int((~kept).sum()), int(kept.size)
        loads = np.concatenate([np.bincount(idx[g * sg:(g + 1) * sg][kept[g * sg:(g + 1) * sg]], minlength=E)
                                for g in range(G)])
        aux = 0.0
        if ly.aux_form == "sequence":   # per sequence: f_e = E/(K T) count_e, P_e = mean of scores/their row sum
            T = ly.seqlen
            for q in range(s // T):
                rows_q = slice(q * T, (q + 1) * T)
                f = E * np.bincount(idx[rows_q].ravel(), minlength=E) / (ly.k * T)
                P = (scores[rows_q] / scores[rows_q].sum(axis=1, keepdims=True)).mean(axis=0)
                aux += float(np.dot(f, P))
            aux /= s // T
        else:
            for g in range(G):
                me = scores[g * sg:(g + 1) * sg].mean(axis=0)
                ce = np.bincount(idx[g * sg:(g + 1) * sg, 0], minlength=E) / sg
                aux += E * float(np.dot(me, ce))
            aux /= G
        c.update(picked=picked, zsum=zsum, renorm=renorm)
    col = idx * C + (np.arange(s) // sg)[:, None] * cap + np.where(kept, loc, 0)
    D = np.zeros((s, E * C))
    Cw = np.zeros((s, E * C))
    kr, kc = np.nonzero(kept)
    D[kr, col[kr, kc]] = 1.0            # distinct columns: every kept choice has its own slot
    Cw[kr, col[kr, kc]] = gates[kr, kc]
    zl = noisy if z_noisy else logits
    lse = logsumexp_rows(zl)
    c.update(logits=logits, noisy=noisy, scores=scores, idx=idx, loc=loc, gates=gates, kept=kept,
             col=col, D=D, Cw=Cw, C=C, zl=zl, lse=lse, aux=aux, z=float(np.mean(lse ** 2)),
             routing=(idx.copy(), loc.copy()), dropped=dropped, routed=routed, loads=loads,
             most=most)
    return c


def gate_backward(ly, p, c, dD, dCw):
    """d loss/d x through the gate, and the gate's gradients, from dD, dCw [S, E*C]."""
    x, s, E, G, sg = c["x"], c["x"].shape[0], ly.E, ly.groups, c["sg"]
    grads = {}
    if ly.gate == "softmoe":
        dlogits = softmax_tokens_grad(dD, c["D"], 1) + softmax_rows_grad(dCw, c["Cw"])
        grads["gate.wg"] = x.T @ dlogits
        return dlogits @ p["gate.wg"].T, grads
    kept, col, gates = c["kept"], c["col"], c["gates"]
    dgates = np.where(kept, np.take_along_axis(dCw, np.where(kept, col, 0), axis=1), 0.0)
    sc = c["scores"]
    if ly.gate == "expert_choice":
        dnoisy = softmax_tokens_grad(dgates, sc, G)
    else:
        idx, rows = c["idx"], np.arange(s)[:, None]
        dgates = dgates * ly.scale
        if c["renorm"]:
            zsum = c["zsum"][:, 0]
            common = (dgates * c["gates0"]).sum(axis=1) / zsum
            contrib = dgates / zsum[:, None] - common[:, None]
        else:
            contrib = dgates
        if ly.balance is not None:   # the correction bias's "gradient": its load imbalance
            grads["gate.eb"] = E * np.bincount(idx.ravel(), minlength=E).astype(np.float64) - s * ly.k
        dscores = np.zeros_like(sc)
        np.add.at(dscores, (np.repeat(rows, ly.k, axis=1), idx), contrib)
        if ly.aux_coef and ly.aux_form == "pooled":    # coef * E * F_e / N, F pooled (constant)
            dscores += ly.aux_coef * E * c["pooled_fn"][None, :]
        elif ly.aux_coef and ly.aux_form == "sequence":   # f constant: coef/(T Q) (f_j - f.s_t/Z_t)/Z_t
            T = ly.seqlen
            Q = s // T
            for q in range(Q):
                rows_q = slice(q * T, (q + 1) * T)
                f = E * np.bincount(idx[rows_q].ravel(), minlength=E) / (ly.k * T)
                z = sc[rows_q].sum(axis=1, keepdims=True)
                dot = (sc[rows_q] * f[None, :]).sum(axis=1, keepdims=True)
                dscores[rows_q] += ly.aux_coef / (T * Q) * (f[None, :] - dot / z) / z
        elif ly.aux_coef:         # ce is piecewise constant
            for g in range(G):
                ce = np.bincount(idx[g * sg:(g + 1) * sg, 0], minlength=E) / sg
                dscores[g * sg:(g + 1) * sg] += ly.aux_coef * E * ce[None, :] / (sg * G)
        if ly.gate == "sigmoid":
            dnoisy = dscores * sc * (1.0 - sc)
        else:
            dnoisy = softmax_rows_grad(dscores, sc)
    dlogits = dnoisy                            # the noise is additive
    if ly.z_coef:                               # mean_s lse_s^2 -> 2 lse softmax / S
        dlogits = dlogits + ly.z_coef * 2.0 * c["lse"][:, None] * softmax_rows(c["zl"]) / s
    if ly.gate != "xmoe":
        grads["gate.wg"] = x.T @ dlogits
        return dlogits @ p["gate.wg"].T, grads
    tau = p["gate.temperature"]
    dcos = dlogits / tau
    grads["gate.temperature"] = np.asarray(-float((dlogits * c["cos"]).sum()) / tau ** 2)
    dhn = dcos @ c["en"]
    den = dcos.T @ c["hn"]
    dh = l2norm_rows_grad(dhn, c["h"])
    grads["gate.expert_emb"] = l2norm_rows_grad(den, p["gate.expert_emb"])
    grads["gate.proj"] = x.T @ dh
    return dh @ p["gate.proj"].T, grads


def expert_forward(ly, p, disp):
    if ly.ffn == "mixtral":
        h1 = np.einsum("ecm,emh->ech", disp, p["experts.w1"])
        h3 = np.einsum("ecm,emh->ech", disp, p["experts.w3"])
        a = silu(h1)
        g = a * h3
        return np.einsum("ech,ehm->ecm", g, p["experts.w2"]), dict(h1=h1, h3=h3, a=a, g=g)
    if ly.ffn == "oss":
        h1 = np.einsum("ecm,emh->ech", disp, p["experts.w1"]) + p["experts.b1"][:, None, :]
        h3 = np.einsum("ecm,emh->ech", disp, p["experts.w3"]) + p["experts.b3"][:, None, :]
        a = oss_act(h1, h3)
        y = np.einsum("ech,ehm->ecm", a, p["experts.w2"]) + p["experts.b2"][:, None, :]
        return y, dict(h1=h1, h3=h3, a=a)
    h = np.einsum("ecm,emh->ech", disp, p["experts.w1"])
    if ly.bias:
        h = h + p["experts.b1"][:, None, :]
    a = act_fwd(ly.act, h)
    y = np.einsum("ech,ehm->ecm", a, p["experts.w2"])
    if ly.bias:
        y = y + p["experts.b2"][:, None, :]
    return y, dict(h=h, a=a)


def expert_backward(ly, p, disp, ec, dy):
    grads = {}
    if ly.ffn == "mixtral":
        grads["experts.w2"] = np.einsum("ech,ecm->ehm", ec["g"], dy)
        dg = np.einsum("ecm,ehm->ech", dy, p["experts.w2"])
        dh3 = dg * ec["a"]
        dh1 = dg * ec["h3"] * silu_grad(ec["h1"])
        grads["experts.w1"] = np.einsum("ecm,ech->emh", disp, dh1)
        grads["experts.w3"] = np.einsum("ecm,ech->emh", disp, dh3)
        ddisp = np.einsum("ech,emh->ecm", dh1, p["experts.w1"]) + \
            np.einsum("ech,emh->ecm", dh3, p["experts.w3"])
        return ddisp, grads
    if ly.ffn == "oss":
        grads["experts.w2"] = np.einsum("ech,ecm->ehm", ec["a"], dy)
        grads["experts.b2"] = dy.sum(axis=1)
        da = np.einsum("ecm,ehm->ech", dy, p["experts.w2"])
        dg, du = oss_act_grads(ec["h1"], ec["h3"])
        dh1, dh3 = da * dg, da * du
        grads["experts.w1"] = np.einsum("ecm,ech->emh", disp, dh1)
        grads["experts.b1"] = dh1.sum(axis=1)
        grads["experts.w3"] = np.einsum("ecm,ech->emh", disp, dh3)
        grads["experts.b3"] = dh3.sum(axis=1)
        ddisp = np.einsum("ech,emh->ecm", dh1, p["experts.w1"]) + \
            np.einsum("ech,emh->ecm", dh3, p["experts.w3"])
        return ddisp, grads
    grads["experts.w2"] = np.einsum("ech,ecm->ehm", ec["a"], dy)
    if ly.bias:
        grads["experts.b2"] = dy.sum(axis=1)
    da = np.einsum("ecm,ehm->ech", dy, p["experts.w2"])
    dh = da * act_grad(ly.act, ec["h"])
    grads["experts.w1"] = np.einsum("ecm,ech->emh", disp, dh)
    if ly.bias:
        grads["experts.b1"] = dh.sum(axis=1)
    return np.einsum("ech,emh->ecm", dh, p["experts.w1"]), grads


def shared_forward(ly, p, x):
    """The shared expert on every token: s = (silu(x.Ws1) * (x.Ws3)).Ws2, times sigmoid(x.wsg)
    (one factor per token) when gated."""
    h1, h3 = x @ p["shared.w1"], x @ p["shared.w3"]
    a = silu(h1)
    g = a * h3
    y = g @ p["shared.w2"]
    c = dict(x=x, h1=h1, h3=h3, a=a, g=g, y=y)
    if not ly.shared_gate:
        return y, c
    c["sg"] = sigmoid(x @ p["shared.gate"])                 # [S, 1]
    return y * c["sg"], c


def shared_backward(ly, p, c, dout):
    """d loss/d x through the shared expert, and its gradients, from dout [S, M]."""
    x, grads, dx = c["x"], {}, 0.0
    dy = dout
    if ly.shared_gate:
        sg = c["sg"]
        dlogit = (dout * c["y"]).sum(axis=1, keepdims=True) * sg * (1.0 - sg)
        grads["shared.gate"] = x.T @ dlogit
        dx = dlogit @ p["shared.gate"].T
        dy = dout * sg
    grads["shared.w2"] = c["g"].T @ dy
    dg = dy @ p["shared.w2"].T
    dh3 = dg * c["a"]
    dh1 = dg * c["h3"] * silu_grad(c["h1"])
    grads["shared.w1"] = x.T @ dh1
    grads["shared.w3"] = x.T @ dh3
    return dx + dh1 @ p["shared.w1"].T + dh3 @ p["shared.w3"].T, grads


def layer_forward(ly, p, x, normals, z_noisy=True, residual=True):
    """x [S, M] float64; p: this layer's params by short name; normals [S, E] or None.
    Both orders are this math: tutel's encode/decode by index and gshard's one-hot matrices
    give the same disp [E, C, M] and combination. Returns x + moe(x), or moe(x) alone with
    residual=False (a language model's block adds its own residual, tests/ref/lm_ref.py)."""
    M, E = ly.M, ly.E
    c = gate_forward(ly, p, x, normals, z_noisy=z_noisy)
    C = c["C"]
    disp = (c["D"].T @ x).reshape(E, C, M)
    disp_h = hook(ly, "before_dispatch", disp)
    y, ec = expert_forward(ly, p, disp_h)
    y_h = hook(ly, "before_combine", y)
    moe = c["Cw"] @ y_h.reshape(E * C, M)
    if ly.shared_hidden:
        s, c["shared"] = shared_forward(ly, p, x)
        moe = moe + s
    seen = dict(before_moe_start=x, before_dispatch=disp, after_dispatch=disp_h,
                before_combine=y, after_combine=y_h, before_moe_end=moe)
    c.update(disp=disp, disp_h=disp_h, y=y, y_h=y_h, ec=ec,
             records=[(pt, seen[pt]) for pt in ly.records()])
    stats = dict(aux=c["aux"], z=c["z"], dropped=c["dropped"], routed=c["routed"],
                 cap=c["cap"], loads=c["loads"], most=c["most"])
    return (x + moe if residual else moe), c, stats


def layer_backward(ly, p, c, dout, residual=True):
    """dout: d loss / d (layer output) [S, M]. Returns dx [S, M] and the layer's gradients
    (residual as in layer_forward). Compression is straight through: d(disp) = d(disp_h),
    d(y) = d(y_h). The aux and z terms' gradients (coefficients included) are added here."""
    x, E, C, M = c["x"], ly.E, c["C"], ly.M
    y2 = c["y_h"].reshape(E * C, M)
    dCw = dout @ y2.T
    dy = (c["Cw"].T @ dout).reshape(E, C, M)
    ddisp, grads = expert_backward(ly, p, c["disp_h"], c["ec"], dy)
    ddisp2 = ddisp.reshape(E * C, M)
    dx = c["D"] @ ddisp2                         # dispatch
    if residual:
        dx = dx + dout
    dD = x @ ddisp2.T if ly.gate == "softmoe" else None
    dxg, gg = gate_backward(ly, p, c, dD, dCw)
    grads.update(gg)
    if ly.shared_hidden:
        dxs, gs = shared_backward(ly, p, c["shared"], dout)
        dx = dx + dxs
        grads.update(gs)
    return dx + dxg, grads


# ---------------------------------------------------------------- whole model
def split_params(ly, params):
    pre = ly.name + ".moe."
    return {n[len(pre):]: v for n, v in params.items() if n.startswith(pre)}


def forward_backward(layers, params, x, target, seed=0, step=1, token0=0, training=True,
                     z_noisy=True, want_grads=True):
    """x, target: [B, L, M] (any float dtype, computed in float64); params: name -> array.
    Returns dict(loss, mse, aux, z, output [B,L,M], grads {name: array}, dx, stats [per layer],
    routing [per layer: (idx, loc) arrays, () for softmoe], caches [per layer])."""
    shape = x.shape
    M = shape[-1]
    h = np.asarray(x, dtype=np.float64).reshape(-1, M)
    tgt = np.asarray(target, dtype=np.float64).reshape(-1, M)
    s = h.shape[0]
    caches, stats, aux_total = [], [], 0.0
    for ly in layers:
        ly.seqlen = shape[1] if len(shape) == 3 else s
    for li, ly in enumerate(layers):
        p = {n: np.asarray(v, dtype=np.float64) for n, v in split_params(ly, params).items()}
        normals = gate_noise_normals(seed, step, li, token0, s, ly.E) if (training and ly.noise) else None
        h, cache, st = layer_forward(ly, p, h, normals, z_noisy=z_noisy)
        caches.append((ly, p, cache))
        stats.append(st)
        aux_total += ly.aux_coef * st["aux"] + ly.z_coef * st["z"]
    diff = h - tgt
    n = diff.size
    mse = float((diff ** 2).sum() / (2 * n))
    res = dict(loss=mse + aux_total, mse=mse, aux=sum(st["aux"] for st in stats),
               z=sum(st["z"] for st in stats), output=h.reshape(shape), stats=stats,
               routing=[c["routing"] for _, _, c in caches], caches=[c for _, _, c in caches])
    if not want_grads:
        return res
    grads = {}
    d = diff / n
    for ly, p, cache in reversed(caches):
        d, g = layer_backward(ly, p, cache, d)
        for short, v in g.items():
            grads[ly.name + ".moe." + short] = v
    res["grads"] = grads
    res["dx"] = d.reshape(shape)
    return res


def same_routing(ra, rb):
    return all(len(a) == len(b) and all(np.array_equal(u, v) for u, v in zip(a, b))
               for a, b in zip(ra, rb))


def route_margin(layers, params, x, seed=0, step=1, token0=0, z_noisy=True):
    """Smallest gap, over layers and tokens, between the last kept and the first rejected score
    (token choice: the k-th and (k+1)-th score of a token; expert choice: the T-th and (T+1)-th
    score of an expert's column in a group): how far the routing is from a tie (a float32 run
    may flip a near-tie and then disagree for real). Soft MoE has no routing."""
    M = x.shape[-1]
    h = np.asarray(x, dtype=np.float64).reshape(-1, M)
    s = h.shape[0]
    gap = math.inf
    for ly in layers:
        ly.seqlen = x.shape[1] if x.ndim == 3 else s
    for li, ly in enumerate(layers):
        p = {n: np.asarray(v, dtype=np.float64) for n, v in split_params(ly, params).items()}
        normals = gate_noise_normals(seed, step, li, token0, s, ly.E) if ly.noise else None
        h2, cache, _ = layer_forward(ly, p, h, normals, z_noisy=z_noisy)
        gap = min(gap, cache_margin(ly, cache))
        h = h2
    return gap


def cache_margin(ly, cache):
    """route_margin of one layer, from its layer_forward cache (inf: no routing decision)."""
    gap = math.inf
    if ly.gate == "expert_choice":
        sg, cap = cache["sg"], cache["cap"]
        if cap < sg:
            for g in range(ly.groups):
                srt = -np.sort(-cache["scores"][g * sg:(g + 1) * sg], axis=0)
                gap = min(gap, float((srt[cap - 1] - srt[cap]).min()))
    elif ly.gate != "softmoe":
        srt = -np.sort(-cache["limited"], axis=1)
        if ly.k < ly.E:
            gap = min(gap, float((srt[:, ly.k - 1] - srt[:, ly.k]).min()))
        G, T = ly.expert_groups, ly.topk_groups
        if 1 < G and T < G:   # the group limit: the T-th and (T+1)-th group scores
            s, e = cache["choice"].shape
            grouped = np.sort(cache["choice"].reshape(s, G, e // G), axis=2)
            gs = grouped[:, :, -1] + grouped[:, :, -2] if ly.group_score == "top2" else grouped[:, :, -1]
            gs = -np.sort(-gs, axis=1)
            gap = min(gap, float((gs[:, T - 1] - gs[:, T]).min()))
    return gap


# ---------------------------------------------------------------- files
def save_npy(path, a):
    np.save(path, a)


def load_npy(path):
    return np.load(path)


def save_safetensors(path, tensors, metadata=None):
    """tensors: name -> array, stored as little-endian F32 (8-byte LE header length + JSON)."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in sorted(tensors):
        t = np.asarray(tensors[name], dtype="<f4")
        a = np.ascontiguousarray(t).reshape(t.shape)     # ascontiguousarray makes a 0-d array 1-d
        b = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)


_ST_DTYPES = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "I32": "<i4", "I64": "<i8", "U8": "u1"}


def load_safetensors(path):
    """Returns (tensors name -> array, metadata dict)."""
    with open(path, "rb") as f:
        data = f.read()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + hlen])
    meta = header.pop("__metadata__", {})
    base = 8 + hlen
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        out[name] = np.frombuffer(data[base + b:base + e], dtype=_ST_DTYPES[info["dtype"]]).reshape(
            info["shape"]).copy()
    return out, meta


# ---------------------------------------------------------------- self-test
def random_params(layers, rng, scale=0.3):
    out = {}
    for n, sh in param_shapes(layers).items():
        if n.endswith("gate.temperature"):
            out[n] = np.asarray(0.3 + 0.5 * rng.random())      # a positive temperature
        else:
            out[n] = np.asarray(rng.standard_normal(sh) * scale)
    return out


def _fd_check(layers, params, x, tgt, seed, eps=1e-6, rtol=1e-6, z_noisy=True, base=None):
    """Central differences of the loss vs the analytic gradients (of `base` when given)."""
    ref_run = forward_backward(layers, params, x, tgt, seed=seed, z_noisy=z_noisy)
    base = base or ref_run
    worst, skipped, failed = 0.0, 0, []

    def loss_at():
        r = forward_backward(layers, params, x, tgt, seed=seed, z_noisy=z_noisy, want_grads=False)
        return r["loss"], same_routing(r["routing"], ref_run["routing"])

    # a correction bias (gate.eb) steers the choice only: the loss does not move with it while the
    # routing holds (its dumped "gradient" is the load imbalance, checked against the binary)
    targets = [(n, params[n], np.zeros_like(params[n]) if n.endswith("gate.eb") else base["grads"][n])
               for n in sorted(params)] + [("input", x, base["dx"])]
    rows = []
    for name, arr, an in targets:
        fd = np.zeros_like(arr)
        mask = np.ones(arr.shape, dtype=bool)
        for i in np.ndindex(arr.shape):
            old = arr[i]
            arr[i] = old + eps
            lp, ok1 = loss_at()
            arr[i] = old - eps
            lm, ok2 = loss_at()
            arr[i] = old
            if not (ok1 and ok2):
                mask[i] = False
                skipped += 1
                continue
            fd[i] = (lp - lm) / (2 * eps)
        scale = max(float(np.abs(an).max()), 1e-12)
        err = float(np.abs(np.where(mask, fd - an, 0.0)).max()) / scale
        worst = max(worst, err)
        rows.append((name, arr.size, scale, err))
        if err > rtol:
            failed.append(name)
    return base, rows, worst, skipped, failed


_RNG_DRIVER = r"""
#include <stdio.h>
#include <stdint.h>
#include "moert.h"
int main(void) {
  const char *names[] = {"", "a", "block0.moe.gate.wg", "a0.moe.experts.w1"};
  for (int i = 0; i < 4; i++) printf("h %llu\n", (unsigned long long)rt_hash_name(names[i]));
  uint64_t keys[3] = {rt_key(rt_key(rt_key(7, 4), 1), 0), rt_key(rt_key(rt_key(7, 1), 1), 3),
                      rt_key(rt_key(42, 3), rt_hash_name("block0.moe.gate.wg"))};
  for (int k = 0; k < 3; k++) {
    printf("k %llu\n", (unsigned long long)keys[k]);
    for (uint64_t i = 0; i < 64; i++) printf("n %.17g\n", rt_normal(keys[k], i * 977));
  }
  return 0;
}
"""

# Reads n float32 from argv[1]; writes to argv[2]: the fp16 round trip, the bf16 round trip
# (n float32 each), then per row of ROW: the int8 scales (rows float32), q (n int8) and the
# round trip (n float32).
_HOOK_DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include "moert.h"
#define ROW 8
int main(int argc, char **argv) {
  FILE *f = fopen(argv[1], "rb");
  float *x = malloc(1 << 20);
  int n = (int)fread(x, sizeof *x, (1 << 20) / sizeof *x, f);
  fclose(f);
  int rows = n / ROW;
  uint16_t *h = malloc(n * 2);
  float *y = malloc(n * 4), *sc = malloc(rows * 4);
  int8_t *q = malloc(n);
  FILE *o = fopen(argv[2], "wb");
  rt_compress_f16(x, h, n); rt_decompress_f16(h, y, n); fwrite(y, 4, n, o);
  rt_compress_bf16(x, h, n); rt_decompress_bf16(h, y, n); fwrite(y, 4, n, o);
  rt_int8_scales(x, sc, rows, ROW); rt_compress_int8(x, sc, q, rows, ROW);
  rt_decompress_int8(q, sc, y, rows, ROW);
  fwrite(sc, 4, rows, o); fwrite(q, 1, n, o); fwrite(y, 4, n, o);
  fclose(o);
  return 0;
}
"""


def _hook_probe_values():
    """float32 values that exercise the rounding: ties of both 16-bit formats, subnormals,
    overflow, inf, NaN, zeros, and int8 rows with exact .5 quotients."""
    rng = np.random.default_rng(99)
    bits = []
    for base in (0x3F800000, 0x40490FDB, 0x38800000, 0x33800000, 0x477FE000, 0x7F7F0000):
        for low in (0x0000, 0x0FFF, 0x1000, 0x1001, 0x3000, 0x7FFF, 0x8000, 0x8001, 0x18000,
                    0xFFFF, 0x17FFF, 0x2000, 0x6000):
            bits += [base + low, (base + low) | 0x80000000]
    bits += [0x00000001, 0x00400000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC12345,
             0x477FF000, 0x477FEFFF, 0x33000000, 0x33000001, 0x32FFFFFF, 0x387FE000, 0x387FF000]
    vals = np.array(bits, dtype=np.uint32).view(np.float32)
    vals = np.concatenate([vals, (rng.standard_normal(256) * 10.0 ** rng.integers(-9, 5, 256))
                           .astype(np.float32)])
    vals = vals[:len(vals) // 8 * 8]
    int8_rows = [
        [127.0, 2.5, -2.5, 0.5, -0.5, 1.5, 126.5, -126.5],     # scale 1: exact halves
        [0.0] * 8,                                             # all zero: scale 1
        [3.96875, 0.015625, -0.046875, 1.0, -3.96875, 0.0, 2.0, 0.03125],
        [1e-30, -2e-30, 0.0, 5e-31, 1e-38, -1e-39, 3e-30, 0.0],
        [float("nan"), 1.0, -2.0, 0.25, 0.5, 0.75, 1.25, -1.75],
        [1e30, -3e38, 1.0, 2e38, 0.0, -1.0, 7e37, 1e-5],
    ]
    rows = np.concatenate([vals.reshape(-1, 8), np.array(int8_rows, dtype=np.float32),
                           (rng.standard_normal((16, 8)) * 0.3).astype(np.float32)])
    return rows.astype(np.float32)


def hooks_vs_c():
    """Compiles runtime/kernels/hook.c with a driver and compares the round trips bit for bit."""
    import os
    import shutil
    import subprocess
    import tempfile
    root = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    hooks_c = os.path.join(root, "runtime", "kernels", "hook.c")
    cc = shutil.which("cc")
    if not (cc and os.path.exists(hooks_c)):
        print("# compression vs runtime/kernels/hook.c: skipped (no cc or no runtime/kernels/hook.c)")
        return True
    rows = _hook_probe_values()
    n, nrows = rows.size, rows.shape[0]
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "drv.c"), os.path.join(d, "drv")
        fin, fout = os.path.join(d, "in.bin"), os.path.join(d, "out.bin")
        open(src, "w").write(_HOOK_DRIVER)
        r = subprocess.run([cc, "-O2", "-I" + os.path.join(root, "runtime"), src, hooks_c, "-lm",
                            "-o", exe], capture_output=True, text=True)
        if r.returncode != 0:
            print("# compression vs runtime/kernels/hook.c: driver did not build:\n" + r.stderr)
            return False
        rows.tofile(fin)
        subprocess.run([exe, fin, fout], check=True)
        out = open(fout, "rb").read()
    f16 = np.frombuffer(out, np.float32, n, 0)
    b16 = np.frombuffer(out, np.float32, n, 4 * n)
    sc = np.frombuffer(out, np.float32, nrows, 8 * n)
    q = np.frombuffer(out, np.int8, n, 8 * n + 4 * nrows).astype(np.float64)
    i8 = np.frombuffer(out, np.float32, n, 9 * n + 4 * nrows)
    flat = rows.ravel()

    def bits_differ(got, want):
        with np.errstate(invalid="ignore", over="ignore"):
            want = np.asarray(want, dtype=np.float32)
        nan = np.isnan(got) & np.isnan(want)
        return int((~nan & (got.view(np.uint32) != want.view(np.uint32))).sum())

    rq, rsc = int8_parts(rows)
    bad = {"fp16": bits_differ(f16, round_fp16(flat)), "bf16": bits_differ(b16, round_bf16(flat)),
           "int8 scale": bits_differ(sc, rsc), "int8 q": int((q != rq.ravel()).sum()),
           "int8": bits_differ(i8, round_int8(rows).ravel())}
    print("# compression vs runtime/kernels/hook.c: %d values (%d int8 rows), differing bits: %s"
          % (n, nrows, ", ".join("%s %d" % kv for kv in bad.items())))
    return not any(bad.values())


def rng_vs_c():
    """Compiles runtime/rng.c with a tiny driver (when cc and the file exist) and compares."""
    import os
    import shutil
    import subprocess
    import tempfile
    root = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    rng_c = os.path.join(root, "runtime", "rng.c")
    cc = shutil.which("cc")
    if not (cc and os.path.exists(rng_c)):
        print("# rng vs runtime/rng.c: skipped (no cc or no runtime/rng.c)")
        return True
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "drv.c"), os.path.join(d, "drv")
        open(src, "w").write(_RNG_DRIVER)
        vector_c = os.path.join(root, "runtime", "vector.c")   # the vector paths rng.c runs on
        r = subprocess.run([cc, "-O2", "-I" + os.path.join(root, "runtime"), src, rng_c, vector_c, "-lm",
                            "-o", exe], capture_output=True, text=True)
        if r.returncode != 0:
            print("# rng vs runtime/rng.c: driver did not build:\n" + r.stderr)
            return False
        lines = subprocess.run([exe], capture_output=True, text=True, check=True).stdout.split("\n")
    want = []
    for nm in ["", "a", "block0.moe.gate.wg", "a0.moe.experts.w1"]:
        want.append("h %d" % rt_hash_name(nm))
    keys = [rt_key(rt_key(rt_key(7, 4), 1), 0), rt_key(rt_key(rt_key(7, 1), 1), 3),
            rt_key(rt_key(42, 3), rt_hash_name("block0.moe.gate.wg"))]
    for k in keys:
        want.append("k %d" % k)
        v = rt_normal_np(k, np.arange(64) * 977)
        want += ["n %r" % float(a) for a in v]
    got = [l for l in lines if l]
    bad = 0
    for g, w in zip(got, want):
        if g[0] == "n":
            if float(g[2:]) != float(w[2:]):
                bad += 1
        elif g != w:
            bad += 1
    bad += abs(len(got) - len(want))
    print("# rng vs runtime/rng.c: %d values, %d differ (bit for bit)" % (len(want), bad))
    return bad == 0


def _ste_check(layers, params, x, t, seed):
    """Straight-through gradients of a compressed model = the gradients of its differentiable
    twin in which each round trip is `v + offset`, the offset frozen at the hooked forward's
    value (the no-hook model evaluated at the hooked forward's values). Returns (ok, lines)."""
    hooked = forward_backward(layers, params, x, t, seed=seed)
    plain = forward_backward([_strip_compress(ly) for ly in layers], params, x, t, seed=seed,
                             want_grads=False)
    twins = []
    for ly, c in zip(layers, hooked["caches"]):
        tw = _strip_compress(ly)
        tw.offsets = {}
        if ly.compress_at("before_dispatch"):
            tw.offsets["before_dispatch"] = c["disp_h"] - c["disp"]
        if ly.compress_at("before_combine"):
            tw.offsets["before_combine"] = c["y_h"] - c["y"]
        twins.append(tw)
    twin = forward_backward(twins, params, x, t, seed=seed)
    scale = float(np.abs(hooked["output"]).max())
    same_fwd = float(np.abs(twin["output"] - hooked["output"]).max()) / scale
    moved = float(np.abs(plain["output"] - hooked["output"]).max()) / scale
    gerr = max(float(np.abs(twin["grads"][n] - hooked["grads"][n]).max())
               / max(float(np.abs(hooked["grads"][n]).max()), 1e-30) for n in hooked["grads"])
    base, rows, worst, skipped, failed = _fd_check(twins, params, x, t, seed=seed, base=hooked)
    ok = same_fwd <= 1e-12 and gerr <= 1e-12 and moved > 0 and not failed
    return ok, (same_fwd, moved, gerr, rows, worst, skipped, failed)


def _strip_compress(ly):
    """A copy of the layer without its compress hooks (record hooks kept)."""
    kw = dict(embed=ly.M, experts=ly.E, hidden=ly.H, k=ly.k, capacity=ly.capacity,
              groups=ly.groups, noise=ly.noise, aux_loss=ly.aux_coef, z_loss=ly.z_coef,
              act=ly.act or "gelu", bias=ly.bias, gate=ly.gate, order=ly.order, ffn=ly.ffn,
              proj=ly.proj, slots=ly.slots, hooks=[h for h in ly.hooks if h[1] == "record"],
              renormalize=ly.renormalize, shared_hidden=ly.shared_hidden, shared_gate=ly.shared_gate,
              expert_groups=ly.expert_groups, topk_groups=ly.topk_groups, group_score=ly.group_score,
              scale=ly.scale, balance=ly.balance)
    return Layer(ly.name, **kw)


def selftest():
    # lang/manual.md §11's capacity rounding, as the compiler's ir_capacity_slots: 1.1 * 200 / 2 is
    # 110.00000000000001 in double, and T is 110
    assert Layer("c", 8, 2, 8, k=1, capacity=1.1).capacity_per_group(200) == 110
    assert Layer("c", 8, 2, 8, k=1, capacity=1.1).capacity_per_group(201) == 111
    rng = np.random.default_rng(1234)
    M, H, E = 6, 5, 4
    base_kw = dict(embed=M, experts=E, hidden=H)
    noisy = dict(noise=1.0, aux_loss=0.1, z_loss=0.01)
    cases = [
        ("k1 nodrop gelu", [("a", 1, dict(k=1, capacity=4.0))]),
        ("k1 drops noise aux z", [("a", 1, dict(k=1, capacity=0.5, **noisy))]),
        ("k2 nodrop noise aux z", [("a", 1, dict(k=2, capacity=2.0, **noisy))]),
        # `renormalize`: k 1 renormalised (every gate 1: the scores reach the loss through the
        # aux and z terms only), k 2 with the raw softmax scores
        ("k1 renormalize drops", [("a", 1, dict(k=1, capacity=0.5, renormalize=True, **noisy))]),
        # DeepSeek's choice: V3's sigmoid scores with a correction bias, 4 groups of 2 (the best 2),
        # renormalised and scaled; V2's softmax with groups ranked by their best, scaled
        ("deepseek v3 choice", [("a", 1, dict(gate="sigmoid", k=2, capacity=2.0, experts=8, renormalize=True,
                                              expert_groups=4, topk_groups=2, scale=2.5, balance=0.01))]),
        ("deepseek v2 choice", [("a", 1, dict(k=3, capacity=2.0, experts=8, renormalize=False, expert_groups=4,
                                              topk_groups=2, group_score="max", scale=1.5, **noisy))]),
        # DeepSeek-V3's sequence-wise balance loss on sigmoid scores, and on softmax ones
        ("aux sequence sigmoid", [("a", 1, dict(gate="sigmoid", k=2, capacity=2.0, experts=8, renormalize=True,
                                                aux_loss=0.3, aux="sequence", z_loss=0.01))]),
        ("aux sequence gshard", [("a", 1, dict(k=2, capacity=0.75, aux_loss=0.3, aux="sequence", noise=1.0))]),
        ("k2 renormalize false drops", [("a", 1, dict(k=2, capacity=0.75, renormalize=False,
                                                      **noisy))]),
        ("xmoe k2 renormalize false", [("a", 1, dict(gate="xmoe", k=2, capacity=2.0, proj=3,
                                                    renormalize=False, **noisy))]),
        ("k2 drops g2 relu nobias", [("a", 1, dict(k=2, capacity=0.5, groups=2, act="relu",
                                                  bias=False, noise=0.5, aux_loss=0.05,
                                                  z_loss=0.02))]),
        ("k2 drops relu2 + nobias", [("a", 1, dict(k=2, capacity=0.5, act="relu2", **noisy)),
                                     ("b", 1, dict(k=1, capacity=1.0, groups=2, act="relu2",
                                                   bias=False))]),
        ("stack a + b x2", [("a", 1, dict(k=2, capacity=0.75, **noisy)),
                            ("b", 2, dict(k=1, capacity=1.0, groups=3, act="relu", bias=False,
                                          aux_loss=0.02))]),
        ("k3 drops g2 z-clean", [("a", 1, dict(k=3, capacity=0.6, groups=2, noise=2.0,
                                              aux_loss=0.1, z_loss=0.05))]),
        ("k4 E8 mixtral drops", [("a", 1, dict(k=4, capacity=0.75, experts=8, ffn="mixtral",
                                              **noisy))]),
        ("dropless k2 g2", [("a", 1, dict(k=2, capacity="*", groups=2, **noisy))]),
        ("sigmoid k2 drops", [("a", 1, dict(gate="sigmoid", k=2, capacity=0.5, **noisy))]),
        ("sigmoid k1 mixtral dropless", [("a", 1, dict(gate="sigmoid", k=1, capacity="*",
                                                      ffn="mixtral", aux_loss=0.05,
                                                      z_loss=0.01))]),
        ("xmoe k2 drops g2 relu", [("a", 1, dict(gate="xmoe", k=2, capacity=0.5, groups=2, proj=3,
                                                act="relu", **noisy))]),
        ("xmoe k1 mixtral nodrop", [("a", 1, dict(gate="xmoe", k=1, capacity=4.0, proj=4,
                                                 ffn="mixtral", z_loss=0.02))]),
        ("expert_choice g2 noise z", [("a", 1, dict(gate="expert_choice", k=1, capacity=1.0,
                                                   groups=2, noise=1.0, z_loss=0.02))]),
        ("expert_choice k2 mixtral", [("a", 1, dict(gate="expert_choice", k=2, capacity=0.5,
                                                   ffn="mixtral"))]),
        ("softmoe slots2 gelu", [("a", 1, dict(gate="softmoe", slots=2))]),
        ("softmoe slots1 mixtral", [("a", 1, dict(gate="softmoe", slots=1, ffn="mixtral"))]),
        # the shared expert (Qwen2-MoE: gated by sigmoid(x.wsg); DeepSeek: ungated), beside the
        # routed experts of two gates
        ("shared gated k2 drops", [("a", 1, dict(k=2, capacity=0.5, ffn="mixtral", shared_hidden=3,
                                                shared_gate=True, **noisy))]),
        ("shared plain + gated xmoe g2", [
            ("a", 1, dict(k=1, capacity=1.0, shared_hidden=4)),
            ("b", 1, dict(gate="xmoe", k=2, capacity=1.0, groups=2, proj=3, shared_hidden=2,
                          shared_gate=True, hooks=[("before_moe_end", "record")], **noisy))]),
        ("stack xmoe+ec+soft+records", [
            ("a", 1, dict(gate="xmoe", k=2, capacity=1.0, proj=3, hooks=[
                (p, "record") for p in HOOK_POINTS], **noisy)),
            ("b", 1, dict(gate="expert_choice", k=2, capacity=1.0, groups=2, ffn="mixtral",
                          noise=0.5, z_loss=0.01)),
            ("c", 1, dict(gate="softmoe", slots=2, act="relu", bias=False))]),
        # gpt-oss's experts on inputs 4x larger (OSS_XSCALE), so that the gate passes 7 and the up
        # projection both -7 and 7 in some filled slots: the clamps' zero gradients are checked too
        ("oss k2 drops", [("a", 1, dict(k=2, capacity=0.75, ffn="oss", **noisy))]),
        ("oss stack sigmoid + gshard", [("a", 1, dict(gate="sigmoid", k=1, capacity="*", ffn="oss")),
                                        ("b", 1, dict(k=2, capacity=2.0, ffn="oss", aux_loss=0.1))]),
    ]
    OSS_XSCALE = 4.0
    ste_cases = [
        ("ste fp16 disp", [("a", 1, dict(k=2, capacity=1.0, hooks=[("before_dispatch", "fp16")]))]),
        ("ste bf16 comb mixtral", [("a", 1, dict(gate="sigmoid", k=2, capacity=0.5, ffn="mixtral",
                                                 hooks=[("before_combine", "bf16")], **noisy))]),
        ("ste int8 both xmoe", [("a", 1, dict(gate="xmoe", k=2, capacity=1.0, proj=3, hooks=[
            ("before_dispatch", "int8"), ("before_combine", "int8")], **noisy))]),
        ("ste bf16+fp16 ec", [("a", 1, dict(gate="expert_choice", k=1, capacity=1.0, groups=2,
                                            hooks=[("before_dispatch", "bf16"),
                                                   ("before_combine", "fp16"),
                                                   ("after_combine", "record")]))]),
        ("ste int8+bf16 softmoe", [("a", 1, dict(gate="softmoe", slots=2, ffn="mixtral", hooks=[
            ("before_dispatch", "int8"), ("before_combine", "bf16")]))]),
    ]
    print("# moe_ref selftest: central finite differences (eps 1e-6, float64) vs manual backward")
    print("# %-28s %-22s %6s %10s %10s" % ("case", "tensor", "numel", "max|grad|", "rel.err"))
    ok = True
    worst_all = 0.0
    B, L = 2, 6
    for cname, items in cases:
        layers = expand_layers([(n, r, dict(base_kw, **kw)) for n, r, kw in items])
        params = random_params(layers, rng, 0.5)
        x = rng.standard_normal((B, L, M)) * (OSS_XSCALE if cname.startswith("oss") else 1.0)
        t = rng.standard_normal((B, L, M))
        z_noisy = "z-clean" not in cname
        base, rows, worst, skipped, failed = _fd_check(layers, params, x, t, seed=7, z_noisy=z_noisy)
        worst_all = max(worst_all, worst)
        drops = sum(st["dropped"] for st in base["stats"])
        for name, n, scale, err in rows:
            print("  %-28s %-22s %6d %10.3e %10.3e %s" % (cname, name, n, scale, err,
                                                         "" if err <= 1e-6 else "<-- FAIL"))
        print("# %s: loss %.6f dropped %d/%d, fd entries skipped (routing changed) %d"
              % (cname, base["loss"], drops, sum(st["routed"] for st in base["stats"]), skipped))
        if failed:
            ok = False
        if "drops" in cname and drops == 0:
            print("# %s: expected drops, got none" % cname)
            ok = False
        if ("dropless" in cname or "nodrop" in cname) and drops:
            print("# %s: expected no drops, got %d" % (cname, drops))
            ok = False
        # the oss cases reach every clamp in the slots that hold tokens
        for ly, c in zip(layers, base["caches"]):
            if ly.ffn != "oss":
                continue
            filled = np.abs(c["disp_h"]).sum(axis=2) > 0
            g, u = c["ec"]["h1"][filled], c["ec"]["h3"][filled]
            counts = (int((g > OSS_LIMIT).sum()), int((u < -OSS_LIMIT).sum()), int((u > OSS_LIMIT).sum()))
            print("# %s: layer %s clamps gate > 7, up < -7, up > 7 in %d, %d, %d of %d elements"
                  % (cname, ly.name, counts[0], counts[1], counts[2], g.size))
            ok = ok and min(counts) > 0
        # `renormalize` true with k 1 makes every gate exactly 1; false keeps the chosen scores
        for ly, c in zip(layers, base["caches"]):
            if ly.renormalize is None:
                continue
            if not ly.renormalize:
                want, what = c["picked"], "the softmax scores as gates"
            elif ly.k == 1:
                want, what = np.ones_like(c["gates"]), "gates of exactly 1"
            else:
                want, what = c["picked"] / c["picked"].sum(axis=1, keepdims=True), "gates summing to 1"
            same = np.array_equal(c["gates"], want * ly.scale)
            print("# %s: renormalize %s with k %d gives %s: %s" % (cname, ly.renormalize, ly.k, what,
                                                                   same))
            ok = ok and same
        # record hooks do not change the math
        if any(ly.records() for ly in layers):
            bare = [_strip_compress(ly) for ly in layers]
            for ly in bare:
                ly.hooks = []
            r2 = forward_backward(bare, params, x, t, seed=7, z_noisy=z_noisy)
            same = np.array_equal(r2["output"], base["output"]) and all(
                np.array_equal(r2["grads"][n], base["grads"][n]) for n in base["grads"])
            print("# %s: record hooks leave output and gradients unchanged: %s" % (cname, same))
            ok = ok and same
    print("# straight-through compression: the hooked model's gradients vs central differences"
          " of its twin with the round trip frozen to `v + offset` at the hooked values")
    for cname, items in ste_cases:
        layers = expand_layers([(n, r, dict(base_kw, **kw)) for n, r, kw in items])
        params = random_params(layers, rng, 0.5)
        x = rng.standard_normal((B, L, M))
        t = rng.standard_normal((B, L, M))
        good, (same_fwd, moved, gerr, rows, worst, skipped, failed) = _ste_check(layers, params, x,
                                                                                 t, 7)
        worst_all = max(worst_all, worst)
        for name, n, scale, err in rows:
            print("  %-28s %-22s %6d %10.3e %10.3e %s" % (cname, name, n, scale, err,
                                                         "" if err <= 1e-6 else "<-- FAIL"))
        print("# %s: twin forward = hooked forward (rel %.1e), compression moved the output by "
              "rel %.2e, twin grads = STE grads (rel %.1e), fd skipped %d: %s"
              % (cname, same_fwd, moved, gerr, skipped, "ok" if good else "FAILED"))
        ok = ok and good
    # RNG spot checks: scalar and vectorised paths agree, and known invariants hold
    key = rt_key(rt_key(rt_key(7, RT_STREAM_NOISE), 1), 0)
    v = rt_normal_np(key, np.arange(16))
    s = np.array([rt_normal(key, i) for i in range(16)])
    if not np.array_equal(v, s):
        print("# rng: vectorised rt_normal differs from scalar")
        ok = False
    if rt_mix(0) != 0xE220A8397B1DCDAF:   # splitmix64's first output from state 0
        print("# rng: rt_mix(0) = %#x, expected 0xe220a8397b1dcdaf" % rt_mix(0))
        ok = False
    if rt_hash_name("") != 0xCBF29CE484222325 or rt_hash_name("a") != 0xAF63DC4C8601EC8C:
        print("# rng: FNV-1a mismatch")
        ok = False
    # compression spot checks that do not need a compiler
    spot = [(round_bf16(np.array([1.0 + 2.0 ** -8]))[0], 1.0),               # tie -> even
            (round_bf16(np.array([1.0 + 3 * 2.0 ** -8]))[0], 1.0 + 2.0 ** -6),
            (round_fp16(np.array([1.0 + 2.0 ** -11]))[0], 1.0),
            (round_fp16(np.array([65520.0]))[0], math.inf),
            (round_int8(np.array([[127.0, 2.5, -2.5, 0.5]]))[0, 1:].tolist(), [3.0, -3.0, 1.0]),
            (round_int8(np.zeros((1, 3)))[0].tolist(), [0.0, 0.0, 0.0])]
    for got, want in spot:
        if got != want:
            print("# compression spot check: got %r, want %r" % (got, want))
            ok = False
    ok = rng_vs_c() and ok
    ok = hooks_vs_c() and ok
    print("# worst relative error %.3e (tolerance 1e-6)" % worst_all)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    if "--selftest" in sys.argv[1:]:
        sys.exit(selftest())
    print(__doc__)
    print("usage: moe_ref.py --selftest")
    sys.exit(2)
