"""What Stable Diffusion users add to a checkpoint: LoRA files (kohya/A1111 and diffusers/PEFT formats)
against diffusers' ``load_lora_weights`` + ``fuse_lora``, on tiny random SD 1.x-, 2.x- and SDXL-shaped
pipelines; the LoRA options, tags, hashes and bad inputs; A1111's prompt weighting and long prompts;
the LCM sampler and trailing timestep spacing; textual-inversion embeddings against diffusers'
``load_textual_inversion``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _diffusion_fixtures import build_reference, save_reference
from _lora_fixtures import random_lora, save_lora

from gencli.errors import CheckpointError, UserError
from gencli.pipelines.diffusion.lora import LoraSpec, lora_hash, parse_lora_option, run_loras, strip_lora_tags
from gencli.pipelines.diffusion.pipeline import generate, load_pipeline, resolve_settings

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["a small red star at the top left on a blue background", "a green circle"]
SEEDS = [3, 11]
SIZE = 16
STEPS = 4
MAX_PIXEL_DIFF = 2  # of 255

_FOLDERS: dict = {}


def _folder(family: str, tmp_path_factory):
    if family not in _FOLDERS:
        _FOLDERS[family] = save_reference(build_reference(family), tmp_path_factory.mktemp(family))
    return _FOLDERS[family]


def _reference(family: str, folder):
    cls = diffusers.StableDiffusionXLPipeline if family == "sdxl" else diffusers.StableDiffusionPipeline
    ref = cls.from_pretrained(str(folder))
    ref.set_progress_bar_config(disable=True)
    ref.scheduler = diffusers.EulerDiscreteScheduler.from_config(ref.scheduler.config)
    return ref


def _reference_images(ref) -> np.ndarray:
    out = ref(prompt=PROMPTS, negative_prompt=["", ""], num_inference_steps=STEPS, height=SIZE, width=SIZE, guidance_scale=6.0,
              generator=[torch.Generator().manual_seed(s) for s in SEEDS], output_type="np").images  # fmt: skip
    return (out * 255).round().astype(np.uint8)


def _ours(pipe, prompts=PROMPTS) -> np.ndarray:
    settings = resolve_settings(pipe, steps=STEPS, guidance=6.0, sampler="euler", width=SIZE, height=SIZE)
    return np.stack([g.pixels for g in generate(pipe, prompts, SEEDS, settings, negative_prompts=["", ""])])


def _diff(a, b) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def _original_names(ref) -> dict:
    from gencli.models.unet.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel
    from gencli.pipelines.diffusion.lora import _weight_modules, original_unet_names

    unet = UNet2DConditionModel(UNet2DConditionConfig.from_dict(dict(ref.unet.config)))
    return {v: k for k, v in original_unet_names(unet, _weight_modules(unet)).items()}


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_lora_matches_diffusers_fuse_lora(family, tmp_path_factory, tmp_path):
    """Random LoRAs on attention, feed-forward, 3x3 convs (LoCon) and the text encoder(s): kohya's
    format (SD 1.x/2.x: diffusers paths; SDXL: original-layout paths, lora_te1/te2) and PEFT's, two at
    once with their own weights, against diffusers' load_lora_weights + fuse_lora(lora_scale=w)."""
    folder = _folder(family, tmp_path_factory)
    ref = _reference(family, folder)
    base = _reference_images(ref)
    kohya = save_lora(random_lora(ref, "kohya", seed=1, original_names=_original_names(ref) if family == "sdxl" else None), tmp_path / "k.safetensors")
    peft = save_lora(random_lora(ref, "peft", seed=2, rank=2), tmp_path / "p.safetensors")
    ref.load_lora_weights(str(kohya), adapter_name="k")
    ref.fuse_lora(lora_scale=0.7, adapter_names=["k"])
    ref.unload_lora_weights()
    want_one = _reference_images(ref)
    ref.load_lora_weights(str(peft), adapter_name="p")
    ref.fuse_lora(lora_scale=-0.4, adapter_names=["p"])
    ref.unload_lora_weights()
    want_two = _reference_images(ref)

    one = load_pipeline(folder, device="cpu", dtype="float32", loras=[LoraSpec(kohya, 0.7)])
    n_text = 2 if family == "sdxl" else 1
    assert [a.format for a in one.loras] == ["kohya"] and len(one.loras[0].layers) == 1 + n_text
    got_one = _ours(one)
    assert _diff(got_one, want_one) <= MAX_PIXEL_DIFF
    assert _diff(got_one, base) > 10  # the LoRA changes the image
    two = load_pipeline(folder, device="cpu", dtype="float32", loras=[LoraSpec(kohya, 0.7), LoraSpec(peft, -0.4)])
    assert two.loras[1].format == "peft"
    assert sum(two.loras[1].layers.values()) == len(random_lora(ref, "peft", rank=2)) // 2
    assert _diff(_ours(two), want_two) <= MAX_PIXEL_DIFF
    # a <lora:...> tag is not encoded: the prompt with it gives the same image
    assert _diff(_ours(two, [p + " <lora:k:0.7>" for p in PROMPTS]), _ours(two)) == 0


