"""The quantization a text model runs with: from ``--quantize`` / ``--group-size`` or the checkpoint's
``quantization_config``."""

from __future__ import annotations

from typing import Any, Optional

from gencli.errors import UserError


def check_quantization_flags(mode: Optional[str], group_size: Optional[int], mode_flag: str = "--quantize") -> None:
    """``--quantize``/``--mode`` (named ``mode_flag``) and ``--group-size``, before anything is read:
    the group size only with int4, and only one the int4 kernels take (never silently the default)."""
    from gencli.backend.quantize import INT4_GROUP_SIZES, MODES

    if mode is not None and mode not in MODES:
        raise UserError(f"{mode_flag} must be one of {', '.join(MODES)} (got '{mode}')")
    if group_size is None:
        return
    if mode != "int4":
        why = " (int8 has one scale per output channel)" if mode == "int8" else ""
        raise UserError(f"--group-size applies to {mode_flag} int4 only{why}")
    if group_size not in INT4_GROUP_SIZES:
        sizes = ", ".join(map(str, INT4_GROUP_SIZES))
        raise UserError(f"--group-size must be one of {sizes} (the int4 group sizes the kernels take: input columns per scale), got {group_size}")


def quantization_of(config: dict[str, Any], quantize: Optional[str], group_size: Optional[int]) -> tuple[bool, Any]:
    """``(stored, spec)``: the :class:`~gencli.backend.quantize.QuantizationSpec` the model runs
    with (None: not quantized) and whether the checkpoint already holds it."""
    from gencli.backend.quantize import QuantizationSpec

    check_quantization_flags(quantize, group_size)
    entry = config.get("quantization_config")
    if entry is None:
        if quantize is None:
            return False, None
        try:
            spec = QuantizationSpec.for_mode(quantize, group_size)
        except ValueError as exc:
            raise UserError(f"--group-size: {exc}") from None
        _check_activation_setting()
        return False, spec
    try:
        spec = QuantizationSpec.from_config(entry if isinstance(entry, dict) else {})
    except ValueError as exc:
        raise UserError(f"config.json: {exc}") from None
    if quantize is not None and (quantize != spec.mode or (group_size is not None and group_size != spec.group_size)):
        raise UserError(f"the checkpoint is quantized already ({describe_quantization(spec)}): it cannot be quantized as {quantize} again")
    _check_activation_setting()
    return True, spec


def _check_activation_setting() -> None:
    """A bad ``GENCLI_QUANT_ACTIVATIONS`` is a usage error before anything loads, not a failure in
    the first quantized product."""
    from gencli.backend.quant_kernels import int8_activations

    try:
        int8_activations()
    except ValueError as exc:
        raise UserError(str(exc)) from None


def describe_quantization(spec: Any) -> str:
    """``int8 per output channel`` / ``int4 in groups of 32``."""
    return f"{spec.mode} " + ("per output channel" if spec.mode == "int8" else f"in groups of {spec.group_size}")


def kept_in_float(spec: Any) -> Optional[str]:
    """The warning that int4 left linear layers in float (their input size not a multiple of the group
    size), or None when every linear layer is quantized."""
    kept = list(spec.modules_to_not_convert) if spec is not None else []
    if not kept:
        return None
    layers = f"{len(kept)} linear layer{'s' if len(kept) > 1 else ''}"
    return f"{layers} kept in float (input size not a multiple of the group size {spec.group_size}): {', '.join(kept)}"
