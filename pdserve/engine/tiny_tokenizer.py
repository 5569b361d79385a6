"""The built-in checkpoints' tokenizer: a byte-level BPE trained on engine/data/corpus.txt, padded to
a model's vocabulary, with ChatML special tokens and chat template (`tiny_model` writes it out)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(vocab_size: int = 2048) -> Tokenizer:
    """Byte-level BPE trained on engine/data/corpus.txt (deterministic for a given corpus)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = CORPUS.read_text(encoding="utf-8")
    tok.train_from_iterator(text.split("\n"), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def pad_tokenizer(tok: Tokenizer, vocab_size: int) -> Tokenizer:
    """Grow the BPE vocabulary to exactly `vocab_size` ids, deterministically.

    The corpus yields fewer merges than a model's vocabulary (1,761 vs 32,000 for
    `bench`), and an id the tokenizer does not know decodes to empty text, so a
    client streaming random-weight output would see empty chunks. The new ids are
    two-word phrases (" the" + " model" -> " the model") added to the vocabulary
    without merges: encoding never produces them, decoding gives readable text.
    """
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    have = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size < have:
        raise ValueError(f"vocab_size {vocab_size} is below the trained tokenizer's {have} ids")
    # "Ġ" is the byte-level alphabet's space: word-initial tokens of letters only, by id
    words = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t[:1] == "Ġ" and t[1:].isalpha()]
    next_id = have
    for first in words:
        for second in words:
            if next_id == vocab_size:
                break
            phrase = first + second
            if phrase not in vocab:
                vocab[phrase] = next_id
                next_id += 1
    assert next_id == vocab_size, f"only {next_id} ids from {len(words)} words; need {vocab_size}"
    return Tokenizer.from_str(json.dumps(data))
