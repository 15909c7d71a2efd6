#!/usr/bin/env python3
"""Generate tiny Hugging Face-layout model fixtures plus reference outputs.

Writes one directory per architecture under
crates/nibble-model/tests/fixtures/:

  tiny-llama3/            LlamaForCausalLM, Llama-3 rope scaling, untied, F32
  tiny-mistral/           MistralForCausalLM, untied, F32
  tiny-qwen2/             Qwen2ForCausalLM, q/k/v biases, untied, F32
  tiny-qwen3/             Qwen3ForCausalLM, head_dim 32 != hidden/heads,
                          q_norm/k_norm, tied embeddings, F32
  tiny-llama-tied-bf16/   LlamaForCausalLM, tied, BF16, two safetensors shards

Each directory holds config.json, *.safetensors, tokenizer.json,
tokenizer_config.json, expected.json (and generation_config.json for
tiny-llama3).  expected.json is produced by an independent float64 numpy
forward pass written from Hugging Face semantics (see forward() below).

Only numpy and `tokenizers` are needed; safetensors files are written by hand
(the format is trivial) so the `safetensors` package is not required.

Usage: python3 scripts/make_tiny_hf_fixtures.py [--out DIR]
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np

# ---------------------------------------------------------------------------
# Shared constants
# ---------------------------------------------------------------------------

HIDDEN = 64
INTERMEDIATE = 96
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
VOCAB = 272
BOS_ID = 256
EOS_ID = 257

# 9 fixed prompt ids, all < 256 (plain byte tokens): b"Hi, nibbl"
INPUT_IDS = [72, 105, 44, 32, 110, 105, 98, 98, 108]
N_GREEDY = 16

SPECIAL_TOKENS = [("<s>", 256), ("</s>", 257), ("<|im_start|>", 258), ("<|im_end|>", 259)]
# Byte-level BPE merges (in byte-level unicode alphabet, "Ġ" == space).
MERGES = [
    ("h", "e"),
    ("Ġ", "t"),
    ("Ġt", "he"),
    ("i", "n"),
    ("e", "r"),
    ("o", "n"),
    ("Ġ", "a"),
    ("r", "e"),
    ("a", "n"),
    ("l", "l"),
]
FIRST_MERGE_ID = 260  # merges occupy 260..269; 270, 271 are unused rows

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# ---------------------------------------------------------------------------
# Model definitions
# ---------------------------------------------------------------------------

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

MODELS = [
    dict(
        name="tiny-llama3",
        seed=1006,
        arch="LlamaForCausalLM",
        model_type="llama",
        eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE_SCALING,
        max_pos=512,
        head_dim=HEAD_DIM,
        explicit_head_dim=False,
        qkv_bias=False,
        qk_norm=False,
        tied=False,
        dtype="F32",
        shards=1,
        generation_config=True,
    ),
    dict(
        name="tiny-mistral",
        seed=1013,
        arch="MistralForCausalLM",
        model_type="mistral",
        eps=1e-5,
        rope_theta=1000000.0,
        rope_scaling=None,
        max_pos=512,
        head_dim=HEAD_DIM,
        explicit_head_dim=True,
        qkv_bias=False,
        qk_norm=False,
        tied=False,
        dtype="F32",
        shards=1,
    ),
    dict(
        name="tiny-qwen2",
        seed=1010,
        arch="Qwen2ForCausalLM",
        model_type="qwen2",
        eps=1e-6,
        rope_theta=1000000.0,
        rope_scaling=None,
        max_pos=512,
        head_dim=HEAD_DIM,
        explicit_head_dim=False,
        qkv_bias=True,
        qk_norm=False,
        tied=False,
        dtype="F32",
        shards=1,
    ),
    dict(
        name="tiny-qwen3",
        seed=1005,
        arch="Qwen3ForCausalLM",
        model_type="qwen3",
        eps=1e-6,
        rope_theta=1000000.0,
        rope_scaling=None,
        max_pos=512,
        head_dim=32,
        explicit_head_dim=True,
        qkv_bias=False,
        qk_norm=True,
        tied=True,
        dtype="F32",
        shards=1,
    ),
    dict(
        name="tiny-llama-tied-bf16",
        seed=1041,
        arch="LlamaForCausalLM",
        model_type="llama",
        eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_pos=256,
        head_dim=HEAD_DIM,
        explicit_head_dim=False,
        qkv_bias=False,
        qk_norm=False,
        tied=True,
        dtype="BF16",
        shards=2,
    ),
]


def make_config(m):
    cfg = {
        "architectures": [m["arch"]],
        "model_type": m["model_type"],
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": m["max_pos"],
        "rms_norm_eps": m["eps"],
        "rope_theta": m["rope_theta"],
        "rope_scaling": m["rope_scaling"],
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": m["tied"],
        "torch_dtype": "bfloat16" if m["dtype"] == "BF16" else "float32",
        "use_cache": True,
        "transformers_version": "4.51.0",
    }
    if m["explicit_head_dim"]:
        cfg["head_dim"] = m["head_dim"]
    mt = m["model_type"]
    if mt == "llama":
        cfg["attention_bias"] = False
        cfg["attention_dropout"] = 0.0
        cfg["mlp_bias"] = False
        cfg["pretraining_tp"] = 1
    elif mt == "mistral":
        cfg["sliding_window"] = None
        cfg["attention_dropout"] = 0.0
    elif mt == "qwen2":
        # As in real Qwen2/2.5 configs: a window size is present but disabled.
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = 32768
        cfg["max_window_layers"] = LAYERS
        cfg["attention_dropout"] = 0.0
    elif mt == "qwen3":
        cfg["attention_bias"] = False
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
        cfg["max_window_layers"] = LAYERS
        cfg["attention_dropout"] = 0.0
    return dict(sorted(cfg.items()))


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------

def make_weights(m):
    """Return an ordered dict name -> float32 ndarray (HF names, [out, in])."""
    rng = np.random.default_rng(m["seed"])
    hd = m["head_dim"]
    q_out = HEADS * hd
    kv_out = KV_HEADS * hd

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_w(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {}
    w["model.embed_tokens.weight"] = normal((VOCAB, HIDDEN), 0.1)
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
        w[p + "mlp.gate_proj.weight"] = normal((INTERMEDIATE, HIDDEN), 0.1)
        w[p + "mlp.up_proj.weight"] = normal((INTERMEDIATE, HIDDEN), 0.1)
        w[p + "mlp.down_proj.weight"] = normal((HIDDEN, INTERMEDIATE), 0.1)
    w["model.norm.weight"] = norm_w(HIDDEN)
    if not m["tied"]:
        w["lm_head.weight"] = normal((VOCAB, HIDDEN), 0.12)
    return w


def f32_to_bf16_bits(a):
    """Round float32 -> bfloat16 (round to nearest, ties to even), as torch does."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    rounding_bias = ((bits >> 16) & 1) + 0x7FFF
    out = ((bits + rounding_bias) >> 16).astype(np.uint16)
    assert np.all(np.isfinite(a))
    return out


