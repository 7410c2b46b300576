"""Assignment 9 (federated learning), graded. Run: ``python -m grader --tasks 9.*`` (4 ranks).

Every check compares with a computation in the test (NumPy, float64, or exact integers for the
fixed point), never a stored number, on clients, counts, updates and keys drawn when the test runs
(all ranks agree on them; every rank can rebuild every rank's clients, so the expected result needs
no communication). ``total_of`` is the test's own: the float64 sum over the group's ranks by MPI's
own all-reduce, with a deadline; it checks what it is given (float64 vectors of the round's length)
and counts its calls, which must be one on every rank.

* 9.1 ``weighted_average``: Σ n_c·Δ_c / Σ n_c over every rank's clients, float64, the same on every
  rank. Fixed hard cases besides a drawn round: sample counts from 1 to 10^6, a client with 0
  samples (its large update must not count), no sample anywhere (zeros), a rank hosting no client of
  the round (it takes part in the sum with no vector), a group of 3 ranks, strided (non-contiguous)
  updates, float32 updates (products and sums in float64).
* 9.2 ``pairwise_mask``: uint64 masks of a round sum to 0 modulo 2^64 exactly (over a group of 4 and
  of 3 ranks, each client's mask computed on the rank that hosts it), a client's mask is the same
  on every rank, each pair's part depends on the key and the pair alone (not on the order of
  ``selected``, nor on the other clients: i's mask over {i, j, k} is its masks over {i, j} and over
  {i, k} added), a lone client's mask is zero, other rounds and other seeds give other masks, a
  masked update is uncorrelated with the update (|corr| below 6/√size), and ``secure_sum`` through
  your masks equals the exact fixed-point sum after decoding (a rank with no client, 3 ranks).
* 9.3 ``clip_update`` and ``private_average``: a float64 copy (not a view of the input, float32
  and strided inputs too), unchanged within the bound and exactly at it, a zero update stays zero,
  a long update keeps its direction and gets norm S, a float32 update whose squared norm overflows
  float32; the average without noise is Σ clip(u) / expected (expected differs from the number of
  updates), a rank without clients takes part, the noise is the same on every rank, comes from the
  generator given (the same seed, the same noise), and over many draws has mean 0 and std
  σ·S/expected whatever the number of clients (added once to the sum).

Seeds are drawn at run time; replay with ``TINYTRAIN_GRADER_SEED=<seed>``.
"""

from __future__ import annotations

import numpy as np
import pytest

from grader.mpi_reference import mpi
from grader.seeds import grading_seed
from tinytrain import distributed as dist
from tinytrain.backend import to_host, xp
from tinytrain.distributed._mpi import MPI

N = 4
FRACTION_BITS = 32  # secure aggregation's fixed point: the handout's, checked against federated.FRACTION_BITS
MOD = 2**64


def host(a):
    return np.asarray(to_host(a))


def shared_seed():
    seed = grading_seed()
    return np.random.default_rng(seed), seed


def on_group(ranks: int):
    """(the group of the first ``ranks`` ranks, or None on a rank outside it). Built before any of
    your code runs (building a group waits for every rank)."""
    if ranks == dist.get_world_size():
        return dist.world()
    group = dist.new_group(range(ranks))
    return group if dist.get_rank() < ranks else None


def drawn_on(ranks: int):
    """(generator, seed, group, this rank in it) of a case on the first ``ranks`` ranks; the group is
    None on a rank outside it, which sits the case out."""
    rng, seed = shared_seed()
    group = on_group(ranks)
    return rng, seed, group, (dist.get_rank(group) if group is not None else None)


