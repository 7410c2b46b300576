"""Federated averaging (``--dp-algo fedavg``, ``tinytrain/parallel/federated.py``) against the runs
it must equal and the numbers it must report:

* every client, iid, H = 1 and plain SGD: synchronous data parallel over the clients' batches
  (the serial step on their concatenation), with 1 and 2 clients per rank;
* H local steps with momentum: each client's own run from θ, then the sample-weighted average,
  replayed in one process; a rank reads only the shards of the clients it hosts;
* secure aggregation changes the sum by at most its fixed point (2^-32 a value), every masked
  upload is uncorrelated with the update it hides, float64 masks would not cancel exactly, and a
  client dropping after masking is refused, naming it;
* DP-FedAvg: ε is the dp-accounting RDP accountant's for the same events; noise moves the run;
* partitions: iid shards equal and disjoint, Dirichlet skew concentrates labels as ALPHA falls;
* the CLI: bytes per round equal the formula, ε printed, a run resumes on its uninterrupted curve,
  bad flags are one sentence.
"""

from __future__ import annotations

import json
import re

import numpy as np
import parallel_cases
import pytest

from tinytrain import distributed as dist
from tinytrain import random as _random
from tinytrain.backend import to_host, xp
from tinytrain.cli import main
from tinytrain.data import AdditionDataset
from tinytrain.nn import GPT, GPTConfig
from tinytrain.optim import SGD
from tinytrain.parallel import costs, federated
from tinytrain.parallel.federated import ClientData, FedAvg, partition, select_clients
from tinytrain.parallel.plan import Plan

TASK = AdditionDataset(2)
SEED = 5


def tiny_model(seed=0):
    config = GPTConfig(vocab_size=TASK.vocab_size, block_size=TASK.block_size, n_layer=2, n_head=2, n_embd=32)
    return GPT(config, seed=seed)


def flat(model):
    return np.concatenate([to_host(p.data).reshape(-1).astype(np.float64) for p in model.parameters()])


def run_rounds(wrapper, optimizer, rounds, max_norm=None):
    """What the training loop does for one step, ``rounds`` times (the runner's calls, in order)."""
    losses = []
    for step in range(1, rounds + 1):
        _random.manual_seed((SEED, step))
        optimizer.zero_grad()
        losses.append(wrapper.round_gradients())
        if max_norm:
            wrapper.clip_grad_norm_(max_norm)
        wrapper.optimizer = optimizer
        wrapper.step()
    return losses


def serial_client_run(model, optimizer, data, client, rows, h_steps, key):
    """One client's H local steps, from the model's current parameters, in one process."""
    for h in range(h_steps):
        x, y = data.batch(client, rows, (*key, h))
        for p in model.parameters():
            p.grad = None
        _random.manual_seed((*key, client, h))
        model.loss(xp.asarray(x), xp.asarray(y)).backward()
        optimizer.step()


# --- against the serial runs it must equal -----------------------------------------------------------


@pytest.mark.world_size(4)
@pytest.mark.parametrize("per_rank", [1, 2])
def test_every_client_iid_one_local_step_and_sgd_is_synchronous_data_parallel(per_rank):
    clients, rows = 4 * per_rank, 2
    model, serial = tiny_model(), tiny_model()
    data = ClientData(TASK, clients, "iid", seed=SEED)
    fed = FedAvg(model, data, batch_size=rows * clients, local_steps=1)
    run_rounds(fed, SGD(model.parameters(), lr=0.5), 3)
    opt = SGD(serial.parameters(), lr=0.5)
    for step in range(1, 4):  # one step on the round's clients' batches together: the mean of their means
        key = (SEED, step)
        batches = [data.batch(c, rows, (*key, 0)) for c in range(clients)]
        x, y = (np.concatenate(part) for part in zip(*batches))
        opt.zero_grad()
        serial.loss(xp.asarray(x), xp.asarray(y)).backward()
        opt.step()
    np.testing.assert_allclose(flat(model), flat(serial), rtol=1e-5, atol=1e-6)


