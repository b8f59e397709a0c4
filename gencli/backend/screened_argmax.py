"""Exact greedy token choice over a large fp32 LM head, reading the head in bf16.

Greedy decoding needs only ``argmax_v (h . w_v)`` over the vocabulary, not the logits themselves.
At batch 1 on a CPU the LM head is a matrix-vector product that streams the whole ``(V, D)``
matrix once per token (GPT-2: 154 MB of its 500 MB per token). :class:`ScreenedArgmax` streams a
bf16 copy instead (half the bytes) and keeps the result exact:

1. ``y~ = bf16(h) . bf16(W)^T`` (oneDNN, fp32 accumulation, bf16 output);
2. a rigorous bound ``|y_v - y~_v| <= B`` for every ``v`` (below) leaves the candidates
   ``{v : y~_v >= max y~ - 2B}``, a set that must contain the true argmax;
3. the candidates' logits are recomputed in fp32 from the original rows and the best one wins.

The bound, with ``dh = h - bf16(h)`` (known exactly), ``dw_v = w_v - bf16(w_v)`` (each element
within 2^-8 of itself, bf16's unit roundoff) and ``R = max_v |w_v|`` (2-norms, computed once)::

    h . w_v - bf16(h) . bf16(w_v) = dh . w_v + bf16(h) . dw_v
    B = |dh| R + |bf16(h)| 2^-8 R                 (Cauchy-Schwarz)
      + D 2^-23 |bf16(h)| (1 + 2^-8) R            (fp32 accumulation of D products, any order)
      + 2^-8 / (1 - 2^-8) max_v |y~_v|            (rounding of the outputs to bf16)

With real logits a handful of candidates remain; when none or more than ``max_candidates`` would
(outputs that overflow bf16, NaN inputs, near-ties everywhere) the full fp32 product decides, so the
answer is always that of the fp32 head (up to the fp32 rounding of a different summation order).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _onednn_bf16() -> bool:
    from gencli.backend.layers import _onednn_linear_available

    return _onednn_linear_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class ScreenedArgmax:
    """``argmax(h @ weight.T, -1)`` for fp32 ``h (B, D)`` and an fp32 head ``weight (V, D)``."""

    def __init__(self, weight: torch.Tensor, *, max_candidates: int = 128):
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("ScreenedArgmax needs a 2-D fp32 weight on the CPU")
        self.weight = weight.detach()
        self.max_candidates = max_candidates
        dim = weight.shape[1]
        # the bf16 head, packed once for oneDNN's matrix-vector kernel
        low = torch.empty(self.weight.shape, dtype=torch.bfloat16).copy_(self.weight)  # row-major, one copy
        self.packed = torch.ops.mkldnn._reorder_linear_weight(low, 1)
        del low
        # rounding to bf16 moves each weight by at most 2^-8 of itself (unit roundoff; bf16 keeps
        # fp32's exponent range, the subnormal tail is covered by an absolute 2^-133 per element),
        # so every row obeys |dw_v| <= 2^-8 |w_v| and |bf16(w_v)| <= (1 + 2^-8) |w_v|: one number,
        # the largest row norm, bounds every row. fp32 norms of D terms are within (D + 1) 2^-24
        # relative and the bound takes a few more fp32 operations: a D 2^-20 margin covers both.
        if self.weight.stride(0) == 1:  # a column-major head: its row norms, read in memory order
            row_norms = torch.linalg.vector_norm(self.weight.t(), dim=0)
        else:
            row_norms = torch.linalg.vector_norm(self.weight, dim=1)
        w_max = float(row_norms.max())
        self.margin = 1.0 + max(dim, 64) * 2.0**-20
        unit = 2.0**-8
        accumulation = dim * 2.0**-23  # fp32 accumulation of D exact bf16 products, any order
        self.w_norm_max = w_max * self.margin
        self.weight_term_max = ((unit + accumulation * (1 + unit)) * w_max + dim**0.5 * 2.0**-133) * self.margin
        self.output_term = unit / (1 - unit) * self.margin  # the bf16 output: |t - r| <= u |t| <= u/(1-u) |r|
        self.last_candidates: Optional[int] = None  # the largest candidate count of the last call

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        """Whether the screen can run here: an fp32 head on a CPU with oneDNN's native bf16 kernels."""
        return weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu" and _onednn_bf16()

    def approximate(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The screened logits ``y~ (B, V)`` (fp32 values of the bf16 outputs), their row maxima
        ``(B,)`` and, per row, one bound ``B (B,)`` with ``|y_v - y~_v| <= B`` for every ``v``."""
        h = hidden.detach()
        low = h.to(torch.bfloat16)
        rounded = low.float()
        norms = torch.stack([(h - rounded).norm(dim=-1), rounded.norm(dim=-1)], -1).mul_(self.margin)
        approx = torch.ops.mkldnn._linear_pointwise(low, self.packed, None, "none", [], "").float()
        top = approx.amax(dim=-1)
        magnitude = torch.maximum(top.abs(), approx.amin(dim=-1).abs())
        bound = norms[:, 0] * self.w_norm_max + norms[:, 1] * self.weight_term_max + self.output_term * magnitude
        return approx, top, bound

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B,)``: the argmax of the fp32 logits of each row of ``hidden (B, D)``.

        The true argmax ``v*`` satisfies ``y~_v* + B >= y_v* >= y_u >= y~_u - B`` for every ``u``,
        so it is among the ``v`` with ``y~_v >= max y~ - 2B``."""
        approx, top, bound = self.approximate(hidden)
        floor = top - 2.0 * bound
        out = torch.empty(hidden.shape[0], dtype=torch.long)
        most = 0
        for row in range(hidden.shape[0]):
            # a non-finite screen (bf16 overflow, NaN input) keeps nothing: the fp32 product decides
            ids = (approx[row] >= floor[row]).nonzero().view(-1)  # ascending: ties go to the lowest id
            most = max(most, len(ids))
            if not 0 < len(ids) <= self.max_candidates:
                out[row] = F.linear(hidden[row], self.weight).argmax()
                continue
            exact = torch.mv(self.weight.index_select(0, ids), hidden[row])
            out[row] = ids[exact.argmax()]
        self.last_candidates = most
        return out


__all__ = ["ScreenedArgmax"]
