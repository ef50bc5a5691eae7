"""Build an offline corpus + tokenizer: `python -m dion3_titan.data.build --size small|large`.

Output folder (default data/dion3_docs_<size>, relative to the working directory, git-ignored):
  train.jsonl, val.jsonl   one {"id", "text"} document per line (torchtitan's dataset reads these)
  tokenizer/               tokenizer.json + tokenizer_config.json (point model.hf_assets_path here)
  train.bin, val.bin       uint16 token ids, each document as BOS text EOS, concatenated
  meta.json                sizes, token counts, sources, SHA-256 of every file
The build is deterministic for a given Python build and package set (fixed document order,
hash-based split, single-pass BPE training) and writes into a temporary folder that is renamed
into place at the end, so an interrupted build never leaves a half-written corpus behind.
"""

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile

import numpy as np

from dion3_titan.data.corpus import Document, documents, is_validation, package_versions
from dion3_titan.data.tokenizer import BOS, EOS, save_tokenizer, train_tokenizer

# Per-size defaults. small: the llama3/deepseek debug models' 2048-entry embedding.
# large: quality runs; 8192 entries and at least 5M training tokens.
DEFAULTS = {
    "small": {"vocab_size": 2048, "min_tokens": 0},
    "large": {"vocab_size": 8192, "min_tokens": 5_000_000},
}
FILES = ("train.jsonl", "val.jsonl", "train.bin", "val.bin", "meta.json")


def default_out(size: str) -> str:
    return os.path.join("data", f"dion3_docs_{size}")


def is_built(out: str) -> bool:
    """True when `out` holds a finished build (meta.json is written last)."""
    return os.path.isfile(os.path.join(out, "meta.json")) and os.path.isfile(
        os.path.join(out, "tokenizer", "tokenizer.json")
    )


def _write_jsonl(path: str, docs: list[Document]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"id": d.doc_id, "text": d.text}, ensure_ascii=False) + "\n")


def _write_bin(path: str, tok, docs: list[Document]) -> int:
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch([d.text for d in docs]):
        ids.append(bos)
        ids.extend(enc.ids)
        ids.append(eos)
    np.asarray(ids, dtype=np.uint16).tofile(path)
    return len(ids)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build(size: str, out: str, vocab_size: int, val_percent: float, min_tokens: int) -> dict:
    if not 2 <= vocab_size <= 65535:
        raise ValueError(f"vocab_size must be in [2, 65535] (uint16 .bin files), got {vocab_size}")
    if not 0 < val_percent < 50:
        raise ValueError(f"val_percent must be in (0, 50), got {val_percent}")
    docs = documents(size)
    train = [d for d in docs if not is_validation(d, val_percent)]
    val = [d for d in docs if is_validation(d, val_percent)]
    if not val:
        raise RuntimeError(f"val_percent={val_percent} left no validation documents")

    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the corpus is ordinary data
    try:
        tok = train_tokenizer((d.text for d in train), vocab_size)
        save_tokenizer(tok, os.path.join(tmp, "tokenizer"))
        _write_jsonl(os.path.join(tmp, "train.jsonl"), train)
        _write_jsonl(os.path.join(tmp, "val.jsonl"), val)
        n_train = _write_bin(os.path.join(tmp, "train.bin"), tok, train)
        n_val = _write_bin(os.path.join(tmp, "val.bin"), tok, val)
        if n_train < min_tokens:
            raise RuntimeError(
                f"corpus has {n_train:,} training tokens, fewer than min_tokens={min_tokens:,}; "
                f"sources found: {package_versions()}"
            )
        names = [*FILES[:-1], "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"]
        meta = {
            "size": size,
            "vocab_size": tok.get_vocab_size(),
            "bos_id": tok.token_to_id(BOS),
            "eos_id": tok.token_to_id(EOS),
            "val_percent": val_percent,
            "train_docs": len(train),
            "val_docs": len(val),
            "train_tokens": n_train,
            "val_tokens": n_val,
            "train_chars": sum(len(d.text) for d in train),
            "python": platform.python_version(),
            "packages": package_versions() if size == "large" else {},
            "sha256": {n: sha256(os.path.join(tmp, n)) for n in names},
        }
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(DEFAULTS), default="small")
    p.add_argument("--out", help="output folder (default data/dion3_docs_<size>)")
    p.add_argument("--vocab-size", type=int, help="BPE vocabulary incl. BOS/EOS (small 2048, large 8192)")
    p.add_argument("--val-percent", type=float, default=2.0, help="share of documents held out")
    p.add_argument("--min-tokens", type=int, help="fail if fewer training tokens (large: 5M)")
    p.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    a = p.parse_args(argv)
    out = a.out or default_out(a.size)
    if is_built(out) and not a.force:
        print(f"{out} already built (use --force to rebuild)")
        return
    d = DEFAULTS[a.size]
    meta = build(
        a.size,
        out,
        vocab_size=a.vocab_size or d["vocab_size"],
        val_percent=a.val_percent,
        min_tokens=d["min_tokens"] if a.min_tokens is None else a.min_tokens,
    )
    print(
        f"built {out}: {meta['train_docs']} train / {meta['val_docs']} val documents, "
        f"{meta['train_tokens']:,} / {meta['val_tokens']:,} tokens, vocab {meta['vocab_size']}"
    )


if __name__ == "__main__":
    sys.exit(main())
