"""`qedprobe eig`: closed-form sigma_max, histogram totals, projected arms in (0, 1), bounded memory."""
import json

import numpy as np
import pytest
import torch

from helpers import saved_tiny_model, tiny, tiny_model
from qedprobe import cli as commands
from qedprobe.eval.eig import BINS, EigAccumulator, run_eig, sigma_max_rank_one, task_batches, text_batches


def test_sigma_max_digest_example():
    # k=(1,0), b=(0.5,0.5), q=(0,1), lambda=0.2: M = [[0.5, -0.1], [0, 1]], spectrum {0.5, 1}
    k = torch.tensor([1.0, 0.0], dtype=torch.float64)
    a = torch.tensor([0.5, 0.1], dtype=torch.float64)
    M = torch.eye(2, dtype=torch.float64) - torch.outer(k, a)
    sv = torch.linalg.svdvals(M)
    assert float(sigma_max_rank_one(k, a)) == pytest.approx(float(sv[0]), abs=1e-14)
    assert float(sigma_max_rank_one(k, a)) > 1.0 > 0.5   # norm > 1 although |eigenvalues| <= 1
    assert float(sigma_max_rank_one(k, a)) >= float(torch.linalg.norm(M @ torch.tensor([0.0, 1.0], dtype=torch.float64)))


