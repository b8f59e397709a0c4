"""`gencli classify`."""

from gencli.cli import app
from gencli.cli.common import placeholder

placeholder(app, "classify", "Classify images with a ViT checkpoint.", "image classification")
