"""make interop: moec against transformers itself (lang/manual.md §19), one family at a time.

Run by tests/interop/run.sh with the virtual environment's python (torch, transformers). For each
case: a tiny random checkpoint made by transformers, `moec import-hf`, `moec build`, the binary
run on fixed tokens, and its logits, loss, export and one SGD step compared with transformers'.
Prints `ok    ...` / `FAIL  ...` lines; exits 1 on a failure.

usage: hf.py MOEC WORKDIR      (INTEROP_ONLY=family,...: those families alone)
"""
import json
import os
import subprocess
import sys

import numpy as np
import torch
from safetensors import safe_open

MOEC, WORK = sys.argv[1], sys.argv[2]
failed = False
EAGER = dict(attn_implementation="eager", experts_implementation="eager")


def ok(msg):
    print(f"ok    {msg}", flush=True)


def bad(msg, detail=""):
    global failed
    failed = True
    print(f"FAIL  {msg}", flush=True)
    for line in detail.splitlines()[-20:]:
        print(f"      {line}")


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p.stdout


FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                     initializer_range=0.1, rms_norm_eps=1e-5)),
    # a dense layer among the MoE ones (mlp_only_layers), the shared expert and q/k/v biases
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                       shared_expert_intermediate_size=36, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                       max_position_embeddings=64, initializer_range=0.1, rms_norm_eps=1e-6)),
    # a sliding window shorter than the sequence (16 tokens)
    "mixtral_window": ("MixtralConfig", "MixtralForCausalLM",
                       dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                            max_position_embeddings=64, initializer_range=0.1, rms_norm_eps=1e-5, sliding_window=6)),
    # head_dim 12 != 32 / 4, RMSNorm of q and k per head, renormalised top-k
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=4,
                       num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64,
                       initializer_range=0.1, rms_norm_eps=1e-6)),
    # GLM-4.5: a dense first layer, rope on half of each head (partial_rotary_factor), head_dim 12 != 32 / 4,
    # q/k/v biases, q/k RMSNorm per head; DeepSeek-V3's router (sigmoid, a correction bias, 4 groups of 2 of
    # which the best 2, renormalised, scaled by 2.5) beside 2 shared experts
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                      n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, n_group=4, topk_group=2,
                      routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, use_qk_norm=True,
                      attention_bias=True, partial_rotary_factor=0.5, max_position_embeddings=64,
                      initializer_range=0.1, rms_norm_eps=1e-5)),
    # DeepSeek-V3: multi-head latent attention with q LoRA, yarn (factor 4 over 16 original positions, both mscales)
    # and rope on adjacent pairs; a dense first layer; the router of 2 groups of 4 experts (the best 1), sigmoid
    # scores with a correction bias, renormalised, scaled by 2.5; a shared expert
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                         n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                         first_k_dense_replace=1, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6,
                         qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64, initializer_range=0.1,
                         rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
                                          "mscale": 0.8, "mscale_all_dim": 0.6})),
    # DeepSeek-V2 (V2-Lite's shape): no q LoRA, softmax scores not renormalised, scaled by 1.5, group-limited
    # greedy (4 groups, the best 2 by their best score), 2 shared experts, v narrower than q and k
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
                         num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8, n_shared_experts=2,
                         num_experts_per_tok=3, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                         routed_scaling_factor=1.5, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=10,
                         qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8, max_position_embeddings=64,
                         initializer_range=0.1, rms_norm_eps=1e-6)),
    # gpt-oss: attention sinks, layers sliding (a window of 6 of the 16 tokens) and full in turn, head_dim 12 !=
    # 32 / 4, biases on q, k, v and o; yarn without truncation (factor 4 over 16 original positions); the router's
    # bias and softmax over the k chosen logits; the clamped SwiGLU experts with biases (their gate_up_proj scaled
    # so that the clamps at 7 act)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=12, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                     max_position_embeddings=64, initializer_range=0.1, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})),
    # RMSNorm of q and k over the whole width, top-k without renormalisation
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                   initializer_range=0.1, rms_norm_eps=1e-5, eos_token_id=2, pad_token_id=1)),
}


