"""The ring all-reduce, from point-to-point sends: what comm.all_reduce asks NCCL or gloo to do.

    python -m pytest tests/test_comm.py -k ring
    See it explained:   notebooks/00_communication.ipynb (exchange by exchange: lab/stepthrough.py)

Teaching only: no stage uses it. It sums like comm.all_reduce(op="sum") and passes through
comm.issue like every collective (tallied as "ring_all_reduce", the bytes it sends).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minizero import comm, events


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over ranks in place with the ring algorithm, using only send/recv.

    The tensor is cut into N chunks. Ranks sit on a ring; each talks only to its two neighbours.
      Phase 1, reduce-scatter (N-1 steps): at step s, rank r sends chunk (r - s) to rank r+1 and
        adds the chunk (r - s - 1) it receives from rank r-1 into its own copy. After N-1 steps
        rank r holds the complete sum of chunk (r + 1).
      Phase 2, all-gather (N-1 steps): the same rotation, but the received chunk *replaces* the
        local one, so the finished sums travel once around the ring.
    Each rank sends 2(N-1) chunks of S/N bytes: 2(N-1)/N * S, independent of N for large N. That is
    why the ring is bandwidth-optimal, and comm's tally's unit.
    """
    n, r = comm.world_size(), comm.rank()
    if n == 1:
        return tensor
    flat = tensor.reshape(-1)                                   # a view when contiguous
    chunk = -(-flat.numel() // n)                               # ceil(S / N)
    padded = torch.zeros(chunk * n, dtype=flat.dtype, device=flat.device)  # [N * chunk]
    padded[: flat.numel()].copy_(flat)
    chunks = padded.view(n, chunk)                              # chunks[i]: [chunk]
    incoming = torch.empty(chunk, dtype=flat.dtype, device=flat.device)
    right, left = (r + 1) % n, (r - 1) % n

    def exchange(send_idx: int) -> None:
        events.emit("ring exchange", buffer=padded, send=send_idx)     # [N * chunk], before it
        # send and receive posted together, so that neither neighbour waits on the other
        ops = [dist.P2POp(dist.isend, chunks[send_idx], right),
               dist.P2POp(dist.irecv, incoming, left)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    for s in range(n - 1):                                      # phase 1: reduce-scatter
        exchange((r - s) % n)
        chunks[(r - s - 1) % n] += incoming
    for s in range(n - 1):                                      # phase 2: all-gather
        exchange((r + 1 - s) % n)
        chunks[(r - s) % n].copy_(incoming)
    # booked as every collective is (the tally, the event stream): the 2(N-1) chunks it sent
    comm.issue("ring_all_reduce", padded, None, "ring all-reduce", False, lambda: None,
               sent=2 * (n - 1) * chunk * flat.element_size())
    flat.copy_(padded[: flat.numel()])
    if flat.data_ptr() != tensor.data_ptr():                    # non-contiguous input: write back
        tensor.copy_(flat.view_as(tensor))
    return tensor
