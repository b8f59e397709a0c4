"""BERT-family encoders (BERT, RoBERTa, DistilBERT): loading, sentence embeddings, fill-mask."""
