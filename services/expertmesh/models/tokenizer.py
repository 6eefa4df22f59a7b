"""A byte-level tokenizer that needs no download, for the embedded model.

Every UTF-8 byte is one token (GPT-2's byte-to-unicode alphabet, so any text
round-trips), after three special tokens; ids up to the model's vocabulary
size that no byte uses are named ``<extra_N>`` so every id the model can sample
decodes. It carries a ChatML chat template (``chat_template``), so chat requests work on the embedded and
tiny models. Saved next to the checkpoint with ``save_pretrained`` and loaded back with ``AutoTokenizer``,
like any HuggingFace tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from expertmesh.models.chat_template import CHATML

SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: the tiny configs' pad, bos and eos


def save_byte_tokenizer(out_dir: str | Path, vocab_size: int, chat_template: str | None = CHATML) -> None:
    """The tokenizer of a ``vocab_size`` model saved in ``out_dir``; ``chat_template`` None: one without."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    base = len(SPECIALS) + len(alphabet)
    if vocab_size < base:
        raise ValueError(f"a byte-level tokenizer needs a vocabulary of at least {base}, the model has {vocab_size}")
    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *alphabet])}
    vocab.update({f"<extra_{i}>": i for i in range(base, vocab_size)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIALS) + [f"<extra_{i}>" for i in range(base, vocab_size)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", model_max_length=1 << 20
    )
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)
