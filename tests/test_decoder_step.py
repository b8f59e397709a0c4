"""The fused decoding step (gencli.backend.decoder_step, csrc/decoder_step.cpp): every layer of a
quantized (int8, int4) or streamed (fp32, bf16 weights) GPT-2 / Llama / Qwen2-style model in one native
call gives the logits of the layer-by-layer path, for one sequence and for a left-padded batch, on every instruction set this CPU has; where it
does not apply (unquantized, prefill, switched off) the layer-by-layer path runs; its activations
against torch's."""

from __future__ import annotations

import pytest
import torch

from gencli.backend import decoder_step, quant_kernels
from gencli.backend.decoder_step import FusedDecoder
from gencli.backend.quantize import QuantizationSpec, quantize_linears
from gencli.backend.streamed_linear import stream_linears
from gencli.models.gpt2 import GPT2Config, GPT2LMHeadModel
from gencli.models.llama import LlamaConfig, LlamaForCausalLM

kernels = quant_kernels.cpu_kernels()
DENSE = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # streamed layers: dense weights, fp32 products
needs_kernels = pytest.mark.usefixtures("quant_kernels_built")  # a skip saying why, a failure on CI


def _model(family: str, mode: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4))
    else:
        cfg = LlamaConfig(
            vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, qkv_bias=family == "qwen2", model_type="qwen2" if family == "qwen2" else "llama",
        )
        model = LlamaForCausalLM(cfg)
    for name, p in model.named_parameters():  # weights of a trained model's scale (and non-trivial norms and biases)
        norm_weight = p.dim() == 1 and ("norm" in name or "ln_" in name) and "bias" not in name
        with torch.no_grad():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 0.1) + (1.0 if norm_weight else 0.0))
    if mode in DENSE:
        stream_linears(model, DENSE[mode])
    else:
        quantize_linears(model, QuantizationSpec.for_mode(mode))
    return model.eval()


def _logits(model, ids, steps, fused, mask=None):
    """Prefill ids[:, :-steps] in one call, then the last `steps` tokens one at a time (teacher forced):
    the logits of every step, (B, steps + 1, V)."""
    if not fused:
        model.fused_decoder = lambda x, cache: None  # (an instance attribute: this model decodes layer by layer)
    try:
        b, n = ids.shape
        cache = model.new_cache(b, n)
        first = n - steps
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0) if mask is not None else torch.arange(n).expand(b, n)
        with torch.inference_mode():
            out = [model(ids[:, :first], kv_cache=cache, position_ids=pos[:, :first], attention_mask=mask, logits_to_keep=1)]
            for i in range(first, n):
                out.append(model(ids[:, i : i + 1], kv_cache=cache, position_ids=pos[:, i : i + 1], attention_mask=mask))
        return torch.cat(out, 1)
    finally:
        model.__dict__.pop("fused_decoder", None)


# (dense weights always multiply fp32 activations: the int8 setting is for quantized codes)
MODES = [(m, a) for m in ("int8", "int4", "float32", "bfloat16") for a in ("fp32", "int8") if a == "fp32" or m not in DENSE]


@needs_kernels
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize(("mode", "activations"), MODES)
def test_the_fused_step_gives_the_logits_of_the_layer_by_layer_path(isa, family, mode, activations, monkeypatch):
    monkeypatch.setenv(quant_kernels.ENV_ACTIVATIONS, activations)
    model = _model(family, mode)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    calls = []
    real = FusedDecoder.__call__
    monkeypatch.setattr(FusedDecoder, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    ref = _logits(model, ids, 8, fused=False)
    assert not calls
    got = _logits(model, ids, 8, fused=True)
    assert len(calls) == 8  # every decoding step, not the prefill
    assert model.__dict__["_fused_decoder"].normalizes  # the final norm in the same native call
    assert model.__dict__["_fused_decoder"].takes_positions == (family != "gpt2")  # RoPE's rows computed natively
    rel = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    if activations == "fp32":  # the same products; only the norms' and activations' rounding differs
        assert rel < 1e-5, rel
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    else:
        # int8 activations: a code rounds the other way when its input moved by an ulp, and these random
        # int4 models amplify that (the layer-by-layer path itself moves 2-4% when the embeddings are
        # scaled by 1 + 1e-7); a wrong layout or scale would be off by far more
        assert rel < 0.1, rel


@needs_kernels
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["int8", "bfloat16"])
def test_a_left_padded_batch_decodes_each_sequence_as_the_layer_by_layer_path_does(family, mode, monkeypatch):
    monkeypatch.setenv(quant_kernels.ENV_ACTIVATIONS, "fp32")
    model = _model(family, mode)
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    mask[2, :1] = False
    ref = _logits(model, ids, 5, fused=False, mask=mask)
    got = _logits(model, ids, 5, fused=True, mask=mask)
    assert isinstance(model.__dict__.get("_fused_decoder"), FusedDecoder)
    rel = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 1e-5, rel


