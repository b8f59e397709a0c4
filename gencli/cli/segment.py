"""`gencli segment IMAGE...`: semantic segmentation with SegFormer checkpoints and gencli's U-Net."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from gencli.cli import app
from gencli.cli.common import DETERMINISTIC_SEED_HELP, RunOptions, command, option
from gencli.cli.images import BatchSizeOpt, ImagesArg, RecursiveOpt


def _expand(pattern: str, path: str, index: int, option: str) -> Path:
    """``pattern`` filled for the input ``path`` (an unknown placeholder is one error, as in txt2img)."""
    from gencli.io import format_name

    p = Path(path)
    return Path(format_name(pattern, option=option, stem=p.stem, name=p.name, index=index))


def _has_placeholder(pattern: str) -> bool:
    """Whether ``pattern`` has a replacement field (``{stem}``, ``{index:03d}`` ...); a malformed one
    counts, so that filling it reports the mistake."""
    import string

    try:
        return any(field is not None for _, field, _, _ in string.Formatter().parse(pattern))
    except ValueError:
        return True


def _fraction(value: Optional[float]) -> Optional[float]:
    if value is not None and not 0.0 <= value <= 1.0:
        raise typer.BadParameter(f"must be between 0 and 1 (got {value})")
    return value


def output_targets(pattern: Optional[str], out_dir: Optional[Path], paths: list[str], what: str, option_name: str, force: bool) -> Optional[list[Path]]:
    """Where each input's ``what`` (mask, overlay) goes: ``pattern`` (one file, or a name with
    ``{stem}``/``{name}``/``{index}``) or ``out_dir``/STEM.png; None when neither is given. Every
    target is checked before any work: distinct, named .png (``-``, a pipe or a device: any name),
    not existing (without ``force``), in a folder that exists."""
    from gencli.errors import UserError
    from gencli.io import ensure_writable, is_in_place

    if pattern is None and out_dir is None:
        return None
    if pattern is not None:
        if len(paths) > 1 and not _has_placeholder(pattern):
            raise UserError(
                f"{option_name} names one file but there are {len(paths)} images: put {{stem}} in it (e.g. '{{stem}}-{what}.png')"
                + (" or use --out-dir" if what == "mask" else "")
            )
        targets = [_expand(pattern, p, i, option_name) for i, p in enumerate(paths)]
    else:
        assert out_dir is not None
        if out_dir.exists() and not out_dir.is_dir():
            raise UserError(f"--out-dir '{out_dir}' is not a directory")
        targets = [out_dir / f"{Path(p).stem}.png" for p in paths]
    seen: dict[Path, str] = {}
    for t, p in zip(targets, paths):
        if t in seen:
            raise UserError(f"'{seen[t]}' and '{p}' would both write the {what} '{t}': use a pattern with {{index}} or distinct names")
        seen[t] = p
        if t.suffix.lower() != ".png" and not is_in_place(t):
            raise UserError(f"{option_name}: the {what} '{t}' is written as PNG: give it the .png suffix")
        if out_dir is not None and pattern is None and not out_dir.exists():
            if t.exists() and not force:
                raise UserError(f"output '{t}' already exists (use --force to overwrite)")
            continue
        ensure_writable(t, force)
    return targets


@command(app, "segment", seed_help=DETERMINISTIC_SEED_HELP)
def segment(
    images: ImagesArg,
    out: Annotated[
        Optional[str],
        option(
            "--out",
            metavar="MASK.png",
            help="Write the class map as a palette PNG (pixel values = class ids); for several images a name with {stem}, {name} or {index}.",
        ),
    ] = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out-dir", help="Write one mask per image into this folder, as STEM.png.")] = None,
    overlay: Annotated[
        Optional[str],
        typer.Option("--overlay", metavar="FILE.png", help="Write the image with the classes blended over it and a legend ({stem} etc. as for --out)."),
    ] = None,
    alpha: Annotated[
        Optional[float], typer.Option("--alpha", metavar="0..1", callback=_fraction, help="Opacity of the class colours in --overlay (default 0.5).")
    ] = None,
    batch_size: BatchSizeOpt = 8,
    recursive: RecursiveOpt = False,
    force: Annotated[bool, option("--force", help="Overwrite existing masks and overlays.")] = False,
    *,
    opts: RunOptions,
) -> None:
    """Label every pixel of images with a SegFormer checkpoint (transformers' SegformerForSemanticSegmentation
    folders) or a gencli UNetSegmenter.

    -o MASK.png writes the class map as an 8-bit palette PNG whose pixel values are the class ids
    (numpy.asarray(Image.open(MASK)) gives them; a viewer shows colours); --out-dir one per image;
    --overlay the image with the classes blended over it and a legend. Prints per image the classes
    present with their pixel counts: a table, or with --json one line per image
    {"image", "labels": [{"id", "label", "pixels", "fraction"}], "mask", "overlay"}. Unreadable
    images are reported and skipped; the exit code is then 2.
    """
    import time

    from gencli.errors import UserError
    from gencli.pipelines.segmentation import loading
    from gencli.pipelines.vision.images import image_paths, predict_image_files
    from gencli.weights import resolve_model

    report = opts.report
    if out is not None and out_dir is not None:
        raise UserError("give -o/--out (a file or a {stem} pattern) or --out-dir, not both")
    if alpha is not None and overlay is None:
        raise UserError("--alpha is the opacity of the --overlay image: give --overlay too")
    on_stdout = check_stdout_outputs(out, overlay, opts)
    paths = image_paths(images, recursive=recursive)  # bad inputs fail before the model loads
    masks = output_targets(out, out_dir, paths, "mask", "--out", force)
    overlays = output_targets(overlay, None, paths, "overlay", "--overlay", force)
    if masks and overlays:
        both = set(masks) & set(overlays)
        if both:
            raise UserError(f"the mask and the overlay would both be written to '{sorted(both)[0]}': give them different names")
    if opts.model is None and loading.DEFAULT_MODEL is None:
        raise UserError("segment has no embedded default model yet: pass --model (a SegFormer folder or a UNetSegmenter folder)")
    start = time.perf_counter()
    seg = loading.Segmenter.load(resolve_model(opts.model, loading.DEFAULT_MODEL), warn=report.warn, **opts.load_options())
    loaded = time.perf_counter()
    report.debug(f"segment: {seg.placement.describe()}")
    report.debug(f"loaded {seg.path} ({seg.kind}, {seg.num_labels} labels) in {loaded - start:.2f}s")
    if out_dir is not None and masks is not None:
        out_dir.mkdir(parents=True, exist_ok=True)

    def predict(ims: list) -> list:
        try:
            maps: list = seg.segment(ims)
        except UserError:  # an image the model cannot take (too small): find it, the others go on
            maps = []
            for im in ims:
                try:
                    maps.append(seg.segment([im])[0])
                except UserError as exc:
                    maps.append(str(exc))
        return [m if isinstance(m, str) else (m, im if overlays else None) for m, im in zip(maps, ims)]

    results = predict_image_files(paths, predict, batch_size=batch_size)
    n = write_segmentations(results, paths, seg.labels, masks, overlays, 0.5 if alpha is None else alpha, force, opts, table_to_stderr=on_stdout)
    took = time.perf_counter() - loaded
    report.debug(f"{n} image(s) in {took:.2f}s ({n / took:.1f} images/s)" if took > 0 else f"{n} image(s)")


def check_stdout_outputs(out: Optional[str], overlay: Optional[str], opts: RunOptions) -> bool:
    """Whether the mask or the overlay goes to stdout (``-``, ``/dev/stdout``); refused before any
    work: both there, with --json (whose lines stdout carries), or stdout a terminal."""
    import sys

    from gencli.errors import UserError
    from gencli.io import names_stdout, refuse_binary_terminal

    given = [(name, value) for name, value in (("-o/--out", out), ("--overlay", overlay)) if names_stdout(value)]
    if len(given) > 1:
        raise UserError("the mask and the overlay would both be written to stdout: give one of them a file")
    if given and opts.json:
        raise UserError(f"{given[0][0]} {given[0][1]} writes a PNG (binary) to stdout, where --json writes its lines: give it a file, or drop --json")
    if given:
        refuse_binary_terminal(sys.stdout, given[0][1])
    return bool(given)


def write_segmentations(
    results, paths: list[str], labels: dict[int, str], masks, overlays, alpha: float, force: bool, opts: RunOptions, *, table_to_stderr: bool = False
) -> int:
    """Write each image's mask/overlay as it comes, its JSON line (or keep its table rows), report
    unreadable inputs; exit 2 at the end if any. Returns the number of images segmented. With
    ``table_to_stderr`` (a PNG holds stdout) the table goes to stderr, unless --quiet."""
    import sys

    from gencli.console import emit_json, is_terminal, print_table
    from gencli.pipelines.segmentation.masks import label_counts, mask_image, overlay_image, write_image
    from gencli.pipelines.vision.images import unreadable_inputs_error

    report = opts.report
    failed: list[str] = []
    rows: list[tuple[str, list[dict[str, Any]]]] = []
    with report.progress("segmenting", total=len(paths)) as advance:
        for i, r in enumerate(results):
            error = r.error if r.error is not None else r.value if isinstance(r.value, str) else None
            if error is not None:
                failed.append(r.path)
                report.error(f"'{r.path}': {error}")
                if opts.json:
                    emit_json({"image": r.path, "error": error})
                advance(1)
                continue
            ids, image = r.value
            record: dict[str, Any] = {"image": r.path, "labels": label_counts(ids, labels)}
            if masks is not None:
                record["mask"] = str(write_image(masks[i], mask_image(ids, len(labels)), force))
            if overlays is not None:
                record["overlay"] = str(write_image(overlays[i], overlay_image(image, ids, labels, alpha), force))
            if opts.json:
                emit_json(record)
            else:
                rows.append((r.path, record["labels"]))
                for key in ("mask", "overlay"):
                    if key in record:
                        report.log(f"wrote {record[key]}")
            advance(1)
    if rows and table_to_stderr:
        if not report.quiet:
            print_table(segmentation_table(rows, repeat_image=not is_terminal(sys.stderr)), sys.stderr)
    elif rows:
        print_table(segmentation_table(rows, repeat_image=not is_terminal(sys.stdout)))
    if failed:
        raise unreadable_inputs_error(failed, len(paths))
    return len(paths) - len(failed)


def segmentation_table(rows, repeat_image: bool = False):
    """One row per class present: image (on its first row, or every row for a pipe), id, label, pixels, fraction."""
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, header_style="bold", show_edge=False, pad_edge=False)
    table.add_column("image", overflow="fold")
    table.add_column("id", justify="right")
    table.add_column("label")
    table.add_column("pixels", justify="right")
    table.add_column("fraction", justify="right")
    for path, present in rows:
        for k, p in enumerate(present):
            last = k == len(present) - 1
            table.add_row(  # names as Text: a path or label with [brackets] is not rich markup
                Text(path) if k == 0 or repeat_image else "",
                str(p["id"]),
                Text(p["label"]),
                str(p["pixels"]),
                f"{p['fraction']:.4f}",
                end_section=not repeat_image and last and len(present) > 1,
            )
    return table
