"""The seed of a graded test: drawn when the test runs, so hard-coded outputs cannot pass.

Rank 0 draws it and every rank of the test's world agrees on it, so all ranks build the same
inputs. A failure message names the seed; ``TINYTRAIN_GRADER_SEED=<seed>`` replays that run.
"""

from __future__ import annotations

import os
import secrets


def grading_seed() -> int:
    """A fresh seed (or ``TINYTRAIN_GRADER_SEED``), the same on every rank."""
    fixed = os.environ.get("TINYTRAIN_GRADER_SEED")
    mine = int(fixed) if fixed else secrets.randbits(31)
    from tinytrain import distributed as dist

    if not dist.is_initialized():
        return mine
    # Agreeing on a Python int is test plumbing, not a collective we teach: MPI's bcast is fine.
    return int(dist.world().comm.bcast(mine, root=0))
