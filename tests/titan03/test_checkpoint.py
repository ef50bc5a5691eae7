"""DCP checkpoint and exact resume with Dion3 state on torchtitan 0.3 (2 gloo ranks, FSDP2): a run
stopped at step 2 and resumed reproduces steps 3-4 of an uninterrupted run bit for bit."""

from pathlib import Path

import pytest

from tests.titan03.helpers import ensure_corpus, run_titan03

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

COMMON = (
    "--lr_scheduler.total_steps", "4",  # the same lr schedule for the stopped and full runs
    "--training.seq_len", "128", "--training.local_batch_size", "2", "--validator.no-enable",
)
CKPT = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no-last_save_model_only")


def test_resume_at_step_2_matches_uninterrupted_run(tmp_path: Path) -> None:
    ensure_corpus()
    full = run_titan03("llama3_debug_dion3", tmp_path / "full", "--training.steps", "4", *COMMON)
    assert full.returncode == 0, full.output[-4000:]

    resumed = tmp_path / "resumed"
    first = run_titan03("llama3_debug_dion3", resumed, "--training.steps", "2", *COMMON, *CKPT)
    assert first.returncode == 0, first.output[-4000:]
    assert (resumed / "checkpoint" / "step-2").is_dir()
    assert first.losses() == {s: full.losses()[s] for s in (1, 2)}

    second = run_titan03("llama3_debug_dion3", resumed, "--training.steps", "4", *COMMON, *CKPT)
    assert second.returncode == 0, second.output[-4000:]
    losses = second.losses()
    assert sorted(losses) == [3, 4], losses  # it resumed, it did not restart
    assert losses == {s: full.losses()[s] for s in (3, 4)}  # bitwise-equal floats
    assert second.records[0]["param_digest"] == full.records[0]["param_digest"]
