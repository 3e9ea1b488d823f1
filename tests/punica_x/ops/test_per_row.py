"""ops.per_row: a row's result alone equals its result among other rows, with fixed_order;
without it, the call is one torch call over all rows."""

from __future__ import annotations

import torch

from punica_x.ops import per_row


def test_each_row_is_computed_as_if_alone():
    torch.manual_seed(0)
    x = torch.randn(100, 1)
    got = per_row.rows(torch.sigmoid, x, True)
    assert got.shape == (100, 1)
    for i in range(100):
        assert torch.equal(got[i], torch.sigmoid(x[i : i + 1])[0]), i


def test_products_a_row_at_a_time_equal_the_one_row_products():
    torch.manual_seed(1)
    x, a, b = torch.randn(37, 64), torch.randn(64, 8), torch.randn(8, 48)
    got = per_row.products(x, [a, b], True)
    assert torch.allclose(got, x @ a @ b, atol=1e-4)
    for i in range(37):
        assert torch.equal(got[i], (x[i : i + 1] @ a @ b)[0]), i


def test_without_fixed_order_it_is_one_call():
    calls = []

    def fn(t):
        calls.append(t.shape[0])
        return t * 2

    x = torch.randn(5, 3)
    assert torch.equal(per_row.rows(fn, x, False), x * 2) and calls == [5]
    calls.clear()
    assert torch.equal(per_row.rows(fn, x, True), x * 2) and calls == [1] * 5
    empty = torch.empty(0, 3)
    assert per_row.rows(fn, empty, True).shape == (0, 3)
