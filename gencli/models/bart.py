"""BART (transformers' ``BartForConditionalGeneration`` layout): bart-base, bart-large, bart-large-cnn
and their fine-tunes.

The same post-LN encoder-decoder as :mod:`gencli.models.marian`, with BART's two differences: a
learned position table (``embed_positions``, ``max_position_embeddings + 2`` rows, position p read at
row p + 2) in place of the fixed sinusoid, and a LayerNorm (``layernorm_embedding``) on the sum of
token embeddings and positions in each stack. Vocabularies are shared (``model.shared``), the LM
head is tied to them, ``final_logits_bias`` is added to the logits. Key names are transformers'
(``model.encoder.layers.N.self_attn.q_proj`` ...); the module is :class:`MarianMTModel` built with
those two options.
"""

from __future__ import annotations

from typing import Any

from gencli.checkpoints.config import read_config
from gencli.checkpoints.keymap import KeyMap
from gencli.errors import CheckpointError
from gencli.models.marian import MarianConfig, MarianMTModel

ARCHITECTURES = {"BartForConditionalGeneration": "bart"}
MODEL_TYPES = {"bart"}


def config_from_hf(cfg: dict[str, Any], *, has_final_logits_bias: bool = True) -> MarianConfig:
    """A BART ``config.json`` as the Marian-layout config with learned positions and the embedding LayerNorm."""
    if cfg.get("normalize_before") or cfg.get("add_final_layer_norm"):
        raise CheckpointError("config.json: pre-LN BART variants (normalize_before, add_final_layer_norm: mBART) are not supported")
    required = ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads")
    return read_config(
        MarianConfig, cfg, what="a BART model", required=required, has_final_logits_bias=has_final_logits_bias, learned_positions=True,
        layernorm_embedding=True, share_encoder_decoder_embeddings=True, decoder_vocab_size=None, normalize_before=False,
    )  # fmt: skip


class BartForConditionalGeneration(MarianMTModel):
    """BART: :class:`MarianMTModel` with learned positions and the embedding LayerNorm."""


HF_KEYMAP = KeyMap([], "transformers-bart")
