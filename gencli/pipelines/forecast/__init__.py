"""Forecasting with the Temporal Fusion Transformer: reading series, features, inference,
fine-tuning, backtests and plots. Submodules import torch only where they run the model."""
