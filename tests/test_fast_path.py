"""The fast inference path (``qedprobe.model.fast``) against the plain path: the masked packed
convolution, the fused regions uncompiled (float32: the same numbers), compiled by inductor
(float32 to rounding, the same greedy tokens), where it is left for the plain path, and how
often it compiles."""
from pathlib import Path

import pytest
import torch

from helpers import saved_tiny_model, tiny, tiny_model
from qedprobe import cli as commands
from qedprobe.eval import SweepError, SweepSpec, load_results, plan, run_sweep, sweep
from qedprobe.eval.sweep import sweep_fast_path
from qedprobe.model import QEDModel, fast_path, strength
from qedprobe.model.decode_step import decode_graphs, decode_step
from qedprobe.model.fast import TokenLayout, conv_silu, fast_path_setting, mixer_inputs, stacked_weights
from qedprobe.model.layers import ShortConvolution
from qedprobe.model.packing import pack_prompts

SWEEP = dict(lengths=[400], strengths=[0.0, 1.0], samples=3, batch_size=2, progress=False, task_format="legacy")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled GPU path needs CUDA")
PROMPTS = [[5, 17, 33, 2, 8, 61, 90], [44], [7, 7, 12], list(range(1, 40)), [3, 9]]
CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "recall-full-s1"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch (what it counts), and no test inherits another's graphs."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def passes(model, prompts, steps=3):
    """The packed prefill's logits and states, then the logits of ``steps`` decode steps (graph
    steps on CUDA) fed fixed tokens (so two paths always see the same inputs), under
    ``torch.inference_mode``."""
    packed = pack_prompts(prompts, model.cfg.vocab_size, model.device)
    with torch.inference_mode():
        logits, states = model.run_blocks(packed.ids, states=None, cu_seqlens=packed.cu_seqlens, scales=None,
                                          want_state=True, logit_positions=packed.last_positions)
        step, out = decode_step(model, states, None), [logits[0]]
        for i in range(steps):
            tokens = (torch.arange(len(prompts), device=model.device) * 7 + 3 * i) % model.cfg.vocab_size
            out.append(step(tokens).clone())
    return out, states


def assert_states_close(a, b, **tol):
    for sa, sb in zip(a, b, strict=True):
        torch.testing.assert_close(sa.recurrent, sb.recurrent, **tol)
        for ca, cb in zip(sa.conv, sb.conv, strict=True):
            torch.testing.assert_close(ca, cb, **tol)


class Graphs:
    """A ``torch.compile`` backend that runs the captured graphs as they are and counts them."""

    def __init__(self):
        self.count = 0

    def __call__(self, gm, example_inputs):
        self.count += 1
        return gm.forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_packed_convolution_equals_the_plain_one(dtype):
    torch.manual_seed(0)
    conv = ShortConvolution(16, 4, bias=True).to(dtype)
    torch.nn.init.normal_(conv.bias)
    cu = torch.tensor([0, 1, 3, 10, 23], dtype=torch.int32)  # sequences of 1, 2, 7 and 13 tokens
    x = torch.randn(1, 23, 16, dtype=dtype)
    y, tail = conv_silu(x, conv.weight, conv.bias, None, TokenLayout.packed(cu, 23, 4))
    y_ref, tail_ref = conv(x, None, cu)
    torch.testing.assert_close(y, y_ref, rtol=2.5e-7, atol=1e-7)  # CPU silu: SIMD body vs scalar tail
    assert torch.equal(tail, tail_ref) and tail[0, :, :2].abs().sum() == 0  # 1 token: 2 zero slots
    cache = torch.randn(3, 16, 3, dtype=dtype)
    rows = torch.randn(3, 5, 16, dtype=dtype)
    for got, want in zip(conv_silu(rows, conv.weight, conv.bias, cache, None), conv(rows, cache)):
        torch.testing.assert_close(got, want, rtol=2.5e-7, atol=1e-7)


