"""Temporal Fusion Transformer (Lim, Arik, Loeff, Pfister 2020, "Temporal Fusion Transformers for
interpretable multi-horizon time series forecasting"), a pure ``nn.Module``.

Building blocks, with the paper's equation numbers:

- :class:`GatedLinearUnit` (eq. 5): ``GLU(g) = sigmoid(W4 g + b4) * (W5 g + b5)``;
- :class:`GatedResidualNetwork` (eqs. 2-4): ``LayerNorm(skip(a) + GLU(W1 ELU(W2 a + W3 c + b2) + b1))``
  with an optional context ``c`` (``W3`` has no bias) and a linear skip projection when the output
  size differs from the input size (as in the authors' reference code);
- :class:`VariableSelectionNetwork` (eqs. 6-8): per-variable GRNs and softmax selection weights from
  a GRN over the flattened inputs (with the static context ``c_s`` for temporal inputs);
- static covariate encoders (four GRNs giving ``c_s, c_e, c_c, c_h``), an LSTM encoder over the
  history and an LSTM decoder over the horizon, gated skip + LayerNorm (eq. 17), static enrichment
  (eq. 18), :class:`InterpretableMultiHeadAttention` (eqs. 13-16, shared value projection, heads
  averaged) with a causal mask, gated skip (eq. 20), the position-wise GRN and the final gated skip
  over the LSTM layer (eqs. 21-22), and one linear head per quantile (eq. 23).

Where the study texts and the paper differ, this follows the paper:

- the texts feed the static selection context ``c_s`` into every per-variable GRN as well; in the
  paper (eq. 7) only the selection-weight GRN receives it;
- the texts send ``c_c`` to the LSTM encoder and ``c_h`` to the decoder; in the paper both
  initialise the encoder (cell and hidden state) and the decoder continues from the encoder's state;
- the texts' VSN example prints the weighted sum as [0.255, 0.005]; the correct value is
  [0.255275, 0.598] (see the unit tests).

Two choices the paper leaves open, made here:

- *Variable transformation sizes.* The paper transforms every input to ``d_model``; like
  pytorch-forecasting, a smaller ``variable_size`` may be used for the per-variable embeddings
  (their GRNs then have hidden size ``min(variable_size, d_model)`` and project to ``d_model``).
  ``variable_size == hidden_size`` is the paper's setting.
- *Quantile crossing.* The paper's independent per-quantile heads may cross. Here the heads
  ``W_q psi + b_q`` (one row of ``quantile_proj`` per quantile) produce the median directly and,
  for the other levels, the *log-spacing* to the neighbouring level nearer the median: outputs are
  ``median +/- cumsum(softplus(head))``, so they are ordered by construction. (Sorting would also
  prevent crossing but passes gradients to the wrong heads; the cumulative form keeps every head's
  meaning fixed.)

Attention goes through the backend's single entry point; with ``return_details=True`` the model
also returns the variable-selection weights and the attention weights over the history (for
interpretation). Only horizon positions are used as queries: the outputs at history positions are
never used by the heads, so this is exactly the paper's masked self-attention, cheaper.

Shapes: ``B`` series, ``L`` history steps, ``H`` horizon steps. Inputs left-aligned: when
``encoder_lengths`` is given, series ``b`` has valid history steps ``[0, encoder_lengths[b])``; the
remaining history positions are padding (packed away for the LSTM and masked for attention).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from gencli.backend.attention import scaled_dot_product_attention
from gencli.backend.layers import LayerNorm
from gencli.checkpoints.config import read_config

ARCHITECTURE = "TemporalFusionTransformer"


@dataclass
class TFTConfig:
    """What a TFT checkpoint's ``config.json`` holds (``architecture`` plus these fields).

    Input names define the order of the input tensors' last dimension; categorical inputs are given
    as ``{name: cardinality}`` (insertion order = tensor order).
    """

    hidden_size: int = 64
    variable_size: int = 16
    num_attention_heads: int = 4
    lstm_layers: int = 1
    dropout: float = 0.1
    layer_norm_eps: float = 1e-5
    quantiles: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    static_reals: list[str] = field(default_factory=list)
    static_categoricals: dict[str, int] = field(default_factory=dict)
    observed_reals: list[str] = field(default_factory=lambda: ["target"])
    observed_categoricals: dict[str, int] = field(default_factory=dict)
    known_reals: list[str] = field(default_factory=lambda: ["relative_time"])
    known_categoricals: dict[str, int] = field(default_factory=dict)
    # Several real columns that form one variable (e.g. the sine and cosine of the hour of day):
    # {variable name: [columns]}; each group is transformed by one linear map and selected as one.
    variable_groups: dict[str, list[str]] = field(default_factory=dict)
    # Anything else a pipeline wants to keep with the weights (scaling, context length, ...).
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        qs = [float(q) for q in self.quantiles]
        if not qs or any(not 0.0 < q < 1.0 for q in qs) or sorted(set(qs)) != qs:
            raise ValueError("quantiles must be distinct, increasing and inside (0, 1)")
        if 0.5 not in qs:
            raise ValueError("the quantile grid must contain the median 0.5")
        self.quantiles = qs
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}")
        if not self.known_reals and not self.known_categoricals:
            raise ValueError("a TFT needs at least one known (future) input, e.g. a relative time index")
        if not self.observed_reals and not self.observed_categoricals:
            raise ValueError("a TFT needs at least one observed (past) input: the target history")
        names = [c for role in ("static", "observed", "known") for c in list(getattr(self, f"{role}_reals")) + list(getattr(self, f"{role}_categoricals"))]
        names += list(self.variable_groups)
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"input names must be unique across roles and groups: {sorted(dup)}")
        for group, cols in self.variable_groups.items():
            roles = {role for role in ("static", "observed", "known") for c in cols if c in getattr(self, f"{role}_reals")}
            if len(roles) != 1 or any(not any(c in getattr(self, f"{r}_reals") for r in roles) for c in cols):
                raise ValueError(f"variable group '{group}' must list real inputs of one role")

    def real_groups(self, role: str) -> tuple[list[str], list[int]]:
        """The real-valued variables of a role (group names or column names) and, per real column,
        the index of the variable it belongs to."""
        owner = {c: g for g, cols in self.variable_groups.items() for c in cols}
        names: list[str] = []
        index: list[int] = []
        for col in getattr(self, f"{role}_reals"):
            name = owner.get(col, col)
            if name not in names:
                names.append(name)
            index.append(names.index(name))
        return names, index

    def input_names(self, role: str) -> list[str]:
        """The variables of a role as the selection networks see them: real ones then categorical."""
        return self.real_groups(role)[0] + list(getattr(self, f"{role}_categoricals"))

    @property
    def past_input_names(self) -> list[str]:
        """Inputs of the history selection network, in its order: known then observed."""
        return self.input_names("known") + self.input_names("observed")

    def to_dict(self) -> dict[str, Any]:
        return {"architecture": ARCHITECTURE, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TFTConfig":
        fields = set(cls.__dataclass_fields__)
        arch = data.get("architecture", ARCHITECTURE)
        if arch != ARCHITECTURE:
            raise ValueError(f"config.json names architecture '{arch}', not {ARCHITECTURE}")
        unknown = sorted(k for k in data if k not in fields and k != "architecture")
        if unknown:
            raise ValueError(f"config.json has unknown TFT fields: {', '.join(unknown)}")
        return read_config(cls, data)


class GatedLinearUnit(nn.Module):
    """``GLU(g) = sigmoid(W4 g + b4) * (W5 g + b5)`` (eq. 5); dropout on the input during training."""

    def __init__(self, input_size: int, output_size: int, dropout: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.gate = nn.Linear(input_size, output_size)  # W4, b4
        self.value = nn.Linear(input_size, output_size)  # W5, b5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(x)
        return torch.sigmoid(self.gate(x)) * self.value(x)


class GateAddNorm(nn.Module):
    """``LayerNorm(skip + GLU(x))``: the gated skip connection used throughout the TFT."""

    def __init__(self, input_size: int, output_size: int, dropout: float = 0.0, eps: float = 1e-5):
        super().__init__()
        self.glu = GatedLinearUnit(input_size, output_size, dropout)
        self.norm = LayerNorm(output_size, eps=eps)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.norm(skip + self.glu(x))


class GatedResidualNetwork(nn.Module):
    """``GRN(a, c) = LayerNorm(skip(a) + GLU(eta1))``, ``eta1 = W1 eta2 + b1``,
    ``eta2 = ELU(W2 a + W3 c + b2)`` (eqs. 2-4).

    ``skip(a) = a`` when input and output sizes agree, else a linear projection.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        output_size: Optional[int] = None,
        context_size: Optional[int] = None,
        dropout: float = 0.0,
        eps: float = 1e-5,
    ):
        super().__init__()
        output_size = input_size if output_size is None else output_size
        self.skip = nn.Linear(input_size, output_size) if output_size != input_size else None
        self.fc2 = nn.Linear(input_size, hidden_size)  # W2, b2
        self.context = nn.Linear(context_size, hidden_size, bias=False) if context_size else None  # W3
        self.fc1 = nn.Linear(hidden_size, hidden_size)  # W1, b1
        self.gate_norm = GateAddNorm(hidden_size, output_size, dropout, eps)

    def forward(self, a: torch.Tensor, c: Optional[torch.Tensor] = None) -> torch.Tensor:
        skip = a if self.skip is None else self.skip(a)
        h = self.fc2(a)
        if c is not None:
            if self.context is None:
                raise ValueError("this GRN was built without a context input")
            ctx = self.context(c)
            # a static context (B, d) broadcasts over the time axis of a temporal input (B, T, d)
            h = h + (ctx.unsqueeze(-2) if h.dim() == ctx.dim() + 1 else ctx)
        h = self.fc1(F.elu(h))
        return self.gate_norm(h, skip)


