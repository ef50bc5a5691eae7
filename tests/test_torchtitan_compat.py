"""Dion3 with torchtitan's activation checkpointing and torch.compile (wrapped parameter names:
`_checkpoint_wrapped_module.`, `_orig_mod.`), with gradient accumulation, and with float8 linears
whose FSDP all-gather runs in float8 (emulated float8 matmuls on CPU; tests/gpu has the real
ones): real training on 2 gloo ranks, llama3 debug, the runs in turn in one launch (`runs`)."""

import importlib.util

import pytest

from tests.test_torchtitan_train import LLAMA_ADAMW, LLAMA_MATRIX, _groups
from tests.titan_helpers import CONFIGS, TitanRun, ensure_corpus, run_titans

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SHORT = ("--training.seq_len", "128", "--training.local_batch_size", "2", "--validation.no-enable")


FLOAT8 = (
    "--model.converters",
    "quantize.linear.float8",
    "--quantize.linear.float8.enable_fsdp_float8_all_gather",
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
    "--quantize.linear.float8.filter_fqns",
    "output",
)
# name -> overrides of the runs (compile last: nothing compiled is left behind for the others)
RUNS = {
    "full_ac": ("--training.steps", "4", *SHORT, "--activation_checkpoint.mode", "full"),
    "grad_accumulation": (
        "--training.steps",
        "3",
        *SHORT,
        "--training.global_batch_size",
        "8",
        "--optimizer.optimizer_metrics",
        "True",
        "--metrics.log_freq",
        "1",
    ),
    "float8": ("--training.steps", "4", *SHORT, *FLOAT8, "--quantize.linear.float8.emulate"),
    "selective_ac+compile": (
        "--training.steps",
        "4",
        *SHORT,
        "--activation_checkpoint.mode",
        "selective",
        "--compile.enable",
        "--compile.backend",
        "aot_eager",
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TitanRun]:
    ensure_corpus()
    folder = tmp_path_factory.mktemp("compat")
    has_torchao = importlib.util.find_spec("torchao") is not None  # else the float8 test skips
    return run_titans(
        {
            name: (CONFIGS / "llama3_debug_dion3.toml", folder / name, args)
            for name, args in RUNS.items()
            if name != "float8" or has_torchao
        }
    )


@pytest.mark.parametrize("name", ["full_ac", "selective_ac+compile"])
def test_trains_with_activation_checkpointing_and_compile(runs: dict[str, TitanRun], name: str) -> None:
    run = runs[name]
    assert run.returncode == 0, run.report()
    losses = run.losses()
    assert losses[4] < losses[1], losses
    g = _groups(run.records[0])  # routing saw through the wrapper prefixes
    assert len(g["dion3"]["names"]) == 6 * 7
    assert all(LLAMA_MATRIX.fullmatch(n) for n in g["dion3"]["names"]), g["dion3"]["names"]
    assert all(LLAMA_ADAMW.fullmatch(n) for n in g["adamw"]["names"]), g["adamw"]["names"]


def test_gradient_accumulation_steps_once_per_global_step(runs: dict[str, TitanRun]) -> None:
    """global batch = 2 x local batch x ranks: two micro-batches, one optimizer step each step."""
    run = runs["grad_accumulation"]
    assert run.returncode == 0, run.report()
    assert "gradient accumulation steps 2" in run.output
    losses = run.losses()
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1], losses
    # the selection tracker counts optimizer steps: after 3 global steps the oldest
    # never-selected row is 3 steps old (f = 0.25), not 6
    import re

    ages = [float(m) for m in re.findall(r"oldest_unselected=([0-9.]+)", run.output)]
    assert ages and max(ages) <= 3, ages


def test_float8_linears_with_float8_all_gather(runs: dict[str, TitanRun]) -> None:
    pytest.importorskip("torchao")
    run = runs["float8"]
    assert run.returncode == 0, run.report()
    assert "Swapped to Float8Linear layers with enable_fsdp_float8_all_gather=True" in run.output
    losses = run.losses()
    assert losses[4] < losses[1], losses
    record = run.records[0]
    assert record["optimizers"]["post_hooks"] >= 1  # torchtitan's float8 scale precompute
    g = _groups(record)
    assert len(g["dion3"]["names"]) == 6 * 7
    assert g["dion3"]["local_classes"] == ["WeightWithDynamicFloat8CastTensor"]
