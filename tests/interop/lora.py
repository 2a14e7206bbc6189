"""make interop, LoRA (lang/manual.md §19): moec's adapters against PEFT itself.

Run by tests/interop/run.sh with the virtual environment's python (torch, transformers, peft),
after hf.py, whose tiny random checkpoints it reuses. For each family: a random PEFT adapter (A
and B both non-zero) on the attention's projections and the experts' stacked tensors
(target_parameters; DeepSeek's latent attention: q_a_proj, q_b_proj or q_proj, kv_a_proj_with_mqa,
kv_b_proj), saved by PEFT; `moec import-hf --lora`, `moec build`, and the binary run with
--weights and --adapter on fixed tokens. Checks:
  - moec's logits and loss equal transformers + PEFT's in float64;
  - the adapter moec exports after one SGD step equals torch's SGD step of PEFT's adapter, and
    PeftModel.from_pretrained loads that export unchanged;
  - the base weights after the step are bit-identical to the imported ones (the checkpoint);
  - --adapter then --steps 0 --export-hf gives PEFT's adapter back bit for bit;
  - --export-hf --merge loads in transformers with PEFT's logits.
Prints `ok    ...` / `FAIL  ...` lines; exits 1 on a failure.

usage: lora.py MOEC WORKDIR      (INTEROP_ONLY=family,...: those families alone)
"""
import json
import os
import sys

import numpy as np
import torch
from safetensors import safe_open

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf  # noqa: E402  (the families, tiny checkpoints and helpers of the full-model checks)
from hf import EAGER, bad, model_class, ok, run, tensors_of, tiny, tokens  # noqa: E402

MOEC, WORK = sys.argv[1], sys.argv[2]
R, ALPHA, LR = 4, 8, 0.05
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
MLP = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
# What each family's adapter targets: moec's lora block words, PEFT's target_modules and
# target_parameters. DeepSeek's latent attention: q is q_a_proj and q_b_proj (q_proj without
# q_lora_rank), k and v together kv_a_proj_with_mqa and kv_b_proj. The dense layers' and shared
# experts' projections are target_parameters (their weights): PEFT 0.21 reads gate_proj, up_proj
# and down_proj in target_modules as transformers 4's names of the experts (its v4-to-v5
# conversion) for every family here but Qwen2-MoE.
MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
CASES = {
    "mixtral": ("q,k,v,o,experts", ["q_proj", "k_proj", "v_proj", "o_proj"], EXPERTS),
    "qwen3_moe": ("q,k,v,o,experts", ["q_proj", "k_proj", "v_proj", "o_proj"], EXPERTS),
    "olmoe": ("q,k,v,o,experts", ["q_proj", "k_proj", "v_proj", "o_proj"], EXPERTS),
    "deepseek_v3": ("q,k,v,o,experts", MLA, EXPERTS),
    "deepseek_v3_noq": ("q,k,v,o,experts", ["q_proj"] + MLA[2:], EXPERTS),
    "deepseek_v2": ("q,k,v,o,experts", ["q_proj"] + MLA[2:], EXPERTS),
    # beyond the four: the shared expert and a dense layer's MLP (Qwen2-MoE, GLM-4.5, DeepSeek-V3),
    # gate and up interleaved in gate_up_proj [E, in, 2I] (gpt-oss)
    "qwen2_moe": ("q,v,experts,shared,mlp", ["q_proj", "v_proj"],
                  EXPERTS + ["shared_expert." + w for w in MLP] + ["mlp." + w for w in MLP]),
    "gpt_oss": ("q,k,v,o,experts", ["q_proj", "k_proj", "v_proj", "o_proj"], EXPERTS),
    "glm4_moe": ("q,k,v,o,experts,shared,mlp", ["q_proj", "k_proj", "v_proj", "o_proj"],
                 EXPERTS + ["shared_experts." + w for w in MLP] + ["mlp." + w for w in MLP]),
    "deepseek_v3_shared": ("o,experts,shared,mlp", ["o_proj"],
                           EXPERTS + ["shared_experts." + w for w in MLP] + ["mlp." + w for w in MLP]),
}
# The cases on a variant of a family's checkpoint: the family and tiny()'s config overrides
# (DeepSeek-V3 with one q projection, q_lora_rank None); any other case is a family's name.
VARIANTS = {"deepseek_v3_noq": ("deepseek_v3", dict(q_lora_rank=None)), "deepseek_v3_shared": ("deepseek_v3", {})}


def family_of(case):
    return VARIANTS.get(case, (case, {}))[0]


def base_model(case):
    """The tiny checkpoint of a case: its family's (hf.tiny, seed 0) with the case's overrides."""
    family, over = VARIANTS.get(case, (case, {}))
    return tiny(family, 0, **over)


