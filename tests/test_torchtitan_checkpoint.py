"""Checkpoint/resume through torchtitan's DCP checkpointing with Dion3 state (2 gloo ranks, FSDP2):
a run stopped at step 2 and resumed must reproduce steps 3-4 of an uninterrupted run exactly."""

from pathlib import Path

import pytest

from tests.titan_helpers import CONFIGS, ensure_corpus, run_titan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LLAMA = CONFIGS / "llama3_debug_dion3.toml"
COMMON = (
    "--lr_scheduler.total_steps", "4",  # the same lr schedule for the stopped and full runs
    "--training.seq_len", "128",
    "--training.local_batch_size", "2",
    "--validation.no-enable",  # its seq_len (256) would exceed the shortened training seq_len
)
CKPT = (
    "--checkpoint.enable", "--checkpoint.interval", "2",
    "--checkpoint.no-last_save_model_only",  # the step-2 save must hold optimizer state too
)


def test_resume_at_step_2_matches_uninterrupted_run(tmp_path: Path) -> None:
    ensure_corpus()
    full = run_titan(LLAMA, tmp_path / "full", "--training.steps", "4", *COMMON)
    assert full.returncode == 0, full.output[-4000:]

    resumed_dir = tmp_path / "resumed"
    first = run_titan(LLAMA, resumed_dir, "--training.steps", "2", *COMMON, *CKPT)
    assert first.returncode == 0, first.output[-4000:]
    assert (resumed_dir / "checkpoint" / "step-2").is_dir()
    assert first.losses() == {s: full.losses()[s] for s in (1, 2)}

    second = run_titan(LLAMA, resumed_dir, "--training.steps", "4", *COMMON, *CKPT)
    assert second.returncode == 0, second.output[-4000:]
    assert "Loading the checkpoint" in second.output or "Finished loading" in second.output
    losses = second.losses()
    assert sorted(losses) == [3, 4], losses  # it resumed, it did not restart
    assert losses == {s: full.losses()[s] for s in (3, 4)}  # bitwise-equal floats
    assert second.records[0]["param_digest"] == full.records[0]["param_digest"]
