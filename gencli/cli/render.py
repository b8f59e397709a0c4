"""Rendering a command's results on the command-line side (no torch at import time): the files a
command wrote (a JSON line each, or an informational line), and generated texts. The image
commands' predictions and similarities are rendered by :mod:`gencli.cli.images`. Text goes through
:mod:`gencli.console`; files through :mod:`gencli.io`.
"""

from __future__ import annotations

from typing import Any, Optional

from gencli.cli.common import RunOptions
from gencli.console import Reporter, emit_json
from gencli.errors import UserError


def check_binary_stdout(opts: RunOptions, *outs: Optional[object], what: str = "the image") -> None:
    """A binary output on stdout (``-o -``, ``/dev/stdout``) cannot share it with --json lines: one line, before any work."""
    from gencli.io import names_stdout

    if opts.json and any(names_stdout(o) for o in outs):
        raise UserError(f"-o - writes {what} (binary) to stdout, where --json writes its lines: give -o a file, or drop --json")


def report_written(opts: RunOptions, record: dict[str, Any]) -> None:
    """One output file written: its JSON line with --json, else an informational line (on a
    terminal or with --verbose: a pipeline's stderr stays quiet)."""
    if opts.json:
        emit_json(record)
        return
    seed = f" (seed {record['seed']})" if "seed" in record else ""
    opts.report.log(f"wrote {record['file']}{seed}")


def write_completions(batches, report: Reporter, out, *, stream: bool = False, echo: bool = False, many: bool = True) -> None:
    """Write each batch's completions (``batches``: ``(completions, model path, context length,
    seed)`` in prompt order) as they come: JSON lines with --json, else the texts (a blank line between
    them when ``many``; only the line end when ``stream``ed already)."""
    context_warned = False
    for completions, model_path, context_length, seed in batches:
        for c in completions:
            if c.hit_context and not context_warned:
                report.warn(f"stopped at the model's context length ({context_length} tokens)")
                context_warned = True
            if report.json:
                emit_json(c.as_json(model_path, seed), out)
            elif stream:
                out.write("\n")
            else:
                out.write((c.prompt if echo else "") + c.text + "\n")
                if many:
                    out.write("\n")
            out.flush()
        t = completions[0].timing
        report.debug(
            f"prefill {t['prefill_s']:.3f}s ({t['prefill_tokens_per_s'] or 0:.1f} tokens/s), "
            f"decode {t['decode_s']:.3f}s ({t['decode_tokens_per_s'] or 0:.1f} tokens/s), batch of {len(completions)}"
        )
