"""Checkpoint I/O: formats, sharding, dtype casting, key mapping, clear errors, pickle refusal."""

import json
import os

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from gencli.backend.positional import RotaryEmbedding
from gencli.checkpoints.describe import describe
from gencli.checkpoints.formats import detect_architecture, open_source
from gencli.checkpoints.header import read_header
from gencli.checkpoints.keymap import Apply, Drop, Fuse, KeyMap, Rename, Split, Transpose
from gencli.checkpoints.loader import build_on_meta, load_model, save_model
from gencli.checkpoints.reader import open_reader
from gencli.errors import CheckpointError, UserError


class Tiny(nn.Module):
    """Embedding + a block + a head tied to the embedding + a rotary table (non-persistent buffer)."""

    def __init__(self, vocab=11, dim=8, built_on=None):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.rope = RotaryEmbedding(4)
        self.register_buffer("counter", torch.zeros(1, dtype=torch.int64))
        self.built_on = self.proj.weight.device.type


def tiny_state(seed=0, vocab=11, dim=8):
    torch.manual_seed(seed)
    m = Tiny(vocab, dim)
    return {k: v.clone() for k, v in m.state_dict().items() if k != "head.weight"}


@pytest.fixture
def single(tmp_path):
    state = tiny_state()
    save_file(state, tmp_path / "model.safetensors")
    return tmp_path, state


def test_load_single_file_on_meta_then_real(single):
    folder, state = single
    model = load_model(Tiny, open_reader(folder / "model.safetensors"))
    assert model.built_on == "meta", "the module must be constructed without allocating weights"
    assert torch.equal(model.proj.weight, state["proj.weight"])
    assert model.head.weight is model.embed.weight, "tied weights stay tied"
    assert model.rope.inv_freq.device.type == "cpu" and torch.allclose(model.rope.inv_freq, torch.tensor([1.0, 0.01]))
    assert not model.training


def test_dtype_cast_and_keep_fp32(single):
    folder, state = single
    model = load_model(Tiny, open_reader(folder), dtype=torch.bfloat16, keep_fp32=[r"^norm\."])
    assert model.proj.weight.dtype == torch.bfloat16
    assert model.norm.weight.dtype == torch.float32
    assert model.counter.dtype == torch.int64, "integer buffers are never cast"
    assert torch.equal(model.proj.weight, state["proj.weight"].bfloat16())


def test_column_major_weights_when_converting(tmp_path, single):
    folder, state = single
    # converted tensors matching a pattern (or tied to one that does) are stored column-major
    model = load_model(Tiny, open_reader(folder), dtype=torch.float64, column_major=[r"^head\.weight$", r"^proj\.weight$"])
    for w, key in ((model.proj.weight, "proj.weight"), (model.embed.weight, "embed.weight")):
        assert w.stride() == (1, w.shape[0]) and torch.equal(w, state[key].double())
    assert model.head.weight is model.embed.weight
    assert model.norm.weight.is_contiguous()  # 1-D tensors keep their layout
    ids = torch.tensor([[3, 7]])
    assert torch.equal(model.embed(ids), state["embed.weight"].double()[ids])  # lookups gather strided rows
    # without a conversion the tensors stay zero-copy views of the file: no second, transposed copy
    same = load_model(Tiny, open_reader(folder), column_major=[r"^proj\.weight$"])
    assert same.proj.weight.is_contiguous()


def test_replaced_modules_are_built_one_at_a_time_from_private_reads(tmp_path):
    """``replace`` hands each module's tensors to its builder as soon as they are read: the other
    replaced modules are then still on meta (or replaced already), and a tied module loads as usual."""

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(11, 8)
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.head = nn.Linear(8, 11, bias=False)
            self.head.weight = self.embed.weight

    torch.manual_seed(0)
    state = {k: v for k, v in Stack().state_dict().items() if k != "head.weight"}
    save_file(state, tmp_path / "model.safetensors")

    class Halved(nn.Module):
        def __init__(self, weight, bias):
            super().__init__()
            self.weight, self.bias = nn.Parameter(weight / 2), nn.Parameter(bias)

    seen = []

    def build(module, tensors):
        others = [m for i, m in enumerate(model.layers) if m is not module]
        assert all(isinstance(m, Halved) or m.weight.is_meta for m in others), "one dense layer at a time"
        assert set(tensors) == {"weight", "bias"} and not tensors["weight"].is_meta
        seen.append(module)
        return Halved(tensors["weight"].double(), tensors["bias"])

    model = build_on_meta(Stack)
    replace = {f"layers.{i}": build for i in range(3)} | {"head": build}
    from gencli.checkpoints.loader import load_state

    with open_reader(tmp_path) as reader:
        load_state(model, reader, replace=replace)
    assert len(seen) == 3, "the tied head is not replaced"
    for i in range(3):
        layer = model.layers[i]
        assert isinstance(layer, Halved) and torch.equal(layer.weight, state[f"layers.{i}.weight"].double() / 2)
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, state["embed.weight"])


