"""Find the weights in what the user points at, and tell what they are — without torch.

Layouts understood:
- a single ``.safetensors`` file (any key naming; e.g. an original Stable Diffusion file);
- a Hugging Face model folder: ``config.json`` + ``model.safetensors`` or a sharded
  ``model.safetensors.index.json``; diffusers component folders use ``diffusion_pytorch_model.*``;
- a diffusers pipeline folder: ``model_index.json`` with one sub-folder per component;
- gencli's own families: ``config.json`` with ``"architecture"`` + ``model.safetensors``;
- pickle checkpoints (``.bin``, ``.pt``, ``.pth``, ``.ckpt``): recognised, but refused unless the user
  opts in with ``--allow-pickle``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from gencli.checkpoints.header import SafetensorsHeader, read_header
from gencli.errors import CheckpointError, UserError
from gencli.io import read_json

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
SAFETENSORS_STEMS = ("model", "diffusion_pytorch_model")

PICKLE_REFUSAL = (
    "refusing to load '{path}': pickle checkpoints (.bin/.pt/.pth/.ckpt) can run arbitrary code when loaded. "
    "Use a .safetensors version of the checkpoint, convert it once with "
    "`python -c \"import torch,safetensors.torch as s; s.save_file(torch.load('IN', weights_only=True), 'OUT.safetensors')\"`, "
    "or pass --allow-pickle to load it with torch.load(weights_only=True)"
)


@dataclass
class CheckpointSource:
    """Where a model's weights and configuration are."""

    path: Path  # what the user gave
    kind: str  # "safetensors" | "safetensors-sharded" | "pickle" | "pickle-sharded" | "diffusers-pipeline"
    weight_files: list[Path] = field(default_factory=list)
    weight_map: Optional[dict[str, str]] = None  # sharded: tensor name -> file name
    folder: Optional[Path] = None
    config: Optional[dict[str, Any]] = None
    variant: Optional[str] = None  # diffusers' weight variant ("fp16", ...) asked for, if any
    _headers: dict[Path, SafetensorsHeader] = field(default_factory=dict, repr=False)

    @property
    def is_pickle(self) -> bool:
        return self.kind.startswith("pickle")

    def headers(self) -> list[SafetensorsHeader]:
        """Validated safetensors headers of every weight file (cached)."""
        out = []
        for f in self.weight_files:
            if f not in self._headers:
                self._headers[f] = read_header(f)
            out.append(self._headers[f])
        return out

    def tensor_infos(self) -> dict[str, Any]:
        """name -> TensorInfo across all shards (safetensors only), checking the index if sharded."""
        infos: dict[str, Any] = {}
        for h in self.headers():
            for name, info in h.tensors.items():
                if name in infos:
                    raise CheckpointError(f"tensor '{name}' appears in more than one shard of '{self.path}'")
                infos[name] = info
        if self.weight_map is not None:
            missing = [k for k in self.weight_map if k not in infos]
            if missing:
                raise CheckpointError(f"'{self.path}': the shard index lists tensor '{missing[0]}' but no shard contains it")
        return infos

    def num_parameters(self) -> Optional[int]:
        """How many numbers the weights hold (from the headers; None for pickle files and pipeline folders)."""
        if self.is_pickle or not self.weight_files:
            return None
        return sum(t.numel for t in self.tensor_infos().values())

    def metadata(self) -> dict[str, str]:
        md: dict[str, str] = {}
        if not self.is_pickle:
            for h in self.headers():
                md.update(h.metadata)
        return md

    def sub(self, name: str, *, variant: Optional[str] = None) -> "CheckpointSource":
        """A component of a diffusers pipeline folder (``unet``, ``vae``, ``text_encoder``...), with the
        weights of ``variant`` (``"fp16"``: ``model.fp16.safetensors``) when one is asked for."""
        if self.folder is None:
            raise CheckpointError(f"'{self.path}' is not a folder")
        sub = self.folder / name
        if not sub.is_dir():
            raise CheckpointError(f"'{self.folder}' has no '{name}' component folder")
        if variant is not None:  # asked for by name: the component must have it
            return open_source(sub, variant=variant)
        # the pipeline folder's variant: a component saved without it loads its default files
        return open_source(sub, variant=self.variant, variant_fallback=True)