def bf16_bits_to_f64(b):
    return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ---------------------------------------------------------------------------
# safetensors writer
# ---------------------------------------------------------------------------

def write_safetensors(path, tensors):
    """tensors: list of (name, dtype_str, shape, raw_bytes). Returns nbytes of data."""
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    blobs = []
    for name, dtype, shape, raw in sorted(tensors, key=lambda t: t[0]):
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        offset += len(raw)
        blobs.append(raw)
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    pad = (8 - len(hjson) % 8) % 8
    hjson += b" " * pad
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for b in blobs:
            f.write(b)
    return offset


def tensor_record(name, arr, dtype):
    if dtype == "F32":
        raw = np.ascontiguousarray(arr, dtype="<f4").tobytes()
    elif dtype == "BF16":
        raw = f32_to_bf16_bits(arr).astype("<u2").tobytes()
    else:
        raise ValueError(dtype)
    return (name, dtype, arr.shape, raw)


def write_weights(outdir, m, weights):
    names = list(weights.keys())
    if m["shards"] == 1:
        recs = [tensor_record(n, weights[n], m["dtype"]) for n in names]
        write_safetensors(os.path.join(outdir, "model.safetensors"), recs)
        return
    assert m["shards"] == 2
    # Shard 1: embeddings + layer 0; shard 2: layer 1 + final norm (+ lm_head).
    first = [n for n in names if n.startswith("model.embed_tokens.") or n.startswith("model.layers.0.")]
    second = [n for n in names if n not in first]
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    total = 0
    for fname, group in zip(files, (first, second)):
        recs = [tensor_record(n, weights[n], m["dtype"]) for n in group]
        total += write_safetensors(os.path.join(outdir, fname), recs)
        for n in group:
            weight_map[n] = fname
    index = {
        "metadata": {"total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }
    write_json(os.path.join(outdir, "model.safetensors.index.json"), index)


# ---------------------------------------------------------------------------
# numpy float64 reference forward (Hugging Face semantics)
# ---------------------------------------------------------------------------

def rms_norm(x, w, eps):
    # HF LlamaRMSNorm: x * rsqrt(mean(x^2, -1) + eps) * w
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + eps) * w


def rope_inv_freq(head_dim, theta, rope_scaling):
    # HF default: inv_freq = 1 / theta^(arange(0, d, 2) / d)
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope_scaling is None:
        return inv_freq
    assert rope_scaling["rope_type"] == "llama3"
    factor = rope_scaling["factor"]
    low_ff = rope_scaling["low_freq_factor"]
    high_ff = rope_scaling["high_freq_factor"]
    old_ctx = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_ctx / low_ff
    high_freq_wavelen = old_ctx / high_ff
    out = np.empty_like(inv_freq)
    for i, f in enumerate(inv_freq):
        wavelen = 2.0 * math.pi / f
        if wavelen < high_freq_wavelen:
            out[i] = f  # high frequency: unchanged
        elif wavelen > low_freq_wavelen:
            out[i] = f / factor  # low frequency: scaled down by factor
        else:
            smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
            out[i] = (1.0 - smooth) * f / factor + smooth * f
    return out


def rope_regimes(head_dim, theta, rope_scaling):
    """For documentation: classify each frequency as high/medium/low."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    old_ctx = rope_scaling["original_max_position_embeddings"]
    lo = old_ctx / rope_scaling["low_freq_factor"]
    hi = old_ctx / rope_scaling["high_freq_factor"]
    res = []
    for f in inv_freq:
        wl = 2 * math.pi / f
        res.append("high" if wl < hi else ("low" if wl > lo else "medium"))
    return res


def apply_rope(x, positions, inv_freq):
    # x: [T, n_heads, head_dim], HF rotate_half layout (pairs (i, i + d/2)).
    freqs = np.outer(positions.astype(np.float64), inv_freq)  # [T, d/2]
    emb = np.concatenate([freqs, freqs], axis=-1)  # [T, d]
    cos = np.cos(emb)[:, None, :]
    sin = np.sin(emb)[:, None, :]
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def silu(x):
    return x / (1.0 + np.exp(-x))


def forward(m, W, ids):
    """W: name -> float64 ndarray. Returns logits [T, VOCAB] in float64."""
    eps = m["eps"]
    hd = m["head_dim"]
    T = len(ids)
    group = HEADS // KV_HEADS
    pos = np.arange(T)
    inv_freq = rope_inv_freq(hd, m["rope_theta"], m["rope_scaling"])
    scale = 1.0 / math.sqrt(hd)
    causal = np.triu(np.ones((T, T), dtype=bool), k=1)  # True where j > i

    x = W["model.embed_tokens.weight"][np.asarray(ids)]  # [T, H]
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
        q = q.reshape(T, HEADS, hd)
        k = k.reshape(T, KV_HEADS, hd)
        v = v.reshape(T, KV_HEADS, hd)
        if m["qk_norm"]:
            # Qwen3: per-head RMSNorm over head_dim, before rope.
            q = rms_norm(q, W[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, W[p + "self_attn.k_norm.weight"], eps)
        q = apply_rope(q, pos, inv_freq)
        k = apply_rope(k, pos, inv_freq)
        attn = np.empty((T, HEADS, hd))
        for hh in range(HEADS):
            kvh = hh // group
            s = (q[:, hh, :] @ k[:, kvh, :].T) * scale  # [T, T]
            s = np.where(causal, -np.inf, s)
            s = s - s.max(axis=-1, keepdims=True)
            pr = np.exp(s)
            pr = pr / pr.sum(axis=-1, keepdims=True)
            attn[:, hh, :] = pr @ v[:, kvh, :]
        x = x + attn.reshape(T, HEADS * hd) @ W[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, W[p + "post_attention_layernorm.weight"], eps)
        g = h @ W[p + "mlp.gate_proj.weight"].T
        u = h @ W[p + "mlp.up_proj.weight"].T
        x = x + (silu(g) * u) @ W[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, W["model.norm.weight"], eps)
    head = W["model.embed_tokens.weight"] if m["tied"] else W["lm_head.weight"]
    return x @ head.T


def weights_as_stored_f64(m, weights):
    out = {}
    for n, a in weights.items():
        if m["dtype"] == "BF16":
            out[n] = bf16_bits_to_f64(f32_to_bf16_bits(a)).reshape(a.shape)
        else:
            out[n] = a.astype(np.float64)
    return out


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

def bytes_to_unicode():
    """GPT-2 byte -> printable unicode char mapping (as used by ByteLevel)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}  # byte b -> id b
    for tok, tid in SPECIAL_TOKENS:
        vocab[tok] = tid
    for j, (a, b) in enumerate(MERGES):
        merged = a + b
        assert merged not in vocab
        vocab[merged] = FIRST_MERGE_ID + j
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES), fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
         for t, _ in SPECIAL_TOKENS]
    )
    for t, tid in SPECIAL_TOKENS:
        assert tok.token_to_id(t) == tid, (t, tok.token_to_id(t))
    assert tok.get_vocab_size(with_added_tokens=True) == FIRST_MERGE_ID + len(MERGES) <= 270
    return tok


