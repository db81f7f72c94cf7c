#!/usr/bin/env python
"""Train a SentencePiece tokenizer on raw text files or folders (= `gigatron train-tokenizer`).

    python tools/train_tokenizer.py --input corpus/ --model-prefix tok/spm --vocab-size 32000

writes tok/spm.model (use --tokenizer-type SentencePieceTokenizer --tokenizer-model
tok/spm.model). Text is kept exactly (identity normalisation, byte fallback); eos is eod.
"""
import sys

from gigatron.data.sentencepiece_trainer import main

if __name__ == "__main__":
    sys.exit(main())