def test_sharded_checkpoint(tmp_path):
    state = tiny_state(1)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, tmp_path / fname)
        weight_map.update({k: fname for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    src = open_source(tmp_path)
    assert src.kind == "safetensors-sharded" and len(src.weight_files) == 2
    model = load_model(Tiny, open_reader(src))
    for k, v in state.items():
        assert torch.equal(model.state_dict()[k], v)
    info = describe(tmp_path)
    assert info["format"] == "safetensors (sharded)" and info["parameters"] == sum(v.numel() for v in state.values())
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="shard 'model-00002-of-00002.safetensors'.*missing"):
        open_source(tmp_path)


def test_missing_unexpected_and_shape_errors_name_the_tensor(tmp_path):
    state = tiny_state()
    missing = {k: v for k, v in state.items() if k != "proj.bias"}
    save_file(missing, tmp_path / "a.safetensors")
    with pytest.raises(CheckpointError, match="missing tensor 'proj.bias'"):
        load_model(Tiny, open_reader(tmp_path / "a.safetensors"))
    extra = {**state, "extra.weight": torch.zeros(2)}
    save_file(extra, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match="unexpected tensor 'extra.weight'"):
        load_model(Tiny, open_reader(tmp_path / "b.safetensors"))
    # a config whose shapes don't match the tensors: the model is built wider than the weights
    save_file(state, tmp_path / "c.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor '\w+\.weight' has shape \[\d+(, \d+)?\] in the checkpoint.*model expects"):
        load_model(lambda: Tiny(vocab=11, dim=16), open_reader(tmp_path / "c.safetensors"))


def test_optional_targets(tmp_path):
    state = {k: v for k, v in tiny_state().items() if k != "counter"}
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensor 'counter'"):
        load_model(Tiny, open_reader(tmp_path))

    def factory():
        m = Tiny()
        return m

    # an optional target must get a real value from somewhere: still on meta -> clear error
    with pytest.raises(CheckpointError, match="'counter' was not loaded"):
        load_model(factory, open_reader(tmp_path), optional=[r"^counter$"])


def test_keymap_rules(tmp_path):
    """A GPT-2-like source (fused qkv stored transposed, a mask buffer) mapped onto split projections."""
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)
    src = {
        "h.0.attn.c_attn.weight": torch.cat([q, k, v], 0).t().contiguous(),  # Conv1D layout (in, out)
        "h.0.attn.bias": torch.ones(1, 1, 4, 4),  # causal-mask buffer, unused
        "h.0.ln.w": torch.arange(4.0),
        "h.0.conv.weight": torch.randn(3, 4, 1, 1),
    }
    save_file(src, tmp_path / "model.safetensors")
    keymap = KeyMap(
        [
            Drop(r"\.attn\.bias$"),
            Rename(r"^h\.(\d+)\.", r"layers.\1."),
            Rename(r"\.ln\.w$", ".norm.weight"),
            Transpose(r"c_attn\.weight$"),
            Split(r"\.c_attn\.weight$", [".q_proj.weight", ".k_proj.weight", ".v_proj.weight"]),
            Apply(r"\.conv\.weight$", lambda t: t[:, :, 0, 0], "1x1 conv as linear"),
        ]
    )
    reader = open_reader(tmp_path)
    plan = keymap.plan(reader.keys())
    assert sorted(plan) == [
        "layers.0.attn.k_proj.weight",
        "layers.0.attn.q_proj.weight",
        "layers.0.attn.v_proj.weight",
        "layers.0.conv.weight",
        "layers.0.norm.weight",
    ]
    assert torch.equal(plan["layers.0.attn.q_proj.weight"](reader), q)
    assert torch.equal(plan["layers.0.attn.v_proj.weight"](reader), v)
    assert plan["layers.0.conv.weight"](reader).shape == (3, 4)
    assert "transposed" in plan["layers.0.attn.k_proj.weight"].describe()
    fused = KeyMap([Fuse(r"\.{part}_proj\.", ["q", "k", "v"], ".qkv.")]).plan(plan)
    # Fuse works on names; feed it the previous plan's names through a reader over the mapped tensors
    assert "layers.0.attn.qkv.weight" in fused and "layers.0.attn.q_proj.weight" not in fused

    class Mapped:
        def get(self, name):
            return plan[name](reader)

    assert torch.equal(fused["layers.0.attn.qkv.weight"](Mapped()), torch.cat([q, k, v], 0))
    with pytest.raises(ValueError, match="partner is missing"):
        KeyMap([Fuse(r"\.{part}_proj\.", ["q", "k", "v"], ".qkv.")]).plan(["a.q_proj.weight", "a.k_proj.weight"])
    sized = KeyMap([Split(r"w$", ["a", "b"], sizes=lambda cfg: [cfg["n"], 4 - cfg["n"]])]).plan(["w"], {"n": 1})
    assert plan and sorted(sized) == ["a", "b"]


