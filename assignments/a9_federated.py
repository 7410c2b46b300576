# Assignment 9: Federated learning (handout: assignments/a9_federated.md).
# Generated from tinytrain/parallel/federated.py by `python -m grader stubs`. Replace each
# `raise NotImplementedError("TODO ...")` with your code; grade it with `python -m grader`.

"""Federated learning: the data stays with its clients, only model updates travel (FedAvg).

C clients each hold their own shard of the training data, which no other client (and no other
rank) reads. N ranks simulate them, rank r hosting clients r·C/N … (r+1)·C/N − 1. One round::

    θ (the same on every rank)
      │  the round's clients: a seeded draw of m = round(F·C) of the C (--participation F)
      ▼
    rank r, for each of its selected clients c, one after the other:
        θ_c ← θ;  H local steps (--local-steps) of the loop's optimizer on batches of c's own data
        Δ_c = θ − θ_c                  how far client c moved; n_c = the samples c holds
      │
      │  one all-reduce (sum) over the ranks                                         ◄── the only
      ▼                                                                               communication
    every rank: θ ← θ − Δ, Δ the samples-weighted mean of the Δ_c   the server's FedAvg step (McMahan et al. 2017)

The "server" is every rank at once: the sum arrives everywhere, so every rank takes the same
step and no parameters are sent back. What would travel in a real deployment is each selected
client's upload of Ψ and its download of Ψ; here the ranks' all-reduce carries the same sum.

Three things make it federated rather than local SGD (``data_parallel.LocalSGD``, whose H = 1,
all-clients, plain-SGD case this equals, as synchronous data parallel):

1. **Own data, skewed** (``partition``): ``iid`` splits the pool at random into equal shards;
   ``skew:ALPHA`` gives every label class proportions over the clients drawn from Dirichlet(ALPHA)
   (Hsu et al. 2019): small ALPHA, each client sees a few classes and sample counts differ widely.
   The label is the addition task's first answer digit, or a text window's first character.
2. **Weighting** (task 9.1, ``weighted_average``): a client with more samples counts more; a
   client with none counts zero; no data anywhere leaves θ where it was.
3. **Privacy of the updates**:
   - secure aggregation (task 9.2, ``pairwise_mask``; Bonawitz et al. 2017): every pair of the
     round's clients derives one seed and adds opposite masks, so the sum is exact and no single
     masked update says anything about its client's. Updates travel as fixed-point integers
     modulo 2^64 (``encode``), where the masks cancel exactly and a masked value is uniform;
     float64 masks would cancel only up to rounding. Left out: the key agreement (the pair's seed
     comes from the run's seed, which every rank knows) and the recovery of a client that drops
     after masking (``secure_sum`` refuses it, naming the client);
   - differential privacy (task 9.3, ``private_average``; DP-FedAvg, McMahan et al. 2018): each
     update clipped to norm S (``--clip``), Gaussian noise of std σ·S (``--dp-noise σ``) added once
     to the sum by the server, divided by the expected count of clients. One client then moves the
     sum by at most S, and the privacy spent, ε at δ, comes from Google's ``dp-accounting``
     (``privacy_spent``), not from a formula of ours.
"""

from __future__ import annotations

import zlib

import numpy

from tinytrain import distributed as dist
from tinytrain import random as _random
from tinytrain import trace
from tinytrain.backend import to_host, xp
from tinytrain.optim import clip_grad_norm_
from tinytrain.parallel.wrapper import Wrapper, broadcast_parameters, flatten, trainable, unflatten_into

FRACTION_BITS = 32  # secure aggregation's fixed point: a value v travels as round(v · 2^32) mod 2^64


# ================================================================================================
# The clients and their data
# ================================================================================================


def parse_partition(text: str) -> float | None:
    """``iid`` -> None; ``skew:ALPHA`` -> ALPHA (a positive number: the Dirichlet concentration)."""
    if text == "iid":
        return None
    kind, _, value = text.partition(":")
    try:
        alpha = float(value)
    except ValueError:
        alpha = float("nan")
    if kind != "skew" or not alpha > 0 or alpha == float("inf"):
        raise ValueError(
            f"--partition is iid or skew:ALPHA with ALPHA > 0 (0.1: very skewed, 100: nearly iid), got {text!r}"
        )
    return alpha


