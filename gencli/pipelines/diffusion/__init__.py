"""Stable Diffusion: pipeline loading, prompt encoding, the denoising loop, the VAE, latent files, PNG parameters, jobs."""