def tiny(family, seed, **over):
    import transformers
    cname, mname, cfg = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = dict(cfg, **over)
    config = getattr(transformers, cname)(**cfg)
    config._attn_implementation = "eager"      # float64 throughout: no fused kernels
    config._experts_implementation = "eager"
    model = getattr(transformers, mname)(config).eval()
    with torch.no_grad():   # norms away from 1 and biases away from 0, so that a misplaced weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif (name.endswith(".bias") or name.endswith("_bias") or name.endswith(".sinks") or
                  "shared_expert_gate" in name or name.endswith("mlp.gate.weight")):
                p.normal_(0, 0.3)
            elif name.endswith("experts.gate_up_proj"):   # gpt-oss: gate and up values past its clamps at 7
                p.mul_(20)
        for name, b in model.named_buffers():   # DeepSeek-V3's correction bias, so that it steers the choice
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    return model


def model_class(family):
    import transformers
    return getattr(transformers, FAMILIES[family][1])


def tokens(vocab, batch, seqlen, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(batch, seqlen + 1), dtype=np.int32)


def hf_loss(model, ids):
    """transformers' loss of moec's window: the L+1 tokens give the cross-entropy of L
    predictions; with output_router_logits its aux term is of the L input tokens the window
    routes (the run over L+1 tokens would also route the last one), so it is taken from a run over
    those (the causal router logits of both runs are the same)."""
    out = model(input_ids=ids, labels=ids)
    if not model.config.output_router_logits:
        return out, out.loss
    coef = model.config.router_aux_loss_coef
    window = model(input_ids=ids[:, :-1], labels=ids[:, :-1])
    return out, out.loss - coef * out.aux_loss + coef * window.aux_loss


def hf_reference(model, toks):
    """Logits [B, L, V] and the training loss in float64, as transformers computes them."""
    m64 = model.to(torch.float64)
    ids = torch.from_numpy(toks.astype(np.int64))
    with torch.no_grad():
        out, loss = hf_loss(m64, ids)
    L = toks.shape[1] - 1
    return out.logits[:, :L].numpy(), float(loss)


def moec_run(name, src_dir, batch, seqlen, toks, extra_import=(), extra_run=()):
    prefix = os.path.join(WORK, name)
    run([MOEC, "import-hf", src_dir, "-o", prefix, "--batch", str(batch), "--seqlen", str(seqlen), *extra_import])
    run([MOEC, "build", prefix + ".moe", "-o", prefix])
    np.save(prefix + ".tokens.npy", toks)
    dump = prefix + ".dump"
    run([prefix, "--steps", "1", "--weights", prefix + ".safetensors", "--input", prefix + ".tokens.npy",
         "--dump", dump, "--quiet", *extra_run])
    return prefix, np.load(os.path.join(dump, "logits.npy")), float(np.load(os.path.join(dump, "loss.npy")))


def compare_forward(what, model, src, batch=2, seqlen=16, seed=1):
    toks = tokens(model.config.vocab_size, batch, seqlen, seed)
    ref_logits, ref_loss = hf_reference(model, toks)
    prefix, logits, loss = moec_run(what.replace(" ", "_"), src, batch, seqlen, toks)
    scale = np.abs(ref_logits).max()
    err = np.abs(logits.reshape(ref_logits.shape) - ref_logits).max() / scale
    lerr = abs(loss - ref_loss)
    if err <= 1e-4 and lerr <= 1e-5:
        ok(f"{what}: logits within {err:.1e} of transformers (float64, relative to the largest logit {scale:.2f}), "
           f"loss {loss:.6f} vs {ref_loss:.6f} ({lerr:.1e})")
    else:
        bad(f"{what}: logits {err:.2e} (tolerance 1e-4), loss {loss:.6f} vs {ref_loss:.6f} ({lerr:.2e}, tolerance 1e-5)")
    return prefix


def tensors_of(path_dir):
    out = {}
    for f in sorted(os.listdir(path_dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path_dir, f), "pt") as s:
                for k in s.keys():
                    out[k] = s.get_tensor(k)
    return out


