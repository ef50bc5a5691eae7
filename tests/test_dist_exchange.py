"""The shard group's exchange on real gloo ranks: rows reach their owner in the dtype they are
sent in, and per-row float32 scalars beside them (NorMuon's second moment, its factors) keep
every bit whatever that dtype, both ways (float16 rows carry each in two columns)."""

import pytest
import torch

from tests.spawn import spawn

pytestmark = pytest.mark.timeout(300)

N, K, COLS, E = 2, 3, 5, 3  # matrices, rows per rank, columns per rank, scalars per row; rank q owns matrix q
LAYOUTS = {"rows": ([0, 1], [0, 0]), "cols": ([0, 0], [0, 1])}  # (row block, column block) per rank


def _inputs(seed: int, rank: int, row_block: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows (N, K, COLS) and its rows' scalars (N, K, E): float32 values that no
    16-bit dtype holds (thirds, tiny and huge magnitudes). Ranks of one row block share the
    scalars, as the optimizer's ranks do."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    rows = torch.randn(N, K, COLS, generator=gen).to(dtype)
    gen.manual_seed(seed * 100 + 50 + row_block)
    scale = 10.0 ** torch.randint(-12, 8, (N, K, E), generator=gen)
    extra = (torch.rand(N, K, E, generator=gen, dtype=torch.float64) / 3 * scale).float()
    return rows, extra


def _worker(rank, world, seed, out_path):
    import torch.distributed as dist

    from dion3_titan.dist.comm import CommStats, ShardedExchange

    results = {}
    for layout, (row_block, col_block) in LAYOUTS.items():
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            ex = ShardedExchange(dist.group.WORLD, rank, row_block, col_block, [0, 1], K, COLS, CommStats())
            rows, extra = _inputs(seed, rank, row_block[rank], dtype)
            full, full_extra = ex.gather(rows, extra)
            # the owner sends back its matrix and twice its scalars
            back, back_extra = ex.scatter(full, full_extra * 2)
            results[(layout, str(dtype))] = (full, full_extra, back, back_extra, rows, extra)
    torch.save(results, f"{out_path}.{rank}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rows_and_their_float32_scalars_arrive_bit_exact(tmp_path, seed, layout):
    out = tmp_path / "ex"
    spawn(2, _worker, seed, str(out))
    row_block, col_block = LAYOUTS[layout]
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        sent = [_inputs(seed, q, row_block[q], dtype) for q in range(2)]
        for rank in range(2):
            full, full_extra, back, back_extra, rows, extra = torch.load(f"{out}.{rank}")[(layout, str(dtype))]
            where = (layout, dtype, rank, f"seed {seed}")
            # the owned matrix: every rank's rows of it, laid out by row and column block
            parts = [[sent[q][0][rank] for q in range(2) if row_block[q] == rb] for rb in sorted(set(row_block))]
            want = torch.cat([torch.cat(blocks, dim=-1) for blocks in parts], dim=0)
            assert full.dtype == dtype and torch.equal(full[0], want), where
            scalars = torch.cat([sent[q][1][rank] for q in range(2) if col_block[q] == 0])
            assert full_extra.dtype == torch.float32 and torch.equal(full_extra[0], scalars), where
            assert torch.equal(back, rows), where
            assert back_extra.dtype == torch.float32 and torch.equal(back_extra, extra * 2), where
