#!/usr/bin/env python3
"""A tiny random Gemma 3 model, twice: as a llama.cpp-style GGUF file and as a Hugging Face
directory, with float64 numpy logits for each (scripts/gemma3_numpy_reference.py's forward).

  crates/nibble-model/tests/fixtures/tiny-gemma3.gguf     arch gemma3; norms stored as 1 + w (as
      llama.cpp's converter writes Gemma norms); attn_q, ffn_gate and ffn_up as Q8_0, the rest F32;
      window 6, every sixth layer global (llama.cpp's default pattern), 7 layers; head_dim 32
      (key_length) with hidden 64 and 4 heads; tokenizer: the tiny fixtures' byte-level BPE
  crates/nibble-model/tests/fixtures/tiny-gemma3/         model_type gemma3_text, the same values
      (Q8_0 dequantized) in F32 with norms as w, layer_types spelled out, and
      query_pre_attn_scalar 48 (not head_dim: GGUF cannot say that, so only here)
  each with expected.json: 24 prompt tokens (four windows long), their logits, and the 16-token
      greedy continuation (the first is the prompt's argmax)

Needs numpy and gguf (e.g. .venv-gguf). Usage: python3 scripts/make_tiny_gemma3_fixture.py
"""
import json
import os
import shutil
import struct
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gemma3_numpy_reference as ref  # noqa: E402
from make_tiny_moe_gguf import tokenizer_meta, VOCAB  # noqa: E402

FIXTURES = os.path.normpath(os.path.join(HERE, "..", "crates", "nibble-model", "tests", "fixtures"))
D, H, KV, HD, FF, LAYERS, WINDOW = 64, 4, 2, 32, 96, 7, 6
INPUT_IDS = [72, 105, 44, 32, 110, 105, 98, 98, 108, 101, 32, 103, 101, 109, 109, 97, 32, 51,
             32, 119, 105, 110, 100, 111]
N_GREEDY = 16
Q8 = ("attn_q", "ffn_gate", "ffn_up")


def weights():
    """GGUF name -> float32 values as stored (norms: 1 + w, w on a 2^-12 grid)."""
    rng = np.random.default_rng(20250603)
    W = {}

    def mat(name, rows, cols, std=None):
        W[name] = (rng.standard_normal((rows, cols)) * (std or cols ** -0.5)).astype(np.float32)

    def norm(name, n):
        w = np.round(rng.uniform(-0.4, 0.4, n) * 4096) / 4096
        W[name] = (1.0 + w).astype(np.float32)

    mat("token_embd.weight", VOCAB, D, 0.05)
    norm("output_norm.weight", D)
    for L in range(LAYERS):
        b = f"blk.{L}."
        mat(b + "attn_q.weight", H * HD, D)
        mat(b + "attn_k.weight", KV * HD, D)
        mat(b + "attn_v.weight", KV * HD, D)
        mat(b + "attn_output.weight", D, H * HD)
        mat(b + "ffn_gate.weight", FF, D)
        mat(b + "ffn_up.weight", FF, D)
        mat(b + "ffn_down.weight", D, FF)
        for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            norm(b + n + ".weight", D)
        norm(b + "attn_q_norm.weight", HD)
        norm(b + "attn_k_norm.weight", HD)
    return W


def stored(name, a):
    """(the values the GGUF holds, after dequantization; raw data and type to write)."""
    if any(f".{q}." in name for q in Q8):
        q = gguf.quants.quantize(a, T.Q8_0)
        return gguf.quants.dequantize(q, T.Q8_0).astype(np.float32), (q, T.Q8_0)
    return a, (a, None)


def write_gguf(path, W):
    tok = json.load(open(os.path.join(FIXTURES, "tiny-qwen3", "tokenizer.json")))
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FF)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(WINDOW)
    tokenizer_meta(w, tok)
    values = {}
    for name in sorted(W):
        v, (raw, ty) = stored(name, W[name])
        values[name] = v.astype(np.float64)
        if ty is None:
            w.add_tensor(name, raw)
        else:
            w.add_tensor(name, raw, raw_dtype=ty)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


def hf_name(g):
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if g in fixed:
        return fixed[g]
    _, layer, module, _ = g.split(".")
    m = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
         "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
         "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
         "post_ffw_norm": "post_feedforward_layernorm"}[module]
    return f"model.layers.{layer}.{m}.weight"


def write_hf(d, values):
    os.makedirs(d, exist_ok=True)
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(LAYERS)]
    cfg = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": D,
        "intermediate_size": FF, "num_hidden_layers": LAYERS, "num_attention_heads": H,
        "num_key_value_heads": KV, "head_dim": HD, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "rope_scaling": None,
        "sliding_window": WINDOW, "layer_types": layer_types, "query_pre_attn_scalar": 48,
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "max_position_embeddings": 512,
        "tie_word_embeddings": True, "attention_bias": False, "torch_dtype": "float32",
    }
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=2)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(FIXTURES, "tiny-qwen3", f), os.path.join(d, f))
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for g in sorted(values, key=hf_name):
        a = values[g].astype(np.float32)
        if "norm" in g:
            a = (a - np.float32(1.0)).astype(np.float32)  # HF stores w of x * (1 + w)
            assert np.array_equal(a + np.float32(1.0), values[g].astype(np.float32))
        raw = np.ascontiguousarray(a).tobytes()
        header[hf_name(g)] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)


def expected(path, cfg, values):
    logits = ref.forward(cfg, values, INPUT_IDS)
    seq, greedy = list(INPUT_IDS), []
    for _ in range(N_GREEDY):
        greedy.append(int(np.argmax(ref.forward(cfg, values, seq)[-1])))
        seq.append(greedy[-1])
    rows = ",\n    ".join("[" + ",".join(f"{v:.9g}" for v in row) + "]" for row in logits)
    with open(path, "w") as f:
        f.write('{\n  "input_ids": %s,\n  "greedy": %s,\n  "logits": [\n    %s\n  ]\n}\n'
                % (json.dumps(INPUT_IDS), json.dumps(greedy), rows))
    print(path, "greedy", greedy)


def main():
    W = weights()
    gguf_path = os.path.join(FIXTURES, "tiny-gemma3.gguf")
    values = write_gguf(gguf_path, W)
    # eps as the file holds it (f32), which is also what nibble reads from config.json.
    cfg = dict(n_layer=LAYERS, d=D, n_head=H, n_kv=KV, head_dim=HD, eps=float(np.float32(1e-6)),
               theta=1e6, theta_local=10000.0, window=WINDOW, period=6, rope_linear=1.0, qpas=HD)
    # The file as the reference script reads it must be what was meant.
    rcfg, rW, _ = ref.load(gguf_path)
    assert rcfg == cfg, (rcfg, cfg)
    assert all(np.array_equal(rW[k], values[k]) for k in values)
    expected(os.path.join(FIXTURES, "tiny-gemma3.gguf-expected.json"), cfg, values)
    d = os.path.join(FIXTURES, "tiny-gemma3")
    write_hf(d, values)
    expected(os.path.join(d, "expected.json"), dict(cfg, qpas=48), values)


if __name__ == "__main__":
    main()
