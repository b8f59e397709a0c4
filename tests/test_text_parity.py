"""Parity with transformers on random-initialised checkpoints loaded through gencli's own path.

Logits agree within 1e-4 (fp32) for whole prompts and for every incremental step through the KV
cache; greedy generation gives the same 32 token ids, also for a left-padded batch.
"""

from __future__ import annotations

import pytest
import torch
from _text_fixtures import gpt2_checkpoint, llama_checkpoint, qwen2_checkpoint

pytest.importorskip("transformers")

TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("text-parity")
    return {
        "gpt2": (root / "gpt2", gpt2_checkpoint(root / "gpt2")),
        "llama": (root / "llama", llama_checkpoint(root / "llama")),  # GQA, untied, llama3 rope scaling
        "qwen2": (root / "qwen2", qwen2_checkpoint(root / "qwen2")),  # q/k/v bias, tied
        "llama-sharded": (
            root / "llama-sharded",
            llama_checkpoint(root / "llama-sharded", seed=5, tie=True, kv_heads=1, rope={"rope_type": "linear", "factor": 2.0}, max_shard_size="40KB"),
        ),
    }


def _load(folder):
    from gencli.pipelines.text.loading import load_text_model

    return load_text_model(folder, device="cpu", dtype="float32")


def _random_ids(vocab: int, shape, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, shape, generator=g)


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "llama-sharded"])
def test_logits_full_prompt_and_every_cached_step(checkpoints, name):
    folder, ref = checkpoints[name]
    if name == "llama-sharded":
        assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("model-*.safetensors"))) > 1
    tm = _load(folder)
    ids = _random_ids(tm.model.vocab_size, (2, 40))
    with torch.inference_mode():
        expected = ref(ids).logits
        full = tm.model(ids)
        assert full.shape == expected.shape
        assert (full - expected).abs().max().item() < TOL

        cache = tm.model.new_cache(2, 40)
        prefix = tm.model(ids[:, :11], kv_cache=cache)
        assert (prefix - expected[:, :11]).abs().max().item() < TOL
        for t in range(11, 40):
            step = tm.model(ids[:, t : t + 1], kv_cache=cache)
            assert (step[:, 0] - expected[:, t]).abs().max().item() < TOL, f"step {t}"
        assert cache.length == 40