class Sums:
    """The test's ``total_of``: the sum over the group's ranks of float64 vectors of ``size``
    numbers (MPI's own all-reduce, with a deadline), recording how many vectors each call got."""

    def __init__(self, group, size: int, what: str):
        self.group, self.size, self.what, self.calls = group, size, what, []

    def __call__(self, vectors):
        vectors = list(vectors)
        local = np.zeros(self.size, dtype=np.float64)
        for v in vectors:
            a = host(v)
            assert a.dtype == np.float64 and a.shape == (self.size,), (
                f"{self.what}: total_of was given a {a.dtype} vector of shape {a.shape}; in this round it sums "
                f"float64 vectors of {self.size} numbers each (one per client of this rank)"
            )
            local += a
        out = np.empty_like(local)
        mpi(self.group, "Allreduce", local, out, op=MPI.SUM)
        self.calls.append(len(vectors))
        return xp.asarray(out)

    def check_called_once(self, hosted: int) -> None:
        assert len(self.calls) == 1, (
            f"{self.what}: total_of was called {len(self.calls)} times on this rank, which hosts {hosted} client(s) "
            "of the round: every rank calls it exactly once (with no vector if it hosts no client), so that "
            "the sum is one collective on every rank"
        )
        assert self.calls[0] == hosted, (
            f"{self.what}: total_of got {self.calls[0]} vectors on this rank, which hosts {hosted} client(s) of the "
            "round: one vector per client"
        )


def same_everywhere(group, got, what: str) -> None:
    """``got`` is bitwise the value rank 0 of the group has (MPI's broadcast, with a deadline)."""
    theirs = np.ascontiguousarray(host(got)).copy()
    mpi(group, "Bcast", theirs, root=0)
    assert np.array_equal(theirs, host(got), equal_nan=True), (
        f"{what}: this rank's result differs from rank 0's; every rank must end with the same value (it comes "
        "from the one sum every rank receives)"
    )


def kind(got, shape, what: str) -> np.ndarray:
    a = host(got)
    assert a.dtype == np.float64, f"{what}: the result is {a.dtype}; it must be float64"
    assert a.shape == shape, f"{what}: the result has shape {a.shape}, expected {shape} (one number per parameter)"
    return a


# ================================================================================================
# 9.1 the client-weighted average
# ================================================================================================

# Each case: the clients per rank (None: drawn), how counts are drawn, the ranks, the updates' form.
CASES_91 = {
    "drawn": dict(),
    "skewed-counts": dict(clients=[3, 2, 1, 2], counts="skewed"),
    "a-client-with-0-samples": dict(clients=[2, 1, 2, 1], counts="one-zero"),
    "no-sample-anywhere": dict(clients=[2, 1, 0, 1], counts="zero"),
    "a-rank-without-clients": dict(clients=[2, 0, 3, 1]),
    "3-ranks": dict(ranks=3),
    "strided-updates": dict(layout="strided"),
    "float32-updates": dict(dtype=np.float32, counts="skewed"),
}


def clients_91(rng, ranks, spec):
    """Every rank's clients: lists of (count, float64 update), drawn the same on every rank."""
    psi = int(rng.integers(1, 300))
    per = spec.get("clients") or [int(rng.integers(0, 4)) for _ in range(ranks)]
    if not any(per):
        per[int(rng.integers(0, ranks))] = 2
    out = []
    for r in range(ranks):
        mine = []
        for _ in range(per[r]):
            if spec.get("counts") == "skewed":
                n = int(10 ** rng.uniform(0, 6))
            elif spec.get("counts") == "zero":
                n = 0
            else:
                n = int(rng.integers(1, 200))
            mine.append([n, rng.standard_normal(psi) * rng.uniform(0.1, 3)])
        out.append(mine)
    if spec.get("counts") == "one-zero":
        r = next(r for r in range(ranks) if out[r])
        out[r][-1][0] = 0
        out[r][-1][1] = out[r][-1][1] * 1e6  # a large update that must not count
    return psi, out


def as_given(update, spec):
    """A client's update as the test hands it over: its dtype, and strided for the strided case."""
    a = update.astype(spec.get("dtype", np.float64))
    if spec.get("layout") == "strided":
        big = np.zeros(3 * a.size, dtype=a.dtype)
        big[1::3] = a
        return xp.asarray(big)[1::3]  # a non-contiguous view
    return xp.asarray(a)


