"""torchtitan 0.3's fused weights are split so that no piece mixes Q, K and V (or gate and up):
each piece of a real FusedQKVLinear's wqkv equals one head of the wq/wk/wv that torchtitan's own
checkpoint hook splits it into; gpt_oss's mlp1 is split into its interleaved gate and up rows."""

import importlib

import pytest
import torch
import torch.nn as nn
from torchtitan.models.common.attention import FusedQKVLinear

from dion3_titan.optim.split import split_pieces
from dion3_titan.titan03.splits import fused_weight_specs, split_specs_for

SEED = 0


def _model_config(module: str, fn: str):
    return getattr(importlib.import_module(f"torchtitan.models.{module}.config_registry"), fn)().model_spec.model


@pytest.mark.parametrize(
    "module, fn", [("llama3", "llama3_debugmodel"), ("qwen3", "qwen3_debugmodel"), ("gpt_oss", "gpt_oss_debugmodel")]
)
def test_every_wqkv_piece_is_one_head_of_q_k_or_v(module: str, fn: str) -> None:
    (_, qkv_cfg, _, _), *_ = _model_config(module, fn).traverse(FusedQKVLinear.Config)
    holder = nn.Module()
    holder.qkv_linear = qkv_cfg.build()
    weight = holder.qkv_linear.wqkv.weight
    torch.manual_seed(SEED)
    with torch.no_grad():
        weight.copy_(torch.randn_like(weight))
    parts = holder.qkv_linear.state_dict()  # torchtitan's hook: wqkv -> wq, wk, wv
    hd = holder.qkv_linear.head_dim
    heads = {
        f"{k}{i}": parts[f"{k}.weight"][i * hd : (i + 1) * hd]
        for k in ("wq", "wk", "wv")
        for i in range(parts[f"{k}.weight"].shape[0] // hd)
    }

    pieces = split_pieces("qkv_linear.wqkv.weight", tuple(weight.shape), {"split_specs": fused_weight_specs(holder)})
    assert pieces is not None and len(pieces) == len(heads)
    matched = []
    for sl in pieces:
        block = weight.detach()[sl]
        found = [name for name, h in heads.items() if torch.equal(block, h)]
        assert len(found) == 1, f"seed {SEED}: piece {sl} is no single head of wq/wk/wv"
        matched += found
    assert sorted(matched) == sorted(heads)  # every head exactly once


def test_gpt_oss_experts_mlp1_is_split_into_interleaved_gate_and_up() -> None:
    with torch.device("meta"):
        model = _model_config("gpt_oss", "gpt_oss_debugmodel").build()
    names = [n for n, _ in model.named_parameters()]
    specs = split_specs_for(model, {}, names)
    name = "layers.0.moe.routed_experts.inner_experts.mlp1_weight_EGD"
    shape = tuple(dict(model.named_parameters())[name].shape)
    pieces = split_pieces(name, shape, {"split_specs": specs})
    assert [(p.start, p.step) for p in pieces] == [(0, 2), (1, 2)]  # its SwiGLU reads h[::2], h[1::2]


def test_user_specs_come_first_and_split_auto_false_keeps_only_them() -> None:
    with torch.device("meta"):
        model = _model_config("llama3", "llama3_debugmodel").build()
    names = [n for n, _ in model.named_parameters()]
    mine = "pattern=layers.*.attention.qkv_linear.wqkv.weight;chunks=3"
    assert split_specs_for(model, {"split_specs": mine}, names)[0] == mine
    assert split_specs_for(model, {"split_specs": mine, "split_auto": False}, names) == (mine,)