def family_checks(family):
    cls = model_class(family)
    model = tiny(family, 0)
    src = os.path.join(WORK, family)
    model.save_pretrained(src)
    orig = tensors_of(src)
    prefix = compare_forward(f"{family} (F32, one file)", tiny(family, 0), src)

    # Export after --steps 0: transformers loads it, every tensor bit-identical.
    out = prefix + ".export"
    run([prefix, "--steps", "0", "--weights", prefix + ".safetensors", "--export-hf", out, "--quiet"])
    back = cls.from_pretrained(out, **EAGER).eval()
    again = os.path.join(WORK, family + ".resaved")
    back.save_pretrained(again)
    got = tensors_of(again)
    diff = [k for k in orig if k not in got or not torch.equal(orig[k], got[k])]
    extra = [k for k in got if k not in orig]
    if not diff and not extra:
        ok(f"{family} export (--steps 0): transformers loads it, all {len(orig)} tensors bit-identical")
    else:
        bad(f"{family} export (--steps 0): tensors differ or are missing", f"differ: {diff[:5]} extra: {extra[:5]}")

    # BF16 over several shards.
    bf = tiny(family, 0).to(torch.bfloat16)
    src_bf = os.path.join(WORK, family + "_bf16")
    bf.save_pretrained(src_bf, max_shard_size="40KB")
    shards = [f for f in os.listdir(src_bf) if f.endswith(".safetensors")]
    if len(shards) < 2 or not os.path.exists(os.path.join(src_bf, "model.safetensors.index.json")):
        bad(f"{family} BF16: transformers did not write several shards", str(shards))
    ref = tiny(family, 0)
    with torch.no_grad():   # the weights as the shards hold them; buffers (the rotary table) as computed
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
        for name, b in ref.named_buffers():   # saved in BF16 too
            if name.endswith("e_score_correction_bias"):
                b.copy_(b.to(torch.bfloat16).to(b.dtype))
    compare_forward(f"{family} (BF16, {len(shards)} shards)", ref, src_bf)

    sgd_check(family, family, src, {})
    if family in ("deepseek_v3", "gpt_oss"):
        layout_check(family, prefix)


def layout_check(family, prefix):
    """The imported model on dp2·mp2·ep2·esp2 (4 ranks, its heads split over MP) against one rank:
    two steps' losses and the step-1 dump (logits, every gradient) within 1e-5."""
    base = open(prefix + ".moe").read()
    first = base.index("\nlayer ")
    one, many = prefix + ".one", prefix + ".many"
    with open(one + ".moe", "w") as f:
        f.write(base.replace("batch 2;", "batch 4;"))
    with open(many + ".moe", "w") as f:
        f.write(base[:first] + "\nparallel { dp 2; mp 2; ep 2; esp 2; }" + base[first:])
    toks = tokens(FAMILIES[family][2]["vocab_size"], 4, 16, 5)
    np.save(prefix + ".t4.npy", toks)
    common = ["--steps", "2", "--weights", prefix + ".safetensors", "--input", prefix + ".t4.npy"]
    outs = []
    for name, launch in ((one, []), (many, ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4"])):
        run([MOEC, "build", name + ".moe", "-o", name])
        outs.append(run(launch + [name, *common, "--dump", name + ".dump"]))
    losses = [[float(l.split()[3]) for l in o.splitlines() if l.startswith("step ")] for o in outs]
    worst = 0.0
    for root, _, files in os.walk(one + ".dump"):
        for f in files:
            a = np.load(os.path.join(root, f)).astype(np.float64)
            b = np.load(os.path.join(root.replace(one + ".dump", many + ".dump"), f)).astype(np.float64)
            worst = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)))
    if len(losses[0]) == 2 and np.allclose(losses[0], losses[1], rtol=1e-5, atol=2e-6) and worst <= 1e-5:
        ok(f"{family} imported, on dp2·mp2·ep2·esp2 (4 ranks): the losses of 2 steps and the step-1 dump equal one "
           f"rank's (worst {worst:.1e})")
    else:
        bad(f"{family} on dp2·mp2·ep2·esp2 differs from one rank: losses {losses}, dump {worst:.2e}")


