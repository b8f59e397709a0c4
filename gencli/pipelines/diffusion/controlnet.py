"""ControlNet for txt2img / img2img: the model, loaded from what people download, and its conditioning image.

- a diffusers ``ControlNetModel`` folder (``config.json`` + ``diffusion_pytorch_model.safetensors``, or a
  ``variant``), e.g. ``lllyasviel/sd-controlnet-canny``, ``diffusers/controlnet-canny-sdxl-1.0``;
- a single file in the original layout (A1111's ``control_v11p_sd15_canny.safetensors``): the
  ``input_blocks`` / ``middle_block`` of the UNet's down path, ``input_hint_block`` (the conditioning
  image's convolutions), ``zero_convs`` and ``middle_block_out``, with or without a ``control_model.``
  prefix; the architecture is the pipeline's UNet's (a ControlNet is a copy of its down path), the
  conditioning convolutions' widths read from the file.

The conditioning image (edges, depth, pose, ... already made: gencli does not run annotators) is read
once, resized to each image's size with Lanczos and scaled to ``[0, 1]``, as diffusers' control image
processor does. Each denoising step runs the ControlNet on the same latents, timestep and prompt
embeddings as the UNet (both halves of classifier-free guidance), and the UNet adds its residuals,
scaled by ``--control-scale``, on the steps between ``--control-start`` and ``--control-end`` (fractions
of the run, diffusers' ``control_guidance_start/end``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from gencli.backend.device import Placement
from gencli.checkpoints.formats import open_source
from gencli.checkpoints.keymap import Drop, KeyMap, Rename
from gencli.checkpoints.loader import load_model
from gencli.checkpoints.reader import TensorReader
from gencli.errors import CheckpointError, UserError
from gencli.models.unet.controlnet import ControlNetConfig, ControlNetModel
from gencli.models.unet.single_file import original_unet_keymap
from gencli.models.unet.unet_2d_condition import UNet2DConditionModel
from gencli.pipelines.diffusion.unet_loading import DIFFUSERS_UNET, prepare_for_device

MAX_CONTROL_SCALE = 10.0
LDM_PREFIX = "control_model."
_HINT = re.compile(r"^(?:control_model\.)?input_hint_block\.(\d+)\.weight$")


@dataclass
class ControlNetSpec:
    """What the command line asks for: the model, the conditioning image and how strongly and when it acts."""

    path: str
    image: str
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0


def check_control_flags(controlnet: Optional[str], image: Optional[str], scale: Optional[float], start: Optional[float], end: Optional[float]) -> None:
    """The ControlNet flags before anything loads: one error line for each that cannot hold."""
    if (controlnet is None) != (image is None):
        raise UserError("--controlnet and --control-image go together (the model and the image that guides it)")
    if controlnet is None:
        given = [name for name, v in (("--control-scale", scale), ("--control-start", start), ("--control-end", end)) if v is not None]
        if given:
            raise UserError(f"{given[0]} needs --controlnet and --control-image")
        return
    if scale is not None and not (math.isfinite(scale) and 0 <= scale <= MAX_CONTROL_SCALE):
        raise UserError(f"--control-scale must be from 0 to {MAX_CONTROL_SCALE:g} (got {scale})")
    for name, v in (("--control-start", start), ("--control-end", end)):
        if v is not None and not (math.isfinite(v) and 0 <= v <= 1):
            raise UserError(f"{name} must be in [0, 1], a fraction of the steps (got {v})")
    if (start or 0.0) >= (1.0 if end is None else end):
        raise UserError(f"--control-start ({start or 0.0:g}) must be before --control-end ({1.0 if end is None else end:g})")


def read_control_image(path: str):
    """The conditioning image as an RGB PIL image (one error line if it cannot be read)."""
    from gencli.pipelines.vision.images import load_image

    return load_image(path).convert("RGB")


@dataclass
class LoadedControlNet:
    model: ControlNetModel
    path: Path
    weight_files: list[Path]
    image: Any  # the conditioning image, RGB PIL, at its own size
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    _conditions: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        stem = self.path.name
        return stem[: -len(".safetensors")] if stem.endswith(".safetensors") else Path(stem).stem if self.path.is_file() else stem

    @property
    def hash(self) -> str:
        from gencli.pipelines.diffusion.png_parameters import files_hash

        return files_hash(self.weight_files, 8)

    def condition(self, width: int, height: int, rows: int) -> torch.Tensor:
        """The image at ``width x height`` in ``[0, 1]``, ``(rows, 3, H, W)`` float32 (Lanczos, as diffusers)."""
        key = (width, height)
        if key not in self._conditions:
            from PIL import Image

            img = self.image if self.image.size == (width, height) else self.image.resize((width, height), Image.LANCZOS)
            self._conditions[key] = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)[None]
        return self._conditions[key].expand(rows, -1, -1, -1)

    def scale_at(self, step: int, steps: int) -> float:
        """The scale of step ``step`` of ``steps``: 0 outside [start, end] (diffusers' ``controlnet_keep``)."""
        keep = not (step / steps < self.start or (step + 1) / steps > self.end)
        return self.scale if keep else 0.0

    def residuals(self, model_input: torch.Tensor, t: Any, context: torch.Tensor, image: torch.Tensor, added: Optional[dict[str, torch.Tensor]],
                  step: int, steps: int, cfg: bool) -> dict[str, Any]:  # fmt: skip
        """The UNet's ``down_block_additional_residuals`` / ``mid_block_additional_residual`` keywords for
        step ``step`` of ``steps`` (none outside [start, end] or at scale 0: the ControlNet is not run).
        A ``global_pool_conditions`` ControlNet (shuffle) under classifier-free guidance runs on the
        conditional half only and the unconditional half gets zeros (diffusers' guess mode, A1111's)."""
        scale = self.scale_at(step, steps)
        if scale <= 0:
            return {}
        pooled = cfg and self.model.control_config.global_pool_conditions
        if pooled:
            half = model_input.shape[0] // 2
            model_input, context, image = model_input[half:], context[half:], image[half:]
            added = {k: v[half:] for k, v in added.items()} if added is not None else None
        down, mid = self.model(model_input, t, context, image, scale, added_cond_kwargs=added)
        if pooled:
            down = [torch.cat([torch.zeros_like(d), d]) for d in down]
            mid = torch.cat([torch.zeros_like(mid), mid])
        return {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}

    def parameters(self) -> dict[str, str]:
        """A1111's ControlNet extension's key (the image itself is not stored; replay names it unapplied)."""
        return {"ControlNet 0": f"Module: none, Model: {self.name} [{self.hash}], Weight: {self.scale:g}, Guidance Start: {self.start:g}, "
                                f"Guidance End: {self.end:g}"}  # fmt: skip


def resolve_controlnet(name: str) -> Path:
    """``--controlnet``: an existing path, else an embedded ControlNet's name (``controlnet-shapes``)."""
    from gencli.weights import weights_dir

    path = Path(name).expanduser()
    if path.exists():
        return path
    embedded = weights_dir() / name
    if re.fullmatch(r"[A-Za-z0-9_.-]+", name) and (embedded / "config.json").is_file():
        return embedded
    raise UserError(f"--controlnet '{name}' does not exist (neither a path nor an embedded ControlNet)")


def _open(path: Path, *, allow_pickle: bool, variant: Optional[str]) -> Any:
    # --variant is the pipeline's: a ControlNet folder without that variant loads its default weights (as a pipeline's components do)
    src = open_source(path, allow_pickle=allow_pickle, variant=variant if path.is_dir() else None, variant_fallback=True)
    if src.kind == "diffusers-pipeline":
        raise UserError(f"--controlnet '{path}' is a diffusers pipeline, not a ControlNet (a ControlNetModel folder or a control_*.safetensors file)")
    return src


def _hint_layout(shapes: dict[str, tuple[int, ...]]) -> tuple[str, list[int], int, tuple[int, ...]]:
    """A single file's prefix, the ``input_hint_block`` conv indices, the conditioning channels and widths."""
    found = {int(m.group(1)): (name, shapes[name]) for name in shapes if (m := _HINT.match(name))}
    if len(found) < 3:
        raise CheckpointError("none of a ControlNet's tensors (controlnet_cond_embedding.* or input_hint_block.*) in it")
    order = sorted(found)
    prefix = LDM_PREFIX if found[order[0]][0].startswith(LDM_PREFIX) else ""
    convs = [found[i][1] for i in order]
    widths = [convs[0][0]] + [convs[j][0] for j in range(2, len(convs) - 1, 2)]
    return prefix, order, int(convs[0][1]), tuple(int(w) for w in widths)


def _single_file_keymap(config: dict[str, Any], prefix: str, hint: list[int]) -> KeyMap:
    rules = [Drop("^(?!" + re.escape(prefix) + ")")] if prefix else []
    rules += [Rename("^" + re.escape(prefix), "")] if prefix else []
    rules.append(Rename(rf"^input_hint_block\.{hint[0]}\.", "controlnet_cond_embedding.conv_in."))
    rules += [Rename(rf"^input_hint_block\.{i}\.", f"controlnet_cond_embedding.blocks.{j}.") for j, i in enumerate(hint[1:-1])]
    rules.append(Rename(rf"^input_hint_block\.{hint[-1]}\.", "controlnet_cond_embedding.conv_out."))
    rules.append(Rename(r"^zero_convs\.(\d+)\.0\.", r"controlnet_down_blocks.\1."))
    rules.append(Rename(r"^middle_block_out\.0\.", "controlnet_mid_block."))
    return KeyMap(rules, "original ControlNet") + original_unet_keymap(config, prefix="")


def _check_single_file_fit(shapes: dict[str, tuple[int, ...]], prefix: str, unet: UNet2DConditionModel, where: Any) -> None:
    """An original-layout file takes the UNet's architecture: one made for another base (an SDXL file beside
    an SD 1.x UNet) is told as such, before its tensors fail to fit one by one."""
    base = unet.config
    first = shapes.get(prefix + "input_blocks.0.0.weight")
    context = next((v[1] for k, v in shapes.items() if k.startswith(prefix + "input_blocks.") and k.endswith("attn2.to_k.weight") and len(v) == 2), None)
    for what, mine, theirs in (
        ("first block width", first[0] if first is not None and len(first) == 4 else None, base.block_out_channels[0]),
        ("text-embedding width (cross_attention_dim)", context, base.context_dim),
        ("added embeddings (SDXL, label_emb)", "text_time" if any(k.startswith(prefix + "label_emb.") for k in shapes) else None,
         base.addition_embed_type if base.addition_embed_type == "text_time" else None),
    ):  # fmt: skip
        if mine is not None or what.startswith("added"):
            if mine != theirs:
                raise UserError(f"the ControlNet '{where}' was made for another base model: its {what} {mine} differ from this UNet's {theirs} "
                                "(an SD 1.x ControlNet needs an SD 1.x model, an SDXL one SDXL)")  # fmt: skip


def _build(config: dict[str, Any], origin: Any) -> ControlNetConfig:
    try:
        return ControlNetConfig.from_dict(config)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"'{origin}': the ControlNet config is not supported: {exc}") from None


