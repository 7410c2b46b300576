"""Assignment 2 (data parallel), graded. Run: ``python -m grader --tasks 2.*`` (4 ranks).

Every test trains a tiny GPT with ``impl.data_parallel`` (your ``assignments/a2_data_parallel.py``
or the reference) and compares with a serial run of the same model on the same global batches,
which every rank computes itself. The model seed and the data are drawn when the test runs (all
ranks agree), so only a real implementation passes; replay with ``TINYTRAIN_GRADER_SEED=<seed>``.
SGD (momentum 0.9) is used because it is sensitive to a missing average (Adam is not); parameters
must agree within atol 1e-6 (float32 rounding of sums taken in a different order) and be
bitwise identical on every rank. Communication is counted exactly with ``dist.comm_stats()``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from grader.mpi_reference import mpi
from grader.seeds import grading_seed
from tinytrain import distributed as dist
from tinytrain import functional as F
from tinytrain.autograd import Parameter
from tinytrain.backend import to_host, xp
from tinytrain.data import shard_rows
from tinytrain.distributed import work
from tinytrain.nn import GPT, GPTConfig
from tinytrain.optim import SGD
from tinytrain.testing import assert_matches_serial

VOCAB, T, ROWS, STEPS = 16, 8, 16, 2


class Case:
    """Shared random choices: model seed and data seed, agreed by all ranks."""

    def __init__(self):
        self.seed = grading_seed()

    def model(self, freeze=()):
        m = GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, n_embd=32), seed=self.seed % 1000)
        for name, p in m.named_parameters():
            if name.startswith(tuple(freeze)):
                p.requires_grad = False
        return m

    def batch(self, step):
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, VOCAB, size=(ROWS, T)), rng.integers(0, VOCAB, size=(ROWS, T))

    def what(self, text):
        return f"{text} (seed {self.seed}, rank {dist.get_rank()})"


def sgd(model):
    return SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def loss_on(model, x, y, scale=1.0):
    return F.cross_entropy(model(xp.asarray(x)), xp.asarray(y)) * scale


def serial(case, freeze=()):
    model = case.model(freeze)
    opt = sgd(model)
    for t in range(STEPS):
        opt.zero_grad()
        loss_on(model, *case.batch(t)).backward()
        opt.step()
    return {n: to_host(p.data) for n, p in model.named_parameters()}


def serial_gradients(case, freeze=()):
    """The serial run's gradients of the first step (a synchronized gradient must equal them)."""
    model = case.model(freeze)
    loss_on(model, *case.batch(0)).backward()
    return {n: to_host(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def train(case, model, wrapper, step, accum=1, grads=None, same_as=None):
    """``STEPS`` steps on this rank's rows; with ``grads`` (the serial first-step gradients) each
    synchronized gradient is checked after the first step (the optimizer leaves ``.grad`` alone);
    with ``same_as`` (a rank) every rank's parameters must equal that rank's after every step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    opt_zero = [p for p in model.parameters()]
    for t in range(STEPS):
        for p in opt_zero:
            p.grad = None
        x, y = (shard_rows(a, rank, n) for a in case.batch(t))
        for i, (xi, yi) in enumerate(zip(np.split(x, accum), np.split(y, accum))):
            quiet = wrapper.no_sync() if i < accum - 1 else contextlib.nullcontext()
            with quiet:
                wrapper.backward(loss_on(wrapper, xi, yi, 1.0 / accum))
        step()
        if t == 0 and grads is not None:
            check_gradients(case, model, grads, type(wrapper).__name__)
        if same_as is not None:
            check_same_as(case, model, same_as, t)


def check_same_as(case, model, owner, t):
    """Parameters equal to rank ``owner``'s, compared with MPI's broadcast (not counted as traffic)."""
    for name, p in model.named_parameters():
        theirs = np.ascontiguousarray(to_host(p.data)).copy()
        mpi(dist.world(), "Bcast", theirs, root=owner)
        assert np.array_equal(theirs, to_host(p.data)), case.what(
            f"after step {t + 1}, parameter {name} differs from rank {owner}'s: every rank must end each step "
            "with the same parameters (a worker copies the parameters it pulls into its model)"
        )


def check_gradients(case, model, want, text, n=4):
    """Each gradient against the serial run's; a clean factor or the opposite sign is named."""
    for name, p in model.named_parameters():
        if name in want:
            got = xp.zeros_like(p.data) if p.grad is None else p.grad
            diagnosed(got, want[name], n, case.what(f"{text}: the synchronized gradient of {name}"))


def diagnosed(got, want, n, what):
    """``assert_matches_serial``, which names a clean factor (x4, x1/4, ...), and the opposite sign."""
    try:
        assert_matches_serial(got, want, n, what)
    except AssertionError:
        a, e = np.asarray(to_host(got), dtype=np.float64), np.asarray(want, dtype=np.float64)
        if a.shape == e.shape and np.allclose(-a, e, rtol=1e-4, atol=1e-6):
            raise AssertionError(f"{what} is the serial value with the opposite sign (x-1)") from None
        raise


def check_params(case, model, want, text):
    for name, p in model.named_parameters():
        got = to_host(p.data)
        assert_matches_serial(got, want[name], 4, case.what(f"{text}: parameter {name}"))
        first = np.ascontiguousarray(got).copy()
        dist.broadcast(first, src=0)
        assert np.array_equal(first, got), case.what(f"{text}: {name} differs between rank 0 and this rank")


def ring_bytes(length, n, rank):
    c = dist.split_counts(length, n)
    return 4 * (2 * length - c[(rank + 1) % n] - c[(rank + 2) % n])


# --- 2.1 naive DDP ---------------------------------------------------------------------------------


@pytest.mark.task("2.1")
@pytest.mark.world_size(4)
def test_naive_ddp_matches_serial_and_sends_one_ring_per_gradient(impl):
    case = Case()
    want = serial(case)
    model = case.model()
    if dist.get_rank() != 0:  # different starting weights: the wrapper must broadcast rank 0's
        for p in model.parameters():
            p.data += 1.0
    ddp = impl.data_parallel.NaiveDDP(model)
    opt = sgd(model)
    with dist.comm_stats() as stats:
        train(case, model, ddp, opt.step, grads=serial_gradients(case))
    check_params(case, model, want, "NaiveDDP")
    expected = STEPS * sum(ring_bytes(p.size, 4, dist.get_rank()) for p in model.parameters())
    assert stats.sent("all_reduce") == expected, case.what(
        f"NaiveDDP sent {stats.sent('all_reduce')} bytes of all_reduce, expected {expected}: one ring all-reduce "
        "(algo='ring') of each gradient per step"
    )


# --- 2.2 bucketed DDP ------------------------------------------------------------------------------


@pytest.mark.task("2.2")
@pytest.mark.world_size(4)
def test_bucketed_ddp_launches_every_bucket_during_backward_in_reverse_order(impl):
    case = Case()
    rank = dist.get_rank()
    model = case.model()
    ddp = impl.data_parallel.BucketedDDP(model, bucket_mb=0.015)
    params = [p for p in model.parameters() if p.requires_grad]
    order = [p for b in ddp.buckets for p in b.params]
    assert order == params[::-1], case.what("buckets must hold the parameters in reverse registration order")
    assert len(ddp.buckets) > 2
    x, y = (shard_rows(a, rank, 4) for a in case.batch(0))
    loss = loss_on(ddp, x, y)
    launched = []
    for b in ddp.buckets:  # record the moment each bucket's all-reduce starts
        b.launch = (lambda orig, b=b: lambda *a, **k: (launched.append(b), orig(*a, **k)))(b.launch)
    loss.backward()  # only the engine: every bucket must have been launched by the hooks
    assert launched == ddp.buckets, case.what(
        f"{len(launched)} of {len(ddp.buckets)} buckets were launched during backward, in order "
        f"{[ddp.buckets.index(b) for b in launched]}; launch each as soon as it is full, in bucket order"
    )
    ddp.finish_gradient_sync()


@pytest.mark.task("2.2")
@pytest.mark.world_size(4)
def test_bucketed_ddp_posts_each_all_reduce_during_backward_and_waits_only_after_it(impl, monkeypatch):
    """The order of events, not a count: each bucket's all-reduce is posted while the backward of
    earlier layers still has gradients to produce, and waited for only once backward has ended."""
    case = Case()
    rank = dist.get_rank()
    model = case.model()
    ddp = impl.data_parallel.BucketedDDP(model, bucket_mb=0.015, poll=True)
    events = []  # ("ready", p) after the wrapper's own hook, ("post", bucket), ("wait", bucket)
    for p in ddp.params:
        p.register_post_accumulate_grad_hook(lambda p: events.append(("ready", id(p))))
    for b in ddp.buckets:
        b.launch = (lambda orig, b=b: lambda *a, **k: (events.append(("post", b)), orig(*a, **k))[1])(b.launch)
    wait = work.Work.wait

    def waiting(w, *args, **kwargs):
        for b in ddp.buckets:
            if w is b.work:
                events.append(("wait", b))
        return wait(w, *args, **kwargs)

    monkeypatch.setattr(work.Work, "wait", waiting)
    x, y = (shard_rows(a, rank, 4) for a in case.batch(0))
    ddp.backward(loss_on(ddp, x, y))
    last_ready = max(i for i, (kind, _) in enumerate(events) if kind == "ready")
    for k, b in enumerate(ddp.buckets):
        posted = [i for i, e in enumerate(events) if e == ("post", b)]
        waited = [i for i, e in enumerate(events) if e == ("wait", b)]
        assert posted, case.what(f"bucket {k}'s all-reduce was never posted")
        if k < len(ddp.buckets) - 1:
            assert posted[0] < last_ready, case.what(
                f"bucket {k}'s all-reduce was posted after backward had produced every gradient: post it when "
                "the bucket is full, while the earlier layers' backward still runs"
            )
        assert waited and waited[0] > last_ready, case.what(
            f"bucket {k}'s all-reduce was waited for "
            + ("never" if not waited else "while backward was still producing gradients")
            + ": a blocking (or early-waited) all-reduce hides nothing behind backward; post it asynchronously "
            "and wait for every bucket only once backward has ended"
        )


@pytest.mark.task("2.2")
@pytest.mark.world_size(4)
def test_bucketed_ddp_matches_serial_with_frozen_and_tied_weights(impl):
    case = Case()
    frozen = ("wpe", "blocks.1.ln_2")
    want = serial(case, frozen)
    model = case.model(frozen)
    ddp = impl.data_parallel.BucketedDDP(model, bucket_mb=0.01, poll=True)
    opt = sgd(model)
    with dist.comm_stats() as stats:
        train(case, model, ddp, opt.step, grads=serial_gradients(case, frozen))
    check_params(case, model, want, "BucketedDDP")
    expected = STEPS * sum(ring_bytes(b.buffer.size, 4, dist.get_rank()) for b in ddp.buckets)
    assert stats.sent("all_reduce") == expected, case.what(
        "one ring all-reduce per bucket per step (the tied embedding once, frozen parameters never)"
    )


# --- 2.3 gradient accumulation ---------------------------------------------------------------------


@pytest.mark.task("2.3")
@pytest.mark.world_size(4)
@pytest.mark.parametrize("kind", ["NaiveDDP", "BucketedDDP"])
def test_no_sync_accumulates_without_communicating(impl, kind):
    case = Case()
    want = serial(case)
    model = case.model()
    ddp = getattr(impl.data_parallel, kind)(model)
    opt = sgd(model)
    x, y = (shard_rows(a, dist.get_rank(), 4) for a in case.batch(0))
    with dist.comm_stats() as stats:
        with ddp.no_sync():
            ddp.backward(loss_on(ddp, x, y))
    assert stats.sent() == 0, case.what("a backward inside no_sync() must not communicate")
    assert ddp.require_sync, "no_sync() must restore synchronization when the block ends"
    check_no_sync_restores_the_previous_state(ddp)
    opt.zero_grad()
    train(case, model, ddp, opt.step, accum=4)
    check_params(case, model, want, f"{kind} with 4 accumulated micro-batches")


class _Boom(Exception):
    pass


def check_no_sync_restores_the_previous_state(ddp) -> None:
    with ddp.no_sync():
        with ddp.no_sync():
            pass
        assert not ddp.require_sync, (
            "a no_sync() nested inside another must leave synchronization off when it ends (restore the "
            "previous value, not True)"
        )
    assert ddp.require_sync, "no_sync() must restore synchronization when the outer block ends"
    with contextlib.suppress(_Boom), ddp.no_sync():
        raise _Boom
    assert ddp.require_sync, (
        "no_sync() must restore the previous state when the block ends with an exception (try/finally)"
    )


# --- a parameter unused on one rank, poll, a gradient ready twice ----------------------------------

USES_AUX = (True, True, True, False)  # rank 3's loss never touches `aux`: its gradient stays None there


def with_aux(case, model):
    """``model`` plus a parameter ``aux`` whose loss term ranks 0-2 add and rank 3 does not."""
    model.aux = Parameter(xp.asarray(np.random.default_rng(case.seed).normal(size=8).astype(np.float32)))
    return model


def aux_term(model, share):
    return (model.aux * model.aux).sum() * share


def serial_with_aux(case):
    model = with_aux(case, case.model())
    opt = sgd(model)
    for t in range(STEPS):
        opt.zero_grad()
        (loss_on(model, *case.batch(t)) + aux_term(model, sum(USES_AUX) / 4)).backward()
        opt.step()
    return {n: to_host(p.data) for n, p in model.named_parameters()}


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("NaiveDDP", marks=pytest.mark.task("2.1")),
        pytest.param("BucketedDDP", marks=pytest.mark.task("2.2")),
    ],
)
def test_a_parameter_without_gradient_on_one_rank_still_takes_part(impl, kind):
    """A parameter no rank-3 loss uses has no gradient there (None): rank 3 must still take part in
    its all-reduce (or its push), with zeros, or the ranks' messages no longer match. (Local SGD:
    its own test below, with an inner SGD for which a skipped step is a zero one.)"""
    case = Case()
    want = serial_with_aux(case)
    rank = dist.get_rank()
    model = with_aux(case, case.model())
    opt = sgd(model)
    if kind == "ParameterServer":
        ddp, step = impl.data_parallel.ParameterServer(model, opt), None
    elif kind == "AsyncParameterServer":  # bound 0: the synchronous server, so the serial run
        ddp = impl.data_parallel.AsyncParameterServer(model, opt, max_staleness=0, order="seeded", seed=case.seed)
        step = None
    else:
        ddp, step = getattr(impl.data_parallel, kind)(model), opt.step
    for t in range(STEPS):
        for p in model.parameters():
            p.grad = None
        x, y = (shard_rows(a, rank, 4) for a in case.batch(t))
        loss = loss_on(ddp, x, y)
        ddp.backward(loss + aux_term(model, 1.0) if USES_AUX[rank] else loss)
        (step or ddp.step)()
    check_params(case, model, want, f"{kind} with a parameter that has no gradient on rank 3")