def weighted_sum(weights: torch.Tensor, processed: torch.Tensor) -> torch.Tensor:
    """The VSN combination ``sum_j v^(j) * xi~^(j)`` (eq. 8): weights ``(..., m)``, processed ``(..., m, d)``."""
    return torch.einsum("...m,...md->...d", weights, processed)


class VariableGRNs(nn.Module):
    """``m`` independent GRNs without context, one per variable, evaluated together.

    Mathematically ``m`` separate :class:`GatedResidualNetwork` (input ``e``, hidden ``h``, output
    ``d``, linear skip when ``e != d``); their weights are stored stacked along a leading variable
    axis (row ``j`` of every tensor is variable ``j``'s GRN, in ``nn.Linear`` layout) so all of them
    run as a few batched matrix products instead of ``m`` small ones. ``glu_weight`` holds W4 (first
    ``d`` rows, the sigmoid gate) and W5 (last ``d`` rows) of each GLU.
    """

    def __init__(self, num_inputs: int, input_size: int, hidden_size: int, output_size: int, dropout: float = 0.0, eps: float = 1e-5):
        super().__init__()
        m, e, h, d = num_inputs, input_size, hidden_size, output_size
        self.num_inputs, self.output_size, self.eps = m, d, eps
        self.fc2_weight = nn.Parameter(torch.empty(m, h, e))
        self.fc2_bias = nn.Parameter(torch.empty(m, h))
        self.fc1_weight = nn.Parameter(torch.empty(m, h, h))
        self.fc1_bias = nn.Parameter(torch.empty(m, h))
        self.glu_weight = nn.Parameter(torch.empty(m, 2 * d, h))
        self.glu_bias = nn.Parameter(torch.empty(m, 2 * d))
        if e != d:
            self.skip_weight = nn.Parameter(torch.empty(m, d, e))
            self.skip_bias = nn.Parameter(torch.empty(m, d))
        else:
            self.skip_weight = self.skip_bias = None
        self.norm_weight = nn.Parameter(torch.empty(m, d))
        self.norm_bias = nn.Parameter(torch.empty(m, d))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.fc2_weight.is_meta:
            return
        for w, b in ((self.fc2_weight, self.fc2_bias), (self.fc1_weight, self.fc1_bias), (self.glu_weight, self.glu_bias), (self.skip_weight, self.skip_bias)):
            if w is None:
                continue
            bound = 1.0 / math.sqrt(w.shape[-1])  # nn.Linear's default initialisation, per variable
            nn.init.uniform_(w, -bound, bound)
            nn.init.uniform_(b, -bound, bound)
        nn.init.ones_(self.norm_weight)
        nn.init.zeros_(self.norm_bias)

    @staticmethod
    def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))

    def combine(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[:, j] * GRN_j(x[j])`` for ``x (m, N, e)``, ``weights (N, m)`` -> ``(N, d)``.

        One variable at a time: the per-variable ``(N, d)`` intermediates stay cache-sized, which on a
        CPU is faster than materialising all ``m`` of them at once.
        """
        out = None
        for j in range(self.num_inputs):
            xj = x[j]
            h = F.elu(F.linear(xj, self.fc2_weight[j], self.fc2_bias[j]))
            h = F.linear(h, self.fc1_weight[j], self.fc1_bias[j])
            gate, value = F.linear(self.dropout(h), self.glu_weight[j], self.glu_bias[j]).chunk(2, dim=-1)
            skip = xj if self.skip_weight is None else F.linear(xj, self.skip_weight[j], self.skip_bias[j])
            y = F.layer_norm(skip + torch.sigmoid(gate) * value, (self.output_size,), self.norm_weight[j], self.norm_bias[j], self.eps)
            y = y * weights[:, j : j + 1]
            out = y if out is None else out + y
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (m, N, e)`` -> ``(m, N, d)``."""
        h = F.elu(self._linear(x, self.fc2_weight, self.fc2_bias))
        h = self._linear(h, self.fc1_weight, self.fc1_bias)
        gate, value = self._linear(self.dropout(h), self.glu_weight, self.glu_bias).chunk(2, dim=-1)
        skip = x if self.skip_weight is None else self._linear(x, self.skip_weight, self.skip_bias)
        y = F.layer_norm(skip + torch.sigmoid(gate) * value, (self.output_size,), eps=self.eps)
        return y * self.norm_weight.unsqueeze(1) + self.norm_bias.unsqueeze(1)


class VariableSelectionNetwork(nn.Module):
    """Instance-wise variable selection (eqs. 6-8).

    ``inputs`` are the transformed variables ``(..., m, variable_size)``. Each is processed by its own
    GRN (to ``hidden_size``); selection weights are ``softmax(GRN_v(flatten(inputs), c))``. Returns
    the weighted sum ``(..., hidden_size)`` and the weights ``(..., m)``.
    """

    def __init__(self, num_inputs: int, variable_size: int, hidden_size: int, context_size: Optional[int] = None, dropout: float = 0.0, eps: float = 1e-5):
        super().__init__()
        self.num_inputs = num_inputs
        self.variable_grns = VariableGRNs(num_inputs, variable_size, min(variable_size, hidden_size), hidden_size, dropout, eps)
        if num_inputs > 1:
            self.flattened_grn = GatedResidualNetwork(
                num_inputs * variable_size, min(hidden_size, num_inputs * variable_size), num_inputs, context_size, dropout, eps
            )
        else:
            self.flattened_grn = None

    def forward(self, inputs: torch.Tensor, context: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        lead = inputs.shape[:-2]
        m, e = inputs.shape[-2:]
        flat = inputs.reshape(-1, m, e)
        if self.flattened_grn is None:
            weights = inputs.new_ones(*lead, 1)
            return self.variable_grns(flat.transpose(0, 1))[0].reshape(*lead, -1), weights
        weights = torch.softmax(self.flattened_grn(inputs.flatten(-2), context), dim=-1)
        combined = self.variable_grns.combine(flat.transpose(0, 1).contiguous(), weights.reshape(-1, m))
        return combined.reshape(*lead, -1), weights


class InputEmbedding(nn.Module):
    """The paper's input transformations: a linear map per real-valued variable (a group of real
    columns shares one ``Linear(k, e)``), an entity embedding per categorical one; output
    ``(..., n_real_variables + n_cats, variable_size)``."""

    def __init__(self, group_index: Sequence[int], cardinalities: Sequence[int], variable_size: int):
        super().__init__()
        self.group_index = [int(g) for g in group_index]
        self.num_real_variables = max(self.group_index) + 1 if self.group_index else 0
        n_cols = len(self.group_index)
        # real column c contributes x_c * real_weight[c]; variable v adds real_bias[v]
        self.real_weight = nn.Parameter(torch.empty(n_cols, variable_size)) if n_cols else None
        self.real_bias = nn.Parameter(torch.empty(self.num_real_variables, variable_size)) if n_cols else None
        self.embeddings = nn.ModuleList(nn.Embedding(int(c), variable_size) for c in cardinalities)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.real_weight is not None and not self.real_weight.is_meta:
            nn.init.normal_(self.real_weight, std=1.0)
            nn.init.zeros_(self.real_bias)

    @property
    def num_inputs(self) -> int:
        return self.num_real_variables + len(self.embeddings)

    def forward(self, reals: Optional[torch.Tensor], cats: Optional[torch.Tensor]) -> torch.Tensor:
        parts = []
        if self.real_weight is not None:
            cols = reals.unsqueeze(-1) * self.real_weight
            if self.num_real_variables != len(self.group_index):
                index = torch.tensor(self.group_index, device=cols.device)
                cols = cols.new_zeros(*cols.shape[:-2], self.num_real_variables, cols.shape[-1]).index_add(-2, index, cols)
            parts.append(cols + self.real_bias)
        if len(self.embeddings):
            parts.append(torch.stack([emb(cats[..., j]) for j, emb in enumerate(self.embeddings)], dim=-2))
        return torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0]


class InterpretableMultiHeadAttention(nn.Module):
    """Multi-head attention with one value projection shared by all heads and the heads' outputs
    averaged before the output projection (eqs. 14-16), so the averaged weights are interpretable."""

    def __init__(self, hidden_size: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim)
        self.k_proj = nn.Linear(hidden_size, num_heads * self.head_dim)
        self.v_proj = nn.Linear(hidden_size, self.head_dim)  # W_V, shared across heads
        self.out_proj = nn.Linear(self.head_dim, hidden_size, bias=False)  # W_H
        self.dropout = dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: Optional[torch.Tensor] = None,
        return_weights: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``query (B, Lq, d)`` at the last ``Lq`` positions of ``key/value (B, Lk, d)``; causal.

        Returns ``(output (B, Lq, d), weights (B, Lq, Lk) averaged over heads or None)``.
        """
        b, lq, _ = query.shape
        lk = key.shape[1]
        q = self.q_proj(query).view(b, lq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(key).view(b, lk, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(value).unsqueeze(1)  # (B, 1, Lk, dv): one value head shared by every head
        weights = None
        if return_weights:
            # the entry point computes the written-out formula when asked for the weights
            heads, w = scaled_dot_product_attention(
                q, k, v.expand(b, self.num_heads, lk, self.head_dim), causal=True, key_padding_mask=key_padding_mask, return_weights=True
            )
            weights = w.mean(dim=1)
        else:
            heads = scaled_dot_product_attention(
                q,
                k,
                v.expand(b, self.num_heads, lk, self.head_dim),
                causal=True,
                key_padding_mask=key_padding_mask,
                dropout_p=self.dropout if self.training else 0.0,
            )
        # H~ = mean_h A_h V W_V, then W_H
        return self.out_proj(heads.mean(dim=1)), weights


def monotone_quantiles(raw: torch.Tensor, median_index: int) -> torch.Tensor:
    """Map per-quantile head outputs ``(..., Q)`` to ordered quantiles: the median head is the median;
    the others are cumulative softplus spacings away from it."""
    median = raw[..., median_index : median_index + 1]
    out = [median]
    if median_index + 1 < raw.shape[-1]:
        up = median + torch.cumsum(F.softplus(raw[..., median_index + 1 :]), dim=-1)
        out.append(up)
    if median_index > 0:
        down = median - torch.cumsum(F.softplus(raw[..., :median_index].flip(-1)), dim=-1).flip(-1)
        out.insert(0, down)
    return torch.cat(out, dim=-1)


class TemporalFusionTransformer(nn.Module):
    """The TFT (see the module docstring). Build from a :class:`TFTConfig`."""

    def __init__(self, config: TFTConfig):
        super().__init__()
        self.config = config
        d, e, p, eps = config.hidden_size, config.variable_size, config.dropout, config.layer_norm_eps
        cards_s = list(config.static_categoricals.values())
        cards_o = list(config.observed_categoricals.values())
        cards_k = list(config.known_categoricals.values())
        self.static_embedding = InputEmbedding(config.real_groups("static")[1], cards_s, e) if config.input_names("static") else None
        self.observed_embedding = InputEmbedding(config.real_groups("observed")[1], cards_o, e)
        self.known_embedding = InputEmbedding(config.real_groups("known")[1], cards_k, e)
        n_static = len(config.input_names("static"))
        n_known = len(config.input_names("known"))
        n_observed = len(config.input_names("observed"))

        if n_static:
            self.static_selection = VariableSelectionNetwork(n_static, e, d, None, p, eps)
            # the four static covariate encoders
            self.static_context_selection = GatedResidualNetwork(d, d, d, dropout=p, eps=eps)  # c_s
            self.static_context_enrichment = GatedResidualNetwork(d, d, d, dropout=p, eps=eps)  # c_e
            self.static_context_state_c = GatedResidualNetwork(d, d, d, dropout=p, eps=eps)  # c_c
            self.static_context_state_h = GatedResidualNetwork(d, d, d, dropout=p, eps=eps)  # c_h
        ctx = d if n_static else None
        self.encoder_selection = VariableSelectionNetwork(n_known + n_observed, e, d, ctx, p, eps)
        self.decoder_selection = VariableSelectionNetwork(n_known, e, d, ctx, p, eps)

        self.lstm_encoder = nn.LSTM(d, d, num_layers=config.lstm_layers, batch_first=True, dropout=p if config.lstm_layers > 1 else 0.0)
        self.lstm_decoder = nn.LSTM(d, d, num_layers=config.lstm_layers, batch_first=True, dropout=p if config.lstm_layers > 1 else 0.0)
        self.post_lstm_gate = GateAddNorm(d, d, p, eps)  # eq. 17, shared by encoder and decoder outputs
        self.static_enrichment = GatedResidualNetwork(d, d, d, context_size=ctx, dropout=p, eps=eps)  # eq. 18
        self.attention = InterpretableMultiHeadAttention(d, config.num_attention_heads, p)
        self.post_attention_gate = GateAddNorm(d, d, p, eps)  # eq. 20
        self.positionwise_grn = GatedResidualNetwork(d, d, d, dropout=p, eps=eps)  # eq. 21
        self.pre_output_gate = GateAddNorm(d, d, 0.0, eps)  # eq. 22
        self.quantile_proj = nn.Linear(d, len(config.quantiles))  # eq. 23: row q is the head W_q, b_q
        self.median_index = config.quantiles.index(0.5)

    # ------------------------------------------------------------------------------------------
    def forward(
        self,
        observed_reals: Optional[torch.Tensor],
        known_reals: Optional[torch.Tensor],
        static_reals: Optional[torch.Tensor] = None,
        static_categoricals: Optional[torch.Tensor] = None,
        observed_categoricals: Optional[torch.Tensor] = None,
        known_categoricals: Optional[torch.Tensor] = None,
        encoder_lengths: Optional[torch.Tensor] = None,
        return_details: bool = False,
    ):
        """Quantile forecasts ``(B, H, Q)`` (ordered along Q, in the scale of the target input).

        - ``observed_reals (B, L, n)`` / ``observed_categoricals (B, L, n)``: past-only inputs,
          the target history among them;
        - ``known_reals (B, L+H, n)`` / ``known_categoricals``: inputs known over history and horizon;
        - ``static_reals (B, n)`` / ``static_categoricals (B, n)``;
        - ``encoder_lengths (B,)``: valid history steps per series (left-aligned), default ``L``.

        With ``return_details`` also returns a dict of interpretation tensors: ``static_weights (B, S)``,
        ``encoder_weights (B, L, P)`` (known then observed inputs), ``decoder_weights (B, H, K)`` and
        ``attention (B, H, L+H)`` (averaged over heads; history positions first).
        """
        known = known_reals if known_reals is not None else known_categoricals
        obs = observed_reals if observed_reals is not None else observed_categoricals
        l_total = known.shape[1]
        l_past = obs.shape[1]
        horizon = l_total - l_past
        if horizon < 1:
            raise ValueError(f"known inputs cover {l_total} steps, history is {l_past}: no horizon")

        # static covariate encoders
        static_weights = None
        if self.static_embedding is not None:
            s_emb = self.static_embedding(static_reals, static_categoricals)
            zeta, static_weights = self.static_selection(s_emb)
            c_s = self.static_context_selection(zeta)
            c_e = self.static_context_enrichment(zeta)
            c_c = self.static_context_state_c(zeta)
            c_h = self.static_context_state_h(zeta)
            state = (
                c_h.unsqueeze(0).expand(self.config.lstm_layers, -1, -1).contiguous(),
                c_c.unsqueeze(0).expand(self.config.lstm_layers, -1, -1).contiguous(),
            )
        else:
            c_s = c_e = None
            state = None

        # variable selection over history (known + observed) and horizon (known)
        k_emb = self.known_embedding(known_reals, known_categoricals)
        o_emb = self.observed_embedding(observed_reals, observed_categoricals)
        past_in = torch.cat([k_emb[:, :l_past], o_emb], dim=-2)
        past_sel, encoder_weights = self.encoder_selection(past_in, c_s)
        future_sel, decoder_weights = self.decoder_selection(k_emb[:, l_past:], c_s)

        # LSTM encoder (packed when the histories have different lengths) and decoder
        variable = encoder_lengths is not None and bool((encoder_lengths != l_past).any())
        if variable:
            lengths_cpu = encoder_lengths.to("cpu", torch.int64).clamp(min=1)
            packed = nn.utils.rnn.pack_padded_sequence(past_sel, lengths_cpu, batch_first=True, enforce_sorted=False)
            enc_packed, enc_state = self.lstm_encoder(packed, state)
            enc_out, _ = nn.utils.rnn.pad_packed_sequence(enc_packed, batch_first=True, total_length=l_past)
        else:
            enc_out, enc_state = self.lstm_encoder(past_sel, state)
        dec_out, _ = self.lstm_decoder(future_sel, enc_state)

        # gated skip over the LSTM layer, static enrichment
        lstm_out = torch.cat([enc_out, dec_out], dim=1)
        selected = torch.cat([past_sel, future_sel], dim=1)
        phi = self.post_lstm_gate(lstm_out, selected)
        theta = self.static_enrichment(phi, c_e)

        # masked interpretable attention: horizon positions query everything before them
        key_padding_mask = None
        if variable:
            pos = torch.arange(l_total, device=theta.device)
            key_padding_mask = (pos.unsqueeze(0) < encoder_lengths.to(theta.device).unsqueeze(1)) | (pos.unsqueeze(0) >= l_past)
        theta_future = theta[:, l_past:]
        attn_out, attn_weights = self.attention(theta_future, theta, theta, key_padding_mask, return_weights=return_details)
        delta = self.post_attention_gate(attn_out, theta_future)
        psi = self.positionwise_grn(delta)
        psi_tilde = self.pre_output_gate(psi, phi[:, l_past:])
        quantiles = monotone_quantiles(self.quantile_proj(psi_tilde), self.median_index)
        if not return_details:
            return quantiles
        details = {
            "static_weights": static_weights,
            "encoder_weights": encoder_weights,
            "decoder_weights": decoder_weights,
            "attention": attn_weights,
        }
        return quantiles, details


def quantile_loss(prediction: torch.Tensor, target: torch.Tensor, quantiles: Sequence[float], mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pinball loss ``q max(y - yhat, 0) + (1 - q) max(yhat - y, 0)`` averaged over quantiles,
    horizon steps and series (eq. 24 up to the constant normalisation). ``prediction (..., Q)``,
    ``target (...)``, optional ``mask (...)`` of observed targets."""
    q = torch.as_tensor(list(quantiles), dtype=prediction.dtype, device=prediction.device)
    diff = target.unsqueeze(-1) - prediction
    loss = torch.maximum(q * diff, (q - 1) * diff)
    if mask is None:
        return loss.mean()
    m = mask.to(loss.dtype).unsqueeze(-1)
    return (loss * m).sum() / (m.sum() * loss.shape[-1]).clamp(min=1.0)