@pytest.fixture
def tuning():
    saved, threads = kernels.tuning(), torch.get_num_threads()
    yield kernels
    kernels.set_tuning(saved)
    torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize(("mode", "activations"), [("int8", "int8"), ("int4", "int8"), ("int4", "fp32"), ("float32", "fp32"), ("bfloat16", "fp32")])
def test_a_team_of_threads_decodes_exactly_as_one_thread_does(family, mode, activations, tuning, monkeypatch):
    """The step in one parallel region (a team: own task ranges and stealing, each thread's own
    key/value heads, the activation shared out, the biases added by the task that computed the rows),
    at 2 and 3 threads (heads and tasks not dividing evenly), equals the step on one thread and the
    step with a parallel region for each product, bit for bit: each value is computed by the same code
    whichever thread computes it."""
    monkeypatch.setenv(quant_kernels.ENV_ACTIVATIONS, activations)
    model = _model(family, mode)
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[1, :4] = False
    torch.set_num_threads(1)
    ref = _logits(model, ids, 6, fused=True, mask=mask)
    assert isinstance(model.__dict__.get("_fused_decoder"), FusedDecoder)
    one = ids[:1]  # one sequence: at 3 threads fewer key/value heads (2 for Llama) than threads
    ref_one = _logits(model, one, 6, fused=True)
    for threads in (2, 3):
        torch.set_num_threads(threads)
        for team in (1, 0):
            tuning.set_tuning({"step_team": team})
            got = _logits(model, ids, 6, fused=True, mask=mask)
            assert torch.equal(got, ref), (threads, team, (got - ref).abs().max().item())
            assert torch.equal(_logits(model, one, 6, fused=True), ref_one), (threads, team)


@needs_kernels
def test_rotary_tables_given_by_the_model_or_computed_by_the_step_agree(monkeypatch):
    import dataclasses

    monkeypatch.setenv(quant_kernels.ENV_ACTIVATIONS, "fp32")
    model = _model("llama", "int4")
    model.model.rotary_emb.__init__(16, base=500.0, scaling={"rope_type": "linear", "factor": 3.0})  # other frequencies than the default
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4))
    ref = _logits(model, ids, 6, fused=False)
    got = _logits(model, ids, 6, fused=True)
    assert model.__dict__["_fused_decoder"].takes_positions
    parts = model.fused_decoder_parts()
    model.forget_fused_decoder()
    monkeypatch.setattr(model, "fused_decoder_parts", lambda: dataclasses.replace(parts, rotary_emb=None))
    tables = _logits(model, ids, 6, fused=True)  # cos and sin from the model's RotaryEmbedding
    assert not model.__dict__["_fused_decoder"].takes_positions
    for out in (got, tables):
        assert ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item() < 1e-5


@needs_kernels
def test_a_final_norm_the_step_cannot_take_is_applied_after_it(monkeypatch):
    from gencli.backend.layers import RMSNorm

    monkeypatch.setenv(quant_kernels.ENV_ACTIVATIONS, "fp32")
    model = _model("llama", "int8")
    gemma_norm = RMSNorm(64, offset=1.0)  # (the Gemma variant: not one the native step has)
    with torch.no_grad():
        gemma_norm.weight.copy_(torch.randn(64) * 0.1)
    model.model.norm = gemma_norm
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(3))
    ref = _logits(model, ids, 4, fused=False)
    got = _logits(model, ids, 4, fused=True)
    assert not model.__dict__["_fused_decoder"].normalizes
    assert ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item() < 1e-5


