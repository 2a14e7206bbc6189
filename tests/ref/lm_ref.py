#!/usr/bin/python3
"""Independent float64 numpy reference of moec's language models (lang/manual.md §7.2), next to
tests/ref/moe_ref.py, whose MoE layer (every gate, expert, order, aux and z loss), RNG and
file readers/writers it imports rather than repeats. Written from lang/manual.md §11 and §2.1, not from
moec's kernels, so that tests/ref/test_lm_ref.py can hold a compiled language model against it.
The backward pass is written by hand; `--selftest` checks it against central finite
differences of this file's own forward.

Model (tokens t [B, L+1] int; S = B*L rows, row s = b*L + i, sample-major; d = head_dim,
default M/heads):
  h = wte[t[b, i]] (+ wpe[i] when `position learned`)                    i < L
  per layer instance (global index li counts dense and MoE layers in the order written):
    a  = h + Attn(Norm_attn(h))
    h' = a + F(Norm_ffn(a))          F = the MoE of §2 without its residual (moe_ref,
                                     residual=False; gate noise layer li, token0 0, step 1)
                                     or the mlp (the same ffn, one expert, no gate)
  logits = Norm_final(h) . wte^T (tied) or . head.w [M, V]
  ce = mean_s (logsumexp(logits_s) - logits_s[t[b, i+1]])
  loss = ce + sum over MoE layers (aux_coef*aux + z_coef*z)      (aux, z as moe_ref: per routing
                                                                    group, averaged over groups)
         except for the layers with aux "pooled" (transformers' load_balancing_loss_func), whose
         one loss replaces their aux terms: over all of them and all their tokens (N = layers x
         tokens), P_e = mean softmax score, F_e = (number of top-k choices of e)/N, aux_pooled =
         E sum_e F_e P_e, added once times their (shared) coefficient; its gradient into each
         pooled layer's scores is coef E F_e/N (F constant)
  LayerNorm(x) = (x - mean)/sqrt(var + eps)*w + b (biased var over M); RMSNorm = x/sqrt(mean x^2 + eps)*w
  Attn(x): q = x.Wq (+bq) [S, H*d], k = x.Wk (+bk), v = x.Wv (+bv) [S, KV*d] (biases with
    `bias true` or `bias qkv`); query head h reads
    key/value head h // (H/KV); `qk_norm` (after the biases, before RoPE): RMSNorm with the
    model's eps and a learned scale, `head` over each head's d columns (q_norm.weight and
    k_norm.weight [d], shared by the heads: Qwen3-MoE), `whole` over all H*d columns of q and
    KV*d of k (weights [H*d], [KV*d]: OLMoE); RoPE (rotate_half, after the biases, q and k, per
    head): for c < d/2 the pair (c, c+d/2) rotates by angle i*theta^(-2c/d), (u, w) -> (u cos -
    w sin, w cos + u sin); scores q.k^T/sqrt(d), causal (key j <= query i; with `window W` also
    j > i - W, transformers' sliding window), softmax, o = p.v, heads concatenated, y = o.Wo
    [H*d, M] (+bo with `bias true` only).
  LoRA (the model's `lora { r R; alpha A; targets ...; }`, LMModel(lora=dict(r, alpha, targets));
    frontend/lower.c fe_lora, fe_expert_linear, shared_expert, lower_lm.c linear): each adapted
    weight W [in, out] (q k v o: attn.wq wk wv wo; mlp: a dense layer's mlp.w1 (w3) w2; shared:
    moe.shared.w1 w3 w2) gets W.lora_A [in, r], W.lora_B [r, out] and the frozen W.lora_scale [r]
    (every element alpha/r), and its output x.W (+ b) becomes x.W (+ b) + ((x.A) * s).B; the
    routed experts' W [E, in, out] (experts: moe.experts.w1 (w3) w2) get A [E, in, r], B [E, r, out]
    and one s [r], expert e adding ((x_e.A_e) * s).B_e to x_e.W_e (before its bias); the experts' w3
    has no A and s of its own but w1's (one A for transformers' gate_up_proj, as PEFT adapts it;
    lora(share_up=False): its own), with its own B. That is x.(W + (A * s).B): the forward uses
    the merged weight, the backward turns its gradient dW into dA = (dW.B^T) * s (summed over the
    weights that share A) and dB = (A * s)^T.dW. Only lora_A and lora_B are trained: every other
    parameter is frozen and has no gradient (LMModel.trained). lora_init gives the binary's initial adapters
    (A uniform within +-1/sqrt(in) from moert's RNG, B 0, s alpha/r). lora(scale="out") puts s
    [out] on the product's columns instead (((x.A).B) * s), the same model.

    /usr/bin/python3 tests/ref/lm_ref.py --selftest
"""
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_ref  # noqa: E402

NOISE_STEP = 1          # the dumped step: the gate noise of step 1
LORA_TARGETS = ("q", "k", "v", "o", "experts", "shared", "mlp")


# ---------------------------------------------------------------- model description
class Attention:
    """bias: True (q, k, v and o), False (none) or "qkv" (q, k, v only); head_dim: d, default
    embed/heads; qk_norm: None, "head" or "whole"; window: None or W >= 1 (keys i-W < j <= i);
    sinks: gpt-oss's learned logit per head (attn.sinks [H]) in each row's softmax, weight
    without a value."""

    def __init__(self, heads, kv_heads=None, bias=True, head_dim=None, qk_norm=None, window=None,
                 sinks=False, mla=None):
        self.heads = heads
        self.kv_heads = heads if kv_heads is None else kv_heads
        assert bias in (True, False, "qkv")
        self.bias = bias
        self.bias_qkv = bias is True or bias == "qkv"
        self.bias_o = bias is True
        self.head_dim = head_dim
        assert qk_norm in (None, "head", "whole")
        self.qk_norm = qk_norm
        assert window is None or window >= 1
        self.window = window
        self.sinks = sinks
        # DeepSeek's multi-head latent attention: dict(q_lora (0: one q projection), kv_lora, nope,
        # rope, v); `bias` True puts biases on the down projections and the output
        self.mla = mla
        if mla:
            self.head_dim = mla["nope"] + mla["rope"]
        assert self.heads % self.kv_heads == 0


class LMLayer:
    """One layer instance: `name` (statement name + repeat index), global index `index`,
    attention, and either `moe` (a moe_ref.Layer named like the instance) or `mlp`
    (a moe_ref.Layer with one expert, used only for its ffn: kind, act, bias, hidden)."""

    def __init__(self, name, index, embed, attention, moe=None, mlp=None):
        assert (moe is None) != (mlp is None), "a layer holds exactly one of moe and mlp"
        self.name, self.index, self.M = name, index, embed
        self.attn = Attention(**attention)
        if self.attn.head_dim is None:
            assert embed % self.attn.heads == 0
            self.d = embed // self.attn.heads
        else:
            self.d = self.attn.head_dim
        self.moe = moe_ref.Layer(name, embed, **moe) if moe is not None else None
        if mlp is not None:
            kw = dict(mlp)
            ffn = kw.pop("ffn", "gpt")
            self.mlp = moe_ref.Layer(name, embed, 1, kw.pop("hidden"), ffn=ffn, **kw)
        else:
            self.mlp = None