@pytest.mark.world_size(4)
def test_local_steps_with_momentum_and_skewed_counts_replay_in_one_process():
    """Half the clients a round, H = 3, SGD with momentum (its state fresh for each client and
    round), skew:0.3 (sample counts far apart), dropout on: the one-process replay of each chosen
    client's run from θ, averaged by samples."""
    clients, chosen, rows, h = 8, 4, 2, 3
    config = dict(vocab_size=TASK.vocab_size, block_size=TASK.block_size, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    model = GPT(GPTConfig(**config), seed=0)
    data = ClientData(TASK, clients, "skew:0.3", seed=SEED)
    counts = [data.count(c) for c in range(clients)]
    assert max(counts) > 2 * min(counts), counts
    seen = []
    batch = data.batch
    data.batch = lambda client, *a: seen.append(client) or batch(client, *a)
    fed = FedAvg(model, data, batch_size=rows * chosen, participation=0.5, local_steps=h)
    run_rounds(fed, SGD(model.parameters(), lr=0.2, momentum=0.9), 3, max_norm=1.0)
    hosted = set(federated.hosted_clients(dist.get_rank(), 4, clients))
    assert set(seen) <= hosted, f"rank {dist.get_rank()} read the shards of clients {sorted(set(seen) - hosted)}"

    replay = GPT(GPTConfig(**config), seed=0)
    theta = flat(replay)
    for step in range(1, 4):
        key, total, weight = (SEED, step), 0.0, 0
        for client in select_clients(clients, 0.5, key):
            start = [p.data.copy() for p in replay.parameters()]
            opt = SGD(replay.parameters(), lr=0.2, momentum=0.9)
            for hh in range(h):  # (the clipping the loop asks for, as the wrapper applies it)
                x, y = data.batch(client, rows, (*key, hh))
                opt.zero_grad()
                _random.manual_seed((*key, client, hh))
                replay.loss(xp.asarray(x), xp.asarray(y)).backward()
                from tinytrain.optim import clip_grad_norm_

                clip_grad_norm_(replay.parameters(), 1.0)
                opt.step()
            total = total + data.count(client) * (theta - flat(replay))
            weight += data.count(client)
            for p, s in zip(replay.parameters(), start):
                p.data[...] = s
        theta = theta - total / weight
        offset = 0
        for p in replay.parameters():
            p.data[...] = theta[offset : offset + p.size].reshape(p.shape)
            offset += p.size
    np.testing.assert_allclose(flat(model), theta, rtol=1e-4, atol=1e-6)


# --- secure aggregation --------------------------------------------------------------------------------


@pytest.mark.world_size(4)
def test_secure_aggregation_changes_the_sum_only_by_its_fixed_point():
    runs = {}
    for secure in (False, True):
        model = tiny_model()
        data = ClientData(TASK, 8, "skew:1", seed=SEED)
        fed = FedAvg(model, data, batch_size=8, participation=0.5, local_steps=2, secure=secure)
        runs[secure] = (run_rounds(fed, SGD(model.parameters(), lr=0.3), 3), flat(model))
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-6)
    np.testing.assert_allclose(runs[True][1], runs[False][1], rtol=0, atol=1e-6)


@pytest.mark.world_size(3)
def test_every_masked_upload_is_uncorrelated_with_the_update_it_hides_and_the_sum_is_exact():
    rng = np.random.default_rng([SEED, dist.get_rank()])
    selected, key, size = [0, 1, 2, 4, 5], (SEED, 9), 4096
    mine = [c for c in selected if c % 3 == dist.get_rank()]
    vectors = {c: xp.asarray(rng.normal(size=size) * 10 ** rng.uniform(-3, 1)) for c in mine}
    for c, v in vectors.items():
        sent = federated.masked_update(v, c, selected, key).view(np.int64).astype(np.float64)
        corr = np.corrcoef(to_host(sent), to_host(v))[0, 1]
        assert abs(corr) < 5 / np.sqrt(size), f"client {c}: its masked upload correlates {corr:.3f} with its update"
    got = federated.secure_sum(vectors, selected, key, size)
    want = federated.plain_sum([federated.decode(federated.encode(v)) for v in vectors.values()], size)
    assert np.array_equal(to_host(got), to_host(want)), "the masks did not cancel exactly"


