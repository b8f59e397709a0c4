"""BERT-family encoders: BERT (MiniLM, PubMedBERT, BioBERT...), RoBERTa and DistilBERT, one implementation.

Post-LN transformer layers (attention -> add & LayerNorm -> GELU MLP -> add & LayerNorm), learned
absolute position embeddings, bidirectional attention with a key padding mask through the one
attention entry point. A padded batch runs its token-wise work (projections, MLP, norms) on the real
tokens alone, packed (:class:`Unpadding`); a sequence classifier's last layer computes the first
token alone; the masked LM's head can be applied to the masked positions alone
(:meth:`EncoderForTask.head_output`). The per-architecture differences are small and explicit:

- BERT: token type embeddings (sentence pairs), optional pooler (``dense`` + tanh on the first token);
- RoBERTa: position ids counted past ``padding_idx`` over the non-pad tokens (``cumsum(mask) + pad``),
  one token type;
- DistilBERT: no token types, no pooler, its own tensor names (``transformer.layer.N.attention.q_lin``
  ...), which :func:`keymap` renames onto BERT's.

Attribute names mirror transformers' BERT/RoBERTa classes (``bert.embeddings.word_embeddings``,
``bert.encoder.layer.N.attention.self.query`` ... and each head's own names), so those checkpoints load
without renaming. The heads: masked LM, sequence classification, token classification, question
answering, or none (the bare encoder, for embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

from gencli.backend.attention import scaled_dot_product_attention
from gencli.backend.layers import LayerNorm, Linear, get_activation
from gencli.checkpoints.config import read_config
from gencli.checkpoints.keymap import Drop, KeyMap, Rename
from gencli.errors import CheckpointError

# model_type -> the attribute the base encoder lives under in transformers' task models
PREFIX = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "distilbert": "distilbert"}
MODEL_TYPES = set(PREFIX)

HEADS = ("base", "masked_lm", "sequence_classification", "token_classification", "question_answering")
# architectures (transformers class names) -> (model_type, head)
ARCHITECTURES: dict[str, tuple[str, str]] = {}
for _mt, _cls in (("bert", "Bert"), ("roberta", "Roberta"), ("xlm-roberta", "XLMRoberta"), ("distilbert", "DistilBert")):
    ARCHITECTURES.update(
        {
            f"{_cls}Model": (_mt, "base"),
            f"{_cls}ForMaskedLM": (_mt, "masked_lm"),
            f"{_cls}ForSequenceClassification": (_mt, "sequence_classification"),
            f"{_cls}ForTokenClassification": (_mt, "token_classification"),
            f"{_cls}ForQuestionAnswering": (_mt, "question_answering"),
        }
    )
ARCHITECTURES["BertForPreTraining"] = ("bert", "masked_lm")


@dataclass
class EncoderConfig:
    model_type: str = "bert"
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    tie_word_embeddings: bool = True
    num_labels: int = 2
    problem_type: Optional[str] = None
    id2label: dict[str, Any] = field(default_factory=dict)
    position_embedding_type: str = "absolute"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "EncoderConfig":
        model_type = cfg.get("model_type") or "bert"
        if model_type not in MODEL_TYPES:
            raise CheckpointError(f"config.json model_type '{model_type}' is not a BERT-family encoder ({', '.join(sorted(MODEL_TYPES))})")
        if cfg.get("position_embedding_type", "absolute") not in (None, "absolute"):
            raise CheckpointError(f"position_embedding_type '{cfg['position_embedding_type']}' is not supported (only absolute positions)")
        if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
            raise CheckpointError("BERT-family decoders (is_decoder / add_cross_attention) are not supported")
        id2label = cfg.get("id2label") or {}
        num_labels = cfg.get("num_labels") or (len(id2label) if id2label else 2)
        if model_type == "distilbert":
            renames = {
                "hidden_size": "dim",
                "num_hidden_layers": "n_layers",
                "num_attention_heads": "n_heads",
                "intermediate_size": "hidden_dim",
                "hidden_act": "activation",
            }
            return read_config(
                cls,
                cfg,
                what="a DistilBERT model",
                required=("vocab_size", "dim", "n_layers", "n_heads"),
                renames=renames,
                model_type=model_type,
                type_vocab_size=0,
                layer_norm_eps=1e-12,
                num_labels=int(num_labels),
                id2label=dict(id2label),
            )
        return read_config(
            cls,
            cfg,
            what=f"a {model_type} model",
            required=("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"),
            model_type=model_type,
            num_labels=int(num_labels),
            id2label=dict(id2label),
        )

    @property
    def roberta_positions(self) -> bool:
        return self.model_type in ("roberta", "xlm-roberta")

    @property
    def max_positions(self) -> int:
        """The most tokens one sequence may have (RoBERTa's positions start past ``padding_idx``)."""
        return self.max_position_embeddings - (self.pad_token_id + 1 if self.roberta_positions else 0)

    @property
    def prefix(self) -> str:
        return PREFIX[self.model_type]


class Embeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        if cfg.type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def position_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.cfg.roberta_positions:
            # RoBERTa: pad tokens sit at padding_idx, the others count from padding_idx + 1
            pad = self.cfg.pad_token_id
            mask = input_ids.ne(pad).to(torch.long)
            return torch.cumsum(mask, dim=1) * mask + pad
        return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        n = input_ids.shape[1]
        limit = self.cfg.max_positions
        if n > limit:
            raise ValueError(f"{n} tokens are more than the model's {limit} positions")
        x = self.word_embeddings(input_ids) + self.position_embeddings(self.position_ids(input_ids))
        if self.cfg.type_vocab_size > 0:
            if token_type_ids is None or self.cfg.type_vocab_size == 1:
                token_type_ids = torch.zeros_like(input_ids)
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        if cfg.hidden_size % cfg.num_attention_heads:
            raise CheckpointError(f"hidden size {cfg.hidden_size} is not a multiple of {cfg.num_attention_heads} attention heads")
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.query = Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor], queries: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Self attention over ``x``; ``queries`` (default ``x``) are the positions whose outputs are wanted."""
        queries = x if queries is None else queries
        return self.attend(self.query(queries), self.key(x), self.value(x), key_padding_mask)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Attention of projected ``(B, nq, d)`` queries over projected ``(B, n, d)`` keys and values -> ``(B, nq, d)``."""
        b, nq, d = q.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, t.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

        out = scaled_dot_product_attention(heads(q), heads(k), heads(v), key_padding_mask=key_padding_mask)
        return out.transpose(1, 2).reshape(b, nq, d)


