"""The option groups of ``gencli.cli.common.command``: options declared once, expanded into each
command that names the group, and handed to the body as one value."""

from __future__ import annotations

from typing import Annotated, Optional

import pytest
import typer
from typer.testing import CliRunner

from gencli.cli.common import RunOptions, command, option_group


@option_group
class Sampling:
    steps: Annotated[int, typer.Option("--steps", help="Steps.")] = 10
    sampler: Annotated[Optional[str], typer.Option("--sampler", help="Sampler.")] = None


def _app(seen: dict, ray: bool = False) -> typer.Typer:
    app = typer.Typer()

    if ray:

        @command(app, "go", model_options=False, ray=True)
        def go(name: Annotated[str, typer.Argument()], *, sampling: Sampling, opts: RunOptions, distributed) -> None:
            seen.update(name=name, sampling=sampling, distributed=distributed, force=opts.force)

    else:

        @command(app, "go", model_options=False)
        def go(name: Annotated[str, typer.Argument()], *, sampling: Sampling, opts: RunOptions) -> None:
            seen.update(name=name, sampling=sampling)

    @app.callback()
    def main() -> None:
        pass

    return app


def test_a_group_becomes_its_options_and_the_body_gets_one_value():
    seen: dict = {}
    app = _app(seen)
    r = CliRunner().invoke(app, ["go", "x", "--steps", "3"])
    assert r.exit_code == 0, r.output
    assert seen == {"name": "x", "sampling": Sampling(steps=3, sampler=None)}
    help_text = CliRunner().invoke(app, ["go", "--help"]).output
    assert "--steps" in help_text and "--sampler" in help_text and "--sampling" not in help_text


def test_ray_true_adds_the_ray_options_and_hands_the_body_ray_options():
    from gencli.pipelines.distributed.runtime import RayOptions

    seen: dict = {}
    app = _app(seen, ray=True)
    r = CliRunner().invoke(app, ["go", "x", "--ray", "auto", "--replicas", "3", "--out-dir", "shards", "--force"])
    assert r.exit_code == 0, r.output
    assert seen["distributed"] == RayOptions("auto", 3, None, "shards", True)
    assert CliRunner().invoke(app, ["go", "x"]).exit_code == 0 and seen["distributed"] is None
    r = CliRunner().invoke(app, ["go", "x", "--gpus-per-replica", "1"])
    assert r.exit_code == 2 and "--gpus-per-replica needs --ray" in r.output


def test_distributed_goes_with_ray_true():
    with pytest.raises(TypeError, match="distributed"):

        @command(typer.Typer(), "go", ray=True)
        def go(*, opts: RunOptions) -> None:
            pass

    with pytest.raises(TypeError, match="distributed"):

        @command(typer.Typer(), "go")
        def go2(*, opts: RunOptions, distributed) -> None:
            pass
