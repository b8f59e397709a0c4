"""Declarative key mapping from a checkpoint's naming to a gencli module's naming.

A family describes each source format as an ordered list of rules; nothing is read while the plan
is built. The plan maps every target name to a lazy *producer* that reads its source tensor(s) and
applies the transformations only when the loader asks for it.

Rules (``pattern`` is a regular expression matched with ``re.search`` on the current name):
- ``Rename(pattern, repl)``: ``re.sub`` on the name (``\\1`` etc. allowed);
- ``Drop(pattern)``: the tensor is not used (buffers such as GPT-2's ``attn.bias`` mask);
- ``Transpose(pattern)``: 2-D weights stored the other way round (GPT-2's Conv1D);
- ``Split(pattern, into, dim, sizes)``: one fused tensor into several (``c_attn`` -> q, k, v);
  ``sizes`` is a list, or a function of the config, or None for equal chunks;
- ``Fuse(pattern, parts, into, dim)``: several tensors into one; ``pattern`` contains ``{part}``;
- ``Apply(pattern, fn, label)``: any other per-tensor transformation (reshape 1x1 convs to linears).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch

Reader = Any  # anything with .get(name) -> Tensor


@dataclass
class Producer:
    """A lazily produced target tensor and where it came from (for error messages)."""

    sources: tuple[str, ...]
    make: Callable[[Reader], torch.Tensor]
    steps: tuple[str, ...] = ()

    def __call__(self, reader: Reader) -> torch.Tensor:
        return self.make(reader)

    def describe(self) -> str:
        src = self.sources[0] if len(self.sources) == 1 else "+".join(self.sources)
        return src + (f" ({', '.join(self.steps)})" if self.steps else "")


def _read(name: str) -> Callable[[Reader], torch.Tensor]:
    return lambda reader: reader.get(name)


class Rule:
    def apply(self, plan: dict[str, Producer], config: Optional[dict]) -> dict[str, Producer]:
        raise NotImplementedError


@dataclass
class Rename(Rule):
    pattern: str
    repl: str

    def apply(self, plan, config):
        rx = re.compile(self.pattern)
        out: dict[str, Producer] = {}
        for name, prod in plan.items():
            new = rx.sub(self.repl, name)
            if new in out:
                raise ValueError(f"key mapping renames two tensors onto '{new}'")
            out[new] = prod
        return out


@dataclass
class Drop(Rule):
    pattern: str

    def apply(self, plan, config):
        rx = re.compile(self.pattern)
        return {k: v for k, v in plan.items() if not rx.search(k)}


@dataclass
class Apply(Rule):
    pattern: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    label: str = "transform"

    def apply(self, plan, config):
        rx = re.compile(self.pattern)
        out = {}
        for name, prod in plan.items():
            if rx.search(name):
                out[name] = Producer(prod.sources, (lambda p, f: lambda r: f(p(r)))(prod, self.fn), prod.steps + (self.label,))
            else:
                out[name] = prod
        return out


def Transpose(pattern: str) -> Apply:  # noqa: N802 - a rule constructor
    return Apply(pattern, lambda t: t.t().contiguous() if t.ndim == 2 else t, "transposed")


Sizes = Union[None, Sequence[int], Callable[[Optional[dict]], Sequence[int]]]


@dataclass
class Split(Rule):
    pattern: str
    into: Sequence[str]
    dim: int = 0
    sizes: Sizes = None

    def apply(self, plan, config):
        rx = re.compile(self.pattern)
        out = {}
        for name, prod in plan.items():
            if not rx.search(name):
                out[name] = prod
                continue
            n = len(self.into)
            sizes = self.sizes(config) if callable(self.sizes) else self.sizes

            def part(i: int, p: Producer = prod, sizes=sizes, n: int = n) -> Callable[[Reader], torch.Tensor]:
                def make(reader: Reader) -> torch.Tensor:
                    t = p(reader)
                    chunks = torch.split(t, list(sizes), dim=self.dim) if sizes is not None else torch.chunk(t, n, dim=self.dim)
                    if len(chunks) != n:
                        raise ValueError(f"cannot split '{p.describe()}' of shape {list(t.shape)} into {n} parts")
                    return chunks[i].contiguous()

                return make

            for i, tmpl in enumerate(self.into):
                out[rx.sub(tmpl, name)] = Producer(prod.sources, part(i), prod.steps + (f"part {i + 1}/{n} of dim {self.dim}",))
        return out


@dataclass
class Fuse(Rule):
    r"""Concatenate tensors that differ only in one name component, e.g.
    ``Fuse(r"\.{part}_proj\.", ["q", "k", "v"], ".qkv_proj.")``."""

    pattern: str  # contains "{part}" where the part name stands
    parts: Sequence[str]
    into: str  # replacement for the whole match of ``pattern``
    dim: int = 0

    def apply(self, plan, config):
        alternatives = "|".join(re.escape(p) for p in self.parts)
        rx = re.compile(self.pattern.replace("{part}", f"(?P<part>{alternatives})"))
        groups: dict[str, dict[str, str]] = {}
        for name in plan:
            m = rx.search(name)
            if m:
                key = name[: m.start("part")] + "\0" + name[m.end("part") :]
                groups.setdefault(key, {})[m.group("part")] = name
        out = dict(plan)
        for members in groups.values():
            missing = [p for p in self.parts if p not in members]
            if missing:
                some = next(iter(members.values()))
                raise ValueError(f"cannot fuse '{some}': its '{missing[0]}' partner is missing")
            names = [members[p] for p in self.parts]
            prods = [out.pop(n) for n in names]
            target = rx.sub(self.into, names[0], count=1)
            out[target] = Producer(
                tuple(s for p in prods for s in p.sources),
                (lambda ps: lambda r: torch.cat([p(r) for p in ps], dim=self.dim))(prods),
                (f"fused along dim {self.dim}",),
            )
        return out


@dataclass
class KeyMap:
    """An ordered list of rules describing one source format."""

    rules: list[Rule] = field(default_factory=list)
    name: str = "identity"

    def plan(self, source_keys: Iterable[str], config: Optional[dict] = None) -> dict[str, Producer]:
        plan = {k: Producer((k,), _read(k)) for k in source_keys}
        for rule in self.rules:
            plan = rule.apply(plan, config)
        return plan

    def __add__(self, other: "KeyMap") -> "KeyMap":
        return KeyMap(self.rules + other.rules, f"{self.name}+{other.name}")


IDENTITY = KeyMap([], "identity")