class DenseNorm(nn.Module):
    """``LayerNorm(dense(x) + residual)``: BERT's ``attention.output`` and ``output``."""

    def __init__(self, d_in: int, d_out: int, eps: float):
        super().__init__()
        self.dense = Linear(d_in, d_out)
        self.LayerNorm = LayerNorm(d_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.self = SelfAttention(cfg)
        self.output = DenseNorm(cfg.hidden_size, cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor], queries: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.output(self.self(x, key_padding_mask, queries), x if queries is None else queries)


class Intermediate(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.intermediate_size)
        get_activation(cfg.hidden_act)  # an unknown activation fails when the model is built
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x, activation=self.act)


class Layer(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = DenseNorm(cfg.intermediate_size, cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor], queries: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The layer's output at every position of ``x``, or only at ``queries`` (a subset of ``x``'s
        positions: every position still serves as a key and a value)."""
        x = self.attention(x, key_padding_mask, queries)
        return self.output(self.intermediate(x), x)

    def forward_packed(self, x: torch.Tensor, unpad: "Unpadding") -> torch.Tensor:
        """The layer on the real tokens alone, packed ``(T, d)``: only attention sees the padded layout."""
        attn = self.attention.self
        q, k, v = (unpad.pad(p(x)) for p in (attn.query, attn.key, attn.value))
        context = unpad.unpad(attn.attend(q, k, v, unpad.key_padding_mask))
        x = self.attention.output(context, x)
        return self.output(self.intermediate(x), x)


class Unpadding:
    """Moving a padded batch's token states ``(B, n, d)`` to the real tokens alone, packed ``(T, d)``, and back."""

    def __init__(self, key_padding_mask: torch.Tensor):
        self.key_padding_mask = key_padding_mask
        self.batch, self.length = key_padding_mask.shape
        self.index = key_padding_mask.reshape(-1).nonzero().squeeze(1)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1]).index_select(0, self.index)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Packed ``(T, d)`` -> ``(B, n, d)``, zeros at the padded positions."""
        out = x.new_zeros(self.batch * self.length, x.shape[-1]).index_copy(0, self.index, x)
        return out.view(self.batch, self.length, x.shape[-1])


class Stack(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor], first_token_only: bool = False) -> torch.Tensor:
        """The last layer's states ``(B, n, d)``; with ``first_token_only`` only the first token's
        ``(B, 1, d)``, the last layer then computing that position alone (what a classifier reads)."""
        last = len(self.layer) - 1
        if key_padding_mask is None:
            for i, layer in enumerate(self.layer):
                x = layer(x, None, x[:, :1] if first_token_only and i == last else None)
            return x
        # padding: the token-wise work (projections, MLP, norms) runs on the real tokens alone; the
        # padded positions' states come back as zeros (nothing reads them)
        unpad = Unpadding(key_padding_mask)
        x = unpad.unpad(x)
        for i, layer in enumerate(self.layer):
            if first_token_only and i == last:
                full = unpad.pad(x)
                return layer(full, key_padding_mask, full[:, :1])
            x = layer.forward_packed(x, unpad)
        return unpad.pad(x)


class Pooler(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.dense(hidden[:, 0], activation="tanh")


class EncoderModel(nn.Module):
    """The bare encoder: ``(B, n)`` token ids -> ``(B, n, hidden)`` states (and the pooler, when present)."""

    def __init__(self, cfg: EncoderConfig, pooler: bool = False):
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Stack(cfg)
        self.pooler = Pooler(cfg) if pooler else None

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
        first_token_only: bool = False,
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, token_type_ids)
        kpm = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.to(torch.bool)
        return self.encoder(x, kpm, first_token_only)


# -- heads ------------------------------------------------------------------------------------
class BertPredictionHead(nn.Module):
    """``cls.predictions``: transform (dense, activation, LayerNorm), decoder tied to the word embeddings, bias."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.transform = nn.Module()
        self.transform.dense = Linear(cfg.hidden_size, cfg.hidden_size)
        self.transform.LayerNorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.act = cfg.hidden_act

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.transform.LayerNorm(self.transform.dense(hidden, activation=self.act))
        return torch.nn.functional.linear(h, self.decoder.weight, self.bias)