def partition(labels, clients: int, scheme: str = "iid", seed: int = 0) -> list:
    """Each client's indices into the pool whose labels are ``labels``: disjoint, together all of
    them (``iid``: but for fewer than ``clients``), each sorted. ``iid``: a seeded shuffle cut into
    ``clients`` equal shards.
    ``skew:ALPHA``: every class's samples cut by proportions over the clients drawn from
    Dirichlet(ALPHA, ..., ALPHA), so that a client's share of each class differs."""
    alpha = parse_partition(scheme)
    labels = numpy.asarray(labels)
    rng = numpy.random.default_rng([seed, 9])
    if alpha is None:  # equal shards (the pool's last size % clients examples of the shuffle go unused)
        order = rng.permutation(labels.size)[: labels.size - labels.size % clients]
        return [numpy.sort(s) for s in numpy.split(order, clients)]
    pieces = [[] for _ in range(clients)]
    for label in numpy.unique(labels):
        members = rng.permutation(numpy.flatnonzero(labels == label))
        cuts = (numpy.cumsum(rng.dirichlet(numpy.full(clients, alpha)))[:-1] * members.size).astype(int)
        for client, piece in enumerate(numpy.split(members, cuts)):
            pieces[client].append(piece)
    return [numpy.sort(numpy.concatenate(p)) for p in pieces]


class ClientData:
    """The pool of training examples (``dataset.examples()``) split over ``clients``; a client's
    batches are drawn from its own shard only."""

    def __init__(self, dataset, clients: int, scheme: str = "iid", seed: int = 0):
        if clients < 1:
            raise ValueError(f"--clients must be at least 1, got {clients}")
        self.dataset, self.clients, self.scheme = dataset, clients, scheme
        self.keys, self.labels = dataset.examples(seed=seed)
        if self.keys.size < clients:
            raise ValueError(
                f"--clients {clients} is more than the {self.keys.size} training examples: use fewer clients"
            )
        self.shards = partition(self.labels, clients, scheme, seed)

    def count(self, client: int) -> int:
        """n_c: the samples client ``client`` holds (FedAvg's weight)."""
        return int(self.shards[client].size)

    def batch(self, client: int, rows: int, key) -> tuple:
        """``rows`` examples of the client's own shard (drawn with replacement from ``key``)."""
        shard = self.shards[client]
        picks = shard[numpy.random.default_rng([*key, client, 11]).integers(0, shard.size, size=rows)]
        return self.dataset.rows(self.keys[picks])

    def label_shares(self) -> numpy.ndarray:
        """(clients, classes): each client's share of each label class (rows of zeros: no data)."""
        classes = numpy.unique(self.labels)
        counts = numpy.array([[(self.labels[s] == k).sum() for k in classes] for s in self.shards], dtype=float)
        return counts / numpy.maximum(counts.sum(axis=1, keepdims=True), 1)


def selected_count(clients: int, participation: float) -> int:
    """m: the clients of a round, round(F·C), at least one."""
    return max(1, round(participation * clients))


def select_clients(clients: int, participation: float, key) -> list[int]:
    """The round's clients: m of the C drawn without replacement from ``key`` (the same on every rank), sorted."""
    rng = numpy.random.default_rng([*key, 7])
    return sorted(rng.choice(clients, size=selected_count(clients, participation), replace=False).tolist())


def hosted_clients(rank: int, ranks: int, clients: int) -> range:
    """The clients rank ``rank`` of ``ranks`` simulates: a contiguous block of C/N."""
    per = clients // ranks
    return range(rank * per, (rank + 1) * per)


# ================================================================================================
# Sums over every rank's clients: in the clear, or masked
# ================================================================================================


def plain_sum(vectors: list, size: int, group=None):
    """Σ of ``vectors`` (float64, ``size`` each) over this rank's clients and every other rank's:
    one all-reduce. A rank with no client of the round takes part with zeros."""
    total = xp.zeros(size, dtype=xp.float64)
    for v in vectors:
        total += v
    return dist.all_reduce(total, op="sum", group=group, algo="ring")


def encode(vector):
    """Fixed point modulo 2^64: round(v · 2^FRACTION_BITS) as uint64 (negative values wrap). Sums of
    encodings, wrapping, are the encoding of the sum while it stays within ±2^(63 - FRACTION_BITS)."""
    scaled = xp.rint(xp.asarray(vector, dtype=xp.float64) * 2.0**FRACTION_BITS)
    if scaled.size and float(xp.abs(scaled).max()) >= 2.0**62:
        raise ValueError(
            f"secure aggregation: an update element of {float(xp.abs(scaled).max()) / 2**FRACTION_BITS:.3g} is too "
            f"large for the fixed point of {FRACTION_BITS} fraction bits (below 2^{62 - FRACTION_BITS}, so that "
            f"sums stay within 2^{63 - FRACTION_BITS}): lower --lr or use --clip"
        )
    return scaled.astype(xp.int64).view(xp.uint64)


