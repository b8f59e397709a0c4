"""Stable Diffusion text conditioning: the shipped CLIP vocabulary against transformers' CLIPTokenizer,
prompt encoding against diffusers' StableDiffusionPipeline / StableDiffusionXLPipeline.encode_prompt on
random tiny text encoders saved with save_pretrained, and single-file original-layout text encoders
against the models they were written from (and against diffusers' own conversion of those files)."""

from __future__ import annotations

import json
import random
import shutil
import types

import pytest
import torch
from _sd_original_layout import open_clip_to_original, openai_clip_to_original, other_components
from safetensors.torch import load_file, save_file

from gencli.backend.device import Placement
from gencli.checkpoints.formats import open_source
from gencli.errors import CheckpointError, UserError
from gencli.models.clip.model import SD_TEXT_ENCODER_CONFIGS
from gencli.pipelines.diffusion.prompt_encoding import PromptEmbeddings, load_prompt_encoder, original_text_encoders
from gencli.tokenizers.clip_bpe import EOS, OPENAI_VOCAB_SIZE, CLIPTokenizer, read_openai_bpe, shipped_vocabulary

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

CPU32 = Placement(torch.device("cpu"), torch.float32)
TOL = 1e-5

LONG = ", ".join(["a very detailed oil painting of a lighthouse at dusk"] * 9)
PROMPTS = [
    "a photo of an astronaut riding a horse on mars, 4k, trending on artstation!",
    "masterpiece, best quality, (ultra-detailed:1.2), 1girl, 城市夜景 😀 café",
    LONG,
]


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def openai_bpe():
    return read_openai_bpe()


def hf_tokenizer(openai_bpe, pad: str):
    vocab, merges = openai_bpe
    return transformers.CLIPTokenizer(vocab=dict(vocab), merges=list(merges), pad_token=pad, model_max_length=77)