def tokenizer_config():
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(tid): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t, tid in SPECIAL_TOKENS
        },
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


TOKENIZER_CASES = [
    "Hi, nibbl",
    "hello the world",
    "in the inner river, an apple",
    " leading space and  double",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<s>the</s>",
    "caf\u00e9 \u2603 \U0001f600",
]

CHAT_MESSAGES = [
    {"role": "system", "content": "You are tiny."},
    {"role": "user", "content": "Say the answer."},
]


def tokenizer_expected(tok):
    cases = []
    for text in TOKENIZER_CASES:
        enc = tok.encode(text, add_special_tokens=True)
        cases.append({"text": text, "ids": enc.ids, "tokens": enc.tokens,
                      "decoded": tok.decode(enc.ids, skip_special_tokens=False)})
    out = {"encode": cases}
    try:
        import jinja2

        env = jinja2.Environment()
        tmpl = env.from_string(CHAT_TEMPLATE)
        rendered = tmpl.render(messages=CHAT_MESSAGES, add_generation_prompt=True,
                               bos_token="<s>", eos_token="</s>")
        out["chat"] = {
            "messages": CHAT_MESSAGES,
            "add_generation_prompt": True,
            "rendered": rendered,
            "ids": tok.encode(rendered, add_special_tokens=True).ids,
        }
    except ImportError:
        print("jinja2 not available; skipping chat template expectation", file=sys.stderr)
    return out