def decode(total):
    """The float64 values of a sum of encodings (uint64 modulo 2^64 read as signed)."""
    return total.view(xp.int64).astype(xp.float64) / 2.0**FRACTION_BITS


def mask_stream(seed, size: int):
    """``size`` uniform 64-bit integers, a pure function of ``seed`` (a tuple of integers)."""
    return xp.asarray(numpy.random.Generator(numpy.random.PCG64(list(seed))).bit_generator.random_raw(size))


def pairwise_mask(client: int, selected: list[int], key, size: int):
    """Client ``client``'s mask in a round whose clients are ``selected`` and whose seed is ``key``
    (a tuple of integers: the run's seed and the round), as uint64 modulo 2^64: the masks of all the
    round's clients add up to zero, and each pair's part is a function of the key and the pair alone."""
    raise NotImplementedError("TODO 9.2: This client's share of the round's masking: masks that only the round's clients could have made, that hide each upload, and that vanish from the sum of the round's uploads, whichever rank computes them.")


def secure_sum(vectors: dict, selected: list[int], key, size: int, group=None, dropped=()):
    """Σ of ``vectors`` ({client: float64 vector}, this rank's clients of the round) over every
    rank's, where each client sends only ``encode(v) + pairwise_mask``: exact, whatever the masks.
    A client that drops after masking leaves its masks in the sum; Bonawitz et al. recover them
    from secret shares of its seeds, which this chapter leaves out, so it is refused."""
    if dropped:
        raise RuntimeError(
            f"secure aggregation: client(s) {sorted(dropped)} dropped after masking, so their pairwise masks with "
            "the others do not cancel and the sum is noise; recovering them needs the secret-shared seeds of "
            "Bonawitz et al., which tinytrain leaves out: run the round again without them"
        )
    total = xp.zeros(size, dtype=xp.uint64)
    for client, v in vectors.items():
        total += masked_update(v, client, selected, key)
    return decode(dist.all_reduce(total, op="sum", group=group, algo="ring"))


def masked_update(vector, client: int, selected: list[int], key):
    """What client ``client`` sends under secure aggregation: its encoded vector plus its mask."""
    return encode(vector) + pairwise_mask(client, selected, key, vector.size)


# ================================================================================================
# The server's average: weighted by samples (FedAvg), or clipped and noised (DP-FedAvg)
# ================================================================================================


def weighted_average(updates: list, counts: list[int], total_of):
    """FedAvg's average Σ n_c·Δ_c / Σ n_c over the round's clients on every rank, as float64,
    from this rank's ``updates`` (flat arrays) and ``counts`` (n_c, one per update, 0 allowed).
    ``total_of(vectors)`` returns the sum of float64 vectors over every rank's clients (it is
    ``plain_sum`` or ``secure_sum`` bound to the round; every rank calls it once, with no vector
    if it hosts no client of the round). No sample anywhere: zeros (θ stays)."""
    raise NotImplementedError("TODO 9.1: FedAvg's average of the round's updates over every rank's clients, each counting as much as the samples behind it, the same on every rank; a round without any sample leaves the parameters where they were.")


def clip_update(delta, max_norm: float):
    """``delta`` scaled down to L2 norm ``max_norm`` if longer (norm in float64), as a float64 copy."""
    raise NotImplementedError("TODO 9.3: A copy of the update whose L2 norm is at most the bound, pointing where the update points, unchanged when already within it (a zero update included).")


def private_average(updates: list, max_norm: float, sigma: float, expected: int, rng, total_of):
    """DP-FedAvg's average: each update clipped to ``max_norm`` (S), summed over every rank's
    clients with ``total_of`` (as in ``weighted_average``; each client counts once, whatever its
    samples: a weight would scale what one client can move), Gaussian noise of std σ·S drawn from
    ``rng`` (the server's: the same generator on every rank) added once to the sum, divided by
    ``expected`` (the round's count of clients m, fixed: a count that depends on who took part
    would itself tell)."""
    raise NotImplementedError("TODO 9.3: DP-FedAvg's release of the round, as the paper defines it: what any one client can move is bounded, the server's noise is drawn once and is the same on every rank.")


