#!/usr/bin/env python3
"""torch_ref: make bench-gpu's PyTorch side (issue 7).

The MoE layer of bench/gpu_layer.cpp written the way a PyTorch user writes it (tutel style),
forward and backward with autograd, on the same shapes, printing the same table:

  gate    gshard, top-2: logits = x @ Wg, softmax, topk, gates renormalised to sum 1; aux loss
          E * sum_e mean(scores_e) * frac(first choice = e), coefficient 0.01, in the backward;
          z = mean(logsumexp(logits)^2) as a statistic (no gradient), as moec computes it
  capacity T = ceil(2 * 1.2 * S / E); locations: all first choices in token order, then all
          second choices (one-hot, cumsum); a choice at location >= T is dropped
  order   by index, no one-hot dispatch GEMMs: slot = expert * T + location; dispatch with
          index_add into [E*T (+1 row for the dropped), M], combine by gathering the slots' rows
          and summing gate * row over a token's choices; no host synchronisation in the layer
  experts gpt: gelu(x W1 + b1) W2 + b2 (tanh gelu); mixtral: (silu(x W1) * (x W3)) W2, all as
          torch.bmm over the E experts
  out     x + moe(x); the backward takes dout and gives dx and every parameter's gradient

Columns (as gpu_layer): layer ms (forward + backward), gemm ms (the layer's torch.bmm set alone,
forward and backward, into preallocated outputs), gemm/layer, gate us (softmax -> topk ->
renormalised gates), route us (matmul + gate + one-hot cumsum locations + capacity mask),
TF/s (same FLOP counts as gpu_layer), drop %, and compile ms: the same layer under torch.compile
(--compile MODE, default "default"; "off" leaves it out: nan), checked against the eager
gradients first. fp32, TF32 off. Times: median of --runs runs after
--warmup runs, torch.cuda.Event (on the CPU: time.perf_counter); the gate and the route over 100
calls per run.

Before timing, the layer is compared on a tiny shape in float64 with a per-token loop version of
the same semantics (lang/manual.md §11): routing, output, aux loss and every gradient.

Without torch: "skip  torch_ref: torch not installed", exit status 0; likewise without a GPU
for --device cuda. --device cpu --quick runs tiny shapes on the CPU.
"""
import argparse
import math
import statistics
import sys
import time

EXPERTS = 8
CHOICES = 2
CAPACITY_FACTOR = 1.2
AUX_COEF = 0.01
GATE_REPS = 100
MAX_REL_ERR_CHECK = 1e-9   # float64, two formulations of the same arithmetic

# bench/gpu_layer.cpp's default_shapes: (B, L, M, hscale), each with both ffns.
DEFAULT_SHAPES = [
    (1, 512, 1024, 2), (2, 1024, 1024, 4), (4, 2048, 1024, 3), (1, 2048, 2048, 3), (4, 512, 2048, 2),
    (2, 2048, 2048, 4), (1, 1024, 4096, 4), (4, 1024, 4096, 2), (4, 2048, 4096, 4),
]
QUICK_SHAPES = [(1, 128, 256, 2)]
FFNS = ("gpt", "mixtral")


# ---- shapes and counts (no torch needed) ----

def parse_shapes(spec):
    """'gpt:4x2048x4096x4,mixtral:1x512x1024x2' -> [(ffn, B, L, M, hscale)]; ValueError when malformed."""
    shapes = []
    for item in spec.split(","):
        ffn, sep, dims = item.partition(":")
        parts = dims.split("x")
        if ffn not in FFNS or not sep or len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"bad shape '{item}': expected FFN:BxLxMxHSCALE with FFN gpt or mixtral")
        shapes.append((ffn, *map(int, parts)))
    return shapes


def select_shapes(args):
    if args.shapes:
        return parse_shapes(args.shapes), "as given (--shapes)"
    if args.quick:
        table, what = QUICK_SHAPES, "--quick: tiny shapes, not of Table 4 (a smoke run)"
    elif args.all:
        table = [(b, l, m, h) for b in (1, 2, 4) for l in (512, 1024, 2048) for m in (1024, 2048, 4096) for h in (2, 3, 4)]
        what = "all of Table 4"
    else:
        table, what = DEFAULT_SHAPES, "representative subset of Table 4 (--all: all 162)"
    return [(ffn, *s) for ffn in FFNS for s in table], what


