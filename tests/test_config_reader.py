"""The one config reader every model config goes through (gencli.checkpoints.config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import pytest

from gencli.checkpoints.config import ConfigError, JsonConfig, config_to_dict, read_config
from gencli.errors import CheckpointError


@dataclass
class Inner:
    width: int = 8


@dataclass
class Sample(JsonConfig):
    hidden_size: int = 4
    eps: float = 1e-5
    act: str = "gelu"
    bias: bool = True
    channels: tuple[int, ...] = (1, 2)
    head_dim: Optional[int] = None
    size: Optional[int | tuple[int, int]] = None
    labels: dict[int, str] = field(default_factory=dict)
    inner: Inner = field(default_factory=Inner)
    extra: Any = None


def test_fields_are_read_converted_and_defaulted():
    cfg = read_config(Sample, {"hidden_size": 16, "eps": 1, "channels": [3, 4, 5], "head_dim": 2, "inner": {"width": 3}, "unknown": 1})
    assert cfg.hidden_size == 16 and cfg.eps == 1.0 and isinstance(cfg.eps, float)
    assert cfg.channels == (3, 4, 5) and cfg.head_dim == 2 and cfg.inner == Inner(3)
    assert cfg.act == "gelu" and cfg.bias is True  # absent: the dataclass default
    assert read_config(Sample, {"head_dim": None}).head_dim is None  # null: the default
    assert read_config(Sample, {"size": [2, 3]}).size == (2, 3) and read_config(Sample, {"size": 7}).size == 7


def test_renames_required_and_computed_values():
    cfg = read_config(Sample, {"n_embd": 32, "hidden_size": 8}, renames={"hidden_size": ("n_embd", "hidden_size")}, act="relu")
    assert cfg.hidden_size == 32 and cfg.act == "relu"
    with pytest.raises(ConfigError, match=r"config\.json lacks 'vocab_size' needed by a test model"):
        read_config(Sample, {}, required=("vocab_size",), what="a test model")


@pytest.mark.parametrize(
    "data, message",
    [
        ({"hidden_size": "wide"}, r"'hidden_size' must be an integer, got 'wide'"),
        ({"hidden_size": 2.5}, r"'hidden_size' must be an integer"),
        ({"bias": "yes"}, r"'bias' must be true or false"),
        ({"channels": 3}, r"'channels' must be a list of integers"),
        ({"act": 3}, r"'act' must be a string"),
        ({"inner": {"width": "x"}}, r"model/config\.json \(inner\): 'width' must be an integer"),
    ],
)
def test_a_bad_value_is_one_error_naming_the_key_and_the_file(data, message):
    with pytest.raises(ConfigError, match=message) as err:
        read_config(Sample, data, where="model/config.json")
    assert isinstance(err.value, CheckpointError) and isinstance(err.value, ValueError)
    assert "\n" not in str(err.value)


def test_the_json_round_trip():
    cfg = Sample.from_dict({"channels": [5], "labels": {"0": "a"}})
    d = cfg.to_dict()
    assert d["channels"] == [5] and d["inner"] == {"width": 8}
    assert Sample.from_dict(d) == cfg
    assert "inner" not in config_to_dict(cfg, drop=("inner",))


def test_model_configs_report_bad_fields_through_it():
    from gencli.models.gpt2 import GPT2Config
    from gencli.models.llama import LlamaConfig

    with pytest.raises(ConfigError, match="lacks 'n_head' needed by a GPT-2 model"):
        GPT2Config.from_hf({"vocab_size": 10, "n_embd": 8, "n_layer": 1})
    with pytest.raises(ConfigError, match="'num_hidden_layers' must be an integer"):
        LlamaConfig.from_hf({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": "two", "num_attention_heads": 2})
    assert GPT2Config.from_hf({"vocab_size": 10, "n_embd": 8, "n_layer": 1, "n_head": 2, "n_ctx": 64}).n_positions == 64