def test_float64_masks_would_not_cancel_exactly_where_integer_ones_do():
    """The choice measured: masks big enough to hide an update (2^20 here) leave rounding behind in
    float64; modulo 2^64 they cancel to the bit."""
    rng = np.random.default_rng(0)
    updates = [rng.normal(size=10_000).astype(np.float32) for _ in range(4)]
    masks = [rng.uniform(-(2.0**20), 2.0**20, size=10_000) for _ in range(3)]
    masks.append(-sum(masks))  # they sum to zero, as pairwise masks do
    floated = sum(u.astype(np.float64) + m for u, m in zip(updates, masks))
    exact = sum(u.astype(np.float64) for u in updates)
    assert np.abs(floated - exact).max() > 1e-12  # rounding of the masks' size stays in the sum
    selected, key = [0, 1, 2, 3], (1, 1)
    total = sum(federated.masked_update(xp.asarray(u), c, selected, key) for c, u in enumerate(updates))
    assert np.array_equal(
        to_host(federated.decode(total)), to_host(federated.decode(sum(federated.encode(u) for u in updates)))
    )


def test_a_client_dropping_after_masking_is_refused_naming_it():
    with pytest.raises(RuntimeError, match=r"client\(s\) \[3\] dropped after masking.*Bonawitz"):
        federated.secure_sum({}, [1, 3, 5], (0, 1), 8, dropped=[3])


def test_an_update_too_large_for_the_fixed_point_says_what_to_change():
    with pytest.raises(ValueError, match="too large for the fixed point.*--clip"):
        federated.encode(np.array([1e12]))


# --- differential privacy ----------------------------------------------------------------------------


def test_epsilon_is_the_rdp_accountants_for_the_same_rounds():
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting import rdp

    for rounds, q, sigma in [(100, 0.01, 1.1), (30, 0.25, 2.0), (1, 1.0, 5.0)]:
        accountant = rdp.RdpAccountant(list(range(2, 64)) + [128, 256, 512])
        event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
        accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
        assert federated.privacy_spent(rounds, q, sigma, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5))
    # more rounds spend more; more noise spends less; a release of nothing spends nothing
    assert federated.privacy_spent(200, 0.1, 1.0, 1e-5) > federated.privacy_spent(100, 0.1, 1.0, 1e-5)
    assert federated.privacy_spent(100, 0.1, 2.0, 1e-5) < federated.privacy_spent(100, 0.1, 1.0, 1e-5)
    assert federated.privacy_spent(0, 0.1, 1.0, 1e-5) == 0.0


@pytest.mark.world_size(2)
def test_dp_fedavg_clips_and_noises_the_same_on_every_rank():
    finals = {}
    for sigma in (0.0, 1.0):
        model = tiny_model()
        data = ClientData(TASK, 4, "iid", seed=SEED)
        fed = FedAvg(model, data, batch_size=8, local_steps=2, clip=0.05, noise=sigma)
        run_rounds(fed, SGD(model.parameters(), lr=0.3), 2)
        finals[sigma] = flat(model)
        everyone = dist.all_gather(finals[sigma][None, :])
        assert np.array_equal(everyone[0], everyone[1]), "the ranks' models parted: the noise must be the server's"
    moved = np.abs(finals[1.0] - finals[0.0]).max()
    assert moved > 0.01, moved  # σ·S / S_expected = 0.0125 a value, twice


# --- the clients' data ---------------------------------------------------------------------------------