@needs_kernels
def test_the_layer_by_layer_path_runs_where_the_fused_step_does_not_apply(monkeypatch):
    dense = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4)).eval()
    x = torch.zeros(1, 1, 64)
    assert dense.fused_decoder(x, dense.new_cache(1, 8)) is None  # torch's layers: nothing is built
    mixed = _model("gpt2", "bfloat16")
    mixed.transformer.h[0].mlp.c_fc = stream_and_keep(mixed.transformer.h[0].mlp.c_fc)
    assert mixed.fused_decoder(x, mixed.new_cache(1, 8)) is None  # weights of two dtypes: layer by layer
    quant = _model("gpt2", "int8")
    cache = quant.new_cache(1, 8)
    assert isinstance(quant.fused_decoder(x, cache), FusedDecoder)
    assert quant.fused_decoder(torch.zeros(1, 2, 64), cache) is None  # a prefill of two positions
    assert quant.fused_decoder(x, None) is None
    assert quant.fused_decoder(x.double(), cache) is None
    quant.float()  # moved / converted: the step is rebuilt from the layers then
    assert "_fused_decoder" not in quant.__dict__
    monkeypatch.setenv(decoder_step.ENV_SWITCH, "0")
    assert quant.fused_decoder(x, cache) is None


def stream_and_keep(layer):
    """An fp32 StreamedLinear of a bf16 one's values."""
    from gencli.backend.streamed_linear import StreamedLinear

    return StreamedLinear(layer.weight.float(), layer.bias)


@needs_kernels
def test_overflowing_the_cache_is_an_error_not_a_write_past_it():
    model = _model("gpt2", "int8")
    cache = model.new_cache(1, 2)
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]), kv_cache=cache)
        with pytest.raises(RuntimeError, match="overflow"):
            model(torch.tensor([[3]]), kv_cache=cache)


@needs_kernels
@pytest.mark.parametrize("name", ["gelu_tanh", "silu", "relu"])
def test_the_vector_activations_match_torch(isa, name):
    x = torch.cat([torch.linspace(-100, 100, 2001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-6, 88.5, -88.5, 200.0, -200.0])])
    up = torch.randn(x.numel(), generator=torch.Generator().manual_seed(3))
    F = torch.nn.functional
    ref = {"gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu, "relu": torch.relu}[name]
    for multiplier in (None, up):
        got = kernels.activation(name, x, multiplier)
        want = ref(x.double()) * (1 if multiplier is None else multiplier.double())
        assert torch.isfinite(got).all()
        assert torch.allclose(got.double(), want, rtol=2e-6, atol=1e-6), (got.double() - want).abs().max()


def _token_steps(model, ids, steps, mask=None, greedy=True):
    """As _logits, with each decoding step from the token ids to the logits in one native call
    (CausalLM.fused_logits): (the logits (B, steps, V), the greedy choices (B, steps))."""
    b, n = ids.shape
    cache = model.new_cache(b, n)
    first = n - steps
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0) if mask is not None else None
    logits, chosen = [], []
    with torch.inference_mode():
        model(ids[:, :first], kv_cache=cache, position_ids=pos[:, :first] if pos is not None else None, attention_mask=mask, logits_to_keep=1)
        for i in range(first, n):
            done = model.fused_logits(ids[:, i : i + 1], position_ids=pos[:, i : i + 1] if pos is not None else None, attention_mask=mask,
                                      kv_cache=cache, greedy=greedy)
            assert done is not None
            logits.append(done[0])
            chosen.append(done[1])
    return torch.stack(logits, 1), (torch.stack(chosen, 1) if greedy else None)


