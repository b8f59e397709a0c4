"""`gencli sample vae|gan` and `gencli reconstruct`."""

from gencli.cli import app
from gencli.cli.common import placeholder

placeholder(app, "sample", "Sample images from a VAE or a GAN (grids, latent walks).", "VAE/GAN")
placeholder(app, "reconstruct", "Round-trip an image through a VAE.", "VAE/GAN")
