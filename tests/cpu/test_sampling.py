"""Sampling tie rules against transformers' logits warpers (TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper of transformers 5.24), on constructed ties and random logits."""
import numpy as np
import pytest

from assembler.ref import ops
from assembler.ref.numerics import bf16, f32

torch = pytest.importorskip("torch")
lp = pytest.importorskip("transformers.generation.logits_process")


def hf_filter(logits, temperature=1.0, top_k=None, top_p=None):
    s = torch.from_numpy(np.atleast_2d(f32(logits)).copy())
    ids = torch.zeros((s.shape[0], 1), dtype=torch.long)
    if temperature != 1.0:
        s = lp.TemperatureLogitsWarper(temperature)(ids, s)
    if top_k:
        s = lp.TopKLogitsWarper(top_k)(ids, s)
    if top_p is not None and top_p < 1.0:
        s = lp.TopPLogitsWarper(top_p)(ids, s)
    return s.numpy()


def same(a, b):
    return np.array_equal(np.isinf(a), np.isinf(b)) and np.array_equal(a[~np.isinf(a)], b[~np.isinf(b)])


def test_top_k_keeps_every_tie_at_threshold():
    lg = np.array([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.5, 2.0]], np.float32)
    got = ops.filter_logits(lg, top_k=2)                                  # 3, 3: exactly k
    assert same(got, hf_filter(lg, top_k=2)) and np.isfinite(got).sum() == 2
    got = ops.filter_logits(lg, top_k=3)                                  # threshold 2.0 ties: kept set 6 > k
    assert same(got, hf_filter(lg, top_k=3)) and np.isfinite(got).sum() == 6


def test_top_p_removes_ascending_prefix_highest_tied_id_survives():
    lg = np.log(np.array([[0.1, 0.1, 0.1, 0.1, 0.6]], np.float32))       # four tied 0.1's, then 0.6
    for p in (0.65, 0.75, 0.85):
        got, want = ops.filter_logits(lg, top_p=p), hf_filter(lg, top_p=p)
        assert same(got, want), (p, got, want)
    got = ops.filter_logits(lg, top_p=0.75)                               # removes 0.1 · 2 from the low ids
    assert list(np.isfinite(got[0])) == [False, False, True, True, True]
    only = ops.filter_logits(np.zeros((1, 6), np.float32), top_p=0.1)    # all tied: the highest id survives
    assert list(np.isfinite(only[0])) == [False] * 5 + [True]
    assert same(only, hf_filter(np.zeros((1, 6), np.float32), top_p=0.1))


def same_up_to_boundary_ties(a, b):
    """Equal except for ids whose score equals the lowest kept score (torch.sort is not stable on long rows,
    so which of several tied ids at the top-p boundary transformers removes is implementation-defined)."""
    for ra, rb_ in zip(np.atleast_2d(a), np.atleast_2d(b)):
        diff = np.isinf(ra) != np.isinf(rb_)
        if not diff.any():
            continue
        lo = min(ra[np.isfinite(ra)].min(), rb_[np.isfinite(rb_)].min())
        vals = np.where(np.isfinite(ra), ra, rb_)[diff]
        if not (np.all(vals == lo) and np.isfinite(ra).sum() == np.isfinite(rb_).sum()):
            return False
    return True


@pytest.mark.parametrize("seed", range(4))
def test_warpers_match_transformers_on_bf16_logits(seed):
    rng = np.random.default_rng(seed)
    lg = bf16(rng.standard_normal((2, 5000)) * 3)                        # bf16 logits: many exact ties
    for t, k, p in ((1.0, 20, None), (0.6, 20, 0.95), (1.3, None, 0.9), (0.7, 50, 0.5)):
        assert same_up_to_boundary_ties(ops.filter_logits(lg, t, k, p), hf_filter(lg, t, k, p)), (t, k, p)
    assert not same_up_to_boundary_ties(ops.filter_logits(lg, 1.0, None, 0.85), hf_filter(lg, 1.0, None, 0.9))


def test_sample_greedy_seeded_and_never_filtered():
    rng = np.random.default_rng(1)
    lg = bf16(rng.standard_normal((3, 1000)))
    assert list(ops.sample(lg, 0, None, None, None)) == list(ops.argmax(lg))
    a = ops.sample(lg, 0.8, 20, 0.9, np.random.Generator(np.random.PCG64(7)))
    b = ops.sample(lg, 0.8, 20, 0.9, np.random.Generator(np.random.PCG64(7)))
    assert np.array_equal(a, b)
    g = np.random.Generator(np.random.PCG64(3))
    keep = np.isfinite(ops.filter_logits(lg[0], 1.0, 5, None))
    draws = [ops.sample(lg[0], 1.0, 5, None, g) for _ in range(300)]
    assert all(keep[d] for d in draws) and len(set(draws)) > 1
    with pytest.raises(ValueError, match="top_p"):
        ops.filter_logits(lg, 1.0, None, 1.5)


class _Out:
    """A StepOutput stand-in: logits, a device greedy token and optionally a device draw."""

    def __init__(self, logits, token=None, sample_on_device=None):
        self.logits, self.token, self.sample_on_device = logits, token, sample_on_device


def test_choose_hands_the_device_draw_the_hosts_u():
    """Sampler.choose: a device draw gets the parameters and the very u the host path would draw, so a seeded
    run picks the same ids whether the GPU or the host samples; greedy takes the device's token; a step with
    neither logits nor token is refused."""
    from host.sampling import Sampler, SamplingParams, mask_padding
    from assembler.ref import sampling as ref

    rng = np.random.default_rng(5)
    rows = [rng.standard_normal(4096).astype(np.float32) * 3 for _ in range(12)]
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=11)
    seen = []

    def device(temperature, top_k, top_p, u):
        seen.append((temperature, top_k, top_p, u))

        class _U:
            def random(self):
                return u
        return int(ref.sample(mask_padding(rows[len(seen) - 1]), temperature, top_k, top_p, _U()))

    host, dev = Sampler(params), Sampler(params)
    want = [host(r) for r in rows]
    got = [dev.choose(_Out(None, token=0, sample_on_device=device)) for _ in rows]
    assert got == want and len(seen) == len(rows)
    assert {s[:3] for s in seen} == {(0.7, 20, 0.9)}
    control = Sampler(SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=12))
    assert [control(r) for r in rows] != want  # negative control: another seed draws other ids
    greedy = Sampler(SamplingParams())
    assert greedy.choose(_Out(None, token=42, sample_on_device=device)) == 42
    with pytest.raises(ValueError, match="neither logits nor a token"):
        dev.choose(_Out(None))
