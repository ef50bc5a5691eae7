"""DCP checkpoint and exact resume with Dion3 state on torchtitan 0.3 (2 gloo ranks, FSDP2): a run
resumed from the step-2 checkpoint of a 4-step run reproduces its steps 3-4 bit for bit (NorMuon
state included, also that of fused wqkv's per-head pieces)."""

from pathlib import Path

import pytest

from tests.titan03.helpers import ensure_corpus, run_titan03

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

COMMON = (
    "--lr_scheduler.total_steps",
    "4",  # the same lr schedule for the stopped and full runs
    "--training.seq_len",
    "128",
    "--training.local_batch_size",
    "2",
    "--validator.no-enable",
)
CKPT = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no-last_save_model_only")


def test_resume_at_step_2_matches_uninterrupted_run(tmp_path: Path) -> None:
    ensure_corpus()
    full = run_titan03("llama3_debug_dion3", tmp_path, "--training.steps", "4", *COMMON, *CKPT)
    assert full.returncode == 0, full.report()
    assert (tmp_path / "checkpoint" / "step-2").is_dir()

    resumed = run_titan03(
        "llama3_debug_dion3", tmp_path, "--training.steps", "4", *COMMON, *CKPT, "--checkpoint.load_step", "2"
    )
    assert resumed.returncode == 0, resumed.report()
    losses = resumed.losses()
    assert sorted(losses) == [3, 4], losses  # it resumed, it did not restart
    assert losses == {s: full.losses()[s] for s in (3, 4)}  # bitwise-equal floats
    assert resumed.records[0]["param_digest"] == full.records[0]["param_digest"]
