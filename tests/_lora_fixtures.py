"""Random LoRA files for the tiny test pipelines, in kohya's and diffusers' (PEFT) formats."""

from __future__ import annotations

from pathlib import Path

import torch

UNET_TARGETS = ("attn1.to_q", "attn1.to_k", "attn2.to_k", "attn2.to_v", "attn1.to_out.0", "attn2.to_q", "proj_in", "proj_out", "ff.net.0.proj",
                "ff.net.2", "resnets.0.conv1", "resnets.0.conv2", "time_emb_proj")  # fmt: skip
TEXT_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")


def _modules(model, targets):
    return [(name, m) for name, m in model.named_modules() if name.endswith(targets) and isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]


def random_lora(ref, fmt: str, *, rank: int = 4, alpha: float = 2.0, seed: int = 0, text: bool = True, original_names=None) -> dict[str, torch.Tensor]:
    """A LoRA for diffusers pipeline ``ref`` touching its attention, feed-forward, conv (LoCon, 3x3)
    and text-encoder layers. ``fmt``: ``kohya`` (``lora_unet_*`` with ``alpha``; the UNet named in the
    original layout when ``original_names`` maps diffusers paths to it, as kohya's SDXL files are) or
    ``peft`` (``unet.<path>.lora_A.weight``, no alpha: scale 1)."""
    g = torch.Generator().manual_seed(seed)
    sdxl = getattr(ref, "text_encoder_2", None) is not None
    comps = [("unet", ref.unet, UNET_TARGETS)]
    if text:
        comps.append(("text_encoder", ref.text_encoder, TEXT_TARGETS))
        if sdxl:
            comps.append(("text_encoder_2", ref.text_encoder_2, TEXT_TARGETS))
    state = {}
    for comp, model, targets in comps:
        for name, m in _modules(model, targets):
            if isinstance(m, torch.nn.Conv2d):
                down = torch.randn(rank, m.in_channels, *m.kernel_size, generator=g) * 0.15
                up = torch.randn(m.out_channels, rank, 1, 1, generator=g) * 0.15
            else:
                down = torch.randn(rank, m.in_features, generator=g) * 0.15
                up = torch.randn(m.out_features, rank, generator=g) * 0.15
            if fmt == "peft":
                path = name if comp == "unet" or name.startswith("text_model.") else "text_model." + name
                state[f"{comp}.{path}.lora_A.weight"] = down
                state[f"{comp}.{path}.lora_B.weight"] = up
                continue
            if comp == "unet":
                key = "lora_unet_" + (original_names[name] if original_names else name).replace(".", "_")
            else:
                path = name if name.startswith("text_model.") else "text_model." + name
                te = {"text_encoder": "lora_te1_" if sdxl else "lora_te_", "text_encoder_2": "lora_te2_"}[comp]
                key = te + path.replace(".", "_")
            state[key + ".lora_down.weight"] = down
            state[key + ".lora_up.weight"] = up
            state[key + ".alpha"] = torch.tensor(alpha)
    return state


def save_lora(state: dict[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path
