"""Offline training corpus for dion3_titan: English text already on this machine
(CPython's own docstrings and its language-reference topics), a BPE tokenizer trained on it,
and a torchtitan dataset registration so `[training] dataset = "dion3_docs"` works with no network.

Build with `python -m dion3_titan.data.build --size small` (debug runs) or `--size large`
(quality runs: >= 5M tokens, 8192-token vocabulary, held-out split, uint16 .bin files).
"""