def test_iid_shards_are_equal_disjoint_and_skew_concentrates_labels():
    keys, labels = TASK.examples()
    iid = partition(labels, 7, "iid", seed=1)
    assert len({s.size for s in iid}) == 1 and sum(s.size for s in iid) > labels.size - 7
    assert np.unique(np.concatenate(iid)).size == sum(s.size for s in iid)
    for scheme in ("skew:0.1", "skew:100"):
        shards = partition(labels, 7, scheme, seed=1)
        assert np.array_equal(np.sort(np.concatenate(shards)), np.arange(labels.size)), scheme
    concentration = {}
    for scheme in ("iid", "skew:100", "skew:1", "skew:0.1"):
        shares = ClientData(TASK, 8, scheme, seed=1).label_shares()
        concentration[scheme] = shares.max(axis=1).mean()  # a client's largest class share
    assert concentration["iid"] < 0.2 and concentration["skew:100"] < 0.2, concentration
    assert concentration["skew:0.1"] > concentration["skew:1"] > concentration["skew:100"] + 0.1, concentration
    assert [s.tolist() for s in partition(labels, 5, "skew:0.5", seed=3)] == [
        s.tolist() for s in partition(labels, 5, "skew:0.5", seed=3)
    ]


def test_a_text_splits_by_the_first_character_of_its_windows(tmp_path):
    from tinytrain.data import CharDataset

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    dataset = CharDataset(str(text), block_size=16)
    keys, labels = dataset.examples()
    x, y = dataset.rows(keys[:5])
    train = dataset.splits["train"]
    assert x.shape == (5, 16) and (x[:, 0] == labels[:5]).all() and (y[:, :-1] == x[:, 1:]).all()
    assert np.array_equal(x[3], train[keys[3] : keys[3] + 16])
    data = ClientData(dataset, 4, "skew:0.1", seed=2)
    spread = {
        scheme: ClientData(dataset, 4, scheme, seed=2).label_shares().std(axis=0).mean()
        for scheme in ("iid", "skew:0.1")
    }
    assert spread["skew:0.1"] > 3 * spread["iid"], spread  # the clients' characters differ
    bx, by = data.batch(1, 6, (0, 1))
    starts = {int(k) for k in data.keys[data.shards[1]]}
    assert all(any(np.array_equal(row, train[s : s + 16]) for s in starts) for row in bx)


