"""The host-sync-free generate path: packed convolution, packed prompts, decode budget from the
task, and (CUDA only) the CUDA-graph decode step against the eager one, bit for bit."""
import json

import pytest
import torch

from helpers import tiny, tiny_model
from qedprobe.eval import SweepError, SweepSpec, load_results, run_sweep
from qedprobe.tasks import NIAHTask
from qedprobe.model import strength
from qedprobe.model.layers import ShortConvolution
from qedprobe.model.decode_step import decode_graphs, graph_usable
from qedprobe.model.packing import pack_prompts

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
PROMPTS = [[5, 17, 33, 2, 8, 61, 90], [44], [7, 7, 12]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_cache", [False, True])
def test_packed_convolution_equals_one_sequence_at_a_time(dtype, with_cache):
    torch.manual_seed(0)
    conv = ShortConvolution(16, 4, bias=True).to(dtype)
    torch.nn.init.normal_(conv.bias)
    cu = torch.tensor([0, 1, 3, 10, 23], dtype=torch.int32)
    x = torch.randn(1, 23, 16, dtype=dtype)
    cache = torch.randn(4, 16, 3, dtype=dtype) if with_cache else None
    y, tail = conv(x, cache, cu)
    b = cu.tolist()
    parts = [conv(x[:, b[n]:b[n + 1]], None if cache is None else cache[n:n + 1]) for n in range(4)]
    # CPU silu (float32 inside): SIMD body and scalar tail may differ in the last bit
    torch.testing.assert_close(y, torch.cat([p[0] for p in parts], 1), rtol=2.5e-7, atol=1e-7)
    assert torch.equal(tail, torch.cat([p[1] for p in parts], 0))


def test_packed_prompts_are_checked_once_and_reusable():
    model = tiny()
    packed = pack_prompts(PROMPTS, model.cfg.vocab_size, model.device)
    assert packed.lengths == (7, 1, 3) and packed.cu_seqlens.tolist() == [0, 7, 8, 11]
    assert model.generate(packed, 5) == model.generate(PROMPTS, 5) == model.generate(PROMPTS, 5, cuda_graph=False)
    with pytest.raises(ValueError, match="checked for vocab"):
        tiny(vocab_size=50).generate(packed, 2)
    with pytest.raises(ValueError, match="must be ints"):
        model.generate([[1, 2.0]], 2)
    with pytest.raises(ValueError, match="must be ints"):
        model.generate([[1, True]], 2)


def test_graph_step_only_on_cuda_without_hooks():
    model = tiny()
    assert not graph_usable(model)  # CPU: the eager step


def test_answer_tokens_follow_the_task():
    task = NIAHTask("s-niah-1", "bytes")
    samples = task.samples(400, 3)
    assert task.answer_tokens(samples) == len(" 1234567.") + 2 == 11
    assert NIAHTask("s-niah-1", "bytes", max_new_tokens=8).answer_tokens(samples) == 8
    with pytest.raises(ValueError, match="no samples"):
        task.answer_tokens([])


def test_sweep_decoding_the_answer_is_a_prefix_of_the_budget_run(tmp_path):
    model = tiny_model()
    kw = dict(lengths=[400], strengths=[0.0, 1.0], samples=2, progress=False, task_format="legacy")
    run_sweep(model, SweepSpec(**kw), out=tmp_path / "budget")
    run_sweep(model, SweepSpec(decode="answer", **kw), out=tmp_path / "answer")
    full, short = load_results(tmp_path / "budget"), load_results(tmp_path / "answer")
    assert [r["sample_id"] for r in full] == [r["sample_id"] for r in short]
    for a, b in zip(full, short):
        assert a["prediction"].startswith(b["prediction"]) and b["new_tokens"] <= 11
    assert "decode" not in json.loads((tmp_path / "budget" / "config.json").read_text())
    with pytest.raises(SweepError, match="different decode"):
        run_sweep(model, SweepSpec(decode="answer", **kw), out=tmp_path / "budget")
    with pytest.raises(SweepError, match="decode must be"):
        run_sweep(model, SweepSpec(decode="some", **kw), out=tmp_path / "x")


@cuda
def test_cuda_graph_decode_is_bit_identical_to_eager():
    model = tiny(vocab_size=97).cuda()
    for s in (1.5, 0.5, 1.5):  # the third call reuses the captured graph with new factors
        with strength(model, s):
            eager = model.generate(PROMPTS, 12, cuda_graph=False)
            assert graph_usable(model)
            assert model.generate(PROMPTS, 12) == eager
    assert len(decode_graphs(model)) == 1
    seen = []
    with model.hooks(fwd_hooks=[("blocks.0.attn.hook_lambda", lambda lam, hook: seen.append(lam))]):
        assert not graph_usable(model)
        model.generate(PROMPTS, 4)
    assert len(seen) == 6  # one prefill per prompt length + three eager decode steps: hooks still fire


@cuda
def test_cuda_graph_stops_at_eos_as_eager_does():
    model = tiny(vocab_size=97).cuda()
    x = torch.tensor([[5, 17, 33], [7, 7, 12]], device="cuda")
    free = model.generate(x, 12, cuda_graph=False, return_type="new_tokens")
    eos = [free[0][1], free[1][2]]  # both rows stop early, at different steps
    eager = model.generate(x, 12, eos_token_id=eos, cuda_graph=False)
    assert graph_usable(model)
    assert torch.equal(model.generate(x, 12, eos_token_id=eos), eager)
    assert model.generate(x, 12, eos_token_id=eos, return_type="new_tokens") == \
        model.generate(x, 12, eos_token_id=eos, cuda_graph=False, return_type="new_tokens")


@cuda
def test_cuda_graph_logits_equal_eager_logits():
    from qedprobe.model.decode_step import decode_step

    model = tiny(vocab_size=97).cuda()
    packed = pack_prompts(PROMPTS, 97, model.device)
    with torch.no_grad():
        _, states = model.run_blocks(packed.ids, states=None, cu_seqlens=packed.cu_seqlens, scales=None,
                                     want_state=True)
        eager, graph = decode_step(model, states, None, cuda_graph=False), decode_step(model, states, None)
        tokens = torch.tensor([3, 4, 5], device="cuda")
        for _ in range(5):
            a, b = eager(tokens), graph(tokens)
            assert torch.equal(a, b)
            tokens = a.argmax(-1)
