"""Every receive checks what arrived (issue 17): ranks that call a collective with different sizes or
dtypes get an error in words on the rank that saw it, not garbage, with the debug signature check off.

Too few bytes arriving is caught by comparing MPI's count with the buffer; too many is MPI's
"Message truncated", re-raised with the operation, step, both ranks, sizes and the caller's line.
What the check costs is measured by ``tinytrain bench collectives --receive-check`` (tested in
test_strict_device.py, on device buffers).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from tinytrain import distributed as dist
from tinytrain.distributed.p2p import CommError, MessageSizeMismatch


@pytest.fixture
def no_debug(monkeypatch):
    """Default settings: the signature cross-check (on in tests) is off, as in a user's run; and no
    signature in the tags either (as on an MPI with few tag bits), so that the receive check alone
    catches what these tests do. (With the tags' signature: test_signature_in_the_tags_names_both_calls.)"""
    from tinytrain.distributed import work

    monkeypatch.setenv("TINYTRAIN_DEBUG", "0")
    monkeypatch.setattr(work, "_SIG_BITS", 0)


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    "case",
    ["float64", "max", "count", "all_gather"],
)
def test_signature_in_the_tags_names_both_calls(monkeypatch, case):
    """Without debug mode, a rank that calls something else (dtype, reduce op, size, operation,
    size) is named with both calls by the waiting rank that finds its message (work.py). (A wrong
    root alone may leave no rank waiting for a message of another signature: the deadline, or debug
    mode, names that one.)"""
    monkeypatch.setenv("TINYTRAIN_DEBUG", "0")
    r = dist.get_rank()
    odd = r == 1
    x = np.ones(8, dtype=np.float64 if odd and case == "float64" else np.float32)
    if case == "count" and odd:
        x = np.ones(16, dtype=np.float32)
    # what the message must say, in any order (the rank that tells may be either of the two)
    expected = {
        "float64": [r"rank 1 called all_reduce\(op=sum, float64\)", r"rank 0 called all_reduce\(op=sum, float32\)",
                    r"differ in dtype\b"],
        "max": [r"rank 1 called all_reduce\(op=max, float32\)", r"rank 0 called all_reduce\(op=sum, float32\)",
                r"differ in reduce op\b"],
        "count": [r"rank 1 called all_reduce\(op=sum, float32\)", r"differ in element count\b"],
        "all_gather": [r"rank 1 called all_gather\(float32\)", r"differ in operation\b"],
    }[case]  # fmt: skip

    def call():
        if case == "max":
            dist.all_reduce(x, op="max" if odd else "sum")
        elif case == "all_gather":
            dist.all_gather(x) if odd else dist.all_reduce(x)
        else:
            dist.all_reduce(x)

    with pytest.raises(dist.DistributedError) as err:
        call()
    if isinstance(err.value, dist.CollectiveMismatch):
        dist.report_failure(f"CollectiveMismatch: {err.value}")  # what an uncaught error does
        assert f"rank {r} called" in str(err.value)  # it names its own call, and the other one
    else:  # a rank that waited behind the two: it hears of the mismatch from one of them
        assert isinstance(err.value, dist.PeerFailure), err.value
    assert "collective mismatch on group world" in str(err.value), str(err.value)
    for pattern in expected:
        assert re.search(pattern, str(err.value)), (pattern, str(err.value))


