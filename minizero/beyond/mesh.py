"""The 2-D mesh of ranks: rows of S consecutive ranks and the columns across them.

    python -m pytest tests/test_hsdp.py tests/test_mesh.py
    shard, replicate = mesh(2)        # this rank's row and column, as comm.Group objects

The paper's ZeRO partitions over all N ranks (group=None in every collective of comm.py). The
designs after it cut the N ranks into a mesh and give each axis a job: HSDP / MiCS shard within a
row and replicate across the columns (hierarchical.py); tensor parallelism splits each block over a
row and ZeRO shards along the columns (tensor_parallel.py); ZeRO++'s hpZ gathers within a row, a
node (hpz.py). Every rank creates every group (dist.new_group is collective), then keeps its own.
"""

from __future__ import annotations

from minizero import comm


def mesh(size: int) -> tuple[comm.Group, comm.Group]:
    """Cut the N ranks into N/S rows of S = size consecutive ranks: this rank's (row, column). With
    S ranks per node a row is one node, so the row's collectives stay inside it."""
    n = comm.world_size()
    row = row_group(size)
    columns = [comm.Group(column_of(index, size, n)) for index in range(size)]
    return row, columns[comm.rank() % size]


def row_group(size: int) -> comm.Group:
    """This rank's row of `size` consecutive ranks, alone (hpZ's node group needs no columns)."""
    n = comm.world_size()
    if size < 1 or n % size:
        raise ValueError(f"a shard group of {size} ranks does not divide the world size {n}")
    rows = [comm.Group(row_of(start, size)) for start in range(0, n, size)]
    return rows[comm.rank() // size]


def row_of(r: int, size: int) -> list[int]:
    """Rank r's row: the `size` consecutive ranks it shards with (its node when size = R)."""
    start = r // size * size
    return list(range(start, start + size))


def column_of(r: int, size: int, n: int) -> list[int]:
    """Rank r's column: one rank of each row, the ranks that hold the same partition."""
    return list(range(r % size, n, size))