def randomise(model, seed: int):
    """Random weights everywhere (norms and biases too), so no parameter sits at a trivial value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def text_config(hidden: int, layers: int, act: str, heads: int | None = None, **kw):
    return transformers.CLIPTextConfig(
        vocab_size=OPENAI_VOCAB_SIZE, hidden_size=hidden, intermediate_size=hidden * 4 - 3, num_hidden_layers=layers,
        num_attention_heads=heads or hidden // 64, max_position_embeddings=77, hidden_act=act,
        bos_token_id=0, eos_token_id=2, pad_token_id=1, **kw,
    )  # fmt: skip


def sd_pipeline(text_encoder, tokenizer):
    return diffusers.StableDiffusionPipeline(
        vae=None, text_encoder=text_encoder, tokenizer=tokenizer, unet=None, scheduler=None,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip


def sdxl_pipeline(te, te2, tok, tok2, force_zeros=True):
    return diffusers.StableDiffusionXLPipeline(
        vae=None, text_encoder=te, text_encoder_2=te2, tokenizer=tok, tokenizer_2=tok2, unet=None, scheduler=None,
        force_zeros_for_empty_prompt=force_zeros,
    )  # fmt: skip


def allow_reference_clip_skip(text_encoder) -> None:
    """diffusers' StableDiffusionPipeline applies clip skip's final norm through
    ``text_encoder.text_model.final_layer_norm`` (transformers 4's nesting); transformers 5's
    CLIPTextModel holds ``final_layer_norm`` directly. Give the reference the path it reads."""
    object.__setattr__(text_encoder, "text_model", types.SimpleNamespace(final_layer_norm=text_encoder.final_layer_norm))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=TOL, rtol=0)


def one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


# -- the shipped vocabulary ---------------------------------------------------------------------
# Ids of OpenAI's vocabulary as published for its CLIP tokenizer (e.g. "a photo of a cat").
ANCHORS = {
    "a photo of a cat": [49406, 320, 1125, 539, 320, 2368, 49407],
    "a photo of a dog": [49406, 320, 1125, 539, 320, 1929, 49407],
    "Hello, world!": [49406, 3306, 267, 1002, 256, 49407],
    "don't stop 42 times": [49406, 847, 713, 1691, 275, 273, 1661, 49407],
    "hello-world, 3.14 (test)": [49406, 3306, 268, 1002, 267, 274, 269, 272, 275, 263, 1628, 264, 49407],
}

VARIED = [
    *PROMPTS,
    "A Photo Of A CAT!!!",
    "wow!nice ! !! '!' ¡hola!",
    "Hello, WORLD!!! It's 2024-05-01: 3.14159 dollars, 1/2 cup, 100%",
    "  multiple   spaces\tand\nnewlines  \r\n\u3000ideographic space\u00a0nbsp",
    "naïve café résumé ΟΔΟΣ İstanbul Straße ẞ A\u0301",
    "日本語のテキスト、東京タワー 😀👍🏽 👩‍🚀 emoji",
    "don't won't they're I've we'll he'd she's IT'S",
    "(masterpiece:1.3), [lowres], {best quality}, <lora:foo:0.8>, score_9, 8k uhd, dslr",
    "portrait by greg rutkowski and alphonse mucha, artstation, octane render, #art @user $5",
    "<|endoftext|> literal specials <|startoftext|>",
    "1234567890 ½ Ⅻ ٣ 2x2 3d",
    "x" * 300,
    " ".join(["word"] * 100),
    "",
    "   ",
]


def test_shipped_vocabulary_is_openai_clips(openai_bpe):
    vocab, merges = openai_bpe
    assert shipped_vocabulary().is_file() and shipped_vocabulary().name == "bpe_simple_vocab_16e6.txt.gz"
    assert len(vocab) == OPENAI_VOCAB_SIZE == 49408 and len(merges) == 48894
    assert sorted(vocab.values()) == list(range(49408))
    assert (vocab["!"], vocab["!</w>"], vocab["<|startoftext|>"], vocab["<|endoftext|>"]) == (0, 256, 49406, 49407)
    assert (vocab["a</w>"], vocab["cat</w>"], vocab["photo</w>"]) == (320, 2368, 1125)
    assert vocab["".join(merges[0])] == 512  # the first merge right after the 2 x 256 byte symbols
    tok = CLIPTokenizer.from_openai_bpe()
    for text, ids in ANCHORS.items():
        assert tok.encode(text) == ids, text


def test_shipped_vocabulary_is_package_data():
    """pyproject.toml ships the vocabulary and its licence notice with the package."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parent.parent
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["gencli.tokenizers"]
    package = shipped_vocabulary().parent.parent
    shipped = {p.relative_to(package).as_posix() for pat in patterns for p in package.glob(pat)}
    assert shipped == {"data/bpe_simple_vocab_16e6.txt.gz", "data/LICENSE-bpe_simple_vocab_16e6.txt"}
    assert "MIT" in (package / "data" / "LICENSE-bpe_simple_vocab_16e6.txt").read_text() or "Permission is hereby granted" in (
        package / "data" / "LICENSE-bpe_simple_vocab_16e6.txt"
    ).read_text()


@pytest.mark.parametrize("pad", [EOS, "!"])
def test_shipped_vocabulary_ids_match_transformers(openai_bpe, pad):
    """Same ids as transformers' CLIPTokenizer on the same vocabulary: padded to 77 with the pad token
    (SD 1.x: <|endoftext|>; SD 2.x / SDXL's second tokenizer: "!", which is then a special token), the
    long prompts truncated with the end token kept."""
    ref = hf_tokenizer(openai_bpe, pad)
    tok = CLIPTokenizer.from_openai_bpe(pad_token=pad)
    assert tok.pad_token_id == ref.pad_token_id == (49407 if pad == EOS else 0)
    want = ref(VARIED, padding="max_length", max_length=77, truncation=True)
    got = tok(VARIED, padding="max_length", max_length=77)
    for text, a, b in zip(VARIED, got.input_ids, want["input_ids"]):
        assert a == b, text
    assert got.attention_mask == want["attention_mask"]
    assert tok(VARIED).input_ids == ref(VARIED, padding="longest", truncation=True, max_length=77)["input_ids"]
    # a sane fixture: real tokens, not unknowns, and many different ones
    content = {i for ids in got.input_ids for i in ids} - {49406, 49407, tok.pad_token_id}
    assert len(content) > 150


def test_shipped_vocabulary_ids_match_transformers_on_random_strings(openai_bpe):
    ref = hf_tokenizer(openai_bpe, "!")
    tok = CLIPTokenizer.from_openai_bpe(pad_token="!")
    rng = random.Random(15)
    alphabet = list("abcXYZ019 '\t\n.,!?-()[]:<|>_") + ["é", "Σ", "ß", "日", "😀", "\u0301", "\u00a0", "\u3000", "٣", "½", "İ", "ﬁ"]
    words = ["photo", "cat", "masterpiece", "!", "<|endoftext|>", "'s", "don't", "42"]
    texts = ["".join(rng.choice(alphabet + words) for _ in range(rng.randint(0, 60))) for _ in range(300)]
    want = ref(texts, truncation=True, max_length=77)["input_ids"]
    for text, ids in zip(texts, want):
        assert tok.encode(text) == ids, repr(text)


@pytest.mark.parametrize("pad", [EOS, "!"])
def test_tokenizer_folders_give_their_pad_token(tmp_path, openai_bpe, pad):
    """A diffusers tokenizer folder in either generation's files: transformers 5's tokenizer.json +
    tokenizer_config.json, or vocab.json + merges.txt + special_tokens_map.json."""
    ref = hf_tokenizer(openai_bpe, pad)
    ref.save_pretrained(str(tmp_path / "v5"))
    CLIPTokenizer.from_openai_bpe(pad_token=pad).save(tmp_path / "v4")
    assert (tmp_path / "v4" / "merges.txt").is_file()
    for folder in ("v5", "v4"):
        tok = CLIPTokenizer.from_folder(tmp_path / folder)
        assert (tok.pad_token, tok.model_max_length) == (pad, 77)
        assert tok(VARIED, padding="max_length").input_ids == ref(VARIED, padding="max_length", max_length=77, truncation=True)["input_ids"]


# -- diffusers folders ------------------------------------------------------------------------
def rewrite_tokenizer_as_v4(folder, pad: str) -> None:
    shutil.rmtree(folder)
    CLIPTokenizer.from_openai_bpe(pad_token=pad).save(folder)


@pytest.mark.parametrize("family", ["sd1", "sd2"])
def test_sd_encode_prompt_matches_diffusers(tmp_path, openai_bpe, family):
    act, pad = ("quick_gelu", EOS) if family == "sd1" else ("gelu", "!")
    te = randomise(transformers.CLIPTextModel(text_config(32, 4, act, heads=4)), 1)
    tok = hf_tokenizer(openai_bpe, pad)
    pipe = sd_pipeline(te, tok)
    pipe.save_pretrained(str(tmp_path))
    if family == "sd2":
        rewrite_tokenizer_as_v4(tmp_path / "tokenizer", pad)
    allow_reference_clip_skip(te)

    enc = load_prompt_encoder(tmp_path, CPU32)
    assert (enc.is_sdxl, enc.hidden_size, enc.pooled_size, enc.max_length) == (False, 32, None, 77)
    assert enc.text_encoder.tokenizer.pad_token == pad
    with torch.no_grad():
        for clip_skip in (None, 1, 2):
            for negative in (None, "blurry, lowres, bad anatomy"):
                want, want_neg = pipe.encode_prompt(PROMPTS, "cpu", 1, True, None if negative is None else [negative] * 3, clip_skip=clip_skip)
                cond, uncond = enc.encode_prompt(PROMPTS, negative, clip_skip=clip_skip)
                assert close(cond.hidden_states, want), (clip_skip, negative)
                assert close(uncond.hidden_states, want_neg), (clip_skip, negative)
                assert cond.pooled is None and uncond.pooled is None
        # clip skip changes the states (the test can tell layers apart), and one image per prompt repeats rows
        assert not close(enc.encode_prompts(PROMPTS, clip_skip=1).hidden_states, enc.encode_prompts(PROMPTS).hidden_states)
        want, want_neg = pipe.encode_prompt(PROMPTS, "cpu", 2, True, None)
        cond, uncond = enc.encode_prompt(PROMPTS)
        assert close(cond.repeat_interleave(2).hidden_states, want) and close(uncond.repeat_interleave(2).hidden_states, want_neg)
        cond, uncond = enc.encode_prompt(PROMPTS, do_classifier_free_guidance=False)
        assert uncond is None

    # the long prompt's notice names what diffusers' warning names
    assert len(cond.notices) == 1 and cond.notices[0].startswith("prompt 3 was truncated to the 77-token window")
    dropped = tok.batch_decode(tok(PROMPTS, padding="longest", return_tensors="pt").input_ids[:, 76:-1])[2]
    assert f'"{dropped}"' in cond.notices[0]
    single = enc.encode_prompts(LONG)
    assert single.notices[0].startswith("prompt was truncated") and enc.encode_prompts("short").notices == []
    _, neg = enc.encode_prompt("a cat", LONG)
    assert neg.notices[0].startswith("negative prompt was truncated")


def test_sdxl_encode_prompt_matches_diffusers(tmp_path, openai_bpe):
    te = randomise(transformers.CLIPTextModel(text_config(32, 3, "quick_gelu", heads=4)), 2)
    te2 = randomise(transformers.CLIPTextModelWithProjection(text_config(64, 3, "gelu", heads=4, projection_dim=48)), 3)
    tok, tok2 = hf_tokenizer(openai_bpe, EOS), hf_tokenizer(openai_bpe, "!")
    pipe = sdxl_pipeline(te, te2, tok, tok2)
    pipe.save_pretrained(str(tmp_path))

    enc = load_prompt_encoder(tmp_path, CPU32)
    assert (enc.is_sdxl, enc.hidden_size, enc.pooled_size, enc.force_zeros_for_empty_prompt) == (True, 96, 48, True)
    assert (enc.text_encoder.tokenizer.pad_token_id, enc.text_encoder_2.tokenizer.pad_token_id) == (49407, 0)
    second = ["an oil painting", "a watercolour", "pixel art"]
    with torch.no_grad():
        for clip_skip in (None, 1):
            for negative in (None, "ugly, deformed"):
                for prompts_2 in (None, second):
                    want = pipe.encode_prompt(
                        PROMPTS, prompt_2=prompts_2, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=True,
                        negative_prompt=None if negative is None else [negative] * 3, clip_skip=clip_skip,
                    )  # fmt: skip
                    cond, uncond = enc.encode_prompt(PROMPTS, negative, clip_skip=clip_skip, prompts_2=prompts_2)
                    case = (clip_skip, negative, prompts_2)
                    assert close(cond.hidden_states, want[0]) and close(cond.pooled, want[2]), case
                    assert close(uncond.hidden_states, want[1]) and close(uncond.pooled, want[3]), case
                    assert (negative is None) == bool(uncond.hidden_states.eq(0).all()), case
        want = pipe.encode_prompt(PROMPTS, device="cpu", num_images_per_prompt=2, negative_prompt=["x"] * 3)
        cond, uncond = enc.encode_prompt(PROMPTS, "x")
        cond, uncond = cond.repeat_interleave(2), uncond.repeat_interleave(2)
        assert all(close(a, b) for a, b in zip((cond.hidden_states, uncond.hidden_states, cond.pooled, uncond.pooled), want))

        # force_zeros_for_empty_prompt comes from model_index.json
        index = json.loads((tmp_path / "model_index.json").read_text())
        index["force_zeros_for_empty_prompt"] = False
        (tmp_path / "model_index.json").write_text(json.dumps(index))
        enc = load_prompt_encoder(tmp_path, CPU32)
        want = sdxl_pipeline(te, te2, tok, tok2, force_zeros=False).encode_prompt(PROMPTS, device="cpu")
        _, uncond = enc.encode_prompt(PROMPTS)
        assert close(uncond.hidden_states, want[1]) and close(uncond.pooled, want[3]) and not uncond.hidden_states.eq(0).all()
    assert enc.encode_prompts(PROMPTS).notices == [n for n in enc.encode_prompts(PROMPTS).notices if n.startswith("prompt 3 ")] != []


def test_variant_weights(tmp_path, openai_bpe):
    """``variant="fp16"`` reads model.fp16.safetensors (fp16 values, computed here in fp32)."""
    te = randomise(transformers.CLIPTextModel(text_config(32, 2, "quick_gelu", heads=4)), 4)
    sd_pipeline(te, hf_tokenizer(openai_bpe, EOS)).save_pretrained(str(tmp_path))
    state = load_file(str(tmp_path / "text_encoder" / "model.safetensors"))
    save_file({k: v.half() for k, v in state.items()}, str(tmp_path / "text_encoder" / "model.fp16.safetensors"))
    full = load_prompt_encoder(tmp_path, CPU32).text_encoder.tower
    half = load_prompt_encoder(tmp_path, CPU32, variant="fp16").text_encoder.tower
    w = state["embeddings.token_embedding.weight"]
    assert torch.equal(full.embeddings.token_embedding.weight, w)
    assert torch.equal(half.embeddings.token_embedding.weight, w.half().float()) and not torch.equal(w.half().float(), w)
    with pytest.raises(CheckpointError, match="no 'bf16' variant") as e:
        load_prompt_encoder(tmp_path, CPU32, variant="bf16")
    one_line(e)
    # the file itself, beside the full-precision one, still finds its config.json
    src = open_source(tmp_path / "text_encoder" / "model.fp16.safetensors")
    assert src.config["hidden_size"] == 32
    # sharded variants: model.safetensors.index.fp16.json and its shards
    shard = tmp_path / "sharded"
    shard.mkdir()
    names = sorted(state)
    parts = {"model.fp16-00001-of-00002.safetensors": names[: len(names) // 2], "model.fp16-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for fname, keys in parts.items():
        save_file({k: state[k].half() for k in keys}, str(shard / fname))
    index = {"metadata": {}, "weight_map": {k: fname for fname, keys in parts.items() for k in keys}}
    (shard / "model.safetensors.index.fp16.json").write_text(json.dumps(index))
    src = open_source(shard, variant="fp16")
    assert src.kind == "safetensors-sharded" and sorted(f.name for f in src.weight_files) == sorted(parts)


# -- single files -----------------------------------------------------------------------------
def write_single_file(path, *parts: dict) -> None:
    state = other_components()
    for p in parts:
        state.update(p)
    save_file(state, str(path))


def diffusers_conversion(cls, checkpoint: dict, config_folder, subfolder: str):
    """The text encoder diffusers' from_single_file builds from ``checkpoint`` (offline: configs local)."""
    from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm

    return create_diffusers_clip_model_from_ldm(cls, checkpoint, config=str(config_folder), subfolder=subfolder, local_files_only=True)


def same_state(a, b) -> bool:
    sa = {k: v for k, v in a.state_dict().items() if "position_ids" not in k}
    sb = {k: v for k, v in b.state_dict().items() if "position_ids" not in k}
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("family", ["sd1", "sd2"])
def test_single_file_sd_text_encoder(tmp_path, openai_bpe, family):
    """SD 1.x: OpenAI CLIP under cond_stage_model.transformer.; SD 2.x: OpenCLIP ViT-H's 24 residual blocks
    under cond_stage_model.model., of which the conditioning uses 23 (the reference has 23 layers)."""
    if family == "sd1":
        te = randomise(transformers.CLIPTextModel(text_config(128, 3, "quick_gelu")), 5)
        checkpoint = openai_clip_to_original(te.state_dict(), "cond_stage_model.transformer.")
        pad = EOS
    else:
        te = randomise(transformers.CLIPTextModel(text_config(64, 23, "gelu")), 6)
        checkpoint = open_clip_to_original(te.state_dict(), "cond_stage_model.model.", extra_layer_seed=7)
        assert "cond_stage_model.model.transformer.resblocks.23.attn.in_proj_weight" in checkpoint
        pad = "!"
    tok = hf_tokenizer(openai_bpe, pad)
    pipe = sd_pipeline(te, tok)
    pipe.save_pretrained(str(tmp_path / "reference"))
    allow_reference_clip_skip(te)
    # the file written by the inverse mapping is what diffusers' own conversion reads back into te
    assert same_state(diffusers_conversion(transformers.CLIPTextModel, checkpoint, tmp_path / "reference", "text_encoder"), te)

    write_single_file(tmp_path / "model.safetensors", checkpoint)
    enc = load_prompt_encoder(tmp_path / "model.safetensors", CPU32)
    cfg = enc.text_encoder.tower.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size) == (
        te.config.hidden_size, te.config.num_hidden_layers, te.config.hidden_size // 64, te.config.intermediate_size,
    )  # fmt: skip
    assert cfg.hidden_act == te.config.hidden_act and enc.text_encoder.tokenizer.pad_token == pad
    with torch.no_grad():
        for clip_skip in (None, 1):
            want, want_neg = pipe.encode_prompt(PROMPTS, "cpu", 1, True, ["bad"] * 3, clip_skip=clip_skip)
            cond, uncond = enc.encode_prompt(PROMPTS, "bad", clip_skip=clip_skip)
            assert close(cond.hidden_states, want) and close(uncond.hidden_states, want_neg), clip_skip


def test_single_file_sdxl_text_encoders(tmp_path, openai_bpe):
    te = randomise(transformers.CLIPTextModel(text_config(64, 3, "quick_gelu")), 8)
    te2 = randomise(transformers.CLIPTextModelWithProjection(text_config(128, 3, "gelu", projection_dim=96)), 9)
    checkpoint = {
        **openai_clip_to_original(te.state_dict(), "conditioner.embedders.0.transformer."),
        **open_clip_to_original(te2.state_dict(), "conditioner.embedders.1.model."),
    }
    tok, tok2 = hf_tokenizer(openai_bpe, EOS), hf_tokenizer(openai_bpe, "!")
    pipe = sdxl_pipeline(te, te2, tok, tok2)
    pipe.save_pretrained(str(tmp_path / "reference"))
    assert same_state(diffusers_conversion(transformers.CLIPTextModel, checkpoint, tmp_path / "reference", "text_encoder"), te)
    assert same_state(diffusers_conversion(transformers.CLIPTextModelWithProjection, checkpoint, tmp_path / "reference", "text_encoder_2"), te2)

    write_single_file(tmp_path / "sdxl.safetensors", checkpoint)
    enc = load_prompt_encoder(tmp_path / "sdxl.safetensors", CPU32)
    assert (enc.is_sdxl, enc.hidden_size, enc.pooled_size, enc.force_zeros_for_empty_prompt) == (True, 192, 96, True)
    assert enc.text_encoder_2.tower.config.num_attention_heads == 2
    with torch.no_grad():
        for clip_skip in (None, 1):
            for negative in (None, "ugly"):
                want = pipe.encode_prompt(PROMPTS, device="cpu", negative_prompt=None if negative is None else [negative] * 3, clip_skip=clip_skip)
                cond, uncond = enc.encode_prompt(PROMPTS, negative, clip_skip=clip_skip)
                got = (cond.hidden_states, uncond.hidden_states, cond.pooled, uncond.pooled)
                assert all(close(a, b) for a, b in zip(got, want)), (clip_skip, negative)


def test_single_file_sdxl_refiner_text_encoder(tmp_path, openai_bpe):
    """The refiner holds only the bigG tower, under conditioner.embedders.0.model."""
    te2 = randomise(transformers.CLIPTextModelWithProjection(text_config(128, 3, "gelu", projection_dim=64)), 10)
    write_single_file(tmp_path / "refiner.safetensors", open_clip_to_original(te2.state_dict(), "conditioner.embedders.0.model."))
    enc = load_prompt_encoder(tmp_path / "refiner.safetensors", CPU32)
    assert enc.text_encoder is None and (enc.hidden_size, enc.pooled_size, enc.force_zeros_for_empty_prompt) == (128, 64, False)
    ids = hf_tokenizer(openai_bpe, "!")(PROMPTS, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        want = te2(ids, output_hidden_states=True)
        got = enc.encode_prompts(PROMPTS)
    assert close(got.hidden_states, want.hidden_states[-2]) and close(got.pooled, want.text_embeds)


def test_standard_configs_match_shapes_of_real_checkpoints():
    """What a full-size file's shapes give is the shipped standard config (SD 1.5, 2.1, SDXL shapes)."""
    from gencli.models.clip.model import sd_text_encoder_config

    for name, (width, layers, heads, inner) in {
        "clip-vit-large-patch14": (768, 12, 12, 3072),
        "open-clip-vit-h-14-penultimate": (1024, 23, 16, 4096),
        "open-clip-vit-bigg-14": (1280, 32, 20, 5120),
    }.items():
        cfg = sd_text_encoder_config(name)
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size) == (width, layers, heads, inner)
        assert cfg.hidden_size // 64 == cfg.num_attention_heads and cfg.vocab_size == 49408 and cfg.max_position_embeddings == 77
        assert cfg.hidden_act == ("quick_gelu" if name.startswith("clip-") else "gelu")
    assert set(SD_TEXT_ENCODER_CONFIGS) == {"clip-vit-large-patch14", "open-clip-vit-h-14-penultimate", "open-clip-vit-bigg-14"}


def test_layout_detection_by_prefix():
    def keys(*prefixes):
        return {p + "x" for p in prefixes} | set(other_components())

    te, te2, zeros = original_text_encoders(keys("cond_stage_model.transformer.text_model."))
    assert (te.standard, te2, zeros) == ("clip-vit-large-patch14", None, False)
    te, te2, zeros = original_text_encoders(keys("cond_stage_model.model."))
    assert (te.standard, te.penultimate, te.pad_token) == ("open-clip-vit-h-14-penultimate", True, "!")
    te, te2, zeros = original_text_encoders(keys("conditioner.embedders.0.transformer.", "conditioner.embedders.1.model."))
    assert (te.pad_token, te2.pad_token, te2.with_projection, zeros) == (EOS, "!", True, True)
    assert original_text_encoders(set(other_components())) == (None, None, False)


# -- bad checkpoints: one line, exit code 2 -------------------------------------------------------
def test_mismatching_encoders_are_one_line_checkpoint_errors(tmp_path, openai_bpe):
    te = randomise(transformers.CLIPTextModel(text_config(64, 2, "quick_gelu")), 11)
    good = openai_clip_to_original(te.state_dict(), "cond_stage_model.transformer.")

    bad = dict(good)
    bad["cond_stage_model.transformer.text_model.embeddings.position_embedding.weight"] = torch.zeros(77, 128)
    write_single_file(tmp_path / "widths.safetensors", bad)
    with pytest.raises(CheckpointError, match="different widths") as e:
        load_prompt_encoder(tmp_path / "widths.safetensors", CPU32)
    one_line(e)

    small = randomise(transformers.CLIPTextModel(_small_vocab_config()), 12)
    write_single_file(tmp_path / "vocab.safetensors", openai_clip_to_original(small.state_dict(), "cond_stage_model.transformer."))
    with pytest.raises(CheckpointError, match="1000 token embeddings, the CLIP vocabulary 49408") as e:
        load_prompt_encoder(tmp_path / "vocab.safetensors", CPU32)
    one_line(e)

    bad = dict(good)
    bad["cond_stage_model.transformer.text_model.encoder.layers.1.mlp.fc2.weight"] = torch.zeros(64, 100)
    write_single_file(tmp_path / "layer.safetensors", bad)
    with pytest.raises(CheckpointError, match=r"encoder\.layers\.1\.mlp\.fc2\.weight") as e:
        load_prompt_encoder(tmp_path / "layer.safetensors", CPU32)
    one_line(e)

    te2 = randomise(transformers.CLIPTextModelWithProjection(text_config(128, 2, "gelu", projection_dim=64)), 13)
    packed = open_clip_to_original(te2.state_dict(), "conditioner.embedders.1.model.")
    packed["conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight"] = torch.zeros(3 * 128 - 3, 128)
    write_single_file(tmp_path / "xl.safetensors", good | openai_clip_to_original(te.state_dict(), "conditioner.embedders.0.transformer.") | packed)
    with pytest.raises(CheckpointError, match="in_proj_weight") as e:
        load_prompt_encoder(tmp_path / "xl.safetensors", CPU32)
    one_line(e)

    write_single_file(tmp_path / "half_xl.safetensors", openai_clip_to_original(te.state_dict(), "conditioner.embedders.0.transformer."))
    with pytest.raises(CheckpointError, match="without its second text encoder") as e:
        load_prompt_encoder(tmp_path / "half_xl.safetensors", CPU32)
    one_line(e)

    save_file({"transformer.h.0.attn.c_attn.weight": torch.zeros(4, 12), "transformer.wte.weight": torch.zeros(10, 4)}, str(tmp_path / "gpt2.safetensors"))
    with pytest.raises(CheckpointError, match="no Stable Diffusion text encoder .it looks like GPT2LMHeadModel") as e:
        load_prompt_encoder(tmp_path / "gpt2.safetensors", CPU32)
    one_line(e)


def _small_vocab_config():
    return transformers.CLIPTextConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1, max_position_embeddings=77
    )


def test_mismatching_folders_are_one_line_checkpoint_errors(tmp_path, openai_bpe):
    te = randomise(transformers.CLIPTextModel(text_config(32, 2, "quick_gelu", heads=4)), 14)
    sd_pipeline(te, hf_tokenizer(openai_bpe, EOS)).save_pretrained(str(tmp_path / "p"))
    folder = tmp_path / "p"

    cfg_file = folder / "text_encoder" / "config.json"
    original = cfg_file.read_text()
    cfg_file.write_text(json.dumps({**json.loads(original), "intermediate_size": 64}))
    with pytest.raises(CheckpointError, match="shape") as e:
        load_prompt_encoder(folder, CPU32)
    one_line(e)
    cfg_file.write_text(original)

    # a text encoder smaller than its tokenizer's vocabulary
    small = randomise(transformers.CLIPTextModel(_small_vocab_config()), 15)
    small.save_pretrained(str(tmp_path / "small"))
    shutil.rmtree(folder / "text_encoder")
    shutil.copytree(tmp_path / "small", folder / "text_encoder")
    with pytest.raises(CheckpointError, match="tokenizer has ids up to 49407, the text encoder only 1000") as e:
        load_prompt_encoder(folder, CPU32)
    one_line(e)

    shutil.rmtree(folder / "tokenizer")
    with pytest.raises(CheckpointError, match="no 'tokenizer' component folder") as e:
        load_prompt_encoder(folder, CPU32)
    one_line(e)


def test_bad_clip_skip_and_batch_sizes_are_user_errors(tmp_path, openai_bpe):
    te = randomise(transformers.CLIPTextModel(text_config(32, 3, "quick_gelu", heads=4)), 16)
    sd_pipeline(te, hf_tokenizer(openai_bpe, EOS)).save_pretrained(str(tmp_path))
    enc = load_prompt_encoder(tmp_path, CPU32)
    enc.encode_prompts("a cat", clip_skip=2)  # the first layer's output: still valid
    for bad in (3, -1):
        with pytest.raises(UserError, match="clip skip .* out of range"):
            enc.encode_prompts("a cat", clip_skip=bad)
    with pytest.raises(UserError, match="2 negative prompts for 3 prompts"):
        enc.encode_prompt(["a", "b", "c"], ["x", "y"])
    out = enc.encode_prompt(["a", "b"], "x")[1]
    assert isinstance(out, PromptEmbeddings) and len(out) == 2