# ---------------------------------------------------------------------------
# Output helpers
# ---------------------------------------------------------------------------

def write_json(path, obj, indent=2):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent, ensure_ascii=False)
        f.write("\n")


def write_tokenizer_expected(path, obj):
    # One encode case per line to keep the file readable.
    cases = ",\n    ".join(json.dumps(c, ensure_ascii=False) for c in obj["encode"])
    with open(path, "w", encoding="utf-8") as f:
        f.write("{\n")
        f.write(f'  "encode": [\n    {cases}\n  ]')
        if "chat" in obj:
            body = ",\n    ".join(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}"
                                  for k, v in obj["chat"].items())
            f.write(',\n  "chat": {\n    ' + body + "\n  }")
        f.write("\n}\n")


def round_sig(x, sig=7):
    return float(f"{x:.{sig}g}")


def write_expected(path, ids, logits, greedy):
    # Compact: one logits row per line; 7 significant digits.
    rows = ",\n    ".join(
        "[" + ",".join(repr(round_sig(v)) for v in row) + "]" for row in logits
    )
    with open(path, "w", encoding="utf-8") as f:
        f.write("{\n")
        f.write(f'  "input_ids": {json.dumps(ids)},\n')
        f.write(f'  "greedy": {json.dumps(greedy)},\n')
        f.write(f'  "logits": [\n    {rows}\n  ]\n')
        f.write("}\n")


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "crates", "nibble-model", "tests", "fixtures"))
    args = ap.parse_args()
    root = os.path.normpath(args.out)
    os.makedirs(root, exist_ok=True)

    tok = build_tokenizer()
    write_tokenizer_expected(os.path.join(root, "tokenizer_expected.json"), tokenizer_expected(tok))

    for m in MODELS:
        d = os.path.join(root, m["name"])
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(d):
            os.remove(os.path.join(d, f))
        write_json(os.path.join(d, "config.json"), make_config(m))
        weights = make_weights(m)
        write_weights(d, m, weights)
        tok.save(os.path.join(d, "tokenizer.json"), pretty=True)
        write_json(os.path.join(d, "tokenizer_config.json"), tokenizer_config())
        if m.get("generation_config"):
            write_json(os.path.join(d, "generation_config.json"), {
                "_from_model_config": True,
                "bos_token_id": BOS_ID,
                "eos_token_id": [EOS_ID, 259],
                "do_sample": False,
                "transformers_version": "4.51.0",
            })

        W = weights_as_stored_f64(m, weights)
        logits = forward(m, W, INPUT_IDS)
        seq = list(INPUT_IDS)
        greedy = []
        greedy_margin = float("inf")
        for _ in range(N_GREEDY):
            last = forward(m, W, seq)[-1]
            top2 = np.sort(last)[-2:]
            greedy_margin = min(greedy_margin, float(top2[1] - top2[0]))
            nxt = int(np.argmax(last))
            greedy.append(nxt)
            seq.append(nxt)
        assert np.all(np.isfinite(logits))
        write_expected(os.path.join(d, "expected.json"), INPUT_IDS, logits.tolist(), greedy)

        srt = np.sort(logits, axis=-1)
        margin = srt[:, -1] - srt[:, -2]
        print(f"{m['name']:24s} logits std={logits.std():.3f} range=[{logits.min():.2f},{logits.max():.2f}] "
              f"min top1-top2 margin: prompt={margin.min():.4f} greedy={greedy_margin:.4f}")
        print(f"  greedy={greedy}")
        if m["rope_scaling"]:
            print(f"  rope freq regimes: {rope_regimes(m['head_dim'], m['rope_theta'], m['rope_scaling'])}")


if __name__ == "__main__":
    main()
