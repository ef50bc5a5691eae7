"""Real torchtitan training with the dion3 plugin: torchrun, 2 gloo ranks on CPU, FSDP2. The
llama3 and deepseek runs train in turn in one launch (`runs`), llama3 also with torchtitan's
compile on (last: torch.compile's state stays in the process); gpt_oss, the largest, in its own."""

import math
import re
from pathlib import Path

import pytest

from tests.titan_helpers import CONFIGS, TitanRun, ensure_corpus, run_titan, run_titans, write_poison

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LLAMA = CONFIGS / "llama3_debug_dion3.toml"
LLAMA_MUON = CONFIGS / "llama3_debug_muon.toml"
DEEPSEEK = CONFIGS / "deepseek_v3_debug_dion3.toml"
GPT_OSS = CONFIGS / "gpt_oss_debug_dion3.toml"

# llama3 debugmodel: 6 layers; every attention/MLP projection is a matrix.
LLAMA_MATRIX = re.compile(r"layers\.\d+\.(attention\.w[qkvo]|feed_forward\.w[123])\.weight")
LLAMA_ADAMW = re.compile(r"(tok_embeddings|output|norm)\.weight|layers\.\d+\.(attention|ffn)_norm\.weight")


@pytest.fixture(scope="module", autouse=True)
def corpus() -> Path:
    return ensure_corpus()


# name -> (config, overrides) of the runs that share one launch
RUNS = {
    "llama3": (LLAMA, ("--training.steps", "20")),
    "deepseek_v3": (DEEPSEEK, ("--training.steps", "3")),
    **{
        name: (LLAMA_MUON, ("--training.steps", "3", "--optimizer.name", name))
        for name in ("muon", "normuon", "prmuon")
    },
    "adamw": (LLAMA, ("--training.steps", "3", "--optimizer.name", "AdamW", "--optimizer.lr", "3e-3")),
    # the llama3 run's first steps, compiled; total_steps keeps its LR schedule
    "llama3_compiled": (LLAMA, ("--training.steps", "4", "--lr_scheduler.total_steps", "20", "--compile.enable")),
    # an inf gradient at step 2 (POISON), with clipping (the config's max_norm 1) and without
    "skip_inf": (LLAMA, ("--training.steps", "4", "--optimizer.nonfinite", "skip")),
    "skip_inf_noclip": (LLAMA, ("--training.steps", "3", "--optimizer.nonfinite", "skip", "--training.max_norm", "0")),
}
COMPILE_RTOL = 1e-4  # fp32: compiled kernels only reorder sums (measured ~1e-7)
POISON = {"step": 2, "param": "layers.0.attention.wo.weight"}


@pytest.fixture(scope="module")
def runs(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, TitanRun]:
    folder = tmp_path_factory.mktemp("train")
    for name in ("skip_inf", "skip_inf_noclip"):
        write_poison(folder / name, **POISON)
    return run_titans({name: (config, folder / name, args) for name, (config, args) in RUNS.items()})


def _groups(record: dict) -> dict[str, dict]:
    (part,) = record["optimizers"]["parts"]  # no pipeline parallelism: one model part
    return {g["algorithm"]: g for g in part["groups"]}


def test_llama3_dion3_trains_and_routes_params(runs: dict[str, TitanRun]) -> None:
    run = runs["llama3"]
    assert run.returncode == 0, run.report()
    losses = run.losses()
    assert sorted(losses) == list(range(1, 21))
    first, last5 = losses[1], sum(losses[s] for s in range(16, 21)) / 5
    assert last5 < first - 1.0, losses  # 8.14 -> ~6.3 with f=0.25 NorMuon

    for record in run.records:  # same layout on both ranks
        assert record["optimizers"]["container"] == "Dion3OptimizersContainer"
        assert record["optimizers"]["post_hooks"] >= 1  # torchtitan's converter hook attached
        (part,) = record["optimizers"]["parts"]
        assert [g["algorithm"] for g in part["groups"]] == ["dion3", "adamw"]  # matrices first
        g = _groups(record)
        assert len(g["dion3"]["names"]) == 6 * 7
        assert all(LLAMA_MATRIX.fullmatch(n) for n in g["dion3"]["names"]), g["dion3"]["names"]
        assert len(g["adamw"]["names"]) == 3 + 6 * 2
        assert all(LLAMA_ADAMW.fullmatch(n) for n in g["adamw"]["names"]), g["adamw"]["names"]
        assert g["dion3"]["fraction"] == 0.25 and g["dion3"]["flavor"] == "normuon"
        assert g["adamw"]["lr"] != g["dion3"]["lr"]  # adamw_lr is its own key
        # clipping is on (max_norm 1): every step's non-finite flag came from its gradient norm
        assert record["nonfinite"] == {"flag_sources": [{"gradient_norm": 20, "own_pass": 0}], "skipped_steps": [0]}


def test_an_inf_gradient_skips_the_step_through_the_clipping_norm(runs: dict[str, TitanRun]) -> None:
    """nonfinite = "skip" with an inf planted in one gradient on one rank at step 2: the
    clipping norm is inf on every rank, so every rank skips that step (without a pass over the
    gradients) and training goes on."""
    run = runs["skip_inf"]
    assert run.returncode == 0, run.report()
    assert math.isinf(run.grad_norms()[POISON["step"]]), run.grad_norms()
    losses = run.losses()
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values()), losses
    assert losses[4] < losses[1], losses
    for record in run.records:
        assert record["nonfinite"] == {"flag_sources": [{"gradient_norm": 4, "own_pass": 0}], "skipped_steps": [1]}