def test_a_round_draws_its_share_of_clients_from_the_seed():
    rounds = [select_clients(16, 0.25, (3, step)) for step in range(1, 6)]
    assert all(len(r) == 4 and r == sorted(set(r)) for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1
    assert rounds[0] == select_clients(16, 0.25, (3, 1))
    assert select_clients(5, 0.01, (0, 1)) and len(select_clients(5, 1.0, (0, 1))) == 5


def test_bad_federated_flags_are_one_sentence_each():
    config = tiny_model().config
    cases = {
        "does not split over --dp 2": Plan(dp=2, dp_algo="fedavg", clients=3),
        "add --dp-algo fedavg": Plan(dp=2, clients=4),
        r"in \(0, 1\]": Plan(dp=2, dp_algo="fedavg", participation=1.5),
        "iid or skew:ALPHA": Plan(dp=2, dp_algo="fedavg", partition="dirichlet"),
        "add --clip S": Plan(dp=2, dp_algo="fedavg", dp_noise=1.0),
        "a round has 1": Plan(dp=2, dp_algo="fedavg", clients=4, participation=0.1, secure_agg=True),
        "does not split over the 3 clients": Plan(dp=1, dp_algo="fedavg", clients=6, participation=0.5),
    }
    for message, plan in cases.items():
        with pytest.raises(ValueError, match=message):
            plan.check(plan.world_size, config, 8)


# --- tinytrain train --dp-algo fedavg ------------------------------------------------------------------

TINY = (
    "--layers 2 --width 32 --heads 4 --batch-size 8 --eval-every 3 --eval-batches 1 --warmup 0 --quiet --no-plot "
    "--dp 4 --dp-algo fedavg --clients 8 --participation 0.5 --local-steps 2"
).split()


def psi() -> int:
    config = GPTConfig(vocab_size=TASK.vocab_size, block_size=TASK.block_size, n_layer=2, n_head=4, n_embd=32)
    return sum(p.size for p in GPT(config).parameters())


@pytest.mark.world_size(4)
@pytest.mark.parametrize("extra", ["", "--secure-agg --partition skew:0.5", "--clip 0.1 --dp-noise 0.8"])
def test_the_cli_prints_bytes_per_round_equal_to_the_formula(tmp_path, capfd, extra):
    if "dp-noise" in extra:
        pytest.importorskip("dp_accounting")
    out = parallel_cases.shared_dir(tmp_path) / "run"
    assert main(["train", *TINY, "--steps", "3", *extra.split(), "--out", str(out)]) == 0
    err = capfd.readouterr().err
    if dist.get_rank() != 0:
        return
    found = re.search(r"per round: ([\d,]+) measured over 3 rounds; formula [^=]*= ([\d,]+)", err)
    assert found, err
    measured, printed = (int(g.replace(",", "")) for g in found.groups())
    want = 2 * 2 * 3 * (psi() + (0 if "clip" in extra else 1)) * 8
    assert measured == printed == want == costs.fedavg_round_volume(psi(), 4, "clip" not in extra), err
    if "dp-noise" in extra:
        epsilon = float(re.search(r"ε = ([\d.e+]+) at δ = 1e-05 after 3 rounds", err).group(1))
        assert epsilon == pytest.approx(federated.privacy_spent(3, 0.5, 0.8, 1e-5), rel=1e-2)


@pytest.mark.world_size(4)
def test_a_federated_run_resumes_on_its_uninterrupted_curve(tmp_path):
    """Everything a round needs is θ and the step: clients, batches and masks come from (seed, step)."""
    base = [*TINY, "--secure-agg", "--partition", "skew:1", "--lr", "0.003", "--min-lr", "0.003"]
    shared = parallel_cases.shared_dir(tmp_path)
    assert main(["train", *base, "--steps", "6", "--out", str(shared / "whole")]) == 0
    assert main(["train", *base, "--steps", "3", "--out", str(shared / "cut")]) == 0
    assert main(["train", *base, "--steps", "6", "--resume", "--out", str(shared / "cut")]) == 0
    if dist.get_rank() == 0:
        whole, cut = (json.loads((shared / name / "metrics.json").read_text()) for name in ("whole", "cut"))
        np.testing.assert_allclose(
            [s["loss"] for s in cut["steps"]], [s["loss"] for s in whole["steps"]], rtol=1e-6, atol=1e-7
        )
        assert cut["final"]["val_loss"] == pytest.approx(whole["final"]["val_loss"], rel=1e-6)


def test_one_process_may_simulate_every_client(tmp_path, capfd):
    out = tmp_path / "run"
    flags = list(TINY)
    del flags[flags.index("--dp") : flags.index("--dp") + 2]
    assert main(["train", *flags, "--steps", "2", "--out", str(out)]) == 0
    err = capfd.readouterr().err
    assert "8 clients, 4 a round" in err and "per round: 0 measured" in err, err


@pytest.mark.world_size(4)
def test_bench_fed_measures_every_setting_and_the_bytes_the_formula_gives(tmp_path, capsys):
    out = parallel_cases.shared_dir(tmp_path) / "bench"
    flags = "--rounds 3 --width 32 --clients 8 --local-steps 1 --target 10 --window 1".split()
    assert main(["bench", "fed", *flags, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    if dist.get_rank() != 0:
        return
    runs = {r["name"]: r for r in json.loads((out / "fed.json").read_text())["runs"]}
    want = {"iid, all", "skew:0.3, all", "iid, 25 %", "skew:0.3, 25 %", "iid, 25 %, secure"}
    assert want <= set(runs) and (out / "fed.png").stat().st_size > 0, runs.keys()
    for name, r in runs.items():  # bytes sent (half the volume's sent + received), and the round's loss
        sent = costs.fedavg_round_volume(r["psi"], 4, "σ" not in name) / 2
        assert r["bytes"] == [pytest.approx(sent, abs=200)] * 3, (name, r["bytes"], sent)
    assert runs["iid, 25 %"]["clients_per_round"] == 2 and runs["iid, all"]["clients_per_round"] == 8
    assert runs["iid, 25 %, secure"]["loss"] == pytest.approx(runs["iid, 25 %"]["loss"], rel=1e-5)
    assert "secure aggregation: the plain curve within" in printed, printed