def _check_fit(control: ControlNetConfig, unet: UNet2DConditionModel, vae_factor: int, where: Any) -> None:
    """A ControlNet is a copy of its base model's down path: its widths, depths and text width must be the UNet's."""
    mine, base = control.unet, unet.config

    def same(a: Any) -> Any:
        return tuple(a) if isinstance(a, (list, tuple)) else a

    for what, a, b in (
        ("block widths", mine.block_out_channels, base.block_out_channels),
        ("layers per block", mine.layers_per_block, base.layers_per_block),
        ("text-embedding width (cross_attention_dim)", mine.context_dim, base.context_dim),
        ("added embeddings (SDXL)", mine.addition_embed_type, base.addition_embed_type),
    ):
        if same(a) != same(b):
            raise UserError(f"the ControlNet '{where}' was made for another base model: its {what} {a} differ from this UNet's {b} "
                            "(an SD 1.x ControlNet needs an SD 1.x model, an SDXL one SDXL)")  # fmt: skip
    if mine.in_channels != base.out_channels:  # it reads the noisy latents alone, also beside an inpainting UNet
        raise UserError(f"the ControlNet '{where}' reads {mine.in_channels} latent channels, this model's latents have {base.out_channels}: they do not fit")
    factor = 2 ** (len(control.conditioning_embedding_out_channels) - 1)
    if factor != vae_factor:
        raise UserError(f"the ControlNet '{where}' reads its image at 1/{factor} of the size, this model's latents are 1/{vae_factor}: they do not fit")


