"""benchmarks/timeline.py's arithmetic on synthetic traces (the tool itself needs a GPU): spans
read from a chrome trace, per-stream use, the device's busy union and idle gaps, checked against
a grid of microseconds that marks every busy one."""

import random

import pytest

from benchmarks.timeline import device_spans, report, summarize


def _trace(seed: int, n: int = 40) -> list[dict]:
    rng = random.Random(seed)
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5, "dur": 999}]  # host side: ignored
    for _ in range(n):
        start = rng.randrange(0, 3000)
        cat = rng.choice(("kernel", "kernel", "gpu_memcpy", "gpu_memset"))
        events.append(
            {
                "ph": "X",
                "cat": cat,
                "name": f"k{rng.randrange(5)}",
                "ts": start + 100,
                "dur": rng.randrange(1, 200),
                "args": {"stream": rng.choice((7, 13, 14))},
            }
        )
    rng.shuffle(events)
    return events


@pytest.mark.parametrize("draw", range(5))
def test_union_gaps_and_streams_match_a_grid(seed: int, draw: int) -> None:
    seed = seed * 7 + draw
    events = _trace(seed)
    spans = device_spans(events)
    device = [e for e in events if e["cat"] != "cpu_op"]
    assert len(spans) == len(device), f"seed {seed}"
    assert [s.start for s in spans] == sorted(s.start for s in spans), f"seed {seed}"
    t0 = min(e["ts"] for e in device)
    end = max(e["ts"] + e["dur"] for e in device)
    busy = [False] * (end - t0)
    for e in device:
        for t in range(e["ts"] - t0, e["ts"] + e["dur"] - t0):
            busy[t] = True
    s = summarize(spans)
    assert s.span_us == end - t0, f"seed {seed}"
    assert s.union_busy_us == sum(busy), f"seed {seed}"
    assert s.union_busy_us + sum(g for _, g in s.gaps) == s.span_us, f"seed {seed}"
    for at, length in s.gaps:  # each gap is idle on the grid and bounded by busy time
        assert not any(busy[int(at) : int(at + length)]), f"seed {seed}"
        assert busy[int(at) - 1] and busy[int(at + length)], f"seed {seed}"
    for sid, use in s.streams.items():
        mine = [e for e in device if e["args"]["stream"] == sid]
        assert use.kernels == len(mine), f"seed {seed}"
        assert use.busy_us == sum(e["dur"] for e in mine), f"seed {seed}"
        assert use.first_us == min(e["ts"] for e in mine) - t0, f"seed {seed}"
        assert use.last_end_us == max(e["ts"] + e["dur"] for e in mine) - t0, f"seed {seed}"
    assert sum(c for _, c, _ in s.by_name) == len(device), f"seed {seed}"
    assert sum(d for _, _, d in s.by_name) == sum(e["dur"] for e in device), f"seed {seed}"
    lines = report(s, spans, top=3, listed=4)
    assert len(lines) == 1 + len(s.streams) + 1 + min(3, len(s.by_name)) + 1 + 4, f"seed {seed}"


def test_no_device_work() -> None:
    s = summarize(device_spans([{"cat": "cpu_op", "name": "x", "ts": 0, "dur": 3}]))
    assert s.span_us == 0 and s.streams == {} and s.gaps == []


def test_median_ms_runs_before_ahead_of_every_call() -> None:
    import torch

    from benchmarks.timing import median_ms

    calls: list[str] = []
    median_ms(lambda: calls.append("fn"), torch.device("cpu"), reps=3, warmup=2, before=lambda: calls.append("before"))
    assert calls == ["before", "fn"] * 5
