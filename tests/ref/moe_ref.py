#!/usr/bin/python3
"""Independent numpy reference of moec's gshard gate + tutel order + `ffn gpt` MoE layer stack.

Written from DESIGN.md §2 ("Exact semantics") and runtime/moert.h only, not from the runtime's
code, so that tests/ref/test_ref.py can hold the compiled binary against it. Everything is
float64. The backward pass is written by hand (chain rule through decode, experts, encode, the
renormalised gate gather, softmax, noise, aux and z losses) and `--selftest` checks it against
central finite differences of the reference's own forward.

Model (S = B*L tokens, x [S, M]); per MoE layer instance, in order:
  logits = x.Wg;  noisy = logits + sigma*N(0,1)/E (training);  scores = softmax(noisy)
  idx = top-k of scores (ties: lower index);  gates = scores[idx] (/ their sum when k > 1)
  groups: G equal runs of tokens; T = ceil(k*f*S_g/E); locations: first choices in token order,
  then second choices ...; loc >= T is dropped (contributes zero)
  y_e = act(disp_e.W1_e + b1_e).W2_e + b2_e;  out = x + sum_j kept gate_j * y_{idx_j}[slot_j]
  aux = mean_g E*sum_e me_ge*ce_ge (me: mean score, ce: fraction of first choices)
  z = mean_s logsumexp(noisy_s)^2
      DESIGN §2 adds the noise "to the logits" and then uses "logits" for both softmax and z, so
      z sees the noisy logits (what the softmax sees); z_noisy=False gives the x.Wg reading.
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
    u1 = rt_uniform(rt_key(key, 2 * i))
    u2 = rt_uniform(rt_key(key, 2 * i + 1))
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


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


def rt_normal_np(key, idx):
    """rt_normal(key, i) for every i of the int array idx, vectorised (uint64 wraparound)."""
    i = np.asarray(idx, dtype=np.uint64)
    k = np.uint64(key & MASK64)
    with np.errstate(over="ignore"):
        h1 = _mix_np(k ^ _mix_np(np.uint64(2) * i))
        h2 = _mix_np(k ^ _mix_np(np.uint64(2) * i + np.uint64(1)))
    u1 = ((h1 >> np.uint64(40)).astype(np.float64) + 0.5) / 16777216.0
    u2 = ((h2 >> np.uint64(40)).astype(np.float64) + 0.5) / 16777216.0
    # libm's log/cos through math (numpy's SIMD versions can differ from C's by an ulp)
    out = [math.sqrt(-2.0 * math.log(a)) * math.cos(2.0 * math.pi * b)
           for a, b in zip(u1.ravel().tolist(), u2.ravel().tolist())]
    return np.array(out, dtype=np.float64).reshape(u1.shape)


def gate_noise_normals(seed, step, layer, token0, s, e):
    """The N(0,1) draws of rt_gate_noise: [s, e], token t = token0 + row, element t*e + j."""
    key = rt_key(rt_key(rt_key(seed, RT_STREAM_NOISE), step), layer)
    idx = (token0 + np.arange(s, dtype=np.int64))[:, None] * e + np.arange(e, dtype=np.int64)[None, :]
    return rt_normal_np(key, idx)


def synthetic_batch(seed, step, batch, seqlen, embed, sample0=0):
    """CONTRACTS.md synthetic data: x [B, L, M] and target (float32, as the binary stores them)."""
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
class Layer:
    """One MoE layer instance (`layer NAME x N` gives N of these: NAME0, NAME1, ...)."""

    def __init__(self, name, embed, experts, hidden, k=1, capacity=1.0, groups=1, noise=0.0,
                 aux_loss=0.0, z_loss=0.0, act="gelu", bias=True):
        self.name, self.M, self.E, self.H = name, embed, experts, hidden
        self.k, self.capacity, self.groups, self.noise = k, capacity, groups, noise
        self.aux_coef, self.z_coef, self.act, self.bias = aux_loss, z_loss, act, bias

    def param_shapes(self):
        p = self.name + ".moe."
        shapes = {p + "gate.wg": (self.M, self.E), p + "experts.w1": (self.E, self.M, self.H)}
        if self.bias:
            shapes[p + "experts.b1"] = (self.E, self.H)
        shapes[p + "experts.w2"] = (self.E, self.H, self.M)
        if self.bias:
            shapes[p + "experts.b2"] = (self.E, self.M)
        return shapes

    def capacity_per_group(self, s):
        sg = s // self.groups
        return int(math.ceil(self.k * self.capacity * sg / self.E))


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


def act_fwd(name, h):
    return gelu(h) if name == "gelu" else np.maximum(h, 0.0)


def act_grad(name, h):
    return gelu_grad(h) if name == "gelu" else (h > 0).astype(h.dtype)


# ---------------------------------------------------------------- one layer
def softmax_rows(z):
    m = z.max(axis=1, keepdims=True)
    e = np.exp(z - m)
    return e / e.sum(axis=1, keepdims=True)


def logsumexp_rows(z):
    m = z.max(axis=1)
    return m + np.log(np.exp(z - m[:, None]).sum(axis=1))


def topk_rows(scores, k):
    # stable sort of -scores: equal scores keep index order, so ties go to the lower index
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def locations(idx, e, groups, cap):
    """loc[s, j]: slot of choice j of token s in its group's buffer of expert idx[s, j], or -1."""
    s, k = idx.shape
    sg = s // groups
    loc = np.full((s, k), -1, dtype=np.int64)
    for g in range(groups):
        count = np.zeros(e, dtype=np.int64)
        for j in range(k):
            for t in range(g * sg, (g + 1) * sg):
                ex = idx[t, j]
                if count[ex] < cap:
                    loc[t, j] = count[ex]
                count[ex] += 1
    return loc