def load_controlnet(
    spec: ControlNetSpec, unet: UNet2DConditionModel, placement: Placement, vae_factor: int, *, variant: Optional[str] = None, allow_pickle: bool = False
) -> LoadedControlNet:
    """The ControlNet of ``spec`` (a diffusers folder or an original single file) for ``unet``'s model, on
    ``placement``, with its conditioning image."""
    image = read_control_image(spec.image)
    path = resolve_controlnet(spec.path)
    src = _open(path, allow_pickle=allow_pickle, variant=variant)
    with TensorReader(src, allow_pickle=allow_pickle) as reader:
        shapes = {k: tuple(reader.shape(k)) for k in reader.keys()}
        if "controlnet_cond_embedding.conv_in.weight" in shapes:  # diffusers' own layout (config.json beside it)
            if not src.config:
                raise CheckpointError(f"'{path}' holds a diffusers ControlNet without its config.json: keep the file in its folder")
            config = dict(src.config)
            keymap = DIFFUSERS_UNET
        else:
            try:
                prefix, hint, channels, widths = _hint_layout(shapes)
            except CheckpointError as exc:
                raise CheckpointError(f"'{path}' is not a ControlNet: {exc}") from None
            _check_single_file_fit(shapes, prefix, unet, path)
            first = shapes.get(prefix + "input_blocks.0.0.weight")  # the latents it reads (4, also beside an inpainting UNet's 9)
            config = {**unet.config.to_dict(), "conditioning_channels": channels, "conditioning_embedding_out_channels": list(widths),
                      "in_channels": int(first[1]) if first is not None and len(first) == 4 else unet.config.out_channels}  # fmt: skip
            keymap = _single_file_keymap(config, prefix, hint)
        cfg = _build(config, path)
        _check_fit(cfg, unet, vae_factor, path)
        model = load_model(lambda: ControlNetModel(cfg), reader, keymap, device=placement.device, dtype=placement.dtype, config=config,
                           private=(lambda _name, target: target.ndim == 4) if placement.device.type == "cpu" else None)  # fmt: skip
    prepare_for_device(model, placement)
    return LoadedControlNet(model.eval(), path, list(src.weight_files), image, spec.scale, spec.start, spec.end)


__all__ = [
    "ControlNetSpec", "LoadedControlNet", "MAX_CONTROL_SCALE", "check_control_flags", "load_controlnet", "read_control_image",
    "resolve_controlnet",
]  # fmt: skip
