"""Exact greedy token choice over a large fp32 or bf16 LM head, reading a low-precision copy of the head.

Greedy decoding needs only ``argmax_v (h . w_v)`` over the vocabulary, not the logits themselves.
At batch 1 on a CPU the LM head is a matrix-vector product that streams the whole ``(V, D)``
matrix once per token (GPT-2: 154 MB of its 500 MB per token). :class:`ScreenedArgmax` streams a
compact copy instead and keeps the result exact:

1. ``y~ = x~ . w~_v`` for every ``v``, from a rounded hidden state ``x~`` and rounded rows ``w~_v``
   (an int8 copy, a quarter of the bytes, or a bf16 copy, half of them);
2. a rigorous bound ``|y_v - y~_v| <= B`` for every ``v`` (below) leaves the candidates
   ``{v : y~_v >= max y~ - 2B}``, a set that must contain the true argmax;
3. the candidates' logits are recomputed in fp32 from the original rows and the best one wins.

The bound. With ``dx = h - x~`` (known exactly), ``dw_v = w_v - w~_v`` and ``R = max_v |w_v|``::

    h . w_v - x~ . w~_v = dx . w_v + x~ . dw_v
    B = (|dx| R + |x~| Q) + (the kernel's own rounding)        (Cauchy-Schwarz)

- **int8** (:class:`Int8Screen`, oneDNN's u8 x s8 kernel, CPUs with VNNI): each row is scaled to
  [-127, 127] once, so ``Q = max_v |dw_v|`` is computed when the copy is built. The hidden state
  goes in as two int8 rows of one product (the head is still read once): ``s q1`` plus the rounded
  remainder ``(s / 256) q2``, so ``x~`` carries about 16 bits and ``|dx| R`` nearly vanishes. The
  int32 sums ``A = sum_i q_i q_vi`` and ``z C = z sum_i q_vi`` (zero point ``z = 128``) are exact;
  turning ``s s_v (A - z C)`` into fp32 takes at most five roundings of ``2^-24 (|A| + |z C|)``
  each, and ``|A|, |z C| <= 255 sum_i |q_vi|``, so ``2^-12 s S`` per row (``S = 127 D max_v s_v``)
  covers them; the fp32 sum of the two rows adds ``2^-24 |x~| (R + Q)``.
- **bf16** (:class:`Bf16Screen`, oneDNN's bf16 kernel, CPUs with native bf16): bf16 rounding moves
  each weight by at most 2^-8 of itself, so ``Q = 2^-8 R`` plus the fp32 accumulation of D products
  (``D 2^-23 (1 + 2^-8) R``); the output is rounded to bf16 (``2^-8 / (1 - 2^-8) max|y~|``).

A bf16 head (the bf16 weights gencli's kernels decode with) is screened by its int8 copy alone (a bf16
copy would be the head itself): its rows are exact in fp32, so the bound is the int8 one, and the
candidates are recomputed from the bf16 rows widened to fp32 (the products the bf16 head computes).

With real logits a handful of candidates remain. Where none or more than ``max_candidates`` would
(a coarse screen, outputs that overflow, near-ties everywhere) the next copy tries, then the full
fp32 product decides (at once for a non-finite hidden state), so the answer is always that of the
fp32 head (up to the fp32 rounding of a different summation order).
"""

from __future__ import annotations

import math
import struct
from typing import Callable, Optional

import torch
import torch.nn.functional as F

_CHUNK_ROWS = 4096  # rows per step when building the int8 copy: its work buffer stays a few MB
_DOWN = torch.tensor(-math.inf)


def _onednn_bf16() -> bool:
    from gencli.backend.layers import _onednn_linear_available

    return _onednn_linear_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


_int8_ok: Optional[bool] = None


def _onednn_int8() -> bool:
    """oneDNN's u8 x s8 linear with an fp32 output, on a CPU whose int8 dot products cannot saturate
    (VNNI / AMX: exact int32 accumulation; older CPUs pair products in saturating 16-bit sums)."""
    global _int8_ok
    if _int8_ok is None:
        try:
            _int8_ok = bool(
                torch.backends.mkldnn.is_available()
                and hasattr(torch.ops, "onednn")
                and hasattr(torch.ops.onednn, "qlinear_pointwise")
                and hasattr(torch.ops.onednn, "qlinear_prepack")
                and torch.cpu._is_vnni_supported()
            )
        except (AttributeError, RuntimeError):
            _int8_ok = False
    return _int8_ok


