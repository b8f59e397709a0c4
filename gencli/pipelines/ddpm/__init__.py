"""Pixel-space diffusion (DDPM / DDIM): diffusers ``DDPMPipeline`` / ``DDIMPipeline`` folders sampled seed by seed."""
