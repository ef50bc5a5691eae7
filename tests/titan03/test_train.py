"""Real torchtitan 0.3 training with Dion3Optimizers: torchrun, gloo on CPU, FSDP2 (and TP, EP)."""

import re
from pathlib import Path

import pytest

from tests.titan03.helpers import ensure_corpus, run_titan03

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
    assert run.returncode == 0, run.output[-4000:]
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
    assert run.returncode == 0, run.output[-4000:]
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
