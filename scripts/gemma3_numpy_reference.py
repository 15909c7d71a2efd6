#!/usr/bin/env python3
"""An independent float64 numpy forward of Gemma 3 from a GGUF file, for nibble's tests.

Reads the GGUF with the `gguf` package, dequantizes every tensor with `gguf.quants`, and runs
Gemma 3 as llama.cpp's graph and Hugging Face's Gemma3ForCausalLM describe it:

  x = embed[ids] * sqrt(hidden)
  per layer:  h = rms(x) * attn_norm                       (GGUF norms hold 1 + w already)
              q, k = per-head rms(q) * q_norm, rms(k) * k_norm; NeoX rotary (half split),
                     base 10000 in sliding layers, rope.freq_base (with linear scaling) in global
              softmax(q.k / sqrt(query_pre_attn_scalar)) over keys j <= i, and i - j < window in
                     sliding layers (every layer but each sixth)
              x += rms(o_proj(attn)) * post_attention_norm
              x += rms(down(gelu_tanh(gate h') * up h')) * post_ffw_norm,  h' = rms(x) * ffn_norm
  logits = (rms(x) * output_norm) @ embed^T

Tokens come from a SentencePiece model rebuilt from the GGUF vocabulary (pieces, scores,
types; BPE, byte fallback, no dummy prefix), encoded by the `sentencepiece` package: so the
token ids are checked independently of nibble's tokenizer too.

Usage:
  gemma3_numpy_reference.py MODEL.gguf OUT.json --text FILE[:NAME] ... --prompt TEXT ... \
      [--greedy N] [--top K] [--bos]

For each --text: token ids, per-token negative log-likelihoods and perplexity, and each
position's K largest logits. For each --prompt: the N-token greedy continuation (ids), with BOS.

The reference for crates/nibble-cli/tests/gemma3_270m.rs was made with
  python3 scripts/gemma3_numpy_reference.py ~/.cache/nibble/models/gemma-3-270m-q4_k_m.gguf \
      crates/nibble-cli/tests/fixtures/gemma3-270m-reference.json --bos --greedy 20 \
      --text ../shared/reference/sample.txt:sample --text LONG.txt:long \
      --prompt "The capital of France is" --prompt "Once upon a time" \
      --prompt "def fibonacci(n):"
where LONG.txt is sample.txt four times over, joined by blank lines (past the 512-token window).
Needs numpy, gguf, sentencepiece, protobuf (e.g. in .venv-gguf).
"""
import argparse
import json
import math
import sys

import numpy as np
import gguf
from gguf import quants


def load(path):
    r = gguf.GGUFReader(path)
    f = {k: v for k, v in r.fields.items()}

    def val(k, default=None):
        if k not in f:
            if default is None:  # required
                sys.exit(f"{path}: missing {k}")
            return default
        return f[k].contents()

    arch = val("general.architecture")
    assert arch == "gemma3", arch
    p = "gemma3."
    n_layer = val(p + "block_count")
    head_dim = val(p + "attention.key_length")
    cfg = dict(
        n_layer=n_layer,
        d=val(p + "embedding_length"),
        n_head=val(p + "attention.head_count"),
        n_kv=val(p + "attention.head_count_kv"),
        head_dim=head_dim,
        eps=val(p + "attention.layer_norm_rms_epsilon"),
        theta=val(p + "rope.freq_base"),
        theta_local=val(p + "rope.freq_base_swa", 10000.0),
        window=val(p + "attention.sliding_window"),
        period=val(p + "attention.sliding_window_pattern", 6),
        rope_linear=val(p + "rope.scaling.factor", 1.0)
        if val(p + "rope.scaling.type", "none") == "linear"
        else 1.0,
        qpas=head_dim,
    )
    W = {}
    for t in r.tensors:
        a = quants.dequantize(t.data, t.tensor_type)
        shape = [int(x) for x in reversed(list(t.shape))]
        W[t.name] = np.asarray(a, dtype=np.float64).reshape(shape)
    tok = dict(
        tokens=[str(x) for x in val("tokenizer.ggml.tokens")],
        scores=[float(x) for x in val("tokenizer.ggml.scores", [])],
        types=[int(x) for x in val("tokenizer.ggml.token_type")],
        bos=val("tokenizer.ggml.bos_token_id", -1),
    )
    return cfg, W, tok