def _no_gradient_on_rank_3(impl, kind):
    test_a_parameter_without_gradient_on_one_rank_still_takes_part(impl, kind)


@pytest.mark.task("2.2")
@pytest.mark.world_size(4)
def test_bucketed_ddp_polls_while_backward_runs_and_refuses_a_gradient_ready_twice(impl, monkeypatch):
    case = Case()
    rank = dist.get_rank()
    model = case.model()
    ddp = impl.data_parallel.BucketedDDP(model, bucket_mb=0.015, poll=True)
    polls = []
    progress_all = dist.progress_all
    monkeypatch.setattr(dist, "progress_all", lambda *a, **k: (polls.append(1), progress_all(*a, **k))[1])
    x, y = (shard_rows(a, rank, 4) for a in case.batch(0))
    hooks = sum(p.requires_grad for p in model.parameters())
    loss_on(ddp, x, y).backward()  # only the engine, so only the hooks can have polled
    assert len(polls) >= hooks, case.what(
        f"with poll=True the hooks called dist.progress_all() {len(polls)} times during a backward of {hooks} "
        "gradients: poll once per ready gradient, so the launched all-reduces move while backward runs"
    )
    try:
        loss_on(ddp, x, y).backward()  # before the gradients were synchronized: each is ready twice
        twice = None
    except Exception as exc:  # noqa: BLE001 - any clear error will do
        twice = exc
    finally:
        ddp.finish_gradient_sync()
    assert twice is not None and not isinstance(twice, NotImplementedError), case.what(
        "a second backward before the gradients were synchronized must raise (a gradient ready twice in one "
        "step would be averaged with the wrong data); it passed silently"
    )


