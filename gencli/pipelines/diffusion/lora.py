"""LoRA files for Stable Diffusion: read, matched to the pipeline's layers, merged into its weights.

Where they come from: ``--lora FILE[:WEIGHT]`` (repeatable, weight 1.0 by default) and A1111's prompt
syntax ``<lora:NAME>`` / ``<lora:NAME:WEIGHT>``, NAME resolved against ``--lora-dir`` (a file
``NAME.safetensors`` anywhere below it); an embedded LoRA (``weights/lora-arrow``) by its name in
either, the tag without ``--lora-dir``. The tags are removed from the prompt before it is encoded
(:func:`strip_lora_tags`), as A1111 does; the prompt recorded in the PNG keeps them.

Formats, told apart by the key names:

- **kohya / A1111** (``lora_unet_*``, ``lora_te_*``; SDXL ``lora_te1_*`` / ``lora_te2_*``), each layer
  a ``.lora_down.weight`` (rank x in), ``.lora_up.weight`` (out x rank) and an optional ``.alpha``;
  LoCon's convolution LoRA on 3x3 convs (down ``(r, in, 3, 3)``, up ``(out, r, 1, 1)``). A kohya name
  is a module path with dots made underscores, of the diffusers layout (SD 1.x/2.x files:
  ``lora_unet_down_blocks_0_attentions_0_proj_in``) or of the original layout (SDXL files:
  ``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``); text encoders in transformers'
  naming (``lora_te_text_model_encoder_layers_0_self_attn_q_proj``). The names are matched against a
  map built from the pipeline's own modules: every ``Linear`` / ``Conv2d`` under its diffusers path
  and, for the UNet, under the original-layout path that
  :func:`gencli.models.unet.single_file.original_unet_keymap` maps onto it (each inverted name checked
  by mapping it forward again), never by guessing where the underscores were dots.
- **diffusers / PEFT** (``unet.<path>.lora_A.weight`` / ``lora_B.weight``, ``text_encoder.<path>``,
  ``text_encoder_2.<path>``; the older ``.lora.down.weight`` / ``.lora.up.weight``), scaled by the
  ``lora_alpha`` / ``alpha_pattern`` / ``use_rslora`` that diffusers' ``save_lora_weights`` writes in
  the safetensors metadata (``lora_adapter_metadata``, keys ``unet.lora_alpha`` etc.), else by 1.

Merging: ``W += weight * scale * up @ down`` with ``scale = alpha / rank`` (1 without ``alpha``),
computed in float32 and rounded once into the layer's dtype, as diffusers' ``fuse_lora`` does.
Several LoRAs add up. The weights are merged at load into freshly read weights, so the next load
starts clean. A LoRA made for another base (an SDXL LoRA on SD 1.5: its cross attention reads another
context width, or it has ``lora_te1_``/``lora_te2_`` keys), a key that matches no layer, a shape that
does not fit, or a rank mismatch between ``down`` and ``up`` is an error naming the file and the key:
nothing is silently skipped.

Hashes: A1111 records ``Lora hashes: "name: hash, ..."``, the hash being the first 12 hex digits of
the SHA-256 of a ``.safetensors`` file's bytes after its header (kohya's "addnet" hash), which
:func:`lora_hash` computes.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from gencli.errors import CheckpointError, UserError

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from gencli.pipelines.diffusion.prompt_encoding import PromptEncoder

LORA_TAG = re.compile(r"<lora:([^>:]+)(?::([^>]*))?>", re.IGNORECASE)
LORA_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".pt", ".ckpt", ".bin", ".pth")
HASH_LENGTH = 12  # A1111's short hash of a LoRA

_KOHYA_PREFIXES = {"lora_unet_": "unet", "lora_te_": "text_encoder", "lora_te1_": "text_encoder", "lora_te2_": "text_encoder_2"}
_PEFT_PREFIXES = {"unet.": "unet", "text_encoder.": "text_encoder", "text_encoder_2.": "text_encoder_2"}
_DOWN = (".lora_down.weight", ".lora_A.weight", ".lora.down.weight")
_UP = (".lora_up.weight", ".lora_B.weight", ".lora.up.weight")
_ALPHA = (".alpha",)
# what LyCORIS and others add to LoRA, which gencli does not apply (an error, never ignored)
_UNSUPPORTED = {".hada_w1_a": "LoHa", ".lokr_w1": "LoKr", ".lora_mid.weight": "LoCon with a Tucker mid weight", ".dora_scale": "DoRA",
                ".diff": "a full weight difference", ".oft_blocks": "OFT"}  # fmt: skip


# -- what to load ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraSpec:
    """One LoRA to apply: its file, weight and name (the file's stem, as A1111 names it)."""

    path: Path
    weight: float = 1.0
    from_tag: bool = False  # named in the prompt (<lora:NAME:W>) rather than by --lora

    @property
    def name(self) -> str:
        return self.path.stem.replace(":", "").replace(",", "")


def _parse_weight(text: str, where: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        raise UserError(f"{where}: the weight {text!r} is not a number") from None
    if not math.isfinite(weight):
        raise UserError(f"{where}: the weight {text!r} is not a finite number")
    return weight


def embedded_lora(name: str) -> Optional[Path]:
    """The LoRA file of an embedded default named ``name`` (``weights/NAME/NAME.safetensors``, such
    as ``lora-arrow``), or None."""
    from gencli.weights import weights_dir

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        return None
    path = weights_dir() / name / f"{name}.safetensors"
    return path if path.is_file() else None


def parse_lora_option(text: str) -> LoraSpec:
    """``FILE`` or ``FILE:WEIGHT`` (``--lora``), FILE a path or the name of an embedded LoRA
    (:func:`embedded_lora`). A path that exists as given is taken whole (a colon in a file name);
    otherwise the part after the last colon is the weight."""
    path = Path(text).expanduser()
    weight = 1.0
    if not path.exists() and ":" in text:
        head, tail = text.rsplit(":", 1)
        if head and (Path(head).expanduser().exists() or embedded_lora(head)):
            path, weight = Path(head).expanduser(), _parse_weight(tail, f"--lora {text!r}")
        elif head and not re.fullmatch(r"[A-Za-z]", head):  # a bare Windows drive letter is no weight
            _parse_weight(tail, f"--lora {text!r}")
            path = Path(head).expanduser()
    if not path.exists():
        path = embedded_lora(str(path)) or path
    if not path.exists():
        raise UserError(f"--lora '{path}' does not exist")
    if path.is_dir():
        raise UserError(f"--lora '{path}' is a folder: give a LoRA .safetensors file")
    return LoraSpec(path, weight)


def strip_lora_tags(prompt: str) -> str:
    """The prompt without its ``<lora:...>`` tags (what is encoded)."""
    return LORA_TAG.sub("", prompt)


def find_lora(name: str, lora_dir: Optional[Path], *, allow_pickle: bool = False) -> Path:
    """``NAME`` of a ``<lora:NAME>`` tag (or a ``Lora hashes`` entry) as a file under ``lora_dir``;
    without ``lora_dir``, an embedded LoRA of that name (:func:`embedded_lora`)."""
    if lora_dir is None:
        embedded = embedded_lora(name)
        if embedded is not None:
            return embedded
        raise UserError(f"the prompt names <lora:{name}>: say where LoRA files are with --lora-dir")
    if not lora_dir.is_dir():
        raise UserError(f"--lora-dir '{lora_dir}' is not a folder")
    if Path(name).is_absolute() or ".." in Path(name).parts:  # a prompt (a replayed PNG's too) reads no file outside the folder
        raise UserError(f"<lora:{name}>: a LoRA is named by its file name in --lora-dir (a subfolder too), not a path out of it")
    suffixes = LORA_SUFFIXES + (PICKLE_SUFFIXES if allow_pickle else ())
    for suffix in suffixes:
        direct = lora_dir / f"{name}{suffix}"
        if direct.is_file():
            return direct
    for suffix in suffixes:
        found = sorted(p for p in lora_dir.rglob(f"*{suffix}") if p.stem == name and p.is_file())
        if found:
            return found[0]
    raise UserError(f"<lora:{name}>: no file '{name}.safetensors' in --lora-dir '{lora_dir}'")


def _tag_items(prompt: str) -> list[tuple[str, float, str]]:
    """``(name, weight, tag)`` of each ``<lora:NAME[:WEIGHT]>`` tag of a prompt (A1111's newer
    ``<lora:NAME:TE:UNET>`` form: the first weight, applied to both)."""
    out = []
    for m in LORA_TAG.finditer(prompt):
        name, weight = m.group(1).strip(), m.group(2)
        w = 1.0
        if weight is not None and weight.strip():
            w = _parse_weight(weight.split(":")[0].strip(), f"the prompt's {m.group(0)}")
        out.append((name, w, m.group(0)))
    return out


def lora_tags(prompt: str, lora_dir: Optional[Path], *, allow_pickle: bool = False) -> list[LoraSpec]:
    """The LoRAs a prompt's ``<lora:NAME[:WEIGHT]>`` tags name, resolved against ``lora_dir``."""
    return [LoraSpec(find_lora(name, lora_dir, allow_pickle=allow_pickle), w, from_tag=True) for name, w, _ in _tag_items(prompt)]


def _directory(lora_dir: Optional[str | Path]) -> Optional[Path]:
    directory = Path(lora_dir).expanduser() if lora_dir is not None else None
    if directory is not None and not directory.is_dir():
        raise UserError(f"--lora-dir '{directory}' is not a folder")
    return directory


def _tags_named(text: str) -> str:
    tags = [tag for _, _, tag in _tag_items(text)]
    return " ".join(tags) if tags else "no <lora:...> tag"


def run_loras(flags: Sequence[str], prompts: Iterable[Optional[str]], lora_dir: Optional[str | Path], *, allow_pickle: bool = False) -> list[LoraSpec]:
    """The LoRAs of a run: ``--lora`` values, then the tags of its prompts. Each item of ``prompts``
    is the text of one image (its prompt and negative prompt together; None: skipped), and every
    image of one run must name the same LoRAs, none included: the model is loaded once with them, so
    an image whose prompt names none would be drawn with them, and its PNG not replayed."""
    directory = _directory(lora_dir)
    specs = [parse_lora_option(text) for text in flags]
    tagged: Optional[list[LoraSpec]] = None
    first = ""
    for prompt in prompts:
        if prompt is None:
            continue
        these = lora_tags(prompt, directory, allow_pickle=allow_pickle)
        if tagged is None:
            tagged, first = these, prompt
        elif [(s.path, s.weight) for s in these] != [(s.path, s.weight) for s in tagged]:
            raise UserError(
                f"the prompts of one run name different <lora:...> tags ({_tags_named(first)}, then {_tags_named(prompt)}): the LoRAs are "
                "merged into the model once for the whole run; run them separately"
            )
    return specs + (tagged or [])


def replay_loras(
    extra: dict[str, str], prompts: Sequence[str], given: Sequence[str], lora_dir: Optional[str | Path], *, allow_pickle: bool = False
) -> list[LoraSpec]:
    """The LoRAs an image's parameters name, found again: those of ``Lora weights`` (given by
    ``--lora`` when it was made) and the prompts' ``<lora:...>`` tags, each looked up by name among the
    files ``given`` (``--lora``, their weights ignored), then in ``lora_dir`` (without it: the embedded
    LoRAs)."""
    directory = _directory(lora_dir)
    files = [parse_lora_option(text).path for text in given]
    recorded = parse_lora_hashes(extra.get("Lora hashes", ""))

    def locate(name: str) -> Path:
        for f in files:
            if LoraSpec(f).name == name:
                return f
        if directory is None:
            embedded = embedded_lora(name)
            if embedded is not None:
                return embedded
            raise UserError(f"the image was made with the LoRA '{name}': give its file with --lora, or the folder holding it with --lora-dir")
        return find_lora(name, directory, allow_pickle=allow_pickle)

    weights = parse_lora_hashes(extra.get("Lora weights", ""))
    specs = [LoraSpec(locate(name), _parse_weight(w, f"the image's Lora weights ({name})")) for name, w in weights.items()]
    for prompt in prompts:
        for name, w, _ in _tag_items(prompt):
            specs.append(LoraSpec(locate(name), w, from_tag=True))
    known = {s.name for s in specs}
    missing = [name for name in recorded if name not in known]
    if missing:
        raise UserError(f"the image's Lora hashes name '{missing[0]}', which neither its prompt nor its Lora weights use")
    return specs


def lora_hash_warnings(recorded_text: str, applied: Sequence["AppliedLora"]) -> list[str]:
    """One line per LoRA whose hash differs from the one an image's ``Lora hashes`` recorded."""
    recorded = parse_lora_hashes(recorded_text)
    return [
        f"the image was made with LoRA '{a.name}' of hash {recorded[a.name]}, '{a.spec.path}' has {a.hash}: the image will differ"
        for a in applied
        if a.name in recorded and recorded[a.name] != a.hash
    ]


# -- reading ---------------------------------------------------------------------------------------
def lora_hash(path: Path) -> str:
    """A1111's short hash of a LoRA: SHA-256 of a ``.safetensors`` file after its header (the whole
    file for other formats), first 12 hex digits."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        if path.suffix == ".safetensors":
            header = fh.read(8)
            if len(header) < 8:
                raise CheckpointError(f"'{path}' is not a safetensors file (shorter than its header)")
            fh.seek(int.from_bytes(header, "little") + 8)
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:HASH_LENGTH]


def read_lora_file(path: Path, *, allow_pickle: bool = False) -> dict[str, "torch.Tensor"]:
    """All tensors of a LoRA file (one line on a missing, truncated or unreadable file)."""
    import torch

    if not path.is_file():
        raise UserError(f"LoRA '{path}' does not exist")
    if path.suffix in PICKLE_SUFFIXES:
        if not allow_pickle:
            raise CheckpointError(f"LoRA '{path}' is a pickle file: refused (pass --allow-pickle to load it with torch.load(weights_only=True))")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file
            raise CheckpointError(f"LoRA '{path}' cannot be read: {str(exc).splitlines()[0]}") from None
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"LoRA '{path}' does not hold a flat dict of tensors")
        return dict(state)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"LoRA '{path}' is not a readable safetensors file (truncated or damaged?): {exc}") from None


@dataclass
class LoraLayer:
    """One layer's low-rank update as the file stores it."""

    key: str  # the file's name of the layer (without .lora_down.weight etc.)
    component: str  # unet, text_encoder, text_encoder_2
    path: str  # the module path inside the component, as the file writes it
    down: Optional["torch.Tensor"] = None
    up: Optional["torch.Tensor"] = None
    alpha: Optional[float] = None
    rslora: bool = False  # PEFT's rank-stabilised scale alpha / sqrt(rank)


def _split_suffix(key: str) -> tuple[str, str]:
    for kind, suffixes in (("down", _DOWN), ("up", _UP), ("alpha", _ALPHA)):
        for s in suffixes:
            if key.endswith(s):
                return key[: -len(s)], kind
    return key, ""


def peft_metadata(path: Path) -> dict:
    """The ``lora_adapter_metadata`` diffusers writes into a LoRA's safetensors header ({} if none)."""
    import json

    if path.suffix != ".safetensors":
        return {}
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("lora_adapter_metadata")
        data = json.loads(raw) if raw else {}
    except (SafetensorError, OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _apply_peft_alphas(layers: list[LoraLayer], metadata: dict, path: Path) -> None:
    for layer in layers:
        if layer.alpha is not None:
            continue
        c = layer.component
        pattern = metadata.get(f"{c}.alpha_pattern") or {}
        alpha = next((v for k, v in pattern.items() if layer.path == k or layer.path.endswith("." + k)), metadata.get(f"{c}.lora_alpha"))
        if alpha is None:
            continue
        try:
            layer.alpha = float(alpha)
        except (TypeError, ValueError):
            raise CheckpointError(f"LoRA '{path}': its metadata's {c}.lora_alpha {alpha!r} is not a number") from None
        layer.rslora = bool(metadata.get(f"{c}.use_rslora", False))


def parse_lora(state: dict[str, "torch.Tensor"], path: Path, metadata: Optional[dict] = None) -> tuple[str, list[LoraLayer]]:
    """``(format, layers)`` of a LoRA's tensors: ``kohya`` or ``peft`` (see the module doc);
    ``metadata``: :func:`peft_metadata`'s."""
    keys = list(state)
    if not keys:
        raise CheckpointError(f"LoRA '{path}' holds no tensors")
    for k in keys:
        for marker, what in _UNSUPPORTED.items():
            if k.endswith(marker):
                raise CheckpointError(f"LoRA '{path}': '{k}' is {what}, which gencli does not apply (plain LoRA and LoCon only)")
    kohya = [k for k in keys if any(k.startswith(p) for p in _KOHYA_PREFIXES)]
    peft = [k for k in keys if any(k.startswith(p) for p in _PEFT_PREFIXES)]
    if not kohya and not peft:
        if any(k.startswith(("model.diffusion_model.", "first_stage_model.", "cond_stage_model.", "conditioner.")) for k in keys):
            raise CheckpointError(f"'{path}' is a full Stable Diffusion checkpoint, not a LoRA: load it with --model")
        raise CheckpointError(
            f"'{path}' is not a LoRA gencli reads: no kohya (lora_unet_*, lora_te_*) or diffusers (unet.*.lora_A.weight) keys (first key: '{keys[0]}')"
        )
    fmt = "kohya" if len(kohya) >= len(peft) else "peft"
    prefixes = _KOHYA_PREFIXES if fmt == "kohya" else _PEFT_PREFIXES
    layers: dict[str, LoraLayer] = {}
    for k in keys:
        prefix = next((p for p in prefixes if k.startswith(p)), None)
        stem, kind = _split_suffix(k)
        if prefix is None or not kind:
            raise CheckpointError(f"LoRA '{path}': the key '{k}' is not a {fmt} LoRA weight (.lora_down/.lora_up/.alpha or lora_A/lora_B)")
        layer = layers.setdefault(stem, LoraLayer(stem, prefixes[prefix], stem[len(prefix) :]))
        t = state[k]
        if kind == "alpha":
            if t.numel() != 1:
                raise CheckpointError(f"LoRA '{path}': '{k}' should be one number, it has shape {list(t.shape)}")
            layer.alpha = float(t.float().item())
        else:
            setattr(layer, kind, t)
    for layer in layers.values():
        if layer.down is None or layer.up is None:
            raise CheckpointError(f"LoRA '{path}': '{layer.key}' has no {'down (lora_A)' if layer.down is None else 'up (lora_B)'} weight")
        if layer.down.ndim not in (2, 4) or layer.up.ndim not in (2, 4):
            raise CheckpointError(f"LoRA '{path}': '{layer.key}' has weights of shapes {list(layer.down.shape)} and {list(layer.up.shape)}")
        if layer.up.shape[1] != layer.down.shape[0]:
            raise CheckpointError(
                f"LoRA '{path}': '{layer.key}' has a rank mismatch: down {list(layer.down.shape)} (rank {layer.down.shape[0]}) "
                f"and up {list(layer.up.shape)} (rank {layer.up.shape[1]})"
            )
    if fmt == "peft" and metadata:
        _apply_peft_alphas(list(layers.values()), metadata, path)
    return fmt, list(layers.values())


# -- the pipeline's layers -------------------------------------------------------------------------
def _weight_modules(module: "nn.Module") -> dict[str, "nn.Module"]:
    import torch.nn as nn

    return {name: m for name, m in module.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d)) and name}


def _unescape(pattern: str) -> Optional[str]:
    """The literal text of a regular expression that is an escaped literal (``^`` aside), else None."""
    body = pattern[1:] if pattern.startswith("^") else pattern
    if re.fullmatch(r"(?:\\.|[^\\.^$*+?{}\[\]|()])*", body) is None:
        return None
    return re.sub(r"\\(.)", r"\1", body)


def original_unet_names(unet: "nn.Module", names: Iterable[str]) -> dict[str, str]:
    """Original-layout (single-file) module path -> the UNet's module path, for ``names``: the
    renames of :func:`~gencli.models.unet.single_file.original_unet_keymap` run backwards, and each
    result kept only where the forward key map takes it back to the same module."""
    from gencli.checkpoints.keymap import Rename
    from gencli.models.unet.single_file import UNET_PREFIX, original_unet_keymap

    keymap = original_unet_keymap(unet.config.to_dict())
    inverse = []
    for rule in keymap.rules:
        if isinstance(rule, Rename) and rule.repl and "\\" not in rule.repl:
            literal = _unescape(rule.pattern)
            if literal is not None:
                inverse.append((re.compile(("^" if rule.pattern.startswith("^") else "") + re.escape(rule.repl)), literal))
    candidates = {}
    for name in names:
        text = name + "."
        for rx, literal in reversed(inverse):
            text = rx.sub(literal.replace("\\", "\\\\"), text)
        candidates[UNET_PREFIX + text + "weight"] = name
    plan = keymap.plan(list(candidates))
    out = {}
    for source_key, name in candidates.items():
        target = name + ".weight"
        if target in plan and plan[target].sources == (source_key,):
            out[source_key[len(UNET_PREFIX) : -len(".weight")]] = name
    return out


@dataclass
class LoraTargets:
    """The pipeline's layers a LoRA may touch, by component: the names a file may use -> module."""

    names: dict[str, dict[str, "nn.Module"]] = field(default_factory=dict)  # component -> dotted path -> module
    kohya: dict[str, dict[str, str]] = field(default_factory=dict)  # component -> underscored path -> dotted path
    context_dim: int = 0
    is_sdxl: bool = False


def lora_targets(unet: "nn.Module", encoder: "PromptEncoder") -> LoraTargets:
    """Every Linear/Conv2d of the UNet and text encoders under the names LoRA files use."""
    targets = LoraTargets(context_dim=int(unet.config.context_dim), is_sdxl=encoder.is_sdxl)
    unet_modules = _weight_modules(unet)
    names = dict(unet_modules)
    for original, name in original_unet_names(unet, unet_modules).items():
        names.setdefault(original, unet_modules[name])
    targets.names["unet"] = names
    for part, component in ((encoder.text_encoder, "text_encoder"), (encoder.text_encoder_2, "text_encoder_2")):
        if part is None:
            continue
        mods = _weight_modules(part.encoder)
        bare = part.encoder is part.tower  # a bare tower: transformers' paths start with text_model.
        targets.names[component] = {("text_model." + n if bare else n): m for n, m in mods.items()}
    for component, mods in targets.names.items():
        targets.kohya[component] = {n.replace(".", "_"): n for n in mods}
    return targets


def _family(context_dim: int, sdxl: bool) -> str:
    return "SDXL" if sdxl else {768: "SD 1.x", 1024: "SD 2.x"}.get(context_dim, f"a {context_dim}-wide text context")


def _check_base(fmt: str, layers: list[LoraLayer], targets: LoraTargets, path: Path) -> None:
    """A LoRA made for another base: SDXL-only keys on SD 1.x/2.x (and back), another context width."""
    xl_keys = [ly.key for ly in layers if ly.key.startswith(("lora_te1_", "lora_te2_")) or ly.component == "text_encoder_2"]
    plain_te = [ly.key for ly in layers if ly.key.startswith("lora_te_")]
    mine = _family(targets.context_dim, targets.is_sdxl)
    if xl_keys and not targets.is_sdxl:
        raise CheckpointError(f"LoRA '{path}' was made for SDXL ('{xl_keys[0]}'), this model is {mine}")
    if plain_te and targets.is_sdxl:
        raise CheckpointError(f"LoRA '{path}' was made for SD 1.x/2.x ('{plain_te[0]}': one text encoder), this model is SDXL")
    for ly in layers:
        if ly.component == "unet" and re.search(r"attn2[._]to_[kv]$", ly.path):
            width = ly.down.flatten(1).shape[1]
            if width != targets.context_dim:
                theirs = _family(width, width == 2048)
                raise CheckpointError(
                    f"LoRA '{path}' was made for {theirs} ('{ly.key}' reads {width}-wide text states), this model is {mine} ({targets.context_dim})"
                )


def _resolve(layer: LoraLayer, fmt: str, targets: LoraTargets, path: Path) -> "nn.Module":
    names = targets.names.get(layer.component)
    if names is None:
        raise CheckpointError(f"LoRA '{path}': '{layer.key}' is for a {layer.component} this model does not have")
    if fmt == "kohya":
        dotted = targets.kohya[layer.component].get(layer.path)
        module = names.get(dotted) if dotted is not None else None
    else:
        module = names.get(layer.path)
    if module is None:
        raise CheckpointError(f"LoRA '{path}': '{layer.key}' matches no layer of this model's {layer.component} (a LoRA for another base model?)")
    return module


def _delta(layer: LoraLayer, module: "nn.Module", path: Path) -> "torch.Tensor":
    """``scale * up @ down`` in float32, in the layer weight's shape."""
    weight = module.weight
    down, up = layer.down.float().flatten(1), layer.up.float().flatten(1)
    rank = down.shape[0]
    if layer.up.ndim == 4 and tuple(layer.up.shape[2:]) != (1, 1):
        raise CheckpointError(f"LoRA '{path}': '{layer.key}' has an up weight of shape {list(layer.up.shape)} (1x1 expected)")
    if up.shape[0] != weight.shape[0] or down.shape[1] != weight[0].numel():
        raise CheckpointError(
            f"LoRA '{path}': '{layer.key}' makes a {up.shape[0]}x{down.shape[1]} update, the model's layer is {list(weight.shape)} "
            "(a LoRA for another base model?)"
        )
    if layer.down.ndim == 4 and weight.ndim == 4 and tuple(layer.down.shape[2:]) != tuple(weight.shape[2:]):
        raise CheckpointError(f"LoRA '{path}': '{layer.key}' has {tuple(layer.down.shape[2:])} kernels, the model's layer {tuple(weight.shape[2:])}")
    scale = 1.0 if layer.alpha is None else layer.alpha / (rank**0.5 if layer.rslora else rank)
    return (scale * (up @ down)).reshape(weight.shape)


@dataclass
class AppliedLora:
    """A LoRA merged into a pipeline: what the PNG parameters and --verbose say about it."""

    spec: LoraSpec
    format: str
    layers: dict[str, int]  # component -> layers touched
    hash: str

    @property
    def name(self) -> str:
        return self.spec.name

    def describe(self) -> str:
        parts = ", ".join(f"{n} in the {c}" for c, n in self.layers.items())
        return f"LoRA '{self.spec.path}' ({self.format}, weight {self.spec.weight:g}): {sum(self.layers.values())} layers ({parts})"


def apply_loras(unet: "nn.Module", encoder: "PromptEncoder", specs: Sequence[LoraSpec], *, allow_pickle: bool = False) -> list[AppliedLora]:
    """Merge ``specs`` into the UNet's and text encoders' weights (see the module doc). Every file is
    read and checked before any weight changes, so an error leaves the model as it was."""
    import torch

    if not specs:
        return []
    targets = lora_targets(unet, encoder)
    plans = []
    for spec in specs:
        state = read_lora_file(spec.path, allow_pickle=allow_pickle)
        fmt, layers = parse_lora(state, spec.path, peft_metadata(spec.path))
        _check_base(fmt, layers, targets, spec.path)
        updates = []
        for layer in layers:
            module = _resolve(layer, fmt, targets, spec.path)
            updates.append((layer.component, module, _delta(layer, module, spec.path)))
        plans.append((spec, fmt, updates))
    applied = []
    with torch.no_grad():
        for spec, fmt, updates in plans:
            counts: dict[str, int] = {}
            for component, module, delta in updates:
                if hasattr(module, "unpack"):  # a conv holding its weight in oneDNN's layout
                    module.unpack()
                w = module.weight
                w.copy_((w.float() + spec.weight * delta.to(w.device)).to(w.dtype))
                counts[component] = counts.get(component, 0) + 1
            applied.append(AppliedLora(spec, fmt, counts, lora_hash(spec.path)))
    return applied


def lora_hashes_text(applied: Sequence[AppliedLora]) -> str:
    """A1111's ``Lora hashes`` value: ``name: hash, name: hash``."""
    return ", ".join(f"{a.name}: {a.hash}" for a in applied)


def parse_lora_hashes(text: str) -> dict[str, str]:
    """``Lora hashes`` back to ``{name: hash}``."""
    out = {}
    for part in text.split(","):
        if ":" in part:
            name, h = part.rsplit(":", 1)
            out[name.strip()] = h.strip()
    return out


__all__ = [
    "LoraSpec",
    "AppliedLora",
    "parse_lora_option",
    "strip_lora_tags",
    "find_lora",
    "lora_tags",
    "run_loras",
    "replay_loras",
    "lora_hash_warnings",
    "lora_hash",
    "read_lora_file",
    "parse_lora",
    "lora_targets",
    "original_unet_names",
    "apply_loras",
    "lora_hashes_text",
    "parse_lora_hashes",
]