@pytest.mark.parametrize("screened", [None, "int8", "bf16"], ids=["fp32-head", "int8-screen", "bf16-screen"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2"])
def test_greedy_ids_match_transformers(checkpoints, name, screened, monkeypatch):
    from gencli.backend.screened_argmax import ScreenedArgmax
    from gencli.pipelines.text import generate as text_generate
    from gencli.pipelines.text.generate import GenerationSettings, generate
    from gencli.pipelines.text.sampling import SamplingParams

    folder, ref = checkpoints[name]
    tm = _load(folder)
    if screened:  # the exact screened argmax, forced on for these small heads
        if not ScreenedArgmax.supported(tm.model.lm_head.weight, screened):
            pytest.skip(f"no exact {screened} kernel on this CPU")
        monkeypatch.setattr(text_generate, "SCREEN_MIN_HEAD_BYTES", 0)
        monkeypatch.setattr(text_generate, "SCREEN_MIN_STEPS", 0)
        monkeypatch.setattr(text_generate, "SCREEN_KIND", screened)
    prompt = tm.tokenizer.encode("def add(a, b):\n    return")
    settings = GenerationSettings(max_new_tokens=32, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    ours = generate(tm, [("p", prompt)], settings)[0]
    with torch.inference_mode():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    theirs = out[0, len(prompt) :].tolist()
    assert len(ours.token_ids) == 32
    assert ours.token_ids == theirs
    assert ours.finish_reason == "length"
    assert (tm.screen.kind if tm.screen is not None else None) == screened


def test_a_screen_that_cannot_be_built_falls_back_once(checkpoints, monkeypatch):
    from gencli.backend import screened_argmax
    from gencli.pipelines.text import generate as text_generate
    from gencli.pipelines.text.generate import GenerationSettings, generate
    from gencli.pipelines.text.sampling import SamplingParams

    folder, ref = checkpoints["gpt2"]
    tm = _load(folder)
    calls = []

    def refuse(self, weight, **kwargs):
        calls.append(1)
        raise ValueError("no exact low-precision screen runs on this CPU")

    monkeypatch.setattr(screened_argmax.ScreenedArgmax, "supported", staticmethod(lambda weight, kind=None: True))
    monkeypatch.setattr(screened_argmax.ScreenedArgmax, "__init__", refuse)
    monkeypatch.setattr(text_generate, "SCREEN_MIN_HEAD_BYTES", 0)
    monkeypatch.setattr(text_generate, "SCREEN_MIN_STEPS", 0)
    prompt = tm.tokenizer.encode("def add(a, b):\n    return")
    settings = GenerationSettings(max_new_tokens=8, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    first = generate(tm, [("p", prompt)], settings)[0].token_ids
    second = generate(tm, [("p", prompt)], settings)[0].token_ids
    with torch.inference_mode():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert first == second == out[0, len(prompt) :].tolist()  # the fp32 head decided
    assert len(calls) == 1  # a failed build is not repeated on every call


def test_cpu_fp32_decoders_store_linear_weights_column_major_where_gencli_kernels_are_not_built(checkpoints, monkeypatch, tmp_path):
    """(Where they are, big fp32 models and bf16 files stream row-major weights instead:
    tests/test_text_bf16.py.)"""
    import shutil

    from safetensors.torch import load_file, save_file

    from gencli.backend import quant_kernels
    from gencli.pipelines.text import loading as text

    monkeypatch.setenv(quant_kernels.ENV_SWITCH, "0")

    # small models keep the checkpoint's layout (they run from the caches)
    assert _load(checkpoints["llama"][0]).model.lm_head.weight.is_contiguous()
    monkeypatch.setattr(text, "COLUMN_MAJOR_MIN_BYTES", 0)  # as if big
    for name, patterns in (("gpt2", ["lm_head.weight"]), ("llama", ["lm_head.weight", "q_proj.weight", "down_proj.weight"])):
        folder, ref = checkpoints[name]
        assert _load(folder).model.lm_head.weight.is_contiguous()  # an fp32 file stays zero-copy
        # a bf16 file (as on the hub) is converted anyway: into the memory of the transposed matrices
        half = tmp_path / name
        shutil.copytree(folder, half)
        save_file({k: v.bfloat16() for k, v in load_file(folder / "model.safetensors").items()}, half / "model.safetensors")
        model = _load(half).model
        reference = ref.state_dict()
        for key, weight in dict(model.named_parameters(remove_duplicate=False)).items():
            if any(key.endswith(p) for p in patterns):
                assert weight.stride() == (1, weight.shape[0]), key
                assert torch.equal(weight, reference[key].bfloat16().float()), key
        if name == "gpt2":  # the tied embedding is the same (column-major) tensor
            assert model.lm_head.weight is model.transformer.wte.weight
            assert model.transformer.h[0].attn.c_attn.weight.is_contiguous()  # Conv1D: (in, out) already


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_left_padded_batch_matches_transformers(checkpoints, name):
    from gencli.pipelines.text.generate import GenerationSettings, generate
    from gencli.pipelines.text.sampling import SamplingParams

    folder, ref = checkpoints[name]
    tm = _load(folder)
    short = tm.tokenizer.encode("import os")
    long = tm.tokenizer.encode("class Point:\n    def __init__(self, x, y):")
    settings = GenerationSettings(max_new_tokens=16, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    ours = generate(tm, [("a", short), ("b", long)], settings)
    width = len(long)
    batch = torch.full((2, width), tm.pad_id, dtype=torch.long)
    mask = torch.zeros((2, width), dtype=torch.long)
    for i, ids in enumerate((short, long)):
        batch[i, width - len(ids) :] = torch.tensor(ids)
        mask[i, width - len(ids) :] = 1
    with torch.inference_mode():
        out = ref.generate(batch, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=tm.pad_id)
    for i in range(2):
        assert ours[i].token_ids == out[i, width:].tolist(), f"row {i}"
    # and each row equals its own unbatched run
    alone = generate(tm, [("a", short)], settings)[0]
    assert alone.token_ids == ours[0].token_ids


def test_transformers4_style_rope_config_reads_the_same():
    from gencli.models.llama import LlamaConfig

    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}
    v4 = LlamaConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}})
    v5 = LlamaConfig.from_hf({**base, "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}})
    assert v4.rope_theta == v5.rope_theta == 5e5
    assert v4.rope_scaling == v5.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    plain = LlamaConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e4
    l3 = LlamaConfig.from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert l3.rope_scaling["original_max_position_embeddings"] == 64
    from gencli.errors import CheckpointError

    with pytest.raises(CheckpointError, match="yarn"):
        LlamaConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_gpt2_checkpoint_without_transformer_prefix_and_with_mask_buffers(checkpoints, tmp_path):
    """The original gpt2 upload was saved from GPT2Model: no 'transformer.' prefix, causal-mask buffers."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, ref = checkpoints["gpt2"]
    dst = tmp_path / "gpt2-bare"
    shutil.copytree(folder, dst)
    state = load_file(str(folder / "model.safetensors"))
    bare = {k.removeprefix("transformer."): v for k, v in state.items() if k != "lm_head.weight"}
    bare["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 96, 96))
    save_file(bare, str(dst / "model.safetensors"))
    tm = _load(dst)
    ids = _random_ids(tm.model.vocab_size, (1, 12))
    with torch.inference_mode():
        assert (tm.model(ids) - ref(ids).logits).abs().max().item() < TOL
    assert tm.model.lm_head.weight is tm.model.transformer.wte.weight


def test_bf16_logits_stay_close_to_fp32(checkpoints):
    from gencli.pipelines.text.loading import load_text_model

    folder, ref = checkpoints["llama"]
    tm = load_text_model(folder, device="cpu", dtype="bfloat16")
    assert tm.model.lm_head.weight.dtype == torch.bfloat16
    ids = _random_ids(tm.model.vocab_size, (1, 24))
    with torch.inference_mode():
        diff = (tm.model(ids).float() - ref(ids).logits).abs().max().item()
    assert diff < 0.05