def spm_from_gguf(tok):
    """A SentencePiece BPE model with the GGUF's pieces, scores and types."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = len(tok["tokens"])
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id = 3
    m.trainer_spec.bos_id = 2
    m.trainer_spec.eos_id = 1
    m.trainer_spec.pad_id = 0
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    # GGUF token types: 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte.
    kinds = {1: pb.ModelProto.SentencePiece.NORMAL, 2: pb.ModelProto.SentencePiece.UNKNOWN,
             3: pb.ModelProto.SentencePiece.CONTROL, 4: pb.ModelProto.SentencePiece.USER_DEFINED,
             5: pb.ModelProto.SentencePiece.UNUSED, 6: pb.ModelProto.SentencePiece.BYTE}
    for piece, score, ty in zip(tok["tokens"], tok["scores"], tok["types"]):
        sp = m.pieces.add()
        sp.piece = piece
        sp.score = score
        sp.type = kinds[ty]
    p = spm.SentencePieceProcessor()
    p.LoadFromSerializedProto(m.SerializeToString())
    return p


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def rope(x, pos, theta, hd, linear):
    inv = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)) / linear
    ang = pos[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], -1)


def forward(cfg, W, ids):
    """Logits [T, vocab] of one sequence from position 0."""
    T = len(ids)
    d, H, KV, hd, eps = cfg["d"], cfg["n_head"], cfg["n_kv"], cfg["head_dim"], cfg["eps"]
    emb = W["token_embd.weight"]
    x = emb[np.asarray(ids)] * math.sqrt(d)
    pos = np.arange(T, dtype=np.float64)
    i = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    causal = j <= i
    for L in range(cfg["n_layer"]):
        b = f"blk.{L}."
        sliding = (L + 1) % cfg["period"] != 0
        h = rms(x, W[b + "attn_norm.weight"], eps)
        q = (h @ W[b + "attn_q.weight"].T).reshape(T, H, hd)
        k = (h @ W[b + "attn_k.weight"].T).reshape(T, KV, hd)
        v = (h @ W[b + "attn_v.weight"].T).reshape(T, KV, hd)
        q = rms(q, W[b + "attn_q_norm.weight"], eps)
        k = rms(k, W[b + "attn_k_norm.weight"], eps)
        if sliding:
            q = rope(q, pos, cfg["theta_local"], hd, 1.0)
            k = rope(k, pos, cfg["theta_local"], hd, 1.0)
            mask = causal & (i - j < cfg["window"])
        else:
            q = rope(q, pos, cfg["theta"], hd, cfg["rope_linear"])
            k = rope(k, pos, cfg["theta"], hd, cfg["rope_linear"])
            mask = causal
        out = np.zeros((T, H, hd))
        g = H // KV
        for hh in range(H):
            kk, vv = k[:, hh // g], v[:, hh // g]
            s = (q[:, hh] @ kk.T) / math.sqrt(cfg["qpas"])
            s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            out[:, hh] = s @ vv
        o = out.reshape(T, H * hd) @ W[b + "attn_output.weight"].T
        x = x + rms(o, W[b + "post_attention_norm.weight"], eps)
        h = rms(x, W[b + "ffn_norm.weight"], eps)
        a = gelu_tanh(h @ W[b + "ffn_gate.weight"].T) * (h @ W[b + "ffn_up.weight"].T)
        dn = a @ W[b + "ffn_down.weight"].T
        x = x + rms(dn, W[b + "post_ffw_norm.weight"], eps)
    x = rms(x, W["output_norm.weight"], eps)
    return x @ W.get("output.weight", emb).T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("out")
    ap.add_argument("--text", action="append", default=[])
    ap.add_argument("--prompt", action="append", default=[])
    ap.add_argument("--ids", action="append", default=[],
                    help="NAME=1,2,3: a sequence of token ids, scored like a text")
    ap.add_argument("--greedy", type=int, default=10)
    ap.add_argument("--top", type=int, default=8, help="logits kept per position")
    ap.add_argument("--bos", action="store_true", help="start each --text with BOS")
    args = ap.parse_args()
    cfg, W, tok = load(args.gguf)
    print(cfg, file=sys.stderr)
    out = {"config": cfg, "texts": {}, "prompts": {}}
    need_spm = args.text or args.prompt
    sp = spm_from_gguf(tok) if need_spm else None

    def score(name, ids):
        logits = forward(cfg, W, ids)
        m = logits.max(-1, keepdims=True)
        lse = (m[:, 0] + np.log(np.exp(logits - m).sum(-1)))
        nll = [float(lse[t] - logits[t, ids[t + 1]]) for t in range(len(ids) - 1)]
        top = np.argsort(-logits, axis=-1, kind="stable")[:, : args.top]
        out["texts"][name] = {
            "ids": [int(t) for t in ids],
            "nll": [round(x, 7) for x in nll],
            "ppl": math.exp(sum(nll) / len(nll)),
            # Per position, the top logits as [id, logit], largest first.
            "top": [[[int(i), round(float(logits[t, i]), 6)] for i in top[t]] for t in range(len(ids))],
        }
        print(name, len(ids), "tokens, ppl", out["texts"][name]["ppl"], file=sys.stderr)

    for spec in args.text:
        path, _, name = spec.partition(":")
        text = open(path, encoding="utf-8").read()
        ids = sp.encode(text)
        if args.bos:
            ids = [tok["bos"]] + ids
        score(name or path, ids)
    for spec in args.ids:
        name, _, rest = spec.partition("=")
        score(name, [int(t) for t in rest.split(",")])
    for prompt in args.prompt:
        ids = [tok["bos"]] + sp.encode(prompt)
        gen = []
        for _ in range(args.greedy):
            logits = forward(cfg, W, ids + gen)
            gen.append(int(logits[-1].argmax()))
        out["prompts"][prompt] = {"ids": ids, "greedy": gen}
        print(repr(prompt), gen, file=sys.stderr)
    with open(args.out, "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
