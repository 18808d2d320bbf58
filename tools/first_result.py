"""The first result fast: what a user meets, each figure a fresh process (first-result-<gpu>.json).

    python3 tools/first_result.py [--out DIR] [--work DIR] [--record] [--cases a,b,...]

Inputs (made once into --work): GLM-ASR-Nano and gpt2 checkpoints of seeded random weights in the
hub layout (bfloat16 / float32 safetensors), FLAC files of 1 s, 30 s, 60 and 75 minutes and a
60-minute m4a (AAC). --record first writes the models' kernel manifests (tilekernels.cubins:
packages/*/src/*/kernels/), each model in a process of its own running what it launches.

Every command runs as a user's would, with Python writing bytecode (a host's PYTHONDONTWRITEBYTECODE
is dropped for it: rows say whether the host set it).

Cases (figure key in brackets; every row carries the run's stages, runtime.profile):
- transcribe_first_run / transcribe_again [wall_s]: `python -m glm_asr.transcribe clip30.flac`
  (vad silero) with every compile cache emptied first (cuTile's, CuPy's and tilekernels') / again. Each
  case starts once no kernel build worker runs on the host; a command's row says how long the
  workers it started went on after it exited (builds_after_exit_s: the rest of its manifest).
- generate_first_run / generate_again [wall_s]: `python -m gpt.generate` on gpt2, 128 tokens.
- prebuild [wall_s]: `python -m tilekernels.prebuild glm_asr gpt` (the install step that builds
  both models' kernels, then runs glm_asr.warmup) with every compile cache emptied first; transcribe_after_prebuild /
  generate_after_prebuild [wall_s]: the commands' first runs after it (a case after prebuild).
- long_file_60min, long_file_60min_vad, long_file_60min_m4a [realtime_factor]: one 60-minute file
  after load, 64 tokens a window, eos ignored; the first pass after load and the best of two more.
- gpt2_batch1 [tokens_per_s]: gpt.load(...).generate, greedy, 128 tokens, bf16 (median of 5).
- clip_30s [latency_ms]: one 30 s file, 64 tokens, vad none, after load (median of 5).
- compiles_after_startup [count]: kernels compiled after the first file started in a mixed run
  (1 s to 75 minutes, vad silero and none, 1 to 64 files at once).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, gpu_name, served_checkpoint, versions, write_result  # noqa: E402

CASES = ["transcribe_first_run", "transcribe_again", "generate_first_run", "generate_again", "prebuild",
         "transcribe_after_prebuild", "generate_after_prebuild", "long_file_60min", "long_file_60min_vad",
         "long_file_60min_m4a", "gpt2_batch1", "clip_30s", "compiles_after_startup"]
LONG = ("long_file_60min", "compiles_after_startup")        # the cases (or --record) that need the long files


def make_inputs(work: Path, long: bool = True) -> None:
    import numpy as np
    import soundfile as sf

    sys.path.insert(0, str(ROOT / "tests" / "asr"))
    from media import encode

    from benchlib import speech_dense

    for kind in ("asr", "gpt"):
        if not (work / kind / "config.json").exists():
            (work / kind).mkdir(parents=True, exist_ok=True)
            served_checkpoint(kind, work / kind)
    minute = speech_dense(60.0)
    for name, seconds in (("clip1", 1), ("clip30", 30), ("min60", 3600), ("min75", 4500))[:None if long else 2]:
        if not (work / f"{name}.flac").exists():
            x = minute[:16000 * seconds] if seconds <= 60 else np.tile(minute, seconds // 60)
            sf.write(work / f"{name}.flac", x, 16000)
    try:
        if long and not (work / "min60.m4a").exists():
            encode(work / "min60.m4a", [("aac", np.tile(minute, 60))])
    except ImportError:
        print("no PyAV here: the m4a case is skipped", file=sys.stderr)


def cupy_cache() -> Path:
    """Where CuPy keeps the kernels it compiles (its own: elementwise, reductions)."""
    return Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")


def cupy_kernels() -> int:
    """Kernels in CuPy's cache (its source files, saved with CUPY_CACHE_SAVE_CUDA_SOURCE, not counted)."""
    return sum(f.suffix != ".cu" for f in cupy_cache().iterdir()) if cupy_cache().is_dir() else 0


