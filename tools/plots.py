"""Pictures of the committed benchmark results (PNG, matplotlib, no GPU needed).

    python tools/plots.py [--out DIR] [--results DIR]

Reads benchmarks/results/*-h100.json (or --results DIR) and writes into docs/assets/ (or --out):

    kernels-vs-torch-h100.png  every tilekernels op against torch: speedup and roofline fraction
    gpt-batch-h100.png         gpt2 tokens/s on the engine by batch and load, beside transformers
    glm-asr-bulk-h100.png      GLM-ASR real-time factor by batch and precision, beside transformers

Each picture names the GPU and the date of its data (the JSON's "date", else the file's last
commit date, else its modification date) and stays under 150 KB. A missing input file skips its
picture with a note; exit code 1 only when
a picture fails or outgrows the limit.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ASSETS = ROOT / "docs" / "assets"
MAX_BYTES = 150 * 1024
DPI = 90
OURS, HF = "#1f6fb4", "#d9822b"     # ours, transformers


# ----------------------------------------------------------------------------- shared pieces
def load(results: Path, name: str):
    """(data, path) of results/name, or None when the file is absent."""
    path = results / name
    if not path.exists():
        return None
    return json.loads(path.read_text()), path


def measured_on(data: dict, path: Path) -> str:
    """The date of a result: its own 'date' field, else the last commit of the file when the
    working copy equals it, else the file's modification date."""
    if data.get("date"):
        return str(data["date"])
    try:
        def git(*cmd):
            return subprocess.run(["git", *cmd], cwd=path.parent, capture_output=True, text=True,
                                  check=True, timeout=30).stdout.strip()
        if not git("status", "--porcelain", "--", path.name):
            committed = git("log", "-1", "--format=%cs", "--", path.name)
            if committed:
                return committed
    except (OSError, subprocess.SubprocessError):
        pass
    return datetime.date.fromtimestamp(path.stat().st_mtime).isoformat()


def source_note(fig, data: dict, path: Path, extra: str = "", more: list | None = None) -> None:
    """The footnote every picture carries: GPU, date, file (and what else the reader needs);
    more: further (data, path) pairs drawn in the same picture, each named with its date."""
    v = data.get("versions", {})
    soft = ", ".join(f"{k.replace('_', '-')} {v[k].split('+')[0]}" for k in ("cuda_tile", "torch", "transformers")
                     if isinstance(v.get(k), str))
    text = f"{data.get('gpu', 'GPU not recorded')}, measured {measured_on(data, path)}"
    text += f" ({soft})" if soft else ""
    text += f"; data: benchmarks/results/{path.name}"
    for d, p in more or []:
        gpu = "" if d.get("gpu") == data.get("gpu") else f", {d.get('gpu', 'GPU not recorded')}"
        text += f", {p.name} (measured {measured_on(d, p)}{gpu})"
    text += f". {extra}" if extra else ""
    fig.text(0.01, 0.005, text, fontsize=7, color="0.35", ha="left", va="bottom", wrap=True)


def save(fig, out: Path, name: str) -> Path:
    import matplotlib.pyplot as plt

    from PIL import Image

    path = out / name
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    # a 16-colour palette (no dithering): flat bars and grey text need no more (32 colours were 5 KB,
    # 256 were 26 KB larger for the two pictures; the tree travels to the GPU host in a few MB)
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(16, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(path, optimize=True)
    return path


def fmt_rate(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 10_000 else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


# ----------------------------------------------------------------------------- (a) kernels
def plot_kernels(results: Path, out: Path):
    found = load(results, "kernels-h100.json")
    if found is None:
        return None
    data, path = found
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in data["rows"] if r.get("ours_ms") and r.get("torch_ms")]
    labels = [f"{r['op']}  {r['shape']}" for r in rows]
    speed = np.array([r["torch_ms"] / r["ours_ms"] for r in rows])
    roof = np.array([r.get("fraction_of_roofline", np.nan) for r in rows])
    y = np.arange(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 1.6 + 0.155 * len(rows)), sharey=True,
                               gridspec_kw={"width_ratios": [1.25, 1], "wspace": 0.04})
    ops = [r["op"] for r in rows]
    for ax in (a, b):               # shade every other op's rows
        k, start = 0, 0
        for i in range(1, len(ops) + 1):
            if i == len(ops) or ops[i] != ops[start]:
                if k % 2:
                    ax.axhspan(start - 0.5, i - 0.5, color="0.93", zorder=0)
                k, start = k + 1, i
    a.barh(y, speed, color=[OURS if s >= 1 else "#c0504d" for s in speed], height=0.72, zorder=2)
    a.axvline(1, color="0.2", lw=0.8, zorder=3)
    a.set_xscale("log")
    lo, hi = min(speed.min(), 0.5) / 1.3, max(speed.max(), 2) * 2.2
    a.set_xlim(lo, hi)
    for yi, s in zip(y, speed):
        a.text(s * 1.06, yi, f"{s:.2f}x", va="center", fontsize=6, zorder=4)
    a.set_xlabel("speedup over torch (device time, CUDA-graph replays; >1: ours faster)", fontsize=8)
    colors = {"memory": "#4c9a2a", "compute": "#7b4fa0"}
    b.barh(y, roof, color=[colors.get(r.get("bound"), "0.5") for r in rows], height=0.72, zorder=2)
    b.axvline(1, color="0.2", lw=0.8, zorder=3)
    b.set_xlim(0, max(1.2, np.nanmax(roof) * 1.08))
    b.set_xlabel("fraction of the measured roofline (ours)", fontsize=8)
    b.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()],
             labels=[f"{k}-bound" for k in colors], fontsize=7, loc="lower right", framealpha=0.9)
    a.set_yticks(y, labels, fontsize=6.5)
    a.invert_yaxis()
    a.set_ylim(len(rows) - 0.5, -0.5)
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", color="0.85", lw=0.5, zorder=1)
    fig.suptitle("tilekernels ops vs torch at the models' shapes", fontsize=11, y=0.995)
    extra = ""
    if data.get("copy_GBps") and data.get("torch_tf32_TFLOPs"):
        extra = f"Roofline: {data['copy_GBps']:,.0f} GB/s copy, {data['torch_tf32_TFLOPs']:.0f} TFLOP/s torch TF32"
    fig.subplots_adjust(left=0.31, right=0.985, top=1 - 0.45 / fig.get_figheight(),
                        bottom=0.75 / fig.get_figheight())
    source_note(fig, data, path, extra)
    return save(fig, out, "kernels-vs-torch-h100.png")