@pytest.mark.parametrize("K", [2, 3, 16, 64])
def test_sigma_max_matches_svdvals(K):
    g = torch.Generator().manual_seed(K)
    n = 200 if K < 32 else 40
    k = torch.randn(n, K, generator=g, dtype=torch.float64)
    k[: n // 2] = k[: n // 2] / k[: n // 2].norm(dim=-1, keepdim=True)           # unit keys
    a = torch.randn(n, K, generator=g, dtype=torch.float64) * torch.rand(n, 1, generator=g, dtype=torch.float64) * 2
    a[:10] = 0.7 * k[:10]                                                         # a parallel to k
    a[10:20] = 1e-4 * torch.randn(10, K, generator=g, dtype=torch.float64)       # M close to I
    M = torch.eye(K, dtype=torch.float64) - k.unsqueeze(-1) * a.unsqueeze(-2)
    ref = torch.linalg.svdvals(M)[:, 0]
    got = sigma_max_rank_one(k, a)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    m1 = sigma_max_rank_one(k, a, minus_one=True)
    assert (m1 >= 0).all()
    torch.testing.assert_close(1 + m1, got, rtol=1e-15, atol=1e-15)


def _totals(acc, tokens):
    for name, (_, _, n) in BINS.items():
        h = acc.hist[name]
        assert h.shape == (acc.L, acc.H, n + 2)
        assert (h.sum(-1) == tokens).all(), name
    assert (acc.counts["n"] == tokens).all()


@pytest.mark.parametrize("arm", ["full", "nogate", "rand"])
def test_projected_arms_stay_in_unit_interval(arm):
    model = tiny_model(arm)
    B, T = 2, 96
    ids = torch.randint(0, 256, (2, B, T), generator=torch.Generator().manual_seed(1))
    acc = run_eig(model, list(ids), s=2.0)
    _totals(acc, 2 * B * T)
    assert acc.tokens == 2 * B * T
    assert (acc.counts["e_out01"] == 0).all() and (acc.counts["e_lt0"] == 0).all()
    assert (acc.min["e"] > 0).all() and (acc.max["e"] < 1).all()
    # the under/overflow and the bins outside (0, 1) are empty
    edges = acc.edges["e"][1:-1]
    lo_bins = int((acc.edges["e"][1:] <= 0).sum())          # bins entirely <= 0
    assert acc.hist["e"][..., : lo_bins + 1].sum() == 0 and acc.hist["e"][..., -1].sum() == 0
    assert edges.numel() == BINS["e"][2] - 1
    # e recomputed from hook_k, hook_b, hook_lambda, hook_d agrees with the probe
    assert acc.e_recompute_maxdiff < 1e-5
    assert (acc.min["sigma"] >= 1).all()


def test_unprojected_arm_and_gdn2():
    acc = run_eig(tiny_model("nogate_noproj"), [torch.randint(0, 256, (2, 96))], s=2.0)
    _totals(acc, 192)
    assert acc.e_recompute_maxdiff < 1e-5
    assert (acc.max["sigma"] > 1).all()            # non-normal: norm above 1 on some token
    acc0 = run_eig(tiny_model("gdn2"), [torch.randint(0, 256, (1, 64))])
    assert float(acc0.max["corr"].max()) == 0.0     # lambda = 0: no correction
    # with a per-channel gate, even GDN-2's M = I - k (b*k)^T is not symmetric: sigma_max >= 1
    assert float(acc0.min["sigma"].min()) >= 1.0


def test_memory_is_bounded():
    model = tiny_model("full")
    a = run_eig(model, [torch.randint(0, 256, (1, 64))])
    b = run_eig(model, [torch.randint(0, 256, (2, 256)), torch.randint(0, 256, (2, 256))])
    assert a.nbytes() == b.nbytes() and a.nbytes() < 200_000
    assert b.pending == {}                          # nothing of the last forward is kept
    # per-layer pending tensors are released as soon as a layer is reduced
    acc = EigAccumulator(2, 2, 16)
    seen = []
    hooks = acc.fwd_hooks()
    model.run_with_hooks(torch.randint(0, 256, (1, 32)),
                         fwd_hooks=hooks + [("blocks.1.attn.hook_q", lambda x, hook: seen.append(len(acc.pending)))])
    assert seen == [0] and acc.tokens == 32


def test_eig_cli_task_and_text(tmp_path, capsys):
    model_dir = saved_tiny_model(tmp_path / "m", arm="full")
    out = tmp_path / "eig"
    assert commands.main(["eig", "--model", model_dir, "--device", "cpu", "--length", "400", "--samples", "2",
                          "--batch-size", "2", "--out", str(out), "--no-progress", "--strength", "1.5", "--format", "legacy"]) == 0
    data = np.load(out / "eig.npz")
    summary = json.loads((out / "eig.json").read_text())
    T = min(len(x) for x in next(task_batches("s-niah-1", length=400, samples=2, batch_size=2, format="legacy")).tolist())
    assert (data["hist_e"].sum(-1) == 2 * T).all() and summary["tokens"] == 2 * T
    assert summary["meta"]["s"] == 1.5
    h = summary["layers"][0]["heads"][0]
    assert h["n"] == 2 * T and h["e_out01"] == 0 and 0 < h["e"]["min"] <= h["e"]["max"] < 1
    for png in ("eig_e_hist.png", "eig_sigma_hist.png", "eig_corr_hist.png", "eig_heatmaps.png"):
        assert (out / png).stat().st_size > 1000
    txt = tmp_path / "t.txt"
    txt.write_text("Some text to read. " * 5)
    assert commands.main(["eig", "--model", model_dir, "--device", "cpu", "--text", str(txt), "--length", "64",
                          "--samples", "3", "--out", str(tmp_path / "e2"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "e2" / "eig.json").read_text())["tokens"] == 3 * 64
    assert commands.main(["eig", "--model", model_dir, "--text", str(tmp_path / "none.txt"),
                          "--out", str(tmp_path / "e3"), "--no-progress"]) == 2
    assert "not a file" in capsys.readouterr().err


def test_eig_cli_refuses_a_tokenizer_larger_than_the_vocabulary(tmp_path, capsys):
    tiny(arm="full").save_pretrained(tmp_path / "m")  # vocabulary 97 < the byte tokenizer's 259 ids
    assert commands.main(["eig", "--model", str(tmp_path / "m"), "--length", "400", "--samples", "1", "--format", "legacy",
                          "--out", str(tmp_path / "eig"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "259 ids" in err and "vocabulary has 97" in err and "--tokenizer" in err
    assert not (tmp_path / "eig" / "eig.json").exists()


def test_text_batches_shapes(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("abc")
    bs = list(text_batches(f, length=10, samples=3, batch_size=2))
    assert [tuple(b.shape) for b in bs] == [(2, 10), (1, 10)]
    assert int(bs[0][0, 0]) == 256 and bytes(bs[0][0, 1:4].tolist()) == b"abc"
