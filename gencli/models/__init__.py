"""Model definitions: pure ``nn.Module``s (no I/O), one module per family."""