# --- 2.4 parameter server --------------------------------------------------------------------------


@pytest.mark.task("2.4")
@pytest.mark.world_size(4)
def test_parameter_server_matches_serial_and_everything_goes_through_the_server(impl):
    case = Case()
    want = serial(case)
    model = case.model()
    opt = sgd(model)
    ps = impl.data_parallel.ParameterServer(model, opt)
    grads = serial_gradients(case) if ps.rank == ps.server else None  # workers keep their own
    with dist.comm_stats() as stats:
        train(case, model, ps, ps.step, grads=grads, same_as=ps.server)
    check_params(case, model, want, "ParameterServer")
    psi_bytes = 4 * sum(p.size for p in model.parameters())
    moved = stats.sent() + stats.recv() - stats.sent("debug_check") - stats.recv("debug_check")
    expected = STEPS * (2 * 3 * psi_bytes if ps.rank == ps.server else 2 * psi_bytes)
    assert moved == expected, case.what(
        f"this rank moved {moved} bytes in {STEPS} steps, expected {expected}: each worker pushes its gradients "
        "and pulls the parameters once per step; the server receives and sends one copy per worker"
    )
    if ps.rank != ps.server:
        assert not opt.state, "only the server keeps optimizer state"


# --- 2.5 asynchronous parameter server -------------------------------------------------------------


