"""kernels/launch.py's key on the CPU: it separates every specialization Triton makes of an
argument (a cached launch would otherwise run a kernel compiled for other arguments) and
merges what Triton does not specialize on (else nothing would hit). Under the interpreter every
launch takes the JIT's path. The cached launches themselves run in tests/gpu/test_launch_gpu.py."""

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from dion3_titan.kernels import launch

_KERNEL = object()  # key_of reads only the kernel's identity


def _key(*args, **meta):
    return launch.key_of(_KERNEL, (4, 1), args, meta)


def test_the_key_separates_what_triton_specializes() -> None:
    buf = torch.zeros(64, dtype=torch.float16)
    aligned, shifted = buf[:32], buf[1:33]  # 16-byte aligned start, and 2 bytes past it
    assert aligned.data_ptr() % 16 == 0
    distinct = [
        _key(aligned),
        _key(shifted),
        _key(aligned.float()),  # dtype
        _key(1),  # an integer equal to 1 becomes a constant
        _key(2),
        _key(16),  # a multiple of 16
        _key(2**31),  # 64-bit
        _key(2**63),  # unsigned 64-bit
        _key(0.5),
        _key(True),
        _key(None),
        _key(aligned, BLOCK=64),  # constexprs and options
        _key(aligned, BLOCK=128),
        launch.key_of(_KERNEL, (4, 1), (aligned,), {}, device=1),
        _key(TensorDescriptor.from_tensor(buf.view(8, 8), [8, 8])),
        _key(TensorDescriptor.from_tensor(buf.view(8, 8), [4, 8])),
    ]
    assert len(set(distinct)) == len(distinct)


def test_the_key_merges_what_triton_does_not_specialize_on() -> None:
    a, b = torch.zeros(8, dtype=torch.float16), torch.zeros(64, dtype=torch.float16)
    assert _key(a, 3, 0.5) == _key(b, 3, -2.0)  # tensor addresses and sizes, float values
    assert _key(a, BLOCK=64) == _key(b, BLOCK=64)
    assert _key(32) != _key(4096)  # integers by value: finer than Triton, never coarser


def test_an_argument_of_another_kind_has_no_key() -> None:
    with pytest.raises(launch.Unkeyed):
        _key([1, 2])
    with pytest.raises(launch.Unkeyed):
        _key("a string")


def test_host_arithmetic_matches_triton() -> None:
    import triton

    for n in range(0, 300):
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 64, 128):
            assert launch.cdiv(n, b) == triton.cdiv(n, b), (n, b)


class _Param:
    def __init__(self, name: str, constexpr: bool, default=None) -> None:
        self.name, self.is_constexpr, self.default = name, constexpr, default


class _FakeKernel:
    """The JIT's interface as launch() uses it: ``kernel[grid](...)`` launches (and returns the
    compiled kernel), ``compiled[grid](*all_args)`` launches it directly."""

    __name__ = "fake_kernel"
    params = [_Param("x", False), _Param("n", False), _Param("BLOCK", True), _Param("EVEN", True, default=True)]

    def __init__(self) -> None:
        self.jit, self.direct = [], []
        kernel = self

        class Compiled:
            def __getitem__(self, grid):
                return lambda *args: kernel.direct.append((grid, args))

        self.compiled = Compiled()

    def __getitem__(self, grid):
        def jit(*args, **meta):
            self.jit.append((grid, args, meta))
            return self.compiled

        return jit

    def run(self, *args, grid, warmup, **meta):  # VERIFY's question: the same compiled kernel
        return self.compiled


def test_a_repeated_launch_calls_the_compiled_kernel_with_every_argument(monkeypatch) -> None:
    """The cache's bookkeeping on the CPU with a stand-in kernel (the real kernels' cached path
    runs in tests/gpu/test_launch_gpu.py): a new key goes through the JIT, a repeated one calls
    the compiled kernel with the runtime arguments, then the constexprs in signature order
    (defaults filled in); a launch hook sends every launch back to the JIT."""
    from triton import knobs

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "ENABLED", True)
    launch.clear()
    k = _FakeKernel()
    x = torch.zeros(16, dtype=torch.float16)
    launch.launch(k, (2, 3), x, 7, BLOCK=64, num_warps=4)
    launch.launch(k, (2, 3), x, 9, BLOCK=64, num_warps=4)  # another integer: another key
    launch.launch(k, (2, 3), x, 7, BLOCK=64, num_warps=4)
    assert [c[1][1] for c in k.jit] == [7, 9]
    assert k.direct == [((2, 3, 1), (x, 7, 64, True))]  # options are not arguments
    assert launch.stats == {"hits": 1, "misses": 2, "jit": 0}
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    launch.launch(k, (2, 3), x, 7, BLOCK=64, num_warps=4)
    assert len(k.jit) == 3 and len(k.direct) == 1 and launch.stats["jit"] == 1
    with launch.counting() as counts:
        launch.launch(k, (2, 3), x, 7, BLOCK=64, num_warps=4)
    assert counts == {"fake_kernel": 1}
