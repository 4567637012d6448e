"""A tiny random Llama saved as a Hugging Face checkpoint, with a BPE tokenizer trained
on the text CPython ships (pydoc topics) and that text as a file: everything the README's
real-model walk-through needs, without a download (needs transformers, tokenizers).

    python scripts/make_tiny_llama.py --out runs/tiny-llama --text runs/corpus.txt
"""

import argparse
from pathlib import Path

from jaxpar.data import corpus_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint folder")
    parser.add_argument("--text", type=Path, required=True, help="where the text goes")
    parser.add_argument("--vocab", type=int, default=512)
    args = parser.parse_args()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    text = corpus_bytes().decode()
    args.text.parent.mkdir(parents=True, exist_ok=True)
    args.text.write_text(text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text.split("\n\n"), trainer)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(args.out)
    tok.save(str(args.out / "tokenizer.json"))
    print(f"wrote {args.out} (LlamaForCausalLM, tokenizer.json) and {args.text}")


if __name__ == "__main__":
    main()
