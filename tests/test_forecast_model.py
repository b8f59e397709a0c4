"""The TFT model: worked examples of the source texts (seed-examples.md sections 1-3), the store
example as a shape fixture, and the properties the architecture promises."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gencli.models.tft import (
    GatedResidualNetwork,
    InterpretableMultiHeadAttention,
    TemporalFusionTransformer,
    TFTConfig,
    VariableSelectionNetwork,
    monotone_quantiles,
    quantile_loss,
    weighted_sum,
)
from gencli.pipelines.forecast.metrics import pinball

T = torch.tensor


def seed_grn() -> GatedResidualNetwork:
    """The GRN of seed-examples.md section 1 (W1..W5, b1, b2, b4, b5, LayerNorm gamma 0.3 beta 0.7)."""
    g = GatedResidualNetwork(2, 2, 2, context_size=2, eps=1e-8)
    with torch.no_grad():
        g.fc1.weight.copy_(T([[0.6, 0.4], [-0.3, 0.8]]))
        g.fc1.bias.zero_()
        g.fc2.weight.copy_(T([[0.5, -0.5], [0.5, 0.5]]))
        g.fc2.bias.zero_()
        g.context.weight.copy_(T([[0.2, 0.1], [-0.1, 0.2]]))
        g.gate_norm.glu.gate.weight.copy_(T([[1.0, -0.5], [0.7, 0.4]]))
        g.gate_norm.glu.gate.bias.copy_(T([0.1, -0.1]))
        g.gate_norm.glu.value.weight.copy_(T([[0.5, 0.2], [0.1, 0.6]]))
        g.gate_norm.glu.value.bias.zero_()
        g.gate_norm.norm.weight.fill_(0.3)
        g.gate_norm.norm.bias.fill_(0.7)
    return g.eval()


def test_grn_worked_example_every_step():
    g = seed_grn()
    a, c = T([1.0, -1.0]), T([0.5, 0.5])
    with torch.no_grad():
        pre = g.fc2(a) + g.context(c)
        assert torch.allclose(pre, T([1.15, 0.05]), atol=2e-3)
        eta2 = torch.nn.functional.elu(pre)
        assert torch.allclose(eta2, T([1.15, 0.05]), atol=2e-3)
        eta1 = g.fc1(eta2)
        assert torch.allclose(eta1, T([0.71, -0.305]), atol=2e-3)
        glu = g.gate_norm.glu
        assert torch.allclose(glu.gate(eta1), T([0.9625, 0.275]), atol=2e-3)
        assert torch.allclose(glu.value(eta1), T([0.294, -0.112]), atol=2e-3)
        assert torch.allclose(torch.sigmoid(glu.gate(eta1)), T([0.723622, 0.568320]), atol=2e-3)
        assert torch.allclose(glu(eta1), T([0.212745, -0.063652]), atol=2e-3)
        assert torch.allclose(a + glu(eta1), T([1.212745, -1.063652]), atol=2e-3)  # pre-norm (two features always norm to beta +- gamma)
        out = g(a, c)
    assert torch.allclose(out, T([1.0, 0.4]), atol=2e-3)


def test_grn_context_broadcasts_over_time_and_skip_projects():
    g = GatedResidualNetwork(3, 4, 5, context_size=2).eval()
    x, c = torch.randn(2, 7, 3), torch.randn(2, 2)
    out = g(x, c)
    assert out.shape == (2, 7, 5)
    step = torch.stack([g(x[:, t], c) for t in range(7)], dim=1)
    assert torch.allclose(out, step, atol=1e-6)
    with pytest.raises(ValueError):
        GatedResidualNetwork(3, 4)(torch.randn(3), torch.randn(2))


def test_vsn_weighted_sum_worked_example():
    # seed-examples.md section 2: the text printed [0.255, 0.005]; the correct value is [0.255275, 0.598]
    xi = T([[0.142, 0.023], [0.339, 1.023]])
    v = T([0.425, 0.575])
    assert torch.allclose(weighted_sum(v, xi), T([0.255275, 0.598]), atol=1e-5)


def test_vsn_equals_independent_grns_and_softmax_weights():
    torch.manual_seed(0)
    vsn = VariableSelectionNetwork(3, 4, 6, context_size=6).eval()
    x, c = torch.randn(5, 3, 4), torch.randn(5, 6)
    out, w = vsn(x, c)
    assert w.shape == (5, 3) and torch.allclose(w.sum(-1), torch.ones(5), atol=1e-6)
    stacked = vsn.variable_grns
    ref = []
    for j in range(3):
        g = GatedResidualNetwork(4, 4, 6).eval()
        with torch.no_grad():
            pairs = [
                (g.fc2.weight, stacked.fc2_weight[j]), (g.fc2.bias, stacked.fc2_bias[j]),
                (g.fc1.weight, stacked.fc1_weight[j]), (g.fc1.bias, stacked.fc1_bias[j]),
                (g.gate_norm.glu.gate.weight, stacked.glu_weight[j, :6]), (g.gate_norm.glu.gate.bias, stacked.glu_bias[j, :6]),
                (g.gate_norm.glu.value.weight, stacked.glu_weight[j, 6:]), (g.gate_norm.glu.value.bias, stacked.glu_bias[j, 6:]),
                (g.skip.weight, stacked.skip_weight[j]), (g.skip.bias, stacked.skip_bias[j]),
                (g.gate_norm.norm.weight, stacked.norm_weight[j]), (g.gate_norm.norm.bias, stacked.norm_bias[j]),
            ]  # fmt: skip
            for param, value in pairs:
                param.copy_(value)
        ref.append(g(x[:, j]))
    expected = weighted_sum(w, torch.stack(ref, dim=1))
    assert torch.allclose(out, expected, atol=1e-5)
    # the batched path and the one-variable-at-a-time path agree
    assert torch.allclose(stacked(x.transpose(0, 1)).transpose(0, 1), torch.stack(ref, dim=1), atol=1e-5)
    assert torch.allclose(torch.softmax(vsn.flattened_grn(x.flatten(-2), c), -1), w, atol=1e-6)


@pytest.mark.parametrize("y,expected", [(230.0, [1.0, 5.0, 2.0]), (260.0, [4.0, 10.0, 9.0]), (210.0, [9.0, 15.0, 4.0])])
def test_quantile_loss_worked_example(y, expected):
    pred = np.array([220.0, 240.0, 250.0])
    assert np.allclose(pinball(np.array(y), pred, [0.1, 0.5, 0.9]), expected)
    loss = quantile_loss(torch.tensor([[220.0, 240.0, 250.0]]), torch.tensor([y]), [0.1, 0.5, 0.9])
    assert math.isclose(float(loss), sum(expected) / 3, rel_tol=1e-6)


def store_config(**kw) -> TFTConfig:
    return TFTConfig(
        hidden_size=16,
        variable_size=8,
        num_attention_heads=4,
        quantiles=[0.1, 0.5, 0.9],
        static_reals=["size", "floors"],
        static_categoricals={"area": 3},
        observed_reals=["sales", "supply_problem", "closure_probability"],
        known_reals=["people", "temperature"],
        **kw,
    )


def store_inputs():
    """The texts' store example: 7 past days, 3 future days."""
    sales = [220, 210, 250, 260, 220, 230, 210]
    supply = [0, 1, 0, 0, 0, 1, 0]
    closure = [0.2, 0.3, 0.8, 0.4, 0.3, 0.9, 0.1]
    people = [400, 410, 430, 390, 380, 400, 410, 420, 420, 370]
    temperature = [27, 26, 27, 26, 27, 29, 34, 35, 32, 28]
    mu = np.mean(sales)
    sd = np.std(sales)
    observed = torch.tensor([[(s - mu) / sd, p, c] for s, p, c in zip(sales, supply, closure)], dtype=torch.float32)[None]
    known = torch.tensor([[(p - 400) / 20, (t - 29) / 3] for p, t in zip(people, temperature)], dtype=torch.float32)[None]
    static_reals = torch.tensor([[math.log1p(340), math.log1p(3)]])
    static_cats = torch.tensor([[1]])  # "urban"
    return observed, known, static_reals, static_cats


