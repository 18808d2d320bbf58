"""Host cost of one ct.launch by argument kind (GPU host): cupy arrays, plain
__cuda_array_interface__ objects without a stream, torch tensors; and the device floor of a
chain of dependent kernels replayed from a CUDA graph (each reads the vector the one before
wrote), the fixed cost every kernel of a decode step pays on top of its memory traffic; and the
same chain as stages of one kernel handed over through counters in device memory.
    python tools/launch_overhead.py [--out DIR]
"""
import argparse
import time

import cuda.tile as ct
import cupy
import torch

import tilekernels._arrays as tk_arrays
from benchlib import gpu_name, graph_ms_cupy, versions, write_result
from tilekernels._arrays import inputs_ready, launch

ConstInt = ct.Constant[int]


@ct.kernel
def touch(X, Y, Z, W, TILE: ConstInt):
    t = ct.load(X, index=(0,), shape=(TILE,))
    ct.store(Y, index=(0,), tile=t)


@ct.kernel
def relay(X, Y, TILE: ConstInt):
    """Y = X + 1 over one vector, by every block (a decode projection's input and output)."""
    inputs_ready()
    t = ct.load(X, index=(0,), shape=(TILE,))
    ct.store(Y, index=(0,), tile=t + 1.0)


def chain_floor_us(blocks: int, n: int = 60) -> float:
    """Device us per kernel of n dependent relay kernels in one graph."""
    a, b = cupy.zeros(1024, cupy.float32), cupy.zeros(1024, cupy.float32)

    def run():
        for i in range(n):
            launch((blocks, 1, 1), relay, (a, b, 1024) if i % 2 == 0 else (b, a, 1024))
    return graph_ms_cupy(run, inner=1) * 1e3 / n


@ct.kernel
def staged_relay(X, C, TILE: ConstInt, PER: ConstInt):
    """relay as stages of one kernel: the PER blocks of stage s = bid // PER spin until all
    PER blocks of stage s - 1 have counted themselves in C[s - 1], then relay row s of X to
    row s + 1 (blocks are dispatched in order, so a waiting stage never blocks the one it
    waits for)."""
    inputs_ready()
    s = ct.bid(0) // PER
    if s > 0:
        seen = ct.atomic_add(C, s - 1, 0, memory_order=ct.MemoryOrder.ACQUIRE)
        while seen < PER:
            seen = ct.atomic_add(C, s - 1, 0, memory_order=ct.MemoryOrder.ACQUIRE)
    t = ct.load(X, index=(s, 0), shape=(1, TILE))
    ct.store(X, index=(s + 1, 0), tile=t + 1.0)
    ct.atomic_add(C, s, 1, memory_order=ct.MemoryOrder.RELEASE)


def staged_floor_us(blocks: int, n: int = 60) -> float:
    """Device us per stage of n relay stages handed over through counters in one kernel."""
    x = cupy.zeros((n + 1, 1024), cupy.float32)

    def run():
        counters = cupy.zeros(n, cupy.int32)
        launch((n * blocks, 1, 1), staged_relay, (x, counters, 1024, blocks))
    us = graph_ms_cupy(run, inner=1) * 1e3 / n
    assert float(x[n, 0]) == float(x[0, 0]) + n, "a stage ran before the one it waits for"
    return us


class Raw:
    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, a):
        self.__cuda_array_interface__ = {"shape": a.shape, "typestr": "<f4", "data": (a.data.ptr, False),
                                         "strides": None, "version": 2}


def per_launch_us(args, n=2000):
    stream = cupy.cuda.get_current_stream().ptr
    for _ in range(20):
        ct.launch(stream, (1, 1, 1), touch, args)
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(n):
        ct.launch(stream, (1, 1, 1), touch, args)
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - t) / n * 1e6


def host_us(fn, n: int = 10000) -> float:
    """Host us per call of fn()."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    arrs = [cupy.zeros(1024, cupy.float32) for _ in range(4)]
    tens = [torch.zeros(1024, device="cuda") for _ in range(4)]
    host = {"cupy_arrays_us": per_launch_us((*arrs, 1024)),
            "cai_v2_objects_us": per_launch_us((*[Raw(a) for a in arrs], 1024)),
            "torch_tensors_us": per_launch_us((*tens, 1024)),
            "build_cai_object_us": host_us(lambda: Raw(arrs[0])),
            "cupy_cai_property_us": host_us(lambda: arrs[0].__cuda_array_interface__)}
    for k, v in host.items():
        print(f"host {k:24s} {v:6.2f}")
    chain = {}
    for dependent in (True, False):
        tk_arrays.DEPENDENT_LAUNCH = dependent
        for blocks in (1, 132, 528, 1056):
            us = chain_floor_us(blocks)
            chain[f"{'dependent' if dependent else 'plain'}_launch_{blocks}_blocks_us"] = round(us, 2)
            print(f"dependent chain, {blocks:5d} blocks, dependent launch {dependent}: {us:6.2f} us per kernel")
    tk_arrays.DEPENDENT_LAUNCH = True
    for blocks in (1, 132, 528):
        us = staged_floor_us(blocks)
        chain[f"counter_stages_{blocks}_blocks_us"] = round(us, 2)
        print(f"stages in one kernel, {blocks:5d} blocks a stage: {us:6.2f} us per stage")
    write_result("launch-overhead", {"gpu": gpu_name(), "versions": versions(),
                                     "host_per_launch": {k: round(v, 2) for k, v in host.items()},
                                     "graph_chain_per_kernel": chain}, args.out)


if __name__ == "__main__":
    main()
