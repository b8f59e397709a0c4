"""`gencli txt2img`."""

from gencli.cli import app
from gencli.cli.common import placeholder

placeholder(app, "txt2img", "Generate images from a text prompt with latent diffusion.", "text-to-image")
