"""Pictures of the committed benchmark results (PNG, matplotlib, no GPU needed).

    python tools/plots.py [--out DIR] [--results DIR]

Reads benchmarks/results/*-h100.json (or --results DIR) and writes into docs/assets/ (or --out):

    kernels-vs-torch-h100.png  every tilekernels op against torch: speedup and roofline fraction
    gpt-decode-h100.png        gpt2 / gpt2-medium decode tokens/s by batch, ours vs transformers
    glm_asr-rtf-h100.png       GLM-ASR real-time factor by batch and checkpoint precision
    gpt-grid-h100.png          our end-to-end speed over transformers: model x batch x prompt length

Each picture names the GPU and the date of its data (the JSON's "date", else the file's last
commit date, else its modification date) and stays under 150 KB. A missing input file skips its
picture with a note (gpt-grid-h100.json comes from `bench_gpt.py --grid`); exit code 1 only when
a picture fails or outgrows the limit.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ASSETS = ROOT / "docs" / "assets"
MAX_BYTES = 150 * 1024
DPI = 90
OURS, HF, HF_FAST = "#1f6fb4", "#d9822b", "#f2c48d"     # ours, transformers eager, transformers compiled


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
    # a 256-colour palette (no dithering): the same picture at a third of the bytes
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
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


# ----------------------------------------------------------------------------- (b) gpt decode
def short_sampling(label: str) -> str:
    return label.replace(" (gpt.generate's default)", "\n(the CLI's default)").replace(", penalty", ",\npenalty")


def plot_gpt_decode(results: Path, out: Path):
    found = load(results, "gpt-h100.json")
    if found is None:
        return None
    data, path = found
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in data["rows"] if r.get("phase") == "decode" and "ours_tok_s" in r and "transformers_tok_s" in r]
    models = list(dict.fromkeys(r["model"] for r in rows))
    samplings = list(dict.fromkeys(r["sampling"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    cell = defaultdict(dict)        # (model, sampling, batch) -> {series: tok/s}
    for r in rows:
        c = cell[r["model"], r["sampling"], r["batch"]]
        mode = r.get("transformers_mode", "eager")
        if mode == "eager":
            c["ours"], c["eager"] = r["ours_tok_s"], r["transformers_tok_s"]
        else:
            c["fast"], c["fast_label"] = r["transformers_tok_s"], f"transformers, {mode}"
    fast_label = next((c["fast_label"] for c in cell.values() if "fast" in c), None)
    fig, axes = plt.subplots(len(models), len(samplings), figsize=(3.4 * len(samplings), 0.6 + 2.75 * len(models)),
                             sharey=True, squeeze=False)
    top = max(v for c in cell.values() for k, v in c.items() if k != "fast_label")
    low = min(v for c in cell.values() for k, v in c.items() if k != "fast_label")
    x = np.arange(len(batches))
    for i, m in enumerate(models):
        for j, s in enumerate(samplings):
            ax = axes[i, j]
            series = [("ours", "ours (tilekernels)", OURS), ("eager", "transformers eager", HF)]
            if any("fast" in cell[m, s, bt] for bt in batches):
                series.append(("fast", fast_label, HF_FAST))
            w = 0.8 / len(series)
            for k, (key, label, color) in enumerate(series):
                vals = [cell[m, s, bt].get(key, np.nan) for bt in batches]
                xs = x - 0.4 + w * (k + 0.5)
                ax.bar(xs, vals, w * 0.92, color=color, label=label, zorder=2)
                for xi, v, bt in zip(xs, vals, batches):
                    if np.isnan(v):
                        continue
                    text = fmt_rate(v)
                    if key == "ours" and cell[m, s, bt].get("eager"):
                        text += f"\n{v / cell[m, s, bt]['eager']:.0f}x"
                    ax.text(xi, v * 1.12, text, ha="center", va="bottom", fontsize=6.5,
                            fontweight="bold" if key == "ours" else None)
            ax.set_yscale("log")
            ax.set_ylim(low / 2, top * 8)
            ax.set_xticks(x, [f"batch {bt}" for bt in batches], fontsize=8)
            ax.tick_params(axis="y", labelsize=7)
            ax.grid(axis="y", color="0.88", lw=0.5, zorder=0)
            if i == 0:
                ax.set_title(short_sampling(s), fontsize=8.5)
            if j == 0:
                ax.set_ylabel(f"{m}\ndecode tokens/s (log)", fontsize=8.5)
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(handles.values(), handles.keys(), loc="upper right", fontsize=7.5, ncol=len(handles),
               frameon=False, bbox_to_anchor=(0.99, 0.965))
    steps = rows[0].get("tokens", "")
    fig.suptitle(f"GPT-2 decode throughput, ours vs transformers ({steps} steps after a 32-token prompt)",
                 fontsize=10.5, x=0.01, ha="left", y=0.995)
    fig.subplots_adjust(left=0.08, right=0.99, top=0.86, bottom=0.1, hspace=0.3, wspace=0.06)
    source_note(fig, data, path, "Random fp32 weights, TF32 allowed; figures above bars: tok/s and ours over "
                "transformers eager")
    return save(fig, out, "gpt-decode-h100.png")


# ----------------------------------------------------------------------------- (c) GLM-ASR
GLM_FILES = ("glm_asr-h100.json", "glm_asr-fp32-h100.json")
PRECISION = {"bf16": "bfloat16 checkpoint", "fp32": "float32 checkpoint"}


def plot_glm_asr(results: Path, out: Path):
    found = [f for f in (load(results, n) for n in GLM_FILES) if f is not None]
    if not found:
        return None
    import matplotlib.pyplot as plt
    import numpy as np

    rtf = {}        # (precision, batch, audio_s) -> (ours, transformers or None)
    for data, _ in found:
        prec = PRECISION.get(data.get("checkpoint_dtype"), str(data.get("checkpoint_dtype", "?")))
        for r in data["rows"]:
            if r.get("stage") == "total" and "ours_real_time_factor" in r:
                rtf[prec, r.get("batch", 1), r["audio_s"]] = (r["ours_real_time_factor"],
                                                              r.get("transformers_real_time_factor"))
    precisions = list(dict.fromkeys(k[0] for k in rtf))
    batches = sorted({k[1] for k in rtf})
    lengths = sorted({k[2] for k in rtf})
    clip = 30 if 30 in lengths else max(lengths, key=lambda n: sum(k[2] == n for k in rtf))
    first = precisions[0]                       # the first file's precision: the published bfloat16
    by_length = sorted({n for p, b, n in rtf if p == first and b == 1})
    two = len(by_length) > 1
    fig, axes = plt.subplots(1, 2 if two else 1, figsize=(10 if two else 7, 4.5), squeeze=False)
    palette = [(OURS, HF), ("#8db9e0", HF_FAST), ("#0b3d66", "#8a4b10")]
    color = {}
    for i, p in enumerate(precisions):
        color[f"ours, {p}"], color[f"transformers, {p}"] = palette[i % len(palette)]

    def bars(ax, groups, key, names):
        """groups: x categories; key(group, precision) -> rtf's key; each group's present
        bars centred on it."""
        x = np.arange(len(groups))
        for xi, g in zip(x, groups):
            vals = []
            for p in precisions:
                ours, hf = rtf.get(key(g, p), (None, None))
                vals.append((f"ours, {p}", ours))
                vals.append((f"transformers, {p}", hf))
            vals = sorted([(lab, v) for lab, v in vals if v], key=lambda t: not t[0].startswith("ours"))
            w = min(0.8 / max(len(vals), 1), 0.3)
            crowded = len(vals) * len(groups) > 8      # labels on their side where bars are narrow
            for k, (label, v) in enumerate(vals):
                xb = xi + w * (k - (len(vals) - 1) / 2)
                ax.bar(xb, v, w * 0.9, color=color[label], label=label, zorder=2)
                ax.text(xb, v * 1.1, f"{v:.4f} ({1 / v:.0f}x RT)" if crowded else f"{v:.4f}\n{1 / v:.0f}x RT",
                        ha="center", va="bottom", fontsize=6.5, rotation=90 if crowded else 0)
        ax.set_xticks(x, names, fontsize=8)
        ax.set_xlim(-0.6, len(groups) - 0.4)
        ax.set_yscale("log")
        ax.grid(axis="y", color="0.88", lw=0.5, zorder=0)
        ax.tick_params(axis="y", labelsize=7)

    ax = axes[0, 0]
    bars(ax, batches, lambda bt, p: (p, bt, clip), [f"batch {bt}" for bt in batches])
    ax.set_title(f"by batch and checkpoint precision, {clip:g} s clip", fontsize=9)
    ax.set_ylabel("real-time factor: processing time / audio time\n(log; lower is better)", fontsize=8)
    if two:
        bars(axes[0, 1], by_length, lambda n, p: (p, 1, n) if p == first else None, [f"{n:g} s" for n in by_length])
        axes[0, 1].set_title(f"by clip length, {first}, batch 1", fontsize=9)
    lo = min(v for pair in rtf.values() for v in pair if v)
    hi = max(v for pair in rtf.values() for v in pair if v)
    for a in axes.flat:
        a.set_ylim(lo / 2.5, hi * 12)
    handles = {}
    for a in axes.flat:
        for h, lab in zip(*a.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    order = sorted(handles, key=lambda lab: (not lab.startswith("ours"), lab))
    fig.legend([handles[k] for k in order], order, fontsize=7.5, loc="upper right", ncol=len(order),
               frameon=False, bbox_to_anchor=(0.99, 0.935))
    fig.suptitle("GLM-ASR-Nano end to end (features, encoder, prefill, 64 decoded tokens a 30 s window), "
                 "ours vs transformers eager", fontsize=10, x=0.01, ha="left", y=0.99)
    fig.subplots_adjust(left=0.09, right=0.99, top=0.82, bottom=0.16, wspace=0.18)
    (data, path), more = found[0], found[1:]
    source_note(fig, data, path, "Random weights at full size, fp32 arithmetic; 'NNx RT': times faster than "
                "real time", more)
    return save(fig, out, "glm_asr-rtf-h100.png")


# ----------------------------------------------------------------------------- (d) gpt grid
def plot_gpt_grid(results: Path, out: Path):
    found = load(results, "gpt-grid-h100.json")
    if found is None:
        return None
    data, path = found
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    rows = [r for r in data["rows"] if (r.get("speedup") or 0) > 0]
    if not rows:
        raise ValueError(f"{path.name} has no rows with a speedup")
    models = list(dict.fromkeys(r["model"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    prompts = sorted({r["prompt"] for r in rows})
    by = {(r["model"], r["batch"], r["prompt"]): r for r in rows}
    speed = np.array([r["speedup"] for r in rows])
    norm = LogNorm(vmin=max(min(speed.min(), 1) * 0.9, 1e-3), vmax=max(speed.max(), 1.5) * 1.1)
    fig, axes = plt.subplots(1, len(prompts), figsize=(1.6 + 3.0 * len(prompts), 1.9 + 0.55 * len(models)),
                             squeeze=False, sharey=True)
    fig.subplots_adjust(left=0.09, right=0.91, top=0.8, bottom=0.25, wspace=0.08)
    image = None
    for ax, t in zip(axes[0], prompts):
        grid = np.full((len(models), len(batches)), np.nan)
        for i, m in enumerate(models):
            for j, bt in enumerate(batches):
                if (m, bt, t) in by:
                    grid[i, j] = by[m, bt, t]["speedup"]
        image = ax.imshow(np.ma.masked_invalid(grid), cmap="viridis", norm=norm, aspect="auto")
        for i, m in enumerate(models):
            for j, bt in enumerate(batches):
                r = by.get((m, bt, t))
                if r is None:
                    ax.text(j, i, "-", ha="center", va="center", fontsize=8)
                    continue
                dark = norm(r["speedup"]) < 0.6
                ax.text(j, i, f"{r['speedup']:.1f}x\n{fmt_rate(r['ours_tok_s'])} tok/s", ha="center", va="center",
                        fontsize=7, color="white" if dark else "black")
        ax.set_xticks(range(len(batches)), [str(b) for b in batches], fontsize=8)
        ax.set_yticks(range(len(models)), models, fontsize=8)
        ax.set_xlabel("batch", fontsize=8)
        ax.set_title(f"prompt {t} tokens", fontsize=9)
    from matplotlib.ticker import FixedLocator, NullLocator

    cbar = fig.colorbar(image, cax=fig.add_axes([0.925, 0.25, 0.012, 0.55]))
    ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200) if norm.vmin <= t <= norm.vmax]
    cbar.ax.yaxis.set_major_locator(FixedLocator(ticks))
    cbar.ax.yaxis.set_minor_locator(NullLocator())
    cbar.ax.set_yticklabels([f"{t}x" for t in ticks])
    cbar.set_label("ours / transformers (log)", fontsize=8)
    cbar.ax.tick_params(labelsize=7)
    new = data.get("new_tokens", rows[0].get("new_tokens", ""))
    fig.suptitle(f"Our end-to-end speed over transformers eager: prefill + {new} greedy tokens "
                 f"(cell: speedup, our tokens/s)", fontsize=10, x=0.01, ha="left")
    source_note(fig, data, path, "Random fp32 weights, TF32 allowed; tokens/s = batch x new tokens / wall time")
    return save(fig, out, "gpt-grid-h100.png")


PLOTS = {"kernels-vs-torch-h100.png": (plot_kernels, "kernels-h100.json"),
         "gpt-decode-h100.png": (plot_gpt_decode, "gpt-h100.json"),
         "glm_asr-rtf-h100.png": (plot_glm_asr, " or ".join(GLM_FILES)),
         "gpt-grid-h100.png": (plot_gpt_grid, "gpt-grid-h100.json (measure it: python3 tools/bench_gpt.py --grid)")}


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
