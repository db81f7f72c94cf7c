#!/usr/bin/env python
"""Train a SentencePiece tokenizer on raw text files or folders.

    python tools/train_tokenizer.py --input corpus/ --model-prefix tok/spm --vocab-size 32000

writes tok/spm.model (use --tokenizer-type SentencePieceTokenizer --tokenizer-model
tok/spm.model). Text is kept exactly (identity normalisation, byte fallback); eos is eod.
"""
import argparse
import sys
import time

from gigatron.data.sentencepiece_trainer import train_sentencepiece


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Train a SentencePiece model", allow_abbrev=False)
    p.add_argument("--input", nargs="+", required=True, help="text files or folders")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-type", choices=("bpe", "unigram", "char", "word"), default="bpe")
    p.add_argument("--input-sentence-size", type=int, default=1_000_000,
                   help="lines sampled for training (0 = all)")
    p.add_argument("--max-bytes", type=int, default=0, help="read at most this much text")
    p.add_argument("--character-coverage", type=float, default=0.9999)
    p.add_argument("--suffixes", nargs="*", default=[],
                   help="in folders, only files ending so (e.g. .txt .py)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        model = train_sentencepiece(args.input, args.model_prefix, args.vocab_size,
                                    args.model_type, args.input_sentence_size, args.max_bytes,
                                    args.character_coverage, args.threads, args.suffixes)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {model} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
