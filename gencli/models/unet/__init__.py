"""The conditional denoising UNet of Stable Diffusion (diffusers' ``UNet2DConditionModel``) and its single-file (original layout) form."""