def layer_forward(ly, p, x, normals, z_noisy=True):
    """x [S, M] float64; p: this layer's params by short name; normals [S, E] or None."""
    s = x.shape[0]
    E, k, G = ly.E, ly.k, ly.groups
    assert s % G == 0, "tokens must split into equal groups"
    sg = s // G
    cap = ly.capacity_per_group(s)
    logits = x @ p["gate.wg"]
    noisy = logits + ly.noise * normals / E if (ly.noise and normals is not None) else logits
    scores = softmax_rows(noisy)
    idx = topk_rows(scores, k)
    rows = np.arange(s)[:, None]
    picked = scores[rows, idx]
    zsum = picked.sum(axis=1, keepdims=True)
    gates = picked / zsum if k > 1 else picked.copy()
    loc = locations(idx, E, G, cap)
    kept = loc >= 0
    slot = (np.arange(s) // sg)[:, None] * cap + np.where(kept, loc, 0)   # row in [E, G*cap]
    C = G * cap
    disp = np.zeros((E, C, ly.M))
    for j in range(k):
        for t in range(s):
            if kept[t, j]:
                disp[idx[t, j], slot[t, j]] = x[t]
    h = np.einsum("ecm,emh->ech", disp, p["experts.w1"])
    if ly.bias:
        h = h + p["experts.b1"][:, None, :]
    a = act_fwd(ly.act, h)
    y = np.einsum("ech,ehm->ecm", a, p["experts.w2"])
    if ly.bias:
        y = y + p["experts.b2"][:, None, :]
    moe = np.zeros_like(x)
    for j in range(k):
        for t in range(s):
            if kept[t, j]:
                moe[t] += gates[t, j] * y[idx[t, j], slot[t, j]]
    # losses, per group then averaged over groups
    aux = 0.0
    for g in range(G):
        sc = scores[g * sg:(g + 1) * sg]
        me = sc.mean(axis=0)
        ce = np.bincount(idx[g * sg:(g + 1) * sg, 0], minlength=E) / sg
        aux += E * float(np.dot(me, ce))
    aux /= G
    zl = noisy if z_noisy else logits
    lse = logsumexp_rows(zl)
    z = float(np.mean(lse ** 2))
    cache = dict(x=x, logits=logits, noisy=noisy, scores=scores, idx=idx, zsum=zsum, gates=gates,
                 kept=kept, slot=slot, disp=disp, h=h, a=a, y=y, lse=lse, zl=zl, cap=cap, sg=sg)
    stats = dict(aux=aux, z=z, dropped=int((~kept).sum()), routed=int(kept.size), cap=cap)
    return x + moe, cache, stats


def layer_backward(ly, p, c, dout):
    """dout: d loss / d (layer output) [S, M]. Returns dx [S, M] and the layer's gradients."""
    x, s = c["x"], c["x"].shape[0]
    E, k, G, sg = ly.E, ly.k, ly.groups, c["sg"]
    idx, kept, slot, gates, y = c["idx"], c["kept"], c["slot"], c["gates"], c["y"]
    grads = {}
    dx = dout.copy()                       # residual
    # decode: moe[t] = sum_j kept gates[t,j] * y[idx, slot]
    dy = np.zeros_like(y)
    dgates = np.zeros_like(gates)
    for j in range(k):
        for t in range(s):
            if kept[t, j]:
                dy[idx[t, j], slot[t, j]] += gates[t, j] * dout[t]
                dgates[t, j] = float(np.dot(dout[t], y[idx[t, j], slot[t, j]]))
    # experts
    grads["experts.w2"] = np.einsum("ech,ecm->ehm", c["a"], dy)
    if ly.bias:
        grads["experts.b2"] = dy.sum(axis=1)
    da = np.einsum("ecm,ehm->ech", dy, p["experts.w2"])
    dh = da * act_grad(ly.act, c["h"])
    grads["experts.w1"] = np.einsum("ecm,ech->emh", c["disp"], dh)
    if ly.bias:
        grads["experts.b1"] = dh.sum(axis=1)
    ddisp = np.einsum("ech,emh->ecm", dh, p["experts.w1"])
    # encode
    for j in range(k):
        for t in range(s):
            if kept[t, j]:
                dx[t] += ddisp[idx[t, j], slot[t, j]]
    # gather (+ renormalisation): g_j = s_{i_j} / Z, Z = sum_l s_{i_l}
    dscores = np.zeros_like(c["scores"])
    rows = np.arange(s)[:, None]
    if k > 1:
        zsum = c["zsum"][:, 0]
        common = (dgates * gates).sum(axis=1) / zsum
        contrib = dgates / zsum[:, None] - common[:, None]
    else:
        contrib = dgates
    np.add.at(dscores, (np.repeat(rows, k, axis=1), idx), contrib)
    # aux: coef * mean_g E * sum_e me_ge ce_ge; ce is piecewise constant
    if ly.aux_coef:
        for g in range(G):
            ce = np.bincount(idx[g * sg:(g + 1) * sg, 0], minlength=E) / sg
            dscores[g * sg:(g + 1) * sg] += ly.aux_coef * E * ce[None, :] / (sg * G)
    # softmax
    sc = c["scores"]
    dnoisy = sc * (dscores - (sc * dscores).sum(axis=1, keepdims=True))
    dlogits = dnoisy                        # the noise is additive
    # z: mean_s lse_s^2 -> d/dz = 2 lse softmax(z) / S
    if ly.z_coef:
        dlogits = dlogits + ly.z_coef * 2.0 * c["lse"][:, None] * softmax_rows(c["zl"]) / s
    grads["gate.wg"] = x.T @ dlogits
    dx += dlogits @ p["gate.wg"].T
    return dx, grads


# ---------------------------------------------------------------- whole model
def split_params(ly, params):
    pre = ly.name + ".moe."
    return {n[len(pre):]: v for n, v in params.items() if n.startswith(pre)}


def forward_backward(layers, params, x, target, seed=0, step=1, token0=0, training=True,
                     z_noisy=True, want_grads=True):
    """x, target: [B, L, M] (any float dtype, computed in float64); params: name -> array.
    Returns dict(loss, mse, aux, z, output [B,L,M], grads {name: array}, dx, stats [per layer],
    routing [(idx, kept) per layer])."""
    shape = x.shape
    M = shape[-1]
    h = np.asarray(x, dtype=np.float64).reshape(-1, M)
    tgt = np.asarray(target, dtype=np.float64).reshape(-1, M)
    s = h.shape[0]
    caches, stats, aux_total = [], [], 0.0
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
               routing=[(c["idx"].copy(), c["kept"].copy()) for _, _, c in caches])
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


