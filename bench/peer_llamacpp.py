#!/usr/bin/env python3
"""Peer benchmark: llama.cpp (via llama-cpp-python) prefill and decode speed on CPU.

Run inside the peer venv (scripts/setup_peer.sh):
    .venv-peer/bin/python bench/peer_llamacpp.py MODEL.gguf --threads 2 \
        --prompt-tokens 128 --gen-tokens 64 --repeats 3 --json OUT.json

Measures the same two numbers as llama-bench's pp/tg tests, so they line up with
nibble's own:
  prefill: one eval() of exactly N prompt tokens (as one batch), from an empty KV cache.
  decode:  M forward passes of one token each after that prompt, greedy (argmax),
           never stopping at EOS, so every run does the same amount of work.
One untimed warm-up run comes first (page-faults the mmap'd weights, spins up
the thread pool); then --repeats timed runs. Headline numbers are the best run
(other processes can only slow a run down, so the best is the least biased
estimate on a shared box); the median is reported too. Each run also records
cpu_util = process CPU time / wall time: well below --threads means the
threads were starved by other processes and the run is suspect.
"""
import argparse
import json
import statistics
import time

import numpy as np
import llama_cpp

# Fixed English text, so the prompt is the same for every run and engine.
# Repeated/truncated to the exact token count asked for.
TEXT = (
    "The quick brown fox jumps over the lazy dog. Once upon a time, in a small "
    "village at the edge of a great forest, there lived an old clockmaker who "
    "repaired every clock in the valley. Each morning he opened his shop, wound "
    "the tall pendulum clock by the door, and listened to the town wake up. "
    "Children stopped by on their way to school to watch the tiny gears turn, "
    "and farmers brought him broken watches wrapped in handkerchiefs. "
)


def prompt_tokens(llm, n):
    # BOS (if the model wants one) + text tokens, repeating the text as needed.
    toks = llm.tokenize(TEXT.encode(), add_bos=True, special=False)
    body = llm.tokenize(TEXT.encode(), add_bos=False, special=False)
    while len(toks) < n:
        toks += body
    return toks[:n]


def last_logits(llm):
    # With logits_all=False, llm.eval() no longer copies logits into llm.scores,
    # so read the last token's logits straight from the context.
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def cpu_busy(secs=0.5):
    # Fraction of all CPU time that was not idle over `secs` (Linux /proc/stat).
    # Unlike the load average, this does not lag behind by a minute.
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait
    try:
        t0, i0 = snap()
        time.sleep(secs)
        t1, i1 = snap()
        return round(1 - (i1 - i0) / max(1, t1 - t0), 3)
    except OSError:
        return None


def one_run(llm, prompt, n_gen):
    # reset() sets n_past to 0; the next eval() then drops the whole KV cache,
    # so each run starts from an empty cache.
    llm.reset()
    c0 = time.process_time()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()

    tok = int(np.argmax(last_logits(llm)))
    t2 = time.perf_counter()
    for _ in range(n_gen):  # no EOS check on purpose: fixed amount of work
        llm.eval([tok])
        tok = int(np.argmax(last_logits(llm)))
    t3 = time.perf_counter()
    c1 = time.process_time()
    return {
        "cpu_util": round((c1 - c0) / (t3 - t0), 2),
        "prefill_s": t1 - t0,
        "decode_s": t3 - t2,
        "prefill_tok_s": len(prompt) / (t1 - t0),
        "decode_tok_s": n_gen / (t3 - t2),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write results here")
    a = ap.parse_args()

    # Other busy processes skew CPU numbers badly (2-10x seen on a 2-core box):
    # record how busy the CPUs were just before, and warn, so a bad run is
    # recognisable afterwards.
    busy = cpu_busy()
    if busy is not None and busy > 0.2:
        print(f"warning: CPUs {busy:.0%} busy before the run; "
              "other processes will skew the results")

    n_batch = max(512, a.prompt_tokens)  # whole prompt in one batch / ubatch
    llm = llama_cpp.Llama(
        model_path=a.model,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        n_ctx=a.prompt_tokens + a.gen_tokens + 16,
        n_batch=n_batch,
        n_ubatch=n_batch,
        logits_all=False,
        verbose=False,
    )
    prompt = prompt_tokens(llm, a.prompt_tokens)
    assert len(prompt) == a.prompt_tokens, "model tokenized the text to too few tokens"

    one_run(llm, prompt, a.gen_tokens)  # warm-up, not recorded
    runs = [one_run(llm, prompt, a.gen_tokens) for _ in range(a.repeats)]

    pp = [r["prefill_tok_s"] for r in runs]
    tg = [r["decode_tok_s"] for r in runs]
    res = {
        "engine": "llama.cpp",
        "version": f"llama-cpp-python {llama_cpp.__version__}",
        "model": a.model,
        "threads": a.threads,
        "prompt_tokens": a.prompt_tokens,
        "gen_tokens": a.gen_tokens,
        "repeats": a.repeats,
        "stat": "best",
        "prefill_tok_s": max(pp),
        "decode_tok_s": max(tg),
        "prefill_tok_s_median": statistics.median(pp),
        "decode_tok_s_median": statistics.median(tg),
        "cpu_busy_before": busy,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "runs": runs,
    }

    print(f"llama.cpp ({res['version']}), {a.threads} threads, "
          f"pp{a.prompt_tokens} / tg{a.gen_tokens}, {a.repeats} runs")
    print(f"{'run':>6} {'prefill tok/s':>14} {'decode tok/s':>13} {'cpu_util':>9}")
    for i, r in enumerate(runs):
        print(f"{i:>6} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f} {r['cpu_util']:>9.2f}")
    print(f"{'median':>6} {res['prefill_tok_s_median']:>14.1f} {res['decode_tok_s_median']:>13.1f}")
    print(f"{'best':>6} {res['prefill_tok_s']:>14.1f} {res['decode_tok_s']:>13.1f}")

    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
