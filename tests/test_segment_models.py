"""Semantic segmentation models: SegFormer equal to transformers' on random tiny checkpoints at odd
sizes, the U-Net's shapes and layout, the palette PNG."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

transformers = pytest.importorskip("transformers")

SHAPE_LABELS = {0: "background", 1: "circle", 2: "square", 3: "triangle", 4: "star", 5: "heart", 6: "cross", 7: "diamond", 8: "crescent"}


def tiny_segformer(path, seed=0, preprocessor=None):
    """A random 2-stage SegFormer saved by transformers (BatchNorm statistics randomised too)."""
    torch.manual_seed(seed)
    cfg = transformers.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 2], sr_ratios=[4, 2], hidden_sizes=[8, 16], num_attention_heads=[1, 2], patch_sizes=[7, 3],
        strides=[4, 2], mlp_ratios=[2, 2], decoder_hidden_size=16, num_labels=5,
        id2label={i: n for i, n in enumerate(["sky", "road", "tree", "car", "person"])},
    )  # fmt: skip
    model = transformers.SegformerForSemanticSegmentation(cfg).eval()
    with torch.no_grad():
        bn = model.decode_head.batch_norm
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_()
        bn.bias.normal_()
    model.save_pretrained(path)
    if preprocessor is not None:
        (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return model


def tiny_unet(path, channels=(8, 16, 32), seed=0):
    from gencli.checkpoints.loader import save_model
    from gencli.models.unet_segmenter import UNetSegmenter, UNetSegmenterConfig

    torch.manual_seed(seed)
    cfg = UNetSegmenterConfig(channels=tuple(channels), norm_groups=4, id2label=dict(SHAPE_LABELS))
    model = UNetSegmenter(cfg)
    model.init_weights()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_dict()))
    save_model(model, path / "model.safetensors")
    return model.eval()


@pytest.fixture(scope="module")
def seg_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("segformer")
    # no resize: the model sees each image at its own (odd) size; ImageNet mean/std
    model = tiny_segformer(path, preprocessor={"image_processor_type": "SegformerImageProcessor", "do_resize": False})
    return path, model


@pytest.fixture(scope="module")
def unet_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("unet") / "unet"
    return path, tiny_unet(path)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from gencli.data import shapes

    root = tmp_path_factory.mktemp("images")
    for i, (seed, size) in enumerate(zip(shapes.split_seeds("test", 3), [(53, 37), (48, 64), 40])):
        shapes.render(seed, size).pil().save(root / f"img{i}.png")
    return root


def load_ours(path):
    from gencli.pipelines.segmentation.loading import Segmenter

    return Segmenter.load(path, device="cpu", dtype="float32", threads=1)


# -- SegFormer equals transformers ----------------------------------------------------------------------
@pytest.mark.parametrize("hw", [(37, 53), (64, 48), (33, 33)])
def test_segformer_logits_and_class_map_equal_transformers(seg_dir, hw):
    path, ref = seg_dir
    ours = load_ours(path)
    torch.manual_seed(1)
    x = torch.randn(2, 3, *hw)
    with torch.no_grad():
        want = ref(pixel_values=x).logits
    got = ours.logits(x)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4
    from gencli.pipelines.segmentation.loading import class_map

    for b in range(2):
        ref_map = F.interpolate(want[b : b + 1], size=hw, mode="bilinear", align_corners=False).argmax(1)[0].numpy()
        agree = (class_map(got[b], hw) == ref_map).mean()
        assert agree >= 0.999, agree


def test_segformer_pipeline_equals_transformers_processor_and_post_processing(seg_dir, images):
    """Image file -> class map at the image's size, against transformers' PIL image processor, the
    model and post_process_semantic_segmentation (odd image sizes, no resize)."""
    from transformers.models.segformer.image_processing_pil_segformer import SegformerImageProcessorPil

    path, ref = seg_dir
    ours = load_ours(path)
    proc = SegformerImageProcessorPil(do_resize=False)
    for name in ("img0.png", "img1.png"):
        im = Image.open(images / name).convert("RGB")
        px = proc(images=im, return_tensors="pt")["pixel_values"]
        assert torch.equal(torch.from_numpy(ours.processor.preprocess(im)), px[0])
        with torch.no_grad():
            out = ref(pixel_values=px)
        want = proc.post_process_semantic_segmentation(out, target_sizes=[(im.height, im.width)])[0].numpy()
        got = ours.segment([im])[0]
        assert got.shape == (im.height, im.width)
        assert (got == want).mean() >= 0.999


def test_segformer_v5_tensor_names_load(seg_dir, tmp_path):
    """A file written with transformers 5's in-memory names loads through the key map."""
    from safetensors.torch import save_file

    path, ref = seg_dir
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    ours = load_ours(tmp_path)
    x = torch.randn(1, 3, 40, 36)
    with torch.no_grad():
        assert (ours.logits(x) - ref(pixel_values=x).logits).abs().max().item() < 1e-4