def peft_adapter(case, modules, params, adir):
    """A random adapter on the case's checkpoint, saved by PEFT: A and B drawn from N(0, 0.1^2)."""
    from peft import LoraConfig, get_peft_model
    cfg = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=modules, target_parameters=params,
                     task_type="CAUSAL_LM")
    pm = get_peft_model(base_model(case), cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).mul(0.1).to(p.dtype))
    pm.save_pretrained(adir)


def ce64(model, ids):
    """The output and the cross-entropy of moec's window in float64 (transformers' own loss casts the
    logits to float32 first)."""
    out = model(input_ids=ids)
    logits = out.logits[:, :-1]
    return out, torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def peft_model(case, adir, trainable=False):
    from peft import PeftModel
    return PeftModel.from_pretrained(base_model(case), adir, is_trainable=trainable).to(torch.float64)


def peft_name(param_name):
    """PEFT's saved name of a trained parameter (its adapter's name left out)."""
    return param_name.replace(".default", "")


def lora_checks(case):
    words, modules, params = CASES[case]
    family = family_of(case)
    src = os.path.join(WORK, case + "_lora_base")
    base_model(case).save_pretrained(src)
    adir = os.path.join(WORK, case + "_peft")
    peft_adapter(case, modules, params, adir)
    with open(os.path.join(adir, "adapter_config.json")) as f:
        saved = json.load(f)
    if saved.get("rank_pattern") or set(saved["target_modules"]) != set(modules):   # PEFT's own conversion
        bad(f"{case} LoRA: PEFT rewrote the adapter's targets", json.dumps(saved)[:600])
    with safe_open(os.path.join(adir, "adapter_model.safetensors"), "pt") as f:
        peft_tensors = {k: f.get_tensor(k) for k in f.keys()}
    nonzero = all(float(t.abs().max()) > 0 for t in peft_tensors.values())

    prefix = os.path.join(WORK, case + "_lora")
    run([MOEC, "import-hf", src, "-o", prefix, "--batch", "2", "--seqlen", "16", "--optimizer", "sgd", "--lr", str(LR),
         "--lora", str(R), "--lora-alpha", str(ALPHA), "--lora-targets", words])
    run([MOEC, "build", prefix + ".moe", "-o", prefix])
    vocab = hf.FAMILIES[family][2]["vocab_size"]
    toks = tokens(vocab, 2, 16, 3)
    np.save(prefix + ".tokens.npy", toks)
    out, ckpt, dump = prefix + ".export", prefix + ".ckpt", prefix + ".dump"
    run([prefix, "--steps", "1", "--weights", prefix + ".safetensors", "--adapter", adir, "--input",
         prefix + ".tokens.npy", "--dump", dump, "--export-hf", out, "--save", ckpt, "--quiet"])

    # The forward: moec's step-1 logits and loss against transformers + PEFT in float64.
    ids = torch.from_numpy(toks.astype(np.int64))
    ref = peft_model(case, adir).eval()
    with torch.no_grad():
        ref_out, ref_loss = ce64(ref, ids)
    ref_logits = ref_out.logits[:, :16].numpy()
    logits = np.load(os.path.join(dump, "logits.npy")).reshape(ref_logits.shape)
    loss = float(np.load(os.path.join(dump, "loss.npy")))
    scale = np.abs(ref_logits).max()
    err, lerr = np.abs(logits - ref_logits).max() / scale, abs(loss - float(ref_loss))
    what = f"{case} LoRA (r {R}, alpha {ALPHA}, {words}; {len(peft_tensors)} adapter tensors, A and B non-zero)"
    if nonzero and err <= 1e-5 and lerr <= 1e-5:
        ok(f"{what}: logits within {err:.1e} of transformers + PEFT (float64, relative to the largest logit "
           f"{scale:.2f}), loss {loss:.6f} vs {float(ref_loss):.6f} ({lerr:.1e})")
    else:
        bad(f"{what}: logits {err:.2e} (tolerance 1e-5), loss {loss:.6f} vs {float(ref_loss):.6f} ({lerr:.2e}); "
            f"A and B non-zero: {nonzero}")

    # One SGD step: torch's on PEFT's adapter against the adapter moec exported.
    trained = peft_model(case, adir, trainable=True).train()
    ce64(trained, ids)[1].backward()
    exported = tensors_of(out)
    cfg = json.load(open(os.path.join(out, "adapter_config.json")))
    worst, upd, missing = 0.0, 0.0, []
    for name, p in trained.named_parameters():
        if not p.requires_grad:
            continue
        key = peft_name(name)
        if key not in exported:
            missing.append(key)
            continue
        want = p.detach() - LR * p.grad
        worst = max(worst, float((exported[key].to(torch.float64) - want).abs().max()))
        upd = max(upd, float((LR * p.grad).abs().max()))
    extra = sorted(set(exported) - set(peft_tensors))
    cfg_ok = (cfg["r"] == R and cfg["lora_alpha"] == ALPHA and set(cfg["target_modules"]) == set(modules) and
              set(cfg["target_parameters"]) == set(params) and cfg["peft_type"] == "LORA" and
              cfg["base_model_name_or_path"] == src and cfg["lora_dropout"] == 0 and cfg["bias"] == "none" and
              cfg["task_type"] == "CAUSAL_LM")
    if not missing and not extra and worst <= 2e-3 * upd and cfg_ok:
        ok(f"{case} LoRA one SGD step (lr {LR}): the exported adapter's {len(exported)} tensors within {worst:.1e} of "
           f"torch's step of PEFT's adapter (the update's scale {upd:.1e}); adapter_config.json r {R}, lora_alpha "
           f"{ALPHA}, target_modules {cfg['target_modules']}, target_parameters {cfg['target_parameters']}, "
           f"base_model_name_or_path the imported checkpoint")
    else:
        bad(f"{case} LoRA one SGD step: {worst:.2e} from torch's (the update's scale {upd:.2e}); missing {missing[:3]}, "
            f"extra {extra[:3]}; config {'ok' if cfg_ok else json.dumps(cfg)[:400]}")
    # PEFT loads the export unchanged: every adapter weight as the file holds it.
    loaded = peft_model(case, out)
    got = {peft_name(n): p for n, p in loaded.named_parameters() if "lora_" in n}
    same = set(got) == set(exported) and all(torch.equal(got[k], exported[k].to(torch.float64)) for k in got)
    if same:
        ok(f"{case} LoRA export: PeftModel.from_pretrained(base, DIR) loads it, all {len(got)} adapter tensors as written")
    else:
        bad(f"{case} LoRA export: PeftModel.from_pretrained does not load it as written",
            f"peft {sorted(got)[:3]} file {sorted(exported)[:3]}")

    # The base weights after the step: the checkpoint's frozen tensors are the imported ones.
    base = {}
    with safe_open(prefix + ".safetensors", "pt") as f:
        for k in f.keys():
            base[k] = f.get_tensor(k)
    saved = {}
    for fn in os.listdir(WORK):
        if fn.startswith(os.path.basename(ckpt) + ".rank") and fn.endswith(".safetensors"):
            with safe_open(os.path.join(WORK, fn), "pt") as f:
                for k in f.keys():
                    saved[k] = f.get_tensor(k)
    differ = [k for k in base if k not in saved or not torch.equal(base[k], saved[k])]
    if base and not differ:
        ok(f"{case} LoRA: after the step all {len(base)} base weights in the checkpoint are bit-identical to the imported ones")
    else:
        bad(f"{case} LoRA: base weights changed or missing after the step", str(differ[:5]))

    # --adapter, then --steps 0 --export-hf: PEFT's adapter back bit for bit.
    back = prefix + ".back"
    run([prefix, "--steps", "0", "--weights", prefix + ".safetensors", "--adapter", adir, "--export-hf", back, "--quiet"])
    again = tensors_of(back)
    differ = [k for k in peft_tensors if k not in again or not torch.equal(peft_tensors[k], again[k])]
    if not differ and set(again) == set(peft_tensors):
        ok(f"{case} LoRA: --adapter then --steps 0 --export-hf gives PEFT's {len(again)} adapter tensors back bit for bit")
    else:
        bad(f"{case} LoRA: --adapter round trip differs", f"{differ[:5]} extra {sorted(set(again) - set(peft_tensors))[:3]}")

    # --merge: the merged checkpoint in transformers, against PEFT's logits.
    merged = prefix + ".merged"
    run([prefix, "--steps", "0", "--weights", prefix + ".safetensors", "--adapter", adir, "--export-hf", merged, "--merge",
         "--quiet"])
    m64 = model_class(family).from_pretrained(merged, **EAGER).to(torch.float64).eval()
    with torch.no_grad():
        m_out, m_loss = ce64(m64, ids)
    merr = float((m_out.logits[:, :16] - ref_out.logits[:, :16]).abs().max()) / scale
    mlerr = abs(float(m_loss) - float(ref_loss))
    if merr <= 1e-5 and mlerr <= 1e-5:
        ok(f"{case} LoRA --export-hf --merge: transformers loads it, logits within {merr:.1e} of transformers + PEFT, "
           f"loss within {mlerr:.1e}")
    else:
        bad(f"{case} LoRA --merge: logits {merr:.2e}, loss {mlerr:.2e} from transformers + PEFT (tolerance 1e-5)")


def main():
    os.makedirs(WORK, exist_ok=True)
    only = [f for f in os.environ.get("INTEROP_ONLY", "").split(",") if f]
    for case in CASES:
        if only and case not in only and family_of(case) not in only:
            continue
        try:
            lora_checks(case)
        except Exception as e:  # a failed command is one failed check, the others still run
            bad(f"{case} LoRA: {type(e).__name__}", str(e))
    sys.exit(1 if hf.failed else 0)


main()
