#!/usr/bin/env python3
"""torch_lm: make bench's PyTorch twin of lang/models/gpt_moe_bytes.moe (the demo's GPT-MoE).

The same model written the way a PyTorch user writes it, trained the same way, one whole step
at a time (forward, backward, clip, AdamW update), on the CPU, so that bench/cpu.sh can set its
step time beside the moec binary's:

  tokens  vocab 256 (bytes), batch 8, seqlen 64, random windows (the data is not timed apart)
  embed   wte [256, 96] + learned wpe [64, 96]
  block   x 3, pre-norm: a = x + Attn(LayerNorm(x)), out = a + MoE(LayerNorm(a))
  attn    4 heads, q/k/v/o projections with biases, causal softmax attention
  moe     4 experts, ffn gpt (hidden 192, tanh gelu, biases), gshard top-2, capacity 1.25,
          aux loss 0.01 (tutel-style dispatch by index, as bench/torch_ref.py)
  head    final LayerNorm, tied to wte, cross-entropy
  update  global-norm clip 1.0, AdamW (lr 0.003, betas 0.9/0.95, weight decay 0.1)

--size mid and --size large are bench/models/lm_mid.moe and lm_large.moe (issue 28): vocab 8192,
batch 4, seqlen 256, embed 512, 6 blocks of 8 heads, 8 experts of hidden 1024; vocab 32000, batch
2, seqlen 512, embed 1024, 4 blocks of 16 heads, 8 experts of hidden 2048 (lr 0.0003, no warmup).
--size gpu is bench/gpu_lm.sh's model for one GPU (vocab 32000, batch 16, seqlen 256, embed 2048,
2 blocks of 16 heads, 8 experts of hidden 8192: 636 M parameters); gpu-quick its smoke size.

--device cuda runs it on the GPU (the step's time after torch.cuda.synchronize); --dtype bf16
under torch.autocast(bfloat16) with fp32 parameters and AdamW state (moec's dtype bf16).

Prints one line "lm NAME <median step ms> <forward+backward ms>" (medians of --steps steps after
--warmup), or "skip  torch_lm: torch not installed" and exit status 0.
"""
import argparse
import math
import statistics
import sys
import time

# name: vocab, batch, seqlen, embed, layers, heads, experts, hidden, lr
SIZES = {
    "demo": ("gpt_moe_bytes", 256, 8, 64, 96, 3, 4, 4, 192, 0.003),
    "mid": ("lm_mid", 8192, 4, 256, 512, 6, 8, 8, 1024, 0.0003),
    "large": ("lm_large", 32000, 2, 512, 1024, 4, 16, 8, 2048, 0.0003),
    "gpu": ("lm_gpu", 32000, 16, 256, 2048, 2, 16, 8, 8192, 0.0003),
    "gpu-quick": ("lm_gpu_quick", 512, 2, 32, 64, 2, 4, 8, 256, 0.0003),
}
NAME, VOCAB, BATCH, SEQ, EMBED, LAYERS, HEADS, EXPERTS, HIDDEN, LR = SIZES["demo"]
CHOICES, CAPACITY, AUX_COEF = 2, 1.25, 0.01


def capacity(tokens):
    return max(1, math.ceil(CHOICES * CAPACITY * tokens / EXPERTS - 1e-9))


