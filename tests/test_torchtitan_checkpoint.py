"""Checkpoint/resume through torchtitan's DCP checkpointing with Dion3 state (2 gloo ranks, FSDP2):
a run stopped at step 2 and resumed must reproduce steps 3-4 of an uninterrupted run exactly."""

import math
from pathlib import Path

import pytest

from tests.titan_helpers import CONFIGS, ensure_corpus, run_titan, run_titans

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LLAMA = CONFIGS / "llama3_debug_dion3.toml"
COMMON = (
    "--lr_scheduler.total_steps",
    "4",  # the same lr schedule for the stopped and full runs
    "--training.seq_len",
    "128",
    "--training.local_batch_size",
    "2",
    "--validation.no-enable",  # its seq_len (256) would exceed the shortened training seq_len
)
CKPT = (
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
    "--checkpoint.no-last_save_model_only",  # the step-2 save must hold optimizer state too
)


def test_resume_at_step_2_matches_uninterrupted_run(tmp_path: Path) -> None:
    ensure_corpus()
    resumed_dir = tmp_path / "resumed"
    # the uninterrupted run and the stopped one in turn in one launch; the resumed run (below)
    # is a fresh launch, so that all it knows of the stopped run is the checkpoint
    launch = run_titans(
        {
            "full": (LLAMA, tmp_path / "full", ("--training.steps", "4", *COMMON)),
            "first": (LLAMA, resumed_dir, ("--training.steps", "2", *COMMON, *CKPT)),
        }
    )
    full, first = launch["full"], launch["first"]
    assert full.returncode == 0, full.report()

    assert first.returncode == 0, first.report()
    assert (resumed_dir / "checkpoint" / "step-2").is_dir()
    assert first.losses() == {s: full.losses()[s] for s in (1, 2)}

    second = run_titan(LLAMA, resumed_dir, "--training.steps", "4", *COMMON, *CKPT)
    assert second.returncode == 0, second.report()
    assert "Loading the checkpoint" in second.output or "Finished loading" in second.output
    losses = second.losses()
    assert sorted(losses) == [3, 4], losses  # it resumed, it did not restart
    assert losses == {s: full.losses()[s] for s in (3, 4)}  # bitwise-equal floats
    assert second.records[0]["param_digest"] == full.records[0]["param_digest"]


# A checkpoint resumes at another world size (DCP reshards parameters and optimizer state; the
# NorMuon second moment has one entry per row of W whatever the sharding). Each (flavor, f) is
# covered by one chain of world sizes, each change of world size (2 -> 1, 1 -> 2, 2 -> 4) by at
# least one chain, instead of the full cross product (each run is ~40 s on 2 cores).
RESHARD = [
    ("normuon", 0.25, (2, 1, 2)),
    ("normuon", 1.0, (2, 4)),
    ("muon", 0.25, (2, 4)),
    ("muon", 1.0, (1, 2)),
]


@pytest.mark.parametrize(
    "flavor,fraction,worlds", RESHARD, ids=[f"{f}-f{x}-{'-'.join(map(str, w))}" for f, x, w in RESHARD]
)
def test_resume_at_another_world_size(tmp_path: Path, flavor: str, fraction: float, worlds: tuple) -> None:
    """Each run trains two more steps from the previous run's checkpoint at its own world size;
    the loss continues from where the checkpoint left it (no restart, no blow-up). torchtitan
    cannot reshard its dataloader's position, so resumed runs leave it out of loading."""
    ensure_corpus()
    opts = (
        "--optimizer.flavor",
        flavor,
        "--optimizer.fraction",
        str(fraction),
        "--lr_scheduler.total_steps",
        str(2 * len(worlds)),
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        "2",
        "--validation.no-enable",
        *CKPT,
    )
    losses: dict[int, float] = {}
    for i, world in enumerate(worlds):
        extra = ("--checkpoint.exclude_from_loading", "dataloader") if i else ()
        run = run_titan(LLAMA, tmp_path, "--training.steps", str(2 * (i + 1)), *opts, *extra, nproc=world)
        assert run.returncode == 0, f"{world}:\n{run.report()}"
        got = run.losses()
        assert sorted(got) == [2 * i + 1, 2 * i + 2], (world, got)  # resumed, not restarted
        if i:
            # Continues from the checkpoint: below the first step's loss, near the last one's.
            assert got[2 * i + 1] < losses[1] - 0.05 and got[2 * i + 1] < losses[2 * i] + 0.1, (world, losses, got)
        losses.update(got)
    assert all(math.isfinite(v) for v in losses.values()), losses
