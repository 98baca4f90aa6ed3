"""The screened greedy LM head (pagedllm.ops.triton.greedy_head) against head_linear + argmax, on CPU under the
Triton interpreter (float16): the same token, ties and near-ties below the int8 codes' resolution included, logits
that round to equal subnormals or overflow to infinity, and a screen whose bounds hold and are tight enough to leave
few rows to recompute. tests/gpu/test_greedy_head_gpu.py compares the tokens in bfloat16 and float16 at Qwen3-0.6B's
and Llama 3 8B's heads."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagedllm.ops.triton import fused, greedy_head, linear  # noqa: E402

VOCAB, HIDDEN = 4416, 256  # 5 pick programs of 16 head tiles (greedy_head.HEAD_CONFIGS), the last one of 5


def _head(seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return (torch.randn(vocab, HIDDEN, generator=torch.Generator().manual_seed(seed)) / 16).half()


def _expected(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return fused.argmax(linear.head_linear(x, weight))


def test_greedy_is_head_linears_argmax():
    weight = _head(1)
    screen = greedy_head.ScreenedHead(weight)
    gen = torch.Generator().manual_seed(10)
    for _ in range(2):  # each ~17 s under the interpreter
        x = torch.randn(1, HIDDEN + 8, generator=gen).half()[:, 8:]
        assert torch.equal(screen.greedy(x), _expected(x, weight))


def test_ties_and_near_ties_go_to_the_first_row():
    """Rows equal to the winner, or apart from it by less than an int8 code can tell, are screened in and the
    first of the logits that round equal wins, as in head_linear's argmax; across pick chunks too."""
    weight = _head(5)
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(6)).half()
    top = int(_expected(x, weight))
    tied = weight.clone()
    tied[[7, 3000, 4415]] = weight[top]  # exact copies, one before the winner in another pick program
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
    """Every logit, exact and as head_linear sums it, lies below the screen's upper bound, T below the largest, and
    the rows that could hold the largest are few; greedy() leaves the slots of T at -inf for the next step."""
    weight = _head(8)
    screen = greedy_head.ScreenedHead(weight)
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(9)).half()
    hi, t = screen.bounds(x)
    exact = (x.double() @ weight.double().T)[0]
    summed = linear.head_linear(x, weight).double()[0]  # rounded to float16: within its rounding of the sum
    assert (exact <= hi.double()).all() and (summed <= hi.double() * (1 + 2.0 ** -10) + 2.0 ** -24).all()
    assert t <= exact.max()
    passed = int((hi >= greedy_head.threshold(t, torch.float16)).sum())
    assert 1 <= passed <= 16, passed
    screen.top.fill_(0.0)
    screen.greedy(x)
    assert (screen.top == float("-inf")).all()


def test_bounds_take_in_the_fixed_point_rounding():
    """The screen sums x in fixed point, 2^-14 units of its largest |x_j| here (1.0): inputs of 1.5 units round up by
    half a unit each, and rows that int8 codes hold exactly (no code error) all weigh them -64 / 128, so the screen's
    sum lies below the logit by 255 x 0.5 x 2^-14 x 0.5, about 0.0039. Only the fixed point's term in the bound
    covers that; with it, Cauchy-Schwarz is tight here."""
    weight = torch.full((64, HIDDEN), -0.5, dtype=torch.float16)
    weight[:, 0] = 127 / 128
    x = torch.full((1, HIDDEN), 1.5 * 2.0 ** -14, dtype=torch.float16)
    x[0, 0] = 1.0
    screen = greedy_head.ScreenedHead(weight)
    hi, t = screen.bounds(x)
    exact = (x.double() @ weight.double().T)[0]
    assert (exact <= hi.double()).all() and t <= exact.max()
    assert torch.equal(screen.greedy(x), _expected(x, weight))


# (x's one nonzero input, row 0's weight there, row 100's): logits 2^-20 - 2^-26 and 2^-20 (both 2^-20 in float16,
# whose subnormals are 2^-24 apart), and ~7e4 and ~1.3e6 (both infinity)
@pytest.mark.parametrize("x0,w0,w100", [(2.0 ** -10, 2.0 ** -10 - 2.0 ** -16, 2.0 ** -10), (256.0, 273.5, 5078.0)],
                         ids=["subnormal", "overflow"])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's, meant
def test_logits_that_round_alike_outside_the_normal_range(x0, w0, w100):
    """float16 logits among the subnormals (a fixed unit apart, not a relative one) or past its largest value tie
    once rounded: the first row wins, as in head_linear's argmax, though the screen ranks the later one higher."""
    x = torch.zeros(1, 128, dtype=torch.float16)
    x[0, 0] = x0
    weight = torch.zeros(256, 128, dtype=torch.float16)
    weight[0, 0], weight[100, 0] = w0, w100  # int8 codes of 127, exact
    logits = linear.head_linear(x, weight)[0]
    assert logits[0] == logits[100] and logits[0] > 0
    assert int(greedy_head.ScreenedHead(weight).greedy(x)) == int(_expected(x, weight)) == 0


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