def test_truncated_and_corrupt_files_give_clean_errors(tmp_path, single):
    folder, _ = single
    data = (folder / "model.safetensors").read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[: len(data) - 20])
    with pytest.raises(CheckpointError, match=r"is truncated: tensor '[\w.]+' ends at byte"):
        open_source(tmp_path / "trunc.safetensors")
    (tmp_path / "tiny.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        read_header(tmp_path / "tiny.safetensors")
    (tmp_path / "garbage.safetensors").write_bytes((20).to_bytes(8, "little") + b"{not json at all!!!}" + b"\0" * 10)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_header(tmp_path / "garbage.safetensors")
    (tmp_path / "huge.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="header length"):
        read_header(tmp_path / "huge.safetensors")


def test_pickle_refused_unless_opted_in(tmp_path):
    state = tiny_state()
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"refusing to load .*pickle.*--allow-pickle"):
        open_source(tmp_path)
    with pytest.raises(CheckpointError, match="refusing"):
        open_source(tmp_path / "pytorch_model.bin")
    src = open_source(tmp_path, allow_pickle=True)
    model = load_model(Tiny, open_reader(src, allow_pickle=True))
    assert torch.equal(model.proj.weight, state["proj.weight"])
    assert describe(tmp_path, allow_pickle=True)["parameters"] == sum(v.numel() for v in state.values())


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_pickle_with_code_is_refused_even_when_allowed(tmp_path):
    import pickle

    with open(tmp_path / "model.ckpt", "wb") as fh:
        pickle.dump({"state_dict": {"w": _Evil()}}, fh)
    with pytest.raises(CheckpointError, match="weights_only=True"):
        open_reader(tmp_path / "model.ckpt", allow_pickle=True)


def test_folder_layouts_and_errors(tmp_path, single):
    folder, _ = single
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(UserError, match="no weights in"):
        open_source(empty)
    with pytest.raises(UserError, match="does not exist"):
        open_source(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(UserError, match="not a checkpoint"):
        open_source(tmp_path / "notes.txt")
    bad = tmp_path / "badcfg"
    bad.mkdir()
    (bad / "config.json").write_text("{oops")
    save_file({"a": torch.zeros(1)}, bad / "model.safetensors")
    with pytest.raises(UserError, match="config.json' is not valid JSON"):
        open_source(bad)
    # diffusers component naming + pipeline folder
    pipe = tmp_path / "pipe"
    (pipe / "unet").mkdir(parents=True)
    (pipe / "scheduler").mkdir()
    (pipe / "model_index.json").write_text(
        json.dumps({"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"], "scheduler": ["diffusers", "DDIMScheduler"]})
    )
    save_file(
        {"conv_in.weight": torch.zeros(4, 4, 3, 3), "time_embedding.linear_1.weight": torch.zeros(8, 4), "down_blocks.0.x": torch.zeros(2)},
        pipe / "unet" / "diffusion_pytorch_model.safetensors",
    )
    (pipe / "scheduler" / "scheduler_config.json").write_text("{}")
    src = open_source(pipe)
    assert src.kind == "diffusers-pipeline"
    assert detect_architecture(src) == "diffusers pipeline (StableDiffusionPipeline)"
    info = describe(pipe)
    assert info["components"]["unet"]["architecture"] == "UNet2DConditionModel"
    assert info["components"]["scheduler"]["weights"] is False
    assert info["parameters"] == 4 * 4 * 9 + 32 + 2
    assert src.sub("unet").kind == "safetensors"


def test_architecture_detection_from_names_and_config(tmp_path):
    save_file({"transformer.h.0.attn.c_attn.weight": torch.zeros(2, 6)}, tmp_path / "gpt2.safetensors")
    assert detect_architecture(open_source(tmp_path / "gpt2.safetensors")) == "GPT2LMHeadModel"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(1), "cond_stage_model.transformer.x": torch.zeros(1)}, tmp_path / "sd.safetensors")
    assert detect_architecture(open_source(tmp_path / "sd.safetensors")).startswith("stable-diffusion-v1")
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.zeros(1)}, hf / "model.safetensors")
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    info = describe(hf)
    assert info["architecture"] == "LlamaForCausalLM" and info["config"] == {"hidden_size": 8}