def on_group(size):
    """(group, its rank) of the first ``size`` ranks (a fixed hard case: 3 of the 4 ranks), or None."""
    group = dist.new_group(range(size)) if size < dist.get_world_size() else None
    return (group, dist.get_rank()) if dist.get_rank() < size else (None, None)


def rows_of(case, t, rank, n):
    """This rank's rows of step t's batch, cut to a multiple of n rows (16 -> 15 for 3 ranks)."""
    x, y = case.batch(t)
    keep = ROWS - ROWS % n
    return shard_rows(x[:keep], rank, n), shard_rows(y[:keep], rank, n)


def serial_rows(case, n, steps=STEPS):
    """The serial run on the rows the n ranks together train on."""
    model = case.model()
    opt = sgd(model)
    for t in range(steps):
        opt.zero_grad()
        x, y = case.batch(t)
        loss_on(model, x[: ROWS - ROWS % n], y[: ROWS - ROWS % n]).backward()
        opt.step()
    return {name: to_host(p.data) for name, p in model.named_parameters()}


def serial_rows_gradients(case, n):
    """The serial run's first-step gradients on the rows the n ranks together train on."""
    model = case.model()
    x, y = case.batch(0)
    loss_on(model, x[: ROWS - ROWS % n], y[: ROWS - ROWS % n]).backward()
    return {name: to_host(p.grad) for name, p in model.named_parameters()}


