"""Pivot ncu --page details CSV: one line a kernel launch, grouped by kernel name (median)."""
import csv, sys, statistics, collections
rows = list(csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"')))
by = collections.defaultdict(dict)
names = {}
for r in rows:
    k = r["ID"]
    names[k] = (r["Kernel Name"][:60], r["Grid Size"], r["Block Size"])
    by[k][r["Metric Name"]] = r["Metric Value"]
want = ["Duration", "DRAM Throughput", "Memory Throughput", "Registers Per Thread", "Achieved Occupancy",
        "Dynamic Shared Memory Per Block", "L2 Hit Rate", "Warp Cycles Per Issued Instruction", "Elapsed Cycles"]
groups = collections.defaultdict(list)
for k, m in by.items():
    groups[names[k]].append(m)
def num(v):
    try: return float(str(v).replace(",", ""))
    except ValueError: return None
for (name, grid, block), ms in sorted(groups.items(), key=lambda g: -len(g[1])):
    out = []
    for w in want:
        vals = [num(m.get(w)) for m in ms if num(m.get(w)) is not None]
        if vals: out.append(f"{w.split()[0][:8]}={statistics.median(vals):g}")
    print(f"{len(ms):4d}x {name:60s} g={grid} b={block} " + " ".join(out))
