"""The row engine's Triton kernels: the memory-bound passes of a Dion3 step, each byte once.

At f < 1 a step is a small Newton-Schulz wrapped in passes over float32 momentum and weights.
Three kernels cover those passes, each launched once for a whole shape group: every member's
(B, R, C) view (any strides: row-major, transposed for column selection, strided pieces, 3D
stacks) is one operand, described per matrix in a small device table (``Operand``), so one grid
covers all members and the launch count of a step does not grow with the number of layers.

* ``accumulate_scores``: M += G, and each row's l1 norm (selection) and sum of squares (so the
  Frobenius norm of the selected rows needs no second read of M), in one pass; where every row
  is selected (f = 1) also the error feedback M *= mu, so no later pass writes M.
* ``gather_rows``: the selected rows of M straight into the zero-padded Newton-Schulz batch or
  send buffer, divided by a per-matrix denominator (the normalization) and cast once, and
  M[sel] *= mu (error feedback) while those rows are in registers; also NorMuon's per-row
  second moment of the selected rows.
* ``update_rows``: W <- decay * W on every row (without weight decay, the selected rows alone
  are read and written), W[sel] -= lr * lr_scale * U with one rounding, the NorMuon epilogue
  U = (O / d_row) * s_matrix, and the new second moment of the selected rows, in one pass
  (it can also apply the error feedback, for a caller whose gather did not).

One module per pass (accumulate.py, gather.py, update.py; NorMuon's factors in normuon.py),
the operands they share in operands.py.

The arithmetic follows the torch reference path operation for operation (no FMA contraction),
so float32 state comes out bit-identical where the reference rounds once. Everything here runs
under ``TRITON_INTERPRET=1`` on CPU tensors (the CPU tests check it there).

Operand tables hold element offsets from a base tensor (the first present view), not raw
addresses: the kernel takes the base as an ordinary pointer argument, which Triton's
interpreter and every Triton version handle alike, and the table of a single tensor depends
only on its shape and strides (the same table serves every step's fresh buffers).
"""

from dion3_titan.kernels.row_engine.accumulate import accumulate_scores, accumulate_scores_group, gradient_views
from dion3_titan.kernels.row_engine.gather import gather_rows, gather_rows_group
from dion3_titan.kernels.row_engine.normuon import normuon_factors
from dion3_titan.kernels.row_engine.operands import (
    COLS_UNIT,
    GENERAL,
    ROWS_UNIT,
    TABLES,
    TILES,
    KeptViews,
    MovableOperand,
    Operand,
    TableCache,
    column_views,
    device_table,
    operand,
)
from dion3_titan.kernels.row_engine.update import (
    RowState,
    applied_rows,
    decay_unselected_group,
    row_slots,
    update_rows,
    update_rows_group,
)

__all__ = [
    "COLS_UNIT",
    "GENERAL",
    "ROWS_UNIT",
    "TABLES",
    "TILES",
    "KeptViews",
    "MovableOperand",
    "Operand",
    "RowState",
    "TableCache",
    "accumulate_scores",
    "accumulate_scores_group",
    "applied_rows",
    "column_views",
    "decay_unselected_group",
    "device_table",
    "gather_rows",
    "gather_rows_group",
    "gradient_views",
    "normuon_factors",
    "operand",
    "row_slots",
    "update_rows",
    "update_rows_group",
]
