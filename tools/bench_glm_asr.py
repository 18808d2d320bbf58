"""GLM-ASR bulk transcription and batch-1 latency on the engine, against transformers (GPU host).

    python tools/bench_glm_asr.py [--out DIR] [--files 64] [--precisions bf16,tf32] [--long-minutes 60]
                                  [--hf-batches 1,8,32] [--dense-files N]

Full-size GLM-ASR-Nano config with seeded random weights saved as the hub's checkpoint (bfloat16
values) and a word-level tokenizer carrying GLM-ASR's special tokens at their ids, loaded by
Transcriber.load as the CLI loads a checkpoint. Inputs are synthetic speech-like audio
(glm_asr.synthetic.speechlike), one seed a file. Every 30 s window generates exactly NEW tokens
(end-of-sequence ignored) on both sides, so both do the same work.

- bulk: --files files of 30 s (NEW, and for the first precision also 2 x NEW, tokens a window) through
  Transcriber.transcribe_many (the CLI's pipeline: reader
  threads, batched features, the encoder 8 windows at a time, every window a request of the
  engine, max_batch 64), wall time from the first file handed in to the last transcript back;
  a first pass compiles and captures, the median of the next 3 is reported (times real time =
  audio s / wall s; a single pass varied by a few percent from run to run).
- VAD (last, on the first precision's model): --dense-files speech-dense 29 s files
  (benchlib.speech_dense: the test fixtures' sentences) with vad none and silero (one window each
  either way), interleaved, medians of 3: the VAD's share.
- long: one file of --long-minutes, wall time (median of 3) and the GPU memory pool's peak.
- latency: one 30 s clip alone, median of 5.
- decoder step: the pipeline engine's decode step at batch 1 and 64 (prompts of a window's length
  joining in one prefill, 1 then 1 + 64 new tokens each; the difference over 64 steps), the
  median of STEP_RUNS, the two batches interleaved (a host drifts by ~1% from run to run).
- transformers 5 eager generate() at batch 1, 8 and 32 (bf16, and fp32 with TF32), the same
  windows, features from its WhisperFeatureExtractor.

--dask (alone; needs dask and distributed): the same checkpoint and --files 30 s FLAC files through
`python -m glm_asr.transcribe DIR` and `python -m glm_asr.bulk gpus=1` (and gpus=2 where two GPUs
are visible), each a subprocess with vad=none: the rate each reports after its model has loaded
(the CLI's closing line, bulk's "after it"), the steady rate of each from its outputs' mtimes,
whether the outputs are identical, and the scheduler's cost per task (10,000 no-op tasks, 2
worker processes); writes glm-asr-dask-<gpu>.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import cupy
import numpy as np

from benchlib import (glm_prompt_ids, gpu_name, markdown_table, random_glm_asr_checkpoint, speech_dense,
                      versions, word_tokenizer, write_result)
from glm_asr.synthetic import speechlike

NEW = 64
PASSES = 3          # timed passes a figure (their median), after a pass that compiles and captures
STEP_RUNS = 5       # measurements of the decoder step at each batch (their median)
OURS = {"system": "tile-inference", "model": "glm-asr-nano"}
WINDOW = 480000     # 30 s at 16 kHz
FIGURES = ("realtime_factor", "vad_added_pct", "latency_ms", "step_ms", "gpu_pool_peak_gb", "guard_cost")


def sync():
    import torch

    cupy.cuda.Device().synchronize()
    torch.cuda.synchronize()


def transcribe(asr, audios: list, vad=None, new: int = NEW, fallback=None) -> tuple[float, int]:
    """Wall seconds for the files through the pipeline (`new` tokens a window; fallback: the loop
    guard, which must keep every first attempt), and the windows transcribed."""
    from glm_asr.api import PROMPT

    sync()
    t = time.perf_counter()
    n = 0
    for name, segments, _ in asr.transcribe_many([(str(i), (lambda a=a: a)) for i, a in enumerate(audios)], PROMPT,
                                                 new, vad=vad, ignore_eos=True, fallback=fallback):
        assert not isinstance(segments, Exception), segments
        assert all(s["temperature"] == 0 for s in segments), "the guard decoded a window again"
        n += len(segments)
    sync()
    return time.perf_counter() - t, n


def decoder_step_ms(asr, batch: int, sampling=None) -> float:
    """ms of one decode step of the pipeline's engine at `batch` rows of a 30 s window's prompt
    length (the rows join in one prefill, as a batch of windows does), each measurement right
    after a warm-up of its own shape, as steps replay in a run (warmed once a shape instead,
    batch 1 read 1.698 ms on two H200s; 1.663-1.675 so on four others). sampling: the rows'
    (default: the pipeline's, greedy with each token scored)."""
    from glm_asr.pipeline import SCORED
    from tilekernels.runtime import generate

    sampling = sampling or SCORED

    m = asr.model
    ids = glm_prompt_ids(m.config, 375)
    x = m.prompt_embeds(ids, cupy.zeros((375, m.config.decoder.hidden_size), cupy.float32))

    def run(new: int) -> float:
        generate(asr.engine, [ids] * batch, new, sampling, embeds=[x] * batch, ignore_eos=True)   # warm: compiles
        sync()
        t = time.perf_counter()
        generate(asr.engine, [ids] * batch, new, sampling, embeds=[x] * batch, ignore_eos=True)
        sync()
        return time.perf_counter() - t
    return (run(1 + NEW) - run(1)) / NEW * 1e3


def timed(*args, **kw) -> tuple[float, dict, int]:
    """PASSES runs of transcribe(*args, **kw): the median wall, the row's wall_s and walls_s, and
    the windows of a run."""
    runs = [transcribe(*args, **kw) for _ in range(PASSES)]
    wall = statistics.median(w for w, _ in runs)
    return wall, {"wall_s": round(wall, 3), "walls_s": [round(w, 3) for w, _ in runs]}, runs[0][1]


def hf_bulk(hf, fe, audios: list, batch: int) -> float:
    """Wall seconds for transformers to transcribe the 30 s files `batch` windows a generate()."""
    import torch

    sync()
    t = time.perf_counter()
    for i in range(0, len(audios), batch):
        chunk = audios[i:i + batch]
        inputs = fe(chunk, sampling_rate=16000, return_tensors="pt", return_attention_mask=True)
        feats = inputs["input_features"].cuda().to(hf.dtype)
        mask = inputs["attention_mask"].cuda()
        frames = int(mask[0].sum())
        n_audio = ((frames - 1) // 2 + 1 - 4) // 4 + 1
        ids = torch.tensor([glm_prompt_ids(hf.config, n_audio)] * len(chunk), device="cuda")
        with torch.no_grad():
            out = hf.generate(input_ids=ids, input_features=feats, input_features_mask=mask, do_sample=False,
                              max_new_tokens=NEW, min_new_tokens=NEW)
        assert out.shape[1] - ids.shape[1] == NEW
    sync()
    return time.perf_counter() - t


def dask_vs_cli(files: int, out: str | None) -> None:
    """--dask: the bulk command on one Dask worker (and on two, when two GPUs are visible) against
    the CLI, the same files on the same GPUs."""
    import filecmp
    import re
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import soundfile

    from glm_asr.bulk import task_overhead, visible_gpus

    def command(args: list[str]) -> str:
        p = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{args[0]} exited with {p.returncode}: {p.stderr[-2000:]}")
        return p.stderr

    def steady(folder: str) -> float:
        """Times real time between the first quarter's outputs and the last one's (their mtimes):
        the rate once kernels are compiled and graphs captured, measured alike for every command."""
        t = sorted(os.stat(os.path.join(folder, n)).st_mtime for n in os.listdir(folder))
        q = len(t) // 4
        return round((len(t) - 1 - q) * 30.0 / (t[-1] - t[q]), 1)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, audio = Path(tmp) / "ckpt", Path(tmp) / "audio"
        audio.mkdir()
        hf = random_glm_asr_checkpoint(str(ckpt), "bf16")
        word_tokenizer(ckpt, hf.config)
        del hf
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: soundfile.write(audio / f"{i:04d}.flac", speechlike(30.0, seed=i), 16000),
                          range(files)))
        opts = [f"model.path={ckpt}", f"max_new_tokens={NEW}", "vad=none", "output_format=json"]
        command(["glm_asr.transcribe", str(audio), f"output_dir={tmp}/warm", *opts])   # fills the kernel cache
        cli = command(["glm_asr.transcribe", str(audio), f"output_dir={tmp}/cli", *opts])
        cli_x = float(re.search(r"([0-9.]+)x real time", cli).group(1))
        cli_steady = steady(f"{tmp}/cli")
        names = sorted(os.listdir(f"{tmp}/cli"))
        one = None
        for gpus in range(1, min(2, len(visible_gpus())) + 1):
            bulk = command(["glm_asr.bulk", f"manifest={audio}", f"output_dir={tmp}/bulk{gpus}", f"gpus={gpus}", *opts])
            bulk_x = float(re.search(r"([0-9.]+)x after it", bulk).group(1))
            _, differ, missing = filecmp.cmpfiles(f"{tmp}/cli", f"{tmp}/bulk{gpus}", names, shallow=False)
            row = {"work": f"{files} files x 30 s, vad none", "gpus": gpus, "cli_realtime_factor": cli_x,
                   "cli_steady_realtime_factor": cli_steady, "dask_realtime_factor": bulk_x,
                   "dask_steady_realtime_factor": steady(f"{tmp}/bulk{gpus}"),
                   "outputs_identical": len(names) == files and not differ and not missing,
                   "cli_line": cli.strip().splitlines()[-1], "bulk_line": bulk.strip().splitlines()[-1]}
            if gpus == 1:
                one = row
                row["dask_over_cli"] = round(bulk_x / cli_x, 3)
                row["dask_over_cli_steady"] = round(row["dask_steady_realtime_factor"] / cli_steady, 3)
            else:
                row["over_one_gpu"] = round(bulk_x / one["dask_realtime_factor"], 3)
                row["over_one_gpu_steady"] = round(row["dask_steady_realtime_factor"]
                                                   / one["dask_steady_realtime_factor"], 3)
            rows.append(row)
            print(row, flush=True)
    overhead = task_overhead(10_000, 2)
    print(overhead, flush=True)
    write_result("glm-asr-dask", {"gpu": gpu_name(), "gpus_visible": len(visible_gpus()), "versions": versions(),
                                  "new_tokens": NEW, "rows": rows, "task_overhead": overhead,
                                  "cpu_cores": os.cpu_count()}, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--files", type=int, default=64, help="30 s files of the bulk run")
    ap.add_argument("--precisions", default="bf16,tf32", help="our precisions to run, comma-separated")
    ap.add_argument("--long-minutes", type=float, default=60.0, help="the long file's minutes (0: skip)")
    ap.add_argument("--dense-files", type=int, help="speech-dense files of the VAD rows (default --files; 0: skip)")
    ap.add_argument("--hf-batches", default="1,8,32", help="transformers' batches (empty: skip)")
    ap.add_argument("--dask", action="store_true", help="only the bulk command on Dask against the CLI")
    args = ap.parse_args()
    if args.dask:
        return dask_vs_cli(args.files, args.out)
    import torch
    import transformers
    from transformers import WhisperFeatureExtractor

    from glm_asr.pipeline import Fallback, Transcriber
    from glm_asr.vad import VadOptions
    from tilekernels.runtime import GREEDY
    from tilekernels.runtime import set_precision

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    audios = [speechlike(30.0, seed=s) for s in range(args.files)]
    seconds = 30.0 * args.files
    rows = []

    def row(**kw):
        """Print a row and write the result file so far (a run cut short keeps its rows)."""
        rows.append(kw)
        print(kw, flush=True)
        md = f"GPU: {gpu_name()}; random weights, {NEW} tokens per 30 s window (eos ignored).\n\n" + markdown_table(
            ["system", "precision", "work", "batch", "figure"],
            [[r["system"], r.get("precision", ""), r["work"], r.get("batch", ""),
              ", ".join(f"{k} {r[k]}" for k in FIGURES if k in r)] for r in rows])
        write_result("glm-asr-bulk", {"gpu": gpu_name(), "versions": versions(), "new_tokens": NEW, "rows": rows},
                     args.out, md)

    with tempfile.TemporaryDirectory() as tmp:
        hf = random_glm_asr_checkpoint(tmp, "bf16")
        word_tokenizer(Path(tmp), hf.config)
        for precision in args.precisions.split(","):
            set_precision(precision)
            asr = Transcriber.load(Path(tmp), "gpu")
            transcribe(asr, audios[:8])                     # compiles, captures the small buckets
            cold, _ = transcribe(asr, audios)
            wall, walls, n = timed(asr, audios)
            assert n == args.files
            row(**OURS, precision=precision, work=f"{args.files} files x 30 s", batch=asr.engine.max_batch,
                new_tokens=NEW, vad="none", **walls, first_pass_s=round(cold, 3),
                realtime_factor=round(seconds / wall, 1))
            if precision == args.precisions.split(",")[0]:
                # the loop guard on with thresholds nothing reaches (random weights: their tokens are far
                # from any likely text), so every window is checked and none decoded again, passes
                # interleaved with the guard off
                guard = Fallback((0.0, 0.2, 0.4, 0.6, 0.8, 1.0), 1e9, None)
                transcribe(asr, audios, fallback=guard)
                pairs = [(transcribe(asr, audios)[0], transcribe(asr, audios, fallback=guard)[0])
                         for _ in range(PASSES)]
                off, on = (statistics.median(p[i] for p in pairs) for i in (0, 1))
                row(**OURS, precision=precision, work=f"{args.files} files x 30 s, loop guard on (none falls back)",
                    batch=asr.engine.max_batch, new_tokens=NEW, vad="none", wall_s=round(on, 3),
                    guard_off_wall_s=round(off, 3), guard_cost=round(on / off - 1, 4),
                    realtime_factor=round(seconds / on, 1))
                transcribe(asr, audios, new=2 * NEW)           # the longer decode: its graphs
                wall, walls, _ = timed(asr, audios, new=2 * NEW)
                row(**OURS, precision=precision, work=f"{args.files} files x 30 s", batch=asr.engine.max_batch,
                    new_tokens=2 * NEW, vad="none", **walls, realtime_factor=round(seconds / wall, 1))
                lat = []
                for _ in range(6):
                    lat.append(transcribe(asr, audios[:1])[0] * 1e3)
                row(**OURS, precision=precision, work="one 30 s clip", batch=1, new_tokens=NEW, vad="none",
                    latency_ms=round(statistics.median(lat[1:]), 1))
                steps = {(b, scored): [] for b in (1, 64) for scored in (True, False)}
                for _ in range(STEP_RUNS):
                    for (b, scored), ms in steps.items():
                        ms.append(decoder_step_ms(asr, b, None if scored else GREEDY))
                for (b, scored), ms in steps.items():
                    row(**OURS, precision=precision, batch=b, step_ms=round(statistics.median(ms), 3),
                        work="decoder step, 30 s window prompts" + ("" if scored else ", tokens not scored"),
                        steps_ms=[round(v, 3) for v in ms])
                if args.long_minutes > 0:
                    pool = cupy.get_default_memory_pool()
                    long = np.tile(np.concatenate(audios[:8]), int(np.ceil(args.long_minutes / 4)))
                    long = long[:int(args.long_minutes * 60 * 16000)]
                    wall, walls, n = timed(asr, [long])
                    row(**OURS, precision=precision, work=f"one {args.long_minutes:g}-minute file",
                        batch=asr.engine.max_batch, new_tokens=NEW, vad="none", **walls, windows=n,
                        realtime_factor=round(len(long) / 16000 / wall, 1),
                        gpu_pool_peak_gb=round(pool.total_bytes() / 1e9, 2))
                first = asr                 # the VAD rows run last (below), on this one
            del asr
            cupy.get_default_memory_pool().free_all_blocks()
        set_precision("bf16")
        fe = WhisperFeatureExtractor(feature_size=128)
        hf_audios = audios[:32]
        for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "tf32")):
            hf = hf.to(dtype)
            for b in [int(x) for x in args.hf_batches.split(",") if x]:
                work = hf_audios[:max(b, 2)]
                hf_bulk(hf, fe, work[:b], b)                  # warm-up
                wall = hf_bulk(hf, fe, work, b)
                row(system=f"transformers {transformers.__version__} eager", model="glm-asr-nano", precision=name,
                    work=f"{len(work)} files x 30 s", batch=b, new_tokens=NEW, vad="none", wall_s=round(wall, 3),
                    realtime_factor=round(30 * len(work) / wall, 1))
        n_dense = args.files if args.dense_files is None else args.dense_files
        if n_dense:
            set_precision(args.precisions.split(",")[0])
            dense = [speech_dense(seed=s) for s in range(n_dense)]
            transcribe(first, dense[:2], VadOptions())
            walls: dict = {"none": [], "silero": []}
            windows: dict = {}
            for _ in range(3):          # interleaved, medians: the VAD's share of the wall time
                for name, vad in (("none", None), ("silero", VadOptions())):
                    w, n_v = transcribe(first, dense, vad)
                    walls[name].append(w)
                    windows[name] = n_v
            for name in walls:
                w = statistics.median(walls[name])
                extra = {"vad_added_pct": round(100 * (w / statistics.median(walls["none"]) - 1), 1)} \
                    if name == "silero" else {}
                row(**OURS, precision=args.precisions.split(",")[0], work=f"{n_dense} speech-dense files x 29 s",
                    batch=first.engine.max_batch, new_tokens=NEW, vad=name, wall_s=round(w, 3), windows=windows[name],
                    realtime_factor=round(29.0 * n_dense / w, 1), **extra)


if __name__ == "__main__":
    main()
