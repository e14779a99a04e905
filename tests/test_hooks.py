"""Ready-made hooks: streaming probe recorders and interventions."""
import pytest
import torch

pytest.importorskip("transformer_lens", reason="the hooked model needs transformer-lens")

from qedprobe.hooks import DirectionReplacement, ProbeRecorder, RunningStats, scale_lambda, zero_direction
from qedprobe.model import hook_name, strength
from qedprobe.model.hooked import BLOCK_HOOKS, MIXER_HOOKS, MODEL_HOOKS

from helpers import ids, tiny


def test_running_stats_match_batch_statistics():
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(n, 5, 3, generator=gen) * (i + 1) for i, n in enumerate((1, 4, 7))]
    rs = RunningStats(3, edges=[-1.0, 0.0, 1.0])
    for c in chunks:
        rs.update(c)
    flat = torch.cat([c.reshape(-1, 3) for c in chunks]).double()
    assert rs.count.tolist() == [60.0] * 3
    torch.testing.assert_close(rs.mean, flat.mean(0))
    torch.testing.assert_close(rs.var, flat.var(0, unbiased=False))
    assert torch.equal(rs.min, flat.min(0).values) and torch.equal(rs.max, flat.max(0).values)
    expected = torch.stack([torch.bucketize(flat[:, h].contiguous(), torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64),
                                            right=True).bincount(minlength=4) for h in range(3)]).double()
    assert torch.equal(rs.counts, expected) and rs.counts.sum().item() == 180
    with pytest.raises(ValueError, match="last axis must be the 3 heads"):
        rs.update(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="strictly increasing"):
        RunningStats(3, edges=[1.0, 0.0])


def test_probe_recorder_streams_what_the_cache_holds():
    model = tiny()
    x1, x2 = ids(seed=1), ids(seed=2)
    rec = ProbeRecorder(model, probes=("e", "Sd", "lambda"), layers=[1], edges={"e": torch.linspace(0, 1, 11)})
    with rec.attach():
        model(x1)
        model(x2)
    assert not any(hp.has_hooks() for hp in model.hook_points())
    caches = [model.run_with_cache(x)[1] for x in (x1, x2)]
    e = torch.cat([c["blocks.1.attn.hook_e"].reshape(-1, 2) for c in caches]).double()
    sd = torch.cat([c["blocks.1.attn.hook_Sd"].norm(dim=-1).reshape(-1, 2) for c in caches]).double()
    torch.testing.assert_close(rec.stats[("e", 1)].mean, e.mean(0))
    torch.testing.assert_close(rec.stats[("Sd", 1)].max, sd.max(0).values)
    assert rec.stats[("e", 1)].counts.sum().item() == e.numel()
    torch.testing.assert_close(rec.stats[("lambda", 1)].mean, model.blocks[1].attn.lam().detach().double())
    assert set(rec.summary()) == {"e/1", "Sd/1", "lambda/1"}
    with pytest.raises(ValueError, match="`probes` must be"):
        ProbeRecorder(model, probes=("eig",))
    with pytest.raises(ValueError, match="`layers` must be"):
        ProbeRecorder(model, layers=[5])


def test_recorder_runs_inside_generate():
    model = tiny()
    rec = ProbeRecorder(model, probes=("rho",), layers=[0])
    with rec.attach():
        model.generate([[1, 2, 3], [4, 5]], 3)
    assert rec.stats[("rho", 0)].count.tolist() == [5 + 2 * 2] * 2  # prefill 5 tokens, 2 steps x 2


def test_scale_lambda_and_zero_direction_match_strength():
    model = tiny()
    x = ids()
    with strength(model, 0.5, layers=[0]):
        s_half = model(x)
    with strength(model, 0.0):
        s_zero = model(x)
    torch.testing.assert_close(model.run_with_hooks(x, fwd_hooks=[("blocks.0.attn.hook_lambda", scale_lambda(0.5))]),
                               s_half)
    zeroed = model.run_with_hooks(x, fwd_hooks=[(lambda n: n.endswith("hook_d"), zero_direction)])
    torch.testing.assert_close(zeroed, s_zero, rtol=0, atol=1e-6)


def test_direction_replacement_reproduces_the_rand_arm():
    rand = tiny("rand")
    full = tiny("full")
    full.load_state_dict({k: v for k, v in rand.state_dict().items() if not k.endswith(".z")}, strict=True)
    x = ids()
    hooks = []
    for l in range(2):
        hooks += DirectionReplacement(rand.blocks[l].attn.z).fwd_hooks([l])
    torch.testing.assert_close(full.run_with_hooks(x, fwd_hooks=hooks), rand(x), rtol=1e-5, atol=1e-6)
    assert (full(x) - rand(x)).abs().max() > 1e-4
    plain = DirectionReplacement(rand.blocks[0].attn.z, gate=False, project=False)
    with full.hooks(fwd_hooks=plain.fwd_hooks([0])):
        _, cache = full.run_with_cache(x, names_filter="blocks.0.attn.hook_d")
    torch.testing.assert_close(cache["blocks.0.attn.hook_d"], rand.blocks[0].attn.z.expand(2, 11, 2, 16))
    with pytest.raises(ValueError, match=r"`z` has shape \(2, 8\)"):
        full.run_with_hooks(x, fwd_hooks=DirectionReplacement(torch.ones(2, 8)).fwd_hooks([0]))