def train_rows(case, model, wrapper, rank, n, steps=STEPS, first=0):
    for t in range(first, steps):
        for p in model.parameters():
            p.grad = None
        wrapper.backward(loss_on(wrapper, *rows_of(case, t, rank, n)))
        wrapper.step()


def replay_async(case, n, steps=STEPS):
    """One process plays the seeded asynchronous schedule (unbounded): each step the server's own
    gradient, then each worker's, computed on the parameters it last pulled, in the order drawn
    from (seed, step); every gradient is one update. Returns (parameters, staleness of each)."""
    model = case.model()
    opt = sgd(model)
    pulled = {w: [p.data.copy() for p in model.parameters()] for w in range(1, n)}
    version, seen, staleness = 0, dict.fromkeys(range(n), 0), []

    def apply(rank, weights, t):
        nonlocal version
        current = [p.data.copy() for p in model.parameters()]
        for p, w in zip(model.parameters(), weights):
            p.data[...] = w
            p.grad = None
        loss_on(model, *rows_of(case, t, rank, n)).backward()
        for p, c in zip(model.parameters(), current):
            p.data[...] = c
        opt.step()
        staleness.append(version - seen[rank])
        version += 1
        seen[rank] = version

    for t in range(steps):
        seen[0] = version
        apply(0, [p.data.copy() for p in model.parameters()], t)
        for w in np.random.default_rng([case.seed, t + 1]).permutation(list(range(1, n))).tolist():
            apply(w, pulled[w], t)
            pulled[w] = [p.data.copy() for p in model.parameters()]
    return {name: to_host(p.data) for name, p in model.named_parameters()}, staleness


