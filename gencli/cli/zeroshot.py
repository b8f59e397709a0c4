"""`gencli zeroshot`."""

from gencli.cli import app
from gencli.cli.common import placeholder

placeholder(app, "zeroshot", "Zero-shot image classification with CLIP against your labels.", "CLIP")
