"""Page runs: moves coalesce into one copy only where both sides are consecutive."""

from kvd.core.blocks import TierKind
from kvd.memory.copier import page_runs

D, H = TierKind.DEVICE, TierKind.HOST


def test_consecutive_moves_coalesce():
    moves = [(D, 3, H, 10), (D, 1, H, 8), (D, 2, H, 9), (D, 7, H, 11)]
    assert page_runs(moves) == [(D, 1, H, 8, 3), (D, 7, H, 11, 1)]


def test_gaps_on_either_side_break_a_run():
    assert page_runs([(D, 0, H, 0), (D, 1, H, 5), (D, 2, H, 6)]) == [
        (D, 0, H, 0, 1), (D, 1, H, 5, 2)]
    assert page_runs([(H, 4, D, 0), (H, 6, D, 1)]) == [(H, 4, D, 0, 1), (H, 6, D, 1, 1)]
