"""Writing Stable Diffusion text encoders in the original single-file layout, for tests.

The inverse of gencli's single-file key maps, written independently of them (by the OpenCLIP and
OpenAI module names) so that a test can save a random transformers text encoder as an original
checkpoint would hold it, and check both gencli and diffusers' conversion against the model it came from.
"""

from __future__ import annotations

import torch


def _flat(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' text tower names without the ``text_model.`` level (transformers 5 drops it for
    CLIPTextModel, keeps it under CLIPTextModelWithProjection); buffers left out."""
    out = {}
    for k, v in state.items():
        if k.endswith("position_ids"):
            continue
        out[k.removeprefix("text_model.")] = v
    return out


def openai_clip_to_original(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """OpenAI CLIP ViT-L as SD 1.x / SDXL files store it: transformers' names (``text_model.`` level
    included, as transformers 4 wrote them) under ``prefix``, with the ``position_ids`` buffer."""
    out = {f"{prefix}text_model.{k}": v.clone() for k, v in _flat(state).items()}
    n = out[f"{prefix}text_model.embeddings.position_embedding.weight"].shape[0]
    out[f"{prefix}text_model.embeddings.position_ids"] = torch.arange(n)[None]
    return out


def open_clip_to_original(state: dict[str, torch.Tensor], prefix: str, *, extra_layer_seed: int | None = None) -> dict[str, torch.Tensor]:
    """An OpenCLIP text tower (SD 2.x ``cond_stage_model.model.``, SDXL ``conditioner.embedders.1.model.``):
    q/k/v packed into ``attn.in_proj_*``, ``text_projection`` as the (width, dim) matrix OpenCLIP
    multiplies by, plus ``logit_scale``. ``extra_layer_seed``: append one more random residual block and
    a random projection, as an SD 2.x file holds the ViT-H layer its conditioning does not use."""
    flat = _flat(state)
    out: dict[str, torch.Tensor] = {
        "token_embedding.weight": flat["embeddings.token_embedding.weight"],
        "positional_embedding": flat["embeddings.position_embedding.weight"],
        "ln_final.weight": flat["final_layer_norm.weight"],
        "ln_final.bias": flat["final_layer_norm.bias"],
        "logit_scale": torch.tensor(4.6052),
    }
    if "text_projection.weight" in flat:
        out["text_projection"] = flat["text_projection.weight"].t()
    layers = sorted({int(k.split(".")[2]) for k in flat if k.startswith("encoder.layers.")})
    names = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj", "self_attn.out_proj": "attn.out_proj"}
    for i in layers:
        src, dst = f"encoder.layers.{i}.", f"transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{dst}attn.in_proj_{kind}"] = torch.cat([flat[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv"])
            for hf, oc in names.items():
                out[f"{dst}{oc}.{kind}"] = flat[f"{src}{hf}.{kind}"]
    if extra_layer_seed is not None:
        g = torch.Generator().manual_seed(extra_layer_seed)
        last, new = f"transformer.resblocks.{layers[-1]}.", f"transformer.resblocks.{layers[-1] + 1}."
        for k in [k for k in out if k.startswith(last)]:
            out[new + k[len(last) :]] = torch.randn(out[k].shape, generator=g)
        width = out["positional_embedding"].shape[1]
        out["text_projection"] = torch.randn(width, width // 2, generator=g)
    return {prefix + k: v.clone().contiguous() for k, v in out.items()}


# A few tensors of the other components, so the text encoders are read out of a whole checkpoint.
def other_components(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.diffusion_model.input_blocks.0.0.weight": torch.randn(8, 4, 3, 3, generator=g),
        "model.diffusion_model.out.2.bias": torch.randn(4, generator=g),
        "first_stage_model.decoder.conv_in.weight": torch.randn(8, 4, 3, 3, generator=g),
        "first_stage_model.quant_conv.bias": torch.randn(8, generator=g),
    }
