"""gencli: run generative and predictive models from safetensors checkpoints.

This package's top level imports nothing heavy: ``gencli --help`` must start without torch.
"""

__version__ = "0.1.0"