def shape_name(shape):
    return "x".join(str(v) for v in shape[1:])


def capacity(tokens):
    """T = ceil(k * f * S / E - 1e-9), at least 1 (ir_capacity_slots: a whole k*f*S/E stays whole)."""
    return max(1, math.ceil(CHOICES * CAPACITY_FACTOR * tokens / EXPERTS - 1e-9))


def gemms_per_expert(ffn):
    return 2 if ffn == "gpt" else 3


def expert_flops(ffn, tokens, model, hidden):
    """Forward + backward of the expert GEMMs over the capacity slots."""
    return 3.0 * gemms_per_expert(ffn) * 2.0 * EXPERTS * capacity(tokens) * model * hidden


def gate_flops(tokens, model):
    return 3.0 * 2.0 * tokens * model * EXPERTS


HEADER = "%-8s %-15s %6s %5s %10s %10s %10s %9s %9s %10s %9s %7s %10s" % (
    "ffn", "shape", "S", "T", "layer ms", "gemm ms", "gemm/layer", "gate us", "route us", "layer TF/s", "gemm TF/s",
    "drop %", "compile ms")


def format_row(shape, layer_ms, gemm_ms, gate_us, route_us, dropped, compile_ms):
    ffn, b, l, m, hs = shape
    s = b * l
    flops = expert_flops(ffn, s, m, hs * m)
    return "%-8s %-15s %6d %5d %10.3f %10.3f %10.2f %9.1f %9.1f %10.1f %9.1f %7.2f %10.3f" % (
        ffn, shape_name(shape), s, capacity(s), layer_ms, gemm_ms, gemm_ms / layer_ms, gate_us, route_us,
        (flops + gate_flops(s, m)) / (layer_ms * 1e9), flops / (gemm_ms * 1e9), dropped, compile_ms)


# ---- the layer in PyTorch ----

def gate(torch, logits):
    """softmax -> top-k -> renormalised gates: what moec's fused gate kernel does."""
    scores = torch.softmax(logits, dim=1)
    top, idx = torch.topk(scores, CHOICES, dim=1)
    return scores, idx, top / top.sum(dim=1, keepdim=True)


def route(torch, x, wg, cap):
    """The whole routing: logits, gate, locations (first choices in token order, then second
    choices: a cumsum over the one-hot choices in that order) and the capacity mask."""
    logits = x @ wg
    scores, idx, gates = gate(torch, logits)
    onehot = torch.nn.functional.one_hot(idx.t().reshape(-1), EXPERTS)      # [k*S, E], choice-major
    loc = ((torch.cumsum(onehot, dim=0) - 1) * onehot).sum(dim=1).view(CHOICES, -1).t()   # [S, k]
    return logits, scores, idx, gates, loc, loc < cap


def layer(torch, p, x, ffn, cap):
    """out = x + moe(x), the aux loss and the z statistic; dropped choices get a zero output."""
    F = torch.nn.functional
    s, m = x.shape
    logits, scores, idx, gates, loc, kept = route(torch, x, p["wg"], cap)
    first = F.one_hot(idx[:, 0], EXPERTS).to(scores.dtype)
    aux = EXPERTS * (scores.mean(dim=0) * first.mean(dim=0)).sum()
    with torch.no_grad():
        z = torch.logsumexp(logits, dim=1).square().mean()
    trash = EXPERTS * cap   # the row that dropped choices go to, never read
    slot = torch.where(kept, idx * cap + loc, torch.full_like(loc, trash)).reshape(-1)   # [S*k]
    rows = x.unsqueeze(1).expand(s, CHOICES, m).reshape(-1, m)
    disp = x.new_zeros(trash + 1, m).index_add(0, slot, rows)[:trash].view(EXPERTS, cap, m)
    if ffn == "gpt":
        h = torch.bmm(disp, p["w1"]) + p["b1"].unsqueeze(1)
        y = torch.bmm(F.gelu(h, approximate="tanh"), p["w2"]) + p["b2"].unsqueeze(1)
    else:
        y = torch.bmm(F.silu(torch.bmm(disp, p["w1"])) * torch.bmm(disp, p["w3"]), p["w2"])
    y = torch.cat([y.reshape(-1, m), y.new_zeros(1, m)])   # the trash row reads as zero
    moe = (gates.unsqueeze(2) * y.index_select(0, slot).view(s, CHOICES, m)).sum(dim=1)
    return x + moe, aux, z, idx, loc, kept


