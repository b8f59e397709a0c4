"""The KL autoencoder of latent diffusion (diffusers' ``AutoencoderKL``): the model, its tiled passes, the original layout's key names."""