def clear_caches() -> None:
    """Every compile cache this user has: tilekernels' cubins, cuTile's and CuPy's own."""
    from tilekernels.cubins import cache_dir

    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    for d in (cache_dir(), home / "cutile-python", cupy_cache()):
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)


def parse_profile(text: str) -> dict:
    """runtime.profile.report's lines back into numbers."""
    out = {"stages": {}, "marks": {}}
    for line in text.splitlines():
        if m := re.match(r"^  (.+?)\s+at\s+([\d.]+) s$", line):
            out["marks"][m[1]] = float(m[2])
        elif m := re.match(r"^  (.+?)\s+([\d.]+) s  \((\d+)x\)$", line):
            out["stages"][m[1]] = {"seconds": float(m[2]), "count": int(m[3])}
        elif line.startswith("  kernels:"):
            n = [float(v) for v in re.findall(r"[\d.]+", line)]
            out["kernels"] = dict(zip(("built", "build_s", "loaded", "prebuilt", "wait_s", "start_s"), n))
        elif m := re.match(r"^profile: ([\d.]+) s", line):
            out["process_s"] = float(m[1])
    return out


def background_builds(timeout: float = 600.0) -> float:
    """Wait until no kernel build worker (tilekernels.cubins.Prebuild) runs on this host, as a new
    machine would be; the seconds waited (what the workers of the run before went on for)."""
    began = time.perf_counter()
    while time.perf_counter() - began < timeout:
        p = subprocess.run(["pgrep", "-f", "tilekernels.cubins import work"], capture_output=True)
        if p.returncode:
            break
        time.sleep(0.1)
    return round(time.perf_counter() - began, 2)


def cli(args: list[str], work: Path) -> dict:
    background_builds()
    cupy_before = cupy_kernels()
    wall, p = command([sys.executable, "-m", *args, "profile=true"], work)
    # the workers build the rest of the model's kernels on after the command has exited
    return {"wall_s": wall, **parse_profile(p.stderr), "cupy_kernels_compiled": cupy_kernels() - cupy_before,
            "host_set_dont_write_bytecode": "PYTHONDONTWRITEBYTECODE" in os.environ,
            "builds_after_exit_s": background_builds()}