def test_lora_options_tags_and_hash(tmp_path):
    f = tmp_path / "my style.safetensors"
    save_lora({"lora_unet_x.lora_down.weight": torch.zeros(1, 2), "lora_unet_x.lora_up.weight": torch.zeros(2, 1)}, f)
    assert parse_lora_option(str(f)) == LoraSpec(f, 1.0)
    assert parse_lora_option(f"{f}:0.5") == LoraSpec(f, 0.5)
    with pytest.raises(UserError, match="not a number"):
        parse_lora_option(f"{f}:heavy")
    with pytest.raises(UserError, match="does not exist"):
        parse_lora_option(str(tmp_path / "nope.safetensors"))
    assert strip_lora_tags("a cat <lora:my style:0.8>, sitting<lora:x>") == "a cat , sitting"
    specs = run_loras([], ["a cat <lora:my style:0.8>", None], tmp_path)
    assert specs == [LoraSpec(f, 0.8, from_tag=True)]
    assert run_loras([], ["a cat <lora:my style>"], tmp_path)[0].weight == 1.0
    with pytest.raises(UserError, match="no file 'other.safetensors'"):
        run_loras([], ["<lora:other:1>"], tmp_path)
    with pytest.raises(UserError, match="--lora-dir"):
        run_loras([], ["<lora:other:1>"], None)
    with pytest.raises(UserError, match="not a number"):
        run_loras([], ["<lora:my style:x>"], tmp_path)
    # A1111's hash: SHA-256 of the bytes after the safetensors header, 12 hex digits
    import hashlib

    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    assert lora_hash(f) == hashlib.sha256(data[8 + n :]).hexdigest()[:12]


@pytest.fixture(scope="module")
def sd1_folder(tmp_path_factory):
    return _folder("sd1", tmp_path_factory)


def _bad(folder, path, match):
    with pytest.raises(CheckpointError, match=match):
        load_pipeline(folder, device="cpu", dtype="float32", loras=[LoraSpec(path)])


