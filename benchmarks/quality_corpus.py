"""Build the pre-tokenized corpus of the training-quality runs (issue 9): data/quality/.

Two modes:
  full (default)  the "large" build of ``dion3_titan.data.build`` (CPython's docstrings and
                  language reference plus the docstrings of torch, sympy, mpmath, networkx,
                  numpy and pandas: >= 5M training tokens, byte-level BPE with 8192 entries,
                  2% of documents held out by a hash of their id). An existing finished build in
                  data/dion3_docs_large is reused when its files match their recorded SHA-256;
                  otherwise it is built there first.
  --tiny          a few hundred KB of the same kind of text (the language-reference topics that
                  ``help()`` shows), a 512-entry BPE and 10% held out: for the CPU smoke test.

Only what training reads is copied into the output folder, so that it stays small enough to
travel with a GPU run (<= 16 MB): train.bin and val.bin (uint16 token ids, each document as
BOS text EOS), tokenizer.json and meta.json (token counts, sources, SHA-256 of every file).

    python scripts/build_quality_corpus.py                 # -> data/quality
    python scripts/build_quality_corpus.py --tiny --out /tmp/tiny_corpus
"""

import argparse
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator

import numpy as np

from dion3_titan.data.build import build as build_docs
from dion3_titan.data.build import is_built, sha256
from dion3_titan.data.corpus import Document, is_validation
from dion3_titan.data.tokenizer import BOS, EOS, train_tokenizer

MAX_BYTES = 16_000_000  # the output travels with the GPU run
FULL = {"vocab_size": 8192, "val_percent": 2.0, "min_tokens": 5_000_000}
TINY = {"vocab_size": 512, "val_percent": 10.0, "docs": 120}
DEFAULT_SOURCE = os.path.join("data", "dion3_docs_large")
COPIED = ("train.bin", "val.bin", "tokenizer/tokenizer.json")


def _source_is_valid(source: str) -> bool:
    """A finished large build with the settings we need, whose files are intact."""
    if not is_built(source):
        return False
    with open(os.path.join(source, "meta.json")) as f:
        meta = json.load(f)
    if meta.get("size") != "large" or meta.get("vocab_size") != FULL["vocab_size"]:
        return False
    if meta.get("train_tokens", 0) < FULL["min_tokens"]:
        return False
    return all(sha256(os.path.join(source, n)) == meta["sha256"].get(n) for n in COPIED)


def _publish(tmp: str, out: str, meta: dict) -> None:
    """Record the files' checksums in meta.json, then move the finished folder into place."""
    meta["sha256"] = {n: sha256(os.path.join(tmp, n)) for n in ("train.bin", "val.bin", "tokenizer.json")}
    _write_json(os.path.join(tmp, "meta.json"), meta)
    _finish(tmp, out)


def _finish(tmp: str, out: str) -> None:
    """Check the size budget, then move the finished folder into place (never half-written)."""
    total = sum(os.path.getsize(os.path.join(tmp, n)) for n in os.listdir(tmp))
    if total > MAX_BYTES:
        raise RuntimeError(f"corpus folder is {total:,} bytes, over the {MAX_BYTES:,}-byte budget")
    if os.path.exists(out):
        shutil.rmtree(out)
    os.replace(tmp, out)


@contextlib.contextmanager
def _staging(out: str) -> Iterator[str]:
    """A fresh folder beside ``out`` to build into; removed if the build fails (a finished
    build is moved into place by ``_publish``)."""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=parent)
    os.chmod(tmp, 0o755)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def build_full(out: str, source: str = DEFAULT_SOURCE) -> dict:
    """data/quality from the large docs build (built into ``source`` first when needed)."""
    if not _source_is_valid(source):
        build_docs("large", source, **FULL)
    with open(os.path.join(source, "meta.json")) as f:
        src_meta = json.load(f)
    with _staging(out) as tmp:
        for name in COPIED:
            shutil.copyfile(os.path.join(source, name), os.path.join(tmp, os.path.basename(name)))
        meta = {
            "mode": "full",
            "source": os.path.relpath(os.path.abspath(source)),
            "builder": "dion3_titan.data.build (size=large)",
            **{k: v for k, v in src_meta.items() if k != "sha256"},
            "dtype": "uint16",
        }
        _publish(tmp, out, meta)
    return meta


def tiny_documents(n_docs: int) -> list[Document]:
    """The first ``n_docs`` language-reference topics long enough to be prose (sorted names,
    so the selection is fixed for a given Python)."""
    from pydoc_data.topics import topics

    docs = [Document(f"topic:{k}", topics[k].strip()) for k in sorted(topics)]
    return [d for d in docs if len(d.text) >= 200][:n_docs]


def _write_bin(path: str, tok, docs: list[Document]) -> int:
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch([d.text for d in docs]):
        ids += [bos, *enc.ids, eos]
    np.asarray(ids, dtype=np.uint16).tofile(path)
    return len(ids)


def build_tiny(out: str, n_docs: int = TINY["docs"], vocab_size: int = TINY["vocab_size"]) -> dict:
    docs = tiny_documents(n_docs)
    train = [d for d in docs if not is_validation(d, TINY["val_percent"])]
    val = [d for d in docs if is_validation(d, TINY["val_percent"])]
    if not val or not train:
        raise RuntimeError(f"{n_docs} documents gave {len(train)} train / {len(val)} validation")
    with _staging(out) as tmp:
        tok = train_tokenizer((d.text for d in train), vocab_size)
        tok.save(os.path.join(tmp, "tokenizer.json"))
        n_train = _write_bin(os.path.join(tmp, "train.bin"), tok, train)
        n_val = _write_bin(os.path.join(tmp, "val.bin"), tok, val)
        meta = {
            "mode": "tiny",
            "source": "pydoc_data.topics",
            "vocab_size": tok.get_vocab_size(),
            "bos_id": tok.token_to_id(BOS),
            "eos_id": tok.token_to_id(EOS),
            "val_percent": TINY["val_percent"],
            "train_docs": len(train),
            "val_docs": len(val),
            "train_tokens": n_train,
            "val_tokens": n_val,
            "dtype": "uint16",
        }
        _publish(tmp, out, meta)
    return meta


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="output folder (default data/quality, or data/quality_tiny with --tiny)")
    p.add_argument("--tiny", action="store_true", help="small corpus for CPU smoke tests")
    p.add_argument("--source", default=DEFAULT_SOURCE, help="large docs build to reuse or create")
    a = p.parse_args(argv)
    out = a.out or os.path.join("data", "quality_tiny" if a.tiny else "quality")
    meta = build_tiny(out) if a.tiny else build_full(out, a.source)
    print(
        f"built {out}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens, vocab {meta['vocab_size']}"
    )


if __name__ == "__main__":
    main()
