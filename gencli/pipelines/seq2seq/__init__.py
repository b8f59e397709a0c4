"""Encoder-decoder text generation (T5, Marian): loading, the seq2seq decoding loop."""