@pytest.mark.parametrize("backend", [None, "inductor"])
def test_pre_region_writes_the_decode_step_caches_in_place(backend):
    model = tiny(vocab_size=97)
    block = model.blocks[0]
    mixer = block.attn
    convs = tuple((c.weight, c.bias) for c in (mixer.q_conv1d, mixer.k_conv1d, mixer.v_conv1d))
    torch.manual_seed(2)
    x = torch.randn(3, 1, model.cfg.hidden_size)
    caches = tuple(torch.randn(3, w.shape[0], w.shape[-1] - 1) for w, _ in convs)
    region = mixer_inputs if backend is None else torch.compile(mixer_inputs, backend=backend, fullgraph=True)

    def run(caches, in_place):
        with torch.inference_mode():
            return region(block, x, stacked_weights(block)[0], caches, None, in_place)
    before = tuple(c.clone() for c in caches)
    new = run(caches, False)
    assert all(torch.equal(c, b) for c, b in zip(caches, before))  # not in place: the caches stay
    got = run(caches, True)
    for a, b in zip(got[:7], new[:7], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for cache, out, want, old in zip(caches, got[-1], new[-1], before, strict=True):
        assert out is cache  # the region returns the caches it wrote
        torch.testing.assert_close(cache, want, rtol=0, atol=0)
        assert torch.equal(cache[..., :-1], old[..., 1:])  # one token in: the window moved by one


@pytest.mark.parametrize("arm, s", [("full", 1.5), ("gdn2", 1.0), ("rand", -1.0)])
def test_uncompiled_fast_path_computes_what_the_plain_path_does(arm, s):
    model = tiny(arm, vocab_size=97)
    with strength(model, s):
        plain, plain_states = passes(model, PROMPTS)
        tokens = model.generate(PROMPTS, 6)
        with fast_path(model, backend=None):
            fast, fast_states = passes(model, PROMPTS)
            with torch.inference_mode():
                assert model.generate(PROMPTS, 6) == tokens
    for a, b in zip(fast, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert_states_close(fast_states, plain_states, rtol=1e-6, atol=1e-6)


def test_uncompiled_fast_path_runs_unpacked_rows_as_the_plain_path():
    model = tiny(vocab_size=97)
    ids = torch.randint(0, 97, (3, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids)
        with fast_path(model, backend=None):
            fast = model(ids)
    torch.testing.assert_close(fast, plain, rtol=1e-6, atol=1e-6)


def test_inductor_fast_path_matches_the_plain_path_in_float32():
    model = tiny(vocab_size=97)
    plain, plain_states = passes(model, PROMPTS)
    with fast_path(model):
        fast, fast_states = passes(model, PROMPTS)
        with torch.inference_mode():
            tokens = model.generate(PROMPTS, 4)
    for a, b in zip(fast, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)
    assert_states_close(fast_states, plain_states, rtol=1e-5, atol=1e-5)
    assert tokens == model.generate(PROMPTS, 4)


def test_compiles_once_per_layout_over_lengths_and_batch_sizes():
    model = tiny(vocab_size=97)
    graphs, gen = Graphs(), torch.Generator().manual_seed(0)
    seen = []
    for n, length in ((4, 30), (3, 50), (5, 20), (2, 64)):
        prompts = [torch.randint(1, 97, (length + i,), generator=gen).tolist() for i in range(n)]
        with fast_path(model, backend=graphs), torch.inference_mode():
            assert model.generate(prompts, 5) == model.generate(prompts, 5, cuda_graph=False)
        seen.append(graphs.count)
    assert seen == [4, 4, 4, 4]  # pre and post region, each for the packed prefill and the decode step


def test_hooks_grad_and_packed_states_take_the_plain_path():
    model = tiny(vocab_size=97)
    graphs, fired = Graphs(), []
    packed = pack_prompts(PROMPTS, 97, model.device)
    with fast_path(model, backend=graphs):
        with model.hooks(fwd_hooks=[("blocks.1.attn.hook_v", lambda v, hook: fired.append(v.shape))]), \
                torch.inference_mode():
            model.generate(PROMPTS, 3)
        assert graphs.count == 0 and len(fired) == len(set(map(len, PROMPTS))) + 2
        model(torch.tensor([PROMPTS[0]]))  # grad mode on: plain
        assert graphs.count == 0
        with torch.inference_mode():
            _, states = model.run_blocks(packed.ids, states=None, cu_seqlens=packed.cu_seqlens, scales=None,
                                         want_state=True)
            assert graphs.count == 2
            model.run_blocks(packed.ids, states=states, cu_seqlens=packed.cu_seqlens, scales=None,
                             want_state=True)  # continuing packed sequences: plain
            assert graphs.count == 2
    before = torch._dynamo.config.recompile_limit
    with fast_path(model):  # every layout, dtype and model shape of a process fits under the limit
        assert torch._dynamo.config.recompile_limit == max(before, 64)
    assert torch._dynamo.config.recompile_limit == before
    with pytest.raises(ValueError, match="`backend` must be"):
        with fast_path(model, backend=3):
            pass
    with pytest.raises(ValueError, match="has no fast path"):
        with fast_path(torch.nn.Linear(2, 2)):
            pass


def test_stacked_weights_follow_in_place_edits():
    model = tiny(vocab_size=97)
    first = stacked_weights(model.blocks[0])
    assert stacked_weights(model.blocks[0])[0] is first[0]
    with torch.no_grad():
        model.blocks[0].attn.k_proj.weight.mul_(3.0)
        model.blocks[1].mlp.up_proj.weight.add_(0.5)
    assert stacked_weights(model.blocks[0])[0] is not first[0]
    plain, _ = passes(model, PROMPTS, steps=1)
    with fast_path(model, backend=None):
        fast, _ = passes(model, PROMPTS, steps=1)
    for a, b in zip(fast, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_sweep_on_the_fast_path_writes_the_plain_rows(tmp_path):
    model = tiny_model()
    plain = run_sweep(model, SweepSpec(**SWEEP), out=tmp_path / "plain")
    fast = run_sweep(model, SweepSpec(fast_path="eager", **SWEEP), out=tmp_path / "fast")  # dynamo, not compiled
    assert (plain.fast_path, fast.fast_path, plain.missing, fast.missing) == (None, "eager", 0, 0)
    assert load_results(tmp_path / "fast") == load_results(tmp_path / "plain")
    assert sweep_fast_path(model, None) is None and sweep_fast_path(model, True) == "inductor"  # CPU: plain
    with pytest.raises(SweepError, match="has no fast path"):
        sweep_fast_path(torch.nn.Linear(2, 2), True)
    with pytest.raises(SweepError, match="fast_path must be"):
        sweep_fast_path(model, 2)


def test_default_fast_path_that_fails_to_compile_falls_back_to_the_plain_path(tmp_path, monkeypatch):
    """The default fast path (CUDA's, here forced on CPU with dynamo's uncompiled backend) that
    fails to compile after a first batch: a warning, and the remaining rows from the plain path,
    equal to a plain sweep's. An explicitly requested fast path that fails raises."""
    model = tiny_model()
    run_sweep(model, SweepSpec(**SWEEP), out=tmp_path / "plain")
    default = sweep.sweep_fast_path
    monkeypatch.setattr(sweep, "sweep_fast_path", lambda m, fp: "eager" if fp is None else default(m, fp))
    real_run_batch, calls = sweep.run_batch, []

    def failing_second_batch(model, *args, **kwargs):
        calls.append(fast_path_setting(model) is not None)
        if calls == [True, True]:
            raise torch._dynamo.exc.InternalTorchDynamoError("simulated compile failure")
        return real_run_batch(model, *args, **kwargs)
    monkeypatch.setattr(sweep, "run_batch", failing_second_batch)
    with pytest.warns(RuntimeWarning, match="fast path did not compile .*simulated compile failure"):
        result = run_sweep(model, SweepSpec(**SWEEP), out=tmp_path / "fallback")
    assert result.fast_path is None and result.missing == 0 and calls == [True, True, False]
    assert load_results(tmp_path / "fallback") == load_results(tmp_path / "plain")
    calls.clear()
    with pytest.raises(torch._dynamo.exc.InternalTorchDynamoError):
        run_sweep(model, SweepSpec(fast_path="eager", **SWEEP), out=tmp_path / "explicit")


def test_sweep_time_limit_stops_between_batches_and_resumes(tmp_path):
    model = tiny_model()
    stopped = run_sweep(model, SweepSpec(time_limit=0, **SWEEP), out=tmp_path / "s")
    assert stopped.missing == 6 and not (tmp_path / "s" / "results.jsonl").exists()
    done = run_sweep(model, SweepSpec(**SWEEP), out=tmp_path / "s")
    assert done.missing == 0 and len(load_results(tmp_path / "s")) == 6


@pytest.mark.parametrize("flags, fast, graph", [([], None, True), (["--eager"], False, False),
                                                (["--eager-decode"], None, False)])
def test_cli_eager_forces_the_plain_path(tmp_path, monkeypatch, flags, fast, graph):
    seen = {}

    def fake_run_sweep(model, spec, out):
        seen.update(fast_path=spec.fast_path, cuda_graph=spec.cuda_graph)
        return sweep.SweepResult([], {"model_s": 0.0, "prefill_tokens_per_s": 0.0})
    monkeypatch.setattr(sweep, "run_sweep", fake_run_sweep)
    model = saved_tiny_model(tmp_path / "m")
    assert commands.main(["sweep", "--model", model, "--device", "cpu", "--out", str(tmp_path / "o"),
                          "--lengths", "400", "--strengths=0,1", "--samples", "2", "--format", "legacy",
                          "--no-progress", *flags]) == 0
    assert (seen["fast_path"], seen["cuda_graph"]) == (fast, graph)


@cuda
def test_gpu_fast_path_matches_plain_and_its_graph_replays_its_steps():
    model = tiny(vocab_size=97).cuda().to(torch.bfloat16)
    plain, _ = passes(model, PROMPTS)
    with fast_path(model):
        fast, _ = passes(model, PROMPTS)
        with torch.inference_mode():
            graph = model.generate(PROMPTS, 10)
            assert model.generate(PROMPTS, 10, cuda_graph=False) == graph
    for a, b in zip(fast, plain, strict=True):  # bf16: a few roundings apart
        torch.testing.assert_close(a.float(), b.float(), rtol=0.03, atol=0.03 * b.abs().max().item())
    assert len(decode_graphs(model)) == 2  # one graph per path: the key holds the fast path's weights
    with torch.inference_mode():
        assert model.generate(PROMPTS, 10) == model.generate(PROMPTS, 10, cuda_graph=False)
    assert len(decode_graphs(model)) == 2  # the plain graph again, not the fast one


@cuda
def test_gpu_fast_path_gives_a_trained_model_the_same_answers():
    model = QEDModel.from_pretrained(CHECKPOINT, dtype=torch.bfloat16, device="cuda").eval()
    from qedprobe.tasks import NIAHTask
    task = NIAHTask("s-niah-1", "bytes")  # the legacy format it was trained on
    samples = task.samples(1024, 16)
    with torch.inference_mode():
        plain = model.generate([s.input_ids for s in samples], 11, return_type="new_tokens")
        with fast_path(model):
            fast = model.generate([s.input_ids for s in samples], 11, return_type="new_tokens")
    found = [[s.answer in task.tokenizer.decode(t) for s, t in zip(samples, out)] for out in (plain, fast)]
    assert found[0] == found[1] and sum(found[0]) >= 8  # the same answers, and it does retrieve
    assert sum(a[:8] == b[:8] for a, b in zip(plain, fast)) >= 15  # bf16 rounding may flip a near tie


@cuda
def test_gpu_cli_sweep_takes_the_fast_path_unless_eager(tmp_path, capsys):
    model = saved_tiny_model(tmp_path / "m")
    argv = ["sweep", "--model", model, "--out", str(tmp_path / "o"), "--lengths", "400", "--strengths=0,1",
            "--samples", "4", "--format", "legacy", "--no-progress"]
    assert commands.main(argv) == 0
    assert "fast path (inductor)" in capsys.readouterr().out
    assert commands.main([*argv[:4], str(tmp_path / "e"), *argv[5:], "--eager"]) == 0
    assert "plain path" in capsys.readouterr().out
    assert load_results(tmp_path / "o") and len(load_results(tmp_path / "e")) == 8
    assert 2 ** 14 <= plan.memory_batch_tokens(tiny_model().cuda()) <= plan.MAX_BATCH_TOKENS