def privacy_spent(rounds: int, sampling: float, sigma: float, delta: float) -> float:
    """ε at ``delta`` after ``rounds`` rounds, each sampling clients with probability ``sampling``
    and adding Gaussian noise of ``sigma`` times the clip bound: Google's ``dp-accounting`` RDP
    accountant, the rounds' selections taken as Poisson sampling with q = m/C (the analysis
    DP-FedAvg gives; tinytrain draws exactly m, the usual stand-in)."""
    try:
        import dp_accounting
        from dp_accounting import rdp
    except ImportError:
        raise ImportError(
            "the privacy spent (ε) is computed by Google's dp-accounting library: pip install 'tinytrain[privacy]'"
        ) from None
    if rounds == 0:
        return 0.0
    orders = list(range(2, 64)) + [128, 256, 512]  # integer orders: exact sums (fractional ones warn and may drop)
    accountant = rdp.RdpAccountant(orders)
    event = dp_accounting.PoissonSampledDpEvent(sampling, dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    return float(accountant.get_epsilon(delta))


# ================================================================================================
# The wrapper: one training-loop step is one round
# ================================================================================================


class FedAvg(Wrapper):
    """``tinytrain train --dp N --dp-algo fedavg``: one step of the loop is one round.

    ``forward_backward`` (through ``round_gradients``) draws the round's clients and computes, for
    each of this rank's, the loss and gradient of θ on its first local batch (the first local
    step's; the loss printed is their mean over the round's clients: the global model's loss on
    the data it trains on). ``step`` then runs the rest: each client's H local steps from θ with
    the loop's optimizer (its state fresh for every client and round: it is the client's), the
    average of the updates (plain, masked, or clipped and noised), and the server's step θ ← θ − Δ.
    ``clip_grad_norm_`` sets the bound every local step clips to and returns the largest first-step
    gradient norm of the round's clients, before clipping.
    """

    def __init__(
        self,
        module,
        data: ClientData,
        batch_size: int,
        participation: float = 1.0,
        local_steps: int = 1,
        secure: bool = False,
        noise: float = 0.0,
        clip: float | None = None,
        delta: float = 1e-5,
        group=None,
    ):
        super().__init__(module)
        self.data, self.group, self.optimizer = data, group, None
        self.participation, self.local_steps, self.secure = participation, local_steps, secure
        self.noise, self.clip, self.delta = noise, clip, delta  # clip set: DP-FedAvg (noise 0: clipping alone)
        self.per_client = batch_size // selected_count(data.clients, participation)
        self.rank, self.ranks = dist.get_rank(group), dist.get_world_size(group)
        if data.clients % self.ranks:
            raise ValueError(
                f"{data.clients} clients do not split over {self.ranks} ranks: use a multiple of {self.ranks}"
            )
        self.hosted = hosted_clients(self.rank, self.ranks, data.clients)
        broadcast_parameters(module, group=group)
        self.params = trainable(module)
        self.size = sum(p.size for p in self.params)
        self.max_norm = None  # every local step's gradient clipping (--grad-clip), set by the loop
        self.rounds = self.moved = 0  # rounds taken, bytes this rank sent and received for the sums
        self.selected: list[int] = []
        self.first: dict = {}  # client -> (its first local step's gradients, loss) this round
        self.epsilon, self.spent_rounds = None, 0  # privacy spent so far, over so many rounds (--dp-noise)
        self.loss = None  # the last round's mean first-batch loss

    @property
    def steps(self) -> int:
        return self.rounds

    def round_key(self) -> tuple:
        """(seed, step) of the loop's step: the round's clients, batches, masks and noise come from it."""
        return tuple(int(k) for k in _random.current_seed())

    def round_gradients(self) -> float:
        """The round's clients; for each of this rank's, the first local step's gradients at θ.
        Returns the mean first-batch loss over the round's clients that hold data (every rank)."""
        key = self.round_key()
        self.selected = select_clients(self.data.clients, self.participation, key)
        self.first, loss_sum = {}, 0.0
        for client in (c for c in self.selected if c in self.hosted and self.data.count(c)):
            loss = self._local_backward(client, 0, key)
            self.first[client] = ([p.grad for p in self.params], loss)
            loss_sum += loss
        totals = xp.asarray([loss_sum, len(self.first)], dtype=xp.float64)
        dist.all_reduce(totals, group=self.group)
        if totals[1]:
            self.loss = float(totals[0] / totals[1])
        elif self.loss is None:
            raise ValueError(
                f"none of round 1's {len(self.selected)} clients holds a sample (--partition {self.data.scheme} left "
                "them empty), so the round has no loss to report: use a larger skew ALPHA, more --participation or "
                "fewer --clients"
            )
        return self.loss  # a round whose clients hold no data: the last round's loss, the model unchanged

    def _local_backward(self, client: int, h: int, key) -> float:
        """Forward and backward of client ``client``'s local step ``h``: the gradients land in ``.grad``."""
        x, y = self.data.batch(client, self.per_client, (*key, h))
        for p in self.params:
            p.grad = None
        _random.manual_seed((*key, client, h))  # dropout masks: the client's and step's own
        with trace.span(f"client {client} step {h}", cat="compute"):
            loss = self.module.loss(xp.asarray(x), xp.asarray(y))
            loss.backward()
        _random.manual_seed(key)
        return loss.item()

    def clip_grad_norm_(self, max_norm: float) -> float:
        self.max_norm = max_norm
        norms = [_norm(grads) for grads, _ in self.first.values()]
        largest = xp.asarray([max(norms, default=0.0)], dtype=xp.float64)
        return float(dist.all_reduce(largest, op="max", group=self.group)[0])

    def step(self) -> None:
        """The rest of the round: local steps, the average of the updates, the server's step."""
        key, theta = self.round_key(), flatten([p.data for p in self.params])
        updates, counts = [], []
        for client in (c for c in self.selected if c in self.hosted):
            updates.append(self._train_client(client, theta, key) if self.data.count(client) else xp.zeros_like(theta))
            counts.append(self.data.count(client))
        with dist.comm_stats() as stats:
            average = self.average(updates, counts, key)
        self.moved += stats.sent("all_reduce") + stats.recv("all_reduce")
        unflatten_into((theta - average).astype(theta.dtype), [p.data for p in self.params])
        for p in self.params:
            p.grad = None
        self.rounds += 1
        if self.noise:  # over every round so far: the step number (a resumed run counts the rounds before it)
            q = selected_count(self.data.clients, self.participation) / self.data.clients
            self.spent_rounds = key[-1]
            self.epsilon = privacy_spent(self.spent_rounds, q, self.noise, self.delta)

    def _train_client(self, client: int, theta, key):
        """Client ``client``'s H local steps from θ; returns Δ_c = θ − θ_c."""
        unflatten_into(theta, [p.data for p in self.params])
        self.optimizer.state = {}  # the client's own optimizer, new each round
        grads, _ = self.first.pop(client)
        for h in range(self.local_steps):
            if h:
                self._local_backward(client, h, key)
            else:
                for p, g in zip(self.params, grads):
                    p.grad = g
            if self.max_norm:
                clip_grad_norm_(self.params, self.max_norm)
            self.optimizer.step()
        return theta - flatten([p.data for p in self.params])

    def average(self, updates: list, counts: list[int], key):
        """The round's update Δ (float64), the same on every rank."""
        hosted = [c for c in self.selected if c in self.hosted]
        if self.secure:

            def total_of(vectors):
                return secure_sum(dict(zip(hosted, vectors)), self.selected, key, size, self.group)
        else:

            def total_of(vectors):
                return plain_sum(vectors, size, self.group)

        size = self.size + (self.clip is None)  # (what weighted_average's contract gives total_of)
        if self.clip is not None:
            rng = numpy.random.default_rng([*key, zlib.crc32(b"server noise")])
            return private_average(updates, self.clip, self.noise, len(self.selected), rng, total_of)
        return weighted_average(updates, counts, total_of)


def _norm(arrays) -> float:
    return float(numpy.sqrt(sum(float((to_host(a).astype(numpy.float64) ** 2).sum()) for a in arrays if a is not None)))


__all__ = [
    "ClientData",
    "FedAvg",
    "clip_update",
    "decode",
    "encode",
    "hosted_clients",
    "mask_stream",
    "pairwise_mask",
    "parse_partition",
    "partition",
    "plain_sum",
    "private_average",
    "privacy_spent",
    "secure_sum",
    "select_clients",
    "selected_count",
    "weighted_average",
]