def fedavg(clients, dtype=np.float64):
    """Σ n_c·Δ_c / Σ n_c in float64 over every client (the values as given, cast to float64)."""
    flat = [(n, u.astype(dtype).astype(np.float64)) for mine in clients for n, u in mine]
    samples = sum(n for n, _ in flat)
    psi = flat[0][1].size
    if samples == 0:
        return np.zeros(psi)
    return sum(n * u for n, u in flat) / samples


def wrong_averages(clients, rank, dtype):
    """What common mistakes would return, by name (each with what to change)."""
    flat = [(n, u.astype(dtype).astype(np.float64)) for mine in clients for n, u in mine]
    out = {}
    out["the unweighted mean of every client's update (weight each update by its client's samples n_c)"] = sum(
        u for _, u in flat
    ) / len(flat)
    mine = [(n, u.astype(dtype).astype(np.float64)) for n, u in clients[rank]]
    if mine and sum(n for n, _ in mine):
        local = sum(n * u for n, u in mine) / sum(n for n, _ in mine)
        out["this rank's clients' average alone (sum over every rank's clients, in one sum)"] = local
    ranks_avg = [
        sum(n * u.astype(dtype).astype(np.float64) for n, u in m) / sum(n for n, _ in m)
        for m in clients
        if m and sum(n for n, _ in m)
    ]
    if ranks_avg:
        out[
            "each rank's average summed (each rank divided by its own samples: the denominator is the samples "
            "of every rank's clients, summed like the numerator)"
        ] = sum(ranks_avg)
        out[
            "the mean of the ranks' averages (each rank divided by its own samples: the denominator is the "
            "samples of every rank's clients, summed like the numerator)"
        ] = sum(ranks_avg) / len(ranks_avg)
    total = sum(n for n, _ in flat)
    if total:
        out["the weighted sum, not divided by the samples Σ n_c"] = sum(n * u for n, u in flat)
    if total and mine and sum(n for n, _ in mine):
        out[
            "the weighted sum of every rank's clients over this rank's samples alone (the denominator is the "
            "samples of every rank's clients, summed like the numerator)"
        ] = sum(n * u for n, u in flat) / sum(n for n, _ in mine)
    return out


def explain(got, want, wrongs, what) -> str:
    if not np.isfinite(got).all():
        return (
            f"{what}: the result holds nan or inf (a division by zero samples?); a round whose clients hold no "
            "sample leaves θ where it was: the average is zeros"
        )
    for name, value in wrongs.items():
        if (
            value.shape == got.shape
            and np.allclose(got, value, rtol=1e-9, atol=1e-12)
            and not np.allclose(value, want, rtol=1e-9, atol=1e-12)
        ):
            return f"{what}: got {name}"
    energy = float((want * want).sum())
    if energy and not got.any():
        return (
            f"{what}: the result is zeros, but the round's clients hold samples: the sums run over every rank's "
            "clients (a rank without clients, or whose clients hold none, gets the same average as the others)"
        )
    scale = float(np.abs(want).max(initial=0))
    if scale and float(np.abs(got - want).max()) <= 1e-5 * scale:
        return (
            f"{what}: the result is off by {float(np.abs(got - want).max()) / scale:.2g} of its largest element, more "
            "than float64's rounding: weight the updates and sum them in float64 (n_c·Δ_c of a float32 update "
            "rounds in float32)"
        )
    if energy:
        ratio = float((got * want).sum()) / energy
        if np.allclose(got, ratio * want, rtol=1e-6, atol=1e-9):
            return f"{what}: the result is the weighted average times {ratio:.6g} (got x{ratio:.4g})"
    worst = int(np.argmax(np.abs(got - want)))
    return f"{what}: element {worst} is {got[worst]!r}, the weighted average there is {want[worst]!r}"