def _sharded(folder: Path, index_file: Path, kind: str) -> tuple[list[Path], dict[str, str]]:
    index = read_json(index_file)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"'{index_file}' has no weight_map")
    files = []
    for name in dict.fromkeys(weight_map.values()):
        f = folder / name
        if not f.is_file():
            raise CheckpointError(f"shard '{name}' listed in '{index_file.name}' is missing from '{folder}'")
        files.append(f)
    return files, weight_map


def _find_named(folder: Path, variant: Optional[str] = None) -> tuple[str, list[Path], Optional[dict[str, str]]]:
    """The standard weight files (``model.safetensors``, ``diffusion_pytorch_model.safetensors`` or their
    shard indexes), or diffusers' variant files: ``{stem}.{variant}.safetensors`` or the index
    ``{stem}.safetensors.index.{variant}.json`` (shards ``{stem}.{variant}-0000N-of-0000M.safetensors``)."""
    for stem in SAFETENSORS_STEMS:
        idx = folder / (f"{stem}.safetensors.index.{variant}.json" if variant else f"{stem}.safetensors.index.json")
        if idx.is_file():
            files, wm = _sharded(folder, idx, "safetensors")
            return "safetensors-sharded", files, wm
        single = folder / (f"{stem}.{variant}.safetensors" if variant else f"{stem}.safetensors")
        if single.is_file():
            return "safetensors", [single], None
    return "", [], None


def _find_weights(folder: Path, variant: Optional[str] = None, *, fallback: bool = False) -> tuple[str, list[Path], Optional[dict[str, str]]]:
    if variant:
        found = _find_named(folder, variant)
        if found[0]:
            return found
        if not fallback:
            raise CheckpointError(
                f"'{folder}' has no '{variant}' variant of its weights "
                f"(looked for diffusion_pytorch_model.{variant}.safetensors, model.{variant}.safetensors and their shard indexes)"
            )
    found = _find_named(folder)
    if found[0]:
        return found
    indexes = [f for stem in SAFETENSORS_STEMS for f in sorted(folder.glob(f"{stem}.safetensors.index.*.json"))]
    if len(indexes) == 1:  # the only weights are a sharded variant
        files, wm = _sharded(folder, indexes[0], "safetensors")
        return "safetensors-sharded", files, wm
    st = sorted(folder.glob("*.safetensors"))
    # variants such as model.fp16.safetensors, or a lone file with another name
    if len(st) == 1:
        return "safetensors", st, None
    if len(st) > 1:
        names = ", ".join(f.name for f in st[:5])
        raise CheckpointError(f"'{folder}' holds several .safetensors files ({names}) and no index: point --model at one of them")
    for stem in ("pytorch_model", "diffusion_pytorch_model"):
        idx = folder / f"{stem}.bin.index.json"
        if idx.is_file():
            files, wm = _sharded(folder, idx, "pickle")
            return "pickle-sharded", files, wm
    pk = sorted(f for f in folder.iterdir() if f.suffix in PICKLE_SUFFIXES and f.is_file())
    if len(pk) == 1:
        return "pickle", pk, None
    return "", [], None


