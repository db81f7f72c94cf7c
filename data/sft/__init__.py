"""Supervised fine-tuning data (`--sft`): conversations from JSON-lines files, tokenized with
the tokenizer's chat template, the loss on the assistant's tokens, packed per line into the
batch format of packed documents (data/documents.py). docs/SFT.md tells the whole path."""
