"""Image classification (ViT, DeiT) and the image inputs the image families share."""