def test_bad_loras_are_one_line_errors(sd1_folder, tmp_path_factory, tmp_path):
    sd1 = _reference("sd1", sd1_folder)
    good = random_lora(sd1, "kohya", rank=2)
    # truncated
    f = save_lora(good, tmp_path / "t.safetensors")
    f.write_bytes(f.read_bytes()[:-100])
    _bad(sd1_folder, f, "truncated")
    # an SDXL LoRA on SD 1.x
    xl = _reference("sdxl", _folder("sdxl", tmp_path_factory))
    _bad(sd1_folder, save_lora(random_lora(xl, "kohya", rank=2, original_names=_original_names(xl)), tmp_path / "xl.safetensors"), "made for SDXL")
    _bad(
        sd1_folder,
        save_lora(random_lora(xl, "peft", rank=2, text=False), tmp_path / "xlp.safetensors"),
        "made for a 96-wide text context .* this model is a 32-wide",
    )
    # a key that matches no layer
    bad = dict(
        good, **{"lora_unet_down_blocks_7_attn_to_q.lora_down.weight": torch.zeros(2, 4), "lora_unet_down_blocks_7_attn_to_q.lora_up.weight": torch.zeros(4, 2)}
    )
    _bad(sd1_folder, save_lora(bad, tmp_path / "nomatch.safetensors"), "lora_unet_down_blocks_7_attn_to_q' matches no layer")
    # a rank mismatch
    key = next(k for k in good if k.endswith("lora_up.weight"))
    bad = dict(good, **{key: torch.zeros(good[key].shape[0], 3)})
    _bad(sd1_folder, save_lora(bad, tmp_path / "rank.safetensors"), "rank mismatch")
    # a full checkpoint given as a LoRA
    _bad(
        sd1_folder,
        save_lora({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(2, 2)}, tmp_path / "full.safetensors"),
        "full Stable Diffusion checkpoint",
    )
    _bad(sd1_folder, save_lora({"x.hada_w1_a": torch.zeros(2, 2)}, tmp_path / "loha.safetensors"), "LoHa")


def test_cli_lora_flag_tag_parameters_and_replay(sd1_folder, tmp_path, monkeypatch):
    """--lora and <lora:NAME:W> on txt2img: the PNG records 'Lora hashes' as A1111 does, replay finds
    the files again (--lora-dir, or the --lora path given) and makes the same PNG; --verbose says how
    many layers each file touched; bad LoRA input is one line, exit 2, nothing written."""
    from conftest import one_error_line
    from PIL import Image
    from typer.testing import CliRunner

    from gencli.cli import app

    monkeypatch.chdir(tmp_path)
    ref = _reference("sd1", sd1_folder)
    loras = tmp_path / "loras"
    loras.mkdir()
    save_lora(random_lora(ref, "kohya", seed=5, rank=2), loras / "style.safetensors")
    other = save_lora(random_lora(ref, "peft", seed=6, rank=2, text=False), tmp_path / "detail.safetensors")

    def invoke(*args):
        return CliRunner().invoke(app, ["txt2img", "-m", str(sd1_folder), "--steps", "2", "--width", "16", "--height", "16", "--seed", "1", *args])

    r = invoke("a red star <lora:style:0.6>", "--lora-dir", str(loras), "--lora", f"{other}:0.5", "-o", "a.png", "--verbose")
    assert r.exit_code == 0, r.output
    assert "LoRA '" in r.stderr and "layers (" in r.stderr
    text = Image.open("a.png").info["parameters"]
    assert text.splitlines()[0] == "a red star <lora:style:0.6>"
    assert f'Lora hashes: "detail: {lora_hash(other)}, style: {lora_hash(loras / "style.safetensors")}"' in text
    assert 'Lora weights: "detail: 0.5"' in text
    plain = invoke("a red star", "-o", "plain.png")
    assert plain.exit_code == 0, plain.output
    assert _diff(np.asarray(Image.open("a.png")), np.asarray(Image.open("plain.png"))) > 5
    r = CliRunner().invoke(app, ["replay", "a.png", "-m", str(sd1_folder), "--lora-dir", str(loras), "--lora", str(other), "-o", "b.png"])
    assert r.exit_code == 0, r.output
    assert open("a.png", "rb").read() == open("b.png", "rb").read()
    # replay without the files: one line naming what is missing
    one_error_line(CliRunner().invoke(app, ["replay", "a.png", "-m", str(sd1_folder), "-o", "c.png"]), "detail")
    # bad input: a tag naming no file, a weight that is not a number, a truncated file
    one_error_line(invoke("a <lora:nope:1>", "--lora-dir", str(loras), "-o", "d.png"), "nope")
    one_error_line(invoke("a <lora:style:x>", "--lora-dir", str(loras), "-o", "d.png"), "not a number")
    one_error_line(invoke("a", "--lora", f"{other}:lots", "-o", "d.png"), "not a number")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(other.read_bytes()[:200])
    one_error_line(invoke("a", "--lora", str(broken), "-o", "d.png"), "broken.safetensors")
    assert not (tmp_path / "c.png").exists() and not (tmp_path / "d.png").exists()
    # prompt weighting: an unbalanced bracket is a warning; --no-weighting reads brackets as text,
    # is recorded as A1111's "Emphasis: None" and replayed so
    r = invoke("a (red star", "-o", "w.png")
    assert r.exit_code == 0 and "warning: unbalanced brackets" in r.stderr, r.output
    r = invoke("a (red star", "-o", "nw.png", "--no-weighting")
    assert r.exit_code == 0, r.output
    assert "Emphasis: None" in Image.open("nw.png").info["parameters"] and "Emphasis" not in Image.open("w.png").info["parameters"]
    assert _diff(np.asarray(Image.open("w.png")), np.asarray(Image.open("nw.png"))) > 0
    r = CliRunner().invoke(app, ["replay", "nw.png", "-m", str(sd1_folder), "-o", "nw2.png"])
    assert r.exit_code == 0, r.output
    assert open("nw.png", "rb").read() == open("nw2.png", "rb").read()
    # an embedding used by name from --embeddings-dir
    save_lora({"emb_params": torch.randn(2, 32)}, loras / "shapey.safetensors")
    r = invoke("a shapey star", "--embeddings-dir", str(loras), "-o", "ti.png")
    assert r.exit_code == 0, r.output
    import hashlib

    want = hashlib.sha256((loras / "shapey.safetensors").read_bytes()).hexdigest()[:12]
    assert f'TI hashes: "shapey: {want}"' in Image.open("ti.png").info["parameters"]


