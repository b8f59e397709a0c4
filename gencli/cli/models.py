"""`gencli models`: the embedded default models."""

from __future__ import annotations

from gencli.cli import app
from gencli.cli.common import RunOptions, command
from gencli.console import emit_json, human_bytes, stdout_console


@command(app, "models", model_options=False)
def models(*, opts: RunOptions) -> None:
    """List the embedded default models: what they do, what they were trained on, how good they are."""
    from gencli.weights import list_defaults, weights_dir

    found = list_defaults()
    if opts.json:
        for m in found:
            emit_json({"name": m.name, "task": m.task, "title": m.title, "summary": m.summary, "path": str(m.path), "size_bytes": m.size_bytes})
        return
    from rich.table import Table

    out = stdout_console(soft_wrap=False)
    if not found:
        out.print(f"no embedded default models in {weights_dir()}")
        return
    table = Table(box=None, header_style="bold", show_edge=False)
    table.add_column("name")
    table.add_column("command")
    table.add_column("size", justify="right")
    table.add_column("summary", overflow="fold")
    for m in found:
        table.add_row(m.name, m.task or "", human_bytes(m.size_bytes), m.summary)
    out.print(table)