def user_env() -> dict:
    """The environment a command runs in: this one, but Python writing bytecode as a user's does
    (a host that sets PYTHONDONTWRITEBYTECODE would have every run compile the sources again)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def command(args: list[str], work: Path) -> tuple[float, subprocess.CompletedProcess]:
    """Run a command in `work`; its wall seconds and what it printed."""
    began = time.perf_counter()
    p = subprocess.run(args, cwd=work, capture_output=True, text=True, env=user_env())
    wall = time.perf_counter() - began
    if p.returncode:
        raise RuntimeError(f"{' '.join(args[1:3])} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return round(wall, 3), p


def in_process(case: str, work: Path, **kw) -> dict:
    """Run one case in a fresh process of this script; its row."""
    background_builds()
    p = subprocess.run([sys.executable, __file__, "--case", case, "--work", str(work), "--kw", json.dumps(kw)],
                       capture_output=True, text=True, env=user_env())
    rows = [json.loads(line[4:]) for line in p.stdout.splitlines() if line.startswith("ROW ")]
    if p.returncode or not rows:
        raise RuntimeError(f"{case} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return rows[0]


def sync() -> None:
    import cupy

    cupy.cuda.get_current_stream().synchronize()


def run_case(case: str, work: Path, kw: dict) -> dict:
    """The body of an in-process case (in its own process)."""
    from tilekernels import cubins
    from tilekernels.runtime import profile

    if case.startswith("record-"):
        return record(case[len("record-"):], work)
    if case == "gpt2_batch1":
        import gpt

        lm = gpt.load(str(work / "gpt"), device="gpu")
        settings = dict(max_new_tokens=128, temperature=0.0)
        began = time.perf_counter()
        first = lm.generate(["Hello"], **settings)[0]
        first_s = time.perf_counter() - began
        walls = []
        for _ in range(5):
            began = time.perf_counter()
            out = lm.generate(["Hello"], **settings)[0]
            walls.append(time.perf_counter() - began)
        return {"tokens_per_s": round(len(out.tokens) / statistics.median(walls), 1), "tokens": len(out.tokens),
                "first_call_tokens_per_s": round(len(first.tokens) / first_s, 1), **profile.stages()}
    import glm_asr

    asr = glm_asr.load(str(work / "asr"), device="gpu")

    def timed(files: list, vad: str) -> float:
        began = time.perf_counter()
        for r in asr.transcribe_many(files, max_new_tokens=64, vad=vad, ignore_eos=True):
            assert r.error is None, r.error
        sync()
        return time.perf_counter() - began

    if case == "clip_30s":
        first = timed([work / "clip30.flac"], "none")
        walls = [timed([work / "clip30.flac"], "none") for _ in range(5)]
        return {"latency_ms": round(1e3 * statistics.median(walls), 1), "first_ms": round(1e3 * first, 1),
                **profile.stages()}
    if case == "long":
        path, vad = work / kw["file"], kw["vad"]
        first = timed([path], vad)
        best = min(timed([path], vad) for _ in range(2))
        return {"realtime_factor": round(3600 / best, 1), "first_realtime_factor": round(3600 / first, 1),
                "pass_s": round(best, 3), "first_pass_s": round(first, 3), "file": kw["file"], "vad": vad,
                **profile.stages()}
    if case == "compiles_after_startup":
        runs = [([work / "clip1.flac"], "none"), ([work / "clip1.flac"], "silero"), ([work / "clip30.flac"], "silero"),
                ([work / "clip30.flac"] * 7, "none"), ([work / "clip30.flac"] * 64, "none"),
                ([work / "clip30.flac"] * 64, "silero"), ([work / "min75.flac"], "none"),
                ([work / "min75.flac"], "silero"), ([work / "clip1.flac"] * 3 + [work / "clip30.flac"] * 5, "silero")]
        began, start, before = time.perf_counter(), dict(cubins.STATS), len(cubins.built())
        for files, vad in runs:
            timed(files, vad)
        return {"count": len(cubins.built()) - before, "compiled": cubins.built()[before:], "runs": len(runs),
                "runs_s": round(time.perf_counter() - began, 2),
                "kernels_loaded_after_startup": cubins.STATS["loaded"] - start["loaded"], **profile.stages()}
    raise ValueError(case)


def record(model: str, work: Path) -> dict:
    """Run what `model` launches (the CLI's run first, then every batch size, both decoders'
    samplers, scored steps and prompts, the encoder's groups, the VAD, prompts of many lengths)
    and write its kernel manifest, in the order of first launch (the order workers build it in)."""
    from tilekernels import cubins
    from tilekernels.runtime import Sampling, kernel_manifest, using, warm_up

    if model == "gpt":
        import gpt
        from gpt.model import KERNELS

        lm = gpt.load(str(work / "gpt"), device="gpu")
        lm.generate(["Hello"], max_new_tokens=128, temperature=0.0)     # what gpt.generate launches, first
        warm_up(lm.engine(), (Sampling(0.0), Sampling(0.8, 200, 0.9, 1.1), Sampling(1.0, 0, 1.0, 1.0)))
        for n, length in ((1, 1), (3, 7), (17, 100), (64, 30), (2, 700)):
            lm.generate([[464] * length] * n, max_new_tokens=8, seed=0)
        for n, length in ((1, 5), (4, 30), (16, 100)):     # scored steps and prompts (logprobs, echo)
            lm.generate([[464] * length] * n, max_new_tokens=8, seed=0, logprobs=5)
            lm.score([[464] * length] * n, top=5)
        lm.logits([[464] * 33])
        c = lm.model.config
        with using(lm.precision):           # the manifest of the precision the model was loaded at
            path = kernel_manifest(KERNELS, "gpu", c.n_embd, c.n_head, c.vocab_size)
    else:
        import glm_asr
        from glm_asr.api import PROMPT
        from glm_asr.model import KERNELS

        asr = glm_asr.load(str(work / "asr"), device="gpu")
        list(asr.transcribe_many([work / "clip30.flac"], vad="silero"))  # what glm_asr.transcribe launches, first
        asr.transcriber.warm_up(PROMPT)
        for files in ([work / "clip1.flac"], [work / "clip30.flac"] * 9, [work / "min60.flac"]):
            for vad in ("silero", "none"):
                list(asr.transcribe_many(files, max_new_tokens=16, vad=vad))
        e, d = asr.transcriber.model.config.encoder, asr.transcriber.model.config.decoder
        with using(asr.transcriber.engine.precision):
            path = kernel_manifest(KERNELS, "gpu", e.hidden_size, d.hidden_size, d.vocab_size)
    lines = cubins.launched()
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"# the kernels {model} launches ({path.stem}), written by tools/first_result.py --record\n"
                    + "".join(line + "\n" for line in lines))
    return {"manifest": str(path.relative_to(ROOT)), "lines": len(lines)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="result folder (default benchmarks/results)")
    ap.add_argument("--work", default="/tmp/first-result", help="checkpoints and audio (made once)")
    ap.add_argument("--record", action="store_true", help="write the kernel manifests first")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--kw", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = Path(args.work)
    if args.case:
        print("ROW " + json.dumps(run_case(args.case, work, json.loads(args.kw))), flush=True)
        return
    work.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    cases = args.cases.split(",")
    make_inputs(work, args.record or any(c.startswith(LONG) for c in cases))
    print(f"inputs ready in {time.perf_counter() - began:.0f} s", file=sys.stderr)
    if args.record:
        for model in ("gpt", "asr"):
            print(json.dumps(in_process(f"record-{model}", work)), file=sys.stderr)
    asr_cli = ["glm_asr.transcribe", "clip30.flac", f"model.path={work / 'asr'}"]
    gpt_cli = ["gpt.generate", f"model.path={work / 'gpt'}", "prompt=Hello", "max_new_tokens=128", "temperature=0"]
    long = {"long_file_60min": ("min60.flac", "none"), "long_file_60min_vad": ("min60.flac", "silero"),
            "long_file_60min_m4a": ("min60.m4a", "none")}
    rows = []
    for case in cases:
        if case.endswith("_first_run") or case == "prebuild":
            background_builds()
            clear_caches()
        if case.endswith("_after_prebuild") and "prebuild" not in [r["case"] for r in rows]:
            raise SystemExit(f"{case}: run the prebuild case before it")
        if case == "prebuild":
            wall, p = command([sys.executable, "-m", "tilekernels.prebuild", "glm_asr", "gpt"], work)
            row = {"wall_s": wall, "printed": p.stdout.strip(), "cupy_kernels_compiled": cupy_kernels()}
        elif case.startswith("transcribe_"):
            row = cli(asr_cli, work)
        elif case.startswith("generate_"):
            row = cli(gpt_cli, work)
        elif case in long and not (work / long[case][0]).exists():
            row = {"skipped": f"{long[case][0]} could not be made here (PyAV missing)"}
        elif case in long:
            row = in_process("long", work, file=long[case][0], vad=long[case][1])
        else:
            row = in_process(case, work)
        rows.append({"case": case, **row})
        print(json.dumps(rows[-1])[:400], file=sys.stderr, flush=True)
        write_result("first-result", {"gpu": gpu_name(), "versions": versions(), "cpu_cores": os.cpu_count(),
                                      "rows": rows}, args.out)


if __name__ == "__main__":
    main()
