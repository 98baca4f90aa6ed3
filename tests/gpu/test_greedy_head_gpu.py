"""The screened greedy LM head on CUDA at real heads (Qwen3-0.6B's and Llama 3 8B's, random weights as
load_format="dummy" draws them; bf16 and fp16): the token of head_linear + argmax, over many inputs, ties and
near-ties included, inside a CUDA graph too. Skipped as a whole without CUDA."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagedllm.ops.triton import fused, greedy_head  # noqa: E402

DEV = "cuda"
HEADS = [(151936, 1024), (128256, 4096)]


def _expected(x, weight):
    return fused.argmax(fused.head_linear(x, weight))


@pytest.fixture(scope="module", params=HEADS, ids=["qwen3-0.6b", "llama3-8b"])
def head(request):
    vocab, hidden = request.param
    gen = torch.Generator(device=DEV).manual_seed(0)
    weight = (0.02 * torch.randn(vocab, hidden, generator=gen, device=DEV)).to(torch.bfloat16)
    return weight, greedy_head.ScreenedHead(weight)


@torch.inference_mode()
def test_greedy_is_head_linears_argmax(head):
    weight, screen = head
    gen = torch.Generator(device=DEV).manual_seed(1)
    for _ in range(200):
        x = torch.randn(1, weight.shape[1], generator=gen, device=DEV).to(weight.dtype)
        assert torch.equal(screen.greedy(x), _expected(x, weight))


@torch.inference_mode()
def test_ties_near_ties_and_a_graph(head):
    """Copies of the winning row (the first wins) and rows within an int8 step of it; the kernels replayed in a
    CUDA graph give the same tokens for new inputs."""
    weight, _ = head
    gen = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(1, weight.shape[1], generator=gen, device=DEV).to(weight.dtype)
    top = min(int(_expected(x, weight)), weight.shape[0] - 4)
    edited = weight.clone()
    edited[top + 1:top + 3] = weight[top]  # later copies lose the tie
    screen = greedy_head.ScreenedHead(edited)
    assert int(screen.greedy(x)) == int(_expected(x, edited)) == top
    edited[5] = weight[top]  # an earlier copy wins it
    edited[top + 3] = weight[top] * (1 + 2.0 ** -7)  # a hair larger, within an int8 code's step
    screen = greedy_head.ScreenedHead(edited)
    assert torch.equal(screen.greedy(x), _expected(x, edited))
    out = torch.empty(1, dtype=torch.int64, device=DEV)
    screen.greedy(x, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        screen.greedy(x, out)
    for _ in range(10):
        x.copy_(torch.randn(x.shape, generator=gen, device=DEV))
        graph.replay()
        assert torch.equal(out, _expected(x, edited))


@torch.inference_mode()
def test_fp16_head():
    gen = torch.Generator(device=DEV).manual_seed(3)
    weight = (0.02 * torch.randn(151936, 1024, generator=gen, device=DEV)).half()
    screen = greedy_head.ScreenedHead(weight)
    for _ in range(50):
        x = torch.randn(1, 1024, generator=gen, device=DEV).half()
        assert torch.equal(screen.greedy(x), _expected(x, weight))