class LMModel:
    """vocab V, batch B, seqlen L, embed M; position learned | rope (theta); norm layernorm |
    rmsnorm (eps); tie_embeddings; seed (gate noise). items: [(name, repeat, dict(attention=
    dict(heads, kv_heads, bias), moe=kwargs of moe_ref.Layer without embed | mlp=dict(ffn
    gpt|mixtral, hidden, act, bias)))] -> instances name0, name1, ... per statement."""

    def __init__(self, vocab, batch, seqlen, embed, items, position="learned", theta=10000.0,
                 norm="layernorm", eps=1e-5, tie_embeddings=True, seed=0, interleave=False, yarn=None,
                 lora=None):
        assert position in ("learned", "rope") and norm in ("layernorm", "rmsnorm")
        # the model's `lora { r R; alpha A; targets ...; }`: dict(r, alpha (default 8), targets,
        # scale: where the frozen lora_scale (every element alpha/r) multiplies, "r" (default: x.A's
        # r columns before B, lora_scale [r], as frontend/lower.c fe_lora now lowers it) or "out"
        # (the product's out columns, lora_scale [out]); the same sum, other shapes and rounding;
        # share_up: the routed experts' w3 (mixtral, oss) uses w1's lora_A and lora_scale with a
        # lora_B of its own (default True, as fe_expert_linear lowers it: transformers keeps the
        # experts' gate and up projections in one gate_up_proj, and PEFT's adapter of it has one A))
        if lora is not None:
            lora = dict(lora)
            lora.setdefault("alpha", 8.0)
            lora.setdefault("scale", "r")
            lora.setdefault("share_up", True)
            lora["targets"] = tuple(lora["targets"])
            assert lora["r"] >= 1 and set(lora["targets"]) <= set(LORA_TARGETS), lora
            assert lora["scale"] in ("r", "out"), lora
        self.lora = lora
        self.V, self.B, self.L, self.M = vocab, batch, seqlen, embed
        self.position, self.theta, self.norm, self.eps = position, float(theta), norm, float(eps)
        # rope on adjacent pairs (DeepSeek); yarn: dict(factor, original, beta_fast, beta_slow,
        # mscale, mscale_all_dim, truncate) as the manual's §7.2
        self.interleave, self.yarn = interleave, yarn
        self.tie, self.seed = tie_embeddings, seed
        self.items = items
        self.layers = []
        for name, repeat, kw in items:
            for r in range(repeat):
                self.layers.append(LMLayer("%s%d" % (name, r), len(self.layers), embed, **kw))
        if position == "rope":
            assert all(ly.d % 2 == 0 for ly in self.layers), "rope needs an even head dimension"

    def norm_shapes(self, prefix):
        sh = {prefix + ".weight": (self.M,)}
        if self.norm == "layernorm":
            sh[prefix + ".bias"] = (self.M,)
        return sh

    def param_shapes(self):
        """Every parameter, the adapters' (lora_A, lora_B, lora_scale) after the base ones."""
        sh = self.base_shapes()
        if self.lora:
            r = self.lora["r"]
            for w, expert, owner in self.lora_weights():
                dims = sh[w]
                lead, (fan_in, fan_out) = dims[:-2], dims[-2:]
                if owner == w:
                    sh[w + ".lora_A"] = lead + (fan_in, r)
                sh[w + ".lora_B"] = lead + (r, fan_out)
                if owner == w:
                    sh[w + ".lora_scale"] = (r,) if self.lora["scale"] == "r" else (fan_out,)
        return sh

    def lora_weights(self):
        """[(W, expert, owner)]: the weights the adapters adapt (frontend/lower.c fe_lora_target,
        fe_expert_linear, shared_expert): q k v o the attention's wq wk wv wo (what a layer
        has of them; on an mla layer q its wq_a and wq_b, or wq, and k and v, which come
        together there, wkv_a and wkv_b), mlp a dense layer's mlp.w1 (w3) w2,
        shared the shared expert's moe.shared.w1 w3 w2, experts the routed experts'
        moe.experts.w1 (w3) w2 [E, in, out] (expert True: one adapter per expert); owner: the
        weight whose lora_A and lora_scale W uses: W, or w1 for the experts' w3 with share_up."""
        if not self.lora:
            return []
        t, base, out = self.lora["targets"], self.base_shapes(), []
        for ly in self.layers:
            n = ly.name
            names = ["%s.attn.w%s" % (n, w) for w in ("q", "q_a", "q_b") if "q" in t]
            names += ["%s.attn.w%s" % (n, w) for w in ("k", "v") if w in t]
            names += ["%s.attn.w%s" % (n, w) for w in ("kv_a", "kv_b") if "k" in t or "v" in t]
            names += ["%s.attn.wo" % n] if "o" in t else []
            names += ["%s.mlp.w%d" % (n, i) for i in (1, 3, 2) if "mlp" in t]
            names += ["%s.moe.shared.w%d" % (n, i) for i in (1, 3, 2) if "shared" in t]
            out += [(w, False, w) for w in names if w in base]
            for i in (1, 3, 2):
                w = "%s.moe.experts.w%d" % (n, i)
                if "experts" in t and w in base:
                    out.append((w, True, w[:-1] + "1" if i == 3 and self.lora["share_up"] else w))
        return out

    def trained(self, name):
        """Whether parameter `name` is trained (has a gradient): with lora only the adapters'
        lora_A and lora_B (frontend/lower.c fe_lora_freeze), else every parameter."""
        return not self.lora or name.endswith((".lora_A", ".lora_B"))

    def base_shapes(self):
        """The parameters of the model without its adapters."""
        V, L, M = self.V, self.L, self.M
        sh = {"embed.wte": (V, M)}
        if self.position == "learned":
            sh["embed.wpe"] = (L, M)
        for ly in self.layers:
            n, at, d = ly.name, ly.attn, ly.d
            sh.update(self.norm_shapes(n + ".attn.norm"))
            sh[n + ".attn.wq"] = (M, at.heads * d)
            sh[n + ".attn.wk"] = (M, at.kv_heads * d)
            sh[n + ".attn.wv"] = (M, at.kv_heads * d)
            sh[n + ".attn.wo"] = (at.heads * (at.mla["v"] if at.mla else d), M)
            if at.bias_qkv:
                sh[n + ".attn.bq"] = (at.heads * d,)
                sh[n + ".attn.bk"] = (at.kv_heads * d,)
                sh[n + ".attn.bv"] = (at.kv_heads * d,)
            if at.mla:
                del sh[n + ".attn.wq"], sh[n + ".attn.wk"], sh[n + ".attn.wv"]
                sh.pop(n + ".attn.bq", None), sh.pop(n + ".attn.bk", None), sh.pop(n + ".attn.bv", None)
                sh.update(mla_shapes(n + ".attn.", at, M))
            if at.bias_o:
                sh[n + ".attn.bo"] = (M,)
            if at.sinks:
                sh[n + ".attn.sinks"] = (at.heads,)
            if at.qk_norm:
                sh[n + ".attn.q_norm.weight"] = (d if at.qk_norm == "head" else at.heads * d,)
                sh[n + ".attn.k_norm.weight"] = (d if at.qk_norm == "head" else at.kv_heads * d,)
            sh.update(self.norm_shapes(n + ".ffn.norm"))
            if ly.moe is not None:
                sh.update(ly.moe.param_shapes())
            else:
                H = ly.mlp.H
                if ly.mlp.ffn == "mixtral":
                    sh.update({n + ".mlp.w1": (M, H), n + ".mlp.w3": (M, H), n + ".mlp.w2": (H, M)})
                else:
                    sh[n + ".mlp.w1"] = (M, H)
                    if ly.mlp.bias:
                        sh[n + ".mlp.b1"] = (H,)
                    sh[n + ".mlp.w2"] = (H, M)
                    if ly.mlp.bias:
                        sh[n + ".mlp.b2"] = (M,)
        sh.update(self.norm_shapes("final_norm"))
        if not self.tie:
            sh["head.w"] = (M, V)
        return sh


# ---------------------------------------------------------------- pieces
def norm_forward(kind, eps, x, w, b):
    if kind == "layernorm":
        mu = x.mean(axis=1, keepdims=True)
        xc = x - mu
        r = 1.0 / np.sqrt((xc * xc).mean(axis=1, keepdims=True) + eps)
        xh = xc * r
        return xh * w + b, (xh, r)
    r = 1.0 / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps)
    xh = x * r
    return xh * w, (xh, r)


def norm_backward(kind, cache, w, dy):
    """Returns dx, dw, db (db None for rmsnorm)."""
    xh, r = cache
    dxh = dy * w
    dw = (dy * xh).sum(axis=0)
    if kind == "layernorm":
        dx = r * (dxh - dxh.mean(axis=1, keepdims=True)
                  - xh * (dxh * xh).mean(axis=1, keepdims=True))
        return dx, dw, dy.sum(axis=0)
    return r * (dxh - xh * (dxh * xh).mean(axis=1, keepdims=True)), dw, None


