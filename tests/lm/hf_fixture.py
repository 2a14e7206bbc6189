"""Hugging Face checkpoints for tests/lm/hf.sh, written with numpy alone (no transformers in make
test): a Mixtral checkpoint in the family's names as transformers saves it, and what the test
compares. Runs under Debian's /usr/bin/python3 (numpy).

  hf_fixture.py make DIR [--family mixtral|qwen2_moe] [--bf16-shards N | --f16] [--config KEY=JSON ...] [--claim KEY=JSON ...]
                   [--drop NAME] [--extra NAME]
      config.json and the weights: F32 in model.safetensors, or BF16 over N shards with an index,
      or F16; values rounded to bf16 first in every form, so that all forms hold the same numbers.
  hf_fixture.py same A B
      every tensor of safetensors file (or folder of shards) A equals B's bit for bit, as float32.
"""
import json
import os
import struct
import sys

import numpy as np

CONFIG = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=64, hidden_size=32,
              intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-5,
              rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, hidden_act="silu",
              tie_word_embeddings=False, sliding_window=None, attention_dropout=0.0, router_aux_loss_coef=0.02,
              router_jitter_noise=0.0, output_router_logits=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=None, initializer_range=0.02, use_cache=True, dtype="float32",
              transformers_version="5.24.0", head_dim=None)


QWEN2 = dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", vocab_size=64, hidden_size=32,
             intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=36, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
             decoder_sparse_step=1, norm_topk_prob=False, qkv_bias=True, max_position_embeddings=64, rms_norm_eps=1e-6,
             rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, hidden_act="silu",
             tie_word_embeddings=False, use_sliding_window=False, sliding_window=None, max_window_layers=28,
             layer_types=["full_attention"] * 3, attention_dropout=0.0, router_aux_loss_coef=0.001,
             output_router_logits=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
             initializer_range=0.02, use_cache=True, dtype="float32", transformers_version="5.24.0")


