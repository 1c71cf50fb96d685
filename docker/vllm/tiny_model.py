"""Make the sandbox vLLM's tiny model locally: a Llama of 4 layers, hidden 128, seeded random weights.

Real weights (random, not trained), not a stand-in: vLLM loads and runs them like any Llama
checkpoint, and `transformers` gives the reference forward pass the tests compare with.
Nothing comes from a hub: the byte-level BPE tokenizer is trained here, with `tokenizers`, on
the fixed text below, and everything is written with `save_pretrained` (safetensors, bf16).
The same seed and text give the same files.

    python tiny_model.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SEED = 1234
VOCAB = 512
LAYERS = 4
HIDDEN = 128
# The tokenizer's training text: fixed, so the vocabulary is the same on every machine.
CORPUS = [
    "The operator prepares a GPU host over SSH, builds the serving image and starts the engine.",
    "Hidden states of the target model are captured per request and written as safetensors files.",
    "An EAGLE-3 drafter is trained on the auxiliary hidden states of three layers and the final state.",
    "vLLM serves the tiny Llama on CPU; the connector writes token ids and hidden states for each prompt.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, punctuation . , ; : ! ? ( ) [ ] { } and quotes ' \".",
    "the quick brown fox jumps over the lazy dog THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG",
]


def make_tokenizer(out: str):
    """A byte-level BPE of `VOCAB` tokens trained on `CORPUS`, saved as a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)
    return fast


def make_model(out: str, vocab_size: int) -> None:
    """A seeded random Llama (`LAYERS` layers, `HIDDEN` wide), saved in bf16."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    tok = make_tokenizer(out)
    make_model(out, vocab_size=max(VOCAB, len(tok)))
    print(out)


if __name__ == "__main__":
    main(sys.argv[1])
