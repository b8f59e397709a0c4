"""The image generators other than diffusion (ConvVAE, DCGAN): loading, sampling, outputs, reconstruction, quality."""
