#!/usr/bin/env python3
"""The batch-1 decode step of every `bench throughput --json` result in the given folders
(scripts/gpu-tp-run.sh part b1, with its A/B options): output tokens/s, and the step's host
part (launch and sampling), device part (the wait for its tokens) and period (their sum,
what tokens/s follows).

    python3 bench/b1_ab_table.py DIR..."""
import glob
import json
import os
import sys


def main(dirs):
    for d in dirs:
        print(f"| {d} | output tok/s | host ms | device ms | period ms |")
        print("|---|---|---|---|---|")
        for f in sorted(glob.glob(os.path.join(d, "*.json"))):
            j = json.load(open(f))
            dec = [b for b in j["steps"]["decode"] if b["seqs_from"] == 1]
            if not dec:
                continue
            b = dec[0]
            name = os.path.basename(f)[:-5]
            print(f"| {name} | {j['output_tok_s']:.1f} | {b['host_ms']:.3f} | {b['device_ms']:.3f} "
                  f"| {b['host_ms'] + b['device_ms']:.3f} |")
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
