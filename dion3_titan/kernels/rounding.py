"""Rounding inside Triton kernels, shared by the symmetric GEMMs (triton_ops.py) and the row
engine (kernels/row_engine/)."""

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 -> dtype, round to nearest even.

    Triton's CPU interpreter (3.9) rounds float32 -> bfloat16 wrongly (no carry into the
    exponent), so there the rounding is done on the bits: add 0x7FFF plus the lowest kept bit,
    drop the low 16 bits. Finite values only, which is all the interpreter tests feed it.
    """
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
