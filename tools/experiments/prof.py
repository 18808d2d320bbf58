"""Decode steps at batch 1 inside a cudaProfilerStart/Stop range (for ncu --profile-from-start off),
then torch's (cuBLAS) bf16 GEMVs at the same shapes in a second range."""
import sys, time
from pathlib import Path
sys.path.insert(0, "tools")
import cupy

mode = sys.argv[1]
rt = cupy.cuda.runtime


def rng(f):
    cupy.cuda.Device().synchronize(); rt.profilerStart(); f(); cupy.cuda.Device().synchronize(); rt.profilerStop()


if mode == "gpt":
    from benchlib import served_checkpoint
    work = Path("/tmp/prof-gpt")
    if not (work / "config.json").exists():
        served_checkpoint("gpt", work)
    import gpt
    lm = gpt.load(str(work), device="gpu")
    for _ in range(3):
        lm.generate(["Hello"], max_new_tokens=64, temperature=0.0)
    t = time.perf_counter(); out = lm.generate(["Hello"], max_new_tokens=128, temperature=0.0)[0]
    print("tok/s", len(out.tokens) / (time.perf_counter() - t), flush=True)
    rng(lambda: lm.generate(["Hello"], max_new_tokens=17, temperature=0.0))
    shapes = [(2304, 768), (768, 768), (3072, 768), (768, 3072), (50257, 768)]
else:
    from benchlib import glm_prompt_ids
    from glm_asr.pipeline import SCORED, Transcriber
    from tilekernels.runtime import generate
    asr = Transcriber.load(Path("/tmp/first-result/asr"), "gpu")
    m = asr.model
    ids = glm_prompt_ids(m.config, 375)
    x = m.prompt_embeds(ids, cupy.zeros((375, m.config.decoder.hidden_size), cupy.float32))
    for _ in range(3):
        generate(asr.engine, [ids], 33, SCORED, embeds=[x], ignore_eos=True)
    rng(lambda: generate(asr.engine, [ids], 17, SCORED, embeds=[x], ignore_eos=True))
    d = m.config.decoder
    n, hd = d.hidden_size, d.head_dim
    shapes = [((d.num_heads + 2 * d.num_kv_heads) * hd, n), (n, d.num_heads * hd), (2 * d.intermediate_size, n),
              (n, d.intermediate_size), (d.vocab_size, n)]
import torch
ws = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
xs = [torch.randn(1, s[1], device="cuda", dtype=torch.bfloat16) for s in shapes]
for w, x in zip(ws, xs):
    torch.nn.functional.linear(x, w)
torch.cuda.synchronize()
rng(lambda: [torch.nn.functional.linear(x, w) for w, x in zip(ws, xs) for _ in range(2)])
print("shapes", shapes, flush=True)
