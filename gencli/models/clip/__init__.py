"""CLIP (transformers' ``CLIPModel`` layout): the model and the OpenAI/open_clip key names."""