@pytest.mark.task("9.1")
@pytest.mark.world_size(N)
@pytest.mark.parametrize("case", list(CASES_91))
def test_weighted_average_is_fedavgs_sample_weighted_mean_on_every_rank(impl, case):
    spec = CASES_91[case]
    ranks = spec.get("ranks", N)
    rng, seed, group, rank = drawn_on(ranks)
    if group is None:
        return  # the 4th rank sits out the 3-rank case
    psi, clients = clients_91(rng, ranks, spec)
    dtype = spec.get("dtype", np.float64)
    want = fedavg(clients, dtype)
    counts = [n for n, _ in clients[rank]]
    what = (
        f"weighted_average on {ranks} ranks ({case}; clients per rank {[len(m) for m in clients]}, their samples "
        f"{[[n for n, _ in m] for m in clients]}, {np.dtype(dtype).name} updates of {psi} numbers; rank {rank}; "
        f"seed {seed})"
    )
    sums = Sums(group, psi + 1, what)
    got = impl.federated.weighted_average([as_given(u, spec) for _, u in clients[rank]], counts, sums)
    sums.check_called_once(len(counts))
    got = kind(got, (psi,), what)
    if not np.allclose(got, want, rtol=1e-10, atol=1e-12 * max(1.0, float(np.abs(want).max(initial=0)))):
        raise AssertionError(explain(got, want, wrong_averages(clients, rank, dtype), what))
    same_everywhere(group, got, what)


@pytest.mark.task("9.1")
@pytest.mark.world_size(N)
def test_weighted_average_leaves_the_updates_alone(impl):
    rng, seed = shared_seed()
    psi, clients = clients_91(rng, N, {"clients": [2, 1, 1, 2]})
    rank = dist.get_rank()
    given = [xp.asarray(u.copy()) for _, u in clients[rank]]
    what = f"weighted_average (rank {rank}, seed {seed})"
    sums = Sums(dist.world(), psi + 1, what)
    impl.federated.weighted_average(given, [n for n, _ in clients[rank]], sums)
    for k, (g, (_, u)) in enumerate(zip(given, clients[rank])):
        assert np.array_equal(host(g), u), f"{what}: client {k}'s update was changed in place; weight a copy"


# ================================================================================================
# 9.2 pairwise masks
# ================================================================================================


def masks_of(impl, clients, selected, key, size, what):
    """{client: its mask} as computed here, each checked: uint64, ``size`` numbers."""
    out = {}
    for c in clients:
        m = host(impl.federated.pairwise_mask(c, list(selected), key, size))
        assert m.dtype == np.uint64 and m.shape == (size,), (
            f"{what}: client {c}'s mask is {m.dtype} of shape {m.shape}; it must be uint64 with {size} numbers "
            "(masks live modulo 2^64, where they cancel exactly)"
        )
        out[c] = m
    return out


def mod_sum(arrays, size):
    total = np.zeros(size, dtype=np.uint64)
    for a in arrays:
        total += a  # uint64 wraps: modulo 2^64
    return total


def a_round(rng, clients_total):
    selected = sorted(
        int(c) for c in rng.choice(clients_total, size=int(rng.integers(2, clients_total + 1)), replace=False)
    )
    key = (int(rng.integers(0, 2**31)), int(rng.integers(1, 1000)))
    return selected, key