def _fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32 number (the scale the kernel receives is an fp32)."""
    return struct.unpack("f", struct.pack("f", value))[0]


class Bf16Screen:
    """``x~ . w~_v`` with ``x~ = bf16(h)`` and a packed bf16 copy of the head (oneDNN)."""

    kind = "bf16"

    def __init__(self, weight: torch.Tensor, r: float):
        dim = weight.shape[1]
        low = torch.empty(weight.shape, dtype=torch.bfloat16).copy_(weight)  # row-major, one copy
        self.packed = torch.ops.mkldnn._reorder_linear_weight(low, 1)
        del low
        unit = 2.0**-8
        # |dw_v| <= 2^-8 |w_v| (bf16 keeps fp32's exponent range; the subnormal tail is covered by
        # an absolute 2^-133 per element); fp32 accumulation of D exact bf16 products, any order
        self.q = (unit + dim * 2.0**-23 * (1 + unit)) * r + dim**0.5 * 2.0**-133
        self.output = unit / (1 - unit)  # the bf16 output: |t - r| <= u |t| <= u/(1-u) |r|

    @staticmethod
    def available() -> bool:
        return _onednn_bf16()

    def __call__(self, h: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        low = h.to(torch.bfloat16)
        rounded = low.double()
        norms = torch.linalg.vector_norm(torch.stack([h.double() - rounded, rounded]), dim=-1)
        approx = torch.ops.mkldnn._linear_pointwise(low, self.packed, None, "none", [], "").float()
        magnitude = torch.maximum(approx.amax(dim=-1).abs(), approx.amin(dim=-1).abs()).double()
        return approx, norms[0], norms[1], self.output * magnitude


class Int8Screen:
    """``x~ . w~_v`` with ``x~`` the hidden state to about 16 bits (two int8 rows per call) and a
    per-row scaled s8 copy of the head (oneDNN's int8 linear, exact int32 accumulation, fp32 output)."""

    kind = "int8"

    def __init__(self, weight: torch.Tensor, r: float):
        vocab, dim = weight.shape
        self.scales = torch.empty(vocab, dtype=torch.float32)
        q8 = torch.empty((vocab, dim), dtype=torch.int8)
        sums = torch.empty(vocab, dtype=torch.float32)  # sum_i q_vi (exact: integers below 2^24)
        q = 0.0
        work = torch.empty((min(vocab, _CHUNK_ROWS), dim))  # reused: fresh large buffers cost page faults
        for start in range(0, vocab, _CHUNK_ROWS):
            w = weight[start : start + _CHUNK_ROWS].float()  # (a bf16 head's rows: exact in fp32)
            rows = work[: len(w)]
            scale = torch.maximum(w.amax(dim=1), w.amin(dim=1).neg_()).div_(127).clamp_(min=2.0**-100)
            self.scales[start : start + len(w)] = scale
            torch.div(w, scale[:, None], out=rows).round_().clamp_(-127, 127)
            q8[start : start + len(w)] = rows
            sums[start : start + len(w)] = rows.sum(dim=1)
            # fp32 w - q s is within 2^-24 (|w| + 2 |dw|) of the true dw per element: adding
            # 2^-23 |w_v| covers it (the fp32 norm's own error is in ScreenedArgmax's margin)
            q = max(q, float(torch.linalg.vector_norm(rows.mul_(scale[:, None]).sub_(w), dim=1).max()))
        self.q = q * (1 + 2.0**-22) + 2.0**-23 * r  # max_v |dw_v|
        self.r = r
        self.s = 127 * dim * float(self.scales.max())  # >= max_v s_v sum_i |q_vi|
        self.packed = torch.ops.onednn.qlinear_prepack(q8, None)
        del q8
        self.zero_points = torch.zeros(vocab, dtype=torch.int64)
        # a kernel that saturated its intermediate sums would be caught here: all-255 inputs give
        # every same-signed pair of products its largest sum
        full = torch.full((1, dim), 255, dtype=torch.uint8)
        got = self._product(full, 1.0, 0)[0].double()
        expected = sums.double() * 255 * self.scales.double()
        err = (got - expected).abs()
        allowed = 2.0**-12 * self.s + 2.0**-100
        if not bool((err <= allowed).all()):
            raise RuntimeError("oneDNN's int8 linear is not exact on this CPU")

    @staticmethod
    def available() -> bool:
        return _onednn_int8()

    def _product(self, qx: torch.Tensor, scale: float, zero: int) -> torch.Tensor:
        return torch.ops.onednn.qlinear_pointwise(
            qx, scale, zero, self.packed, self.scales, self.zero_points, None, 1.0, 0, torch.float32, "none", [], ""
        )

    def __call__(self, h: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(y~, |dx|, |x~|, the rounding of y~)`` per row; None when ``h`` is not finite.

        The hidden state goes in as two int8 rows of one matrix product, which costs what one row
        does (the head is read once): ``h ~ s q1 + (s / 256) q2`` with ``q1 = round(h / s)`` and
        ``q2`` the rounded remainder, so ``x~`` resolves ``h`` to about 16 bits and the ``|dx| R``
        term nearly vanishes (a single 8-bit row left it the larger half of the bound)."""
        rows = h.shape[0]
        peak = float(h.abs().amax())
        if not math.isfinite(peak):
            return None
        scale = _fp32(peak / 127) or 1.0
        wide = h.double()
        coarse = torch.round(h / scale).clamp_(-128, 127).double()
        step = coarse.mul(scale)
        fine = torch.round((wide - step).mul_(256 / scale)).clamp_(-128, 127)
        rounded = step.add_(fine, alpha=scale / 256)  # x~ exactly: 16-bit integers times an fp32 fit fp64
        norms = torch.linalg.vector_norm(torch.stack([wide - rounded, rounded]), dim=-1)
        levels = torch.cat([coarse, fine]).add_(128).to(torch.uint8)
        both = self._product(levels, scale, 128)
        approx = torch.add(both[:rows], both[rows:], alpha=1 / 256)
        # the kernel's rounding of each row (the second scaled by 1/256), then the fp32 sum: at most
        # 2^-24 |y~_v| <= 2^-24 |x~| (R + Q) each
        return approx, norms[0], norms[1], 2.0**-11 * scale * self.s + 2.0**-23 * (self.r + self.q) * norms[1]


_SCREENS = {"int8": Int8Screen, "bf16": Bf16Screen}


def _row_norms(weight: torch.Tensor) -> torch.Tensor:
    """fp32 norms of the rows of ``weight`` (fp32: any layout; bf16: row-major, a chunk at a time)."""
    if weight.dtype != torch.float32:
        return torch.cat([torch.linalg.vector_norm(weight[s : s + _CHUNK_ROWS].float(), dim=1) for s in range(0, weight.shape[0], _CHUNK_ROWS)])
    if weight.stride(0) == 1:  # a column-major head: its row norms, read in memory order
        return torch.linalg.vector_norm(weight.t(), dim=0)
    return torch.linalg.vector_norm(weight, dim=1)


def _kinds_for(weight: torch.Tensor) -> list[str]:
    """The copies that can screen ``weight``: both for fp32, the int8 one for bf16 (its bf16 copy is itself)."""
    return list(_SCREENS) if weight.dtype == torch.float32 else ["int8"]


def _screenable(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.device.type == "cpu" and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and weight.is_contiguous()))


class ScreenedArgmax:
    """``argmax(h @ weight.T, -1)`` for fp32 ``h (B, D)`` and an fp32 or row-major bf16 head ``weight (V, D)``
    (the argmax of the fp32 products of ``h`` and the bf16 values).

    ``kind`` picks the copy: "int8", "bf16", or None for a cascade of the copies this CPU runs
    exactly, cheapest first. A row the int8 screen cannot decide (too many candidates: a huge
    feature of the hidden state meeting a nearly unused column of the head makes the ``|x~| Q`` term
    of its bound loose) goes to the bf16 copy, built the first time it is needed, and only then to
    the fp32 product; when the int8 copy fails on most calls it is dropped and the bf16 copy leads."""

    DEMOTE_AFTER = 16  # calls before the leading copy can be dropped for failing on most of them

    def __init__(
        self, weight: torch.Tensor, *, max_candidates: int = 1024, kind: Optional[str] = None, product: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    ):
        if not _screenable(weight):
            raise ValueError("ScreenedArgmax needs a 2-D fp32 (or row-major bf16) weight on the CPU")
        if kind is not None and kind not in _SCREENS:
            raise ValueError(f"unknown screen {kind!r}; expected one of {', '.join(_SCREENS)}")
        self.weight = weight.detach()
        self.max_candidates = max_candidates
        self.product = product  # the head's own full product (fp32 logits of (B, D) rows), for what no copy decides
        dim = weight.shape[1]
        row_norms = _row_norms(self.weight)
        # fp32 norms of D terms are within (D + 1) 2^-24 relative and the bound takes a few more
        # fp32 operations: a D 2^-20 margin covers both
        self.margin = 1.0 + max(dim, 64) * 2.0**-20
        self.r = float(row_norms.max()) * self.margin
        # the cascade: the copies this CPU has kernels for, cheapest first; built when first needed
        self._kinds = [k for k in ([kind] if kind is not None else list(_SCREENS)) if k in _kinds_for(weight) and _SCREENS[k].available()]
        self._built: dict[str, object] = {}
        while self._kinds and self._build(self._kinds[0]) is None:
            self._kinds.pop(0)
        if not self._kinds:
            raise ValueError(f"no {kind or 'exact low-precision'} screen runs on this CPU")
        self._calls = self._misses = 0  # of the leading copy
        self.gave_up = False  # the last copy failed on most calls: every row goes to the full product
        self.last_candidates: Optional[int] = None  # the largest candidate count of the last call

    def _build(self, kind: str):
        """The copy of ``kind``, built on first use; None when its kernel fails the exactness check."""
        if kind not in self._built:
            try:
                self._built[kind] = _SCREENS[kind](self.weight, self.r)
            except RuntimeError:
                self._built[kind] = None
        return self._built[kind]

    @property
    def screen(self):
        """The leading copy (:class:`Int8Screen` or :class:`Bf16Screen`)."""
        return self._built[self._kinds[0]]

    @property
    def kind(self) -> str:
        return self._kinds[0]

    @staticmethod
    def supported(weight: torch.Tensor, kind: Optional[str] = None) -> bool:
        """Whether a screen can run here: an fp32 head on a CPU with oneDNN's int8 (VNNI) or native
        bf16 kernels, a bf16 one with the int8 kernel (``kind`` asks for one of them)."""
        if not _screenable(weight):
            return False
        kinds = [kind] if kind is not None else list(_SCREENS)
        return any(k in _kinds_for(weight) and _SCREENS[k].available() for k in kinds)

    def approximate(self, hidden: torch.Tensor, screen=None) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The screened logits ``y~ (B, V)`` (fp32) of ``screen`` (the leading copy by default), their
        row maxima ``(B,)`` and, per row, one bound ``B (B,)`` (fp64) with ``|y_v - y~_v| <= B`` for
        every ``v``; None when ``hidden`` is not finite."""
        screen = self.screen if screen is None else screen
        out = screen(hidden.detach())
        if out is None:
            return None
        approx, dx_norm, x_norm, rounding = out
        bound = (dx_norm * self.r + x_norm * screen.q + rounding) * self.margin
        return approx, approx.amax(dim=-1), bound

    def _decide(self, screen, hidden: torch.Tensor) -> Optional[list]:
        """Per row, the token id the screen proves to be the argmax, or None where too many (or no)
        candidates remain; None for all rows when ``hidden`` is not finite.

        The true argmax ``v*`` satisfies ``y~_v* + B >= y_v* >= y_u >= y~_u - B`` for every ``u``,
        so it is among the ``v`` with ``y~_v >= max y~ - 2B``."""
        screened = self.approximate(hidden, screen)
        if screened is None:
            return None
        approx, top, bound = screened
        # max y~ - 2B in fp64, then the fp32 number just below it: rounding never drops a candidate
        floor = torch.nextafter((top.double() - 2.0 * bound).float(), _DOWN)
        decided = []
        for row, (y, h) in enumerate(zip(approx, hidden)):
            # a non-finite screen (NaN, overflow) keeps nothing: the next copy or fp32 decides
            ids = (y >= floor[row]).nonzero().view(-1)  # ascending: ties go to the lowest id
            self.last_candidates = max(self.last_candidates or 0, len(ids))
            if not 0 < len(ids) <= self.max_candidates:
                decided.append(None)
                continue
            decided.append(ids[torch.mv(self.weight.index_select(0, ids).float(), h).argmax()])
        return decided

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B,)``: the argmax of the fp32 logits of each row of ``hidden (B, D)``."""
        out: list = [None] * hidden.shape[0]
        todo = list(range(hidden.shape[0]))
        self.last_candidates = None
        for level, kind in enumerate([] if self.gave_up else list(self._kinds)):
            screen = self._build(kind)
            if screen is None:
                continue
            decided = self._decide(screen, hidden[todo] if len(todo) < len(out) else hidden)
            if decided is None:  # a non-finite hidden state: only the fp32 product can answer
                break
            left = [row for row, token in zip(todo, decided) if token is None]
            for row, token in zip(todo, decided):
                if token is not None:
                    out[row] = token
            if level == 0:
                self._count(bool(left))
            todo = left
            if not todo:
                break
        for row in todo:
            out[row] = self._logits(hidden[row]).argmax()
        return torch.stack(out)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The full fp32 logits of one hidden state: the head's own product where one was given, else
        fp32 (a bf16 head widened a chunk of rows at a time)."""
        if self.product is not None:
            return self.product(h[None]).view(-1)
        if self.weight.dtype == torch.float32:
            return F.linear(h, self.weight)
        return torch.cat([F.linear(h, self.weight[s : s + _CHUNK_ROWS].float()) for s in range(0, self.weight.shape[0], _CHUNK_ROWS)])

    def _count(self, missed: bool) -> None:
        """Drop the leading copy when it fails on most calls and a next one can take over; when none
        can, stop screening (its misses would pay for the copy and the full product both)."""
        self._calls += 1
        self._misses += missed
        if self._calls >= self.DEMOTE_AFTER and 2 * self._misses > self._calls:
            if len(self._kinds) > 1 and self._build(self._kinds[1]) is not None:
                self._built.pop(self._kinds.pop(0))
                self._calls = self._misses = 0
            elif len(self._kinds) == 1:
                self.gave_up = True


__all__ = ["Bf16Screen", "Int8Screen", "ScreenedArgmax"]
