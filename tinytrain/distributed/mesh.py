"""The named device mesh: ranks arranged on a grid with named axes, and one group per axis.

``DeviceMesh({"dp": 2, "pp": 2, "tp": 2})`` gives every rank its coordinates and, for each axis, the
group of ranks that differ from it only along that axis (``mesh.get_group("tp")``). The parallel
strategies each take one of those groups; ``tinytrain.parallel.hybrid`` composes them on one mesh.
"""

from __future__ import annotations

import itertools
import math

from .group import ProcessGroup, _subgroup, resolve


class DeviceMesh:
    """Ranks arranged on named axes, e.g. ``DeviceMesh({"dp": 2, "tp": 2})``.

    Order: the *last* axis is innermost (row-major, like a NumPy array of ranks), so with
    ``{"dp": 2, "tp": 2}``::

                  tp=0  tp=1
        dp=0  ->  rank 0  rank 1        rank = dp_index * tp_size + tp_index
        dp=1  ->  rank 2  rank 3

    Ranks next to each other (on one node, with fast links) share a TP group, which is what tensor
    parallelism wants; DP groups stride across them. Launchers place consecutive ranks on a node
    (so does the emulated topology, ``topology.py``), so a TP group of up to a node's ranks never
    leaves its node: with 2 nodes of 4, ``{"dp": 2, "tp": 4}`` gives TP groups [0 1 2 3] and
    [4 5 6 7] (:func:`axis_groups` lists them without building the mesh). Every rank must
    construct the mesh.
    """

    def __init__(self, shape: dict[str, int], group=None):
        base = resolve(group)
        if not shape:
            raise ValueError("DeviceMesh needs at least one axis, e.g. {'dp': 2, 'tp': 2}")
        for axis, size in shape.items():
            if int(size) < 1:
                raise ValueError(f"mesh axis {axis!r} has size {size}; sizes must be >= 1")
        self.shape = {axis: int(size) for axis, size in shape.items()}
        self.axis_names = tuple(self.shape)
        total = math.prod(self.shape.values())
        if total != base.size:
            raise ValueError(
                f"DeviceMesh {self.shape} needs {total} ranks but {base.describe()} has {base.size}; "
                f"run with mpirun -n {total} or change the mesh so its sizes multiply to {base.size}."
            )
        self.base = base
        self.rank = base.rank
        self.coords = self.coords_of(base.rank)
        self._groups = {}
        for axis in self.axis_names:  # same order on every rank, so group creation matches up
            self._groups[axis] = _subgroup(base, _members(self.shape, self.coords, axis), axis)

    def coords_of(self, rank: int) -> dict[str, int]:
        """The coordinates of a rank of the mesh's base group."""
        return _coords(self.shape, rank)

    def rank_at(self, **coords) -> int:
        """The rank at the given coordinates (all axes must be given)."""
        return _rank_at(self.shape, coords)

    def get_group(self, *axes: str) -> ProcessGroup:
        """The group of ranks that differ from this one only along ``axes``: one axis, or several
        flattened in mesh order (``get_group("dp", "cp")``: every replica and context shard of
        this rank's other coordinates). A flattened group is built on first use, so every rank
        must ask for it at the same point."""
        unknown = [a for a in axes if a not in self.shape]
        if not axes or unknown:
            raise ValueError(f"mesh has axes {list(self.axis_names)}, not {', '.join(map(repr, unknown)) or 'none'}")
        key = tuple(a for a in self.axis_names if a in axes)
        name = key[0] if len(key) == 1 else "x".join(key)
        if name not in self._groups:
            members = sorted(
                self.rank_at(**{**self.coords, **dict(zip(key, index))})
                for index in itertools.product(*(range(self.shape[a]) for a in key))
            )
            self._groups[name] = _subgroup(self.base, members, name)
        return self._groups[name]

    def size(self, axis: str) -> int:
        return self.shape[axis]

    def coordinate(self, axis: str) -> int:
        return self.coords[axis]

    def ring(self, axis: str) -> tuple[int, int]:
        """(previous, next) neighbour of this rank on ``axis``, as ranks of that axis's group."""
        n, i = self.shape[axis], self.coords[axis]
        return (i - 1) % n, (i + 1) % n

    def __repr__(self) -> str:
        return f"DeviceMesh({self.shape}, rank={self.rank}, coords={self.coords})"


def _coords(shape: dict[str, int], rank: int) -> dict[str, int]:
    coords = {}
    for axis in reversed(tuple(shape)):
        coords[axis] = rank % shape[axis]
        rank //= shape[axis]
    return {axis: coords[axis] for axis in shape}


def _rank_at(shape: dict[str, int], coords: dict[str, int]) -> int:
    rank = 0
    for axis in shape:
        rank = rank * shape[axis] + int(coords[axis])
    return rank


def _members(shape: dict[str, int], coords: dict[str, int], axis: str) -> list[int]:
    """The ranks that differ from ``coords`` only along ``axis``, in order along it."""
    return [_rank_at(shape, {**coords, axis: i}) for i in range(shape[axis])]


def axis_groups(shape: dict[str, int], axis: str) -> list[list[int]]:
    """Every group of ``axis`` in a mesh of ``shape`` (ranks of its base group), without building
    it: ``axis_groups({"dp": 2, "tp": 2}, "tp") == [[0, 1], [2, 3]]``."""
    groups = []
    for rank in range(math.prod(shape.values())):
        members = _members(shape, _coords(shape, rank), axis)
        if members not in groups:
            groups.append(members)
    return groups