def make_params(torch, ffn, m, h, device, dtype):
    def randn(*size, scale):
        return (torch.randn(*size, device=device, dtype=dtype) * scale).requires_grad_()
    p = {"wg": randn(m, EXPERTS, scale=m ** -0.5), "w1": randn(EXPERTS, m, h, scale=m ** -0.5),
         "w2": randn(EXPERTS, h, m, scale=h ** -0.5)}
    if ffn == "gpt":
        p["b1"] = randn(EXPERTS, h, scale=0.02)
        p["b2"] = randn(EXPERTS, m, scale=0.02)
    else:
        p["w3"] = randn(EXPERTS, m, h, scale=m ** -0.5)
    return p


def forward_backward(torch, p, x, dout, ffn, cap):
    out, aux, _, _, _, _ = layer(torch, p, x, ffn, cap)
    inputs = [x] + list(p.values())
    return torch.autograd.grad([out, AUX_COEF * aux], inputs, [dout, None])


def compiled_layer(torch, names, ffn, cap, bf16, mode):
    """torch.compile of the same layer (out and aux; under autocast when bf16), as a user compiles
    a module: TorchInductor generates the forward and, through AOTAutograd, the backward."""
    def forward(x, *params):
        p = dict(zip(names, params))
        if bf16:
            with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
                out, aux = layer(torch, p, x, ffn, cap)[:2]
        else:
            out, aux = layer(torch, p, x, ffn, cap)[:2]
        return out, aux
    torch._dynamo.reset()   # a fresh compilation per shape (no recompilation limit, no stale guards)
    return torch.compile(forward, mode=mode, dynamic=False)


def forward_backward_compiled(torch, fn, p, x, dout):
    out, aux = fn(x, *p.values())
    inputs = [x] + list(p.values())
    return torch.autograd.grad([out, AUX_COEF * aux], inputs, [dout, None])


# ---- the check: the same layer as loops over tokens ----

def loop_layer(torch, p, x, ffn, cap):
    """lang/manual.md §11 read literally: per-token top-k (ties to the lower index), locations by
    counting, y_t = x_t + sum over kept choices of gate * FFN_e(x_t)."""
    F = torch.nn.functional
    s = x.shape[0]
    logits = x @ p["wg"]
    scores = torch.softmax(logits, dim=1)
    idx = [sorted(range(EXPERTS), key=lambda e: (-scores[t, e].item(), e))[:CHOICES] for t in range(s)]
    count, loc = [0] * EXPERTS, [[0] * CHOICES for _ in range(s)]
    for j in range(CHOICES):
        for t in range(s):
            loc[t][j] = count[idx[t][j]]
            count[idx[t][j]] += 1
    outs = []
    for t in range(s):
        total = sum(scores[t, e] for e in idx[t])
        acc = x[t]
        for j, e in enumerate(idx[t]):
            if loc[t][j] >= cap:
                continue
            if ffn == "gpt":
                f = F.gelu(x[t] @ p["w1"][e] + p["b1"][e], approximate="tanh") @ p["w2"][e] + p["b2"][e]
            else:
                f = (F.silu(x[t] @ p["w1"][e]) * (x[t] @ p["w3"][e])) @ p["w2"][e]
            acc = acc + scores[t, e] / total * f
        outs.append(acc)
    first = [sum(1.0 for t in range(s) if idx[t][0] == e) / s for e in range(EXPERTS)]
    aux = EXPERTS * sum(scores[:, e].mean() * first[e] for e in range(EXPERTS))
    return torch.stack(outs), aux, idx, loc


