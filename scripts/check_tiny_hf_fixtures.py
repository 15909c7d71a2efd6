#!/usr/bin/env python3
"""Optional cross-check of the tiny HF fixtures against Hugging Face transformers.

Needs torch + transformers (neither is needed to regenerate the fixtures).
Loads each fixture directory with AutoModelForCausalLM in float64, compares its
logits with expected.json, re-runs the greedy continuation, and checks the
tokenizer and chat template against tokenizer_expected.json. Exits 1 on mismatch.

Usage: python3 scripts/check_tiny_hf_fixtures.py [FIXTURES_DIR]
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

NAMES = ["tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-llama-tied-bf16"]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default = os.path.join(here, "..", "crates", "nibble-model", "tests", "fixtures")
    root = sys.argv[1] if len(sys.argv) > 1 else default
    ok = True
    for name in NAMES:
        d = os.path.join(root, name)
        with open(os.path.join(d, "expected.json")) as f:
            exp = json.load(f)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64, attn_implementation="eager")
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor([exp["input_ids"]])).logits[0]
            diff = (logits - torch.tensor(exp["logits"], dtype=torch.float64)).abs().max().item()
            seq = list(exp["input_ids"])
            greedy = []
            for _ in range(len(exp["greedy"])):
                nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
                greedy.append(nxt)
                seq.append(nxt)
        tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        good = diff < 1e-5 and greedy == exp["greedy"]
        ok &= good
        print(f"{name:24s} {type(model).__name__:20s} max|dlogit|={diff:.3e} "
              f"greedy_match={greedy == exp['greedy']} tied={tied} {'OK' if good else 'FAIL'}")

    tok = AutoTokenizer.from_pretrained(os.path.join(root, NAMES[0]))
    with open(os.path.join(root, "tokenizer_expected.json")) as f:
        te = json.load(f)
    for case in te["encode"]:
        ids = tok(case["text"])["input_ids"]
        if ids != case["ids"]:
            ok = False
            print("tokenizer mismatch:", case["text"], ids, case["ids"])
    rendered = tok.apply_chat_template(te["chat"]["messages"], add_generation_prompt=True, tokenize=False)
    chat_ok = rendered == te["chat"]["rendered"]
    ok &= chat_ok
    print(f"tokenizer encode cases checked; chat template match={chat_ok}; "
          f"bos={tok.bos_token_id} eos={tok.eos_token_id}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