@pytest.mark.task("9.2")
@pytest.mark.world_size(N)
@pytest.mark.parametrize("ranks", [N, 3])
def test_the_masks_of_a_round_sum_to_zero_and_a_clients_mask_is_the_same_on_every_rank(impl, ranks):
    rng, seed, group, rank = drawn_on(ranks)
    if group is None:
        return
    per = int(rng.integers(1, 4))  # clients per rank
    selected, key = a_round(rng, per * ranks)
    size = int(rng.integers(1, 500))
    mine = [c for c in selected if c // per == rank]
    what = (
        f"pairwise_mask on {ranks} ranks (round's clients {selected}, key {key}, {size} numbers; rank {rank}; "
        f"seed {seed})"
    )
    here = masks_of(impl, selected, selected, key, size, what)  # every client's mask, computed on this rank
    assert not np.any(mod_sum(here.values(), size)), (
        f"{what}: the masks of the round's clients add up to something other than 0 modulo 2^64 (at "
        f"{int(np.count_nonzero(mod_sum(here.values(), size)))} of {size} positions): each pair's part must be added "
        "by one of the two and taken away by the other"
    )
    hosted = np.zeros((len(selected), size), dtype=np.uint64)  # each mask as the rank hosting its client has it
    for i, c in enumerate(selected):
        if c in mine:
            hosted[i] = here[c]
    gathered = np.zeros_like(hosted)
    mpi(group, "Allreduce", hosted, gathered, op=MPI.BOR)  # each row is set by one rank only
    for i, c in enumerate(selected):
        assert np.array_equal(gathered[i], here[c]), (
            f"{what}: client {c}'s mask computed on rank {c // per} differs from the same client's mask computed "
            "here: a mask must be a function of (client, the round's clients, key) alone"
        )


@pytest.mark.task("9.2")
def test_each_pairs_part_depends_on_the_key_and_the_pair_alone(impl):
    rng, seed = shared_seed()
    size = int(rng.integers(1, 400))
    i, j, k, m = (int(x) for x in rng.choice(50, size=4, replace=False))
    key = (int(rng.integers(0, 2**31)), int(rng.integers(1, 1000)))
    what = f"pairwise_mask (clients {i}, {j}, {k}, {m}; key {key}; {size} numbers; seed {seed})"

    def mask(c, selected, key=key):
        return masks_of(impl, [c], selected, key, size, what)[c]

    ij, ik, ijk = mask(i, [i, j]), mask(i, [i, k]), mask(i, [i, j, k])
    assert np.array_equal(mod_sum([ij, mask(j, [i, j])], size), np.zeros(size, np.uint64)), (
        f"{what}: over the round {{{i}, {j}}} the two masks do not cancel: the pair's part must be the same stream "
        "for both, added by one and taken away by the other"
    )
    assert np.array_equal(ijk, mod_sum([ij, ik], size)), (
        f"{what}: client {i}'s mask over {{{i}, {j}, {k}}} is not its mask over {{{i}, {j}}} plus its mask over "
        f"{{{i}, {k}}}: a pair's part may depend on the key and the pair alone, not on the other clients of the round"
    )
    for order in ([k, i, j], [j, k, i]):
        assert np.array_equal(mask(i, order), ijk), (
            f"{what}: client {i}'s mask changes with the order of selected ({order} against sorted): a pair's part "
            "and its sign may depend on the two clients, not on where they stand in the list"
        )
    assert not np.array_equal(ij, ik) or size == 0, (
        f"{what}: client {i}'s masks with {j} and with {k} are equal: each pair needs its own stream"
    )
    big = [i, j, k, m]
    assert np.array_equal(mask(j, big), mod_sum([mask(j, [j, c]) for c in (i, k, m)], size)), (
        f"{what}: client {j}'s mask over {sorted(big)} is not the sum of its pairs' parts"
    )


@pytest.mark.task("9.2")
def test_a_lone_client_has_no_mask_and_other_rounds_other_masks(impl):
    rng, seed = shared_seed()
    size = int(rng.integers(16, 400))
    i, j = (int(x) for x in rng.choice(30, size=2, replace=False))
    s, t = int(rng.integers(0, 2**31)), int(rng.integers(1, 1000))
    what = f"pairwise_mask (clients {i}, {j}; {size} numbers; seed {seed})"
    lone = masks_of(impl, [i], [i], (s, t), size, what)[i]
    assert not np.any(lone), (
        f"{what}: client {i} alone in its round got a non-zero mask: with no other client there is no pair, so "
        "nothing to add (and nothing would cancel it)"
    )
    empty = masks_of(impl, [i], [i, j], (s, t), 0, what)[i]
    assert empty.shape == (0,)
    this = masks_of(impl, [i], [i, j], (s, t), size, what)[i]
    for other, words in (((s, t + 1), "the next round"), ((s + 1, t), "another run seed")):
        again = masks_of(impl, [i], [i, j], other, size, what)[i]
        assert not np.array_equal(this, again), (
            f"{what}: key {other} ({words}) gives the same mask as key {(s, t)}: the pair's stream must come from "
            "the round's key too, or one round's masked updates subtracted from another's reveal the change"
        )


@pytest.mark.task("9.2")
def test_a_masked_update_is_uncorrelated_with_the_update(impl):
    rng, seed = shared_seed()
    size = 4096
    selected, key = a_round(rng, 8)
    c = selected[int(rng.integers(0, len(selected)))]
    update = np.cumsum(rng.standard_normal(size)) * 1e-3  # smooth: a weak mask would leave it readable
    encoded = np.rint(update * 2.0**FRACTION_BITS).astype(np.int64).view(np.uint64)
    mask = masks_of(impl, [c], selected, key, size, f"pairwise_mask (seed {seed})")[c]
    sent = (encoded + mask).view(np.int64).astype(np.float64)
    corr = abs(float(np.corrcoef(sent, update)[0, 1]))
    bound = 6 / np.sqrt(size)
    assert corr < bound, (
        f"pairwise_mask (client {c} of {selected}, key {key}; seed {seed}): the masked update's correlation with the "
        f"update is {corr:.3f} (an independent uniform mask gives below {bound:.3f}): each pair's stream must be "
        "uniform over all 64 bits, so that a masked value says nothing about the update"
    )


@pytest.mark.task("9.2")
@pytest.mark.world_size(N)
@pytest.mark.parametrize("case", ["4-ranks", "a-rank-without-clients", "3-ranks"])
def test_secure_sum_through_your_masks_is_the_exact_sum(impl, case):
    assert impl.federated.FRACTION_BITS == FRACTION_BITS
    ranks = 3 if case == "3-ranks" else N
    rng, seed, group, rank = drawn_on(ranks)
    if group is None:
        return
    per = [int(rng.integers(1, 4)) for _ in range(ranks)]
    if case == "a-rank-without-clients":
        per[1] = 0
    owners = [r for r in range(ranks) for _ in range(per[r])]
    selected, key = a_round(rng, len(owners))
    size = int(rng.integers(1, 300))
    vectors = {c: rng.standard_normal(size) * rng.uniform(0.01, 10) for c in selected}
    exact = sum(np.rint(v * 2.0**FRACTION_BITS).astype(np.int64) for v in vectors.values())
    want = exact.astype(np.float64) / 2.0**FRACTION_BITS
    mine = {c: xp.asarray(v) for c, v in vectors.items() if owners[c] == rank}
    got = host(impl.federated.secure_sum(mine, selected, key, size, group=group))
    what = (
        f"secure_sum through your pairwise_mask on {ranks} ranks ({case}; round's clients {selected}, key {key}; "
        f"rank {rank}; seed {seed})"
    )
    assert got.shape == (size,), f"{what}: shape {got.shape}"
    if not np.array_equal(got, want):
        off = np.abs(got - want).max()
        raise AssertionError(
            f"{what}: the decoded sum differs from the exact sum of the updates by up to {off:.3g}: the masks of the "
            "round's clients must cancel exactly modulo 2^64"
        )


# ================================================================================================
# 9.3 clipping and the server's noise
# ================================================================================================


def clipped(u, bound):
    """The update scaled to norm ``bound`` if longer, in float64."""
    d = np.asarray(u, dtype=np.float64).reshape(-1)
    norm = float(np.sqrt(np.sum((d / np.abs(d).max()) ** 2)) * np.abs(d).max()) if d.size and d.any() else 0.0
    return d * (bound / norm) if norm > bound else d.copy()


@pytest.mark.task("9.3")
@pytest.mark.parametrize("case", ["shorter", "longer", "at-the-bound", "zero", "float32-huge", "strided", "empty"])
def test_clip_update_scales_down_to_the_bound_only_and_returns_a_float64_copy(impl, case):
    rng, seed = shared_seed()
    size = int(rng.integers(2, 200))
    bound = float(rng.uniform(0.1, 10))
    u = rng.standard_normal(size)
    if case == "shorter":
        u *= 0.5 * bound / np.linalg.norm(u)
    elif case == "longer":
        u *= rng.uniform(1.5, 100) * bound / np.linalg.norm(u)
    elif case == "at-the-bound":
        size, u = 2, np.array([3.0, 4.0]) * 2.0 ** int(rng.integers(-4, 4))
        bound = 5.0 * 2.0 ** int(np.log2(u[0] / 3.0))  # norm exactly the bound
    elif case == "zero":
        u = np.zeros(size)
    elif case == "float32-huge":
        u = (u * 1e20).astype(np.float32)  # its squares overflow float32 (max 3.4e38)
    elif case == "empty":
        size, u = 0, np.zeros(0)
    given = xp.asarray(u)
    if case == "strided":
        big = xp.zeros(2 * size)
        big[::2] = xp.asarray(u * 3 * bound / np.linalg.norm(u))
        given, u = big[::2], host(big[::2]).copy()
    before = host(given).copy()
    norm_u = float(np.linalg.norm(u.astype(np.float64)))
    what = f"clip_update ({case}: {host(given).dtype} update of norm {norm_u:.4g}, bound {bound:.4g}; seed {seed})"
    got = impl.federated.clip_update(given, bound)
    a = kind(got, (size,), what)
    want = clipped(u, bound)
    assert np.isfinite(a).all(), (
        f"{what}: the result holds nan or inf (the norm of a zero update is 0, and of a float32 update take it in "
        "float64: its squares overflow float32)"
    )
    if case in ("shorter", "at-the-bound", "zero", "empty"):
        assert np.array_equal(a, want), (
            f"{what}: an update within the bound must come back unchanged (got norm {np.linalg.norm(a):.6g}): "
            "clipping only ever shortens"
        )
    else:
        norm = float(np.linalg.norm(a))
        assert abs(norm - bound) <= 1e-9 * bound, (
            f"{what}: the clipped update has norm {norm!r}, not the bound {bound!r}"
        )
        cos = float(a @ want) / (norm * float(np.linalg.norm(want)))
        assert cos > 1 - 1e-12 and np.allclose(a, want, rtol=1e-9, atol=1e-12 * bound), (
            f"{what}: the clipped update does not point where the update points (cosine {cos:.9f}): scale it, "
            "every element by the same factor"
        )
    a[...] = 7.0
    assert np.array_equal(host(given), before), (
        f"{what}: writing into the result changed the update you were given: return a copy, not a view"
    )


def private_round(rng, ranks, per=None, psi=None):
    """Every rank's updates (float64), some longer than the bound and some shorter."""
    psi = psi or int(rng.integers(1, 300))
    per = per or [int(rng.integers(0, 4)) for _ in range(ranks)]
    if not any(per):
        per[0] = 1
    bound = float(rng.uniform(0.1, 5))
    out = [[rng.standard_normal(psi) * bound * rng.uniform(0.2, 3) / np.sqrt(psi) for _ in range(k)] for k in per]
    return psi, bound, out


@pytest.mark.task("9.3")
@pytest.mark.world_size(N)
@pytest.mark.parametrize("case", ["drawn", "a-rank-without-clients", "3-ranks", "float32-updates"])
def test_private_average_without_noise_is_the_clipped_sum_over_the_expected_count(impl, case):
    ranks = 3 if case == "3-ranks" else N
    rng, seed, group, rank = drawn_on(ranks)
    if group is None:
        return
    per = [2, 0, 3, 1] if case == "a-rank-without-clients" else None
    psi, bound, updates = private_round(rng, ranks, per)
    dtype = np.float32 if case == "float32-updates" else np.float64
    count = sum(len(u) for u in updates)
    expected = count + int(rng.integers(1, 4))  # the round's count S: some of its clients sent nothing
    want = sum(clipped(u.astype(dtype), bound) for mine in updates for u in mine) / expected
    what = (
        f"private_average with sigma 0 on {ranks} ranks ({case}; updates per rank {[len(m) for m in updates]}, bound "
        f"{bound:.4g}, expected {expected}; rank {rank}; seed {seed})"
    )
    sums = Sums(group, psi, what)
    mine = [xp.asarray(u.astype(dtype)) for u in updates[rank]]
    got = impl.federated.private_average(mine, bound, 0.0, expected, np.random.default_rng([seed, 5]), sums)
    sums.check_called_once(len(mine))
    got = kind(got, (psi,), what)
    if not np.allclose(got, want, rtol=1e-10, atol=1e-12 * bound):
        wrongs = {
            f"divided by the {count} clients that sent an update: divide by expected, the round's fixed count "
            "(a count that depends on who took part would itself tell)": want * expected / count,
            "the sum of the updates unclipped over expected: clip each update to the bound first": sum(
                u.astype(dtype).astype(np.float64) for m in updates for u in m
            )
            / expected,
            "the clipped sum not divided by expected": want * expected,
        }
        if updates[rank]:
            wrongs[
                f"divided by this rank's {len(updates[rank])} update(s): divide by expected, the round's fixed count"
            ] = want * expected / len(updates[rank])
        raise AssertionError(explain(got, want, wrongs, what))
    same_everywhere(group, got, what)


@pytest.mark.task("9.3")
@pytest.mark.world_size(N)
@pytest.mark.parametrize(
    "per", [[1, 0, 0, 0], [2, 0, 3, 1], [3, 3, 3, 3]], ids=["one-client", "six-clients", "twelve-clients"]
)
def test_the_servers_noise_is_added_once_the_same_on_every_rank_with_std_sigma_times_the_bound(impl, per):
    rng, seed = shared_seed()
    rank = dist.get_rank()
    psi, bound, updates = private_round(rng, N, per, psi=20000)
    sigma = float(rng.uniform(0.3, 3))
    expected = sum(per) + 1
    signal = sum(clipped(u, bound) for mine in updates for u in mine)
    what = (
        f"private_average (updates per rank {per}, {psi} numbers, bound {bound:.4g}, sigma {sigma:.4g}, expected "
        f"{expected}; rank {rank}; seed {seed})"
    )
    mine = [xp.asarray(u) for u in updates[rank]]
    runs = []
    for draw in range(2):
        sums = Sums(dist.world(), psi, what)
        got = impl.federated.private_average(mine, bound, sigma, expected, np.random.default_rng([seed, 7]), sums)
        sums.check_called_once(len(mine))
        runs.append(kind(got, (psi,), what))
    same_everywhere(dist.world(), runs[0], what + ": the noise must be the server's, drawn from the generator given, "
                    "which is the same on every rank")  # fmt: skip
    assert np.array_equal(runs[0], runs[1]), (
        f"{what}: two calls with generators of the same seed gave different results: draw the noise from the "
        "generator given (rng), not from another source"
    )
    noise = runs[0] * expected - signal  # what was added to the sum
    want = sigma * bound
    std, mean = float(noise.std()), float(noise.mean())
    tol = 6 / np.sqrt(2 * psi)  # the relative spread of a std estimated from psi draws, 6 times
    assert abs(std / want - 1) < tol, (
        f"{what}: the noise on the sum has std {std:.4g}; Gaussian noise of std sigma x bound = {want:.4g} is added "
        f"once to the sum (std of the average {want / expected:.4g}), whatever the number of clients "
        f"(got x{std / want:.3g} of it)"
    )
    assert abs(mean) < 6 * want / np.sqrt(psi), f"{what}: the noise has mean {mean:.4g}, not 0"