def rel_err(a, b):
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def check(torch):
    """The vectorised layer against loop_layer in float64 on the CPU; prints one '#' line per ffn."""
    ok = True
    s, m, hscale = 24, 8, 2
    cap = capacity(s)
    for ffn in FFNS:
        torch.manual_seed(1)
        p = make_params(torch, ffn, m, hscale * m, "cpu", torch.float64)
        x = torch.randn(s, m, dtype=torch.float64, requires_grad=True)
        dout = torch.randn(s, m, dtype=torch.float64)
        out, aux, _, idx, loc, kept = layer(torch, p, x, ffn, cap)
        want_out, want_aux, want_idx, want_loc = loop_layer(torch, p, x, ffn, cap)
        inputs = [x] + list(p.values())
        got = torch.autograd.grad([out, AUX_COEF * aux], inputs, [dout, None])
        want = torch.autograd.grad([want_out, AUX_COEF * want_aux], inputs, [dout, None])
        same_routing = idx.tolist() == want_idx and loc.tolist() == want_loc
        errors = {"out": rel_err(out, want_out), "aux": rel_err(aux, want_aux)}
        for name, g, w in zip(["dx"] + ["d" + k for k in p], got, want):
            errors[name] = rel_err(g, w)
        worst = max(errors, key=errors.get)
        good = same_routing and errors[worst] <= MAX_REL_ERR_CHECK
        ok = ok and good
        dropped = int((~kept).sum())
        print("# check %-7s S %d, M %d: vectorised vs per-token loops (float64): routing %s (%d of %d choices "
              "dropped), largest relative error %.1e (%s) %s %.0e" % (
                  ffn, s, m, "identical" if same_routing else "DIFFERS", dropped, s * CHOICES, errors[worst], worst,
                  "<=" if errors[worst] <= MAX_REL_ERR_CHECK else ">", MAX_REL_ERR_CHECK))
    return ok


# ---- timing ----

def median_ms(torch, device, warmup, runs, reps, work):
    """Median over runs of the time of reps calls of work, per call, in ms."""
    for _ in range(warmup):
        work()
    times = []
    if device == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
        for start, end in events:
            start.record()
            for _ in range(reps):
                work()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) / reps for start, end in events]
    else:
        for _ in range(runs):
            t0 = time.perf_counter()
            for _ in range(reps):
                work()
            times.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(times)