def test_hook_name_builds_every_hook_point_name():
    model = tiny()
    names = [hook_name(n) for n in MODEL_HOOKS]
    names += [hook_name(n, l) for l in range(model.cfg.num_hidden_layers) for n in BLOCK_HOOKS + MIXER_HOOKS]
    norms = ["norm"] + [f"blocks.{l}.{n}" for l in range(model.cfg.num_hidden_layers)
                        for n in ("attn_norm", "mlp_norm", "attn.o_norm")]
    assert sorted(names + [f"{n}.hook_scale" for n in norms]) == sorted(model.hook_dict)  # + each RMSNorm's scale
    assert hook_name("sd", 1) == "blocks.1.attn.hook_Sd" == hook_name("Sd", 1)
    assert hook_name("e", 3, "linear_attn") == "blocks.3.linear_attn.hook_e"
    for bad, match in ((("embed", 0), "takes no `layer`"), (("e",), "needs a `layer`"), (("E", 0), "`name` must be")):
        with pytest.raises(ValueError, match=match):
            hook_name(*bad)


def test_has_hook_reads_what_hook_point_has_hooks_reads():
    """``hookio.has_hook`` (the hook dicts, read at every decode step) answers as TransformerLens'
    ``HookPoint.has_hooks`` with its defaults, for both directions and forward only, with
    temporary and permanent hooks, before and after their removal; and counts torch's own hooks
    too, which ``has_hooks`` does not."""
    from transformer_lens.hook_points import HookPoint

    from qedprobe.model.hookio import has_hook
    hp = HookPoint()
    ours = lambda: (has_hook(hp), has_hook(hp, forward_only=True))  # noqa: E731
    lens = lambda: (hp.has_hooks(), hp.has_hooks(dir="fwd"))  # noqa: E731
    assert ours() == lens() == (False, False)
    hp.add_hook(lambda grad, hook: None, dir="bwd")
    assert ours() == lens() == (True, False)
    hp.add_hook(lambda x, hook: None, dir="fwd", is_permanent=True)
    assert ours() == lens() == (True, True)
    hp.remove_hooks(dir="bwd")
    assert ours() == lens() == (True, True)
    hp.remove_hooks(dir="both", including_permanent=True)
    assert ours() == lens() == (False, False)
    # torch's own hooks, which TransformerLens' lists do not hold, count too
    for register, want in ((hp.register_forward_hook, (True, True)), (hp.register_forward_pre_hook, (True, True)),
                           (hp.register_full_backward_hook, (True, False))):
        handle = register(lambda *args: None)
        assert ours() == want and lens() == (False, False)
        handle.remove()
        assert ours() == (False, False)


def test_torch_hooks_on_hook_points_fire_as_transformer_lens_hooks_do():
    """A hook put on a hook point with torch's ``register_forward_hook`` (or a pre-hook) sees and
    replaces what a TransformerLens hook there sees and replaces; the model counts as hooked (no
    fast path) while it is there."""
    from qedprobe.model.hooked import hooks_attached
    model = tiny()
    x = ids()
    _, cache = model.run_with_cache(x)
    seen = []
    handle = model.blocks[1].attn.hook_e.register_forward_hook(lambda mod, args, out: seen.append(out))
    assert hooks_attached(model)
    plain = model(x)
    handle.remove()
    assert not hooks_attached(model)
    torch.testing.assert_close(seen[0], cache["blocks.1.attn.hook_e"])
    torch.testing.assert_close(plain, model(x))
    turn = lambda q: q.roll(1, dims=-1)  # noqa: E731  (a new direction: q is L2-normalised in the op)
    want = model.run_with_hooks(x, fwd_hooks=[("blocks.0.attn.hook_q", lambda q, hook: turn(q))])
    assert (want - plain).abs().max() > 0.1
    for register, hook in ((model.blocks[0].attn.hook_q.register_forward_hook, lambda mod, args, out: turn(out)),
                           (model.blocks[0].attn.hook_q.register_forward_pre_hook, lambda mod, args: (turn(args[0]),))):
        handle = register(hook)
        torch.testing.assert_close(model(x), want)
        handle.remove()


def test_recurrence_points_are_its_registered_hook_points():
    """``HookedRecurrence.recur`` reads its hook points from a plain tuple (``RecurrencePoints``):
    each field is the submodule ``hook_<name>`` (``lam``: ``hook_lambda``) that TransformerLens
    names and hooks, in firing order, and a hook added by name reaches the op's probe request."""
    from transformer_lens.hook_points import HookPoint

    from qedprobe.model.recurrence import HookedRecurrence, RecurrencePoints
    rec = HookedRecurrence()
    points = rec.hook_points()
    assert isinstance(points, RecurrencePoints)
    registered = {name: m for name, m in rec.named_children() if isinstance(m, HookPoint)}
    assert len(registered) == len(points)
    for field, hp in zip(points._fields, points):
        assert registered["hook_lambda" if field == "lam" else f"hook_{field}"] is hp
    q, k = torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 4)
    v, g, b = torch.randn(1, 5, 2, 3), -torch.rand(1, 5, 2), torch.rand(1, 5, 2)
    seen = []
    rec.hook_e.add_hook(lambda x, hook: seen.append(x.shape))
    rec.recur(q, k, v, g, b, b, torch.full((2,), 0.1), arm="full", mode="naive")
    assert seen == [torch.Size([1, 5, 2])]