# -- prompt weighting and long prompts ----------------------------------------------------------------
@pytest.mark.parametrize(
    "text, want",
    [  # the examples of A1111's prompt_parser.parse_prompt_attention docstring
        ("normal text", [["normal text", 1.0]]),
        ("an (important) word", [["an ", 1.0], ["important", 1.1], [" word", 1.0]]),
        ("(unbalanced", [["unbalanced", 1.1]]),
        ("\\(literal\\]", [["(literal]", 1.0]]),
        ("(unnecessary)(parens)", [["unnecessaryparens", 1.1]]),
        (
            "a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
            [
                ["a ", 1.0],
                ["house", 1.5730000000000004],
                [" ", 1.1],
                ["on", 1.0],
                [" a ", 1.1],
                ["hill", 0.55],
                [", sun, ", 1.1],
                ["sky", 1.4641000000000006],
                [".", 1.1],
            ],
        ),  # fmt: skip
        # and the rest of the syntax
        ("((word))", [["word", 1.2100000000000002]]),
        ("[word]", [["word", 1 / 1.1]]),
        ("(word:1.3) x", [["word", 1.3], [" x", 1.0]]),
        ("a BREAK b", [["a", 1.0], ["BREAK", -1], ["b", 1.0]]),
        ("a) b", [["a) b", 1.0]]),  # a bracket that closes nothing is text
        ("photo: a cat", [["photo: a cat", 1.0]]),
    ],
)
def test_parse_prompt_attention_matches_a1111(text, want):
    from gencli.pipelines.diffusion.prompt_weighting import parse_prompt_attention

    got = parse_prompt_attention(text)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [w for _, w in got] == pytest.approx([w for _, w in want], rel=1e-12)


def test_bracket_notices_and_bad_weights():
    from gencli.pipelines.diffusion.prompt_weighting import bracket_notice, parse_prompt_attention

    assert bracket_notice("a (b) [c] \\( d") is None
    assert "'(' left open" in bracket_notice("a (b")
    assert "')' closing nothing" in bracket_notice("a b)")
    with pytest.raises(UserError, match="not a number"):
        parse_prompt_attention("(word:1.2.3)")


