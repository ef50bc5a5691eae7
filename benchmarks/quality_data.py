"""The data of scripts/quality_run.py: the token ids of a corpus built by
scripts/build_quality_corpus.py, the training windows in one seeded order shared by every run,
and the fixed validation set."""

from __future__ import annotations

import json
import os

import numpy as np
import torch


def load_corpus(folder: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """train and validation token ids (int64 on ``device``: the whole corpus is ~45 MB) and
    the corpus' meta.json."""
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)

    def read(name: str) -> torch.Tensor:
        ids = np.fromfile(os.path.join(folder, name), dtype=np.uint16).astype(np.int64)
        return torch.from_numpy(ids).to(device)

    return read("train.bin"), read("val.bin"), meta


def batch_order(n_chunks: int, steps: int, batch: int, seed: int) -> np.ndarray:
    """(steps, batch) indices of non-overlapping training windows: a fresh seeded permutation
    per epoch, so every window is seen once before any repeats; identical for every run."""
    rng = np.random.default_rng(seed)
    need = steps * batch
    perms = [rng.permutation(n_chunks) for _ in range(-(-need // n_chunks))]
    return np.concatenate(perms)[:need].reshape(steps, batch)


def windows(ids: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets for windows of seq_len + 1 tokens at ``starts``."""
    idx = starts[:, None] + torch.arange(seq_len + 1, device=ids.device)
    w = ids[idx]
    return w[:, :-1], w[:, 1:]


class TrainBatches:
    def __init__(self, ids: torch.Tensor, seq_len: int, batch: int, steps: int, seed: int) -> None:
        self.ids, self.seq_len = ids, seq_len
        n_chunks = (ids.numel() - 1) // (seq_len + 1)
        self.n_chunks = n_chunks
        order = batch_order(n_chunks, steps, batch, seed) * (seq_len + 1)
        self.starts = torch.from_numpy(order).to(ids.device)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return windows(self.ids, self.starts[step], self.seq_len)


def val_batches(
    ids: torch.Tensor, seq_len: int, batch: int, max_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation set: consecutive non-overlapping windows, up to ``max_tokens``."""
    n = min((ids.numel() - 1) // (seq_len + 1), max(1, max_tokens // seq_len))
    starts = torch.arange(n, device=ids.device) * (seq_len + 1)
    return [windows(ids, s, seq_len) for s in starts.split(batch)]