def qwen2_names(c):
    M, V = c["hidden_size"], c["vocab_size"]
    d = M // c["num_attention_heads"]
    Q, KV = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    I, Is, Id, E = c["moe_intermediate_size"], c["shared_expert_intermediate_size"], c["intermediate_size"], c["num_experts"]
    out = {"model.embed_tokens.weight": (V, M), "model.norm.weight": (M,), "lm_head.weight": (V, M)}

    def swiglu(prefix, hidden):
        out[prefix + "gate_proj.weight"] = (hidden, M)
        out[prefix + "up_proj.weight"] = (hidden, M)
        out[prefix + "down_proj.weight"] = (M, hidden)
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        out[p + "input_layernorm.weight"] = (M,)
        out[p + "post_attention_layernorm.weight"] = (M,)
        for w, rows in (("q", Q), ("k", KV), ("v", KV)):
            out[f"{p}self_attn.{w}_proj.weight"] = (rows, M)
            out[f"{p}self_attn.{w}_proj.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (M, Q)
        if l in c["mlp_only_layers"]:
            swiglu(p + "mlp.", Id)
            continue
        out[p + "mlp.gate.weight"] = (E, M)
        for e in range(E):
            swiglu(f"{p}mlp.experts.{e}.", I)
        swiglu(p + "mlp.shared_expert.", Is)
        out[p + "mlp.shared_expert_gate.weight"] = (1, M)
    return out


def names(c):
    if c["model_type"] == "qwen2_moe":
        return qwen2_names(c)
    M, V, I, E = c["hidden_size"], c["vocab_size"], c["intermediate_size"], c["num_local_experts"]
    d = M // c["num_attention_heads"]
    Q, KV = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = {"model.embed_tokens.weight": (V, M), "model.norm.weight": (M,), "lm_head.weight": (V, M)}
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        out[p + "input_layernorm.weight"] = (M,)
        out[p + "post_attention_layernorm.weight"] = (M,)
        out[p + "self_attn.q_proj.weight"] = (Q, M)
        out[p + "self_attn.k_proj.weight"] = (KV, M)
        out[p + "self_attn.v_proj.weight"] = (KV, M)
        out[p + "self_attn.o_proj.weight"] = (M, Q)
        out[p + "block_sparse_moe.gate.weight"] = (E, M)
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            out[q + "w1.weight"] = (I, M)
            out[q + "w3.weight"] = (I, M)
            out[q + "w2.weight"] = (M, I)
    return out


def to_bf16_bits(x):
    """float32 -> bf16 bits (round to nearest even); the values are already bf16, so exact."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def round_bf16(x):
    return (to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def write_st(path, tensors, dtype):
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = tensors[name]
        if dtype == "BF16":
            raw = to_bf16_bits(a).tobytes()
        elif dtype == "F16":
            raw = a.astype(np.float16).tobytes()
        else:
            raw = a.astype("<f4").tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def read_st(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        raw = data[8 + n + b:8 + n + e]
        kind = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}[t["dtype"]]
        a = np.frombuffer(raw, dtype=kind)
        if t["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = a.astype(np.float32).reshape(t["shape"])
    return out


def read_any(path):
    if os.path.isdir(path):
        out = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                out.update(read_st(os.path.join(path, f)))
        return out
    return read_st(path)


def make(args):
    d = args[0]
    os.makedirs(d, exist_ok=True)
    cfg, shards, dtype, drop, extra, claims = dict(CONFIG), 0, "F32", [], [], {}
    i = 1
    if len(args) > 2 and args[1] == "--family":
        cfg = dict(QWEN2) if args[2] == "qwen2_moe" else dict(CONFIG)
        i = 3
    while i < len(args):
        if args[i] == "--bf16-shards":
            shards, dtype = int(args[i + 1]), "BF16"
            i += 2
        elif args[i] == "--f16":
            dtype = "F16"
            i += 1
        elif args[i] == "--config":
            k, v = args[i + 1].split("=", 1)
            if v == "DELETE":
                cfg.pop(k)
            else:
                cfg[k] = json.loads(v)
            i += 2
        elif args[i] == "--claim":   # config.json only: the tensors keep the true shapes
            k, v = args[i + 1].split("=", 1)
            claims[k] = json.loads(v)
            i += 2
        elif args[i] == "--drop":
            drop.append(args[i + 1])
            i += 2
        elif args[i] == "--extra":
            extra.append(args[i + 1])
            i += 2
        else:
            sys.exit(f"hf_fixture.py: unknown option {args[i]}")
    rng = np.random.default_rng(7)
    tensors = {}
    for name, shape in names(cfg).items():
        if name in drop:
            continue
        if "norm" in name:
            a = rng.uniform(0.5, 1.5, size=shape)
        elif name.endswith(".bias"):
            a = rng.normal(0, 0.3, size=shape)
        else:
            a = rng.normal(0, 0.1, size=shape)
        a = round_bf16(a.astype(np.float32))
        if dtype == "F16":   # values every form holds exactly: bf16 values within f16's range and precision
            a = a.astype(np.float16).astype(np.float32)
        tensors[name] = a
    for name in extra:
        tensors[name] = np.zeros((3,), np.float32)
    cfg.update(claims)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if shards:
        keys = sorted(tensors)
        weight_map = {}
        for s in range(shards):
            part = keys[s::shards]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            write_st(os.path.join(d, fname), {k: tensors[k] for k in part}, dtype)
            weight_map.update({k: fname for k in part})
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f, indent=2)
    else:
        write_st(os.path.join(d, "model.safetensors"), tensors, dtype)


def same(args):
    a, b = read_any(args[0]), read_any(args[1])
    if sorted(a) != sorted(b):
        sys.exit(f"tensor names differ: only in {args[0]}: {sorted(set(a) - set(b))[:5]}, "
                 f"only in {args[1]}: {sorted(set(b) - set(a))[:5]}")
    for k in a:
        if a[k].shape != b[k].shape or not np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)):
            sys.exit(f"tensor {k} differs")
    print(f"{len(a)} tensors bit-identical")


{"make": make, "same": same}[sys.argv[1]](sys.argv[2:])