def open_source(
    path: str | os.PathLike, *, allow_pickle: bool = False, variant: Optional[str] = None, variant_fallback: bool = False
) -> CheckpointSource:
    """Resolve a file or folder into a CheckpointSource; raise a one-line UserError when it is not one.

    Pickle checkpoints are refused unless ``allow_pickle``. ``variant`` (a folder only) picks diffusers'
    variant files (``diffusion_pytorch_model.fp16.safetensors``, or the sharded
    ``diffusion_pytorch_model.safetensors.index.fp16.json``); a folder without them is an error, or,
    with ``variant_fallback`` (the components of a pipeline folder), loads its default files.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"'{p}' does not exist")
    if p.is_file():
        if p.suffix == ".safetensors":
            src = CheckpointSource(p, "safetensors", [p], folder=p.parent)
            cfg = p.parent / "config.json"
            # model.safetensors, a variant of it (model.fp16.safetensors), or the folder's only weights
            if cfg.is_file() and (p.name.split(".")[0] in SAFETENSORS_STEMS or len(list(p.parent.glob("*.safetensors"))) == 1):
                src.config = read_json(cfg)
            src.headers()  # validate now: a truncated file fails here, cleanly
            return src
        if p.suffix in PICKLE_SUFFIXES:
            if not allow_pickle:
                raise CheckpointError(PICKLE_REFUSAL.format(path=p))
            return CheckpointSource(p, "pickle", [p], folder=p.parent)
        if p.name.endswith(".safetensors.index.json"):
            return open_source(p.parent, allow_pickle=allow_pickle)
        raise UserError(f"'{p}' is not a checkpoint: expected a .safetensors file or a model folder")
    if (p / "model_index.json").is_file():
        return CheckpointSource(p, "diffusers-pipeline", folder=p, config=read_json(p / "model_index.json"), variant=variant)
    kind, files, weight_map = _find_weights(p, variant, fallback=variant_fallback)
    config = read_json(p / "config.json") if (p / "config.json").is_file() else None
    if not kind:
        raise UserError(
            f"no weights in '{p}': expected model.safetensors, a sharded model.safetensors.index.json, "
            "diffusion_pytorch_model.safetensors, or a diffusers pipeline with model_index.json"
        )
    if kind.startswith("pickle") and not allow_pickle:
        raise CheckpointError(PICKLE_REFUSAL.format(path=files[0] if len(files) == 1 else p))
    src = CheckpointSource(p, kind, files, weight_map, folder=p, config=config, variant=variant)
    if not src.is_pickle:
        src.headers()
    return src


# -- architecture detection ------------------------------------------------------------------
# Each detector looks at the set of tensor names (and the config, if any) and names the architecture.
# Families register theirs; the order of registration is the order of checking.
Detector = Callable[[set[str], Optional[dict[str, Any]]], Optional[str]]
_DETECTORS: list[tuple[str, Detector]] = []


def register_detector(name: str, detector: Detector) -> None:
    _DETECTORS.append((name, detector))


def _has_prefix(keys: set[str], *prefixes: str) -> bool:
    return any(k.startswith(prefixes) for k in keys)


def _builtin_detectors() -> None:
    def controlnet(keys: set[str], _cfg):
        if _has_prefix(keys, "control_model.input_hint_block.", "input_hint_block."):  # before the SD file a full one also holds
            return "ControlNetModel (single file, original layout)"
        if _has_prefix(keys, "controlnet_cond_embedding."):
            return "ControlNetModel"
        return None

    def sd_single_file(keys: set[str], _cfg):
        if _has_prefix(keys, "model.diffusion_model."):
            if _has_prefix(keys, "conditioner.embedders."):
                return "stable-diffusion-xl (single file, original layout)"
            if _has_prefix(keys, "cond_stage_model.model."):
                return "stable-diffusion-v2 (single file, original layout)"
            return "stable-diffusion-v1 (single file, original layout)"
        return None

    def gpt2(keys, _cfg):
        if any(k.endswith("h.0.attn.c_attn.weight") for k in keys):
            return "GPT2LMHeadModel"
        return None

    def llama(keys, _cfg):
        if "model.layers.0.self_attn.q_proj.weight" in keys and "model.layers.0.mlp.gate_proj.weight" in keys:
            if "model.layers.0.self_attn.q_proj.bias" in keys:
                return "Qwen2ForCausalLM (Llama family with q/k/v bias)"
            return "LlamaForCausalLM (Llama family)"
        return None

    def vit(keys, _cfg):
        if _has_prefix(keys, "vit.embeddings.patch_embeddings."):
            return "ViTForImageClassification" if _has_prefix(keys, "classifier.") else "ViTModel"
        if _has_prefix(keys, "deit.embeddings."):
            return "DeiTForImageClassification"
        return None

    def clip(keys, _cfg):
        if _has_prefix(keys, "text_model.embeddings.token_embedding.") and _has_prefix(keys, "vision_model."):
            return "CLIPModel"
        if _has_prefix(keys, "text_model.embeddings.token_embedding."):
            return "CLIPTextModel"
        return None

    def autoencoder_kl(keys, _cfg):
        if _has_prefix(keys, "encoder.down_blocks.") and _has_prefix(keys, "decoder.up_blocks."):
            if any(".mid_block.attentions.0.query." in k for k in keys):
                return "AutoencoderKL (diffusers, legacy attention names)"
            return "AutoencoderKL"
        if "encoder.conv_in.weight" in keys and _has_prefix(keys, "encoder.down.") and _has_prefix(keys, "decoder.up."):
            return "AutoencoderKL (original latent-diffusion layout, e.g. a standalone SD VAE file)"
        return None

    def unet(keys, _cfg):
        if "conv_in.weight" in keys and _has_prefix(keys, "time_embedding.") and _has_prefix(keys, "down_blocks."):
            return "UNet2DConditionModel"
        return None

    for name, det in [
        ("controlnet", controlnet),
        ("sd-single-file", sd_single_file),
        ("gpt2", gpt2),
        ("llama", llama),
        ("vit", vit),
        ("clip", clip),
        ("autoencoder-kl", autoencoder_kl),
        ("unet", unet),
    ]:
        register_detector(name, det)


_builtin_detectors()


def detect_architecture(src: CheckpointSource, keys: Optional[set[str]] = None) -> Optional[str]:
    """The architecture name: from the config (``architectures``, ``architecture``, ``_class_name``,
    ``model_type``), the safetensors metadata, or else the tensor names."""
    cfg = src.config or {}
    if src.kind == "diffusers-pipeline":
        return f"diffusers pipeline ({cfg.get('_class_name', 'unknown')})"
    if isinstance(cfg.get("architectures"), list) and cfg["architectures"]:
        return str(cfg["architectures"][0])
    for field_name in ("architecture", "_class_name"):
        if isinstance(cfg.get(field_name), str):
            return cfg[field_name]
    md = src.metadata()
    if md.get("architecture"):
        return md["architecture"]
    if keys is None and not src.is_pickle:
        keys = set(src.tensor_infos())
    if keys:
        for _name, det in _DETECTORS:
            found = det(keys, src.config)
            if found:
                return found
    if isinstance(cfg.get("model_type"), str):
        return cfg["model_type"]
    return None

# -- which command runs what -------------------------------------------------------------------
# an architecture's first word -> (what it is, the command that runs it)
_COMMAND_FOR = {
    **dict.fromkeys(("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"), ("a text-generation model", "gencli generate")),
    **dict.fromkeys(
        ("ViTForImageClassification", "DeiTForImageClassification", "DeiTForImageClassificationWithTeacher"), ("an image classifier", "gencli classify")
    ),
    **dict.fromkeys(
        ("T5ForConditionalGeneration", "MT5ForConditionalGeneration", "MarianMTModel", "BartForConditionalGeneration"),
        ("a text-to-text model", "gencli text2text or gencli translate"),
    ),
    "CLIPModel": ("an image-text model", "gencli zeroshot or gencli similarity"),
    "TemporalFusionTransformer": ("a forecasting model", "gencli forecast"),
    "ConvVAE": ("a VAE", "gencli sample vae or gencli reconstruct"),
    "DCGAN": ("a GAN", "gencli sample gan"),
    "AutoencoderKL": ("a latent-diffusion VAE", "gencli reconstruct"),
    **dict.fromkeys(
        ("diffusers", "stable-diffusion-v1", "stable-diffusion-v2", "stable-diffusion-xl"),
        ("a Stable Diffusion pipeline", "gencli txt2img or gencli img2img"),
    ),
    **dict.fromkeys(
        ("CLIPTextModel", "CLIPTextModelWithProjection"), ("a CLIP text encoder", "gencli txt2img, as the text encoder of a Stable Diffusion pipeline")
    ),
    "UNet2DConditionModel": ("a Stable Diffusion UNet", "gencli txt2img, with the pipeline folder it belongs to"),
    "ControlNetModel": ("a ControlNet", "gencli txt2img --controlnet, beside the Stable Diffusion model it was made for"),
    **dict.fromkeys(("DDPMPipeline", "DDIMPipeline"), ("a pixel-space diffusion pipeline", "gencli sample ddpm")),
    "UNet2DModel": ("a pixel-space diffusion UNet", "gencli sample ddpm, with the pipeline folder it belongs to"),
    **dict.fromkeys(("SegformerForSemanticSegmentation", "UNetSegmenter"), ("a segmentation model", "gencli segment")),
    "SimCLREncoder": ("an image encoder", "gencli embed --images"),
    # BERT-family encoders: the command that runs each head
    **{
        f"{family}{head}": (what, command)
        for family in ("Bert", "Roberta", "XLMRoberta", "DistilBert")
        for head, what, command in (
            ("Model", "a BERT-family encoder", "gencli embed"),
            ("ForMaskedLM", "a masked-language model", "gencli fill-mask (or gencli embed)"),
            ("ForSequenceClassification", "a text classifier", "gencli classify-text"),
            ("ForTokenClassification", "a token classifier", "gencli ner"),
            ("ForQuestionAnswering", "a question-answering model", "gencli qa"),
        )
    },
    "BertForPreTraining": ("a masked-language model", "gencli fill-mask (or gencli embed)"),
}


def with_article(word: str) -> str:
    """``word`` after "a" or "an" (by its sound: "an AutoencoderKL", "a ViT...", "a UNet2DModel":
    an initial "U" before a capital, and "UNet", "Unet", "Uni...", read "you")."""
    sounds_like_you = word[:1] == "U" and (word[1:2].isupper() or word.lower().startswith(("unet", "uni")))
    return f"{'an' if word[:1].lower() in 'aeiou' and not sounds_like_you else 'a'} {word}"


def command_for(arch: Optional[str]) -> Optional[tuple[str, str]]:
    """``(what it is, the command that runs it)`` for an architecture name, or None."""
    if not arch:
        return None
    inner = re.search(r"\((\w+)\)", arch)  # "diffusers pipeline (DDPMPipeline)": the pipeline's class decides
    if inner and inner.group(1) in _COMMAND_FOR:
        return _COMMAND_FOR[inner.group(1)]
    return _COMMAND_FOR.get(re.split(r"[ (]", arch, maxsplit=1)[0])


def shard_index(path: Path) -> Optional[Path]:
    """The ``*.safetensors.index.json`` next to ``path`` that lists it as a shard, if any."""
    for index in sorted(path.parent.glob("*.safetensors.index.json")):
        try:
            weight_map = read_json(index).get("weight_map") or {}
        except (UserError, AttributeError):
            continue
        if path.name in set(weight_map.values()):
            return index
    return None


def wrong_family(src: "CheckpointSource", wanted: str, supported: str = "") -> UserError:
    """The error for a checkpoint that is not ``wanted`` (e.g. "a text-generation model"): it names
    what the checkpoint is and the command that runs it (``supported``: what this command runs, for
    an architecture no command runs), or says that it is one shard of a sharded checkpoint."""
    index = shard_index(src.path) if src.path.is_file() else None
    if index is not None:
        return UserError(f"'{src.path}' is one shard of a sharded checkpoint ({index.name} lists it): pass its folder '{src.path.parent}'")
    arch = detect_architecture(src)
    if not arch:
        return UserError(f"'{src.path}' is not {wanted}: neither a config.json nor its tensor names tell its architecture")
    what, command = command_for(arch) or (None, None)
    if command is None or wanted == what:
        return UserError(f"'{src.path}' holds {with_article(arch)}, which gencli does not run" + (f": {supported}" if supported else ""))
    named = arch if "(" in arch else f"{arch} ({what})"
    return UserError(f"'{src.path}' holds {with_article(named)}, not {wanted}: run it with {command}")
