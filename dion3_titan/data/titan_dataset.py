"""Registers the offline corpus in torchtitan's dataset table (`hf_datasets.text_datasets.DATASETS`).

  [training]   dataset = "dion3_docs"      dataset_path = "data/dion3_docs_small"
  [validation] dataset = "dion3_docs_val"  dataset_path = "data/dion3_docs_small"
`dataset_path` is the folder written by `python -m dion3_titan.data.build`. Documents are read
from its jsonl files into an in-memory `datasets.Dataset` (no hub, no cache, no network); torchtitan's
HuggingFaceTextDataset then tokenizes, packs to seq_len, shards by data-parallel rank and
checkpoints its position as for any map-style dataset.
"""

import json
import os
from typing import Any

from datasets import Dataset
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

from dion3_titan.data.build import default_out


def _load_split(folder: str, split: str) -> Dataset:
    path = os.path.join(folder, f"{split}.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} not found: build the corpus first with "
            f"`python -m dion3_titan.data.build --size small` (or --size large --out {folder})"
        )
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    return Dataset.from_dict({"text": texts})


def _text(sample: dict[str, Any]) -> str:
    return sample["text"]


def register_datasets() -> None:
    """Idempotent. Default path: the small corpus, relative to the working directory."""
    small = default_out("small")
    DATASETS.setdefault("dion3_docs", DatasetConfig(small, lambda p: _load_split(p, "train"), _text))
    DATASETS.setdefault("dion3_docs_val", DatasetConfig(small, lambda p: _load_split(p, "val"), _text))
