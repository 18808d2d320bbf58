"""gpt2 batch-1 chain replays before and after a DecodeGraph's first captured graph has run (GPU host).

    python tools/decode_state.py [--out DIR]

Each sequence runs in a fresh process (a DecodeGraph's state is what is measured) on a
DecodeGraph built without its warm replay (DecodeGraph._warm skipped), then times its ops
in order, each from the same 32-token prompt over a cache of 289 positions (bench_gpt's):
  c    chain replays back to back over 256 steps (us a token)
  g    DecodeGraph.tokens (greedy) over 256 steps
  a16  16 replays of single[0], the graph captured first;  b16  of single[1]
  e    5 eager steps;  w  the warm replay the library does (DecodeGraph._warm)
Found: chains run ~13 us a token slower until single[0] has run once, whatever else runs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SEQUENCES = ["c,c,a16,c,c", "c,b16,c,a16,c", "c,e,c", "g,g,w,g,g", "w,c,g"]


def run_sequence(seq: list[str]) -> list[list]:
    """[op, us a step] for each op of seq, in one process."""
    import cupy
    import numpy as np
    import torch

    from benchlib import prompted_decoder, random_gpt2
    from gpt.graph import CHAIN, DecodeGraph

    prompt, steps = 32, 256
    torch.manual_seed(0)
    model = random_gpt2()
    warm, DecodeGraph._warm = DecodeGraph._warm, lambda self: None
    out = []
    with cupy.cuda.Stream(non_blocking=True) as stream:
        dg, cache, ids, _ = prompted_decoder(model, 1, prompt, prompt + steps + 1)
        for op in seq:
            cache.length = prompt
            dg._seed(ids[:, -1], np.array([prompt]))
            stream.synchronize()
            t = time.perf_counter()
            if op == "c":
                for c in range(steps // CHAIN):
                    dg.chains[c % 2].graph.launch(stream)
                n = steps
            elif op == "g":
                n = sum(1 for _ in dg.tokens(ids[:, -1], np.array([prompt]), steps))
            elif op[0] in "ab":
                n = int(op[1:])
                for _ in range(n):
                    dg.single[0 if op[0] == "a" else 1].graph.launch(stream)
            elif op == "e":
                n = 5
                for _ in range(n):
                    cache.begin(1)
                    model.step(dg.x[0], cache)
            elif op == "w":
                n = 1
                warm(dg)
            else:
                raise SystemExit(f"unknown op {op!r}")
            stream.synchronize()
            out.append([op, round((time.perf_counter() - t) / n * 1e6, 1)])
            print(*out[-1], flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--sequence", help="run this one sequence here and print its JSON (used by the parent)")
    args = ap.parse_args()
    if args.sequence:
        print("RESULT " + json.dumps(run_sequence(args.sequence.split(","))))
        return
    from benchlib import gpu_name, versions, write_result

    rows = []
    for seq in SEQUENCES:
        proc = subprocess.run([sys.executable, __file__, "--sequence", seq], capture_output=True, text=True,
                              env=os.environ)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise SystemExit(f"sequence {seq} failed: {proc.stderr.strip().splitlines()[-1:]}")
        rows.append({"sequence": seq, "us_per_step": json.loads(lines[0][7:])})
        print(rows[-1], flush=True)
    write_result("decode-state-gpt2-b1", {"gpu": gpu_name(), "versions": versions(), "model": "gpt2, random weights",
                                          "prompt": 32, "steps": 256, "capacity": 289, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