@pytest.mark.task("2.5")
@pytest.mark.world_size(4)
@pytest.mark.parametrize("size", [4, 3])
def test_async_server_with_bound_0_is_the_synchronous_serial_run(impl, size):
    case = Case()
    group, rank = on_group(size)
    if group is None and rank is None:
        return
    model = case.model()
    server = impl.data_parallel.AsyncParameterServer(
        model, sgd(model), group=group, max_staleness=0, order="seeded", seed=case.seed
    )
    train_rows(case, model, server, rank, size, steps=1)
    if rank == 0:  # bound 0: the first update's gradient is the whole batch's, as the serial run's
        check_gradients(case, model, serial_rows_gradients(case, size), f"{size} ranks, bound 0", n=size)
    train_rows(case, model, server, rank, size, first=1)
    want = serial_rows(case, size)
    for name, p in model.named_parameters():
        assert_matches_serial(to_host(p.data), want[name], 4, case.what(f"{size} ranks, bound 0: parameter {name}"))
    if rank == 0:
        assert server.staleness == [0] * (size * STEPS), case.what(
            f"with --max-staleness 0 every gradient must be applied fresh: staleness {server.staleness}"
        )


@pytest.mark.task("2.5")
@pytest.mark.world_size(4)
@pytest.mark.parametrize("size", [4, 3])
def test_async_server_applies_each_gradient_as_it_arrives_and_measures_its_staleness(impl, size):
    case = Case()
    group, rank = on_group(size)
    if group is None and rank is None:
        return
    model = case.model()
    server = impl.data_parallel.AsyncParameterServer(model, sgd(model), group=group, order="seeded", seed=case.seed)
    with dist.comm_stats() as stats:
        train_rows(case, model, server, rank, size)
    psi_bytes = 4 * sum(p.size for p in model.parameters())
    moved = stats.sent("send") + stats.recv("recv")
    want_moved = STEPS * 2 * psi_bytes * ((size - 1) if rank == 0 else 1)
    assert moved == want_moved, case.what(
        f"moved {moved} bytes in {STEPS} steps, expected {want_moved}: each worker pushes its gradient once per "
        "step and gets the parameters back once"
    )
    if rank != 0:
        return
    want, staleness = replay_async(case, size)
    assert server.staleness == staleness, case.what(
        f"staleness {server.staleness}, expected {staleness}: each gradient is one update, applied as it "
        "arrives; its staleness is the updates applied since its worker last pulled"
    )
    for name, p in model.named_parameters():
        assert_matches_serial(to_host(p.data), want[name], 4, case.what(f"unbounded, {size} ranks: parameter {name}"))


@pytest.mark.task("2.5")
@pytest.mark.world_size(4)
@pytest.mark.parametrize("bound", [1, 2])
def test_async_server_never_exceeds_its_staleness_bound(impl, bound):
    case = Case()
    model = case.model()
    server = impl.data_parallel.AsyncParameterServer(
        model, sgd(model), max_staleness=bound, order="seeded", seed=case.seed
    )
    train_rows(case, model, server, dist.get_rank(), 4, steps=3)
    if dist.get_rank() != 0:
        return
    assert len(server.staleness) == 12 and max(server.staleness) <= bound, case.what(
        f"--max-staleness {bound}: staleness {server.staleness} (every gradient applied once, none more than "
        f"{bound} updates behind)"
    )
    assert max(server.staleness) == bound and server.version < 12, case.what(
        f"--max-staleness {bound}: {server.version} updates for 12 gradients, staleness {server.staleness}: "
        "hold an update back only while it would break the bound, and then average what waits"
    )


# --- 2.6 local SGD: the outer step -----------------------------------------------------------------


@pytest.mark.task("2.6")
@pytest.mark.world_size(4)
@pytest.mark.parametrize("size", [4, 3])
def test_local_sgd_with_one_local_step_is_the_serial_run(impl, size):
    case = Case()
    group, rank = on_group(size)
    if group is None and rank is None:
        return
    model = case.model()
    local = impl.data_parallel.LocalSGD(model, local_steps=1, group=group)
    local.optimizer = sgd(model)  # inner SGD with momentum: linear in the gradient
    before = {name: to_host(p.data).copy() for name, p in model.named_parameters()}
    train_rows(case, model, local, rank, size, steps=1)
    first = serial_rows(case, size, steps=1)
    for name, p in model.named_parameters():  # the first outer step's move, against the serial step's
        diagnosed(
            to_host(p.data) - before[name],
            first[name] - before[name],
            size,
            case.what(f"H = 1, {size} ranks: the first outer step's change of {name}"),
        )
    train_rows(case, model, local, rank, size, first=1)
    want = serial_rows(case, size)
    for name, p in model.named_parameters():
        assert_matches_serial(to_host(p.data), want[name], 4, case.what(f"H = 1, {size} ranks: parameter {name}"))


