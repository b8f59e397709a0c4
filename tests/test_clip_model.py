"""CLIP model parity with transformers on random-initialised configs, loaded through the same path a
downloaded checkpoint takes (save_pretrained -> gencli's loader)."""

from __future__ import annotations

import json

import pytest
import torch

from gencli.backend.device import Placement
from gencli.errors import CheckpointError, UserError
from gencli.models.clip.model import CLIPConfig, CLIPModel, contrastive_loss, init_clip_weights
from gencli.pipelines.clip.loading import load_clip_model, load_text_encoder

transformers = pytest.importorskip("transformers")

CPU32 = Placement(torch.device("cpu"), torch.float32)
TOL = 1e-4


def _hf_config(act: str, eos: int, image_size: int = 30, patch: int = 6):
    text = dict(
        hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4, vocab_size=99,
        max_position_embeddings=20, hidden_act=act, eos_token_id=eos, bos_token_id=96, pad_token_id=1,
    )  # fmt: skip
    vision = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=image_size, patch_size=patch, hidden_act=act)
    return transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16, logit_scale_init_value=2.3)


def _save(model, folder):
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def _randomise(model, seed: int):
    """Random weights everywhere (norms and biases too), so no parameter is checked at a trivial value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        if hasattr(model, "logit_scale"):
            model.logit_scale.fill_(2.3)
    return model


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 95, (3, 12), generator=g)
    ids[0, 5] = ids[1, 11] = ids[2, 7] = 97  # the end-of-text token
    ids[2, 9] = 98  # a later, higher id: the legacy rule (highest id) and the first-EOS rule differ here
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0
    pixels = torch.randn(2, 3, 30, 30, generator=g)
    return ids, mask, pixels


@pytest.mark.parametrize("act,eos", [("quick_gelu", 2), ("gelu", 97)])
def test_clip_model_matches_transformers(tmp_path, act, eos):
    torch.manual_seed(0)
    ref = _randomise(transformers.CLIPModel(_hf_config(act, eos)).eval(), 1)
    folder = _save(ref, tmp_path / "clip")
    model = load_clip_model(folder, CPU32)
    ids, mask, pixels = _inputs()
    with torch.no_grad():
        want = ref(input_ids=ids, pixel_values=pixels, attention_mask=mask, output_hidden_states=True)
        got = model(ids, pixels, mask)
        text = model.text_model(ids, mask, output_hidden_states=True)
        vision = model.vision_model(pixels, output_hidden_states=True)
    assert torch.allclose(got.logits_per_image, want.logits_per_image, atol=TOL)
    assert torch.allclose(got.logits_per_text, want.logits_per_text, atol=TOL)
    assert torch.allclose(got.image_embeds, want.image_embeds, atol=TOL)
    assert torch.allclose(got.text_embeds, want.text_embeds, atol=TOL)
    # the towers' states, layer by layer (the text-to-image family conditions on these)
    ref_text, ref_vision = want.text_model_output, want.vision_model_output
    assert torch.allclose(text.last_hidden_state, ref_text.last_hidden_state, atol=TOL)
    assert len(text.hidden_states) == len(ref_text.hidden_states) == 4
    for a, b in zip(text.hidden_states, ref_text.hidden_states):
        assert torch.allclose(a, b, atol=TOL)
    assert torch.allclose(vision.last_hidden_state, ref_vision.last_hidden_state, atol=TOL)
    for a, b in zip(vision.hidden_states, ref_vision.hidden_states):
        assert torch.allclose(a, b, atol=TOL)
    # the loss matches transformers' return_loss
    with torch.no_grad():
        ref_loss = ref(input_ids=ids[:2], pixel_values=pixels, return_loss=True).loss
        ours = contrastive_loss(model(ids[:2], pixels).logits_per_image)
    assert torch.allclose(ours, ref_loss, atol=TOL)


def test_eos_rules_pick_different_positions():
    cfg = CLIPConfig.from_dict(_hf_config("quick_gelu", 2).to_dict())
    model = CLIPModel(cfg)
    ids, _, _ = _inputs()
    assert model.text_model.eos_positions(ids).tolist() == [5, 11, 9]  # legacy: the highest id
    model.text_model.config.eos_token_id = 97
    assert model.text_model.eos_positions(ids).tolist() == [5, 11, 7]  # the first end-of-text token
    model.text_model.config.eos_token_id = [50, 97]
    assert model.text_model.eos_positions(ids).tolist()[2] <= 7


def test_interpolated_positions_match_transformers(tmp_path):
    ref = _randomise(transformers.CLIPModel(_hf_config("quick_gelu", 97)).eval(), 2)
    model = load_clip_model(_save(ref, tmp_path / "clip"), CPU32)
    pixels = torch.randn(2, 3, 42, 36)
    with torch.no_grad():
        want = ref.get_image_features(pixel_values=pixels, interpolate_pos_encoding=True).pooler_output
        got = model.get_image_features(pixels, interpolate_pos_encoding=True)
    assert torch.allclose(got, want, atol=TOL)
    with pytest.raises(ValueError, match="does not match"):
        model.get_image_features(pixels)


def test_text_encoders_on_their_own(tmp_path):
    """The text tower as the text-to-image family loads it: CLIPTextModel (both key layouts) and
    CLIPTextModelWithProjection folders."""
    cfg = _hf_config("quick_gelu", 97).text_config
    ids, mask, _ = _inputs()
    ref = _randomise(transformers.CLIPTextModel(cfg).eval(), 3)
    folder = _save(ref, tmp_path / "text_encoder")
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    # transformers 4 stored the tower under "text_model."; rewrite the file that way too
    from safetensors.torch import load_file, save_file

    old = tmp_path / "text_encoder_v4"
    old.mkdir()
    (old / "config.json").write_text((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    state = {f"text_model.{k}": v for k, v in state.items()}
    state["text_model.embeddings.position_ids"] = torch.arange(20)[None]
    save_file(state, str(old / "model.safetensors"))
    for path in (folder, old):
        enc = load_text_encoder(path, CPU32)
        with torch.no_grad():
            got = enc(ids, mask, output_hidden_states=True)
        assert torch.allclose(got.last_hidden_state, want.last_hidden_state, atol=TOL)
        assert torch.allclose(got.pooler_output, want.pooler_output, atol=TOL)
        assert torch.allclose(got.hidden_states[-2], want.hidden_states[-2], atol=TOL)  # "clip skip"

    ref_p = _randomise(transformers.CLIPTextModelWithProjection(cfg).eval(), 4)
    enc = load_text_encoder(_save(ref_p, tmp_path / "text_encoder_2"), CPU32)
    with torch.no_grad():
        want = ref_p(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        embeds, out = enc(ids, mask, output_hidden_states=True)
    assert torch.allclose(embeds, want.text_embeds, atol=TOL)
    assert torch.allclose(out.hidden_states[-2], want.hidden_states[-2], atol=TOL)


def test_bf16_keeps_the_temperature_in_fp32(tmp_path):
    ref = _randomise(transformers.CLIPModel(_hf_config("quick_gelu", 97)).eval(), 5)
    folder = _save(ref, tmp_path / "clip")
    model = load_clip_model(folder, Placement(torch.device("cpu"), torch.bfloat16))
    assert model.logit_scale.dtype == torch.float32
    assert model.text_projection.weight.dtype == torch.bfloat16
    ids, mask, pixels = _inputs()
    with torch.no_grad():
        want = ref(input_ids=ids, pixel_values=pixels, attention_mask=mask)
        got = model(ids, pixels, mask)
    cos = torch.nn.functional.cosine_similarity(got.text_embeds, want.text_embeds, dim=-1)
    assert cos.min() > 0.99


def test_checkpoint_errors_are_user_errors(tmp_path):
    ref = transformers.CLIPModel(_hf_config("quick_gelu", 97)).eval()
    folder = _save(ref, tmp_path / "clip")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["vision_config"]["hidden_size"] = 64
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        load_clip_model(folder, CPU32)
    text = _save(transformers.CLIPTextModel(_hf_config("quick_gelu", 97).text_config), tmp_path / "text")
    with pytest.raises(UserError, match="holds a CLIPTextModel .a CLIP text encoder., not an image-text model"):
        load_clip_model(text, CPU32)


def test_from_scratch_initialisation_and_config_round_trip(tmp_path):
    cfg = CLIPConfig.from_dict(_hf_config("gelu", 97).to_dict())
    model = CLIPModel(cfg)
    init_clip_weights(model)
    assert abs(model.logit_scale.item() - 2.3) < 1e-6
    assert model.text_model.final_layer_norm.weight.eq(1).all()
    # our config.json loads in transformers with the same shapes
    hf_cfg = transformers.CLIPConfig.from_dict(cfg.to_dict())
    ref = transformers.CLIPModel(hf_cfg)
    assert {k: tuple(v.shape) for k, v in ref.state_dict().items() if "position_ids" not in k} == {
        k: tuple(v.shape) for k, v in model.state_dict().items()
    }


def test_text_conditioning_as_diffusers_computes_it(tmp_path):
    """Stable Diffusion's prompt states: padded to 77 tokens, last layer or "clip skip" (final norm
    applied), SDXL's penultimate layer without it."""
    from gencli.pipelines.clip.loading import text_conditioning
    from gencli.tokenizers.clip_bpe import train_bpe

    tok = train_bpe(["a red star at the top left", "a photo of a cat", "a blue circle"] * 3, 40)
    text_cfg = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4, vocab_size=tok.vocab_size,
                    max_position_embeddings=77, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    ref = _randomise(transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**text_cfg, projection_dim=16)).eval(), 6)
    enc = load_text_encoder(_save(ref, tmp_path / "te"), CPU32)
    tok.save(tmp_path / "te")
    ref_tok = transformers.CLIPTokenizer.from_pretrained(str(tmp_path / "te"))
    prompts = ["a red star", "a photo of a blue cat at the top left"]
    ids = ref_tok(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = ref(input_ids=ids, output_hidden_states=True)
        norm = ref.text_model.final_layer_norm
        for skip, final_norm, expected in [
            (0, True, want.last_hidden_state),
            (1, True, norm(want.hidden_states[-2])),
            (1, False, want.hidden_states[-2]),
            (0, False, want.hidden_states[-1]),
        ]:
            states, pooled = text_conditioning(enc, tok, prompts, skip=skip, final_norm=final_norm)
            assert states.shape == (2, 77, 32)
            assert torch.allclose(states, expected, atol=TOL), (skip, final_norm)
            assert torch.allclose(pooled, want.text_embeds, atol=TOL)
