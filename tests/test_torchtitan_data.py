"""The offline corpus: reproducible build, tokenizer within the debug models' vocabulary,
.bin files that match the jsonl text, and torchtitan's dataset table serving it."""

import json
from pathlib import Path

import numpy as np

from tests.titan_helpers import ensure_corpus


def test_small_build_is_reproducible_and_consistent(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from dion3_titan.data.build import main

    default = ensure_corpus()
    main(["--size", "small", "--out", str(tmp_path / "again")])
    meta = json.loads((default / "meta.json").read_text())
    again = json.loads((tmp_path / "again" / "meta.json").read_text())
    assert meta["sha256"] == again["sha256"]  # byte-identical rebuild

    assert meta["vocab_size"] <= 2048 and meta["val_docs"] > 0 and meta["train_tokens"] > 300_000
    tok = Tokenizer.from_file(str(default / "tokenizer" / "tokenizer.json"))
    ids = np.fromfile(default / "val.bin", dtype=np.uint16)
    assert len(ids) == meta["val_tokens"] and ids.max() < meta["vocab_size"]
    first = json.loads((default / "val.jsonl").read_text().splitlines()[0])["text"]
    assert ids[0] == meta["bos_id"]
    end = int(np.argmax(ids == meta["eos_id"]))
    assert tok.decode(ids[1:end].tolist()) == first  # byte-level BPE round-trips exactly


def test_registered_in_torchtitan_dataset_table() -> None:
    from torchtitan.hf_datasets.text_datasets import DATASETS

    import dion3_titan.job_config  # noqa: F401  (registers the plugin and the datasets)

    folder = str(ensure_corpus())
    train = DATASETS["dion3_docs"].loader(folder)
    val = DATASETS["dion3_docs_val"].loader(folder)
    assert len(train) > 100 and len(val) > 0
    assert DATASETS["dion3_docs"].sample_processor(train[0]).strip()
