"""`gencli models`: the embedded default models."""

from __future__ import annotations

from gencli.cli import app
from gencli.cli.common import RunOptions, command
from gencli.console import emit_json, human_bytes, print_table, stdout_console


@command(app, "models", model_options=False)
def models(*, opts: RunOptions) -> None:
    """List the embedded default models: what they do, what they were trained on, how good they are."""
    from gencli.weights import list_defaults

    found = list_defaults()
    with opts.results() as fh:
        _write(found, opts.json, fh)


def _write(found, json: bool, fh) -> None:
    from gencli.weights import weights_dir

    if json:
        for m in found:
            emit_json(
                {"name": m.name, "commands": m.commands, "title": m.title, "summary": m.summary, "path": str(m.path), "size_bytes": m.size_bytes}, fh
            )
        return
    from rich.table import Table

    if not found:
        stdout_console(fh).print(f"no embedded default models in {weights_dir()}", markup=False)
        return
    table = Table(box=None, header_style="bold", show_edge=False, pad_edge=False)
    table.add_column("name")
    table.add_column("commands")
    table.add_column("size", justify="right")
    table.add_column("summary", overflow="fold")
    for m in found:
        table.add_row(m.name, ",".join(m.commands), human_bytes(m.size_bytes), m.summary)
    print_table(table, fh)