def test_without_clipping_the_optimizer_makes_its_own_pass(runs: dict[str, TitanRun]) -> None:
    """max_norm = 0 (torchtitan has no off switch; 0 scales every gradient by 0): no norm is
    handed over, and the optimizer's own pass catches the planted inf (NaN after the clip)."""
    run = runs["skip_inf_noclip"]
    assert run.returncode == 0, run.report()
    for record in run.records:
        assert record["nonfinite"] == {"flag_sources": [{"gradient_norm": 0, "own_pass": 3}], "skipped_steps": [1]}


def test_llama3_compiled_trains_as_uncompiled(runs: dict[str, TitanRun]) -> None:
    """torchtitan's `compile.enable` (each TransformerBlock and the loss compiled by inductor)
    with FSDP2 and Dion3: the uncompiled llama3 run's losses, step for step."""
    run, eager = runs["llama3_compiled"], runs["llama3"]
    assert run.returncode == 0, run.report()
    for line in ("Compiling each TransformerBlock", "Compiling the loss function"):
        assert line in run.output and line not in eager.output, line
    compiled, reference = run.losses(), eager.losses()
    pairs = {s: (reference.get(s), v) for s, v in compiled.items()}
    assert sorted(compiled) == [1, 2, 3, 4] and compiled[4] < compiled[1], pairs
    worst = max(abs(v - reference[s]) / reference[s] for s, v in compiled.items())
    assert worst <= COMPILE_RTOL, f"relative difference {worst:.2e}; (uncompiled, compiled): {pairs}"


def test_deepseek_v3_moe_dion3_trains_experts_as_matrix_batches(runs: dict[str, TitanRun]) -> None:
    run = runs["deepseek_v3"]
    assert run.returncode == 0, run.report()
    losses = run.losses()
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[2] < losses[1], losses
    assert losses[3] < losses[1] - 0.2, losses  # 8.14 -> 7.88
    record = run.records[0]
    # torchtitan's MoE expert-bias hook, registered by its own builder around our container
    assert record["optimizers"]["pre_hooks"] >= 1
    g = _groups(record)
    shapes = dict(zip(g["dion3"]["names"], g["dion3"]["shapes"]))
    experts = {n: s for n, s in shapes.items() if ".moe.experts." in n}
    assert len(experts) == 5 * 3  # 5 MoE layers x (w1, w2, w3)
    assert all(len(s) == 3 and s[0] == 8 for s in experts.values()), experts  # 8 experts
    assert any(".moe.shared_experts." in n for n in shapes)
    adamw = g["adamw"]["names"]
    assert any(n.endswith("moe.router.gate.weight") for n in adamw)
    assert "tok_embeddings.weight" in adamw and "output.weight" in adamw


@pytest.mark.parametrize(
    "name, flavor, optimizer",
    [("muon", "muon", "Dion3"), ("normuon", "normuon", "Dion3"), ("prmuon", "muon", "PeriodicRowwiseMuon")],
)
def test_muon_normuon_prmuon_names(runs: dict[str, TitanRun], name: str, flavor: str, optimizer: str) -> None:
    # the Muon baseline config sets neither fraction nor flavor: the name decides both
    run = runs[name]
    assert run.returncode == 0, run.report()
    (part,) = run.records[0]["optimizers"]["parts"]
    assert part["class"] == optimizer
    g = _groups(run.records[0])
    assert g["dion3"]["fraction"] == 1.0 and g["dion3"]["flavor"] == flavor
    losses = run.losses()
    # 8.14 -> 7.96 (prmuon 7.97); with the matrices' updates dropped, 8.01 (only AdamW's groups train)
    assert losses[3] < losses[2] < losses[1] and losses[3] < losses[1] - 0.15, losses


def test_adamw_is_untouched(runs: dict[str, TitanRun]) -> None:
    run = runs["adamw"]
    assert run.returncode == 0, run.report()
    record = run.records[0]["optimizers"]
    assert record["container"] == "OptimizersContainer"  # torchtitan's own
    (part,) = record["parts"]
    assert part["class"] == "AdamW" and len(part["groups"]) == 1
    assert "[dion3] optimizer" not in run.output
    losses = run.losses()
    assert losses[3] < losses[2] < losses[1] and losses[3] < losses[1] - 0.5, losses  # 8.14 -> 7.48


def test_gpt_oss_trains_with_mlp1_split_into_gate_and_up(tmp_path: Path) -> None:
    """gpt_oss fuses gate and up as interleaved rows of mlp1_weight (experts x 2*hidden x dim):
    the plugin's automatic split makes them two pieces (even and odd rows). torchtitan's real
    gpt_oss debug model trains on 2 gloo ranks (FlexAttention runs densely on CPU, cpu_shims
    shim 6), and the plan the optimizer built shows the split."""
    run = run_titan(GPT_OSS, tmp_path, "--training.steps", "4", "--training.seq_len", "64")
    assert run.returncode == 0, run.report()
    losses = run.losses()
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1] - 0.4, losses  # 12.86 -> 12.22
    for record in run.records:
        plan = record["optimizers"]["plan"]
        mlp1 = [m for m in plan if re.fullmatch(r"layers\.\d+\.moe\.experts\.mlp1_weight\[\d\]", m["name"])]
        assert len(mlp1) == 2 * 4  # 4 layers x (gate, up)
        assert sorted({tuple(m["piece"][::2]) for m in mlp1}) == [(0, 2), (1, 2)]  # (start, step)
        g = _groups(record)
        shapes = dict(zip(g["dion3"]["names"], g["dion3"]["shapes"]))
        fused = shapes["layers.0.moe.experts.mlp1_weight"]
        assert all(m["shape"][-2] * 2 == fused[-2] and m["shape"][-1] == fused[-1] for m in mlp1), (mlp1, fused)
        assert not any(n.endswith("_bias") for n in g["dion3"]["names"])  # mlp1/mlp2 biases -> AdamW
