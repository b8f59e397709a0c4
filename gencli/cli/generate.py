"""`gencli generate`."""

from gencli.cli import app
from gencli.cli.common import placeholder

placeholder(app, "generate", "Generate text with a GPT-2 or Llama-family model (streams tokens).", "text generation")
