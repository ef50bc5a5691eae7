"""Compressed sync across HSDP replicas in real torchtitan 0.3 training (4 gloo ranks, HSDP
2 x 2, ``optimizer_kwargs={"replicate_sync": "compressed"}``): the loss falls, the replicas'
weights stay bit-identical, a checkpoint saved at step 10 resumes at HSDP 2 x 2 bit for bit and
at FSDP 2 (replicate degree 1); with a MoE's experts over expert parallelism it reproduces
gradient sync."""

from pathlib import Path

import pytest

from tests.titan03.helpers import ensure_corpus, run_titan03
from tests.titan_helpers import checkpoint_from, hsdp_replicas_identical

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

STEPS = 14
COMMON = (
    "--lr_scheduler.total_steps",
    str(STEPS),
    "--training.seq_len",
    "128",
    "--training.local_batch_size",
    "2",
    "--validator.no-enable",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "10",
    "--checkpoint.no-last_save_model_only",
)
HSDP = ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2")


def test_compressed_trains_and_resumes(tmp_path: Path) -> None:
    ensure_corpus()
    full = run_titan03(
        "llama3_debug_dion3_compressed", tmp_path / "full", "--training.steps", str(STEPS), *COMMON, *HSDP, nproc=4
    )
    assert full.returncode == 0, full.report()
    losses = full.losses()
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    assert losses[STEPS] < losses[1] - 1.0, losses
    assert hsdp_replicas_identical(full), [r["local_hashes"] for r in full.records]

    same = checkpoint_from(tmp_path / "full", 10, tmp_path / "same")
    again = run_titan03("llama3_debug_dion3_compressed", same, "--training.steps", str(STEPS), *COMMON, *HSDP, nproc=4)
    assert again.returncode == 0, again.report()
    assert again.losses() == {s: losses[s] for s in range(11, STEPS + 1)}  # bitwise-equal floats
    assert hsdp_replicas_identical(again)

    fsdp = checkpoint_from(tmp_path / "full", 10, tmp_path / "fsdp")
    two = run_titan03(
        "llama3_debug_dion3",
        fsdp,
        "--training.steps",
        str(STEPS),
        *COMMON,
        "--checkpoint.exclude_from_loading",
        "dataloader",
        nproc=2,
    )
    assert two.returncode == 0, two.report()
    got = two.losses()
    assert sorted(got) == list(range(11, STEPS + 1)), got
    assert max(got.values()) < losses[1] - 1.0, (got, losses)


def test_compressed_with_expert_parallelism_equals_gradient_sync(tmp_path: Path) -> None:
    """deepseek_v3's debug MoE on HSDP 2 x 2 with its routed experts over EP 2 (the experts on a
    mesh of their own): with random selection and a clipping factor of 1, compressed sync
    trains as gradient sync does, step for step, and the replicas stay bit-identical."""
    ensure_corpus()
    common = ("--training.steps", "6", "--lr_scheduler.total_steps", "6", "--training.max_norm", "1000", *HSDP)
    common += ("--parallelism.expert_parallel_degree", "2")
    synced = run_titan03("deepseek_v3_debug_dion3_random", tmp_path / "gradients", *common, nproc=4)
    assert synced.returncode == 0, synced.report()
    run = run_titan03("deepseek_v3_debug_dion3_random_compressed", tmp_path / "compressed", *common, nproc=4)
    assert run.returncode == 0, run.report()
    losses = run.losses()
    assert sorted(losses) == list(range(1, 7)), losses
    assert losses[6] < losses[1] - 0.5, losses  # it trains
    assert losses == pytest.approx(synced.losses(), rel=1e-5, abs=0.0), (losses, synced.losses())
    assert hsdp_replicas_identical(run), [r["local_hashes"] for r in run.records]
