"""scripts/bench.py measures the memory's read bandwidth before and after every side of every round and
gives each side's decode speed in a round as a share of the figures measured around it (none where the
two differ: the memory changed state while the side ran): a shared machine's memory speed can change
state within one run, even within a round (a 2-core VM read 78 GB/s at two threads, then 44-46 ten
minutes later)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench  # noqa: E402


def _round(tokens_per_s: float, bytes_per_token: float = 1e9) -> dict:
    return {"decode_tokens_per_s": tokens_per_s, "weight_bytes_per_token": bytes_per_token}


def test_each_round_is_measured_against_its_own_bandwidth():
    # gencli reads 40 GB/s in a round where the memory gave 40, then 20 where it gave 20: all of it both times
    rounds = [{"gencli": _round(40.0), "llama.cpp": _round(30.0)}, {"gencli": _round(20.0), "llama.cpp": _round(15.0)}]
    fractions = bench._bandwidth_fractions(rounds, [40.0, 20.0])
    assert fractions == {"gencli": pytest.approx(1.0), "llama.cpp": pytest.approx(0.75)}
    assert bench._bandwidth_fraction_rounds(rounds, [40.0, 20.0])["llama.cpp"] == pytest.approx([0.75, 0.75])  # each round's own
    # against one figure for the whole run, the same speeds would read 0.75 (median of 1.0 and 0.5)
    assert bench._bandwidth_fractions(rounds, [40.0, 40.0])["gencli"] == pytest.approx(0.75)


def test_each_side_is_measured_against_the_bandwidth_just_before_it():
    # within one round the memory went from 40 to 80 GB/s between the sides
    rounds = [{"gencli": _round(36.0), "llama.cpp": _round(40.0)}, {"gencli": _round(72.0), "llama.cpp": _round(20.0)}]
    per_side = [{"gencli": 40.0, "llama.cpp": 80.0}, {"gencli": 80.0, "llama.cpp": 40.0}]
    assert bench._bandwidth_fraction_rounds(rounds, per_side) == {"gencli": pytest.approx([0.9, 0.9]), "llama.cpp": pytest.approx([0.5, 0.5])}
    assert bench._bandwidth_fractions(rounds, per_side) == {"gencli": pytest.approx(0.9), "llama.cpp": pytest.approx(0.5)}
    # a side not measured in a round has no share there
    assert bench._bandwidth_fraction_rounds(rounds, [{"gencli": 40.0}, {"gencli": 80.0}]) == {"gencli": pytest.approx([0.9, 0.9])}


def test_a_side_during_which_the_memory_changed_state_has_no_share_in_that_round():
    # measured before and after each side: steady (within STEADY) -> their mean; a change -> no share
    rounds = [{"gencli": _round(36.0), "llama.cpp": _round(40.0)}, {"gencli": _round(72.0), "llama.cpp": _round(20.0)}]
    per_side = [{"gencli": [39.0, 41.0], "llama.cpp": [80.0, 45.0]}, {"gencli": [80.0, 80.0], "llama.cpp": [40.0, 40.0]}]
    shares = bench._bandwidth_fraction_rounds(rounds, per_side)
    assert shares["gencli"] == pytest.approx([0.9, 0.9])
    assert shares["llama.cpp"][0] is None and shares["llama.cpp"][1] == pytest.approx(0.5)
    assert bench._bandwidth_fractions(rounds, per_side) == {"gencli": pytest.approx(0.9), "llama.cpp": pytest.approx(0.5)}
    # no steady round at all: no fraction for the side
    never = [{"gencli": [40.0, 80.0]}, {"gencli": [80.0, 40.0]}]
    assert bench._bandwidth_fractions(rounds, never) == {}
    assert bench._steady_bandwidth([40.0, 40.0 * bench.STEADY]) == pytest.approx(40.0 * (1 + bench.STEADY) / 2)
    assert bench._steady_bandwidth([40.0, 40.0 * bench.STEADY * 1.01]) is None


def test_rounds_whose_two_sides_ran_in_one_state_are_told_apart():
    per_side = [
        {"gencli": [45.0, 46.0], "llama.cpp": [47.0, 45.0]},  # both in the slower state
        {"gencli": [78.0, 79.0], "llama.cpp": [46.0, 45.0]},  # one in each
        {"gencli": [78.0, 45.0], "llama.cpp": [77.0, 78.0]},  # gencli's changed while it ran
        {"gencli": [78.0, 79.0], "llama.cpp": [77.0, 80.0]},  # both in the faster
    ]
    assert bench._same_state(per_side, "gencli", "llama.cpp") == [True, False, False, True]
    assert bench._same_state([40.0, 80.0], "gencli", "llama.cpp") == [True, True]  # one figure a round: its sides together


def test_median_over_three_rounds_and_sides_without_a_decode_speed():
    rounds = [{"gencli": _round(t, 2e9), "reference": {"images_per_s": 3.0}} for t in (10.0, 12.0, 30.0)]
    fractions = bench._bandwidth_fractions(rounds, [40.0, 40.0, 40.0])
    assert fractions == {"gencli": pytest.approx(0.6)}  # 2 GB x 12 tokens/s / 40 GB/s


def test_no_fraction_without_a_bandwidth_for_every_round():
    rounds = [{"gencli": _round(40.0)}, {"gencli": _round(40.0)}]
    assert bench._bandwidth_fractions(rounds, []) == {}
    assert bench._bandwidth_fractions(rounds, [40.0]) == {}


@pytest.mark.parametrize(
    ("bandwidths", "changed"),
    [([78.0, 45.0, 44.0], True), ([45.0, 47.0, 44.0], False), ([40.0], False), ([], False), ([40.0, 48.5], True)],
)
def test_a_change_between_rounds_is_reported(bandwidths, changed):
    assert bench._bandwidth_changed(bandwidths) is changed