# ----------------------------------------------------------------------------- (b), (c) the models end to end
def bars(data: dict, path: Path, out: Path, name: str, rows: list[dict], values: list[float], unit: str,
         xlabel: str, title: str, note: str) -> Path:
    """One horizontal bar a row (ours blue, transformers orange) on a log axis, each labelled
    '<system>, <precision>: <work>, batch <n>' and its value."""
    import matplotlib.pyplot as plt

    labels = [f"{r['system']}, {r['precision']}: {r['work']}, "
              + (f"batch {r['batch']}" if isinstance(r["batch"], int) else str(r["batch"])) for r in rows]
    fig, ax = plt.subplots(figsize=(10, 1.3 + 0.32 * len(rows)))
    y = range(len(rows))
    ax.barh(y, values, height=0.7, zorder=2,
            color=[OURS if r["system"] == "tile-inference" else HF for r in rows])
    for yi, v in zip(y, values):
        ax.text(v * 1.06, yi, f"{fmt_rate(v)}{unit}", va="center", fontsize=7)
    ax.set_xscale("log")
    ax.set_xlim(min(values) / 1.5, max(values) * 3)
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.invert_yaxis()
    ax.grid(axis="x", color="0.85", lw=0.5, zorder=1)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel(xlabel, fontsize=8)
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.subplots_adjust(left=0.5, right=0.98, top=1 - 0.45 / fig.get_figheight(), bottom=0.75 / fig.get_figheight())
    source_note(fig, data, path, note)
    return save(fig, out, name)


def plot_gpt_batch(results: Path, out: Path):
    found = load(results, "gpt-batch-h100.json")
    if found is None:
        return None
    data, path = found
    rows = [r for r in data["rows"] if r.get("tokens_per_s")]
    if not rows:
        raise ValueError(f"{path.name} has no rows with tokens_per_s")
    return bars(data, path, out, "gpt-batch-h100.png", rows, [r["tokens_per_s"] for r in rows], " tok/s",
                "tokens/s end to end (prefill + new tokens; log)",
                "gpt2 (124M) on the continuous-batching engine against transformers eager", "Random weights")


def plot_glm_asr_bulk(results: Path, out: Path):
    found = load(results, "glm-asr-bulk-h100.json")
    if found is None:
        return None
    data, path = found
    rows = [r for r in data["rows"] if r.get("realtime_factor") or "clip" in r.get("work", "")]
    if not rows:
        raise ValueError(f"{path.name} has no rows with realtime_factor")
    rows = [r if r.get("realtime_factor") else {**r, "realtime_factor": 30_000 / r["latency_ms"],
                                                  "work": f"{r['work']} (30 s / its latency)"} for r in rows]
    rows = [{**r, "work": f"{r['work']}, {r['new_tokens']} tokens, vad {r['vad']}"} for r in rows]
    return bars(data, path, out, "glm-asr-bulk-h100.png", rows, [r["realtime_factor"] for r in rows], "x",
                "real-time factor: seconds of audio a second, end to end (log)",
                "GLM-ASR-Nano through the pipeline against transformers eager, by batch and precision",
                "Random weights")


PLOTS = {"kernels-vs-torch-h100.png": (plot_kernels, "kernels-h100.json"),
         "gpt-batch-h100.png": (plot_gpt_batch, "gpt-batch-h100.json (measure it: python3 tools/bench_gpt.py)"),
         "glm-asr-bulk-h100.png": (plot_glm_asr_bulk,
                                   "glm-asr-bulk-h100.json (measure it: python3 tools/bench_glm_asr.py)")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ASSETS, help="folder for the PNGs (default docs/assets)")
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of the JSON (default benchmarks/results)")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    args.out.mkdir(parents=True, exist_ok=True)
    failed = False
    for name, (plot, source) in PLOTS.items():
        try:
            path = plot(args.results, args.out)
        except Exception as e:  # noqa: BLE001 - one bad file must not hide the other pictures
            print(f"error: {name}: {type(e).__name__}: {e}", file=sys.stderr)
            failed = True
            continue
        if path is None:
            print(f"skipped {name}: no {source} in {args.results}")
            continue
        size = path.stat().st_size
        print(f"wrote {path} ({size / 1024:.0f} KB)")
        if size > MAX_BYTES:
            print(f"error: {path} is {size / 1024:.0f} KB, over the {MAX_BYTES // 1024} KB limit", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
