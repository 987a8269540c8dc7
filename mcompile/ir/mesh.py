"""Named device meshes (DESIGN §3).

``Mesh(dp=2, tp=2)``: named axes, ranks row-major over the axes as written (the last axis varies
fastest, so write ``tp`` last to keep it on neighbouring devices). ``Mesh.fake(...)`` is the same
description with no processes behind it, for planning at any scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum


class Axis(StrEnum):
    DP = "dp"
    PP = "pp"
    CP = "cp"
    EP = "ep"
    TP = "tp"


KNOWN_AXES = tuple(a.value for a in Axis)


@dataclass(frozen=True)
class Mesh:
    """An ordered set of named mesh axes. ``Mesh(dp=8, tp=8)``."""

    axes: tuple[tuple[str, int], ...]
    fake_mesh: bool = field(default=False, compare=False)

    def __init__(self, _axes=None, /, **sizes: int):
        if _axes is not None:
            sizes = dict(_axes)
        if not sizes:
            raise ValueError("a Mesh needs at least one axis, e.g. Mesh(tp=2) or Mesh(dp=2, tp=2)")
        for name, n in sizes.items():
            if name not in KNOWN_AXES:
                raise ValueError(f"unknown mesh axis {name!r}; known axes: {', '.join(KNOWN_AXES)}")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"mesh axis {name}={n!r} must be a positive integer")
        object.__setattr__(self, "axes", tuple(sizes.items()))
        object.__setattr__(self, "fake_mesh", False)

    @classmethod
    def fake(cls, **sizes: int) -> Mesh:
        """A mesh for planning only: no process group, no devices (any size)."""
        m = cls(**sizes)
        object.__setattr__(m, "fake_mesh", True)
        return m

    @classmethod
    def parse(cls, text: str, fake: bool = False) -> Mesh:
        """``"dp=8,tp=8"`` -> Mesh(dp=8, tp=8)."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, eq, value = part.partition("=")
            if not eq or not value.strip().isdigit():
                raise ValueError(f"cannot parse mesh {text!r}: write axis=size pairs like dp=8,tp=8")
            name = name.strip()
            if name in sizes:  # "tp=2,tp=4" would silently keep the last one
                raise ValueError(f"mesh {text!r} gives axis {name!r} twice ({name}={sizes[name]} and {name}="
                                 f"{int(value)}): give each axis once, e.g. {name}={int(value)}")
            sizes[name] = int(value)
        return cls.fake(**sizes) if fake else cls(**sizes)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.axes)

    def size(self, axis: str | None = None) -> int:
        if axis is None:
            return math.prod(self.shape)
        return dict(self.axes).get(axis, 1)

    def __getitem__(self, axis: str) -> int:
        return self.size(axis)

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` along each axis (row-major, last axis fastest)."""
        if not 0 <= rank < self.size():
            raise ValueError(f"rank {rank} is outside a mesh of {self.size()} ranks")
        out = {}
        for name, n in reversed(self.axes):
            out[name] = rank % n
            rank //= n
        return {a: out[a] for a in self.axis_names}

    def rank_of(self, **coords: int) -> int:
        r = 0
        for name, n in self.axes:
            r = r * n + coords.get(name, 0)
        return r

    def group_ranks(self, axis: str) -> list[list[int]]:
        """All groups of global ranks that vary only along ``axis``."""
        groups: dict[tuple, list[int]] = {}
        for r in range(self.size()):
            c = self.coords(r)
            key = tuple(v for a, v in c.items() if a != axis)
            groups.setdefault(key, []).append(r)
        return list(groups.values())

    def __repr__(self) -> str:
        inner = ", ".join(f"{a}={n}" for a, n in self.axes)
        return f"Mesh.fake({inner})" if self.fake_mesh else f"Mesh({inner})"

    def spec(self) -> str:
        return ",".join(f"{a}={n}" for a, n in self.axes)


def check_sequence(seq: int, cp: int) -> None:
    """The load-balanced layout cuts the sequence into 2*cp equal chunks (rank r holds r and 2cp-1-r)."""
    if seq % (2 * cp):
        raise ValueError(f"context parallelism over cp={cp} cuts each sequence into 2*cp = {2 * cp} equal chunks "
                         f"(load-balanced causal attention): the sequence length {seq} does not divide by {2 * cp}; "
                         f"use a multiple of {2 * cp} (pad the batch)")