def route_margin(layers, params, x, seed=0, step=1, token0=0, z_noisy=True):
    """Smallest gap, over layers and tokens, between the k-th and (k+1)-th score: how far the
    routing is from a tie (a float32 run may flip a near-tie and then disagree for real)."""
    M = x.shape[-1]
    h = np.asarray(x, dtype=np.float64).reshape(-1, M)
    s = h.shape[0]
    gap = math.inf
    for li, ly in enumerate(layers):
        p = {n: np.asarray(v, dtype=np.float64) for n, v in split_params(ly, params).items()}
        normals = gate_noise_normals(seed, step, li, token0, s, ly.E) if ly.noise else None
        h2, cache, _ = layer_forward(ly, p, h, normals, z_noisy=z_noisy)
        srt = -np.sort(-cache["scores"], axis=1)
        if ly.k < ly.E:
            gap = min(gap, float((srt[:, ly.k - 1] - srt[:, ly.k]).min()))
        h = h2
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
        a = np.ascontiguousarray(np.asarray(tensors[name], dtype="<f4"))
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
    return {n: rng.standard_normal(sh) * scale for n, sh in param_shapes(layers).items()}


def _fd_check(layers, params, x, tgt, seed, eps=1e-6, rtol=1e-6, z_noisy=True):
    base = forward_backward(layers, params, x, tgt, seed=seed, z_noisy=z_noisy)
    worst, skipped, failed = 0.0, 0, []

    def loss_at(pp, xx):
        r = forward_backward(layers, pp, xx, tgt, seed=seed, z_noisy=z_noisy, want_grads=False)
        same = all((a[0] == b[0]).all() and (a[1] == b[1]).all()
                   for a, b in zip(r["routing"], base["routing"]))
        return r["loss"], same

    targets = [(n, params[n], base["grads"][n]) for n in sorted(params)] + [("input", x, base["dx"])]
    rows = []
    for name, arr, an in targets:
        fd = np.zeros_like(arr)
        mask = np.ones(arr.shape, dtype=bool)
        for i in np.ndindex(arr.shape):
            old = arr[i]
            arr[i] = old + eps
            lp, ok1 = loss_at(params, x)
            arr[i] = old - eps
            lm, ok2 = loss_at(params, x)
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
        r = subprocess.run([cc, "-O2", "-I" + os.path.join(root, "runtime"), src, rng_c, "-lm",
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


def selftest():
    rng = np.random.default_rng(1234)
    M, H, E = 6, 5, 4
    base_kw = dict(embed=M, experts=E, hidden=H)
    cases = [
        ("k1 nodrop gelu", 2, 6, [("a", 1, dict(k=1, capacity=4.0))]),
        ("k1 drops noise aux z", 2, 6, [("a", 1, dict(k=1, capacity=0.5, noise=1.0, aux_loss=0.1,
                                                     z_loss=0.01))]),
        ("k2 nodrop noise aux z", 2, 6, [("a", 1, dict(k=2, capacity=2.0, noise=1.0, aux_loss=0.1,
                                                      z_loss=0.01))]),
        ("k2 drops g2 relu nobias", 2, 6, [("a", 1, dict(k=2, capacity=0.5, groups=2, act="relu",
                                                        bias=False, noise=0.5, aux_loss=0.05,
                                                        z_loss=0.02))]),
        ("stack a + b x2", 2, 6, [("a", 1, dict(k=2, capacity=0.75, noise=1.0, aux_loss=0.1,
                                               z_loss=0.01)),
                                  ("b", 2, dict(k=1, capacity=1.0, groups=3, act="relu", bias=False,
                                                aux_loss=0.02))]),
        ("k3 drops g2 z-clean", 2, 6, [("a", 1, dict(k=3, capacity=0.6, groups=2, noise=2.0,
                                                    aux_loss=0.1, z_loss=0.05))]),
    ]
    print("# moe_ref selftest: central finite differences (eps 1e-6, float64) vs manual backward")
    print("# %-26s %-22s %6s %10s %10s" % ("case", "tensor", "numel", "max|grad|", "rel.err"))
    ok = True
    worst_all = 0.0
    for cname, B, L, items in cases:
        layers = expand_layers([(n, r, dict(base_kw, **kw)) for n, r, kw in items])
        params = random_params(layers, rng, 0.5)
        x = rng.standard_normal((B, L, M))
        t = rng.standard_normal((B, L, M))
        z_noisy = "z-clean" not in cname
        base, rows, worst, skipped, failed = _fd_check(layers, params, x, t, seed=7, z_noisy=z_noisy)
        worst_all = max(worst_all, worst)
        drops = sum(st["dropped"] for st in base["stats"])
        for name, n, scale, err in rows:
            print("  %-26s %-22s %6d %10.3e %10.3e %s" % (cname, name, n, scale, err,
                                                         "" if err <= 1e-6 else "<-- FAIL"))
        print("# %s: loss %.6f dropped %d/%d, fd entries skipped (routing changed) %d"
              % (cname, base["loss"], drops, sum(st["routed"] for st in base["stats"]), skipped))
        if failed:
            ok = False
        if "drops" in cname and drops == 0:
            print("# %s: expected drops, got none" % cname)
            ok = False
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
    ok = rng_vs_c() and ok
    print("# worst relative error %.3e (tolerance 1e-6)" % worst_all)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    if "--selftest" in sys.argv[1:]:
        sys.exit(selftest())
    print(__doc__)
    print("usage: moe_ref.py --selftest")
    sys.exit(2)