@needs_kernels
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize(("mode", "activations"), [("int8", "int8"), ("int4", "int8"), ("int4", "fp32"), ("float32", "fp32"), ("bfloat16", "fp32")])
def test_a_token_step_gives_the_fused_steps_logits_and_the_heads_bit_for_bit(family, mode, activations, tuning, monkeypatch):
    """Token ids -> embeddings, every layer, the final norm and the LM head in one call (one parallel
    region at 2 and 3 threads, a region a product, one thread): the logits of the fused step followed
    by the head from Python, bit for bit (the same code computes each value), for one sequence from the
    cache's length and for a left-padded batch at explicit positions; the greedy choices are
    torch.argmax's of those logits."""
    monkeypatch.setenv(quant_kernels.ENV_ACTIVATIONS, activations)
    model = _model(family, mode)
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[1, :4] = False
    mask[2, :1] = False
    ref = _logits(model, ids, 6, fused=True, mask=mask)[:, 1:]
    ref_one = _logits(model, ids[:1], 6, fused=True)[:, 1:]
    assert model.__dict__["_fused_decoder"].takes_ids
    assert len(set(ref.argmax(-1).flatten().tolist())) > 3  # logits that vary: a sane fixture
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        for team in (1, 0):
            tuning.set_tuning({"step_team": team})
            got, chosen = _token_steps(model, ids, 6, mask=mask)
            assert torch.equal(got, ref), (threads, team, (got - ref).abs().max().item())
            assert torch.equal(chosen, got.argmax(-1))
            got_one, chosen_one = _token_steps(model, ids[:1], 6)
            assert torch.equal(got_one, ref_one), (threads, team)
            assert torch.equal(chosen_one, got_one.argmax(-1))
    got, none = _token_steps(model, ids, 6, mask=mask, greedy=False)
    assert none is None and torch.equal(got, ref)


@needs_kernels
@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_the_token_steps_greedy_choice_is_torch_argmax_with_ties_infinities_and_nans(isa, parts):
    """Each thread's first largest of its slice of the row, then the first largest of those (16 at a
    time by AVX-512, plainly on AVX2): torch.argmax's choice, the first of equal logits, a NaN before any
    number, index 0 for a row of -inf, for rows not a multiple of 16 long."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 16, 17, 33, 100, 1000):
        for trial in range(20):
            x = torch.randint(-3, 4, (4, n), generator=g).float()  # many ties
            r = torch.rand(4, n, generator=g)
            x[r < 0.02] = float("nan")
            x[(r > 0.05) & (r < 0.1)] = float("inf")
            x[(r > 0.1) & (r < 0.2)] = -float("inf")
            if trial % 4 == 0:
                x[0] = -float("inf")
            if trial % 4 == 1:
                x[1] = x[1].abs() * 0.0 * torch.where(r[1] < 0.5, -1.0, 1.0)  # 0.0 and -0.0 tie
            assert torch.equal(kernels.greedy_choices(x, parts), x.argmax(-1)), (n, parts, x)


@needs_kernels
def test_a_token_step_refuses_ids_and_positions_outside_the_tables(monkeypatch):
    model = _model("gpt2", "int8")
    cache = model.new_cache(1, 40)
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]), kv_cache=cache)
        with pytest.raises(RuntimeError, match="token id 96 outside the vocabulary of 96"):
            model.fused_logits(torch.tensor([[96]]), kv_cache=cache)
        with pytest.raises(RuntimeError, match="position 32 outside the table of 32"):
            model.fused_logits(torch.tensor([[3]]), position_ids=torch.tensor([[32]]), kv_cache=cache)
        assert cache.length == 2  # nothing written
        assert model.fused_logits(torch.tensor([[3]]), kv_cache=cache) is not None
        assert cache.length == 3


@needs_kernels
def test_a_head_or_embedding_the_token_step_cannot_take_leaves_the_ids_to_python():
    """A plain torch head (or one on another kind of weights than the kernels read), or an embedding
    of another class: no token step (generate then runs the fused layers and the head from Python)."""
    model = _model("llama", "int8")
    model.lm_head = torch.nn.Linear(64, 96, bias=False)
    cache = model.new_cache(1, 8)
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]), kv_cache=cache)
        assert model.fused_logits(torch.tensor([[3]]), kv_cache=cache) is None
    assert not model.__dict__["_fused_decoder"].takes_ids
    assert model.__dict__["_fused_decoder"].normalizes  # the layers still fused
    gpt2 = _model("gpt2", "int4")
    assert gpt2.fused_logits(torch.tensor([[3]]), kv_cache=None) is None
    assert gpt2.fused_logits(torch.tensor([[3, 4]]), kv_cache=gpt2.new_cache(1, 8)) is None  # two positions: a prefill
