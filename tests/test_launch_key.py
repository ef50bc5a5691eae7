"""kernels/launch.py's key on the CPU: it separates every specialization Triton makes of an
argument (a cached launch would otherwise run a kernel compiled for other arguments) and
merges what Triton does not specialize on (else nothing would hit). Under the interpreter every
launch takes the JIT's path. The cached launches themselves run in tests/gpu/test_launch_gpu.py."""

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from dion3_titan.kernels import launch


def _key(*args, **meta):
    return launch.key_of(test_the_key_separates_what_triton_specializes, (4, 1), args, meta)


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
        launch.key_of(test_the_key_separates_what_triton_specializes, (4, 1), (aligned,), {}, device=1),
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
