"""Character-level tokenizer of the synthetic math task, built with the `tokenizers` library.

Every character is one token (WordLevel model over a pre-tokenizer that splits on every character). The
special tokens come first, so their ids are fixed: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3. The
tokenizer adds no special tokens by itself (no BOS, no EOS): callers append ``<eos>`` to training targets.
Saved as a ``PreTrainedTokenizerFast`` so ``AutoTokenizer.from_pretrained(dir)`` loads it offline.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, EOS, BOS, UNK)
# every character the task writes, plus newline for chat-style prompts later; order fixes the ids
CHARACTERS: str = " \n0123456789+-=:{}\\QAboxed"


def build_vocab() -> dict[str, int]:
    """Token -> id: the specials (ids 0-3), then one id per character of ``CHARACTERS``."""
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    if len(set(tokens)) != len(tokens):
        raise ValueError("duplicate token in the character vocabulary")
    return {token: i for i, token in enumerate(tokens)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer as a ``PreTrainedTokenizerFast``: adds no BOS/EOS, pads on the left."""
    backend = Tokenizer(models.WordLevel(vocab=build_vocab(), unk_token=UNK))
    # split before every character and keep it, so "Q: 3" -> ["Q", ":", " ", "3"]
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=128,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> list[str]:
    """Write the tokenizer files into ``out_dir``; return the names written.

    transformers 5 records its backend class name ("TokenizersBackend"); we write the older alias
    "PreTrainedTokenizerFast", which both transformers 4 (e.g. an inference engine's pin) and 5 resolve.
    Switches off any padding/truncation state left in ``tokenizer``'s backend by earlier batch calls.
    """
    # a batch call with padding=True leaves padding switched on in the backend; save the tokenizer without it
    tokenizer.backend_tokenizer.no_padding()
    tokenizer.backend_tokenizer.no_truncation()
    written = [Path(p) for p in tokenizer.save_pretrained(str(out_dir))]
    config_path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return sorted({p.name for p in written})
