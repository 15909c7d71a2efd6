#!/usr/bin/env python3
"""Generate tiny mixture-of-experts Hugging Face fixtures plus reference outputs.

The MoE counterpart of make_tiny_hf_fixtures.py (whose shapes, tokenizer, safetensors writer and
helpers it reuses), writing under crates/nibble-model/tests/fixtures/:

  tiny-mixtral/     MixtralForCausalLM: 4 experts, top 2, router always renormalized,
                    `block_sparse_moe.{gate, experts.E.w1/w2/w3}`, BF16, untied
  tiny-qwen2-moe/   Qwen2MoeForCausalLM: 8 experts, top 2, norm_topk_prob false, a shared
                    expert scaled by sigmoid(shared_expert_gate), q/k/v biases, F32, untied
  tiny-qwen3-moe/   Qwen3MoeForCausalLM: 8 experts, top 2, norm_topk_prob true, layer 0 dense
                    (mlp_only_layers [0]), QK norm, head_dim 32, F16, untied

expected.json comes from an independent float64 numpy forward written from Hugging Face
semantics (MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock): router
logits, softmax over all experts, top-k, renormalized when the model says so, the weighted sum
of the chosen experts' SwiGLU outputs, plus (Qwen2-MoE) sigmoid(gate(x)) * shared_expert(x).
The script refuses a seed whose routing has a near-tie at the top-k boundary anywhere in the
prompt or the greedy continuation (margin < 1e-3 in router logits), since an f32 forward could
then pick another expert.

Only numpy and `tokenizers` are needed.

Usage: python3 scripts/make_tiny_moe_fixtures.py [--out DIR]
"""

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_hf_fixtures as base  # noqa: E402
from make_tiny_hf_fixtures import (  # noqa: E402
    BOS_ID, EOS_ID, HEADS, HIDDEN, INPUT_IDS, INTERMEDIATE, KV_HEADS, LAYERS, N_GREEDY, VOCAB,
    apply_rope, bf16_bits_to_f64, f32_to_bf16_bits, rms_norm, rope_inv_freq, silu,
)

EXPERT_FF = 32
SHARED_FF = 48
MIN_ROUTER_MARGIN = 1e-3

MODELS = [
    dict(name="tiny-mixtral", seed=2001, arch="MixtralForCausalLM", model_type="mixtral",
         eps=1e-5, rope_theta=1000000.0, head_dim=16, qkv_bias=False, qk_norm=False,
         dtype="BF16", experts=4, top_k=2, renorm=True, shared=False, dense_layers=[]),
    dict(name="tiny-qwen2-moe", seed=2002, arch="Qwen2MoeForCausalLM", model_type="qwen2_moe",
         eps=1e-6, rope_theta=1000000.0, head_dim=16, qkv_bias=True, qk_norm=False,
         dtype="F32", experts=8, top_k=2, renorm=False, shared=True, dense_layers=[]),
    dict(name="tiny-qwen3-moe", seed=2003, arch="Qwen3MoeForCausalLM", model_type="qwen3_moe",
         eps=1e-6, rope_theta=1000000.0, head_dim=32, qkv_bias=False, qk_norm=True,
         dtype="F16", experts=8, top_k=2, renorm=True, shared=False, dense_layers=[0]),
]