def build(torch):
    nn, F = torch.nn, torch.nn.functional

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            std = 0.02
            self.wg = nn.Parameter(torch.randn(EMBED, EXPERTS) * EMBED ** -0.5)
            self.w1 = nn.Parameter(torch.randn(EXPERTS, EMBED, HIDDEN) * std)
            self.b1 = nn.Parameter(torch.zeros(EXPERTS, HIDDEN))
            self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, EMBED) * std / math.sqrt(2 * LAYERS))
            self.b2 = nn.Parameter(torch.zeros(EXPERTS, EMBED))

        def forward(self, x):   # x [S, M] -> moe(x), aux
            s, m = x.shape
            cap = capacity(s)
            logits = x @ self.wg
            scores = torch.softmax(logits, dim=1)
            top, idx = torch.topk(scores, CHOICES, dim=1)
            gates = top / top.sum(dim=1, keepdim=True)
            onehot = F.one_hot(idx.t().reshape(-1), EXPERTS)
            loc = ((torch.cumsum(onehot, dim=0) - 1) * onehot).sum(dim=1).view(CHOICES, -1).t()
            kept = loc < cap
            aux = EXPERTS * (scores.mean(dim=0) * F.one_hot(idx[:, 0], EXPERTS).to(x.dtype).mean(dim=0)).sum()
            trash = EXPERTS * cap
            slot = torch.where(kept, idx * cap + loc, torch.full_like(loc, trash)).reshape(-1)
            rows = x.unsqueeze(1).expand(s, CHOICES, m).reshape(-1, m)
            disp = x.new_zeros(trash + 1, m).index_add(0, slot, rows)[:trash].view(EXPERTS, cap, m)
            h = F.gelu(torch.bmm(disp, self.w1) + self.b1.unsqueeze(1), approximate="tanh")
            y = torch.bmm(h, self.w2) + self.b2.unsqueeze(1)
            y = torch.cat([y.reshape(-1, m), y.new_zeros(1, m)])
            return (gates.unsqueeze(2) * y.index_select(0, slot).view(s, CHOICES, m)).sum(dim=1), aux

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(EMBED), nn.LayerNorm(EMBED)
            self.q, self.k, self.v, self.o = (nn.Linear(EMBED, EMBED) for _ in range(4))
            self.moe = MoE()

        def forward(self, x):   # [B, L, M]
            b, l, m = x.shape
            a = self.ln1(x)
            q, k, v = (p(a).view(b, l, HEADS, m // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(att.transpose(1, 2).reshape(b, l, m))
            y, aux = self.moe(self.ln2(x).reshape(b * l, m))
            return x + y.view(b, l, m), aux

    class GPTMoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Parameter(torch.randn(VOCAB, EMBED) * 0.02)
            self.wpe = nn.Parameter(torch.randn(SEQ, EMBED) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.lnf = nn.LayerNorm(EMBED)

        def forward(self, tokens, targets):
            x = self.wte[tokens] + self.wpe
            aux = 0.0
            for blk in self.blocks:
                x, a = blk(x)
                aux = aux + a
            logits = self.lnf(x) @ self.wte.t()
            return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) + AUX_COEF * aux

    return GPTMoE()


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--size", choices=sorted(SIZES), default="demo")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: PyTorch's default)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: torch.autocast(bfloat16), fp32 parameters (as moec's dtype bf16)")
    args = ap.parse_args(argv)
    global NAME, VOCAB, BATCH, SEQ, EMBED, LAYERS, HEADS, EXPERTS, HIDDEN, LR
    NAME, VOCAB, BATCH, SEQ, EMBED, LAYERS, HEADS, EXPERTS, HIDDEN, LR = SIZES[args.size]
    try:
        import torch
    except ImportError:
        print("skip  torch_lm: torch not installed")
        return 0
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skip  torch_lm: no GPU (torch.cuda.is_available() is False)")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False   # fp32 as moec computes it
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(1)
    model = build(torch).to(args.device)
    cuda = args.device == "cuda"
    bf16 = args.dtype == "bf16"
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95))
    steps, fwd_bwd = [], []
    def sync():
        if cuda:
            torch.cuda.synchronize()
    for i in range(args.warmup + args.steps):
        data = torch.randint(0, VOCAB, (BATCH, SEQ + 1)).to(args.device)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device_type=args.device, dtype=torch.bfloat16, enabled=bf16):
            loss = model(data[:, :-1], data[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync()
        t2 = time.perf_counter()
        if i >= args.warmup:
            steps.append((t2 - t0) * 1e3)
            fwd_bwd.append((t1 - t0) * 1e3)
    if not math.isfinite(loss.item()):
        print("torch_lm: the loss is not finite")
        return 1
    print("lm %s %.3f %.3f" % (NAME, statistics.median(steps), statistics.median(fwd_bwd)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
