"""Train a byte-level BPE tokenizer with the `tokenizers` package and save it in the layout
torchtitan's HuggingFaceTokenizer loads (tokenizer.json + tokenizer_config.json naming BOS/EOS)."""

import json
import os
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every byte is in the alphabet, so any text encodes without <unk>.
    `vocab_size` counts the two special tokens, so ids stay < vocab_size (the model's
    embedding size)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"trained vocab {tok.get_vocab_size()} exceeds {vocab_size}")
    return tok


def save_tokenizer(tok: Tokenizer, folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    # torchtitan reads bos/eos from here; BOS/EOS are added by its dataset, not the tokenizer.
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": False, "add_eos_token": False}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