# -- U-Net ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hw", [(37, 53), (64, 48), (17, 31), (96, 96)])
def test_unet_output_has_the_input_size(unet_dir, hw):
    _, model = unet_dir
    with torch.no_grad():
        out = model(torch.randn(2, 3, *hw))
    assert out.shape == (2, 9, *hw)


def test_unet_skip_connections_concatenate(unet_dir):
    _, model = unet_dir
    # the deepest up block reads the up-convolution's channels and as many from the skip connection
    assert model.up[0].up.out_channels == 16 and model.up[0].block.conv1.in_channels == 32
    assert model.up[-1].block.conv1.in_channels == 2 * model.config.channels[0]
    assert model.classifier.kernel_size == (1, 1)


def test_unet_checkpoint_loads_with_its_config(unet_dir):
    path, model = unet_dir
    seg = load_ours(path)
    assert seg.kind == "unet" and seg.labels == SHAPE_LABELS
    x = torch.randn(1, 3, 29, 41)
    with torch.no_grad():
        assert torch.allclose(seg.logits(x), model(x), atol=1e-5)
    im = Image.fromarray(np.random.default_rng(0).integers(0, 255, (29, 41, 3), dtype=np.uint8))
    assert seg.segment([im])[0].shape == (29, 41)


# -- palette PNG ------------------------------------------------------------------------------------------
def test_palette_png_round_trip(tmp_path):
    from gencli.pipelines.segmentation.masks import label_counts, mask_image, palette, write_image

    ids = np.random.default_rng(0).integers(0, 150, (37, 53)).astype(np.uint8)
    write_image(tmp_path / "m.png", mask_image(ids))
    back = Image.open(tmp_path / "m.png")
    assert back.mode == "P"
    assert np.array_equal(np.asarray(back), ids)
    assert back.getpalette()[3:6] == list(palette()[1])
    assert len(set(palette())) == 256
    counts = label_counts(ids, {i: f"c{i}" for i in range(150)})
    assert sum(c["pixels"] for c in counts) == ids.size
    assert abs(sum(c["fraction"] for c in counts) - 1) < 1e-4
    with pytest.raises(Exception, match="already exists"):
        write_image(tmp_path / "m.png", mask_image(ids))


# -- the shapes world's masks ------------------------------------------------------------------------
@pytest.mark.parametrize("size", [64, (53, 37), 128])
def test_shapes_mask_marks_each_object_with_its_shape(size):
    from gencli.data import shapes

    for seed in shapes.split_seeds("test", 6):
        image, mask, scene = shapes.render_with_mask(seed, size, n_objects=1 + seed % 2)
        assert mask.shape == image.shape[:2] and mask.dtype == np.uint8
        assert shapes.MASK_CLASSES[0] == "background" and shapes.MASK_CLASSES[1:] == shapes.SHAPES
        assert set(np.unique(mask).tolist()) == {0} | {1 + shapes.SHAPES.index(o.shape) for o in scene.objects}
        bg = mask == 0
        assert (np.abs(image[bg].astype(int) - scene.background_rgb).max(-1) <= 2).mean() > 0.97
        for o in scene.objects:
            inside = mask == 1 + shapes.SHAPES.index(o.shape)
            assert (np.abs(image[inside].astype(int) - o.rgb).max(-1) <= 60).mean() > 0.8


def test_only_shrink_resizes_larger_images_only(tmp_path):
    path = tmp_path / "unet"
    tiny_unet(path)
    (path / "preprocessor_config.json").write_text(json.dumps({"do_resize": True, "size": {"shortest_edge": 48}, "only_shrink": True}))
    seg = load_ours(path)
    small, large = Image.new("RGB", (40, 30)), Image.new("RGB", (96, 80))
    assert seg.preprocess(small).shape == (3, 30, 40)
    assert seg.preprocess(large).shape == (3, 48, 57)
    assert seg.segment([large])[0].shape == (80, 96)


def test_segformer_autograd_path_and_the_composed_head_follow_the_weights(seg_dir):
    """The plain path (autograd on: no fused kernels, no packed weights) gives the inference path's
    logits, and the head composed once for inference is composed again when a weight changes."""
    path, ref = seg_dir
    model = load_ours(path).model
    x = torch.randn(1, 3, 41, 29, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        fast = model(x)
    slow = model(x)
    torch.testing.assert_close(slow.detach(), fast, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        model.decode_head.batch_norm.bias.add_(1.0)
        ref.decode_head.batch_norm.bias.add_(1.0)
        try:
            want = ref(pixel_values=x).logits
            with torch.inference_mode():
                got = model(x)
        finally:
            ref.decode_head.batch_norm.bias.sub_(1.0)
    assert (got - want).abs().max().item() < 1e-4