@pytest.mark.task("2.6")
@pytest.mark.world_size(4)
def test_local_sgd_with_a_parameter_without_gradient_on_one_rank(impl):
    """H = 1 with a plain inner SGD (no momentum, no decay: a step a replica skips for want of a
    gradient is a step with a zero one). Rank 3 never completes ``aux``, yet its replica must take
    part in the outer average of every parameter, and the run stays the serial run (whose loss adds
    the aux term with weight 3/4)."""
    case = Case()
    rank = dist.get_rank()
    serial_model = with_aux(case, case.model())
    opt = SGD(serial_model.parameters(), lr=0.1)
    for t in range(STEPS):
        opt.zero_grad()
        (loss_on(serial_model, *case.batch(t)) + aux_term(serial_model, sum(USES_AUX) / 4)).backward()
        opt.step()
    want = {n: to_host(p.data) for n, p in serial_model.named_parameters()}
    model = with_aux(case, case.model())
    local = impl.data_parallel.LocalSGD(model, local_steps=1)
    local.optimizer = SGD(model.parameters(), lr=0.1)
    for t in range(STEPS):
        for p in model.parameters():
            p.grad = None
        x, y = (shard_rows(a, rank, 4) for a in case.batch(t))
        loss = loss_on(local, x, y)
        local.backward(loss + aux_term(model, 1.0) if USES_AUX[rank] else loss)
        local.step()
    check_params(case, model, want, "LocalSGD (H = 1) with a parameter that has no gradient on rank 3")


@pytest.mark.task("2.6")
@pytest.mark.world_size(4)
def test_diloco_outer_step_moves_the_start_by_nesterov_on_the_average_delta_once_per_h_steps(impl):
    case = Case()
    model = case.model(freeze=("wpe",))  # a frozen parameter is neither averaged nor moved
    frozen = to_host(model.wpe.weight.data).copy()
    diloco = impl.data_parallel.LocalSGD.diloco(model, local_steps=2)
    diloco.optimizer = sgd(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    start, momentum = np.concatenate([to_host(p.data).ravel() for p in trained]), 0.0
    for outer in range(2):
        with dist.comm_stats() as stats:
            for t in range(2):
                for p in model.parameters():
                    p.grad = None
                diloco.backward(loss_on(diloco, *rows_of(case, 2 * outer + t, dist.get_rank(), 4)))
                if t == 1:  # the replicas, just before the outer step (MPI's gather, not counted)
                    diloco.optimizer.step()
                    mine = np.concatenate([to_host(p.data).ravel() for p in trained])
                    every = np.empty((4, mine.size), dtype=mine.dtype)
                    mpi(dist.world(), "Allgather", mine, every)
                    diloco.inner_steps += 1
                    diloco.outer_step()
                else:
                    diloco.step()
        delta = (start[None, :] - every).mean(axis=0)
        momentum = 0.9 * momentum + delta
        start = start - 0.7 * (delta + 0.9 * momentum)
        got = np.concatenate([to_host(p.data).ravel() for p in trained])
        assert_matches_serial(got, start, 4, case.what(f"after outer step {outer + 1}, the parameters"))
        sent = int(stats.sent("all_reduce"))
        assert 0 < sent <= 2 * 4 * start.size, case.what(
            f"the outer step sent {sent} bytes: one all-reduce of the {start.size} trainable parameters' deltas "
            "per H steps, none in the inner steps"
        )
    assert np.array_equal(to_host(model.wpe.weight.data), frozen), case.what("a frozen parameter moved")


# --- the servers with a parameter unused on one rank (after their main tests: those diagnose first) --


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("ParameterServer", marks=pytest.mark.task("2.4")),
        pytest.param("AsyncParameterServer", marks=pytest.mark.task("2.5")),
    ],
)
def test_a_server_takes_a_parameter_without_gradient_on_one_rank(impl, kind):
    _no_gradient_on_rank_3(impl, kind)