class RobertaLMHead(nn.Module):
    """``lm_head``: dense, GELU, layer_norm, decoder tied to the word embeddings, bias."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size)
        self.layer_norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        h = self.layer_norm(self.dense(hidden, activation="gelu"))
        return torch.nn.functional.linear(h, self.decoder.weight, self.bias)


class RobertaClassificationHead(nn.Module):
    """``classifier``: dense + tanh over the first token, then ``out_proj``."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.dense(hidden[:, 0], activation="tanh"))


class EncoderForTask(nn.Module):
    """A BERT-family encoder with one head (``head`` in :data:`HEADS`), under transformers' names.

    ``forward`` returns the head's logits: ``(B, n, vocab)`` for the masked LM, ``(B, labels)`` for
    sequence classification, ``(B, n, labels)`` for token classification, ``(B, n, 2)`` (start, end)
    for question answering; the bare encoder returns its hidden states ``(B, n, hidden)``.
    """

    def __init__(self, cfg: EncoderConfig, head: str = "base", *, pooler: bool = False):
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"unknown head '{head}' (known: {', '.join(HEADS)})")
        self.config = cfg
        self.head = head
        arch = cfg.model_type
        bert_like = arch == "bert"
        # BERT's sequence classifier reads the pooler; the other heads never need it
        pooler = pooler or (head == "sequence_classification" and bert_like)
        self.base_name = cfg.prefix
        setattr(self, self.base_name, EncoderModel(cfg, pooler=pooler))
        tie = cfg.tie_word_embeddings
        if head == "masked_lm":
            if arch == "bert":
                self.cls = nn.Module()
                self.cls.predictions = BertPredictionHead(cfg)
                decoder = self.cls.predictions.decoder
            elif arch == "distilbert":
                self.vocab_transform = Linear(cfg.hidden_size, cfg.hidden_size)
                self.vocab_layer_norm = LayerNorm(cfg.hidden_size, eps=1e-12)
                self.vocab_projector = Linear(cfg.hidden_size, cfg.vocab_size)
                decoder = self.vocab_projector
            else:
                self.lm_head = RobertaLMHead(cfg)
                decoder = self.lm_head.decoder
            if tie:
                decoder.weight = self.base.embeddings.word_embeddings.weight
        elif head == "sequence_classification":
            if arch == "bert":
                self.classifier = Linear(cfg.hidden_size, cfg.num_labels)
            elif arch == "distilbert":
                self.pre_classifier = Linear(cfg.hidden_size, cfg.hidden_size)
                self.classifier = Linear(cfg.hidden_size, cfg.num_labels)
            else:
                self.classifier = RobertaClassificationHead(cfg)
        elif head == "token_classification":
            self.classifier = Linear(cfg.hidden_size, cfg.num_labels)
        elif head == "question_answering":
            self.qa_outputs = Linear(cfg.hidden_size, 2)

    @property
    def base(self) -> EncoderModel:
        return getattr(self, self.base_name)

    def hidden_states(
        self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, token_type_ids: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return self.base(input_ids, attention_mask, token_type_ids)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        # a sequence classifier reads the first token alone: the last layer computes only that one
        h = self.base(input_ids, attention_mask, token_type_ids, first_token_only=self.head == "sequence_classification")
        return self.head_output(h)

    def head_output(self, h: torch.Tensor) -> torch.Tensor:
        """The head applied to token states: ``(..., d)`` states of any positions for the per-token
        heads (the masked LM's logits of the masked positions alone, say), ``(B, n, d)`` (or the first
        token's ``(B, 1, d)``) for the sequence classifier."""
        arch = self.config.model_type
        if self.head == "base":
            return h
        if self.head == "masked_lm":
            if arch == "bert":
                return self.cls.predictions(h)
            if arch == "distilbert":
                return self.vocab_projector(self.vocab_layer_norm(self.vocab_transform(h, activation=self.config.hidden_act)))
            return self.lm_head(h)
        if self.head == "sequence_classification":
            if arch == "bert":
                return self.classifier(self.base.pooler(h))
            if arch == "distilbert":
                return self.classifier(self.pre_classifier(h[:, 0], activation="relu"))
            return self.classifier(h)
        if self.head == "token_classification":
            return self.classifier(h)
        return self.qa_outputs(h)

    def pooled(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """The pooler's output (BERT checkpoints that carry one), else None."""
        return self.base.pooler(hidden) if self.base.pooler is not None else None


# -- tensor names ----------------------------------------------------------------------------
_HEAD_PREFIXES = ("cls.", "lm_head.", "classifier.", "qa_outputs.", "vocab_transform.", "vocab_layer_norm.", "vocab_projector.", "pre_classifier.")


def keymap(cfg: EncoderConfig, head: str, *, keep_pooler: bool) -> KeyMap:
    """The checkpoint's names onto :class:`EncoderForTask`'s for ``head``.

    Bare-encoder checkpoints (saved from ``BertModel``, as sentence-transformers models are) lack the
    base prefix: it is added. Buffers (``position_ids``), next-sentence-prediction weights and the heads
    this task does not use are dropped; DistilBERT's layer names become BERT's."""
    p = cfg.prefix
    rules: list = [
        Drop(r"(^|\.)position_ids$"),
        Drop(r"(^|\.)token_type_ids$"),
        Drop(r"^cls\.seq_relationship\."),
        Rename(r"^(embeddings|encoder|pooler|transformer)\.", p + r".\1."),
        Rename(r"(LayerNorm|layer_norm)\.gamma$", r"\1.weight"),  # the original TensorFlow conversion's names
        Rename(r"(LayerNorm|layer_norm)\.beta$", r"\1.bias"),
    ]
    if cfg.model_type == "distilbert":
        layer = rf"^{p}\.transformer\.layer\.(\d+)\."
        enc = rf"{p}.encoder.layer.\1."
        for old, new in (
            ("attention.q_lin", "attention.self.query"),
            ("attention.k_lin", "attention.self.key"),
            ("attention.v_lin", "attention.self.value"),
            ("attention.out_lin", "attention.output.dense"),
            ("sa_layer_norm", "attention.output.LayerNorm"),
            ("ffn.lin1", "intermediate.dense"),
            ("ffn.lin2", "output.dense"),
            ("output_layer_norm", "output.LayerNorm"),
        ):
            rules.append(Rename(layer + old.replace(".", r"\.") + r"\.", enc + new + "."))
    if head == "base":
        rules.append(Drop("^(" + "|".join(x.replace(".", r"\.") for x in _HEAD_PREFIXES) + ")"))
    if not keep_pooler:
        rules.append(Drop(rf"^{p}\.pooler\."))
    # the decoder's own bias duplicates the head's bias (transformers ties them)
    rules += [Drop(r"^cls\.predictions\.decoder\.bias$"), Drop(r"^lm_head\.decoder\.bias$")]
    if cfg.tie_word_embeddings:
        rules += [Drop(r"^cls\.predictions\.decoder\.weight$"), Drop(r"^lm_head\.decoder\.weight$"), Drop(r"^vocab_projector\.weight$")]
    return KeyMap(rules, f"{cfg.model_type}-{head}")