def test_store_example_shapes_and_interpretation():
    torch.manual_seed(0)
    model = TemporalFusionTransformer(store_config()).eval()
    obs, known, sr, sc = store_inputs()
    q, det = model(obs, known, sr, sc, return_details=True)
    assert q.shape == (1, 3, 3)
    assert (q[..., 1:] >= q[..., :-1]).all()
    assert det["static_weights"].shape == (1, 3)
    assert det["encoder_weights"].shape == (1, 7, 5)  # people, temperature, sales, supply, closure
    assert det["decoder_weights"].shape == (1, 3, 2)
    assert det["attention"].shape == (1, 3, 10)
    for k in ("static_weights", "encoder_weights", "decoder_weights", "attention"):
        assert torch.allclose(det[k].sum(-1), torch.ones_like(det[k].sum(-1)), atol=1e-5)
    # causal: horizon step 1 (position 7) cannot see positions 8 and 9
    att = det["attention"][0].detach()
    assert float(att[0, 8:].abs().max()) == 0.0 and float(att[1, 9]) == 0.0 and float(att[2, 9]) > 0
    # the fast path (no weights) gives the same forecast
    assert torch.allclose(model(obs, known, sr, sc), q, atol=1e-5)


def test_future_inputs_do_not_leak_into_the_past():
    torch.manual_seed(1)
    model = TemporalFusionTransformer(store_config()).eval()
    obs, known, sr, sc = store_inputs()
    base = model(obs, known, sr, sc)
    later = known.clone()
    later[:, 9] += 5.0  # change the known input of the last horizon step only
    out = model(obs, later, sr, sc)
    assert torch.allclose(out[:, :2], base[:, :2], atol=1e-6)
    assert not torch.allclose(out[:, 2], base[:, 2])


