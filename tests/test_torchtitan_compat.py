"""Dion3 with torchtitan's activation checkpointing and torch.compile (wrapped parameter names:
`_checkpoint_wrapped_module.`, `_orig_mod.`), with gradient accumulation, and with float8 linears
whose FSDP all-gather runs in float8 (emulated float8 matmuls on CPU; tests/gpu has the real
ones): real training on 2 gloo ranks, llama3 debug."""

from pathlib import Path

import pytest

from tests.test_torchtitan_train import LLAMA_ADAMW, LLAMA_MATRIX, _groups
from tests.titan_helpers import CONFIGS, ensure_corpus, run_titan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SHORT = ("--training.seq_len", "128", "--training.local_batch_size", "2", "--validation.no-enable")


@pytest.mark.parametrize(
    "extra",
    [
        ("--activation_checkpoint.mode", "full"),
        ("--activation_checkpoint.mode", "selective", "--compile.enable", "--compile.backend", "aot_eager"),
    ],
    ids=["full_ac", "selective_ac+compile"],
)
def test_trains_with_activation_checkpointing_and_compile(tmp_path: Path, extra) -> None:
    ensure_corpus()
    run = run_titan(CONFIGS / "llama3_debug_dion3.toml", tmp_path, "--training.steps", "4", *SHORT, *extra)
    assert run.returncode == 0, run.output[-4000:]
    losses = run.losses()
    assert losses[4] < losses[1], losses
    g = _groups(run.records[0])  # routing saw through the wrapper prefixes
    assert len(g["dion3"]["names"]) == 6 * 7
    assert all(LLAMA_MATRIX.fullmatch(n) for n in g["dion3"]["names"]), g["dion3"]["names"]
    assert all(LLAMA_ADAMW.fullmatch(n) for n in g["adamw"]["names"]), g["adamw"]["names"]


def test_gradient_accumulation_steps_once_per_global_step(tmp_path: Path) -> None:
    """global batch = 2 x local batch x ranks: two micro-batches, one optimizer step each step."""
    ensure_corpus()
    run = run_titan(
        CONFIGS / "llama3_debug_dion3.toml",
        tmp_path,
        "--training.steps",
        "3",
        *SHORT,
        "--training.global_batch_size",
        "8",
        "--optimizer.optimizer_metrics",
        "True",
        "--metrics.log_freq",
        "1",
    )
    assert run.returncode == 0, run.output[-4000:]
    assert "gradient accumulation steps 2" in run.output
    losses = run.losses()
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1], losses
    # the selection tracker counts optimizer steps: after 3 global steps the oldest
    # never-selected row is 3 steps old (f = 0.25), not 6
    import re

    ages = [float(m) for m in re.findall(r"oldest_unselected=([0-9.]+)", run.output)]
    assert ages and max(ages) <= 3, ages


FLOAT8 = (
    "--model.converters",
    "quantize.linear.float8",
    "--quantize.linear.float8.enable_fsdp_float8_all_gather",
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
    "--quantize.linear.float8.filter_fqns",
    "output",
)


def test_float8_linears_with_float8_all_gather(tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    ensure_corpus()
    run = run_titan(
        CONFIGS / "llama3_debug_dion3.toml",
        tmp_path,
        "--training.steps",
        "4",
        *SHORT,
        *FLOAT8,
        "--quantize.linear.float8.emulate",
    )
    assert run.returncode == 0, run.output[-4000:]
    assert "Swapped to Float8Linear layers with enable_fsdp_float8_all_gather=True" in run.output
    losses = run.losses()
    assert losses[4] < losses[1], losses
    record = run.records[0]
    assert record["optimizers"]["post_hooks"] >= 1  # torchtitan's float8 scale precompute
    g = _groups(record)
    assert len(g["dion3"]["names"]) == 6 * 7
    assert g["dion3"]["local_classes"] == ["WeightWithDynamicFloat8CastTensor"]
