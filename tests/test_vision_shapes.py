"""The shapes world: determinism, disjoint seed ranges, vocabulary coverage, and that each object is
drawn in its colour at its position and size."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest

from gencli.data import shapes as S


def _object_mask(image: np.ndarray, background_rgb) -> np.ndarray:
    diff = np.abs(image.astype(np.int32) - np.asarray(background_rgb, dtype=np.int32)).sum(-1)
    return diff > 24


def test_vocabularies_are_rich_enough_and_distinct():
    assert len(S.SHAPES) >= 8 and len(set(S.SHAPES)) == len(S.SHAPES)
    assert {"circle", "square", "triangle", "star", "heart", "cross"} <= set(S.SHAPES)
    assert len(S.COLOURS) >= 8 and len(S.BACKGROUNDS) >= 4
    assert list(S.SIZES) == ["small", "medium", "large"]
    assert len(S.POSITIONS) == 9 and "top left" in S.POSITIONS and "center" in S.POSITIONS
    # object colours are visually distinct from each other
    for a, b in itertools.combinations(S.COLOURS.values(), 2):
        assert S.colour_distance(a, b) > 30
    # every background admits most colours, none of which is its own
    for bg in S.BACKGROUNDS:
        allowed = S.allowed_colours(bg)
        assert bg not in allowed and len(allowed) >= 6
    assert S.nearest_colour((230, 40, 30)) == "red"


def test_same_seed_same_scene_and_image_at_any_resolution():
    a, b = S.render(123, 64), S.render(123, 64)
    assert a.scene == b.scene and np.array_equal(a.image, b.image)
    big = S.render(123, 128)
    assert big.scene == a.scene and big.image.shape == (128, 128, 3)
    # the 128 px image, averaged down, is the 64 px image up to anti-aliasing differences
    down = big.image.astype(np.float32).reshape(64, 2, 64, 2, 3).mean((1, 3))
    assert np.abs(down - a.image).mean() < 3.0
    assert S.render(124, 64).scene != a.scene
    wide = S.render(123, (96, 64))
    assert wide.image.shape == (64, 96, 3) and wide.scene == a.scene


def test_seed_ranges_are_disjoint_and_named():
    ranges = list(S.SPLITS.values())
    for r1, r2 in itertools.combinations(ranges, 2):
        assert r1.stop <= r2.start or r2.stop <= r1.start
    test = S.split_seeds("test", 100)
    assert len(test) == 100 and all(S.split_of(s) == "test" for s in test)
    assert S.split_of(S.split_seeds("train", 5)[-1]) == "train"
    assert S.split_of(S.split_seeds("validation", 5, offset=10)[0]) == "validation"
    with pytest.raises(ValueError):
        S.split_seeds("holdout", 1)
    with pytest.raises(ValueError):
        S.split_seeds("validation", len(S.SPLITS["validation"]) + 1)


def test_every_word_of_the_vocabulary_occurs():
    scenes = [S.make_scene(s) for s in S.split_seeds("train", 3000)]
    counts = collections.defaultdict(collections.Counter)
    for sc in scenes:
        counts["n"][len(sc.objects)] += 1
        counts["background"][sc.background] += 1
        for o in sc.objects:
            for k in ("shape", "colour", "size", "position"):
                counts[k][getattr(o, k)] += 1
            # the colour rule: never the background's colour, always contrasting
            assert o.colour != sc.background
            assert S.colour_distance(S.COLOURS[o.colour], S.BACKGROUNDS[sc.background]) >= S.MIN_CONTRAST
    assert set(counts["n"]) == {1, 2} and min(counts["n"].values()) > 1200
    assert set(counts["shape"]) == set(S.SHAPES)
    assert set(counts["colour"]) == set(S.COLOURS)
    assert set(counts["size"]) == set(S.SIZES)
    assert set(counts["position"]) == set(S.POSITIONS)
    assert set(counts["background"]) == set(S.BACKGROUNDS)
    # roughly balanced shapes (classifier training relies on it)
    assert max(counts["shape"].values()) < 1.5 * min(counts["shape"].values())


@pytest.mark.parametrize("shape", S.SHAPES)
def test_object_is_drawn_in_its_colour_at_its_position(shape):
    for seed in S.split_seeds("test", 12):
        sample = S.render(seed, 96, n_objects=1, shape=shape)
        sc, img = sample.scene, sample.image
        obj = sc.main
        assert obj.shape == shape
        mask = _object_mask(img, sc.background_rgb)
        assert mask.sum() > 20
        ys, xs = np.nonzero(mask)
        # the centroid lies in the named cell of the 3x3 grid
        col, row = int(xs.mean() / 96 * 3), int(ys.mean() / 96 * 3)
        assert S.POSITIONS[row * 3 + col] == obj.position, (seed, obj)
        # fully covered pixels have exactly the object's colour, which is near its palette colour
        inside = np.all(img == np.asarray(obj.rgb, dtype=np.uint8), axis=-1)
        assert inside.sum() > 0.5 * mask.sum()
        assert S.nearest_colour(img[inside].mean(0)) == obj.colour
        # the area grows with the nominal size: diameter^2 within the shapes' range of fill factors
        area = mask.sum() / (obj.diameter * 96) ** 2
        assert 0.25 < area < 1.3, (shape, area)


def test_sizes_are_ordered_by_area():
    areas = {}
    for size in S.SIZES:
        sample = S.render(5, 64, n_objects=1, shape="circle", object_size=size)
        areas[size] = _object_mask(sample.image, sample.scene.background_rgb).sum()
    assert areas["small"] < areas["medium"] < areas["large"]


def test_two_objects_never_overlap_and_differ():
    for seed in S.split_seeds("validation", 150):
        sc = S.make_scene(seed, n_objects=2)
        a, b = sc.objects
        assert (a.shape, a.colour) != (b.shape, b.colour) and a.position != b.position
        masks = [_object_mask(S.render_scene(S.with_changes(sc, objects=(o,)), 64), sc.background_rgb) for o in sc.objects]
        assert not np.any(masks[0] & masks[1]), seed


def test_constraints_are_honoured_and_keep_the_rest_of_the_scene():
    free = S.make_scene(77, n_objects=1)
    star = S.make_scene(77, n_objects=1, shape="star")
    assert star.main.shape == "star"
    assert (star.main.size, star.main.position, star.background) == (free.main.size, free.main.position, free.background)
    sc = S.make_scene(78, n_objects=2, shape="heart", colour="green", object_size="large", position="top left", background="white")
    assert sc.main.labels() == {"shape": "heart", "colour": "green", "size": "large", "position": "top left"}
    assert sc.background == "white" and len(sc.objects) == 2
    sc = S.make_scene(79, objects=[{"shape": "cross"}, {"shape": "circle", "colour": ["red", "blue"]}])
    assert [o.shape for o in sc.objects] == ["cross", "circle"] and sc.objects[1].colour in ("red", "blue")
    # a colour constraint steers the background away from that colour
    for seed in range(40):
        assert S.make_scene(seed, colour="white").background != "white"
    with pytest.raises(ValueError, match="unknown shape"):
        S.make_scene(1, shape="hexagram")
    with pytest.raises(ValueError, match="background"):
        S.make_scene(1, colour="red", background="red")
    with pytest.raises(ValueError):
        S.make_scene(-1)


def test_captions_describe_the_scene_in_several_phrasings():
    sc = S.make_scene(3, n_objects=1, shape="star", colour="red", object_size="small", position="top left", background="blue")
    caps = sc.captions()
    assert caps["full"] == "a small red star at the top left on a blue background"
    assert caps["list"] == "red star, small, top left, blue background"
    assert caps["background_first"] == "a blue background with a small red star at the top left"
    assert caps["short"] == "a red star"
    assert len(set(caps.values())) == len(S.CAPTION_STYLES)
    two = S.make_scene(4, objects=[{"shape": "circle", "colour": "orange", "size": "large", "position": "center"}, {"position": "bottom right"}])
    full = two.caption()
    assert full.startswith("a large orange circle in the center and ") and "bottom right" in full
    assert two.caption("short").startswith("an orange circle and a")
    assert two.labels()["objects"][0]["shape"] == "circle"
    rng = np.random.default_rng(0)
    assert two.random_caption(rng) in two.captions().values()
    assert two.to_dict()["caption"] == full


def test_render_batch_matches_single_renders():
    seeds = S.split_seeds("test", 6)
    images, scenes = S.render_batch(seeds, 32, n_objects=1)
    assert images.shape == (6, 32, 32, 3) and images.dtype == np.uint8
    for img, sc, seed in zip(images, scenes, seeds):
        assert np.array_equal(img, S.render(seed, 32, n_objects=1).image) and sc.seed == seed
    image, scene = S.render(seeds[0], 32, n_objects=1)  # a Sample unpacks
    assert scene == scenes[0]
