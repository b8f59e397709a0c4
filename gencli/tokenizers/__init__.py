"""Tokenizers: sentencepiece, tokenizer.json (the tokenizers library), byte-level and CLIP BPE."""
