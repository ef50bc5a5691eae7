"""Host microseconds per launch of what an eager optimizer step calls: torch ops, the torch
backend's symmetric product, our Triton symmetric GEMM (per-tile and persistent), the bare
Triton JIT launch of the same kernel, its argument binding alone, a direct call of the
compiled kernel, and kernels/launch.py's cached launch of it.

    python scripts/bench_launch_cost.py      # one GPU, ~20 s
"""

import statistics
import sys
import time

import torch
import triton

from dion3_titan.kernels import launch, triton_ops
from dion3_titan.kernels.torch_ops import mirror_lower


def per_call_us(fn, n: int = 200) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (host cost of device launches)")
    dev = torch.device("cuda")
    a = torch.randn(4, 256, 256, device=dev, dtype=torch.float16)
    big = torch.randn(16, 1024, 4096, device=dev, dtype=torch.float16)
    x = torch.randn(1000, device=dev)
    rows = {
        "torch add (1000 floats)": lambda: x.add(1.0),
        "torch where with a scalar": lambda: torch.where(x > 0, x, 0.0),
        "torch empty": lambda: torch.empty(1000, device=dev),
        "torch bmm 4x256^2": lambda: torch.bmm(a, a),
        "torch baddbmm 4x256^2": lambda: torch.baddbmm(a, a, a, beta=0.5),
        "torch backend symmetric product 4x256^2": lambda: mirror_lower(torch.bmm(a, a.mT)),
        "Triton sym_gemm 4x256^2 (per-tile)": lambda: triton_ops.sym_gemm(a, a.mT),
        "Triton sym_gemm 16x1024x4096 (persistent)": lambda: triton_ops.sym_gemm(big, big.mT),
    }
    # the bare JIT launch of the per-tile kernel, its binding, and the compiled kernel called directly
    out = torch.empty_like(a)
    L, n, k = a.shape
    b = a.mT
    block, block_k, group, warps, stages = triton_ops.SYM_CONFIG
    side = triton.cdiv(n, block)
    grid = (side * (side + 1) // 2, L, 1)
    args = (a, b, out, out, n, k, *a.stride(), *b.stride(), 0, 0, 0, *out.stride(), 1.0, 0.0)
    kw = dict(
        HAS_C=False,
        EVEN_K=k % block_k == 0,
        EVEN_N=n % block == 0,
        BLOCK=block,
        BLOCK_K=block_k,
        GROUP=group,
        INTERPRET=False,
        num_warps=warps,
        num_stages=stages,
    )
    kernel = triton_ops._sym_gemm_kernel
    compiled = kernel[grid](*args, **kw)
    binder = kernel.device_caches[torch.cuda.current_device()][-1]
    bound = list(binder(*args, **kw)[0].values())
    run = compiled[grid]
    rows["Triton JIT launch, same kernel"] = lambda: kernel[grid](*args, **kw)
    rows["  of which the argument binding"] = lambda: binder(*args, **kw)
    rows["compiled kernel called directly"] = lambda: run(*bound)
    rows["kernels/launch.py: the cached launch"] = lambda: launch.launch(kernel, grid, *args, **kw)
    print(torch.cuda.get_device_name(dev), f"triton {triton.__version__}, torch {torch.__version__}; host us per call")
    for name, fn in rows.items():
        print(f"  {name:45s} {per_call_us(fn):7.1f}")


if __name__ == "__main__":
    main()
