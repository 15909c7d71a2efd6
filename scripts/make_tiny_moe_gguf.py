#!/usr/bin/env python3
"""Write the tiny mixture-of-experts HF fixtures as GGUF files the way llama.cpp's converter does.

Reads crates/nibble-model/tests/fixtures/tiny-{mixtral,qwen2-moe,qwen3-moe}/ (made by
make_tiny_moe_fixtures.py) and writes crates/nibble-model/tests/fixtures/gguf-moe/:

  tiny-mixtral.gguf    arch `llama` with llama.expert_count / expert_used_count, Q/K rows
                       permuted for the interleaved rotary layout, stacked experts
                       blk.N.ffn_{gate,up,down}_exps, BF16 (the fixture's own values, bit for bit)
  tiny-qwen3-moe.gguf  arch `qwen3moe`, expert_feed_forward_length, layer 0 dense (blk.0.ffn_up
                       and no router; llama.cpp cannot express mlp_only_layers, nibble reads it),
                       F16 (bit for bit)
  tiny-qwen2-moe.gguf  arch `qwen2moe`, shared expert blk.N.ffn_{gate,up,down}_shexp and its
                       gate blk.N.ffn_gate_inp_shexp (a [hidden] vector), every matrix Q8_0 except
                       the routers (F32, as llama.cpp keeps them) and ffn_down_shexp (48-wide
                       rows are no whole Q8_0 blocks: F16, as llama-quantize falls back),
                       norms, biases F32

For the Q8_0 file, tiny-qwen2-moe.q8_0-expected.json holds the float64 numpy forward of
make_tiny_moe_fixtures.py run on the dequantized Q8_0 (and F16) values, so the GGUF's logits can
be checked tightly, not just within the quantization error (its greedy continuation is that of
the dequantized model).

Tensor layout is llama.cpp's: a numpy array [experts, out, in] has ggml dims [in, out, experts].
Tokenizer metadata matches the dense GGUF exports in crates/nibble-cpu/tests/gguf_models.rs:
the fixtures' byte-level BPE as `gpt2`, padded to 272 tokens, eos 257.

Needs the `gguf` package (pip install gguf numpy into a venv, e.g. .venv-gguf).

Usage: python3 scripts/make_tiny_moe_gguf.py
"""

import json
import os
import struct
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.normpath(os.path.join(HERE, "..", "crates", "nibble-model", "tests", "fixtures"))
VOCAB = 272

MODELS = [
    dict(name="tiny-mixtral", arch="llama", ty="BF16"),
    dict(name="tiny-qwen2-moe", arch="qwen2moe", ty="Q8_0"),
    dict(name="tiny-qwen3-moe", arch="qwen3moe", ty="F16"),
]