def a1111_reference(tokenizer, encoders, runs, *, chunks=None, penultimate=False):
    """A1111's encoding written from its algorithm (FrozenCLIPEmbedderWithCustomWords), on
    transformers' tokenizer and text encoders: ``runs`` are the parser's [text, weight] pairs (no
    commas near a chunk end here, so its comma backtracking never moves words); every run is
    tokenized on its own; the tokens fill chunks of 75; each chunk is [BOS] + tokens + [EOS], padded
    with EOS and then, after the first EOS, with the tokenizer's pad token, and is encoded on its own;
    its states multiplied by the token weights and scaled back to the mean they had before (the
    "Original" emphasis); the chunks concatenated along the tokens; SDXL's encoders (penultimate
    layer, no final norm) concatenated along the features, the pooled output that of chunk 0."""
    ids, weights = [], []
    for text, w in runs:
        t = tokenizer(text, add_special_tokens=False).input_ids
        ids += t
        weights += [w] * len(t)
    n = max(1, -(-len(ids) // 75)) if chunks is None else chunks
    outs, pooled = [], None
    for c in range(n):
        part, pw = ids[75 * c : 75 * (c + 1)], weights[75 * c : 75 * (c + 1)]
        fill = 75 - len(part)
        toks = [tokenizer.bos_token_id, *part, *[tokenizer.eos_token_id] * fill, tokenizer.eos_token_id]
        mult = torch.tensor([1.0, *pw, *[1.0] * fill, 1.0])
        per_encoder = []
        for enc in encoders:
            row = list(toks)
            end = row.index(tokenizer.eos_token_id)
            pad = enc["pad"]
            row = row[: end + 1] + [pad] * (77 - end - 1)
            with torch.no_grad():
                out = enc["model"](torch.tensor([row]), output_hidden_states=True)
            z = out.hidden_states[-2] if penultimate else out.last_hidden_state
            mean = z.mean()
            z = z * mult[None, :, None]
            z = z * (mean / z.mean())
            per_encoder.append(z)
            if c == 0 and hasattr(out, "text_embeds"):
                pooled = out.text_embeds
        outs.append(torch.cat(per_encoder, dim=-1))
    return torch.cat(outs, dim=1), pooled


LONG = "a small red star at the top left on a blue background next to " + " ".join(["a green circle and a yellow square"] * 20)


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_weighted_and_long_prompts_match_a1111_reference(family, tmp_path_factory):
    folder = _folder(family, tmp_path_factory)
    ref = _reference(family, folder)
    pipe = load_pipeline(folder, device="cpu", dtype="float32")
    enc = pipe.prompt_encoder
    xl = family == "sdxl"
    encoders = [{"model": ref.text_encoder, "pad": ref.tokenizer.pad_token_id}]
    if xl:
        encoders.append({"model": ref.text_encoder_2, "pad": ref.tokenizer_2.pad_token_id})
    if not xl:
        # the random encoder's final LayerNorm has no bias: every state would have mean 0, and the
        # emphasis' rescaling by the ratio of two means of about 0 would be noise in both
        bias = torch.randn(ref.text_encoder.final_layer_norm.bias.shape, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref.text_encoder.final_layer_norm.bias.copy_(bias)
            enc.text_encoder.tower.final_layer_norm.bias.copy_(bias)
    # a prompt without brackets of at most 75 tokens: exactly today's (diffusers') encoding
    plain = enc.encode_prompts(PROMPTS, weighting=True)
    today = enc.encode_prompts(PROMPTS)
    assert torch.equal(plain.hidden_states, today.hidden_states) and plain.hidden_states.shape[1] == 77
    # weights
    prompt = "a (red:1.5) star, [blue] background, ((green))"
    runs = [["a ", 1.0], ["red", 1.5], [" star, ", 1.0], ["blue", 1 / 1.1], [" background, ", 1.0], ["green", 1.21]]
    want, want_pooled = a1111_reference(ref.tokenizer, encoders, runs, penultimate=xl)
    got = enc.encode_prompts([prompt], weighting=True)
    assert torch.allclose(got.hidden_states, want, atol=1e-5)
    assert not torch.allclose(got.hidden_states, enc.encode_prompts([prompt], weighting=False).hidden_states, atol=1e-3)
    if xl:
        assert torch.allclose(got.pooled, want_pooled, atol=1e-5)
    # a long prompt: 3 chunks of 75 (no truncation notice), with a weighted word in the second
    long = LONG + " (tiny:0.7) dots"
    n_tokens = len(ref.tokenizer(long, add_special_tokens=False).input_ids)
    assert 150 < n_tokens <= 225
    cut = long.index(" (tiny")
    want, want_pooled = a1111_reference(ref.tokenizer, encoders, [[long[:cut] + " ", 1.0], ["tiny", 0.7], [" dots", 1.0]], penultimate=xl)
    cond, uncond = enc.encode_prompt([long], ["blurry"], weighting=True)
    assert cond.hidden_states.shape[1] == 3 * 77 and not cond.notices
    assert torch.allclose(cond.hidden_states, want, atol=1e-5)
    if xl:
        assert torch.allclose(cond.pooled, want_pooled, atol=1e-5)
    # the negative prompt padded to the same number of chunks with the empty prompt's
    neg, _ = a1111_reference(ref.tokenizer, encoders, [["blurry", 1.0]], chunks=3, penultimate=xl)
    assert uncond.hidden_states.shape == cond.hidden_states.shape
    assert torch.allclose(uncond.hidden_states, neg, atol=1e-5)
    # BREAK starts a new chunk
    assert enc.encode_prompts(["a red star BREAK a blue sky"], weighting=True).hidden_states.shape[1] == 2 * 77


def test_comma_backtracking_moves_words_after_a_comma():
    from gencli.pipelines.diffusion.prompt_weighting import tokenize_chunks
    from gencli.tokenizers.clip_bpe import CLIPTokenizer

    tok = CLIPTokenizer.from_openai_bpe()
    words = ["cat"] * 70 + [","] + ["dog"] * 10  # the comma is 70 tokens in: the 5 dogs that fit move on
    chunks = tokenize_chunks(tok, " ".join(words))
    assert len(chunks) == 2 and all(len(c.tokens) == 77 for c in chunks)
    dog = tok.tokenize_ids("dog")[0]
    assert chunks[0].tokens[72] == tok.eos_token_id and dog not in chunks[0].tokens
    assert chunks[1].tokens[1:11] == [dog] * 10


# -- few-step sampling ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config, steps",
    [
        ({}, 4),
        ({"beta_schedule": "scaled_linear", "set_alpha_to_one": False, "steps_offset": 1, "prediction_type": "v_prediction"}, 8),
        ({"original_inference_steps": 25, "clip_sample": True, "timestep_scaling": 5.0}, 3),
        ({}, 1),
    ],
)
def test_lcm_matches_diffusers_step_for_step(config, steps):
    from gencli.schedulers import get_scheduler

    want = diffusers.LCMScheduler(**config)
    got = get_scheduler("lcm", config)
    want.set_timesteps(steps)
    got.set_timesteps(steps)
    got.set_begin_index(0)
    assert torch.equal(got.timesteps, want.timesteps) and got.display_name == "LCM"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=g)
    x_ref = x.clone()
    gens, gens_ref = ([torch.Generator().manual_seed(s) for s in (5, 6)] for _ in range(2))
    for t in want.timesteps:
        out = torch.randn(2, 4, 8, 8, generator=g)
        ref = want.step(out, t, x_ref, generator=gens_ref)
        mine = got.step(out, t, x, generator=gens)
        x, x_ref = mine.prev_sample, ref.prev_sample
        assert torch.allclose(x, x_ref, atol=1e-6) and torch.allclose(mine.pred_original_sample, ref.denoised, atol=1e-6)
    with pytest.raises(UserError, match="at most"):
        get_scheduler("lcm", {}).set_timesteps(51)


@pytest.fixture(scope="module")
def sd1_pipe(sd1_folder):
    return load_pipeline(sd1_folder, device="cpu", dtype="float32")


def test_lcm_and_trailing_one_step_images_match_diffusers(sd1_folder, sd1_pipe):
    """--sampler lcm at 4 steps and guidance 1 (LCM-LoRA's settings), and SD-Turbo's one Euler step
    with trailing spacing and no guidance, against diffusers' pipelines with those schedulers."""
    ref = _reference("sd1", sd1_folder)

    def reference(steps, guidance):
        out = ref(prompt=PROMPTS, num_inference_steps=steps, height=SIZE, width=SIZE, guidance_scale=guidance,
                  generator=[torch.Generator().manual_seed(s) for s in SEEDS], output_type="np").images  # fmt: skip
        return (out * 255).round().astype(np.uint8)

    def ours(pipe, sampler, steps, guidance):
        settings = resolve_settings(pipe, steps=steps, guidance=guidance, sampler=sampler, width=SIZE, height=SIZE)
        return np.stack([g.pixels for g in generate(pipe, PROMPTS, SEEDS, settings)])

    ref.scheduler = diffusers.LCMScheduler.from_config(ref.scheduler.config)
    want = reference(4, 1.0)
    assert _diff(ours(sd1_pipe, "lcm", 4, 1.0), want) <= MAX_PIXEL_DIFF
    ref.scheduler = diffusers.EulerDiscreteScheduler.from_config(ref.scheduler.config, timestep_spacing="trailing")
    want = reference(1, 0.0)
    turbo = load_pipeline(sd1_folder, device="cpu", dtype="float32", timestep_spacing="trailing")
    got = ours(turbo, "euler", 1, 0.0)
    assert _diff(got, want) <= MAX_PIXEL_DIFF
    assert _diff(got, ours(sd1_pipe, "euler", 1, 0.0)) > 10  # leading spacing starts elsewhere
    params = generate(turbo, PROMPTS[:1], SEEDS[:1], resolve_settings(turbo, steps=1, guidance=0.0, sampler="lcm", width=SIZE, height=SIZE))[0]
    text = params.parameters(turbo).to_text()
    assert "Sampler: LCM" in text and "Timestep spacing: trailing" in text
    with pytest.raises(UserError, match="--timestep-spacing"):
        load_pipeline(sd1_folder, device="cpu", dtype="float32", timestep_spacing="sideways")


# -- textual inversion ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_textual_inversion_matches_diffusers(family, tmp_path_factory, tmp_path):
    """A1111's emb_params file (2 vectors, token = the file's stem) and diffusers' one-token file on
    SD 1.x, SDXL's clip_l/clip_g file: the prompt embeddings equal those of diffusers'
    load_textual_inversion (per text encoder for SDXL, as diffusers loads them)."""
    from gencli.pipelines.diffusion.textual_inversion import EmbeddingSpec, expand_prompt

    folder = _folder(family, tmp_path_factory)
    ref = _reference(family, folder)
    g = torch.Generator().manual_seed(7)
    prompt = "a photo of shapey on a <blob> background"
    if family == "sdxl":
        a1111 = save_lora({"clip_l": torch.randn(2, 32, generator=g), "clip_g": torch.randn(2, 64, generator=g)}, tmp_path / "shapey.safetensors")
        from safetensors.torch import load_file

        state = load_file(str(a1111))
        ref.load_textual_inversion(state["clip_l"], token="shapey", text_encoder=ref.text_encoder, tokenizer=ref.tokenizer)
        ref.load_textual_inversion(state["clip_g"], token="shapey", text_encoder=ref.text_encoder_2, tokenizer=ref.tokenizer_2)
        specs = [EmbeddingSpec(a1111, "shapey")]
        prompt = "a photo of shapey on a blue background"
        want = ref.encode_prompt(prompt=prompt, device="cpu", do_classifier_free_guidance=False)
        want, want_pooled = want[0], want[2]
    else:
        a1111 = save_lora({"emb_params": torch.randn(2, 32, generator=g)}, tmp_path / "shapey.safetensors")
        diff = save_lora({"<blob>": torch.randn(32, generator=g)}, tmp_path / "learned_embeds.safetensors")
        ref.load_textual_inversion(str(a1111), token="shapey")
        ref.load_textual_inversion(str(diff))
        specs = [EmbeddingSpec(a1111, "shapey"), EmbeddingSpec(diff, "<blob>")]
        want, want_pooled = ref.encode_prompt(prompt, "cpu", 1, False)[0], None
    pipe = load_pipeline(folder, device="cpu", dtype="float32", embeddings=specs)
    assert [e.vectors for e in pipe.embeddings][0] == 2
    got = pipe.prompt_encoder.encode_prompts([expand_prompt(prompt, pipe.embeddings)], weighting=True)
    assert torch.allclose(got.hidden_states, want, atol=1e-5)
    if want_pooled is not None:
        assert torch.allclose(got.pooled, want_pooled, atol=1e-5)
    plain = load_pipeline(folder, device="cpu", dtype="float32").prompt_encoder.encode_prompts([prompt], weighting=True)
    assert not torch.allclose(got.hidden_states, plain.hidden_states, atol=1e-3)


def test_bad_embeddings_are_one_line_errors(sd1_folder, tmp_path):
    from gencli.pipelines.diffusion.textual_inversion import EmbeddingSpec, parse_embedding_option, run_embeddings

    def bad(state, match, token="thing", error=CheckpointError):
        f = save_lora(state, tmp_path / f"{token}.safetensors")
        with pytest.raises(error, match=match):
            load_pipeline(sd1_folder, device="cpu", dtype="float32", embeddings=[EmbeddingSpec(f, token)])

    bad({"emb_params": torch.zeros(1, 64)}, "64-wide vectors, text_encoder takes 32")
    bad({"clip_l": torch.zeros(1, 32), "clip_g": torch.zeros(1, 64)}, "SDXL embedding")
    bad({"a": torch.zeros(1, 32), "b": torch.zeros(1, 32)}, "not a textual-inversion embedding")
    bad({"emb_params": torch.zeros(1, 32)}, "already in the tokenizer", token="cat", error=UserError)
    f = save_lora({"emb_params": torch.zeros(1, 32)}, tmp_path / "trunc.safetensors")
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        load_pipeline(sd1_folder, device="cpu", dtype="float32", embeddings=[EmbeddingSpec(f, "trunc")])
    assert parse_embedding_option(f"{f}:<mine>") == EmbeddingSpec(f, "<mine>")
    assert run_embeddings([], tmp_path, ["a trunc b", None]) == [EmbeddingSpec(f, "trunc")]
    with pytest.raises(UserError, match="does not exist"):
        parse_embedding_option(str(tmp_path / "none.safetensors"))


def test_peft_lora_alpha_from_diffusers_metadata(sd1_folder, tmp_path):
    """A PEFT LoRA saved with lora_alpha (and an alpha_pattern) in its lora_adapter_metadata merges
    with alpha / rank, as diffusers' fuse_lora does (the merged UNet and text-encoder weights)."""
    import json

    from safetensors.torch import save_file

    ref = _reference("sd1", sd1_folder)
    state = random_lora(ref, "peft", seed=3, rank=2)
    layer = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    from _lora_fixtures import TEXT_TARGETS, UNET_TARGETS

    meta = {"unet.r": 2, "unet.lora_alpha": 6, "unet.alpha_pattern": {layer: 1}, "unet.target_modules": list(UNET_TARGETS),
            "text_encoder.r": 2, "text_encoder.lora_alpha": 4, "text_encoder.target_modules": list(TEXT_TARGETS)}  # fmt: skip
    path = tmp_path / "alpha.safetensors"
    save_file(state, str(path), metadata={"format": "pt", "lora_adapter_metadata": json.dumps(meta)})
    ref.load_lora_weights(str(path))
    ref.fuse_lora(lora_scale=0.5)
    ref.unload_lora_weights()
    pipe = load_pipeline(sd1_folder, device="cpu", dtype="float32", loras=[LoraSpec(path, 0.5)])
    ours = dict(pipe.unet.named_parameters())
    for name in (layer, "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k"):
        assert torch.allclose(ours[name + ".weight"], ref.unet.get_submodule(name).weight, atol=1e-6), name
    te = pipe.prompt_encoder.text_encoder.tower.encoder.layers[0].self_attn.q_proj.weight
    assert torch.allclose(te, ref.text_encoder.get_submodule("encoder.layers.0.self_attn.q_proj").weight, atol=1e-6)