def make_config(m):
    cfg = {
        "architectures": [m["arch"]],
        "model_type": m["model_type"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
        "rms_norm_eps": m["eps"],
        "rope_theta": m["rope_theta"],
        "rope_scaling": None,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "torch_dtype": {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[m["dtype"]],
        "use_cache": True,
        "num_experts_per_tok": m["top_k"],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "attention_dropout": 0.0,
        "transformers_version": "4.51.0",
    }
    mt = m["model_type"]
    if mt == "mixtral":
        # Mixtral's experts are intermediate_size wide; there are no dense layers.
        cfg["intermediate_size"] = EXPERT_FF
        cfg["num_local_experts"] = m["experts"]
        cfg["sliding_window"] = None
        cfg["router_jitter_noise"] = 0.0
    else:
        cfg["intermediate_size"] = INTERMEDIATE  # the dense layers' width
        cfg["moe_intermediate_size"] = EXPERT_FF
        cfg["num_experts"] = m["experts"]
        cfg["norm_topk_prob"] = m["renorm"]
        cfg["decoder_sparse_step"] = 1
        cfg["mlp_only_layers"] = m["dense_layers"]
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = 32768 if mt == "qwen2_moe" else None
        cfg["max_window_layers"] = LAYERS
        if mt == "qwen2_moe":
            cfg["shared_expert_intermediate_size"] = SHARED_FF
            cfg["qkv_bias"] = True
        else:
            cfg["head_dim"] = m["head_dim"]
            cfg["attention_bias"] = False
    return dict(sorted(cfg.items()))


def expert_names(m, p, e):
    if m["model_type"] == "mixtral":
        q = f"{p}block_sparse_moe.experts.{e}."
        return q + "w1.weight", q + "w3.weight", q + "w2.weight"
    q = f"{p}mlp.experts.{e}."
    return q + "gate_proj.weight", q + "up_proj.weight", q + "down_proj.weight"


def router_name(m, p):
    return p + ("block_sparse_moe.gate.weight" if m["model_type"] == "mixtral" else "mlp.gate.weight")


def make_weights(m):
    rng = np.random.default_rng(m["seed"])
    hd = m["head_dim"]
    q_out, kv_out = HEADS * hd, KV_HEADS * hd

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_w(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": normal((VOCAB, HIDDEN), 0.1)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_w(HIDDEN)
        w[p + "self_attn.q_proj.weight"] = normal((q_out, HIDDEN), 0.1)
        w[p + "self_attn.k_proj.weight"] = normal((kv_out, HIDDEN), 0.1)
        w[p + "self_attn.v_proj.weight"] = normal((kv_out, HIDDEN), 0.1)
        w[p + "self_attn.o_proj.weight"] = normal((HIDDEN, q_out), 0.1)
        if m["qkv_bias"]:
            w[p + "self_attn.q_proj.bias"] = normal((q_out,), 0.2)
            w[p + "self_attn.k_proj.bias"] = normal((kv_out,), 0.2)
            w[p + "self_attn.v_proj.bias"] = normal((kv_out,), 0.2)
        if m["qk_norm"]:
            w[p + "self_attn.q_norm.weight"] = norm_w(hd)
            w[p + "self_attn.k_norm.weight"] = norm_w(hd)
        w[p + "post_attention_layernorm.weight"] = norm_w(HIDDEN)
        if i in m["dense_layers"]:
            w[p + "mlp.gate_proj.weight"] = normal((INTERMEDIATE, HIDDEN), 0.1)
            w[p + "mlp.up_proj.weight"] = normal((INTERMEDIATE, HIDDEN), 0.1)
            w[p + "mlp.down_proj.weight"] = normal((HIDDEN, INTERMEDIATE), 0.1)
            continue
        # Router logits of std ~1.2 over unit-scale normed inputs: routing varies by token.
        w[router_name(m, p)] = normal((m["experts"], HIDDEN), 0.15)
        for e in range(m["experts"]):
            g, u, d = expert_names(m, p, e)
            w[g] = normal((EXPERT_FF, HIDDEN), 0.15)
            w[u] = normal((EXPERT_FF, HIDDEN), 0.15)
            w[d] = normal((HIDDEN, EXPERT_FF), 0.15)
        if m["shared"]:
            q = p + "mlp.shared_expert."
            w[q + "gate_proj.weight"] = normal((SHARED_FF, HIDDEN), 0.1)
            w[q + "up_proj.weight"] = normal((SHARED_FF, HIDDEN), 0.1)
            w[q + "down_proj.weight"] = normal((HIDDEN, SHARED_FF), 0.1)
            w[p + "mlp.shared_expert_gate.weight"] = normal((1, HIDDEN), 0.2)
    w["model.norm.weight"] = norm_w(HIDDEN)
    w["lm_head.weight"] = normal((VOCAB, HIDDEN), 0.12)
    return w


def tensor_record(name, arr, dtype):
    if dtype == "F16":
        return (name, dtype, arr.shape, np.ascontiguousarray(arr, dtype="<f2").tobytes())
    return base.tensor_record(name, arr, dtype)


def as_stored_f64(m, weights):
    out = {}
    for n, a in weights.items():
        if m["dtype"] == "BF16":
            out[n] = bf16_bits_to_f64(f32_to_bf16_bits(a)).reshape(a.shape)
        elif m["dtype"] == "F16":
            out[n] = a.astype(np.float16).astype(np.float64)
        else:
            out[n] = a.astype(np.float64)
    return out


def swiglu(x, g, u, d):
    return (silu(x @ g.T) * (x @ u.T)) @ d.T


def sparse_moe(m, W, p, x, margins):
    """HF *SparseMoeBlock.forward in float64. Appends each token's top-k boundary margin."""
    logits = x @ W[router_name(m, p)].T  # [T, E]
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = probs / probs.sum(axis=-1, keepdims=True)
    k = m["top_k"]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        order = np.argsort(-probs[t], kind="stable")
        chosen = order[:k]
        srt = np.sort(logits[t])[::-1]
        margins.append(float(srt[k - 1] - srt[k]))
        wts = probs[t, chosen]
        if m["renorm"]:
            wts = wts / wts.sum()
        for e, wt in zip(chosen, wts):
            g, u, d = (W[n] for n in expert_names(m, p, e))
            out[t] += wt * swiglu(x[t:t + 1], g, u, d)[0]
    if m["shared"]:
        q = p + "mlp.shared_expert."
        y = swiglu(x, W[q + "gate_proj.weight"], W[q + "up_proj.weight"], W[q + "down_proj.weight"])
        gate = 1.0 / (1.0 + np.exp(-(x @ W[p + "mlp.shared_expert_gate.weight"].T)))  # [T, 1]
        out = out + gate * y
    return out


def forward(m, W, ids, margins):
    eps, hd, T = m["eps"], m["head_dim"], len(ids)
    group = HEADS // KV_HEADS
    pos = np.arange(T)
    inv_freq = rope_inv_freq(hd, m["rope_theta"], None)
    scale = 1.0 / math.sqrt(hd)
    causal = np.triu(np.ones((T, T), dtype=bool), k=1)
    x = W["model.embed_tokens.weight"][np.asarray(ids)]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        h = rms_norm(x, W[p + "input_layernorm.weight"], eps)
        q = h @ W[p + "self_attn.q_proj.weight"].T
        k = h @ W[p + "self_attn.k_proj.weight"].T
        v = h @ W[p + "self_attn.v_proj.weight"].T
        if m["qkv_bias"]:
            q = q + W[p + "self_attn.q_proj.bias"]
            k = k + W[p + "self_attn.k_proj.bias"]
            v = v + W[p + "self_attn.v_proj.bias"]
        q, k, v = q.reshape(T, HEADS, hd), k.reshape(T, KV_HEADS, hd), v.reshape(T, KV_HEADS, hd)
        if m["qk_norm"]:
            q = rms_norm(q, W[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, W[p + "self_attn.k_norm.weight"], eps)
        q, k = apply_rope(q, pos, inv_freq), apply_rope(k, pos, inv_freq)
        attn = np.empty((T, HEADS, hd))
        for hh in range(HEADS):
            kvh = hh // group
            s = (q[:, hh, :] @ k[:, kvh, :].T) * scale
            s = np.where(causal, -np.inf, s)
            pr = np.exp(s - s.max(axis=-1, keepdims=True))
            attn[:, hh, :] = (pr / pr.sum(axis=-1, keepdims=True)) @ v[:, kvh, :]
        x = x + attn.reshape(T, HEADS * hd) @ W[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, W[p + "post_attention_layernorm.weight"], eps)
        if i in m["dense_layers"]:
            x = x + swiglu(h, W[p + "mlp.gate_proj.weight"], W[p + "mlp.up_proj.weight"],
                           W[p + "mlp.down_proj.weight"])
        else:
            x = x + sparse_moe(m, W, p, h, margins)
    x = rms_norm(x, W["model.norm.weight"], eps)
    return x @ W["lm_head.weight"].T


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "crates", "nibble-model", "tests", "fixtures"))
    args = ap.parse_args()
    root = os.path.normpath(args.out)
    tok = base.build_tokenizer()
    for m in MODELS:
        d = os.path.join(root, m["name"])
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(d):
            os.remove(os.path.join(d, f))
        base.write_json(os.path.join(d, "config.json"), make_config(m))
        weights = make_weights(m)
        recs = [tensor_record(n, weights[n], m["dtype"]) for n in weights]
        base.write_safetensors(os.path.join(d, "model.safetensors"), recs)
        tok.save(os.path.join(d, "tokenizer.json"), pretty=True)
        base.write_json(os.path.join(d, "tokenizer_config.json"), base.tokenizer_config())

        W = as_stored_f64(m, weights)
        margins = []
        logits = forward(m, W, INPUT_IDS, margins)
        seq, greedy, greedy_margin = list(INPUT_IDS), [], float("inf")
        for _ in range(N_GREEDY):
            last = forward(m, W, seq, margins)[-1]
            top2 = np.sort(last)[-2:]
            greedy_margin = min(greedy_margin, float(top2[1] - top2[0]))
            greedy.append(int(np.argmax(last)))
            seq.append(greedy[-1])
        assert np.all(np.isfinite(logits))
        assert min(margins) >= MIN_ROUTER_MARGIN, (m["name"], min(margins), "pick another seed")
        base.write_expected(os.path.join(d, "expected.json"), INPUT_IDS, logits.tolist(), greedy)
        srt = np.sort(logits, axis=-1)
        print(f"{m['name']:16s} logits std={logits.std():.3f} min top1-top2 margin: "
              f"prompt={(srt[:, -1] - srt[:, -2]).min():.4f} greedy={greedy_margin:.4f} "
              f"router top-k margin={min(margins):.4f}")
        print(f"  greedy={greedy}")


if __name__ == "__main__":
    main()