def test_padded_histories_match_unpadded():
    torch.manual_seed(2)
    model = TemporalFusionTransformer(store_config()).eval()
    obs, known, sr, sc = store_inputs()
    short = model(obs[:, 3:], known[:, 3:], sr, sc)
    # the same 4-step history, left-aligned in a 7-step batch slot with garbage padding after it
    obs_pad = torch.cat([obs[:, 3:], torch.randn(1, 3, 3)], dim=1)
    known_pad = torch.cat([known[:, 3:7], torch.randn(1, 3, 2), known[:, 7:]], dim=1)
    both_obs = torch.cat([obs_pad, obs], dim=0)
    both_known = torch.cat([known_pad, known], dim=0)
    out = model(both_obs, both_known, sr.repeat(2, 1), sc.repeat(2, 1), encoder_lengths=torch.tensor([4, 7]))
    assert torch.allclose(out[0], short[0], atol=1e-5)
    assert torch.allclose(out[1], model(obs, known, sr, sc)[0], atol=1e-5)


def test_quantiles_never_cross():
    raw = torch.randn(64, 5, 7) * 5
    q = monotone_quantiles(raw, 3)
    assert (q[..., 1:] >= q[..., :-1]).all()
    assert torch.equal(q[..., 3], raw[..., 3])  # the median head is the median


def test_interpretable_attention_shares_values_and_averages_heads():
    torch.manual_seed(3)
    att = InterpretableMultiHeadAttention(8, 2).eval()
    x = torch.randn(1, 6, 8)
    out, w = att(x[:, 4:], x, x, return_weights=True)
    q = att.q_proj(x[:, 4:]).view(1, 2, 2, 4).transpose(1, 2)
    k = att.k_proj(x).view(1, 6, 2, 4).transpose(1, 2)
    v = att.v_proj(x)  # one shared value projection
    scores = q @ k.transpose(-1, -2) / 2.0
    mask = torch.tensor([[True] * 5 + [False], [True] * 6])
    heads = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    assert torch.allclose(w, heads.mean(1), atol=1e-6)
    assert torch.allclose(out, att.out_proj(heads.mean(1) @ v), atol=1e-5)


def test_attention_goes_through_the_backend_entry_point(monkeypatch):
    import gencli.models.tft as tft

    calls = []
    real = tft.scaled_dot_product_attention

    def spy(*a, **kw):
        calls.append(kw.get("return_weights", False))
        return real(*a, **kw)

    monkeypatch.setattr(tft, "scaled_dot_product_attention", spy)
    model = TemporalFusionTransformer(store_config()).eval()
    obs, known, sr, sc = store_inputs()
    model(obs, known, sr, sc)
    model(obs, known, sr, sc, return_details=True)
    assert calls == [False, True]


def test_config_round_trip_and_validation():
    cfg = store_config()
    again = TFTConfig.from_dict(cfg.to_dict())
    assert again == cfg and cfg.to_dict()["architecture"] == "TemporalFusionTransformer"
    with pytest.raises(ValueError, match="median"):
        TFTConfig(quantiles=[0.1, 0.9])
    with pytest.raises(ValueError, match="inside"):
        TFTConfig(quantiles=[0.5, 1.2])
    with pytest.raises(ValueError, match="known"):
        TFTConfig(known_reals=[])
    with pytest.raises(ValueError, match="unknown TFT fields"):
        TFTConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match="architecture"):
        TFTConfig.from_dict({**cfg.to_dict(), "architecture": "LlamaForCausalLM"})


def test_without_static_inputs_and_gradients_flow():
    cfg = TFTConfig(hidden_size=8, variable_size=4, num_attention_heads=2, observed_reals=["target"], known_reals=["relative_time"])
    model = TemporalFusionTransformer(cfg)
    q = model(torch.randn(2, 5, 1), torch.randn(2, 8, 1))
    assert q.shape == (2, 3, 3)
    quantile_loss(q, torch.randn(2, 3), cfg.quantiles).backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "flattened" not in n)


def test_variable_groups_are_one_linear_map_and_one_selected_variable():
    cfg = TFTConfig(
        hidden_size=8, variable_size=4, num_attention_heads=2,
        observed_reals=["target", "target_observed"], known_reals=["relative_time", "hour_sin", "hour_cos"],
        variable_groups={"target history": ["target", "target_observed"], "hour of day": ["hour_sin", "hour_cos"]},
    )
    assert cfg.input_names("known") == ["relative_time", "hour of day"] and cfg.input_names("observed") == ["target history"]
    model = TemporalFusionTransformer(cfg).eval()
    emb = model.known_embedding
    x = torch.randn(3, 3)
    out = emb(x, None)
    assert out.shape == (3, 2, 4)
    # the group is Linear(2, 4): x_sin * w_sin + x_cos * w_cos + b
    expected = x[:, 1:2] * emb.real_weight[1] + x[:, 2:3] * emb.real_weight[2] + emb.real_bias[1]
    assert torch.allclose(out[:, 1], expected, atol=1e-6)
    q, det = model(torch.randn(2, 6, 2), torch.randn(2, 9, 3), return_details=True)
    assert det["encoder_weights"].shape == (2, 6, 3) and det["decoder_weights"].shape == (2, 3, 2)
    with pytest.raises(ValueError, match="one role"):
        TFTConfig(observed_reals=["target"], known_reals=["t"], variable_groups={"g": ["target", "t"]})
