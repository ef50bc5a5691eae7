"""Compressed sync across HSDP replicas in real torchtitan 0.3 training (4 gloo ranks, HSDP
2 x 2, ``optimizer_kwargs={"replicate_sync": "compressed"}``): the loss falls, the replicas'
weights stay bit-identical, a checkpoint saved at step 10 resumes at HSDP 2 x 2 bit for bit and
at FSDP 2 (replicate degree 1)."""

import shutil
from pathlib import Path

import pytest

from tests.titan03.helpers import ensure_corpus, run_titan03

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


def _replicas_identical(run) -> bool:
    hashes = [record["local_hashes"] for record in run.records]
    return len(hashes) == 4 and hashes[0] == hashes[2] and hashes[1] == hashes[3] and hashes[0] != hashes[1]


def test_compressed_trains_and_resumes(tmp_path: Path) -> None:
    ensure_corpus()
    full = run_titan03(
        "llama3_debug_dion3_compressed", tmp_path / "full", "--training.steps", str(STEPS), *COMMON, *HSDP, nproc=4
    )
    assert full.returncode == 0, full.output[-4000:]
    losses = full.losses()
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    assert losses[STEPS] < losses[1] - 1.0, losses
    assert _replicas_identical(full), [r["local_hashes"] for r in full.records]

    same = tmp_path / "same"
    (same / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoint" / "step-10", same / "checkpoint" / "step-10")
    again = run_titan03("llama3_debug_dion3_compressed", same, "--training.steps", str(STEPS), *COMMON, *HSDP, nproc=4)
    assert again.returncode == 0, again.output[-4000:]
    assert again.losses() == {s: losses[s] for s in range(11, STEPS + 1)}  # bitwise-equal floats
    assert _replicas_identical(again)

    fsdp = tmp_path / "fsdp"
    (fsdp / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoint" / "step-10", fsdp / "checkpoint" / "step-10")
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
    assert two.returncode == 0, two.output[-4000:]
    got = two.losses()
    assert sorted(got) == list(range(11, STEPS + 1)), got
    assert max(got.values()) < losses[1] - 1.0, (got, losses)