def test_save_model_roundtrip_stores_tied_once(tmp_path):
    torch.manual_seed(3)
    m = Tiny()
    save_model(m, tmp_path / "model.safetensors", dtype=torch.float16, metadata={"architecture": "tiny"})
    header = read_header(tmp_path / "model.safetensors")
    assert "head.weight" not in header.tensors and header.tensors["embed.weight"].dtype == "F16"
    assert header.metadata["architecture"] == "tiny"
    loaded = load_model(Tiny, open_reader(tmp_path / "model.safetensors"), dtype=torch.float32)
    assert torch.allclose(loaded.proj.weight, m.proj.weight, atol=1e-3)
    assert build_on_meta(Tiny).proj.weight.is_meta


def test_private_reads_equal_mapped_reads(tmp_path):
    """TensorReader.get(private=True) reads the bytes with file reads: the same tensors as the mapped views."""
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(4, 2, 3).bfloat16(),
        "f16": torch.randn(7).half(),
        "i64": torch.arange(6).reshape(2, 3),
        "scalar": torch.tensor(2.5),
        "flag": torch.tensor([True, False, True]),
    }
    save_file(tensors, str(tmp_path / "t.safetensors"))
    with open_reader(tmp_path / "t.safetensors") as reader:
        for name, t in tensors.items():
            got = reader.get(name, private=True)
            assert got.dtype == t.dtype and torch.equal(got, t) and torch.equal(got, reader.get(name))
            assert reader.dtype(name) == t.dtype
    # a converting load reads privately and gives the same model as a mapped one
    model = load_model(lambda: torch.nn.Linear(5, 3), open_reader(_linear_file(tmp_path)), dtype=torch.bfloat16)
    assert model.weight.dtype == torch.bfloat16


def _linear_file(tmp_path):
    save_file({"weight": torch.randn(3, 5), "bias": torch.randn(3)}, str(tmp_path / "lin.safetensors"))
    return tmp_path / "lin.safetensors"


def test_diffusers_variant_files(tmp_path):
    folder = tmp_path / "unet"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(folder / "diffusion_pytorch_model.safetensors"))
    save_file({"w": torch.ones(2).half()}, str(folder / "diffusion_pytorch_model.fp16.safetensors"))
    assert open_source(folder).weight_files[0].name == "diffusion_pytorch_model.safetensors"
    assert open_source(folder, variant="fp16").weight_files[0].name == "diffusion_pytorch_model.fp16.safetensors"
    with pytest.raises(CheckpointError, match="no 'bf16' variant"):
        open_source(folder, variant="bf16")
    assert open_source(folder, variant="bf16", variant_fallback=True).weight_files[0].name == "diffusion_pytorch_model.safetensors"
