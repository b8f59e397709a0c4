"""Model architectures as pure nn.Modules (no I/O)."""
