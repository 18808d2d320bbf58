"""Decode attention's kernel copy at small batches (experiment): gpt2 batch-1 tok/s and GLM-ASR's
decoder step at batch 1 with decode_kernel_for's choice replaced by one copy, each variant in a
fresh process (graphs capture the copy they meet). `copies.py run VARIANT MODEL` prints one JSON
line; `copies.py` alone runs every variant twice, interleaved, and writes JSON to argv[1]."""
import json, statistics, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, "tools")
VARIANTS = ["shipped", "decode_kernel_occupancy2", "decode_kernel_occupancy4"]


def run(variant, model):
    import importlib
    D = importlib.import_module("tilekernels.decode_attention")
    if variant != "shipped":
        forced = getattr(D, variant)
        D.decode_kernel_for = lambda itemsize, d, pairs, sms: forced
    if model == "gpt":
        from benchlib import served_checkpoint
        work = Path("/tmp/prof-gpt")
        if not (work / "config.json").exists():
            served_checkpoint("gpt", work)
        import gpt
        lm = gpt.load(str(work), device="gpu")
        lm.generate(["Hello"], max_new_tokens=128, temperature=0.0)
        walls = []
        for _ in range(5):
            t = time.perf_counter()
            out = lm.generate(["Hello"], max_new_tokens=128, temperature=0.0)[0]
            walls.append(time.perf_counter() - t)
        return {"tok_s": round(len(out.tokens) / statistics.median(walls), 1), "tokens": out.tokens[:16]}
    import bench_glm_asr as B
    from glm_asr.pipeline import Transcriber
    asr = Transcriber.load(Path("/tmp/first-result/asr"), "gpu")
    return {"step_ms_b1": round(statistics.median(B.decoder_step_ms(asr, 1) for _ in range(3)), 4),
            "step_ms_b64": round(B.decoder_step_ms(asr, 64), 4)}


if len(sys.argv) > 1 and sys.argv[1] == "run":
    print("ROW " + json.dumps({"variant": sys.argv[2], "model": sys.argv[3], **run(sys.argv[2], sys.argv[3])}))
    sys.exit()
rows = []
models = ["gpt"] + (["asr"] if Path("/tmp/first-result/asr/config.json").exists() else [])
for rnd in range(2):
    for model in models:
        for v in VARIANTS:
            p = subprocess.run([sys.executable, __file__, "run", v, model], capture_output=True, text=True)
            got = [json.loads(l[4:]) for l in p.stdout.splitlines() if l.startswith("ROW ")]
            row = got[0] if got else {"variant": v, "model": model, "error": p.stderr[-800:]}
            row["round"] = rnd
            rows.append(row)
            print(json.dumps(row), flush=True)
            Path(sys.argv[1]).write_text(json.dumps(rows))
