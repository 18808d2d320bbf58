"""Host cost of one ct.launch by argument kind (GPU host): cupy arrays, plain
__cuda_array_interface__ objects without a stream, torch tensors.
python tools/launch_overhead.py"""
import time

import cuda.tile as ct
import cupy
import torch

ConstInt = ct.Constant[int]


@ct.kernel
def touch(X, Y, Z, W, TILE: ConstInt):
    t = ct.load(X, index=(0,), shape=(TILE,))
    ct.store(Y, index=(0,), tile=t)


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


arrs = [cupy.zeros(1024, cupy.float32) for _ in range(4)]
print(f"cupy arrays      {per_launch_us((*arrs, 1024)):6.1f} us/launch")
print(f"CAI v2 objects   {per_launch_us((*[Raw(a) for a in arrs], 1024)):6.1f} us/launch")
t0 = time.perf_counter()
for _ in range(10000):
    Raw(arrs[0])
print(f"  (building one CAI object: {(time.perf_counter() - t0) / 10000 * 1e6:.2f} us)")
tens = [torch.zeros(1024, device="cuda") for _ in range(4)]
print(f"torch tensors    {per_launch_us((*tens, 1024)):6.1f} us/launch")
t0 = time.perf_counter()
for _ in range(10000):
    arrs[0].__cuda_array_interface__
print(f"  (cupy __cuda_array_interface__ property: {(time.perf_counter() - t0) / 10000 * 1e6:.2f} us)")