def read_safetensors(path):
    """name -> (dtype, numpy array of the raw values: uint16 for BF16, float16, float32)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        np_ty = {"BF16": "<u2", "F16": "<f2", "F32": "<f4"}[info["dtype"]]
        out[name] = (info["dtype"], np.frombuffer(data[a:b], dtype=np_ty).reshape(info["shape"]))
    return out


def permute(w, heads):
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute: HF half-split rows to interleaved."""
    shape = w.shape
    return (w.reshape(heads, 2, shape[0] // heads // 2, *shape[1:])
            .swapaxes(1, 2).reshape(shape))


def to_f32(dtype, a):
    if dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def gguf_name(hf):
    """GGUF name and, for a routed expert, (expert index) to stack under a `_exps` name."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf], None
    rest = hf[len("model.layers."):]
    layer, part = rest.split(".", 1)
    module, suffix = part.rsplit(".", 1)
    for pre in ("block_sparse_moe.experts.", "mlp.experts."):
        if module.startswith(pre):
            e, proj = module[len(pre):].split(".")
            g = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
                 "down_proj": "down"}[proj]
            return f"blk.{layer}.ffn_{g}_exps.{suffix}", int(e)
    g = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp",
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    }[module]
    return f"blk.{layer}.{g}.{suffix}", None


def add(w, name, dtype, a, ty):
    """Adds tensor `a` (raw values of safetensors `dtype`) stored as ggml type `ty`."""
    router = "ffn_gate_inp" in name
    if a.ndim == 1 or router:
        w.add_tensor(name, to_f32(dtype, a))
    elif ty == "BF16":
        assert dtype == "BF16"
        w.add_tensor(name, np.ascontiguousarray(a), raw_dtype=T.BF16)
    elif ty == "F16":
        assert dtype == "F16"
        w.add_tensor(name, np.ascontiguousarray(a))
    elif ty == "Q8_0" and a.shape[-1] % 32:
        # Rows that are not whole Q8_0 blocks fall back to F16, as llama-quantize does.
        w.add_tensor(name, to_f32(dtype, a).astype(np.float16))
    elif ty == "Q8_0":
        w.add_tensor(name, gguf.quants.quantize(to_f32(dtype, a), T.Q8_0), raw_dtype=T.Q8_0)
    else:
        raise ValueError(ty)


def tokenizer_meta(w, tok):
    tokens = [""] * VOCAB
    for t, i in tok["model"]["vocab"].items():
        tokens[i] = t
    for a in tok["added_tokens"]:
        tokens[a["id"]] = a["content"]
    tokens = [t or f"<unused{i}>" for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if 256 <= i < 260 else 1 for i in range(VOCAB)])
    w.add_token_merges(merges)
    w.add_eos_token_id(257)


def write(m, out_dir):
    d = os.path.join(FIXTURES, m["name"])
    cfg = json.load(open(os.path.join(d, "config.json")))
    tok = json.load(open(os.path.join(d, "tokenizer.json")))
    st = read_safetensors(os.path.join(d, "model.safetensors"))
    arch = m["arch"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    path = os.path.join(out_dir, m["name"] + ".gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if head_dim != cfg["hidden_size"] // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch != "llama":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    tokenizer_meta(w, tok)

    stacked = {}
    for hf in sorted(st):
        dtype, a = st[hf]
        name, expert = gguf_name(hf)
        if expert is not None:
            stacked.setdefault(name, {})[expert] = (dtype, a)
            continue
        if arch == "llama" and "self_attn.q_proj" in hf:
            a = permute(a, heads)
        elif arch == "llama" and "self_attn.k_proj" in hf:
            a = permute(a, kv)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            a = a.reshape(-1)  # llama.cpp: a [hidden] vector
        add(w, name, dtype, a, m["ty"])
    for name in sorted(stacked):
        experts = stacked[name]
        dtype = experts[0][0]
        add(w, name, dtype, np.stack([experts[e][1] for e in range(len(experts))]), m["ty"])

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{path}: {os.path.getsize(path)} bytes")


def stored_values(dtype, a, ty, hf):
    """The float64 values `add` stores for HF tensor `hf` (its ggml type `ty`)."""
    a = to_f32(dtype, a)
    if ty != "Q8_0" or a.ndim == 1 or hf.endswith("gate.weight") or "shared_expert_gate" in hf:
        return a.astype(np.float64)
    if a.shape[-1] % 32:
        return a.astype(np.float16).astype(np.float64)
    return gguf.quants.dequantize(gguf.quants.quantize(a, T.Q8_0), T.Q8_0).astype(np.float64)


def write_q8_expected(m, out_dir):
    import make_tiny_moe_fixtures as mf
    import make_tiny_hf_fixtures as base
    spec = next(x for x in mf.MODELS if x["name"] == m["name"])
    st = read_safetensors(os.path.join(FIXTURES, m["name"], "model.safetensors"))
    W = {hf: stored_values(dt, a, m["ty"], hf) for hf, (dt, a) in st.items()}
    margins = []
    logits = mf.forward(spec, W, base.INPUT_IDS, margins)
    seq, greedy = list(base.INPUT_IDS), []
    for _ in range(base.N_GREEDY):
        greedy.append(int(np.argmax(mf.forward(spec, W, seq, margins)[-1])))
        seq.append(greedy[-1])
    assert min(margins) >= mf.MIN_ROUTER_MARGIN, min(margins)
    path = os.path.join(out_dir, m["name"] + ".q8_0-expected.json")
    base.write_expected(path, base.INPUT_IDS, logits.tolist(), greedy)
    print(f"{path}: router margin {min(margins):.4f}")


def main():
    sys.path.insert(0, HERE)
    out = os.path.join(FIXTURES, "gguf-moe")
    os.makedirs(out, exist_ok=True)
    for m in MODELS:
        write(m, out)
        if m["ty"] == "Q8_0":
            write_q8_expected(m, out)


if __name__ == "__main__":
    main()
