"""The harness gives every rank its own root for ``tmp_path`` (``grader/mpi_plugin.py``)."""

from __future__ import annotations

import pytest

from tinytrain import distributed as dist


@pytest.mark.world_size(4)
def test_every_rank_tidies_its_own_temp_root(tmp_path_factory):
    """pytest tidies its temp root as the session ends (old numbered folders, the pytest-current
    link); four ranks tidying one root raced, and one rank's failed unlink ended a green run."""
    root = tmp_path_factory.getbasetemp().parent.parent  # <root>/pytest-of-<user>/pytest-N
    roots = dist.world().comm.allgather(str(root))
    assert len(set(roots)) == 4, roots
    assert root.name.endswith(f"rank{dist.get_rank()}"), root
