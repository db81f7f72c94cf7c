#!/usr/bin/env python
"""Tokenize JSON lines or plain text into Megatron .bin/.idx files (= `gigatron preprocess-data`).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 2

writes data/corpus_text_document.bin/.idx (train with --data-path data/corpus_text_document).
"""
import sys

from gigatron.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