def sgd_check(what, family, src, over):
    """One SGD step on transformers' loss (the model tiny(family, 0, **over), saved in src)."""
    cls = model_class(family)
    lr = 0.05
    toks = tokens(FAMILIES[family][2]["vocab_size"], 2, 16, 3)
    p2 = os.path.join(WORK, what + "_sgd")
    run([MOEC, "import-hf", src, "-o", p2, "--batch", "2", "--seqlen", "16", "--optimizer", "sgd", "--lr", str(lr)])
    run([MOEC, "build", p2 + ".moe", "-o", p2])
    np.save(p2 + ".tokens.npy", toks)
    run([p2, "--steps", "1", "--weights", p2 + ".safetensors", "--input", p2 + ".tokens.npy", "--export-hf",
         p2 + ".export", "--quiet"])
    m64 = tiny(family, 0, **over).to(torch.float64).train()
    ids = torch.from_numpy(toks.astype(np.int64))
    hf_loss(m64, ids)[1].backward()
    worst, scale = 0.0, 0.0
    stepped = cls.from_pretrained(p2 + ".export", **EAGER).to(torch.float64)
    mine = dict(stepped.named_parameters())
    for name, p in m64.named_parameters():
        want = p.detach() - lr * (p.grad if p.grad is not None else torch.zeros_like(p))
        worst = max(worst, float((mine[name].detach() - want).abs().max()))
        if p.grad is not None:
            scale = max(scale, float((lr * p.grad).abs().max()))
    if worst <= 2e-3 * scale:
        ok(f"{what} one SGD step (lr {lr}): every weight within {worst:.1e} of torch's step on transformers' loss "
           f"(the update's scale {scale:.1e})")
    else:
        bad(f"{what} one SGD step: {worst:.2e} from torch's, more than 2e-3 of the update's scale {scale:.2e}")


def router_logits_checks(family):
    """output_router_logits: transformers' loss then adds router_aux_loss_coef times its
    load-balancing loss pooled over the MoE layers; moec imports it as `aux pooled`. The loss
    (a large coefficient, so that the term shows), then one SGD step, and the export's config."""
    over = dict(output_router_logits=True, router_aux_loss_coef=0.5)
    what = family + "_router_logits"
    src = os.path.join(WORK, what)
    tiny(family, 0, **over).save_pretrained(src)
    prefix = compare_forward(f"{family} with output_router_logits (aux coef 0.5)", tiny(family, 0, **over), src)
    with open(prefix + ".moe") as f:
        if "aux_loss 0.5; aux pooled;" not in f.read():
            bad(f"{what}: the imported gates do not say 'aux_loss 0.5; aux pooled;'")
    sgd_check(what, family, src, over)
    cfg = json.load(open(os.path.join(WORK, what + "_sgd.export", "config.json")))
    if cfg.get("output_router_logits") is True and cfg.get("router_aux_loss_coef") == 0.5:
        ok(f"{what}: the export's config.json has output_router_logits true and router_aux_loss_coef 0.5")
    else:
        bad(f"{what}: the export's config.json has output_router_logits {cfg.get('output_router_logits')}, "
            f"router_aux_loss_coef {cfg.get('router_aux_loss_coef')}")


def main():
    os.makedirs(WORK, exist_ok=True)
    only = [f for f in os.environ.get("INTEROP_ONLY", "").split(",") if f]   # INTEROP_ONLY=glm4_moe,...: those alone
    for family in FAMILIES:
        if only and family not in only:
            continue
        try:
            family_checks(family)
        except Exception as e:  # a failed command is one failed check, the others still run
            bad(f"{family}: {type(e).__name__}", str(e))
    for family in ("mixtral", "qwen2_moe", "olmoe", "gpt_oss"):
        if only and family not in only:
            continue
        try:
            router_logits_checks(family)
        except Exception as e:
            bad(f"{family} with output_router_logits: {type(e).__name__}", str(e))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":   # tests/interop/lora.py imports the families and helpers
    main()
