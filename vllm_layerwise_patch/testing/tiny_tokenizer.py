"""The tiny model's offline tokenizer (``vllm serve`` needs one): a WordLevel
vocabulary of ``t<id>`` words, built with ``tokenizers`` next to the weights."""

from __future__ import annotations

import json
import pathlib

#: Token ids reserved in the tiny vocabulary (also in the tokenizer).
TINY_UNK_TOKEN_ID = 0
TINY_EOS_TOKEN_ID = 1
#: ``tiny_prompt`` draws from ids >= this (never a special token).
FIRST_ORDINARY_ID = 2


def write_tokenizer(path: pathlib.Path, vocab_size: int) -> None:
    """Offline WordLevel tokenizer: ids 0 ``<unk>``, 1 ``<eos>``, then ``t2``..."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": TINY_UNK_TOKEN_ID, "<eos>": TINY_EOS_TOKEN_ID}
    for i in range(FIRST_ORDINARY_ID, vocab_size):
        vocab[f"t{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "eos_token": "<eos>",
                "pad_token": "<unk>",
                "model_max_length": 1 << 20,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    (path / "special_tokens_map.json").write_text(
        json.dumps({"unk_token": "<unk>", "eos_token": "<eos>", "pad_token": "<unk>"}, indent=2)
    )
