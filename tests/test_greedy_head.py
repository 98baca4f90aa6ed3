"""The screened greedy LM head (pagedllm.ops.triton.greedy_head) against head_linear + argmax, on CPU under the
Triton interpreter (float16): the same token, ties and near-ties below the int8 codes' resolution
included, and a screen whose bounds hold and are tight enough to leave few rows to recompute.
tests/gpu/test_greedy_head_gpu.py runs the same checks in bfloat16 at Qwen3-0.6B's head."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagedllm.ops.triton import fused, greedy_head, linear  # noqa: E402

VOCAB, HIDDEN = 4352, 256  # five pick programs (1024 rows), the last ragged


def _head(seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return (torch.randn(vocab, HIDDEN, generator=torch.Generator().manual_seed(seed)) / 16).half()


def _expected(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return fused.argmax(linear.head_linear(x, weight))


def test_greedy_is_head_linears_argmax():
    weight = _head(1)
    screen = greedy_head.ScreenedHead(weight)
    gen = torch.Generator().manual_seed(10)
    for _ in range(4):
        x = torch.randn(1, HIDDEN + 8, generator=gen).half()[:, 8:]
        assert torch.equal(screen.greedy(x), _expected(x, weight))


def test_ties_and_near_ties_go_to_the_first_row():
    """Rows equal to the winner, or apart from it by less than an int8 code can tell, are screened in and the
    first of the logits that round equal wins, as in head_linear's argmax; across pick chunks too."""
    weight = _head(5)
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(6)).half()
    top = int(_expected(x, weight))
    tied = weight.clone()
    tied[[7, 3000, 4351]] = weight[top]  # exact copies, one before the winner in another chunk
    screen = greedy_head.ScreenedHead(tied)
    assert int(screen.greedy(x)) == int(_expected(x, tied)) == min(7, top)
    near = weight.clone()
    j = int(x.abs().argmax())
    near[2100] = near[top]
    near[2100, j] += torch.sign(x[0, j]).half() * near[top, j].abs().clamp(min=1e-2) * 2.0 ** -8
    screen = greedy_head.ScreenedHead(near)
    codes = screen.codes.view(torch.uint8)
    assert torch.equal(codes[2100], codes[top])  # the screen cannot tell them apart
    assert int(screen.greedy(x)) == int(_expected(x, near))


def test_screen_bounds_hold_and_prune():
    """Every logit lies within the screen's bounds, and the rows that could hold the largest are few."""
    weight = _head(8)
    screen = greedy_head.ScreenedHead(weight)
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(9)).half()
    hi, threshold = screen.bounds(x)
    exact = (x.double() @ weight.double().T)[0]
    assert (exact <= hi.double()).all()
    assert threshold <= exact.max()
    passed = int((hi >= threshold - abs(threshold) * greedy_head.MARGIN[torch.float16]).sum())
    assert 1 <= passed <= 16, passed
    assert (screen.top == float("-inf")).all()  # ready for the next step


def test_zero_rows_and_bad_input():
    weight = _head(11, vocab=192)
    weight[:64] = 0  # a zero scale: codes 0, bound 0
    screen = greedy_head.ScreenedHead(weight)
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(12)).half()
    assert torch.equal(screen.greedy(x), _expected(x, weight))
    with pytest.raises(ValueError, match="one row"):
        screen.greedy(torch.zeros(2, HIDDEN, dtype=torch.float16))
    with pytest.raises(ValueError, match="not one"):
        greedy_head.ScreenedHead(weight[:100])
