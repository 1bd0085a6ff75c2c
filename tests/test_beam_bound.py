"""scripts/beam_speculation_bound.py: the oracle's draft trees and its steps per pass on hand-made beam traces."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("beam_bound", os.path.join(ROOT, "scripts", "beam_speculation_bound.py"))
beam_bound = importlib.util.module_from_spec(spec)
spec.loader.exec_module(beam_bound)


def test_tree_paths():
    assert beam_bound.tree((1,), 2) == {(0,), (0, 0)}
    assert beam_bound.tree((2,), 2) == {(0,), (1,), (0, 0), (1, 0)}
    assert beam_bound.tree((2, 2), 2) == {(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)}
    assert all(len(beam_bound.tree(w, d)) == n for w, d, n in [((1,), 6, 6), ((3,), 1, 3), ((2,), 7, 14)])


def test_steps_per_pass_ends_a_round_at_the_first_beam_off_the_tree():
    # two beams; per step: (each kept beam's source, its token's rank among the source's candidates)
    trace = [([0, 0], [0, 1]),  # beam 1 keeps its source's second best: off a chain
             ([0, 1], [0, 0]),  # both the best of their sources
             ([1, 0], [0, 0]),
             ([0, 0], [0, 0])]
    chain1, chain2, top2 = beam_bound.tree((1,), 1), beam_bound.tree((1,), 2), beam_bound.tree((2,), 2)
    assert beam_bound.steps_per_pass([trace], chain1, 2) == 4 / 3  # rounds: [1], [2, 3], [4]
    assert beam_bound.steps_per_pass([trace], chain2, 2) == 4 / 2  # [1], [2, 3, 4]
    assert beam_bound.steps_per_pass([trace], top2, 2) == 4 / 2  # [1, 2, 3]: the second best at depth 1, [4]
    assert beam_bound.steps_per_pass([trace, trace], set(), 2) == 1.0  # no drafts: one step per pass


def test_every_shape_is_a_tree():
    for widths, depth in beam_bound.SHAPES.values():
        paths = beam_bound.tree(widths, depth)
        assert all(p[:-1] in paths for p in paths if len(p) > 1)
