"""trainer.step's data-parallel split and ordered sum (trainer.deterministic_layout): the
shares in rank order are the minibatch's rows in order, and the sum's order is the rows'."""

from __future__ import annotations

import pytest
import torch

from trainer.step import ordered_sum, rank_share


@pytest.mark.parametrize("n", range(1, 13))
def test_shares_in_rank_order_are_the_rows_in_order(n: int) -> None:
    rows = [7 * i % 13 for i in range(n)]  # not sorted: the minibatch's shuffled order is kept
    for size in range(1, n + 1):
        shares = [rank_share(rows, r, size) for r in range(size)]
        assert [row for share in shares for row in share] == rows
        lengths = {len(s) for s in shares}
        assert min(lengths) >= 1 and max(lengths) - min(lengths) <= 1


def test_ordered_sum_adds_in_row_order() -> None:
    # float32 absorbs 1 into 1e8: the order of the adds decides the result, and it is the rows'.
    rows = torch.tensor([[1.0], [1e8], [-1e8]])
    assert ordered_sum(rows).item() == 0.0
    assert ordered_sum(rows[[1, 2, 0]]).item() == 1.0
    assert ordered_sum(rows).dtype == torch.float32
    stats = torch.tensor([[0.1, 2.0], [0.2, 3.0]], dtype=torch.float64)
    assert ordered_sum(stats).tolist() == [0.1 + 0.2, 5.0]
