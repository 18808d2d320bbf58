"""Silero VAD on the GPU (vad.device_probs) over 60 minutes of speech-dense audio, tilekernels
variants A/B (experiment): `vad_ab.py` builds /tmp/v_<name> copies of tilekernels with each patch
applied, then times every variant in fresh processes, interleaved twice, median of 3 calls after a
warm-up each, and compares each variant's probabilities with the shipped ones; JSON to argv[1]."""
import json, os, shutil, statistics, subprocess, sys, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = Path("packages/tilekernels/src/tilekernels")
VARIANTS = {"shipped": [], "lstm_loads_in_loop": ["lstm_loads_in_loop.patch"],
            "x3_tiles_128x64": ["x3_tiles_128x64.patch"],
            "both": ["lstm_loads_in_loop.patch", "x3_tiles_128x64.patch"]}


def build():
    for name, patches in VARIANTS.items():
        dest = Path(f"/tmp/v_{name}")
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(SRC, dest / "tilekernels")
        for p in patches:
            subprocess.run(["patch", "-p5", "-d", str(dest / "tilekernels"), "-i", str(HERE / p)], check=True)


def run():
    sys.path.insert(0, "tools")
    import cupy
    import numpy as np
    from benchlib import speech_dense
    from glm_asr.vad.model import device_probs
    import tilekernels
    x = cupy.asarray(np.tile(speech_dense(60.0), 60))
    device_probs([x[:16000 * 30]])
    device_probs([x])
    walls = []
    for _ in range(3):
        cupy.cuda.Device().synchronize()
        t = time.perf_counter()
        p = device_probs([x])[0]
        walls.append(time.perf_counter() - t)
    np.save(f"/tmp/vadp_{os.environ['VARIANT']}.npy", p)
    return {"seconds": round(statistics.median(walls), 4), "walls": [round(w, 4) for w in walls],
            "package": tilekernels.__file__}


if len(sys.argv) > 1 and sys.argv[1] == "run":
    print("ROW " + json.dumps(run()))
    sys.exit()
build()
rows = []
import numpy as np
for rnd in range(2):
    for name in VARIANTS:
        env = dict(os.environ, VARIANT=name, PYTHONPATH=f"/tmp/v_{name}:" + os.environ.get("PYTHONPATH", ""))
        p = subprocess.run([sys.executable, __file__, "run"], capture_output=True, text=True, env=env)
        got = [json.loads(l[4:]) for l in p.stdout.splitlines() if l.startswith("ROW ")]
        row = {"variant": name, "round": rnd, **(got[0] if got else {"error": p.stderr[-800:]})}
        if got and name != "shipped" and Path("/tmp/vadp_shipped.npy").exists():
            a, b = np.load("/tmp/vadp_shipped.npy"), np.load(f"/tmp/vadp_{name}.npy")
            row["max_abs_diff_vs_shipped"] = float(np.abs(a - b).max())
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(sys.argv[1]).write_text(json.dumps(rows))
