"""Static audit of cuTile kernels for sm_90 on a host without a GPU (experiment kit).

    pip install --target /tmp/nvd nvidia-cuda-nvdisasm==13.5.37 nvidia-cuda-cuobjdump==13.5.37
    PATH=/tmp/nvd/nvidia/cu13/bin:$PATH python sass_audit.py MANIFEST.txt ...     # every line
    PATH=... python sass_audit.py --linear "128,128,32,0,1;128,64,32,0,1"          # tm,tn,tk,occupancy,mma

Per specialization: registers, stack and shared memory (cuobjdump --dump-resource-usage), local
loads/stores (STL/LDL: spills) and instructions in the SASS (nvdisasm)."""
import importlib, io, re, subprocess, sys
from cuda.tile.compilation import demangle_kernel_name, export_kernel

OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9]*)", re.M)


def report(label, k, symbol):
    _, sig = demangle_kernel_name(symbol)
    buf = io.BytesIO()
    try:
        export_kernel(k, [sig], buf, gpu_code="sm_90", output_format="cubin")
    except Exception as e:  # noqa: BLE001
        print(f"{label}: FAIL {type(e).__name__}: {str(e)[:200]}", flush=True)
        return
    path = "/tmp/sass_audit.cubin"
    open(path, "wb").write(buf.getvalue())
    res = subprocess.run(["cuobjdump", "--dump-resource-usage", path], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+)", res, re.S)
    ops = OP.findall(subprocess.run(["nvdisasm", path], capture_output=True, text=True).stdout)
    local = sum(o in ("STL", "LDL") for o in ops)
    print(f"{label}: reg {m[1]} stack {m[2]} smem {m[3]} local ld/st {local} of {len(ops)} instructions", flush=True)


if sys.argv[1] == "--linear":
    L = importlib.import_module("tilekernels.linear")
    man = "packages/glm_asr/src/glm_asr/kernels/1280-2048-59264-bf16.txt"
    base = next(l.split(" ", 1)[1].strip() for l in open(man)
                if l.startswith("tilekernels.linear:linear_kernel ") and "_B1_I0_B0_B0_B0_I" in l and "A2f32" in l)
    for v in sys.argv[2].split(";"):
        tm, tn, tk, occ, mma = map(int, v.split(","))
        sym = re.sub(r"_I\d+_I\d+_I\d+_B1_I0_B0_B0_B0_I\d+$", f"_I{tm}_I{tn}_I{tk}_B1_I0_B0_B0_B0_I{mma}", base)
        k = L.linear_kernel if occ == 0 else L.linear_kernel.replace_hints(occupancy=occ)
        report(f"linear_kernel {tm}x{tn}x{tk} occupancy {occ or 'none'} mma {mma}", k, sym)
    sys.exit()
seen = set()
for man in sys.argv[1:]:
    for line in map(str.strip, open(man)):
        if line and not line.startswith("#") and line not in seen:
            seen.add(line)
            ref, symbol = line.split(" ", 1)
            module, name = ref.split(":")
            report(f"{name} ...{symbol[-48:]}", getattr(importlib.import_module(module), name), symbol)
