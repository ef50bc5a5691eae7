"""Compressed sync across HSDP replicas in real torchtitan 0.2 training (4 gloo ranks, HSDP
2 x 2, `[optimizer] replicate_sync = "compressed"`): the loss falls and the replicas' weights
stay bit-identical; a checkpoint saved at step 10 resumes at HSDP 2 x 2 (reproducing the
uninterrupted losses bit for bit) and at FSDP 2 (replicate degree 1); with a MoE's experts over
expert parallelism it reproduces gradient sync; a config that cannot use compressed sync stops
before step 1 with one line."""

from pathlib import Path

import pytest

from tests.titan_helpers import (
    CONFIGS,
    checkpoint_from,
    ensure_corpus,
    hsdp_replicas_identical,
    run_titan,
    run_titans,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

LLAMA = CONFIGS / "llama3_debug_dion3.toml"
DEEPSEEK = CONFIGS / "deepseek_v3_debug_dion3.toml"
STEPS = 14
COMMON = (
    "--lr_scheduler.total_steps",
    str(STEPS),
    "--training.seq_len",
    "128",
    "--training.local_batch_size",
    "2",
    "--validation.no-enable",
    "--optimizer.fraction",
    "0.25",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "10",
    "--checkpoint.no-last_save_model_only",
)
HSDP = ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2")
COMPRESSED = ("--optimizer.replicate_sync", "compressed")


def test_compressed_trains_and_resumes(tmp_path: Path) -> None:
    ensure_corpus()
    full = run_titan(LLAMA, tmp_path / "full", "--training.steps", str(STEPS), *COMMON, *HSDP, *COMPRESSED, nproc=4)
    assert full.returncode == 0, full.report()
    losses = full.losses()
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    assert losses[STEPS] < losses[1] - 1.0, losses  # it trains
    assert hsdp_replicas_identical(full), [r["local_hashes"] for r in full.records]
    assert "replicate_sync='compressed'" not in full.output  # no refusal line

    # resume at the same mesh from step 10: steps 11-14 exactly as uninterrupted
    same = checkpoint_from(tmp_path / "full", 10, tmp_path / "same")
    again = run_titan(LLAMA, same, "--training.steps", str(STEPS), *COMMON, *HSDP, *COMPRESSED, nproc=4)
    assert again.returncode == 0, again.report()
    assert again.losses() == {s: losses[s] for s in range(11, STEPS + 1)}  # bitwise-equal floats
    assert hsdp_replicas_identical(again)

    # resume at FSDP 2 (replicate degree 1, so gradient sync): it continues, it does not restart
    fsdp = checkpoint_from(tmp_path / "full", 10, tmp_path / "fsdp")
    two = run_titan(
        LLAMA, fsdp, "--training.steps", str(STEPS), *COMMON, "--checkpoint.exclude_from_loading", "dataloader", nproc=2
    )
    assert two.returncode == 0, two.report()
    got = two.losses()
    assert sorted(got) == list(range(11, STEPS + 1)), got
    # from the step-10 weights (another world size reads the data from its start): well below
    # the untrained loss at every step, no blow-up
    assert max(got.values()) < losses[1] - 1.0, (got, losses)


def test_compressed_with_expert_parallelism_equals_gradient_sync(tmp_path: Path) -> None:
    """deepseek_v3's debug MoE on HSDP 2 x 2 with its routed experts over EP 2: the experts live
    on a mesh of their own (replicas x expert FSDP x EP), the rest on replicas x FSDP. With
    random selection (the same rows under either sync) and a clipping factor of 1, compressed
    sync trains as gradient sync does, step for step (the replicas' mean momentum is the synced
    one, experts included), and the replicas' weights stay bit-identical. The replica-consistent
    clipping scales the gradients of both meshes. Two microbatches per step (gradient
    accumulation): FSDP2 reduces each within the replica and sums them."""
    ensure_corpus()
    common = (
        *("--training.steps", "6", "--lr_scheduler.total_steps", "6", "--validation.no-enable"),
        *("--training.local_batch_size", "2", "--training.global_batch_size", "16"),
        *("--training.max_norm", "1000", "--optimizer.selection", "random"),
        *HSDP,
        *("--parallelism.expert_parallel_degree", "2"),
    )
    runs = run_titans(
        {
            "gradients": (DEEPSEEK, tmp_path / "gradients", common),
            "compressed": (DEEPSEEK, tmp_path / "compressed", (*common, *COMPRESSED)),
        },
        nproc=4,
    )
    for name, run in runs.items():
        assert run.returncode == 0, f"{name}:\n{run.report()}"
        assert "gradient accumulation steps 2" in run.output, name
    synced, compressed = runs["gradients"].losses(), runs["compressed"].losses()
    assert sorted(compressed) == list(range(1, 7)), compressed
    assert compressed[6] < compressed[1] - 0.5, compressed  # it trains
    assert compressed == pytest.approx(synced, rel=1e-5, abs=0.0), (compressed, synced)
    assert hsdp_replicas_identical(runs["compressed"]), [r["local_hashes"] for r in runs["compressed"].records]


@pytest.mark.parametrize(
    "args,message",
    [
        (COMPRESSED, "replicate_sync='compressed' needs HSDP"),
        (("--optimizer.name", "prmuon", *COMPRESSED), "conflicts with name='prmuon'"),
        (("--optimizer.replicate_sync", "sometimes"), "replicate_sync='sometimes': allowed values are"),
        (("--optimizer.replicate_ns", "twice"), "replicate_ns='twice': allowed values are"),
    ],
    ids=["no-replicas", "prmuon", "unknown-sync", "unknown-ns"],
)
def test_bad_replicate_settings_stop_before_training(args, message) -> None:
    from dion3_titan.titan02.check_config import ConfigError, parse_job_config

    with pytest.raises(ConfigError, match=message) as e:
        parse_job_config(["--job.config_file", str(LLAMA), *args])
    assert "\n" not in str(e.value)