@pytest.mark.world_size(4)
def test_one_rank_on_float64_fails_in_words_and_the_others_hear_of_it(no_debug):
    """Issue 17's case: rank 1 all_reduces float64, the others float32 (recursive doubling:
    round 1 pairs 0-1 and 2-3, round 2 pairs 0-2 and 1-3)."""
    r = dist.get_rank()
    x = np.ones(8, dtype=np.float64 if r == 1 else np.float32)
    if r in (0, 1):
        with pytest.raises(MessageSizeMismatch) as err:
            dist.all_reduce(x)
        dist.report_failure(f"{err.type.__name__}: {err.value}")  # what an uncaught error does
        text = str(err.value)
        peer = 1 - r
        assert f"rank {r} recv from rank {peer}" in text and "all_reduce" in text and "recursive doubling" in text
        if r == 0:  # 32 bytes (8 float32) expected, 64 sent: MPI's "Message truncated"
            assert "truncated" in text and "Rank 1 sent more than the 32 bytes this rank expected (8 x float32" in text
        else:  # rank 1 expected 64 bytes; rank 0 sent 32 bytes
            assert "32 bytes arrived, but this rank expected 64 bytes (8 x float64" in text
        assert "test_checked_receives.py" in text  # the caller's line
    else:
        with pytest.raises(dist.PeerFailure, match="MessageSizeMismatch"):
            dist.all_reduce(x)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("poll", ["get_status_all", "testall"])
def test_point_to_point_too_long_and_too_short(no_debug, poll, monkeypatch):
    """Both ways a step polls: MPI_Request_get_status_all, and Testall where MPI lacks it (< 4.1)."""
    from tinytrain.distributed import p2p

    if poll == "testall":
        monkeypatch.setattr(p2p, "_all_complete", None)
    r = dist.get_rank()
    first, second = dist.new_group([0, 1], name="first"), dist.new_group([0, 1], name="second")
    if r == 0:
        dist.send(np.arange(10.0), 1, group=first)
        dist.send(np.arange(3.0), 1, group=second)
        return
    with pytest.raises(MessageSizeMismatch, match=r"rank 1 recv from rank 0 .*MPI failed: .*truncated") as err:
        dist.recv(np.zeros(5), 0, group=first)  # 10 floats into 5
    assert "Rank 0 sent more than the 40 bytes this rank expected (5 x float64" in str(err.value)
    assert isinstance(err.value, CommError)
    with pytest.raises(dist.DistributedError, match="unusable after an earlier MessageSizeMismatch"):
        dist.recv(np.zeros(5), 0, group=first)  # its messages may still be in flight
    with pytest.raises(MessageSizeMismatch, match="24 bytes arrived, but this rank expected 40 bytes"):
        dist.recv(np.zeros(5), 0, group=second)


@pytest.mark.world_size(3)
def test_all_gather_with_a_wrong_row_count_names_the_step(no_debug):
    r = dist.get_rank()
    x = np.full((3 if r == 2 else 2, 4), float(r), dtype=np.float32)
    with pytest.raises((MessageSizeMismatch, dist.PeerFailure)) as err:
        try:
            dist.all_gather(x)
        except MessageSizeMismatch as exc:
            dist.report_failure(f"MessageSizeMismatch: {exc}")
            raise
    if isinstance(err.value, MessageSizeMismatch):
        assert "ring all-gather step" in str(err.value) and "float32" in str(err.value)


def test_debug_signatures_of_many_ranks_fit_their_message():
    """On 64 ranks an all_gather's sizes list passed the 512 bytes of the debug exchange and was cut:
    the JSON no longer parsed (``python -m grader --ranks 64`` scored the reference 0). Long lists
    travel as a digest, equal exactly when the lists are."""
    import json

    from tinytrain.distributed import work

    def sig(sizes):
        return work._fitting({"shape": [3, 4], "dtype": "float32", "sizes": sizes, "op": "all_gather", "seq": 7})

    many = list(range(100000, 100064))  # rows per rank of 64 ranks
    assert len(json.dumps({"sizes": many})) > work._SIG_BYTES  # the case that broke
    assert len(json.dumps(sig(many))) <= work._SIG_BYTES
    assert sig(many) == sig(list(many)) and sig(many) != sig(many[:-1] + [0])
    assert sig([1, 2]) == {"shape": [3, 4], "dtype": "float32", "sizes": [1, 2], "op": "all_gather", "seq": 7}
    assert "shape=(3, 4)" in work._fmt_sig(sig(many)) and "64 values" in work._fmt_sig(sig(many))