def yarn_mscale(factor, m):
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def rope_tables(model, L, d):
    """cos, sin [L, d/2]: angle of position i, pair c = i * theta^(-2c/d); with yarn the turn
    blended with its 1/factor over the ramp, cos and sin times the attention factor."""
    c = np.arange(d // 2, dtype=np.float64)
    theta, y = model.theta, model.yarn
    freq, scale = theta ** (-2.0 * c / d), 1.0
    if y:
        def dim(turns):
            return d * math.log(y["original"] / (turns * 2 * math.pi)) / (2 * math.log(theta))
        low, high = dim(y.get("beta_fast", 32.0)), dim(y.get("beta_slow", 1.0))
        if y.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        r = np.clip((c - low) / (high - low), 0, 1)
        freq = freq / y["factor"] * r + freq * (1 - r)
        m, a = y.get("mscale", 0), y.get("mscale_all_dim", 0)
        scale = (yarn_mscale(y["factor"], m) / yarn_mscale(y["factor"], a) if m > 0 and a > 0
                 else yarn_mscale(y["factor"], 1.0))
    ang = np.arange(L, dtype=np.float64)[:, None] * freq[None, :]
    return np.cos(ang) * scale, np.sin(ang) * scale


def scores_scale(model, d):
    """1/sqrt(d), times yarn's mscale(factor, mscale_all_dim)^2 when it has mscale_all_dim."""
    y = model.yarn
    f = yarn_mscale(y["factor"], y["mscale_all_dim"]) ** 2 if y and y.get("mscale_all_dim", 0) > 0 else 1.0
    return f / math.sqrt(d)


def rope_apply(a, cos, sin, inverse=False, interleave=False):
    """a [..., L, d]: each pair (u, w) -> (u cos - w sin, w cos + u sin), the pairs the halves
    (c, c + d/2) or, interleaved, (2c, 2c + 1); inverse (the transpose, for the backward):
    (u cos + w sin, w cos - u sin)."""
    if inverse:
        sin = -sin
    if interleave:
        u, w = a[..., 0::2], a[..., 1::2]
        out = np.empty_like(a)
        out[..., 0::2], out[..., 1::2] = u * cos - w * sin, w * cos + u * sin
        return out
    h = a.shape[-1] // 2
    u, w = a[..., :h], a[..., h:]
    return np.concatenate([u * cos - w * sin, w * cos + u * sin], axis=-1)


def mla_shapes(pre, at, M):
    m, H = at.mla, at.heads
    dq, K = m["nope"] + m["rope"], m["kv_lora"]
    sh = {}
    if m.get("q_lora"):
        sh[pre + "wq_a"] = (M, m["q_lora"])
        if at.bias_qkv:
            sh[pre + "bq_a"] = (m["q_lora"],)
        sh[pre + "q_a_norm.weight"] = (m["q_lora"],)
        sh[pre + "wq_b"] = (m["q_lora"], H * dq)
    else:
        sh[pre + "wq"] = (M, H * dq)
    sh[pre + "wkv_a"] = (M, K + m["rope"])
    if at.bias_qkv:
        sh[pre + "bkv_a"] = (K + m["rope"],)
    sh[pre + "kv_a_norm.weight"] = (K,)
    sh[pre + "wkv_b"] = (K, H * (m["nope"] + m["v"]))
    return sh


def softmax_rows(at, s, p, L):
    """The masked rows' softmax of scores s [B, H, L, L] (with the sinks p["sinks"] [H] in each
    denominator): probabilities and the sinks' share (None without)."""
    H = s.shape[1]
    s = np.where(window_mask(L, at.window), s, -np.inf)
    sink = p["sinks"].reshape(1, H, 1, 1) if at.sinks else None
    mx = s.max(axis=-1, keepdims=True)
    if at.sinks:   # the sink: a logit in the denominator, no value
        mx = np.maximum(mx, sink)
    e = np.exp(s - mx)
    den = e.sum(axis=-1, keepdims=True) + (np.exp(sink - mx) if at.sinks else 0)
    return e / den, (np.exp(sink - mx) / den if at.sinks else None)


def mla_forward(model, ly, p, x):
    """Multi-head latent attention (manual §7.2 `mla`): q (through q_lora's bottleneck and its
    RMSNorm), the latent c and the shared rope key from x·Wkv_a, kv = rms(c)·Wkv_b [k_nope | v]
    per head; heads [q_nope | q_rope]; scores (q_nope·k_nope + rope(q_rope)·rope(kr)) * scale."""
    B, L = model.B, model.L
    at, m, H = ly.attn, ly.attn.mla, ly.attn.heads
    dn, dr, dv, K = m["nope"], m["rope"], m["v"], m["kv_lora"]
    c = dict(x=x)
    if m.get("q_lora"):
        qa = x @ p["wq_a"] + (p["bq_a"] if at.bias_qkv else 0)
        c["qan"], c["qa_cache"] = norm_forward("rmsnorm", model.eps, qa, p["q_a_norm.weight"], None)
        q = c["qan"] @ p["wq_b"]
    else:
        q = x @ p["wq"]
    ckv = x @ p["wkv_a"] + (p["bkv_a"] if at.bias_qkv else 0)
    c["cn"], c["c_cache"] = norm_forward("rmsnorm", model.eps, ckv[:, :K], p["kv_a_norm.weight"], None)
    kv4 = (c["cn"] @ p["wkv_b"]).reshape(B, L, H, dn + dv).transpose(0, 2, 1, 3)
    q4 = q.reshape(B, L, H, dn + dr).transpose(0, 2, 1, 3)
    kr = ckv[:, K:].reshape(B, L, 1, dr).transpose(0, 2, 1, 3)           # [B, 1, L, dr]
    rope = tuple(t.astype(x.dtype) for t in rope_tables(model, L, dr))
    qr = rope_apply(q4[..., dn:], *rope, interleave=model.interleave)
    krr = rope_apply(kr, *rope, interleave=model.interleave)
    qn, kn, v4 = q4[..., :dn], kv4[..., :dn], kv4[..., dn:]
    scale = scores_scale(model, dn + dr)
    s = (qn @ kn.transpose(0, 1, 3, 2) + qr @ krr.transpose(0, 1, 3, 2)) * scale
    pr, psink = softmax_rows(at, s, p, L)
    o = (pr @ v4).transpose(0, 2, 1, 3).reshape(B * L, H * dv)
    y = o @ p["wo"] + (p["bo"] if at.bias_o else 0)
    c.update(qn=qn, kn=kn, v4=v4, qr=qr, krr=krr, pr=pr, psink=psink, o=o, rope=rope, scale=scale)
    return y, c


def mla_backward(model, ly, p, c, dy):
    B, L = model.B, model.L
    at, m, H = ly.attn, ly.attn.mla, ly.attn.heads
    dn, dr, dv, K = m["nope"], m["rope"], m["v"], m["kv_lora"]
    S, x = B * L, c["x"]
    gr = {"wo": c["o"].T @ dy}
    if at.bias_o:
        gr["bo"] = dy.sum(axis=0)
    do4 = (dy @ p["wo"].T).reshape(B, L, H, dv).transpose(0, 2, 1, 3)
    pr = c["pr"]
    dpr = do4 @ c["v4"].transpose(0, 1, 3, 2)
    dv4 = pr.transpose(0, 1, 3, 2) @ do4
    D = (dpr * pr).sum(axis=-1, keepdims=True)
    ds = pr * (dpr - D) * c["scale"]
    if at.sinks:
        gr["sinks"] = -(c["psink"] * D).sum(axis=(0, 2, 3))
    dqn, dkn = ds @ c["kn"], ds.transpose(0, 1, 3, 2) @ c["qn"]
    dqr = rope_apply(ds @ c["krr"], *c["rope"], inverse=True, interleave=model.interleave)
    dkr = rope_apply((ds.transpose(0, 1, 3, 2) @ c["qr"]).sum(axis=1, keepdims=True), *c["rope"],
                     inverse=True, interleave=model.interleave)
    dq = np.concatenate([dqn, dqr], axis=-1).transpose(0, 2, 1, 3).reshape(S, H * (dn + dr))
    dkv = np.concatenate([dkn, dv4], axis=-1).transpose(0, 2, 1, 3).reshape(S, H * (dn + dv))
    gr["wkv_b"] = c["cn"].T @ dkv
    dc, gr["kv_a_norm.weight"], _ = norm_backward("rmsnorm", c["c_cache"], p["kv_a_norm.weight"],
                                                  dkv @ p["wkv_b"].T)
    dckv = np.concatenate([dc, dkr.transpose(0, 2, 1, 3).reshape(S, dr)], axis=1)
    gr["wkv_a"] = x.T @ dckv
    if at.bias_qkv:
        gr["bkv_a"] = dckv.sum(axis=0)
    dx = dckv @ p["wkv_a"].T
    if m.get("q_lora"):
        gr["wq_b"] = c["qan"].T @ dq
        dqa, gr["q_a_norm.weight"], _ = norm_backward("rmsnorm", c["qa_cache"], p["q_a_norm.weight"],
                                                      dq @ p["wq_b"].T)
        gr["wq_a"] = x.T @ dqa
        if at.bias_qkv:
            gr["bq_a"] = dqa.sum(axis=0)
        dx = dx + dqa @ p["wq_a"].T
    else:
        gr["wq"] = x.T @ dq
        dx = dx + dq @ p["wq"].T
    return dx, gr


def qk_norm_forward(model, ly, x, w, heads):
    """`qk_norm` of q (heads H) or k (KV): x [S, heads*d] -> (y, cache)."""
    S, d = x.shape[0], ly.d
    rows = x.reshape(S * heads, d) if ly.attn.qk_norm == "head" else x
    y, cache = norm_forward("rmsnorm", model.eps, rows, w, None)
    return y.reshape(S, heads * d), cache


def qk_norm_backward(ly, cache, w, dy):
    """-> dx [S, heads*d], dw."""
    S, n = dy.shape
    rows = dy.reshape(-1, ly.d) if ly.attn.qk_norm == "head" else dy
    dx, dw, _ = norm_backward("rmsnorm", cache, w, rows)
    return dx.reshape(S, n), dw


def window_mask(L, window):
    """[L, L] bool: query i sees key j iff j <= i (and i - window < j)."""
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    return (j <= i) & ((i - j < window) if window else True)


def attn_forward(model, ly, p, x):
    """x [S, M] (normed); p: short names wq, wk, wv, wo, bq, bk, bv, bo."""
    if ly.attn.mla:
        return mla_forward(model, ly, p, x)
    B, L = model.B, model.L
    at, d = ly.attn, ly.d
    H, KV = at.heads, at.kv_heads
    g = H // KV
    q = x @ p["wq"]
    k = x @ p["wk"]
    v = x @ p["wv"]
    if at.bias_qkv:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    qn = kn = None
    if at.qk_norm:
        q, qn = qk_norm_forward(model, ly, q, p["q_norm.weight"], H)
        k, kn = qk_norm_forward(model, ly, k, p["k_norm.weight"], KV)
    q4 = q.reshape(B, L, H, d).transpose(0, 2, 1, 3)          # [B, H, L, d]
    k4 = k.reshape(B, L, KV, d).transpose(0, 2, 1, 3)         # [B, KV, L, d]
    v4 = v.reshape(B, L, KV, d).transpose(0, 2, 1, 3)
    rope = None
    if model.position == "rope":
        rope = tuple(t.astype(x.dtype) for t in rope_tables(model, L, d))
        q4 = rope_apply(q4, *rope, interleave=model.interleave)
        k4 = rope_apply(k4, *rope, interleave=model.interleave)
    kh = np.repeat(k4, g, axis=1)                             # head h reads kv head h // g
    vh = np.repeat(v4, g, axis=1)
    s = q4 @ kh.transpose(0, 1, 3, 2) * scores_scale(model, d)  # [B, H, L, L]
    pr, psink = softmax_rows(at, s, p, L)
    o4 = pr @ vh                                              # [B, H, L, d]
    o = o4.transpose(0, 2, 1, 3).reshape(B * L, H * d)
    y = o @ p["wo"]
    if at.bias_o:
        y = y + p["bo"]
    return y, dict(x=x, q4=q4, kh=kh, vh=vh, pr=pr, psink=psink, o=o, rope=rope, qn=qn, kn=kn)


def attn_backward(model, ly, p, c, dy):
    if ly.attn.mla:
        return mla_backward(model, ly, p, c, dy)
    B, L = model.B, model.L
    at, d = ly.attn, ly.d
    H, KV = at.heads, at.kv_heads
    g = H // KV
    x = c["x"]
    gr = {"wo": c["o"].T @ dy}
    if at.bias_o:
        gr["bo"] = dy.sum(axis=0)
    do4 = (dy @ p["wo"].T).reshape(B, L, H, d).transpose(0, 2, 1, 3)
    pr = c["pr"]
    dpr = do4 @ c["vh"].transpose(0, 1, 3, 2)
    dvh = pr.transpose(0, 1, 3, 2) @ do4
    D = (dpr * pr).sum(axis=-1, keepdims=True)
    ds = pr * (dpr - D) * scores_scale(model, d)
    if at.sinks:   # d sink = sum over rows of p_sink (0 - D)
        gr["sinks"] = -(c["psink"] * D).sum(axis=(0, 2, 3))
    dq4 = ds @ c["kh"]
    dkh = ds.transpose(0, 1, 3, 2) @ c["q4"]
    dk4 = dkh.reshape(B, KV, g, L, d).sum(axis=2)
    dv4 = dvh.reshape(B, KV, g, L, d).sum(axis=2)
    if c["rope"] is not None:
        dq4 = rope_apply(dq4, *c["rope"], inverse=True, interleave=model.interleave)
        dk4 = rope_apply(dk4, *c["rope"], inverse=True, interleave=model.interleave)
    dq = dq4.transpose(0, 2, 1, 3).reshape(B * L, H * d)
    dk = dk4.transpose(0, 2, 1, 3).reshape(B * L, KV * d)
    dv = dv4.transpose(0, 2, 1, 3).reshape(B * L, KV * d)
    if at.qk_norm:
        dq, gr["q_norm.weight"] = qk_norm_backward(ly, c["qn"], p["q_norm.weight"], dq)
        dk, gr["k_norm.weight"] = qk_norm_backward(ly, c["kn"], p["k_norm.weight"], dk)
    gr["wq"], gr["wk"], gr["wv"] = x.T @ dq, x.T @ dk, x.T @ dv
    if at.bias_qkv:
        gr["bq"], gr["bk"], gr["bv"] = dq.sum(axis=0), dk.sum(axis=0), dv.sum(axis=0)
    dx = dq @ p["wq"].T + dk @ p["wk"].T + dv @ p["wv"].T
    return dx, gr


def mlp_params(ly, p):
    """The mlp's [in, out] weights as moe_ref's one-expert tensors."""
    return {"experts." + k: v[None] for k, v in p.items()}


def mlp_forward(ly, p, x):
    y, ec = moe_ref.expert_forward(ly.mlp, mlp_params(ly, p), x[None])
    return y[0], ec


def mlp_backward(ly, p, x, ec, dy):
    dx, gr = moe_ref.expert_backward(ly.mlp, mlp_params(ly, p), x[None], ec, dy[None])
    return dx[0], {k[len("experts."):]: v[0] for k, v in gr.items()}


def cross_entropy(logits, tgt):
    m = logits.max(axis=1, keepdims=True)
    e = np.exp(logits - m)
    lse = m[:, 0] + np.log(e.sum(axis=1))
    s = logits.shape[0]
    ce = float(np.mean(lse - logits[np.arange(s), tgt]))
    dlogits = e / e.sum(axis=1, keepdims=True)
    dlogits[np.arange(s), tgt] -= 1.0
    return ce, dlogits / s


def sub(params, prefix, dtype=np.float64):
    return {n[len(prefix):]: np.asarray(v, dtype=dtype) for n, v in params.items()
            if n.startswith(prefix)}


# ---------------------------------------------------------------- the model
def forward(model, params, tokens, want_grads=True, training=True, z_noisy=True,
            dtype=np.float64):
    """tokens [B, L+1] int; params: name -> array (any float dtype; computed in float64).
    dtype float32 computes everything but the MoE layers (moe_ref: float64) in float32: an
    estimate of the rounding a float32 binary sees, not a reference.
    Returns dict(loss, ce, aux, z (unweighted sums over MoE layers), logits [B, L, V],
    grads {name: array} (want_grads; the trained parameters only: with lora lora_A, lora_B), routing [per MoE layer], stats [per MoE layer],
    margin (moe_ref.cache_margin over the MoE layers: distance of the routing from a tie),
    caches [per layer: dict])."""
    B, L, M, V = model.B, model.L, model.M, model.V
    tokens = np.asarray(tokens).astype(np.int64)
    assert tokens.shape == (B, L + 1), tokens.shape
    assert tokens.min() >= 0 and tokens.max() < V
    S = B * L
    inp = tokens[:, :L].reshape(S)
    tgt = tokens[:, 1:].reshape(S)
    P = {n: np.asarray(v, dtype=dtype) for n, v in params.items()}
    ln = model.norm == "layernorm"
    # LoRA: x.W (+ b) + ((x.A) * s).B = x.(W + (A * s).B) (+ b) for every row x (per expert: W_e,
    # A_e, B_e; s the frozen lora_scale [r], alpha/r, column-wise; with scale "out": x.W +
    # ((x.A).B) * s = x.(W + A.(B * s)), s [out]), so each adapted weight takes part as its merged
    # W + (A * s_r).(B * s_out), the other factor 1; the base weight itself stays as written
    adapted = model.lora_weights()

    def lora_factors(w, owner):
        sc = P[owner + ".lora_scale"]
        a, b = P[owner + ".lora_A"], P[w + ".lora_B"]
        return (a * sc, b, sc, 1.0) if model.lora["scale"] == "r" else (a, b * sc, 1.0, sc)

    for w, _, owner in adapted:
        a_s, b_s, _, _ = lora_factors(w, owner)
        P[w] = P[w] + a_s @ b_s

    def norm(prefix, x):
        return norm_forward(model.norm, model.eps, x, P[prefix + ".weight"],
                            P[prefix + ".bias"] if ln else None)

    h = P["embed.wte"][inp]
    if model.position == "learned":
        h = h + np.tile(P["embed.wpe"], (B, 1))
    caches, stats, routing, pooled = [], [], [], []
    extra, margin, aux_sum = 0.0, math.inf, 0.0
    for ly in model.layers:
        n = ly.name
        c = dict(h=h)
        c["xa"], c["na"] = norm(n + ".attn.norm", h)
        pa = sub(P, n + ".attn.", dtype)
        ya, c["attn"] = attn_forward(model, ly, pa, c["xa"])
        a = h + ya
        c["xf"], c["nf"] = norm(n + ".ffn.norm", a)
        if ly.moe is not None:
            pm = sub(P, n + ".moe.")
            normals = (moe_ref.gate_noise_normals(model.seed, NOISE_STEP, ly.index, 0, S, ly.moe.E)
                       if (training and ly.moe.noise) else None)
            yf, c["moe"], st = moe_ref.layer_forward(ly.moe, pm, c["xf"].astype(np.float64),
                                                     normals, z_noisy=z_noisy, residual=False)
            yf = yf.astype(dtype)
            stats.append(st)
            routing.append(c["moe"]["routing"])
            if ly.moe.aux_form == "pooled":
                pooled.append((ly.moe, c["moe"]))
                extra += ly.moe.z_coef * st["z"]
            else:
                extra += ly.moe.aux_coef * st["aux"] + ly.moe.z_coef * st["z"]
                aux_sum += st["aux"]
            margin = min(margin, moe_ref.cache_margin(ly.moe, c["moe"]))
        else:
            yf, c["mlp"] = mlp_forward(ly, sub(P, n + ".mlp.", dtype), c["xf"])
        h = a + yf
        caches.append(c)
    if pooled:
        En = pooled[0][0].E
        psum, count, N = np.zeros(En), np.zeros(En), 0
        for mly, mc in pooled:
            psum += mc["scores"].sum(axis=0)
            count += np.bincount(mc["idx"].ravel(), minlength=En)
            N += mc["scores"].shape[0]
        aux_pooled = En * float(np.dot(count / N, psum / N))
        for mly, mc in pooled:
            mc["pooled_fn"] = count / N / N
        extra += pooled[0][0].aux_coef * aux_pooled
        aux_sum += aux_pooled
    hf, nfin = norm("final_norm", h)
    W = P["embed.wte"].T if model.tie else P["head.w"]
    logits = hf @ W
    ce, dlogits = cross_entropy(logits, tgt)
    res = dict(loss=ce + extra, ce=ce, aux=aux_sum,
               z=sum(st["z"] for st in stats), logits=logits.reshape(B, L, V), stats=stats,
               routing=routing, margin=margin, caches=caches)
    if not want_grads:
        return res

    # ---- backward
    G = {}

    def norm_back(prefix, cache, dy):
        dx, dw, db = norm_backward(model.norm, cache, P[prefix + ".weight"], dy)
        G[prefix + ".weight"] = dw
        if ln:
            G[prefix + ".bias"] = db
        return dx

    dwte = np.zeros_like(P["embed.wte"])
    if model.tie:
        dwte += dlogits.T @ hf
    else:
        G["head.w"] = hf.T @ dlogits
    dh = norm_back("final_norm", nfin, dlogits @ W.T)
    for ly, c in zip(reversed(model.layers), reversed(caches)):
        n = ly.name
        if ly.moe is not None:      # adds the aux and z terms' gradients itself
            dxf, gr = moe_ref.layer_backward(ly.moe, sub(P, n + ".moe."), c["moe"],
                                             dh.astype(np.float64), residual=False)
            dxf = dxf.astype(dtype)
            pre = n + ".moe."
        else:
            dxf, gr = mlp_backward(ly, sub(P, n + ".mlp.", dtype), c["xf"], c["mlp"], dh)
            pre = n + ".mlp."
        G.update({pre + k: v for k, v in gr.items()})
        da = dh + norm_back(n + ".ffn.norm", c["nf"], dxf)
        dxa, gr = attn_backward(model, ly, sub(P, n + ".attn.", dtype), c["attn"], da)
        G.update({n + ".attn." + k: v for k, v in gr.items()})
        dh = da + norm_back(n + ".attn.norm", c["na"], dxa)
    np.add.at(dwte, inp, dh)
    G["embed.wte"] = dwte
    if model.position == "learned":
        G["embed.wpe"] = dh.reshape(B, L, M).sum(axis=0)
    assert set(G) == set(model.base_shapes()), set(G) ^ set(model.base_shapes())
    # the adapters from the merged weight's gradient dW = d loss / d(W + (A*s_r).(B*s_out)):
    # dA = (dW.(B*s_out)^T) * s_r, dB = ((A*s_r)^T.dW) * s_out (per expert for [E, ...] tensors);
    # a shared A (the experts' w1 and w3) sums both weights' terms
    for w, _, owner in adapted:
        a_s, b_s, s_r, s_out = lora_factors(w, owner)
        G[owner + ".lora_A"] = G.get(owner + ".lora_A", 0.0) + (G[w] @ np.swapaxes(b_s, -1, -2)) * s_r
        G[w + ".lora_B"] = (np.swapaxes(a_s, -1, -2) @ G[w]) * s_out
    # frozen parameters (every one but lora_A and lora_B under lora) have no gradient
    G = {n: g for n, g in G.items() if model.trained(n)}
    want = {n for n in model.param_shapes() if model.trained(n)}
    assert set(G) == want, set(G) ^ want
    res["grads"] = G
    return res


def lora_init(model, name, shape):
    """The binary's initial value (float32) of adapter tensor `name` (runtime/shard.c
    rt_shard_init, frontend/lower.c lora_params): lora_A uniform within +-std, std =
    (float)(1/sqrt(in)) (in: the adapted weight's input width, shape[-2]), element i (global
    row-major index) (float)(std * (2 rt_uniform(rt_key(k, i)) - 1)) with k =
    rt_key(rt_key(seed, RT_STREAM_INIT), rt_hash_name(name)); lora_B zeros; lora_scale
    (float)(alpha / r)."""
    if name.endswith(".lora_B"):
        return np.zeros(shape, dtype=np.float32)
    if name.endswith(".lora_scale"):
        return np.full(shape, np.float32(model.lora["alpha"] / model.lora["r"]), dtype=np.float32)
    assert name.endswith(".lora_A"), name
    std = float(np.float32(1.0 / math.sqrt(shape[-2])))
    key = moe_ref.rt_key(moe_ref.rt_key(model.seed, moe_ref.RT_STREAM_INIT), moe_ref.rt_hash_name(name))
    i = np.arange(int(np.prod(shape)), dtype=np.uint64)
    h = moe_ref._mix_np(np.uint64(key) ^ moe_ref._mix_np(i))                     # rt_key(key, i)
    u = ((h >> np.uint64(40)).astype(np.float64) + 0.5) / 16777216.0          # rt_uniform
    return (std * (2.0 * u - 1.0)).astype(np.float32).reshape(shape)


def random_params(model, rng, scale=0.5):
    """Random weights for tests: norm weights around 1, everything else N(0, scale^2)
    (xmoe's temperature positive; lora_scale alpha/r; lora_A and lora_B both random, so that
    every adapter has a gradient)."""
    out = {}
    for n, sh in model.param_shapes().items():
        if n.endswith(".lora_scale"):
            out[n] = np.full(sh, model.lora["alpha"] / model.lora["r"])
        elif n.endswith("norm.weight"):
            out[n] = 1.0 + 0.3 * rng.standard_normal(sh)
        elif n.endswith("gate.temperature"):
            out[n] = np.asarray(0.3 + 0.5 * rng.random())
        else:
            out[n] = scale * rng.standard_normal(sh)
    return out


def random_tokens(model, rng):
    return rng.integers(0, model.V, (model.B, model.L + 1)).astype(np.int32)


# ---------------------------------------------------------------- self-test
def naive_attention(model, ly, p, x):
    """The attention of lang/manual.md §7.2 with explicit loops (rope by its angle formula, GQA by the
    head mapping, the qk norm per row or per head slice, the window by its inequality): an
    independent check of the vectorised forward."""
    B, L = model.B, model.L
    at, d = ly.attn, ly.d
    q = x @ p["wq"] + (p["bq"] if at.bias_qkv else 0)
    k = x @ p["wk"] + (p["bk"] if at.bias_qkv else 0)
    v = x @ p["wv"] + (p["bv"] if at.bias_qkv else 0)

    def rms(a, w):  # a [S, n] normalised per row (whole) or per d-wide slice (head)
        out = a.copy()
        width = d if at.qk_norm == "head" else a.shape[1]
        for s_ in range(a.shape[0]):
            for c0 in range(0, a.shape[1], width):
                seg = a[s_, c0:c0 + width]
                out[s_, c0:c0 + width] = seg / math.sqrt(float(seg @ seg) / width + model.eps) * w
        return out

    if at.qk_norm:
        q, k = rms(q, p["q_norm.weight"]), rms(k, p["k_norm.weight"])
    first = (lambda i: max(0, i - at.window + 1)) if at.window else (lambda i: 0)

    def rot(vec, i):
        if model.position != "rope":
            return vec
        out = vec.copy()
        for c in range(d // 2):
            ang = i * model.theta ** (-2.0 * c / d)
            u, w = vec[c], vec[c + d // 2]
            out[c] = u * math.cos(ang) - w * math.sin(ang)
            out[c + d // 2] = w * math.cos(ang) + u * math.sin(ang)
        return out

    o = np.zeros((B * L, at.heads * d))
    for b in range(B):
        for hh in range(at.heads):
            j = hh // (at.heads // at.kv_heads)
            for i in range(L):
                qi = rot(q[b * L + i, hh * d:(hh + 1) * d], i)
                keys = range(first(i), i + 1)
                sc = [float(qi @ rot(k[b * L + t, j * d:(j + 1) * d], t)) / math.sqrt(d)
                      for t in keys]
                sk = [float(p["sinks"][hh])] if at.sinks else []
                mx = max(sc + sk)
                w = [math.exp(s - mx) for s in sc]
                tot = sum(w) + sum(math.exp(s - mx) for s in sk)
                for wt, t in zip(w, keys):
                    o[b * L + i, hh * d:(hh + 1) * d] += wt / tot * v[b * L + t, j * d:(j + 1) * d]
    return o @ p["wo"] + (p["bo"] if at.bias_o else 0)


def fd_check(model, params, tokens, eps=1e-6, rtol=1e-6, floor=1e-3, grads=None, names=None):
    """Central differences of the loss vs the analytic gradients (`grads`, default the
    backward's) of the tensors `names` (default all the trained ones). Per tensor: err = max|fd - an| / max(max|an|, floor) over the entries whose
    ±eps leaves every routing decision as it was. Returns (rows, worst, skipped, failed)."""
    base = forward(model, params, tokens)
    grads = grads or base["grads"]
    rows, worst, skipped, failed = [], 0.0, 0, []
    for name in sorted(n for n in params if model.trained(n)) if names is None else names:
        arr, an = params[name], grads[name]
        fd = np.zeros_like(arr)
        mask = np.ones(arr.shape, dtype=bool)
        for i in np.ndindex(arr.shape):
            old = arr[i]
            vals = []
            for delta in (eps, -eps):
                arr[i] = old + delta
                r = forward(model, params, tokens, want_grads=False)
                vals.append((r["loss"], moe_ref.same_routing(r["routing"], base["routing"])))
            arr[i] = old
            if not (vals[0][1] and vals[1][1]):
                mask[i] = False
                skipped += 1
                continue
            fd[i] = (vals[0][0] - vals[1][0]) / (2 * eps)
        scale = float(np.abs(an).max())
        err = float(np.abs(np.where(mask, fd - an, 0.0)).max()) / max(scale, floor)
        worst = max(worst, err)
        rows.append((name, arr.size, scale, err))
        if err > rtol:
            failed.append(name)
    return base, rows, worst, skipped, failed


SELFTEST_CASES = [
    # GPT-2 style: layernorm, learned positions, attention biases, gshard k 2 with drops,
    # noise, aux and z, tied embeddings; a dense mlp layer after two MoE layers
    ("gpt: layernorm learned bias gshard k2 drops tied",
     dict(vocab=11, batch=2, seqlen=5, embed=8, position="learned", norm="layernorm",
          tie_embeddings=True, seed=7),
     [("block", 2, dict(attention=dict(heads=2),
                        moe=dict(experts=4, hidden=6, k=2, capacity=0.5, noise=1.0,
                                 aux_loss=0.1, z_loss=0.01)))], "drops"),
    # Llama/Mixtral style: rmsnorm, rope, GQA 4/2, no attention bias, mixtral experts, k 1,
    # untied head
    ("llama: rmsnorm rope gqa4/2 nobias mixtral k1 untied",
     dict(vocab=13, batch=2, seqlen=4, embed=8, position="rope", theta=10.0, norm="rmsnorm",
          eps=1e-5, tie_embeddings=False, seed=3),
     [("block", 2, dict(attention=dict(heads=4, kv_heads=2, bias=False),
                        moe=dict(experts=4, hidden=6, k=1, capacity=1.0, ffn="mixtral",
                                 noise=0.5, aux_loss=0.05, z_loss=0.02)))], None),
    # dense mlp layers (gpt with bias, then mixtral) around an MoE layer with groups 2 and
    # noise (its noise is that of global layer 1: the dense layer counts); layernorm eps 1e-3
    ("dense: mlp gpt + moe g2 + mlp mixtral, rope gqa 2/1",
     dict(vocab=9, batch=2, seqlen=4, embed=8, position="rope", theta=100.0, norm="layernorm",
          eps=1e-3, tie_embeddings=False, seed=11),
     [("dense", 1, dict(attention=dict(heads=2, kv_heads=1),
                        mlp=dict(ffn="gpt", hidden=6, act="gelu", bias=True))),
      ("moe", 1, dict(attention=dict(heads=2),
                      moe=dict(experts=4, hidden=5, k=2, capacity=1.0, groups=2, noise=1.0,
                               aux_loss=0.05, z_loss=0.01, act="gelu", bias=False))),
      ("tail", 1, dict(attention=dict(heads=1, bias=False),
                       mlp=dict(ffn="mixtral", hidden=6)))], None),
    # the Hugging Face families (lang/manual.md §19): Qwen2-MoE's q/k/v biases without an o bias and
    # the raw softmax scores as gates (renormalize false), Qwen3-MoE's head_dim apart from
    # embed/heads (6 and 10 here, embed 8), Mixtral's top-1 renormalised to a gate of 1
    ("qwen: rope head_dim 6 gqa 4/2 bias qkv, k2 not renormalised; head_dim 10 k1 renormalised",
     dict(vocab=10, batch=2, seqlen=4, embed=8, position="rope", theta=100.0, norm="rmsnorm",
          eps=1e-6, tie_embeddings=False, seed=13),
     [("qw", 1, dict(attention=dict(heads=4, kv_heads=2, bias="qkv", head_dim=6),
                     moe=dict(experts=4, hidden=5, k=2, capacity=0.75, ffn="mixtral",
                              renormalize=False, noise=1.0, aux_loss=0.05, z_loss=0.01))),
      ("mx", 1, dict(attention=dict(heads=2, kv_heads=1, bias="qkv", head_dim=10),
                     moe=dict(experts=4, hidden=5, k=1, capacity=1.0, ffn="mixtral",
                              renormalize=True, aux_loss=0.05, z_loss=0.01)))], "drops"),
    # Qwen2-MoE's shared expert: every token's SwiGLU output times sigmoid(x.wsg) added to the
    # routed output (its parameters moe.shared.w1, w3, w2, gate), and DeepSeek's ungated one
    ("qwen2 shared: gated shared expert beside k2 not renormalised; ungated beside k1",
     dict(vocab=9, batch=2, seqlen=4, embed=8, position="rope", theta=100.0, norm="rmsnorm",
          eps=1e-6, tie_embeddings=False, seed=19),
     [("sh", 1, dict(attention=dict(heads=2, bias="qkv"),
                     moe=dict(experts=4, hidden=5, k=2, capacity=0.75, ffn="mixtral",
                              renormalize=False, shared_hidden=6, shared_gate=True, noise=1.0,
                              aux_loss=0.05, z_loss=0.01))),
      ("ds", 1, dict(attention=dict(heads=2, bias=False),
                     moe=dict(experts=4, hidden=5, k=1, capacity=1.0, ffn="mixtral",
                              shared_hidden=3, aux_loss=0.05)))], "drops"),
    # Qwen3-MoE's per-head RMSNorm of q and k (one weight [d] for all heads) under a sliding
    # window of 3 (Mixtral's sliding_window), GQA 4/2 of head_dim 6; OLMoE's norm over the whole
    # width of q and k (weights [H*d], [KV*d]) with a window of 2
    ("qwen3/olmoe: qk_norm head + window 3; qk_norm whole + window 2",
     dict(vocab=9, batch=2, seqlen=5, embed=8, position="rope", theta=100.0, norm="rmsnorm",
          eps=1e-6, tie_embeddings=False, seed=23),
     [("qw", 1, dict(attention=dict(heads=4, kv_heads=2, head_dim=6, bias=False, qk_norm="head",
                                    window=3),
                     moe=dict(experts=4, hidden=5, k=2, capacity=1.0, ffn="mixtral",
                              renormalize=True, aux_loss=0.05, z_loss=0.01))),
      ("ol", 1, dict(attention=dict(heads=2, bias="qkv", qk_norm="whole", window=2),
                     moe=dict(experts=4, hidden=5, k=2, capacity=1.0, ffn="mixtral",
                              renormalize=False, aux_loss=0.05)))], None),
    # learned positions with qk_norm whole and a window of 2 (bk then has a real gradient: the
    # norm is not shift-invariant), then a window of 1 (each query sees only itself: k has no
    # gradient at all), layernorm
    ("gpt: qk_norm whole + window 2, window 1, learned positions",
     dict(vocab=9, batch=2, seqlen=4, embed=8, position="learned", norm="layernorm", eps=1e-5,
          tie_embeddings=True, seed=29),
     [("block", 1, dict(attention=dict(heads=2, qk_norm="whole", window=2),
                        mlp=dict(ffn="gpt", hidden=6, act="gelu", bias=True))),
      ("one", 1, dict(attention=dict(heads=2, window=1),
                      mlp=dict(ffn="mixtral", hidden=6)))], None),
    # gpt-oss's attention sinks under a window of 2 and over the whole sequence, GQA 4/2
    ("gpt-oss: sinks + window 2, sinks over the whole sequence",
     dict(vocab=9, batch=2, seqlen=5, embed=8, position="rope", theta=100.0, norm="rmsnorm",
          eps=1e-5, tie_embeddings=False, seed=31),
     [("sw", 1, dict(attention=dict(heads=4, kv_heads=2, head_dim=4, bias=True, window=2, sinks=True),
                     moe=dict(experts=4, hidden=5, k=2, capacity=1.0, ffn="mixtral",
                              renormalize=True, aux_loss=0.05))),
      ("fa", 1, dict(attention=dict(heads=2, bias=True, sinks=True),
                     mlp=dict(ffn="mixtral", hidden=6)))], None),
    # DeepSeek's multi-head latent attention with q LoRA (and biases on the down projections and
    # o), then without (and a window of 3), v narrower than the heads, rope on adjacent pairs,
    # yarn with both mscales (the scores scaled by mscale_all_dim's) and untruncated
    ("deepseek: mla with q_lora + yarn + interleave; mla without q_lora, window 3",
     dict(vocab=9, batch=2, seqlen=5, embed=8, position="rope", theta=100.0, norm="rmsnorm",
          eps=1e-6, tie_embeddings=False, seed=37, interleave=True,
          yarn=dict(factor=4.0, original=2, beta_fast=32.0, beta_slow=1.0, mscale=0.8,
                    mscale_all_dim=0.6, truncate=False)),
     [("ql", 1, dict(attention=dict(heads=2, bias=True, mla=dict(q_lora=5, kv_lora=4, nope=2, rope=4, v=3)),
                     moe=dict(experts=4, hidden=5, k=2, capacity=1.0, ffn="mixtral",
                              renormalize=True, aux_loss=0.05))),
      ("kv", 1, dict(attention=dict(heads=2, bias=False, window=3,
                                    mla=dict(q_lora=0, kv_lora=3, nope=4, rope=2, v=2)),
                     mlp=dict(ffn="mixtral", hidden=6)))], None),
    # transformers' load-balancing loss (aux "pooled"): one loss over a k 2 and a k 1 layer
    # (drops counted: F counts every top-k choice), the gradient coef E F_e/N into both
    ("pooled: aux pooled over k2 (drops) and k1 layers, rope rmsnorm",
     dict(vocab=11, batch=2, seqlen=5, embed=8, position="rope", theta=100.0, norm="rmsnorm",
          eps=1e-5, tie_embeddings=False, seed=29),
     [("p2", 1, dict(attention=dict(heads=2, bias=False),
                     moe=dict(experts=4, hidden=6, k=2, capacity=0.5, ffn="mixtral", noise=1.0,
                              aux_loss=0.3, aux="pooled", z_loss=0.01))),
      ("p1", 1, dict(attention=dict(heads=2, bias=False),
                     moe=dict(experts=4, hidden=6, k=1, capacity=1.0, ffn="mixtral",
                              renormalize=True, aux_loss=0.3, aux="pooled")))], "drops"),
    # LoRA (issue 63; frontend/lower.c): only the adapters lora_A, lora_B are trained (the
    # finite differences run over them alone), B random (non-zero) so that A has a gradient.
    # GPT-style with q k v o mlp: the attention's four projections (with their biases: the
    # adapter adds after the bias), a gpt mlp with biases and a mixtral mlp (w1 w3 w2); the MoE
    # layer's experts are not adapted (frozen with the rest)
    ("lora gpt: q k v o mlp, learned layernorm tied, moe + gpt mlp + mixtral mlp",
     dict(vocab=9, batch=2, seqlen=4, embed=8, position="learned", norm="layernorm", eps=1e-5,
          tie_embeddings=True, seed=41, lora=dict(r=2, alpha=3.0, targets=("q", "k", "v", "o", "mlp"))),
     [("block", 1, dict(attention=dict(heads=2),
                        moe=dict(experts=4, hidden=5, k=2, capacity=1.0, aux_loss=0.05, z_loss=0.01))),
      ("dense", 1, dict(attention=dict(heads=2, kv_heads=1),
                        mlp=dict(ffn="gpt", hidden=6, act="gelu", bias=True))),
      ("tail", 1, dict(attention=dict(heads=2, bias=False), mlp=dict(ffn="mixtral", hidden=6)))], None),
    # Mixtral-style with q v experts: per-expert adapters A [E, in, r], B [E, r, out] on the
    # routed experts' w1 w3 w2 (mixtral, k 2 with drops and noise), and on gpt-oss's experts
    # (before their biases b1 b3 b2)
    ("lora mixtral: q v experts, rope rmsnorm gqa 4/2, mixtral k2 drops + oss k1",
     dict(vocab=9, batch=2, seqlen=4, embed=8, position="rope", theta=100.0, norm="rmsnorm",
          eps=1e-6, tie_embeddings=False, seed=43, lora=dict(r=3, alpha=4.0, targets=("q", "v", "experts"))),
     [("mx", 1, dict(attention=dict(heads=4, kv_heads=2, bias=False),
                     moe=dict(experts=4, hidden=5, k=2, capacity=0.5, ffn="mixtral", noise=1.0,
                              aux_loss=0.05, z_loss=0.01))),
      ("oss", 1, dict(attention=dict(heads=2, bias=True),
                      moe=dict(experts=4, hidden=5, k=1, capacity=1.0, ffn="oss", aux_loss=0.05)))],
     "drops"),
    # shared experts: the gated shared expert (w1 w3 w2 adapted, then times sigmoid(x.wsg)) and an
    # ungated one beside gpt experts with biases (experts adapted before b1, b2)
    ("lora shared: shared experts, gated shared + ungated shared beside gpt bias experts",
     dict(vocab=9, batch=2, seqlen=4, embed=8, position="rope", theta=100.0, norm="rmsnorm",
          eps=1e-6, tie_embeddings=False, seed=47, lora=dict(r=2, alpha=5.0, targets=("shared", "experts"))),
     [("sh", 1, dict(attention=dict(heads=2, bias="qkv"),
                     moe=dict(experts=4, hidden=5, k=2, capacity=0.75, ffn="mixtral",
                              renormalize=False, shared_hidden=6, shared_gate=True, noise=1.0,
                              aux_loss=0.05, z_loss=0.01))),
      ("gp", 1, dict(attention=dict(heads=2, bias=False),
                     moe=dict(experts=4, hidden=5, k=1, capacity="*", act="relu", bias=True,
                              shared_hidden=3, aux_loss=0.05)))], None),
    # squared ReLU (act relu2) in gpt experts with drops and in a dense mlp
    ("relu2: gpt experts k2 drops + dense relu2 mlp, rope rmsnorm",
     dict(vocab=9, batch=2, seqlen=4, embed=8, position="rope", theta=100.0, norm="rmsnorm",
          eps=1e-6, tie_embeddings=True, seed=53),
     [("r", 1, dict(attention=dict(heads=2, bias=False),
                    moe=dict(experts=4, hidden=5, k=2, capacity=0.75, act="relu2", bias=True,
                             noise=1.0, aux_loss=0.05, z_loss=0.01))),
      ("d", 1, dict(attention=dict(heads=2, bias=False),
                    mlp=dict(ffn="gpt", hidden=6, act="relu2", bias=False)))], None),
]
LORA_CASES = [i for i, c in enumerate(SELFTEST_CASES) if c[1].get("lora")]


def lora_checks(rng):
    """What the finite differences cannot see: (1) with B = 0 (the binary's start) the LoRA
    model computes exactly what the base model does on the same base weights, A has a zero
    gradient and B does not; (2) with B random the adapters move the logits; (3) the
    gradients are the adapters' only; (4) the two places of the scale (scale "r" and "out")
    agree; (5) lora_init's A lies within +-1/sqrt(in), spread."""
    ok = True
    for ci in LORA_CASES:
        cname, mkw, items, _ = SELFTEST_CASES[ci]
        model = LMModel(items=items, **mkw)
        base_model = LMModel(items=items, **{k: v for k, v in mkw.items() if k != "lora"})
        params = random_params(model, rng)
        tokens = random_tokens(model, rng)
        zero_b = {n: (np.zeros_like(v) if n.endswith(".lora_B") else v) for n, v in params.items()}
        r0 = forward(model, zero_b, tokens)
        rb = forward(base_model, {n: v for n, v in params.items() if ".lora_" not in n}, tokens)
        same = float(np.abs(r0["logits"] - rb["logits"]).max()) + abs(r0["loss"] - rb["loss"])
        ga = max(float(np.abs(g).max()) for n, g in r0["grads"].items() if n.endswith(".lora_A"))
        gb = min(float(np.abs(g).max()) for n, g in r0["grads"].items() if n.endswith(".lora_B"))
        moved = float(np.abs(forward(model, params, tokens, want_grads=False)["logits"]
                             - rb["logits"]).max())
        names = sorted(r0["grads"])
        want = sorted(n for n in model.param_shapes() if n.endswith((".lora_A", ".lora_B")))
        nw = len(model.lora_weights())
        na = len({o for _, _, o in model.lora_weights()})
        good = same <= 1e-12 and ga == 0.0 and gb > 1e-6 and moved > 1e-3 and names == want \
            and len(want) == nw + na
        # the scale on x.A's r columns (lora_scale [r]) and on the product's out columns ([out])
        # is the same model while every element is alpha/r
        other = "out" if model.lora["scale"] == "r" else "r"
        omodel = LMModel(items=items, **dict(mkw, lora=dict(mkw["lora"], scale=other)))
        osh = omodel.param_shapes()
        oparams = {n: (np.full(osh[n], v.flat[0]) if n.endswith(".lora_scale") else v) for n, v in params.items()}
        ra, ro = forward(model, params, tokens), forward(omodel, oparams, tokens)
        forms = max([float(np.abs(ra["logits"] - ro["logits"]).max())]
                    + [float(np.abs(ra["grads"][n] - ro["grads"][n]).max()) for n in ra["grads"]])
        good = good and forms <= 1e-12
        print("# %s: B = 0: logits and loss vs the base model %.1e, max|grad A| %.1e, min over B "
              "of max|grad B| %.1e; B random moves the logits by %.2e; gradients: %d adapters of %d "
              "adapted weights, nothing else; lora_scale [r] vs [out]: logits and gradients within "
              "%.1e %s" % (cname, same, ga, gb, moved, len(names), nw, forms, "ok" if good else "<-- FAIL"))
        ok = ok and good
    cname, mkw, items, _ = SELFTEST_CASES[LORA_CASES[1]]
    model = LMModel(items=items, **mkw)
    worst = 0.0
    for w, expert, owner in model.lora_weights():
        if owner != w:
            continue
        shape = model.param_shapes()[w + ".lora_A"]
        a = lora_init(model, w + ".lora_A", shape).astype(np.float64)
        bound = 1.0 / math.sqrt(shape[-2])
        worst = max(worst, float(np.abs(a).max()) / bound)
        ok = ok and float(np.abs(a).max()) < bound and float(np.abs(a).max()) > 0.5 * bound \
            and abs(float(a.mean())) < 0.5 * bound and len(np.unique(a)) == a.size
    print("# lora_init: every A within +-1/sqrt(in) (max|A| %.3f of the bound), distinct values" % worst)
    return ok


def selftest():
    rng = np.random.default_rng(2024)
    ok = True
    worst_all = 0.0
    print("# lm_ref selftest: central finite differences (eps 1e-6, float64) vs the manual backward")
    print("# err = max|fd - grad| / max(max|grad|, 1e-3) per tensor, tolerance 1e-6")
    print("# %-50s %-26s %5s %10s %10s" % ("case", "tensor", "numel", "max|grad|", "err"))
    for cname, mkw, items, expect in SELFTEST_CASES:
        model = LMModel(items=items, **mkw)
        params = random_params(model, rng)
        tokens = random_tokens(model, rng)
        # the vectorised attention = the loops of the spec, every layer on its own normed input
        base = forward(model, params, tokens, want_grads=False)
        att_err = 0.0
        for ly, c in zip(model.layers, base["caches"]):
            if ly.attn.mla or model.interleave or model.yarn:   # the loops know plain rope only
                continue
            p = sub(params, ly.name + ".attn.")
            y, _ = attn_forward(model, ly, p, c["xa"])
            att_err = max(att_err, float(np.abs(y - naive_attention(model, ly, p, c["xa"])).max()))
        # causality: changing the last token of a window changes no logit of that window
        t2 = tokens.copy()
        t2[:, model.L - 1] = (t2[:, model.L - 1] + 1) % model.V
        r2 = forward(model, params, t2, want_grads=False)
        causal = float(np.abs(r2["logits"][:, :model.L - 1] - base["logits"][:, :model.L - 1]).max())
        # (capacity couples the tokens of a routing group: a later token's first choice comes
        # before an earlier token's second choice and can push it out, so causality is exact
        # only when neither run drops anything)
        no_drops = not any(st["dropped"] for st in base["stats"] + r2["stats"])
        causal_ok = causal <= 1e-12 or not no_drops
        res, rows, worst, skipped, failed = fd_check(model, params, tokens)
        worst_all = max(worst_all, worst)
        for name, numel, scale, err in rows:
            print("  %-50s %-26s %5d %10.3e %10.3e %s" % (cname, name, numel, scale, err,
                                                          "" if err <= 1e-6 else "<-- FAIL"))
        drops = sum(st["dropped"] for st in res["stats"])
        routed = sum(st["routed"] for st in res["stats"])
        print("# %s: loss %.6f ce %.6f aux %.4f z %.4f dropped %d/%d, fd entries skipped "
              "(routing changed) %d; attention vs loops %.1e; logits of earlier positions moved "
              "by %.1e when the last token changed" % (cname, res["loss"], res["ce"], res["aux"],
                                                       res["z"], drops, routed, skipped, att_err,
                                                       causal))
        # bk shifts every score of a query by the same q.bk when positions are learned: its
        # gradient is exactly 0 (softmax is shift-invariant). Not with rope: the key's rotation
        # depends on its position, so q.R_j bk differs per key and bk has a real gradient; nor
        # with qk_norm, which bk passes through.
        for ly in model.layers:
            gbk = res["grads"].get(ly.name + ".attn.bk")
            if gbk is None:
                continue
            zero = model.position == "learned" and not ly.attn.qk_norm
            print("# %s: %s max|grad attn.bk| %.1e (%s)" % (
                cname, ly.name, float(np.abs(gbk).max()),
                "exactly 0 in exact arithmetic" if zero else "rope or qk_norm: not 0"))
            if (float(np.abs(gbk).max()) > 1e-12) == zero:
                ok = False
        if failed or att_err > 1e-12 or not causal_ok:
            ok = False
        if expect == "drops" and drops == 0:
            print("# %s: expected drops, got none" % cname)
            ok = False
        # the check can fail: one wrong gradient entry (1e-4 of the tensor's scale) is caught,
        # and so is a backward that forgets the aux/z terms
        name = sorted(res["grads"], key=lambda n: -res["grads"][n].size)[0]
        bad = {n: v.copy() for n, v in res["grads"].items()}
        i = np.unravel_index(np.argmax(np.abs(bad[name])), bad[name].shape)
        bad[name][i] += 1e-4 * float(np.abs(bad[name]).max())
        _, _, _, _, caught = fd_check(model, params, tokens, grads=bad, names=[name])
        print("# %s: a wrong entry of grad %s is caught: %s" % (cname, name, caught == [name]))
        ok = ok and caught == [name]
    # causality where nothing can be dropped: the dense case with its MoE layer dropless
    cname, mkw, items, _ = SELFTEST_CASES[2]
    items = [(n, r, dict(kw, moe=dict(kw["moe"], capacity="*")) if "moe" in kw else kw)
             for n, r, kw in items]
    model = LMModel(items=items, **mkw)
    params = random_params(model, np.random.default_rng(3))
    tokens = random_tokens(model, np.random.default_rng(4))
    base = forward(model, params, tokens, want_grads=False)
    worst_c = 0.0
    for i in range(1, model.L + 1):
        t2 = tokens.copy()
        t2[:, i] = (t2[:, i] + 1 + np.arange(model.B)) % model.V
        r2 = forward(model, params, t2, want_grads=False)
        worst_c = max(worst_c, float(np.abs(r2["logits"][:, :i] - base["logits"][:, :i]).max()))
        if i < model.L and float(np.abs(r2["logits"][:, i:] - base["logits"][:, i:]).max()) < 1e-6:
            print("# causality: changing token %d moved no later logit" % i)
            ok = False
    print("# causality (dropless): changing token i moves the logits before i by at most %.1e"
          % worst_c)
    ok = ok and worst_c <= 1e-12
    # the windows' reach: in the case of windows 2 and 1 (no MoE) the logits at position i see
    # tokens i - 1 and i only, so changing token i moves the logits at i and i + 1 and no other
    cname, mkw, items, _ = SELFTEST_CASES[6]
    model = LMModel(items=items, **mkw)
    params = random_params(model, np.random.default_rng(7))
    tokens = random_tokens(model, np.random.default_rng(8))
    base = forward(model, params, tokens, want_grads=False)
    far, near = 0.0, math.inf
    for i in range(model.L):
        t2 = tokens.copy()
        t2[:, i] = (t2[:, i] + 1 + np.arange(model.B)) % model.V
        moved = np.abs(forward(model, params, t2, want_grads=False)["logits"] - base["logits"]).max(axis=(0, 2))
        far = max([far] + [float(moved[j]) for j in range(model.L) if j not in (i, i + 1)])
        near = min([near] + [float(moved[j]) for j in (i, i + 1) if j < model.L])
    print("# windows 2 then 1: changing token i moves the logits at i and i+1 by at least %.1e, "
          "the others by at most %.1e" % (near, far))
    ok = ok and far <= 1e-12 and near > 1e-6
    # a wrong semantics is caught too: the backward of the GPT case without the aux and z terms
    cname, mkw, items, _ = SELFTEST_CASES[0]
    model = LMModel(items=items, **mkw)
    params = random_params(model, np.random.default_rng(5))
    tokens = random_tokens(model, np.random.default_rng(6))
    nolosses = LMModel(items=[(n, r, dict(kw, moe=dict(kw["moe"], aux_loss=0.0, z_loss=0.0)))
                              for n, r, kw in items], **mkw)
    wrong = forward(nolosses, params, tokens)["grads"]
    gname = "block0.moe.gate.wg"
    _, rows, _, _, caught = fd_check(model, params, tokens, grads=wrong, names=[gname])
    print("# gradients without the aux/z terms are caught: %s (err %.2e on %s)"
          % (caught == [gname], rows[0][3], gname))
    ok = ok and caught == [gname]
    ok = lora_checks(np.random.default_rng(53)) and ok
    print("# worst relative error %.3e (tolerance 1e-6)" % worst_all)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    if "--selftest" in sys.argv[1:]:
        sys.exit(selftest())
    print(__doc__)
    print("usage: lm_ref.py --selftest")
    sys.exit(2)