def bench_shape(torch, shape, device, warmup, runs, bf16=False, compile_mode=None):
    ffn, b, l, m, hscale = shape
    s, h = b * l, hscale * m
    cap = capacity(s)
    torch.manual_seed(42)
    p = make_params(torch, ffn, m, h, device, torch.float32)
    x = torch.randn(s, m, device=device).requires_grad_()
    dout = torch.randn(s, m, device=device) * m ** -0.5

    def step():
        if not bf16:
            return forward_backward(torch, p, x, dout, ffn, cap)
        # PyTorch's mixed precision: fp32 parameters, the matrix products on bf16 copies
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            return forward_backward(torch, p, x, dout, ffn, cap)
    layer_ms = median_ms(torch, device, warmup, runs, 1, step)

    # torch.compile of the same layer: checked against the eager layer's gradients first (the
    # same inputs; fp32 to 1e-3 and bf16 to 5e-2 of each tensor's largest element: the generated
    # kernels order their sums and roundings differently), then timed as the eager one (the
    # compilation happens in the first warm-up run).
    compile_ms = float("nan")
    if compile_mode:
        fn = compiled_layer(torch, list(p), ffn, cap, bf16, compile_mode)
        t0 = time.perf_counter()
        got = forward_backward_compiled(torch, fn, p, x, dout)
        seconds = time.perf_counter() - t0
        want = step()
        tol = 5e-2 if bf16 else 1e-3
        worst, name = max((rel_err(g.float(), w.float()), n) for g, w, n in zip(got, want, ["dx"] + ["d" + k for k in p]))
        print("# compile %-7s %s: torch.compile(mode=%s) compiled in %.1f s; gradients against eager: largest "
              "relative error %.1e (%s) %s %.0e" % (ffn, shape_name(shape), compile_mode, seconds, worst, name,
                                                   "<=" if worst <= tol else ">", tol))
        if not worst <= tol:
            raise RuntimeError("torch.compile's layer differs from the eager layer")
        compile_ms = median_ms(torch, device, warmup, runs, 1,
                               lambda: forward_backward_compiled(torch, fn, p, x, dout))
        del fn, got, want

    # The expert GEMMs alone: the layer's bmm set, forward and backward, on tensors of its shapes
    # (bf16: bf16 tensors).
    def rand(*size):
        return torch.randn(*size, device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
    w = {k: v.detach().to(torch.bfloat16 if bf16 else torch.float32) for k, v in p.items()}
    disp, dy = rand(EXPERTS, cap, m), rand(EXPERTS, cap, m)
    act = rand(EXPERTS, cap, h)                                    # gelu's output (gpt), glu (mixtral)
    d_hidden = [rand(EXPERTS, cap, h) for _ in range(gemms_per_expert(ffn) - 1)]   # dhb (gpt); dh1, dh3
    out_h, out_m = rand(EXPERTS, cap, h), rand(EXPERTS, cap, m)
    out_mh, out_hm = rand(EXPERTS, m, h), rand(EXPERTS, h, m)
    w_in = [w["w1"]] + ([w["w3"]] if ffn == "mixtral" else [])

    def gemms():
        for wi in w_in:                                            # forward: disp @ W1 (and @ W3)
            torch.bmm(disp, wi, out=out_h)
        torch.bmm(act, w["w2"], out=out_m)                     # forward: act/glu @ W2
        torch.bmm(dy, w["w2"].transpose(1, 2), out=out_h)          # backward through W2
        torch.bmm(act.transpose(1, 2), dy, out=out_hm)
        for wi, dh in zip(w_in, d_hidden):                         # backward through W1 (and W3)
            torch.bmm(dh, wi.transpose(1, 2), out=out_m)
            torch.bmm(disp.transpose(1, 2), dh, out=out_mh)
    gemm_ms = median_ms(torch, device, warmup, runs, 1, gemms)

    with torch.no_grad():   # the routing in fp32 (as the layer's under autocast: the gate's product aside)
        xd, wg = x.detach(), p["wg"].detach()
        logits = xd @ wg
        gate_us = 1e3 * median_ms(torch, device, warmup, runs, GATE_REPS, lambda: gate(torch, logits))
        route_us = 1e3 * median_ms(torch, device, warmup, runs, GATE_REPS, lambda: route(torch, xd, wg, cap))
        kept = route(torch, xd, wg, cap)[5]
        dropped = 100.0 * (1.0 - kept.float().mean().item())
    return format_row(shape, layer_ms, gemm_ms, gate_us, route_us, dropped, compile_ms)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    ap.add_argument("--all", action="store_true", help="all 162 shapes of Table 4")
    ap.add_argument("--shapes", help="comma-separated FFN:BxLxMxHSCALE (overrides --quick and --all)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: autocast to bf16 (fp32 parameters, bf16 matrix products), as dtype bf16")
    ap.add_argument("--list-shapes", action="store_true", help="print the shapes as --shapes takes them and exit")
    ap.add_argument("--compile", default="default", metavar="MODE",
                    help="also time torch.compile of the layer in this mode (default, reduce-overhead, "
                         "max-autotune; 'off': not at all); the column 'compile ms'")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        ap.error("--runs must be >= 1 and --warmup >= 0")
    try:
        shapes, selection = select_shapes(args)
    except ValueError as e:
        ap.error(str(e))
    if args.list_shapes:
        print(",".join("%s:%s" % (s[0], shape_name(s)) for s in shapes))
        return 0
    try:
        import torch
    except ImportError:
        print("skip  torch_ref: torch not installed")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skip  torch_ref: no GPU (torch %s: torch.cuda.is_available() is False)" % torch.__version__)
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    print("# torch_ref: the same MoE layer in PyTorch %s (%s), forward + backward by autograd" % (
        torch.__version__, "autocast bf16: fp32 parameters, bf16 matrix products" if args.dtype == "bf16"
        else "fp32, TF32 off"))
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        print("# device: %s, sm_%d%d, %d SMs, %.1f GiB; CUDA %s" % (
            props.name, props.major, props.minor, props.multi_processor_count, props.total_memory / 2 ** 30,
            torch.version.cuda))
    else:
        print("# device: cpu, %d threads" % torch.get_num_threads())
    print("# layer: E %d experts, top-%d gshard gate, capacity %.1f (T = ceil(k*%.1f*S/E)), aux_loss %g, "
          "index dispatch (tutel style)" % (EXPERTS, CHOICES, CAPACITY_FACTOR, CAPACITY_FACTOR, AUX_COEF))
    print("# shapes: %s; shape = BxLxMxhscale, S = B*L tokens, H = hscale*M" % selection)
    print("# times: median of %d runs after %d warm-up runs, %s; gate and route: %d calls per run" % (
        args.runs, args.warmup, "torch.cuda.Event" if args.device == "cuda" else "time.perf_counter", GATE_REPS))
    ok = check(torch)
    if ok:
        print(HEADER)
        sys.stdout.flush()
        for shape in shapes:
            print(bench_shape(torch, shape, args.device, args.warmup, args.runs, args.dtype == "bf16",
                              None if args.compile == "off" else args.compile))
            sys.stdout.flush()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
