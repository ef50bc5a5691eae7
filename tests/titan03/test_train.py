"""Real torchtitan 0.3 training with Dion3Optimizers: torchrun, gloo on CPU, FSDP2 (and TP, EP)."""

import math
import re
from pathlib import Path

import pytest

from tests.titan03.helpers import ensure_corpus, run_titan03
from tests.titan_helpers import write_poison

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", autouse=True)
def corpus() -> Path:
    return ensure_corpus()


def test_llama3_dion3_20_steps_loss_falls_and_fused_qkv_splits_per_head(tmp_path: Path) -> None:
    run = run_titan03(
        "llama3_debug_dion3",
        tmp_path,
        "--training.steps",
        "20",
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        "2",
        "--validator.no-enable",
    )
    assert run.returncode == 0, run.report()
    losses = run.losses()
    assert sorted(losses) == list(range(1, 21))
    first, last5 = losses[1], sum(losses[s] for s in range(16, 21)) / 5
    assert last5 < first - 1.0, losses
    assert "[dion3] step" in run.output and "comm_MB" in run.output  # metrics reached the log
    for record in run.records:
        opts = record["optimizers"]
        assert opts["container"] == "Dion3Optimizers"
        dion3, adamw = opts["optimizers"]
        assert (dion3["class"], adamw["class"]) == ("Dion3", "AdamW")
        (group,) = dion3["groups"]
        assert group["fraction"] == 0.25 and group["flavor"] == "normuon"
        assert len(group["names"]) == 6 * 5  # wqkv, wo, w1, w2, w3 per layer
        assert all(
            re.fullmatch(r"layers\.\d\.(attention\.(qkv_linear\.wqkv|wo)|feed_forward\.w[123])\.weight", n)
            for n in group["names"]
        ), group["names"]
        # 0.3 fuses Q, K and V per KV group: 16 heads x (q, k, v) blocks of head_dim = 16 rows
        wqkv = [m for m in opts["plan"] if m["name"].startswith("layers.0.attention.qkv_linear.wqkv")]
        assert len(wqkv) == 48 and all(m["shape"] == [16, 256] for m in wqkv), wqkv
        assert sorted(m["piece"][0] for m in wqkv) == list(range(0, 768, 16))
        # clipping is on (max_norm 1): every step's non-finite flag came from its gradient norm
        assert record["nonfinite"] == {"flag_sources": [{"gradient_norm": 20, "own_pass": 0}], "skipped_steps": [0]}


@pytest.mark.parametrize("clipping", [True, False])
def test_an_inf_gradient_is_skipped_with_and_without_clipping(tmp_path: Path, clipping: bool) -> None:
    """nonfinite = "skip" with an inf planted in one gradient on one rank at step 2. With
    clipping (max_norm 1) the step's flag comes from the clipping norm, inf on every rank; with
    max_norm = 0 (torchtitan has no off switch; 0 scales every gradient by 0) no norm is handed
    over and Dion3's own pass catches it (NaN after the clip). Either way every rank skips it.
    torchtitan's own AdamW (fused) skips it with Dion3 when the flag comes from the norm, which
    covers its gradients too; with Dion3's own pass it steps (on gradients the clip zeroed)."""
    steps = 4 if clipping else 3
    write_poison(tmp_path, step=2, param="layers.0.attention.wo.weight")
    run = run_titan03(
        "llama3_debug_dion3_skip",
        tmp_path,
        *("--training.steps", str(steps), "--training.seq_len", "64", "--validator.no-enable"),
        *(() if clipping else ("--training.max_norm", "0")),
    )
    assert run.returncode == 0, run.report()
    losses = run.losses()
    assert sorted(losses) == list(range(1, steps + 1)) and all(math.isfinite(v) for v in losses.values()), losses
    sources = {"gradient_norm": steps, "own_pass": 0} if clipping else {"gradient_norm": 0, "own_pass": steps}
    for record in run.records:
        assert record["nonfinite"] == {"flag_sources": [sources], "skipped_steps": [1]}, record["nonfinite"]
        assert record["titan_steps"] == [[steps - 1.0 if clipping else float(steps)]], record["titan_steps"]


def test_deepseek_v3_moe_with_fsdp_tp_and_ep_on_4_ranks(tmp_path: Path) -> None:
    """FSDP x TP (2 x 2) with experts over EP (2): Dion3 steps matrices sharded every way."""
    run = run_titan03(
        "deepseek_v3_debug_dion3",
        tmp_path,
        "--training.steps",
        "3",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.expert_parallel_degree",
        "2",
        nproc=4,
    )
    assert run.returncode == 0, run.report()
    losses = run.losses()
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1], losses
    record = run.records[0]["optimizers"]
    assert record["pre_hooks"] >= 1  # torchtitan's MoE expert-bias hook on our container
    (group,) = record["optimizers"][0]["groups"]
    sharded = dict(zip(group["names"], group["sharded_over"]))
    experts = {n: s for n, s in sharded.items() if ".inner_experts." in n}
    assert experts and all(re.search(r"w[123]_[A-Z]+$", n) for n in experts)
    assert all("ep" in s for s in experts.values()), experts
    assert any("tp" in s for n, s in sharded.items() if ".attention." in n), sharded
    assert any("fsdp" in s or "dp_shard" in s for s in sharded.values()), sharded
    assert not any("router.gate" in n for n in sharded)  # the router gate stays with AdamW
