"""`gencli info PATH`: format, architecture, parameter count, dtypes and a tensor listing."""

from __future__ import annotations

import re
from typing import Annotated, Optional

import typer

from gencli.cli import app
from gencli.cli.common import RunOptions, at_least, command
from gencli.console import emit_json, human_bytes, human_count, print_table, stdout_console


@command(app, "info", model_options=False)
def info(
    path: Annotated[
        str,
        typer.Argument(
            metavar="PATH", help="A .safetensors file, a model folder, a diffusers pipeline folder, or an embedded default's name.", show_default=False
        ),
    ],
    match: Annotated[Optional[str], typer.Option("--match", help="Only list tensors whose name matches this regular expression.")] = None,
    limit: Annotated[
        Optional[int], typer.Option("--limit", callback=at_least(0), help="Tensors listed in the table (default 40; 0 = none; --all for every one).")
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="List every tensor.")] = False,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Read .bin/.pt/.ckpt checkpoints with torch.load(weights_only=True).")] = False,
    *,
    opts: RunOptions,
) -> None:
    """Show what a checkpoint is: format, architecture, parameters, dtypes and its tensors."""
    from gencli.checkpoints.describe import describe
    from gencli.errors import UserError
    from gencli.weights import resolve_model

    if all_ and limit is not None:
        raise UserError("--all lists every tensor and --limit some of them: give one")
    d = describe(resolve_model(path), allow_pickle=allow_pickle)
    if match:
        try:
            rx = re.compile(match)
        except re.error as exc:
            raise UserError(f"--match is not a valid regular expression: {exc}") from None
        d["tensors"] = [t for t in d["tensors"] if rx.search(t["name"])]
    with opts.results() as fh:
        if opts.json:
            emit_json(d, fh)
        else:
            _render(d, None if all_ else 40 if limit is None else limit, fh)


def _quantization_line(q: dict) -> str:
    """The quantization a checkpoint's config.json names: gencli's own (mode, the layers it quantized,
    per channel or in groups), else the method and what its entry says (GPTQ, AWQ, bitsandbytes: their
    layers are not gencli's, not counted). Any value of the entry may be malformed: shown, never a crash."""
    size = q.get("group_size")
    grouped = isinstance(size, int) and not isinstance(size, bool) and size > 0
    method = q.get("quant_method")
    if method != "gencli":
        bits = f", {q['bits']} bits" if q.get("bits") is not None else ""
        return f"{method or 'unknown method'}{bits}" + (f", in groups of {size}" if grouped else "") + " (not a gencli quantize folder)"
    how = f"in groups of {size}" if grouped else "per output channel" if size in (None, -1, 0) else f"group size {size!r}"
    head = ", the LM head stored as a quantized copy of the tied embedding (not counted)" if q.get("untied_head") else ""
    return f"{q.get('mode')} ({method}), {q.get('layers')} linear layers {how}{head}"


def _render(d: dict, limit: Optional[int], file) -> None:
    from rich.table import Table

    out = stdout_console(file)
    out.print(f"[bold]{d['path']}[/bold]")
    out.print(f"  format        {d['format']}")
    out.print(f"  architecture  {d['architecture'] or 'unknown'}")
    out.print(f"  parameters    {human_count(d['parameters'])} ({d['parameters']:,})")
    out.print(
        f"  size          {human_bytes(d['size_bytes'])} in "
        + (f"{len(d['components'])} component(s)" if "components" in d else f"{max(len(d['files']), 1)} file(s)")
    )
    dts = ", ".join(
        f"{k} {human_count(v['parameters'])} in {v['tensors']} tensors" for k, v in sorted(d["dtypes"].items(), key=lambda kv: -kv[1]["parameters"])
    )
    out.print(f"  dtypes        {dts or '-'}")
    q = d.get("quantization")
    if q:
        out.print(f"  quantization  {_quantization_line(q)}")
    if d.get("config"):
        out.print("  config        " + ", ".join(f"{k}={v}" for k, v in d["config"].items()))
    for name, comp in (d.get("components") or {}).items():
        if comp.get("parameters"):
            out.print(f"  - {name:<14}{comp.get('class') or comp['architecture']}: {human_count(comp['parameters'])} parameters")
        else:
            out.print(f"  - {name:<14}{comp.get('class') or ''} (no weights)")
    if limit == 0 or not d["tensors"]:
        return
    rows = d["tensors"] if limit is None else d["tensors"][:limit]
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    table.add_column("tensor")
    table.add_column("dtype")
    table.add_column("shape")
    table.add_column("parameters", justify="right")
    for t in rows:
        n = 1
        for s in t["shape"]:
            n *= s
        table.add_row(t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", f"{n:,}")
    out.print()
    print_table(table, file)
    if len(rows) < len(d["tensors"]):
        out.print(f"... {len(d['tensors']) - len(rows)} more tensors (use --all or --match)")
